"""The share of the cores that each of a group of children takes for
torch's threads (NOTE [ A rank's share of the cores ] in proc/_cores.py):
the children of one spawn or start_processes call, the workers of an
mpcore Pool and of a ProcessPoolExecutor on an mpcore context.  Each gets
torch's default thread count divided by the group's size (at least one),
in OMP_NUM_THREADS and in torch; a group of one, and a parent whose
environment sets OMP_NUM_THREADS or MKL_NUM_THREADS, keep torch's way.
The expected counts come from a fresh `python -c` under the same
environment, not from mpcore's own formula.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import require, scaled

import mpcore as mp
import mpcore.proc._spawn as S

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("leak_check")]

METHODS = ["spawn", "fork"]
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@pytest.fixture(autouse=True)
def torch_and_no_thread_variables(monkeypatch):
    require(importlib.util.find_spec("torch") is not None, "needs torch")
    for k in THREAD_VARS:
        monkeypatch.delenv(k, raising=False)
    yield
    assert not any(k in os.environ for k in THREAD_VARS), "the parent's environment changed"


def fresh_threads():
    """torch's intra-op threads in a fresh process under this environment."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, timeout=scaled(60), check=True)
    return int(out.stdout)


def threads_here(*_):
    import torch
    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def _report_threads(i, w):
    w.send((i, threads_here()))


def _note(tag):
    os.environ["MPCORE_TEST_INITIALIZER"] = tag


def _initializer_and_threads(_):
    return os.environ.get("MPCORE_TEST_INITIALIZER"), threads_here()


def recv_all(r, n):
    out = {}
    for _ in range(n):
        if not r.poll(scaled(60)):
            pytest.fail(f"no message from a child within {scaled(60):g}s")
        i, got = r.recv()
        out[i] = got
    return out


@pytest.mark.parametrize("method", METHODS)
def test_the_children_of_one_spawn_call_share_the_cores(method):
    default = fresh_threads()
    for nprocs in (2, 3, 1):
        r, w = mp.get_context(method).Pipe(duplex=False)
        S.start_processes(_report_threads, (w,), nprocs, start_method=method)
        share = max(1, default // nprocs)
        want = (str(share), share) if nprocs > 1 else (None, default)
        assert recv_all(r, nprocs) == {i: want for i in range(nprocs)}, (nprocs, default)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("var", THREAD_VARS)
def test_a_thread_count_the_parent_sets_is_kept(method, var, monkeypatch):
    """The children's count is then what torch gives a process under that
    environment (a forked one: the parent's)."""
    import torch
    monkeypatch.setenv(var, "3")
    want = torch.get_num_threads() if method == "fork" else fresh_threads()
    omp = "3" if var == "OMP_NUM_THREADS" else None
    r, w = mp.get_context(method).Pipe(duplex=False)
    S.start_processes(_report_threads, (w,), 2, start_method=method)
    assert recv_all(r, 2) == {0: (omp, want), 1: (omp, want)}
    with mp.get_context(method).Pool(2) as pool:
        assert set(pool.map(threads_here, range(4))) == {(omp, want)}
    monkeypatch.delenv(var)


@pytest.mark.parametrize("method", METHODS)
def test_a_pools_workers_share_the_cores_and_run_the_programs_initializer(method):
    default = fresh_threads()
    ctx = mp.get_context(method)
    for workers in (2, 3, 1):
        share = max(1, default // workers)
        want = (str(share), share) if workers > 1 else (None, default)
        with ctx.Pool(workers, _note, (f"ran {workers}",)) as pool:
            got = pool.map(_initializer_and_threads, range(2 * workers), chunksize=1)
        assert set(got) == {(f"ran {workers}", want)}, (workers, default)
    with ctx.Pool() as pool:           # as many workers as CPUs
        n = os.cpu_count()
        share = max(1, default // n)
        want = (str(share), share) if n > 1 else (None, default)
        assert set(pool.map(threads_here, range(4))) == {want}
    with pytest.raises(TypeError, match="initializer must be a callable"):
        ctx.Pool(2, initializer=3)


@pytest.mark.parametrize("method", METHODS)
def test_an_executors_workers_on_an_mpcore_context_share_the_cores(method):
    from concurrent.futures import ProcessPoolExecutor
    default = fresh_threads()
    share = max(1, default // 2)
    with ProcessPoolExecutor(2, mp.get_context(method), _note, ("ran",)) as ex:
        got = set(ex.map(_initializer_and_threads, range(4)))
    assert got == {("ran", (str(share), share))}
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context(method)) as ex:
        assert ex.submit(threads_here).result(scaled(60)) == (None, default)
