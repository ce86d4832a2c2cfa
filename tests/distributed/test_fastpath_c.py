"""What the collectives' fast paths do in C (csrc/py_fastpath.c): whether
anything observes a call, asked of torch's C++ functions that the table of
torch changes found and checked (NOTE [ Observers asked in C ]), and
dist.barrier's fast path (NOTE [ dist.barrier in C ]), on a group of one
rank in a program of its own.  What the profiler and CommDebugMode see of a
barrier on two ranks is test_dispatch_parity.py's."""
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
out["served"] = [now(None, W, P), now(dist.group.WORLD, W, P)]
out["another class"] = now(None, W, object)
with TorchDispatchMode():
    out["in a mode"] = now(None, W, P)
shm = dist.group.WORLD.shm
w = dist.all_reduce(torch.ones(4), async_op=True)
out["queued"] = [shm.collectives.queued, now(None, W, P), shm.collectives.queued]
dist.barrier()        # Python's way: drains the lane first
out["after dist.barrier"] = [shm.collectives.queued, w.is_completed()]
try:
    now(None, W)
    out["two arguments"] = None
except TypeError as e:
    out["two arguments"] = str(e)
dist.destroy_process_group()
out["no group"] = now(None, W, P)
print(json.dumps(out))
'''


def test_observers_and_the_barrier_in_c():
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
    # the barrier: served on the default group and on a group given ...
    assert out["served"] == [True, True], out
    # ... and left to Python, having done nothing, whenever a check fails
    assert out["another class"] is False and out["in a mode"] is False, out
    assert out["queued"] == [1, False, 1], out
    assert out["after dist.barrier"] == [0, True], out
    assert "takes 3 arguments" in out["two arguments"], out
    assert out["no group"] is False, out
