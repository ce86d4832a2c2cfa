"""Faults of the C core itself: a fork while another thread holds one of
the core's locks, a keeper whose connect() is interrupted, and errors that
must be reported as what they are (a missing /proc file is no bad handle,
a failed malloc no shortage of shared memory)."""
import os
import platform
import shutil

import pytest

from helpers import require, scaled

pytestmark = pytest.mark.timeout(180)


def test_children_forked_while_threads_hold_core_locks_do_not_hang(scenario):
    # Two threads hammer paths that hold a lock of the core with the GIL
    # released: loading NCCL (which tries libraries under its lock) and
    # allocating shared memory (which checks the memory available under
    # another).  The main thread forks children meanwhile; each child uses
    # both paths again and must finish.  A lock copied while held would hang
    # the child (NOTE [ Reset after fork ] in core.c).
    r = scenario.run(r"""
        import os, sys, threading, time
        SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
        import mpcore
        from mpcore import _core

        stop = threading.Event()
        ready = [threading.Event(), threading.Event()]

        def load_nccl():
            while not stop.is_set():
                try:
                    _core.nccl_load(["/nonexistent/libnccl.so.2"])
                except Exception:
                    pass
                ready[0].set()

        def allocate():
            k = 0
            while not stop.is_set():
                k += 1
                b = _core.alloc((1 << 20) + 4096 * (k % 64))
                del b
                ready[1].set()

        threads = [threading.Thread(target=load_nccl), threading.Thread(target=allocate)]
        for t in threads:
            t.start()
        for e in ready:
            e.wait(60 * SLOW)
        hung = []
        for i in range(60):
            pid = os.fork()
            if pid == 0:
                try:
                    _core.nccl_load(["/nonexistent/libnccl.so.2"])
                except Exception:
                    pass
                b = _core.alloc((1 << 20) + 4096 * i)
                del b
                os._exit(0)
            deadline = time.monotonic() + 30 * SLOW
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    if status != 0:
                        hung.append((i, "exit status %d" % status))
                    break
                if time.monotonic() > deadline:
                    hung.append((i, "still running after %g s" % (30 * SLOW)))
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.005)
        stop.set()
        for t in threads:
            t.join()
        print("HUNG", hung)
    """, timeout=170)
    assert r.returncode == 0, r.stderr
    assert "HUNG []" in r.stdout, r.stdout + r.stderr
    scenario.check_clean()


# The number of connect(2) on the machines mpcore runs on.
_CONNECT = {"x86_64": 42, "aarch64": 203}


def test_interrupted_connect_joins_the_running_keeper(scenario):
    # A signal that interrupts connect() while the keeper's backlog is full
    # must not make the process start a second keeper: it retries and joins
    # the one named in MPCORE_KEEPER (NOTE [ Finding the keeper ]).
    require(platform.machine() in _CONNECT, "connect's syscall number is known here")
    r = scenario.run(r"""
        import os, signal, socket, sys, threading
        name = "mpcore-test-busy-%d" % os.getpid()
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        lsock.bind("\0" + name)
        lsock.listen(0)
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        filler.connect("\0" + name)      # the backlog is now full
        os.environ["MPCORE_KEEPER"] = name
        signal.signal(signal.SIGUSR1, lambda *a: None)   # no SA_RESTART
        main_tid = threading.get_native_id()
        main_ident = threading.main_thread().ident
        CONNECT = int(sys.argv[1])

        def in_connect():
            with open("/proc/self/task/%d/syscall" % main_tid) as f:
                return f.read().split()[0] == str(CONNECT)

        accepted = []

        lsock.settimeout(20)

        def helper():
            import time
            while not in_connect():          # the main thread waits for room
                time.sleep(0.001)
            signal.pthread_kill(main_ident, signal.SIGUSR1)
            for _ in range(2):               # the filler, then the main thread
                accepted.append(lsock.accept()[0])

        t = threading.Thread(target=helper)
        t.start()
        from mpcore import _core   # importing mpcore connects to MPCORE_KEEPER
        got = _core.ensure_keeper()
        t.join()
        print("NAME", got == name, os.environ["MPCORE_KEEPER"] == name, _core.keeper_pid())
        sys.stdout.flush()
        os._exit(0)
    """, str(_CONNECT.get(platform.machine(), 0)), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "NAME True True 0" in r.stdout, r.stdout + r.stderr
    scenario.check_clean()


def test_missing_proc_meminfo_is_an_os_error_not_a_bad_handle():
    # Where /proc/meminfo cannot be read, mem_available says so: an OSError
    # naming the file, not a HandleError (which is for handles).
    import subprocess
    import sys
    require(os.geteuid() == 0 and shutil.which("unshare") is not None,
            "root and unshare(1) to hide /proc in a mount namespace")
    code = ("import errno, mpcore\n"
            "from mpcore import _core\n"
            "try:\n"
            "    _core.mem_available()\n"
            "except mpcore.HandleError as e:\n"
            "    print('HANDLEERROR', e)\n"
            "except OSError as e:\n"
            "    print('OSERROR', e.errno == errno.ENOENT, '/proc/meminfo' in str(e), e)\n"
            "else:\n"
            "    print('NO ERROR')\n")
    r = subprocess.run(["unshare", "--mount", "sh", "-c",
                        'mount -t tmpfs none /proc && exec "$0" -c "$1"', sys.executable, code],
                       capture_output=True, text=True, timeout=scaled(60))
    require("mount:" not in r.stderr and "unshare:" not in r.stderr,
            f"a private mount namespace (unshare said: {r.stderr.strip()})")
    assert "OSERROR True True" in r.stdout, r.stdout + r.stderr


def test_a_failed_malloc_is_not_called_a_shortage_of_shared_memory():
    # The pool's books are plain malloc'd memory: a size no malloc can give
    # is a MemoryError about memory, never one about shared memory.
    from mpcore import _core
    buf = bytearray(_core.ring_footprint(4096))
    ring = _core.Ring(buf, create=True)
    with pytest.raises(MemoryError) as info:
        _core.Pool(ring, 1 << 20, 1 << 30)
    assert "shared memory" not in str(info.value)
    assert str(info.value)  # says something


_FAIL_CALLOC = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

extern void *__libc_calloc(size_t, size_t);
static int armed;

/* The next calloc called from mpcore's core fails. */
void mpc_test_fail_next_core_calloc(void) { __atomic_store_n(&armed, 1, __ATOMIC_SEQ_CST); }

void *calloc(size_t n, size_t size) {
    if (__atomic_load_n(&armed, __ATOMIC_SEQ_CST)) {
        Dl_info info;
        if (dladdr(__builtin_return_address(0), &info) && info.dli_fname &&
            strstr(info.dli_fname, "/_core.") && __atomic_exchange_n(&armed, 0, __ATOMIC_SEQ_CST)) {
            errno = ENOMEM;
            return NULL;
        }
    }
    return __libc_calloc(n, size);
}
"""


def test_a_new_segment_whose_books_cannot_be_allocated_is_retired(scenario, tmp_path):
    # When the books of a new segment cannot be allocated, the segment
    # (already registered with the keeper) is retired and the allocation
    # fails with MemoryError; the process neither crashes (reading the
    # unmapped header) nor leaves the keeper holding the segment.
    import subprocess
    from helpers import run_program
    require(shutil.which("gcc") is not None, "gcc to build a calloc that fails on demand")
    src = tmp_path / "failcalloc.c"
    so = tmp_path / "failcalloc.so"
    src.write_text(_FAIL_CALLOC)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(so), str(src), "-ldl"],
                   check=True, timeout=scaled(60))
    env = dict(scenario.env(), LD_PRELOAD=str(so))
    r = run_program(r"""
        import ctypes, os
        from mpcore import _core
        b = _core.alloc(4096)          # connected, slot taken
        kpid = _core.keeper_pid()

        def keeper_memfds():
            n = 0
            for fd in os.listdir("/proc/%d/fd" % kpid):
                try:
                    n += "memfd:mpcore" in os.readlink("/proc/%d/fd/%s" % (kpid, fd))
                except OSError:
                    pass
            return n

        before = keeper_memfds()
        ctypes.CDLL(None).mpc_test_fail_next_core_calloc()
        try:
            _core.alloc(8 << 20)
            print("NO ERROR")
        except MemoryError as e:
            print("MEMORYERROR", e)
        print("KEEPER HOLDS", keeper_memfds() - before, "MORE")
        big = _core.alloc(8 << 20)     # the next allocation works
        print("ALLOCATED", len(memoryview(big)) >= 8 << 20)
    """, env=env, timeout=60)
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "MEMORYERROR out of memory" in r.stdout, r.stdout + r.stderr
    assert "KEEPER HOLDS 0 MORE" in r.stdout, r.stdout
    assert "ALLOCATED True" in r.stdout, r.stdout
    scenario.check_clean()
