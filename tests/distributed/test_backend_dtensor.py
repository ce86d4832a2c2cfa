"""DeviceMesh, DTensor and tensor parallelism over the "mpcore" c10d
backend, result for result against gloo, on 2 and 4 ranks.

One program (DTENSOR) builds the meshes ("cpu", (WORLD,)) and, on 4 ranks,
("cpu", (2, 2)) with mesh_dim_names; runs collectives on each mesh
dimension's group; distributes, redistributes (Shard -> Replicate,
Replicate -> Shard, Partial -> Replicate, Partial -> Shard, Shard -> Shard)
and multiplies DTensors; and trains one step of a column/row-wise sharded
MLP.  Every input is the same seeded tensor on every rank (or a rank's own
seeded piece), so each rank also records the local reference; the tests
assert that gloo gives the reference, and that mpcore (asked for by name,
or given to a program that asks for "gloo" under `mpcore run`) gives what
gloo gives.  NOTE [ One start per stack ] in helpers/ranks.py.
"""
import pytest

from helpers.ranks import MPCORE_PG, RankRuns, same, stack_tests

pytestmark = pytest.mark.timeout(400)

WORLDS = (2, 4)
# The runs served by mpcore: by name on 2 and 4 ranks, and asked for as
# "gloo" under `mpcore run` on 4 (a (2, 2) mesh: subgroups made by torch).
RUNS = [("mpcore", 2), ("mpcore", 4), ("run-gloo", 2)]   # under `mpcore run`: 2 ranks suffice

DTENSOR = r'''
import zlib
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

init()


def seeded(name, shape, rank=None):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()))
    return torch.randn(shape, generator=g)


MESHES = {"1d": init_device_mesh("cpu", (WORLD,))}
if WORLD == 4:
    MESHES["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

for mname, mesh in MESHES.items():
    names = mesh.mesh_dim_names or [0]
    for dim in names:
        name = f"mesh/{mname}/{dim}"

        @check(name)
        def _():
            pg = mesh.get_group(dim)
            ranks = dist.get_process_group_ranks(pg)
            x = seeded(name, (6, 2 * len(ranks)), RANK)
            xs = {r: seeded(name, (6, 2 * len(ranks)), r) for r in ranks}
            s = x.clone()
            dist.all_reduce(s, group=pg)
            gathered = torch.empty(len(ranks) * 6, x.shape[1])
            dist.all_gather_into_tensor(gathered, x, group=pg)
            rs = torch.empty(2, 6)
            dist.reduce_scatter_tensor(rs, x.t().contiguous(), group=pg)
            b = x.clone()
            dist.broadcast(b, group=pg, group_src=len(ranks) - 1)
            local_rank = ranks.index(RANK)
            total = sum(xs[r] for r in ranks)
            return {"identity": identity(pg), "ranks": ranks,
                    "local_rank": mesh.get_local_rank(dim),
                    "got": [s, gathered, rs, b],
                    "want": [total, torch.cat([xs[r] for r in ranks]),
                             total.t().contiguous().chunk(len(ranks))[local_rank],
                             xs[ranks[-1]]]}

PLACEMENTS = {"1d": [[Shard(0)], [Shard(1)], [Replicate()]],
              "2d": [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()],
                     [Shard(0), Shard(0)]]}
for mname, mesh in MESHES.items():
    n = mesh.ndim
    for i, placements in enumerate(PLACEMENTS[mname]):
        name = f"distribute/{mname}/{i}"

        @check(name)
        def _():
            full = seeded(name, (8, 12))
            dt = distribute_tensor(full, mesh, placements)
            back = dt.redistribute(mesh, [Replicate()] * n)
            resharded = dt.redistribute(mesh, [Shard(1)] * n)   # Shard(0) -> Shard(1): all_to_all
            return {"got": [dt.to_local(), back.to_local(), dt.full_tensor(),
                            resharded.full_tensor()],
                    "want": [None, full, full, full]}

    name = f"partial/{mname}"

    @check(name)
    def _():
        mine = seeded(name, (8, 4), RANK)
        everyone = [seeded(name, (8, 4), r) for r in range(WORLD)]
        dt = DTensor.from_local(mine, mesh, [Partial()] * n)
        rep = dt.redistribute(mesh, [Replicate()] * n)
        shard = dt.redistribute(mesh, [Shard(0)] * n)
        avg = DTensor.from_local(mine, mesh, [Partial("avg")] * n).redistribute(
            mesh, [Replicate()] * n)
        return {"got": [rep.to_local(), shard.full_tensor(), avg.to_local()],
                "want": [sum(everyone), sum(everyone), sum(everyone) / WORLD]}

    name = f"matmul/{mname}"

    @check(name)
    def _():
        # Column-wise then row-wise sharded weights: (x @ w1) @ w2 is Partial,
        # then made whole.  On the 2-d mesh, x is sharded by rows over "dp".
        x, w1, w2 = seeded(name + "x", (8, 6)), seeded(name + "w1", (6, 8)), \
            seeded(name + "w2", (8, 5))
        xp = [Replicate()] * n if n == 1 else [Shard(0), Replicate()]
        wp1 = [Shard(1)] if n == 1 else [Replicate(), Shard(1)]
        wp2 = [Shard(0)] if n == 1 else [Replicate(), Shard(0)]
        dx = distribute_tensor(x, mesh, xp)
        h = dx @ distribute_tensor(w1, mesh, wp1)
        y = h @ distribute_tensor(w2, mesh, wp2)
        return {"got": [str(h.placements), str(y.placements),
                        y.redistribute(mesh, [Replicate()] * n).to_local(), y.full_tensor()],
                "want": [None, None, x @ w1 @ w2, x @ w1 @ w2]}


@check("tensor_parallel_mlp")
def _():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8))
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 8))
    reference.load_state_dict(model.state_dict())
    mesh = MESHES["1d"]
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = seeded("tp-input", (4, 16))
    losses, ref_losses = [], []
    for step in range(3):
        for m, o, out in ((model, opt, losses), (reference, ref_opt, ref_losses)):
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.detach())
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
              for k, v in model.state_dict().items()}
    return {"got": [torch.stack(losses), params],
            "want": [torch.stack(ref_losses), dict(reference.state_dict())]}


finish()
'''


def checks(world):
    out = ["mesh/1d/0", "distribute/1d/0", "distribute/1d/1", "distribute/1d/2", "partial/1d",
           "matmul/1d", "tensor_parallel_mlp"]
    if world == 4:
        out += ["mesh/2d/dp", "mesh/2d/tp", "partial/2d", "matmul/2d"] + \
            [f"distribute/2d/{i}" for i in range(4)]
    return out


CASES = [(w, c) for w in WORLDS for c in checks(w)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return RankRuns(tmp_path_factory, "dtensor", DTENSOR, timeout=300)


def _expected(got, want, where):
    for i, (g, w) in enumerate(zip(got, want)):
        if w is not None:
            same(g, w, f"{where}[{i}]")


@pytest.mark.parametrize("world,check", CASES)
def test_gloo_gives_the_reference(runs, world, check):
    for r, v in enumerate(runs.get("gloo", world).value(check)):
        if isinstance(v["got"], list):
            _expected(v["got"], v["want"], f"gloo rank {r} {check}")
        else:
            same(v["got"], v["want"], f"gloo rank {r} {check}")


@pytest.mark.parametrize("mode,world,check", [(m, w, c) for m, w in RUNS
                                               for v, c in CASES if v == w])
def test_mpcore_gives_what_gloo_gives(runs, world, check, mode):
    ref = runs.get("gloo", world).value(check)
    got = runs.get(mode, world).value(check)
    for r in range(world):
        if check.startswith("mesh/"):
            # Each mesh dimension's group is mpcore's too, with the same ranks.
            # (Under `mpcore run`, the type: test_get_backend_under_run in
            # test_backend_collectives.py checks the name.)
            assert got[r]["identity"]["type"] == MPCORE_PG, got[r]
            if mode == "mpcore":
                assert got[r]["identity"]["backend"] == "mpcore", got[r]
            assert ref[r]["identity"]["type"] != MPCORE_PG, ref[r]
            assert (got[r]["ranks"], got[r]["local_rank"]) == \
                (ref[r]["ranks"], ref[r]["local_rank"])
        same(got[r]["got"], ref[r]["got"], f"{mode} rank {r} {check}")


test_reference_run_is_gloo_and_finishes, test_served_by_mpcore_and_finishes, \
    test_nothing_left_behind = stack_tests(WORLDS, RUNS)
