"""mpcore.Queue, SimpleQueue and JoinableQueue: parity with
multiprocessing's.

Scenarios that start processes are module-level functions taking a start
method.  Under fork they run inside the pytest process; under spawn they run
as a fresh program that imports this module (spawning from the pytest
process would leave multiprocessing's resource tracker behind as a child of
pytest).  Children report through queues or pipes; every test reaps its
children even when it fails.  Time bounds here only stop hangs, except one
loose lower bound on a get() timeout.
"""
import os
import queue
import sys
import time
import traceback

import pytest

import mpcore
from helpers import reap, run_in_session, run_program, run_scenario, scaled

MODULE = __name__
METHODS = ["fork", "spawn"]


class Point:
    """A picklable user class (module-level, so children can import it)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)


# --- helpers ------------------------------------------------------------

def _run_child(result_q, fn_name, *args):
    try:
        out = globals()[fn_name](*args)
    except BaseException:
        result_q.put(("error", traceback.format_exc()))
        raise
    result_q.put(("ok", out))


def start(ctx, procs, fn_name, result_q, *args):
    p = ctx.Process(target=_run_child, args=(result_q, fn_name) + args)
    procs.append(p)
    p.start()
    return p


def join_all(procs):
    for p in procs:
        p.join(scaled(60))
    assert [p.exitcode for p in procs] == [0] * len(procs)


# --- one process --------------------------------------------------------

def test_exceptions_are_the_queue_modules():
    assert mpcore.Empty is queue.Empty
    assert mpcore.Full is queue.Full


OBJECTS = [
    None, True, 0, -1, 2 ** 100, 3.25, float("inf"), 1 + 2j, "", "text", "ünï©ødé",
    b"", b"\x00\xff" * 10, bytearray(b"abc"), (), (1, (2, (3,))), [1, [2, [3]]],
    {"a": 1, (1, 2): [3, {4}]}, {1, 2, 3}, frozenset({"x"}), range(3, 9, 2),
    Point(1, "y"), [Point(i, i) for i in range(5)], ValueError("boom"),
]


def _same(a, b):
    if isinstance(a, BaseException):
        return type(a) is type(b) and a.args == b.args
    return type(a) is type(b) and a == b


def test_put_get_roundtrip_in_order():
    q = mpcore.Queue()
    assert q.empty() and q.qsize() == 0
    for obj in OBJECTS:
        q.put(obj)
    assert q.qsize() == len(OBJECTS) and not q.empty() and not q.full()
    got = [q.get(timeout=scaled(10)) for _ in OBJECTS]
    bad = [(a, b) for a, b in zip(OBJECTS, got) if not _same(a, b)]
    assert not bad, bad
    assert q.empty() and q.qsize() == 0


def test_get_on_empty_queue_raises_empty():
    q = mpcore.Queue()
    with pytest.raises(queue.Empty):
        q.get(block=False)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(False, 5)     # timeout is ignored when not blocking
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    # Loose: a timed get must not give up long before its timeout.
    assert time.monotonic() - t0 >= 0.1
    with pytest.raises(queue.Empty):
        q.get(True, 0)
    q.put_nowait("x")
    assert q.get_nowait() == "x"
    q.put("y", block=False)
    assert q.get(block=False) == "y"
    q.put("z", timeout=1)
    assert q.get(timeout=scaled(1)) == "z"


def test_maxsize():
    q = mpcore.Queue(2)
    assert not q.full()
    q.put(1)
    q.put(2)
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    with pytest.raises(queue.Full):
        q.put(3, block=False)
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.1)
    assert q.qsize() == 2
    assert q.get() == 1
    assert not q.full()
    q.put(3)
    assert [q.get(), q.get()] == [2, 3]
    assert q.empty() and not q.full()
    for maxsize in (0, -1):
        u = mpcore.Queue(maxsize)
        for i in range(100):
            u.put_nowait(i)
        assert not u.full() and u.qsize() == 100
        assert [u.get_nowait() for _ in range(100)] == list(range(100))


def test_unbounded_queue_holds_more_than_its_ring():
    """multiprocessing.Queue(maxsize=0) is infinite: put never raises Full
    and never blocks, even with no consumer yet (a program may fill its
    task queue before starting its workers)."""
    q = mpcore.Queue()
    item = b"x" * 10_000
    n = 400     # 4 MB in all, more than the ring's 2 MB
    try:
        for i in range(n):
            q.put(item, timeout=5)
    except queue.Full:
        pytest.fail(f"put #{i} of an unbounded queue raised queue.Full "
                    f"({i * len(item)} bytes queued, no consumer)")
    assert q.qsize() == n
    assert all(q.get(timeout=scaled(10)) == item for _ in range(n))


def test_close_and_join_thread():
    q = mpcore.Queue()
    q.put("before")
    with pytest.raises(AssertionError):
        q.join_thread()
    q.cancel_join_thread()
    q.close()
    with pytest.raises(ValueError):
        q.put("after")
    with pytest.raises(ValueError):
        q.get()
    with pytest.raises(ValueError):
        q.get_nowait()
    with pytest.raises(ValueError):
        q.put_nowait(1)
    q.join_thread()
    q.close()   # closing twice is fine


def test_simple_queue():
    q = mpcore.SimpleQueue()
    assert q.empty()
    q.put({"k": [1, 2]})
    q.put(Point(0, 0))
    assert not q.empty()
    assert q.get() == {"k": [1, 2]}
    assert q.get() == Point(0, 0)
    assert q.empty()
    q.close()


def test_joinable_queue_task_done_and_join():
    q = mpcore.JoinableQueue()
    q.join()    # nothing put: returns at once
    with pytest.raises(ValueError):
        q.task_done()
    for i in range(3):
        q.put(i)
    assert [q.get(timeout=scaled(10)) for _ in range(3)] == [0, 1, 2]
    for _ in range(3):
        q.task_done()
    q.join()
    with pytest.raises(ValueError, match="too many times"):
        q.task_done()
    # A put that fails does not count as a task.
    j = mpcore.JoinableQueue(1)
    j.put("a")
    with pytest.raises(queue.Full):
        j.put_nowait("b")
    assert j.get() == "a"
    j.task_done()
    j.join()


def test_messages_larger_than_the_ring():
    q = mpcore.Queue()
    big = os.urandom(10 << 20)
    lst = list(range(1_000_000))
    q.put(big)
    q.put(lst)
    q.put("small")
    assert q.qsize() == 3
    assert q.get(timeout=scaled(30)) == big
    assert q.get(timeout=scaled(30)) == lst
    assert q.get(timeout=scaled(30)) == "small"


def test_many_threads_share_a_queue():
    import threading
    q = mpcore.Queue(maxsize=8)
    n, nthreads = 300, 3
    out = []

    def produce(k):
        for i in range(n):
            q.put((k, i))

    def consume():
        for _ in range(n * nthreads):
            out.append(q.get(timeout=scaled(60)))

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(nthreads)]
    threads.append(threading.Thread(target=consume))
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(120))
    assert not any(t.is_alive() for t in threads)
    assert sorted(out) == [(k, i) for k in range(nthreads) for i in range(n)]
    for k in range(nthreads):
        assert [i for kk, i in out if kk == k] == list(range(n))


# --- across processes -----------------------------------------------------

def _producer(q, k, n):
    for i in range(n):
        q.put((k, i, "p" * (i % 50)))


def _consumer(q, results, nsentinels):
    got, seen = [], 0
    while seen < nsentinels:
        item = q.get(timeout=scaled(120))
        if item is None:
            seen += 1
        else:
            got.append(item[:2])
    results.put(got)


def scenario_many_producers_consumers(method):
    ctx = mpcore.get_context(method)
    q = mpcore.Queue(maxsize=16)
    results = mpcore.Queue()
    nprod, ncons, n = 3, 2, 300
    procs = []
    try:
        for k in range(nprod):
            p = ctx.Process(target=_producer, args=(q, k, n))
            procs.append(p)
            p.start()
        consumers = []
        for _ in range(ncons):
            c = ctx.Process(target=_consumer, args=(q, results, 1))
            procs.append(c)
            consumers.append(c)
            c.start()
        for p in procs[:nprod]:
            p.join(scaled(120))
            assert p.exitcode == 0
        for _ in range(ncons):
            q.put(None)
        lists = [results.get(timeout=scaled(120)) for _ in range(ncons)]
        join_all(procs)
    finally:
        reap(procs)
    everything = sorted(x for lst in lists for x in lst)
    assert everything == [(k, i) for k in range(nprod) for i in range(n)]
    # FIFO: each consumer sees each producer's items in the order put.
    for lst in lists:
        for k in range(nprod):
            seq = [i for kk, i in lst if kk == k]
            assert seq == sorted(seq)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", METHODS)
def test_many_producers_and_consumers(method, leak_check):
    run_scenario(MODULE, "scenario_many_producers_consumers", method)


def _child_uses_queues(q, jq, sq, small, out):
    report = {}
    # Work from the joinable queue, results to q.
    while True:
        item = jq.get(timeout=scaled(60))
        if item is None:
            jq.task_done()
            break
        q.put(("done", item * 2))
        jq.task_done()
    # A bounded queue passed to a child keeps its bound.
    small.put(1)
    small.put(2)
    report["small_full"] = small.full()
    try:
        small.put_nowait(3)
        report["small_put_nowait"] = "accepted"
    except queue.Full:
        report["small_put_nowait"] = "Full"
    report["sq"] = sq.get()
    sq.put(Point(7, 8))
    # Closing in this process leaves other processes' handles open.
    q.close()
    for name, call in (("put", lambda: q.put(0)), ("get", lambda: q.get(False))):
        try:
            call()
            report["closed_" + name] = "no error"
        except ValueError:
            report["closed_" + name] = "ValueError"
    out.put(report)


def scenario_queues_in_children(method):
    ctx = mpcore.get_context(method)
    q, jq, sq = ctx.Queue(), ctx.JoinableQueue(), ctx.SimpleQueue()
    small, out = ctx.Queue(2), ctx.Queue()
    assert isinstance(q, mpcore.Queue) and isinstance(jq, mpcore.JoinableQueue)
    assert isinstance(sq, mpcore.SimpleQueue)
    p = ctx.Process(target=_child_uses_queues, args=(q, jq, sq, small, out))
    try:
        p.start()
        for i in range(10):
            jq.put(i)
        jq.put(None)
        sq.put("hello")
        jq.join()       # returns once the child has done every task...
        # ...and the child put each result before calling task_done().
        assert q.qsize() == 10
        assert [q.get_nowait() for _ in range(10)] == [("done", i * 2) for i in range(10)]
        report = out.get(timeout=scaled(90))
        assert sq.get() == Point(7, 8)
        p.join(scaled(60))
        assert p.exitcode == 0
    finally:
        reap([p])
    assert report == {"small_full": True, "small_put_nowait": "Full", "sq": "hello",
                      "closed_put": "ValueError", "closed_get": "ValueError"}
    assert small.full() and [small.get(), small.get()] == [1, 2]
    q.put("still open here")
    assert q.get(timeout=scaled(10)) == "still open here"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_queues_passed_to_children(method, leak_check):
    run_scenario(MODULE, "scenario_queues_in_children", method)


def _bounded_producer(q, n):
    for i in range(n):
        q.put(i)


def _big_sender(q):
    q.put(bytes(range(256)) * (40 << 10))          # 10 MB
    q.put({"list": list(range(500_000)), "tag": "big"})


def scenario_blocking_and_large(method):
    ctx = mpcore.get_context(method)
    # A producer blocks on a full bounded queue until the consumer gets.
    q = mpcore.Queue(maxsize=2)
    big = mpcore.Queue()
    procs = []
    try:
        p = ctx.Process(target=_bounded_producer, args=(q, 50))
        procs.append(p)
        p.start()
        got = [q.get(timeout=scaled(60)) for _ in range(50)]
        # A sender of messages larger than the ring, which exits before
        # they are read.
        s = ctx.Process(target=_big_sender, args=(big,))
        procs.append(s)
        s.start()
        s.join(scaled(90))
        assert s.exitcode == 0
        first = big.get(timeout=scaled(60))
        second = big.get(timeout=scaled(60))
        join_all(procs)
    finally:
        reap(procs)
    assert got == list(range(50))
    assert first == bytes(range(256)) * (40 << 10)
    assert second == {"list": list(range(500_000)), "tag": "big"}
    assert q.empty() and big.empty()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_blocking_producer_and_large_messages(method, leak_check):
    run_scenario(MODULE, "scenario_blocking_and_large", method)


def _nested_child(q_in, q_out):
    import torch
    torch.set_num_threads(1)
    msg = q_in.get(timeout=scaled(60))
    t, arr = msg["tensors"][0], msg["arrays"][0]
    info = {"types": [type(x).__name__ for x in (t, msg["tensors"][1], arr,
                                                   msg["nested"]["deep"][0])],
            "t": t.tolist(), "arr": arr.tolist(),
            "deep": msg["nested"]["deep"][0].tolist(),
            "small": msg["nested"]["small"].tolist(),
            "other": msg["nested"]["other"]}
    t.add_(1)
    arr += 1
    msg["nested"]["deep"][0].mul_(-1)
    msg["nested"]["small"][0] = 99      # a small unshared array: a copy
    q_out.put(info)


def scenario_nested(method):
    import numpy as np
    import torch
    ctx = mpcore.get_context(method)
    t = torch.arange(4, dtype=torch.float32)
    arr = mpcore.zeros((3,), "int64")
    deep = torch.ones(2, 2, dtype=torch.float64)
    small = np.array([1, 2, 3])
    msg = {"tensors": [t, t[1:]], "arrays": [arr],
           "nested": {"deep": (deep,), "small": small, "other": [Point(1, 2), {"s": "x"}]}}
    q_in, q_out = mpcore.Queue(), mpcore.Queue()
    p = ctx.Process(target=_nested_child, args=(q_in, q_out))
    try:
        p.start()
        q_in.put(msg)
        info = q_out.get(timeout=scaled(90))
        p.join(scaled(60))
        assert p.exitcode == 0
    finally:
        reap([p])
    assert info == {"types": ["Tensor", "Tensor", "ndarray", "Tensor"],
                    "t": [0, 1, 2, 3], "arr": [0, 0, 0], "deep": [[1, 1], [1, 1]],
                    "small": [1, 2, 3], "other": [Point(1, 2), {"s": "x"}]}
    assert t.tolist() == [1, 2, 3, 4]
    assert arr.tolist() == [1, 1, 1]
    assert deep.tolist() == [[-1, -1], [-1, -1]]
    assert small.tolist() == [1, 2, 3]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", METHODS)
def test_nested_containers_of_tensors_and_arrays(method, leak_check):
    run_scenario(MODULE, "scenario_nested", method)


def test_failed_put_takes_no_ticket_with_it():
    # Pickling fails after a tensor was handled: the tickets already taken
    # are dropped, so the tensor's memory is freed with the tensor.
    import gc
    import threading
    import torch
    from mpcore import _core
    q = mpcore.Queue()
    t = torch.ones(10)
    with pytest.raises(TypeError):
        q.put([t, threading.Lock()])
    assert t.is_shared()
    handle = mpcore.shm._blocks.find(t.data_ptr(), 40)[0].handle
    del t
    gc.collect()
    # Freed: its handle is stale now (a leaked ticket would keep it live,
    # and this attach would redeem that ticket instead of failing).
    with pytest.raises(mpcore.HandleError):
        _core.attach(handle)
    q.put("still works")
    assert q.get(timeout=scaled(10)) == "still works"


# --- put_many / get_many (NOTE [ Batches ]) ---------------------------------

def test_put_many_get_many_keep_order_and_max_count():
    import torch
    q = mpcore.Queue()
    t = torch.arange(6, dtype=torch.float64)
    objs = ["a", {"k": [1, 2]}, t, Point(3, 4), t[1::2], None, b"bytes"]
    q.put_many(objs)
    assert q.qsize() == len(objs)
    first = q.get_many(max_messages_to_get=3)
    assert len(first) == 3
    rest = q.get_many(timeout=scaled(10))
    got = first + rest
    assert len(got) == len(objs) and q.empty()
    for a, b in zip(objs, got):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.stride() == b.stride()
            assert a.storage_offset() == b.storage_offset()
            assert b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        else:
            assert _same(a, b)
    q.put_many(())                        # an empty batch puts nothing
    q.put_many(("x",))                    # tuples too
    assert q.get_many(block=False) == ["x"]
    with pytest.raises(TypeError, match="list or tuple"):
        q.put_many(iter([1, 2]))
    with pytest.raises(ValueError, match="at least 1"):
        q.get_many(max_messages_to_get=0)


def test_get_many_on_empty_queue_raises_empty():
    q = mpcore.Queue()
    with pytest.raises(queue.Empty):
        q.get_many(block=False)
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get_many(timeout=0.2)
    assert time.monotonic() - t0 >= 0.1
    # It returns what is there once one message is; it never waits for more.
    q.put(1)
    assert q.get_many(timeout=scaled(10), max_messages_to_get=5) == [1]


def test_put_many_is_all_or_nothing_on_a_bounded_queue():
    q = mpcore.Queue(3)
    q.put_many([1, 2])
    with pytest.raises(queue.Full):
        q.put_many([3, 4], block=False)
    with pytest.raises(queue.Full):
        q.put_many([3, 4], timeout=0.1)
    assert q.qsize() == 2                 # nothing of a refused batch went in
    with pytest.raises(ValueError, match="never fit"):
        q.put_many([0] * 4)               # more than maxsize: never
    small = mpcore.Queue(10, capacity=4096)
    with pytest.raises(ValueError, match="never fit"):
        small.put_many([b"x" * 1500] * 3)  # more bytes than the ring
    assert small.empty()
    q.put_many([3])
    assert q.get_many() == [1, 2, 3]
    jq = mpcore.JoinableQueue()
    jq.put_many(["a", "b"])
    assert jq.get_many() == ["a", "b"]
    jq.task_done()
    assert not jq._ring.join(0.05)        # one task still unfinished
    jq.task_done()
    assert jq._ring.join(scaled(10))


def test_put_many_on_an_unbounded_queue_never_blocks():
    q = mpcore.Queue(capacity=4096)
    q.put("first")
    q.put_many([b"x" * 1000] * 10)        # more than the ring: to the feeder
    q.put("last")
    got = []
    while len(got) < 12:
        got += q.get_many(timeout=scaled(10))
    assert got == ["first"] + [b"x" * 1000] * 10 + ["last"]
    big = [b"y" * 100_000] * 3           # each larger than the ring: spilled
    q.put_many(big)
    got = []
    while len(got) < 3:
        got += q.get_many(timeout=scaled(10))
    assert got == big


def test_batches_on_a_closed_queue_raise():
    q = mpcore.Queue()
    q.close()
    with pytest.raises(ValueError, match="closed"):
        q.put_many([1])
    with pytest.raises(ValueError, match="closed"):
        q.get_many()
    r = mpcore.Queue()
    r._ring.close()                       # closed by another process, say
    with pytest.raises(ValueError, match="closed"):
        r.put_many([1], timeout=1)


def test_failed_put_many_takes_no_ticket_with_it():
    import gc
    import threading
    import torch
    from mpcore import _core
    q = mpcore.Queue(4)
    t = torch.ones(10)
    with pytest.raises(TypeError):
        q.put_many([t, threading.Lock()])
    q.put_many([1, 2, 3])
    with pytest.raises(queue.Full):
        q.put_many([t, t], timeout=0.05)  # the tensor's tickets go with the batch
    assert q.get_many() == [1, 2, 3]
    handle = mpcore.shm._blocks.find(t.data_ptr(), 40)[0].handle
    del t
    gc.collect()
    with pytest.raises(mpcore.HandleError):
        _core.attach(handle)


def _batch_producer(q, n):
    import torch
    q.put_many([torch.full((1024,), float(i)) for i in range(n)] + [{"done": n}])


def test_batches_between_processes(leak_check):
    ctx = mpcore.get_context("fork")
    q = mpcore.Queue()
    p = ctx.Process(target=_batch_producer, args=(q, 50))
    try:
        p.start()
        got = []
        while not got or not isinstance(got[-1], dict):
            got += q.get_many(timeout=scaled(30), max_messages_to_get=16)
        assert got[-1] == {"done": 50}
        assert [float(x[0]) for x in got[:-1]] == [float(i) for i in range(50)]
        assert all(x.is_shared() for x in got[:-1])
        p.join(scaled(30))
        assert p.exitcode == 0
    finally:
        reap([p])


# --- tensor records (NOTE [ Tensor records ]) --------------------------------

def test_bare_tensors_of_every_dtype_and_view_round_trip():
    import torch
    from mpcore.queue import _records
    q = mpcore.Queue()
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    views = [base, base[:, 1:, ::2], base.transpose(0, 2), base[1, 2, 3], base[:, :0],
             base.expand(5, 2, 3, 4)[:, 1], torch.empty(0)]
    dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.int8,
              torch.uint8, torch.int16, torch.int64, torch.bool, torch.uint32]
    sent = views + [torch.zeros(3, 2, dtype=d).t() for d in dtypes]
    for t in sent:
        msg = _records.message(t)
        if t.numel():
            assert msg is not None, f"{t.dtype} {tuple(t.shape)} was not sent as a record"
            for ref in msg[0]:
                _core_drop_journaled([ref])
        q.put(t)
    for t in sent:
        r = q.get(timeout=scaled(10))
        assert type(r) is torch.Tensor and r.dtype == t.dtype
        assert r.shape == t.shape and r.stride() == t.stride()
        assert r.storage_offset() == t.storage_offset() and torch.equal(r, t)
        if t.numel():
            assert r.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    # What a record cannot carry takes the pickle path, unchanged.
    p = torch.nn.Parameter(torch.ones(2))
    g = torch.ones(2, requires_grad=True)
    for t in (p, g):
        assert _records.message(t) is None
        q.put(t)
        r = q.get(timeout=scaled(10))
        assert type(r) is type(t) and r.requires_grad and torch.equal(r, t)



def test_tensor_record_is_read_by_a_process_that_never_imported_torch():
    # The getter's first import of torch happens inside get(), and serves it.
    r = run_program("""
        import sys, mpcore
        import os
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        def put_one(q):
            import torch
            q.put(torch.arange(3.0))
        if __name__ == "__main__":
            q = mpcore.Queue()
            p = mpcore.get_context("fork").Process(target=put_one, args=(q,))
            p.start()
            assert "torch" not in sys.modules
            print(q.get(timeout=30 * SLOW).tolist())
            p.join(30 * SLOW)
            assert p.exitcode == 0
    """, timeout=90)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[0.0, 1.0, 2.0]"

def _core_drop_journaled(refs):
    from mpcore import _core
    _core.drop_journaled(refs)


def test_received_tensor_is_shared_and_freed_when_dropped():
    import gc
    import torch
    from mpcore import _core
    q = mpcore.Queue()
    t = torch.full((1000,), 7.0)
    q.put(t)
    r = q.get(timeout=scaled(10))
    r[0] = 1.0
    assert t[0] == 1.0                    # one memory
    handle = mpcore.shm._blocks.find(t.data_ptr(), 4000)[0].handle
    del t, r
    gc.collect()
    with pytest.raises(mpcore.HandleError):
        _core.attach(handle)


def test_corrupt_tensor_record_raises_and_drops_its_ticket():
    import gc
    import torch
    from mpcore import _core
    from mpcore.queue import _records
    t = torch.ones(8)
    refs, payload = _records.message(t)
    _core.drop_journaled(refs)            # only its payload is used below
    block = mpcore.shm._blocks.find(t.data_ptr(), 32)[0]
    bad = [
        payload[:-8],                                        # truncated
        payload[:4] + (70).to_bytes(4, "little") + payload[8:],  # ndim
        payload[:8] + (1 << 40).to_bytes(8, "little") + payload[16:],  # offset
    ]
    for corrupt in bad:
        refs = [block.ticket(True)]
        with pytest.raises(mpcore.HandleError):
            _records.receive(refs, corrupt)
    # A view past the storage's bytes (offset 4 elements, 8 long, in 32 bytes).
    refs, past = _core.tensor_message(block, 0, 32, 0, 4, 4, (8,), (1,))
    with pytest.raises(mpcore.HandleError, match="outside"):
        _records.receive(refs, past)
    # Items of 1 byte for a float32 tensor: checked as bytes, read as floats.
    refs, wrong = _core.tensor_message(block, 0, 32, mpcore.shm._torch.CODES[torch.float32], 1, 0,
                                       (32,), (1,))
    with pytest.raises(mpcore.HandleError, match="1-byte items for a dtype of 4"):
        _records.receive(refs, wrong)
    del refs
    handle = block.handle
    del t, block
    gc.collect()
    # Every ticket was dropped: the block went with the tensor.
    with pytest.raises(mpcore.HandleError):
        _core.attach(handle)


def test_tensor_record_is_read_before_torch_is_served(monkeypatch):
    # A getter whose process has not served torch yet (it never imported
    # torch.multiprocessing) still reads a record.
    import torch
    from mpcore.queue import _queue
    q = mpcore.Queue()
    t = torch.arange(5)
    q.put(t)
    monkeypatch.setattr(_queue, "_receive_record", None)
    r = q.get(timeout=scaled(10))
    assert torch.equal(r, t) and r.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def _records_to_send():
    import torch
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    flat = torch.arange(8, dtype=torch.float64)
    return [
        torch.arange(6, dtype=torch.int64),          # a fresh tensor: made in one step
        torch.tensor(2.5),                           # no dimensions
        torch.ones(5, dtype=torch.bool),
        torch.zeros(3, 2, dtype=torch.bfloat16).t(),  # a dtype numpy lacks: set_()
        base.transpose(0, 2),                        # all of its storage, strides permuted
        base,                                        # the same storage again
        base[:, 1:, ::2],                            # a view inside it
        flat[2:],                                    # a storage seen first through a view
        flat,                                        # ... then whole
    ]


def _record_sender(q):
    for t in _records_to_send():
        q.put(t)


def test_tensor_records_from_another_process_keep_views_and_identity(leak_check):
    # NOTE [ Tensor records in C ]: whether a received tensor is made in one
    # step or by set_(), it has the sent view, dtype and values, over a
    # storage of the sent storage's bytes, one per storage in the getter.
    import torch
    ctx = mpcore.get_context("fork")
    q = mpcore.Queue()
    p = ctx.Process(target=_record_sender, args=(q,))
    try:
        p.start()
        got = [q.get(timeout=scaled(30)) for _ in range(9)]
        p.join(scaled(30))
        assert p.exitcode == 0
    finally:
        reap([p])
    for r, t in zip(got, _records_to_send()):
        assert type(r) is torch.Tensor and not r.requires_grad and r.dtype == t.dtype
        assert r.shape == t.shape and r.stride() == t.stride()
        assert r.storage_offset() == t.storage_offset() and torch.equal(r, t)
        assert r.untyped_storage().nbytes() == t.untyped_storage().nbytes()
        assert r.is_shared()
    ptr = [r.untyped_storage().data_ptr() for r in got]
    assert ptr[4] == ptr[5] == ptr[6] and ptr[7] == ptr[8]
    assert len(set(ptr)) == 6
    got[5][0, 0, 0] = 100.0                          # one memory for the three views
    assert got[4][0, 0, 0] == 100.0
    got[5][1, 2, 2] = -1.0
    assert got[6][1, 1, 1] == -1.0
    got[8][3] = 42.0
    assert got[7][1] == 42.0


# --- NOTE [ Storage entries go with their block ] (py_shm.c) -------------------

def test_storage_entries_go_with_their_block():
    import torch
    from mpcore.shm import _torch

    def key(t):
        b, off = mpcore.shm._blocks.find(t.data_ptr(), t.untyped_storage().nbytes())
        return (b.handle, off, t.untyped_storage().nbytes())
    q = mpcore.Queue()
    kept = torch.full((1000,), 1.0)
    q.put(kept)                               # a record's move
    gone = torch.full((1000,), 2.0)
    q.put([gone])                             # the pickle path's move
    held = torch.full((1000,), 4.0).share_memory_()
    k_kept, k_gone, k_held = key(kept), key(gone), key(held)
    assert {k_kept, k_gone, k_held} <= set(_torch._storages)
    del gone                                  # its block goes, and the entry with it
    assert k_gone not in _torch._storages
    view = held[10:20]
    del held                                  # a view still holds the storage
    assert k_held in _torch._storages
    del view
    assert k_held not in _torch._storages
    assert k_kept in _torch._storages         # the one still alive is kept
    got = [q.get(timeout=scaled(10)) for _ in range(2)]
    assert got[0].untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
    kept[0] = 5.0                             # one memory: a storage that comes back is the original
    assert got[0][0] == 5.0
    assert float(got[1][0][0]) == 2.0


def test_entries_of_storages_gone_under_a_live_block_are_pruned():
    import torch  # noqa: F401  (served first: mpcore.shm._torch is imported by that)
    from mpcore import _core
    from mpcore.shm import _torch
    b = mpcore.shm._blocks.alloc(1 << 16)
    kept = {}
    for i in range(5000):                  # the table is pruned each time it doubles
        s = _core.storage_over(b, 8 * i, 8)
        if i % 500 == 0:
            kept[i] = s
    mine = [k for k in _torch._storages if k[0] == b.handle]
    assert len(mine) < 4096, len(mine)
    for i, s in kept.items():              # the live ones stay, as themselves
        assert (b.handle, 8 * i, 8) in _torch._storages
        assert _core.storage_over(b, 8 * i, 8).data_ptr() == s.data_ptr()
    del kept, s
    del b                                  # and the rest goes with the block
    assert not [k for k in _torch._storages if k[0] == mine[0][0]]


def test_storage_over_checks_its_bytes():
    import torch  # noqa: F401  (served first, as above)
    from mpcore import _core
    b = mpcore.shm._blocks.alloc(4096)
    s = _core.storage_over(b, 1024, 1024)
    assert s.nbytes() == 1024 and s.data_ptr() == _core.storage_over(b, 1024, 1024).data_ptr()
    for off, n in ((4000, 200), (-1, 10), (0, -5), (5000, 0)):
        with pytest.raises(mpcore.HandleError, match="block|dimension"):
            _core.storage_over(b, off, n)


# The head of the programs below: their anonymous memory, in MB.
RSS_PROGRAM = """
import os
import mpcore, torch
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale

def rss_anon_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) >> 10
"""

HELD_LARGE_TENSORS = RSS_PROGRAM + """
if __name__ == "__main__":
    for rnd in range(8):
        held = [torch.full((4 << 20,), float(i)).share_memory_() for i in range(8)]
        assert [float(t[-1]) for t in held] == [float(i) for i in range(8)]
        del held
        if rnd == 1:
            first = rss_anon_mb()
    print("RSS", first, rss_anon_mb())
"""


FRESH_LARGE_PRODUCER = RSS_PROGRAM + """
def consume(q, n):
    for i in range(n):
        assert float(q.get(timeout=60 * SLOW)[-1]) == float(i)

if __name__ == "__main__":
    n = 150
    q = mpcore.Queue(maxsize=16)
    p = mpcore.get_context("fork").Process(target=consume, args=(q, n))
    p.start()
    for i in range(n):
        q.put(torch.full((4 << 20,), float(i)))   # 16 MB, made in the loop
        if i == 20:
            first = rss_anon_mb()
    p.join(60 * SLOW)
    assert p.exitcode == 0, p.exitcode
    print("RSS", first, rss_anon_mb())
"""


def _fresh_program(tmp_path, code, timeout):
    """Runs code as a fresh program (its own session, cleaned up); its
    stdout, once it exited 0."""
    script = tmp_path / "prog.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCORE_")}
    r = run_in_session([sys.executable, script], cwd=tmp_path, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


INHERITED_LARGE_PUT = """
import mpcore, torch
import os
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale

def put_inherited(q, x):
    q.put(x)   # a large move, this process's first torch call

if __name__ == "__main__":
    torch.set_num_threads(2)
    x = torch.full((4 << 20,), 3.0)   # torch's OpenMP threads run here
    q = mpcore.Queue()
    p = mpcore.get_context("fork").Process(target=put_inherited, args=(q, x))
    p.start()
    y = q.get(timeout=60 * SLOW)
    p.join(60 * SLOW)
    print("GOT", float(y[0]), float(y[-1]), y.numel(), p.exitcode)
"""


@pytest.mark.timeout(120)
def test_a_child_forked_after_torch_threads_ran_puts_a_large_tensor(tmp_path):
    # Such a child must not copy with torch, whose OpenMP pool hangs after
    # fork: a large move copies in C (NOTE [ Large copies go around the
    # cache ] in csrc/util.c).
    out = _fresh_program(tmp_path, INHERITED_LARGE_PUT, 90)
    assert out.split() == ["GOT", "3.0", "3.0", str(4 << 20), "0"]


@pytest.mark.timeout(150)
def test_a_producer_of_fresh_large_tensors_does_not_grow(tmp_path):
    # Pinned small chunks made the large chunk each put freed unusable for the
    # next tensor: the producer grew by 16 MB an item in most runs before.
    # The producer is a fresh program's main process: a child forked from a
    # process that has run OpenMP threads (this one) hangs in its first
    # parallel torch call, as torch documents for fork.
    out = _fresh_program(tmp_path, FRESH_LARGE_PRODUCER, 120)
    first, last = (int(v) for v in out.split("RSS")[1].split())
    assert last - first < 10 * 16, f"the producer grew from {first} to {last} MB"


@pytest.mark.timeout(150)
def test_large_tensors_shared_and_held_together_do_not_grow_a_process(tmp_path):
    # Eight 16 MB tensors made, shared and held at once, eight rounds: when
    # only the last moves' entries were dropped, the others' pinned chunks
    # grew the process by about 110 MB a round.
    out = _fresh_program(tmp_path, HELD_LARGE_TENSORS, 120)
    first, last = (int(v) for v in out.split("RSS")[1].split())
    assert last - first < 4 * 16, f"the process grew from {first} to {last} MB"
