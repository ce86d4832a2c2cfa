"""The `mpcore` command: `mpcore run ...`, `mpcore bench ...` and `mpcore doctor`."""
import sys

USAGE = """usage: mpcore run [-m module | -c command | script.py] [args...]
       mpcore run --nproc-per-node N [torchrun's flags] [-m module | script.py] [args...]
       mpcore bench [--json FILE] [--plot FILE.png] [--quick] [--only NAME,...]
       mpcore doctor [--json] [--workers N]   (exit 1 when it finds problems)"""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        from .run._launcher import run
        return run(rest)
    if cmd == "bench":
        from .bench.runner import main as bench_main
        return bench_main(rest)
    if cmd == "doctor":
        from ._doctor import main as doctor_main
        return doctor_main(rest)
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
