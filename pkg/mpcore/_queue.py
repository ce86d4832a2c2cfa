"""Queue, SimpleQueue and JoinableQueue over a shared-memory ring.

NOTE [ Queue messages ]
A message is a ForkingPickler pickle.  Pickling a tensor or a shared array
takes a ticket on its block (see _shm.ticket), so the block outlives the
sender; the message lists those tickets beside its bytes, so that a queue
freed with messages still inside drops them (ring.c).  A pickle too large
for the ring travels in a block of its own, named by the message.
There is no feeder thread: put() returns once the message is in shared
memory, and a killed sender cannot lose a message it has put.
"""
import queue as _stdqueue

from . import _core, _pickle, _shm, _stats

_INLINE = b"P"
_SPILLED = b"S"
DEFAULT_CAPACITY = 2 << 20


class Queue:
    """multiprocessing.Queue's API over an mpcore shared-memory ring."""

    _counted = False

    def __init__(self, maxsize=0, *, ctx=None, capacity=DEFAULT_CAPACITY):
        if maxsize is None or maxsize < 0:
            maxsize = 0
        self._block = _shm.alloc(_core.ring_footprint(capacity), zero=True,
                                 kind=_shm.BLOCK_QUEUE)
        self._ring = _core.Ring(self._block, 0, None, True, maxsize)
        self._maxsize = maxsize
        self._closed = False
        _stats.bump("queues_created")

    def __reduce__(self):
        return (_rebuild_queue, (type(self), _shm.ticket(self._block), self._maxsize))

    def __repr__(self):
        return f"<{type(self).__module__}.{type(self).__qualname__} object at {id(self):#x}>"

    def _check_closed(self):
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")

    def put(self, obj, block=True, timeout=None):
        self._check_closed()
        with _shm.transfer() as t:
            payload = _pickle.dumps(obj, _INLINE)
        refs = t.refs
        try:
            if len(payload) > self._ring.max_message() - 16 * (len(refs) + 1):
                spill = _shm.alloc(len(payload))
                memoryview(spill)[:] = payload
                refs.append(spill.ticket(True))
                payload = _SPILLED
            self._ring.put(refs, payload, block, timeout, self._counted)
        except BaseException:
            for ref in refs:
                _core.drop_ticket(ref)
            raise

    def get(self, block=True, timeout=None):
        self._check_closed()
        refs, payload = self._ring.get(block, timeout)
        try:
            if payload[:1] == _SPILLED:
                spill = _shm.attach(refs[-1])
                return _pickle.loads(memoryview(spill)[1:])
            return _pickle.loads(memoryview(payload)[1:])
        finally:
            if refs:
                # Tickets still journaled were not redeemed (unpickling
                # failed): drop them rather than leak their blocks.
                _core.drop_journaled(refs)

    def put_nowait(self, obj):
        return self.put(obj, False)

    def get_nowait(self):
        return self.get(False)

    def qsize(self):
        return self._ring.count()

    def empty(self):
        return self._ring.count() == 0

    def full(self):
        return self._maxsize > 0 and self._ring.count() >= self._maxsize

    def close(self):
        """Says this process will put no more; other processes are unaffected."""
        self._closed = True

    def join_thread(self):
        # There is no feeder thread to join: put() has finished when it returns.
        if not self._closed:
            raise AssertionError(f"Queue {self!r} not closed")

    def cancel_join_thread(self):
        pass


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


def _rebuild_queue(cls, ref, maxsize):
    q = cls.__new__(cls)
    q._block = _shm.attach(ref)
    if q._block.kind != _shm.BLOCK_QUEUE:
        raise _shm.HandleError(f"handle names a data block, not a queue: {ref}")
    q._ring = _core.Ring(q._block, 0, None, False, maxsize)
    q._maxsize = maxsize
    q._closed = False
    return q


Empty = _stdqueue.Empty
Full = _stdqueue.Full
