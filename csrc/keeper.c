/* keeper.c: the keeper process of a program: its server loop, and what it
 * does when a process dies.  Each process's side of the connection is in
 * client.c, the journal in journal.c, the segments it keeps in arena.c.
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
 * The protocol is one fixed-size message each way on SOCK_SEQPACKET
 * (mpc_kmsg in internal.h). */
#include "internal.h"

#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---------------------------------------------------------------- */
/* The keeper                                                       */
/* ---------------------------------------------------------------- */

#define MPC_MAX_CLIENTS 1024

typedef struct {
    int sock;
    int slot; /* -1 before HELLO */
    pid_t pid;
} mpc_client;

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

/* Drops a ticket that a dead process's journal still listed. */
static void mpc__drop_journaled(const mpc_ref *ref, void *arg) {
    (void)arg;
    mpc_debug("keeper: dropping a ticket of a dead process (block %u of %016" PRIx64 ")",
              ref->index, ref->seg_id);
    mpc_ref_drop(ref);
}

static void mpc__client_gone(mpc_client *c, uint8_t *slots_used) {
    mpc_debug("keeper: client pid %d slot %d gone", (int)c->pid, c->slot);
    if (c->slot >= 0) {
        mpc__death d = {(uint32_t)c->slot};
        mpc__journal_sweep(d.slot, mpc__drop_journaled, NULL);
        mpc__foreach_seg(mpc__death_sweep, &d);
        mpc__foreach_seg(mpc__orphan_sweep, &d);
        mpc__run_pending();
        slots_used[c->slot] = 0;
    }
    close(c->sock);
    c->sock = -1;
}

/* Serves one request of client c.  Returns 0, or -1 if c must go. */
static int mpc__serve(mpc_client *c, uint8_t *slots_used, int journal_fd) {
    mpc_kmsg m;
    int fd = -1, nfds = 0;
    ssize_t n = mpc__recv_fds(c->sock, &m, sizeof m, &fd, 1, &nfds);
    if (n != (ssize_t)sizeof m) {
        if (nfds > 0)
            close(fd);
        return -1;
    }
    mpc_kmsg reply = {.op = m.op, .seg_id = m.seg_id};
    int send_fd = -1;
    switch (m.op) {
    case MPC_KOP_HELLO:
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
        send_fd = journal_fd;
        break;
    case MPC_KOP_REGISTER: {
        mpc_seg_header *h;
        if (fd < 0)
            reply.status = -EBADF;
        else if (mpc__keeper_fd(m.seg_id) >= 0)
            reply.status = -EEXIST;
        else
            reply.status = mpc__keeper_map(m.seg_id, fd, &h);
        break;
    }
    case MPC_KOP_FETCH:
        send_fd = mpc__keeper_fd(m.seg_id);
        reply.status = send_fd < 0 ? -ENOENT : 0;
        break;
    case MPC_KOP_RETIRE:
        reply.status = mpc__keeper_unmap(m.seg_id, 0);
        break;
    default:
        reply.status = -EPROTO;
    }
    if (fd >= 0)
        close(fd);
    mpc__run_pending();
    return mpc__send_fd(c->sock, &reply, sizeof reply, send_fd) < 0 ? -1 : 0;
}

int mpc_keeper_main(int first, int lsock) {
    mpc__client_become_keeper();
    mpc__arena_set_retire_hook(mpc__defer_retire);
    /* Ctrl-C goes to the whole foreground group; the keeper must outlive
     * its clients so they can finish cleanly, and leaves with the last. */
    signal(SIGINT, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_NAME, "mpcore-keeper", 0, 0, 0);

    int journal_fd;
    int jr = mpc__journal_create(&journal_fd);
    if (jr < 0)
        return jr;
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
            if (mpc__serve(c, slots_used, journal_fd) < 0) {
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
