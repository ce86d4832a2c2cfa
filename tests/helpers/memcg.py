"""Memory cgroups, for the tests of a shortage of memory."""
import os
import re
import signal
import subprocess
import time
import uuid

from .programs import program_result
from .timescale import require, scaled

# --- memory cgroups, for shortage tests ---------------------------------------

_MEMORY_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1000,
          "MB": 10 ** 6, "GB": 10 ** 9}


def memory_amounts(msg):
    """Every amount of memory a message names, in bytes."""
    return [float(n) * _MEMORY_UNITS[u]
            for n, u in re.findall(r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|KB|MB|GB)\b", msg)]


def make_memcg(limit):
    """Creates a memory cgroup limited to `limit` bytes; returns (directory,
    procs file).  Skips (fails in CI) where that is not possible."""
    name = f"mpcore-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    v1 = v2 = None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            v1 = path
        elif ctrls == "":
            v2 = path
    made = None
    try:
        if v1 is not None and os.path.isdir("/sys/fs/cgroup/memory"):
            made = os.path.join("/sys/fs/cgroup/memory" + v1.rstrip("/"), name)
            os.mkdir(made)
            with open(os.path.join(made, "memory.limit_in_bytes"), "w") as f:
                f.write(str(limit))
            return made
        mount = None
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, right = line.split(" - ", 1)
                if right.split()[0] == "cgroup2":
                    mount = left.split()[4]
        if mount is None or v2 is None:
            raise OSError("no memory cgroup hierarchy is mounted")
        parent = mount + v2.rstrip("/")
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
        made = os.path.join(parent, name)
        os.mkdir(made)
        with open(os.path.join(made, "memory.max"), "w") as f:
            f.write(str(limit))
        return made
    except OSError as e:
        if made and os.path.isdir(made):
            os.rmdir(made)
        require(False, f"cannot create a memory cgroup: {e}")


def remove_memcg(path):
    deadline = time.monotonic() + scaled(30)
    while os.path.isdir(path):
        try:
            os.rmdir(path)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the cgroup empties once its last task is reaped


def run_in_memcg(scenario, code, limit, timeout=120):
    """Runs program `code` in a fresh memory cgroup of `limit` bytes: the
    program prints "READY <pid>" and waits for a line on stdin, is moved
    into the cgroup, then goes on.  Returns its RESULT (program_result) and
    the cgroup's name, once it exited 0; the cgroup is removed."""
    cg = make_memcg(limit)
    p = None
    try:
        p = scenario.popen(code)
        ready = p.stdout.readline().split()
        assert ready[:1] == ["READY"], (ready, p.stderr.read() if p.poll() is not None else "")
        assert int(ready[1]) == p.pid
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(p.pid))
        with open(f"/proc/{p.pid}/cgroup") as f:
            assert os.path.basename(cg) in f.read(), "the child did not move into the cgroup"
        out, err = p.communicate("GO\n", timeout=scaled(timeout))
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        remove_memcg(cg)
    assert p.returncode == 0, (
        f"the child did not exit normally: {p.returncode} "
        f"({'killed by ' + signal.Signals(-p.returncode).name if p.returncode < 0 else ''})"
        f"\nstderr:\n{err[-3000:]}")
    return program_result(subprocess.CompletedProcess(p.args, 0, out, err)), os.path.basename(cg)
