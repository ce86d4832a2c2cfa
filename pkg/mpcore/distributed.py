"""mpcore.distributed: torch.distributed's process group, with collectives
between the ranks of one machine over shared memory.

    import mpcore.distributed as dist
    dist.init_process_group("gloo")          # env:// as torch: RANK, WORLD_SIZE, MASTER_ADDR, ...
    dist.all_reduce(t)                       # CPU tensors: shared memory; others: torch's backend

Under `mpcore run`, torch.distributed's functions of the same names are
these.  NOTE [ Two groups in one ] in _dist.py says which path serves what.
"""
import torch
import torch.distributed as _td
from torch.distributed import distributed_c10d as _c10d

from . import _dist, _nccl

ReduceOp = _td.ReduceOp
_orig = {}
_state = {"group": None, "nccl": None}


def _torch(name):
    """torch.distributed's own function of that name (never ours)."""
    return _orig.get(name) or getattr(_c10d, name)


_DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
           torch.int32: 4, torch.int64: 5, torch.uint8: 6}
_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


def _opcode(op):
    for code, name in enumerate(_OPS):
        if op == getattr(ReduceOp, name):
            return code
    return None


def _default(group):
    return (group is None or group is _c10d.GroupMember.WORLD
            or group is _c10d._get_default_group())


def _fast(group, *tensors):
    """The shared-memory group, if it can serve these tensors on `group`."""
    g = _state["group"]
    if g is None or not _default(group):
        return None
    for t in tensors:
        if (t.device.type != "cpu" or t.dtype not in _DTYPES or not t.is_contiguous()
                or t.layout != torch.strided):
            return None
    return g


def _cuda(group, *tensors):
    """mpcore's NCCL communicator, if it can serve these tensors on `group`."""
    g = _state["nccl"]
    if g is None or not _default(group):
        return None
    for t in tensors:
        if t.device.type != "cuda" or t.dtype not in _DTYPES or not t.is_contiguous():
            return None
    return g


def _done(async_op, tensors):
    """What a collective enqueued on the current stream returns."""
    if not async_op:
        return None
    w = _dist.Work(tensors)
    w._finish()
    return w


# --- the group ----------------------------------------------------------------

def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None, **kwargs):
    """torch.distributed.init_process_group, and mpcore's shared-memory group
    beside torch's when every rank is on this machine."""
    timeout_s = _dist._seconds(timeout) or _c10d.default_pg_timeout.total_seconds()
    prefix = _dist.next_prefix()
    if store is None:
        where = _dist.parse_init_method(init_method, rank, world_size)
        if where is not None:
            host, port, rank, world_size = where
            store = _dist.make_store(host, port, rank, world_size, timeout_s)
            _dist.wait_for_ranks(store, prefix, rank, world_size, timeout_s, f"{host}:{port}")
            init_method = None
    _torch("init_process_group")(backend, init_method=init_method, timeout=timeout,
                                 world_size=world_size, rank=rank, store=store,
                                 group_name=group_name, pg_options=pg_options,
                                 device_id=device_id, **kwargs)
    if store is None:
        store = _c10d._get_default_store()
    rank, world = _td.get_rank(), _td.get_world_size()
    _state["group"] = _dist.join(store, prefix, rank, world, timeout_s)
    if backend is not None and "nccl" in str(backend).lower():
        _state["nccl"] = _nccl.NcclGroup.create(store, rank, world, prefix)


def destroy_process_group(group=None):
    if group is None or group is _c10d.GroupMember.WORLD:
        for key in ("group", "nccl"):
            g, _state[key] = _state[key], None
            if g is not None:
                g.close()
    return _torch("destroy_process_group")(group)


def is_initialized():
    return _td.is_initialized()


def is_available():
    return _td.is_available()


def get_rank(group=None):
    return _td.get_rank(group)


def get_world_size(group=None):
    return _td.get_world_size(group)


def shm_group_active():
    """Whether collectives on the default group can take the shared-memory
    path (every rank on this machine)."""
    return _state["group"] is not None


# --- collectives ----------------------------------------------------------------

def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    n = _cuda(group, tensor)
    if n is not None and _opcode(op) is not None:
        n.all_reduce(tensor, _DTYPES[tensor.dtype], _opcode(op))
        return _done(async_op, [tensor])
    g = _fast(group, tensor)
    code = _opcode(op) if g is not None else None
    if code is None:
        return _torch("all_reduce")(tensor, op, group, async_op)
    return g.run(async_op, [tensor], g.core.all_reduce, tensor.data_ptr(), tensor.numel(),
                 _DTYPES[tensor.dtype], code)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    root = src if src is not None else group_src
    n = _cuda(group, tensor)
    if n is not None and root is not None:
        n.broadcast(tensor, root)
        return _done(async_op, [tensor])
    g = _fast(group, tensor)
    if g is None or root is None:
        return _torch("broadcast")(tensor, src, group, async_op, group_src)
    return g.run(async_op, [tensor], g.core.broadcast, tensor.data_ptr(),
                 tensor.numel() * tensor.element_size(), root)


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    g = _fast(group)
    if g is None or device_ids is not None:
        return _torch("barrier")(group, async_op, device_ids, timeout)
    if timeout is not None and not async_op:
        g.drain()
        g.core.barrier(_dist._seconds(timeout))
        return None
    return g.run(async_op, [], g.core.barrier)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    n = _cuda(group, output_tensor, input_tensor)
    if (n is not None and output_tensor.dtype == input_tensor.dtype
            and output_tensor.numel() == input_tensor.numel() * n.world):
        n.all_gather(output_tensor, input_tensor)
        return _done(async_op, [output_tensor])
    g = _fast(group, output_tensor, input_tensor)
    if (g is None or output_tensor.dtype != input_tensor.dtype
            or output_tensor.numel() != input_tensor.numel() * g.world):
        return _torch("all_gather_into_tensor")(output_tensor, input_tensor, group, async_op)
    return g.run(async_op, [output_tensor], g.core.all_gather, output_tensor.data_ptr(),
                 input_tensor.data_ptr(), input_tensor.numel() * input_tensor.element_size(),
                 keep=(input_tensor,))


def all_gather(tensor_list, tensor, group=None, async_op=False):
    n = _cuda(group, tensor)
    if (n is not None and len(tensor_list) == n.world
            and all(t.shape == tensor.shape and t.dtype == tensor.dtype for t in tensor_list)):
        flat = torch.empty((n.world,) + tuple(tensor.shape), dtype=tensor.dtype,
                           device=tensor.device)
        n.all_gather(flat, tensor.contiguous())
        for i, t in enumerate(tensor_list):
            t.copy_(flat[i])
        return _done(async_op, tensor_list)
    g = _fast(group, tensor)
    if (g is None or len(tensor_list) != g.world
            or any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list)):
        return _torch("all_gather")(tensor_list, tensor, group, async_op)
    flat = torch.empty((g.world,) + tuple(tensor.shape), dtype=tensor.dtype)
    src = tensor.contiguous()
    nbytes = src.numel() * src.element_size()

    def gather(out, inp, n, timeout):
        g.core.all_gather(out, inp, n, timeout)
        for i, t in enumerate(tensor_list):
            t.copy_(flat[i])

    return g.run(async_op, tensor_list, gather, flat.data_ptr(), src.data_ptr(), nbytes,
                 keep=(flat, src))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    g = _fast(group, output, input)
    code = _opcode(op) if g is not None else None
    if (code is None or output.dtype != input.dtype
            or input.numel() != output.numel() * g.world):
        return _torch("reduce_scatter_tensor")(output, input, op, group, async_op)
    return g.run(async_op, [output], g.core.reduce_scatter, output.data_ptr(), input.data_ptr(),
                 output.numel(), _DTYPES[output.dtype], code, keep=(input,))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    g = _fast(group, output, *input_list)
    code = _opcode(op) if g is not None else None
    if (code is None or len(input_list) != g.world
            or any(t.shape != output.shape or t.dtype != output.dtype for t in input_list)):
        return _torch("reduce_scatter")(output, input_list, op, group, async_op)
    flat = torch.stack(input_list)
    return g.run(async_op, [output], g.core.reduce_scatter, output.data_ptr(), flat.data_ptr(),
                 output.numel(), _DTYPES[output.dtype], code, keep=(flat,))


_PATCHED = ("init_process_group", "destroy_process_group", "all_reduce", "broadcast", "barrier",
            "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")


def _serve_torch():
    """Makes torch.distributed's functions these (under `mpcore run`)."""
    for name in _PATCHED:
        if name not in _orig:
            _orig[name] = getattr(_c10d, name)
        setattr(_td, name, globals()[name])
        setattr(_c10d, name, globals()[name])
