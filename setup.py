"""Build of mpcore's C core (mpcore._core).

MPCORE_DEBUG=1 builds without optimisation and with assertions;
MPCORE_ASAN=1 adds AddressSanitizer.

What an sdist carries beyond the packages is listed in MANIFEST.in
(pkg/mpcore.pth and the headers among them: a wheel is built from it).
The core's Extension is made by core_extension(), which
tests/csrc/test_cross_compile.py also reads, so that its aarch64 build uses
these very flags; setup() runs only when this file is run as a script
(as pip and build run it).
"""
import os
import sys
from glob import glob

import numpy
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

if not sys.platform.startswith("linux"):
    raise SystemExit("mpcore supports Linux only")

extra_compile = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                 "-Wno-missing-field-initializers", "-fvisibility=hidden",
                 # An API the interpreter lacks fails the build, not the import.
                 "-Werror=implicit-function-declaration"]
extra_link = []
if os.environ.get("MPCORE_DEBUG"):
    extra_compile += ["-O0", "-g", "-UNDEBUG"]
else:
    extra_compile += ["-O3"]
if os.environ.get("MPCORE_ASAN"):
    extra_compile += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    extra_link += ["-fsanitize=address"]


class build_py_with_pth(build_py):
    """Also install mpcore.pth, which lets `mpcore run` reach every process
    its program starts (it does nothing unless MPCORE_RUN is set)."""

    def run(self):
        super().run()
        self.copy_file("pkg/mpcore.pth", os.path.join(self.build_lib, "mpcore.pth"),
                       preserve_mode=0)


def core_extension():
    """The C core, mpcore._core."""
    return Extension(
        "mpcore._core",
        sources=sorted(glob("csrc/*.c")),
        depends=sorted(glob("csrc/*.h")),  # a changed header rebuilds every object
        include_dirs=["csrc", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION")],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
        libraries=["dl"],
    )


if __name__ == "__main__":
    setup(
        package_dir={"": "pkg", "mpcore.bench": "benchmarks"},
        packages=["mpcore", "mpcore.shm", "mpcore.queue", "mpcore.proc", "mpcore.data", "mpcore.dist",
                  "mpcore.run", "mpcore.bench"],
        ext_modules=[core_extension()],
        cmdclass={"build_py": build_py_with_pth},
    )
