"""mpcore.distributed (collectives over shared memory) and
mpcore.parallel.DistributedDataParallel, against numpy references and
against torch's own DDP over gloo.

Every multi-process case runs as ONE fresh program per world size, which
loops over all its cases and writes a report (a JSON or torch.save file per
rank); the tests assert on those reports.  Ranks make their data from seeds
that name (dtype, length, rank, case), so every rank can rebuild every other
rank's input and compute the reference itself, and a reduction that mixes up
ranks, pieces or slices is caught.

Programs that run under `mpcore run` or plain python run in a
session of their own (run_in_session), and the test waits for all of it
to go; the collective programs run under the Scenario harness, which also
checks that no mpcore memfd, keeper or /dev/shm entry outlives them.
"""
import ast
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from helpers import article, fresh_env, require, run_in_session, scaled

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("leak_check")]

def _have_gloo():
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_gloo_available()
    except ImportError:
        return False


@pytest.fixture(autouse=True)
def needs_gloo():
    require(_have_gloo(), "torch.distributed with gloo is not available")


def child_env(**extra):
    """The environment of a fresh program: none of mpcore's switches (no
    MPCORE_RUN, no keeper or zygote of ours), no rendezvous variables of
    ours."""
    env = {k: v for k, v in fresh_env().items()
           if not k.startswith("MPCORE_") and k not in (
               "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE")}
    env.update(extra)
    return env


def write(tmp_path, name, code):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def report_of(r):
    reports = [l for l in r.stdout.splitlines() if l.startswith("REPORT ")]
    assert r.returncode == 0 and len(reports) == 1, (
        f"rc={r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-6000:]}")
    return ast.literal_eval(reports[0][len("REPORT "):])


# --- 1. every op and dtype, world sizes 1..5 ---------------------------------------

COLLECTIVES = r'''
import datetime, hashlib, json, os, sys, time, traceback, zlib
import numpy as np
import torch
import mpcore
import mpcore.distributed as dist
from mpcore.dist import _reduce
from mpcore import _core
from torch.distributed import distributed_c10d as c10d

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64,
          "uint8": torch.uint8}
FLOATS = ("float32", "float64", "float16", "bfloat16")
# relative rounding unit of the result's dtype, and of what it accumulates in
EPS = {"float32": 2.0 ** -24, "float64": 2.0 ** -53, "float16": 2.0 ** -11,
       "bfloat16": 2.0 ** -8}
ACC = {"float32": 2.0 ** -24, "float64": 2.0 ** -53, "float16": 2.0 ** -24,
       "bfloat16": 2.0 ** -24}
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
LENGTHS = (1, 7, 1001, 70_001)          # 70_001: past the one-shot size for every dtype
# more than one staging piece per rank (1 MiB; all-reduce: 256 KiB)
BIG = (("float32", 300_001, OPS), ("bfloat16", 600_001, ("SUM", "AVG")),
       ("int64", 150_001, ("SUM", "MAX")), ("uint8", 1_100_001, ("SUM",)))

_cache = {}


def data(name, n, rank, tag):
    """Rank `rank`'s input for a case: the tensor, and its exact values as a
    float64 (floats) or int64 (ints) numpy array."""
    key = (name, n, rank, tag)
    if key not in _cache:
        rng = np.random.default_rng(zlib.crc32(repr(key).encode()))
        if name in FLOATS:
            x = rng.uniform(-2.0, 2.0, n)
        elif name == "uint8":
            x = rng.integers(0, 256, n)
        else:
            x = rng.integers(-40, 41, n)
        t = torch.from_numpy(x).to(DTYPES[name])
        exact = t.double().numpy() if name in FLOATS else t.long().numpy()
        _cache[key] = (t, exact)
    t, exact = _cache[key]
    return t.clone(), exact


def numpy_of(t):
    return t.double().numpy() if t.is_floating_point() else t.long().numpy()


def reference(name, op, arrays, world):
    """op over the ranks' arrays, in float64 (floats) or int64 (ints), then
    what the dtype keeps (uint8 wraps modulo 256)."""
    a = np.stack(arrays)
    if op in ("SUM", "AVG"):
        r = a.sum(0)
    elif op == "PRODUCT":
        r = a.prod(0)
    elif op == "MIN":
        r = a.min(0)
    else:
        r = a.max(0)
    if op == "AVG":
        r = r / world
    if name == "uint8":
        r = r % 256
    return r


def close(name, op, got, ref, world):
    """got (numpy, float64/int64) against the float64/int64 reference."""
    if name not in FLOATS or op in ("MIN", "MAX"):
        wrong = np.flatnonzero(got != ref)
        return not wrong.size, (f"{wrong.size} of {ref.size} wrong, first at {wrong[0]}: "
                                f"got {got[wrong[0]]}, want {ref[wrong[0]]}" if wrong.size else "")
    # float32 accumulation in rank order (float64 for float64), then one
    # rounding to the dtype: a few ulps of the dtype relative to the result,
    # plus the accumulation's error relative to the inputs (|x| <= 2).
    rtol = 2 * EPS[name] + 2 * world * ACC[name]
    atol = 4.0 * world * world * ACC[name] * (2.0 ** world if op == "PRODUCT" else 1.0)
    if name == "float16":
        atol += 2.0 ** -24      # float16's subnormal spacing
    err = np.abs(got - ref)
    wrong = np.flatnonzero(~(err <= rtol * np.abs(ref) + atol))
    return not wrong.size, (f"{wrong.size} of {ref.size} out of tolerance, max error "
                            f"{err.max():.3g}, first at {wrong[0]}: got {got[wrong[0]]!r}, "
                            f"want {ref[wrong[0]]!r}" if wrong.size else "")


def main_worker(rank, world, outdir):
    out = {"rank": rank, "world": world, "failures": [], "cases": 0, "hashes": {},
           "fallbacks": [], "error": None}
    try:
        run(rank, world, outdir, out)
    except BaseException:
        out["error"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if out["error"]:
        raise SystemExit(1)


def run(rank, world, outdir, out):
    torch.set_num_threads(1)    # W ranks on a few cores: no spinning intra-op threads
    dist.init_process_group("gloo")
    out["shm"] = dist.shm_group_active()
    out["rank_seen"] = dist.get_rank()
    out["world_seen"] = dist.get_world_size()
    # The default group is mpcore's, and serves every call over shared
    # memory (it holds no gloo group to hand calls to).
    pg = c10d._get_default_group()
    if type(pg).__name__ != "ProcessGroupMpcore" or pg.gloo is not None:
        out["fallbacks"].append(repr(pg))
    W = world
    fail = out["failures"]
    shm = dist.shm_group()

    def check(key, ok, detail=""):
        out["cases"] += 1
        if not ok:
            fail.append(f"{key}: {detail}")

    def digest(t):
        return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

    def all_reduce_case(name, n, op, tag):
        key = f"all_reduce {name} n={n} {op}"
        t, _ = data(name, n, rank, tag)
        arrays = [data(name, n, q, tag)[1] for q in range(W)]
        r = dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        if r is not None:
            fail.append(f"{key}: a synchronous all_reduce returned {r!r}, not None")
        ok, why = close(name, op, numpy_of(t), reference(name, op, arrays, W), W)
        check(key, ok and t.dtype == DTYPES[name] and t.shape == (n,), why)
        out["hashes"][key] = digest(t)
        # The same, with every rank's data in a group buffer (at a different
        # place in each), and with only the even ranks naming one (then the
        # staging path serves all): the same bits either way.
        for who in ("every rank", "even ranks") if W > 1 else ("every rank",):
            mkey = f"{key} in group buffers of {who}"
            src, _ = data(name, n, rank, tag)
            es, at = src.element_size(), 3 * rank + 1
            buf = _core.GroupBuffer((n + at) * es)
            m = torch.frombuffer(buf, dtype=DTYPES[name], count=n, offset=at * es)
            m.copy_(src)
            named = buf if who == "every rank" or rank % 2 == 0 else None
            shm.core.all_reduce(m.data_ptr(), n, _reduce.DTYPES[m.dtype], OPS.index(op), None, named)
            check(mkey, digest(m) == out["hashes"][key], "differs from the staged result")
            # a reduce to the last rank: its data becomes the same bits, the
            # others' data stays
            m.copy_(src)
            shm.core.reduce(m.data_ptr(), n, _reduce.DTYPES[m.dtype], OPS.index(op), W - 1, None,
                            named)
            check(mkey.replace("all_reduce", f"reduce to {W - 1}"),
                  digest(m) == (out["hashes"][key] if rank == W - 1 else digest(src)),
                  "differs from the staged all-reduce" if rank == W - 1 else "the data changed")
            del m, buf

    def avg_int_case(name, n):
        key = f"all_reduce {name} n={n} AVG"
        t, exact = data(name, n, rank, "avg-int")
        try:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            check(key, "avg" in str(e).lower() and name in str(e), f"unclear error {msg}")
            check(key + " leaves the tensor", np.array_equal(numpy_of(t), exact),
                  "the tensor changed")
        else:
            check(key, False, f"no error; got {numpy_of(t)[:5]}")
        o = torch.empty(n, dtype=DTYPES[name])
        i, _ = data(name, n * W, rank, "avg-int-rs")
        try:
            dist.reduce_scatter_tensor(o, i, op=dist.ReduceOp.AVG)
        except Exception as e:
            check("reduce_scatter_tensor " + key[11:], "avg" in str(e).lower(),
                  f"unclear error {type(e).__name__}: {e}")
        else:
            check("reduce_scatter_tensor " + key[11:], False, "no error")

    def broadcast_case(name, n, root):
        key = f"broadcast {name} n={n} root={root}"
        t, _ = data(name, n, rank, f"bc{root}")
        want, _ = data(name, n, root, f"bc{root}")
        dist.broadcast(t, src=root)
        check(key, torch.equal(t.view(torch.uint8), want.view(torch.uint8)))

    def all_gather_case(name, n):
        t, _ = data(name, n, rank, "ag")
        want = [data(name, n, q, "ag")[0] for q in range(W)]
        outs = [torch.full((n,), 3, dtype=DTYPES[name]) for _ in range(W)]
        dist.all_gather(outs, t)
        check(f"all_gather {name} n={n}",
              all(torch.equal(o.view(torch.uint8), w.view(torch.uint8))
                  for o, w in zip(outs, want)))
        check(f"all_gather {name} n={n} input kept", torch.equal(t, data(name, n, rank, "ag")[0]))
        # into a flat tensor, and into a (world, n) one
        flat = torch.full((W * n,), 3, dtype=DTYPES[name])
        dist.all_gather_into_tensor(flat, t)
        check(f"all_gather_into_tensor {name} n={n}",
              torch.equal(flat.view(torch.uint8), torch.cat(want).view(torch.uint8)))
        if n in (7, 1001):
            two = torch.full((W, n), 3, dtype=DTYPES[name])
            dist.all_gather_into_tensor(two, t)
            check(f"all_gather_into_tensor {name} n={n} 2-d",
                  torch.equal(two.view(torch.uint8), torch.stack(want).view(torch.uint8)))

    def reduce_scatter_case(name, n, op, tensor_form=True):
        tag = "rs"
        inp, _ = data(name, W * n, rank, tag)
        arrays = [data(name, W * n, q, tag)[1][rank * n:(rank + 1) * n] for q in range(W)]
        o = torch.full((n,), 3, dtype=DTYPES[name])
        rop = getattr(dist.ReduceOp, op)
        if tensor_form:
            key = f"reduce_scatter_tensor {name} n={n} {op}"
            dist.reduce_scatter_tensor(o, inp, op=rop)
        else:
            key = f"reduce_scatter {name} n={n} {op}"
            dist.reduce_scatter(o, list(inp.split(n)), op=rop)
        ok, why = close(name, op, numpy_of(o), reference(name, op, arrays, W), W)
        check(key, ok, why)
        check(key + " input kept", torch.equal(inp, data(name, W * n, rank, tag)[0]))

    for name in DTYPES:
        for n in LENGTHS:
            for op in OPS:
                if op == "AVG" and name not in FLOATS:
                    continue
                all_reduce_case(name, n, op, "ar")
            if name not in FLOATS:
                avg_int_case(name, n)
            for root in range(W):
                broadcast_case(name, n, root)
            all_gather_case(name, n)
            for op in OPS:
                if op == "AVG" and name not in FLOATS:
                    continue
                reduce_scatter_case(name, n, op, tensor_form=True)
                reduce_scatter_case(name, n, op, tensor_form=False)
        _cache.clear()
    for name, n, ops in BIG:
        for op in ops:
            all_reduce_case(name, n, op, "big")
        for root in sorted({0, W - 1}):
            broadcast_case(name, n, root)
        all_gather_case(name, n)
        if name == "float32":
            # each rank's input is W * m elements, more than one piece in all
            m = n // W
            for op in ("SUM", "MAX"):
                reduce_scatter_case(name, m, op, tensor_form=True)
            reduce_scatter_case(name, m, "AVG", tensor_form=False)
        _cache.clear()

    # barrier: nobody leaves before everyone came (one late rank each round)
    for i in range(3):
        if rank == i % W:
            time.sleep(0.05)
        open(os.path.join(outdir, f"bar{i}.{rank}"), "w").close()
        if i == 2:
            r = dist.barrier(timeout=datetime.timedelta(seconds=60))
        else:
            r = dist.barrier()
        seen = [q for q in range(W) if os.path.exists(os.path.join(outdir, f"bar{i}.{q}"))]
        check(f"barrier {i}", seen == list(range(W)) and r is None, f"saw ranks {seen}, {r!r}")
    out["shm_after"] = dist.shm_group_active()
    dist.destroy_process_group()
    out["shm_destroyed"] = dist.shm_group_active()
    out["initialized_after"] = dist.is_initialized()


if __name__ == "__main__":
    world, outdir = int(sys.argv[1]), sys.argv[2]
    mpcore.spawn(main_worker, args=(world, outdir), nprocs=world)
    print("REPORT", repr({"done": True}), flush=True)
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_every_op_and_dtype_against_numpy(world, tmp_path, scenario):
    path = write(tmp_path, "collectives.py", COLLECTIVES)
    outdir = tmp_path / "out"
    outdir.mkdir()
    env = child_env(**scenario.env())
    try:
        r = subprocess.run([sys.executable, path, str(world), str(outdir)], capture_output=True,
                           text=True, timeout=scaled(130), env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the program did not finish; still running: "
                    f"{scenario.describe(scenario.live())}\n{e.stdout}\n{e.stderr}")
    reports = []
    for rank in range(world):
        f = outdir / f"rank{rank}.json"
        assert f.exists(), f"rank {rank} wrote no report\n{r.stdout}\n{r.stderr[-6000:]}"
        reports.append(json.loads(f.read_text()))
    for rep in reports:
        assert rep["error"] is None, f"rank {rep['rank']} failed:\n{rep['error']}"
    assert report_of(r) == {"done": True}
    for rep in reports:
        rank = rep["rank"]
        assert (rep["rank_seen"], rep["world_seen"]) == (rank, world)
        assert rep["shm"] is True and rep["shm_after"] is True, "not the shared-memory path"
        assert rep["fallbacks"] == [], f"rank {rank} fell back to gloo: {rep['fallbacks']}"
        assert rep["failures"] == [], (f"rank {rank}: {len(rep['failures'])} failing cases:\n"
                                       + "\n".join(rep["failures"][:40]))
        assert rep["shm_destroyed"] is False and rep["initialized_after"] is False
    # every rank ran every case, and every rank got the same bits from all_reduce
    assert len({rep["cases"] for rep in reports}) == 1
    assert reports[0]["cases"] > 300
    for rep in reports[1:]:
        differ = [k for k, h in rep["hashes"].items() if reports[0]["hashes"].get(k) != h]
        assert not differ, f"rank {rep['rank']} differs from rank 0 in: {differ[:20]}"
    scenario.check_clean()


def test_group_buffer_bad_input():
    """Group buffers (NOTE [ Group buffers ]): clear errors for a size of
    nothing or of more than the machine has, and for data that does not lie
    in the buffer named; a one-rank all-reduce in one leaves the data."""
    import numpy as np
    from mpcore import _core
    with pytest.raises(ValueError, match="at least one byte"):
        _core.GroupBuffer(0)
    with pytest.raises(MemoryError, match=str(1 << 50)):
        _core.GroupBuffer(1 << 50)
    fd = _core.coll_create(1, 1 << 20)
    try:
        g = _core.Group(fd, 0, 1)
    finally:
        os.close(fd)
    b, other = _core.GroupBuffer(4000), _core.GroupBuffer(4096)
    assert b.nbytes == 4096 and memoryview(b).nbytes == 4096    # whole pages
    a = np.frombuffer(b, np.float32)
    a[:] = np.arange(1024)
    for addr, count in ((other.address, 10), (b.address + 4000, 100), (b.address - 4, 2)):
        with pytest.raises(ValueError, match="does not lie in the group buffer given"):
            g.all_reduce(addr, count, 0, 0, None, b)
    for addr, nbytes in ((other.address, 40), (b.address + 4000, 400), (b.address - 4, 8)):
        with pytest.raises(ValueError, match="does not lie in the group buffer given"):
            g.all_to_all(other.address, addr, [nbytes], [nbytes], None, b)
    with pytest.raises(TypeError, match="GroupBuffer"):
        g.all_reduce(b.address, 1, 0, 0, None, bytearray(4))
    with pytest.raises(TypeError, match="all_to_all: buffer must be a GroupBuffer"):
        g.all_to_all(other.address, b.address, [4], [4], None, bytearray(4))
    g.all_reduce(b.address + 4, 1023, 0, 1, None, b)
    assert np.array_equal(a, np.arange(1024))
    g.close()


# --- 2. async_op=True: Work, futures, order ------------------------------------------

ASYNC = r'''
import json, os, sys, traceback
import torch
import mpcore
import mpcore.distributed as dist
from torch.distributed import distributed_c10d as c10d


def worker(rank, world, outdir):
    torch.set_num_threads(1)
    out = {"rank": rank, "checks": {}, "error": None}
    c = out["checks"]
    try:
        run(rank, world, c)
    except BaseException:
        out["error"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def run(rank, W, c):
    dist.init_process_group("gloo")
    store = c10d._get_default_store()
    c["shm"] = dist.shm_group_active()
    S = W * (W + 1) / 2

    # Work's surface, and the result after wait()
    t = torch.full((1001,), float(rank + 1))
    w = dist.all_reduce(t, async_op=True)
    c["surface"] = all(callable(getattr(w, m, None))
                       for m in ("wait", "is_completed", "get_future"))
    c["wait_returns"] = w.wait()
    c["completed_after_wait"] = w.is_completed()
    c["value_after_wait"] = bool(torch.all(t == S))
    fut = w.get_future()
    c["future_done"] = fut.done()
    v = fut.wait()
    c["future_value"] = (isinstance(v, list) and len(v) == 1 and v[0].data_ptr() == t.data_ptr()
                         and bool(torch.all(v[0] == S)))

    # Not completed until every rank has called: rank 0 calls only after
    # the others have looked (through the store, no sleeping).
    t = torch.full((7,), float(rank + 1))
    if rank == 0:
        for q in range(1, W):
            store.wait([f"looked/{q}"])
        w = dist.all_reduce(t, async_op=True)
        fut = w.get_future()
        c["pending"] = [False, False, False]
    else:
        w = dist.all_reduce(t, async_op=True)
        fut = w.get_future()        # asked for before the work completes
        c["pending"] = [w.is_completed(), fut.done(), bool(torch.all(t == S))]
        store.set(f"looked/{rank}", "1")
    doubled = fut.then(lambda f: f.value()[0] * 2)
    c["then"] = bool(torch.all(doubled.wait() == 2 * S))
    c["pending_value"] = w.wait() is True and bool(torch.all(t == S)) and w.is_completed()

    # Several async ops, then a synchronous one: done in the order asked.
    # SUM then PRODUCT on the same tensor gives S**W, the other way W * W!.
    x = torch.full((3,), float(rank + 1))
    b = torch.full((5,), float(rank))
    g_in = torch.full((11,), float(rank))
    g_out = torch.empty(11 * W)
    works = [dist.all_reduce(x, async_op=True),
             dist.broadcast(b, src=W - 1, async_op=True),
             dist.all_reduce(x, op=dist.ReduceOp.PRODUCT, async_op=True),
             dist.all_gather_into_tensor(g_out, g_in, async_op=True),
             dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)]
    y = torch.full((13,), float(rank + 1))
    c["sync_returns"] = repr(dist.all_reduce(y))
    c["sync_value"] = bool(torch.all(y == S))
    c["done_before_sync"] = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    c["order_value"] = x.tolist() == [S ** W] * 3
    c["order_broadcast"] = b.tolist() == [float(W - 1)] * 5
    c["order_gather"] = g_out.tolist() == [float(q) for q in range(W) for _ in range(11)]

    # Many async all_reduces, waited for in reverse order
    ts = [torch.full((64 * (i + 1),), float(rank + i)) for i in range(20)]
    ws = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(ws):
        w.wait()
    c["many"] = all(bool(torch.all(t == sum(q + i for q in range(W)))) for i, t in enumerate(ts))

    # async barrier, broadcast, all_gather (list), reduce_scatter (both)
    c["barrier"] = dist.barrier(async_op=True).wait() is True
    b = torch.full((5,), float(rank))
    dist.broadcast(b, src=0, async_op=True).wait()
    c["broadcast"] = b.tolist() == [0.0] * 5
    outs = [torch.empty(4) for _ in range(W)]
    mine = torch.full((4,), float(rank))
    dist.all_gather(outs, mine, async_op=True).wait()
    c["all_gather"] = [o.tolist() for o in outs] == [[float(q)] * 4 for q in range(W)]
    inp = torch.arange(W * 4, dtype=torch.float32) + rank
    o = torch.empty(4)
    dist.reduce_scatter_tensor(o, inp, async_op=True).wait()
    want = [sum(float(rank * 4 + j + q) for q in range(W)) for j in range(4)]
    c["reduce_scatter_tensor"] = o.tolist() == want
    o = torch.empty(4)
    dist.reduce_scatter(o, list(inp.split(4)), async_op=True).wait()
    c["reduce_scatter"] = o.tolist() == want
    c["reduce_scatter_got"] = (o.tolist(), want)

    # A failing async op reports through its Work, and the group goes on
    i = torch.arange(5, dtype=torch.int32)
    w = dist.all_reduce(i, op=dist.ReduceOp.AVG, async_op=True)
    try:
        w.wait()
        c["error_wait"] = "no error"
    except Exception as e:
        c["error_wait"] = f"{type(e).__name__}: {e}"
    c["error_completed"] = w.is_completed()
    try:
        w.get_future().wait()
        c["error_future"] = "no error"
    except Exception as e:
        c["error_future"] = f"{type(e).__name__}: {e}"
    z = torch.full((9,), float(rank + 1))
    dist.all_reduce(z)
    c["after_error"] = bool(torch.all(z == S))

    # Inputs the caller does not keep: torch's Work holds its tensors until
    # the collective is done, so a temporary input is fine.  The last rank
    # calls only after the others have called, dropped their inputs and
    # allocated (and filled) buffers of the same size.
    n = 1000

    def got(t):     # a few of the distinct values, for the report
        return sorted(set(t.tolist()))[:6]

    def temporaries(q_tag, call):
        if rank == W - 1:
            for q in range(W - 1):
                store.wait([f"{q_tag}/{q}"])
            return call()
        w, res = call()
        junk = [torch.full((W * n,), -7.0) for _ in range(8)] + \
               [torch.full((n,), -7.0) for _ in range(8)]
        store.set(f"{q_tag}/{rank}", "1")
        w.wait()
        del junk
        return w, res

    def rs_list():
        o = torch.empty(n)
        inputs = [torch.full((n,), float(rank + 1)) for _ in range(W)]
        return dist.reduce_scatter(o, inputs, async_op=True), (o, inputs)
    w, (o, inputs) = temporaries("rs_list", rs_list)
    w.wait()
    c["temp_reduce_scatter_list"] = (bool(torch.all(o == S)), got(o), S)

    def rs_tensor():
        o = torch.empty(n)
        return dist.reduce_scatter_tensor(o, torch.full((W * n,), float(rank + 1)),
                                          async_op=True), o
    w, o = temporaries("rs_tensor", rs_tensor)
    w.wait()
    c["temp_reduce_scatter_tensor"] = (bool(torch.all(o == S)), got(o), S)

    def ag_tensor():
        o = torch.empty(W * n)
        return dist.all_gather_into_tensor(o, torch.full((n,), float(rank + 1)),
                                           async_op=True), o
    w, o = temporaries("ag_tensor", ag_tensor)
    w.wait()
    want = [float(q + 1) for q in range(W) for _ in range(n)]
    c["temp_all_gather_into_tensor"] = (o.tolist() == want, got(o), sorted(set(want)))

    def ag_list():
        outs = [torch.empty(n) for _ in range(W)]
        return dist.all_gather(outs, torch.full((n,), float(rank + 1)), async_op=True), outs
    w, outs = temporaries("ag_list", ag_list)
    w.wait()
    c["temp_all_gather_list"] = ([o.tolist() for o in outs] == [[float(q + 1)] * n
                                                               for q in range(W)],
                                 got(torch.cat(outs)), [float(q + 1) for q in range(W)])
    c["shm_end"] = dist.shm_group_active()
    dist.destroy_process_group()


if __name__ == "__main__":
    world, outdir = int(sys.argv[1]), sys.argv[2]
    mpcore.spawn(worker, args=(world, outdir), nprocs=world)
    print("REPORT", repr({"done": True}), flush=True)
'''


def run_async(world, tmp_path, scenario):
    path = write(tmp_path, "async.py", ASYNC)
    outdir = tmp_path / "out"
    outdir.mkdir()
    r = subprocess.run([sys.executable, path, str(world), str(outdir)], capture_output=True,
                       text=True, timeout=scaled(100), env=child_env(**scenario.env()))
    reps = {}
    for rank in range(world):
        f = outdir / f"rank{rank}.json"
        assert f.exists(), f"rank {rank} wrote no report\n{r.stdout}\n{r.stderr[-6000:]}"
        rep = json.loads(f.read_text())
        assert rep["error"] is None, f"rank {rank} failed:\n{rep['error']}"
        reps[rank] = rep["checks"]
    assert report_of(r) == {"done": True}
    scenario.check_clean()
    return reps


@pytest.fixture(scope="module")
def async_reports():
    """The async program's checks for world sizes 2 and 3 (each run once)."""
    return {}


def async_checks(world, async_reports, tmp_path, scenario):
    if world not in async_reports:
        async_reports[world] = run_async(world, tmp_path, scenario)
    return async_reports[world]


@pytest.mark.parametrize("world", [2, 3])
def test_async_work_surface_and_results(world, async_reports, tmp_path, scenario):
    reps = async_checks(world, async_reports, tmp_path, scenario)
    for rank, c in reps.items():
        assert c["shm"] and c["shm_end"], rank
        assert c["surface"], rank
        assert c["wait_returns"] is True
        assert c["completed_after_wait"] and c["value_after_wait"], (rank, c)
        assert c["future_done"] and c["future_value"], (rank, c)
        # before every rank has called, the work is pending
        assert c["pending"] == [False, False, False], (rank, c["pending"])
        assert c["then"] and c["pending_value"], (rank, c)
        for name in ("many", "barrier", "broadcast", "all_gather", "reduce_scatter_tensor"):
            assert c[name], (rank, name)


@pytest.mark.parametrize("world", [2, 3])
def test_async_reduce_scatter_list(world, async_reports, tmp_path, scenario):
    # The caller keeps its output and its input list; the result after
    # wait() is the rank's slice of the sum.
    reps = async_checks(world, async_reports, tmp_path, scenario)
    bad = {rank: "got %s, want %s" % tuple(c["reduce_scatter_got"])
           for rank, c in reps.items() if not c["reduce_scatter"]}
    assert not bad, f"async reduce_scatter (list form) wrong: {bad}"


@pytest.mark.parametrize("world", [2, 3])
def test_async_ops_then_sync_keep_order(world, async_reports, tmp_path, scenario):
    reps = async_checks(world, async_reports, tmp_path, scenario)
    for rank, c in reps.items():
        assert c["sync_returns"] == "None"
        assert c["sync_value"], rank
        # the synchronous call runs after everything queued before it
        assert c["done_before_sync"] == [True] * 5, (rank, c["done_before_sync"])
        assert c["order_value"] and c["order_broadcast"] and c["order_gather"], (rank, c)


@pytest.mark.parametrize("world", [2, 3])
def test_async_error_reported_through_work(world, async_reports, tmp_path, scenario):
    reps = async_checks(world, async_reports, tmp_path, scenario)
    for rank, c in reps.items():
        assert "avg" in c["error_wait"].lower() and "int32" in c["error_wait"], c["error_wait"]
        assert c["error_completed"], rank
        assert "avg" in c["error_future"].lower(), c["error_future"]
        assert c["after_error"], rank


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["reduce_scatter_list", "reduce_scatter_tensor",
                                  "all_gather_into_tensor", "all_gather_list"])
def test_async_input_not_kept_by_caller(world, case, async_reports, tmp_path, scenario):
    """torch's Work keeps a collective's tensors alive until it is done; an
    input the caller drops (or one mpcore made itself) must not be freed
    and reused while the collective still reads it."""
    reps = async_checks(world, async_reports, tmp_path, scenario)
    bad = {rank: f"got values {c['temp_' + case][1]}, want {c['temp_' + case][2]}"
           for rank, c in reps.items() if not c["temp_" + case][0]}
    assert not bad, f"wrong results: {bad}"


# --- 3, 4. DDP: mpcore's against torch's ---------------------------------------------

DDP_PROGRAM = r'''
import copy, gc, os, socket, sys, threading, traceback, weakref
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
import torch
from torch import nn

STEPS = 10
CONFIGS = [
    ("default", {}, False),
    ("small_buckets", {"bucket_cap_mb": 0.0001}, False),        # 104 bytes a bucket
    ("bucket_view", {"bucket_cap_mb": 0.0001, "gradient_as_bucket_view": True}, False),
    ("unused", {"find_unused_parameters": True}, True),
]


class MLP(nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.fc1 = nn.Linear(10, 20)
        self.fc2 = nn.Linear(20, 1)
        if unused:
            self.branch = nn.Linear(20, 4)      # never used in forward

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(gen, n=16):
    return torch.randn(n, 10, generator=gen), torch.randn(n, 1, generator=gen)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def grads_of(model):
    return {k: (p.grad.clone() if p.grad is not None else None)
            for k, p in model.named_parameters()}


def worker(rank, mode, W, out):
    torch.set_num_threads(1)
    if mode == "mpcore":
        import mpcore.distributed as dist
        from mpcore.parallel import DistributedDataParallel as DDP
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
    res = {"configs": {}, "error": None}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=W)
        for name, kw, unused in CONFIGS:
            torch.manual_seed(100 + rank)    # different on every rank: rank 0's are broadcast
            model = MLP(unused)
            ddp = DDP(model, **kw)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(1000 + rank)
            losses = []
            for step in range(STEPS):
                x, y = batch(gen)
                opt.zero_grad()
                loss = loss_of(ddp, x, y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            log = ddp._get_ddp_logging_data()
            hooks = getattr(ddp, "_mpcore_hooks", None)
            bufs = list(hooks.buffers.values()) if hooks is not None else []
            # every gradient lies in one of the group buffers (they are views
            # of the buckets with gradient_as_bucket_view, else copies)
            in_bufs = sorted(k for k, p in model.named_parameters()
                       if p.grad is not None and any(
                           b.address <= p.grad.data_ptr() < b.address + b.nbytes for b in bufs))
            params = {k: v.detach().clone() for k, v in model.named_parameters()}
            kind = f"{type(ddp).__module__}.{type(ddp).__name__}"
            # Each buffer says when it is freed: the group's thread may still
            # be settling its last call's future (which holds the last
            # bucket) when drain() returns, so the test waits on that, bounded.
            freed = threading.Semaphore(0)
            nbufs = len([weakref.finalize(b, freed.release) for b in bufs])
            del ddp, opt, model, bufs, loss   # the last loss holds the graph: the parameters
            if hooks is not None:
                hooks.group.drain()
            gc.collect()
            for _ in range(nbufs):
                if not freed.acquire(timeout=10 * SLOW):
                    break
            res["configs"][name] = {
                "params": params,
                "losses": losses,
                "hooks": hooks is not None,
                "grads_in_buffers": in_bufs,
                "buffers_left": len(hooks.buffers) if hooks is not None else None,
                "bucket_sizes": str(log.get("rebuilt_bucket_sizes", log.get("bucket_sizes"))),
                "type": kind,
            }

        # no_sync: two backward passes without, one with synchronisation
        torch.manual_seed(7 + rank)
        model = MLP(False)
        ddp = DDP(model)
        init = copy.deepcopy(model)          # rank 0's parameters, on every rank
        gen = torch.Generator().manual_seed(2000 + rank)
        batches = [batch(gen, 8) for _ in range(3)]
        with ddp.no_sync():
            for x, y in batches[:2]:
                loss_of(ddp, x, y).backward()
        after_two = grads_of(model)
        x, y = batches[2]
        loss_of(ddp, x, y).backward()
        # by hand: every rank's three local passes on a plain copy, averaged in float64
        local = []
        for q in range(W):
            m = copy.deepcopy(init)
            g = torch.Generator().manual_seed(2000 + q)
            bs = [batch(g, 8) for _ in range(3)]
            for i, (x, y) in enumerate(bs):
                loss_of(m, x, y).backward()
                if i == 1 and q == rank:
                    local_two = grads_of(m)
            local.append(grads_of(m))
        res["nosync"] = {
            "grads": grads_of(model),
            "after_two": after_two,
            "local_two": local_two,
            "by_hand": {k: sum(l[k].double() for l in local) / W for k in local[0]},
            "hooks": getattr(ddp, "_mpcore_hooks", None) is not None,
        }
        dist.destroy_process_group()
    except BaseException:
        res["error"] = traceback.format_exc()
    res["mpcore_loaded"] = "mpcore" in sys.modules
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    mode, W, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if mode == "mpcore":
        import mpcore
        mpcore.spawn(worker, args=(mode, W, out), nprocs=W)
    else:
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        # fork: no second import of torch in every child (this machine is slow)
        mp.start_processes(worker, args=(mode, W, out), nprocs=W, start_method="fork")
    print("REPORT", repr({"mpcore_loaded": "mpcore" in sys.modules}), flush=True)
'''

RTOL, ATOL = 1e-5, 1e-6


def run_ddp(tmp_path, how, world):
    """Runs the DDP program: 'torch' (plain python, torch's DDP over gloo),
    'mpcore' (mpcore.spawn and mpcore.parallel's DDP), 'run' (the 'torch'
    program unchanged under `mpcore run`).  Returns (REPORT, per-rank results)."""
    import torch
    d = tmp_path / f"ddp-{how}-{world}"
    d.mkdir()
    path = write(d, "prog.py", DDP_PROGRAM)
    mode = "mpcore" if how == "mpcore" else "torch"
    cmd = [sys.executable] + (["-m", "mpcore", "run"] if how == "run" else []) + [
        path, mode, str(world), str(d)]
    r = run_in_session(cmd, cwd=str(d), env=child_env(), timeout=100)
    ranks = []
    for rank in range(world):
        f = d / f"rank{rank}.pt"
        assert f.exists(), f"{how}: rank {rank} wrote nothing\n{r.stdout}\n{r.stderr[-6000:]}"
        res = torch.load(f, weights_only=False)
        assert res["error"] is None, f"{how}: rank {rank} failed:\n{res['error']}"
        ranks.append(res)
    return report_of(r), ranks


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    cache = {}
    base = tmp_path_factory.mktemp("ddp")

    def get(how, world):
        if (how, world) not in cache:
            cache[how, world] = run_ddp(base, how, world)
        return cache[how, world]
    return get


def assert_close_dicts(got, want, what):
    import torch
    assert got.keys() == want.keys(), what
    for k in want:
        g, w = got[k], want[k]
        assert (g is None) == (w is None), (what, k)
        if w is None:
            continue
        ok = bool(torch.allclose(g.double(), w.double(), rtol=RTOL, atol=ATOL))
        assert ok, (f"{what}: {k} differs by up to "
                    f"{(g.double() - w.double()).abs().max().item():.3g}")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_torch_ddp_program_never_imports_mpcore(world, ddp_runs):
    report, ranks = ddp_runs("torch", world)
    assert report == {"mpcore_loaded": False}
    assert [r["mpcore_loaded"] for r in ranks] == [False] * world
    for r in ranks:
        for name, c in r["configs"].items():
            assert c["type"] == "torch.nn.parallel.distributed.DistributedDataParallel"
            assert not c["hooks"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("config", ["default", "small_buckets", "bucket_view", "unused"])
@pytest.mark.parametrize("world", [2, 3])
def test_mpcore_ddp_matches_torch_ddp(world, config, ddp_runs):
    _, want = ddp_runs("torch", world)
    _, got = ddp_runs("mpcore", world)
    for rank in range(world):
        c = got[rank]["configs"][config]
        assert c["type"] == "mpcore.parallel.DistributedDataParallel"
        assert c["hooks"], f"rank {rank}: mpcore's DDP did not use its hook"
        assert_close_dicts(c["params"], want[rank]["configs"][config]["params"],
                           f"{config}, rank {rank}, final parameters")
        # and every rank ends with rank 0's parameters
        assert_close_dicts(c["params"], got[0]["configs"][config]["params"],
                           f"{config}, rank {rank} against rank 0")
        # the buckets were moved into group buffers (the gradients are views
        # of them only with gradient_as_bucket_view), and freed with the DDP
        assert c["grads_in_buffers"] == (sorted(c["params"]) if config == "bucket_view" else [])
        assert c["buffers_left"] == 0
    if config in ("small_buckets", "bucket_view"):
        # several buckets (the same as torch's)
        sizes = got[0]["configs"][config]["bucket_sizes"]
        assert sizes == want[0]["configs"][config]["bucket_sizes"]
        assert len(re.findall(r"\d+", sizes)) > 1, sizes
    if config == "unused":
        p = got[0]["configs"][config]["params"]
        assert "branch.weight" in p


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_no_sync_accumulates(world, ddp_runs):
    _, want = ddp_runs("torch", world)
    _, got = ddp_runs("mpcore", world)
    import torch
    for rank in range(world):
        ns = got[rank]["nosync"]
        assert ns["hooks"]
        # under no_sync, nothing was averaged: the rank's own summed gradients
        assert_close_dicts(ns["after_two"], ns["local_two"], f"rank {rank} after no_sync")
        # then the average over ranks of the three passes' summed gradients
        assert_close_dicts(ns["grads"], ns["by_hand"], f"rank {rank} against the hand reference")
        assert_close_dicts(ns["grads"], want[rank]["nosync"]["grads"],
                           f"rank {rank} against torch's DDP")
        assert_close_dicts(want[rank]["nosync"]["grads"], ns["by_hand"],
                           f"rank {rank}: torch against the hand reference")
        if world > 1:
            assert not torch.equal(ns["after_two"]["fc2.bias"], ns["grads"]["fc2.bias"])


@pytest.mark.timeout(200)
def test_torch_ddp_program_under_mpcore_run(ddp_runs):
    """The same torch program, unchanged, under `mpcore run`: torch's names
    are mpcore's, the hook runs, and the result is torch's."""
    world = 2
    _, want = ddp_runs("torch", world)
    report, got = ddp_runs("run", world)
    assert report == {"mpcore_loaded": True}
    for rank in range(world):
        for config, c in got[rank]["configs"].items():
            assert c["type"] == "mpcore.parallel.DistributedDataParallel", c["type"]
            assert c["hooks"], (rank, config)
            assert_close_dicts(c["params"], want[rank]["configs"][config]["params"],
                               f"under mpcore run, {config}, rank {rank}")
        assert_close_dicts(got[rank]["nosync"]["grads"], want[rank]["nosync"]["grads"],
                           f"under mpcore run, no_sync, rank {rank}")


# --- 5. the article's ddp_cpu.py under `mpcore run` -----------------------------------

PROGRESS = re.compile(
    r"Process (\d+), Epoch (\d+), Loss: (-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|nan|inf)")


@pytest.mark.timeout(150)
def test_article_ddp_cpu_under_mpcore_run():
    path = article("ddp_cpu.py")
    env = child_env()
    env.pop("PYTHONUNBUFFERED", None)
    r = run_in_session([sys.executable, "-m", "mpcore", "run", path], cwd=os.path.dirname(path),
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "Traceback" not in r.stderr, r.stderr[-6000:]
    # Four processes share the pipe: parse the whole output, not line by line.
    found = PROGRESS.findall(r.stdout)
    assert len(found) == 40, r.stdout
    assert PROGRESS.sub("", r.stdout).strip() == "", f"other output:\n{r.stdout}"
    by_rank, by_epoch = {}, {}
    for rank, epoch, loss in found:
        by_rank.setdefault(int(rank), []).append(int(epoch))
        by_epoch.setdefault(int(epoch), {})[int(rank)] = loss
        assert float(loss) >= 0 and loss not in ("nan", "inf"), loss
    assert sorted(by_rank) == [0, 1, 2, 3]
    for rank, epochs in by_rank.items():
        assert epochs == list(range(10)), (rank, epochs)
    # DDP keeps the replicas equal, and every rank trains on the same data:
    # every rank prints the same loss at every epoch.
    for epoch, losses in sorted(by_epoch.items()):
        assert sorted(losses) == [0, 1, 2, 3], (epoch, losses)
        assert len(set(losses.values())) == 1, (epoch, losses)
    assert by_epoch[0][0] != by_epoch[9][0], "the loss never changed"


# --- 6. under `mpcore run`, torch's names are mpcore's ----------------------------------

NAMES_PROGRAM = r'''
import json, os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.parallel
from torch.distributed import all_reduce as all_reduce_imported
from torch.nn.parallel import DistributedDataParallel as ddp_imported

NAMES = ("init_process_group", "destroy_process_group", "all_reduce", "broadcast", "barrier",
         "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")


def names():
    """What serves torch.distributed here: torch's own functions (no
    wrappers), which backend CPU groups get by default, whose DDP."""
    import mpcore.parallel as mpar
    from torch.distributed import distributed_c10d as c10d
    return {
        "torch_functions": [n for n in NAMES if getattr(dist, n) is getattr(c10d, n)
                            and getattr(c10d, n).__module__ == "torch.distributed.distributed_c10d"],
        "all_reduce_imported": all_reduce_imported is c10d.all_reduce,
        "cpu_backend": dist.Backend.default_device_backend_map["cpu"],
        "ddp": torch.nn.parallel.DistributedDataParallel is mpar.DistributedDataParallel,
        "ddp_imported": ddp_imported is mpar.DistributedDataParallel,
        "ddp_module": (torch.nn.parallel.distributed.DistributedDataParallel
                       is mpar.DistributedDataParallel),
    }


def worker(rank, out):
    torch.set_num_threads(1)
    # The CPU's default backend, asked for by name as Lightning asks for it.
    dist.init_process_group(dist.get_default_backend_for_device("cpu"))
    import mpcore.distributed as md
    res = {"names": names(), "shm": md.shm_group_active(),
           "group": type(dist.distributed_c10d._get_default_group()).__name__,
           "backend": dist.get_backend()}
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    res["sum"] = t.tolist()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    res["hooks"] = getattr(ddp, "_mpcore_hooks", None) is not None
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    out, what = sys.argv[1], sys.argv[2]
    report = {"loaded_before": "mpcore" in sys.modules}
    if what == "spawn":
        mp.spawn(worker, args=(out,), nprocs=2)
    report["names"] = names()
    print("REPORT", repr(report), flush=True)
'''

ALL_NAMES = ["init_process_group", "destroy_process_group", "all_reduce", "broadcast", "barrier",
             "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"]
SERVED = {"torch_functions": ALL_NAMES, "all_reduce_imported": True, "cpu_backend": "gloo",
          "ddp": True, "ddp_imported": True, "ddp_module": True}


@pytest.mark.timeout(120)
def test_mpcore_run_serves_torch_distributed_and_ddp(tmp_path):
    path = write(tmp_path, "names.py", NAMES_PROGRAM)
    r = run_in_session([sys.executable, "-m", "mpcore", "run", path, str(tmp_path), "spawn"],
                       cwd=str(tmp_path), env=child_env(), timeout=100)
    report = report_of(r)
    assert report["loaded_before"] is True
    assert report["names"] == SERVED
    for rank in range(2):
        f = tmp_path / f"rank{rank}.json"
        assert f.exists(), r.stderr[-6000:]
        res = json.loads(f.read_text())
        assert res["names"] == SERVED, rank
        assert res["shm"] is True and res["group"] == "ProcessGroupMpcore"
        assert res["backend"] == "gloo"   # the name asked for, as under python
        assert res["sum"] == [3.0] * 5
        assert res["hooks"] is True


@pytest.mark.timeout(60)
def test_plain_python_keeps_torch_names(tmp_path):
    # Without `mpcore run`, importing mpcore.distributed registers the backend
    # and changes nothing else of torch's.
    path = write(tmp_path, "names.py", NAMES_PROGRAM)
    r = run_in_session([sys.executable, path, str(tmp_path), "names"], cwd=str(tmp_path),
                       env=child_env(), timeout=60)
    report = report_of(r)
    assert report["loaded_before"] is False
    assert report["names"] == {"torch_functions": ALL_NAMES, "all_reduce_imported": True,
                               "cpu_backend": "gloo", "ddp": False, "ddp_imported": False,
                               "ddp_module": False}
