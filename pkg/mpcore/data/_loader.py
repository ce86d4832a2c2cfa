"""mpcore.data.DataLoader: torch's DataLoader, whose worker processes are
mpcore's pool (py_pool.c, pool.c) and whose batches arrive zero-copy.

NOTE [ One loader, torch's rules ]
With torch installed, DataLoader subclasses torch's: construction,
validation, the protected attributes, len(), the samplers and the
single-process iterator are torch's own.  Only multi-process iteration is
ours (_PoolIter), and it follows torch's _MultiProcessingDataLoaderIter
step for step: the same tasks to the same workers in the same order, the
same seeds, the same errors.  Without torch the base classes are
_base.DataLoaderBase and _base.DataLoaderIterBase, which give numpy
batches.

NOTE [ Batch slots ]
A worker collates each batch into one block of shared memory that it
allocates; the main process's batch is views of that block.  When the
program lets go of the batch's last tensor the block returns to its
worker's arena, and the worker's next batch of that size takes it again:
the blocks of a worker are a ring of slots, already faulted in on both
sides, reused batch after batch.  A program that keeps every batch only
makes the worker allocate more; nothing waits for a slot to come back.

NOTE [ DataPipes ]
A DataPipe graph is loaded as torch loads it: the iterator's base is
torch's _BaseDataLoaderIter, which draws the epoch's shared seed
(_share_dist_seed: broadcast over a process group when torch.distributed
is initialised) and seeds the graph's random operations with it, at
construction and at each _reset; each worker seeds its copy of the graph
with the same shared seed (and again with each Resume), and shards it
with torch's _sharding_worker_init_fn (apply_sharding over
num_workers * world_size, MULTIPROCESSING priority), so that workers
split the data instead of each giving all of it.

NOTE [ Waiting for results ]
The iterator waits for the next result on the result ring alone, in C,
with the GIL released and no periodic wake-up.  A worker that dies cannot
send anything, so the pool watches the workers' pidfds from a thread of
its own (NOTE [ Watching workers ] in pool.c) that puts a DIED message on
the result ring when a worker's process ends; the wait wakes as for any
result, and the iterator decides whether that worker mattered (torch's
rule: a persistent worker, or one with tasks still to do).
"""
import functools
import inspect
import multiprocessing as _mp
import pickle
import queue
import signal
import sys
import time
import warnings
import weakref
from multiprocessing import context as _mpctx
from typing import TypeVar

from .. import _core
from ..shm import _blocks
from ..queue import _queue
from ..proc import _context
from . import _collate, _compat, _shared, _ship, _state, _worker
from ._single import SingleIter

torch = _compat.torch
_INDEX_CAPACITY = 64 << 10  # bytes of each worker's task ring
_EXIT_CODE_WAIT = 1.0       # seconds to learn the exit code of a worker known to be gone
_STOP = pickle.dumps(_worker.STOP)

if torch is not None:
    _IterBase = _compat.IterBase
    _Base = torch.utils.data.DataLoader
else:
    from ._base import DataLoaderBase as _Base
    from ._base import DataLoaderIterBase as _IterBase

_T_co = TypeVar("_T_co", covariant=True)


def _with_keyword(fn, name, default):
    """fn's signature with a keyword-only parameter added at its end."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))
    return sig.replace(parameters=params)


class DataLoader(_Base[_T_co]):
    """torch.utils.data.DataLoader, with mpcore's worker pool.

    Takes torch's arguments with torch's meaning.  With num_workers > 0,
    batches made by default_collate arrive as views of shared memory that
    their worker filled (no copy, no file descriptor per tensor), and
    stats() says whether loading keeps up with the loop.

    share_dataset=True (mpcore's only keyword) first converts the dataset's
    large list and dict attributes, in place, into SharedList and
    SharedDict (share_dataset() in _shared.py), so that its workers map one
    copy instead of each copying it."""

    def __init__(self, dataset, *args, share_dataset=False, **kwargs):
        if share_dataset:
            _shared.share_dataset(dataset)
        super().__init__(dataset, *args, **kwargs)

    # What inspect.signature() shows is torch's parameters and share_dataset:
    # tools that rebuild a loader from its arguments (Lightning, which adds
    # a DistributedSampler so) read the parameters by name.
    __init__.__signature__ = _with_keyword(_Base.__init__, "share_dataset", False)

    @property
    def multiprocessing_context(self):
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, multiprocessing_context):
        # torch's checks and messages; a start method's name gives mpcore's
        # context, and mpcore's contexts are accepted beside the stdlib's.
        if multiprocessing_context is not None:
            if self.num_workers > 0:
                if isinstance(multiprocessing_context, str):
                    valid_start_methods = _mp.get_all_start_methods()
                    if multiprocessing_context not in valid_start_methods:
                        raise ValueError(
                            "multiprocessing_context option "
                            f"should specify a valid start method in {valid_start_methods!r}, "
                            f"but got multiprocessing_context={multiprocessing_context!r}")
                    multiprocessing_context = _context.get_context(multiprocessing_context)
                if not isinstance(multiprocessing_context,
                                  (_mpctx.BaseContext, _context.Context)):
                    raise TypeError(
                        "multiprocessing_context option should be a valid context object "
                        "or a string specifying the start method, but got "
                        f"multiprocessing_context={multiprocessing_context}")
            else:
                raise ValueError(
                    "multiprocessing_context can only be used with multi-process loading "
                    f"(num_workers > 0), but got num_workers={self.num_workers}")
        self.__multiprocessing_context = multiprocessing_context

    def _get_iterator(self):
        state = self.__dict__.pop("_mpcore_next_state", None)
        self.__dict__.pop("_mpcore_retired", None)
        if self.num_workers == 0:
            it = SingleIter(self, state)
        else:
            self.check_worker_number_rationality()
            it = _PoolIter(self, state)
            self.__dict__["_mpcore_stats"] = it._stats
        self.__dict__["_mpcore_iter"] = weakref.ref(it)
        return it

    def __iter__(self):
        # NOTE [ Resumable loading ] (_state.py): the iterator that
        # state_dict() made before iteration began, or one that resumes
        # from a loaded state; a state taken at the end of an epoch resumes
        # at the start of the next.
        d = self.__dict__
        it = d.pop("_mpcore_pending", None)
        if it is None:
            if "_mpcore_next_state" in d and self._iterator is not None:
                self._iterator._shutdown_workers()
                self._iterator = None
            it = super().__iter__()
        if it.finished:
            if self.persistent_workers and self.num_workers > 0:
                it._reset(self)
            else:
                it = self._get_iterator()
        if self.persistent_workers and self.num_workers > 0:
            self._iterator = it
        it._handed_out = True
        return it

    def state_dict(self):
        """Where loading stands, as torchdata's StatefulDataLoader saves it:
        resume with load_state_dict() on a loader made with the same
        arguments (in this program or another).  Cheap: nothing is asked of
        the workers and nothing is pickled unless the dataset has a state
        of its own (NOTE [ Resumable loading ] in _state.py)."""
        if self.num_workers > 0 and not getattr(self, "in_order", True):
            warnings.warn("DataLoader.state_dict() with in_order=False: the batches yielded "
                          "are not the sampler's first ones, so resuming may repeat or skip "
                          "some (as with torchdata)", stacklevel=2)
        it = _state.current(self)
        if it is None:
            retired = self.__dict__.get("_mpcore_retired")
            if retired is not None:
                return retired
            it = self._iterator if self.persistent_workers and self.num_workers > 0 else None
            if it is None:
                it = self._get_iterator()
                self.__dict__["_mpcore_pending"] = it
                if self.persistent_workers and self.num_workers > 0:
                    self._iterator = it
        return it.state_dict()

    def load_state_dict(self, state_dict):
        """Resumes, at the next iter(), from a state_dict() of a loader made
        with the same arguments (or torchdata's StatefulDataLoader's).  An
        empty dict does nothing.  Raises ValueError for a state that is not
        one, or that was taken with another num_workers; RuntimeError while
        the program still holds an unfinished iterator of this loader (NOTE
        [ A live iterator ])."""
        if state_dict == {}:
            return
        _state.check(state_dict, self.num_workers)
        it = _state.current(self)
        if it is not None and getattr(it, "_handed_out", False) and not it.finished:
            # NOTE [ A live iterator ]: an iterator the program still holds
            # would go on from where it was, and the loaded state would be
            # silently ignored by it; the loader's own references (its
            # persistent iterator) and this frame's do not count.
            held = sys.getrefcount(it) - 2 - (self._iterator is it)
            if held > 0:
                raise RuntimeError(
                    f"DataLoader.load_state_dict() called while an iterator of this loader is "
                    f"live ({it._num_yielded} batches into its epoch): it would ignore the "
                    "loaded state. Load the state before iter(loader), or let go of the "
                    "iterator first (finish it, or del it)")
        del it
        d = self.__dict__
        d.pop("_mpcore_retired", None)
        pending = d.pop("_mpcore_pending", None)
        for old in (pending, self._iterator):
            if isinstance(old, _PoolIter):
                old._shutdown_workers()
        self._iterator = None
        d["_mpcore_iter"] = None
        d["_mpcore_next_state"] = state_dict

    def stats(self):
        """How the last multi-process iteration went: time the loop waited
        for data against its total time, each worker's throughput, and how
        full the ring of prefetched batches was.  A wait fraction near 1 and
        a ring near empty mean loading is the bottleneck."""
        s = self.__dict__.get("_mpcore_stats")
        return s.report() if s is not None else _Stats(self.num_workers, 0).report()


class StatefulDataLoader(DataLoader):
    """torchdata's StatefulDataLoader, served by mpcore's DataLoader, which
    resumes by itself.  snapshot_every_n_steps is accepted and needs doing
    nothing: mpcore's state is exact at every step without snapshots (NOTE
    [ Resumable loading ] in _state.py).

    NOTE [ torchdata's samplers ]
    Where the program gives no sampler, torchdata's loader takes its own
    RandomSampler and BatchSampler, not torch's.  They draw differently:
    torchdata's RandomSampler draws an epoch's order when its iterator is
    made, before the loader's seeds, and torch's at the first index, after
    them; without a generator it takes its seed at construction.  So the
    same program gives other batches and worker seeds under each loader.
    With torchdata installed this class takes torchdata's samplers where
    torchdata's loader would, so that a program gets torchdata's batches
    and seeds whichever of the two serves it; without torchdata it has
    torch's, as DataLoader does."""

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, snapshot_every_n_steps=1, share_dataset=False):
        td = _torchdata_samplers()
        if (td is not None and shuffle and sampler is None and batch_sampler is None
                and not isinstance(dataset, _compat.IterableDataset)):
            sampler, shuffle = td.RandomSampler(dataset, generator=generator), None
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,
                         collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
                         multiprocessing_context, generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order,
                         share_dataset=share_dataset)
        if td is not None and batch_sampler is None and type(self.batch_sampler) is \
                _compat.BatchSampler:
            # past torch's guard on the attribute, as construction is
            self.__dict__["batch_sampler"] = td.BatchSampler(self.sampler, self.batch_size,
                                                             self.drop_last)
        self.snapshot_every_n_steps = snapshot_every_n_steps


def _torchdata_samplers():
    """torchdata's sampler module, or None where torchdata is missing
    (NOTE [ torchdata's samplers ])."""
    try:
        from torchdata.stateful_dataloader import sampler
    except ImportError:
        return None
    return sampler


class _Stats:
    def __init__(self, nworkers, prefetch):
        self.prefetch = prefetch
        self.pids = [None] * nworkers
        self.batches = [0] * nworkers
        self.samples = [0] * nworkers
        self.busy_ns = [0] * nworkers
        self.wait = 0.0
        self.delivered = 0
        self.ready_sum = 0
        self.start = None
        self.last = None

    def report(self):
        total = (self.last - self.start) if self.start is not None else 0.0
        n = len(self.batches)
        return {
            "batches": self.delivered,
            "total_s": total,
            "wait_s": self.wait,
            "wait_fraction": self.wait / total if total > 0 else 0.0,
            "workers": [{
                "id": i, "pid": self.pids[i], "batches": self.batches[i],
                "samples": self.samples[i], "busy_s": self.busy_ns[i] / 1e9,
                "batches_per_s": self.batches[i] / (self.busy_ns[i] / 1e9)
                if self.busy_ns[i] else 0.0,
            } for i in range(n)],
            "ring": {
                "slots": self.prefetch * n,
                "mean_ready": self.ready_sum / self.delivered if self.delivered else 0.0,
            },
        }


def _start_method(ctx):
    if ctx is None:
        return _mp.get_start_method()
    return ctx.get_start_method()


class _PoolIter(_state.Position, _IterBase):
    """Multi-process iteration over a DataLoader (NOTE [ One loader,
    torch's rules ]); the books are a _core.Pool.  The base (torch's
    _BaseDataLoaderIter, or _base.DataLoaderIterBase without torch) draws
    the seeds in torch's order and seeds DataPipe graphs (NOTE [ DataPipes ]).
    `state`: a state_dict() to resume from (NOTE [ Resumable loading ])."""

    def __init__(self, loader, state=None):
        self._shutdown = True
        super().__init__(loader)
        self.loader_ref = _state.loader_ref(loader)
        self._prefetch_factor = loader.prefetch_factor
        n = self._num_workers
        self._stats = _Stats(n, self._prefetch_factor)
        kind = self._dataset_kind
        self._worker_states = [_state.initial_worker_state(i, kind) for i in range(n)]
        saved = [None] * n
        if state is not None:
            snap = state[_state.SNAPSHOT]
            main = snap[_state.MAIN]
            self._base_seed = main[_state.BASE_SEED]
            if main.get(_state.SHARED_SEED) is not None:
                self._shared_seed = main[_state.SHARED_SEED]
            for i in range(n):
                saved[i] = snap[_state.WORKERS][_state.worker_key(i)]
                if saved[i] is not None:
                    self._worker_states[i] = saved[i]

        worker_init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (_compat.IterDataPipe, _compat.MapDataPipe)):
            worker_init_fn = functools.partial(
                _compat.sharding_worker_init_fn, worker_init_fn, self._world_size, self._rank)

        ctx = _context.get_context(_start_method(loader.multiprocessing_context))
        if ctx.get_start_method() == "fork" and "numpy" in sys.modules:
            # A forked worker seeds numpy.random (_worker._seed).  Imported
            # here first: a fork taken while another thread of this process
            # was importing it would leave the worker a module lock held by
            # no thread of its own.
            import numpy.random  # noqa: F401
        self._results = _queue.Queue()
        self._result_ring = _queue.ring_of(self._results)
        self._index_queues = [_queue.Queue(capacity=_INDEX_CAPACITY) for _ in range(n)]
        self._index_rings = [_queue.ring_of(q) for q in self._index_queues]
        self._pool = _core.Pool(self._result_ring, n, self._prefetch_factor,
                                getattr(loader, "in_order", True))
        self._workers = []
        self._shutdown = False
        parent = _compat.parent_token()
        ship = None
        try:
            if ctx.get_start_method() != "fork":
                # NOTE [ A dataset travels once ] (_ship.py): pickled here
                # once, not with each worker's Process; None: per worker.
                try:
                    ship = _ship.pack((self._dataset, self._collate_fn, worker_init_fn))
                except BaseException as e:   # NOTE [ A pickle error at a worker's start ]
                    _ship.warn_start_error(e)
                    raise
            for i in range(n):
                if ship is not None:
                    ship.send(self._index_rings[i])
                    dataset = collate_fn = init_fn = None
                else:
                    dataset, collate_fn, init_fn = (self._dataset, self._collate_fn,
                                                    worker_init_fn)
                w = ctx.Process(
                    target=_worker.main,
                    args=(self._dataset_kind, dataset, self._index_queues[i],
                          self._results, self._auto_collation, collate_fn,
                          self._drop_last, self._base_seed, init_fn, i, n,
                          parent, self._shared_seed, saved[i], ship is not None),
                    daemon=True)
                try:
                    w.start()
                except BaseException as e:
                    _ship.warn_start_error(e)
                    raise
                self._workers.append(w)
                self._stats.pids[i] = w.pid
                try:
                    self._pool.watch(i, w.pid)
                except ProcessLookupError:  # already gone, and reaped by the zygote
                    w.join(_EXIT_CODE_WAIT)
                    raise RuntimeError(_death(w)) from None
            if ship is not None:
                ship.close()  # the workers' tickets keep the block until they have read it
            self._reset(loader, first_iter=True, state=state)
        except BaseException:
            if ship is not None:
                ship.close()
            self._shutdown_workers()
            raise

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._index_sampler)

    def __getstate__(self):
        raise NotImplementedError("{} cannot be pickled", self.__class__.__name__)

    def _reset(self, loader, first_iter=False, state=None):
        super()._reset(loader, first_iter)  # the sampler, and the epoch's shared seed
        self._start_epoch()
        self._last_worker = self._num_workers - 1
        self._pool.reset()
        if not first_iter:
            kind = self._dataset_kind
            self._worker_states = [_state.initial_worker_state(i, kind)
                                   for i in range(self._num_workers)]
            resume = pickle.dumps(_worker.Resume(self._shared_seed), 4)
            for ring in self._index_rings:
                ring.put([], resume)
            waiting = self._num_workers
            while waiting > 0:
                worker, what, _, refs, payload = self._wait(self._pool.get_raw)
                if what == _worker.RESUME:
                    waiting -= 1
                    if payload:
                        self._worker_states[worker] = _queue.decode(refs, payload)
                elif refs:
                    _core.drop_journaled(refs)  # a batch of the abandoned epoch
        forward = 0
        if state is not None:
            forward = self._restore(state)
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()
        if forward:
            _state.warn_fast_forward(forward)
            _state.fast_forward(self, forward)
        if state is not None:
            for _ in range(state[_state.STEPS_SINCE]):
                next(self)  # torchdata's snapshots may lag the state by some steps
            self.finished = bool(state.get(_state.FINISHED, False))

    def _restore(self, state):
        """Puts the sampler, the counts and the round robin where `state`
        has them; returns how many batches to make again and drop (an
        IterableDataset without state), else 0."""
        snap = state[_state.SNAPSHOT]
        main = snap[_state.MAIN]
        self._IterableDataset_len_called = main.get(_state.LEN_CALLED)
        if main.get(_state.SHARED_SEED) is not None:
            self._shared_seed = main[_state.SHARED_SEED]
        _state.restore_sampler(self, main)
        step = snap[_state.STEP]
        if (self._dataset_kind == _compat.ITERABLE
                and not any(_state.saved_state(w) for w in self._worker_states)):
            return step
        self._num_yielded = step
        self._last_worker = snap[_state.LAST_WORKER]
        self._pool.start_at((self._last_worker + 1) % self._num_workers)
        return 0

    def state_dict(self):
        n = self._num_yielded
        main = self._main_state(n)
        main[_state.NUM_WORKERS] = self._num_workers
        main[_state.BASE_SEED] = self._base_seed
        return {
            _state.SNAPSHOT: {
                _state.STEP: n,
                _state.LAST_WORKER: self._last_worker,
                _state.MAIN: main,
                _state.WORKERS: {_state.worker_key(i): s
                                 for i, s in enumerate(self._worker_states)},
            },
            _state.STEPS_SINCE: 0,
            _state.FINISHED: self.finished,
        }

    def _try_put_index(self):
        try:
            index = self._next_index()
        except StopIteration:
            return
        got = self._pool.dispatch()
        if got is None:
            return
        worker, task = got
        self._index_rings[worker].put([], pickle.dumps((task, index), 4))

    def __next__(self):
        stats = self._stats
        if stats.start is None:
            stats.start = time.perf_counter()
        try:
            data = self._next_data()
        except StopIteration:
            self.finished = True
            raise
        stats.last = time.perf_counter()
        self._num_yielded += 1
        if (self._dataset_kind == _compat.ITERABLE
                and self._IterableDataset_len_called is not None
                and self._num_yielded > self._IterableDataset_len_called):
            warnings.warn(
                f"Length of IterableDataset {self._dataset} was reported to be "
                f"{self._IterableDataset_len_called}(when accessing len(dataloader)), but "
                f"{self._num_yielded} samples have been fetched. For multiprocessing "
                "data-loading, this could be caused by not properly configuring the "
                "IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                "for examples.", stacklevel=2)
        return data

    def _next_data(self):
        if self._shutdown:
            raise StopIteration
        stats = self._stats
        while True:
            stats.ready_sum += self._pool.kept + self._result_ring.count()
            got = self._wait(self._pool.next)
            if got is None:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            worker, kind, _, refs, payload = got
            if kind == _worker.END:
                if payload:
                    self._worker_states[worker] = _queue.decode(refs, payload)
                if not self._persistent_workers:
                    self._index_rings[worker].put([], _STOP)
                self._try_put_index()
                continue
            self._pool.delivered(worker)
            self._try_put_index()
            return self._process(worker, kind, refs, payload)

    def _process(self, worker, kind, refs, payload):
        if kind == _worker.COLLATED:
            skeleton, busy, n, state = pickle.loads(payload)
            # The one ticket is redeemed by attach itself, or counts as
            # redeemed if attach fails (as _blocks.receive would count it).
            data = _collate.rebuild(skeleton, _blocks.attach(refs[0]))
        else:
            data, busy, n, state = _queue.decode(refs, payload)
        stats = self._stats
        stats.delivered += 1
        stats.batches[worker] += 1
        stats.samples[worker] += n
        stats.busy_ns[worker] += busy
        if kind == _worker.ERROR:
            data.reraise()
        self._last_worker = worker
        if state is not None:
            self._worker_states[worker] = state
        if self._pin_memory:
            data = _compat.pin_memory(data, self._pin_memory_device)
        return data

    def _wait(self, get):
        """get(timeout) until it gives a result, within the loader's
        timeout (NOTE [ Waiting for results ])."""
        timeout = self._timeout
        t0 = time.perf_counter()
        deadline = t0 + timeout if timeout > 0 else None
        try:
            while True:
                left = None
                if deadline is not None:
                    left = max(0.0, deadline - time.perf_counter())
                try:
                    got = get(left)
                except queue.Empty:
                    raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None
                if got is None or got[1] != _worker.DIED:
                    return got
                self._worker_ended(got[0])
        finally:
            self._stats.wait += time.perf_counter() - t0

    def _worker_ended(self, i):
        """Worker i's process ended: an error if the loader still needed it."""
        if not (self._persistent_workers or self._pool.active(i)):
            return  # it ran out of data and was told to stop
        w = self._workers[i]
        w.join(_EXIT_CODE_WAIT)  # it is gone; this only learns its exit code
        self._shutdown_workers()
        raise RuntimeError(_death(w))

    def _shutdown_workers(self):
        if self._shutdown:
            return
        self._shutdown = True
        self._pool.unwatch()
        for ring in self._index_rings:
            try:
                ring.put([], _STOP, False)
            except Exception:
                pass
        deadline = time.monotonic() + 1.0
        for w in self._workers:
            w.join(max(0.0, deadline - time.monotonic()))
        for w in self._workers:
            if w.exitcode is None:
                w.kill()
                w.join()
        self._pool.reset()
        for ring in self._index_rings:
            ring.close()
        # The workers are gone: their segments that hold no batch of ours
        # need not stay mapped here (NOTE [ Mappings of orphans ]).
        _core.forget_idle()

    def __del__(self):
        _state.retire(self)
        try:
            self._shutdown_workers()
        except Exception:
            pass


def _death(w):
    code = w.exitcode
    if code is None:
        return f"DataLoader worker (pid {w.pid}) exited unexpectedly."
    if code < 0:
        try:
            name = signal.strsignal(-code) or f"signal {-code}"
        except ValueError:
            name = f"signal {-code}"
        return f"DataLoader worker (pid {w.pid}) is killed by signal: {name}."
    return f"DataLoader worker (pid {w.pid}) exited unexpectedly with exit code {code}."
