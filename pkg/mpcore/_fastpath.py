"""torch.distributed's send, recv, gather, scatter and all_to_all_single,
each with a fast path to the core for an mpcore group.

NOTE [ A fast path for torch's module functions ]
torch's dispatcher is the way into the backend (NOTE [ The backend is a
ProcessGroup ] in _backend.py), and these five functions are the exception,
for what measurement showed.  On one rank, with a 4 KB float32 tensor, the
core's own gather takes 1.3 us, and torch's dist.gather 12 us: its checks,
its options object, its logging wrapper and the group's method cost about
10 us, where the same ranks' all-reduce costs under 6.  dist.recv makes a
Work and waits on it, on top of the receive's 2 us.  gloo's own calls
being fast at that size (180 to 270 us), these were the rows that stayed
under 30x gloo.

So each function here first looks for the case the core serves as it
stands: the group is mpcore's (the default one when `group` is None) and
has a shared-memory region, the tensors are plain contiguous CPU tensors
(type torch.Tensor, no torch-function mode active), the call is blocking,
ranks are given as global ranks of the group, and, for point-to-point
calls, the lane that keeps their order is idle.  Then it calls the core
directly, as the group's method would, and returns what torch's function
returns.  Anything else goes to torch's function unchanged, which checks
the arguments and raises its own errors.  The result never depends on the
path: the core's call is the same one the group's method makes.  Measured
after it, on one rank: dist.gather 4.8 us; on two ranks (`mpcore bench
--only c10d-gather,...`), at 4 KB: gather 36x gloo, scatter 39x,
all_to_all_single 51x, a send/recv ping-pong 24x (7x before)."""
import functools

import torch
from torch.distributed import distributed_c10d as _c10d

from . import _backend

_TORCH = {}   # name -> torch's own function
_has_torch_function = torch._C._has_torch_function


def _group(group):
    """The mpcore group a call names (None: the default group), when it
    has a region; else None."""
    g = _c10d._world.default_pg if group is None else group
    if type(g) is _backend.ProcessGroupMpcore and g.shm is not None and g._batch is None:
        return g
    return None


def _plain(t):
    return type(t) is torch.Tensor and t.is_cpu and t.is_contiguous()


def _fast(name):
    def wrap(fn):
        torch_fn = getattr(_c10d, name)

        @functools.wraps(torch_fn)
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            return _TORCH[name](*args, **kwargs) if out is _SLOW else out
        call._mpcore_fast = True
        _TORCH[name] = torch_fn
        return call
    return wrap


_SLOW = object()   # "torch's function serves this call"


def _peer(tensor, rank, group, group_rank):
    """(group, the peer's group rank) of a send or receive the core
    serves; None else."""
    g = _group(group)
    if g is None or group_rank is not None or not _plain(tensor) or _has_torch_function((tensor,)):
        return None
    peer = g._group_ranks.get(rank)
    return None if peer is None or peer == g._rank else (g, peer)


@_fast("send")
def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    call = _peer(tensor, dst, group, group_dst)
    if call is None:
        return _SLOW
    g, peer = call
    return None if g._send_now(tensor, peer, tag) else _SLOW


@_fast("recv")
def recv(tensor, src=None, group=None, tag=0, group_src=None):
    call = _peer(tensor, src, group, group_src)
    if call is None:
        return _SLOW
    g, peer = call
    shm = g.shm
    got = shm._lane("mpcore-recv").run_if_idle(shm.core.recv, tensor.data_ptr(), tensor.nbytes,
                                               peer, tag, shm.timeout)
    return _SLOW if got is None else src


def _rooted(tensor, tensors, rank, group, async_op, group_rank):
    """(group, root's group rank, addresses of the root's list: 0 off the
    root) of a blocking gather or scatter the core serves; None else."""
    g = _group(group)
    if (g is None or async_op or group_rank is not None or not _plain(tensor)
            or _has_torch_function((tensor,))):
        return None
    root = g._group_ranks.get(0 if rank is None else rank)
    if root is None:
        return None
    mine = _backend._plain_list([tensors] if tensors else [], tensor,
                                g._world if g._rank == root else 0)
    if mine is None:
        return None
    return g, root, [t.data_ptr() for t in mine] if mine else 0


@_fast("gather")
def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    call = _rooted(tensor, gather_list, dst, group, async_op, group_dst)
    if call is None:
        return _SLOW
    g, root, outs = call
    g.shm.run(False, None, g.shm.core.gather, outs, tensor.data_ptr(), tensor.nbytes, root)
    return None


@_fast("scatter")
def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    call = _rooted(tensor, scatter_list, src, group, async_op, group_src)
    if call is None:
        return _SLOW
    g, root, ins = call
    g.shm.run(False, None, g.shm.core.scatter, tensor.data_ptr(), ins, tensor.nbytes, root)
    return None


@_fast("all_to_all_single")
def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    g = _group(group)
    if (g is None or async_op or not _plain(output) or not _plain(input)
            or output.dtype != input.dtype or _has_torch_function((output, input))
            or not isinstance(output_split_sizes, (list, tuple, type(None)))
            or not isinstance(input_split_sizes, (list, tuple, type(None)))):
        return _SLOW
    send = g._splits("input", input, input_split_sizes or ())
    recv = g._splits("output", output, output_split_sizes or ())
    g.shm.run(False, None, g.shm.core.all_to_all, output.data_ptr(), input.data_ptr(), send,
              recv)
    return None


def install():
    """Puts the functions above in torch.distributed's place (once)."""
    import torch.distributed as dist
    for fn in (send, recv, gather, scatter, all_to_all_single):
        name = fn.__name__
        if not getattr(getattr(_c10d, name), "_mpcore_fast", False):
            setattr(_c10d, name, fn)
            setattr(dist, name, fn)
