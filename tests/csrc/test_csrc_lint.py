"""Invariants of the C sources that a compiler does not check."""
import os
import re

from helpers.layers import LONG

CSRC = os.environ.get("MPCORE_CSRC") or os.path.join(os.path.dirname(__file__), "..", "..", "csrc")
HEADERS = ("mpcore.h", "internal.h", "py_mpcore.h", "coll.h")

# What a contract says: what is returned, or what happens on failure.
CONTRACT = re.compile(r"\b[Rr]eturns?\b|\b[Nn]ever[\s*]+fail|-E[A-Z]{2,}|-MPC_E|\bNULL\b|\bno-op\b"
                      r"|-errno|\bexception set\b")


def sources():
    for name in sorted(os.listdir(CSRC)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(CSRC, name)) as f:
                yield name, f.read()


def _strip_comments_and_strings(text):
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def units(text):
    """(name, body) of each function definition and each #define of a
    source, comments and strings removed."""
    text = _strip_comments_and_strings(text)
    out = []
    # Macros first, then cut them out so that their braces do not count.
    for m in re.finditer(r"^#\s*define\s+(\w+)(?:[^\n]*\\\n)*[^\n]*", text, re.M):
        out.append(("macro " + m.group(1), m.group(0)))
    text = re.sub(r"^#[^\n]*(?:\\\n[^\n]*)*", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text,
                  flags=re.M)
    depth, start, name = 0, None, None
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                head = text[:i].rstrip()
                m = re.search(r"(\w+)\s*\([^()]*(?:\([^()]*\)[^()]*)*\)\s*$", head)
                name, start = (m.group(1) if m else None), i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0 and name:
                out.append((name, text[start:i + 1]))
                name = None
    return out


def test_only_bindings_include_python():
    for name, text in sources():
        uses_python = re.search(r'#include\s+[<"](Python\.h|py_mpcore\.h|numpy/)', text)
        assert bool(uses_python) == name.startswith("py_"), name


def test_only_the_core_includes_its_internal_header():
    for name, text in sources():
        if re.search(r'#include\s+"(internal|coll)\.h"', text):
            assert not name.startswith("py_"), f"{name}: bindings use mpcore.h only"


def test_gil_released_and_taken_back_in_pairs():
    # Per function (and per macro): every Py_BEGIN_ALLOW_THREADS has its
    # Py_END_ALLOW_THREADS, every PyEval_SaveThread its PyEval_RestoreThread.
    bad = []
    for name, text in sources():
        if not name.endswith(".c"):
            continue
        for fn, body in units(text):
            for a, b in (("Py_BEGIN_ALLOW_THREADS", "Py_END_ALLOW_THREADS"),
                         ("PyEval_SaveThread", "PyEval_RestoreThread")):
                na = len(re.findall(rf"\b{a}\b", body))
                nb = len(re.findall(rf"\b{b}\b", body))
                if na != nb:
                    bad.append(f"{name}: {fn} has {na} {a} and {nb} {b}")
    assert not bad, bad


def test_the_pair_counter_sees_unbalanced_code():
    # The check above must be able to fail.
    text = ("static int f(void) {\n    PyThreadState *t = PyEval_SaveThread();\n"
            "    if (x) { return 1; }\n    return 0;\n}\n"
            "static int g(void) {\n    Py_BEGIN_ALLOW_THREADS\n    Py_END_ALLOW_THREADS\n}\n")
    counts = {fn: (body.count("PyEval_SaveThread"), body.count("PyEval_RestoreThread"))
              for fn, body in units(text)}
    assert counts == {"f": (1, 0), "g": (0, 0)}


def test_every_file_says_what_it_owns():
    for name, text in sources():
        assert text.lstrip().startswith("/*"), f"{name} has no header comment"


_DECL_START = re.compile(r"^(?!typedef\b|#|extern\b|static\b|return\b)[A-Za-z_][\w \t\*]*?\b(\w+)\s*\(")


def _comment_before(lines, i, skip_group):
    """The text of the comment that ends on the line above line i (skipping,
    when skip_group, the declarations of the group above it), or None."""
    j = i - 1
    if skip_group:
        while j >= 0 and (_DECL_START.match(lines[j]) or
                          (lines[j].startswith((" ", "\t")) and
                           not lines[j].strip().startswith(("*", "/*")))):
            j -= 1
    if j < 0 or not lines[j].rstrip().endswith("*/"):
        return None
    k = j
    while k >= 0 and "/*" not in lines[k]:
        k -= 1
    return "\n".join(lines[k:j + 1])


def header_contracts():
    """name -> (header, comment or None) for each function declared in a header."""
    out = {}
    for h in HEADERS:
        with open(os.path.join(CSRC, h)) as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines):
            m = _DECL_START.match(line)
            if not m or m.group(1) in ("if", "while", "for", "switch"):
                continue
            out[m.group(1)] = (h, _comment_before(lines, i, True))
    return out


def test_every_declared_function_has_a_contract():
    # Each function declared in a header has a comment just above its
    # declaration (or above the group it belongs to) that says what it
    # returns or what happens on failure.
    missing = [f"{h}: {fn}" for fn, (h, c) in sorted(header_contracts().items())
               if c is None or not CONTRACT.search(c)]
    assert not missing, f"declarations without a contract comment: {missing}"


def test_every_exported_function_has_a_contract():
    # A function with external linkage defined in a .c file is declared in
    # a header with a contract, or has one directly above its definition.
    declared = header_contracts()
    missing = []
    for name, text in sources():
        if not name.endswith(".c"):
            continue
        lines = text.split("\n")
        for i, line in enumerate(lines):
            m = _DECL_START.match(line)
            if (not m or m.group(1) in ("if", "while", "for", "switch")
                    or re.search(r"\bstatic\b", line[:m.start(1)])):
                continue
            # A definition: its signature ends with '{' (a prototype with ';').
            rest = "\n".join(lines[i:i + 8])
            sig = re.match(r"[^;{]*[;{]", rest, re.S)
            if not sig or not sig.group(0).endswith("{"):
                continue
            fn = m.group(1)
            h = declared.get(fn)
            if h and h[1] and CONTRACT.search(h[1]):
                continue
            c = _comment_before(lines, i, False)
            if not (c and CONTRACT.search(c)):
                missing.append(f"{name}: {fn}")
    assert not missing, f"exported functions without a contract comment: {missing}"


def test_the_contract_check_rejects_a_bare_comment():
    lines = ["/* Sets things up. */", "int mpc_x(void);",
             "/* Sets things up.  Returns 0 or -errno. */", "int mpc_y(void);"]
    assert not CONTRACT.search(_comment_before(lines, 1, True))
    assert CONTRACT.search(_comment_before(lines, 3, True))


def test_every_lock_of_the_core_is_reset_after_fork():
    # NOTE [ Reset after fork ] in core.c: each process-local mutex of the
    # core is made fresh in the child by its own file's reset function, and
    # the note lists it.
    with open(os.path.join(CSRC, "core.c")) as f:
        note = f.read()
    bad = []
    for name, text in sources():
        if not name.endswith(".c") or name.startswith("py_"):
            continue
        for lock in re.findall(r"^static pthread_mutex_t (\w+)", text, re.M):
            reset = re.search(rf"memcpy\(&{lock}, &fresh|pthread_mutex_init\(&{lock}\b", text)
            if not reset:
                bad.append(f"{name}: {lock} is never reset")
            if not re.search(rf"\b{name}\s+{lock}\b", note):
                bad.append(f"{name}: {lock} is not in NOTE [ Reset after fork ]")
    assert not bad, bad


# Core calls that may wait for the keeper (a connect, a request, a reply).
_MAY_WAIT_FOR_THE_KEEPER = ("mpc_ref_drop", "mpc_block_release", "mpc_block_alloc",
                            "mpc_block_claim", "mpc_segment_prepare", "mpc_forget_idle",
                            "mpc_client_connect", "mpc_client_slot", "mpc_keeper_main")


def test_bindings_release_the_gil_around_calls_that_may_wait_for_the_keeper():
    bad = []
    for name, text in sources():
        if not name.startswith("py_") or not name.endswith(".c"):
            continue
        for fn, body in units(text):
            for m in re.finditer(r"\b(" + "|".join(_MAY_WAIT_FOR_THE_KEEPER) + r")\s*\(", body):
                before = body[:m.start()]
                opened = before.rfind("Py_BEGIN_ALLOW_THREADS")
                closed = before.rfind("Py_END_ALLOW_THREADS")
                if opened < 0 or closed > opened:
                    bad.append(f"{name}: {fn} calls {m.group(1)} with the GIL held")
    assert not bad, bad


def test_long_sources_say_why_they_stay_whole():
    bad = []
    for name, text in sources():
        n = text.count("\n")
        head = text[:text.find("*/")]
        if n > LONG and not re.search(r"\bstays one (file|header)\b", head):
            bad.append(f"{name}: {n} lines, and its header does not say why it stays one file")
    assert not bad, bad
