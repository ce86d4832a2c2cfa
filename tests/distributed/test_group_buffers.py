"""What group buffers may take of a process (NOTE [ Memory reduced again
and again ] in mpcore/dist/_buffers.py): each holds a file descriptor, so
a process keeps at most a quarter of its descriptor limit in them, and a
buffer the system refuses leaves the storage where it is.  Either way every
all-reduce gives its sum, and the program keeps descriptors of its own."""
import pytest

from helpers import run_program
from helpers.programs import program_result

PROGRAM = """
import datetime, json, os, resource, socket
import torch
import torch.distributed as dist
import mpcore.distributed  # noqa: F401
from mpcore.dist import _buffers

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("mpcore", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
n = _buffers.BUFFER_MIN // 4 + 3
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
out = {}

def reduce_in_turn(ts):
    ok = True
    for rnd in range(3):
        for i, t in enumerate(ts):
            t.fill_(float(i))
            dist.all_reduce(t)
            ok = ok and bool((t == float(i)).all())
    return ok

def open_files():
    return len(os.listdir("/proc/self/fd")) - 1

# the budget: a quarter of the limit
limit = 4 * (len(_buffers._held) + 12)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(limit, open_files() + 64), hard))
budget = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4
ts = [torch.empty(n) for _ in range(budget + 8)]
out["budget"] = [reduce_in_turn(ts), len(_buffers._held), budget]
del ts

# the system refuses a buffer: five descriptors left, a budget far larger
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
mine = [open(os.devnull) for _ in range(80)]
before = len(_buffers._held)
resource.setrlimit(resource.RLIMIT_NOFILE, (open_files() + 5, hard))
room = resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4 - before   # what the budget allows
ts = [torch.empty(n) for _ in range(12)]
refused = reduce_in_turn(ts)
held = len(_buffers._held) - before
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
out["refused"] = [refused, held, room]
for f in mine:
    f.close()
f = open(os.devnull)     # the program's own descriptors are there again
f.close()
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_buffers_keep_within_a_quarter_of_the_descriptors_and_fall_back_when_refused():
    r = run_program(PROGRAM, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = program_result(r)
    ok, held, budget = out["budget"]
    assert ok, "a sum was wrong with the buffers at their budget"
    assert held == budget, f"{held} buffers held for a budget of {budget}"
    ok, held, room = out["refused"]
    assert room > 12, f"the budget ({room} more buffers), not the system, would refuse"
    assert ok, "a sum was wrong when the system refused buffers"
    assert held <= 5, f"{held} buffers made with five descriptors left"
