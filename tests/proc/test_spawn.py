"""mpcore's torch.multiprocessing spawn API (mpcore.proc._spawn): torch's own
spawn tests (test/test_multiprocessing_spawn.py) for the start methods
'spawn' and 'fork', and the fault tests mpcore adds.

Tests that start children from the test process reap them before they end
(leak_check).  'forkserver' leaves its server running in the process that
uses it, and some tests kill or interrupt the parent, so those run a fresh
program in a session of its own, and wait for all of that session to go.

Children report to the test through pipes, and hang in signal.pause() where
they must outlive something; nothing here sleeps to let something happen.
Spawn children import this file as the module pytest imported it as, so the
targets are module-level functions here.
"""
import ast
import glob
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import multiprocessing as std

import pytest

from helpers import adopt_orphans, children_of, require, run_program, scaled, wait_session_gone

import mpcore.proc._spawn as S

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("leak_check")]

METHODS = ["spawn", "fork"]
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
              "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def no_error_dirs_left():
    """No error-file directory of this process is left after a test."""
    pattern = os.path.join(tempfile.gettempdir(), f"mpcore-spawn-{os.getpid()}-*")
    yield
    left = glob.glob(pattern)
    assert not left, f"error-file directories left behind: {left}"


def pipe(method):
    """A one-way pipe children can write to: (reader, writer)."""
    return std.get_context(method).Pipe(duplex=False)


def recv(r, timeout=60):
    if not r.poll(scaled(timeout)):
        pytest.fail(f"no message from a child within {scaled(timeout):g}s")
    return r.recv()


def run(fn, args=(), nprocs=2, method="spawn", **kw):
    return S.start_processes(fn, args, nprocs, start_method=method, **kw)


def join_all(ctx, **kw):
    while not ctx.join(**kw):
        pass


# --- targets (module level: spawn children import them from here) ------------------

def _hang():
    while True:
        signal.pause()


def _no_core():
    # No core file; and no faulthandler dump (a fork child inherits pytest's).
    import faulthandler
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    faulthandler.disable()


def _success(i):
    pass


def _success_single_arg(i, w):
    if w is not None:
        w.send(i)


def _exception_single(i, arg, w):
    if i == arg:
        raise ValueError("legitimate exception from process %d" % i)
    w.send(i)
    _hang()


def _exception_all(i):
    raise ValueError("legitimate exception from process %d" % i)


def _terminate_signal(i, w):
    if i == 0:
        _no_core()
        os.kill(os.getpid(), signal.SIGABRT)
    w.send(i)
    _hang()


def _terminate_exit(i, exitcode, w):
    if i == 0:
        sys.exit(exitcode)
    w.send(i)
    _hang()


def _success_first_then_exception(i, go):
    if i == 0:
        return
    go.wait()
    raise ValueError("legitimate exception")


def _segfault(i, w):
    if i == 0:
        import ctypes
        _no_core()
        ctypes.string_at(0)
    w.send(i)
    _hang()


def _report_and_hang(i, w):
    w.send((i, os.getpid()))
    _hang()


def _exception_after_stubborn_sibling(i, w, ready):
    if i == 0:
        ready.wait()
        raise ValueError("legitimate exception from process 0")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    w.send(os.getpid())
    ready.set()
    _hang()


def _exception_with_finishing_sibling(i, go):
    if i == 0:
        go.set()
        raise ValueError("legitimate exception from process 0")
    go.wait()   # returns once process 0 is failing: exits 0 within the grace period


def _keyboard_interrupt(i):
    raise KeyboardInterrupt


def _report_env(i, w):
    w.send((i, {k: os.environ.get(k) for k in RENDEZVOUS}))


def _all_reduce(i, w):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(i + 1)])
        dist.all_reduce(t)
        w.send((i, dist.get_rank(), dist.get_world_size(), t.item()))
    finally:
        dist.destroy_process_group()


class CustomError(Exception):
    pass


class BadInit(Exception):
    """Pickles, but does not unpickle: args is (message,), __init__ wants two."""

    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def _raise(i, kind):
    if kind == "custom":
        raise CustomError("custom error from process %d" % i)
    if kind == "cause":
        try:
            raise KeyError("the root cause")
        except KeyError as e:
            raise ValueError("outer error") from e
    if kind == "context":
        try:
            raise KeyError("the first error")
        except KeyError:
            raise ValueError("error while handling")
    if kind == "unpicklable":
        e = ValueError("holds a lock")
        e.lock = threading.Lock()
        raise e
    if kind == "bad_init":
        raise BadInit(1, 2)
    if kind == "unpicklable_cause":
        cause = RuntimeError("a cause that holds a lock")
        cause.lock = threading.Lock()
        raise ValueError("outer error") from cause
    raise AssertionError(kind)


# --- torch's tests ------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_success(method):
    assert run(_success, nprocs=2, method=method) is None


@pytest.mark.parametrize("method", METHODS)
def test_first_argument_index(method):
    r, w = pipe(method)
    run(_success_single_arg, (w,), nprocs=3, method=method)
    assert sorted(recv(r) for _ in range(3)) == [0, 1, 2]


@pytest.mark.parametrize("method", METHODS)
def test_success_non_blocking(method):
    r, w = pipe(method)
    ctx = run(_success_single_arg, (w,), nprocs=3, method=method, join=False)
    assert isinstance(ctx, S.ProcessContext)
    pids = ctx.pids()
    assert len(pids) == 3 and all(isinstance(p, int) for p in pids)
    assert [p.pid for p in ctx.processes] == pids
    assert sorted(ctx.sentinels.values()) == [0, 1, 2]
    while not ctx.join(timeout=5.0):
        pass
    assert ctx.join() is True          # joining again, once done, is fine
    assert [p.exitcode for p in ctx.processes] == [0, 0, 0]
    assert sorted(recv(r) for _ in range(3)) == [0, 1, 2]


@pytest.mark.parametrize("daemon", [False, True])
def test_daemon_flag(daemon):
    r, w = pipe("fork")
    ctx = run(_success_single_arg, (w,), nprocs=2, method="fork", join=False, daemon=daemon)
    assert [p.daemon for p in ctx.processes] == [daemon, daemon]
    join_all(ctx)
    assert sorted(recv(r) for _ in range(2)) == [0, 1]


@pytest.mark.parametrize("method", METHODS)
def test_exception_single(method):
    r, w = pipe(method)
    nprocs = 3
    for i in range(nprocs):
        ctx = run(_exception_single, (i, w), nprocs=nprocs, method=method, join=False)
        with pytest.raises(S.ProcessRaisedException) as info:
            join_all(ctx)
        e = info.value
        assert re.search(r"\nValueError: legitimate exception from process %d\n?$" % i, str(e))
        assert str(e).startswith(f"\n\n-- Process {i} terminated with the following error:\n")
        assert "Traceback (most recent call last):" in str(e)
        assert 'raise ValueError("legitimate exception from process %d" % i)' in str(e)
        assert e.error_index == i and e.error_pid == ctx.pids()[i]
        # mpcore: the child's own exception, chained
        cause = e.__cause__
        assert type(cause) is ValueError
        assert str(cause) == "legitimate exception from process %d" % i
        assert "legitimate exception from process" in cause.child_traceback
        assert any("raise ValueError" in n for n in getattr(cause, "__notes__", [""]))
        # one error file per child, in a private directory that is gone now
        folders = {os.path.dirname(f) for f in ctx.error_files}
        assert len(ctx.error_files) == nprocs and len(folders) == 1
        assert folders.pop().startswith(os.path.join(tempfile.gettempdir(), "mpcore-spawn-"))
        assert not any(os.path.exists(f) for f in ctx.error_files)
        # the siblings were terminated, and everything is reaped
        codes = [p.exitcode for p in ctx.processes]
        assert codes[i] == 1
        assert all(c in (-signal.SIGTERM, 0) for k, c in enumerate(codes) if k != i), codes
    while r.poll(0):
        r.recv()


@pytest.mark.parametrize("method", METHODS)
def test_exception_all(method):
    with pytest.raises(S.ProcessRaisedException,
                       match=r"ValueError: legitimate exception from process (0|1)$") as info:
        run(_exception_all, nprocs=2, method=method)
    e = info.value
    assert type(e.__cause__) is ValueError
    assert str(e.__cause__) == "legitimate exception from process %d" % e.error_index


@pytest.mark.parametrize("method", METHODS)
def test_terminate_signal(method):
    r, w = pipe(method)
    with pytest.raises(S.ProcessExitedException,
                       match=r"^process 0 terminated with signal SIGABRT$") as info:
        run(_terminate_signal, (w,), nprocs=2, method=method)
    e = info.value
    assert e.error_index == 0 and e.exit_code == -signal.SIGABRT
    assert e.signal_name == "SIGABRT"
    assert e.__cause__ is None


@pytest.mark.parametrize("method", METHODS)
def test_terminate_exit(method):
    r, w = pipe(method)
    with pytest.raises(S.ProcessExitedException,
                       match=r"^process 0 terminated with exit code 123$") as info:
        run(_terminate_exit, (123, w), nprocs=2, method=method)
    e = info.value
    assert e.error_index == 0 and e.exit_code == 123 and e.signal_name is None


@pytest.mark.parametrize("method", METHODS)
def test_success_first_then_exception(method):
    go = std.get_context(method).Event()
    ctx = run(_success_first_then_exception, (go,), nprocs=2, method=method, join=False)
    assert ctx.join() is False          # only process 0 can end before `go`
    assert ctx.processes[0].exitcode == 0
    go.set()
    with pytest.raises(S.ProcessRaisedException, match="ValueError: legitimate exception"):
        join_all(ctx)


def test_exceptions_pickle():
    e = S.ProcessExitedException("process 0 terminated with signal SIGABRT", 0, 1234,
                                 -signal.SIGABRT, "SIGABRT")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is S.ProcessExitedException
    assert (e2.msg, e2.error_index, e2.error_pid, e2.exit_code, e2.signal_name) == \
        (e.msg, 0, 1234, -signal.SIGABRT, "SIGABRT")
    assert str(e2) == str(e)
    r = S.ProcessRaisedException("\n\n-- Process 1 terminated with the following error:\nx", 1, 9)
    r2 = pickle.loads(pickle.dumps(r))
    assert type(r2) is S.ProcessRaisedException
    assert (r2.msg, r2.error_index, r2.error_pid) == (r.msg, 1, 9)
    assert issubclass(S.ProcessRaisedException, S.ProcessException)
    assert issubclass(S.ProcessExitedException, S.ProcessException)


def test_spawn_warns_for_other_start_methods():
    with pytest.warns(FutureWarning, match="only supports start_method=spawn"):
        S.spawn(_success, nprocs=1, start_method="fork")


def test_spawn_context_is_deprecated():
    with pytest.warns(UserWarning, match="SpawnContext is renamed to ProcessContext"):
        ctx = S.SpawnContext([], [])
    assert isinstance(ctx, S.ProcessContext)
    assert ctx.join() is True


def test_spawn_default_is_spawn():
    r, w = pipe("spawn")
    assert S.spawn(_success_single_arg, (w,), nprocs=2) is None
    assert sorted(recv(r) for _ in range(2)) == [0, 1]


# --- faults ---------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_segfault(method):
    r, w = pipe(method)
    ctx = run(_segfault, (w,), nprocs=2, method=method, join=False)
    with pytest.raises(S.ProcessExitedException,
                       match=r"^process 0 terminated with signal SIGSEGV$") as info:
        join_all(ctx)
    assert info.value.signal_name == "SIGSEGV"
    assert info.value.exit_code == -signal.SIGSEGV
    assert all(p.exitcode is not None for p in ctx.processes)
    assert not [p for p in ctx.pids() if p in dict(children_of(os.getpid()))]


@pytest.mark.parametrize("method", METHODS)
def test_hang_join_with_timeout(method):
    r, w = pipe(method)
    ctx = run(_report_and_hang, (w,), nprocs=1, method=method, join=False)
    assert recv(r) == (0, ctx.pids()[0])
    assert ctx.join(timeout=0.5) is False
    assert ctx.processes[0].is_alive()
    ctx.processes[0].terminate()
    with pytest.raises(S.ProcessExitedException,
                       match=r"^process 0 terminated with signal SIGTERM$"):
        join_all(ctx)
    assert ctx.processes[0].exitcode == -signal.SIGTERM


@pytest.mark.parametrize("method", METHODS)
def test_sibling_killed_after_grace_period(method):
    # A sibling that ignores SIGTERM gets SIGKILL after the grace period.
    r, w = pipe(method)
    ready = std.get_context(method).Event()
    ctx = run(_exception_after_stubborn_sibling, (w, ready), nprocs=2, method=method,
              join=False)
    with pytest.raises(S.ProcessRaisedException, match="legitimate exception from process 0"):
        join_all(ctx, grace_period=0.2)
    assert recv(r) == ctx.pids()[1]
    assert [p.exitcode for p in ctx.processes] == [1, -signal.SIGKILL]


@pytest.mark.parametrize("method", METHODS)
def test_sibling_finishes_within_grace_period(method):
    go = std.get_context(method).Event()
    ctx = run(_exception_with_finishing_sibling, (go,), nprocs=2, method=method, join=False)
    with pytest.raises(S.ProcessRaisedException, match="legitimate exception from process 0"):
        join_all(ctx, grace_period=scaled(60))
    assert [p.exitcode for p in ctx.processes] == [1, 0]


def test_join_after_error_raises_it_again():
    ctx = run(_exception_all, nprocs=2, method="fork", join=False)
    with pytest.raises(S.ProcessRaisedException) as first:
        join_all(ctx)
    with pytest.raises(S.ProcessRaisedException) as again:
        ctx.join()
    assert again.value is first.value


def test_keyboard_interrupt_in_child_is_a_quiet_exit():
    # torch's semantics: a child stopped by SIGINT (KeyboardInterrupt) exits 0.
    ctx = run(_keyboard_interrupt, nprocs=2, method="fork", join=False)
    join_all(ctx)
    assert [p.exitcode for p in ctx.processes] == [0, 0]


@pytest.mark.timeout(60)
def test_unpicklable_target_fails_at_start():
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError),
                       match="(?i)pickle") as info:
        run(lambda i: None, nprocs=2, method="spawn")
    notes = getattr(info.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert any("top level of a module" in n for n in notes), notes

    def local(i):
        pass
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError), match="(?i)pickle"):
        run(local, nprocs=2, method="spawn")
    # fork pickles nothing: a lambda is fine there
    assert run(lambda i: None, nprocs=2, method="fork") is None


@pytest.mark.parametrize("nprocs", [-1, -5])
def test_nprocs_must_not_be_negative(nprocs):
    with pytest.raises(ValueError, match="nprocs"):
        S.start_processes(_success, nprocs=nprocs, start_method="fork")
    with pytest.raises(ValueError, match="nprocs"):
        S.spawn(_success, nprocs=nprocs)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_nprocs_zero_starts_nothing(method):
    # As torch: nothing starts; joining returns None, else a context whose
    # join() is True at once (a program sizing its ranks by
    # torch.cuda.device_count() on a machine without GPUs).
    import mpcore
    import torch.multiprocessing as tmp
    before = sorted(children_of(os.getpid()))
    started = mpcore.stats().get("processes_started", 0)
    assert S.start_processes(_success, nprocs=0, start_method=method) is None
    ctx = S.start_processes(_success, nprocs=0, start_method=method, join=False)
    assert isinstance(ctx, S.ProcessContext)
    assert ctx.processes == [] and ctx.pids() == [] and ctx.error_files == []
    assert ctx.join() is True and ctx.join(timeout=0) is True
    if method == "spawn":
        assert S.spawn(_success, nprocs=0) is None
        theirs = tmp.spawn(_success, nprocs=0, join=False)
        assert type(theirs).__name__ == "ProcessContext" and theirs.join() is True
        assert isinstance(S.spawn(_success, nprocs=0, join=False), S.ProcessContext)
    assert mpcore.stats().get("processes_started", 0) == started
    assert sorted(children_of(os.getpid())) == before


DEVICE_COUNT = r"""
import torch
import torch.multiprocessing as mp

def rank(i):
    pass

if __name__ == "__main__":
    assert getattr(mp, "__mpcore__", False), "not running under mpcore"
    n = torch.cuda.device_count()   # 0 on a machine without GPUs
    assert mp.spawn(rank, nprocs=n) is None
    ctx = mp.spawn(rank, nprocs=n, join=False)
    assert ctx.join() is True and len(ctx.processes) == n
    print("RANKS", n, type(ctx).__module__, flush=True)
"""


def test_spawning_device_count_ranks_under_mpcore_run():
    # A program that sizes its ranks by the GPUs it finds runs to the end
    # on a machine without any, under `mpcore run` as under torch.
    r = run_program(DEVICE_COUNT, launcher=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    import torch
    assert f"RANKS {torch.cuda.device_count()} mpcore.proc._spawn" in r.stdout, r.stdout


def test_nprocs_must_be_an_int():
    with pytest.raises(TypeError, match="nprocs"):
        S.start_processes(_success, nprocs=2.0, start_method="fork")


# --- the child's exception, chained ----------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_child_exception_is_the_cause(method):
    with pytest.raises(S.ProcessRaisedException) as info:
        run(_raise, ("custom",), nprocs=1, method=method)
    cause = info.value.__cause__
    assert type(cause) is CustomError and str(cause) == "custom error from process 0"
    assert info.value.__suppress_context__
    assert "CustomError: custom error from process 0" in cause.child_traceback
    assert 'raise CustomError("custom error from process %d" % i)' in cause.child_traceback
    if sys.version_info >= (3, 11):
        assert any("raise CustomError" in n for n in cause.__notes__)


@pytest.mark.parametrize("method", METHODS)
def test_child_exception_chain(method):
    with pytest.raises(S.ProcessRaisedException) as info:
        run(_raise, ("cause",), nprocs=1, method=method)
    e = info.value.__cause__
    assert type(e) is ValueError and str(e) == "outer error"
    assert type(e.__cause__) is KeyError and e.__cause__.args == ("the root cause",)
    assert e.__suppress_context__
    assert "The above exception was the direct cause" in str(info.value)

    with pytest.raises(S.ProcessRaisedException) as info:
        run(_raise, ("context",), nprocs=1, method=method)
    e = info.value.__cause__
    assert type(e) is ValueError and str(e) == "error while handling"
    assert e.__cause__ is None and not e.__suppress_context__
    assert type(e.__context__) is KeyError and e.__context__.args == ("the first error",)
    assert "During handling of the above exception" in str(info.value)


@pytest.mark.parametrize("kind", ["unpicklable", "bad_init"])
def test_exception_that_does_not_pickle_falls_back_to_text(kind):
    with pytest.raises(S.ProcessRaisedException) as info:
        run(_raise, (kind,), nprocs=1, method="fork")
    assert info.value.__cause__ is None
    text = "ValueError: holds a lock" if kind == "unpicklable" else "BadInit: 1 and 2"
    assert text in str(info.value)
    assert "Traceback (most recent call last):" in str(info.value)


def test_chain_comes_back_as_far_as_it_pickles():
    with pytest.raises(S.ProcessRaisedException) as info:
        run(_raise, ("unpicklable_cause",), nprocs=1, method="fork")
    e = info.value.__cause__
    assert type(e) is ValueError and str(e) == "outer error"
    assert e.__cause__ is None
    assert "RuntimeError: a cause that holds a lock" in str(info.value)
    assert "RuntimeError: a cause that holds a lock" in e.child_traceback


def test_error_file_in_torchs_format_is_read(tmp_path):
    # A ProcessContext over processes whose error files hold torch's format
    # (a pickled str) reports them as torch does.
    ctx = run(_terminate_exit, (1, None), nprocs=1, method="fork", join=False)
    ctx.processes[0].join()
    path = tmp_path / "torch-errorfile.pickle"
    path.write_bytes(pickle.dumps("Traceback (most recent call last):\nValueError: x\n"))
    other = S.ProcessContext(ctx.processes, [str(path)])
    with pytest.raises(S.ProcessRaisedException) as info:
        join_all(other)
    assert str(info.value) == ("\n\n-- Process 0 terminated with the following error:\n"
                               "Traceback (most recent call last):\nValueError: x\n")
    assert info.value.__cause__ is None


# --- rendezvous environment -------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_rendezvous_environment(method, monkeypatch):
    for k in RENDEZVOUS:
        monkeypatch.delenv(k, raising=False)
    before = dict(os.environ)
    r, w = pipe(method)
    run(_report_env, (w,), nprocs=3, method=method)
    got = dict(recv(r) for _ in range(3))
    assert dict(os.environ) == before          # the parent's environment is untouched
    ports = {env["MASTER_PORT"] for env in got.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for i, env in got.items():
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["RANK"] == env["LOCAL_RANK"] == str(i)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"


@pytest.mark.parametrize("method", METHODS)
def test_rendezvous_environment_keeps_the_parents(method, monkeypatch):
    for k in RENDEZVOUS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29123")
    monkeypatch.setenv("RANK", "7")
    r, w = pipe(method)
    run(_report_env, (w,), nprocs=2, method=method)
    got = dict(recv(r) for _ in range(2))
    for i, env in got.items():
        assert env == {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29123", "RANK": "7",
                       "LOCAL_RANK": str(i), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.timeout(180)
def test_init_process_group_needs_no_setup(monkeypatch):
    try:
        import torch.distributed as dist
        available = dist.is_available() and dist.is_gloo_available()
    except ImportError:
        available = False
    require(available, "torch.distributed with gloo is not available")
    for k in RENDEZVOUS:
        monkeypatch.delenv(k, raising=False)
    r, w = pipe("spawn")
    S.spawn(_all_reduce, (w,), nprocs=2)
    got = sorted(recv(r) for _ in range(2))
    assert got == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]


# --- fresh programs: forkserver, the parent killed or interrupted ------------------------

class Program:
    """A fresh Python program in a session of its own, whose stdout is read
    line by line."""

    def __init__(self, code, tmp_path, *args):
        script = tmp_path / "prog.py"
        script.write_text(textwrap.dedent(code))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MPCORE_")}
        # its orphans are reaped here (NOTE [ Reaping a finished program's orphans ])
        self.restore = adopt_orphans()
        self.p = subprocess.Popen([sys.executable, str(script), *args], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  start_new_session=True)
        self.buf = b""
        self.lines = []

    def line(self, prefix, timeout=60):
        deadline = time.monotonic() + scaled(timeout)
        fd = self.p.stdout.fileno()
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                line = line.decode()
                self.lines.append(line)
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                self.close()
                pytest.fail(f"no line {prefix!r} from the program; it wrote {self.lines} "
                            f"and on stderr:\n{self.err}")
            self.buf += chunk

    def close(self, timeout=60):
        try:
            try:
                out, err = self.p.communicate(timeout=scaled(timeout))
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                out, err = self.p.communicate()
                self.err = err.decode(errors="replace")
                wait_session_gone(self.p.pid)
                pytest.fail(f"the program did not finish within {scaled(timeout):g}s:\n{self.err}")
            self.buf += out
            self.lines += self.buf.decode().splitlines()
            self.buf = b""
            self.err = err.decode(errors="replace")
            wait_session_gone(self.p.pid)
        finally:
            self.restore()
        return self.p.returncode


def run_fresh(code, tmp_path, *args, timeout=90):
    prog = Program(code, tmp_path, *args)
    rc = prog.close(timeout)
    assert rc == 0, prog.err
    reports = [l for l in prog.lines if l.startswith("REPORT ")]
    assert len(reports) == 1, (prog.lines, prog.err)
    return ast.literal_eval(reports[0][len("REPORT "):])


def error_dirs(pid):
    return glob.glob(os.path.join(tempfile.gettempdir(), f"mpcore-spawn-{pid}-*"))


SCENARIOS = r"""
import glob, os, signal, sys, tempfile
import multiprocessing as std
import mpcore.proc._spawn as S

class MainError(Exception):
    pass

def hang():
    while True:
        signal.pause()

def ok(i, w):
    w.send((i, os.environ["RANK"]))

def raise_cause(i):
    if i == 1:
        try:
            raise KeyError("k")
        except KeyError as e:
            raise ValueError("outer 1") from e
    hang()

def raise_main_error(i):
    raise MainError("from the main script")

def exit123(i):
    if i == 0:
        sys.exit(123)
    hang()

def abort(i):
    if i == 0:
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), signal.SIGABRT)
    hang()

def main(method):
    out = {}
    r, w = std.get_context(method).Pipe(duplex=False)
    S.start_processes(ok, (w,), 2, start_method=method)
    out["ok"] = sorted(r.recv() for _ in range(2))
    try:
        S.start_processes(raise_cause, (), 3, start_method=method)
    except S.ProcessRaisedException as e:
        c = e.__cause__
        out["cause"] = (e.error_index, type(c).__name__, str(c), repr(c.__cause__),
                        "raise ValueError" in str(e))
    try:
        S.start_processes(raise_main_error, (), 1, start_method=method)
    except S.ProcessRaisedException as e:
        c = e.__cause__
        out["main_error"] = (type(c).__module__, type(c).__name__, isinstance(c, MainError),
                             str(c))
    for name, fn in (("exit", exit123), ("abort", abort)):
        try:
            S.start_processes(fn, (), 2, start_method=method)
        except S.ProcessExitedException as e:
            out[name] = (str(e), e.exit_code, e.signal_name)
    if method == "forkserver":   # torch's opt-in parallel start
        os.environ["TORCH_MP_PARALLEL_START"] = "1"
        S.start_processes(ok, (w,), 3, start_method=method)
        out["parallel"] = sorted(r.recv() for _ in range(3))
        del os.environ["TORCH_MP_PARALLEL_START"]
    out["dirs"] = glob.glob(os.path.join(tempfile.gettempdir(), f"mpcore-spawn-{os.getpid()}-*"))
    print("REPORT", repr(out), flush=True)

if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_scenarios_in_a_fresh_program(method, tmp_path):
    out = run_fresh(SCENARIOS, tmp_path, method, timeout=150)
    assert out["ok"] == [(0, "0"), (1, "1")]
    assert out["cause"] == (1, "ValueError", "outer 1", "KeyError('k')", True)
    # a class of the main script comes back as itself (`__mp_main__` in the child)
    assert out["main_error"] == ("__main__", "MainError", True, "from the main script")
    assert out["exit"] == ("process 0 terminated with exit code 123", 123, None)
    assert out["abort"] == ("process 0 terminated with signal SIGABRT", -signal.SIGABRT,
                            "SIGABRT")
    if method == "forkserver":
        assert out["parallel"] == [(0, "0"), (1, "1"), (2, "2")]
    assert out["dirs"] == []


KILLED = r"""
import os, signal, sys, threading
import multiprocessing as std
import mpcore.proc._spawn as S

def hang(i, w):
    w.send(os.getpid())
    while True:
        signal.pause()

def main(method, where, n=2):
    r, w = std.get_context(method).Pipe(duplex=False)
    def report():
        pids = [r.recv() for _ in range(n)]
        print("PIDS", *pids, flush=True)
    threading.Thread(target=report, daemon=True).start()
    if where == "thread":   # started from a thread, which then waits in join
        t = threading.Thread(target=S.start_processes, args=(hang, (w,), n),
                             kwargs={"start_method": method})
        t.start()
        t.join()
    elif where == "exec":   # Processes: the zygote's, then one started by exec
        import mpcore
        ctx = mpcore.get_context(method)
        for i in range(n):
            ctx.Process(target=hang, args=(i, w)).start()
            os.environ["PYTHONHASHSEED"] = "1"  # unlike the zygote's: exec from now on
        while True:
            signal.pause()
    else:
        S.start_processes(hang, (w,), n, start_method=method)

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,where", [("spawn", "main"), ("fork", "main"),
                                          ("forkserver", "main"), ("fork", "thread"),
                                          ("spawn", "thread"), ("spawn", "exec")])
def test_children_die_with_the_parent(method, where, tmp_path):
    prog = Program(KILLED, tmp_path, method, where)
    try:
        pids = [int(p) for p in prog.line("PIDS").split()]
        fds = [os.pidfd_open(pid) for pid in pids]
    except BaseException:
        os.killpg(prog.p.pid, signal.SIGKILL)
        prog.close()
        raise
    alive = pids
    try:
        os.kill(prog.p.pid, signal.SIGKILL)
        killed = time.monotonic()
        waiting = list(fds)
        while waiting:
            left = killed + scaled(1.0) - time.monotonic()
            if left <= 0:
                break
            ready = select.select(waiting, [], [], left)[0]
            waiting = [fd for fd in waiting if fd not in ready]
        alive = [pid for pid, fd in zip(pids, fds) if fd in waiting]
    finally:
        for fd in fds:
            os.close(fd)
        if alive:   # they hold the program's stdout: the program cannot be waited for
            os.killpg(prog.p.pid, signal.SIGKILL)
        prog.close()
    assert not alive, (f"children still running {scaled(1.0):g} s after their parent was "
                       f"killed: {alive}")
    assert prog.p.returncode == -signal.SIGKILL
    assert error_dirs(prog.p.pid) == []


INTERRUPTED = r"""
import os, signal, sys, threading
import multiprocessing as std
import mpcore.proc._spawn as S

def hang(i, w, stubborn):
    if stubborn:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    w.send(os.getpid())
    while True:
        signal.pause()

def main(method, stubborn, n=2):
    r, w = std.get_context(method).Pipe(duplex=False)
    pids = []
    def report():
        pids.extend(r.recv() for _ in range(n))
        print("PIDS", *pids, flush=True)
    t = threading.Thread(target=report, daemon=True)
    t.start()
    try:
        if method == "spawn":
            S.spawn(hang, (w, stubborn == "stubborn"), n)
        else:
            S.start_processes(hang, (w, stubborn == "stubborn"), n, start_method=method)
    except KeyboardInterrupt:
        t.join()
        left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        print("INTERRUPTED", left, flush=True)
        sys.exit(0)
    print("NOT INTERRUPTED", flush=True)
    sys.exit(3)

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,stubborn,target", [
    ("spawn", "plain", "parent"), ("fork", "plain", "parent"), ("forkserver", "plain", "parent"),
    ("fork", "stubborn", "parent"), ("spawn", "plain", "group")])
def test_sigint_stops_every_child(method, stubborn, target, tmp_path):
    prog = Program(INTERRUPTED, tmp_path, method, stubborn)
    try:
        pids = [int(p) for p in prog.line("PIDS").split()]
        if target == "group":   # Ctrl-C at a terminal: the whole foreground group
            os.killpg(prog.p.pid, signal.SIGINT)
        else:
            os.kill(prog.p.pid, signal.SIGINT)
        left = prog.line("INTERRUPTED")
    finally:
        rc = prog.close()
    assert left == "[]", f"children of the interrupted parent left: {left}"
    assert rc == 0, prog.err
    assert len(pids) == 2
    assert error_dirs(prog.p.pid) == []


def test_import_does_not_import_torch():
    r = run_program("""
        import sys
        import mpcore.proc._spawn
        print("TORCH", "torch" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert "TORCH False" in r.stdout
