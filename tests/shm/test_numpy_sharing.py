"""numpy arrays in mpcore shared memory: mpcore.empty / zeros /
share_memory_, and arrays crossing Queues and Process arguments.

This module does not import torch: its spawn children, and the fresh
programs that run its scenarios, show that numpy sharing works without it.
Scenarios that start processes are module-level functions taking a start
method; under fork they run in the pytest process, under spawn as a fresh
program (spawning from pytest would leave multiprocessing's resource
tracker behind as a child of pytest).  Every test reaps its children.
"""
import sys
import traceback
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import mpcore
from helpers import mpcore_ranges, reap, result, run_scenario, scaled

MODULE = __name__
METHODS = ["fork", "spawn"]
THRESHOLD = 64 * 1024


# --- helpers ------------------------------------------------------------

def in_mpcore_memory(a):
    """Whether the array's bytes lie in an mpcore memfd mapping."""
    lo = a.__array_interface__["data"][0]
    hi = lo
    for n, s in zip(a.shape, a.strides):
        if s > 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    hi += a.itemsize
    return any(x <= lo and hi <= y for x, y in mpcore_ranges())


def address(a):
    return a.__array_interface__["data"][0]


def _run_child(result_q, fn_name, *args):
    try:
        out = globals()[fn_name](*args)
    except BaseException:
        result_q.put(("error", traceback.format_exc()))
        raise
    result_q.put(("ok", out))


# --- one process --------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32", "int64", "int32", "uint8",
                                   "bool", "complex128", np.dtype([("a", "i4"), ("b", "f8")])])
def test_zeros_and_empty(dtype):
    z = mpcore.zeros((3, 5), dtype)
    assert isinstance(z, np.ndarray) and z.dtype == np.dtype(dtype) and z.shape == (3, 5)
    assert z.flags.c_contiguous and z.flags.writeable
    assert in_mpcore_memory(z)
    assert not np.any(z.view(np.uint8))
    assert mpcore.share_memory_(z) is z
    e = mpcore.empty(7, dtype)
    assert e.shape == (7,) and e.dtype == np.dtype(dtype) and in_mpcore_memory(e)
    e[...] = np.ones(7).astype(e.dtype) if e.dtype.names is None else (1, 1.0)
    assert e[3] == e[6]


def test_defaults_and_bad_shapes():
    assert mpcore.zeros(4).dtype == np.float64
    assert mpcore.empty((2, 2)).dtype == np.float64
    z = mpcore.zeros((0, 3), "int32")
    assert z.shape == (0, 3) and z.size == 0
    with pytest.raises(ValueError):
        mpcore.zeros((2, -1))
    with pytest.raises(TypeError):
        mpcore.share_memory_([1, 2, 3])


def test_share_memory_returns_a_shared_copy():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    s = mpcore.share_memory_(a)
    assert s is not a and not np.shares_memory(s, a)
    assert s.dtype == a.dtype and s.shape == a.shape and np.array_equal(s, a)
    assert in_mpcore_memory(s) and not in_mpcore_memory(a)
    s[0, 0] = 100
    assert a[0, 0] == 0
    # Already shared: the array itself, views of it too.
    assert mpcore.share_memory_(s) is s
    v = s[1:, ::2]
    assert mpcore.share_memory_(v) is v
    # A non-contiguous source gives an equal copy.
    nc = np.arange(40.0)[::4]
    snc = mpcore.share_memory_(nc)
    assert np.array_equal(snc, nc) and in_mpcore_memory(snc)


def test_shared_array_pickles_as_a_small_handle():
    s = mpcore.zeros(1 << 17)       # 1 MB
    s[:] = np.arange(1 << 17)
    data = ForkingPickler.dumps(s)
    assert len(data) < 4096, len(data)
    back = ForkingPickler.loads(data)
    assert address(back) == address(s) and np.array_equal(back, s)
    v = s[10:1000:3]
    back = ForkingPickler.loads(ForkingPickler.dumps(v))
    assert address(back) == address(v) and back.strides == v.strides
    assert np.array_equal(back, v)
    # An ordinary array pickled outside a Queue is pickled by value.
    a = np.ones(1 << 17)
    assert len(ForkingPickler.dumps(a)) > a.nbytes


def test_queue_copies_large_arrays_once_and_small_ones_inline():
    q = mpcore.Queue()
    big = np.arange(THRESHOLD // 8, dtype=np.float64)          # exactly 64 KB
    small = np.arange(THRESHOLD // 8 - 1, dtype=np.float64)    # just under
    blocks = mpcore.stats()["shm_blocks_allocated"]
    q.put(big)
    assert mpcore.stats()["shm_blocks_allocated"] == blocks + 1   # one copy
    assert not in_mpcore_memory(big)        # the sender's array stays as it was
    q.put(small)
    assert mpcore.stats()["shm_blocks_allocated"] == blocks + 1
    rb, rs = q.get(timeout=scaled(10)), q.get(timeout=scaled(10))
    assert np.array_equal(rb, big) and np.array_equal(rs, small)
    assert in_mpcore_memory(rb) and not in_mpcore_memory(rs)
    # The received copy is the receiver's: writing it leaves the sender's.
    rb[0] = -1
    assert big[0] == 0
    # A shared array travels by handle: the same memory.
    s = mpcore.zeros((4, 1000), "int32")
    q.put(s)
    r = q.get(timeout=scaled(10))
    assert address(r) == address(s)
    r[2, 5] = 7
    assert s[2, 5] == 7


@pytest.mark.parametrize("make", [
    lambda: np.arange(100_000.0)[::3],
    lambda: np.asfortranarray(np.arange(100_000.0).reshape(100, 1000)),
    lambda: np.arange(100_000.0)[::-1],
    lambda: np.zeros(20_000, dtype=[("a", "i4"), ("b", "f8")]) ,
    lambda: np.arange(50_000, dtype=np.complex64).reshape(50, 1000).T,
], ids=["strided", "fortran", "reversed", "structured", "transposed"])
def test_queue_large_array_layouts(make):
    a = make()
    assert a.nbytes >= THRESHOLD
    q = mpcore.Queue()
    q.put(a)
    r = q.get(timeout=scaled(10))
    assert r.dtype == a.dtype and r.shape == a.shape and np.array_equal(r, a)


def test_queue_large_object_array_is_pickled():
    """Arrays of Python objects cannot live in shared memory, but are as
    picklable as with multiprocessing.Queue: they must arrive by value."""
    a = np.array(["x" * (i % 7) for i in range(10_000)], dtype=object)
    assert a.nbytes >= THRESHOLD
    q = mpcore.Queue()
    q.put(a)
    r = q.get(timeout=scaled(10))
    assert r.dtype == object and r.shape == a.shape and list(r) == list(a)
    small = np.array([1, "two", None], dtype=object)
    q.put(small)
    assert list(q.get(timeout=scaled(10))) == [1, "two", None]


# --- across processes -----------------------------------------------------

def _child_writes(arg_shared, q_in, q_out):
    report = {"arg": arg_shared.tolist()}
    arg_shared += 1                         # through Process args
    s, big, small = q_in.get(timeout=scaled(60))    # through a Queue
    report["shared_is_shared"] = mpcore.share_memory_(s) is s
    report["big_is_shared"] = mpcore.share_memory_(big) is big
    report["big_sum"] = float(big.sum())
    report["small"] = small.tolist()
    s[:] = -5
    big[:] = 0                              # a copy: the sender's stays
    small[:] = 0
    mine = mpcore.zeros((2, 3), "int16")    # a shared array made here
    mine[1] = [1, 2, 3]
    return report, mine, mine[1, 1:]


def scenario_children_see_writes(method):
    ctx = mpcore.get_context(method)
    arg_shared = mpcore.zeros(5, "int64")
    s = mpcore.empty((2, 2), "float32")
    s[:] = 3
    big = np.ones(20_000)                   # 160 KB, not shared
    small = np.arange(4)
    q_in, q_out = mpcore.Queue(), mpcore.Queue()
    p = ctx.Process(target=_run_child, args=(q_out, "_child_writes", arg_shared, q_in, q_out))
    try:
        p.start()
        q_in.put((s, big, small))
        report, mine, tail = result(q_out, [p])
        p.join(scaled(60))
        assert p.exitcode == 0
    finally:
        reap([p])
    assert report == {"arg": [0] * 5, "shared_is_shared": True, "big_is_shared": True,
                      "big_sum": 20_000.0, "small": [0, 1, 2, 3]}
    assert arg_shared.tolist() == [1] * 5
    assert s.tolist() == [[-5, -5], [-5, -5]]
    assert big.sum() == 20_000 and small.tolist() == [0, 1, 2, 3]
    # The child's array outlives the child, and its view is of the same memory.
    assert mine.tolist() == [[0, 0, 0], [1, 2, 3]] and in_mpcore_memory(mine)
    assert tail.tolist() == [2, 3]
    mine[1, 2] = 30
    assert tail.tolist() == [2, 30]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", METHODS)
def test_children_see_and_make_writes(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_children_see_writes", method, runner=scenario_runner)


def _child_sends_and_exits(q):
    s = mpcore.zeros(1000, "float64")
    s[:] = np.arange(1000)
    q.put({"shared": s, "big": np.full(50_000, 2.5), "small": np.array([1, 2])})


def scenario_sender_exits_first(method):
    ctx = mpcore.get_context(method)
    q = mpcore.Queue()
    p = ctx.Process(target=_child_sends_and_exits, args=(q,))
    try:
        p.start()
        p.join(scaled(90))
        assert p.exitcode == 0
        msg = q.get(timeout=scaled(60))
    finally:
        reap([p])
    assert np.array_equal(msg["shared"], np.arange(1000.0))
    assert msg["big"].shape == (50_000,) and np.all(msg["big"] == 2.5)
    assert msg["small"].tolist() == [1, 2]
    msg["shared"][0] = 9
    assert msg["shared"][0] == 9


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", METHODS)
def test_sender_may_exit_before_receiver_gets(method, leak_check, scenario_runner):
    run_scenario(MODULE, "scenario_sender_exits_first", method, runner=scenario_runner)


def scenario_torch_free(method):
    assert "torch" not in sys.modules
    test_zeros_and_empty("float32")
    test_share_memory_returns_a_shared_copy()
    test_shared_array_pickles_as_a_small_handle()
    test_queue_copies_large_arrays_once_and_small_ones_inline()
    scenario_children_see_writes(method)
    scenario_sender_exits_first(method)
    assert "torch" not in sys.modules


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_works_without_torch(method, leak_check):
    run_scenario(MODULE, "scenario_torch_free", method, fresh=True, torch_free=True)
