"""mpcore: a C core for torch.multiprocessing.

Shared-memory tensors and arrays passed by handle, a shared-memory Queue,
and `mpcore run`, which serves these inside unchanged torch programs.
`import mpcore as mp` gives torch.multiprocessing's module surface.

NOTE [ Layers of the package ]
Each layer imports only its own modules and those of the layers beneath it,
and reads only their public names (tests/package/test_py_layers.py checks both,
imports inside functions included).  From the bottom up:
  base    _core (the C core), _version, _hooks (calls on a module's
          import), _torchapi (the one table of torch's internals), _stats
  shm/    shared-memory blocks and numpy arrays, torch's tensors in them
  queue/  the pickler, Queue over a ring, tensor records, what `import
          mpcore` serves once numpy or torch is imported
  proc/   dying with the parent, the zygote (its process, its children's
          first steps, the connection to it, Popen), contexts, Process,
          error files, spawn
  data/   the DataLoader over mpcore's worker pool
  dist/   the torch.distributed backend: the shared-memory group, NCCL,
          the process group and its parts, groups across hosts, fast paths
  faces   mpcore (this file), mpcore.distributed, mpcore.parallel
  run/    `mpcore run`: the hooks that serve every process of a program
          (mpcore.pth calls run/_boot.activate_run), torchrun's command line
  tools   `mpcore doctor` (_doctor), the `mpcore` command (__main__)
A module that waits for a library it does not import (torch, numpy,
torch._dynamo) registers with _hooks.when_imported, at whatever layer it is;
what must run for a higher layer is called by that layer (run/_boot.py
makes torch's names mpcore's), never reached for from below.
"""
import sys as _sys

if not _sys.platform.startswith("linux"):
    raise ImportError(f"mpcore supports Linux only, not {_sys.platform!r}")

import multiprocessing as _mp

from ._core import HandleError
from . import _hooks, _stats
from .shm import _blocks
from .queue import _serve
from .proc import _context
from .proc._context import (
    Context, Process, get_all_sharing_strategies, get_context, get_sharing_strategy,
    set_sharing_strategy,
)
from .queue._queue import Empty, Full, JoinableQueue, Queue, SimpleQueue
from .shm._api import empty, share_memory_, stats, zeros
from .proc._spawn import (
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
_serve.serve_tensors()
_hooks.when_imported("concurrent.futures.process", _context.serve_executor)
_blocks.ensure_keeper()


def __getattr__(name):
    # Whatever mpcore does not reimplement is multiprocessing's.
    try:
        return getattr(_mp, name)
    except AttributeError:
        raise AttributeError(f"module 'mpcore' has no attribute {name!r}") from None
