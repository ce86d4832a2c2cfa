"""mpcore as a torch.distributed backend: ProcessGroupMpcore, registered
under the name "mpcore", serves every collective of every group that torch
routes to it (dist.*, functional collectives, DTensor, FSDP, DDP, ...).

NOTE [ The backend is a ProcessGroup ]
A C++ c10d Backend cannot be made from Python (it has no constructor
there); a Python subclass of torch.distributed.ProcessGroup can, and torch
takes what the backend's creator returns as the group itself.  torch's
Python functions call the group's methods by name (group.allreduce(...),
group.gather(...)); the C++ dispatcher (functional collectives, compiled
graphs) reaches the same methods through the ProcessGroup's pybind
trampoline.  Each method takes CPU tensors to the group's shared-memory
region (mpcore._dist.ShmGroup over the C core, csrc/coll.c), CUDA tensors
to mpcore's NCCL communicator of the group (made on first CUDA use, which
every rank reaches at the same call), and returns a Work with torch's
surface.  A call with asyncOp false runs at once on the caller's thread
(after what the group has queued); one with asyncOp true runs on the
group's thread, in the order asked for.  Point-to-point calls always run
on the group's thread, since torch gives them no asyncOp.

NOTE [ The group is its own backend ]
A C++ ProcessGroup lists the Backends registered on it, one per device;
ours has none registered, since it is the group and the backend at once.
torch's Python asks a group for them: `_device_types` decides the device
of object collectives, whether DCP's async_save may run, and where
set_model_state_dict broadcasts from rank 0; `_get_backend(device)` is
asked for a backend's capabilities (FSDP2's comm allocator, split_group,
time estimates).  So the group answers both for itself: the devices it
serves (CPU, and CUDA through NCCL where torch sees a GPU), itself as
their backend, and no capability beyond the collectives.  One of torch's
functions looks past that: `_set_pg_timeout(timeout, group)` (called by
training stacks after their first step) sets the timeout only of the
gloo and NCCL backends it finds, and warns otherwise; on our group it
calls the group's set_timeout instead (_set_pg_timeout below).

NOTE [ The backend's cost per call ]
A small all-reduce is a few microseconds in the core, so the layer above
counts.  torch's dist.all_reduce spends about as much as the core before it
calls the group (its checks, options, logging wrapper); the backend adds
the reading of opts.reduceOp (a new pybind object each time), one dict
lookup for what the core reduces (_CORE), and a completed Work without an
event (_Done) for a synchronous call.  The dispatcher is the way in, except
for six of torch's module functions and three functional collectives
whose own cost measurement put above the core's (NOTE [ A fast path for
torch's module functions ] and NOTE [ A fast path for the functional
collectives ] in _fastpath.py).

NOTE [ What the core cannot serve ]
- Ranks on several machines: the group has no region (ShmGroup is None),
  and a HierGroup (_hier.py, NOTE [ Hierarchical groups ]) serves every
  call: shared memory inside each host, gloo among the hosts' leaders, and
  a flat gloo ProcessGroup on the same store for the rest.  It is
  made eagerly, in the creator, because it is then the group's only
  transport, and because gloo's connect is collective over all ranks of
  the group: made on first need, a need that only some ranks reach (a
  send, a wrong call) would hang in connect instead of failing.  Whether
  there is a region depends only on the hosts the ranks published in the
  store, so every rank makes the same choice.
- A reduction the core lacks for a dtype (float8, complex, a dtype the
  core does not know): on one machine this is not sent to
  gloo, which lacks the same dtypes, but done by the core's all-gather of
  the raw bytes followed by a reduction in torch, in rank order, the same
  code on every rank, so every rank gets the same bits.  The choice depends
  only on the dtype and op, which the ranks share (ranks that disagree are
  told so by the core, which compares what each asked for).
- PREMUL_SUM (an NCCL-only op) is refused with a clear error, as gloo
  does, and so is AVG of integers (as the core: no rounding rule to pick).

NOTE [ Memory reduced again and again ]
A large all-reduce or reduce of memory that is the rank's own copies it
between the ranks (NOTE [ Copies between ranks' memory ] in coll.c):
system calls that take each peer's memory map lock, and a copy into a
scratch area.  In a group buffer (NOTE [ Group buffers ] in coll.c) the
ranks read each other's data where it lies.  So a storage of BUFFER_MIN
bytes or more that a rank reduces a second time, all-reduce and reduce
alike (torch's DDP buckets, FSDP's and the program's own gradient
buffers: memory reduced again and again), is moved into a group buffer
in place, as share_memory_() moves a storage (into_buffer), and stays
there until the storage is freed, when the buffer goes with it.
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
do: it keeps a freed storage's memory.

Only memory torch's own allocator gave and that no one else sees is
moved: not a storage over a numpy array, a file or another process's
shared memory (not resizable, or shared), nor pinned memory, which would
lose its pinning; such memory is not remembered either.  Each rank
decides alone; when not every rank names a buffer the core copies
between ranks' memory as before, so the result never depends on the
choice.  Without memory for a buffer the storage stays where it is.
"""
import collections
import datetime
import functools
import hashlib
import os
import queue
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed import distributed_c10d as _c10d

from . import _core, _dist, _torchapi

_AllgatherOptions = _torchapi.get("torch._C._distributed_c10d.AllgatherOptions")  # not re-exported
# None where torch cannot move a storage in place: no group buffers then
# (NOTE [ Moving a storage in place ] in _torch.py).
_SWAP = _torchapi.find("torch.UntypedStorage._swap_data_ptr_")

_RED = ReduceOp.RedOpType


def _tables():
    """(torch dtype -> core code, RedOpType -> core code) of what this core
    reduces (NOTE [ What the core cannot serve ])."""
    dtypes = {getattr(torch, n): c for n, c in _core.COLL_DTYPES.items() if hasattr(torch, n)}
    return dtypes, {getattr(_RED, n): c for n, c in _core.COLL_OPS.items()}


DTYPES, OPS = _tables()
# (torch dtype, RedOpType) -> (dtype code, op code) of what the core reduces itself
_CORE = {(dt, red): (dc, oc) for dt, dc in DTYPES.items() for red, oc in OPS.items()
         if (red != _RED.AVG or dt.is_floating_point)
         and (red not in (_RED.BAND, _RED.BOR, _RED.BXOR) or not dt.is_floating_point)}
# the same by dtype, then by the op's value (hashing a pybind enum costs more than indexing)
_CORE_ROWS = {dt: tuple(_CORE.get((dt, r)) for r in sorted(_RED.__members__.values(),
                                                        key=lambda r: r.value))
              for dt in DTYPES}
assert all(r.value == i for i, r in enumerate(sorted(_RED.__members__.values(),
                                                     key=lambda r: r.value)))
_FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
_BITWISE = (_RED.BAND, _RED.BOR, _RED.BXOR)
_NO_TIMEOUT = datetime.timedelta(0)


# --- group buffers (NOTE [ Memory reduced again and again ]) ---------------------------

BUFFER_MIN = 1 << 20     # the core's MPC_COLL_CMA_AR_MIN: smaller all-reduces are staged
_SEEN_MAX = 64           # storages remembered as reduced once
_held = weakref.WeakValueDictionary()   # address -> the GroupBuffer a storage was moved into
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
    _SWAP(s, new.untyped_storage())
    _held[b.address] = b
    return b


def _in_buffer(method, buf, *args):
    """method(*args, buf): a core call whose last arguments are the timeout
    (which the group's run appends) and then the group buffer."""
    return method(*args, buf)


def _all_to_all_in(core, out, inp, send, recv, buf, timeout):
    core.all_to_all(out.data_ptr(), inp.data_ptr(), send, recv, timeout, buf)


def _buffer_of(t):
    """The GroupBuffer holding t (CPU, contiguous) for the core's all-reduce,
    reduce, all-to-all, all-gather or reduce-scatter, moving t's storage
    into one when the same storage comes a second time; or None."""
    s = t.untyped_storage()
    addr = s.data_ptr()
    b = _held.get(addr)
    if b is not None:
        return b
    n = s.nbytes()
    if (n < BUFFER_MIN or _SWAP is None or not s.resizable() or s.is_shared()
            or (torch.cuda.is_initialized() and s.is_pinned())):
        return None     # small, or memory that never moves: not remembered either
    ref = _seen.pop(addr, None)
    if ref is not None and ref() is s:      # the same storage, a second time
        try:
            return into_buffer(s)
        except MemoryError:
            return None
    _seen[addr] = weakref.ref(s)
    if len(_seen) > _SEEN_MAX:
        _seen.popitem(last=False)
    return None


# --- Work ------------------------------------------------------------------------

class Work(_dist.Work, dist.Work):
    """torch's Work for a call of the group (NOTE [ The backend is a
    ProcessGroup ]): wait(timeout), is_completed, exception, get_future,
    result; _source_rank for a receive (None for any other call, of which
    torch's Work refuses it, as here); the profiler's events of the call
    that made it, which end before a waiter wakes (NOTE [ Collectives in
    the profiler ])."""

    _events = None

    def __init__(self, tensors):
        dist.Work.__init__(self)
        _dist.Work.__init__(self, tensors)
        self._source = None
        if _recording:
            self._events = getattr(_inside, "events", None)

    def _end(self, exc=None):
        events = self._events
        if events is not None:
            self._events = None
            events.end()
        return _dist.Work._end(self, exc)

    def wait(self, timeout=_NO_TIMEOUT):
        s = _dist._seconds(timeout)
        if not s or s <= 0:
            self._run_here()
        if not self._wait_done(s if s and s > 0 else None):
            raise TimeoutError(f"Work.wait: the collective did not complete within {s:g} s "
                               "(it goes on; wait again or look at the group's timeout)")
        if self._exc is not None:
            raise self._exc
        return True

    def _source_rank(self):
        self.wait()
        if self._source is None:
            raise RuntimeError("sourceRank() may only be called on work objects that "
                               "correspond to a recv or recv-from-any call.")
        return self._source

    def source_rank(self):
        return self._source_rank()

    def synchronize(self):
        self.wait()


class _Done(dist.Work):
    """The Work of a call that completed before it returned: no event to
    wait on (NOTE [ The backend's cost per call ])."""

    def __init__(self, tensors):
        dist.Work.__init__(self)
        self._tensors = tensors

    def wait(self, timeout=_NO_TIMEOUT):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._tensors

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut

    def synchronize(self):
        pass


_done = _Done


def _checked(what, red, tensors, async_op):
    """None when the op suits the tensors; else, for async_op, a Work that
    reports the error (as the group's thread reports the core's), and
    otherwise the error is raised."""
    try:
        _check_op(what, red, tensors)
    except ValueError as e:
        if not async_op:
            raise
        w = Work(tensors)
        w._finish(e)
        return w
    return None


# --- helpers ------------------------------------------------------------------------

def _nbytes(t):
    return t.numel() * t.element_size()


_ALIGN = 16   # bytes: where each piece of a packed all-gather starts



class _AllOf(dist.Work):
    """The Work of a coalescing block: done when all of its calls are."""

    def __init__(self, works):
        dist.Work.__init__(self)
        self._works = works

    def wait(self, timeout=_NO_TIMEOUT):
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def is_success(self):
        return all(w.is_success() for w in self._works)

    def exception(self):
        return next((e for e in (w.exception() for w in self._works) if e is not None), None)

    def result(self):
        return [t for w in self._works for t in w.result()]

    def get_future(self):
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(
            lambda fut: [t for f in fut.value() for t in f.value()])

    def synchronize(self):
        self.wait()


class _Dense:
    """A contiguous CPU stand-in for a tensor: the tensor itself when it is
    one, else a contiguous copy (copied in when `read`) that back() copies
    out into the tensor."""
    __slots__ = ("orig", "t")

    def __init__(self, t, read=True):
        if t.is_contiguous() and t.layout == torch.strided:
            self.orig, self.t = None, t
        else:
            self.orig = t
            self.t = t.contiguous() if read else torch.empty(t.shape, dtype=t.dtype)

    def back(self):
        if self.orig is not None:
            self.orig.copy_(self.t)


def _plain_list(lists, like, n):
    """The one list of n tensors in `lists` (a call's output lists of a
    gather, input lists of a scatter; n == 0: none, or one empty list),
    when each is a contiguous CPU tensor of like's dtype and shape; else
    None (the call's general path, which also names what is wrong)."""
    if not n:
        return () if not lists or (len(lists) == 1 and not lists[0]) else None
    if len(lists) != 1 or len(lists[0]) != n:
        return None
    dtype, shape = like.dtype, like.shape
    for t in lists[0]:
        if not (t.is_cpu and t.is_contiguous() and t.dtype == dtype and t.shape == shape):
            return None
    return lists[0]


def _check_cpu(what, tensors):
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"mpcore: {what} got a tensor on {t.device}; a call takes tensors "
                             "all on the CPU or all on CUDA devices")
        if t.layout != torch.strided:
            raise ValueError(f"mpcore: {what} takes dense tensors, not {t.layout}")


def _same_shapes(what, tensors, like):
    for t in tensors:
        if t.dtype != like.dtype or t.shape != like.shape:
            raise ValueError(f"mpcore: {what}: every tensor must have the input's dtype and "
                             f"shape ({like.dtype}, {tuple(like.shape)}), not ({t.dtype}, "
                             f"{tuple(t.shape)})")


def _op_name(op):
    return getattr(op, "name", str(op))


def _check_op(what, red, tensors):
    """A clear error, before anyone waits, for an op no path serves."""
    if red == _RED.PREMUL_SUM:
        raise ValueError(f"mpcore: {what} with PREMUL_SUM is not supported (an NCCL op); "
                         "scale the tensor and use SUM")
    for t in tensors:
        if red == _RED.AVG and not (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"mpcore: {what}: avg needs a floating-point dtype, not {t.dtype}")
        if red in _BITWISE and (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"mpcore: {what}: {_op_name(red)} needs an integer or bool dtype, "
                             f"not {t.dtype}")


def _reduce_stack(stack, red, world):
    """The reduction over dim 0 of stack (world, ...) by `red` (RedOpType),
    in rank order, as the same code on every rank
    (NOTE [ What the core cannot serve ])."""
    dt = stack.dtype
    if dt == torch.bool:
        x = stack.to(torch.uint8)
        fns = {_RED.SUM: torch.bitwise_or, _RED.MAX: torch.bitwise_or, _RED.BOR: torch.bitwise_or,
               _RED.PRODUCT: torch.bitwise_and, _RED.MIN: torch.bitwise_and,
               _RED.BAND: torch.bitwise_and, _RED.BXOR: torch.bitwise_xor}
    else:
        if dt.is_floating_point:
            cd = torch.float64 if dt == torch.float64 else torch.float32
        elif dt.is_complex:
            cd = torch.complex128 if dt == torch.complex128 else torch.complex64
        else:
            cd = torch.int64
        x = stack.to(cd) if dt != torch.uint64 else stack.view(torch.int64)
        fns = {_RED.SUM: torch.add, _RED.AVG: torch.add, _RED.PRODUCT: torch.mul,
               _RED.MIN: torch.minimum, _RED.MAX: torch.maximum}
        if not (dt.is_floating_point or dt.is_complex):
            fns.update({_RED.BAND: torch.bitwise_and, _RED.BOR: torch.bitwise_or,
                        _RED.BXOR: torch.bitwise_xor})
    fn = fns.get(red)
    if fn is None:
        raise ValueError(f"mpcore: reduction {_op_name(red)} is not defined for {dt}")
    acc = functools.reduce(fn, x.unbind(0))
    if red == _RED.AVG:
        acc = acc / world
    if dt == torch.uint64:
        return acc.view(torch.uint64)
    return acc.to(dt)


# --- the group ------------------------------------------------------------------------

class ProcessGroupMpcore(dist.ProcessGroup):
    """One rank's handle on a process group served by mpcore
    (NOTE [ The backend is a ProcessGroup ]).  `.shm` is the group's
    ShmGroup, None when the ranks are not all on one machine."""

    def __init__(self, store, rank, world, timeout_s, shm, gloo):
        super().__init__(rank, world)
        self._store = store
        self._rank = rank
        self._world = world
        self._timeout_s = timeout_s
        self.shm = shm
        self._gloo = gloo
        self._nccl = None
        self._torch_nccl = None  # torch's ProcessGroupNCCL, where torch has one
        self._name = ""
        self._desc = ""
        self._asked = None  # NOTE [ The name the group answers to ]
        self._monitored = 0  # monitored_barrier calls (NOTE [ monitored_barrier's protocol ])
        self._batch = None  # the point-to-point Works of a coalescing block
        self._split_count = 0  # split_group calls on this group (NOTE [ Splitting a group ])
        # global rank -> this group's rank (_create_extended sets a subgroup's)
        self._group_ranks = {r: r for r in range(world)}
        self._send_lanes = [f"mpcore-send-{q}" for q in range(world)]  # lane names by rank
        if shm is not None:
            shm.work_type = Work

    # -- identity ---------------------------------------------------------------
    def getBackendName(self):
        """NOTE [ The name the group answers to ]
        torch records the backend a program asked for (dist.get_backend()
        reads it) and its Python asks the group too, by name() and
        _get_backend_name(): SyncBatchNorm gathers with a list for a group
        named "gloo", ShardedTensor takes the CPU for one.  A group asked
        for as gloo (NOTE [ Which backend a group gets ] in distributed.py)
        answers "gloo" there, as gloo's group would, so that what a program
        sees of it never depends on who serves it; one asked for as
        "mpcore" answers "mpcore".  torch's C++ asks getBackendName(), and
        where that says "gloo" it takes the group's backend for a
        ProcessGroupGloo (DDP's logger reads its threads): so this one
        always answers "mpcore", and mpcore's DDP puts the asked name in
        its logging data (NOTE [ mpcore's hook is invisible ] in
        parallel.py)."""
        return "mpcore"

    def _get_backend_name(self):
        name = self._asked
        if name is None:
            rec = _c10d._world.pg_map.get(self)
            if rec is None:
                return "mpcore"   # not registered yet: asked again later
            asked = str(rec[0]).lower()
            name = self._asked = ("gloo" if asked == "gloo" or "cpu:gloo" in asked.split(",")
                                  else "mpcore")
        return name

    name = _get_backend_name

    def size(self):
        return self._world

    def rank(self):
        return self._rank

    @property
    def group_name(self):
        return self._name

    def _set_group_name(self, name):
        self._name = name

    @property
    def group_desc(self):
        return self._desc

    def _set_group_desc(self, desc):
        self._desc = desc

    def get_group_store(self):
        return self._store

    # -- the group as its own device backend (NOTE [ The group is its own backend ]) --
    @property
    def _device_types(self):
        cuda = torch.cuda.is_available()
        return [torch.device("cpu")] + ([torch.device("cuda")] if cuda else [])

    def _get_backend(self, device):
        device = torch.device(device)
        if all(d.type != device.type for d in self._device_types):
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return self

    supports_splitting = False
    supports_coalescing = False
    supports_shrinking = False
    supports_time_estimate = False

    def supports_tensor_alloc(self, device):
        return False

    def set_timeout(self, timeout):
        """The group's default timeout from now on, as torch's groups take it."""
        self._timeout_s = timeout.total_seconds()
        if self.shm is not None:
            self.shm.set_timeout(self._timeout_s)
        for inner in (self._gloo, self._torch_nccl):
            if inner is not None:
                inner.set_timeout(timeout)

    def __repr__(self):
        where = ("shared memory" if self.shm is not None else
                 "gloo" if self._gloo is not None else "destroyed")
        return f"ProcessGroupMpcore(rank={self._rank}, world={self._world}, {where})"

    def shutdown(self):
        """Frees the group's region (and its NCCL communicator) at once."""
        shm, self.shm = self.shm, None
        if shm is not None:
            shm.close()
        t, self._torch_nccl = self._torch_nccl, None
        if t is not None:
            t.shutdown()
        n, self._nccl = self._nccl, None
        if n is not None:
            n.close()
        g, self._gloo = self._gloo, None
        if g is not None and hasattr(g, "shutdown"):
            g.shutdown()

    def abort(self):
        self.shutdown()

    # -- plumbing ---------------------------------------------------------------
    def _run(self, async_op, result, fn, *args, keep=(), after=None):
        """fn(*args, timeout) on the region, now or on the group's thread;
        then after() (copies out); returns the call's Work."""
        shm = self.shm
        if shm is None:
            raise RuntimeError("mpcore: this process group has been destroyed")
        if not async_op:
            shm.run(False, result, fn, *args)
            if after is not None:
                after()
            return _Done(result)
        if after is not None:
            inner = fn

            def fn(*a):
                inner(*a)
                after()
        return shm.run(True, result, fn, *args, keep=keep)

    def _core(self):
        """The group's _core.Group; a clear error once the group is destroyed."""
        shm = self.shm
        if shm is None:
            raise RuntimeError("mpcore: this process group has been destroyed")
        return shm.core

    def _cuda(self, what):
        """This group's NCCL communicator (made on first use: every rank
        reaches its first CUDA collective at the same call)."""
        if self._nccl is None:
            from . import _nccl
            self._nccl = _nccl.NcclGroup.create(self._store, self._rank, self._world,
                                                "mpcore-nccl/")
        return self._nccl

    def _torch_nccl_pg(self):
        """torch's ProcessGroupNCCL for this group (NOTE [ CUDA tensors in an
        mpcore group ])."""
        if self._torch_nccl is None:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=self._timeout_s)
            self._torch_nccl = dist.ProcessGroupNCCL(dist.PrefixStore("torch-nccl/", self._store),
                                                     self._rank, self._world, opts)
        return self._torch_nccl

    def _cuda_call(self, what, tensors):
        if all(t.device.type == "cuda" for t in tensors):
            for t in tensors:
                if t.dtype not in _NCCL_DTYPES or not t.is_contiguous():
                    raise ValueError(f"mpcore: {what} on CUDA takes contiguous tensors of "
                                     f"{sorted(str(d) for d in _NCCL_DTYPES)}, not {t.dtype}")
            return self._cuda(what)
        if any(t.device.type == "cuda" for t in tensors):
            raise ValueError(f"mpcore: {what} got tensors on several devices "
                             f"({sorted({str(t.device) for t in tensors})})")
        return None

    def _no_cuda(self, what, tensors):
        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError(f"mpcore: {what} serves CPU tensors; on CUDA mpcore serves "
                             "all_reduce, broadcast and all_gather (through NCCL), not this")

    def _timeout(self, opts):
        t = opts.timeout
        return self._timeout_s if t.total_seconds() < 0 else t.total_seconds()

    # -- all-reduce ---------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if opts is None:
            opts = dist.AllreduceOptions()
        red = opts.reduceOp.op
        shm = self.shm
        if len(tensors) == 1 and shm is not None:
            t = tensors[0]
            row = _CORE_ROWS.get(t.dtype)
            codes = row[red.value] if row is not None else None
            if codes is not None and t.is_cpu and t.is_contiguous():
                buf = _buffer_of(t) if t.nbytes >= BUFFER_MIN else None
                if opts.asyncOp:
                    if buf is None:
                        return shm.run(True, tensors, shm.core.all_reduce, t.data_ptr(),
                                       t.numel(), codes[0], codes[1], keep=(t,))
                    return shm.run(True, tensors, _in_buffer, shm.core.all_reduce, buf,
                                   t.data_ptr(), t.numel(), codes[0], codes[1], keep=(t,))
                if shm._queued:
                    shm.drain()
                shm.core.all_reduce(t.data_ptr(), t.numel(), codes[0], codes[1], shm.timeout,
                                    buf)
                return _Done(tensors)
        return self._allreduce(tensors, red, opts.asyncOp)

    def _allreduce(self, tensors, red, async_op):
        if self._gloo is not None:
            o = dist.AllreduceOptions()
            o.reduceOp = ReduceOp(red)
            o.asyncOp = async_op
            return self._gloo.allreduce(tensors, o)
        n = self._cuda_call("all_reduce", tensors)
        if n is not None:
            if red not in OPS or OPS[red] > 4:
                raise ValueError(f"mpcore: all_reduce on CUDA takes SUM, AVG, PRODUCT, MIN "
                                 f"or MAX, not {_op_name(red)}")
            for t in tensors:
                n.all_reduce(t, _NCCL_DTYPES[t.dtype], OPS[red])
            return _done(tensors)
        if any(t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, red, async_op)
        _check_cpu("all_reduce", tensors)
        failed = _checked("all_reduce", red, tensors, async_op)
        if failed is not None:
            return failed
        dense = [_Dense(t) for t in tensors]
        calls = []
        for d in dense:
            t = d.t
            dt, code = DTYPES.get(t.dtype), OPS.get(red)
            if (dt is not None and code is not None
                    and (red != _RED.AVG or t.dtype in _FLOATS)
                    and (red not in _BITWISE or not t.is_floating_point())):
                calls.append(functools.partial(self._core().all_reduce, t.data_ptr(),
                                               t.numel(), dt, code))
            else:
                calls.append(functools.partial(self._gathered_reduce, t, red))

        def run(timeout):
            for c in calls:
                c(timeout)
            for d in dense:
                d.back()
        return self._run(async_op, tensors, run, keep=dense)

    def _sparse_allreduce(self, tensors, red, async_op):
        """NOTE [ Sparse all-reduce ]
        gloo sums sparse COO tensors (SUM only) by gathering every rank's
        indices and values and adding the ranks' tensors in rank order, then
        coalescing; so does this, with the same torch operations in the same
        order, so that the result (its values' bits, its indices' order, its
        coalesced flag) is gloo's.  Three all-gathers: each rank's sizes and
        nnz (gloo's metadata: at most 4 sparse and 4 dense dimensions), then
        the indices and the values, each padded to the largest nnz (where
        gloo gathers exactly each rank's, allgatherv)."""
        what = "all_reduce of sparse tensors"
        for t in tensors:
            if t.layout != torch.sparse_coo or t.device.type != "cpu":
                raise ValueError(f"mpcore: {what}: every tensor must be a sparse COO tensor on "
                                 f"the CPU, not {t.layout} on {t.device}")
            if t.dtype != tensors[0].dtype or t.shape != tensors[0].shape:
                raise ValueError(f"mpcore: {what}: every tensor must have the first's dtype and "
                                 f"shape ({tensors[0].dtype}, {tuple(tensors[0].shape)}), not "
                                 f"({t.dtype}, {tuple(t.shape)})")
            if t.sparse_dim() > 4 or t.dense_dim() > 4:
                raise ValueError(f"mpcore: {what}: at most 4 sparse and 4 dense dimensions (as "
                                 f"gloo), not {t.sparse_dim()} and {t.dense_dim()}")
        if red != _RED.SUM:
            raise ValueError(f"mpcore: unsupported reduction operation {_op_name(red)} (allreduce "
                             f"of sparse tensors only works with ReduceOp.SUM)")
        core, w, me = self._core(), self._world, self._rank

        def gather(t, timeout):
            """(world, *t.shape) of every rank's t (contiguous, same shape)."""
            out = torch.empty((w,) + tuple(t.shape), dtype=t.dtype)
            core.all_gather(out.data_ptr(), t.data_ptr(), _nbytes(t), timeout)
            return out

        def sizes(m):
            # gloo's: the sparse, then the dense sizes, each up to the first not above 0
            out = []
            for lo in (0, 4):
                for v in m[lo:lo + 4]:
                    if v <= 0:
                        break
                    out.append(v)
            return out

        def run(timeout):
            with torch.no_grad():
                inp = tensors[0]
                for t in tensors[1:]:
                    inp = inp + t
                inp = inp.coalesce()
                sd, shape = inp.sparse_dim(), list(inp.shape)
                meta = torch.zeros(9, dtype=torch.int64)
                meta[:sd] = torch.tensor(shape[:sd], dtype=torch.int64)
                meta[4:4 + len(shape) - sd] = torch.tensor(shape[sd:], dtype=torch.int64)
                idx, val = inp.indices(), inp.values()
                meta[8] = idx.shape[1]   # nnz
                metas = gather(meta, timeout).tolist()
                if any(sizes(m) != sizes(metas[me]) for m in metas):
                    raise RuntimeError("Sparse dimensions do not match")
                nnz = [m[8] for m in metas]
                most = max(nnz)
                pidx = torch.zeros((sd, most), dtype=idx.dtype)
                pidx[:, :idx.shape[1]] = idx
                pval = torch.zeros((most,) + tuple(val.shape[1:]), dtype=val.dtype)
                pval[:val.shape[0]] = val
                idxs, vals = gather(pidx, timeout), gather(pval, timeout)
                out = None
                for q in range(w):
                    one = torch.sparse_coo_tensor(idxs[q][:, :nnz[q]], vals[q][:nnz[q]],
                                                  inp.shape, check_invariants=False)
                    if out is None:
                        out = one
                    else:
                        out += one
                out = out.coalesce()
                for t in tensors:
                    t.copy_(out)
        return self._run(async_op, tensors, run, keep=tuple(tensors))

    def _gathered_reduce(self, t, red, timeout):
        """t becomes the reduction over the ranks, for a dtype or op the
        core does not reduce (NOTE [ What the core cannot serve ])."""
        stack = torch.empty((self._world,) + tuple(t.shape), dtype=t.dtype)
        self._core().all_gather(stack.data_ptr(), t.data_ptr(), _nbytes(t), timeout)
        t.copy_(_reduce_stack(stack, red, self._world))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._allreduce(list(tensors), opts.reduceOp.op, opts.asyncOp)

    # -- reduce -----------------------------------------------------------------------
    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        shm = self.shm
        if len(tensors) == 1 and shm is not None:   # as allreduce's
            t, root = tensors[0], opts.rootRank
            row = _CORE_ROWS.get(t.dtype)
            codes = row[opts.reduceOp.op.value] if row is not None else None
            if codes is not None and t.is_cpu and t.is_contiguous() and 0 <= root < self._world:
                buf = _buffer_of(t) if t.nbytes >= BUFFER_MIN else None
                if opts.asyncOp:
                    return shm.run(True, tensors, _in_buffer, shm.core.reduce, buf, t.data_ptr(),
                                   t.numel(), codes[0], codes[1], root, keep=(t,))
                if shm._queued:
                    shm.drain()
                shm.core.reduce(t.data_ptr(), t.numel(), codes[0], codes[1], root, shm.timeout,
                                buf)
                return _Done(tensors)
        if self._gloo is not None:
            return self._gloo.reduce(tensors, opts)
        self._no_cuda("reduce", tensors)
        _check_cpu("reduce", tensors)
        red, root = opts.reduceOp.op, opts.rootRank
        _check_op("reduce", red, tensors)
        self._check_root("reduce", root)
        dense = [_Dense(t) for t in tensors]
        core = self._core()
        calls = []
        for d in dense:
            t = d.t
            dt, code = DTYPES.get(t.dtype), OPS.get(red)
            if (dt is not None and code is not None
                    and (red != _RED.AVG or t.dtype in _FLOATS)
                    and (red not in _BITWISE or not t.is_floating_point())):
                calls.append(functools.partial(core.reduce, t.data_ptr(), t.numel(), dt, code,
                                               root))
            else:
                calls.append(functools.partial(self._gathered_root_reduce, t, red, root))

        def run(timeout):
            for c in calls:
                c(timeout)
            if self._rank == root:
                for d in dense:
                    d.back()
        return self._run(opts.asyncOp, tensors, run, keep=dense)

    def _gathered_root_reduce(self, t, red, root, timeout):
        tmp = t.clone()
        self._gathered_reduce(tmp, red, timeout)
        if self._rank == root:
            t.copy_(tmp)

    def _check_root(self, what, root):
        if not 0 <= root < self._world:
            raise ValueError(f"mpcore: {what}: root rank {root} is not a rank of this group "
                             f"of {self._world}")

    # -- broadcast -----------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        shm = self.shm
        if len(tensors) == 1 and shm is not None:   # one contiguous CPU tensor: the core's call
            t, root = tensors[0], opts.rootRank
            if t.is_cpu and t.is_contiguous() and 0 <= root < self._world:
                return self._run(opts.asyncOp, tensors, shm.core.broadcast, t.data_ptr(),
                                 _nbytes(t), root, keep=(t,))
        if self._gloo is not None:
            return self._gloo.broadcast(tensors, opts)
        root = opts.rootRank
        self._check_root("broadcast", root)
        n = self._cuda_call("broadcast", tensors)
        if n is not None:
            for t in tensors:
                n.broadcast(t, root)
            return _done(tensors)
        _check_cpu("broadcast", tensors)
        dense = [_Dense(t) for t in tensors]
        core = self._core()

        def run(timeout):
            for d in dense:
                core.broadcast(d.t.data_ptr(), _nbytes(d.t), root, timeout)
                d.back()
        return self._run(opts.asyncOp, tensors, run, keep=dense)

    # -- all-gather -------------------------------------------------------------------------
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        if self._gloo is not None:
            return self._gloo.allgather(output_lists, inputs, opts)
        if len(inputs) != 1 or len(output_lists) != 1:
            raise ValueError("mpcore: all_gather takes one input tensor and one list of outputs")
        inp, outs = inputs[0], output_lists[0]
        if len(outs) != self._world:
            raise ValueError(f"mpcore: all_gather needs {self._world} output tensors (one per "
                             f"rank), not {len(outs)}")
        _same_shapes("all_gather", outs, inp)
        n = self._cuda_call("all_gather", [inp] + list(outs))
        if n is not None:
            flat = torch.empty((self._world,) + tuple(inp.shape), dtype=inp.dtype,
                               device=inp.device)
            n.all_gather(flat, inp)
            for i, t in enumerate(outs):
                t.copy_(flat[i])
            return _done(output_lists)
        _check_cpu("all_gather", [inp] + list(outs))
        src = _Dense(inp).t
        flat = torch.empty((self._world,) + tuple(inp.shape), dtype=inp.dtype)
        core = self._core()

        def run(timeout):
            core.all_gather(flat.data_ptr(), src.data_ptr(), _nbytes(src), timeout)
            for i, t in enumerate(outs):
                t.copy_(flat[i])
        # the Work's result is the outputs' list, as gloo's
        return self._run(opts.asyncOp, outs, run, keep=(src, flat))

    def _allgather_base(self, output, input, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        shm = self.shm
        if (shm is not None and output.dtype == input.dtype and output.is_cpu and input.is_cpu
                and output.numel() == input.numel() * self._world
                and output.is_contiguous() and input.is_contiguous()):   # the core's call
            buf = _buffer_of(input) if input.nbytes >= BUFFER_MIN else None
            return self._run(opts.asyncOp, [output], _in_buffer, shm.core.all_gather, buf,
                             output.data_ptr(), input.data_ptr(), _nbytes(input),
                             keep=(input, output))
        if self._gloo is not None:
            return self._gloo._allgather_base(output, input, opts)
        if output.dtype != input.dtype or output.numel() != input.numel() * self._world:
            raise ValueError(f"mpcore: all_gather_into_tensor: the output must hold {self._world} "
                             f"times the input ({input.numel()} x {input.dtype}), not "
                             f"{output.numel()} x {output.dtype}")
        n = self._cuda_call("all_gather_into_tensor", [output, input])
        if n is not None:
            n.all_gather(output, input)
            return _done([output])
        _check_cpu("all_gather_into_tensor", [output, input])
        src, dst = _Dense(input), _Dense(output, read=False)
        core = self._core()
        return self._run(opts.asyncOp, [output], core.all_gather, dst.t.data_ptr(),
                         src.t.data_ptr(), _nbytes(src.t), keep=(src, dst), after=dst.back)

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """torch's all_gather_coalesced: output_lists[r][i] gets rank r's
        inputs[i] (indexed by rank, then input, as gloo's).  One all-gather
        of the inputs' bytes end to end, each piece padded to _ALIGN bytes
        so that every output reads its own dtype where it lies."""
        opts = opts if opts is not None else _AllgatherOptions()
        if self._gloo is not None:
            return self._gloo.allgather_coalesced(output_lists, inputs, opts)
        w, inputs = self._world, list(inputs)
        what = "all_gather_coalesced"
        if not inputs:
            raise ValueError(f"mpcore: {what} requires a non-empty input tensor list")
        if len(output_lists) != w:
            raise ValueError(f"mpcore: {what} needs {w} output lists (one per rank, each with "
                             f"a tensor per input), not {len(output_lists)}")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(inputs):
                raise ValueError(f"mpcore: {what}: output list {r} has {len(outs)} tensors, "
                                 f"not one per input ({len(inputs)})")
            for i, (o, t) in enumerate(zip(outs, inputs)):
                if o.dtype != t.dtype or o.shape != t.shape:
                    raise ValueError(f"mpcore: {what}: output {i} of list {r} is ({o.dtype}, "
                                     f"{tuple(o.shape)}), not input {i}'s ({t.dtype}, "
                                     f"{tuple(t.shape)})")
        everything = inputs + [o for outs in output_lists for o in outs]
        self._no_cuda(what, everything)
        _check_cpu(what, everything)
        sizes = [_nbytes(t) for t in inputs]
        at = [0]
        for n in sizes:
            at.append(at[-1] + -(-n // _ALIGN) * _ALIGN)
        src = torch.zeros(at[-1], dtype=torch.uint8)
        for t, a, n in zip(inputs, at, sizes):
            src[a:a + n] = t.reshape(-1).view(torch.uint8)
        total = at[-1]
        flat = torch.empty(w * total, dtype=torch.uint8)
        core = self._core()

        def run(timeout):
            core.all_gather(flat.data_ptr(), src.data_ptr(), total, timeout)
            for r, outs in enumerate(output_lists):
                for o, a, n in zip(outs, at, sizes):
                    o.copy_(flat[r * total + a:r * total + a + n].view(o.dtype).view(o.shape))
        return self._run(opts.asyncOp, output_lists, run, keep=(src, flat))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        return self._chain([functools.partial(self._allgather_base, o, i)
                            for o, i in zip(outputs, inputs)], opts.asyncOp, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _chain(self, calls, async_op, result):
        """Several calls as one: each queued in order (asynchronously when
        async_op); the last one's completion is the whole's."""
        o = dist.AllreduceOptions()
        o.asyncOp = async_op
        works = [c(o) for c in calls]
        if not works:
            return _done(result)
        if not async_op:
            for w in works:
                w.wait()
            return _done(result)
        if self.shm is None:
            return works[-1]
        # the group's thread runs them in order: a last, empty call finishes after all
        def check(timeout):
            for w in works:
                if w.exception() is not None:
                    raise w.exception()
        return self.shm.run(True, result, check)

    # -- reduce-scatter -----------------------------------------------------------------------
    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if self._gloo is not None:
            return self._gloo.reduce_scatter(outputs, input_lists, opts)
        if len(outputs) != 1 or len(input_lists) != 1:
            raise ValueError("mpcore: reduce_scatter takes one output and one list of inputs")
        out, ins = outputs[0], input_lists[0]
        if len(ins) != self._world:
            raise ValueError(f"mpcore: reduce_scatter needs {self._world} input tensors (one "
                             f"per rank), not {len(ins)}")
        _same_shapes("reduce_scatter", ins, out)
        self._no_cuda("reduce_scatter", [out] + list(ins))
        _check_cpu("reduce_scatter", [out] + list(ins))
        flat = torch.stack([t.contiguous() for t in ins]) if ins else None
        return self._reduce_scatter_flat(out, flat, opts.reduceOp.op, opts.asyncOp, outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        shm = self.shm
        if (shm is not None and output.dtype == input.dtype and output.is_cpu and input.is_cpu
                and input.numel() == output.numel() * self._world
                and output.is_contiguous() and input.is_contiguous()):
            row = _CORE_ROWS.get(output.dtype)
            codes = row[opts.reduceOp.op.value] if row is not None else None
            if codes is not None:   # the core's call
                buf = _buffer_of(input) if input.nbytes >= BUFFER_MIN else None
                return self._run(opts.asyncOp, [output], _in_buffer, shm.core.reduce_scatter,
                                 buf, output.data_ptr(), input.data_ptr(), output.numel(),
                                 codes[0], codes[1], keep=(input, output))
        if self._gloo is not None:
            return self._gloo._reduce_scatter_base(output, input, opts)
        if output.dtype != input.dtype or input.numel() != output.numel() * self._world:
            raise ValueError(f"mpcore: reduce_scatter_tensor: the input must hold {self._world} "
                             f"times the output ({output.numel()} x {output.dtype}), not "
                             f"{input.numel()} x {input.dtype}")
        self._no_cuda("reduce_scatter_tensor", [output, input])
        _check_cpu("reduce_scatter_tensor", [output, input])
        return self._reduce_scatter_flat(output, _Dense(input).t, opts.reduceOp.op,
                                         opts.asyncOp, [output])

    reduce_scatter_single = _reduce_scatter_base

    def _reduce_scatter_flat(self, output, flat, red, async_op, result):
        failed = _checked("reduce_scatter", red, [output], async_op)
        if failed is not None:
            return failed
        dst = _Dense(output, read=False)
        out = dst.t
        dt, code = DTYPES.get(out.dtype), OPS.get(red)
        core = self._core()
        if (dt is not None and code is not None
                and (red != _RED.AVG or out.dtype in _FLOATS)
                and (red not in _BITWISE or not out.is_floating_point())):
            return self._run(async_op, result, core.reduce_scatter, out.data_ptr(),
                             flat.data_ptr(), out.numel(), dt, code, keep=(flat, dst),
                             after=dst.back if dst.orig is not None else None)

        def run(timeout):
            whole = flat.clone()
            self._gathered_reduce(whole, red, timeout)
            out.copy_(whole.view(self._world, -1)[self._rank].view(out.shape))
            dst.back()
        return self._run(async_op, result, run, keep=(flat, dst))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        red = opts.reduceOp

        def one(o, i, op):
            r = dist.ReduceScatterOptions()
            r.reduceOp = red
            r.asyncOp = op.asyncOp
            return self._reduce_scatter_base(o, i, r)
        return self._chain([functools.partial(one, o, i) for o, i in zip(outputs, inputs)],
                           opts.asyncOp, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- gather, scatter ---------------------------------------------------------------------
    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        shm, root = self.shm, opts.rootRank
        if shm is not None and len(inputs) == 1 and 0 <= root < self._world:
            # contiguous CPU tensors of one shape: the core's call
            inp = inputs[0]
            outs = _plain_list(output_lists, inp, self._world if self._rank == root else 0)
            if outs is not None and inp.is_cpu and inp.is_contiguous():
                # the Work's result is the root's outputs' list, as gloo's
                return self._run(opts.asyncOp, outs or [], shm.core.gather,
                                 [o.data_ptr() for o in outs] if outs else 0, inp.data_ptr(),
                                 _nbytes(inp), root, keep=(inp, outs))
        if self._gloo is not None:
            return self._gloo.gather(output_lists, inputs, opts)
        self._check_root("gather", root)
        if len(inputs) != 1:
            raise ValueError("mpcore: gather takes one input tensor")
        inp = inputs[0]
        outs = output_lists[0] if output_lists else []
        if self._rank == root:
            if len(output_lists) != 1 or len(outs) != self._world:
                raise ValueError(f"mpcore: gather needs {self._world} output tensors on the "
                                 f"root, not {len(outs)}")
            _same_shapes("gather", outs, inp)
        elif output_lists and output_lists[0]:
            raise ValueError("mpcore: gather takes output tensors on the root rank only")
        self._no_cuda("gather", [inp] + list(outs))
        _check_cpu("gather", [inp] + list(outs))
        src = _Dense(inp).t
        core = self._core()
        dsts = [_Dense(t, read=False) for t in outs]   # the root's, straight into each
        addrs = [d.t.data_ptr() for d in dsts] if dsts else 0

        def run(timeout):
            core.gather(addrs, src.data_ptr(), _nbytes(src), root, timeout)
            for d in dsts:
                d.back()
        return self._run(opts.asyncOp, list(outs), run, keep=(src, dsts))

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        shm, root = self.shm, opts.rootRank
        if shm is not None and len(outputs) == 1 and 0 <= root < self._world:   # as gather's
            out = outputs[0]
            ins = _plain_list(input_lists, out, self._world if self._rank == root else 0)
            if ins is not None and out.is_cpu and out.is_contiguous():
                return self._run(opts.asyncOp, outputs, shm.core.scatter, out.data_ptr(),
                                 [t.data_ptr() for t in ins] if ins else 0, _nbytes(out), root,
                                 keep=(out, ins))
        if self._gloo is not None:
            return self._gloo.scatter(outputs, input_lists, opts)
        self._check_root("scatter", root)
        if len(outputs) != 1:
            raise ValueError("mpcore: scatter takes one output tensor")
        out = outputs[0]
        ins = input_lists[0] if input_lists else []
        mine = self._rank == root
        if mine:
            if len(input_lists) != 1 or len(ins) != self._world:
                raise ValueError(f"mpcore: scatter needs {self._world} input tensors on the "
                                 f"root, not {len(ins)}")
            _same_shapes("scatter", ins, out)
        elif input_lists and input_lists[0]:
            raise ValueError("mpcore: scatter takes input tensors on the root rank only")
        self._no_cuda("scatter", [out] + list(ins))
        _check_cpu("scatter", [out] + list(ins))
        dst = _Dense(out, read=False)
        core = self._core()
        n = _nbytes(dst.t)
        srcs = [t.contiguous() for t in ins]    # the root's, straight from each
        addrs = [t.data_ptr() for t in srcs] if srcs else 0

        def run(timeout):
            core.scatter(dst.t.data_ptr(), addrs, n, root, timeout)
            dst.back()
        return self._run(opts.asyncOp, outputs, run, keep=(srcs, dst))

    # -- all-to-all ------------------------------------------------------------------------
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        shm = self.shm
        if (shm is not None and output.dtype == input.dtype and output.is_cpu and input.is_cpu
                and output.is_contiguous() and input.is_contiguous()):   # the core's call
            return self._run(opts.asyncOp, [output],
                             *self._core_all_to_all(output, input, output_split_sizes,
                                                    input_split_sizes), keep=(input, output))
        if self._gloo is not None:
            return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                            opts)
        self._no_cuda("all_to_all_single", [output, input])
        _check_cpu("all_to_all_single", [output, input])
        if output.dtype != input.dtype:
            raise ValueError(f"mpcore: all_to_all_single: output is {output.dtype} but input is "
                             f"{input.dtype}")
        send = self._splits("input", input, input_split_sizes)
        recv = self._splits("output", output, output_split_sizes)
        src, dst = _Dense(input), _Dense(output, read=False)
        return self._all_to_all(dst, src.t, send, recv, opts.asyncOp, [output], keep=(src,))

    all_to_all_single = alltoall_base

    def _core_all_to_all(self, output, input, output_split_sizes, input_split_sizes):
        """(fn, *args) of the core's all_to_all of two contiguous CPU tensors
        of one dtype, the input in its group buffer if it has one (NOTE
        [ Memory reduced again and again ]).  An input that overlaps the
        output is copied first: peers may still read a piece of it after
        this rank has written its own (gloo's result is then garbage)."""
        send = self._splits("input", input, input_split_sizes)
        recv = self._splits("output", output, output_split_sizes)
        o, i, n = output.data_ptr(), input.data_ptr(), sum(send)
        if i < o + sum(recv) and o < i + n:
            input, buf = input.clone(), None   # passed on below, which keeps it alive
        elif n < BUFFER_MIN:
            return self.shm.core.all_to_all, o, i, send, recv
        else:
            buf = _buffer_of(input)
        return _all_to_all_in, self.shm.core, output, input, send, recv, buf

    def _splits(self, what, t, sizes):
        """Byte counts for each rank of a dim-0 split of t (even when sizes
        is empty)."""
        w = self._world
        rows = t.shape[0] if t.dim() else 1
        row = _nbytes(t) // rows if rows else 0
        if not sizes:
            if rows % w:
                raise ValueError(f"mpcore: all_to_all_single: the {what}'s first dimension "
                                 f"({rows}) does not split evenly over {w} ranks")
            return [rows // w * row] * w
        if len(sizes) != w or sum(sizes) != rows or any(s < 0 for s in sizes):
            raise ValueError(f"mpcore: all_to_all_single: {what} split sizes {list(sizes)} do "
                             f"not split {rows} rows over {w} ranks")
        return [s * row for s in sizes]

    def _all_to_all(self, dst, src, send, recv, async_op, result, keep=()):
        core = self._core()

        def run(timeout):
            core.all_to_all(dst.t.data_ptr(), src.data_ptr(), send, recv, timeout)
            dst.back()
        return self._run(async_op, result, run, keep=keep + (dst, src))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        if self._gloo is not None:
            return self._gloo.alltoall(output_tensors, input_tensors, opts)
        w = self._world
        if len(output_tensors) != w or len(input_tensors) != w:
            raise ValueError(f"mpcore: all_to_all needs {w} input and {w} output tensors, not "
                             f"{len(input_tensors)} and {len(output_tensors)}")
        everything = list(output_tensors) + list(input_tensors)
        self._no_cuda("all_to_all", everything)
        _check_cpu("all_to_all", everything)
        dtype = input_tensors[0].dtype
        for t in everything:
            if t.dtype != dtype:
                raise ValueError(f"mpcore: all_to_all: every tensor must be {dtype}, not {t.dtype}")
        src = torch.cat([t.reshape(-1) for t in input_tensors]) if input_tensors else None
        dst = _Dense(torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype), read=False)
        send = [_nbytes(t) for t in input_tensors]
        recv = [_nbytes(t) for t in output_tensors]

        class _Out:
            t = dst.t

            @staticmethod
            def back():
                at = 0
                for o in output_tensors:
                    o.copy_(dst.t[at:at + o.numel()].view(o.shape))
                    at += o.numel()
        return self._all_to_all(_Out, src, send, recv, opts.asyncOp, output_tensors)

    # -- barrier -----------------------------------------------------------------------------
    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        if self._gloo is not None:
            return self._gloo.barrier(opts)
        shm = self.shm
        if shm is None:
            raise RuntimeError("mpcore: this process group has been destroyed")
        timeout = self._timeout(opts)
        if not opts.asyncOp:
            shm.drain()
            shm.core.barrier(timeout)
            return _done([])
        return shm.run(True, [], lambda _t: shm.core.barrier(timeout))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """NOTE [ monitored_barrier's protocol ]
        gloo's: every other rank tells rank 0 that it came, and waits (up to
        the group's timeout) for rank 0's answer; rank 0 waits for each rank
        in turn, rank 1 first, within `timeout` in all (or `timeout` for
        each with wait_all_ranks), and then answers all.  A rank that does
        not come in time makes rank 0 raise "[Rank 0]: Rank N failed to pass
        monitoredBarrier in T ms" (with wait_all_ranks, "Ranks N, M failed
        ..." once every rank had its time), and every rank that came raise
        "Rank K successfully reached monitoredBarrier, but received errors
        while waiting for send/recv from rank 0", with rank 0's message as
        the original exception: gloo's texts, which torch's tests match.
        gloo moves the messages by send and recv; here they are keys in the
        group's store, whose waits time out without breaking anything,
        where a point-to-point wait that times out breaks the group (NOTE
        [ Mailboxes ] in coll.c), and rank 0 could not go on waiting for the
        next rank.  Each call has keys of its own (the group counts its
        calls, as gloo's tags do); rank 0 deletes each arrival as it sees it,
        and, once every rank came, the previous call's answer, which each of
        them has read.  Unlike gloo's, the group stays usable after a
        failure, and a rank that comes late is told of it at once."""
        import logging
        timeout_s = self._timeout_s if timeout is None else _dist._seconds(timeout)
        ms = int(round(timeout_s * 1000))
        store, me, w = self._store, self._rank, self._world
        self._monitored += 1
        key = f"mpcore/monitored/{self._monitored}/"
        answer = f"{key}answer"
        if me != 0:
            store.set(f"{key}came/{me}", "1")
            try:
                store.wait([answer], datetime.timedelta(seconds=self._timeout_s))
                said = store.get(answer).decode()
            except Exception as e:
                said = f"{type(e).__name__}: {e}"
            else:
                if said == "ok":
                    return
            raise RuntimeError(
                f"Rank {me} successfully reached monitoredBarrier, but received errors while "
                f"waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.\n"
                f" Original exception: \n{said}")
        log = logging.getLogger(__name__)

        def fail(msg, detail=""):
            store.set(answer, msg)
            log.error(msg)
            raise RuntimeError(msg + detail)

        start = time.monotonic()
        passed, failed = [], []
        for q in range(1, w):
            left = timeout_s
            if not wait_all_ranks:
                left = timeout_s - (time.monotonic() - start)
                if left <= 0:
                    fail(f"Rank {me} timed out in monitoredBarrier after {ms} ms.\n"
                         + (f"Successfully processed ranks: {', '.join(map(str, passed))}"
                            if passed else "No ranks successfully processed in monitoredBarrier."))
            came = f"{key}came/{q}"
            try:
                # a wait of 0 ms would be no wait at all: at least 1 ms
                store.wait([came], datetime.timedelta(seconds=max(left, 0.001)))
            except Exception as e:
                msg = f"[Rank 0]: Rank {q} failed to pass monitoredBarrier in {ms} ms"
                if not wait_all_ranks:
                    fail(msg, f"\n Original exception: \n{e}")
                log.error(msg)
                failed.append(q)
                continue
            store.delete_key(came)
            passed.append(q)
        if failed:
            fail(f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier "
                 f"in {ms} ms")
        store.set(answer, "ok")
        if self._monitored > 1:   # every rank came here, so every rank read the last answer
            store.delete_key(f"mpcore/monitored/{self._monitored - 1}/answer")

    # -- coalescing (torch's _coalescing_manager, batch_isend_irecv) ---------------------------
    def _start_coalescing(self, device):
        """Calls made inside run as they come, in order (nothing to batch);
        the point-to-point ones are remembered for _end_coalescing."""
        self._batch = []

    def _end_coalescing(self, device):
        """A Work that completes once every call made so far has."""
        batch, self._batch = self._batch or [], None
        if self._gloo is not None:
            return _Done([])
        self._core()
        return _AllOf(batch + [self.shm.run(True, [], lambda timeout: None)])

    # -- point to point --------------------------------------------------------------------------
    def send(self, tensors, dst, tag):
        """NOTE [ A send that fits the mailbox ]
        A message that fits in the peer's mailbox right now needs neither
        the peer nor a wait: when nothing else to that peer is queued or
        running (so that messages stay in order), it is put there on the
        calling thread, and the call returns a completed Work.  Otherwise it
        goes to its lane (NOTE [ Lanes ] in _dist.py)."""
        if self._gloo is not None:
            return self._gloo.send(tensors, dst, tag)
        shm = self.shm
        t = tensors[0] if len(tensors) == 1 else None
        if not (t is not None and t.is_cpu and t.is_contiguous() and shm is not None
                and 0 <= dst < self._world and dst != self._rank):
            self._no_cuda("send", tensors)
            _check_cpu("send", tensors)
            self._check_peer("send to", dst)
        src = [_Dense(t).t for t in tensors]
        core = self._core()
        lane = self._send_lanes[dst]
        if len(src) == 1 and self._send_now(src[0], dst, tag):
            return self._p2p(_Done(tensors))

        def run(timeout):
            for t in src:
                core.send(t.data_ptr(), _nbytes(t), dst, tag, timeout)
        # NOTE [ Lanes ] in _dist.py
        return self._p2p(self.shm.run(True, tensors, run, keep=src, lane=lane))

    def _send_now(self, t, dst, tag):
        """Whether contiguous CPU tensor t went to rank dst's mailbox on
        this thread (NOTE [ A send that fits the mailbox ])."""
        shm = self.shm
        return bool(shm._lane(self._send_lanes[dst]).run_if_idle(
            shm.core.try_send, t.data_ptr(), t.nbytes, dst, tag))

    def recv(self, tensors, src, tag):
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._recv(tensors, -1, tag)

    def _recv(self, tensors, src, tag):
        if self._gloo is not None:
            if src < 0:
                return self._gloo.recv_anysource(tensors, tag)
            return self._gloo.recv(tensors, src, tag)
        shm = self.shm
        t = tensors[0] if len(tensors) == 1 else None
        work = Work(tensors)
        if (t is not None and t.is_cpu and t.is_contiguous() and shm is not None
                and -1 <= src < self._world and src != self._rank):   # the core's call
            return self._p2p(shm.run(True, tensors, _recv_into, work, shm.core, t.data_ptr(),
                                     _nbytes(t), src, tag, keep=t, work=work,
                                     lane="mpcore-recv"))
        self._no_cuda("recv", tensors)
        _check_cpu("recv", tensors)
        if src >= 0:
            self._check_peer("receive from", src)
        dense = [_Dense(t, read=False) for t in tensors]
        core = self._core()

        def run(timeout):
            for d in dense:
                _recv_into(work, core, d.t.data_ptr(), _nbytes(d.t), src, tag, timeout)
                d.back()
        return self._p2p(shm.run(True, tensors, run, keep=dense, work=work, lane="mpcore-recv"))

    def _p2p(self, work):
        if self._batch is not None:
            self._batch.append(work)
        return work

    def _check_peer(self, what, peer):
        if not 0 <= peer < self._world or peer == self._rank:
            raise ValueError(f"mpcore: cannot {what} rank {peer}: not another rank of this "
                             f"group of {self._world}")


def _recv_into(work, core, addr, nbytes, src, tag, timeout):
    work._source = core.recv(addr, nbytes, src, tag, timeout)


def _on_cuda(args):
    """Whether the first tensor among a call's arguments (a tensor, a list
    of them, or a list of lists) is on a CUDA device."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.is_cuda
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b.is_cuda
                if isinstance(b, (list, tuple)) and b and isinstance(b[0], torch.Tensor):
                    return b[0].is_cuda
    return False


def _cuda_to_torch_nccl(name, method):
    """NOTE [ CUDA tensors in an mpcore group ]
    torch takes the ProcessGroupMpcore as the whole group, so CUDA tensors
    of a "cpu:mpcore,cuda:nccl" group reach it too.  Where torch has NCCL,
    every call on CUDA tensors goes to torch's own ProcessGroupNCCL for the
    group (made at the first such call, which every rank reaches alike;
    it connects lazily itself), so that CUDA gets every operation, torch's
    streams and its Work; elsewhere mpcore's own NCCL communicator serves
    all-reduce, broadcast and all-gather."""
    @functools.wraps(method)
    def call(self, *args):
        if _HAVE_TORCH_NCCL and _on_cuda(args):
            return getattr(self._torch_nccl_pg(), name)(*args)
        if _profiling():   # NOTE [ Collectives in the profiler ]
            return _profiled(self, name, method, args, {})
        return method(self, *args)
    return call


_HAVE_TORCH_NCCL = dist.is_nccl_available()
for _name in ("allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather",
              "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
              "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
              "gather", "scatter", "alltoall_base", "alltoall", "send", "recv",
              "recv_anysource"):
    setattr(ProcessGroupMpcore, _name,
            _cuda_to_torch_nccl(_name, getattr(ProcessGroupMpcore, _name)))
del _name


# --- profiler events (NOTE [ Collectives in the profiler ]) ---------------------------

# NOTE [ Collectives in the profiler ]
# gloo's Work records an event in torch's profiler for every call, named
# "gloo:" and the operation, with the call's input tensors (their shapes
# under record_shapes), begun when the call is made and ended by gloo's
# thread when the call completes, so that torch marks it asynchronous.
# torch's own tests look them up by dist.get_backend() + ":" + the name
# (test_distributed_spawn's call_dist_op and p2p tests: count, shapes,
# is_async), and trace tools read them.  A Work made in Python records
# nothing, so the group records them itself while torch's profiler runs
# on the calling thread, one check per call otherwise: what gloo records,
# read from gloo's own runs (_EVENTS; tests/test_dispatch_parity.py
# compares the two), named by the backend torch reports for the group
# ("gloo" for a program that asked for gloo, "mpcore" for one that named
# mpcore).  An event is begun by record_function's entry with the inputs;
# its end is tied to a future (record_function's way for asynchronous
# calls, which carries the profiler's thread state), and _ender's thread
# completes that future: an event ended on another thread is asynchronous
# to torch, as gloo's are.  The end comes before the call is seen done:
# a call done on return is ended before it returns, and a Work made during
# the call ends its events when it completes, before its waiters wake, so
# that a profile closed right after wait() holds the whole event.  Calls a
# recorded call makes of the group's own methods (the parts of a coalesced
# call) record nothing of their own, as gloo's one event per call.  A
# group without a region (NOTE [ What the core cannot serve ]) is gloo's
# own underneath, and gloo records those.
# What is not there: the dispatcher's c10d::allreduce_ and the like,
# which torch's C++ ProcessGroup emits on its way to a gloo Backend, and
# which dispatch modes (CommDebugMode) count.  dist.* calls reach a group
# kept in Python by its methods directly, and c10d's ops cannot take one:
# they refuse a Python ProcessGroup and a ReduceOp made in Python, and
# their CPU kernels ask the group for a C++ Backend, which cannot be made
# from Python.  So a dispatch mode sees the functional collectives
# (_c10d_functional's ops, which reach the group through the dispatcher:
# NOTE [ Fast paths nobody sees ] in _fastpath.py) but not dist.* calls,
# as for any group torch keeps in Python.  Nor the flight recorder: gloo
# records its calls there from C++ (TORCH_FR_BUFFER_SIZE), and torch has
# no way to record an entry from Python (torchcomms' FlightRecorderHook
# is a package of its own), so _dump_fr_trace lists none of mpcore's.
# record_param_comms, which torch's NCCL emits, gloo does not on the CPU.

def _ins(i):
    return lambda args: [("", args[i])]


def _one(i):
    return lambda args: [("", [args[i]])]


# method -> the events gloo records for a call: f(args) -> [(name, input tensors)],
# the name "" being the method's own (_TITLES)
_EVENTS = {
    "allreduce": _ins(0), "allreduce_coalesced": _ins(0), "reduce": _ins(0),
    "broadcast": _ins(0), "allgather": _ins(1), "_allgather_base": _one(1),
    "allgather_coalesced": _ins(1), "allgather_into_tensor_coalesced": _ins(1),
    # one all-reduce per rank's input (gloo reduces each and keeps its own)
    "reduce_scatter": lambda args: [("all_reduce", [t]) for t in args[1][0]],
    "_reduce_scatter_base": _one(1), "reduce_scatter_tensor_coalesced": _ins(1),
    "gather": _ins(1), "scatter": lambda args: [("", args[1][0] if args[1] else [])],
    "alltoall_base": _one(1), "alltoall": _ins(1), "barrier": lambda args: [("", [])],
    "send": _ins(0), "recv": _ins(0), "recv_anysource": _ins(0),
}
_TITLES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "reduce": "reduce",
    "broadcast": "broadcast", "allgather": "all_gather", "_allgather_base": "all_gather",
    "allgather_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "all_reduce", "_reduce_scatter_base": "all_reduce",
    "reduce_scatter_tensor_coalesced": "all_reduce", "gather": "gather", "scatter": "scatter",
    "alltoall_base": "all_to_all", "alltoall": "all_to_all", "barrier": "barrier",
    "send": "send", "recv": "recv", "recv_anysource": "recvAnySource",
}

_profiling = _torchapi.get("torch._C._autograd._profiler_enabled")
_inside = threading.local()   # .on: a recorded call runs on this thread; .events: its _Events
_recording = 0                # recorded calls running, in every thread
_recording_lock = threading.Lock()
_record = None                # (record_function's entry, the end tied to a future), once read


class _Events:
    """The profiler's events of one call, begun now; end() ends them, once."""
    __slots__ = ("future", "ended", "claim")

    def __init__(self, names):
        enter, end_on = _record
        self.future = torch.futures.Future()
        self.ended = [end_on(enter(name, *tensors), self.future) for name, tensors in names]
        self.claim = [True]

    def end(self):
        try:
            self.claim.pop()     # atomic: the first caller ends them
        except IndexError:
            return
        _ender.put(self.future)
        for f in self.ended:     # done once the events' ends have run
            f.wait()


class _Ender:
    """The thread that completes events' futures, so that their ends run
    on a thread other than the caller's (NOTE [ Collectives in the profiler ])."""

    def __init__(self):
        self._queue = None
        self._lock = threading.Lock()

    def put(self, future):
        q = self._queue
        if q is None:
            with self._lock:
                if self._queue is None:
                    q = queue.SimpleQueue()
                    threading.Thread(target=self._loop, args=(q,), name="mpcore-profiler",
                                     daemon=True).start()
                    self._queue = q
                q = self._queue
        q.put(future)

    @staticmethod
    def _loop(q):
        while True:
            q.get().set_result(None)

    def _after_fork(self):
        self._queue, self._lock = None, threading.Lock()


_ender = _Ender()
os.register_at_fork(after_in_child=_ender._after_fork)


def _backend_name(pg):
    """The name torch reports for pg's backend (dist.get_backend), its CPU
    one for a device map."""
    entry = _c10d._world.pg_map.get(pg)
    name = str(entry[0]) if entry else "mpcore"
    for pair in name.split(","):
        if pair.startswith("cpu:"):
            return pair[4:]
    return name


def _profiled(self, name, method, args, kwargs):
    """method(self, *args, **kwargs), recorded in torch's profiler as gloo
    records the call (NOTE [ Collectives in the profiler ])."""
    global _record, _recording
    if getattr(_inside, "on", False):   # a part of a recorded call
        events, _inside.events = _inside.events, None
        try:
            return method(self, *args, **kwargs)
        finally:
            _inside.events = events
    if self.shm is None or not _torchapi.serves("profiler events"):
        return method(self, *args, **kwargs)
    if _record is None:
        _record = (_torchapi.get("torch._C._autograd._record_function_with_args_enter"),
                   _torchapi.get("torch.ops.profiler._call_end_callbacks_on_jit_fut")
                   ._RecordFunction)
    prefix = _backend_name(self) + ":"
    try:
        names = [(prefix + (title or _TITLES[name]), list(tensors))
                 for title, tensors in _EVENTS[name](args)]
    except (IndexError, TypeError):   # arguments of another shape: the event, without inputs
        names = [(prefix + _TITLES[name], [])]
    events = _Events(names)
    with _recording_lock:
        _recording += 1
    _inside.on, _inside.events = True, events
    try:
        work = method(self, *args, **kwargs)
    except BaseException:
        events.end()
        raise
    finally:
        _inside.on, _inside.events = False, None
        with _recording_lock:
            _recording -= 1
    if not (isinstance(work, Work) and work._events is events):
        events.end()     # done on return, or a Work that does not end them
    return work


def _recorded(name, method):
    """method, its calls recorded as `name`'s (NOTE [ Collectives in the
    profiler ]): for the methods torch reaches by other names, and barrier."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if _profiling():
            return _profiled(self, name, method, args, kwargs)
        return method(self, *args, **kwargs)
    return call


for _alias, _name in (("barrier", "barrier"), ("all_gather_single", "_allgather_base"),
                      ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
                      ("reduce_scatter_single", "_reduce_scatter_base"),
                      ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
                      ("all_to_all_single", "alltoall_base")):
    setattr(ProcessGroupMpcore, _alias, _recorded(_name, getattr(ProcessGroupMpcore, _alias)))
del _alias, _name


_NCCL_DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
                torch.int32: 4, torch.int64: 5, torch.uint8: 6}


def create(store, rank, world, timeout):
    """The backend's creator: a group's ProcessGroupMpcore, with its own
    shared-memory region named in the group's store."""
    timeout_s = _dist._seconds(timeout)
    shm = _dist.join(store, "mpcore/", rank, world, timeout_s)
    gloo = None
    if shm is None:  # NOTE [ What the core cannot serve ], NOTE [ Hierarchical groups ]
        from . import _hier
        gloo = _hier.create(store, rank, world, timeout)
    return ProcessGroupMpcore(store, rank, world, timeout_s, shm, gloo)


def _create_extended(opts, backend_options):
    """torch's extended creator call: create(), then the group's messages
    name its ranks by their global ranks (the default group's are its own)."""
    pg = create(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    ranks = list(opts.global_ranks_in_group)
    if len(ranks) == opts.group_size:
        pg._group_ranks = {r: i for i, r in enumerate(ranks)}
        if pg.shm is not None:
            pg.shm.core.set_labels(ranks)
    return pg


# NOTE [ The backend runs uncompiled ]
# torch calls a backend's methods from C++: c10d's dispatcher, DDP's
# reducer.  Such a call may come while torch.compile's frame hook is on in
# the calling thread: in the eager part of a compiled function after a
# graph break, dynamo compiles every Python frame that starts as a new
# function (a compiled DDP module's forward rebuilds its buckets, and the
# reducer then broadcasts).  gloo's methods are C++ and never seen; ours
# would be traced, and dynamo gives up with a hard error on the group,
# which it takes for an opaque object.  So the entry points torch's C++
# calls are marked, together with everything they call, to run as plain
# Python (dynamo's per-code frame strategy, as torch._dynamo.disable's
# effect without its wrapper on every call).  The marks are set once
# torch._dynamo is imported, never earlier: importing it costs seconds.

def run_uncompiled(*objs):
    """Marks objs (functions, or classes: the functions in their own
    namespace) to run uncompiled (NOTE [ The backend runs uncompiled ]),
    now if torch._dynamo is imported, else when it is."""
    from . import _boot
    _boot.when_imported("torch._dynamo.eval_frame", lambda ef: _mark_uncompiled(ef, objs))


def _mark_uncompiled(eval_frame, objs):
    from . import _torchapi
    set_strategy = _torchapi.find("torch._dynamo.eval_frame.set_code_exec_strategy")
    if set_strategy is not None:
        plain = _torchapi.get("torch._dynamo.types.FrameExecStrategy")(
            *(_torchapi.get("torch._dynamo.types.FrameAction").SKIP,) * 2)
        mark = lambda code: set_strategy(code, plain)  # noqa: E731
    else:
        mark = _torchapi.find("torch._dynamo.eval_frame.skip_code")   # torch before 2.7's way
        if mark is None:
            return
    for obj in objs:
        for f in vars(obj).values() if isinstance(obj, type) else (obj,):
            if isinstance(f, (staticmethod, classmethod)):
                f = f.__func__
            fs = (f.fget, f.fset) if isinstance(f, property) else (f,)
            for g in fs:
                code = getattr(g, "__code__", None)
                if code is not None:
                    mark(code)


def _set_pg_timeout(timeout, group=None):
    """torch's _set_pg_timeout, which reaches our group too (NOTE [ The
    group is its own backend ])."""
    pg = group
    if pg is None and _c10d.is_initialized():
        pg = _c10d._get_default_group()
    if isinstance(pg, ProcessGroupMpcore):
        pg.set_timeout(timeout)
        return None
    return _torch_set_pg_timeout(timeout, group)


_torch_set_pg_timeout = None


def _split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None,
                 group_desc=None, backend=None):
    """torch's split_group, for mpcore's groups too.

    NOTE [ Splitting a group ]
    torch's split_group refuses every group unless the default group is
    bound to an accelerator whose backend splits communicators (NCCL's
    ncclCommSplit), so on the CPU it fails for gloo and for any backend
    before it asks the group.  A split of an mpcore group needs no
    communicator to split: each split is a new group of its ranks, made
    only by its members (torch's new_group with use_local_synchronization:
    its registration, barrier and backend config), with the parent's
    backend.  As in torch, every rank of the parent calls it with the same
    splits, the ranks in a split are the parent's group ranks, and a rank
    in no split gets None.  Splits that share a rank are refused on every
    rank (torch leaves them to hang).  Any other parent goes to torch's
    function.
    The one part of torch's new_group replaced here is the group's name,
    which is the prefix of the group's keys in the store.  torch hashes the ranks
    with the number of groups this rank knows, and ranks that were left
    out of some earlier group know fewer: the members of one split would
    then wait for each other under different names until the timeout.
    Here the name hashes the parent's name, how many splits of the parent
    came before (every member of the parent counts each call) and the
    split's ranks, which every member of the split knows alike."""
    parent = parent_pg
    if parent is None and _c10d.is_initialized():
        parent = _c10d._get_default_group()
    if not isinstance(parent, ProcessGroupMpcore):
        return _torch_split_group(parent_pg, split_ranks, timeout, pg_options, group_desc,
                                  backend)
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    to_group = _c10d._world.pg_group_ranks.get(parent)
    if to_group is None:
        raise ValueError(f"Group {parent} is not registered")
    me = to_group.get(_c10d.get_rank())
    if me is None:
        raise ValueError(f"Global rank {_c10d.get_rank()} is not part of the parent group {parent}")
    to_global = {g: r for r, g in to_group.items()}
    parent._split_count += 1
    mine, seen = None, set()
    for split in split_ranks:
        split = list(split)
        if not split:
            raise ValueError("the split group cannot be empty")
        if len(split) != len(set(split)):
            raise ValueError(f"the split group cannot have duplicate ranks: {split}")
        outside = [r for r in split if r not in to_global]
        if outside:
            raise ValueError(f"split {split}: ranks {outside} are not group ranks of the parent "
                             f"group, which has {len(to_global)}")
        if seen.intersection(split):
            raise ValueError(f"split {split}: ranks {sorted(seen.intersection(split))} are in "
                             f"another split too")
        seen.update(split)
        if me in split:
            mine = sorted(split)
    if mine is None:
        return None
    ranks = [to_global[r] for r in mine]
    key = f"{parent.group_name}/split{parent._split_count}/{ranks}"
    name = hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()
    hashed = _c10d._process_group_name
    _c10d._process_group_name = lambda ranks, use_hashed_name: name
    try:
        return _c10d.new_group(ranks, timeout=timeout,
                               backend=backend or _c10d._world.pg_map[parent][0],
                               pg_options=pg_options, use_local_synchronization=True,
                               group_desc=group_desc)
    finally:
        _c10d._process_group_name = hashed


_torch_split_group = None


# NOTE [ asyncOp before torch 2.7 ]
# The group's methods read opts.asyncOp to run a call at once or on the
# group's thread.  torch 2.6's AllreduceOptions, ReduceOptions,
# GatherOptions, AllToAllOptions, BarrierOptions and AllreduceCoalescedOptions
# have no asyncOp: there torch waits on the Work of every call that is not
# async_op, so every call may be asynchronous to the group.  Where an
# options class lacks it, asyncOp is added (through the table) as True,
# which setting leaves so: such calls run as a later torch runs an async_op
# one, and give the same results.
_OPTIONS = ("AllreduceOptions", "AllreduceCoalescedOptions", "ReduceOptions",
            "BroadcastOptions", "AllgatherOptions", "GatherOptions", "ScatterOptions",
            "ReduceScatterOptions", "AllToAllOptions", "BarrierOptions")
_ASYNC_OP = property(lambda self: True, lambda self, value: None,
                     doc="added by mpcore: this torch's options have no asyncOp")


def register():
    """Registers the backend with torch.distributed (once)."""
    global _torch_set_pg_timeout, _torch_split_group
    for name in _OPTIONS:   # NOTE [ asyncOp before torch 2.7 ]
        _torchapi.replace(f"torch._C._distributed_c10d.{name}.asyncOp", _ASYNC_OP)
    if "MPCORE" not in _torchapi.get("torch.distributed.Backend._plugins"):
        dist.Backend.register_backend("mpcore", _create_extended, extended_api=True,
                                      devices=["cpu"])
        run_uncompiled(ProcessGroupMpcore, Work, _dist.Work, _Done, _AllOf, _create_extended)
    if _torch_set_pg_timeout is None and hasattr(_c10d, "_set_pg_timeout"):
        _torch_set_pg_timeout = _c10d._set_pg_timeout
        _c10d._set_pg_timeout = functools.wraps(_torch_set_pg_timeout)(_set_pg_timeout)
    if _torch_split_group is None and hasattr(_c10d, "split_group"):
        _torch_split_group = _c10d.split_group
        split = functools.wraps(_torch_split_group)(_split_group)
        _c10d.split_group = dist.split_group = split   # NOTE [ Splitting a group ]
        mesh = sys.modules.get("torch.distributed.device_mesh")
        if getattr(mesh, "split_group", None) is _torch_split_group:
            mesh.split_group = split
    from . import _fastpath
    _fastpath.install()   # NOTE [ A fast path for torch's module functions ]
