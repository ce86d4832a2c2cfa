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


# --- 4, 5, 6: starting processes (spawn) ------------------------------------
#
# These rows time a whole program's start of processes, so each measurement
# runs SPAWN_PROGRAM (below) as a program of its own: `python prog.py` on the
# torch side, `mpcore run prog.py` on the mpcore side (same text; the
# MPCORE_BENCH_SPAWN variable tells it which spawn to call, see
# _spawn_impl in the program).  The program times the calls with
# time.perf_counter and prints one JSON line (PROG_TAG); it also times its own
# `import torch`, which is reported but not counted.  One program run serves
# every spawn/process case of the same child (under --quick, all of them).

PROG_TAG = "MPCORE-BENCH-PROG "
PROG_TIMEOUT_S = 150.0   # bound on one program run
SPAWN_NPROCS = 4
SPAWN_REPEATS = 5        # calls timed by spawn-repeat, after a first one ...
QUICK_SPAWN_REPEATS = 1  # ... under --quick (torch's spawn(4) takes seconds)

SPAWN_PROGRAM = r"""
# A program that starts processes, as a user's would: it imports torch, and
# its children (which import this file as __mp_main__) import it too.
import json, os, sys, time
_t0 = time.perf_counter()
import torch
import torch.multiprocessing
IMPORT_S = time.perf_counter() - _t0
MPCORE = os.environ.get("MPCORE_BENCH_SPAWN") == "mpcore"


def noop(*args):
    pass


def _mini_spawn(fn, args=(), nprocs=1, join=True):
    # spawn(fn, args, nprocs) on mpcore's spawn context, the essentials only:
    # start nprocs processes running fn(i, *args), join them, check exit codes.
    import mpcore
    ctx = mpcore.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(i,) + tuple(args)) for i in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"children exited with codes {bad}")


def _spawn_impl():
    # The torch side: torch's.  The mpcore side (run by `mpcore run`):
    # torch.multiprocessing.spawn if mpcore serves it there, else
    # mpcore._spawn.spawn if that exists, else _mini_spawn above.
    tmp = torch.multiprocessing
    if not MPCORE:
        return tmp.spawn, "torch.multiprocessing.spawn"
    if (getattr(tmp.spawn, "__module__", "") or "").startswith("mpcore"):
        return tmp.spawn, f"torch.multiprocessing.spawn = {tmp.spawn.__module__}.spawn"
    try:
        from mpcore._spawn import spawn
        return spawn, "mpcore._spawn.spawn"
    except ImportError as e:
        return _mini_spawn, f"minimal spawn on mpcore.get_context('spawn') ({e})"


def _ctx():
    if MPCORE:
        import mpcore
        return mpcore.get_context("spawn"), "mpcore.get_context('spawn')"
    return torch.multiprocessing.get_context("spawn"), "torch.multiprocessing.get_context('spawn')"


def _start_join(ctx):
    t0 = time.perf_counter()
    p = ctx.Process(target=noop)
    p.start()
    p.join()
    el = time.perf_counter() - t0
    if p.exitcode != 0:
        raise RuntimeError(f"child exited with code {p.exitcode}")
    return el


def main():
    sections = sys.argv[1].split(",")
    nprocs, repeats, target_s = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    out = {"import_torch_s": IMPORT_S, "mpcore_run": os.environ.get("MPCORE_RUN") == "1"}
    if "first" in sections or "repeat" in sections:
        spawn, out["spawn_impl"] = _spawn_impl()
        t0 = time.perf_counter()
        spawn(noop, args=(), nprocs=nprocs, join=True)
        out["first_s"] = time.perf_counter() - t0
        if "repeat" in sections:
            out["repeat_s"] = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                spawn(noop, args=(), nprocs=nprocs, join=True)
                out["repeat_s"].append(time.perf_counter() - t0)
    if "process" in sections:
        ctx, out["process_ctx"] = _ctx()
        out["process_warmup_s"] = _start_join(ctx)
        times = []
        t_end = time.perf_counter() + target_s
        while len(times) < 2 or (time.perf_counter() < t_end and len(times) < 1000):
            times.append(_start_join(ctx))
        out["process_s"] = times
    print("%s%s" % (os.environ["MPCORE_BENCH_PROG_TAG"], json.dumps(out)), flush=True)


if __name__ == "__main__":
    main()
"""

_batch = []          # the cases this child runs (set by main)
_prog_results = {}   # impl -> [program results not yet used by a case]
_prog_dir = None
_PROG_SECTIONS = {"spawn-first": ("first",), "spawn-repeat": ("first", "repeat"),
                  "process-spawn": ("process",)}


def _prog_path():
    global _prog_dir
    if _prog_dir is None:
        import atexit
        import shutil
        import tempfile
        _prog_dir = tempfile.mkdtemp(prefix="mpcore-bench-")
        atexit.register(shutil.rmtree, _prog_dir, True)
        with open(os.path.join(_prog_dir, "spawn_prog.py"), "w") as f:
            f.write(SPAWN_PROGRAM)
    return os.path.join(_prog_dir, "spawn_prog.py")


def _prog_command(impl, path):
    if impl == "torch":
        return [sys.executable, path]
    script = os.path.join(os.path.dirname(sys.executable), "mpcore")
    if os.path.exists(script):
        return [script, "run", path]
    return [sys.executable, "-m", "mpcore", "run", path]


def run_program(impl, sections, target_s, timeout_s=PROG_TIMEOUT_S):
    """Runs SPAWN_PROGRAM once, as a program of its own, in a new session
    (its process group is killed on timeout, and anything it leaves alive);
    returns its result dict."""
    import signal
    import subprocess
    env = dict(os.environ)
    for k in ("MPCORE_RUN", "MPCORE_KEEPER", "MPCORE_ZYGOTE"):
        env.pop(k, None)   # the program starts its own (or, torch side, none)
    env["MPCORE_BENCH_SPAWN"] = impl
    env["MPCORE_BENCH_PROG_TAG"] = PROG_TAG
    env["PYTHONUNBUFFERED"] = "1"
    repeats = QUICK_SPAWN_REPEATS if target_s < 0.5 else SPAWN_REPEATS
    cmd = _prog_command(impl, _prog_path()) + [
        ",".join(sections), str(SPAWN_NPROCS), str(repeats), repr(target_s)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=_prog_dir, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        why = f"exit code {proc.returncode}"
    except BaseException as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        why = f"timed out after {timeout_s:.0f} s"
    wall = time.perf_counter() - t0
    try:   # whatever it left in its group (it should leave nothing)
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for line in out.splitlines():
        if line.startswith(PROG_TAG) and proc.returncode == 0:
            r = json.loads(line[len(PROG_TAG):])
            r["program_wall_s"] = wall
            r["sections"] = list(sections)
            return r
    tail = " | ".join(err.strip().splitlines()[-3:])
    raise RuntimeError(f"{' '.join(cmd[:3])}: {why}: {tail}")


def _program_result(env, case_name, target_s):
    """A program result with the sections case_name needs: one left by an
    earlier case of this child, else a new run, which also does the
    sections of the other program cases of this child (so --quick runs the
    program once per side)."""
    need = set(_PROG_SECTIONS[case_name])
    pool = _prog_results.setdefault(env.impl, [])
    for r in pool:
        if need <= set(r["sections"]) and case_name not in r["used_by"]:
            r["used_by"].append(case_name)
            return r
    want = set(need)
    for other in _batch:
        if other in _PROG_SECTIONS and other != case_name:
            want |= set(_PROG_SECTIONS[other])
    order = ("first", "repeat", "process")
    r = run_program(env.impl, [s for s in order if s in want], target_s)
    r["used_by"] = [case_name]
    pool.append(r)
    return r


def _prog_extra(r):
    keep = ("import_torch_s", "spawn_impl", "process_ctx", "program_wall_s", "mpcore_run")
    return {k: r[k] for k in keep if k in r}


def spawn_first(env, target_s):
    # One fresh program per child: the driver's repeats make the "few times".
    r = _program_result(env, "spawn-first", target_s)
    extra = _prog_extra(r)
    extra.update(nprocs=SPAWN_NPROCS)
    return Measurement(r["first_s"] * 1e3, 1, r["first_s"], extra)


def spawn_repeat(env, target_s):
    r = _program_result(env, "spawn-repeat", target_s)
    times = r["repeat_s"]
    mean = sum(times) / len(times)
    extra = _prog_extra(r)
    extra.update(repeat_ms_all=[x * 1e3 for x in times], first_ms=r["first_s"] * 1e3,
                 nprocs=SPAWN_NPROCS)
    return Measurement(mean * 1e3, len(times), sum(times), extra)


def process_spawn(env, target_s):
    r = _program_result(env, "process-spawn", target_s)
    times = r["process_s"]
    mean = sum(times) / len(times)
    extra = _prog_extra(r)
    extra.update(min_ms=min(times) * 1e3, warmup_ms=r["process_warmup_s"] * 1e3)
    return Measurement(mean * 1e3, len(times), sum(times), extra)


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


add_case("spawn-first", "first spawn(no-op, nprocs=4)", "ms", False, spawn_first,
         timeout_s=PROG_TIMEOUT_S + 30,
         note="In a fresh program that imported torch, the first "
              "torch.multiprocessing.spawn(noop, nprocs=4, join=True); mpcore: the same "
              "program under `mpcore run` (see README for which spawn it calls).")
add_case("spawn-repeat", "spawn(no-op, nprocs=4), repeated", "ms", False, spawn_repeat,
         timeout_s=PROG_TIMEOUT_S + 30,
         note=f"Mean of the {SPAWN_REPEATS} spawn(noop, nprocs=4) calls after a first one, "
              f"in the same program ({QUICK_SPAWN_REPEATS} under --quick).")
add_case("process-spawn", "spawn Process start+join", "ms", False, process_spawn,
         timeout_s=PROG_TIMEOUT_S + 30,
         note="ctx.Process(target=noop).start(); join() with the spawn context, after a "
              "warm-up one; mean per process, in a program that imported torch (mpcore: "
              "under `mpcore run`).")


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
    _batch[:] = names
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
