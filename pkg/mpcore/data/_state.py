"""Resumable loading: what DataLoader.state_dict() holds and how an
iterator resumes from it, in torchdata StatefulDataLoader's format (its
keys, its nesting), so that a checkpoint moves between the two.

NOTE [ Resumable loading ]
A loader's position is what the program has received, not what the
workers have made: the batches yielded so far.  The main process knows
almost all of it without asking anyone:
- the sampler: how many of this epoch's indices the yielded batches took,
  and the random state the sampler drew the epoch's order from (NOTE [ The
  epoch's random state ]).  Resuming draws the epoch again under that state
  and skips what was yielded.  A sampler with a state of its own
  (state_dict/load_state_dict, torchdata's Stateful) is saved and restored
  through it instead, as torchdata does;
- the seeds: the base seed (workers' seeds), the shared seed (DataPipes),
  and the worker that gave the last batch (the round robin resumes after it).
Only a dataset that has a state of its own (Stateful, or an IterableDataset
whose iterator is) costs anything per step: its worker sends that state
with each batch, and the main process keeps, per worker, the state that
came with the last batch it yielded from that worker.  A map-style dataset
without state sends nothing and is never pickled: a state_dict() is a few
small dicts built on the spot.  An IterableDataset without state is
fast-forwarded on resume (the epoch's first batches are made again and
dropped), with one warning, as torchdata does.

NOTE [ The epoch's random state ]
torch's samplers draw an epoch's order at its first index: RandomSampler
from its generator, or, without one, from a seed it takes from torch's
global generator; WeightedRandomSampler and SubsetRandomSampler likewise.
Just before that first draw the iterator records the state of the global
generator and of every generator of the sampler chain (the index sampler
and the samplers it wraps).  Resuming sets those states, makes the epoch's
iterator and takes its first index, so that every draw happens then, and
puts the global generator back as the program had it.  The sampler's own
generators are left where the epoch's draws leave them, which is where an
uninterrupted run has them, so the epochs after it come out the same too.
The record is mpcore's key (EPOCH_RNG); torchdata ignores it.  For a
RandomSampler the state it drew from is also written in the form
torchdata's own RandomSampler keeps (SAMPLER_ITER_STATE), and read from
there when a state dict comes from torchdata.
"""
import itertools
import warnings
import weakref

from . import _compat

torch = _compat.torch

# torchdata's keys.
SNAPSHOT, STEPS_SINCE, FINISHED = "_snapshot", "_steps_since_snapshot", "_iterator_finished"
STEP, LAST_WORKER = "_snapshot_step", "_last_yielded_worker_id"
MAIN, WORKERS = "_main_snapshot", "_worker_snapshots"
NUM_WORKERS, BASE_SEED = "_num_workers", "_base_seed"
INDEX_SAMPLER_STATE, SAMPLER_ITER_STATE = "_index_sampler_state", "_sampler_iter_state"
SAMPLER_ITER_YIELDED, LEN_CALLED = "_sampler_iter_yielded", "_IterableDataset_len_called"
SHARED_SEED, NUM_YIELDED = "_shared_seed", "_num_yielded"
W_ID, W_FETCHER, W_DATASET = "worker_id", "fetcher_state", "dataset_state"
W_ITER, W_ENDED = "dataset_iter_state", "fetcher_ended"
# torchdata's BatchSampler and RandomSampler iterators.
B_SAMPLES, B_ITER = "samples_yielded", "sampler_iter_state"
R_YIELDED, R_GENERATOR = "yielded", "generator"
# mpcore's own (NOTE [ The epoch's random state ]).
EPOCH_RNG = "_mpcore_epoch_rng"


def stateful(obj):
    """torchdata's Stateful protocol: state_dict() and load_state_dict()."""
    return (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def serialize(obj):
    return obj.state_dict() if stateful(obj) else None


def worker_key(i):
    return f"worker_{i}"


# --- a worker's dataset ------------------------------------------------------

def worker_state(worker_id, kind, fetcher, dataset):
    """A worker's state as torchdata's workers write it."""
    if kind != _compat.ITERABLE:
        return {W_ID: worker_id, W_FETCHER: None, W_DATASET: serialize(dataset)}
    it = fetcher.it if fetcher is not None else None
    return {W_ID: worker_id,
            W_FETCHER: {W_ITER: serialize(it), W_ENDED: bool(fetcher and fetcher.ended)},
            W_DATASET: serialize(dataset) if it is not dataset else None}


def initial_worker_state(worker_id, kind):
    """The state of a worker that has yielded nothing (and has no state)."""
    if kind != _compat.ITERABLE:
        return {W_ID: worker_id, W_FETCHER: None, W_DATASET: None}
    return {W_ID: worker_id, W_FETCHER: {W_ITER: None, W_ENDED: False}, W_DATASET: None}


def has_state(kind, fetcher, dataset):
    """Whether a worker's state says more than initial_worker_state."""
    return stateful(dataset) or (kind == _compat.ITERABLE and fetcher is not None
                                 and stateful(fetcher.it))


def restore_dataset(state, dataset):
    """Applies a worker's saved dataset state (before its fetcher is made)."""
    if state and state.get(W_DATASET) is not None and stateful(dataset):
        dataset.load_state_dict(state[W_DATASET])


def restore_fetcher(state, kind, fetcher):
    """Applies a worker's saved iterator state to the fetcher made after
    restore_dataset, torchdata's order."""
    fs = state.get(W_FETCHER) if state else None
    if kind == _compat.ITERABLE and fs and fs.get(W_ITER) is not None and stateful(fetcher.it):
        fetcher.it.load_state_dict(fs[W_ITER])


def saved_state(state):
    """Whether a saved worker state lets the worker resume by itself (else
    the epoch is fast-forwarded)."""
    if state is None:
        return False
    fs = state.get(W_FETCHER) or {}
    return state.get(W_DATASET) is not None or fs.get(W_ITER) is not None


# --- random state -------------------------------------------------------------

def _is_generator(g):
    if torch is not None and isinstance(g, torch.Generator):
        return True
    return hasattr(getattr(g, "bit_generator", None), "state")


def _get(g):
    return g.get_state() if torch is not None and isinstance(g, torch.Generator) \
        else g.bit_generator.state


def _set(g, st):
    if torch is not None and isinstance(g, torch.Generator):
        g.set_state(st)
    else:
        g.bit_generator.state = st


def _global_get():
    if torch is not None:
        return torch.get_rng_state()
    import numpy as np
    return np.random.get_state()


def _global_set(st):
    if torch is not None:
        torch.set_rng_state(st)
    else:
        import numpy as np
        np.random.set_state(st)


def _chain(sampler):
    """(path, sampler) for the index sampler and the samplers it wraps."""
    path = ""
    for _ in range(8):
        if sampler is None:
            return
        yield path, sampler
        sampler = getattr(sampler, "sampler", None)
        path = f"{path}.sampler" if path else "sampler"


def capture(index_sampler):
    """The random state an epoch of index_sampler draws from (NOTE [ The
    epoch's random state ])."""
    gens = {}
    for path, s in _chain(index_sampler):
        g = getattr(s, "generator", None)
        if _is_generator(g):
            gens[path] = _get(g)
    return {"global": _global_get(), "generators": gens}


def _random_sampler(index_sampler):
    """The torch RandomSampler the index sampler draws from, if any."""
    if torch is None:
        return None
    for _, s in _chain(index_sampler):
        if isinstance(s, torch.utils.data.RandomSampler):
            return s
    return None


def _perm_state(index_sampler, rng):
    """The state of the generator a RandomSampler drew the epoch's order
    from: its own, or the one it seeded from the global generator."""
    s = _random_sampler(index_sampler)
    if s is None or rng is None:
        return s, None
    if "global" not in rng:
        return s, rng.get("perm")
    for path, t in _chain(index_sampler):
        if t is s and path in rng["generators"] and s.generator is not None:
            return s, rng["generators"][path]
    g = torch.Generator()
    g.set_state(rng["global"])
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=g).item())
    g.manual_seed(seed)
    return s, g.get_state()


def resume_sampler(index_sampler, skip, rng=None):
    """An iterator over the epoch of index_sampler whose first `skip` items
    were yielded: the epoch is drawn again under `rng` (capture()'s record,
    or {"perm": state} for a RandomSampler's generator, as torchdata keeps
    it), and those items skipped.  The global generator is left as it was."""
    saved = _global_get()
    swapped = None
    try:
        if rng is not None and "global" in rng:
            _global_set(rng["global"])
            for path, s in _chain(index_sampler):
                st = rng["generators"].get(path)
                if st is not None and _is_generator(getattr(s, "generator", None)):
                    _set(s.generator, st)
        elif rng is not None:
            s = _random_sampler(index_sampler)
            if s is not None:
                if s.generator is None:
                    swapped, s.generator = s, torch.Generator()
                s.generator.set_state(rng["perm"])
        it = iter(index_sampler)
        next(itertools.islice(it, skip, skip), None)
        head = next(it, _END)
    finally:
        _global_set(saved)
        if swapped is not None:
            swapped.generator = None
    return it if head is _END else itertools.chain((head,), it)


_END = object()


# --- the sampler's part of a state ------------------------------------------

def sampler_states(index_sampler, sampler_iter, yielded, rng):
    """(INDEX_SAMPLER_STATE, SAMPLER_ITER_STATE) after `yielded` items: the
    samplers' own states when they have them; for torch's samplers the form
    torchdata's BatchSampler and RandomSampler iterators write."""
    if stateful(index_sampler) or stateful(sampler_iter):
        return serialize(index_sampler), serialize(sampler_iter)
    if torch is None:
        return None, None
    s, perm = _perm_state(index_sampler, rng)
    if isinstance(index_sampler, torch.utils.data.BatchSampler):
        inner = index_sampler.sampler
        samples = yielded * index_sampler.batch_size
        if hasattr(inner, "__len__"):
            samples = min(samples, len(inner))
        out = {B_SAMPLES: samples}
        if s is inner and perm is not None:
            out[B_ITER] = {R_YIELDED: samples, R_GENERATOR: perm}
        return None, out
    if s is index_sampler and perm is not None:
        return None, {R_YIELDED: yielded, R_GENERATOR: perm}
    return None, None


def _torchdata_perm(state):
    """The RandomSampler generator state in a torchdata-written sampler
    iterator state, if there is one."""
    if not isinstance(state, dict):
        return None
    inner = state.get(B_ITER, state)
    return inner.get(R_GENERATOR) if isinstance(inner, dict) else None


def restore_sampler(it, main):
    """Sets iterator `it`'s sampler to the position in `main` (a main
    snapshot, or a single-process state dict)."""
    yielded = main[SAMPLER_ITER_YIELDED]
    it._sampler_iter_yielded = yielded
    it._rng_known = True
    sampler = it._index_sampler
    if stateful(sampler) or stateful(it._sampler_iter):
        if main.get(INDEX_SAMPLER_STATE) is not None and stateful(sampler):
            sampler.load_state_dict(main[INDEX_SAMPLER_STATE])
        it._sampler_iter = iter(sampler)
        if main.get(SAMPLER_ITER_STATE) is not None and stateful(it._sampler_iter):
            it._sampler_iter.load_state_dict(main[SAMPLER_ITER_STATE])
        return
    if torch is not None and isinstance(
            sampler, torch.utils.data.dataloader._InfiniteConstantSampler):
        return
    rng = main.get(EPOCH_RNG)
    if rng is None:
        perm = _torchdata_perm(main.get(SAMPLER_ITER_STATE))
        rng = {"perm": perm} if perm is not None else None
    it._epoch_rng = rng
    it._sampler_iter = resume_sampler(sampler, yielded, rng)


# --- what both iterators keep ------------------------------------------------

class Position:
    """Mixed into both iterators (before torch's base): the sampler's
    position in the epoch and its random state (NOTE [ Resumable loading ])."""

    finished = False

    def _start_epoch(self):
        self._sampler_iter_yielded = 0
        self._epoch_rng = None
        self._rng_known = False
        self.finished = False
        # (items drawn, index sampler state, iterator state) of a sampler
        # with a state of its own, from the first item not yet yielded on
        # (the pool's iterator draws ahead of what it yields).
        self._sampler_log = [] if self._num_workers > 0 and (
            stateful(self._index_sampler) or stateful(self._sampler_iter)) else None

    def _next_index(self):
        if not self._rng_known:
            self._epoch_rng = capture(self._index_sampler)
            self._rng_known = True
        log = self._sampler_log
        if log is not None:
            while len(log) > 1 and log[1][0] <= self._num_yielded:
                del log[0]
            if not log:
                log.append(self._logged())
        idx = next(self._sampler_iter)
        self._sampler_iter_yielded += 1
        if log is not None:
            log.append(self._logged())
        return idx

    def _logged(self):
        return (self._sampler_iter_yielded, serialize(self._index_sampler),
                serialize(self._sampler_iter))

    def _main_state(self, yielded):
        """The keys both forms of state share, after `yielded` indices."""
        rng = self._epoch_rng if self._rng_known else capture(self._index_sampler)
        log = self._sampler_log
        if log is not None:
            entry = next((e for e in log if e[0] == yielded), None) or self._logged()
            index_state, iter_state = entry[1], entry[2]
        else:
            index_state, iter_state = sampler_states(self._index_sampler, self._sampler_iter,
                                                     yielded, rng)
        out = {INDEX_SAMPLER_STATE: index_state, SAMPLER_ITER_STATE: iter_state,
               SAMPLER_ITER_YIELDED: yielded, LEN_CALLED: self._IterableDataset_len_called,
               SHARED_SEED: self._shared_seed}
        if rng is not None and "global" in rng:
            out[EPOCH_RNG] = rng
        return out


def loader_ref(loader):
    return weakref.ref(loader)


def current(loader):
    """The loader's latest iterator, if it is still alive."""
    ref = loader.__dict__.get("_mpcore_iter")
    return ref() if ref is not None else None


def retire(it):
    """An iterator that goes away leaves its state with its loader, so that
    state_dict() after the program let go of it still says where the data
    stopped (torchdata's loader keeps its iterator for that)."""
    try:
        loader = it.loader_ref()
        if loader is None:
            return
        cur = current(loader)
        if cur is None or cur is it:
            loader.__dict__["_mpcore_retired"] = it.state_dict()
    except Exception:  # at interpreter exit, or an iterator that never started
        pass


def fast_forward(it, n):
    """Makes and drops the first n batches of iterator it's epoch."""
    it._num_yielded = 0
    for _ in range(n):
        try:
            next(it)
        except StopIteration:
            return


# --- checking a state dict -----------------------------------------------------

def _need(d, key, kind, where):
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"DataLoader.load_state_dict: not a DataLoader state: {where} has no "
                         f"key {key!r}")
    v = d[key]
    if kind is not None and not isinstance(v, kind):
        raise ValueError(f"DataLoader.load_state_dict: {where}[{key!r}] is "
                         f"{type(v).__name__}, expected {getattr(kind, '__name__', kind)}")
    return v


def check(state, num_workers):
    """Raises ValueError naming what is wrong if `state` is not a state
    this loader (with `num_workers`) can resume from."""
    if not isinstance(state, dict):
        raise ValueError("DataLoader.load_state_dict: expected the dict that state_dict() "
                         f"returned, got {type(state).__name__}")
    multi = SNAPSHOT in state
    if not multi and NUM_YIELDED not in state:
        raise ValueError(
            f"DataLoader.load_state_dict: not a DataLoader state: it has neither {SNAPSHOT!r} "
            f"(taken with workers) nor {NUM_YIELDED!r} (taken without); its keys are "
            f"{sorted(map(str, state))[:8]}")
    if multi != (num_workers > 0):
        taken = _taken_with(state)
        raise ValueError(
            f"DataLoader.load_state_dict: the state was taken with num_workers={taken} and "
            f"this loader has num_workers={num_workers}; resume with the same num_workers")
    if not multi:
        for key in (NUM_YIELDED, SAMPLER_ITER_YIELDED):
            if _need(state, key, int, "the state") < 0:
                raise ValueError(f"DataLoader.load_state_dict: the state's {key!r} is negative")
        return
    snap = _need(state, SNAPSHOT, dict, "the state")
    main = _need(snap, MAIN, dict, SNAPSHOT)
    n = _need(main, NUM_WORKERS, int, MAIN)
    if n != num_workers:
        raise ValueError(
            f"DataLoader.load_state_dict: the state was taken with num_workers={n} and this "
            f"loader has num_workers={num_workers}; resume with the same num_workers")
    for key in (STEP, LAST_WORKER):
        _need(snap, key, int, SNAPSHOT)
    if snap[STEP] < 0 or _need(main, SAMPLER_ITER_YIELDED, int, MAIN) < 0:
        raise ValueError("DataLoader.load_state_dict: the state's step counts are negative")
    if not -1 <= snap[LAST_WORKER] < num_workers:
        raise ValueError(f"DataLoader.load_state_dict: the state's last worker "
                         f"{snap[LAST_WORKER]} is not one of {num_workers} workers")
    if _need(state, STEPS_SINCE, int, "the state") < 0:
        raise ValueError("DataLoader.load_state_dict: the state's step counts are negative")
    _need(main, BASE_SEED, int, MAIN)
    workers = _need(snap, WORKERS, dict, SNAPSHOT)
    if set(workers) != {worker_key(i) for i in range(num_workers)}:
        raise ValueError(f"DataLoader.load_state_dict: the state's worker snapshots are "
                         f"{sorted(workers)}, expected worker_0..worker_{num_workers - 1}")
    for key, w in workers.items():
        if w is not None and not isinstance(w, dict):
            raise ValueError(f"DataLoader.load_state_dict: {key}'s state is "
                             f"{type(w).__name__}, expected dict")


def _taken_with(state):
    try:
        return state[SNAPSHOT][MAIN][NUM_WORKERS]
    except (KeyError, TypeError):
        return 0 if NUM_YIELDED in state else "?"


def warn_fast_forward(n):
    warnings.warn(
        "DataLoader: neither the dataset nor its iterator has state_dict/load_state_dict, so "
        f"resuming makes the epoch's first {n} batches again and drops them; give the "
        "IterableDataset (or its iterator) state_dict and load_state_dict to resume without "
        "that", stacklevel=4)
