"""Bare tensors on a Queue as tensor records instead of pickles (NOTE
[ Tensor records ] in py_tensor.c).  Installed with shm/_torch.py's tensor
handles (queue/_serve.py), so only once torch is served.

NOTE [ The per-item path of a tensor ]
Queue.put of a tensor of the base class with no autograd state (what
NOTE [ What the fast path carries ] in shm/_torch.py calls plain) is one core
call, _core.tensor_record: it moves the storage into a block as a pickle
would (as _torch._move does), takes the ticket and writes the record;
Queue.get hands the record to one core call, _core.tensor_from_record, that
redeems the ticket, checks the view and makes the tensor over the one
storage of that byte range in this process (NOTE [ Storage identity ]).
Both reach torch through the objects shm/_torch.py gives _core.torch_hooks
(NOTE [ Tensor records in C ] in py_tensor.c).  Everything else (Parameters,
tensors that require grad, subclasses, other layouts, a tensor inside a
list) takes the pickle path, with the same handle in other words.
"""
import torch

from .. import _core
from ..shm import _torch  # noqa: F401  (gives the core torch's objects the records need)
from . import _queue

# message(t): (refs, payload) of a tensor record for t, or None when t must
# be pickled.
message = _core.tensor_record

# receive(refs, payload): the tensor of a record, or None if the message is
# not one.
receive = _core.tensor_from_record


def install():
    _queue.serve_records(torch.Tensor, message, receive)
