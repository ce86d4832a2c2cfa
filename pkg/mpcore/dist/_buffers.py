"""Group buffers: CPU storage reduced again and again moved, in place, into
shared memory the ranks read from each other (NOTE [ Group buffers ] in
coll_copy.c), and the core calls that take a buffer.

NOTE [ Memory reduced again and again ]
An all-reduce or reduce of memory that is the rank's own is staged
through the group's region (every byte copied in and out), or from 1 MB
copied between the ranks (NOTE [ Copies between ranks' memory ] in
coll.c): system calls that take each peer's memory map lock, and a copy
into a scratch area.  In a group buffer (NOTE [ Group buffers ] in
coll_copy.c) the ranks read each other's data where it lies.  So a
storage of BUFFER_MIN bytes or more that a rank reduces a second time,
all-reduce and reduce alike (torch's DDP buckets, FSDP's and the
program's own gradient buffers: memory reduced again and again), is
moved into a group buffer in place, as share_memory_() moves a storage
(into_buffer), and stays there until the storage is freed, when the
buffer goes with it.
all_to_all_single's input follows the same rule: its peers then read
their pieces where they lie (16 MB on two ranks, `mpcore bench --only
c10d-alltoall-16m`: 1.23-1.77 ms before, 0.65-0.97 ms after), and so do
the inputs of all_gather_into_tensor and reduce_scatter_tensor (`--only
c10d-allgather-16m,c10d-reducescatter-16m`: all_gather 1.50-2.04 ms
before, 0.91-1.24 ms after; reduce_scatter 1.67-1.83 ms before, 1.11-1.47
ms after).

Once is not enough: a tensor reduced once (a metric, a checkpoint
average) would pay a copy and shared memory for nothing.  And the second
time must be the same storage, not a new one that malloc put where a
freed one lay: a loop that reduces a tensor it makes anew each step (the
gradients of `zero_grad(set_to_none=True)` averaged by hand) finds the
same address again and again, and moving those would cost a buffer's
setup, its faults and a copy every other step (16 MB made and
all-reduced per step on two ranks: 12.2 ms per step with those moves,
3.2-4.5 ms without).  So the last _SEEN_MAX storages seen once are
remembered by a weak reference to their Python object, which torch keeps
for as long as the storage lives.  torch's own weak reference would not
do: it keeps a freed storage's memory.  _SEEN_MAX is large because a
program reduces many storages in turn before it comes back to the first:
with 64 remembered, the 100 gradients of a loop over a model's parameters
(or DDP's buckets past 64) each left the list before their second call,
and none was ever moved (`mpcore bench --only c10d-allreduce-1m-x100`).

Each buffer keeps a file descriptor open for its peers to map it through,
so a process holds at most a quarter of its descriptor limit in buffers
(_room_for_buffer): past that, and when the system refuses a buffer, the
storage stays where it is, and the program keeps its descriptors.

Only memory torch's own allocator gave and that no one else sees is
moved: not a storage over a numpy array, a file or another process's
shared memory (not resizable, or shared), nor pinned memory, which would
lose its pinning; such memory is looked at when it comes a second time
(buffer_of), and stays where it is.  Each rank
decides alone; when not every rank names a buffer the core copies
between ranks' memory as before, so the result never depends on the
choice.  Without memory for a buffer the storage stays where it is.
"""
import collections
import functools
import resource
import weakref

import torch

from .. import _core, _torchapi

# None where torch cannot move a storage in place: no group buffers then
# (NOTE [ Moving a storage in place ] in _torch.py).
SWAP = _torchapi.find("torch.UntypedStorage._swap_data_ptr_")


# NOTE [ Group buffers from 64 KB ]
# Measured on two ranks, dist.all_reduce of the same tensor again and
# again, staged against from a group buffer (us per call): 8 KB 6.4 and
# 5.0, 16 KB 8.4 and 5.2, 64 KB 17.4 and 7.6, 256 KB 47.5 and 15.2, 768 KB
# 135 and 39; on four ranks (two a core) 64 KB 46.6 and 21.1, 768 KB 339
# and 112.  The movers' inputs gain from 256 KB (all_gather_into_tensor 33
# and 17 us, reduce_scatter_tensor 34 and 17, all_to_all_single 30 and 22)
# and are even at 64 KB (all_to_all_single 12 and 13).  What it costs: a
# tensor made anew for each call now pays buffer_of too (its storage's
# Python object, a weak reference), measured with both thresholds
# alternated in one pair of ranks: 64 KB 21.4 and 23.3 us, 256 KB 58.8 and
# 61.9, 768 KB 170 and 182 (5 to 9%).  Below 64 KB the gain is a few
# microseconds, for a descriptor per buffer and that cost each call, so
# smaller storages stay where they are.
BUFFER_MIN = 64 << 10
_SEEN_MAX = 4096         # storages remembered as reduced once
# address -> a weak reference to the GroupBuffer a storage was moved into, gone
# with it (a dict's get costs a third of a WeakValueDictionary's)
_held = {}
_seen = collections.OrderedDict()       # address -> weakref.ref of a storage reduced once


def into_buffer(s):
    """Moves CPU storage s into a new GroupBuffer in place (every tensor over
    s follows, NOTE [ Moving a storage in place ] in _torch.py) and returns
    the buffer, which s's memory keeps alive.  MemoryError when there is no
    shared memory for it; s is then unchanged."""
    n = s.nbytes()
    b = _core.GroupBuffer(n)
    new = torch.frombuffer(b, dtype=torch.uint8, count=n)  # holds b
    new.copy_(torch.empty(0, dtype=torch.uint8).set_(s))
    SWAP(s, new.untyped_storage())
    addr = b.address

    def gone(ref):
        if _held.get(addr) is ref:
            del _held[addr]
    _held[addr] = weakref.ref(b, gone)
    return b


def with_buffer(call, buf):
    """The core's call, given the group buffer buf by name when there is one
    (the group's run appends the timeout to its arguments)."""
    return call if buf is None else functools.partial(call, buffer=buf)


def buffer_of(t):
    """The GroupBuffer holding t (CPU, contiguous) for the core's all-reduce,
    reduce, all-to-all, all-gather or reduce-scatter, moving t's storage
    into one when the same storage comes a second time; or None.  Whether
    its memory may move at all is asked only then: a tensor made anew for
    each call never comes a second time, and the question (is_shared()
    above all) cost half the bookkeeping."""
    s = t.untyped_storage()
    addr = s.data_ptr()
    ref = _held.get(addr)
    if ref is not None and (b := ref()) is not None:
        return b
    if s.nbytes() < BUFFER_MIN or SWAP is None:
        return None
    ref = _seen.pop(addr, None)
    if ref is None or ref() is not s:       # first seen (or new where a freed one lay)
        _seen[addr] = weakref.ref(s)
        if len(_seen) > _SEEN_MAX:
            _seen.popitem(last=False)
        return None
    if (not s.resizable() or s.is_shared() or (torch.cuda.is_initialized() and s.is_pinned())
            or not _room_for_buffer()):
        return None     # memory that never moves, or no room for another buffer
    try:
        return into_buffer(s)
    except (MemoryError, OSError):      # no memory, or no descriptor, for it
        return None


def _room_for_buffer():
    """Whether this process may hold one more group buffer: fewer than a
    quarter of its file descriptor limit (NOTE [ Memory reduced again and
    again ])."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft == resource.RLIM_INFINITY or len(_held) < soft // 4
