/* coll.c: the collectives over shared memory for the ranks of one
 * machine: all-reduce, broadcast, barrier, all-gather, reduce-scatter,
 * reduce, gather, scatter and all-to-all.  Each chooses how its data moves
 * (staged through the region, read where it lies in group buffers, or
 * copied straight between the ranks' memory) the same way on every rank.
 * The group itself, its barriers, the kernels, the copies and point to
 * point live in the files coll.h lists; the notes that govern them are
 * there too: NOTE [ Group buffers ] and NOTE [ Copies between ranks'
 * memory ] in coll_copy.c, NOTE [ Mailboxes ] in coll_p2p.c, NOTE
 * [ Reduction kernels on each architecture ] in coll_kernels.c.
 *
 * NOTE [ Shared-memory collectives ]
 * A group is one memfd that rank 0 makes and every rank maps (the Python
 * side hands its fd around at rendezvous).  It holds, in this order:
 *   - a header: one line per rank (its pid, how many barriers it has
 *     entered, and what it asked for);
 *   - the all-to-all sizes: per call parity, each rank's `world` send and
 *     `world` recv sizes (2 * world * 2 * world words);
 *   - the mailboxes: two counter lines per ordered pair of ranks, a
 *     doorbell per rank, and a ring per ordered pair (NOTE [ Mailboxes ]
 *     in coll_p2p.c);
 *   - twice over, a staging area of `chunk` bytes per rank plus one result
 *     area.
 * A collective moves its data in pieces that fit the staging areas:
 *   - small all-reduce pieces (<= MPC_COLL_ONESHOT bytes) are one-shot:
 *     each rank copies its piece in, all meet at a barrier, and each rank
 *     reduces all the pieces into its own buffer;
 *   - larger ones are a reduce-scatter and an all-gather: rank r reduces
 *     the r-th slice of every rank's piece (its own from its own buffer)
 *     into the result area, all meet, and each rank copies out the slices
 *     the others reduced;
 *   - broadcast, all-gather and reduce-scatter take one barrier a piece;
 *   - reduce is all-reduce's scheme with only the root keeping the result:
 *     small pieces the root reduces alone, larger ones rank r reduces slice
 *     r (the root's straight into its buffer, the others' into the result
 *     area, which the root copies out after a second barrier);
 *   - gather and scatter take one barrier a piece: the ranks stage their
 *     pieces and the root copies them out, or the root stages rank q's
 *     piece in rank q's area and each rank copies out its own;
 *   - all-to-all posts each rank's send and recv sizes beside its call, and
 *     after the first barrier every rank checks every pair (rank i's send
 *     size to j against j's recv size from i), so a mismatch fails
 *     everywhere alike, naming i, j and both sizes.  Each rank's staging
 *     area is cut into a slot per peer (chunk / (world - 1) bytes, whole
 *     64-byte lines); round k moves bytes k*slot.. of every pair, one
 *     barrier a round, until the largest pair is done.  A rank's piece for
 *     itself is copied directly.  Every rank knows every size, so all agree
 *     on the number of rounds without another word.
 * Pieces alternate between the two copies of the areas, so a rank may
 * write the next piece while a slower one still reads this one: the
 * barrier of the piece in between keeps them from meeting.  Every rank
 * reduces in rank order, so all ranks get the same bits.  float16 and
 * bfloat16 accumulate in float32.
 *
 * A barrier: each rank adds itself to one shared word, and whoever brings
 * its count to the group's size wakes the sleepers (NOTE [ One word a
 * meeting ] in coll_group.c).  Waiting spins briefly, then sleeps on that
 * word (sync.c), because with more ranks than cores a spinning rank only
 * delays the one it waits for.
 * Every MPC_COLL_CHECK_NS of waiting a rank looks at its peers through
 * pidfds: a peer that exited breaks the group, and every rank then fails
 * with a message naming it instead of waiting forever.  What each rank
 * asked for is compared at the first barrier of each call, so calls that
 * differ in kind, size, dtype, op or root fail on every rank alike. */
#include "coll.h"

#include <string.h>

#define MPC_COLL_ONESHOT (64u << 10)
#define MPC_COLL_AR_PIECE (256u << 10)       /* all-reduce piece: staged, it stays in cache */
#define MPC_COLL_MAPPED_PIECE (64u << 10)    /* see reduce_mapped() */
#define MPC_COLL_CMA_MIN (256u << 10)         /* NOTE [ Copies between ranks' memory ] */
#define MPC_COLL_CMA_AR_MIN (1u << 20)        /* (all-)reduce bytes to copy directly */
#define MPC_COLL_ROOT_SHARE 4                 /* NOTE [ The root of two takes a share ] */

/* ------------------------------------------------------------------ */
/* Pieces and slices                                                  */
/* ------------------------------------------------------------------ */

/* Splits n elements of es bytes into W slices of whole 64-byte units:
 * slice q is elements lo[q] .. lo[q + 1] - 1. */
static void slices(uint64_t n, size_t es, int W, uint64_t lo[]) {
    uint64_t unit = MPC_COLL_ALIGN / es, units = (n + unit - 1) / unit;
    for (int q = 0; q <= W; q++) {
        lo[q] = units * (uint64_t)q / (uint64_t)W * unit;
        if (lo[q] > n)
            lo[q] = n;
    }
}

/* Elements per piece: what fits `room` bytes, a multiple of 64 bytes. */
static uint64_t piece_elems(uint64_t room, size_t es) {
    uint64_t n = room / es;
    uint64_t unit = MPC_COLL_ALIGN / es;
    return n >= unit ? n / unit * unit : n;
}

/* ------------------------------------------------------------------ */
/* Reductions straight between the ranks' memory                      */
/* ------------------------------------------------------------------ */

/* The all-reduce (root < 0) or reduce when every rank's data lies in a
 * group buffer: rank r reduces slice r straight from every rank's buffer
 * and writes the result into every rank's buffer, or into the root's only;
 * a barrier closes the call.  Each rank reads and writes the size of the
 * data once, and nothing is staged.  NOTE [ Group buffers ]. */
static int reduce_mapped(mpc_coll *c, uint8_t *mine, uint64_t count, int dtype, int op, int root,
                         uint64_t parity, int64_t deadline) {
    int W = c->world;
    const char *what = root < 0 ? "all_reduce" : "reduce";
    size_t es = mpc_coll_dtype_size(dtype);
    uint8_t *bufs[MPC_COLL_MAX_RANKS];
    void *srcs[MPC_COLL_MAX_RANKS];
    for (int q = 0; q < W; q++)
        if ((bufs[q] = q == c->rank ? mine : mpc__coll_peer_data(c, q, parity)) == NULL)
            return mpc__coll_broken(c);
    uint64_t unit = MPC_COLL_ALIGN / es, units = (count + unit - 1) / unit;
    uint64_t a = units * (uint64_t)c->rank / (uint64_t)W * unit;
    uint64_t b = units * (uint64_t)(c->rank + 1) / (uint64_t)W * unit;
    if (b > count)
        b = count;
    if (a > b)
        a = b;
    /* A piece at a time, so that the result is still in cache when it is
     * copied to the peers.  A reduce writes its slice into the root's
     * buffer straight away (each element is read before it is written). */
    uint8_t *out = root < 0 ? mine : bufs[root];
    uint64_t per = piece_elems(MPC_COLL_MAPPED_PIECE, es);
    for (uint64_t off = a; off < b; off += per) {
        uint64_t n = b - off < per ? b - off : per;
        for (int q = 0; q < W; q++)
            srcs[q] = bufs[q] + off * es;
        mpc__coll_reduce(dtype, op, out + off * es, srcs, W, n);
        for (int q = 0; q < W && root < 0; q++)
            if (q != c->rank)
                memcpy(bufs[q] + off * es, mine + off * es, n * es);
    }
    return mpc__coll_barrier(c, what, deadline);
}

/* The all-reduce (root < 0) or reduce of a large buf when every rank can
 * copy from and into the others (NOTE [ Copies between ranks' memory ]):
 * as reduce_mapped, rank r reduces slice r, a piece at a time, reading
 * the peers' pieces into memory of its own, and writes the result into
 * every peer's buf, or into the root's only.  A reduce leaves the buf of a
 * rank other than the root as it was: such a rank reduces into memory of
 * its own. */
static int reduce_direct(mpc_coll *c, uint8_t *mine, uint64_t count, int dtype, int op, int root,
                         uint64_t parity, int64_t deadline) {
    int W = c->world, me = c->rank;
    const char *what = root < 0 ? "all_reduce" : "reduce";
    size_t es = mpc_coll_dtype_size(dtype);
    uint64_t per = piece_elems(MPC_COLL_AR_PIECE, es);
    if (c->peers_tmp == NULL &&
        (c->peers_tmp = malloc((size_t)W * per * es)) == NULL) {
        mpc__coll_break(c, me, "rank %d has no memory for a %s's pieces", lbl(c, me), what);
        return mpc__coll_broken(c);
    }
    uint64_t lo[MPC_COLL_MAX_RANKS + 1];
    slices(count, es, W, lo);
    void *srcs[MPC_COLL_MAX_RANKS];
    int r;
    for (uint64_t off = lo[me]; off < lo[me + 1]; off += per) {
        uint64_t n = lo[me + 1] - off < per ? lo[me + 1] - off : per;
        for (int q = 0; q < W; q++) {
            srcs[q] = q == me ? mine + off * es : c->peers_tmp + (uint64_t)q * per * es;
            uint64_t at = c->h->ranks[q].addr[parity] + off * es;
            if (q != me && (r = mpc__coll_cma_copy(c, q, srcs[q], at, n * es, 0, 0, what)) < 0)
                return r;
        }
        /* peers_tmp's piece of this rank is free: srcs[me] is in buf */
        uint8_t *out = root < 0 || me == root ? mine + off * es
                                              : c->peers_tmp + (uint64_t)me * per * es;
        mpc__coll_reduce(dtype, op, out, srcs, W, n);
        for (int q = 0; q < W; q++) {
            uint64_t at = c->h->ranks[q].addr[parity] + off * es;
            if (q != me && (root < 0 || q == root) &&
                (r = mpc__coll_cma_copy(c, q, out, at, n * es, 1, 0, what)) < 0)
                return r;
        }
    }
    return mpc__coll_barrier(c, what, deadline);
}

/* ------------------------------------------------------------------ */
/* All-reduce, broadcast, barrier                                     */
/* ------------------------------------------------------------------ */

int mpc_coll_all_reduce(mpc_coll *c, void *buf, uint64_t count, int dtype, int op,
                        const mpc_coll_buf *in, int64_t deadline) {
    int r = mpc__coll_check_args(dtype, op, 1);
    if (r < 0)
        return r;
    size_t es = mpc_coll_dtype_size(dtype);
    uint64_t parity = c->calls & 1;
    if ((r = mpc__coll_post_buffer(c, buf, count, es, in, parity)) < 0 ||
        (r = mpc__coll_begin(c, MPC_COLL_ALL_REDUCE, (uint32_t)op, (uint32_t)dtype, 0, count,
                             deadline)) < 0)
        return r;
    int W = c->world;
    if (all_mapped(c, parity))
        return reduce_mapped(c, buf, count, dtype, op, -1, parity, deadline);
    if (W > 1 && count * es >= MPC_COLL_CMA_AR_MIN && cma_all(c))
        return reduce_direct(c, buf, count, dtype, op, -1, parity, deadline);
    void *srcs[MPC_COLL_MAX_RANKS];
    uint64_t per = piece_elems(c->chunk < MPC_COLL_AR_PIECE ? c->chunk : MPC_COLL_AR_PIECE, es);
    for (uint64_t off = 0; off < count; off += per) {
        uint64_t n = count - off < per ? count - off : per;
        uint8_t *mine = (uint8_t *)buf + off * es;
        uint64_t p = c->piece++ & 1;
        if (n * es <= MPC_COLL_ONESHOT || W == 1) {
            memcpy(stage(c, p, c->rank), mine, n * es);
            if ((r = mpc__coll_barrier(c, "all_reduce", deadline)) < 0)
                return r;
            for (int q = 0; q < W; q++)
                srcs[q] = stage(c, p, q);
            mpc__coll_reduce(dtype, op, mine, srcs, W, n);
            continue;
        }
        /* Reduce-scatter, then all-gather.  Rank q reduces slice q (whole
         * 64-byte units), so each rank stages only the slices the others
         * reduce, reads its own slice from its own buffer, and copies back
         * only the slices the others reduced. */
        uint64_t lo[MPC_COLL_MAX_RANKS + 1];
        slices(n, es, W, lo);
        uint8_t *st = stage(c, p, c->rank), *res = result(c, p);
        uint64_t a = lo[c->rank], b = lo[c->rank + 1];
        memcpy(st, mine, a * es);
        memcpy(st + b * es, mine + b * es, (n - b) * es);
        if ((r = mpc__coll_barrier(c, "all_reduce", deadline)) < 0)
            return r;
        if (a < b) {
            for (int q = 0; q < W; q++)
                srcs[q] = (q == c->rank ? mine : stage(c, p, q)) + a * es;
            mpc__coll_reduce(dtype, op, res + a * es, srcs, W, b - a);
            memcpy(mine + a * es, res + a * es, (b - a) * es);
        }
        if ((r = mpc__coll_barrier(c, "all_reduce", deadline)) < 0)
            return r;
        memcpy(mine, res, a * es);
        memcpy(mine + b * es, res + b * es, (n - b) * es);
    }
    return 0;
}

/* NOTE [ A large broadcast between two copies once ]
 * Staged, a broadcast moves every byte twice, the root's copy into the
 * region and each peer's out of it, chunk by chunk with a barrier each.
 * Between two ranks that may copy between their memory (NOTE [ Copies
 * between ranks' memory ] in coll_copy.c), a large one (MPC_COLL_CMA_MIN
 * bytes or more) copies once: the peer reads the first half of the root's
 * buffer into its own, and the root, which has nothing of its own to
 * copy, writes the second half into the peer's.  Each posts its buffer's
 * address with its call, and a barrier after the copies keeps the root's
 * buffer unchanged until both are done.  Measured, the core's broadcast
 * on two ranks, roots alternating (best of 5 runs, staged / direct):
 * 256 KB 44 / 24-25 us, 1 MB 202-212 / 79-90 us, 4 MB 505-601 / 371-420
 * us, 16 MB 1.69-1.83 / 1.25-1.28 ms.  With more ranks the peers read the
 * root's memory once each, where staged they read a chunk the root just
 * wrote, from the cache: four ranks on two cores took longer direct
 * (256 KB 81 us against 47-53, 4 MB 1.36 ms against 1.04-1.08), and more
 * ranks with cores of their own were not measured, so they stage. */
static int broadcast_pair(mpc_coll *c, void *buf, uint64_t nbytes, int root, uint64_t parity,
                          int64_t deadline) {
    int peer = 1 - c->rank;
    uint64_t half = (nbytes / 2) & ~(uint64_t)4095;
    uint64_t theirs = c->h->ranks[peer].addr[parity];
    int r = c->rank == root
                ? mpc__coll_cma_copy(c, peer, (uint8_t *)buf + half, theirs + half, nbytes - half,
                                     1, 0, "broadcast")
                : mpc__coll_cma_copy(c, peer, buf, theirs, half, 0, 0, "broadcast");
    if (r < 0)
        return r;
    return mpc__coll_barrier(c, "broadcast", deadline);
}

int mpc_coll_broadcast(mpc_coll *c, void *buf, uint64_t nbytes, int root, int64_t deadline) {
    if (root < 0 || root >= c->world)
        return mpc_fail(EINVAL, "root %d is not a rank of this group of %d", root, c->world);
    uint64_t parity = c->calls & 1;
    c->h->ranks[c->rank].addr[parity] = (uint64_t)(uintptr_t)buf;
    int r = mpc__coll_begin(c, MPC_COLL_BROADCAST, 0, MPC_DT_U8, root, nbytes, deadline);
    if (r < 0)
        return r;
    if (c->world == 2 && nbytes >= MPC_COLL_CMA_MIN && cma_all(c))
        return broadcast_pair(c, buf, nbytes, root, parity, deadline);
    for (uint64_t off = 0; off < nbytes; off += c->chunk) {
        uint64_t n = nbytes - off < c->chunk ? nbytes - off : c->chunk;
        uint64_t p = c->piece++ & 1;
        if (c->rank == root)
            memcpy(stage(c, p, 0), (uint8_t *)buf + off, n);
        if ((r = mpc__coll_barrier(c, "broadcast", deadline)) < 0)
            return r;
        if (c->rank != root)
            memcpy((uint8_t *)buf + off, stage(c, p, 0), n);
    }
    return 0;
}

int mpc_coll_barrier(mpc_coll *c, int64_t deadline) {
    int r = mpc_coll_barrier_start(c, 0);
    return r != 0 ? (r < 0 ? r : 0) : mpc_coll_barrier_end(c, deadline);
}

/* ------------------------------------------------------------------ */
/* All-gather and reduce-scatter                                      */
/* ------------------------------------------------------------------ */

/* Copies a rank's own piece of a data mover, n bytes from src to dst,
 * which may overlap (a caller may pass one tensor as both): apart, as
 * mpc_copy does, so a large piece goes around the cache (NOTE [ Large
 * copies go around the cache ] in util.c). */
static void copy_own(void *dst, const void *src, uint64_t n) {
    const uint8_t *d = dst, *s = src;
    if (d + n <= s || s + n <= d)
        mpc_copy(dst, src, n);
    else if (d != s)
        memmove(dst, src, n);
}

/* Whether n bytes at a and m bytes at b share a byte. */
static int overlap(const void *a, uint64_t n, const void *b, uint64_t m) {
    const uint8_t *x = a, *y = b;
    return n > 0 && m > 0 && x < y + m && y < x + n;
}

/* NOTE [ Movers write where no one reads ]
 * all_gather and reduce_scatter read the input while they write the
 * output: a piece at a time when staged, and, from group buffers (NOTE
 * [ Group buffers ]), while the peers read it where it lies.  An output
 * that overlaps the rank's own input anywhere but where an in-place call
 * puts it (all_gather: the input is this rank's part of the output;
 * reduce_scatter: the output is this rank's slice of the input, which no
 * peer reads) would change input not read yet, by this rank or by a slower
 * peer.  Such a rank writes into memory of its own, copied into out at the
 * end (after the last barrier, when peers read the input).  Sets *to, where
 * to write: out, or new memory in *tmp for the caller to free (end_apart).
 * Returns 0, or the error of the group it broke when there is no memory for
 * it.  out may be NULL (an empty tensor's data), so the address alone
 * cannot say which. */
static int write_apart(mpc_coll *c, void *out, uint64_t outn, const void *in, uint64_t inn,
                       int in_place, uint8_t **to, void **tmp, const char *what) {
    *tmp = NULL;
    *to = out;
    if (in_place || !overlap(out, outn, in, inn))
        return 0;
    if ((*tmp = malloc(outn)) == NULL) {
        mpc__coll_break(c, c->rank, "rank %d has no memory for its %s's result", lbl(c, c->rank),
                        what);
        return mpc__coll_broken(c);
    }
    *to = *tmp;
    return 0;
}

/* Ends an all_gather or reduce_scatter that returned r so far: after the
 * barrier that frees the peers' reads of the input when `mapped`, the
 * result written apart (NOTE [ Movers write where no one reads ]) is
 * copied into out. */
static int end_apart(mpc_coll *c, int r, int mapped, void *out, void *tmp, uint64_t n,
                     const char *what, int64_t deadline) {
    if (r == 0 && mapped)
        r = mpc__coll_barrier(c, what, deadline);
    if (r == 0 && tmp != NULL)
        memcpy(out, tmp, n);
    free(tmp);
    return r;
}

int mpc_coll_all_gather(mpc_coll *c, void *out, const void *in, uint64_t nbytes,
                        const mpc_coll_buf *in_buf, int64_t deadline) {
    int W = c->world, me = c->rank;
    uint64_t parity = c->calls & 1;
    int r = mpc__coll_post_buffer(c, (void *)in, nbytes, 1, in_buf, parity);
    if (r < 0 ||
        (r = mpc__coll_begin(c, MPC_COLL_ALL_GATHER, 0, MPC_DT_U8, 0, nbytes, deadline)) < 0)
        return r;
    if (nbytes == 0) /* every rank asked for none (begin compared): an empty tensor's NULL */
        return 0;
    int in_place = (const uint8_t *)in == (uint8_t *)out + me * nbytes;
    int mapped = all_mapped(c, parity);
    void *tmp;
    uint8_t *to;
    if ((r = write_apart(c, out, W * nbytes, in, nbytes, in_place, &to, &tmp, "all_gather")) < 0)
        return r;
    if (!in_place)
        copy_own(to + me * nbytes, in, nbytes);
    if (mapped) {
        /* NOTE [ Group buffers ]: rank q's part, read where it lies */
        for (int k = 1; k < W && r == 0; k++) {
            int q = (me + k) % W;
            const uint8_t *at = mpc__coll_peer_data(c, q, parity);
            if (at == NULL)
                r = mpc__coll_broken(c);
            else
                mpc_copy(to + (uint64_t)q * nbytes, at, nbytes);
        }
        return end_apart(c, r, 1, out, tmp, W * nbytes, "all_gather", deadline);
    }
    /* Staged, a chunk at a time (a rank's own part came from in above) */
    for (uint64_t off = 0; off < nbytes && r == 0; off += c->chunk) {
        uint64_t n = nbytes - off < c->chunk ? nbytes - off : c->chunk;
        uint64_t p = c->piece++ & 1;
        memcpy(stage(c, p, me), (const uint8_t *)in + off, n);
        if ((r = mpc__coll_barrier(c, "all_gather", deadline)) < 0)
            break;
        for (int q = 0; q < W; q++)
            if (q != me)
                memcpy(to + (uint64_t)q * nbytes + off, stage(c, p, q), n);
    }
    return end_apart(c, r, 0, out, tmp, W * nbytes, "all_gather", deadline);
}

int mpc_coll_reduce_scatter(mpc_coll *c, void *out, const void *in, uint64_t count, int dtype,
                            int op, const mpc_coll_buf *in_buf, int64_t deadline) {
    int r = mpc__coll_check_args(dtype, op, 1);
    if (r < 0)
        return r;
    size_t es = mpc_coll_dtype_size(dtype);
    int W = c->world, me = c->rank;
    uint64_t parity = c->calls & 1;
    if ((r = mpc__coll_post_buffer(c, (void *)in, W * count, es, in_buf, parity)) < 0 ||
        (r = mpc__coll_begin(c, MPC_COLL_REDUCE_SCATTER, (uint32_t)op, (uint32_t)dtype, 0, count,
                             deadline)) < 0)
        return r;
    if (count == 0) /* as all_gather's */
        return 0;
    const uint8_t *mine = (const uint8_t *)in + (uint64_t)me * count * es;
    void *tmp;
    uint8_t *to;
    if ((r = write_apart(c, out, count * es, in, W * count * es, (uint8_t *)out == mine, &to,
                         &tmp, "reduce_scatter")) < 0)
        return r;
    void *srcs[MPC_COLL_MAX_RANKS];
    if (all_mapped(c, parity)) {
        /* NOTE [ Group buffers ]: this rank's slice, reduced from every
         * rank's input where it lies, a piece at a time */
        const uint8_t *ins[MPC_COLL_MAX_RANKS];
        for (int q = 0; q < W && r == 0; q++)
            if ((ins[q] = q == me ? mine : mpc__coll_peer_data(c, q, parity)) == NULL)
                r = mpc__coll_broken(c);
            else if (q != me)
                ins[q] += (uint64_t)me * count * es;
        uint64_t per = piece_elems(MPC_COLL_MAPPED_PIECE, es);
        for (uint64_t off = 0; off < count && r == 0; off += per) {
            for (int q = 0; q < W; q++)
                srcs[q] = (void *)(ins[q] + off * es);
            mpc__coll_reduce(dtype, op, to + off * es, srcs, W,
                             count - off < per ? count - off : per);
        }
        return end_apart(c, r, 1, out, tmp, count * es, "reduce_scatter", deadline);
    }
    /* Staged, a piece at a time: a rank stages only the peers' slices and
     * reads its own from in */
    uint64_t per = piece_elems(c->chunk / (uint64_t)W, es);
    if (per == 0)
        per = 1;
    for (uint64_t off = 0; off < count && r == 0; off += per) {
        uint64_t n = count - off < per ? count - off : per;
        uint64_t p = c->piece++ & 1;
        uint8_t *st = stage(c, p, me);
        for (int q = 0; q < W; q++) /* this rank's input for rank q's output */
            if (q != me)
                memcpy(st + (uint64_t)q * n * es,
                       (const uint8_t *)in + ((uint64_t)q * count + off) * es, n * es);
        if ((r = mpc__coll_barrier(c, "reduce_scatter", deadline)) < 0)
            break;
        for (int q = 0; q < W; q++)
            srcs[q] = q == me ? (void *)(mine + off * es) : stage(c, p, q) + (uint64_t)me * n * es;
        mpc__coll_reduce(dtype, op, to + off * es, srcs, W, n);
    }
    return end_apart(c, r, 0, out, tmp, count * es, "reduce_scatter", deadline);
}

/* ------------------------------------------------------------------ */
/* Reduce                                                             */
/* ------------------------------------------------------------------ */

int mpc_coll_reduce(mpc_coll *c, void *buf, uint64_t count, int dtype, int op, int root,
                    const mpc_coll_buf *in, int64_t deadline) {
    int r = mpc__coll_check_args(dtype, op, 1);
    if (r < 0)
        return r;
    if (root < 0 || root >= c->world)
        return mpc_fail(EINVAL, "root %d is not a rank of this group of %d", root, c->world);
    size_t es = mpc_coll_dtype_size(dtype);
    uint64_t parity = c->calls & 1;
    if ((r = mpc__coll_post_buffer(c, buf, count, es, in, parity)) < 0 ||
        (r = mpc__coll_begin(c, MPC_COLL_REDUCE, (uint32_t)op, (uint32_t)dtype, root, count,
                             deadline)) < 0)
        return r;
    int W = c->world, me = c->rank;
    if (all_mapped(c, parity))
        return reduce_mapped(c, buf, count, dtype, op, root, parity, deadline);
    if (W > 1 && count * es >= MPC_COLL_CMA_AR_MIN && cma_all(c))
        return reduce_direct(c, buf, count, dtype, op, root, parity, deadline);
    void *srcs[MPC_COLL_MAX_RANKS];
    uint64_t per = piece_elems(c->chunk < MPC_COLL_AR_PIECE ? c->chunk : MPC_COLL_AR_PIECE, es);
    for (uint64_t off = 0; off < count; off += per) {
        uint64_t n = count - off < per ? count - off : per;
        uint8_t *mine = (uint8_t *)buf + off * es;
        uint64_t p = c->piece++ & 1;
        if (n * es <= MPC_COLL_ONESHOT || W == 1) {
            /* the root reduces the whole piece */
            if (me != root)
                memcpy(stage(c, p, me), mine, n * es);
            if ((r = mpc__coll_barrier(c, "reduce", deadline)) < 0)
                return r;
            if (me == root) {
                for (int q = 0; q < W; q++)
                    srcs[q] = q == me ? mine : stage(c, p, q);
                mpc__coll_reduce(dtype, op, mine, srcs, W, n);
            }
            continue;
        }
        /* Rank q reduces slice q, as all_reduce does; the root's slice goes
         * straight into its buffer, the others' into the result area, which
         * the root copies out after the second barrier. */
        uint64_t lo[MPC_COLL_MAX_RANKS + 1];
        slices(n, es, W, lo);
        uint8_t *st = stage(c, p, me), *res = result(c, p);
        uint64_t a = lo[me], b = lo[me + 1];
        memcpy(st, mine, a * es);
        memcpy(st + b * es, mine + b * es, (n - b) * es);
        if ((r = mpc__coll_barrier(c, "reduce", deadline)) < 0)
            return r;
        if (a < b) {
            for (int q = 0; q < W; q++)
                srcs[q] = (q == me ? mine : stage(c, p, q)) + a * es;
            mpc__coll_reduce(dtype, op, (me == root ? mine : res) + a * es, srcs, W, b - a);
        }
        if ((r = mpc__coll_barrier(c, "reduce", deadline)) < 0)
            return r;
        if (me == root) {
            memcpy(mine, res, a * es);
            memcpy(mine + b * es, res + b * es, (n - b) * es);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Gather and scatter                                                 */
/* ------------------------------------------------------------------ */

static int check_root_size(const mpc_coll *c, int root, uint64_t nbytes) {
    if (root < 0 || root >= c->world)
        return mpc_fail(EINVAL, "root %d is not a rank of this group of %d", root, c->world);
    if (nbytes > UINT64_MAX / (uint64_t)c->world)
        return mpc_fail(EINVAL, "%llu bytes per rank is too large", (unsigned long long)nbytes);
    return 0;
}

/* NOTE [ The root of two takes a share ]
 * In a large gather or scatter between ranks' memory, each peer copies its
 * own piece from or to the root's buffer, while the root copies only its
 * own piece, in this process: with two ranks, the peer's copy through the
 * kernel (page pinning included) is the call's whole length, and the
 * root's core idles for half of it.  So the root of two also moves the
 * last 1/MPC_COLL_ROOT_SHARE of the peer's piece, through the same system
 * calls in the other direction, into or from the peer's buffer (every
 * rank posts its buffer's address before the call).  Measured on two
 * cores, a scatter of 2 x 8 MB in the core: 0.59-0.68 ms with the peer
 * alone, 0.54-0.65 ms with the root taking a quarter, 0.55-0.66 ms a
 * third, and 0.74-0.76 ms a half; through torch's dist.scatter, 0.79 ms
 * before and 0.49 ms after.  With more ranks, the root's time is already
 * longer than a peer's. */
static uint64_t root_share(const mpc_coll *c, uint64_t nbytes) {
    return c->world == 2 && nbytes >= MPC_COLL_CMA_SPLIT
               ? (nbytes / MPC_COLL_ROOT_SHARE) & ~(uint64_t)4095 : 0;
}

/* The root posts its `world` buffers' addresses (one per rank) in its words
 * of the call's parity, where peers copy to or from them. */
static void post_addresses(mpc_coll *c, const void *const *bufs) {
    uint64_t *mine = a2a_sizes(c, c->calls & 1, c->rank);
    for (int q = 0; q < c->world; q++)
        mine[q] = (uint64_t)(uintptr_t)bufs[q];
}

int mpc_coll_gather(mpc_coll *c, void *const *outs, const void *in, uint64_t nbytes, int root,
                    int64_t deadline) {
    int r = check_root_size(c, root, nbytes);
    int me = c->rank;
    uint64_t parity = c->calls & 1;
    if (r == 0 && me == root)
        post_addresses(c, (const void *const *)outs);
    c->h->ranks[me].addr[parity] = (uint64_t)(uintptr_t)in;
    if (r < 0 ||
        (r = mpc__coll_begin(c, MPC_COLL_GATHER, 0, MPC_DT_U8, root, nbytes, deadline)) < 0)
        return r;
    if (me == root)
        copy_own(outs[me], in, nbytes);
    if (nbytes >= MPC_COLL_CMA_MIN && cma_all(c)) {
        uint64_t tail = root_share(c, nbytes), to = a2a_sizes(c, parity, root)[me];
        if (me != root)
            r = mpc__coll_cma_copy(c, root, (void *)in, to, nbytes - tail, 1, 0, "gather");
        else if (tail > 0)
            r = mpc__coll_cma_copy(c, 1 - me, (uint8_t *)outs[1 - me] + (nbytes - tail),
                                   c->h->ranks[1 - me].addr[parity] + (nbytes - tail), tail,
                                   0, 0, "gather");
        if (r < 0)
            return r;
        return mpc__coll_barrier(c, "gather", deadline);
    }
    for (uint64_t off = 0; off < nbytes; off += c->chunk) {
        uint64_t n = nbytes - off < c->chunk ? nbytes - off : c->chunk;
        uint64_t p = c->piece++ & 1;
        if (me != root)
            memcpy(stage(c, p, me), (const uint8_t *)in + off, n);
        if ((r = mpc__coll_barrier(c, "gather", deadline)) < 0)
            return r;
        if (me == root)
            for (int q = 0; q < c->world; q++)
                if (q != me)
                    memcpy((uint8_t *)outs[q] + off, stage(c, p, q), n);
    }
    return 0;
}

int mpc_coll_scatter(mpc_coll *c, void *out, const void *const *ins, uint64_t nbytes, int root,
                     int64_t deadline) {
    int r = check_root_size(c, root, nbytes);
    int me = c->rank;
    uint64_t parity = c->calls & 1;
    if (r == 0 && me == root)
        post_addresses(c, ins);
    c->h->ranks[me].addr[parity] = (uint64_t)(uintptr_t)out;
    if (r < 0 ||
        (r = mpc__coll_begin(c, MPC_COLL_SCATTER, 0, MPC_DT_U8, root, nbytes, deadline)) < 0)
        return r;
    if (me == root)
        copy_own(out, ins[me], nbytes);
    if (nbytes >= MPC_COLL_CMA_MIN && cma_all(c)) {
        uint64_t tail = root_share(c, nbytes), from = a2a_sizes(c, parity, root)[me];
        if (me != root)
            r = mpc__coll_cma_copy(c, root, out, from, nbytes - tail, 0, 0, "scatter");
        else if (tail > 0)
            r = mpc__coll_cma_copy(c, 1 - me, (uint8_t *)ins[1 - me] + (nbytes - tail),
                                   c->h->ranks[1 - me].addr[parity] + (nbytes - tail), tail,
                                   1, 0, "scatter");
        if (r < 0)
            return r;
        return mpc__coll_barrier(c, "scatter", deadline);
    }
    for (uint64_t off = 0; off < nbytes; off += c->chunk) {
        uint64_t n = nbytes - off < c->chunk ? nbytes - off : c->chunk;
        uint64_t p = c->piece++ & 1;
        if (me == root) /* rank q's slice goes into rank q's staging area */
            for (int q = 0; q < c->world; q++)
                if (q != me)
                    memcpy(stage(c, p, q), (const uint8_t *)ins[q] + off, n);
        if ((r = mpc__coll_barrier(c, "scatter", deadline)) < 0)
            return r;
        if (me != root)
            memcpy((uint8_t *)out + off, stage(c, p, me), n);
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* All-to-all                                                         */
/* ------------------------------------------------------------------ */

int mpc_coll_all_to_all(mpc_coll *c, void *out, const void *in, const uint64_t *send,
                        const uint64_t *recv, const mpc_coll_buf *in_buf, int64_t deadline) {
    int W = c->world, me = c->rank;
    uint64_t parity = c->calls & 1, sent = 0;
    uint64_t *mine = a2a_sizes(c, parity, me);
    memcpy(mine, send, (size_t)W * sizeof *send);
    memcpy(mine + W, recv, (size_t)W * sizeof *recv);
    for (int q = 0; q < W; q++)
        sent += send[q];
    int r = mpc__coll_post_buffer(c, (void *)in, sent, 1, in_buf, parity);
    if (r < 0 || (r = mpc__coll_begin(c, MPC_COLL_ALL_TO_ALL, 0, MPC_DT_U8, 0, 0, deadline)) < 0)
        return r;
    /* Every rank checks every pair against the sizes all posted, so a
     * mismatch fails everywhere alike. */
    uint64_t most = 0;
    for (int i = 0; i < W; i++)
        for (int j = 0; j < W; j++) {
            uint64_t s = a2a_sizes(c, parity, i)[j], t = a2a_sizes(c, parity, j)[W + i];
            if (s != t)
                return mpc_fail(EINVAL, "ranks disagree in all_to_all: rank %d sends %llu bytes "
                                        "to rank %d, which expects %llu bytes from rank %d",
                                lbl(c, i), (unsigned long long)s, lbl(c, j),
                                (unsigned long long)t, lbl(c, i));
            if (i != j && s > most)
                most = s;
        }
    uint64_t soff[MPC_COLL_MAX_RANKS] = {0}, roff[MPC_COLL_MAX_RANKS] = {0}, at_s = 0, at_r = 0;
    for (int q = 0; q < W; q++) {
        soff[q] = at_s;
        roff[q] = at_r;
        at_s += send[q];
        at_r += recv[q];
    }
    if (send[me] > 0)
        copy_own((uint8_t *)out + roff[me], (const uint8_t *)in + soff[me], send[me]);
    if (W == 1 || most == 0)
        return 0;
    if (all_mapped(c, parity)) {
        /* NOTE [ Group buffers ]: rank i's piece for me, read where it lies */
        for (int k = 1; k < W; k++) {
            int i = (me + k) % W;
            if (recv[i] == 0)
                continue;
            const uint64_t *theirs = a2a_sizes(c, parity, i);
            uint8_t *at = mpc__coll_peer_data(c, i, parity);
            if (at == NULL)
                return mpc__coll_broken(c);
            for (int q = 0; q < me; q++)
                at += theirs[q];
            mpc_copy((uint8_t *)out + roff[i], at, recv[i]);
        }
        return mpc__coll_barrier(c, "all_to_all", deadline);
    }
    if (most >= MPC_COLL_CMA_MIN && cma_all(c)) {
        /* read rank i's piece for me from its input: it starts after its
         * pieces for ranks 0 .. me-1 */
        for (int k = 1; k < W; k++) {
            int i = (me + k) % W;
            const uint64_t *theirs = a2a_sizes(c, parity, i);
            uint64_t at = c->h->ranks[i].addr[parity];
            for (int q = 0; q < me; q++)
                at += theirs[q];
            if (recv[i] > 0 &&
                (r = mpc__coll_cma_copy(c, i, (uint8_t *)out + roff[i], at, recv[i], 0, 0,
                                        "all_to_all")) < 0)
                return r;
        }
        return mpc__coll_barrier(c, "all_to_all", deadline);
    }
    /* Rounds: each rank's staging area holds a slot per peer, and round k
     * moves bytes k*slot.. of every pair.  The sender's slot for dst is
     * (dst - src - 1) mod world. */
    uint64_t slot = c->chunk / (uint64_t)(W - 1) / MPC_COLL_ALIGN * MPC_COLL_ALIGN;
    if (slot == 0)
        slot = c->chunk / (uint64_t)(W - 1);
    for (uint64_t off = 0; off < most; off += slot) {
        uint64_t p = c->piece++ & 1;
        uint8_t *st = stage(c, p, me);
        for (int j = 0; j < W; j++)
            if (j != me && off < send[j]) {
                uint64_t n = send[j] - off < slot ? send[j] - off : slot;
                memcpy(st + (uint64_t)((j - me - 1 + W) % W) * slot,
                       (const uint8_t *)in + soff[j] + off, n);
            }
        if ((r = mpc__coll_barrier(c, "all_to_all", deadline)) < 0)
            return r;
        for (int i = 0; i < W; i++)
            if (i != me && off < recv[i]) {
                uint64_t n = recv[i] - off < slot ? recv[i] - off : slot;
                memcpy((uint8_t *)out + roff[i] + off,
                       stage(c, p, i) + (uint64_t)((me - i - 1 + W) % W) * slot, n);
            }
    }
    return 0;
}

