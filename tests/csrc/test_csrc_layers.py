"""The C core's files call each other in one direction only
(NOTE [ Layers of the core ] in csrc/internal.h): the graph of which core
file uses a function or variable defined in which other core file goes
down the note's list of layers (never up it), has no cycle, and every name
one core file shares with another is declared in a header, never by hand in
the file that uses it.  A header of a few files (coll.h, the collectives')
is included by those files only."""
import os
import re

from helpers.layers import find_cycle

CSRC = os.environ.get("MPCORE_CSRC") or os.path.join(os.path.dirname(__file__), "..", "..", "csrc")

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


def layers(csrc=CSRC):
    """The note's list of layers in internal.h: file -> its line's index,
    bottom first (files on one line share it)."""
    with open(os.path.join(csrc, "internal.h")) as f:
        text = f.read()
    note = text[text.index("NOTE [ Layers of the core ]"):]
    note = note[:note.index("*/")]
    level = {}
    for line in note.split("\n"):
        m = re.match(r"\s*\*\s{3}((?:\w+\.c\s+)+)", line + " ")
        if m:
            n = len(set(level.values()))
            for name in m.group(1).split():
                level[name] = n
    return level


def upward(edges, level):
    """The edges from a file to one on a later line of the list, as
    'a -> b: names'."""
    return [f"{a} (line {level[a]}) -> {b} (line {level[b]}): {', '.join(sorted(edges[a][b])[:6])}"
            for a in sorted(edges) for b in sorted(edges[a])
            if a in level and b in level and level[b] > level[a]]


def includes(name, csrc=CSRC):
    """The project headers that csrc/name includes ("..." includes)."""
    with open(os.path.join(csrc, name)) as f:
        text = _COMMENT.sub(" ", f.read())
    return set(re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M))


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


def test_every_core_file_has_its_layer():
    # The list names every core file (a new file is placed, not passed
    # over), and nothing that is not one.
    level = layers()
    files = set(core_files())
    assert set(level) == files, (f"not in NOTE [ Layers of the core ]: {sorted(files - set(level))}; "
                                 f"listed but not in csrc/: {sorted(set(level) - files)}")
    # the collectives' files, bottom up, as coll.h lists them
    order = ["coll_kernels.c", "coll_group.c", "coll_copy.c", "coll_p2p.c"]
    assert [level[f] for f in order] == sorted(level[f] for f in order)
    assert len({level[f] for f in order}) == len(order)
    assert level["coll_p2p.c"] == level["coll.c"]


def test_calls_go_down_the_layers():
    edges = graph()
    bad = upward(edges, layers())
    assert not bad, ("a core file calls one on a later line of NOTE [ Layers of the core ]:\n  "
                     + "\n  ".join(bad))


def test_the_layer_check_sees_an_upward_call():
    # The checks above must be able to fail: a lower file that calls a
    # higher one, and a circle.
    level = {"a.c": 0, "b.c": 1, "c.c": 1}
    edges = {"a.c": {"b.c": ["mpc_b"]}, "b.c": {"a.c": ["mpc_a"], "c.c": ["mpc_c"]}, "c.c": {}}
    assert upward(edges, level) == ["a.c (line 0) -> b.c (line 1): mpc_b"]
    assert find_cycle(edges) == ["a.c", "b.c", "a.c"]
    assert find_cycle({"a.c": {}, "b.c": {"a.c": ["f"]}}) is None


def test_headers_of_a_few_files_are_theirs():
    # coll.h is the collectives' own: only their files include it, never
    # a binding, nor another core file; and every one of them does.
    files = core_files(bindings=True)
    users = sorted(n for n in files if "coll.h" in includes(n))
    assert users == sorted(n for n in files if n == "coll.c" or n.startswith("coll_")), users
    assert includes("coll.h") == {"mpcore.h"}, "coll.h builds on mpcore.h alone"


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
    # declared in internal.h, or in a header of a few files (coll.h) that
    # both include.
    def header(name):
        with open(os.path.join(CSRC, name)) as f:
            return _clean(f.read())
    internal = header("internal.h")
    with_includes = {n: includes(n) for n in core_files()}
    edges = graph()
    missing = []
    for a in edges:
        for b in edges[a]:
            shared = (with_includes[a] & with_includes[b]) - {"mpcore.h", "internal.h"}
            for tok in edges[a][b]:
                if not tok.startswith("mpc__") or re.search(rf"\b{tok}\b", internal):
                    continue
                if not any(re.search(rf"\b{tok}\b", header(h)) for h in shared):
                    missing.append(f"{tok} ({b}, used in {a})")
    assert not missing, ("cross-file internals declared neither in internal.h nor in a header "
                         f"both files include: {sorted(missing)}")


if __name__ == "__main__":
    e = graph()
    print(describe(e))
    print("cycle:", find_cycle(e))
    print("upward:", upward(e, layers()))
