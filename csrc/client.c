/* client.c: every process's connection to its program's keeper
 * (NOTE [ Keeper ] in keeper.c): finding the keeper or starting one, the
 * HELLO that gives this process its slot and journal, and the requests
 * that register, fetch and retire segments.  One connection per process,
 * used under one lock, one request and one reply at a time.
 *
 * NOTE [ Finding the keeper ]
 * MPCORE_KEEPER names the keeper of the program this process belongs to.
 * A process starts a keeper (and sets MPCORE_KEEPER for its own children)
 * only when no one listens at that address: connect() failing with
 * ECONNREFUSED (an address whose keeper has exited) or ENOENT.  Any other
 * failure means a keeper is there.  EINTR (a signal while connect waited
 * for room in the backlog) is retried at once.  EAGAIN (the backlog of a
 * busy keeper is full: a connect waits at most a second for room, then
 * fails so) is retried after a short pause, for up to
 * MPC_CONNECT_PATIENCE_NS, after which the keeper is reported as not
 * accepting.  Starting a second keeper instead would split the program's
 * processes between two keepers, and neither could fetch the other's
 * segments. */
#include "internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/time.h>
#include <time.h>

#define MPC_CONNECT_PATIENCE_NS (30LL * 1000000000LL)

static pthread_mutex_t mpc__client_lock = PTHREAD_MUTEX_INITIALIZER;
static int mpc__sock = -1;
static int32_t mpc__slot = -1;
static char *const *mpc__spawn_argv; /* set by the binding: how to start one */
static pid_t mpc__keeper_pid = 0;      /* when this process started it */
static int mpc__is_keeper = 0;
static char mpc__name[96]; /* the keeper this process is connected to */

void mpc__client_become_keeper(void) { mpc__is_keeper = 1; }

void mpc_set_keeper_argv(char *const *argv) { mpc__spawn_argv = argv; }

pid_t mpc_keeper_pid(void) { return mpc__keeper_pid; }

/* Sends one request and receives its reply (and the fd it carries, when
 * recv_fd is not NULL).  Called with mpc__client_lock held.  Returns the
 * reply's status (0 or -errno), or -ECONNREFUSED when the connection broke
 * (it is then closed and the slot forgotten). */
static int mpc__rpc(mpc_kmsg *m, int send_fd, int *recv_fd) {
    int r = mpc__send_fd(mpc__sock, m, sizeof *m, send_fd);
    if (recv_fd)
        *recv_fd = -1;
    if (r == 0) {
        int nfds = 0;
        ssize_t n = mpc__recv_fds(mpc__sock, m, sizeof *m, recv_fd, recv_fd ? 1 : 0, &nfds);
        r = n == (ssize_t)sizeof *m ? 0 : n == 0 ? -EPIPE : n < 0 ? (int)n : -EPROTO;
        if (r < 0 && nfds > 0) {
            close(*recv_fd);
            *recv_fd = -1;
        }
    }
    if (r < 0) {
        close(mpc__sock);
        mpc__sock = -1;
        mpc__slot = -1;
        return mpc_fail(ECONNREFUSED, "lost the connection to the mpcore keeper (%s)",
                        strerror(-r));
    }
    return m->status;
}

/* Says HELLO: gets this process's slot and maps its journal.  Called with
 * mpc__client_lock held.  Returns 0, -EUSERS when every slot is taken, or
 * the errors of mpc__rpc. */
static int mpc__hello(void) {
    mpc_kmsg m = {.op = MPC_KOP_HELLO, .arg = getpid()};
    int jfd = -1;
    int r = mpc__rpc(&m, -1, &jfd);
    if (r == -EUSERS)
        r = mpc_fail(EUSERS, "too many processes use mpcore shared memory at once (%d)",
                     MPC_MAX_PROCS);
    if (r == 0 && m.arg >= 0 && m.arg < MPC_MAX_PROCS)
        mpc__journal_attach(jfd, (uint32_t)m.arg);
    if (jfd >= 0)
        close(jfd);
    if (r < 0)
        return r;
    if (m.arg < 0 || m.arg >= MPC_MAX_PROCS)
        return mpc_fail(EPROTO, "the mpcore keeper gave slot %" PRId64, m.arg);
    mpc__slot = (int32_t)m.arg;
    return 0;
}

int mpc_keeper_spawn(char *const tmpl[], char *name, size_t namelen) {
    pid_t pid;
    int r = mpc_spawn_service(tmpl, "mpcore", SOCK_SEQPACKET, name, namelen, &mpc__sock, &pid);
    if (r == 0) {
        mpc__keeper_pid = pid;
        mpc_debug("spawned keeper pid %d at @%s", (int)pid, name);
    }
    return r;
}

/* Connects a new socket to the keeper at @name (NOTE [ Finding the
 * keeper ]).  Returns 0 with the socket in *out; 1 when no one listens
 * there; or -errno with a message (-EAGAIN when the keeper's backlog stayed
 * full for MPC_CONNECT_PATIENCE_NS). */
static int mpc__connect_to(const char *name, int *out) {
    struct sockaddr_un sa;
    socklen_t l = mpc__addr(name, &sa);
    int64_t give_up = mpc_now_ns() + MPC_CONNECT_PATIENCE_NS;
    long pause_ns = 1000000;
    for (;;) {
        int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (sock < 0)
            return mpc_fail(errno, "cannot make a socket for the mpcore keeper: %s",
                            strerror(errno));
        /* A blocking connect waits for room in a full backlog; the timeout
         * turns that wait into EAGAIN after a second, so that a keeper that
         * never accepts is reported instead of waited for forever.  It is
         * cleared once connected: requests wait for their replies. */
        struct timeval tv = {1, 0}, none = {0, 0};
        setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(sock, (struct sockaddr *)&sa, l) == 0) {
            setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
            *out = sock;
            return 0;
        }
        int e = errno;
        close(sock); /* a fresh socket for each try: no half-made state */
        if (e == ECONNREFUSED || e == ENOENT)
            return 1;
        if (e == EINTR)
            continue;
        if (e == EAGAIN) {
            if (mpc_now_ns() > give_up)
                return mpc_fail(EAGAIN, "the mpcore keeper at @%s accepts no connection: its "
                                "backlog stayed full for %lld s", name,
                                (long long)(MPC_CONNECT_PATIENCE_NS / 1000000000LL));
            struct timespec ts = {0, pause_ns};
            while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
                ;
            if (pause_ns < 50000000)
                pause_ns *= 2;
            continue;
        }
        return mpc_fail(e, "cannot connect to the mpcore keeper at @%s: %s", name, strerror(e));
    }
}

/* Connects to the keeper named in MPCORE_KEEPER, or starts one when no one
 * listens there.  Called with mpc__client_lock held.  Returns 0 or -errno. */
static int mpc__connect(void) {
    if (mpc__sock >= 0)
        return 0;
    const char *name = getenv("MPCORE_KEEPER");
    if (name && *name) {
        int sock = -1;
        int r = mpc__connect_to(name, &sock);
        if (r < 0)
            return r;
        if (r == 0) {
            mpc__sock = sock;
            snprintf(mpc__name, sizeof mpc__name, "%s", name);
            return 0;
        }
    }
    /* No keeper (or the address of a program that has ended): this process
     * starts its program's keeper. */
    if (mpc__spawn_argv == NULL)
        return mpc_fail(ECONNREFUSED, "no mpcore keeper is running and none can be started");
    int r = mpc_keeper_spawn(mpc__spawn_argv, mpc__name, sizeof mpc__name);
    if (r == 0)
        setenv("MPCORE_KEEPER", mpc__name, 1);
    return r;
}

int mpc_client_connect(const char **name) {
    if (mpc__is_keeper)
        return mpc_fail(EINVAL, "the keeper is no client");
    pthread_mutex_lock(&mpc__client_lock);
    int r = mpc__connect();
    pthread_mutex_unlock(&mpc__client_lock);
    if (r == 0 && name)
        *name = mpc__name;
    return r;
}

int mpc_client_slot_ready(uint32_t *slot) {
    int32_t s = __atomic_load_n(&mpc__slot, __ATOMIC_ACQUIRE);
    if (s < 0)
        return -EAGAIN;
    *slot = (uint32_t)s;
    return 0;
}

int mpc_client_slot(uint32_t *slot) {
    if (mpc__is_keeper)
        return mpc_fail(EINVAL, "the keeper holds no blocks");
    int32_t s = __atomic_load_n(&mpc__slot, __ATOMIC_ACQUIRE);
    if (s >= 0) {
        *slot = (uint32_t)s;
        return 0;
    }
    pthread_mutex_lock(&mpc__client_lock);
    int r = 0;
    if (mpc__slot < 0) {
        r = mpc__connect();
        if (r == 0)
            r = mpc__hello();
    }
    if (r == 0)
        *slot = (uint32_t)mpc__slot;
    pthread_mutex_unlock(&mpc__client_lock);
    return r;
}

/* One request of this process (connecting and saying HELLO first if
 * needed).  Returns the reply's status or the errors of mpc_client_slot
 * and mpc__rpc. */
static int mpc__request(uint32_t op, uint64_t seg_id, int send_fd, int *recv_fd) {
    uint32_t slot;
    int r = mpc_client_slot(&slot);
    if (r < 0)
        return r;
    pthread_mutex_lock(&mpc__client_lock);
    mpc_kmsg m = {.op = op, .seg_id = seg_id};
    if (mpc__sock < 0)
        r = mpc_fail(ECONNREFUSED, "not connected to the mpcore keeper");
    else
        r = mpc__rpc(&m, send_fd, recv_fd);
    pthread_mutex_unlock(&mpc__client_lock);
    return r;
}

int mpc_client_register(uint64_t seg_id, int fd) {
    int r = mpc__request(MPC_KOP_REGISTER, seg_id, fd, NULL);
    return r < 0 && !*mpc_errmsg()
               ? mpc_fail(-r, "the keeper refused segment %016" PRIx64 ": %s", seg_id,
                          mpc_strerror(-r))
               : r;
}

int mpc_client_fetch(uint64_t seg_id, int *fd) {
    if (mpc__is_keeper)
        return mpc_fail(MPC_ENOSEG, "unknown shared-memory segment %016" PRIx64, seg_id);
    *fd = -1;
    int r = mpc__request(MPC_KOP_FETCH, seg_id, -1, fd);
    if (r == -ENOENT) /* the keeper's answer for a segment it does not know */
        return mpc_fail(MPC_ENOSEG, "unknown shared-memory segment %016" PRIx64
                        " (a forged handle, or one whose memory was freed)", seg_id);
    if (r == 0 && *fd < 0)
        return mpc_fail(EPROTO, "the keeper sent no fd for segment %016" PRIx64, seg_id);
    if (r < 0 && *fd >= 0) {
        close(*fd);
        *fd = -1;
    }
    return r;
}

int mpc_client_retire(uint64_t seg_id) {
    if (mpc__is_keeper)
        return 0;
    int r = mpc__request(MPC_KOP_RETIRE, seg_id, -1, NULL);
    mpc_clear_error();
    return r;
}

void mpc__client_after_fork_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&mpc__client_lock, &fresh, sizeof fresh);
    /* The socket is shared with the parent: closing our copy leaves the
     * parent's connection intact; this process connects afresh. */
    if (mpc__sock >= 0)
        close(mpc__sock);
    mpc__sock = -1;
    mpc__slot = -1;
}
