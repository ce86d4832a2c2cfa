/* sync.c: the monotonic clock and process-shared futex waits that every
 * blocking operation of the core (rings, task counts) is built on.
 *
 * The futex words live in shared memory mapped by several processes, so
 * the waits use FUTEX_WAIT/FUTEX_WAKE without FUTEX_PRIVATE_FLAG: the
 * kernel then keys each wait on the page itself rather than on this
 * process's address, and a wake from any process reaches it. */
#include "mpcore.h"

#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* How many times mpc_wait_change looks at the word before it sleeps.  The
 * machines this runs on may have fewer cores than processes, where a
 * waiter that spins only delays the process it is waiting for, so the spin
 * is kept to a few microseconds: enough to catch a reply that is already on
 * its way from another core, short enough to cost little when it is not. */
#define MPC_SPIN_ITERATIONS 200

/* NOTE [ Spin hints ]
 * A spin loop tells the CPU what it is doing, so that it saves power and
 * lets the other hyperthread of the core run.  On x86 that is `pause`.
 * aarch64's `yield` is a no-op on most cores, so a spin of
 * MPC_SPIN_ITERATIONS would end in a fraction of the time it takes with
 * pause; an instruction barrier (`isb`) stalls for a comparable few tens
 * of cycles, which is what Rust's spin_loop and others chose.  Elsewhere
 * the hint is nothing.  Every spin of the core uses it: mpc_cpu_relax in
 * mpcore.h. */

/* Returns the monotonic clock in nanoseconds.  Never fails: CLOCK_MONOTONIC
 * always exists on Linux. */
int64_t mpc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Sleeps while *addr == expected, until deadline_ns (-1: no deadline).
 * Returns 0 when woken, when the word had already changed, or on a
 * spurious wake-up (callers re-check their condition); -ETIMEDOUT when the
 * deadline has passed (also when it had passed before the call); -EINTR when
 * a signal handler ran; another -errno, with a message, if the futex call
 * itself is refused (a bad address), which leaves nothing changed. */
int mpc_futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t deadline_ns) {
    if (atomic_load(addr) != expected)
        return 0;
    struct timespec ts, *tsp = NULL;
    if (deadline_ns >= 0) {
        /* FUTEX_WAIT takes a relative timeout measured on CLOCK_MONOTONIC,
         * so the absolute deadline is turned into what is left of it; a
         * retry after EINTR recomputes it, so the total wait never exceeds
         * the deadline. */
        int64_t left = deadline_ns - mpc_now_ns();
        if (left <= 0)
            return -ETIMEDOUT;
        ts.tv_sec = (time_t)(left / 1000000000LL);
        ts.tv_nsec = (long)(left % 1000000000LL);
        tsp = &ts;
    }
    long rc = syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, tsp, NULL, 0);
    if (rc == 0)
        return 0;
    int e = errno;
    switch (e) {
    case EAGAIN: /* the word changed before the kernel queued us */
        return 0;
    case ETIMEDOUT:
        return -ETIMEDOUT;
    case EINTR:
        return -EINTR;
    default:
        return mpc_fail(e, "futex wait on %p failed: %s", (void *)addr, strerror(e));
    }
}

/* Wakes up to n sleepers on addr.  Never fails: the only possible errors
 * (a bad address) would already have failed the waits on the same word. */
void mpc_futex_wake(_Atomic uint32_t *addr, int n) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* Waits until *addr != expected: looks at the word a few hundred times,
 * then sleeps on the futex, looping over spurious wake-ups.  Returns 0 once
 * the word differs; -ETIMEDOUT, -EINTR or another -errno exactly as
 * mpc_futex_wait, in which case the word may still equal expected. */
int mpc_wait_change(_Atomic uint32_t *addr, uint32_t expected, int64_t deadline_ns) {
    return mpc_wait_change_spin(addr, expected, 0, deadline_ns, NULL);
}

int mpc_wait_change_spin(_Atomic uint32_t *addr, uint32_t expected, int64_t spin_ns,
                         int64_t deadline_ns, _Atomic uint32_t *sleepers) {
    for (int i = 0; i < MPC_SPIN_ITERATIONS; i++) {
        if (atomic_load_explicit(addr, memory_order_acquire) != expected)
            return 0;
        mpc_cpu_relax();
    }
    if (spin_ns > 0) {
        int64_t until = mpc_now_ns() + spin_ns;
        if (deadline_ns >= 0 && deadline_ns < until)
            until = deadline_ns;
        do {
            for (int i = 0; i < MPC_SPIN_ITERATIONS; i++) {
                if (atomic_load_explicit(addr, memory_order_acquire) != expected)
                    return 0;
                mpc_cpu_relax();
            }
        } while (mpc_now_ns() < until);
    }
    for (;;) {
        /* NOTE [ Wakes only for sleepers ]: counted before the kernel looks
         * at the word, so that a waker who saw no sleeper had changed the
         * word first, and the kernel sees the change */
        if (sleepers != NULL)
            atomic_fetch_add(sleepers, 1);
        int rc = mpc_futex_wait(addr, expected, deadline_ns);
        if (sleepers != NULL)
            atomic_fetch_sub(sleepers, 1);
        if (rc < 0)
            return rc;
        if (atomic_load(addr) != expected)
            return 0;
    }
}

/* NOTE [ Wakes only for sleepers ]
 * A FUTEX_WAKE on shared memory costs a system call (about 0.4 us here) even
 * when nobody sleeps, and the collectives' and mailboxes' waiters mostly
 * spin: a 4 KB send/recv round trip made four such calls, a barrier one.  So
 * those waiters count themselves in a word beside the one they wait on
 * while they sleep (mpc_wait_change_spin's `sleepers`), and the waker, after
 * changing the word, calls the kernel only when the count is not zero.
 * Both sides are sequentially consistent: if the waker read a count of zero,
 * the sleeper counted itself after the waker's change, and the kernel's own
 * look at the word (FUTEX_WAIT compares it first) sees the change. */

/* Wakes every sleeper on addr when *sleepers says there is one.  Call after
 * changing *addr.  Never fails. */
void mpc_wake_sleepers(_Atomic uint32_t *addr, _Atomic uint32_t *sleepers) {
    if (atomic_load(sleepers) != 0)
        mpc_futex_wake(addr, INT32_MAX);
}
