"""The founding article's programs (../shared/article) under `mpcore run`.

Each program runs unchanged through `python -m mpcore run` and prints what
the article says it prints, and what plain python prints; MPCORE_STATS shows
that torch.multiprocessing in them was served by mpcore (and that plain
python leaves mpcore out).  helpers.article() skips locally when the
article is absent and fails in CI.  Every program runs in a session of its
own, and the test waits for all of that session (keeper included) to go.
"""
import json
import math
import os
import re
import sys

import pytest

from helpers import article, run_in_session

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("leak_check")]

SHARED_TENSOR_OUT = """\
tensor([[0., 0., 0., 0.],
        [1., 1., 1., 1.],
        [2., 2., 2., 2.],
        [3., 3., 3., 3.]])
"""

HOGWILD_LINE = re.compile(r"^Process (\d+), Epoch (\d+), Loss: (\S+)$")


def clean_env(**extra):
    # Without mpcore's switches, and with python's default buffering: under
    # PYTHONUNBUFFERED, print() writes a line's text and its newline
    # separately, so 4 processes' lines interleave mid-line (with or without
    # mpcore); buffered, each child's lines reach the pipe in one write.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MPCORE_") and k != "PYTHONUNBUFFERED"}
    env.update(extra)
    return env


def run(path, launcher, env=None, timeout=120):
    """Runs the program (under `mpcore run` if launcher) from a scratch cwd;
    returns (CompletedProcess, pid of its first process)."""
    cmd = [sys.executable] + (["-m", "mpcore", "run"] if launcher else []) + [path]
    r = run_in_session(cmd, os.path.dirname(path), env or clean_env(), timeout)
    return r, r.pid


def stats_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --- shared_tensor.py -----------------------------------------------------------

def test_shared_tensor_under_launcher():
    r, _ = run(article("shared_tensor.py"), launcher=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == SHARED_TENSOR_OUT
    assert "Traceback" not in r.stderr


def test_shared_tensor_same_as_plain_python():
    path = article("shared_tensor.py")
    want, _ = run(path, launcher=False)
    got, _ = run(path, launcher=True)
    assert want.returncode == got.returncode == 0, (want.stderr, got.stderr)
    assert got.stdout == want.stdout == SHARED_TENSOR_OUT


def test_shared_tensor_served_by_mpcore(tmp_path):
    stats = tmp_path / "stats.jsonl"
    r, pid = run(article("shared_tensor.py"), launcher=True,
                 env=clean_env(MPCORE_STATS=str(stats)))
    assert r.returncode == 0, r.stderr
    assert r.stdout == SHARED_TENSOR_OUT
    lines = stats_lines(stats)
    main = [l for l in lines if l["pid"] == pid]
    assert len(main) == 1, lines
    assert main[0]["processes_started"] == 4
    assert main[0]["storages_shared"] >= 1
    assert main[0]["shm_segments_created"] >= 1
    # Each of the 4 children wrote its own line too: all were mpcore's.
    assert len({l["pid"] for l in lines} - {pid}) == 4


# --- hogwild.py -----------------------------------------------------------------

def check_hogwild_output(stdout):
    lines = stdout.splitlines()
    assert len(lines) == 40, stdout
    seen = {}
    for line in lines:
        m = HOGWILD_LINE.match(line)
        assert m, f"not a progress line: {line!r}"
        rank, epoch, loss = int(m.group(1)), int(m.group(2)), float(m.group(3))
        assert math.isfinite(loss) and loss >= 0, line
        seen.setdefault(rank, []).append(epoch)
    assert sorted(seen) == [0, 1, 2, 3]
    for rank, epochs in seen.items():
        # Each process prints its own epochs in order.
        assert epochs == list(range(10)), (rank, epochs)


def test_hogwild_under_launcher():
    r, _ = run(article("hogwild.py"), launcher=True)
    assert r.returncode == 0, r.stderr
    check_hogwild_output(r.stdout)
    assert "Traceback" not in r.stderr


def test_hogwild_same_shape_as_plain_python():
    # The losses are random; the 40 lines' shape is what both must print.
    want, _ = run(article("hogwild.py"), launcher=False)
    assert want.returncode == 0, want.stderr
    check_hogwild_output(want.stdout)


def test_hogwild_served_by_mpcore(tmp_path):
    stats = tmp_path / "stats.jsonl"
    r, pid = run(article("hogwild.py"), launcher=True, env=clean_env(MPCORE_STATS=str(stats)))
    assert r.returncode == 0, r.stderr
    check_hogwild_output(r.stdout)
    lines = stats_lines(stats)
    main = [l for l in lines if l["pid"] == pid]
    assert len(main) == 1, lines
    assert main[0]["processes_started"] == 4
    assert main[0]["storages_shared"] >= 2      # the Linear's weight and bias
    assert len({l["pid"] for l in lines} - {pid}) == 4


@pytest.mark.parametrize("name", ["shared_tensor.py", "hogwild.py"])
def test_plain_python_leaves_mpcore_out(tmp_path, name):
    stats = tmp_path / "stats.jsonl"
    r, _ = run(article(name), launcher=False, env=clean_env(MPCORE_STATS=str(stats)))
    assert r.returncode == 0, r.stderr
    assert not stats.exists(), stats.read_text()


# --- dataloader.py --------------------------------------------------------------

def test_dataloader_same_as_plain_python():
    path = article("dataloader.py")
    want, _ = run(path, launcher=False)
    got, _ = run(path, launcher=True)
    assert want.returncode == got.returncode == 0, (want.stderr, got.stderr)
    assert got.stdout == want.stdout
    assert got.stdout.startswith("tensor([ 0,  1,  2,")
    assert got.stdout.count("tensor(") == 32    # 1000 items in batches of 32


# --- async_tasks.py -------------------------------------------------------------

def test_async_tasks_under_launcher():
    # Plain torch fails on torch.sleep, which PyTorch lacks; under mpcore run
    # it is a sleep in seconds.  (Each child's lines reach the pipe when it
    # exits, so their order says nothing about overlap.)
    plain, _ = run(article("async_tasks.py"), launcher=False)
    assert "torch' has no attribute 'sleep'" in plain.stderr
    assert "Ending task" not in plain.stdout
    r, _ = run(article("async_tasks.py"), launcher=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sorted(lines) == sorted([f"Starting task in process {i}" for i in range(4)]
                                   + [f"Ending task in process {i}" for i in range(4)])
    for i in range(4):
        assert lines.index(f"Starting task in process {i}") < lines.index(
            f"Ending task in process {i}")


def test_launcher_adds_only_torch_sleep(tmp_path):
    # The one change mpcore run makes to torch's namespace is torch.sleep.
    probe = tmp_path / "probe.py"
    probe.write_text("import json, torch\n"
                     "print(json.dumps(sorted(n for n in dir(torch) if not n.startswith('_'))))\n")
    plain, _ = run(str(probe), launcher=False)
    served, _ = run(str(probe), launcher=True)
    assert plain.returncode == 0 and served.returncode == 0, (plain.stderr, served.stderr)
    assert set(json.loads(served.stdout)) - set(json.loads(plain.stdout)) == {"sleep"}
    assert set(json.loads(plain.stdout)) <= set(json.loads(served.stdout))
