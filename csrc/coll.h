/* coll.h: what the files of the shared-memory collectives share with each
 * other and with no one else: the layout of a group's region, this
 * process's handle on it, and the calls one of these files makes into
 * another.  mpcore.h is what the bindings call; internal.h what the rest of
 * the core shares.  Only the collectives' files include this header.
 *
 * The files, from the bottom up (NOTE [ Layers of the core ] in internal.h;
 * tests/csrc/test_csrc_layers.py checks that none calls a file above it):
 *   coll_kernels.c  what the core reduces, and the reduction kernels (the
 *                   one file with code for particular CPUs)
 *   coll_group.c    the region's layout, a group's life (create, attach,
 *                   watch, close), breaking it, barriers, and the start of
 *                   every collective
 *   coll_copy.c     group buffers, and copies between the ranks' memory
 *   coll_p2p.c      point to point: send and recv through the mailboxes
 *   coll.c          the collectives
 * NOTE [ Shared-memory collectives ] in coll.c says how they work. */
#ifndef MPCORE_COLL_H
#define MPCORE_COLL_H

#include "mpcore.h"

#define MPC_COLL_DATA 16384                   /* header bytes, page aligned */
#define MPC_COLL_CHECK_NS 100000000LL        /* 100 ms between looks at peers */
#define MPC_COLL_ALIGN 64
#define MPC_COLL_CMA_SPLIT (4u << 20)         /* NOTE [ A large receive copies on two threads ] */

typedef struct {
    uint32_t kind, op, dtype;
    int32_t root;
    uint64_t count;
} mpc_coll_call;

/* Where a rank's data lies when it is in a group buffer (fd < 0: not). */
typedef struct {
    int32_t fd;
    uint32_t pad;
    uint64_t uid, nbytes, offset;
} mpc_coll_ref;

typedef struct {
    _Alignas(64) _Atomic uint64_t bar; /* barriers entered (read when one times out) */
    int32_t pid;
    _Atomic uint32_t cma;  /* 1: it can copy from and into every peer */
    mpc_coll_call call[2]; /* by call parity */
    mpc_coll_ref ref[2];
    uint64_t base;         /* where this rank maps the region */
    uint64_t addr[2];      /* by call parity: its buffer, for peers to copy */
    uint64_t met[2], calls, piece; /* its mpc_coll's as it closed: for a rank that attaches
                                    * again (the barriers it entered are `bar`) */
} mpc_coll_rank;

#define MPC_COLL_COUNT_BITS 16 /* a meeting word's arrivals: more than MPC_COLL_MAX_RANKS */

/* Where the ranks meet at a barrier, one per barrier parity (NOTE [ One
 * word a meeting ] in coll_group.c). */
typedef struct {
    _Alignas(64) _Atomic uint64_t word; /* arrivals (the low MPC_COLL_COUNT_BITS), digests above */
    _Atomic uint32_t sleepers;          /* ranks asleep on word's low half */
} mpc_coll_meet;

typedef struct {
    uint64_t magic;
    uint32_t world;
    _Atomic uint32_t why_told; /* 1 once why is written (NOTE [ The reason comes before the word ]
                                * in coll_group.c) */
    uint64_t chunk, size;
    _Atomic uint32_t broken; /* 0, or 1 + the rank whose loss broke the group */
    char why[200];           /* what broke it */
    mpc_coll_meet meet[2];   /* by barrier parity */
    mpc_coll_rank ranks[MPC_COLL_MAX_RANKS];
} mpc_coll_hdr;

/* The mailbox from one rank to another: a ring of bytes.  NOTE [ Mailboxes ]
 * in coll_p2p.c. */
typedef struct {
    _Alignas(64) _Atomic uint64_t head; /* bytes the sender has put in, ever */
    _Alignas(64) _Atomic uint64_t tail; /* bytes the receiver has taken out, ever */
} mpc_coll_box;

/* A rank's doorbell: bumped (and woken) when something it may wait for in
 * a mailbox changed, or when the group broke. */
typedef struct {
    _Alignas(64) _Atomic uint32_t bell;
    _Atomic uint32_t sleepers; /* NOTE [ Wakes only for sleepers ] in sync.c */
} mpc_coll_bell;

/* Where things lie in the region of a group of `world` ranks.
 * NOTE [ Shared-memory collectives ] in coll.c. */
typedef struct {
    uint64_t sizes, boxes, bells, rings, ring, areas, size;
} mpc_coll_layout;

/* A peer's group buffer mapped here (NOTE [ Peers' buffers stay mapped ]
 * in coll_copy.c). */
typedef struct {
    int rank;
    uint64_t uid, len, used;
    uint8_t *addr;
} mpc_coll_map;

#define MPC_COLL_MAP_SETS 256 /* a mapping's set: a hash of its rank and uid */
#define MPC_COLL_MAP_WAYS 8   /* mappings a set holds, the least recently used going */
#define MPC_COLL_MAPS (MPC_COLL_MAP_SETS * MPC_COLL_MAP_WAYS)

/* A message that a recv took out of its mailbox ahead of the one it
 * wanted (NOTE [ Mailboxes ] in coll_p2p.c). */
typedef struct mpc_coll_held {
    struct mpc_coll_held *next;
    int src;
    uint32_t tag;
    uint64_t nbytes;
    uint8_t data[];
} mpc_coll_held;

struct mpc_coll {
    mpc_coll_hdr *h;
    uint64_t size, chunk;
    mpc_coll_layout at;
    int next_src;        /* where a recv from any rank looks first */
    mpc_coll_held *held; /* messages held for a later recv, oldest first */
    int rank, world;
    int pidfds[MPC_COLL_MAX_RANKS];
    uint64_t bar;   /* barriers this rank entered */
    uint64_t met[2]; /* each meeting word as its last barrier left it, by parity */
    struct {         /* the barrier between its two halves (coll_group.c's meet_add) */
        uint64_t target, want, w;
        uint64_t call_parity; /* the call's, which picks its slot (not the barrier's) */
        mpc_coll_call call;
    } meeting;
    uint64_t calls; /* collectives called */
    uint64_t piece; /* pieces moved: which copy of the areas is next */
    int (*interrupted)(void *);
    void *arg;
    int direct;         /* may copy between ranks' memory (mpc_coll_attach) */
    uint8_t *peers_tmp; /* reduce_direct's pieces of the peers' data (coll.c) */
    int label[MPC_COLL_MAX_RANKS]; /* what messages call each rank (mpc_coll_set_labels) */
    int yields;         /* sched_yield()s before sleeping in a barrier */
    int64_t spin_ns;    /* how long a wait spins before it sleeps */
    uint64_t maps_used; /* lookups in maps, for least-recently-used */
    mpc_coll_map *maps; /* MPC_COLL_MAPS, allocated at the first peer's buffer */
};

struct mpc_coll_buf {
    uint8_t *addr;
    uint64_t nbytes, uid;
    int fd;
};

/* ------------------------------------------------------------------ */
/* Where things lie in the region (NOTE [ Shared-memory collectives ]) */
/* ------------------------------------------------------------------ */

/* The bytes of one copy of the staging areas: a `chunk` per rank, and the
 * result area. */
static inline uint64_t area_bytes(int world, uint64_t chunk) {
    return (uint64_t)(world + 1) * chunk;
}

static inline uint8_t *stage(const mpc_coll *c, uint64_t parity, int rank) {
    return (uint8_t *)c->h + c->at.areas + parity * area_bytes(c->world, c->chunk) +
           (uint64_t)rank * c->chunk;
}

/* Rank q's sizes in an all-to-all of this parity: world send sizes, then
 * world recv sizes. */
static inline uint64_t *a2a_sizes(const mpc_coll *c, uint64_t parity, int q) {
    return (uint64_t *)((uint8_t *)c->h + c->at.sizes) +
           (parity * (uint64_t)c->world + (uint64_t)q) * 2 * (uint64_t)c->world;
}

/* The mailbox (and its ring) from src to dst, src != dst. */
static inline uint64_t pair_index(const mpc_coll *c, int src, int dst) {
    return (uint64_t)src * (uint64_t)(c->world - 1) + (uint64_t)(dst < src ? dst : dst - 1);
}

static inline mpc_coll_box *box(const mpc_coll *c, int src, int dst) {
    return (mpc_coll_box *)((uint8_t *)c->h + c->at.boxes) + pair_index(c, src, dst);
}

static inline uint8_t *ring(const mpc_coll *c, int src, int dst) {
    return (uint8_t *)c->h + c->at.rings + pair_index(c, src, dst) * c->at.ring;
}

static inline _Atomic uint32_t *bell(const mpc_coll *c, int q) {
    return &((mpc_coll_bell *)((uint8_t *)c->h + c->at.bells) + q)->bell;
}

static inline _Atomic uint32_t *sleepers(const mpc_coll *c, int q) {
    return &((mpc_coll_bell *)((uint8_t *)c->h + c->at.bells) + q)->sleepers;
}

static inline uint8_t *result(const mpc_coll *c, uint64_t parity) {
    return stage(c, parity, c->world);
}

/* What messages call rank q of the group (q itself when out of range). */
static inline int lbl(const mpc_coll *c, int q) {
    return q >= 0 && q < c->world ? c->label[q] : q;
}

/* 1 when every rank can copy from and into every other one (NOTE [ Copies
 * between ranks' memory ] in coll_copy.c). */
static inline int cma_all(const mpc_coll *c) {
    for (int q = 0; q < c->world; q++)
        if (!atomic_load(&c->h->ranks[q].cma))
            return 0;
    return 1;
}

/* Whether every rank of a group of more than one posted a group buffer
 * for the call of this parity (NOTE [ Group buffers ] in coll_copy.c). */
static inline int all_mapped(const mpc_coll *c, uint64_t parity) {
    int mapped = c->world > 1;
    for (int q = 0; q < c->world; q++)
        mapped &= c->h->ranks[q].ref[parity].fd >= 0;
    return mapped;
}

/* ------------------------------------------------------------------ */
/* What the core reduces, and how (coll_kernels.c)                    */
/* ------------------------------------------------------------------ */

/* Returns 0 when dtype is a known code and, when `reducing`, op a known
 * one that the core applies to that dtype (mpc_coll_reduces); -EINVAL
 * naming what is wrong otherwise. */
int mpc__coll_check_args(int dtype, int op, int reducing);

/* dst[i] = op over srcs[0..nsrc-1][i] for n elements, in that order, so
 * that every rank gets the same bits (AVG: the sum divided by nsrc;
 * float16 and bfloat16 accumulate in float32).  dst may alias any source.
 * Never fails: dtype and op were checked (mpc__coll_check_args). */
void mpc__coll_reduce(int dtype, int op, void *dst, void *const *srcs, int nsrc, size_t n);

/* ------------------------------------------------------------------ */
/* A group's life, breaking it, barriers (coll_group.c)               */
/* ------------------------------------------------------------------ */

/* The error of a broken group: -EPIPE, with the reason the rank that broke
 * it wrote (NOTE [ The reason comes before the word ] in coll_group.c). */
int mpc__coll_broken(mpc_coll *c);

/* Breaks the group on behalf of rank `who`, giving the reason (the first
 * break's reason is kept), and wakes every rank that waits at a barrier or
 * on a mailbox.  Never fails. */
void mpc__coll_break(mpc_coll *c, int who, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Looks at the peers through their pidfds and breaks the group if one
 * exited during `what` (the call, for the message).  Returns 0, or the
 * error to return (-EPIPE naming the rank). */
int mpc__coll_check_peers(mpc_coll *c, const char *what);

/* Meets every rank at the group's next barrier: spins briefly, then sleeps
 * (NOTE [ Shared-memory collectives ] in coll.c), looking at the peers
 * every MPC_COLL_CHECK_NS.  Returns 0, or, having broken the group,
 * -ETIMEDOUT naming the ranks that did not arrive by deadline (-1: none),
 * -EPIPE naming a rank that exited (or the reason of an earlier break), or
 * -EINTR when the interrupt callback said to give up. */
int mpc__coll_barrier(mpc_coll *c, const char *what, int64_t deadline);

/* Starts a collective: posts what this rank asks for, meets the others at
 * a barrier, and checks that every rank asked for the same.  Returns 0,
 * -EINVAL naming what this rank and a disagreeing one called (on every
 * rank alike), or mpc__coll_barrier's errors. */
int mpc__coll_begin(mpc_coll *c, uint32_t kind, uint32_t op, uint32_t dtype, int32_t root,
                    uint64_t count, int64_t deadline);

/* ------------------------------------------------------------------ */
/* Group buffers and copies between ranks (coll_copy.c)               */
/* ------------------------------------------------------------------ */

/* Copies n bytes between `mine` here and `theirs` in rank q's memory (into
 * q's when `into`), sharing the copy with a helper thread when `split` and
 * it is large (NOTE [ A large receive copies on two threads ] in
 * coll_copy.c).  Returns 0, or, having broken the group, -EPIPE: a peer
 * that exited is named as such, any other failure (a buffer that is not
 * there any more) names the peer and the kernel's reason. */
int mpc__coll_cma_copy(mpc_coll *c, int q, void *mine, uint64_t theirs, uint64_t n, int into,
                       int split, const char *what);

/* Where rank q's data of the call of `parity` lies in this process: in q's
 * group buffer, mapped here (NOTE [ Group buffers ] in coll_copy.c).
 * Returns NULL, having broken the group, when it cannot be mapped. */
uint8_t *mpc__coll_peer_data(mpc_coll *c, int q, uint64_t parity);

/* Posts, in this rank's words of the call's parity, where buf lies (for
 * peers that copy from or into it) and the group buffer `in` that holds
 * it, if any.  Returns 0, or -EINVAL when buf's count elements of es bytes
 * do not lie in `in`. */
int mpc__coll_post_buffer(mpc_coll *c, void *buf, uint64_t count, size_t es,
                          const mpc_coll_buf *in, uint64_t parity);

#endif /* MPCORE_COLL_H */
