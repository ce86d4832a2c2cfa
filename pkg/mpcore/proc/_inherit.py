"""What a child forked from the zygote takes over from the process that
asked for it, so that it starts as a spawned child would (NOTE [ Zygote ]
in csrc/proc.c): the requester's side (what it sends, and whether the
zygote can serve it at all) and the child's (taking it over).  The zygote
notes its own start-up values here before it serves (note_zygote_state).
"""
import os
import signal
import sys
import warnings

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
ZYGOTE_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _parent_is_the_requester(requester):
    zygote = os.getppid()
    real = os.getppid

    def getppid():
        ppid = real()
        return requester if ppid == zygote else ppid
    getppid.__doc__ = real.__doc__
    os.getppid = getppid


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
#   (why_exec), saying so once.
THREAD_VARS = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
_LOG_VARS = ("TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT")
START_ENV = "MPCORE_ZYGOTE_START"  # the zygote's session and PYTHONHASHSEED, for requesters
_start_env = None  # the zygote's values of THREAD_VARS + _LOG_VARS, once torch is imported


def _note_start_env():
    global _start_env
    if "torch" in sys.modules:
        _start_env = {v: os.environ.get(v) for v in THREAD_VARS + _LOG_VARS}


def hash_seed():
    seed = os.environ.get("PYTHONHASHSEED", "random")
    return "random" if seed in ("", "random") else seed


def start_mark(seed):
    """What START_ENV holds for a zygote started now with hash seed `seed`."""
    return f"{os.getsid(0)} {seed}"


def why_exec(parent):
    """Why a child must be started by exec, or None: its PYTHONHASHSEED
    (NOTE [ What a fresh start reads from the environment ]), or a session
    other than the zygote's in `parent`, what the child would inherit (NOTE
    [ A child's process group ])."""
    mark = os.environ.get(START_ENV)
    if mark is None:
        return None
    session, seed = mark.split(" ", 1)
    if seed != hash_seed():
        return (f"PYTHONHASHSEED is {hash_seed()!r} here but was {seed!r} when the zygote "
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


def physical_cores():
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
    if changed & set(THREAD_VARS):
        cores = physical_cores()
        n = next(filter(None, (_env_threads(os.environ.get(v)) for v in THREAD_VARS)), None)
        n = n or cores
        if torch.backends.mkl.is_available():
            n = min(n, cores)
        torch.set_num_threads(n)
    if changed & set(_LOG_VARS):
        from .. import _torchapi
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


def parent_state_for(method):
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


def note_zygote_state():
    """In the zygote, once it has imported what it preloads: the values a
    child compares with its requester's (NOTE [ What a fresh start reads
    from the environment ], NOTE [ What a spawned child inherits from its
    parent ])."""
    _note_start_env()
    _note_signals_and_limits()


def become_spawned(parent, requester):
    """In a child just forked from the zygote: takes over what a spawned
    child of `requester` would have (`parent`: what parent_state_for gave
    the requester)."""
    _as_a_spawned_child_inherits(parent)
    _parent_is_the_requester(requester)
    _named_as_python()
    _fresh_seeds()
    _as_a_fresh_start_reads_the_environment()
