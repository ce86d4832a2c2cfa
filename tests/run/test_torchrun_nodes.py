"""`mpcore run` as torchrun on two nodes: each node's launcher runs in a
network and UTS namespace of its own (tests/helpers/netns.py), the two meet through
torch's c10d rendezvous over the veth pair, and their 2 x 2 ranks form one
world group, hierarchical across the nodes.  Then node 1's launcher is
SIGKILLed while every rank all-reduces: its ranks die with it, node 0's
ranks fail with an error, node 0's launcher ends with torchrun's failure
summary, and nothing is left on either node.

One job serves the module.  Needs root and iproute2 (`ip`): skipped
without them, failed in CI.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import fresh_env, netns, require, scaled, session_members, wait_session_gone

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
JOB_TIMEOUT = 150

pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 60)

PROGRAM = textwrap.dedent(r'''
    import json, os, socket, sys, time
    import torch
    import torch.distributed as dist

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")           # under mpcore run: mpcore's backend
    pg = dist.group.WORLD
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    rec = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE",
                                          "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")}
    rec.update(host=socket.gethostname(), pid=os.getpid(), sum=t[:3].tolist(),
               group=type(pg).__name__, inner=type(getattr(pg, "gloo", None)).__name__)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    n = 0
    try:
        while True:
            dist.all_reduce(t)
            n += 1
            if n == 20:
                open(os.path.join(out, f"loop{rank}"), "w").close()
    except Exception as e:
        with open(os.path.join(out, f"fail{rank}.json"), "w") as f:
            json.dump({"error": f"{type(e).__name__}: {e}", "t": time.monotonic(),
                       "iterations": n}, f)
        raise
''')


class Job:
    pass


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    why = netns.missing()
    require(why is None, why)
    out = str(tmp_path_factory.mktemp("torchrun-nodes"))
    prog = os.path.join(out, "prog.py")
    with open(prog, "w") as f:
        f.write(PROGRAM)
    nodes = netns.Nodes()
    procs, logs, j = [], [], Job()
    try:
        for k in range(NODES):
            env = fresh_env()
            env.update(GLOO_SOCKET_IFNAME=nodes.ifname(k))
            argv = [os.path.join(os.path.dirname(sys.executable), "mpcore"), "run",
                    "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.addr(0)}:29400",
                    "--rdzv-id", "two-nodes", "--local-addr", nodes.addr(k),
                    "--shutdown-timeout", "5", prog, out]
            logs.append(os.path.join(out, f"node{k}.log"))
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(nodes.command(k, argv), env=env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + scaled(JOB_TIMEOUT)
        netns.wait_files(out, [f"rank{r}.json" for r in range(WORLD)] +
                    [f"loop{r}" for r in range(WORLD)], procs, deadline, logs)
        j.ranks = {}
        for r in range(WORLD):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                j.ranks[r] = json.load(f)
        j.t_kill = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)       # node 1's launcher (its pid is the launcher's)
        j.codes = [p.wait(timeout=max(1, deadline - time.monotonic())) for p in procs]
        j.fails = {}
        for r in range(WORLD):
            path = os.path.join(out, f"fail{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    j.fails[r] = json.load(f)
        for p in procs:
            wait_session_gone(p.pid, timeout=30)
        j.logs = [netns.tail(path) for path in logs]
        j.in_namespaces = nodes.pids()
        nodes.close()
        j.nodes_left = nodes.leftovers()
        return j
    finally:
        netns.kill_sessions(procs, session_members)
        nodes.close()


def test_two_launchers_make_one_hierarchical_world(job):
    want = float(sum(range(1, WORLD + 1)))
    for r in range(WORLD):
        rec = job.ranks[r]
        node = r // PER_NODE
        assert rec["host"] == f"node{node}", (r, rec)
        assert (rec["RANK"], rec["LOCAL_RANK"], rec["GROUP_RANK"]) == (
            str(r), str(r % PER_NODE), str(node)), (r, rec)
        assert (rec["WORLD_SIZE"], rec["LOCAL_WORLD_SIZE"], rec["GROUP_WORLD_SIZE"]) == (
            str(WORLD), str(PER_NODE), str(NODES)), (r, rec)
        assert rec["sum"] == [want] * 3, (r, rec)
        assert (rec["group"], rec["inner"]) == ("ProcessGroupMpcore", "HierGroup"), (r, rec)


def test_a_killed_launcher_takes_its_ranks_and_fails_the_other_node(job):
    assert job.codes[1] == -signal.SIGKILL
    # node 0's ranks saw the loss of node 1's as an error (not a hang), and
    # node 0's launcher failed the job with torchrun's summary
    assert sorted(job.fails) == [0, 1], (job.fails, job.logs)
    for r in (0, 1):
        assert job.fails[r]["iterations"] >= 20
        assert "rank" in job.fails[r]["error"], job.fails[r]
    assert job.codes[0] not in (0, None), job.logs[0]
    assert "ChildFailedError" in job.logs[0] or "Failures:" in job.logs[0], job.logs[0]


def test_nothing_left_on_either_node(job):
    assert job.in_namespaces == [], job.in_namespaces
    assert job.nodes_left == [], job.nodes_left
