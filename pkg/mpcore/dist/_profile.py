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
# read from gloo's own runs (_EVENTS; tests/distributed/test_dispatch_parity.py
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
# c10d's own ops (c10d::allreduce_ and the like, which torch's C++
# ProcessGroup dispatches on its way to a gloo Backend, and which dispatch
# modes such as CommDebugMode count) are NOTE [ Observed calls go through
# the dispatcher ] below.  What is not there: the Flight Recorder (NOTE
# [ The Flight Recorder ] in _recorder.py).
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
    "_reduce_scatter_base": _one(1),
    # one all-reduce per input of the block (gloo reduces each pair as _reduce_scatter_base)
    "reduce_scatter_tensor_coalesced": lambda args: [("all_reduce", [t]) for t in args[1]],
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
modes = _torchapi.get("torch._C._len_torch_dispatch_stack")   # dispatch modes on the thread
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


def recorded_as(name, called=None):
    """A decorator: the method's calls recorded as `name`'s (NOTE
    [ Collectives in the profiler ]), for the methods torch reaches by
    other names (`called`: the name the group's attribute has), and
    barrier."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if profiling() or modes():
                return observed(self, name, method, args, kwargs, called)
            return method(self, *args, **kwargs)
        return call
    return wrap


# --- calls seen through torch's dispatcher ---------------------------------------------
# NOTE [ Observed calls go through the dispatcher ]
# On gloo, dist.all_reduce calls the C++ ProcessGroup's allreduce, which
# dispatches c10d::allreduce_ (with the group and a c10d ReduceOp as
# TorchScript objects) to its CPU kernel, which calls the group's gloo
# Backend.  Dispatch modes see that op (CommDebugMode counts it under
# torch.ops.c10d.allreduce_, as torch's test_comm_mode.py checks; DebugMode
# logs it; FakeTensorMode serves it with its meta kernel) and the profiler
# records "c10d::allreduce_" around gloo's own "gloo:all_reduce".  torch's
# Python calls the group's methods directly, so a group kept in Python is
# seen by none of that, and torch cannot give it the C++ way: a Backend has
# no constructor in Python on this torch ("No constructor defined"), and
# c10d's CPU kernels ask the group for one ("No backend type associated
# with device type cpu" for a group without; torch 2.14 makes a Backend
# constructible in Python, 2.6 to 2.13 do not, so that way in is not
# taken: the one below works on all of them).  c10d's ops do take a
# Python group, boxed (ProcessGroup.boxed()); its ReduceOp can be made in
# Python only as SUM (torch.classes.c10d.ReduceOp has no other
# constructor, and a torch.distributed.ReduceOp is refused).
# So while something observes the call on this thread (torch's profiler
# runs, or a dispatch mode is on the stack: one more check per call,
# _len_torch_dispatch_stack, 50 ns), a group method with a region goes
# the C++ way: it calls torch's C++ ProcessGroup method of its own name on
# itself (pybind11 skips the Python override when the caller's frame is
# the override's namesake with the same self: _forward), which builds the
# op's arguments as for gloo and dispatches the op; what observes sees it,
# and the op reaches its CPU kernel under the Python dispatcher (turned on
# for that call only, on this thread), where this module put a Python
# kernel for the CPU (and SparseCPU for all_reduce) key: for an mpcore
# group it calls the group's method with the op's tensors and the caller's
# own options (kept on the thread: a PREMUL_SUM's factor does not survive
# c10d's ReduceOp; an op reached otherwise gets options made of its
# arguments, read by name, since they differ from torch to torch), served
# at once (inside.serving) and recorded in the profiler as before; any
# other group goes on to torch's C++ kernel.  Fake tensors never reach it:
# FakeTensorMode answers with c10d's meta kernel and a FakeWork, as for
# gloo (before, the group's method took a fake tensor's address to the
# core, and the program died of SIGSEGV).
# The Work comes back to the caller through torch's C++ (boxed); the
# thread holds it until then, since torch keeps only its C++ part.  Three
# pairs of names call each other in torch's C++ (alltoall_base and
# all_to_all_single, allgather_into_tensor_coalesced and
# all_gather_single_coalesced, reduce_scatter_tensor_coalesced and
# reduce_scatter_single_coalesced), and the group overrides both, so
# there the op is called from Python as torch's C++ calls it (_direct),
# the reduce-scatter's reduction other than SUM made by torch's C++ (NOTE
# [ c10d's ReduceOp of another kind ] below; a PREMUL_SUM stays direct,
# unseen).  monitored_barrier goes through its op too (NOTE
# [ monitored_barrier observed ] below).  Not routed: CUDA tensors
# (torch's NCCL group dispatches its own ops),
# a group without a region (gloo's group underneath dispatches them).  A
# torch whose C++ method calls the same name back (the namesake skip not
# working) is noticed at the second call of one name: the call is served
# directly, routing stops, and the table says why.  Unobserved calls take
# the direct way as before.  Measured: CommDebugMode's counts and the
# profiler's c10d:: events of every dist.* collective and point-to-point
# call equal gloo's on torch 2.6.0, 2.13.0 and 2.14.1 (on 2.6, gloo
# itself lacks reduce_scatter and all_to_all, which mpcore serves and
# which are counted under their c10d ops).  The cost unobserved is the
# one check: the wrapper's condition alone takes 113 ns where the profiler
# check alone took 67 (best of 31 runs of 200,000, alternating); a 4 KB
# all_reduce through the group's method on a group of one rank, best of
# 41 runs alternating with the wrapper before: 5.95 and 5.84 us against
# 5.93 and 5.76 us (two runs at load 3.5 on two cores); allreduce_layers.py,
# the wrapper's layer (method over method body) at load 4.6: 0.43 and
# 0.50 us against 0.26 and 0.27 before, runs alternating (noisier: its
# levels move by 0.3 us from run to run).  dist.all_reduce itself takes
# the fast path unobserved (NOTE [ The rest of torch's collectives ] in
# _fastpath.py), which this does not touch.

# c10d's op -> (the group's method, the op's arguments after the group that
# the method takes before its options, its options' class): the method is
# called with the op's tensors (its arguments before the group), those, and
# options made of the op's arguments of _FIELDS' names (which differ from
# torch to torch: each is read by name where the op has it)
_OPS = {
    "allreduce_": ("allreduce", (), "AllreduceOptions"),
    "allreduce_coalesced_": ("allreduce_coalesced", (), "AllreduceCoalescedOptions"),
    "reduce_": ("reduce", (), "ReduceOptions"),
    "broadcast_": ("broadcast", (), "BroadcastOptions"),
    "allgather_": ("allgather", (), "AllgatherOptions"),
    "_allgather_base_": ("_allgather_base", (), "AllgatherOptions"),
    "allgather_coalesced_": ("allgather_coalesced", (), "AllgatherOptions"),
    "allgather_into_tensor_coalesced_": ("allgather_into_tensor_coalesced", (),
                                         "AllgatherOptions"),
    "reduce_scatter_": ("reduce_scatter", (), "ReduceScatterOptions"),
    "_reduce_scatter_base_": ("_reduce_scatter_base", (), "ReduceScatterOptions"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", (),
                                         "ReduceScatterOptions"),
    "gather_": ("gather", (), "GatherOptions"),
    "scatter_": ("scatter", (), "ScatterOptions"),
    "alltoall_": ("alltoall", (), "AllToAllOptions"),
    "alltoall_base_": ("alltoall_base", ("output_split_sizes", "input_split_sizes"),
                       "AllToAllOptions"),
    "barrier": ("barrier", (), "BarrierOptions"),
    "send": ("send", ("dst", "tag"), None),
    "recv_": ("recv", ("src", "tag"), None),
    "recv_any_source_": ("recv_anysource", ("tag",), None),
}
# option -> c10d's argument of it
_FIELDS = {"reduceOp": "reduce_op", "sparseIndices": "sparse_indices", "rootRank": "root_rank",
           "rootTensor": "root_tensor", "asyncOp": "async_op", "timeout": "timeout",
           "device_ids": "device_ids"}
# torch's other names for the group's methods (its C++ method of one name calls the other's)
_ALIASES = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
            "all_to_all_single": "alltoall_base",
            "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
            "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced"}
_routes = None      # the group's method -> c10d's op it serves, once installed ({}: none)
_forwards = {}      # name -> _forward(name)
_base = None        # torch's C++ ProcessGroup
_install_lock = threading.Lock()
_group_type = None  # ProcessGroupMpcore, once installed


def observed(self, name, method, args, kwargs=None, called=None):
    """method(self, *args, **kwargs), the group's attribute `called` (by
    default the method's name), as gloo's group serves it while something
    observes (NOTE [ Observed calls go through the dispatcher ]): through
    c10d's op, whose CPU kernel comes back to the group (_kernel); recorded
    in the profiler as gloo records it."""
    if _routes is None:
        with _install_lock:     # once, whichever thread comes first
            if _routes is None:
                _install_routes(type(self))
    called = called or method.__name__
    route = (_forward(called) if self.shm is not None
             and (called in _routes or _ALIASES.get(called) in _routes) else None)
    if kwargs:
        if route is not None and set(kwargs) == {"opts"}:
            args, kwargs = tuple(args) + (kwargs["opts"],), None
        else:
            route = None
    if route is not None and called in _DIRECT:
        route = _direct(called, method, args, self)
    call = getattr(inside, "call", None)
    if route is None or getattr(inside, "serving", 0):
        if profiling():
            return profiled(self, name, method, args, kwargs or {})
        return method(self, *args, **(kwargs or {}))
    if call is not None and call[0] is self:
        # torch's C++ method, on its way to the op, called another of the
        # group's methods (one name calling the other): its C++ too, once
        # per name.  A name called again means torch's C++ could not be
        # reached past the override (a pybind11 that skips no namesake):
        # no call is routed from then on, and this one is served here.
        if called in call[3]:
            _routes.clear()
            _torchapi.mark("torch._C._distributed_c10d.ProcessGroup", "wrong shape",
                           "its methods call the group's Python overrides back")
            return method(self, *args, **(kwargs or {}))
        call[3].add(called)
        return route(self, *args)
    outer = call, getattr(inside, "held", None)
    inside.call, inside.held = (self, method.__name__, args, {called}), []
    try:
        with _python_dispatcher():
            return route(self, *args)
    finally:
        inside.call, inside.held = outer


# The pairs of names whose C++ methods call each other's name: torch's C++
# ProcessGroup cannot be reached past the group's Python overrides of both,
# so the op is called here, as torch's C++ calls it (c10d's ReduceOp can be
# made in Python only as SUM: another reduction stays direct).
_DIRECT = {"alltoall_base": "alltoall_base_", "all_to_all_single": "alltoall_base_",
           "allgather_into_tensor_coalesced": "allgather_into_tensor_coalesced_",
           "all_gather_single_coalesced": "allgather_into_tensor_coalesced_",
           "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced_",
           "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced_"}


def _direct(called, method, args, pg):
    """A route that calls c10d's op of `called` on group pg itself; None
    where it cannot."""
    import torch.distributed as dist
    op_name = _DIRECT[called]
    op = _torchapi.find(f"torch.ops.c10d.{op_name}.default")
    if op is None:
        return None
    n = 4 if op_name == "alltoall_base_" else 2    # the method's arguments before its options
    opts = args[n] if len(args) > n else None
    if opts is None:
        opts = _torchapi.get("torch._C._distributed_c10d.AllgatherOptions")() \
            if op_name.startswith("allgather") else getattr(
                dist, "AllToAllOptions" if op_name.startswith("alltoall")
                else "ReduceScatterOptions")()
    values = {"async_op": opts.asyncOp, "timeout": int(opts.timeout / _MS)}
    if op_name == "alltoall_base_":
        values.update(output=args[0], input=args[1], output_split_sizes=list(args[2]),
                      input_split_sizes=list(args[3]))
    else:
        values.update(outputs=list(args[0]), inputs=list(args[1]))
        if op_name == "reduce_scatter_tensor_coalesced_":
            kind = opts.reduceOp.op
            if kind == dist.ReduceOp.SUM:
                values["reduce_op"] = _torchapi.get("torch.classes.c10d.ReduceOp")()
            else:   # NOTE [ c10d's ReduceOp of another kind ]
                values["reduce_op"] = _script_reduce_op(pg, kind)
                if values["reduce_op"] is None:
                    return None
    names = [a.name for a in op._schema.arguments]
    if any(a.name not in values and a.name != "process_group" and not a.has_default_value()
           for a in op._schema.arguments):
        return None     # an op of another shape: the call stays direct

    def route(pg, *_):
        values["process_group"] = pg.boxed()
        return _unbox_work(op(**{k: values[k] for k in names if k in values}))
    return route


def _unbox_work(so):
    return None if so is None else _unbox_w(so)


def _forward(name):
    """A function named `name` that calls torch's C++ ProcessGroup method
    of that name on the group (None when torch has none, or its op has no
    kernel here): pybind11 calls the C++ class's own method, not the
    group's Python override, when the caller's frame is the override's
    namesake with the same self."""
    f = _forwards.get(name, False)
    if f is not False:
        return f
    base = getattr(_base, name, None)
    if base is None or not callable(base):
        f = None
    else:
        def forward(self, *args):
            return base(self, *args)
        forward.__code__ = forward.__code__.replace(co_name=name)
        forward.__name__ = forward.__qualname__ = name
        f = forward
    _forwards[name] = f
    return f


def _install_routes(group_type):
    """Puts a CPU kernel for the group in each c10d op's Python kernels
    (served only while the Python dispatcher runs, which observed() turns
    on); {} where this torch cannot take them (the calls then stay direct)."""
    global _routes, _python_dispatcher, _unbox, _boxed, _unbox_w, _group_type, _base, _MS
    _routes, _group_type = {}, group_type
    if not _torchapi.serves("observed collectives"):
        return _routes
    import torch.distributed as dist
    _python_dispatcher = _torchapi.get("torch._dispatch.python.enable_python_dispatcher")
    _unbox = _torchapi.get("torch._C._distributed_c10d.ProcessGroup.unbox")
    _boxed = _torchapi.get("torch._C._distributed_c10d.Work.boxed")
    _unbox_w = _torchapi.get("torch._C._distributed_c10d.Work.unbox")
    import datetime
    _MS = datetime.timedelta(milliseconds=1)
    keys = _torchapi.get("torch._C.DispatchKey")
    base = _base = _torchapi.get("torch._C._distributed_c10d.ProcessGroup")
    routes = {}
    for op_name, (method, extra, cls) in _OPS.items():
        op = _torchapi.find(f"torch.ops.c10d.{op_name}.default")
        if op is None or not hasattr(base, method):
            continue     # this torch lacks the op: the calls stay direct
        names = [a.name for a in op._schema.arguments]
        if "process_group" not in names:
            continue
        opts = getattr(dist, cls, None) if cls else None
        if cls and opts is None:
            opts = _torchapi.get("torch._C._distributed_c10d.AllgatherOptions")
        op_keys = [keys.CPU] + ([keys.SparseCPU] if op_name == "allreduce_" else [])
        if any(k in op.py_kernels for k in op_keys):
            continue     # torch's own Python kernel: the calls stay direct
        if any(n not in names for n in extra):
            continue
        serve = _kernel(op, method, names, extra, opts)
        for k in op_keys:
            op.py_impl(k)(serve(k))
        routes[method] = op_name
    _routes = routes
    return routes


def _red(so):
    """torch's ReduceOp of c10d's ReduceOp script object."""
    import torch.distributed as dist
    v = so.op()
    kind = dist.ReduceOp.RedOpType(v)
    if kind == dist.ReduceOp.PREMUL_SUM:
        raise ValueError("mpcore: a PREMUL_SUM ReduceOp reached the backend through c10d's op "
                         "without its factor, which torch keeps from Python")
    return dist.ReduceOp(kind)


def _kernel(op, method, names, extra, opts_cls):
    """serve(key) -> the kernel of c10d's `op` for dispatch key `key`: for
    an mpcore group, the group's `method` with the op's arguments (and the
    caller's options, when the group's own call led here); for any other
    group, torch's C++ kernel."""
    import datetime
    schema = op._schema.arguments
    at = names.index("process_group")
    lead = 0 if method == "barrier" else at     # barrier's tensor is torch's, not the call's
    pos = list(range(lead)) + [names.index(n) for n in extra]
    fields = {f: names.index(n) for f, n in _FIELDS.items() if n in names}
    pair = len(op._schema.returns) == 2

    def arguments(a, kw):
        if len(a) < len(schema) or kw:
            a = list(a) + [kw.get(s.name, s.default_value) for s in schema[len(a):]]
        return a

    def serve(key):
        def kernel(*a, **kw):
            pg = _unbox(a[at]) if len(a) > at else None
            if type(pg) is not _group_type:
                return op._op_dk(key, *a, **kw)
            a = arguments(a, kw)
            taken = getattr(inside, "capture", None)
            if taken is not None and "reduce_op" in names:
                taken.append(a[names.index("reduce_op")])   # _script_reduce_op's call
                raise _Captured()
            margs = [a[i] for i in pos]
            if opts_cls is not None:
                call = getattr(inside, "call", None)
                if (call is not None and call[0] is pg and call[1] == method
                        and len(call[2]) > len(pos)):
                    o = call[2][len(pos)]     # the caller's own options
                else:
                    o = opts_cls()
                    for f, i in fields.items():
                        v = a[i]
                        if f == "reduceOp":
                            v = _red(v)
                        elif f == "timeout":
                            if v is None or v < 0:
                                continue
                            v = datetime.timedelta(milliseconds=v)
                        elif f == "device_ids":
                            v = list(v)
                        if hasattr(o, f):
                            setattr(o, f, v)
                margs.append(o)
            inside.serving = getattr(inside, "serving", 0) + 1
            try:
                work = getattr(pg, method)(*margs)
            finally:
                inside.serving -= 1
            if work is None:
                return (a[0], None) if pair else None
            held = getattr(inside, "held", None)
            if held is not None:
                held.append(work)   # alive until torch's C++ hands it back to the caller
            boxed = _boxed(work)
            return (a[0], boxed) if pair else boxed
        return kernel
    return serve


# NOTE [ monitored_barrier observed ]
# gloo's monitored_barrier is c10d::monitored_barrier_ (torch's C++
# ProcessGroup makes an empty CPU tensor and dispatches the op with the
# group, [] device ids, the timeout in ms and wait_all_ranks), whose CPU
# kernel runs gloo's protocol over send and recv: the profiler records
# the op (one synchronous event, input shapes [[0], [], [], [], []]) and
# gloo's "gloo:recv" and "gloo:send" events (asynchronous, input [[1]]):
# on rank 0 a recv from each other rank and then a send to each, on the
# others a send and a recv.  CommDebugMode counts nothing (the op is not
# among the collectives it counts); DebugMode logs the op.  The group's
# own protocol moves its messages through the store (NOTE
# [ monitored_barrier's protocol ] in _group.py), so while something
# observes the call it dispatches the op itself, as torch's C++ would, and
# a Python kernel for its CPU key (under the Python dispatcher) runs the
# protocol, recording gloo's send and recv events while the profiler runs.
# Unobserved, the call is the group's protocol alone, as before.
def monitored(method):
    """A decorator for the group's monitored_barrier(timeout,
    wait_all_ranks): observed, the call goes through c10d's op (NOTE
    [ monitored_barrier observed ])."""
    @functools.wraps(method)
    def call(self, timeout=None, wait_all_ranks=False):
        if ((profiling() or modes()) and self.shm is not None
                and not getattr(inside, "serving", 0)):
            op = _monitored_op(type(self), method)
            if op is not None:
                seconds = (self.timeout_s if timeout is None else timeout.total_seconds()
                           if hasattr(timeout, "total_seconds") else float(timeout))
                with _python_dispatcher():
                    op(torch.empty(0), self.boxed(), [], int(round(seconds * 1000)),
                       bool(wait_all_ranks))
                return None
        return method(self, timeout, wait_all_ranks)
    return call


_monitored = None    # c10d's monitored_barrier_ op, once its kernel is in (False: none)


def _monitored_op(group_type, method):
    """c10d's monitored_barrier_ op with mpcore's CPU kernel in, or None
    where this torch cannot take it."""
    global _monitored
    if _monitored is None:
        with _install_lock:
            if _routes is None:
                _install_routes(group_type)
            if _monitored is None:
                _monitored = _install_monitored(method) or False
    return _monitored or None


def _install_monitored(method):
    """Puts the group's kernel for c10d's monitored_barrier_ CPU key in;
    returns the op, or None (NOTE [ monitored_barrier observed ])."""
    if not _torchapi.serves("observed collectives"):
        return None
    op = _torchapi.find("torch.ops.c10d.monitored_barrier_.default")
    if op is None or "process_group" not in [a.name for a in op._schema.arguments]:
        return None
    cpu = _torchapi.get("torch._C.DispatchKey").CPU
    if cpu in op.py_kernels:
        return None     # torch's own Python kernel: the calls stay direct
    import datetime

    def kernel(tensor, process_group, device_ids, timeout, wait_all_ranks):
        pg = _unbox(process_group)
        if type(pg) is not _group_type:
            return op._op_dk(cpu, tensor, process_group, device_ids, timeout, wait_all_ranks)
        events = None
        if profiling() and _torchapi.serves("profiler events"):
            _load_record()
            one = torch.empty(1)
            prefix = _backend_name(pg) + ":"
            peers = pg.world - 1
            order = (["recv"] * peers + ["send"] * peers) if pg.my_rank == 0 else ["send", "recv"]
            events = _Events([(prefix + name, [one]) for name in order]) if peers else None
        inside.serving = getattr(inside, "serving", 0) + 1
        try:
            method(pg, None if timeout is None or timeout < 0
                   else datetime.timedelta(milliseconds=timeout), wait_all_ranks)
        finally:
            inside.serving -= 1
            if events is not None:
                events.end()
    op.py_impl(cpu)(kernel)
    return op


def _load_record():
    """record_function's entry and the end tied to a future, read once."""
    global _record
    if _record is None:
        _record = (_torchapi.get("torch._C._autograd._record_function_with_args_enter"),
                   _torchapi.get("torch.ops.profiler._call_end_callbacks_on_jit_fut")
                   ._RecordFunction)


# NOTE [ c10d's ReduceOp of another kind ]
# c10d's ops take their reduction as a TorchScript object
# (torch.classes.c10d.ReduceOp), which Python can make only as SUM; torch's
# C++ ProcessGroup methods make it of any kind from their options.  The
# reduce-scatter of a coalesced block is called from Python here (_direct),
# so for another reduction the object is taken from torch's C++ once per
# kind and kept: an all_reduce of an empty tensor with that reduction goes
# through torch's C++ ProcessGroup method on the group (_forward), which
# makes the object and dispatches c10d's allreduce_ to this module's kernel;
# the kernel, seeing the capture asked for on the thread, keeps the object
# and raises before anything reaches the group (no collective is made, on
# this rank or any other).  Nothing observes that call: dispatch modes are
# set aside for it, and the profiler's record functions are off for its
# duration (they are turned back on after it, as the profiler that is
# running had them).  A PREMUL_SUM, whose factor lives in the object,
# stays direct.  Measured: a coalesced reduce_scatter_tensor with MAX,
# MIN, PRODUCT or AVG under CommDebugMode counts c10d's
# reduce_scatter_tensor_coalesced_ once, as gloo's does, where it counted
# _reduce_scatter_base_ before (the parts of the block, each routed).
class _Captured(Exception):
    """Raised by a kernel once it kept the reduction _script_reduce_op asked for."""


_REDUCE_OPS = {}    # RedOpType -> c10d's ReduceOp object of that kind (None: cannot)


def _script_reduce_op(pg, kind):
    """c10d's ReduceOp object of reduction `kind` (a ReduceOp.RedOpType),
    taken from torch's C++ through group pg, or None where it cannot be
    (NOTE [ c10d's ReduceOp of another kind ])."""
    import torch.distributed as dist
    if kind in _REDUCE_OPS:
        return _REDUCE_OPS[kind]
    so = None
    forward = _forward("allreduce")
    enable = _torchapi.find("torch._C._autograd._enable_record_function")
    no_modes = _torchapi.find("torch.utils._python_dispatch._disable_current_modes")
    if (kind != dist.ReduceOp.PREMUL_SUM and forward is not None and "allreduce" in _routes
            and enable is not None and no_modes is not None):
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(kind)
        outer = getattr(inside, "capture", None)
        inside.capture = taken = []
        recording = profiling()
        try:
            with no_modes():
                if recording:
                    enable(False)
                try:
                    with _python_dispatcher():
                        forward(pg, [torch.empty(0)], opts)
                except Exception:   # _Captured, as torch's C++ hands it back
                    pass
                finally:
                    if recording:
                        enable(True)
        finally:
            inside.capture = outer
        so = taken[0] if taken else None
    _REDUCE_OPS[kind] = so
    return so
