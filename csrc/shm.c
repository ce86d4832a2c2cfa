/* shm.c: memfd segments and the memory they may use.
 *
 * A segment is an anonymous memfd: it has no name, so nothing is left in
 * /dev/shm or anywhere else when a process dies.  Memory is reserved with
 * posix_fallocate before anything maps it, so that a shortage is an error
 * code here and never a SIGBUS at first touch; and before reserving we
 * check what this process may still commit, because a memfd reserved past
 * a memory cgroup's limit gets the process killed by the OOM killer with no
 * error code at all.  NOTE [ Shared-memory shortage ] below. */
#include "internal.h"

#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif
#ifndef F_SEAL_SEAL
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#endif

/* NOTE [ Shared-memory shortage ]
 * The figure we compare a request with is the smallest of:
 *   - MemAvailable from /proc/meminfo;
 *   - for the memory cgroup of this process and each of its ancestors,
 *     limit - usage (v1: memory.limit_in_bytes / memory.usage_in_bytes,
 *     v2: memory.max / memory.current).
 * The check is advisory in the sense that two processes may race for the
 * last megabytes; it exists so that one oversized request, the common
 * mistake, becomes a MemoryError instead of a kill. */

static int mpc__read_u64(const char *path, uint64_t *out) {
    char buf[64];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t n;
    do {
        n = read(fd, buf, sizeof buf - 1);
    } while (n < 0 && errno == EINTR);
    int e = errno;
    close(fd);
    if (n <= 0)
        return n < 0 ? -e : -EINVAL;
    buf[n] = '\0';
    if (strncmp(buf, "max", 3) == 0) {
        *out = UINT64_MAX;
        return 0;
    }
    char *end;
    *out = strtoull(buf, &end, 10);
    return end == buf ? -EINVAL : 0;
}

/* Finds this process's memory cgroup directory (v1 "memory" controller,
 * else the v2 unified one).  Returns 1 for v1, 2 for v2, 0 if none. */
static int mpc__cgroup_dir(char *dir, size_t len) {
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (f == NULL)
        return 0;
    char line[1024];
    char v2[512] = "";
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':');
        char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (c2 == NULL)
            continue;
        *c2 = '\0';
        const char *ctrls = c1 + 1, *path = c2 + 1;
        if (*ctrls == '\0') {
            snprintf(v2, sizeof v2, "%s", path);
            continue;
        }
        /* The controller list is comma-separated. */
        char tmp[256];
        snprintf(tmp, sizeof tmp, "%s", ctrls);
        for (char *tok = strtok(tmp, ","); tok; tok = strtok(NULL, ",")) {
            if (strcmp(tok, "memory") == 0) {
                snprintf(dir, len, "/sys/fs/cgroup/memory%s", path);
                found = 1;
            }
        }
    }
    fclose(f);
    if (found)
        return 1;
    if (v2[0]) {
        snprintf(dir, len, "/sys/fs/cgroup%s", v2);
        return 2;
    }
    return 0;
}

int mpc_mem_available(uint64_t *avail, char *why, size_t whylen) {
    uint64_t best = UINT64_MAX;
    snprintf(why, whylen, "no limit found");

    FILE *f = fopen("/proc/meminfo", "re");
    if (f == NULL)
        return mpc_fail(errno, "cannot read /proc/meminfo: %s", strerror(errno));
    int found = 0;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        unsigned long long kb;
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
            best = (uint64_t)kb * 1024;
            snprintf(why, whylen, "MemAvailable");
            found = 1;
            break;
        }
    }
    int read_error = ferror(f);
    fclose(f);
    if (!found && read_error)
        return mpc_fail(EIO, "cannot read /proc/meminfo: read error");

    char dir[1024];
    int ver = mpc__cgroup_dir(dir, sizeof dir);
    while (ver) {
        char p[1100];
        uint64_t limit, usage;
        snprintf(p, sizeof p, "%s/%s", dir, ver == 1 ? "memory.limit_in_bytes" : "memory.max");
        int have = mpc__read_u64(p, &limit) == 0;
        snprintf(p, sizeof p, "%s/%s", dir, ver == 1 ? "memory.usage_in_bytes" : "memory.current");
        if (have && limit != UINT64_MAX && limit < (UINT64_MAX >> 2) &&
            mpc__read_u64(p, &usage) == 0) {
            uint64_t left = usage >= limit ? 0 : limit - usage;
            if (left < best) {
                best = left;
                snprintf(why, whylen, "memory cgroup %s: limit %" PRIu64 " MiB, used %" PRIu64 " MiB",
                         dir, limit >> 20, usage >> 20);
            }
        }
        /* Walk up to the hierarchy's root; its own files may be absent. */
        char *slash = strrchr(dir, '/');
        const char *root = ver == 1 ? "/sys/fs/cgroup/memory" : "/sys/fs/cgroup";
        if (slash == NULL || strlen(dir) <= strlen(root))
            break;
        *slash = '\0';
    }
    *avail = best;
    return 0;
}

/* Reserves [off, off+len) after the availability check.  posix_fallocate
 * returns its error instead of setting errno, and can return EINTR. */
/* Reading /proc and the cgroup files costs tens of microseconds, so a small
 * reservation may rely on a reading taken in the last 50 ms, less what has
 * been reserved since; anything larger than a sixteenth of that reading, or
 * than MPC_AVAIL_CACHED_MAX, reads again.  The absolute bound matters: the
 * limit itself can change within those 50 ms (the process moved into a
 * smaller memory cgroup), and a reservation the kernel then cannot charge
 * gets the process killed, not an error.  Faulting in a reservation of a
 * megabyte costs more than the reading, so larger ones always read. */
#define MPC_AVAIL_CACHED_MAX (1u << 20)
static pthread_mutex_t mpc__avail_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t mpc__avail_cached;
static int64_t mpc__avail_when = -1;

static int mpc__check_available(uint64_t len, uint64_t *avail, char *why, size_t whylen) {
    int64_t now = mpc_now_ns();
    pthread_mutex_lock(&mpc__avail_lock);
    if (mpc__avail_when >= 0 && now - mpc__avail_when < 50000000 &&
        len <= MPC_AVAIL_CACHED_MAX && len <= mpc__avail_cached / 16) {
        mpc__avail_cached -= len;
        pthread_mutex_unlock(&mpc__avail_lock);
        return 0;
    }
    pthread_mutex_unlock(&mpc__avail_lock);
    if (mpc_mem_available(avail, why, whylen) < 0)
        return 0; /* no figure to check against: let posix_fallocate decide */
    pthread_mutex_lock(&mpc__avail_lock);
    mpc__avail_cached = *avail > len ? *avail - len : 0;
    mpc__avail_when = now;
    pthread_mutex_unlock(&mpc__avail_lock);
    return len > *avail ? -ENOMEM : 0;
}

void mpc__shm_after_fork_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&mpc__avail_lock, &fresh, sizeof fresh);
    mpc__avail_when = -1; /* the parent's figure: read again */
}

static int mpc__reserve(int fd, uint64_t off, uint64_t len) {
    uint64_t avail = 0;
    char why[512];
    if (mpc__check_available(len, &avail, why, sizeof why) < 0)
        return mpc_fail(MPC_ENOSHM,
                        "cannot allocate %" PRIu64 " bytes (%.1f MiB) of shared memory: "
                        "only %" PRIu64 " bytes (%.1f MiB) available (%s)",
                        len, len / 1048576.0, avail, avail / 1048576.0, why);
    int r;
    do {
        r = posix_fallocate(fd, (off_t)off, (off_t)len);
    } while (r == EINTR);
    if (r == ENOSPC || r == ENOMEM || r == EFBIG)
        return mpc_fail(MPC_ENOSHM, "cannot allocate %" PRIu64 " bytes (%.1f MiB) of shared memory: %s",
                        len, len / 1048576.0, strerror(r));
    if (r != 0)
        return mpc_fail(r, "posix_fallocate of %" PRIu64 " bytes failed: %s", len, strerror(r));
    return 0;
}

int mpc_memfd_reserve(int fd, uint64_t off, uint64_t len) {
    return len ? mpc__reserve(fd, off, len) : 0;
}

/* MFD_NOEXEC_SEAL is EINVAL before Linux 6.3; remember the first answer. */
static _Atomic int mpc__noexec_ok = 1;

int mpc_memfd_create(uint64_t size, uint64_t reserve, int *fdp) {
    if (size == 0 || size % MPC_PAGE || reserve > size)
        return mpc_fail(EINVAL, "bad segment size %" PRIu64, size);
    unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING;
    int fd = -1;
    if (atomic_load(&mpc__noexec_ok)) {
        fd = (int)syscall(SYS_memfd_create, "mpcore", flags | MFD_NOEXEC_SEAL);
        if (fd < 0 && errno == EINVAL)
            atomic_store(&mpc__noexec_ok, 0);
    }
    if (fd < 0)
        fd = (int)syscall(SYS_memfd_create, "mpcore", flags);
    if (fd < 0)
        return mpc_fail(errno, "memfd_create failed: %s", strerror(errno));

    int r;
    if (ftruncate(fd, (off_t)size) < 0) {
        r = mpc_fail(errno == EFBIG ? MPC_ENOSHM : errno, "cannot size a %" PRIu64 "-byte segment: %s",
                     size, strerror(errno));
        goto err;
    }
    if ((r = mpc_memfd_reserve(fd, 0, reserve)) < 0)
        goto err;
    /* No peer may shrink the segment under a reader or grow it. */
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
        r = mpc_fail(errno, "cannot seal a segment: %s", strerror(errno));
        goto err;
    }
    *fdp = fd;
    return 0;
err:
    close(fd);
    return r;
}
