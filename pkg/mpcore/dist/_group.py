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
region (mpcore.dist._dist.ShmGroup over the C core, csrc/coll.c), CUDA tensors
to mpcore's NCCL communicator of the group (made on first CUDA use, which
every rank reaches at the same call), and returns a Work with torch's
surface.  A call with asyncOp false runs at once on the caller's thread
(after what the group has queued); one with asyncOp true runs on the
group's thread, in the order asked for.  Point-to-point calls always run
on the group's thread, since torch gives them no asyncOp.  While a
dispatch mode or torch's profiler observes a call, a method goes the C++
ProcessGroup's way instead, through c10d's op, and comes back to itself
from the op's CPU kernel (NOTE [ Observed calls go through the
dispatcher ] in _profile.py).

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
lookup for what the core reduces (CORE_ROWS, _reduce.py), and a completed Work without an
event (Done) for a synchronous call.  The dispatcher is the way in, except
for six of torch's module functions and three functional collectives
whose own cost measurement put above the core's (NOTE [ A fast path for
torch's module functions ] and NOTE [ A fast path for the functional
collectives ] in _fastpath.py).
"""
import datetime
import time

import torch
import torch.distributed as dist

from .. import _torchapi
from . import _dist
from ._args import Dense, check_cpu, nbytes
from ._collectives import NCCL_DTYPES, Collectives, cuda_routed
from ._profile import monitored, recorded_as
from ._work import AllOf, Done, Work, done

_WORLD = _torchapi.find(f"{_torchapi.C10D}._world")   # None only outside the torch window


# --- the group ------------------------------------------------------------------------

class ProcessGroupMpcore(Collectives, dist.ProcessGroup):
    """One rank's handle on a process group served by mpcore
    (NOTE [ The backend is a ProcessGroup ]).  `.shm` is the group's
    ShmGroup, None when the ranks are not all on one machine."""

    # NOTE [ The fast paths' attributes are slots ]
    # Every fast path reads some of these on each call (C's and Python's,
    # dist/_fastpath.py).  An attribute in the __dict__ of a subclass of a
    # pybind11 class costs about 0.02 us to read (its dict lies at a
    # negative offset, which the interpreter finds the slow way), a slot
    # about 0.008: dist.barrier reads four of them.  The rest stay in
    # __dict__; torch's base gives the instances their weakref already.
    __slots__ = ("shm", "gloo", "batch", "timeout_s", "group_ranks", "__dict__")

    def __init__(self, store, rank, world, timeout_s, shm, gloo):
        super().__init__(rank, world)
        self._store = store
        self.my_rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.shm = shm
        self.gloo = gloo
        self._nccl = None
        self._torch_nccl = None  # torch's ProcessGroupNCCL, where torch has one
        self._name = ""
        self._desc = ""
        self._asked = None  # NOTE [ The name the group answers to ]
        self._monitored = 0  # monitored_barrier calls (NOTE [ monitored_barrier's protocol ])
        self.batch = None  # the point-to-point Works of a coalescing block
        self.split_count = 0  # split_group calls on this group (NOTE [ Splitting a group ])
        # global rank -> this group's rank (_create_extended sets a subgroup's)
        self.group_ranks = {r: r for r in range(world)}
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
            rec = _WORLD.pg_map.get(self)
            if rec is None:
                return "mpcore"   # not registered yet: asked again later
            asked = str(rec[0]).lower()
            name = self._asked = ("gloo" if asked == "gloo" or "cpu:gloo" in asked.split(",")
                                  else "mpcore")
        return name

    name = _get_backend_name

    def size(self):
        return self.world

    def rank(self):
        return self.my_rank

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
        """The group's default timeout from now on, as torch's groups take it.

        NOTE [ Where the group's timeout is held ]
        Three holders, each for a reason none of the others can serve;
        set_timeout (and torch's _set_pg_timeout, which calls it) reaches
        them all:
        - `timeout_s` here: the group's default whatever serves it (the
          region, gloo, the hierarchy, or nothing after shutdown).  Options
          with no timeout of their own, monitored_barrier's store waits and
          the NCCL group made on first CUDA use read it, and `shm` may be
          None, so it cannot be derived from the region.
        - the ShmGroup's `timeout` (and each of its lanes'): the core's
          calls take the timeout as an argument, and a call queued with
          async_op reads it when its lane runs it, so that a new timeout
          reaches queued calls.  The ShmGroup lies a layer below this
          class and holds no reference up to it.
        - the inner groups (torch's gloo or NCCL group, the hierarchy's):
          torch's objects keep their own and are told by set_timeout."""
        self.timeout_s = timeout.total_seconds()
        if self.shm is not None:
            self.shm.set_timeout(self.timeout_s)
        for inner in (self.gloo, self._torch_nccl):
            if inner is not None:
                inner.set_timeout(timeout)

    def __repr__(self):
        where = ("shared memory" if self.shm is not None else
                 "gloo" if self.gloo is not None else "destroyed")
        return f"ProcessGroupMpcore(rank={self.my_rank}, world={self.world}, {where})"

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
        g, self.gloo = self.gloo, None
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

    def cuda_group(self, what):
        """This group's NCCL communicator (made on first use: every rank
        reaches its first CUDA collective at the same call)."""
        if self._nccl is None:
            from . import _nccl
            self._nccl = _nccl.NcclGroup.create(self._store, self.my_rank, self.world,
                                                "mpcore-nccl/")
        return self._nccl

    def _torch_nccl_pg(self):
        """torch's ProcessGroupNCCL for this group (NOTE [ CUDA tensors in an
        mpcore group ])."""
        if self._torch_nccl is None:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=self.timeout_s)
            self._torch_nccl = dist.ProcessGroupNCCL(dist.PrefixStore("torch-nccl/", self._store),
                                                     self.my_rank, self.world, opts)
        return self._torch_nccl

    def _cuda_call(self, what, tensors):
        if all(t.device.type == "cuda" for t in tensors):
            for t in tensors:
                if t.dtype not in NCCL_DTYPES or not t.is_contiguous():
                    raise ValueError(f"mpcore: {what} on CUDA takes contiguous tensors of "
                                     f"{sorted(str(d) for d in NCCL_DTYPES)}, not {t.dtype}")
            return self.cuda_group(what)
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
        return self.timeout_s if t.total_seconds() < 0 else t.total_seconds()

    # -- barrier -----------------------------------------------------------------------------
    @recorded_as("barrier")
    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        if self.gloo is not None:
            return self.gloo.barrier(opts)
        shm = self.shm
        if shm is None:
            raise RuntimeError("mpcore: this process group has been destroyed")
        timeout = self._timeout(opts)
        if not opts.asyncOp:
            shm.drain()
            shm.core.barrier(timeout)
            return done([])
        return shm.run(True, [], lambda _t: shm.core.barrier(timeout))

    @monitored   # NOTE [ monitored_barrier observed ] in _profile.py
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
        [ Mailboxes ] in coll_p2p.c), and rank 0 could not go on waiting for the
        next rank.  Each call has keys of its own (the group counts its
        calls, as gloo's tags do); rank 0 deletes each arrival as it sees it,
        and, after an "ok", waits until every rank has said it read the
        answer, then deletes those keys: rank 0 hosts the store in most jobs,
        and `monitored_barrier(); destroy_process_group()` at a program's end
        would otherwise take the store from a rank still reading it
        (DistNetworkError there).  Unlike gloo's, the group stays usable after
        a failure, and a rank that comes late is told of it at once."""
        import logging
        timeout_s = self.timeout_s if timeout is None else _dist.seconds(timeout)
        ms = int(round(timeout_s * 1000))
        store, me, w = self._store, self.my_rank, self.world
        self._monitored += 1
        key = f"mpcore/monitored/{self._monitored}/"
        answer = f"{key}answer"
        if me != 0:
            store.set(f"{key}came/{me}", "1")
            try:
                store.wait([answer], datetime.timedelta(seconds=self.timeout_s))
                said = store.get(answer).decode()
            except Exception as e:
                said = f"{type(e).__name__}: {e}"
            else:
                if said == "ok":
                    store.set(f"{key}read/{me}", "1")   # rank 0 may now leave
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
        # Rank 0 returns once every rank has read the answer: it hosts the
        # store in most jobs, and a program that leaves right after the
        # barrier would take the store from a rank still reading it.
        read = [f"{key}read/{q}" for q in range(1, w)]
        store.wait(read, datetime.timedelta(seconds=self.timeout_s))
        for k in read + [answer]:
            store.delete_key(k)

    # -- coalescing (torch's _coalescing_manager, batch_isend_irecv) ---------------------------
    def _start_coalescing(self, device):
        """Calls made inside run as they come, in order (nothing to batch);
        the point-to-point ones are remembered for _end_coalescing."""
        self.batch = []

    def _end_coalescing(self, device):
        """A Work that completes once every call made so far has."""
        batch, self.batch = self.batch or [], None
        if self.gloo is not None:
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
        if self.gloo is not None:
            return self.gloo.send(tensors, dst, tag)
        shm = self.shm
        t = tensors[0] if len(tensors) == 1 else None
        if not (t is not None and t.is_cpu and t.is_contiguous() and shm is not None
                and 0 <= dst < self.world and dst != self.my_rank):
            self._no_cuda("send", tensors)
            check_cpu("send", tensors)
            self._check_peer("send to", dst)
        src = [Dense(t).t for t in tensors]
        core = self._core()
        lane = self._send_lanes[dst]
        if len(src) == 1 and self.send_now(src[0], dst, tag):
            return self._p2p(Done(tensors))

        def run(timeout):
            for t in src:
                core.send(t.data_ptr(), nbytes(t), dst, tag, timeout)
        # NOTE [ Lanes ] in _dist.py
        return self._p2p(self.shm.run(True, tensors, run, keep=src, lane=lane))

    def send_now(self, t, dst, tag):
        """Whether contiguous CPU tensor t went to rank dst's mailbox on
        this thread (NOTE [ A send that fits the mailbox ])."""
        shm = self.shm
        return bool(shm.lane(self._send_lanes[dst]).run_if_idle(
            shm.core.try_send, t.data_ptr(), t.nbytes, dst, tag))

    @cuda_routed
    def recv(self, tensors, src, tag):
        return self._recv(tensors, src, tag)

    @cuda_routed
    def recv_anysource(self, tensors, tag):
        return self._recv(tensors, -1, tag)

    def _recv(self, tensors, src, tag):
        if self.gloo is not None:
            if src < 0:
                return self.gloo.recv_anysource(tensors, tag)
            return self.gloo.recv(tensors, src, tag)
        shm = self.shm
        t = tensors[0] if len(tensors) == 1 else None
        work = Work(tensors)
        if (t is not None and t.is_cpu and t.is_contiguous() and shm is not None
                and -1 <= src < self.world and src != self.my_rank):   # the core's call
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
        if self.batch is not None:
            self.batch.append(work)
        return work

    def _check_peer(self, what, peer):
        if not 0 <= peer < self.world or peer == self.my_rank:
            raise ValueError(f"mpcore: cannot {what} rank {peer}: not another rank of this "
                             f"group of {self.world}")


def _recv_into(work, core, addr, nbytes, src, tag, timeout):
    work.source = core.recv(addr, nbytes, src, tag, timeout)
