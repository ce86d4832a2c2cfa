"""Collectives in torch's profiler: the events gloo records for each call,
recorded by the group's methods while the profiler runs (NOTE
[ Collectives in the profiler ])."""
import functools
import os
import queue
import threading

import torch

from .. import _torchapi

# NOTE [ Collectives in the profiler ]
# gloo's Work records an event in torch's profiler for every call, named
# "gloo:" and the operation, with the call's input tensors (their shapes
# under record_shapes), begun when the call is made and ended by gloo's
# thread when the call completes, so that torch marks it asynchronous.
# torch's own tests look them up by dist.get_backend() + ":" + the name
# (test_distributed_spawn's call_dist_op and p2p tests: count, shapes,
# is_async), and trace tools read them.  A Work made in Python records
# nothing, so the group records them itself while torch's profiler runs
# on the calling thread, one check per call otherwise: what gloo records,
# read from gloo's own runs (_EVENTS; tests/test_dispatch_parity.py
# compares the two), named by the backend torch reports for the group
# ("gloo" for a program that asked for gloo, "mpcore" for one that named
# mpcore).  An event is begun by record_function's entry with the inputs;
# its end is tied to a future (record_function's way for asynchronous
# calls, which carries the profiler's thread state), and _ender's thread
# completes that future: an event ended on another thread is asynchronous
# to torch, as gloo's are.  The end comes before the call is seen done:
# a call done on return is ended before it returns, and a Work made during
# the call ends its events when it completes, before its waiters wake, so
# that a profile closed right after wait() holds the whole event.  Calls a
# recorded call makes of the group's own methods (the parts of a coalesced
# call) record nothing of their own, as gloo's one event per call.  A
# group without a region (NOTE [ What the core cannot serve ]) is gloo's
# own underneath, and gloo records those.
# What is not there: the dispatcher's c10d::allreduce_ and the like,
# which torch's C++ ProcessGroup emits on its way to a gloo Backend, and
# which dispatch modes (CommDebugMode) count.  dist.* calls reach a group
# kept in Python by its methods directly, and c10d's ops cannot take one:
# they refuse a Python ProcessGroup and a ReduceOp made in Python, and
# their CPU kernels ask the group for a C++ Backend, which cannot be made
# from Python.  So a dispatch mode sees the functional collectives
# (_c10d_functional's ops, which reach the group through the dispatcher:
# NOTE [ Fast paths nobody sees ] in _fastpath.py) but not dist.* calls,
# as for any group torch keeps in Python.  Nor the flight recorder: gloo
# records its calls there from C++ (TORCH_FR_BUFFER_SIZE), and torch has
# no way to record an entry from Python (torchcomms' FlightRecorderHook
# is a package of its own), so _dump_fr_trace lists none of mpcore's.
# record_param_comms, which torch's NCCL emits, gloo does not on the CPU.

def _ins(i):
    return lambda args: [("", args[i])]


def _one(i):
    return lambda args: [("", [args[i]])]


# method -> the events gloo records for a call: f(args) -> [(name, input tensors)],
# the name "" being the method's own (_TITLES)
_EVENTS = {
    "allreduce": _ins(0), "allreduce_coalesced": _ins(0), "reduce": _ins(0),
    "broadcast": _ins(0), "allgather": _ins(1), "_allgather_base": _one(1),
    "allgather_coalesced": _ins(1), "allgather_into_tensor_coalesced": _ins(1),
    # one all-reduce per rank's input (gloo reduces each and keeps its own)
    "reduce_scatter": lambda args: [("all_reduce", [t]) for t in args[1][0]],
    "_reduce_scatter_base": _one(1), "reduce_scatter_tensor_coalesced": _ins(1),
    "gather": _ins(1), "scatter": lambda args: [("", args[1][0] if args[1] else [])],
    "alltoall_base": _one(1), "alltoall": _ins(1), "barrier": lambda args: [("", [])],
    "send": _ins(0), "recv": _ins(0), "recv_anysource": _ins(0),
}
_TITLES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "reduce": "reduce",
    "broadcast": "broadcast", "allgather": "all_gather", "_allgather_base": "all_gather",
    "allgather_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "all_reduce", "_reduce_scatter_base": "all_reduce",
    "reduce_scatter_tensor_coalesced": "all_reduce", "gather": "gather", "scatter": "scatter",
    "alltoall_base": "all_to_all", "alltoall": "all_to_all", "barrier": "barrier",
    "send": "send", "recv": "recv", "recv_anysource": "recvAnySource",
}

_WORLD = _torchapi.find(f"{_torchapi.C10D}._world")   # None only outside the torch window
profiling = _torchapi.get("torch._C._autograd._profiler_enabled")
inside = threading.local()   # .on: a recorded call runs on this thread; .events: its _Events
recording = 0                # recorded calls running, in every thread
_recording_lock = threading.Lock()
_record = None                # (record_function's entry, the end tied to a future), once read


class _Events:
    """The profiler's events of one call, begun now; end() ends them, once."""
    __slots__ = ("future", "ended", "claim")

    def __init__(self, names):
        enter, end_on = _record
        self.future = torch.futures.Future()
        self.ended = [end_on(enter(name, *tensors), self.future) for name, tensors in names]
        self.claim = [True]

    def end(self):
        try:
            self.claim.pop()     # atomic: the first caller ends them
        except IndexError:
            return
        _ender.put(self.future)
        for f in self.ended:     # done once the events' ends have run
            f.wait()


class _Ender:
    """The thread that completes events' futures, so that their ends run
    on a thread other than the caller's (NOTE [ Collectives in the profiler ])."""

    def __init__(self):
        self._queue = None
        self._lock = threading.Lock()

    def put(self, future):
        q = self._queue
        if q is None:
            with self._lock:
                if self._queue is None:
                    q = queue.SimpleQueue()
                    threading.Thread(target=self._loop, args=(q,), name="mpcore-profiler",
                                     daemon=True).start()
                    self._queue = q
                q = self._queue
        q.put(future)

    @staticmethod
    def _loop(q):
        while True:
            q.get().set_result(None)

    def _after_fork(self):
        self._queue, self._lock = None, threading.Lock()


_ender = _Ender()
os.register_at_fork(after_in_child=_ender._after_fork)


def _backend_name(pg):
    """The name torch reports for pg's backend (dist.get_backend), its CPU
    one for a device map."""
    entry = _WORLD.pg_map.get(pg)
    name = str(entry[0]) if entry else "mpcore"
    for pair in name.split(","):
        if pair.startswith("cpu:"):
            return pair[4:]
    return name


def profiled(self, name, method, args, kwargs):
    """method(self, *args, **kwargs), recorded in torch's profiler as gloo
    records the call (NOTE [ Collectives in the profiler ])."""
    global _record, recording
    if getattr(inside, "on", False):   # a part of a recorded call
        events, inside.events = inside.events, None
        try:
            return method(self, *args, **kwargs)
        finally:
            inside.events = events
    if self.shm is None or not _torchapi.serves("profiler events"):
        return method(self, *args, **kwargs)
    if _record is None:
        _record = (_torchapi.get("torch._C._autograd._record_function_with_args_enter"),
                   _torchapi.get("torch.ops.profiler._call_end_callbacks_on_jit_fut")
                   ._RecordFunction)
    prefix = _backend_name(self) + ":"
    try:
        names = [(prefix + (title or _TITLES[name]), list(tensors))
                 for title, tensors in _EVENTS[name](args)]
    except (IndexError, TypeError):   # arguments of another shape: the event, without inputs
        names = [(prefix + _TITLES[name], [])]
    events = _Events(names)
    with _recording_lock:
        recording += 1
    inside.on, inside.events = True, events
    try:
        work = method(self, *args, **kwargs)
    except BaseException:
        events.end()
        raise
    finally:
        inside.on, inside.events = False, None
        with _recording_lock:
            recording -= 1
    if getattr(work, "profiler_events", None) is not events:
        events.end()     # done on return, or a Work that does not end them
    return work


def recorded_as(name):
    """A decorator: the method's calls recorded as `name`'s (NOTE
    [ Collectives in the profiler ]), for the methods torch reaches by
    other names, and barrier."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if profiling():
                return profiled(self, name, method, args, kwargs)
            return method(self, *args, **kwargs)
        return call
    return wrap
