"""Pickling for mpcore's queues: ForkingPickler's reductions without its
per-message cost.

NOTE [ One dispatch table ]
ForkingPickler copies copyreg's dispatch table and merges its registered
reducers for every pickler it makes, which costs more than pickling a
small tensor handle.  We build that merged table once and reuse it until a
reducer is registered again (ForkingPickler.register is wrapped to say
so), or copyreg's table changes size.
"""
import copyreg
import io
import pickle
import threading
from multiprocessing.reduction import ForkingPickler

_table = None
_table_key = None


def _invalidate():
    global _table
    _table = None


def _dispatch_table():
    global _table, _table_key
    key = len(copyreg.dispatch_table)
    if _table is None or key != _table_key:
        t = copyreg.dispatch_table.copy()
        t.update(ForkingPickler._extra_reducers)
        _table, _table_key = t, key
    return _table


_register = ForkingPickler.register.__func__


def _register_and_invalidate(cls, type, reduce):
    _register(cls, type, reduce)
    _invalidate()


if not getattr(ForkingPickler.register, "_mpcore", False):
    _register_and_invalidate._mpcore = True
    ForkingPickler.register = classmethod(_register_and_invalidate)


# NOTE [ One pickler per thread ]
# Making a Pickler and its BytesIO costs more than pickling a small dict, so
# each thread keeps one and reuses it: the memo is cleared and the buffer
# rewound for every message, and the bytes are copied out (a small copy).
# A message of more than KEEP_BYTES leaves with the buffer itself, uncopied,
# and the thread makes a new pickler.  A pickling that starts while the
# thread's pickler is busy (a reducer that puts on a queue) gets a fresh one.
KEEP_BYTES = 64 * 1024
_local = threading.local()


def _new_pickler():
    buf = io.BytesIO()
    p = pickle.Pickler(buf, 4)
    return p, buf


def dumps(obj, prefix=b""):
    table = _dispatch_table()
    cached = getattr(_local, "pickler", None)
    if cached is None or _local.busy:
        if cached is None:
            cached = _local.pickler = _new_pickler()
            _local.busy = False
        else:
            cached = _new_pickler()   # nested: a private one
    p, buf = cached
    own = cached is _local.pickler
    if own:
        _local.busy = True
    try:
        if prefix:
            buf.write(prefix)
        p.dispatch_table = table
        p.dump(obj)
        if buf.tell() > KEEP_BYTES:
            out = buf.getbuffer()
            if own:
                _local.pickler = _new_pickler()
            return out
        return buf.getvalue()
    finally:
        if own and _local.pickler is cached:
            p.clear_memo()
            buf.seek(0)
            buf.truncate()
        if own:
            _local.busy = False


loads = pickle.loads
