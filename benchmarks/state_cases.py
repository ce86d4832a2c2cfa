"""The resumable-loading row: what a checkpoint of the loader costs per
step, mpcore.data.DataLoader against torchdata's StatefulDataLoader with
its default settings, on the same loop.

cases.py imports this module and calls register(cases) near its end.
Nothing here imports torch, torchdata or mpcore at module level.

NOTE [ The snapshot row ]
The loop is the one a training program runs when it checkpoints the loader
every step: next(it), then loader.state_dict().  The dataset is the
article's (a list of ints), batch 32, 2 fork workers, both sides made the
same way; the torch side is torchdata's StatefulDataLoader
(snapshot_every_n_steps=1, its default: its workers send their state with
every batch), the mpcore side mpcore's DataLoader (which sends nothing for
a dataset without state).  The figure is time per step with state_dict();
the same loop without state_dict() is timed in the same child, in runs
that alternate with those of the loop with it (the best of each counts), so
the note gives each side's cost of the checkpoint itself, and that of
torchdata's per-step snapshots, against a plain torch DataLoader.
"""
import time

WORKERS, BATCH = 2, 32
ROUNDS = 3  # timed runs of each loop after calibration, alternating; the best counts
_c = None


def _loader(env, kind, n_items):
    ds = _c.CustomDataset(list(range(n_items)))
    if kind == "mpcore":
        from mpcore.data import DataLoader as cls
    elif kind == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader as cls
    else:
        cls = env.torch.utils.data.DataLoader
    return cls(ds, batch_size=BATCH, num_workers=WORKERS)


def _loop(env, kind, n, snapshot):
    """Seconds for n steps after the first batch (the loader, its workers
    and the first batch are made before the clock starts)."""
    loader = _loader(env, kind, (n + 1) * BATCH)
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    if snapshot:
        for _ in range(n):
            b = next(it)
            state = loader.state_dict()
    else:
        for _ in range(n):
            b = next(it)
    el = time.perf_counter() - t0
    if int(b[-1]) != (n + 1) * BATCH - 1 or (snapshot and not state):
        raise AssertionError(f"last batch wrong: {b}")
    del it, b
    return el


def snapshot_row(env, target_s):
    kind = "mpcore" if env.mpcore is not None else "torchdata"
    if kind == "torchdata":
        try:
            import torchdata.stateful_dataloader  # noqa: F401
        except ImportError:
            raise RuntimeError("torchdata is not installed (pip install --no-deps torchdata)")
    with _c._quiet():
        n, el = _c.calibrate(lambda k: _loop(env, kind, k, True), target_s, probe=200,
                             lo=2, hi=100_000)
        plain = float("inf")
        for _ in range(ROUNDS):  # alternating, so that both see the same machine
            plain = min(plain, _loop(env, kind, n, False))
            el = min(el, _loop(env, kind, n, True))
        extra = {"without_state_dict_us": plain / n * 1e6,
                 "loader": kind}
        if kind == "torchdata":
            extra["torch_dataloader_us"] = min(_loop(env, "torch", n, False)
                                               for _ in range(2)) / n * 1e6
    per = el / n * 1e6
    extra["state_dict_us"] = per - extra["without_state_dict_us"]
    return _c.Measurement(per, n, el, extra)


def _notes(row):
    out = []
    for impl, best, e in _c.best_entries(row):
        line = (f"{e['loader']}: {best:.3g} us a step with state_dict(), "
                f"{e['without_state_dict_us']:.3g} us without: the checkpoint costs "
                f"{e['state_dict_us']:.3g} us")
        if "torch_dataloader_us" in e:
            line += (f"; torch's DataLoader without snapshots: "
                     f"{e['torch_dataloader_us']:.3g} us a step")
        out.append(line)
    return out


def register(cases):
    """Adds this module's rows to cases.CASES (called by cases.py)."""
    global _c
    _c = cases
    cases.add_case(
        "dl-snapshot", "DataLoader step + state_dict(), batch 32", "us/step", False,
        snapshot_row, row_notes=_notes, in_quick=False,
        note="The article's ints, batch_size=32, num_workers=2, fork; next(it) then "
             "loader.state_dict() every step (NOTE [ The snapshot row ]). torch: torchdata's "
             "StatefulDataLoader, default snapshot_every_n_steps=1; mpcore: "
             "mpcore.data.DataLoader.")
