"""Messages of any size: through every ring (a payload too large for the
ring travels in a shared-memory block of its own, NOTE [ Ring ] in ring.c),
through the DataLoader's index and result rings, through every kind of
queue, and through the zygote (NOTE [ Zygote payloads ] in proc.c); and the
zygote's wire format, defined once in C.

Leaks are counted in the segments themselves: every segment's header says
how many of its blocks are live, and the keeper holds every segment, so
the sum over the keeper's memfds is the program's live blocks."""
import gc
import os
import signal
import struct

import pytest

import mpcore
from mpcore import _core
from mpcore.proc import _client
from helpers import (memory_amounts, module_path, program_result, reap, run_in_memcg,
                     run_scenario, scaled)

# Where a program finds this module and the helpers (os.pathsep between).
MODULE_PATH = os.pathsep.join(module_path(__name__))
MODULE = __name__

_SEG_MAGIC = 0x47455345524F4350  # MPC_SEG_MAGIC
_SEG_LIVE = 60                   # offsetof(mpc_seg_header, live)


def keeper_live_blocks(keeper=None):
    """Live blocks of this program, summed over the headers of the segments
    its keeper holds."""
    keeper = keeper or _core.keeper_pid()
    assert keeper, "this process has no keeper"
    live = 0
    for fd in os.listdir(f"/proc/{keeper}/fd"):
        path = f"/proc/{keeper}/fd/{fd}"
        try:
            if not os.readlink(path).startswith("/memfd:mpcore"):
                continue
            with open(path, "rb") as f:
                head = f.read(64)
        except OSError:
            continue
        if len(head) == 64 and struct.unpack_from("<Q", head, 0)[0] == _SEG_MAGIC:
            live += struct.unpack_from("<I", head, _SEG_LIVE)[0]
    return live


def settle():
    """Two round trips to the keeper, so that it has handled every death
    that happened before (it serves all ready clients in one pass)."""
    for _ in range(2):
        try:
            _core.attach((0x5EED0001, 0, 1))  # an unknown segment: the keeper answers
        except mpcore.HandleError:
            pass


# --- the ring itself -------------------------------------------------------

def _ring(capacity, maxitems=0):
    block = mpcore.shm._blocks.alloc(_core.ring_footprint(capacity), zero=True,
                              kind=mpcore.shm._blocks.BLOCK_QUEUE)
    return block, _core.Ring(block, 0, None, True, maxitems)


def test_ring_takes_payloads_of_any_size_and_frees_their_blocks():
    _core.connect()
    block, r = _ring(4096)
    room = r.max_message()
    base = keeper_live_blocks()
    payloads = [b"", b"x" * room, b"y" * (room + 1), os.urandom(1 << 20), os.urandom(10 << 20),
                bytearray(os.urandom(600_000))]
    for p in payloads:
        r.put([], p)
        refs, got = r.get(True, scaled(30))
        assert refs == [] and bytes(got) == p
        # Inline payloads come as bytes, larger ones as the Block they
        # travelled in, exactly their length, freed with the object.
        assert type(got) is bytes if len(p) <= room else type(got) is not bytes
        assert len(memoryview(got)) == len(p)
        del got
    assert keeper_live_blocks() == base
    # Several spilled messages queued at once, with inline ones between.
    r.put([], payloads[3])
    r.put([], b"small")
    r.put([], payloads[4], task=True)
    assert r.count() == 3
    assert keeper_live_blocks() == base + 2  # the two spilled payloads
    got = [bytes(r.get(True, scaled(30))[1]) for _ in range(3)]
    assert got == [payloads[3], b"small", payloads[4]]
    r.task_done()
    assert r.join(scaled(5)) is True
    assert keeper_live_blocks() == base


@pytest.mark.parametrize("n", [(4 << 20) - 1, 4 << 20, (4 << 20) + 129, (32 << 20) + 4099])
def test_large_payloads_arrive_exactly_from_any_alignment(n):
    # From 4 MB a copy goes around the cache, and from 32 MB two threads share
    # it (NOTE [ Large copies go around the cache ] in csrc/util.c): every
    # byte arrives, whatever the source's alignment and the length's tail.
    _core.connect()
    block, r = _ring(4096)
    base = keeper_live_blocks()
    src = bytearray(os.urandom(n + 127))
    for off in (0, 1, 63, 127):
        want = memoryview(src)[off:off + n]
        r.put([], want)
        refs, got = r.get(True, scaled(30))
        assert refs == [] and len(memoryview(got)) == n
        assert memoryview(got).cast("B") == want, f"offset {off}: the bytes differ"
        del got
    assert keeper_live_blocks() == base


def test_spilled_message_keeps_its_refs():
    _core.connect()
    _, r = _ring(4096)
    base = keeper_live_blocks()
    data = mpcore.shm._blocks.alloc(64)
    memoryview(data)[:4] = b"abcd"
    refs = [data.ticket(True) for _ in range(3)]
    payload = os.urandom(100_000)
    r.put(refs, payload)
    got_refs, got = r.get(True, scaled(30))
    assert bytes(got) == payload and [tuple(x) for x in got_refs] == [tuple(x) for x in refs]
    del got
    for ref in got_refs:  # redeem them: the same block, held once
        assert bytes(memoryview(_core.attach(ref))[:4]) == b"abcd"
    del data
    gc.collect()
    assert keeper_live_blocks() == base


def test_draining_a_ring_drops_spilled_payloads():
    _core.connect()
    _, r = _ring(4096)
    base = keeper_live_blocks()
    r.put([], os.urandom(1 << 20))
    r.put([], os.urandom(50_000))
    assert keeper_live_blocks() == base + 2
    left = r.drain()
    assert len(left) == 2  # the ticket of each spilled payload's block
    assert keeper_live_blocks() == base + 2
    for ref in left:
        _core.drop_ticket(ref)
    assert keeper_live_blocks() == base


def test_freeing_a_queue_frees_its_spilled_messages():
    _core.connect()
    base = keeper_live_blocks()
    q = mpcore.Queue(capacity=4096)
    q.put(os.urandom(1 << 20))
    q.put(os.urandom(3 << 20))
    assert keeper_live_blocks() == base + 3  # the queue and two payloads
    del q
    gc.collect()
    assert keeper_live_blocks() == base


def test_a_failed_put_leaves_no_block():
    _core.connect()
    _, r = _ring(4096, maxitems=1)
    base = keeper_live_blocks()
    r.put([], b"first")
    with pytest.raises(mpcore.Full):
        r.put([], os.urandom(1 << 20), False)
    with pytest.raises(mpcore.Full):
        r.put([], os.urandom(1 << 20), True, 0.05)
    assert keeper_live_blocks() == base
    r.close()
    with pytest.raises(ValueError, match="closed"):
        r.put([], os.urandom(1 << 20))
    assert keeper_live_blocks() == base
    assert r.get(True, scaled(5)) == ([], b"first")


def test_refs_that_can_never_fit_are_refused_clearly():
    _core.connect()
    _, r = _ring(1024)
    data = mpcore.shm._blocks.alloc(64)
    base = keeper_live_blocks()
    refs = [(1, 1, 1)] * 100  # 1600 bytes of refs: never in a 1 KiB ring
    with pytest.raises(ValueError, match=r"100 refs .* can never fit"):
        r.put(refs, b"")
    with pytest.raises(ValueError, match=r"100 refs .* can never fit"):
        r.put(refs, os.urandom(1 << 20))
    assert keeper_live_blocks() == base
    del data


# --- the DataLoader ----------------------------------------------------------

def _torch_batches(n, batch_size):
    import torch.utils.data as tud
    return list(tud.DataLoader(range(n), batch_size=batch_size, num_workers=0))


def _check_loader(n, batch_size, workers, ctx=None):
    import torch
    from mpcore.data import DataLoader
    want = _torch_batches(n, batch_size)
    got = list(DataLoader(range(n), batch_size=batch_size, num_workers=workers,
                          multiprocessing_context=ctx))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch_size,n", [(10 ** 5, 3 * 10 ** 5 + 7), (10 ** 6, 2 * 10 ** 6 + 3)])
@pytest.mark.parametrize("workers", [1, 2])
def test_dataloader_batches_larger_than_its_rings(batch_size, n, workers, leak_check):
    _core.connect()
    base = keeper_live_blocks()
    _check_loader(n, batch_size, workers)
    gc.collect()
    settle()
    assert keeper_live_blocks() == base


def scenario_loader_spawn(method):
    _check_loader(2 * 10 ** 5 + 1, 10 ** 5, 2, ctx=method)


@pytest.mark.timeout(300)
def test_dataloader_large_batches_under_spawn(scenario_runner):
    run_scenario(MODULE, "scenario_loader_spawn", "spawn", timeout=240, runner=scenario_runner)


# --- queues across processes -------------------------------------------------

def _messages():
    import numpy as np
    rng = np.random.default_rng(5)
    return [os.urandom(10 << 20),
            rng.integers(0, 1 << 40, size=(10 << 20) // 8, dtype=np.int64),
            list(range(300_000)),
            "small"]


def _echo(q_in, q_out, n, joinable):
    for _ in range(n):
        m = q_in.get()
        q_out.put(m)
        if joinable:
            q_in.task_done()


def _same(a, b):
    import numpy as np
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def scenario_queues(method):
    ctx = mpcore.get_context(method)
    _core.connect()
    base = keeper_live_blocks()
    msgs = _messages()
    kinds = [("Queue", lambda: ctx.Queue()), ("bounded Queue", lambda: ctx.Queue(maxsize=2)),
             ("SimpleQueue", lambda: ctx.SimpleQueue()),
             ("JoinableQueue", lambda: ctx.JoinableQueue())]
    for name, make in kinds:
        q_in, q_out = make(), make()
        joinable = name == "JoinableQueue"
        p = ctx.Process(target=_echo, args=(q_in, q_out, len(msgs), joinable))
        try:
            p.start()
            for m in msgs:
                q_in.put(m)
            back = [q_out.get() for _ in msgs]
            if joinable:
                q_in.join()
            p.join(scaled(60))
            assert p.exitcode == 0, (name, p.exitcode)
        finally:
            reap([p])
        for m, b in zip(msgs, back):
            assert _same(m, b), f"{name}: a {type(m).__name__} came back different"
        del q_in, q_out, back
        gc.collect()
        settle()
        assert keeper_live_blocks() == base, f"{name}: blocks left live"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_queue_messages_larger_than_the_ring_cross_processes(method, leak_check,
                                                            scenario_runner):
    run_scenario(MODULE, "scenario_queues", method, timeout=240, runner=scenario_runner)


# --- deaths around a spilled message ---------------------------------------

DEATH_PROGRAM = r'''
import gc, json, os, signal, sys, time
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
sys.path[:0] = sys.argv[2].split(os.pathsep)
import mpcore
from test_large_messages import keeper_live_blocks, settle

BIG = 64 << 20


def receiver(q, started):
    started.set()
    q.get()          # killed before, during or after copying the payload out
    time.sleep(60)


def sender(q, started):
    payload = os.urandom(BIG)
    started.set()
    while True:      # killed before, during or after spilling
        q._ring.put([], payload)


if __name__ == "__main__":
    how = sys.argv[1]
    ctx = mpcore.get_context("fork")
    mpcore._core.connect()
    base = keeper_live_blocks()
    rounds = []
    for rnd in range(4):
        q = ctx.Queue(maxsize=1)
        started = ctx.Event()
        if how == "receiver":
            q.put(os.urandom(BIG))          # spilled, then the receiver dies around its get
            p = ctx.Process(target=receiver, args=(q, started))
        else:
            p = ctx.Process(target=sender, args=(q, started))
        p.start()
        started.wait(60 * SLOW)
        time.sleep(0.01 * rnd)              # a different point of the transfer each round
        os.kill(p.pid, signal.SIGKILL)
        p.join(60 * SLOW)
        rounds.append(p.exitcode)
        settle()
        del q, p, started
        gc.collect()
        settle()
    print("RESULT " + json.dumps({"base": base, "after": keeper_live_blocks(),
                                  "exitcodes": rounds}), flush=True)
'''


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["receiver", "sender"])
def test_a_death_around_a_spilled_message_leaks_nothing(how, scenario, leak_check):
    r = scenario.run(DEATH_PROGRAM, how, MODULE_PATH, timeout=200)
    res = program_result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert res["exitcodes"] == [-signal.SIGKILL] * 4, res
    assert res["after"] == res["base"], f"blocks left live after the {how} died: {res}"
    scenario.check_clean()


# --- shared memory running out while spilling --------------------------------

SHORTAGE_CHILD = r'''
import json, os, sys
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
import mpcore

mpcore._core.connect()          # the keeper starts now, outside the cgroup
q = mpcore.Queue()
payload = b"z" * (128 << 20)    # made before this process joins the cgroup
print("READY", os.getpid(), flush=True)
if sys.stdin.readline().strip() != "GO":
    sys.exit(5)
res = {"cgroup": open("/proc/self/cgroup").read()}
try:
    q._ring.put([], payload)
    res["outcome"] = "ok"
except MemoryError as e:
    res["outcome"], res["msg"] = "MemoryError", str(e)
except BaseException as e:
    res["outcome"], res["msg"] = type(e).__name__, str(e)
res["count"] = q.qsize()
q.put("after")                  # a shortage is no lasting state
res["next"] = q.get(timeout=10 * SLOW)
print("RESULT " + json.dumps(res), flush=True)
'''


@pytest.mark.timeout(180)
def test_no_shared_memory_for_a_spill_is_a_memory_error(scenario, leak_check):
    limit = 64 << 20
    res, cg = run_in_memcg(scenario, SHORTAGE_CHILD, limit)
    assert cg in res["cgroup"]
    assert res["outcome"] == "MemoryError", res
    msg = res["msg"]
    assert any((128 << 20) <= a <= (129 << 20) for a in memory_amounts(msg)), msg
    assert "available" in msg.lower(), msg
    assert res["count"] == 0 and res["next"] == "after", res
    scenario.check_clean()


# --- the zygote --------------------------------------------------------------

ZYGOTE_PROGRAM = r'''
import hashlib, json, os, sys, warnings
SLOW = float(os.environ.get("TEST_TIME_SCALE", "1"))  # the tests' time scale
import mpcore


def child(data, q):
    from mpcore.proc import _child
    q.put({"len": len(data), "sha": hashlib.sha256(data).hexdigest(),
           "forked_by_zygote": _child.forked})


if __name__ == "__main__":
    warnings.simplefilter("error", RuntimeWarning)   # no fallback to exec
    data = os.urandom(1 << 20) * 270                  # 270 MiB: above the old 256 MiB cap
    ctx = mpcore.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(data, q))
    p.start()
    got = q.get(timeout=120 * SLOW)
    p.join(60 * SLOW)
    got.update(exitcode=p.exitcode, want_len=len(data),
               want_sha=hashlib.sha256(data).hexdigest())
    print("RESULT " + json.dumps(got), flush=True)
'''


@pytest.mark.timeout(300)
def test_spawn_argument_larger_than_256_mb(scenario, leak_check):
    r = scenario.run(ZYGOTE_PROGRAM, timeout=240)
    res = program_result(r)
    assert r.returncode == 0, r.stderr[-3000:]
    assert res["exitcode"] == 0, res
    assert res["forked_by_zygote"] is True, res
    assert res["len"] == res["want_len"] == 270 << 20, res
    assert res["sha"] == res["want_sha"], res
    scenario.check_clean()


def test_zygote_header_is_the_c_definition():
    layout, size = _core.ZYGOTE_MSG_LAYOUT, _core.ZYGOTE_MSG_SIZE
    assert _client._MSG.size == struct.calcsize(_client._MSG.format) == size
    fmt = "="
    for name, offset, code in layout:
        assert struct.calcsize(fmt) == offset, (name, offset, fmt)
        fmt += code
    assert struct.calcsize(_client._MSG.format) == struct.calcsize(fmt)
    assert [n for n, _, _ in layout] == list(_client._FIELDS)
    assert dict((n, o) for n, o, _ in layout)["targets"] + 4 * _core.ZYGOTE_MAX_FDS == size
    assert (_client._MAGIC, _client._SPAWN, _client._STARTED, _client.FAILED,
            _client._EXIT, _client.MAX_FDS) == (
        _core.ZYGOTE_MAGIC, _core.ZYGOTE_SPAWN, _core.ZYGOTE_STARTED, _core.ZYGOTE_FAILED,
        _core.ZYGOTE_EXIT, _core.ZYGOTE_MAX_FDS)
    assert len({_core.ZYGOTE_SPAWN, _core.ZYGOTE_STARTED, _core.ZYGOTE_FAILED,
                _core.ZYGOTE_EXIT}) == 4


def test_a_header_that_differs_from_c_is_refused_at_import():
    layout, size = _core.ZYGOTE_MSG_LAYOUT, _core.ZYGOTE_MSG_SIZE
    with pytest.raises(RuntimeError, match="bytes in C"):
        _client._header_struct(layout, size + 4)
    moved = tuple((n, o + 4 if n == "len" else o, c) for n, o, c in layout)
    with pytest.raises(RuntimeError, match="field len is at byte"):
        _client._header_struct(moved, size)
    renamed = (("magic2",) + layout[0][1:],) + layout[1:]
    with pytest.raises(RuntimeError, match="fields are"):
        _client._header_struct(renamed, size)
