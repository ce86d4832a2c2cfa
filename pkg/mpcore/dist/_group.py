"""The process group mpcore serves: ProcessGroupMpcore, one rank's handle
on a group, which torch takes as the group and as its backend.

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
event (Done) for a synchronous call.  The dispatcher is the way in, except
for six of torch's module functions and three functional collectives
whose own cost measurement put above the core's (NOTE [ A fast path for
torch's module functions ] and NOTE [ A fast path for the functional
collectives ] in _fastpath.py).
"""
import datetime
import functools
import time

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed import distributed_c10d as _c10d

from .. import _torchapi
from . import _dist
from ._args import ALIGN, Dense, check_cpu, nbytes, plain_list, same_shapes
from ._buffers import BUFFER_MIN, all_to_all_in, buffer_of, in_buffer
from ._profile import profiled, profiling, recorded_as
from ._reduce import BITWISE, CORE_ROWS, DTYPES, FLOATS, OPS, RED, check_op, op_name, reduce_stack
from ._work import AllOf, Done, Work, checked, done

_AllgatherOptions = _torchapi.get("torch._C._distributed_c10d.AllgatherOptions")  # not re-exported

NCCL_DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
                torch.int32: 4, torch.int64: 5, torch.uint8: 6}


_HAVE_TORCH_NCCL = dist.is_nccl_available()


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


def cuda_routed(method):
    """A decorator of the group's methods that take tensors.

    NOTE [ CUDA tensors in an mpcore group ]
    torch takes the ProcessGroupMpcore as the whole group, so CUDA tensors
    of a "cpu:mpcore,cuda:nccl" group reach it too.  Where torch has NCCL,
    every call on CUDA tensors goes to torch's own ProcessGroupNCCL for the
    group (made at the first such call, which every rank reaches alike;
    it connects lazily itself), so that CUDA gets every operation, torch's
    streams and its Work; elsewhere mpcore's own NCCL communicator serves
    all-reduce, broadcast and all-gather.  Otherwise the call is recorded
    in torch's profiler while it runs (NOTE [ Collectives in the profiler ]
    in _profile.py), and runs."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args):
        if _HAVE_TORCH_NCCL and _on_cuda(args):
            return getattr(self._torch_nccl_pg(), name)(*args)
        if profiling():
            return profiled(self, name, method, args, {})
        return method(self, *args)
    return call


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
            return Done(result)
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
                if t.dtype not in NCCL_DTYPES or not t.is_contiguous():
                    raise ValueError(f"mpcore: {what} on CUDA takes contiguous tensors of "
                                     f"{sorted(str(d) for d in NCCL_DTYPES)}, not {t.dtype}")
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
    @cuda_routed
    def allreduce(self, tensors, opts=None):
        if opts is None:
            opts = dist.AllreduceOptions()
        red = opts.reduceOp.op
        shm = self.shm
        if len(tensors) == 1 and shm is not None:
            t = tensors[0]
            row = CORE_ROWS.get(t.dtype)
            codes = row[red.value] if row is not None else None
            if codes is not None and t.is_cpu and t.is_contiguous():
                buf = buffer_of(t) if t.nbytes >= BUFFER_MIN else None
                if opts.asyncOp:
                    if buf is None:
                        return shm.run(True, tensors, shm.core.all_reduce, t.data_ptr(),
                                       t.numel(), codes[0], codes[1], keep=(t,))
                    return shm.run(True, tensors, in_buffer, shm.core.all_reduce, buf,
                                   t.data_ptr(), t.numel(), codes[0], codes[1], keep=(t,))
                if shm._queued:
                    shm.drain()
                shm.core.all_reduce(t.data_ptr(), t.numel(), codes[0], codes[1], shm.timeout,
                                    buf)
                return Done(tensors)
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
                                 f"or MAX, not {op_name(red)}")
            for t in tensors:
                n.all_reduce(t, NCCL_DTYPES[t.dtype], OPS[red])
            return done(tensors)
        if any(t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, red, async_op)
        check_cpu("all_reduce", tensors)
        failed = checked("all_reduce", red, tensors, async_op)
        if failed is not None:
            return failed
        dense = [Dense(t) for t in tensors]
        calls = []
        for d in dense:
            t = d.t
            dt, code = DTYPES.get(t.dtype), OPS.get(red)
            if (dt is not None and code is not None
                    and (red != RED.AVG or t.dtype in FLOATS)
                    and (red not in BITWISE or not t.is_floating_point())):
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
        if red != RED.SUM:
            raise ValueError(f"mpcore: unsupported reduction operation {op_name(red)} (allreduce "
                             f"of sparse tensors only works with ReduceOp.SUM)")
        core, w, me = self._core(), self._world, self._rank

        def gather(t, timeout):
            """(world, *t.shape) of every rank's t (contiguous, same shape)."""
            out = torch.empty((w,) + tuple(t.shape), dtype=t.dtype)
            core.all_gather(out.data_ptr(), t.data_ptr(), nbytes(t), timeout)
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
        self._core().all_gather(stack.data_ptr(), t.data_ptr(), nbytes(t), timeout)
        t.copy_(reduce_stack(stack, red, self._world))

    @cuda_routed
    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._allreduce(list(tensors), opts.reduceOp.op, opts.asyncOp)

    # -- reduce -----------------------------------------------------------------------
    @cuda_routed
    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        shm = self.shm
        if len(tensors) == 1 and shm is not None:   # as allreduce's
            t, root = tensors[0], opts.rootRank
            row = CORE_ROWS.get(t.dtype)
            codes = row[opts.reduceOp.op.value] if row is not None else None
            if codes is not None and t.is_cpu and t.is_contiguous() and 0 <= root < self._world:
                buf = buffer_of(t) if t.nbytes >= BUFFER_MIN else None
                if opts.asyncOp:
                    return shm.run(True, tensors, in_buffer, shm.core.reduce, buf, t.data_ptr(),
                                   t.numel(), codes[0], codes[1], root, keep=(t,))
                if shm._queued:
                    shm.drain()
                shm.core.reduce(t.data_ptr(), t.numel(), codes[0], codes[1], root, shm.timeout,
                                buf)
                return Done(tensors)
        if self._gloo is not None:
            return self._gloo.reduce(tensors, opts)
        self._no_cuda("reduce", tensors)
        check_cpu("reduce", tensors)
        red, root = opts.reduceOp.op, opts.rootRank
        check_op("reduce", red, tensors)
        self._check_root("reduce", root)
        dense = [Dense(t) for t in tensors]
        core = self._core()
        calls = []
        for d in dense:
            t = d.t
            dt, code = DTYPES.get(t.dtype), OPS.get(red)
            if (dt is not None and code is not None
                    and (red != RED.AVG or t.dtype in FLOATS)
                    and (red not in BITWISE or not t.is_floating_point())):
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
    @cuda_routed
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        shm = self.shm
        if len(tensors) == 1 and shm is not None:   # one contiguous CPU tensor: the core's call
            t, root = tensors[0], opts.rootRank
            if t.is_cpu and t.is_contiguous() and 0 <= root < self._world:
                return self._run(opts.asyncOp, tensors, shm.core.broadcast, t.data_ptr(),
                                 nbytes(t), root, keep=(t,))
        if self._gloo is not None:
            return self._gloo.broadcast(tensors, opts)
        root = opts.rootRank
        self._check_root("broadcast", root)
        n = self._cuda_call("broadcast", tensors)
        if n is not None:
            for t in tensors:
                n.broadcast(t, root)
            return done(tensors)
        check_cpu("broadcast", tensors)
        dense = [Dense(t) for t in tensors]
        core = self._core()

        def run(timeout):
            for d in dense:
                core.broadcast(d.t.data_ptr(), nbytes(d.t), root, timeout)
                d.back()
        return self._run(opts.asyncOp, tensors, run, keep=dense)

    # -- all-gather -------------------------------------------------------------------------
    @cuda_routed
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
        same_shapes("all_gather", outs, inp)
        n = self._cuda_call("all_gather", [inp] + list(outs))
        if n is not None:
            flat = torch.empty((self._world,) + tuple(inp.shape), dtype=inp.dtype,
                               device=inp.device)
            n.all_gather(flat, inp)
            for i, t in enumerate(outs):
                t.copy_(flat[i])
            return done(output_lists)
        check_cpu("all_gather", [inp] + list(outs))
        src = Dense(inp).t
        flat = torch.empty((self._world,) + tuple(inp.shape), dtype=inp.dtype)
        core = self._core()

        def run(timeout):
            core.all_gather(flat.data_ptr(), src.data_ptr(), nbytes(src), timeout)
            for i, t in enumerate(outs):
                t.copy_(flat[i])
        # the Work's result is the outputs' list, as gloo's
        return self._run(opts.asyncOp, outs, run, keep=(src, flat))

    @cuda_routed
    def _allgather_base(self, output, input, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        shm = self.shm
        if (shm is not None and output.dtype == input.dtype and output.is_cpu and input.is_cpu
                and output.numel() == input.numel() * self._world
                and output.is_contiguous() and input.is_contiguous()):   # the core's call
            buf = buffer_of(input) if input.nbytes >= BUFFER_MIN else None
            return self._run(opts.asyncOp, [output], in_buffer, shm.core.all_gather, buf,
                             output.data_ptr(), input.data_ptr(), nbytes(input),
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
            return done([output])
        check_cpu("all_gather_into_tensor", [output, input])
        src, dst = Dense(input), Dense(output, read=False)
        core = self._core()
        return self._run(opts.asyncOp, [output], core.all_gather, dst.t.data_ptr(),
                         src.t.data_ptr(), nbytes(src.t), keep=(src, dst), after=dst.back)

    # torch reaches it by this name too: recorded as _allgather_base, served on the CPU
    all_gather_single = recorded_as("_allgather_base")(_allgather_base.__wrapped__)

    @cuda_routed
    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """torch's all_gather_coalesced: output_lists[r][i] gets rank r's
        inputs[i] (indexed by rank, then input, as gloo's).  One all-gather
        of the inputs' bytes end to end, each piece padded to ALIGN bytes
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
        check_cpu(what, everything)
        sizes = [nbytes(t) for t in inputs]
        at = [0]
        for n in sizes:
            at.append(at[-1] + -(-n // ALIGN) * ALIGN)
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

    @cuda_routed
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()
        return self._chain([functools.partial(self._allgather_base, o, i)
                            for o, i in zip(outputs, inputs)], opts.asyncOp, outputs)

    # torch reaches it by this name too: recorded as allgather_into_tensor_coalesced, served on the CPU
    all_gather_single_coalesced = recorded_as("allgather_into_tensor_coalesced")(allgather_into_tensor_coalesced.__wrapped__)

    def _chain(self, calls, async_op, result):
        """Several calls as one: each queued in order (asynchronously when
        async_op); the last one's completion is the whole's."""
        o = dist.AllreduceOptions()
        o.asyncOp = async_op
        works = [c(o) for c in calls]
        if not works:
            return done(result)
        if not async_op:
            for w in works:
                w.wait()
            return done(result)
        if self.shm is None:
            return works[-1]
        # the group's thread runs them in order: a last, empty call finishes after all
        def check(timeout):
            for w in works:
                if w.exception() is not None:
                    raise w.exception()
        return self.shm.run(True, result, check)

    # -- reduce-scatter -----------------------------------------------------------------------
    @cuda_routed
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
        same_shapes("reduce_scatter", ins, out)
        self._no_cuda("reduce_scatter", [out] + list(ins))
        check_cpu("reduce_scatter", [out] + list(ins))
        flat = torch.stack([t.contiguous() for t in ins]) if ins else None
        return self._reduce_scatter_flat(out, flat, opts.reduceOp.op, opts.asyncOp, outputs)

    @cuda_routed
    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        shm = self.shm
        if (shm is not None and output.dtype == input.dtype and output.is_cpu and input.is_cpu
                and input.numel() == output.numel() * self._world
                and output.is_contiguous() and input.is_contiguous()):
            row = CORE_ROWS.get(output.dtype)
            codes = row[opts.reduceOp.op.value] if row is not None else None
            if codes is not None:   # the core's call
                buf = buffer_of(input) if input.nbytes >= BUFFER_MIN else None
                return self._run(opts.asyncOp, [output], in_buffer, shm.core.reduce_scatter,
                                 buf, output.data_ptr(), input.data_ptr(), output.numel(),
                                 codes[0], codes[1], keep=(input, output))
        if self._gloo is not None:
            return self._gloo._reduce_scatter_base(output, input, opts)
        if output.dtype != input.dtype or input.numel() != output.numel() * self._world:
            raise ValueError(f"mpcore: reduce_scatter_tensor: the input must hold {self._world} "
                             f"times the output ({output.numel()} x {output.dtype}), not "
                             f"{input.numel()} x {input.dtype}")
        self._no_cuda("reduce_scatter_tensor", [output, input])
        check_cpu("reduce_scatter_tensor", [output, input])
        return self._reduce_scatter_flat(output, Dense(input).t, opts.reduceOp.op,
                                         opts.asyncOp, [output])

    # torch reaches it by this name too: recorded as _reduce_scatter_base, served on the CPU
    reduce_scatter_single = recorded_as("_reduce_scatter_base")(_reduce_scatter_base.__wrapped__)

    def _reduce_scatter_flat(self, output, flat, red, async_op, result):
        failed = checked("reduce_scatter", red, [output], async_op)
        if failed is not None:
            return failed
        dst = Dense(output, read=False)
        out = dst.t
        dt, code = DTYPES.get(out.dtype), OPS.get(red)
        core = self._core()
        if (dt is not None and code is not None
                and (red != RED.AVG or out.dtype in FLOATS)
                and (red not in BITWISE or not out.is_floating_point())):
            return self._run(async_op, result, core.reduce_scatter, out.data_ptr(),
                             flat.data_ptr(), out.numel(), dt, code, keep=(flat, dst),
                             after=dst.back if dst.orig is not None else None)

        def run(timeout):
            whole = flat.clone()
            self._gathered_reduce(whole, red, timeout)
            out.copy_(whole.view(self._world, -1)[self._rank].view(out.shape))
            dst.back()
        return self._run(async_op, result, run, keep=(flat, dst))

    @cuda_routed
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

    # torch reaches it by this name too: recorded as reduce_scatter_tensor_coalesced, served on the CPU
    reduce_scatter_single_coalesced = recorded_as("reduce_scatter_tensor_coalesced")(reduce_scatter_tensor_coalesced.__wrapped__)

    # -- gather, scatter ---------------------------------------------------------------------
    @cuda_routed
    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        shm, root = self.shm, opts.rootRank
        if shm is not None and len(inputs) == 1 and 0 <= root < self._world:
            # contiguous CPU tensors of one shape: the core's call
            inp = inputs[0]
            outs = plain_list(output_lists, inp, self._world if self._rank == root else 0)
            if outs is not None and inp.is_cpu and inp.is_contiguous():
                # the Work's result is the root's outputs' list, as gloo's
                return self._run(opts.asyncOp, outs or [], shm.core.gather,
                                 [o.data_ptr() for o in outs] if outs else 0, inp.data_ptr(),
                                 nbytes(inp), root, keep=(inp, outs))
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
            same_shapes("gather", outs, inp)
        elif output_lists and output_lists[0]:
            raise ValueError("mpcore: gather takes output tensors on the root rank only")
        self._no_cuda("gather", [inp] + list(outs))
        check_cpu("gather", [inp] + list(outs))
        src = Dense(inp).t
        core = self._core()
        dsts = [Dense(t, read=False) for t in outs]   # the root's, straight into each
        addrs = [d.t.data_ptr() for d in dsts] if dsts else 0

        def run(timeout):
            core.gather(addrs, src.data_ptr(), nbytes(src), root, timeout)
            for d in dsts:
                d.back()
        return self._run(opts.asyncOp, list(outs), run, keep=(src, dsts))

    @cuda_routed
    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        shm, root = self.shm, opts.rootRank
        if shm is not None and len(outputs) == 1 and 0 <= root < self._world:   # as gather's
            out = outputs[0]
            ins = plain_list(input_lists, out, self._world if self._rank == root else 0)
            if ins is not None and out.is_cpu and out.is_contiguous():
                return self._run(opts.asyncOp, outputs, shm.core.scatter, out.data_ptr(),
                                 [t.data_ptr() for t in ins] if ins else 0, nbytes(out), root,
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
            same_shapes("scatter", ins, out)
        elif input_lists and input_lists[0]:
            raise ValueError("mpcore: scatter takes input tensors on the root rank only")
        self._no_cuda("scatter", [out] + list(ins))
        check_cpu("scatter", [out] + list(ins))
        dst = Dense(out, read=False)
        core = self._core()
        n = nbytes(dst.t)
        srcs = [t.contiguous() for t in ins]    # the root's, straight from each
        addrs = [t.data_ptr() for t in srcs] if srcs else 0

        def run(timeout):
            core.scatter(dst.t.data_ptr(), addrs, n, root, timeout)
            dst.back()
        return self._run(opts.asyncOp, outputs, run, keep=(srcs, dst))

    # -- all-to-all ------------------------------------------------------------------------
    @cuda_routed
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
        check_cpu("all_to_all_single", [output, input])
        if output.dtype != input.dtype:
            raise ValueError(f"mpcore: all_to_all_single: output is {output.dtype} but input is "
                             f"{input.dtype}")
        send = self._splits("input", input, input_split_sizes)
        recv = self._splits("output", output, output_split_sizes)
        src, dst = Dense(input), Dense(output, read=False)
        return self._all_to_all(dst, src.t, send, recv, opts.asyncOp, [output], keep=(src,))

    # torch reaches it by this name too: recorded as alltoall_base, served on the CPU
    all_to_all_single = recorded_as("alltoall_base")(alltoall_base.__wrapped__)

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
            buf = buffer_of(input)
        return all_to_all_in, self.shm.core, output, input, send, recv, buf

    def _splits(self, what, t, sizes):
        """Byte counts for each rank of a dim-0 split of t (even when sizes
        is empty)."""
        w = self._world
        rows = t.shape[0] if t.dim() else 1
        row = nbytes(t) // rows if rows else 0
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

    @cuda_routed
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
        check_cpu("all_to_all", everything)
        dtype = input_tensors[0].dtype
        for t in everything:
            if t.dtype != dtype:
                raise ValueError(f"mpcore: all_to_all: every tensor must be {dtype}, not {t.dtype}")
        src = torch.cat([t.reshape(-1) for t in input_tensors]) if input_tensors else None
        dst = Dense(torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype), read=False)
        send = [nbytes(t) for t in input_tensors]
        recv = [nbytes(t) for t in output_tensors]

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
    @recorded_as("barrier")
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
            return done([])
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
        timeout_s = self._timeout_s if timeout is None else _dist.seconds(timeout)
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
            return Done([])
        self._core()
        return AllOf(batch + [self.shm.run(True, [], lambda timeout: None)])

    # -- point to point --------------------------------------------------------------------------
    @cuda_routed
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
            check_cpu("send", tensors)
            self._check_peer("send to", dst)
        src = [Dense(t).t for t in tensors]
        core = self._core()
        lane = self._send_lanes[dst]
        if len(src) == 1 and self._send_now(src[0], dst, tag):
            return self._p2p(Done(tensors))

        def run(timeout):
            for t in src:
                core.send(t.data_ptr(), nbytes(t), dst, tag, timeout)
        # NOTE [ Lanes ] in _dist.py
        return self._p2p(self.shm.run(True, tensors, run, keep=src, lane=lane))

    def _send_now(self, t, dst, tag):
        """Whether contiguous CPU tensor t went to rank dst's mailbox on
        this thread (NOTE [ A send that fits the mailbox ])."""
        shm = self.shm
        return bool(shm._lane(self._send_lanes[dst]).run_if_idle(
            shm.core.try_send, t.data_ptr(), t.nbytes, dst, tag))

    @cuda_routed
    def recv(self, tensors, src, tag):
        return self._recv(tensors, src, tag)

    @cuda_routed
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
                                     nbytes(t), src, tag, keep=t, work=work,
                                     lane="mpcore-recv"))
        self._no_cuda("recv", tensors)
        check_cpu("recv", tensors)
        if src >= 0:
            self._check_peer("receive from", src)
        dense = [Dense(t, read=False) for t in tensors]
        core = self._core()

        def run(timeout):
            for d in dense:
                _recv_into(work, core, d.t.data_ptr(), nbytes(d.t), src, tag, timeout)
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
