"""How the core's collectives are called from Python (csrc/py_coll.c), in a
group of one rank (no processes): every call takes its arguments by
position or by name, so a caller names `timeout` and `buffer` instead of
reordering them; and the core exports what it reduces (COLL_REDUCES), which
is exactly what its reductions accept."""
import os

import numpy as np
import pytest

from mpcore import _core

CHUNK = 1 << 20
NP = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
      "bfloat16": np.uint16, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
      "bool": np.bool_, "int8": np.int8, "int16": np.int16, "uint16": np.uint16,
      "uint32": np.uint32, "uint64": np.uint64}


@pytest.fixture
def group():
    fd = _core.coll_create(1, CHUNK)
    try:
        g = _core.Group(fd, 0, 1)
    finally:
        os.close(fd)
    yield g
    g.close()


def test_coll_reduces_is_what_the_reductions_accept(group):
    # Every (dtype, op) pair: the reductions take it exactly when
    # COLL_REDUCES lists it, with the codes it gives.
    D, O = _core.COLL_DTYPES, _core.COLL_OPS
    assert set(NP) == set(D)
    taken = {}
    for dname, dcode in D.items():
        for oname, ocode in O.items():
            x = np.ones(64, NP[dname])
            try:
                group.all_reduce(x.ctypes.data, 64, dcode, ocode, 10)
                group.reduce(x.ctypes.data, 64, dcode, ocode, 0, 10)
                out = np.zeros(64, NP[dname])
                group.reduce_scatter(out.ctypes.data, x.ctypes.data, 64, dcode, ocode, 10)
            except ValueError as e:
                assert oname in str(e) and dname in str(e), e   # the error names both
                continue
            taken[(dname, oname)] = (dcode, ocode)
    assert taken == _core.COLL_REDUCES
    # the rule mpcore.h states: AVG for floating point only, the bitwise
    # ops for integers and bool only, every other op for every dtype
    floats = {"float32", "float64", "float16", "bfloat16"}
    for (dname, oname) in taken:
        assert oname != "AVG" or dname in floats
        assert oname not in ("BAND", "BOR", "BXOR") or dname not in floats
    assert len(taken) == len(D) * len(O) - len(floats) * 3 - (len(D) - len(floats))


def test_the_reductions_take_timeout_and_buffer_by_name(group):
    d, op = _core.COLL_DTYPES["float32"], _core.COLL_OPS["SUM"]
    b = _core.GroupBuffer(4096)
    inside = np.frombuffer(b, np.float32, 64)
    inside[:] = 3
    outside = np.full(64, 3, np.float32)
    # the buffer named: its data must lie in it (the core checks)
    group.all_reduce(inside.ctypes.data, 64, d, op, buffer=b, timeout=10)
    group.reduce(inside.ctypes.data, 64, d, op, 0, buffer=b)
    assert (inside == 3).all()
    with pytest.raises(ValueError, match="does not lie in the group buffer"):
        group.all_reduce(outside.ctypes.data, 64, d, op, buffer=b)
    with pytest.raises(ValueError, match="does not lie in the group buffer"):
        group.reduce(address=outside.ctypes.data, count=64, dtype=d, op=op, root=0, buffer=b)
    out = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="does not lie in the group buffer"):
        group.reduce_scatter(out.ctypes.data, outside.ctypes.data, 64, d, op, buffer=b)
    with pytest.raises(ValueError, match="does not lie in the group buffer"):
        group.all_gather(out.ctypes.data, outside.ctypes.data, 256, buffer=b, timeout=None)
    with pytest.raises(ValueError, match="does not lie in the group buffer"):
        group.all_to_all(out.ctypes.data, outside.ctypes.data, [256], [256], buffer=b)
    group.all_gather(out.ctypes.data, inside.ctypes.data, 256, buffer=b)
    assert (out == 3).all()
    # positional calls work as before: timeout, then buffer
    group.all_reduce(inside.ctypes.data, 64, d, op, 10, b)
    with pytest.raises(ValueError, match="does not lie in the group buffer"):
        group.all_reduce(outside.ctypes.data, 64, d, op, None, b)
    # the buffer is checked whichever way it comes
    with pytest.raises(TypeError, match="buffer must be a GroupBuffer"):
        group.all_reduce(inside.ctypes.data, 64, d, op, buffer=bytearray(8))


def test_every_call_takes_timeout_by_name(group):
    x = np.arange(100, dtype=np.uint8)
    out = np.zeros(100, np.uint8)
    group.broadcast(x.ctypes.data, 100, 0, timeout=10)
    group.barrier(timeout=10)
    group.barrier()
    group.gather(out.ctypes.data, x.ctypes.data, 100, 0, timeout=10)
    assert np.array_equal(out, x)
    out[:] = 0
    group.scatter(out_address=out.ctypes.data, ins=x.ctypes.data, nbytes=100, root=0, timeout=10)
    assert np.array_equal(out, x)
    # a negative or NaN timeout is refused, by name as by position, before
    # the call begins (a peer would otherwise wait for it)
    with pytest.raises(ValueError, match="'timeout' must be a non-negative number"):
        group.barrier(timeout=-1)
    with pytest.raises(ValueError, match="'timeout' must be a non-negative number"):
        group.barrier(timeout=float("nan"))
    with pytest.raises(ValueError):
        group.broadcast(x.ctypes.data, 100, 0, -1)
    with pytest.raises(ValueError):
        group.all_reduce(x.ctypes.data, 100, 0, 0, float("nan"))
    with pytest.raises(TypeError):
        group.barrier(timeout="1")
    group.barrier(timeout=0.5)
    # point to point (no peer in a group of one: the core says so)
    with pytest.raises(ValueError, match="rank 0 cannot send to rank 0"):
        group.send(x.ctypes.data, 10, 0, tag=3, timeout=1)
    with pytest.raises(ValueError, match="rank 0 cannot receive from rank -1"):
        group.recv(address=out.ctypes.data, nbytes=10, src=-1, tag=0, timeout=1)
    with pytest.raises(ValueError, match="rank 0 cannot send to rank 0"):
        group.try_send(x.ctypes.data, 10, dst=0, tag=1)


def test_bad_keywords_are_named(group):
    x = np.zeros(8, np.float32)
    d, op = _core.COLL_DTYPES["float32"], _core.COLL_OPS["SUM"]
    with pytest.raises(TypeError, match="deadline"):
        group.all_reduce(x.ctypes.data, 8, d, op, deadline=1)
    with pytest.raises(TypeError, match="timeout"):
        group.all_reduce(x.ctypes.data, 8, d, op, 10, timeout=10)   # given twice
    with pytest.raises(TypeError, match="count"):
        group.all_reduce(x.ctypes.data, dtype=d, op=op)              # missing
    with pytest.raises(TypeError, match="at most 6 arguments"):
        group.all_reduce(x.ctypes.data, 8, d, op, 10, None, 0)
    # each argument's type and range, by its name
    with pytest.raises(TypeError, match="'address' must be int, not float"):
        group.all_reduce(1.5, 8, d, op)
    with pytest.raises(OverflowError, match="'count' is out of range"):
        group.all_reduce(x.ctypes.data, -1, d, op)
    with pytest.raises(OverflowError, match="'root' is out of range"):
        group.broadcast(x.ctypes.data, 32, 1 << 40)
    with pytest.raises(TypeError, match="'nbytes' must be int, not str"):
        group.all_gather(x.ctypes.data, x.ctypes.data, "32")
    with pytest.raises(ValueError, match="tag -1 is not in"):
        group.send(x.ctypes.data, 32, 0, tag=-1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dst'"):
        group.recv(x.ctypes.data, 32, dst=0)
    with pytest.raises(TypeError, match="multiple values for argument 'timeout'"):
        group.barrier(1, timeout=1)
    # an int of another type (numpy's, anything with __index__) is taken, as before
    group.broadcast(np.uint64(x.ctypes.data), np.int32(32), np.int64(0), timeout=10)
