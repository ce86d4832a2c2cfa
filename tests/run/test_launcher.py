"""Tests of `mpcore run` (pkg/mpcore/_launcher.py, _boot.py, __main__.py).

The launcher runs an unchanged program: each test runs the same program
under plain `python` and under `mpcore run` and compares what the program
sees and prints (stdout, traceback lines, exit code).  Every test is bounded
and checks that no process is left behind (conftest.leak_check).
"""
import json
import os
import signal
import sys
import textwrap

import pytest

from helpers import run_in_session

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("leak_check")]

MPCORE_BIN = os.path.join(os.path.dirname(sys.executable), "mpcore")


def clean_env(**extra):
    """The test's environment without any mpcore switches, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCORE_")}
    env.update(extra)
    return env


def write(path, code):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))
    return path


def run(cmd, cwd, timeout=90, env=None):
    """Runs cmd in a session of its own; returns its CompletedProcess once
    every process of that session is gone."""
    return run_in_session(cmd, cwd, env if env is not None else clean_env(), timeout)


def plain(script, *args, cwd, **kw):
    return run([sys.executable, str(script), *args], cwd, **kw)


def launched(script, *args, cwd, **kw):
    return run([sys.executable, "-m", "mpcore", "run", str(script), *args], cwd, **kw)


def after_header(stderr):
    """The lines of a traceback after its "Traceback" header."""
    lines = stderr.splitlines()
    assert "Traceback (most recent call last):" in lines, stderr
    return lines[lines.index("Traceback (most recent call last):") + 1:]


# --- what the program sees ----------------------------------------------------

SEES = '''
"""A program that prints what it sees of its own start."""
import os
import sys
print("name", __name__)
print("file", __file__)
print("argv", sys.argv)
print("path0", sys.path[0])
print("main", sys.modules["__main__"].__dict__ is globals())
print("doc", __doc__)
print("torch", "torch" in sys.modules)
'''


def test_script_sees_what_python_gives(tmp_path):
    script = write(tmp_path / "prog" / "sees.py", SEES)
    want = plain(script, "a", "--b", "c d", cwd=tmp_path)
    got = launched(script, "a", "--b", "c d", cwd=tmp_path)
    assert want.returncode == 0, want.stderr
    assert got.returncode == 0, got.stderr
    assert got.stdout == want.stdout
    assert got.stderr == want.stderr == ""
    # And what python gives is what the brief says it is.
    lines = dict(l.split(" ", 1) for l in got.stdout.splitlines())
    assert lines["name"] == "__main__"
    assert lines["path0"] == str(tmp_path / "prog")
    assert lines["argv"] == repr([str(script), "a", "--b", "c d"])
    assert lines["torch"] == "False"   # a program that does not use torch gets no torch


def test_script_given_by_relative_path(tmp_path):
    # python makes __main__.__file__ absolute (3.9+) and argv[0] stays as given.
    write(tmp_path / "prog" / "sees.py", SEES)
    want = plain("prog/sees.py", "x", cwd=tmp_path)
    got = launched("prog/sees.py", "x", cwd=tmp_path)
    assert want.returncode == got.returncode == 0, got.stderr
    assert f"file {tmp_path / 'prog' / 'sees.py'}" in want.stdout.splitlines()
    assert got.stdout == want.stdout


def test_script_through_a_symlink(tmp_path):
    # python puts the directory of the resolved script first on sys.path.
    write(tmp_path / "real" / "sees.py", SEES)
    (tmp_path / "link").mkdir()
    os.symlink(tmp_path / "real" / "sees.py", tmp_path / "link" / "sees.py")
    want = plain(tmp_path / "link" / "sees.py", cwd=tmp_path)
    got = launched(tmp_path / "link" / "sees.py", cwd=tmp_path)
    assert f"path0 {tmp_path / 'real'}" in want.stdout.splitlines()
    assert got.stdout == want.stdout


def test_main_module_globals_as_under_python(tmp_path):
    # __builtins__ is the builtins module in __main__ (a program may use
    # `__builtins__.print`), and __loader__ / __spec__ / __package__ are
    # what python sets for a script.
    script = write(tmp_path / "g.py", '''
        import sys
        print("builtins", type(__builtins__).__name__)
        print("loader", type(__loader__).__name__)
        print("spec", __spec__)
        print("package", __package__)
        __builtins__.print("via builtins")
    ''')
    want = plain(script, cwd=tmp_path)
    got = launched(script, cwd=tmp_path)
    assert want.returncode == 0, want.stderr
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)


def test_script_imports_a_sibling_module(tmp_path):
    write(tmp_path / "prog" / "helper.py", "VALUE = 42\n")
    script = write(tmp_path / "prog" / "main.py", '''
        import helper
        print(helper.VALUE, helper.__file__)
    ''')
    want = plain(script, cwd=tmp_path)
    got = launched(script, cwd=tmp_path)
    assert want.returncode == 0, want.stderr
    assert (got.returncode, got.stdout) == (0, want.stdout)


# --- exit codes and tracebacks --------------------------------------------------

@pytest.mark.parametrize("how, code", [
    ("sys.exit(3)", 3),
    ("sys.exit(0)", 0),
    ("sys.exit()", 0),
    ("sys.exit('bye')", 1),
    ("raise SystemExit(7)", 7),
    ("pass", 0),
])
def test_exit_codes(tmp_path, how, code):
    script = write(tmp_path / "ex.py", f'''
        import sys
        print("before", flush=True)
        {how}
    ''')
    want = plain(script, cwd=tmp_path)
    got = launched(script, cwd=tmp_path)
    assert want.returncode == code
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)


RAISES = '''
import sys
def inner():
    raise ValueError("boom")
def outer():
    inner()
print("started")
outer()
'''


def test_uncaught_exception_traceback_as_under_python(tmp_path):
    script = write(tmp_path / "raises.py", RAISES)
    want = plain(script, cwd=tmp_path)
    got = launched(script, cwd=tmp_path)
    assert want.returncode == got.returncode == 1
    assert got.stdout == want.stdout == "started\n"
    assert after_header(got.stderr) == after_header(want.stderr)
    # It starts at the program's frame; nothing of the launcher in it.
    assert after_header(got.stderr)[0] == f'  File "{script}", line 8, in <module>'
    assert "mpcore" not in got.stderr
    assert got.stderr == want.stderr


def test_uncaught_exception_by_relative_path(tmp_path):
    write(tmp_path / "raises.py", RAISES)
    want = plain("raises.py", cwd=tmp_path)
    got = launched("raises.py", cwd=tmp_path)
    assert want.returncode == got.returncode == 1
    assert after_header(got.stderr) == after_header(want.stderr)


def test_chained_exception_traceback_as_under_python(tmp_path):
    script = write(tmp_path / "chained.py", '''
        def f():
            try:
                {}["missing"]
            except KeyError as e:
                raise RuntimeError("while handling") from e
        f()
    ''')
    want = plain(script, cwd=tmp_path)
    got = launched(script, cwd=tmp_path)
    assert want.returncode == got.returncode == 1
    assert got.stderr == want.stderr
    assert "mpcore" not in got.stderr


def test_exception_in_imported_module(tmp_path):
    write(tmp_path / "bad.py", "raise ImportError('bad module')\n")
    script = write(tmp_path / "imp.py", "import bad\n")
    want = plain(script, cwd=tmp_path)
    got = launched(script, cwd=tmp_path)
    assert want.returncode == got.returncode == 1
    assert after_header(got.stderr) == after_header(want.stderr)


def test_syntax_error_in_script(tmp_path):
    script = write(tmp_path / "syn.py", "print('x'\n")
    want = plain(script, cwd=tmp_path)
    got = launched(script, cwd=tmp_path)
    assert want.returncode == 1
    assert got.returncode == 1
    assert got.stdout == ""
    assert "SyntaxError" in got.stderr.splitlines()[-1]
    assert got.stderr.splitlines()[-1] == want.stderr.splitlines()[-1]


def test_keyboard_interrupt_dies_by_sigint(tmp_path):
    # python re-raises an uncaught KeyboardInterrupt as death by SIGINT.
    script = write(tmp_path / "kbd.py", '''
        def f():
            raise KeyboardInterrupt
        f()
    ''')
    want = plain(script, cwd=tmp_path)
    got = launched(script, cwd=tmp_path)
    assert want.returncode == -signal.SIGINT
    assert got.returncode == want.returncode
    assert after_header(got.stderr) == after_header(want.stderr)


# --- the two spellings and -m ---------------------------------------------------

def test_console_script_and_python_dash_m_agree(tmp_path):
    script = write(tmp_path / "sees.py", SEES)
    a = launched(script, "1", cwd=tmp_path)
    b = run([MPCORE_BIN, "run", str(script), "1"], tmp_path)
    assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
    assert a.stdout == b.stdout
    ex = write(tmp_path / "ex.py", "import sys; sys.exit(5)\n")
    assert run([MPCORE_BIN, "run", str(ex)], tmp_path).returncode == 5


def test_console_script_traceback(tmp_path):
    script = write(tmp_path / "raises.py", RAISES)
    want = plain(script, cwd=tmp_path)
    got = run([MPCORE_BIN, "run", str(script)], tmp_path)
    assert got.returncode == 1
    assert after_header(got.stderr) == after_header(want.stderr)


MODULE = '''
import sys
print("name", __name__)
print("file", __file__)
print("argv", sys.argv)
print("path0", sys.path[0])
print("spec", __spec__.name)
print("package", __package__)
from . import sibling
print("sibling", sibling.X)
if sys.argv[1:] == ["exit"]:
    sys.exit(4)
if sys.argv[1:] == ["raise"]:
    def deep():
        raise LookupError("from module")
    deep()
'''


@pytest.fixture
def package(tmp_path):
    write(tmp_path / "mypkg" / "__init__.py", "")
    write(tmp_path / "mypkg" / "sibling.py", "X = 'sib'\n")
    write(tmp_path / "mypkg" / "prog.py", MODULE)
    write(tmp_path / "mypkg" / "__main__.py", "import sys\nprint('pkg main', sys.argv[1:])\n")
    return tmp_path


@pytest.mark.parametrize("args", [["plain"], [], ["exit"]])
def test_dash_m_module(package, args):
    want = run([sys.executable, "-m", "mypkg.prog", *args], package)
    got = run([sys.executable, "-m", "mpcore", "run", "-m", "mypkg.prog", *args], package)
    assert want.returncode == (4 if args == ["exit"] else 0), want.stderr
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert "name __main__" in got.stdout.splitlines()
    assert f"path0 {package}" in got.stdout.splitlines()


def test_dash_m_package_main(package):
    want = run([sys.executable, "-m", "mypkg", "q"], package)
    got = run([MPCORE_BIN, "run", "-m", "mypkg", "q"], package)
    assert want.returncode == 0, want.stderr
    assert (got.returncode, got.stdout) == (0, want.stdout)


def test_dash_m_traceback_has_no_launcher_frames(package):
    want = run([sys.executable, "-m", "mypkg.prog", "raise"], package)
    got = run([sys.executable, "-m", "mpcore", "run", "-m", "mypkg.prog", "raise"], package)
    assert want.returncode == got.returncode == 1
    prog = str(package / "mypkg" / "prog.py")

    def from_program(stderr):
        lines = after_header(stderr)
        first = next(i for i, l in enumerate(lines) if l.startswith(f'  File "{prog}"'))
        return lines[first:]

    assert from_program(got.stderr) == from_program(want.stderr)
    # Whatever comes before the program's frames is python's (runpy), not mpcore's.
    assert "mpcore" not in got.stderr, got.stderr


def test_dash_m_missing_module(tmp_path):
    want = run([sys.executable, "-m", "no_such_module_xyz"], tmp_path)
    got = run([sys.executable, "-m", "mpcore", "run", "-m", "no_such_module_xyz"], tmp_path)
    assert want.returncode == 1
    assert got.returncode != 0
    assert "No module named no_such_module_xyz" in got.stderr
    assert "Traceback" not in got.stderr


COMMAND = """if 1:
    import sys
    print("name", __name__, "file" in globals(), "loader", __loader__)
    print("argv", sys.argv, "path0", repr(sys.path[0]))
    print("spec", __spec__, "torch", "torch" in sys.modules)
    if sys.argv[1:] == ["raise"]:
        raise ValueError("from -c")
    sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
"""


@pytest.mark.parametrize("args", [[], ["3", "b"], ["raise"]])
def test_dash_c_command(tmp_path, args):
    want = run([sys.executable, "-c", COMMAND, *args], tmp_path)
    got = run([sys.executable, "-m", "mpcore", "run", "-c", COMMAND, *args], tmp_path)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout,
                                                        want.stderr), (got, want)
    assert got.stdout.startswith("name __main__ False"), got


# --- usage ----------------------------------------------------------------------

@pytest.mark.parametrize("args", [[], ["frobnicate"], ["run"], ["run", "-m"], ["run", "-c"],
                                  ["--bogus"]])
def test_usage_on_bad_arguments(tmp_path, args):
    for cmd in ([sys.executable, "-m", "mpcore"], [MPCORE_BIN]):
        r = run(cmd + args, tmp_path)
        assert r.returncode == 2, (cmd, args, r)
        assert "usage: mpcore run" in r.stdout + r.stderr
        assert "Traceback" not in r.stderr


def test_help_exits_zero(tmp_path):
    r = run([MPCORE_BIN, "--help"], tmp_path)
    assert r.returncode == 0
    assert "usage: mpcore run" in r.stdout


def test_nonexistent_script(tmp_path):
    missing = tmp_path / "nope.py"
    for cmd in ([sys.executable, "-m", "mpcore", "run"], [MPCORE_BIN, "run"]):
        r = run(cmd + [str(missing), "arg"], tmp_path)
        assert r.returncode == 2
        assert r.stdout == ""
        assert "Traceback" not in r.stderr
        assert str(missing) in r.stderr
        assert "No such file or directory" in r.stderr


# --- mpcore serves torch.multiprocessing in every process -----------------------

SPAWN_PROGRAM = '''
import sys
import torch
import torch.multiprocessing as mp
import os
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale


def square(x):                      # defined in the script: must pickle for spawn
    return x * x


def child(inbox, outbox, ready):
    import mpcore
    t = inbox.get()
    t.add_(10)                      # visible to the parent only if shared
    outbox.put({
        "mpcore": getattr(mp, "__mpcore__", False),
        "queue_is_mpcore": mp.Queue is mpcore.Queue,
        "process_is_mpcore": mp.Process is mpcore.Process,
        "inbox_type": type(inbox).__module__,
        "tensor_shared": t.is_shared(),
        "handles_received": mpcore.stats().get("handles_received", 0),
        "main_name": sys.modules["__main__"].__name__,
        "square": square(7),
    })
    ready.set()


if __name__ == '__main__':
    ctx = mp.get_context("spawn")
    inbox, outbox, ready = ctx.Queue(), ctx.Queue(), ctx.Event()
    t = torch.zeros(5)
    p = ctx.Process(target=child, args=(inbox, outbox, ready))
    p.start()
    inbox.put(t)
    report = outbox.get(timeout=60 * SLOW)
    assert ready.wait(60 * SLOW)
    p.join()
    report["exitcode"] = p.exitcode
    report["parent_sees"] = t.tolist()
    report["parent_mpcore"] = getattr(mp, "__mpcore__", False)
    print("REPORT", repr(report))
'''


def parse_report(stdout):
    import ast
    line = [l for l in stdout.splitlines() if l.startswith("REPORT ")]
    assert line, stdout
    return ast.literal_eval(line[0][len("REPORT "):])


def test_spawn_children_under_launcher(tmp_path):
    script = write(tmp_path / "spawny.py", SPAWN_PROGRAM)
    got = launched(script, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    r = parse_report(got.stdout)
    assert r["exitcode"] == 0
    assert r["square"] == 49
    assert r["main_name"] == "__mp_main__"
    assert r["parent_sees"] == [10.0] * 5
    # Served by mpcore in the parent and, through mpcore.pth, in the spawn child.
    assert r["parent_mpcore"] is True
    assert r["mpcore"] is True
    assert r["queue_is_mpcore"] is True
    assert r["process_is_mpcore"] is True
    assert r["inbox_type"] == "mpcore.queue._queue"
    assert r["tensor_shared"] is True
    assert r["handles_received"] >= 1


def test_spawn_program_without_launcher_is_torchs(tmp_path):
    # The same program under plain python: same results, torch's machinery.
    script = write(tmp_path / "spawny.py", SPAWN_PROGRAM)
    got = plain(script, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    r = parse_report(got.stdout)
    assert r["parent_sees"] == [10.0] * 5
    assert r["square"] == 49
    assert r["mpcore"] is False and r["parent_mpcore"] is False
    assert r["queue_is_mpcore"] is False
    assert r["inbox_type"] == "multiprocessing.queues"
    assert r["handles_received"] == 0


def test_a_spawn_childs_classes_come_back_to_the_parent(tmp_path):
    """A spawn child defines the script's classes as `__mp_main__.X`; the
    parent unpickles them from its own __main__, as multiprocessing makes
    `__mp_main__` name it (mpcore's launcher imports multiprocessing before
    the program runs)."""
    script = write(tmp_path / "classes.py", '''
        import collections
        import sys
        import torch
        from torch.utils.data import DataLoader, Dataset
        import torch.multiprocessing as mp
        import os
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale

        Pair = collections.namedtuple("Pair", "x y")

        class Box:
            def __init__(self, v):
                self.v = v

        class Items(Dataset):
            def __len__(self):
                return 6

            def __getitem__(self, i):
                return Pair(torch.tensor(i), Box(i))

        def child(q):
            q.put([Pair(1, Box(2))])

        def as_they_are(samples):
            return samples

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            got = q.get(timeout=60 * SLOW)
            p.join()
            out = [(type(got[0]).__name__, got[0].x, got[0].y.v)]
            dl = DataLoader(Items(), batch_size=3, num_workers=2, multiprocessing_context="spawn",
                            collate_fn=as_they_are)
            out += [(s.x.item(), s.y.v, type(s).__name__) for batch in dl for s in batch]
            print("REPORT", repr(out))
    ''')
    want = [("Pair", 1, 2)] + [(i, i, "Pair") for i in range(6)]
    for how in (plain, launched):
        got = how(script, cwd=tmp_path)
        assert got.returncode == 0, (how.__name__, got.stderr)
        assert parse_report(got.stdout) == want, how.__name__


def test_fork_and_forkserver_children_are_served(tmp_path):
    script = write(tmp_path / "methods.py", '''
        import torch
        import torch.multiprocessing as mp
        import os
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale

        def child(q, t):
            import mpcore
            t.add_(1)
            q.put((getattr(mp, "__mpcore__", False), mp.Queue is mpcore.Queue,
                   mpcore.stats().get("handles_received", 0) > 0 or mp.get_start_method() == "fork"))

        if __name__ == "__main__":
            out = {}
            for method in ("fork", "forkserver", "spawn"):
                ctx = mp.get_context(method)
                q = ctx.Queue()
                t = torch.zeros(2).share_memory_()
                p = ctx.Process(target=child, args=(q, t))
                p.start()
                out[method] = q.get(timeout=60 * SLOW)
                p.join()
                out[method] += (p.exitcode, t.tolist())
            print("REPORT", repr(out))
    ''')
    got = launched(script, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    r = parse_report(got.stdout)
    for method in ("fork", "forkserver", "spawn"):
        assert r[method] == (True, True, True, 0, [1.0, 1.0]), (method, r[method])


def test_a_pool_and_an_executor_are_served(tmp_path):
    # torch.multiprocessing's Pool, module-level and from each context, and
    # concurrent.futures' executor on each context: their workers are
    # mpcore's (a spawn worker comes from the zygote).
    script = write(tmp_path / "pool.py", '''
        from concurrent.futures import ProcessPoolExecutor
        import torch
        import torch.multiprocessing as mp

        def work(i):
            from mpcore.proc import _child
            return torch.full((3,), float(i)).sum().item(), _child.forked

        if __name__ == "__main__":
            out = {}
            with mp.Pool(2) as pool:
                out["module"] = pool.map(work, range(3))
            for method in ("fork", "forkserver", "spawn"):
                with mp.get_context(method).Pool(2) as pool:
                    out[method] = pool.map(work, range(3))
                with ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
                    out["executor-" + method] = list(ex.map(work, range(3)))
            print("REPORT", repr(out))
    ''')
    got = launched(script, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    r = parse_report(got.stdout)
    for kind, forked in (("module", False), ("fork", False), ("forkserver", True),
                         ("spawn", True), ("executor-fork", False),
                         ("executor-forkserver", True), ("executor-spawn", True)):
        assert r[kind] == [(0.0, forked), (3.0, forked), (6.0, forked)], (kind, r)


def test_subprocess_of_a_launched_program_is_served(tmp_path):
    # A python started by exec (not multiprocessing) is part of the program too.
    script = write(tmp_path / "sub.py", '''
        import subprocess, sys
        code = "import torch.multiprocessing as mp; print(getattr(mp, '__mpcore__', False))"
        print(subprocess.run([sys.executable, "-c", code], capture_output=True,
                             text=True, check=True).stdout.strip())
    ''')
    got = launched(script, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout == "True\n"
    want = plain(script, cwd=tmp_path)
    assert want.returncode == 0, want.stderr
    assert want.stdout == "False\n"


def test_stats_lines_under_launcher(tmp_path):
    stats = tmp_path / "stats.jsonl"
    script = write(tmp_path / "q.py", '''
        import torch
        import torch.multiprocessing as mp
        import os
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale

        def child(q):
            q.put(torch.arange(4.0))

        if __name__ == "__main__":
            q = mp.Queue()
            p = mp.Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=60 * SLOW).tolist())
            p.join()
    ''')
    proc = launched(script, cwd=tmp_path, env=clean_env(MPCORE_STATS=str(stats)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[0.0, 1.0, 2.0, 3.0]\n"
    lines = [json.loads(l) for l in stats.read_text().splitlines()]
    main = [l for l in lines if l["pid"] == proc.pid]
    assert len(main) == 1, lines
    main = main[0]
    assert main["processes_started"] == 1
    assert main["queues_created"] == 1
    assert main["handles_received"] >= 1
    assert any(k.startswith("shm_") for k in main)
    others = [l for l in lines if l["pid"] != proc.pid]
    assert len(others) == 1 and others[0]["handles_sent"] >= 1


def test_no_stats_without_launcher_or_mpcore(tmp_path):
    stats = tmp_path / "stats.jsonl"
    script = write(tmp_path / "t.py", '''
        import torch
        import torch.multiprocessing as mp
        print(hasattr(mp, "__mpcore__"))
    ''')
    r = plain(script, cwd=tmp_path, env=clean_env(MPCORE_STATS=str(stats)))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "False\n"
    assert not stats.exists()


def test_stats_of_a_fork_child_are_its_own(tmp_path):
    # mpcore.stats() / MPCORE_STATS count "what mpcore served in this process":
    # a fork child that shares and starts nothing must not report its
    # parent's counts as its own (summing the lines would count them twice).
    stats = tmp_path / "stats.jsonl"
    script = write(tmp_path / "idle.py", '''
        import torch
        import torch.multiprocessing as mp

        def idle():
            pass

        if __name__ == "__main__":
            t = torch.zeros(8).share_memory_()
            ps = [mp.Process(target=idle) for _ in range(3)]
            for p in ps:
                p.start()
            for p in ps:
                p.join()
            print([p.exitcode for p in ps])
    ''')
    proc = launched(script, cwd=tmp_path, env=clean_env(MPCORE_STATS=str(stats)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[0, 0, 0]\n"
    lines = [json.loads(l) for l in stats.read_text().splitlines()]
    main = [l for l in lines if l["pid"] == proc.pid]
    children = [l for l in lines if l["pid"] != proc.pid]
    assert len(main) == 1 and len(children) == 3, lines
    assert main[0]["processes_started"] == 3
    assert main[0]["storages_shared"] == 1
    for child in children:
        assert child.get("processes_started", 0) == 0, child
        assert child.get("storages_shared", 0) == 0, child
