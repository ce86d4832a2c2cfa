"""torch's tensors and storages in mpcore's shared memory.

Imported only once torch itself is (see _boot.py); the core never knows
about torch.

NOTE [ Moving a storage in place ]
torch's `share_memory_()` moves a storage into shared memory in place, so
that every tensor and view over it follows.  We do the same: the bytes are
copied into an mpcore block, a storage is made over the block (through
numpy, whose array keeps the Block alive), and `_swap_data_ptr_` swaps the
two storages' memory.  The user's storage object now points into the block;
the temporary one takes the old memory away with it.
torch before 2.13 has no `_swap_data_ptr_` and no other way, from Python,
to change a storage's memory under the tensors that share it (torch's own
`share_memory_` does it in C++, into torch's own shared memory, and
`torch.utils.swap_tensors` swaps two tensors, not what their views see).
There the move is not served ("in-place moves" in _torchapi.py):
share_memory_() is torch's own, and a tensor not yet in mpcore memory is
pickled by torch's reductions; tensors made in mpcore memory (mpcore.empty,
a DataLoader's batches, tensors received) still travel as handles.

NOTE [ Storage identity ]
A block (or a byte range of one) arriving twice in one process must give
one storage, so that tensors sent separately still share memory, as under
torch.  `_storages` maps (handle, offset, nbytes) to a weak reference of the
storage made for it; the storage a process moved into a block itself is
recorded too, so a tensor that comes back arrives as the original storage.
"""
import torch
from multiprocessing.reduction import ForkingPickler
from torch.multiprocessing import reductions as _torch_reductions

from .. import _core, _stats, _torchapi
from . import _blocks

_storages = {}  # (handle, offset, nbytes) -> torch's weak reference (an int)
_orig = {}

# Handles name dtypes and classes by small values: pickling torch.float32
# or torch.Tensor themselves costs more than the rest of a handle.
_DTYPES = {str(d).split(".")[1]: d for d in vars(torch).values() if isinstance(d, torch.dtype)}
DTYPE_NAME = {d: n for n, d in _DTYPES.items()}  # dtype -> its name in handles
# One empty tensor per dtype: .new() of it is the cheapest way to get a
# fresh tensor to set_() onto a storage.
_PROTO = {}


def _storage_block(storage):
    """(Block, offset) if the CPU storage's memory is an mpcore block."""
    n = storage.nbytes()
    if n == 0 or storage.device.type != "cpu":
        return None, 0
    return _blocks.find(storage.data_ptr(), n)


# storage_over(block, offset, nbytes): the storage over bytes [offset,
# offset + nbytes) of a block, one per byte range in a process (NOTE
# [ Storage identity ]; its entry goes with the block: NOTE [ Storage entries
# go with their block ] in py_tensor.c).
storage_over = _core.storage_over


def share_storage_(storage):
    """Moves a CPU storage into an mpcore block in place (no-op if there)."""
    if storage.device.type != "cpu" or not _MOVES:
        return _orig["share_memory_"](storage)
    _move(storage)
    return storage


def _move(storage):
    """(Block, offset) of a CPU storage after moving it into mpcore memory;
    (None, 0) for an empty storage, or one outside mpcore memory where
    moves are not served (NOTE [ Moving a storage in place ])."""
    n = storage.nbytes()
    if n == 0:
        return None, 0
    b, off = _blocks.find(storage.data_ptr(), n)
    if b is not None or not _MOVES:
        return b, off
    return _core.move_storage(storage), 0


def _share_memory_(self):
    return share_storage_(self)


def _is_shared(self):
    if self.device.type == "cpu" and _storage_block(self)[0] is not None:
        return True
    return _orig["is_shared"](self)


# --- pickling -------------------------------------------------------------

def _rebuild_storage(ref, offset, nbytes):
    return storage_over(_blocks.attach(ref), offset, nbytes)


def reduce_storage(storage):
    if storage.device.type != "cpu":
        return _torch_reductions.reduce_storage(storage)
    if storage.nbytes() == 0:
        return (torch.UntypedStorage, (0,))
    b, off = _move(storage)
    if b is None:
        return _torch_reductions.reduce_storage(storage)
    return (_rebuild_storage, (_blocks.ticket(b), off, storage.nbytes()))


_itemsize = {}


def proto(dtype):
    """The empty tensor of a dtype named as handles name it."""
    p = _PROTO.get(dtype)
    if p is None:
        if type(dtype) is not str or dtype not in _DTYPES:
            raise _blocks.HandleError("handle has a corrupt dtype")
        p = _PROTO[dtype] = torch.empty((0,), dtype=_DTYPES[dtype])
    return p


def _rebuild_tensor(param, ref, offset, nbytes, dtype, storage_offset, size, stride,
                    requires_grad):
    block = _blocks.attach(ref)
    p = proto(dtype)
    itemsize = p.itemsize
    # Check the view against the storage's bytes before torch sees it: a
    # forged handle gets HandleError, never an out-of-bounds view.
    if offset < 0 or nbytes < 0 or offset + nbytes > block.nbytes:
        raise _blocks.HandleError(f"handle names bytes [{offset}, {offset + nbytes}) of a "
                               f"{block.nbytes}-byte block: out of bounds")
    block.check_view(itemsize, size, stride, offset + storage_offset * itemsize, offset,
                     offset + nbytes, itemsize)
    t = p.new().set_(storage_over(block, offset, nbytes), storage_offset, size, stride)
    if param:
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad = True
    return t


# NOTE [ What the fast path carries ]
# A handle carries a storage's bytes and one strided view of them (dtype,
# offset, size, stride, requires_grad, and whether it is a Parameter).  That
# is exactly a tensor of the base class (or Parameter) whose dispatch keys
# are those of a plain dense CPU tensor (with or without autograd's keys: an
# inference tensor is plain too).  Anything else takes torch's own
# reduction, whatever it is: nested tensors (their strided layout says
# nothing of their buffer), sparse, quantized, meta, mkldnn, conjugate or
# negative views (their bit would be lost), zero tensors, and subclasses
# (DTensor, ...).  Deciding by a positive test, rather than by a list of
# what to exclude, keeps a kind of tensor torch adds later off the fast path.
PLAIN_TYPES = (torch.Tensor, torch.nn.parameter.Parameter)
_dispatch_keys = _torchapi.get("torch._C._dispatch_keys")


def _plain_keys():
    with torch.inference_mode():
        inference = torch.empty(0)
    return (_dispatch_keys(torch.empty(0)), _dispatch_keys(inference))


_PLAIN_KEYS = _plain_keys()


def fast_path(tensor):
    """Whether a handle represents this tensor exactly (NOTE [ What the fast
    path carries ])."""
    return type(tensor) in PLAIN_TYPES and _dispatch_keys(tensor) in _PLAIN_KEYS


def reduce_tensor(tensor):
    if not fast_path(tensor):
        return _torch_reductions.reduce_tensor(tensor)
    cls = type(tensor)
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, "
            "since autograd does not support crossing process boundaries.  "
            "If you just want to transfer the data, call detach() on the tensor "
            "before serializing (e.g., putting it on the queue).")
    storage = tensor.untyped_storage()
    b, off = _move(storage)
    if b is None:
        return _torch_reductions.reduce_tensor(tensor)
    return (_rebuild_tensor,
            (cls is not torch.Tensor, _blocks.ticket(b), off, storage.nbytes(),
             DTYPE_NAME[tensor.dtype], tensor.storage_offset(), tuple(tensor.size()),
             tuple(tensor.stride()), tensor.requires_grad))


_installed = False
_orig["share_memory_"] = torch.UntypedStorage.share_memory_
_orig["is_shared"] = torch.UntypedStorage.is_shared
# The move's swap (None where torch lacks it) and whether moves are served:
# read once, here (NOTE [ Moving a storage in place ]).
_SWAP = (_torchapi.get("torch.UntypedStorage._swap_data_ptr_")
         if _torchapi.serves("in-place moves") else None)
_MOVES = _SWAP is not None


def install():
    """Serves torch's tensor sharing from mpcore memory (idempotent); the
    caller has checked that "tensor handles" is served."""
    global _installed
    if _installed:
        return
    _installed = True
    _torchapi.replace("torch.UntypedStorage.is_shared", _is_shared)
    if _MOVES:
        _torchapi.replace("torch.UntypedStorage.share_memory_", _share_memory_)
    ForkingPickler.register(torch.UntypedStorage, reduce_storage)
    for t in (list(_torchapi.get("torch._tensor_classes"))
              + [torch.Tensor, torch.nn.parameter.Parameter]):
        ForkingPickler.register(t, reduce_tensor)
    _torchapi.mark("multiprocessing.reduction.ForkingPickler[torch tensors and storages]",
                   "replaced")


def empty(shape, dtype, zero=False):
    """A tensor in mpcore shared memory."""
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    itemsize = dtype.itemsize
    numel = 1
    for s in shape:
        if s < 0:
            raise ValueError(f"negative dimension {s} in shape {shape}")
        numel *= s
    n = numel * itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    b = _blocks.alloc(n, zero=zero)
    storage = storage_over(b, 0, n)
    return torch.empty((0,), dtype=dtype).set_(storage, 0, shape)


# --- torch's objects for the core (NOTE [ Tensor records in C ] in py_tensor.c) ---
# Given to _core.torch_hooks last, since they are this module's names: the
# core's storage_over, its moves and its tensor records (queue/_records.py)
# need them.  Dtype codes of records: the index in this list, the same in
# every process of a program (same torch, same mpcore).
_NAMES = sorted(_DTYPES)
CODES = {_DTYPES[n]: i for i, n in enumerate(_NAMES)}
_BY_CODE = {}   # code -> proto tensor, filled on first use


def _proto(code):
    p = _BY_CODE.get(code)
    if p is None:
        if code >= len(_NAMES):
            raise _core.HandleError(f"tensor record has a corrupt dtype code {code}")
        p = _BY_CODE[code] = proto(_NAMES[code])
    return p


def _from_numpy_dtypes():
    """code -> the numpy dtype that torch.from_numpy turns into that code's
    dtype, or None (bfloat16, float8, ...): the one-step path of NOTE
    [ Tensor records in C ] is taken only where this round trip holds."""
    import numpy as np
    out = [None] * len(_NAMES)
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
                 "uint64", "float16", "float32", "float64", "complex64", "complex128"):
        nd = np.dtype(name)
        try:
            d = torch.from_numpy(np.empty(1, nd)).dtype
        except TypeError:   # a numpy dtype this torch cannot take
            continue
        if d in CODES and d.itemsize == nd.itemsize:
            out[CODES[d]] = nd
    return tuple(out)


# torch's private objects come through the table (_torchapi.py); _SWAP
# is None where moves in place are not served (NOTE [ Moving a storage in
# place ] above).
_core.torch_hooks(torch.Tensor, _dispatch_keys, _PLAIN_KEYS,
                  {d: (c, d.itemsize) for d, c in CODES.items()}, _from_numpy_dtypes(), _proto,
                  torch.from_numpy, _storages,
                  _torchapi.get("torch.UntypedStorage._new_with_weak_ptr"),
                  _torchapi.get("torch.UntypedStorage._free_weak_ref"),
                  _torchapi.get("torch.UntypedStorage._expired"),
                  _stats.counts, _SWAP)
