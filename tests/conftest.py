"""Shared helpers for mpcore's tests.

Tests that start processes are bounded by pytest-timeout (pyproject sets a
default) and check afterwards that nothing is left behind.  Every bound a
test puts on a wait is scaled by how slow the machine is now (NOTE [ Waits
scale with how slow the machine is ])."""
import ctypes
import json
import os
import queue
import re
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

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


# --- how slow the machine is --------------------------------------------------

TIME_SCALE_VAR = "TEST_TIME_SCALE"
_SCALE_CAP = 10.0


def _cpu_share_slowdown(seconds=0.2):
    """Wall time over the CPU time a busy loop of `seconds` was given: 1 on
    a CPU of its own, 3 when it shares one with two other busy programs."""
    w0, c0 = time.monotonic(), time.thread_time()
    while time.monotonic() - w0 < seconds:
        pass
    return (time.monotonic() - w0) / max(time.thread_time() - c0, 1e-3)


def _load_slowdown():
    """The 1-minute load average per CPU this process may run on."""
    try:
        return os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))
    except OSError:
        return 1.0


class _TimeScale:
    """NOTE [ Waits scale with how slow the machine is ]
    A test bounds each wait for an event (a line from a child, a process's
    exit, a queue's item) so that a hang fails instead of blocking the
    suite; the bound only matters when the event never comes.  On a busy
    machine (other programs on the same cores: a shared machine of two
    cores at a load of 10 to 15) everything takes several times longer, and
    a bound picked on a quiet machine ends tests that were on their way.  So
    every such bound, every deadline, every "it took less than" check and
    every timeout given to mpcore only so that it does not fire before
    slow peers arrive goes through scaled(): the quiet machine's seconds
    times `factor`, the machine's slowdown now.  pytest-timeout's per-test
    limit is scaled the same way (pytest_runtest_protocol below), and the
    helpers of this file scale the timeouts they are given: their callers
    name a quiet machine's seconds.

    The factor is the larger of the 1-minute load average per CPU (read
    again before every test, as other programs come and go) and the
    slowdown a 0.2 s busy loop saw at the session's start (its wall time
    over the CPU time it was given), at least 1 (a quiet machine keeps the
    numbers the tests name) and at most _SCALE_CAP (so that a hang still
    fails within minutes).  TEST_TIME_SCALE in the environment fixes it;
    the programs the tests start inherit it there, so that their waits
    (scaled(), or SLOW read from that variable) agree with the test's.
    What is itself under test stays as it is: a timeout whose firing a
    test checks (a 0.05 s get that must raise Empty, a group timeout of
    0.5 s), and the lower bound of an "it took at least" check."""

    def __init__(self):
        given = os.environ.get(TIME_SCALE_VAR)
        self.fixed = given is not None
        self.start = 1.0
        try:
            self.factor = float(given) if self.fixed else 1.0
        except ValueError:
            raise ValueError(f"{TIME_SCALE_VAR}={given!r} is not a number") from None
        if self.fixed and not self.factor > 0:
            raise ValueError(f"{TIME_SCALE_VAR}={given!r} must be above 0")
        self.load = None

    def calibrate(self):
        """At the session's start, in the pytest process only."""
        if not self.fixed:
            self.start = _cpu_share_slowdown()
            self.refresh()

    def refresh(self):
        """Before each test: the factor from the load now."""
        if self.fixed:
            return self.factor
        self.load = _load_slowdown()
        self.factor = round(min(_SCALE_CAP, max(1.0, self.start, self.load)), 2)
        os.environ[TIME_SCALE_VAR] = str(self.factor)
        return self.factor

    def describe(self):
        if self.fixed:
            return f"{self.factor:g} (fixed by {TIME_SCALE_VAR})"
        load = self.load if self.load is not None else _load_slowdown()
        return (f"{self.factor:g} (load {load:.2f} per CPU; a busy loop ran "
                f"{self.start:.2f}x slower than its CPU time at the session's start)")


TIME_SCALE = _TimeScale()


def scaled(seconds):
    """`seconds` of a quiet machine on this machine now (NOTE [ Waits scale
    with how slow the machine is ])."""
    return seconds * TIME_SCALE.factor


def pytest_configure(config):
    TIME_SCALE.calibrate()


def pytest_report_header(config):
    return f"time scale of waits: {TIME_SCALE.describe()}"


_BASE_TIMEOUT = pytest.StashKey()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Scales the test's pytest-timeout limit (its marker's, else the
    configured one) by the factor now, before pytest-timeout reads it."""
    TIME_SCALE.refresh()
    if _BASE_TIMEOUT not in item.stash:
        marker = item.get_closest_marker("timeout")
        args, kwargs = ((), {}) if marker is None else (marker.args, dict(marker.kwargs))
        if "timeout" in kwargs:
            base = kwargs.pop("timeout")
        elif args:
            base, args = args[0], args[1:]
        else:
            base = item.config.getoption("timeout", None) or os.environ.get("PYTEST_TIMEOUT") \
                or item.config.getini("timeout")
        item.stash[_BASE_TIMEOUT] = (float(base or 0), args, kwargs)
    base, args, kwargs = item.stash[_BASE_TIMEOUT]
    if base > 0:
        if args:    # the method, given by position
            kwargs = dict(kwargs, method=args[0])
        item.add_marker(pytest.mark.timeout(timeout=scaled(base), **kwargs), append=False)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("time scale", TIME_SCALE.describe()))


def article(name):
    path = os.path.join(ARTICLE, name)
    require(os.path.exists(path), f"the article's programs are not at {ARTICLE}")
    return path


# --- mpcore's shared memory, seen from /proc ---------------------------------
# (Programs that tests run import these too, after putting TESTS on sys.path:
# see TESTS_ON_PATH.)

TESTS = os.path.dirname(os.path.abspath(__file__))
# First line of a program that imports helpers from this file.
TESTS_ON_PATH = f"import sys; sys.path.insert(0, {TESTS!r})\n"


def _memfd_links(pid):
    """The /proc/PID/fd/N links of the mpcore memfds pid has open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(link).startswith("/memfd:mpcore"):
                out.append(link)
        except OSError:
            pass
    return out


def mpcore_memfds(exclude_pids=()):
    """{pid: count} of mpcore memfds open in any process."""
    found = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in exclude_pids:
            n = len(_memfd_links(pid))
            if n:
                found[int(pid)] = n
    return found


def memfd_inodes(pid, maps=False):
    """{inode: bytes} of the mpcore memfds pid has open (and, with maps, those
    it maps), with the memory a mapped one holds (0 for one only open)."""
    inos = {}
    for link in _memfd_links(pid):
        try:
            inos.setdefault(os.stat(link).st_ino, 0)
        except OSError:
            pass
    if maps:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/memfd:mpcore"):
                    try:   # the memory the segment holds: its allocated blocks
                        held = os.stat(f"/proc/{pid}/map_files/{parts[0]}").st_blocks * 512
                    except OSError:
                        held = 0
                    inos[int(parts[4])] = held
    return inos


def mpcore_ranges():
    """[(start, end)] of this process's mappings of mpcore memfds."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:mpcore" in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


# What the programs a test runs name their /dev/shm entries: multiprocessing's
# semaphores and SharedMemory, torch's file_system strategy, mpcore's tests.
SHM_NAMES = ("sem.", "psm_", "torch_", "mpcore")


def shm_gained(before, ours=None):
    """The entries of /dev/shm made since `before` (a set of its names) that
    a test can have left: those still there that no live process outside
    the test maps.  The test process and the processes for which ours(pid)
    is true are the test's.

    NOTE [ Whose /dev/shm entry is it ]
    Other programs on the machine make and remove /dev/shm entries while a
    test runs (the semaphores of their multiprocessing locks, torch's
    shared files), so a snapshot before and after finds theirs too.  One
    that is gone again was nobody's leak.  One that a process outside the
    test maps is that process's.  The match is by inode, not by name: glibc
    makes a named semaphore under a temporary name, maps it, links it to its
    name and unlinks the temporary one, so its creator's maps name
    "/dev/shm/sem.XXXXXX (deleted)" and never "sem.mp-..." (a match by name
    took every other program's multiprocessing lock for the test's).
    And only the names a test's programs make count (SHM_NAMES: Python's
    semaphores and SharedMemory, torch's shared files, mpcore's own): another
    program's entry that nobody maps at the moment of the check (Open MPI's
    sm_segment.* between a rank's death and its launcher's cleanup) is not
    the test's."""
    gained = {}
    for name in set(os.listdir("/dev/shm")) - set(before):
        if not name.startswith(SHM_NAMES):
            continue
        try:
            st = os.stat(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            continue        # gone again
        gained[name] = (st.st_dev, st.st_ino)
    if not gained:
        return []
    wanted = set(gained.values())
    me = os.getpid()
    theirs = set()
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me or (ours is not None and ours(int(p))):
            continue
        try:
            with open(f"/proc/{p}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and fields[4] != "0":
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                key = (os.makedev(major, minor), int(fields[4]))
                if key in wanted:
                    theirs.add(key)
    return sorted(n for n, key in gained.items() if key not in theirs)


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
        if comm != "mpcore-keeper" or fields[0] in _EXITED:
            continue
        if all_groups or int(fields[3]) == mygroup:
            out.append(int(pid))
    return out


def _proc_stats():
    """(pid, state, ppid, session) of every process there is now."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        yield int(p), fields[0], int(fields[1]), int(fields[3])


def children_of(pid):
    """Direct children of pid that are still there (zombies included)."""
    return [(p, state) for p, state, ppid, _ in _proc_stats() if ppid == pid]


def fresh_env():
    """This process's environment for a fresh program: one that starts a
    keeper and a zygote of its own instead of joining ours."""
    return {k: v for k, v in os.environ.items() if k not in ("MPCORE_KEEPER", "MPCORE_ZYGOTE")}


def run_program(code, *args, timeout=60, env=None, launcher=False, flags=()):
    """Runs `code` as a fresh Python program (optionally under `mpcore run`),
    the interpreter given `flags`, in its own process tree; returns the
    CompletedProcess.  timeout: a quiet machine's seconds (scaled)."""
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(code))
        path = f.name
    try:
        py = [sys.executable, *flags]
        cmd = py + ["-m", "mpcore", "run", path] if launcher else py + [path]
        e = fresh_env()
        e.update(env or {})
        return subprocess.run(cmd + list(args), capture_output=True, text=True,
                              timeout=scaled(timeout), env=e)
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


def _is_own_zygote(pid):
    # The test process's zygote, like its keeper, lives as long as it does.
    from mpcore.proc import _zygote
    return _zygote._service is not None and _zygote._service[1] == pid


# pids of live ScenarioRunner programs: they outlive a test on purpose.
RUNNER_PIDS = set()


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
            if p not in own_keeper and p not in RUNNER_PIDS and not _is_resource_tracker(p)
            and not _is_own_zygote(p)]
    assert not kids, f"processes left behind: {kids}"
    stray = set(mpcore_processes()) - own_keeper - before
    assert not stray, f"keepers left behind: {stray}"


# --- fresh programs whose whole process tree is checked afterwards -----------

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_TAG = "MPCORE_TEST_TAG"


def _set_subreaper(on):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _is_subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    on = ctypes.c_int(0)
    if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_GET_CHILD_SUBREAPER)")
    return bool(on.value)


def _reap_own(pids, block=False):
    """Reaps those of pids that are exited children of this process (orphans
    it adopted as their subreaper); other pids are left alone."""
    for pid in pids:
        try:
            os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            pass


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# A process being reaped passes from Z through X (dead) before it leaves /proc.
_EXITED = ("Z", "X")


def exited(pid):
    """True once `pid` has exited: a zombie, being reaped, or gone."""
    return _state(pid) in (None, *_EXITED)


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class Scenario:
    """Runs programs tagged through their environment, with this process as
    their subreaper, so that every process of the program's tree (keeper
    included) is found, waited for and reaped here."""

    def __init__(self):
        self.tag = uuid.uuid4().hex
        self.me = os.getpid()
        self.kids_before = {p for p, _ in children_of(self.me)}
        self.shm_before = set(os.listdir("/dev/shm"))
        _set_subreaper(True)

    def env(self):
        return {_TAG: self.tag}

    def tagged(self, pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            return False
        return f"{_TAG}={self.tag}".encode() in env

    def live(self):
        """Processes of the program still running (zombies are not)."""
        out = []
        for p in os.listdir("/proc"):
            if p.isdigit() and int(p) != self.me and self.tagged(int(p)):
                if not exited(int(p)):
                    out.append(int(p))
        return out

    def _reap(self):
        left = []
        for pid, _ in children_of(self.me):
            if pid in self.kids_before:
                continue
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if not done:
                left.append(pid)
        return left

    def wait_tree(self, timeout=30.0):
        """Waits (bounded) until every process of the program has exited and
        been reaped; returns those still running at the deadline."""
        deadline = time.monotonic() + scaled(timeout)
        while True:
            left = set(self._reap()) | set(self.live())
            if not left or time.monotonic() > deadline:
                return sorted(left)
            time.sleep(0.02)

    def describe(self, pids):
        return [(p, _comm(p)) for p in pids]

    def run(self, code, *args, timeout=120):
        try:
            return run_program(code, *args, timeout=timeout, env=self.env())
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the program did not finish within {scaled(timeout):g}s; still running: "
                        f"{self.describe(self.live())}\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")

    def check_clean(self):
        """After the program's main process has exited: its whole tree exits,
        no mpcore memfd stays open in any of its processes, no keeper of it
        runs, and /dev/shm gained nothing."""
        left = self.wait_tree()
        assert not left, f"processes of the program still running: {self.describe(left)}"
        memfds = {p: n for p, n in mpcore_memfds(exclude_pids=(self.me,)).items()
                  if self.tagged(p)}
        assert not memfds, f"mpcore memfds still open: {memfds}"
        keepers = [p for p in mpcore_processes() if self.tagged(p)]
        assert not keepers, f"keepers of the program still running: {keepers}"
        # What another program (a test run next to this one) holds is not
        # ours (NOTE [ Whose /dev/shm entry is it ]).
        gained = shm_gained(self.shm_before, ours=self.tagged)
        assert not gained, f"/dev/shm gained entries: {gained}"

    def close(self):
        try:
            for _ in range(50):
                left = set(self._reap()) | set(self.live())
                if not left:
                    break
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.02)
        finally:
            _set_subreaper(False)

    def popen(self, code, *args, **kw):
        """Starts `code` as a fresh program (like run_program, but not waited
        for); stdin and stdout are pipes."""
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(textwrap.dedent(code))
            self.files.append(f.name)
        env = fresh_env()
        env.update(self.env())
        return subprocess.Popen([sys.executable, f.name, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, **kw)


@pytest.fixture
def scenario():
    sc = Scenario()
    sc.files = []
    try:
        yield sc
    finally:
        sc.close()
        for f in sc.files:
            os.unlink(f)


def session_members(sid):
    """pids (with their state) of the processes in session `sid`."""
    return [(p, state) for p, state, _, s in _proc_stats() if s == sid]


def wait_session_gone(sid, timeout=30):
    """Waits for every process of a finished program's session (its keeper,
    zygote, resource tracker, children) to exit, then to be reaped; fails
    listing what is left.  Exits are awaited on pidfds; reaping by init is
    not an event we can wait on, so that part polls (with a deadline)."""
    deadline = time.monotonic() + scaled(timeout)
    # A process may start another while we wait (a zygote's throwaway fork):
    # list again until none is running.
    running = [pid for pid, s in session_members(sid) if s not in _EXITED]
    while running and time.monotonic() < deadline:
        for pid in running:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            finally:
                os.close(fd)
        running = [pid for pid, s in session_members(sid) if s not in _EXITED]
    left = session_members(sid)
    while left and all(s in _EXITED for _, s in left) and time.monotonic() < deadline:
        # Ours to reap where this process is their subreaper (run_in_session);
        # else init's, whenever it gets to it.
        _reap_own([pid for pid, _ in left])
        left = session_members(sid)
        if left:
            time.sleep(0.02)
            left = session_members(sid)
    alive = [(pid, s) for pid, s in left if s not in _EXITED]
    for pid, _ in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _reap_own([pid for pid, _ in alive], block=True)
    assert not alive, f"processes of the program left behind: {alive}"


def adopt_orphans():
    """Makes this process the subreaper of the processes it starts from now
    on (NOTE [ Reaping a finished program's orphans ]); returns the function
    that undoes that, and reaps the adopted orphans that have exited (one
    that had left its program's session included)."""
    was_subreaper = _is_subreaper()
    kids_before = {pid for pid, _ in children_of(os.getpid())}
    _set_subreaper(True)

    def restore():
        if not was_subreaper:
            _set_subreaper(False)
        _reap_own([pid for pid, state in children_of(os.getpid())
                   if pid not in kids_before and state in _EXITED])
    return restore


def run_in_session(cmd, cwd=None, env=None, timeout=90):
    """Runs cmd in a session of its own; returns its CompletedProcess once
    every process of that session (keeper, zygote, children) is gone.

    NOTE [ Reaping a finished program's orphans ]
    A program's keeper and zygote outlive its main process by a moment, as
    orphans, and wait_session_gone waits until they are reaped.  Init reaps
    orphans when it gets to it, on some machines about once a second: most
    of the time a short program takes.  While the program runs this process
    is a subreaper, so its orphans come here, and wait_session_gone reaps
    them as soon as they exit."""
    restore = adopt_orphans()
    try:
        p = subprocess.Popen([str(x) for x in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=scaled(timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
        finally:
            wait_session_gone(p.pid)
    finally:
        restore()
    r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    r.pid = p.pid
    return r


# --- children started inside the test process ---------------------------------

def result(q, procs, timeout=90):
    """The next report of a child; fails at once if a child died without
    reporting (the loop's timeouts only bound a hang)."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        try:
            kind, value = q.get(timeout=0.5)
            break
        except queue.Empty:
            dead = [(p.pid, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise AssertionError(f"child died without reporting: {dead}")
            if time.monotonic() > deadline:
                raise AssertionError("no report from the child")
    if kind == "error":
        raise AssertionError("child failed:\n" + value)
    return value


def run_scenario(module, name, method, timeout=150, fresh=False, torch_free=False,
                 runner=None):
    """Runs the scenario function `name` of test module `module` (its
    __name__) with a start method: in this process under fork (unless
    fresh), else as a fresh program that imports the module, so that spawn
    children can import the targets by module name and multiprocessing's
    resource tracker is not left behind as a child of pytest.  torch_free:
    the program must not have imported torch.  runner: a ScenarioRunner of
    the module, which runs the scenario (unless fresh) in its program instead
    of a fresh one."""
    if method == "fork" and not fresh:
        getattr(sys.modules[module], name)(method)
        return
    if runner is not None and not fresh and not torch_free:
        runner.run(name, method, timeout=timeout)
        return
    code = f"""
    import sys
    sys.path.insert(0, {TESTS!r})
    import {module} as T
    if __name__ == "__main__":
        T.{name}({method!r})
        print("SCENARIO-PASSED")
        print("TORCH=%s" % ("torch" in sys.modules))
        print("KEEPER=%d" % (T.mpcore._core.keeper_pid() or 0))
    """
    r = run_program(code, timeout=timeout)
    assert r.returncode == 0 and "SCENARIO-PASSED" in r.stdout, (
        f"scenario {name}({method!r}) failed, rc={r.returncode}\n"
        f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    if torch_free:
        assert "TORCH=False" in r.stdout, "torch was imported"
    wait_keeper_gone(int(re.search(r"KEEPER=(\d+)", r.stdout).group(1)))


_RUNNER_PROGRAM = """
import json, os, sys, traceback
sys.path.insert(0, {tests!r})
import conftest as C
import mpcore
import {module} as T
if __name__ == "__main__":
    me = os.getpid()
    keepers_before = set(C.mpcore_processes())
    for line in sys.stdin:
        if line == "quit\\n":
            break
        name, method = json.loads(line)
        try:
            getattr(T, name)(method)
            out = {{"ok": True}}
        except BaseException:
            out = {{"ok": False, "tb": traceback.format_exc()}}
        # What leak_check asks of a test, asked here of this scenario: no
        # child of this program left behind but its keeper, zygote and
        # resource tracker, and no other keeper running in its session.
        own = {{mpcore._core.keeper_pid()}}
        out["kids"] = [(p, s) for p, s in C.children_of(me)
                       if p not in own and not C._is_resource_tracker(p)
                       and not C._is_own_zygote(p)]
        out["stray"] = sorted(set(C.mpcore_processes()) - own - keepers_before)
        print("SCENARIO-RESULT " + json.dumps(out), flush=True)
    print("KEEPER=%d" % (mpcore._core.keeper_pid() or 0), flush=True)
"""


class ScenarioRunner:
    """One fresh program, in a session of its own, that runs the scenarios
    of a test module one after another (NOTE [ One program for a module's
    spawn scenarios ]).

    NOTE [ One program for a module's spawn scenarios ]
    A scenario under spawn runs outside pytest (see run_scenario).  Run as a
    program of its own, each pays for starting Python, importing torch, a
    zygote that imports torch again, and the interpreter's exit: about 7 s
    of a 2-core machine for a scenario that itself takes a fraction of a
    second.  A runner starts once per module; after each scenario it checks
    what leak_check checks of a test (nothing left behind), and when the
    module is done it must exit with 0 and leave nothing running in its
    session, its keeper included.  Scenarios that need a parent that has
    never used mpcore (fresh) still run as programs of their own."""

    def __init__(self, module, tmp_dir):
        path = os.path.join(tmp_dir, f"runner_{module}.py")
        with open(path, "w") as f:
            f.write(_RUNNER_PROGRAM.format(tests=TESTS, module=module))
        self.err_path = os.path.join(tmp_dir, f"runner_{module}.err")
        self.module = module
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, path], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=fresh_env(), start_new_session=True)
        RUNNER_PIDS.add(self.proc.pid)

    def _stderr(self):
        with open(self.err_path) as f:
            return f.read()[-5000:]

    def _line(self, prefix, deadline):
        f = self.proc.stdout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                self.kill()
                pytest.fail(f"the scenario runner of {self.module} gave no {prefix.strip()}"
                            f" in time\nstderr:\n{self._stderr()}")
            line = f.readline()
            if not line:
                pytest.fail(f"the scenario runner of {self.module} exited "
                            f"(rc {self.proc.wait()})\nstderr:\n{self._stderr()}")
            if line.startswith(prefix):
                return line[len(prefix):].rstrip("\n")

    def run(self, name, method, timeout=150):
        """Runs scenario `name` with `method` in the runner's program; fails
        as run_scenario would, or when it left a process behind."""
        assert self.proc.poll() is None, (
            f"the scenario runner of {self.module} is gone (rc {self.proc.returncode})")
        self.proc.stdin.write(json.dumps([name, method]) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self._line("SCENARIO-RESULT ", time.monotonic() + scaled(timeout)))
        assert out["ok"], (f"scenario {name}({method!r}) failed\n{out['tb']}\n"
                           f"--- stderr\n{self._stderr()}")
        assert not out["kids"], f"processes left behind: {out['kids']}"
        assert not out["stray"], f"keepers left behind: {out['stray']}"

    def close(self, timeout=60):
        """Ends the program: it must exit with 0, and every process of its
        session (keeper, zygote, resource tracker) must be gone."""
        # Its keeper and zygote come here as orphans, to be reaped at once
        # (NOTE [ Reaping a finished program's orphans ]).
        restore = adopt_orphans()
        try:
            # Not only EOF: a process forked from pytest may hold this pipe too.
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass        # it is gone already: _line says so, with its rc
            keeper = int(self._line("KEEPER=", time.monotonic() + scaled(timeout)))
            rc = self.proc.wait(scaled(timeout))
            self.proc.stdout.close()
            assert rc == 0, f"the scenario runner exited with {rc}\n{self._stderr()}"
            wait_session_gone(self.proc.pid)
            wait_keeper_gone(keeper)
        finally:
            restore()
            self.kill()
            RUNNER_PIDS.discard(self.proc.pid)

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()


@pytest.fixture(scope="module")
def scenario_runner(request, tmp_path_factory):
    """The program that runs the test module's spawn scenarios (NOTE [ One
    program for a module's spawn scenarios ])."""
    r = ScenarioRunner(request.module.__name__, str(tmp_path_factory.mktemp("runner")))
    yield r
    r.close()


def reap(procs, timeout=60):
    for p in procs:
        if p._popen is not None:
            p.join(scaled(timeout))
    for p in procs:
        if p._popen is not None and p.is_alive():
            p.kill()
            p.join()

def wait_keeper_gone(pid, timeout=30):
    """Checks that the keeper of a finished program exits, then waits (a
    bounded poll) for init to reap it, so that leak_check, which counts
    zombies too, does not take it for a keeper left running."""
    if pid <= 0:
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], scaled(timeout))
    finally:
        os.close(fd)
    assert ready, f"the keeper {pid} of a finished program is still running"
    deadline = time.monotonic() + scaled(timeout)
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)


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


# --- programs without torch ---------------------------------------------------

# The first lines of a program that plays a machine where torch is not
# installed: importing torch (or any part of it) raises ImportError.
NO_TORCH_PRELUDE = '''
import sys

class NoTorch:
    """Plays a machine where torch is not installed."""
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoTorch())
'''


def program_result(proc, prefix="RESULT "):
    """The JSON a finished program printed after `prefix`; fails with its
    output when it printed none."""
    for line in proc.stdout.splitlines():
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    pytest.fail(f"the program reported no {prefix.strip()}: rc {proc.returncode}\n"
                f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
