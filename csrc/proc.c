/* proc.c: the zygote's side of process creation: its server loop, the
 * set-up of a child right after fork, and the reaping of children; and
 * how a process dies with another (mpc_die_with).
 *
 * NOTE [ Zygote ]
 * `spawn` is safe because the child is a fresh interpreter, and slow for
 * the same reason: each child imports torch again.  The zygote is a clean
 * Python process, started by the program, that has imported torch once and
 * then only forks: a child forked from it is as clean as a spawned one
 * (no threads, no CUDA context, no state of the program) at fork's cost.
 *   - Requests come over a stream socket, one connection per requesting
 *     process: a header, the pickled process, and by SCM_RIGHTS the
 *     requester's stdio and the fds the child must have (each with the
 *     number it must get).  The zygote answers STARTED with the pid, and
 *     EXIT with the wait status once it has reaped the child, since only a
 *     parent can wait for a process.
 *   - When a requester's connection closes (it exited or was killed), the
 *     zygote SIGKILLs that requester's children.  When the program's first
 *     process goes (fd 3, as for the keeper), the zygote kills every child
 *     and exits.  Children get PR_SET_PDEATHSIG(SIGKILL): the zygote is
 *     single-threaded, so its one thread is the parent thread.
 *   - Python does the fork itself (PyOS_BeforeFork and friends live in the
 *     binding); this file only waits for a request, sets up the child, and
 *     keeps the books. */
#include "internal.h"

#include <dirent.h>
#include <inttypes.h>
#include <spawn.h>
#include <sys/un.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/mman.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>

extern char **environ;

/* NOTE [ Starting a service ]
 * The keeper and the zygote start the same way: an abstract address bound
 * here, before the service runs, so that a process started a moment later
 * can connect at once (its connection waits in the backlog); a socketpair
 * whose other end is the program's first process, so that the service
 * knows when the program ends; posix_spawn, so that nothing of this
 * process but those two fds reaches it. */
int mpc_service_sockets(const char *prefix, int type, char *name, size_t namelen, int *mine,
                        int *theirs, int *lsockp) {
    snprintf(name, namelen, "%s-%d-%016" PRIx64, prefix, (int)getpid(),
             (uint64_t)((uint64_t)mpc_now_ns() * 0x9E3779B97F4A7C15ULL));
    /* The address is bound here, before the service runs, so that a process
     * started a moment later can connect at once: its connection waits in
     * the backlog until the service accepts it. */
    int lsock = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    if (lsock < 0)
        return mpc_fail(errno, "socket: %s", strerror(errno));
    struct sockaddr_un sa;
    socklen_t salen = mpc__addr(name, &sa);
    if (bind(lsock, (struct sockaddr *)&sa, salen) < 0 || listen(lsock, 128) < 0) {
        int e = errno;
        close(lsock);
        return mpc_fail(e, "cannot listen on @%s: %s", name, strerror(e));
    }
    int sv[2];
    if (socketpair(AF_UNIX, type | SOCK_CLOEXEC, 0, sv) < 0) {
        int e = errno;
        close(lsock);
        return mpc_fail(e, "socketpair: %s", strerror(e));
    }
    /* The service's fds move above 4 first: dup2 onto 3 must not clobber
     * the other when it happens to be fd 3 itself. */
    int hi_pair = fcntl(sv[1], F_DUPFD_CLOEXEC, 16);
    int hi_listen = fcntl(lsock, F_DUPFD_CLOEXEC, 16);
    close(sv[1]);
    close(lsock);
    if (hi_pair < 0 || hi_listen < 0) {
        int e = errno;
        close(sv[0]);
        if (hi_pair >= 0)
            close(hi_pair);
        if (hi_listen >= 0)
            close(hi_listen);
        return mpc_fail(e, "cannot start %s: %s", prefix, strerror(e));
    }
    *mine = sv[0];
    *theirs = hi_pair;
    *lsockp = hi_listen;
    return 0;
}

int mpc_spawn_service(char *const tmpl[], const char *prefix, int type, char *name, size_t namelen,
                      int *sock, pid_t *pidp) {
    int sv[2], lsock;
    int r = mpc_service_sockets(prefix, type, name, namelen, &sv[0], &sv[1], &lsock);
    if (r < 0)
        return r;
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t at;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, sv[1], 3);
    posix_spawn_file_actions_adddup2(&fa, lsock, 4);
    /* The keeper must not hold the program's pipes open: a caller waiting
     * for the program's output to end would wait for the keeper too. */
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    if (!mpc_debug_enabled)
        posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    posix_spawnattr_init(&at);
    sigset_t none, defs;
    sigemptyset(&none);
    sigemptyset(&defs);
    sigaddset(&defs, SIGTERM);
    sigaddset(&defs, SIGPIPE);
    posix_spawnattr_setsigmask(&at, &none);
    posix_spawnattr_setsigdefault(&at, &defs);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    pid_t pid;
    r = posix_spawn(&pid, tmpl[0], &fa, &at, tmpl, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&at);
    close(sv[1]);
    close(lsock);
    if (r != 0) {
        close(sv[0]);
        return mpc_fail(r, "cannot start %s (%s): %s", prefix, tmpl[0], strerror(r));
    }
    *sock = sv[0];
    *pidp = pid;
    return 0;
}


#define MPC_ZMAX_CLIENTS 256
#define MPC_ZMAX_CHILDREN 4096

/* mpc_zmsg (mpcore.h) crosses to Python as a packed struct: no padding. */
_Static_assert(sizeof(mpc_zmsg) == 48 + 4 * MPC_ZMAX_FDS, "mpc_zmsg has padding");

struct mpc_zygote {
    int root;   /* fd 3: the program's first process */
    int listen; /* fd 4: where requesters connect */
    int sigfd;  /* SIGCHLD */
    int clients[MPC_ZMAX_CLIENTS];
    pid_t client_pid[MPC_ZMAX_CLIENTS]; /* as the kernel gave it at connect */
    pid_t child_pid[MPC_ZMAX_CHILDREN];
    int child_client[MPC_ZMAX_CHILDREN];
    uint8_t child_sigchld[MPC_ZMAX_CHILDREN]; /* MPC_ZF_SIGCHLD was asked */
};

static int mpc__zsend(int sock, const mpc_zmsg *m) {
    const char *p = (const char *)m;
    size_t left = sizeof *m;
    while (left) {
        ssize_t n = send(sock, p, left, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        left -= (size_t)n;
    }
    return 0;
}

/* Reads exactly len bytes; -1 on EOF or error. */
static int mpc__zread(int sock, void *buf, size_t len) {
    char *p = buf;
    while (len) {
        ssize_t n = recv(sock, p, len, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int mpc_zygote_open(int root, int lsock, mpc_zygote **out) {
    mpc_zygote *z = calloc(1, sizeof *z);
    if (z == NULL)
        return mpc_fail(ENOMEM, "out of memory");
    z->root = root;
    z->listen = lsock;
    for (int i = 0; i < MPC_ZMAX_CLIENTS; i++)
        z->clients[i] = -1;
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);
    z->sigfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    if (z->sigfd < 0) {
        int e = errno;
        free(z);
        return mpc_fail(e, "zygote: signalfd: %s", strerror(e));
    }
    /* Ctrl-C goes to the whole foreground group: the children get it, and
     * the zygote leaves when its program does. */
    signal(SIGINT, SIG_IGN);
    prctl(PR_SET_NAME, "mpcore-zygote", 0, 0, 0);
    *out = z;
    return 0;
}

static void mpc__zkill_children(mpc_zygote *z, int client) {
    for (int i = 0; i < MPC_ZMAX_CHILDREN; i++)
        if (z->child_pid[i] > 0 && (client < 0 || z->child_client[i] == client))
            kill(z->child_pid[i], SIGKILL);
}

static void mpc__zdrop_client(mpc_zygote *z, int c) {
    mpc_debug("zygote: requester %d gone, killing its children", c);
    mpc__zkill_children(z, c);
    close(z->clients[c]);
    z->clients[c] = -1;
}

/* Reaps every child that has exited and tells its requester. */
static void mpc__zreap(mpc_zygote *z) {
    struct signalfd_siginfo si;
    while (read(z->sigfd, &si, sizeof si) == (ssize_t)sizeof si)
        ;
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0)
            return;
        for (int i = 0; i < MPC_ZMAX_CHILDREN; i++) {
            if (z->child_pid[i] != pid)
                continue;
            int c = z->child_client[i];
            z->child_pid[i] = 0;
            if (c >= 0 && z->clients[c] >= 0) {
                mpc_zmsg m = {.magic = MPC_ZMAGIC, .op = MPC_ZOP_EXIT, .arg = pid, .arg2 = status};
                if (mpc__zsend(z->clients[c], &m) < 0)
                    mpc__zdrop_client(z, c);
                else if (z->child_sigchld[i] && z->client_pid[c] > 0)
                    kill(z->client_pid[c], SIGCHLD); /* after EXIT: its handler can read it */
            }
            break;
        }
    }
}

/* NOTE [ Zygote payloads ]
 * A request's payload (the pickled process) comes inline on the stream
 * when it is at most MPC_ZINLINE_MAX bytes, which costs one copy into the
 * socket and one out.  A larger one would hold the zygote, which serves
 * every requester from one thread, for as long as the stream takes, and
 * would need as much again in its heap: it comes instead as one more fd,
 * a memfd that the requester filled and sealed against shrinking (so that
 * the mapping cannot turn into SIGBUS under the zygote), which the zygote
 * maps read-only and hands to the child.  Its size is bounded only by
 * memory, and it is reserved when made, so a shortage is the requester's
 * MemoryError. */

/* Maps the first len bytes of a payload memfd read-only.  Returns 0 with
 * *p and *maplen set, or -errno (-EINVAL when the fd is not a memfd
 * sealed against shrinking or is shorter than len). */
static int mpc__zmap_payload(int fd, uint64_t len, char **p, uint64_t *maplen) {
    struct stat st;
    int seals = fcntl(fd, F_GET_SEALS);
    if (len == 0 || seals < 0 || !(seals & F_SEAL_SHRINK) || fstat(fd, &st) < 0 ||
        (uint64_t)st.st_size < len)
        return mpc_fail(EINVAL, "a zygote request's payload fd is not a sealed memfd of "
                        "%" PRIu64 " bytes", len);
    void *a = mmap(NULL, (size_t)len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (a == MAP_FAILED)
        return mpc_fail(errno, "zygote: cannot map a payload of %" PRIu64 " bytes: %s", len,
                        strerror(errno));
    *p = a;
    *maplen = len;
    return 0;
}

int mpc_zygote_payload_fd(const void *p, uint64_t len, int *fdp) {
    if (len == 0)
        return mpc_fail(EINVAL, "an empty payload needs no memfd");
    uint64_t size = (len + MPC_PAGE - 1) / MPC_PAGE * MPC_PAGE;
    int fd, r = mpc_memfd_create(size, size, &fd);
    if (r < 0)
        return r;
    const char *src = p;
    for (uint64_t off = 0; off < len;) {
        ssize_t n = pwrite(fd, src + off, len - off > (1u << 30) ? (1u << 30) : len - off,
                           (off_t)off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            r = mpc_fail(n < 0 ? errno : EIO, "cannot fill a %" PRIu64 "-byte payload memfd: %s",
                         len, n < 0 ? strerror(errno) : "short write");
            close(fd);
            return r;
        }
        off += (uint64_t)n;
    }
    *fdp = fd;
    return 0;
}

/* Reads one request from client c into req.  Returns 1 if a request is
 * ready, 0 if the client went away, -errno on a protocol error. */
static int mpc__zrecv(mpc_zygote *z, int c, mpc_zreq *req) {
    int sock = z->clients[c];
    mpc_zmsg m;
    int fds[MPC_ZMAX_FDS];
    int nfds = 0;
    ssize_t n = mpc__recv_fds(sock, &m, sizeof m, fds, MPC_ZMAX_FDS, &nfds);
    if (n <= 0)
        goto gone;
    /* The rest of the header may come in a later segment of the stream. */
    if ((size_t)n < sizeof m && mpc__zread(sock, (char *)&m + n, sizeof m - (size_t)n) < 0)
        goto gone;
    int in_memfd = (m.flags & MPC_ZF_MEMFD) != 0;
    if (m.magic != MPC_ZMAGIC || m.op != MPC_ZOP_SPAWN || m.nfds != (uint32_t)nfds ||
        (m.flags & ~(MPC_ZF_MEMFD | MPC_ZF_SIGCHLD)) != 0 ||
        (in_memfd ? nfds < 1 : m.len > MPC_ZINLINE_MAX))
        goto gone;
    char *payload = NULL;
    uint64_t maplen = 0;
    int err = 0;
    if (in_memfd) {
        int pfd = fds[--nfds];
        err = mpc__zmap_payload(pfd, m.len, &payload, &maplen);
        close(pfd);
    } else {
        payload = malloc(m.len ? m.len : 1);
        if (payload == NULL || mpc__zread(sock, payload, m.len) < 0) {
            free(payload);
            goto gone;
        }
    }
    req->client = c;
    req->token = m.token;
    req->flags = m.flags;
    req->payload = payload;
    req->len = m.len;
    req->maplen = maplen;
    req->nfds = nfds;
    for (int i = 0; i < nfds; i++) {
        req->fds[i] = fds[i];
        req->targets[i] = m.targets[i];
    }
    if (err < 0) {
        /* The stream is intact: refuse this request, keep the client. */
        mpc_zygote_started(z, req, 0, -err, 0);
        return 0;
    }
    return 1;
gone:
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    mpc__zdrop_client(z, c);
    return 0;
}

int mpc_zygote_wait(mpc_zygote *z, mpc_zreq *req) {
    for (;;) {
        struct pollfd p[MPC_ZMAX_CLIENTS + 3];
        int map[MPC_ZMAX_CLIENTS + 3];
        int np = 0;
        p[np++] = (struct pollfd){z->root, POLLIN, 0};
        p[np++] = (struct pollfd){z->sigfd, POLLIN, 0};
        p[np++] = (struct pollfd){z->listen, POLLIN, 0};
        for (int i = 0; i < MPC_ZMAX_CLIENTS; i++)
            if (z->clients[i] >= 0) {
                map[np] = i;
                p[np++] = (struct pollfd){z->clients[i], POLLIN, 0};
            }
        if (poll(p, (nfds_t)np, -1) < 0) {
            if (errno == EINTR)
                continue;
            return mpc_fail(errno, "zygote: poll: %s", strerror(errno));
        }
        if (p[1].revents)
            mpc__zreap(z);
        if (p[0].revents) {
            /* The program is gone: so are its children. */
            mpc__zkill_children(z, -1);
            return 0;
        }
        if (p[2].revents & POLLIN) {
            int s = accept4(z->listen, NULL, NULL, SOCK_CLOEXEC);
            if (s >= 0) {
                int slot = -1;
                for (int i = 0; i < MPC_ZMAX_CLIENTS && slot < 0; i++)
                    if (z->clients[i] < 0)
                        slot = i;
                struct ucred cr;
                socklen_t crl = sizeof cr;
                if (slot < 0)
                    close(s);
                else {
                    z->clients[slot] = s;
                    z->client_pid[slot] =
                        getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &crl) == 0 ? cr.pid : 0;
                }
            }
        }
        for (int k = 3; k < np; k++) {
            if (!p[k].revents || z->clients[map[k]] < 0)
                continue;
            int r = mpc__zrecv(z, map[k], req);
            if (r != 0)
                return r;
        }
    }
}

int mpc_zygote_threads(void) {
    DIR *d = opendir("/proc/self/task");
    if (d == NULL)
        return -errno;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n;
}

void mpc_zygote_started(mpc_zygote *z, mpc_zreq *req, pid_t pid, int err, int64_t detail) {
    mpc_zmsg m = {.magic = MPC_ZMAGIC, .token = req->token};
    if (pid > 0) {
        m.op = MPC_ZOP_STARTED;
        m.arg = pid;
        int placed = 0;
        for (int i = 0; i < MPC_ZMAX_CHILDREN && !placed; i++)
            if (z->child_pid[i] == 0) {
                z->child_pid[i] = pid;
                z->child_client[i] = req->client;
                z->child_sigchld[i] = (req->flags & MPC_ZF_SIGCHLD) != 0;
                placed = 1;
            }
        if (!placed) /* cannot keep books on it: do not let it run unwatched */
            kill(pid, SIGKILL);
    } else {
        m.op = MPC_ZOP_FAILED;
        m.arg = err;
        m.arg2 = detail;
    }
    if (z->clients[req->client] >= 0 && mpc__zsend(z->clients[req->client], &m) < 0)
        mpc__zdrop_client(z, req->client);
    mpc_zreq_free(req);
}

void mpc_zreq_free_payload(mpc_zreq *req) {
    if (req->maplen != 0)
        munmap(req->payload, (size_t)req->maplen);
    else
        free(req->payload);
    req->payload = NULL;
    req->maplen = 0;
}

void mpc_zreq_free(mpc_zreq *req) {
    for (int i = 0; i < req->nfds; i++)
        if (req->fds[i] >= 0)
            close(req->fds[i]);
    req->nfds = 0;
    mpc_zreq_free_payload(req);
}

int mpc_zygote_child_setup(mpc_zygote *z, mpc_zreq *req, pid_t zygote_pid) {
    /* Die with the zygote; it may already be gone by now. */
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    if (getppid() != zygote_pid)
        _exit(1);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    /* Move the handed fds above every target, then onto their numbers, so
     * that no dup2 overwrites an fd still to be placed. */
    int base = 3;
    for (int i = 0; i < req->nfds; i++)
        if (req->targets[i] >= base)
            base = req->targets[i] + 1;
    int hi[MPC_ZMAX_FDS];
    int top = base;
    for (int i = 0; i < req->nfds; i++) {
        hi[i] = fcntl(req->fds[i], F_DUPFD, base);
        if (hi[i] < 0)
            return mpc_fail(errno, "zygote child: dup: %s", strerror(errno));
        if (hi[i] >= top)
            top = hi[i] + 1;
    }
    for (int i = 0; i < req->nfds; i++)
        if (dup2(hi[i], req->targets[i]) < 0)
            return mpc_fail(errno, "zygote child: dup2 to %d: %s", req->targets[i],
                            strerror(errno));
    /* Keep exactly stdio and the handed fds: no fd of the zygote's (its
     * sockets, the signalfd, the keeper's connection) survives. */
    for (int fd = 3; fd < top; fd++) {
        int keep = 0;
        for (int i = 0; i < req->nfds; i++)
            keep |= req->targets[i] == fd;
        if (!keep)
            close(fd);
    }
    syscall(SYS_close_range, (unsigned)top, ~0u, 0);
    for (int i = 0; i < req->nfds; i++)
        fcntl(req->targets[i], F_SETFD, 0);
    free(z);
    return 0;
}

/* NOTE [ Dying with a process ]
 * A child started for a program must not outlive it.  The kernel's
 * PR_SET_PDEATHSIG is the cheapest way, with three limits: it fires when
 * the parent *thread* that forked the child exits, not the parent process;
 * it only knows the direct parent (not a requester whose child a fork
 * server made); and it is never delivered if the parent is gone before it
 * is set, so getppid() is checked after setting it.  Where it cannot serve
 * (the parent thread may end first, or the process to follow is not the
 * parent), a pidfd of that process is watched by a small thread: poll()
 * reports the pidfd readable once the process has exited (as a zombie
 * too), and the thread sends the signal to its own process.  The pidfd is
 * O_CLOEXEC; a process forked from this one holds a copy of it but no
 * watcher, which is harmless. */

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

typedef struct {
    int fd;
    int sig;
} mpc__watch;

static void *mpc__watch_main(void *arg) {
    mpc__watch w = *(mpc__watch *)arg;
    free(arg);
    struct pollfd p = {.fd = w.fd, .events = POLLIN};
    int r;
    do {
        r = poll(&p, 1, -1);
    } while (r < 0 && errno == EINTR);
    /* Only a readable pidfd means the process ended.  If the program closed
     * the fd under us (POLLNVAL), or its number now names a file that is not
     * a pidfd (EBADF from pidfd_send_signal), we no longer know anything:
     * stop watching rather than kill on a guess. */
    if (r == 1 && (p.revents & POLLIN) && !(p.revents & POLLNVAL) &&
        !(syscall(SYS_pidfd_send_signal, w.fd, 0, NULL, 0) < 0 && errno == EBADF))
        kill(getpid(), w.sig);
    return NULL;
}

static int mpc__pidfd_gone(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r;
    do {
        r = poll(&p, 1, 0);
    } while (r < 0 && errno == EINTR);
    return r == 1 && (p.revents & POLLIN);
}

int mpc_die_with(pid_t pid, int sig, int thread_lasts) {
    if (pid <= 0 || sig <= 0 || sig >= NSIG)
        return mpc_fail(EINVAL, "die_with: bad pid %d or signal %d", (int)pid, sig);
    int parent = pid == getppid();
    if (parent && thread_lasts) {
        if (prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) < 0)
            return mpc_fail(errno, "die_with: PR_SET_PDEATHSIG: %s", strerror(errno));
        if (getppid() == pid)
            return 0;
        prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0);
        return mpc_fail(ESRCH, "die_with: process %d is gone", (int)pid);
    }
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (fd < 0) {
        int e = errno;
        if (e == ESRCH)
            return mpc_fail(ESRCH, "die_with: process %d is gone", (int)pid);
        return mpc_fail(e, "die_with: pidfd_open(%d): %s", (int)pid, strerror(e));
    }
    /* A parent that died before pidfd_open may have had its pid reused;
     * being still its child proves that the fd names it. */
    if ((parent && getppid() != pid) || mpc__pidfd_gone(fd)) {
        close(fd);
        return mpc_fail(ESRCH, "die_with: process %d is gone", (int)pid);
    }
    mpc__watch *w = malloc(sizeof *w);
    if (w == NULL) {
        close(fd);
        return mpc_fail(ENOMEM, "die_with: out of memory");
    }
    w->fd = fd;
    w->sig = sig;
    /* The watcher takes no signal of the program's: they stay with its
     * other threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    pthread_t t;
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int r = pthread_create(&t, &attr, mpc__watch_main, w);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (r != 0) {
        free(w);
        close(fd);
        return mpc_fail(r, "die_with: cannot start a watcher thread: %s", strerror(r));
    }
    return 0;
}
