"""The core's die_with (NOTE [ Dying with a process ] in proc.c): a process
gets SIGKILL within 1 s of the process it follows ending, whether that is
its parent (PR_SET_PDEATHSIG, when the parent thread lasts) or not (a pidfd
watched by a C thread); a parent thread that ends early kills nobody; a
process already gone is reported.  Spawned children under every start
method are covered by test_spawn.py's test_children_die_with_the_parent.
"""
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import fresh_env

import mpcore._core as core

pytestmark = pytest.mark.timeout(120)

# A follower: arms die_with on the pid given (or its parent), says so, then
# answers each line on stdin until it is killed.
FOLLOWER = r"""
import os, sys, threading
from mpcore import _core
pid = int(sys.argv[1]) or os.getppid()
_core.die_with(pid, 9, sys.argv[2] == "lasts")
print("ARMED", threading.active_count(), len(os.listdir("/proc/self/task")), flush=True)
for line in sys.stdin:
    print("ALIVE", flush=True)
"""

# A parent that starts a follower: from its main thread ("lasts"), or from a
# thread that ends once the follower has armed ("thread").
PARENT = r"""
import subprocess, sys, threading
procs = []
def start():
    f = subprocess.Popen([sys.executable, "-c", sys.argv[1], "0", sys.argv[2]],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append((f, f.stdout.readline().strip()))
if sys.argv[2] == "lasts":
    start()
else:
    t = threading.Thread(target=start)
    t.start()
    t.join()
f, armed = procs[0]
print("FOLLOWER", f.pid, armed, flush=True)
f.stdin.write("ping\n")
f.stdin.flush()
print("AFTER-THREAD", f.stdout.readline().strip(), flush=True)
sys.stdin.readline()
"""


def popen(args, **kw):
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=fresh_env(), **kw)


def gone_within(pid_or_fd, seconds, is_fd=False):
    fd = pid_or_fd if is_fd else os.pidfd_open(pid_or_fd)
    try:
        return bool(select.select([fd], [], [], seconds)[0])
    finally:
        if not is_fd:
            os.close(fd)


def kill_all(*procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_bad_arguments_are_refused():
    for pid, sig in ((0, 9), (-4, 9), (os.getpid(), 0), (os.getpid(), 1000)):
        with pytest.raises(ValueError, match="die_with"):
            core.die_with(pid, sig, True)
    with pytest.raises(TypeError):
        core.die_with("1", 9, True)


def test_a_process_already_gone_is_reported():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with pytest.raises(ProcessLookupError, match=str(p.pid)):
        core.die_with(p.pid, signal.SIGKILL, False)


def test_following_a_process_that_is_not_the_parent():
    watched = popen([sys.executable, "-c", "import signal; signal.pause()"])
    follower = popen([sys.executable, "-c", FOLLOWER, str(watched.pid), "thread"])
    try:
        line = follower.stdout.readline().split()
        assert line[0] == "ARMED", line
        # No Python thread watches: the watcher is the core's own thread.
        assert line[1:] == ["1", "2"], line
        follower.stdin.write("ping\n")
        follower.stdin.flush()
        assert follower.stdout.readline().strip() == "ALIVE"
        watched.kill()
        assert gone_within(follower.pid, 1.0), "follower still running 1 s after its process died"
        assert follower.wait() == -signal.SIGKILL
    finally:
        kill_all(watched, follower)


@pytest.mark.parametrize("how", ["lasts", "thread"])
def test_following_the_parent(how):
    # "lasts": PR_SET_PDEATHSIG, no thread.  "thread": the parent thread that
    # started the follower ends at once, and the follower must outlive it.
    parent = popen([sys.executable, "-c", textwrap.dedent(PARENT), FOLLOWER, how],
                   start_new_session=True)
    follower = None
    try:
        line = parent.stdout.readline().split()
        assert line[0] == "FOLLOWER", line
        follower = int(line[1])
        threads = {"lasts": ["1", "1"], "thread": ["1", "2"]}[how]
        assert line[2:] == ["ARMED"] + threads, line
        assert parent.stdout.readline().split() == ["AFTER-THREAD", "ALIVE"]
        fd = os.pidfd_open(follower)
        try:
            parent.kill()
            assert gone_within(fd, 1.0, is_fd=True), "follower still running 1 s after its parent"
        finally:
            os.close(fd)
    finally:
        if parent.poll() is None or follower is not None:
            try:
                os.killpg(parent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait()
