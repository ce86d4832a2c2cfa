"""`mpcore doctor`: what a user needs to know about this machine before a
multi-process job fails on it.

NOTE [ What doctor looks at, and in which order ]
Each section is a dict of facts; a *problem* is one line that says what is
wrong and what to do about it.  The sections run in an order that keeps
each one truthful:
- the zygote first, as `mpcore run` starts it: forked from this process
  the moment torch has been imported, or started by exec when that cannot
  be (no torch, MPCORE_ZYGOTE_PRELOAD set).  The thread count is taken at
  that very moment (a hook on torch's import, registered before the
  zygote's own), so it is the count the zygote sees; then one child is
  started through it and the zygote is stopped.  Nothing that may start a
  thread (CUDA, NCCL) runs before it;
- then torch's entry points, served exactly as `mpcore run` serves them,
  and read back from torch's own modules (NOTE [ Entry points as torch
  sees them ]);
- then NCCL and the GPUs.
Doctor leaves nothing behind: the zygote and its child are reaped here,
and the keeper and multiprocessing's resource tracker end with this
process, as for any mpcore program.
"""
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings

USAGE = """usage: mpcore doctor [--json] [--workers N]

Reports what a multi-process job needs from this machine: the memory cgroup,
/dev/shm, RLIMIT_NOFILE, start methods and the zygote, torch/numpy and the ABI
mpcore was built for, NCCL, GPUs, the torch entry points `mpcore run` serves,
and whether torch is inside mpcore's window and which parts mpcore serves on
it (--json: the whole table of torch changes).
Each problem found gets one line that says what to do about it.

  --json       print one JSON object with the same facts (and "problems")
  --workers N  size the checks for N processes (default: the CPUs it may use)

exit status: 0 when no problem was found, 1 when there are problems,
2 on bad arguments."""

MIB = 1 << 20


def _mib(n):
    return f"{n / MIB:.0f} MiB" if n < 10 * (1 << 30) else f"{n / (1 << 30):.1f} GiB"


# --- memory cgroup ----------------------------------------------------------

def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_dir(proc_cgroup, sysfs):
    """(version, directory) of the memory cgroup that /proc/self/cgroup's
    text names, found as the core finds it (mpc__cgroup_dir in
    csrc/shm.c): the v1 memory controller's, else the v2 unified one;
    (0, None) when there is none."""
    v2 = None
    for line in (proc_cgroup or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if ctrls == "":
            v2 = path
        elif "memory" in ctrls.split(","):
            return 1, f"{sysfs}/memory{path}".rstrip("/")
    if v2 is not None:
        return 2, f"{sysfs}{v2}".rstrip("/")
    return 0, None


# A v1 cgroup without a limit reports the largest page-aligned int64.
_NO_LIMIT = 1 << 62
# NOTE [ Memory headroom ]
# memfd pages are charged to the memory cgroup, and a job that commits past
# the limit is SIGKILLed by the OOM killer with no error (mpcore checks
# before it reserves, so its own requests fail with MemoryError instead).
# Less than this much headroom is reported as a problem.
HEADROOM_MIN = 1 << 30


def memory(proc_cgroup=None, sysfs="/sys/fs/cgroup"):
    """The tightest memory cgroup limit of this process and its ancestors,
    with usage and headroom, and what mpcore's own check allows.  (Tests
    pass another process's /proc/self/cgroup text and cgroup tree.)"""
    from . import _core
    if proc_cgroup is None:
        proc_cgroup = _read("/proc/self/cgroup")
    ver, d = _cgroup_dir(proc_cgroup, sysfs)
    mine = d
    out = {"cgroup_version": ver or None, "cgroup": None, "limit_bytes": None,
           "usage_bytes": None, "headroom_bytes": None}
    root = f"{sysfs}/memory" if ver == 1 else sysfs
    lim_name, use_name = (("memory.limit_in_bytes", "memory.usage_in_bytes") if ver == 1
                          else ("memory.max", "memory.current"))
    while d:
        lim, use = _read(f"{d}/{lim_name}"), _read(f"{d}/{use_name}")
        if lim and lim.isdigit() and int(lim) < _NO_LIMIT and use and use.isdigit():
            lim, use = int(lim), int(use)
            head = max(0, lim - use)
            if out["headroom_bytes"] is None or head < out["headroom_bytes"]:
                out.update(cgroup=d, limit_bytes=lim, usage_bytes=use, headroom_bytes=head)
        if len(d) <= len(root) or "/" not in d:
            break
        d = d.rsplit("/", 1)[0]
    if out["cgroup"] is None:
        out["cgroup"] = mine
    try:
        avail, bound = _core.mem_available()
        out["mpcore_available_bytes"], out["mpcore_bound"] = int(avail), str(bound)
    except (OSError, RuntimeError) as e:
        out["mpcore_available_bytes"], out["mpcore_bound"] = None, str(e)
    return out


def memory_problems(m):
    if m["limit_bytes"] is not None and m["headroom_bytes"] < HEADROOM_MIN:
        return [f"memory cgroup {m['cgroup']} leaves {_mib(m['headroom_bytes'])} of its "
                f"{_mib(m['limit_bytes'])} limit: shared memory is charged to it and a job past "
                f"the limit is OOM-killed; raise the limit (e.g. `docker run --memory`) or "
                f"free memory"]
    return []


# --- /dev/shm ---------------------------------------------------------------

def dev_shm():
    try:
        st = os.statvfs("/dev/shm")
    except OSError as e:
        return {"present": False, "size_bytes": None, "free_bytes": None, "error": str(e)}
    return {"present": True, "size_bytes": st.f_blocks * st.f_frsize,
            "free_bytes": st.f_bavail * st.f_frsize, "error": None}


# NCCL's intra-node transport puts its buffers in /dev/shm (Docker's
# default is 64 MB); mpcore itself uses memfds, which /dev/shm does not bound.
DEV_SHM_MIN_FOR_NCCL = 256 * MIB


# --- open files ---------------------------------------------------------------

# NOTE [ How many fds a job needs ]
# mpcore passes a segment's fd once per process pair, not one per tensor
# as torch's file_descriptor strategy does, so a process needs few: under
# `mpcore run`, a DataLoader's main process with 8 workers held 34 fds at
# its peak (each worker 31), and a process that started 8 spawn children
# 27.  The estimate is a base for the interpreter, its libraries and the
# program's own files, plus a few per worker for its pipes, sentinel,
# sockets and segments, with room to spare; a soft limit below it is where
# "Too many open files" starts to be seen.
NOFILE_BASE = 256
NOFILE_PER_WORKER = 16


def nofile(workers):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    return {"soft": None if soft == inf else soft, "hard": None if hard == inf else hard,
            "workers": workers, "needed": NOFILE_BASE + NOFILE_PER_WORKER * workers}


def nofile_problems(n):
    soft, hard, need = n["soft"], n["hard"], n["needed"]
    if soft is None or soft >= need:
        return []
    want = max(need, 65536)
    if hard is None or hard >= want:
        fix = f"raise it with `ulimit -n {want}`"
    elif hard >= need:
        fix = f"raise it with `ulimit -n {hard}` (the hard limit)"
    else:
        fix = (f"the hard limit is {hard} too: raise both (`ulimit -Hn {want}` as root, "
               f"`docker run --ulimit nofile={want}:{want}`, or limits.conf)")
    return [f"RLIMIT_NOFILE soft limit {soft} is low for {n['workers']} workers "
            f"(about {need} fds): {fix}"]


# --- start methods and the zygote ---------------------------------------------

def _threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _child_exits():
    pass  # the zygote's test child: it only has to start and exit


def _stop_zygote():
    """Stops the zygote this process started and reaps it."""
    from .proc import _zygote
    pid = _zygote.stop()
    if pid is not None:
        _reap(pid, 10.0)
    return pid


def _reap(pid, timeout):
    """Waits up to `timeout` s for a child to exit (SIGKILL after that)."""
    import select
    import signal
    try:
        pfd = os.pidfd_open(pid)
    except OSError:
        pfd = None
    if pfd is not None:
        try:
            if not select.select([pfd], [], [], timeout)[0]:
                os.kill(pid, signal.SIGKILL)
        finally:
            os.close(pfd)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def zygote():
    """Starts the zygote as `mpcore run` would, asks it for one child, and
    stops it (NOTE [ What doctor looks at, and in which order ])."""
    from . import _hooks
    from .proc import _popen, _zygote
    os.environ.pop(_zygote.ENV, None)  # doctor tests a zygote of its own
    preload_env = os.environ.get(_zygote.PRELOAD_ENV)
    out = {"preload": (preload_env.split(",") if preload_env is not None
                       else ["numpy", "torch"]),
           "route": None, "threads_at_preload": None, "python_threads_at_preload": None,
           "started": False, "child_forked": False, "pid": None, "detail": None}
    seen = {}

    def at_preload(_module):
        seen["threads"] = _threads()
        seen["python_threads"] = threading.active_count()

    _hooks.when_imported("torch", at_preload)   # runs just before the zygote's fork
    _zygote.fork_at_torch_import()
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        pass
    if seen:
        out["threads_at_preload"] = seen["threads"]
        out["python_threads_at_preload"] = seen["python_threads"]
    else:
        # No torch import to hook: the zygote is started by exec, and
        # preloads in a process of its own; this process shows the count
        # after the same imports.
        out["threads_at_preload"] = _threads()
        out["python_threads_at_preload"] = threading.active_count()
    service = _zygote.started()
    forked = service is not None and service[1]
    out["route"] = "forked at torch's import" if forked else "started by exec"
    ctx = __import__("mpcore").get_context("spawn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = ctx.Process(target=_child_exits, name="mpcore-doctor-child")
            p.start()
            p.join(60)
        if p.exitcode is None:
            p.kill()
            p.join()
            out["detail"] = "the test child did not exit within 60 s"
        elif p.exitcode != 0:
            out["detail"] = f"the test child exited with {p.exitcode}"
        out["child_forked"] = isinstance(p._popen, _popen.Popen) and p.exitcode == 0
        service = _zygote.started()
        if service is not None:
            out["started"] = True
            out["pid"] = service[0]
            # a forked zygote that found a thread it could not lose has
            # left, and start() replaced it by one started by exec
            if not service[1] and forked:
                out["route"] = "started by exec (the forked one had a thread and left)"
        fallback = [str(w.message) for w in caught if "mpcore:" in str(w.message)]
        if fallback:
            out["detail"] = fallback[0]
    except Exception as e:  # reported, not raised: doctor goes on
        out["detail"] = f"{type(e).__name__}: {e}"
    finally:
        _stop_zygote()
    return out


def zygote_problems(z):
    if z["started"] and z["child_forked"]:
        return []
    why = z["detail"] or "it did not start"
    return [f"the zygote cannot fork children ({why}): spawn children start by exec, each "
            f"importing torch again; find which of the modules it preloads "
            f"({', '.join(z['preload'])}; MPCORE_ZYGOTE_PRELOAD sets them) leaves a thread "
            f"running, and stop it or leave that module out"]


def start_methods():
    import multiprocessing as mp
    return {"available": mp.get_all_start_methods(),
            "default": mp.get_context().get_start_method(),
            "mpcore_zygote_serves": ["spawn", "forkserver"]}


# --- versions and ABI -----------------------------------------------------------

def _version(name):
    try:
        mod = __import__(name)
    except ImportError:
        return None
    return getattr(mod, "__version__", "unknown")


def _hexver(v):
    return f"0x{v:08x}"


def versions():
    from . import _core
    import mpcore
    build = dict(getattr(_core, "BUILD", {}))
    out = {"mpcore": mpcore.__version__, "python": platform.python_version(),
           "python_abi": sys.implementation.cache_tag,
           "torch": _version("torch"), "numpy": _version("numpy"),
           "core_file": os.path.basename(_core.__file__),
           "built_for_python": build.get("python"),
           "built_numpy_abi": (_hexver(build["numpy_abi"]) if "numpy_abi" in build else None),
           "built_numpy_api": (_hexver(build["numpy_api"]) if "numpy_api" in build else None),
           "built_numpy_oldest": build.get("numpy_oldest") or None,
           "numpy_abi": None}
    try:
        try:
            from numpy._core._multiarray_umath import _get_ndarray_c_version
        except ImportError:
            from numpy.core._multiarray_umath import _get_ndarray_c_version
        out["numpy_abi"] = _hexver(_get_ndarray_c_version())
    except ImportError:
        pass
    return out


def version_problems(v):
    probs = []
    built = v["built_for_python"]
    if built and built.split(".")[:2] != v["python"].split(".")[:2]:
        probs.append(f"mpcore's core was built for Python {built} but runs on {v['python']}: "
                     f"reinstall mpcore with this interpreter")
    oldest = v["built_numpy_oldest"]
    if v["numpy"] is None:
        probs.append("numpy is not installed: mpcore needs it; `pip install numpy`")
    elif oldest and _major_minor(v["numpy"]) < _major_minor(oldest):
        probs.append(f"numpy {v['numpy']} is older than the {oldest} mpcore's core was built "
                     f"for: `pip install 'numpy>={oldest}'`")
    return probs


def _major_minor(version):
    try:
        return tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return (0, 0)


# --- torch's entry points -------------------------------------------------------

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _ours(value):
    """Whether a value is one of mpcore's objects: by its module, or, for a
    function that wears the name and module of the torch function it stands
    in for (functools.wraps), by where its code is."""
    if isinstance(value, str):
        return value == "mpcore"  # the backend's name, in torch's registries
    try:
        value = getattr(value, "__func__", value)  # staticmethod, classmethod, bound method
        mod = getattr(value, "__module__", None)
        code = getattr(value, "__code__", None)
        where = getattr(code, "co_filename", None)
    except Exception:  # an object whose attributes cannot be read is not ours
        return False
    if isinstance(where, str) and where.startswith(_PKG_DIR):
        return True
    return isinstance(mod, str) and (mod == "mpcore" or mod.startswith("mpcore."))


def _scan_dict(prefix, d, out, classes):
    for name, value in list(d.items()):
        if _ours(value):
            out.append(f"{prefix}.{name}")
        elif isinstance(value, dict) and len(value) < 1000:
            for k, v in list(value.items()):
                if _ours(v) or (isinstance(v, tuple) and any(map(_ours, v))):
                    out.append(f"{prefix}.{name}[{k!r}]")
        elif (classes is not None and isinstance(value, type)
              and value.__module__ == prefix and id(value) not in classes):
            classes.add(id(value))
            _scan_dict(f"{prefix}.{value.__qualname__}", vars(value), out, None)


def entry_points():
    """The torch entry points `mpcore run` serves (NOTE [ Entry points as
    torch sees them ])."""
    from . import _hooks
    from .run import _boot
    out = {"torch": None, "served": [], "pickled_by_mpcore": []}
    try:
        import torch
    except ImportError:
        torch = None
    with warnings.catch_warnings():
        # mpcore's fallback warning: the torch_api section reports each fallback
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="mpcore")
        _boot.serve_torch(patch_multiprocessing=True)
        if torch is not None:
            # Import what the hooks still wait for, as a program that uses it would.
            for _ in range(10):
                pending = [n for n in _hooks.pending() if _torch_module(n)]
                if not pending:
                    break
                for name in pending:
                    try:
                        __import__(name)
                    except ImportError:
                        _hooks.forget(name)
    if torch is not None:
        out["torch"] = torch.__version__
        classes = set()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated names warn when read
            for name, mod in sorted(sys.modules.items()):
                if _torch_module(name) and mod is not None:
                    d = getattr(mod, "__dict__", None)
                    if isinstance(d, dict):
                        _scan_dict(name, d, out["served"], classes)
    from multiprocessing.reduction import ForkingPickler
    for cls, reducer in list(ForkingPickler._extra_reducers.items()):
        if _ours(reducer):
            out["pickled_by_mpcore"].append(f"{cls.__module__}.{cls.__qualname__}")
    out["pickled_by_mpcore"].sort()
    return out


def _torch_module(name):
    """torch's modules, and torchdata's (whose StatefulDataLoader is served)."""
    return name.split(".", 1)[0] in ("torch", "torchdata")


# NOTE [ Entry points as torch sees them ]
# The list is not written down here: doctor serves torch as `mpcore run`
# does (_boot.serve_torch, importing every module its hooks wait for), then
# reads torch's modules back and lists every name, class attribute and
# registry entry that now holds an mpcore object (or names mpcore's
# backend), and every type ForkingPickler sends through mpcore.  What the
# hooks patch is what is listed, so the two cannot drift apart.


# --- the torch window and what is served on it -----------------------------------

# NOTE [ What doctor says of the torch ]
# Every feature of mpcore's table of torch changes (_torchapi.py) is checked
# on the installed torch, every row of the table too (importing the modules
# they live in, which a program that needs them imports anyway), and doctor
# lists which features are served and, for each one that is not, what torch
# lacks and what stays torch's.  A feature not served is no problem: mpcore
# falls back to torch's own way by design.  A torch outside the window is
# one: mpcore then serves nothing of it.  --json carries the whole table.

def torch_api():
    from . import _torchapi
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the fallback warning: reported below instead
        from .dist._recorder import doctor_facts   # NOTE [ The Flight Recorder ] there
        fr = doctor_facts()
        _torchapi.check_all()
    return dict(_torchapi.report(), flight_recorder=fr)


def torch_api_problems(t):
    if t["torch"] is None or t["in_window"] or t["window_lifted"]:
        return []
    return [f"torch {t['torch']} is outside mpcore's window (torch {t['window'][0]} to "
            f"{t['window'][1]}): mpcore serves nothing of it; install a torch in the window "
            f"(`pip install 'torch>={t['window'][0]},<={t['window'][1]}'`)"]


def _text_torch_api(t):
    lo, hi = t["window"]
    if t["torch"] is None:
        yield f"torch is not installed (mpcore's window: torch {lo} to {hi})"
        return
    where = "inside" if t["in_window"] else "OUTSIDE"
    yield (f"torch {t['torch']}: {where} mpcore's window (torch {lo} to {hi})"
           + ("; MPCORE_TORCH_ANY=1 lifts it" if t["window_lifted"] else ""))
    served = [f["feature"] for f in t["features"] if f["served"]]
    if served:
        yield f"served: {', '.join(served)}"
    for f in t["features"]:
        if not f["served"]:
            yield f"not served: {f['feature']} ({f['why']}): {f['otherwise']}"
    if (t.get("flight_recorder") or {}).get("note"):
        yield t["flight_recorder"]["note"]
    changed = sum(r["status"] in ("replaced", "added") for r in t["table"])
    yield (f"{len(t['table'])} rows in mpcore's table of torch changes, {changed} replaced or "
           f"added here (`mpcore doctor --json` lists them)")


# --- NCCL and GPUs --------------------------------------------------------------

def _nccl_version_string(code):
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def nccl():
    from . import _core
    from .dist import _nccl
    out = {"found": False, "path": None, "how": None, "version": None, "error": None}
    try:
        out["how"] = _nccl.load()
    except RuntimeError as e:
        out["error"] = str(e)
        return out
    out["found"] = True
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "libnccl" in os.path.basename(parts[5]):
                out["path"] = parts[5]
                break
    try:
        out["version"] = _nccl_version_string(_core.nccl_version())
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def gpus():
    out = {"torch_cuda_available": False, "torch_cuda_version": None, "torch_devices": [],
           "torch_error": None, "nvidia_smi": None, "smi_gpus": [], "driver": None,
           "smi_error": None}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        out["torch_cuda_version"] = torch.version.cuda
        try:
            if torch.cuda.is_available():
                out["torch_cuda_available"] = True
                out["torch_devices"] = [torch.cuda.get_device_name(i)
                                        for i in range(torch.cuda.device_count())]
        except Exception as e:  # a broken driver: reported, not raised
            out["torch_error"] = f"{type(e).__name__}: {e}"
    smi = shutil.which("nvidia-smi")
    out["nvidia_smi"] = smi
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=20)
            for line in r.stdout.splitlines():
                fields = [x.strip() for x in line.split(",")]
                if len(fields) == 3:
                    out["smi_gpus"].append(f"{fields[0]} ({fields[2]})")
                    out["driver"] = fields[1]
            if r.returncode != 0:
                out["smi_error"] = (r.stderr or r.stdout).strip()[-300:]
        except (OSError, subprocess.TimeoutExpired) as e:
            out["smi_error"] = str(e)
    return out


def gpu_problems(g, n, shm, torch_version):
    probs = []
    if g["smi_gpus"] and torch_version is not None and not g["torch_cuda_available"]:
        why = ("a CPU build of torch" if g["torch_cuda_version"] is None
               else f"torch built for CUDA {g['torch_cuda_version']} sees none")
        probs.append(f"nvidia-smi sees {len(g['smi_gpus'])} GPU(s) but {why}: install a torch "
                     f"build for this driver ({g['driver']})")
    if (g["torch_cuda_available"] or g["smi_gpus"]) and not n["found"]:
        probs.append("GPUs are present but NCCL was not found: `pip install nvidia-nccl-cu12` "
                     "(or -cu13, matching torch's CUDA)")
    if ((g["torch_cuda_available"] or g["smi_gpus"]) and shm["present"]
            and shm["free_bytes"] < DEV_SHM_MIN_FOR_NCCL):
        probs.append(f"/dev/shm has {_mib(shm['free_bytes'])} free and NCCL keeps its "
                     f"intra-node buffers there: enlarge it (`docker run --shm-size=1g`)")
    return probs


# --- the report -----------------------------------------------------------------

def collect(workers):
    """Every section, then the problems found in them.  A check that fails
    outright is a problem of its own: its section holds only the error,
    it is named in "unchecked", and the other sections are still
    reported."""
    report, unchecked = {}, []
    # NOTE [ What doctor looks at, and in which order ]
    for name, check in (("zygote", zygote), ("start_methods", start_methods),
                        ("memory", memory), ("dev_shm", dev_shm),
                        ("nofile", lambda: nofile(workers)), ("versions", versions),
                        ("entry_points", entry_points), ("torch_api", torch_api),
                        ("nccl", nccl), ("gpus", gpus)):
        try:
            report[name] = check()
        except Exception as e:
            report[name] = {"error": f"{type(e).__name__}: {e}"}
            unchecked.append(name)
    ok = lambda *names: not any(n in unchecked for n in names)  # noqa: E731
    problems = []
    for name, find in (("memory", memory_problems), ("nofile", nofile_problems),
                       ("zygote", zygote_problems), ("versions", version_problems),
                       ("torch_api", torch_api_problems)):
        if ok(name):
            problems += find(report[name])
    if ok("gpus", "nccl", "dev_shm", "versions"):
        problems += gpu_problems(report["gpus"], report["nccl"], report["dev_shm"],
                                 report["versions"]["torch"])
    problems += [f"doctor could not check {name} ({report[name]['error']}): please report "
                 f"this with the output of `mpcore doctor --json`" for name in unchecked]
    report["unchecked"] = unchecked
    report["problems"] = problems
    return report


def _or(v, none):
    return none if v is None else v


# torch.FloatTensor, torch.cuda.sparse.HalfTensor, ...: listed in full in --json
_LEGACY = re.compile(r"^torch(\.cuda)?(\.sparse)?\.\w+Tensor$")


def _grouped(names):
    """[(where, [names])]: entry points grouped by the module or class
    that holds them, in order of first appearance."""
    groups = {}
    for n in names:
        cut = n.index("[") if "[" in n else len(n)
        where, last = n[:cut].rsplit(".", 1)
        groups.setdefault(where, []).append(last + n[cut:])
    return list(groups.items())


def _text_memory(m):
    if m["limit_bytes"] is None:
        yield (f"no limit (cgroup v{m['cgroup_version']}: {m['cgroup']})" if m["cgroup_version"]
               else "no limit (no memory cgroup)")
    else:
        yield (f"v{m['cgroup_version']} {m['cgroup']}: limit {_mib(m['limit_bytes'])}, "
               f"used {_mib(m['usage_bytes'])}, headroom {_mib(m['headroom_bytes'])}")
    if m["mpcore_available_bytes"] is not None:
        yield (f"mpcore may still allocate {_mib(m['mpcore_available_bytes'])} "
               f"(bound: {m['mpcore_bound']})")


def _text_dev_shm(s):
    if s["present"]:
        yield f"size {_mib(s['size_bytes'])}, free {_mib(s['free_bytes'])}"
    else:
        yield f"absent ({s['error']})"
    yield "mpcore does not depend on it: its shared memory is memfd segments"


def _text_nofile(n):
    yield (f"soft {_or(n['soft'], 'unlimited')}, hard {_or(n['hard'], 'unlimited')} "
           f"(about {n['needed']} needed for {n['workers']} workers)")


def _text_start_methods(sm):
    yield (f"available: {', '.join(sm['available'])}; default: {sm['default']}; "
           f"mpcore's zygote serves {' and '.join(sm['mpcore_zygote_serves'])}")


def _text_zygote(z):
    yield (f"preloads {', '.join(z['preload']) or 'nothing'}; {z['route']}; threads at "
           f"preload: {z['threads_at_preload']} ({z['python_threads_at_preload']} Python)")
    yield (f"started: {'yes' if z['started'] else 'no'}; forked a test child: "
           f"{'yes' if z['child_forked'] else 'no'}" + (f" ({z['detail']})" if z["detail"] else ""))


def _text_versions(v):
    yield (f"mpcore {v['mpcore']}, Python {v['python']} ({v['python_abi']}), "
           f"torch {_or(v['torch'], 'not installed')}, numpy {_or(v['numpy'], 'not installed')}")
    yield (f"core {v['core_file']}: built for Python {v['built_for_python']}, numpy ABI "
           f"{v['built_numpy_abi']} C API {v['built_numpy_api']} (runs on numpy >= "
           f"{v['built_numpy_oldest']}); this numpy's ABI {_or(v['numpy_abi'], '-')}")


def _short(path):
    """A path under the working directory as relative to it (the JSON keeps
    it whole)."""
    rel = os.path.relpath(path) if path else path
    return rel if rel and not rel.startswith("..") else path


def _text_nccl(nc):
    if nc["found"]:
        yield (f"found: {nc['version']} at {_short(nc['path'])}"
               + (f" ({nc['how']})" if nc["how"] != nc["path"] else ""))
    else:
        yield f"not found ({nc['error']})"


def _text_gpus(g):
    if g["torch_devices"]:
        yield f"torch (CUDA {g['torch_cuda_version']}): {', '.join(g['torch_devices'])}"
    else:
        yield "torch: none" + (f" (torch built for CUDA {g['torch_cuda_version']})"
                               if g["torch_cuda_version"] else "")
    if g["nvidia_smi"] is None:
        yield "nvidia-smi: not found"
    else:
        yield (f"nvidia-smi: {', '.join(g['smi_gpus']) or 'none'}"
               + (f"; driver {g['driver']}" if g["driver"] else ""))


def _text_entry_points(e):
    if e["torch"] is None:
        yield "none: torch is not installed"
    for where, names in _grouped(e["served"]):
        yield f"{where}: {', '.join(names)}"
    if e["pickled_by_mpcore"]:
        legacy = [t for t in e["pickled_by_mpcore"] if _LEGACY.match(t)]
        rest = [t for t in e["pickled_by_mpcore"] if t not in legacy]
        yield (f"pickled through mpcore's shared memory: {', '.join(rest)}"
               + (f", and {len(legacy)} legacy typed tensor classes ({legacy[0]}, ...)"
                  if legacy else ""))


# (section, its heading, its lines) in the order the text shows them
_TEXT = (("memory", "memory cgroup", _text_memory), ("dev_shm", "/dev/shm", _text_dev_shm),
         ("nofile", "open files (RLIMIT_NOFILE)", _text_nofile),
         ("start_methods", "start methods", _text_start_methods),
         ("zygote", "zygote", _text_zygote), ("versions", "versions", _text_versions),
         ("nccl", "NCCL", _text_nccl), ("gpus", "GPUs", _text_gpus),
         ("entry_points", "torch entry points served under `mpcore run`", _text_entry_points),
         ("torch_api", "the torch window and what mpcore serves on it", _text_torch_api))


def render(r):
    """The report as text: each section under its heading, then the
    problems, one line each."""
    lines = []
    for name, heading, text in _TEXT:
        lines.append(heading)
        body = ([f"could not be checked: {r[name]['error']}"] if name in r["unchecked"]
                else text(r[name]))
        for line in body:  # long lists wrap; a problem stays on its one line
            lines += textwrap.wrap(line, 100, initial_indent="  ", subsequent_indent="    ",
                                   break_on_hyphens=False, break_long_words=False)
    lines.append("")
    if r["problems"]:
        lines.append(f"{len(r['problems'])} problem(s):")
        lines += [f"  - {p}" for p in r["problems"]]
    else:
        lines.append("no problems found")
    return "\n".join(lines)


def main(argv):
    """`mpcore doctor [--json] [--workers N]`: prints the report; returns 0
    when no problem was found, 1 when there are problems, 2 on bad
    arguments (with the usage on stderr)."""
    as_json, workers = False, None
    args = list(argv)
    while args:
        a = args.pop(0)
        if a in ("-h", "--help"):
            print(USAGE)
            return 0
        if a == "--json":
            as_json = True
        elif a == "--workers" or a.startswith("--workers="):
            val = a.split("=", 1)[1] if "=" in a else (args.pop(0) if args else "")
            try:
                workers = int(val)
                if workers < 1:
                    raise ValueError
            except ValueError:
                print(f"mpcore doctor: --workers needs a positive integer, not {val!r}\n"
                      f"{USAGE}", file=sys.stderr)
                return 2
        else:
            print(f"mpcore doctor: unknown argument {a!r}\n{USAGE}", file=sys.stderr)
            return 2
    if workers is None:
        workers = len(os.sched_getaffinity(0))  # the CPUs this process may run on
    report = collect(workers)
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if as_json else render(report) + "\n")
    sys.stdout.flush()
    return 1 if report["problems"] else 0
