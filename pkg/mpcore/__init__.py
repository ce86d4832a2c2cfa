"""mpcore: a C core for torch.multiprocessing.

Shared-memory tensors and arrays passed by handle, a shared-memory Queue,
and `mpcore run`, which serves these inside unchanged torch programs.
`import mpcore as mp` gives torch.multiprocessing's module surface.
"""
import sys as _sys

if not _sys.platform.startswith("linux"):
    raise ImportError(f"mpcore supports Linux only, not {_sys.platform!r}")

import multiprocessing as _mp

from ._core import HandleError
from . import _boot, _context, _shm, _stats
from ._context import (
    Context, Process, get_all_sharing_strategies, get_context, get_sharing_strategy,
    set_sharing_strategy,
)
from ._queue import Empty, Full, JoinableQueue, Queue, SimpleQueue
from ._api import empty, share_memory_, stats, zeros
from ._spawn import (
    ProcessContext, ProcessException, ProcessExitedException, ProcessRaisedException,
    SpawnContext, spawn, start_processes,
)

from ._version import __version__

set_start_method = _mp.set_start_method
get_start_method = _mp.get_start_method
get_all_start_methods = _mp.get_all_start_methods
cpu_count = _mp.cpu_count


def Pool(processes=None, initializer=None, initargs=(), maxtasksperchild=None):
    """multiprocessing's Pool under the current start method, with mpcore's
    processes as its workers (NOTE [ A Pool's workers are mpcore's ])."""
    return get_context().Pool(processes, initializer, initargs, maxtasksperchild)


__all__ = [
    "HandleError", "Process", "Queue", "SimpleQueue", "JoinableQueue", "Empty", "Full",
    "get_context", "set_start_method", "get_start_method", "get_all_start_methods",
    "cpu_count", "Pool", "set_sharing_strategy", "get_sharing_strategy",
    "get_all_sharing_strategies", "empty", "zeros", "share_memory_", "stats",
    "spawn", "start_processes", "ProcessContext", "SpawnContext", "ProcessException",
    "ProcessRaisedException", "ProcessExitedException",
]

# Tensor sharing is served from mpcore memory once torch is imported.
_boot.serve_torch(patch_multiprocessing=False)
_boot.when_imported("concurrent.futures.process", _context.serve_executor)
_shm.ensure_keeper()


def __getattr__(name):
    # Whatever mpcore does not reimplement is multiprocessing's.
    try:
        return getattr(_mp, name)
    except AttributeError:
        raise AttributeError(f"module 'mpcore' has no attribute {name!r}") from None
