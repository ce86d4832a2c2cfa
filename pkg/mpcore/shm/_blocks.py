"""Shared-memory blocks on the Python side: handles for numpy arrays,
tickets in transit, and what happens around fork.  The core keeps the one
Block object of each block this process holds (NOTE [ One Block object per
block ] in py_block.c).
"""
import os
import sys
import threading

from .. import _core
from .._core import HandleError

# Per thread: .refs, the tickets of the message being pickled (also read by
# queue/_queue.encode); .redeemed, those that unpickling redeemed.
tls = threading.local()

BLOCK_DATA = 1
BLOCK_QUEUE = 2

# Arrays at least this large are copied into shared memory when they cross
# an mpcore Queue; smaller ones travel inside the message.
COPY_THRESHOLD = 64 * 1024


def core_command(call, *argv):
    """The command line of a process that needs only the extension module:
    an isolated interpreter that imports no site packages loads it by path
    as `m` (so it starts in tens of milliseconds), then runs the Python
    source `call`; sys.argv[2:] is argv."""
    code = ("import importlib.util as u, os, sys\n"
            "s = u.spec_from_file_location('mpcore._core', sys.argv[1])\n"
            "m = u.module_from_spec(s); s.loader.exec_module(m)\n" + call)
    return [sys.executable, "-I", "-S", "-c", code, _core.__file__, *argv]


_core.set_keeper_command(core_command("m.keeper_main(3, 4)\n"))


def ensure_keeper():
    """Connects this process to its program's keeper, starting it if none
    runs, and makes sure processes started from here find the same one.

    NOTE [ One keeper per program ]
    Done at import: a child that allocated first would otherwise start a
    keeper of its own, and the parent could never map its memory.  Starting
    costs no wait: the address is bound before the keeper runs."""
    os.environ["MPCORE_KEEPER"] = _core.ensure_keeper()


def alloc(nbytes, zero=False, kind=BLOCK_DATA):
    """A new block of `nbytes` bytes held by this process."""
    return _core.alloc(nbytes, zero, kind)


def attach(ref):
    """Redeems a handle's ticket and returns this process's Block for it.
    A malformed handle raises HandleError (from the core)."""
    redeemed = getattr(tls, "redeemed", None)
    if redeemed is not None:
        redeemed.append(ref)
    return _core.attach(ref)


def find(address, nbytes):
    """(Block, byte offset) of the block held here that contains the range,
    or (None, 0)."""
    return _core.find(address, nbytes) or (None, 0)


def ticket(block):
    """Takes a ticket for sending `block`; records it in the current
    transfer (a Queue message), if any."""
    refs = getattr(tls, "refs", None)
    ref = block.ticket(refs is not None)
    if refs is not None:
        refs.append(ref)
    return ref


class transfer:
    """Context of one message being pickled: collects the tickets taken, and
    says whether large arrays should be copied into shared memory."""

    def __init__(self):
        self.refs = []

    def __enter__(self):
        self._saved = getattr(tls, "refs", None)
        tls.refs = self.refs
        return self

    def __exit__(self, *exc):
        tls.refs = self._saved
        return False


def receive(refs, load, data):
    """Returns load(data), a message carrying tickets `refs`.  The tickets
    that unpickling did not redeem (it failed half-way) are then dropped, so
    their blocks are not held forever."""
    saved = getattr(tls, "redeemed", None)
    redeemed = tls.redeemed = []
    try:
        return load(data)
    finally:
        tls.redeemed = saved
        if len(redeemed) < len(refs):
            left = list(refs)
            for ref in redeemed:
                if ref in left:
                    left.remove(ref)
            _core.drop_journaled(left)


def in_transfer():
    return getattr(tls, "refs", None) is not None


# --- numpy -------------------------------------------------------------

def empty_array(shape, dtype, zero=False):
    import numpy as np
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"shared arrays cannot hold Python objects (dtype {dtype})")
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    n = dtype.itemsize
    for s in shape:
        n *= s
    b = alloc(max(n, 1), zero=zero)
    return b.array(dtype, shape)


def array_block(arr):
    """(Block, offset) if the array's memory is an mpcore block held here."""
    if arr.nbytes == 0:
        return None, 0
    lo, hi = _extent(arr)
    return find(lo, hi - lo)


def _extent(arr):
    lo = hi = arr.__array_interface__["data"][0]
    for n, s in zip(arr.shape, arr.strides):
        if s > 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo, hi + arr.itemsize


def share_array(arr):
    """The array itself if it lives in mpcore memory, else a shared copy."""
    b, _ = array_block(arr)
    if b is not None:
        return arr
    out = empty_array(arr.shape, arr.dtype)
    out[...] = arr
    return out


def _rebuild_ndarray(ref, dtype, shape, strides, offset):
    return attach(ref).array(dtype, shape, strides, offset)


def reduce_ndarray(arr):
    if arr.dtype.hasobject:
        return arr.__reduce_ex__(4)
    b, off = array_block(arr)
    if b is None and in_transfer() and arr.nbytes >= COPY_THRESHOLD:
        arr = share_array(arr)
        b, off = array_block(arr)
    if b is None:
        return arr.__reduce_ex__(4)
    data = arr.__array_interface__["data"][0]
    lo, _ = _extent(arr)
    return (_rebuild_ndarray,
            (ticket(b), arr.dtype, arr.shape, arr.strides, off + (data - lo)))


# --- fork ---------------------------------------------------------------

_inherited = None


def _before_fork():
    global _inherited
    ensure_keeper()
    # A ticket per block keeps it alive for the child until the child has
    # made the hold its own, even if the parent lets go at once.
    _inherited = []
    for b in _core.live_blocks():
        try:
            b.ticket()
            _inherited.append(b)
        except HandleError:
            pass


def _after_fork_parent():
    global _inherited
    _inherited = None


def _after_fork_child():
    global _inherited
    _core.after_fork_child()
    inherited, _inherited = _inherited, None
    for b in inherited or ():
        b.claim()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                    after_in_child=_after_fork_child)
