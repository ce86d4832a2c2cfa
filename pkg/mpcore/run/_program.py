"""Running a program as python would: `python script.py`, `python -m
module` or `python -c command`, with a fresh __main__ module, sys.argv,
sys.path[0], exit codes, and tracebacks without launcher frames.  Used by
`mpcore run` (_launcher.py) and by each rank of its torchrun command line
(_torchrun.py)."""
import builtins
import os
import runpy
import signal
import sys
import types
from importlib.machinery import BuiltinImporter, SourceFileLoader


def report(e, tb):
    """Prints an uncaught exception as python does, from the program's own
    frames, and exits as python would."""
    e.__traceback__ = tb
    sys.excepthook(type(e), e, tb)
    if isinstance(e, KeyboardInterrupt):
        # As python does: die by SIGINT, so the parent sees it.
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(1)


def run_script(path, argv, report=report):
    with open(path, "rb") as f:
        source = f.read()
    full = os.path.abspath(path)
    main = types.ModuleType("__main__")
    main.__file__ = full
    main.__cached__ = None
    main.__loader__ = SourceFileLoader("__main__", full)
    _run_main(compile(source, full, "exec"), main, argv,
              os.path.dirname(os.path.realpath(path)), report)


def run_command(source, argv):
    """`python -c source`: __main__ has no file, sys.path[0] is ''."""
    main = types.ModuleType("__main__")
    main.__loader__ = BuiltinImporter
    _run_main(compile(source, "<string>", "exec"), main, argv, "", report)


def _run_main(code, main, argv, path0, report):
    main.__builtins__ = builtins
    launcher = sys.modules["__main__"]
    sys.modules["__main__"] = main
    if sys.modules.get("__mp_main__") is launcher:
        # multiprocessing, imported before the program was, named the
        # launcher as what a spawn child's classes (`__mp_main__.X`) come
        # from; a parent unpickles them from the program.
        sys.modules["__mp_main__"] = main
    sys.argv = argv
    sys.path[0:1] = [path0]
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        # Drop the launcher's frames: the traceback starts in the program.
        report(e, e.__traceback__.tb_next)


def run_module(name, argv, report=report):
    sys.argv = argv
    sys.path[0:1] = [os.getcwd()]
    try:
        runpy._run_module_as_main(name, alter_argv=True)
    except SystemExit:
        raise
    except BaseException as e:
        # python -m shows runpy's frames; only ours are dropped.
        report(e, e.__traceback__.tb_next)
