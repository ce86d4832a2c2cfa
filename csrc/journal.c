/* journal.c: the journal of tickets in transit, one per process slot, in
 * one memfd that the keeper makes and every client maps its part of.
 *
 * NOTE [ Journal ]
 * A ticket between a queue and a process (pickled but not yet put, or got
 * but not yet unpickled) is held by no one the keeper can see.  So each
 * process has a journal, one page set per slot in a memfd the keeper makes
 * and hands over with HELLO: a ticket is recorded there while in the
 * process's hands, and when the process dies the keeper drops what its
 * journal still lists.  An entry is published by writing its segment id
 * last, and erased by zeroing that id; the orders are chosen so that a kill
 * between two steps leaks a reference rather than dropping one twice:
 *   put: record tickets while pickling; the ring erases them once the
 *        message is in it;
 *   get: the ring records the message's tickets once it has taken it out;
 *        redeeming a ticket erases it first.
 * Those leaks are real but narrow: a SIGKILL that lands between the two
 * stores of a step (a ticket taken and not yet journaled, a journal entry
 * erased and the message not yet published, a message taken and not yet
 * journaled, an entry erased and the holder bit not yet set, a holder bit
 * cleared and the count not yet dropped) leaves one block counted until
 * the program ends and its keeper exits.  Each window is a few
 * instructions with no system call; of 2,342 random kills of a busy
 * put/get loop (1,171 rounds of tests/shm/test_shm_faults.py's kill program),
 * one hit one.  Closing them would need one atomic
 * store to change two words (a block's count and a process's private
 * state), which the hardware does not offer for a count shared by 256
 * slots; a double drop would lose data, a leak only memory.
 *
 * NOTE [ A full journal ]
 * A slot's journal holds MPC_JOURNAL_CAP entries; a process can hold more
 * tickets in transit (a loader's pool keeping many batches of many
 * tensors).  The tickets past the journal go to an overflow list in the
 * process's own memory: the keeper cannot see them, so a death then leaks
 * them, but the process itself still finds them when it forgets or drops a
 * ticket it holds.  Without it, a pool dropping kept results (which drops
 * only what its process journaled, so that a forked child never drops its
 * parent's) leaked every ticket the full journal had not taken.
 * This file only keeps the entries; dropping what a dead slot's journal
 * lists is the keeper's (it passes the drop to mpc__journal_sweep), so the
 * journal knows nothing of blocks. */
#include "internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define MPC_JOURNAL_CAP 1024

typedef struct {
    _Atomic uint64_t seg_id; /* 0: free; written last */
    uint32_t index;
    uint32_t gen;
} mpc_jentry;

typedef struct {
    mpc_jentry e[MPC_JOURNAL_CAP];
} mpc_journal;

static int mpc__journal_fd = -1;     /* keeper: the memfd of all journals */
static mpc_journal *mpc__journals;   /* keeper: all of them */
static mpc_journal *mpc__myjournal;  /* client: this process's */
static void *mpc__jmap;              /* client: its mapping */
static size_t mpc__jmaplen;
static pthread_mutex_t mpc__journal_lock = PTHREAD_MUTEX_INITIALIZER;
/* Entries at or above this index are free: scans stop there. */
static int mpc__jtop;
/* The entries the full journal did not take (NOTE [ A full journal ]). */
static mpc_ref *mpc__jover;
static size_t mpc__jover_n, mpc__jover_cap;

int mpc__journal_create(int *fd) {
    uint64_t jsize = (sizeof(mpc_journal) * MPC_MAX_PROCS + MPC_PAGE - 1) / MPC_PAGE * MPC_PAGE;
    int r = mpc_memfd_create(jsize, jsize, &mpc__journal_fd);
    if (r < 0)
        return r;
    void *p = mmap(NULL, jsize, PROT_READ | PROT_WRITE, MAP_SHARED, mpc__journal_fd, 0);
    if (p == MAP_FAILED) {
        r = mpc_fail(errno, "keeper: cannot map the journals: %s", strerror(errno));
        close(mpc__journal_fd);
        mpc__journal_fd = -1;
        return r;
    }
    mpc__journals = p;
    *fd = mpc__journal_fd;
    return 0;
}

void mpc__journal_sweep(uint32_t slot, void (*drop)(const mpc_ref *, void *), void *arg) {
    if (mpc__journals == NULL || slot >= MPC_MAX_PROCS)
        return;
    mpc_journal *j = &mpc__journals[slot];
    for (int i = 0; i < MPC_JOURNAL_CAP; i++) {
        uint64_t id = atomic_load(&j->e[i].seg_id);
        if (id == 0)
            continue;
        mpc_ref ref = {id, j->e[i].index, j->e[i].gen};
        atomic_store(&j->e[i].seg_id, 0);
        drop(&ref, arg);
    }
}

void mpc__journal_attach(int jfd, uint32_t slot) {
    if (jfd < 0 || slot >= MPC_MAX_PROCS)
        return;
    /* Only our own slot's pages: a process never touches another's. */
    uint64_t off = (uint64_t)slot * sizeof(mpc_journal);
    uint64_t start = off / MPC_PAGE * MPC_PAGE;
    size_t len = (size_t)(off + sizeof(mpc_journal) - start);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, jfd, (off_t)start);
    if (p == MAP_FAILED)
        return;
    pthread_mutex_lock(&mpc__journal_lock);
    if (mpc__jmap != NULL)
        munmap(mpc__jmap, mpc__jmaplen);
    mpc__jmap = p;
    mpc__jmaplen = len;
    mpc__jtop = 0;
    mpc__myjournal = (mpc_journal *)((uint8_t *)p + (off - start));
    pthread_mutex_unlock(&mpc__journal_lock);
}

int mpc_journal_add(const mpc_ref *ref) {
    mpc_journal *j = mpc__myjournal;
    if (j == NULL)
        return -ENOENT;
    pthread_mutex_lock(&mpc__journal_lock);
    int r = -ENOSPC;
    for (int i = 0; i < MPC_JOURNAL_CAP; i++)
        if (i >= mpc__jtop || atomic_load(&j->e[i].seg_id) == 0) {
            j->e[i].index = ref->index;
            j->e[i].gen = ref->gen;
            atomic_store(&j->e[i].seg_id, ref->seg_id);
            if (i >= mpc__jtop)
                mpc__jtop = i + 1;
            r = 0;
            break;
        }
    if (r < 0 && mpc__jover_n == mpc__jover_cap) {
        size_t cap = mpc__jover_cap ? 2 * mpc__jover_cap : 256;
        mpc_ref *p = realloc(mpc__jover, cap * sizeof *p);
        if (p == NULL)
            r = -ENOMEM;
        else {
            mpc__jover = p;
            mpc__jover_cap = cap;
        }
    }
    if (r == -ENOSPC)
        mpc__jover[mpc__jover_n++] = *ref;
    pthread_mutex_unlock(&mpc__journal_lock);
    return r;
}

int mpc_journal_clear(const mpc_ref *ref) {
    mpc_journal *j = mpc__myjournal;
    if (j == NULL)
        return 0;
    int found = 0;
    pthread_mutex_lock(&mpc__journal_lock);
    for (int i = mpc__jtop - 1; i >= 0; i--)
        if (atomic_load(&j->e[i].seg_id) == ref->seg_id && j->e[i].index == ref->index &&
            j->e[i].gen == ref->gen) {
            atomic_store(&j->e[i].seg_id, 0);
            found = 1;
            break;
        }
    while (mpc__jtop > 0 && atomic_load(&j->e[mpc__jtop - 1].seg_id) == 0)
        mpc__jtop--;
    for (size_t i = mpc__jover_n; !found && i-- > 0;)
        if (mpc__jover[i].seg_id == ref->seg_id && mpc__jover[i].index == ref->index &&
            mpc__jover[i].gen == ref->gen) {
            mpc__jover[i] = mpc__jover[--mpc__jover_n];
            found = 1;
        }
    pthread_mutex_unlock(&mpc__journal_lock);
    return found;
}

void mpc__journal_after_fork_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&mpc__journal_lock, &fresh, sizeof fresh);
    if (mpc__jmap != NULL) /* the parent's journal: never ours to write */
        munmap(mpc__jmap, mpc__jmaplen);
    mpc__jmap = NULL;
    mpc__myjournal = NULL;
    mpc__jtop = 0;
    mpc__jover_n = 0; /* the parent's too; the memory is kept for reuse */
}
