"""torch.distributed's send, recv, broadcast, gather, scatter,
all_to_all_single, all_reduce, barrier, all_gather, all_gather_single (or
all_gather_into_tensor), reduce_scatter_single (or reduce_scatter_tensor),
reduce_scatter and all_to_all, and the functional all_reduce,
all_gather_single and reduce_scatter_single, each with a fast path to the
core for an mpcore group, and the functional wait_tensor, with one for
their results.

It stays one module: every fast path reads the same module globals on each
call, among them what observes a call (_compiling, rebound once
torch._dynamo is imported), and split, each part would need a call more
per call or its own rebinding; a third of its length is the notes with
the figures its inline checks are written to.

NOTE [ A fast path for torch's module functions ]
torch's dispatcher is the way into the backend (NOTE [ The backend is a
ProcessGroup ] in _group.py), and torch's module functions are the
exception, for what measurement showed: first six of them (the rest
followed, NOTE [ The rest of torch's collectives ]).  On one rank, with a
4 KB float32 tensor, the core's own gather takes 1.3 us, and torch's
dist.gather 12 us: its checks, its options object, its logging wrapper and
the group's method cost about 10 us, where the same ranks' all-reduce
costs under 6.  dist.recv makes a Work and waits on it, on top of the
receive's 2 us.  The core's broadcast takes 0.4 us, dist.broadcast 7.4.
gloo's own calls being fast at that size (160 to 290 us), these were the
rows that stayed under 30x gloo.

So each function here first looks for the case the core serves as it
stands: the group is mpcore's (the default one when `group` is None) and
has a shared-memory region, the tensors are plain contiguous CPU tensors
(type torch.Tensor, no torch-function mode active), ranks are given as
global ranks of the group, and, for point-to-point calls, the lane that
keeps their order is idle.  Then it calls the core directly, as the
group's method would, and returns what torch's function returns; an
asynchronous call is queued as the group's method queues it (NOTE
[ Asynchronous calls on the fast path ]).  Anything else goes to torch's
function unchanged, which checks the arguments and raises its own errors.
It is given the group (and what follows) by name, as programs pass it:
torch's logging wrapper reads the group from the keywords alone, and on a
group that is gone (destroyed) that reading is what raises torch's "not
initialized" error.  The result never depends on the path: the core's
call is the same one the group's method makes.  Each is installed only where torch's function has
the same parameters (another torch's keeps its own).  Measured after it,
on one rank: dist.gather 4.8 us; on two ranks (`mpcore bench --only
c10d-...-4k`), at 4 KB, world group: gather 53x gloo, scatter 101x,
broadcast 103x, all_to_all_single 57x, a send/recv ping-pong 42x (7x
before; with the core's own p2p made cheaper, NOTE [ Wakes only for
sleepers ] in sync.c).

NOTE [ The rest of torch's collectives ]
A small collective is what latency-bound programs make (metrics and loss
synchronisation, barriers, tensor parallelism on the CPU), and on one rank
at 4 KB the core's own call takes 0.2 to 0.6 us where torch's functions
took 6 to 40 us before reaching it: dist.all_reduce 6.4 us for the core's
0.53 (torch's function 2.5 to 3.2 with its AllreduceOptions, the group's
method 3.0 to 3.5 with reading opts.reduceOp.op and making the Work,
benchmarks/allreduce_layers.py), dist.barrier 5.6 for 0.21, dist.all_gather
of a list 19.5, dist.reduce_scatter of a list 22.7, dist.all_to_all of
lists 41 (CPU time per call, best of 5 runs, `python
benchmarks/fastpath_calls.py`).  On two ranks that put all_reduce 4 KB
and barrier behind Open MPI (`mpcore bench --only mpi-2r-...`: 12.5 us
through torch for the core's 2.8 and Open MPI's 5.0; barrier 8.2 for 0.8
and 0.8).

So all_reduce, barrier, all_gather, all_gather_single (and
all_gather_into_tensor), reduce_scatter_single (and reduce_scatter_tensor),
reduce_scatter and all_to_all have fast paths too, with the same checks
and the same stepping aside (NOTE [ Fast paths nobody sees ]), each
written out inline: at this size every Python call and attribute read
counts (about 0.1 us each on these cores: the observers' three checks
0.15 us, the group's 0.17, the tensor's 0.27, the op's row 0.23; a
RedOpType's .value alone 0.1, so SUM is taken by identity; _World's
default_pg property 0.15 where its attribute takes 0.03).  What each
serves, and torch's function the rest:
- all_reduce: an op that is a RedOpType the core reduces for the tensor's
  dtype (PREMUL_SUM, complex tensors and the rest go to torch's function,
  and so to the group's method, which reduces them in torch);
- barrier: no device_ids, a timeout that is None or a timedelta, a group
  that is not served by gloo (it takes no tensor, so a torch-function mode
  does not see it in torch's either);
- all_gather_single and reduce_scatter_single: two tensors of one dtype
  whose sizes agree as the group's method requires, an op as all_reduce's;
- all_gather, reduce_scatter and all_to_all: lists of the group's size of
  plain tensors of the input's dtype and shape.  A list laid end to end in
  memory (views of one tensor, list(x.unbind(0)), and any list of one)
  goes to the core as one address, the core's own call; otherwise
  all_gather gathers into one new tensor and copies each piece out, and
  reduce_scatter and all_to_all concatenate the inputs first, as the
  group's methods do, for the same results.  gather's and scatter's root
  lists are read the same way (a list laid apart goes to the core as the
  pieces' addresses).  The lists are read in C, _core.tensor_pieces (NOTE
  [ A list of tensors read in one call ] in py_pieces.c): the same loop in
  Python cost more than the core's call.
On a torch where all_gather_into_tensor and reduce_scatter_tensor are
deprecated aliases of the *_single functions, they stay torch's: they call
the fast path of the name they stand for through the module and warn as
torch's do, for about 1.3 us more than the *_single call.  Measured after
it, CPU time per call on one rank, 4 KB, over the core's own call (best
of 7 runs, interleaved, `python benchmarks/fastpath_calls.py`; on these
shared cores whole runs go up to twice as slow at times, so only figures
of one run compare): all_reduce +0.84 us (1.34 for the core's 0.50),
barrier +0.38 (0.58 for 0.20), broadcast +0.73 (1.15 for 0.42),
all_gather_single +1.23 (1.72 for 0.48), reduce_scatter_single +1.28
(1.82 for 0.54), gather +1.61 (2.30 for 0.69), all_to_all_single +1.75
(its split sizes and overlap checked too), and of lists (of one tensor
on one rank) all_gather +2.01, reduce_scatter +2.38, all_to_all +3.17;
all_gather_into_tensor +2.60 and reduce_scatter_tensor +2.54 through
torch's deprecated aliases.  Through torch's function (the path before,
and the one an observed call takes) the same calls cost 6.24, 5.82, 6.42,
5.70, 7.38, 8.44, 9.20, 18.5, 22.9 and 40.5 us.  With the lists read in C,
the list forms cost about what the *_single forms cost: in one process, each
call of the code before it timed beside the code after it (interleaved,
best of 7 runs, one run at load 9.8, where whole figures are about twice
the quiet cores'), over the core's call, before and after: all_gather
+3.71 and +2.57, reduce_scatter +4.33 and +2.83, all_to_all +5.13 and
+3.08, gather +2.81 and +2.29, scatter +2.93 and +2.27, against
all_gather_single's +2.49 and +2.46 (unchanged code: the run's noise).
The script's own run after it (all_to_all's two lists then read in one
call, against its first input's dtype and shape), at load 6.5, where
all_reduce took +0.92: all_gather +1.45, gather +1.32, scatter +1.27,
reduce_scatter +1.54, all_to_all +1.77, all_to_all_single +1.80 (the
code before: +2.10), all_gather_single +1.45, reduce_scatter_single
+1.34, barrier +0.53, broadcast +0.83.  What is left is the checks every
fast path makes and torch's own attribute reads, five for each tensor of
a list (is_cpu, dtype, is_contiguous(), shape and data_ptr(), the shape,
a new torch.Size, the dearest of them), which cost as much from C as
from Python: all_to_all_single's pair read in C (one call returning the
addresses, bytes and first dimensions of both) took no less than the
same reads in Python, and was not kept.  The
script's two-rank mode (`--p2p`) times a 4 KB send/recv ping-pong: dist.*
7.01 us a round trip against the core's 3.47, about 0.9 us a call over
the core's (two sends and two receives a round trip).
Between two ranks (`mpcore bench --only mpi-2r-allreduce-4k,mpi-2r-barrier,
mpi-2r-broadcast-4k`, one run at load 3.5, others' work on the cores):
barrier 2.50 us through torch, 2.12 the core's, 3.83 Open MPI's;
broadcast 2.64, 1.85, 2.30; all_reduce 66.9, 70.8, 19.8, where the core's
own all_reduce, not the layers above it, lost to Open MPI on the loaded
cores.

NOTE [ Asynchronous calls on the fast path ]
With async_op=True the fast path makes the same checks and queues the
core's call on the group's collectives lane, as the group's method does
(ShmGroup.run(True, ...)): the same Work, run on the group's thread or by
the thread that waits for it (NOTE [ A waiter runs its own call ] in
_dist.py), in the order of the calls.  It never runs the call on the
caller's thread at once: a rank that posts an asynchronous all_reduce and
then a send, whose peer receives first and then all-reduces, would wait
in the all_reduce for a peer that waits for its send.  What the fast path
saves is torch's layers (dist.all_reduce(t, async_op=True).wait() 5.81
us against 10.44 through torch's function and the group's method, in the
run above; barrier 4.72 against 10.29, broadcast 5.75 against 10.82);
what is left over a blocking call, +4.47 us for all_reduce (+4.15 for
barrier, +4.3 to +5.2 for the others), is the Work and the lane, all
Python: a
profile of dist.all_reduce(t, async_op=True).wait() puts a fifth of it in
making the Work (torch's Work base, the latch, its fields: 1.2 us alone),
a quarter in queueing it (the lane's lock, its deque, the clock the poller
reads) and over half in the waiter taking and running it (the lane's lock
twice, the Work's end under the futures' lock, the latch).  Reading the
thread's ident rather than current_thread() (0.08 us against 0.16, twice a
call) and not reading a timeout in Work.wait() when none is given (0.19
us) took about 0.35 us off.  Then the Work itself: the lane gives the
Work it made last again when nothing but the lane holds it (NOTE [ A
Work used again ] in _dist.py), and a call's end is one hold of the
lane's lock, with no lock of the Work's own or for its future (NOTE
[ A call's end ]), and a put reads no clock; then the lane's state and
its post and wait_for in C (NOTE [ A lane's hot path in C ] in
_dist.py).  Measured (4 KB, best of 5 runs of 5000 calls; old and new
code alternated in one sitting, the core's all_reduce at 0.52 to 0.59
us, as on quiet cores): async - dist, for all_reduce, barrier,
broadcast, all_gather_single and reduce_scatter_single, +5.3, +4.9,
+5.0 (the three first) before; +2.72, +2.56, +2.83, +2.77, +3.16 with
the Work used again and the Python lane; +1.55, +1.39, +1.57, +1.57,
+1.91 with the lane in C (another run of it: +1.68, +1.43, +1.53,
+1.57, +2.10).  Then the lane's lock and queue taken by C calls, no
longer through a threading.RLock's and a deque's methods (NOTE [ The
lane's lock in C ] in py_lanelock.c): in one process, the two lanes
alternated run by run, all_reduce +1.36 and +1.39 us before, +1.12 and
+1.18 after; barrier +0.94 after in the quieter run.  What was left
then: about 0.25 us of Python in Work.wait and a helper that looked the
lane up and queued on it, and about ten attribute reads and writes of
the Work, a pybind object with a dict (0.2 us).  So the lane's post and
wait_for read and write the Work's fields in its dict (NOTE [ A Work's
fields in its dict ] in py_lane.c), Work.wait is C (NOTE [ Work.wait in
C ] in py_lane.c), and the fast paths call the group's shm.post, the
collectives lane's post bound once, with no helper between.  Measured,
the package before and after installed in turn (python
benchmarks/fastpath_calls.py --runs 5 --calls 10000, two rounds), async
- dist before and after: all_reduce +1.03 and +1.06 us, +0.76 and
+0.75; barrier +0.87 and +0.83, +0.63 and +0.59; broadcast +1.06 and
+1.08, +0.75 and +0.76; all_gather_single +1.07 and +1.05, +0.73 and
+0.75; reduce_scatter_single +1.39 and +1.42, +0.84 and +0.80;
reduce_scatter +1.59 and +1.56, +0.80 and +0.78; gather +1.49 and
+1.52, +0.79 and +0.74 (the three last had summed their result's bytes
in a generator for the lane's `small`).

NOTE [ Calls a coalescing manager gathers ]
Inside torch's _coalescing_manager(group) (DTensor's and FSDP's way of
making several all_reduces, all_gather_singles or reduce_scatter_singles
one call), torch's function does not call the group: it appends the call
to _world.pg_coalesce_state[group], and the manager makes one coalesced
call at its end, whose Work it holds with async_ops=True.  Those three
fast paths step aside while their group is in that dict, so torch's
function gathers the call as gloo's: served at once, the calls left the
manager nothing to wait on (its Works None, and torch 2.6's manager an
unbound `work`).  The check is one dict lookup, usually of an empty dict.

NOTE [ A fast path for the functional collectives ]
torch.distributed._functional_collectives (what DTensor and FSDP2's
helpers call) goes through the dispatcher three times per call: the
collective's custom op, a wrapper op that makes its result an
AsyncCollectiveTensor, and the wait, each with Python autograd and pytree
layers, and the AsyncCollectiveTensor's own __torch_dispatch__ at its first
use.  On one rank, a 4 KB all_reduce and its wait took 123 us, for 7 us of
dist.all_reduce on the same group: gloo's took 120 us, so no backend could
reach 30x gloo behind that layer.

all_reduce, all_gather_single and reduce_scatter_single (and the
deprecated *_tensor names, which call them) therefore serve, when nothing
observes the call (NOTE [ Fast paths nobody sees ]: tracing included), a
plain contiguous CPU tensor that does not require grad, on an mpcore group
named as a ProcessGroup, a DeviceMesh of one dimension, (mesh, dim) or a
group name, with an op and dtype the core reduces and, for the last two,
dimension 0.  The result is made as torch's kernel makes it (a contiguous
clone, or a new tensor of the gathered or scattered shape) and is
complete on return.  It is handed back as torch's eager path hands it,
an AsyncCollectiveTensor (one already complete: its first use waits on
nothing), and funcol.wait_tensor, also put in torch's place, returns the
tensor inside such a complete one at once; what torch's wait_tensor does
with it, through the subclass's __torch_dispatch__, costs far more than
the collective (54 us of CPU on two busy cores, where making the tensor
takes 3.1 us).  Everything else goes to torch's function.  Measured after
it, 4 KB all_reduce + wait: 12.6 us on one rank;
on two (`mpcore bench --only c10d-funcol-allreduce-4k`) 13.6 to 20 us, 52x
to 75x gloo (4.5x before; the figures are of the plain tensor it returned
then, NOTE [ Fast paths nobody sees ] has the ones after).

NOTE [ Fast paths nobody sees ]
A fast path must not be seen: what observes collectives sees a call on an
mpcore group as it sees one on gloo's.  So every fast path here steps
aside, and torch's function serves the call, whenever something may
observe it:
- torch.compile or export traces the call: torch.compiler.is_compiling,
  which torch.compile takes for True, so that a compiled caller goes
  straight on to torch's function and never traces the rest (where the
  graphs and graph breaks would differ from gloo's).  Nothing traces
  before torch._dynamo is imported (which neither torch.distributed nor
  DTensor does), so until then the check is bool(), 5 ns;
- a TorchDispatchMode is on the thread's stack: the program's
  (CommDebugMode, DebugMode) or torch's own while it traces (FakeTensorMode,
  make_fx's proxy mode), which torch._C._len_torch_dispatch_stack counts
  alike.  With is_compiling this asks what funcol's own _are_we_tracing
  asks (dynamo, fake and proxy modes), at a fifth of its cost;
- a TorchFunctionMode is active (_has_torch_function, as before);
- torch's profiler runs on this thread (torch.autograd._profiler_enabled),
  so that the backend records the call's events (NOTE [ Collectives in the
  profiler ] in _profile.py).
Then a functional collective goes through the dispatcher (the modes see
_c10d_functional's ops, the profiler records them) to the group's method,
and a dist.* call through torch's Python function to the group's method,
which then goes through c10d's op as gloo's group does (NOTE [ Observed
calls go through the dispatcher ] in _profile.py).  Measured CPU time per check, on two busy cores: is_compiling 75 ns,
_profiler_enabled 50 ns, _len_torch_dispatch_stack 52 ns (the Python-key
test of the thread's key set, 102 ns; _are_we_tracing, which the
functional fast path called before, 840 ns).  Measured after it, CPU time
per call on a group of one rank, best of 8 runs alternating with the code
before it, on two cores at load 17 to 29: dist.broadcast 4 KB 1.77 us
(1.75 before), dist.all_reduce 6.45 us (6.74), the functional all_reduce
and its wait_tensor 7.35 us (14.8: the complete AsyncCollectiveTensor and
its wait cost less than torch's wait_tensor of a plain tensor and
_are_we_tracing did).  The profiler's and the modes' checks are one C
call now, _observed (NOTE [ Observers asked in C ] in py_fastpath.c), and
dist.barrier's whole fast path is C (NOTE [ dist.barrier in C ] there)."""

from datetime import timedelta as _timedelta

import torch
from torch.distributed import distributed_c10d as _c10d

from .. import _core, _hooks, _torchapi
from ._buffers import BUFFER_MIN, buffer_of, with_buffer
from ._dist import ShmGroup
from ._group import ProcessGroupMpcore
from ._work import Work as _Work
from ._reduce import CORE_ROWS, RED
from ._uncompiled import run_uncompiled

_WORLD = _torchapi.find(f"{_torchapi.C10D}._world")   # None only outside the torch window
_torchapi.find(f"{_torchapi.C10D}._world._default_pg")   # read as _WORLD._default_pg
# the groups inside torch's _coalescing_manager (NOTE [ Calls a coalescing manager gathers ])
_COALESCING = _torchapi.find(f"{_torchapi.C10D}._world._pg_coalesce_state")
_resolve_process_group = _torchapi.find(f"{_torchapi.C10D}._resolve_process_group")
_TORCH = {}   # key (the function's name, "funcol." before a functional one's) -> torch's
_has_torch_function = _torchapi.get("torch._C._has_torch_function")
# what observes a call (NOTE [ Fast paths nobody sees ])
_compiling = bool   # torch.compiler.is_compiling once torch._dynamo is imported (_compiler)
_profiling = _torchapi.get("torch._C._autograd._profiler_enabled")
_modes = _torchapi.get("torch._C._len_torch_dispatch_stack")   # the program's and torch's


def _observers():
    """A call that says whether the profiler or a dispatch mode observes
    this thread's calls: _core.observed where torch's C++ functions check
    (NOTE [ Observers asked in C ] in py_observe.c), else the same question
    asked of their Python bindings."""
    import ctypes
    fns = _torchapi.find(_torchapi.PROFILER_ENABLED), _torchapi.find(_torchapi.STACK_LEN)
    if None in fns:
        return lambda: _profiling() or _modes()
    _core.set_observers(*(ctypes.cast(f, ctypes.c_void_p).value for f in fns))
    return _core.observed


_observed = _observers()
_Tensor = torch.Tensor
_PG = ProcessGroupMpcore
_FUNCOL = "torch.distributed._functional_collectives"
_SUM = RED.SUM
_ROWS = CORE_ROWS
_SUMS = {dt: row[RED.SUM.value] for dt, row in CORE_ROWS.items() if row[RED.SUM.value]}
_ITEM = {dt: dt.itemsize for dt in CORE_ROWS}   # a dict's read costs less than numel()
_FEW = BUFFER_MIN // 16   # fewer elements than this are under BUFFER_MIN bytes in any dtype
# the fast paths of barrier (blocking), all_reduce and broadcast made in
# C where the observers are asked in C (NOTE [ dist.barrier in C ], NOTE
# [ Small collectives in C ] in py_fastpath.c): each returns what the
# dist.* call returns, or False; until set_fastpath, and without it,
# always False, and the Python path serves the call
if _observed is _core.observed and _WORLD is not None:
    _core.set_fastpath(_WORLD, _PG, _Tensor, _has_torch_function, _COALESCING, _SUM, _SUMS,
                       _ROWS, BUFFER_MIN, _Work, ShmGroup.SMALL)
_barrier_now = _core.barrier_now
_all_reduce_now = _core.all_reduce_now
_broadcast_now = _core.broadcast_now
_torch_empty = torch.empty
_torch_cat = torch.cat


def _region(g):
    """g when it is an mpcore group with a region; else None."""
    if type(g) is _PG and g.shm is not None and g.batch is None:
        return g
    return None


def _plain(t):
    return type(t) is _Tensor and t.is_cpu and t.is_contiguous()


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.shm is not None and g.batch is None and group_dst is None
            and type(tensor) is _Tensor and tensor.is_cpu and tensor.is_contiguous()
            and not _has_torch_function((tensor,))):
        peer = g.group_ranks.get(dst)
        if peer is not None and peer != g.my_rank and g.send_now(tensor, peer, tag):
            return None
    return _TORCH["send"](tensor, dst, group=group, tag=tag, group_dst=group_dst)


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.shm is not None and g.batch is None and group_src is None
            and type(tensor) is _Tensor and tensor.is_cpu and tensor.is_contiguous()
            and not _has_torch_function((tensor,))):
        peer = g.group_ranks.get(src)
        if peer is not None and peer != g.my_rank:
            shm = g.shm
            if shm.lane("mpcore-recv").run_if_idle(shm.core.recv, tensor.data_ptr(),
                                                    tensor.nbytes, peer, tag,
                                                    shm.timeout) is not None:
                return src
    return _TORCH["recv"](tensor, src, group=group, tag=tag, group_src=group_src)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    if group_src is None and not _compiling():
        done = _broadcast_now(tensor, src, group, async_op)   # NOTE [ Small collectives in C ]
        if done is not False:
            return done
    g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.batch is None and group_src is None
            and type(tensor) is _Tensor and tensor.is_cpu and tensor.is_contiguous()
            and not _has_torch_function((tensor,))):
        root = g.group_ranks.get(src)
        shm = g.shm
        if root is not None and shm is not None:
            if async_op:
                return shm.post(_Work, [tensor], shm.core.broadcast,
                                (tensor.data_ptr(), tensor.nbytes, root), tensor,
                                tensor.nbytes <= _SMALL)
            if shm.collectives.queued:
                shm.drain()
            shm.core.broadcast(tensor.data_ptr(), tensor.nbytes, root, shm.timeout)
            return None
    return _TORCH["broadcast"](tensor, src, group=group, async_op=async_op,
                               group_src=group_src)


def _call(shm, async_op, keep, result, fn, *args):
    """fn(*args, timeout) on shm, as the group's method runs the core's
    call: at once after the collectives queued (None, as torch's function
    returns for a blocking call), or on the group's thread (its Work, with
    `result` and `keep`) for async_op (NOTE [ Asynchronous calls on the
    fast path ])."""
    if async_op:
        return shm.post(_Work, result, fn, args, keep,
                        sum(t.nbytes for t in result) <= _SMALL)
    if shm.collectives.queued:
        shm.drain()
    fn(*args, shm.timeout)
    return None


# shm.post(_Work, result, fn, args, keep, small): the Work of fn(*args,
# timeout) queued on the group's collectives lane, as ShmGroup.run(True,
# ...) queues it (NOTE [ Asynchronous calls on the fast path ]); small: the
# call's bytes are at most _SMALL, which tells the lane not to wake its
# thread (NOTE [ A waiter runs its own call ] in _dist.py).
_SMALL = ShmGroup.SMALL


# _pieces(ts, torch.Tensor, dtype, shape, w, nbytes): ts as the core takes
# a list of w pieces, for a list of w plain contiguous CPU tensors of that
# dtype and shape (nbytes: one's bytes; dtype and shape None: the first's):
# the first's address when they lie end to end (rank q's piece at q *
# nbytes), else the list of their addresses; None for any other list.  A
# seventh argument, a second list checked alike: the pair, or None.  In C
# (NOTE [ A list of tensors read in one call ] in py_pieces.c): the same
# loop in Python cost more than the core's call.
_pieces = _core.tensor_pieces


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.batch is None and group_dst is None
            and (shm := g.shm) is not None
            and type(tensor) is _Tensor and tensor.is_cpu and tensor.is_contiguous()
            and not _has_torch_function((tensor,))):
        root = g.group_ranks.get(0 if dst is None else dst)
        if root is not None:
            n = tensor.nbytes
            if root != g.my_rank:
                outs = None if gather_list else 0
            else:
                outs = _pieces(gather_list, _Tensor, tensor.dtype, tensor.shape, g.world, n)
            if outs is not None:
                if async_op:   # the Work's result is the root's outputs' list, as the method's
                    return shm.post(_Work, gather_list if outs else [], shm.core.gather,
                                    (outs, tensor.data_ptr(), n, root), (tensor, gather_list),
                                    (n * g.world if outs else 0) <= _SMALL)
                if shm.collectives.queued:
                    shm.drain()
                shm.core.gather(outs, tensor.data_ptr(), n, root, shm.timeout)
                return None
    return _TORCH["gather"](tensor, gather_list, dst, group=group, async_op=async_op,
                            group_dst=group_dst)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    g = _WORLD._default_pg if group is None else group   # as gather's
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.batch is None and group_src is None
            and (shm := g.shm) is not None
            and type(tensor) is _Tensor and tensor.is_cpu and tensor.is_contiguous()
            and not _has_torch_function((tensor,))):
        root = g.group_ranks.get(0 if src is None else src)
        if root is not None:
            n = tensor.nbytes
            if root != g.my_rank:
                ins = None if scatter_list else 0
            else:
                ins = _pieces(scatter_list, _Tensor, tensor.dtype, tensor.shape, g.world, n)
            if ins is not None:
                if async_op:
                    return shm.post(_Work, [tensor], shm.core.scatter,
                                    (tensor.data_ptr(), ins, n, root), (tensor, scatter_list),
                                    n <= _SMALL)
                if shm.collectives.queued:
                    shm.drain()
                shm.core.scatter(tensor.data_ptr(), ins, n, root, shm.timeout)
                return None
    return _TORCH["scatter"](tensor, scatter_list, src, group=group, async_op=async_op,
                             group_src=group_src)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.batch is None and (shm := g.shm) is not None
            and type(output) is _Tensor and type(input) is _Tensor
            and output.is_cpu and input.is_cpu and output.dtype is input.dtype
            and output.is_contiguous() and input.is_contiguous()
            and not _has_torch_function((output, input))):
        n, m, w = input.nbytes, output.nbytes, g.world
        o, i = output.data_ptr(), input.data_ptr()
        si, so = input.shape, output.shape
        if (not output_split_sizes and not input_split_sizes and n < BUFFER_MIN
                and si and so and not si[0] % w and not so[0] % w
                and (i >= o + m or o >= i + n)):
            # even splits, apart, not in a group buffer: the sizes are the bytes' shares
            sent = [n // w] * w
            got = sent if m == n else [m // w] * w
            if async_op:
                return shm.post(_Work, [output], shm.core.all_to_all, (o, i, sent, got),
                                (input, output), m <= _SMALL)
            if shm.collectives.queued:
                shm.drain()
            shm.core.all_to_all(o, i, sent, got, shm.timeout)
            return None
        if (isinstance(output_split_sizes, (list, tuple, type(None)))
                and isinstance(input_split_sizes, (list, tuple, type(None)))):
            return _call(shm, async_op, (input, output), [output],
                         *g.core_all_to_all(output, input, output_split_sizes or (),
                                             input_split_sizes or ()))
    return _TORCH["all_to_all_single"](output, input, output_split_sizes, input_split_sizes,
                                       group=group, async_op=async_op)


# --- the collectives that reduce or gather (NOTE [ The rest of torch's collectives ]) ---

def all_reduce(tensor, op=_SUM, group=None, async_op=False):
    if not _compiling():
        done = _all_reduce_now(tensor, op, group, async_op)   # NOTE [ Small collectives in C ]
        if done is not False:
            return done
    g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.batch is None and type(op) is RED and g not in _COALESCING
            and type(tensor) is _Tensor and tensor.is_cpu and tensor.is_contiguous()
            and not _has_torch_function((tensor,))):
        if op is _SUM:    # an enum's .value costs more than the rest of a row's read
            codes = _SUMS.get(tensor.dtype)
        else:
            row = _ROWS.get(tensor.dtype)
            codes = row[op.value] if row is not None else None
        shm = g.shm
        if codes is not None and shm is not None:
            call, n = shm.core.all_reduce, tensor.numel()
            if n >= _FEW and tensor.nbytes >= BUFFER_MIN:
                call = with_buffer(call, buffer_of(tensor))
            if async_op:
                return shm.post(_Work, [tensor], call,
                                (tensor.data_ptr(), n, codes[0], codes[1]), tensor,
                                tensor.nbytes <= _SMALL)
            if shm.collectives.queued:
                shm.drain()
            call(tensor.data_ptr(), n, codes[0], codes[1], shm.timeout)
            return None
    return _TORCH["all_reduce"](tensor, op, group=group, async_op=async_op)


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    if (timeout is None and device_ids is None and not async_op and not _compiling()
            and _barrier_now(group) is None):   # NOTE [ dist.barrier in C ] in py_fastpath.c
        return None
    g = _WORLD._default_pg if group is None else group
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.batch is None and g.gloo is None and device_ids is None):
        shm = g.shm
        if timeout is None:
            s = g.timeout_s
        elif type(timeout) is _timedelta:
            s = timeout.total_seconds()
            s = g.timeout_s if s < 0 else s
        else:
            s = None     # torch's options take a timedelta only: its error
        if shm is not None and s is not None:
            if async_op:
                return shm.post(_Work, [], _barrier, (shm.core, s), None, True)
            if shm.collectives.queued:
                shm.drain()
            shm.core.barrier(s)
            return None
    return _TORCH["barrier"](group=group, async_op=async_op, device_ids=device_ids,
                             timeout=timeout)


def _barrier(core, seconds, _timeout):
    core.barrier(seconds)


def _all_gather_base(key):
    """all_gather_single (or all_gather_into_tensor, torch's name for it
    before), with torch's function _TORCH[key]."""
    def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
        g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
        if (not (_compiling() or _observed())
                and type(g) is _PG and g.batch is None and g.shm is not None
                and g not in _COALESCING
                and type(output_tensor) is _Tensor and type(input_tensor) is _Tensor
                and output_tensor.is_cpu and input_tensor.is_cpu
                and output_tensor.dtype is input_tensor.dtype
                and output_tensor.is_contiguous() and input_tensor.is_contiguous()
                and output_tensor.numel() == input_tensor.numel() * g.world
                and not _has_torch_function((input_tensor,))):
            shm = g.shm
            call, n = shm.core.all_gather, input_tensor.nbytes
            if n >= BUFFER_MIN:
                call = with_buffer(call, buffer_of(input_tensor))
            if async_op:
                return shm.post(_Work, [output_tensor], call,
                                (output_tensor.data_ptr(), input_tensor.data_ptr(), n),
                                (input_tensor, output_tensor), n * g.world <= _SMALL)
            if shm.collectives.queued:
                shm.drain()
            call(output_tensor.data_ptr(), input_tensor.data_ptr(), n, shm.timeout)
            return None
        return _TORCH[key](output_tensor, input_tensor, group=group, async_op=async_op)
    all_gather_single.__name__ = all_gather_single.__qualname__ = key
    return all_gather_single


def _reduce_scatter_base(key):
    """reduce_scatter_single (or reduce_scatter_tensor, torch's name for it
    before), with torch's function _TORCH[key]."""
    def reduce_scatter_single(output, input, op=_SUM, group=None, async_op=False):
        g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
        if (not (_compiling() or _observed())
                and type(g) is _PG and g.batch is None and g.shm is not None
                and g not in _COALESCING
                and type(output) is _Tensor and type(input) is _Tensor and type(op) is RED
                and output.is_cpu and input.is_cpu and (dt := output.dtype) is input.dtype
                and output.is_contiguous() and input.is_contiguous()
                and input.numel() == (m := output.numel()) * g.world
                and not _has_torch_function((input,))):
            if op is _SUM:
                codes = _SUMS.get(dt)
            else:
                row = _ROWS.get(dt)
                codes = row[op.value] if row is not None else None
            if codes is not None:
                shm = g.shm
                call = shm.core.reduce_scatter
                if m * g.world >= _FEW and input.nbytes >= BUFFER_MIN:
                    call = with_buffer(call, buffer_of(input))
                if async_op:
                    return shm.post(_Work, [output], call,
                                    (output.data_ptr(), input.data_ptr(), m, codes[0], codes[1]),
                                    (input, output), output.nbytes <= _SMALL)
                if shm.collectives.queued:
                    shm.drain()
                call(output.data_ptr(), input.data_ptr(), m, codes[0], codes[1], shm.timeout)
                return None
        return _TORCH[key](output, input, op, group=group, async_op=async_op)
    reduce_scatter_single.__name__ = reduce_scatter_single.__qualname__ = key
    return reduce_scatter_single


all_gather_single = _all_gather_base("all_gather_single")
all_gather_into_tensor = _all_gather_base("all_gather_into_tensor")
reduce_scatter_single = _reduce_scatter_base("reduce_scatter_single")
reduce_scatter_tensor = _reduce_scatter_base("reduce_scatter_tensor")


def all_gather(tensor_list, tensor, group=None, async_op=False):
    g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.batch is None and (shm := g.shm) is not None
            and type(tensor) is _Tensor and tensor.is_cpu and tensor.is_contiguous()
            and not _has_torch_function((tensor,))):
        n, w = tensor.nbytes, g.world
        outs = _pieces(tensor_list, _Tensor, tensor.dtype, tensor.shape, w, n)
        if outs is not None:
            if type(outs) is int:   # one buffer: the core writes into it
                if async_op:
                    return shm.post(_Work, tensor_list, shm.core.all_gather,
                                    (outs, tensor.data_ptr(), n), (tensor, tensor_list),
                                    n * w <= _SMALL)
                if shm.collectives.queued:
                    shm.drain()
                shm.core.all_gather(outs, tensor.data_ptr(), n, shm.timeout)
                return None
            flat = _torch_empty((g.world,) + tuple(tensor.shape), dtype=tensor.dtype)
            return _call(shm, async_op, (tensor, flat), tensor_list, _gather_apart, shm.core,
                         flat, tensor_list, tensor.data_ptr(), tensor.nbytes)
    return _TORCH["all_gather"](tensor_list, tensor, group=group, async_op=async_op)


def _gather_apart(core, flat, outs, addr, nbytes, timeout):
    core.all_gather(flat.data_ptr(), addr, nbytes, timeout)
    for t, piece in zip(outs, flat.unbind(0)):
        t.copy_(piece)


def reduce_scatter(output, input_list, op=_SUM, group=None, async_op=False):
    g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.batch is None and type(op) is RED
            and (shm := g.shm) is not None
            and type(output) is _Tensor and output.is_cpu and output.is_contiguous()
            and not _has_torch_function((output,))):
        dt = output.dtype
        if op is _SUM:
            codes = _SUMS.get(dt)
        else:
            row = _ROWS.get(dt)
            codes = row[op.value] if row is not None else None
        ins = (_pieces(input_list, _Tensor, dt, output.shape, g.world, nb := output.nbytes)
               if codes is not None else None)
        if type(ins) is int:    # laid end to end: the core reads them where they lie
            if async_op:
                return shm.post(_Work, [output], shm.core.reduce_scatter,
                                (output.data_ptr(), ins, nb // _ITEM[dt], codes[0], codes[1]),
                                (output, input_list), nb <= _SMALL)
            if shm.collectives.queued:
                shm.drain()
            shm.core.reduce_scatter(output.data_ptr(), ins, nb // _ITEM[dt], codes[0], codes[1],
                                    shm.timeout)
            return None
        if ins is not None:
            flat = None if type(ins) is int else _torch_cat([t.view(-1) for t in input_list])
            return _call(shm, async_op, (output, input_list, flat), [output],
                         shm.core.reduce_scatter, output.data_ptr(),
                         ins if flat is None else flat.data_ptr(), output.numel(), codes[0],
                         codes[1])
    return _TORCH["reduce_scatter"](output, input_list, op, group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    g = _WORLD._default_pg if group is None else group   # _region(), _plain(), inline
    if (not (_compiling() or _observed())
            and type(g) is _PG and g.batch is None and (shm := g.shm) is not None
            and type(input_tensor_list) is list and input_tensor_list
            and not _has_torch_function(input_tensor_list)):
        first, w = input_tensor_list[0], g.world
        both = None
        if type(first) is _Tensor:   # both lists against the first input's dtype and shape
            n = first.nbytes
            both = _pieces(input_tensor_list, _Tensor, None, None, w, n, output_tensor_list)
        ins, outs = both if both is not None else (None, None)
        if type(outs) is int and type(ins) is int:   # both end to end: the core's one call
            sizes = [n] * w
            if async_op:
                return shm.post(_Work, output_tensor_list, shm.core.all_to_all,
                                (outs, ins, sizes, sizes), input_tensor_list, n * w <= _SMALL)
            if shm.collectives.queued:
                shm.drain()
            shm.core.all_to_all(outs, ins, sizes, sizes, shm.timeout)
            return None
        if outs is not None:
            sizes = [n] * w
            src = None if type(ins) is int else _torch_cat([t.view(-1) for t in input_tensor_list])
            at = ins if src is None else src.data_ptr()
            if type(outs) is int:
                return _call(shm, async_op, (input_tensor_list, src), output_tensor_list,
                             shm.core.all_to_all, outs, at, sizes, sizes)
            flat = _torch_empty((w,) + tuple(first.shape), dtype=first.dtype)
            return _call(shm, async_op, (input_tensor_list, src, flat), output_tensor_list,
                         _to_all_apart, shm.core, flat, output_tensor_list, at, sizes)
    return _TORCH["all_to_all"](output_tensor_list, input_tensor_list, group=group,
                              async_op=async_op)


def _to_all_apart(core, flat, outs, addr, sizes, timeout):
    core.all_to_all(flat.data_ptr(), addr, sizes, sizes, timeout)
    for t, piece in zip(outs, flat.unbind(0)):
        t.copy_(piece)


# --- functional collectives (NOTE [ A fast path for the functional collectives ]) -----

_FC_OPS = {"sum": RED.SUM, "avg": RED.AVG,
           "product": RED.PRODUCT, "min": RED.MIN,
           "max": RED.MAX, "band": RED.BAND, "bor": RED.BOR,
           "bxor": RED.BXOR}
_fc = None   # the functional collectives' module, once installed
_ACT = None  # its AsyncCollectiveTensor


def _fc_group(group):
    """The mpcore group (with a region) a functional collective names; or None."""
    if type(group) is not ProcessGroupMpcore:
        if type(group) is tuple and len(group) == 2 and type(group[1]) is int \
                and isinstance(group[0], _fc.DeviceMesh):
            name = group[0]._dim_group_names[group[1]]
        elif isinstance(group, _fc.DeviceMesh) and group.ndim == 1:
            name = group._dim_group_names[0]
        elif type(group) is str:
            name = group
        else:
            return None
        try:
            group = _resolve_process_group(name)
        except (RuntimeError, ValueError):
            return None
    return _region(group)


def _fc_input(self, group):
    """The group a functional collective of `self` is served on; or None
    (NOTE [ Fast paths nobody sees ])."""
    if (_compiling() or _observed() or not _plain(self)
            or self.requires_grad or _has_torch_function((self,))):
        return None
    g = _fc_group(group)
    if g is not None and g.shm.collectives.queued:
        g.shm.drain()     # after the group's calls in flight, as torch's order is
    return g


def _fc_codes(self, reduce_op):
    """(dtype code, op code) of the core's reduction; or None."""
    red = _FC_OPS.get(reduce_op.lower()) if type(reduce_op) is str else None
    row = CORE_ROWS.get(self.dtype) if red is not None else None
    return row[red.value] if row is not None else None


def fc_all_reduce(self, reduceOp, group, tag=""):
    g = _fc_input(self, group)
    codes = _fc_codes(self, reduceOp) if g is not None else None
    if codes is None:
        return _TORCH["funcol.all_reduce"](self, reduceOp, group, tag)
    out = self.clone()
    shm = g.shm
    shm.core.all_reduce(out.data_ptr(), out.numel(), codes[0], codes[1], shm.timeout, None)
    return _complete(out)


def fc_all_gather_single(self, gather_dim, group, tag=""):
    g = _fc_input(self, group) if gather_dim == 0 else None
    if g is None or self.dim() == 0:
        return _TORCH["funcol.all_gather_single"](self, gather_dim, group, tag)
    out = self.new_empty((self.shape[0] * g.world,) + self.shape[1:])
    shm = g.shm
    shm.core.all_gather(out.data_ptr(), self.data_ptr(), self.nbytes, shm.timeout)
    return _complete(out)


def fc_reduce_scatter_single(self, reduceOp, scatter_dim, group, tag=""):
    g = _fc_input(self, group) if scatter_dim == 0 else None
    codes = _fc_codes(self, reduceOp) if g is not None else None
    if codes is None or self.dim() == 0 or self.shape[0] % g.world:
        return _TORCH["funcol.reduce_scatter_single"](self, reduceOp, scatter_dim, group, tag)
    out = self.new_empty((self.shape[0] // g.world,) + self.shape[1:])
    shm = g.shm
    shm.core.reduce_scatter(out.data_ptr(), self.data_ptr(), out.numel(), codes[0], codes[1],
                            shm.timeout)
    return _complete(out)


def _complete(t):
    """t as funcol hands a result back: an AsyncCollectiveTensor, here one
    whose collective is complete."""
    r = _ACT(t)
    r.completed = True
    return r


def fc_wait_tensor(tensor):
    if (type(tensor) is _ACT and tensor.completed
            and not (_compiling() or _observed())):
        return tensor.elem    # what torch's wait_tensor gives for it, the same tensor
    return _TORCH["funcol.wait_tensor"](tensor)


def _put(module, key, fn, name=None):
    """Puts fn in place of module's function `name` (fn's name by default)
    once, when their parameters are the same; torch's function is then
    _TORCH[key].  A function torch keeps only as a deprecated alias of
    another (all_gather_into_tensor of all_gather_single) stays torch's: it
    calls the other through the module, so its fast path, and keeps its
    own warning."""
    name = name or fn.__name__
    torch_fn = getattr(module, name, None)
    if (torch_fn is None or getattr(torch_fn, "_mpcore_fast", False)
            or getattr(torch_fn, "__deprecated__", None) is not None):
        return None
    # the table checks the parameters are the same (_torchapi.py)
    if _torchapi.replace(f"{module.__name__}.{name}", fn, wraps=True) is None:
        return None    # another torch's function: its own serves every call
    _TORCH[key] = torch_fn
    fn._mpcore_fast = True
    return fn


def _install_funcol(fc):
    global _fc, _ACT
    if not _torchapi.serves("functional collective fast paths"):
        return    # torch's functions serve every call, through the backend
    _fc = fc
    _ACT = _torchapi.get(f"{_FUNCOL}.AsyncCollectiveTensor")
    # wait_tensor first: a result of the others is waited on by it
    for name, fn in (("wait_tensor", fc_wait_tensor), ("all_reduce", fc_all_reduce),
                     ("all_gather_single", fc_all_gather_single),
                     ("reduce_scatter_single", fc_reduce_scatter_single)):
        _put(fc, "funcol." + name, fn, name)


# torch.distributed's functions with a fast path, in _torchapi._FASTPATH's order
_DIST = (send, recv, broadcast, gather, scatter, all_to_all_single, all_reduce, barrier,
         all_gather, all_gather_into_tensor, all_gather_single, reduce_scatter_tensor,
         reduce_scatter_single, reduce_scatter, all_to_all)


def install():
    """Puts the functions above in torch.distributed's place (once), and in
    the functional collectives' once they are imported."""
    import torch.distributed as dist
    for fn in _DIST:
        if _put(_c10d, fn.__name__, fn) is not None and hasattr(dist, fn.__name__):
            _torchapi.replace(f"torch.distributed.{fn.__name__}", fn)
    # A compiled caller traces through them to torch's function, which it
    # sees as under gloo (NOTE [ Fast paths nobody sees ]); after a graph
    # break in torch's, their own frames then run as plain Python, as
    # torch's module functions do, rather than be compiled anew.
    run_uncompiled(*_DIST)
    _hooks.when_imported("torch._dynamo", _compiler)
    _hooks.when_imported(_FUNCOL, _install_funcol)


def _compiler(dynamo):
    """Once torch._dynamo is imported, a call may be traced
    (NOTE [ Fast paths nobody sees ])."""
    global _compiling
    _compiling = torch.compiler.is_compiling
