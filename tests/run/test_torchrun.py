"""Tests of `mpcore run` with torchrun's command line (pkg/mpcore/_torchrun.py)
and of init_process_group under torchelastic's agent store (_dist.py).

Starting a launcher costs seconds (torch's import, and torchrun's ranks
each import it again), so the module starts few: one set of jobs at once
(real torchrun and two `mpcore run` jobs side by side) that several tests
read, and one launcher per fault.  Every launcher runs under the helpers'
Scenario (its whole process tree is found through an environment tag and
reaped) and each test checks that nothing was left behind.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import Scenario, exited, scaled
from helpers.ranks import free_port, left_behind

pytestmark = pytest.mark.timeout(120)

BIN = os.path.dirname(sys.executable)
MPCORE = os.path.join(BIN, "mpcore")
TORCHRUN = os.path.join(BIN, "torchrun")

ENV_NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
             "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
             "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS")

# What a rank sees and computes; the same text under torchrun and mpcore run.
# It asks mpcore.distributed for its group, so that under torchrun too it
# goes through mpcore's init_process_group (the agent's store).
# No `if __name__ == "__main__"` guard, as in many programs torchrun starts:
# the DataLoader's workers must not run it again.
PROG = r'''
import json, multiprocessing, os, sys
import torch
import mpcore.distributed as dist
NAMES = %r
env = {n: os.environ.get(n) for n in NAMES}
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
method = multiprocessing.get_start_method(allow_none=True)
loaded = [b.tolist() for b in torch.utils.data.DataLoader(range(6), batch_size=4, num_workers=2)]
line = json.dumps({"env": env, "argv": sys.argv, "name": __name__, "path0": sys.path[0],
                   "sum": t.item(), "mp": dist.shm_group_active(), "start_method": method,
                   "loaded": loaded, "threads": torch.get_num_threads()})
os.write(1, f"rank-line {line}\n".encode())  # one write: the ranks share stdout
dist.destroy_process_group()
# Left to the interpreter's end: a file never flushed, and an atexit handler.
import atexit
tag = f"{env['TORCHELASTIC_RUN_ID']}.{env['RANK']}"
kept = open(f"{tag}.open", "w")
kept.write("left open")
atexit.register(lambda: open(f"{tag}.atexit", "w").close())
''' % (ENV_NAMES,)


def _env(scenario, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MPCORE_", "PET_", "TORCHELASTIC_")) and k not in (
               "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
               "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}
    env.update(scenario.env())
    env.update(extra)
    return env


class Job:
    """A launcher in a session of its own, its output in files (read while
    it runs)."""

    def __init__(self, cmd, cwd, env, name, ignore_sigint=False):
        self.out_path = os.path.join(cwd, f"{name}.out")
        self.err_path = os.path.join(cwd, f"{name}.err")
        # ignore_sigint: as a shell starts a job in the background
        pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.p = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=out,
                                      stderr=err, start_new_session=True, preexec_fn=pre)

    @property
    def out(self):
        with open(self.out_path) as f:
            return f.read()

    @property
    def err(self):
        with open(self.err_path) as f:
            return f.read()

    def wait(self, timeout=90):
        try:
            return self.p.wait(scaled(timeout))
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
            pytest.fail(f"the launcher did not finish within {scaled(timeout):g}s\n{self.out}\n"
                        f"{self.err}")

    def wait_for(self, pattern, count=1, timeout=60):
        """Waits until `pattern` has appeared `count` times in stdout (or the
        launcher has ended); returns the matches."""
        deadline = time.monotonic() + scaled(timeout)
        while True:
            found = re.findall(pattern, self.out, re.M)
            if len(found) >= count:
                return found
            if self.p.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{pattern!r} x{count} never came (exit {self.p.poll()})\n"
                            f"{self.out}\n{self.err}")
            time.sleep(0.02)


def rank_lines(job):
    return {d["env"]["RANK"]: d for d in
            (json.loads(line.split(" ", 1)[1]) for line in job.out.splitlines()
             if line.startswith("rank-line "))}


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """torchrun and two mpcore run jobs, all started at once, with the same
    flags and program."""
    d = tmp_path_factory.mktemp("torchrun")
    (d / "prog.py").write_text(PROG)
    sc = Scenario()
    args = ["--nproc-per-node", "2", "prog.py", "a", "--b=c"]
    jobs = {"torchrun": Job([TORCHRUN, *args], d, _env(sc), "torchrun"),
            "mpcore1": Job([MPCORE, "run", *args], d, _env(sc), "mpcore1"),
            # the same flags spelt as torchrun also takes them: underscores, PET_* defaults
            "mpcore2": Job([MPCORE, "run", "--max_restarts=0", *args[2:]], d,
                           _env(sc, PET_NPROC_PER_NODE="2"), "mpcore2")}
    try:
        for job in jobs.values():
            job.wait()
        jobs["left"] = left_behind(sc)
        jobs["dir"] = d
    finally:
        sc.close()
    return jobs


def _same_but_per_job(a, b, local_rank):
    """The environments agree, except values each job must choose itself,
    which have torchrun's form in both."""
    a, b = dict(a), dict(b)
    for env in (a, b):
        assert env.pop("MASTER_PORT").isdigit()
        assert re.fullmatch(r"[0-9a-f-]{36}", env.pop("TORCHELASTIC_RUN_ID"))
        assert env.pop("TORCHELASTIC_ERROR_FILE").endswith(f"/attempt_0/{local_rank}/error.json")
    assert a == b


def test_workers_see_what_torchrun_gives(side_by_side):
    theirs, ours = rank_lines(side_by_side["torchrun"]), rank_lines(side_by_side["mpcore1"])
    assert sorted(theirs) == sorted(ours) == ["0", "1"], (side_by_side["mpcore1"].err,
                                                          side_by_side["torchrun"].err)
    for r in ("0", "1"):
        t, o = theirs[r], ours[r]
        _same_but_per_job(t.pop("env"), o.pop("env"), r)
        assert t.pop("mp") and o.pop("mp")  # mpcore's group in both
        assert t == o  # argv, __name__, sys.path[0], the all_reduce, the start method, the loader
        assert o["sum"] == 3.0 and o["argv"] == ["prog.py", "a", "--b=c"]
        assert o["start_method"] is None and o["loaded"] == [[0, 1, 2, 3], [4, 5]]
        assert o["threads"] == 1  # torchrun's OMP_NUM_THREADS=1, as a fresh import reads it
    for job in ("torchrun", "mpcore1"):
        assert side_by_side[job].p.returncode == 0, side_by_side[job].err


def test_omp_threads_and_agent_store(side_by_side):
    ours = rank_lines(side_by_side["mpcore1"])
    assert {d["env"]["OMP_NUM_THREADS"] for d in ours.values()} == {"1"}
    assert {d["env"]["TORCHELASTIC_USE_AGENT_STORE"] for d in ours.values()} == {"True"}
    # mpcore's init_process_group under torchrun's agent uses the agent's
    # store instead of binding the agent's port again.
    for job in ("torchrun", "mpcore1", "mpcore2"):
        assert "failed to bind" not in side_by_side[job].err, side_by_side[job].err


def test_a_rank_ends_as_python_would(side_by_side):
    # NOTE [ A spawned child ends as python would ]: as a `python -u` rank
    # of torchrun's, a rank's unflushed file is written and its atexit
    # handlers run when its program ends.
    for job in ("torchrun", "mpcore1", "mpcore2"):
        lines = rank_lines(side_by_side[job])
        assert sorted(lines) == ["0", "1"], side_by_side[job].err
        for r, d in lines.items():
            tag = side_by_side["dir"] / f"{d['env']['TORCHELASTIC_RUN_ID']}.{r}"
            assert open(f"{tag}.open").read() == "left open", (job, r)
            assert os.path.exists(f"{tag}.atexit"), (job, r)


def test_two_jobs_at_once_on_one_node(side_by_side):
    a, b = rank_lines(side_by_side["mpcore1"]), rank_lines(side_by_side["mpcore2"])
    assert side_by_side["mpcore2"].p.returncode == 0, side_by_side["mpcore2"].err
    assert [d["sum"] for d in b.values()] == [3.0, 3.0]  # 2 ranks, from PET_NPROC_PER_NODE
    for r in ("0", "1"):
        _same_but_per_job(a[r]["env"], b[r]["env"], r)
    assert a["0"]["env"]["MASTER_PORT"] != b["0"]["env"]["MASTER_PORT"]
    assert a["0"]["env"]["TORCHELASTIC_RUN_ID"] != b["0"]["env"]["TORCHELASTIC_RUN_ID"]
    assert not side_by_side["left"], side_by_side["left"]


FAIL = r'''
import atexit, os, time
rank = int(os.environ["RANK"])
def deep():
    raise ValueError(f"boom from rank {rank}")
print("up", rank, flush=True)
if rank == 1:
    kept = open("rank1.open", "w")
    kept.write("left open")
    atexit.register(lambda: open("rank1.atexit", "w").close())
    deep()
time.sleep(120)   # rank 0 must be stopped by the launcher
'''


def test_failing_rank_traceback_error_file_and_summary(tmp_path, scenario):
    (tmp_path / "fail.py").write_text(FAIL)
    sc = scenario
    job = Job([MPCORE, "run", "--nproc-per-node", "2", "--log-dir", tmp_path / "logs",
               "fail.py"], tmp_path, _env(sc), "fail")
    assert job.wait() == 1
    err = job.err
    # The rank's traceback, with its rank on every line, from the program's frames.
    assert "[rank1]: Traceback (most recent call last):" in err
    assert re.search(r'\[rank1\]:   File ".*fail.py", line 5, in deep', err), err
    assert "[rank1]: ValueError: boom from rank 1" in err
    # It ended as python would: its open file flushed, its atexit handler run.
    assert (tmp_path / "rank1.open").read_text() == "left open"
    assert (tmp_path / "rank1.atexit").exists()
    # torchrun's summary, naming the rank, its exit code and its error file.
    summary = err[err.index("ChildFailedError"):]
    assert "fail.py FAILED" in summary
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", summary), summary
    assert re.search(r"exitcode\s*: 1 \(pid: \d+\)", summary), summary
    path = re.search(r"error_file: (\S+)", summary).group(1)
    assert path.endswith("/attempt_0/1/error.json")
    # torchelastic's format, without @record.
    with open(path) as f:
        data = json.load(f)
    msg = data["message"]
    assert msg["message"] == "ValueError: boom from rank 1"
    stack = msg["extraInfo"]["py_callstack"]
    assert stack.startswith("Traceback (most recent call last):")
    assert "fail.py" in stack and "site-packages" not in stack
    assert msg["extraInfo"]["timestamp"].isdigit()
    assert "boom from rank 1" in summary  # the summary carries the traceback
    # rank 0 was stopped by the launcher: it has no error of its own
    assert not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(path)), "0",
                                           "error.json"))
    assert not left_behind(sc)


RESTART = r'''
import json, os, signal
import torch
import torch.distributed as dist
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
stale = [k for k in ("attempt0", "attempt1") if store.check([k])]
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
dist.barrier()
store.set(f"attempt{attempt}", "1")
line = json.dumps({"rank": rank, "attempt": attempt, "stale": stale, "sum": t.item(),
                   "pid": os.getpid()})
os.write(1, f"rank-line {line}\n".encode())
if attempt == 0 and rank == 1:
    raise RuntimeError("crash in attempt 0")
if attempt == 1 and rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()   # the other rank of a failed attempt waits here until stopped
os.write(1, f"done {rank}\n".encode())
'''


def test_max_restarts_after_a_crash_and_a_sigkill(tmp_path, scenario):
    (tmp_path / "restart.py").write_text(RESTART)
    sc = scenario
    job = Job([MPCORE, "run", "--nproc-per-node", "2", "--max-restarts", "2", "restart.py"],
              tmp_path, _env(sc), "restart")
    assert job.wait() == 0, job.err
    lines = [json.loads(line.split(" ", 1)[1]) for line in job.out.splitlines()
             if line.startswith("rank-line ")]
    assert sorted((d["attempt"], d["rank"]) for d in lines) == [
        (a, r) for a in range(3) for r in range(2)], job.out
    # Each attempt works in a fresh key space, with new processes.
    assert all(d["stale"] == [] and d["sum"] == 3.0 for d in lines), lines
    assert len({d["pid"] for d in lines}) == 6
    assert sorted(re.findall(r"^done (\d)", job.out, re.M)) == ["0", "1"]
    assert "RuntimeError: crash in attempt 0" in job.err
    assert re.search(r"failed \(exitcode: -9\) local_rank: 0", job.err), job.err
    assert not left_behind(sc)


SIGNALS = r'''
import os, signal, sys, time
rank = int(os.environ["RANK"])
def on_usr(signum, frame):
    os.write(1, f"{signal.Signals(signum).name} {rank}\n".encode())
def on_term(signum, frame):
    os.write(1, f"SIGTERM {rank}\n".encode())
    if rank == 0:
        sys.exit(0)
    # rank 1 stays: it gets SIGKILL after the grace
signal.signal(signal.SIGUSR1, on_usr)
signal.signal(signal.SIGUSR2, on_usr)
signal.signal(signal.SIGTERM, on_term)
os.write(1, f"ready {rank} {os.getpid()}\n".encode())
while True:
    time.sleep(0.05)
'''


# The ranks as Python programs (from the zygote), and as binaries
# (--no-python: exec'd, the interpreter standing in for any binary).
PROGRAM = {"python": ["sig.py"], "binary": ["--no-python", sys.executable, "sig.py"]}


@pytest.mark.parametrize("kind", sorted(PROGRAM))
def test_signals_forwarded_and_grace(tmp_path, scenario, kind):
    (tmp_path / "sig.py").write_text(SIGNALS)
    sc = scenario
    job = Job([MPCORE, "run", "--nproc-per-node", "2", "--shutdown-timeout", "1",
               *PROGRAM[kind]], tmp_path, _env(sc), "sig")
    pids = dict((int(r), int(p)) for r, p in job.wait_for(r"^ready (\d) (\d+)$", 2))
    for name in ("SIGUSR1", "SIGUSR2"):
        job.p.send_signal(getattr(signal, name))
        assert sorted(job.wait_for(rf"^{name} (\d)$", 2)) == ["0", "1"]
    assert job.p.poll() is None  # forwarded, and the job goes on
    job.p.send_signal(signal.SIGTERM)
    start = time.monotonic()
    assert job.wait() == -signal.SIGTERM
    assert sorted(job.wait_for(r"^SIGTERM (\d)$", 2)) == ["0", "1"]
    assert time.monotonic() - start < scaled(20)  # a 1 s grace, not torchrun's 30 s
    # rank 1 ignores SIGTERM: SIGKILL after the grace; rank 0 ended by itself
    killed = re.findall(r"Unable to shutdown process (\d+) via 15, forcefully exiting via 9",
                        job.err)
    assert killed == [str(pids[1])], job.err
    assert "leaked" not in job.err
    for pid in pids.values():
        assert exited(pid)
    assert not left_behind(sc)



@pytest.mark.parametrize("kind", sorted(PROGRAM))
def test_ranks_die_with_a_sigkilled_launcher(tmp_path, scenario, kind):
    (tmp_path / "sig.py").write_text(SIGNALS)
    sc = scenario
    job = Job([MPCORE, "run", "--nproc-per-node", "2", *PROGRAM[kind]], tmp_path, _env(sc),
              "kill")
    pids = [int(p) for p in job.wait_for(r"^ready \d (\d+)$", 2)]
    job.p.kill()
    job.p.wait()
    left = sc.wait_tree(timeout=10)
    assert not left, sc.describe(left)
    assert all(exited(p) for p in pids)
    assert not left_behind(sc)


def test_a_node_that_never_comes_times_out_naming_it(tmp_path, scenario):
    (tmp_path / "p.py").write_text("print('never')\n")
    sc = scenario
    port = free_port()
    job = Job([MPCORE, "run", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
               "--master-port", port, "--rdzv-conf", "timeout=2", "p.py"],
              tmp_path, _env(sc), "rdzv")
    assert job.wait() == 1
    err = job.err
    assert "never" not in job.out
    assert re.search(rf"rendezvous .* at 127\.0\.0\.1:{port} \(static\) timed out after 2 s: "
                     r"node rank 0 of 2 came", err), err
    assert "1/2 clients joined" in err
    assert "Traceback" not in err
    assert not left_behind(sc)


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_nodes_that_disagree_on_nnodes_both_fail_naming_both(tmp_path, scenario, sigint):
    # NOTE [ Nodes that disagree on --nnodes ]: torch's rendezvous would have
    # both wait out its 600 s join timeout; each ends at once with one line,
    # also when started as a shell's background job (SIGINT ignored)
    (tmp_path / "p.py").write_text("print('rank-ran')\n")
    port = free_port()

    def node(nnodes, name):
        return Job([MPCORE, "run", "--nnodes", nnodes, "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-id", "disagree", "p.py"], tmp_path, _env(scenario), name,
                   ignore_sigint=sigint == "ignored")
    jobs = [node("2", "two"), node("3", "three")]
    for job in jobs:
        assert job.wait(60) == 1, job.err
        err = job.err
        assert "rank-ran" not in job.out
        assert re.search(r"mpcore run: the rendezvous 'disagree' at 127\.0\.0\.1:\d+: .*"
                         r"--nnodes (2:2|3:3).*--nnodes (2:2|3:3); every node must give the "
                         r"same --nnodes", err), err
        assert "2:2" in err and "3:3" in err and "Traceback" not in err, err
    assert not left_behind(scenario)
