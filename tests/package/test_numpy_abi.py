"""The extension is built against numpy 2 and must run with numpy 1.24 too."""
import os
import shutil
import subprocess
import sys

import pytest

import mpcore
from helpers import fresh_env, require, scaled

PROGRAM = """
import numpy as np
import mpcore
import os
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
assert np.__version__.startswith("1.24"), np.__version__
a = mpcore.zeros((3, 4), "float32")
a[1] = 5
q = mpcore.Queue()
q.put(a)
b = q.get()
b[2] = 7
def child(q):
    q.put(mpcore.empty((2,), "int64"))
if __name__ == "__main__":
    p = mpcore.get_context("fork").Process(target=child, args=(q,))
    p.start()
    c = q.get(timeout=60 * SLOW)
    p.join()
    print(np.__version__, a.sum(), c.shape, p.exitcode)
"""


@pytest.mark.timeout(600)
def test_same_build_runs_with_numpy_1_24(tmp_path, leak_check):
    venv = tmp_path / "venv"
    # No pip of its own in the environment (installing it is most of what
    # `venv` costs): this test run's pip installs numpy into it with --python.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=scaled(120))
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "numpy==1.24.4"], capture_output=True, text=True, timeout=scaled(400))
    require(r.returncode == 0, f"numpy 1.24.4 cannot be installed here: {r.stderr[-500:]}")
    # Only the package itself, as built for this test run, on the path.
    pkg = tmp_path / "only-mpcore"
    shutil.copytree(os.path.dirname(mpcore.__file__), pkg / "mpcore")
    (tmp_path / "prog.py").write_text(PROGRAM)
    env = fresh_env()
    env["PYTHONPATH"] = str(pkg)
    r = subprocess.run([str(py), str(tmp_path / "prog.py")], capture_output=True, text=True,
                       env=env, timeout=scaled(120))
    assert r.returncode == 0, r.stderr
    # 4 fives, and 4 sevens written through the received view of the same memory.
    assert r.stdout.split() == ["1.24.4", "48.0", "(2,)", "0"], r.stdout
