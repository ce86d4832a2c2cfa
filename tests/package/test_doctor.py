"""`mpcore doctor`: the installed command, in text and --json, problems it
is made to find, a machine without torch, and nothing left behind.

Each doctor run is a fresh program in a session of its own (run_in_session
waits for every process of it to go, and fails naming any that stays);
the runs are shared by the tests of this module."""
import json
import os
import resource
import sys
from importlib import metadata

import pytest

from helpers import (TESTS_ON_PATH, exited, fresh_env, program_result, require,
                      run_in_session, shm_gained)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("leak_check")]

MPCORE = os.path.join(os.path.dirname(sys.executable), "mpcore")
MIB = 1 << 20
SECTIONS = ("memory", "dev_shm", "nofile", "start_methods", "zygote", "versions", "nccl",
            "gpus", "entry_points", "torch_api", "unchecked", "problems")


def doctor(*args, env=None, nofile=None):
    """Runs the installed `mpcore doctor` (under a lowered RLIMIT_NOFILE
    when nofile is given); returns its CompletedProcess, with shm_gained:
    the /dev/shm entries that appeared meanwhile and that no other program
    maps (NOTE [ Whose /dev/shm entry is it ])."""
    require(os.path.exists(MPCORE), f"the mpcore command is not installed at {MPCORE}")
    cmd = [MPCORE, "doctor", *args]
    if nofile is not None:
        # setrlimit, then exec: the limit is the command's from its start
        cmd = [sys.executable, "-c",
               "import os, resource, sys; "
               f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile})); "
               "os.execv(sys.argv[1], sys.argv[1:])", *cmd]
    e = fresh_env()
    e.update(env or {})
    before = set(os.listdir("/dev/shm"))
    r = run_in_session(cmd, env=e, timeout=90)
    r.shm_gained = shm_gained(before)
    return r


def as_json(r):
    try:
        return json.loads(r.stdout)
    except ValueError:
        pytest.fail(f"doctor --json printed no JSON object (rc {r.returncode}):\n"
                    f"{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}")


@pytest.fixture(scope="module")
def report():
    r = doctor("--json")
    return r, as_json(r)


THREAD_AT_IMPORT = """import threading
threading.Thread(target=threading.Event().wait, daemon=True).start()
"""


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """An environment whose processes (the zygote's too) find a torch that
    cannot be imported, first on their path: a machine without torch.  Its
    directory also holds a module that starts a thread when imported."""
    d = tmp_path_factory.mktemp("no_torch")
    (d / "torch").mkdir()
    (d / "torch" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    (d / "doctor_thread_at_import.py").write_text(THREAD_AT_IMPORT)
    return {"PYTHONPATH": str(d)}


@pytest.fixture(scope="module")
def provoked(no_torch):
    """The text report without torch, with two problems at once:
    RLIMIT_NOFILE 64 for 4 workers, and a zygote whose preload leaves a
    thread running (so it must refuse to fork)."""
    return doctor("--workers", "4", nofile=64,
                  env=dict(no_torch, MPCORE_ZYGOTE_PRELOAD="doctor_thread_at_import"))


def test_json_has_every_section_with_its_types(report):
    r, rep = report
    assert r.returncode == (1 if rep["problems"] else 0), (r.returncode, rep["problems"])
    assert set(SECTIONS) <= set(rep), sorted(rep)
    assert rep["unchecked"] == [], [rep[name] for name in rep["unchecked"]]
    m = rep["memory"]
    assert m["cgroup_version"] in (None, 1, 2)
    for k in ("limit_bytes", "usage_bytes", "headroom_bytes"):
        assert m[k] is None or (isinstance(m[k], int) and m[k] >= 0), (k, m[k])
    assert (m["limit_bytes"] is None) == (m["headroom_bytes"] is None)
    if m["limit_bytes"] is not None:
        assert m["headroom_bytes"] == max(0, m["limit_bytes"] - m["usage_bytes"])
    assert isinstance(m["mpcore_available_bytes"], int) and m["mpcore_available_bytes"] > 0
    s = rep["dev_shm"]
    if s["present"]:
        assert isinstance(s["size_bytes"], int) and 0 <= s["free_bytes"] <= s["size_bytes"]
    n = rep["nofile"]
    limits = [None if x == resource.RLIM_INFINITY else x
              for x in resource.getrlimit(resource.RLIMIT_NOFILE)]
    assert [n["soft"], n["hard"]] == limits  # inherited from this process
    assert n["workers"] == len(os.sched_getaffinity(0)) and n["needed"] > n["workers"]
    sm = rep["start_methods"]
    assert sm["default"] in sm["available"] and "spawn" in sm["available"]
    v = rep["versions"]
    # the installed distributions' versions (importing torch here would cost seconds)
    assert (v["torch"], v["numpy"]) == (metadata.version("torch"), metadata.version("numpy"))
    assert v["built_for_python"].split(".")[:2] == v["python"].split(".")[:2]
    assert v["built_numpy_abi"].startswith("0x") and v["built_numpy_oldest"]
    g = rep["gpus"]
    assert isinstance(g["torch_cuda_available"], bool) and isinstance(g["torch_devices"], list)
    assert g["torch_cuda_version"] is None or isinstance(g["torch_cuda_version"], str)
    assert g["torch_cuda_available"] == bool(g["torch_devices"])
    assert isinstance(rep["problems"], list) and all(isinstance(p, str) for p in rep["problems"])
    assert not r.shm_gained, r.shm_gained


def test_zygote_started_forked_a_child_and_is_gone(report):
    r, rep = report
    z = rep["zygote"]
    assert z["started"] and z["child_forked"], z
    assert z["route"] == "forked at torch's import", z
    assert isinstance(z["threads_at_preload"], int) and z["threads_at_preload"] >= 1
    assert z["python_threads_at_preload"] == 1
    assert exited(z["pid"]), "the zygote outlived doctor"


def test_nccl_found_with_its_path_and_version(report):
    from mpcore.dist import _nccl
    wheel = _nccl.wheel_paths()
    require(wheel, "no nvidia-nccl wheel on sys.path")
    nc = report[1]["nccl"]
    assert nc["found"], nc
    assert os.path.realpath(nc["path"]) in {os.path.realpath(p) for p in wheel}, nc
    major, minor, patch = (int(x) for x in nc["version"].split("."))
    assert major == 2 and minor > 0, nc


def test_entry_points_are_what_mpcore_run_patches(report):
    e = report[1]["entry_points"]
    served = set(e["served"])
    for name in ("torch.multiprocessing.Process", "torch.multiprocessing.spawn",
                 "torch.utils.data.DataLoader", "torch.nn.parallel.DistributedDataParallel",
                 "torch.storage.UntypedStorage.share_memory_",
                 "torch.distributed.distributed_c10d.BackendConfig",
                 "torch.distributed.monitored_barrier",
                 # functions that wear their torch function's name and module
                 "torch.distributed.send", "torch.distributed.all_to_all_single",
                 "torch.distributed.distributed_c10d._set_pg_timeout"):
        assert name in served, (name, sorted(served))
    assert {"torch.Tensor", "torch.storage.UntypedStorage",
            "numpy.ndarray"} <= set(e["pickled_by_mpcore"])
    # everything listed is torch's or torchdata's, mpcore's under `mpcore run`
    assert all(n.startswith(("torch.", "torchdata.")) for n in served), served
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError:
        return
    assert "torchdata.stateful_dataloader.StatefulDataLoader" in served, sorted(served)


def test_torch_api_says_the_window_what_is_served_and_the_table(report):
    # NOTE [ What doctor says of the torch ]
    r, rep = report
    t = rep["torch_api"]
    from mpcore import _torchapi
    assert t["torch"] == metadata.version("torch") and t["in_window"] is True
    assert t["window"] == list(_torchapi.WINDOW)
    features = {f["feature"]: f for f in t["features"]}
    assert set(features) == set(_torchapi.FEATURES)
    for f in features.values():
        assert f["served"] in (True, False), f
        assert f["served"] or f["why"], f       # a feature not served says why
    assert features["tensor handles"]["served"] and features["torch.multiprocessing"]["served"]
    rows = {row["target"]: row for row in t["table"]}
    assert set(rows) == set(_torchapi.TABLE)
    for row in rows.values():
        assert row["status"] in ("ok", "replaced", "added", "checked", "kept torch's", "missing",
                                 "wrong shape"), row
        assert row["status"] not in ("missing", "wrong shape") or row["why"], row
    assert rows["torch.multiprocessing.Process"]["status"] == "replaced"
    assert rows["torch.utils.data.DataLoader"]["status"] == "replaced"
    assert not [p for p in rep["problems"] if "window" in p]
    text = doctor()
    assert "the torch window and what mpcore serves on it" in text.stdout
    assert f"torch {t['torch']}: inside mpcore's window" in text.stdout


def test_text_reports_every_section_and_one_line_per_problem(provoked):
    r = provoked
    assert r.returncode == 1, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    out = r.stdout
    for head in ("memory cgroup", "/dev/shm", "open files (RLIMIT_NOFILE)", "start methods",
                 "zygote", "versions", "NCCL", "GPUs",
                 "torch entry points served under `mpcore run`"):
        assert f"\n{head}\n" in f"\n{out}", (head, out)
    assert "mpcore does not depend on it" in out
    assert "soft 64, hard 64" in out
    assert "\n2 problem(s):\n" in out, out
    problems = [ln for ln in out.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 2, out
    nofile = [ln for ln in problems if "RLIMIT_NOFILE soft limit 64" in ln]
    assert len(nofile) == 1 and "4 workers" in nofile[0] and "ulimit" in nofile[0], problems
    zyg = [ln for ln in problems if "the zygote cannot fork" in ln]
    assert len(zyg) == 1 and "2 threads" in zyg[0] and "doctor_thread_at_import" in zyg[0], \
        problems
    assert "started by exec" in out and "forked a test child: no" in out, out
    assert not r.shm_gained, r.shm_gained


def test_without_torch_every_section_is_still_reported(provoked):
    # (the two problems above are the only ones: no check failed for want of torch)
    out = provoked.stdout
    assert "torch not installed, numpy " in out, out
    assert "\n  none: torch is not installed\n" in out, out
    assert "\n  pickled through mpcore's shared memory: numpy.ndarray\n" in out, out
    assert "\n  torch: none\n" in out, out


def test_text_lists_torch_entry_points_by_where_they_are(report):
    from mpcore import _doctor
    rep = report[1]
    text = _doctor.render(rep)
    mp_line = next(ln for ln in text.splitlines() if ln.startswith("  torch.multiprocessing: "))
    assert "Process" in mp_line.split(": ", 1)[1].split(", "), mp_line
    assert "\n  torch.utils.data: DataLoader\n" in text, text
    assert "pickled through mpcore's shared memory: numpy.ndarray, torch.Tensor" in text, text
    problems = [ln for ln in text.splitlines() if ln.startswith("  - ")]
    assert problems == [f"  - {p}" for p in rep["problems"]], (problems, rep["problems"])


def test_zygote_check_reaps_what_it_starts(no_torch):
    # In the process that ran the check: no child left but the keeper and
    # multiprocessing's resource tracker, which live as long as it does.
    # (Without torch, so that no one waits for its import: the zygote is a
    # child of this process either way, stopped and reaped the same way.)
    code = TESTS_ON_PATH + """
import json, os
import mpcore._core as core
from mpcore import _doctor
from helpers import children_of, is_resource_tracker
z = _doctor.zygote()
kids = [(p, s) for p, s in children_of(os.getpid())
        if p != core.keeper_pid() and not is_resource_tracker(p)]
print("RESULT " + json.dumps({"zygote": z, "kids": kids}))
"""
    env = fresh_env()
    env.update(no_torch)
    r = run_in_session([sys.executable, "-c", code], env=env, timeout=90)
    res = program_result(r)
    assert res["zygote"]["started"] and res["zygote"]["child_forked"], res
    assert res["kids"] == [], res


def test_bad_arguments_exit_2_and_help_says_the_exit_status(capsys):
    r = doctor("--bogus")
    assert r.returncode == 2 and "unknown argument '--bogus'" in r.stderr, r.stderr
    from mpcore import _doctor
    for bad in (["--workers", "zero"], ["--workers", "0"], ["--workers"]):
        assert _doctor.main(bad) == 2, bad
        assert "--workers needs a positive integer" in capsys.readouterr().err
    assert _doctor.main(["--help"]) == 0
    assert "1 when there are problems" in capsys.readouterr().out


def test_problem_lines_say_what_to_do():
    from mpcore import _doctor
    gib = 1 << 30
    m = {"cgroup": "/sys/fs/cgroup/job", "limit_bytes": 8 * gib, "usage_bytes": 8 * gib - 100,
         "headroom_bytes": 100}
    (line,) = _doctor.memory_problems(m)
    assert "/sys/fs/cgroup/job" in line and "OOM" in line and "raise the limit" in line, line
    assert _doctor.memory_problems(dict(m, usage_bytes=gib, headroom_bytes=7 * gib)) == []
    assert _doctor.memory_problems(dict(m, limit_bytes=None, headroom_bytes=None)) == []
    n = _doctor.nofile(64)
    (line,) = _doctor.nofile_problems(dict(n, soft=1024, hard=1048576))
    assert "soft limit 1024" in line and "64 workers" in line and "`ulimit -n 65536`" in line
    (line,) = _doctor.nofile_problems(dict(n, soft=1024, hard=4096))
    assert "`ulimit -n 4096` (the hard limit)" in line, line
    assert _doctor.nofile_problems(dict(n, soft=n["needed"], hard=n["needed"])) == []
    assert _doctor.nofile_problems(dict(n, soft=None, hard=None)) == []  # unlimited
    t = {"torch": "2.5.1", "in_window": False, "window_lifted": False, "window": ["2.6", "2.14.1"]}
    (line,) = _doctor.torch_api_problems(t)
    assert "torch 2.5.1 is outside mpcore's window (torch 2.6 to 2.14.1)" in line, line
    assert "`pip install 'torch>=2.6,<=2.14.1'`" in line, line
    assert _doctor.torch_api_problems(dict(t, in_window=True)) == []
    assert _doctor.torch_api_problems(dict(t, window_lifted=True)) == []
    assert _doctor.torch_api_problems(dict(t, torch=None)) == []


def _cgroup_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return str(root)


def test_memory_cgroup_v2_and_v1_limits_and_ancestors(tmp_path):
    from mpcore import _doctor
    gib = 1 << 30
    # v2: the job's limit binds; its step has none of its own ("max")
    sysfs = _cgroup_tree(tmp_path / "v2", {
        "job/memory.max": str(8 * gib), "job/memory.current": str(gib),
        "job/step/memory.max": "max", "job/step/memory.current": str(gib // 2)})
    m = _doctor.memory("0::/job/step\n", sysfs)
    assert m["cgroup_version"] == 2 and m["cgroup"] == f"{sysfs}/job", m
    assert (m["limit_bytes"], m["usage_bytes"], m["headroom_bytes"]) == (8 * gib, gib, 7 * gib)
    assert _doctor.memory_problems(m) == []
    # ... and when the step's own limit leaves less, it is the one reported
    sysfs = _cgroup_tree(tmp_path / "v2", {"job/step/memory.max": str(2 * gib),
                                           "job/step/memory.current": str(2 * gib - 5 * MIB)})
    m = _doctor.memory("0::/job/step\n", sysfs)
    assert m["cgroup"] == f"{sysfs}/job/step" and m["headroom_bytes"] == 5 * MIB, m
    (line,) = _doctor.memory_problems(m)
    assert f"memory cgroup {sysfs}/job/step leaves 5 MiB of its 2048 MiB limit" in line, line
    # v1 without a limit (the largest page-aligned int64): "no limit"
    sysfs = _cgroup_tree(tmp_path / "v1", {
        "memory/a/memory.limit_in_bytes": "9223372036854771712",
        "memory/a/memory.usage_in_bytes": str(gib)})
    m = _doctor.memory("4:memory:/a\n1:cpu:/\n0::/\n", sysfs)
    assert m["cgroup_version"] == 1 and m["cgroup"] == f"{sysfs}/memory/a", m
    assert m["limit_bytes"] is None and m["headroom_bytes"] is None, m
    # no memory cgroup at all
    m = _doctor.memory("", sysfs)
    assert m["cgroup_version"] is None and m["limit_bytes"] is None, m
