"""mpcore.distributed: torch.distributed served by mpcore's backend, which
moves CPU tensors between the ranks of one machine over shared memory.

    import mpcore.distributed as dist
    dist.init_process_group("gloo")          # env:// as torch: RANK, WORLD_SIZE, MASTER_ADDR, ...
    dist.all_reduce(t)                       # torch's own function; mpcore's backend serves it

Importing this module registers the backend "mpcore" with torch
(ProcessGroupMpcore, dist/_group.py).  The collectives here are torch's own
functions: every call reaches the backend through torch, as do functional
collectives, DTensor, FSDP and DDP.

NOTE [ Which backend a group gets ]
Through init_process_group here, and everywhere under `mpcore run`, a
group asked for with "gloo" or with no backend on a machine without an
accelerator gets "mpcore" ("cpu:gloo" in a device map too); "nccl" stays
torch's own.  "cpu:mpcore,cuda:nccl" is one group for both (NOTE [ CUDA
tensors in an mpcore group ] in dist/_collectives.py).  The one place that decides is torch's
BackendConfig, which every group's creation (init_process_group,
new_group, new_subgroups, DeviceMesh, torch's internals asking for gloo)
goes through: install() makes it translate the names it resolves, both
those asked for and the defaults it fills in from torch's
Backend.default_device_backend_map, which stays torch's ("gloo" for the
CPU).  torch still records the name the program asked for, so
dist.get_backend() says "gloo" to a program that asked for gloo (or for
the CPU's default by that map, as Lightning does), and its own tests of
that name go as under python.  A program that asked for torch's Flight
Recorder keeps gloo's groups (NOTE [ The Flight Recorder ] in
dist/_recorder.py).
"""
import datetime

import torch.distributed as _td
from torch.distributed import distributed_c10d as _c10d

from .dist import _backend, _dist, _recorder
from . import _torchapi

ReduceOp = _td.ReduceOp
_get_default_group = _torchapi.get("torch.distributed.distributed_c10d._get_default_group")

_backend.register()

_TORCH_NAMES = (
    "destroy_process_group", "is_initialized", "is_available", "get_rank", "get_world_size",
    "get_backend", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
    "all_reduce", "all_reduce_coalesced", "broadcast", "barrier",
    "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "reduce_scatter",
    "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp", "all_gather_object",
    "gather_object", "scatter_object_list", "broadcast_object_list", "send_object_list",
    "recv_object_list", "get_process_group_ranks", "get_global_rank", "get_group_rank",
    "GroupMember", "ProcessGroup", "Work",
)
for _name in _TORCH_NAMES:
    if hasattr(_c10d, _name):
        globals()[_name] = getattr(_c10d, _name)
del _name


def translate(backend):
    """The backend torch is asked for, as mpcore serves it
    (NOTE [ Which backend a group gets ])."""
    if backend is None:
        return None
    name = str(backend).lower()
    if name == "gloo":
        return "mpcore"
    if ":" in name:
        pairs = [p.split(":", 1) for p in name.split(",")]
        if all(len(p) == 2 for p in pairs):
            return ",".join(f"{d}:{'mpcore' if (d, b) == ('cpu', 'gloo') else b}"
                            for d, b in pairs)
    return backend


class _BackendConfig(_c10d.BackendConfig):
    """torch's BackendConfig, for the backend as mpcore serves it."""

    def __init__(self, backend):
        super().__init__(_td.Backend(translate(backend)))
        if self.device_backend_map.get("cpu") == "gloo":   # a default torch filled in
            self.device_backend_map["cpu"] = _td.Backend("mpcore")
        if "nccl" in self.device_backend_map.values() and not _td.is_nccl_available():
            # torch's own error: the mpcore group would otherwise stand in for NCCL
            raise RuntimeError("Distributed package doesn't have NCCL built in")


_torch_monitored_barrier = _c10d.monitored_barrier


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """torch.distributed.monitored_barrier, for mpcore's groups too.

    NOTE [ monitored_barrier ]
    torch's function refuses every group whose backend is not named "gloo"
    before it calls the group, so a program that asked for gloo and got
    mpcore would lose it.  For an mpcore group this calls the group's own
    monitored_barrier (a barrier whose timeout names the ranks that did not
    come); every other group gets torch's function.  It is the one torch
    function install() replaces."""
    pg = _get_default_group() if group is None else group
    if not isinstance(pg, _backend.ProcessGroupMpcore):
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def install():
    """Makes every group torch creates from now on get mpcore's backend
    for the CPU (NOTE [ Which backend a group gets ]), and torch's
    monitored_barrier serve it (NOTE [ monitored_barrier ]).  Idempotent.
    Where the program asked for torch's Flight Recorder, gloo's groups stay
    gloo's (NOTE [ The Flight Recorder ] in dist/_recorder.py): the backend
    is registered by its name, and nothing else changes."""
    _backend.register()
    if _recorder.leave_gloo_to_gloo() is not None:
        return
    _dist.serve_agent_store()
    if _c10d.BackendConfig is not _BackendConfig:
        _c10d.BackendConfig = _BackendConfig
    _c10d.monitored_barrier = _td.monitored_barrier = monitored_barrier


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None, **kwargs):
    """torch.distributed.init_process_group, with mpcore's backend for the
    CPU (NOTE [ Which backend a group gets ]).  For env:// and tcp://,
    every rank waits for all here, so that a timeout names the ranks that
    never came (NOTE [ Rendezvous ] in _dist.py)."""
    install()
    timeout_s = _dist.seconds(timeout) or _c10d.default_pg_timeout.total_seconds()
    if store is None:
        where = _dist.parse_init_method(init_method, rank, world_size)
        if where is not None:
            host, port, rank, world_size = where
            store = _dist.make_store(host, port, rank, world_size, timeout_s)
            _dist.wait_for_ranks(store, _dist.next_prefix(), rank, world_size, timeout_s,
                                 f"{host}:{port}")
            init_method = None
    _c10d.init_process_group(backend, init_method=init_method, timeout=timeout,
                             world_size=world_size, rank=rank, store=store,
                             group_name=group_name, pg_options=pg_options,
                             device_id=device_id, **kwargs)


def shm_group(group=None):
    """The ShmGroup of a process group served by mpcore (the default group
    when None), or None."""
    if not _td.is_initialized():
        return None
    pg = _get_default_group() if group is None else group
    return getattr(pg, "shm", None) if isinstance(pg, _backend.ProcessGroupMpcore) else None


def shm_group_active(group=None):
    """Whether collectives on the group (the default group when None) take
    the shared-memory path (mpcore's backend, every rank on this
    machine)."""
    return shm_group(group) is not None
