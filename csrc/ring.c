/* ring.c: message rings, the bounded multi-producer multi-consumer queues
 * of variable-length messages that mpcore's queues are built on, and the
 * task count of JoinableQueue that lives in the same header.
 *
 * It stays one file of about 1,000 lines: put, get, close and the task
 * count are the halves of one protocol over one header (NOTE [ Ring ]),
 * whose memory orderings are argued against each other (a put's publish
 * against a get's claim, a close against both); apart, each half would
 * lose the other it is reasoned with.
 *
 * NOTE [ Ring ]
 * =============
 * Layout.  A ring is a region of shared memory: a fixed header of
 * MPC_RING_HDR bytes (six 64-byte lines, see struct mpc_ring) followed by
 * `capacity` bytes of message data (a multiple of 8).  The region is mapped
 * at different addresses in different processes, so nothing in it is a
 * pointer: positions are byte counters.  `head` and `tail` count every byte
 * ever taken from and put into the ring; they only grow (2^64 bytes never
 * wrap), the bytes in use are tail - head, and a counter maps to the data
 * area at counter % capacity.
 *
 * A message is a record: a 16-byte record header (nrefs, a tag that catches
 * corruption, the payload length), nrefs mpc_refs of 16 bytes, the payload,
 * and padding to a multiple of 8.  A record is written at the tail as if
 * the data area were endless and simply continues at the start of the area
 * when it reaches the end: records are split across the wrap, not kept
 * contiguous.  The copies do at most two memcpys each, no space is lost to
 * padding at the end, and so the largest message that can ever fit is the
 * whole capacity less the record header (mpc_ring_max_message).  Keeping
 * records contiguous would waste the bytes skipped at the end, make whether
 * a message fits depend on where the tail happens to be, and buy nothing,
 * since messages are always copied out anyway.
 *
 * Spilled messages.  A message whose payload can never fit travels in a
 * shared-memory block of its own (mpc_block_alloc, MPC_BLOCK_DATA), and
 * the ring carries a record tagged MPC_REC_SPILL: its refs, then the
 * ticket of that block as one more ref, and no payload bytes; its len is
 * the payload's length in the block.  Only refs must fit in the ring:
 * 16 bytes each, so a ring of capacity C carries up to C/16 - 2 of them
 * in one message.  The block's ticket is one more ref of the message, so
 * everything that already keeps tickets leak-free keeps it too: the putter journals the ticket before it takes
 * it and the publishing put clears it, a get journals it with the others,
 * mpc_ring_drain hands it to fn with the others (a queue freed with the
 * message inside drops it), and the getter redeems it and either copies
 * the payload out and releases the block before returning (mpc_ring_get)
 * or hands the block over, held (mpc_ring_get_block, which Ring.get
 * uses, so that a large pickle is loaded where it lies, with no copy).  A putter killed while
 * spilling leaves a block held by a dead process and a journaled ticket,
 * both of which the keeper drops; a getter killed between taking the
 * record and releasing the block leaves the same.  Spilling is done once
 * per message by mpc_ring_spill, before the put waits for room, so a put
 * that has to wait or is retried after a signal does not copy again.
 *
 * Locking.  One process-shared robust mutex guards head, tail and count,
 * and messages are copied in and out while it is held.  Critical sections
 * are therefore as long as a message copy; messages are meant to be small
 * (a few block references and a pickled header), and the bulk data travels
 * in shared-memory blocks, so a lock-free reservation scheme, whose
 * reservations a dying producer could leave as holes, is not worth it.
 * Everything is published by the store to tail (put) or head (get) after
 * the copy, so a process that dies holding the mutex, even half-way
 * through a copy, has left nothing half-visible.  The next locker gets
 * EOWNERDEAD, marks the mutex consistent, recounts the messages between
 * head and tail (the only field a death can have left stale) and wakes
 * every waiter, in case the dead process was about to.
 *
 * Waiting.  Condition variables are not used: a process that dies while
 * waiting on a process-shared condition variable leaves it broken.  Each
 * direction has instead a 32-bit sequence word, bumped under the mutex
 * whenever its condition may have changed (not_empty after a put or a
 * close, not_full after a get, drain or close), and a count of sleepers.  A
 * waiter reads the sequence word while it still holds the mutex, unlocks,
 * spins on the word for a few microseconds, then increments the sleeper
 * count and sleeps on the futex for as long as the word is unchanged.  A
 * waker bumps the word, unlocks, and makes the wake system call only when
 * the sleeper count is non-zero.  The futex compares the word before it
 * sleeps, and both sides use sequentially consistent read-modify-writes,
 * so either the waiter sees the new value or the waker sees the sleeper:
 * no wake-up is lost.  A process killed while asleep leaves the sleeper
 * count one too high for good; that costs a needless wake system call
 * now and then, never a missed one.  The spin is not counted as sleeping,
 * so a waker whose waiter is still spinning makes no system call at all;
 * that is why the ring spins itself instead of calling mpc_wait_change.
 * A wait that reaches its deadline looks at the ring once more before it
 * reports the timeout, in case a message or room came just then.
 *
 * Yielding.  Between the spin and the sleep a waiter polls for up to
 * MPC_RING_YIELD_NS more, calling sched_yield between looks.  In a stream
 * (a producer putting tensors it makes in a loop) the next message is
 * usually a few microseconds away; a getter that slept on every empty ring
 * made its putter pay a wake system call for every message (measured: a
 * put of a small message went from about 1 us to 7-9 us when the putter
 * did 5 us of work between puts), and itself a wake-up latency.  Polling
 * keeps the waiter out of the sleeper count, so the putter makes no system
 * call; yielding gives the core to any other runnable process in the
 * meantime, so ranks that outnumber the cores still progress, and after
 * MPC_RING_YIELD_NS an idle waiter sleeps as before.
 *
 * Any message satisfies any getter, so a put wakes one sleeping getter.  A
 * getter that leaves its wait without taking a message (a signal) passes
 * its wake-up on, and a getter that takes a message while others remain
 * wakes one more sleeper, so a wake-up swallowed by a getter that was then
 * stopped or killed delays the next message only until the ring is used
 * again.  Putters need different amounts of room, so a get wakes every
 * sleeping putter: waking only one, whose message might still not fit,
 * could leave a smaller one asleep although its message would fit.
 *
 * Close sets a flag and bumps both words under the mutex, so no waiter can
 * miss it.  The task count of JoinableQueue is an atomic word outside the
 * mutex; mpc_ring_put_counted adds to it in the critical section that
 * publishes the message, so no consumer can call task_done for a message
 * whose task is not counted yet, and a put that fails counts nothing.
 * task_done bumps a third sequence word each time the count reaches
 * zero, and join returns as soon as that word moves: like the stdlib's
 * join, it returns when the count has been zero, even if a new task was
 * added before the joiner ran. */
#include "mpcore.h"

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <unistd.h> /* getpid, for mpc_debug */

#define MPC_RING_MAGIC 0x474e4952524f4350ULL /* "PCORRING" */
#define MPC_RING_VERSION 1u
#define MPC_RING_HDR 384u
#define MPC_RING_MIN_CAPACITY 64u
#define MPC_RING_MAX_CAPACITY (1ULL << 48)

/* The record header in front of every message. */
typedef struct {
    uint32_t nrefs;
    uint32_t tag; /* MPC_REC_TAG, so that a corrupt ring is caught */
    uint64_t len; /* payload bytes */
} mpc__rec;

#define MPC_REC_TAG 0x4753534du   /* "MSSG" */
#define MPC_REC_SPILL 0x4c495053u /* "SPIL": the payload is in the block of the last ref */
#define MPC_REC_HDR ((uint64_t)sizeof(mpc__rec))

/* How long a waiter looks at a sequence word before it sleeps; see
 * MPC_SPIN_ITERATIONS in sync.c for why it is short. */
#define MPC_RING_SPIN 200
/* How long a waiter then polls, yielding its core between looks, before it
 * sleeps (NOTE [ Ring ], Yielding). */
#ifndef MPC_RING_YIELD_NS
#define MPC_RING_YIELD_NS 50000
#endif

struct mpc_ring {
    /* Line 0: written once by mpc_ring_init, read-only afterwards.  magic
     * is written last, so a process that sees it sees the rest. */
    uint64_t magic;
    uint32_t version;
    uint32_t header_size; /* MPC_RING_HDR */
    uint64_t capacity;    /* bytes of message data after the header */
    uint32_t maxitems;    /* 0 = bounded by bytes only */
    uint32_t _pad0;
    uint64_t _reserved0[4];

    /* Line 1: the mutex, on a line of its own because every operation
     * bounces it between cores. */
    union {
        pthread_mutex_t mutex;
        char _bytes[64];
    } lock;

    /* Line 2: what the mutex guards.  count and closed are atomics only
     * so that count() and closed can be read without the mutex. */
    uint64_t head;
    uint64_t tail;
    _Atomic uint32_t count;
    _Atomic uint32_t closed;
    char _pad2[40];

    /* Lines 3 to 5: the futex words, one direction per line, so that
     * spinning getters do not slow down putters. */
    _Atomic uint32_t not_empty_seq;
    _Atomic uint32_t get_sleepers;
    char _pad3[56];

    _Atomic uint32_t not_full_seq;
    _Atomic uint32_t put_sleepers;
    char _pad4[56];

    _Atomic uint32_t tasks;    /* unfinished tasks of a JoinableQueue */
    _Atomic uint32_t join_seq; /* bumped whenever tasks reaches zero */
    _Atomic uint32_t join_sleepers;
    char _pad5[52];
};

_Static_assert(sizeof(pthread_mutex_t) <= 64, "pthread_mutex_t does not fit a line");
_Static_assert(sizeof(struct mpc_ring) == MPC_RING_HDR, "ring header size changed");
_Static_assert(MPC_RING_HDR % 64 == 0, "ring header must be whole cache lines");
_Static_assert(sizeof(mpc_ref) == 16, "mpc_ref layout changed");

/* ------------------------------------------------------------------ */
/* Helpers                                                             */
/* ------------------------------------------------------------------ */

static inline uint64_t mpc__round8(uint64_t n) { return (n + 7) & ~(uint64_t)7; }

static inline char *mpc__ring_data(mpc_ring *r) { return (char *)r + MPC_RING_HDR; }

/* Checks that r looks like a ring before anything in it is trusted. */
static int mpc__ring_valid(const mpc_ring *r) {
    if (r == NULL)
        return mpc_fail(EINVAL, "no ring");
    uint64_t magic = __atomic_load_n(&r->magic, __ATOMIC_ACQUIRE);
    if (magic != MPC_RING_MAGIC)
        return mpc_fail(EINVAL, "the region at %p is not an mpcore ring (magic %#" PRIx64 ")",
                        (const void *)r, magic);
    if (r->version != MPC_RING_VERSION)
        return mpc_fail(EINVAL, "the ring at %p has version %u, this build knows only %u",
                        (const void *)r, r->version, MPC_RING_VERSION);
    return 0;
}

/* Copies n bytes to the data area at byte counter pos, continuing at the
 * start of the area when the end is reached. */
static void mpc__ring_write(mpc_ring *r, uint64_t pos, const void *src, uint64_t n) {
    uint64_t cap = r->capacity, off = pos % cap, first = cap - off;
    if (first > n)
        first = n;
    memcpy(mpc__ring_data(r) + off, src, first);
    if (n > first)
        memcpy(mpc__ring_data(r), (const char *)src + first, n - first);
}

/* Copies n bytes from the data area at byte counter pos, the same way. */
static void mpc__ring_read(mpc_ring *r, uint64_t pos, void *dst, uint64_t n) {
    uint64_t cap = r->capacity, off = pos % cap, first = cap - off;
    if (first > n)
        first = n;
    memcpy(dst, mpc__ring_data(r) + off, first);
    if (n > first)
        memcpy((char *)dst + first, mpc__ring_data(r), n - first);
}

/* Bytes a record with nrefs refs and len payload bytes takes, or 0 when it
 * could never fit in the ring. */
static uint64_t mpc__rec_size(const mpc_ring *r, uint64_t nrefs, uint64_t len) {
    uint64_t cap = r->capacity;
    if (len > cap || nrefs > cap / sizeof(mpc_ref))
        return 0;
    uint64_t total = mpc__round8(MPC_REC_HDR + nrefs * sizeof(mpc_ref) + len);
    return total <= cap ? total : 0;
}

/* Bytes the record with header *rec takes in the ring (a spilled record
 * holds no payload bytes), or 0 if the header is corrupt. */
static uint64_t mpc__rec_total(const mpc_ring *r, const mpc__rec *rec) {
    if (rec->tag == MPC_REC_TAG)
        return mpc__rec_size(r, rec->nrefs, rec->len);
    if (rec->tag == MPC_REC_SPILL && rec->nrefs >= 1 && rec->len > 0)
        return mpc__rec_size(r, rec->nrefs, 0);
    return 0;
}

/* Reads the record header at the head and checks it against the bytes in
 * use.  Called with the mutex held.  Returns the record size, or 0 if the
 * record is corrupt. */
static uint64_t mpc__ring_peek(mpc_ring *r, mpc__rec *rec) {
    uint64_t used = r->tail - r->head;
    if (used < MPC_REC_HDR || used > r->capacity)
        return 0;
    mpc__ring_read(r, r->head, rec, MPC_REC_HDR);
    uint64_t total = mpc__rec_total(r, rec);
    return total != 0 && total <= used ? total : 0;
}

/* After a process died holding the mutex: recounts the records between
 * head and tail, since the dead process may have moved head or tail without
 * updating count; if they do not parse (which a death alone cannot cause)
 * empties the ring rather than leave it unusable.  Then wakes everyone, in
 * case the dead process was about to. */
static void mpc__ring_repair(mpc_ring *r) {
    uint64_t pos = r->head, n = 0;
    int corrupt = r->tail - r->head > r->capacity;
    while (!corrupt && pos != r->tail) {
        mpc__rec rec;
        mpc__ring_read(r, pos, &rec, MPC_REC_HDR);
        uint64_t total = mpc__rec_total(r, &rec);
        if (total == 0 || total > r->tail - pos) {
            corrupt = 1;
            break;
        }
        pos += total;
        n++;
    }
    if (corrupt) {
        mpc_debug("ring %p: corrupt after a holder died; emptying it", (void *)r);
        r->head = r->tail;
        n = 0;
    }
    mpc_debug("ring %p: a process died holding its lock; %" PRIu64 " messages remain",
              (void *)r, n);
    atomic_store(&r->count, (uint32_t)n);
    atomic_fetch_add(&r->not_empty_seq, 1);
    atomic_fetch_add(&r->not_full_seq, 1);
    mpc_futex_wake(&r->not_empty_seq, INT32_MAX);
    mpc_futex_wake(&r->not_full_seq, INT32_MAX);
}

/* Takes the ring's mutex, repairing the ring if its last holder died.
 * Returns 0 with the mutex held, or -errno (mutex not held). */
static int mpc__ring_lock(mpc_ring *r) {
    int e = pthread_mutex_lock(&r->lock.mutex);
    if (e == 0)
        return 0;
    if (e == EOWNERDEAD) {
        mpc__ring_repair(r);
        pthread_mutex_consistent(&r->lock.mutex);
        return 0;
    }
    return mpc_fail(e, "cannot lock the ring at %p: %s", (void *)r, strerror(e));
}

static void mpc__ring_unlock(mpc_ring *r) { pthread_mutex_unlock(&r->lock.mutex); }

/* Waits for *seq to move away from seen: spins briefly, then sleeps,
 * counted in *sleepers so that wakers know to make the system call.
 * Returns as mpc_futex_wait; 0 may be spurious, the caller re-checks. */
static int mpc__ring_wait(_Atomic uint32_t *seq, _Atomic uint32_t *sleepers, uint32_t seen,
                          int64_t deadline_ns) {
    for (int i = 0; i < MPC_RING_SPIN; i++) {
        if (atomic_load_explicit(seq, memory_order_acquire) != seen)
            return 0;
        mpc_cpu_relax();
    }
    /* NOTE [ Ring ], Yielding: a stream's next message is usually a few
     * microseconds away, and a waiter that sleeps makes its peer pay a wake
     * system call for every message. */
    int64_t until = mpc_now_ns() + MPC_RING_YIELD_NS;
    if (deadline_ns >= 0 && deadline_ns < until)
        until = deadline_ns;
    while (mpc_now_ns() < until) {
        sched_yield();
        for (int i = 0; i < MPC_RING_SPIN / 4; i++) {
            if (atomic_load_explicit(seq, memory_order_acquire) != seen)
                return 0;
            mpc_cpu_relax();
        }
    }
    atomic_fetch_add(sleepers, 1);
    int rc = mpc_futex_wait(seq, seen, deadline_ns);
    atomic_fetch_sub(sleepers, 1);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Set-up and inspection                                               */
/* ------------------------------------------------------------------ */

/* Returns the header size plus capacity rounded up to 64 bytes, so that
 * regions laid end to end stay aligned; mpc_ring_init on a region of that
 * size gives at least `capacity` bytes.  Never fails: a capacity too large
 * for any region gives UINT64_MAX, which init then refuses. */
uint64_t mpc_ring_footprint(uint64_t capacity) {
    if (capacity > MPC_RING_MAX_CAPACITY)
        return UINT64_MAX;
    return MPC_RING_HDR + ((capacity + 63) & ~(uint64_t)63);
}

/* Checks that region (size bytes) holds an initialised ring that fits in
 * it, before a process that did not create the ring starts using it.
 * Returns 0, or -EINVAL with a message saying what is wrong. */
int mpc_ring_check(const void *region, uint64_t size) {
    if (region == NULL || ((uintptr_t)region & 7) != 0)
        return mpc_fail(EINVAL, "a ring must start at an 8-byte aligned address, not %p", region);
    if (size < MPC_RING_HDR + MPC_RING_MIN_CAPACITY)
        return mpc_fail(EINVAL, "a region of %" PRIu64 " bytes is too small for a ring", size);
    const mpc_ring *r = region;
    int rc = mpc__ring_valid(r);
    if (rc < 0)
        return rc;
    if (r->header_size != MPC_RING_HDR || r->capacity < MPC_RING_MIN_CAPACITY ||
        r->capacity % 8 != 0 || r->capacity > MPC_RING_MAX_CAPACITY)
        return mpc_fail(EINVAL, "the ring at %p has a corrupt header (capacity %" PRIu64 ")",
                        region, r->capacity);
    if (r->capacity > size - MPC_RING_HDR)
        return mpc_fail(EINVAL,
                        "the ring at %p needs %" PRIu64 " bytes but its region has only %" PRIu64,
                        region, r->capacity + MPC_RING_HDR, size);
    return 0;
}

/* Initialises a ring in a zeroed region of size bytes.  Returns 0; -EINVAL
 * with a message if the region is misaligned, too small, or not zeroed (a
 * ring, live or not, is never initialised over); or the -errno of
 * pthread_mutex_init.  On failure the region is left as it was, and in
 * particular without the magic, so nobody can use it as a ring. */
int mpc_ring_init(void *region, uint64_t size, uint32_t maxitems) {
    if (region == NULL || ((uintptr_t)region & 7) != 0)
        return mpc_fail(EINVAL, "a ring must start at an 8-byte aligned address, not %p", region);
    if (size < MPC_RING_HDR + MPC_RING_MIN_CAPACITY)
        return mpc_fail(EINVAL, "a region of %" PRIu64 " bytes is too small for a ring (at least %u)",
                        size, MPC_RING_HDR + MPC_RING_MIN_CAPACITY);
    const unsigned char *p = region;
    for (unsigned i = 0; i < MPC_RING_HDR; i++)
        if (p[i] != 0)
            return mpc_fail(EINVAL, "the region at %p is not zeroed; a ring needs a fresh region",
                            region);
    mpc_ring *r = region;
    uint64_t cap = (size - MPC_RING_HDR) & ~(uint64_t)7;
    if (cap > MPC_RING_MAX_CAPACITY)
        cap = MPC_RING_MAX_CAPACITY;

    pthread_mutexattr_t attr;
    int e = pthread_mutexattr_init(&attr);
    if (e == 0)
        e = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (e == 0)
        e = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (e == 0)
        e = pthread_mutex_init(&r->lock.mutex, &attr);
    pthread_mutexattr_destroy(&attr);
    if (e != 0)
        return mpc_fail(e, "cannot set up the lock of a ring: %s", strerror(e));

    r->version = MPC_RING_VERSION;
    r->header_size = MPC_RING_HDR;
    r->capacity = cap;
    r->maxitems = maxitems;
    __atomic_store_n(&r->magic, MPC_RING_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

/* Returns the largest message, refs (16 bytes each) and payload together,
 * that can ever fit; 0 if r is not a ring. */
uint64_t mpc_ring_max_message(const mpc_ring *r) {
    if (mpc__ring_valid(r) < 0)
        return 0;
    return r->capacity - MPC_REC_HDR;
}

/* Returns the number of messages in the ring (a snapshot, taken without
 * the mutex); 0 if r is not a ring. */
uint32_t mpc_ring_count(const mpc_ring *r) {
    if (mpc__ring_valid(r) < 0)
        return 0;
    return atomic_load(&r->count);
}

/* Returns 1 if the ring was closed, 0 if not, -EINVAL if r is not a ring. */
int mpc_ring_is_closed(const mpc_ring *r) {
    int rc = mpc__ring_valid(r);
    if (rc < 0)
        return rc;
    return atomic_load(&r->closed) != 0;
}

/* ------------------------------------------------------------------ */
/* Put and get                                                         */
/* ------------------------------------------------------------------ */

/* Writes one record at the tail and publishes it (the tail moves only
 * after the copy).  Called with the mutex held and room checked; total is
 * mpc__rec_size of the record.  The caller updates count. */
static void mpc__ring_append(mpc_ring *r, const mpc_ref *refs, uint32_t nrefs,
                             const void *payload, uint64_t len, const mpc_ref *spill,
                             uint64_t total) {
    mpc__rec rec = {.nrefs = nrefs + (spill != NULL), .tag = spill ? MPC_REC_SPILL : MPC_REC_TAG,
                    .len = len};
    uint64_t pos = r->tail, at = pos + MPC_REC_HDR;
    mpc__ring_write(r, pos, &rec, MPC_REC_HDR);
    if (nrefs > 0)
        mpc__ring_write(r, at, refs, (uint64_t)nrefs * sizeof(mpc_ref));
    at += (uint64_t)nrefs * sizeof(mpc_ref);
    if (spill != NULL)
        mpc__ring_write(r, at, spill, sizeof(mpc_ref));
    else if (len > 0)
        mpc__ring_write(r, at, payload, len);
    /* The message carries its tickets now: they leave the putter's
     * journal before it is published (NOTE [ Journal ]). */
    for (uint32_t i = 0; i < nrefs; i++)
        mpc_journal_clear(&refs[i]);
    if (spill != NULL)
        mpc_journal_clear(spill);
    r->tail = pos + total;
}

/* Publishes n validated messages (total bytes of records, which fit the
 * ring) in one critical section, waiting until deadline_ns for room in
 * bytes and in maxitems; counted != 0 adds n unfinished tasks with them.
 * The returns of mpc_ring_put_many. */
static int mpc__ring_publish(mpc_ring *r, const mpc_ring_msg *msgs, uint32_t n,
                             uint64_t total, int64_t deadline_ns, int counted) {
    int rc, last_try = 0;
    for (;;) {
        if ((rc = mpc__ring_lock(r)) < 0)
            return rc;
        if (atomic_load(&r->closed)) {
            mpc__ring_unlock(r);
            return -EPIPE;
        }
        uint32_t count = atomic_load(&r->count);
        uint64_t room = r->capacity - (r->tail - r->head);
        if (total <= room && (r->maxitems == 0 || count + (uint64_t)n <= r->maxitems) &&
            count + (uint64_t)n <= UINT32_MAX) {
            if (counted) {
                /* The tasks are counted before the messages are published;
                 * a consumer can only see them after the unlock. */
                uint32_t t = atomic_load(&r->tasks);
                do {
                    if ((uint64_t)t + n > UINT32_MAX) {
                        mpc__ring_unlock(r);
                        return mpc_fail(EOVERFLOW, "too many unfinished tasks");
                    }
                } while (!atomic_compare_exchange_weak(&r->tasks, &t, t + n));
            }
            for (uint32_t i = 0; i < n; i++) {
                const mpc_ring_msg *m = &msgs[i];
                mpc__ring_append(r, m->refs, m->nrefs, m->payload, m->len, m->spill,
                                 mpc__rec_size(r, (uint64_t)m->nrefs + (m->spill != NULL),
                                               m->spill ? 0 : m->len));
            }
            atomic_store(&r->count, count + n);
            atomic_fetch_add(&r->not_empty_seq, 1);
            mpc__ring_unlock(r);
            if (atomic_load(&r->get_sleepers) > 0)
                mpc_futex_wake(&r->not_empty_seq, n < INT32_MAX ? (int)n : INT32_MAX);
            return 0;
        }
        uint32_t seen = atomic_load(&r->not_full_seq);
        mpc__ring_unlock(r);
        if (deadline_ns == 0)
            return -EAGAIN;
        if (last_try)
            return -ETIMEDOUT;
        rc = mpc__ring_wait(&r->not_full_seq, &r->put_sleepers, seen, deadline_ns);
        if (rc == -ETIMEDOUT)
            last_try = 1; /* room may have come just at the deadline: look once more */
        else if (rc < 0)
            return rc; /* putters are woken all at once, so no wake-up to pass on */
    }
}

/* The body of the single puts: checks one message, then publishes it
 * (mpc__ring_publish).  counted != 0 also adds one unfinished task, inside
 * the same critical section that publishes the message, so that no
 * consumer can finish the task before it is counted and a put that fails
 * counts nothing.  spill, when not NULL, is the ticket of the block that
 * holds the payload (mpc_ring_spill): the record then carries it as its
 * last ref and no payload bytes. */
static int mpc__ring_put(mpc_ring *r, const mpc_ref *refs, uint32_t nrefs, const void *payload,
                         uint64_t len, const mpc_ref *spill, int64_t deadline_ns, int counted) {
    int rc = mpc__ring_valid(r);
    if (rc < 0)
        return rc;
    if ((nrefs > 0 && refs == NULL) || (len > 0 && payload == NULL && spill == NULL))
        return mpc_fail(EINVAL, "a message with refs or payload but no buffer for them");
    uint32_t nall = nrefs + (spill != NULL);
    if (nall < nrefs)
        return mpc_fail(EMSGSIZE, "a message cannot carry %u refs", nrefs);
    uint64_t total = mpc__rec_size(r, nall, spill ? 0 : len);
    if (total == 0)
        return mpc_fail(EMSGSIZE,
                        "a message of %u refs (%" PRIu64 " bytes, besides its payload) can never "
                        "fit in a ring whose largest message is %" PRIu64 " bytes",
                        nrefs, (uint64_t)nrefs * sizeof(mpc_ref), r->capacity - MPC_REC_HDR);
    mpc_ring_msg m = {refs, nrefs, payload, len, spill};
    return mpc__ring_publish(r, &m, 1, total, deadline_ns, counted);
}

/* Appends n messages at once, all or none: waits until deadline_ns (-1
 * forever, 0 not at all) for room for all of them (bytes, and maxitems),
 * then publishes them in order in one critical section, so no other
 * message comes between them and a getter sees either none or all.  A
 * message whose payload is too large for the ring must have been spilled
 * by the caller (mpc_ring_spill; msgs[i].spill then names the block, and
 * the ring owns it on success).  counted != 0 adds n unfinished tasks with
 * them.  Returns 0; -EAGAIN, -ETIMEDOUT, -EINTR, -EPIPE, -EINVAL as
 * mpc_ring_put; -EMSGSIZE (with a message) when the batch can never fit,
 * in bytes or in maxitems; -EOVERFLOW for too many unfinished tasks.  On
 * any failure the ring and the task count are unchanged. */
int mpc_ring_put_many(mpc_ring *r, const mpc_ring_msg *msgs, uint32_t n, int64_t deadline_ns,
                      int counted) {
    int rc = mpc__ring_valid(r);
    if (rc < 0)
        return rc;
    if (n == 0)
        return 0;
    if (msgs == NULL)
        return mpc_fail(EINVAL, "a batch of %u messages but no array of them", n);
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        const mpc_ring_msg *m = &msgs[i];
        if ((m->nrefs > 0 && m->refs == NULL) ||
            (m->len > 0 && m->payload == NULL && m->spill == NULL))
            return mpc_fail(EINVAL, "a message with refs or payload but no buffer for them");
        uint64_t one = mpc__rec_size(r, (uint64_t)m->nrefs + (m->spill != NULL),
                                     m->spill ? 0 : m->len);
        if (one == 0 || total + one > r->capacity)
            return mpc_fail(EMSGSIZE, "a batch of %u messages (%" PRIu64 "+ bytes) can never fit "
                            "in a ring of %" PRIu64 " bytes", n, total + one, r->capacity);
        total += one;
    }
    if (r->maxitems != 0 && n > r->maxitems)
        return mpc_fail(EMSGSIZE, "a batch of %u messages can never fit in a queue of at most "
                        "%u", n, r->maxitems);
    return mpc__ring_publish(r, msgs, n, total, deadline_ns, counted);
}

/* Decides whether a message of nrefs refs and len payload bytes must
 * travel in a block, and if so puts its payload into a new block (NOTE
 * [ Ring ], Spilled messages) and stores the block's ticket, journaled, in
 * *spill.  Returns 1 when spilled (the caller then puts with
 * mpc_ring_put_spilled, or drops *spill with mpc_ref_drop); 0 when the
 * message fits inline (nothing done); -EINVAL if r is not a ring;
 * -EMSGSIZE when even its refs can never fit; -ENOMEM (the message names
 * the size and what was available) or another -errno of mpc_block_alloc,
 * with nothing allocated. */
int mpc_ring_spill(mpc_ring *r, uint32_t nrefs, const void *payload, uint64_t len,
                   mpc_ref *spill) {
    int rc = mpc__ring_valid(r);
    if (rc < 0)
        return rc;
    if (mpc__rec_size(r, nrefs, len) != 0)
        return 0;
    if (mpc__rec_size(r, (uint64_t)nrefs + 1, 0) == 0)
        return mpc_fail(EMSGSIZE,
                        "a message of %u refs (%" PRIu64 " bytes, besides its payload) can never "
                        "fit in a ring whose largest message is %" PRIu64 " bytes",
                        nrefs, (uint64_t)nrefs * sizeof(mpc_ref), r->capacity - MPC_REC_HDR);
    if (payload == NULL)
        return mpc_fail(EINVAL, "a message with a payload but no buffer for it");
    mpc_block b;
    if ((rc = mpc_block_alloc(len, MPC_BLOCK_DATA, 0, &b)) < 0) {
        if (rc == -ENOMEM) {
            char why[512];
            snprintf(why, sizeof why, "%s", mpc_errmsg());
            return mpc_fail(ENOMEM, "a message of %" PRIu64 " bytes, larger than its ring, "
                            "cannot travel in shared memory: %s", len, why);
        }
        return rc;
    }
    mpc_copy(b.addr, payload, len);
    mpc_ref ref = {.seg_id = b.seg_id, .index = b.index, .gen = b.gen};
    /* Journaled before it is taken: a death in between leaves a ticket
     * the keeper cannot drop while our hold stands, so it is refused, and
     * the hold's drop frees the block. */
    mpc_journal_add(&ref);
    if ((rc = mpc_block_ticket(&b)) < 0) {
        mpc_journal_clear(&ref);
        mpc_block_release(&b);
        return rc;
    }
    mpc_block_release(&b); /* the ticket keeps it now */
    *spill = ref;
    return 1;
}

/* Appends a message whose payload mpc_ring_spill put into a block: the
 * record carries refs and then the ticket *spill, and records len as the
 * payload's length.  The same returns as mpc_ring_put; on success the
 * ring owns *spill, on failure the caller still does. */
int mpc_ring_put_spilled(mpc_ring *r, const mpc_ref *refs, uint32_t nrefs, const mpc_ref *spill,
                         uint64_t len, int64_t deadline_ns, int counted) {
    if (spill == NULL || len == 0)
        return mpc_fail(EINVAL, "a spilled message needs its block and length");
    return mpc__ring_put(r, refs, nrefs, NULL, len, spill, deadline_ns, counted);
}

/* Spills if needed, puts, and drops the spilled block if the put fails. */
static int mpc__ring_put_any(mpc_ring *r, const mpc_ref *refs, uint32_t nrefs,
                             const void *payload, uint64_t len, int64_t deadline_ns, int counted) {
    mpc_ref spill;
    int rc = mpc_ring_spill(r, nrefs, payload, len, &spill);
    if (rc <= 0)
        return rc < 0 ? rc : mpc__ring_put(r, refs, nrefs, payload, len, NULL, deadline_ns,
                                           counted);
    rc = mpc__ring_put(r, refs, nrefs, NULL, len, &spill, deadline_ns, counted);
    if (rc < 0)
        mpc_ref_drop(&spill);
    return rc;
}

/* Appends a message, waiting for room until deadline_ns (-1 forever, 0 not
 * at all); a payload too large for the ring travels in a block (NOTE
 * [ Ring ]).  Returns 0; -EAGAIN when full and not waiting; -ETIMEDOUT;
 * -EINTR (a signal: the caller checks it and calls again); -EPIPE when the
 * ring is closed; -EMSGSIZE (with a message naming the sizes) when its
 * refs alone can never fit; -ENOMEM when a block for a large payload
 * cannot be had; -EINVAL if r is not a ring.  On any failure the ring is
 * unchanged and no block is left behind.  A caller that may call again
 * after -EAGAIN or -EINTR spills once itself (mpc_ring_spill,
 * mpc_ring_put_spilled). */
int mpc_ring_put(mpc_ring *r, const mpc_ref *refs, uint32_t nrefs, const void *payload,
                 uint64_t len, int64_t deadline_ns) {
    return mpc__ring_put_any(r, refs, nrefs, payload, len, deadline_ns, 0);
}

/* As mpc_ring_put, and also adds one unfinished task (JoinableQueue.put)
 * atomically with the message; -EOVERFLOW if 2^32-1 tasks are unfinished.
 * On any failure neither the ring nor the task count changes. */
int mpc_ring_put_counted(mpc_ring *r, const mpc_ref *refs, uint32_t nrefs, const void *payload,
                         uint64_t len, int64_t deadline_ns) {
    return mpc__ring_put_any(r, refs, nrefs, payload, len, deadline_ns, 1);
}

/* Removes the head message into malloc'd buffers.  Called with the mutex
 * held and count > 0.  A spilled message's block ticket goes to *spill
 * (journaled, like its refs) and *spilled is set; its payload buffer is
 * allocated here, so that a failure leaves the message in the ring, and
 * filled by the caller once the mutex is released.  Returns 0, -ENOMEM
 * (the message stays), or -EIO if the record at the head is corrupt. */
static int mpc__ring_pop(mpc_ring *r, mpc_ref **refs, uint32_t *nrefs, void **payload,
                         uint64_t *len, mpc_ref *spill, int *spilled, int keep_block) {
    mpc__rec rec;
    uint64_t total = mpc__ring_peek(r, &rec);
    if (total == 0)
        return mpc_fail(EIO, "the ring at %p is corrupt at byte %" PRIu64, (void *)r, r->head);
    int is_spill = rec.tag == MPC_REC_SPILL;
    uint32_t n = rec.nrefs - (uint32_t)is_spill; /* the message's own refs */
    mpc_ref *rbuf = NULL;
    if (n > 0) {
        rbuf = malloc((size_t)n * sizeof(mpc_ref));
        if (rbuf == NULL)
            return mpc_fail(ENOMEM, "cannot allocate %u refs to receive a message", n);
    }
    /* At least one byte, so that a successful get never hands back NULL;
     * none when a spilled payload is handed over in its block. */
    void *pbuf = NULL;
    if (!(is_spill && keep_block) && (pbuf = malloc(rec.len > 0 ? (size_t)rec.len : 1)) == NULL) {
        free(rbuf);
        return mpc_fail(ENOMEM, "cannot allocate %" PRIu64 " bytes to receive a message", rec.len);
    }
    uint64_t pos = r->head, at = pos + MPC_REC_HDR;
    if (n > 0)
        mpc__ring_read(r, at, rbuf, (uint64_t)n * sizeof(mpc_ref));
    at += (uint64_t)n * sizeof(mpc_ref);
    if (is_spill)
        mpc__ring_read(r, at, spill, sizeof(mpc_ref));
    else if (rec.len > 0)
        mpc__ring_read(r, at, pbuf, rec.len);
    r->head = pos + total;
    atomic_fetch_sub(&r->count, 1);
    /* The tickets are the getter's now: journal them, so that they are
     * dropped if it dies before redeeming them (NOTE [ Journal ]). */
    for (uint32_t i = 0; i < n; i++)
        mpc_journal_add(&rbuf[i]);
    if (is_spill)
        mpc_journal_add(spill);
    *refs = rbuf;
    *nrefs = n;
    *payload = pbuf;
    *len = rec.len;
    *spilled = is_spill;
    return 0;
}

/* Redeems a spilled message's ticket into this process's hold on its
 * block.  Returns 0 with *out filled, or the -errno of mpc_block_attach or
 * -EIO (block shorter than the record says), the ticket dropped. */
static int mpc__ring_take_block(const mpc_ref *spill, uint64_t len, mpc_block *out) {
    int rc = mpc_block_attach(spill, 0, 1, out);
    if (rc < 0) {
        mpc_ref_drop(spill);
        return rc;
    }
    if (out->length < len) {
        rc = mpc_fail(EIO, "a spilled message says %" PRIu64 " bytes but its block has %" PRIu64,
                      len, out->length);
        mpc_block_release(out);
    }
    return rc;
}

/* Copies a spilled message's payload out of its block into buf (len
 * bytes) and lets the block go.  Called without the ring's mutex, since
 * it may have to ask the keeper for the block's segment.  Returns 0 or the
 * errors of mpc__ring_take_block; the ticket is dropped either way. */
static int mpc__ring_unspill(const mpc_ref *spill, void *buf, uint64_t len) {
    mpc_block b;
    int rc = mpc__ring_take_block(spill, len, &b);
    if (rc < 0)
        return rc;
    mpc_copy(buf, b.addr, len);
    mpc_block_release(&b);
    return 0;
}

/* The body of mpc_ring_get and mpc_ring_get_block: block, when not NULL,
 * receives a spilled payload's block (held) instead of a copy. */
static int mpc__ring_get(mpc_ring *r, mpc_ref **refs, uint32_t *nrefs, void **payload,
                         uint64_t *len, mpc_block *block, int64_t deadline_ns) {
    int rc = mpc__ring_valid(r);
    if (rc < 0)
        return rc;
    int last_try = 0;
    for (;;) {
        if ((rc = mpc__ring_lock(r)) < 0)
            return rc;
        if (atomic_load(&r->count) > 0) {
            mpc_ref *rr = NULL, spill;
            uint32_t nr = 0;
            void *p = NULL;
            uint64_t n = 0;
            int spilled = 0;
            rc = mpc__ring_pop(r, &rr, &nr, &p, &n, &spill, &spilled, block != NULL);
            if (rc == 0)
                atomic_fetch_add(&r->not_full_seq, 1);
            int more = atomic_load(&r->count) > 0;
            mpc__ring_unlock(r);
            if (rc < 0)
                return rc;
            if (atomic_load(&r->put_sleepers) > 0)
                mpc_futex_wake(&r->not_full_seq, INT32_MAX);
            /* Pass a wake-up on if messages remain: the one that woke us
             * may have been meant for a getter that has gone. */
            if (more && atomic_load(&r->get_sleepers) > 0)
                mpc_futex_wake(&r->not_empty_seq, 1);
            if (spilled) {
                rc = block ? mpc__ring_take_block(&spill, n, block)
                           : mpc__ring_unspill(&spill, p, n);
                if (rc < 0) {
                    for (uint32_t i = 0; i < nr; i++)
                        mpc_ref_drop_journaled(&rr[i]);
                    free(rr);
                    free(p);
                    return rc;
                }
            }
            *refs = rr;
            *nrefs = nr;
            *payload = p;
            *len = n;
            return spilled && block != NULL;
        }
        if (atomic_load(&r->closed)) {
            mpc__ring_unlock(r);
            return -EPIPE;
        }
        uint32_t seen = atomic_load(&r->not_empty_seq);
        mpc__ring_unlock(r);
        if (deadline_ns == 0)
            return -EAGAIN;
        if (last_try)
            return -ETIMEDOUT;
        rc = mpc__ring_wait(&r->not_empty_seq, &r->get_sleepers, seen, deadline_ns);
        if (rc == -ETIMEDOUT) {
            last_try = 1; /* a message may have come just at the deadline */
        } else if (rc < 0) {
            /* We may have taken the wake-up of a put and are leaving without
             * its message: hand it to another sleeper. */
            if (atomic_load(&r->count) > 0 && atomic_load(&r->get_sleepers) > 0)
                mpc_futex_wake(&r->not_empty_seq, 1);
            return rc;
        }
    }
}

/* Removes the oldest message, waiting for one until deadline_ns (-1
 * forever, 0 not at all).  On success returns 0 and hands over malloc'd
 * buffers that the caller frees: *refs (NULL when *nrefs is 0) and
 * *payload (never NULL, *len bytes), a spilled payload copied out of its
 * block, which is released.  Returns -EAGAIN when empty and not waiting;
 * -ETIMEDOUT; -EINTR (a signal: check it and call again); -EPIPE when
 * closed and empty; -ENOMEM when the buffers cannot be allocated; -EIO if
 * the ring is corrupt; -EINVAL if r is not a ring; on all of these the
 * ring is unchanged and the out-parameters are untouched.  When a spilled
 * payload cannot be read back (its block cannot be mapped: the -errno of
 * mpc_block_attach), the message is lost, its tickets are dropped, and
 * the out-parameters are untouched. */
int mpc_ring_get(mpc_ring *r, mpc_ref **refs, uint32_t *nrefs, void **payload, uint64_t *len,
                 int64_t deadline_ns) {
    return mpc__ring_get(r, refs, nrefs, payload, len, NULL, deadline_ns);
}

/* As mpc_ring_get, but a spilled payload is not copied: its block is
 * handed over in *block, held by this process (the caller releases it
 * with mpc_block_release), with *payload NULL and *len its length; then
 * 1 is returned instead of 0.  The same errors otherwise. */
int mpc_ring_get_block(mpc_ring *r, mpc_ref **refs, uint32_t *nrefs, void **payload,
                       uint64_t *len, mpc_block *block, int64_t deadline_ns) {
    if (block == NULL)
        return mpc_fail(EINVAL, "mpc_ring_get_block needs a block to fill");
    return mpc__ring_get(r, refs, nrefs, payload, len, block, deadline_ns);
}

/* ------------------------------------------------------------------ */
/* Close and drain                                                     */
/* ------------------------------------------------------------------ */

/* Marks the ring closed and wakes every waiter: waiting and later puts
 * return -EPIPE, gets return what is left and then -EPIPE.  Never fails;
 * does nothing if r is not a ring.  The flag is set under the mutex, so a
 * waiter that has just looked at it and is about to sleep cannot miss it. */
void mpc_ring_close(mpc_ring *r) {
    if (mpc__ring_valid(r) < 0)
        return;
    int locked = mpc__ring_lock(r) == 0;
    atomic_store(&r->closed, 1);
    atomic_fetch_add(&r->not_empty_seq, 1);
    atomic_fetch_add(&r->not_full_seq, 1);
    if (locked)
        mpc__ring_unlock(r);
    mpc_futex_wake(&r->not_empty_seq, INT32_MAX);
    mpc_futex_wake(&r->not_full_seq, INT32_MAX);
}

/* Calls fn(ref, arg) (fn may be NULL) for each ref of each undelivered
 * message, oldest first (the ticket of a spilled message's block among
 * them, so that dropping the refs frees it), and empties the ring.  fn runs with the ring's
 * mutex held, so it must not use this ring.  Never fails; does nothing if
 * r is not a ring or its mutex cannot be taken.  If the ring is corrupt
 * the refs of the unreadable messages are not reported.  A process that
 * dies inside drain leaves the messages it has not finished in the ring,
 * so their refs may be reported twice by the next drain. */
void mpc_ring_drain(mpc_ring *r, void (*fn)(const mpc_ref *, void *), void *arg) {
    if (mpc__ring_valid(r) < 0 || mpc__ring_lock(r) < 0)
        return;
    while (r->head != r->tail) {
        mpc__rec rec;
        uint64_t total = mpc__ring_peek(r, &rec);
        if (total == 0) {
            mpc_debug("ring %p: corrupt at byte %" PRIu64 " while draining", (void *)r, r->head);
            break;
        }
        for (uint32_t i = 0; fn != NULL && i < rec.nrefs; i++) {
            mpc_ref ref;
            mpc__ring_read(r, r->head + MPC_REC_HDR + (uint64_t)i * sizeof(mpc_ref), &ref,
                           sizeof ref);
            fn(&ref, arg);
        }
        /* Move on message by message, so that a death in fn repeats at most
         * one message's refs. */
        r->head += total;
        atomic_fetch_sub(&r->count, 1);
    }
    r->head = r->tail;
    atomic_store(&r->count, 0);
    atomic_fetch_add(&r->not_full_seq, 1);
    mpc__ring_unlock(r);
    if (atomic_load(&r->put_sleepers) > 0)
        mpc_futex_wake(&r->not_full_seq, INT32_MAX);
}

/* ------------------------------------------------------------------ */
/* Task accounting (JoinableQueue)                                     */
/* ------------------------------------------------------------------ */

/* Adds one unfinished task.  Returns 0; -EOVERFLOW if 2^32-1 tasks are
 * unfinished already; -EINVAL if r is not a ring.  On failure nothing
 * changes.  JoinableQueue.put should use mpc_ring_put_counted instead,
 * which counts the task together with the message. */
int mpc_ring_task_add(mpc_ring *r) {
    int rc = mpc__ring_valid(r);
    if (rc < 0)
        return rc;
    uint32_t v = atomic_load(&r->tasks);
    do {
        if (v == UINT32_MAX)
            return mpc_fail(EOVERFLOW, "too many unfinished tasks");
    } while (!atomic_compare_exchange_weak(&r->tasks, &v, v + 1));
    return 0;
}

/* Removes one unfinished task, waking the joiners when none is left.
 * Returns 0; -EINVAL with a message if no task is unfinished (nothing
 * changes) or r is not a ring. */
int mpc_ring_task_done(mpc_ring *r) {
    int rc = mpc__ring_valid(r);
    if (rc < 0)
        return rc;
    uint32_t v = atomic_load(&r->tasks);
    do {
        if (v == 0)
            return mpc_fail(EINVAL, "task_done() called too many times");
    } while (!atomic_compare_exchange_weak(&r->tasks, &v, v - 1));
    if (v == 1) {
        atomic_fetch_add(&r->join_seq, 1);
        if (atomic_load(&r->join_sleepers) > 0)
            mpc_futex_wake(&r->join_seq, INT32_MAX);
    }
    return 0;
}

/* Waits until no task is unfinished, or has been since the call began,
 * until deadline_ns (-1 forever, 0 not at all).  Returns 0; -ETIMEDOUT
 * (also when not waiting and tasks remain); -EINTR (check signals and call
 * again); -EINVAL if r is not a ring; another -errno from the futex. */
int mpc_ring_join(mpc_ring *r, int64_t deadline_ns) {
    int rc = mpc__ring_valid(r);
    if (rc < 0)
        return rc;
    /* Read the sequence word before the count: a task_done that empties
     * the count after we looked at it then bumps the word we wait on. */
    uint32_t seen = atomic_load(&r->join_seq);
    for (;;) {
        if (atomic_load(&r->tasks) == 0 || atomic_load(&r->join_seq) != seen)
            return 0;
        if (deadline_ns == 0)
            return -ETIMEDOUT;
        atomic_fetch_add(&r->join_sleepers, 1);
        rc = mpc_futex_wait(&r->join_seq, seen, deadline_ns);
        atomic_fetch_sub(&r->join_sleepers, 1);
        if (rc < 0)
            return rc;
    }
}
