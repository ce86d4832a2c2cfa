"""The DataLoader worker process: fetch samples, collate them into shared
memory, send the batch.  The main process's side is _loader.py.

NOTE [ Worker messages ]
Tasks arrive on the worker's own index queue's ring as pickles of
(task, index); a Resume starts a new epoch (persistent workers) with the
epoch's shared seed, and None says stop.  Results go to the one result
ring, each behind a header (task, worker, kind) whose one definition is
mpc_pool_msg in C (mpcore.h); its size, offsets and kinds come from
_core, and HEADER below is checked against them at import:
  COLLATED  refs = [the batch's block]; payload: pickle of
            (skeleton, busy_ns, samples, state)  (NOTE [ Collating into a
            block ])
  PICKLED   payload: an encoded (batch, busy_ns, samples, state), for
            batches that default collation did not produce (collate_fn,
            strings only, batch_size=None, or samples collate.c does not
            take)
  ERROR     payload: an encoded (ExceptionWrapper, busy_ns, 0, None)
  END       the worker's iterable ran out (IterableDataset); payload: an
            encoded state, or nothing
  RESUME    acknowledges a Resume; payload: an encoded state, or nothing
`state` is the worker's dataset state after the task, for a dataset that
has one, else None (NOTE [ Resumable loading ] in _state.py).
  DIED      (sent by the main process's watcher, never by a worker: the
            worker's process ended; NOTE [ Watching workers ] in pool.c)
The seeds, worker info and the order of events are torch's worker loop's,
so that a program gets the same batches from the same workers.
"""
import pickle
import queue
import random
import struct
import time

from .. import _core
from ..queue import _queue
from . import _collate, _compat, _ship, _state
from ._fetch import Fetcher

COLLATED, PICKLED, ERROR, END, RESUME, DIED = (
    _core.POOL_COLLATED, _core.POOL_PICKLED, _core.POOL_ERROR, _core.POOL_END,
    _core.POOL_RESUME, _core.POOL_DIED)


def _header():
    """The struct of mpc_pool_msg, laid out from the offsets and size the
    core exports: u64 task, u32 worker, u32 kind, little-endian, packed in
    that order."""
    fields = sorted([(_core.POOL_HEADER_TASK, "Q", "task"),
                     (_core.POOL_HEADER_WORKER, "I", "worker"),
                     (_core.POOL_HEADER_KIND, "I", "kind")])
    fmt, at = "<", 0
    for offset, code, name in fields:
        if offset < at or name != ("task", "worker", "kind")[fields.index((offset, code, name))]:
            break
        fmt += "x" * (offset - at) + code
        at = offset + struct.calcsize("<" + code)
    else:
        if at <= _core.POOL_HEADER_SIZE:
            return struct.Struct(fmt + "x" * (_core.POOL_HEADER_SIZE - at))
    raise ImportError("mpcore.data: the core's pool message header is not laid out as "
                      "task, worker, kind; reinstall mpcore")


HEADER = _header()  # pack(task, worker, kind)
STOP = None
_CHECK_INTERVAL = 5.0


class Resume:
    """Starts a new epoch of a persistent worker, as torch's
    _ResumeIteration does: seed is the epoch's shared seed (DataPipes)."""

    __slots__ = ("seed",)

    def __init__(self, seed=None):
        self.seed = seed

    def __reduce__(self):
        return (Resume, (self.seed,))


def _seed(base_seed, worker_id):
    seed = base_seed + worker_id
    random.seed(seed)
    torch = _compat.torch
    if torch is not None:
        torch.set_num_threads(1)
        torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return seed
    np.random.seed(_compat.numpy_seed(base_seed, worker_id))
    return seed


def main(kind, dataset, index_queue, result_queue, auto_collation, collate_fn, drop_last,
         base_seed, init_fn, worker_id, num_workers, parent, shared_seed=None, state=None,
         shipped=False):
    """A worker's whole life; `state`: its saved state, to resume from.
    `shipped`: dataset, collate_fn and init_fn are not among the arguments
    but the first message on the index queue (NOTE [ A dataset travels
    once ] in _ship.py), unpickled before anything else, as arguments are."""
    _compat.die_with_parent(parent)
    index_ring = _queue.ring_of(index_queue)
    if shipped:
        got = _ship.receive(index_ring)
        if got is None:  # the loader has gone already
            return
        dataset, collate_fn, init_fn = got
        del got
    seed = _seed(base_seed, worker_id)
    # As torch's worker loop: a DataPipe graph's random operations take the
    # seed that every worker (and every rank) shares this epoch.
    shared_rng = None
    if isinstance(dataset, _compat.IterDataPipe):
        if shared_seed is None:
            raise AssertionError("shared_seed must be provided for IterDataPipe workers")
        shared_rng = _compat.torch.Generator()
        shared_rng.manual_seed(shared_seed)
        dataset = _compat.apply_random_seed(dataset, shared_rng)
    _compat.set_worker_info(worker_id, num_workers, seed, dataset)
    result_ring = _queue.ring_of(result_queue)
    fast = collate_fn is _compat.default_collate and auto_collation

    def send(task, what, obj=None, refs=None):
        header = HEADER.pack(task, worker_id, what)
        if refs is not None:
            payload = header + pickle.dumps(obj, 4)
        elif obj is not None:
            refs, payload = _queue.encode(obj, header)
        else:
            refs, payload = [], header
        try:
            result_ring.put(refs, payload)
        except BaseException:
            for ref in refs:
                _core.drop_ticket(ref)
            raise

    # As in torch, an error in worker_init_fn or in making the fetcher
    # (iter() of an IterableDataset) is the result of the worker's first
    # task; later tasks try to make the fetcher again.
    init_error = fetcher = None
    try:
        if init_fn is not None:
            init_fn(worker_id)
        _state.restore_dataset(state, dataset)
        fetcher = Fetcher(kind, dataset, auto_collation, drop_last)
        _state.restore_fetcher(state, kind, fetcher)
    except Exception:
        init_error = _compat.wrap_exception(worker_id)
    del state
    ended = False

    def snapshot():
        if _state.has_state(kind, fetcher, dataset):
            return _state.worker_state(worker_id, kind, fetcher, dataset)
        return None
    try:
        while True:
            try:
                refs, msg = index_ring.get(True, _CHECK_INTERVAL)
            except queue.Empty:
                continue
            except ValueError:  # the ring was closed: the loader is gone
                return
            r = pickle.loads(msg)
            if r is STOP:
                return
            if type(r) is Resume:
                send(0, RESUME, _state.worker_state(worker_id, kind, None, dataset)
                     if _state.stateful(dataset) else None)
                ended = False
                if shared_rng is not None:
                    if r.seed is None:
                        raise AssertionError("resume iteration seed is None for IterDataPipe")
                    shared_rng.manual_seed(r.seed)
                    dataset = _compat.apply_random_seed(dataset, shared_rng)
                fetcher = None
                continue
            if ended:
                continue
            task, index = r
            if init_error is not None:
                send(task, ERROR, (init_error, 0, 0, None))
                init_error = None
                continue
            start = time.perf_counter_ns()
            try:
                if fetcher is None:
                    fetcher = Fetcher(kind, dataset, auto_collation, drop_last)
                samples = fetcher.fetch(index)
                block = None
                if fast and type(samples) is list and samples:
                    got = _collate.into_block(samples)
                    if got is not None:
                        block, skeleton = got
                if block is None:
                    batch = collate_fn(samples)
            except StopIteration:
                if kind == _compat.ITERABLE:
                    ended = True
                    send(task, END, snapshot())
                    continue
                send(task, ERROR, (_compat.wrap_exception(worker_id), 0, 0, None))
                continue
            except Exception:
                send(task, ERROR, (_compat.wrap_exception(worker_id), 0, 0, None))
                continue
            busy = time.perf_counter_ns() - start
            n = len(samples) if auto_collation else 1
            state = snapshot()
            if block is not None:
                ref = block.ticket(True)
                del block
                send(task, COLLATED, (skeleton, busy, n, state), [ref])
            else:
                try:
                    send(task, PICKLED, (batch, busy, n, state))
                except Exception:
                    send(task, ERROR, (_compat.wrap_exception(worker_id), busy, 0, None))
            del samples
    except KeyboardInterrupt:
        pass
