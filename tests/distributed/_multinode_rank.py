"""One rank of test_multinode.py's job: started with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), on a "node" of its own
(tests/helpers/netns.py) or, with MPCORE_TEST_RANKS_PER_HOST=k, with mpcore told
that every k ranks share a host, or with MPCORE_TEST_REGION_MAX=k, with regions
of k ranks at most.

    python _multinode_rank.py OUT

1. Runs every operation of the backend on the mpcore group and on a gloo
   group of the same ranks (the world, a subgroup across the hosts, one of
   uneven hosts and one inside a host), and writes OUT/rank<r>.json: each
   check's "ok" or what differed, and which transport each group got.
2. Then all-reduces in a loop, writing OUT/loop<r> once it is in the loop,
   until a collective fails (a rank was killed); writes OUT/fail<r>.json
   with the error and time.monotonic() when it was raised, and exits.
"""
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
OUT = sys.argv[1]
if os.environ.get("MPCORE_TEST_RANKS_PER_HOST"):
    from mpcore.dist import _dist
    _k = int(os.environ["MPCORE_TEST_RANKS_PER_HOST"])
    _dist._host_id = lambda: f"fake-host-{RANK // _k}"

import mpcore.distributed as md  # noqa: E402

if os.environ.get("MPCORE_TEST_REGION_MAX"):   # NOTE [ More ranks than a region holds ]
    from mpcore.dist import _dist
    _dist.REGION_MAX = int(os.environ["MPCORE_TEST_REGION_MAX"])

if os.environ.get("MPCORE_TEST_DEADLINE"):  # a hang shows where each thread was
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ["MPCORE_TEST_DEADLINE"]), exit=True)

torch.set_num_threads(1)
R = dist.ReduceOp
RESULTS = {}


def _write(name, obj):
    tmp = os.path.join(OUT, f".{name}")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.rename(tmp, os.path.join(OUT, name))


def check(name, a, b):
    """a, b: what mpcore and gloo gave (tensors or lists of them)."""
    a = a if isinstance(a, (list, tuple)) else [a]
    b = b if isinstance(b, (list, tuple)) else [b]
    if len(a) != len(b):
        RESULTS[name] = f"{len(a)} results against gloo's {len(b)}"
        return
    for x, y in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            RESULTS[name] = f"mpcore gave {x.flatten()[:8].tolist()}, gloo {y.flatten()[:8].tolist()}"
            return
    RESULTS[name] = "ok"


def guarded(name, fn):
    if os.environ.get("MPCORE_TEST_VERBOSE"):
        print(name, flush=True)
    try:
        fn()
    except Exception:
        RESULTS[name] = "raised " + traceback.format_exc()[-1500:]
        if os.environ.get("MPCORE_TEST_VERBOSE"):
            print(RESULTS[name], flush=True)


def data(rank, n, dtype, salt=0):
    t = torch.arange(n, dtype=torch.int64) % 7 + rank * 3 + salt + 1
    return t.to(dtype)


def backend_of(group):
    """The object whose methods serve the group's calls."""
    if type(group).__name__ == "ProcessGroupMpcore":
        return group
    return group._get_backend(torch.device("cpu"))


def transport(group):
    pg = group
    shm = getattr(pg, "shm", None)
    inner = getattr(pg, "gloo", None)
    return {"type": type(pg).__name__, "shm": shm is not None,
            "inner": type(inner).__name__ if inner is not None else None}


def run_checks(tag, ranks, mp, gl):
    """Every operation on mpcore's group mp and gloo's gl (same ranks)."""
    if RANK not in ranks:
        return
    w = len(ranks)
    me = ranks.index(RANK)
    for dtype in (torch.float32, torch.int64):
        dn = str(dtype).split(".")[1]
        for n in (5, 70000):  # small, and larger than a 1 MiB staging piece as int64
            k = f"{tag}/{dn}/{n}"

            def ar(op, async_op):
                x, y = data(me, n, dtype), data(me, n, dtype)
                wx = dist.all_reduce(x, op=op, group=mp, async_op=async_op)
                wy = dist.all_reduce(y, op=op, group=gl, async_op=async_op)
                if async_op:
                    wx.wait(), wy.wait()
                return x, y
            for op in (R.SUM, R.MAX, R.MIN, R.PRODUCT):
                if op == R.PRODUCT and n > 5:
                    continue
                guarded(f"{k}/all_reduce/{op}", lambda op=op: check(f"{k}/all_reduce/{op}",
                                                                      *ar(op, False)))
            guarded(f"{k}/all_reduce_async", lambda: check(f"{k}/all_reduce_async",
                                                             *ar(R.SUM, True)))
            if not dtype.is_floating_point:
                guarded(f"{k}/all_reduce/BXOR", lambda: check(f"{k}/all_reduce/BXOR",
                                                                *ar(R.BXOR, False)))
            else:
                def avg():
                    x, y = data(me, n, dtype), data(me, n, dtype)
                    dist.all_reduce(x, op=R.AVG, group=mp)
                    dist.all_reduce(y, op=R.SUM, group=gl)
                    check(f"{k}/all_reduce/AVG", x, y / w)
                guarded(f"{k}/all_reduce/AVG", avg)

            def queued():  # several async calls, then one sync: order per group
                xs = [data(me, n, dtype, s) for s in range(3)]
                ys = [data(me, n, dtype, s) for s in range(3)]
                works = [dist.all_reduce(x, group=mp, async_op=True) for x in xs]
                b = data(me, 3, dtype) if me == 0 else torch.zeros(3, dtype=dtype)
                c = b.clone()
                works.append(dist.broadcast(b, ranks[0], group=mp, async_op=True))
                dist.barrier(group=mp)
                for x in ys:
                    dist.all_reduce(x, group=gl)
                dist.broadcast(c, ranks[0], group=gl)
                assert all(wk.is_completed() or wk.wait() for wk in works)
                check(f"{k}/async_in_order", xs + [b], ys + [c])
            guarded(f"{k}/async_in_order", queued)

            def coalesced():
                xs = [data(me, n, dtype, s) for s in range(2)]
                ys = [data(me, n, dtype, s) for s in range(2)]
                o = dist.AllreduceCoalescedOptions()
                o.reduceOp = R.SUM
                backend_of(mp).allreduce_coalesced(xs, o).wait()
                backend_of(gl).allreduce_coalesced(ys, o).wait()
                check(f"{k}/allreduce_coalesced", xs, ys)
            guarded(f"{k}/allreduce_coalesced", coalesced)

            for root in sorted({ranks[0], ranks[-1]}):
                def bc(root=root):
                    x = data(me, n, dtype) if RANK == root else torch.zeros(n, dtype=dtype)
                    y = x.clone()
                    dist.broadcast(x, root, group=mp)
                    dist.broadcast(y, root, group=gl)
                    check(f"{k}/broadcast/{root}", x, y)
                guarded(f"{k}/broadcast/{root}", bc)

                def red(root=root):
                    x, y = data(me, n, dtype), data(me, n, dtype)
                    dist.reduce(x, root, op=R.SUM, group=mp)
                    dist.reduce(y, root, op=R.SUM, group=gl)
                    if RANK == root:
                        check(f"{k}/reduce/{root}", x, y)
                    else:
                        RESULTS[f"{k}/reduce/{root}"] = "ok"
                guarded(f"{k}/reduce/{root}", red)

                def gat(root=root):
                    x = data(me, n, dtype)
                    outs = [torch.zeros(n, dtype=dtype) for _ in range(w)] if RANK == root else None
                    outs2 = [torch.zeros(n, dtype=dtype) for _ in range(w)] if RANK == root else None
                    dist.gather(x, outs, root, group=mp)
                    dist.gather(x, outs2, root, group=gl)
                    check(f"{k}/gather/{root}", outs or [], outs2 or [])
                guarded(f"{k}/gather/{root}", gat)

                def sca(root=root):
                    ins = [data(i, n, dtype) for i in range(w)] if RANK == root else None
                    x, y = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
                    dist.scatter(x, ins, root, group=mp)
                    dist.scatter(y, ins, root, group=gl)
                    check(f"{k}/scatter/{root}", x, y)
                guarded(f"{k}/scatter/{root}", sca)

            def ag():
                x = data(me, n, dtype)
                a = [torch.zeros(n, dtype=dtype) for _ in range(w)]
                b = [torch.zeros(n, dtype=dtype) for _ in range(w)]
                dist.all_gather(a, x, group=mp)
                dist.all_gather(b, x, group=gl)
                check(f"{k}/all_gather", a, b)
                a, b = torch.zeros(w * n, dtype=dtype), torch.zeros(w * n, dtype=dtype)
                dist.all_gather_into_tensor(a, x, group=mp)
                dist.all_gather_into_tensor(b, x, group=gl)
                check(f"{k}/all_gather_into_tensor", a, b)
                # coalesced forms, on the backends (gloo's answer: one call each)
                o = AllgatherOptions()
                xs = [data(me, n, dtype, s) for s in range(2)]
                # output lists indexed [rank][input], as torch's all_gather_coalesced
                a = [[torch.zeros(n, dtype=dtype) for _ in xs] for _ in range(w)]
                b = [[torch.zeros(n, dtype=dtype) for _ in range(w)] for _ in xs]
                backend_of(mp).allgather_coalesced(a, xs, o).wait()
                for bb, x in zip(b, xs):
                    dist.all_gather(bb, x, group=gl)
                check(f"{k}/allgather_coalesced", [t for i in range(len(xs)) for t in
                                                   (a[r][i] for r in range(w))], sum(b, []))
                a = [torch.zeros(w * n, dtype=dtype) for _ in xs]
                b = [torch.zeros(w * n, dtype=dtype) for _ in xs]
                backend_of(mp).allgather_into_tensor_coalesced(a, xs, o).wait()
                for bb, x in zip(b, xs):
                    dist.all_gather_into_tensor(bb, x, group=gl)
                check(f"{k}/allgather_into_tensor_coalesced", a, b)
            guarded(f"{k}/all_gather", ag)

            def rs():
                ins = [data(me, n, dtype, s) for s in range(w)]
                a, b = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
                dist.reduce_scatter(a, ins, group=mp)
                dist.reduce_scatter(b, ins, group=gl)
                check(f"{k}/reduce_scatter", a, b)
                flat = torch.cat(ins)
                a, b = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
                dist.reduce_scatter_tensor(a, flat, group=mp)
                dist.reduce_scatter_tensor(b, flat, group=gl)
                check(f"{k}/reduce_scatter_tensor", a, b)
                o = dist.ReduceScatterOptions()
                o.reduceOp = R.MAX
                flats = [flat, flat * 2]
                a = [torch.zeros(n, dtype=dtype) for _ in flats]
                b = [torch.zeros(n, dtype=dtype) for _ in flats]
                backend_of(mp).reduce_scatter_tensor_coalesced(a, flats, o).wait()
                for bb, f in zip(b, flats):
                    dist.reduce_scatter_tensor(bb, f, op=R.MAX, group=gl)
                check(f"{k}/reduce_scatter_tensor_coalesced", a, b)
            guarded(f"{k}/reduce_scatter", rs)

            def a2a():
                ins = [data(me, n, dtype, s) for s in range(w)]
                a = [torch.zeros(n, dtype=dtype) for _ in range(w)]
                b = [torch.zeros(n, dtype=dtype) for _ in range(w)]
                dist.all_to_all(a, ins, group=mp)
                dist.all_to_all(b, ins, group=gl)
                check(f"{k}/all_to_all", a, b)
                # uneven: rank i sends i + j + 1 rows to rank j
                send = [me + j + 1 for j in range(w)]
                recv = [i + me + 1 for i in range(w)]
                x = data(me, sum(send), dtype)
                a, b = torch.zeros(sum(recv), dtype=dtype), torch.zeros(sum(recv), dtype=dtype)
                dist.all_to_all_single(a, x, recv, send, group=mp)
                dist.all_to_all_single(b, x, recv, send, group=gl)
                check(f"{k}/all_to_all_single", a, b)
            guarded(f"{k}/all_to_all", a2a)

            def p2p():
                src, dst = ranks[0], ranks[-1]
                if RANK == src:
                    dist.send(data(me, n, dtype), dst, group=mp)
                elif RANK == dst:
                    x = torch.zeros(n, dtype=dtype)
                    dist.recv(x, src, group=mp)
                    check(f"{k}/send_recv", x, data(0, n, dtype))
                    y = torch.zeros(n, dtype=dtype)
                    got = dist.recv(y, group=mp)  # from any rank
                    check(f"{k}/recv_anysource", [y, torch.tensor(got)],
                          [data(0, n, dtype, 1), torch.tensor(src)])
                if RANK == src:
                    dist.send(data(me, n, dtype, 1), dst, group=mp)
                RESULTS.setdefault(f"{k}/send_recv", "ok")
                dist.barrier(group=mp)
                dist.monitored_barrier(group=gl)
            guarded(f"{k}/send_recv", p2p)


def run_pieces(tag, ranks, mp, gl):
    """all_reduce of tensors larger than a piece of the leaders' exchange."""
    if RANK not in ranks:
        return
    me = ranks.index(RANK)
    n = 700000
    for dtype in (torch.float32, torch.int64):
        name = f"{tag}/{str(dtype).split('.')[1]}/{n}/all_reduce_pieces"

        def ar(dtype=dtype, name=name):
            x, y = data(me, n, dtype), data(me, n, dtype)
            dist.all_reduce(x, group=mp)
            dist.all_reduce(y, group=gl)
            check(name, x, y)
        guarded(name, ar)


def main():
    # 60 s of a quiet machine (tests/helpers/timescale.py: NOTE [ Waits scale with how slow the
    # machine is ])
    seconds = 60 * float(os.environ.get("TEST_TIME_SCALE", "1"))
    md.init_process_group("mpcore", timeout=datetime.timedelta(seconds=seconds))
    hosts_of = {}
    world = list(range(WORLD))
    half = WORLD // 2
    across = [0, half]               # one rank of each host
    uneven = list(range(half + 1))   # all of host 0 and one rank of host 1
    inside = list(range(half, WORLD))  # host 1 alone
    groups = {"world": (world, dist.group.WORLD, dist.new_group(world, backend="gloo"))}
    for name, ranks in (("across", across), ("uneven", uneven), ("inside", inside)):
        groups[name] = (ranks, dist.new_group(ranks, backend="mpcore"),
                        dist.new_group(ranks, backend="gloo"))
    for name, (ranks, mp, gl) in groups.items():
        if RANK in ranks:
            hosts_of[name] = transport(mp)
    if not os.environ.get("MPCORE_TEST_NO_CHECKS"):
        for name, (ranks, mp, gl) in groups.items():
            run_checks(name, ranks, mp, gl)
        run_pieces("world", *groups["world"])
    _write(f"rank{RANK}.json", {"results": RESULTS, "transport": hosts_of})

    # 2. the fault: all-reduce until a rank is killed
    dist.barrier()
    x = torch.ones(1024)
    i = 0
    try:
        while True:
            dist.all_reduce(x)
            x.fill_(1)
            i += 1
            if i == 20:
                _write(f"loop{RANK}", {"pid": os.getpid()})
    except Exception as e:
        t = time.monotonic()
        _write(f"fail{RANK}.json", {"t": t, "error": f"{type(e).__name__}: {e}",
                                    "iterations": i})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
