"""DataLoader rows beyond cases.py's: loaders made anew, as an evaluation
loop makes them.

cases.py imports this module and calls register(cases) near its end; the
rows go after its own.  Nothing here imports torch or mpcore at module
level.

NOTE [ Evaluation loaders made anew ]
An evaluation loop often makes a new DataLoader each time it evaluates,
non-persistent, with the 'spawn' start method (the only safe one once
threads or CUDA run).  Each of its workers is then a new process: with
torch a fresh interpreter that imports torch and unpickles the dataset;
with mpcore a child forked by the zygote, which has imported torch once.
The row makes such a loader EVAL_LOADERS times, on both sides with the
same code (the side's DataLoader class, multiprocessing_context="spawn"),
and times each from the loader's creation to its first batch; the rest of
the epoch runs and the workers stop untimed.  One loader before them is
not timed (its time is in extra.first_ms): it pays once what every later
loader of the program is spared (on the mpcore side the zygote's start,
with its import of torch, when the program was not started by `mpcore
run`).  The figure is the mean of the timed loaders.
"""
import time

EVAL_LOADERS = 10        # loaders timed per run
EVAL_WORKERS = 2
EVAL_ITEMS = 256         # the article's ints
EVAL_BATCH = 32
EVAL_TARGET = 20.0       # mpcore's target ratio

_c = None                # the cases module (register)


def _eval_loader_first_batch(env, cls, ds):
    """Seconds from making the loader to its first batch; then the epoch
    is run to its end (untimed) and the workers stop."""
    with _c._quiet():
        t0 = time.perf_counter()
        loader = cls(ds, batch_size=EVAL_BATCH, num_workers=EVAL_WORKERS,
                     multiprocessing_context="spawn")
        it = iter(loader)
        b = next(it)
        el = time.perf_counter() - t0
        if tuple(b.shape) != (EVAL_BATCH,) or int(b[-1]) != EVAL_BATCH - 1:
            raise AssertionError(f"first batch wrong: {b}")
        n = 1 + sum(1 for _ in it)
        if n != EVAL_ITEMS // EVAL_BATCH:
            raise AssertionError(f"{n} batches, expected {EVAL_ITEMS // EVAL_BATCH}")
        del it, b, loader
    return el


def eval_anew(env, target_s, loaders=EVAL_LOADERS):
    cls = _c._loader_cls(env)
    ds = _c.CustomDataset(list(range(EVAL_ITEMS)))
    first = _eval_loader_first_batch(env, cls, ds)
    times = [_eval_loader_first_batch(env, cls, ds) for _ in range(loaders)]
    mean = sum(times) / len(times)
    return _c.Measurement(mean * 1e3, len(times), sum(times), {
        "first_ms": first * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
        "num_workers": EVAL_WORKERS, "context": "spawn",
        "dataloader": f"{cls.__module__}.DataLoader"})


def _eval_notes(row):
    ex = {impl: _c._best_row_extra(row, impl) for impl in _c.IMPLS}
    out = []
    firsts = [f"{impl} {ex[impl]['first_ms']:.4g} ms" for impl in _c.IMPLS if ex[impl]]
    if firsts:
        out.append("the untimed loader before them (best run's): " + ", ".join(firsts))
    if row["ratio"] is not None:
        out.append(f"target >= {EVAL_TARGET:g}x: "
                   f"{'met' if row['ratio'] >= EVAL_TARGET else 'MISSED'}")
    return out


def register(cases):
    """Adds this module's rows to cases.CASES (called by cases.py)."""
    global _c
    _c = cases
    cases.add_case(
        "dl-eval-anew", f"DataLoader made anew x{EVAL_LOADERS}, spawn, to first batch", "ms",
        False, eval_anew, row_notes=_eval_notes, timeout_s=240.0,
        note=f"An evaluation loader made anew {EVAL_LOADERS} times (NOTE [ Evaluation loaders "
             f"made anew ] in loader_cases.py): the article's dataset ({EVAL_ITEMS} ints), "
             f"batch_size={EVAL_BATCH}, num_workers={EVAL_WORKERS}, "
             "multiprocessing_context='spawn', non-persistent; mean time from creation to "
             "first batch, after one untimed loader. torch: torch.utils.data.DataLoader; "
             f"mpcore: mpcore.data.DataLoader. Target >= {EVAL_TARGET:g}x.")
