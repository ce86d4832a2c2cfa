"""Rows of datasets that workers share (mpcore.data.SharedList and
share_dataset, NOTE [ Shared datasets ] in mpcore/data/_shared.py).

cases.py imports this module and calls register(cases) near its end.
Nothing here imports torch or mpcore at module level.

NOTE [ The shared-dataset rows ]
The dataset is a map-style Dataset over a list of small dicts (a path, a
label, a box of 4 floats: about 500 bytes each as Python objects, COCO's
metadata in miniature); each read touches every field.
- shared-mem: one epoch with 4 fork workers (persistent, so that they are
  still there when it ends), then the unique memory (USS: Private_Clean +
  Private_Dirty of /proc/PID/smaps_rollup) of the workers, summed, and the
  PSS of the loading program (its main process and workers).  Each variant
  runs in a process forked from the side's child for it alone (its own
  heap: what one variant freed cannot flatter the next), for the large
  dataset and for one 1,000 times smaller; the figure is the growth
  between the two, which leaves out what a forked worker costs whatever
  its dataset.  torch's side: torch's DataLoader on the plain list, and on
  the list serialized as detectron2 does it (pickles in one numpy byte
  array with an offsets array, a dozen lines below).  mpcore's side:
  mpcore's DataLoader on the plain list, and on the dataset converted
  (share_dataset=True).  The ratio is torch's plain list against mpcore
  converted.  "One copy" is the growth of a process's own memory when it
  builds the plain list.
- shared-start: from DataLoader(..., num_workers=4, 'spawn') to its first
  batch, for the large dataset and one 100 times smaller, after one untimed
  loader (the zygote's start on mpcore's side); the dataset is built (and
  converted) before the clock.
- shared-start-plain: as shared-start, on the plain list on both sides
  (the dataset left as it is), the large dataset only: 4 workers and 1;
  on mpcore's side also 4 workers with the dataset pickled per worker, as
  mpcore did before it pickled it once (NOTE [ A dataset travels once ] in
  mpcore/data/_ship.py); and what one pickle and one unpickle of the
  dataset cost, which the times to first batch are made of.
- shared-item: reading random items, a plain list's on torch's side, a
  SharedList's on mpcore's.
- shared-epoch: one epoch's items per second, 4 fork workers, torch's
  DataLoader on the plain list against mpcore's on the converted one.
"""
import gc
import json
import os
import pickle
import random
import time

MEM_ITEMS = int(os.environ.get("MPCORE_BENCH_SHARED_ITEMS", 2_000_000))
MEM_SMALL_DIV = 1000
START_SMALL_DIV = 100
WORKERS = 4
BATCH = 256
EPOCH_ITEMS = 200_000
ITEM_ITEMS = 200_000
MEM_TARGET = 0.05        # converted's workers' USS growth over torch's
PSS_TARGET = 1.3         # the program's PSS growth over one copy
START_TARGET = 20.0
START_FLAT = 1.5         # large dataset's time to first batch over the small one's

_c = None


def make_items(n):
    return [{"path": f"/datasets/coco/train2017/{i:012d}.jpg", "label": i % 80,
             "box": [i * 0.5, 1.5, 2.5 + i, 3.5]} for i in range(n)]


class MetaDataset:
    """A map-style dataset over a list of dicts."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        return it["label"] + len(it["path"]) + int(it["box"][0] > 0)


class NumpySerialized:
    """detectron2's serialization (DatasetFromList(serialize=True)): each
    item pickled into one numpy byte array, and the offsets in another."""

    def __init__(self, items):
        import numpy as np
        blobs = [np.frombuffer(pickle.dumps(x, protocol=-1), dtype=np.uint8) for x in items]
        self._addr = np.cumsum(np.asarray([len(b) for b in blobs], dtype=np.int64))
        self._lst = np.concatenate(blobs)

    def __len__(self):
        return len(self._addr)

    def __getitem__(self, idx):
        start = 0 if idx == 0 else self._addr[idx - 1].item()
        return pickle.loads(memoryview(self._lst[start:self._addr[idx].item()]))


def _dataset(env, items):
    # torch's DataLoader takes any object with __getitem__ and __len__ as a
    # map-style dataset, and share_dataset any object's attributes.
    return MetaDataset(items)


def _rollup(pid):
    """(USS, PSS, RSS) in bytes, from /proc/PID/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[0].endswith(":"):
                out[parts[0][:-1]] = int(parts[1]) * 1024
    return (out.get("Private_Clean", 0) + out.get("Private_Dirty", 0), out.get("Pss", 0),
            out.get("Rss", 0))


def _in_fork(fn, *args):
    """fn(*args) in a process forked for it alone; its JSON result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            res = fn(*args)
            code = 0
        except BaseException as e:
            import traceback
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
        try:
            os.write(w, json.dumps(res).encode())
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        res = json.loads(b"".join(chunks))
    except ValueError:
        res = {"error": "it reported nothing"}
    if code != 0 or (isinstance(res, dict) and "error" in res):
        why = res.get("error") if isinstance(res, dict) else res
        raise RuntimeError(f"the measuring process ({fn.__name__}{args[1:]}) failed, exit "
                           f"code {code}: {why}")
    return res


def _one_copy(n):
    gc.collect()
    before = _rollup(os.getpid())[0]
    items = make_items(n)
    after = _rollup(os.getpid())[0]
    del items
    return after - before


def _mem_variant(env, variant, n):
    cls = _c._loader_cls(env)
    gc.collect()
    items = make_items(n)
    kw = {}
    if variant == "numpy":
        ds = _dataset(env, None)
        ds.items = NumpySerialized(items)
    else:
        ds = _dataset(env, items)
        kw = {"share_dataset": True} if variant == "converted" else {}
    del items
    gc.collect()
    with _c._quiet():
        loader = cls(ds, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True,
                     multiprocessing_context="fork", **kw)
        t0 = time.perf_counter()
        seen = 0
        for b in loader:
            seen += len(b)
        epoch = time.perf_counter() - t0
    if seen != n:
        raise AssertionError(f"{seen} items, expected {n}")
    pids = [w.pid for w in loader._iterator._workers]
    workers = [_rollup(p) for p in pids]
    main = _rollup(os.getpid())
    res = {"uss_workers": sum(w[0] for w in workers),
           "pss_total": main[1] + sum(w[1] for w in workers),
           "uss_main": main[0], "epoch_s": epoch}
    del loader
    return res


def _variants(env):
    return ("plain", "converted") if env.mpcore is not None else ("plain", "numpy")


def shared_mem(env, target_s, n=None):
    n = n or MEM_ITEMS
    small = max(n // MEM_SMALL_DIV, 1)
    extra = {"items": n, "small_items": small, "workers": WORKERS,
             "one_copy": _in_fork(_one_copy, n)}
    for v in _variants(env):
        big = _in_fork(_mem_variant, env, v, n)
        lit = _in_fork(_mem_variant, env, v, small)
        extra[v] = {"large": big, "small": lit,
                    "uss_growth": big["uss_workers"] - lit["uss_workers"],
                    "pss_growth": big["pss_total"] - lit["pss_total"]}
    main = extra["converted" if env.mpcore is not None else "plain"]
    return _c.Measurement(main["uss_growth"] / 2**20, n, main["large"]["epoch_s"], extra)


def _mb(b):
    return f"{b / 2**20:,.0f} MB"


def _mem_columns(row):
    ex = {impl: _c._best_row_extra(row, impl) for impl in _c.IMPLS}
    t, m = ex["torch"] or {}, ex["mpcore"] or {}

    def cell(side, v, key):
        return _mb(side[v][key]) if side and v in side else "-"
    cols = []
    for key, label in (("uss_growth", "workers' USS growth"), ("pss_growth", "PSS growth")):
        cols.append((f"{label}: torch / d2 numpy / mpcore / mpcore converted",
                     " / ".join([cell(t, "plain", key), cell(t, "numpy", key),
                                 cell(m, "plain", key), cell(m, "converted", key)])))
    one = (t or m).get("one_copy")
    cols.append(("one copy", _mb(one) if one else "-"))
    return cols


def _mem_notes(row):
    ex = {impl: _c._best_row_extra(row, impl) for impl in _c.IMPLS}
    t, m = ex["torch"], ex["mpcore"]
    out = []
    if t and m:
        g = m["converted"]["uss_growth"] / max(t["plain"]["uss_growth"], 1)
        out.append(f"converted workers' USS growth {100 * g:.1f}% of torch's (target <= "
                   f"{100 * MEM_TARGET:g}%): {'met' if g <= MEM_TARGET else 'MISSED'}")
        one = m["one_copy"]
        p = m["converted"]["pss_growth"] / max(one, 1)
        out.append(f"converted PSS growth {p:.2f}x one copy ({_mb(one)}; target <= "
                   f"{PSS_TARGET:g}x): {'met' if p <= PSS_TARGET else 'MISSED'}")
        ep = [f"{name} {side[v]['large']['epoch_s']:.1f} s" for name, side, v in
              (("torch", t, "plain"), ("d2 numpy", t, "numpy"), ("mpcore", m, "plain"),
               ("mpcore converted", m, "converted"))]
        out.append("the large epoch took: " + ", ".join(ep))
    return out


# --- start-up ----------------------------------------------------------------------

def _first_batch(cls, ds, num_workers=WORKERS, **kw):
    with _c._quiet():
        t0 = time.perf_counter()
        loader = cls(ds, batch_size=BATCH, num_workers=num_workers,
                     multiprocessing_context="spawn", **kw)
        it = iter(loader)
        next(it)
        el = time.perf_counter() - t0
        del it, loader
    return el


def shared_start(env, target_s, n=None):
    n = n or MEM_ITEMS
    small = max(n // START_SMALL_DIV, 1)
    cls = _c._loader_cls(env)
    _first_batch(cls, _dataset(env, make_items(64)))     # untimed: the zygote's start
    conv = env.mpcore is not None
    res = {}
    for name, k in (("large", n), ("small", small)):
        ds = _dataset(env, make_items(k))
        if conv:
            from mpcore.data import share_dataset
            share_dataset(ds)
        res[name] = _first_batch(cls, ds) * 1e3
        del ds
    if conv:
        res["plain_large"] = _first_batch(cls, _dataset(env, make_items(n))) * 1e3
    return _c.Measurement(res["large"], 1, res["large"] / 1e3,
                          {"items": n, "small_items": small, **{f"{k}_ms": v
                                                                for k, v in res.items()}})


def _start_notes(row):
    ex = {impl: _c._best_row_extra(row, impl) for impl in _c.IMPLS}
    t, m = ex["torch"], ex["mpcore"]
    out = []
    if t and m:
        out.append(f"small dataset ({m['small_items']:,} items): torch {t['small_ms']:.4g} ms, "
                   f"mpcore converted {m['small_ms']:.4g} ms; mpcore on the plain list, large: "
                   f"{m['plain_large_ms']:.4g} ms")
        flat = m["large_ms"] / m["small_ms"]
        out.append(f"mpcore converted, large over small: {flat:.2f}x (target <= "
                   f"{START_FLAT:g}x): {'met' if flat <= START_FLAT else 'MISSED'}")
    if row.get("ratio") is not None:
        out.append(f"target >= {START_TARGET:g}x: "
                   f"{'met' if row['ratio'] >= START_TARGET else 'MISSED'}")
    return out


# --- start-up of a dataset left as it is -------------------------------------------

def _pickle_costs(ds):
    """(ms to pickle ds once, ms to unpickle it once, the same with the
    collector paused, bytes), as a loader's Process pickles its arguments."""
    import io
    from multiprocessing.reduction import ForkingPickler
    t0 = time.perf_counter()
    f = io.BytesIO()
    ForkingPickler(f).dump(ds)
    t1 = time.perf_counter()
    data = f.getbuffer()
    pickle.loads(data)
    t2 = time.perf_counter()
    gc.disable()  # as mpcore's workers unpickle it
    try:
        pickle.loads(data)
    finally:
        gc.enable()
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, len(data)


def shared_start_plain(env, target_s, n=None):
    """NOTE [ The shared-dataset rows ]: shared-start-plain."""
    n = n or MEM_ITEMS
    cls = _c._loader_cls(env)
    _first_batch(cls, _dataset(env, make_items(64)))     # untimed: the zygote's start
    ds = _dataset(env, make_items(n))
    gc.collect()
    res = {"items": n, "workers": WORKERS}
    (res["pickle_ms"], res["unpickle_ms"], res["unpickle_paused_ms"],
     res["pickle_bytes"]) = _pickle_costs(ds)
    res["one_worker_ms"] = _first_batch(cls, ds, num_workers=1) * 1e3
    res["large_ms"] = _first_batch(cls, ds) * 1e3
    if env.mpcore is not None:
        # mpcore as it was: the dataset pickled with each worker's Process
        from mpcore.data import _ship
        pack, _ship.pack = _ship.pack, lambda obj: None
        try:
            res["per_worker_ms"] = _first_batch(cls, ds) * 1e3
        finally:
            _ship.pack = pack
    return _c.Measurement(res["large_ms"], 1, res["large_ms"] / 1e3, res)


def _start_plain_notes(row):
    ex = {impl: _c._best_row_extra(row, impl) for impl in _c.IMPLS}
    t, m = ex["torch"], ex["mpcore"]
    out = []
    side = m or t
    if side:
        out.append(f"one pickle of the dataset {side['pickle_ms']:.4g} ms "
                   f"({_mb(side['pickle_bytes'])}), one unpickle {side['unpickle_ms']:.4g} ms "
                   f"({side['unpickle_paused_ms']:.4g} ms with the collector paused, as "
                   "mpcore's workers do)")
    if t:
        out.append(f"torch: 1 worker {t['one_worker_ms']:.4g} ms, {t['workers']} workers "
                   f"{t['large_ms']:.4g} ms")
    if m:
        out.append(f"mpcore: 1 worker {m['one_worker_ms']:.4g} ms, {m['workers']} workers "
                   f"{m['large_ms']:.4g} ms; pickled per worker (as before) "
                   f"{m['per_worker_ms']:.4g} ms")
    return out


# --- per item and per epoch ----------------------------------------------------------------

def shared_item(env, target_s):
    items = make_items(ITEM_ITEMS)
    if env.mpcore is not None:
        from mpcore.data import SharedList
        items = SharedList(items)
    rng = random.Random(0)
    idx = [rng.randrange(ITEM_ITEMS) for _ in range(1 << 16)]

    def run(k):
        t0 = time.perf_counter()
        for j in range(k):
            it = items[idx[j & 0xFFFF]]
            it["label"]
        return time.perf_counter() - t0
    k, el = _c.calibrate(run, target_s, 1000, hi=10**7)
    return _c.Measurement(el / k * 1e6, k, el, {"items": ITEM_ITEMS})


def shared_epoch(env, target_s):
    cls = _c._loader_cls(env)
    ds = _dataset(env, make_items(EPOCH_ITEMS))
    kw = {"share_dataset": True} if env.mpcore is not None else {}
    with _c._quiet():
        loader = cls(ds, batch_size=BATCH, num_workers=WORKERS, multiprocessing_context="fork",
                     **kw)
        t0 = time.perf_counter()
        seen = sum(len(b) for b in loader)
        el = time.perf_counter() - t0
    if seen != EPOCH_ITEMS:
        raise AssertionError(f"{seen} items, expected {EPOCH_ITEMS}")
    return _c.Measurement(EPOCH_ITEMS / el, EPOCH_ITEMS, el, {"items": EPOCH_ITEMS})


def register(cases):
    """Adds this module's rows to cases.CASES (called by cases.py)."""
    global _c
    _c = cases
    cases.add_case(
        "shared-mem", f"Dataset of {MEM_ITEMS:,} dicts, {WORKERS} fork workers: workers' USS "
        "growth", "MB", False, shared_mem, row_notes=_mem_notes, columns=_mem_columns,
        timeout_s=1800.0, in_quick=False, own_child=True,
        note="NOTE [ The shared-dataset rows ] in shared_cases.py: one epoch, 4 persistent fork "
             "workers; growth from a dataset 1,000x smaller of the sum of the workers' USS and "
             "of the program's PSS. torch: torch's DataLoader on the plain list (and on "
             "detectron2's numpy serialization); mpcore: mpcore's DataLoader with "
             "share_dataset=True (and on the plain list). Targets: <= 5% of torch's USS "
             "growth; PSS growth <= 1.3x one copy.")
    cases.add_case(
        "shared-start", f"Dataset of {MEM_ITEMS:,} dicts, spawn, {WORKERS} workers: first batch",
        "ms", False, shared_start, row_notes=_start_notes, timeout_s=900.0, in_quick=False,
        own_child=True,
        note="From DataLoader(..., num_workers=4, multiprocessing_context='spawn') to its first "
             "batch, the dataset built before the clock, after one untimed loader. torch: the "
             "plain list; mpcore: share_dataset=True. Targets: >= 20x; mpcore's large dataset "
             "within 1.5x of one 100x smaller.")
    cases.add_case(
        "shared-start-plain", f"Dataset of {MEM_ITEMS:,} dicts left as it is, spawn, {WORKERS} "
        "workers: first batch", "ms", False, shared_start_plain, row_notes=_start_plain_notes,
        timeout_s=900.0, in_quick=False, own_child=True,
        note="As shared-start, both sides on the plain list (no share_dataset): mpcore pickles "
             "the dataset once for all the workers (NOTE [ A dataset travels once ] in "
             "mpcore/data/_ship.py), torch once per worker; each worker still unpickles its own "
             "copy. Also: 1 worker, and mpcore pickling per worker as it did before.")
    cases.add_case(
        "shared-item", f"Random item of a {ITEM_ITEMS:,}-dict list (torch: plain list; mpcore: "
        "SharedList)", "us", False, shared_item,
        note="ds[i] at random indices, one field read: a plain list on torch's side, a "
             "SharedList of the same items on mpcore's (one unpickle a read).")
    cases.add_case(
        "shared-epoch", f"Epoch over {EPOCH_ITEMS:,} dicts, {WORKERS} fork workers", "items/s",
        True, shared_epoch, timeout_s=300.0,
        note="One epoch, batch 256, 4 fork workers: torch's DataLoader on the plain list, "
             "mpcore's with share_dataset=True. Target: no slower than torch.")
