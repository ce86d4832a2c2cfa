"""The DataLoader worker process: fetch samples, collate them into shared
memory, send the batch.  The main process's side is _loader.py.

NOTE [ Worker messages ]
Tasks arrive on the worker's own index queue's ring as pickles of
(task, index); RESUME starts a new epoch (persistent workers) and None
says stop.  Results go to the one result ring, each behind a 16-byte
header (task, worker, kind) that the main process's Pool (py_pool.c) reads:
  COLLATED  refs = [the batch's block]; payload: pickle of
            (skeleton, busy_ns, samples)  (NOTE [ Collating into a block ])
  PICKLED   payload: an encoded (batch, busy_ns, samples), for batches
            that default collation did not produce (collate_fn, strings
            only, batch_size=None, or samples collate.c does not take)
  ERROR     payload: an encoded (ExceptionWrapper, busy_ns, 0)
  END       the worker's iterable ran out (IterableDataset)
  RESUME    acknowledges RESUME
The seeds, worker info and the order of events are torch's worker loop's,
so that a program gets the same batches from the same workers.
"""
import pickle
import queue
import random
import struct
import time

from .. import _core, _queue
from . import _collate, _compat

COLLATED, PICKLED, ERROR, END, RESUME = range(5)
HEADER = struct.Struct("<QII")
STOP = None
RESUME_TASK = b"resume"
_CHECK_INTERVAL = 5.0


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


class _Fetcher:
    """torch's map-style and iterable-style fetchers, stopping short of
    collation, which the loop does (into shared memory when it can)."""

    def __init__(self, kind, dataset, auto_collation, drop_last):
        self.kind = kind
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.drop_last = drop_last
        self.ended = False
        if kind == _compat.ITERABLE:
            self.it = iter(dataset)

    def fetch(self, index):
        if self.kind != _compat.ITERABLE:
            if not self.auto_collation:
                return self.dataset[index]
            getitems = getattr(self.dataset, "__getitems__", None)
            if getitems:
                return getitems(index)
            return [self.dataset[i] for i in index]
        if self.ended:
            raise StopIteration
        if not self.auto_collation:
            return next(self.it)
        data = []
        for _ in index:
            try:
                data.append(next(self.it))
            except StopIteration:
                self.ended = True
                break
        if not data or (self.drop_last and len(data) < len(index)):
            raise StopIteration
        return data


def main(kind, dataset, index_queue, result_queue, auto_collation, collate_fn, drop_last,
         base_seed, init_fn, worker_id, num_workers, parent):
    """A worker's whole life."""
    _compat.die_with_parent(parent)
    seed = _seed(base_seed, worker_id)
    _compat.set_worker_info(worker_id, num_workers, seed, dataset)
    index_ring = index_queue._ring
    result_ring = result_queue._ring
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
        fetcher = _Fetcher(kind, dataset, auto_collation, drop_last)
    except Exception:
        init_error = _compat.wrap_exception(worker_id)
    ended = False
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
            if r == RESUME_TASK:
                send(0, RESUME)
                ended = False
                fetcher = None
                continue
            if ended:
                continue
            task, index = r
            if init_error is not None:
                send(task, ERROR, (init_error, 0, 0))
                init_error = None
                continue
            start = time.perf_counter_ns()
            try:
                if fetcher is None:
                    fetcher = _Fetcher(kind, dataset, auto_collation, drop_last)
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
                    send(task, END)
                    continue
                send(task, ERROR, (_compat.wrap_exception(worker_id), 0, 0))
                continue
            except Exception:
                send(task, ERROR, (_compat.wrap_exception(worker_id), 0, 0))
                continue
            busy = time.perf_counter_ns() - start
            n = len(samples) if auto_collation else 1
            if block is not None:
                ref = block.ticket(True)
                del block
                send(task, COLLATED, (skeleton, busy, n), [ref])
            else:
                try:
                    send(task, PICKLED, (batch, busy, n))
                except Exception:
                    send(task, ERROR, (_compat.wrap_exception(worker_id), busy, 0))
            del samples
    except KeyboardInterrupt:
        pass
