"""Resumable loading: DataLoader.state_dict() / load_state_dict().

The matrix: for sequential, shuffled-with-a-generator and weighted samplers
and for an IterableDataset with and without a state of its own, with 0, 2
and 4 workers (and persistent workers), a checkpoint is taken after k
batches of a two-epoch stream: k = 0, 1, the epoch's last batch but one,
its last batch, a batch of the next epoch, and after the epoch ran out.
The checkpoints are taken along one uninterrupted run, which must itself
give what a run without them (and without workers) gives; one fresh program
resumes every checkpoint (tests/data/_resume_data.py), and the batches it gives
must be exactly the rest of that stream.
Then: a dataset whose items depend on each worker's own state, torchdata's
StatefulDataLoader in both directions, the errors (a live iterator, another
num_workers, foreign and corrupt states), and a worker killed around a
state_dict()."""
import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from helpers import NO_TORCH_PRELUDE, Scenario, fresh_env, require, run_program, scaled
import _resume_data as rd

pytestmark = pytest.mark.timeout(240)

CONFIGS = [(k, w, False) for k in rd.SAMPLERS + rd.ITERABLES for w in (0, 2, 4)]
CONFIGS += [("shuffled", 2, True), ("iterable-stateful", 2, True)]


def _name(config):
    kind, workers, persistent = config
    return f"{kind}-{workers}w" + ("-persistent" if persistent else "")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{config name: (full stream, [(k, batches before, batches resumed)])}."""
    warnings.simplefilter("ignore")
    d = tmp_path_factory.mktemp("resume")
    plans, jobs = {}, {}
    for config in CONFIGS:
        kind, workers, persistent = config
        per_epoch = len(rd.make(kind, 0)) if kind in rd.SAMPLERS else -(-rd.N_ITER // rd.BATCH)
        marks = (0, 1, per_epoch - 1, per_epoch, per_epoch + 3, "end")
        # The checkpoints are taken along the uninterrupted stream itself.
        full, states = rd.stream(rd.make(kind, workers, persistent_workers=persistent),
                                 marks=marks)
        points = []
        for k in marks:
            state, epoch = states[k]
            job = f"{_name(config)}-{k}"
            torch.save(state, d / f"{job}.pt")
            jobs[job] = (kind, workers, persistent, str(d / f"{job}.pt"), epoch)
            before = full[:per_epoch if k == "end" else k]
            points.append((k, before, job))
        plans[_name(config)] = (full, points)
    (d / "jobs.json").write_text(json.dumps(jobs))
    sc = Scenario()
    try:
        env = fresh_env()
        env.update(sc.env())
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__),
                                             env.get("PYTHONPATH", "")])
        r = subprocess.run([sys.executable, rd.__file__, str(d / "jobs.json"), str(d / "out.json")],
                           capture_output=True, text=True, timeout=scaled(180), env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        sc.check_clean()
    finally:
        sc.close()
    rest = json.loads((d / "out.json").read_text())
    return {name: (full, [(k, got, rest[job]) for k, got, job in points])
            for name, (full, points) in plans.items()}


@pytest.mark.parametrize("config", CONFIGS, ids=_name)
def test_resumes_where_it_stopped(resumed, config):
    full, points = resumed[_name(config)]
    assert len(full) > rd.EPOCHS
    kind, workers, persistent = config
    if workers and kind in rd.SAMPLERS and not persistent:
        # Taking states along the way changed nothing (and workers give
        # what loading in the main process gives).
        assert full == rd.stream(rd.make(kind, 0))[0]
    for k, before, after in points:
        assert before + after == full, (
            f"checkpoint after {k} batches: {len(before)} before + {len(after)} resumed, "
            f"expected the {len(full)} of the uninterrupted stream")


class Drifting(torch.utils.data.Dataset):
    """Each item carries how many items this copy of the dataset (one per
    worker) has given: a state of its own, per worker."""

    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 40

    def __getitem__(self, i):
        self.calls += 1
        return torch.tensor([i, self.calls])

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


@pytest.mark.parametrize("workers", [0, 3])
def test_a_dataset_state_per_worker(workers):
    from mpcore.data import DataLoader

    def make():
        return DataLoader(Drifting(), batch_size=3, num_workers=workers)

    full = [b.tolist() for b in make()]
    for k in (1, 4, 7):
        loader = make()
        it = iter(loader)
        before = [next(it).tolist() for _ in range(k)]
        state = loader.state_dict()
        del it
        again = make()
        again.load_state_dict(state)
        assert before + [b.tolist() for b in again] == full, f"after {k} batches"


def _torchdata():
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        StatefulDataLoader = None
    require(StatefulDataLoader is not None,
            "torchdata (pip install --no-deps torchdata) for the differential test")
    return StatefulDataLoader


@pytest.mark.parametrize("kind", ["sequential", "shuffled"])
@pytest.mark.parametrize("workers", [0, 2])
def test_state_moves_between_mpcore_and_torchdata(kind, workers):
    from mpcore.data import DataLoader
    StatefulDataLoader = _torchdata()

    def make(cls):
        g = torch.Generator()
        g.manual_seed(7)
        return cls(rd.Items(), batch_size=rd.BATCH, shuffle=kind == "shuffled", generator=g,
                   num_workers=workers)

    for src, dst in ((DataLoader, StatefulDataLoader), (StatefulDataLoader, DataLoader)):
        full = [b.tolist() for b in make(src)]
        for k in (0, 1, 6):
            assert _moved(make, src, dst, k) == full, f"{src.__name__} -> {dst.__name__} after {k}"


def _moved(make, src, dst, k):
    """The epoch's batches: k from make(src), then the rest from make(dst)
    given make(src)'s state after those k."""
    loader = make(src)
    it = iter(loader)
    before = [next(it).tolist() for _ in range(k)]
    state = loader.state_dict()
    del it
    other = make(dst)
    other.load_state_dict(state)
    return before + [b.tolist() for b in other]


class Seeded(rd.Items):
    """An item and the seed of the worker (or process) that made it."""

    def __getitem__(self, i):
        return torch.tensor([i, torch.initial_seed() % 100_003])


@pytest.mark.parametrize("generator", [True, False], ids=["generator", "global"])
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_loader_gives_torchdatas_batches(workers, generator):
    """NOTE [ torchdata's samplers ]: mpcore's StatefulDataLoader, shuffled,
    gives what torchdata's gives (an order and worker seeds that torch's
    DataLoader does not), over two epochs, and a state moves between them."""
    from mpcore.data import StatefulDataLoader as Ours
    Theirs = _torchdata()

    def make(cls):
        torch.manual_seed(11)
        g = torch.Generator().manual_seed(7) if generator else None
        return cls(Seeded(), batch_size=rd.BATCH, shuffle=True, generator=g, num_workers=workers)

    def epochs(loader):
        return [[b.tolist() for b in loader] for _ in range(2)]

    want = epochs(make(Theirs))
    assert epochs(make(Ours)) == want
    assert want != epochs(make(torch.utils.data.DataLoader))
    for src, dst in ((Ours, Theirs), (Theirs, Ours)):
        for k in (0, 3):
            assert _moved(make, src, dst, k) == want[0], \
                f"{src.__module__} -> {dst.__module__} after {k}"


def test_torchdata_loader_is_served_under_mpcore_run():
    _torchdata()
    r = run_program("""
        from torchdata.stateful_dataloader import StatefulDataLoader
        loader = StatefulDataLoader(list(range(10)), batch_size=3, num_workers=2,
                                    snapshot_every_n_steps=5)
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        del it
        again = StatefulDataLoader(list(range(10)), batch_size=3, num_workers=2)
        again.load_state_dict(state)
        print(type(again).__module__, [b.tolist() for b in again])
    """, launcher=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["mpcore.data._loader", "[[3,", "4,", "5],", "[6,", "7,", "8],",
                                "[9]]"], r.stdout


def test_resumes_without_torch():
    # numpy batches and numpy generators: the shuffled order of the epoch and
    # of the next one come out the same after a resume.
    r = run_program(NO_TORCH_PRELUDE + """
import numpy as np
from mpcore.data import DataLoader
def make(workers):
    g = np.random.default_rng(5)
    return DataLoader(list(range(37)), batch_size=4, shuffle=True, generator=g,
                      num_workers=workers)
for workers in (0, 2):
    loader = make(workers)
    full = [b.tolist() for b in loader] + [b.tolist() for b in loader]
    loader = make(workers)
    it = iter(loader)
    before = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    del it
    again = make(workers)
    again.load_state_dict(state)
    after = [b.tolist() for b in again] + [b.tolist() for b in again]
    print(workers, before + after == full, len(full), "torch" in sys.modules)
""", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["0", "True", "20", "False", "2", "True", "20", "False"], r.stdout


def test_load_while_an_iterator_is_live_is_an_error():
    loader = rd.make("sequential", 2)
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    with pytest.raises(RuntimeError, match=r"iterator of this loader is live \(1 batches"):
        loader.load_state_dict(state)
    # The iterator goes on undisturbed; once let go of, the state loads.
    assert next(it).tolist() == [[4 + i, 40 + 10 * i] for i in range(4)]
    del it
    loader.load_state_dict(state)
    assert [first.tolist()] + [b.tolist() for b in loader] == _epoch("sequential")


@pytest.mark.parametrize("taken, given", [(2, 4), (2, 0), (0, 2)])
def test_another_num_workers_is_an_error(taken, given):
    loader = rd.make("shuffled", taken)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    other = rd.make("shuffled", given)
    with pytest.raises(ValueError, match=f"num_workers={taken} and this loader has "
                                         f"num_workers={given}"):
        other.load_state_dict(state)
    assert len(list(other)) == len(other)  # nothing was loaded: a whole epoch


def _epoch(kind, workers=0):
    return [b.tolist() for b in rd.make(kind, workers)]


def _good_state(workers):
    loader = rd.make("sequential", workers)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    return state


@pytest.mark.parametrize("mangle, message", [
    (lambda s: ["a list"], "expected the dict that state_dict"),
    (lambda s: {"model": 1}, "not a DataLoader state: it has neither"),
    (lambda s: {**s, "_snapshot": 5}, r"\['_snapshot'\] is int, expected dict"),
    (lambda s: {**s, "_snapshot": {**s["_snapshot"], "_snapshot_step": "3"}},
     "'_snapshot_step'] is str"),
    (lambda s: {**s, "_snapshot": {**s["_snapshot"], "_snapshot_step": -2}}, "negative"),
    (lambda s: {**s, "_snapshot": {**s["_snapshot"], "_last_yielded_worker_id": 7}},
     "last worker 7 is not one of 2"),
    (lambda s: {**s, "_snapshot": {**s["_snapshot"], "_worker_snapshots": {"worker_0": None}}},
     "worker snapshots are"),
    (lambda s: {**s, "_snapshot": {**s["_snapshot"], "_main_snapshot": {}}},
     "has no key '_num_workers'"),
])
def test_foreign_and_corrupt_states_are_errors(mangle, message):
    bad = mangle(_good_state(2))
    loader = rd.make("sequential", 2)
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(bad)
    assert [b.tolist() for b in loader] == _epoch("sequential")


def test_a_dataset_without_state_is_fast_forwarded_with_one_warning():
    loader = rd.make("iterable-stateless", 2)
    it = iter(loader)
    before = [next(it).tolist() for _ in range(5)]
    state = loader.state_dict()
    del it
    again = rd.make("iterable-stateless", 2)
    again.load_state_dict(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after = [b.tolist() for b in again]
    fast = [w for w in caught if "drops them" in str(w.message)]
    assert len(fast) == 1, [str(w.message) for w in caught]
    assert "first 5 batches" in str(fast[0].message)
    assert before + after == _epoch("iterable-stateless", 2)


def test_a_worker_killed_around_a_state_dict(leak_check):
    # The state describes what the program received, so it survives the
    # worker: taken after the kill it still resumes exactly, the iterator
    # reports the death clearly, and nothing is left behind.
    loader = rd.make("shuffled", 2)
    full = [b.tolist() for b in rd.make("shuffled", 2)]
    it = iter(loader)
    before = [next(it).tolist() for _ in range(3)]
    pid = it._workers[1].pid
    os.kill(pid, signal.SIGKILL)
    state = loader.state_dict()
    with pytest.raises(RuntimeError, match=f"DataLoader worker \\(pid {pid}\\) is killed by "
                                           "signal: Killed"):
        while True:
            next(it)
    del it
    again = rd.make("shuffled", 2)
    again.load_state_dict(state)
    assert before + [b.tolist() for b in again] == full
