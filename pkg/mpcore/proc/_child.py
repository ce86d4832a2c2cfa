"""A child forked from the zygote: its first steps (child_main), and its
end as a spawned child's (NOTE [ A spawned child ends as python would ])."""
import gc
import io
import os
import pickle
import sys

from multiprocessing import spawn as _mpspawn

from . import _inherit

forked = False  # true in a child the zygote forked (and in what that child forks)


def child_main(payload):
    """In a child just forked from the zygote: become the requested
    process and run it."""
    global forked
    forked = True
    code = 1
    try:
        f = io.BytesIO(payload)
        head = pickle.load(f)
        os.environ.clear()
        os.environ.update(head["env"])
        _inherit.become_spawned(head["parent"], head["requester"])
        # The zygote's stdout was /dev/null, so Python made it block-buffered;
        # buffer it as a spawned child would buffer the stdout it now has.
        if head["unbuffered"]:
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        else:
            sys.stdout.reconfigure(line_buffering=os.isatty(1))
        from multiprocessing import process, resource_tracker
        resource_tracker._resource_tracker._fd = head["tracker_fd"]
        process.current_process()._inheriting = True
        try:
            _mpspawn.prepare(head["prep"])
            proc = pickle.load(f)
        finally:
            del process.current_process()._inheriting
        code = proc._bootstrap(parent_sentinel=head["parent_sentinel"])
        if head["method"] == "spawn":
            end_as_python_would(code)
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        _exit_now(code)


def exit_code(e):
    """The exit status python gives a SystemExit that ends the program
    (a message is printed, and is status 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _exit_now(code):
    """Flushes stdout and stderr, then ends this process with `code`."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def end_as_python_would(code):
    """NOTE [ A spawned child ends as python would ]
    A process that multiprocessing spawns ends through sys.exit, so the
    interpreter finalizes: non-daemon threads are joined, atexit handlers
    run (weakref.finalize's among them: a TemporaryDirectory is removed,
    logging's handlers are flushed and closed), and the files the program
    left open are flushed as their objects go.  A zygote child cannot
    finalize (its stack is the import of torch that the zygote was born
    in, NOTE [ The zygote is born inside an import ]), so it ends with
    os._exit after doing those steps itself: threads, atexit, a collection
    (files in garbage cycles close as they are freed), and a flush of every
    file object still open.  Files are flushed, not closed: a daemon
    thread may still write to one, and python stops those threads before
    it frees anything.  Objects are not freed, so a __del__ that writes
    (zipfile's central directory) runs only for garbage.  A 'fork' or
    'forkserver' child ends by os._exit alone, as the standard library's
    do.  Handlers registered before torch's import, in the program the
    zygote was forked from, are inherited as well; a spawned process gets
    them only where re-importing __main__ registers them again.
    Never returns."""
    import atexit
    import threading
    try:
        try:
            threading._shutdown()
        finally:
            try:
                atexit._run_exitfuncs()
            finally:
                gc.collect()
                _flush_files()
    finally:
        _exit_now(code)


def _flush_files():
    """Flushes every open file object the collector tracks, text ones
    first (each pushes its text into its binary buffer)."""
    import _io  # its bases: io's are ABCs, slower to test against
    import warnings
    with warnings.catch_warnings():
        # isinstance reads __class__, which some objects warn about (torch
        # before 2.7: torch.distributed.reduce_op is deprecated)
        warnings.simplefilter("ignore")
        files = [o for o in gc.get_objects() if isinstance(o, _io._IOBase)]
    files.sort(key=lambda o: not isinstance(o, _io._TextIOBase))
    for f in files:
        try:
            if not f.closed:
                f.flush()
        except Exception:
            pass
