/* mpcore.h: the interface of mpcore's C core, what the bindings call.
 * It stays one header of about 900 lines, a section per subsystem: it is
 * the core's whole contract, every declaration with what it returns on
 * failure, and a binding reads the few sections it uses in one place.
 *
 * The core is plain C with no Python in it.  Every exported function returns
 * 0 (or a non-negative count) on success and a negative errno on failure; the
 * longer explanation of a failure, when there is one, is left in a
 * thread-local buffer that mpc_errmsg() returns (the way dlerror() works).
 * Only the py_*.c binding files include Python.h, and they turn these codes
 * into exceptions in one place (py_core.c: mpc_py_raise).
 *
 * Names: mpc_ for the core's interface (declared here), mpc__ for what one
 * core file shares with another (declared in internal.h, which bindings
 * never include) or keeps to itself (static).
 */
#ifndef MPCORE_H
#define MPCORE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Errors and debugging                                                */
/* ------------------------------------------------------------------ */

/* Records a printf-style explanation of the failure about to be returned.
 * Always returns -err, so that `return mpc_fail(ENOMEM, "...")` reads well. */
int mpc_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Returns the explanation recorded by the last mpc_fail() of this thread,
 * or "" (never NULL). */
const char *mpc_errmsg(void);

/* Clears the explanation (done by bindings before each call).  Never
 * fails. */
void mpc_clear_error(void);

#define MPC_COPY_AROUND (4u << 20) /* see mpc_copy */
#define MPC_COPY_SPLIT (32u << 20)

/* Copies n bytes like memcpy.  A copy of MPC_COPY_AROUND bytes or more
 * goes around the cache, and one of MPC_COPY_SPLIT bytes or more is shared
 * with a helper thread joined before returning (NOTE [ Large copies go
 * around the cache ] in util.c).  Never fails (without a thread it just
 * copies alone). */
void mpc_copy(void *dst, const void *src, size_t n);

extern int mpc_debug_enabled; /* set from MPCORE_DEBUG at load */
#define mpc_debug(...)                                                      \
    do {                                                                    \
        if (mpc_debug_enabled) {                                            \
            fprintf(stderr, "mpcore[%d] %s:%d: ", (int)getpid(), __FILE__, \
                    __LINE__);                                              \
            fprintf(stderr, __VA_ARGS__);                                   \
            fputc('\n', stderr);                                            \
        }                                                                   \
    } while (0)

/* NOTE [ mpcore's error codes ]
 * Where an errno would be ambiguous, the core returns codes of its own,
 * above every errno value, and the bindings map exactly these to mpcore's
 * exceptions; a plain errno always means what the C library says it means
 * (ENOENT: a file is missing; ENOMEM: malloc failed), and becomes OSError
 * or MemoryError as that errno says. */
#define MPC_ERR_BASE 0x4000
#define MPC_EHANDLE (MPC_ERR_BASE + 1) /* a handle that is forged, corrupt or out of bounds */
#define MPC_ESTALE (MPC_ERR_BASE + 2)  /* a handle whose block was freed or reused */
#define MPC_ENOSEG (MPC_ERR_BASE + 3)  /* a handle naming a segment no one knows */
#define MPC_ENOSHM (MPC_ERR_BASE + 4)  /* shared memory (or what may be committed) exhausted */
#define MPC_ERR_END (MPC_ERR_BASE + 5)

/* Describes an error code, mpcore's own or an errno (either sign).
 * Returns a static string; never fails. */
const char *mpc_strerror(int err);

/* ------------------------------------------------------------------ */
/* Time and futex waits (sync.c)                                       */
/* ------------------------------------------------------------------ */

/* Returns the monotonic clock in nanoseconds.  Never fails. */
int64_t mpc_now_ns(void);

/* Tells the CPU that the caller spins (NOTE [ Spin hints ] in sync.c): one
 * pause.  Never fails. */
static inline void mpc_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("isb" ::: "memory");
#endif
}

/* Waits while *addr == expected, at most until deadline_ns (monotonic; -1
 * means no deadline).  The word lives in shared memory, so the wait is a
 * process-shared futex.  Returns 0 when woken (or when *addr had already
 * changed), -ETIMEDOUT at the deadline, -EINTR when a signal arrived: the
 * caller then checks for Python signals and calls again. */
int mpc_futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t deadline_ns);

/* Wakes up to n waiters of addr (n = INT32_MAX for all). Never fails. */
void mpc_futex_wake(_Atomic uint32_t *addr, int n);

/* Waits until *addr != expected: spins briefly, then sleeps on the futex.
 * Same returns as mpc_futex_wait. */
int mpc_wait_change(_Atomic uint32_t *addr, uint32_t expected, int64_t deadline_ns);

/* As mpc_wait_change, but looks at the word for up to spin_ns more before
 * it sleeps: for waiters that have a core of their own, where a futex
 * wake-up costs more than the wait.  While it sleeps it counts itself in
 * *sleepers, unless that is NULL (then wakers must always call the kernel);
 * see mpc_wake_sleepers.  Same returns. */
int mpc_wait_change_spin(_Atomic uint32_t *addr, uint32_t expected, int64_t spin_ns,
                         int64_t deadline_ns, _Atomic uint32_t *sleepers);

/* Wakes every waiter of addr, calling the kernel only when *sleepers (the
 * count mpc_wait_change_spin keeps) is not zero.  Call after changing
 * *addr.  Never fails. */
void mpc_wake_sleepers(_Atomic uint32_t *addr, _Atomic uint32_t *sleepers);

/* ------------------------------------------------------------------ */
/* Memory availability and memfd segments (shm.c)                      */
/* ------------------------------------------------------------------ */

#define MPC_PAGE 4096u
#define MPC_MAX_PROCS 256 /* processes of one program holding blocks at once */

/* How many bytes this process may still commit: the smallest of
 * MemAvailable and, for each memory cgroup (v1 or v2) from ours up to the
 * root, its limit minus its usage.  On success stores the figure in *avail
 * and a short description of which bound it is in why (at least 96 bytes).
 * Returns 0, or -errno (with a message naming /proc/meminfo) if
 * /proc/meminfo cannot be read. */
int mpc_mem_available(uint64_t *avail, char *why, size_t whylen);

/* Creates a memfd of `size` bytes (a multiple of MPC_PAGE), sealed against
 * shrinking and growing, and reserves the first `reserve` bytes of it with
 * posix_fallocate after checking mpc_mem_available.  On success stores the
 * fd (close-on-exec) in *fd and returns 0.  On failure returns -MPC_ENOSHM
 * (with a message naming the size asked for and what was available), or
 * another -errno; no fd is left open. */
int mpc_memfd_create(uint64_t size, uint64_t reserve, int *fd);

/* Reserves bytes [off, off+len) of a memfd made by mpc_memfd_create, with
 * the same availability check.  Returns 0, -MPC_ENOSHM or -errno. */
int mpc_memfd_reserve(int fd, uint64_t off, uint64_t len);

/* ------------------------------------------------------------------ */
/* Segments and blocks (arena.c)                                       */
/* ------------------------------------------------------------------ */

/* Every segment starts with a header and a table of block metadata.
 * Small requests share an arena segment whose blocks all have one size
 * class; a large request gets a segment with a single block. */

#define MPC_SEG_MAGIC 0x47455345524f4350ULL /* "PCORESEG" */
#define MPC_SEG_VERSION 1u

enum { MPC_SEG_ORPHAN = 1u, MPC_SEG_RETIRED = 2u };
enum { MPC_BLOCK_DATA = 1u, MPC_BLOCK_QUEUE = 2u };

typedef struct {
    _Atomic uint32_t gen;  /* odd while the block is live, even while free */
    _Atomic uint32_t refs; /* holding processes + tickets in transit */
    uint32_t kind;         /* MPC_BLOCK_* */
    uint32_t _pad0;
    uint64_t length;       /* bytes asked for (<= the segment's block_size) */
    uint64_t _pad1;
    _Atomic uint64_t holders[MPC_MAX_PROCS / 64]; /* process slots holding it */
} mpc_meta; /* 64 bytes */

typedef struct {
    uint64_t magic;
    uint64_t seg_id;
    uint64_t size;        /* bytes of the whole segment */
    uint64_t data_offset; /* where block 0 starts */
    uint64_t block_size;  /* bytes per block */
    uint32_t nblocks;
    uint32_t version;
    int32_t owner_pid;
    uint32_t owner_slot;
    _Atomic uint32_t flags; /* MPC_SEG_* */
    _Atomic uint32_t live;  /* live blocks */
    uint64_t reserved;      /* bytes reserved so far (written by the owner) */
    uint64_t _pad[6];
    mpc_meta meta[];
} mpc_seg_header;

/* A reference to one block, as it travels between processes. */
typedef struct {
    uint64_t seg_id;
    uint32_t index;
    uint32_t gen;
} mpc_ref;

/* A block held by this process. */
typedef struct {
    uint64_t seg_id;
    uint32_t index;
    uint32_t gen;
    void *addr;      /* first byte of the block in this process */
    uint64_t length; /* bytes usable */
    uint32_t kind;
} mpc_block;

/* Allocates a block of `length` bytes (length > 0) of the given kind,
 * reserved and mapped, zero-filled when zero != 0, held once by this
 * process.  Returns 0 and fills *out, or -MPC_ENOSHM (message names the size
 * and what was available), -ECONNREFUSED when no keeper can be reached,
 * -ENOMEM when malloc fails, or another -errno. */
int mpc_block_alloc(uint64_t length, uint32_t kind, int zero, mpc_block *out);

/* Takes a ticket on a block this process holds, so that the block outlives
 * this process until the ticket is redeemed by mpc_block_attach or dropped
 * by mpc_ref_drop.  Returns 0, or -MPC_ESTALE if the block is no longer
 * live. */
int mpc_block_ticket(const mpc_block *b);

/* Redeems a ticket: maps the block's segment if needed (asking the keeper
 * for its fd once per segment), checks the reference against the segment's
 * header, and converts the ticket into this process's hold.  If
 * already_held is non-zero this process holds the block already and the
 * ticket is simply dropped.  With may_block == 0 it never waits: where it
 * would have to connect or fetch, it returns -EAGAIN having changed
 * nothing (call mpc_segment_prepare, then again).  Returns 0 and fills
 * *out, or -MPC_EHANDLE (forged or corrupt), -MPC_ESTALE (block freed or
 * reused, or its ticket already redeemed), -MPC_ENOSEG (no such segment), or
 * another -errno; on failure no reference count changes. */
int mpc_block_attach(const mpc_ref *ref, int already_held, int may_block, mpc_block *out);

/* Connects to the keeper and maps segment seg_id, as a blocking attach
 * would.  Returns 0 or the errors of mpc_block_attach. */
int mpc_segment_prepare(uint64_t seg_id);

/* Adds this process's hold on a block it can already see (after fork, the
 * child redeems the ticket its parent took for it).  Same returns as
 * mpc_block_attach. */
int mpc_block_claim(const mpc_block *b);

/* Drops this process's hold.  When it was the last reference the block is
 * freed (a queue's undelivered messages drop their tickets first), and a
 * segment left with no live block whose owner is gone is retired.  Never
 * fails: a block that is already gone is ignored. */
void mpc_block_release(const mpc_block *b);

/* Gives up this process's ownership of the segment of b, a block of more
 * than the arena's largest size class that this process allocated and
 * still holds: nothing is allocated in the segment again, it is retired
 * (its memory returned) as soon as its block is freed, by whichever
 * process frees it, and each process's mapping of it, this one's
 * included, goes with that process's last hold (NOTE [ A disowned segment ]
 * in arena.c).  Returns 1 when disowned; 0, changing nothing, when b lies
 * in an arena segment (a freed block's place there goes to the next small
 * block); -MPC_ESTALE if b is not live and held here, or -EINVAL if this
 * process does not own its segment (error set, nothing changed); or
 * mpc_client_slot's error. */
int mpc_block_disown(const mpc_block *b);

/* Unmaps every mapping of another process's segment in which this process
 * holds no block (the next attach maps it again), and marks the others to
 * be unmapped when this process's last hold in them goes.  Used when the
 * producers of those segments are known to be finished.  Never fails. */
void mpc_forget_idle(void);

/* Drops a ticket without redeeming it (and one journal entry of it, if the
 * journal lists one).  Never fails. */
void mpc_ref_drop(const mpc_ref *ref);

/* Drops a ticket only if this process's journal lists one of that block:
 * the entry is forgotten and the ticket dropped, and 1 returned; else 0,
 * nothing done (a ticket this process never journaled, such as one a
 * forked child inherited, is not its to drop).  Never fails. */
int mpc_ref_drop_journaled(const mpc_ref *ref);

/* Looks up which live block of this process contains [addr, addr+len).
 * Returns 1 and fills *out (without taking a hold) if found, 0 if not. */
int mpc_block_find(const void *addr, uint64_t len, mpc_block *out);

/* Counts for tests and stats: segments mapped here, bytes mapped, blocks
 * allocated here since start, fetches of a segment fd from the keeper,
 * segments created here, tickets taken (handles sent) and redeemed
 * (handles received). */
typedef struct {
    uint64_t segments, mapped_bytes, blocks_allocated, fd_fetches, segments_created;
    uint64_t tickets, attaches;
} mpc_shm_stats;

/* Copies this process's counters into *st.  Never fails. */
void mpc_shm_get_stats(mpc_shm_stats *st);

/* What a block of some kind must let go of before it is freed
 * (NOTE [ Block finalizers ] in arena.c): called with the block's memory,
 * its length, and drop, which drops one ticket (pass it arg). */
typedef void (*mpc_block_finalizer)(void *addr, uint64_t length,
                                    void (*drop)(const mpc_ref *, void *), void *arg);

/* Registers fn (NULL: none) as the finalizer of blocks of `kind` in this
 * process.  Returns 0, or -EINVAL for a kind outside 1..7. */
int mpc_block_set_finalizer(uint32_t kind, mpc_block_finalizer fn);

/* ------------------------------------------------------------------ */
/* The keeper (keeper.c) and each process's client of it (client.c)   */
/* ------------------------------------------------------------------ */

/* The keeper is a small process, one per program, that holds the fd of
 * every segment, hands it to processes that map the segment, and drops the
 * references of processes that die.  NOTE [ Keeper ] in keeper.c. */

/* Runs the keeper: `first` is a socket already connected to the program's
 * first process, `lsock` the listening socket bound to its address.
 * Returns when no process is connected any more; returns -errno if it
 * cannot start. */
int mpc_keeper_main(int first, int lsock);

/* Client side: connects this process to the keeper named by the address in
 * MPCORE_KEEPER, or starts one (and sets MPCORE_KEEPER), without asking
 * for a slot yet.  Stores the keeper's address in *name.  Returns 0 or
 * -errno. */
int mpc_client_connect(const char **name);

/* Connects as mpc_client_connect does, once, says HELLO and stores this
 * process's slot in *slot.  Returns 0; -EINVAL in the keeper itself;
 * -EUSERS when every slot is taken; or the errors of mpc_client_connect. */
int mpc_client_slot(uint32_t *slot);

/* This process's slot if it has one already (0), else -EAGAIN. */
int mpc_client_slot_ready(uint32_t *slot);

/* Starts a keeper for this program with mpc_spawn_service (the command is
 * a Python that runs mpcore._core.keeper_main) and keeps its connection.
 * Returns 0 or -errno. */
int mpc_keeper_spawn(char *const tmpl[], char *name, size_t namelen);

/* Sets the command mpc_client_slot uses to start a keeper when none runs.
 * The array must stay valid for the life of the process.  Never fails. */
void mpc_set_keeper_argv(char *const *argv);

/* Returns the pid of the keeper this process started, or 0.  Never fails. */
pid_t mpc_keeper_pid(void);

/* Client requests; each returns 0 or -errno (-ECONNREFUSED when the keeper
 * cannot be reached).  register hands the keeper a new segment's fd (-EEXIST
 * for a known id); fetch stores a new fd of the segment in *fd, or returns
 * -MPC_ENOSEG for a segment the keeper does not know; retire returns the
 * keeper's answer (-EBUSY while a block is live) and leaves no message. */
int mpc_client_register(uint64_t seg_id, int fd);
int mpc_client_fetch(uint64_t seg_id, int *fd);
int mpc_client_retire(uint64_t seg_id);

/* The journal of tickets in transit (journal.c, NOTE [ Journal ]).  Each
 * process records there the tickets it holds between taking them off (or
 * before putting them on) a queue, so that the keeper drops them if the
 * process dies in between.  Both calls are no-ops in a process without a
 * keeper connection. */

/* Records a ticket this process holds in transit.  Returns 0; -ENOSPC when
 * the journal is full (the ticket is then kept in the process's own memory,
 * where mpc_journal_clear finds it, but not protected against the process's
 * death: NOTE [ A full journal ]); -ENOMEM when that memory cannot grow
 * either (the ticket is not recorded); -ENOENT when this process has no
 * journal. */
int mpc_journal_add(const mpc_ref *ref);

/* Forgets a recorded ticket (the first entry equal to ref).  Returns 1 if
 * one was found, 0 if not.  Never fails. */
int mpc_journal_clear(const mpc_ref *ref);

/* ------------------------------------------------------------------ */
/* The core as a whole (core.c)                                        */
/* ------------------------------------------------------------------ */

/* Ties the subsystems together once per process, at load: registers the
 * queue's block finalizer with the arena and the core's fork handlers
 * (NOTE [ Reset after fork ] in core.c).  Returns 0 or -errno. */
int mpc_core_init(void);

/* Resets every subsystem in a child after fork: each lock of the core is
 * made fresh (a thread of the parent may have held it), the keeper
 * connection and slot are forgotten so that the next operation connects
 * afresh, and the parent's segments are no longer owned.  Never fails. */
void mpc_after_fork_child(void);

/* ------------------------------------------------------------------ */
/* Message rings (ring.c)                                              */
/* ------------------------------------------------------------------ */

/* A bounded multi-producer multi-consumer queue of variable-length
 * messages in a shared-memory region.  Each message is a list of block
 * references (tickets it carries) followed by payload bytes.  Waits spin
 * briefly, then sleep on a futex.  NOTE [ Ring ] in ring.c. */

typedef struct mpc_ring mpc_ring;

/* Returns the bytes a ring needs in its region for `capacity` bytes of
 * messages.  Never fails. */
uint64_t mpc_ring_footprint(uint64_t capacity);

/* Initialises a ring in a zeroed region of `size` bytes; maxitems 0 means
 * no bound on the count of messages.  Returns 0 or -EINVAL. */
int mpc_ring_init(void *region, uint64_t size, uint32_t maxitems);

/* Returns the largest message (refs included) that travels inline in the
 * ring; larger payloads are spilled into blocks.  Never fails. */
uint64_t mpc_ring_max_message(const mpc_ring *r);

/* Appends a message of any size: a payload that can never fit in the
 * ring travels in a shared-memory block whose ticket the message carries
 * (NOTE [ Ring ], Spilled messages).  deadline_ns: -1 waits for room
 * forever, 0 does not wait, else an absolute monotonic time.  Returns 0;
 * -EAGAIN when full and not waiting; -ETIMEDOUT; -EINTR (a signal: check
 * it and call again); -EPIPE when the ring was closed; -EMSGSIZE when its
 * refs alone can never fit; -ENOMEM when no block can be had for a large
 * payload.  On failure nothing is put and no block is left behind. */
int mpc_ring_put(mpc_ring *r, const mpc_ref *refs, uint32_t nrefs,
                 const void *payload, uint64_t len, int64_t deadline_ns);

/* The two halves of a put that may be retried (after -EAGAIN or -EINTR)
 * without copying a large payload again.  mpc_ring_spill returns 0 when
 * the message fits inline (put it with mpc_ring_put), or 1 having put the
 * payload into a new block whose journaled ticket it stores in *spill;
 * -EMSGSIZE, -ENOMEM (naming the size) or -errno with nothing allocated.
 * mpc_ring_put_spilled then puts refs plus *spill (counted != 0: as
 * mpc_ring_put_counted), with mpc_ring_put's returns; on success the ring
 * owns *spill, on failure the caller drops it with mpc_ref_drop when it
 * gives up. */
int mpc_ring_spill(mpc_ring *r, uint32_t nrefs, const void *payload, uint64_t len,
                   mpc_ref *spill);
int mpc_ring_put_spilled(mpc_ring *r, const mpc_ref *refs, uint32_t nrefs, const mpc_ref *spill,
                         uint64_t len, int64_t deadline_ns, int counted);

/* Removes the oldest message.  On success returns 0 and hands over, in
 * malloc'd buffers the caller frees, the refs (*refs, *nrefs; NULL when
 * none) and the payload (*payload, *len; a spilled payload is copied out
 * of its block, which is released).  Same error returns as put, except
 * that -EPIPE means closed and empty; -ENOMEM if malloc fails (the
 * message then stays in the ring); a spilled payload whose block cannot
 * be mapped gives mpc_block_attach's -errno, the message being lost. */
int mpc_ring_get(mpc_ring *r, mpc_ref **refs, uint32_t *nrefs, void **payload,
                 uint64_t *len, int64_t deadline_ns);

/* As mpc_ring_get, but a spilled payload is handed over uncopied: its
 * block, held by this process, goes to *block (the caller releases it),
 * *payload is NULL, *len its length, and 1 is returned instead of 0.
 * Same error returns as mpc_ring_get. */
int mpc_ring_get_block(mpc_ring *r, mpc_ref **refs, uint32_t *nrefs, void **payload,
                       uint64_t *len, mpc_block *block, int64_t deadline_ns);

/* One message of a batch for mpc_ring_put_many: refs, and either the
 * payload (len bytes) or, for a payload spilled by mpc_ring_spill, the
 * ticket of its block (spill, len then its length). */
typedef struct {
    const mpc_ref *refs;
    uint32_t nrefs;
    const void *payload;
    uint64_t len;
    const mpc_ref *spill;
} mpc_ring_msg;

/* Appends n messages all or none, in order and together (ring.c says
 * how); the returns of mpc_ring_put, and -EMSGSIZE when the batch can
 * never fit.  On failure the ring is unchanged; spilled blocks stay the
 * caller's. */
int mpc_ring_put_many(mpc_ring *r, const mpc_ring_msg *msgs, uint32_t n, int64_t deadline_ns,
                      int counted);

/* Returns the count of messages in the ring now (a snapshot).  Never fails. */
uint32_t mpc_ring_count(const mpc_ring *r);

/* Marks the ring closed: waiting and later puts get -EPIPE; gets drain
 * what is left first. */
void mpc_ring_close(mpc_ring *r);

/* Calls fn(ref, arg) for each ref of each undelivered message (spilled
 * payloads' block tickets included) and empties the ring.  Used when a
 * queue is freed, so its tickets are dropped.  Never fails (a corrupt ring
 * is emptied without calls). */
void mpc_ring_drain(mpc_ring *r, void (*fn)(const mpc_ref *, void *), void *arg);

/* Checks that region (size bytes) holds an initialised ring that fits in
 * it.  Returns 0, or -EINVAL with a message saying what is wrong. */
int mpc_ring_check(const void *region, uint64_t size);

/* Returns 1 if the ring was closed, 0 if not, -EINVAL if r is not a ring. */
int mpc_ring_is_closed(const mpc_ring *r);

/* As mpc_ring_put, and also adds one unfinished task (JoinableQueue.put)
 * atomically with the message; -EOVERFLOW if 2^32-1 tasks are unfinished.
 * On any failure neither the ring nor the task count changes. */
int mpc_ring_put_counted(mpc_ring *r, const mpc_ref *refs, uint32_t nrefs, const void *payload,
                         uint64_t len, int64_t deadline_ns);

/* Task accounting for JoinableQueue: task_add adds one unfinished task;
 * task_done removes one (-EINVAL if none is unfinished); join waits until
 * none is.  join's returns are those of mpc_futex_wait. */
int mpc_ring_task_add(mpc_ring *r);
int mpc_ring_task_done(mpc_ring *r);
int mpc_ring_join(mpc_ring *r, int64_t deadline_ns);

/* ------------------------------------------------------------------ */
/* The zygote (proc.c)                                                 */
/* ------------------------------------------------------------------ */

/* NOTE [ Zygote ] in proc.c. */

#define MPC_ZMAX_FDS 16

/* The zygote's wire format, its one definition: the module exports these
 * (ZYGOTE_* in py_proc.c, with the header's layout) and _zygote.py builds
 * its struct from them.  A request is a header, the fds by SCM_RIGHTS, and
 * then either len payload bytes on the stream or, with MPC_ZF_MEMFD, none:
 * the payload is the first len bytes of the last fd, a memfd sealed
 * against shrinking (NOTE [ Zygote payloads ] in proc.c). */
#define MPC_ZMAGIC 0x5a59474fu /* "OGYZ" */
enum { MPC_ZOP_SPAWN = 1, MPC_ZOP_STARTED, MPC_ZOP_FAILED, MPC_ZOP_EXIT };
#define MPC_ZF_MEMFD 1u
/* SPAWN: once the child has exited and EXIT is sent, the zygote sends the
 * requester SIGCHLD, as the kernel does to a parent (NOTE [ A child's
 * parent ] in proc/_inherit.py). */
#define MPC_ZF_SIGCHLD 2u
#define MPC_ZINLINE_MAX (64u << 20) /* larger payloads must come in a memfd */

typedef struct {
    uint32_t magic;
    uint32_t op;
    uint64_t token; /* request: chosen by the requester; replies echo it */
    int64_t arg;    /* STARTED: pid; FAILED: errno; EXIT: pid */
    int64_t arg2;   /* FAILED: detail; EXIT: wait status */
    uint64_t len;   /* SPAWN: payload bytes */
    uint32_t nfds;  /* SPAWN: fds passed with the header (the memfd included) */
    uint32_t flags; /* SPAWN: MPC_ZF_* */
    int32_t targets[MPC_ZMAX_FDS]; /* SPAWN: the number each fd must get */
} mpc_zmsg;

typedef struct mpc_zygote mpc_zygote;

/* A request to start a child: the pickled process and the fds it gets. */
typedef struct {
    int client;
    uint64_t token;
    uint32_t flags;  /* MPC_ZF_* */
    char *payload;   /* malloc'd, or a read-only mapping when maplen != 0 */
    uint64_t len;
    uint64_t maplen; /* bytes mapped at payload (a memfd payload), or 0 */
    int nfds;
    int fds[MPC_ZMAX_FDS];     /* received here */
    int targets[MPC_ZMAX_FDS]; /* the number each must have in the child */
} mpc_zreq;

/* Sets up the zygote's books: root is the program's first process (its
 * end closes when the program ends), lsock the listening socket.  Blocks
 * SIGCHLD (read through a signalfd) and ignores SIGINT.  Returns 0 or
 * -errno. */
int mpc_zygote_open(int root, int lsock, mpc_zygote **z);

/* Serves until a request to start a child arrives (returns 1 and fills
 * req) or the program has ended (returns 0, having killed every child).
 * Reaps children and reports their exit on the way (then sends SIGCHLD
 * to the requester of each that asked for it).  Returns -errno if polling
 * fails. */
int mpc_zygote_wait(mpc_zygote *z, mpc_zreq *req);

/* Threads of this process now, or -errno. */
int mpc_zygote_threads(void);

/* In the zygote after fork: records the child (pid > 0) and answers
 * STARTED, or answers FAILED with err and detail (pid <= 0); frees the
 * request.
 * Never fails: a requester that cannot be told is dropped, and its
 * children are killed. */
void mpc_zygote_started(mpc_zygote *z, mpc_zreq *req, pid_t pid, int err, int64_t detail);

/* Starts a service of the program (NOTE [ Starting a service ]): binds a
 * fresh abstract address named after prefix for sockets of `type`
 * (SOCK_SEQPACKET or SOCK_STREAM), and spawns the command tmpl
 * with fd 3 connected to this process (its end stored in *sock) and fd 4
 * listening on the address; stdin and stdout are /dev/null, stderr too
 * unless MPCORE_DEBUG is set.  Stores the address in name (at least 64
 * bytes) and the pid in *pid.  Returns 0 or -errno; nothing is left open
 * on failure. */
int mpc_spawn_service(char *const tmpl[], const char *prefix, int type, char *name, size_t namelen,
                      int *sock, pid_t *pid);

/* The sockets of a service that the caller starts itself (the zygote forked
 * from the program: NOTE [ The zygote costs only programs that use it ] in
 * _zygote.py): binds a fresh abstract address as mpc_spawn_service does and
 * stores it in name; *mine is this process's end of a connected pair,
 * *theirs the service's end (fd 3 of a spawned service) and *lsock the
 * listening socket (its fd 4), both above fd 15; all close-on-exec.
 * Returns 0 or -errno with nothing left open. */
int mpc_service_sockets(const char *prefix, int type, char *name, size_t namelen, int *mine,
                        int *theirs, int *lsock);

/* Frees a request's payload and closes its fds.  Never fails. */
void mpc_zreq_free(mpc_zreq *req);

/* Frees (or unmaps) only a request's payload, as a child does once it has
 * copied it.  Never fails. */
void mpc_zreq_free_payload(mpc_zreq *req);

/* The requester's side of a large payload: a memfd of len bytes (len > 0)
 * holding a copy of p, sealed against shrinking and growing, for a request with
 * MPC_ZF_MEMFD.  Stores the fd (close-on-exec) in *fd and returns 0, or
 * -ENOMEM (naming the size and what was available) or another -errno with
 * nothing left open. */
int mpc_zygote_payload_fd(const void *p, uint64_t len, int *fd);

/* In the child right after fork: dies with the zygote (exits at once if
 * the zygote is already gone), unblocks SIGCHLD (the zygote's other
 * blocked signals, and all dispositions, stay the zygote's for the caller
 * to set: a signal sent meanwhile waits), puts the handed fds on their
 * numbers and closes every other fd but stdio, and frees the zygote's
 * books.  Returns 0 or -errno. */
int mpc_zygote_child_setup(mpc_zygote *z, mpc_zreq *req, pid_t zygote_pid);

/* Arranges that this process receives `sig` once process `pid` has ended
 * (NOTE [ Dying with a process ] in proc.c).  When pid is this process's
 * parent and `thread_lasts` is non-zero (the parent thread that forked
 * this process lives as long as the parent process), PR_SET_PDEATHSIG does
 * it; otherwise a detached thread of this process waits on a pidfd of pid
 * and sends sig to this process when pid exits.  A pid that is not this
 * process's parent must still name the process the caller means (the
 * caller rules out its reuse).  Returns 0 once armed; -ESRCH if pid is
 * already gone (nothing is armed and no signal sent: the caller decides);
 * -EINVAL for a bad pid or signal; -ENOSYS without pidfds (Linux < 5.3);
 * another -errno if the pidfd or thread cannot be made.  Nothing is left
 * armed or open on failure. */
int mpc_die_with(pid_t pid, int sig, int thread_lasts);


/* ------------------------------------------------------------------ */
/* DataLoader worker pool (pool.c) and collation (collate.c)           */
/* ------------------------------------------------------------------ */

/* The main process's books on a pool of DataLoader workers: which worker
 * each batch index goes to, how many tasks are in flight, and the results
 * that came back early, so that batches are handed out in order.  Results
 * are opaque pointers the caller owns; the pool only keeps them.
 * NOTE [ Dispatch and reassembly ] in pool.c. */
typedef struct mpc_pool mpc_pool;

/* Creates the books for nworkers workers with prefetch tasks each in
 * flight at most; in_order != 0 hands results out in task order.  drop
 * frees a kept result when the pool is reset or freed.  Returns 0 and sets
 * *out, -EINVAL for a count below 1, or -ENOMEM. */
int mpc_pool_new(int nworkers, int prefetch, int in_order, void (*drop)(void *),
                 mpc_pool **out);

/* Frees the books and every kept result.  Never fails. */
void mpc_pool_free(mpc_pool *p);

/* Starts a new epoch: every worker active, no task in flight, kept results
 * dropped.  Never fails. */
void mpc_pool_reset(mpc_pool *p);

/* Makes `worker` the first one the round robin looks at for the next task
 * (a resumed epoch goes on after the worker of its last batch).  Returns 0,
 * or -EINVAL (with a message) when there is no such worker. */
int mpc_pool_start_at(mpc_pool *p, int worker);

/* Chooses the worker for the next task (round robin over the active ones;
 * with in_order == 0, one with fewer than its share in flight) and records
 * the task.  Returns 0 and sets *worker and *task; -EAGAIN when no worker
 * can take it (the task is not recorded); -ENOSPC when the prefetch bound
 * is already reached; -ENOMEM. */
int mpc_pool_dispatch(mpc_pool *p, int *worker, uint64_t *task);

/* The next result to hand out.  Returns 1 with *worker and *data (now the
 * caller's) when one is ready; 0 when the caller must wait for the next
 * result to arrive; -EPIPE when every recorded task has been handed out
 * (the epoch is over).  Tasks of workers marked inactive are skipped. */
int mpc_pool_next(mpc_pool *p, int *worker, void **data);

/* Records the result of a task that arrived.  Returns 1 with *worker when
 * it is to be handed out now (data stays the caller's), 0 when the pool
 * keeps it until its turn, or -EINVAL (with data still the caller's) when
 * no such task is in flight. */
int mpc_pool_arrived(mpc_pool *p, uint64_t task, void *data, int *worker);

/* Notes that a task's result was handed out to the program, which frees
 * a place in its worker's share.  Never fails. */
void mpc_pool_delivered(mpc_pool *p, int worker);

/* Notes that a task came back without a result (its worker's iterable
 * ran out), and marks that worker inactive for the epoch.  Returns 0, or
 * -EINVAL for an unknown task. */
int mpc_pool_ended(mpc_pool *p, uint64_t task, int worker);

/* Marks a worker inactive for the rest of the epoch.  Never fails. */
void mpc_pool_deactivate(mpc_pool *p, int worker);

/* Counters for stats: tasks in flight (sent, result not yet arrived) and
 * results kept early.  Never fail. */
uint64_t mpc_pool_outstanding(const mpc_pool *p);
uint64_t mpc_pool_kept(const mpc_pool *p);
int mpc_pool_active(const mpc_pool *p, int worker);

/* The one definition of a pool message's header: every message on a
 * pool's result ring starts with it, little-endian, and the rest is the
 * kind's payload (NOTE [ Worker messages ] in data/_worker.py).  The
 * binding exports its size, offsets and kinds to Python. */
typedef struct {
    uint64_t task;   /* the task's number in its epoch (0 for RESUME, DIED) */
    uint32_t worker; /* the worker's index */
    uint32_t kind;   /* enum mpc_pool_kind */
} mpc_pool_msg;

enum mpc_pool_kind {
    MPC_POOL_COLLATED = 0, /* a batch collated into one block */
    MPC_POOL_PICKLED = 1,  /* a batch as an encoded pickle */
    MPC_POOL_ERROR = 2,    /* an exception from the worker */
    MPC_POOL_END = 3,      /* the worker's iterable ran out */
    MPC_POOL_RESUME = 4,   /* the worker acknowledges a new epoch */
    MPC_POOL_DIED = 5,     /* the worker's process ended (from the watcher) */
    MPC_POOL_NKINDS
};

/* Watches worker's process (pid) through a pidfd, so that its end puts an
 * MPC_POOL_DIED message for it on ring (NOTE [ Watching workers ] in
 * pool.c).  The pidfd is opened now; the watching thread starts with
 * mpc_pool_watch_start.  Returns 0; -EINVAL for a bad worker or pid;
 * -ESRCH when the process has already been reaped; another -errno from
 * pidfd_open.  A worker watched again replaces its pidfd. */
int mpc_pool_watch(mpc_pool *p, int worker, pid_t pid, mpc_ring *ring);

/* Starts the watching thread if pidfds are watched and it is not running.
 * Returns 0 or -errno (the thread could not start; nothing watches). */
int mpc_pool_watch_start(mpc_pool *p);

/* Stops the watching thread and closes the pidfds; no DIED message is
 * put after it returns.  Never fails.  Called by mpc_pool_free. */
void mpc_pool_unwatch(mpc_pool *p);

/* Copies n pieces of piece bytes each, src[i] to dst + i * piece, so that
 * they lie end to end.  Never fails. */
void mpc_gather(void *dst, void *const *src, size_t piece, size_t n);

/* ------------------------------------------------------------------ */
/* Collectives over shared memory (coll.c and the files coll.h lists) */
/* ------------------------------------------------------------------ */

/* NOTE [ Shared-memory collectives ] in coll.c. */
#define MPC_COLL_MAX_RANKS 64
/* Element types and reductions; the codes are fixed (new ones go at the
 * end), and their names (torch's) are what mpc_coll_dtype_name and
 * mpc_coll_op_name return. */
enum { MPC_DT_F32, MPC_DT_F64, MPC_DT_F16, MPC_DT_BF16, MPC_DT_I32, MPC_DT_I64, MPC_DT_U8,
       MPC_DT_BOOL, MPC_DT_I8, MPC_DT_I16, MPC_DT_U16, MPC_DT_U32, MPC_DT_U64, MPC_DT_COUNT };
enum { MPC_OP_SUM, MPC_OP_AVG, MPC_OP_PROD, MPC_OP_MIN, MPC_OP_MAX, MPC_OP_BAND, MPC_OP_BOR,
       MPC_OP_BXOR, MPC_OP_COUNT };
enum { MPC_COLL_ALL_REDUCE = 1, MPC_COLL_BROADCAST, MPC_COLL_BARRIER, MPC_COLL_ALL_GATHER,
       MPC_COLL_REDUCE_SCATTER, MPC_COLL_REDUCE, MPC_COLL_GATHER, MPC_COLL_SCATTER,
       MPC_COLL_ALL_TO_ALL, MPC_COLL_KINDS };

typedef struct mpc_coll mpc_coll;
typedef struct mpc_coll_buf mpc_coll_buf;

/* Returns the bytes of an element of a dtype code, or 0 for an unknown
 * code. */
size_t mpc_coll_dtype_size(int dtype);

/* The name of a dtype code as torch spells it ("float32", "bool", ...) or
 * of an op code ("SUM", "BAND", ...); NULL for an unknown code.  Never
 * fails. */
const char *mpc_coll_dtype_name(int dtype);
const char *mpc_coll_op_name(int op);

/* Returns 1 when the collectives reduce dtype with op, 0 otherwise (an
 * unknown code included): every op applies to every dtype but AVG, which
 * applies to the floating-point ones only, and BAND, BOR and BXOR, which
 * apply to the integer ones and bool only.  Never fails. */
int mpc_coll_reduces(int dtype, int op);

/* Returns the bytes of the shared region of a group of `world` ranks that
 * stages `chunk` bytes per rank.  Never fails. */
uint64_t mpc_coll_footprint(int world, uint64_t chunk);

/* Makes the shared region of a new group (a sealed, reserved memfd) and
 * returns its fd in *fd.  Returns 0, -EINVAL for a world outside 1..64 or a
 * chunk that is not a multiple of 4096, -ENOMEM (message names the sizes),
 * or -errno. */
int mpc_coll_create(int world, uint64_t chunk, int *fd);

/* Maps the group in fd as `rank` of `world` and records this process's
 * pid in it.  direct: this rank may copy straight between its memory and
 * its peers' (NOTE [ Copies between ranks' memory ] in coll_copy.c); 0 keeps
 * every byte in the region.  Returns 0 and sets *out, or -EINVAL (not a
 * group, or a rank or world that does not fit it), -ENOMEM or -errno. */
int mpc_coll_attach(int fd, int rank, int world, int direct, mpc_coll **out);

/* Starts watching every peer's pid (after all have attached) so that a
 * peer that exits breaks the group instead of hanging it, and finds
 * whether this rank can copy from and into every peer.  Returns 0, or
 * -errno naming the rank that could not be watched. */
int mpc_coll_watch(mpc_coll *c);

/* 1 when every rank found that it can copy from and into every peer (so
 * large data movers copy directly), else 0.  Never fails. */
int mpc_coll_direct(const mpc_coll *c);

/* What the group's messages call its ranks: labels[q] for rank q (world
 * entries; the global ranks of a subgroup), where they say "rank q" by
 * default.  Every rank should set the same.  Never fails. */
void mpc_coll_set_labels(mpc_coll *c, const int *labels);

/* fn(arg) is called when a wait is interrupted by a signal; non-zero means
 * give up: the call then breaks the group and returns -EINTR. */
void mpc_coll_set_interrupt(mpc_coll *c, int (*fn)(void *), void *arg);

/* Breaks the group on behalf of this rank, with `why` as the message that
 * every rank's current and later calls fail with (the first break's
 * message is kept); wakes every waiting rank.  Never fails. */
void mpc_coll_break(mpc_coll *c, const char *why);

/* The pid of a rank (as it attached), or -1.  Never fails. */
int mpc_coll_pid(const mpc_coll *c, int rank);

/* The number of ranks of the group.  Never fails. */
int mpc_coll_world(const mpc_coll *c);

/* Leaves this rank's counts in the region for a later attach (mpc_coll_attach
 * goes on from them), unmaps the group and closes its pidfds.  Never fails. */
void mpc_coll_close(mpc_coll *c);

/* Group buffers: memory that the other ranks of a group map when a
 * collective names it.  buf_new makes one of at least nbytes (rounded up to
 * pages, reserved so that a shortage is -ENOMEM now and never a bus error
 * later) and returns 0, -EINVAL for 0 bytes, -ENOMEM or -errno.  buf_free
 * releases its memory at once, even where peers still map it; never fails.
 * buf_addr returns its address here and its size in *nbytes. */
int mpc_coll_buf_new(uint64_t nbytes, mpc_coll_buf **out);
void mpc_coll_buf_free(mpc_coll_buf *b);
void *mpc_coll_buf_addr(const mpc_coll_buf *b, uint64_t *nbytes);

/* The collectives.  Every rank of the group must call the same one with
 * the same size, dtype, op and root, in the same order.  deadline_ns: -1
 * waits forever, else an absolute monotonic time.  Each returns 0, or:
 * -EINVAL when the arguments are bad or the ranks disagree (every rank
 * gets the error, naming what each asked for); -ETIMEDOUT naming the ranks
 * that did not arrive; -EPIPE when a rank exited (naming it) or the group
 * was broken before; -EINTR when the interrupt callback said to give up.
 * After -ETIMEDOUT, -EPIPE or -EINTR the group is broken for good.
 *   all_reduce: buf (count elements) becomes the reduction over the ranks.
 *     `in` names the group buffer that holds buf, or is NULL; when every
 *     rank names one, the data moves between the buffers directly
 *     (NOTE [ Group buffers ]).  -EINVAL if buf does not lie in `in`.
 *   broadcast: root's nbytes of buf are copied to every rank's buf.
 *   barrier: returns once every rank has called it.
 *   all_gather: out (world * nbytes) gets every rank's in, in rank order.
 *   reduce_scatter: out (count elements) gets this rank's slice of the
 *     reduction of every rank's in (world * count elements).
 *   For both, `in_buf` names the group buffer that holds in, or is NULL,
 *   as all_reduce's `in`: when every rank names one, each reads the
 *   peers' inputs where they lie.  out may hold in (this rank's part of
 *   an all_gather's out; an in-place reduce_scatter's out is this rank's
 *   slice of in) or overlap it otherwise (at the cost of a copy: NOTE
 *   [ Movers write where no one reads ] in coll.c). */
int mpc_coll_all_reduce(mpc_coll *c, void *buf, uint64_t count, int dtype, int op,
                        const mpc_coll_buf *in, int64_t deadline_ns);
int mpc_coll_broadcast(mpc_coll *c, void *buf, uint64_t nbytes, int root, int64_t deadline_ns);
int mpc_coll_barrier(mpc_coll *c, int64_t deadline_ns);
int mpc_coll_all_gather(mpc_coll *c, void *out, const void *in, uint64_t nbytes,
                        const mpc_coll_buf *in_buf, int64_t deadline_ns);

/* mpc_coll_barrier in two halves, for a caller that would let others run
 * while it waits (a Python binding releases the GIL between them).  _start
 * arrives at the group's next barrier and looks up to `looks` times (none
 * with more ranks than CPUs) whether every rank has: 1 when they have, and
 * the barrier is over (its errors as mpc_coll_barrier's), or 0, and the
 * caller must then call mpc_coll_barrier_end, the group's next call, which
 * waits until deadline_ns and returns what mpc_coll_barrier would. */
int mpc_coll_barrier_start(mpc_coll *c, int looks);
int mpc_coll_barrier_end(mpc_coll *c, int64_t deadline_ns);
int mpc_coll_reduce_scatter(mpc_coll *c, void *out, const void *in, uint64_t count, int dtype,
                            int op, const mpc_coll_buf *in_buf, int64_t deadline_ns);

/* More collectives, with the same rules and errors as those above.  A
 * reduction's op must suit its dtype: AVG only for floating-point dtypes,
 * BAND, BOR and BXOR only for integer ones and bool (-EINVAL naming both
 * otherwise).  For bool, SUM and MAX are a logical or, PRODUCT and MIN a
 * logical and.  The data movers (gather, scatter, all_to_all, send, recv)
 * move bytes and take data of any type.
 *   reduce: root's buf (count elements) becomes the reduction over the
 *     ranks; the other ranks' buf is left as it was.  `in` as all_reduce's.
 *   gather: on the root, outs[q] (nbytes) gets rank q's in; outs is not
 *     read (and may be NULL) elsewhere.
 *   scatter: every rank's out (nbytes) gets the root's ins[rank]; ins is
 *     not read (and may be NULL) elsewhere.
 *   all_to_all: send[j] bytes of in (the pieces for ranks 0..world-1 end
 *     to end) go to rank j, and out gets recv[i] bytes from each rank i, end
 *     to end; in and out must not overlap.  send and recv hold `world`
 *     sizes each.  When a rank's send size to j differs from j's recv size
 *     from it, every rank returns -EINVAL naming both ranks and sizes.
 *     in_buf: NULL, or the group buffer that holds in (all_reduce's `in`);
 *     -EINVAL when in's bytes do not lie in it. */
int mpc_coll_reduce(mpc_coll *c, void *buf, uint64_t count, int dtype, int op, int root,
                    const mpc_coll_buf *in, int64_t deadline_ns);
int mpc_coll_gather(mpc_coll *c, void *const *outs, const void *in, uint64_t nbytes, int root,
                    int64_t deadline_ns);
int mpc_coll_scatter(mpc_coll *c, void *out, const void *const *ins, uint64_t nbytes, int root,
                     int64_t deadline_ns);
int mpc_coll_all_to_all(mpc_coll *c, void *out, const void *in, const uint64_t *send,
                        const uint64_t *recv, const mpc_coll_buf *in_buf, int64_t deadline_ns);

/* Point to point, through the mailboxes of the group's region (NOTE
 * [ Mailboxes ] in coll_p2p.c).  Only the ranks named take part, and messages
 * from one rank to another arrive in the order they were sent.
 *   send: sends nbytes of buf to rank dst with a tag; returns once the
 *     last byte is in dst's mailbox (a message larger than the mailbox is
 *     streamed: it returns once dst has taken all but the last mailbox's
 *     worth; or dst copies it from buf, and it returns once dst has).
 *     -EINVAL for a dst that is not another rank of the group.
 *   recv: receives the oldest message with this tag from rank src (-1:
 *     from whichever rank has one first) into buf; returns the source
 *     rank.  Older messages with other tags are held for later recvs.  A
 *     message of another size is -EINVAL naming both sizes (the message
 *     stays for a recv that fits), -ENOMEM when a message to hold finds no
 *     memory, -EINVAL too for a src that is not another rank or -1.
 * Both: -ETIMEDOUT naming the peer, -EPIPE naming a rank that exited,
 * -EINTR as the collectives; after these the group is broken for good.
 * A collective, a recv and sends to different ranks may run at once from
 * different threads; two collectives, two recvs or two sends to one rank
 * may not. */
int mpc_coll_send(mpc_coll *c, const void *buf, uint64_t nbytes, int dst, uint32_t tag,
                  int64_t deadline_ns);

/* send, only when the whole message fits in dst's mailbox now: returns 1
 * once it is there, 0 (having done nothing) when it does not fit, or
 * send's errors.  Never waits. */
int mpc_coll_try_send(mpc_coll *c, const void *buf, uint64_t nbytes, int dst, uint32_t tag);
int mpc_coll_recv(mpc_coll *c, void *buf, uint64_t nbytes, int src, uint32_t tag,
                  int64_t deadline_ns);

/* ------------------------------------------------------------------ */
/* NCCL, loaded at run time (nccl.c)                                   */
/* ------------------------------------------------------------------ */

/* NCCL's unique id, as ncclGetUniqueId makes it (128 bytes). */
typedef struct {
    char internal[128];
} mpc_nccl_id;

/* Loads NCCL once per process: the copy already loaded (torch's), else the
 * first of paths that loads, else the system's libnccl.so.2.  Sets *where
 * to a description of what was loaded.  Returns 0, -ENOENT naming what was
 * tried, or -ENOSYS when the library lacks a function mpcore needs. */
int mpc_nccl_load(const char *const *paths, int npaths, const char **where);

/* Thin calls into NCCL.  dtype and op are mpcore's codes (MPC_DT_*,
 * MPC_OP_*); comm is what mpc_nccl_comm_init made; stream a cudaStream_t
 * (NULL: the default stream); buffers are device pointers.  Each returns 0,
 * -ENOENT when NCCL is not loaded, -EINVAL for an unknown code, or -EIO
 * with NCCL's error string and last message.  The collectives are enqueued
 * on the stream and return before they finish, as in NCCL. */
int mpc_nccl_version(int *version);
int mpc_nccl_unique_id(mpc_nccl_id *id);
int mpc_nccl_comm_init(void **comm, int nranks, const mpc_nccl_id *id, int rank);
int mpc_nccl_comm_free(void *comm, int abort);
int mpc_nccl_async_error(void *comm);
int mpc_nccl_all_reduce(void *comm, const void *send, void *recv, size_t count, int dtype,
                        int op, void *stream);
int mpc_nccl_broadcast(void *comm, const void *send, void *recv, size_t nbytes, int root,
                       void *stream);
int mpc_nccl_all_gather(void *comm, const void *send, void *recv, size_t nbytes, void *stream);

#endif /* MPCORE_H */
