"""The DataLoader's C parts on their own: the pool's books (csrc/pool.c via
_core.Pool), collation into a block (csrc/py_collate.c), and mpcore.data
where torch is missing or where `mpcore run` serves torch's names."""
import struct
import sys

import numpy as np
import pytest

from mpcore import Queue, _core
from mpcore.queue import _queue
from mpcore.data import _collate, _worker

from helpers import NO_TORCH_PRELUDE, run_in_session, scaled

HEADER = _worker.HEADER


def make_pool(nworkers=3, prefetch=2, in_order=True):
    q = Queue()
    ring = _queue.ring_of(q)
    return _core.Pool(ring, nworkers, prefetch, in_order), ring


def send(ring, task, worker, kind=_worker.PICKLED, body=b"", refs=()):
    ring.put(list(refs), HEADER.pack(task, worker, kind) + body)


# --- the wire format ----------------------------------------------------------

def test_the_worker_header_is_the_cores_struct():
    # mpc_pool_msg in mpcore.h is the one definition; the worker's struct
    # format must lay its fields where C does.
    assert struct.calcsize(HEADER.format) == _core.POOL_HEADER_SIZE == 16
    packed = HEADER.pack(0x0102030405060708, 0x11223344, 0x55667788)
    task_at, worker_at, kind_at = (_core.POOL_HEADER_TASK, _core.POOL_HEADER_WORKER,
                                   _core.POOL_HEADER_KIND)
    assert int.from_bytes(packed[task_at:task_at + 8], "little") == 0x0102030405060708
    assert int.from_bytes(packed[worker_at:worker_at + 4], "little") == 0x11223344
    assert int.from_bytes(packed[kind_at:kind_at + 4], "little") == 0x55667788
    kinds = [_worker.COLLATED, _worker.PICKLED, _worker.ERROR, _worker.END, _worker.RESUME,
             _worker.DIED]
    assert kinds == [_core.POOL_COLLATED, _core.POOL_PICKLED, _core.POOL_ERROR,
                     _core.POOL_END, _core.POOL_RESUME, _core.POOL_DIED]
    assert len(set(kinds)) == len(kinds)


# --- dispatch and reassembly --------------------------------------------------

def test_dispatch_is_round_robin_up_to_the_prefetch_bound():
    pool, _ = make_pool(3, 2)
    got = [pool.dispatch() for _ in range(6)]
    assert got == [(i % 3, i) for i in range(6)]
    with pytest.raises(OSError, match="in flight"):
        pool.dispatch()
    assert pool.outstanding == 6


def test_results_are_handed_out_in_task_order():
    pool, ring = make_pool(3, 2)
    for _ in range(6):
        pool.dispatch()
    for task in (2, 1, 5, 0, 4, 3):
        send(ring, task, task % 3, body=bytes([task]))
    out = []
    for _ in range(6):
        worker, kind, task, refs, payload = pool.next(scaled(1.0))
        pool.delivered(worker)
        out.append((worker, task, payload))
    assert out == [(t % 3, t, bytes([t])) for t in range(6)]
    assert pool.kept == 0 and pool.outstanding == 0
    assert pool.next(0) is None  # the epoch is over


def test_out_of_order_hands_results_out_as_they_come():
    pool, ring = make_pool(2, 2, in_order=False)
    for _ in range(4):
        pool.dispatch()
    for task in (3, 0, 2, 1):
        send(ring, task, task % 2)
    assert [pool.next(scaled(1.0))[2] for _ in range(4)] == [3, 0, 2, 1]
    assert pool.next(0) is None


def test_out_of_order_skips_a_worker_holding_its_share():
    pool, _ = make_pool(2, 2, in_order=False)
    first = [pool.dispatch() for _ in range(4)]
    assert [w for w, _ in first] == [0, 1, 0, 1]


def test_an_ended_worker_gets_no_more_tasks_and_its_tasks_are_skipped():
    pool, ring = make_pool(2, 2)
    for _ in range(4):
        pool.dispatch()  # tasks 0, 2 -> worker 0; 1, 3 -> worker 1
    send(ring, 0, 0, kind=_worker.END)
    worker, kind, task, refs, payload = pool.next(scaled(1.0))
    assert (worker, kind, task) == (0, _worker.END, 0)
    assert not pool.active(0)
    assert pool.dispatch() == (1, 4)
    for task in (1, 3, 4):
        send(ring, task, 1)
    assert [pool.next(scaled(1.0))[2] for _ in range(3)] == [1, 3, 4]  # 2 is never coming
    assert pool.next(0) is None


def test_nothing_arrives_in_time():
    import queue
    pool, _ = make_pool(1, 1)
    pool.dispatch()
    with pytest.raises(queue.Empty):
        pool.next(0.05)


def test_a_result_for_no_task_is_an_error():
    pool, ring = make_pool(1, 1)
    pool.dispatch()
    send(ring, 7, 0)
    with pytest.raises(ValueError, match="task 7"):
        pool.next(scaled(1.0))


@pytest.mark.parametrize("tickets", [1, 3])
def test_reset_drops_kept_results_and_their_blocks(tickets):
    # Several tickets of one block: a batch of tensors that share a block.
    pool, ring = make_pool(2, 1)
    pool.dispatch(), pool.dispatch()
    block = _core.alloc(1 << 16)
    refs = [block.ticket() for _ in range(tickets)]
    handle = block.handle
    del block
    send(ring, 1, 1, refs=refs)  # arrives early: kept
    with pytest.raises(Exception):
        pool.next(0.05)
    assert pool.kept == 1
    pool.reset()
    assert pool.kept == 0
    with pytest.raises(_core.HandleError):
        _core.attach(handle + ())  # the block's last ticket is gone


def test_a_full_journal_still_drops_what_the_process_holds():
    # NOTE [ A full journal ]: more tickets in transit than a journal holds
    # (1024), as a pool keeping many batches of many tensors has.  The
    # tickets past it are still dropped: by drop_journaled, and by a pool
    # dropping a kept result on reset.
    pool, ring = make_pool(2, 1)  # its queue gives the process its journal
    pool.dispatch(), pool.dispatch()
    filler = _core.alloc(64)
    filler_handle = filler.handle
    refs = [filler.ticket(True) for _ in range(1500)]
    del filler
    block = _core.alloc(1 << 16)
    ref = block.ticket()
    handle = block.handle
    del block
    send(ring, 1, 1, refs=[ref])  # arrives early: kept, its ticket journaled past the 1024
    with pytest.raises(Exception):
        pool.next(0.05)
    pool.reset()
    with pytest.raises(_core.HandleError):
        _core.attach(handle + ())
    _core.drop_journaled(refs)
    with pytest.raises(_core.HandleError):
        _core.attach(filler_handle + ())  # all 1500 were dropped


# --- collation into a block ---------------------------------------------------

def rebuild_np(skeleton, block):
    """The batch as numpy views of its block (what a program without torch
    gets)."""
    return _collate._walk(skeleton, lambda off, dt, shape: block.array(np.dtype(dt), shape,
                                                                       None, off))


def collate_np(samples):
    got = _core.collate(samples, None, None, None)
    return None if got is None else rebuild_np(got[1], got[0])


def test_numbers_and_arrays_collate_as_numpy_without_torch_hooks():
    out = collate_np([{"i": 1, "f": 0.5, "b": True, "a": np.arange(3, dtype=np.int16)},
                      {"i": 2, "f": 2, "b": False, "a": np.arange(3, 6, dtype=np.int16)}])
    assert out["i"].dtype == np.int64 and out["i"].tolist() == [1, 2]
    assert out["f"].dtype == np.float64 and out["f"].tolist() == [0.5, 2.0]
    assert out["b"].dtype == np.bool_ and out["b"].tolist() == [True, False]
    assert out["a"].dtype == np.int16 and out["a"].tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("samples", [
    [1, 2.5],                       # torch.tensor of mixed numbers: torch decides
    [True, 2],
    [1, 1 << 70],                   # does not fit int64
    [np.ones(3), np.ones(4)],       # shapes differ: torch raises its own error
    [np.ones(3), np.ones(3, np.float32)],
    [np.ones((3, 3))[:, 0], np.ones(3)],  # not contiguous
    [{"a": 1}, {"b": 1}],           # keys differ
    [[1, 2], [1]],                  # lengths differ
    [object(), object()],
    [None, None],
    [np.array(["a"]), np.array(["b"])],
])
def test_what_collate_does_not_take_goes_back_to_the_caller(samples):
    assert _core.collate(samples, None, None, None) is None


def test_strings_in_a_sequence_stay_tuples_in_a_dict_lists():
    block, skel = _core.collate([("a", {"s": b"x"}), ("b", {"s": b"y"})], None, None, None)
    assert rebuild_np(skel, block) == [("a", "b"), {"s": [b"x", b"y"]}]


def test_a_deep_structure_goes_back_to_the_caller():
    deep = 1
    for _ in range(100):
        deep = [deep]
    assert _core.collate([deep, deep], None, None, None) is None


def _dict_of_small_tensors(torch, i):
    # dl-dicts' samples: 16 keys of 4 kinds, interleaved, and two numbers
    kinds = [lambda: torch.full((8,), float(i)), lambda: torch.full((4,), i, dtype=torch.int64),
             lambda: torch.full((2, 3), float(-i)), lambda: torch.tensor(i, dtype=torch.int32)]
    out = {f"k{j:02d}": kinds[j % 4]() for j in range(16)}
    out["n"], out["x"] = i, i / 4
    return out


def _collate_counting_stacks(torch, samples):
    """The lengths of the columns each stack call got, and the batch
    collated into a block and rebuilt over it."""
    calls = []
    stack = _collate._Stacker()

    def counting(column, *rest):
        calls.append(len(column))
        stack(column, *rest)
    block, skel = _core.collate(samples, torch.Tensor, _collate._tensor_info, counting)
    return calls, _collate.rebuild(skel, block)


def test_tensor_leaves_of_one_dtype_and_shape_are_stacked_by_one_call():
    # NOTE [ One stack per group ]: 16 tensor leaves of 4 kinds cost 4 stack
    # calls, and the batch is default_collate's in dtype, shape, values and
    # key order.
    torch = pytest.importorskip("torch")
    from torch.utils.data import default_collate
    samples = [_dict_of_small_tensors(torch, i) for i in range(5)]
    calls, got = _collate_counting_stacks(torch, samples)
    want = default_collate(samples)
    assert calls == [4 * 5] * 4
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k
    # each leaf is its own range of the block, not a view of its group's
    ptrs = sorted((got[k].data_ptr(), got[k].nbytes) for k in want)
    assert all(a + n <= b for (a, n), (b, _) in zip(ptrs, ptrs[1:]))


def test_samples_of_many_shapes_search_only_the_first_groups():
    # 40 tensor leaves of 40 shapes, then one of the first shape (it joins
    # that group) and one of the 36th (beyond the groups searched: a group
    # of its own).  The batch is default_collate's either way.
    torch = pytest.importorskip("torch")
    from torch.utils.data import default_collate
    samples = [[torch.full((k + 1,), i * 100 + k) for k in range(40)]
               + [torch.full((1,), -i), torch.full((36,), -i)] for i in range(3)]
    calls, got = _collate_counting_stacks(torch, samples)
    want = default_collate(samples)
    assert sorted(calls) == [3] * 40 + [6]
    assert len(got) == len(want) == 42
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


def test_a_group_whose_later_leaf_differs_goes_back_to_the_caller():
    # The first sample puts "a" and "b" in one group; a later sample's "b"
    # has another shape: the group's stack fails, and default_collate says why.
    torch = pytest.importorskip("torch")
    samples = [{"a": torch.zeros(2), "b": torch.zeros(2)},
               {"a": torch.zeros(2), "b": torch.zeros(3)}]
    assert _core.collate(samples, torch.Tensor, _collate._tensor_info, _collate._Stacker()) \
        is None


# --- without torch, and under mpcore run ---------------------------------------

NO_TORCH = NO_TORCH_PRELUDE + '''
from collections import namedtuple
import numpy as np
from mpcore.data import DataLoader, Dataset, IterableDataset, get_worker_info

P = namedtuple("P", "x y")

class Squares(Dataset):
    def __len__(self):
        return 50
    def __getitem__(self, i):
        return {"i": i, "sq": np.full(2, i * i, np.float32), "p": P(float(i), f"s{i}")}

class Shards(IterableDataset):
    def __iter__(self):
        w = get_worker_info()
        return iter(range(w.id, 20, w.num_workers))

def flat(batches, key):
    return [v for b in batches for v in b[key].tolist()]

if __name__ == "__main__":
    one = list(DataLoader(Squares(), batch_size=8))
    two = list(DataLoader(Squares(), batch_size=8, num_workers=2))
    shuffled = list(DataLoader(Squares(), batch_size=8, shuffle=True, num_workers=2))
    shards = list(DataLoader(Shards(), batch_size=4, num_workers=2))
    print("REPORT", repr((
        type(two[0]["i"]).__name__, str(two[0]["sq"].dtype), two[-1]["sq"].shape,
        flat(one, "i") == flat(two, "i") == list(range(50)),
        [b["p"].y == a["p"].y for a, b in zip(one, two)] == [True] * 7,
        type(two[0]["p"]).__name__, sorted(flat(shuffled, "i")) == list(range(50)),
        sorted(v for b in shards for v in b.tolist()), "torch" in sys.modules)))
'''


@pytest.mark.timeout(120)
def test_loader_without_torch_gives_numpy_batches(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(NO_TORCH)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MPCORE_")}
    r = run_in_session([sys.executable, script], cwd=tmp_path, env=env, timeout=90)
    assert r.returncode == 0, r.stderr
    line = [l for l in r.stdout.splitlines() if l.startswith("REPORT ")][0]
    got = eval(line[len("REPORT "):])
    assert got == ("ndarray", "float32", (2, 2), True, True, "P", True, list(range(20)), False)


RUN = '''
import torch
import torch.utils.data as tud
import mpcore.data

class Tens(tud.Dataset):
    def __len__(self):
        return 10
    def __getitem__(self, i):
        return torch.full((2,), i)

loader = tud.DataLoader(Tens(), batch_size=5, num_workers=2)
batches = list(loader)
print("REPORT", repr((tud.DataLoader is mpcore.data.DataLoader,
                      tud.dataloader.DataLoader is mpcore.data.DataLoader,
                      isinstance(loader, tud.dataloader.DataLoader.__mro__[1]),
                      [b.tolist() for b in batches], loader.stats()["batches"],
                      tud.get_worker_info is mpcore.data.get_worker_info)))
'''


@pytest.mark.timeout(120)
def test_mpcore_run_serves_torch_dataloader(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(RUN)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MPCORE_")}
    mpcore_cmd = [sys.executable, "-m", "mpcore", "run", str(script)]
    r = run_in_session(mpcore_cmd, cwd=tmp_path, env=env, timeout=90)
    assert r.returncode == 0, r.stderr
    line = [l for l in r.stdout.splitlines() if l.startswith("REPORT ")][0]
    got = eval(line[len("REPORT "):])
    rows = [[[i, i] for i in range(5)], [[i, i] for i in range(5, 10)]]
    assert got == (True, True, True, rows, 2, True)


# --- watching workers (NOTE [ Watching workers ] in pool.c) --------------------

def _sleeper(grandchild):
    """A process to watch, and a way to reap it: our child, or (grandchild)
    one whose parent is a shell that is not us."""
    import subprocess
    if not grandchild:
        p = subprocess.Popen(["sleep", "60"])
        return p.pid, p.wait
    sh = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
    pid = int(sh.stdout.readline())
    return pid, lambda: (sh.wait(), sh.stdout.close())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("grandchild", [False, True], ids=["child", "not-a-child"])
def test_a_watched_worker_that_dies_wakes_the_wait_at_once(grandchild):
    import os
    import signal
    import threading
    import time
    pool, ring = make_pool(2, 1)
    pool.dispatch(), pool.dispatch()
    pid, reap = _sleeper(grandchild)
    other, reap_other = _sleeper(False)
    try:
        pool.watch(0, other)
        pool.watch(1, pid)
        killed = []

        def kill():
            time.sleep(0.3)  # let the main thread be asleep in next()
            killed.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        t = threading.Thread(target=kill)
        t.start()
        worker, kind, task, refs, payload = pool.next(scaled(10.0))
        woke = time.monotonic()
        t.join()
        assert (worker, kind, refs, payload) == (1, _worker.DIED, None, None)
        assert woke - killed[0] < scaled(1.0)
        with pytest.raises(OSError, match="already being watched"):
            pool.watch(1, pid)
        pool.unwatch()
        os.kill(other, signal.SIGKILL)
        reap_other()
        import queue
        with pytest.raises(queue.Empty):  # unwatched: nothing more comes
            pool.next(0.3)
    finally:
        for p in (pid, other):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap()
        reap_other()


def test_watching_a_process_that_is_gone_is_an_error():
    import subprocess
    pool, _ = make_pool(1, 1)
    p = subprocess.Popen(["true"])
    p.wait()
    with pytest.raises(ProcessLookupError):
        pool.watch(0, p.pid)
    with pytest.raises(ValueError, match="worker 3"):
        pool.watch(3, 1)


class _Gate:
    """Sample 2 waits until the test writes to a FIFO."""

    def __init__(self, fifo):
        self.fifo = fifo

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            import os
            fd = os.open(self.fifo, os.O_RDONLY)
            os.read(fd, 1)
            os.close(fd)
        return i


class _Counting:
    """A Pool whose next() calls are counted."""

    def __init__(self, pool):
        self.pool, self.calls = pool, 0

    def next(self, *args):
        self.calls += 1
        return self.pool.next(*args)

    def __getattr__(self, name):
        return getattr(self.pool, name)


@pytest.mark.timeout(60)
def test_the_loader_waits_for_a_slow_batch_in_one_call(tmp_path, leak_check):
    # NOTE [ Waiting for results ]: no periodic wake-up while a worker is
    # busy.  The second is how long the batch is held back, not a wait for
    # an event; a loader that looked at its workers every 0.1 s would call
    # into the pool about ten times.
    import os
    import threading
    import time
    from mpcore.data import DataLoader
    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    loader = DataLoader(_Gate(fifo), batch_size=1, num_workers=1, multiprocessing_context="fork")
    it = iter(loader)
    assert [int(next(it)), int(next(it))] == [0, 1]
    it._pool = counting = _Counting(it._pool)

    def release():
        time.sleep(1.0)
        fd = os.open(fifo, os.O_WRONLY)
        os.write(fd, b"x")
        os.close(fd)

    t = threading.Thread(target=release)
    t.start()
    assert int(next(it)) == 2
    t.join()
    assert counting.calls == 1
    assert int(next(it)) == 3
    del it, loader
