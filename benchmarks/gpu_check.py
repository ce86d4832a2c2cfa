"""The GPU half of gpu_check.sh: mpcore's NCCL path against torch's own
NCCL on this machine's GPUs.  Prints PASS/FAIL lines, then a table."""
import os
import socket
import subprocess
import sys
import time

import torch
import torch.multiprocessing as tmp

RESULTS = []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def ranks_main(rank, world, port, out):
    """One rank: the same collectives through torch's NCCL and through
    mpcore's own NCCL communicator (the one mpcore loads at run time) of a
    "cpu:mpcore,cuda:nccl" group."""
    import torch.distributed as td
    import mpcore.distributed as md
    from mpcore.dist import _collectives
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    md.init_process_group("cpu:mpcore,cuda:nccl", rank=rank, world_size=world)
    pg = td.group.WORLD
    dev = torch.device("cuda", rank)
    lines = []
    mine = pg.cuda_group("gpu_check")        # mpcore's NCCL communicator
    theirs = pg._torch_nccl_pg()        # torch's ProcessGroupNCCL of the same group
    codes = _collectives.NCCL_DTYPES

    def torch_all_reduce(t):
        o = td.AllreduceOptions()
        o.reduceOp = td.ReduceOp.SUM
        theirs.allreduce([t], o).wait()

    def mpcore_all_reduce(t):
        mine.all_reduce(t, codes[t.dtype], 0)

    torch.manual_seed(rank)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        x = (torch.rand(1_000_003, device=dev) * 100).to(dtype)
        a, b = x.clone(), x.clone()
        torch_all_reduce(a)
        mpcore_all_reduce(b)
        torch.cuda.synchronize()
        lines.append(f"all_reduce {dtype} {'PASS' if torch.equal(a, b) else 'FAIL'}")
    t = torch.full((4097,), float(rank), device=dev)
    mine.broadcast(t, 0)
    torch.cuda.synchronize()
    lines.append(f"broadcast {'PASS' if bool((t == 0).all()) else 'FAIL'}")
    out_t = torch.empty(world * 5, device=dev)
    mine.all_gather(out_t, torch.full((5,), float(rank), device=dev))
    torch.cuda.synchronize()
    want = torch.arange(world, device=dev).repeat_interleave(5).float()
    lines.append(f"all_gather {'PASS' if torch.equal(out_t, want) else 'FAIL'}")
    # every other operation on CUDA tensors of the group: torch's NCCL
    rs = torch.empty(5, device=dev)
    td.reduce_scatter_tensor(rs, torch.ones(world * 5, device=dev))
    torch.cuda.synchronize()
    lines.append(f"reduce_scatter via the group {'PASS' if bool((rs == world).all()) else 'FAIL'}")
    # DDP on CUDA tensors: mpcore's hook against torch's reducer.
    from mpcore.parallel import DistributedDataParallel as MDDP
    from torch.nn.parallel import DistributedDataParallel as TDDP
    params = []
    for cls in (TDDP, MDDP):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 8)).to(dev)
        ddp = cls(model, device_ids=[rank])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator(device=dev).manual_seed(100 + rank)
        for _ in range(10):
            opt.zero_grad()
            loss = ddp(torch.randn(32, 64, device=dev, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    hooked = getattr(ddp, "_mpcore_hooks", None) is not None
    ok = hooked and torch.allclose(params[0], params[1], rtol=1e-5, atol=1e-6)
    lines.append(f"ddp cuda {'PASS' if ok else 'FAIL'} (mpcore hook {hooked})")
    # Timing: all-reduce of float32 at several sizes, both paths.
    for nbytes in (4 << 10, 1 << 20, 16 << 20, 256 << 20):
        x = torch.ones(nbytes // 4, device=dev)
        for name, fn in (("torch", torch_all_reduce), ("mpcore", mpcore_all_reduce)):
            for _ in range(5):
                fn(x)
            torch.cuda.synchronize()
            n = 50 if nbytes <= (16 << 20) else 10
            t0 = time.perf_counter()
            for _ in range(n):
                fn(x)
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / n * 1e6
            lines.append(f"time {name} {nbytes} {us:.1f}")
    md.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def _served_by(pg, dev):
    """The class of the backend that serves device `dev` in group pg."""
    import torch.distributed as dist
    try:
        b = pg._get_backend(torch.device(dev))
    except Exception as e:    # a Python ProcessGroup subclass serves every device itself
        if isinstance(pg, dist.ProcessGroup) and type(pg) is not dist.ProcessGroup:
            return f"{type(pg).__module__}.{type(pg).__qualname__}"
        return f"unknown ({type(e).__name__}: {e})"
    return f"{type(b).__module__}.{type(b).__qualname__}"


def mixed_main(rank, world, port, out):
    """One rank of a group made by torch's own
    init_process_group("cpu:mpcore,cuda:nccl"): an all-reduce of a CPU and
    of a CUDA tensor on it, checked, and the backend that served each."""
    import torch.distributed as dist
    import mpcore.distributed  # noqa: F401  (registers the "mpcore" backend)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:mpcore,cuda:nccl", rank=rank, world_size=world)
    pg = dist.group.WORLD
    want = world * (world + 1) / 2
    lines = []
    for dev, must in (("cpu", "mpcore"), (f"cuda:{rank}", None)):
        t = torch.full((4097,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        ok = bool((t == want).all())
        served = _served_by(pg, dev)
        if must and must not in served.lower():
            ok = False
        lines.append(f"group cpu:mpcore,cuda:nccl: all_reduce of a {dev.split(':')[0]} tensor "
                     f"{'PASS' if ok else 'FAIL'} (served by {served})")
    # torch's split_group of that group (NOTE [ Splitting a group ] in _backend.py)
    try:
        split = dist.split_group(split_ranks=[list(range(world))])
        for dev in ("cpu", f"cuda:{rank}"):
            t = torch.full((4097,), float(rank + 1), device=dev)
            dist.all_reduce(t, group=split)
            ok = bool((t == want).all())
            lines.append(f"split_group of it: all_reduce of a {dev.split(':')[0]} tensor "
                         f"{'PASS' if ok else 'FAIL'} ({type(split).__name__})")
    except Exception as e:
        lines.append(f"split_group of it: FAIL ({type(e).__name__}: {e})")
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def main():
    n = torch.cuda.device_count()
    if n == 0:
        print("FAIL: torch sees no CUDA GPU here")
        sys.exit(1)
    world = min(n, 8)
    out = f"/tmp/mpcore-gpu-check-{os.getpid()}.txt"
    tmp.spawn(ranks_main, args=(world, free_port(), out), nprocs=world)
    lines = open(out).read().split("\n")
    # torch's own init_process_group with a backend per device: mpcore for
    # CPU tensors, NCCL for CUDA ones.
    print(f"checking init_process_group(\"cpu:mpcore,cuda:nccl\") on {world} rank(s): "
          "all_reduce of a CPU tensor (must be served by mpcore) and of a CUDA tensor")
    try:
        tmp.spawn(mixed_main, args=(world, free_port(), out), nprocs=world)
        lines += open(out).read().split("\n")
    except Exception as e:
        lines.append(f"group cpu:mpcore,cuda:nccl FAIL ({type(e).__name__}: {e})")
    fails = [l for l in lines if "FAIL" in l]
    for l in lines:
        if l and not l.startswith("time"):
            print(l)
    if n >= 4:
        art = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "article", "ddp.py")
        if os.path.exists(art):
            mpcore = [sys.executable, "-m", "mpcore", "run", art]
            r = subprocess.run(mpcore, capture_output=True, text=True, timeout=240)
            got = r.stdout.count("Loss:")
            ok = r.returncode == 0 and got == 40
            print(f"article ddp.py under mpcore run {'PASS' if ok else 'FAIL'} "
                  f"({got} progress lines, rc {r.returncode})")
            if not ok:
                fails.append("ddp.py")
                print(r.stderr[-2000:])
        else:
            print(f"article ddp.py not found at {art}")
    else:
        print(f"article ddp.py needs 4 GPUs; this machine has {n}: not run")
    times = {}
    for l in lines:
        if l.startswith("time"):
            _, name, nbytes, us = l.split()
            times[(int(nbytes), name)] = float(us)
    print(f"\nall_reduce float32 over {world} GPU(s), NCCL, us per call")
    print(f"{'size':>10} {'torch':>10} {'mpcore':>10} {'ratio':>7}")
    for nbytes in sorted({k[0] for k in times}):
        a, b = times[(nbytes, "torch")], times[(nbytes, "mpcore")]
        print(f"{nbytes:>10} {a:>10.1f} {b:>10.1f} {a / b:>6.2f}x")
    print("\nRESULT:", "FAIL" if fails else "PASS")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
