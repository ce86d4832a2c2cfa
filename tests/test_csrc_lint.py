"""Invariants of the C sources that a compiler does not check."""
import os
import re

CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")


def sources():
    for name in sorted(os.listdir(CSRC)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(CSRC, name)) as f:
                yield name, f.read()


def test_only_bindings_include_python():
    for name, text in sources():
        uses_python = re.search(r'#include\s+[<"](Python\.h|py_mpcore\.h|numpy/)', text)
        assert bool(uses_python) == name.startswith("py_"), name


def test_gil_released_and_taken_back_in_pairs():
    for name, text in sources():
        begins = len(re.findall(r"\bPy_BEGIN_ALLOW_THREADS\b", text))
        ends = len(re.findall(r"\bPy_END_ALLOW_THREADS\b", text))
        assert begins == ends, f"{name}: {begins} Py_BEGIN_ALLOW_THREADS, {ends} Py_END"


def test_every_file_says_what_it_owns():
    for name, text in sources():
        assert text.lstrip().startswith("/*"), f"{name} has no header comment"


def test_every_core_function_has_a_contract():
    # Each function declared in the core's header has a comment just above
    # its declaration (or above the group it belongs to) saying what it does
    # and what happens on failure.
    with open(os.path.join(CSRC, "mpcore.h")) as f:
        lines = f.read().split("\n")
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^[a-z_][\w ]*\*?\s*\**(mpc_\w+)\(", line)
        if not m or line.startswith(("typedef", "#")):
            continue
        j = i - 1
        while j >= 0 and (re.match(r"^[a-z_][\w ]*\*?\s*\**mpc_\w+\(", lines[j])
                          or lines[j].startswith(" ") and not lines[j].strip().startswith("*")):
            j -= 1  # a group of declarations under one comment
        if not (lines[j].rstrip().endswith("*/") or lines[j].strip().startswith("*")):
            missing.append(m.group(1))
    assert not missing, f"functions without a contract comment in mpcore.h: {missing}"
