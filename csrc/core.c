/* core.c: what ties the core's subsystems together, and nothing else: the
 * registrations made once per process at load, and the reset of every
 * subsystem in a child after fork.  It sits above every other file of the
 * core (NOTE [ Layers of the core ] in internal.h), so that no subsystem
 * has to reach into another.
 *
 * NOTE [ Reset after fork ]
 * fork copies a process's memory with only the calling thread.  A lock
 * that another thread of the parent held at that moment stays held in the
 * child forever, and the child's first call that takes it hangs.  So every
 * lock of the core is re-initialised here, in the child, before the child
 * runs any of the core's code: each subsystem offers a reset function for
 * its own statics, and mpc_after_fork_child calls them all.  The locks are:
 *   client.c  mpc__client_lock   the keeper connection
 *   journal.c mpc__journal_lock  this process's journal
 *   arena.c   mpc__lock          the segments mapped here
 *   shm.c     mpc__avail_lock    the cached memory-availability figure
 *   nccl.c    nccl_lock          loading NCCL
 * Loading NCCL is more than a lock: a thread inside dlopen() at the moment
 * of fork leaves the C library's list of loaded objects half-changed in
 * the child, whose next dlopen() then crashes.  So the NCCL loader's lock
 * is also taken around fork (pthread_atfork, registered once at load): the
 * fork waits until no thread is loading NCCL, and the child starts with the
 * lock fresh.
 * The pthread_once of mpc_core_init cannot be caught half-way: it runs
 * while the module loads, and Python forks only with the import lock held.
 * (The rings' mutexes live in shared memory and are robust, process-shared
 * ones: a holder in another process is not a lost thread; they need no
 * reset.)  A new lock in the core gets a reset here, or a fork test that
 * forks while a thread holds it will hang. */
#include "internal.h"

#include <pthread.h>

/* The queue's finalizer: a queue's undelivered messages carry tickets,
 * dropped before its block is freed. */
static void mpc__queue_finalizer(void *addr, uint64_t length,
                                 void (*drop)(const mpc_ref *, void *), void *arg) {
    (void)length;
    mpc_ring_drain((mpc_ring *)addr, drop, arg);
}

static pthread_once_t mpc__atfork_once = PTHREAD_ONCE_INIT;
static int mpc__atfork_err;

static void mpc__register_atfork(void) {
    mpc__atfork_err = pthread_atfork(mpc__nccl_before_fork, mpc__nccl_after_fork_parent,
                                     mpc__nccl_after_fork_child);
}

int mpc_core_init(void) {
    pthread_once(&mpc__atfork_once, mpc__register_atfork);
    if (mpc__atfork_err != 0)
        return mpc_fail(mpc__atfork_err, "cannot register the core's fork handlers: %s",
                        mpc_strerror(mpc__atfork_err));
    return mpc_block_set_finalizer(MPC_BLOCK_QUEUE, mpc__queue_finalizer);
}

void mpc_after_fork_child(void) {
    mpc__client_after_fork_child();
    mpc__journal_after_fork_child();
    mpc__arena_after_fork_child();
    mpc__shm_after_fork_child();
    mpc__nccl_after_fork_child();
}
