"""mpcore as a torch.distributed backend: the backend registered under the
name "mpcore", whose creator makes a group's ProcessGroupMpcore (_group.py),
and what it changes in torch for its groups (_set_pg_timeout, split_group,
asyncOp before torch 2.7); it serves every collective of every group that
torch routes to it (dist.*, functional collectives, DTensor, FSDP, DDP,
...).  The group's parts: its collectives (_collectives.py), what the core
reduces (_reduce.py), group buffers (_buffers.py), the Work types
(_work.py), the profiler's events (_profile.py), the arguments' checks
(_args.py); what runs uncompiled under torch.compile (_uncompiled.py).
"""
import hashlib
import sys

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from .. import _torchapi
from .._torchapi import C10D
from . import _dist
from ._collectives import Collectives
from ._group import ProcessGroupMpcore
from ._uncompiled import run_uncompiled
from ._work import AllOf, Done, Work


def create(store, rank, world, timeout):
    """The backend's creator: a group's ProcessGroupMpcore, with its own
    shared-memory region named in the group's store."""
    timeout_s = _dist.seconds(timeout)
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
        pg.group_ranks = {r: i for i, r in enumerate(ranks)}
        if pg.shm is not None:
            pg.shm.core.set_labels(ranks)
    return pg


def _set_pg_timeout(timeout, group=None):
    """torch's _set_pg_timeout, which reaches our group too (NOTE [ The
    group is its own backend ])."""
    pg = group
    if pg is None and _c10d.is_initialized():
        pg = _torchapi.get(f"{C10D}._get_default_group")()
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
        parent = _torchapi.get(f"{C10D}._get_default_group")()
    if not isinstance(parent, ProcessGroupMpcore):
        return _torch_split_group(parent_pg, split_ranks, timeout, pg_options, group_desc,
                                  backend)
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    world = _torchapi.get(f"{C10D}._world")
    to_group = world.pg_group_ranks.get(parent)
    if to_group is None:
        raise ValueError(f"Group {parent} is not registered")
    me = to_group.get(_c10d.get_rank())
    if me is None:
        raise ValueError(f"Global rank {_c10d.get_rank()} is not part of the parent group {parent}")
    to_global = {g: r for r, g in to_group.items()}
    parent.split_count += 1
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
    key = f"{parent.group_name}/split{parent.split_count}/{ranks}"
    name = hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()
    with _torchapi.swapped(f"{C10D}._process_group_name", lambda ranks, use_hashed_name: name):
        return _c10d.new_group(ranks, timeout=timeout,
                               backend=backend or world.pg_map[parent][0],
                               pg_options=pg_options, use_local_synchronization=True,
                               group_desc=group_desc)


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
        run_uncompiled(ProcessGroupMpcore, Collectives, Work, _dist.Work, Done, AllOf,
                       _create_extended)
    if _torch_set_pg_timeout is None:
        _torch_set_pg_timeout = _torchapi.replace(f"{C10D}._set_pg_timeout", _set_pg_timeout,
                                                  wraps=True)
    if _torch_split_group is None:   # NOTE [ Splitting a group ]
        _torch_split_group = _torchapi.replace(f"{C10D}.split_group", _split_group, wraps=True)
        if _torch_split_group is not None:
            _torchapi.replace("torch.distributed.split_group", _split_group)
            mesh = sys.modules.get("torch.distributed.device_mesh")
            if getattr(mesh, "split_group", None) is _torch_split_group:
                _torchapi.replace("torch.distributed.device_mesh.split_group", _split_group)
    from . import _fastpath
    _fastpath.install()   # NOTE [ A fast path for torch's module functions ]
