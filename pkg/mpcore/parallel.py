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
future completes when the sum is in place.  A module on the CPU must
use the default group of mpcore.distributed; otherwise DDP is torch's
alone.  A module on CUDA devices whose group has mpcore's NCCL
communicator (backend "nccl") gets the same hook, with the sum enqueued
through NCCL on the current stream.  A hook the program registers itself
(register_comm_hook) takes the place of mpcore's.
"""
import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from . import distributed as _mdist

__all__ = ["DistributedDataParallel"]


class _Hooks:
    """The state of mpcore's hook: the group, and a hook the program
    registered later, which then runs instead."""

    def __init__(self, group):
        self.group = group
        self.user = None


def _hook(hooks, bucket):
    if hooks.user is not None:
        state, hook = hooks.user
        return hook(state, bucket)
    group = hooks.group
    t = bucket.buffer()
    code = _mdist._DTYPES.get(t.dtype)
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
    work = group.run(True, t, group.core.all_reduce, t.data_ptr(), t.numel(), code, op)
    return work.get_future().then(lambda fut: t)


class DistributedDataParallel(_TorchDDP):
    """torch.nn.parallel.DistributedDataParallel, with torch's arguments.
    NOTE [ DDP over shared memory ]."""

    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self._mpcore_hooks = None
        devices = {p.device.type for p in self.module.parameters()}
        group = None
        if devices == {"cpu"}:
            group = _mdist._fast(self.process_group)
        elif devices == {"cuda"}:
            group = _mdist._cuda(self.process_group)
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
