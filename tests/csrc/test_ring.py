"""Tests of mpcore._core.Ring, the shared-memory message ring (csrc/ring.c).

Tests that fork synchronise on pipes, never on sleeps, are bounded by
pytest-timeout, and reap every child they start (the `children` fixture
kills and reaps whatever a failing test left behind).
"""
import collections
import ctypes
import mmap
import os
import platform
import queue
import random
import select
import signal
import struct
import threading
import time
import traceback

import pytest

from helpers import scaled
from mpcore import _core as core

_GOT = []   # the refs this module's rings gave out (see Ring)


class Ring:
    """The core's ring, whose gets and drains are noted: the refs these
    tests send are made up, no one redeems them, and a get journals each
    (NOTE [ Journal ] in journal.c), so a fixture forgets them after each
    test rather than leave the process's journal, which holds 1024, full
    for the tests after these."""

    def __init__(self, *args, **kwargs):
        self._ring = core.Ring(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._ring, name)

    def get(self, *args, **kwargs):
        got = self._ring.get(*args, **kwargs)
        _GOT.extend(got[0])
        return got

    def drain(self):
        refs = self._ring.drain()
        _GOT.extend(refs)
        return refs


@pytest.fixture(autouse=True)
def _journal_forgets_made_up_refs():
    yield
    core.drop_journaled(_GOT)
    _GOT.clear()

# Where ring.c keeps things in its header (NOTE [ Ring ]); only the tests
# that play a process dying inside the lock need to know.
MUTEX_OFFSET = 64
COUNT_OFFSET = 144


def make_ring(capacity, maxitems=0, shared=False):
    """A new ring of at least `capacity` bytes, and the buffer it lives in
    (an anonymous shared mapping, which forked children share, or a
    bytearray)."""
    size = core.ring_footprint(capacity)
    buf = mmap.mmap(-1, size) if shared else bytearray(size)
    return Ring(buf, create=True, maxitems=maxitems), buf


def message(rng, max_refs=5, max_len=300):
    refs = [(rng.getrandbits(64), rng.getrandbits(32), rng.getrandbits(32))
            for _ in range(rng.randint(0, max_refs))]
    payload = rng.randbytes(rng.randint(0, max_len))
    return refs, payload


class Children:
    """Forks children that run a function and exit 0 if it returned, 1 if
    it raised; reaps them."""

    def __init__(self):
        self.live = set()

    def spawn(self, fn, *args):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fn(*args)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        self.live.add(pid)
        return pid

    def wait(self, pid):
        """Reaps pid and returns its exit code (-signal if killed)."""
        _, status = os.waitpid(pid, 0)
        self.live.discard(pid)
        return os.waitstatus_to_exitcode(status)

    def kill_all(self):
        for pid in list(self.live):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            self.live.discard(pid)


@pytest.fixture
def children():
    c = Children()
    try:
        yield c
    finally:
        c.kill_all()


FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98}.get(platform.machine())


def wait_until_asleep(pid, timeout=10.0):
    """Waits until pid sleeps in a futex (for a ring, that is the only
    thing a single-threaded child can sleep in).  This polls /proc, the only
    way to observe another process's state; it waits for the event, not for
    a guessed time."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/syscall") as f:
                fields = f.read().split()
            if fields and FUTEX_SYSCALL is not None and fields[0] == str(FUTEX_SYSCALL):
                return
        except (PermissionError, FileNotFoundError):
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "S":
                    return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} never went to sleep")


def read_exactly(fd, n, timeout=10.0):
    """Reads n bytes from a pipe, failing if they do not come in time."""
    data = b""
    deadline = time.monotonic() + scaled(timeout)
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"timed out reading a pipe (got {data!r})")
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise AssertionError(f"pipe closed early (got {data!r})")
        data += chunk
    return data


# ---------------------------------------------------------------------------
# Single process
# ---------------------------------------------------------------------------


def test_footprint_and_sizes():
    hdr = core.ring_footprint(0)
    assert hdr % 64 == 0
    for cap in (64, 100, 1000, 4096, 1 << 20):
        fp = core.ring_footprint(cap)
        assert fp % 64 == 0 and fp >= hdr + cap
        r = Ring(bytearray(fp), create=True)
        assert r.max_message() >= cap - 16
        assert r.size == fp
    with pytest.raises(OverflowError):
        core.ring_footprint(-1)
    with pytest.raises(OverflowError):
        core.ring_footprint(1 << 62)


def test_fifo_with_refs_and_payloads():
    r, _ = make_ring(1 << 16)
    rng = random.Random(1)
    sent = [message(rng) for _ in range(200)]
    sent.append(([], b""))
    sent.append(([(2**64 - 1, 2**32 - 1, 2**32 - 1)], b"\0" * 7))
    for refs, payload in sent:
        r.put(refs, payload)
    assert r.count() == len(sent)
    for refs, payload in sent:
        assert r.get(block=False) == (refs, payload)
    assert r.count() == 0


def test_payload_types():
    r, _ = make_ring(4096)
    r.put([], bytearray(b"abc"))
    r.put([], memoryview(b"xdefx")[1:4])
    r.put(([1, 2, 3],), b"")  # any sequences of three ints will do
    assert r.get() == ([], b"abc")
    assert r.get() == ([], b"def")
    assert r.get() == ([(1, 2, 3)], b"")
    with pytest.raises(TypeError):
        r.put([(1, 2)], b"")
    with pytest.raises(TypeError):
        r.put(None, b"")
    with pytest.raises(TypeError):
        r.put([], "text")
    with pytest.raises(OverflowError):
        r.put([(1, 2**32, 3)], b"")
    with pytest.raises(OverflowError):
        r.put([(-1, 2, 3)], b"")
    assert r.count() == 0


def test_wrap_around():
    # A small ring, filled and emptied many times with messages of every
    # size, so that records and their headers are split across the end of
    # the data area at every possible place.
    r, _ = make_ring(512)
    maxmsg = r.max_message()
    rng = random.Random(2)
    model = collections.deque()
    for round_ in range(300):
        # Fill up, then take a random number out, so that head and tail
        # move independently of each other.
        while True:
            refs, payload = message(rng, max_refs=3, max_len=200)
            try:
                r.put(refs, payload, block=False)
            except queue.Full:
                break
            model.append((refs, payload))
        assert model, "an empty ring refused a message"
        assert r.count() == len(model)
        for _ in range(rng.randint(1, len(model))):
            assert r.get(block=False) == model.popleft()
    while model:
        assert r.get(block=False) == model.popleft()
    assert r.count() == 0
    # The largest message fits in an empty ring wherever the head is.
    for shift in range(0, 64, 8):
        r.put([], b"s" * shift)
        r.get()
        big = ([(shift, 1, 2)], bytes(range(256)) * ((maxmsg - 16) // 256) + b"z" * ((maxmsg - 16) % 256))
        assert 16 * len(big[0]) + len(big[1]) == maxmsg
        r.put(*big, block=False)
        with pytest.raises(queue.Full):
            r.put([], b"", block=False)
        assert r.get(block=False) == big


def test_empty_and_full():
    r, _ = make_ring(256)
    with pytest.raises(queue.Empty) as ei:
        r.get(block=False)
    assert ei.value.args == ()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        r.get(timeout=0.05)
    assert 0.05 <= time.monotonic() - t0 < scaled(2)
    with pytest.raises(queue.Empty):
        r.get(timeout=0)
    while True:
        try:
            r.put([], b"x" * 40, block=False)
        except queue.Full as e:
            assert e.args == ()
            break
    n = r.count()
    assert n > 0
    t0 = time.monotonic()
    with pytest.raises(queue.Full):
        r.put([], b"x" * 40, timeout=0.05)
    assert 0.05 <= time.monotonic() - t0 < scaled(2)
    with pytest.raises(ValueError):
        r.put([], b"", timeout=-1)
    with pytest.raises(ValueError):
        r.get(timeout=-1)
    assert r.count() == n


def test_maxitems():
    r, _ = make_ring(1 << 16, maxitems=3)
    for i in range(3):
        r.put([], bytes([i]))
    with pytest.raises(queue.Full):
        r.put([], b"", block=False)
    assert r.get() == ([], b"\0")
    r.put([], b"\3", block=False)
    assert [r.get()[1] for _ in range(3)] == [b"\1", b"\2", b"\3"]
    with pytest.raises(OverflowError):
        make_ring(1024, maxitems=2**32)


def test_msgsize():
    r, _ = make_ring(1000)
    m = r.max_message()
    r.put([], b"a" * m)
    assert r.get()[1] == b"a" * m
    r.put([(1, 2, 3)] * 4, b"b" * (m - 64))
    assert r.get() == ([(1, 2, 3)] * 4, b"b" * (m - 64))
    # Larger payloads travel in a shared-memory block (NOTE [ Ring ]).
    r.put([], b"a" * (m + 1))
    r.put([(1, 2, 3)], b"c" * (m - 15))
    assert r.count() == 2
    refs, got = r.get()  # handed over in the block it travelled in
    assert refs == [] and bytes(got) == b"a" * (m + 1) and len(memoryview(got)) == m + 1
    refs, got = r.get()
    assert refs == [(1, 2, 3)] and bytes(got) == b"c" * (m - 15)
    # Refs travel in the ring itself: too many can never fit.
    with pytest.raises(ValueError, match=f"{m // 16 + 1} refs .* largest message is {m} bytes"):
        r.put([(1, 2, 3)] * (m // 16 + 1), b"")
    assert r.count() == 0


def test_close():
    r, buf = make_ring(4096)
    other = Ring(buf)  # another view of the same ring
    r.put([(1, 2, 3)], b"one")
    r.put([], b"two")
    assert not other.closed
    other.close()
    assert r.closed and other.closed
    with pytest.raises(ValueError, match="ring is closed"):
        r.put([], b"three")
    assert r.get() == ([(1, 2, 3)], b"one")
    assert r.get(block=False) == ([], b"two")
    with pytest.raises(ValueError, match="ring is closed"):
        r.get()
    with pytest.raises(ValueError, match="ring is closed"):
        r.get(block=False)
    r.close()  # closing twice is harmless


@pytest.mark.timeout(30)
def test_close_wakes_waiters():
    # A getter on an empty ring and a putter on a full one, both waiting
    # with no timeout in threads: close wakes both.  (This also shows that
    # waiting releases the GIL: the main thread runs meanwhile.)
    r, _ = make_ring(256, maxitems=1)
    full, _ = make_ring(256, maxitems=1)
    full.put([], b"x")
    results = {}
    started = threading.Barrier(3)

    def waiter(name, fn):
        started.wait()
        try:
            fn()
            results[name] = "returned"
        except ValueError as e:
            results[name] = str(e)

    threads = [threading.Thread(target=waiter, args=("get", r.get)),
               threading.Thread(target=waiter, args=("put", lambda: full.put([], b"y")))]
    for t in threads:
        t.start()
    started.wait()
    r.close()
    full.close()
    for t in threads:
        t.join(scaled(10))
        assert not t.is_alive()
    assert results == {"get": "ring is closed", "put": "ring is closed"}


def test_drain():
    r, _ = make_ring(4096, maxitems=3)
    r.put([(1, 1, 1), (2, 2, 2)], b"a")
    r.put([], b"b")
    r.put([(3, 3, 3)], b"c")
    assert r.drain() == [(1, 1, 1), (2, 2, 2), (3, 3, 3)]
    assert r.count() == 0
    with pytest.raises(queue.Empty):
        r.get(block=False)
    r.put([(4, 4, 4)], b"d", block=False)
    assert r.get() == ([(4, 4, 4)], b"d")
    assert r.drain() == []


@pytest.mark.timeout(30)
def test_tasks_and_join():
    r, _ = make_ring(4096)
    assert r.join(timeout=0) is True
    r.task_add()
    r.put([], b"x", task=True)
    assert r.join(timeout=0) is False
    t0 = time.monotonic()
    assert r.join(timeout=0.05) is False
    assert time.monotonic() - t0 >= 0.05
    r.task_done()
    assert r.join(timeout=0.01) is False
    with pytest.raises(ValueError):
        r.join(timeout=-1)

    # A joiner in a thread is released by the last task_done.
    ready = threading.Event()
    out = []

    def joiner():
        ready.set()
        out.append(r.join())

    t = threading.Thread(target=joiner)
    t.start()
    ready.wait()
    assert r.get() == ([], b"x")
    r.task_done()
    t.join(scaled(10))
    assert out == [True]
    with pytest.raises(ValueError, match="too many"):
        r.task_done()
    # A put that fails counts no task.
    r.close()
    with pytest.raises(ValueError):
        r.put([], b"y", task=True)
    assert r.join(timeout=0) is True


def test_attach_checks():
    r, buf = make_ring(1024)
    with pytest.raises(ValueError, match="not an mpcore ring"):
        Ring(bytearray(4096))
    with pytest.raises(ValueError, match="not zeroed"):
        Ring(buf, create=True)
    with pytest.raises(ValueError):
        Ring(bytearray(100), create=True)
    with pytest.raises(ValueError):
        Ring(buf, size=len(buf) - 64)  # the header says it needs more
    with pytest.raises(ValueError):
        Ring(buf, offset=len(buf) + 1)
    with pytest.raises(ValueError):
        Ring(buf, offset=8, size=len(buf))
    with pytest.raises(ValueError):
        Ring(bytearray(4096), offset=4, create=True)  # misaligned
    with pytest.raises((TypeError, BufferError)):
        Ring(bytes(4096), create=True)  # read-only
    # A ring need not start at the start of its buffer.
    big = bytearray(64 + core.ring_footprint(256))
    a = Ring(big, offset=64, create=True)
    a.put([(9, 9, 9)], b"off")
    assert Ring(big, offset=64).get() == ([(9, 9, 9)], b"off")
    assert big[:64] == bytes(64)


def test_keeps_buffer_exported():
    r, mm = make_ring(1024, shared=True)
    with pytest.raises(BufferError):
        mm.close()
    del r
    mm.close()


@pytest.mark.timeout(30)
def test_signal_during_timed_wait_keeps_deadline():
    # Signals whose handlers return interrupt the wait, which then goes on
    # towards the same deadline.
    r, _ = make_ring(256)
    hits = []
    old = signal.signal(signal.SIGUSR1, lambda *a: hits.append(1))
    stop = threading.Event()
    main = threading.get_ident()

    def pester():
        while not stop.wait(0.01):
            signal.pthread_kill(main, signal.SIGUSR1)

    t = threading.Thread(target=pester)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(queue.Empty):
            r.get(timeout=0.3)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
        signal.signal(signal.SIGUSR1, old)
    assert 0.3 <= elapsed < scaled(3)
    assert len(hits) >= 2


# ---------------------------------------------------------------------------
# Several processes
# ---------------------------------------------------------------------------

N_PRODUCERS = 2
N_CONSUMERS = 2
N_MESSAGES = 20000


def _produce(r, p, n):
    for i in range(n):
        refs = [(p, i, (i * 7 + k) & 0xFFFFFFFF) for k in range(i % 4)]
        body = bytes((p + i + j) & 0xFF for j in range((i * 37) % 300))
        r.put(refs, struct.pack("<II", p, i) + body)


def _consume(r, path):
    got = []
    while True:
        try:
            refs, payload = r.get()
        except ValueError:  # closed and empty
            break
        p, i = struct.unpack_from("<II", payload)
        assert refs == [(p, i, (i * 7 + k) & 0xFFFFFFFF) for k in range(i % 4)]
        assert payload[8:] == bytes((p + i + j) & 0xFF for j in range((i * 37) % 300))
        got.append((p << 32) | i)
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{len(got)}Q", *got))


@pytest.mark.timeout(180)
def test_fork_producers_consumers(children, tmp_path):
    # A small ring, so that producers wait for room and consumers for
    # messages all the time.
    r, mm = make_ring(2048, shared=True)
    paths = [tmp_path / f"c{k}" for k in range(N_CONSUMERS)]
    consumers = [children.spawn(_consume, r, str(p)) for p in paths]
    per = N_MESSAGES // N_PRODUCERS
    producers = [children.spawn(_produce, r, p, per) for p in range(N_PRODUCERS)]
    for pid in producers:
        assert children.wait(pid) == 0
    r.close()
    for pid in consumers:
        assert children.wait(pid) == 0
    seen = []
    counts = []
    for p in paths:
        data = p.read_bytes()
        ids = struct.unpack(f"<{len(data) // 8}Q", data)
        counts.append(len(ids))
        # Each consumer sees each producer's messages in order.
        for prod in range(N_PRODUCERS):
            mine = [x & 0xFFFFFFFF for x in ids if x >> 32 == prod]
            assert mine == sorted(mine)
        seen.extend(ids)
    assert len(seen) == N_MESSAGES
    assert sorted(seen) == sorted((p << 32) | i for p in range(N_PRODUCERS) for i in range(per))
    assert r.count() == 0


def _blocked_getter(r, ready_w, out_w):
    os.write(ready_w, b"r")
    refs, payload = r.get()
    os.write(out_w, payload)


@pytest.mark.timeout(60)
def test_killed_waiter_leaves_ring_usable(children):
    r, mm = make_ring(4096, shared=True)
    ready_r, ready_w = os.pipe()
    outs = [os.pipe() for _ in range(2)]
    try:
        pids = [children.spawn(_blocked_getter, r, ready_w, outs[k][1]) for k in range(2)]
        assert read_exactly(ready_r, 2) == b"rr"
        for pid in pids:
            wait_until_asleep(pid)
        os.kill(pids[0], signal.SIGKILL)
        assert children.wait(pids[0]) == -signal.SIGKILL
        # The survivor gets the next message: the dead sleeper took no
        # wake-up with it.
        r.put([], b"hello")
        assert read_exactly(outs[1][0], 5) == b"hello"
        assert children.wait(pids[1]) == 0
        # And the ring works as before, here and in a new process.
        r.put([(1, 2, 3)], b"again")
        assert r.get(timeout=scaled(5)) == ([(1, 2, 3)], b"again")
        pid = children.spawn(_blocked_getter, r, ready_w, outs[0][1])
        assert read_exactly(ready_r, 1) == b"r"
        r.put([], b"third")
        assert read_exactly(outs[0][0], 5) == b"third"
        assert children.wait(pid) == 0
        assert r.count() == 0
    finally:
        for fd in (ready_r, ready_w, *outs[0], *outs[1]):
            os.close(fd)


def _die_holding_lock(mm, corrupt_count, done_w):
    libc = ctypes.CDLL(None, use_errno=True)
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    assert libc.pthread_mutex_lock(ctypes.c_void_p(base + MUTEX_OFFSET)) == 0
    if corrupt_count:
        # Play a process that died between moving head or tail and
        # updating the count.
        ctypes.c_uint32.from_address(base + COUNT_OFFSET).value = 99
    os.write(done_w, b"d")
    os._exit(0)  # with the lock held


@pytest.mark.timeout(60)
@pytest.mark.parametrize("corrupt_count", [False, True])
def test_process_dying_with_lock_held(children, corrupt_count):
    r, mm = make_ring(4096, shared=True)
    r.put([(1, 1, 1)], b"before")
    r.put([], b"before2")
    done_r, done_w = os.pipe()
    try:
        pid = children.spawn(_die_holding_lock, mm, corrupt_count, done_w)
        assert read_exactly(done_r, 1) == b"d"
        assert children.wait(pid) == 0
    finally:
        os.close(done_r)
        os.close(done_w)
    # The next locker recovers the mutex (EOWNERDEAD) and recounts.
    r.put([], b"after")
    assert r.count() == 3
    assert r.get() == ([(1, 1, 1)], b"before")
    assert r.get() == ([], b"before2")
    assert r.get() == ([], b"after")
    with pytest.raises(queue.Empty):
        r.get(block=False)


def _interrupted(r, op, ready_w, out_w):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.write(ready_w, b"r")
    try:
        if op == "get":
            r.get()
        else:
            r.put([], b"x")
    except KeyboardInterrupt:
        os.write(out_w, b"K")
        return
    os.write(out_w, b"?")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["get", "put"])
def test_ctrl_c_interrupts_blocked_wait(children, op):
    r, mm = make_ring(256, shared=True, maxitems=1)
    if op == "put":
        r.put([], b"full")
    ready_r, ready_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        pid = children.spawn(_interrupted, r, op, ready_w, out_w)
        assert read_exactly(ready_r, 1) == b"r"
        wait_until_asleep(pid)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGINT)
        assert read_exactly(out_r, 1, timeout=10) == b"K"
        assert time.monotonic() - t0 < scaled(2)
        assert children.wait(pid) == 0
    finally:
        for fd in (ready_r, ready_w, out_r, out_w):
            os.close(fd)
    # The interrupted waiter left the ring as it was.
    assert r.count() == (1 if op == "put" else 0)
