"""Queue rows beyond cases.py's: fresh 16 MB tensors made in the producer's
loop, and small Python objects against faster-fifo.

cases.py imports this module and calls register(cases) near its end.
Nothing here imports torch or mpcore at module level.

NOTE [ The fresh-tensor rows ]
`queue-fresh-16m` and `-unbounded`: a forked producer makes each tensor in
its loop, `q.put(torch.full((4 << 20,), float(i)))` (16 MB of float32),
into a Queue of maxsize=16 (or an unbounded one); the consumer gets each
and reads one element (checked).  A warm-up item comes first (as in
cases.py's queue rows), so the producer's first put after fork (its keeper
connection, its first segment, torch's thread pool) is not counted.
The producer then alternates two kinds of round, in the same process:
  - a floor round: FLOOR_ITEMS times `torch.full` of the same size plus
    one `copy_` of it into a tensor made (and faulted in) beforehand: what
    a put cannot avoid (making the tensor, one copy into shared memory);
  - a queue round: ROUND_ITEMS puts, from the producer's first put to the
    consumer's last get of the round (both read the same monotonic clock);
    a bounded queue blocks the producer within a round, an unbounded one
    lets it run ahead of the consumer.
The figure is the median queue round's ms per item, `extra.floor_ms` the
median floor round's, and `extra.vs_floor` their ratio; the table's notes
say whether mpcore is within FLOOR_TARGET of its floor.  Alternating the
rounds compares the two under the same conditions: this machine's speed
drifts by 2x within minutes, and a floor timed only before or after the
puts (as the row first did) drew on other minutes than the puts did.
That floor copies into one tensor again and again, which the CPU's last
cache may hold (16 MB of source and 16 MB of destination fit a 32 MB L3),
while a queue with items in flight writes into a block no cache holds.  So
the producer also times at the end (median of three rounds) the same loop
copying into enough tensors in turn to outgrow that cache
(`extra.cold_floor_ms`, COLD_MAX of them at most): the notes give it
beside the floor, which stays the target's reference.

NOTE [ The small-object row ]
`queue-dict`: a forked producer puts N dicts of about 100 pickled bytes
(made before the clock), then a sentinel; the consumer gets them all;
items/s.  The torch side is multiprocessing.Queue (torch's is the
stdlib's).  The mpcore side times, in the same child, mpcore.Queue (the
figure), faster-fifo's Queue (if installed: it is a benchmark-only
comparison, never a dependency), and both again in batches of BATCH
(`put_many`/`get_many`).  The notes give each and the target: mpcore at
least FF_TARGET times faster-fifo, single items.
"""
import statistics
import time

KB, MB = 1 << 10, 1 << 20
FRESH_NUMEL = 4 << 20          # float32: 16 MB
FRESH_MAXSIZE = 16
ROUND_ITEMS = 48               # puts per queue round: 768 MB in flight at most
FLOOR_ITEMS = 16               # items per floor round
FRESH_MAX_ROUNDS = 12
FLOOR_TARGET = 1.5
COLD_MAX = 16                  # destinations of the cold floor: 256 MB at most
FF_TARGET = 1.5
BATCH = 64
DICT_MAX_ITEMS = 400_000

_c = None   # the cases module (register)


# --- fresh 16 MB tensors --------------------------------------------------

def _last_cache_bytes():
    """The size of the CPU's largest cache (Linux's sysfs), else 32 MB."""
    import glob
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                v = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
        try:
            best = max(best, int(v.rstrip("KMG")) * mult)
        except ValueError:
            pass
    return best or 32 * MB


def _floor_round(torch, dsts):
    """ms per item of torch.full plus one copy_ of the same size into the
    tensors of dsts in turn, over FLOOR_ITEMS items."""
    t0 = time.perf_counter()
    for i in range(FLOOR_ITEMS):
        t = torch.full((FRESH_NUMEL,), float(i))
        dsts[i % len(dsts)].copy_(t)
        del t
    return (time.perf_counter() - t0) / FLOOR_ITEMS * 1e3


def _faulted(torch, k):
    """k tensors of FRESH_NUMEL, faulted in, as a reused shared block is."""
    dsts = [torch.empty(FRESH_NUMEL) for _ in range(k)]
    for d in dsts:
        d.fill_(0.0)
    return dsts


def _fresh_producer(torch, q, rounds, go, acks, done):
    # A warm-up item first (the consumer's cue), as the other queue rows:
    # what is timed is a running producer, not its first put after fork.
    dst = _faulted(torch, 1)
    q.put(torch.full((FRESH_NUMEL,), -1.0))
    go.acquire(timeout=_c.CHILD_WAIT_S)
    floor, puts = [], []
    for _ in range(rounds):
        floor.append(_floor_round(torch, dst))
        t0 = time.perf_counter()
        for i in range(ROUND_ITEMS):
            q.put(torch.full((FRESH_NUMEL,), float(i)))
        puts.append((acks.get() - t0) / ROUND_ITEMS * 1e3)
    del dst
    k = min(COLD_MAX, _last_cache_bytes() // (FRESH_NUMEL * 4) + 2)
    cold_dsts = _faulted(torch, k)
    cold = sorted(_floor_round(torch, cold_dsts) for _ in range(3))[1]
    q.put({"puts_ms": puts, "floor_ms": floor, "cold_floor_ms": cold})
    done.wait(_c.CHILD_WAIT_S)


def _fresh_once(env, rounds, maxsize, out):
    q = env.Queue(maxsize)
    go, done, acks = env.ctx.Semaphore(0), env.ctx.Event(), env.ctx.SimpleQueue()
    p = env.ctx.Process(target=_fresh_producer, daemon=True,
                        args=(env.torch, q, rounds, go, acks, done))
    p.start()
    try:
        q.get(timeout=_c.CHILD_WAIT_S)            # the warm-up item
        go.release()
        for _ in range(rounds):
            for i in range(ROUND_ITEMS):
                t = q.get(timeout=_c.CHILD_WAIT_S)
                if t.numel() != FRESH_NUMEL or float(t[-1]) != float(i):
                    raise AssertionError(f"item {i} wrong: {t.numel()} elements, "
                                         f"last {float(t[-1])}")
                del t
            acks.put(time.perf_counter())
        out.clear()
        out.update(q.get(timeout=_c.CHILD_WAIT_S))
        return sum(out["puts_ms"]) * ROUND_ITEMS / 1e3
    finally:
        done.set()
        go.release()
        _c._reap([p])
        _c.close_queue(q)


def fresh_16m(env, target_s, maxsize):
    out = {}
    rounds, el = _c.calibrate(lambda k: _fresh_once(env, k, maxsize, out), target_s, 1, lo=3,
                              hi=FRESH_MAX_ROUNDS)
    ms, floor = statistics.median(out["puts_ms"]), statistics.median(out["floor_ms"])
    return _c.Measurement(ms, rounds * ROUND_ITEMS, el,
                          {"ms_per_item": ms, "floor_ms": floor, "vs_floor": ms / floor,
                           "rounds_ms": out["puts_ms"], "floor_rounds_ms": out["floor_ms"],
                           "cold_floor_ms": out["cold_floor_ms"],
                           "GB_per_s": FRESH_NUMEL * 4 / ms / 1e6})


def _fresh_notes(row):
    out = []
    for impl, best, e in _c.best_entries(row):
        line = (f"{impl}: {best:.3g} ms per item (median round); its producer's floor "
                f"(torch.full + one 16 MB copy, median of the rounds between) "
                f"{e['floor_ms']:.3g} ms: {e['vs_floor']:.2f}x the floor")
        if impl == "mpcore":
            line += (f" (target <= {FLOOR_TARGET:g}x: "
                     f"{'met' if e['vs_floor'] <= FLOOR_TARGET else 'MISSED'})")
        if e.get("rounds_ms") and e.get("floor_rounds_ms"):
            bq, bf = min(e["rounds_ms"]), min(e["floor_rounds_ms"])
            line += f"; best rounds {bq:.3g} / {bf:.3g} ms: {bq / bf:.2f}x"
        if e.get("cold_floor_ms"):
            line += (f"; {best / e['cold_floor_ms']:.2f}x the same floor copying into memory "
                     f"no cache holds ({e['cold_floor_ms']:.3g} ms)")
        out.append(line)
    return out


# --- small Python objects -------------------------------------------------

def _small_dict(i):
    # About 100 bytes pickled (protocol 4); checked in _dict_bytes.
    return {"id": i, "name": f"item-{i:012d}", "score": 0.5 * i, "tags": ["a", "b"],
            "ok": True, "n": 7}


def _dict_bytes():
    import pickle
    return len(pickle.dumps(_small_dict(123), 4))


def _dict_producer(q, n, go, batch):
    items = [_small_dict(i) for i in range(n)]
    go.acquire(timeout=_c.CHILD_WAIT_S)
    if batch:
        for k in range(0, n, batch):
            q.put_many(items[k:k + batch], timeout=_c.CHILD_WAIT_S)
        q.put_many([None], timeout=_c.CHILD_WAIT_S)
    else:
        for it in items:
            q.put(it)
        q.put(None)


def _dict_once(ctx, make_queue, n, batch):
    q = make_queue()
    go = ctx.Semaphore(0)
    p = ctx.Process(target=_dict_producer, daemon=True, args=(q, n, go, batch))
    p.start()
    try:
        got = 0
        last = None
        t0 = time.perf_counter()
        go.release()
        if batch:
            while True:
                msgs = q.get_many(timeout=_c.CHILD_WAIT_S, max_messages_to_get=batch)
                if msgs[-1] is None:
                    got += len(msgs) - 1
                    last = msgs[-2] if len(msgs) > 1 else last
                    break
                got += len(msgs)
                last = msgs[-1]
        else:
            while True:
                m = q.get(timeout=_c.CHILD_WAIT_S)
                if m is None:
                    break
                got += 1
                last = m
        el = time.perf_counter() - t0
        if got != n or last != _small_dict(n - 1):
            raise AssertionError(f"got {got} of {n} items, last {last!r}")
        p.join(_c.CHILD_WAIT_S)
        return el
    finally:
        _c._reap([p])
        _c.close_queue(q)


def _dict_rate(ctx, make_queue, target_s, batch=0):
    n, el = _c.calibrate(lambda k: _dict_once(ctx, make_queue, k, batch), target_s, 2000,
                         lo=1000, hi=DICT_MAX_ITEMS)
    return n, el, n / el


def _faster_fifo_queue():
    try:
        import faster_fifo
    except ImportError:
        return None
    return lambda: faster_fifo.Queue(max_size_bytes=2 << 20)


def queue_dict(env, target_s):
    n, el, rate = _dict_rate(env.ctx, env.Queue, target_s)
    extra = {"items_per_s": rate, "us_per_item": 1e6 / rate, "item_bytes": _dict_bytes()}
    if env.mpcore is not None:
        b_n, b_el, b_rate = _dict_rate(env.ctx, env.Queue, target_s, BATCH)
        extra["batch_items_per_s"] = b_rate
        ff = _faster_fifo_queue()
        extra["faster_fifo"] = ff is not None
        if ff is not None:
            extra["ff_items_per_s"] = _dict_rate(env.ctx, ff, target_s)[2]
            extra["ff_batch_items_per_s"] = _dict_rate(env.ctx, ff, target_s, BATCH)[2]
            extra["vs_ff"] = rate / extra["ff_items_per_s"]
            extra["batch_vs_ff"] = b_rate / extra["ff_batch_items_per_s"]
    return _c.Measurement(rate, n, el, extra)


def _dict_notes(row):
    e = _c._best_row_extra(row, "mpcore")
    if not e:
        return []
    out = [f"mpcore put_many/get_many in batches of {BATCH}: "
           f"{e['batch_items_per_s']:,.0f} items/s"]
    if not e.get("faster_fifo"):
        out.append("faster-fifo: not installed (pip install faster-fifo to compare; it is "
                   "never a dependency)")
        return out
    best_ff = max(x.get("ff_items_per_s", 0) for x in row["mpcore"]["extra"])
    ratio = row["mpcore"]["best"] / best_ff
    out.append(f"faster-fifo (same child): {best_ff:,.0f} items/s single, "
               f"{max(x.get('ff_batch_items_per_s', 0) for x in row['mpcore']['extra']):,.0f} "
               f"in batches of {BATCH}; mpcore / faster-fifo = {ratio:.2f}x single "
               f"(target >= {FF_TARGET:g}x: {'met' if ratio >= FF_TARGET else 'MISSED'}), "
               f"{e['batch_vs_ff']:.2f}x in batches")
    return out


# --- the rows -----------------------------------------------------------------

def register(cases):
    """Adds this module's rows to cases.CASES (called by cases.py)."""
    global _c
    _c = cases
    for tag, maxsize, what in (("", FRESH_MAXSIZE, f"maxsize={FRESH_MAXSIZE}"),
                               ("-unbounded", 0, "unbounded")):
        cases.add_case(f"queue-fresh-16m{tag}", f"Queue fresh 16 MB tensors, {what}", "ms",
                       False, fresh_16m, params={"maxsize": maxsize}, row_notes=_fresh_notes,
                       own_child=True, timeout_s=180.0,
                       note=f"A forked producer puts torch.full((4M,), i) made in its loop "
                            f"(16 MB float32) on a Queue ({what}); the consumer reads one "
                            f"element of each; ms per item, the median of rounds of {ROUND_ITEMS} after a "
                            f"warm-up item. The notes compare it with the producer's floor, timed "
                            f"in rounds between (torch.full + one 16 MB copy), target <= "
                            f"{FLOOR_TARGET:g}x (NOTE [ The fresh-tensor rows ]).")
    cases.add_case("queue-dict", "Queue 100-byte dicts", "items/s", True, queue_dict,
                   row_notes=_dict_notes, timeout_s=240.0,
                   note="A forked producer puts small dicts (~100 bytes pickled), the consumer "
                        "gets them; items/s. torch: multiprocessing.Queue; mpcore: mpcore.Queue. "
                        f"The notes add faster-fifo and the batch forms (batches of {BATCH}); "
                        f"target: mpcore >= {FF_TARGET:g}x faster-fifo "
                        "(NOTE [ The small-object row ]).")
