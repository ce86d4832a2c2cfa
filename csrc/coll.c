/* coll.c: collectives over shared memory for the ranks of one machine:
 * all-reduce, broadcast, barrier, all-gather, reduce-scatter, reduce,
 * gather, scatter, all-to-all, and point-to-point send and recv, with the
 * reductions vectorised for the CPU found at run time.
 *
 * NOTE [ Shared-memory collectives ]
 * A group is one memfd that rank 0 makes and every rank maps (the Python
 * side hands its fd around at rendezvous).  It holds, in this order:
 *   - a header: one line per rank (its pid, how many barriers it has
 *     entered, and what it asked for);
 *   - the all-to-all sizes: per call parity, each rank's `world` send and
 *     `world` recv sizes (2 * world * 2 * world words);
 *   - the mailboxes: two counter lines per ordered pair of ranks, a
 *     doorbell per rank, and a ring per ordered pair (NOTE [ Mailboxes ]);
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
 * A barrier: each rank raises its own count, and whoever sees every count
 * reach the target bumps a shared word and wakes the sleepers.  Waiting
 * spins briefly, then sleeps on that word (sync.c), because with more
 * ranks than cores a spinning rank only delays the one it waits for.
 * Every MPC_COLL_CHECK_NS of waiting a rank looks at its peers through
 * pidfds: a peer that exited breaks the group, and every rank then fails
 * with a message naming it instead of waiting forever.  What each rank
 * asked for is compared at the first barrier of each call, so calls that
 * differ in kind, size, dtype, op or root fail on every rank alike.
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
 * threads; two collectives, two recvs, or two sends to one rank may not.
 *
 * NOTE [ Group buffers ]
 * Staging costs a large all-reduce about four and a half times its size in
 * memory traffic per rank.  Memory that will be reduced again and again
 * (DDP's gradient buckets) can instead live in a group buffer: a memfd of
 * its own that the other ranks map.  An all-reduce or reduce names the
 * buffer that holds its data; each rank posts the buffer's fd, unique id
 * and the data's offset with its call, and when every rank named one, rank
 * r reduces slice r straight from every rank's buffer and writes the result
 * into every rank's buffer (a reduce: into the root's only): reading and
 * writing the size of the data once, with
 * one barrier to start (all data in place) and one to end (all results
 * written).  An all-to-all, all-gather or reduce-scatter names the
 * buffer that holds its input, and when every rank named one, each reads
 * what it needs of the peers' inputs where they lie: its pieces (mpc_copy)
 * or its slice, which it reduces into its own output.  If any rank named
 * none, every rank stages (or copies between the ranks' memory) instead,
 * so the choice is the same everywhere.  A rank maps a peer's buffer through
 * /proc/<pid>/fd on first use and keeps the mapping (the least recently
 * used goes when MPC_COLL_MAPS are held); buffers are told apart by an id
 * unique in their process, never by fd, which the kernel reuses.  Freeing
 * a buffer punches its pages out of the memfd, so the memory returns at
 * once although peers still map it.  Punching never shrinks the file: a
 * peer still writing (only possible once the group broke mid-call) lands
 * in a fresh page of a file no one reads, and frees it when it unmaps.
 *
 * NOTE [ Copies between ranks' memory ]
 * Staging moves every byte twice (into the region, out of it) with a
 * barrier per chunk.  Where the kernel lets a rank copy from or into
 * another process's memory (process_vm_readv/writev: same user, and no
 * Yama restriction, or the peer allowed it), large data movers copy once,
 * straight between the ranks' own buffers:
 *   - scatter: each rank reads its slice from the root's input;
 *   - gather: each rank writes its piece into the root's output;
 *   - all-to-all: each rank reads its piece from every peer's input;
 *   - all-reduce (MPC_COLL_CMA_AR_MIN bytes or more, when not in group
 *     buffers): as with group buffers, rank r reduces slice r, reading the
 *     peers' pieces of it into memory of its own, and writes the result
 *     into every peer's buffer;
 *   - reduce (as large): the same, with each slice's result written into
 *     the root's buffer only;
 *   - a send of more than MPC_COLL_CMA_SEND bytes puts only its header
 *     (with its buffer's address) in the mailbox, and the receiver reads
 *     the bytes and then takes the header out, which lets the send return.
 *     Smaller ones stream through the mailbox, whose ring stays in the
 *     cache, both ranks copying at once; measured, a ping-pong (ms):
 *       size      2 MB  4 MB  8 MB  16 MB  32 MB  64 MB
 *       direct    0.42  0.55  0.91   1.97   4.75   9.07
 *       streamed  0.16  0.31  0.67   1.96   5.12  10.24
 * Each rank posts its buffer's address with its call; one barrier after
 * the copies keeps every buffer alive and unchanged until all are done.
 * Whether the ranks can do this is found once, when a rank starts
 * watching its peers (mpc_coll_watch): it reads a word of each peer's
 * mapping of the region, and posts 1 in its line when every read worked.
 * A call copies directly only when every rank posted 1 (a send: when its
 * receiver did) and it is large (MPC_COLL_CMA_MIN bytes a piece or more),
 * so all ranks choose alike.  Under Yama's ptrace_scope 1, which allows
 * such access only to ancestors, each rank allows it to every process of
 * its user (PR_SET_PTRACER_ANY), the same rule as without Yama. */
#include "mpcore.h"

#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>

#define MPC_COLL_MAGIC 0x33306c6c6f63706dULL /* "mpcoll03" */
#define MPC_COLL_DATA 16384                   /* header bytes, page aligned */
#define MPC_COLL_ONESHOT (64u << 10)
#define MPC_COLL_AR_PIECE (256u << 10)       /* all-reduce piece: staged, it stays in cache */
#define MPC_COLL_MAPPED_PIECE (64u << 10)    /* see reduce_mapped() */
#define MPC_COLL_CHECK_NS 100000000LL        /* 100 ms between looks at peers */
#define MPC_COLL_ALIGN 64
#define MPC_COLL_YIELDS 16                    /* see barrier() */
#define MPC_COLL_SPIN_NS 30000LL              /* see barrier() */
#define MPC_COLL_BOXES (8u << 20)             /* mailbox bytes of a group, about */
#define MPC_COLL_BOX_MIN 4096u                /* mailbox bytes of a pair, at least */
#define MPC_COLL_BOX_MAX (1u << 20)           /* and at most */
#define MPC_COLL_MSG_MAGIC 0x67736d6du        /* "mmsg" */
#define MPC_COLL_CMA_MAGIC 0x616d636du        /* "mcma": the bytes stay in the sender */
#define MPC_COLL_CMA_MIN (256u << 10)         /* NOTE [ Copies between ranks' memory ] */
#define MPC_COLL_CMA_STEP (8u << 20)          /* bytes per process_vm_readv/writev */
#define MPC_COLL_CMA_AR_MIN (1u << 20)        /* (all-)reduce bytes to copy directly */
#define MPC_COLL_CMA_SEND (16u << 20)         /* send bytes beyond which to copy directly */
#define MPC_COLL_CMA_SPLIT (4u << 20)         /* NOTE [ A large receive copies on two threads ] */
#define MPC_COLL_ROOT_SHARE 4                 /* NOTE [ The root of two takes a share ] */

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
    _Alignas(64) _Atomic uint64_t bar; /* barriers entered */
    int32_t pid;
    _Atomic uint32_t cma;  /* 1: it can copy from and into every peer */
    mpc_coll_call call[2]; /* by call parity */
    mpc_coll_ref ref[2];
    uint64_t base;         /* where this rank maps the region */
    uint64_t addr[2];      /* by call parity: its buffer, for peers to copy */
} mpc_coll_rank;

typedef struct {
    uint64_t magic;
    uint32_t world;
    _Atomic uint32_t why_told; /* 1 once why is written (NOTE [ The reason comes before the word ]) */
    uint64_t chunk, size;
    _Atomic uint32_t gen;    /* bumped when a barrier completes */
    _Atomic uint32_t gen_sleepers; /* ranks asleep on gen (NOTE [ Wakes only for sleepers ]) */
    _Atomic uint32_t broken; /* 0, or 1 + the rank whose loss broke the group */
    char why[200];           /* what broke it */
    mpc_coll_rank ranks[MPC_COLL_MAX_RANKS];
} mpc_coll_hdr;

_Static_assert(sizeof(mpc_coll_hdr) <= MPC_COLL_DATA, "collective header too large");

/* The mailbox from one rank to another: a ring of bytes.  NOTE [ Mailboxes ]. */
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

/* What starts each message in a mailbox (one 64-byte line). */
typedef struct {
    uint32_t magic, tag;
    uint64_t nbytes;
    uint64_t addr; /* MPC_COLL_CMA_MAGIC: where the bytes lie in the sender */
} mpc_coll_msg;

/* Where things lie in the region of a group of `world` ranks.
 * NOTE [ Shared-memory collectives ]. */
typedef struct {
    uint64_t sizes, boxes, bells, rings, ring, areas, size;
} mpc_coll_layout;

/* A peer's group buffer mapped here. */
typedef struct {
    int rank;
    uint64_t uid, len, used;
    uint8_t *addr;
} mpc_coll_map;

#define MPC_COLL_MAPS 64

/* A message that a recv took out of its mailbox ahead of the one it
 * wanted (NOTE [ Mailboxes ]). */
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
    uint64_t calls; /* collectives called */
    uint64_t piece; /* pieces moved: which copy of the areas is next */
    int (*interrupted)(void *);
    void *arg;
    int direct;         /* may copy between ranks' memory (mpc_coll_attach) */
    uint8_t *peers_tmp; /* reduce_direct's pieces of the peers' data */
    int label[MPC_COLL_MAX_RANKS]; /* what messages call each rank (mpc_coll_set_labels) */
    int yields;         /* sched_yield()s before sleeping in a barrier */
    int64_t spin_ns;    /* how long a wait spins before it sleeps */
    uint64_t maps_used; /* lookups in maps, for least-recently-used */
    mpc_coll_map maps[MPC_COLL_MAPS];
};

struct mpc_coll_buf {
    uint8_t *addr;
    uint64_t nbytes, uid;
    int fd;
};

static const char *const kind_names[MPC_COLL_KINDS] = {
    "?",      "all_reduce", "broadcast", "barrier", "all_gather", "reduce_scatter",
    "reduce", "gather",     "scatter",   "all_to_all"};
/* Names as torch gives them: _core.COLL_DTYPES and _core.COLL_OPS are made
 * from these tables, and nowhere else. */
static const char *const dtype_names[MPC_DT_COUNT] = {
    "float32", "float64", "float16", "bfloat16", "int32",  "int64",  "uint8",
    "bool",    "int8",    "int16",   "uint16",   "uint32", "uint64"};
static const char *const op_names[MPC_OP_COUNT] = {"SUM", "AVG",  "PRODUCT", "MIN",
                                                   "MAX", "BAND", "BOR",     "BXOR"};
static const size_t dtype_size[MPC_DT_COUNT] = {4, 8, 2, 2, 4, 8, 1, 1, 1, 2, 2, 4, 8};

size_t mpc_coll_dtype_size(int dtype) {
    return dtype >= 0 && dtype < MPC_DT_COUNT ? dtype_size[dtype] : 0;
}

const char *mpc_coll_dtype_name(int dtype) {
    return dtype >= 0 && dtype < MPC_DT_COUNT ? dtype_names[dtype] : NULL;
}

const char *mpc_coll_op_name(int op) {
    return op >= 0 && op < MPC_OP_COUNT ? op_names[op] : NULL;
}

static int is_float(int dtype) {
    return dtype == MPC_DT_F32 || dtype == MPC_DT_F64 || dtype == MPC_DT_F16 ||
           dtype == MPC_DT_BF16;
}

/* ------------------------------------------------------------------ */
/* Layout                                                              */
/* ------------------------------------------------------------------ */

static uint64_t area_bytes(int world, uint64_t chunk) { return (uint64_t)(world + 1) * chunk; }

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

static uint8_t *stage(const mpc_coll *c, uint64_t parity, int rank) {
    return (uint8_t *)c->h + c->at.areas + parity * area_bytes(c->world, c->chunk) +
           (uint64_t)rank * c->chunk;
}

/* Rank q's sizes in an all-to-all of this parity: world send sizes, then
 * world recv sizes. */
static uint64_t *a2a_sizes(const mpc_coll *c, uint64_t parity, int q) {
    return (uint64_t *)((uint8_t *)c->h + c->at.sizes) +
           (parity * (uint64_t)c->world + (uint64_t)q) * 2 * (uint64_t)c->world;
}

/* The mailbox (and its ring) from src to dst, src != dst. */
static uint64_t pair_index(const mpc_coll *c, int src, int dst) {
    return (uint64_t)src * (uint64_t)(c->world - 1) + (uint64_t)(dst < src ? dst : dst - 1);
}

static mpc_coll_box *box(const mpc_coll *c, int src, int dst) {
    return (mpc_coll_box *)((uint8_t *)c->h + c->at.boxes) + pair_index(c, src, dst);
}

static uint8_t *ring(const mpc_coll *c, int src, int dst) {
    return (uint8_t *)c->h + c->at.rings + pair_index(c, src, dst) * c->at.ring;
}

static _Atomic uint32_t *bell(const mpc_coll *c, int q) {
    return &((mpc_coll_bell *)((uint8_t *)c->h + c->at.bells) + q)->bell;
}

static _Atomic uint32_t *sleepers(const mpc_coll *c, int q) {
    return &((mpc_coll_bell *)((uint8_t *)c->h + c->at.bells) + q)->sleepers;
}

static uint8_t *result(const mpc_coll *c, uint64_t parity) { return stage(c, parity, c->world); }

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
    atomic_store(&h->gen, 0);
    atomic_store(&h->broken, 0);
    atomic_store(&h->why_told, 0);
    h->magic = MPC_COLL_MAGIC;
    munmap(h, MPC_COLL_DATA);
    return 0;
}

/* Under Yama's ptrace_scope 1, lets processes of this user copy from and
 * into this one (NOTE [ Copies between ranks' memory ]). */
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
    c->bar = atomic_load(&c->h->ranks[rank].bar);
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

/* What messages call rank q of the group (q itself when out of range). */
static int lbl(const mpc_coll *c, int q) { return q >= 0 && q < c->world ? c->label[q] : q; }

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
    /* NOTE [ Copies between ranks' memory ]: read each peer's pid from its
     * own mapping of the region */
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
    for (int r = 0; r < MPC_COLL_MAX_RANKS; r++)
        if (c->pidfds[r] >= 0)
            close(c->pidfds[r]);
    for (int i = 0; i < MPC_COLL_MAPS; i++)
        if (c->maps[i].addr != NULL)
            munmap(c->maps[i].addr, c->maps[i].len);
    free(c->peers_tmp);
    while (c->held != NULL) {
        mpc_coll_held *h = c->held;
        c->held = h->next;
        free(h);
    }
    munmap(c->h, c->size);
    free(c);
}

/* 1 when every rank can copy from and into every other one. */
static int cma_all(const mpc_coll *c) {
    for (int q = 0; q < c->world; q++)
        if (!atomic_load(&c->h->ranks[q].cma))
            return 0;
    return 1;
}

int mpc_coll_world(const mpc_coll *c) { return c->world; }

int mpc_coll_direct(const mpc_coll *c) { return cma_all(c); }

int mpc_coll_pid(const mpc_coll *c, int rank) {
    return rank >= 0 && rank < c->world ? c->h->ranks[rank].pid : -1;
}

/* ------------------------------------------------------------------ */
/* Barriers                                                            */
/* ------------------------------------------------------------------ */

/* NOTE [ The reason comes before the word ]
 * One rank wins the right to break the group (the compare-exchange on
 * broken) and then writes why.  A peer can see broken in between, so it
 * reads why only once why_told says it is whole.  The writer is a
 * vsnprintf away; if it died there, the peer says who broke the group
 * instead of waiting on. */
static int broken_error(mpc_coll *c) {
    for (int i = 0; i < 1000 && !atomic_load_explicit(&c->h->why_told, memory_order_acquire); i++) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    if (!atomic_load_explicit(&c->h->why_told, memory_order_acquire))
        return mpc_fail(EPIPE, "the group was broken by rank %d, which gave no reason",
                        lbl(c, (int)atomic_load(&c->h->broken) - 1));
    return mpc_fail(EPIPE, "%s", c->h->why);
}

static void break_group(mpc_coll *c, int who, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void break_group(mpc_coll *c, int who, const char *fmt, ...) {
    uint32_t zero = 0;
    if (atomic_compare_exchange_strong(&c->h->broken, &zero, (uint32_t)who + 1)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->h->why, sizeof c->h->why, fmt, ap);
        va_end(ap);
        atomic_store_explicit(&c->h->why_told, 1, memory_order_release);
    }
    atomic_fetch_add(&c->h->gen, 1);
    mpc_futex_wake(&c->h->gen, INT32_MAX);
    for (int q = 0; q < c->world; q++) { /* ranks waiting on a mailbox */
        atomic_fetch_add(bell(c, q), 1);
        mpc_futex_wake(bell(c, q), INT32_MAX);
    }
}

void mpc_coll_break(mpc_coll *c, const char *why) {
    break_group(c, c->rank, "%s", why);
}

/* Looks at the peers; breaks the group if one exited.  Returns 0 or the
 * error to return. */
static int check_peers(mpc_coll *c, const char *what) {
    for (int r = 0; r < c->world; r++) {
        if (c->pidfds[r] < 0)
            continue;
        struct pollfd p = {c->pidfds[r], POLLIN, 0};
        if (poll(&p, 1, 0) > 0) {
            break_group(c, r, "rank %d (pid %d) exited during %s", lbl(c, r), c->h->ranks[r].pid,
                        what);
            return broken_error(c);
        }
    }
    return 0;
}

static int all_reached(const mpc_coll *c, uint64_t target) {
    for (int r = 0; r < c->world; r++)
        if (atomic_load(&c->h->ranks[r].bar) < target)
            return 0;
    return 1;
}

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

static int barrier(mpc_coll *c, const char *what, int64_t deadline) {
    mpc_coll_hdr *h = c->h;
    uint64_t target = ++c->bar;
    /* Sequentially consistent, store then loads: two ranks arriving
     * together must not both miss the other's store, or neither would
     * wake the group. */
    atomic_store(&h->ranks[c->rank].bar, target);
    if (all_reached(c, target)) {
        atomic_fetch_add(&h->gen, 1);
        mpc_wake_sleepers(&h->gen, &h->gen_sleepers);
        return 0;
    }
    for (;;) {
        uint32_t g = atomic_load(&h->gen);
        if (atomic_load(&h->broken))
            return broken_error(c);
        if (all_reached(c, target))
            return 0;
        int64_t now = mpc_now_ns();
        int64_t until = now + MPC_COLL_CHECK_NS;
        if (deadline >= 0 && deadline < until)
            until = deadline;
        /* More ranks than CPUs: a rank that would sleep first yields its CPU
         * a few times, which lets the ranks it waits for run without the
         * round trip of a futex wake-up. */
        for (int y = 0; y < c->yields && atomic_load(&h->gen) == g; y++)
            sched_yield();
        /* As many ranks as CPUs: a rank spins up to MPC_COLL_SPIN_NS first,
         * since a peer a few microseconds behind (a Python caller's
         * overhead) would otherwise cost a futex sleep and wake-up. */
        int r = mpc_wait_change_spin(&h->gen, g, c->spin_ns, until, &h->gen_sleepers);
        if (r == -EINTR && c->interrupted != NULL && c->interrupted(c->arg)) {
            break_group(c, c->rank, "rank %d was interrupted during %s", lbl(c, c->rank), what);
            return -EINTR;
        }
        if (r == -ETIMEDOUT) {
            /* a signal that came while this rank spun or looked at its
             * peers was not an EINTR: look for it here too */
            if (c->interrupted != NULL && c->interrupted(c->arg)) {
                break_group(c, c->rank, "rank %d was interrupted during %s", lbl(c, c->rank), what);
                return -EINTR;
            }
            if ((r = check_peers(c, what)) < 0)
                return r;
            if (deadline >= 0 && mpc_now_ns() >= deadline && !all_reached(c, target)) {
                char missing[160];
                size_t n = 0;
                missing[0] = '\0';
                for (int q = 0; q < c->world && n < sizeof missing - 8; q++)
                    if (atomic_load(&h->ranks[q].bar) < target)
                        n += (size_t)snprintf(missing + n, sizeof missing - n, "%s%d",
                                              n ? ", " : "", lbl(c, q));
                /* " timeout ": torch's tests of gloo match " (Timed out|closed|timeout) " */
                break_group(c, c->rank, "%s hit its timeout waiting for ranks %s", what, missing);
                return mpc_fail(ETIMEDOUT, "%s hit its timeout waiting for ranks %s", what,
                                missing);
            }
        }
    }
}

/* Writes what a call asked for into out, as the errors give it: "reduce
 * of 1000 float32 with SUM to rank 0". */
static void describe(const mpc_coll *c, char *out, size_t n, const mpc_coll_call *x) {
    uint32_t k = x->kind < MPC_COLL_KINDS ? x->kind : 0;
    int reduces = k == MPC_COLL_ALL_REDUCE || k == MPC_COLL_REDUCE_SCATTER || k == MPC_COLL_REDUCE;
    int p = snprintf(out, n, "%s", kind_names[k]);
    if (k != MPC_COLL_BARRIER && k != MPC_COLL_ALL_TO_ALL && p >= 0 && (size_t)p < n)
        p += snprintf(out + p, n - (size_t)p, " of %llu %s", (unsigned long long)x->count,
                      !reduces ? "bytes" : x->dtype < MPC_DT_COUNT ? dtype_names[x->dtype] : "?");
    if (reduces && p >= 0 && (size_t)p < n)
        p += snprintf(out + p, n - (size_t)p, " with %s",
                      x->op < MPC_OP_COUNT ? op_names[x->op] : "?");
    if ((k == MPC_COLL_BROADCAST || k == MPC_COLL_SCATTER) && p >= 0 && (size_t)p < n)
        snprintf(out + p, n - (size_t)p, " from rank %d", lbl(c, x->root));
    if ((k == MPC_COLL_REDUCE || k == MPC_COLL_GATHER) && p >= 0 && (size_t)p < n)
        snprintf(out + p, n - (size_t)p, " to rank %d", lbl(c, x->root));
}

/* Posts what this rank asks for, meets the others, and checks that they
 * asked for the same.  Returns 0 or the error. */
static int begin(mpc_coll *c, uint32_t kind, uint32_t op, uint32_t dtype, int32_t root,
                 uint64_t count, int64_t deadline) {
    if (atomic_load(&c->h->broken))
        return broken_error(c);
    uint64_t parity = c->calls++ & 1;
    mpc_coll_call me = {kind, op, dtype, root, count};
    c->h->ranks[c->rank].call[parity] = me;
    if (kind != MPC_COLL_ALL_REDUCE && kind != MPC_COLL_REDUCE && kind != MPC_COLL_ALL_TO_ALL &&
        kind != MPC_COLL_ALL_GATHER && kind != MPC_COLL_REDUCE_SCATTER) /* those post_buffer() */
        c->h->ranks[c->rank].ref[parity].fd = -1;
    int r = barrier(c, kind_names[kind], deadline);
    if (r < 0)
        return r;
    for (int q = 0; q < c->world; q++) {
        mpc_coll_call o = c->h->ranks[q].call[parity];
        if (o.kind == me.kind && o.op == me.op && o.dtype == me.dtype && o.root == me.root &&
            o.count == me.count)
            continue;
        char a[128], b[128];
        describe(c, a, sizeof a, &me);
        describe(c, b, sizeof b, &o);
        return mpc_fail(EINVAL, "ranks disagree: rank %d called %s, rank %d called %s",
                        lbl(c, c->rank), a, lbl(c, q), b);
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Reductions                                                          */
/* ------------------------------------------------------------------ */

/* NOTE [ Reduction kernels on each architecture ]
 * The kernels are plain loops that the compiler vectorises.  On x86-64 each
 * is built three times (AVX-512, AVX2 and the baseline SSE2) and the
 * loader picks the widest the CPU has (target_clones, an ifunc).  Elsewhere
 * one build serves: on aarch64 the baseline already has Advanced SIMD
 * (NEON), which -O3 uses, and GCC before 14 has no target_clones there.
 * tests/test_cross_compile.py builds the core for aarch64. */
#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* Integer sums and products are computed in U, an unsigned type at least
 * as wide as int: they wrap around as torch's do, without the undefined
 * behaviour of a signed (or promoted) overflow. */
#define BINOPS(T, U, NAME)                                                                 \
    CLONES static void NAME##_sum(T *restrict d, const T *restrict s, size_t n) {          \
        for (size_t i = 0; i < n; i++)                                                     \
            d[i] = (T)((U)d[i] + (U)s[i]);                                                 \
    }                                                                                      \
    CLONES static void NAME##_prod(T *restrict d, const T *restrict s, size_t n) {         \
        for (size_t i = 0; i < n; i++)                                                     \
            d[i] = (T)((U)d[i] * (U)s[i]);                                                 \
    }                                                                                      \
    CLONES static void NAME##_min(T *restrict d, const T *restrict s, size_t n) {          \
        for (size_t i = 0; i < n; i++)                                                     \
            d[i] = s[i] < d[i] ? s[i] : d[i];                                              \
    }                                                                                      \
    CLONES static void NAME##_max(T *restrict d, const T *restrict s, size_t n) {          \
        for (size_t i = 0; i < n; i++)                                                     \
            d[i] = s[i] > d[i] ? s[i] : d[i];                                              \
    }                                                                                      \
    static void NAME##_apply(int op, T *d, const T *s, size_t n) {                         \
        switch (op) {                                                                      \
        case MPC_OP_PROD: NAME##_prod(d, s, n); break;                                     \
        case MPC_OP_MIN: NAME##_min(d, s, n); break;                                       \
        case MPC_OP_MAX: NAME##_max(d, s, n); break;                                       \
        default: NAME##_sum(d, s, n);                                                      \
        }                                                                                  \
    }

/* The bitwise ops of an integer type, and all its ops in one switch. */
#define BITOPS(T, U, NAME)                                                                 \
    BINOPS(T, U, NAME##a)                                                                  \
    CLONES static void NAME##_band(T *restrict d, const T *restrict s, size_t n) {         \
        for (size_t i = 0; i < n; i++)                                                     \
            d[i] = (T)(d[i] & s[i]);                                                       \
    }                                                                                      \
    CLONES static void NAME##_bor(T *restrict d, const T *restrict s, size_t n) {          \
        for (size_t i = 0; i < n; i++)                                                     \
            d[i] = (T)(d[i] | s[i]);                                                       \
    }                                                                                      \
    CLONES static void NAME##_bxor(T *restrict d, const T *restrict s, size_t n) {         \
        for (size_t i = 0; i < n; i++)                                                     \
            d[i] = (T)(d[i] ^ s[i]);                                                       \
    }                                                                                      \
    static void NAME##_apply(int op, T *d, const T *s, size_t n) {                         \
        switch (op) {                                                                      \
        case MPC_OP_BAND: NAME##_band(d, s, n); break;                                     \
        case MPC_OP_BOR: NAME##_bor(d, s, n); break;                                       \
        case MPC_OP_BXOR: NAME##_bxor(d, s, n); break;                                     \
        default: NAME##a_apply(op, d, s, n);                                               \
        }                                                                                  \
    }

BINOPS(float, float, f32)
BINOPS(double, double, f64)
BITOPS(int32_t, uint32_t, i32)
BITOPS(int64_t, uint64_t, i64)
BITOPS(uint8_t, uint32_t, u8)
BITOPS(int8_t, uint32_t, i8)
BITOPS(int16_t, uint32_t, i16)
BITOPS(uint16_t, uint32_t, u16)
BITOPS(uint32_t, uint32_t, u32)
BITOPS(uint64_t, uint64_t, u64)

/* bool (one byte, 0 or 1), as torch's gloo reduces it: SUM and MAX are a
 * logical or, PRODUCT and MIN a logical and, the bitwise ops bitwise. */
static void bool_apply(int op, uint8_t *d, const uint8_t *s, size_t n) {
    switch (op) {
    case MPC_OP_SUM:
    case MPC_OP_MAX:
    case MPC_OP_BOR: u8_bor(d, s, n); break;
    case MPC_OP_PROD:
    case MPC_OP_MIN:
    case MPC_OP_BAND: u8_band(d, s, n); break;
    default: u8_bxor(d, s, n);
    }
}

/* d[i] / k, the average's division.  For k a power of two (two ranks, four)
 * it multiplies by 1/k instead: both are exact scalings rounded once, so the
 * results are the same bits, and a vector multiply costs a fraction of a
 * divide. */
#define SCALE(T, name)                                                       \
    CLONES static void name(T *d, int k, size_t n) {                         \
        if ((k & (k - 1)) == 0) {                                            \
            T inv = (T)1 / (T)k;                                             \
            for (size_t i = 0; i < n; i++)                                   \
                d[i] = d[i] * inv;                                           \
            return;                                                          \
        }                                                                    \
        for (size_t i = 0; i < n; i++)                                       \
            d[i] = d[i] / (T)k;                                              \
    }

SCALE(float, f32_scale)
SCALE(double, f64_scale)

CLONES static void f16_to_f32(float *restrict d, const _Float16 *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = (float)s[i];
}

CLONES static void f32_to_f16(_Float16 *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = (_Float16)s[i];
}

CLONES static void bf16_to_f32(float *restrict d, const uint16_t *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)s[i] << 16;
        memcpy(&d[i], &u, 4);
    }
}

/* Rounds to nearest even, as torch does; NaN stays a (quiet) NaN. */
CLONES static void f32_to_bf16(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &s[i], 4);
        uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        d[i] = (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? ((u >> 16) | 0x40u) : r);
    }
}

/* dst[i] = op over srcs[0..nsrc-1][i], in that order (avg: the sum over
 * nsrc).  One pass: the sources are read a tile at a time into an
 * accumulator that stays in L1, and dst is written once.  dst may alias
 * any source: each tile is read whole before it is written. */
#define TILE 1024
static void reduce(int dtype, int op, void *dst, void *const *srcs, int nsrc, size_t n) {
    size_t es = dtype_size[dtype];
    int half = dtype == MPC_DT_F16 || dtype == MPC_DT_BF16;
    _Alignas(64) uint8_t acc_b[TILE * 8], tmp_b[TILE * 8];
    float *acc = (float *)acc_b, *tmp = (float *)tmp_b;
    for (size_t off = 0; off < n; off += TILE) {
        size_t m = n - off < TILE ? n - off : TILE;
        for (int r = 0; r < nsrc; r++) {
            const uint8_t *s = (const uint8_t *)srcs[r] + off * es;
            if (half) {
                float *into = r == 0 ? acc : tmp;
                if (dtype == MPC_DT_F16)
                    f16_to_f32(into, (const _Float16 *)s, m);
                else
                    bf16_to_f32(into, (const uint16_t *)s, m);
                if (r > 0)
                    f32_apply(op, acc, tmp, m);
                continue;
            }
            if (r == 0) {
                memcpy(acc_b, s, m * es);
                continue;
            }
            switch (dtype) {
            case MPC_DT_F32: f32_apply(op, (float *)acc_b, (const float *)s, m); break;
            case MPC_DT_F64: f64_apply(op, (double *)acc_b, (const double *)s, m); break;
            case MPC_DT_I32: i32_apply(op, (int32_t *)acc_b, (const int32_t *)s, m); break;
            case MPC_DT_I64: i64_apply(op, (int64_t *)acc_b, (const int64_t *)s, m); break;
            case MPC_DT_BOOL: bool_apply(op, acc_b, s, m); break;
            case MPC_DT_I8: i8_apply(op, (int8_t *)acc_b, (const int8_t *)s, m); break;
            case MPC_DT_I16: i16_apply(op, (int16_t *)acc_b, (const int16_t *)s, m); break;
            case MPC_DT_U16: u16_apply(op, (uint16_t *)acc_b, (const uint16_t *)s, m); break;
            case MPC_DT_U32: u32_apply(op, (uint32_t *)acc_b, (const uint32_t *)s, m); break;
            case MPC_DT_U64: u64_apply(op, (uint64_t *)acc_b, (const uint64_t *)s, m); break;
            default: u8_apply(op, acc_b, s, m); break;
            }
        }
        void *d = (uint8_t *)dst + off * es;
        if (half) {
            if (op == MPC_OP_AVG)
                f32_scale(acc, nsrc, m);
            if (dtype == MPC_DT_F16)
                f32_to_f16(d, acc, m);
            else
                f32_to_bf16(d, acc, m);
            continue;
        }
        if (op == MPC_OP_AVG) {
            if (dtype == MPC_DT_F32)
                f32_scale((float *)acc_b, nsrc, m);
            else
                f64_scale((double *)acc_b, nsrc, m);
        }
        memcpy(d, acc_b, m * es);
    }
}

/* ------------------------------------------------------------------ */
/* Collectives                                                         */
/* ------------------------------------------------------------------ */

static int check_args(int dtype, int op, int reducing) {
    if (dtype < 0 || dtype >= MPC_DT_COUNT)
        return mpc_fail(EINVAL, "unknown dtype code %d", dtype);
    if (reducing && (op < 0 || op >= MPC_OP_COUNT))
        return mpc_fail(EINVAL, "unknown reduction op code %d", op);
    if (reducing && op == MPC_OP_AVG && !is_float(dtype))
        return mpc_fail(EINVAL, "AVG needs a floating-point dtype, not %s", dtype_names[dtype]);
    if (reducing && (op == MPC_OP_BAND || op == MPC_OP_BOR || op == MPC_OP_BXOR) &&
        is_float(dtype))
        return mpc_fail(EINVAL, "%s needs an integer or bool dtype, not %s", op_names[op],
                        dtype_names[dtype]);
    return 0;
}

/* Elements per piece: what fits `room` bytes, a multiple of 64 bytes. */
static uint64_t piece_elems(uint64_t room, size_t es) {
    uint64_t n = room / es;
    uint64_t unit = MPC_COLL_ALIGN / es;
    return n >= unit ? n / unit * unit : n;
}

/* ------------------------------------------------------------------ */
/* Group buffers                                                       */
/* ------------------------------------------------------------------ */

static _Atomic uint64_t buf_uids; /* unique in this process, so in a group with its pid */

int mpc_coll_buf_new(uint64_t nbytes, mpc_coll_buf **out) {
    if (nbytes == 0)
        return mpc_fail(EINVAL, "a group buffer needs at least one byte");
    uint64_t size = (nbytes + MPC_PAGE - 1) / MPC_PAGE * MPC_PAGE;
    mpc_coll_buf *b = calloc(1, sizeof *b);
    if (b == NULL)
        return -ENOMEM;
    int r = mpc_memfd_create(size, size, &b->fd);
    if (r < 0) {
        free(b);
        return r;
    }
    b->addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, b->fd, 0);
    if (b->addr == MAP_FAILED) {
        r = mpc_fail(errno, "cannot map a %" PRIu64 "-byte group buffer: %s", size,
                     strerror(errno));
        close(b->fd);
        free(b);
        return r;
    }
    b->nbytes = size;
    b->uid = atomic_fetch_add(&buf_uids, 1) + 1;
    *out = b;
    return 0;
}

void mpc_coll_buf_free(mpc_coll_buf *b) {
    if (b == NULL)
        return;
    /* NOTE [ Group buffers ]: peers may still map it. */
    fallocate(b->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)b->nbytes);
    munmap(b->addr, b->nbytes);
    close(b->fd);
    free(b);
}

void *mpc_coll_buf_addr(const mpc_coll_buf *b, uint64_t *nbytes) {
    *nbytes = b->nbytes;
    return b->addr;
}

/* This process's mapping of rank q's buffer named by ref, made on first
 * use through /proc/<pid>/fd and kept (least recently used goes first).
 * Returns NULL with the error set. */
static uint8_t *peer_buffer(mpc_coll *c, int q, const mpc_coll_ref *ref) {
    mpc_coll_map *slot = NULL;
    uint64_t now = ++c->maps_used;
    for (int i = 0; i < MPC_COLL_MAPS; i++) {
        mpc_coll_map *m = &c->maps[i];
        if (m->addr != NULL && m->rank == q && m->uid == ref->uid) {
            m->used = now;
            return m->addr;
        }
        if (slot == NULL || (slot->addr != NULL && (m->addr == NULL || m->used < slot->used)))
            slot = m;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", c->h->ranks[q].pid, ref->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        mpc_fail(errno, "cannot open rank %d's buffer (%s): %s", q, path, strerror(errno));
        return NULL;
    }
    struct stat st;
    uint8_t *addr = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (uint64_t)st.st_size == ref->nbytes)
        addr = mmap(NULL, ref->nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    else
        errno = ESTALE;
    int e = errno;
    close(fd);
    if (addr == MAP_FAILED) {
        mpc_fail(e, "cannot map rank %d's %" PRIu64 "-byte buffer: %s", q, ref->nbytes,
                 strerror(e));
        return NULL;
    }
    if (slot->addr != NULL)
        munmap(slot->addr, slot->len);
    *slot = (mpc_coll_map){q, ref->uid, ref->nbytes, now, addr};
    return addr;
}

/* ------------------------------------------------------------------ */
/* Copies between ranks' memory (NOTE [ Copies between ranks' memory ]) */
/* ------------------------------------------------------------------ */

/* Copies n bytes between `mine` here and `theirs` in rank q's memory
 * (into q's when `into`).  Returns 0, or the error, having broken the
 * group: a peer that exited is named as such, any other failure (a buffer
 * that is not there any more) names the peer and the kernel's reason. */
typedef struct {
    pid_t pid;
    uint8_t *mine;
    uint64_t theirs, n;
    int into;
    int err; /* 0, or the errno of the copy that failed */
} cma_job;

/* Does job j's copy; sets j->err.  Touches nothing shared, so a helper
 * thread may run it. */
static void *cma_run(void *arg) {
    cma_job *j = arg;
    j->err = 0;
    while (j->n > 0) {
        size_t k = j->n < MPC_COLL_CMA_STEP ? (size_t)j->n : MPC_COLL_CMA_STEP;
        struct iovec l = {j->mine, k}, r = {(void *)(uintptr_t)j->theirs, k};
        ssize_t done = j->into ? process_vm_writev(j->pid, &l, 1, &r, 1, 0)
                               : process_vm_readv(j->pid, &l, 1, &r, 1, 0);
        if (done < 0 && errno == EINTR)
            continue;
        if (done <= 0) {
            j->err = done < 0 ? errno : EFAULT;
            break;
        }
        j->mine += done;
        j->theirs += (uint64_t)done;
        j->n -= (uint64_t)done;
    }
    return NULL;
}

/* NOTE [ A large receive copies on two threads ]
 * A send whose bytes the receiver reads from the sender's memory returns
 * only once they are read, so while the receiver reads, the sender's core
 * is idle.  So such a receive of MPC_COLL_CMA_SPLIT bytes or more is
 * shared with a helper thread (joined before the receive returns):
 * measured, process_vm_readv of 16 MB took 1.59 ms on one thread and
 * 0.91 ms on two.  Collectives, where every rank copies at once, copy on
 * one thread: a helper would only compete with a peer for a core. */

/* Copies n bytes between `mine` here and `theirs` in rank q's memory
 * (into q's when `into`), sharing the copy with a helper thread when
 * `split` and it is large (NOTE [ A large receive copies on two
 * threads ]).  Returns 0, or the error, having broken the group: a peer
 * that exited is named as such, any other failure (a buffer that is not
 * there any more) names the peer and the kernel's reason. */
static int cma_copy(mpc_coll *c, int q, void *mine, uint64_t theirs, uint64_t n, int into,
                    int split, const char *what) {
    pid_t pid = c->h->ranks[q].pid;
    uint64_t half = split && n >= MPC_COLL_CMA_SPLIT ? (n / 2) & ~(uint64_t)4095 : 0;
    cma_job a = {pid, mine, theirs, n - half, into, 0};
    cma_job b = {pid, (uint8_t *)mine + (n - half), theirs + (n - half), half, into, 0};
    pthread_t t;
    int helper = half > 0 && pthread_create(&t, NULL, cma_run, &b) == 0;
    if (!helper)
        a.n = n; /* alone: the whole copy */
    cma_run(&a);
    if (helper)
        pthread_join(t, NULL);
    int e = a.err ? a.err : b.err;
    if (e == 0)
        return 0;
    if (e == ESRCH || check_peers(c, what) < 0) {
        break_group(c, q, "rank %d (pid %d) exited during %s", lbl(c, q), pid, what);
        return broken_error(c);
    }
    break_group(c, c->rank, "rank %d could not copy %s rank %d's memory during %s: %s",
                lbl(c, c->rank), into ? "into" : "from", lbl(c, q), what, strerror(e));
    return broken_error(c);
}

/* Where rank q's data of the call of `parity` lies in this process: in
 * q's group buffer, mapped here.  NULL, having broken the group, when it
 * cannot be mapped. */
static uint8_t *peer_data(mpc_coll *c, int q, uint64_t parity) {
    const mpc_coll_ref *ref = &c->h->ranks[q].ref[parity];
    uint8_t *b = peer_buffer(c, q, ref);
    if (b == NULL) {
        break_group(c, c->rank, "rank %d could not map rank %d's buffer: %s", lbl(c, c->rank),
                    lbl(c, q), mpc_errmsg());
        return NULL;
    }
    return b + ref->offset;
}

/* The all-reduce (root < 0) or reduce when every rank's data lies in a
 * group buffer: rank r reduces slice r straight from every rank's buffer
 * and writes the result into every rank's buffer, or into the root's only;
 * a barrier closes the call.  Each rank reads and writes the size of the
 * data once, and nothing is staged.  NOTE [ Group buffers ]. */
static int reduce_mapped(mpc_coll *c, uint8_t *mine, uint64_t count, int dtype, int op, int root,
                         uint64_t parity, int64_t deadline) {
    int W = c->world;
    const char *what = root < 0 ? "all_reduce" : "reduce";
    size_t es = dtype_size[dtype];
    uint8_t *bufs[MPC_COLL_MAX_RANKS];
    void *srcs[MPC_COLL_MAX_RANKS];
    for (int q = 0; q < W; q++)
        if ((bufs[q] = q == c->rank ? mine : peer_data(c, q, parity)) == NULL)
            return broken_error(c);
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
        reduce(dtype, op, out + off * es, srcs, W, n);
        for (int q = 0; q < W && root < 0; q++)
            if (q != c->rank)
                memcpy(bufs[q] + off * es, mine + off * es, n * es);
    }
    return barrier(c, what, deadline);
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
    size_t es = dtype_size[dtype];
    uint64_t per = piece_elems(MPC_COLL_AR_PIECE, es);
    if (c->peers_tmp == NULL &&
        (c->peers_tmp = malloc((size_t)W * per * es)) == NULL) {
        break_group(c, me, "rank %d has no memory for a %s's pieces", lbl(c, me), what);
        return broken_error(c);
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
            if (q != me && (r = cma_copy(c, q, srcs[q], at, n * es, 0, 0, what)) < 0)
                return r;
        }
        /* peers_tmp's piece of this rank is free: srcs[me] is in buf */
        uint8_t *out = root < 0 || me == root ? mine + off * es
                                              : c->peers_tmp + (uint64_t)me * per * es;
        reduce(dtype, op, out, srcs, W, n);
        for (int q = 0; q < W; q++) {
            uint64_t at = c->h->ranks[q].addr[parity] + off * es;
            if (q != me && (root < 0 || q == root) &&
                (r = cma_copy(c, q, out, at, n * es, 1, 0, what)) < 0)
                return r;
        }
    }
    return barrier(c, what, deadline);
}

/* Posts, in this rank's words of the call's parity, where buf lies (for
 * peers that copy from or into it) and the group buffer `in` that holds it,
 * if any; -EINVAL when buf's count elements do not lie in `in`. */
static int post_buffer(mpc_coll *c, void *buf, uint64_t count, size_t es, const mpc_coll_buf *in,
                       uint64_t parity) {
    mpc_coll_ref *ref = &c->h->ranks[c->rank].ref[parity];
    ref->fd = -1;
    c->h->ranks[c->rank].addr[parity] = (uint64_t)(uintptr_t)buf;
    if (in != NULL) {
        uint64_t off = (uint64_t)((uint8_t *)buf - in->addr);
        if ((uint8_t *)buf < in->addr || off > in->nbytes || count > (in->nbytes - off) / es)
            return mpc_fail(EINVAL, "the data does not lie in the group buffer given");
        *ref = (mpc_coll_ref){in->fd, 0, in->uid, in->nbytes, off};
    }
    return 0;
}

/* Whether every rank of a group of more than one posted a group buffer. */
static int all_mapped(const mpc_coll *c, uint64_t parity) {
    int mapped = c->world > 1;
    for (int q = 0; q < c->world; q++)
        mapped &= c->h->ranks[q].ref[parity].fd >= 0;
    return mapped;
}

int mpc_coll_all_reduce(mpc_coll *c, void *buf, uint64_t count, int dtype, int op,
                        const mpc_coll_buf *in, int64_t deadline) {
    int r = check_args(dtype, op, 1);
    if (r < 0)
        return r;
    size_t es = dtype_size[dtype];
    uint64_t parity = c->calls & 1;
    if ((r = post_buffer(c, buf, count, es, in, parity)) < 0 ||
        (r = begin(c, MPC_COLL_ALL_REDUCE, (uint32_t)op, (uint32_t)dtype, 0, count, deadline)) < 0)
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
            if ((r = barrier(c, "all_reduce", deadline)) < 0)
                return r;
            for (int q = 0; q < W; q++)
                srcs[q] = stage(c, p, q);
            reduce(dtype, op, mine, srcs, W, n);
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
        if ((r = barrier(c, "all_reduce", deadline)) < 0)
            return r;
        if (a < b) {
            for (int q = 0; q < W; q++)
                srcs[q] = (q == c->rank ? mine : stage(c, p, q)) + a * es;
            reduce(dtype, op, res + a * es, srcs, W, b - a);
            memcpy(mine + a * es, res + a * es, (b - a) * es);
        }
        if ((r = barrier(c, "all_reduce", deadline)) < 0)
            return r;
        memcpy(mine, res, a * es);
        memcpy(mine + b * es, res + b * es, (n - b) * es);
    }
    return 0;
}

int mpc_coll_broadcast(mpc_coll *c, void *buf, uint64_t nbytes, int root, int64_t deadline) {
    if (root < 0 || root >= c->world)
        return mpc_fail(EINVAL, "root %d is not a rank of this group of %d", root, c->world);
    int r = begin(c, MPC_COLL_BROADCAST, 0, MPC_DT_U8, root, nbytes, deadline);
    if (r < 0)
        return r;
    for (uint64_t off = 0; off < nbytes; off += c->chunk) {
        uint64_t n = nbytes - off < c->chunk ? nbytes - off : c->chunk;
        uint64_t p = c->piece++ & 1;
        if (c->rank == root)
            memcpy(stage(c, p, 0), (uint8_t *)buf + off, n);
        if ((r = barrier(c, "broadcast", deadline)) < 0)
            return r;
        if (c->rank != root)
            memcpy((uint8_t *)buf + off, stage(c, p, 0), n);
    }
    return 0;
}

int mpc_coll_barrier(mpc_coll *c, int64_t deadline) {
    return begin(c, MPC_COLL_BARRIER, 0, MPC_DT_U8, 0, 0, deadline);
}

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
        break_group(c, c->rank, "rank %d has no memory for its %s's result", lbl(c, c->rank),
                    what);
        return broken_error(c);
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
        r = barrier(c, what, deadline);
    if (r == 0 && tmp != NULL)
        memcpy(out, tmp, n);
    free(tmp);
    return r;
}

int mpc_coll_all_gather(mpc_coll *c, void *out, const void *in, uint64_t nbytes,
                        const mpc_coll_buf *in_buf, int64_t deadline) {
    int W = c->world, me = c->rank;
    uint64_t parity = c->calls & 1;
    int r = post_buffer(c, (void *)in, nbytes, 1, in_buf, parity);
    if (r < 0 || (r = begin(c, MPC_COLL_ALL_GATHER, 0, MPC_DT_U8, 0, nbytes, deadline)) < 0)
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
            const uint8_t *at = peer_data(c, q, parity);
            if (at == NULL)
                r = broken_error(c);
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
        if ((r = barrier(c, "all_gather", deadline)) < 0)
            break;
        for (int q = 0; q < W; q++)
            if (q != me)
                memcpy(to + (uint64_t)q * nbytes + off, stage(c, p, q), n);
    }
    return end_apart(c, r, 0, out, tmp, W * nbytes, "all_gather", deadline);
}

int mpc_coll_reduce_scatter(mpc_coll *c, void *out, const void *in, uint64_t count, int dtype,
                            int op, const mpc_coll_buf *in_buf, int64_t deadline) {
    int r = check_args(dtype, op, 1);
    if (r < 0)
        return r;
    size_t es = dtype_size[dtype];
    int W = c->world, me = c->rank;
    uint64_t parity = c->calls & 1;
    if ((r = post_buffer(c, (void *)in, W * count, es, in_buf, parity)) < 0 ||
        (r = begin(c, MPC_COLL_REDUCE_SCATTER, (uint32_t)op, (uint32_t)dtype, 0, count,
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
            if ((ins[q] = q == me ? mine : peer_data(c, q, parity)) == NULL)
                r = broken_error(c);
            else if (q != me)
                ins[q] += (uint64_t)me * count * es;
        uint64_t per = piece_elems(MPC_COLL_MAPPED_PIECE, es);
        for (uint64_t off = 0; off < count && r == 0; off += per) {
            for (int q = 0; q < W; q++)
                srcs[q] = (void *)(ins[q] + off * es);
            reduce(dtype, op, to + off * es, srcs, W, count - off < per ? count - off : per);
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
        if ((r = barrier(c, "reduce_scatter", deadline)) < 0)
            break;
        for (int q = 0; q < W; q++)
            srcs[q] = q == me ? (void *)(mine + off * es) : stage(c, p, q) + (uint64_t)me * n * es;
        reduce(dtype, op, to + off * es, srcs, W, n);
    }
    return end_apart(c, r, 0, out, tmp, count * es, "reduce_scatter", deadline);
}

int mpc_coll_reduce(mpc_coll *c, void *buf, uint64_t count, int dtype, int op, int root,
                    const mpc_coll_buf *in, int64_t deadline) {
    int r = check_args(dtype, op, 1);
    if (r < 0)
        return r;
    if (root < 0 || root >= c->world)
        return mpc_fail(EINVAL, "root %d is not a rank of this group of %d", root, c->world);
    size_t es = dtype_size[dtype];
    uint64_t parity = c->calls & 1;
    if ((r = post_buffer(c, buf, count, es, in, parity)) < 0 ||
        (r = begin(c, MPC_COLL_REDUCE, (uint32_t)op, (uint32_t)dtype, root, count, deadline)) < 0)
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
            if ((r = barrier(c, "reduce", deadline)) < 0)
                return r;
            if (me == root) {
                for (int q = 0; q < W; q++)
                    srcs[q] = q == me ? mine : stage(c, p, q);
                reduce(dtype, op, mine, srcs, W, n);
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
        if ((r = barrier(c, "reduce", deadline)) < 0)
            return r;
        if (a < b) {
            for (int q = 0; q < W; q++)
                srcs[q] = (q == me ? mine : stage(c, p, q)) + a * es;
            reduce(dtype, op, (me == root ? mine : res) + a * es, srcs, W, b - a);
        }
        if ((r = barrier(c, "reduce", deadline)) < 0)
            return r;
        if (me == root) {
            memcpy(mine, res, a * es);
            memcpy(mine + b * es, res + b * es, (n - b) * es);
        }
    }
    return 0;
}

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
    if (r < 0 || (r = begin(c, MPC_COLL_GATHER, 0, MPC_DT_U8, root, nbytes, deadline)) < 0)
        return r;
    if (me == root)
        copy_own(outs[me], in, nbytes);
    if (nbytes >= MPC_COLL_CMA_MIN && cma_all(c)) {
        uint64_t tail = root_share(c, nbytes), to = a2a_sizes(c, parity, root)[me];
        if (me != root)
            r = cma_copy(c, root, (void *)in, to, nbytes - tail, 1, 0, "gather");
        else if (tail > 0)
            r = cma_copy(c, 1 - me, (uint8_t *)outs[1 - me] + (nbytes - tail),
                         c->h->ranks[1 - me].addr[parity] + (nbytes - tail), tail, 0, 0, "gather");
        if (r < 0)
            return r;
        return barrier(c, "gather", deadline);
    }
    for (uint64_t off = 0; off < nbytes; off += c->chunk) {
        uint64_t n = nbytes - off < c->chunk ? nbytes - off : c->chunk;
        uint64_t p = c->piece++ & 1;
        if (me != root)
            memcpy(stage(c, p, me), (const uint8_t *)in + off, n);
        if ((r = barrier(c, "gather", deadline)) < 0)
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
    if (r < 0 || (r = begin(c, MPC_COLL_SCATTER, 0, MPC_DT_U8, root, nbytes, deadline)) < 0)
        return r;
    if (me == root)
        copy_own(out, ins[me], nbytes);
    if (nbytes >= MPC_COLL_CMA_MIN && cma_all(c)) {
        uint64_t tail = root_share(c, nbytes), from = a2a_sizes(c, parity, root)[me];
        if (me != root)
            r = cma_copy(c, root, out, from, nbytes - tail, 0, 0, "scatter");
        else if (tail > 0)
            r = cma_copy(c, 1 - me, (uint8_t *)ins[1 - me] + (nbytes - tail),
                         c->h->ranks[1 - me].addr[parity] + (nbytes - tail), tail, 1, 0, "scatter");
        if (r < 0)
            return r;
        return barrier(c, "scatter", deadline);
    }
    for (uint64_t off = 0; off < nbytes; off += c->chunk) {
        uint64_t n = nbytes - off < c->chunk ? nbytes - off : c->chunk;
        uint64_t p = c->piece++ & 1;
        if (me == root) /* rank q's slice goes into rank q's staging area */
            for (int q = 0; q < c->world; q++)
                if (q != me)
                    memcpy(stage(c, p, q), (const uint8_t *)ins[q] + off, n);
        if ((r = barrier(c, "scatter", deadline)) < 0)
            return r;
        if (me != root)
            memcpy((uint8_t *)out + off, stage(c, p, me), n);
    }
    return 0;
}

int mpc_coll_all_to_all(mpc_coll *c, void *out, const void *in, const uint64_t *send,
                        const uint64_t *recv, const mpc_coll_buf *in_buf, int64_t deadline) {
    int W = c->world, me = c->rank;
    uint64_t parity = c->calls & 1, sent = 0;
    uint64_t *mine = a2a_sizes(c, parity, me);
    memcpy(mine, send, (size_t)W * sizeof *send);
    memcpy(mine + W, recv, (size_t)W * sizeof *recv);
    for (int q = 0; q < W; q++)
        sent += send[q];
    int r = post_buffer(c, (void *)in, sent, 1, in_buf, parity);
    if (r < 0 || (r = begin(c, MPC_COLL_ALL_TO_ALL, 0, MPC_DT_U8, 0, 0, deadline)) < 0)
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
            uint8_t *at = peer_data(c, i, parity);
            if (at == NULL)
                return broken_error(c);
            for (int q = 0; q < me; q++)
                at += theirs[q];
            mpc_copy((uint8_t *)out + roff[i], at, recv[i]);
        }
        return barrier(c, "all_to_all", deadline);
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
                (r = cma_copy(c, i, (uint8_t *)out + roff[i], at, recv[i], 0, 0, "all_to_all")) < 0)
                return r;
        }
        return barrier(c, "all_to_all", deadline);
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
        if ((r = barrier(c, "all_to_all", deadline)) < 0)
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

/* ------------------------------------------------------------------ */
/* Point to point                                                      */
/* ------------------------------------------------------------------ */

static uint64_t up64(uint64_t n) { return (n + MPC_COLL_ALIGN - 1) / MPC_COLL_ALIGN * MPC_COLL_ALIGN; }

/* Sleeps until this rank's doorbell moves from g (read before the caller
 * looked at its mailboxes), looking at the peers every MPC_COLL_CHECK_NS.
 * Returns 0 for the caller to look again, or the error (the group is then
 * broken).  what: the call, for messages; peer: the rank waited for, or -1
 * for any. */
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

static int p2p_wait(mpc_coll *c, uint32_t g, const char *what, int peer, int64_t deadline) {
    _Atomic uint32_t *b = bell(c, c->rank);
    if (atomic_load(&c->h->broken))
        return broken_error(c);
    int64_t until = mpc_now_ns() + MPC_COLL_CHECK_NS;
    if (deadline >= 0 && deadline < until)
        until = deadline;
    for (int y = 0; y < c->yields && atomic_load(b) == g; y++)
        sched_yield();
    int r = mpc_wait_change_spin(b, g, c->spin_ns, until, sleepers(c, c->rank));
    if (r == 0 || (r == -EINTR && (c->interrupted == NULL || !c->interrupted(c->arg))))
        return 0;
    if (r == -EINTR || (r == -ETIMEDOUT && c->interrupted != NULL && c->interrupted(c->arg))) {
        break_group(c, c->rank, "rank %d was interrupted during %s", lbl(c, c->rank), what);
        return -EINTR;
    }
    if (r != -ETIMEDOUT)
        return r;
    if ((r = check_peers(c, what)) < 0)
        return r;
    if (deadline >= 0 && mpc_now_ns() >= deadline) {
        char whom[32];
        if (peer >= 0)
            snprintf(whom, sizeof whom, "rank %d", lbl(c, peer));
        else
            snprintf(whom, sizeof whom, "any rank");
        break_group(c, c->rank, "rank %d's %s hit its timeout waiting for %s", lbl(c, c->rank),
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
        return broken_error(c);
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
        return broken_error(c);
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
        int r = cma_copy(c, from, buf, m->addr, nbytes, 0, 1,
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
            return broken_error(c);
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
