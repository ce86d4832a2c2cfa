"""The zygote from Python: starting it, asking it for children (the Popen of
mpcore's 'spawn' and 'forkserver' contexts), and the child's first steps.

NOTE [ Zygote ] in csrc/proc.c says what the zygote is.  Here:
- The zygote is started by `mpcore run` at launch, at idle priority, or by
  the program's first zygote child (NOTE [ The zygote costs only programs
  that use it ]).  A request waits in the socket's backlog until it is
  ready.
- A child gets spawn's semantics: the requester's os.environ, cwd, sys.path
  and sys.argv as of the request, __main__ imported as __mp_main__
  (multiprocessing.spawn.prepare does that part), fresh random seeds, and
  no fd but stdio and those handed to it.
- If the zygote has more than one thread when asked (something it
  imported started one), it refuses to fork, and the requester spawns the
  child by exec instead, saying so once.
"""
import atexit
import errno
import io
import os
import pickle
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The zygote serves the program; it is not one of its processes, whose
    # counters MPCORE_STATS collects (its children get the requester's
    # environment back).
    os.environ.pop("MPCORE_STATS", None)
    _preload()
    import gc
    gc.collect()
    gc.freeze()  # children do not copy pages just to touch GC headers
    _leave_idle()  # warm: its children run at the program's priority
    payload = _core.Zygote(3, 4).serve()
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
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _leave_idle()
        _fresh_seeds()
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
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _fresh_seeds():
    # `random` reseeds itself after fork; numpy's global generator would
    # otherwise be the same in every child, unlike in spawned ones.
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


# --- the requester side ---------------------------------------------------

class _Client:
    """This process's connection to the zygote."""

    def __init__(self, address):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect("\0" + address)
        self.lock = threading.Lock()
        self.token = 0
        self.replies = {}
        self.exits = {}

    def _read_one(self):
        data = b""
        while len(data) < _MSG.size:
            chunk = self.sock.recv(_MSG.size - len(data))
            if not chunk:
                raise ConnectionError("the mpcore zygote has gone")
            data += chunk
        magic, op, token, arg, arg2, *_ = _MSG.unpack(data)
        if op == _EXIT:
            self.exits[arg] = arg2
        else:
            self.replies[token] = (op, arg, arg2)

    def request(self, payload, fds, targets):
        """Asks for a child; a payload above _INLINE_MAX bytes goes as one
        more fd, a sealed memfd (NOTE [ Zygote payloads ] in proc.c)."""
        nbytes = len(payload)
        pfd = _core.zygote_payload_fd(payload) if nbytes > _INLINE_MAX else None
        try:
            with self.lock:
                self.token += 1
                token = self.token
                sent = list(fds) + ([pfd] if pfd is not None else [])
                msg = _MSG.pack(_MAGIC, _SPAWN, token, 0, 0, nbytes, len(sent),
                                _FLAG_MEMFD if pfd is not None else 0,
                                *(list(targets) + [0] * (_MAX_FDS - len(targets))))
                self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           struct.pack(f"{len(sent)}i", *sent))])
                if pfd is None:
                    self.sock.sendall(payload)
                else:
                    os.close(pfd)
                    pfd = None
                while token not in self.replies:
                    self._read_one()
                return self.replies.pop(token)
        finally:
            if pfd is not None:
                os.close(pfd)

    def exit_status(self, pid, block):
        with self.lock:
            while pid not in self.exits:
                if not block:
                    self.sock.setblocking(False)
                    try:
                        self._read_one()
                    except BlockingIOError:
                        return None
                    finally:
                        self.sock.setblocking(True)
                else:
                    self._read_one()
            return self.exits.pop(pid)


_client = None
_client_lock = threading.Lock()
_service = None  # (fd to the zygote, pid) when this process started it
_idle_pid = None  # the zygote this process started idle, until it needs it

# NOTE [ The zygote costs only programs that use it ]
# The zygote imports torch a second time: seconds of CPU that a program
# which never starts a spawn child must not pay (a fork-worker DataLoader,
# a one-process training loop, torchrun's launcher).  Two ways were
# measured (`mpcore bench --only run-,spawn-first`):
# - Started on first need (a spawn or forkserver Process, a spawn
#   DataLoader, spawn()): free for programs that never need it, but the
#   first spawn always waits for the zygote's own import of torch.
# - Started at launch under SCHED_IDLE: it runs only on a core the program
#   leaves idle, so it never takes one from the program.  Once warm it
#   returns to the normal policy (its children inherit the zygote's); the
#   program's first request raises it at once, so a program that needs it
#   before it is warm waits no longer than with the first way; and at the
#   program's exit a zygote still warming up is killed.
# Where a core is free, an idle zygote warms up there at full speed, as
# one at normal priority did, so the first spawn stays ~0.3 s instead of a
# torch import.  Where every core was busy (2 cores, heavily loaded) both
# gave the same first spawn (the zygote's import then runs after the
# program's, not beside it at half the speed of each), and neither cost the
# program wall time.  So the second is used.  What it
# still costs is CPU time on cores that would otherwise idle.  Leaving
# SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE that allows the
# program's nice value (without it every child of the zygote would stay
# idle), so where that is not allowed the zygote starts on first need.

_CAP_SYS_NICE = 23


def _may_leave_idle():
    """Whether a process of this user, at this process's nice value, may go
    from SCHED_IDLE back to the normal policy (the kernel's can_nice)."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if soft == resource.RLIM_INFINITY or 20 - nice <= soft:
        return True
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except OSError:
        pass
    return False


def _leave_idle(pid=0):
    """Puts pid (this process when 0) back on the normal policy if it is
    idle; quietly does nothing where that is not allowed."""
    try:
        if os.sched_getscheduler(pid) == os.SCHED_IDLE:
            os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass


def start_early():
    """At launch: starts the zygote at idle priority, where it may leave it
    (NOTE [ The zygote costs only programs that use it ])."""
    global _idle_pid
    if os.environ.get(ENV) or _service is not None or not _may_leave_idle():
        return
    start()
    try:
        os.sched_setscheduler(_service[1], os.SCHED_IDLE, os.sched_param(0))
        _idle_pid = _service[1]
    except OSError:
        return
    atexit.register(_stop_warming)


def _stop_warming():
    """At the program's exit: a zygote that is still warming up (still
    idle, so it has no child) is killed, not left to finish an import for
    nothing; it would only notice the program's end once warm."""
    pid = _idle_pid
    if pid is not None:
        try:
            if os.sched_getscheduler(pid) == os.SCHED_IDLE:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def start():
    """Starts this program's zygote if none runs (or connects to it); a
    zygote this process started idle is raised to the normal policy."""
    global _service, _idle_pid
    with _client_lock:
        if _idle_pid is not None:
            _leave_idle(_idle_pid)
            _idle_pid = None
        if os.environ.get(ENV) or _service is not None:
            return
        argv = [sys.executable, "-c", "import mpcore._zygote as z, sys; sys.exit(z.main())"]
        address, fd, pid = _core.spawn_service(argv, "mpcore-zygote")
        _service = (fd, pid)
        os.environ[ENV] = address


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
    global _client, _service, _client_lock, _idle_pid
    _client_lock = threading.Lock()
    _idle_pid = None
    if _client is not None:
        _client.sock.close()
    _client = None
    if _service is not None:
        os.close(_service[0])
        _service = None


def _close_client():
    if _client is not None:
        _client.sock.close()


os.register_at_fork(after_in_child=_after_fork_child)
atexit.register(_close_client)
_warned = False


class Popen(popen_fork.Popen):
    """Starts a Process by asking the zygote to fork it."""

    method = "spawn"
    DupFd = popen_spawn_posix._DupFd

    def __init__(self, process_obj):
        self._fds = []
        super().__init__(process_obj)

    def duplicate_for_child(self, fd):
        self._fds.append(fd)
        return fd

    def _launch(self, process_obj):
        from multiprocessing import reduction, resource_tracker
        start()
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
                                "parent_sentinel": child_r,
                                "unbuffered": bool(os.environ.get("PYTHONUNBUFFERED"))}, fp)
                reduction.dump(process_obj, fp)
            finally:
                _mpctx.set_spawning_popen(None)
            fds = list(dict.fromkeys([0, 1, 2, child_w, child_r] + self._fds))
            room = _MAX_FDS - (fp.tell() > _INLINE_MAX)  # one for the payload's memfd
            if len(fds) > room:
                raise _Fallback(f"{len(fds)} fds to hand over, more than {room}")
            try:
                op, arg, arg2 = _get_client().request(fp.getbuffer(), fds, fds)
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
        return Popen(process_obj)
    except _Fallback as e:
        if not _warned:
            _warned = True
            warnings.warn(f"mpcore: {e}; starting processes by exec instead (slower)",
                          RuntimeWarning, stacklevel=4)
        return popen_spawn_posix.Popen(process_obj)
