"""mpcore.parallel.DistributedDataParallel: torch's DDP whose gradient
buckets are all-reduced over mpcore's shared-memory group.

NOTE [ DDP over shared memory ]
torch's DistributedDataParallel stays in charge: it broadcasts parameters
and buffers from rank 0 at construction, buckets gradients
(bucket_cap_mb), launches each bucket as soon as backward has filled it,
and supports no_sync(), find_unused_parameters and
gradient_as_bucket_view.  Only the bucket's all-reduce changes: a
communication hook averages the bucket over the shared-memory group (the
sum and the division by the world size in one pass, where torch's reducer
divides first and then sums over gloo: the same to float32 round-off), on
the group's thread, so that it overlaps with the rest of backward; the hook's
future completes when the sum is in place.  The first time the hook sees a
bucket, it moves the bucket's storage into a group buffer in place (as
share_memory_() moves a storage), so that from then on the ranks reduce
straight from each other's buckets (NOTE [ Group buffers ] in coll.c); the
reducer, its views of the bucket and the gradients that are views of it
(gradient_as_bucket_view) follow the storage.  Buckets the reducer rebuilds
are moved when first seen; without the memory for a buffer, a bucket goes
through the group's staging areas instead (with one RuntimeWarning).  The
hook serves a module whose process group is mpcore's
(_backend.ProcessGroupMpcore): on the CPU through the group's
shared-memory region, when it has one; on CUDA devices through the
group's NCCL communicator, with the sum enqueued on the current stream.
Otherwise DDP is torch's alone (and on an mpcore group torch's reducer
reaches the backend anyway).  A hook the program registers itself
(register_comm_hook) takes the place of mpcore's.
"""
import warnings
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from . import _backend

__all__ = ["DistributedDataParallel"]


class _Hooks:
    """The state of mpcore's hook: the group, and a hook the program
    registered later, which then runs instead."""

    def __init__(self, group):
        self.group = group
        self.user = None
        self.buffers = weakref.WeakValueDictionary()  # bucket index -> its GroupBuffer
        self.warned = False  # about a bucket left without a buffer

    def buffer(self, index, t):
        """The group buffer that holds bucket `index` (tensor t), after moving
        the bucket's storage into a new one if it is not in one yet; None
        when there is no memory for it."""
        s = t.untyped_storage()
        b = self.buffers.get(index)
        if b is not None and b.address == s.data_ptr():
            return b
        try:
            b = _backend.into_buffer(s)
        except MemoryError as e:
            if not self.warned:
                self.warned = True
                warnings.warn(f"mpcore DDP: no shared memory for bucket {index} ({e}); "
                              f"its all-reduce is staged instead, which is slower",
                              RuntimeWarning, stacklevel=2)
            return None
        self.buffers[index] = b
        return b


def _hook(hooks, bucket):
    if hooks.user is not None:
        state, hook = hooks.user
        return hook(state, bucket)
    group = hooks.group
    t = bucket.buffer()
    code = (_backend._NCCL_DTYPES if t.device.type == "cuda" else _backend.DTYPES).get(t.dtype)
    if code is None or not t.is_contiguous():
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        return default_hooks.allreduce_hook(None, bucket)
    if t.device.type == "cuda":
        # enqueued on the current stream; the future's events order the rest
        t.div_(group.world)
        group.all_reduce(t, code, 0)
        fut = torch.futures.Future(devices=[t.device])
        fut.set_result(t)
        return fut
    if not t.is_floating_point():
        t.div_(group.world)
        op = 0
    else:
        op = 1  # avg: the division is folded into the sum's one pass
    buf = hooks.buffer(bucket.index(), t)
    addr, n, core = t.data_ptr(), t.numel(), group.core
    work = group.run(True, t, lambda timeout: core.all_reduce(addr, n, code, op, timeout, buf))
    return work.get_future().then(lambda fut: t)


_backend.run_uncompiled(_hook)   # called by the reducer (NOTE [ The backend runs uncompiled ])


class DistributedDataParallel(_TorchDDP):
    """torch.nn.parallel.DistributedDataParallel, with torch's arguments.
    NOTE [ DDP over shared memory ]."""

    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self._mpcore_hooks = None
        devices = {p.device.type for p in self.module.parameters()}
        pg, group = self.process_group, None
        if isinstance(pg, _backend.ProcessGroupMpcore):
            if devices == {"cpu"}:
                group = pg.shm
            elif devices == {"cuda"}:
                group = pg._cuda("DistributedDataParallel")
        if group is not None:
            self._mpcore_hooks = _Hooks(group)
            super().register_comm_hook(self._mpcore_hooks, _hook)

    def register_comm_hook(self, state, hook):
        if self._mpcore_hooks is None:
            return super().register_comm_hook(state, hook)
        if self._mpcore_hooks.user is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._check_comm_hook(hook)
        self._mpcore_hooks.user = (state, hook)
