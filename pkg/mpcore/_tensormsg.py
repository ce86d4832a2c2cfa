"""Bare tensors on a Queue as tensor records instead of pickles (NOTE
[ Tensor records ] in py_shm.c).  Imported by _torch.install(), so only
once torch is served.

NOTE [ The per-item path of a tensor ]
Queue.put of a tensor of the base class with no autograd state (what
NOTE [ What the fast path carries ] in _torch.py calls plain) is one core
call, _core.tensor_record: it moves the storage into a block as a pickle
would (as _torch._move does), takes the ticket and writes the record;
Queue.get hands the record to one core call, _core.tensor_from_record, that
redeems the ticket, checks the view and makes the tensor over the one
storage of that byte range in this process (NOTE [ Storage identity ]).
Both reach torch through the objects given to _core.torch_hooks below
(NOTE [ Tensor records in C ] in py_shm.c).  Everything else (Parameters,
tensors that require grad, subclasses, other layouts, a tensor inside a
list) takes the pickle path, with the same handle in other words.
"""
import torch

from . import _core, _queue, _stats, _torch, _torchapi

# Dtype codes of records: the index in this list, the same in every process
# of a program (same torch, same mpcore).
_NAMES = sorted(_torch._DTYPES)
_CODE = {_torch._DTYPES[n]: i for i, n in enumerate(_NAMES)}
_BY_CODE = {}   # code -> proto tensor, filled on first use


# message(t): (refs, payload) of a tensor record for t, or None when t must
# be pickled.
message = _core.tensor_record


def _proto(code):
    p = _BY_CODE.get(code)
    if p is None:
        if code >= len(_NAMES):
            raise _core.HandleError(f"tensor record has a corrupt dtype code {code}")
        p = _BY_CODE[code] = _torch.proto(_NAMES[code])
    return p


# receive(refs, payload): the tensor of a record, or None if the message is
# not one.
receive = _core.tensor_from_record


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
        if d in _CODE and d.itemsize == nd.itemsize:
            out[_CODE[d]] = nd
    return tuple(out)


# torch's private objects come through the table (_torchapi.py); _torch._SWAP
# is None where moves in place are not served (NOTE [ Moving a storage in
# place ] in _torch.py).
_core.torch_hooks(torch.Tensor, _torch._dispatch_keys, _torch._PLAIN_KEYS,
                  {d: (c, d.itemsize) for d, c in _CODE.items()}, _from_numpy_dtypes(), _proto,
                  torch.from_numpy, _torch._storages,
                  _torchapi.get("torch.UntypedStorage._new_with_weak_ptr"),
                  _torchapi.get("torch.UntypedStorage._free_weak_ref"),
                  _torchapi.get("torch.UntypedStorage._expired"),
                  _stats._counts, _torch._SWAP)


def install():
    _queue._RECORDS[torch.Tensor] = message
    _queue._receive_record = receive
