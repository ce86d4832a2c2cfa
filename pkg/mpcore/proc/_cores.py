"""The share of the cores that each of a group of children takes for
torch's threads: the ranks of one spawn call, the workers of a Pool or of a
ProcessPoolExecutor on an mpcore context.

NOTE [ A rank's share of the cores ]
torch gives a process as many intra-op threads as the machine has cores,
so n processes that compute at once run n times as many threads as there
are cores; and an OpenMP thread that runs out of work spins for a while
(libgomp: 300,000 pauses) before it sleeps, on a core that another
process needs, be it a rank its peers wait for in a collective or a
worker of the same map.  Measured on two cores (ms):
- a DDP program, torch's DDP on gloo, an MLP 512-1024-1024-10 at batch 64,
  2 ranks from torch.multiprocessing.spawn, a step: `python` 82-98 and
  `mpcore run` 52-66 with torch's two threads a rank; 20-23 and 13 with one;
- Pool(2).map of 64 tasks of torch ops (a 256x256 matmul and elementwise
  ops on 20,000 floats, 50 times): 1,693 to 6,479 under `python` and 1,954
  to 5,389 under `mpcore run` with two threads a worker; 550 to 608 with one.
torchrun sets OMP_NUM_THREADS=1 for more than one rank where the
environment leaves it unset, and torch's DataLoader gives each worker one
thread.  Here each of n > 1 children gets its share, cores // n (at least
one), which a machine of many cores keeps busy: the variable (read by a
torch imported later, and by the child's own children) and, where torch is
imported already, torch.set_num_threads.  A parent whose environment sets
OMP_NUM_THREADS or MKL_NUM_THREADS keeps its choice, and a child may call
torch.set_num_threads as under torch.
"""
import os
import sys

from . import _inherit

VAR = "OMP_NUM_THREADS"


def share(n):
    """Intra-op threads for each of n children: the cores torch gives one
    process (the physical cores this process may run on), shared; None
    when n < 2 or the environment sets a thread count."""
    if n < 2 or any(v in os.environ for v in _inherit.THREAD_VARS):
        return None
    cores = min(_inherit.physical_cores(), len(os.sched_getaffinity(0)))
    return max(1, cores // n)


def take(threads):
    """In a child: its share, for torch now and for what it starts later."""
    os.environ[VAR] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def then(threads, initializer, *initargs):
    """A pool worker's initializer: its share, then the program's own."""
    take(threads)
    if initializer is not None:
        initializer(*initargs)
