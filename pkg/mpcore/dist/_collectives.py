"""The collectives of the process group (ProcessGroupMpcore in _group.py
takes them from Collectives): all-reduce, reduce, broadcast, the
all-gathers, the reduce-scatters, gather, scatter and all-to-all, each on
the group's region, on NCCL for CUDA tensors (NOTE [ CUDA tensors in an
mpcore group ]), or, where the core does not reduce, through torch (NOTE
[ What the core cannot serve ] in _reduce.py).  The group's life, its
plumbing (_run, _core, _cuda_call, _timeout), barriers and point-to-point
calls are _group.py's."""
import functools

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .. import _torchapi
from ._args import ALIGN, Dense, check_cpu, nbytes, plain_list, same_shapes
from ._buffers import BUFFER_MIN, buffer_of, with_buffer
from ._profile import modes, observed, profiling, recorded_as
from ._reduce import BITWISE, CORE_ROWS, DTYPES, FLOATS, OPS, RED, check_op, op_name, reduce_stack
from ._work import Done, checked, done

NCCL_DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
                torch.int32: 4, torch.int64: 5, torch.uint8: 6}
_AllgatherOptions = _torchapi.get("torch._C._distributed_c10d.AllgatherOptions")  # not re-exported
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
        if profiling() or modes():
            return observed(self, name, method, args)
        return method(self, *args)
    return call


class Collectives:
    """The collectives of ProcessGroupMpcore, each routed to torch's NCCL
    group for CUDA tensors where torch has NCCL (cuda_routed).

    NOTE [ What an older torch's gloo refuses or gets wrong ]
    gloo is the reference, but gloo itself changed across the torch window,
    and these collectives do the same on every torch of it:
      - where an older gloo refuses a call (torch 2.6: all_to_all of lists,
        reduce_scatter of lists, all_reduce with AVG; torch 2.8: all_to_all
        of lists), the group serves it.  That is strictly more useful, and it
        cannot break a program that runs on that torch's gloo: such a program
        never gets the call served, so at most it catches the refusal and
        computes the same values another way.  A group that hands its calls
        to gloo (self.gloo: NOTE [ What the core cannot serve ]) answers as
        that gloo does.
      - where an older gloo gives a wrong value (torch 2.6 and 2.8:
        reduce_scatter_tensor, coalesced or not, sums whatever reduction it
        is asked for, AVG undivided), the group gives the reduction asked
        for.
    What gloo refuses on every torch (NOTE [ Reductions gloo refuses ] in
    _reduce.py) mpcore refuses too; this note is about what only an older
    torch's gloo lacks.
    test_dispatch_parity.py and test_dispatch_reductions.py check both against
    values computed from the inputs, on the torches where gloo differs."""

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
                    return shm.run(True, tensors, with_buffer(shm.core.all_reduce, buf),
                                   t.data_ptr(), t.numel(), codes[0], codes[1], keep=(t,))
                if shm.collectives.queued:
                    shm.drain()
                shm.core.all_reduce(t.data_ptr(), t.numel(), codes[0], codes[1], shm.timeout,
                                    buf)
                return Done(tensors)
        return self._allreduce(tensors, red, opts.asyncOp)

    def _allreduce(self, tensors, red, async_op):
        if self.gloo is not None:
            o = dist.AllreduceOptions()
            o.reduceOp = ReduceOp(red)
            o.asyncOp = async_op
            return self.gloo.allreduce(tensors, o)
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
        core, w, me = self._core(), self.world, self.my_rank

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
        stack = torch.empty((self.world,) + tuple(t.shape), dtype=t.dtype)
        self._core().all_gather(stack.data_ptr(), t.data_ptr(), nbytes(t), timeout)
        t.copy_(reduce_stack(stack, red, self.world))

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
            if codes is not None and t.is_cpu and t.is_contiguous() and 0 <= root < self.world:
                buf = buffer_of(t) if t.nbytes >= BUFFER_MIN else None
                if opts.asyncOp:
                    return shm.run(True, tensors, with_buffer(shm.core.reduce, buf), t.data_ptr(),
                                   t.numel(), codes[0], codes[1], root, keep=(t,))
                if shm.collectives.queued:
                    shm.drain()
                shm.core.reduce(t.data_ptr(), t.numel(), codes[0], codes[1], root, shm.timeout,
                                buf)
                return Done(tensors)
        if self.gloo is not None:
            return self.gloo.reduce(tensors, opts)
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
            if self.my_rank == root:
                for d in dense:
                    d.back()
        return self._run(opts.asyncOp, tensors, run, keep=dense)

    def _gathered_root_reduce(self, t, red, root, timeout):
        tmp = t.clone()
        self._gathered_reduce(tmp, red, timeout)
        if self.my_rank == root:
            t.copy_(tmp)

    def _check_root(self, what, root):
        if not 0 <= root < self.world:
            raise ValueError(f"mpcore: {what}: root rank {root} is not a rank of this group "
                             f"of {self.world}")

    # -- broadcast -----------------------------------------------------------------------
    @cuda_routed
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        shm = self.shm
        if len(tensors) == 1 and shm is not None:   # one contiguous CPU tensor: the core's call
            t, root = tensors[0], opts.rootRank
            if t.is_cpu and t.is_contiguous() and 0 <= root < self.world:
                return self._run(opts.asyncOp, tensors, shm.core.broadcast, t.data_ptr(),
                                 nbytes(t), root, keep=(t,))
        if self.gloo is not None:
            return self.gloo.broadcast(tensors, opts)
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
        if self.gloo is not None:
            return self.gloo.allgather(output_lists, inputs, opts)
        if len(inputs) != 1 or len(output_lists) != 1:
            raise ValueError("mpcore: all_gather takes one input tensor and one list of outputs")
        inp, outs = inputs[0], output_lists[0]
        if len(outs) != self.world:
            raise ValueError(f"mpcore: all_gather needs {self.world} output tensors (one per "
                             f"rank), not {len(outs)}")
        same_shapes("all_gather", outs, inp)
        n = self._cuda_call("all_gather", [inp] + list(outs))
        if n is not None:
            flat = torch.empty((self.world,) + tuple(inp.shape), dtype=inp.dtype,
                               device=inp.device)
            n.all_gather(flat, inp)
            for i, t in enumerate(outs):
                t.copy_(flat[i])
            return done(output_lists)
        check_cpu("all_gather", [inp] + list(outs))
        src = Dense(inp).t
        flat = torch.empty((self.world,) + tuple(inp.shape), dtype=inp.dtype)
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
                and output.numel() == input.numel() * self.world
                and output.is_contiguous() and input.is_contiguous()):   # the core's call
            buf = buffer_of(input) if input.nbytes >= BUFFER_MIN else None
            return self._run(opts.asyncOp, [output], with_buffer(shm.core.all_gather, buf),
                             output.data_ptr(), input.data_ptr(), nbytes(input),
                             keep=(input, output))
        if self.gloo is not None:
            return self.gloo._allgather_base(output, input, opts)
        if output.dtype != input.dtype or output.numel() != input.numel() * self.world:
            raise ValueError(f"mpcore: all_gather_into_tensor: the output must hold {self.world} "
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

    # torch's other name for _allgather_base:
    # recorded as it, and not routed to torch's NCCL group
    all_gather_single = recorded_as("_allgather_base", "all_gather_single")(
        _allgather_base.__wrapped__)

    @cuda_routed
    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """torch's all_gather_coalesced: output_lists[r][i] gets rank r's
        inputs[i] (indexed by rank, then input, as gloo's).  One all-gather
        of the inputs' bytes end to end, each piece padded to ALIGN bytes
        so that every output reads its own dtype where it lies."""
        opts = opts if opts is not None else _AllgatherOptions()
        if self.gloo is not None:
            return self.gloo.allgather_coalesced(output_lists, inputs, opts)
        w, inputs = self.world, list(inputs)
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

    # torch's other name for allgather_into_tensor_coalesced:
    # recorded as it, and not routed to torch's NCCL group
    all_gather_single_coalesced = recorded_as("allgather_into_tensor_coalesced", "all_gather_single_coalesced")(
        allgather_into_tensor_coalesced.__wrapped__)

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
        if self.gloo is not None:
            return self.gloo.reduce_scatter(outputs, input_lists, opts)
        if len(outputs) != 1 or len(input_lists) != 1:
            raise ValueError("mpcore: reduce_scatter takes one output and one list of inputs")
        out, ins = outputs[0], input_lists[0]
        if len(ins) != self.world:
            raise ValueError(f"mpcore: reduce_scatter needs {self.world} input tensors (one "
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
                and input.numel() == output.numel() * self.world
                and output.is_contiguous() and input.is_contiguous()):
            row = CORE_ROWS.get(output.dtype)
            codes = row[opts.reduceOp.op.value] if row is not None else None
            if codes is not None:   # the core's call
                buf = buffer_of(input) if input.nbytes >= BUFFER_MIN else None
                return self._run(opts.asyncOp, [output], with_buffer(shm.core.reduce_scatter, buf),
                                 output.data_ptr(), input.data_ptr(), output.numel(),
                                 codes[0], codes[1], keep=(input, output))
        if self.gloo is not None:
            return self.gloo._reduce_scatter_base(output, input, opts)
        if output.dtype != input.dtype or input.numel() != output.numel() * self.world:
            raise ValueError(f"mpcore: reduce_scatter_tensor: the input must hold {self.world} "
                             f"times the output ({output.numel()} x {output.dtype}), not "
                             f"{input.numel()} x {input.dtype}")
        self._no_cuda("reduce_scatter_tensor", [output, input])
        check_cpu("reduce_scatter_tensor", [output, input])
        return self._reduce_scatter_flat(output, Dense(input).t, opts.reduceOp.op,
                                         opts.asyncOp, [output])

    # torch's other name for _reduce_scatter_base:
    # recorded as it, and not routed to torch's NCCL group
    reduce_scatter_single = recorded_as("_reduce_scatter_base", "reduce_scatter_single")(
        _reduce_scatter_base.__wrapped__)

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
            out.copy_(whole.view(self.world, -1)[self.my_rank].view(out.shape))
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

    # torch's other name for reduce_scatter_tensor_coalesced:
    # recorded as it, and not routed to torch's NCCL group
    reduce_scatter_single_coalesced = recorded_as("reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced")(
        reduce_scatter_tensor_coalesced.__wrapped__)

    # -- gather, scatter ---------------------------------------------------------------------
    @cuda_routed
    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        shm, root = self.shm, opts.rootRank
        if shm is not None and len(inputs) == 1 and 0 <= root < self.world:
            # contiguous CPU tensors of one shape: the core's call
            inp = inputs[0]
            outs = plain_list(output_lists, inp, self.world if self.my_rank == root else 0)
            if outs is not None and inp.is_cpu and inp.is_contiguous():
                # the Work's result is the root's outputs' list, as gloo's
                return self._run(opts.asyncOp, outs or [], shm.core.gather,
                                 [o.data_ptr() for o in outs] if outs else 0, inp.data_ptr(),
                                 nbytes(inp), root, keep=(inp, outs))
        if self.gloo is not None:
            return self.gloo.gather(output_lists, inputs, opts)
        self._check_root("gather", root)
        if len(inputs) != 1:
            raise ValueError("mpcore: gather takes one input tensor")
        inp = inputs[0]
        outs = output_lists[0] if output_lists else []
        if self.my_rank == root:
            if len(output_lists) != 1 or len(outs) != self.world:
                raise ValueError(f"mpcore: gather needs {self.world} output tensors on the "
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
        if shm is not None and len(outputs) == 1 and 0 <= root < self.world:   # as gather's
            out = outputs[0]
            ins = plain_list(input_lists, out, self.world if self.my_rank == root else 0)
            if ins is not None and out.is_cpu and out.is_contiguous():
                return self._run(opts.asyncOp, outputs, shm.core.scatter, out.data_ptr(),
                                 [t.data_ptr() for t in ins] if ins else 0, nbytes(out), root,
                                 keep=(out, ins))
        if self.gloo is not None:
            return self.gloo.scatter(outputs, input_lists, opts)
        self._check_root("scatter", root)
        if len(outputs) != 1:
            raise ValueError("mpcore: scatter takes one output tensor")
        out = outputs[0]
        ins = input_lists[0] if input_lists else []
        mine = self.my_rank == root
        if mine:
            if len(input_lists) != 1 or len(ins) != self.world:
                raise ValueError(f"mpcore: scatter needs {self.world} input tensors on the "
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
                             *self.core_all_to_all(output, input, output_split_sizes,
                                                    input_split_sizes), keep=(input, output))
        if self.gloo is not None:
            return self.gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes,
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

    # torch's other name for alltoall_base:
    # recorded as it, and not routed to torch's NCCL group
    all_to_all_single = recorded_as("alltoall_base", "all_to_all_single")(
        alltoall_base.__wrapped__)

    def core_all_to_all(self, output, input, output_split_sizes, input_split_sizes):
        """(fn, *args) of the core's all_to_all of two contiguous CPU tensors
        of one dtype, the input in its group buffer if it has one (NOTE
        [ Memory reduced again and again ]).  An input that overlaps the
        output is copied first: peers may still read a piece of it after
        this rank has written its own (gloo's result is then garbage)."""
        send = self._splits("input", input, input_split_sizes)
        recv = self._splits("output", output, output_split_sizes)
        call = self.shm.core.all_to_all
        o, i, n = output.data_ptr(), input.data_ptr(), sum(send)
        if i < o + sum(recv) and o < i + n:
            copy = input.clone()
            call = functools.partial(call)
            call.copy = copy   # lives as long as the call does
            return call, o, copy.data_ptr(), send, recv
        if n < BUFFER_MIN:
            return call, o, i, send, recv
        buf = buffer_of(input)   # may move input's storage: its address is read after
        return with_buffer(call, buf), o, input.data_ptr(), send, recv

    def _splits(self, what, t, sizes):
        """Byte counts for each rank of a dim-0 split of t (even when sizes
        is empty)."""
        w = self.world
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
        if self.gloo is not None:
            return self.gloo.alltoall(output_tensors, input_tensors, opts)
        w = self.world
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
