"""torch's Flight Recorder sees the collectives of a program under `mpcore
run` as it sees them under python (NOTE [ The Flight Recorder ] in
dist/_recorder.py): a program that asks for it (TORCH_FR_BUFFER_SIZE
positive) keeps gloo's own groups, whose dump then holds plain torch's
entries; one warning says why, and `mpcore doctor` lists the distributed
backend as not served, with the reason.  Asked for with 0, or not asked for,
mpcore serves the groups as before.

One program (RECORDED) runs on 2 ranks with gloo (the reference) and asking
for gloo under `mpcore run`, once with the recorder asked for and once with
it turned off; each test compares a run's record with gloo's run of the same
environment."""
import json
import os
import sys

import pytest

from helpers import fresh_env, require, run_in_session
from helpers.ranks import MPCORE_PG, RankRuns

pytestmark = pytest.mark.timeout(400)

MPCORE = os.path.join(os.path.dirname(sys.executable), "mpcore")
WARNING = "torch's Flight Recorder is on"

RECORDED = r'''
import json
import pickle
import torch._C._distributed_c10d as c10d_c

init()
RESULTS["_has_recorder"] = {"value": hasattr(c10d_c, "_dump_fr_trace")}
RESULTS["ddp"] = {"value": torch.nn.parallel.DistributedDataParallel.__module__}


def mine():
    return torch.arange(4, dtype=torch.float32) + 10 * RANK


def collectives():
    t = mine()
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.barrier()
    dist.all_gather([torch.empty(4) for _ in range(WORLD)], t)
    dist.all_gather_into_tensor(torch.empty(4 * WORLD), t)
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * WORLD))
    dist.all_to_all_single(torch.empty(2 * WORLD), torch.ones(2 * WORLD))
    if RANK == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    dist.all_reduce(t, async_op=True).wait()
    sub = dist.new_group([0, 1])
    dist.all_reduce(mine(), group=sub)


# what of an entry does not depend on timing ("retired" is set by gloo's thread
# when the call completes, which may come after the dump)
KEYS = ("profiling_name", "process_group", "collective_seq_id", "p2p_seq_id", "is_p2p",
        "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "state")


@check("entries")
def _():
    """The recorder's entries of the calls (what of them does not depend on
    time, threads or files), from the pickled dump and the JSON one."""
    collectives()
    if not hasattr(c10d_c, "_dump_fr_trace"):
        return None     # this torch binds no generic dump (gloo records nothing)
    dump = pickle.loads(c10d_c._dump_fr_trace())
    entries = [{k: e.get(k) for k in KEYS} for e in dump.get("entries", [])]
    js = json.loads(c10d_c._dump_fr_trace_json()) if hasattr(c10d_c, "_dump_fr_trace_json") \
        else {}
    return {"entries": entries, "json_names": [e.get("profiling_name")
                                               for e in js.get("entries", [])],
            "groups": sorted((v["desc"], v["ranks"]) for v in dump.get("pg_config", {}).values())}


finish()
'''

ASKED = {"TORCH_FR_BUFFER_SIZE": "2000"}
OFF = {"TORCH_FR_BUFFER_SIZE": "0"}


@pytest.fixture(scope="module")
def asked(tmp_path_factory):
    return RankRuns(tmp_path_factory, "fr_asked", RECORDED, timeout=300, env=ASKED)


@pytest.fixture(scope="module")
def off(tmp_path_factory):
    return RankRuns(tmp_path_factory, "fr_off", RECORDED, timeout=300, env=OFF)


def _recorder(run):
    return all(run.value("_has_recorder"))


def test_gloo_records_entries(asked):
    """The reference is not empty where torch has the recorder: gloo's
    groups record their collectives (else the comparison below proves
    nothing); on a torch without it gloo records nothing, and the run
    under `mpcore run` is then mpcore's as always."""
    run = asked.get("gloo", 2)
    run.check_finished()
    if not _recorder(run):
        got = asked.get("run-gloo", 2)
        got.check_finished()
        assert all(i["type"] == MPCORE_PG for i in got.value("_identity"))
        return
    for r, v in enumerate(run.value("entries")):
        names = [e["profiling_name"] for e in v["entries"]]
        assert "gloo:all_reduce" in names and "gloo:broadcast" in names, (r, names)
        assert v["json_names"] == names, (r, v["json_names"], names)


def test_recorder_asked_keeps_gloos_groups(asked):
    """Under `mpcore run`, with the recorder asked for, the groups are
    gloo's own, and the recorder's dump holds the entries plain torch's
    holds: the same operations, groups, sequence numbers, sizes and dtypes."""
    ref = asked.get("gloo", 2)
    got = asked.get("run-gloo", 2)
    got.check_finished()
    if not _recorder(ref):   # gloo records nothing: nothing changes
        assert all(i["type"] == MPCORE_PG for i in got.value("_identity"))
        return
    for r, ident in enumerate(got.value("_identity")):
        assert ident["type"] != MPCORE_PG and ident["backend"] == "gloo", (r, ident)
    assert all(got.value("_mpcore_imported"))   # `mpcore run` served the program
    assert got.value("ddp") == ref.value("ddp")   # torch's own DDP too
    want, have = ref.value("entries"), got.value("entries")
    for r in range(2):
        assert have[r] == want[r], f"rank {r}:\n got {have[r]}\nwant {want[r]}"


def test_one_warning_says_why(asked):
    """Each rank (a program of its own here) is told once why its gloo
    groups stay gloo's; the reference, plain python, is told nothing (nor
    is a rank where gloo records nothing)."""
    if not _recorder(asked.get("gloo", 2)):   # gloo records nothing: nothing to say
        for log in asked.get("run-gloo", 2).logs:
            assert WARNING not in log
        return
    for r, log in enumerate(asked.get("run-gloo", 2).logs):
        assert log.count(WARNING) == 1, (r, log[-3000:])
        assert "TORCH_FR_BUFFER_SIZE=2000" in log, (r, log[-3000:])
    for log in asked.get("gloo", 2).logs:
        assert WARNING not in log


def test_recorder_off_served_by_mpcore(off):
    """With the recorder turned off (TORCH_FR_BUFFER_SIZE=0) the groups are
    mpcore's, without a warning, and the dump is as empty as gloo's."""
    ref, got = off.get("gloo", 2), off.get("run-gloo", 2)
    ref.check_finished()
    got.check_finished()
    for r, ident in enumerate(got.value("_identity")):
        assert ident["type"] == MPCORE_PG, (r, ident)
    for log in got.logs:
        assert WARNING not in log
    if _recorder(ref):
        for r, (want, have) in enumerate(zip(ref.value("entries"), got.value("entries"))):
            assert want["entries"] == [] and have["entries"] == [], (r, want, have)


def test_nothing_left_behind(asked, off):
    for runs in (asked, off):
        assert runs.runs, "no run happened"
        assert not runs.leftovers(), runs.leftovers()


def _doctor(*args, env=None):
    require(os.path.exists(MPCORE), f"the mpcore command is not installed at {MPCORE}")
    e = {k: v for k, v in fresh_env().items() if k not in ("TORCH_FR_BUFFER_SIZE",
                                                           "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    e.update(env or {})
    r = run_in_session([MPCORE, "doctor", *args], env=e, timeout=120)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


def _has_recorder():
    import torch._C._distributed_c10d as c10d_c
    return hasattr(c10d_c, "_dump_fr_trace")


@pytest.mark.timeout(300)
def test_doctor_says_gloo_groups_not_served():
    """With the recorder asked for, doctor lists the distributed backend
    (and DDP) as not served and why, in text and in --json (on a torch without the
    recorder: served, as always)."""
    r = _doctor("--json", env=ASKED)
    t = json.loads(r.stdout)["torch_api"]
    backend = [f for f in t["features"] if f["feature"] == "distributed backend"]
    assert len(backend) == 1, t["features"]
    if not _has_recorder():
        assert backend[0]["served"] is True, backend
        assert t["flight_recorder"]["left_to_gloo"] is None
        return
    assert backend[0]["served"] is False, backend
    assert backend[0]["why"].startswith(WARNING), backend
    assert "TORCH_FR_BUFFER_SIZE=2000" in backend[0]["why"], backend
    assert t["flight_recorder"]["left_to_gloo"] == backend[0]["why"]
    ddp = [f for f in t["features"] if f["feature"] == "DDP"]
    assert ddp[0]["served"] is False and ddp[0]["why"] == backend[0]["why"], ddp
    text = " ".join(_doctor(env=ASKED).stdout.split())   # the lines joined as one
    assert f"not served: distributed backend ({WARNING} (TORCH_FR_BUFFER_SIZE=2000)" in text, text
    assert "gloo groups are gloo's" in text


@pytest.mark.timeout(300)
def test_doctor_notes_the_default_recorder():
    """With neither variable set, the groups are served, and doctor says
    that the recorder torch keeps on by default lacks their collectives."""
    r = _doctor("--json")
    t = json.loads(r.stdout)["torch_api"]
    backend = [f for f in t["features"] if f["feature"] == "distributed backend"]
    assert backend[0]["served"] is True, backend
    note = t["flight_recorder"]["note"]
    if not _has_recorder():
        assert note is None
        return
    assert note and "lack the collectives of mpcore's groups" in note, note
    text = " ".join(_doctor().stdout.split())
    assert "lack the collectives of mpcore's groups" in text, text
