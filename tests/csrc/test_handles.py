"""Forged, corrupt, truncated and stale shared-memory handles.

Every bad handle must raise mpcore.HandleError (a ValueError) with a message
that names the problem (or, for a truncated pickle, a clean pickle error),
and must never crash the process that meets it: no segfault, no bus error,
no view of memory outside the block the handle names.

All cases run in one fresh program (one torch import).  Its first process,
the creator, makes genuine tensors and arrays and forges pickles of their
handles (each payload carries a ticket of its own, as a real one does).  Each
case is then met twice, each time in a forked child of its own so that a
crash costs only that case:
  - "owner": a child of the creator, which has the segments mapped already;
  - "receiver": a child of a process started by spawn, which has never seen
    the segments and must ask the keeper for them.
A child reports over a pipe, one JSON line per attempt, and exits 0; the
program prints one RESULT line per case with the child's exit status.
"""
import json
import re
import signal
import time

import pytest

from helpers import Scenario

# --------------------------------------------------------------------------
# The program
# --------------------------------------------------------------------------

PROGRAM = r'''
import gc, json, os, pickle, random, select, signal, sys, time, traceback
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
import numpy as np
import torch
# Children are forked after torch has computed: torch's own thread pool
# does not survive fork, so keep torch single-threaded.
torch.set_num_threads(1)
CHILD_TIMEOUT = 60 * SLOW
import mpcore
from mpcore.queue import _queue
from mpcore.shm import _blocks as _shm, _torch as T
from multiprocessing.reduction import ForkingPickler


class Forged:
    """Pickles as the call fn(*args): a handle with forged fields."""
    def __init__(self, fn, args):
        self.fn, self.args = fn, args
    def __reduce__(self):
        return (self.fn, self.args)


def dumps(obj):
    return bytes(ForkingPickler.dumps(obj))


def describe(e):
    return {"outcome": "raised", "type": type(e).__name__,
            "handle_error": isinstance(e, mpcore.HandleError),
            "value_error": isinstance(e, ValueError), "msg": str(e)[:600]}


def touch(obj):
    """Reads every byte a received object claims to have."""
    try:
        if isinstance(obj, torch.Tensor):
            return repr(float(obj.double().sum())) + " " + repr(tuple(obj.shape))
        if isinstance(obj, np.ndarray):
            return repr(obj)[:200] + " " + repr(obj.tolist())[:100]
        if isinstance(obj, mpcore.Queue):
            return "queue of %d" % obj.qsize()
        return repr(obj)[:200]
    except Exception as e:
        return "accepted; reading it raised %s: %s" % (type(e).__name__, str(e)[:200])


def load(payload):
    try:
        obj = pickle.loads(payload)
    except BaseException as e:
        return describe(e)
    try:
        return {"outcome": "ok", "value": touch(obj)}
    finally:
        del obj
        gc.collect()


def in_child(fn, *args):
    """Runs fn(emit, *args) in a forked child; returns the child's exit
    status (negative: killed by that signal) and what it emitted."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        def emit(obj):
            data = (json.dumps(obj) + "\n").encode()
            while data:
                data = data[os.write(w, data):]
        try:
            fn(emit, *args)
        except BaseException as e:
            emit({"outcome": "harness", "tb": traceback.format_exc()})
            code = 3
        os._exit(code)
    os.close(w)
    buf = b""
    hung = False
    deadline = time.monotonic() + CHILD_TIMEOUT
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            hung = True
            os.kill(pid, signal.SIGKILL)
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        buf += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    lines = [json.loads(l) for l in buf.decode().splitlines() if l.strip()]
    return {"status": "hung" if hung else os.waitstatus_to_exitcode(status), "results": lines}


# --- cases the child runs ----------------------------------------------------

def run_payload(emit, payload):
    emit(load(payload))


def run_group(emit, payloads):
    for i, p in enumerate(payloads):
        res = load(p)
        res["i"] = i
        emit(res)


def run_truncations(emit, payloads):
    # payloads[i] is a genuine pickle (a ticket of its own) cut to i bytes.
    run_group(emit, payloads)


def stale_same_process(emit, kind):
    """A block is pickled, unpickled once (the ticket redeemed), freed, and
    the same bytes unpickled again (after the block was reused, if asked)."""
    if kind == "numpy":
        x = mpcore.empty((100,), "float64")
    elif kind == "large":
        x = mpcore.empty((1 << 18,), torch.float32)
    else:
        x = mpcore.empty((100,), torch.float32)
    x[:] = 7
    p = dumps(x)
    y = pickle.loads(p)
    assert (y == 7).all()
    del x, y
    gc.collect()
    z = None
    if kind == "reused":
        z = mpcore.empty((100,), torch.float32)   # takes the freed block again
        z[:] = 9
    res = load(p)
    if z is not None:
        res["other_intact"] = bool((z == 9).all())
    emit(res)


def stale_cross(emit, payload, value):
    """The creator pickled a tensor and let go of it: the ticket alone keeps
    it.  Redeem it here, drop it (the block is freed), then meet it again."""
    y = pickle.loads(payload)
    ok = bool((y == value).all())
    del y
    gc.collect()
    res = load(payload)
    res["first_ok"] = ok
    emit(res)


def stale_orphan(emit):
    """The owner made a tensor, pickled it and exited; the block lives on
    its ticket.  Redeem, drop (the block and its segment go), meet again."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        t = torch.full((1 << 18,), 3.0)
        p = dumps(t)
        os.write(w, len(p).to_bytes(8, "little") + p)
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    payload = data[8:8 + int.from_bytes(data[:8], "little")]
    stale_cross(emit, payload, 3.0)


# --- payloads the creator forges ---------------------------------------------

T_ARGS = ("param", "ref", "offset", "nbytes", "dtype", "storage_offset", "size", "stride",
          "requires_grad")


def tensor_payload(t, **over):
    # Start from the genuine handle (it takes the ticket), then forge fields.
    fn, args = T.reduce_tensor(t)
    assert fn is T._rebuild_tensor and len(args) == len(T_ARGS)
    d = dict(zip(T_ARGS, args))
    for k, v in over.items():
        d[k] = v(d[k]) if callable(v) else v
    return dumps(Forged(T._rebuild_tensor, tuple(d[k] for k in T_ARGS)))


def array_payload(a, **over):
    b, off = _shm.array_block(a)
    assert b is not None
    d = {"ref": b.ticket(), "dtype": a.dtype, "shape": a.shape, "strides": a.strides,
         "offset": off}
    for k, v in over.items():
        d[k] = v(d[k]) if callable(v) else v
    return dumps(Forged(_shm._rebuild_ndarray,
                        (d["ref"], d["dtype"], d["shape"], d["strides"], d["offset"])))


def queue_payload(a):
    b, _ = _shm.array_block(a)
    return dumps(Forged(_queue._rebuild_queue, (mpcore.Queue, b.ticket(), 0)))


RANDOM_SEG = random.Random(7).getrandbits(64) | 1


def build(small, big, view, arr, zarr, mode):
    """name -> (function, args) for one mode; every payload is fresh (its
    own ticket), since a ticket can be redeemed once."""
    gen = lambda r: r[2]
    c = {}
    P = lambda name, payload: c.__setitem__(name, (run_payload, (payload,)))
    # -- tensors: the reference
    P("t_random_segment", tensor_payload(small, ref=(RANDOM_SEG, 0, 1)))
    P("t_random_segment_big_index", tensor_payload(small, ref=(RANDOM_SEG ^ 2, 12345, 77)))
    P("t_index_out_of_range", tensor_payload(small, ref=lambda r: (r[0], 1 << 30, r[2])))
    P("t_index_past_uint32", tensor_payload(small, ref=lambda r: (r[0], (1 << 32) + r[1], r[2])))
    P("t_index_negative", tensor_payload(small, ref=lambda r: (r[0], -1, r[2])))
    P("t_free_block_of_segment", tensor_payload(small, ref=lambda r: (r[0], r[1] + 1000, 1)))
    P("t_generation_even", tensor_payload(small, ref=lambda r: (r[0], r[1], r[2] + 1)))
    P("t_generation_other", tensor_payload(small, ref=lambda r: (r[0], r[1], r[2] + 2)))
    P("t_generation_zero", tensor_payload(big, ref=lambda r: (r[0], r[1], 0)))
    P("t_ref_not_integers", tensor_payload(small, ref=lambda r: (str(r[0]), r[1], r[2])))
    P("t_ref_short", tensor_payload(small, ref=lambda r: (r[0], r[1])))
    P("t_ref_none", tensor_payload(small, ref=None))
    # -- tensors: the view
    P("t_huge_shape", tensor_payload(small, size=(1 << 40,)))
    P("t_huge_shape_overflow", tensor_payload(small, size=(1 << 62,)))
    P("t_shape_past_uint64", tensor_payload(small, size=(1 << 64,)))
    P("t_negative_shape", tensor_payload(small, size=(-5,)))
    P("t_huge_stride", tensor_payload(small, size=(2,), stride=(1 << 61,)))
    P("t_huge_stride_2d", tensor_payload(big, size=(2, 2), stride=(1 << 40, 1)))
    P("t_negative_stride_before_block", tensor_payload(small, size=(4,), stride=(-1,)))
    P("t_negative_storage_offset", tensor_payload(view, storage_offset=-1))
    P("t_storage_offset_past_block", tensor_payload(big, storage_offset=1 << 18))
    P("t_huge_storage_offset", tensor_payload(big, storage_offset=1 << 60))
    P("t_negative_offset", tensor_payload(small, offset=-4))
    P("t_offset_past_block", tensor_payload(big, offset=1 << 20))
    P("t_nbytes_past_block", tensor_payload(small, nbytes=1 << 40))
    P("t_negative_nbytes", tensor_payload(small, nbytes=-8))
    # 16 floats (64 bytes) live in a 256-byte slot of an arena: a view of 60
    # floats stays in the slot but reads the neighbours' memory.
    P("t_view_past_block_length_in_slot", tensor_payload(small, size=(60,)))
    # The storage named is 16 bytes of the 64-byte block; the view, 32.
    P("t_view_past_storage", tensor_payload(small, nbytes=16, size=(8,)))
    P("t_sizes_strides_mismatch", tensor_payload(small, size=(4, 4), stride=(1,)))
    # -- numpy arrays
    P("a_random_segment", array_payload(arr, ref=(RANDOM_SEG ^ 4, 0, 1)))
    P("a_generation_other", array_payload(arr, ref=lambda r: (r[0], r[1], r[2] + 2)))
    P("a_index_out_of_range", array_payload(arr, ref=lambda r: (r[0], 1 << 30, r[2])))
    P("a_huge_shape", array_payload(arr, shape=(1 << 40,), strides=(8,)))
    P("a_shape_overflow", array_payload(arr, shape=(1 << 62, 4), strides=(32, 8)))
    P("a_shape_past_int64", array_payload(arr, shape=(1 << 63,), strides=(8,)))
    P("a_negative_shape", array_payload(arr, shape=(-1,), strides=(8,)))
    P("a_one_past_end", array_payload(arr, shape=(65,), strides=(8,)))
    P("a_negative_stride_before_block", array_payload(arr, strides=(-8,)))
    P("a_huge_stride", array_payload(arr, shape=(2,), strides=(1 << 62,)))
    P("a_negative_offset", array_payload(arr, offset=-8))
    P("a_offset_past_block", array_payload(arr, offset=1 << 40))
    P("a_offset_at_end", array_payload(arr, offset=8 * 64))
    P("a_bigger_dtype", array_payload(arr, dtype="V4096", strides=(4096,)))
    P("a_sizes_strides_mismatch", array_payload(arr, shape=(8, 8), strides=(8,)))
    # An object array over shared memory would hand out the bytes as
    # PyObject pointers: the sender chooses them.
    P("a_object_dtype", array_payload(arr, dtype="O"))
    P("a_object_field_dtype", array_payload(zarr, dtype=[("x", "O")], shape=(8,), strides=(8,)))
    # -- a queue handle naming a data block
    P("q_data_block_as_queue", queue_payload(zarr))
    # -- stale handles
    c["stale_same_process"] = (stale_same_process, ("tensor",))
    c["stale_same_process_numpy"] = (stale_same_process, ("numpy",))
    c["stale_same_process_large"] = (stale_same_process, ("large",))
    c["stale_block_reused"] = (stale_same_process, ("reused",))
    s = torch.full((300,), 5.0).share_memory_()
    p = dumps(s)
    del s   # only the ticket keeps the block now
    c["stale_other_process"] = (stale_cross, (p, 5.0))
    c["stale_owner_exited"] = (stale_orphan, ())
    # -- truncated and corrupted pickles of genuine handles
    n = len(dumps(view))
    c["truncated_tensor"] = (run_truncations, ([dumps(view)[:i] for i in range(n)],))
    n = len(dumps(arr))
    c["truncated_array"] = (run_truncations, ([dumps(arr)[:i] for i in range(n)],))
    rng = random.Random(1234 + (mode == "receiver"))
    bad = []
    for k in range(300):
        obj = view if k % 2 else arr
        p = bytearray(dumps(obj))
        for _ in range(rng.randint(1, 3)):
            p[rng.randrange(len(p))] ^= rng.randint(1, 255)
        bad.append(bytes(p))
    c["corrupted"] = (run_group, (bad,))
    return c


def run_all(mode, cases):
    for name, (fn, args) in cases.items():
        res = in_child(fn, *args)
        res.update(mode=mode, case=name)
        print("RESULT " + json.dumps(res), flush=True)


def receiver(cases):
    run_all("receiver", cases)


if __name__ == "__main__":
    mode = sys.argv[1]
    small = mpcore.empty((16,), torch.float32)
    small[:] = torch.arange(16.0)
    big = torch.arange(float(1 << 18)).share_memory_()
    view = big[10:20]
    arr = mpcore.empty((64,), "float64")
    arr[:] = 1.5
    zarr = mpcore.zeros((64,), "float64")
    if mode in ("both", "owner"):
        run_all("owner", build(small, big, view, arr, zarr, "owner"))
    if mode in ("both", "receiver"):
        cases = build(small, big, view, arr, zarr, "receiver")
        p = mpcore.get_context("spawn").Process(target=receiver, args=(cases,))
        p.start()
        p.join(300 * SLOW)
        assert p.exitcode == 0, p.exitcode
    # The genuine objects are intact after all that.
    assert (small == torch.arange(16.0)).all()
    assert (big == torch.arange(float(1 << 18))).all()
    assert (arr == 1.5).all() and (zarr == 0).all()
    print("DONE", flush=True)
'''

# What the message of each case's HandleError must name.
GENERATION = r"generation|stale|freed"
BOUNDS = r"out of bounds|outside|exceed|absurd|overflow|too (large|big)"
CORRUPT_REF = r"corrupt|handle|integer"
SEGMENT = r"segment"
INDEX = r"block|index"
EXPECT = {
    "t_random_segment": SEGMENT,
    "t_random_segment_big_index": SEGMENT,
    "t_index_out_of_range": INDEX,
    "t_index_past_uint32": INDEX + "|" + CORRUPT_REF,
    "t_index_negative": INDEX + "|" + CORRUPT_REF,
    "t_free_block_of_segment": GENERATION,
    "t_generation_even": GENERATION,
    "t_generation_other": GENERATION,
    "t_generation_zero": GENERATION,
    "t_ref_not_integers": CORRUPT_REF,
    "t_ref_short": CORRUPT_REF,
    "t_ref_none": CORRUPT_REF,
    "t_huge_shape": BOUNDS,
    "t_huge_shape_overflow": BOUNDS,
    "t_shape_past_uint64": BOUNDS,
    "t_negative_shape": r"negative",
    "t_huge_stride": BOUNDS,
    "t_huge_stride_2d": BOUNDS,
    "t_negative_stride_before_block": BOUNDS,
    "t_negative_storage_offset": BOUNDS + "|negative",
    "t_storage_offset_past_block": BOUNDS,
    "t_huge_storage_offset": BOUNDS,
    "t_negative_offset": BOUNDS + "|negative",
    "t_offset_past_block": BOUNDS,
    "t_nbytes_past_block": BOUNDS,
    "t_negative_nbytes": BOUNDS + "|negative",
    "t_view_past_block_length_in_slot": BOUNDS,
    "t_view_past_storage": BOUNDS,
    "t_sizes_strides_mismatch": r"sizes|strides|dimension",
    "a_random_segment": SEGMENT,
    "a_generation_other": GENERATION,
    "a_index_out_of_range": INDEX,
    "a_huge_shape": BOUNDS,
    "a_shape_overflow": BOUNDS,
    "a_shape_past_int64": BOUNDS,
    "a_negative_shape": r"negative",
    "a_one_past_end": BOUNDS,
    "a_negative_stride_before_block": BOUNDS,
    "a_huge_stride": BOUNDS,
    "a_negative_offset": BOUNDS + "|negative",
    "a_offset_past_block": BOUNDS,
    "a_offset_at_end": BOUNDS,
    "a_bigger_dtype": BOUNDS,
    "a_sizes_strides_mismatch": r"sizes|strides|dimension",
    "a_object_dtype": r"object|dtype|pointer",
    "a_object_field_dtype": r"object|dtype|pointer",
    "q_data_block_as_queue": r"queue|ring|kind",
    "stale_same_process": GENERATION,
    "stale_same_process_numpy": GENERATION,
    "stale_same_process_large": GENERATION + "|unknown",
    "stale_block_reused": GENERATION,
    "stale_other_process": GENERATION + "|unknown",
    "stale_owner_exited": GENERATION + "|unknown",
}
MODES = ("owner", "receiver")
SIGNALS = {-signal.SIGSEGV: "SIGSEGV", -signal.SIGBUS: "SIGBUS", -signal.SIGABRT: "SIGABRT",
           -signal.SIGKILL: "SIGKILL"}


@pytest.fixture(scope="module")
def handle_run():
    """Runs the program once for the module; returns its results and what
    it left behind."""
    sc = Scenario()
    try:
        t0 = time.monotonic()
        r = sc.run(PROGRAM, "both", timeout=300)
        results = {}
        for line in r.stdout.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
                results[(res["mode"], res["case"])] = res
        leftover = None
        try:
            sc.check_clean()
        except AssertionError as e:
            leftover = str(e)
    finally:
        sc.close()
    yield {"proc": r, "results": results, "leftover": leftover,
           "seconds": time.monotonic() - t0}


def _case(handle_run, mode, name):
    res = handle_run["results"].get((mode, name))
    if res is None:
        r = handle_run["proc"]
        pytest.fail(f"case {name} ({mode}) never reported; program rc {r.returncode}\n"
                    f"stderr:\n{r.stderr[-4000:]}")
    status = res["status"]
    assert status == 0, (f"the process meeting {name} ({mode}) died: exit status {status} "
                         f"{SIGNALS.get(status, '')}; it reported {res['results']}")
    return res["results"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(EXPECT))
def test_bad_handle_raises_handle_error(handle_run, mode, name):
    results = _case(handle_run, mode, name)
    assert len(results) == 1, results
    res = results[0]
    assert res["outcome"] == "raised", (
        f"{name} ({mode}) was accepted: {res.get('value')!r}; expected mpcore.HandleError")
    assert res["handle_error"], (
        f"{name} ({mode}) raised {res['type']}: {res['msg']!r}; expected mpcore.HandleError")
    assert re.search(EXPECT[name], res["msg"], re.I), (
        f"{name} ({mode}): the message does not name the problem ({EXPECT[name]!r}): "
        f"{res['msg']!r}")
    if name == "stale_block_reused":
        assert res["other_intact"], "meeting the stale handle changed the block's new tenant"
    if name in ("stale_other_process", "stale_owner_exited"):
        assert res["first_ok"], "the handle's first use did not give the data"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["truncated_tensor", "truncated_array"])
def test_truncated_pickle_raises_cleanly(handle_run, mode, name):
    import pickle

    import mpcore
    results = _case(handle_run, mode, name)
    assert results, "no attempt reported"
    assert [r["i"] for r in results] == list(range(len(results)))
    allowed = {pickle.UnpicklingError.__name__, EOFError.__name__, mpcore.HandleError.__name__}
    bad = [r for r in results if r["outcome"] != "raised" or r["type"] not in allowed]
    assert not bad, f"truncated pickles not refused cleanly: {bad[:5]}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", MODES)
def test_corrupted_pickles_never_crash(handle_run, mode):
    results = _case(handle_run, mode, "corrupted")
    assert len(results) == 300, f"only {len(results)} of 300 reported"
    # Anything may come of a flipped byte except a crash or an exception
    # that is not an Exception (SystemExit and the like).
    bad = [r for r in results if r["outcome"] not in ("ok", "raised")]
    assert not bad, bad[:5]


@pytest.mark.timeout(400)
def test_handle_program_finished_and_left_nothing(handle_run, leak_check):
    r = handle_run["proc"]
    assert r.returncode == 0 and "DONE" in r.stdout, (
        f"rc {r.returncode}\nstdout tail:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}")
    assert handle_run["leftover"] is None, handle_run["leftover"]
