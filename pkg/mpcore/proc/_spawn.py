"""torch.multiprocessing's spawn API (spawn, start_processes, ProcessContext
and its exceptions) on mpcore's processes, with torch's semantics and
message texts, and these additions:

  * A child's exception comes back as itself when it pickles: the parent's
    ProcessRaisedException is raised `from` it, it carries the child's
    traceback (`child_traceback`, and a note on 3.11+), and its
    __cause__/__context__ chain comes back as far as that pickles.
  * Children die with the process that started them (PR_SET_PDEATHSIG, or a
    pidfd watched in C where the kernel's signal cannot be relied on), and a
    KeyboardInterrupt in the parent during join stops and reaps them all.
  * Each child finds torchrun's rendezvous variables (MASTER_ADDR,
    MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) wherever the
    parent's environment leaves them unset.
  * Children of one call share the cores: with nprocs > 1 each gets
    cores // nprocs intra-op threads (at least one) where the parent's
    environment sets neither OMP_NUM_THREADS nor MKL_NUM_THREADS (NOTE
    [ A rank's share of the cores ] in _cores.py).
  * nprocs must be an int, and not negative (torch takes a negative count
    for 0).  nprocs=0 starts nothing, as under torch: spawn returns None
    when joining, else a ProcessContext whose join() returns True at once.

Error files: NOTE [ Error files ] in _errfile.py.  Dying with the parent:
NOTE [ Dying with the parent ] in _parentdeath.py.

This module must not import torch.
"""
import logging
import multiprocessing
import multiprocessing.connection
import operator
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
import warnings
import weakref

from . import _cores, _errfile, _parentdeath

__all__ = [
    "ProcessContext", "ProcessException", "ProcessExitedException",
    "ProcessRaisedException", "spawn", "SpawnContext", "start_processes",
]

ENV_VAR_PARALLEL_START = "TORCH_MP_PARALLEL_START"

log = logging.getLogger(__name__)

_INTERRUPT_GRACE = 3.0   # seconds between SIGTERM and SIGKILL after a KeyboardInterrupt


# --- exceptions ----------------------------------------------------------------

class ProcessException(Exception):
    __slots__ = ["error_index", "error_pid"]

    def __init__(self, msg, error_index, error_pid):
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid)

    # NOTE [ A failed rank's pid under both names ]
    # torch 2.6 names the failed process's pid `pid`, 2.13 and 2.14
    # `error_pid`; torchrun's agent of each torch reads its own name when a
    # rank fails (2.6's elastic/multiprocessing/api.py logs `e.pid`, and
    # without it the launcher dies of an AttributeError in place of its
    # failure summary).  Both names are answered, on every torch.
    @property
    def pid(self):
        return self.error_pid


class ProcessRaisedException(ProcessException):
    """Exception raised when a process failed due to an exception raised by the code."""


class ProcessExitedException(ProcessException):
    """Exception raised when a process failed due to signal or exited with a specific code."""

    __slots__ = ["exit_code"]

    def __init__(self, msg, error_index, error_pid, exit_code, signal_name=None):
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self):
        return (type(self),
                (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name))


# --- the child's side ----------------------------------------------------------

def _wrap(fn, i, args, error_file, parent=None, env=None, ranks=()):
    if parent is not None:
        _parentdeath.die_with(parent)
    if env:
        os.environ.update(env)
        if _cores.VAR in env:
            _cores.take(int(env[_cores.VAR]))
    for name in ranks:
        os.environ[name] = str(i)
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # SIGINT: stopped from outside, as torch's children are
    except Exception as e:
        _errfile.write_error(error_file, e)
        sys.exit(1)


# --- ProcessContext -------------------------------------------------------------------

def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"<Unknown signal {signum}>"


class ProcessContext:
    def __init__(self, processes, error_files):
        self.error_files = error_files
        self.processes = processes
        self.sentinels = {process.sentinel: index for index, process in enumerate(processes)}
        self._error = None
        self._cleanup = None
        self._private = False

    def _own_dir(self, path):
        """Makes this context read error files only from `path`, a private
        directory, and remove it once its children are reaped (or, failing
        that, when it is collected or the program exits)."""
        self._private = True
        self._cleanup = weakref.finalize(self, _errfile.remove_dir, path, os.getpid())

    def _done(self):
        if self._cleanup is not None:
            self._cleanup()

    def pids(self):
        return [int(process.pid) for process in self.processes]

    def _join_procs_with_timeout(self, timeout):
        """Joins all processes with a shared timeout."""
        end = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0, end - time.monotonic()))

    def join(self, timeout=None, grace_period=None):
        r"""Joins one or more processes of this context.

        If one of them exited with a non-zero exit status, this kills the
        remaining processes (after an optional grace period) and raises an
        exception with the cause of the first process exiting.

        Returns ``True`` if all processes have been joined successfully,
        ``False`` if there are more processes that need to be joined.

        Args:
            timeout (float): Wait this long (in seconds) before giving up on waiting.
            grace_period (float): When any processes fail, wait this long (in seconds)
                for others to shutdown gracefully before terminating them. If they
                still don't exit, wait another grace period before killing them.

        A KeyboardInterrupt (or any other exception) while joining terminates
        every child, kills those still running after a short grace, reaps
        them all and is then re-raised.
        """
        if self._error is not None:
            raise self._error
        if not self.sentinels:
            self._done()
            return True
        try:
            return self._join(timeout, grace_period)
        except ProcessException:
            raise
        except BaseException:
            self._abort()
            raise

    def _join(self, timeout, grace_period):
        ready = multiprocessing.connection.wait(list(self.sentinels), timeout=timeout)
        failed = []
        for sentinel in ready:
            index = self.sentinels[sentinel]
            process = self.processes[index]
            process.join()
            del self.sentinels[sentinel]
            if process.exitcode != 0:
                failed.append(index)
        if not failed:
            if self.sentinels:
                return False
            self._done()
            return True
        # Of children that failed together, one that reported an exception
        # says most; then the lowest index.
        error_index = min(failed, key=lambda k: (not os.path.exists(self.error_files[k]), k))
        self._stop_others(grace_period)
        error, cause = self._error_for(error_index)
        self._done()
        self._error = error
        if cause is not None:
            raise error from cause
        raise error

    def _stop_others(self, grace_period):
        # First, a grace period for the others to finish by themselves.
        if grace_period is not None:
            self._join_procs_with_timeout(grace_period)
        for process in self.processes:
            if process.is_alive():
                log.warning("Terminating process %s via signal SIGTERM", process.pid)
                process.terminate()
        # SIGKILL for those still there after another grace period: a process
        # stuck in C code never runs Python's SIGTERM handler.
        self._join_procs_with_timeout(30 if grace_period is None else grace_period)
        for process in self.processes:
            if process.is_alive():
                log.warning("Unable to shutdown process %s via SIGTERM , forcefully exiting "
                            "via SIGKILL", process.pid)
                process.kill()
            process.join()
        self.sentinels.clear()

    def _abort(self):
        """Stops every child: SIGTERM, SIGKILL after a short grace (at once on
        a second interrupt), and reaps them; the sentinels stay, so that a
        later join reports how they ended."""
        _stop_all(self.processes, _INTERRUPT_GRACE)
        self._done()

    def _error_for(self, index):
        process = self.processes[index]
        report = _errfile.read_error_file(self.error_files[index], self._private,
                                  f"process {index} (pid {process.pid})")
        if report is None:
            exitcode = process.exitcode
            if exitcode < 0:
                name = _signal_name(-exitcode)
                return ProcessExitedException(
                    f"process {index:d} terminated with signal {name}",
                    error_index=index, error_pid=process.pid, exit_code=exitcode,
                    signal_name=name), None
            return ProcessExitedException(
                f"process {index:d} terminated with exit code {exitcode:d}",
                error_index=index, error_pid=process.pid, exit_code=exitcode), None
        text, cause = report
        msg = f"\n\n-- Process {index:d} terminated with the following error:\n" + text
        return ProcessRaisedException(msg, index, process.pid), cause


class SpawnContext(ProcessContext):
    def __init__(self, processes, error_files):
        warnings.warn("SpawnContext is renamed to ProcessContext since 1.4 release.",
                      stacklevel=2)
        super().__init__(processes, error_files)


def _stop_all(processes, grace):
    try:
        for p in processes:
            if p.exitcode is None and p.is_alive():
                p.terminate()
        end = time.monotonic() + grace
        for p in processes:
            p.join(max(0, end - time.monotonic()))
    except KeyboardInterrupt:
        pass  # a second interrupt: kill at once
    finally:
        for p in processes:
            try:
                if p.is_alive():
                    p.kill()
            except (OSError, ValueError):
                pass
        for p in processes:
            try:
                p.join()
            except (OSError, ValueError):
                pass


# --- starting ---------------------------------------------------------------------

def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_env(nprocs):
    """What the parent's environment leaves unset of torchrun's rendezvous
    variables and the children's thread count: the shared values, and the
    names of the per-rank ones."""
    have = os.environ
    env = {}
    if "MASTER_ADDR" not in have:
        env["MASTER_ADDR"] = "127.0.0.1"
    if "MASTER_PORT" not in have:
        env["MASTER_PORT"] = str(_free_port())
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        if name not in have:
            env[name] = str(nprocs)
    ranks = tuple(name for name in ("RANK", "LOCAL_RANK") if name not in have)
    threads = _cores.share(nprocs)      # NOTE [ A rank's share of the cores ]
    if threads is not None:
        env[_cores.VAR] = str(threads)
    return env, ranks


def _check_nprocs(nprocs):
    if isinstance(nprocs, bool):
        raise TypeError(f"nprocs must be an int, not bool ({nprocs!r})")
    try:
        n = operator.index(nprocs)
    except TypeError:
        raise TypeError(f"nprocs must be an int, not {type(nprocs).__name__}") from None
    if n < 0:
        raise ValueError(f"nprocs must be a non-negative number of processes, got nprocs={n}")
    return n


def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    """Starts nprocs processes running fn(i, *args) for i in range(nprocs)
    under start_method; joins them when join is true, else returns their
    ProcessContext.  See spawn."""
    nprocs = _check_nprocs(nprocs)
    from ._context import get_context
    ctx = get_context(start_method)
    parallel = (start_method == "forkserver" and nprocs > 1
                and os.environ.get(ENV_VAR_PARALLEL_START, "0") == "1")

    me = os.getpid()
    env, ranks = _children_env(nprocs)
    # Made only by a child that fails: see NOTE [ Error files ].
    tmpdir = os.path.join(tempfile.gettempdir(), f"mpcore-spawn-{me}-{secrets.token_hex(8)}")
    error_files = [os.path.join(tmpdir, f"error-{i}.pickle") for i in range(nprocs)]
    processes = [None] * nprocs

    def start_one(i):
        # Taken on the thread that starts the child (NOTE [ Dying with the
        # parent ]): with parallel starts, not the main one.
        parent = _parentdeath.token()
        process = ctx.Process(target=_wrap, args=(fn, i, args, error_files[i], parent, env, ranks),
                              daemon=daemon)
        process.start()
        processes[i] = process

    context = None
    try:
        if parallel:
            log.info("Starting processes in parallel.")
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(max_workers=nprocs) as pool:
                futures = [pool.submit(start_one, i) for i in range(nprocs)]
            for f in futures:
                f.result()
        else:
            for i in range(nprocs):
                start_one(i)
        context = ProcessContext(processes, error_files)
        context._own_dir(tmpdir)
        if not join:
            return context
        # Loop on join until it returns True or raises an exception.
        while not context.join():
            pass
    except ProcessException:
        raise
    except BaseException as e:
        # Failed or interrupted while starting (or between start and join):
        # no child is left running, or unreaped.
        _stop_all([p for p in processes if p is not None], _INTERRUPT_GRACE)
        _errfile.remove_dir(tmpdir, me)
        if context is None and "pickl" in str(e).lower() and hasattr(e, "add_note"):
            e.add_note(f"start method {start_method!r} pickles fn and args to start each "
                       "process: fn must be a function defined at the top level of a module")
        raise


def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    r"""Spawns ``nprocs`` processes that run ``fn`` with ``args``.

    If one of the processes exits with a non-zero exit status, the remaining
    processes are killed and an exception is raised with the cause of
    termination.  If the child raised an exception, its traceback is in the
    raised exception's message and, when it pickles, the child's exception
    itself is the raised exception's ``__cause__``.

    Args:
        fn (function): the entry point of each process; it must be defined at
            the top level of a module so that it pickles.  It is called as
            ``fn(i, *args)``, ``i`` being the process index.
        args (tuple): Arguments passed to ``fn``.
        nprocs (int): Number of processes to spawn (0 starts none).
        join (bool): Perform a blocking join on all processes.
        daemon (bool): The spawned processes' daemon flag.
        start_method (str): (deprecated) this always uses ``spawn``; use
            ``start_processes()`` for another start method.

    Each child finds MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE and
    LOCAL_WORLD_SIZE set as torchrun would, where the parent left them unset,
    has its share of the cores for torch's threads (cores // nprocs) where
    the parent left OMP_NUM_THREADS and MKL_NUM_THREADS unset, and dies when
    the parent does.

    Returns:
        None if ``join`` is ``True``, :class:`~ProcessContext` if ``join`` is ``False``
    """
    if start_method != "spawn":
        msg = (f"This method only supports start_method=spawn (got: {start_method}).\n"
               "To use a different start_method use:\n\t\t"
               " torch.multiprocessing.start_processes(...)")
        warnings.warn(msg, FutureWarning, stacklevel=2)
    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn")
