"""The one table of what mpcore takes from torch's internals and changes in
torch, and the torch window.

NOTE [ The table of torch changes ]
Every private torch symbol mpcore reads and every torch attribute it
replaces is a row of TABLE: its dotted target, the shape expected of it
(exists, callable, a class, has these attributes, has these call
parameters), and the feature of mpcore that needs it.  Code reads such a
symbol with get() and replaces an attribute with replace(), never directly,
and only at install time: a hot path keeps what get() returned.  Each call
records what it did in the row: "ok" (read, of the expected shape),
"replaced", "added" (torch had no such name), "checked" (a replacement
whose target checks, not made in this process), "kept torch's" (not
replaced, and why), "missing" or "wrong shape" (and why); rows never
reached stay "unchecked".  `mpcore doctor --json` prints the table.

NOTE [ A feature torch cannot carry falls back ]
A feature is served only when every row it reads or replaces checks on the
installed torch (serves(feature), checked once per process, the first time
the feature is about to install).  When one does not, nothing of that
feature is replaced: torch's own way stays, whatever else mpcore serves.
The first such fallback in a program gives one RuntimeWarning that names
torch's version, what it lacks and what stays torch's; every later one is
recorded only (`mpcore doctor` lists them all).  "One per program": the
warning sets MPCORE_TORCH_WARNED in the environment, so processes started
after it (spawn children, `mpcore run`'s ranks, a DataLoader's workers)
keep quiet about the same torch.  Rows marked at_use are read only when
their code first runs (their module costs seconds to import, or exists only
on some torches); a caller handles Missing from them by taking torch's way.

NOTE [ The torch window ]
mpcore is tested on torch WINDOW[0] to WINDOW[1], the oldest and newest
ends in CI (`make test-window`) and the pinned torch in full (`make test`).
Inside the window the table decides feature by feature.  Outside it mpcore
serves nothing of torch at all (not even what would check): a torch it was
never tried with gets one warning at its import and torch's own behaviour.
MPCORE_TORCH_ANY=1 lifts the window (the table still decides), for trying
a new torch.  The bounds are written here and nowhere else; pyproject.toml
states the same range as metadata (NOTE [ torch is optional ] there).

This module imports nothing of torch itself.
"""
import os
import sys
import warnings

WINDOW = ("2.6", "2.14.1")   # NOTE [ The torch window ]: oldest, newest

_WARNED_ENV = "MPCORE_TORCH_WARNED"
_ANY_ENV = "MPCORE_TORCH_ANY"

# feature -> (what mpcore serves, what stays torch's when it is not served)
FEATURES = {
    "tensor handles": (
        "tensors already in mpcore memory travel as handles (pickles, Queue records) and "
        "arrive as one storage per byte range",
        "tensors are pickled by torch's own reductions"),
    "in-place moves": (
        "share_memory_() and sending a tensor move its storage into mpcore memory in place "
        "(and the backend moves storages reduced again and again into group buffers)",
        "share_memory_() and sending tensors not yet in mpcore memory are torch's own "
        "(tensors made in mpcore memory still travel as handles)"),
    "torch.multiprocessing": (
        "under `mpcore run`, torch.multiprocessing's Process, Queue, spawn, Pool, ... are "
        "mpcore's", "torch.multiprocessing is torch's own"),
    "DataLoader": (
        "under `mpcore run`, torch.utils.data.DataLoader is mpcore's",
        "torch.utils.data.DataLoader is torch's own"),
    "StatefulDataLoader": (
        "under `mpcore run`, torchdata's StatefulDataLoader is mpcore's",
        "torchdata's StatefulDataLoader is its own"),
    "distributed backend": (
        "gloo groups on the CPU are served by mpcore's backend",
        "gloo groups are gloo's"),
    "DDP": (
        "under `mpcore run`, torch.nn.parallel.DistributedDataParallel is mpcore's",
        "DistributedDataParallel is torch's own"),
    "collective fast paths": (
        "send, recv, broadcast, gather, scatter, all_to_all_single, all_reduce, barrier, the "
        "all_gathers, the reduce_scatters and all_to_all on mpcore groups skip torch's Python "
        "layers", "those calls take torch's layers to mpcore's backend"),
    "functional collective fast paths": (
        "funcol's all_reduce, all_gather_single and reduce_scatter_single on mpcore groups "
        "skip the dispatcher's Python layers, and wait_tensor of their complete results",
        "functional collectives take torch's dispatcher to mpcore's backend"),
    "profiler events": (
        "collectives on mpcore groups leave events in torch's profiler, named as gloo's",
        "collectives on mpcore groups leave no events of their own in torch's profiler"),
    "observed collectives": (
        "dist.* calls on mpcore groups reach the backend through c10d's ops, as gloo's do, "
        "while a dispatch mode (CommDebugMode) or torch's profiler observes them",
        "dispatch modes see the functional collectives on mpcore groups but not dist.* calls"),
    "torchrun launch": (
        "`mpcore run --nproc-per-node`: torchrun's launcher with ranks forked from the zygote",
        "`mpcore run --nproc-per-node` cannot launch"),
    "zygote": (
        "the zygote's children read TORCH_LOGS afresh",
        "a child takes the zygote's torch logging setup"),
}

# Shapes: "exists", "callable", "class", "attrs:a,b" (has these attributes),
# "params:a,b" (a callable whose parameters include these), "same params"
# (a callable whose parameters are exactly those of mpcore's replacement).
TM_NAMES = ("Process", "Queue", "SimpleQueue", "JoinableQueue", "Pool", "get_context",
             "set_sharing_strategy", "get_sharing_strategy", "get_all_sharing_strategies",
             "spawn", "start_processes", "ProcessContext", "ProcessException",
             "ProcessRaisedException", "ProcessExitedException")
_FASTPATH = ("send", "recv", "broadcast", "gather", "scatter", "all_to_all_single", "all_reduce",
             "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
             "reduce_scatter", "all_to_all")
_FASTPATH_NEW = ("all_gather_single", "reduce_scatter_single")   # names a newer torch has
_FUNCOL = ("all_reduce", "all_gather_single", "reduce_scatter_single", "wait_tensor")
# c10d's ops that dist.* calls dispatch on gloo (NOTE [ Observed calls go through the
# dispatcher ] in dist/_profile.py)
_C10D_OPS = ("allreduce_", "allreduce_coalesced_", "reduce_", "broadcast_", "allgather_",
             "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
             "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
             "gather_", "scatter_", "alltoall_", "alltoall_base_", "barrier", "send", "recv_",
             "recv_any_source_", "monitored_barrier_")
C10D = "torch.distributed.distributed_c10d"
# a C function of one of torch's libraries: "library!symbol" (_resolve)
PROFILER_ENABLED = "libtorch_cpu.so!_ZN5torch8profiler4impl15profilerEnabledEv"
STACK_LEN = "libc10.so!_ZN3c104impl20TorchDispatchModeTLS9stack_lenEv"
_FC = "torch.distributed._functional_collectives"


def _rows():
    """(target, kind, shape, feature, at_use): kind is "read", "replace" or
    "add" (a name torch may lack, supplied where it does)."""
    yield from (
        # tensor handles (_torch.py, _records.py, py_shm.c's torch_hooks)
        ("torch._C._dispatch_keys", "read", "callable", "tensor handles", False),
        ("torch._tensor_classes", "read", "exists", "tensor handles", False),
        ("torch.UntypedStorage._new_with_weak_ptr", "read", "callable", "tensor handles", False),
        ("torch.UntypedStorage._free_weak_ref", "read", "callable", "tensor handles", False),
        ("torch.UntypedStorage._expired", "read", "callable", "tensor handles", False),
        ("torch.UntypedStorage._weak_ref", "read", "callable", "tensor handles", False),
        ("torch.multiprocessing.reductions.reduce_tensor", "read", "callable",
         "tensor handles", False),
        ("torch.multiprocessing.reductions.reduce_storage", "read", "callable",
         "tensor handles", False),
        ("torch.UntypedStorage.is_shared", "replace", "callable", "tensor handles", False),
        ("multiprocessing.reduction.ForkingPickler[torch tensors and storages]", "replace",
         "exists", "tensor handles", False),
        # in-place moves (NOTE [ Moving a storage in place ] in _torch.py)
        ("torch.UntypedStorage._swap_data_ptr_", "read", "callable", "in-place moves", False),
        ("torch.UntypedStorage.share_memory_", "replace", "callable", "in-place moves", False),
        # the zygote
        ("torch._logging._internal._init_logs", "read", "callable", "zygote", True),
    )
    for n in TM_NAMES:
        # torch.multiprocessing has no ProcessException: mpcore's module has, so it is added
        yield (f"torch.multiprocessing.{n}", "add" if n == "ProcessException" else "replace",
               "exists", "torch.multiprocessing", False)
    yield ("torch.sleep", "add", "exists", "torch.multiprocessing", False)
    yield from (
        # DataLoader (data/_compat.py, data/_loader.py, data/_single.py)
        ("torch.utils.data.DataLoader", "replace", "class", "DataLoader", False),
        ("torch.utils.data.dataloader.DataLoader", "replace", "class", "DataLoader", False),
        ("torch.utils.data.dataloader._DatasetKind", "read", "attrs:Map,Iterable",
         "DataLoader", False),
        ("torch.utils.data.dataloader._BaseDataLoaderIter", "read", "attrs:_next_index,_reset",
         "DataLoader", False),
        # its source, for the warning torch gives when a worker's arguments do not
        # pickle (NOTE [ A pickle error at a worker's start ] in data/_ship.py)
        ("torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__", "read",
         "callable", "DataLoader", True),
        ("torch.utils.data.dataloader._sharding_worker_init_fn", "read", "callable",
         "DataLoader", False),
        ("torch.utils.data._utils.worker._generate_state", "read", "callable", "DataLoader",
         False),
        ("torch.utils.data._utils.worker.WorkerInfo", "read", "class", "DataLoader", False),
        ("torch.utils.data._utils.worker._worker_info", "replace", "exists", "DataLoader",
         False),
        ("torch._utils.ExceptionWrapper", "read", "attrs:reraise", "DataLoader", False),
        ("torch.utils.data._utils.pin_memory.pin_memory", "read", "callable", "DataLoader",
         False),
        ("torch.utils.data.graph_settings.apply_random_seed", "read", "callable",
         "DataLoader", False),
        ("torchdata.stateful_dataloader.StatefulDataLoader", "replace", "class",
         "StatefulDataLoader", False),
        ("torchdata.stateful_dataloader.stateful_dataloader.StatefulDataLoader", "replace",
         "class", "StatefulDataLoader", False),
        # distributed backend (dist/_backend.py, dist/_group.py, dist/_profile.py,
        # distributed.py, dist/_hier.py, dist/_dist.py)
        ("torch.distributed.Backend.register_backend", "read", "params:extended_api,devices",
         "distributed backend", False),
        ("torch.distributed.Backend._plugins", "read", "exists", "distributed backend", False),
        ("torch._C._distributed_c10d.AllgatherOptions", "read", "class",
         "distributed backend", False),
        *((f"torch._C._distributed_c10d.{n}.asyncOp", "add", "exists", "distributed backend",
           False)
          for n in ("AllreduceOptions", "AllreduceCoalescedOptions", "ReduceOptions",
                    "BroadcastOptions", "AllgatherOptions", "GatherOptions", "ScatterOptions",
                    "ReduceScatterOptions", "AllToAllOptions", "BarrierOptions")),
        (f"{C10D}._world", "read", "attrs:default_pg,pg_map,pg_group_ranks",
         "distributed backend", False),
        (f"{C10D}._get_default_group", "read", "callable", "distributed backend", False),
        (f"{C10D}._process_group_name", "replace", "params:ranks,use_hashed_name",
         "distributed backend", False),
        (f"{C10D}._set_pg_timeout", "replace", "params:timeout,group",
         "distributed backend", True),
        (f"{C10D}.split_group", "replace", "callable", "distributed backend", True),
        ("torch.distributed.split_group", "replace", "callable", "distributed backend", True),
        ("torch.distributed.device_mesh.split_group", "replace", "callable",
         "distributed backend", True),
        (f"{C10D}.BackendConfig", "replace", "class", "distributed backend", False),
        (f"{C10D}.monitored_barrier", "replace", "callable", "distributed backend", False),
        ("torch.distributed.monitored_barrier", "replace", "callable", "distributed backend",
         False),
        # NOTE [ The Flight Recorder ] in dist/_recorder.py: the generic recorder's dump,
        # which torch has where its gloo records
        ("torch._C._distributed_c10d._dump_fr_trace", "read", "callable", "distributed backend",
         True),
        # NOTE [ The backend runs uncompiled ] in dist/_uncompiled.py: set_code_exec_strategy
        # where torch has it (2.7 on), else skip_code
        ("torch._dynamo.eval_frame.set_code_exec_strategy", "read", "callable",
         "distributed backend", True),
        ("torch._dynamo.types.FrameExecStrategy", "read", "callable", "distributed backend",
         True),
        ("torch._dynamo.types.FrameAction", "read", "attrs:SKIP", "distributed backend", True),
        ("torch._dynamo.eval_frame.skip_code", "read", "callable", "distributed backend", True),
        # DDP (parallel.py)
        ("torch.nn.parallel.DistributedDataParallel", "replace", "class", "DDP", False),
        ("torch.nn.parallel.distributed.DistributedDataParallel", "replace", "class", "DDP",
         False),
        ("torch.distributed._register_comm_hook", "read", "callable", "DDP", False),
        ("torch.distributed.ProcessGroupGloo._Options", "read", "class", "DDP", True),
        # collective fast paths (dist/_fastpath.py)
        ("torch._C._has_torch_function", "read", "callable", "collective fast paths", False),
        ("torch._C._autograd._profiler_enabled", "read", "callable", "collective fast paths",
         False),
        ("torch._C._len_torch_dispatch_stack", "read", "callable", "collective fast paths",
         False),
        # the C++ functions those two bind, asked in C where they check (NOTE [ Observers
        # asked in C ] in py_observe.c); the fast paths ask the bindings where not
        (PROFILER_ENABLED, "read", "c:bool=torch._C._autograd._profiler_enabled",
         "collective fast paths", True),
        (STACK_LEN, "read", "c:int64=torch._C._len_torch_dispatch_stack",
         "collective fast paths", True),
        (f"{C10D}._resolve_process_group", "read", "callable", "collective fast paths", False),
        # the default group without _World.default_pg's property call
        (f"{C10D}._world._default_pg", "read", "exists", "collective fast paths", False),
        # the groups inside a _coalescing_manager, whose calls torch's functions gather
        (f"{C10D}._world._pg_coalesce_state", "read", "exists", "collective fast paths", False),
    )
    for n in _FASTPATH + _FASTPATH_NEW:
        yield (f"{C10D}.{n}", "replace", "same params", "collective fast paths",
               n in _FASTPATH_NEW)
        yield (f"torch.distributed.{n}", "replace", "same params", "collective fast paths",
               n in _FASTPATH_NEW)
    for n in _FUNCOL:
        yield (f"{_FC}.{n}", "replace", "same params", "functional collective fast paths", False)
    yield from (
        (f"{_FC}.DeviceMesh", "read", "class", "functional collective fast paths", False),
        (f"{_FC}.AsyncCollectiveTensor", "read", "attrs:elem,completed,trigger_wait",
         "functional collective fast paths", False),
        # profiler events (dist/_profile.py, NOTE [ Collectives in the profiler ])
        ("torch._C._autograd._record_function_with_args_enter", "read", "callable",
         "profiler events", False),
        ("torch.ops.profiler._call_end_callbacks_on_jit_fut", "read", "exists",
         "profiler events", False),
        # observed collectives (dist/_profile.py, NOTE [ Observed calls go through the
        # dispatcher ]); each c10d op is read where it is used (a torch without one keeps
        # that call direct)
        ("torch._dispatch.python.enable_python_dispatcher", "read", "callable",
         "observed collectives", False),
        ("torch._C.DispatchKey", "read", "attrs:CPU,SparseCPU", "observed collectives", False),
        ("torch._C._distributed_c10d.ProcessGroup", "read", "class", "observed collectives",
         False),
        ("torch._C._distributed_c10d.ProcessGroup.unbox", "read", "callable",
         "observed collectives", False),
        ("torch._C._distributed_c10d.Work.boxed", "read", "callable", "observed collectives",
         False),
        ("torch._C._distributed_c10d.Work.unbox", "read", "callable", "observed collectives",
         False),
        ("torch.classes.c10d.ReduceOp", "read", "callable", "observed collectives", True),
        # NOTE [ c10d's ReduceOp of another kind ] in dist/_profile.py
        ("torch._C._autograd._enable_record_function", "read", "callable",
         "observed collectives", True),
        ("torch.utils._python_dispatch._disable_current_modes", "read", "callable",
         "observed collectives", True),
    )
    for n in _C10D_OPS:
        yield (f"torch.ops.c10d.{n}.default", "read", "attrs:py_impl,py_kernels,_op_dk,_schema",
               "observed collectives", True)
    yield from (
        # torchrun launch (run/_torchrun.py)
        ("torch.distributed.run.get_args_parser", "read", "callable", "torchrun launch", False),
        ("torch.distributed.run.config_from_args", "read", "callable", "torchrun launch", False),
        ("torch.distributed.run.parse_min_max_nnodes", "read", "callable", "torchrun launch",
         False),
        ("torch.distributed.elastic.multiprocessing.api._wrap", "replace",
         "params:local_rank,fn,args,ret_vals", "torchrun launch", True),
        ("torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler."
         "SubprocessHandler._popen", "replace", "params:self,args,env", "torchrun launch",
         True),
    )


class Row:
    __slots__ = ("target", "kind", "shape", "feature", "at_use", "status", "why")

    def __init__(self, target, kind, shape, feature, at_use):
        self.target, self.kind, self.shape = target, kind, shape
        self.feature, self.at_use = feature, at_use
        self.status, self.why = "unchecked", None

    def as_dict(self):
        return {"target": self.target, "kind": self.kind, "shape": self.shape,
                "feature": self.feature, "status": self.status, "why": self.why}


TABLE = {r[0]: Row(*r) for r in _rows()}

_served = {}      # feature -> (served, why)
_originals = {}   # target -> torch's value before replace()
_warned = False
_window = None    # (in the window, why) once torch's version was read


class Missing(AttributeError):
    """A row's target is missing or not of the expected shape on this torch."""


def torch_version():
    """The installed torch's version string, without importing torch (None
    when it is not imported)."""
    torch = sys.modules.get("torch")
    v = getattr(torch, "__version__", None)
    return None if v is None else str(v)


def _release(version):
    """(major, minor, micro) of a version string ("2.8.0+cpu" -> (2, 8, 0));
    a pre-release counts as its release."""
    out = []
    for part in str(version).split("+")[0].split(".")[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        out.append(int(digits or 0))
        if digits != part:
            break
    return tuple(out + [0] * (3 - len(out)))


def in_window(version=None):
    """Whether a torch version is inside the window (NOTE [ The torch window ])."""
    v = _release(version if version is not None else torch_version())
    return _release(WINDOW[0]) <= v <= _release(WINDOW[1])


def at_least(version):
    """Whether the imported torch is `version` or newer (False when torch is
    not imported)."""
    v = torch_version()
    return v is not None and _release(v) >= _release(version)


def check_window():
    """True when mpcore may serve the imported torch; else warns once (the
    one warning of NOTE [ A feature torch cannot carry falls back ]) and
    returns False, after which nothing of torch is to be replaced."""
    global _window
    if _window is None:
        v = torch_version()
        if v is None or in_window(v) or os.environ.get(_ANY_ENV) == "1":
            _window = (True, None)
        else:
            _window = (False, f"is outside mpcore's window, torch {WINDOW[0]} to {WINDOW[1]}")
            _warn(f"mpcore: torch {v} {_window[1]}: mpcore serves nothing of it and torch's "
                  f"own behaviour stays (install a torch in the window, or set {_ANY_ENV}=1 "
                  f"to try this one)")
    return _window[0]


def _warn(text):
    global _warned
    if _warned or os.environ.get(_WARNED_ENV):
        _warned = True
        return
    _warned = True
    os.environ[_WARNED_ENV] = "1"
    # Shown as "<mpcore>:1: RuntimeWarning: mpcore: ...", without a line of
    # mpcore's source under it; filters by category or message apply.
    warnings.warn_explicit(text, RuntimeWarning, "<mpcore>", 1, module="mpcore")


def _resolve(target):
    """The object a dotted target names, importing its modules as needed;
    raises Missing with why."""
    if "[" in target:
        return None   # a registry entry: nothing to read
    if "!" in target:
        return _resolve_c(*target.split("!"))
    parts = target.split(".")
    name = parts[0]
    try:
        obj = sys.modules.get(name) or __import__(name)
    except ModuleNotFoundError:
        raise Missing(f"{name} is not installed") from None
    except Exception as e:
        raise Missing(f"{name} cannot be imported ({type(e).__name__}: {e})") from None
    for part in parts[1:]:
        try:
            obj = getattr(obj, part)
            name += "." + part
            continue
        except AttributeError:
            pass
        sub = name + "." + part
        if not isinstance(obj, type(sys)):
            raise Missing(f"lacks {sub}")
        try:
            __import__(sub)
            obj = sys.modules[sub]
        except ModuleNotFoundError:
            raise Missing(f"lacks {sub}") from None
        except Exception as e:
            raise Missing(f"{sub} cannot be imported ({type(e).__name__}: {e})") from None
        name = sub
    return obj


def _resolve_c(lib, symbol):
    """The ctypes function `symbol` of torch's library `lib`, which torch's
    import loaded (a library not loaded is not loaded here)."""
    import ctypes
    torch = sys.modules.get("torch")
    if torch is None:
        raise Missing(f"{lib} is not loaded: torch is not imported")
    path = os.path.join(os.path.dirname(torch.__file__), "lib", lib)
    try:
        handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
    except OSError:
        raise Missing(f"lacks {lib} (not at {path}, or not loaded)") from None
    try:
        return getattr(handle, symbol)
    except AttributeError:
        raise Missing(f"lacks {symbol} in {lib}") from None


def _check_c(row, fn):
    """None when the C function fn ("c:TYPE=BINDING": it takes nothing and
    returns TYPE) answers what torch's Python binding answers, else why not."""
    import ctypes
    kind, binding = row.shape[2:].split("=")
    fn.argtypes, fn.restype = [], {"bool": ctypes.c_bool, "int64": ctypes.c_int64}[kind]
    try:
        want = _resolve(binding)()
    except Missing as e:
        return str(e)
    got = fn()
    return None if got == want else f"{row.target} gave {got!r} where {binding} gave {want!r}"


def _params(obj):
    import inspect
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def _check_shape(row, obj, new=None):
    """None when obj has the row's shape, else why not."""
    shape = row.shape
    if row.kind == "add" or "[" in row.target:
        return None
    if shape == "exists":
        return None
    if shape.startswith("c:"):
        return _check_c(row, obj)
    if shape == "class":
        return None if isinstance(obj, type) else f"{row.target} is not a class"
    if not shape.startswith("attrs:") and not callable(obj):
        return f"{row.target} is not callable"
    if shape.startswith("attrs:"):
        lacks = [a for a in shape[6:].split(",") if not hasattr(obj, a)]
        return f"{row.target} lacks {', '.join(lacks)}" if lacks else None
    if shape.startswith("params:"):
        ps = _params(obj)
        lacks = [p for p in shape[7:].split(",") if ps is not None and p not in ps]
        return f"{row.target} takes no {', '.join(lacks)}" if lacks else None
    if shape == "same params" and new is not None:
        mine, theirs = _params(new), _params(obj)
        if mine is not None and theirs is not None and mine != theirs:
            return f"{row.target} takes ({', '.join(theirs)}), not ({', '.join(mine)})"
    return None


def _row(target):
    row = TABLE.get(target)
    if row is None:   # a programming error of mpcore's own: every target has its row
        raise KeyError(f"{target} is not in mpcore's table of torch changes (_torchapi.TABLE)")
    return row


def _check(row):
    """Resolves and checks a row; returns the object, raises Missing."""
    try:
        obj = _resolve(row.target)
    except Missing as e:
        row.status, row.why = "missing", str(e)
        raise Missing(row.why) from None
    why = _check_shape(row, obj)
    if why is not None:
        row.status, row.why = "wrong shape", why
        raise Missing(why)
    return obj


def serves(feature):
    """Whether a feature is served on this torch: the window holds and every
    row of it that is checked ahead checks (NOTE [ A feature torch cannot
    carry falls back ]); checked once.  A feature not served warns once
    per program."""
    got = _served.get(feature)
    if got is not None:
        return got[0]
    if feature not in FEATURES:
        raise KeyError(f"{feature!r} is not a feature of mpcore's table")
    if not check_window():
        _served[feature] = (False, _window[1])
        return False
    why = None
    for row in TABLE.values():
        if row.feature != feature or row.at_use or row.kind == "add":
            continue
        if row.status in ("ok", "replaced"):
            continue
        try:
            _check(row)
            if row.status == "unchecked":
                row.status = "ok" if row.kind == "read" else "checked"
        except Missing as e:
            why = str(e)
            break
    if why is None:
        _served[feature] = (True, None)
        return True
    fall_back(feature, why)
    return False


def fall_back(feature, why):
    """Records that a feature is not served (why: what torch lacks), marks
    its replacements as kept, and warns once per program."""
    _served[feature] = (False, why)
    for row in TABLE.values():
        if row.feature == feature and row.kind != "read" and row.status in ("unchecked",
                                                                            "checked"):
            row.status, row.why = "kept torch's", f"{feature} is not served"
    if why.endswith("is not installed"):
        return    # a library torch's feature needs (torchdata) is absent: nothing falls back
    _warn(f"mpcore: {because(why)}; {FEATURES[feature][1]} (`mpcore doctor` tells what "
          f"mpcore serves on this torch)")


def because(why):
    """A row's why as a clause: "torch 2.8.0 lacks X", "torchdata is not
    installed"."""
    if why is None or not why.startswith(("lacks", "is outside")):
        return why
    return f"torch {torch_version()} {why}"


def report_feature(feature):
    """Why a feature is not served ("torch 2.8.0 lacks X"), or None."""
    served, why = _served.get(feature, (True, None))
    return None if served else because(why)


def get(target, feature=None):
    """torch's object at target, checked against its row's shape, and
    recorded; raises Missing (an AttributeError) with why when it is missing
    or of another shape.  For install time: keep what it returns."""
    row = _row(target)
    if feature is not None and feature != row.feature:
        raise KeyError(f"{target} is a row of {row.feature!r}, not {feature!r}")
    obj = _check(row)
    if row.kind == "read":
        row.status, row.why = "ok", None
    return obj


def find(target):
    """get(target), or None when it is missing (recorded)."""
    try:
        return get(target)
    except Missing:
        return None


def replace(target, new, feature=None, wraps=False):
    """Puts new in place of torch's attribute at target when the row's
    feature is served and torch's attribute has the row's shape (for "same
    params": the same parameters as new).  Returns torch's value (what was
    there; None for an "add" of a name torch lacked); returns None, leaving
    torch's in place, when it did not replace (recorded: kept torch's).
    wraps: new takes torch's function's name, module and doc
    (functools.update_wrapper), once the check has passed."""
    row = _row(target)
    if feature is not None and feature != row.feature:
        raise KeyError(f"{target} is a row of {row.feature!r}, not {feature!r}")
    if not serves(row.feature):
        row.status, row.why = "kept torch's", f"{row.feature} is not served"
        return None
    owner_name, name = target.rsplit(".", 1)
    try:
        owner = _resolve(owner_name)
    except Missing as e:
        row.status, row.why = "missing", str(e)
        return None
    if row.kind == "add":
        if row.status == "added":
            return None   # added already (a second install)
        if hasattr(owner, name):
            row.status, row.why = "kept torch's", f"torch has {target}"
            return None
        setattr(owner, name, new)
        row.status, row.why = "added", None
        return None
    old = getattr(owner, name, _ABSENT)
    if old is _ABSENT:
        row.status, row.why = "missing", f"lacks {target}"
        return None
    old = _originals.get(target, old) if _is_ours(old) else old
    why = _check_shape(row, old, new)
    if why is not None:
        row.status, row.why = "kept torch's", why
        return None
    _originals.setdefault(target, old)
    if wraps:
        import functools
        functools.update_wrapper(new, old)
    setattr(owner, name, new)
    row.status, row.why = "replaced", None
    return old


_ABSENT = object()


def _is_ours(value):
    mod = getattr(getattr(value, "__func__", value), "__module__", None)
    return isinstance(mod, str) and (mod == "mpcore" or mod.startswith("mpcore."))


class swapped:
    """`with swapped(target, new):` new in place of torch's attribute at
    target for the block, torch's again after it: a replace() that lasts one
    call.  The row is checked as get() checks it, and Missing is raised when
    the check fails, since the caller relies on the swap."""

    def __init__(self, target, new):
        self._target, self._new = target, new

    def __enter__(self):
        self._old = get(self._target)
        owner_name, self._name = self._target.rsplit(".", 1)
        self._owner = _resolve(owner_name)
        setattr(self._owner, self._name, self._new)
        row = _row(self._target)
        row.status, row.why = "replaced", None
        return self._old

    def __exit__(self, *exc):
        setattr(self._owner, self._name, self._old)
        return False


def original(target):
    """torch's value at target before replace() put mpcore's there (None if
    nothing was replaced)."""
    return _originals.get(target)


def mark(target, status, why=None):
    """Records what was done to a row that get()/replace() cannot do
    themselves (a registry entry such as ForkingPickler's)."""
    row = _row(target)
    row.status, row.why = status, why


def check_all():
    """Checks every feature and every at_use row, as doctor reports them
    (imports the modules they live in)."""
    for feature in FEATURES:
        serves(feature)
    for row in TABLE.values():
        if row.status == "unchecked" and row.kind != "add":
            try:
                _check(row)
                row.status = "ok" if row.kind == "read" else "checked"
            except Missing:
                pass


def report():
    """The table and the features, for `mpcore doctor` (JSON-ready)."""
    v = torch_version()
    feats = []
    for name, (what, otherwise) in FEATURES.items():
        served, why = _served.get(name, (None, None))
        feats.append({"feature": name, "serves": what, "served": served,
                      "why": because(why), "otherwise": otherwise})
    return {"torch": v, "window": list(WINDOW), "in_window": None if v is None else in_window(v),
            "window_lifted": os.environ.get(_ANY_ENV) == "1",
            "features": feats, "table": [r.as_dict() for r in TABLE.values()]}
