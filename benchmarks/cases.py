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
import importlib
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
    # False: the two figures stand side by side, with no ratio (a ratio of
    # two small percentages that may be 0 or negative says nothing).
    compare: bool = True
    # row_notes(row) -> [str]: lines the table prints under the row (figures
    # from `extra` that the two columns cannot show).  Row as runner.summarize.
    row_notes: object = None
    # False: --quick leaves the row out unless --only names it.
    in_quick: bool = True
    # True: runs in a child of its own under --quick too.  A case that forks
    # a process which then runs parallel torch work needs a parent where
    # OpenMP never ran: libgomp is not fork-safe, and such a child hangs in
    # its first parallel call.
    own_child: bool = False
    # columns(row) -> [(header, cell)]: the row goes to a table of its own,
    # with these columns, after the main one (rows that show more than two
    # figures: mpi_cases.py).  Row as runner.summarize.
    columns: object = None

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
        close_queue(q)


def close_queue(q):
    """Closes a queue of either side (a multiprocessing.Queue or another
    kind) and joins its feeder thread, if it has them."""
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
from torch.utils.data import Dataset
MPCORE = os.environ.get("MPCORE_BENCH_SPAWN") == "mpcore"


class CustomDataset(Dataset):
    # The article's dataset (its dataloader.py), for the "dataloader" section.
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return self.data[idx]


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
    # mpcore.proc._spawn.spawn if that exists, else _mini_spawn above.
    tmp = torch.multiprocessing
    if not MPCORE:
        return tmp.spawn, "torch.multiprocessing.spawn"
    if (getattr(tmp.spawn, "__module__", "") or "").startswith("mpcore"):
        return tmp.spawn, f"torch.multiprocessing.spawn = {tmp.spawn.__module__}.spawn"
    try:
        from mpcore.proc._spawn import spawn
        return spawn, "mpcore.proc._spawn.spawn"
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


def square(x):
    return x * x


def _pool_map(nprocs):
    # torch.multiprocessing's spawn Pool, as a program writes it (under
    # `mpcore run`, torch's get_context is mpcore's): made, one map, ended.
    ctx = torch.multiprocessing.get_context("spawn")
    t0 = time.perf_counter()
    with ctx.Pool(nprocs) as pool:
        got = pool.map(square, range(64))
    el = time.perf_counter() - t0
    if got != [x * x for x in range(64)]:
        raise RuntimeError(f"Pool.map gave {got}")
    return el


def _first_batch(nworkers):
    # From DataLoader(...) to its first batch, with spawned workers, over the
    # article's dataset.  torch side: torch's DataLoader; mpcore side:
    # mpcore.data.DataLoader (also torch.utils.data.DataLoader under mpcore run).
    import warnings
    if MPCORE:
        from mpcore.data import DataLoader
    else:
        from torch.utils.data import DataLoader
    dataset = CustomDataset([i for i in range(1000)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "will create 4 worker processes" on small machines
        t0 = time.perf_counter()
        loader = DataLoader(dataset, batch_size=32, num_workers=nworkers,
                            multiprocessing_context="spawn")
        it = iter(loader)
        first = next(it)
        el = time.perf_counter() - t0
        if first.tolist() != list(range(32)):
            raise RuntimeError(f"first batch wrong: {first}")
        t0 = time.perf_counter()
        del it, first                     # the workers stop (not counted)
        stop = time.perf_counter() - t0
    return {"dl_first_s": el, "dl_shutdown_s": stop,
            "dataloader_impl": f"{type(loader).__module__}.{type(loader).__qualname__}"}


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
    if "pool" in sections:
        times = []
        t_end = time.perf_counter() + target_s
        while len(times) < 2 or (time.perf_counter() < t_end and len(times) < 100):
            times.append(_pool_map(nprocs))
        out["pool_s"] = times
        out["pool_ctx"] = repr(torch.multiprocessing.get_context("spawn"))
    if "dataloader" in sections:
        out.update(_first_batch(nprocs))
    print("%s%s" % (os.environ["MPCORE_BENCH_PROG_TAG"], json.dumps(out)), flush=True)


if __name__ == "__main__":
    main()
"""

_batch = []          # the cases this child runs (set by main)
_prog_results = {}   # impl -> [program results not yet used by a case]
_prog_dir = None
_PROG_SECTIONS = {"spawn-first": ("first",), "spawn-repeat": ("first", "repeat"),
                  "process-spawn": ("process",), "pool-spawn": ("pool",),
                  "dl-first-spawn": ("dataloader",)}
# Program runs are shared only within a group: a DataLoader's first batch must
# be its program's first start of processes, as the first spawn must be its own.
_PROG_GROUP = {"dl-first-spawn": "dataloader"}   # others: "spawn"


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
    group = _PROG_GROUP.get(case_name, "spawn")
    for other in _batch:
        if (other in _PROG_SECTIONS and other != case_name
                and _PROG_GROUP.get(other, "spawn") == group):
            want |= set(_PROG_SECTIONS[other])
    order = ("first", "repeat", "process", "pool", "dataloader")
    r = run_program(env.impl, [s for s in order if s in want], target_s)
    r["used_by"] = [case_name]
    pool.append(r)
    return r


def _prog_extra(r):
    keep = ("import_torch_s", "spawn_impl", "process_ctx", "pool_ctx", "program_wall_s",
            "mpcore_run")
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


def pool_spawn(env, target_s):
    r = _program_result(env, "pool-spawn", target_s)
    times = r["pool_s"]
    extra = _prog_extra(r)
    extra.update(pool_ms_all=[x * 1e3 for x in times], nprocs=SPAWN_NPROCS)
    return Measurement(sum(times) / len(times) * 1e3, len(times), sum(times), extra)


# --- 11-15: DataLoader ------------------------------------------------------
#
# torch.utils.data.DataLoader (torch side) against mpcore.data.DataLoader
# (mpcore side), with the same arguments: num_workers=4, the default start
# method (fork) except dl-first-spawn.  A case times the loop of a program
# that holds a running loader: the loader and its iterator are made and the
# first batch taken (the workers are up) before the clock starts, and the
# clock stops at the last batch, before the workers are shut down.

DL_WORKERS = 4
RSS_BATCHES = 100_000    # dl-rss: mpcore side's run (and torch's, when it fits)
RSS_FROM = 1_000         # ... growth is measured from this batch on
RSS_EVERY = 1_000        # ... RSS is read every this many batches
RSS_TORCH_BUDGET = 15    # ... torch side stops at a reading after this many timed parts
RSS_MAX_S = 60.0         # ... either side stops at a reading after this long
RSS_TARGET_PCT = 5.0     # target of the mpcore side
STACK_TARGET = 1.5       # dl-images: target of mpcore's time / in-process stacking
INPROC_TARGET = 2.0      # dl-ints: target of mpcore's time / in-process loading


class CustomDataset:
    """The article's dataset (its dataloader.py), as published: a list's
    items by index.  A plain class (cases.py imports no torch at module
    level); torch's DataLoader takes any object with __getitem__ and
    __len__, and so does mpcore's."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return self.data[idx]


class CycleData:
    """n samples that go round a few precomputed ones: item idx is
    data[idx % len(data)] (the same objects again, as a cache of decoded
    samples would give)."""

    def __init__(self, data, n):
        self.data = data
        self.m = len(data)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        return self.data[idx % self.m]


def _loader_cls(env):
    if env.mpcore is not None:
        import mpcore.data
        return mpcore.data.DataLoader
    return env.torch.utils.data.DataLoader


def _quiet():
    """A context without the "will create 4 worker processes" warning that
    both loaders give on a small machine."""
    import warnings
    w = warnings.catch_warnings()

    class Quiet:
        def __enter__(self):
            w.__enter__()
            warnings.filterwarnings("ignore", message="This DataLoader will create")

        def __exit__(self, *exc):
            return w.__exit__(*exc)
    return Quiet()


def _cpu_s(pid):
    """User + system CPU seconds of a process so far (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_now(pids):
    return [_cpu_s(p) for p in [os.getpid()] + pids]


def _loader_once(env, data, batch_size, n, check, info=None, workers=DL_WORKERS):
    """Times batches 2..n+1 of an epoch of n+1 batches over `data`
    (CustomDataset(data) if it has (n+1)*batch_size items, else
    CycleData(data, (n+1)*batch_size)): the loader, its
    iterator and the first batch are made before the clock starts; the
    clock stops at the last batch, before the workers are shut down.
    check(last_batch, last_index) asserts the last batch.  `info` gets the
    CPU time the main process and the workers spent over the timed part
    (both sides' iterators keep their workers in `_workers`)."""
    n_items = (n + 1) * batch_size
    ds = CustomDataset(data) if len(data) == n_items else CycleData(data, n_items)
    with _quiet():
        loader = _loader_cls(env)(ds, batch_size=batch_size, num_workers=workers)
        it = iter(loader)
        b = next(it)
        pids = [p.pid for p in getattr(it, "_workers", [])]
        cpu0 = _cpu_now(pids)
        t0 = time.perf_counter()
        for _ in range(n):
            b = next(it)
        el = time.perf_counter() - t0
        cpu1 = _cpu_now(pids)
        check(b, (n + 1) * batch_size - 1)
        del it, b      # the workers stop here (not timed)
    if info is not None and None not in cpu0 + cpu1:
        # /proc's ticks are 10 ms: meaningful over a timed part of 0.2 s or more.
        info.update(main_cpu_ms_per_batch=(cpu1[0] - cpu0[0]) / n * 1e3,
                    workers_cpu_ms_per_batch=(sum(cpu1[1:]) - sum(cpu0[1:])) / n * 1e3,
                    cores_busy=(sum(cpu1) - sum(cpu0)) / el)
    return el


def _per_batch(env, target_s, make_data, batch_size, check, probe, hi, scale, unit_name,
               lo=2, workers=DL_WORKERS):
    info = {}
    n, el = calibrate(
        lambda k: _loader_once(env, make_data(k), batch_size, k, check, info, workers),
        target_s, probe, lo=lo, hi=hi)
    per = el / n
    extra = {"batches_per_s": n / el, "samples_per_s": n * batch_size / el,
             "batch_size": batch_size, "num_workers": workers,
             "dataloader": f"{_loader_cls(env).__module__}.DataLoader",
             unit_name: per * scale}
    extra.update(info)
    return Measurement(per * scale, n, el, extra)


def dl_ints(env, target_s, batch_size=32):
    # The article's dataset: a list of n python ints, [i for i in range(n)],
    # made anew for each epoch length.
    def check(b, last):
        if b.shape != (batch_size,) or int(b[-1]) != last:
            raise AssertionError(f"last batch wrong: {b}")
    def run(workers, t):
        return _per_batch(env, t, lambda k: [i for i in range((k + 1) * batch_size)],
                          batch_size, check, probe=500, hi=100_000, scale=1e6,
                          unit_name="us_per_batch", workers=workers)
    m = run(DL_WORKERS, target_s)
    # The same data and batches loaded in this process (num_workers=0), in
    # the same run: what the workers must beat (INPROC_TARGET).
    m.extra["inproc_us_per_batch"] = run(0, min(target_s, 0.5)).value
    return m


def _ints_notes(row):
    out = []
    for impl in IMPLS:
        e = _best_row_extra(row, impl)
        if e and "inproc_us_per_batch" in e:
            r = e["us_per_batch"] / e["inproc_us_per_batch"]
            out.append(f"{impl}: {e['num_workers']} workers {e['us_per_batch']:.3g} us/batch, "
                       f"in-process (num_workers=0) {e['inproc_us_per_batch']:.3g} us/batch: "
                       f"{r:.2f}x")
            if impl == "mpcore":
                out.append(f"target mpcore multi-worker <= {INPROC_TARGET:g}x in-process: "
                           f"{'met' if r <= INPROC_TARGET else 'MISSED'}")
    return out


def _stack_ms(torch, items, batch_size, target_s, threads=None):
    """The single-process alternative: torch.stack of the batch's samples
    in this process, per batch (what num_workers=0 does with them; the
    previous batch lives until the next is made, as in a loop), with
    torch's own thread count or `threads`."""
    m = len(items)

    def loop(n):
        b = None
        t0 = time.perf_counter()
        for k in range(n):
            b = torch.stack([items[(k * batch_size + j) % m] for j in range(batch_size)])
        el = time.perf_counter() - t0
        assert b.shape[0] == batch_size
        return el
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        # The first batches of fresh memory can take 10x longer (a VM's host
        # backs the pages on first touch): warm up before calibrating.
        loop(16)
        n, el = calibrate(loop, target_s, 10, lo=3, hi=100_000)
    finally:
        torch.set_num_threads(before)
    return el / n * 1e3


def dl_images(env, target_s, batch_size=32, distinct=64, shape=(3, 224, 224)):
    torch = env.torch
    items = [torch.full(shape, float(i)) for i in range(distinct)]

    def check(b, last):
        if b.shape != (batch_size,) + tuple(shape) or float(b[-1, -1, -1, -1]) != last % distinct:
            raise AssertionError(f"last batch wrong: {b.shape} {float(b[-1, -1, -1, -1])}")
    # At least 150 timed batches: a fresh loader's first ~50 are 2-3x slower
    # (each worker faults in its ring of 19 MB slots), which a short timed
    # part (--quick) would otherwise mostly measure.
    m = _per_batch(env, target_s, lambda k: items, batch_size, check, probe=20, hi=20_000,
                   scale=1e3, unit_name="ms_per_batch", lo=150)
    # After the loader's workers are gone: the same batches stacked here, with
    # torch's threads (2 on a 2-core machine: on a busy machine its OpenMP
    # threads can stall for a scheduler tick per call), and with one thread
    # (what each worker of either loader does: they set_num_threads(1)).
    t = min(target_s, 0.5)
    stack = _stack_ms(torch, items, batch_size, t)
    stack_1t = _stack_ms(torch, items, batch_size, t, threads=1)
    m.extra.update(stack_ms=stack, stack_threads=torch.get_num_threads(),
                   stack_1thread_ms=stack_1t, vs_stack=m.value / stack,
                   batch_MB=batch_size * items[0].nbytes / 1e6,
                   GB_per_s=batch_size * items[0].nbytes / (m.value * 1e-3) / 1e9)
    return m


DICT_KEYS = 16


def _dict_sample(torch, i):
    # 16 keys of 4 kinds: float32 (8,), int64 (4,), float32 (2, 3), int32 ().
    out = {}
    for j in range(DICT_KEYS):
        kind = j % 4
        if kind == 0:
            t = torch.full((8,), float(i))
        elif kind == 1:
            t = torch.full((4,), i, dtype=torch.int64)
        elif kind == 2:
            t = torch.full((2, 3), float(i))
        else:
            t = torch.tensor(i, dtype=torch.int32)
        out[f"k{j:02d}"] = t
    return out


def dl_dicts(env, target_s, batch_size=64, distinct=256):
    torch = env.torch
    items = [_dict_sample(torch, i) for i in range(distinct)]

    def check(b, last):
        if (sorted(b) != sorted(items[0]) or b["k00"].shape != (batch_size, 8)
                or int(b["k15"][-1]) != last % distinct):
            raise AssertionError(f"last batch wrong: { {k: v.shape for k, v in b.items()} }")
    return _per_batch(env, target_s, lambda k: items, batch_size, check, probe=100, hi=200_000,
                      scale=1e6, unit_name="us_per_batch")


def dl_first_spawn(env, target_s):
    # One fresh program per child, as spawn-first (see the spawn rows above):
    # `python prog.py` / `mpcore run prog.py`, its "dataloader" section.
    r = _program_result(env, "dl-first-spawn", target_s)
    keep = ("import_torch_s", "program_wall_s", "mpcore_run", "dataloader_impl")
    extra = {k: r[k] for k in keep if k in r}
    extra.update(num_workers=SPAWN_NPROCS, shutdown_ms=r["dl_shutdown_s"] * 1e3,
                 context="spawn")
    return Measurement(r["dl_first_s"] * 1e3, 1, r["dl_first_s"], extra)


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status_kb(keys=("VmRSS", "RssAnon", "RssFile", "RssShmem")):
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k + "_MB"] = int(v.split()[0]) / 1024
    return out


def dl_rss(env, target_s, batch_size=32, batches=RSS_BATCHES, budget=None):
    """The main process's RSS growth from batch RSS_FROM to the last batch
    of one long epoch (one iterator), in percent of its RSS at RSS_FROM.
    RSS is read every RSS_EVERY batches; the run stops at a reading at or
    after `batches`, or after `budget` timed parts (torch side), or after
    RSS_MAX_S."""
    budget_s = RSS_MAX_S if budget is None else min(RSS_MAX_S, budget * target_s)
    ds = CycleData([i for i in range(1000)], batches * batch_size)
    with _quiet():
        loader = _loader_cls(env)(ds, batch_size=batch_size, num_workers=DL_WORKERS)
        it = iter(loader)
        series = []                        # (batch, rss bytes)
        k = 0
        t0 = time.perf_counter()
        while k < batches:
            for _ in range(RSS_EVERY):
                b = next(it)
            k += RSS_EVERY
            series.append((k, _rss_bytes()))
            if k == RSS_FROM:
                t_from, status_from = time.perf_counter(), _status_kb()
            if k > RSS_FROM and time.perf_counter() - t0 > budget_s:
                break
        el = time.perf_counter() - t_from
        status_end = _status_kb()
        if int(b[-1]) != (k * batch_size - 1) % 1000:
            raise AssertionError(f"last batch wrong: {b}")
        del it, b
    rss_from = dict(series)[RSS_FROM]
    rss_end = series[-1][1]
    return Measurement((rss_end - rss_from) / rss_from * 100, k - RSS_FROM, el, {
        "batches_from": RSS_FROM, "batches_end": k, "batches_wanted": batches,
        "stopped_by_time": k < batches, "budget_s": budget_s,
        "rss_from_MB": rss_from / 2**20, "rss_end_MB": rss_end / 2**20,
        "rss_peak_MB": max(r for _, r in series) / 2**20,
        "growth_MB": (rss_end - rss_from) / 2**20,
        "us_per_batch": el / (k - RSS_FROM) * 1e6,
        "status_from": status_from, "status_end": status_end,
        "rss_MB_series": [(i, r / 2**20) for i, r in series
                          if i == RSS_FROM or i % 10_000 == 0 or i == k],
    })


def dl_rss_torch(env, target_s, **params):
    return dl_rss(env, target_s, budget=RSS_TORCH_BUDGET, **params)


def best_entries(row):
    """(impl, best value, the extra figures of that value) of each side that
    has a best value."""
    for impl in IMPLS:
        best = row[impl]["best"]
        if best is not None:
            yield impl, best, row[impl]["extra"][row[impl]["values"].index(best)]


def _best_extra(row, impl, key, pick=min):
    vals = [e[key] for e in row[impl]["extra"] if key in e]
    return pick(vals) if vals else None


def _images_notes(row):
    out = []
    for impl, best, e in best_entries(row):
        st, st1 = _best_extra(row, impl, "stack_ms"), _best_extra(row, impl, "stack_1thread_ms")
        if st is None:
            continue
        line = (f"{impl} child: in-process torch.stack per batch {st:.3g} ms with "
                f"{e['stack_threads']} threads, {st1:.3g} ms with 1; "
                f"loader / stack = {best / st:.2f}x")
        if impl == "mpcore":
            ok = "met" if best / st <= STACK_TARGET else "MISSED"
            line += f" (target <= {STACK_TARGET}x: {ok})"
        if "workers_cpu_ms_per_batch" in e:
            line += (f"; CPU per batch: main {e['main_cpu_ms_per_batch']:.3g} ms, workers "
                     f"{e['workers_cpu_ms_per_batch']:.3g} ms ({e['cores_busy']:.2f} cores busy)")
        out.append(line)
    return out


def _rss_notes(row):
    out = []
    for impl in IMPLS:
        vals, ex = row[impl]["values"], row[impl]["extra"]
        if not vals:
            continue
        e = ex[vals.index(row[impl]["best"])]
        bound = (f", stopped by its time bound ({e['budget_s']:.0f} s)"
                 if e["stopped_by_time"] else "")
        out.append(f"{impl}: batches {e['batches_from']:,} -> {e['batches_end']:,}{bound}; "
                   f"RSS {e['rss_from_MB']:.0f} -> {e['rss_end_MB']:.0f} MB "
                   f"({e['growth_MB']:+.1f} MB); {e['us_per_batch']:.0f} us/batch")
    if row["mpcore"]["values"]:
        worst = max(row["mpcore"]["values"])
        ok = "met" if worst < RSS_TARGET_PCT else "MISSED"
        out.append(f"mpcore target < {RSS_TARGET_PCT:g}% (worst repeat {worst:+.2f}%): {ok}; "
                   "no ratio: the sides may run different lengths, and the figures are near 0")
    return out


def _first_spawn_notes(row):
    impls = sorted({e.get("dataloader_impl", "?") for e in row["mpcore"]["extra"]})
    out = []
    if impls:
        run = all(e.get("mpcore_run") for e in row["mpcore"]["extra"])
        out.append(f"mpcore side used {', '.join(impls)}"
                   f"{' under mpcore run (zygote forked at the import of torch)' if run else ''}")
    return out   # (the runner adds the program's own import torch)


# --- 16-26: collectives and DDP (torch.distributed) ---------------------------
#
# torch side: torch.distributed with backend "gloo" (and torch's
# DistributedDataParallel), ranks started by torch.multiprocessing.spawn from
# the child; neither the child nor its ranks import mpcore.  mpcore side: the
# same code on mpcore.distributed (init_process_group("gloo"): torch's gloo
# group with mpcore's shared-memory group beside it) and
# mpcore.parallel.DistributedDataParallel, ranks started by mpcore.spawn.
# Both: MASTER_ADDR=127.0.0.1, a free MASTER_PORT, rank and world_size passed
# to init_process_group, torch.set_num_threads(cores // ranks) in each rank
# (as torchrun's OMP_NUM_THREADS=1 would on this 2-core machine).
#
# The ranks start once per (child, world size) and measure every all-reduce
# size of that world the child runs: one size in a full run (one child per
# row), all five under --quick.  Rank 0 writes the figures to a file the
# child reads.  Timing: the ranks meet at a barrier, each times n calls, and
# the largest of their times counts; it is all-reduced (MAX) so that every
# rank holds the same figure, and calibrate() then picks the same n on every
# rank (the ranks agree on iteration counts without another message).

AR_WORLDS = (2, 4)
AR_SIZES = (("4k", "4 KB", 4 << 10), ("64k", "64 KB", 64 << 10), ("1m", "1 MB", 1 << 20),
            ("16m", "16 MB", 16 << 20), ("64m", "64 MB", 64 << 20))
AR_US_BELOW = 1 << 20           # sizes below: latency in us; from 1 MB on: ms per call
AR_TARGETS = {4 << 10: 30.0, 16 << 20: 3.0}   # mpcore's target ratio at these sizes
DDP_LAYERS = (1024, 2048, 2048, 1024, 1024, 512)   # Linear sizes: 9.97M parameters
DDP_BATCH = 32
# what a DDP job reports that its rows keep
DDP_EXTRA = ("params", "ddp", "param_spread", "compute_only_ms", "phases_ms",
             "compute_only_phases_ms", "cpu_ms", "compute_only_cpu_ms", "reducer_only_ms",
             "reduce_cpu_ms")
DDP_WORLD = 2
DDP_TARGET = 1.5
DDP_OVERLAP_TARGET = 1.15       # mpcore's DDP step against its own no_sync step
DIST_TIMEOUT_S = 60.0           # init_process_group's timeout (collectives' too)

_dist_results = {}   # (impl, world) -> rank 0's figures, or the exception


def _free_port():
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_threads(world):
    return max(1, len(os.sched_getaffinity(0)) // world)


def _dist_setup(rank, impl, world):
    """In a rank: torch, the side's distributed module (torch.distributed or
    mpcore.distributed) with its group initialised, and the init time."""
    import datetime
    import torch
    torch.set_num_threads(_rank_threads(world))
    if impl == "mpcore":
        import mpcore.distributed as dist
    else:
        import torch.distributed as dist
    t0 = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S))
    init_s = time.perf_counter() - t0
    if impl == "mpcore" and not dist.shm_group_active():
        raise RuntimeError("mpcore.distributed made no shared-memory group")
    return torch, dist, init_s


def _max_over_ranks(torch, dist, x):
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _write_result(path, out):
    out["mpcore_imported"] = "mpcore" in sys.modules
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def _allreduce_size(torch, dist, rank, world, nbytes, target_s):
    numel = nbytes // 4
    t = torch.full((numel,), float(rank + 1))
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    if not bool((t == want).all()):
        raise AssertionError(f"all_reduce of {nbytes} bytes: got {t[:4].tolist()}..., "
                             f"want {want}")
    t.zero_()   # zeros from here on: no overflow to inf, no denormals
    for _ in range(max(2, min(50, (8 << 20) // nbytes))):
        dist.all_reduce(t)

    def run(n):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        return _max_over_ranks(torch, dist, time.perf_counter() - t0)
    n, el = calibrate(run, target_s, max(2, min(50, (1 << 20) // nbytes)), lo=2)
    per = el / n
    out = {"n": n, "elapsed_s": el, "per_call_s": per}
    if rank == 0 and nbytes >= AR_US_BELOW:
        # The yardstick for the large sizes: a plain copy of the same size
        # (torch's copy_, this rank's threads) while the other ranks wait at
        # the next barrier; the fastest of a few, after a warm-up.
        src, dst = torch.ones(numel), torch.empty(numel)
        dst.copy_(src)
        times = []
        t_end = time.perf_counter() + min(target_s, 0.3)
        while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 1000):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        out["memcpy_s"] = min(times)
    dist.barrier()
    return out


def _dist_rank(rank, impl, world, jobs, target_s, path):
    """One rank: init_process_group, then each job of `jobs` ({"allreduce":
    [sizes], "ddp": True}) in turn; rank 0 writes the figures to path."""
    torch, dist, init_s = _dist_setup(rank, impl, world)
    try:
        out = {"init_s": init_s, "threads": torch.get_num_threads()}
        if jobs.get("allreduce"):
            out["sizes"] = {str(nbytes): _allreduce_size(torch, dist, rank, world, nbytes,
                                                         target_s)
                            for nbytes in jobs["allreduce"]}
        if jobs.get("ddp"):
            out["ddp"] = _ddp_job(torch, dist, impl, rank, target_s)
        if rank == 0:
            _write_result(path, out)
    finally:
        dist.destroy_process_group()


def _ddp_model(torch):
    """The MLP of the DDP rows (DDP_LAYERS, ReLU between), seeded."""
    nn = torch.nn
    torch.manual_seed(0)
    layers = []
    for a, b in zip(DDP_LAYERS, DDP_LAYERS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _ddp_job(torch, dist, impl, rank, target_s, torch_ddp=False):
    """torch_ddp: torch's own DistributedDataParallel on both sides."""
    if impl == "mpcore" and not torch_ddp:
        from mpcore.parallel import DistributedDataParallel as DDP
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
    nn = torch.nn
    model = _ddp_model(torch)
    ddp = DDP(model)
    if impl == "mpcore" and not torch_ddp and getattr(ddp, "_mpcore_hooks", None) is None:
        raise RuntimeError("mpcore.parallel.DistributedDataParallel did not take the "
                           "shared-memory path")
    reduce_cpu = _count_reduce_cpu(ddp) if impl == "mpcore" and not torch_ddp else None
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(DDP_BATCH, DDP_LAYERS[0], generator=g)
    y = torch.randn(DDP_BATCH, DDP_LAYERS[-1], generator=g)
    phases = [0.0, 0.0, 0.0]

    def step(timed=False):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        if timed:
            phases[0] += t1 - t0
            phases[1] += t2 - t1
            phases[2] += time.perf_counter() - t2

    def run(n, sync=True, timed=False):
        dist.barrier()
        t0 = time.perf_counter()
        if sync:
            for _ in range(n):
                step(timed)
        else:
            with ddp.no_sync():
                for _ in range(n):
                    step(timed)
        return _max_over_ranks(torch, dist, time.perf_counter() - t0)

    for _ in range(3):
        step()
    n, el = calibrate(run, target_s, 4, lo=3)

    def phase_ms(sync):
        """Forward, backward and SGD ms per step, then the CPU ms per step
        of the rank's process (every thread: the backend's too); each the
        busiest rank's."""
        import resource
        phases[:] = [0.0, 0.0, 0.0]
        k = max(3, min(20, n // 2))
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0 = reduce_cpu[0] if reduce_cpu else 0.0
        run(k, sync, timed=True)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        red = reduce_cpu[0] - c0 if reduce_cpu else 0.0
        return [_max_over_ranks(torch, dist, p / k * 1e3) for p in phases + [cpu, red]]
    fwd, bwd, opt_ms, cpu_ms, reduce_ms = phase_ms(True)
    # The ranks must hold the same parameters after synchronised steps.
    w = ddp.module[0].weight.detach().double().sum().item()
    spread = _max_over_ranks(torch, dist, w) + _max_over_ranks(torch, dist, -w)
    # The same step under no_sync (each rank keeps its own gradients: DDP
    # copies nothing into buckets and all-reduces nothing): the step's
    # compute, what DDP's communication is added to.
    run(2, sync=False)
    n0, el0 = calibrate(lambda k: run(k, sync=False), min(target_s, 0.5), 4, lo=3)
    fwd0, bwd0, opt0, cpu0, _ = phase_ms(False)
    # Last, the step with a hook that communicates nothing (torch's own
    # noop_hook; a DDP takes one hook only, so nothing is measured after
    # it): what torch's reducer costs by itself (copying gradients into
    # buckets and back), which no backend's all-reduce can take away.
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    ddp.register_comm_hook(None, noop_hook)
    run(2)
    n1, el1 = calibrate(run, min(target_s, 0.5), 4, lo=3)
    return {"n": n, "elapsed_s": el, "params": sum(p.numel() for p in model.parameters()),
            "param_spread": spread, "compute_only_n": n0,
            "compute_only_ms": el0 / n0 * 1e3, "phases_ms": [fwd, bwd, opt_ms],
            "compute_only_phases_ms": [fwd0, bwd0, opt0],
            "cpu_ms": cpu_ms, "compute_only_cpu_ms": cpu0,
            "reducer_only_ms": el1 / n1 * 1e3, "reduce_cpu_ms": reduce_ms if reduce_cpu else None,
            "ddp": f"{type(ddp).__module__}.{type(ddp).__qualname__}"}


def _count_reduce_cpu(ddp):
    """Makes mpcore's DDP hook count the CPU time (of the thread that runs
    them) of its buckets' all-reduces in the core; returns the one-element
    list that sums it, in seconds."""
    group = ddp._mpcore_hooks.group
    core, total = group.core, [0.0]

    class Counted:
        def __getattr__(self, name):
            return getattr(core, name)

        def all_reduce(self, *args):
            t0 = time.thread_time()
            try:
                return core.all_reduce(*args)
            finally:
                total[0] += time.thread_time() - t0
    group.core = Counted()
    return total


def _run_ranks(env, world, jobs, target_s, rank_fn=None):
    """Starts `world` ranks running rank_fn (default _dist_rank) with the
    side's spawn, joins them, returns what rank 0 wrote."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix="mpcore-bench-dist-", suffix=".json")
    os.close(fd)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    spawn = env.mpcore.spawn if env.mpcore is not None else env.torch.multiprocessing.spawn
    t0 = time.perf_counter()
    try:
        spawn(rank_fn or _dist_rank, args=(env.impl, world, jobs, target_s, path),
              nprocs=world, join=True)
        with open(path) as f:
            r = json.load(f)
    finally:
        for p in (path, path + ".tmp"):
            if os.path.exists(p):
                os.unlink(p)
    if env.impl == "torch" and r["mpcore_imported"]:
        raise RuntimeError("a torch-side rank imported mpcore")
    r["ranks_wall_s"] = time.perf_counter() - t0
    r["spawn"] = f"{spawn.__module__}.spawn"
    r["jobs"] = jobs
    return r


def _dist_jobs(world, nbytes=None, ddp=False):
    """What the ranks of `world` do: the case asking (an all-reduce of
    nbytes, or the DDP step) and the other distributed cases of this child's
    batch with that world size (one start of the ranks serves them all)."""
    sizes = {nbytes} if nbytes else set()
    for name in _batch:
        c = CASES.get(name)
        if c is None or c.params.get("world") != world:
            continue
        if c.torch is allreduce:
            sizes.add(c.params["nbytes"])
        elif c.torch is ddp_step:
            ddp = True
    jobs = {"allreduce": sorted(sizes)} if sizes else {}
    if ddp:
        jobs["ddp"] = True
    return jobs


def _dist_result(env, world, target_s, **need):
    """The figures of this child's ranks of `world` size: started by the
    first case that needs them; a failure fails them all, once."""
    key = (env.impl, world)
    if key not in _dist_results:
        try:
            _dist_results[key] = _run_ranks(env, world, _dist_jobs(world, **need), target_s)
        except Exception as e:
            _dist_results[key] = e
            raise
    r = _dist_results[key]
    if isinstance(r, Exception):
        raise RuntimeError(f"the ranks failed (see this child's first error): {r}")
    return r


def _dist_extra(r):
    extra = {k: r[k] for k in ("threads", "init_s", "ranks_wall_s", "spawn")}
    extra["jobs_in_run"] = r["jobs"]
    return extra


def allreduce(env, target_s, world, nbytes):
    r = _dist_result(env, world, target_s, nbytes=nbytes)
    s = r["sizes"][str(nbytes)]
    per = s["per_call_s"]
    algbw = nbytes / per / 1e9
    extra = {"bytes": nbytes, "world": world, "us_per_call": per * 1e6,
             "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (world - 1) / world}
    extra.update(_dist_extra(r))
    if "memcpy_s" in s:
        extra.update(memcpy_ms=s["memcpy_s"] * 1e3, vs_memcpy=per / s["memcpy_s"])
    return Measurement(per * (1e6 if nbytes < AR_US_BELOW else 1e3), s["n"], s["elapsed_s"],
                       extra)


def ddp_step(env, target_s, world):
    r = _dist_result(env, world, target_s, ddp=True)
    d = r["ddp"]
    step_ms = d["elapsed_s"] / d["n"] * 1e3
    extra = {k: d[k] for k in DDP_EXTRA}
    extra.update(_dist_extra(r))
    extra.update(step_ms=step_ms, comm_ms=step_ms - d["compute_only_ms"], batch=DDP_BATCH,
                 world=world)
    if abs(d["param_spread"]) > 1e-6 * max(1.0, d["params"] ** 0.5):
        raise AssertionError(f"the ranks' parameters differ after DDP steps "
                             f"(spread of a checksum {d['param_spread']:g})")
    return Measurement(d["n"] / d["elapsed_s"], d["n"], d["elapsed_s"], extra)


def _best_row_extra(row, impl):
    """The extra of a side's best repeat."""
    vals = row[impl]["values"]
    return row[impl]["extra"][vals.index(row[impl]["best"])] if vals else None


def _allreduce_notes(row):
    ex = {impl: _best_row_extra(row, impl) for impl in IMPLS}
    out = []
    bw = [f"{impl} {ex[impl]['busbw_GBps']:.3g}" for impl in IMPLS if ex[impl]]
    if bw:
        out.append("bus bandwidth GB/s (best): " + ", ".join(bw))
    m = ex["mpcore"]
    if m and "memcpy_ms" in m:
        out.append(f"mpcore per call = {m['vs_memcpy']:.2f}x a one-rank copy of the same size "
                   f"({m['memcpy_ms']:.3g} ms)")
    goal = AR_TARGETS.get(m["bytes"] if m else None)
    if goal and row["ratio"] is not None:
        out.append(f"target >= {goal:g}x: {'met' if row['ratio'] >= goal else 'MISSED'}")
    return out


def _ddp_notes(row):
    out = []
    for impl in IMPLS:
        e = _best_row_extra(row, impl)
        if e:
            f, b, o = e["phases_ms"]
            f0, b0, o0 = e["compute_only_phases_ms"]
            out.append(f"{impl}: step {e['step_ms']:.3g} ms (forward {f:.3g}, backward with "
                       f"all-reduce {b:.3g}, SGD {o:.3g}); under no_sync (no bucket copies, "
                       f"no all-reduce) {e['compute_only_ms']:.3g} ms (backward {b0:.3g}); "
                       f"CPU per step of the busiest rank {e['cpu_ms']:.3g} ms, under no_sync "
                       f"{e['compute_only_cpu_ms']:.3g} ms")
            if e.get("reducer_only_ms"):
                over = e["step_ms"] / e["compute_only_ms"]
                line = (f"{impl}: step = {over:.2f}x its no_sync step; with a hook that "
                        f"communicates nothing (torch's noop_hook: the reducer's own bucket "
                        f"copies, the floor of any backend) {e['reducer_only_ms']:.3g} ms = "
                        f"{e['reducer_only_ms'] / e['compute_only_ms']:.2f}x")
                if impl == "mpcore" and "mpcore" in e["ddp"]:
                    line += (f" (target step <= {DDP_OVERLAP_TARGET:g}x no_sync: "
                             f"{'met' if over <= DDP_OVERLAP_TARGET else 'MISSED'})")
                out.append(line)
                if e.get("reduce_cpu_ms") is not None:
                    red = e["reduce_cpu_ms"]
                    out.append(f"{impl}: the buckets' all-reduces took {red:.3g} ms of CPU a "
                               f"step in the core; with that CPU added to the noop_hook floor "
                               f"(no core is left to hide it on when the ranks' threads fill "
                               f"the CPUs) {(e['reducer_only_ms'] + red) / e['compute_only_ms']:.2f}x "
                               f"no_sync")
    if row["ratio"] is not None:
        out.append(f"target >= {DDP_TARGET:g}x: "
                   f"{'met' if row['ratio'] >= DDP_TARGET else 'MISSED'}")
    return out


# --- whole programs: `python prog.py` against `mpcore run prog.py` ---------
#
# Programs that never start a spawn child must cost no more under
# `mpcore run` than under python.  Each runs as a program of its own under a
# small wrapper that makes itself the subreaper of the program's tree (so
# the keeper and a zygote, if one starts, are its children once orphaned)
# and reaps every process of it: RUSAGE_CHILDREN is then the CPU time of the
# whole tree.  The figure is the program's wall time (start to the exit of
# its main process); the CPU time is in `extra` and the table's notes.

RUN_PROGRAMS = {
    "import": "import torch\n",
    "dl-fork": r"""
import torch
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i % 10


if __name__ == "__main__":
    loader = DataLoader(Samples(20_000), batch_size=32, num_workers=2,
                        multiprocessing_context="fork")
    seen = 0
    for x, y in loader:
        seen += len(x)
    assert seen == 20_000, seen
""",
    "mlp": r"""
import torch
from torch import nn

if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for _ in range(200):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
""",
    # A user's DDP program as tutorials write it: spawn, gloo, torch's own
    # DDP, and torch's default threads in each rank.
    "ddp-spawn": r"""
import os, socket
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

STEPS = 60


def train(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
    w = model[0].weight.detach().sum().reshape(1)
    ws = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(ws, w)
    assert all(torch.equal(v, ws[0]) for v in ws), ws     # DDP kept the ranks in step
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(train, args=(2,), nprocs=2)
""",
    # torch ops in a Pool's workers, each left with torch's default threads.
    "pool-torch": r"""
import torch
import torch.multiprocessing as mp


def task(seed):
    g = torch.Generator().manual_seed(seed)
    a, x = torch.randn(256, 256, generator=g), torch.randn(20_000, generator=g)
    for _ in range(50):
        a = torch.tanh(a @ a * 0.01)
        x = torch.sigmoid(x) + 0.5
    return float(a.sum() + x.sum())


if __name__ == "__main__":
    with mp.Pool(2) as pool:
        got = pool.map(task, range(64))
    assert len(got) == 64 and all(v == v for v in got), got
""",
}

_TREE_WRAPPER = r"""
import ctypes, json, os, resource, subprocess, sys, time
# The subreaper of the program's tree: its orphans (keeper, zygote) are
# reparented here and reaped below, so RUSAGE_CHILDREN counts them too.
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
t0 = time.perf_counter()
p = subprocess.Popen(sys.argv[1:])
p.wait()
wall = time.perf_counter() - t0
while True:   # every process of the tree, to its end
    try:
        os.wait()
    except ChildProcessError:
        break
tree = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": p.returncode, "wall_s": wall, "tree_s": tree,
                  "cpu_s": ru.ru_utime + ru.ru_stime}), flush=True)
"""


def run_tree(impl, program, timeout_s=PROG_TIMEOUT_S):
    """Runs RUN_PROGRAMS[program] as `python prog.py` (torch) or `mpcore run
    prog.py` (mpcore) under _TREE_WRAPPER, in a new session; returns the
    wrapper's dict (wall_s, tree_s, cpu_s)."""
    path = os.path.join(os.path.dirname(_prog_path()), f"run_{program.replace('-', '_')}.py")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(RUN_PROGRAMS[program])
    wrapper = os.path.join(os.path.dirname(path), "tree_wrapper.py")
    if not os.path.exists(wrapper):
        with open(wrapper, "w") as f:
            f.write(_TREE_WRAPPER)
    env = dict(os.environ)
    for k in ("MPCORE_RUN", "MPCORE_KEEPER", "MPCORE_ZYGOTE"):
        env.pop(k, None)
    cmd = [sys.executable, wrapper] + _prog_command(impl, path)
    proc, out, err = _run_session(cmd, env, os.path.dirname(path), timeout_s)
    r = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 and out.strip() else None
    if r is None or r["rc"] != 0:
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise RuntimeError(f"{program} ({impl}): exit code "
                           f"{r['rc'] if r else proc.returncode}: {tail}")
    return r


def _run_session(cmd, env, cwd, timeout_s):
    """Runs cmd in a session of its own to the end (or timeout_s), then
    kills whatever of the session is left; (proc, stdout, stderr)."""
    import signal
    import subprocess
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    return proc, out, err


def program_tree(env, target_s, program):
    r = run_tree(env.impl, program)
    return Measurement(r["wall_s"] * 1e3, 1, r["wall_s"],
                       {"cpu_s": r["cpu_s"], "tree_s": r["tree_s"], "program": program})


LAUNCH_NPROCS = 4
LAUNCH_PROGRAM = """
import os, time
import torch  # noqa: F401  (a training program's first line)
os.write(1, f"first {os.environ['RANK']} {time.time()!r}\\n".encode())
"""


def launch_first_lines(env, target_s):
    """From starting `torchrun --nproc-per-node 4 prog.py` (torch) or `mpcore
    run --nproc-per-node 4 prog.py` (mpcore) to the last rank's first line
    (the ranks' own clock, time.time(), against the one read before the
    start); the launcher's whole run in extra."""
    path = os.path.join(os.path.dirname(_prog_path()), "launch_first.py")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(LAUNCH_PROGRAM)
    bindir = os.path.dirname(sys.executable)
    head = ([os.path.join(bindir, "torchrun")] if env.impl == "torch"
            else [os.path.join(bindir, "mpcore"), "run"])
    cmd = head + ["--nproc-per-node", str(LAUNCH_NPROCS), path]
    penv = {k: v for k, v in os.environ.items()
            if k not in ("MPCORE_RUN", "MPCORE_KEEPER", "MPCORE_ZYGOTE")}
    t0 = time.time()
    proc, out, err = _run_session(cmd, penv, os.path.dirname(path), PROG_TIMEOUT_S)
    wall = time.time() - t0
    firsts = [float(line.split()[2]) for line in out.splitlines() if line.startswith("first ")]
    if proc.returncode != 0 or len(firsts) != LAUNCH_NPROCS:
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise RuntimeError(f"{' '.join(cmd[:2])}: exit code {proc.returncode}, "
                           f"{len(firsts)} first lines: {tail}")
    last = max(firsts) - t0
    # The floor of any launcher whose ranks run prog.py: one `import torch`
    # (mpcore's zygote imports it once, while the launcher imports it too).
    import subprocess
    t1 = time.time()
    imp = subprocess.run([sys.executable, "-c", "import torch"], env=penv, capture_output=True)
    imp_s = time.time() - t1
    if imp.returncode != 0:
        raise RuntimeError(f"python -c 'import torch': exit code {imp.returncode}")
    return Measurement(last * 1e3, 1, last, {"launcher_wall_s": wall, "import_torch_s": imp_s})


def _launch_notes(row):
    out = []
    for impl, best, e in best_entries(row):
        if "import_torch_s" in e:
            out.append(f"{impl}: {best:.4g} ms to the last rank's first line; one `python -c "
                       f"'import torch'` in the same run {e['import_torch_s'] * 1e3:.4g} ms: "
                       f"{best / (e['import_torch_s'] * 1e3):.2f}x it")
    return out


def _tree_notes(row):
    ex = {impl: _best_row_extra(row, impl) for impl in IMPLS}
    if not all(ex.values()):
        return []
    cpu = {impl: min(e["cpu_s"] for e in row[impl]["extra"]) for impl in IMPLS}
    out = [f"CPU time of the process tree (best): torch {cpu['torch']:.3g} s, "
           f"mpcore {cpu['mpcore']:.3g} s, {cpu['torch'] / cpu['mpcore']:.2f}x"]
    if row["ratio"] is not None:
        out.append(f"target >= 1x (wall and CPU): "
                   f"{'met' if min(row['ratio'], cpu['torch'] / cpu['mpcore']) >= 1 else 'MISSED'}")
    return out


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

add_case("pool-spawn", "spawn Pool(4): made, map(64), ended", "ms", False, pool_spawn,
         timeout_s=PROG_TIMEOUT_S + 30,
         note="torch.multiprocessing.get_context('spawn').Pool(4), one map of 64 small items, "
              "then the with-block's end; mean per pool, at least 2, in a program that "
              "imported torch (mpcore: the same program under `mpcore run`).")

add_case("dl-ints", "DataLoader ints, batch 32", "us/batch", False, dl_ints,
         row_notes=_ints_notes,
         note="The article's dataset (a list of n python ints), batch_size=32, num_workers=4, "
              "fork: time per batch after the first, over one long epoch. torch: "
              "torch.utils.data.DataLoader; mpcore: mpcore.data.DataLoader. Target >= 10x; "
              "extra.inproc_us_per_batch: the same epoch with num_workers=0 in the same run, "
              f"target mpcore <= {INPROC_TARGET:g}x that.")
add_case("dl-images", "DataLoader images 3x224x224, batch 32", "ms/batch", False, dl_images,
         row_notes=_images_notes,
         note="64 precomputed float32 3x224x224 tensors, sample i = tensor i % 64, "
              "batch_size=32 (19 MB a batch), num_workers=4, fork; extra.stack_ms: "
              "torch.stack of the same 32 tensors in the child's own process. Targets: "
              f">= 3x, and mpcore <= {STACK_TARGET}x single-process stacking.")
add_case("dl-dicts", "DataLoader dicts of 16 small tensors, batch 64", "us/batch", False,
         dl_dicts,
         note="256 precomputed samples, each a dict of 16 small tensors (float32 (8,), "
              "int64 (4,), float32 (2,3), int32 ()), batch_size=64, num_workers=4, fork. "
              "Target >= 25x.")
add_case("dl-first-spawn", "DataLoader first batch, spawn", "ms", False, dl_first_spawn,
         timeout_s=PROG_TIMEOUT_S + 30, row_notes=_first_spawn_notes,
         note="In a fresh program that imported torch: from DataLoader(article's dataset, "
              "batch_size=32, num_workers=4, multiprocessing_context='spawn') to its first "
              "batch. torch: `python prog.py`; mpcore: `mpcore run prog.py` with "
              "mpcore.data.DataLoader. Target >= 10x.")
add_case("dl-rss", "DataLoader RSS after 100k batches", "%", False, dl_rss_torch, dl_rss,
         compare=False, row_notes=_rss_notes, timeout_s=RSS_MAX_S + 60,
         note=f"Main process's RSS growth from batch {RSS_FROM:,} to batch {RSS_BATCHES:,} of "
              "one epoch (one iterator) over the article's ints, batch_size=32, num_workers=4, "
              f"fork; mpcore target < {RSS_TARGET_PCT:g}%. The torch side stops at a reading "
              f"after {RSS_TORCH_BUDGET} timed parts ({RSS_TORCH_BUDGET} s; "
              f"{RSS_TORCH_BUDGET * 0.2:g} s under --quick), short of 100k batches: the "
              "table's notes say where each side stopped. No ratio.")


def _add_program(program, title, note):
    """A RUN_PROGRAMS row: `python prog.py` against `mpcore run prog.py`."""
    add_case(f"run-{program}", f"program: {title}", "ms", False, program_tree,
             params={"program": program}, row_notes=_tree_notes, timeout_s=PROG_TIMEOUT_S + 30,
             note=note + ": `python prog.py` against `mpcore run prog.py`; wall and tree CPU "
                         "time. Target >= 1x.")


_add_program("import", "import torch", "A program that only imports torch")
_add_program("dl-fork", "DataLoader epoch, 2 fork workers",
             "A program running one epoch of torch.utils.data.DataLoader (20,000 samples of "
             "64 floats, batch_size=32, num_workers=2, fork)")
_add_program("mlp", "MLP training, 200 steps",
             "A one-process program training a small MLP (256-512-512-10, batch 64, SGD) "
             "for 200 steps")
_add_program("ddp-spawn", "DDP through spawn, 2 ranks, 60 steps",
             "A program training an MLP (512-1024-1024-10, batch 64, SGD) for 60 steps with "
             "torch's DistributedDataParallel on gloo in 2 ranks started by "
             "torch.multiprocessing.spawn, leaving each rank torch's default thread count "
             "(mpcore's spawn gives each its share of the cores, NOTE [ A rank's share of the "
             "cores ])")
_add_program("pool-torch", "torch ops in Pool(2).map, 64 tasks",
             "A program mapping 64 tasks of torch ops (a 256x256 matmul and elementwise ops "
             "on 20,000 floats, 50 times) over torch.multiprocessing.Pool(2), each worker left "
             "with torch's default thread count (mpcore's Pool gives each its share of the "
             "cores)")

add_case("run-launch-4", "launcher: 4 ranks to first line", "ms", False, launch_first_lines,
         timeout_s=PROG_TIMEOUT_S + 30, in_quick=False, row_notes=_launch_notes,
         note="From starting `torchrun --nproc-per-node 4 prog.py` (torch) or `mpcore run "
              "--nproc-per-node 4 prog.py` (mpcore) to every rank's first line; prog.py "
              "imports torch, then prints. Each side then times one `python -c 'import "
              "torch'`: no launcher whose ranks import torch can be faster (the notes give "
              "each side's ratio to it). Target >= 5x.")

for _world in AR_WORLDS:
    for _tag, _label, _nbytes in AR_SIZES:
        _goal = AR_TARGETS.get(_nbytes)
        add_case(f"allreduce-{_world}r-{_tag}", f"all_reduce {_label} float32, {_world} ranks",
                 "us" if _nbytes < AR_US_BELOW else "ms", False, allreduce,
                 params={"world": _world, "nbytes": _nbytes}, row_notes=_allreduce_notes,
                 note=f"dist.all_reduce (SUM) of a {_label} float32 tensor among {_world} "
                      "spawned ranks, time per call; extra: algbw/busbw GB/s. torch: "
                      "torch.distributed, gloo; mpcore: mpcore.distributed (shared memory)."
                      + (f" Target >= {_goal:g}x." if _goal else ""))
del _world, _tag, _label, _nbytes, _goal
add_case("ddp-mlp", f"DDP step, 10M-param MLP, {DDP_WORLD} ranks", "steps/s", True, ddp_step,
         params={"world": DDP_WORLD}, row_notes=_ddp_notes, timeout_s=150.0,
         note="A training step (forward, MSE loss, backward, SGD) of a 9.97M-parameter MLP "
              "(Linear 1024-2048-2048-1024-1024-512, ReLU), batch 32, 2 spawned ranks. torch: "
              "torch's DistributedDataParallel over gloo; mpcore: "
              f"mpcore.parallel.DistributedDataParallel. Target >= {DDP_TARGET:g}x.")


# The rows of the other case modules, after the rows above, in this order:
# Queue (queue_cases.py), DataLoader (loader_cases.py), resumable loading
# (state_cases.py), the torch.distributed backend (dist_cases.py), Open MPI
# as a peer (mpi_cases.py), shared datasets (shared_cases.py).  Each has
# register(cases).
for _name in ("queue_cases", "loader_cases", "state_cases", "dist_cases", "mpi_cases",
              "shared_cases"):
    importlib.import_module(f".{_name}" if __package__ else _name,
                            __package__).register(sys.modules[__name__])


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
