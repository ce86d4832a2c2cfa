"""torch's own distributed tests as a standing check (torch_suite.py).

The CI subset of torch's DistributedTest (shipped inside torch, BACKEND=gloo,
two ranks) runs under plain python and under `mpcore run`.  Every test of the
subset must pass under plain python on the pinned torch (else the subset or
the environment is wrong, and the comparison would prove nothing), and every
one that passes plain must pass under mpcore: that is what mpcore promises,
a program's results the same as under python.
"""
import importlib.util
import json
import os
import sys

import pytest

from helpers import require, run_in_session, scaled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_suite  # noqa: E402

# Seconds on a quiet machine (each scaled by how slow this one is now):
# each test in each mode is bounded by the script (PER_TEST), the whole run
# (about 5 minutes on two quiet cores) by WHOLE, and pytest-timeout leaves
# the script room to end its last worker.
PER_TEST = 120
WHOLE = 900

pytestmark = [pytest.mark.timeout(WHOLE + 60), pytest.mark.usefixtures("leak_check")]


def test_ci_subset_passes_under_mpcore_where_it_passes_plain(tmp_path):
    # torch's test harness (common_utils) imports expecttest, a test
    # dependency that torch's wheel does not pull in.
    require(importlib.util.find_spec("expecttest") is not None,
            "torch's test harness needs the expecttest package")
    r = run_in_session([sys.executable, torch_suite.HERE, "--json", "--quiet",
                        "--timeout", str(scaled(PER_TEST)), "--log-dir", str(tmp_path / "logs")],
                       cwd=tmp_path, timeout=scaled(WHOLE))
    assert r.returncode in (0, 1), f"the script failed (status {r.returncode}):\n{r.stderr[-4000:]}"
    out = json.loads(r.stdout)
    names = [row["test"] for row in out["tests"]]
    assert names == torch_suite.CI_SUBSET

    not_plain = {row["test"]: (row["plain"]["outcome"], row["plain"]["error"])
                 for row in out["tests"] if row["plain"]["outcome"] != "pass"}
    assert not not_plain, ("tests of the CI subset that do not pass under plain python on "
                           f"this torch (the subset or the environment is wrong): {not_plain}")

    regressions = {row["test"]: f"{row['mpcore']['outcome']}: {row['mpcore']['error']}"
                   for row in out["tests"] if row["mpcore"]["outcome"] != "pass"}
    assert out["passes_plain_not_mpcore"] == sorted(regressions, key=names.index)
    assert not regressions, (
        "torch's tests that pass under plain python but not under `mpcore run`:\n"
        + "\n".join(f"  {k}: {v}" for k, v in regressions.items()))
    assert r.returncode == 0
