"""pytest's hooks and the fixtures every test folder shares.

The helpers themselves live in the package helpers (tests/helpers/), which
test files import by name (`from helpers import scaled`).  Tests that start
processes are bounded by pytest-timeout (pyproject sets a default) and
check afterwards that nothing is left behind.  Every bound a test puts on
a wait is scaled by how slow the machine is now (NOTE [ Waits scale with
how slow the machine is ] in helpers/timescale.py), and so is every test's
pytest-timeout limit (pytest_runtest_protocol below)."""
import os
import signal
import time

import pytest

from helpers.procfs import children_of, is_own_zygote, is_resource_tracker, mpcore_processes
from helpers.programs import RUNNER_PIDS, Scenario, ScenarioRunner, wait_exits
from helpers.timescale import TIME_SCALE, scaled


def pytest_configure(config):
    TIME_SCALE.calibrate()
    # A suite started in the background by a shell without job control
    # (`make test &` in a script, nohup) inherits SIGINT ignored, and so
    # would every program the tests start: the tests of Ctrl-C would wait
    # for an interrupt that never comes.  They run as under a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_report_header(config):
    return f"time scale of waits: {TIME_SCALE.describe()}"


_BASE_TIMEOUT = pytest.StashKey()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Scales the test's pytest-timeout limit (its marker's, else the
    configured one) by the factor now, before pytest-timeout reads it."""
    TIME_SCALE.refresh()
    if _BASE_TIMEOUT not in item.stash:
        marker = item.get_closest_marker("timeout")
        args, kwargs = ((), {}) if marker is None else (marker.args, dict(marker.kwargs))
        if "timeout" in kwargs:
            base = kwargs.pop("timeout")
        elif args:
            base, args = args[0], args[1:]
        else:
            base = item.config.getoption("timeout", None) or os.environ.get("PYTEST_TIMEOUT") \
                or item.config.getini("timeout")
        item.stash[_BASE_TIMEOUT] = (float(base or 0), args, kwargs)
    base, args, kwargs = item.stash[_BASE_TIMEOUT]
    if base > 0:
        if args:    # the method, given by position
            kwargs = dict(kwargs, method=args[0])
        item.add_marker(pytest.mark.timeout(timeout=scaled(base), **kwargs), append=False)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("time scale", TIME_SCALE.describe()))


@pytest.fixture
def leak_check():
    """After the test: no child process left (zombie or not), and no keeper
    of a finished program still running."""
    before = set(mpcore_processes())
    yield
    me = os.getpid()
    own_keeper = set(before)
    import mpcore._core as core
    if core.keeper_pid():
        own_keeper.add(core.keeper_pid())
    kids = [(p, s) for p, s in children_of(me)
            if p not in own_keeper and p not in RUNNER_PIDS and not is_resource_tracker(p)
            and not is_own_zygote(p)]
    assert not kids, f"processes left behind: {kids}"
    # A finished program's keeper sees it go and exits, which on a busy
    # machine takes a moment: each is given until the deadline to end.
    stray = set(mpcore_processes()) - own_keeper - before
    wait_exits(sorted(stray), time.monotonic() + scaled(10))
    stray &= set(mpcore_processes())
    assert not stray, f"keepers left behind: {stray}"


@pytest.fixture
def scenario():
    sc = Scenario()
    sc.files = []
    try:
        yield sc
    finally:
        sc.close()
        for f in sc.files:
            os.unlink(f)


@pytest.fixture(scope="module")
def scenario_runner(request, tmp_path_factory):
    """The program that runs the test module's spawn scenarios (NOTE [ One
    program for a module's spawn scenarios ])."""
    r = ScenarioRunner(request.module.__name__, str(tmp_path_factory.mktemp("runner")))
    yield r
    r.close()
