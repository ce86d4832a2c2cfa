/* pool.c: the main process's books on a pool of DataLoader workers:
 * dispatch of tasks to workers, the bound on tasks in flight, and the
 * reassembly of results in order.  It moves no data; the rings (ring.c)
 * carry tasks and results, and the binding (py_pool.c) waits on them.
 *
 * NOTE [ Dispatch and reassembly ]
 * The rules are torch's DataLoader's, so that the same program gets the
 * same batches in the same order from the same workers:
 *   - an epoch starts with prefetch * nworkers tasks, and every result
 *     handed out (or task that ended its worker's iterable) lets one more
 *     task go, so at most prefetch * nworkers are in flight;
 *   - task i goes to the next active worker in round-robin order, so with
 *     every worker active, worker i % nworkers serves task i; out of order,
 *     a worker is skipped while it holds its share of the tasks in flight;
 *   - in order, a result that arrives before its turn is kept until every
 *     earlier task has been handed out; out of order, it is handed out at
 *     once;
 *   - tasks sent to a worker that has since become inactive (its iterable
 *     ended) are skipped: they will never come back.
 * Tasks are numbered from 0 each epoch; the table of tasks between the
 * next to hand out and the next to send is a ring indexed by task number,
 * grown when the window outgrows it.
 *
 * NOTE [ Watching workers ]
 * A worker that dies sends nothing, so the main process, waiting on the
 * result ring's futex, would not wake.  The pool therefore holds a pidfd of
 * each worker (pidfd_open works for any process, so a worker forked by the
 * zygote is watched as a child is) and one thread that sleeps in poll() on
 * them and on an eventfd that stops it.  When a pidfd becomes readable the
 * thread puts a header-only MPC_POOL_DIED message for that worker on the
 * result ring, once, and stops watching it: the main process's wait wakes
 * as for any result, with no periodic wake-up.  If the ring is full the
 * put waits for room in steps of MPC_POOL_WATCH_STEP_NS, looking at the
 * stop flag between them; the waiter is then busy with the messages ahead
 * anyway.  The thread starts only when the caller first waits (after every
 * worker has been started, so that forking them never copies a process in
 * which it runs), runs with every signal blocked (they stay the main
 * thread's), and after it started allocates nothing and takes no lock but
 * the ring's process-shared one, so that a fork elsewhere in the program
 * cannot leave a child with a private lock held.  A forked child that frees
 * the pool never joins a thread it does not have. */
#include "mpcore.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>

#define MPC_POOL_WATCH_STEP_NS 100000000LL /* 100 ms */

_Static_assert(sizeof(mpc_pool_msg) == 16, "the pool message header is 16 bytes");
_Static_assert(offsetof(mpc_pool_msg, task) == 0 && offsetof(mpc_pool_msg, worker) == 8 &&
                   offsetof(mpc_pool_msg, kind) == 12,
               "the pool message header has no padding");

enum { TASK_FREE = 0, TASK_SENT = 1, TASK_ARRIVED = 2 };

typedef struct {
    int32_t worker;
    int32_t state;
    void *data;
} mpc_task;

struct mpc_pool {
    int nworkers, prefetch, in_order;
    int cursor;                /* next worker the round robin looks at */
    uint64_t send_idx;         /* next task number to send */
    uint64_t rcvd_idx;         /* next task number to hand out */
    uint64_t outstanding;      /* sent, result not yet arrived */
    uint64_t kept;             /* arrived early, kept */
    uint32_t *num_tasks;       /* per worker: sent and not yet handed out */
    uint8_t *active;           /* per worker */
    mpc_task *tasks;           /* ring of cap entries, task & (cap - 1) */
    uint64_t cap;
    void (*drop)(void *);
    /* NOTE [ Watching workers ] */
    int *pidfds;               /* per worker; -1 when not watched (or reported) */
    struct pollfd *pfds;       /* nworkers + 1, for the thread */
    int *pfd_worker;           /* worker of each pfds entry after the first */
    mpc_ring *ring;            /* where DIED messages go */
    int wake_fd;               /* eventfd that stops the thread; -1 until started */
    int running;
    pid_t owner;               /* the process whose thread it is */
    pthread_t thread;
    _Atomic int stop;
};

static mpc_task *task_at(const mpc_pool *p, uint64_t t) { return &p->tasks[t & (p->cap - 1)]; }

int mpc_pool_new(int nworkers, int prefetch, int in_order, void (*drop)(void *),
                 mpc_pool **out) {
    if (nworkers < 1 || prefetch < 1)
        return mpc_fail(EINVAL, "a pool needs at least one worker and one task per worker "
                                "(got %d workers, prefetch %d)", nworkers, prefetch);
    mpc_pool *p = calloc(1, sizeof *p);
    if (p == NULL)
        return -ENOMEM;
    p->nworkers = nworkers;
    p->prefetch = prefetch;
    p->in_order = in_order != 0;
    p->drop = drop;
    uint64_t want = 2 * (uint64_t)nworkers * (uint64_t)prefetch + 2;
    p->cap = 8;
    while (p->cap < want)
        p->cap *= 2;
    p->num_tasks = calloc((size_t)nworkers, sizeof *p->num_tasks);
    p->active = calloc((size_t)nworkers, 1);
    p->tasks = calloc(p->cap, sizeof *p->tasks);
    p->pidfds = malloc((size_t)nworkers * sizeof *p->pidfds);
    p->pfds = calloc((size_t)nworkers + 1, sizeof *p->pfds);
    p->pfd_worker = calloc((size_t)nworkers + 1, sizeof *p->pfd_worker);
    p->wake_fd = -1;
    if (p->pidfds != NULL)
        for (int w = 0; w < nworkers; w++)
            p->pidfds[w] = -1;
    if (p->num_tasks == NULL || p->active == NULL || p->tasks == NULL || p->pidfds == NULL ||
        p->pfds == NULL || p->pfd_worker == NULL) {
        mpc_pool_free(p);
        return -ENOMEM;
    }
    mpc_pool_reset(p);
    *out = p;
    return 0;
}

static void drop_kept(mpc_pool *p) {
    for (uint64_t i = 0; i < p->cap; i++) {
        if (p->tasks[i].state == TASK_ARRIVED && p->drop != NULL)
            p->drop(p->tasks[i].data);
        p->tasks[i] = (mpc_task){0, TASK_FREE, NULL};
    }
    p->kept = 0;
}

void mpc_pool_free(mpc_pool *p) {
    if (p == NULL)
        return;
    if (p->pidfds != NULL)
        mpc_pool_unwatch(p);
    if (p->tasks != NULL)
        drop_kept(p);
    free(p->tasks);
    free(p->pidfds);
    free(p->pfds);
    free(p->pfd_worker);
    free(p->num_tasks);
    free(p->active);
    free(p);
}

void mpc_pool_reset(mpc_pool *p) {
    drop_kept(p);
    p->cursor = 0;
    p->send_idx = p->rcvd_idx = p->outstanding = 0;
    for (int w = 0; w < p->nworkers; w++) {
        p->num_tasks[w] = 0;
        p->active[w] = 1;
    }
}

int mpc_pool_start_at(mpc_pool *p, int worker) {
    if (worker < 0 || worker >= p->nworkers)
        return mpc_fail(EINVAL, "no worker %d in a pool of %d", worker, p->nworkers);
    p->cursor = worker;
    return 0;
}

/* Doubles the task ring, keeping each live task at its new place. */
static int grow(mpc_pool *p) {
    uint64_t cap = p->cap * 2;
    mpc_task *t = calloc(cap, sizeof *t);
    if (t == NULL)
        return -ENOMEM;
    for (uint64_t i = p->rcvd_idx; i < p->send_idx; i++)
        t[i & (cap - 1)] = *task_at(p, i);
    free(p->tasks);
    p->tasks = t;
    p->cap = cap;
    return 0;
}

int mpc_pool_dispatch(mpc_pool *p, int *worker, uint64_t *task) {
    uint64_t max_tasks = (uint64_t)p->prefetch * (uint64_t)p->nworkers;
    if (p->outstanding >= max_tasks)
        return mpc_fail(ENOSPC, "%llu tasks already in flight (prefetch bound)",
                        (unsigned long long)p->outstanding);
    int nactive = 0;
    for (int w = 0; w < p->nworkers; w++)
        nactive += p->active[w];
    int chosen = -1;
    for (int i = 0; i < p->nworkers && nactive > 0; i++) {
        int w = p->cursor;
        p->cursor = (p->cursor + 1) % p->nworkers;
        if (!p->active[w])
            continue;
        if (p->in_order || p->num_tasks[w] < max_tasks / (uint64_t)nactive) {
            chosen = w;
            break;
        }
    }
    if (chosen < 0)
        return -EAGAIN;
    if (p->send_idx - p->rcvd_idx + 1 >= p->cap && grow(p) < 0)
        return -ENOMEM;
    *task_at(p, p->send_idx) = (mpc_task){chosen, TASK_SENT, NULL};
    p->num_tasks[chosen]++;
    p->outstanding++;
    *worker = chosen;
    *task = p->send_idx++;
    return 0;
}

int mpc_pool_next(mpc_pool *p, int *worker, void **data) {
    while (p->rcvd_idx < p->send_idx) {
        mpc_task *t = task_at(p, p->rcvd_idx);
        if (t->state == TASK_ARRIVED || (t->state == TASK_SENT && p->active[t->worker]))
            break;
        *t = (mpc_task){0, TASK_FREE, NULL}; /* handed out already, or never coming */
        p->rcvd_idx++;
    }
    if (p->rcvd_idx == p->send_idx)
        return -EPIPE;
    mpc_task *t = task_at(p, p->rcvd_idx);
    if (t->state != TASK_ARRIVED)
        return 0;
    *worker = t->worker;
    *data = t->data;
    *t = (mpc_task){0, TASK_FREE, NULL};
    p->kept--;
    p->rcvd_idx++;
    return 1;
}

int mpc_pool_arrived(mpc_pool *p, uint64_t task, void *data, int *worker) {
    if (task < p->rcvd_idx || task >= p->send_idx || task_at(p, task)->state != TASK_SENT)
        return mpc_fail(EINVAL, "a result came back for task %llu, which is not in flight",
                        (unsigned long long)task);
    mpc_task *t = task_at(p, task);
    p->outstanding--;
    *worker = t->worker;
    if (!p->in_order || task == p->rcvd_idx) {
        *t = (mpc_task){0, TASK_FREE, NULL};
        if (p->in_order)
            p->rcvd_idx++;
        return 1;
    }
    t->state = TASK_ARRIVED;
    t->data = data;
    p->kept++;
    return 0;
}

void mpc_pool_delivered(mpc_pool *p, int worker) {
    if (worker >= 0 && worker < p->nworkers && p->num_tasks[worker] > 0)
        p->num_tasks[worker]--;
}

int mpc_pool_ended(mpc_pool *p, uint64_t task, int worker) {
    if (task < p->rcvd_idx || task >= p->send_idx || task_at(p, task)->state != TASK_SENT ||
        task_at(p, task)->worker != worker)
        return mpc_fail(EINVAL, "worker %d ended task %llu, which is not in flight there", worker,
                        (unsigned long long)task);
    p->outstanding--;
    mpc_pool_deactivate(p, worker);
    return 0;
}

void mpc_pool_deactivate(mpc_pool *p, int worker) {
    if (worker >= 0 && worker < p->nworkers)
        p->active[worker] = 0;
}

uint64_t mpc_pool_outstanding(const mpc_pool *p) { return p->outstanding; }
uint64_t mpc_pool_kept(const mpc_pool *p) { return p->kept; }
int mpc_pool_active(const mpc_pool *p, int worker) {
    return worker >= 0 && worker < p->nworkers && p->active[worker];
}

/* ------------------------------------------------------------------ */
/* Watching workers (NOTE [ Watching workers ])                        */
/* ------------------------------------------------------------------ */

int mpc_pool_watch(mpc_pool *p, int worker, pid_t pid, mpc_ring *ring) {
    if (worker < 0 || worker >= p->nworkers || pid <= 0 || ring == NULL)
        return mpc_fail(EINVAL, "cannot watch worker %d (pid %d) of a pool of %d", worker,
                        (int)pid, p->nworkers);
    if (p->running)
        return mpc_fail(EBUSY, "the pool's workers are already being watched");
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (fd < 0) {
        int e = errno;
        return mpc_fail(e, "cannot watch worker %d (pid %d): %s", worker, (int)pid,
                        strerror(e));
    }
    if (p->pidfds[worker] >= 0)
        close(p->pidfds[worker]);
    p->pidfds[worker] = fd;
    p->ring = ring;
    return 0;
}

/* Puts worker's DIED message, waiting for room in steps so that a stop is
 * seen.  Returns 0, or -1 when told to stop first. */
static int report_death(mpc_pool *p, int worker) {
    mpc_pool_msg m = {0, (uint32_t)worker, MPC_POOL_DIED};
    for (;;) {
        int rc = mpc_ring_put(p->ring, NULL, 0, &m, sizeof m,
                              mpc_now_ns() + MPC_POOL_WATCH_STEP_NS);
        if (rc != -ETIMEDOUT && rc != -EINTR && rc != -EAGAIN)
            return 0; /* put, or the ring can take nothing more: no one is waiting */
        if (atomic_load(&p->stop))
            return -1;
    }
}

static void *watch_thread(void *arg) {
    mpc_pool *p = arg;
    for (;;) {
        int n = 0;
        p->pfds[n++] = (struct pollfd){p->wake_fd, POLLIN, 0};
        for (int w = 0; w < p->nworkers; w++) {
            if (p->pidfds[w] < 0)
                continue;
            p->pfd_worker[n] = w;
            p->pfds[n++] = (struct pollfd){p->pidfds[w], POLLIN, 0};
        }
        int rc = poll(p->pfds, (nfds_t)n, -1);
        if (atomic_load(&p->stop))
            return NULL;
        if (rc < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOMEM)
                continue;
            mpc_debug("pool %p: poll on the workers' pidfds failed: %s", (void *)p,
                      strerror(errno));
            return NULL;
        }
        for (int i = 1; i < n; i++) {
            if (p->pfds[i].revents == 0)
                continue;
            int w = p->pfd_worker[i];
            close(p->pidfds[w]);
            p->pidfds[w] = -1;
            if (report_death(p, w) < 0)
                return NULL;
        }
    }
}

int mpc_pool_watch_start(mpc_pool *p) {
    if (p->running || p->ring == NULL)
        return 0;
    if (p->wake_fd < 0) {
        p->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (p->wake_fd < 0) {
            int e = errno;
            return mpc_fail(e, "cannot watch the pool's workers: eventfd: %s", strerror(e));
        }
    }
    atomic_store(&p->stop, 0);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int e = pthread_create(&p->thread, NULL, watch_thread, p);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e != 0)
        return mpc_fail(e, "cannot start the thread that watches the pool's workers: %s",
                        strerror(e));
    p->running = 1;
    p->owner = getpid();
    return 0;
}

void mpc_pool_unwatch(mpc_pool *p) {
    if (p->running) {
        if (p->owner == getpid()) {
            atomic_store(&p->stop, 1);
            uint64_t one = 1;
            while (write(p->wake_fd, &one, sizeof one) < 0 && errno == EINTR) {
            }
            pthread_join(p->thread, NULL);
        }
        p->running = 0; /* in a forked child there is no thread to join */
    }
    for (int w = 0; w < p->nworkers; w++) {
        if (p->pidfds[w] >= 0)
            close(p->pidfds[w]);
        p->pidfds[w] = -1;
    }
    if (p->wake_fd >= 0)
        close(p->wake_fd);
    p->wake_fd = -1;
    p->ring = NULL;
}
