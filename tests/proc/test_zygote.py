"""The zygote: spawn semantics at fork speed, and a safe fallback."""
import os
import re
import signal

import pytest

from helpers import exited, run_program, scaled

pytestmark = pytest.mark.timeout(120)


def test_child_gets_spawn_semantics(tmp_path, leak_check):
    # What a spawned child sees is the requester's state as of the start:
    # environment, cwd, sys.path and argv, __main__ as __mp_main__, and no
    # fd of the parent's beyond stdio.
    r = run_program(f"""
        import os, sys
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        import mpcore
        def child(q):
            targets = set()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    targets.add(os.readlink(f"/proc/self/fd/{{fd}}"))
                except OSError:
                    pass
            with open("/proc/self/stat") as f:  # the kernel's parent, not os.getppid()'s
                kernel_ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            q.put((os.environ.get("PROBE"), os.getcwd(), sys.path[-1], sys.argv[1:],
                   __name__, child.__module__, kernel_ppid, targets))
        if __name__ == "__main__":
            leaked = open(__file__)          # an fd the child must not get
            os.environ["PROBE"] = "set-after-start-of-zygote"
            os.chdir({str(tmp_path)!r})
            sys.path.append("/nonexistent/probe")
            ctx = mpcore.get_context("spawn")
            q = mpcore.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            env, cwd, last, argv, name, mod, ppid, targets = q.get(timeout=60 * SLOW)
            p.join()
            # The child is the zygote's, not ours: forked, not exec'd.
            print(env, cwd, last, argv, name, mod, ppid != os.getpid(), p.exitcode)
            print("leaked" if os.path.realpath(leaked.name) in targets else "clean")
        """, "a1", "a2", launcher=True)
    assert r.returncode == 0, r.stderr
    out = r.stdout.split("\n")
    assert out[0] == (f"set-after-start-of-zygote {tmp_path} /nonexistent/probe ['a1', 'a2'] "
                      "__mp_main__ __mp_main__ True 0"), r.stdout
    assert out[1] == "clean"


def test_zygote_with_threads_falls_back_and_says_so(tmp_path, leak_check):
    # A preload that starts a thread: the zygote must not fork, and the
    # child is started by exec instead, with a warning.
    (tmp_path / "threaded_preload.py").write_text(
        "import threading\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()\n")
    r = run_program("""
        import mpcore
        import os
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        def child(q):
            q.put(42)
        if __name__ == "__main__":
            q = mpcore.Queue()
            p = mpcore.get_context("spawn").Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=60 * SLOW))
            p.join()
            print(p.exitcode)
        """, env={"MPCORE_ZYGOTE_PRELOAD": "threaded_preload",
                  "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["42", "0"]
    assert "zygote has 2 threads" in r.stderr and "by exec" in r.stderr, r.stderr


def test_zygote_lives_as_long_as_its_program(leak_check):
    r = run_program("""
        import os, mpcore
        from mpcore.proc import _zygote
        def child():
            pass
        if __name__ == "__main__":
            p = mpcore.get_context("spawn").Process(target=child)
            p.start(); p.join()
            print(_zygote._service[1], p.exitcode)
        """)
    assert r.returncode == 0, r.stderr
    zpid, code = map(int, r.stdout.split())
    assert code == 0
    # The program has exited; its zygote notices at once and leaves (it is
    # reaped by init, so poll for it to be gone rather than a zombie).
    import time
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline:
        if exited(zpid):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"zygote {zpid} outlived its program")


def test_requester_killed_children_die(leak_check):
    # The requester is SIGKILLed: the zygote kills its children at once.
    r = run_program("""
        import os, signal, sys, time
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        import mpcore
        def child(q):
            q.put(os.getpid())
            time.sleep(600)
        if __name__ == "__main__":
            q = mpcore.Queue()
            ctx = mpcore.get_context("spawn")
            procs = [ctx.Process(target=child, args=(q,)) for _ in range(3)]
            for p in procs:
                p.start()
            for _ in procs:
                q.get(timeout=60 * SLOW)
            print(" ".join(str(p.pid) for p in procs), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """)
    assert r.returncode == -9
    pids = [int(x) for x in r.stdout.split()]
    assert len(pids) == 3
    import time
    deadline = time.monotonic() + scaled(1.0)
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not exited(p)]
        time.sleep(0.01)
    assert not alive, (f"children still running {scaled(1.0):g} s after their parent was "
                       f"killed: {alive}")



def test_child_output_on_a_terminal_is_line_buffered(tmp_path, leak_check):
    # A spawned child whose stdout is a terminal prints line by line; the
    # zygote's own stdout was /dev/null, so its children must be reset.  The
    # child's line must reach the terminal while the child still runs: the
    # test only answers (unblocking the child) once it has read that line.
    import pty
    import select
    import subprocess
    import sys
    from helpers import fresh_env
    prog = tmp_path / "tty.py"
    prog.write_text(
        "import sys, mpcore\n"
        "def child(q):\n"
        "    print('child is running')\n"
        "    q.get()\n"
        "if __name__ == '__main__':\n"
        "    q = mpcore.Queue()\n"
        "    p = mpcore.get_context('spawn').Process(target=child, args=(q,))\n"
        "    p.start()\n"
        "    q.put(sys.stdin.readline())\n"
        "    p.join()\n"
        "    print('exit', p.exitcode)\n")
    master, slave = pty.openpty()
    env = fresh_env()
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.Popen([sys.executable, str(prog)], stdin=slave, stdout=slave,
                            stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out = b""
    try:
        while b"child is running" not in out:
            ready, _, _ = select.select([master], [], [], scaled(60))
            assert ready, f"no line from the child while it runs; got {out!r}"
            out += os.read(master, 1024)
        os.write(master, b"go\n")
        while b"exit" not in out or not out.rstrip().endswith(b"0"):
            ready, _, _ = select.select([master], [], [], scaled(60))
            assert ready, out
            try:
                out += os.read(master, 1024)
            except OSError:
                break
        assert proc.wait(timeout=scaled(60)) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        os.close(master)
    assert b"exit 0" in out


def _run_in(tmp_path, files, main, timeout=90):
    """Writes the program's files into tmp_path and runs main.py there under
    `mpcore run`."""
    import subprocess
    import sys
    import textwrap
    from helpers import fresh_env
    for name, text in dict(files, **{"main.py": main}).items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    return subprocess.run([sys.executable, "-m", "mpcore", "run", "main.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=scaled(timeout),
                          env=fresh_env())


def _wait_gone(pid):
    import time
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline:
        if exited(pid):
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail(f"zygote {pid} outlived its program")


def test_zygote_forked_at_torch_import_holds_nothing_of_the_program(tmp_path, leak_check):
    # NOTE [ The zygote costs only programs that use it ]: under `mpcore
    # run` the zygote is the launcher's process forked once torch is
    # imported.  Its child must still be a clean spawn child: the program's
    # own modules (one that imported torch, half imported at the fork) are
    # imported afresh in the child, and the zygote holds none of the
    # program's fds, signal handlers or output.
    r = _run_in(tmp_path, {
        "early.py": "import os\nloaded_in = os.getpid()\n",
        "outer.py": "import os\nimport torch\nloaded_in = os.getpid()\nDONE = True\n",
    }, """
        import os, signal, sys
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        import early
        held = open(__file__)                    # an fd of the program's
        signal.signal(signal.SIGTERM, lambda *a: None)
        if __name__ == "__main__":
            print("buffered before the fork", end="|")
        import outer                             # imports torch: the fork happens inside
        from mpcore.proc import _zygote
        import mpcore

        def child(q):
            q.put((early.loaded_in == os.getpid(), outer.loaded_in == os.getpid(), outer.DONE,
                   __name__))

        def zygote_view(pid):
            with open(f"/proc/{pid}/status") as f:
                caught = int(next(l for l in f if l.startswith("SigCgt:")).split()[1], 16)
            fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            return (bool(caught >> (signal.SIGTERM - 1) & 1),
                    sorted(t for t in fds if t not in ("/dev/null", "anon_inode:[signalfd]")
                           and not t.startswith("socket:")))   # all the zygote's own

        if __name__ == "__main__":
            zpid = _zygote._service[1]
            print(_zygote._forked, os.getppid() != zpid, open(f"/proc/{zpid}/stat").read()
                  .rsplit(")", 1)[1].split()[1] == str(os.getpid()))
            q = mpcore.Queue()
            p = mpcore.get_context("spawn").Process(target=child, args=(q,))
            p.start()
            got = q.get(timeout=60 * SLOW)
            p.join()
            print(*zygote_view(zpid))            # it has served: its set-up is done
            print(*got)
            print(p.exitcode, zpid)
        """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == "buffered before the fork|True True True", r.stdout
    assert lines[1] == "False []", r.stdout          # no handler of ours, no fd of ours
    assert lines[2] == "True True True __mp_main__", r.stdout
    code, zpid = lines[3].split()
    assert code == "0"
    assert r.stdout.count("buffered before the fork") == 1, r.stdout
    _wait_gone(int(zpid))


def test_a_childs_thread_imports_what_the_fork_was_importing(tmp_path, leak_check):
    # NOTE [ The zygote is born inside an import ]: the zygote is forked in
    # the hook on torch's import, here inside the program's own `import
    # outer` too.  In its child, a thread other than the main one imports
    # both (as a collectives thread's callback or a loader's thread does).
    r = _run_in(tmp_path, {"outer.py": "import torch\n"}, """
        import threading
        import outer                             # imports torch: the fork happens inside
        import mpcore
        import os
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale

        def child(q):
            got = []

            def imports():
                import torch
                import outer
                got.append((torch.__name__, outer.__name__))
            t = threading.Thread(target=imports, daemon=True)
            t.start()
            t.join(20 * SLOW)
            q.put(got)

        if __name__ == "__main__":
            q = mpcore.Queue()
            p = mpcore.get_context("spawn").Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=60 * SLOW))
            p.join(60 * SLOW)
            print(p.exitcode)
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[('torch', 'outer')]", "0"], r.stdout


def test_program_objects_shared_with_the_zygote_are_frozen(tmp_path, leak_check):
    # NOTE [ Pages the zygote shares ]: what the program had at the fork is
    # in the collector's permanent generation; what it makes later is
    # collected as before.
    r = _run_in(tmp_path, {}, """
        import gc
        before = gc.get_freeze_count()
        import torch
        from mpcore.proc import _zygote
        frozen = gc.get_freeze_count()
        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        print(_zygote._forked, before, frozen > 10000, gc.collect() >= 2)
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "0", "True", "True"], r.stdout


def test_zygote_not_started_for_a_program_that_never_imports_torch(tmp_path, leak_check):
    # A program without torch never pays for a zygote until it asks for a
    # spawn child; then one is started by exec and serves it.
    r = _run_in(tmp_path, {}, """
        import mpcore, sys
        from mpcore.proc import _zygote
        import os
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        def child(q):
            q.put("torch" in sys.modules)
        if __name__ == "__main__":
            print(_zygote._service is None, "torch" in sys.modules)
            q = mpcore.Queue()
            p = mpcore.get_context("spawn").Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=60 * SLOW), _zygote._forked)
            p.join()
            print(p.exitcode, _zygote._service[1])
        """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == "True False", r.stdout
    assert lines[1] == "True False", r.stdout        # the exec'd zygote preloads torch
    code, zpid = lines[2].split()
    assert code == "0"
    _wait_gone(int(zpid))


def test_zygote_not_forked_while_the_program_runs_threads(tmp_path, leak_check):
    # torch imported while another Python thread runs: no fork (the thread
    # could hold a lock the zygote would need); the first spawn child comes
    # from a zygote started by exec.
    r = _run_in(tmp_path, {}, """
        import threading
        stop = threading.Event()
        t = threading.Thread(target=stop.wait)
        t.start()
        import torch
        stop.set()
        t.join()
        import os, mpcore
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        from mpcore.proc import _zygote
        def child(q):
            q.put(os.getpid())
        if __name__ == "__main__":
            print(_zygote._service is None)
            q = mpcore.Queue()
            p = mpcore.get_context("spawn").Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=60 * SLOW) == p.pid, _zygote._forked)
            p.join()
            print(p.exitcode, _zygote._service[1])
        """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[:2] == ["True", "True False"], r.stdout
    code, zpid = lines[2].split()
    assert code == "0"
    _wait_gone(int(zpid))


ENDINGS_PROGRAM = """
    import atexit, os, sys, tempfile
    SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
    import multiprocessing
    import mpcore
    def child(out, how):
        f = open(os.path.join(out, "file"), "w")   # left open, never flushed
        f.write("written")
        globals()["kept"] = f
        td = tempfile.TemporaryDirectory(dir=out)  # removed at exit by python
        globals()["td"] = td
        atexit.register(lambda: open(os.path.join(out, "atexit"), "w").close())
        if how == "exit3":
            sys.exit(3)
        if how == "raise":
            raise ValueError("from the child")
    if __name__ == "__main__":
        side, method, out = sys.argv[1:4]
        ctx = (multiprocessing if side == "stdlib" else mpcore).get_context(method)
        for how in ("return", "exit3", "raise"):
            d = os.path.join(out, how)
            os.mkdir(d)
            p = ctx.Process(target=child, args=(d, how))
            p.start()
            p.join(60 * SLOW)
            left = sorted(n for n in os.listdir(d) if n not in ("file", "atexit"))
            with open(os.path.join(d, "file")) as f:
                text = f.read()
            print(how, p.exitcode, repr(text), os.path.exists(os.path.join(d, "atexit")),
                  "tmpdirs left:", len(left))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_ends_as_the_standard_librarys_would(tmp_path, method, leak_check):
    # NOTE [ A spawned child ends as python would ]: a spawned child runs its
    # atexit handlers (a TemporaryDirectory is removed) and flushes the files
    # it left open, whether it returns, exits or raises; a forkserver child
    # does neither.  The standard library's own contexts are the reference.
    outs = {}
    for side in ("stdlib", "mpcore"):
        d = tmp_path / side
        d.mkdir()
        r = run_program(ENDINGS_PROGRAM, side, method, str(d), launcher=(side == "mpcore"))
        assert r.returncode == 0, r.stderr
        outs[side] = r.stdout
    assert outs["mpcore"] == outs["stdlib"], outs
    if method == "spawn":
        assert outs["mpcore"].splitlines() == [
            "return 0 'written' True tmpdirs left: 0",
            "exit3 3 'written' True tmpdirs left: 0",
            "raise 1 'written' True tmpdirs left: 0"], outs


START_ENV_PROGRAM = """
    import os, sys
    SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
    import multiprocessing
    import torch
    import mpcore
    def child(q):
        from torch._logging import _internal
        seeded = os.environ.get("PYTHONHASHSEED") not in (None, "random")
        q.put((torch.get_num_threads(), hash("abc") if seeded else None,
               sorted(_internal.log_state.get_log_level_pairs())))
    if __name__ == "__main__":
        ctx = (multiprocessing if sys.argv[1] == "stdlib" else mpcore).get_context("spawn")
        rows = (("OMP_NUM_THREADS", None), ("OMP_NUM_THREADS", "1"), ("OMP_NUM_THREADS", "3"),
                ("OMP_NUM_THREADS", "x"), ("MKL_NUM_THREADS", "1"), ("TORCH_LOGS", "dynamo"),
                ("PYTHONHASHSEED", "0"))
        for name, value in rows:
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print(name, value, q.get(timeout=60 * SLOW), flush=True)
            p.join()
"""


INHERIT_PROGRAM = """
    import os, resource, signal, sys
    SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
    import multiprocessing
    if sys.argv[1] == "mpcore":
        import torch  # under mpcore run, the zygote starts now
    import mpcore
    def disposition(sig):
        h = signal.getsignal(sig)
        return {signal.SIG_IGN: "ign", signal.SIG_DFL: "dfl",
                signal.default_int_handler: "int"}.get(h, "handler")
    def kernel_ignores():
        with open("/proc/self/status") as f:
            bits = int(next(l for l in f if l.startswith("SigIgn:")).split()[1], 16)
        return {s for s in range(1, 64) if bits >> (s - 1) & 1}
    def child(q):
        mask = os.umask(0)
        sigs = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
        ignored = kernel_ignores()
        q.put(([disposition(s) + ("/kernel-ign" if s in ignored else "") for s in sigs],
               resource.getrlimit(resource.RLIMIT_NOFILE), oct(mask),
               os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0)),
               open("/proc/self/comm").read().strip(),
               sorted(signal.pthread_sigmask(signal.SIG_BLOCK, ()))))
    if __name__ == "__main__":
        method = sys.argv[2]
        ctx = (multiprocessing if sys.argv[1] == "stdlib" else mpcore).get_context(method)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        rows = (("nohup", lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)),
                ("background", lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)),
                ("a handler", lambda: signal.signal(signal.SIGTERM, lambda *a: None)),
                ("SIGUSR2 back", lambda: signal.signal(signal.SIGUSR2, signal.SIG_DFL)),
                ("fewer files", lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                           (min(soft, 512) - 1, hard))),
                ("umask", lambda: os.umask(0o077)),
                ("nicer", lambda: os.nice(3)),
                ("blocked", lambda: signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])),
                ("one core", lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})))
        for name, change in rows:
            change()
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print(name, q.get(timeout=60 * SLOW), flush=True)
            p.join()
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_inherits_what_a_fresh_start_would(leak_check, method):
    # NOTE [ What a spawned child inherits from its parent ]: the program is
    # started with SIGUSR2 ignored (so is the zygote), then changes its
    # signals, a limit, its umask, nice value, blocked signals and affinity,
    # one by one, the first before its first child; each child has what the
    # standard library's has, and its name (ps, pkill).  Under `mpcore run`
    # the zygote is older than all of them.
    outs = {}
    before = signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # inherited by the program
    try:
        for side in ("stdlib", "mpcore"):
            r = run_program(INHERIT_PROGRAM, side, method, launcher=(side == "mpcore"))
            assert r.returncode == 0, r.stderr
            assert "could not take" not in r.stderr, r.stderr
            outs[side] = r.stdout
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert outs["mpcore"] == outs["stdlib"], outs
    last = outs["mpcore"].splitlines()[-1]
    if method == "spawn":  # each child has its parent's latest
        assert last.startswith(
            "one core (['ign/kernel-ign', 'ign/kernel-ign', 'dfl', 'dfl'], ("), outs
        assert "'0o77', 3, [" in last, outs
    else:  # each has the parent's at its first 'forkserver' child
        firsts = {line.split(" (", 1)[1] for line in outs["mpcore"].splitlines()}
        assert len(firsts) == 1 and last.startswith(
            "one core (['ign/kernel-ign', 'int', 'dfl', 'ign/kernel-ign'], ("), outs


FLAGS_PROGRAM = """
    import faulthandler, sys, warnings
    import multiprocessing
    import torch
    import mpcore
    import os
    SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
    def child(q):
        q.put((sys.flags.optimize, __debug__, faulthandler.is_enabled(), sys._xoptions,
               [(f[0], getattr(f[1], "pattern", f[1]), f[2].__name__,
                 getattr(f[3], "pattern", f[3])) for f in warnings.filters]))
    if __name__ == "__main__":
        ctx = (multiprocessing if sys.argv[1] == "stdlib" else mpcore).get_context(sys.argv[2])
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        print(q.get(timeout=60 * SLOW), flush=True)
        p.join()
"""


@pytest.mark.parametrize("launcher", [False, True], ids=["import", "mpcore-run"])
def test_a_child_has_the_interpreters_flags_and_warning_filters(leak_check, launcher):
    # the zygote started by exec gets the interpreter's flags, as a spawned
    # child does (_zygote._interpreter_flags); the one forked under `mpcore
    # run` keeps the filters torch's and numpy's imports made (NOTE [ The
    # zygote costs only programs that use it ])
    method = "spawn"
    flags = ["-O", "-X", "faulthandler", "-W", "error::UserWarning"]
    outs = {}
    for side in ("stdlib", "mpcore"):
        r = run_program(FLAGS_PROGRAM, side, method, launcher=launcher, flags=flags)
        assert r.returncode == 0, r.stderr
        outs[side] = r.stdout
    assert outs["mpcore"] == outs["stdlib"], outs
    assert outs["mpcore"].startswith("(1, False, True, {'faulthandler': True}, [("), outs
    assert "TracerWarning" in outs["mpcore"] and "('error', None, 'UserWarning'" in outs["mpcore"]


RAISING_PROGRAM = """
    import sys
    import multiprocessing
    import mpcore
    class Worker(multiprocessing.Process if sys.argv[1] == "stdlib" else mpcore.Process):
        def run(self):  # a subclass's run(), which calls no other
            raise ValueError("from the child's run")
    def target():
        raise KeyError("from the child's target")
    if __name__ == "__main__":
        mod = multiprocessing if sys.argv[1] == "stdlib" else mpcore
        mod.set_start_method(sys.argv[2])
        for p in (mod.Process(target=target), Worker()):
            p.start()
            p.join()
            print(p.exitcode, flush=True)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_a_childs_traceback_is_the_standard_librarys(leak_check, method, tmp_path):
    # mpcore's Process adds no frame of its own to what a failing child
    # prints, and a subclass's run() is served like any other
    outs, stats = {}, tmp_path / "stats"
    for side in ("stdlib", "mpcore"):
        r = run_program(RAISING_PROGRAM, side, method,
                        env={"MPCORE_STATS": str(stats)} if side == "mpcore" else None)
        outs[side] = (r.returncode, r.stdout, re.sub(r'File "[^"]*tmp\w*\.py"', "PROGRAM",
                                                     r.stderr))
    assert outs["mpcore"] == outs["stdlib"], outs
    assert outs["mpcore"][1] == "1\n1\n" and "from the child's run" in outs["mpcore"][2], outs
    reports = stats.read_text().splitlines()
    assert len(reports) == 3, reports  # the program and its two children


PARENT_PROGRAM = """
    import os, signal, sys
    SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
    import mpcore
    def child(q, until, tell_parent):
        with open("/proc/self/stat") as f:
            real_ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        q.put((os.getppid(), real_ppid))
        if tell_parent:
            os.kill(os.getppid(), signal.SIGUSR1)
        until.poll(60 * SLOW)  # a pipe: a child killed while it waits leaves nothing locked
    if __name__ == "__main__":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
        ctx = mpcore.get_context(sys.argv[1])
        q = ctx.Queue()
        until, go = ctx.Pipe(duplex=False)
        first = ctx.Process(target=child, args=(q, until, True))
        first.start()
        ppid, zygote = q.get(timeout=60 * SLOW)
        heard = signal.sigtimedwait([signal.SIGUSR1], 60 * SLOW)
        print("parent", ppid == os.getpid(), zygote != os.getpid(), heard is not None, flush=True)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
            os.kill(zygote, sig)  # as a job's every process gets them
        second = ctx.Process(target=child, args=(q, until, False))
        second.start()
        print("second", q.get(timeout=60 * SLOW) == (os.getpid(), zygote), flush=True)
        os.kill(zygote, signal.SIGKILL)
        first.join(60 * SLOW)
        second.join(60 * SLOW)
        print("killed with it", first.exitcode, second.exitcode, flush=True)
        third = ctx.Process(target=child, args=(q, until, False))
        third.start()
        print("third", q.get(timeout=60 * SLOW)[0] == os.getpid(), flush=True)
        go.send(None)
        third.join(60 * SLOW)
        print("third ended", third.exitcode, flush=True)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_signals_its_parent_and_the_zygote_outlives_stray_signals(leak_check, method):
    # NOTE [ A child's parent ]: os.kill(os.getppid(), ...) reaches the
    # program, not the zygote; signals sent to the zygote itself do not end
    # it; and once it is killed, its children are reported killed with it
    # (once, with a warning), and later ones are started by exec
    r = run_program(PARENT_PROGRAM, method, launcher=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["parent True True True", "second True",
                                     "killed with it -9 -9", "third True", "third ended 0"], r
    assert r.stderr.count("the zygote has gone, and the processes it started were killed") == 1
    assert r.stderr.count("starting processes by exec instead") == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def _outputs(program, *args, launcher=False, timeout=60):
    """{side: stdout} of `program` run with the standard library's
    multiprocessing ("stdlib" as its first argument) and with mpcore's
    (under `mpcore run` when `launcher`), each run having exited with 0."""
    outs = {}
    for side in ("stdlib", "mpcore"):
        r = run_program(program, side, *args, launcher=launcher and side == "mpcore",
                        timeout=timeout)
        assert r.returncode == 0, (side, r.stdout, r.stderr)
        outs[side] = r.stdout
    return outs


WAITERS_PROGRAM = """
    import os, platform, resource, signal, sys, threading
    import multiprocessing
    import mpcore
    FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
    def child(until):
        until.recv()
    def when_blocked(tid, then):
        # runs `then` once thread tid sleeps in a system call other than a
        # futex (where it waits for the GIL): inside the join it was started
        # into, which is all it does
        def watch():
            while True:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open(f"/proc/self/task/{tid}/syscall") as f:
                    nr = f.read().split()[0]
                if state == "S" and nr.isdigit() and int(nr) != FUTEX:
                    return then()
        threading.Thread(target=watch, daemon=True).start()
    if __name__ == "__main__":
        side, method = sys.argv[1:]
        # every fd the program opens from now on is above select()'s FD_SETSIZE
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
        filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        ctx = (multiprocessing if side == "stdlib" else mpcore).get_context(method)
        # 1. a signal handler looks at a child while the program joins it
        until, go = ctx.Pipe(duplex=False)
        p = ctx.Process(target=child, args=(until,))
        p.start()
        def handler(signum, frame):
            print("handler sees it alive", p.is_alive(), flush=True)
            go.send(None)
        signal.signal(signal.SIGUSR1, handler)
        when_blocked(threading.get_native_id(), lambda: os.kill(os.getpid(), signal.SIGUSR1))
        p.join()
        print("joined", p.exitcode, flush=True)
        # 2. a thread joins one child while another looks at a second
        pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
        joined, other = (ctx.Process(target=child, args=(until,)) for until, _ in pipes)
        joined.start()
        other.start()
        ready = threading.Event()
        def join_it():
            ready.set()
            joined.join()
        t = threading.Thread(target=join_it)
        t.start()
        ready.wait()
        looked = threading.Event()
        when_blocked(t.native_id, looked.set)
        looked.wait()
        print("while a thread joins", joined.is_alive(), other.is_alive(), flush=True)
        for _, go in pipes:
            go.send(None)
        t.join()
        other.join()
        print("both ended", joined.exitcode, other.exitcode, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_children_can_be_looked_at_while_another_waiter_blocks(leak_check, method):
    # NOTE [ Reading the zygote's replies ]: a signal handler that asks
    # whether a child lives while the program joins it, and a thread that
    # asks while another thread joins, get their answer at once, as with
    # multiprocessing; before, the first deadlocked and the second waited
    # for the join.  The program's fds are numbered above FD_SETSIZE, which
    # select() would refuse
    expected = ("handler sees it alive True\njoined 0\nwhile a thread joins True True\n"
                "both ended 0 0\n")
    assert _outputs(WAITERS_PROGRAM, method, timeout=50) == {"stdlib": expected,
                                                             "mpcore": expected}


TERMINATE_PROGRAM = """
    import sys
    import multiprocessing
    import mpcore
    import os
    SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
    def child(until):
        until.recv()
    if __name__ == "__main__":
        side, method = sys.argv[1:]
        ctx = (multiprocessing if side == "stdlib" else mpcore).get_context(method)
        until, go = ctx.Pipe(duplex=False)
        codes = []
        for _ in range(5):
            p = ctx.Process(target=child, args=(until,))
            p.start()
            p.terminate()  # most often while the child is still starting
            p.join(10 * SLOW)
            codes.append(p.exitcode)
            if p.exitcode is None:
                p.kill()
                p.join()
        print(codes, flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_terminated_as_it_starts_ends(leak_check, method):
    # _ignore_stray_signals: the zygote ignores SIGTERM, and its children
    # used to until they took their own dispositions, so a terminate() just
    # after start() (a Pool's `with` block that ends at once) was lost and
    # the join that followed waited for ever
    expected = f"{[-signal.SIGTERM] * 5}\n"
    assert _outputs(TERMINATE_PROGRAM, method, timeout=100) == {"stdlib": expected,
                                                                "mpcore": expected}


SIGCHLD_PROGRAM = """
    import os, select, signal, sys
    SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
    import multiprocessing
    import mpcore
    def child():
        pass
    if __name__ == "__main__":
        ctx = (multiprocessing if sys.argv[1] == "stdlib" else mpcore).get_context("spawn")
        r, w = os.pipe()
        ended = []
        p = ctx.Process(target=child)
        def handler(signum, frame):  # the end of a child: which one?
            if p.pid is not None and not ended and not p.is_alive():
                ended.append(p.exitcode)
                os.write(w, b"!")
        signal.signal(signal.SIGCHLD, handler)
        p.start()
        print("heard", bool(select.select([r], [], [], 30 * SLOW)[0]), ended, flush=True)
        p.join()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", [False, True], ids=["import", "mpcore-run"])
def test_a_spawned_childs_end_sends_sigchld(leak_check, launcher):
    # NOTE [ A child's parent ]: the program hears of its 'spawn' child's
    # end through SIGCHLD, as from a child of its own, and its handler finds
    # the child ended
    expected = "heard True [0]\n"
    assert _outputs(SIGCHLD_PROGRAM, launcher=launcher) == {"stdlib": expected,
                                                            "mpcore": expected}


GROUP_PROGRAM = """
    import os, sys
    SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
    import multiprocessing
    import torch  # under mpcore run, the zygote starts now
    import mpcore
    def child(q):
        q.put((os.getpgrp(), os.getsid(0)))
    if __name__ == "__main__":
        side, method, make = sys.argv[1:]
        getattr(os, make)()  # a group, or a session, of the program's own
        ctx = (multiprocessing if side == "stdlib" else mpcore).get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        print(make, q.get(timeout=60 * SLOW) == (os.getpgrp(), os.getsid(0)), flush=True)
        p.join()
"""


@pytest.mark.parametrize("make", ["setpgrp", "setsid"])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_is_in_its_parents_process_group(leak_check, method, make):
    # NOTE [ A child's process group ]: a program that makes a group or a
    # session of its own after the zygote started still has its children in
    # it (a killpg of its group reaches them)
    for side in ("stdlib", "mpcore"):
        r = run_program(GROUP_PROGRAM, side, method, make, launcher=(side == "mpcore"))
        assert r.returncode == 0, r.stderr
        assert r.stdout == f"{make} True\n", (side, r.stdout, r.stderr)
        if side == "mpcore":
            assert r.stderr.count("a session of its own") == (make == "setsid"), r.stderr


def test_a_child_reads_the_environment_as_a_fresh_start_would(leak_check):
    # NOTE [ What a fresh start reads from the environment ]: a spawned
    # child's torch threads and torch logging come from the environment it
    # is given, and its string hashes from its PYTHONHASHSEED, as the
    # standard library's spawned child has them, whatever the zygote was
    # started with.
    outs = {}
    for side in ("stdlib", "mpcore"):
        r = run_program(START_ENV_PROGRAM, side, launcher=(side == "mpcore"),
                        env={"OMP_NUM_THREADS": "2"})
        assert r.returncode == 0, r.stderr
        outs[side] = r.stdout
        if side == "mpcore":
            assert r.stderr.count("PYTHONHASHSEED is '0' here but was 'random'") == 1, r.stderr
    assert outs["mpcore"] == outs["stdlib"], outs
    lines = outs["mpcore"].splitlines()
    assert lines[1].startswith("OMP_NUM_THREADS 1 (1, None, [])"), outs
    assert "torch._dynamo" in lines[5] and "None" not in lines[6].split("(", 1)[1], outs
