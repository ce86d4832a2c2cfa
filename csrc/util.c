/* util.c: error messages and debug switches shared by the whole core. */
#include "mpcore.h"

#include <pthread.h>
#include <stdarg.h>
#include <string.h>
#include <unistd.h>

int mpc_debug_enabled = 0;

static __thread char mpc__errbuf[512];

__attribute__((constructor)) static void mpc__util_init(void) {
    const char *d = getenv("MPCORE_DEBUG");
    mpc_debug_enabled = d != NULL && *d != '\0' && strcmp(d, "0") != 0;
}

int mpc_fail(int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(mpc__errbuf, sizeof mpc__errbuf, fmt, ap);
    va_end(ap);
    mpc_debug("fail(%d): %s", err, mpc__errbuf);
    return -(err < 0 ? -err : err);
}

const char *mpc_errmsg(void) { return mpc__errbuf; }

void mpc_clear_error(void) { mpc__errbuf[0] = '\0'; }

/* Large copies are split between this thread and one helper thread:
 * copying 16 MB is bound by one core's memory bandwidth, and a second core
 * adds most of its own.  The helper is joined before returning, so no
 * thread outlives the call (a process that forks must be single-threaded
 * in between). */

typedef struct {
    void *dst;
    const void *src;
    size_t n;
} mpc__copy_job;

static void *mpc__copy_thread(void *arg) {
    mpc__copy_job *j = arg;
    memcpy(j->dst, j->src, j->n);
    return NULL;
}

void mpc_copy(void *dst, const void *src, size_t n) {
    static long ncpu = 0;
    if (ncpu == 0)
        ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    pthread_t t;
    size_t half = (n / 2) & ~(size_t)4095;
    mpc__copy_job job = {(char *)dst + half, (const char *)src + half, n - half};
    if (n < MPC_COPY_SPLIT || ncpu < 2 || pthread_create(&t, NULL, mpc__copy_thread, &job) != 0) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, half);
    pthread_join(t, NULL);
}

const char *mpc_strerror(int err) {
    int e = err < 0 ? -err : err;
    switch (e) {
    case MPC_EHANDLE:
        return "invalid shared-memory handle";
    case MPC_ESTALE:
        return "stale shared-memory handle";
    case MPC_ENOSEG:
        return "unknown shared-memory segment";
    case MPC_ENOSHM:
        return "out of shared memory";
    default:
        return strerror(e);
    }
}
