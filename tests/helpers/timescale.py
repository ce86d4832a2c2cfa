"""How slow the machine is now, and the waits that follow from it (NOTE
[ Waits scale with how slow the machine is ]); require(), the skip that
fails in CI.

Programs the tests start import this module too (after putting the tests'
folder on sys.path: helpers.programs.TESTS_ON_PATH), so it imports nothing
of mpcore or torch."""
import os
import time

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(condition, reason):
    """Skips the test when condition is false, but fails it in CI, where a
    skip must never stand in for a missing feature."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


# --- how slow the machine is --------------------------------------------------

TIME_SCALE_VAR = "TEST_TIME_SCALE"
_SCALE_CAP = 10.0


def _cpu_share_slowdown(seconds=0.2):
    """Wall time over the CPU time a busy loop of `seconds` was given: 1 on
    a CPU of its own, 3 when it shares one with two other busy programs."""
    w0, c0 = time.monotonic(), time.thread_time()
    while time.monotonic() - w0 < seconds:
        pass
    return (time.monotonic() - w0) / max(time.thread_time() - c0, 1e-3)


def _load_slowdown():
    """The 1-minute load average per CPU this process may run on."""
    try:
        return os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))
    except OSError:
        return 1.0


class _TimeScale:
    """NOTE [ Waits scale with how slow the machine is ]
    A test bounds each wait for an event (a line from a child, a process's
    exit, a queue's item) so that a hang fails instead of blocking the
    suite; the bound only matters when the event never comes.  On a busy
    machine (other programs on the same cores: a shared machine of two
    cores at a load of 10 to 15) everything takes several times longer, and
    a bound picked on a quiet machine ends tests that were on their way.  So
    every such bound, every deadline, every "it took less than" check and
    every timeout given to mpcore only so that it does not fire before
    slow peers arrive goes through scaled(): the quiet machine's seconds
    times `factor`, the machine's slowdown now.  pytest-timeout's per-test
    limit is scaled the same way (pytest_runtest_protocol in conftest.py),
    and the helpers of this package scale the timeouts they are given:
    their callers name a quiet machine's seconds.

    The factor is the larger of the 1-minute load average per CPU (read
    again before every test, as other programs come and go) and the
    slowdown a 0.2 s busy loop saw at the session's start (its wall time
    over the CPU time it was given), at least 1 (a quiet machine keeps the
    numbers the tests name) and at most _SCALE_CAP (so that a hang still
    fails within minutes).  TEST_TIME_SCALE in the environment fixes it;
    the programs the tests start inherit it there, so that their waits
    (scaled(), or SLOW read from that variable) agree with the test's.
    What is itself under test stays as it is: a timeout whose firing a
    test checks (a 0.05 s get that must raise Empty, a group timeout of
    0.5 s), and the lower bound of an "it took at least" check."""

    def __init__(self):
        given = os.environ.get(TIME_SCALE_VAR)
        self.fixed = given is not None
        self.start = 1.0
        try:
            self.factor = float(given) if self.fixed else 1.0
        except ValueError:
            raise ValueError(f"{TIME_SCALE_VAR}={given!r} is not a number") from None
        if self.fixed and not self.factor > 0:
            raise ValueError(f"{TIME_SCALE_VAR}={given!r} must be above 0")
        self.load = None

    def calibrate(self):
        """At the session's start, in the pytest process only."""
        if not self.fixed:
            self.start = _cpu_share_slowdown()
            self.refresh()

    def refresh(self):
        """Before each test: the factor from the load now."""
        if self.fixed:
            return self.factor
        self.load = _load_slowdown()
        self.factor = round(min(_SCALE_CAP, max(1.0, self.start, self.load)), 2)
        os.environ[TIME_SCALE_VAR] = str(self.factor)
        return self.factor

    def describe(self):
        if self.fixed:
            return f"{self.factor:g} (fixed by {TIME_SCALE_VAR})"
        load = self.load if self.load is not None else _load_slowdown()
        return (f"{self.factor:g} (load {load:.2f} per CPU; a busy loop ran "
                f"{self.start:.2f}x slower than its CPU time at the session's start)")


TIME_SCALE = _TimeScale()


def scaled(seconds):
    """`seconds` of a quiet machine on this machine now (NOTE [ Waits scale
    with how slow the machine is ])."""
    return seconds * TIME_SCALE.factor
