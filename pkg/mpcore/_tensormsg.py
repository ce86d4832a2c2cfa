"""Bare tensors on a Queue as tensor records instead of pickles (NOTE
[ Tensor records ] in py_shm.c).  Imported by _torch.install(), so only
once torch is served.

NOTE [ The per-item path of a tensor ]
Queue.put of a tensor of the base class with no autograd state (what
NOTE [ What the fast path carries ] in _torch.py calls plain) moves its
storage into a block as a pickle would (_torch._move), then one core call
takes the ticket and writes the record; Queue.get hands the record to one
core call that redeems the ticket and checks the view, and builds the
tensor with one set_() over the storage of that byte range (one per range
in a process, NOTE [ Storage identity ]).  Everything else (Parameters,
tensors that require grad, subclasses, other layouts, a tensor inside a
list) takes the pickle path, with the same handle in other words.
"""
import torch

from . import _core, _queue, _torch

# Dtype codes of records: the index in this list, the same in every process
# of a program (same torch, same mpcore).
_NAMES = sorted(_torch._DTYPES)
_CODE = {_torch._DTYPES[n]: i for i, n in enumerate(_NAMES)}
_BY_CODE = {}   # code -> proto tensor, filled on first use


def message(t):
    """(refs, payload) of a tensor record for t, or None when t must be
    pickled."""
    if t.requires_grad or not _torch.fast_path(t):
        return None
    storage = t.untyped_storage()
    b, off = _torch._move(storage)
    if b is None:
        return None
    return _core.tensor_message(b, off, storage.nbytes(), _CODE[t.dtype], t.itemsize,
                                t.storage_offset(), t.size(), t.stride())


def _proto(code):
    p = _BY_CODE.get(code)
    if p is None:
        if code >= len(_NAMES):
            raise _core.HandleError(f"tensor record has a corrupt dtype code {code}")
        p = _BY_CODE[code] = _torch.proto(_NAMES[code])
    return p


def receive(refs, payload):
    """The tensor of a record, or None if the message is not one."""
    h = _core.open_tensor_message(refs, payload)
    if h is None:
        return None
    block, off, nbytes, code, storage_offset, size, stride = h
    p = _BY_CODE.get(code)
    if p is None:
        p = _proto(code)
    return p.new().set_(_torch.storage_over(block, off, nbytes), storage_offset,
                                   size, stride)


def install():
    _queue._RECORDS[torch.Tensor] = message
    _queue._receive_record = receive
