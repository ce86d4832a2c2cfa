/* coll_copy.c: how a rank reaches its peers' memory.  It owns group
 * buffers (memory the other ranks map: making, freeing and mapping them,
 * NOTE [ Group buffers ]) and copies straight between the ranks' own
 * buffers (NOTE [ Copies between ranks' memory ]), which the collectives
 * (coll.c) and large sends (coll_p2p.c) choose when every rank can.
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
 * /proc/<pid>/fd on first use and keeps the mapping (NOTE [ Peers' buffers
 * stay mapped ]); buffers are told apart by an id
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
#include "coll.h"

#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>

#define MPC_COLL_CMA_STEP (8u << 20)          /* bytes per process_vm_readv/writev */

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

/* NOTE [ Peers' buffers stay mapped ]
 * Mapping a peer's buffer (an open through /proc, an mmap, and the page
 * faults of the first touch) costs more than a small all-reduce, so each
 * rank keeps what it mapped.  Every rank maps every peer's buffer of each
 * call: a program whose gradients all_reduce from b buffers holds
 * (world - 1) * b mappings, in every rank, for as long as it runs.  When
 * a rank held 64, DDP with more than 64 / (world - 1) buckets (10 on 8
 * ranks), or a loop over more gradients than that, mapped anew in every
 * call: on two ranks, 256 KB each, 24 us a call over 60 buffers, 73 over
 * 70; on four, 63 us over 21 buffers, 258 over 22.  A rank now holds
 * MPC_COLL_MAPS, in sets by a hash of (rank, uid) so that a look costs
 * MPC_COLL_MAP_WAYS comparisons; the least recently used of a full set
 * goes.  A mapping of a freed buffer holds only the file, whose pages the
 * owner punched out (mpc_coll_buf_free). */

/* This process's mapping of rank q's buffer named by ref, made on first
 * use through /proc/<pid>/fd and kept (NOTE [ Peers' buffers stay
 * mapped ]).  Returns NULL with the error set. */
static uint8_t *peer_buffer(mpc_coll *c, int q, const mpc_coll_ref *ref) {
    if (c->maps == NULL && (c->maps = calloc(MPC_COLL_MAPS, sizeof *c->maps)) == NULL) {
        mpc_fail(ENOMEM, "no memory to map rank %d's buffer", q);
        return NULL;
    }
    uint64_t h = (ref->uid * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)q * 0xC2B2AE3D27D4EB4Full);
    mpc_coll_map *set = c->maps + (h >> 32) % MPC_COLL_MAP_SETS * MPC_COLL_MAP_WAYS;
    mpc_coll_map *slot = NULL;
    uint64_t now = ++c->maps_used;
    for (int i = 0; i < MPC_COLL_MAP_WAYS; i++) {
        mpc_coll_map *m = &set[i];
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
int mpc__coll_cma_copy(mpc_coll *c, int q, void *mine, uint64_t theirs, uint64_t n, int into,
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
    if (e == ESRCH || mpc__coll_check_peers(c, what) < 0) {
        mpc__coll_break(c, q, "rank %d (pid %d) exited during %s", lbl(c, q), pid, what);
        return mpc__coll_broken(c);
    }
    mpc__coll_break(c, c->rank, "rank %d could not copy %s rank %d's memory during %s: %s",
                    lbl(c, c->rank), into ? "into" : "from", lbl(c, q), what, strerror(e));
    return mpc__coll_broken(c);
}

/* Where rank q's data of the call of `parity` lies in this process: in
 * q's group buffer, mapped here.  NULL, having broken the group, when it
 * cannot be mapped. */
uint8_t *mpc__coll_peer_data(mpc_coll *c, int q, uint64_t parity) {
    const mpc_coll_ref *ref = &c->h->ranks[q].ref[parity];
    uint8_t *b = peer_buffer(c, q, ref);
    if (b == NULL) {
        mpc__coll_break(c, c->rank, "rank %d could not map rank %d's buffer: %s", lbl(c, c->rank),
                        lbl(c, q), mpc_errmsg());
        return NULL;
    }
    return b + ref->offset;
}

/* Posts, in this rank's words of the call's parity, where buf lies (for
 * peers that copy from or into it) and the group buffer `in` that holds it,
 * if any; -EINVAL when buf's count elements do not lie in `in`. */
int mpc__coll_post_buffer(mpc_coll *c, void *buf, uint64_t count, size_t es,
                          const mpc_coll_buf *in, uint64_t parity) {
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

