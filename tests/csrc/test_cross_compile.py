"""The C core compiles for aarch64, warnings as errors.

Each csrc/*.c is compiled to an object file (no link) with Debian's
cross compiler, aarch64-linux-gnu-gcc (`make test` installs it), with the
flags setup.py builds the core with, -Werror added.  The reduction kernels
must still be vectorised there (NEON), and the x86-64 build must keep its
AVX-512 and AVX2 clones of them.

NOTE [ Python's headers in a cross build ]
The core includes Python.h and numpy's headers, taken here from the
interpreter that runs the test and from its numpy, both built for this
machine.  Most of them are the same for every architecture; what is not is
the configuration each generates (pyconfig.h, numpy's _numpyconfig.h): the
sizes and alignments of C types, and the byte order.  Both x86-64 and
aarch64 Linux are little-endian LP64, so these agree, and
test_python_headers_fit_aarch64 proves it by asserting every such figure
with the cross compiler.  pyconfig.h's HAVE_GCC_ASM_FOR_X87/X64 are read
only by CPython's internal headers (Py_BUILD_CORE), which an extension
never includes.  Debian's libpython3-dev:arm64 would give aarch64's own
pyconfig.h, but only for Debian's Python and only after adding a foreign
architecture to dpkg; the checked figures stand in for it.
"""
import os
import platform
import re
import runpy
import shutil
import subprocess
import sys
import sysconfig
from glob import glob

import pytest

from helpers import require

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CC = "aarch64-linux-gnu-gcc"
OBJDUMP = "aarch64-linux-gnu-objdump"
SOURCES = sorted(os.path.basename(p) for p in glob(os.path.join(ROOT, "csrc", "*.c")))
EM_AARCH64 = 183


def _cross_compiler():
    path = shutil.which(CC)
    require(path is not None,
            f"{CC} is not installed (apt-get install gcc-aarch64-linux-gnu; make test does)")
    return path


@pytest.fixture(scope="module")
def core_extension():
    """setup.py's Extension for the core, with the release flags (neither
    MPCORE_DEBUG nor MPCORE_ASAN), its sources found from the project root."""
    saved = {k: os.environ.pop(k) for k in ("MPCORE_DEBUG", "MPCORE_ASAN") if k in os.environ}
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        ext = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="mpcore_setup")["core_extension"]()
    finally:
        os.chdir(cwd)
        os.environ.update(saved)
    return ext


def _flags(ext):
    """What setuptools passes the compiler for ext, as it builds the core
    here: the interpreter's CFLAGS and CCSHARED (less machine options of the
    host's compiler, -m...), the include dirs and macros, then the
    extension's own flags; -Werror last."""
    base = (sysconfig.get_config_var("CFLAGS") or "").split()
    base += (sysconfig.get_config_var("CCSHARED") or "").split()
    flags = [f for f in base if not f.startswith("-m")]
    flags += [f"-D{name}" if value is None else f"-D{name}={value}"
              for name, value in ext.define_macros]
    includes = [d if os.path.isabs(d) else os.path.join(ROOT, d) for d in ext.include_dirs]
    includes += [sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]]
    flags += [f"-I{d}" for d in dict.fromkeys(includes)]
    return flags + list(ext.extra_compile_args) + ["-Werror"]


def _compile(source, obj, flags, cwd=ROOT):
    r = subprocess.run([_cross_compiler(), *flags, "-c", source, "-o", obj],
                       capture_output=True, text=True, cwd=cwd, timeout=300)
    assert r.returncode == 0, f"{CC} failed on {source}:\n{r.stderr[-6000:]}"
    assert not r.stderr.strip(), f"{CC} said something about {source}:\n{r.stderr[-6000:]}"
    return obj


def _elf_machine(path):
    with open(path, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(head[18:20], "little")


def test_setup_builds_every_source(core_extension):
    # The files compiled below are the ones the core is built from.
    assert sorted(os.path.basename(s) for s in core_extension.sources) == SOURCES
    assert "coll_kernels.c" in SOURCES and "py_core.c" in SOURCES


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_aarch64(source, core_extension, tmp_path):
    obj = _compile(os.path.join("csrc", source), str(tmp_path / (source[:-2] + ".o")),
                   _flags(core_extension))
    assert _elf_machine(obj) == EM_AARCH64


# Every size and alignment the headers' configuration states, and the C
# expression it must equal (a macro that is not here fails the test, so
# that a new one is looked at, not passed over).
_TYPES = {
    "DOUBLE": "double", "FLOAT": "float", "FPOS_T": "fpos_t", "INT": "int", "LONG": "long",
    "LONG_DOUBLE": "long double", "LONGDOUBLE": "long double", "LONG_LONG": "long long",
    "LONGLONG": "long long", "PY_LONG_LONG": "long long", "OFF_T": "off_t", "PID_T": "pid_t",
    "PTHREAD_KEY_T": "pthread_key_t", "PTHREAD_T": "pthread_t", "SHORT": "short",
    "SIZE_T": "size_t", "TIME_T": "time_t", "UINTPTR_T": "uintptr_t", "VOID_P": "void *",
    "WCHAR_T": "wchar_t", "_BOOL": "_Bool", "MAX_ALIGN_T": "max_align_t",
    "COMPLEX_FLOAT": "float _Complex", "COMPLEX_DOUBLE": "double _Complex",
    "COMPLEX_LONGDOUBLE": "long double _Complex", "PY_INTPTR_T": "intptr_t",
    "INTP": "intptr_t", "UINTP": "uintptr_t",
}


def _config_asserts(path, prefix):
    """_Static_assert lines for every #define <prefix>SIZEOF_x / ALIGNOF_x n
    in the header at path; fails on a type not in _TYPES."""
    with open(path) as f:
        text = f.read()
    found = re.findall(rf"^#define {prefix}(SIZEOF|ALIGNOF)_(\w+) (\d+)\s*$", text, re.M)
    unknown = sorted({name for _, name, _ in found if name not in _TYPES})
    assert not unknown, f"{path} states figures this test does not know: {unknown}"
    out = []
    for kind, name, value in found:
        op = "sizeof" if kind == "SIZEOF" else "_Alignof"
        macro = f"{prefix}{kind}_{name}"
        out.append(f'_Static_assert({op}({_TYPES[name]}) == {macro}, "{macro} is {value} here");')
    return out


@pytest.mark.timeout(120)
def test_python_headers_fit_aarch64(core_extension, tmp_path):
    # NOTE [ Python's headers in a cross build ]
    import numpy
    pyconfig = os.path.join(sysconfig.get_paths()["platinclude"], "pyconfig.h")
    npconfig = os.path.join(numpy.get_include(), "numpy", "_numpyconfig.h")
    asserts = _config_asserts(pyconfig, "") + _config_asserts(npconfig, "NPY_")
    assert len(asserts) >= 30, asserts
    src = tmp_path / "fit.c"
    src.write_text("\n".join([
        "#include <Python.h>", "#include <numpy/ndarraytypes.h>",
        "#include <pthread.h>", "#include <stddef.h>", "#include <stdint.h>",
        "#include <stdio.h>", "#include <sys/types.h>", "#include <time.h>", "#include <wchar.h>",
        *asserts,
        "#if !defined(__aarch64__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__",
        '#error "not a little-endian aarch64 compiler"',
        "#endif",
        "#if defined(WORDS_BIGENDIAN) || NPY_BYTE_ORDER != NPY_LITTLE_ENDIAN",
        '#error "the headers say big-endian"',
        "#endif",
        "",
    ]))
    obj = _compile(str(src), str(tmp_path / "fit.o"), _flags(core_extension))
    assert _elf_machine(obj) == EM_AARCH64


@pytest.mark.timeout(300)
def test_reductions_use_neon_on_aarch64(core_extension, tmp_path):
    # NOTE [ Reduction kernels on each architecture ] in csrc/coll_kernels.c:
    # one build there, vectorised with Advanced SIMD.
    require(shutil.which(OBJDUMP) is not None, f"{OBJDUMP} is not installed (binutils-aarch64-linux-gnu)")
    obj = _compile(os.path.join("csrc", "coll_kernels.c"), str(tmp_path / "coll_kernels.o"),
                   _flags(core_extension))
    asm = subprocess.run([OBJDUMP, "-d", obj], capture_output=True, text=True, timeout=120).stdout
    # a float sum four lanes at a time, a double sum two at a time
    assert re.search(r"\tfadd\tv\d+\.4s", asm), "no vectorised float add in coll_kernels.o"
    assert re.search(r"\tfadd\tv\d+\.2d", asm), "no vectorised double add in coll_kernels.o"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the clones are x86-64's")
def test_x86_build_keeps_its_clones():
    # The installed core has an AVX-512, an AVX2 and a baseline build of each
    # reduction kernel, chosen at load (NOTE [ Reduction kernels on each
    # architecture ]).
    from mpcore import _core
    require(shutil.which("nm") is not None, "nm (binutils) is not installed")
    r = subprocess.run(["nm", _core.__file__], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    names = set(re.findall(r"\s(\S+)$", r.stdout, re.M))
    require(names, f"{_core.__file__} has no symbol table (stripped)")
    for kernel in ("f32_sum", "f64_sum", "i64a_sum", "f32_to_bf16"):
        for clone in ("arch_x86_64_v4", "arch_x86_64_v3", "default"):
            assert f"{kernel}.{clone}" in names, (kernel, clone)


def test_only_the_kernels_have_cpu_specific_code():
    # NOTE [ Reduction kernels on each architecture ]: of the collectives'
    # files, coll_kernels.c alone names a CPU or builds for one; the rest is
    # plain C, and the kernels have a path for every other CPU (no clones).
    cpu = re.compile(r"target_clones|__attribute__\s*\(\(\s*target\b|__x86_64__|__aarch64__|"
                     r"__i386__|immintrin|arm_neon|__builtin_ia32")
    found = {}
    for path in sorted(glob(os.path.join(ROOT, "csrc", "coll*"))):
        with open(path) as f:
            if cpu.search(f.read()):
                found[os.path.basename(path)] = True
    assert list(found) == ["coll_kernels.c"], found
    with open(os.path.join(ROOT, "csrc", "coll_kernels.c")) as f:
        text = f.read()
    assert re.search(r"#if defined\(__x86_64__\)\n#define CLONES .*\n#else\n#define CLONES\n#endif",
                     text), "the clones' switch and its portable branch"
