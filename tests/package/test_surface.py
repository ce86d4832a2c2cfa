"""`import mpcore as mp` as torch.multiprocessing's module surface.

Each name is there and works for real in a small bounded use.  Uses that
start fork children run in the test process (reaped before the test ends);
spawn and forkserver, which leave a resource tracker or a fork server behind
in the process that uses them, run in a fresh program in a session of its
own, and the test waits for all of that session to go.
"""
import ast
import os
import sys
import textwrap

import pytest

from helpers import NO_TORCH_PRELUDE, run_in_session, scaled

import mpcore as mp

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("leak_check")]

SURFACE = [
    "Process", "Queue", "SimpleQueue", "JoinableQueue", "Pool", "Event", "Lock", "RLock",
    "Semaphore", "Condition", "Barrier", "Value", "Array", "Manager", "Pipe", "get_context",
    "set_start_method", "get_start_method", "get_all_start_methods", "cpu_count",
    "current_process", "active_children", "set_sharing_strategy", "get_sharing_strategy",
    "get_all_sharing_strategies",
]

# The names mpcore implements itself.  Each must be an object of an mpcore
# module, never the standard library's reached through mpcore's fallback
# (its module __getattr__ hands out whatever mpcore does not define).
OWN = [
    "Process", "Queue", "SimpleQueue", "JoinableQueue", "Pool", "get_context", "set_sharing_strategy",
    "get_sharing_strategy", "get_all_sharing_strategies", "spawn", "start_processes",
    "ProcessContext", "ProcessException", "ProcessRaisedException", "ProcessExitedException",
    "SpawnContext",
]


def assert_mpcores(name):
    """mpcore.<name> is mpcore's own object where mpcore implements the
    name (OWN), else the very object torch.multiprocessing exports (for
    Pool, Lock, Value and the like, torch's are the standard library's, and
    mpcore gives the same on purpose)."""
    import torch.multiprocessing as tmp
    obj = getattr(mp, name)
    module = getattr(obj, "__module__", None) or ""
    if name in OWN:
        assert module.startswith("mpcore"), (
            f"mpcore.{name} is {obj!r} from {module!r}, not mpcore's own")
    else:
        assert hasattr(tmp, name), f"mpcore.{name} is neither mpcore's nor torch's"
        assert obj is getattr(tmp, name), (
            f"mpcore.{name} is {obj!r} from {module!r}, not torch.multiprocessing's")


# --- running a fresh program ----------------------------------------------------

def run_fresh(code, tmp_path, timeout=90):
    """Runs `code` as a fresh program (plain python) in its own session;
    returns the CompletedProcess once the whole session is gone."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCORE_")}
    return run_in_session([sys.executable, script], cwd=tmp_path, env=env, timeout=timeout)


def report(r):
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("REPORT ")]
    assert len(lines) == 1, r.stdout
    return ast.literal_eval(lines[0][len("REPORT "):])


# --- the names ------------------------------------------------------------------

@pytest.mark.parametrize("name", SURFACE)
def test_name_is_there(name):
    import torch.multiprocessing as tmp
    assert hasattr(tmp, name)          # it is torch's surface ...
    assert callable(getattr(mp, name))  # ... and mpcore has it ...
    assert_mpcores(name)               # ... its own, or torch's on purpose


def test_all_of_torch_multiprocessing_is_there():
    import torch.multiprocessing as tmp
    missing = [n for n in tmp.__all__ if not hasattr(mp, n)]
    assert not missing
    for name in tmp.__all__:
        assert_mpcores(name)


def test_own_names_are_checked_as_mpcores(monkeypatch):
    # Were mpcore to lose one of its own names, its fallback would hand out
    # the standard library's: assert_mpcores must then fail.
    import multiprocessing
    monkeypatch.delattr(mp, "Queue")
    assert mp.Queue is multiprocessing.Queue
    with pytest.raises(AssertionError, match="not mpcore's own"):
        assert_mpcores("Queue")


def test_torch_spawn_api_is_there():
    # torch.multiprocessing.spawn / start_processes are its best-known names;
    # mpcore.spawn must be that function, not the stdlib's multiprocessing.spawn module.
    import types
    for name in ("spawn", "start_processes", "ProcessContext", "ProcessRaisedException",
                 "ProcessExitedException"):
        assert hasattr(mp, name), name
    assert not isinstance(mp.spawn, types.ModuleType), mp.spawn
    assert callable(mp.spawn)
    for name in ("spawn", "start_processes", "ProcessContext", "ProcessRaisedException",
                 "ProcessExitedException"):
        assert_mpcores(name)


def test_process_and_queues_are_mpcores():
    import multiprocessing
    from mpcore.queue import _queue
    assert mp.Queue is _queue.Queue
    assert mp.SimpleQueue is _queue.SimpleQueue
    assert mp.JoinableQueue is _queue.JoinableQueue
    assert issubclass(mp.Process, multiprocessing.process.BaseProcess)


# --- small real uses, fork children ---------------------------------------------

def _square(x):
    return x * x


def test_pool_map():
    pool = mp.Pool(2)
    try:
        assert pool.map(_square, range(20)) == [x * x for x in range(20)]
        assert pool.apply(_square, (7,)) == 49
    finally:
        pool.close()
        pool.join()


def _worker_kind(x):
    from mpcore.proc import _child
    if x < 0:
        raise ValueError(f"negative {x}")
    return x * x, _child.forked


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_pool_workers_are_mpcores(method):
    # NOTE [ A Pool's workers are mpcore's ]: the standard library's Pool,
    # whose 'spawn' and 'forkserver' workers come from the zygote; results,
    # errors and termination are the Pool's.
    pool = mp.get_context(method).Pool(2, maxtasksperchild=3)
    try:
        got = pool.map(_worker_kind, range(10))
        assert [x for x, _ in got] == [x * x for x in range(10)]
        assert {z for _, z in got} == {method != "fork"}
        assert sorted(x for x, _ in pool.imap_unordered(_worker_kind, range(4))) == [0, 1, 4, 9]
        with pytest.raises(ValueError, match="negative -1"):
            pool.apply(_worker_kind, (-1,))
        assert pool.apply_async(_worker_kind, (5,)).get(scaled(30))[0] == 25
        workers = [p.pid for p in pool._pool]
    finally:
        pool.terminate()
        pool.join()
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def _die_in_task(x):
    os._exit(7)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_process_pool_executor_on_an_mpcore_context(method):
    # NOTE [ An executor's workers are mpcore's ]: concurrent.futures'
    # executor given an mpcore context works as with the standard library's,
    # its spawn and forkserver workers from the zygote; a worker that dies
    # breaks the pool with its error, and nothing is left behind.
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    with ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        got = list(ex.map(_worker_kind, range(6)))
        assert [x for x, _ in got] == [x * x for x in range(6)]
        assert {z for _, z in got} == {method != "fork"}
        with pytest.raises(ValueError, match="negative -2"):
            ex.submit(_worker_kind, -2).result(scaled(60))
        workers = list(ex._processes)
    ex = ProcessPoolExecutor(1, mp_context=mp.get_context(method))
    try:
        with pytest.raises(BrokenProcessPool):
            ex.submit(_die_in_task, 0).result(scaled(60))
        workers += list(ex._processes or ())
    finally:
        ex.shutdown(wait=True)
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def _add_to_value(v, n):
    for _ in range(n):
        with v.get_lock():
            v.value += 1


def test_value_shared_by_fork_child():
    v = mp.Value("i", 0)
    ps = [mp.Process(target=_add_to_value, args=(v, 200)) for _ in range(2)]
    for p in ps:
        p.start()
    _add_to_value(v, 200)
    for p in ps:
        p.join()
    assert [p.exitcode for p in ps] == [0, 0]
    assert v.value == 600


def _fill_array(a):
    for i in range(len(a)):
        a[i] = i * 1.5


def test_array_shared_by_fork_child():
    a = mp.Array("d", 5)
    p = mp.Process(target=_fill_array, args=(a,))
    p.start()
    p.join()
    assert p.exitcode == 0
    assert list(a) == [0.0, 1.5, 3.0, 4.5, 6.0]


def _fill_dict(d, lst):
    d["child"] = os.getpid()
    lst.append("from child")


def test_manager_dict_and_list():
    with mp.Manager() as m:
        d, lst = m.dict(), m.list()
        p = mp.Process(target=_fill_dict, args=(d, lst))
        p.start()
        p.join()
        assert p.exitcode == 0
        assert d["child"] == p.pid
        assert list(lst) == ["from child"]


def _set(e):
    e.set()


def test_event_set_by_child():
    e = mp.Event()
    assert not e.is_set()
    p = mp.Process(target=_set, args=(e,))
    p.start()
    assert e.wait(scaled(60))
    p.join()
    assert p.exitcode == 0


def _locks_in_child(lock, rlock, sem, out):
    with lock:
        with rlock:
            with rlock:            # re-entrant
                pass
    assert sem.acquire(timeout=scaled(60))
    out.put("locked")


def test_lock_rlock_semaphore():
    lock, rlock, sem, out = mp.Lock(), mp.RLock(), mp.Semaphore(0), mp.SimpleQueue()
    lock.acquire()                 # the child must wait for this
    p = mp.Process(target=_locks_in_child, args=(lock, rlock, sem, out))
    p.start()
    lock.release()
    sem.release()
    assert out.get() == "locked"
    p.join()
    assert p.exitcode == 0


def _notify(cond, flag):
    with cond:
        flag.value = 1
        cond.notify_all()


def test_condition_notified_by_child():
    cond, flag = mp.Condition(), mp.Value("i", 0)
    with cond:
        p = mp.Process(target=_notify, args=(cond, flag))
        p.start()
        assert cond.wait_for(lambda: flag.value == 1, timeout=scaled(60))
    p.join()
    assert p.exitcode == 0


def _at_barrier(b, q):
    q.put(b.wait(timeout=scaled(60)))


def test_barrier():
    b, q = mp.Barrier(3), mp.Queue()
    ps = [mp.Process(target=_at_barrier, args=(b, q)) for _ in range(2)]
    for p in ps:
        p.start()
    mine = b.wait(timeout=scaled(60))
    theirs = [q.get(timeout=scaled(60)) for _ in ps]
    for p in ps:
        p.join()
    assert sorted(theirs + [mine]) == [0, 1, 2]


def _pipe_child(conn):
    conn.send(conn.recv() * 2)
    conn.close()


def test_pipe():
    a, b = mp.Pipe()
    p = mp.Process(target=_pipe_child, args=(b,))
    p.start()
    a.send(21)
    assert a.recv() == 42
    p.join()
    assert p.exitcode == 0


def _queues_child(q, sq, jq):
    q.put(("queue", os.getpid()))
    sq.put("simple")
    jq.get()
    jq.task_done()


def test_queues_with_child():
    q, sq, jq = mp.Queue(), mp.SimpleQueue(), mp.JoinableQueue()
    jq.put("work")
    p = mp.Process(target=_queues_child, args=(q, sq, jq))
    p.start()
    assert q.get(timeout=scaled(60))[0] == "queue"
    assert sq.get() == "simple"
    jq.join()                       # returns once the child did task_done()
    p.join()
    assert p.exitcode == 0
    assert q.empty() and sq.empty()


def _wait_then_exit(e):
    e.wait(scaled(60))


def test_current_process_and_active_children():
    assert mp.current_process().name == "MainProcess"
    e = mp.Event()
    p = mp.Process(target=_wait_then_exit, args=(e,), name="worker-x")
    p.start()
    try:
        assert p in mp.active_children()
        assert p.name == "worker-x"
    finally:
        e.set()
        p.join()
    assert p not in mp.active_children()


def test_start_method_queries():
    import multiprocessing
    assert set(mp.get_all_start_methods()) >= {"fork", "spawn", "forkserver"}
    assert mp.get_start_method() == multiprocessing.get_start_method()
    assert mp.cpu_count() == os.cpu_count()


def _report_method(q):
    import multiprocessing
    q.put(multiprocessing.get_start_method())


def test_fork_context_process():
    ctx = mp.get_context("fork")
    assert ctx.get_start_method() == "fork"
    q = ctx.Queue()
    assert isinstance(q, mp.Queue)
    p = ctx.Process(target=_report_method, args=(q,))
    p.start()
    assert q.get(timeout=scaled(60)) == "fork"
    p.join()
    assert p.exitcode == 0


# --- spawn and forkserver, in a fresh program -----------------------------------

CONTEXTS = '''
import os, sys
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
import mpcore

def child(q, method):
    import multiprocessing
    q.put((method, sys.modules["__main__"].__name__, multiprocessing.parent_process().pid,
           os.getppid() == multiprocessing.parent_process().pid))

if __name__ == "__main__":
    out = {}
    for method in ("spawn", "forkserver", "fork"):
        ctx = mpcore.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q, method))
        p.start()
        got = q.get(timeout=60 * SLOW)
        p.join()
        out[method] = got + (p.exitcode, type(q).__module__, ctx.get_start_method())
    print("REPORT", repr((os.getpid(), out)))
'''


def test_contexts_spawn_forkserver_fork(tmp_path):
    me, out = report(run_fresh(CONTEXTS, tmp_path))
    # A spawned child imports the script as __mp_main__; fork children keep __main__.
    # Spawn and forkserver children are forked by mpcore's zygote: their
    # kernel parent is the zygote, but os.getppid() and their
    # multiprocessing parent are us (NOTE [ A child's parent ]).
    assert out["spawn"] == ("spawn", "__mp_main__", me, True, 0, "mpcore.queue._queue", "spawn")
    assert out["forkserver"] == ("forkserver", "__mp_main__", me, True, 0, "mpcore.queue._queue",
                                 "forkserver")
    assert out["fork"] == ("fork", "__main__", me, True, 0, "mpcore.queue._queue", "fork")


def test_set_start_method_is_followed(tmp_path):
    r = run_fresh('''
        import sys
        import mpcore as mp
        import os
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale

        def child(q):
            q.put(sys.modules["__main__"].__name__)

        if __name__ == "__main__":
            mp.set_start_method("spawn")
            q = mp.Queue()
            p = mp.Process(target=child, args=(q,))
            p.start()
            name = q.get(timeout=60 * SLOW)
            p.join()
            print("REPORT", repr((mp.get_start_method(), name, p.exitcode)))
    ''', tmp_path)
    assert report(r) == ("spawn", "__mp_main__", 0)


# --- contexts and strategies: errors ----------------------------------------------

@pytest.mark.parametrize("bad", ["threads", "", "Spawn", "fork "])
def test_invalid_context_raises_value_error(bad):
    with pytest.raises(ValueError):
        mp.get_context(bad)


def test_default_context():
    ctx = mp.get_context()
    assert ctx.get_start_method() == mp.get_start_method()
    assert mp.get_context("spawn") is mp.get_context("spawn")


def test_a_context_is_a_standard_context():
    # torch's contexts are the standard library's, and code checks that
    # (torch's DataLoader does): mpcore's are BaseContexts, with its methods.
    import multiprocessing
    for method in ("fork", "spawn", "forkserver"):
        ctx = mp.get_context(method)
        assert isinstance(ctx, multiprocessing.context.BaseContext)
        assert ctx.get_context() is ctx and ctx.get_context("fork") is mp.get_context("fork")
        assert ctx.get_start_method() == method
        assert ctx.cpu_count() == multiprocessing.cpu_count()
        assert type(ctx.Lock()) is type(multiprocessing.get_context(method).Lock())
        with pytest.raises(multiprocessing.TimeoutError):
            raise ctx.TimeoutError


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torchs_dataloader_takes_an_mpcore_context(method):
    # Its workers are then mpcore's processes.
    import torch.utils.data
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4, num_workers=2,
                                         multiprocessing_context=mp.get_context(method))
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_sharing_strategies():
    import torch.multiprocessing as tmp
    assert mp.get_all_sharing_strategies() == tmp.get_all_sharing_strategies()
    before = mp.get_sharing_strategy()
    assert before in mp.get_all_sharing_strategies()
    try:
        for s in mp.get_all_sharing_strategies():
            mp.set_sharing_strategy(s)
            assert mp.get_sharing_strategy() == s
    finally:
        mp.set_sharing_strategy(before)


@pytest.mark.parametrize("bad", ["shared_memory", "", "FILE_SYSTEM", None])
def test_unknown_sharing_strategy_rejected(bad):
    import torch.multiprocessing as tmp
    before = mp.get_sharing_strategy()
    with pytest.raises(AssertionError):      # what torch raises
        tmp.set_sharing_strategy(bad)
    with pytest.raises(AssertionError):
        mp.set_sharing_strategy(bad)
    assert mp.get_sharing_strategy() == before


# --- without torch -------------------------------------------------------------------

NO_TORCH = NO_TORCH_PRELUDE + '''

try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block torch")

import os
import mpcore

SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale

def child(q, a):
    a *= 2
    q.put(("from child", float(a.sum())))

if __name__ == "__main__":
    q = mpcore.Queue()
    a = mpcore.empty((4,), "float64")
    a[:] = 1.5
    p = mpcore.Process(target=child, args=(q, a))
    p.start()
    got = q.get(timeout=60 * SLOW)
    p.join()
    sq = mpcore.SimpleQueue()
    sq.put({"k": [1, 2]})
    print("REPORT", repr((got, p.exitcode, a.tolist(), sq.get(), "torch" in sys.modules,
                          mpcore.get_sharing_strategy())))
'''


def test_import_without_torch(tmp_path):
    got, code, arr, simple, torch_loaded, strategy = report(run_fresh(NO_TORCH, tmp_path))
    assert got == ("from child", 12.0)
    assert code == 0
    assert arr == [3.0, 3.0, 3.0, 3.0]
    assert simple == {"k": [1, 2]}
    assert torch_loaded is False
    assert strategy == "file_descriptor"
