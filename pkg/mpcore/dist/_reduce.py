"""What the core reduces, and what is left to torch: the tables of dtypes
and ops the core serves, read from the core's own (COLL_DTYPES, COLL_OPS),
the checks of an op that no path serves, and the reduction in torch of
what the core does not reduce.

NOTE [ What the core cannot serve ]
- Ranks on several machines: the group has no region (ShmGroup is None),
  and a HierGroup (_hier.py, NOTE [ Hierarchical groups ]) serves every
  call: shared memory inside each host, gloo among the hosts' leaders, and
  a flat gloo ProcessGroup on the same store for the rest.  It is
  made eagerly, in the creator, because it is then the group's only
  transport, and because gloo's connect is collective over all ranks of
  the group: made on first need, a need that only some ranks reach (a
  send, a wrong call) would hang in connect instead of failing.  Whether
  there is a region depends only on the hosts the ranks published in the
  store, so every rank makes the same choice.
- A reduction the core lacks for a dtype (float8, complex, a dtype the
  core does not know): on one machine this is not sent to
  gloo, which lacks the same dtypes, but done by the core's all-gather of
  the raw bytes followed by a reduction in torch, in rank order, the same
  code on every rank, so every rank gets the same bits.  The choice depends
  only on the dtype and op, which the ranks share (ranks that disagree are
  told so by the core, which compares what each asked for).
- PREMUL_SUM (an NCCL-only op) is refused with a clear error, as gloo
  does, and so is AVG of integers (as the core: no rounding rule to pick).
"""
import functools

import torch
from torch.distributed import ReduceOp

from .. import _core

RED = ReduceOp.RedOpType


def _tables():
    """(torch dtype -> core code, RedOpType -> core code) of what this core
    reduces (NOTE [ What the core cannot serve ])."""
    dtypes = {getattr(torch, n): c for n, c in _core.COLL_DTYPES.items() if hasattr(torch, n)}
    return dtypes, {getattr(RED, n): c for n, c in _core.COLL_OPS.items()}


DTYPES, OPS = _tables()
# What the core reduces itself, from the core's own table (COLL_REDUCES:
# (dtype name, op name) -> (dtype code, op code) of every pair it reduces),
# as torch dtype -> (dtype code, op code) or None for each RedOpType by its
# value (hashing a pybind enum costs more than indexing); core_codes() reads
# it by (dtype, op).
_CORE = {(getattr(torch, d), getattr(RED, o)): tuple(codes)
         for (d, o), codes in _core.COLL_REDUCES.items() if hasattr(torch, d)}
CORE_ROWS = {dt: tuple(_CORE.get((dt, r)) for r in sorted(RED.__members__.values(),
                                                       key=lambda r: r.value))
             for dt in DTYPES}
del _CORE
assert all(r.value == i for i, r in enumerate(sorted(RED.__members__.values(),
                                                     key=lambda r: r.value)))


def core_codes(dtype, red):
    """(dtype code, op code) when the core reduces dtype by red (a
    RedOpType) itself, else None."""
    row = CORE_ROWS.get(dtype)
    return None if row is None else row[red.value]


FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
BITWISE = (RED.BAND, RED.BOR, RED.BXOR)


def op_name(op):
    return getattr(op, "name", str(op))


def check_op(what, red, tensors):
    """A clear error, before anyone waits, for an op no path serves: gloo's
    type and text, then what was wrong (NOTE [ Reductions gloo refuses ])."""
    if red == RED.PREMUL_SUM:
        raise RuntimeError(f"Cannot use ReduceOp.PREMUL_SUM with Gloo (mpcore: {what}: an NCCL "
                           "op; scale the tensor and use SUM)")
    for t in tensors:
        if red == RED.AVG and not (t.is_floating_point() or t.is_complex()):
            try:
                torch.empty(1, dtype=t.dtype).div_(1)   # torch's cast error, as gloo's
            except RuntimeError as e:
                said = str(e)
            else:
                said = "AVG"
            raise RuntimeError(f"{said} (mpcore: {what} with avg needs a floating-point dtype, "
                               f"not {t.dtype})")
        if red in BITWISE and (t.is_floating_point() or t.is_complex()):
            raise RuntimeError(f"Cannot use ReduceOp.{op_name(red)} with non-integral dtype "
                               f"(mpcore: {what} of {t.dtype})")


# NOTE [ Reductions gloo refuses ]
# PREMUL_SUM (an NCCL op), BAND/BOR/BXOR of floating or complex tensors and
# AVG of integer or bool tensors fail on gloo's groups with a RuntimeError
# (for AVG, torch's own cast error from dividing the sum in place, which
# names neither the op nor the call).  mpcore raises the same type, its
# text beginning with gloo's (a program's `except RuntimeError` and torch's
# tests' regexes see no difference) and then naming the call, the op and
# the dtype; blocking at the call, and for async_op at the Work's wait, as
# gloo does.


def reduce_stack(stack, red, world):
    """The reduction over dim 0 of stack (world, ...) by `red` (RedOpType),
    in rank order, as the same code on every rank
    (NOTE [ What the core cannot serve ])."""
    dt = stack.dtype
    if dt == torch.bool:
        x = stack.to(torch.uint8)
        fns = {RED.SUM: torch.bitwise_or, RED.MAX: torch.bitwise_or, RED.BOR: torch.bitwise_or,
               RED.PRODUCT: torch.bitwise_and, RED.MIN: torch.bitwise_and,
               RED.BAND: torch.bitwise_and, RED.BXOR: torch.bitwise_xor}
    else:
        if dt.is_floating_point:
            cd = torch.float64 if dt == torch.float64 else torch.float32
        elif dt.is_complex:
            cd = torch.complex128 if dt == torch.complex128 else torch.complex64
        else:
            cd = torch.int64
        x = stack.to(cd) if dt != torch.uint64 else stack.view(torch.int64)
        fns = {RED.SUM: torch.add, RED.AVG: torch.add, RED.PRODUCT: torch.mul,
               RED.MIN: torch.minimum, RED.MAX: torch.maximum}
        if not (dt.is_floating_point or dt.is_complex):
            fns.update({RED.BAND: torch.bitwise_and, RED.BOR: torch.bitwise_or,
                        RED.BXOR: torch.bitwise_xor})
    fn = fns.get(red)
    if fn is None:
        raise ValueError(f"mpcore: reduction {op_name(red)} is not defined for {dt}")
    acc = functools.reduce(fn, x.unbind(0))
    if red == RED.AVG:
        acc = acc / world
    if dt == torch.uint64:
        return acc.view(torch.uint64)
    return acc.to(dt)
