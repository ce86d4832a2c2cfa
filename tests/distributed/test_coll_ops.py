"""The core's collectives beyond all-reduce (coll.c): reduce, gather,
scatter, all_to_all, send/recv, the dtypes and the bitwise ops, against
numpy references and, for the semantics of bool and the bitwise ops,
against torch's gloo.

The ranks are started once per module and world size (Ranks): processes
that map one group made here and run the jobs this process sends them, so
every test talks to ranks that are already up.  A job is a piece of Python
that every rank runs with `g` (its _core.Group), `rank` and `world` at hand;
what it leaves in `result` comes back.  Inputs are made from seeds that
name (dtype, size, rank, case), so this process rebuilds every rank's input
and computes the reference itself.
"""
import hashlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from helpers import children_of, fresh_env, mpcore_memfds, require, scaled

pytestmark = pytest.mark.timeout(120)

from mpcore import _core  # noqa: E402

CHUNK = 1 << 20          # staging bytes per rank, as mpcore.distributed uses
BIG = 16 << 20           # "large": 16 MB per rank

# Made from a seed, the same in this process and in every rank.
COMMON = r'''
import hashlib, zlib
import numpy as np

NP = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
      "bfloat16": np.uint16, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
      "bool": np.bool_, "int8": np.int8, "int16": np.int16, "uint16": np.uint16,
      "uint32": np.uint32, "uint64": np.uint64}

def data(dtype, n, rank, case=""):
    """n elements of dtype for this rank (bfloat16: its bits as uint16)."""
    rng = np.random.default_rng(zlib.crc32(repr((dtype, n, rank, case)).encode()))
    if dtype == "bool":
        return rng.random(n) < 0.5
    if dtype == "bfloat16":
        f = (rng.standard_normal(n) * 4).astype(np.float32)
        u = f.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    t = NP[dtype]
    if np.issubdtype(t, np.floating):
        return (rng.standard_normal(n) * 4).astype(t)
    info = np.iinfo(t)
    return rng.integers(info.min, info.max, n, dtype=t, endpoint=True)

def blob(n, rank, case=""):
    """n bytes for this rank."""
    rng = np.random.default_rng(zlib.crc32(repr(("bytes", n, rank, case)).encode()))
    return rng.integers(0, 256, n, dtype=np.uint8)

def digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()
'''
exec(COMMON)

WORKER = COMMON + r'''
import os, pickle, struct, sys, traceback
from mpcore import _core

fd, rank, world, direct = map(int, sys.argv[1:5])
# The timeouts the jobs give the group only bound a hang: they scale with
# the machine's slowdown (NOTE [ Waits scale with how slow the machine is ]).
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))
replies = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)                      # stray prints go to stderr, never into a reply
jobs = sys.stdin.buffer
g = _core.Group(fd, rank, world, bool(direct))
os.close(fd)
g.barrier(60 * SLOW)
g.watch()

def reply(obj):
    b = pickle.dumps(obj)
    replies.write(struct.pack("<Q", len(b)) + b)
    replies.flush()

reply(("ok", os.getpid()))
while True:
    head = jobs.read(8)
    if len(head) < 8:
        break
    src = pickle.loads(jobs.read(struct.unpack("<Q", head)[0]))
    ns = {"g": g, "rank": rank, "world": world, "np": np, "data": data, "blob": blob,
          "digest": digest, "result": None, "SLOW": SLOW}
    try:
        exec(src, ns)
        reply(("ok", ns["result"]))
    except BaseException as e:
        reply(("err", type(e).__name__, str(e)))
g.close()
replies.close()
# Finalising an interpreter that imported torch takes tens of seconds on a
# loaded machine (its last garbage collection): nothing is left to flush.
os._exit(0)
'''


class Ranks:
    """`world` rank processes on one group, taking jobs from this process;
    `direct[r]` False: rank r may not copy straight between its memory and
    its peers' (NOTE [ Copies between ranks' memory ] in coll.c)."""

    def __init__(self, world, direct=None):
        self.world = world
        direct = direct or [True] * world
        fd = _core.coll_create(world, CHUNK)
        try:
            self.procs = [subprocess.Popen(
                [sys.executable, "-c", WORKER, str(fd), str(r), str(world), str(int(direct[r]))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,),
                env=fresh_env()) for r in range(world)]
        finally:
            os.close(fd)
        self.pids = [r["value"] for r in self.collect(60)]
        for r, v in enumerate(self.pids):
            assert isinstance(v, int), f"rank {r} did not start: {v}"

    def send(self, src, ranks=None):
        b = pickle.dumps(src)
        for r in range(self.world) if ranks is None else ranks:
            self.procs[r].stdin.write(struct.pack("<Q", len(b)) + b)
            self.procs[r].stdin.flush()

    def _read(self, r, n, deadline):
        out = b""
        f = self.procs[r].stdout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                raise TimeoutError(f"rank {r} gave no reply in time")
            chunk = os.read(f.fileno(), n - len(out))
            if not chunk:
                raise EOFError(f"rank {r} exited (rc {self.procs[r].poll()})")
            out += chunk
        return out

    def collect(self, timeout=60, ranks=None):
        """Each rank's reply: {"value": ...} or {"error": (type, message)}."""
        deadline = time.monotonic() + scaled(timeout)
        out = []
        for r in range(self.world) if ranks is None else ranks:
            n = struct.unpack("<Q", self._read(r, 8, deadline))[0]
            rep = pickle.loads(self._read(r, n, deadline))
            out.append({"value": rep[1]} if rep[0] == "ok" else {"error": rep[1:]})
        return out

    def run(self, src, timeout=60):
        """Runs src on every rank; returns the results, failing on any error."""
        self.send(src)
        res = self.collect(timeout)
        for r, x in enumerate(res):
            assert "error" not in x, f"rank {r}: {x['error']}"
        return [x["value"] for x in res]

    def close(self):
        """Ends the ranks (EOF on their jobs); returns the exit codes of
        those that had to be killed, by rank."""
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        killed = {}
        for r, p in enumerate(self.procs):
            try:
                p.wait(scaled(10))
            except subprocess.TimeoutExpired:
                p.kill()
                killed[r] = p.wait()
            p.stdout.close()
        return killed


def _gone(ranks):
    """What a finished Ranks left behind: live children, mpcore memfds."""
    pids = set(ranks.pids)
    kids = [p for p, _ in children_of(os.getpid()) if p in pids]
    fds = {p: n for p, n in mpcore_memfds().items() if p in pids}
    return kids, fds


def _finish(rk):
    killed = rk.close()
    assert not killed, f"ranks that did not exit at the end of their jobs: {killed}"
    assert [p.returncode for p in rk.procs] == [0] * rk.world
    kids, fds = _gone(rk)
    assert not kids and not fds, f"left behind: processes {kids}, memfds {fds}"


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ranks(request):
    rk = Ranks(request.param)
    yield rk
    _finish(rk)


@pytest.fixture(scope="module")
def pair():
    rk = Ranks(2)
    yield rk
    _finish(rk)


@pytest.fixture(scope="module")
def staged_pair():
    """Two ranks of which rank 1 may not copy directly."""
    rk = Ranks(2, direct=[True, False])
    yield rk
    _finish(rk)


def _have_torch():
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_gloo_available()
    except ImportError:
        return False


# --- the reference ------------------------------------------------------------

def _bf16_to_f32(u):
    return (u.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f):
    u = f.astype(np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def reference(dtype, op, xs):
    """The reduction over xs in rank order, as gloo defines it for bool and
    with float16/bfloat16 accumulated in float32."""
    half = dtype in ("float16", "bfloat16")
    conv = (lambda a: a.astype(np.float32)) if dtype == "float16" else _bf16_to_f32
    xs = [conv(x) for x in xs] if half else xs
    if dtype == "bool":
        f = {"SUM": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or,
             "PRODUCT": np.logical_and, "MIN": np.logical_and, "BAND": np.logical_and,
             "BXOR": np.logical_xor}[op]
    else:
        f = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum,
             "MAX": np.maximum, "BAND": np.bitwise_and, "BOR": np.bitwise_or,
             "BXOR": np.bitwise_xor}[op]
    acc = xs[0].copy()
    with np.errstate(over="ignore"):
        for x in xs[1:]:
            acc = f(acc, x).astype(acc.dtype)
    if op == "AVG":
        acc = (acc / acc.dtype.type(len(xs))).astype(acc.dtype)
    if dtype == "float16":
        return acc.astype(np.float16)
    if dtype == "bfloat16":
        return _f32_to_bf16(acc)
    return acc


FLOATS = ("float32", "float64", "float16", "bfloat16")


def valid_ops(dtype):
    ops = ["SUM", "PRODUCT", "MIN", "MAX"]
    return ops + (["AVG"] if dtype in FLOATS else ["BAND", "BOR", "BXOR"])


# --- 1. the codes ---------------------------------------------------------------

def test_codes_keep_their_values_and_name_every_dtype_and_op():
    old = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3, "int32": 4, "int64": 5,
           "uint8": 6}
    assert {k: _core.COLL_DTYPES[k] for k in old} == old
    assert set(_core.COLL_DTYPES) == set(NP)
    assert sorted(_core.COLL_DTYPES.values()) == list(range(len(NP)))
    assert _core.COLL_OPS == {"SUM": 0, "AVG": 1, "PRODUCT": 2, "MIN": 3, "MAX": 4, "BAND": 5,
                              "BOR": 6, "BXOR": 7}
    require(_have_torch(), "torch is not installed")
    import torch
    for name in _core.COLL_DTYPES:   # torch's names, and the sizes coll.c moves
        assert isinstance(getattr(torch, name), torch.dtype), name
        assert np.dtype(NP[name]).itemsize == getattr(torch, name).itemsize, name


def test_a_group_of_one_rank():
    """Every collective of one rank is a copy (or nothing); point to point
    has no peer and says so."""
    fd = _core.coll_create(1, CHUNK)
    try:
        g = _core.Group(fd, 0, 1)
    finally:
        os.close(fd)
    try:
        x = data("int16", 1000, 0)
        want = x.copy()
        g.reduce(x.ctypes.data, 1000, _core.COLL_DTYPES["int16"], _core.COLL_OPS["BXOR"], 0, 10)
        assert np.array_equal(x, want)
        src, out = blob(5000, 0), np.zeros(5000, np.uint8)
        g.gather(out.ctypes.data, src.ctypes.data, 5000, 0, 10)
        assert np.array_equal(out, src)
        out[:] = 0
        g.scatter(out.ctypes.data, src.ctypes.data, 5000, 0, 10)
        assert np.array_equal(out, src)
        out[:] = 0
        g.all_to_all(out.ctypes.data, src.ctypes.data, [5000], [5000], 10)
        assert np.array_equal(out, src)
        with pytest.raises(ValueError, match="rank 0 cannot receive from rank -1"):
            g.recv(out.ctypes.data, 10, -1, 0, 10)
        with pytest.raises(ValueError, match="rank 0 cannot send to rank 0"):
            g.send(out.ctypes.data, 10, 0, 0, 10)
        with pytest.raises(ValueError, match="root 1 is not a rank"):
            g.gather(out.ctypes.data, src.ctypes.data, 10, 1, 10)
    finally:
        g.close()


# --- 2. reduce, against numpy --------------------------------------------------------

# 1000 elements: one-shot pieces; 300_001: pieces reduced in slices by every rank.
REDUCE = r'''
D, O = _core_codes
out = {}
for dtype in DTYPES:
    for op in OPS[dtype]:
        for n in SIZES:
            for root in ROOTS:
                x = data(dtype, n, rank, (op, root))
                before = digest(x)
                g.reduce(x.ctypes.data, n, D[dtype], O[op], root, 60 * SLOW)
                out[dtype, op, n, root] = (x if n <= 1000 else digest(x), before)
result = out
'''


def test_reduce_every_dtype_and_op_matches_numpy(ranks):
    W = ranks.world
    sizes, roots = (0, 1, 1000, 300_001), (0, W - 1)
    ops = {d: valid_ops(d) for d in NP}
    src = (f"from mpcore import _core as _c\n_core_codes = (_c.COLL_DTYPES, _c.COLL_OPS)\n"
           f"DTYPES = {list(NP)!r}\nOPS = {ops!r}\nSIZES = {sizes!r}\nROOTS = {roots!r}\n"
           + REDUCE)
    res = ranks.run(src, timeout=100)
    for dtype in NP:
        for op in ops[dtype]:
            for n in sizes:
                for root in roots:
                    key = (dtype, op, n, root)
                    xs = [data(dtype, n, r, (op, root)) for r in range(W)]
                    want = reference(dtype, op, xs)
                    got, before = res[root][key]
                    if n <= 1000:
                        assert got.dtype == want.dtype and np.array_equal(
                            got.view(np.uint8), want.view(np.uint8)), (key, got[:8], want[:8])
                    else:
                        assert got == digest(want), key
                    for r in range(W):
                        if r != root:  # the others' buffers are left as they were
                            got_r, before_r = res[r][key]
                            assert (got_r if n > 1000 else digest(got_r)) == before_r, (r, key)


# Two ranks' NaNs and zeros: one-shot (7 elements), staged in slices (35,000)
# and copied directly (280,000: 1 MB of float32).
SPECIAL = r"""
from mpcore import _core as _c
D, O = _c.COLL_DTYPES, _c.COLL_OPS
nan = float("nan")
vals = ([nan, 1.0, -0.0, 0.0, nan, 2.0, -1.0], [1.0, nan, 0.0, -0.0, 5.0, -3.0, -1.0])[rank]
out = {}
for dtype in ("float32", "float64"):
    for op in ("MIN", "MAX", "SUM", "PRODUCT", "AVG"):
        for reps in (1, 5_000, 40_000):
            x = np.array(vals * reps, dtype=dtype)
            g.all_reduce(x.ctypes.data, x.size, D[dtype], O[op], 60 * SLOW)
            out[dtype, op, reps] = (x[:7].tobytes(), x.tobytes() == x[:7].tobytes() * reps)
result = out
"""


def test_two_ranks_reduce_each_element_in_rank_order(pair):
    """Each element is rank 0's op rank 1's, as gloo's std::min and std::max
    order them: on a NaN or a tie of zeros the first operand stays (NOTE
    [ Two sources straight into the result ] in coll_kernels.c)."""
    res = pair.run(SPECIAL, timeout=100)
    nan = float("nan")
    a = [nan, 1.0, -0.0, 0.0, nan, 2.0, -1.0]
    b = [1.0, nan, 0.0, -0.0, 5.0, -3.0, -1.0]
    ops = {"MIN": lambda x, y: y if y < x else x, "MAX": lambda x, y: y if y > x else x,
           "SUM": lambda x, y: x + y, "PRODUCT": lambda x, y: x * y,
           "AVG": lambda x, y: (x + y) * 0.5}
    for dtype in ("float32", "float64"):
        for op, f in ops.items():
            want = np.array([f(x, y) for x, y in zip(a, b)], dtype=dtype)
            for reps in (1, 5_000, 40_000):
                for r in (0, 1):
                    head, every = res[r][dtype, op, reps]
                    got = np.frombuffer(head, dtype=dtype)
                    key = (dtype, op, reps, r)
                    assert every, key      # every repetition reduced alike
                    assert np.array_equal(np.isnan(got), np.isnan(want)), (key, got, want)
                    ok = ~np.isnan(want)   # zeros compared with their signs
                    assert got[ok].tobytes() == want[ok].tobytes(), (key, got, want)


def test_bitwise_op_on_a_float_dtype_is_refused_naming_both(pair):
    res = pair.run(r'''
from mpcore import _core as c
x = np.zeros(4, np.float32)
msgs = []
for op in ("BAND", "BOR", "BXOR"):
    for fn in (lambda: g.all_reduce(x.ctypes.data, 4, c.COLL_DTYPES["float32"], c.COLL_OPS[op], 10),
               lambda: g.reduce(x.ctypes.data, 4, c.COLL_DTYPES["float32"], c.COLL_OPS[op], 0, 10)):
        try:
            fn()
            msgs.append(None)
        except ValueError as e:
            msgs.append((op, str(e)))
y = np.ones(4, np.int32)   # the group is still fine
g.all_reduce(y.ctypes.data, 4, c.COLL_DTYPES["int32"], c.COLL_OPS["SUM"], 10 * SLOW)
result = msgs, y.tolist()
''')
    for msgs, after in res:
        assert after == [2] * 4
        for m in msgs:
            assert m is not None, "a bitwise op on float32 was taken"
            op, msg = m
            assert op in msg and "float32" in msg, msg


# --- 3. the semantics of bool and the bitwise ops, against gloo ----------------------

GLOO = r'''
import torch, torch.distributed as dist
from mpcore import _core as c
import datetime
port = np.zeros(1, np.int64)
if rank == 0:
    store = dist.TCPStore("127.0.0.1", 0, world, True,
                          timeout=datetime.timedelta(seconds=60 * SLOW),
                          wait_for_workers=False)
    port[0] = store.port
g.broadcast(port.ctypes.data, 8, 0, 30 * SLOW)         # the port, through our own group
if rank != 0:
    store = dist.TCPStore("127.0.0.1", int(port[0]), world, False,
                          timeout=datetime.timedelta(seconds=60 * SLOW))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
out = {}
for dtype in ("bool", "int8", "uint8", "int32", "int64"):
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        x = data(dtype, 999, rank, op)
        t = torch.from_numpy(x.copy())
        dist.all_reduce(t, getattr(dist.ReduceOp, op))
        g.all_reduce(x.ctypes.data, 999, c.COLL_DTYPES[dtype], c.COLL_OPS[op], 30 * SLOW)
        y = data(dtype, 999, rank, op)
        g.reduce(y.ctypes.data, 999, c.COLL_DTYPES[dtype], c.COLL_OPS[op], 0, 30 * SLOW)
        out[dtype, op] = (t.numpy(), x, y)
dist.destroy_process_group()
result = out
'''


def test_bool_and_bitwise_reductions_match_gloo(ranks):
    require(_have_torch(), "torch is not installed")
    res = ranks.run(GLOO, timeout=100)
    for r, out in enumerate(res):
        for (dtype, op), (gloo, ours, reduced) in out.items():
            assert np.array_equal(ours, gloo), (r, dtype, op, ours[:8], gloo[:8])
            if r == 0:
                assert np.array_equal(reduced, gloo), (dtype, op)
            want = reference(dtype, op, [data(dtype, 999, q, op) for q in range(ranks.world)])
            assert np.array_equal(gloo, want), ("the reference differs from gloo", dtype, op)


# --- 4. gather and scatter ----------------------------------------------------------

MOVERS = r'''
out = {}
for n in SIZES:
    for root in ROOTS:
        mine = blob(n, rank, ("gather", root))
        gathered = np.full(world * n, 7, np.uint8) if rank == root else None
        g.gather(gathered.ctypes.data if rank == root else 0, mine.ctypes.data, n, root, 60 * SLOW)
        whole = (np.concatenate([blob(n, q, ("scatter", root)) for q in range(world)])
                 if rank == root else None)
        part = np.full(n, 7, np.uint8)
        g.scatter(part.ctypes.data, whole.ctypes.data if rank == root else 0, n, root, 60 * SLOW)
        out[n, root] = (None if gathered is None else digest(gathered), digest(part))
result = out
'''


def test_gather_and_scatter_move_every_piece(ranks):
    _gather_and_scatter_move_every_piece(ranks)


def _gather_and_scatter_move_every_piece(ranks):
    W = ranks.world
    # BIG // 4 + 12345: the root of two takes a share that ends mid-page
    sizes, roots = (0, 1, 4096, 3 * CHUNK + 17, BIG // 4 + 12345, BIG), (0, W - 1)
    res = ranks.run(f"SIZES = {sizes!r}\nROOTS = {roots!r}\n" + MOVERS, timeout=100)
    for n in sizes:
        for root in roots:
            want = digest(np.concatenate([blob(n, q, ("gather", root)) for q in range(W)]))
            for r in range(W):
                gathered, part = res[r][n, root]
                assert gathered == (want if r == root else None), (r, n, root)
                assert part == digest(blob(n, r, ("scatter", root))), (r, n, root)


BROADCASTS = r'''
out = {}
for n in SIZES:
    for root in range(world):
        buf = np.concatenate([blob(n, rank, ("broadcast", root)), np.full(64, 7, np.uint8)])
        g.broadcast(buf.ctypes.data, n, root, 60 * SLOW)
        out[n, root] = digest(buf[:n]), bool((buf[n:] == 7).all())
result = out
'''


def test_broadcast_from_every_root_in_every_size(ranks):
    """Small, staged, and (two ranks) copied between the ranks' memory
    (NOTE [ A large broadcast between two copies once ] in coll.c): around
    the size that copies directly, odd sizes whose halves end mid-page, and
    16 MB; every rank ends with the root's bytes and nothing past them."""
    _broadcast_from_every_root(ranks)


def _broadcast_from_every_root(ranks):
    sizes = (0, 1, 4096, (256 << 10) - 1, 256 << 10, 3 * CHUNK + 17, BIG // 4 + 12345, BIG)
    res = ranks.run(f"SIZES = {sizes!r}\n" + BROADCASTS, timeout=100)
    for n in sizes:
        for root in range(ranks.world):
            want = digest(blob(n, root, ("broadcast", root)))
            assert [res[r][n, root] for r in range(ranks.world)] == [(want, True)] * ranks.world, \
                (n, root)


# --- 4b. all_gather and reduce_scatter ------------------------------------------------

GATHER_SCATTER = r'''
from mpcore import _core
F32, SUM = _core.COLL_DTYPES["float32"], _core.COLL_OPS["SUM"]
named = WHERE == "every rank" or (WHERE == "even ranks" and rank % 2 == 0)

def room(n):
    """n float32 zeros, in a group buffer (at a different place on each
    rank) when this rank names one, and the buffer (or None)."""
    if not named:
        return np.zeros(n, np.float32), None
    at = 16 * (rank + 1)
    b = _core.GroupBuffer(4 * (at + n))
    return np.frombuffer(b, np.float32)[at:at + n], b

out = {}
for n in SIZES:                 # float32 elements per rank
    for place in PLACES:
        mine = data("float32", n, rank, ("all_gather", place))
        # all_gather: apart; in place (the input is this rank's part of the
        # output); "aside" (the input is the output's first part on every
        # rank: a peer still reads it while this rank writes its output);
        # "askew" (the input one element past this rank's part)
        whole, b = room(world * n + 2)
        whole[-1] = 7
        dst = whole[:world * n]
        if place == "apart":
            src, b = room(n)
        else:
            at = {"in place": rank * n, "aside": 0, "askew": rank * n + 1}[place]
            src = whole[at:at + n]
        src[:] = mine
        g.all_gather(dst.ctypes.data, src.ctypes.data, n * 4, 60, b)
        ag = digest(dst), float(whole[-1])
        # reduce_scatter: apart; in place (the output is this rank's part of
        # the input); "aside" (the output is the input's first part); "askew"
        # (the output one element past this rank's part)
        buf, b = room(world * n + 2)
        buf[:world * n] = data("float32", world * n, rank, ("reduce_scatter", place))
        buf[-1] = 7
        at = {"in place": rank * n, "aside": 0, "askew": rank * n + 1}.get(place)
        res = np.full(n, 7, np.float32) if at is None else buf[at:at + n]
        g.reduce_scatter(res.ctypes.data, buf.ctypes.data, n, F32, SUM, 60, b)
        out[n, place] = ag, res.copy(), float(buf[-1])
        del whole, dst, src, buf, res, b
result = out
'''


@pytest.mark.parametrize("where", ["own memory", "every rank", "even ranks"])
def test_all_gather_and_reduce_scatter_in_and_out_of_place(ranks, where):
    _all_gather_and_reduce_scatter(ranks, where)


def _all_gather_and_reduce_scatter(ranks, where="own memory"):
    """Every size, staged in pieces or (inputs in group buffers on every
    rank) read where they lie (NOTE [ Group buffers ]), with the input apart
    from the output, in place, and overlapping it elsewhere (NOTE [ Movers
    write where no one reads ])."""
    W = ranks.world
    sizes = (0, 1, 1000, CHUNK // 4 + 3, 3 * CHUNK // 4 + 12345)
    places = ("apart", "in place", "aside", "askew")
    res = ranks.run(f"SIZES = {sizes!r}\nPLACES = {places!r}\nWHERE = {where!r}\n"
                    + GATHER_SCATTER, timeout=150)
    for n in sizes:
        for place in places:
            ag = digest(np.concatenate([data("float32", n, q, ("all_gather", place))
                                        for q in range(W)]))
            ins = [data("float32", W * n, q, ("reduce_scatter", place)) for q in range(W)]
            total = reference("float32", "SUM", ins)
            for r in range(W):
                (got_ag, past_ag), got_rs, past_rs = res[r][n, place]
                assert got_ag == ag and past_ag == 7, ("all_gather", r, n, place)
                assert past_rs == 7, ("reduce_scatter wrote past its input", r, n, place)
                assert np.array_equal(got_rs, total[r * n:(r + 1) * n]), \
                    ("reduce_scatter", r, n, place)


# --- 5. all_to_all ----------------------------------------------------------------

A2A = r'''
from mpcore import _core
out = {}
for case, sizes in CASES.items():
    send = [sizes[rank][j] for j in range(world)]
    recv = [sizes[i][rank] for i in range(world)]
    src = np.concatenate([blob(send[j], rank, (case, j)) for j in range(world)])
    named = None
    if WHERE == "every rank" or (WHERE == "even ranks" and rank % 2 == 0):
        # the input in a group buffer, at a different place on each rank
        at = 3 * rank + 1
        named = _core.GroupBuffer(at + len(src))
        inside = np.frombuffer(named, np.uint8)[at:at + len(src)]
        inside[:] = src
        src = inside
    dst = np.full(sum(recv), 7, np.uint8)
    g.all_to_all(dst.ctypes.data, src.ctypes.data, send, recv, 60, named)
    out[case] = digest(dst)
    del src, named
result = out
'''


def a2a_cases(W):
    """{case: sizes[i][j], the bytes rank i sends rank j}."""
    rng = np.random.default_rng(W)
    return {
        "equal": [[1000] * W for _ in range(W)],
        "uneven": [[int(v) for v in rng.integers(0, 3 * CHUNK, W)] for _ in range(W)],
        "zeros": [[0 if (i + j) % 2 else 64 * i + j + 1 for j in range(W)] for i in range(W)],
        "all zero": [[0] * W for _ in range(W)],
        "one pair": [[CHUNK * 5 + 3 if (i, j) == (W - 1, 0) else 0 for j in range(W)]
                     for i in range(W)],
        "16 MB per rank": [[BIG // W] * W for _ in range(W)],
    }


@pytest.mark.parametrize("where", ["own memory", "every rank", "even ranks"])
def test_all_to_all_equal_uneven_zero_and_large(ranks, where):
    """The inputs in the ranks' own memory, in group buffers on every rank
    (each reads its pieces where they lie, NOTE [ Group buffers ]), or on
    some ranks only (then none reads from them): the same bytes arrive."""
    _all_to_all_equal_uneven_zero_and_large(ranks, where)


def _all_to_all_equal_uneven_zero_and_large(ranks, where="own memory"):
    W = ranks.world
    cases = a2a_cases(W)
    res = ranks.run(f"CASES = {cases!r}\nWHERE = {where!r}\n" + A2A, timeout=100)
    for case, sizes in cases.items():
        for r in range(W):
            want = np.concatenate([blob(sizes[i][r], i, (case, r)) for i in range(W)])
            assert res[r][case] == digest(want), (case, r)


def test_all_to_all_size_mismatch_fails_on_every_rank_naming_both(ranks):
    W = ranks.world
    res = ranks.run(r'''
send = [8] * world
recv = [8] * world
if rank == world - 1:
    send[0] = 16          # the last rank sends rank 0 16 bytes, rank 0 expects 8
src = np.zeros(sum(send), np.uint8)
dst = np.zeros(sum(recv), np.uint8)
try:
    g.all_to_all(dst.ctypes.data, src.ctypes.data, send, recv, 30 * SLOW)
    err = None
except ValueError as e:
    err = str(e)
ok = np.ones(8 * world, np.uint8)
back = np.zeros(8 * world, np.uint8)
g.all_to_all(back.ctypes.data, ok.ctypes.data, [8] * world, [8] * world, 30 * SLOW)
result = err, int(back.sum())
''')
    for r, (err, after) in enumerate(res):
        assert err is not None, f"rank {r} saw no error"
        assert f"rank {W - 1} sends 16 bytes to rank 0" in err and "expects 8" in err, err
        assert after == 8 * W, "a matching all_to_all after the error failed"


def test_mismatched_calls_fail_on_every_rank_naming_each_call(ranks):
    W = ranks.world
    res = ranks.run(r'''
from mpcore import _core as c
x = np.zeros(64, np.int32)
errs = {}
calls = {
    "root": lambda: g.reduce(x.ctypes.data, 64, c.COLL_DTYPES["int32"], c.COLL_OPS["SUM"],
                             0 if rank == 0 else 1, 30),
    "op": lambda: g.reduce(x.ctypes.data, 64, c.COLL_DTYPES["int32"],
                           c.COLL_OPS["BAND" if rank == 0 else "BOR"], 0, 30),
    "kind": lambda: (g.gather(x.ctypes.data if rank == 0 else 0, x.ctypes.data, 16, 0, 30 * SLOW)
                     if rank == 0 else g.scatter(x.ctypes.data, 0, 16, 0, 30 * SLOW)),
}
for name, fn in calls.items():
    try:
        fn()
        errs[name] = None
    except ValueError as e:
        errs[name] = str(e)
result = errs
''')
    for r, errs in enumerate(res):
        other = 1 if r == 0 else 0
        for name, err in errs.items():
            assert err is not None, f"rank {r} saw no error for differing {name}"
        assert "to rank 0" in res[r]["root"] and "to rank 1" in res[r]["root"], res[r]["root"]
        assert "BAND" in errs["op"] and "BOR" in errs["op"], errs["op"]
        assert "gather of 16 bytes to rank 0" in errs["kind"] and "scatter of 16 bytes from rank 0" in errs["kind"], errs["kind"]
        assert f"rank {r} called" in errs["kind"] and f"rank {other} called" in errs["kind"]


def test_a_rank_attached_again_meets_a_peer_already_at_the_next_barrier():
    """NOTE [ One word a meeting ] in coll_group.c: a rank that closes its
    group and attaches again takes up its count where it left it, also when
    its peer has already added itself to the next barrier's word; calls that
    differ still fail on both ranks after it, and the group goes on."""
    import threading
    fd = _core.coll_create(2, CHUNK)
    try:
        g0, g1 = _core.Group(fd, 0, 2), _core.Group(fd, 1, 2)
        x = np.zeros(16, np.uint8)

        def both(f0, f1):
            """f0 on this thread, f1 on another: what each returned or raised."""
            out = [None, None]

            def run(i, f):
                try:
                    out[i] = ("ok", f())
                except Exception as e:
                    out[i] = ("err", type(e).__name__, str(e))
            t = threading.Thread(target=run, args=(1, f1))
            t.start()
            run(0, f0)
            t.join(scaled(30))
            assert not t.is_alive(), "rank 1's call never returned"
            return out

        for _ in range(3):   # an odd count: the next barrier is of the other parity
            assert both(lambda: g0.barrier(scaled(10)), lambda: g1.barrier(scaled(10))) == [
                ("ok", None)] * 2
        g1.close()
        # rank 0 arrives at the next barrier and sleeps there ...
        ahead = {}

        def rank0():
            ahead["tid"] = threading.get_native_id()
            try:
                g0.barrier(scaled(20))
                ahead["out"] = "ok"
            except Exception as e:
                ahead["out"] = f"{type(e).__name__}: {e}"
        t = threading.Thread(target=rank0)
        t.start()
        deadline = time.monotonic() + scaled(30)
        while "tid" not in ahead or "futex" not in open(
                f"/proc/self/task/{ahead['tid']}/wchan").read():
            assert time.monotonic() < deadline and t.is_alive(), f"rank 0 never waited: {ahead}"
            time.sleep(0.01)
        # ... and only then does rank 1 attach again and come
        g1 = _core.Group(fd, 1, 2)
        g1.barrier(scaled(20))
        t.join(scaled(30))
        assert ahead.get("out") == "ok", ahead
        for _ in range(4):
            assert both(lambda: g0.barrier(scaled(10)), lambda: g1.barrier(scaled(10))) == [
                ("ok", None)] * 2
        # the calls' and the staging areas' parities go on too: a staged
        # all_reduce of pieces larger than one shot adds up
        D, O = _core.COLL_DTYPES["int32"], _core.COLL_OPS["SUM"]
        a, b = data("int32", 300_001, 0) >> 2, data("int32", 300_001, 1) >> 2
        want = a + b
        for _ in range(2):
            x0, x1 = a.copy(), b.copy()
            assert both(lambda: g0.all_reduce(x0.ctypes.data, 300_001, D, O, scaled(10)),
                        lambda: g1.all_reduce(x1.ctypes.data, 300_001, D, O, scaled(10))) == [
                ("ok", None)] * 2
            assert np.array_equal(x0, want) and np.array_equal(x1, want)
        got = both(lambda: g0.barrier(scaled(10)),
                   lambda: g1.broadcast(x.ctypes.data, 16, 0, scaled(10)))
        assert got[0][:2] == ("err", "ValueError") and got[1][:2] == ("err", "ValueError"), got
        assert "rank 0 called barrier" in got[0][2] and "broadcast of 16 bytes" in got[0][2], got
        assert "rank 1 called broadcast" in got[1][2] and "called barrier" in got[1][2], got
        assert both(lambda: g0.barrier(scaled(10)), lambda: g1.barrier(scaled(10))) == [
            ("ok", None)] * 2
    finally:
        os.close(fd)
    g0.close()
    g1.close()


# --- 6. send and recv -----------------------------------------------------------------

P2P = r'''
out = []
if rank == 0:
    for i, n in enumerate(SIZES):
        m = blob(n, 0, i)
        g.send(m.ctypes.data, n, 1, i % 3, 60 * SLOW)
    buf = np.zeros(16, np.uint8)
    out.append(g.recv(buf.ctypes.data, 16, 1, 5, 60 * SLOW))
elif rank == 1:
    for i, n in enumerate(SIZES):
        m = np.full(n, 7, np.uint8)
        src = g.recv(m.ctypes.data, n, 0, i % 3, 60 * SLOW)
        out.append((src, digest(m)))
    g.send(blob(16, 1).ctypes.data, 16, 0, 5, 60 * SLOW)
result = out
'''


def test_send_recv_in_order_small_and_large(ranks):
    _send_recv_in_order_small_and_large(ranks)


def _send_recv_in_order_small_and_large(ranks):
    # BIG streams through the mailbox, 2 * BIG + 1 is read from the sender's
    # memory (NOTE [ Copies between ranks' memory ]).
    sizes = [0, 1, 63, 64, 65, 4096, 5 * CHUNK + 1, BIG, 2 * BIG + 1, 10]
    res = ranks.run(f"SIZES = {sizes!r}\n" + P2P, timeout=100)
    assert res[0] == [1]
    assert res[1] == [(0, digest(blob(n, 0, i))) for i, n in enumerate(sizes)]


def test_every_peers_buffer_stays_mapped_past_the_old_sixty_four(ranks):
    """NOTE [ Peers' buffers stay mapped ] in coll_copy.c: all-reduces that
    name 80 buffers in turn, twice over, give the right sums, and after them
    each rank still maps every buffer of every peer (a rank that kept 64
    mappings, the least recently used going, had to map each again at each
    call)."""
    many, n = 80, 4096
    res = ranks.run(rf'''
import os
from mpcore import _core
F32, SUM = _core.COLL_DTYPES["float32"], _core.COLL_OPS["SUM"]
bufs = [_core.GroupBuffer(4 * {n}) for _ in range({many})]
views = [np.frombuffer(b, np.float32, {n}) for b in bufs]
ok = True
for rnd in range(2):
    for i, (b, v) in enumerate(zip(bufs, views)):
        v[:] = data("float32", {n}, rank, ("many", i))
        g.all_reduce(v.ctypes.data, {n}, F32, SUM, 60, b)
        want = sum(data("float32", {n}, q, ("many", i)).astype(np.float64) for q in range(world))
        ok = ok and np.allclose(v, want, rtol=1e-5, atol=1e-4)
owned = set()
for fd in os.listdir("/proc/self/fd"):
    try:     # (the listing's own fd is gone)
        if os.readlink(f"/proc/self/fd/{{fd}}").startswith("/memfd:mpcore"):
            owned.add(os.stat(f"/proc/self/fd/{{fd}}").st_ino)
    except FileNotFoundError:
        pass
with open("/proc/self/maps") as f:
    mapped = {{int(x.split()[4]) for x in f if "/memfd:mpcore" in x}}
g.barrier(60 * SLOW)      # every rank has looked before any buffer goes
result = ok, owned, mapped
''', timeout=scaled(120))
    assert [ok for ok, _, _ in res] == [True] * ranks.world
    region = set.intersection(*(owned for _, owned, _ in res))
    for r, (_, _, mapped) in enumerate(res):
        for q, (_, owned, _) in enumerate(res):
            if q != r:
                theirs = owned - region
                assert len(theirs) == many
                assert theirs <= mapped, \
                    f"rank {r} maps {len(theirs & mapped)} of rank {q}'s {many} buffers"


def test_large_movers_copy_directly_between_the_ranks(ranks):
    """NOTE [ Copies between ranks' memory ]: ranks of one user copy large
    pieces straight from and into each other's buffers, which the tests
    above then exercise (the staged path: the test below)."""
    assert ranks.run("result = g.direct()") == [True] * ranks.world, \
        "process_vm_readv between the ranks failed: the kernel forbids it here"


def test_a_rank_that_may_not_copy_directly_makes_the_movers_stage(staged_pair):
    """Every rank then stages (they choose alike), and a send to that rank
    streams through the mailbox: the same bytes arrive."""
    assert staged_pair.run("result = g.direct()") == [False, False]
    n = 3 * CHUNK // 4 + 5      # float32: past MPC_COLL_CMA_AR_MIN
    res = staged_pair.run(f"x = data('float32', {n}, rank, 'staged')\n"
                          f"g.all_reduce(x.ctypes.data, {n}, {_core.COLL_DTYPES['float32']}, "
                          f"{_core.COLL_OPS['SUM']}, 60)\nresult = digest(x)")
    want = reference("float32", "SUM", [data("float32", n, q, "staged") for q in range(2)])
    assert res == [digest(want)] * 2
    _gather_and_scatter_move_every_piece(staged_pair)
    _broadcast_from_every_root(staged_pair)
    _all_gather_and_reduce_scatter(staged_pair)
    _all_to_all_equal_uneven_zero_and_large(staged_pair)
    _send_recv_in_order_small_and_large(staged_pair)


def test_recv_from_any_source_takes_every_sender(ranks):
    W = ranks.world
    res = ranks.run(r'''
if rank == 0:
    got = {}
    for _ in range(3 * (world - 1)):
        m = np.zeros(1000, np.uint8)
        src = g.recv(m.ctypes.data, 1000, -1, 9, 60 * SLOW)
        got.setdefault(src, []).append(digest(m))
    result = got
else:
    for k in range(3):
        g.send(blob(1000, rank, k).ctypes.data, 1000, 0, 9, 60 * SLOW)
''')
    assert res[0] == {q: [digest(blob(1000, q, k)) for k in range(3)] for q in range(1, W)}


@pytest.mark.parametrize("n", [BIG, 2 * BIG + 1], ids=["streamed", "direct"])
def test_exchange_larger_than_the_mailboxes_with_send_and_recv_on_two_threads(pair, n):
    """Both ranks send n bytes to each other at once: each send waits for
    the peer's recv, which runs on another thread of the peer meanwhile."""
    res = pair.run(r'''
import threading
peer = 1 - rank
mine = blob(BIG, rank, "exchange")
errs = []
def sender():
    try:
        g.send(mine.ctypes.data, BIG, peer, 1, 60 * SLOW)
    except BaseException as e:
        errs.append(repr(e))
t = threading.Thread(target=sender)
t.start()
got = np.zeros(BIG, np.uint8)
src = g.recv(got.ctypes.data, BIG, peer, 1, 60 * SLOW)
t.join()
result = errs, src, digest(got)
'''.replace("BIG", str(n)))
    for r, (errs, src, got) in enumerate(res):
        assert errs == [] and src == 1 - r, (r, errs, src)
        assert got == digest(blob(n, 1 - r, "exchange")), r


def test_recv_takes_the_oldest_message_with_its_tag_past_others(pair):
    """As gloo matches: a recv for tag t takes the first message with tag t
    from its source, even when messages with other tags came first (one of
    them larger than the mailbox); a message of the wrong size is an error
    and stays for a recv that fits."""
    res = pair.run(r'''
if rank == 0:
    for n, tag in SENDS:
        g.send(blob(n, 0, tag).ctypes.data, n, 1, tag, 60 * SLOW)
    result = None
else:
    def recv(n, src, tag):
        m = np.zeros(n, np.uint8)
        got = g.recv(m.ctypes.data, n, src, tag, 60 * SLOW)
        return got, digest(m)
    out = [recv(100, 0, 2), recv(BIG3, -1, 1), recv(50, 0, 11)]
    try:
        g.recv(np.zeros(99, np.uint8).ctypes.data, 99, 0, 3, 60 * SLOW)
        err = None
    except ValueError as e:
        err = str(e)
    out.append(recv(100, 0, 3))
    result = out, err
'''.replace("SENDS", repr(SENDS)).replace("BIG3", str(3 * CHUNK)))
    out, err = res[1]
    assert out == [(0, digest(blob(100, 0, 2))), (0, digest(blob(3 * CHUNK, 0, 1))),
                   (0, digest(blob(50, 0, 11))), (0, digest(blob(100, 0, 3)))]
    assert err is not None and "99 bytes" in err and "100 bytes" in err and "tag 3" in err, err


SENDS = [(3 * CHUNK, 1), (100, 2), (50, 11), (100, 3)]


def test_bad_peers_are_refused(pair):
    res = pair.run(r'''
errs = []
for fn in (lambda: g.send(0, 0, rank, 0, 1), lambda: g.send(0, 0, 2, 0, 1),
           lambda: g.recv(0, 0, rank, 0, 1), lambda: g.recv(0, 0, -2, 0, 1),
           lambda: g.send(0, 0, 1 - rank, -1, 1),
           lambda: g.all_to_all(0, 0, [0], [0, 0], 1)):
    try:
        fn()
        errs.append(None)
    except ValueError as e:
        errs.append(str(e))
result = errs
''')
    for r, errs in enumerate(res):
        assert all(errs), errs
        assert f"rank {r}" in errs[0] and "rank 2" in errs[1] and "rank -2" in errs[3], errs
        assert "tag -1" in errs[4] and "send_sizes" in errs[5], errs


def test_a_dead_peer_during_recv_is_named_within_a_second():
    rk = Ranks(3)
    try:
        rk.send(r'''
import time
t0 = time.monotonic()
try:
    g.recv(np.zeros(8, np.uint8).ctypes.data, 8, 0, 0, 60 * SLOW)
    result = None
except RuntimeError as e:
    result = str(e), time.monotonic() - t0
''', ranks=[1, 2])
        rk.send("import time; time.sleep(0.3)", ranks=[0])
        assert rk.collect(10, ranks=[0])[0] == {"value": None}
        os.kill(rk.pids[0], signal.SIGKILL)
        killed = time.monotonic()
        res = rk.collect(10, ranks=[1, 2])
        took = time.monotonic() - killed
    finally:
        rk.close()
    for r, x in zip((1, 2), res):
        msg, _ = x["value"]
        assert "rank 0" in msg and str(rk.pids[0]) in msg, msg
    assert took < scaled(1.0), f"the ranks noticed rank 0's death after {took:.2f}s"
    kids, fds = _gone(rk)
    assert not kids and not fds, f"left behind: processes {kids}, memfds {fds}"


def test_recv_timeout_names_the_peer():
    rk = Ranks(2)
    try:
        rk.send(r'''
try:
    g.recv(np.zeros(8, np.uint8).ctypes.data, 8, 0, 0, 0.3)
    result = None
except TimeoutError as e:
    result = str(e)
''', ranks=[1])
        res = rk.collect(10, ranks=[1])
    finally:
        rk.close()
    assert res[0]["value"] is not None and "rank 0" in res[0]["value"], res


def test_ctrl_c_during_recv_raises_there_and_breaks_the_group():
    rk = Ranks(2)
    try:
        rk.send(r'''
try:
    g.recv(np.zeros(8, np.uint8).ctypes.data, 8, 0, 0, 60 * SLOW)
    result = None
except KeyboardInterrupt:
    result = "interrupted"
''', ranks=[1])
        deadline = time.monotonic() + scaled(30)   # until rank 1 sleeps in its recv
        while "futex" not in open(f"/proc/{rk.pids[1]}/wchan").read():
            assert time.monotonic() < deadline, "rank 1 never waited in recv"
            time.sleep(0.01)
        os.kill(rk.pids[1], signal.SIGINT)
        assert rk.collect(10, ranks=[1]) == [{"value": "interrupted"}]
        rk.send(r'''
try:
    g.send(np.zeros(8, np.uint8).ctypes.data, 8, 1, 0, 10)
    result = None
except RuntimeError as e:
    result = str(e)
''', ranks=[0])
        got = rk.collect(10, ranks=[0])[0]["value"]
    finally:
        _finish(rk)
    assert got is not None and "rank 1 was interrupted during recv from rank 0" in got, got
