"""The Python package's modules import each other in one direction only
(NOTE [ Layers of the package ] in pkg/mpcore/__init__.py), the twin of
test_csrc_layers.py: the graph of which module of pkg/mpcore imports which
(every import, those inside functions included) has no cycle, no module
imports one of a layer above its own, no module reads another's private
names (a leading underscore), nor the private members of an object another
module's class defines (NOTE [ Private members stay in their module ]):
modules talk through public members."""
import ast
import os
import re

from helpers.layers import LONG, find_cycle  # what csrc/test_csrc_*.py use, for modules

PKG = os.environ.get("MPCORE_PKG") or os.path.join(os.path.dirname(__file__), "..", "..", "pkg",
                                                   "mpcore")

# NOTE [ Layers of the package ] in pkg/mpcore/__init__.py, from the bottom
# up: a module may import its own layer's modules and those of the layers
# below.  A layer is a subpackage (every module in it) or a set of modules.
LAYERS = (
    ("base", {"mpcore._core", "mpcore._version", "mpcore._hooks", "mpcore._torchapi",
              "mpcore._stats"}),
    ("shm", "mpcore.shm"),
    ("queue", "mpcore.queue"),
    ("proc", "mpcore.proc"),
    ("data", "mpcore.data"),
    ("dist", "mpcore.dist"),
    ("faces", {"mpcore", "mpcore.distributed", "mpcore.parallel"}),
    ("run", "mpcore.run"),
    ("tools", {"mpcore._doctor", "mpcore.__main__"}),
)
# Built from C (no .py file): a leaf.
EXTENSIONS = {"mpcore._core"}


def modules(pkg=PKG):
    """dotted module name -> path of every .py file of the package."""
    root = os.path.dirname(os.path.abspath(pkg))
    out = {}
    for d, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _resolve(importer, is_package, node):
    """The dotted name an ImportFrom's module part names."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[:-(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(pkg=PKG):
    """module -> [(line, imported module, alias bound or None, name imported
    from it or None)] for every import of a module of the package."""
    mods = modules(pkg)
    known = set(mods) | EXTENSIONS
    out = {}
    for name, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        rows = out[name] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known:
                        rows.append((node.lineno, a.name, a.asname or a.name.split(".")[0], None))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.endswith("__init__.py"), node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in known:       # from package import module
                        rows.append((node.lineno, sub, a.asname or a.name, None))
                    elif base in known:    # from module import name
                        rows.append((node.lineno, base, None, a.name))
    return out


def graph(pkg=PKG):
    """module -> {imported module: [lines]} (a module importing itself is no edge)."""
    edges = {}
    for name, rows in imports(pkg).items():
        e = edges.setdefault(name, {})
        for line, target, _, _ in rows:
            if target != name:
                e.setdefault(target, []).append(line)
    for ext in EXTENSIONS:
        edges.setdefault(ext, {})
    return edges


def layer_of(module):
    """(index, name) of the module's layer, or None."""
    for i, (lname, members) in enumerate(LAYERS):
        if isinstance(members, str):
            if module == members or module.startswith(members + "."):
                return i, lname
        elif module in members:
            return i, lname
    return None


def upward(edges):
    """Every import of a module of a higher layer, as text."""
    bad = []
    for a in sorted(edges):
        for b in sorted(edges[a]):
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb[0] > la[0]:
                bad.append(f"{a} ({la[1]}) imports {b} ({lb[1]}) at line {edges[a][b][0]}")
    return bad


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reads(pkg=PKG):
    """Every private name one module reads of (or writes into) another,
    by attribute or by `from module import _name`, as text."""
    mods = modules(pkg)
    known = set(mods) | EXTENSIONS
    rows = imports(pkg)
    bad = []
    for name, path in sorted(mods.items()):
        aliases = {alias: target for _, target, alias, what in rows[name]
                   if alias is not None and target != name}
        for line, target, _, what in rows[name]:
            if what is not None and _private(what) and target != name:
                bad.append(f"{name}:{line} imports {target}'s {what}")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            # a.b.c where a is an imported module: the first attribute that
            # is not a module itself is what is read
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if not isinstance(cur, ast.Name) or cur.id not in aliases:
                continue
            mod = aliases[cur.id]
            for attr in reversed(chain):
                if f"{mod}.{attr}" in known:
                    mod = f"{mod}.{attr}"
                    continue
                if _private(attr) and mod != name:
                    bad.append(f"{name}:{node.lineno} reads {mod}.{attr}")
                break
    return sorted(set(bad))


# NOTE [ Private members stay in their module ]
# An object's private members (a leading underscore) are read and written by
# the module whose class defines them; another module uses a public name (an
# attribute, a property or a method).  Types are not known statically, so
# the rule goes by where a name is defined: `x._name` (x not self, cls or
# super()) in module M is refused when a class of another module of the
# package defines `_name` (a method or class attribute in its body, or
# `self._name = ...` in one of its methods) and no class of M does (then the
# object may be M's own, which M may touch).  Exempt:
# - a receiver bound by an import of a module or of another library's
#   object (module-level names are private_reads' and test_torchapi's);
# - the private members torch and the standard library give the objects
#   the package's classes extend or mirror (FOREIGN): the package's class
#   defines the name because torch's interface has it, and another module
#   calls it as torch would.  test_foreign_members_are_foreign checks each
#   against its owner, so the list cannot grow to hide the package's own.
FOREIGN = {
    # torch's ProcessGroup: what ProcessGroupMpcore answers
    "_get_backend_name": "torch.distributed.ProcessGroup",
    # torch's DataLoader iterator, which data/_base.py mirrors without torch
    # and data/_state.py resumes
    "_num_yielded": "torch.utils.data.dataloader._BaseDataLoaderIter",
    "_sampler_iter": "torch.utils.data.dataloader._BaseDataLoaderIter",
    "_index_sampler": "torch.utils.data.dataloader._BaseDataLoaderIter",
    # multiprocessing's Process, which proc/_context.py's processes extend
    "_bootstrap": "multiprocessing.process.BaseProcess",
    "_name": "multiprocessing.process.BaseProcess",
}


def _receiver_is_self(value):
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id == "super")


def _defined_members(tree):
    """The private member names the module's classes define."""
    out = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Name):
                        out.add(t.id)
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and _receiver_is_self(node.value)):
                out.add(node.attr)
    return {n for n in out if _private(n)}


def _foreign_bindings(tree, known):
    """Names bound by `import x` or by an import from another library."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update((a.asname or a.name.split(".")[0]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and not (
                node.module in known or (node.module or "").split(".")[0] == "mpcore"):
            out.update(a.asname or a.name for a in node.names)
    return out


def private_member_reads(pkg=PKG, foreign=FOREIGN):
    """Every private member of another module's object one module reads or
    writes (NOTE [ Private members stay in their module ]), as text."""
    mods = modules(pkg)
    trees = {}
    for name, path in mods.items():
        with open(path) as f:
            trees[name] = ast.parse(f.read(), path)
    defined = {name: _defined_members(tree) for name, tree in trees.items()}
    owners = {}
    for name, members in defined.items():
        for m in members:
            owners.setdefault(m, set()).add(name)
    bad = []
    for name, tree in sorted(trees.items()):
        skip = _foreign_bindings(tree, set(mods) | EXTENSIONS)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            attr, value = node.attr, node.value
            if (_receiver_is_self(value) or attr in foreign or attr in defined[name]
                    or (isinstance(value, ast.Name) and value.id in skip)):
                continue
            others = sorted(owners.get(attr, set()) - {name})
            if others:
                bad.append(f"{name}:{node.lineno} {ast.unparse(node)} "
                           f"(defined by a class of {', '.join(others)})")
    return sorted(set(bad))


def describe(edges):
    return "\n".join(f"  {a} -> {b}" for a in sorted(edges) for b in sorted(edges[a]))


def test_the_graph_is_seen():
    # The parser must find the imports it is meant to judge: the package's
    # face imports the queues, a lazy import inside a function counts, and
    # a private read through an alias is seen.
    edges = graph()
    assert "mpcore.queue._queue" in edges["mpcore"], describe(edges)
    assert "mpcore.dist._nccl" in edges["mpcore.dist._group"], describe(edges)   # in a method
    assert find_cycle({"a": {"b": [1]}, "b": {"a": [2]}}) == ["a", "b", "a"]
    assert upward({"mpcore.shm._blocks": {"mpcore.proc._zygote": [3]}}) == [
        "mpcore.shm._blocks (shm) imports mpcore.proc._zygote (proc) at line 3"]


def test_a_private_read_is_seen(tmp_path):
    pkg = tmp_path / "mpcore"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "_a.py").write_text("_x = 1\ny = 2\n")
    (pkg / "sub" / "_b.py").write_text("from . import _a\nfrom ._a import _x\n"
                                       "def f():\n    return _a._x + _a.y\n")
    assert private_reads(str(pkg)) == ["mpcore.sub._b:2 imports mpcore.sub._a's _x",
                                       "mpcore.sub._b:4 reads mpcore.sub._a._x"]


def test_every_module_has_a_layer():
    missing = sorted(m for m in modules() if layer_of(m) is None)
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_modules_form_no_cycle():
    edges = graph()
    cycle = find_cycle(edges)
    assert cycle is None, ("the package's modules import each other in a circle: "
                           + " -> ".join(cycle) + "\nevery edge:\n" + describe(edges))


def test_imports_go_downward_only():
    bad = upward(graph())
    assert not bad, "imports of a higher layer:\n  " + "\n  ".join(bad)


def test_modules_read_no_private_names_of_others():
    bad = private_reads()
    assert not bad, "private names read across modules:\n  " + "\n  ".join(bad)


def test_a_private_member_read_is_seen(tmp_path):
    pkg = tmp_path / "mpcore"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_a.py").write_text(
        "class A:\n"
        "    _kind = 1\n"
        "    def __init__(self):\n"
        "        self._n = 0\n"
        "        self.size = 0\n"
        "    def _step(self):\n"
        "        return self._n\n")
    (pkg / "_b.py").write_text(
        "import threading\n"
        "from ._a import A\n"
        "class B:\n"
        "    def __init__(self):\n"
        "        self._own = A()\n"
        "    def f(self, a, b):\n"
        "        threading._shutdown\n"          # another library's module
        "        b._own = a.size\n"              # this module's class defines _own
        "        a._n += 1\n"                    # written into A's member
        "        return a._step(), A._kind, self._own, super()._n\n")
    assert private_member_reads(str(pkg), foreign={}) == [
        "mpcore._b:10 A._kind (defined by a class of mpcore._a)",
        "mpcore._b:10 a._step (defined by a class of mpcore._a)",
        "mpcore._b:9 a._n (defined by a class of mpcore._a)"]
    assert private_member_reads(str(pkg), foreign={"_n": "x", "_step": "x", "_kind": "x"}) == []


def test_modules_read_no_private_members_of_others():
    bad = private_member_reads()
    assert not bad, ("private members of another module's objects read or written (give them a "
                     "public name; NOTE [ Private members stay in their module ]):\n  "
                     + "\n  ".join(bad))


def test_foreign_members_are_foreign():
    # Each exempt name is a member of the torch or standard-library class
    # named for it, and some module does use it across modules: the list
    # holds nothing of the package's own and nothing stale.
    import importlib
    import inspect
    used = "\n".join(private_member_reads(foreign={}))
    for name, owner in sorted(FOREIGN.items()):
        mod, _, attr = owner.rpartition(".")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except ImportError:   # a class reached through its module
            parent, _, cls = mod.rpartition(".")
            obj = getattr(getattr(importlib.import_module(parent), cls), attr)
        has = hasattr(obj, name)
        if not has:
            try:
                has = re.search(rf"self\.{name}\b", inspect.getsource(obj)) is not None
            except (OSError, TypeError):
                pass
        assert has, f"{owner} has no member {name}: FOREIGN exempts it for nothing"
        assert f".{name} (" in used, (
            f"no module reads {name} across modules: drop it from FOREIGN")


def test_long_modules_say_why_they_stay_whole():
    # The twin of test_csrc_lint's check: a module longer than about 800
    # lines is split along its seams, or its docstring says why it stays one.
    bad = []
    for name, path in sorted(modules().items()):
        with open(path) as f:
            text = f.read()
        doc = ast.get_docstring(ast.parse(text)) or ""
        n = text.count("\n")
        if n > LONG and not re.search(r"\bstays one module\b", doc):
            bad.append(f"{name}: {n} lines, and its docstring does not say why it stays one module")
    assert not bad, bad


if __name__ == "__main__":
    e = graph()
    print("\n".join([describe(e), f"cycle: {find_cycle(e)}", *upward(e), *private_reads()]))
