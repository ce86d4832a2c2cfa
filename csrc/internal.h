/* internal.h: what the files of the core share with each other and with no
 * one else.  mpcore.h is the core's interface (what the bindings call);
 * this header holds every mpc__ name that one core file defines and
 * another uses (but those that only the collectives' files share, which
 * their own header, coll.h, holds), so that no file declares another's
 * functions by hand.  Only core files (not the py_*.c bindings) include
 * it.
 *
 * NOTE [ Layers of the core ]
 * The core's files call each other in one direction only.  From the
 * bottom up, each file calls only files on its own line or on the lines
 * before it (tests/csrc/test_csrc_layers.py builds the graph of calls from the
 * sources, checks every edge against this list, which names every core
 * file, and checks that the graph has no cycle):
 *   util.c sync.c          errors, debug switch, copies, clock, futexes
 *   fdpass.c               abstract socket addresses, messages with fds
 *   shm.c                  memfds and the memory they may use
 *   coll_kernels.c         what the collectives reduce, and the kernels
 *   coll_group.c           a shared-memory group's life, its barriers
 *   coll_copy.c            group buffers, copies between ranks' memory
 *   coll_p2p.c coll.c      point to point, and the collectives (coll.h
 *                          says what each of these five files owns)
 *   journal.c              tickets in transit, per process slot
 *   proc.c                 starting services, the zygote
 *   client.c               this process's connection to its keeper
 *   arena.c                segments and blocks (asks client.c for fds)
 *   ring.c pool.c collate.c nccl.c   what is built on blocks
 *   keeper.c               the keeper process (arena.c and journal.c
 *                          seen from the keeper's side)
 *   core.c                 ties them together: finalizers at load, the
 *                          reset of every subsystem after fork
 * A lower file that must reach a higher one does so through a pointer the
 * higher one registers (a block finalizer, the keeper's retire hook), never
 * by name. */
#ifndef MPCORE_INTERNAL_H
#define MPCORE_INTERNAL_H

#include "mpcore.h"

#include <sys/socket.h>
#include <sys/un.h>

/* ------------------------------------------------------------------ */
/* Sockets that carry fds (fdpass.c)                                   */
/* ------------------------------------------------------------------ */

/* Fills *sa with the abstract Unix address `name` (no file behind it; a
 * name too long for sun_path is cut).  Returns the address's length for
 * bind/connect.  Never fails. */
socklen_t mpc__addr(const char *name, struct sockaddr_un *sa);

/* Sends len bytes from buf in one sendmsg, with fd attached by SCM_RIGHTS
 * when fd >= 0, retrying on EINTR and without SIGPIPE.  Returns 0 once all
 * len bytes went, -EPROTO when only part of them did, or -errno. */
int mpc__send_fd(int sock, const void *buf, size_t len, int fd);

/* Receives with one recvmsg (retrying on EINTR) up to len bytes into buf
 * and the fds passed with them (close-on-exec): the first maxfds are
 * stored in fds[] and counted in *nfds, any beyond are closed (fds may be
 * NULL with maxfds 0 to close them all).  Returns the bytes received (0 at
 * end of stream), or -errno with *nfds = 0. */
ssize_t mpc__recv_fds(int sock, void *buf, size_t len, int *fds, int maxfds, int *nfds);

/* ------------------------------------------------------------------ */
/* The keeper's protocol (client.c and keeper.c)                       */
/* ------------------------------------------------------------------ */

/* One fixed-size message each way on SOCK_SEQPACKET (NOTE [ Keeper ]). */
enum { MPC_KOP_HELLO = 1, MPC_KOP_REGISTER, MPC_KOP_FETCH, MPC_KOP_RETIRE };

typedef struct {
    uint32_t op;
    int32_t status; /* reply: 0 or -errno */
    uint64_t seg_id;
    int64_t arg;    /* HELLO: pid, reply: slot */
} mpc_kmsg;

/* Marks this process as the keeper: from now on it is no client, and
 * client requests fail (fetch) or do nothing (retire).  Never fails. */
void mpc__client_become_keeper(void);

/* Forgets the keeper connection and slot in a child after fork (closing
 * the child's copy of the socket) and resets the client's lock.  Never
 * fails; async-signal-safe. */
void mpc__client_after_fork_child(void);

/* ------------------------------------------------------------------ */
/* The journal of tickets in transit (journal.c)                       */
/* ------------------------------------------------------------------ */

/* Keeper: makes the memfd that holds every slot's journal and maps it.
 * Returns 0 and stores the fd (kept by journal.c, handed out with HELLO)
 * in *fd, or -errno (-MPC_ENOSHM when memory is short). */
int mpc__journal_create(int *fd);

/* Keeper: calls drop(ref, arg) for each ticket that slot's journal still
 * lists, clearing each entry first.  A no-op before mpc__journal_create. */
void mpc__journal_sweep(uint32_t slot, void (*drop)(const mpc_ref *, void *), void *arg);

/* Client: maps this process's own pages of the journal memfd jfd (the
 * keeper's, received with HELLO) for slot.  Never fails: where the mapping
 * cannot be made, the process simply has no journal (mpc_journal_add then
 * returns -ENOENT). */
void mpc__journal_attach(int jfd, uint32_t slot);

/* In a child after fork: unmaps the parent's journal (never the child's to
 * write) and resets the journal's lock.  Never fails. */
void mpc__journal_after_fork_child(void);

/* ------------------------------------------------------------------ */
/* Segments seen from the keeper, and the arena's fork reset (arena.c) */
/* ------------------------------------------------------------------ */

/* Keeper: segments whose last block is freed while their owner is gone
 * are passed to hook instead of to the keeper (mpc_client_retire).  hook
 * returns 0 or -errno, which is ignored.  Never fails. */
void mpc__arena_set_retire_hook(int (*hook)(uint64_t seg_id));

/* Keeper: maps segment seg_id from fd (which stays the caller's; a dup is
 * kept) so that it can be fetched, swept and drained.  Returns 0 and the
 * header in *hdr, -MPC_EHANDLE when fd holds no valid segment, or -errno. */
int mpc__keeper_map(uint64_t seg_id, int fd, mpc_seg_header **hdr);

/* Keeper: the fd kept for seg_id, or -1 when the segment is unknown.
 * Never fails otherwise. */
int mpc__keeper_fd(uint64_t seg_id);

/* Keeper: retires a segment: marks it RETIRED, unmaps it and closes its fd.
 * Returns 0, -ENOENT when unknown, or -EBUSY when a block is still live
 * (unless force). */
int mpc__keeper_unmap(uint64_t seg_id, int force);

/* Keeper: calls fn(hdr, arg) for every segment mapped here.  Never fails
 * (without memory for the snapshot it calls nothing). */
void mpc__foreach_seg(void (*fn)(mpc_seg_header *, void *), void *arg);

/* Keeper: drops every hold of a dead process's slot in one segment,
 * freeing the blocks left without references.  Never fails. */
void mpc__drop_slot(mpc_seg_header *h, uint32_t slot);

/* In a child after fork: resets the arena's lock and forgets ownership of
 * the parent's segments (the child holds nothing yet).  Never fails. */
void mpc__arena_after_fork_child(void);

/* ------------------------------------------------------------------ */
/* Other subsystems' fork resets (shm.c, nccl.c)                       */
/* ------------------------------------------------------------------ */

/* In a child after fork: resets the lock of the memory-availability cache
 * and forgets the cached figure.  Never fails. */
void mpc__shm_after_fork_child(void);

/* Around fork (pthread_atfork, NOTE [ Reset after fork ] in core.c):
 * before_fork waits until no thread of this process is loading NCCL and
 * keeps others from starting, after_fork_parent lets them go on, and
 * after_fork_child makes the lock fresh in the child (what was loaded
 * stays loaded).  They never fail. */
void mpc__nccl_before_fork(void);
void mpc__nccl_after_fork_parent(void);
void mpc__nccl_after_fork_child(void);

#endif /* MPCORE_INTERNAL_H */
