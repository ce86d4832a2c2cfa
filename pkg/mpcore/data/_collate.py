"""Both ends of collation into shared memory: the worker's hooks for
_core.collate (NOTE [ Collating into a block ] in py_collate.c) and the
main process's rebuild of a batch over the block, without a copy."""
from .. import _core
from . import _compat

torch = _compat.torch

if torch is not None:
    from ..shm import _torch

    _DTYPE_NAME = _torch.DTYPE_NAME
    _fast_path = _torch.fast_path
    _proto = _torch.proto

    def _storage(block):
        # every leaf of a batch is a view of its block's one storage
        return _torch.storage_over(block, 0, block.nbytes)

    def _tensor_info(t):
        # Only what a block holds exactly (NOTE [ What the fast path
        # carries ] in _torch.py); anything else goes to torch's collate.
        if not _fast_path(t):
            return None
        return (t.nbytes, _DTYPE_NAME[t.dtype], tuple(t.shape))

    class _Stacker:
        """tensor_stack for one batch: the block's storage is made once."""

        __slots__ = ("block", "storage")

        def __init__(self):
            self.block = self.storage = None

        def __call__(self, column, block, offset, dtype, shape):
            if block is not self.block:
                self.block, self.storage = block, _storage(block)
            p = _proto(dtype)
            out = p.new().set_(self.storage, offset // p.itemsize, shape)
            torch.stack(column, out=out)

    def into_block(samples):
        stack = _Stacker()
        try:
            return _core.collate(samples, torch.Tensor, _tensor_info, stack)
        finally:
            stack.block = stack.storage = None

    def rebuild(skeleton, block):
        storage = None

        def leaf(offset, dtype, shape):
            nonlocal storage
            if storage is None:
                storage = _storage(block)
            p = _proto(dtype)
            return p.new().set_(storage, offset // p.itemsize, shape)

        return _walk(skeleton, leaf)
else:
    def into_block(samples):
        return _core.collate(samples, None, None, None)

    def rebuild(skeleton, block):
        import numpy as np

        def leaf(offset, dtype, shape):
            return block.array(np.dtype(dtype), shape, None, offset)

        return _walk(skeleton, leaf)


def _walk(s, leaf):
    t = type(s)
    if t is tuple:
        tag = s[0]
        if tag == 0:
            return leaf(s[1], s[2], s[3])
        if tag == 1:
            return s[1](*[_walk(c, leaf) for c in s[2]])
        return s[1]
    if t is dict:
        return {k: _walk(v, leaf) for k, v in s.items()}
    return [_walk(c, leaf) for c in s]
