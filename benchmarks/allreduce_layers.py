"""Where a blocking 4 KB `dist.all_reduce` on an mpcore group spends its
time, layer by layer, on a group of one rank (no peer to wait for: what is
left is the software above the core's work).

    python benchmarks/allreduce_layers.py [--size BYTES] [--calls N] [--runs R]

NOTE [ The layers of a small all_reduce ]
The call is taken apart by stripping one layer at a time, each level timed
in the same loop form, the levels interleaved run by run (best of R runs of
N calls, CPU time of the calling thread per call: the process is alone in
its group, so nothing waits, and time the machine's other work takes from
it is not counted):
- core: the C core's own call, group.shm.core.all_reduce(address, count,
  dtype, op, timeout, None), the one the backend makes;
- method body: the backend's Python method without the wrapper that
  every method has (CUDA tensors to torch's NCCL, the profiler's events),
  group.allreduce.__wrapped__(group, [t], opts), with opts made once (its
  checks, the core call, the Work it returns);
- method: the same through the wrapper, group.allreduce([t], opts);
- method+wait: the same and Work.wait(), as dist.all_reduce calls it;
- torch body: torch's all_reduce without its logging wrapper (the
  __wrapped__ of torch's function): its torch-function check, tensor
  check, group-membership check, AllreduceOptions, default group,
  coalescing check, the method and the wait;
- torch's function: the whole of torch's dist.all_reduce, the path before
  the fast path and the one an observed call takes;
- dist.all_reduce: the call as a program makes it, which on an mpcore
  group skips all of the above to the core (NOTE [ The rest of torch's
  collectives ] in dist/_fastpath.py): less than the level before it.
The differences between consecutive levels are the layers.  Pieces are
also timed alone (a Work made for a completed call, AllreduceOptions with
its two fields set, torch's checks) so that the layers can be split
further.  On two ranks the same levels' wall times, including the wait for
the peer, are what `mpcore bench --only c10d-layer-allreduce-4k` prints.
"""
import argparse
import datetime
import os
import socket
import statistics
import sys
import time


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loop(call, n):
    """CPU seconds of this thread for n calls (time the machine's other work
    takes from it is not counted)."""
    t0 = time.thread_time()
    for _ in range(n):
        call()
    return time.thread_time() - t0


def measure(levels, n, runs):
    """{name: best us per call}, the levels interleaved run by run (the
    order turned each run), plus the medians."""
    for call in levels.values():     # warm-up
        _loop(call, max(100, n // 20))
    per = {name: [] for name in levels}
    names = list(levels)
    for r in range(runs):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            per[name].append(_loop(levels[name], n) / n * 1e6)
    return {name: (min(v), statistics.median(v)) for name, v in per.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=4096, help="bytes of float32 (default 4096)")
    ap.add_argument("--calls", type=int, default=20000, help="calls per run")
    ap.add_argument("--runs", type=int, default=7, help="runs per level")
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    import mpcore.distributed  # noqa: F401  (registers the backend)
    from mpcore import _core
    from mpcore.dist import _profile, _work

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("mpcore", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        pg = dist.group.WORLD
        shm = getattr(pg, "shm", None)
        if shm is None:
            sys.exit(f"the default group ({type(pg).__qualname__}) has no shared-memory group")
        core = shm.core
        t = torch.zeros(args.size // 4)
        addr, count = t.data_ptr(), t.numel()
        f32, op_sum = _core.COLL_DTYPES["float32"], _core.COLL_OPS["SUM"]
        timeout = shm.timeout
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.asyncOp = False
        try:
            from mpcore.dist import _fastpath
            torch_fn = _fastpath._TORCH.get("all_reduce", dist.all_reduce)
        except ImportError:
            torch_fn = dist.all_reduce
        body = getattr(torch_fn, "__wrapped__", torch_fn)
        done = getattr(_work, "Done", None)
        tensors = [t]
        SUM = dist.ReduceOp.SUM
        red = opts.reduceOp.op

        def new_opts():
            o = dist.AllreduceOptions()
            o.reduceOp = SUM
            o.asyncOp = False
            return o
        method = type(pg).allreduce
        inner = getattr(method, "__wrapped__", method)
        levels = {
            "core": lambda: core.all_reduce(addr, count, f32, op_sum, timeout, None),
            "method body": lambda: inner(pg, tensors, opts),
            "method": lambda: pg.allreduce(tensors, opts),
            "method+wait": lambda: pg.allreduce(tensors, opts).wait(),
            "torch body": lambda: body(t),
            "torch's function": lambda: torch_fn(t),
            "dist.all_reduce": lambda: dist.all_reduce(t),
        }
        pieces = {
            "empty loop (a lambda call)": lambda: None,
            "Work of a completed call (Done([t]))": (lambda: done(tensors)) if done else None,
            "Work.wait() of it": (done(tensors).wait if done else None),
            "AllreduceOptions(), reduceOp and asyncOp set": new_opts,
            "opts.reduceOp.op (read in the method)": lambda: opts.reduceOp.op,
            "the profiler check (profiling())": getattr(_profile, "profiling", None),
            "red.value (the op's code)": lambda: red.value,
            "t.dtype": lambda: t.dtype,
            "t.nbytes": lambda: t.nbytes,
            "t.data_ptr() and t.numel()": lambda: (t.data_ptr(), t.numel()),
            "opts.asyncOp": lambda: opts.asyncOp,
            "group.shm": lambda: pg.shm,
            "shm.timeout and shm.collectives.queued": lambda: (shm.timeout, shm.collectives.queued),
            "has_torch_function((t,))": lambda: c10d.has_torch_function((t,)),
            "_check_single_tensor(t)": lambda: c10d._check_single_tensor(t, "tensor"),
            "_rank_not_in_group(None)": lambda: c10d._rank_not_in_group(None),
            "t.is_complex()": t.is_complex,
            "_get_default_group()": c10d._get_default_group,
            "group in pg_coalesce_state": lambda: pg in c10d._world.pg_coalesce_state,
            "t.is_cpu and t.is_contiguous()": lambda: t.is_cpu and t.is_contiguous(),
        }
        pieces = {k: v for k, v in pieces.items() if v is not None}
        lv = measure(levels, args.calls, args.runs)
        pc = measure(pieces, args.calls, args.runs)
    finally:
        dist.destroy_process_group()

    print(f"blocking dist.all_reduce of {args.size} bytes float32 SUM on an mpcore group of one "
          f"rank; torch {torch.__version__}; best (median) of {args.runs} runs of "
          f"{args.calls} calls, CPU us per call; load average {os.getloadavg()[0]:.1f}")
    prev = None
    for name, (best, med) in lv.items():
        layer = f"  {best - lv[prev][0]:+.2f} over {prev}" if prev else ""
        print(f"  {name:<17s} {best:7.2f} ({med:.2f}){layer}")
        prev = name
    print("pieces alone:")
    for name, (best, med) in pc.items():
        print(f"  {name:<46s} {best:7.3f} ({med:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
