"""Shared memory under faults: a low fd limit, a memory cgroup too small for
the request, processes killed mid-transfer, a sender that exits at once, the
keeper's exit with its program, and the mappings of producers that are done.

Each scenario runs as a fresh program (helpers.run_program) tagged through
its environment, with the test process as the subreaper of its tree, so that
every process of the program, keeper included, is waited for and reaped
here.  Afterwards: none of them runs, none holds an mpcore memfd, no keeper
of the program runs, and /dev/shm gained nothing.  Processes synchronise on
events, pipes and queues; the only waiting loops poll for processes to exit.

The programs keep torch single-threaded: they fork after torch has
computed, and torch's thread pool does not survive fork.
"""
import re
import signal

import pytest

from helpers import TESTS_ON_PATH, exited, memory_amounts, program_result as result, run_in_memcg

# --------------------------------------------------------------------------
# 1. Ten thousand tensors held under RLIMIT_NOFILE = 128
# --------------------------------------------------------------------------

FDS_PROGRAM = r'''
import json, os, resource, sys
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
import torch
torch.set_num_threads(1)
import mpcore

N = int(sys.argv[1])


def nfds(pid="self"):
    return len(os.listdir(f"/proc/{pid}/fd"))


def size(i):
    return 1 + (i % 7) * 37   # 4 .. 892 bytes: three size classes


def producer(q, done, n):
    held = []
    for i in range(n):
        t = torch.full((size(i),), float(i))
        q.put(t)
        held.append(t)        # the sender keeps its tensors too
    q.put(("producer", nfds(), resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
    done.wait(120 * SLOW)


if __name__ == "__main__":
    ctx = mpcore.get_context("fork")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=producer, args=(q, done, N))
    p.start()
    got, max_fds = [], nfds()
    for i in range(N):
        got.append(q.get(timeout=60 * SLOW))
        if i % 100 == 0:
            max_fds = max(max_fds, nfds())
    prod = q.get(timeout=60 * SLOW)
    max_fds = max(max_fds, nfds())
    bad = [i for i, t in enumerate(got)
           if tuple(t.shape) != (size(i),) or not bool((t == float(i)).all())]
    res = {"max_fds": max_fds, "fds_holding": nfds(), "producer": prod, "nbad": len(bad),
           "bad": bad[:10], "distinct": len({t.untyped_storage().data_ptr() for t in got}),
           "shared": all(t.is_shared() for t in got),
           "limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
           "keeper_fds": nfds(mpcore._core.keeper_pid())}
    done.set()
    p.join(60 * SLOW)
    res["exitcode"] = p.exitcode
    print("RESULT " + json.dumps(res), flush=True)
'''


@pytest.mark.timeout(240)
def test_ten_thousand_tensors_under_fd_limit_128(leak_check, scenario):
    n = 10_000
    r = scenario.run(FDS_PROGRAM, str(n), timeout=200)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert res["limit"] == 128
    assert res["exitcode"] == 0
    assert res["nbad"] == 0, f"{res['nbad']} tensors arrived wrong, e.g. {res['bad']}"
    assert res["distinct"] == n, "the tensors received do not have distinct storages"
    assert res["shared"]
    # Holding 10,000 shared tensors costs a handful of fds, not one each.
    assert res["max_fds"] < 64 and res["fds_holding"] < 64, res
    assert res["producer"][1] < 64, res
    assert res["keeper_fds"] < 64, res
    scenario.check_clean()


# --------------------------------------------------------------------------
# 2. A real shared-memory shortage: a 64 MB memory cgroup, 128 MB asked for
# --------------------------------------------------------------------------

CGROUP_CHILD = r'''
import json, os, sys
import torch
torch.set_num_threads(1)
import mpcore

mpcore._core.connect()          # the keeper starts now, outside the cgroup
print("READY", os.getpid(), flush=True)
if sys.stdin.readline().strip() != "GO":
    sys.exit(5)
res = {"cgroup": open("/proc/self/cgroup").read(),
       "available": list(mpcore._core.mem_available())}


def attempt(name, fn, nbytes):
    try:
        fn()
        res[name] = {"outcome": "ok", "nbytes": nbytes}
    except MemoryError as e:
        res[name] = {"outcome": "MemoryError", "msg": str(e), "nbytes": nbytes}
    except BaseException as e:
        res[name] = {"outcome": type(e).__name__, "msg": str(e), "nbytes": nbytes}


attempt("numpy", lambda: mpcore.empty((128 << 20,), "uint8"), 128 << 20)
attempt("torch", lambda: torch.empty(32 << 20).share_memory_(), 128 << 20)
# A shortage is no lasting state: what fits is still served.
attempt("small_after", lambda: int(mpcore.zeros((4 << 20,), "uint8").sum()), 4 << 20)
print("RESULT " + json.dumps(res), flush=True)
'''

@pytest.mark.timeout(180)
def test_memory_cgroup_shortage_is_a_memory_error(leak_check, scenario):
    limit = 64 << 20
    res, cg = run_in_memcg(scenario, CGROUP_CHILD, limit)
    assert cg in res["cgroup"]
    for name in ("numpy", "torch"):
        r = res[name]
        assert r["outcome"] == "MemoryError", f"{name}: {r}"
        msg, asked = r["msg"], r["nbytes"]
        amounts = memory_amounts(msg)
        # The size asked for (up to a page of bookkeeping) ...
        assert any(asked <= a <= asked + (1 << 20) for a in amounts), (
            f"{name}: the message does not name the {asked} bytes asked for: {msg!r}")
        # ... and what was available, which is under the cgroup's limit.
        assert "available" in msg.lower(), f"{name}: {msg!r}"
        assert any(a < limit for a in amounts), (
            f"{name}: the message does not name the amount available: {msg!r}")
    assert res["small_after"]["outcome"] == "ok", res["small_after"]
    scenario.check_clean()


LIMIT_CHANGED_CHILD = r'''
import json, os, sys
import mpcore

keep = mpcore.zeros((1 << 16,), "uint8")   # a reservation: the core reads what is available
print("READY", os.getpid(), flush=True)
if sys.stdin.readline().strip() != "GO":
    sys.exit(5)
res = {"cgroup": open("/proc/self/cgroup").read()}
try:
    mpcore.empty((48 << 20,), "uint8")
    res["big"] = {"outcome": "ok"}
except MemoryError as e:
    res["big"] = {"outcome": "MemoryError", "msg": str(e)}
print("RESULT " + json.dumps(res), flush=True)
'''


@pytest.mark.timeout(120)
def test_a_limit_lowered_just_after_a_reservation_is_seen(leak_check, scenario):
    """The process moves into a 32 MB memory cgroup right after a
    reservation, then asks for 48 MB at once: a MemoryError naming the
    cgroup, not a kill for a reservation checked against the reading taken
    before the move (NOTE in shm.c, MPC_AVAIL_CACHED_MAX)."""
    res, cg = run_in_memcg(scenario, LIMIT_CHANGED_CHILD, 32 << 20)
    assert cg in res["cgroup"]
    big = res["big"]
    assert big["outcome"] == "MemoryError", big
    assert "memory cgroup" in big["msg"] and "available" in big["msg"], big
    scenario.check_clean()


# --------------------------------------------------------------------------
# 3. Producer and consumer SIGKILLed mid-transfer
# --------------------------------------------------------------------------

KILL_PROGRAM = TESTS_ON_PATH + r'''
import gc, json, os, signal, sys
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
import torch
torch.set_num_threads(1)
import mpcore

ROUNDS, CHECK_KEEPER, HOW = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
N = (1 << 20) // 4              # 1 MB of float32


def die():
    os.kill(os.getpid(), signal.SIGKILL)


class DieOnUnpickle:
    """Kills the process that unpickles it: a message (DieOnUnpickle(), t)
    kills its consumer after the message left the queue, before t's ticket
    is redeemed."""
    def __reduce__(self):
        return (die, ())


class DieOnPickle:
    """Kills the process that pickles it: put((t, DieOnPickle())) kills the
    producer after t's ticket was taken, before the message is in the queue."""
    def __reduce__(self):
        die()


def producer_in_message(q, progress):
    q.put(torch.full((N,), 0.0))
    q.put((DieOnUnpickle(), torch.full((N,), 1.0)))
    progress.set()
    q.put((torch.full((N,), 2.0), DieOnPickle()))


def consumer_in_message(q, progress):
    t = q.get()
    progress.set()
    q.get()


def producer(q, progress):
    i = 0
    while True:
        q.put(torch.full((N,), float(i)))
        i += 1
        if i == 8:
            progress.set()


def consumer(q, progress):
    held, n = [], 0
    while True:
        t = q.get()
        if float(t[0]) != n or float(t[-1]) != n:
            os._exit(7)
        held = (held + [t])[-4:]   # it dies holding some
        n += 1
        if n == 8:
            progress.set()


from helpers import memfd_inodes  # noqa: E402


def kill_in_a_system_call(pid):
    """SIGKILLs our child pid at a point where it is blocked in a system
    call: stopped, it is killed if /proc says it is in one, else let go on
    and stopped again.  Those points are where a loop of puts and gets
    waits (for room, a message, the keeper, the kernel); a kill between two
    steps of the core's few-instruction windows, none of which makes a
    system call, leaks one block until the program ends (NOTE [ Journal ]
    in journal.c).  Returns the system call's number, or a string saying
    how pid ended by itself first."""
    while True:
        os.kill(pid, signal.SIGSTOP)
        status = os.waitpid(pid, os.WUNTRACED)[1]
        if not os.WIFSTOPPED(status):
            return f"ended first: wait status {status}"
        with open(f"/proc/{pid}/syscall") as f:
            nr = f.read().split()[0]
        if nr.isdigit():
            os.kill(pid, signal.SIGKILL)
            return int(nr)
        os.kill(pid, signal.SIGCONT)


def settle():
    """Two round trips to the keeper: it serves every ready client in one
    poll pass, so once the second is answered it has handled each death
    that happened before the first was sent."""
    for _ in range(2):
        try:
            mpcore._core.attach((0x5EED0001, 0, 1))   # asks the keeper for an unknown segment
        except mpcore.HandleError:
            pass


if __name__ == "__main__":
    ctx = mpcore.get_context("fork")
    mpcore._core.connect()
    keeper = mpcore._core.keeper_pid()
    base = len(memfd_inodes(keeper))
    report = {"keeper": keeper, "base": base, "rounds": []}
    for rnd in range(ROUNDS):
        q = ctx.Queue(maxsize=4)
        pe, ce = ctx.Event(), ctx.Event()
        if HOW == "in-message":
            prod = ctx.Process(target=producer_in_message, args=(q, pe), daemon=True)
            cons = ctx.Process(target=consumer_in_message, args=(q, ce), daemon=True)
        else:
            prod = ctx.Process(target=producer, args=(q, pe), daemon=True)
            cons = ctx.Process(target=consumer, args=(q, ce), daemon=True)
        prod.start()
        cons.start()
        progressed = pe.wait(60 * SLOW) and ce.wait(60 * SLOW)
        killed_in = None
        if HOW != "in-message":       # those two kill themselves
            killed_in = [kill_in_a_system_call(prod.pid), kill_in_a_system_call(cons.pid)]
        prod.join(60 * SLOW)
        cons.join(60 * SLOW)
        report["rounds"].append({"progressed": progressed, "killed_in": killed_in,
                                 "exitcodes": [prod.exitcode, cons.exitcode],
                                 "keeper_during": len(memfd_inodes(keeper))})
        settle()
        del q, pe, ce, prod, cons
        gc.collect()
    settle()
    if CHECK_KEEPER:
        kept = memfd_inodes(keeper)
        mine = memfd_inodes(os.getpid(), maps=True)
        report.update(keeper_after=len(kept), own=len(mine), not_ours=len(set(kept) - set(mine)),
                      stats=mpcore.stats())
    print("RESULT " + json.dumps(report), flush=True)
'''


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rounds,check_keeper,how", [
    (1, False, "random"), (3, True, "random"), (1, True, "in-message")],
    ids=["program-exits", "keeper-drops-dead-holds", "killed-inside-a-message"])
def test_killed_mid_transfer_leaves_nothing_held(leak_check, scenario, rounds, check_keeper,
                                                 how):
    """Producer and consumer die mid-transfer: killed by the parent at a
    random point of their loops where each is in a system call, or ("killed-inside-a-message") each killed
    at the worst point: the consumer after taking a message out of the queue
    but before redeeming its tensor's ticket, the producer after taking a
    ticket for its tensor but before the message is in the queue.  After the
    queue is dropped, nothing of theirs may stay held."""
    r = scenario.run(KILL_PROGRAM, str(rounds), "1" if check_keeper else "0", how,
                     timeout=200)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    for rnd in res["rounds"]:
        assert rnd["progressed"], f"no transfer progress before the kill: {res}"
        assert rnd["exitcodes"] == [-signal.SIGKILL] * 2, res
    if check_keeper:
        # The queue and all tensors are dropped and both peers are dead: the
        # keeper holds no segment but those the live program itself maps.
        assert res["not_ours"] == 0, (
            f"the keeper still holds {res['not_ours']} segments of the dead processes "
            f"({res['keeper_after']} memfds, {res['own']} mapped by the program; "
            f"{res['base']} before): {res}")
        assert res["keeper_after"] <= max(res["base"], res["own"]), res
    scenario.check_clean()


# --------------------------------------------------------------------------
# 4. A sender that exits right after put()
# --------------------------------------------------------------------------

SENDER_PROGRAM = r'''
import json, sys
import numpy as np
import torch
import os
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
torch.set_num_threads(1)
import mpcore


def sender(q):
    q.put({"big": torch.arange(2 << 20, dtype=torch.float64) * 3 + 1,      # 16 MB
           "small": torch.tensor([1.5, 2.5, 3.5]),
           "view": torch.arange(1000.0)[10:20],
           "array": np.arange(100_000, dtype=np.int64) * 7})               # 800 KB
    # returns at once: the process exits with its message in the queue


if __name__ == "__main__":
    ctx = mpcore.get_context(sys.argv[1])
    q = ctx.Queue()
    p = ctx.Process(target=sender, args=(q,))
    p.start()
    p.join(120 * SLOW)
    res = {"sender_exitcode": p.exitcode}
    m = q.get(timeout=60 * SLOW)                 # the sender is gone by now
    res["big"] = bool(torch.equal(m["big"], torch.arange(2 << 20, dtype=torch.float64) * 3 + 1))
    res["small"] = m["small"].tolist()
    res["view"] = m["view"].tolist()
    res["view_offset"] = m["view"].storage_offset()
    res["array"] = bool((m["array"] == np.arange(100_000, dtype=np.int64) * 7).all())
    res["shared"] = [m["big"].is_shared(), m["small"].is_shared(), m["view"].is_shared()]
    m["big"].add_(1)                       # the memory is alive and writable
    res["written"] = float(m["big"][5]) == 17.0
    print("RESULT " + json.dumps(res), flush=True)
'''


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sender_exits_right_after_put(leak_check, scenario, method):
    r = scenario.run(SENDER_PROGRAM, method, timeout=150)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert res["sender_exitcode"] == 0
    assert res["big"] and res["array"], res
    assert res["small"] == [1.5, 2.5, 3.5]
    assert res["view"] == [float(i) for i in range(10, 20)] and res["view_offset"] == 10
    assert all(res["shared"]) and res["written"], res
    scenario.check_clean()


# --------------------------------------------------------------------------
# 5. The keeper exits with its program
# --------------------------------------------------------------------------

KEEPER_PROGRAM = r'''
import json, os, signal, sys
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
import torch
torch.set_num_threads(1)
import mpcore


def child(q, out):
    t = q.get(timeout=60 * SLOW)
    out.put(float(t.sum()))


if __name__ == "__main__":
    how = sys.argv[1]
    ctx = mpcore.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    t = torch.ones(1000).share_memory_()
    if how == "sigkill":
        ready_r, ready_w = os.pipe()
        life_r, life_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(life_w)
            del t
            held = q.get(timeout=60 * SLOW)
            os.write(ready_w, b"x")
            os.read(life_r, 1)         # EOF: the main process was killed
            ok = float(held.sum()) == 1000.0 and held.is_shared()
            held.add_(1)               # its memory is alive after its owner died
            ok = ok and float(held.sum()) == 2000.0
            print("CHILD " + json.dumps({"ok": ok}), flush=True)
            os._exit(0)
        os.close(ready_w)
        os.close(life_r)
        q.put(t)
        assert os.read(ready_r, 1) == b"x"
        print("KEEPER %d CHILD %d" % (mpcore._core.keeper_pid(), pid), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    p = ctx.Process(target=child, args=(q, out))
    p.start()
    q.put(t)
    assert out.get(timeout=60 * SLOW) == 1000.0
    p.join(60 * SLOW)
    assert p.exitcode == 0
    keep = [t, mpcore.empty((1 << 20,), "uint8"), mpcore.empty((10,), torch.int64)]
    print("KEEPER %d" % mpcore._core.keeper_pid(), flush=True)
    if how == "exception":
        raise RuntimeError("the program fails on purpose, holding shared memory")
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["normal", "exception", "sigkill"])
def test_keeper_exits_with_program(leak_check, scenario, how):
    r = scenario.run(KEEPER_PROGRAM, how, timeout=120)
    m = re.search(r"^KEEPER (\d+)", r.stdout, re.M)
    assert m, f"rc {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    keeper = int(m.group(1))
    assert keeper > 0
    if how == "normal":
        assert r.returncode == 0, r.stderr[-3000:]
    elif how == "exception":
        assert r.returncode == 1 and "fails on purpose" in r.stderr, r.stderr[-3000:]
    else:
        assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-3000:])
        child = result(r, "CHILD ")
        assert child["ok"], "the child lost its tensor when the main process was killed"
    scenario.check_clean()
    assert exited(keeper), f"keeper {keeper} is still running"



# --------------------------------------------------------------------------
# 6. A finished producer's memory is not kept mapped
# --------------------------------------------------------------------------

FORGET_PROGRAM = TESTS_ON_PATH + r'''
import gc, json, os
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
import torch
torch.set_num_threads(1)
import mpcore
from helpers import memfd_inodes


def producer(q, more):
    q.put(torch.full((1 << 18,), 1.0))     # 1 MB: a segment of its own
    more.wait(60 * SLOW)
    q.put(torch.full((1 << 18,), 2.0))


if __name__ == "__main__":
    ctx = mpcore.get_context("fork")
    q, more = ctx.Queue(), ctx.Event()
    mpcore._core.connect()
    before = set(memfd_inodes(os.getpid(), maps=True))
    p = ctx.Process(target=producer, args=(q, more))
    p.start()
    t = q.get(timeout=60 * SLOW)
    theirs = set(memfd_inodes(os.getpid(), maps=True)) - before
    # The producer lives on, so the keeper never calls its segment orphan:
    # only forget_idle's mark can drop the mapping when the hold goes.
    mpcore._core.forget_idle()
    held = sorted(theirs & set(memfd_inodes(os.getpid(), maps=True)))
    value = float(t[7])
    del t
    gc.collect()
    after_release = sorted(theirs & set(memfd_inodes(os.getpid(), maps=True)))
    more.set()
    t2 = q.get(timeout=60 * SLOW)                 # a live producer still reaches us
    res = {"theirs": len(theirs), "held": len(held), "after_release": after_release,
           "values": [value, float(t2[7])], "alive": p.is_alive()}
    del t2
    p.join(60 * SLOW)
    res["exitcode"] = p.exitcode
    print("RESULT " + json.dumps(res), flush=True)
'''


@pytest.mark.timeout(120)
def test_a_mapping_held_at_forget_idle_goes_with_its_last_hold(leak_check, scenario):
    # A DataLoader's end calls forget_idle once its workers are reaped, but
    # the keeper learns of their deaths a moment later: a batch released in
    # that moment found its segment not yet orphan, and the mapping (the
    # worker's memory) stayed (NOTE [ Mappings of orphans ] in arena.c).
    r = scenario.run(FORGET_PROGRAM, timeout=100)
    res = result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert res["theirs"] >= 1 and res["held"] == res["theirs"], res
    assert res["after_release"] == [], (
        f"the producer's segment is still mapped after its last hold went: {res}")
    assert res["values"] == [1.0, 2.0] and res["exitcode"] == 0, res
    scenario.check_clean()
