"""mpcore builds, installs and works on each Python it supports.

Each test builds the package from a copy of this source tree with one
interpreter (3.10, 3.12, 3.13, found under pyenv or on PATH) into a fresh
virtual environment with numpy, then runs a numpy-only program there: a
Queue between processes, shared arrays seen by children (fork and
spawn), and a DataLoader with 2 workers.  Where an interpreter is missing
the test is skipped, but fails in CI.
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import program_result, require, run_in_session, scaled

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

SMOKE = r'''
import json
import sys
import os
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale

import numpy as np

import mpcore
from mpcore.data import DataLoader, Dataset


def fill(a, value, q):
    a[:] = value
    q.put(("filled", float(a.sum())))


def echo(qin, qout):
    while True:
        item = qin.get(timeout=60 * SLOW)
        if item is None:
            break
        qout.put((item[0] * 2, item[1] + 1))


class Squares(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return np.full(3, i * i, dtype=np.int64)


def main():
    out = {"version": list(sys.version_info[:2])}
    # A Queue between processes, both ways.
    qin, qout = mpcore.Queue(), mpcore.Queue()
    p = mpcore.Process(target=echo, args=(qin, qout))
    p.start()
    big = np.arange(100_000, dtype=np.float32)
    for i in range(5):
        qin.put((i, big))
    qin.put(None)
    got = [qout.get(timeout=60 * SLOW) for _ in range(5)]
    p.join(60 * SLOW)
    out["queue"] = [g[0] for g in got]
    out["queue_array_ok"] = all(np.array_equal(g[1], big + 1) for g in got)
    out["queue_exit"] = p.exitcode
    # Shared arrays: a child's writes are seen here, by fork and by spawn.
    for method in ("fork", "spawn"):
        ctx = mpcore.get_context(method)
        for make in (mpcore.zeros, mpcore.empty):
            a = make((4, 5), "float64")
            q = ctx.Queue()
            c = ctx.Process(target=fill, args=(a, 3.0, q))
            c.start()
            reply = q.get(timeout=120 * SLOW)
            c.join(60 * SLOW)
            out[f"shared_{method}_{make.__name__}"] = [reply[1], float(a.sum()), c.exitcode]
    # A DataLoader with 2 workers yielding numpy batches.
    loader = DataLoader(Squares(), batch_size=4, num_workers=2)
    batches = list(loader)
    out["loader_types"] = sorted({type(b).__name__ for b in batches})
    out["loader"] = [b[:, 0].tolist() for b in batches]
    out["torch"] = "torch" in sys.modules
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
'''


def _interpreter(version):
    """The python binary of `version` ("3.10"), or None."""
    roots = []
    try:
        roots.append(subprocess.run(["pyenv", "root"], capture_output=True, text=True,
                                    timeout=scaled(30)).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    roots.append(os.path.expanduser("~/.pyenv"))
    for root in filter(None, roots):
        found = sorted(glob.glob(os.path.join(root, "versions", version + ".*", "bin", "python")))
        if found:
            return found[-1]
    return shutil.which(f"python{version}")


def _run(cmd, timeout, **kw):
    """Runs cmd (bounded by `timeout`, a quiet machine's seconds: scaled)."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(timeout), **kw)
    assert r.returncode == 0, (f"{' '.join(cmd)} failed, rc {r.returncode}\n"
                               f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}")
    return r


def _copy_tree(dest):
    """The package's sources as they are now (not only what is committed),
    without build outputs or virtual environments."""
    ignore = shutil.ignore_patterns(".venv", ".venv-*", ".git", "build", "*.egg-info", "*.so",
                                    "__pycache__", "bench-out", ".pytest_cache")
    shutil.copytree(ROOT, dest, ignore=ignore)


VERSIONS = ["3.10", "3.12", "3.13"]


def _build(python, tmp):
    """Builds and installs the package with `python` into a fresh virtual
    environment under tmp; returns (its python, the environment to run it in)."""
    src, venv = os.path.join(tmp, "src"), os.path.join(tmp, "venv")
    _copy_tree(src)
    # The environment gets no pip of its own (installing it is most of what
    # `venv` costs): this test run's pip installs into it with --python,
    # running itself, and so the build, under the environment's interpreter.
    _run([python, "-m", "venv", "--without-pip", venv], timeout=120)
    vpy = os.path.join(venv, "bin", "python")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPCORE_KEEPER", "MPCORE_ZYGOTE", "MPCORE_RUN", "PYTHONPATH",
                        "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = [sys.executable, "-m", "pip", "--python", vpy, "install", "-q"]
    _run(pip + ["setuptools>=64", "wheel", "numpy>=2"], env=env, timeout=300)
    _run(pip + ["--no-build-isolation", "--no-deps", src], env=env, timeout=300, cwd=tmp)
    return vpy, env


@pytest.fixture(scope="module")
def builds():
    """{version: future of _build()} for every installed interpreter.  The
    builds run at once, each in a thread of its own: each is mostly one
    compiler on one core, so together they take about the time of the
    slowest on a machine with two cores or more, not the sum."""
    found = {v: _interpreter(v) for v in VERSIONS}
    tmp = tempfile.mkdtemp(prefix="mpcore-pythons-")
    try:
        with ThreadPoolExecutor(len(VERSIONS)) as pool:
            yield {v: pool.submit(_build, python, os.path.join(tmp, v))
                   for v, python in found.items() if python is not None}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", VERSIONS)
def test_builds_and_works_on(version, builds):
    python = _interpreter(version)
    require(python is not None, f"Python {version} is not installed")
    vpy, env = builds[version].result()
    with tempfile.TemporaryDirectory(prefix=f"mpcore-py{version}-") as tmp:
        prog = os.path.join(tmp, "smoke.py")
        with open(prog, "w") as f:
            f.write(SMOKE)
        # In a session of its own, which must be empty once it exits (no
        # keeper, zygote or worker left).
        r = run_in_session([vpy, prog], cwd=tmp, env=env, timeout=240)
        out = program_result(r)
    assert r.returncode == 0, r.stderr[-5000:]
    assert out["version"] == [int(x) for x in version.split(".")]
    assert out["queue"] == [0, 2, 4, 6, 8]
    assert out["queue_array_ok"] is True and out["queue_exit"] == 0
    for method in ("fork", "spawn"):
        for make in ("zeros", "empty"):
            # the child saw the array (its sum after filling), and so do we
            assert out[f"shared_{method}_{make}"] == [60.0, 60.0, 0], (method, make)
    assert out["loader_types"] == ["ndarray"]
    assert out["loader"] == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]
    assert out["torch"] is False
