"""Groups whose ranks are on several machines: shared memory inside each
host, torch's gloo among one leader per host, and a flat gloo group for
what the hierarchy does not serve.

NOTE [ Hierarchical groups ]
The backend's creator (_backend.create) asks _dist.join for a region; when
the ranks' host ids (hostname and boot id, published by join in the
group's own store) are not all the same, it makes a HierGroup instead.  So
locality is decided per group, from what its own ranks published: a
subgroup whose ranks are all on one host still gets a plain region, and a
subgroup across hosts gets its own hierarchy.

The parts, made in the same order on every rank (each connect is
collective over the ranks that take part, so the order rules out a wait
in a cycle):
- the host's group: the group's ranks on this host, numbered by their
  group rank (local rank 0 is the lowest), over one region of their own
  (_dist.join with the prefix "mpcore/hier/<host index>/");
- the flat group: a ProcessGroupGloo over all ranks ("gloo/", the store
  keys the backend used before hierarchies);
- the leaders' group: the host's local rank 0 of every host, numbered by
  host index (hosts in the order of their lowest rank), a ProcessGroupGloo
  over "mpcore/leaders/".

What runs hierarchically, on CPU tensors of a dtype and op that both the
core and gloo reduce:
- all_reduce: reduce to the leader in shared memory, all-reduce among
  leaders, broadcast from the leader (AVG is a SUM divided by the world
  size at the leaders: gloo has no AVG);
- reduce: the same, to the root's leader, which sends it to the root;
- broadcast (any dtype, as bytes): in shared memory on the root's host,
  among leaders from the root's host, in shared memory on the others;
- all_gather (list and into-tensor): gather to the leader, all-gather
  among leaders of blocks padded to the largest host, put in rank order,
  broadcast from the leader;
- reduce_scatter (list and tensor): reduce the whole input to the leader,
  all-reduce it among leaders, scatter each local rank's piece;
- barrier: local, leaders, local.
Everything else (gather, scatter, all_to_all, point-to-point, tensors not
on the CPU, dtypes or ops gloo or the core lack, arguments that do not fit,
which gloo then refuses with its own message) goes to the flat gloo group,
so its result is gloo's.

Order: every collective, hierarchical or flat, runs on the host group's
collectives thread (asyncOp) or at once after what that thread has queued
(synchronous), so the group's results come in the order asked for, as on
one host; point-to-point calls go to the flat group directly.

Failures.  A rank that dies is seen first by its host's ranks (the core
watches every peer's pid) or, for a leader, by the other leaders (gloo sees
its sockets close).  Whoever sees a failure first
- writes its explanation (local ranks translated to group ranks, the host
  named) under "mpcore/hier/failed" in the group's store, first writer
  wins;
- breaks its host's region with that explanation, which wakes every rank
  of the host at once (Group.break_group);
- aborts its gloo groups, so that the other hosts' leaders, waiting in
  gloo, fail at once instead of at gloo's timeout.
A leader whose gloo call fails reads the explanation from the store
(waiting up to _CAUSE_WAIT_S for it: a dead leader's host may need the
core's 100 ms look at its peers to write it) and passes it on to its
host the same way; so every rank of every host raises an error naming the
rank that died.  When the store itself is gone (the group's store is
served by rank 0 of the job), the error names the link that failed and
says that no cause was recorded.  A group that failed stays failed: later
calls raise the same error.

CUDA tensors reach the flat gloo group (a NCCL group among leaders is not
made).

NOTE [ More ranks than a region holds ]
A region serves at most _dist.REGION_MAX ranks (the core's
MPC_COLL_MAX_RANKS, 64: its per-rank lines and the arrays its calls keep on
the stack).  A group with more ranks on one host (a CPU job with a rank
per core on a large machine) was refused at rank 0 while the other ranks
waited for its region until the store's timeout.  Such a host is now told
as several, of consecutive ranks in parts as even as can be (96 ranks:
two of 48), and the group is a hierarchy over them as over hosts: shared
memory inside each part, gloo among one leader per part.
"""
import datetime
import re
import threading

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .. import _torchapi
from . import _dist
from ._args import Dense
from ._reduce import core_codes
from ._work import Done, Work

AllgatherOptions = _torchapi.get("torch._C._distributed_c10d.AllgatherOptions")

_RED = ReduceOp.RedOpType
_CAUSE_WAIT_S = 1.0
# NOTE [ Pieces of a large all-reduce ]
# A leader all-reduces a large tensor among the leaders piece by piece, as
# soon as each piece is reduced on its host, and its host's ranks wait for
# the broadcast of the first piece only: the host's shared-memory reduce of
# piece i + 1 runs while gloo's threads send piece i, and the broadcast of
# piece i while gloo sends the rest.  Every rank of a host makes the same
# calls in the same order (all the reduces, then all the broadcasts), and
# gloo keeps the order of the leaders' calls.
_PIECE = 2 << 20
# dtypes that both the core and gloo reduce
_GLOO_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                torch.uint8, torch.int32, torch.int64)
_GLOO_OPS = {_RED.SUM: ReduceOp.SUM, _RED.PRODUCT: ReduceOp.PRODUCT, _RED.MIN: ReduceOp.MIN,
             _RED.MAX: ReduceOp.MAX, _RED.BAND: ReduceOp.BAND, _RED.BOR: ReduceOp.BOR,
             _RED.BXOR: ReduceOp.BXOR}


def hosts_of(store, world):
    """The host id of every rank of the group, as _dist.join published
    them in the group's store, a host of more ranks than a region serves
    told as several (NOTE [ More ranks than a region holds ])."""
    hosts = [h.decode() for h in store.multi_get([f"mpcore/host/{r}" for r in range(world)])]
    for h in set(hosts):
        mine = [r for r in range(world) if hosts[r] == h]
        parts = -(-len(mine) // _dist.REGION_MAX)
        if parts > 1:
            for i, r in enumerate(mine):   # even parts of consecutive ranks
                hosts[r] = f"{h}#{i * parts // len(mine)}"
    return hosts


class HierGroup:
    """The transport of a ProcessGroupMpcore whose ranks are on several
    hosts (NOTE [ Hierarchical groups ]): the methods of a torch
    ProcessGroup's operations, as the backend calls them."""

    def __init__(self, store, rank, world, timeout, hosts):
        self._store = store
        self._rank = rank
        self._world = world
        self._timeout_s = _dist.seconds(timeout)
        order = list(dict.fromkeys(hosts))
        self._names = [h.split("/")[0] for h in order]
        self._members = [[r for r in range(world) if hosts[r] == h] for h in order]
        self._host_of = [order.index(h) for h in hosts]
        self._local_of = [self._members[self._host_of[r]].index(r) for r in range(world)]
        self._h = self._host_of[rank]
        self._mine = self._members[self._h]
        self._H = len(order)
        self._L = len(self._mine)
        self._lmax = max(len(m) for m in self._members)
        self._broken = None
        self._inline = threading.local()
        self.local = _dist.join(store, f"mpcore/hier/{self._h}/", self._local_of[rank], self._L,
                                self._timeout_s)
        self.local.work_type = Work
        self.flat = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world, timeout)
        self.leaders = None
        if self._local_of[rank] == 0:
            self.leaders = dist.ProcessGroupGloo(dist.PrefixStore("mpcore/leaders/", store),
                                                 self._h, self._H, timeout)

    def set_timeout(self, timeout):
        self._timeout_s = _dist.seconds(timeout)
        self.local.set_timeout(self._timeout_s)
        for g in (self.flat, self.leaders):
            if g is not None:
                g.set_timeout(timeout)

    def __repr__(self):
        return (f"HierGroup(rank={self._rank}, hosts={self._H}, host={self._names[self._h]}, "
                f"local={self._local_of[self._rank]}/{self._L})")

    # -- failures (NOTE [ Hierarchical groups ]) ------------------------------------------
    def _explain_local(self, e):
        msg = str(e)
        if msg.startswith("mpcore: "):  # a break passed on by this host's leader
            return msg
        mine = self._mine

        def one(m):
            q = int(m.group(1))
            return f"rank {mine[q]}" if q < len(mine) else m.group(0)

        def many(m):
            qs = [int(q) for q in re.findall(r"\d+", m.group(1))]
            return "ranks " + ", ".join(str(mine[q]) if q < len(mine) else str(q) for q in qs)
        msg = re.sub(r"\branks ((?:\d+(?:, )?)+)", many, msg)
        msg = re.sub(r"\brank (\d+)", one, msg)
        return (f"mpcore: a collective of a group across {self._H} hosts failed on host "
                f"{self._names[self._h]} (ranks {mine}): {msg}")

    def _explain_remote(self, e, link):
        key = "mpcore/hier/failed"
        try:
            self._store.wait([key], datetime.timedelta(seconds=_CAUSE_WAIT_S))
            return self._store.get(key).decode()
        except Exception:
            pass
        return (f"mpcore: a collective of a group across {self._H} hosts failed on host "
                f"{self._names[self._h]} (rank {self._rank}): {link} failed and no rank "
                f"recorded why (a host, or the rank serving the store, may be gone): "
                f"{_first_line(e)}")

    def _fail(self, msg):
        """Records msg as the group's failure, passes it on, and raises it."""
        if self._broken is None:
            self._broken = msg
            try:
                self._store.compare_set("mpcore/hier/failed", "", msg)
            except Exception:
                pass  # the store is gone: the others see their links fail
            local = self.local
            if local is not None:
                local.core.break_group(msg)
            for g in (self.leaders, self.flat):
                if g is not None:
                    try:
                        g.abort()
                    except Exception:
                        pass
        raise GroupFailed(self._broken) from None

    def _loc(self, name, *args):
        """A call of the host group's core; its failure is the group's."""
        try:
            return getattr(self.local.core, name)(*args)
        except GroupFailed:
            raise
        except Exception as e:
            self._fail(self._explain_local(e))

    def _gloo(self, which, call):
        """call(group).wait() on the leaders' or the flat gloo group."""
        self._gloo_wait(which, self._gloo_start(which, call))

    def _gloo_start(self, which, call):
        """call(group) on the leaders' or the flat gloo group: its Work."""
        g = self.leaders if which == "leaders" else self.flat
        try:
            return call(g)
        except Exception as e:
            if which == "flat":  # gloo refused the call's arguments: nothing was sent
                raise _Refused(e) from None
            raise

    def _gloo_wait(self, which, work):
        try:
            work.wait()
        except Exception as e:
            self._fail(self._explain_remote(
                e, "the link among the hosts' leaders" if which == "leaders"
                else "the flat gloo group"))

    def _go(self, async_op, result, fn, keep=()):
        """fn(timeout) in the group's order (NOTE [ Hierarchical groups ])."""
        local = self.local
        if local is None:
            raise RuntimeError("mpcore: this process group has been destroyed")

        def guarded(timeout):
            if self._broken is not None:
                raise GroupFailed(self._broken)
            try:
                fn(timeout)
            except GroupFailed:
                raise
            except _Refused as e:
                raise e.args[0] from None
            except Exception as e:  # a step failed on this rank alone: the others must hear
                self._fail(f"mpcore: a collective of a group across {self._H} hosts failed "
                           f"on host {self._names[self._h]} (rank {self._rank}): "
                           f"{type(e).__name__}: {e}")
        if getattr(self._inline, "on", False):  # inside _each, on the group's thread
            guarded(local.timeout)
            return Done(result)
        if not async_op:
            local.run(False, result, guarded)
            return Done(result)
        return local.run(True, result, guarded, keep=keep)

    def _flat_op(self, name, result, async_op, *args):
        """The flat gloo group's `name`, in the group's order."""
        return self._go(async_op, result,
                        lambda timeout: self._gloo("flat", lambda g: getattr(g, name)(*args)),
                        keep=args)

    # -- what runs hierarchically ------------------------------------------------------------
    def _plan(self, tensors, red):
        """(core dtype code, core op code, gloo ReduceOp, avg) per tensor, or
        None when the hierarchy cannot reduce them all."""
        if red == _RED.AVG:
            base, avg = _RED.SUM, True
        else:
            base, avg = red, False
        if base not in _GLOO_OPS:
            return None
        plans = []
        for t in tensors:
            if (not isinstance(t, torch.Tensor) or t.device.type != "cpu"
                    or t.layout != torch.strided or t.dtype not in _GLOO_DTYPES
                    or t.numel() == 0
                    or (avg and not t.is_floating_point())):
                return None
            codes = core_codes(t.dtype, base)
            if codes is None:
                return None
            plans.append((codes[0], codes[1], _GLOO_OPS[base], avg))
        return plans

    def _cpu(self, tensors):
        """True when the hierarchy can move the tensors (CPU, dense, not
        empty)."""
        return all(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                   and t.layout == torch.strided and t.numel() > 0 for t in tensors)

    def _all_reduce_one(self, t, plan, timeout):
        """t (contiguous) becomes the reduction over the group, in pieces
        (NOTE [ Pieces of a large all-reduce ])."""
        dc, oc, gop, avg = plan
        flat = t.view(-1)
        es = t.element_size()
        step = max(1, _PIECE // es)
        pieces = [flat[i:i + step] for i in range(0, flat.numel(), step)] or [flat]
        works = []
        for p in pieces:
            if self._L > 1:
                self._loc("reduce", p.data_ptr(), p.numel(), dc, oc, 0, timeout)
            if self.leaders is not None:
                o = dist.AllreduceOptions()
                o.reduceOp = gop
                works.append(self._gloo_start("leaders", lambda g, p=p, o=o: g.allreduce([p], o)))
        for i, p in enumerate(pieces):
            if self.leaders is not None:
                self._gloo_wait("leaders", works[i])
                if avg:
                    p.div_(self._world)
            if self._L > 1:
                self._loc("broadcast", p.data_ptr(), p.numel() * es, 0, timeout)

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._allreduce(list(tensors), opts.reduceOp, opts.asyncOp, "allreduce", opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._allreduce(list(tensors), opts.reduceOp, opts.asyncOp,
                               "allreduce_coalesced", opts)

    def _allreduce(self, tensors, reduce_op, async_op, name, opts):
        plans = self._plan(tensors, reduce_op.op)
        if plans is None:
            return self._flat_op(name, tensors, async_op, tensors, opts)
        dense = [Dense(t) for t in tensors]

        def run(timeout):
            for d, p in zip(dense, plans):
                self._all_reduce_one(d.t, p, timeout)
                d.back()
        return self._go(async_op, tensors, run, keep=dense)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        root = opts.rootRank
        plans = self._plan(tensors, opts.reduceOp.op)
        if plans is None or not 0 <= root < self._world:
            return self._flat_op("reduce", tensors, opts.asyncOp, tensors, opts)
        hr, lr = self._host_of[root], self._local_of[root]
        me = self._local_of[self._rank]
        dense = [Dense(t) for t in tensors]

        def run(timeout):
            for d, (dc, oc, gop, avg) in zip(dense, plans):
                t = d.t.clone() if (self._rank != root or lr != 0) else d.t
                if self._L > 1:
                    self._loc("reduce", t.data_ptr(), t.numel(), dc, oc, 0, timeout)
                if self.leaders is not None:
                    o = dist.ReduceOptions()
                    o.reduceOp, o.rootRank = gop, hr
                    self._gloo("leaders", lambda g: g.reduce([t], o))
                    if avg and self._h == hr:
                        t.div_(self._world)
                if self._h == hr and lr != 0:
                    n = t.numel() * t.element_size()
                    if me == 0:
                        self._loc("send", t.data_ptr(), n, lr, 0, timeout)
                    elif me == lr:
                        self._loc("recv", t.data_ptr(), n, 0, 0, timeout)
                if self._rank == root:
                    if t is not d.t:
                        d.t.copy_(t)
                    d.back()
        return self._go(opts.asyncOp, tensors, run, keep=dense)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        root = opts.rootRank
        if not self._cpu(tensors) or not 0 <= root < self._world:
            return self._flat_op("broadcast", tensors, opts.asyncOp, tensors, opts)
        hr, lr = self._host_of[root], self._local_of[root]
        dense = [Dense(t) for t in tensors]

        def run(timeout):
            for d in dense:
                t = d.t
                n = t.numel() * t.element_size()
                if self._h == hr and self._L > 1:
                    self._loc("broadcast", t.data_ptr(), n, lr, timeout)
                if self.leaders is not None and n:
                    o = dist.BroadcastOptions()
                    o.rootRank = hr
                    raw = t.view(-1).view(torch.uint8)
                    self._gloo("leaders", lambda g: g.broadcast([raw], o))
                if self._h != hr and self._L > 1:
                    self._loc("broadcast", t.data_ptr(), n, 0, timeout)
                d.back()
        return self._go(opts.asyncOp, tensors, run, keep=dense)

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()

        def run(timeout):
            if self._L > 1:
                self._loc("barrier", timeout)
            if self.leaders is not None:
                self._gloo("leaders", lambda g: g.barrier(dist.BarrierOptions()))
            if self._L > 1:
                self._loc("barrier", timeout)
        return self._go(opts.asyncOp, [], run)

    def _gather_all(self, out, src, timeout):
        """out (world x n bytes, uint8) becomes every rank's src (n bytes)
        in rank order."""
        n = src.numel()
        lead = self.leaders is not None
        block = torch.empty((self._lmax, n), dtype=torch.uint8) if lead else None
        if self._L > 1:
            self._loc("gather", block.data_ptr() if lead else 0, src.data_ptr(), n, 0, timeout)
        elif lead:
            block[0].copy_(src)
        if lead:
            every = torch.empty((self._H * self._lmax, n), dtype=torch.uint8)
            self._gloo("leaders", lambda g: g._allgather_base(every, block,
                                                                AllgatherOptions()))
            every = every.view(self._H, self._lmax, n)
            for h, ranks in enumerate(self._members):
                out[ranks] = every[h, :len(ranks)]
        if self._L > 1:
            self._loc("broadcast", out.data_ptr(), out.numel(), 0, timeout)

    def _gather_fits(self, inp, outs):
        return (self._cpu([inp] + list(outs)) and inp.numel() > 0
                and all(o.dtype == inp.dtype and o.numel() == inp.numel() for o in outs))

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        if (len(inputs) != 1 or len(output_lists) != 1 or len(output_lists[0]) != self._world
                or not self._gather_fits(inputs[0], output_lists[0])):
            return self._flat_op("allgather", output_lists, opts.asyncOp, output_lists, inputs,
                                 opts)
        inp, outs = inputs[0], output_lists[0]
        src = inp.contiguous()
        flat = torch.empty((self._world, inp.numel() * inp.element_size()), dtype=torch.uint8)

        def run(timeout):
            self._gather_all(flat, src.view(-1).view(torch.uint8), timeout)
            for i, t in enumerate(outs):
                t.copy_(flat[i].view(inp.dtype).view(t.shape))
        return self._go(opts.asyncOp, output_lists, run, keep=(src, flat))

    def _allgather_base(self, output, input, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        if (output.numel() != input.numel() * self._world or not self._cpu([output, input])
                or output.dtype != input.dtype or input.numel() == 0):
            return self._flat_op("_allgather_base", [output], opts.asyncOp, output, input, opts)
        src = input.contiguous()
        dst = Dense(output, read=False)
        n = input.numel() * input.element_size()

        def run(timeout):
            self._gather_all(dst.t.view(-1).view(torch.uint8).view(self._world, n),
                             src.view(-1).view(torch.uint8), timeout)
            dst.back()
        return self._go(opts.asyncOp, [output], run, keep=(src, dst))

    def _each(self, calls, async_op, result):
        """Several calls as one, in order; one Work for all."""
        o = dist.AllreduceOptions()
        o.asyncOp = False

        def run(timeout):
            for c in calls:
                c(o)
        return self._go(async_op, result, run)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # gloo's own: output_lists is indexed [rank][input], one flat all-gather
        opts = opts if opts is not None else AllgatherOptions()
        return self._flat_op("allgather_coalesced", output_lists, opts.asyncOp, output_lists,
                             inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        return self._each([lambda o, a=a, b=b: self._now(self._allgather_base, a, b)
                           for a, b in zip(outputs, inputs)], opts.asyncOp, outputs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        red = opts.reduceOp
        return self._each([lambda o, a=a, b=b: self._now(self._reduce_scatter_base, a, b,
                                                         red=red)
                           for a, b in zip(outputs, inputs)], opts.asyncOp, outputs)

    def _now(self, method, *args, red=None):
        """method(*args) run synchronously on the caller's thread (which is
        the group's thread, inside _each)."""
        opts = (dist.ReduceScatterOptions() if red is not None else AllgatherOptions())
        if red is not None:
            opts.reduceOp = red
        self._inline.on = True
        try:
            return method(*args, opts)
        finally:
            self._inline.on = False

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if (len(outputs) != 1 or len(input_lists) != 1 or len(input_lists[0]) != self._world
                or any(t.shape != outputs[0].shape or t.dtype != outputs[0].dtype
                       for t in input_lists[0])
                or self._plan([outputs[0]] + list(input_lists[0]), opts.reduceOp.op) is None):
            return self._flat_op("reduce_scatter", outputs, opts.asyncOp, outputs, input_lists,
                                 opts)
        whole = torch.stack([t.contiguous() for t in input_lists[0]])
        return self._reduce_scatter(outputs[0], whole, opts.reduceOp.op, opts.asyncOp, outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if (input.numel() != output.numel() * self._world or input.dtype != output.dtype
                or self._plan([output, input], opts.reduceOp.op) is None):
            return self._flat_op("_reduce_scatter_base", [output], opts.asyncOp, output, input,
                                 opts)
        return self._reduce_scatter(output, input.contiguous().clone(), opts.reduceOp.op,
                                    opts.asyncOp, [output])

    def _reduce_scatter(self, output, whole, red, async_op, result):
        """output becomes this rank's piece of the reduction of `whole`
        (world pieces of output's size, a copy this call may change)."""
        dc, oc, gop, avg = self._plan([output], red)[0]
        n = output.numel()
        dst = Dense(output, read=False)
        lead = self.leaders is not None
        mine = torch.tensor(self._mine, dtype=torch.int64)

        def run(timeout):
            w = whole.view(-1)
            if self._L > 1:
                self._loc("reduce", w.data_ptr(), w.numel(), dc, oc, 0, timeout)
            if lead:
                o = dist.AllreduceOptions()
                o.reduceOp = gop
                self._gloo("leaders", lambda g: g.allreduce([w], o))
                if avg:
                    w.div_(self._world)
            if self._L > 1:
                pieces = w.view(self._world, n)[mine].contiguous() if lead else None
                self._loc("scatter", dst.t.data_ptr(), pieces.data_ptr() if lead else 0,
                          n * output.element_size(), 0, timeout)
            else:
                dst.t.view(-1).copy_(w.view(self._world, n)[self._rank])
            dst.back()
        return self._go(async_op, result, run, keep=(whole, dst))

    # -- what the flat gloo group serves -------------------------------------------------------
    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        return self._flat_op("gather", output_lists, opts.asyncOp, output_lists, inputs, opts)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._flat_op("scatter", outputs, opts.asyncOp, outputs, input_lists, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._flat_op("alltoall", output_tensors, opts.asyncOp, output_tensors,
                             input_tensors, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._flat_op("alltoall_base", [output], opts.asyncOp, output, input,
                             output_split_sizes, input_split_sizes, opts)

    def send(self, tensors, dst, tag):
        return self.flat.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self.flat.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self.flat.recv_anysource(tensors, tag)

    def shutdown(self):
        """Stops the host group's thread, unmaps its region and shuts the
        gloo groups down."""
        local, self.local = self.local, None
        if local is not None:
            local.close()
        for name in ("leaders", "flat"):
            g = getattr(self, name)
            setattr(self, name, None)
            if g is not None:
                try:
                    g.shutdown() if self._broken is None else g.abort()
                except Exception:
                    pass


def _first_line(e):
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class GroupFailed(dist.DistBackendError):
    """The group failed (NOTE [ Hierarchical groups ])."""


class _Refused(Exception):
    """Carries gloo's refusal of a call of the flat group's."""


def create(store, rank, world, timeout):
    """The HierGroup of a group whose ranks are on several hosts."""
    return HierGroup(store, rank, world, timeout, hosts_of(store, world))
