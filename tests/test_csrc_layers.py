"""The C core's files call each other in one direction only
(NOTE [ Layers of the core ] in csrc/internal.h): the graph of which core
file uses a function or variable defined in which other core file has no
cycle, and every name one core file shares with another is declared in a
header, never by hand in the file that uses it."""
import os
import re

CSRC = os.environ.get("MPCORE_CSRC") or os.path.join(os.path.dirname(__file__), "..", "csrc")

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
# A function definition starts at column 0 and its body's brace follows the
# closing parenthesis (the core's style); prototypes end in ';' instead.
_FUNC_DEF = re.compile(r"^(?!static\b|typedef\b|extern\b|#)([A-Za-z_][\w \t\*]*?)\b(\w+)\s*\(([^;{}]*?)\)\s*\{",
                       re.M)
_VAR_DEF = re.compile(r"^(?!static\b|typedef\b|extern\b|return\b|#)[A-Za-z_][\w \t\*]*?\b(\w+)\s*"
                      r"(?:\[[^\]\n]*\])?\s*(?:=[^;\n]*)?;", re.M)
_PROTO = re.compile(r"^(?!static\b|typedef\b|#)(?:extern\s+)?[A-Za-z_][\w \t\*]*?\b(\w+)\s*\([^;{}]*\)\s*"
                    r"(?:__attribute__\s*\(\(.*?\)\)\s*)?;", re.M)


def _clean(text):
    return _STRING.sub('""', _COMMENT.sub(" ", text))


def core_files(csrc=CSRC, bindings=False):
    """The core's C files (with bindings, the py_*.c files too), name ->
    cleaned text."""
    out = {}
    for name in sorted(os.listdir(csrc)):
        if name.endswith(".c") and (bindings or not name.startswith("py_")):
            with open(os.path.join(csrc, name)) as f:
                out[name] = _clean(f.read())
    return out


def definitions(files):
    """name -> file that defines it (non-static functions and variables)."""
    owner = {}
    for name, text in files.items():
        for m in _FUNC_DEF.finditer(text):
            owner[m.group(2)] = name
        for m in _VAR_DEF.finditer(text):
            owner.setdefault(m.group(1), name)
    return owner


def graph(csrc=CSRC):
    """file -> {other file: [names it uses from there]}."""
    files = core_files(csrc)
    owner = definitions(files)
    edges = {name: {} for name in files}
    for name, text in files.items():
        for tok in set(re.findall(r"\b[A-Za-z_]\w*\b", text)):
            where = owner.get(tok)
            if where is not None and where != name:
                edges[name].setdefault(where, []).append(tok)
    return edges


def find_cycle(edges):
    """A list of files forming a cycle (first == last), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {n: WHITE for n in edges}
    stack = []

    def visit(n):
        colour[n] = GREY
        stack.append(n)
        for m in sorted(edges[n]):
            if colour[m] == GREY:
                return stack[stack.index(m):] + [m]
            if colour[m] == WHITE:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        colour[n] = BLACK
        return None

    for n in sorted(edges):
        if colour[n] == WHITE:
            found = visit(n)
            if found:
                return found
    return None


def describe(edges):
    return "\n".join(f"  {a} -> {b}: {', '.join(sorted(edges[a][b])[:6])}"
                     for a in sorted(edges) for b in sorted(edges[a]))


def test_the_graph_is_seen():
    # The parser must find the calls it is meant to judge: the arena
    # reserves memory through shm.c, and the keeper keeps segments through
    # the arena.
    edges = graph()
    assert "mpc_memfd_create" in edges["arena.c"].get("shm.c", []), describe(edges)
    assert "mpc__keeper_map" in edges["keeper.c"].get("arena.c", []), describe(edges)
    assert find_cycle({"a.c": {"b.c": ["f"]}, "b.c": {"a.c": ["g"]}}) == ["a.c", "b.c", "a.c"]


def test_core_files_form_no_cycle():
    edges = graph()
    cycle = find_cycle(edges)
    assert cycle is None, ("the core's files call each other in a circle: "
                           + " -> ".join(cycle) + "\nevery edge:\n" + describe(edges))


def test_no_hand_written_declarations_of_other_files():
    # Every name shared between C files is declared in a header (mpcore.h,
    # internal.h, py_mpcore.h); no .c file declares another file's function.
    files = core_files(bindings=True)
    owner = definitions(files)
    bad = []
    for name, text in files.items():
        for m in _PROTO.finditer(text):
            fn = m.group(1)
            if owner.get(fn) not in (None, name):
                bad.append(f"{name} declares {fn} (defined in {owner[fn]})")
            elif owner.get(fn) == name and not m.group(0).lstrip().startswith("static"):
                bad.append(f"{name} declares its own {fn} outside a header")
        for m in re.finditer(r"^extern\s+[^;(]*\b(\w+)\s*;", text, re.M):
            if m.group(1) in owner:
                bad.append(f"{name} declares {m.group(1)} extern by hand")
    assert not bad, bad


def test_shared_internals_are_in_the_internal_header():
    # An mpc__ name defined in one core file and used in another is
    # declared in internal.h.
    with open(os.path.join(CSRC, "internal.h")) as f:
        internal = _clean(f.read())
    edges = graph()
    missing = sorted({tok for a in edges for b in edges[a] for tok in edges[a][b]
                      if tok.startswith("mpc__") and not re.search(rf"\b{tok}\b", internal)})
    assert not missing, f"cross-file internals not declared in internal.h: {missing}"


if __name__ == "__main__":
    e = graph()
    print(describe(e))
    print("cycle:", find_cycle(e))
