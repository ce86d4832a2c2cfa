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
straight from each other's buckets (NOTE [ Group buffers ] in coll_copy.c); the
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
import copyreg
import os
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from . import _torchapi
from .dist import _backend, _buffers, _collectives, _profile, _reduce, _uncompiled

__all__ = ["DistributedDataParallel"]


class _Hooks:
    """The state of mpcore's hook: the group, and a hook the program
    registered later, which then runs instead."""

    def __init__(self, group, pg=None):
        self.group = group
        self.pg = pg    # the ProcessGroupMpcore, whose method the profiler sees
        self.user = None
        self.buffers = weakref.WeakValueDictionary()  # bucket index -> its GroupBuffer
        self.warned = False  # about a bucket left without a buffer

    def buffer(self, index, t):
        """The group buffer that holds bucket `index` (tensor t), after moving
        the bucket's storage into a new one if it is not in one yet; None
        when there is no memory for it."""
        if _buffers.SWAP is None:
            return None   # torch cannot move a storage in place: the all-reduce is staged
        s = t.untyped_storage()
        b = self.buffers.get(index)
        if b is not None and b.address == s.data_ptr():
            return b
        try:
            b = _buffers.into_buffer(s)
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
    if hooks.user is not None and hooks.user[1] is not None:
        state, hook = hooks.user
        return hook(state, bucket)
    group = hooks.group
    t = bucket.buffer()
    code = (_collectives.NCCL_DTYPES if t.device.type == "cuda" else _reduce.DTYPES).get(t.dtype)
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
    if hooks.pg is not None and (_profile.profiling() or _profile.modes()):
        # as torch's reducer, through the group's method, which records the
        # bucket's event and goes through c10d's op (NOTE [ Collectives in the
        # profiler ] and NOTE [ Observed calls go through the dispatcher ] in
        # dist/_profile.py)
        if op:
            t.div_(group.world)
        o = dist.AllreduceOptions()
        o.asyncOp = True
        return hooks.pg.allreduce([t], o).get_future().then(lambda fut: t)
    buf = hooks.buffer(bucket.index(), t)
    addr, n, core = t.data_ptr(), t.numel(), group.core
    work = group.run(True, t, lambda timeout: core.all_reduce(addr, n, code, op, timeout, buf))
    return work.get_future().then(lambda fut: t)


_uncompiled.run_uncompiled(_hook)   # called by the reducer (NOTE [ The backend runs uncompiled ])


class DistributedDataParallel(_TorchDDP):
    """torch.nn.parallel.DistributedDataParallel, with torch's arguments.
    NOTE [ DDP over shared memory ].

    NOTE [ mpcore's hook is invisible ]
    A program sees torch's DDP: mpcore's hook goes to the reducer directly,
    not through register_comm_hook, so DDP's logging data names no hook
    (`comm_hook`) and torch's list of the program's hooks stays empty
    until the program registers one; a hook torch's DDP registers itself
    while it is made (mixed precision, an optimizer in backward) keeps its
    place and mpcore's is not installed.  The program's own hook, or a
    built-in one, takes mpcore's place and is logged as torch logs it.  The
    logging data names the backend the program asked for, as
    dist.get_backend() does, with what torch's logger adds for gloo.  A
    pickled module (torch.save) is torch's class without its process group,
    reducer, logger or mpcore's hook, as torch pickles DDP: it loads where
    mpcore is not installed, and under `mpcore run` (where torch's name is
    this class) it is served again, on the default group, as torch
    reattaches that group.  torch's own DDP on a group asked for as
    "mpcore" cannot take a built-in hook (_register_builtin_comm_hook): the
    C++ hook asks the group's Work for a typed future, which a Work made in
    Python cannot give; this class serves them (the FP16 one by torch's
    Python twin of it)."""

    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self._serve()

    def _serve(self):
        """Installs mpcore's hook where the module's group is mpcore's
        (NOTE [ mpcore's hook is invisible ])."""
        self._mpcore_hooks = None
        devices = {p.device.type for p in self.module.parameters()}
        pg, group = self.process_group, None
        if (isinstance(pg, _backend.ProcessGroupMpcore) and not self._comm_hooks
                and getattr(self, "reducer", None) is not None):
            if devices == {"cpu"}:
                group = pg.shm
            elif devices == {"cuda"}:
                group = pg.cuda_group("DistributedDataParallel")
        if group is not None:
            self._mpcore_hooks = _Hooks(group, pg if devices == {"cpu"} else None)
            _torchapi.get("torch.distributed._register_comm_hook")(self.reducer, self._mpcore_hooks,
                                                                   _hook)

    def register_comm_hook(self, state, hook):
        hooks = getattr(self, "_mpcore_hooks", None)   # None while torch's __init__ runs
        if hooks is None:
            return super().register_comm_hook(state, hook)
        if hooks.user is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._check_comm_hook(hook)
        self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks.append((hook, state))
        hooks.user = (state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type):
        hooks = getattr(self, "_mpcore_hooks", None)
        if hooks is None:
            return super()._register_builtin_comm_hook(comm_hook_type)
        if hooks.user is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once.")
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            user = (self.process_group, default_hooks.fp16_compress_hook)
        elif comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
            user = (None, None)   # the bucket's average: mpcore's own hook does it
        else:
            return super()._register_builtin_comm_hook(comm_hook_type)
        self.logger._set_comm_hook_name(str(comm_hook_type))
        hooks.user = user

    def _get_ddp_logging_data(self):
        # the backend the program asked for (NOTE [ The name the group answers
        # to ] in dist/_group.py), and what torch's logger records for gloo
        data = super()._get_ddp_logging_data()
        pg = self.process_group
        if (isinstance(pg, _backend.ProcessGroupMpcore) and data.get("backend_name") == "mpcore"
                and pg._get_backend_name() == "gloo"):
            data["backend_name"] = "gloo"
            for key, env in (("gloo_socket_ifname", "GLOO_SOCKET_IFNAME"),
                             ("gloo_device_transport", "GLOO_DEVICE_TRANSPORT")):
                data.setdefault(key, os.environ.get(env, "N/A"))
            # the threads gloo's group takes by default (its options')
            data.setdefault("gloo_num_threads",
                            getattr(_torchapi.get("torch.distributed.ProcessGroupGloo._Options")(),
                                    "_threads", 2))
        return data

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_mpcore_hooks", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._serve()

    def __reduce_ex__(self, protocol):
        # Pickled as torch's class, by its name (NOTE [ mpcore's hook is
        # invisible ]): the class that name finds where it is loaded, torch's,
        # or this one under `mpcore run`.  By name, not as a class object,
        # because under `mpcore run` torch's name finds this class while
        # torch's class says it is that name, and pickle refuses such a
        # class.  A subclass of the program's own pickles as itself.
        if type(self) is not DistributedDataParallel:
            return super().__reduce_ex__(protocol)
        return copyreg._reconstructor, (_ByName(_TORCH_DDP), object, None), self.__getstate__()


_TORCH_DDP = "torch.nn.parallel.distributed.DistributedDataParallel"


class _ByName:
    """Pickles as the object a dotted name finds where it is loaded."""

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        import pydoc
        return pydoc.locate, (self.name,)
