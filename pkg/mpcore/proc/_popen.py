"""The Popen of mpcore's 'spawn' and 'forkserver' contexts: a child
forked by the zygote, or one started by exec where the zygote cannot
(saying why, once)."""
import errno
import io
import os
import warnings

from multiprocessing import context as _mpctx
from multiprocessing import popen_fork, popen_spawn_posix, spawn as _mpspawn, util

from . import _client, _inherit, _parentdeath, _zygote

_warned = False


class Popen(popen_fork.Popen):
    """Starts a Process by asking the zygote to fork it; `start_method`,
    'spawn' or 'forkserver', is the one whose ending the child has (NOTE
    [ A spawned child ends as python would ])."""

    method = "spawn"
    DupFd = popen_spawn_posix._DupFd

    def __init__(self, process_obj, start_method="spawn"):
        self._fds = []
        self._start_method = start_method
        super().__init__(process_obj)

    def duplicate_for_child(self, fd):
        self._fds.append(fd)
        return fd

    def _launch(self, process_obj):
        from multiprocessing import reduction, resource_tracker
        _zygote.start()
        parent = _inherit.parent_state_for(self._start_method)
        why = _inherit.why_exec(parent)
        if why is not None:
            raise _client.Fallback(why)
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep = _mpspawn.get_preparation_data(process_obj._name)
        parent_r, child_w = os.pipe()    # EOF for the parent when the child ends
        child_r, parent_w = os.pipe()    # EOF for the child when the parent ends
        try:
            fp = io.BytesIO()
            _mpctx.set_spawning_popen(self)
            try:
                reduction.dump({"env": dict(os.environ), "prep": prep, "tracker_fd": tracker_fd,
                                "parent_sentinel": child_r, "method": self._start_method,
                                "parent": parent,
                                "requester": os.getpid(),
                                "unbuffered": bool(os.environ.get("PYTHONUNBUFFERED"))}, fp)
                reduction.dump(process_obj, fp)
            finally:
                _mpctx.set_spawning_popen(None)
            fds = list(dict.fromkeys([0, 1, 2, child_w, child_r] + self._fds))
            room = _client.MAX_FDS - (fp.tell() > _client.INLINE_MAX)  # one for the payload's memfd
            if len(fds) > room:
                raise _client.Fallback(f"{len(fds)} fds to hand over, more than {room}")
            try:
                op, arg, arg2 = _zygote.client().request(
                    fp.getbuffer(), fds, fds,
                    _client.FLAG_SIGCHLD if self._start_method == "spawn" else 0)
            except (ConnectionError, OSError) as e:
                raise _client.Fallback(f"the zygote cannot be reached ({e})") from None
            if op == _client.FAILED:
                if arg == errno.EDEADLK:
                    raise _client.Fallback(f"the zygote has {arg2} threads, so it must not fork")
                raise OSError(arg, f"the mpcore zygote could not fork: {os.strerror(arg)}")
        except BaseException:
            for fd in (parent_r, parent_w):
                os.close(fd)
            raise
        finally:
            os.close(child_w)
            os.close(child_r)
        self.pid = arg
        self.sentinel = parent_r
        self.finalizer = util.Finalize(self, util.close_fds, [parent_r, parent_w])

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None:
            status = _zygote.client().exit_status(self.pid, block=flag != os.WNOHANG)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def popen(process_obj, method):
    """The Popen for a process of an mpcore 'spawn' or 'forkserver' context:
    the zygote's, or the standard library's spawn if the zygote cannot."""
    global _warned
    try:
        return Popen(process_obj, method)
    except _client.Fallback as e:
        if not _warned:
            _warned = True
            warnings.warn(f"mpcore: {e}; starting processes by exec instead (slower)",
                          RuntimeWarning, stacklevel=4)
        # a zygote child dies with its parent; so does this one, first thing
        # in its _bootstrap (NOTE [ Dying with the parent ])
        process_obj._mpcore_die_with = _parentdeath.token()
        return popen_spawn_posix.Popen(process_obj)
