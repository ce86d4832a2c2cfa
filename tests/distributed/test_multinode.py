"""Groups across hosts (NOTE [ Hierarchical groups ] in mpcore/dist/_hier.py), on
two "nodes" of this machine: two network namespaces joined by a veth pair,
each rank with a hostname of its node's (tests/helpers/netns.py), 2 ranks per node.

One job serves most of the module (NOTE [ One start per stack ] in
helpers/ranks.py): the ranks (tests/distributed/_multinode_rank.py) compare every operation of
the backend with gloo on the same ranks, then all-reduce in a loop until the
test SIGKILLs rank 3; the job is then over, and the tests read what it
recorded.  A second, shorter job only loops, and loses rank 2, a leader.  A
third runs the first's checks on this host alone, with regions of two ranks
at most, so that the host is told as two (NOTE [ More ranks than a region
holds ] in mpcore/dist/_hier.py).

Needs root and iproute2 (`ip`): skipped without them, failed in CI.
"""
import json
import os
import signal
import subprocess
import time

import pytest

from helpers import netns, require, scaled, session_members, wait_session_gone
from helpers.ranks import free_port, start_rank

WORLD, PER_NODE = 4, 2
KILLED = 3          # a rank that is not its node's leader
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multinode_rank.py")
JOB_TIMEOUT = 150   # seconds for the whole job (it takes about 20 on a quiet machine)

pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 60)


class Job:
    pass


def _comm(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def _read(out, name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def _run_job(out, killed, checks=True, one_host=False):
    """Runs the job on two fresh nodes, SIGKILLs rank `killed` once every
    rank is in its all-reduce loop, and yields what it recorded; the nodes
    and every process are gone when it returns, even on failure.  one_host:
    every rank on this machine, with regions of PER_NODE ranks at most
    (NOTE [ More ranks than a region holds ] in _hier.py), so the host is
    told as two."""
    nodes = None if one_host else netns.Nodes()
    procs, logs = [], []
    port = free_port() if one_host else 29500
    j = Job()
    try:
        for r in range(WORLD):
            k = r // PER_NODE
            extra = dict(LOCAL_RANK=str(r % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE),
                         MPCORE_TEST_DEADLINE=str(scaled(JOB_TIMEOUT)))
            if one_host:
                extra.update(MPCORE_TEST_REGION_MAX=str(PER_NODE), GLOO_SOCKET_IFNAME="lo")
            else:
                extra["GLOO_SOCKET_IFNAME"] = nodes.ifname(k)
            if not checks:
                extra["MPCORE_TEST_NO_CHECKS"] = "1"
            logs.append(os.path.join(out, f"log{r}"))
            with open(logs[-1], "w") as log:
                procs.append(start_rank(PROGRAM, r, WORLD, port, (out,), extra=extra,
                                        addr="127.0.0.1" if one_host else nodes.addr(0),
                                        wrap=None if one_host else
                                        (lambda cmd, k=k: nodes.command(k, cmd)),
                                        stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True))
        deadline = time.monotonic() + scaled(JOB_TIMEOUT)
        netns.wait_files(out, [f"rank{r}.json" for r in range(WORLD)] +
                    [f"loop{r}" for r in range(WORLD)], procs, deadline, logs)
        j.results = {r: _read(out, f"rank{r}.json") for r in range(WORLD)}
        # every rank is in its all-reduce loop: kill one
        pid = _read(out, f"loop{killed}")["pid"]
        j.t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        j.codes = [p.wait(timeout=max(1, deadline - time.monotonic())) for p in procs]
        j.fails = {r: _read(out, f"fail{r}.json") for r in range(WORLD)
                   if os.path.exists(os.path.join(out, f"fail{r}.json"))}
        j.logs = {r: netns.tail(logs[r]) for r in range(WORLD)}
        for p in procs:  # everything the ranks started is gone too
            wait_session_gone(p.pid, timeout=30)
        if nodes is not None:
            j.in_namespaces = [(pid, _comm(pid)) for pid in nodes.pids()]
            nodes.close()
            j.nodes_left = nodes.leftovers()
        return j
    finally:
        netns.kill_sessions(procs, session_members)
        if nodes is not None:
            nodes.close()


def _require_nodes():
    why = netns.missing()
    require(why is None, why)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Every check, then rank 3 (not its node's leader) killed."""
    _require_nodes()
    return _run_job(str(tmp_path_factory.mktemp("multinode")), KILLED)


@pytest.fixture(scope="module")
def leader_job(tmp_path_factory):
    """No checks; rank 2, node 1's leader, killed."""
    _require_nodes()
    return _run_job(str(tmp_path_factory.mktemp("multinode-leader")), 2, checks=False)


@pytest.fixture(scope="module")
def crowded_job(tmp_path_factory):
    """Every check on one host with regions of two ranks at most, then rank 3
    killed."""
    return _run_job(str(tmp_path_factory.mktemp("one-host")), KILLED, one_host=True)


def test_a_host_with_more_ranks_than_a_region_is_told_as_several(crowded_job):
    """NOTE [ More ranks than a region holds ]: the group is a hierarchy over
    parts of the host, every operation matches gloo, and a killed rank
    fails every part in time, as across hosts."""
    _assert_hierarchical(crowded_job, across_hosts=False)   # [0, 2] fits one region
    _assert_every_operation_matches_gloo(crowded_job)
    _assert_failed_in_time(crowded_job, KILLED)


def test_groups_across_nodes_are_hierarchical(job):
    _assert_hierarchical(job)


def _assert_hierarchical(job, across_hosts=True):
    for r in range(WORLD):
        t = job.results[r]["transport"]
        assert t["world"] == {"type": "ProcessGroupMpcore", "shm": False, "inner": "HierGroup"}
        if r in (0, 1, 2):
            assert t["uneven"]["inner"] == "HierGroup"
        if r in (0, 2):
            assert t["across"]["inner"] == ("HierGroup" if across_hosts else None)
        if r in (2, 3):  # a subgroup inside one node gets a plain region
            assert t["inside"] == {"type": "ProcessGroupMpcore", "shm": True, "inner": None}


def test_every_operation_matches_gloo(job):
    _assert_every_operation_matches_gloo(job)


def _assert_every_operation_matches_gloo(job):
    ops = ("all_reduce/RedOpType.SUM", "all_reduce/RedOpType.MAX", "all_reduce/AVG",
           "all_reduce/BXOR", "all_reduce_async", "async_in_order", "allreduce_coalesced",
           "broadcast/0", "reduce/0", "gather/0", "scatter/0", "all_gather",
           "all_gather_into_tensor", "allgather_coalesced", "allgather_into_tensor_coalesced",
           "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
           "all_to_all", "all_to_all_single", "send_recv")
    for r in range(WORLD):
        res = job.results[r]["results"]
        bad = {k: v for k, v in res.items() if v != "ok"}
        assert not bad, f"rank {r}: {bad}"
        if r == 0:  # every op ran, for each group, dtype and size
            for group in ("world", "across", "uneven"):
                for dt in ("float32", "int64"):
                    for n in (5, 70000):
                        for op in ops:
                            if op == "all_reduce/AVG" and dt != "float32":
                                continue
                            if op == "all_reduce/BXOR" and dt != "int64":
                                continue
                            assert f"{group}/{dt}/{n}/{op}" in res, (group, dt, n, op)
    assert "world/int64/5/broadcast/3" in job.results[3]["results"]
    for dt in ("float32", "int64"):  # several pieces among the leaders
        assert f"world/{dt}/700000/all_reduce_pieces" in job.results[0]["results"]
    assert "inside/int64/70000/reduce_scatter" in job.results[2]["results"]


def _assert_failed_in_time(job, killed):
    survivors = [r for r in range(WORLD) if r != killed]
    assert sorted(job.fails) == survivors, (job.fails, job.logs)
    for r in survivors:
        f = job.fails[r]
        assert f"rank {killed} " in f["error"] and "exited" in f["error"], (r, f)
        assert f["iterations"] >= 20
        assert f["t"] - job.t_kill < scaled(2.0), (r, f["t"] - job.t_kill, f["error"])
    assert [job.codes[r] for r in survivors] == [0] * len(survivors), job.logs
    assert job.codes[killed] == -signal.SIGKILL


def test_a_rank_killed_mid_all_reduce_fails_every_node_within_2s(job):
    _assert_failed_in_time(job, KILLED)


def test_a_leader_killed_mid_all_reduce_fails_every_node_within_2s(leader_job):
    _assert_failed_in_time(leader_job, 2)


def test_nothing_left_behind(job, leader_job):
    for j in (job, leader_job):
        assert j.in_namespaces == [], j.in_namespaces
        assert j.nodes_left == [], j.nodes_left
