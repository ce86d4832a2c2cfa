"""The Work of the group's calls (NOTE [ The backend is a ProcessGroup ] in
_group.py): Work for a call that runs on the group's thread, Done for one
complete on return, AllOf for a coalescing block."""
import datetime

import torch
import torch.distributed as dist

from .. import _core, _torchapi
from . import _dist, _profile
from ._reduce import check_op

NO_TIMEOUT = datetime.timedelta(0)

# NOTE [ A Work only torch's C++ holds ]
# torch's C++ keeps the Work a call of this group returned (the functional
# collectives' registry until wait_tensor, DDP's reducer until it takes the
# future) while Python may drop it.  From torch 2.7 c10d keeps the Python
# object alive with it.  Before, the Python object dies, the C++ part it
# leaves forgets the Python methods, and its wait() waits for ever for a
# completion only Python knew of (a functional collective hangs at the
# first garbage collection after the call).  On such a torch each Work is
# held in HELD until it is waited on or its future is taken, which is what
# every C++ holder does with it.  The price: a Work a program drops without
# ever waiting on it (async_op=True, never waited) stays alive, with its
# tensors, until the program ends.
HOLD = not _torchapi.at_least("2.7")
HELD = {}


def held(work):
    """work, kept alive until wait() or get_future() where HOLD says so."""
    HELD[id(work)] = work
    return work


def let_go(work):
    """The end of held(work): it was waited on, or its future was taken."""
    HELD.pop(id(work), None)


class Work(_dist.Work, dist.Work):
    """torch's Work for a call of the group (NOTE [ The backend is a
    ProcessGroup ]): wait(timeout), is_completed, exception, get_future,
    result; _source_rank for a receive (None for any other call, of which
    torch's Work refuses it, as here); the profiler's events of the call
    that made it, which end before a waiter wakes (NOTE [ Collectives in
    the profiler ])."""

    source = None   # the source rank of a receive, once it is done
    # a lane may give it again (NOTE [ A Work used again ] in _dist.py) where
    # torch's C++ holds it by a Python reference
    reusable = not HOLD

    def __init__(self, tensors):
        dist.Work.__init__(self)
        _dist.Work.__init__(self, tensors)
        if _profile.recording:
            self.profiler_events = getattr(_profile.inside, "events", None)
        if HOLD:
            held(self)

    def _wait(self, timeout=NO_TIMEOUT):
        if HOLD:
            let_go(self)
        if not self._done:
            if timeout is NO_TIMEOUT:   # no timeout: what follows, without reading one
                self.lane.wait_for(self)
            else:
                s = _dist.seconds(timeout)
                if not s or s <= 0:
                    self.lane.wait_for(self)
                elif not self.lane.await_done(self, s):
                    raise TimeoutError(f"Work.wait: the collective did not complete within "
                                       f"{s:g} s (it goes on; wait again or look at the "
                                       "group's timeout)")
        if self._exc is not None:
            raise self._exc
        return True

    # wait(timeout=None): in C, which calls _wait with a timeout (NOTE
    # [ Work.wait in C ] in py_lane.c); _wait alone where HOLD, whose Works
    # are let go of as they are waited on
    wait = _wait if HOLD else _core.WorkWait(_wait)

    def _source_rank(self):
        self.wait()
        if self.source is None:
            raise RuntimeError("sourceRank() may only be called on work objects that "
                               "correspond to a recv or recv-from-any call.")
        return self.source

    def source_rank(self):
        return self._source_rank()

    def get_future(self):
        if HOLD:
            let_go(self)
        return _dist.Work.get_future(self)

    def synchronize(self):
        self.wait()


class Done(dist.Work):
    """The Work of a call that completed before it returned: no event to
    wait on (NOTE [ The backend's cost per call ])."""

    def __init__(self, tensors):
        dist.Work.__init__(self)
        self._tensors = tensors
        if HOLD:
            held(self)

    def wait(self, timeout=NO_TIMEOUT):
        if HOLD:
            let_go(self)
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._tensors

    def get_future(self):
        if HOLD:
            let_go(self)
        fut = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut

    def synchronize(self):
        pass


done = Done


def checked(what, red, tensors, async_op):
    """None when the op suits the tensors; else, for async_op, a Work that
    reports the error (as the group's thread reports the core's), and
    otherwise the error is raised."""
    try:
        check_op(what, red, tensors)
    except RuntimeError as e:
        if not async_op:
            raise
        w = Work(tensors)
        w.finish(e)
        return w
    return None


class AllOf(dist.Work):
    """The Work of a coalescing block: done when all of its calls are."""

    def __init__(self, works):
        dist.Work.__init__(self)
        self._works = works
        if HOLD:
            held(self)

    def wait(self, timeout=NO_TIMEOUT):
        if HOLD:
            let_go(self)
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def is_success(self):
        return all(w.is_success() for w in self._works)

    def exception(self):
        return next((e for e in (w.exception() for w in self._works) if e is not None), None)

    def result(self):
        return [t for w in self._works for t in w.result()]

    def get_future(self):
        if HOLD:
            let_go(self)
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(
            lambda fut: [t for f in fut.value() for t in f.value()])

    def synchronize(self):
        self.wait()
