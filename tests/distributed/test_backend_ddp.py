"""torch's own DistributedDataParallel over the "mpcore" c10d backend:
parameters after N steps equal to gloo's.

The program (DDP) uses torch.nn.parallel.DistributedDataParallel as any
program does and, in the "gloo" and "run-gloo" modes, never imports mpcore:
under `mpcore run` it asks for "gloo" and must be served by mpcore.  In the
"mpcore" mode it is plain python with init_process_group("mpcore").  It
trains four times (default buckets; tiny buckets with gradient_as_bucket_view
and a no_sync accumulation step; default buckets under torch.compile; PowerSGD's
comm hook), and once unwrapped in one process on all ranks' batches, the
reference that makes the gloo run meaningful.
NOTE [ One start per stack ] in helpers/ranks.py.
"""
import pytest

from helpers.ranks import RankRuns, same, stack_tests

pytestmark = pytest.mark.timeout(400)

# 2 ranks: the 4-rank pools of test_backend.py cover every operation on 4 ranks, and
# a 4-rank DDP run costs minutes of the suite on a 2-core machine.
WORLDS = (2,)
CONFIGS = ("default", "small-buckets", "compiled", "powersgd")
STEPS = 10

DDP = r'''
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

STEPS = 10
init()
RESULTS["_ddp_class"] = {"value": DistributedDataParallel.__module__ + "." +
                         DistributedDataParallel.__qualname__}


def model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


# Targets are a fixed function of the inputs: there is something to learn.
TRUE = torch.randn(32, 4, generator=torch.Generator().manual_seed(99)) / 4


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 32, generator=g)
    return x, torch.tanh(x @ TRUE)


CONFIG = {"default": {}, "small-buckets": {"bucket_cap_mb": 0.01,
                                           "gradient_as_bucket_view": True},
          "compiled": {}, "powersgd": {}}
for name, kw in CONFIG.items():
    @check(f"ddp/{name}")
    def _():
        ddp = DistributedDataParallel(model(), **kw)
        if name == "compiled":
            # dynamo's frame hook is on when the reducer calls the group
            # (the bucket rebuild's broadcast); "eager" skips code generation.
            ddp = torch.compile(ddp, backend="eager")
        if name == "powersgd":
            # its callbacks queue all-reduces and wait for them inside the
            # callback (NOTE [ Callbacks that call again ] in _dist.py)
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            ddp.register_comm_hook(ps.PowerSGDState(process_group=None, start_powerSGD_iter=2,
                                                    matrix_approximation_rank=1), ps.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.5)
        losses = []
        for step in range(STEPS):
            x, y = batch(RANK, step)
            if name == "small-buckets" and step % 2 == 0:
                # Half of the batch without a reduction, half with one.
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x[:3]), y[:3]).div(2).backward()
                loss = nn.functional.mse_loss(ddp(x[3:]), y[3:]).div(2)
            else:
                loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return {"losses": torch.stack(losses),
                "params": {k: v.detach() for k, v in ddp.module.state_dict().items()}}


@check("unwrapped")
def _():
    # Every step's averaged gradient is that of the mean of the ranks' losses.
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    losses = []
    for step in range(STEPS):
        loss = sum(nn.functional.mse_loss(m(x), y)
                   for x, y in (batch(r, step) for r in range(WORLD))) / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses),
            "params": {k: v.detach() for k, v in m.state_dict().items()}}


finish()
'''

RUNS = [("mpcore", 2), ("run-gloo", 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return RankRuns(tmp_path_factory, "ddp", DDP, timeout=300)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("config", CONFIGS)
def test_gloo_run_trains_like_one_process(runs, world, config):
    run = runs.get("gloo", world)
    ddp, plain = run.value(f"ddp/{config}"), run.value("unwrapped")[0]
    for r in range(world):
        if config != "powersgd":   # it compresses the gradients: not one process's training
            same(ddp[r]["params"], plain["params"], f"rank {r}", rtol=1e-4, atol=1e-5)
        same(ddp[r]["params"], ddp[0]["params"], f"rank {r} vs rank 0")
    # Training that changes something: the whole batch's loss falls.
    assert plain["losses"][-3:].mean() < 0.9 * plain["losses"][:3].mean(), plain["losses"]


@pytest.mark.parametrize("mode,world", RUNS)
@pytest.mark.parametrize("config", CONFIGS)
def test_mpcore_trains_as_gloo_does(runs, mode, world, config):
    ref = runs.get("gloo", world).value(f"ddp/{config}")
    got = runs.get(mode, world).value(f"ddp/{config}")
    for r in range(world):
        same(got[r]["losses"], ref[r]["losses"], f"{mode} rank {r} losses")
        same(got[r]["params"], ref[r]["params"], f"{mode} rank {r} params")


test_reference_run_is_gloo_and_finishes, test_served_by_mpcore_and_finishes, \
    test_nothing_left_behind = stack_tests(WORLDS, RUNS)
