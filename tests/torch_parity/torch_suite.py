"""torch's own distributed tests, under `mpcore run` and under plain python.

    .venv/bin/python tests/torch_parity/torch_suite.py                # the CI subset
    .venv/bin/python tests/torch_parity/torch_suite.py --all          # every test of DistributedTest
    .venv/bin/python tests/torch_parity/torch_suite.py test_barrier test_all_reduce_sum
    .venv/bin/python tests/torch_parity/torch_suite.py --file some/test_file.py   # another torch test file

By default this drives `torch.testing._internal.distributed.distributed_test`,
which ships inside torch, so nothing is fetched: its `DistributedTest` runs
with BACKEND=gloo and WORLD_SIZE=2, each test's ranks started by torch's own
harness (MultiProcessTestCase), once under plain python and once under
`mpcore run` (where mpcore serves the gloo groups).  It prints each test's
outcome in both modes, the totals, and every test that passes plain but not
under mpcore; it exits 1 if there is any such test.

torch's test harness (torch.testing._internal.common_utils) imports
expecttest, a test dependency torch's wheel does not pull in: without it
every test fails at its worker's start, naming the missing module.

This file is a script, not a pytest module: tests/torch_parity/test_torch_suite.py runs it.

NOTE [ How the suite is driven ]
Each mode runs a worker: this same file with `--_worker`, under the mode's
interpreter.  The worker defines the test class at module level (only when
_TORCH_SUITE_WORKER is set), so the ranks torch's harness spawns find it in
their `__main__`, as they would in torch's test/distributed/
test_distributed_spawn.py.  The worker runs the tests one after another and
reports each one's start and outcome as a JSON line on a pipe of its own.
The worker runs in a session of its own; when a test outlives its timeout,
or the worker dies, the whole session (ranks, mpcore's zygote and keeper,
resource trackers) is killed and a new worker goes on with the tests after
it.  Every process of a worker's session is gone before the next starts.
"""
import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

WORKER_ENV = "_TORCH_SUITE_WORKER"
WORLD_SIZE = 2
HERE = os.path.abspath(__file__)

# The CI subset: tests of DistributedTest that pass under plain python on the
# pinned torch with gloo and two ranks on CPU (with two ranks torch skips its
# subgroup tests), one or two for each kind of call mpcore serves, chosen
# where mpcore differed from gloo before: the profiler's events for
# collectives and point-to-point calls (the all_reduce, all_gather, gather and
# send/recv tests profile each call), the coalesced all_gather's [rank][input]
# outputs, sparse all_reduce, monitored_barrier's errors, the backend's name
# in DDP's logging data, a pickled DDP module.  About 15 s a test under plain
# python and half that under mpcore on two quiet cores.
CI_SUBSET = [
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_sparse_all_reduce_sum",
    "test_gather",
    "test_scatter",
    "test_send_recv",
    "test_batch_isend_irecv_gloo",
    "test_all_gather_object_default_pg",
    "test_barrier",
    "test_monitored_barrier_gloo_subgroup",
    "test_get_backend",
    "test_DistributedDataParallelCPU",
    "test_ddp_logging_data_cpu",
]

DEFAULT_TIMEOUT = 300
# How long a killed worker's session may take to be gone.
REAP_TIMEOUT = 30


# --- the worker: runs in the mode's interpreter ------------------------------

def _worker_class():
    """The test class the ranks and the worker share (NOTE [ How the suite is
    driven ]): torch's DistributedTest._DistTestBase on TestDistBackend, as
    torch's own spawn driver builds it."""
    import torch
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest, TestDistBackend)

    class TorchSuiteGloo(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    # Pickled by reference (the ranks' target is its _run): a module-level name.
    TorchSuiteGloo.__qualname__ = "TorchSuiteGloo"
    return TorchSuiteGloo


if os.environ.get(WORKER_ENV) == "distributed_test":
    TorchSuiteGloo = _worker_class()


def _load_cases(file):
    """{test name: (class, method)} of the tests the worker can run: the
    shipped DistributedTest, or every TestCase of a torch test file."""
    import unittest
    if file is None:
        classes = [sys.modules["__main__"].TorchSuiteGloo]
    else:
        import importlib
        sys.path.insert(0, os.path.dirname(os.path.abspath(file)))
        name = os.path.splitext(os.path.basename(file))[0]
        module = importlib.import_module(name)
        classes = [v for v in vars(module).values()
                   if isinstance(v, type) and issubclass(v, unittest.TestCase)
                   and v.__module__ == module.__name__]
    loader = unittest.TestLoader()
    cases = {}
    for cls in classes:
        for method in loader.getTestCaseNames(cls):
            key = method if file is None else f"{cls.__name__}.{method}"
            cases[key] = (cls, method)
    return cases


def _short_error(text):
    """What a failure's text says in one line: for each traceback in it (each
    rank's, as torch's harness joins them), its exception and the frame that
    raised it; or the text's last line."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last):"):
            continue
        where = ""
        for j in range(i + 1, len(lines)):
            later = lines[j]
            m = re.match(r'\s+File "([^"]+)", line (\d+), in (\S+)', later)
            if m:
                # the last frame outside the assertion helpers
                if os.path.basename(m.group(1)) not in ("common_utils.py", "case.py"):
                    code = lines[j + 1].strip() if j + 1 < len(lines) else ""
                    where = f"{os.path.basename(m.group(1))}:{m.group(2)} {m.group(3)}: {code}"
                continue
            if later and not later.startswith((" ", "\t", "Traceback")):
                # the exception, with the next lines of its message
                msg = [later.strip()]
                for more in lines[j + 1:j + 8]:
                    if more.startswith(("Traceback", "During handling", "The above exception",
                                        "To execute this test")) or len(msg) == 3:
                        break
                    if more.strip():
                        msg.append(more.strip())
                found.append((" ".join(msg), where))
                break
    if found:
        # The harness's own RuntimeError wraps the ranks': keep the ranks'.
        inner = [f for f in found if not f[0].startswith("RuntimeError: Process ")]
        out = []
        for msg, where in inner or found:
            item = f"{msg} (at {where})" if where else msg
            if item not in out:
                out.append(item)
        return " | ".join(out)[:700]
    rest = [l for l in lines if l.strip()]
    return rest[-1].strip()[:700] if rest else ""


def worker_main(fd, file, names):
    import unittest
    os.set_inheritable(fd, False)
    out = os.fdopen(fd, "w", buffering=1)

    def emit(**record):
        out.write(json.dumps(record) + "\n")
        out.flush()

    cases = _load_cases(file)
    if names == ["--list"]:
        emit(list=sorted(cases))
        return 0

    class Result(unittest.TestResult):
        def __init__(self, name):
            super().__init__()
            self.name = name
            self.outcome = None

        def _set(self, outcome, text=""):
            # A test's first verdict stands (a failing tearDown after a pass
            # makes it a failure, as unittest counts it).
            if self.outcome in (None, "pass"):
                self.outcome, self.text = outcome, text

        def addSuccess(self, test):
            self._set("pass")

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._set("fail", self.failures[-1][1])

        def addError(self, test, err):
            super().addError(test, err)
            self._set("fail", self.errors[-1][1])

        def addSkip(self, test, reason):
            self._set("skip", str(reason))

        def addExpectedFailure(self, test, err):
            self._set("pass")

        def addUnexpectedSuccess(self, test):
            self._set("fail", "unexpected success")

    for name in names:
        emit(start=name)
        t0 = time.monotonic()
        if name not in cases:
            emit(test=name, outcome="fail", error=f"no such test: {name}",
                 detail="", seconds=0.0)
            continue
        cls, method = cases[name]
        result = Result(name)
        cls(method).run(result)
        outcome = result.outcome or "fail"
        text = getattr(result, "text", "") if result.outcome else "the test reported nothing"
        emit(test=name, outcome=outcome,
             error=text if outcome == "skip" else _short_error(text),
             detail="" if outcome in ("pass", "skip") else text[-8000:],
             seconds=round(time.monotonic() - t0, 1))
    return 0


# --- the driver: runs workers, kills what is left, compares ------------------

def _session_members(sid):
    """[(pid, state)] of the processes of session sid (the tests' helper,
    imported when the driver first needs it: the workers never import
    pytest)."""
    tests = os.path.dirname(os.path.dirname(HERE))
    if tests not in sys.path:
        sys.path.append(tests)
    from helpers import session_members
    return session_members(sid)


def _running(sid):
    return [pid for pid, state in _session_members(sid) if state not in ("Z", "X")]


def _end_session(proc, kill):
    """Ends a worker's session: with kill, SIGKILLs every process in it;
    without, gives its stragglers (mpcore's keeper and zygote outlive the
    main process by a moment) REAP_TIMEOUT seconds, then SIGKILLs them.
    Returns once none of them runs; raises RuntimeError if one survives."""
    sid = proc.pid
    deadline = time.monotonic() + REAP_TIMEOUT
    if not kill:
        while _running(sid) and time.monotonic() < deadline:
            for pid in _running(sid):
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError:
                    continue
                try:
                    select.select([pidfd], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
                finally:
                    os.close(pidfd)
    for _ in range(50):
        left = _running(sid)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.wait(timeout=REAP_TIMEOUT)
    left = _running(sid)
    if left:
        raise RuntimeError(f"processes of a killed test run survive SIGKILL: {left}")


def _mode_command(mode, mpcore):
    if mode == "plain":
        return [sys.executable, HERE]
    return [*mpcore, "run", HERE]


def _worker_env(mode, file, timeout, world_size=WORLD_SIZE):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if mode == "plain":
        # plain python: nothing of mpcore's switches (MPCORE_RUN would make
        # every python process start mpcore, as `mpcore run` does)
        env = {k: v for k, v in env.items() if not k.startswith("MPCORE_")}
    if file:
        env[WORKER_ENV] = "file"
    else:
        # as torch's test/distributed/test_distributed_spawn.py is run for gloo
        env.update(BACKEND="gloo", WORLD_SIZE=str(world_size))
        env[WORKER_ENV] = "distributed_test"
    # torch's harness times a test out (and prints the ranks' stacks) a
    # little before this driver would kill it.
    env["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(max(10, int(timeout) - 20))
    return env


def _log_tail(path, n=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


# Workers running now, and whether the driver was told to stop: a signal
# to the driver ends every worker's session before the driver exits, so
# that no rank outlives it (_stop).
_LIVE = set()
_STOPPING = []


def _stop(signum, frame):
    _STOPPING.append(signum)
    for proc in list(_LIVE):
        for pid in _running(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    raise SystemExit(128 + signum)


def run_mode(mode, names, args, log):
    """{name: result} of running names in mode, each bounded by args.timeout;
    log(line) reports progress."""
    results = {}
    todo = list(names)
    batch = 0
    while todo and not _STOPPING:
        batch += 1
        logfile = os.path.join(args.log_dir, f"{mode}-{batch}.log")
        r, w = os.pipe()
        argv = [*_mode_command(mode, args.mpcore), "--_worker", str(w)]
        if args.file:
            argv += ["--file", os.path.abspath(args.file)]
        chunk = todo[:1] if args.isolate else todo
        with open(logfile, "wb") as lf:
            proc = subprocess.Popen(argv + chunk, stdin=subprocess.DEVNULL, stdout=lf,
                                    stderr=subprocess.STDOUT, pass_fds=(w,),
                                    start_new_session=True, cwd=args.cwd,
                                    env=_worker_env(mode, args.file, args.timeout, args.world_size))
        _LIVE.add(proc)
        os.close(w)
        current, buf, killed, ran_any = None, b"", False, False
        # Bounded from the worker's start to its first test, and each test
        # from its start to its outcome.
        deadline = time.monotonic() + args.timeout
        pidfd = os.pidfd_open(proc.pid)
        os.set_blocking(r, False)
        try:
            exited = False
            while True:
                ready, _, _ = select.select([r, pidfd], [], [],
                                            max(0.0, deadline - time.monotonic()))
                if not ready:
                    killed = True
                    break
                if pidfd in ready:
                    exited = True
                try:
                    data = os.read(r, 65536)
                except BlockingIOError:
                    data = None
                if data == b"" or (data is None and exited):
                    # EOF, or the worker is gone and nothing is left to read
                    # (a process it started may hold the pipe open).
                    break
                if data is None:
                    continue
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    rec = json.loads(line)
                    if "start" in rec:
                        current, ran_any = rec["start"], True
                    elif "test" in rec:
                        results[rec["test"]] = rec
                        if rec["test"] in todo:
                            todo.remove(rec["test"])
                        log(f"  {mode:6} {rec['outcome']:7} {rec['test']} ({rec['seconds']} s)"
                            + (f": {rec['error'][:200]}" if rec["outcome"] == "fail" else ""))
                        current = None
                    deadline = time.monotonic() + args.timeout
        except BaseException:
            killed = True   # the driver is stopping: so is the worker
            raise
        finally:
            os.close(r)
            os.close(pidfd)
            if not killed:
                try:
                    proc.wait(timeout=REAP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    killed = True
            _end_session(proc, kill=killed)
            _LIVE.discard(proc)
        if not todo or _STOPPING:
            continue
        tail = _log_tail(logfile)
        if not ran_any:
            # A worker that cannot start a test would fail every test so.
            what = (f"the worker started no test in {args.timeout} s" if killed else
                    f"the worker exited (status {proc.returncode}) before its first test")
            log(f"  {mode:6} fail    all {len(todo)} tests: {what}")
            for name in todo:
                results[name] = dict(test=name, outcome="fail", error=what, detail=tail,
                                     seconds=0.0)
            break
        victim = current if current is not None else todo[0]
        if killed:
            what = f"timed out after {args.timeout:g} s"
        else:
            what = f"the worker died (exit status {proc.returncode})"
        results[victim] = dict(test=victim, outcome="timeout" if killed else "fail",
                               error=what, detail=tail, seconds=args.timeout if killed else 0.0)
        log(f"  {mode:6} {results[victim]['outcome']:7} {victim}: {what}")
        todo.remove(victim)
    return results


def list_tests(args):
    """Every test the worker finds (DistributedTest's, or the file's)."""
    r, w = os.pipe()
    argv = [sys.executable, HERE, "--_worker", str(w)]
    if args.file:
        argv += ["--file", os.path.abspath(args.file)]
    proc = subprocess.Popen(argv + ["--list"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            pass_fds=(w,), start_new_session=True, cwd=args.cwd,
                            env=_worker_env("plain", args.file, args.timeout, args.world_size))
    os.close(w)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
        with os.fdopen(r, "rb") as f:
            data = f.read()
    except subprocess.TimeoutExpired:
        _end_session(proc, kill=True)
        raise SystemExit("listing the tests timed out")
    _end_session(proc, kill=False)
    if proc.returncode != 0 or not data:
        raise SystemExit(f"listing the tests failed:\n{out.decode(errors='replace')}")
    return json.loads(data.splitlines()[-1])["list"]


PASS = "pass"


def compare(names, plain, mpcore):
    rows, regressions = [], []
    totals = {m: {} for m in ("plain", "mpcore")}
    for name in names:
        row = {"test": name}
        for mode, res in (("plain", plain), ("mpcore", mpcore)):
            if res is None:
                continue
            rec = res.get(name, {"outcome": "not run", "error": "", "detail": "", "seconds": 0})
            row[mode] = rec
            o = "fail" if rec["outcome"] == "timeout" else rec["outcome"]
            totals[mode][o] = totals[mode].get(o, 0) + 1
        if plain is not None and mpcore is not None and \
                row["plain"]["outcome"] == PASS and row["mpcore"]["outcome"] != PASS:
            regressions.append(name)
        rows.append(row)
    return rows, totals, regressions


def _fmt_totals(t):
    return " / ".join(f"{t.get(k, 0)} {k}" for k in ("pass", "fail", "skip"))


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Run torch's distributed tests (DistributedTest, gloo, 2 ranks) under "
                    "plain python and under `mpcore run`, and compare.")
    ap.add_argument("tests", nargs="*", help="test names (default: the CI subset)")
    ap.add_argument("--all", action="store_true",
                    help="every test of DistributedTest (or of --file); the harness skips "
                         "those that need CUDA or another backend")
    ap.add_argument("-k", dest="keyword", action="append", default=[],
                    help="keep only tests whose name contains this (repeatable: any)")
    ap.add_argument("--file", help="run the TestCases of this torch test file instead "
                                   "(names are Class.method; default: all of them)")
    ap.add_argument("--world-size", type=int, default=WORLD_SIZE,
                    help=f"ranks of DistributedTest (default {WORLD_SIZE}; its subgroup tests "
                         "need 3 or more, and skip with 2)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                    help=f"seconds a test may take in one mode (default {DEFAULT_TIMEOUT})")
    ap.add_argument("--modes", default="plain,mpcore",
                    help="which modes to run: plain, mpcore or both (default plain,mpcore)")
    ap.add_argument("--parallel", action="store_true",
                    help="run the two modes at the same time (twice the load)")
    ap.add_argument("--isolate", action="store_true",
                    help="a fresh worker process for every test")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--log-dir", help="keep the workers' output here (default: a temporary "
                                      "directory, removed at the end)")
    ap.add_argument("--mpcore", default=None,
                    help="the mpcore command (default: the mpcore beside this python)")
    ap.add_argument("--list", action="store_true", help="list the tests and exit")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("plain", "mpcore")]
    if bad or not modes:
        ap.error(f"--modes takes plain and/or mpcore, not {args.modes!r}")
    if args.world_size < 2:
        ap.error(f"--world-size must be 2 or more, not {args.world_size}")
    if args.timeout <= 0:
        ap.error(f"--timeout must be positive, not {args.timeout}")
    if args.file and not os.path.exists(args.file):
        ap.error(f"--file {args.file!r}: no such file")
    if args.tests and args.all:
        ap.error("name tests or give --all, not both")
    if args.mpcore is None:
        beside = os.path.join(os.path.dirname(sys.executable), "mpcore")
        args.mpcore = [beside] if os.path.exists(beside) else [sys.executable, "-m", "mpcore"]
    else:
        args.mpcore = args.mpcore.split()
    args.cwd = os.getcwd()

    if args.tests:
        names = list(args.tests)
    elif args.all or args.file or args.list:
        names = list_tests(args)
    else:
        names = list(CI_SUBSET)
    if args.keyword:
        names = [n for n in names if any(k in n for k in args.keyword)]
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        ap.error("no tests selected")

    def log(line):
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _stop)
    own_logs = args.log_dir is None
    if own_logs:
        args.log_dir = tempfile.mkdtemp(prefix="torch_suite-")
    else:
        os.makedirs(args.log_dir, exist_ok=True)
    results = {"plain": None, "mpcore": None}
    t0 = time.monotonic()
    try:
        if args.parallel and len(modes) == 2:
            from concurrent.futures import ThreadPoolExecutor
            log(f"{' and '.join(modes)} at once: {len(names)} tests")
            with ThreadPoolExecutor(2) as pool:
                futures = {m: pool.submit(run_mode, m, names, args, log) for m in modes}
                for m, f in futures.items():
                    results[m] = f.result()
        else:
            for mode in modes:
                log(f"{mode}: {len(names)} tests")
                results[mode] = run_mode(mode, names, args, log)
    finally:
        if own_logs:
            shutil.rmtree(args.log_dir, ignore_errors=True)
    rows, totals, regressions = compare(names, results["plain"], results["mpcore"])

    if args.json:
        json.dump({"source": args.file or "torch.testing._internal.distributed.distributed_test",
                   "backend": "gloo", "world_size": None if args.file else args.world_size, "modes": modes,
                   "seconds": round(time.monotonic() - t0, 1), "tests": rows,
                   "totals": {m: totals[m] for m in modes},
                   "passes_plain_not_mpcore": regressions}, sys.stdout, indent=1)
        print()
    else:
        width = max(len(n) for n in names)
        print(f"{'test':{width}}  " + "  ".join(f"{m:8}" for m in modes))
        for row in rows:
            print(f"{row['test']:{width}}  " + "  ".join(f"{row[m]['outcome']:8}" for m in modes))
        print()
        for m in modes:
            print(f"{m:6}: {_fmt_totals(totals[m])}  (of {len(names)})")
        if len(modes) == 2:
            print(f"\npasses plain, not under mpcore: {len(regressions)}")
            for name in regressions:
                rec = next(r for r in rows if r["test"] == name)["mpcore"]
                print(f"  {name}: {rec['outcome']}: {rec['error']}")
    return 1 if regressions else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--_worker":
        fd, rest = int(sys.argv[2]), sys.argv[3:]
        file = None
        if rest[:1] == ["--file"]:
            file, rest = rest[1], rest[2:]
        sys.exit(worker_main(fd, file, rest))
    sys.exit(main())
