"""Shared helpers for mpcore's tests.

Tests that start processes are bounded by pytest-timeout (pyproject sets a
default) and check afterwards that nothing is left behind."""
import os
import subprocess
import sys
import textwrap

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"
ARTICLE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "article"))


def require(condition, reason):
    """Skips the test when condition is false, but fails it in CI, where a
    skip must never stand in for a missing feature."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


def article(name):
    path = os.path.join(ARTICLE, name)
    require(os.path.exists(path), f"the article's programs are not at {ARTICLE}")
    return path


def mpcore_memfds(exclude_pids=()):
    """{pid: count} of mpcore memfds open in any process."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in exclude_pids:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/memfd:mpcore"):
                found[int(pid)] = found.get(int(pid), 0) + 1
    return found


def mpcore_processes(all_groups=False):
    """pids of live (not zombie) mpcore keepers in this process group, where
    the programs a test starts run (other sessions' keepers are not ours)."""
    out = []
    mygroup = os.getpgid(0)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if comm != "mpcore-keeper" or fields[0] == "Z":
            continue
        if all_groups or int(fields[3]) == mygroup:
            out.append(int(pid))
    return out


def children_of(pid):
    """Direct children of pid that are still there (zombies included)."""
    kids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append((int(p), fields[0]))
    return kids


def run_program(code, *args, timeout=60, env=None, launcher=False):
    """Runs `code` as a fresh Python program (optionally under `mpcore run`)
    in its own process tree; returns the CompletedProcess."""
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(code))
        path = f.name
    try:
        cmd = [sys.executable, "-m", "mpcore", "run", path] if launcher else [sys.executable, path]
        # A fresh program: it starts a keeper of its own.
        e = {k: v for k, v in os.environ.items() if k != "MPCORE_KEEPER"}
        e.update(env or {})
        return subprocess.run(cmd + list(args), capture_output=True, text=True,
                              timeout=timeout, env=e)
    finally:
        os.unlink(path)


def _is_resource_tracker(pid):
    # multiprocessing's resource tracker, started by the first spawn of the
    # test process, lives as long as the test process: it is not a leak.
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


@pytest.fixture
def leak_check():
    """After the test: no child process left (zombie or not), and no keeper
    of a finished program still running."""
    before = set(mpcore_processes())
    yield
    me = os.getpid()
    own_keeper = set(before)
    import mpcore._core as core
    if core.keeper_pid():
        own_keeper.add(core.keeper_pid())
    kids = [(p, s) for p, s in children_of(me)
            if p not in own_keeper and not _is_resource_tracker(p)]
    assert not kids, f"processes left behind: {kids}"
    stray = set(mpcore_processes()) - own_keeper - before
    assert not stray, f"keepers left behind: {stray}"
