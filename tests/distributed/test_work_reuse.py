"""The Work of an asynchronous call on the fast path, given again once only
its lane holds it (NOTE [ A Work used again ] in mpcore/dist/_dist.py):
torch's Work surface holds for every call, and a Work that anyone still
holds (a name, a weak reference) is never given again."""
import pytest

from helpers import run_program
from helpers.programs import program_result

PROGRAM = """
import datetime, gc, json, os, socket, weakref
import torch
import torch.distributed as dist
import mpcore.distributed  # noqa: F401
from mpcore.dist import _work

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("mpcore", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
out = {}
lane_of = lambda w: w.lane
t = torch.ones(8)
made = [0]   # Works constructed
_init = _work.Work.__init__
def counting(self, tensors):
    made[0] += 1
    _init(self, tensors)
_work.Work.__init__ = counting

# a Work dropped after its call is given again, with its new call's surface
w = dist.all_reduce(t, async_op=True)
out["type"] = isinstance(w, dist.Work) and isinstance(w, _work.Work)
assert w.wait() is True
first = id(w)
fut_before = w.get_future()
del w
w = dist.all_reduce(t, async_op=True)
out["reused"] = [id(w) == first, made[0]]
out["fresh_state"] = [w.is_completed(), w.exception() is None]
out["wait"] = w.wait()
out["after"] = [w.is_completed(), w.is_success(), w.exception() is None]
out["result"] = [r is t for r in w.result()]
fut = w.get_future()
out["future"] = [fut is not fut_before, fut.done(), fut.value()[0] is t,
                 fut_before.done(), fut_before.value()[0] is t]
out["timeout_wait"] = w.wait(datetime.timedelta(seconds=30))
del fut, fut_before

# a Work the program holds is never given again; it keeps its own call
held = w
t2 = torch.full((4,), 2.0)
w2 = dist.broadcast(t2, 0, async_op=True)
out["held_not_reused"] = w2 is not held
out["held_result"] = held.result()[0] is t and w2.result()[0] is t2
# a weak reference keeps a dropped Work from being given again
ref = weakref.ref(w2)
del w2, held, w
w3 = dist.barrier(async_op=True)
out["weakref_not_reused"] = ref() is None or w3 is not ref()
w3.wait()
# nor is one the program gave an attribute of its own
w3.tag = "mine"
w3_id = id(w3)
del w3
w3 = dist.barrier(async_op=True)
out["attribute_not_reused"] = [id(w3) != w3_id, hasattr(w3, "tag")]
w3.wait()

# a call that fails reports its error at wait(), and keeps it while held
lane = lane_of(w3)
del w3
def boom(timeout):
    raise ValueError("boom")
bad = lane.post(_work.Work, [], boom, (), None, True)
try:
    bad.wait()
    out["error"] = "no error"
except ValueError as e:
    out["error"] = str(e)
good = dist.all_reduce(t, async_op=True)
out["error_kept"] = [good is not bad, good.wait(), good.is_success(),
                     good.exception() is None, bad.is_completed(), bad.is_success(),
                     str(bad.exception())]
del bad, good
# the lane lets its spare go once it has had nothing to do for IDLE_S
lane.IDLE_S = 0.05
w = dist.all_reduce(t, async_op=True); w.wait()
gone = weakref.ref(t)
del w, t
import time
deadline = time.monotonic() + float(os.environ.get("WAIT_S", "30"))
while gone() is not None and time.monotonic() < deadline:
    time.sleep(0.01)
out["spare_let_go"] = gone() is None
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_a_work_is_given_again_only_when_nobody_holds_it():
    from helpers import scaled
    r = run_program(PROGRAM, timeout=120, env={"WAIT_S": str(scaled(20))})
    assert r.returncode == 0, r.stderr[-3000:]
    out = program_result(r)
    assert out["type"] is True
    assert out["reused"] == [True, 1], "a Work nobody held was not given again"
    assert out["fresh_state"][1] is True   # no error of the call before
    assert out["wait"] is True
    assert out["after"] == [True, True, True]
    assert out["result"] == [True]
    assert out["future"] == [True, True, True, True, True]
    assert out["timeout_wait"] is True
    assert out["held_not_reused"] is True
    assert out["held_result"] is True
    assert out["weakref_not_reused"] is True
    assert out["attribute_not_reused"] == [True, False]
    assert out["error"] == "boom"
    assert out["error_kept"] == [True, True, True, True, True, False, "boom"]
    assert out["spare_let_go"] is True


@pytest.mark.timeout(60)
def test_the_lanes_c_calls_hold_nothing_of_a_finished_call():
    """post and wait_for (NOTE [ A lane's hot path in C ]) called many
    times, on calls that succeed and calls that fail: nothing they were
    given is held once the calls are done (a reference lost or kept in C
    shows in the counts)."""
    import gc
    import sys

    from mpcore.dist import _dist

    lane = _dist._Lane("test-lane", 5.0)
    try:
        def fine(a, b, timeout):
            return None

        def boom(timeout):
            raise ValueError("boom")

        args, keep, result = (1, 2), object(), []
        before = [sys.getrefcount(x) for x in (fine, boom, args, keep, result)]
        errors = 0
        for i in range(2000):
            w = lane.post(_dist.Work, result, fine, args, keep, i % 2 == 0)
            lane.wait_for(w)
            assert w.is_success() and w.result() is result
            bad = lane.post(_dist.Work, result, boom, (), keep, True)
            try:
                bad.wait()
            except ValueError:
                errors += 1
        del w, bad
        gc.collect()   # a failed Work's error holds the frame that raised it: a cycle
        assert errors == 2000
        assert lane.queued == 0 and not lane.running
        after = [sys.getrefcount(x) for x in (fine, boom, args, keep, result)]
        assert after == before
    finally:
        lane.stop()
