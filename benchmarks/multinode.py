"""all_reduce across two nodes of this machine: 2 nodes x 2 ranks, mpcore's
hierarchical groups (NOTE [ Hierarchical groups ] in mpcore/dist/_hier.py)
against flat gloo, over the same veth link between two network namespaces
(tests/helpers/netns.py: each node has its own network and hostname).

    sudo .venv/bin/python benchmarks/multinode.py [--sizes 4096,16777216] [--seconds 2]
                                                  [--ddp-steps 5]

Needs root and iproute2.  Each backend is one job of 4 ranks that times
every size: a check of the result, warm-up calls, then runs of "barrier, n
all-reduces" (n chosen so that a run takes about --seconds / 4), each
rank's time all-reduced with MAX on the group under test; the figure is
the best of 4 runs, per call.  Then (unless --ddp-steps 0) torch's own
DistributedDataParallel of the 10M-parameter MLP of mpcore bench's DDP
rows, batch 32 a rank: the best of 3 runs of --ddp-steps steps, per step
(on the mpcore side torch's DDP reaches the hierarchical group through the
backend).  Prints one row per size and the DDP row, and JSON with --json
PATH.  Each size's row also gives the mpcore job's all-reduce on the
leaders' gloo link alone (one rank per node; the others wait) and the
speed-up it would give: the bound of any hierarchy over that link.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from helpers import netns as _netns  # noqa: E402

RANK = r'''
import json, os, sys, time, torch
import torch.distributed as dist
backend, sizes, seconds, out = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
steps = int(sys.argv[5])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
if backend == "mpcore":
    import mpcore.distributed as md
    md.init_process_group("mpcore")
    pg = dist.group.WORLD
    assert type(getattr(pg, "gloo", None)).__name__ == "HierGroup", pg
else:
    dist.init_process_group("gloo")
res = {}
for nbytes in sizes:
    x = torch.full((nbytes // 4,), float(rank + 1))
    dist.all_reduce(x)
    assert x[0].item() == world * (world + 1) / 2, x[0].item()

    def run(n):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        e = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        return e.item()
    run(3)
    n = 1
    while True:
        e = run(n)
        if e > seconds / 8 or n >= 1 << 16:
            break
        n *= 2
    res[nbytes] = min(run(n) for _ in range(4)) / n
    if backend == "mpcore":
        # The same all-reduce on the leaders' gloo link alone (the other
        # ranks wait in the barrier): what the hierarchy cannot go below.
        leaders = pg.gloo.leaders

        def run_leaders(n):
            dist.barrier()
            t = time.perf_counter()
            if leaders is not None:
                for _ in range(n):
                    leaders.allreduce([x]).wait()
            e = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(e, op=dist.ReduceOp.MAX)
            return e.item()
        run_leaders(3)
        res[f"leaders_{nbytes}"] = min(run_leaders(n) for _ in range(4)) / n
if steps:
    # torch's own DDP of the 10M-parameter MLP of mpcore bench's ddp rows, batch 32 a rank
    layers = (1024, 2048, 2048, 1024, 1024, 512)
    torch.manual_seed(0)
    mods = []
    for a, b in zip(layers, layers[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*mods[:-1]))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, layers[0], generator=g), torch.randn(32, layers[-1], generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    def steps_time(n):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(n):
            step()
        e = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        return e.item()
    steps_time(2)
    res["ddp_step"] = min(steps_time(steps) for _ in range(3)) / steps
if rank == 0:
    with open(out, "w") as f:
        json.dump(res, f)
dist.destroy_process_group()
'''


def run_job(nodes, backend, sizes, seconds, steps, tmp):
    out = os.path.join(tmp, f"{backend}.json")
    procs = []
    for r in range(4):
        k = r // 2
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r % 2),
                   MASTER_ADDR=nodes.addr(0), MASTER_PORT="29500",
                   GLOO_SOCKET_IFNAME=nodes.ifname(k))
        procs.append(subprocess.Popen(
            nodes.command(k, [sys.executable, "-c", RANK, backend, json.dumps(sizes),
                              str(seconds), out, str(steps)]), env=env))
    codes = [p.wait(timeout=600) for p in procs]
    if codes != [0] * 4:
        raise SystemExit(f"{backend}: ranks exited with {codes}")
    with open(out) as f:
        return {(int(k) if k.isdigit() else k): v for k, v in json.load(f).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,16777216")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--ddp-steps", type=int, default=5,
                    help="steps per timed run of torch's DDP (10M-parameter MLP); 0: none")
    ap.add_argument("--json")
    a = ap.parse_args()
    why = _netns.missing()
    if why:
        raise SystemExit(why)
    sizes = [int(s) for s in a.sizes.split(",")]
    nodes = _netns.Nodes(f"mpb{os.getpid()}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gloo = run_job(nodes, "gloo", sizes, a.seconds, a.ddp_steps, tmp)
            mp = run_job(nodes, "mpcore", sizes, a.seconds, a.ddp_steps, tmp)
    finally:
        nodes.close()
    rows = []
    print(f"{'all_reduce, 2 nodes x 2 ranks':32} {'flat gloo':>12} {'mpcore':>12} {'speed-up':>9}"
          f" {'leaders alone':>14} {'bound':>7}")
    for s in sizes:
        lead = mp[f"leaders_{s}"]
        rows.append({"bytes": s, "gloo_s": gloo[s], "mpcore_s": mp[s], "speedup": gloo[s] / mp[s],
                     "leaders_s": lead, "bound": gloo[s] / lead})
        print(f"{s:>32} {gloo[s] * 1e6:>10.1f}us {mp[s] * 1e6:>10.1f}us {gloo[s] / mp[s]:>8.2f}x"
              f" {lead * 1e6:>12.1f}us {gloo[s] / lead:>6.2f}x")
    if a.ddp_steps:
        g, m = gloo["ddp_step"], mp["ddp_step"]
        rows.append({"ddp_step": True, "gloo_s": g, "mpcore_s": m, "speedup": g / m})
        print(f"{'torch DDP step, 10M-param MLP':>32} {g * 1e3:>10.1f}ms {m * 1e3:>10.1f}ms "
              f"{g / m:>8.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
