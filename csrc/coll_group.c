/* coll_group.c: a shared-memory group's life and its meetings.  It owns
 * the region's layout (NOTE [ Shared-memory collectives ] in coll.c),
 * making, attaching, watching and closing a group, breaking it, the
 * barrier every collective meets at, and the start of each collective
 * (what every rank asked for, compared). */
#include "coll.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>

#define MPC_COLL_MAGIC 0x34306c6c6f63706dULL /* "mpcoll04" */
#define MPC_COLL_YIELDS 16                    /* see mpc__coll_barrier() */
#define MPC_COLL_SPIN_NS 30000LL              /* see mpc__coll_barrier() */
#define MPC_COLL_BOXES (8u << 20)             /* mailbox bytes of a group, about */
#define MPC_COLL_BOX_MIN 4096u                /* mailbox bytes of a pair, at least */
#define MPC_COLL_BOX_MAX (1u << 20)           /* and at most */

_Static_assert(sizeof(mpc_coll_hdr) <= MPC_COLL_DATA, "collective header too large");
_Static_assert(MPC_COLL_MAX_RANKS < (1 << MPC_COLL_COUNT_BITS), "a meeting counts every rank");

static const char *const kind_names[MPC_COLL_KINDS] = {
    "?",      "all_reduce", "broadcast", "barrier", "all_gather", "reduce_scatter",
    "reduce", "gather",     "scatter",   "all_to_all"};

/* ------------------------------------------------------------------ */
/* Layout                                                              */
/* ------------------------------------------------------------------ */

static uint64_t page_up(uint64_t n) { return (n + MPC_PAGE - 1) / MPC_PAGE * MPC_PAGE; }

/* The mailbox bytes of each ordered pair: about MPC_COLL_BOXES in all,
 * a power of two within MPC_COLL_BOX_MIN..MAX. */
static uint64_t box_bytes(int world) {
    uint64_t pairs = (uint64_t)world * (uint64_t)(world - 1), ring = MPC_COLL_BOX_MAX;
    if (pairs == 0)
        return 0;
    while (ring > MPC_COLL_BOX_MIN && ring * pairs > MPC_COLL_BOXES)
        ring /= 2;
    return ring;
}

static mpc_coll_layout layout(int world, uint64_t chunk) {
    mpc_coll_layout l;
    uint64_t w = (uint64_t)world, pairs = w * (w - 1);
    l.sizes = MPC_COLL_DATA;
    l.boxes = l.sizes + page_up(2 * w * 2 * w * sizeof(uint64_t));
    l.bells = l.boxes + pairs * sizeof(mpc_coll_box);
    l.rings = l.boxes + page_up(pairs * sizeof(mpc_coll_box) + w * sizeof(mpc_coll_bell));
    l.ring = box_bytes(world);
    l.areas = l.rings + page_up(pairs * l.ring);
    l.size = l.areas + 2 * area_bytes(world, chunk);
    return l;
}

uint64_t mpc_coll_footprint(int world, uint64_t chunk) { return layout(world, chunk).size; }

/* ------------------------------------------------------------------ */
/* A group's life                                                      */
/* ------------------------------------------------------------------ */

int mpc_coll_create(int world, uint64_t chunk, int *fd) {
    if (world < 1 || world > MPC_COLL_MAX_RANKS)
        return mpc_fail(EINVAL, "a group has 1 to %d ranks, not %d", MPC_COLL_MAX_RANKS, world);
    if (chunk < 4096 || chunk % 4096)
        return mpc_fail(EINVAL, "the staging size must be a multiple of 4096 bytes");
    uint64_t size = mpc_coll_footprint(world, chunk);
    int r = mpc_memfd_create(size, size, fd);
    if (r < 0)
        return r;
    mpc_coll_hdr *h = mmap(NULL, MPC_COLL_DATA, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    if (h == MAP_FAILED) {
        r = -errno;
        close(*fd);
        return mpc_fail(-r, "cannot map a new group: %s", strerror(-r));
    }
    h->world = (uint32_t)world;
    h->chunk = chunk;
    h->size = size;
    atomic_store(&h->broken, 0);
    atomic_store(&h->why_told, 0);
    h->magic = MPC_COLL_MAGIC;
    munmap(h, MPC_COLL_DATA);
    return 0;
}

/* Under Yama's ptrace_scope 1, lets processes of this user copy from and
 * into this one (NOTE [ Copies between ranks' memory ] in coll_copy.c). */
static void allow_peers(void) {
    int fd = open("/proc/sys/kernel/yama/ptrace_scope", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    char v = 0;
    if (read(fd, &v, 1) == 1 && v == '1')
        prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    close(fd);
}

int mpc_coll_attach(int fd, int rank, int world, int direct, mpc_coll **out) {
    mpc_coll_hdr probe;
    if (pread(fd, &probe, sizeof probe.magic + 8 + 16, 0) < 0)
        return mpc_fail(errno, "cannot read the group's header: %s", strerror(errno));
    if (probe.magic != MPC_COLL_MAGIC)
        return mpc_fail(EINVAL, "the fd is not a collective group");
    if ((int)probe.world != world || rank < 0 || rank >= world)
        return mpc_fail(EINVAL, "rank %d of %d does not fit a group made for %u ranks", rank,
                        world, probe.world);
    mpc_coll *c = calloc(1, sizeof *c);
    if (c == NULL)
        return -ENOMEM;
    c->h = mmap(NULL, probe.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (c->h == MAP_FAILED) {
        int e = errno;
        free(c);
        return mpc_fail(e, "cannot map the group: %s", strerror(e));
    }
    c->size = probe.size;
    c->chunk = probe.chunk;
    c->rank = rank;
    c->world = world;
    c->at = layout(world, probe.chunk);
    if (c->at.size != probe.size) {
        munmap(c->h, probe.size);
        free(c);
        return mpc_fail(EINVAL, "the group's region has an unexpected size");
    }
    for (int i = 0; i < MPC_COLL_MAX_RANKS; i++) {
        c->pidfds[i] = -1;
        c->label[i] = i;
    }
    /* a rank that attaches again goes on where it closed (the counts' parities
     * pick what its peers read) */
    c->bar = atomic_load(&c->h->ranks[rank].bar);
    c->calls = c->h->ranks[rank].calls;
    c->piece = c->h->ranks[rank].piece;
    for (int p = 0; p < 2; p++)
        c->met[p] = c->h->ranks[rank].met[p];
    cpu_set_t cpus;
    if (sched_getaffinity(0, sizeof cpus, &cpus) == 0 && world > CPU_COUNT(&cpus))
        c->yields = MPC_COLL_YIELDS;
    else
        c->spin_ns = MPC_COLL_SPIN_NS;
    c->h->ranks[rank].pid = getpid();
    c->h->ranks[rank].base = (uint64_t)(uintptr_t)c->h;
    atomic_store(&c->h->ranks[rank].cma, 0);
    c->direct = direct;
    if (direct)
        allow_peers();
    *out = c;
    return 0;
}

void mpc_coll_set_labels(mpc_coll *c, const int *labels) {
    for (int q = 0; q < c->world; q++)
        c->label[q] = labels[q];
}

void mpc_coll_set_interrupt(mpc_coll *c, int (*fn)(void *), void *arg) {
    c->interrupted = fn;
    c->arg = arg;
}

int mpc_coll_watch(mpc_coll *c) {
    for (int r = 0; r < c->world; r++) {
        if (r == c->rank || c->pidfds[r] >= 0)
            continue;
        int pid = c->h->ranks[r].pid;
        int fd = pid > 0 ? (int)syscall(SYS_pidfd_open, pid, 0) : -1;
        if (fd < 0)
            return mpc_fail(pid > 0 ? errno : EINVAL, "cannot watch rank %d (pid %d): %s", r,
                            pid, pid > 0 ? strerror(errno) : "it has not joined");
        c->pidfds[r] = fd;
    }
    /* NOTE [ Copies between ranks' memory ] in coll_copy.c: read each
     * peer's pid from its own mapping of the region */
    int ok = c->direct;
    for (int r = 0; r < c->world && ok; r++) {
        if (r == c->rank)
            continue;
        int32_t seen = 0;
        uint64_t at = c->h->ranks[r].base + offsetof(mpc_coll_hdr, ranks[r].pid);
        struct iovec l = {&seen, sizeof seen}, rm = {(void *)(uintptr_t)at, sizeof seen};
        ok = process_vm_readv(c->h->ranks[r].pid, &l, 1, &rm, 1, 0) == (ssize_t)sizeof seen &&
             seen == c->h->ranks[r].pid;
    }
    atomic_store(&c->h->ranks[c->rank].cma, (uint32_t)ok);
    return 0;
}

void mpc_coll_close(mpc_coll *c) {
    if (c == NULL)
        return;
    mpc_coll_rank *me = &c->h->ranks[c->rank];
    me->calls = c->calls;
    me->piece = c->piece;
    for (int p = 0; p < 2; p++)
        me->met[p] = c->met[p];
    for (int r = 0; r < MPC_COLL_MAX_RANKS; r++)
        if (c->pidfds[r] >= 0)
            close(c->pidfds[r]);
    for (int i = 0; c->maps != NULL && i < MPC_COLL_MAPS; i++)
        if (c->maps[i].addr != NULL)
            munmap(c->maps[i].addr, c->maps[i].len);
    free(c->maps);
    free(c->peers_tmp);
    while (c->held != NULL) {
        mpc_coll_held *h = c->held;
        c->held = h->next;
        free(h);
    }
    munmap(c->h, c->size);
    free(c);
}

int mpc_coll_world(const mpc_coll *c) { return c->world; }

int mpc_coll_direct(const mpc_coll *c) { return cma_all(c); }

int mpc_coll_pid(const mpc_coll *c, int rank) {
    return rank >= 0 && rank < c->world ? c->h->ranks[rank].pid : -1;
}

/* ------------------------------------------------------------------ */
/* Breaking a group, barriers, and the start of every collective     */
/* ------------------------------------------------------------------ */

/* The 32 bits of w holding its low half: the futex word. */
static _Atomic uint32_t *low_half(_Atomic uint64_t *w) {
    return (_Atomic uint32_t *)(void *)((char *)w +
                                        (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__ ? 4 : 0));
}

/* NOTE [ The reason comes before the word ]
 * One rank wins the right to break the group (the compare-exchange on
 * broken) and then writes why.  A peer can see broken in between, so it
 * reads why only once why_told says it is whole.  The writer is a
 * vsnprintf away; if it died there, the peer says who broke the group
 * instead of waiting on. */
int mpc__coll_broken(mpc_coll *c) {
    for (int i = 0; i < 1000 && !atomic_load_explicit(&c->h->why_told, memory_order_acquire); i++) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    if (!atomic_load_explicit(&c->h->why_told, memory_order_acquire))
        return mpc_fail(EPIPE, "the group was broken by rank %d, which gave no reason",
                        lbl(c, (int)atomic_load(&c->h->broken) - 1));
    return mpc_fail(EPIPE, "%s", c->h->why);
}

void mpc__coll_break(mpc_coll *c, int who, const char *fmt, ...) {
    uint32_t zero = 0;
    if (atomic_compare_exchange_strong(&c->h->broken, &zero, (uint32_t)who + 1)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->h->why, sizeof c->h->why, fmt, ap);
        va_end(ap);
        atomic_store_explicit(&c->h->why_told, 1, memory_order_release);
    }
    for (int p = 0; p < 2; p++) { /* ranks waiting at a barrier: above the arrivals */
        atomic_fetch_add(&c->h->meet[p].word, 1ull << MPC_COLL_COUNT_BITS);
        mpc_futex_wake(low_half(&c->h->meet[p].word), INT32_MAX);
    }
    for (int q = 0; q < c->world; q++) { /* ranks waiting on a mailbox */
        atomic_fetch_add(bell(c, q), 1);
        mpc_futex_wake(bell(c, q), INT32_MAX);
    }
}

void mpc_coll_break(mpc_coll *c, const char *why) {
    mpc__coll_break(c, c->rank, "%s", why);
}

int mpc__coll_check_peers(mpc_coll *c, const char *what) {
    for (int r = 0; r < c->world; r++) {
        if (c->pidfds[r] < 0)
            continue;
        struct pollfd p = {c->pidfds[r], POLLIN, 0};
        if (poll(&p, 1, 0) > 0) {
            mpc__coll_break(c, r, "rank %d (pid %d) exited during %s", lbl(c, r),
                            c->h->ranks[r].pid, what);
            return mpc__coll_broken(c);
        }
    }
    return 0;
}

/* NOTE [ One word a meeting ]
 * A barrier is one atomic add per rank on a word all of them wait on.  The
 * word's low MPC_COLL_COUNT_BITS count arrivals; the bits above sum what
 * each rank adds there, a digest of the call it starts (0 inside a call).
 * Every rank knows the word as the barrier before it of the same parity
 * left it (c->met), so it knows what the word must read once all W ranks
 * added: met + W * (its own digest, shifted, + 1).  The rank whose add
 * brings the count there is the last; the others wait until it does.  If
 * then the word is not what this rank expected, some rank added another
 * digest: calls that differ are found at the barrier itself, without
 * reading one line a rank.  Between two ranks that is exact (a + b = 2a
 * only when b = a); among more, digests that differ could still add up to
 * the total expected, with about the odds of a 48-bit hash colliding.
 * Two words, by the barrier's parity: a rank that left barrier k adds to
 * the other word at k + 1, and cannot reach k + 2 before every rank has
 * arrived at k + 1, by when each has read word k.  Before, each rank
 * raised a count of its own, looked at every peer's, and the last bumped a
 * generation word the others slept on: several cache-line handoffs a
 * barrier, and the call's check read each peer's line once more;
 * measured in C, 0.38 us a barrier against 0.18 us this way.
 * A rank still writes how many barriers it entered to its own line (read
 * only when a barrier times out, to name who did not come), and its call
 * (read only when the digests disagree).  As it closes, it leaves c->met
 * there for when it attaches again: a peer may have added itself to the
 * next barrier by then, so the word itself may have moved on.  A break adds
 * above the arrivals, which wakes the sleepers and leaves the count as it is. */

/* Whether w holds as many arrivals as want (the count bits only). */
static int arrived(uint64_t w, uint64_t want) {
    return ((w ^ want) & ((1ull << MPC_COLL_COUNT_BITS) - 1)) == 0;
}

/* The first half of a barrier (NOTE [ One word a meeting ]): adds this rank,
 * with digest (below 2^(64 - MPC_COLL_COUNT_BITS)), to the next barrier's
 * word, and looks at the word up to `looks` more times (none with more
 * ranks than CPUs) while some rank has not come.  Leaves what meet_end
 * needs in c->meeting.  Returns 1 when every rank has come, else 0. */
static int meet_add(mpc_coll *c, uint64_t digest, int looks) {
    mpc_coll_hdr *h = c->h;
    uint64_t target = ++c->bar, p = target & 1;
    mpc_coll_meet *m = &h->meet[p];
    uint64_t v = digest << MPC_COLL_COUNT_BITS | 1;
    uint64_t want = c->met[p] + (uint64_t)c->world * v;
    atomic_store_explicit(&h->ranks[c->rank].bar, target, memory_order_release);
    /* sequentially consistent: the call posted before is seen by whoever
     * reads the word after */
    uint64_t w = atomic_fetch_add(&m->word, v) + v;
    if (arrived(w, want))
        mpc_wake_sleepers(low_half(&m->word), &m->sleepers);
    for (int i = 0; i < (c->yields ? 0 : looks) && !arrived(w, want); i++) {
        mpc_cpu_relax();
        w = atomic_load_explicit(&m->word, memory_order_acquire);
    }
    c->meeting.target = target;
    c->meeting.want = want;
    c->meeting.w = w;
    return arrived(w, want);
}

/* The second half: waits until every rank has come, and checks the word.
 * Returns 0, 1 when the ranks' digests disagree, or mpc__coll_barrier's
 * errors. */
static int meet_end(mpc_coll *c, const char *what, int64_t deadline) {
    mpc_coll_hdr *h = c->h;
    uint64_t target = c->meeting.target, p = target & 1;
    uint64_t want = c->meeting.want, w = c->meeting.w;
    mpc_coll_meet *m = &h->meet[p];
    while (!arrived(w, want)) {
        if (atomic_load(&h->broken))
            return mpc__coll_broken(c);
        int64_t now = mpc_now_ns();
        int64_t until = now + MPC_COLL_CHECK_NS;
        if (deadline >= 0 && deadline < until)
            until = deadline;
        /* More ranks than CPUs: a rank that would sleep first yields its CPU
         * a few times, which lets the ranks it waits for run without the
         * round trip of a futex wake-up. */
        for (int y = 0; y < c->yields && atomic_load(&m->word) == w; y++)
            sched_yield();
        /* As many ranks as CPUs: a rank spins up to MPC_COLL_SPIN_NS first,
         * since a peer a few microseconds behind (a Python caller's
         * overhead) would otherwise cost a futex sleep and wake-up. */
        int r = mpc_wait_change_spin(low_half(&m->word), (uint32_t)w, c->spin_ns, until,
                                     &m->sleepers);
        uint64_t was = w;
        w = atomic_load(&m->word);
        if (arrived(w, want) || w != was)
            continue;
        if (r == -EINTR && c->interrupted != NULL && c->interrupted(c->arg)) {
            mpc__coll_break(c, c->rank, "rank %d was interrupted during %s", lbl(c, c->rank),
                            what);
            return -EINTR;
        }
        if (r == -ETIMEDOUT) {
            /* a signal that came while this rank spun or looked at its
             * peers was not an EINTR: look for it here too */
            if (c->interrupted != NULL && c->interrupted(c->arg)) {
                mpc__coll_break(c, c->rank, "rank %d was interrupted during %s", lbl(c, c->rank),
                                what);
                return -EINTR;
            }
            if ((r = mpc__coll_check_peers(c, what)) < 0)
                return r;
            if (deadline >= 0 && mpc_now_ns() >= deadline) {
                char missing[160];
                size_t n = 0;
                missing[0] = '\0';
                for (int q = 0; q < c->world && n < sizeof missing - 8; q++)
                    if (atomic_load(&h->ranks[q].bar) < target)
                        n += (size_t)snprintf(missing + n, sizeof missing - n, "%s%d",
                                              n ? ", " : "", lbl(c, q));
                if (n == 0) /* every rank came, and the word never said so */
                    snprintf(missing, sizeof missing, "that had all come (the group's count "
                             "is out of step)");
                /* " timeout ": torch's tests of gloo match " (Timed out|closed|timeout) " */
                mpc__coll_break(c, c->rank, "%s hit its timeout waiting for ranks %s", what,
                                missing);
                return mpc_fail(ETIMEDOUT, "%s hit its timeout waiting for ranks %s", what,
                                missing);
            }
        }
    }
    c->met[p] = w;
    if (w == want)
        return 0;
    if (atomic_load(&h->broken))
        return mpc__coll_broken(c);
    return 1;
}

int mpc__coll_barrier(mpc_coll *c, const char *what, int64_t deadline) {
    meet_add(c, 0, 0);
    int r = meet_end(c, what, deadline);
    if (r <= 0)
        return r;
    /* inside a call every rank adds 0: only ranks out of step differ */
    mpc__coll_break(c, c->rank, "rank %d found the ranks out of step in %s", lbl(c, c->rank),
                    what);
    return mpc__coll_broken(c);
}

/* s, or "?" for a code without a name. */
static const char *or_unknown(const char *s) { return s != NULL ? s : "?"; }

/* Writes what a call asked for into out, as the errors give it: "reduce
 * of 1000 float32 with SUM to rank 0". */
static void describe(const mpc_coll *c, char *out, size_t n, const mpc_coll_call *x) {
    uint32_t k = x->kind < MPC_COLL_KINDS ? x->kind : 0;
    int reduces = k == MPC_COLL_ALL_REDUCE || k == MPC_COLL_REDUCE_SCATTER || k == MPC_COLL_REDUCE;
    int p = snprintf(out, n, "%s", kind_names[k]);
    if (k != MPC_COLL_BARRIER && k != MPC_COLL_ALL_TO_ALL && p >= 0 && (size_t)p < n)
        p += snprintf(out + p, n - (size_t)p, " of %llu %s", (unsigned long long)x->count,
                      !reduces ? "bytes" : or_unknown(mpc_coll_dtype_name((int)x->dtype)));
    if (reduces && p >= 0 && (size_t)p < n)
        p += snprintf(out + p, n - (size_t)p, " with %s",
                      or_unknown(mpc_coll_op_name((int)x->op)));
    if ((k == MPC_COLL_BROADCAST || k == MPC_COLL_SCATTER) && p >= 0 && (size_t)p < n)
        snprintf(out + p, n - (size_t)p, " from rank %d", lbl(c, x->root));
    if ((k == MPC_COLL_REDUCE || k == MPC_COLL_GATHER) && p >= 0 && (size_t)p < n)
        snprintf(out + p, n - (size_t)p, " to rank %d", lbl(c, x->root));
}

/* A digest of what a call asks for, in 64 - MPC_COLL_COUNT_BITS bits
 * (NOTE [ One word a meeting ]): splitmix64's finaliser over its fields. */
static uint64_t digest_of(const mpc_coll_call *x) {
    uint64_t z = (uint64_t)x->kind | (uint64_t)x->op << 8 | (uint64_t)x->dtype << 16 |
                 (uint64_t)(uint32_t)x->root << 32;
    z ^= x->count * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (z ^ (z >> 31)) >> MPC_COLL_COUNT_BITS;
}

/* mpc__coll_begin's first half: posts the call and adds this rank to the
 * barrier (meet_add, looking `looks` times).  Returns 1 when every rank has
 * come, 0, or the error of a group broken before. */
static int begin_start(mpc_coll *c, uint32_t kind, uint32_t op, uint32_t dtype, int32_t root,
                       uint64_t count, int looks) {
    if (atomic_load(&c->h->broken))
        return mpc__coll_broken(c);
    uint64_t parity = c->calls++ & 1;
    mpc_coll_call me = {kind, op, dtype, root, count};
    c->h->ranks[c->rank].call[parity] = me;
    if (kind != MPC_COLL_ALL_REDUCE && kind != MPC_COLL_REDUCE && kind != MPC_COLL_ALL_TO_ALL &&
        kind != MPC_COLL_ALL_GATHER && kind != MPC_COLL_REDUCE_SCATTER) /* those post theirs */
        c->h->ranks[c->rank].ref[parity].fd = -1;
    c->meeting.call = me;
    c->meeting.call_parity = parity;
    return meet_add(c, digest_of(&me), looks);
}

/* The second half: waits for the ranks and compares what they called. */
static int begin_end(mpc_coll *c, int64_t deadline) {
    mpc_coll_call me = c->meeting.call;
    int r = meet_end(c, kind_names[me.kind < MPC_COLL_KINDS ? me.kind : 0], deadline);
    if (r <= 0)
        return r;
    /* the digests disagree: the calls say how */
    char a[128], b[128];
    describe(c, a, sizeof a, &me);
    for (int q = 0; q < c->world; q++) {
        mpc_coll_call o = c->h->ranks[q].call[c->meeting.call_parity];
        if (o.kind == me.kind && o.op == me.op && o.dtype == me.dtype && o.root == me.root &&
            o.count == me.count)
            continue;
        describe(c, b, sizeof b, &o);
        return mpc_fail(EINVAL, "ranks disagree: rank %d called %s, rank %d called %s",
                        lbl(c, c->rank), a, lbl(c, q), b);
    }
    mpc__coll_break(c, c->rank, "rank %d found the ranks out of step at %s", lbl(c, c->rank), a);
    return mpc__coll_broken(c);
}

int mpc__coll_begin(mpc_coll *c, uint32_t kind, uint32_t op, uint32_t dtype, int32_t root,
                    uint64_t count, int64_t deadline) {
    int r = begin_start(c, kind, op, dtype, root, count, 0);
    return r < 0 ? r : begin_end(c, deadline);
}

int mpc_coll_barrier_start(mpc_coll *c, int looks) {
    int r = begin_start(c, MPC_COLL_BARRIER, 0, MPC_DT_U8, 0, 0, looks);
    if (r <= 0)
        return r;
    r = begin_end(c, -1); /* every rank has come: nothing to wait for */
    return r < 0 ? r : 1;
}

int mpc_coll_barrier_end(mpc_coll *c, int64_t deadline) { return begin_end(c, deadline); }

