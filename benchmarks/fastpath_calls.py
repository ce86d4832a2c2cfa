"""What each small torch.distributed call costs on an mpcore group, next to
the C core's own call it makes, on a group of one rank (no peer to wait
for: what is left is the software above the core's work).

    python benchmarks/fastpath_calls.py [--size BYTES] [--calls N] [--runs R] [--only a,b]

NOTE [ Every small call against the core's ]
For each operation, five ways of making the same call, timed as
allreduce_layers.py times its levels (CPU time of the calling thread per
call, best and median of R runs of N calls, the ways interleaved run by
run and the order turned each run):
- core: the C core's own call that the fast path makes
  (group.shm.core.all_reduce(...) and so on), with its arguments made
  once;
- dist: the dist.* call as a program makes it (the fast path of
  _fastpath.py where one serves it);
- torch's path: torch's own function, the one the fast path stands in
  front of (_fastpath._TORCH), which goes through torch's checks and
  options to the group's method: the path before the fast path, and the
  one an observed call takes;
- async: the dist.* call with async_op=True and its Work's wait();
- torch's async: the same through torch's function and the group's
  method, as before the fast path.
The table gives each in us, and dist - core, the fast path's price over
the core, and async - dist, what asking for a Work costs over a blocking
call.  On two ranks the wall times of all_reduce, barrier and broadcast
through torch.distributed next to the core's and Open MPI's are the
`mpcore bench --only mpi-2r-...` rows.

NOTE [ Two ranks, each way on either ]
On two ranks a call through torch.distributed has cost more over the
core's own call (wall time) than the fast path's CPU time on one rank.
`--mixed` asks why: for all_reduce 4 KB, barrier and broadcast 4 KB, each
rank makes the core's call, the dist.* call, or the core's call after a
pure-Python delay ("pad", as long as the fast path's CPU time over the
core's on one rank, PADS_US, or --pad), in all nine pairs, interleaved run by run (wall us per
call on rank 0, median and best of the runs).  If the software above the
core only added its own time, dist/dist would cost what pad/pad costs, and
core/dist what dist/dist costs; a pair that costs more says where the time
goes (the ranks' arrival order, one rank's delay waking the other).
Measured on quiet cores (benchmarks/README.md, The Open MPI rows):
dist/dist costs what pad/pad costs, and both ranks' pads add up in wall
time where one rank's costs only itself.
"""
import argparse
import datetime
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce_layers import _free_port, measure  # noqa: E402


def cases(dist, pg, n):
    """{op: {way: call}} for tensors of n float32 elements."""
    import torch
    from mpcore.dist import _fastpath
    shm = pg.shm
    core, timeout, w = shm.core, shm.timeout, pg.size()
    from mpcore import _core
    f32, op_sum = _core.COLL_DTYPES["float32"], _core.COLL_OPS["SUM"]

    def torch_fn(name):
        return _fastpath._TORCH.get(name) or getattr(dist.distributed_c10d, name)

    t = torch.zeros(n)
    flat = torch.zeros(w * n)
    outs = [torch.zeros(n) for _ in range(w)]
    ins = [torch.ones(n) for _ in range(w)]
    out1 = torch.zeros(n)
    a2a_in, a2a_out = torch.ones(w * n), torch.zeros(w * n)
    nb = t.nbytes
    sizes = [nb] * w
    SUM = dist.ReduceOp.SUM
    def ways(name, core_call, *args):
        """The core's own call beside torch.distributed's `name`: the fast
        path, torch's own function (the path before it), and each of them
        async and waited on; None where this torch has no `name`."""
        fn = getattr(dist, name, None)
        if fn is None:
            return None
        torch = torch_fn(name)
        return {"core": core_call,
                "dist": lambda: fn(*args),
                "torch's path": lambda: torch(*args),
                "async": lambda: fn(*args, async_op=True).wait(),
                "torch's async": lambda: torch(*args, async_op=True).wait()}

    def all_gather():
        core.all_gather(flat.data_ptr(), t.data_ptr(), nb, timeout)

    def reduce_scatter():
        core.reduce_scatter(out1.data_ptr(), flat.data_ptr(), n, f32, op_sum, timeout)

    def all_to_all():
        core.all_to_all(a2a_out.data_ptr(), a2a_in.data_ptr(), sizes, sizes, timeout)

    out = {
        "all_reduce": ways("all_reduce",
                           lambda: core.all_reduce(t.data_ptr(), n, f32, op_sum, timeout, None), t),
        "barrier": ways("barrier", lambda: core.barrier(timeout)),
        "broadcast": ways("broadcast", lambda: core.broadcast(t.data_ptr(), nb, 0, timeout), t, 0),
        "all_gather_into_tensor": ways("all_gather_into_tensor", all_gather, flat, t),
        "all_gather": ways("all_gather", all_gather, outs, t),
        "reduce_scatter_tensor": ways("reduce_scatter_tensor", reduce_scatter, out1, flat),
        "all_gather_single": ways("all_gather_single", all_gather, flat, t),
        "reduce_scatter_single": ways("reduce_scatter_single", reduce_scatter, out1, flat),
        "reduce_scatter": ways("reduce_scatter", reduce_scatter, out1, ins),
        "all_to_all_single": ways("all_to_all_single", all_to_all, a2a_out, a2a_in),
        "all_to_all": ways("all_to_all", all_to_all, outs, ins),
        "gather": ways("gather", lambda: core.gather([o.data_ptr() for o in outs], t.data_ptr(),
                                                     nb, 0, timeout), t, outs, 0),
        "scatter": ways("scatter", lambda: core.scatter(t.data_ptr(), [i.data_ptr() for i in ins],
                                                        nb, 0, timeout), t, ins, 0),
    }
    return {op: calls for op, calls in out.items() if calls is not None}


def _p2p_rank(rank, port, n, calls, runs, size, out):
    """A 4 KB ping-pong between two ranks, dist.send/recv against the core's
    send/recv, interleaved run by run: wall us per round trip (best,
    median) on rank 0."""
    import time
    import torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    import mpcore.distributed  # noqa: F401
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("mpcore", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    shm = dist.group.WORLD.shm
    core, timeout, peer = shm.core, shm.timeout, 1 - rank
    t = torch.zeros(size // 4)
    addr, nb = t.data_ptr(), t.nbytes

    def via_dist():
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)

    def via_core():
        if rank == 0:
            core.send(addr, nb, peer, 0, timeout)
            core.recv(addr, nb, peer, 0, timeout)
        else:
            core.recv(addr, nb, peer, 0, timeout)
            core.send(addr, nb, peer, 0, timeout)
    ways = {"core": via_core, "dist": via_dist}
    per = {k: [] for k in ways}
    for r in range(runs + 1):
        for name in (ways if r % 2 else list(ways)[::-1]):
            core.barrier(timeout)
            t0 = time.perf_counter()
            for _ in range(calls):
                ways[name]()
            if r:           # the first run warms up
                per[name].append((time.perf_counter() - t0) / calls * 1e6)
    if rank == 0:
        out.put({k: (min(v), statistics.median(v)) for k, v in per.items()})
    dist.destroy_process_group()


def p2p(calls, runs, size):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    ps = [ctx.Process(target=_p2p_rank, args=(r, port, 2, calls, runs, size, out))
          for r in range(2)]
    for p in ps:
        p.start()
    res = out.get(timeout=600)
    for p in ps:
        p.join(60)
    print(f"send/recv ping-pong of {size} bytes between 2 ranks, wall us per round trip, best "
          f"(median) of {runs} runs of {calls}, interleaved; load average "
          f"{os.getloadavg()[0]:.1f}")
    for k, (best, med) in res.items():
        print(f"  {k:<6s} {best:7.2f} ({med:.2f})")
    print(f"  dist - core: {res['dist'][0] - res['core'][0]:+.2f} us per round trip "
          "(two sends and two receives)")


# each operation's pad: the fast path's CPU time over the core's on one rank
# (NOTE [ The rest of torch's collectives ] in _fastpath.py, quiet cores)
PADS_US = {"all_reduce": 0.84, "barrier": 0.38, "broadcast": 0.73}


def _mixed_rank(rank, port, calls, runs, size, pad_us, out):
    """One rank of --mixed (NOTE [ Two ranks, each way on either ])."""
    import time
    import torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    import mpcore.distributed  # noqa: F401
    from mpcore import _core
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("mpcore", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    shm = dist.group.WORLD.shm
    core, timeout = shm.core, shm.timeout
    f32, op_sum = _core.COLL_DTYPES["float32"], _core.COLL_OPS["SUM"]
    n = size // 4
    t, tc = torch.zeros(n), torch.zeros(n)
    addr = tc.data_ptr()
    ops = {"all_reduce": (lambda: core.all_reduce(addr, n, f32, op_sum, timeout),
                          lambda: dist.all_reduce(t)),
           "barrier": (lambda: core.barrier(timeout), dist.barrier),
           "broadcast": (lambda: core.broadcast(addr, n * 4, 0, timeout),
                         lambda: dist.broadcast(t, 0))}

    def cpu_us(call, k=20000):
        t0 = time.thread_time()
        for _ in range(k):
            call()
        return (time.thread_time() - t0) / k * 1e6
    spin = list(range(1))

    def pad_of(us):
        """A pure-Python call of about `us` CPU us (a list of k Nones
        made), and its CPU us."""
        k = 1
        while (took := cpu_us(lambda: [None for _ in spin * k], 2000)) < us and k < 1 << 12:
            k *= 2
        k = max(1, round(k * us / took))
        pad = lambda: [None for _ in spin * k]   # noqa: E731
        return pad, cpu_us(pad, 2000)
    res = {}
    for name, (via_core, via_dist) in ops.items():
        pad, took = pad_of(pad_us if pad_us is not None else PADS_US[name])
        core.barrier(timeout)
        ways = {"core": via_core, "dist": via_dist,
                "pad": lambda pad=pad, via_core=via_core: (pad(), via_core())}
        pairs = [(a, b) for a in ways for b in ways]
        per = {p: [] for p in pairs}
        for r in range(runs + 1):
            for p in (pairs if r % 2 else pairs[::-1]):
                call = ways[p[rank]]
                core.barrier(timeout)
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                if r:           # the first run warms up
                    per[p].append((time.perf_counter() - t0) / calls * 1e6)
        res[name] = {p: (statistics.median(v), min(v)) for p, v in per.items()}
        res[name]["pad us"] = took
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def mixed(calls, runs, size, pad_us):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    ps = [ctx.Process(target=_mixed_rank, args=(r, port, calls, runs, size, pad_us, out))
          for r in range(2)]
    for p in ps:
        p.start()
    res = out.get(timeout=1800)
    for p in ps:
        p.join(60)
    print(f"two ranks, {size} bytes float32, each way on either rank (rank 0 / rank 1), wall us "
          f"per call on rank 0, median (best) of {runs} runs of {calls}, interleaved; load "
          f"average {os.getloadavg()[0]:.1f}")
    for name, per in res.items():
        print(f"  {name} (rank 0's pad: {per.pop('pad us'):.2f} us of CPU)")
        for (a, b), (med, best) in per.items():
            print(f"    {a:>4s} / {b:<4s} {med:8.2f} ({best:.2f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=4096, help="bytes of float32 (default 4096)")
    ap.add_argument("--calls", type=int, default=20000, help="calls per run")
    ap.add_argument("--runs", type=int, default=7, help="runs per way")
    ap.add_argument("--only", default="", help="operations, comma-separated (default: all)")
    ap.add_argument("--p2p", action="store_true",
                    help="instead: a send/recv ping-pong between two ranks, dist.* and the core's")
    ap.add_argument("--mixed", action="store_true",
                    help="instead: two ranks, each way on either (NOTE [ Two ranks, each way on "
                         "either ])")
    ap.add_argument("--pad", type=float, default=None,
                    help="--mixed: the pad's CPU us (default: each operation's in PADS_US)")
    args = ap.parse_args(argv)
    if args.mixed:
        mixed(min(args.calls, 5000), args.runs, args.size, args.pad)
        return 0
    if args.p2p:
        p2p(args.calls, args.runs, args.size)
        return 0

    import warnings

    import torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    import mpcore.distributed  # noqa: F401  (registers the backend)

    warnings.simplefilter("ignore", FutureWarning)   # the *_tensor names are deprecated
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("mpcore", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        pg = dist.group.WORLD
        if getattr(pg, "shm", None) is None:
            sys.exit(f"the default group ({type(pg).__qualname__}) has no shared-memory group")
        ops = cases(dist, pg, args.size // 4)
        only = [o for o in args.only.split(",") if o]
        for op, ways in ops.items():
            if not only or op in only:
                results[op] = measure(ways, args.calls, args.runs)
    finally:
        dist.destroy_process_group()

    print(f"{args.size} bytes float32 on an mpcore group of one rank; torch {torch.__version__}; "
          f"best (median) of {args.runs} runs of {args.calls} calls, CPU us per call; load "
          f"average {os.getloadavg()[0]:.1f}")
    ways = ("core", "dist", "torch's path", "async", "torch's async")
    print(f"  {'operation':<23s}" + "".join(f"{w:>15s}" for w in ways)
          + f"{'dist-core':>10s}{'async-dist':>11s}")
    for op, r in results.items():
        cells = "".join(f"{r[k][0]:7.2f} ({r[k][1]:5.2f})" for k in ways)
        print(f"  {op:<23s}{cells}{r['dist'][0] - r['core'][0]:+10.2f}"
              f"{r['async'][0] - r['dist'][0]:+11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
