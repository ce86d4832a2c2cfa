/* coll_p2p.c: point to point between two ranks of a shared-memory group:
 * send, try_send and recv through the mailboxes of the group's region
 * (NOTE [ Mailboxes ]), or, for a large send, straight from the sender's
 * memory (NOTE [ Copies between ranks' memory ] in coll_copy.c).
 *
 * NOTE [ Mailboxes ]
 * send and recv involve two ranks only, so they cannot use the barriers.
 * Each ordered pair (src, dst) has a ring of bytes in the region, written
 * only by src and read only by dst, and two counters: head (bytes src ever
 * put in, written by src) and tail (bytes dst ever took out, written by
 * dst).  A message is a 64-byte line (magic, tag, size) and its bytes,
 * padded to whole lines, so a header never wraps around the ring.  A
 * message larger than the ring streams through it in pieces of at most a
 * quarter of the ring: the sender puts in what fits (waiting for at least
 * a quarter of the ring, or the rest, so that neither side wakes for
 * crumbs), the receiver takes out what is there, each publishing its
 * counter with release order after every piece and ringing the other's
 * doorbell, so that both copy at once (published only once a whole ring
 * was copied, the two took turns: a 16 MB ping-pong took 6.0 ms, against
 * 2.0 ms in pieces).  A rank sleeps on its own doorbell (a futex word that
 * every change it may wait for bumps, and break_group too) with the same
 * spin, sleep and peer watch as a barrier.  The rings take about
 * MPC_COLL_BOXES bytes in all: 1 MB a pair for 2 ranks, down to 4 KB a
 * pair (16 MB in all) for 64.
 * Matching is gloo's: a recv for tag t from rank s takes the oldest
 * message with tag t from s, past older ones with other tags.  Those it
 * passes it takes out of the mailbox (so that the sender is not stuck
 * behind them) and holds in this process's memory, oldest first, for the
 * recv that wants them; a recv looks at what is held before the mailbox,
 * since a held message is older than any still there.  A message with the
 * right tag but another size is an error (-EINVAL naming both sizes) that
 * leaves the message where it was.  A recv from any rank looks at the
 * ranks in turn from the one after the last it took from.
 * A timeout or a peer's exit during send or recv breaks the group, as in a
 * collective: a message may be half in the ring.
 * Threads: a collective, a recv and sends to different ranks touch
 * different state, so they may run at once on one group from different
 * threads; two collectives, two recvs, or two sends to one rank may not. */
#include "coll.h"

#include <sched.h>
#include <string.h>

#define MPC_COLL_MSG_MAGIC 0x67736d6du        /* "mmsg" */
#define MPC_COLL_CMA_MAGIC 0x616d636du        /* "mcma": the bytes stay in the sender */
#define MPC_COLL_CMA_SEND (16u << 20)         /* send bytes beyond which to copy directly */

/* What starts each message in a mailbox (one 64-byte line). */
typedef struct {
    uint32_t magic, tag;
    uint64_t nbytes;
    uint64_t addr; /* MPC_COLL_CMA_MAGIC: where the bytes lie in the sender */
} mpc_coll_msg;

/* n rounded up to whole 64-byte lines. */
static uint64_t up64(uint64_t n) {
    return (n + MPC_COLL_ALIGN - 1) / MPC_COLL_ALIGN * MPC_COLL_ALIGN;
}

/* NOTE [ Messages name their peer when they are needed ]
 * A send or receive names what it does ("recv from rank 3 (tag 0)") for its
 * errors.  Formatting that on every call cost more than a small message's
 * copy: a 4 KB ping-pong formats it three times per rank.  So a call keeps
 * an empty buffer and fills it here, once, just before it first waits or
 * copies between processes: off the path of a message that is there. */

/* Fills what (64 bytes), if empty, with `verb` and peer ("rank N", or "any
 * rank" for -1), then " (tag T)" when tag >= 0; returns what. */
static const char *p2p_what(const mpc_coll *c, char *what, const char *verb, int peer,
                            int64_t tag) {
    if (what[0] != '\0')
        return what;
    int n = peer >= 0 ? snprintf(what, 64, "%s rank %d", verb, lbl(c, peer))
                      : snprintf(what, 64, "%s any rank", verb);
    if (tag >= 0 && n > 0 && n < 64)
        snprintf(what + n, 64 - (size_t)n, " (tag %lld)", (long long)tag);
    return what;
}

/* Sleeps until this rank's doorbell moves from g (read before the caller
 * looked at its mailboxes), looking at the peers every MPC_COLL_CHECK_NS.
 * Returns 0 for the caller to look again, or the error (the group is then
 * broken).  what: the call, for messages; peer: the rank waited for, or -1
 * for any. */
static int p2p_wait(mpc_coll *c, uint32_t g, const char *what, int peer, int64_t deadline) {
    _Atomic uint32_t *b = bell(c, c->rank);
    if (atomic_load(&c->h->broken))
        return mpc__coll_broken(c);
    int64_t until = mpc_now_ns() + MPC_COLL_CHECK_NS;
    if (deadline >= 0 && deadline < until)
        until = deadline;
    for (int y = 0; y < c->yields && atomic_load(b) == g; y++)
        sched_yield();
    int r = mpc_wait_change_spin(b, g, c->spin_ns, until, sleepers(c, c->rank));
    if (r == 0 || (r == -EINTR && (c->interrupted == NULL || !c->interrupted(c->arg))))
        return 0;
    if (r == -EINTR || (r == -ETIMEDOUT && c->interrupted != NULL && c->interrupted(c->arg))) {
        mpc__coll_break(c, c->rank, "rank %d was interrupted during %s", lbl(c, c->rank), what);
        return -EINTR;
    }
    if (r != -ETIMEDOUT)
        return r;
    if ((r = mpc__coll_check_peers(c, what)) < 0)
        return r;
    if (deadline >= 0 && mpc_now_ns() >= deadline) {
        char whom[32];
        if (peer >= 0)
            snprintf(whom, sizeof whom, "rank %d", lbl(c, peer));
        else
            snprintf(whom, sizeof whom, "any rank");
        mpc__coll_break(c, c->rank, "rank %d's %s hit its timeout waiting for %s", lbl(c, c->rank),
                        what, whom);
        return mpc_fail(ETIMEDOUT, "%s hit its timeout waiting for %s", what, whom);
    }
    return 0;
}

/* Copies n bytes between a ring of cap bytes (at byte pos, wrapping) and
 * flat memory. */
static void ring_put(uint8_t *ring, uint64_t cap, uint64_t pos, const uint8_t *src, uint64_t n) {
    if (n == 0)
        return;
    uint64_t at = pos % cap, first = cap - at < n ? cap - at : n;
    memcpy(ring + at, src, first);
    memcpy(ring, src + first, n - first);
}

static void ring_get(uint8_t *dst, const uint8_t *ring, uint64_t cap, uint64_t pos, uint64_t n) {
    if (n == 0)
        return;
    uint64_t at = pos % cap, first = cap - at < n ? cap - at : n;
    memcpy(dst, ring + at, first);
    memcpy(dst + first, ring, n - first);
}

static void ring_bell(mpc_coll *c, int q) {
    atomic_fetch_add(bell(c, q), 1);
    mpc_wake_sleepers(bell(c, q), sleepers(c, q));
}

/* A send whose receiver copies the bytes from buf (NOTE [ Copies between
 * ranks' memory ]): the header goes into the mailbox, and the send
 * returns once the receiver has taken it out, after its copy. */
static int send_direct(mpc_coll *c, const void *buf, uint64_t nbytes, int dst, uint32_t tag,
                       const char *what, int64_t deadline) {
    mpc_coll_box *bx = box(c, c->rank, dst);
    uint64_t cap = c->at.ring, head = atomic_load_explicit(&bx->head, memory_order_relaxed);
    for (;;) {
        uint32_t g = atomic_load(bell(c, c->rank));
        if (cap - (head - atomic_load_explicit(&bx->tail, memory_order_acquire)) >= MPC_COLL_ALIGN)
            break;
        int r = p2p_wait(c, g, what, dst, deadline);
        if (r < 0)
            return r;
    }
    _Alignas(64) uint8_t line[MPC_COLL_ALIGN] = {0};
    mpc_coll_msg m = {MPC_COLL_CMA_MAGIC, tag, nbytes, (uint64_t)(uintptr_t)buf};
    memcpy(line, &m, sizeof m);
    memcpy(ring(c, c->rank, dst) + head % cap, line, MPC_COLL_ALIGN);
    head += MPC_COLL_ALIGN;
    atomic_store_explicit(&bx->head, head, memory_order_release);
    ring_bell(c, dst);
    for (;;) {
        uint32_t g = atomic_load(bell(c, c->rank));
        if (atomic_load_explicit(&bx->tail, memory_order_acquire) >= head)
            return 0;
        int r = p2p_wait(c, g, what, dst, deadline);
        if (r < 0)
            return r;
    }
}

int mpc_coll_send(mpc_coll *c, const void *buf, uint64_t nbytes, int dst, uint32_t tag,
                  int64_t deadline) {
    if (dst < 0 || dst >= c->world || dst == c->rank)
        return mpc_fail(EINVAL, "rank %d cannot send to rank %d: not another rank of this "
                                "group of %d", c->rank, dst, c->world);
    if (atomic_load(&c->h->broken))
        return mpc__coll_broken(c);
    /* NOTE [ Messages name their peer when they are needed ] */
    char what[64] = "";
    mpc_coll_box *bx = box(c, c->rank, dst);
    uint8_t *rg = ring(c, c->rank, dst);
    uint64_t cap = c->at.ring, head = atomic_load_explicit(&bx->head, memory_order_relaxed);
    const uint8_t *src = buf;
    if (nbytes > MPC_COLL_CMA_SEND && atomic_load(&c->h->ranks[dst].cma))
        return send_direct(c, buf, nbytes, dst, tag, p2p_what(c, what, "send to", dst, -1),
                           deadline);
    /* the header, then the data in pieces of what fits, at most a quarter
     * of the ring (at least that, or the rest, so that neither side wakes
     * for crumbs): NOTE [ Mailboxes ] */
    uint64_t sent = 0, total = MPC_COLL_ALIGN + up64(nbytes);
    int header = 1;
    while (header || sent < nbytes) {
        uint32_t g = atomic_load(bell(c, c->rank));
        uint64_t room = cap - (head - atomic_load_explicit(&bx->tail, memory_order_acquire));
        uint64_t left = header ? total : up64(nbytes - sent);
        uint64_t want = left < cap / 4 ? left : cap / 4;
        if (room < want || room < MPC_COLL_ALIGN) {
            int r = p2p_wait(c, g, p2p_what(c, what, "send to", dst, -1), dst, deadline);
            if (r < 0)
                return r;
            continue;
        }
        if (header) {
            _Alignas(64) uint8_t line[MPC_COLL_ALIGN] = {0};
            mpc_coll_msg m = {MPC_COLL_MSG_MAGIC, tag, nbytes};
            memcpy(line, &m, sizeof m);
            memcpy(rg + head % cap, line, MPC_COLL_ALIGN);
            head += MPC_COLL_ALIGN;
            room -= MPC_COLL_ALIGN;
            header = 0;
        }
        uint64_t n = (room < cap / 4 ? room : cap / 4) / MPC_COLL_ALIGN * MPC_COLL_ALIGN;
        if (n >= nbytes - sent)
            n = nbytes - sent;
        ring_put(rg, cap, head, src + sent, n);
        sent += n;
        head += up64(n);
        atomic_store_explicit(&bx->head, head, memory_order_release);
        ring_bell(c, dst);
    }
    return 0;
}

int mpc_coll_try_send(mpc_coll *c, const void *buf, uint64_t nbytes, int dst, uint32_t tag) {
    if (dst < 0 || dst >= c->world || dst == c->rank)
        return mpc_coll_send(c, buf, nbytes, dst, tag, -1); /* its error */
    if (atomic_load(&c->h->broken))
        return mpc__coll_broken(c);
    mpc_coll_box *bx = box(c, c->rank, dst);
    uint64_t used = atomic_load_explicit(&bx->head, memory_order_relaxed) -
                    atomic_load_explicit(&bx->tail, memory_order_acquire);
    if (MPC_COLL_ALIGN + up64(nbytes) > c->at.ring - used)
        return 0;
    /* only this sender moves head, and tail only grows: it all fits */
    int r = mpc_coll_send(c, buf, nbytes, dst, tag, -1);
    return r < 0 ? r : 1;
}

/* Takes the next message out of from's mailbox (its header m) into buf:
 * streaming it as the sender puts it in, or copying it from the sender's
 * memory and then taking out the header.  Returns 0 or the error (the
 * group is then broken). */
static int take(mpc_coll *c, int from, void *buf, const mpc_coll_msg *m, int64_t deadline) {
    int me = c->rank;
    char what[64] = "";
    mpc_coll_box *bx = box(c, from, me);
    const uint8_t *rg = ring(c, from, me);
    uint64_t cap = c->at.ring, nbytes = m->nbytes;
    uint64_t tail = atomic_load_explicit(&bx->tail, memory_order_relaxed) + MPC_COLL_ALIGN;
    uint64_t got = 0;
    if (m->magic == MPC_COLL_CMA_MAGIC) {
        /* NOTE [ A large receive copies on two threads ] */
        int r = mpc__coll_cma_copy(c, from, buf, m->addr, nbytes, 0, 1,
                                   p2p_what(c, what, "recv from", from, -1));
        if (r < 0)
            return r;
        atomic_store_explicit(&bx->tail, tail, memory_order_release);
        ring_bell(c, from);
        return 0;
    }
    atomic_store_explicit(&bx->tail, tail, memory_order_release);
    if (nbytes == 0)
        ring_bell(c, from);
    while (got < nbytes) {
        uint32_t g = atomic_load(bell(c, me));
        uint64_t have = atomic_load_explicit(&bx->head, memory_order_acquire) - tail;
        if (have == 0) {
            int r = p2p_wait(c, g, p2p_what(c, what, "recv from", from, -1), from, deadline);
            if (r < 0)
                return r;
            continue;
        }
        uint64_t n = have < cap / 4 ? have : cap / 4;
        if (n > nbytes - got)
            n = nbytes - got;
        ring_get((uint8_t *)buf + got, rg, cap, tail, n);
        got += n;
        tail += up64(n);
        atomic_store_explicit(&bx->tail, tail, memory_order_release);
        ring_bell(c, from);
    }
    return 0;
}

static int size_mismatch(const mpc_coll *c, uint64_t nbytes, uint32_t tag, int q,
                         uint64_t has) {
    return mpc_fail(EINVAL, "rank %d's recv of %llu bytes with tag %u from rank %d does not "
                            "match the message rank %d sent it with that tag: %llu bytes",
                    lbl(c, c->rank), (unsigned long long)nbytes, tag, lbl(c, q), lbl(c, q),
                    (unsigned long long)has);
}

int mpc_coll_recv(mpc_coll *c, void *buf, uint64_t nbytes, int src, uint32_t tag,
                  int64_t deadline) {
    int W = c->world, me = c->rank;
    if (src < -1 || src >= W || src == me || W == 1)
        return mpc_fail(EINVAL, "rank %d cannot receive from rank %d: not another rank of "
                                "this group of %d, nor -1 (any)", me, src, W);
    char what[64] = "";
    uint64_t cap = c->at.ring;
    for (;;) {
        /* a message held earlier is older than any still in a mailbox */
        for (mpc_coll_held **at = &c->held; *at != NULL; at = &(*at)->next) {
            mpc_coll_held *h = *at;
            if ((src >= 0 && h->src != src) || h->tag != tag)
                continue;
            if (h->nbytes != nbytes)
                return size_mismatch(c, nbytes, tag, h->src, h->nbytes);
            int from = h->src;
            if (nbytes > 0)
                memcpy(buf, h->data, nbytes);
            *at = h->next;
            free(h);
            return from;
        }
        uint32_t g = atomic_load(bell(c, me));
        if (atomic_load(&c->h->broken))
            return mpc__coll_broken(c);
        int from = -1, held = 0;
        mpc_coll_msg found = {0};
        for (int k = 0; k < W && from < 0 && !held; k++) {
            int q = src >= 0 ? src : (c->next_src + k) % W;
            if (q == me || (src >= 0 && k > 0))
                continue;
            mpc_coll_box *bx = box(c, q, me);
            uint64_t tail = atomic_load_explicit(&bx->tail, memory_order_relaxed);
            if (atomic_load_explicit(&bx->head, memory_order_acquire) - tail < MPC_COLL_ALIGN)
                continue;
            mpc_coll_msg m;
            memcpy(&m, ring(c, q, me) + tail % cap, sizeof m);
            if (m.magic != MPC_COLL_MSG_MAGIC && m.magic != MPC_COLL_CMA_MAGIC)
                return mpc_fail(EIO, "rank %d's mailbox from rank %d is corrupt", lbl(c, me),
                                lbl(c, q));
            if (m.tag == tag) {
                if (m.nbytes != nbytes)
                    return size_mismatch(c, nbytes, tag, q, m.nbytes);
                from = q;
                found = m;
                continue;
            }
            /* another tag's message: take it out and hold it for its recv
             * (NOTE [ Mailboxes ]), then look again */
            mpc_coll_held *h = malloc(sizeof *h + m.nbytes);
            if (h == NULL)
                return mpc_fail(ENOMEM, "rank %d has no memory to hold a %llu-byte message "
                                        "from rank %d with tag %u while it waits for tag %u",
                                lbl(c, me), (unsigned long long)m.nbytes, lbl(c, q), m.tag, tag);
            *h = (mpc_coll_held){NULL, q, m.tag, m.nbytes};
            int r = take(c, q, h->data, &m, deadline);
            if (r < 0) {
                free(h);
                return r;
            }
            mpc_coll_held **end = &c->held;
            while (*end != NULL)
                end = &(*end)->next;
            *end = h;
            held = 1;
        }
        if (from >= 0) {
            if (src < 0)
                c->next_src = (from + 1) % W;
            int r = take(c, from, buf, &found, deadline);
            return r < 0 ? r : from;
        }
        if (!held) {
            int r = p2p_wait(c, g, p2p_what(c, what, "recv from", src, (int64_t)tag), src,
                             deadline);
            if (r < 0)
                return r;
        }
    }
}
