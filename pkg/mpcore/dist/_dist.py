"""The process group's machinery: rendezvous, the shared-memory group of
a process group's ranks on this machine (_core.Group, csrc/coll.c), and
the queue that runs collectives asked for with async_op=True.

NOTE [ One region per group ]
Every process group served by mpcore's backend (_backend.py) has a region
of its own: the backend's creator calls join() with the group's own
prefix store, which torch makes for each group, so groups made in any
order (subgroups, DeviceMesh dimensions) never share one.  Destroying the
group closes its ShmGroup, which unmaps the region at once.

NOTE [ Rendezvous ]
For env:// and tcp:// the store is made here, as torch's handlers make it,
but rank 0 does not wait inside the store for the others: every rank
writes its own key and waits for all, so that a timeout can say which
ranks never came.  The shared-memory region is a memfd of rank 0, which
the others open through /proc/<pid>/fd/<n>, named in the store; a group
whose ranks are on different machines (by boot id) gets no region.
"""
import datetime
import os
import socket
import threading
import time
import urllib.parse

from .. import _core

_CHUNK = 1 << 20        # staging bytes per rank and piece (all-reduce pieces are smaller: coll.c)
REGION_MAX = _core.COLL_MAX_RANKS   # the most ranks one region serves (_hier.hosts_of)
_inits = 0              # init_process_group calls so far: a fresh key space each


def _host_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _nbytes(tensors):
    """The bytes of a tensor, or of the tensors in a (nested) list; a
    sparse tensor, which has no nbytes, counts as none."""
    if isinstance(tensors, (list, tuple)):
        if len(tensors) == 1:
            return _nbytes(tensors[0])
        return sum(_nbytes(t) for t in tensors)
    try:
        return getattr(tensors, "nbytes", 0)
    except RuntimeError:
        return 0


def seconds(timeout):
    """A timeout (timedelta, seconds or None) in seconds, or None: how every
    timeout the group is given is read."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


# --- rendezvous -------------------------------------------------------------

def _env_int(name, given, method):
    if given is not None and given >= 0:
        return given
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"Error initializing torch.distributed using {method} rendezvous: "
                         f"environment variable {name} expected, but not set")
    return int(value)


def parse_init_method(init_method, rank, world_size):
    """(host, port, rank, world_size) for env:// (None) and tcp:// URLs,
    with torch's rules for what the URL, the arguments and the
    environment give; None for other methods."""
    url = init_method or "env://"
    parts = urllib.parse.urlparse(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    if "rank" in query:
        rank = int(query["rank"])
    if "world_size" in query:
        world_size = int(query["world_size"])
    if parts.scheme == "env":
        method = "env://"
        rank = _env_int("RANK", rank, method)
        world_size = _env_int("WORLD_SIZE", world_size, method)
        host = os.environ.get("MASTER_ADDR")
        if host is None:
            raise ValueError("Error initializing torch.distributed using env:// rendezvous: "
                             "environment variable MASTER_ADDR expected, but not set")
        port = os.environ.get("MASTER_PORT")
        if port is None:
            raise ValueError("Error initializing torch.distributed using env:// rendezvous: "
                             "environment variable MASTER_PORT expected, but not set")
        return host, int(port), rank, world_size
    if parts.scheme == "tcp":
        if rank is None or rank < 0 or world_size is None or world_size < 0:
            raise ValueError("rank and world_size are required for tcp:// rendezvous")
        return parts.hostname, parts.port, rank, world_size
    return None


def make_store(host, port, rank, world_size, timeout_s):
    """The job's TCPStore (rank 0 serves it) without waiting for workers;
    under torchelastic's agent, the agent's (NOTE [ The agent's store ])."""
    from torch.distributed import TCPStore
    td = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return _agent_store(host, port, world_size, td)
    try:
        return TCPStore(host, port, world_size, rank == 0, td, wait_for_workers=False)
    except Exception as e:
        if rank == 0:
            raise
        raise TimeoutError(f"rank {rank} could not reach rank 0's store at {host}:{port} within "
                           f"{timeout_s:g} s: rank 0 did not come ({e})") from None


def _agent_store(host, port, world_size, td):
    """NOTE [ The agent's store ]
    Under torchelastic's agent (torchrun, `mpcore run --nproc-per-node`),
    TORCHELASTIC_USE_AGENT_STORE=True says that the agent already serves
    the store at MASTER_ADDR:MASTER_PORT: every rank, rank 0 included, is
    a client of it, as torch's own env:// handler makes it (a server of
    our own would fail to bind that port).  The agent's store outlives a
    restart, so each attempt (TORCHELASTIC_RESTART_COUNT) works under a
    prefix of its own, and a restarted rank never sees a key of the
    attempt before it (a region named there by a rank that is gone, a
    barrier's count).  torch's own env:// handler gets the same prefix
    (serve_agent_store), since torch adds none."""
    from torch.distributed import PrefixStore, TCPStore
    try:
        store = TCPStore(host, port, world_size, False, td)
    except Exception as e:
        raise TimeoutError(f"could not reach the launcher's store at {host}:{port} within "
                           f"{td.total_seconds():g} s ({e})") from None
    return PrefixStore(_attempt_prefix(), store)


def _attempt_prefix():
    return f"mpcore/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def serve_agent_store():
    """Makes torch's env:// rendezvous put the store of a rank under
    torchelastic's agent in its attempt's key space (NOTE [ The agent's
    store ]).  Idempotent."""
    import importlib
    from torch.distributed import PrefixStore
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module, not the function
    torch_env = rdzv._rendezvous_handlers.get("env")
    if torch_env is None or getattr(torch_env, "_mpcore", False):
        return

    def env_handler(url, *args, **kwargs):
        for store, rank, world_size in torch_env(url, *args, **kwargs):
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                store = PrefixStore(_attempt_prefix(), store)
            yield store, rank, world_size

    env_handler._mpcore = True
    rdzv._rendezvous_handlers["env"] = env_handler


def next_prefix():
    """A fresh key space in the store for this init_process_group (every
    rank makes the same calls, so they agree)."""
    global _inits
    _inits += 1
    return f"mpcore/{_inits}/"


def wait_for_ranks(store, prefix, rank, world_size, timeout_s, where):
    """Every rank marks its arrival and waits for all; then rank 0 waits
    until every rank has seen all, so that its store (which dies with it)
    outlives everyone's wait.  A timeout names the ranks that never came."""
    deadline = time.monotonic() + timeout_s
    _await(store, f"{prefix}arrived/", rank, world_size, deadline, timeout_s, where,
           "never joined (is world_size right?)")
    if rank == 0:
        _await(store, f"{prefix}saw-all/", rank, world_size, deadline, timeout_s, where,
               "joined but did not go on")
    else:
        store.set(f"{prefix}saw-all/{rank}", "1")


def _await(store, prefix, rank, world_size, deadline, timeout_s, where, what):
    store.set(f"{prefix}{rank}", "1")
    missing = [r for r in range(world_size) if r != rank]
    while True:
        try:
            missing = [r for r in missing if not store.check([f"{prefix}{r}"])]
        except Exception:
            raise TimeoutError(
                f"init_process_group: rank 0's store at {where} went away while rank {rank} "
                f"waited (rank 0 gave up or died); rank(s) {missing} of world_size "
                f"{world_size} had not joined") from None
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"init_process_group timed out after {timeout_s:g} s: rank(s) {missing} of "
                f"world_size {world_size} {what}")
        time.sleep(0.02)  # a poll of the store: the store has no wait for "any of"


# --- the shared-memory group --------------------------------------------------

class Work:
    """What an async_op collective returns: torch's Work surface.  The call
    is done once `_done` is set, which its lane does under the lane's lock
    (NOTE [ A call's end ]); a thread that waits for it waits on the lane."""

    reusable = False         # whether a lane may give it again (NOTE [ A Work used again ])

    def __init__(self, tensors):
        # the fields post and wait_for read in the dict (NOTE [ A Work's
        # fields in its dict ] in py_lane.c): all six, in every Work
        self._tensors = tensors
        self._done = False
        self._exc = None
        self._future = None
        self.lane = None
        self.profiler_events = None   # the profiler's events of the call, which its end ends

    def end(self, exc=None):
        """Marks the call done; returns its future when one was asked for
        before (the caller settles it), else None (get_future settles it).
        For a call of its lane, the lane does this (_Lane.ended)."""
        if self.lane is not None:
            return self.lane.ended(self, exc)
        _end_events(self)
        with _futures:
            self._exc = exc
            self._done = True
            return self._future

    def finish(self, exc=None):
        fut = self.end(exc)
        if fut is not None:
            self.settle(fut)

    def settle(self, fut):
        if self._exc is not None:
            fut.set_exception(self._exc)
        else:
            fut.set_result(self._tensors)

    def _wait_done(self, timeout=None):
        """True once the call is done; False when timeout (seconds) passed.
        It never runs the call here."""
        return self._done or self.lane.await_done(self, timeout)

    def wait(self, timeout=None):
        if not self._done:
            self.lane.wait_for(self)
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self):
        return self._done

    def is_success(self):
        return self._done and self._exc is None

    def exception(self):
        return self._exc

    def result(self):
        self.wait()
        return self._tensors

    def get_future(self):
        import torch
        lane = self.lane
        with _futures if lane is None else lane.lock:
            fut = self._future
            if fut is not None:
                return fut
            fut = self._future = torch.futures.Future()
            done = self._done
        if done:   # made after the call finished: settled here, once
            self.settle(fut)
        return fut


def _end_events(work):
    """Ends the profiler's events of work's call, before anyone sees it done
    (NOTE [ Collectives in the profiler ] in _profile.py)."""
    events = work.profiler_events
    if events is not None:
        work.profiler_events = None
        events.end()


_futures = threading.Lock()   # orders a lane-less Work's future against its completion
_get_ident = threading.get_ident


class _Lane(_core.Lane):
    """A thread that runs calls in the order they were queued.

    NOTE [ A waiter runs its own call ]
    Handing a call to the lane's thread and waking the caller when it is
    done costs two thread switches and a pass of the GIL each way: most of
    an async call's time at small sizes (functional collectives, send and
    recv, whose torch functions wait at once).  So a thread that waits for
    a call which is next in its lane, while the lane's thread has not
    taken it, takes it and runs it itself.  The order of the lane holds:
    only the next call is taken, and never while another runs.  A wait with
    a timeout does not take the call (it could not keep its timeout).

    Waking the lane's thread for a call its caller then runs itself would
    still cost the switches (and, on a machine with no idle core, time of
    a peer rank).  So a small call (SMALL bytes or less) queued while the
    lane's thread is polling wakes nobody: the thread polls every POLL_S
    for as long as small calls came in the last IDLE_S, and takes what no
    waiter took.  A small call that nobody waits for starts at most POLL_S
    late; a large one wakes the thread at once, so that it overlaps with
    what the caller does next (DDP's buckets, FSDP's prefetches), and does
    not keep it polling: a lane of large calls only would wake every POLL_S
    for nothing (with DDP's 40 MB of buckets a step, 2 ranks on 2 cores,
    0.7 ms of CPU in a 50 ms step, taken from backward).  The thread, not
    the caller, reads the clock: a put only counts small calls
    (`small_puts`), and the thread polls for IDLE_S after it last saw the
    count move (within POLL_S of the put, since it polls).

    NOTE [ A finished call wakes only who needs it ]
    A call's end wakes the threads waiting on the lane only when one of
    them can go on: the lane's thread when another call is queued, and
    threads waiting for a call's end (drain(), a Work's wait).  Waking the
    polling thread after every call a waiter ran itself cost a thread
    switch and a pass of the GIL per call: half of a small send/recv
    ping-pong's time (52 us against 24 us, 2 ranks).

    NOTE [ A call's end ]
    A call is done when the lane marks it so, under the lane's lock, with
    the lane's own bookkeeping (running, queued) in the same hold: one
    acquire per call's end, where a lock of each Work's own (acquired when
    made, released at the end) and a global lock for its future cost two
    more, and a lock made per call.  A thread that waits for a call it
    does not run waits on the lane's condition, counted in `waiting`, and
    the end of any call wakes it when one waits.

    NOTE [ Callbacks that call again ]
    A finished call's future is settled, and so its callbacks run, once
    the lane is free again: after `running` is cleared, on the thread that
    ran the call.  A callback may queue another call and wait for it
    (PowerSGD's DDP hook waits, inside a callback, on the future of the
    all-reduce it has just queued).  On a waiter's thread that call is run
    by the lane's thread or by the waiter.  On the lane's own thread
    nobody else would run it: so there a call queued (put), waited for
    (Work.wait) or drained is run at once, on that thread, after what was
    queued before it, the lane's order kept.

    NOTE [ A Work used again ]
    Making the Work of an asynchronous call is a fifth of what such a call
    costs over a blocking one (torch's Work base is constructed through
    pybind).  So the fast paths of torch's functions (_fastpath._queue)
    keep the last Work they made on the lane (`spare`) and give it again
    for the next call when nothing but the lane holds it: its reference
    count says that no program, torch's C++ (which holds a Python Work by
    a Python reference, from torch 2.7) or queued call has it, and no weak
    reference sees it; a Work that anyone still holds is never given
    again, nor one a program gave attributes of its own (they would show
    on the next call's).  On a torch whose C++ does not hold the Python
    Work (NOTE [ A Work only torch's C++ holds ] in _work.py) none is used
    again.  The
    spare holds its last call's tensors until the next call or until the
    lane has had nothing to do for IDLE_S, when the thread lets it go.

    NOTE [ A lane's hot path in C ]
    An asynchronous call waited on at once (dist.all_reduce(t,
    async_op=True).wait(), a functional collective's wait, a send or recv)
    goes through the lane twice: post() queues it with its Work, and the
    waiter's wait_for() takes it and runs it.  In Python those two cost
    about 1.8 us of the 2.6 to 3.6 an async call cost over a blocking one
    (4 KB, one rank; each attribute, lock and call counts).  So the lane's
    state lives in a C base (csrc/py_lane.c: its members are the
    attributes the Python methods here use, under the same lock) and those
    two are C; the rest (the thread's loop, drain, put, run_if_idle, the
    waits with a timeout) stays Python, being off that path.  The C code
    keeps every rule of the Python it replaced: it takes the lane's lock
    (a reentrant LaneLock, by C calls, NOTE [ The lane's lock in C ] in
    py_lanelock.c) around each change of the state, runs the call outside it, marks the end as _call does (NOTE
    [ A call's end ]) and settles the future after it.  Measured, one run,
    4 KB, best of 5 runs of 5000 calls, Python lane and C lane alternated
    (python benchmarks/fastpath_calls.py): async - dist went from +2.72,
    +2.56, +2.83, +2.77, +3.16 us to +1.58, +1.39, +1.70, +1.62, +1.90 for
    all_reduce, barrier, broadcast, all_gather_single and
    reduce_scatter_single."""

    SMALL = 64 << 10
    POLL_S = 0.002
    IDLE_S = 0.5

    def __init__(self, name, timeout):
        self.name = name
        self.timeout = timeout
        # (work, fn, args, keep) in order; a list, which post and wait_for
        # change by C calls (NOTE [ The lane's lock in C ] in py_lanelock.c)
        self.queue = []
        # `with self.lock` is `with self.cond` without threading.Condition's
        # Python-level __enter__/__exit__ (NOTE [ The backend's cost per
        # call ] in _group.py): three of them per call.  A reentrant lock
        # that post and wait_for take by C calls (NOTE [ The lane's lock in
        # C ] in py_lanelock.c).
        self.lock = _core.LaneLock()
        self.cond = threading.Condition(self.lock)
        self.thread = None
        self.ident = None      # the thread's (get_ident() is cheaper than current_thread())
        self.queued = 0
        self.running = False   # a call of this lane runs (on its thread or a waiter's)
        self.polling = False   # the thread waits with POLL_S timeouts
        self.waiting = 0       # threads waiting on cond for a call's end (drain, a Work's wait)
        self.small_puts = 0    # small calls queued so far
        self.spare = None      # NOTE [ A Work used again ]

    def put(self, item, small=False):
        with self.lock:
            if self.thread is None:
                self._start()
            self.queued += 1
            self.queue.append(item)
            if small:
                self.small_puts += 1
            here = _get_ident() == self.ident
            if not (here or small and self.polling):
                self.cond.notify()
        if here:   # a callback on the lane's thread (NOTE [ Callbacks that call again ])
            self.drain(item[0])

    def _start(self):
        """Starts the lane's thread (the caller holds the lock)."""
        self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self.thread.start()
        self.ident = self.thread.ident

    def drain(self, work=None):
        """Waits until every call queued so far is done (given `work`, until
        that call is), running them here, in order, while the lane's thread
        has not taken them."""
        while True:
            with self.lock:
                if work._done if work is not None else not self.queued:
                    return
                item = self._take()
                if item is None:
                    self.waiting += 1
                    try:
                        self.cond.wait()
                    finally:
                        self.waiting -= 1
                    continue
            self._call(item)

    def await_done(self, work, timeout=None):
        """True once `work` is done, run by whoever runs it; False when
        timeout (seconds, None for ever) passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            self.waiting += 1
            try:
                while not work._done:
                    if deadline is None:
                        self.cond.wait()
                    else:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return False
                        self.cond.wait(left)
            finally:
                self.waiting -= 1
        return True

    def run_if_idle(self, fn, *args):
        """fn(*args) now, on this thread, when the lane runs and holds
        nothing (so it keeps its order); returns its result, or None
        without calling it."""
        with self.lock:
            if self.running or self.queue:
                return None
            self.running = True
        try:
            return fn(*args)
        finally:
            with self.lock:
                self.running = False
                if self.queue or self.waiting:   # NOTE [ A finished call wakes only who needs it ]
                    self.cond.notify_all()

    def _take(self):
        """The next call, now marked running; None while one runs (the
        caller holds cond)."""
        if self.running or not self.queue or self.queue[0] is None:
            return None
        self.running = True
        return self.queue.pop(0)

    def _call(self, item):
        work, fn, args, keep = item
        exc = None
        try:
            try:
                fn(*args, self.timeout)
            except BaseException as e:  # reported through the Work
                exc = e
            # nothing of a finished call is held until the next one
            del fn, args, keep, item
            if work.profiler_events is not None:
                _end_events(work)
        finally:
            with self.lock:   # NOTE [ A call's end ]
                work._exc = exc
                work._done = True
                fut = work._future
                self.running = False
                self.queued -= 1
                if self.queue or self.waiting:   # NOTE [ A finished call wakes only who needs it ]
                    self.cond.notify_all()
        if fut is not None:   # NOTE [ Callbacks that call again ]
            work.settle(fut)

    # post(work_type, result, fn, args, keep, small): put() of fn(*args,
    # timeout) with its Work, which is made there: the lane's spare when
    # only the lane holds it, else a new work_type(result) (NOTE [ A Work
    # used again ]); returns the Work.  wait_for(work): until `work` (a
    # call of this lane) is done, running it there when it is next and
    # nobody runs it (NOTE [ A waiter runs its own call ]).  Both in C
    # (NOTE [ A lane's hot path in C ]).

    def _end_events(self, work):
        """For wait_for: ends the profiler's events of work's call."""
        _end_events(work)

    def ended(self, work, exc):
        """Marks `work`, a call of this lane that is not queued, done (its
        Work.end); returns its future when one was asked for before."""
        _end_events(work)
        with self.lock:
            work._exc = exc
            work._done = True
            if self.waiting:
                self.cond.notify_all()
            return work._future

    def _loop(self):
        seen, last = 0, -self.IDLE_S   # small_puts when last seen moving, and when
        while True:
            with self.lock:
                while True:
                    if self.queue and self.queue[0] is None and not self.running:
                        return
                    item = self._take()
                    if item is not None:
                        break
                    now = time.monotonic()
                    if self.small_puts != seen:
                        seen, last = self.small_puts, now
                    self.polling = now - last < self.IDLE_S
                    if self.polling:
                        self.cond.wait(self.POLL_S)
                    elif self.spare is None:
                        self.cond.wait()
                    elif not self.cond.wait(self.IDLE_S) and not self.queue:
                        # idle: the spare Work goes with its last call's tensors
                        spare, self.spare = self.spare, None
                        self.lock.release()
                        try:
                            del spare
                        finally:
                            self.lock.acquire()
                    self.polling = False
            self._call(item)

    def stop(self):
        """Stops the thread after what is queued."""
        with self.lock:
            self.spare = None
            if self.thread is None:
                return
            self.queue.append(None)
            self.cond.notify_all()
        self.thread.join()
        self.thread = self.ident = None


class ShmGroup:
    """This rank's shared-memory group, and the threads that run its
    asynchronous calls.

    NOTE [ Lanes ]
    Collectives asked for with async_op run on one thread, in the order
    asked for, as every rank must call them.  Point-to-point calls have
    lanes of their own: receives one thread, sends one thread per
    destination.  A send larger than the mailbox waits for the peer's
    receive, so a rank that posts irecv before isend (batch_isend_irecv,
    a pipeline's exchange) would otherwise wait for its own send behind
    its receive while the peer does the same.  Messages to one rank stay in
    order, and so do receives; the core lets one collective, one receive
    and sends to different ranks wait at once (NOTE [ Mailboxes ] in
    coll.c)."""

    work_type = Work  # what run() returns for async_op (the backend's has torch's base)
    COLLECTIVES = "mpcore-collectives"
    SMALL = _Lane.SMALL   # a call of at most these bytes is small to a lane

    def __init__(self, core, rank, world, timeout_s):
        self.core = core
        self.rank = rank
        self.world = world
        self.timeout = timeout_s
        self.lanes = {}
        self._lanes_lock = threading.Lock()
        # The collectives' lane, made with the group (its thread starts at
        # its first call), and its post bound once: the fast paths of
        # torch's functions queue by shm.post(work_type, result, fn, args,
        # keep, small) and look at shm.collectives.queued, where a lookup
        # of the lane and a helper's frame cost a tenth of an async call
        # over a blocking one (NOTE [ Asynchronous calls on the fast path ]
        # in _fastpath.py).
        self.collectives = self.lane(self.COLLECTIVES)
        self.post = self.collectives.post

    def set_timeout(self, seconds):
        """The timeout of every call from now on, queued ones included."""
        with self._lanes_lock:
            self.timeout = seconds
            for lane in self.lanes.values():
                lane.timeout = seconds

    def lane(self, name):
        lane = self.lanes.get(name)
        if lane is None:
            with self._lanes_lock:
                lane = self.lanes.setdefault(name, _Lane(name, self.timeout))
        return lane

    def run(self, async_op, tensors, fn, *args, keep=(), work=None, lane=COLLECTIVES):
        """fn(*args, timeout) now (after the collectives queued), or on the
        thread of `lane` when async_op; returns a Work for async_op (`work`,
        or a new one), which holds `tensors` (its result) and `keep` (what
        fn reads: the caller may drop them) until fn is done."""
        if not async_op:
            if self.collectives.queued:
                self.drain()
            fn(*args, self.timeout)
            return None
        if work is None:
            work = self.work_type(tensors)
        work.lane = self.lane(lane)
        work.lane.put((work, fn, args, keep), _nbytes(tensors) <= _Lane.SMALL)
        return work

    def drain(self):
        """Waits for the collectives queued so far."""
        self.collectives.drain()

    def close(self):
        """Stops the group's threads (after what is queued) and unmaps the
        region."""
        with self._lanes_lock:
            lanes, self.lanes = list(self.lanes.values()), {}
        for lane in lanes:
            lane.stop()
        self.core.close()


def join(store, prefix, rank, world, timeout_s):
    """The shared-memory group of this job's ranks, or None when they are
    not all on this machine (NOTE [ Rendezvous ])."""
    store.set(f"{prefix}host/{rank}", _host_id())
    hosts = {store.get(f"{prefix}host/{r}").decode() for r in range(world)}
    if len(hosts) != 1 or world > REGION_MAX:   # NOTE [ More ranks than a region holds ]
        return None
    direct = os.environ.get("MPCORE_DIRECT_COPY", "1") != "0"
    if rank == 0:
        fd = _core.coll_create(world, _CHUNK)
        try:
            core = _core.Group(fd, 0, world, direct)
            store.set(f"{prefix}region", f"{os.getpid()}:{fd}")
            core.barrier(timeout_s)  # everyone has mapped it
        finally:
            os.close(fd)
    else:
        pid, fd = map(int, store.get(f"{prefix}region").decode().split(":"))
        mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            core = _core.Group(mine, rank, world, direct)
        finally:
            os.close(mine)
        core.barrier(timeout_s)
    core.watch()
    return ShmGroup(core, rank, world, timeout_s)
