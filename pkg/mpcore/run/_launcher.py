"""`mpcore run`: runs an unchanged program with mpcore serving it.

The program sees what `python script.py`, `python -m module` or `python -c
command` would give it (_program.py); torchrun's command line is
_torchrun.py's.
"""
import os
import sys

from . import _program

USAGE = ("usage: mpcore run [-m module | -c command | script.py] [args...]\n"
         "       mpcore run --nproc-per-node N [torchrun's flags] [-m module | script.py] [args...]")


def run(args):
    if not args or (args[0] in ("-m", "-c") and len(args) < 2):
        print(USAGE, file=sys.stderr)
        return 2
    if args[0].startswith("-") and args[0] not in ("-m", "-c"):
        # torchrun's command line (NOTE [ torchrun on the zygote ])
        from ._torchrun import main
        return main(args)
    from . import _boot
    _boot.activate_run(launcher=True)
    if args[0] == "-m":
        _program.run_module(args[1], args[1:])
        return 0
    if args[0] == "-c":
        _program.run_command(args[1], ["-c", *args[2:]])
        return 0
    path = args[0]
    if not os.path.exists(path):
        print(f"mpcore run: can't open file {path!r}: No such file or directory",
              file=sys.stderr)
        return 2
    _program.run_script(path, args)
    return 0
