"""`mpcore run` with torchrun's command line: `mpcore run --nproc-per-node N
[torchrun's flags] script.py args` (or `-m module args`).

NOTE [ torchrun on the zygote ]
The launcher is torchrun's own machinery, with one thing changed: where
torchrun execs `python -u script.py` once per rank, each rank here is a
child of mpcore's zygote (spawn semantics at fork speed: torch is already
imported) that runs the program as `mpcore run script.py` would (a fresh
__main__, sys.argv, sys.path[0], mpcore serving torch).
- The flags, their dash and underscore spellings and their PET_*
  environment defaults are torch.distributed.run's own parser; what
  run() does with them (--standalone, a free port on a single node unless
  a port is given, master port 29500 otherwise) is copied from it.
- Rendezvous, the agent's TCPStore, the workers' environment, restarts,
  monitoring, the shutdown grace (--shutdown-timeout,
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and the failure summary are torch's
  elastic agent's.  The program is given to it as a function
  (rank_main), so the agent runs it through torch.multiprocessing's
  start_processes, which under `mpcore run` is mpcore's: the zygote.
  --no-python runs the binary as torchrun does (by exec), through a
  trampoline (NOTE [ Binaries under --no-python ]).
- Every rank dies with the launcher however it dies: the zygote SIGKILLs
  the children of a requester whose connection closes (NOTE [ Zygote ]).
- A rank's uncaught exception is printed with the rank on every line and
  written to its TORCHELASTIC_ERROR_FILE in torchelastic's format (what
  @record writes), so the summary carries the traceback without @record.
- SIGUSR1 and SIGUSR2 (unless named in --signals-to-handle, which gives
  torch's meaning: stop) are passed on to every rank, binaries included,
  and the job goes on;
  the signals torch handles (SIGTERM, SIGINT, SIGHUP, SIGQUIT) are sent to
  the ranks, which get --shutdown-timeout seconds before SIGKILL, and the
  launcher then dies by the same signal.
- Under the agent's store a restarted rank's init_process_group works in
  a key space of its attempt (NOTE [ The agent's store ] in _dist.py).
"""
import json
import logging
import os
import signal
import sys
import time
import traceback

_FORWARDED = ("SIGUSR1", "SIGUSR2")
_binaries = []   # the Popen of every --no-python rank this launcher started


# --- the rank's side -----------------------------------------------------------

def _rank_report(e, tb):
    """A rank's uncaught exception: printed with its rank on every line,
    written to the error file in torchelastic's format; exit 1."""
    from . import _program
    if isinstance(e, KeyboardInterrupt):
        _program.report(e, tb)  # dies by SIGINT, as python does
    e.__traceback__ = tb
    text = "".join(traceback.format_exception(type(e), e, tb))
    rank = os.environ.get("RANK", "?")
    sys.stderr.write("".join(f"[rank{rank}]: {line}\n" for line in text.splitlines()))
    sys.stderr.flush()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):  # a program's own @record wrote it already
        data = {"message": {"message": f"{type(e).__name__}: {e}",
                            "extraInfo": {"py_callstack": text,
                                          "timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass
    sys.exit(1)


# NOTE [ The rank's return queue ]
# torch's worker wrapper (elastic.multiprocessing.api._wrap) calls the
# rank's program and then puts its return value on ret_vals[local_rank].
# The launcher puts _rank_wrap in _wrap's place (through _torchapi, which
# checks that _wrap takes ret_vals): it keeps that queue for rank_main and
# calls torch's _wrap with every argument as given.  Where torch's _wrap
# takes no ret_vals the launcher keeps torch's, and the queue is None.
_WRAP = "torch.distributed.elastic.multiprocessing.api._wrap"
_return_queue = None


def _rank_wrap(local_rank, fn, args, envs, stdout_redirects, stderr_redirects, ret_vals,
               *rest, **kwargs):
    """torch's _wrap, keeping this rank's return queue (NOTE [ The rank's
    return queue ])."""
    global _return_queue
    from .. import _torchapi
    _return_queue = ret_vals[local_rank]
    torch_wrap = _torchapi.original(_WRAP) or _torchapi.get(_WRAP)
    return torch_wrap(local_rank, fn, args, envs, stdout_redirects, stderr_redirects,
                      ret_vals, *rest, **kwargs)


def _end_as_python_would(queue, code):
    """NOTE [ A rank whose program is done ends at once ]
    torch's wrapper of a function entry point puts the return value on a
    queue, then waits until every rank has returned before it lets the
    process end.  While the agent shuts the job down it no longer lets
    them go, so a rank whose program ended on the launcher's SIGTERM (a
    handler that saves and exits, the graceful case) would sit there
    until SIGKILL at the end of the grace.  torchrun's ranks are programs
    that end when they end; so are these: a rank whose program succeeded
    puts its return value (None) on torch's queue itself (the queue's ring
    is shared memory the agent holds, so the value outlives the rank), and
    every rank then ends as the interpreter would, with the program's exit
    code (NOTE [ A spawned child ends as python would ] in proc/_child.py)."""
    from ..proc import _child
    if code == 0 and queue is not None:
        queue.put(None)
    _child.end_as_python_would(code)


def rank_main(module, target, *argv):
    """One rank: runs the program as `mpcore run` runs it (NOTE [ torchrun
    on the zygote ]); `module` is true for `-m target`."""
    import multiprocessing
    from . import _boot, _program
    from ..proc import _child
    _boot.activate_run()
    # NOTE [ A rank's start method is its own ]
    # A zygote child takes its parent's start method, as a spawned process
    # does (multiprocessing.spawn.prepare): here the agent's, "spawn" by
    # default.  torchrun's ranks are fresh interpreters, where none is set
    # and a DataLoader's workers are forked; under "spawn" they would run
    # the program's __main__ again, init_process_group and all, in a script
    # without an `if __name__ == "__main__"` guard.
    multiprocessing.set_start_method(None, force=True)
    # As torchrun's `python -u`.
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
    queue = _return_queue
    code = 0
    try:
        if module:
            _program.run_module(target, [target, *argv], report=_rank_report)
        else:
            if not os.path.exists(target):
                print(f"mpcore run: can't open file {target!r}: No such file or directory",
                      file=sys.stderr)
                sys.exit(2)
            _program.run_script(target, [target, *argv], report=_rank_report)
    except SystemExit as e:
        code = _child.exit_code(e)
    _end_as_python_would(queue, code)


# --- the launcher --------------------------------------------------------------

def _forward(signum, frame):
    """Passes a signal on to every rank still running."""
    import multiprocessing.process as mpp
    popens = [getattr(p, "_popen", None) for p in list(mpp._children)]
    for popen in popens + _binaries:
        if popen is not None and popen.returncode is None and popen.pid:
            try:
                os.kill(popen.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


# NOTE [ Binaries under --no-python ]
# torchrun starts a --no-python rank with Popen (in a new session), so a
# SIGKILLed launcher would leave it running, and it is no multiprocessing
# child for _forward to find.  Here each one is started through a
# trampoline: a bare interpreter that loads only the core's extension
# (_blocks.core_command, as the keeper starts), calls die_with(launcher) and
# execs the binary, which keeps the pid, and with it PR_SET_PDEATHSIG, and
# the environment torch gave.  PR_SET_PDEATHSIG follows the thread that forked, so the trampoline
# is used only from the launcher's main thread (where torch's agent starts
# the ranks); a rank started from another thread is started as torchrun
# does.  The Popen is kept in _binaries for _forward.
_TRAMPOLINE = ("try:\n"
               "    m.die_with(int(sys.argv[2]), 9, True)\n"
               "except ProcessLookupError:\n"
               "    os.kill(os.getpid(), 9)\n"
               "os.execvp(sys.argv[3], sys.argv[3:])\n")


def _start_binaries_dying_with_the_launcher():
    """Wraps torch's SubprocessHandler._popen (NOTE [ Binaries under
    --no-python ])."""
    import threading
    from ..shm import _blocks
    from .. import _torchapi
    target = ("torch.distributed.elastic.multiprocessing.subprocess_handler."
              "subprocess_handler.SubprocessHandler._popen")
    popen = _torchapi.find(target)
    if popen is None:
        return    # torch's own Popen: a rank may outlive a SIGKILLed launcher

    def _popen(self, args, env):
        if threading.current_thread() is threading.main_thread():
            args = tuple(_blocks.core_command(_TRAMPOLINE, str(os.getpid()), *args))
        p = popen(self, args, env)
        _binaries.append(p)
        return p
    _torchapi.replace(target, _popen)


def _plain_failure_line(record):
    """torch logs a failed rank of a function entry point with the
    launcher's own traceback (the rank's is printed by the rank and is in
    the summary); formatting it also imports torch._dynamo, seconds of
    CPU.  The line stays, as torchrun prints it for a binary."""
    if str(record.msg).startswith("failed (exitcode"):
        record.exc_info = None
        record.exc_text = None
    return True


def _parse(argv):
    import torch.distributed.run as tdr
    from .. import _torchapi
    parser = _torchapi.get("torch.distributed.run.get_args_parser")()
    parser.prog = "mpcore run"
    return tdr, parser.parse_args(argv)


def _settle(tdr, args):
    """What torch.distributed.run.run() does to the arguments before
    config_from_args."""
    import uuid
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        from .. import _torchapi
        _, max_nodes = _torchapi.get("torch.distributed.run.parse_min_max_nnodes")(args.nnodes)
        if max_nodes == 1:
            # a free port: two jobs on one host never clash
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _entrypoint(args, cmd, cmd_args):
    """torchrun's (cmd, args) for `python -u [-m] target args`, as
    rank_main and its args; others (--no-python, --run-path) unchanged."""
    if args.no_python or args.run_path or not isinstance(cmd, str):
        return cmd, cmd_args
    rest = list(cmd_args)
    if rest[:1] == ["-u"]:
        del rest[0]
    module = rest[:1] == ["-m"]
    if module:
        del rest[0]
    return rank_main, [module, *rest]


def _summary(e, name):
    """torchrun's ending for a failed job (what @record does in its main),
    without the launcher's frames; the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError, get_error_handler)
    e = ChildFailedError(name, e.failures)
    _, failure = e.get_first_failure()
    if failure.error_file and os.path.isfile(failure.error_file):
        try:
            get_error_handler().dump_error_file(failure.error_file, failure.exitcode)
        except Exception:
            pass
    sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
    sys.stderr.flush()
    return 1


def _rendezvous_timeout(config, args, e):
    """A clear line for a rendezvous that did not complete (torch raises
    RendezvousTimeoutError without a message); the exit code."""
    import socket
    if config.rdzv_backend == "static":
        which = (f"node rank {args.node_rank} of {config.max_nodes} came; every node rank "
                 f"of 0..{config.max_nodes - 1} must start a launcher")
    else:
        which = (f"this node ({socket.gethostname()}) came; fewer than the "
                 f"{config.min_nodes} node(s) --nnodes {args.nnodes} asks for joined")
    timeout = config.rdzv_configs.get("join_timeout", config.rdzv_configs.get("timeout", 600))
    detail = f" ({e})" if str(e) else ""
    print(f"mpcore run: the rendezvous {config.run_id!r} at {config.rdzv_endpoint} "
          f"({config.rdzv_backend}) timed out after {timeout} s: {which}{detail}",
          file=sys.stderr)
    return 1


def _die_by(signum):
    """Ends the launcher by the signal it got, once the exit-time
    finalizers of multiprocessing (the semaphores of the ranks' queues)
    have run, as they would at a normal exit."""
    try:
        from multiprocessing import util
        util._run_finalizers(0)
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return 128 + signum


def main(argv):
    """`mpcore run` with torchrun's flags; returns the exit code."""
    from . import _boot
    from .. import _torchapi
    _boot.activate_run(launcher=True)  # the zygote forks once torch is imported
    import torch  # noqa: F401  (the window and the table are torch's)
    if not _torchapi.serves("torchrun launch"):
        why = _torchapi.report_feature("torchrun launch")
        print(f"mpcore run: torchrun's flags need torch's launcher: {why}", file=sys.stderr)
        return 1
    tdr, args = _parse(argv)
    _settle(tdr, args)
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        _plain_failure_line)
    # --signals-to-handle came in torch 2.9; before it torch handles SIGTERM,
    # SIGINT, SIGHUP and SIGQUIT, never SIGUSR1 or SIGUSR2.
    signals = getattr(args, "signals_to_handle", None)
    torch_handles = {s.strip() for s in str(signals).split(",")} if signals else set()
    for name in _FORWARDED:
        if name not in torch_handles:
            signal.signal(getattr(signal, name), _forward)
    config, cmd, cmd_args = _torchapi.get("torch.distributed.run.config_from_args")(args)
    _torchapi.replace(_WRAP, _rank_wrap)   # NOTE [ The rank's return queue ]
    entry, entry_args = _entrypoint(args, cmd, cmd_args)
    if isinstance(entry, str):
        _start_binaries_dying_with_the_launcher()
    from . import _rdzv
    _rdzv.install()
    try:
        try:
            elastic_launch(config=config, entrypoint=entry)(*entry_args)
        except (KeyboardInterrupt, RendezvousError):
            if _rdzv.error() is None:
                raise
            print(_rdzv.error(), file=sys.stderr)  # NOTE [ Nodes that disagree on --nnodes ]
            return 1
    except _rdzv.NnodesMismatch as e:
        print(e, file=sys.stderr)
        return 1
    except ChildFailedError as e:
        return _summary(e, args.training_script)
    except (RendezvousTimeoutError, DistStoreError) as e:
        # DistStoreError: the static rendezvous's TCPStore, waiting for nodes
        if isinstance(e, DistStoreError) and (config.rdzv_backend != "static"
                                              or "waiting for clients" not in str(e)):
            raise
        return _rendezvous_timeout(config, args, e)
    except SignalException as e:
        print(f"mpcore run: got {signal.Signals(e.sigval).name}; the ranks were sent it",
              file=sys.stderr)
        return _die_by(e.sigval)
    return 0
