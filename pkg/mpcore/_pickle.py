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


def dumps(obj, prefix=b""):
    buf = io.BytesIO()
    buf.write(prefix)
    p = pickle.Pickler(buf, 4)
    p.dispatch_table = _dispatch_table()
    p.dump(obj)
    return buf.getbuffer()


loads = pickle.loads
