"""torch's functional collectives (eager, and compiled with fullgraph=True
by the "eager" backend and by inductor) and the object collectives, over
the "mpcore" c10d backend, result for result against gloo.

One program (COLLECTIVES) runs every check on 2 and on 4 ranks; each rank
builds every rank's input from seeds that name (check, rank), so it also
records the reference result computed locally, and the tests assert
  - gloo gives the reference (the harness and the checks are sound),
  - mpcore, asked for by name, gives what gloo gave,
  - a program asking for "gloo" under `mpcore run` is served by mpcore and
    gives what gloo gave.
NOTE [ One start per stack ] in helpers/ranks.py says how the runs are shared.
"""
import pytest

from helpers.ranks import RankRuns, same, stack_tests

pytestmark = pytest.mark.timeout(400)

# 2 ranks: the 4-rank pools of test_backend.py cover every operation on 4 ranks, and
# a 4-rank functional collectives run costs minutes of the suite on a 2-core machine.
WORLDS = (2,)
# The runs served by mpcore: by name on 2 and 4 ranks; asked for as "gloo"
# under `mpcore run` on 2 (the 4-rank routing is covered by the DTensor
# module's (2, 2) mesh).
RUNS = [("mpcore", 2), ("run-gloo", 2)]

COLLECTIVES = r'''
import zlib
import torch.distributed._functional_collectives as funcol

init()
G = dist.group.WORLD
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "int64": torch.int64}


def data(name, rank, shape, dtype):
    """Rank `rank`'s input of check `name`: any rank can rebuild it."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def everyone(name, shape, dtype):
    return [data(name, r, shape, dtype) for r in range(WORLD)]


REDUCE = {"sum": lambda xs: sum(x.double() for x in xs),
          "max": lambda xs: torch.stack(xs).amax(0),
          "min": lambda xs: torch.stack(xs).amin(0)}


def reduced(op, xs):
    return REDUCE[op](xs).to(xs[0].dtype)


for dname, dtype in DTYPES.items():
    for op in ("sum", "max", "min"):
        name = f"all_reduce/{op}/{dname}"

        @check(name)
        def _():
            xs = everyone(name, (7, 5), dtype)
            out = funcol.all_reduce(xs[RANK].clone(), op, G)
            return {"got": funcol.wait_tensor(out), "want": reduced(op, xs)}

    for dim in (0, 1):
        name = f"all_gather_tensor/dim{dim}/{dname}"

        @check(name)
        def _():
            xs = everyone(name, (3, 4), dtype)
            out = funcol.all_gather_tensor(xs[RANK], dim, G)
            return {"got": funcol.wait_tensor(out), "want": torch.cat(xs, dim)}

        name = f"reduce_scatter_tensor/dim{dim}/{dname}"

        @check(name)
        def _():
            shape = (2 * WORLD, 3) if dim == 0 else (3, 2 * WORLD)
            xs = everyone(name, shape, dtype)
            out = funcol.reduce_scatter_tensor(xs[RANK], "sum", dim, G)
            want = reduced("sum", xs).chunk(WORLD, dim)[RANK]
            return {"got": funcol.wait_tensor(out), "want": want}

    name = f"all_to_all_single/even/{dname}"

    @check(name)
    def _():
        xs = everyone(name, (3 * WORLD, 2), dtype)
        out = funcol.all_to_all_single(xs[RANK], None, None, G)
        want = torch.cat([x.chunk(WORLD)[RANK] for x in xs])
        return {"got": funcol.wait_tensor(out), "want": want}

    name = f"all_to_all_single/uneven/{dname}"

    @check(name)
    def _():
        # Rank i sends (i + j) % 3 + 1 rows to rank j.
        rows = lambda i, j: (i + j) % 3 + 1
        xs = [data(name, i, (sum(rows(i, j) for j in range(WORLD)), 2), dtype)
              for i in range(WORLD)]
        send = [rows(RANK, j) for j in range(WORLD)]
        recv = [rows(i, RANK) for i in range(WORLD)]
        out = funcol.all_to_all_single(xs[RANK], recv, send, G)
        want = torch.cat([xs[i].split([rows(i, j) for j in range(WORLD)])[RANK]
                          for i in range(WORLD)])
        return {"got": funcol.wait_tensor(out), "want": want}


def chain(x):
    """Every functional collective, each on the one before."""
    a = funcol.all_reduce(x, "sum", G)
    b = funcol.all_gather_tensor(a * 2, 0, G)
    c = funcol.reduce_scatter_tensor(b + 1, "sum", 0, G)
    d = funcol.all_to_all_single(c, None, None, G)
    return a, b, c, d


def chain_reference(xs):
    a = sum(xs)
    b = torch.cat([a * 2] * WORLD)
    c = ((b + 1) * WORLD).chunk(WORLD)[RANK]
    d = torch.cat([c.chunk(WORLD)[RANK]] * WORLD)
    return a, b, c, d


for mode in ("none", "eager", "inductor"):
    name = f"compiled/{mode}"

    @check(name)
    def _():
        xs = everyone("chain", (4 * WORLD, 3), torch.float32)
        fn = chain if mode == "none" else torch.compile(chain, backend=mode, fullgraph=True)
        got = [funcol.wait_tensor(t) for t in fn(xs[RANK])]
        got2 = [funcol.wait_tensor(t) for t in fn(xs[RANK] * 3)]
        want2 = chain_reference([x * 3 for x in xs])
        return {"got": got + got2, "want": list(chain_reference(xs)) + list(want2)}


OBJECTS = [{"rank": r, "name": "r" * (r + 1), "t": torch.arange(r + 2)} for r in range(WORLD)]


@check("all_gather_object")
def _():
    out = [None] * WORLD
    dist.all_gather_object(out, OBJECTS[RANK])
    return {"got": out, "want": OBJECTS}


@check("broadcast_object_list")
def _():
    src = WORLD - 1
    objs = [OBJECTS[RANK], "x" * 1000, RANK] if RANK == src else [None, None, None]
    dist.broadcast_object_list(objs, src=src)
    return {"got": objs, "want": [OBJECTS[src], "x" * 1000, src]}


@check("scatter_object_list")
def _():
    out = [None]
    dist.scatter_object_list(out, OBJECTS if RANK == 1 else None, src=1)
    return {"got": out, "want": [OBJECTS[RANK]]}


@check("gather_object")
def _():
    dst = WORLD - 1
    out = [None] * WORLD if RANK == dst else None
    dist.gather_object(OBJECTS[RANK], out, dst=dst)
    return {"got": out, "want": OBJECTS if RANK == dst else None}


finish()
'''

CHECKS = (
    [f"all_reduce/{op}/{d}" for d in ("float32", "float64", "bfloat16", "int64")
     for op in ("sum", "max", "min")]
    + [f"{c}/dim{k}/{d}" for d in ("float32", "float64", "bfloat16", "int64")
       for c in ("all_gather_tensor", "reduce_scatter_tensor") for k in (0, 1)]
    + [f"all_to_all_single/{s}/{d}" for d in ("float32", "float64", "bfloat16", "int64")
       for s in ("even", "uneven")]
    + ["compiled/none", "compiled/eager", "compiled/inductor"]
    + ["all_gather_object", "broadcast_object_list", "scatter_object_list", "gather_object"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return RankRuns(tmp_path_factory, "collectives", COLLECTIVES, timeout=360)


def test_get_backend_under_run(runs):
    """A program that asked for "gloo" under `mpcore run` gets mpcore's
    group, and torch still names the backend it asked for, so the
    program's own `dist.get_backend() == "gloo"` tests go as under python
    (NOTE [ Which backend a group gets ])."""
    for r, ident in enumerate(runs.get("run-gloo", 2).value("_identity")):
        assert ident["type"] == "mpcore.dist._group.ProcessGroupMpcore", ident
        assert ident["backend"] == "gloo", (
            f"rank {r}: the program asked for gloo, but dist.get_backend() says "
            f"{ident['backend']!r}")


def tolerance(check, world):
    """A bfloat16 sum of `world` inputs of magnitude up to ~4, rounded to
    bfloat16 after each addition in an order of the backend's choosing,
    may be off by (world - 1) half-ulps of the partial sums (ulp 2**-5 up
    to 8): an absolute tolerance, since a sum near zero has no relative
    one.  Everything else: assert_close's defaults for the dtype."""
    if check.endswith("bfloat16") and ("sum" in check or "reduce_scatter" in check):
        return {"rtol": 1.6e-2, "atol": (world - 1) * 2 ** -6}
    return {}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("world", WORLDS)
def test_gloo_gives_the_reference(runs, world, check):
    for r, v in enumerate(runs.get("gloo", world).value(check)):
        same(v["got"], v["want"], f"gloo rank {r} {check}", **tolerance(check, world))


@pytest.mark.parametrize("mode,world", RUNS)
@pytest.mark.parametrize("check", CHECKS)
def test_mpcore_gives_what_gloo_gives(runs, world, check, mode):
    ref = runs.get("gloo", world).value(check)
    got = runs.get(mode, world).value(check)
    tol = tolerance(check, world)
    for r in range(world):
        same(got[r]["got"], ref[r]["got"], f"{mode} rank {r} {check}", **tol)
        same(got[r]["got"], got[r]["want"], f"{mode} rank {r} {check} vs reference", **tol)


test_reference_run_is_gloo_and_finishes, test_served_by_mpcore_and_finishes, \
    test_nothing_left_behind = stack_tests(WORLDS, RUNS)
