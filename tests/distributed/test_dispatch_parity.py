"""What observes collectives sees the same of an mpcore group as of gloo's:
torch's profiler (the backend's events, by name, shapes, asynchrony and
count, c10d's ops of dist.* calls and the functional collectives'
dispatcher ops), CommDebugMode's counts of dist.* calls and of the
functional collectives, torch.compile's graphs and graph
breaks, and what asynchronous calls return (AsyncCollectiveTensor from the
functional collectives, a Work that behaves as gloo's from dist.*).

One program (PARITY) runs on 2 ranks with gloo (the reference), with
mpcore asked for by name, and asking for gloo under `mpcore run`; each
test compares a check's record with gloo's run of the same check.  The
exceptions are the torches whose gloo refuses a call mpcore serves, or
answers wrongly (GLOO_REFUSES and the lists after it; NOTE [ What an older
torch's gloo refuses or gets wrong ] in dist/_collectives.py): there the
test checks that gloo did, and mpcore against values computed from the
inputs or against what gloo records where it serves the call
(SERVED_RECORDS, which the torches that serve it check against gloo's own).
NOTE [ Fast paths nobody sees ] in _fastpath.py and NOTE [ Collectives in
the profiler ] in _profile.py say what mpcore does for it; NOTE [ One start
per stack ] in helpers/ranks.py how the runs are shared.
"""
import importlib.util

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from helpers.ranks import RankRuns, same, stack_tests
from helpers.releases import GLOO_REDUCE_SCATTER_SUMS, TORCH_RELEASE

pytestmark = pytest.mark.timeout(400)

WORLDS = (2,)
RUNS = [("mpcore", 2), ("run-gloo", 2)]

PARITY = r'''
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor.debug import CommDebugMode

init()
G = dist.group.WORLD
PREFIX = str(dist.get_backend()) + ":"    # "gloo:" or "mpcore:", as torch's tests build it
all_gather_single = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)


def mine():
    return torch.arange(4, dtype=torch.float32) + 10 * RANK


def outcome(f):
    """f's value, or the first line of the error it raised, as "Type: message"
    (the gloo of some torches refuses a call: NOTE [ What an older torch's
    gloo refuses or gets wrong ] in dist/_collectives.py)."""
    try:
        return f()
    except Exception as e:
        return f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0]


def events(fn, kineto=False):
    """The profiler's events of fn's collectives, sorted: the backend's
    (named without the backend's prefix) and the functional collectives'
    dispatcher ops, each as (name, is_async, input shapes, count)."""
    if kineto:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                      record_shapes=True)
    else:
        prof = torch.autograd.profiler.profile(record_shapes=True)
    with prof:
        fn()
    out = []
    for e in (prof.events() if kineto else prof.function_events):
        if e.name.startswith(PREFIX):
            out.append([e.name[len(PREFIX):], e.is_async, e.input_shapes, e.count])
        elif e.name.startswith("_c10d_functional::"):
            out.append([e.name, e.is_async, e.input_shapes, e.count])
    return sorted(out)


def send_recv():
    t = mine()
    if RANK == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0)
        dist.send(t, 0)


def recv_any_source():
    t = mine()
    if RANK == 0:
        dist.send(t, 1)
    else:
        dist.recv(t)


def isend_irecv():
    t = mine()
    (dist.isend(t, 1) if RANK == 0 else dist.irecv(t, 0)).wait()


def batch_isend_irecv():
    ops = [dist.P2POp(dist.isend, mine(), (RANK + 1) % WORLD),
           dist.P2POp(dist.irecv, torch.empty(4), (RANK - 1) % WORLD)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


PROFILED = {
    "all_reduce": lambda: dist.all_reduce(mine()),
    "all_reduce/async_op": lambda: dist.all_reduce(mine(), async_op=True).wait(),
    "broadcast": lambda: dist.broadcast(mine(), 0),
    "reduce": lambda: dist.reduce(mine(), 1),
    "all_gather": lambda: dist.all_gather([torch.empty(4) for _ in range(WORLD)], mine()),
    "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(4 * WORLD),
                                                                  mine()),
    "reduce_scatter": lambda: dist.reduce_scatter(torch.empty(3),
                                                  [torch.ones(3) for _ in range(WORLD)]),
    "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(3),
                                                                torch.ones(3 * WORLD)),
    "gather": lambda: dist.gather(mine(), [torch.empty(4) for _ in range(WORLD)]
                                  if RANK == 0 else None, 0),
    "scatter": lambda: dist.scatter(torch.empty(4), [torch.ones(4) for _ in range(WORLD)]
                                    if RANK == 1 else None, 1),
    "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(2 * WORLD),
                                                        torch.ones(2 * WORLD)),
    "all_to_all": lambda: dist.all_to_all([torch.empty(2) for _ in range(WORLD)],
                                          [torch.ones(2) for _ in range(WORLD)]),
    "barrier": lambda: dist.barrier(),
    "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)]),
    "send_recv": send_recv,
    "recv_any_source": recv_any_source,
    "isend_irecv": isend_irecv,
    "batch_isend_irecv": batch_isend_irecv,
    "funcol/all_reduce": lambda: funcol.wait_tensor(funcol.all_reduce(mine(), "sum", G)),
    "funcol/all_gather_single": lambda: funcol.wait_tensor(all_gather_single(mine(), 0, G)),
    "funcol/reduce_scatter_single": lambda: funcol.wait_tensor(
        reduce_scatter_single(torch.ones(2 * WORLD), "sum", 0, G)),
}

for name, fn in PROFILED.items():
    check("profile/" + name)(lambda fn=fn: outcome(lambda: events(fn)))

@check("profile/ddp")
def _():
    """DDP's buckets: torch's reducer on gloo, mpcore's DDP under `mpcore run`."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8, bias=False))
    x = torch.ones(3, 8)

    def steps(n):
        for _ in range(n):
            model(x).sum().backward()
    steps(1)     # the buckets are rebuilt at the next step: its broadcast is recorded too
    return events(lambda: steps(2))




def dispatched(fn):
    """What torch's dispatcher shows of fn's calls: CommDebugMode's counts
    of c10d's ops, and the profiler's c10d:: events (name, count)."""
    with CommDebugMode() as mode:
        fn()
    prof = torch.autograd.profiler.profile()
    with prof:
        fn()
    return {"counts": {str(k): v for k, v in mode.get_comm_counts().items()},
            "events": sorted([e.name, e.count] for e in prof.function_events
                             if e.name.startswith("c10d::"))}


for name, fn in PROFILED.items():
    check("dispatch/" + name)(lambda fn=fn: outcome(lambda: dispatched(fn)))


check("profile/kineto/all_reduce")(lambda: events(lambda: dist.all_reduce(mine()), kineto=True))
check("profile/kineto/funcol/all_reduce")(lambda: events(
    lambda: funcol.wait_tensor(funcol.all_reduce(mine(), "sum", G)), kineto=True))


def functional():
    """The functional collectives' results, waited on."""
    return [funcol.wait_tensor(funcol.all_reduce(mine(), "sum", G)),
            funcol.wait_tensor(all_gather_single(mine(), 0, G)),
            funcol.wait_tensor(reduce_scatter_single(torch.ones(2 * WORLD) * (RANK + 1), "sum",
                                                     0, G))]


@check("comm_debug_mode")
def _():
    with CommDebugMode() as mode:
        values = functional()
    return {"counts": {str(k): v for k, v in mode.get_comm_counts().items()},
            "total": mode.get_total_counts(), "values": values}


@check("funcol_results")
def _():
    out = {}
    calls = {"all_reduce": lambda: funcol.all_reduce(mine(), "max", G),
             "all_gather_single": lambda: all_gather_single(mine(), 0, G),
             "reduce_scatter_single": lambda: reduce_scatter_single(
                 torch.ones(2 * WORLD) * (RANK + 1), "sum", 0, G)}
    for name, call in calls.items():
        y = call()
        used = y * 2                     # used before any wait: it waits itself
        z = call()
        waited = funcol.wait_tensor(z)
        again = funcol.wait_tensor(z)    # a second wait gives the same tensor
        out[name] = {"type": type(y).__name__, "used": [type(used).__name__, used],
                     "waited": [type(waited).__name__, waited], "again": again is waited,
                     "wait()": y.wait()}
    return out


@check("funcol_complete")
def _():
    """Whether an AsyncCollectiveTensor a functional collective returns is
    already complete: unobserved, and under CommDebugMode."""
    plain = funcol.all_reduce(mine(), "sum", G).completed
    with CommDebugMode():
        observed = funcol.all_reduce(mine(), "sum", G).completed
    return [plain, observed]


def shapes(v):
    if isinstance(v, torch.Tensor):
        return list(v.shape)
    if isinstance(v, (list, tuple)):
        return [shapes(x) for x in v]
    return repr(v)


def facts(w):
    """What a program can learn of an async_op call's Work."""
    out = {"is_work": isinstance(w, dist.Work), "wait": w.wait()}
    out["completed"] = w.is_completed()
    out["exception"] = outcome(lambda: repr(w.exception()))
    try:
        out["future"] = shapes(w.get_future().wait())
    except RuntimeError as e:
        out["future"] = "RuntimeError: " + str(e)
    try:
        out["source_rank"] = w._source_rank()
    except RuntimeError as e:
        out["source_rank"] = "RuntimeError: " + str(e)
    return out


def p2p_work(any_source):
    t = mine()
    if RANK == 0:
        return dist.isend(t, 1)
    return dist.irecv(t) if any_source else dist.irecv(t, 0)


WORKS = {
    "all_reduce": lambda: dist.all_reduce(mine(), async_op=True),
    "broadcast": lambda: dist.broadcast(mine(), 1, async_op=True),
    "reduce": lambda: dist.reduce(mine(), 0, async_op=True),
    "all_gather": lambda: dist.all_gather([torch.empty(4) for _ in range(WORLD)], mine(),
                                          async_op=True),
    "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(4 * WORLD), mine(),
                                                                  async_op=True),
    "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(2),
                                                                torch.ones(2 * WORLD),
                                                                async_op=True),
    "gather": lambda: dist.gather(mine(), [torch.empty(4) for _ in range(WORLD)]
                                  if RANK == 1 else None, 1, async_op=True),
    "scatter": lambda: dist.scatter(torch.empty(4), [torch.ones(4) for _ in range(WORLD)]
                                    if RANK == 0 else None, 0, async_op=True),
    "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(2 * WORLD),
                                                        torch.ones(2 * WORLD), async_op=True),
    "all_to_all": lambda: dist.all_to_all([torch.empty(2) for _ in range(WORLD)],
                                          [torch.ones(2) for _ in range(WORLD)], async_op=True),
    "barrier": lambda: dist.barrier(async_op=True),
    "isend_irecv": lambda: p2p_work(False),
    "isend_irecv_any_source": lambda: p2p_work(True),
}

for name, fn in WORKS.items():
    check("work/" + name)(lambda fn=fn: outcome(lambda: facts(fn())))


def _coalesced(call):
    with dist._coalescing_manager():
        call()


@check("dispatch/comm_mode_c10d")
def _():
    """torch's test_comm_mode.py test_comm_mode_with_c10d, on CPU tensors:
    CommDebugMode's count of each dist.* call's c10d op, and its total
    (or the error a call raised)."""
    inp = torch.rand(2, 8, 16) + RANK
    out = inp.new_empty(WORLD * 2, 8, 16)
    calls = {
        "all_reduce": lambda: dist.all_reduce(inp),
        "all_gather_single": lambda: getattr(dist, "all_gather_single",
                                             dist.all_gather_into_tensor)(out, inp),
        "reduce_scatter_single": lambda: getattr(dist, "reduce_scatter_single",
                                                 dist.reduce_scatter_tensor)(inp, out),
        "broadcast": lambda: dist.broadcast(inp, 0),
        "gather": lambda: dist.gather(inp, [inp.clone() for _ in range(WORLD)]
                                      if RANK == 0 else None, 0),
        "reduce": lambda: dist.reduce(inp, 0),
        "scatter": lambda: dist.scatter(inp, [inp.clone() for _ in range(WORLD)]
                                        if RANK == 0 else None, 0),
        "all_gather": lambda: dist.all_gather([torch.empty_like(inp) for _ in range(WORLD)],
                                              inp),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced(
            [[inp.new_empty(inp.shape)] for _ in range(WORLD)], [inp]),
        "coalesced all_gather_single": lambda: _coalesced(lambda: getattr(
            dist, "all_gather_single", dist.all_gather_into_tensor)(out, inp)),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced(inp),
        "reduce_scatter": lambda: dist.reduce_scatter(inp, [inp.clone() for _ in range(WORLD)]),
        "coalesced reduce_scatter_single": lambda: _coalesced(lambda: getattr(
            dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(inp, out)),
        "all_to_all": lambda: dist.all_to_all([torch.empty_like(inp) for _ in range(WORLD)],
                                              [inp.clone() for _ in range(WORLD)]),
        "all_to_all_single": lambda: dist.all_to_all_single(inp, inp.clone()),
    }
    got = {}
    for name, call in calls.items():
        mode = CommDebugMode()
        try:
            with mode:
                call()
        except Exception as e:
            got[name] = f"{type(e).__name__}: {e}"
            continue
        got[name] = [{str(k): v for k, v in mode.get_comm_counts().items()},
                     mode.get_total_counts()]
    dist.barrier()
    return got


@check("dispatch/ddp")
def _():
    """What the dispatcher shows of DDP's buckets (torch's reducer on gloo,
    mpcore's DDP under `mpcore run`)."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8, bias=False))
    x = torch.ones(3, 8)
    model(x).sum().backward()      # the buckets are rebuilt at the next step

    def step():
        model(x).sum().backward()
    step()
    return dispatched(step)


@check("dispatch/fake")
def _():
    """dist.* calls on fake tensors: c10d's meta kernels serve them, as on gloo
    (a torch without them raises, as on gloo)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def calls():
        with FakeTensorMode():
            t = torch.ones(4)
            w = dist.all_reduce(t, async_op=True)
            dist.broadcast(t, 0)
            out = torch.empty(4 * WORLD)
            dist.all_gather_into_tensor(out, t)
        return [type(t).__name__, type(w).__name__, type(out).__name__, list(out.shape)]
    return outcome(calls)


@check("dispatch/debug_mode")
def _():
    """The c10d ops torch's DebugMode logs of dist.* calls (None on a torch
    without DebugMode)."""
    try:
        from torch.utils._debug_mode import DebugMode
    except ImportError:
        return None
    with DebugMode() as dm:
        dist.all_reduce(mine())
        dist.broadcast(mine(), 0)
        dist.barrier()
    return [line.strip().split("(")[0] for line in dm.debug_string().splitlines()
            if "c10d" in line]


@check("dispatch/values")
def _():
    """Results of dist.* calls made under CommDebugMode (which the group
    then serves through c10d's ops)."""
    with CommDebugMode():
        a = mine()
        dist.all_reduce(a, op=dist.ReduceOp.MAX)
        b = mine()
        dist.broadcast(b, 1)
        c = torch.empty(4 * WORLD)
        dist.all_gather_into_tensor(c, mine())
        d = torch.empty(2)
        d_input = torch.arange(2.0 * WORLD) * (RANK + 1)
        dist.reduce_scatter_tensor(d, d_input, op=dist.ReduceOp.MIN)
        e = torch.empty(2 * WORLD)
        dist.all_to_all_single(e, torch.arange(2.0 * WORLD) + 100 * RANK)
        f = [torch.empty(4) for _ in range(WORLD)]
        dist.all_gather(f, mine())
        w = dist.all_reduce(mine(), async_op=True)
    return {"values": [a, b, c, d, e, f], "work": facts(w), "d_input": d_input}


@check("served/values")
def _():
    """Results of calls the gloo of some torches refuses, with their inputs."""
    a2a_in = [torch.arange(2.0) + 10 * RANK + 100 * j for j in range(WORLD)]
    a2a_out = [torch.empty(2) for _ in range(WORLD)]
    rs_in = [torch.arange(3.0) * (RANK + 1) + j for j in range(WORLD)]
    rs_out = torch.empty(3)
    avg = mine()
    return {"inputs": {"all_to_all": a2a_in, "reduce_scatter": rs_in, "all_reduce/AVG": mine()},
            "all_to_all": outcome(lambda: dist.all_to_all(a2a_out, a2a_in) or a2a_out),
            "reduce_scatter": outcome(lambda: dist.reduce_scatter(rs_out, rs_in) or rs_out),
            "all_reduce/AVG": outcome(lambda: dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                                      or avg)}


def graphs(fn):
    """What torch.compile made of fn: its result, graph breaks, graphs."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    result = torch.compile(fn, backend="eager")(mine())
    return {"result": result, "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"]}


def compiled_broadcast(x):
    y = x * 2
    dist.broadcast(y, 0)
    return y + 1


def compiled_all_to_all(x):
    y = x * 2
    out = torch.empty_like(y)
    dist.all_to_all_single(out, y)
    return out + 1


def compiled_all_reduce(x):
    y = x * 2
    dist.all_reduce(y)
    return y + 1


def compiled_all_gather(x):
    y = x * 2
    outs = [torch.empty_like(y) for _ in range(WORLD)]
    dist.all_gather(outs, y)
    return torch.stack(outs) + 1


check("compiled/broadcast")(lambda: graphs(compiled_broadcast))
check("compiled/all_to_all_single")(lambda: graphs(compiled_all_to_all))
check("compiled/all_reduce")(lambda: graphs(compiled_all_reduce))
check("compiled/all_gather")(lambda: graphs(compiled_all_gather))


@check("coalescing/unobserved")
def _():
    """The calls torch's _coalescing_manager gathers into one coalesced
    call (all_reduce, all_gather_single, reduce_scatter_single), made in
    one, unobserved: their results, and the manager's Works with
    async_ops=True (or the error)."""
    ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    out = {}
    for async_ops in (False, True):
        a, b = mine(), mine() * 2
        gathered = [torch.zeros(4 * WORLD) for _ in range(2)]
        scattered = [torch.zeros(4 // WORLD) for _ in range(2)]
        calls = {"all_reduce": lambda: (dist.all_reduce(a), dist.all_reduce(b)),
                 "all_gather_single": lambda: (ag(gathered[0], a), ag(gathered[1], b)),
                 "reduce_scatter_single": lambda: (rs(scattered[0], a), rs(scattered[1], b))}
        for name, call in calls.items():
            try:
                with dist._coalescing_manager(async_ops=async_ops) as cm:
                    call()
                if async_ops:
                    works = [isinstance(w, dist.Work) for w in cm.works]
                    cm.wait()
                else:
                    works = None
                out[f"{name}/{async_ops}"] = {"works": works, "values": [
                    t.tolist() for t in (a, b, *gathered, *scattered)]}
            except Exception as e:   # the comparison with gloo says whether it should raise
                out[f"{name}/{async_ops}"] = f"{type(e).__name__}: {e}"
    return out

finish()
'''

PROFILE_CHECKS = (["profile/" + n for n in (
    "all_reduce", "all_reduce/async_op", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
    "all_to_all_single", "all_to_all", "barrier", "all_reduce_coalesced", "send_recv",
    "recv_any_source", "isend_irecv", "batch_isend_irecv", "funcol/all_reduce",
    "funcol/all_gather_single", "funcol/reduce_scatter_single", "ddp", "kineto/all_reduce",
    "kineto/funcol/all_reduce")])

# What of a Work is compared, where gloo's own Work is short of torch's surface: its
# reduce_scatter Work has no future (and reports itself incomplete after wait()), nor its
# isend/irecv Works; gloo's all_gather_into_tensor future gives the output's chunks, which
# mpcore's does not (it gives [output], as NCCL's).
WORK_FACTS = {"reduce_scatter_tensor": ("is_work", "wait", "exception", "source_rank"),
              "all_gather_into_tensor": ("is_work", "wait", "completed", "exception",
                                         "source_rank"),
              "isend_irecv": ("is_work", "wait", "completed", "exception", "source_rank"),
              "isend_irecv_any_source": ("is_work", "wait", "completed", "exception",
                                         "source_rank")}
WORK_CHECKS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single", "all_to_all",
               "barrier", "isend_irecv", "isend_irecv_any_source")


# the calls of PROFILED: dist.* calls, and the functional collectives (whose
# kernels call the group's method, which goes through c10d's op as gloo's does)
DISPATCH_CHECKS = ["dispatch/" + c[len("profile/"):] for c in PROFILE_CHECKS
                   if not c.startswith(("profile/kineto/", "profile/ddp"))]

# Where the gloo of a torch differs from gloo's later behaviour (NOTE [ What an older
# torch's gloo refuses or gets wrong ] in dist/_collectives.py).  Each was seen on torch
# 2.6.0 and, where listed, 2.8.0; 2.13.0 and 2.14.1 differ in none.  The releases between
# were not tried: one whose gloo differs too fails the test that checks the difference,
# which names it.
#
# Calls the gloo of a torch refuses, which mpcore's group serves: call -> (torches,
# gloo's refusal).
GLOO_REFUSES = {
    "all_to_all": (((2, 6), (2, 8)), "RuntimeError: Backend gloo does not support alltoall"),
    "reduce_scatter": (((2, 6),), "RuntimeError: ProcessGroupGloo does not support "
                                  "reduce_scatter"),
    "all_reduce/AVG": (((2, 6),), "RuntimeError: Cannot use ReduceOp.AVG with Gloo"),
}
# What gloo records of those calls where it serves them: mpcore's records where gloo
# refuses (checked against gloo's own on the torches that serve them).
SERVED_RECORDS = {
    "profile/all_to_all": [["all_to_all", True, [[2], [2]], 1]],
    # gloo's reduce_scatter of lists is one all-reduce per rank
    "profile/reduce_scatter": [["all_reduce", True, [[3]], 1]] * WORLDS[0],
    "dispatch/all_to_all": {"counts": {"c10d.alltoall_": 1},
                            "events": [["c10d::alltoall_", 1]]},
    "dispatch/reduce_scatter": {"counts": {"c10d.reduce_scatter_": 1},
                                "events": [["c10d::reduce_scatter_", 1]]},
    "work/all_to_all": {"is_work": True, "wait": True, "completed": True, "exception": "None",
                        "future": [[2], [2]],
                        "source_rank": "RuntimeError: sourceRank() may only be called on work "
                                       "objects that correspond to a recv or recv-from-any "
                                       "call."},
}
COMM_MODE_RECORDS = {"all_to_all": [{"c10d.alltoall_": 1}, 1],
                     "reduce_scatter": [{"c10d.reduce_scatter_": 1}, 1]}
# Torches whose Work.exception() binding cannot convert its answer: it raises on gloo's
# Work; mpcore's Work answers (None for the calls here, which succeed), as gloo's does on
# a later torch.
GLOO_WORK_EXCEPTION_RAISES = ((2, 6), (2, 8))
WORK_EXCEPTION_RAISES = ("TypeError: Unable to convert function return value to a Python type! "
                         "The signature was")
# Torches whose c10d ops have no fake kernels: dist.* calls on fake tensors raise, on gloo
# and on mpcore alike (2.8.0 has them, once the program imported what PARITY imports).
NO_FAKE_KERNELS = ((2, 6),)
NO_FAKE_KERNEL = "UnsupportedOperatorException: c10d.allreduce_.default"
HAS_DEBUG_MODE = importlib.util.find_spec("torch.utils._debug_mode") is not None
# mpcore's functional fast path needs these of torch (the functional collective fast
# paths' rows in _torchapi.py); without them it falls back to torch's way.
FUNCOL_FAST = all(hasattr(funcol, n) for n in ("all_gather_single", "reduce_scatter_single"))
SERVED_CALLS = tuple(GLOO_REFUSES)


def refused(call):
    """gloo's refusal of `call` on this torch, or None where it serves it."""
    torches, text = GLOO_REFUSES.get(call, ((), None))
    return text if TORCH_RELEASE in torches else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return RankRuns(tmp_path_factory, "parity", PARITY, timeout=360)


def gloo(runs, check):
    return runs.get("gloo", 2).value(check)


def reference(runs, check, world=2):
    """gloo's record of `check` on each rank; where this torch's gloo refuses
    the check's call (GLOO_REFUSES), after checking that it did, what gloo
    records where it serves the call (SERVED_RECORDS)."""
    ref = gloo(runs, check)
    text = refused(check.split("/", 1)[1])
    if text is None:
        return ref
    assert ref == [text] * world, (check, torch.__version__, ref)
    return [SERVED_RECORDS[check]] * world


def work_reference(facts):
    """gloo's facts of a Work (facts() in PARITY), where gloo's Work.exception()
    raises (GLOO_WORK_EXCEPTION_RAISES), after checking that it did, with the
    answer of a torch whose binding converts it: "None", the calls here
    succeed."""
    if TORCH_RELEASE not in GLOO_WORK_EXCEPTION_RAISES:
        return facts
    assert facts["exception"] == WORK_EXCEPTION_RAISES, (torch.__version__, facts)
    return {**facts, "exception": "None"}


@pytest.mark.parametrize("check", sorted(SERVED_RECORDS))
def test_served_records_are_gloos(runs, check):
    """The records written in SERVED_RECORDS are gloo's, where this torch's
    gloo serves the call (else reference() checks its refusal)."""
    if refused(check.split("/", 1)[1]) is not None:
        reference(runs, check)
        return
    for r, got in enumerate(gloo(runs, check)):
        assert got == SERVED_RECORDS[check], (r, got)


@pytest.mark.parametrize("check", PROFILE_CHECKS)
def test_gloo_records_events(runs, check):
    """The reference is not empty: gloo's run records an event of the
    backend for every check (else the comparison below proves nothing)."""
    for r, evs in enumerate(reference(runs, check)):
        if check == "profile/recv_any_source" and r == 0:
            continue    # rank 0 only sends there; rank 1 receives
        assert isinstance(evs, list), (r, evs)
        assert any(not e[0].startswith("_c10d_functional::") for e in evs), (r, evs)


@pytest.mark.parametrize("mode,world", RUNS)
@pytest.mark.parametrize("check", PROFILE_CHECKS)
def test_profiler_events_as_gloo(runs, mode, world, check):
    """Every collective leaves the events gloo's leaves, under the backend
    name torch reports: the same operations, input shapes, asynchrony and
    counts, and a functional collective the same dispatcher ops."""
    ref, got = reference(runs, check, world), runs.get(mode, world).value(check)
    for r in range(world):
        assert got[r] == ref[r], f"{mode} rank {r} {check}:\n got {got[r]}\nwant {ref[r]}"


@pytest.mark.parametrize("mode,world", RUNS)
def test_comm_debug_mode_counts_as_gloo(runs, mode, world):
    """CommDebugMode counts the functional collectives an mpcore group
    serves as it counts gloo's (its fast path steps aside under a dispatch
    mode), and their results are gloo's."""
    ref, got = gloo(runs, "comm_debug_mode"), runs.get(mode, world).value("comm_debug_mode")
    for r in range(world):
        assert ref[r]["total"] == 3, ref[r]
        assert got[r]["counts"] == ref[r]["counts"], (mode, r, got[r]["counts"])
        assert got[r]["total"] == ref[r]["total"]
        same(got[r]["values"], ref[r]["values"], f"{mode} rank {r} values")


@pytest.mark.parametrize("check", DISPATCH_CHECKS)
def test_gloo_dispatches_c10d_ops(runs, check):
    """The reference is not empty: on gloo every dist.* call shows c10d's
    op in the profiler, and CommDebugMode counts the collectives."""
    for r, got in enumerate(reference(runs, check)):
        if check == "dispatch/recv_any_source" and r == 0:
            continue    # rank 0 only sends there
        assert isinstance(got, dict) and got["events"], (r, got)
        if not check.startswith(("dispatch/send", "dispatch/recv", "dispatch/isend",
                                 "dispatch/batch", "dispatch/barrier")):
            assert sum(got["counts"].values()) >= 1, (r, got)


@pytest.mark.parametrize("mode,world", RUNS)
@pytest.mark.parametrize("check", DISPATCH_CHECKS)
def test_dist_calls_dispatched_as_gloo(runs, mode, world, check):
    """A dist.* call on an mpcore group goes through c10d's op while a
    dispatch mode or the profiler observes it (NOTE [ Observed calls go
    through the dispatcher ] in _profile.py): CommDebugMode counts it under
    gloo's keys, and the profiler records gloo's c10d:: events."""
    ref, got = reference(runs, check, world), runs.get(mode, world).value(check)
    for r in range(world):
        assert got[r] == ref[r], f"{mode} rank {r} {check}:\n got {got[r]}\nwant {ref[r]}"


@pytest.mark.parametrize("mode,world", RUNS)
@pytest.mark.parametrize("check", ["dispatch/fake", "dispatch/debug_mode"])
def test_modes_see_dist_calls_as_gloo(runs, mode, world, check):
    """FakeTensorMode serves a dist.* call with c10d's meta kernels (a
    FakeWork), and DebugMode logs its c10d ops, as on gloo; on a torch
    without the kernels (NO_FAKE_KERNELS) the call raises as on gloo, and a
    torch without DebugMode records None."""
    ref, got = gloo(runs, check), runs.get(mode, world).value(check)
    for r in range(world):
        if check == "dispatch/fake" and TORCH_RELEASE in NO_FAKE_KERNELS:
            assert ref[r] == NO_FAKE_KERNEL, (torch.__version__, ref[r])
        elif check == "dispatch/debug_mode" and not HAS_DEBUG_MODE:
            assert ref[r] is None, ref[r]
        else:
            assert isinstance(ref[r], list) and ref[r], ref[r]
        assert got[r] == ref[r], (mode, r, got[r], ref[r])


@pytest.mark.parametrize("mode,world", RUNS)
def test_torchs_comm_mode_test_as_gloo(runs, mode, world):
    """torch's own CommDebugMode test of dist.* calls (test_comm_mode.py,
    test_comm_mode_with_c10d, there on an accelerator), on CPU tensors:
    each call counts its c10d op once, as on gloo; a call this torch's gloo
    refuses (GLOO_REFUSES) as gloo counts it where it serves it
    (COMM_MODE_RECORDS, checked there)."""
    ref = gloo(runs, "dispatch/comm_mode_c10d")
    got = runs.get(mode, world).value("dispatch/comm_mode_c10d")
    for r in range(world):
        for name, v in ref[r].items():
            text = refused(name)
            if text is not None:
                assert v == text, (torch.__version__, r, name, v)
                v = COMM_MODE_RECORDS[name]
            else:
                assert not isinstance(v, str), (r, name, v)
                assert v == COMM_MODE_RECORDS.get(name, v), (r, name, v)
            assert got[r][name] == v, (mode, r, name, got[r][name], v)


def served_value(inputs, call, r, world):
    """What `call` of the check "served/values" must give rank r, computed
    from every rank's recorded inputs."""
    ins = [inputs[q][call] for q in range(world)]
    if call == "all_to_all":
        return [ins[q][r] for q in range(world)]
    if call == "reduce_scatter":
        return torch.stack([ins[q][r] for q in range(world)]).sum(0)
    return torch.stack(ins).mean(0)     # all_reduce/AVG


@pytest.mark.parametrize("mode,world", RUNS)
@pytest.mark.parametrize("call", SERVED_CALLS)
def test_calls_an_older_gloo_refuses_are_served(runs, mode, world, call):
    """The calls the gloo of some torches refuses (GLOO_REFUSES) give the
    right values on every torch (NOTE [ What an older torch's gloo refuses or
    gets wrong ]): computed here from the inputs, and gloo's where it serves
    them; where it does not, gloo refused them as listed."""
    ref, got = gloo(runs, "served/values"), runs.get(mode, world).value("served/values")
    text = refused(call)
    for r in range(world):
        want = served_value([g["inputs"] for g in got], call, r, world)
        if text is not None:
            assert ref[r][call] == text, (torch.__version__, r, ref[r][call])
        else:
            same(ref[r][call], want, f"gloo rank {r} {call}")
        same(got[r][call], want, f"{mode} rank {r} {call}")


@pytest.mark.parametrize("mode,world", RUNS)
def test_ddp_buckets_dispatched_as_gloo(runs, mode, world):
    """DDP's bucket all-reduces, observed, go through c10d's op as torch's
    reducer's do on gloo: the same CommDebugMode counts and c10d:: events."""
    ref, got = gloo(runs, "dispatch/ddp"), runs.get(mode, world).value("dispatch/ddp")
    for r in range(world):
        assert ref[r]["counts"] and ref[r]["events"], ref[r]
        assert got[r] == ref[r], (mode, r, got[r], ref[r])


@pytest.mark.parametrize("mode,world", RUNS)
def test_dispatched_calls_give_gloos_results(runs, mode, world):
    """Calls served through c10d's ops give gloo's results, and an async
    one a Work that answers as gloo's (work_reference()).  The
    reduce_scatter_tensor with MIN gives the minimum, computed here from the
    inputs; gloo's too, except where it sums (GLOO_REDUCE_SCATTER_SUMS)."""
    ref, got = gloo(runs, "dispatch/values"), runs.get(mode, world).value("dispatch/values")
    sums = TORCH_RELEASE in GLOO_REDUCE_SCATTER_SUMS
    for r in range(world):
        stacked = torch.stack([got[q]["d_input"] for q in range(world)])
        minimum = stacked.amin(0).chunk(world)[r]
        same(ref[r]["values"][3], stacked.sum(0).chunk(world)[r] if sums else minimum,
             f"gloo rank {r} reduce_scatter_tensor MIN on torch {torch.__version__}")
        same(got[r]["values"][3], minimum, f"{mode} rank {r} reduce_scatter_tensor MIN")
        mine, theirs = list(got[r]["values"]), list(ref[r]["values"])
        del mine[3], theirs[3]
        same(mine, theirs, f"{mode} rank {r} values")
        want = work_reference(ref[r]["work"])
        for k in ("is_work", "wait", "completed", "exception", "future", "source_rank"):
            assert got[r]["work"][k] == want[k], (mode, r, k, got[r]["work"], want)


@pytest.mark.parametrize("mode,world", RUNS)
def test_calls_in_a_coalescing_manager_as_gloo(runs, mode, world):
    """Unobserved calls inside torch's _coalescing_manager are gathered
    into one coalesced call as gloo's are: the same results, and with
    async_ops=True the manager holds the one Work to wait on (a fast path
    that served them at once left it None)."""
    ref = gloo(runs, "coalescing/unobserved")
    got = runs.get(mode, world).value("coalescing/unobserved")
    for r in range(world):
        assert all(isinstance(v, dict) for v in ref[r].values()), ref[r]
        assert ref[r]["all_reduce/True"]["works"] == [True], ref[r]
        assert got[r] == ref[r], (mode, r, got[r], ref[r])


@pytest.mark.parametrize("mode,world", RUNS)
def test_functional_results_as_gloo(runs, mode, world):
    """A functional collective returns an AsyncCollectiveTensor, as torch's
    eager path does, used as it is or waited on with the same results."""
    ref, got = gloo(runs, "funcol_results"), runs.get(mode, world).value("funcol_results")
    for r in range(world):
        for name, v in ref[r].items():
            assert v["type"] == "AsyncCollectiveTensor", (name, v)
        same(got[r], ref[r], f"{mode} rank {r}")


@pytest.mark.parametrize("mode,world", RUNS)
def test_functional_fast_path_serves_unobserved_calls(runs, mode, world):
    """Unobserved, mpcore's functional collectives return a result already
    complete (its fast path served it); under CommDebugMode torch's path
    serves it, and the result is one still to be waited on, as gloo's.  On
    a torch without what the fast path needs (FUNCOL_FAST: before 2.13)
    torch's path serves both, as gloo's (NOTE [ A feature torch cannot carry
    falls back ] in _torchapi.py)."""
    assert gloo(runs, "funcol_complete") == [[False, False]] * world
    assert runs.get(mode, world).value("funcol_complete") == [[FUNCOL_FAST, False]] * world


@pytest.mark.parametrize("mode,world", RUNS)
@pytest.mark.parametrize("op", WORK_CHECKS)
def test_async_work_as_gloo(runs, mode, world, op):
    """A dist.* call with async_op=True returns a Work that answers wait,
    is_completed, exception, get_future and _source_rank as gloo's does
    (where gloo's answers at all: WORK_FACTS, work_reference(); where this
    torch's gloo refuses the call, as gloo's Work where it serves it)."""
    ref = reference(runs, "work/" + op, world)
    if refused(op) is None:
        ref = [work_reference(f) for f in ref]
    got = runs.get(mode, world).value("work/" + op)
    keys = WORK_FACTS.get(op, ("is_work", "wait", "completed", "exception", "future",
                               "source_rank"))
    for r in range(world):
        assert ref[r]["is_work"] and ref[r]["wait"] is True, ref[r]
        for k in keys:
            assert got[r][k] == ref[r][k], (mode, r, op, k, got[r][k], ref[r][k])


@pytest.mark.parametrize("mode,world", RUNS)
@pytest.mark.parametrize("check", ["compiled/broadcast", "compiled/all_to_all_single",
                                   "compiled/all_reduce", "compiled/all_gather"])
def test_compiled_as_gloo(runs, mode, world, check):
    """torch.compile traces a dist.* call on an mpcore group as on gloo's:
    the same result, graph breaks and graphs (the fast path steps aside
    while dynamo traces)."""
    ref, got = gloo(runs, check), runs.get(mode, world).value(check)
    for r in range(world):
        same(got[r], ref[r], f"{mode} rank {r} {check}")


test_reference_run_is_gloo_and_finishes, test_served_by_mpcore_and_finishes, \
    test_nothing_left_behind = stack_tests(WORLDS, RUNS)
