/* keeper.c: the keeper process of a program, and each process's connection
 * to it.
 *
 * NOTE [ Keeper ]
 * A memfd lives while some process has it open or mapped.  For a segment
 * to outlive the process that made it (a tensor put in a queue by a
 * producer that then exits), somebody must keep its fd: that is the
 * keeper, a small single-threaded process started by the program's first
 * process.  It
 *   - holds the fd of every segment and hands it, by SCM_RIGHTS, to a
 *     process that meets a handle of a segment it has not mapped yet, so a
 *     segment's fd reaches each process once, not once per tensor;
 *   - gives each connected process a slot (its bit in blocks' `holders`),
 *     and when the connection closes, because the process exited or was
 *     killed, drops every hold of that slot and marks the segments it owned
 *     as orphans, retiring those left with no live block;
 *   - exits when no process is connected any more, closing the fds, so
 *     that nothing of the program outlives it.
 * Its address is an abstract Unix socket (no file), named in MPCORE_KEEPER
 * for the processes the program starts.  The first process is connected
 * through a socketpair made before the keeper is spawned, so the keeper
 * cannot miss it; its reply to HELLO comes after the keeper listens.
 *
 * The protocol is one fixed-size message each way on SOCK_SEQPACKET.
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
 *        redeeming a ticket erases it first. */
#include "mpcore.h"

#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

extern char **environ;

enum { OP_HELLO = 1, OP_REGISTER, OP_FETCH, OP_RETIRE };

typedef struct {
    uint32_t op;
    int32_t status; /* reply: 0 or -errno */
    uint64_t seg_id;
    int64_t arg;    /* HELLO: pid, reply: slot */
} mpc_kmsg;

/* Defined in arena.c. */
extern int (*mpc__retire_hook)(uint64_t seg_id);
int mpc__keeper_map(uint64_t seg_id, int fd, mpc_seg_header **hdr);
int mpc__keeper_fd(uint64_t seg_id);
int mpc__keeper_unmap(uint64_t seg_id, int force);
void mpc__foreach_seg(void (*fn)(mpc_seg_header *, void *), void *arg);
void mpc__drop_slot(mpc_seg_header *h, uint32_t slot);
void mpc__arena_after_fork_child(void);

/* ---------------------------------------------------------------- */
/* Messages                                                         */
/* ---------------------------------------------------------------- */

static int mpc__send(int sock, const mpc_kmsg *m, int fd) {
    struct iovec iov = {(void *)m, sizeof *m};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&u, 0, sizeof u);
        mh.msg_control = u.buf;
        mh.msg_controllen = sizeof u.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    ssize_t n;
    do {
        n = sendmsg(sock, &mh, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n == (ssize_t)sizeof *m ? 0 : -(n < 0 ? errno : EPROTO);
}

/* Receives one message; *fd gets a passed fd or -1.  Returns 0, -EPIPE on
 * EOF, or -errno. */
static int mpc__recv(int sock, mpc_kmsg *m, int *fd) {
    struct iovec iov = {m, sizeof *m};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                        .msg_controllen = sizeof u.buf};
    ssize_t n;
    do {
        n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (fd)
        *fd = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int got;
            memcpy(&got, CMSG_DATA(c), sizeof got);
            if (fd)
                *fd = got;
            else
                close(got);
        }
    if (n == 0)
        return -EPIPE;
    if (n < 0)
        return -errno;
    return n == (ssize_t)sizeof *m ? 0 : -EPROTO;
}

socklen_t mpc__addr(const char *name, struct sockaddr_un *sa) {
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    size_t n = strlen(name);
    if (n > sizeof sa->sun_path - 2)
        n = sizeof sa->sun_path - 2;
    memcpy(sa->sun_path + 1, name, n); /* abstract: leading NUL, no file */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* ---------------------------------------------------------------- */
/* The keeper                                                       */
/* ---------------------------------------------------------------- */

#define MPC_MAX_CLIENTS 1024

typedef struct {
    int sock;
    int slot; /* -1 before HELLO */
    pid_t pid;
} mpc_client;

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
static void *mpc__jmap;               /* client: its mapping */
static size_t mpc__jmaplen;
static pthread_mutex_t mpc__journal_lock = PTHREAD_MUTEX_INITIALIZER;

/* Keeper: drops what a dead slot's journal lists, and clears it. */
static void mpc__journal_sweep(uint32_t slot) {
    if (mpc__journals == NULL)
        return;
    mpc_journal *j = &mpc__journals[slot];
    for (int i = 0; i < MPC_JOURNAL_CAP; i++) {
        uint64_t id = atomic_load(&j->e[i].seg_id);
        if (id == 0)
            continue;
        mpc_ref ref = {id, j->e[i].index, j->e[i].gen};
        atomic_store(&j->e[i].seg_id, 0);
        mpc_debug("keeper: dropping a ticket of dead slot %u (block %u of %016" PRIx64 ")",
                  slot, ref.index, ref.seg_id);
        mpc_ref_drop(&ref);
    }
}

/* Entries at or above this index are free: scans stop there. */
static int mpc__jtop;

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
    pthread_mutex_unlock(&mpc__journal_lock);
    return found;
}

static int mpc__is_keeper = 0;
static uint64_t *mpc__pending; /* segments to retire after the current sweep */
static size_t mpc__npending, mpc__cappending;

static int mpc__defer_retire(uint64_t seg_id) {
    if (mpc__npending == mpc__cappending) {
        size_t cap = mpc__cappending ? 2 * mpc__cappending : 64;
        uint64_t *p = realloc(mpc__pending, cap * sizeof *p);
        if (p == NULL)
            return -ENOMEM;
        mpc__pending = p;
        mpc__cappending = cap;
    }
    mpc__pending[mpc__npending++] = seg_id;
    return 0;
}

static void mpc__run_pending(void) {
    for (size_t i = 0; i < mpc__npending; i++)
        if (mpc__keeper_unmap(mpc__pending[i], 0) == 0)
            mpc_debug("keeper: retired segment %016" PRIx64, mpc__pending[i]);
    mpc__npending = 0;
}

typedef struct {
    uint32_t slot;
} mpc__death;

static void mpc__death_sweep(mpc_seg_header *h, void *arg) {
    mpc__death *d = arg;
    mpc__drop_slot(h, d->slot);
}

static void mpc__orphan_sweep(mpc_seg_header *h, void *arg) {
    mpc__death *d = arg;
    if (h->owner_slot != d->slot || (atomic_load(&h->flags) & MPC_SEG_ORPHAN))
        return;
    atomic_fetch_or(&h->flags, MPC_SEG_ORPHAN);
    if (atomic_load(&h->live) == 0)
        mpc__defer_retire(h->seg_id);
}

static void mpc__client_gone(mpc_client *c, uint8_t *slots_used) {
    mpc_debug("keeper: client pid %d slot %d gone", (int)c->pid, c->slot);
    if (c->slot >= 0) {
        mpc__death d = {(uint32_t)c->slot};
        mpc__journal_sweep(d.slot);
        mpc__foreach_seg(mpc__death_sweep, &d);
        mpc__foreach_seg(mpc__orphan_sweep, &d);
        mpc__run_pending();
        slots_used[c->slot] = 0;
    }
    close(c->sock);
    c->sock = -1;
}

/* Serves one request of client c.  Returns 0, or -1 if c must go. */
static int mpc__serve(mpc_client *c, uint8_t *slots_used) {
    mpc_kmsg m;
    int fd;
    if (mpc__recv(c->sock, &m, &fd) < 0)
        return -1;
    mpc_kmsg reply = {.op = m.op, .seg_id = m.seg_id};
    int send_fd = -1;
    switch (m.op) {
    case OP_HELLO:
        if (c->slot < 0) {
            for (int i = 0; i < MPC_MAX_PROCS; i++)
                if (!slots_used[i]) {
                    slots_used[i] = 1;
                    c->slot = i;
                    break;
                }
        }
        c->pid = (pid_t)m.arg;
        reply.status = c->slot < 0 ? -EUSERS : 0;
        reply.arg = c->slot;
        send_fd = mpc__journal_fd;
        break;
    case OP_REGISTER: {
        mpc_seg_header *h;
        if (fd < 0)
            reply.status = -EBADF;
        else if (mpc__keeper_fd(m.seg_id) >= 0)
            reply.status = -EEXIST;
        else
            reply.status = mpc__keeper_map(m.seg_id, fd, &h);
        break;
    }
    case OP_FETCH:
        send_fd = mpc__keeper_fd(m.seg_id);
        reply.status = send_fd < 0 ? -ENOENT : 0;
        break;
    case OP_RETIRE:
        reply.status = mpc__keeper_unmap(m.seg_id, 0);
        break;
    default:
        reply.status = -EPROTO;
    }
    if (fd >= 0)
        close(fd);
    mpc__run_pending();
    return mpc__send(c->sock, &reply, send_fd) < 0 ? -1 : 0;
}

int mpc_keeper_main(int first, int lsock) {
    mpc__is_keeper = 1;
    mpc__retire_hook = mpc__defer_retire;
    /* Ctrl-C goes to the whole foreground group; the keeper must outlive
     * its clients so they can finish cleanly, and leaves with the last. */
    signal(SIGINT, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_NAME, "mpcore-keeper", 0, 0, 0);

    uint64_t jsize = (sizeof(mpc_journal) * MPC_MAX_PROCS + MPC_PAGE - 1) / MPC_PAGE * MPC_PAGE;
    int jr = mpc_memfd_create(jsize, jsize, &mpc__journal_fd);
    if (jr < 0)
        return jr;
    mpc__journals = mmap(NULL, jsize, PROT_READ | PROT_WRITE, MAP_SHARED, mpc__journal_fd, 0);
    if (mpc__journals == MAP_FAILED)
        return mpc_fail(errno, "keeper: cannot map the journals: %s", strerror(errno));
    int fl = fcntl(lsock, F_GETFL);
    if (fl < 0 || fcntl(lsock, F_SETFL, fl | O_NONBLOCK) < 0)
        return mpc_fail(errno, "keeper: bad listening socket: %s", strerror(errno));
    static mpc_client clients[MPC_MAX_CLIENTS];
    static struct pollfd pfds[MPC_MAX_CLIENTS + 1];
    uint8_t slots_used[MPC_MAX_PROCS] = {0};
    int nclients = 1;
    for (int i = 0; i < MPC_MAX_CLIENTS; i++)
        clients[i].sock = -1;
    clients[0] = (mpc_client){first, -1, 0};
    uid_t me = getuid();

    while (nclients > 0) {
        int np = 0;
        pfds[np++] = (struct pollfd){lsock, POLLIN, 0};
        int map[MPC_MAX_CLIENTS];
        for (int i = 0; i < MPC_MAX_CLIENTS; i++)
            if (clients[i].sock >= 0) {
                map[np - 1] = i;
                pfds[np++] = (struct pollfd){clients[i].sock, POLLIN, 0};
            }
        if (poll(pfds, (nfds_t)np, -1) < 0) {
            if (errno == EINTR)
                continue;
            return mpc_fail(errno, "keeper: poll: %s", strerror(errno));
        }
        for (int p = 1; p < np; p++) {
            if (!pfds[p].revents)
                continue;
            mpc_client *c = &clients[map[p - 1]];
            if (mpc__serve(c, slots_used) < 0) {
                mpc__client_gone(c, slots_used);
                nclients--;
            }
        }
        if (pfds[0].revents & POLLIN) {
            int s;
            while ((s = accept4(lsock, NULL, NULL, SOCK_CLOEXEC)) >= 0) {
                struct ucred cr;
                socklen_t crl = sizeof cr;
                int slot = -1;
                if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &crl) < 0 ||
                    (cr.uid != me && me != 0)) {
                    close(s);
                    continue;
                }
                for (int i = 0; i < MPC_MAX_CLIENTS; i++)
                    if (clients[i].sock < 0) {
                        slot = i;
                        break;
                    }
                if (slot < 0) {
                    close(s);
                    continue;
                }
                clients[slot] = (mpc_client){s, -1, cr.pid};
                nclients++;
            }
        }
    }
    close(lsock);
    return 0;
}

/* ---------------------------------------------------------------- */
/* Client side                                                      */
/* ---------------------------------------------------------------- */

static pthread_mutex_t mpc__client_lock = PTHREAD_MUTEX_INITIALIZER;
static int mpc__sock = -1;
static int32_t mpc__slot = -1;
static char *const *mpc__spawn_argv; /* set by the binding: how to start one */
static pid_t mpc__keeper_pid = 0;      /* when this process started it */

void mpc_set_keeper_argv(char *const *argv) { mpc__spawn_argv = argv; }

/* One request, one reply.  Called with mpc__client_lock held. */
static int mpc__rpc(mpc_kmsg *m, int send_fd, int *recv_fd) {
    int r = mpc__send(mpc__sock, m, send_fd);
    if (r == 0)
        r = mpc__recv(mpc__sock, m, recv_fd);
    if (r < 0) {
        close(mpc__sock);
        mpc__sock = -1;
        mpc__slot = -1;
        return mpc_fail(ECONNREFUSED, "lost the connection to the mpcore keeper (%s)",
                        strerror(-r));
    }
    return m->status;
}

static int mpc__hello(void) {
    mpc_kmsg m = {.op = OP_HELLO, .arg = getpid()};
    int jfd = -1;
    int r = mpc__rpc(&m, -1, &jfd);
    if (r == -EUSERS)
        r = mpc_fail(EUSERS, "too many processes use mpcore shared memory at once (%d)",
                     MPC_MAX_PROCS);
    if (r == 0 && jfd >= 0 && m.arg >= 0 && m.arg < MPC_MAX_PROCS) {
        /* Only our own slot's pages: a process never touches another's. */
        uint64_t off = (uint64_t)m.arg * sizeof(mpc_journal);
        uint64_t start = off / MPC_PAGE * MPC_PAGE;
        void *p = mmap(NULL, off + sizeof(mpc_journal) - start, PROT_READ | PROT_WRITE, MAP_SHARED,
                       jfd, (off_t)start);
        if (p != MAP_FAILED) {
            mpc__jmap = p;
            mpc__jmaplen = off + sizeof(mpc_journal) - start;
            mpc__myjournal = (mpc_journal *)((uint8_t *)p + (off - start));
        }
    }
    if (jfd >= 0)
        close(jfd);
    if (r < 0)
        return r;
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

pid_t mpc_keeper_pid(void) { return mpc__keeper_pid; }

static char mpc__name[96]; /* the keeper this process is connected to */

/* Connects to the keeper named in MPCORE_KEEPER, or starts one.  Called
 * with mpc__client_lock held. */
static int mpc__connect(void) {
    if (mpc__sock >= 0)
        return 0;
    const char *name = getenv("MPCORE_KEEPER");
    if (name && *name) {
        int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        struct sockaddr_un sa;
        socklen_t l = mpc__addr(name, &sa);
        if (sock >= 0 && connect(sock, (struct sockaddr *)&sa, l) == 0) {
            mpc__sock = sock;
            snprintf(mpc__name, sizeof mpc__name, "%s", name);
            return 0;
        }
        if (sock >= 0)
            close(sock);
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
        return mpc_fail(ENOENT, "the keeper holds no blocks");
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
    int r = mpc__request(OP_REGISTER, seg_id, fd, NULL);
    return r < 0 && !*mpc_errmsg()
               ? mpc_fail(-r, "the keeper refused segment %016" PRIx64 ": %s", seg_id, strerror(-r))
               : r;
}

int mpc_client_fetch(uint64_t seg_id, int *fd) {
    if (mpc__is_keeper)
        return mpc_fail(ENOENT, "unknown shared-memory segment %016" PRIx64, seg_id);
    *fd = -1;
    int r = mpc__request(OP_FETCH, seg_id, -1, fd);
    if (r == -ENOENT)
        return mpc_fail(ENOENT, "unknown shared-memory segment %016" PRIx64
                        " (a forged handle, or one whose memory was freed)", seg_id);
    if (r == 0 && *fd < 0)
        return mpc_fail(EPROTO, "the keeper sent no fd for segment %016" PRIx64, seg_id);
    return r;
}

int mpc_client_retire(uint64_t seg_id) {
    if (mpc__is_keeper)
        return 0;
    int r = mpc__request(OP_RETIRE, seg_id, -1, NULL);
    mpc_clear_error();
    return r;
}

void mpc_after_fork_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&mpc__client_lock, &fresh, sizeof fresh);
    /* The socket is shared with the parent: closing our copy leaves the
     * parent's connection intact; this process connects afresh. */
    if (mpc__sock >= 0)
        close(mpc__sock);
    mpc__sock = -1;
    mpc__slot = -1;
    memcpy(&mpc__journal_lock, &fresh, sizeof fresh);
    if (mpc__jmap != NULL) /* the parent's journal: never ours to write */
        munmap(mpc__jmap, mpc__jmaplen);
    mpc__jmap = NULL;
    mpc__myjournal = NULL;
    mpc__jtop = 0;
    mpc__arena_after_fork_child();
}
