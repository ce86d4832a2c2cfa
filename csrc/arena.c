/* arena.c: segments mapped by this process, and the blocks inside them.
 * It asks the keeper for what it has not mapped through client.c, and
 * offers the keeper (keeper.c) the few functions of internal.h that it
 * needs to keep segments and sweep a dead process's holds.
 *
 * It stays one file of about 900 lines: allocation, holds, attach and the
 * keeper's hooks all work on one table of mapped segments under one lock
 * (mpc__lock), and the rules of NOTE [ Blocks and references ] (who may
 * flip a generation, when a segment is retired) hold only if every change
 * to a block's state is read in one place.
 *
 * NOTE [ Blocks and references ]
 * Shared memory is handed out in blocks.  A request of up to
 * MPC_ARENA_MAX bytes gets a block in an arena segment whose blocks all
 * have one power-of-two size class, so that many small tensors share one
 * memfd; a larger request gets a segment of its own with one block.  Only
 * the process that created a segment (its owner) allocates in it, so
 * allocation needs no lock: the owner flips a free block's generation from
 * even to odd.  Any process may free a block.
 *
 * Each block's metadata counts its references: one per process that holds
 * it (a bit in `holders` records which) plus one per ticket in transit.  A
 * handle sent to another process carries a ticket, which keeps the block
 * alive even if the sender exits before the receiver redeems it.  The
 * order of updates is chosen so that a process killed between two of them
 * can only leak a reference, never free a block twice:
 *   hold:    refs++ then set bit   (if the bit was set already, refs--)
 *   release: clear bit then refs-- (only if the bit was set)
 * The keeper drops the holds of a process that dies (keeper.c).
 *
 * When a block's count reaches zero it is freed: its kind's finalizer runs
 * first (a queue drops the tickets of its undelivered messages; NOTE
 * [ Block finalizers ]), then the generation becomes even.  A
 * segment whose owner has gone (ORPHAN) is retired by the keeper when its
 * last block is freed.  A freed single-block segment stays with its owner
 * for reuse, within a budget (MPC_CACHE_BYTES); idle mappings of other
 * processes' segments are likewise kept within a budget, so that a tensor
 * that crosses a queue again and again costs no mmap and no page faults. */
#include "internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MPC_ARENA_MIN 256u
#define MPC_ARENA_MAX (512u * 1024u)
#define MPC_NCLASSES 12 /* 256 B .. 512 KiB */
#define MPC_ARENA_DATA (4u << 20)
#define MPC_RESERVE_CHUNK (256u * 1024u)
#define MPC_CACHE_BYTES (512ull << 20) /* free owned single-block segments kept */
#define MPC_IDLE_BYTES (512ull << 20)  /* idle mappings of others' segments kept */
#define MPC_HASH 1024

typedef struct mpc_seg {
    uint64_t seg_id;
    mpc_seg_header *hdr;
    uint64_t size;
    int fd;             /* kept by the owner of an arena, to reserve more */
    int owned;
    int cls;            /* size class of an owned arena, -1 otherwise */
    uint32_t nheld;     /* blocks this process holds in it */
    uint32_t bump;      /* owned arena: blocks below this were handed out once */
    uint64_t idle_tick; /* when nheld last fell to zero */
    uint32_t hint;      /* owned arena: where to look for a free block next */
    uint32_t pins;      /* threads freeing a block in it without the lock */
    int forget;         /* unmapped when our last hold goes (mpc_forget_idle) */
    struct mpc_seg *next;             /* hash chain */
    struct mpc_seg *all_prev, *all_next; /* every segment mapped here */
} mpc_seg;

static pthread_mutex_t mpc__lock = PTHREAD_MUTEX_INITIALIZER;
static mpc_seg *mpc__table[MPC_HASH];
static mpc_seg *mpc__all; /* list of every mapped segment, newest first */
static mpc_shm_stats mpc__stats;
static uint64_t mpc__tick;

/* Set by keeper.c in the keeper process, which retires segments itself. */
static int (*mpc__retire_hook)(uint64_t seg_id) = NULL;

/* NOTE [ Block finalizers ]
 * Freeing a block of some kinds must first let go of what the block holds:
 * a queue's undelivered messages carry tickets.  The subsystem that gives
 * a kind its meaning registers a finalizer for it (core.c does, at load),
 * and the arena calls it with the block's memory and a function that drops
 * a ticket; so the arena knows nothing of queues, and the file that does
 * (ring.c) is above the arena, never below it. */
#define MPC_BLOCK_KINDS 8
static mpc_block_finalizer mpc__finalizers[MPC_BLOCK_KINDS];

int mpc_block_set_finalizer(uint32_t kind, mpc_block_finalizer fn) {
    if (kind == 0 || kind >= MPC_BLOCK_KINDS)
        return mpc_fail(EINVAL, "no block kind %u", kind);
    __atomic_store_n(&mpc__finalizers[kind], fn, __ATOMIC_RELEASE);
    return 0;
}

void mpc__arena_set_retire_hook(int (*hook)(uint64_t seg_id)) { mpc__retire_hook = hook; }

static inline uint32_t mpc__myslot_bit(uint32_t slot, int *word) {
    *word = (int)(slot / 64);
    return slot % 64;
}

static mpc_seg *mpc__lookup(uint64_t seg_id) {
    for (mpc_seg *s = mpc__table[seg_id % MPC_HASH]; s; s = s->next)
        if (s->seg_id == seg_id)
            return s;
    return NULL;
}

static void mpc__insert(mpc_seg *s) {
    s->next = mpc__table[s->seg_id % MPC_HASH];
    mpc__table[s->seg_id % MPC_HASH] = s;
    s->all_prev = NULL;
    s->all_next = mpc__all;
    if (mpc__all)
        mpc__all->all_prev = s;
    mpc__all = s;
    mpc__stats.segments++;
    mpc__stats.mapped_bytes += s->size;
}

static void mpc__unmap(mpc_seg *s) {
    mpc_seg **pp = &mpc__table[s->seg_id % MPC_HASH];
    while (*pp && *pp != s)
        pp = &(*pp)->next;
    if (*pp)
        *pp = s->next;
    if (s->all_prev)
        s->all_prev->all_next = s->all_next;
    else
        mpc__all = s->all_next;
    if (s->all_next)
        s->all_next->all_prev = s->all_prev;
    mpc__stats.segments--;
    mpc__stats.mapped_bytes -= s->size;
    munmap(s->hdr, s->size);
    if (s->fd >= 0)
        close(s->fd);
    free(s);
}

static inline uint8_t *mpc__block_addr(const mpc_seg *s, uint32_t i) {
    return (uint8_t *)s->hdr + s->hdr->data_offset + (uint64_t)i * s->hdr->block_size;
}

static uint64_t mpc__random_id(void) {
    uint64_t v = 0;
    FILE *f = fopen("/dev/urandom", "re");
    if (f) {
        if (fread(&v, sizeof v, 1, f) != 1)
            v = 0;
        fclose(f);
    }
    if (v == 0)
        v = ((uint64_t)getpid() << 32) ^ (uint64_t)mpc_now_ns();
    return v | 1; /* never zero */
}

/* ---------------------------------------------------------------- */
/* Holding and freeing                                              */
/* ---------------------------------------------------------------- */

/* NOTE [ Replayed tickets ]
 * A ticket is redeemed once.  Unpickling the same bytes twice would redeem
 * it twice and free a block that others still use; so the count may never
 * fall below the number of holders, and a redemption that would break that
 * is refused as stale.  A replay can still take the ticket of a message in
 * flight, whose receiver then gets the error: misuse meets an error, never
 * freed memory. */
static uint32_t mpc__holders(const mpc_meta *m) {
    uint32_t n = 0;
    for (int w = 0; w < MPC_MAX_PROCS / 64; w++)
        n += (uint32_t)__builtin_popcountll(atomic_load(&m->holders[w]));
    return n;
}

/* Drops one ticket's reference unless that would leave fewer references
 * than holders.  Returns 1 if the count reached zero, 0 if not, -1 if the
 * ticket was refused. */
static int mpc__drop_ticket_ref(mpc_meta *m) {
    uint32_t r = atomic_load(&m->refs);
    do {
        if (r == 0 || r - 1 < mpc__holders(m))
            return -1;
    } while (!atomic_compare_exchange_weak(&m->refs, &r, r - 1));
    return r == 1;
}

static void mpc__drop_ticket_cb(const mpc_ref *ref, void *arg) {
    (void)arg;
    mpc_ref_drop(ref);
}

/* Called with mpc__lock NOT held, after the count reached zero. */
static void mpc__free_block(mpc_seg_header *h, uint32_t i) {
    mpc_meta *m = &h->meta[i];
    uint32_t kind = m->kind;
    mpc_block_finalizer fin =
        kind < MPC_BLOCK_KINDS ? __atomic_load_n(&mpc__finalizers[kind], __ATOMIC_ACQUIRE) : NULL;
    if (fin != NULL) {
        uint8_t *addr = (uint8_t *)h + h->data_offset + (uint64_t)i * h->block_size;
        uint64_t length = m->length <= h->block_size ? m->length : h->block_size;
        fin(addr, length, mpc__drop_ticket_cb, NULL);
    }
    atomic_fetch_add(&m->gen, 1); /* odd -> even: free */
    uint32_t live = atomic_fetch_sub(&h->live, 1) - 1;
    mpc_debug("freed block %u of segment %016" PRIx64 " (%u live)", i, h->seg_id, live);
    if (live == 0 && (atomic_load(&h->flags) & MPC_SEG_ORPHAN)) {
        if (mpc__retire_hook)
            mpc__retire_hook(h->seg_id);
        else
            mpc_client_retire(h->seg_id);
    }
}

/* Frees block i of s after mpc__lock is dropped (freeing a queue drops the
 * tickets of its messages, which takes the lock again).  The pin keeps
 * another thread's trim or cache eviction from unmapping s meanwhile.
 * Called with mpc__lock held; returns with it released. */
static void mpc__free_unlocked(mpc_seg *s, uint32_t i) {
    s->pins++;
    pthread_mutex_unlock(&mpc__lock);
    mpc__free_block(s->hdr, i);
    pthread_mutex_lock(&mpc__lock);
    s->pins--;
    pthread_mutex_unlock(&mpc__lock);
}

/* NOTE [ Mappings of orphans ]
 * A mapping of another process's segment that holds nothing of ours is
 * kept (up to MPC_IDLE_BYTES) because its owner will likely send more from
 * it.  Once the owner is gone (the keeper marked the segment orphan) or the
 * segment is retired, no more will come: the mapping is dropped as soon as
 * our last hold in it goes, so that the memory of a finished producer (a
 * DataLoader worker) is not kept mapped here until some later mapping
 * trims it.  The keeper learns of a death a moment after the parent has
 * reaped the child, so a hold released in that moment would find the
 * segment not yet orphan, and its mapping would stay.  So mpc_forget_idle,
 * which a process calls when it knows its producers finished, also marks
 * the mappings it finds still held (`forget`): each goes with its last
 * hold, whatever the keeper knows by then.  A live producer's segment so
 * marked costs one mmap more when it next sends from it. */
static void mpc__unmap_if_orphan(uint64_t seg_id) {
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s = mpc__lookup(seg_id);
    if (s && !s->owned && !s->nheld && !s->pins &&
        (s->forget || (atomic_load(&s->hdr->flags) & (MPC_SEG_ORPHAN | MPC_SEG_RETIRED))))
        mpc__unmap(s);
    pthread_mutex_unlock(&mpc__lock);
}

/* Drops one reference; frees the block if it was the last. */
static void mpc__unref(mpc_seg_header *h, uint32_t i) {
    if (atomic_fetch_sub(&h->meta[i].refs, 1) == 1)
        mpc__free_block(h, i);
}

/* Drops every hold of a dead process slot in one segment (keeper). */
void mpc__drop_slot(mpc_seg_header *h, uint32_t slot) {
    int w;
    uint32_t bit = mpc__myslot_bit(slot, &w);
    for (uint32_t i = 0; i < h->nblocks; i++) {
        mpc_meta *m = &h->meta[i];
        if (!(atomic_load(&m->holders[w]) & (1ull << bit)))
            continue;
        uint64_t old = atomic_fetch_and(&m->holders[w], ~(1ull << bit));
        if (old & (1ull << bit))
            mpc__unref(h, i);
    }
}

/* ---------------------------------------------------------------- */
/* Mapping                                                          */
/* ---------------------------------------------------------------- */

/* Checks that a mapped header is one of ours and self-consistent. */
static int mpc__check_header(const mpc_seg_header *h, uint64_t seg_id, uint64_t size) {
    if (h->magic != MPC_SEG_MAGIC || h->version != MPC_SEG_VERSION)
        return mpc_fail(MPC_EHANDLE, "segment %016" PRIx64 " is not an mpcore segment", seg_id);
    if (h->seg_id != seg_id || h->size != size || h->nblocks == 0 || h->block_size == 0 ||
        h->data_offset < sizeof(mpc_seg_header) + (uint64_t)h->nblocks * sizeof(mpc_meta) ||
        h->data_offset > size || (size - h->data_offset) / h->block_size < h->nblocks)
        return mpc_fail(MPC_EHANDLE, "segment %016" PRIx64 " has a corrupt header", seg_id);
    return 0;
}

/* Maps a segment from its fd (taking the fd: it is closed here unless
 * keep_fd).  Called with mpc__lock held. */
static int mpc__map_fd(uint64_t seg_id, int fd, int keep_fd, mpc_seg **out) {
    struct stat st;
    int r;
    if (fstat(fd, &st) < 0) {
        r = mpc_fail(errno, "fstat of segment failed: %s", strerror(errno));
        goto err;
    }
    uint64_t size = (uint64_t)st.st_size;
    if (size < MPC_PAGE) {
        r = mpc_fail(MPC_EHANDLE, "segment %016" PRIx64 " is too small", seg_id);
        goto err;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        r = mpc_fail(errno == ENOMEM ? ENOMEM : errno, "cannot map a %" PRIu64 "-byte segment: %s",
                     size, strerror(errno));
        goto err;
    }
    if ((r = mpc__check_header(p, seg_id, size)) < 0) {
        munmap(p, size);
        goto err;
    }
    mpc_seg *s = calloc(1, sizeof *s);
    if (s == NULL) {
        munmap(p, size);
        r = mpc_fail(ENOMEM, "out of memory");
        goto err;
    }
    s->seg_id = seg_id;
    s->hdr = p;
    s->size = size;
    s->fd = keep_fd ? fd : -1;
    s->cls = -1;
    if (!keep_fd)
        close(fd);
    /* A single-block segment is about to be read whole: fault it in once. */
    if (s->hdr->nblocks == 1)
        madvise((uint8_t *)p + s->hdr->data_offset, s->hdr->block_size, MADV_WILLNEED);
    mpc__insert(s);
    *out = s;
    return 0;
err:
    close(fd);
    return r;
}

/* Unmaps idle mappings of others' segments beyond the budget, and those
 * whose segment has been retired.  Called with mpc__lock held. */
static void mpc__trim_idle(void) {
    uint64_t idle = 0;
    for (mpc_seg *s = mpc__all, *n; s; s = n) {
        n = s->all_next;
        if (s->owned || s->nheld || s->pins)
            continue;
        if (atomic_load(&s->hdr->flags) & MPC_SEG_RETIRED) {
            mpc__unmap(s);
            continue;
        }
        idle += s->size;
    }
    while (idle > MPC_IDLE_BYTES) {
        mpc_seg *oldest = NULL;
        for (mpc_seg *s = mpc__all; s; s = s->all_next)
            if (!s->owned && !s->nheld && !s->pins &&
                (!oldest || s->idle_tick < oldest->idle_tick))
                oldest = s;
        if (!oldest)
            break;
        idle -= oldest->size;
        mpc__unmap(oldest);
    }
}

/* Finds or maps a segment.  Called with mpc__lock held; drops it while
 * asking the keeper. */
static int mpc__get_seg(uint64_t seg_id, int may_block, mpc_seg **out) {
    mpc_seg *s = mpc__lookup(seg_id);
    if (s && (atomic_load(&s->hdr->flags) & MPC_SEG_RETIRED) && !s->nheld && !s->owned &&
        !s->pins) {
        mpc__unmap(s);
        s = NULL;
    }
    if (s) {
        *out = s;
        return 0;
    }
    if (!may_block)
        return -EAGAIN;
    int fd = -1;
    pthread_mutex_unlock(&mpc__lock);
    int r = mpc_client_fetch(seg_id, &fd);
    pthread_mutex_lock(&mpc__lock);
    if (r < 0)
        return r;
    mpc__stats.fd_fetches++;
    s = mpc__lookup(seg_id); /* another thread may have mapped it meanwhile */
    if (s) {
        close(fd);
        *out = s;
        return 0;
    }
    mpc__trim_idle();
    return mpc__map_fd(seg_id, fd, 0, out);
}

/* ---------------------------------------------------------------- */
/* Allocation (owner only)                                          */
/* ---------------------------------------------------------------- */

static int mpc__size_class(uint64_t length) {
    uint64_t bs = MPC_ARENA_MIN;
    int c = 0;
    while (bs < length) {
        bs <<= 1;
        c++;
    }
    return c;
}

/* Creates, registers and maps a new segment.  Called with mpc__lock held. */
static int mpc__new_segment(uint64_t block_size, uint32_t nblocks, uint64_t reserve_data,
                            int keep_fd, mpc_seg **out) {
    uint32_t slot;
    int r = mpc_client_slot(&slot);
    if (r < 0)
        return r;
    uint64_t hdr_bytes = sizeof(mpc_seg_header) + (uint64_t)nblocks * sizeof(mpc_meta);
    uint64_t data_offset = (hdr_bytes + MPC_PAGE - 1) / MPC_PAGE * MPC_PAGE;
    uint64_t size = data_offset + (uint64_t)nblocks * block_size;
    size = (size + MPC_PAGE - 1) / MPC_PAGE * MPC_PAGE;
    int fd;
    if ((r = mpc_memfd_create(size, data_offset + reserve_data, &fd)) < 0)
        return r;
    int populate = nblocks == 1 ? MAP_POPULATE : 0;
    mpc_seg_header *h = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | populate, fd, 0);
    if (h == MAP_FAILED) {
        r = mpc_fail(errno, "cannot map a new %" PRIu64 "-byte segment: %s", size, strerror(errno));
        close(fd);
        return r;
    }
    h->seg_id = mpc__random_id();
    h->size = size;
    h->data_offset = data_offset;
    h->block_size = block_size;
    h->nblocks = nblocks;
    h->version = MPC_SEG_VERSION;
    h->owner_pid = (int32_t)getpid();
    h->owner_slot = slot;
    h->reserved = data_offset + reserve_data;
    atomic_thread_fence(memory_order_release);
    h->magic = MPC_SEG_MAGIC;
    /* The keeper holds the fd from now on; it is what other processes map. */
    pthread_mutex_unlock(&mpc__lock);
    r = mpc_client_register(h->seg_id, fd);
    pthread_mutex_lock(&mpc__lock);
    if (r < 0) {
        munmap(h, size);
        close(fd);
        return r;
    }
    mpc_seg *s = calloc(1, sizeof *s);
    if (s == NULL) {
        /* Never touch the mapping after munmap: the id is read first. */
        uint64_t seg_id = h->seg_id;
        munmap(h, size);
        close(fd);
        pthread_mutex_unlock(&mpc__lock);
        mpc_client_retire(seg_id);
        pthread_mutex_lock(&mpc__lock);
        return mpc_fail(ENOMEM, "out of memory");
    }
    s->seg_id = h->seg_id;
    s->hdr = h;
    s->size = size;
    s->owned = 1;
    s->cls = -1;
    s->fd = keep_fd ? fd : -1;
    if (!keep_fd)
        close(fd);
    mpc__insert(s);
    mpc__stats.segments_created++;
    *out = s;
    return 0;
}

/* Marks block i of an owned segment live and held by this process. */
static void mpc__activate(mpc_seg *s, uint32_t i, uint64_t length, uint32_t kind, uint32_t slot,
                          mpc_block *out) {
    mpc_meta *m = &s->hdr->meta[i];
    m->kind = kind;
    m->length = length;
    for (int w = 0; w < MPC_MAX_PROCS / 64; w++)
        atomic_store(&m->holders[w], 0);
    int w;
    uint32_t bit = mpc__myslot_bit(slot, &w);
    atomic_store(&m->holders[w], 1ull << bit);
    atomic_store(&m->refs, 1);
    atomic_fetch_add(&s->hdr->live, 1);
    uint32_t gen = atomic_fetch_add(&m->gen, 1) + 1; /* even -> odd: live */
    s->nheld++;
    mpc__stats.blocks_allocated++;
    out->seg_id = s->seg_id;
    out->index = i;
    out->gen = gen;
    out->addr = mpc__block_addr(s, i);
    out->length = length;
    out->kind = kind;
}

/* Retires free owned single-block segments beyond the cache budget.
 * Called with mpc__lock held. */
static void mpc__trim_cache(void) {
    uint64_t cached = 0;
    for (mpc_seg *s = mpc__all; s; s = s->all_next)
        if (s->owned && s->cls < 0 && !s->pins && !(atomic_load(&s->hdr->meta[0].gen) & 1))
            cached += s->size;
    while (cached > MPC_CACHE_BYTES) {
        mpc_seg *oldest = NULL;
        for (mpc_seg *s = mpc__all; s; s = s->all_next)
            if (s->owned && s->cls < 0 && !s->pins && !(atomic_load(&s->hdr->meta[0].gen) & 1) &&
                (!oldest || s->idle_tick < oldest->idle_tick))
                oldest = s;
        if (!oldest)
            break;
        cached -= oldest->size;
        uint64_t id = oldest->seg_id;
        atomic_fetch_or(&oldest->hdr->flags, MPC_SEG_RETIRED);
        mpc__unmap(oldest);
        mpc_client_retire(id);
    }
}

static int mpc__alloc_large(uint64_t length, uint32_t kind, int zero, uint32_t slot,
                            mpc_block *out) {
    uint64_t bs = (length + MPC_PAGE - 1) / MPC_PAGE * MPC_PAGE;
    /* Reuse a free segment of ours that fits without wasting over a quarter. */
    mpc_seg *best = NULL;
    for (mpc_seg *s = mpc__all; s; s = s->all_next)
        if (s->owned && s->cls < 0 && s->hdr->block_size >= bs &&
            s->hdr->block_size - bs <= bs / 4 &&
            !(atomic_load(&s->hdr->meta[0].gen) & 1) &&
            (!best || s->hdr->block_size < best->hdr->block_size))
            best = s;
    if (best) {
        if (zero)
            memset(mpc__block_addr(best, 0), 0, length);
        mpc__activate(best, 0, length, kind, slot, out);
        return 0;
    }
    mpc__trim_cache();
    mpc_seg *s;
    int r = mpc__new_segment(bs, 1, bs, 0, &s);
    if (r < 0)
        return r;
    mpc__activate(s, 0, length, kind, slot, out);
    return 0;
}

static int mpc__alloc_small(uint64_t length, uint32_t kind, int zero, uint32_t slot,
                            mpc_block *out) {
    int cls = mpc__size_class(length);
    uint64_t bs = (uint64_t)MPC_ARENA_MIN << cls;
    for (mpc_seg *s = mpc__all; s; s = s->all_next) {
        if (!s->owned || s->cls != cls)
            continue;
        mpc_seg_header *h = s->hdr;
        /* Reuse a freed block first: its pages are reserved already. */
        if (atomic_load(&h->live) < s->bump) {
            for (uint32_t k = 0; k < s->bump; k++) {
                uint32_t i = (s->hint + k) % s->bump;
                if (!(atomic_load(&h->meta[i].gen) & 1)) {
                    if (zero)
                        memset(mpc__block_addr(s, i), 0, length);
                    mpc__activate(s, i, length, kind, slot, out);
                    s->hint = i + 1;
                    return 0;
                }
            }
        }
        if (s->bump < h->nblocks) {
            uint32_t i = s->bump;
            uint64_t end = h->data_offset + (uint64_t)(i + 1) * bs;
            if (end > h->reserved) {
                /* Reserve in growing steps: each reservation checks
                 * the memory available, which reads /proc. */
                uint64_t want = end - h->reserved;
                uint64_t step = h->reserved - h->data_offset;
                if (step < MPC_RESERVE_CHUNK)
                    step = MPC_RESERVE_CHUNK;
                if (want < step)
                    want = step;
                if (h->reserved + want > h->size)
                    want = h->size - h->reserved;
                int r = mpc_memfd_reserve(s->fd, h->reserved, want);
                if (r < 0)
                    return r;
                h->reserved += want;
            }
            s->bump++;
            mpc__activate(s, i, length, kind, slot, out); /* fresh pages are zero */
            return 0;
        }
    }
    uint32_t nblocks = (uint32_t)(MPC_ARENA_DATA / bs);
    if (nblocks < 16)
        nblocks = 16;
    uint64_t first = bs < MPC_RESERVE_CHUNK ? MPC_RESERVE_CHUNK : bs;
    if (first > (uint64_t)nblocks * bs)
        first = (uint64_t)nblocks * bs;
    mpc_seg *s;
    int r = mpc__new_segment(bs, nblocks, first, 1, &s);
    if (r < 0)
        return r;
    s->cls = cls;
    s->bump = 1;
    mpc__activate(s, 0, length, kind, slot, out);
    return 0;
}

int mpc_block_alloc(uint64_t length, uint32_t kind, int zero, mpc_block *out) {
    if (length == 0)
        return mpc_fail(EINVAL, "cannot allocate an empty block");
    if (length > (1ull << 46))
        return mpc_fail(MPC_ENOSHM, "cannot allocate %" PRIu64 " bytes of shared memory", length);
    uint32_t slot;
    int r = mpc_client_slot(&slot);
    if (r < 0)
        return r;
    pthread_mutex_lock(&mpc__lock);
    r = length > MPC_ARENA_MAX ? mpc__alloc_large(length, kind, zero, slot, out)
                               : mpc__alloc_small(length, kind, zero, slot, out);
    pthread_mutex_unlock(&mpc__lock);
    return r;
}

/* ---------------------------------------------------------------- */
/* Tickets, attach, release                                         */
/* ---------------------------------------------------------------- */

int mpc_block_ticket(const mpc_block *b) {
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s = mpc__lookup(b->seg_id);
    int r = 0;
    if (s == NULL || atomic_load(&s->hdr->meta[b->index].gen) != b->gen)
        r = mpc_fail(MPC_ESTALE, "block %u of segment %016" PRIx64 " is no longer live", b->index,
                     b->seg_id);
    else {
        atomic_fetch_add(&s->hdr->meta[b->index].refs, 1);
        mpc__stats.tickets++;
    }
    pthread_mutex_unlock(&mpc__lock);
    return r;
}

/* Validates ref against a mapped segment.  Called with mpc__lock held. */
static int mpc__check_ref(mpc_seg *s, const mpc_ref *ref) {
    mpc_seg_header *h = s->hdr;
    if (ref->index >= h->nblocks)
        return mpc_fail(MPC_EHANDLE, "handle names block %u of segment %016" PRIx64
                        ", which has %u blocks", ref->index, ref->seg_id, h->nblocks);
    if (!(ref->gen & 1))
        return mpc_fail(MPC_EHANDLE, "handle has a corrupt generation (%u)", ref->gen);
    uint32_t gen = atomic_load(&h->meta[ref->index].gen);
    if (gen != ref->gen)
        return mpc_fail(MPC_ESTALE, "stale handle: block %u of segment %016" PRIx64
                        " was freed%s (generation %u, handle has %u)", ref->index, ref->seg_id,
                        (gen & 1) ? " and reused" : "", gen, ref->gen);
    if (h->meta[ref->index].length > h->block_size)
        return mpc_fail(MPC_EHANDLE, "segment %016" PRIx64 " has corrupt block metadata",
                        ref->seg_id);
    return 0;
}

static void mpc__fill(mpc_seg *s, uint32_t i, mpc_block *out) {
    out->seg_id = s->seg_id;
    out->index = i;
    out->gen = atomic_load(&s->hdr->meta[i].gen);
    out->addr = mpc__block_addr(s, i);
    out->length = s->hdr->meta[i].length;
    out->kind = s->hdr->meta[i].kind;
}

int mpc_segment_prepare(uint64_t seg_id) {
    uint32_t slot;
    int r = mpc_client_slot(&slot);
    if (r < 0)
        return r;
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s;
    r = mpc__get_seg(seg_id, 1, &s);
    pthread_mutex_unlock(&mpc__lock);
    return r;
}

int mpc_block_attach(const mpc_ref *ref, int already_held, int may_block, mpc_block *out) {
    uint32_t slot;
    int r = may_block ? mpc_client_slot(&slot) : mpc_client_slot_ready(&slot);
    if (r < 0)
        return r;
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s;
    if ((r = mpc__get_seg(ref->seg_id, may_block, &s)) < 0)
        goto out;
    if ((r = mpc__check_ref(s, ref)) < 0)
        goto out;
    mpc_meta *m = &s->hdr->meta[ref->index];
    /* Out of the journal first: a kill right after leaks, never drops twice. */
    mpc_journal_clear(ref);
    int w;
    uint32_t bit = mpc__myslot_bit(slot, &w);
    int held = already_held || (atomic_fetch_or(&m->holders[w], 1ull << bit) & (1ull << bit));
    /* Holding it already, the ticket is simply dropped (we hold it, so the
     * count stays above zero); else the ticket becomes our hold. */
    if (held ? mpc__drop_ticket_ref(m) < 0 : atomic_load(&m->refs) < mpc__holders(m)) {
        if (!held)
            atomic_fetch_and(&m->holders[w], ~(1ull << bit));
        r = mpc_fail(MPC_ESTALE, "stale handle: the ticket of block %u of segment %016" PRIx64
                     " was already redeemed (the same pickle loaded twice?)", ref->index,
                     ref->seg_id);
        goto out;
    }
    if (!held)
        s->nheld++;
    mpc__stats.attaches++;
    mpc__fill(s, ref->index, out);
out:
    pthread_mutex_unlock(&mpc__lock);
    return r;
}

int mpc_block_claim(const mpc_block *b) {
    uint32_t slot;
    int r = mpc_client_slot(&slot);
    if (r < 0)
        return r;
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s = mpc__lookup(b->seg_id);
    if (s == NULL) {
        r = mpc_fail(MPC_ENOSEG, "segment %016" PRIx64 " is not mapped here", b->seg_id);
    } else {
        int w;
        uint32_t bit = mpc__myslot_bit(slot, &w);
        uint64_t old = atomic_fetch_or(&s->hdr->meta[b->index].holders[w], 1ull << bit);
        if (old & (1ull << bit))
            atomic_fetch_sub(&s->hdr->meta[b->index].refs, 1);
        else
            s->nheld++;
    }
    pthread_mutex_unlock(&mpc__lock);
    return r;
}

void mpc_block_release(const mpc_block *b) {
    uint32_t slot;
    if (mpc_client_slot(&slot) < 0)
        return;
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s = mpc__lookup(b->seg_id);
    if (s == NULL || atomic_load(&s->hdr->meta[b->index].gen) != b->gen) {
        pthread_mutex_unlock(&mpc__lock);
        return;
    }
    mpc_seg_header *h = s->hdr;
    int w;
    uint32_t bit = mpc__myslot_bit(slot, &w);
    uint64_t old = atomic_fetch_and(&h->meta[b->index].holders[w], ~(1ull << bit));
    if (!(old & (1ull << bit))) {
        pthread_mutex_unlock(&mpc__lock);
        return;
    }
    int last_hold = s->nheld && --s->nheld == 0;
    if (last_hold)
        s->idle_tick = ++mpc__tick;
    if (atomic_fetch_sub(&h->meta[b->index].refs, 1) == 1)
        mpc__free_unlocked(s, b->index);
    else
        pthread_mutex_unlock(&mpc__lock);
    if (last_hold)
        mpc__unmap_if_orphan(b->seg_id);
}

/* NOTE [ A disowned segment ]
 * A large block that is written once and read by others (a DataLoader's
 * shipment of its dataset) would, once freed, stay with its owner as a
 * cached segment (MPC_CACHE_BYTES): hundreds of megabytes that no later
 * allocation of that size may want.  Its owner disowns it instead while
 * it still holds it: the segment is marked as an orphan's (as if its owner
 * had gone), so that whichever process frees the block asks the keeper to
 * retire the segment, and it is no longer owned here, so that this
 * process's mapping goes with its last hold (mpc__unmap_if_orphan), as
 * every other process's does.  Nothing is allocated in it again.  Holding
 * the block while disowning keeps its count above zero, so the free that
 * retires the segment comes after the mark. */
int mpc_block_disown(const mpc_block *b) {
    uint32_t slot;
    int r = mpc_client_slot(&slot);
    if (r < 0)
        return r;
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s = mpc__lookup(b->seg_id);
    int w;
    uint32_t bit = mpc__myslot_bit(slot, &w);
    if (s == NULL || atomic_load(&s->hdr->meta[b->index].gen) != b->gen ||
        !(atomic_load(&s->hdr->meta[b->index].holders[w]) & (1ull << bit)))
        r = mpc_fail(MPC_ESTALE, "block %u of segment %016" PRIx64 " is not live and held here",
                     b->index, b->seg_id);
    else if (!s->owned)
        r = mpc_fail(EINVAL, "segment %016" PRIx64 " is not this process's", b->seg_id);
    else if (s->cls < 0) {
        atomic_fetch_or(&s->hdr->flags, MPC_SEG_ORPHAN);
        s->owned = 0;
        r = 1;
    } /* else: an arena's block, whose place the next small block takes (0) */
    pthread_mutex_unlock(&mpc__lock);
    return r;
}

void mpc_forget_idle(void) {
    pthread_mutex_lock(&mpc__lock);
    for (mpc_seg *s = mpc__all, *n; s; s = n) {
        n = s->all_next;
        if (s->owned)
            continue;
        if (!s->nheld && !s->pins)
            mpc__unmap(s);
        else
            s->forget = 1; /* NOTE [ Mappings of orphans ] */
    }
    pthread_mutex_unlock(&mpc__lock);
}

/* A ticket's count dropped, its journal left alone. */
static void mpc__ref_drop_count(const mpc_ref *ref) {
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s;
    if (mpc__get_seg(ref->seg_id, 1, &s) < 0 || mpc__check_ref(s, ref) < 0) {
        mpc_clear_error();
        pthread_mutex_unlock(&mpc__lock);
        return;
    }
    if (mpc__drop_ticket_ref(&s->hdr->meta[ref->index]) == 1)
        mpc__free_unlocked(s, ref->index);
    else
        pthread_mutex_unlock(&mpc__lock);
}

void mpc_ref_drop(const mpc_ref *ref) {
    mpc_journal_clear(ref);
    mpc__ref_drop_count(ref);
}

int mpc_ref_drop_journaled(const mpc_ref *ref) {
    if (!mpc_journal_clear(ref))
        return 0;
    mpc__ref_drop_count(ref);
    return 1;
}

int mpc_block_find(const void *addr, uint64_t len, mpc_block *out) {
    const uint8_t *p = addr;
    int found = 0;
    pthread_mutex_lock(&mpc__lock);
    for (mpc_seg *s = mpc__all; s && !found; s = s->all_next) {
        uint8_t *data = (uint8_t *)s->hdr + s->hdr->data_offset;
        uint8_t *end = (uint8_t *)s->hdr + s->size;
        if (p < data || p >= end)
            continue;
        uint32_t i = (uint32_t)((uint64_t)(p - data) / s->hdr->block_size);
        if (i >= s->hdr->nblocks || !(atomic_load(&s->hdr->meta[i].gen) & 1))
            break;
        uint8_t *start = mpc__block_addr(s, i);
        if (p + len > start + s->hdr->meta[i].length)
            break;
        mpc__fill(s, i, out);
        found = 1;
        break;
    }
    pthread_mutex_unlock(&mpc__lock);
    return found;
}

void mpc_shm_get_stats(mpc_shm_stats *st) {
    pthread_mutex_lock(&mpc__lock);
    *st = mpc__stats;
    pthread_mutex_unlock(&mpc__lock);
}

/* ---------------------------------------------------------------- */
/* Hooks for the keeper and for fork                                */
/* ---------------------------------------------------------------- */

/* The keeper maps each registered segment (keeping its fd) so that it can
 * drop a dead process's holds and drain queues.  Returns 0 or -errno. */
int mpc__keeper_map(uint64_t seg_id, int fd, mpc_seg_header **hdr) {
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s;
    int dupfd = dup(fd);
    int r = dupfd < 0 ? mpc_fail(errno, "dup failed: %s", strerror(errno))
                      : mpc__map_fd(seg_id, dupfd, 1, &s);
    if (r == 0) {
        s->nheld = 1; /* never trimmed as idle in the keeper */
        *hdr = s->hdr;
    }
    pthread_mutex_unlock(&mpc__lock);
    return r;
}

int mpc__keeper_fd(uint64_t seg_id) {
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s = mpc__lookup(seg_id);
    int fd = s ? s->fd : -1;
    pthread_mutex_unlock(&mpc__lock);
    return fd;
}

/* Retires a segment in the keeper: marks it, unmaps it, closes its fd.
 * Returns 0, or -ENOENT if unknown, or -EBUSY if a block is still live. */
int mpc__keeper_unmap(uint64_t seg_id, int force) {
    pthread_mutex_lock(&mpc__lock);
    mpc_seg *s = mpc__lookup(seg_id);
    int r = 0;
    if (s == NULL)
        r = -ENOENT;
    else if (!force && atomic_load(&s->hdr->live) != 0)
        r = -EBUSY;
    else {
        atomic_fetch_or(&s->hdr->flags, MPC_SEG_RETIRED);
        mpc__unmap(s);
    }
    pthread_mutex_unlock(&mpc__lock);
    return r;
}

/* Calls fn for every segment mapped here (keeper's sweep). */
void mpc__foreach_seg(void (*fn)(mpc_seg_header *, void *), void *arg) {
    pthread_mutex_lock(&mpc__lock);
    uint64_t n = mpc__stats.segments, k = 0;
    mpc_seg_header **list = malloc((n + 1) * sizeof *list);
    if (list)
        for (mpc_seg *s = mpc__all; s && k < n; s = s->all_next)
            list[k++] = s->hdr;
    pthread_mutex_unlock(&mpc__lock);
    /* Segments are only unmapped by this (single-threaded) keeper, after
     * the callbacks: safe to walk the snapshot without the lock. */
    for (uint64_t i = 0; list && i < k; i++)
        fn(list[i], arg);
    free(list);
}

void mpc__arena_after_fork_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&mpc__lock, &fresh, sizeof fresh);
    /* The child owns none of its parent's segments and holds nothing yet:
     * it allocates in arenas of its own, and redeems tickets for what it
     * inherited. */
    for (mpc_seg *s = mpc__all; s; s = s->all_next) {
        s->owned = 0;
        s->cls = -1;
        s->nheld = 0;
        s->pins = 0;
        if (s->fd >= 0) {
            close(s->fd);
            s->fd = -1;
        }
    }
}
