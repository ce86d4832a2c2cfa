"""The zygote from Python: the zygote process itself, its fork from the
program at torch's import, and this process's zygote (start, stop, the
connection).  Its children's first steps are _child.py's, what they take
over from their requester _inherit.py's, the connection's protocol
_client.py's, and the Popen of mpcore's 'spawn' and 'forkserver' contexts
_popen.py's.

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
import gc
import os
import signal
import sys
import threading

from multiprocessing import util

from .. import _core
from . import _child, _client, _inherit

ENV = "MPCORE_ZYGOTE"
PRELOAD_ENV = "MPCORE_ZYGOTE_PRELOAD"
START_ENV = _inherit.START_ENV


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


def _ignore_stray_signals():
    """NOTE [ A child's parent ].  Blocked as well as ignored: the kernel
    never discards a blocked signal, so one sent to a child between its
    fork and the moment it takes its own dispositions (a Pool's terminate()
    of a worker still starting) waits for it instead of being lost."""
    for sig in _inherit.ZYGOTE_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, _inherit.ZYGOTE_IGNORES)


def _before_serving():
    """What the zygote settles once it has imported what it preloads."""
    _ignore_stray_signals()
    _keep_finalizers_at_exit()
    _inherit.note_zygote_state()


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
    _child.child_main(payload)  # never returns


_conn = None
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
    _launch = (os.getpid(), _inherit.hash_seed())
    from .._hooks import when_imported
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
    os.environ[START_ENV] = _inherit.start_mark(_launch[1])  # the interpreter's seed, as it started


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
                "import mpcore.proc._zygote as z, sys; sys.exit(z.main())"]
        address, fd, pid = _core.spawn_service(argv, "mpcore-zygote")
        _service = (fd, pid)
        os.environ[ENV] = address
        os.environ[START_ENV] = _inherit.start_mark(_inherit.hash_seed())


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
    global _conn, _service, _forked
    with _client_lock:
        if _conn is not None:
            _conn.close()
            _conn = None
        service, _service, _forked = _service, None, False
        os.environ.pop(ENV, None)
        os.environ.pop(START_ENV, None)
    if service is None:
        return None
    os.close(service[0])
    return service[1]


def started():
    """(pid, forked) of the zygote this process started, forked true when
    it forked itself at torch's import; None when it started none."""
    return None if _service is None else (_service[1], _forked)


def client():
    """This process's connection to its zygote; ConnectionError when none runs."""
    global _conn
    with _client_lock:
        if _conn is None:
            address = os.environ.get(ENV)
            if not address:
                raise ConnectionError("no zygote")
            _conn = _client.Client(address)
        return _conn


def _after_fork_child():
    global _conn, _service, _client_lock, _forked
    _client_lock = threading.RLock()
    _forked = False
    if _conn is not None:
        _conn.close()
    _conn = None
    if _service is not None:
        os.close(_service[0])
        _service = None


def _close_client():
    if _conn is not None:
        _conn.close()


os.register_at_fork(after_in_child=_after_fork_child)
# After multiprocessing's own exit handler, which may still poll children.
util.Finalize(None, _close_client, exitpriority=-100)
