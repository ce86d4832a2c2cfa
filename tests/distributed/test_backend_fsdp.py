"""FSDP2 (torch.distributed.fsdp.fully_shard) training an MLP over the
"mpcore" c10d backend: losses and final parameters equal to gloo's, to
float32 round-off, on 2 and 4 ranks, with SGD and with Adam.

One program (FSDP) trains both for 20 steps from a fixed seed, each rank on
its own seeded batches, and also trains the same MLP unsharded, in one
process, on all ranks' batches at once (what FSDP's averaged gradients
amount to), so the tests can check that the gloo run is real training and
not a no-op.  NOTE [ One start per stack ] in helpers/ranks.py.
"""
import pytest

from helpers.ranks import RankRuns, same, stack_tests

pytestmark = pytest.mark.timeout(400)

# 2 ranks: the 4-rank pools of test_backend.py cover every operation on 4 ranks, and
# a 4-rank FSDP2 run costs minutes of the suite on a 2-core machine.
WORLDS = (2,)
OPTIMIZERS = ("sgd", "adam")
STEPS = 20

FSDP = r'''
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

STEPS = 20
init()
mesh = init_device_mesh("cpu", (WORLD,))


def mlp():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 16))


# Targets are a fixed function of the inputs (plus noise): there is
# something to learn, so the losses fall.
TRUE = torch.randn(128, 16, generator=torch.Generator().manual_seed(99)) / 8


def batch(rank, step):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(8, 128, generator=g)
    return x, torch.tanh(x @ TRUE) + 0.01 * torch.randn(8, 16, generator=g)


def optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3)


def train(model, opt, batches):
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


for kind in ("sgd", "adam"):
    @check(f"fsdp/{kind}")
    def _():
        model = mlp()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        losses = train(model, optimizer(kind, model.parameters()),
                       [batch(RANK, s) for s in range(STEPS)])
        shards = {k: v.to_local().detach().clone() for k, v in model.state_dict().items()}
        full = {k: v.full_tensor().detach() for k, v in model.state_dict().items()}
        assert all(isinstance(v, DTensor) for v in model.state_dict().values())
        return {"losses": losses, "shards": shards, "params": full}

    @check(f"unsharded/{kind}")
    def _():
        model = mlp()
        batches = [[batch(r, s) for r in range(WORLD)] for s in range(STEPS)]
        losses = train(model, optimizer(kind, model.parameters()),
                       [(torch.cat([x for x, _ in b]), torch.cat([y for _, y in b]))
                        for b in batches])
        # Each rank's FSDP loss is the loss of its own batch; their mean is
        # the whole batch's loss.
        return {"losses": losses, "params": {k: v.detach() for k, v in model.state_dict().items()}}


def sharded():
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full(model):
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


@check("checkpoint")
def _():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    model = sharded()
    train(model, optimizer("sgd", model.parameters()), [batch(RANK, s) for s in range(3)])
    path = os.path.join(OUT, "checkpoint")
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    dcp.async_save(get_model_state_dict(model), checkpoint_id=path + "-async").result()
    loaded, init = [], None
    for where in (path, path + "-async"):
        fresh = sharded()
        init = full(fresh)
        sd = get_model_state_dict(fresh)
        dcp.load(sd, checkpoint_id=where)
        set_model_state_dict(fresh, sd)
        loaded.append(full(fresh))
    trained = full(model)
    fresh = sharded()
    given = {k: v + 1 for k, v in trained.items()} if RANK == 0 else {}
    set_model_state_dict(fresh, given, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))
    return {"init": init, "trained": trained, "loaded": loaded, "from_rank0": full(fresh)}

finish()
'''

CASES = [(w, k) for w in WORLDS for k in OPTIMIZERS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return RankRuns(tmp_path_factory, "fsdp", FSDP, timeout=300)


@pytest.mark.parametrize("world,opt", CASES)
def test_gloo_run_trains_like_one_process(runs, world, opt):
    """The reference itself: FSDP over gloo trains as the unsharded MLP does
    on all ranks' batches (summed in another order: a looser tolerance)."""
    run = runs.get("gloo", world)
    fsdp, plain = run.value(f"fsdp/{opt}"), run.value(f"unsharded/{opt}")[0]
    mean_loss = sum(f["losses"] for f in fsdp) / world
    import torch
    torch.testing.assert_close(mean_loss, plain["losses"], rtol=1e-4, atol=1e-5)
    assert plain["losses"][-5:].mean() < 0.9 * plain["losses"][:5].mean(), plain["losses"]
    for r in range(world):
        same(fsdp[r]["params"], plain["params"], f"rank {r}", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode,world,opt", [("mpcore", w, k) for w, k in CASES]
                         + [("run-gloo", 2, k) for k in OPTIMIZERS])
def test_mpcore_trains_as_gloo_does(runs, mode, world, opt):
    ref = runs.get("gloo", world).value(f"fsdp/{opt}")
    got = runs.get(mode, world).value(f"fsdp/{opt}")
    for r in range(world):
        assert len(got[r]["losses"]) == STEPS
        # float32 round-off: assert_close's own float32 tolerances.
        same(got[r]["losses"], ref[r]["losses"], f"{mode} rank {r} losses")
        same(got[r]["shards"], ref[r]["shards"], f"{mode} rank {r} shards")
        same(got[r]["params"], ref[r]["params"], f"{mode} rank {r} params")


@pytest.mark.parametrize("mode", ["gloo", "mpcore", "run-gloo"])
def test_checkpoints_save_load_and_broadcast(runs, mode):
    """DCP's save and async_save, loaded into a fresh sharded model, and a
    full state dict given on rank 0 only and broadcast from it
    (NOTE [ The group is its own backend ]): the same parameters as gloo's."""
    import torch
    ref = runs.get("gloo", 2).value("checkpoint")
    got = runs.get(mode, 2).value("checkpoint")
    for r in range(2):
        trained, init = got[r]["trained"], got[r]["init"]
        same(trained, ref[r]["trained"], f"{mode} rank {r} trained")
        assert all(not torch.equal(trained[k], init[k]) for k in trained), "nothing to load"
        for i, loaded in enumerate(got[r]["loaded"]):
            same(loaded, trained, f"{mode} rank {r} loaded ({['save', 'async_save'][i]})")
        same(got[r]["from_rank0"], {k: v + 1 for k, v in trained.items()},
             f"{mode} rank {r} broadcast from rank 0")


test_reference_run_is_gloo_and_finishes, test_served_by_mpcore_and_finishes, \
    test_nothing_left_behind = stack_tests(WORLDS, [("mpcore", 2), ("run-gloo", 2)])
