"""Shared arrays and tensors: mpcore.empty, zeros, share_memory_, stats."""
import sys

from . import _blocks
from .. import _stats


def _is_torch_dtype(dtype):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


def empty(shape, dtype="float64"):
    """An uninitialised array in shared memory; a tensor if dtype is a
    torch.dtype."""
    if _is_torch_dtype(dtype):
        from . import _torch
        return _torch.empty(shape, dtype)
    return _blocks.empty_array(shape, dtype)


def zeros(shape, dtype="float64"):
    """A zero-filled array in shared memory; a tensor if dtype is a
    torch.dtype."""
    if _is_torch_dtype(dtype):
        from . import _torch
        return _torch.empty(shape, dtype, zero=True)
    return _blocks.empty_array(shape, dtype, zero=True)


def share_memory_(obj):
    """Moves a tensor's storage into shared memory in place and returns the
    tensor.  A numpy array cannot change its memory in place: the array is
    returned as it is if it is shared already, else a shared copy."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.share_memory_()
    import numpy as np
    if isinstance(obj, np.ndarray):
        return _blocks.share_array(obj)
    raise TypeError(f"share_memory_() takes a tensor or a numpy array, not {type(obj).__name__}")


def stats():
    """Counters of what mpcore served in this process."""
    return _stats.snapshot()
