"""mpcore's torch.distributed backend (ProcessGroupMpcore, dist/_group.py),
result for result against torch's own gloo.

Ranks are started once per module: pools of 2 and 4 rank processes that
run jobs the test sends them (one JSON line each on stdin) and answer with
one line each.  Every rank has the default group (init_process_group("gloo"),
which mpcore serves) and, next to each mpcore group, a group of torch's own
gloo over the same ranks: a job runs the same call on both with the same
inputs, and checks mpcore's result against the one computed from every
rank's inputs (each rank can rebuild all inputs from their seeds) and
against gloo's, where gloo takes the dtype and op.
"""
import ast
import json
import os
import re
import select
import signal
import subprocess
import textwrap
import time

import pytest

from helpers import fresh_env, require, scaled
from helpers.ranks import free_port, start_rank

pytestmark = pytest.mark.timeout(180)


def _have_gloo():
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_gloo_available()
    except ImportError:
        return False


WORKER = r'''
import ast, contextlib, datetime, json, os, sys, threading, time, traceback, warnings, zlib
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
import mpcore.distributed as md
from mpcore.dist import _buffers

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
if os.environ.get("FAKE_HOSTS"):        # every rank on a machine of its own, as far as mpcore sees
    from mpcore.dist import _dist
    _dist._host_id = lambda: f"host-{RANK}"
md.init_process_group("gloo", timeout=datetime.timedelta(seconds=60 * SLOW))
R = dist.ReduceOp

DT = ["float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int8", "int16",
      "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn",
      "float8_e5m2"]
FLOATS = {"float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
COMPLEX = {"complex64", "complex128"}
UNSIGNED = {"uint8", "uint16", "uint32", "uint64"}


class real_gloo:
    """torch's own gloo for the groups made inside (mpcore serves "gloo"
    otherwise): torch's BackendConfig while inside."""
    def __enter__(self):
        self.cfg = c10d.BackendConfig
        c10d.BackendConfig = self.cfg.__mro__[1]
    def __exit__(self, *a):
        c10d.BackendConfig = self.cfg


GROUPS = {}
def make_groups():
    """kind -> (mpcore group, gloo group, global ranks), None where this
    rank is not a member; every rank makes every group in the same order."""
    with real_gloo():
        GROUPS["world"] = (c10d._get_default_group(), dist.new_group(backend="gloo"),
                           list(range(WORLD)))
    pair = [0, WORLD - 1]
    m = dist.new_group(pair)
    with real_gloo():
        g = dist.new_group(pair, backend="gloo")
    GROUPS["new_group"] = (m, g, pair) if RANK in pair else None
    m, _ = dist.new_subgroups(2)
    with real_gloo():
        g, _ = dist.new_subgroups(2, backend="gloo")
    GROUPS["new_subgroups"] = (m, g, dist.get_process_group_ranks(m))
    asked = dist.new_group(backend="gloo")          # served by mpcore all the same
    with real_gloo():
        g = dist.new_group(backend="gloo")
    GROUPS["asked_for_gloo"] = (asked, g, list(range(WORLD)))
    splits = [[0, WORLD - 1]] + ([list(range(1, WORLD - 1))] if WORLD > 2 else [])
    m = dist.split_group(split_ranks=splits)     # torch's function, for mpcore's groups too
    mine = next(s for s in splits if RANK in s)
    with real_gloo():
        gs = [dist.new_group(s, backend="gloo") for s in splits]
    GROUPS["split_group"] = (m, gs[splits.index(mine)], mine)
    kinds = {}
    for k, v in GROUPS.items():
        if v is not None:
            kinds[k] = [type(v[0]).__name__, type(v[1]).__name__, v[0].shm is not None]
    return kinds


def make(name, shape, rank, tag):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}|{shape}|{rank}|{tag}".encode()))
    x = torch.randint(-2, 3, tuple(shape), generator=g)
    if name == "bool":
        return (x % 2).bool()
    if name in UNSIGNED:
        x = x.abs()
    if name in COMPLEX:
        return torch.complex(x.double(), x.flip(-1).double()).to(getattr(torch, name))
    return x.to(getattr(torch, name))


def nbytes_view(t):
    t = t.contiguous()
    if t.dtype == torch.bool:
        return (t.view(torch.uint8) != 0).to(torch.uint8).reshape(-1)
    return t.reshape(-1).view(torch.uint8)


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(nbytes_view(a), nbytes_view(b))


def reduce_ref(ts, op, name):
    """The reduction of ts (rank order) computed here, wide, then cast."""
    dt = ts[0].dtype
    if name == "bool":
        x = torch.stack([t.to(torch.int64) for t in ts])
        if op in ("SUM", "MAX", "BOR"):
            r = x.amax(0)
        elif op in ("PRODUCT", "MIN", "BAND"):
            r = x.amin(0)
        else:
            r = x.sum(0) % 2
        return r.bool()
    if name in COMPLEX:
        x = torch.stack([t.to(torch.complex128) for t in ts])
    elif name in FLOATS:
        x = torch.stack([t.double() for t in ts])
    else:
        x = torch.stack([t.to(torch.int64) for t in ts])
    if op in ("SUM", "AVG"):
        r = x.sum(0)
        if op == "AVG":
            r = r / len(ts)
    elif op == "PRODUCT":
        r = x.prod(0)
    elif op == "MIN":
        r = x.amin(0)
    elif op == "MAX":
        r = x.amax(0)
    else:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        r = x[0]
        for y in x[1:]:
            r = fn(r, y)
    return r.to(dt)


def applies(op, name):
    if op == "AVG":
        return name in FLOATS or name in COMPLEX
    if op in ("BAND", "BOR", "BXOR"):
        return name not in FLOATS and name not in COMPLEX
    if op in ("MIN", "MAX", "PRODUCT"):
        return name not in COMPLEX
    return True


def strided(t):
    """A non-contiguous tensor with t's values."""
    big = torch.zeros((2,) + tuple(t.shape), dtype=t.dtype)
    big[1] = t
    return big.transpose(0, 1)[:, 1] if t.dim() else big[1]


def checker():
    st = {"fails": [], "gloo": []}
    def check(key, mine, want, theirs=None):
        if not same(mine, want):
            st["fails"].append(f"{key}: got {mine.tolist()} want {want.tolist()}")
        if theirs is not None:
            st["gloo"].append(key)
            if not same(mine, theirs):
                st["fails"].append(f"{key}: got {mine.tolist()}, gloo {theirs.tolist()}")
    return st, check


def on_gloo(fn):
    """fn() on torch's gloo; None when gloo refuses the dtype or op."""
    try:
        return fn()
    except (RuntimeError, ValueError, TypeError) as e:
        return None


def job_all_reduce(kind, op, noncontig=False, async_op=False, shape=(3, 5), coalesced=False,
                   dtypes=DT):
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    r, W = members.index(RANK), len(members)
    st, check = checker()
    for name in dtypes:
        if not applies(op, name):
            continue
        ins = [make(name, shape, q, "ar" + op) for q in range(W)]
        want = reduce_ref(ins, op, name)
        t = strided(ins[r]) if noncontig else ins[r].clone()
        if coalesced:
            u = ins[r].clone()
            dist.all_reduce_coalesced([t, u], op=getattr(R, op), group=m)
            check(f"{name} coalesced second", u, want)
        else:
            w = dist.all_reduce(t, op=getattr(R, op), group=m, async_op=async_op)
            if async_op:
                w.wait()
        if name in COMPLEX or op == "AVG":
            theirs = None
        else:
            def theirs_call(x=ins[r].clone()):
                dist.all_reduce(x, op=getattr(R, op), group=g)
                return x
            theirs = on_gloo(theirs_call)
        check(name, t, want, theirs)
    return st


def job_reduced_again(kind, call="all_reduce"):
    """NOTE [ Memory reduced again and again ]: three all-reduces (or
    reduces to the last member, or all_to_all_singles, all_gather_into_
    tensors or reduce_scatter_tensors of it as the input) of a large tensor
    of each sort; its address after each, and whether it
    then lies in a group buffer.  "fresh" is a new tensor at each call, the
    last one freed first (so malloc may put it where that one lay)."""
    if GROUPS[kind] is None:
        return "skip"
    import gc
    import numpy as np
    m, g, members = GROUPS[kind]
    W = len(members)
    n = _buffers.BUFFER_MIN // 4 + 3
    cut = 5
    if call == "all_to_all":   # rows of 4 that split over the ranks, in "view" too
        n, cut = n + -n % (4 * W), 4 * W
    elif call == "reduce_scatter":   # a slice per rank, in "view" too
        n, cut = n + -n % W, W
    moves = call in ("all_to_all", "all_gather", "reduce_scatter")   # the input only
    st, check = checker()
    own = torch.empty(n)
    arr = np.zeros(n, dtype=np.float32)
    tensors = {"own": own, "view": own[cut:], "numpy": torch.from_numpy(arr),
               "shared": torch.empty(n).share_memory_(), "fresh": None}
    # rank 0's tensor over numpy stays where it is while the others' move:
    # the core must then copy between the ranks' memory, with the same result
    mixed = tensors["numpy"] if RANK == 0 else torch.empty(n)
    me = members.index(RANK)
    out = {}
    for sort, t in list(tensors.items()) + [("mixed", mixed)]:
        head = t[:7] if t is not None else None     # a view made before any move
        trail = []
        for i in range(3):
            if sort == "fresh":
                t = res = w = None
                t = torch.empty(n)
            ins = [make("float32", (t.numel(),), q, f"again{sort}{i}") for q in range(W)]
            t.copy_(ins[me])
            if call == "all_to_all":
                res = torch.empty_like(t)
                w = dist.all_to_all_single(res.view(-1, 4), t.view(-1, 4), group=m,
                                           async_op=i == 2)
                want = torch.cat([x.view(W, -1)[me] for x in ins])
            elif call == "all_gather":
                res = torch.empty(W * t.numel())
                w = dist.all_gather_into_tensor(res, t, group=m, async_op=i == 2)
                want = torch.cat(ins)
            elif call == "reduce_scatter":
                res = torch.empty(t.numel() // W)
                w = dist.reduce_scatter_tensor(res, t, group=m, async_op=i == 2)
                want = reduce_ref(ins, "SUM", "float32").view(W, -1)[me]
            elif call == "reduce":
                res = t
                w = dist.reduce(t, dst=members[-1], group=m, async_op=i == 2)
                want = reduce_ref(ins, "SUM", "float32") if RANK == members[-1] else ins[me]
            else:
                res = t
                w = dist.all_reduce(t, group=m, async_op=i == 2)
                want = reduce_ref(ins, "SUM", "float32")
            if i == 2:
                w.wait()
            check(f"{sort} call {i}", res, want)
            if head is not None:   # a mover's input stays as it was
                check(f"{sort} call {i}, a view made before", head,
                      (ins[me] if moves else want)[:7])
            a = t.untyped_storage().data_ptr()
            trail.append([a, a in _buffers._held])
        out[sort] = trail
    check("numpy array", torch.from_numpy(arr), tensors["numpy"])
    out["shared_after"] = tensors["shared"].is_shared()
    addr = own.untyped_storage().data_ptr()
    del own, head, t, tensors, mixed
    gc.collect()
    out["freed"] = addr not in _buffers._held
    out.update(st)
    return out


def job_many_reduced_in_turn(kind, many=80):
    """NOTE [ Memory reduced again and again ]: `many` large tensors
    all-reduced in turn, three rounds: which lie in group buffers after
    each round, and the sums."""
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    W, me = len(members), members.index(RANK)
    n = _buffers.BUFFER_MIN // 4 + 3
    st, check = checker()
    ts = [torch.empty(n) for _ in range(many)]
    held = []
    for rnd in range(3):
        for i, t in enumerate(ts):
            t.fill_(float(me + 1 + i))
            dist.all_reduce(t, group=m)
            check(f"tensor {i}, round {rnd}", t[::4099], torch.full_like(t[::4099], float(
                sum(q + 1 + i for q in range(W)))))
        held.append(sum(t.untyped_storage().data_ptr() in _buffers._held for t in ts))
    st["held"] = held
    return st


def job_all_to_all_in_place(kind):
    """all_to_all_single with the output the input itself, small and
    large, three times each (the peers read the input while this rank
    writes): the pieces as gloo's would be if gloo got them right."""
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    W, me = len(members), members.index(RANK)
    st, check = checker()
    for n in (8 * W, (_buffers.BUFFER_MIN // 4 // W + 5) * W):
        for i in range(3):
            ins = [make("float32", (n,), q, f"inplace{n}{i}") for q in range(W)]
            t = ins[me].clone()
            w = dist.all_to_all_single(t, t, group=m, async_op=i == 2)
            if i == 2:
                w.wait()
            check(f"{n} elements, call {i}", t, torch.cat([x.view(W, -1)[me] for x in ins]))
    return st


def job_reduce(kind, op):
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    r, W = members.index(RANK), len(members)
    st, check = checker()
    for root in range(W):
        for name in DT:
            if not applies(op, name):
                continue
            ins = [make(name, (4,), q, "red" + op + str(root)) for q in range(W)]
            want = reduce_ref(ins, op, name) if r == root else ins[r]
            t = ins[r].clone()
            dist.reduce(t, dst=members[root], op=getattr(R, op), group=m)
            theirs = None
            if op != "AVG" and name not in COMPLEX and r == root:   # gloo's others: scratch
                x = ins[r].clone()
                theirs = on_gloo(lambda: (dist.reduce(x, dst=members[root], op=getattr(R, op),
                                                      group=g), x)[1])
            elif op != "AVG" and name not in COMPLEX:
                on_gloo(lambda: dist.reduce(ins[r].clone(), dst=members[root],
                                            op=getattr(R, op), group=g))
            check(f"{name} root {root}", t, want, theirs)
    return st


def job_reduce_scatter(kind, op, form):
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    r, W = members.index(RANK), len(members)
    st, check = checker()
    for name in DT:
        if not applies(op, name):
            continue
        ins = [make(name, (W * 3,), q, "rs" + op) for q in range(W)]
        want = reduce_ref([x[r * 3:(r + 1) * 3] for x in ins], op, name)
        out = torch.zeros(3, dtype=ins[0].dtype)
        def call(group, o):
            if form == "tensor":
                dist.reduce_scatter_tensor(o, ins[r].clone(), op=getattr(R, op), group=group)
            else:
                dist.reduce_scatter(o, list(ins[r].clone().split(3)), op=getattr(R, op),
                                    group=group)
            return o
        call(m, out)
        theirs = None
        if op != "AVG" and name not in COMPLEX:
            theirs = on_gloo(lambda: call(g, torch.zeros(3, dtype=ins[0].dtype)))
        check(name, out, want, theirs)
    return st


def job_movers(kind, what, noncontig=False, dtypes=DT):
    """Collectives that move bytes: every dtype, every root."""
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    r, W = members.index(RANK), len(members)
    st, check = checker()
    for name in dtypes:
        dt = getattr(torch, name)
        ins = [make(name, (2, 3), q, what) for q in range(W)]
        mine = lambda: strided(ins[r]) if noncontig else ins[r].clone()
        if what == "broadcast":
            for root in range(W):
                def call(group):
                    t = mine()
                    dist.broadcast(t, src=members[root], group=group)
                    return t
                check(f"{name} root {root}", call(m), ins[root], on_gloo(lambda: call(g)))
        elif what == "all_gather":
            def call(group):
                outs = [torch.zeros(2, 3, dtype=dt) for _ in range(W)]
                dist.all_gather(outs, mine(), group=group)
                return torch.stack(outs)
            check(name, call(m), torch.stack(ins), on_gloo(lambda: call(g)))
        elif what == "all_gather_into_tensor":
            def call(group):
                out = torch.zeros(3, W * 2, dtype=dt).t() if noncontig else \
                    torch.zeros(W * 2, 3, dtype=dt)
                dist.all_gather_into_tensor(out, mine(), group=group)
                return out
            check(name, call(m), torch.cat(ins), on_gloo(lambda: call(g)))
        elif what == "gather":
            for root in range(W):
                def call(group):
                    outs = [torch.zeros(2, 3, dtype=dt) for _ in range(W)] if r == root else None
                    dist.gather(mine(), outs, dst=members[root], group=group)
                    return torch.stack(outs) if outs is not None else torch.zeros(1)
                want = torch.stack(ins) if r == root else torch.zeros(1)
                check(f"{name} root {root}", call(m), want, on_gloo(lambda: call(g)))
        elif what == "scatter":
            for root in range(W):
                parts = [make(name, (2, 3), q, f"sc{root}") for q in range(W)]
                def call(group):
                    out = torch.zeros(2, 3, dtype=dt)
                    o = strided(out) if noncontig else out
                    dist.scatter(o, [p.clone() for p in parts] if r == root else None,
                                 src=members[root], group=group)
                    return o
                check(f"{name} root {root}", call(m), parts[r], on_gloo(lambda: call(g)))
        elif what == "all_to_all_single":
            def call(group):
                out = torch.zeros(W * 2, 3, dtype=dt)
                dist.all_to_all_single(out, torch.cat([x for x in ins[r].repeat(W, 1).split(2)]),
                                       group=group)
                return out
            want = torch.cat([ins[q] for q in range(W)])
            check(f"{name} even", call(m), want, on_gloo(lambda: call(g)))
            f = lambda i, j: (i + 2 * j) % 3 + 1      # rows rank i sends to rank j
            src = make(name, (sum(f(r, j) for j in range(W)), 3), r, "a2av")
            srcs = [make(name, (sum(f(i, j) for j in range(W)), 3), i, "a2av") for i in range(W)]
            def call(group):
                out = torch.zeros(sum(f(i, r) for i in range(W)), 3, dtype=dt)
                dist.all_to_all_single(out, src.clone(), [f(i, r) for i in range(W)],
                                       [f(r, j) for j in range(W)], group=group)
                return out
            want = torch.cat([srcs[i][sum(f(i, k) for k in range(r)):][:f(i, r)] for i in range(W)])
            check(f"{name} uneven", call(m), want, on_gloo(lambda: call(g)))
        elif what == "all_to_all":
            f = lambda i, j: (i + j) % 2 + 1
            def call(group):
                outs = [torch.zeros(f(i, r), 3, dtype=dt) for i in range(W)]
                dist.all_to_all(outs, [make(name, (f(r, j), 3), r, f"a2a{j}") for j in range(W)],
                                group=group)
                return torch.cat(outs)
            want = torch.cat([make(name, (f(i, r), 3), i, f"a2a{r}") for i in range(W)])
            check(name, call(m), want, on_gloo(lambda: call(g)))
        elif what == "send_recv":
            # a ring: send to the next rank, receive from the previous one (or from any)
            nxt, prv = members[(r + 1) % W], members[(r - 1) % W]
            for anysrc in (False, True):
                def call(group):
                    out = torch.zeros(2, 3, dtype=dt)
                    s = dist.isend(mine(), nxt, group=group)
                    if anysrc:
                        w = dist.irecv(out, group=group)
                        w.wait()
                        got = w._source_rank() if hasattr(w, "_source_rank") else None
                    else:
                        dist.recv(out, prv, group=group)
                    s.wait()
                    return out
                check(f"{name} any={anysrc}", call(m), ins[(r - 1) % W], on_gloo(lambda: call(g)))
        elif what == "batch_isend_irecv":
            nxt, prv = members[(r + 1) % W], members[(r - 1) % W]
            def call(group):
                out = torch.zeros(2, 3, dtype=dt)
                ops = [dist.P2POp(dist.isend, mine(), nxt, group),
                       dist.P2POp(dist.irecv, out, prv, group)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                return out
            check(name, call(m), ins[(r - 1) % W], on_gloo(lambda: call(g)))
        elif what == "irecv_first_large" and name == "float32":
            # every rank posts its receive before its send, each larger than a
            # mailbox, so a send must not wait behind the receive (NOTE [ Lanes ])
            nxt, prv = members[(r + 1) % W], members[(r - 1) % W]
            big = lambda q: torch.arange(1 << 21, dtype=dt) * (q + 1)
            def call(group):
                outs = [torch.zeros(1 << 21, dtype=dt) for _ in range(2)]
                ops = [dist.P2POp(dist.irecv, outs[0], prv, group),
                       dist.P2POp(dist.isend, big(r), nxt, group)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                rw = dist.irecv(outs[1], prv, group=group)
                sw = dist.isend(big(r), nxt, group=group)
                rw.wait()
                sw.wait()
                return torch.stack(outs)
            check(name, call(m), torch.stack([big((r - 1) % W)] * 2), on_gloo(lambda: call(g)))
    return st


@contextlib.contextmanager
def torch_refused():
    """Each of torch's functions behind a fast path (_fastpath._TORCH)
    replaced by one that raises "torch's NAME reached"."""
    from mpcore.dist import _fastpath
    saved = dict(_fastpath._TORCH)

    def refuse(name):
        def fn(*a, **k):
            raise RuntimeError(f"torch's {name} reached")
        return fn
    for name in saved:
        _fastpath._TORCH[name] = refuse(name)
    try:
        yield
    finally:
        _fastpath._TORCH.update(saved)


def job_fastpath(kind):
    """NOTE [ A fast path for torch's module functions ]: which calls take
    it (torch's own function, replaced by one that raises, must not be
    reached) and which go to torch's function; receives keep their order
    behind a pending irecv; a send larger than the mailbox; torch's errors
    for wrong arguments."""
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    r, W = members.index(RANK), len(members)
    peer = members[(r + 1) % W] if W == 2 else None
    out = {"installed": all(getattr(getattr(dist, n), "_mpcore_fast", False)
                            for n in ("send", "recv", "broadcast", "gather", "scatter",
                                      "all_to_all_single"))}
    fast, slow = [], []
    with torch_refused():
        x = torch.arange(6.0).reshape(2, 3) + 10 * r
        outs = [torch.zeros(2, 3) for _ in range(W)] if r == 0 else None
        dist.gather(x, outs, dst=members[0], group=m)
        fast.append(("gather", outs is None or torch.equal(torch.stack(outs), torch.stack(
            [torch.arange(6.0).reshape(2, 3) + 10 * q for q in range(W)]))))
        o = torch.zeros(2, 3)
        dist.scatter(o, [x + q for q in range(W)] if r == 0 else None, src=members[0], group=m)
        fast.append(("scatter", torch.equal(o, torch.arange(6.0).reshape(2, 3) + r)))
        b = torch.full((5,), float(r), dtype=torch.float64)
        dist.broadcast(b, src=members[-1], group=m)
        fast.append(("broadcast", b.tolist() == [float(W - 1)] * 5))
        a = torch.zeros(W * 2)
        dist.all_to_all_single(a, torch.full((W * 2,), float(r)), group=m)
        fast.append(("all_to_all_single", a.tolist() == [float(q) for q in range(W) for _ in "ab"]))
        if peer is not None:
            y = torch.full((4,), float(r))
            if r == 0:
                dist.send(y, peer, group=m)
                got = dist.recv(y, peer, group=m)
            else:
                got = dist.recv(y, peer, group=m)
                dist.send(y + 1, peer, group=m)
            fast.append(("send/recv", got == peer and y.tolist() == [float(1 - r)] * 4))
        outs2 = [torch.zeros(2, 3) for _ in range(W)] if r == 0 else None
        w = dist.gather(x, outs2, dst=members[0], group=m, async_op=True)
        fast.append(("async gather", isinstance(w, dist.Work) and w.wait() is True and (
            outs2 is None or all(torch.equal(a, b) for a, b in zip(outs, outs2)))))
        for what, call in (("broadcast by group_src", lambda: dist.broadcast(
                               x, group_src=0, group=m)),
                           ("gather by group_dst", lambda: dist.gather(
                               x, outs, group_dst=0, group=m)),
                           ("non-contiguous scatter", lambda: dist.scatter(
                               torch.zeros(3, 2).t(), None, src=members[-1], group=m)),
                           ("recv from any rank", lambda: dist.recv(torch.zeros(1), group=m))):
            try:
                call()
                slow.append((what, "served"))
            except RuntimeError as e:
                slow.append((what, str(e)))
    out["fast"], out["slow"] = fast, slow
    if peer is not None:
        # receives stay in order behind a pending irecv; a large send waits
        big = torch.arange(1 << 20, dtype=torch.float32)
        if r == 0:
            dist.send(torch.ones(3), peer, group=m)
            dist.send(torch.full((3,), 2.0), peer, group=m)
            dist.send(big, peer, group=m)
            out["order"] = True
        else:
            first, second, b = torch.zeros(3), torch.zeros(3), torch.zeros(1 << 20)
            w = dist.irecv(first, peer, group=m)
            dist.recv(second, peer, group=m)
            w.wait()
            dist.recv(b, peer, group=m)
            out["order"] = first.tolist() == [1.0] * 3 and second.tolist() == [2.0] * 3 \
                and torch.equal(b, big)
    errs = {}
    for what, call in (("gather list off the root", lambda: r != W - 1 and dist.gather(
                            torch.zeros(2), [torch.zeros(2)] * W, dst=members[-1], group=m)),
                       ("send to a rank outside", lambda: dist.send(torch.zeros(2), 10 ** 6,
                                                                   group=m))):
        try:
            call()
            errs[what] = None
        except (ValueError, RuntimeError) as e:
            errs[what] = f"{type(e).__name__}: {e}"
    out["errors"] = errs
    dist.barrier(group=m)
    return out


FAST_COLLECTIVES = ("all_reduce", "barrier", "all_gather", "all_gather_into_tensor",
                    "reduce_scatter_tensor", "reduce_scatter", "all_to_all")


def fast_collective_calls(r, W):
    """name -> call(group, async_op): one collective on this rank's inputs
    (the same on every run), returning (what the call returned, its
    outputs).  Every rank can rebuild every rank's inputs from r."""
    def mine(q, dtype=torch.float32):
        return (torch.arange(6, dtype=dtype).reshape(2, 3) + 10 * q + 1).to(dtype)

    def all_reduce(op, dtype):
        def call(grp, async_op):
            t = mine(r, dtype)
            return dist.all_reduce(t, op, group=grp, async_op=async_op), [t]
        return call

    def all_gather(end_to_end):
        def call(grp, async_op):
            outs = (list(torch.zeros(W, 2, 3).unbind(0)) if end_to_end
                    else [torch.zeros(2, 3) for _ in range(W)])
            return dist.all_gather(outs, mine(r), group=grp, async_op=async_op), outs
        return call

    def gather_into(fn):
        def call(grp, async_op):
            out = torch.zeros(W * 2, 3)
            return fn(out, mine(r), group=grp, async_op=async_op), [out]
        return call

    def scatter_from(fn, op=R.SUM):
        def call(grp, async_op):
            out = torch.zeros(2, 3)
            inp = torch.cat([mine(r) * (q + 1) for q in range(W)])
            return fn(out, inp, op, group=grp, async_op=async_op), [out]
        return call

    def reduce_scatter(end_to_end):
        def call(grp, async_op):
            out = torch.zeros(2, 3)
            ins = [mine(r) * (q + 1) for q in range(W)]
            if end_to_end:
                ins = list(torch.stack(ins).unbind(0))
            return dist.reduce_scatter(out, ins, group=grp, async_op=async_op), [out]
        return call

    def all_to_all(end_to_end):
        def call(grp, async_op):
            ins = [mine(r) * (q + 1) for q in range(W)]
            outs = [torch.zeros(2, 3) for _ in range(W)]
            if end_to_end:
                ins = list(torch.stack(ins).unbind(0))
                outs = list(torch.zeros(W, 2, 3).unbind(0))
            return dist.all_to_all(outs, ins, group=grp, async_op=async_op), outs
        return call

    calls = {"all_reduce sum float32": all_reduce(R.SUM, torch.float32),
             "all_reduce max int64": all_reduce(R.MAX, torch.int64),
             "all_reduce product float64": all_reduce(R.PRODUCT, torch.float64),
             "all_reduce bxor int32": all_reduce(R.BXOR, torch.int32),
             "barrier": lambda grp, async_op: (dist.barrier(group=grp, async_op=async_op), []),
             "all_gather": all_gather(False),
             "all_gather end to end": all_gather(True),
             "all_gather_into_tensor": gather_into(dist.all_gather_into_tensor),
             "reduce_scatter_tensor": scatter_from(dist.reduce_scatter_tensor),
             "reduce_scatter_tensor min": scatter_from(dist.reduce_scatter_tensor, R.MIN),
             "reduce_scatter": reduce_scatter(False),
             "reduce_scatter end to end": reduce_scatter(True),
             "all_to_all": all_to_all(False),
             "all_to_all end to end": all_to_all(True)}
    if hasattr(dist, "all_gather_single"):
        calls["all_gather_single"] = gather_into(dist.all_gather_single)
        calls["reduce_scatter_single"] = scatter_from(dist.reduce_scatter_single)
    return calls, mine


def job_fastpath_collectives(kind):
    """NOTE [ The rest of torch's collectives ] in _fastpath.py: each call,
    blocking and async, is served without torch's function (replaced by
    one that raises) and gives gloo's results and return types; observed
    (a dispatch mode, a torch-function mode, the profiler) it reaches
    torch's function; wrong arguments raise what torch's function raises."""
    import re
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.overrides import TorchFunctionMode
    from mpcore.dist import _fastpath
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    r, W = members.index(RANK), len(members)
    names = FAST_COLLECTIVES + (("all_gather_single", "reduce_scatter_single")
                                if hasattr(dist, "all_gather_single") else ())
    # a deprecated alias stays torch's: it calls the name it stands for, which has one
    out = {"installed": {n: getattr(getattr(dist, n), "_mpcore_fast", False)
                         or getattr(getattr(dist, n), "__deprecated__", None) is not None
                         for n in names}}
    calls, mine = fast_collective_calls(r, W)

    def form(ret):
        return "None" if ret is None else "Work" if isinstance(ret, dist.Work) else repr(ret)

    def run(call, grp, async_op):
        ret, outs = call(grp, async_op)
        waited = ret.wait() if async_op else None
        return [form(ret), waited, [(str(t.dtype), t.tolist()) for t in outs]]

    # the reference: gloo's, or for the list all_to_all (which gloo lacks) by hand
    want = {}
    for name, call in calls.items():
        for async_op in (False, True):
            if name.startswith("all_to_all"):
                ret = "Work" if async_op else "None"
                want[name, async_op] = [ret, True if async_op else None,
                                        [("torch.float32", (mine(q) * (r + 1)).tolist())
                                         for q in range(W)]]
            else:
                want[name, async_op] = run(call, g, async_op)
    got, observed = {}, {}

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class SeenFn(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with torch_refused():
        for name, call in calls.items():
            for async_op in (False, True):
                try:
                    got[name, async_op] = run(call, m, async_op)
                except RuntimeError as e:
                    got[name, async_op] = str(e)
        for how, ctx in (("dispatch mode", Seen), ("function mode", SeenFn),
                         ("profiler", torch.autograd.profiler.profile)):
            for name, call in calls.items():
                if how == "function mode" and name == "barrier":
                    continue     # torch's barrier takes no tensor: no mode sees it there
                try:
                    with ctx():
                        call(m, False)
                    observed[how, name] = "served"
                except RuntimeError as e:
                    observed[how, name] = str(e)
    out["same"] = {f"{n} async={a}": got[n, a] == want[n, a] or [got[n, a], want[n, a]]
                   for n, a in want}
    out["observed"] = {f"{h}: {n}": v for (h, n), v in observed.items()}
    # wrong arguments: what the fast path raises is what torch's function raises
    t = mine(r)
    wrong = {
        "all_reduce of a list": lambda f: f["all_reduce"]([t], group=m),
        "all_reduce PREMUL_SUM": lambda f: f["all_reduce"](
            t, dist._make_nccl_premul_sum(2.0), group=m),
        "all_gather one output short": lambda f: f["all_gather"](
            [torch.zeros(2, 3) for _ in range(W - 1)], t, group=m),
        "all_gather outputs of another dtype": lambda f: f["all_gather"](
            [torch.zeros(2, 3, dtype=torch.float64) for _ in range(W)], t, group=m),
        "all_gather_into_tensor too small": lambda f: f["all_gather_into_tensor"](
            torch.zeros(1), t, group=m),
        "reduce_scatter_tensor too small": lambda f: f["reduce_scatter_tensor"](
            torch.zeros(2, 3), torch.zeros(1), group=m),
        "reduce_scatter inputs short": lambda f: f["reduce_scatter"](
            torch.zeros(2, 3), [t] * (W + 1), group=m),
        "all_to_all outputs short": lambda f: f["all_to_all"](
            [torch.zeros(2, 3)], [t] * W, group=m),
        "barrier timeout in seconds": lambda f: f["barrier"](group=m, timeout=5),
    }
    torch_fns = {n: _fastpath._TORCH.get(n, getattr(dist, n)) for n in FAST_COLLECTIVES}
    dist_fns = {n: getattr(dist, n) for n in FAST_COLLECTIVES}
    errs = {}
    for what, call in wrong.items():
        said = []
        for fns in (dist_fns, torch_fns):
            try:
                call(fns)
                said.append(None)
            except Exception as e:   # an object's address differs from call to call
                said.append(re.sub(" at 0x[0-9a-f]+", "", f"{type(e).__name__}: {e}"))
        errs[what] = said
    out["errors"] = errs
    dist.barrier(group=m)
    return out


def job_fastpath_async_order():
    """NOTE [ Asynchronous calls on the fast path ]: rank 0 posts an async
    all_reduce and then a send larger than a mailbox; rank 1 receives
    first and then all-reduces.  Run at once on rank 0's thread, the
    all_reduce would wait for rank 1, which waits for the send: a timeout.
    Each call is also checked to have been served by the fast path."""
    from mpcore.dist import _fastpath
    sub = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20 * SLOW))
    res = {}
    if RANK in (0, 1):
        big = torch.arange(1 << 20, dtype=torch.float32)
        t = torch.full((4,), float(RANK + 1))
        try:
            if RANK == 0:
                with torch_refused():     # the all_reduce is the fast path's
                    w = dist.all_reduce(t, group=sub, async_op=True)
                res["work"] = isinstance(w, dist.Work)
                dist.send(big, 1, group=sub)     # larger than a mailbox: waits for rank 1
                w.wait()
            else:
                got = torch.zeros(1 << 20)
                dist.recv(got, 0, group=sub)
                res["received"] = torch.equal(got, big)
                with torch_refused():
                    dist.all_reduce(t, group=sub)
            res["sum"] = t.tolist()
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    dist.destroy_process_group(sub)
    return res


def job_fastpath_timeout():
    """Only rank 0 comes to a collective of a fresh group of the world,
    through the fast path and through torch's function: the same error."""
    from mpcore.dist import _fastpath
    res = {}
    short = datetime.timedelta(seconds=0.5)
    for name in ("all_reduce", "all_gather_into_tensor", "barrier"):
        for path in ("fast", "torch", "async"):
            sub = dist.new_group(list(range(WORLD)), timeout=short)
            if RANK == 0:
                fn = _fastpath._TORCH.get(name, getattr(dist, name)) if path == "torch" \
                    else getattr(dist, name)
                args = {"all_reduce": (torch.ones(4),),
                        "all_gather_into_tensor": (torch.zeros(4 * WORLD), torch.ones(4)),
                        "barrier": ()}[name]
                try:
                    if path == "async":
                        fn(*args, group=sub, async_op=True).wait()
                    else:
                        fn(*args, group=sub)
                    res[f"{name} {path}"] = "no error"
                except Exception as e:
                    res[f"{name} {path}"] = f"{type(e).__name__}: {e}"
            dist.barrier()
            dist.destroy_process_group(sub)
    return res


def job_funcol_fast(kind):
    """NOTE [ A fast path for the functional collectives ]: the calls it
    serves (torch's functions, replaced by ones that raise, must not be
    reached) give gloo's results, as AsyncCollectiveTensors as torch's
    eager path does, and leave the input alone; the rest reach torch's
    function."""
    if GROUPS[kind] is None:
        return "skip"
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import DeviceMesh
    m, g, members = GROUPS[kind]
    r, W = members.index(RANK), len(members)
    mesh = DeviceMesh.from_group(m, "cpu")
    names = ("all_reduce", "all_gather_single", "reduce_scatter_single")
    out = {"installed": all(getattr(getattr(fc, n), "_mpcore_fast", False) for n in names)}
    x = torch.arange(2.0 * W * 3).reshape(2 * W, 3) + 10 * r
    i = torch.arange(2 * W, dtype=torch.int32) * (r + 3)
    # gloo's answers, from torch's own functions on the twin gloo group
    want = {f"all_reduce {op}": fc.all_reduce(x, op, g).wait()
            for op in ("sum", "product", "min", "max")}
    want["all_reduce avg"] = fc.all_reduce(x, "sum", g).wait() / W
    want["all_reduce bxor int32"] = fc.all_reduce(i, "bxor", g).wait()
    want["all_gather_single"] = fc.all_gather_single(x, 0, g).wait()
    want["all_gather_tensor"] = want["all_gather_single"]
    want["reduce_scatter_single"] = fc.reduce_scatter_single(x, "sum", 0, g).wait()
    got, forms, slow = {}, {}, []
    with torch_refused():
        before = x.clone()
        for op in ("sum", "product", "min", "max", "avg"):
            got[f"all_reduce {op}"] = fc.all_reduce(x, op.upper() if op == "max" else op, m)
        got["all_reduce bxor int32"] = fc.all_reduce(i, "bxor", m)
        got["all_gather_single"] = fc.all_gather_single(x, 0, m)
        got["all_gather_tensor"] = fc.all_gather_tensor(x, 0, m)
        got["reduce_scatter_single"] = fc.reduce_scatter_single(x, "sum", 0, m)
        for form, grp in (("mesh", mesh), ("(mesh, 0)", (mesh, 0)), ("name", m.group_name)):
            forms[form] = torch.equal(fc.wait_tensor(fc.all_reduce(x, "sum", grp)),
                                      want["all_reduce sum"])
        out["input kept"] = torch.equal(x, before)
        out["types"] = sorted({type(v).__name__ for v in got.values()})
        for what, call in (("requires grad", lambda: fc.all_reduce(
                                x.clone().requires_grad_(), "sum", m)),
                           ("non-contiguous", lambda: fc.all_reduce(x.t(), "sum", m)),
                           ("gather_dim 1", lambda: fc.all_gather_single(x, 1, m)),
                           ("scatter_dim 1", lambda: fc.reduce_scatter_single(
                               x.t().contiguous(), "sum", 1, m)),
                           ("bxor on floats", lambda: fc.all_reduce(x, "bxor", m)),
                           ("ranks as a list", lambda: fc.all_reduce(x, "sum", members))):
            try:
                call()
                slow.append((what, "served"))
            except RuntimeError as e:
                slow.append((what, str(e)))
    out["same"] = {k: torch.equal(got[k], want[k]) for k in want}
    out["forms"], out["slow"] = forms, slow
    # after the group's calls in flight
    y = torch.full((4,), float(r + 1))
    w = dist.all_reduce(y, group=m, async_op=True)
    z = fc.all_reduce(y, "sum", m)
    w.wait()
    out["ordered"] = z.tolist() == [float(W * (W + 1) // 2 * W)] * 4
    return out


def job_objects(kind):
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    r, W = members.index(RANK), len(members)
    res = {}
    for key, group in (("mpcore", m), ("gloo", g)):
        objs = [None] * W
        dist.all_gather_object(objs, {"rank": RANK, "x": [RANK] * (RANK + 1)}, group=group)
        lst = [f"from {members[0]}", None] if r == 0 else [None, None]
        dist.broadcast_object_list(lst, src=members[0], group=group)
        res[key] = [objs, lst]
    return res


def job_mismatch(kind):
    """Ranks that ask for different calls: an error on every rank."""
    m, g, members = GROUPS[kind]
    r = members.index(RANK)
    out = {}
    for case in ("size", "op", "kind"):
        try:
            if case == "size":
                dist.all_reduce(torch.ones(4 + r), group=m)
            elif case == "op":
                dist.all_reduce(torch.ones(4), op=R.SUM if r == 0 else R.MAX, group=m)
            elif r == 0:
                dist.all_reduce(torch.ones(4), group=m)
            else:
                dist.broadcast(torch.ones(4), src=members[0], group=m)
            out[case] = "no error"
        except Exception as e:
            out[case] = f"{type(e).__name__}: {e}"
    t = torch.ones(3)
    dist.all_reduce(t, group=m)          # the group still serves
    out["after"] = t.tolist()
    return out


def _region_maps():
    with open("/proc/self/maps") as f:
        return sum(1 for l in f if "memfd:mpcore" in l)


def job_destroy():
    before = _region_maps()
    sub = dist.new_group(list(range(WORLD)))
    t = torch.ones(2)
    dist.all_reduce(t, group=sub)
    made = _region_maps()
    dist.destroy_process_group(sub)
    after = _region_maps()
    used = []
    for call in (lambda: dist.all_reduce(torch.ones(2), group=sub),    # torch refuses it
                 lambda: sub.allreduce([torch.ones(2)])):                # the group itself
        try:
            call()
            used.append("no error")
        except Exception as e:
            used.append(f"{type(e).__name__}: {e}")
    return {"before": before, "made": made, "after": after, "sum": t.tolist(), "used": used}


def job_split():
    """NOTE [ Splitting a group ]: a split of a subgroup (group ranks, in
    any order), a rank in no split, splits torch would take and ones it
    should not, a group of torch's gloo as the parent, and destroying a
    split."""
    out = {"errors": {}}
    sub = GROUPS["new_subgroups"][0]
    before = _region_maps()
    h = dist.split_group(sub, [[1, 0]])
    t = torch.tensor([float(RANK)])
    dist.all_reduce(t, group=h)
    made = _region_maps()
    out["of_sub"] = [type(h).__name__, dist.get_process_group_ranks(h), t.item()]
    dist.destroy_process_group(h)
    out["regions"] = [before, made, _region_maps()]
    only = dist.split_group(split_ranks=[[0]])
    out["only0"] = None if only is None else dist.get_process_group_ranks(only)
    for name, splits in (("shared", [[0, 1], [1]]), ("outside", [[0, WORLD]]),
                         ("duplicate", [[0, 0]]), ("empty", [])):
        try:
            dist.split_group(split_ranks=splits)
            out["errors"][name] = "no error"
        except Exception as e:
            out["errors"][name] = f"{type(e).__name__}: {e}"
    with real_gloo():
        g = dist.new_group(backend="gloo")
    try:
        dist.split_group(g, [[0, 1]])
        out["gloo_parent"] = "no error"
    except Exception as e:
        out["gloo_parent"] = f"{type(e).__name__}: {e}"
    return out


def job_work(stage):
    m = c10d._get_default_group()
    if stage == "async":
        t = torch.full((4,), float(RANK + 1))
        w = dist.all_reduce(t, async_op=True)
        fut = w.get_future()
        ok = w.wait()
        val = fut.wait()
        later = dist.all_reduce(torch.ones(2), async_op=True)   # queued after
        b = torch.ones(2)
        dist.all_reduce(b)                                      # runs after `later`
        # a small call nobody waits for still runs (its lane's thread takes it)
        idle = dist.all_reduce(torch.ones(2), async_op=True)
        ran = threading.Event()
        idle.get_future().then(lambda f: ran.set())
        return {"wait": ok, "done": w.is_completed(), "exc": w.exception() is None,
                "sum": t.tolist(), "fut": [x.tolist() for x in val],
                "later_done": later.is_completed(), "b": b.tolist(),
                "unwaited_ran": ran.wait(30 * SLOW) and idle.is_completed(),
                "isinstance": isinstance(w, dist.Work)}
    if stage == "early":     # only rank 0 runs this first: its wait(timeout) times out
        t = torch.ones(3)
        w = dist.all_reduce(t, async_op=True)
        t0 = time.monotonic()
        try:
            w.wait(datetime.timedelta(milliseconds=200))
            r = "no timeout"
        except Exception as e:
            r = f"{type(e).__name__}: {e}"
        GROUPS["pending"] = (w, t)
        return {"wait": r, "done": w.is_completed(), "took": time.monotonic() - t0}
    if stage == "late":      # the other ranks join; rank 0 waits for its pending work
        if RANK == 0:
            w, t = GROUPS.pop("pending")
            w.wait()
            return t.tolist()
        t = torch.ones(3)
        dist.all_reduce(t)
        return t.tolist()
    if stage == "error":     # an async call that fails reports through its Work
        w = dist.all_reduce(torch.ones(2 + RANK), async_op=True)
        try:
            w.wait()
            r = "no error"
        except Exception as e:
            r = f"{type(e).__name__}: {e}"
        return {"wait": r, "exc": str(w.exception()), "done": w.is_completed()}


def job_large_gather_scatter(n):
    """gather and scatter of n float32 per rank between separate tensors
    (large: copied straight between the ranks' tensors), one output on the
    root not contiguous; every root."""
    out = {}
    for root in range(WORLD):
        mine = torch.arange(n, dtype=torch.float32) + 1e6 * RANK
        outs = ([torch.zeros(n) for _ in range(WORLD - 1)] + [torch.zeros(n, 2)[:, 0]]
                if RANK == root else None)
        dist.gather(mine, outs, dst=root)
        out[f"gather {root}"] = (all(torch.equal(o, torch.arange(n, dtype=torch.float32) + 1e6 * q)
                                     for q, o in enumerate(outs)) if RANK == root else None)
        parts = ([torch.arange(n, dtype=torch.float32) - 7.0 * q for q in range(WORLD)]
                 if RANK == root else None)
        got = torch.zeros(n)
        dist.scatter(got, parts, src=root)
        out[f"scatter {root}"] = torch.equal(got, torch.arange(n, dtype=torch.float32) - 7.0 * RANK)
    return out


def job_dead_rank(victim):
    """Every rank of the world; a subgroup of the others and the victim.
    The victim is killed by the test while the others wait in collectives."""
    sub = dist.new_group([1, 2])
    if RANK == victim:
        print("READY", flush=True)
        time.sleep(600)
    print("READY", flush=True)
    errors, at = {}, {}

    def catch(key, fn):
        try:
            fn()
            errors[key] = "no error"
        except Exception as e:
            errors[key] = f"{type(e).__name__}: {e}"
        at[key] = time.monotonic()      # CLOCK_MONOTONIC: the test's clock too

    if RANK == 1:
        w = dist.all_reduce(torch.ones(2), async_op=True)         # world, on its thread
        catch("sub", lambda: dist.all_reduce(torch.ones(2), group=sub))
        catch("world", w.wait)
    else:
        catch("world", lambda: dist.all_reduce(torch.ones(2)))
    return {"errors": errors, "at": at}


def job_timeout():
    """Only rank 0 comes to a barrier of a fresh group: a timeout naming the others."""
    sub = dist.new_group(list(range(WORLD)))
    res = None
    if RANK == 0:
        t0 = time.monotonic()
        try:
            dist.barrier(group=sub, timeout=datetime.timedelta(seconds=0.5))
            res = "no error"
        except Exception as e:
            res = f"{type(e).__name__}: {e}"
        res = [res, time.monotonic() - t0]
    dist.barrier()
    dist.destroy_process_group(sub)
    return res


def job_own_backend():
    """NOTE [ The group is its own backend ]: the devices and backend torch's
    Python asks a group for, and a default timeout set on the group, which
    rank 0 then meets alone at a barrier given none."""
    sub = dist.new_group(list(range(WORLD)))
    try:
        sub._get_backend(torch.device("meta"))
        meta = "no error"
    except RuntimeError as e:
        meta = str(e)
    res = {"devices": [str(d) for d in sub._device_types],
           "backend_is_group": sub._get_backend(torch.device("cpu")) is sub,
           "meta": meta, "alloc": sub._get_backend("cpu").supports_tensor_alloc("cpu"),
           "object_device": str(dist.distributed_c10d._get_object_coll_device(sub))}
    # A group per call: a timeout breaks its group.
    groups = [sub, dist.new_group(list(range(WORLD))), dist.new_group(list(range(WORLD)))]
    for g in groups[:2]:
        g.set_timeout(datetime.timedelta(seconds=0.5))
    # the third through torch's private _set_pg_timeout, as training stacks
    # set it, which looks for gloo's and NCCL's backends only
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=0.5), groups[2])
    res["pg_timeout_warnings"] = [str(w.message) for w in said]
    if RANK == 0:
        # no timeout given: a barrier, a blocking all_reduce, an async one
        calls = {"barrier": lambda g: dist.barrier(group=g),
                 "all_reduce": lambda g: dist.all_reduce(torch.ones(2), group=g),
                 "async": lambda g: dist.all_reduce(torch.ones(2), group=g, async_op=True).wait()}
        for g, (name, call) in zip(groups, calls.items()):
            t0 = time.monotonic()
            try:
                call(g)
                res[name] = "no error"
            except Exception as e:
                res[name] = f"{type(e).__name__}: {e}"
            res[name + "_s"] = time.monotonic() - t0
    dist.barrier()
    for g in groups:
        dist.destroy_process_group(g)
    return res


def job_monitored():
    """torch's monitored_barrier on mpcore groups (asked for as gloo): every
    rank comes; then only rank 0, which is told who did not."""
    sub = dist.new_group(list(range(WORLD)))
    dist.monitored_barrier()
    dist.monitored_barrier(group=sub, wait_all_ranks=True)
    res = "all came"
    if RANK == 0:
        try:
            dist.monitored_barrier(group=sub, timeout=datetime.timedelta(seconds=0.5))
            res = "no error"
        except Exception as e:
            res = f"{type(e).__name__}: {e}"
    dist.barrier()
    dist.destroy_process_group(sub)
    return res


def job_functional(kind):
    """Functional collectives (the C++ dispatcher's way in), eager and compiled."""
    import torch.distributed._functional_collectives as fc
    if GROUPS[kind] is None:
        return "skip"
    m, g, members = GROUPS[kind]
    r, W = members.index(RANK), len(members)
    x = torch.arange(4.0) + r
    out = {"all_reduce": fc.all_reduce(x, "sum", m).tolist(),
           "all_gather": fc.all_gather_tensor(x, 0, m).tolist(),
           "reduce_scatter": fc.reduce_scatter_tensor(torch.arange(2.0 * W) + r, "sum", 0,
                                                      m).tolist(),
           "all_to_all": fc.all_to_all_single(torch.arange(2.0 * W) + 10 * r, None, None,
                                              m).tolist()}
    @torch.compile(fullgraph=True, backend="eager")
    def f(y):
        return fc.all_reduce(y * 2, "max", m) + 1
    out["compiled"] = f(x).tolist()
    want = {"all_reduce": (torch.arange(4.0) * W + sum(range(W))).tolist(),
            "all_gather": torch.cat([torch.arange(4.0) + q for q in range(W)]).tolist(),
            "reduce_scatter": (torch.arange(2.0 * W)[2 * r:2 * r + 2] * W + sum(range(W))).tolist(),
            "all_to_all": torch.cat([(torch.arange(2.0 * W) + 10 * q)[2 * r:2 * r + 2]
                                     for q in range(W)]).tolist(),
            "compiled": ((torch.arange(4.0) + W - 1) * 2 + 1).tolist()}
    return {"got": out, "want": want, "pg": type(m).__name__}


JOBS = {k[4:]: v for k, v in globals().items() if k.startswith("job_")}
JOBS["make_groups"] = make_groups
print("UP", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["job"] == "quit":
        break
    try:
        res = {"ok": JOBS[req["job"]](**req["kw"])}
    except BaseException as e:
        res = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
    print("RESULT " + repr(res), flush=True)
dist.destroy_process_group()
'''


class Pool:
    """`world` rank processes of the worker program, with the world group up."""

    def __init__(self, world, tmp, groups=True, extra=None):
        self.world = world
        path = tmp / "worker.py"
        path.write_text(textwrap.dedent(WORKER))
        port = free_port()
        base = {k: v for k, v in fresh_env().items() if not k.startswith("MPCORE_")}
        self.procs = [start_rank(path, r, world, port, base=base,
                                 extra={"PYTHONUNBUFFERED": "1", **(extra or {})},
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=open(tmp / f"rank{r}.err", "w"), text=True,
                                 start_new_session=True)
                      for r in range(world)]
        self.tmp = tmp
        try:
            for r in range(world):
                assert self.line(r, 120) == "UP", self.stderr(r)
            self.kinds = self.run("make_groups") if groups else None
        except BaseException:
            self.close()
            raise

    def stderr(self, r):
        return (self.tmp / f"rank{r}.err").read_text()[-4000:]

    def line(self, r, timeout):
        f = self.procs[r].stdout
        deadline = time.monotonic() + scaled(timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                raise AssertionError(f"rank {r} gave no answer in {scaled(timeout):g} s\n"
                                     f"{self.stderr(r)}")
            line = f.readline()
            if not line:
                raise AssertionError(f"rank {r} exited (rc {self.procs[r].poll()})\n"
                                     f"{self.stderr(r)}")
            if line.startswith(("RESULT ", "UP", "READY")):
                return line.rstrip("\n")

    def send(self, job, ranks=None, **kw):
        for r in (range(self.world) if ranks is None else ranks):
            self.procs[r].stdin.write(json.dumps({"job": job, "kw": kw}) + "\n")
            self.procs[r].stdin.flush()

    def collect(self, ranks=None, timeout=90):
        out = []
        for r in (range(self.world) if ranks is None else ranks):
            res = ast.literal_eval(self.line(r, timeout)[len("RESULT "):])
            assert "error" in res or "ok" in res
            if "error" in res:
                raise AssertionError(f"rank {r}: {res['error']}\n{res['tb']}")
            out.append(res["ok"])
        return out

    def run(self, job, timeout=90, **kw):
        self.send(job, **kw)
        return self.collect(timeout=timeout)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write(json.dumps({"job": "quit"}) + "\n")
                    p.stdin.close()
                except OSError:
                    pass
        rcs = []
        for p in self.procs:
            try:
                rcs.append(p.wait(scaled(30)))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rcs.append(p.wait())
        for p in self.procs:
            p.stdout.close()
        return rcs


def _pool(world, tmp_path_factory):
    require(_have_gloo(), "torch.distributed with gloo is not available")
    pool = Pool(world, tmp_path_factory.mktemp(f"pool{world}"))
    yield pool
    rcs = pool.close()
    assert rcs == [0] * world, [pool.stderr(r) for r in range(world)]


@pytest.fixture(scope="module")
def pool2(tmp_path_factory):
    yield from _pool(2, tmp_path_factory)


@pytest.fixture(scope="module")
def pool4(tmp_path_factory):
    yield from _pool(4, tmp_path_factory)


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def pool(request):
    return request.getfixturevalue(f"pool{request.param}")


def _assert_all(results, min_gloo=()):
    ran = [res for res in results if res != "skip"]
    assert ran, "no rank ran the job"
    for rank, res in enumerate(results):
        if res == "skip":
            continue
        assert res["fails"] == [], f"rank {rank}:\n" + "\n".join(res["fails"][:30])
    for key in min_gloo:
        assert all(any(k.split()[0] == key for k in res["gloo"]) for res in ran), \
            (key, ran[0]["gloo"])


KINDS = ["world", "new_group", "new_subgroups", "asked_for_gloo", "split_group"]


def test_groups_are_mpcore_and_gloo(pool):
    """Every group of mpcore's, asked for with "gloo" or with no backend, and
    its twin of torch's gloo."""
    for kinds in pool.kinds:
        assert set(kinds) >= {"world", "new_subgroups", "asked_for_gloo", "split_group"}, kinds
        for kind, (mine, theirs, shm) in kinds.items():
            assert mine == "ProcessGroupMpcore" and shm is True, kind
            assert theirs == "ProcessGroup", kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_all_reduce(pool, kind, op):
    _assert_all(pool.run("all_reduce", kind=kind, op=op),
                min_gloo=("float32", "int64") if op in ("SUM", "MIN", "MAX") else ())


@pytest.mark.parametrize("how", ["noncontig", "async", "coalesced"])
def test_all_reduce_forms(pool, how):
    _assert_all(pool.run("all_reduce", kind="world", op="SUM", noncontig=how == "noncontig",
                         async_op=how == "async", coalesced=how == "coalesced"))


@pytest.mark.parametrize("call", ["all_reduce", "reduce", "all_to_all", "all_gather",
                                  "reduce_scatter"])
@pytest.mark.parametrize("kind", ["world", "new_group"])
def test_memory_reduced_again_moves_into_a_group_buffer(pool, kind, call):
    """A large tensor of torch's own memory moves into a group buffer at its
    second all-reduce (or reduce; or all_to_all_single, all_gather_into_
    tensor or reduce_scatter_tensor as the input) and
    stays; a new tensor at each call never moves, wherever malloc puts it;
    memory that others see (numpy's, shared) never moves; a rank whose
    tensor did not move still gets every result."""
    results = pool.run("reduced_again", kind=kind, call=call)
    _assert_all(results)
    for rank, res in enumerate(results):
        if res == "skip":
            continue
        own = res["own"]
        assert [held for _, held in own] == [False, True, True], (rank, own)
        assert own[0][0] != own[1][0] == own[2][0], (rank, own)   # moved once, in place
        assert res["view"] == [own[2]] * 3, (rank, res["view"])  # a view of it is in it too
        for sort in ("numpy", "shared"):
            assert res[sort] == [res[sort][0]] * 3 and not res[sort][0][1], (rank, sort, res)
        assert not any(held for _, held in res["fresh"]), (rank, res["fresh"])
        assert [held for _, held in res["mixed"]] == ([False] * 3 if rank == 0
                                                      else [False, True, True]), (rank, res)
        assert res["shared_after"] is True and res["freed"] is True, (rank, res)


def test_many_tensors_reduced_in_turn_all_move_into_group_buffers(pool):
    """More large tensors than a rank once remembered (64), all-reduced in
    turn as a loop over a model's gradients does: every one moves into a
    group buffer at its second call, and every sum is right."""
    results = pool.run("many_reduced_in_turn", kind="world")
    _assert_all(results)
    assert [res["held"] for res in results] == [[0, 80, 80]] * len(results)


@pytest.mark.parametrize("kind", ["world", "new_group"])
def test_all_to_all_in_place(pool, kind):
    _assert_all(pool.run("all_to_all_in_place", kind=kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["SUM", "MAX", "BXOR"])
def test_reduce(pool, kind, op):
    _assert_all(pool.run("reduce", kind=kind, op=op))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["tensor", "list"])
@pytest.mark.parametrize("op", ["SUM", "AVG", "MIN"])
def test_reduce_scatter(pool, kind, form, op):
    _assert_all(pool.run("reduce_scatter", kind=kind, op=op, form=form))


MOVERS = ["broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter",
          "all_to_all_single", "all_to_all", "send_recv", "batch_isend_irecv", "irecv_first_large"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("what", MOVERS)
def test_movers(pool, kind, what):
    _assert_all(pool.run("movers", kind=kind, what=what), min_gloo=("float32",) if what not in (
        "send_recv", "batch_isend_irecv", "all_to_all") else ())   # gloo: no list all_to_all


def test_large_gather_and_scatter_between_separate_tensors(pool):
    for r, res in enumerate(pool.run("large_gather_scatter", n=300_001)):
        for k, v in res.items():
            assert v is (True if k.endswith(f" {r}") or k.startswith("scatter") else None), (r, k, v)


@pytest.mark.parametrize("what", ["broadcast", "all_gather_into_tensor", "scatter"])
def test_movers_non_contiguous(pool, what):
    _assert_all(pool.run("movers", kind="world", what=what, noncontig=True))


@pytest.mark.parametrize("kind", ["world", "new_group"])
def test_fast_path_of_module_functions(pool2, kind):
    """NOTE [ A fast path for torch's module functions ]."""
    for r, res in enumerate(pool2.run("fastpath", kind=kind)):
        assert res["installed"], res
        for what, ok in res["fast"]:
            assert ok is True, (r, what, res)   # served, and right, without torch's function
        assert len(res["fast"]) == 6, res
        for what, said in res["slow"]:
            assert "reached" in said, (r, what, said)   # torch's function took them
        assert len(res["slow"]) == 4, res
        assert res["order"] is True, res
        errs = res["errors"]
        assert "ValueError" in errs["send to a rank outside"], errs
        if r != 1:   # the root of that gather (rank 1) is not asked
            assert "ValueError" in errs["gather list off the root"], errs


@pytest.mark.parametrize("kind", KINDS)
def test_object_collectives(pool, kind):
    for res in pool.run("objects", kind=kind):
        if res != "skip":
            assert res["mpcore"] == res["gloo"]


def test_mismatched_calls_fail_on_every_rank(pool):
    results = pool.run("mismatch", kind="world", timeout=60)
    for rank, res in enumerate(results):
        sizes = set(re.findall(r"all_reduce of (\d+)", res["size"]))
        assert res["size"].startswith("ValueError") and len(sizes) == 2 and "4" in sizes, res
        assert "sum" in res["op"].lower() and "max" in res["op"].lower(), res
        assert "all_reduce" in res["kind"] and "broadcast" in res["kind"], res
        assert res["after"] == [float(pool.world)] * 3


def test_split_group(pool):
    """torch's split_group, which refuses every CPU group, splits mpcore's
    (NOTE [ Splitting a group ])."""
    W = pool.world
    for rank, res in enumerate(pool.run("split")):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert res["of_sub"] == ["ProcessGroupMpcore", pair, float(sum(pair))], (rank, res)
        before, made, after = res["regions"]
        assert made > before == after, (rank, res["regions"])
        assert res["only0"] == ([0] if rank == 0 else None), (rank, res)
        errors = res["errors"]
        assert errors["shared"].startswith("ValueError") and "[1] are in another split" in \
            errors["shared"], errors
        assert errors["outside"].startswith("ValueError") and f"ranks [{W}] are not group ranks" \
            in errors["outside"], errors
        assert errors["duplicate"].startswith("ValueError") and "duplicate" in \
            errors["duplicate"], errors
        assert errors["empty"].startswith("ValueError") and "cannot be None or empty" in \
            errors["empty"], errors
        # a group of torch's gloo goes to torch's function, which refuses it on the CPU
        assert res["gloo_parent"].startswith("RuntimeError") and "split" in \
            res["gloo_parent"], res["gloo_parent"]


def test_destroy_frees_the_region(pool):
    for res in pool.run("destroy"):
        assert res["made"] == res["before"] + 1 and res["after"] == res["before"], res
        assert res["sum"] == [float(pool.world)] * 2
        assert "not initialized" in res["used"][0], res
        assert res["used"][1] == "RuntimeError: mpcore: this process group has been destroyed", res


def test_timeout_names_the_missing_ranks(pool):
    res = pool.run("timeout")[0]
    msg, took = res
    assert msg.startswith("TimeoutError") and took < 0.5 + scaled(1.0), res
    assert all(str(q) in msg for q in range(1, pool.world)), res


def test_the_group_is_its_own_backend(pool2):
    res = pool2.run("own_backend")
    for r in res:
        assert r["devices"] == ["cpu"] and r["backend_is_group"] and r["alloc"] is False, r
        assert r["meta"] == "No backend type associated with device type meta", r
        assert r["object_device"] == "cpu", r
        assert r["pg_timeout_warnings"] == [], r
    for name in ("barrier", "all_reduce", "async"):
        assert res[0][name].startswith("TimeoutError") and "1" in res[0][name], res[0]
        assert res[0][name + "_s"] < scaled(10), res[0]   # the default is 60 s


def test_monitored_barrier(pool):
    # NOTE [ monitored_barrier ] in distributed.py, NOTE [ monitored_barrier's
    # protocol ] in dist/_group.py: gloo's error, naming the first rank that did not come
    res = pool.run("monitored")
    assert res[1:] == ["all came"] * (pool.world - 1), res
    assert res[0].startswith("RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier "
                             "in 500 ms"), res


MONITORED_THEN_EXIT = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")   # under mpcore run: mpcore's group, as gloo's
assert type(dist.group.WORLD).__module__.startswith("mpcore"), type(dist.group.WORLD)
dist.monitored_barrier()
print("LEFT", flush=True)
if dist.get_rank() == 0:
    os._exit(0)   # at once, with the store it hosts
dist.destroy_process_group()
"""


RUNS_THEN_EXIT = 8


@pytest.mark.timeout(600)
def test_monitored_barrier_then_exit(tmp_path):
    """`monitored_barrier(); destroy_process_group()` at a program's end:
    rank 0, which hosts the store, leaves only once every rank has read its
    answer (NOTE [ monitored_barrier's protocol ]), so no rank meets a
    store that is gone.  The race it closes lost about one run in three
    here; RUNS_THEN_EXIT runs in a row each exit cleanly on both ranks."""
    path = tmp_path / "prog.py"
    path.write_text(MONITORED_THEN_EXIT)
    for run in range(RUNS_THEN_EXIT):
        port = free_port()
        procs = [start_rank(path, r, 2, port, launcher=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for r in range(2)]
        try:
            outs = [p.communicate(timeout=scaled(120)) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            assert p.returncode == 0 and "LEFT" in out, (run, r, p.returncode, err[-2000:])


@pytest.mark.parametrize("kind", ["world", "new_group"])
def test_fast_path_of_collectives(pool2, kind):
    """NOTE [ The rest of torch's collectives ] in _fastpath.py: all_reduce,
    barrier, the all-gathers, the reduce-scatters and all_to_all, blocking
    and async, served without torch's function, with gloo's results and
    return types; observed, torch's function serves them; wrong arguments
    raise what torch's function raises."""
    for r, res in enumerate(pool2.run("fastpath_collectives", kind=kind)):
        assert all(res["installed"].values()), res["installed"]
        bad = {k: v for k, v in res["same"].items() if v is not True}
        assert not bad, (r, bad)     # served (torch's function raises), and right
        assert len(res["same"]) >= 28, res["same"]
        for what, said in res["observed"].items():
            assert "reached" in said, (r, what, said)   # torch's function took them
        assert len(res["observed"]) == 3 * len(res["same"]) // 2 - 1, res["observed"]
        for what, (fast, slow) in res["errors"].items():
            assert fast is not None and fast == slow, (r, what, fast, slow)


def test_fast_path_async_runs_off_the_callers_thread(pool2):
    """An async call on the fast path is queued, not run at once: a send
    after it goes out, and the peer that receives before all-reducing
    gets there (NOTE [ Asynchronous calls on the fast path ])."""
    res = pool2.run("fastpath_async_order", timeout=120)
    assert res[0].get("work") is True and res[1].get("received") is True, res
    assert res[0]["sum"] == res[1]["sum"] == [3.0] * 4, res


def test_fast_path_timeout_as_before(pool2):
    """A peer that never comes: the fast path's error (blocking, and from an
    async call's wait) is the one torch's function gives."""
    res = pool2.run("fastpath_timeout", timeout=120)[0]
    for name in ("all_reduce", "all_gather_into_tensor", "barrier"):
        fast, slow, asynced = (res[f"{name} {p}"] for p in ("fast", "torch", "async"))
        assert slow.startswith("TimeoutError"), res
        assert fast == slow == asynced, res


@pytest.mark.parametrize("kind", ["world", "new_group"])
def test_fast_path_of_functional_collectives(pool, kind):
    """NOTE [ A fast path for the functional collectives ]."""
    for r, res in enumerate(pool.run("funcol_fast", kind=kind)):
        if res == "skip":
            continue
        assert res["installed"] and res["input kept"] and res["ordered"], (r, res)
        assert res["same"] and all(res["same"].values()), (r, res)
        assert res["forms"] == {"mesh": True, "(mesh, 0)": True, "name": True}, (r, res)
        assert res["types"] == ["AsyncCollectiveTensor"], (r, res)
        assert len(res["slow"]) == 6, res
        for what, said in res["slow"]:
            assert "reached" in said, (r, what, said)   # torch's function took them


@pytest.mark.parametrize("kind", KINDS)
def test_functional_collectives_eager_and_compiled(pool, kind):
    for res in pool.run("functional", kind=kind, timeout=150):
        if res != "skip":
            assert res["got"] == res["want"] and res["pg"] == "ProcessGroupMpcore", res


def test_backend_names():
    """NOTE [ Which backend a group gets ]: what torch is asked for."""
    require(_have_gloo(), "torch.distributed with gloo is not available")
    import mpcore.distributed as md
    assert md.translate("gloo") == "mpcore" and md.translate("GLOO") == "mpcore"
    assert md.translate("nccl") == "nccl"     # torch's own NCCL group, unchanged
    assert md.translate("cpu:gloo,cuda:nccl") == "cpu:mpcore,cuda:nccl"
    assert md.translate("mpcore") == "mpcore" and md.translate(None) is None
    assert md.translate("cuda:nccl") == "cuda:nccl"


GLOO_DTYPES = ["float32", "float64", "int32", "int64", "uint8"]


@pytest.fixture(scope="module")
def pool_hosts(tmp_path_factory):
    """Two ranks that mpcore sees on two machines: the backend's gloo serves."""
    require(_have_gloo(), "torch.distributed with gloo is not available")
    pool = Pool(2, tmp_path_factory.mktemp("hosts"), extra={"FAKE_HOSTS": "1"})
    yield pool
    assert pool.close() == [0, 0], [pool.stderr(r) for r in range(2)]


def test_ranks_on_several_machines_get_gloo_inside(pool_hosts):
    for kinds in pool_hosts.kinds:
        for kind, (mine, theirs, shm) in kinds.items():
            assert mine == "ProcessGroupMpcore" and shm is False, kind
    for op in ("SUM", "MAX"):
        _assert_all(pool_hosts.run("all_reduce", kind="world", op=op, dtypes=GLOO_DTYPES),
                    min_gloo=("float32",))
    for what in ("broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter",
                 "all_to_all_single", "send_recv"):
        _assert_all(pool_hosts.run("movers", kind="new_subgroups", what=what,
                                   dtypes=GLOO_DTYPES))
    for res in pool_hosts.run("objects", kind="world"):
        assert res["mpcore"] == res["gloo"]
    # set_timeout reaches the gloo groups inside (a timeout there is gloo's error)
    res = pool_hosts.run("own_backend")
    assert [r["backend_is_group"] for r in res] == [True, True], res
    assert [r["pg_timeout_warnings"] for r in res] == [[], []], res
    for name in ("barrier", "all_reduce", "async"):
        assert res[0][name] != "no error" and res[0][name + "_s"] < scaled(10), res[0]


def test_work_surface(pool2):
    a, b = pool2.run("work", stage="async")
    for res in (a, b):
        assert res["wait"] is True and res["done"] and res["exc"] and res["isinstance"]
        assert res["sum"] == [3.0] * 4 and res["fut"] == [[3.0] * 4]
        assert res["later_done"] is True and res["b"] == [2.0, 2.0]
        assert res["unwaited_ran"] is True
    pool2.send("work", ranks=[0], stage="early")
    early, = pool2.collect(ranks=[0])
    assert "TimeoutError" in early["wait"] and early["done"] is False, early
    pool2.send("work", stage="late")
    assert pool2.collect() == [[2.0] * 3, [2.0] * 3]
    errs = pool2.run("work", stage="error")
    for res in errs:
        assert "all_reduce" in res["wait"] and res["done"] is True
        assert res["exc"] in res["wait"]


@pytest.mark.timeout(120)
def test_dead_rank_on_a_subgroup(tmp_path):
    """A rank killed while the others wait on the world group and on a
    subgroup: a clear error naming it (by its global rank) on every rank
    within a second, and nothing left behind."""
    require(_have_gloo(), "torch.distributed with gloo is not available")
    pool = Pool(3, tmp_path, groups=False)
    victim = 2
    try:
        pool.send("dead_rank", victim=victim)
        for r in range(3):
            assert pool.line(r, 60) == "READY"
        # whether the others are inside their collectives yet or not, they
        # must all report the loss within a second of it
        killed = time.monotonic()
        os.kill(pool.procs[victim].pid, signal.SIGKILL)
        res = pool.collect(ranks=[0, 1], timeout=30)
    finally:
        rcs = pool.close()
    pid = pool.procs[victim].pid
    for r, out in zip((0, 1), res):
        keys = ("sub", "world") if r == 1 else ("world",)
        assert sorted(out["errors"]) == sorted(keys), out
        for k in keys:   # rank 1 of the subgroup: named by its global rank, 2, there too
            assert f"rank 2 (pid {pid}) exited" in out["errors"][k], (r, k, out)
            assert out["at"][k] - killed < scaled(1.0), (r, k, out["at"][k] - killed)
    assert rcs[:2] == [0, 0] and rcs[2] == -signal.SIGKILL
    for p in pool.procs:
        assert p.poll() is not None
