"""Benchmark cases: each has a torch implementation and an mpcore one.

Run one (or several) measurements in this process and print one JSON line
per case, prefixed with RESULT_TAG:

    python benchmarks/cases.py CASE[,CASE...] torch|mpcore [--target S]
    python -m mpcore.bench.cases CASE[,CASE...] torch|mpcore [--target S]

The torch side must run in a process that never imports mpcore (importing
mpcore changes how tensors pickle), so the driver runs this file by path.
Under `-m mpcore.bench.cases ... torch` the parent package `mpcore` is
already imported; the process then re-executes itself by path.

NOTE [ Adding a case ]
Write a function `fn(env, target_s, **params) -> Measurement` (or two, one
per implementation) and register it with `add_case(...)` at the bottom of
this file.  `env` gives torch, the queue/process context of the side being
measured, and the mpcore module (None on the torch side).  Use `calibrate()`
to pick the iteration count so that the timed part takes about `target_s`.
Nothing at module level may import torch or mpcore: the driver imports this
module (for the registry) and must stay neutral.
"""
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace

RESULT_TAG = "MPCORE-BENCH-RESULT "
IMPLS = ("torch", "mpcore")

# Fresh tensors a producer makes for one round of a queue run (bounds memory).
MAX_ROUND_BYTES = 256 << 20
MAX_ITEMS = 200_000
# How long a producer waits for its consumer before giving up.
CHILD_WAIT_S = 120.0


@dataclass
class Measurement:
    value: float                                 # in the case's unit
    n: int                                       # items or calls timed
    elapsed_s: float                             # the timed part
    extra: dict = field(default_factory=dict)    # further figures (e.g. GB/s)


@dataclass
class Case:
    name: str             # short id, used by --only and on the command line
    title: str            # row label of the table
    unit: str             # unit of Measurement.value
    higher_better: bool
    torch: object         # fn(env, target_s, **params) -> Measurement
    mpcore: object
    params: dict = field(default_factory=dict)
    timeout_s: float = 90.0      # bound on one child running this case
    note: str = ""               # one line for the README/JSON

    def impl(self, which):
        return self.torch if which == "torch" else self.mpcore


CASES = {}   # name -> Case, in registration (= table) order


def add_case(name, title, unit, higher_better, torch, mpcore=None, **kw):
    """Registers a case; `mpcore` defaults to the same function as `torch`
    (the same code, run in a process that imported mpcore)."""
    if name in CASES:
        raise ValueError(f"duplicate case {name!r}")
    CASES[name] = Case(name, title, unit, higher_better, torch,
                       torch if mpcore is None else mpcore, **kw)
    return CASES[name]


# --- environment of one side ----------------------------------------------

def make_env(impl):
    if impl == "mpcore":
        import mpcore
        import torch
        import torch.multiprocessing  # noqa: F401  (mpcore's hooks fire here)
        return SimpleNamespace(impl=impl, torch=torch, mpcore=mpcore,
                               Queue=mpcore.Queue, ctx=mpcore.get_context("fork"))
    if "mpcore" in sys.modules:
        raise RuntimeError("torch baseline in a process that imported mpcore")
    import torch
    import torch.multiprocessing as tmp
    return SimpleNamespace(impl=impl, torch=torch, mpcore=None,
                           Queue=tmp.Queue, ctx=tmp.get_context("fork"))


def calibrate(run, target_s, probe, lo=1, hi=10**6, rounds=3):
    """Runs `run(n) -> elapsed_s` with `probe` iterations (a warm-up and a
    first estimate), then with the n that should take about target_s,
    re-estimating (up to `rounds` times) while a run falls well short.
    Returns (n, elapsed_s) of the last run."""
    el = run(probe)
    n = probe
    for _ in range(rounds):
        n = max(lo, min(hi, int(n * target_s / max(el, 1e-9))))
        el = run(n)
        if el >= 0.6 * target_s or n >= hi:
            break
    return n, el


def _reap(procs):
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


# --- 1, 2: tensors through a Queue ----------------------------------------

def _rounds(n, per_round):
    return [min(per_round, n - i) for i in range(0, n, per_round)]


def _producer(torch, q, numel, n, per_round, shared, go, done):
    """Puts n tensors in rounds of at most per_round.  Each round: make the
    tensors (untimed), put one warm-up item (the consumer's cue that the
    round is ready), wait for `go`, put the round's tensors."""
    if shared:
        t = torch.empty(numel).fill_(1.0)
        t.share_memory_()
    for k in _rounds(n, per_round):
        if shared:
            q.put(t)
            go.acquire(timeout=CHILD_WAIT_S)
            for _ in range(k):
                q.put(t)
        else:
            items = [torch.empty(numel).fill_(float(i)) for i in range(k)]
            q.put(torch.empty(numel).fill_(-1.0))
            go.acquire(timeout=CHILD_WAIT_S)
            for i in range(k):
                q.put(items[i])
                items[i] = None   # the queue keeps it alive as long as needed
            del items
    # Stay alive until the consumer has everything (torch's file_descriptor
    # strategy serves each fd from this process).
    done.wait(CHILD_WAIT_S)


def _queue_once(env, numel, n, shared, per_round):
    """Times the transfer of n tensors from a forked producer to this
    process; the producer makes them before the clock starts (the clock is
    stopped while it makes each round's batch)."""
    q = env.Queue()
    go, done = env.ctx.Semaphore(0), env.ctx.Event()
    p = env.ctx.Process(target=_producer, daemon=True,
                        args=(env.torch, q, numel, n, per_round, shared, go, done))
    p.start()
    try:
        el = 0.0
        last = None
        for k in _rounds(n, per_round):
            q.get(timeout=CHILD_WAIT_S)           # the round is ready
            t0 = time.perf_counter()
            go.release()
            for _ in range(k):
                last = q.get(timeout=CHILD_WAIT_S)
            el += time.perf_counter() - t0
            want = 1.0 if shared else float(k - 1)
            if last.numel() != numel or float(last[-1]) != want:
                raise AssertionError(f"last item wrong: {last.numel()} elements, "
                                     f"last {float(last[-1])} != {want}")
            last = None
        done.set()
        return el
    finally:
        done.set()
        for _ in range(4):
            go.release()
        _reap([p])
        if hasattr(q, "close"):
            q.close()
        if hasattr(q, "join_thread"):
            try:
                q.join_thread()
            except Exception:
                pass


def queue_transfer(env, target_s, nbytes, shared=False, probe=None, min_n=8):
    numel = nbytes // 4
    per_round = 10**6 if shared else max(min_n, MAX_ROUND_BYTES // nbytes)
    probe = probe or max(2, min(200, per_round // 8))
    n, el = calibrate(lambda k: _queue_once(env, numel, k, shared, per_round), target_s,
                      probe, lo=min_n, hi=MAX_ITEMS)
    rate = n / el
    return Measurement(rate, n, el, {"items_per_s": rate, "GB_per_s": rate * nbytes / 1e9,
                                     "us_per_item": 1e6 / rate, "item_bytes": nbytes,
                                     "items_per_round": min(n, per_round)})


def queue_transfer_gbs(env, target_s, **params):
    m = queue_transfer(env, target_s, **params)
    m.value = m.extra["GB_per_s"]
    return m


# --- 3: creating shared tensors ---------------------------------------------

def _per_call(loop, target_s, probe, scale, hi=10**6):
    n, el = calibrate(loop, target_s, probe, lo=3, hi=hi)
    return Measurement(el / n * scale, n, el, {"calls_per_s": n / el})


def share_small(env, target_s):
    torch = env.torch

    def loop(n):
        t0 = time.perf_counter()
        for _ in range(n):
            t = torch.zeros(4, 4).share_memory_()
        el = time.perf_counter() - t0
        assert t.is_shared()
        return el
    return _per_call(loop, target_s, 200, 1e6)


def share_large(env, target_s, numel=16 << 20):
    torch = env.torch

    def loop(n):
        t0 = time.perf_counter()
        for _ in range(n):
            t = torch.empty(numel).share_memory_()
            del t
        return time.perf_counter() - t0
    return _per_call(loop, target_s, 3, 1e3, hi=2000)


def mpcore_zeros_small(env, target_s):
    torch, mpcore = env.torch, env.mpcore

    def loop(n):
        t0 = time.perf_counter()
        for _ in range(n):
            t = mpcore.zeros((4, 4), torch.float32)
        el = time.perf_counter() - t0
        assert t.is_shared() and t.shape == (4, 4)
        return el
    return _per_call(loop, target_s, 200, 1e6)


# --- the registry (table order) --------------------------------------------

KB, MB = 1 << 10, 1 << 20

add_case("queue-4k", "Queue 4 KB tensors", "items/s", True, queue_transfer,
         params={"nbytes": 4 * KB},
         note="Fresh (unshared) float32 tensors put by a forked producer, got by the "
              "consumer; each put copies one into shared memory.")
add_case("queue-1m", "Queue 1 MB tensors", "GB/s", True, queue_transfer_gbs,
         params={"nbytes": 1 * MB},
         note="As queue-4k with 1 MB tensors; figure is payload GB/s.")
add_case("queue-16m", "Queue 16 MB tensors", "GB/s", True, queue_transfer_gbs,
         params={"nbytes": 16 * MB},
         note="As queue-4k with 16 MB tensors; figure is payload GB/s.")
add_case("queue-shared", "Queue already-shared 1 MB tensor", "items/s", True,
         queue_transfer, params={"nbytes": 1 * MB, "shared": True},
         note="One tensor shared before timing, put N times: only the handle travels.")
add_case("share-4x4", "torch.zeros(4,4).share_memory_()", "us/call", False, share_small,
         note="Create a small tensor and move it to shared memory (and free it).")
add_case("share-64m", "torch.empty(64 MB).share_memory_()", "ms/call", False, share_large,
         note="Create a 64 MB tensor and move it to shared memory (and free it).")
add_case("zeros-4x4", "mpcore.zeros((4,4), float32)", "us/call", False,
         share_small, mpcore_zeros_small,
         note="mpcore.zeros((4,4), torch.float32) against torch's zeros(4,4).share_memory_().")


# --- command line -----------------------------------------------------------

def run_one(case, impl, env, target_s):
    m = case.impl(impl)(env, target_s, **case.params)
    return {"case": case.name, "impl": impl, "value": m.value, "unit": case.unit,
            "n": m.n, "elapsed_s": m.elapsed_s, "extra": m.extra}


def _versions():
    out = {"python": sys.version.split()[0], "pid": os.getpid()}
    for mod in ("torch", "numpy", "mpcore"):
        m = sys.modules.get(mod)
        if m is not None:
            out[mod] = getattr(m, "__version__", "?")
    return out


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="mpcore.bench.cases")
    ap.add_argument("cases", help="case name(s), comma separated")
    ap.add_argument("impl", choices=IMPLS)
    ap.add_argument("--target", type=float, default=1.0,
                    help="seconds the timed part of each case should take")
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    status = 0
    try:
        env = make_env(args.impl)
    except Exception as e:
        env, status = None, 1
        err = f"{type(e).__name__}: {e}"
    for name in names:
        if env is None:
            res = {"case": name, "impl": args.impl, "error": err}
        else:
            try:
                res = run_one(CASES[name], args.impl, env, args.target)
            except Exception as e:
                traceback.print_exc()
                res = {"case": name, "impl": args.impl, "error": f"{type(e).__name__}: {e}"}
                status = 1
        # The torch side must never have loaded mpcore, and vice versa.
        res["mpcore_imported"] = "mpcore" in sys.modules
        if args.impl == "torch" and res["mpcore_imported"] and "error" not in res:
            res["error"] = "mpcore was imported in the torch baseline process"
            status = 1
        res.update(_versions())
        print(RESULT_TAG + json.dumps(res), flush=True)
    return status


if __name__ == "__main__":
    argv = sys.argv[1:]
    if (__package__ and "mpcore" in sys.modules and len(argv) >= 2 and argv[1] == "torch"):
        # `python -m mpcore.bench.cases X torch` imported mpcore as our parent
        # package: start over as a plain script so the baseline is clean.
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + argv)
    sys.exit(main(argv))
