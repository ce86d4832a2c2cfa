"""The torch.distributed backend rows: `init_process_group("mpcore")` against
gloo, the same torch.distributed code on both sides.

cases.py imports this module and calls register(cases) near its end; the
rows go after its own.  Nothing here imports torch or mpcore at module
level.

NOTE [ The backend rows ]
Each side starts 2 ranks from the measuring child (cases._run_ranks: torch's
spawn on the torch side, mpcore's on the other) and every rank calls
`torch.distributed.init_process_group(BACKEND[impl])`: "gloo" on the torch
side, in processes that never import mpcore; "mpcore" on the mpcore side,
after `import mpcore.distributed` (which registers the backend).  The rank
code is the same on both sides and uses torch.distributed only: what is
measured is torch's own API dispatching to either backend.  The mpcore side
fails unless its default group is mpcore's (`ProcessGroupMpcore` with a
shared-memory group, `.shm`), so a fallback to another backend cannot pass
for mpcore.

One start of the ranks serves every row of this module that the child runs
(one row in a full run, all of them under --quick); the rows ask for jobs
(`Case.params["jobs"]`) and the ranks run their union, in a fixed order.
A job times one thing the way cases._allreduce_size does: a check of the
result with known values, warm-up calls, then calibrate() over runs of
"barrier, n calls", each rank's elapsed time all-reduced with MAX (the
slowest rank counts, and every rank picks the same n), then ROUNDS more
runs of that n: the figure is the best run.

Sizes follow nccl-tests: the figure is the largest buffer of the call, so
all_gather_into_tensor's output, reduce_scatter_tensor's input, gather's
and scatter's whole (world x piece) buffer on the root, the tensor itself
for the others.  send/recv is a ping-pong: the figure is one round trip.

A "-sub" row runs the same op on `new_group(all ranks)`; its job also
times the world group's op, with the same n, in runs that alternate with
the subgroup's, so the note compares the two from the same seconds
(target: the subgroup within 1.2x of the world group).
"""
import time

BACKEND = {"torch": "gloo", "mpcore": "mpcore"}
WORLD = 2
KB, MB = 1 << 10, 1 << 20
SIZES = (("4k", "4 KB", 4 * KB), ("16m", "16 MB", 16 * MB))
TARGETS = {4 * KB: 30.0, 16 * MB: 3.0}   # mpcore's target ratio per size (every op)
MANY = 100     # c10d-allreduce-1m-x100: tensors reduced in turn, more than a rank once kept mapped
SUB_TARGET = 1.2          # a subgroup's time over the world group's, at most
STEP_TARGET = 1.5         # FSDP2 and torch-DDP steps
LAYER_TARGET_US = 10.0    # what the backend layer may add to the core's all_reduce
ROUNDS = 2                # timed runs after calibrate's last (alternating with others)
US_BELOW = 1 * MB         # sizes below: us per call; from 1 MB on: ms

# op name in rows -> (torch.distributed call, title)
OPS = (("allreduce", "all_reduce"), ("broadcast", "broadcast"),
       ("allgather", "all_gather_into_tensor"), ("reducescatter", "reduce_scatter_tensor"),
       ("alltoall", "all_to_all_single"), ("reduce", "reduce"), ("gather", "gather"),
       ("scatter", "scatter"), ("barrier", "barrier"), ("sendrecv", "send/recv ping-pong"))
QUICK_ROWS = ("c10d-allreduce-4k", "c10d-allreduce-4k-sub", "c10d-sendrecv-4k",
              "c10d-funcol-allreduce-4k", "c10d-layer-allreduce-4k")

_c = None            # the cases module (register)
_names = []          # this module's rows
_results = {}        # impl -> rank 0's figures, or the exception


# --- in the ranks ---------------------------------------------------------

def _setup(rank, impl, world):
    """torch, torch.distributed with the side's backend as default group,
    the init time."""
    import datetime
    import torch
    torch.set_num_threads(_c._rank_threads(world))
    import torch.distributed as dist
    if impl == "mpcore":
        import mpcore.distributed  # noqa: F401  (registers the "mpcore" backend)
    t0 = time.perf_counter()
    dist.init_process_group(BACKEND[impl], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=_c.DIST_TIMEOUT_S))
    init_s = time.perf_counter() - t0
    if impl == "mpcore":
        pg = dist.group.WORLD
        if getattr(pg, "shm", None) is None:
            raise RuntimeError(f"the default group is {type(pg).__module__}."
                               f"{type(pg).__qualname__} with backend "
                               f"{dist.get_backend()!r}, not mpcore's shared-memory group")
    return torch, dist, init_s


def _run(torch, dist, call, n):
    """Barrier, n calls: the slowest rank's time (every rank gets it)."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return _c._max_over_ranks(torch, dist, time.perf_counter() - t0)


def _timed(torch, dist, call, target_s, probe, others=None):
    """calibrate() over _run, then ROUNDS more runs of the same n; the best
    run.  `others` ({name: call}): calls timed with the same n in the same
    rounds, alternating with `call` (their best runs: extra "<name>_s")."""
    n, el = _c.calibrate(lambda k: _run(torch, dist, call, k), target_s, probe, lo=2)
    best = {name: float("inf") for name in others or {}}
    for _ in range(ROUNDS):
        for name, other in (others or {}).items():
            best[name] = min(best[name], _run(torch, dist, other, n))
        el = min(el, _run(torch, dist, call, n))
    out = {"n": n, "elapsed_s": el, "per_call_s": el / n}
    out.update({f"{name}_s": b for name, b in best.items()})
    return out


def _expect(ok, what):
    """Every rank calls this at the same point: a wrong result on any rank
    fails the job on all of them (and the ranks stay in step for the next
    job)."""
    import torch
    import torch.distributed as dist
    ok = bool(ok)
    if _c._max_over_ranks(torch, dist, 0.0 if ok else 1.0):
        raise AssertionError(f"wrong result {'on another rank' if ok else ''}: {what}")


def _op(torch, dist, op, nbytes, g, rank, world):
    """A zero-argument call of `op` on group g with buffers of nbytes (see
    NOTE [ The backend rows ] for what the size counts), after one call
    whose result is checked."""
    numel = max(1, nbytes // 4)
    piece = max(1, numel // world)
    want_sum = world * (world + 1) / 2
    full = lambda n, v: torch.full((n,), float(v))   # noqa: E731
    if op == "allreduce":
        t = full(numel, rank + 1)
        dist.all_reduce(t, group=g)
        _expect((t == want_sum).all(), f"all_reduce gave {t[:2].tolist()}, want {want_sum}")
        t.zero_()
        return lambda: dist.all_reduce(t, group=g)
    if op == "allreduce-fresh":
        def call():
            t = full(numel, rank + 1)
            dist.all_reduce(t, group=g)
            return t
        t = call()
        _expect((t == want_sum).all(), f"all_reduce gave {t[:2].tolist()}, want {want_sum}")
        return call
    if op == "allreduce-many":
        # MANY tensors reduced in turn, each again and again: gradients averaged by
        # hand (NOTE [ Peers' buffers stay mapped ] in coll_copy.c)
        ts = [full(numel, rank + 1) for _ in range(MANY)]
        for t in ts:
            dist.all_reduce(t, group=g)
        _expect(all((t == want_sum).all() for t in ts), "all_reduce of many tensors: wrong sums")

        def call():
            for t in ts:
                dist.all_reduce(t, group=g)
        return call
    if op == "broadcast":
        t = full(numel, rank + 1)
        dist.broadcast(t, src=0, group=g)
        _expect((t == 1).all(), f"broadcast gave {t[:2].tolist()}, want 1")
        return lambda: dist.broadcast(t, src=0, group=g)
    if op == "allgather":
        inp, out = full(piece, rank + 1), torch.empty(piece * world)
        dist.all_gather_into_tensor(out, inp, group=g)
        want = torch.arange(1, world + 1, dtype=out.dtype).repeat_interleave(piece)
        _expect(torch.equal(out, want), "all_gather_into_tensor: pieces out of place")
        return lambda: dist.all_gather_into_tensor(out, inp, group=g)
    if op == "reducescatter":
        inp, out = full(piece * world, rank + 1), torch.empty(piece)
        dist.reduce_scatter_tensor(out, inp, group=g)
        _expect((out == want_sum).all(), f"reduce_scatter_tensor gave {out[:2].tolist()}")
        inp.zero_()
        return lambda: dist.reduce_scatter_tensor(out, inp, group=g)
    if op == "alltoall":
        inp = torch.arange(world, dtype=torch.float32).add_(rank * world).repeat_interleave(piece)
        out = torch.empty(piece * world)
        dist.all_to_all_single(out, inp, group=g)
        want = (torch.arange(world, dtype=torch.float32) * world + rank).repeat_interleave(piece)
        _expect(torch.equal(out, want), "all_to_all_single: pieces out of place")
        return lambda: dist.all_to_all_single(out, inp, group=g)
    if op == "reduce":
        t = full(numel, rank + 1)
        dist.reduce(t, dst=0, group=g)
        _expect(rank != 0 or (t == want_sum).all(), f"reduce gave {t[:2].tolist()} on the root")
        t.zero_()
        return lambda: dist.reduce(t, dst=0, group=g)
    if op == "gather":
        inp = full(piece, rank + 1)
        outs = [torch.empty(piece) for _ in range(world)] if rank == 0 else None
        dist.gather(inp, outs, dst=0, group=g)
        _expect(rank != 0 or all((o == k + 1).all() for k, o in enumerate(outs)),
                "gather: pieces out of place on the root")
        return lambda: dist.gather(inp, outs, dst=0, group=g)
    if op == "scatter":
        ins = [full(piece, k + 1) for k in range(world)] if rank == 0 else None
        out = torch.empty(piece)
        dist.scatter(out, ins, src=0, group=g)
        _expect((out == rank + 1).all(), f"scatter gave rank {rank} {out[:2].tolist()}")
        return lambda: dist.scatter(out, ins, src=0, group=g)
    if op == "barrier":
        dist.barrier(group=g)
        return lambda: dist.barrier(group=g)
    if op == "sendrecv":
        if world != 2:
            raise ValueError("the send/recv ping-pong runs on 2 ranks")
        t = full(numel, 7 if rank == 0 else 0)
        if rank == 0:
            def call():
                dist.send(t, 1, group=g)
                dist.recv(t, 1, group=g)
        else:
            def call():
                dist.recv(t, 0, group=g)
                dist.send(t, 0, group=g)
        call()
        _expect((t == 7).all(), f"ping-pong gave {t[:2].tolist()} on rank {rank}")
        return call
    raise ValueError(f"unknown op {op!r}")


def _op_job(torch, dist, groups, rank, world, target_s, op, nbytes, group):
    """One op on one group; on the subgroup, the world group's op is timed
    in the same rounds, alternating with it."""
    calls = {g: _op(torch, dist, op, nbytes, groups[g], rank, world)
             for g in dict.fromkeys(("world", group))}
    for call in calls.values():
        for _ in range(max(2, min(50, (8 << 20) // max(nbytes, 1)))):
            call()
    others = {"world": calls["world"]} if group != "world" else None
    out = _timed(torch, dist, calls[group], target_s,
                 max(2, min(50, (1 << 20) // max(nbytes, 1))), others)
    if others:
        out["world_per_call_s"] = out.pop("world_s") / out["n"]
    return out


def _funcol_job(torch, dist, rank, world, target_s, nbytes):
    """torch.distributed._functional_collectives.all_reduce and its wait;
    also, in alternating runs of the same n, the same call on a group of
    this rank alone: what torch's functional layer and the backend cost
    with no peer to meet ("alone")."""
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    alone = [dist.new_group([q]) for q in range(world)][rank]
    t = torch.full((nbytes // 4,), float(rank + 1))

    def call(group=g):
        y = funcol.all_reduce(t, "sum", group)
        return funcol.wait_tensor(y)
    y = call()
    want = world * (world + 1) / 2
    _expect((y == want).all() and (t == rank + 1).all(),
            f"functional all_reduce gave {y[:2].tolist()} (input now {t[:2].tolist()})")
    t.zero_()
    for _ in range(20):
        call()
        call(alone)
    out = _timed(torch, dist, call, target_s, 50, {"alone": lambda: call(alone)})
    out["alone_per_call_s"] = out.pop("alone_s") / out["n"]
    return out


def _layer_job(torch, dist, impl, rank, world, target_s, nbytes):
    """dist.all_reduce on the default group and (mpcore side) the same
    all-reduce through the core's own call, `.shm.core.all_reduce`, timed in
    alternating runs of the same n; the best run of each."""
    t = torch.full((nbytes // 4,), float(rank + 1))
    dist.all_reduce(t)
    t.zero_()
    call_dist = lambda: dist.all_reduce(t)   # noqa: E731
    for _ in range(50):
        call_dist()
    if impl != "mpcore":
        return _timed(torch, dist, call_dist, target_s, 50)
    from mpcore import _core
    core = dist.group.WORLD.shm.core
    f32 = getattr(_core, "COLL_DTYPES", {}).get("float32", 0)
    op_sum = getattr(_core, "COLL_OPS", {}).get("SUM", 0)
    addr, count, timeout = t.data_ptr(), t.numel(), _c.DIST_TIMEOUT_S
    call_core = lambda: core.all_reduce(addr, count, f32, op_sum, timeout)   # noqa: E731
    pg, opts = dist.group.WORLD, dist.AllreduceOptions()
    opts.asyncOp = False      # as dist.all_reduce asks
    call_method = lambda: pg.allreduce([t], opts)   # noqa: E731
    t.fill_(rank + 1)
    call_core()
    _expect((t == world * (world + 1) / 2).all(), "the core's all_reduce")
    t.zero_()
    for _ in range(50):
        call_core()
    out = _timed(torch, dist, call_dist, target_s, 50, {"core": call_core, "method": call_method})
    out["core_per_call_s"] = out.pop("core_s") / out["n"]
    out["method_per_call_s"] = out.pop("method_s") / out["n"]
    return out


def _fsdp2_job(torch, dist, rank, world, target_s):
    """An FSDP2 training step: fully_shard on each Linear and the root,
    forward, MSE loss, backward, SGD step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    nn = torch.nn
    model = _c._ddp_model(torch)
    params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(_c.DDP_BATCH, _c.DDP_LAYERS[0], generator=g)
    y = torch.randn(_c.DDP_BATCH, _c.DDP_LAYERS[-1], generator=g)

    def step():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss
    for _ in range(3):
        loss = step()
    out = _timed(torch, dist, step, target_s, 4)
    # The sharded parameters, gathered: the same on every rank by
    # construction, so compare a checksum with the mean of the ranks' too.
    w = model[0].weight.full_tensor().double().sum().item()
    spread = _c._max_over_ranks(torch, dist, w) + _c._max_over_ranks(torch, dist, -w)
    loss = float(loss.detach())
    _expect(abs(spread) <= 1e-9 * max(1.0, abs(w)) and loss == loss and abs(loss) < 1e30,
            f"FSDP2 ranks disagree (checksum spread {spread:g}) or the loss is {loss}")
    out.update(params=params, step_ms=out["per_call_s"] * 1e3)
    return out


def _run_job(torch, dist, impl, groups, rank, world, target_s, job):
    kind = job[0]
    if kind == "op":
        return _op_job(torch, dist, groups, rank, world, target_s, *job[1:])
    if kind == "funcol":
        return _funcol_job(torch, dist, rank, world, target_s, job[1])
    if kind == "layer":
        return _layer_job(torch, dist, impl, rank, world, target_s, job[1])
    if kind == "fsdp2":
        return _fsdp2_job(torch, dist, rank, world, target_s)
    if kind == "ddp":
        return _c._ddp_job(torch, dist, impl, rank, target_s, torch_ddp=True)
    raise ValueError(f"unknown job {job!r}")


def _rank_main(rank, impl, world, jobs, target_s, path):
    """One rank: the side's backend, then every job of `jobs` (a sorted list
    of job keys) in order; rank 0 writes the figures to path."""
    torch, dist, init_s = _setup(rank, impl, world)
    try:
        out = {"init_s": init_s, "threads": torch.get_num_threads(),
               "backend": str(dist.get_backend()),
               "group": f"{type(dist.group.WORLD).__module__}."
                        f"{type(dist.group.WORLD).__qualname__}", "jobs_out": {}}
        groups = {"world": dist.group.WORLD}
        if any(j[0] == "op" and j[3] == "sub" for j in jobs):
            groups["sub"] = dist.new_group(list(range(world)))
        for job in jobs:
            try:
                r = _run_job(torch, dist, impl, groups, rank, world, target_s, job)
            except Exception as e:
                # The job's row fails; the others go on (an error that every
                # rank raises, as _expect's, leaves the ranks in step).
                r = {"error": f"{type(e).__name__}: {e}"}
            out["jobs_out"][_key(job)] = r
        if rank == 0:
            _c._write_result(path, out)
    finally:
        dist.destroy_process_group()


# --- in the measuring child -------------------------------------------------

def _key(job):
    return "/".join(str(x) for x in job)


def _result(env, target_s, job):
    """This child's ranks' figures for `job`: the ranks start with the first
    row that needs them and run the jobs of every row of this module in the
    child's batch.  Ranks that fail fail every row, once; a job that fails
    (on every rank) fails its own row."""
    if env.impl not in _results:
        jobs = set()
        for name in _c._batch:
            if name in _names:
                jobs.update(tuple(j) for j in _c.CASES[name].params["jobs"])
        try:
            _results[env.impl] = _c._run_ranks(env, WORLD, sorted(jobs, key=_key), target_s,
                                               rank_fn=_rank_main)
        except Exception as e:
            _results[env.impl] = e
            raise
    r = _results[env.impl]
    if isinstance(r, Exception):
        raise RuntimeError(f"the ranks failed (see this child's first error): {r}")
    s = r["jobs_out"][_key(job)]
    if "error" in s:
        raise RuntimeError(f"rank 0: {s['error']}")
    return r, s


def _extra(r):
    extra = {k: r[k] for k in ("threads", "init_s", "ranks_wall_s", "spawn", "backend",
                               "group")}
    extra["jobs_in_run"] = len(r["jobs"])
    return extra


def _scale(nbytes):
    return 1e6 if nbytes < US_BELOW else 1e3


def op_row(env, target_s, jobs, nbytes):
    """An op on the world group or on a subgroup (with the world group's
    figure from the same rounds)."""
    r, s = _result(env, target_s, tuple(jobs[0]))
    extra = _extra(r)
    extra.update(bytes=nbytes, us_per_call=s["per_call_s"] * 1e6)
    if "world_per_call_s" in s:
        extra.update(world_us_per_call=s["world_per_call_s"] * 1e6,
                     sub_over_world=s["per_call_s"] / s["world_per_call_s"])
    return _c.Measurement(s["per_call_s"] * _scale(nbytes), s["n"], s["elapsed_s"], extra)


def funcol_row(env, target_s, jobs, nbytes):
    r, s = _result(env, target_s, tuple(jobs[0]))
    extra = _extra(r)
    extra.update(bytes=nbytes, alone_us=s["alone_per_call_s"] * 1e6)
    return _c.Measurement(s["per_call_s"] * 1e6, s["n"], s["elapsed_s"], extra)


def layer_row(env, target_s, jobs, nbytes):
    r, s = _result(env, target_s, tuple(jobs[0]))
    extra = _extra(r)
    extra.update(bytes=nbytes, dist_us=s["per_call_s"] * 1e6)
    if "core_per_call_s" in s:
        extra.update(core_us=s["core_per_call_s"] * 1e6,
                     method_us=s["method_per_call_s"] * 1e6,
                     layer_us=(s["method_per_call_s"] - s["core_per_call_s"]) * 1e6,
                     torch_us=(s["per_call_s"] - s["method_per_call_s"]) * 1e6)
    return _c.Measurement(s["per_call_s"] * 1e6, s["n"], s["elapsed_s"], extra)


def fsdp2_row(env, target_s, jobs):
    r, s = _result(env, target_s, tuple(jobs[0]))
    extra = _extra(r)
    extra.update(step_ms=s["step_ms"], params=s["params"], batch=_c.DDP_BATCH, world=WORLD)
    return _c.Measurement(s["step_ms"], s["n"], s["elapsed_s"], extra)


def ddp_row(env, target_s, jobs):
    r, d = _result(env, target_s, tuple(jobs[0]))
    step_ms = d["elapsed_s"] / d["n"] * 1e3
    extra = {k: d[k] for k in _c.DDP_EXTRA}
    extra.update(_extra(r))
    extra.update(step_ms=step_ms, comm_ms=step_ms - d["compute_only_ms"],
                 batch=_c.DDP_BATCH, world=WORLD)
    if abs(d["param_spread"]) > 1e-6 * max(1.0, d["params"] ** 0.5):
        raise AssertionError(f"the ranks' parameters differ after DDP steps "
                             f"(spread of a checksum {d['param_spread']:g})")
    return _c.Measurement(step_ms, d["n"], d["elapsed_s"], extra)


# --- notes under the table ----------------------------------------------------

def _num(x):
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _us(x):
    return f"{_num(x)} us"


def _met(ok):
    return "met" if ok else "MISSED"


def _op_notes(row):
    out = []
    ex = {impl: _c._best_row_extra(row, impl) for impl in ("torch", "mpcore")}
    m = ex["mpcore"]
    if m and "alone_us" in m:
        t = ex["torch"]
        out.append(f"the same call on a group of one rank (no peer: torch's functional layer "
                   f"and the backend): mpcore {_us(m['alone_us'])}"
                   + (f", gloo {_us(t['alone_us'])}" if t and "alone_us" in t else ""))
    goal = TARGETS.get(m["bytes"]) if m else None
    if goal and row["ratio"] is not None:
        out.append(f"target >= {goal:g}x gloo: {_met(row['ratio'] >= goal)}")
    if m and "sub_over_world" in m:
        t = ex["torch"]
        gloo = (f"; gloo {_us(t['us_per_call'])} vs {_us(t['world_us_per_call'])}"
                if t and "world_us_per_call" in t else "")
        out.append(f"mpcore subgroup {_us(m['us_per_call'])} per call vs the world group's "
                   f"{_us(m['world_us_per_call'])} in the same ranks: "
                   f"{m['sub_over_world']:.2f}x (target <= {SUB_TARGET:g}x: "
                   f"{_met(m['sub_over_world'] <= SUB_TARGET)}){gloo}")
    return out


def _step_notes(row):
    out = []
    for impl in ("torch", "mpcore"):
        e = _c._best_row_extra(row, impl)
        if e:
            out.append(f"{impl} ({e['backend']}): {_num(e['step_ms'])} ms per step")
    if row["ratio"] is not None:
        out.append(f"target >= {STEP_TARGET:g}x: {_met(row['ratio'] >= STEP_TARGET)}")
    return out


def _layer_notes(row):
    m = _c._best_row_extra(row, "mpcore")
    if not m or "core_us" not in m:
        return []
    return [f"mpcore: dist.all_reduce {_us(m['dist_us'])}, the backend's allreduce method "
            f"called directly {_us(m['method_us'])}, the core's own all_reduce "
            f"{_us(m['core_us'])}: the backend layer adds {_us(m['layer_us'])} "
            f"(target <= {LAYER_TARGET_US:g} us: {_met(m['layer_us'] <= LAYER_TARGET_US)}); "
            + (f"torch's dist.all_reduce function adds {_us(m['torch_us'])} on top (the same "
               "function serves gloo)" if m["torch_us"] >= 0 else
               f"dist.all_reduce takes {_us(-m['torch_us'])} less than the method: its fast "
               "path calls the core past torch's function and the method (NOTE [ The rest of "
               "torch's collectives ] in dist/_fastpath.py)")]


# --- the rows -----------------------------------------------------------------

def _add(name, title, unit, fn, params, **kw):
    _c.add_case(name, title, unit, False, fn, in_quick=name in QUICK_ROWS, params=params, **kw)
    _names.append(name)


def register(cases):
    """Adds this module's rows to cases.CASES (called by cases.py)."""
    global _c
    _c = cases
    side = ("torch: torch.distributed on gloo; mpcore: torch.distributed on "
            "init_process_group(\"mpcore\"); 2 spawned ranks")
    for op, call in OPS:
        for tag, label, nbytes in (SIZES if op != "barrier" else (("", "", 0),)):
            for group in ("world", "sub"):
                name = f"c10d-{op}" + (f"-{tag}" if tag else "") + \
                    ("-sub" if group == "sub" else "")
                jobs = [("op", op, nbytes, group)]
                title = f"c10d {call}{' ' + label if label else ''}, " + \
                    ("world group" if group == "world" else "subgroup")
                goal = TARGETS.get(nbytes)
                _add(name, title, "us" if nbytes < US_BELOW else "ms", op_row,
                     {"jobs": jobs, "nbytes": nbytes}, row_notes=_op_notes,
                     timeout_s=120.0,
                     note=f"dist.{call}" + (f" of {label} float32" if label else "") +
                          (" on new_group(all ranks)" if group == "sub" else "") +
                          f", time per call; {side}." +
                          (f" Target >= {goal:g}x." if goal else "") +
                          (f" Subgroup within {SUB_TARGET:g}x of the world group."
                           if group == "sub" else ""))
    _add("c10d-allreduce-fresh-16m", "c10d all_reduce 16 MB, a new tensor each call", "ms",
         op_row, {"jobs": [("op", "allreduce-fresh", 16 * MB, "world")], "nbytes": 16 * MB},
         row_notes=_op_notes, timeout_s=120.0,
         note="t = torch.full(16 MB of float32); dist.all_reduce(t): a tensor made anew for "
              "each call, as gradients averaged by hand after zero_grad(set_to_none=True) are "
              "(NOTE [ Memory reduced again and again ] in dist/_buffers.py); time per call, the "
              f"making included; {side}. Target >= {TARGETS[16 * MB]:g}x.")
    _add(f"c10d-allreduce-1m-x{MANY}", f"c10d all_reduce of {MANY} tensors of 1 MB in turn", "ms",
         op_row, {"jobs": [("op", "allreduce-many", MB, "world")], "nbytes": MB},
         row_notes=_op_notes, timeout_s=180.0,
         note=f"dist.all_reduce of each of {MANY} tensors of 1 MB float32, the same tensors "
              "every time, as gradients averaged by hand are (and DDP's buckets); time per "
              f"round of {MANY} calls; {side}.")
    _add("c10d-funcol-allreduce-4k", "c10d functional all_reduce 4 KB + wait", "us",
         funcol_row, {"jobs": [("funcol", 4 * KB)], "nbytes": 4 * KB}, row_notes=_op_notes,
         timeout_s=120.0,
         note="torch.distributed._functional_collectives.all_reduce of a 4 KB float32 tensor "
              f"and wait_tensor, time per call; {side}. Target >= 30x.")
    _add("c10d-fsdp2-mlp", "c10d FSDP2 step, 10M-param MLP", "ms", fsdp2_row,
         {"jobs": [("fsdp2",)]}, row_notes=_step_notes, timeout_s=180.0,
         note="fully_shard (each Linear and the root) of the 9.97M-parameter MLP of ddp-mlp, "
              f"batch 32: forward, MSE loss, backward, SGD step; ms per step; {side}. "
              f"Target >= {STEP_TARGET:g}x.")
    _add("c10d-ddp-mlp", "c10d torch DDP step, 10M-param MLP", "ms", ddp_row,
         {"jobs": [("ddp",)]}, row_notes=_c._ddp_notes, timeout_s=180.0,
         note="torch.nn.parallel.DistributedDataParallel (torch's own, on both sides) of the "
              f"MLP of ddp-mlp, batch 32; ms per step; {side}. Target >= {STEP_TARGET:g}x.")
    _add("c10d-layer-allreduce-4k", "c10d backend layer: all_reduce 4 KB", "us", layer_row,
         {"jobs": [("layer", 4 * KB)], "nbytes": 4 * KB}, row_notes=_layer_notes,
         timeout_s=120.0,
         note="dist.all_reduce of 4 KB float32 on the default group (figure, both sides); "
              "the mpcore side also times the core's own call (group.shm.core.all_reduce) in "
              "alternating runs: the notes give both and the difference. Target: the layer "
              f"adds <= {LAYER_TARGET_US:g} us.")
