"""SharedList, SharedDict and share_dataset (NOTE [ Shared datasets ] in
mpcore/data/_shared.py): the container's promises in this process, and
loading, faults, shortage and ranks in fresh programs whose whole process
tree is checked afterwards (nothing left running, no memfd open, nothing
gained in /dev/shm)."""
import copy
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import mpcore
from mpcore.data import SharedDict, SharedList, share_dataset
from helpers import (TESTS_ON_PATH, fresh_env, memory_amounts, module_on_path, program_result,
                     require, run_in_memcg, scaled)

pytestmark = pytest.mark.timeout(180)

# The first line of the programs below, which import this module.
MODULE_ON_PATH = module_on_path(__name__)


def _items(n):
    """Nested items: dicts, lists, tuples, strings, numpy arrays and
    tensors (a view of one storage among them)."""
    out = []
    for i in range(n):
        base = torch.arange(6, dtype=torch.float32) + i
        out.append({
            "path": f"/data/{i:05d}.jpg", "label": i % 7, "w": i / 3,
            "boxes": [[i, i + 1, i + 2, i + 3], (i, "x")],
            "mask": np.arange(i % 4 + 1, dtype=np.int16) * i,
            "fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3) + i),
            "t": base, "view": base[2:5], "half": torch.full((2,), i, dtype=torch.bfloat16),
            "meta": {"tags": ["a", str(i)], "none": None},
        })
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and np.array_equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


# --- the container, in this process -------------------------------------------

def test_the_loaders_signature_is_torchs_and_share_dataset():
    # Tools that rebuild a DataLoader from its parameters by name (Lightning
    # adds its DistributedSampler so) read inspect.signature().
    import inspect
    from mpcore.data import DataLoader
    torchs = inspect.signature(torch.utils.data.DataLoader.__init__).parameters
    ours = inspect.signature(DataLoader.__init__).parameters
    assert list(ours) == list(torchs) + ["share_dataset"]
    assert ours["share_dataset"].kind is inspect.Parameter.KEYWORD_ONLY
    assert all(ours[n] == p for n, p in torchs.items())


def test_list_reads_back_every_item_nested_arrays_and_tensors_included():
    src = _items(50)
    sl = SharedList(src)
    assert len(sl) == 50
    for i in (0, 1, 17, 49, -1, -50):
        assert _same(sl[i], src[i]), i
    assert all(_same(a, b) for a, b in zip(sl, src))
    assert all(_same(a, b) for a, b in zip(reversed(sl), reversed(src)))
    with pytest.raises(IndexError):
        sl[50]
    with pytest.raises(IndexError):
        sl[-51]
    with pytest.raises(TypeError, match="indices must be integers"):
        sl["a"]
    assert sl[np.int64(3)]["path"] == "/data/00003.jpg"


def test_arrays_and_tensors_are_views_of_the_shared_block():
    sl = SharedList(_items(4))
    item = sl[2]
    lo, hi = sl._block.address, sl._block.address + sl._block.nbytes
    for a in (item["mask"], item["fortran"]):
        assert lo <= a.__array_interface__["data"][0] < hi
        assert not a.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            a[...] = 0
    assert item["fortran"].flags.f_contiguous
    for t in (item["t"], item["view"], item["half"]):
        assert lo <= t.data_ptr() < hi
    # a view keeps its storage shared with its base, as in the source
    assert item["view"].untyped_storage().data_ptr() == item["t"].untyped_storage().data_ptr()
    assert item["view"].storage_offset() == 2
    # torch's semantics for a dataset's tensors sent to 'spawn' workers:
    # writable, in shared memory, so a write is seen by every reader
    item["t"][0] = -1
    assert sl[2]["t"][0].item() == -1


def test_slicing_gives_a_list_and_the_rest_behaves_as_a_list():
    src = list(range(100)) + ["x", (1, 2)]
    sl = SharedList(src)
    for s in (slice(2, 9), slice(None, None, -3), slice(-5, None), slice(200, 300)):
        got = sl[s]
        assert type(got) is list and got == src[s]
    assert sl == src and src == sl and not (sl != src) and sl != src[:-1]
    assert sl == SharedList(src) and sl == sl
    assert sl != tuple(src)
    assert 57 in sl and (1, 2) in sl and 1000 not in sl
    assert sl.index(57) == 57 and sl.count("x") == 1
    with pytest.raises(ValueError):
        sl.index(1000)
    assert sl + [5] == src + [5] and [5] + sl == [5] + src
    assert "SharedList([0, 1, 2, ...]" in repr(sl) and "len=102" in repr(sl)
    assert copy.copy(sl) is sl and copy.deepcopy(sl) is sl
    with pytest.raises(TypeError):
        hash(sl)
    assert SharedList([]) == [] and len(SharedList(iter([1, 2]))) == 2


@pytest.mark.parametrize("write", [
    lambda x: x.__setitem__(0, 1), lambda x: x.__delitem__(0), lambda x: x.append(1),
    lambda x: x.extend([1]), lambda x: x.insert(0, 1), lambda x: x.pop(), lambda x: x.remove(1),
    lambda x: x.clear(), lambda x: x.sort(), lambda x: x.reverse(), lambda x: x.__iadd__([1]),
])
def test_list_writes_are_refused(write):
    sl = SharedList([1, 2, 3])
    with pytest.raises(TypeError, match="SharedList is read-only"):
        write(sl)
    assert sl == [1, 2, 3]


def test_dict_builds_in_a_block_that_held_other_data(monkeypatch):
    # The arena hands back memory a freed block wrote; the key table must
    # not take what it finds there for taken slots.
    from mpcore.data import _shared
    from mpcore.shm import _blocks
    alloc = _blocks.alloc

    def dirty(n):
        b = alloc(n)
        b.array(np.uint8, (n,), None, 0)[:] = 0xff
        return b
    monkeypatch.setattr(_shared._blocks, "alloc", dirty)
    src = {f"k{i}": i for i in range(100)}
    d = SharedDict(src)
    assert d == src and d["k7"] == 7 and "k100" not in d


def test_dict_finds_keys_by_value_whatever_the_process_hash():
    src = {"a": 1, 2: [1, 2], 3.5: "x", (1, "b"): {"n": np.ones(2)}, None: 0, b"k": "bytes",
           frozenset({1}): "other"}
    src.update({f"key{i}": i for i in range(1000)})
    sd = SharedDict(src)
    assert len(sd) == len(src) and list(sd) == list(src)
    for k, v in src.items():
        assert _same(sd[k], v), k
        assert k in sd
    assert sd[2.0] == [1, 2]            # 2 == 2.0, one key as in dict
    # a frozenset of strings iterates (and would pickle) in an order the
    # process's hash salt sets; its hash in the table does not depend on it
    from mpcore.data import _shared
    assert _shared._key_hash(frozenset(["b", "a", "c"])) == \
        _shared._key_hash(frozenset(["c", "a", "b"]))
    assert _shared._hashable_bytes(frozenset(["a", "b"])) == b"{sa\0sb}"
    assert "zz" not in sd and sd.get("zz", 5) == 5
    with pytest.raises(KeyError):
        sd["zz"]
    with pytest.raises(TypeError):
        sd[[1]]                         # unhashable, as dict says
    assert sd.keys() == list(src.keys())
    plain = {k: v for k, v in src.items() if k != (1, "b")}   # no arrays: == is a bool
    assert SharedDict(plain) == plain and plain == SharedDict(plain)
    small = {"a": 1, "b": [2]}
    assert SharedDict(small) == small and small == SharedDict(small)
    assert SharedDict(small) != {"a": 1} and SharedDict(small) != {"a": 1, "b": [3]}
    assert "SharedDict({'a': 1, 'b': [2]}" in repr(SharedDict(small))
    for write in (lambda x: x.__setitem__("a", 1), lambda x: x.__delitem__("a"),
                  lambda x: x.update({}), lambda x: x.pop("a"), lambda x: x.popitem(),
                  lambda x: x.setdefault("a"), lambda x: x.clear()):
        with pytest.raises(TypeError, match="SharedDict is read-only"):
            write(sd)


def test_pickles_as_a_handle_to_the_same_memory():
    sl = SharedList(_items(3))
    back = pickle.loads(pickle.dumps(sl))
    assert back.handle == sl.handle and back._block is sl._block
    assert _same(back[1], sl[1])
    assert len(pickle.dumps(SharedList(list(range(100000))))) < 200
    sd = SharedDict({"a": 1})
    assert pickle.loads(pickle.dumps(sd)).handle == sd.handle


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("no pickling")


def test_an_item_that_cannot_be_pickled_is_named():
    with pytest.raises(TypeError, match=r"SharedList item 2 cannot be pickled"):
        SharedList([1, 2, lambda: 3])
    with pytest.raises(TypeError, match=r"SharedDict value of key 'f' cannot be pickled"):
        SharedDict({"e": 1, "f": lambda: 3})
    with pytest.raises(TypeError, match=r"SharedDict key .*Unpicklable.* cannot be pickled"):
        SharedDict({"e": 1, _Unpicklable(): 3})


class _Meta(torch.utils.data.Dataset):
    def __init__(self, n, bad=False):
        self.items = [{"x": i, "name": f"n{i}"} for i in range(n)]
        self.lookup = {f"n{i}": i * 2 for i in range(n)}
        self.small = [1, 2, 3]
        self.opened = (lambda: 0) if bad else None
        self.extra = [1, 2, (lambda: 0)] * (n // 3 + 1) if bad else []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        return torch.tensor([it["x"], self.lookup[it["name"]]])


def test_share_dataset_converts_large_attributes_in_place_and_nested_datasets():
    ds = _Meta(3000)
    before = [ds[i].tolist() for i in range(len(ds))]
    sub = torch.utils.data.Subset(ds, list(range(0, 3000, 2)))
    cat = torch.utils.data.ConcatDataset([sub, _Meta(1500)])
    assert share_dataset(cat) is cat
    assert type(ds.items) is SharedList and type(ds.lookup) is SharedDict
    assert type(ds.small) is list            # below min_items: left as it is
    assert type(sub.indices) is SharedList and type(cat.datasets[1].items) is SharedList
    assert type(cat.datasets) is list and type(cat.cumulative_sizes) is list
    assert [ds[i].tolist() for i in range(len(ds))] == before
    assert share_dataset(ds).items is ds.items  # already shared: left as it is


def test_share_dataset_names_the_attribute_that_cannot_be_shared_and_changes_nothing():
    ds = _Meta(3000, bad=True)
    items = ds.items
    with pytest.raises(TypeError, match=r"share_dataset: _Meta\.extra cannot be shared: "
                                        r"_Meta\.extra item 2 cannot be pickled"):
        share_dataset(ds)
    assert ds.items is items and type(ds.lookup) is dict


# --- loading, in fresh programs ----------------------------------------------------

LOADER_PROGRAM = MODULE_ON_PATH + r'''
import json, os, random, sys
import numpy as np
import torch
torch.set_num_threads(1)
import mpcore
from mpcore.data import DataLoader, SharedList, get_worker_info
import test_shared_data as T


class DS(torch.utils.data.Dataset):
    """Items with arrays and tensors inside; each read also reports the
    worker's seeds, and index 13 raises."""
    def __init__(self, n):
        self.items = T._items(n)
        self.names = {f"/data/{i:05d}.jpg": i for i in range(n)}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if i == 13:
            raise KeyError(f"item {i} is bad")
        it = self.items[i]
        w = get_worker_info()
        return {"i": self.names[it["path"]], "mask": torch.from_numpy(it["mask"].copy()),
                "t": it["t"], "half": it["half"].float(), "label": it["label"],
                "seed": torch.initial_seed(), "rnd": random.random(),
                "np": float(np.random.rand()), "wid": w.id if w else -1}


def collate(batch):
    return batch   # lists of dicts: tensors as read, compared one by one


def epochs(loader, n):
    out = []
    for _ in range(n):
        got = []
        it = iter(loader)
        while True:
            try:
                got.append(next(it))
            except StopIteration:
                break
            except KeyError as e:
                got.append(("error", str(e)))
        out.append(got)
    return out


def run(method, share):
    ds = DS(1100)   # share_dataset converts lists of 1024 items and more
    kw = dict(batch_size=64, shuffle=True, num_workers=2, multiprocessing_context=method,
              collate_fn=collate, generator=torch.Generator().manual_seed(7))
    res = {}
    torch.manual_seed(1)
    res["persistent"] = epochs(DataLoader(ds, persistent_workers=True, share_dataset=share,
                                          **kw), 2)
    if share:
        assert type(ds.items) is SharedList, type(ds.items)
    torch.manual_seed(2)
    res["recreated"] = [epochs(DataLoader(ds, **kw), 1)[0] for _ in range(2)]
    # state_dict mid-epoch, resumed by a new loader
    torch.manual_seed(3)
    loader = DataLoader(ds, **kw)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    del it
    again = DataLoader(ds, **kw)
    again.load_state_dict(state)
    res["resumed"] = head + epochs(again, 1)[0]
    return res


if __name__ == "__main__":
    method = sys.argv[1]
    plain, shared = run(method, False), run(method, True)
    same = {k: T._same(plain[k], shared[k]) for k in plain}
    errors = sum(1 for e in plain["persistent"][0] if isinstance(e, tuple))
    seeds = sorted({d["seed"] for b in plain["persistent"][0] if not isinstance(b, tuple)
                    for d in b})
    print("RESULT " + json.dumps({"same": same, "errors": errors, "seeds": len(seeds),
                                  "batches": len(plain["persistent"][0])}), flush=True)
'''


def _check_program(scenario, code, *args, timeout=240):
    r = scenario.run(code, *args, timeout=timeout)
    res = program_result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    scenario.check_clean()
    return res


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_loading_gives_the_same_batches_seeds_errors_and_state(leak_check, scenario, method):
    """Plain against share_dataset=True: the same batches, seeds (torch,
    random, numpy), errors and resumed state, with persistent workers over
    two epochs and with loaders made again."""
    res = _check_program(scenario, LOADER_PROGRAM, method)
    assert res["same"] == {"persistent": True, "recreated": True, "resumed": True}, res
    assert res["errors"] == 1 and res["seeds"] == 2 and res["batches"] == 18, res


KILL_PROGRAM = MODULE_ON_PATH + r'''
import json, os, signal, sys
import torch
torch.set_num_threads(1)
import mpcore
from mpcore.data import DataLoader, get_worker_info
import test_shared_data as T


class DS(torch.utils.data.Dataset):
    def __init__(self, n):
        self.items = T._items(n)
        self.kill_at = 20

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if i == self.kill_at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.items[i]["t"]


if __name__ == "__main__":
    method = sys.argv[1]
    ds = DS(2048)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=method,
                        share_dataset=True)
    handle = ds.items.handle
    err = None
    try:
        for _ in loader:
            pass
    except RuntimeError as e:
        err = str(e)
    # This process still holds the dataset; a new loader reads it whole.
    ds.kill_at = -1
    total = sum(float(b.sum()) for b in DataLoader(ds, batch_size=64, num_workers=2,
                                                   multiprocessing_context=method))
    want = sum(float(it["t"].sum()) for it in T._items(2048))
    print("RESULT " + json.dumps({"err": err, "total": total, "want": want,
                                  "same": ds.items.handle == handle}), flush=True)
'''


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_killed_mid_epoch_leaves_nothing_behind(leak_check, scenario, method):
    res = _check_program(scenario, KILL_PROGRAM, method)
    assert res["err"] and "killed by signal" in res["err"], res
    assert res["same"] and res["total"] == res["want"], res


SHORTAGE_PROGRAM = r'''
import json, os, sys
import numpy as np
import mpcore
from mpcore.data import SharedList, SharedDict

mpcore._core.connect()          # the keeper starts now, outside the cgroup
print("READY", os.getpid(), flush=True)
if sys.stdin.readline().strip() != "GO":
    sys.exit(5)
before = mpcore._core.stats()
# 96 MiB of array data, held here in one byte (a broadcast view)
big = np.broadcast_to(np.zeros(1, np.uint8), (96 << 20,))
res = {}
for name, make in (("list", lambda: SharedList([{"a": 1}, big])),
                   ("dict", lambda: SharedDict({"a": big}))):
    try:
        make()
        res[name] = {"outcome": "ok"}
    except MemoryError as e:
        res[name] = {"outcome": "MemoryError", "msg": str(e)}
after = mpcore._core.stats()
res["segments"] = [before["segments"], after["segments"]]
res["mapped"] = [before["mapped_bytes"], after["mapped_bytes"]]
res["small_after"] = SharedList(list(range(1000)))[999]
print("RESULT " + json.dumps(res), flush=True)
'''


def test_a_build_that_does_not_fit_is_a_memory_error_and_takes_nothing(leak_check, scenario):
    """In a 64 MB memory cgroup, a dataset of 96 MB: MemoryError naming
    what it needed and what is available, before any shared memory is
    taken; what fits is still served."""
    limit = 64 << 20
    res, _ = run_in_memcg(scenario, SHORTAGE_PROGRAM, limit)
    for name in ("list", "dict"):
        r = res[name]
        assert r["outcome"] == "MemoryError", (name, r)
        assert "needs" in r["msg"] and "available" in r["msg"], r
        assert any(a >= 96 << 20 for a in memory_amounts(r["msg"])), r
    assert res["segments"][0] == res["segments"][1] and res["mapped"][0] == res["mapped"][1], res
    assert res["small_after"] == 999
    scenario.check_clean()


RANKS_PROGRAM = MODULE_ON_PATH + r'''
import json, os
import torch
import torch.distributed as dist
import mpcore
from mpcore.data import SharedList, broadcast_shared
import test_shared_data as T

dist.init_process_group("gloo")
rank = dist.get_rank()
sl = SharedList(T._items(300)) if rank == 0 else None
sl = broadcast_shared(sl, src=0)
addr = sl._block.address
inode = None
with open("/proc/self/maps") as f:
    for line in f:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            inode = int(line.split()[4])
ok = all(T._same(a, b) for a, b in zip(sl, T._items(300)))
dist.barrier()   # rank 0 keeps its copy until every rank has read
line = json.dumps({"rank": rank, "handle": list(sl.handle), "inode": inode, "ok": ok,
                   "keeper": os.environ.get("MPCORE_KEEPER")})
os.write(1, f"rank-line {line}\n".encode())
dist.destroy_process_group()
'''


def test_two_ranks_of_a_job_map_one_copy(leak_check, scenario, tmp_path):
    path = tmp_path / "ranks.py"
    path.write_text(RANKS_PROGRAM)
    env = fresh_env()
    env.update(scenario.env())
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    mpcore_bin = os.path.join(os.path.dirname(sys.executable), "mpcore")
    r = subprocess.run([mpcore_bin, "run", "--nproc-per-node", "2", str(path)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=scaled(180))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    lines = {d["rank"]: d for d in (json.loads(line.split(" ", 1)[1])
                                    for line in r.stdout.splitlines()
                                    if line.startswith("rank-line "))}
    assert set(lines) == {0, 1}, r.stdout
    assert lines[0]["ok"] and lines[1]["ok"]
    assert lines[0]["handle"] == lines[1]["handle"]
    assert lines[0]["inode"] is not None and lines[0]["inode"] == lines[1]["inode"]
    scenario.check_clean()


# --- the bench rows' table (the figures themselves live in `mpcore bench`) ----------

def test_the_memory_row_shows_every_variant_and_judges_both_targets():
    from mpcore.bench import cases, runner

    def variant(large, small, pss_large, pss_small):
        return {"large": {"uss_workers": large, "pss_total": pss_large, "uss_main": 1,
                          "epoch_s": 2.0},
                "small": {"uss_workers": small, "pss_total": pss_small, "uss_main": 1,
                          "epoch_s": 0.1},
                "uss_growth": large - small, "pss_growth": pss_large - pss_small}
    mb = 2**20
    torch_ex = {"items": 2000, "small_items": 2, "workers": 4, "one_copy": 1000 * mb,
                "plain": variant(800 * mb, 50 * mb, 2000 * mb, 200 * mb),
                "numpy": variant(300 * mb, 50 * mb, 900 * mb, 200 * mb)}
    mpcore_ex = {"items": 2000, "small_items": 2, "workers": 4, "one_copy": 1000 * mb,
                 "plain": variant(700 * mb, 40 * mb, 1900 * mb, 200 * mb),
                 "converted": variant(60 * mb, 40 * mb, 1500 * mb, 200 * mb)}
    res = {impl: [{"case": "shared-mem", "impl": impl, "value": e[k]["uss_growth"] / mb,
                   "n": 2000, "elapsed_s": 2.0, "extra": e}]
           for impl, e, k in (("torch", torch_ex, "plain"), ("mpcore", mpcore_ex, "converted"))}
    row = runner.summarize(cases.CASES["shared-mem"], res)
    table = runner.format_table([row])
    assert "750 MB / 250 MB / 660 MB / 20 MB" in table, table      # USS growth, all four
    assert "1,800 MB / 700 MB / 1,700 MB / 1,300 MB" in table, table
    assert "2.7% of torch's (target <= 5%): met" in table, table
    assert "1.30x one copy" in table and "MISSED" not in table, table


def _mem_row_doc(figures, one_copy, items=2_000_000, workers=4):
    """A bench JSON document with a shared-mem row whose growths (MB) are
    `figures`: {(side, variant): (USS growth, PSS growth)}."""
    from mpcore.bench import cases, runner
    mb = 2**20

    def variant(uss, pss):
        return {"large": {"uss_workers": (uss + 50) * mb, "pss_total": (pss + 200) * mb,
                          "uss_main": mb, "epoch_s": 2.0},
                "small": {"uss_workers": 50 * mb, "pss_total": 200 * mb, "uss_main": mb,
                          "epoch_s": 0.1},
                "uss_growth": uss * mb, "pss_growth": pss * mb}
    res = {}
    for side, main in (("torch", "plain"), ("mpcore", "converted")):
        ex = {"items": items, "small_items": items // 1000, "workers": workers,
              "one_copy": one_copy * mb}
        for (s, v), (uss, pss) in figures.items():
            if s == side:
                ex[v] = variant(uss, pss)
        res[side] = [{"case": "shared-mem", "impl": side, "value": ex[main]["uss_growth"] / mb,
                      "n": items, "elapsed_s": 2.0, "extra": ex}]
    return json.loads(json.dumps({"rows": [runner.summarize(cases.CASES["shared-mem"], res)]}))


def test_the_memory_chart_draws_the_rows_four_variants(tmp_path):
    """benchmarks/plot_shared_mem.py: the chart of a bench JSON's shared-mem
    row shows each variant's two growths and one copy, as text; a JSON
    without the row is an error that says which row to run."""
    import importlib.util
    require(importlib.util.find_spec("matplotlib") is not None,
            "the chart is drawn with matplotlib (mpcore[bench])")
    from mpcore.bench import plot_shared_mem
    doc = _mem_row_doc({("torch", "plain"): (704, 1577), ("torch", "numpy"): (3, 681),
                        ("mpcore", "plain"): (702, 1576), ("mpcore", "converted"): (0, 257)},
                       875)
    path = tmp_path / "mem.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "mem.svg"
    assert plot_shared_mem.main([str(path), str(out)]) == 0
    svg = out.read_text()
    for text in ("704 MB", "3 MB", "702 MB", "0 MB", "1,577 MB", "681 MB", "1,576 MB",
                 "257 MB", "one copy of the dataset: 875 MB", "torch, plain list",
                 "torch, detectron2-style numpy", "mpcore, plain list",
                 "mpcore, share_dataset=True", "2,000,000 small dicts"):
        assert text in svg, text
    (tmp_path / "none.json").write_text(json.dumps({"rows": []}))
    assert plot_shared_mem.main([str(tmp_path / "none.json"), str(tmp_path / "x.svg")]) == 1
    with pytest.raises(ValueError, match="--only shared-mem"):
        plot_shared_mem.figures({"rows": []})


def test_the_readmes_memory_chart_shows_the_figures_of_its_json():
    """docs/shared-mem.svg was drawn from docs/shared-mem.json: each of the
    JSON's figures is in it (rounded as the chart writes them)."""
    from mpcore.bench import plot_shared_mem
    docs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs")
    with open(os.path.join(docs, "shared-mem.json")) as f:
        figs, one, items, workers = plot_shared_mem.figures(json.load(f))
    with open(os.path.join(docs, "shared-mem.svg")) as f:
        svg = f.read()
    for uss, pss in figs.values():
        assert f">{uss:,.0f} MB<" in svg and f">{pss:,.0f} MB<" in svg, (uss, pss)
    assert f"one copy of the dataset: {one:,.0f} MB" in svg and f"{items:,} small dicts" in svg


def test_empty_containers_and_unusual_arrays_and_tensors():
    assert len(SharedList([])) == 0 and list(SharedList([])) == []
    assert len(SharedDict({})) == 0 and "a" not in SharedDict({}) and SharedDict({}) == {}
    rec = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])
    rec["a"] = [1, 2, 3]
    p = torch.nn.Parameter(torch.ones(3))
    src = [np.empty((0, 3)), torch.empty(0), np.array([True, False]), rec,
           np.array([1, "x", None], dtype=object), torch.ones(2, requires_grad=True), p,
           torch.eye(2).to_sparse(), np.float32(2.5), np.arange(10)[::3], torch.arange(10)[::3]]
    sl = SharedList(src)
    got = list(sl)
    assert got[0].shape == (0, 3) and got[1].shape == (0,)
    assert got[2].tolist() == [True, False] and got[3]["a"].tolist() == [1, 2, 3]
    assert got[3].dtype == rec.dtype
    assert got[4].tolist() == [1, "x", None]          # objects: pickled with the item
    assert got[5].requires_grad and got[5].is_leaf and torch.equal(got[5], src[5])
    assert type(got[6]) is torch.nn.Parameter and got[6].requires_grad
    assert got[7].is_sparse and torch.equal(got[7].to_dense(), torch.eye(2))
    assert got[8] == np.float32(2.5) and type(got[8]) is np.float32
    assert got[9].tolist() == [0, 3, 6, 9] and got[10].tolist() == [0, 3, 6, 9]


def test_a_shared_list_crosses_an_mpcore_queue_as_a_handle():
    sl = SharedList(_items(5))
    q = mpcore.Queue()
    q.put(sl)
    got = q.get(timeout=scaled(10))
    assert got.handle == sl.handle and _same(got[3], sl[3])


def test_stateful_loader_takes_the_keyword_too():
    from mpcore.data import StatefulDataLoader
    ds = _Meta(1100)
    loader = StatefulDataLoader(ds, batch_size=100, share_dataset=True)
    assert type(ds.items) is SharedList
    assert torch.cat([b[:, 0] for b in loader]).tolist() == list(range(1100))


def test_works_where_torch_is_not_installed(leak_check):
    from helpers import NO_TORCH_PRELUDE, run_program
    r = run_program(NO_TORCH_PRELUDE + r'''
import json, pickle, sys
import numpy as np
from mpcore.data import SharedDict, SharedList, share_dataset

sl = SharedList([{"a": np.arange(3)}, "x"])
back = pickle.loads(pickle.dumps(sl))
class DS:
    def __init__(self):
        self.items = list(range(2000))
ds = share_dataset(DS())
print("RESULT " + json.dumps({"a": back[0]["a"].tolist(), "x": sl[1],
                              "d": SharedDict({"k": 1})["k"], "ds": type(ds.items).__name__,
                              "torch": "torch" in sys.modules}))
''')
    res = program_result(r)
    assert res == {"a": [0, 1, 2], "x": "x", "d": 1, "ds": "SharedList", "torch": False}, res


# --- a dataset that travels once (NOTE [ A dataset travels once ] in _ship.py) ----------

SHIP_PROGRAM = TESTS_ON_PATH + r'''
import gc, json, multiprocessing, os, signal, sys
import numpy as np
import torch
torch.set_num_threads(1)
import mpcore
from mpcore.data import DataLoader, _ship, get_worker_info
from mpcore.shm import _blocks

MAIN = os.getpid() if __name__ == "__main__" else None
PICKLES = [0]
FLAG = sys.argv[2]  # a spawned worker has its parent's argv


def rebuild(n, t, arr, pad, how, conn):
    if how == "kill-while-unpickling":
        try:   # the first worker to unpickle dies in the middle of it
            os.close(os.open(FLAG, os.O_CREAT | os.O_EXCL))
            os.kill(os.getpid(), signal.SIGKILL)
        except FileExistsError:
            pass
    ds = DS.__new__(DS)
    ds.n, ds.t, ds.arr, ds.pad, ds.how, ds.conn = n, t, arr, pad, how, conn
    return ds


class DS(torch.utils.data.Dataset):
    """A tensor (it travels as a handle), a numpy array of 800 KB (each
    worker's own),
    3 MB of strings (so that its pickle has a segment of its own); counts
    its pickles in the main process."""
    def __init__(self, n, how=None, conn=None):
        self.n, self.how, self.conn = n, how, conn
        self.t = torch.arange(n) * 10
        self.arr = np.zeros(100_000, np.int64)  # large enough for a Queue to share it
        self.pad = [f"/data/{i:07d}.jpg" for i in range(100_000)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.how == "kill-mid-epoch" and i == 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([int(self.t[i]), int(self.arr[0]), get_worker_info().id,
                             len(self.pad)])

    def __reduce__(self):
        if os.getpid() == MAIN:
            PICKLES[0] += 1
        return (rebuild, (self.n, self.t, self.arr, self.pad, self.how, self.conn))


def init(worker_id):
    # each worker writes its own copy of the array: no other worker sees it
    get_worker_info().dataset.arr[0] = 100 + worker_id


def right(batches, n):
    rows = torch.cat(batches)
    return (rows[:, 0].tolist() == [10 * i for i in range(n)]
            and all(int(r[1]) == 100 + int(r[2]) for r in rows)
            and set(rows[:, 3].tolist()) == {100_000})


SHIPPED = []
_pack = _ship.pack


def maps():
    """(low, high, inode) of each mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            yield lo, hi, parts[4]


def pack(obj):
    s = _pack(obj)
    if s is not None:
        at = s._block.address
        SHIPPED.append((s._block.handle, next(i for lo, hi, i in maps() if lo <= at < hi)))
    return s


_ship.pack = pack


def settle():
    """Two round trips to the keeper: deaths before the first are handled."""
    for _ in range(2):
        try:
            mpcore._core.attach((0x5EED0001, 0, 1))
        except mpcore.HandleError:
            pass


def freed():
    """Whether the last shipment's block was freed and its memory given
    back (NOTE [ A disowned segment ] in arena.c): nothing here maps its
    segment, and the keeper knows the segment no more."""
    gc.collect()
    settle()
    (seg, index, gen), inode = SHIPPED[-1]
    if any(i == inode for _, _, i in maps()):
        return False
    try:   # a later generation: redeems no ticket, whatever the keeper says
        mpcore._core.attach((seg, index, gen + 2))
    except mpcore.HandleError as e:
        return "unknown shared-memory segment" in str(e)
    return False


def count(make, epochs=2):
    PICKLES[0] = 0
    loader = make()
    ok = all(right(list(loader), loader.dataset.n) for _ in range(epochs))
    del loader
    return {"pickles": PICKLES[0], "ok": ok, "freed": freed()}


if __name__ == "__main__":
    method = sys.argv[1]
    kw = dict(batch_size=8, num_workers=4, multiprocessing_context=method, worker_init_fn=init)
    res = {}
    ds = DS(96)
    res["loader"] = count(lambda: DataLoader(ds, **kw))
    res["persistent"] = count(lambda: DataLoader(ds, persistent_workers=True, **kw))
    res["recreated"] = count(lambda: DataLoader(ds, **kw), epochs=1)
    # an fd handed to each worker (a Pipe's end): pickled per worker, as before
    r, w = multiprocessing.Pipe(duplex=False)
    PICKLES[0] = 0
    loader = DataLoader(DS(96, conn=r), **kw)
    ok = right(list(loader), 96)
    res["per_worker"] = {"pickles": PICKLES[0], "ok": ok}
    del loader
    for how in ("kill-while-unpickling", "kill-mid-epoch"):
        err = None
        try:
            list(DataLoader(DS(96, how=how), **kw))
        except RuntimeError as e:
            err = str(e)
        res[how] = {"err": err, "freed": freed()}
    print("RESULT " + json.dumps(res), flush=True)
'''


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_zygote_workers_get_the_dataset_from_one_pickle(leak_check, scenario, method,
                                                        tmp_path):
    """4 'spawn' or 'forkserver' workers: the dataset is pickled once per
    loader (it was once per worker), once for the whole life of persistent
    workers, once more for a loader made again; its tensor reaches every
    worker, its numpy array is each worker's own copy, worker_init_fn gets
    the dataset the worker reads.  The block is freed once the workers have
    read it, also when one is killed while unpickling or mid-epoch; a
    dataset that hands an fd to its workers is pickled per worker, as
    before."""
    res = _check_program(scenario, SHIP_PROGRAM, method, str(tmp_path / "killed-one"),
                         timeout=300)
    assert res["loader"] == {"pickles": 2, "ok": True, "freed": True}, res
    assert res["persistent"] == {"pickles": 1, "ok": True, "freed": True}, res
    assert res["recreated"] == {"pickles": 1, "ok": True, "freed": True}, res
    # the one pickle, abandoned where the fd is asked for, then one per worker
    assert res["per_worker"] == {"pickles": 5, "ok": True}, res
    for how in ("kill-while-unpickling", "kill-mid-epoch"):
        assert res[how]["err"] and "killed by signal" in res[how]["err"], res
        assert res[how]["freed"], res


class _HoldsALock(torch.utils.data.Dataset):
    def __init__(self, pipe=False):
        import multiprocessing
        import threading
        if pipe:   # an fd handed to each worker first: pickled per worker (_ship.py)
            self.conn = multiprocessing.Pipe(duplex=False)[0]
        self.lock = threading.Lock()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_dataset_that_cannot_be_pickled_gives_torchs_error(leak_check, method):
    """The error torch's DataLoader raises at iter() for a dataset (or
    collate_fn) that cannot be pickled, the same type and message, after
    the same warnings (NOTE [ A pickle error at a worker's start ] in
    _ship.py), whether it is pickled once or per worker, and no worker left
    behind."""
    import warnings

    def errors(make):
        out = []
        for ds, collate in ((_HoldsALock(), None), (_Meta(8), lambda b: b),
                            (_HoldsALock(pipe=True), None)):
            loader = make(ds, batch_size=2, num_workers=2, multiprocessing_context=method,
                          collate_fn=collate)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                with pytest.raises(Exception) as e:
                    iter(loader)
            out.append((type(e.value), str(e.value),
                         [(w.category, str(w.message)) for w in said]))
        return out
    theirs = errors(torch.utils.data.DataLoader)
    ours = errors(mpcore.data.DataLoader)
    assert ours == theirs, (ours, theirs)
    assert "cannot pickle '_thread.lock' object" in theirs[0][1], theirs
    if "Got pickle error" in str(theirs[0][2]):   # the torches that warn: each case did
        assert all(len(warned) == 1 for _, _, warned in theirs), theirs


def test_torchs_warning_for_a_pickle_error_is_read_from_its_handler():
    """What warn_start_error gives is what torch's handler says, read from
    its source: the types it catches, its message and its category; a
    function without such a handler gives none."""
    import warnings
    from mpcore.data import _ship

    def theirs(self):
        from pickle import PicklingError
        try:
            self.start()
        except (TypeError, PicklingError):
            warnings.warn("Got pickle error: " "two literals", RuntimeWarning, stacklevel=2)
            raise

    def plain(self):
        try:
            self.start()
        except TypeError:
            warnings.warn("another handler")
            raise
    assert _ship._handler_warning(theirs) == ((TypeError, pickle.PicklingError),
                                              "Got pickle error: two literals", RuntimeWarning)
    assert _ship._handler_warning(plain) == ((), None, None)


def _given_back(handle):
    """Whether the block `handle`, made here, was freed and its segment
    retired (NOTE [ A disowned segment ] in arena.c): the keeper knows it no
    more."""
    import gc
    gc.collect()
    seg, index, gen = handle
    try:   # a later generation: redeems no ticket, whatever the keeper says
        mpcore._core.attach((seg, index, gen + 2))
    except mpcore.HandleError as e:
        return "unknown shared-memory segment" in str(e)
    return False


def test_a_shipment_is_read_back_and_freed_with_its_ring_when_no_worker_took_it():
    """The shipment's tickets travel with the messages: one read back gives
    the object (its tensor the same memory); one never taken is dropped
    when its ring is freed, and then nothing holds the block."""
    from mpcore.data import _ship
    from mpcore.queue import _queue
    ds = {"t": torch.arange(1000), "pad": [f"/data/{i:07d}.jpg" for i in range(100_000)],
          "arr": np.arange(100_000)}
    s = _ship.pack(ds)
    handle = s._block.handle
    taken, left = _queue.Queue(capacity=64 << 10), _queue.Queue(capacity=64 << 10)
    s.send(_queue.ring_of(taken))
    s.send(_queue.ring_of(left))
    s.close()
    got = _ship.receive(_queue.ring_of(taken))
    assert got["pad"] == ds["pad"] and torch.equal(got["t"], ds["t"])
    assert got["t"].data_ptr() == ds["t"].data_ptr()      # one storage in one process
    assert np.array_equal(got["arr"], ds["arr"]) and not np.shares_memory(got["arr"], ds["arr"])
    from mpcore.shm import _blocks
    # the message left in a ring holds the block: not freed, its segment known
    assert not _given_back(handle)
    del left
    assert _given_back(handle)
