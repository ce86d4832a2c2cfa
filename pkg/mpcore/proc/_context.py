"""Processes and start-method contexts: torch.multiprocessing's module
surface, with mpcore's Process and queues, and the standard library's
everything else (Pool, Event, Lock, Value, Array, Manager, ...).

NOTE [ Contexts ]
An mpcore context is a multiprocessing BaseContext that wraps the
standard library's context of the same start method.  Process and the
three queues are mpcore's; every other method and attribute is the
wrapped context's, so nothing of multiprocessing is missing.  Pool stays
the standard library's (it reaches into its queues' pipes), with mpcore's
Process for its workers (NOTE [ A Pool's workers are mpcore's ]).
"""
import multiprocessing as _mp
import os
from multiprocessing import context as _mpctx

from ..queue import _queue
from ..shm import _blocks
from .. import _stats
from . import _cores

# torch's on Linux, and its default.
_SHARING_STRATEGIES = frozenset({"file_descriptor", "file_system"})
_sharing_strategy = "file_descriptor"


class _ProcessMixin:
    def start(self):
        _stats.bump("processes_started")
        _blocks.ensure_keeper()  # a spawned child must find this program's keeper
        return super().start()

    def _bootstrap(self, *args, **kwargs):
        # Not run(): a subclass's own run() need not call ours, and a frame
        # of ours would show in every traceback a child prints.
        token = getattr(self, "_mpcore_die_with", None)  # started by exec (_popen.popen)
        if token is not None:
            from . import _parentdeath
            _parentdeath.die_with(token)
        try:
            return super()._bootstrap(*args, **kwargs)
        finally:
            _stats.report()


def _process_class(base):
    return type(base.__name__, (_ProcessMixin, base),
                {"__module__": __name__, "__qualname__": base.__name__})


ForkProcess = _process_class(_mpctx.ForkProcess)


class SpawnProcess(_ProcessMixin, _mpctx.SpawnProcess):
    """A 'spawn' process, forked by the zygote (NOTE [ Zygote ])."""

    _start_method = "spawn"

    @staticmethod
    def _Popen(process_obj):
        from . import _popen
        return _popen.popen(process_obj, "spawn")


class ForkServerProcess(_ProcessMixin, _mpctx.ForkServerProcess):
    """A 'forkserver' process: the zygote is mpcore's fork server."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj):
        from . import _popen
        return _popen.popen(process_obj, "forkserver")
_PROCESS = {"fork": ForkProcess, "spawn": SpawnProcess, "forkserver": ForkServerProcess}


class Process(_ProcessMixin, _mpctx.Process):
    """multiprocessing.Process under the default start method."""

    @staticmethod
    def _Popen(process_obj):
        return _PROCESS[_mp.get_start_method()]._Popen(process_obj)


class Context(_mpctx.BaseContext):
    """A start-method context whose Process, queues and Pool are mpcore's.
    It is a BaseContext, as torch's contexts are (torch's DataLoader checks
    its multiprocessing_context so); BaseContext's other methods, and any
    other attribute, are those of the standard library's context of the
    same start method."""

    def __init__(self, method):
        self._ctx = _mp.get_context(method)
        self._method = method
        self.Process = _PROCESS[method]

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def get_start_method(self, allow_none=False):
        return self._method

    def get_context(self, method=None):
        return self if method is None else get_context(method)

    def Queue(self, maxsize=0):
        return _queue.Queue(maxsize)

    def SimpleQueue(self):
        return _queue.SimpleQueue()

    def JoinableQueue(self, maxsize=0):
        return _queue.JoinableQueue(maxsize)

    def Pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None):
        """NOTE [ A Pool's workers are mpcore's ]
        The standard library's Pool, whose queues it reaches into, given a
        context that is the standard library's but for Process: its
        workers are mpcore's (a 'spawn' or 'forkserver' worker comes from
        the zygote instead of importing torch again), which take their
        share of the cores (NOTE [ A rank's share of the cores ])."""
        from multiprocessing.pool import Pool
        initializer, initargs = _sharing(processes, initializer, initargs)
        return Pool(processes, initializer, initargs, maxtasksperchild,
                    context=_PoolContext(self))

    def __repr__(self):
        return f"<mpcore context {self._method!r}>"


def _delegate(name):
    def method(self, *args, **kwargs):
        return getattr(self._ctx, name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(_mpctx.BaseContext, name).__doc__
    return method


for _name, _value in list(vars(_mpctx.BaseContext).items()):
    if (callable(_value) and not isinstance(_value, type) and not _name.startswith("__")
            and _name not in vars(Context)):
        setattr(Context, _name, _delegate(_name))


class _PoolContext:
    """NOTE [ A Pool's workers are mpcore's ]; NOTE [ An executor's
    workers are mpcore's ]."""

    def __init__(self, ctx):
        self._ctx = ctx._ctx
        self.Process = ctx.Process

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def serve_executor(cfp):
    """NOTE [ An executor's workers are mpcore's ]
    concurrent.futures' ProcessPoolExecutor, given an mpcore context as
    its mp_context (torch.multiprocessing.get_context(...) under `mpcore
    run`), asks it for a SimpleQueue and then waits on that queue's pipe
    (`_reader`), which a ring does not have.  So, as a Pool, it is given
    the standard library's context but for Process: its queues are pipes,
    its workers mpcore's.  Installed when concurrent.futures.process is
    imported, by a wrapper of the executor's __init__ that changes nothing
    else."""
    import functools
    cls = cfp.ProcessPoolExecutor
    init = cls.__init__
    if getattr(init, "__mpcore__", False):
        return

    @functools.wraps(init)
    def __init__(self, max_workers=None, mp_context=None, initializer=None, initargs=(),
                 **kwargs):
        if isinstance(mp_context, Context):
            mp_context = _PoolContext(mp_context)
            initializer, initargs = _sharing(max_workers, initializer, initargs)
        init(self, max_workers, mp_context, initializer, initargs, **kwargs)

    __init__.__mpcore__ = True
    cls.__init__ = __init__


def _sharing(workers, initializer, initargs):
    """A pool's initializer and its arguments, such that each of its workers
    (workers, or as many as the pool makes by default) first takes its share
    of the cores (NOTE [ A rank's share of the cores ]).  An initializer
    that is not callable stays, for the pool to refuse."""
    if workers is None:
        workers = (getattr(os, "process_cpu_count", None) or os.cpu_count)() or 1
    threads = _cores.share(workers) if isinstance(workers, int) else None
    if threads is None or not (initializer is None or callable(initializer)):
        return initializer, initargs
    return _cores.then, (threads, initializer) + tuple(initargs)


_contexts = {}


def get_context(method=None):
    if method is None:
        method = _mp.get_start_method()
    if method not in _PROCESS:
        raise ValueError(f"cannot find context for {method!r}")
    if method not in _contexts:
        _contexts[method] = Context(method)
    return _contexts[method]


def set_sharing_strategy(new_strategy):
    """Sets the strategy for sharing CPU tensors, as torch's does: one of
    get_all_sharing_strategies(), else AssertionError.

    NOTE [ Sharing strategies ]
    The strategy is recorded, and reported by get_sharing_strategy(), but
    changes nothing: with either one, CPU tensors and storages are moved into
    mpcore's memory (memfd segments served by the keeper) and pass between
    processes as handles.  That is by design: torch's "file_system" exists to
    avoid running out of file descriptors and to survive fd passing limits,
    and mpcore passes one fd per segment and process pair, never one per
    tensor, and leaves no file in /dev/shm behind.  torch's own record of the
    strategy (torch.multiprocessing._sharing_strategy) is kept equal, so that
    code reading it agrees.
    """
    global _sharing_strategy
    if new_strategy not in _SHARING_STRATEGIES:
        raise AssertionError(f"invalid sharing strategy {new_strategy!r}, "
                             f"expected one of {set(_SHARING_STRATEGIES)}")
    _sharing_strategy = new_strategy
    import sys
    tmp = sys.modules.get("torch.multiprocessing")
    if tmp is not None and hasattr(tmp, "_sharing_strategy"):
        tmp._sharing_strategy = new_strategy


def get_sharing_strategy():
    """The strategy set_sharing_strategy() last set ("file_descriptor" at
    first, as torch's on Linux); NOTE [ Sharing strategies ]."""
    return _sharing_strategy


def get_all_sharing_strategies():
    """The strategies set_sharing_strategy() accepts: torch's on Linux."""
    return set(_SHARING_STRATEGIES)
