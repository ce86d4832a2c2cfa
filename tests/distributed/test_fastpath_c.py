"""What the collectives' fast paths do in C (csrc/py_fastpath.c): whether
anything observes a call, asked of torch's C++ functions that the table of
torch changes found and checked (NOTE [ Observers asked in C ]), and the
fast paths of dist.barrier, dist.all_reduce and dist.broadcast, blocking
and (the last two) async (NOTE [ dist.barrier in C ], NOTE [ Small
collectives in C ]), on a group
of one rank in a program of its own.  What the profiler and CommDebugMode
see of these calls on two ranks is test_dispatch_parity.py's, and their
results there and under faults are test_backend.py's and
test_dist_faults.py's, whose calls take these paths."""
import json
import subprocess
import sys

import pytest

from helpers import fresh_env, scaled
from helpers.ranks import free_port

pytestmark = pytest.mark.timeout(120)

PROGRAM = r'''
import json, os, sys, threading
import torch, torch.distributed as dist
import mpcore.distributed
from mpcore import _core, _torchapi as T
from mpcore.dist import _fastpath as F
from mpcore.dist._buffers import BUFFER_MIN
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("mpcore", rank=0, world_size=1)
W, P = F._WORLD, F._PG
out = {"rows": [T.TABLE[t].status for t in (T.PROFILER_ENABLED, T.STACK_LEN)],
       "observed is C": F._observed is _core.observed}


def asked():
    """(C's answer, the Python bindings' answer)."""
    return [F._observed(), bool(F._profiling() or F._modes())]


out["plain"] = asked()
with TorchDispatchMode():
    out["mode"] = asked()
    seen = []
    t = threading.Thread(target=lambda: seen.append(asked()))
    t.start()
    t.join()
    out["mode, another thread"] = seen[0]
with torch.profiler.profile():
    out["profiler"] = asked()
out["after"] = asked()

# a C function that answers otherwise than its binding, and one torch lacks
row = T.Row(T.PROFILER_ENABLED, "read", "c:bool=torch._C._len_torch_dispatch_stack",
            "collective fast paths", True)
with TorchDispatchMode():
    try:
        T._check(row)
        out["wrong function"] = None
    except T.Missing as e:
        out["wrong function"] = str(e)
try:
    T._resolve("libc10.so!no_such_function_of_torch")
    out["no function"] = None
except T.Missing as e:
    out["no function"] = str(e)

now = _core.barrier_now
RED = dist.ReduceOp


def ar(t, op, group, async_op=False):
    return _core.all_reduce_now(t, op, group, async_op)


def bc(t, src, group, async_op=False):
    return _core.broadcast_now(t, src, group, async_op)


def works(*made):
    """What async calls gave: each Work's class, wait(), whether its
    result() is the tensor given, and is_completed() after the wait."""
    return [[type(w).__name__, w.wait(), w.result()[0] is t, w.is_completed()] for w in made]



gloo = dist.new_group([0], backend="gloo")     # a group of another class
t = torch.arange(8, dtype=torch.float32)
out["served"] = {
    "barrier": [now(None), now(dist.group.WORLD)],
    "all_reduce": [ar(t, RED.SUM, None), ar(t, RED.SUM, dist.group.WORLD),
                   ar(t, RED.MAX, None), ar(t.to(torch.int64), RED.BAND, None)],
    "broadcast": [bc(t, 0, None), bc(t, 0, dist.group.WORLD)],
}
out["values kept"] = t.tolist()
out["async"] = works(ar(t, RED.SUM, None, True), ar(t, RED.MAX, dist.group.WORLD, True),
                     bc(t, 0, None, True))
w = ar(t, RED.SUM, None, True)
out["async is torch's Work"] = isinstance(w, dist.Work) and w.wait()
out["values kept"] += t.tolist()


class Sub(torch.Tensor):
    pass


class Passing(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


with TorchDispatchMode():
    in_mode = [now(None), ar(t, RED.SUM, None), bc(t, 0, None), ar(t, RED.SUM, None, True),
               bc(t, 0, None, True)]
with Passing():
    fn_mode = [ar(t, RED.SUM, None), bc(t, 0, None), ar(t, RED.SUM, None, True)]
big = torch.zeros(BUFFER_MIN // 4)
out["served"]["all_reduce"].append(ar(big[:-1], RED.SUM, None))    # 4 bytes fewer
out["turned away"] = {
    "another class": [now(gloo), ar(t, RED.SUM, gloo), bc(t, 0, gloo)],
    "a dispatch mode": in_mode,
    "a torch-function mode": fn_mode,
    "a subclass": [ar(t.as_subclass(Sub), RED.SUM, None), bc(t.as_subclass(Sub), 0, None)],
    "not contiguous": [ar(t[::2], RED.SUM, None), bc(t[::2], 0, None)],
    "not an op": [ar(t, "sum", None)],
    "no codes": [ar(t, RED.BAND, None), ar(t, RED.PREMUL_SUM, None),
                 ar(t.to(torch.complex64), RED.SUM, None)],
    "a group buffer's size": [ar(big, RED.SUM, None), ar(big, RED.SUM, None, True)],
    "not a rank of the group": [bc(t, 1, None), bc(t, "0", None)],
}
with dist._coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
    out["turned away"]["coalescing"] = [ar(t, RED.SUM, None), ar(t, RED.SUM, None, True)]
    dist.all_reduce(t)
cm.wait()
shm = dist.group.WORLD.shm
w = dist.all_reduce(torch.ones(4), async_op=True)
out["queued"] = [shm.collectives.queued, now(None), ar(t, RED.SUM, None), bc(t, 0, None),
                 shm.collectives.queued]
behind = ar(t, RED.SUM, None, True)     # an async call goes behind what is queued
out["queued"].append(shm.collectives.queued)
dist.barrier()        # Python's way: drains the lane first
out["after dist.barrier"] = [shm.collectives.queued, w.is_completed(), behind.is_completed()]
errors = {}
for name, call in [("barrier", lambda: now(None, None)),
                   ("all_reduce", lambda: _core.all_reduce_now(t, None, None)),
                   ("unhashable source", lambda: bc(t, [0], None))]:
    try:
        call()
        errors[name] = None
    except TypeError as e:
        errors[name] = str(e)
out["errors"] = errors
dist.destroy_process_group()
out["no group"] = [now(None), ar(t, RED.SUM, None), bc(t, 0, None), ar(t, RED.SUM, None, True)]
print(json.dumps(out))
'''


def test_observers_and_the_fast_paths_in_c():
    r = subprocess.run([sys.executable, "-c", PROGRAM, str(free_port())], env=fresh_env(),
                       capture_output=True, text=True, timeout=scaled(90))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # both C functions found and checked: every fast path asks them
    assert out["rows"] == ["ok", "ok"] and out["observed is C"], out
    assert out["plain"] == [False, False] and out["after"] == [False, False], out
    assert out["mode"] == [True, True], out
    assert out["mode, another thread"] == [False, False], out   # a mode is this thread's
    assert out["profiler"] == [True, True], out
    assert "gave False where torch._C._len_torch_dispatch_stack gave 1" in out[
        "wrong function"], out
    assert out["no function"] == "lacks no_such_function_of_torch in libc10.so", out
    # served on the default group and on a group given (all_reduce: an op
    # other than SUM by its row, and up to 4 bytes under a group buffer's
    # size; one rank's sum leaves the values), returning what dist.*
    # returns: None, or for an async call the backend's Work of the call ...
    assert out["served"] == {"barrier": [None, None], "all_reduce": [None] * 5,
                             "broadcast": [None, None]}, out
    assert out["async"] == [["Work", True, True, True]] * 3, out
    assert out["async is torch's Work"], out
    assert out["values kept"] == list(range(8)) * 2, out
    # ... and left to Python, having done nothing, whenever a check fails
    for why, got in out["turned away"].items():
        assert got == [False] * len(got), (why, out)
    assert out["queued"] == [1, False, False, False, 1, 2], out
    assert out["after dist.barrier"] == [0, True, True], out
    assert out["errors"] == {
        "barrier": "barrier_now(group) takes 1 arguments",
        "all_reduce": "all_reduce_now(tensor, op, group, async_op) takes 4 arguments",
        "unhashable source": "unhashable type: 'list'"}, out
    assert out["no group"] == [False] * 4, out
