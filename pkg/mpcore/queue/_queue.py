"""Queue, SimpleQueue and JoinableQueue over a shared-memory ring.

NOTE [ Queue messages ]
A message is a ForkingPickler pickle.  Pickling a tensor or a shared array
takes a ticket on its block (see _blocks.ticket), so the block outlives the
sender; the message lists those tickets beside its bytes, so that a queue
freed with messages still inside drops them (ring.c).  A pickle too large
for the ring travels in a block of its own: the ring does that itself
(NOTE [ Ring ] in ring.c), for every ring, so nothing here limits a size.
There is no feeder thread: put() returns once the message is in shared
memory, and a killed sender cannot lose a message it has put.

NOTE [ Batches ]
put_many() and get_many() are faster-fifo's: put_many(objs) puts all of
objs or none of them, together (no other message comes between them), and
fails with queue.Full when there is no room for all of them in time; a
batch that can never fit (more than maxsize, more bytes than the ring) is a
ValueError at once.  An unbounded queue's put_many never blocks: the batch
goes to the feeder when the ring has no room for all of it.  get_many()
waits, as get() does, for one message (queue.Empty if none comes in time)
and then takes what is there, up to max_messages_to_get, without waiting
for more.  Their timeouts default to None, as the stdlib's do (faster-fifo
defaults to 10 s).

NOTE [ Unbounded queues ]
multiprocessing.Queue() never blocks in put(): its feeder thread buffers
what the pipe cannot take.  The ring has a fixed size, so when an unbounded
queue's ring is full, put() leaves the message with a feeder thread of this
process, started then and only then, which moves it into the ring as room
comes; later messages of this process wait behind it, keeping their order.
As with multiprocessing, the process joins that thread at exit unless
cancel_join_thread() was called.
"""
import collections
import queue as _stdqueue
import threading
import weakref
from multiprocessing import util as _mputil

from .. import _core, _stats
from . import _pickle
from ..shm import _blocks

DEFAULT_CAPACITY = 2 << 20


class Queue:
    """multiprocessing.Queue's API over an mpcore shared-memory ring."""

    _counted = False

    def __init__(self, maxsize=0, *, ctx=None, capacity=DEFAULT_CAPACITY):
        if maxsize is None or maxsize < 0:
            maxsize = 0
        self._block = _blocks.alloc(_core.ring_footprint(capacity), zero=True,
                                 kind=_blocks.BLOCK_QUEUE)
        self._ring = _core.Ring(self._block, 0, None, True, maxsize)
        self._maxsize = maxsize
        self._reset()
        _stats.bump("queues_created")

    def _reset(self):
        self._closed = False
        self._backlog = 0        # messages with the feeder, not yet in the ring
        self._pending = None     # deque of (refs, payload) for the feeder
        self._cond = None
        self._feeder = None
        self._join_feeder = True
        _mputil.register_after_fork(self, Queue._reset)

    def __reduce__(self):
        return (_rebuild_queue, (type(self), _blocks.ticket(self._block), self._maxsize))

    def __repr__(self):
        return f"<{type(self).__module__}.{type(self).__qualname__} object at {id(self):#x}>"

    def _check_closed(self):
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")

    def put(self, obj, block=True, timeout=None):
        if self._closed:
            self._check_closed()
        record = _RECORDS.get(type(obj))
        if record is None or (msg := record(obj)) is None:
            refs, payload = encode(obj)
        else:
            refs, payload = msg
        try:
            if self._maxsize == 0:
                if self._backlog == 0:
                    try:
                        self._ring.put(refs, payload, False, None, self._counted)
                        return
                    except _stdqueue.Full:
                        pass
                self._defer(refs, bytes(payload))
                return
            self._ring.put(refs, payload, block, timeout, self._counted)
        except BaseException:
            for ref in refs:
                _core.drop_ticket(ref)
            raise

    def put_many(self, objs, block=True, timeout=None):
        """Puts every object of objs (a list or tuple), in order, all or
        none (NOTE [ Batches ]): raises queue.Full, having put none, when
        there was no room for all of them in time; ValueError when they can
        never fit together (more than maxsize of them, or more bytes than
        the queue's capacity)."""
        self._check_closed()
        if not isinstance(objs, (list, tuple)):
            raise TypeError(f"put_many() takes a list or tuple, not {type(objs).__name__}")
        if self._maxsize and len(objs) > self._maxsize:
            raise ValueError(f"a batch of {len(objs)} can never fit in a queue of maxsize "
                             f"{self._maxsize}")
        msgs = []
        try:
            for obj in objs:
                record = _RECORDS.get(type(obj))
                msg = record(obj) if record is not None else None
                msgs.append(msg if msg is not None else encode(obj))
            if self._maxsize == 0:
                if self._backlog == 0:
                    try:
                        self._ring.put_many(msgs, False, None, self._counted)
                        return
                    except _stdqueue.Full:
                        pass
                    except ValueError:
                        if self._ring.closed:
                            raise
                for refs, payload in msgs:
                    self._defer(refs, bytes(payload))
                return
            self._ring.put_many(msgs, block, timeout, self._counted)
        except BaseException:
            for refs, _ in msgs:
                for ref in refs:
                    _core.drop_ticket(ref)
            raise

    def get_many(self, block=True, timeout=None, max_messages_to_get=1 << 30):
        """Returns a list of the objects in the queue, oldest first: at
        least one (waiting for it as get() does: queue.Empty if none comes
        in time), at most max_messages_to_get, and no more than are there
        once the first has come (NOTE [ Batches ])."""
        self._check_closed()
        msgs = self._ring.get_many(block, timeout, max_messages_to_get)
        out = []
        try:
            for refs, payload in msgs:
                out.append(decode(refs, payload))
        except BaseException:
            # The messages after the one that failed are dropped with it.
            for refs, _ in msgs[len(out) + 1:]:
                if refs:
                    _core.drop_journaled(refs)
            raise
        return out

    def _defer(self, refs, payload):
        if self._counted:
            self._ring.task_add()
        if self._feeder is None:
            self._pending = collections.deque()
            self._cond = threading.Condition()
            self._feeder = threading.Thread(target=Queue._feed,
                                            args=(self._ring, self._pending, self._cond),
                                            name="mpcore-queue-feeder", daemon=True)
            self._feeder.start()
            self._join_finalizer = _mputil.Finalize(
                self._feeder, Queue._finalize_join, [weakref.ref(self._feeder)],
                exitpriority=-5)
            _mputil.Finalize(self, Queue._finalize_close, [self._pending, self._cond],
                             exitpriority=10)
        with self._cond:
            self._backlog += 1
            self._pending.append((refs, payload, self))
            self._cond.notify()

    @staticmethod
    def _feed(ring, pending, cond):
        while True:
            with cond:
                while not pending:
                    cond.wait()
                item = pending.popleft()
            if item is None:
                return
            refs, payload, q = item
            try:
                ring.put(refs, payload, True, None, False)
            except BaseException:
                for ref in refs:
                    _core.drop_ticket(ref)
            finally:
                with cond:
                    q._backlog -= 1
                del q, item

    @staticmethod
    def _finalize_close(pending, cond):
        with cond:
            pending.append(None)
            cond.notify()

    @staticmethod
    def _finalize_join(twr):
        thread = twr()
        if thread is not None:
            thread.join()

    def get(self, block=True, timeout=None):
        if self._closed:
            self._check_closed()
        refs, payload = self._ring.get(block, timeout)
        if not refs:
            return _pickle.loads(payload)
        if len(refs) == 1 and _receive_record is not None:
            # A tensor record, most likely (None if the message is not one).
            obj = _receive_record(refs, payload)
            if obj is not None:
                return obj
        return decode(refs, payload)

    def put_nowait(self, obj):
        return self.put(obj, False)

    def get_nowait(self):
        return self.get(False)

    def qsize(self):
        return self._ring.count() + self._backlog

    def empty(self):
        return self._ring.count() == 0 and self._backlog == 0

    def full(self):
        return self._maxsize > 0 and self._ring.count() >= self._maxsize

    def close(self):
        """Says this process will put no more; other processes are unaffected.
        What the feeder still holds is put before it stops."""
        self._closed = True
        if self._feeder is not None:
            Queue._finalize_close(self._pending, self._cond)

    def join_thread(self):
        if not self._closed:
            raise AssertionError(f"Queue {self!r} not closed")
        if self._feeder is not None and self._join_feeder:
            self._feeder.join()

    def cancel_join_thread(self):
        self._join_feeder = False
        if self._feeder is not None:
            self._join_finalizer.cancel()


class JoinableQueue(Queue):
    """multiprocessing.JoinableQueue: task_done() and join()."""

    _counted = True

    def task_done(self):
        try:
            self._ring.task_done()
        except ValueError:
            raise ValueError("task_done() called too many times") from None

    def join(self):
        self._ring.join(None)


class SimpleQueue(Queue):
    """multiprocessing.SimpleQueue: get, put, empty, close."""

    def put(self, obj):
        return Queue.put(self, obj)

    def get(self):
        return Queue.get(self)


def encode(obj, prefix=b""):
    """(refs, payload) of a message carrying obj after `prefix`.  The
    tickets pickling takes are collected as _blocks.transfer does."""
    tls = _blocks.tls
    saved = getattr(tls, "refs", None)
    refs = tls.refs = []
    try:
        payload = _pickle.dumps(obj, prefix)
    except BaseException:
        for ref in refs:
            _core.drop_ticket(ref)
        raise
    finally:
        tls.refs = saved
    return refs, payload


def decode(refs, payload):
    """The object of a message made by encode() (prefix removed) or of a
    tensor record (Queue.put)."""
    if not refs:
        return _pickle.loads(payload)
    if len(refs) == 1 and type(payload) is bytes and payload[:4] == _RECORD_TAG:
        receive = _receive_record
        if receive is None:   # torch not served here yet: read it all the same
            # torch first: its import serves it (queue/_serve.py), which
            # imports shm/_torch whole; then _torch, which gives the core
            # torch's objects where nothing served it.
            import torch  # noqa: F401
            from ..shm import _torch  # noqa: F401
            receive = _core.tensor_from_record
        obj = receive(refs, payload)
        if obj is not None:
            return obj
    return _blocks.receive(refs, _pickle.loads, payload)


# NOTE [ Tensor records ] in py_tensor.c: type -> fn(obj) giving (refs, payload)
# or None (then obj is pickled); filled by serve_records once torch is served.
_RECORDS = {}
_receive_record = None


def serve_records(cls, message, receive):
    """Puts objects of exactly type cls as records: message(obj) gives
    (refs, payload), or None to pickle obj; receive(refs, payload) gives
    the object of a record, or None if the message is not one."""
    global _receive_record
    _RECORDS[cls] = message
    _receive_record = receive
_RECORD_TAG = _core.TENSOR_RECORD_TAG   # a record's first bytes; a pickle's first is 0x80


def _rebuild_queue(cls, ref, maxsize):
    q = cls.__new__(cls)
    q._block = _blocks.attach(ref)
    if q._block.kind != _blocks.BLOCK_QUEUE:
        raise _blocks.HandleError(f"handle names a data block, not a queue: {ref}")
    q._ring = _core.Ring(q._block, 0, None, False, maxsize)
    q._maxsize = maxsize
    q._reset()
    return q


Empty = _stdqueue.Empty
Full = _stdqueue.Full


def ring_of(q):
    """The _core.Ring under an mpcore queue, for mpcore's own code that
    speaks the ring's protocol directly (the DataLoader's pool)."""
    return q._ring
