"""Starting N ranks of a torch.distributed program, the one way the tests do
it (NOTE [ Starting N ranks ]), and RankRuns: one program on N ranks, the
way torchrun starts them (env:// rendezvous: MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE), once per backend, with what each rank recorded handed to
the tests.

NOTE [ Starting N ranks ]
A rank is a fresh Python program (start_rank): `python SCRIPT ARGS`, or
`python -m mpcore run SCRIPT ARGS` with launcher=True, in the environment
`base` (fresh_env() unless given) plus torchrun's four variables
(torchrun_env: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) plus `extra`;
the caller picks the port (free_port), the other variables (LOCAL_RANK,
...) and how it talks to the rank (Popen's keywords: pipes, a log file, a
session of its own).  RankRuns (below), test_backend.py's Pool,
test_dist_faults.py's Job and test_multinode.py's job start their ranks so.

Some tests start ranks otherwise because the way they start them is what
they test, or because the ranks are not torch.distributed ranks:
  - mpcore.spawn / mp.spawn (proc/test_spawn.py, distributed/test_dist.py):
    the spawn API under test starts them;
  - `mpcore run --nproc-per-node N` and torchrun (run/test_torchrun.py,
    run/test_launcher.py, data/test_shared_data.py's ranks, run/test_article.py)
    and Lightning's own launcher (torch_parity/test_lightning.py): the
    launcher under test starts them;
  - torch's DistributedTest (torch_parity/torch_suite.py): torch's harness
    starts them;
  - the core's collectives (distributed/test_coll_ops.py): each rank is handed
    the fd of a core group made in the test process, below torch.distributed
    and with no rendezvous;
  - two nodes in network namespaces (run/test_torchrun_nodes.py: a launcher
    per node, started through helpers.netns); test_multinode.py's ranks go
    through start_rank with netns's command wrapper (`wrap`);
  - data/test_data_datapipes.py's ranks meet through a file:// store named on
    their command line, as the test's program was written, not env://.

NOTE [ One start per stack ]
Starting ranks costs seconds each (torch's import, on a small shared
machine), so a test module starts its program once per (mode, world size),
lazily, from a module-scoped RankRuns; its tests only read the results.  The
first test that needs a run pays for it, so each test's timeout covers one
run.  Every run happens under helpers.programs.Scenario: its whole process tree
is found through an environment tag, reaped, and checked for leftovers
(processes, keepers, mpcore memfds, /dev/shm entries); the module's last
test asserts that every run left nothing behind.
"""
import os
import select
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from .procfs import mpcore_memfds, mpcore_processes, shm_gained
from .programs import Scenario, fresh_env
from .timescale import scaled

MODES = ("gloo", "mpcore", "run-gloo")
MPCORE_PG = "mpcore.dist._group.ProcessGroupMpcore"

# The first lines of every rank program.
RANK_PRELUDE = r'''
import datetime, os, sys, time, traceback
import torch
import torch.distributed as dist

MODE, OUT = sys.argv[1], sys.argv[2]
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
BACKEND = {"gloo": "gloo", "mpcore": "mpcore", "run-gloo": "gloo"}[MODE]
if MODE == "mpcore":
    import mpcore.distributed  # noqa: F401  (registers the "mpcore" backend)
RESULTS = {}


def _save():
    tmp = os.path.join(OUT, f".rank{RANK}.pt")
    torch.save(RESULTS, tmp)
    os.replace(tmp, os.path.join(OUT, f"rank{RANK}.pt"))


def identity(pg=None):
    """What torch says serves group pg (the default group when None)."""
    pg = pg if pg is not None else dist.group.WORLD
    return {"backend": str(dist.get_backend(pg)),
            "type": type(pg).__module__ + "." + type(pg).__qualname__}


def check(name):
    """Runs fn now and records its value (or its traceback) under name."""
    def run(fn):
        started = time.monotonic()
        try:
            RESULTS[name] = {"value": fn()}
        except Exception:
            RESULTS[name] = {"error": traceback.format_exc()}
            print(f"rank {RANK}: check {name} failed:\n{RESULTS[name]['error']}",
                  file=sys.stderr, flush=True)
        RESULTS[name]["seconds"] = time.monotonic() - started
        _save()
        return fn
    return run


def init():
    # 60 s of a quiet machine (NOTE [ Waits scale with how slow the machine is ])
    seconds = 60 * float(os.environ.get("TEST_TIME_SCALE", "1"))
    dist.init_process_group(BACKEND, timeout=datetime.timedelta(seconds=seconds))
    RESULTS["_identity"] = {"value": identity()}
    RESULTS["_mpcore_imported"] = {"value": "mpcore" in sys.modules}
    _save()


def finish():
    RESULTS["_finished"] = {"value": True}
    _save()
    dist.destroy_process_group()
'''

_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def free_port():
    """A TCP port of 127.0.0.1 free now, for a job's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank, world, port, addr="127.0.0.1"):
    """torchrun's four variables of env:// for rank `rank` of `world`."""
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world)}


def start_rank(script, rank, world, port, args=(), base=None, extra=None, addr="127.0.0.1",
               launcher=False, wrap=None, **popen):
    """Starts rank `rank` of `world` (NOTE [ Starting N ranks ]): `script`
    with `args`, under `mpcore run` when launcher, in `base` (fresh_env()
    when None) with torchrun_env's variables and then `extra`; wrap(cmd)
    may put the command in a namespace.  Returns the Popen."""
    env = dict(fresh_env() if base is None else base)
    env.update(torchrun_env(rank, world, port, addr))
    env.update(extra or {})
    cmd = [sys.executable] + (["-m", "mpcore", "run"] if launcher else [])
    cmd += [str(script)] + [str(a) for a in args]
    return subprocess.Popen(cmd if wrap is None else wrap(cmd), env=env, **popen)


def _bare_env():
    """A fresh program's environment with no mpcore switches and no
    rendezvous variables of ours: what RankRuns' ranks start from."""
    return {k: v for k, v in fresh_env().items()
            if not k.startswith("MPCORE_") and k not in _RENDEZVOUS}


def _local(rank, world):
    """The rest of what RankRuns' ranks get: one node, one thread each."""
    return {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}


def left_behind(sc):
    """What the run under Scenario `sc` left: Scenario.check_clean's checks,
    except that a /dev/shm entry that a live process outside the run maps
    (another program on this machine, not ours) does not count (NOTE [ Whose
    /dev/shm entry is it ])."""
    out = []
    left = sc.wait_tree()
    if left:
        out.append(f"processes still running: {sc.describe(left)}")
    memfds = {p: n for p, n in mpcore_memfds(exclude_pids=(sc.me,)).items() if sc.tagged(p)}
    if memfds:
        out.append(f"mpcore memfds still open: {memfds}")
    keepers = [p for p in mpcore_processes() if sc.tagged(p)]
    if keepers:
        out.append(f"keepers still running: {keepers}")
    ours = shm_gained(sc.shm_before, ours=sc.tagged)
    if ours:
        out.append(f"/dev/shm gained entries no other program maps: {ours}")
    return out


class Run:
    """What one start of a program on `world` ranks left: every rank's
    recorded checks, exit codes and output."""

    def __init__(self, mode, world, outdir, codes, logs, timed_out, leftovers):
        self.mode, self.world, self.outdir = mode, world, outdir
        self.codes, self.logs, self.timed_out, self.leftovers = codes, logs, timed_out, leftovers
        import torch
        self.ranks = []
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.pt")
            self.ranks.append(torch.load(path, weights_only=False) if os.path.exists(path) else {})

    def describe(self):
        head = (f"{self.mode} on {self.world} ranks: exit codes {self.codes}"
                + (" (timed out, killed)" if self.timed_out else ""))
        tails = [f"--- rank {r} output (tail)\n{log[-3000:]}" for r, log in enumerate(self.logs)]
        return "\n".join([head] + tails)

    def value(self, name):
        """[rank 0's value, rank 1's, ...] of check `name`; fails the test
        with the rank's traceback (or the run's output) when a rank has none."""
        out = []
        for r, res in enumerate(self.ranks):
            if name not in res:
                pytest.fail(f"rank {r} recorded no {name!r}\n{self.describe()}")
            if "error" in res[name]:
                pytest.fail(f"{self.mode}, {self.world} ranks, rank {r}: {name!r} raised\n"
                            f"{res[name]['error']}")
            out.append(res[name]["value"])
        return out

    def check_finished(self):
        assert not self.timed_out and self.codes == [0] * self.world, self.describe()
        for r in range(self.world):
            assert self.ranks[r].get("_finished"), f"rank {r} did not finish\n{self.describe()}"


def launch(script, mode, world, outdir, timeout, env=None):
    """Starts `script` on `world` ranks in `mode` under a Scenario and waits
    (on pidfds) for all of them, killing the rest as soon as one fails or the
    deadline (`timeout`, a quiet machine's seconds: scaled) passes.  Returns
    a Run."""
    os.makedirs(outdir, exist_ok=True)
    sc = Scenario()
    procs, logs, leftovers = [], [], []
    timed_out = False
    try:
        port = free_port()
        base = _bare_env()
        for r in range(world):
            log = open(os.path.join(outdir, f"rank{r}.log"), "w+")
            logs.append(log)
            procs.append(start_rank(script, r, world, port, (mode, outdir), base=base,
                                    extra={**_local(r, world), **(env or {}), **sc.env()},
                                    launcher=mode == "run-gloo", stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + scaled(timeout)
        fds = {os.pidfd_open(p.pid): p for p in procs}
        try:
            while fds:
                left = deadline - time.monotonic()
                ready, _, _ = select.select(list(fds), [], [], max(0.0, left))
                if not ready:
                    timed_out = True
                    break
                failed = False
                for fd in ready:
                    p = fds.pop(fd)
                    os.close(fd)
                    failed |= p.wait() != 0
                if failed:
                    # The others would wait for it in their next collective.
                    break
        finally:
            for fd in fds:
                os.close(fd)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        leftovers += left_behind(sc)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        sc.close()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return Run(mode, world, outdir, [p.returncode for p in procs], texts, timed_out, leftovers)


class RankRuns:
    """The runs of one program, each started at most once (NOTE [ One start
    per stack ])."""

    def __init__(self, tmp_path_factory, name, program, timeout=240, env=None):
        self.dir = tmp_path_factory.mktemp(name)
        self.script = str(self.dir / f"{name}.py")
        with open(self.script, "w") as f:
            f.write(RANK_PRELUDE + textwrap.dedent(program))
        # Inductor compiles in the rank itself (no pool of compile workers
        # to start, or to leave semaphores behind), and the runs of a module
        # share one cache, so only its first run pays for compiling.
        self.env = {"TORCHINDUCTOR_COMPILE_THREADS": "1",
                    "TORCHINDUCTOR_CACHE_DIR": str(self.dir / "inductor-cache")}
        self.env.update(env or {})
        self.timeout, self.runs = timeout, {}

    def get(self, mode, world):
        key = (mode, world)
        if key not in self.runs:
            started = time.monotonic()
            self.runs[key] = launch(self.script, mode, world, str(self.dir / f"{mode}-{world}"),
                                    self.timeout, self.env)
            self.runs[key].seconds = time.monotonic() - started
        return self.runs[key]

    def leftovers(self):
        return {f"{m} x{w}": run.leftovers for (m, w), run in self.runs.items() if run.leftovers}


def same(a, b, where="", **tol):
    """Asserts that two recorded values (tensors, numbers, strings, nested
    lists/tuples/dicts) are equal, floating tensors to assert_close's
    tolerances for their dtype (or `tol`)."""
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (where, type(a), type(b))
        torch.testing.assert_close(a, b, msg=lambda m: f"{where}: {m}", **tol)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (where, sorted(a), sorted(b))
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]", **tol)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]", **tol)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_served(run, by_mpcore):
    """The default group of every rank of `run` is mpcore's (or, for the
    reference runs, is not).  Under `mpcore run` this checks the group's
    type only: what dist.get_backend() names there is
    test_backend_collectives.py's test_get_backend_under_run."""
    for r, ident in enumerate(run.value("_identity")):
        if not by_mpcore:
            assert ident["type"] != MPCORE_PG and ident["backend"] == "gloo", (run.mode, r, ident)
        elif run.mode == "run-gloo":
            assert ident["type"] == MPCORE_PG, (run.mode, r, ident)
        else:
            assert ident == {"backend": "mpcore", "type": MPCORE_PG}, (run.mode, r, ident)


def stack_tests(worlds, runs):
    """The tests every stack module has, for its `runs` fixture: the gloo
    reference runs (plain torch: mpcore never imported) and the runs in
    `runs` ((mode, world) pairs) are served as they should be and finish;
    afterwards nothing is left behind.  A module takes them as
    `test_a, test_b, test_c = stack_tests(WORLDS, RUNS)`."""

    @pytest.mark.parametrize("world", worlds)
    def test_reference_run_is_gloo_and_finishes(runs, world):
        run = runs.get("gloo", world)
        assert_served(run, by_mpcore=False)
        assert not any(run.value("_mpcore_imported"))
        run.check_finished()

    @pytest.mark.parametrize("mode,world", runs)
    def test_served_by_mpcore_and_finishes(runs, mode, world):
        run = runs.get(mode, world)
        assert_served(run, by_mpcore=True)
        if mode == "run-gloo":
            # The program itself never imported mpcore: `mpcore run` did.
            assert all(run.value("_mpcore_imported"))
        run.check_finished()

    def test_nothing_left_behind(runs):
        assert runs.runs, "no run happened"
        assert not runs.leftovers(), runs.leftovers()

    return (test_reference_run_is_gloo_and_finishes, test_served_by_mpcore_and_finishes,
            test_nothing_left_behind)
