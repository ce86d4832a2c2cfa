"""The group's lanes (mpcore.dist._dist._Lane) on their own: calls run in the
order queued, on the lane's thread or on a thread that waits for the next
one (NOTE [ A waiter runs its own call ]), and a call's end wakes whoever
can go on (NOTE [ A finished call wakes only who needs it ])."""
import datetime
import threading
import time

import pytest

from helpers import scaled
from mpcore.dist import _dist

WAIT_S = scaled(10)


def _call(lane, fn, *args, small=True):
    work = _dist.Work([])
    work.lane = lane
    lane.put((work, fn, args, ()), small)
    return work


@pytest.fixture
def lane():
    """A lane whose thread never polls: it moves only when notified, so a
    notification that a call's end owes is not covered up by a poll."""
    ln = _dist._Lane("test-lane", 5.0)
    ln.IDLE_S = 0
    yield ln
    ln.stop()


def _sleeping(lane):
    """Until the lane's thread waits on the lane again, having taken the
    notifications so far (Condition keeps its waiters in _waiters); returns
    whether it polls (it sets `polling` before it waits, and a waiter is
    listed until it holds the lock again)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        with lane.lock:
            if len(lane.cond._waiters) == 1:
                return lane.polling
        assert time.monotonic() < deadline, "the lane's thread never went back to waiting"
        time.sleep(0.0005)


@pytest.mark.timeout(60)
def test_a_call_queued_while_a_waiter_runs_one_still_runs(lane):
    """This thread waits for a call and runs it itself; meanwhile a second
    call is queued, and the lane's thread, woken by it, finds the lane
    busy and sleeps again.  The first call's end must wake it: nobody that
    could run the second call waits for it."""
    # The lane's thread takes nothing until this thread holds the first
    # call (else it may win the race for it, and there is no waiter's call)
    taken, take = threading.Event(), lane._take
    lane._take = lambda: take() if (taken.is_set()
                                     or threading.current_thread() is not lane.thread) else None
    started, release, order, later = threading.Event(), threading.Event(), [], []

    def first(timeout):
        assert threading.current_thread() is not lane.thread
        taken.set()
        started.set()
        assert release.wait(WAIT_S)
        order.append(1)

    def meanwhile():
        assert started.wait(WAIT_S)
        later.append(_call(lane, lambda timeout: order.append(2)))
        _sleeping(lane)   # woken by that put, it found the lane busy
        release.set()

    w1 = _call(lane, first)
    helper = threading.Thread(target=meanwhile)
    helper.start()
    w1.wait()
    helper.join(WAIT_S)
    # a wait with a timeout never takes a call: the lane's thread must
    assert later[0]._wait_done(WAIT_S), "the call queued behind a waiter's never ran"
    assert order == [1, 2]


@pytest.mark.timeout(60)
def test_drain_returns_when_a_waiters_call_ends(lane):
    started, release = threading.Event(), threading.Event()

    def slow(timeout):
        started.set()
        assert release.wait(WAIT_S)

    w = _call(lane, slow)
    waiter = threading.Thread(target=w.wait)
    waiter.start()
    assert started.wait(WAIT_S)
    drained = threading.Event()
    drainer = threading.Thread(target=lambda: (lane.drain(), drained.set()))
    drainer.start()
    assert not drained.is_set()   # the call still runs
    release.set()
    assert drained.wait(WAIT_S), "drain() missed the end of a call a waiter ran"
    waiter.join(WAIT_S)
    drainer.join(WAIT_S)
    assert lane.queued == 0


@pytest.mark.timeout(60)
def test_calls_run_in_order_and_report_errors(lane):
    order = []
    works = [_call(lane, lambda timeout, k=k: order.append(k)) for k in range(50)]

    def boom(timeout):
        raise ValueError("boom")
    bad = _call(lane, boom)
    works[-1].wait()
    with pytest.raises(ValueError, match="boom"):
        bad.wait()
    assert order == list(range(50))
    assert all(w.is_completed() and w.is_success() for w in works)
    assert bad.is_completed() and not bad.is_success()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["future", "work", "drain"])
def test_a_callback_on_the_lanes_thread_waits_for_a_call_it_queued(how):
    """NOTE [ Callbacks that call again ]: a callback of a finished call's
    future, run on the lane's own thread, queues another call and waits for
    it (on its torch future, as PowerSGD's hook does; on its Work; or by
    draining the lane).  Nobody else runs the lane, so that thread must run
    it, after a call queued before it, in order.  The test's own waits are
    bounded; a lane stuck in the callback is left to its daemon thread."""
    lane = _dist._Lane("test-lane", 5.0)
    order, results = [], []
    gate = threading.Event()

    def first(timeout):
        assert threading.current_thread() is lane.thread
        assert gate.wait(WAIT_S)   # the second call is queued before this one ends
        order.append("first")

    def callback(fut):
        assert threading.current_thread() is lane.thread
        inner = _call(lane, lambda timeout: order.append("inner"))
        if how == "future":
            inner.get_future().wait()
        elif how == "work":
            inner.wait()
        else:
            lane.drain()
        results.append(inner.is_completed())

    w = _call(lane, first, small=False)
    chained = w.get_future().then(callback)
    second = _call(lane, lambda timeout: order.append("second"), small=False)
    gate.set()
    deadline = time.monotonic() + WAIT_S
    while not chained.done():
        assert time.monotonic() < deadline, f"the callback never finished (ran: {order})"
        time.sleep(0.001)
    chained.wait()   # done: raises what the callback raised
    assert second.is_completed()
    assert order == ["first", "second", "inner"]
    assert results == [True]
    lane.stop()


@pytest.mark.timeout(60)
def test_only_small_calls_keep_the_thread_polling():
    """The lane's thread polls (NOTE [ A waiter runs its own call ]) after
    a small call, and not after large ones only: those wake it anyway."""
    ln = _dist._Lane("test-lane", 5.0)
    try:
        for _ in range(3):
            _call(ln, lambda timeout: None, small=False).wait()
        assert _sleeping(ln) is False
        _call(ln, lambda timeout: None, small=True).wait()
        assert _sleeping(ln) is True
    finally:
        ln.stop()


# --- the lane's lock (NOTE [ The lane's lock in C ] in py_lanelock.c) -------------------

def test_the_lanes_lock_is_reentrant_and_held_by_one_thread():
    from mpcore import _core
    lock = _core.LaneLock()
    assert lock.acquire() and lock.acquire(blocking=False)     # again, by its holder
    assert lock._is_owned() and "locked" in repr(lock)
    got, out = threading.Event(), []

    def other():
        out.append(lock.acquire(False))             # held: not taken, at once
        out.append(lock.acquire(timeout=0.01))      # held: not taken once the time is out
        try:
            lock.release()
        except RuntimeError as e:
            out.append(str(e))
        out.append(lock._is_owned())
        got.set()
    t = threading.Thread(target=other)
    t.start()
    assert got.wait(WAIT_S)
    t.join(WAIT_S)
    assert out == [False, False, "cannot release un-acquired lock", False]
    lock.release()
    lock.release()
    assert not lock._is_owned() and "unlocked" in repr(lock)
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock.release()
    with pytest.raises(ValueError, match="non-blocking"):
        lock.acquire(False, 1)
    with pytest.raises(ValueError, match="non-negative"):
        lock.acquire(timeout=-2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'wait'"):
        lock.acquire(wait=True)
    with pytest.raises(OverflowError, match="too large"):
        lock.acquire(timeout=1e300)


def test_a_condition_on_the_lanes_lock_waits_and_wakes_as_on_an_rlock():
    from mpcore import _core
    lock = _core.LaneLock()
    cond = threading.Condition(lock)
    ready, seen = [], []

    def waiter():
        with lock:
            with lock:                             # twice: wait releases both
                cond.wait_for(lambda: ready, WAIT_S)
                seen.append((list(ready), lock._is_owned()))
            seen.append(lock._is_owned())
    t = threading.Thread(target=waiter)
    t.start()
    deadline = time.monotonic() + WAIT_S
    while True:                                    # until the waiter waits (the lock is free)
        with cond:
            if cond._waiters:
                ready.append(1)
                cond.notify()
                break
        assert time.monotonic() < deadline, "the waiter never waited"
        time.sleep(0.001)
    t.join(WAIT_S)
    assert not t.is_alive() and seen == [([1], True), True]
    assert not lock._is_owned()


@pytest.mark.timeout(60)
def test_a_signal_ends_a_blocked_acquire_of_the_lanes_lock_with_its_handlers_error():
    """The main thread blocks on the lock another thread holds; a signal
    whose handler raises ends the wait with that error, and the lock is
    then taken as before once free."""
    import signal

    from mpcore import _core
    lock = _core.LaneLock()
    held, done = threading.Event(), threading.Event()

    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop()

    def holder():
        with lock:
            held.set()
            done.wait(WAIT_S)
    old = signal.signal(signal.SIGUSR1, handler)
    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(WAIT_S)
        main = threading.main_thread().ident

        def kick():                # again and again until the main thread has raised
            while not done.wait(0.01):
                signal.pthread_kill(main, signal.SIGUSR1)
        k = threading.Thread(target=kick)
        k.start()
        try:
            with pytest.raises(Stop):
                lock.acquire()
        finally:
            done.set()
            k.join(WAIT_S)
        t.join(WAIT_S)
        assert lock.acquire(timeout=WAIT_S) and lock._is_owned()
        lock.release()
    finally:
        done.set()
        signal.signal(signal.SIGUSR1, old)


def test_a_lane_takes_its_lock_in_c():
    from mpcore import _core
    ln = _dist._Lane("test-lane", 5.0)
    try:
        assert type(ln.lock) is _core.LaneLock
        w = ln.post(_dist.Work, [], lambda timeout: None, (), None, True)
        ln.wait_for(w)
        assert w._done and not ln.lock._is_owned()
    finally:
        ln.stop()


def _watched(base, sets):
    """A subclass of base whose _done is a property that records each set."""
    def get(self):
        return self.__dict__["done"]

    def set_(self, value):
        self.__dict__["done"] = value
        sets.append(value)
    return type("Watched", (base,), {"_done": property(get, set_)})


def test_a_works_field_behind_a_property_is_set_through_it():
    """NOTE [ A Work's fields in its dict ] (py_lane.c): post and wait_for
    write a Work's fields in its dict only where its type has no data
    descriptor of their names; a type with one is served by name."""
    sets = []
    ln = _dist._Lane("test-lane", 5.0)
    try:
        w = ln.post(_watched(_dist.Work, sets), [], lambda timeout: None, (), None, True)
        ln.wait_for(w)
        assert w.is_completed() and sets == [False, True]
        assert "_done" not in w.__dict__
    finally:
        ln.stop()


def test_a_work_type_changed_after_its_calls_is_looked_at_again():
    """The look at a type is kept with its version tag: a property added to
    the class after it was found plain is seen at the next call."""
    late = type("Late", (_dist.Work,), {})
    ln = _dist._Lane("test-lane", 5.0)
    try:
        first = ln.post(late, [], lambda timeout: None, (), None, True)
        ln.wait_for(first)
        assert first.is_completed()
        sets = []
        late._done = _watched(object, sets).__dict__["_done"]
        second = ln.post(late, [], lambda timeout: None, (), None, True)
        ln.wait_for(second)
        assert second.is_completed() and sets == [False, True]
    finally:
        ln.stop()


@pytest.mark.timeout(60)
def test_work_wait_in_c_is_what_the_python_method_was():
    """NOTE [ Work.wait in C ] (py_lane.c): bound to a Work, wait is a bound
    method of a callable that is no built-in function (pybind takes it for
    the Python override, so torch's C++ holders call it); it runs the call,
    raises the call's own error, and with a timeout goes to the Python
    method, which says when the call did not end in time."""
    import types
    from mpcore.dist import _work

    ln = _dist._Lane("test-lane", 5.0)
    try:
        w = ln.post(_work.Work, [], lambda timeout: None, (), None, True)
        assert type(w.wait) is types.MethodType
        assert not isinstance(w.wait.__func__, types.BuiltinFunctionType)
        assert w.wait() is True and w.is_completed()

        err = ValueError("the call's own")

        def boom(timeout):
            raise err
        bad = ln.post(_work.Work, [], boom, (), None, True)
        with pytest.raises(ValueError) as info:
            bad.wait()
        assert info.value is err and bad.exception() is err

        hold, started = threading.Event(), threading.Event()

        def blocked(timeout):
            started.set()
            hold.wait(WAIT_S)
        first = ln.post(_work.Work, [], blocked, (), None, False)   # the lane's thread takes it
        assert started.wait(WAIT_S)
        late = ln.post(_work.Work, [], lambda timeout: None, (), None, True)
        with pytest.raises(TimeoutError, match="did not complete within 0.05 s"):
            late.wait(datetime.timedelta(seconds=0.05))
        hold.set()
        assert first.wait() is True and late.wait() is True
    finally:
        ln.stop()


@pytest.mark.timeout(60)
def test_torchs_cpp_waits_on_a_work_through_its_c_wait():
    """torch's own C++ (the functional collectives' registry: wait_tensor)
    waits on a Work of this backend: it calls the Work's wait, which runs
    the queued call, where torch's base wait would never end."""
    import torch
    from torch._C import _distributed_c10d as c10d
    from mpcore.dist import _work

    ln = _dist._Lane("test-lane", 5.0)
    ln.IDLE_S = 0
    try:
        t = torch.zeros(4)
        w = ln.post(_work.Work, [t], lambda timeout: t.fill_(7.0), (), None, True)
        c10d._register_work(t, w)
        torch.ops._c10d_functional.wait_tensor(t)
        assert w.is_completed() and t.tolist() == [7.0] * 4
    finally:
        ln.stop()
