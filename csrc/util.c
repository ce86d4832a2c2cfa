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

/* NOTE [ Large copies go around the cache ]
 * A copy of MPC_COPY_AROUND bytes or more is written with non-temporal
 * stores, which go to memory without first reading each destination line
 * into the cache (and without pushing the reader's data out of it).  Such
 * a copy is bound by memory bandwidth, and skipping those reads takes a
 * third of the traffic away.  Measured (from a source in cache into
 * destinations in turn that are not, 2 cores), ms:
 *
 *   size    memcpy  memcpy, 2 threads  non-temporal  non-temporal, 2 threads
 *   1 MB     0.029              0.076         0.036                    0.074
 *   4 MB     0.235              0.192         0.155                    0.191
 *   16 MB    1.149              0.772         0.689                    0.684
 *   64 MB    5.390              3.841         3.349                    2.698
 *
 * and with the destination read once afterwards, as a consumer does,
 * 16 MB: 1.71, 1.40, 1.29, 1.23.  Below 4 MB memcpy stays (the data is
 * read back from the cache).  Up to MPC_COPY_SPLIT one thread does it
 * all: a helper thread gains nothing there, and it competes for a core
 * with the consumer and with torch's OpenMP workers, which spin for a
 * while after each parallel call (a 16 MB put right after torch.full took
 * 1.5 ms with a helper).  From MPC_COPY_SPLIT a helper thread takes half:
 * it gains a fifth, and a source never written (torch.empty) faults in
 * page by page on the reading thread, which two threads share
 * (torch.empty(64 MB).share_memory_(): 15.8 ms on one thread, 8.5 ms on
 * two).  glibc's memcpy switches to non-temporal stores only far above
 * these sizes (its threshold follows the cache size the machine reports). */

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2"))) static void mpc__stream_avx2(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
}

/* Copies with non-temporal stores: the destination's unaligned head and
 * its tail by memcpy, the 128-byte aligned body streamed, then a fence, so
 * that a store that publishes the data afterwards is seen after it.  A
 * CPU without AVX2 (before 2013) copies with memcpy. */
static void mpc__copy_around(void *dst, const void *src, size_t n) {
    if (!__builtin_cpu_supports("avx2")) {
        memcpy(dst, src, n);
        return;
    }
    char *d = dst;
    const char *s = src;
    size_t head = (size_t)(-(uintptr_t)d & 127);
    if (head > n)
        head = n;
    memcpy(d, s, head);
    size_t body = (n - head) & ~(size_t)127;
    mpc__stream_avx2(d + head, s + head, body);
    _mm_sfence();
    memcpy(d + head + body, s + head + body, n - head - body);
}
#else
#define mpc__copy_around memcpy
#endif

typedef struct {
    void *dst;
    const void *src;
    size_t n;
} mpc__copy_job;

static void *mpc__copy_thread(void *arg) {
    mpc__copy_job *j = arg;
    mpc__copy_around(j->dst, j->src, j->n);
    return NULL;
}

void mpc_copy(void *dst, const void *src, size_t n) {
    if (n < MPC_COPY_AROUND) {
        memcpy(dst, src, n);
        return;
    }
    static long ncpu = 0;
    if (ncpu == 0)
        ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    pthread_t t;
    size_t half = (n / 2) & ~(size_t)4095;
    mpc__copy_job job = {(char *)dst + half, (const char *)src + half, n - half};
    if (n < MPC_COPY_SPLIT || ncpu < 2 || pthread_create(&t, NULL, mpc__copy_thread, &job) != 0) {
        mpc__copy_around(dst, src, n);
        return;
    }
    mpc__copy_around(dst, src, half);
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
