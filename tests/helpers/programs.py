"""Fresh programs and the process trees they leave: run_program, Scenario
(a program's whole tree, tagged, found and reaped), run_in_session,
run_scenario and ScenarioRunner (a test module's scenarios under a start
method), and the reaping of what a finished program leaves behind."""
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

from .procfs import (EXITED, comm_of, children_of, exited, mpcore_memfds, mpcore_processes,
                     session_members, shm_gained)
from .timescale import require, scaled

# The tests' folder, where the package helpers is.  Programs that tests run
# import the helpers too, after putting TESTS on sys.path: see TESTS_ON_PATH.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# First line of a program that imports the helpers.
TESTS_ON_PATH = f"import sys; sys.path.insert(0, {TESTS!r})\n"
ARTICLE = os.path.abspath(os.path.join(TESTS, "..", "..", "shared", "article"))


def article(name):
    path = os.path.join(ARTICLE, name)
    require(os.path.exists(path), f"the article's programs are not at {ARTICLE}")
    return path


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


RUNNER_PIDS = set()


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
        return [(p, comm_of(p)) for p in pids]

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


def wait_exits(pids, deadline):
    """Waits, on their pidfds, until each of pids has exited or the deadline
    (time.monotonic()) has passed."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)


def wait_session_gone(sid, timeout=30):
    """Waits for every process of a finished program's session (its keeper,
    zygote, resource tracker, children) to exit, then to be reaped; fails
    listing what is left.  Exits are awaited on pidfds; reaping by init is
    not an event we can wait on, so that part polls (with a deadline)."""
    deadline = time.monotonic() + scaled(timeout)
    # A process may start another while we wait (a zygote's throwaway fork):
    # list again until none is running.
    running = [pid for pid, s in session_members(sid) if s not in EXITED]
    while running and time.monotonic() < deadline:
        wait_exits(running, deadline)
        running = [pid for pid, s in session_members(sid) if s not in EXITED]
    left = session_members(sid)
    while left and all(s in EXITED for _, s in left) and time.monotonic() < deadline:
        # Ours to reap where this process is their subreaper (run_in_session);
        # else init's, whenever it gets to it.
        _reap_own([pid for pid, _ in left])
        left = session_members(sid)
        if left:
            time.sleep(0.02)
            left = session_members(sid)
    alive = [(pid, s) for pid, s in left if s not in EXITED]
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
                   if pid not in kids_before and state in EXITED])
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


def module_path(module):
    """What a fresh program puts first on sys.path to import test module
    `module` (its __name__) as pytest did, and the helpers: the module's
    folder, then the tests' own."""
    return [os.path.dirname(os.path.abspath(sys.modules[module].__file__)), TESTS]


def module_on_path(module):
    """The first line of a program that imports test module `module` (its
    __name__) and the helpers (TESTS_ON_PATH for a test module's own)."""
    return f"import sys; sys.path[:0] = {module_path(module)!r}\n"


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
    sys.path[:0] = {module_path(module)!r}
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
sys.path[:0] = {path!r}
import helpers as C
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
                       if p not in own and not C.is_resource_tracker(p)
                       and not C.is_own_zygote(p)]
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
            f.write(_RUNNER_PROGRAM.format(path=module_path(module), module=module))
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
