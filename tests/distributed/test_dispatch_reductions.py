"""What observes monitored_barrier, and a coalesced reduce_scatter (two
pairs, with SUM and with each other reduction), sees the same of an mpcore
group as of gloo's: torch's profiler (the backend's events and c10d's op,
by name, shapes, asynchrony and count), CommDebugMode's counts and
DebugMode's log of c10d's ops; and the results are gloo's.  NOTE
[ monitored_barrier observed ] and NOTE [ c10d's ReduceOp of another kind ]
in _profile.py say what mpcore does for it.

One program (PARITY) runs on 2 ranks with gloo (the reference), with mpcore
asked for by name, and asking for gloo under `mpcore run`; each test
compares a check's record with gloo's run of the same check.  torch's
monitored_barrier refuses a group whose backend is not named "gloo", so a
program that named mpcore does not make that call.

The results of the coalesced reduce_scatter are checked against values
computed here from the inputs every rank recorded, on every torch: gloo's
own are wrong on some torches (GLOO_REDUCE_SCATTER_SUMS), where mpcore's
stay right."""
import pytest
import torch

from helpers.ranks import RankRuns, same, stack_tests
from helpers.releases import GLOO_REDUCE_SCATTER_SUMS, TORCH_RELEASE

pytestmark = pytest.mark.timeout(400)

WORLDS = (2,)
RUNS = [("mpcore", 2), ("run-gloo", 2)]
REDUCTIONS = ("SUM", "MAX", "MIN", "PRODUCT", "AVG")

PARITY = r'''
from torch.distributed.tensor.debug import CommDebugMode
try:
    from torch.utils._debug_mode import DebugMode
except ImportError:     # a torch without it (2.6): that part is compared as None
    DebugMode = None

init()
PREFIX = str(dist.get_backend()) + ":"    # "gloo:" or "mpcore:", as torch's tests build it


def events(fn):
    """The profiler's events of fn's collectives, sorted: the backend's
    (named without its prefix) and c10d's ops, as (name, is_async, input
    shapes, count)."""
    prof = torch.autograd.profiler.profile(record_shapes=True)
    with prof:
        fn()
    out = []
    for e in prof.function_events:
        if e.name.startswith(PREFIX):
            out.append([e.name[len(PREFIX):], e.is_async, e.input_shapes, e.count])
        elif e.name.startswith("c10d::"):
            out.append([e.name, e.is_async, e.input_shapes, e.count])
    return sorted(out)


def observed(fn):
    """What torch's dispatcher and profiler show of fn's calls, and what
    they returned (or raised) under each."""
    def outcome(f):
        try:
            return f()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    with CommDebugMode() as mode:
        under_mode = outcome(fn)
    logged = None
    if DebugMode is not None:
        with DebugMode() as dm:
            under_debug = outcome(fn)
        logged = [line.strip().split("(")[0] for line in dm.debug_string().splitlines()
                  if "c10d" in line]
    else:
        under_debug = outcome(fn)
    return {"counts": {str(k): v for k, v in mode.get_comm_counts().items()},
            "total": mode.get_total_counts(), "debug_mode": logged,
            "events": events(lambda: outcome(fn)),
            "values": [under_mode, under_debug, outcome(fn)]}


if MODE != "mpcore":
    check("monitored_barrier")(lambda: observed(lambda: dist.monitored_barrier()))
    check("monitored_barrier/wait_all_ranks")(
        lambda: observed(lambda: dist.monitored_barrier(wait_all_ranks=True)))


def inputs():
    return [torch.arange(6.0) + RANK + 1, torch.arange(4.0) * (RANK + 2)]


def coalesced_reduce_scatter(op):
    outs = [torch.empty(3), torch.empty(2)]
    ins = inputs()
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(outs[0], ins[0], op=op)
        dist.reduce_scatter_tensor(outs[1], ins[1], op=op)
    return outs


check("coalesced_reduce_scatter/inputs")(inputs)
for name in ("SUM", "MAX", "MIN", "PRODUCT", "AVG"):
    check("coalesced_reduce_scatter/" + name)(
        lambda op=getattr(dist.ReduceOp, name): observed(lambda: coalesced_reduce_scatter(op)))

finish()
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return RankRuns(tmp_path_factory, "reductions", PARITY, timeout=360)


def gloo(runs, check):
    return runs.get("gloo", 2).value(check)


MONITORED = ("monitored_barrier", "monitored_barrier/wait_all_ranks")



def reduced(runs, reduction, mode="gloo", world=2):
    """What a coalesced reduce_scatter with `reduction` must leave on each rank
    of `mode`'s run, computed here from the inputs its ranks recorded:
    [rank][pair] tensors."""
    ins = runs.get(mode, world).value("coalesced_reduce_scatter/inputs")
    out = [[] for _ in range(world)]
    for i in range(len(ins[0])):
        stacked = torch.stack([ins[r][i] for r in range(world)])
        whole = {"SUM": stacked.sum(0), "MAX": stacked.amax(0), "MIN": stacked.amin(0),
                 "PRODUCT": stacked.prod(0), "AVG": stacked.mean(0)}[reduction]
        for r, part in enumerate(whole.chunk(world)):
            out[r].append(part)
    return out


@pytest.mark.parametrize("check", MONITORED)
def test_gloo_shows_monitored_barrier(runs, check):
    """The reference is not empty: gloo's monitored_barrier shows c10d's op
    in the profiler and DebugMode and its send and recv events, and
    CommDebugMode counts nothing of it."""
    for r, got in enumerate(gloo(runs, check)):
        names = [e[0] for e in got["events"]]
        assert "c10d::monitored_barrier_" in names and "send" in names and "recv" in names, \
            (r, got)
        assert got["debug_mode"] in (["c10d::monitored_barrier_"], None), (r, got)
        assert got["counts"] == {} and got["total"] == 0, (r, got)


@pytest.mark.parametrize("check", MONITORED)
def test_monitored_barrier_observed_as_gloo(runs, check):
    """Under `mpcore run`, monitored_barrier goes through c10d's op while
    something observes it: the same profiler events (c10d's op, gloo's send
    and recv, asynchronous), CommDebugMode counts and DebugMode log."""
    ref, got = gloo(runs, check), runs.get("run-gloo", 2).value(check)
    for r in range(2):
        assert got[r] == ref[r], f"rank {r} {check}:\n got {got[r]}\nwant {ref[r]}"


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gloo_shows_coalesced_reduce_scatter(runs, reduction):
    """The reference is not empty: gloo counts its coalesced reduce-scatter
    once under c10d's coalesced op, whatever the reduction."""
    for r, got in enumerate(gloo(runs, "coalesced_reduce_scatter/" + reduction)):
        assert got["counts"] == {"c10d.reduce_scatter_tensor_coalesced_": 1}, (r, got)
        assert [e[0] for e in got["events"] if e[0].startswith("c10d::")] == \
            ["c10d::reduce_scatter_tensor_coalesced_"], (r, got)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gloo_reduces_as_asked(runs, reduction):
    """gloo's coalesced reduce_scatter gives the reduction asked for, except on
    the torches of GLOO_REDUCE_SCATTER_SUMS, where it gives the sum (checked
    too, so that the list names only torches where gloo is wrong)."""
    sums = TORCH_RELEASE in GLOO_REDUCE_SCATTER_SUMS
    want = reduced(runs, "SUM" if sums else reduction)
    for r, got in enumerate(gloo(runs, "coalesced_reduce_scatter/" + reduction)):
        same(got["values"], [want[r]] * 3,
             f"gloo rank {r} {reduction} on torch {torch.__version__} ("
             + ("listed as summing" if sums else "not listed as summing") + ")")


@pytest.mark.parametrize("mode,world", RUNS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_coalesced_reduce_scatter_observed_as_gloo(runs, mode, world, reduction):
    """A coalesced reduce_scatter_tensor goes through c10d's coalesced op as
    gloo's does, whatever the reduction (NOTE [ c10d's ReduceOp of another
    kind ]): the same counts, DebugMode log and profiler events (an
    all-reduce event per pair, and nothing of the reduction's capture); its
    results are the reduction asked for, computed here from the inputs (gloo's
    where gloo is right: test_gloo_reduces_as_asked)."""
    check = "coalesced_reduce_scatter/" + reduction
    ref, got = gloo(runs, check), runs.get(mode, world).value(check)
    want = reduced(runs, reduction, mode, world)
    for r in range(world):
        for k in ("counts", "total", "debug_mode", "events"):
            assert got[r][k] == ref[r][k], f"{mode} rank {r} {check} {k}:\n got {got[r][k]}\n" \
                                           f"want {ref[r][k]}"
        same(got[r]["values"], [want[r]] * 3, f"{mode} rank {r} {check} values")


test_reference_run_is_gloo_and_finishes, test_served_by_mpcore_and_finishes, \
    test_nothing_left_behind = stack_tests(WORLDS, RUNS)
