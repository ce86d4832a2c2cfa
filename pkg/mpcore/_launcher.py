"""`mpcore run`: runs an unchanged program with mpcore serving it.

The program sees what `python script.py` or `python -m module` would give
it: a fresh __main__ module, sys.argv, sys.path[0], exit codes, and
tracebacks without launcher frames.
"""
import os
import runpy
import signal
import sys

USAGE = "usage: mpcore run [-m module | script.py] [args...]"


def _strip_traceback(tb, filename):
    # Drop the launcher's own frames: the traceback starts in the program.
    t = tb
    while t is not None and t.tb_frame.f_code.co_filename != filename:
        t = t.tb_next
    return t or tb


def _run_script(path, argv):
    import types
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec")
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__
    main.__cached__ = None
    sys.modules["__main__"] = main
    sys.argv = argv
    sys.path[0:1] = [os.path.dirname(os.path.abspath(path))]
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        tb = _strip_traceback(e.__traceback__, path)
        if isinstance(e, KeyboardInterrupt):
            sys.excepthook(type(e), e, tb)
            # As python does: die by SIGINT so the parent sees it.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.excepthook(type(e), e, tb)
        sys.exit(1)


def run(args):
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    from . import _boot
    _boot.activate_run()
    if args[0] == "-m":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = args[1:]
        sys.path[0:1] = [os.getcwd()]
        runpy._run_module_as_main(args[1], alter_argv=True)
        return 0
    path = args[0]
    if not os.path.exists(path):
        print(f"mpcore run: can't open file {path!r}: No such file or directory",
              file=sys.stderr)
        return 2
    _run_script(path, args)
    return 0
