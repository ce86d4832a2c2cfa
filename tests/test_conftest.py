"""The helpers every test leans on: waits that scale with how slow the
machine is (NOTE [ Waits scale with how slow the machine is ]) and the
count of what a test left in /dev/shm (NOTE [ Whose /dev/shm entry is
it ])."""
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from helpers import timescale
from helpers import TESTS, TIME_SCALE_VAR, fresh_env, scaled, shm_gained

pytestmark = pytest.mark.usefixtures("leak_check")


# --- the time scale ------------------------------------------------------------

def test_scaled_multiplies_by_the_factor_now():
    f = timescale.TIME_SCALE.factor
    assert 1 <= f <= timescale._SCALE_CAP
    assert scaled(2) == 2 * f
    # The programs a test starts inherit it.
    assert float(os.environ[TIME_SCALE_VAR]) == f


def test_the_factor_follows_the_load(monkeypatch):
    monkeypatch.delenv(TIME_SCALE_VAR)
    ts = timescale._TimeScale()
    assert not ts.fixed
    cpus = len(os.sched_getaffinity(0))
    for load, want in ((0.1 * cpus, 1.0), (3.0 * cpus, 3.0), (50.0 * cpus, timescale._SCALE_CAP)):
        monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
        assert ts.refresh() == want
        assert os.environ[TIME_SCALE_VAR] == str(want)
    # What the session's start measured is a floor.
    ts.start = 2.5
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert ts.refresh() == 2.5


@pytest.mark.parametrize("given,error", [("fast", "is not a number"), ("0", "must be above 0")])
def test_a_bad_fixed_factor_is_a_clear_error(monkeypatch, given, error):
    monkeypatch.setenv(TIME_SCALE_VAR, given)
    with pytest.raises(ValueError, match=f"{TIME_SCALE_VAR}=.*{error}"):
        timescale._TimeScale()


def test_a_fixed_factor_stays(monkeypatch):
    monkeypatch.setenv(TIME_SCALE_VAR, "3")
    ts = timescale._TimeScale()
    monkeypatch.setattr(os, "getloadavg", lambda: (100.0, 0.0, 0.0))
    ts.calibrate()
    assert ts.fixed and ts.refresh() == 3.0
    assert os.environ[TIME_SCALE_VAR] == "3"


def test_a_busy_loop_on_the_same_cpu_is_seen():
    """The session's calibration measures the CPU share a loop gets: two
    busy programs pinned to one CPU get half of it each (or less, when other
    programs use that CPU too), so the slowdown is well above 1."""
    code = f"""
        import os, sys
        sys.path.insert(0, {TESTS!r})
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {{cpu}})
        pid = os.fork()
        if pid == 0:
            while True:
                pass
        try:
            from helpers import timescale
            print("SLOWDOWN", timescale._cpu_share_slowdown(0.5), flush=True)
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=scaled(60), env=fresh_env())
    assert r.returncode == 0, r.stderr
    slowdown = float(r.stdout.split("SLOWDOWN")[1])
    assert slowdown > 1.5, slowdown


INNER_TEST = """
import time
import pytest

@pytest.mark.timeout(1)
def test_marked():
    time.sleep(2)

def test_configured():
    time.sleep(2)
"""


@pytest.mark.parametrize("factor,passed", [("1", False), ("4", True)])
def test_pytest_timeout_limits_are_scaled(tmp_path, factor, passed):
    """A test's pytest-timeout limit, from its marker or from the
    configuration, is the quiet machine's limit times the factor."""
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 1\n")
    env = fresh_env()
    env[TIME_SCALE_VAR] = factor
    env["PYTHONPATH"] = TESTS
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                        "-p", "conftest", "-c", str(tmp_path / "pytest.ini"),
                        "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                       capture_output=True, text=True, timeout=scaled(120), env=env,
                       cwd=tmp_path)
    out = r.stdout + r.stderr
    assert f"time scale of waits: {factor} (fixed by {TIME_SCALE_VAR})" in out, out
    if passed:
        assert r.returncode == 0 and "2 passed" in out, out
    else:
        assert r.returncode == 1 and "2 failed" in out and "Timeout" in out, out
        assert out.count("time scale") >= 3, out   # the header and each failure's section


def test_a_program_reads_the_same_factor():
    code = f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        from helpers import timescale
        print("SCALED", timescale.scaled(1))
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=scaled(60), env=fresh_env())
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split("SCALED")[1]) == scaled(1)


# --- what a test left in /dev/shm ---------------------------------------------

LOCK_HOLDER = """
import multiprocessing, os, sys
lock = multiprocessing.get_context("spawn").Lock()   # a named semaphore until it is freed
print("MADE", flush=True)
sys.stdin.readline()
"""


def test_another_programs_semaphore_is_not_the_tests():
    """A program outside the test makes a multiprocessing lock (a named
    semaphore in /dev/shm, which its creator maps under a temporary name)
    while the test runs: it is not what the test left."""
    before = set(os.listdir("/dev/shm"))
    p = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=fresh_env())
    try:
        assert p.stdout.readline() == "MADE\n"
        new = set(os.listdir("/dev/shm")) - before
        sems = [n for n in new if n.startswith("sem.mp-")]
        assert sems, f"the lock made no semaphore in /dev/shm: {sorted(new)}"
        assert not set(sems) & set(shm_gained(before)), shm_gained(before)
        # Made by a process of the test, it is the test's.
        assert set(sems) <= set(shm_gained(before, ours=lambda pid: pid == p.pid))
    finally:
        p.communicate("\n", timeout=scaled(60))
    assert p.returncode == 0


def test_what_the_test_left_is_counted():
    before = set(os.listdir("/dev/shm"))
    left = os.path.join("/dev/shm", f"mpcore-test-left-{uuid.uuid4().hex}")
    gone = os.path.join("/dev/shm", f"mpcore-test-gone-{uuid.uuid4().hex}")
    for path in (left, gone):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    os.unlink(gone)
    try:
        assert shm_gained(before) == [os.path.basename(left)]
    finally:
        os.unlink(left)
    assert shm_gained(before) == []


def test_another_programs_name_is_not_the_tests():
    """An entry nobody maps under a name no program of a test makes (Open MPI's
    shared-memory segments between a rank's death and their cleanup) is not
    what the test left; one under a name the test's programs make is."""
    before = set(os.listdir("/dev/shm"))
    foreign = os.path.join("/dev/shm", f"sm_segment.test.{uuid.uuid4().hex}")
    torchs = os.path.join("/dev/shm", f"torch_{os.getpid()}_{uuid.uuid4().hex}")
    for path in (foreign, torchs):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    try:
        assert shm_gained(before) == [os.path.basename(torchs)]
    finally:
        os.unlink(foreign)
        os.unlink(torchs)
