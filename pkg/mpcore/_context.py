"""Processes and start-method contexts: torch.multiprocessing's module
surface, with mpcore's Process and queues, and the standard library's
everything else (Pool, Event, Lock, Value, Array, Manager, ...).

NOTE [ Contexts ]
An mpcore context wraps the standard library's context of the same start
method.  Process and the three queues are mpcore's; any other attribute is
looked up on the wrapped context, so nothing of multiprocessing is missing.
Pool stays the standard library's: it reaches into its queues' pipes.
"""
import multiprocessing as _mp
from multiprocessing import context as _mpctx

from . import _queue, _shm, _stats

_SHARING_STRATEGIES = {"file_descriptor", "file_system"}
_sharing_strategy = "file_descriptor"


class _ProcessMixin:
    def start(self):
        _stats.bump("processes_started")
        _shm.ensure_keeper()  # a spawned child must find this program's keeper
        return super().start()

    def run(self):
        try:
            return super().run()
        finally:
            _stats._report()


def _process_class(base):
    return type(base.__name__, (_ProcessMixin, base),
                {"__module__": __name__, "__qualname__": base.__name__})


ForkProcess = _process_class(_mpctx.ForkProcess)


class SpawnProcess(_ProcessMixin, _mpctx.SpawnProcess):
    """A 'spawn' process, forked by the zygote (NOTE [ Zygote ])."""

    _start_method = "spawn"

    @staticmethod
    def _Popen(process_obj):
        from . import _zygote
        return _zygote.popen(process_obj, "spawn")


class ForkServerProcess(_ProcessMixin, _mpctx.ForkServerProcess):
    """A 'forkserver' process: the zygote is mpcore's fork server."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj):
        from . import _zygote
        return _zygote.popen(process_obj, "forkserver")
_PROCESS = {"fork": ForkProcess, "spawn": SpawnProcess, "forkserver": ForkServerProcess}


class Process(_ProcessMixin, _mpctx.Process):
    """multiprocessing.Process under the default start method."""

    @staticmethod
    def _Popen(process_obj):
        return _PROCESS[_mp.get_start_method()]._Popen(process_obj)


class Context:
    """A start-method context whose Process and queues are mpcore's."""

    def __init__(self, method):
        self._ctx = _mp.get_context(method)
        self._method = method
        self.Process = _PROCESS[method]

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def get_start_method(self, allow_none=False):
        return self._method

    def Queue(self, maxsize=0):
        return _queue.Queue(maxsize)

    def SimpleQueue(self):
        return _queue.SimpleQueue()

    def JoinableQueue(self, maxsize=0):
        return _queue.JoinableQueue(maxsize)

    def __repr__(self):
        return f"<mpcore context {self._method!r}>"


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
    """Accepts torch's strategies; mpcore serves both from its own memory."""
    global _sharing_strategy
    if new_strategy not in _SHARING_STRATEGIES:
        raise AssertionError(f"invalid sharing strategy {new_strategy!r}")
    _sharing_strategy = new_strategy


def get_sharing_strategy():
    return _sharing_strategy


def get_all_sharing_strategies():
    return set(_SHARING_STRATEGIES)
