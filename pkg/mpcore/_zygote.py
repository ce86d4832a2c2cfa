"""The zygote from Python: starting it, asking it for children (the Popen of
mpcore's 'spawn' and 'forkserver' contexts), and the child's first steps.

NOTE [ Zygote ] in csrc/proc.c says what the zygote is.  Here:
- Under `mpcore run` the zygote is forked from the program the moment torch
  has been imported, else started by the program's first zygote child
  (NOTE [ The zygote costs only programs that use it ]).  A request waits
  in the socket's backlog until it is ready.
- A child gets spawn's semantics: the requester's os.environ, cwd, sys.path
  and sys.argv as of the request, __main__ imported as __mp_main__
  (multiprocessing.spawn.prepare does that part), fresh random seeds, and
  no fd but stdio and those handed to it.
- If the zygote has more than one thread when asked (something it
  imported started one), it refuses to fork, and the requester spawns the
  child by exec instead, saying so once.
"""
import errno
import gc
import io
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import warnings

from multiprocessing import context as _mpctx
from multiprocessing import popen_fork, popen_spawn_posix, spawn as _mpspawn, util

from . import _core

# The wire format has one definition, mpc_zmsg in mpcore.h; the module
# exports its layout, and the struct is built from it.
_FIELDS = ("magic", "op", "token", "arg", "arg2", "len", "nfds", "flags", "targets")


def _header_struct(layout, size):
    """The struct of the request header from the core's (field, offset, code)
    layout; RuntimeError when it is not the header this module packs."""
    if tuple(name for name, _, _ in layout) != _FIELDS:
        raise RuntimeError(f"mpcore: the zygote header's fields are {layout}, "
                           f"this module packs {_FIELDS}")
    fmt = "="
    for name, offset, code in layout:
        if struct.calcsize(fmt) != offset:
            raise RuntimeError(f"mpcore: the zygote header's field {name} is at byte {offset} "
                               f"in C but at {struct.calcsize(fmt)} in Python")
        fmt += code
    if struct.calcsize(fmt) != size:
        raise RuntimeError(f"mpcore: the zygote header is {size} bytes in C but "
                           f"{struct.calcsize(fmt)} in Python")
    return struct.Struct(fmt)


_MSG = _header_struct(_core.ZYGOTE_MSG_LAYOUT, _core.ZYGOTE_MSG_SIZE)
_MAGIC = _core.ZYGOTE_MAGIC
_SPAWN, _STARTED, _FAILED, _EXIT = (_core.ZYGOTE_SPAWN, _core.ZYGOTE_STARTED,
                                    _core.ZYGOTE_FAILED, _core.ZYGOTE_EXIT)
_MAX_FDS = _core.ZYGOTE_MAX_FDS
_INLINE_MAX = _core.ZYGOTE_INLINE_MAX  # larger payloads travel in a memfd
_FLAG_MEMFD = _core.ZYGOTE_FLAG_MEMFD
_FLAG_SIGCHLD = _core.ZYGOTE_FLAG_SIGCHLD
ENV = "MPCORE_ZYGOTE"
forked = False  # true in a child the zygote forked
PRELOAD_ENV = "MPCORE_ZYGOTE_PRELOAD"


# --- the zygote process ---------------------------------------------------

def _preload():
    names = os.environ.get(PRELOAD_ENV)
    names = names.split(",") if names is not None else ["numpy", "torch"]
    for name in filter(None, names):
        try:
            __import__(name)
        except ImportError:
            pass
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()  # its first call sets up machinery: not in every child
    # Libraries with thread pools (OpenBLAS) stop them before a fork and
    # start them again lazily: one throwaway fork leaves this process with
    # its one thread, as a zygote must be.
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def main():
    _ignore_stray_signals()
    # The zygote serves the program; it is not one of its processes, whose
    # counters MPCORE_STATS collects (its children get the requester's
    # environment back).
    os.environ.pop("MPCORE_STATS", None)
    _preload()
    gc.collect()
    _before_serving()
    gc.freeze()  # children do not copy pages just to touch GC headers
    return _serve(3, 4)


# NOTE [ A child's parent ]
# In the kernel, a zygote child's parent is the zygote; a spawned child's
# is the program, and programs signal it (os.kill(os.getppid(), SIGUSR1)
# to say a checkpoint is written) or watch it through os.getppid().  So in
# a zygote child os.getppid() gives the process that asked for it, as long
# as the zygote is its parent (a child dies with its requester, and one
# whose zygote is gone is given the pid the kernel gives).  A signal that
# still reaches the zygote, sent through a C library's getppid() or to
# every process of a job (SLURM's SIGTERM before preemption), does not end
# it: the zygote ignores SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2, and
# ends when its program does.  Its children get their own dispositions
# (NOTE [ What a spawned child inherits from its parent ]).  And the other
# way: a 'spawn' child's end sends its requester SIGCHLD, once the zygote
# has reaped it and sent its exit status, so that a handler that asks
# whether the child lives is told the truth (NOTE [ Reading the zygote's
# replies ]).  The signal comes from the zygote (its si_pid), and not for a
# child that only stops; a 'forkserver' child sends none, as the standard
# library's, a child of its fork server, does not.
_ZYGOTE_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _parent_is_the_requester(requester):
    zygote = os.getppid()
    real = os.getppid

    def getppid():
        ppid = real()
        return requester if ppid == zygote else ppid
    getppid.__doc__ = real.__doc__
    os.getppid = getppid


def _ignore_stray_signals():
    """NOTE [ A child's parent ].  Blocked as well as ignored: the kernel
    never discards a blocked signal, so one sent to a child between its
    fork and the moment it takes its own dispositions (a Pool's terminate()
    of a worker still starting) waits for it instead of being lost."""
    for sig in _ZYGOTE_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, _ZYGOTE_IGNORES)


def _before_serving():
    """What the zygote settles once it has imported what it preloads."""
    _ignore_stray_signals()
    _keep_finalizers_at_exit()
    _note_start_env()
    _note_signals_and_limits()


def _keep_finalizers_at_exit():
    """The weakref.finalize callbacks registered so far (torch's 134
    operator libraries, each unregistered at exit: 26 ms) stay uncalled
    at a child's end (NOTE [ A spawned child ends as python would ]): a
    process about to end need not tidy memory it leaves anyway, and one
    that the program registered before the zygote was forked (a
    TemporaryDirectory) is the program's to run, not every child's."""
    import weakref
    for f in list(weakref.finalize._registry):
        f.atexit = False


def _serve(root, lsock):
    payload = _core.Zygote(root, lsock).serve()
    if payload is None:
        return 0
    _child_main(payload)  # never returns


def _child_main(payload):
    """In a child just forked from the zygote: become the requested
    process and run it."""
    global forked
    forked = True
    code = 1
    try:
        f = io.BytesIO(payload)
        head = pickle.load(f)
        os.environ.clear()
        os.environ.update(head["env"])
        _as_a_spawned_child_inherits(head["parent"])
        _parent_is_the_requester(head["requester"])
        _named_as_python()
        _fresh_seeds()
        _as_a_fresh_start_reads_the_environment()
        # The zygote's stdout was /dev/null, so Python made it block-buffered;
        # buffer it as a spawned child would buffer the stdout it now has.
        if head["unbuffered"]:
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        else:
            sys.stdout.reconfigure(line_buffering=os.isatty(1))
        from multiprocessing import process, resource_tracker
        resource_tracker._resource_tracker._fd = head["tracker_fd"]
        process.current_process()._inheriting = True
        try:
            _mpspawn.prepare(head["prep"])
            proc = pickle.load(f)
        finally:
            del process.current_process()._inheriting
        code = proc._bootstrap(parent_sentinel=head["parent_sentinel"])
        if head["method"] == "spawn":
            end_as_python_would(code)
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        _exit_now(code)


def exit_code(e):
    """The exit status python gives a SystemExit that ends the program
    (a message is printed, and is status 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _exit_now(code):
    """Flushes stdout and stderr, then ends this process with `code`."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def end_as_python_would(code):
    """NOTE [ A spawned child ends as python would ]
    A process that multiprocessing spawns ends through sys.exit, so the
    interpreter finalizes: non-daemon threads are joined, atexit handlers
    run (weakref.finalize's among them: a TemporaryDirectory is removed,
    logging's handlers are flushed and closed), and the files the program
    left open are flushed as their objects go.  A zygote child cannot
    finalize (its stack is the import of torch that the zygote was born
    in, NOTE [ The zygote is born inside an import ]), so it ends with
    os._exit after doing those steps itself: threads, atexit, a collection
    (files in garbage cycles close as they are freed), and a flush of every
    file object still open.  Files are flushed, not closed: a daemon
    thread may still write to one, and python stops those threads before
    it frees anything.  Objects are not freed, so a __del__ that writes
    (zipfile's central directory) runs only for garbage.  A 'fork' or
    'forkserver' child ends by os._exit alone, as the standard library's
    do.  Handlers registered before torch's import, in the program the
    zygote was forked from, are inherited as well; a spawned process gets
    them only where re-importing __main__ registers them again.
    Never returns."""
    import atexit
    import threading
    try:
        try:
            threading._shutdown()
        finally:
            try:
                atexit._run_exitfuncs()
            finally:
                gc.collect()
                _flush_files()
    finally:
        _exit_now(code)


def _flush_files():
    """Flushes every open file object the collector tracks, text ones
    first (each pushes its text into its binary buffer)."""
    import _io  # its bases: io's are ABCs, slower to test against
    import warnings
    with warnings.catch_warnings():
        # isinstance reads __class__, which some objects warn about (torch
        # before 2.7: torch.distributed.reduce_op is deprecated)
        warnings.simplefilter("ignore")
        files = [o for o in gc.get_objects() if isinstance(o, _io._IOBase)]
    files.sort(key=lambda o: not isinstance(o, _io._TextIOBase))
    for f in files:
        try:
            if not f.closed:
                f.flush()
        except Exception:
            pass


# NOTE [ What a fresh start reads from the environment ]
# A spawned process reads some variables as it starts, where a zygote
# child has what the zygote read from its own environment; a program may
# set them before it starts children (torchrun's ranks get
# OMP_NUM_THREADS=1).  So the zygote notes the values it started with,
# and a child whose environment has others does what a fresh start would:
# - torch's intra-op thread count, from MKL_NUM_THREADS, else
#   OMP_NUM_THREADS, else the physical cores, at import (MKL, whose
#   OpenMP reads them when it loads, caps it at the physical cores): the
#   child sets it;
# - torch's logging (TORCH_LOGS, TORCH_LOGS_OUT, TORCH_LOGS_FORMAT), set
#   up at import: the child sets it up again;
# - PYTHONHASHSEED, read by the interpreter before anything runs, which
#   no child can change: the requester starts such a child by exec
#   (_why_exec), saying so once.
_THREAD_VARS = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
_LOG_VARS = ("TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT")
START_ENV = "MPCORE_ZYGOTE_START"  # the zygote's session and PYTHONHASHSEED, for requesters
_start_env = None  # the zygote's values of _THREAD_VARS + _LOG_VARS, once torch is imported


def _note_start_env():
    global _start_env
    if "torch" in sys.modules:
        _start_env = {v: os.environ.get(v) for v in _THREAD_VARS + _LOG_VARS}


def _hash_seed():
    seed = os.environ.get("PYTHONHASHSEED", "random")
    return "random" if seed in ("", "random") else seed


def _start_mark(seed):
    """What START_ENV holds for a zygote started now with hash seed `seed`."""
    return f"{os.getsid(0)} {seed}"


def _why_exec(parent):
    """Why a child must be started by exec, or None: its PYTHONHASHSEED
    (NOTE [ What a fresh start reads from the environment ]), or a session
    other than the zygote's in `parent`, what the child would inherit (NOTE
    [ A child's process group ])."""
    mark = os.environ.get(START_ENV)
    if mark is None:
        return None
    session, seed = mark.split(" ", 1)
    if seed != _hash_seed():
        return (f"PYTHONHASHSEED is {_hash_seed()!r} here but was {seed!r} when the zygote "
                f"started, and a forked child keeps the zygote's")
    if int(session) != parent["session"]:
        return ("this process started a session of its own (os.setsid()) after the zygote "
                "did, and a forked child could not join it")
    return None


def _env_threads(value):
    """A variable's thread count as OpenMP and MKL read it, or None when
    unset or not a positive number (they then ignore it)."""
    value = (value or "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _physical_cores():
    seen = set()
    try:
        with open("/proc/cpuinfo") as f:
            phys = "0"
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    phys = val.strip()
                elif key == "core id":
                    seen.add((phys, val.strip()))
    except OSError:
        pass
    return len(seen) or os.cpu_count() or 1


def _as_a_fresh_start_reads_the_environment():
    """NOTE [ What a fresh start reads from the environment ]."""
    if _start_env is None:
        return
    changed = {v for v in _start_env if os.environ.get(v) != _start_env[v]}
    if not changed:
        return
    torch = sys.modules["torch"]
    if changed & set(_THREAD_VARS):
        cores = _physical_cores()
        n = next(filter(None, (_env_threads(os.environ.get(v)) for v in _THREAD_VARS)), None)
        n = n or cores
        if torch.backends.mkl.is_available():
            n = min(n, cores)
        torch.set_num_threads(n)
    if changed & set(_LOG_VARS):
        from . import _torchapi
        init_logs = _torchapi.find("torch._logging._internal._init_logs")
        if init_logs is not None:   # else the child keeps the zygote's logging
            init_logs()


# NOTE [ What a spawned child inherits from its parent ]
# exec keeps a process's ignored signals ignored (python then keeps them so:
# an ignored SIGINT gets no KeyboardInterrupt handler), its blocked signals,
# resource limits, umask, nice value and CPU affinity.  A 'spawn' child of a program that
# ignores SIGHUP (nohup) or SIGINT (a shell's background job), raised its
# RLIMIT_NOFILE, set a umask or pinned itself to some cores has them too.
# A child forked from the zygote has the zygote's instead, so the requester
# sends its own (_parent_state, a few tens of microseconds) and the child
# takes over those that differ before anything runs, torch's threads
# included, which are made later and inherit the affinity.  A limit or a
# priority the child may not take (a hard limit above the zygote's without
# the privilege to raise it) is a warning, and the child runs on with the
# zygote's.  A 'forkserver' child of the standard library has its server's,
# which are its parent's when the parent started its first such child, so
# that is what a 'forkserver' child from the zygote takes.

_SIGNALS = None  # every valid signal number, for _parent_state
_RLIMITS = None  # every resource.RLIMIT_*


def _note_signals_and_limits():
    global _SIGNALS, _RLIMITS
    import resource
    if _SIGNALS is None:
        _SIGNALS = sorted(int(s) for s in signal.valid_signals())
        _RLIMITS = sorted(getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_"))


def _parent_state():
    import _signal
    import resource
    _note_signals_and_limits()
    get, ign = _signal.getsignal, _signal.SIG_IGN  # signal.getsignal's enums cost 100 us
    return {"ignored": [s for s in _SIGNALS if get(s) == ign],
            "rlimits": {r: resource.getrlimit(r) for r in _RLIMITS},
            "umask": _umask(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "affinity": os.sched_getaffinity(0),
            "blocked": signal.pthread_sigmask(signal.SIG_BLOCK, ()),
            "pgid": os.getpgrp(), "session": os.getsid(0)}


_server_state = {}  # pid: _parent_state() when this process first started a 'forkserver' child


def _parent_state_for(method):
    """What a child started by `method` inherits: this process's state for
    'spawn'; for 'forkserver', the state this process had when it started
    its first such child, which is when the standard library starts the
    server whose state its children inherit."""
    if method == "spawn":
        return _parent_state()
    pid = os.getpid()
    if pid not in _server_state:
        _server_state.clear()
        _server_state[pid] = _parent_state()
    return _server_state[pid]


def _umask():
    """This process's umask, read without setting it (os.umask would set
    it for an instant under the program's other threads), or None."""
    try:
        fd = os.open("/proc/self/status", os.O_RDONLY)
        try:
            text = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        return int(text.split(b"Umask:", 1)[1].split(None, 1)[0], 8)
    except (OSError, ValueError, IndexError):
        return None


def _as_a_spawned_child_inherits(state):
    """NOTE [ What a spawned child inherits from its parent ]."""
    import _signal
    ignored = set(state["ignored"])
    # set either way: the zygote ignores it, and most children must not
    signal.signal(signal.SIGINT, signal.SIG_IGN if signal.SIGINT in ignored
                  else signal.default_int_handler)
    for sig in _SIGNALS:
        if sig == signal.SIGINT:
            continue
        try:
            now = _signal.getsignal(sig)
            if sig in ignored and now != _signal.SIG_IGN:
                _signal.signal(sig, _signal.SIG_IGN)
            elif sig not in ignored and now == _signal.SIG_IGN:
                _signal.signal(sig, _signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    # the zygote's blocked signals (_ignore_stray_signals) give way to the
    # parent's mask; one sent meanwhile is delivered now
    signal.pthread_sigmask(signal.SIG_SETMASK, state["blocked"])
    import resource
    refused = []
    for r, limits in state["rlimits"].items():
        try:
            if resource.getrlimit(r) != limits:
                resource.setrlimit(r, limits)
        except (OSError, ValueError) as e:
            refused.append(f"resource limit {r} {limits} ({e})")
    if state["umask"] is not None:
        os.umask(state["umask"])
    if os.getpgrp() != state["pgid"]:  # NOTE [ A child's process group ]
        try:
            os.setpgid(0, state["pgid"])
        except OSError as e:
            refused.append(f"process group {state['pgid']} ({e})")
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) != state["nice"]:
            os.setpriority(os.PRIO_PROCESS, 0, state["nice"])
    except OSError as e:
        refused.append(f"nice {state['nice']} ({e})")
    try:
        if os.sched_getaffinity(0) != state["affinity"]:
            os.sched_setaffinity(0, state["affinity"])
    except OSError as e:
        refused.append(f"CPU affinity {sorted(state['affinity'])} ({e})")
    if refused:
        warnings.warn("mpcore: this spawned child could not take its parent's "
                      + ", ".join(refused) + "; it has the zygote's", RuntimeWarning)


# NOTE [ A child's process group ]
# A spawned child is in its parent's process group and session, which a
# program that made a group of its own (os.setpgrp()) or a session
# (os.setsid()) after the zygote started has left: its os.killpg() of its
# group must reach its children all the same.  So a zygote child joins its
# parent's group (for 'forkserver', the group its parent had at its first
# such child, as the standard library's server has it).  A group in
# another session cannot be joined, so a child of a process that started a
# session after the zygote did (for 'forkserver', before its first such
# child) is started by exec, saying so once.


def _named_as_python():
    """The child's name, which ps, top and pkill see, becomes a started
    python's (its executable's file name), not the zygote's."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(os.path.basename(sys.executable)[:15])
    except OSError:
        pass


def _fresh_seeds():
    # `random` reseeds itself after fork; numpy's global generator would
    # otherwise be the same in every child, unlike in spawned ones.
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


# --- the requester side ---------------------------------------------------

# NOTE [ Reading the zygote's replies ]
# One stream from the zygote carries every reply of this process: STARTED
# for a request, EXIT for each child.  Several threads may wait on it (one
# joins a child while another asks whether a second is alive), and so may
# a signal handler that interrupts a thread in the middle of a wait (a
# SIGTERM handler that looks at its workers while the program joins one),
# where multiprocessing, which waits with waitpid, has no lock to deadlock
# on.  So:
#   - the stream is only read without waiting, under `lock`, which is held
#     for nothing longer; what is read goes into `replies` and `exits`;
#   - a wait that must block has one thread at a time (the `watcher`)
#     sleep in select() on the stream and a wake-up pipe, holding nothing;
#     other blocking waiters sleep on the condition, and whoever reads
#     anything wakes both the watcher (a byte in the pipe) and them;
#   - a non-blocking look never waits for another thread: it reads what
#     is there and answers;
#   - a call made by a signal handler in a thread that holds `lock` (it
#     interrupted one of those short reads) answers from what was read
#     already, touching nothing; a request, which writes the stream, is
#     refused then, and the caller starts its child by exec.

def _poll(fds, events, timeout=None):
    """Waits (timeout in seconds, None: for ever) until one of fds has one
    of events; the list of those that have.  poll(), not select(): the
    program may hold more than FD_SETSIZE fds."""
    p = select.poll()
    for fd in fds:
        p.register(fd, events)
    return p.poll(None if timeout is None else timeout * 1000)


class _Client:
    """This process's connection to the zygote."""

    def __init__(self, address):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect("\0" + address)
        self.sock.setblocking(False)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.watcher = None   # the thread asleep in select()
        self.send_lock = threading.RLock()
        self.buf = b""
        self.token = 0
        self.replies = {}
        self.exits = {}

    def close(self):
        self.sock.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)

    def _pump(self):
        """Reads what the stream holds now into replies and exits; with
        lock held.  ConnectionError once the zygote has gone."""
        got, gone = b"", False
        while True:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                gone = True
                break
            got += chunk
        if got:
            self.buf += got
            n = len(self.buf) // _MSG.size * _MSG.size
            for at in range(0, n, _MSG.size):
                magic, op, token, arg, arg2, *_ = _MSG.unpack_from(self.buf, at)
                if op == _EXIT:
                    self.exits[arg] = arg2
                else:
                    self.replies[token] = (op, arg, arg2)
            self.buf = self.buf[n:]
            self._wake()
            self.cond.notify_all()
        if gone:
            raise ConnectionError("the mpcore zygote has gone")

    def _wake(self):
        if self.watcher is not None:
            try:
                os.write(self.wake_w, b"!")
            except BlockingIOError:  # a byte is there already
                pass

    def _wait(self, ready, block):
        """Waits until ready() holds (NOTE [ Reading the zygote's replies ]):
        True then; False at once if it does not hold and not `block`."""
        if self.lock._is_owned():  # a signal handler, amid this thread's read
            return ready()
        me = threading.get_ident()
        with self.cond:
            outer = self.watcher == me  # a signal handler, amid this thread's select
            try:
                while True:
                    if ready():
                        return True
                    self._pump()
                    if ready():
                        return True
                    if not block:
                        return False
                    if self.watcher not in (None, me):
                        self.cond.wait()
                        continue
                    self.watcher = me
                    self.lock.release()
                    try:
                        _poll([self.sock, self.wake_r], select.POLLIN)
                        try:
                            os.read(self.wake_r, 4096)
                        except BlockingIOError:
                            pass
                    finally:
                        self.lock.acquire()
                        self.watcher = None
                        self.cond.notify_all()  # another waiter may watch now
            finally:
                if outer:  # that select may have missed what was read here
                    self.watcher = me
                    self._wake()

    def request(self, payload, fds, targets, flags=0):
        """Asks for a child; a payload above _INLINE_MAX bytes goes as one
        more fd, a sealed memfd (NOTE [ Zygote payloads ] in proc.c).
        `flags`: _FLAG_SIGCHLD or 0."""
        if self.send_lock._is_owned() or self.lock._is_owned():
            raise _Fallback("a signal handler starts a process while its thread talks to "
                            "the zygote")
        nbytes = len(payload)
        pfd = _core.zygote_payload_fd(payload) if nbytes > _INLINE_MAX else None
        try:
            with self.send_lock:
                self.token += 1
                token = self.token
                sent = list(fds) + ([pfd] if pfd is not None else [])
                msg = _MSG.pack(_MAGIC, _SPAWN, token, 0, 0, nbytes, len(sent),
                                flags | (_FLAG_MEMFD if pfd is not None else 0),
                                *(list(targets) + [0] * (_MAX_FDS - len(targets))))
                self._send(msg, sent, payload if pfd is None else b"")
            if pfd is not None:
                os.close(pfd)
                pfd = None
            self._wait(lambda: token in self.replies, True)
            return self.replies.pop(token)
        finally:
            if pfd is not None:
                os.close(pfd)

    def _send(self, msg, fds, payload):
        """Writes a request on the non-blocking stream, waiting for room."""
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        while True:
            try:
                n = self.sock.sendmsg([msg], ancillary)  # the fds go with its first byte
                break
            except BlockingIOError:
                _poll([self.sock], select.POLLOUT)
        for data in (memoryview(msg)[n:], memoryview(payload)):  # the payload uncopied
            while data:
                try:
                    data = data[self.sock.send(data):]
                except BlockingIOError:
                    _poll([self.sock], select.POLLOUT)

    def exit_status(self, pid, block):
        try:
            if not self._wait(lambda: pid in self.exits, block):
                return None
        except ConnectionError:
            return _killed_with_the_zygote(pid, block)
        return self.exits.pop(pid)


_ZYGOTE_GONE_WAIT_S = 5.0  # the most a child killed with the zygote is waited for


def _killed_with_the_zygote(pid, block):
    """The wait status of child `pid` once its zygote has gone: the kernel
    kills a zygote child when the zygote ends (PR_SET_PDEATHSIG), so it is
    SIGKILL's, given once the child is gone (None before, when not
    `block`).  A pid reused meanwhile is waited for at most
    _ZYGOTE_GONE_WAIT_S.  Warns once."""
    global _gone_warned
    if not _gone_warned:
        _gone_warned = True
        warnings.warn("mpcore: the zygote has gone, and the processes it started were killed "
                      "with it", RuntimeWarning, stacklevel=2)
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already
        return signal.SIGKILL
    try:
        gone = _poll([fd], select.POLLIN, _ZYGOTE_GONE_WAIT_S if block else 0)
    finally:
        os.close(fd)
    return signal.SIGKILL if gone or block else None


_gone_warned = False


_client = None
_client_lock = threading.RLock()  # a signal handler may ask for the client amid its making
_service = None  # (fd to the zygote, pid) when this process started it
_forked = False  # ... by forking itself (fork_at_torch_import)

# NOTE [ The zygote costs only programs that use it ]
# A zygote that imports torch itself costs seconds of CPU, which a program
# that never starts a spawn child must not pay (a fork-worker DataLoader,
# a one-process training loop, torchrun's launcher); started on first need
# instead, it makes the first spawn wait for that import.  Under `mpcore
# run` neither is needed: the program imports torch anyway, so the moment
# its import of torch is done the launcher's process forks, and the child
# becomes the zygote.  That costs a fork (page tables, and later the
# copies of pages the program writes while the zygote shares them), not an
# import, and the zygote is warm before the program can ask it for a
# child.  A spawn child must still see none of the program's state, so the
# fork is made only where little of it can exist yet, and the zygote drops
# the rest:
# - only in the launcher's process, only at torch's first import, and only
#   while the program has no other Python thread (a native thread pool,
#   OpenBLAS's, stops itself around a fork; a zygote that still has more
#   than one thread exits, and the first request starts one by exec);
# - the zygote forgets the modules the program has imported from its own
#   directories (the script's and the working directory, outside the
#   installation) and those still being imported, so that a child imports
#   them afresh as a spawned child would; __main__ is replaced by
#   prepare(), as in every zygote child;
# - every fd of the program becomes /dev/null in the zygote (stdio
#   included), so that it holds no pipe, file or socket of the program open,
#   and an object that later closes one closes only a copy of /dev/null;
# - the program's Python signal handlers are put back to what they were at
#   start-up; its buffered output was flushed before the fork;
# - the warning filters stay as they are at the fork: the interpreter's
#   (-W, PYTHONWARNINGS), those that the imports of torch and of the other
#   libraries the zygote keeps made (torch's and numpy's six), which a
#   spawned child's imports would make again, and those of the program's
#   code before `import torch`, which the child's import of __mp_main__
#   runs again.
# Elsewhere (mpcore imported by a plain python program, torch imported
# while threads run, MPCORE_ZYGOTE_PRELOAD set) the zygote is started by
# exec on first need and imports what it preloads itself.

_launch = None  # (pid, hash seed at start-up) of the launcher


def fork_at_torch_import():
    """At launch: forks the zygote from this process once torch has been
    imported, where that is safe (NOTE [ The zygote costs only programs
    that use it ])."""
    global _launch
    if os.environ.get(ENV) or os.environ.get(PRELOAD_ENV) is not None:
        return
    _launch = (os.getpid(), _hash_seed())
    from ._boot import when_imported
    when_imported("torch", _fork_now)


# NOTE [ Pages the zygote shares ]
# After _fork_now the program and the zygote share every page the program
# had then, and the program's first write to each costs it a copy (a page
# fault).  Python's cyclic collector writes to every object it tracks at
# each full collection, so the program's first full collection after the
# fork (or the last ones, at exit) copied nearly all of them: a program
# that only imports torch ran 0.93x as fast as under python, and one
# training an MLP 0.93x too (13,600 faults where python had 3,300 for the
# same few ms of work and a collection).  So the program moves the objects
# it had at the fork to the collector's permanent generation
# (gc.freeze(), made for servers that fork): they are modules, classes and
# functions that live as long as the program, the collector no longer
# visits them, and their pages stay shared.  What the program makes later is
# collected as before.  Measured: 1.06x and 1.16x python.


def _fork_now(torch):
    global _service, _forked
    if (_launch is None or os.getpid() != _launch[0] or _service is not None
            or os.environ.get(ENV) or threading.active_count() != 1):
        return
    address, mine, theirs, lsock = _core.service_sockets("mpcore-zygote")
    util._flush_std_streams()
    pid = os.fork()
    if pid == 0:
        try:
            _become_zygote(mine, theirs, lsock)
        finally:
            os._exit(1)
    os.close(theirs)
    os.close(lsock)
    gc.freeze()  # NOTE [ Pages the zygote shares ]
    _service = (mine, pid)
    _forked = True
    os.environ[ENV] = address
    os.environ[START_ENV] = _start_mark(_launch[1])  # the interpreter's seed, as it started


def _program_modules():
    """The modules a spawned child would not have: those still being
    imported, and those found through the program's own directories (the
    script's, the working directory) rather than the installation.  A
    module's __file__ is the sys.path entry it was found through joined
    with its name, so comparing the strings suffices (no syscalls)."""
    cwd = os.getcwd()
    own = {sys.path[0] or cwd, cwd}
    roots = sorted({(p or cwd).rstrip(os.sep) + os.sep for p in sys.path if isinstance(p, str)},
                   key=len, reverse=True)
    own = {d.rstrip(os.sep) + os.sep for d in own}
    names = []
    for name, module in list(sys.modules.items()):
        if (getattr(getattr(module, "__spec__", None), "_initializing", False)
                and name != "torch"):  # torch's own import is done: this runs after it
            names.append(name)
            continue
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not os.path.isabs(path):
            continue  # built in, frozen, or a namespace object (torch.ops)
        if next((r for r in roots if path.startswith(r)), None) in own:
            names.append(name)
    return names


def _leave_the_import():
    """NOTE [ The zygote is born inside an import ]
    _fork_now runs in the hook on torch's import, so the zygote and every
    child it forks run with the import of torch (and of whatever the program
    was importing around it) still on the main thread's stack: torch's spec
    says it is initializing, and the main thread holds importlib's lock of
    each of those modules, for good.  Another thread of a child that imports
    torch (a callback on a collectives thread, a loader's thread) would wait
    on that lock forever.  torch's own import is done when the hook runs, so
    it is marked so, and the zygote (one thread, nothing importing) drops
    importlib's table of module locks: a later import makes a fresh one.  The
    program's modules that were still being imported are gone from
    sys.modules by then (_program_modules), to be imported afresh."""
    from importlib import _bootstrap
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__spec__", None) is not None:
        torch.__spec__._initializing = False
    locks = getattr(_bootstrap, "_module_locks", None)
    if locks is not None:
        locks.clear()


def _become_zygote(mine, root, lsock):
    """In the child of _fork_now: drops what it has of the program and
    serves as the zygote; never returns."""
    if len(os.listdir("/proc/self/task")) != 1:
        os._exit(0)  # a thread survived the fork: the first request starts one by exec
    os.close(mine)
    null = os.open(os.devnull, os.O_RDWR)
    keep = {root, lsock, null}
    if os.environ.get("MPCORE_DEBUG"):
        keep.add(2)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:
                pass  # the listing's own fd, closed by now
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    for name in _program_modules():
        sys.modules.pop(name, None)
    _leave_the_import()
    import types
    sys.modules["__main__"] = types.ModuleType("__main__")  # as `python -c` has
    os.environ.pop("MPCORE_STATS", None)
    _before_serving()
    gc.freeze()
    os._exit(_serve(root, lsock))


def _gone(pid):
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


def start():
    """Starts this program's zygote if none runs (or connects to it)."""
    global _service, _forked
    with _client_lock:
        if _forked and _gone(_service[1]):
            # the forked zygote found a thread it could not lose and left
            os.close(_service[0])
            _service, _forked = None, False
            os.environ.pop(ENV, None)
            os.environ.pop(START_ENV, None)
        if os.environ.get(ENV) or _service is not None:
            return
        argv = [sys.executable, *_interpreter_flags(), "-c",
                "import mpcore._zygote as z, sys; sys.exit(z.main())"]
        address, fd, pid = _core.spawn_service(argv, "mpcore-zygote")
        _service = (fd, pid)
        os.environ[ENV] = address
        os.environ[START_ENV] = _start_mark(_hash_seed())


def _interpreter_flags():
    """The flags of this interpreter that a spawned child is started with
    (-O, -B, -X faulthandler, -W ...), so that the zygote's children run
    as it would; not those that change where modules are found (-E, -s,
    -S, -I, -P): the zygote must find mpcore where this process did, and a
    child's sys.path is the parent's anyway."""
    from multiprocessing import util
    return [a for a in util._args_from_interpreter_flags()
            if a not in ("-E", "-s", "-S", "-I", "-P")]


def stop():
    """Stops the zygote this process started: closing the program's
    connection makes it kill its children and exit (NOTE [ Zygote ] in
    csrc/proc.c).  Returns its pid, for the caller to reap, or None when
    this process started none."""
    global _client, _service, _forked
    with _client_lock:
        if _client is not None:
            _client.close()
            _client = None
        service, _service, _forked = _service, None, False
        os.environ.pop(ENV, None)
        os.environ.pop(START_ENV, None)
    if service is None:
        return None
    os.close(service[0])
    return service[1]


def _get_client():
    global _client
    with _client_lock:
        if _client is None:
            address = os.environ.get(ENV)
            if not address:
                raise ConnectionError("no zygote")
            _client = _Client(address)
        return _client


def _after_fork_child():
    global _client, _service, _client_lock, _forked
    _client_lock = threading.RLock()
    _forked = False
    if _client is not None:
        _client.close()
    _client = None
    if _service is not None:
        os.close(_service[0])
        _service = None


def _close_client():
    if _client is not None:
        _client.close()


os.register_at_fork(after_in_child=_after_fork_child)
# After multiprocessing's own exit handler, which may still poll children.
util.Finalize(None, _close_client, exitpriority=-100)
_warned = False


class Popen(popen_fork.Popen):
    """Starts a Process by asking the zygote to fork it; `start_method`,
    'spawn' or 'forkserver', is the one whose ending the child has (NOTE
    [ A spawned child ends as python would ])."""

    method = "spawn"
    DupFd = popen_spawn_posix._DupFd

    def __init__(self, process_obj, start_method="spawn"):
        self._fds = []
        self._start_method = start_method
        super().__init__(process_obj)

    def duplicate_for_child(self, fd):
        self._fds.append(fd)
        return fd

    def _launch(self, process_obj):
        from multiprocessing import reduction, resource_tracker
        start()
        parent = _parent_state_for(self._start_method)
        why = _why_exec(parent)
        if why is not None:
            raise _Fallback(why)
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep = _mpspawn.get_preparation_data(process_obj._name)
        parent_r, child_w = os.pipe()    # EOF for the parent when the child ends
        child_r, parent_w = os.pipe()    # EOF for the child when the parent ends
        try:
            fp = io.BytesIO()
            _mpctx.set_spawning_popen(self)
            try:
                reduction.dump({"env": dict(os.environ), "prep": prep, "tracker_fd": tracker_fd,
                                "parent_sentinel": child_r, "method": self._start_method,
                                "parent": parent,
                                "requester": os.getpid(),
                                "unbuffered": bool(os.environ.get("PYTHONUNBUFFERED"))}, fp)
                reduction.dump(process_obj, fp)
            finally:
                _mpctx.set_spawning_popen(None)
            fds = list(dict.fromkeys([0, 1, 2, child_w, child_r] + self._fds))
            room = _MAX_FDS - (fp.tell() > _INLINE_MAX)  # one for the payload's memfd
            if len(fds) > room:
                raise _Fallback(f"{len(fds)} fds to hand over, more than {room}")
            try:
                op, arg, arg2 = _get_client().request(
                    fp.getbuffer(), fds, fds,
                    _FLAG_SIGCHLD if self._start_method == "spawn" else 0)
            except (ConnectionError, OSError) as e:
                raise _Fallback(f"the zygote cannot be reached ({e})") from None
            if op == _FAILED:
                if arg == errno.EDEADLK:
                    raise _Fallback(f"the zygote has {arg2} threads, so it must not fork")
                raise OSError(arg, f"the mpcore zygote could not fork: {os.strerror(arg)}")
        except BaseException:
            for fd in (parent_r, parent_w):
                os.close(fd)
            raise
        finally:
            os.close(child_w)
            os.close(child_r)
        self.pid = arg
        self.sentinel = parent_r
        self.finalizer = util.Finalize(self, util.close_fds, [parent_r, parent_w])

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None:
            status = _get_client().exit_status(self.pid, block=flag != os.WNOHANG)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class _Fallback(Exception):
    pass


def popen(process_obj, method):
    """The Popen for a process of an mpcore 'spawn' or 'forkserver' context:
    the zygote's, or the standard library's spawn if the zygote cannot."""
    global _warned
    try:
        return Popen(process_obj, method)
    except _Fallback as e:
        if not _warned:
            _warned = True
            warnings.warn(f"mpcore: {e}; starting processes by exec instead (slower)",
                          RuntimeWarning, stacklevel=4)
        from . import _parentdeath
        # a zygote child dies with its parent; so does this one, first thing
        # in its _bootstrap (NOTE [ Dying with the parent ])
        process_obj._mpcore_die_with = _parentdeath.token()
        return popen_spawn_posix.Popen(process_obj)
