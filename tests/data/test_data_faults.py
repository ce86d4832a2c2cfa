"""mpcore.data.DataLoader under faults: a worker that segfaults, exits, hangs
or raises; the main process SIGKILLed mid-epoch (fork and spawn workers); a
program that keeps every batch; a shared-memory shortage in a worker; and
the clean-up of normal and persistent loaders.

Each scenario runs as a fresh program (like test_shm_faults.py) tagged
through its environment, with the test process as the subreaper of its
tree, so that every process of the program (keeper, zygote, workers) is
waited for and reaped here; afterwards none of them runs, none holds an
mpcore memfd, and /dev/shm gained nothing (Scenario.check_clean).  Inside
the program, the main process reports its own children after the fault, so
that a worker left running or left a zombie by the loader itself is seen
before the program's exit would hide it.

Workers report through files written before they fault (their pid, and the
CLOCK_MONOTONIC time of the fault, which all processes share) and through a
FIFO; the test waits on pipes, the FIFO and pidfds.  The only polling
loops wait for the kernel to reap processes (Scenario's wait for the tree,
and the removal of an emptied cgroup), which is no event one can wait on.
"""
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from helpers import (TESTS_ON_PATH, fresh_env, make_memcg, memory_amounts, scaled,
                      program_result as result, remove_memcg)


def _env(scenario):
    env = fresh_env()
    env.update(scenario.env())
    return env


def _script(scenario, code):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(code))
    scenario.files.append(f.name)
    return f.name


def run(scenario, *args, timeout=60):
    """Runs PROGRAM with args; returns the CompletedProcess."""
    path = _script(scenario, PROGRAM)
    try:
        return subprocess.run([sys.executable, path, *map(str, args)], capture_output=True,
                              text=True, timeout=scaled(timeout), env=_env(scenario))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the program did not finish within {scaled(timeout):g}s (a hang); still "
                    f"running: "
                    f"{scenario.describe(scenario.live())}\nstdout:\n{e.stdout}\n"
                    f"stderr:\n{e.stderr}")


def popen(scenario, *args):
    path = _script(scenario, PROGRAM)
    return subprocess.Popen([sys.executable, path, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(scenario))


PROGRAM = TESTS_ON_PATH + r'''
import gc, json, os, signal, sys, threading, time
import numpy as np
import torch
torch.set_num_threads(1)
import mpcore
from mpcore.proc import _zygote
from mpcore.data import DataLoader, Dataset

MODE, WORK = sys.argv[1], sys.argv[2]
BS = 4          # samples per batch
BAD = 21        # the faulty sample: batch 5, which goes to worker 1 of 2


def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def no_core():
    import faulthandler, resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    faulthandler.disable()


def note_fault(i):
    """Written by a worker just before it faults: its pid and the time."""
    with open(os.path.join(WORK, "fault"), "w") as f:
        f.write(json.dumps({"pid": os.getpid(), "t": time.monotonic(), "index": i}))


def read_fault():
    with open(os.path.join(WORK, "fault")) as f:
        return json.load(f)


def elems(i):
    """float32 elements of sample i: 4 KB, or 1 MB in every 40th batch."""
    return (1 << 18) if (i // BS) % 40 == 0 else 1024


def sample(i):
    return {"x": torch.arange(elems(i), dtype=torch.float32) + i, "i": i}


def expected(j):
    """Batch j, computed without torch and without collation."""
    idx = np.arange(j * BS, (j + 1) * BS)
    return idx, np.arange(elems(j * BS), dtype=np.float32)[None, :] + idx[:, None]


def correct(j, b):
    idx, x = expected(j)
    return (sorted(b) == ["i", "x"] and np.array_equal(b["i"].numpy(), idx)
            and b["x"].dtype == torch.float32 and np.array_equal(b["x"].numpy(), x))


class DS(Dataset):
    def __init__(self, n, fault=None, fifo=None):
        self.n, self.fault, self.fifo = n, fault, fifo

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        f = self.fault
        if f == "block" and i >= 3 * BS:    # batches 3 on: every worker blocks
            fd = os.open(self.fifo, os.O_WRONLY)
            os.write(fd, b"%d\n" % os.getpid())
            os.close(fd)
            threading.Event().wait()
        if i == BAD and f is not None:
            if f == "segv":
                no_core()
                note_fault(i)
                os.kill(os.getpid(), signal.SIGSEGV)
            elif f == "exit3":
                note_fault(i)
                os._exit(3)
            elif f == "hang":
                note_fault(i)
                threading.Event().wait()
            elif f == "raise":
                raise ValueError(f"sample {i} is broken on purpose")
            elif f == "killme":             # waits to be SIGKILLed from outside
                fd = os.open(self.fifo, os.O_WRONLY)
                os.write(fd, b"%d\n" % os.getpid())
                os.close(fd)
                threading.Event().wait()
        return sample(i)


class Huge(Dataset):
    """Samples of 64 MiB each that cost nothing (expanded views of one
    element), so only collation asks for memory: 256 MiB per batch."""
    ELEMS = 16 << 20

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((1,), float(i)).expand(self.ELEMS)


def _stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def kids():
    """[pid, state] of this process's children, zombies included, but its
    keeper, its zygote and multiprocessing's resource tracker, which live
    as long as it does."""
    services = {mpcore._core.keeper_pid()}
    if _zygote._service is not None:
        services.add(_zygote._service[1])
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) in services:
            continue
        st = _stat(p)
        if st is None or int(st[1]) != os.getpid():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    continue
        except OSError:
            continue
        out.append([int(p), st[0]])
    return out


def worker_pids(loader):
    return [w["pid"] for w in loader.stats()["workers"]]


def settle():
    """Two round trips to the keeper: it has then handled every release
    and death that happened before (see test_shm_faults.py)."""
    for _ in range(2):
        try:
            mpcore._core.attach((0x5EED0001, 0, 1))
        except mpcore.HandleError:
            pass


from helpers import memfd_inodes  # noqa: E402


def memory_left():
    """What mpcore shared memory is still held once the program dropped
    everything: segments the keeper holds that this process does not map
    (held for processes that are gone), and segments this process maps
    that the keeper no longer holds (retired, but whose memory the mapping
    keeps alive), with the bytes of memory they hold."""
    settle()
    keeper = memfd_inodes(mpcore._core.keeper_pid())
    mine = memfd_inodes(os.getpid(), maps=True)
    retired = {i: n for i, n in mine.items() if i not in keeper}
    return {"keeper_only": len(set(keeper) - set(mine)), "retired_mapped": len(retired),
            "retired_bytes": sum(retired.values()), "stats": mpcore._core.stats()}


def drain(it):
    """Iterates to the end or the first error: (batch numbers got, error
    text, error type name, monotonic time of the error)."""
    got = []
    try:
        for b in it:
            got.append(int(b["i"][0]) // BS)
    except Exception as e:
        return got, str(e), type(e).__name__, time.monotonic()
    return got, None, None, None


def fatal():
    """A worker dies (segv, exit3) or hangs (hang) at sample BAD."""
    timeout = 1 if MODE == "hang" else 0
    loader = DataLoader(DS(64, MODE), batch_size=BS, num_workers=2, timeout=timeout)
    it = iter(loader)
    pids = worker_pids(loader)
    got, err, kind, t_raise = drain(it)
    kids_after_error = kids()
    del it
    kids_after_del = kids()
    del loader
    gc.collect()
    report(pids=pids, got=got, err=err, kind=kind, t_raise=t_raise, fault=read_fault(),
           kids_after_error=kids_after_error, kids_after_del=kids_after_del,
           kids_end=kids())


def sigkill():
    """A worker is SIGKILLed (by a thread of this program, which learns its
    pid from the FIFO it writes to) while the main thread waits in next()
    for a batch that worker holds."""
    ctx = None if sys.argv[3] == "fork" else sys.argv[3]
    fifo = os.path.join(WORK, "fifo")
    os.mkfifo(fifo)
    loader = DataLoader(DS(64, "killme", fifo), batch_size=BS, num_workers=2,
                        multiprocessing_context=ctx)
    it = iter(loader)
    pids = worker_pids(loader)
    killed = {}

    def killer():
        with open(fifo) as f:
            pid = int(f.readline())
        killed["t"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    got, err, kind, t_raise = drain(it)
    t.join()
    kids_after_error = kids()
    del it
    del loader
    gc.collect()
    report(pids=pids, got=got, err=err, kind=kind, t_raise=t_raise, killed=killed,
           kids_after_error=kids_after_error, kids_end=kids())


def raising():
    loader = DataLoader(DS(64, "raise"), batch_size=BS, num_workers=2)
    pids = worker_pids(loader)
    it = iter(loader)
    got, errors, bad = [], [], []
    while True:
        try:
            b = next(it)
        except StopIteration:
            break
        except ValueError as e:
            errors.append(str(e))
            continue
        j = int(b["i"][0]) // BS
        got.append(j)
        if not correct(j, b):
            bad.append(j)
    pids = worker_pids(loader)
    kids_after_epoch = kids()
    del it, b, loader
    gc.collect()
    report(got=got, errors=errors, bad=bad, pids=pids, kids_after_epoch=kids_after_epoch,
           kids_end=kids())


def keep_all():
    nbatches, workers, prefetch = 400, 2, 2
    mpcore._core.connect()
    before = memory_left()
    loader = DataLoader(DS(nbatches * BS), batch_size=BS, num_workers=workers,
                        prefetch_factor=prefetch)
    it = iter(loader)
    pids = worker_pids(loader)
    batches = list(it)
    bad_during = [j for j, b in enumerate(batches) if not correct(j, b)]
    shared = all(b["x"].is_shared() for b in batches)
    kids_after_epoch = kids()
    del it, loader
    gc.collect()
    bad_after = [j for j, b in enumerate(batches) if not correct(j, b)]
    held = {"mapped_bytes": mpcore._core.stats()["mapped_bytes"]}
    n = len(batches)
    del batches
    gc.collect()
    report(n=n, slots=workers * prefetch, bad_during=bad_during, bad_after=bad_after,
           shared=shared, pids=pids, kids_after_epoch=kids_after_epoch, kids_end=kids(),
           held=held, before=before, after=memory_left())


def normal():
    mpcore._core.connect()
    before = memory_left()
    loader = DataLoader(DS(64), batch_size=BS, num_workers=2)
    epochs = []
    for _ in range(2):
        got, bad = [], []
        for j, b in enumerate(loader):
            got.append(j)
            if not correct(j, b):
                bad.append(j)
        del b
        epochs.append({"got": got, "bad": bad, "pids": worker_pids(loader), "kids": kids()})
    del loader
    kids_after_del = kids()
    gc.collect()
    report(epochs=epochs, kids_after_del=kids_after_del, kids_end=kids(), before=before,
           after=memory_left())


def persistent():
    mpcore._core.connect()
    before = memory_left()
    loader = DataLoader(DS(64), batch_size=BS, num_workers=2, persistent_workers=True)
    epochs = []
    for _ in range(2):
        got, bad = [], []
        for j, b in enumerate(loader):
            got.append(j)
            if not correct(j, b):
                bad.append(j)
        del b
        epochs.append({"got": got, "bad": bad, "pids": worker_pids(loader), "kids": kids()})
    del loader                  # no gc.collect(): the workers go at del
    kids_after_del = kids()
    gc.collect()
    report(epochs=epochs, kids_after_del=kids_after_del, kids_end=kids(), before=before,
           after=memory_left())


def kill_main():
    """Prints the workers' pids once iteration is under way, then waits in
    next() for a batch that never comes, until the test kills it."""
    ctx = None if sys.argv[3] == "fork" else sys.argv[3]
    loader = DataLoader(DS(64, "block", os.path.join(WORK, "fifo")), batch_size=BS,
                        num_workers=2, multiprocessing_context=ctx)
    it = iter(loader)
    got = [int(next(it)["i"][0]) // BS for _ in range(3)]
    print("ITERATING " + json.dumps({"pids": worker_pids(loader), "got": got}), flush=True)
    next(it)
    print("the blocked batch arrived", flush=True)


def shortage():
    mpcore._core.connect()          # the keeper starts now, outside the cgroup
    print("READY", os.getpid(), flush=True)
    if sys.stdin.readline().strip() != "GO":
        sys.exit(5)
    loader = DataLoader(Huge(), batch_size=4, num_workers=1)
    it = iter(loader)
    pids = worker_pids(loader)
    outcome, err = "ok", None
    try:
        next(it)
    except BaseException as e:
        outcome, err = type(e).__name__, str(e)
    kids_after_error = kids()
    del it, loader
    gc.collect()
    report(cgroup=open("/proc/self/cgroup").read(), outcome=outcome, err=err, pids=pids,
           asked=4 * Huge.ELEMS * 4, kids_after_error=kids_after_error, kids_end=kids())


if __name__ == "__main__":
    {"segv": fatal, "exit3": fatal, "hang": fatal, "raise": raising, "keep": keep_all,
     "normal": normal, "persistent": persistent, "kill": kill_main, "sigkill": sigkill,
     "shortage": shortage}[MODE]()
'''


def no_workers_left(res, key, pids):
    """None of the loader's workers is still a child of the main process
    (running or zombie), and no other child is there either."""
    left = res[key]
    assert not left, f"{key}: children of the main process left behind: {left} (workers {pids})"


def death_reported(res, event, words, within):
    """The loader raised a RuntimeError naming the dead worker's pid and
    each of `words`, within `within` seconds of the death (a bound, not a
    benchmark), and left no worker behind."""
    ev = res[event]
    assert ev["pid"] in res["pids"], res
    assert res["kind"] == "RuntimeError", res
    msg = res["err"]
    assert f"pid {ev['pid']}" in msg, f"the message does not name the worker: {msg!r}"
    for w in words:
        assert w in msg, msg
    delay = res["t_raise"] - ev["t"]
    assert 0 <= delay < within, f"the error came {delay:.2f}s after the worker died"
    no_workers_left(res, "kids_after_error", res["pids"])
    no_workers_left(res, "kids_end", res["pids"])


# --------------------------------------------------------------------------
# 1-3. A worker that segfaults, exits, hangs
# --------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_worker_segfault_is_a_clear_error_at_once(leak_check, scenario, tmp_path):
    r = run(scenario, "segv", tmp_path)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert res["fault"]["index"] == 21, res
    # The death is noticed at once (the worker's pidfd wakes the wait), not
    # at some long timeout.
    death_reported(res, "fault", ["killed by signal", "Segmentation fault"], 2.0)
    assert res["got"] == list(range(len(res["got"]))) and len(res["got"]) <= 5, res["got"]
    scenario.check_clean()


@pytest.mark.timeout(60)
def test_worker_exit_code_is_a_clear_error(leak_check, scenario, tmp_path):
    r = run(scenario, "exit3", tmp_path)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    death_reported(res, "fault", ["exit code 3"], 2.0)
    scenario.check_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_sigkilled_while_main_waits_is_reported_within_a_second(
        leak_check, scenario, tmp_path, method):
    # The loader learns of the death from the worker's pidfd (NOTE [ Watching
    # workers ] in pool.c), not from a periodic look; spawn workers are the
    # zygote's children, not the main process's.
    r = run(scenario, "sigkill", tmp_path, method)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    death_reported(res, "killed", ["killed by signal", "Killed"], 1.0)
    assert res["got"] == list(range(len(res["got"]))) and len(res["got"]) <= 5, res["got"]
    scenario.check_clean()


@pytest.mark.timeout(60)
def test_worker_hang_times_out_and_del_ends_workers(leak_check, scenario, tmp_path):
    r = run(scenario, "hang", tmp_path)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    fault = res["fault"]
    assert fault["pid"] in res["pids"], res
    assert res["kind"] == "RuntimeError", res
    assert res["err"] == "DataLoader timed out after 1 seconds", res["err"]
    # timeout=1 bounds the wait for a batch: it is raised about a second
    # after the worker stopped producing, not much later.
    assert res["t_raise"] - fault["t"] < scaled(3.0), res
    # Torch's rule: a timeout leaves the iterator as it is; deleting it
    # ends the workers, the hung one included.
    no_workers_left(res, "kids_after_del", res["pids"])
    no_workers_left(res, "kids_end", res["pids"])
    scenario.check_clean()


# --------------------------------------------------------------------------
# 4. The main process SIGKILLed mid-epoch
# --------------------------------------------------------------------------

def _read_lines(fd, n, timeout):
    """n lines from a non-blocking fd, waiting on select within timeout."""
    deadline = time.monotonic() + scaled(timeout)
    buf = b""
    while buf.count(b"\n") < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            pytest.fail(f"only {len(buf.split())} of {n} workers blocked within "
                        f"{scaled(timeout):g}s")
        buf += os.read(fd, 4096)
    return [int(x) for x in buf.split()]


def _wait_exited(pids, timeout):
    """Waits on pidfds for every pid to exit; returns those still running."""
    deadline = time.monotonic() + scaled(timeout)
    left = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                left.append(pid)
        finally:
            os.close(fd)
    return left


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_main_killed_mid_epoch_workers_exit(leak_check, scenario, tmp_path, method):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    wfd = os.open(fifo, os.O_WRONLY)      # no EOF between the workers' writes
    p = popen(scenario, "kill", tmp_path, method)
    try:
        line = p.stdout.readline()
        assert line.startswith("ITERATING "), (
            line, p.stderr.read() if p.poll() is not None else "")
        info = json.loads(line[len("ITERATING "):])
        assert info["got"] == [0, 1, 2], info
        workers = info["pids"]
        # Every worker is inside __getitem__, blocked, and the main process
        # waits in next(): the middle of an epoch.
        blocked = _read_lines(rfd, len(workers), 30)
        assert sorted(blocked) == sorted(workers), (blocked, workers)
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(scaled(30)) == -signal.SIGKILL
        left = _wait_exited(workers, 5.0)
        assert not left, (f"workers still running {scaled(5.0):g}s after the main process was "
                          f"killed: "
                          f"{scenario.describe(left)}")
    finally:
        os.close(rfd)
        os.close(wfd)
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()
        p.stdin.close()
    scenario.check_clean()


# --------------------------------------------------------------------------
# 5. Every batch kept
# --------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_every_batch_kept_is_correct_and_released(leak_check, scenario, tmp_path):
    r = run(scenario, "keep", tmp_path, timeout=80)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert res["n"] == 400 and res["n"] > 10 * res["slots"], res["n"]
    assert res["bad_during"] == [], f"batches wrong as received: {res['bad_during'][:20]}"
    assert res["shared"], "the batches are not in shared memory"
    assert res["bad_after"] == [], (
        f"batches wrong once the loader is gone: {res['bad_after'][:20]}")
    no_workers_left(res, "kids_after_epoch", res["pids"])
    # 10 batches of 4 MB and 390 of 16 KB were held...
    assert res["held"]["mapped_bytes"] >= 40 << 20, res["held"]
    # ... and once they are dropped, none of that memory is held any more:
    # not by the keeper for the workers that made it, nor by the main
    # process's mappings of segments nobody else holds.
    after = res["after"]
    assert after["keeper_only"] == 0, after
    no_workers_left(res, "kids_end", res["pids"])
    scenario.check_clean()
    assert after["retired_mapped"] == 0, (
        f"the main process still maps {after['retired_mapped']} segments (holding "
        f"{after['retired_bytes']} bytes of memory) that the keeper has retired, after every "
        f"batch was dropped: {after}")


# --------------------------------------------------------------------------
# 6. A shared-memory shortage in a worker: a memory cgroup too small
# --------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_shared_memory_shortage_in_worker_is_a_memory_error(leak_check, scenario, tmp_path):
    limit = 64 << 20
    cg = make_memcg(limit)
    p = None
    try:
        p = popen(scenario, "shortage", tmp_path)
        ready = p.stdout.readline().split()
        assert ready[:1] == ["READY"], (ready, p.stderr.read() if p.poll() is not None else "")
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(p.pid))
        out, err = p.communicate("GO\n", timeout=scaled(45))
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        remove_memcg(cg)
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    res = result(r)
    assert p.returncode == 0, err[-3000:]
    assert os.path.basename(cg) in res["cgroup"], "the program did not move into the cgroup"
    msg, asked = res["err"], res["asked"]
    assert res["outcome"] == "MemoryError", res
    assert "DataLoader worker process 0" in msg, msg
    assert any(asked <= a <= asked + (1 << 20) for a in memory_amounts(msg)), (
        f"the message does not name the {asked} bytes needed: {msg!r}")
    assert "available" in msg and any(a < limit for a in memory_amounts(msg)), msg
    no_workers_left(res, "kids_end", res["pids"])
    scenario.check_clean()


# --------------------------------------------------------------------------
# 7. An exception in __getitem__, and iteration goes on
# --------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_getitem_exception_reraised_then_iteration_continues(leak_check, scenario, tmp_path):
    r = run(scenario, "raise", tmp_path)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(res["errors"]) == 1, res["errors"]
    msg = res["errors"][0]
    assert "Caught ValueError in DataLoader worker process 1" in msg, msg
    assert "Traceback (most recent call last)" in msg and "__getitem__" in msg, msg
    assert "sample 21 is broken on purpose" in msg, msg
    assert res["got"] == [j for j in range(16) if j != 5], res["got"]
    assert res["bad"] == [], res["bad"]
    no_workers_left(res, "kids_after_epoch", res["pids"])
    no_workers_left(res, "kids_end", res["pids"])
    scenario.check_clean()


# --------------------------------------------------------------------------
# Normal completion, persistent workers
# --------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_normal_completion_and_del_leave_nothing(leak_check, scenario, tmp_path):
    r = run(scenario, "normal", tmp_path)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    for e in res["epochs"]:
        assert e["got"] == list(range(16)) and e["bad"] == [], e
        # An epoch's end ends its workers (torch's rule without
        # persistent_workers): none is left, running or zombie.
        assert not e["kids"], f"workers left after the epoch: {e}"
    assert set(res["epochs"][0]["pids"]).isdisjoint(res["epochs"][1]["pids"]), res["epochs"]
    no_workers_left(res, "kids_after_del", [])
    after = res["after"]
    assert after["keeper_only"] == 0, after
    scenario.check_clean()
    assert after["retired_mapped"] == 0, (
        f"the main process still maps {after['retired_mapped']} retired segments (holding "
        f"{after['retired_bytes']} bytes) after the loader and its batches are gone: {after}")


@pytest.mark.timeout(60)
def test_persistent_workers_end_at_del(leak_check, scenario, tmp_path):
    r = run(scenario, "persistent", tmp_path)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = res["epochs"]
    for e in (first, second):
        assert e["got"] == list(range(16)) and e["bad"] == [], e
    # The same workers serve both epochs and are alive between them.
    assert first["pids"] == second["pids"], res["epochs"]
    for e in (first, second):
        assert sorted(p for p, _ in e["kids"]) == sorted(e["pids"]), e
        assert all(s not in ("Z", "X") for _, s in e["kids"]), e
    assert not res["kids_after_del"], (
        f"persistent workers still there right after `del loader`: {res['kids_after_del']}")
    no_workers_left(res, "kids_end", first["pids"])
    after = res["after"]
    assert after["keeper_only"] == 0, after
    scenario.check_clean()
    assert after["retired_mapped"] == 0, (
        f"the main process still maps {after['retired_mapped']} retired segments (holding "
        f"{after['retired_bytes']} bytes) after `del loader`: {after}")
