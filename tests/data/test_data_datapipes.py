"""mpcore.data.DataLoader over DataPipe graphs, against torch's DataLoader:
the same samples, once each where torch gives them once, in torch's order,
epoch after epoch (NOTE [ DataPipes ] in data/_loader.py).  Also: the
loader subscripts as torch's does (DataLoader[int]), with and without
torch, and the modules of mpcore.data import alone, with no import cycle.

Each case runs torch's loader and mpcore's over fresh copies of the same
graph after the same torch.manual_seed, in this (plain python) process, so
torch's loader is torch's own."""
import ast
import json
import os
import subprocess
import sys
import typing

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.datapipes.map import SequenceWrapper

import mpcore.data as md
from helpers import NO_TORCH_PRELUDE, run_in_session, scaled

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create")]

N = 40
BS = 4


def plain():
    return IterableWrapper(range(N))


def shuffled():
    return IterableWrapper(range(N)).shuffle()


def sharded():
    return IterableWrapper(range(N)).sharding_filter()


def shuffled_sharded():
    return IterableWrapper(range(N)).shuffle().sharding_filter()


PIPES = [plain, shuffled, sharded, shuffled_sharded]


def epochs(cls, make, num_workers, persistent, seed, n_epochs=2, **kw):
    torch.manual_seed(seed)
    loader = cls(make(), batch_size=BS, num_workers=num_workers,
                 persistent_workers=persistent, **kw)
    try:
        return [[x for b in loader for x in b.tolist()] for _ in range(n_epochs)]
    finally:
        del loader


CASES = [(0, False)] + [(n, p) for n in (1, 2, 3) for p in (False, True)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", PIPES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("num_workers,persistent", CASES,
                         ids=[f"{n}w{'-persistent' if p else ''}" for n, p in CASES])
def test_iter_datapipe_gives_torchs_samples_in_torchs_order(make, num_workers, persistent,
                                                             leak_check):
    want = epochs(tud.DataLoader, make, num_workers, persistent, seed=7)
    got = epochs(md.DataLoader, make, num_workers, persistent, seed=7)
    assert got == want
    for epoch in got:
        if make in (sharded, shuffled_sharded) or num_workers <= 1:
            assert sorted(epoch) == list(range(N)), "every sample once"
        else:  # torch's rule: a graph without sharding_filter is copied per worker
            assert sorted(epoch) == sorted(list(range(N)) * num_workers)
    if make in (shuffled, shuffled_sharded):
        assert got[0] != got[1], "each epoch is shuffled with a seed of its own"
        assert got[0] != sorted(got[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_shuffle_argument_sets_the_graphs_shufflers(shuffle, leak_check):
    # DataLoader(shuffle=...) turns a graph's shufflers on or off
    # (graph_settings.apply_shuffle_settings), as torch's does.
    want = epochs(tud.DataLoader, shuffled_sharded, 2, True, seed=3, shuffle=shuffle)
    got = epochs(md.DataLoader, shuffled_sharded, 2, True, seed=3, shuffle=shuffle)
    assert got == want
    assert sorted(got[0]) == list(range(N))
    unshuffled = epochs(md.DataLoader, sharded, 2, True, seed=3)
    assert (got == unshuffled) is (not shuffle)


@pytest.mark.timeout(60)
def test_a_generator_seeds_the_graph_as_in_torch(leak_check):
    g1, g2 = torch.Generator(), torch.Generator()
    g1.manual_seed(11), g2.manual_seed(11)
    want = epochs(tud.DataLoader, shuffled_sharded, 2, True, seed=0, generator=g1)
    got = epochs(md.DataLoader, shuffled_sharded, 2, True, seed=99, generator=g2)
    assert got == want


@pytest.mark.timeout(60)
def test_the_same_seed_gives_the_same_epochs(leak_check):
    a = epochs(md.DataLoader, shuffled_sharded, 2, True, seed=5)
    b = epochs(md.DataLoader, shuffled_sharded, 2, True, seed=5)
    assert a == b


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_datapipe_gives_torchs_samples(num_workers, leak_check):
    def run(cls):
        torch.manual_seed(1)
        loader = cls(SequenceWrapper(range(N)), batch_size=BS, shuffle=True,
                     num_workers=num_workers)
        return [[x for b in loader for x in b.tolist()] for _ in range(2)]
    assert run(md.DataLoader) == run(tud.DataLoader)


class Squares(tud.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i * i


class Stream(tud.IterableDataset):
    def __iter__(self):
        w = tud.get_worker_info()
        start, step = (w.id, w.num_workers) if w is not None else (0, 1)
        return iter(range(start, N, step))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dataset", [Squares, Stream], ids=["map", "iterable"])
@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_datasets_without_datapipes_are_unchanged(dataset, num_workers, persistent,
                                                   leak_check):
    def run(cls):
        torch.manual_seed(2)
        kw = {"shuffle": True} if dataset is Squares else {}
        loader = cls(dataset(), batch_size=BS, num_workers=num_workers,
                     persistent_workers=persistent, **kw)
        return [[x for b in loader for x in b.tolist()] for _ in range(2)]
    assert run(md.DataLoader) == run(tud.DataLoader)


# --- typing --------------------------------------------------------------------

def test_loader_subscripts_as_torchs_does():
    alias = md.DataLoader[int]
    assert typing.get_origin(alias) is md.DataLoader
    assert typing.get_args(alias) == (int,)
    assert typing.get_origin(tud.DataLoader[int]) is tud.DataLoader
    assert issubclass(md.DataLoader, tud.DataLoader)


NO_TORCH_TYPING = NO_TORCH_PRELUDE + '''
import typing
from mpcore.data import DataLoader
from mpcore.data._base import DataLoaderBase
a, b = DataLoader[int], DataLoaderBase[str]
print("REPORT", repr((typing.get_origin(a) is DataLoader, typing.get_args(a) == (int,),
                      typing.get_origin(b) is DataLoaderBase, "torch" in sys.modules,
                      [int(x) for batch in DataLoader(list(range(6)), batch_size=3)
                       for x in batch])))
'''


@pytest.mark.timeout(60)
def test_loader_subscripts_without_torch(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(NO_TORCH_TYPING)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCORE_")}
    r = run_in_session([sys.executable, script], cwd=tmp_path, env=env, timeout=50)
    assert r.returncode == 0, r.stderr
    line = [l for l in r.stdout.splitlines() if l.startswith("REPORT ")][0]
    assert eval(line[len("REPORT "):]) == (True, True, True, False, list(range(6)))


# --- the modules of mpcore.data -------------------------------------------------

DATA_DIR = os.path.dirname(md.__file__)
MODULES = sorted(f[:-3] for f in os.listdir(DATA_DIR) if f.endswith(".py"))


def _data_imports(name):
    """The mpcore.data modules that module `name` imports (at any depth of
    its code: a function-level import closes a cycle as surely)."""
    with open(os.path.join(DATA_DIR, name + ".py")) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith("mpcore.data."):
            out.add(node.module.split(".")[2])
    return out & set(MODULES)


def test_the_modules_of_mpcore_data_import_in_no_cycle():
    graph = {m: _data_imports(m) for m in MODULES}
    assert "_worker" in graph["_loader"] and "_fetch" in graph["_worker"]  # the parse works
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                pytest.fail("import cycle: " + " -> ".join(path + [m, n]))
            if n not in state:
                visit(n, path + [m])
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m, [])


ALONE = """
import importlib, sys, types
pkg = types.ModuleType("mpcore.data")   # the package without its __init__,
pkg.__path__ = [{path!r}]               # which would import every module first
sys.modules["mpcore.data"] = pkg
importlib.import_module("mpcore.data." + {name!r})
print(sorted(m[12:] for m in sys.modules if m.startswith("mpcore.data.")))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [m for m in MODULES if m != "__init__"])
def test_each_module_imports_alone(name):
    r = subprocess.run([sys.executable, "-c", ALONE.format(path=DATA_DIR, name=name)],
                       capture_output=True, text=True, timeout=scaled(100))
    assert r.returncode == 0, r.stderr
    loaded = set(ast.literal_eval(r.stdout.strip().splitlines()[-1]))
    assert name in loaded and loaded - {name} <= _closure(name), loaded


def _closure(name):
    seen, todo = set(), [name]
    while todo:
        for n in _data_imports(todo.pop()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


# --- across ranks ----------------------------------------------------------------

RANK_PROGRAM = '''
import json, sys
import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data.datapipes.iter import IterableWrapper
import mpcore.data as md

rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

def run(cls):
    torch.manual_seed(100 + rank)  # each rank its own seed: the shared one is rank 0's
    pipe = IterableWrapper(range({n})).shuffle().sharding_filter()
    loader = cls(pipe, batch_size=2, num_workers=2, persistent_workers=True)
    return [[x for b in loader for x in b.tolist()] for _ in range(2)]

print("RESULT " + json.dumps({{"torch": run(tud.DataLoader), "mpcore": run(md.DataLoader)}}),
      flush=True)
dist.destroy_process_group()
'''


@pytest.mark.timeout(180)
def test_ranks_share_the_seed_and_split_the_data(tmp_path):
    world = 2
    script = tmp_path / "rank.py"
    script.write_text(RANK_PROGRAM.format(n=N))
    init = f"file://{tmp_path / 'store'}"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), init],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=scaled(150))
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads([l for l in out.splitlines()
                                    if l.startswith("RESULT ")][0][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r in outs:
        assert r["mpcore"] == r["torch"]
    for epoch in range(2):
        every = sorted(x for r in outs for x in r["mpcore"][epoch])
        assert every == list(range(N)), "the ranks' workers split the data between them"
    assert outs[0]["mpcore"][0] != outs[0]["mpcore"][1]
