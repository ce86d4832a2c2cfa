"""Counters of what mpcore served in this process (mpcore.stats()).

With MPCORE_STATS=path set, each process that imported mpcore appends its
counters to that file as one JSON line when it exits normally."""
import atexit
import json
import os

counts = {}  # name -> count; the core counts into it too (_core.torch_hooks)


def bump(name, n=1):
    counts[name] = counts.get(name, 0) + n


def snapshot():
    from . import _core
    out = dict(counts)
    for k, v in _core.stats().items():
        out[k if k.startswith("handles_") else "shm_" + k] = v
    return out


_reported = None  # the pid that appended its line already


def report():
    """Appends this process's counters to $MPCORE_STATS, if set, once per
    process (at exit, and when a Process's _bootstrap ends: a forked child
    leaves by os._exit, which runs no atexit hook)."""
    global _reported
    path = os.environ.get("MPCORE_STATS")
    if not path or _reported == os.getpid():
        return
    _reported = os.getpid()
    line = json.dumps({"pid": os.getpid(), **snapshot()})
    with open(path, "a") as f:
        f.write(line + "\n")


def _after_fork_child():
    # A child counts what it serves itself, from zero.
    counts.clear()


atexit.register(report)
os.register_at_fork(after_in_child=_after_fork_child)
