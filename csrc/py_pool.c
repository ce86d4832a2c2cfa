/* py_pool.c: mpcore._core.Pool, the main process's side of a pool of
 * DataLoader workers: the books of pool.c over the ring workers send their
 * results to.  Every result message starts with an mpc_pool_msg header
 * (mpcore.h, its one definition; the module exports its size, offsets and
 * kinds as POOL_*); the rest is the kind's payload, handed back as bytes
 * with the message's refs.  Waiting for a result releases the GIL and runs
 * signal handlers (py_ring.c); before the first wait the pool starts
 * watching its workers (NOTE [ Watching workers ] in pool.c). */
#include "py_mpcore.h"

#include <string.h>

#define HEADER ((uint64_t)sizeof(mpc_pool_msg))

typedef struct msg {
    mpc_ref *refs;
    uint32_t nrefs;
    uint32_t kind;
    void *payload; /* header included */
    uint64_t len;
    struct msg *next; /* set aside to be dropped */
} msg;

typedef struct {
    PyObject_HEAD
    mpc_pool *pool;
    PyObject *ring_obj;
    mpc_ring *ring;
} PoolObject;

/* Drops a message nobody will read: its tickets (journaled by the get)
 * and its memory.  Called with the GIL held; releases it while dropping,
 * which may ask the keeper for a segment. */
static void msg_drop(void *p) {
    msg *m = p;
    Py_BEGIN_ALLOW_THREADS
    for (uint32_t i = 0; i < m->nrefs; i++)
        mpc_ref_drop_journaled(&m->refs[i]);
    Py_END_ALLOW_THREADS
    free(m->refs);
    free(m->payload);
    free(m);
}

/* The pool's books drop kept results while they change (reset, free),
 * where releasing the GIL would let another thread see them half-done: so
 * those results are only set aside here (a list under the GIL, which
 * cannot fail), and dropped by drop_set_aside once the books are whole. */
static msg *set_aside;

static void msg_set_aside(void *p) {
    msg *m = p;
    m->next = set_aside;
    set_aside = m;
}

static void drop_set_aside(void) {
    while (set_aside != NULL) {
        msg *m = set_aside;
        set_aside = m->next;
        msg_drop(m);
    }
}

/* (worker, kind, task, refs, payload) for Python; frees m. */
static PyObject *msg_out(msg *m, int worker) {
    uint64_t task;
    memcpy(&task, (char *)m->payload + offsetof(mpc_pool_msg, task), sizeof task);
    PyObject *rp = mpc_py_ring_message(m->refs, m->nrefs, (char *)m->payload + HEADER,
                                       m->len - HEADER);
    free(m->refs);
    free(m->payload);
    uint32_t kind = m->kind;
    free(m);
    if (rp == NULL)
        return NULL;
    PyObject *res = Py_BuildValue("(iIKOO)", worker, kind, (unsigned long long)task,
                                  PyTuple_GET_ITEM(rp, 0), PyTuple_GET_ITEM(rp, 1));
    Py_DECREF(rp);
    return res;
}

/* Takes the next message off the ring.  Returns a new msg, or NULL with an
 * exception set (queue.Empty when none came before the deadline). */
static msg *take(PoolObject *self, int64_t deadline) {
    if (deadline != 0) {
        mpc_clear_error();
        int rc = mpc_pool_watch_start(self->pool);
        if (rc < 0) {
            mpc_py_raise(mpc_type_state(Py_TYPE(self)), rc);
            return NULL;
        }
    }
    msg *m = calloc(1, sizeof *m);
    if (m == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    int rc = mpc_py_ring_get(self->ring, deadline, &m->refs, &m->nrefs, &m->payload, &m->len);
    if (rc < 0) {
        free(m);
        mpc_py_ring_raise(self->ring_obj, rc);
        return NULL;
    }
    if (m->len < HEADER) {
        msg_drop(m);
        PyErr_SetString(PyExc_RuntimeError, "a DataLoader worker sent a malformed result");
        return NULL;
    }
    memcpy(&m->kind, (char *)m->payload + offsetof(mpc_pool_msg, kind), sizeof m->kind);
    return m;
}

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ring", "nworkers", "prefetch", "in_order", NULL};
    PyObject *ring;
    int nworkers, prefetch, in_order = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oii|p:Pool", kwlist, &ring, &nworkers,
                                     &prefetch, &in_order))
        return NULL;
    mpc_state *st = mpc_type_state(type);
    mpc_ring *r = mpc_py_ring_of(st, ring);
    if (r == NULL)
        return NULL;
    PoolObject *self = (PoolObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    mpc_clear_error();
    int rc = mpc_pool_new(nworkers, prefetch, in_order, msg_set_aside, &self->pool);
    if (rc < 0) {
        Py_DECREF(self);
        return mpc_py_raise(st, rc);
    }
    self->ring_obj = Py_NewRef(ring);
    self->ring = r;
    return (PyObject *)self;
}

static void Pool_dealloc(PyObject *op) {
    PoolObject *self = (PoolObject *)op;
    PyTypeObject *tp = Py_TYPE(op);
    mpc_pool_free(self->pool);
    drop_set_aside();
    Py_XDECREF(self->ring_obj);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *Pool_dispatch(PyObject *op, PyObject *unused) {
    PoolObject *self = (PoolObject *)op;
    int worker;
    uint64_t task;
    mpc_clear_error();
    int rc = mpc_pool_dispatch(self->pool, &worker, &task);
    if (rc == -EAGAIN)
        Py_RETURN_NONE;
    if (rc < 0)
        return mpc_py_raise(mpc_type_state(Py_TYPE(op)), rc);
    return Py_BuildValue("(iK)", worker, (unsigned long long)task);
}

static PyObject *Pool_next(PyObject *op, PyObject *args) {
    PoolObject *self = (PoolObject *)op;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "|O:next", &timeout))
        return NULL;
    int64_t deadline = mpc_py_deadline(1, timeout);
    if (deadline == -2)
        return NULL;
    for (;;) {
        int worker;
        void *data;
        int r = mpc_pool_next(self->pool, &worker, &data);
        if (r == 1)
            return msg_out(data, worker);
        if (r == -EPIPE)
            Py_RETURN_NONE;
        msg *m = take(self, deadline);
        if (m == NULL)
            return NULL;
        uint64_t task;
        uint32_t from;
        memcpy(&task, (char *)m->payload + offsetof(mpc_pool_msg, task), sizeof task);
        memcpy(&from, (char *)m->payload + offsetof(mpc_pool_msg, worker), sizeof from);
        if (m->kind == MPC_POOL_RESUME) { /* a late acknowledgement: nothing to do */
            msg_drop(m);
            continue;
        }
        mpc_clear_error();
        if (m->kind == MPC_POOL_END || m->kind == MPC_POOL_DIED) {
            uint32_t kind = m->kind;
            msg_drop(m);
            if (kind == MPC_POOL_END && mpc_pool_ended(self->pool, task, (int)from) < 0)
                return mpc_py_raise(mpc_type_state(Py_TYPE(op)), -EINVAL);
            return Py_BuildValue("(iIKOO)", (int)from, (unsigned)kind,
                                 (unsigned long long)task, Py_None, Py_None);
        }
        r = mpc_pool_arrived(self->pool, task, m, &worker);
        if (r == 1)
            return msg_out(m, worker);
        if (r < 0) {
            msg_drop(m);
            return mpc_py_raise(mpc_type_state(Py_TYPE(op)), r);
        }
    }
}

static PyObject *Pool_get_raw(PyObject *op, PyObject *args) {
    PoolObject *self = (PoolObject *)op;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "|O:get_raw", &timeout))
        return NULL;
    int64_t deadline = mpc_py_deadline(1, timeout);
    if (deadline == -2)
        return NULL;
    msg *m = take(self, deadline);
    if (m == NULL)
        return NULL;
    uint32_t from;
    memcpy(&from, (char *)m->payload + offsetof(mpc_pool_msg, worker), sizeof from);
    return msg_out(m, (int)from);
}

static PyObject *Pool_delivered(PyObject *op, PyObject *arg) {
    int w = (int)PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    mpc_pool_delivered(((PoolObject *)op)->pool, w);
    Py_RETURN_NONE;
}

static PyObject *Pool_deactivate(PyObject *op, PyObject *arg) {
    int w = (int)PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    mpc_pool_deactivate(((PoolObject *)op)->pool, w);
    Py_RETURN_NONE;
}

static PyObject *Pool_start_at(PyObject *op, PyObject *arg) {
    int w = (int)PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    mpc_clear_error();
    int rc = mpc_pool_start_at(((PoolObject *)op)->pool, w);
    if (rc < 0)
        return mpc_py_raise(mpc_type_state(Py_TYPE(op)), rc);
    Py_RETURN_NONE;
}

static PyObject *Pool_active(PyObject *op, PyObject *arg) {
    int w = (int)PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(mpc_pool_active(((PoolObject *)op)->pool, w));
}

static PyObject *Pool_watch(PyObject *op, PyObject *args) {
    PoolObject *self = (PoolObject *)op;
    int worker;
    long pid;
    if (!PyArg_ParseTuple(args, "il:watch", &worker, &pid))
        return NULL;
    mpc_clear_error();
    int rc = mpc_pool_watch(self->pool, worker, (pid_t)pid, self->ring);
    if (rc < 0)
        return mpc_py_raise(mpc_type_state(Py_TYPE(op)), rc);
    Py_RETURN_NONE;
}

static PyObject *Pool_unwatch(PyObject *op, PyObject *unused) {
    PoolObject *self = (PoolObject *)op;
    Py_BEGIN_ALLOW_THREADS /* joins the watcher, which may wait up to a step */
    mpc_pool_unwatch(self->pool);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Pool_reset(PyObject *op, PyObject *unused) {
    mpc_pool_reset(((PoolObject *)op)->pool);
    drop_set_aside();
    Py_RETURN_NONE;
}

static PyObject *Pool_get_outstanding(PyObject *op, void *c) {
    return PyLong_FromUnsignedLongLong(mpc_pool_outstanding(((PoolObject *)op)->pool));
}

static PyObject *Pool_get_kept(PyObject *op, void *c) {
    return PyLong_FromUnsignedLongLong(mpc_pool_kept(((PoolObject *)op)->pool));
}

static PyMethodDef Pool_methods[] = {
    {"dispatch", Pool_dispatch, METH_NOARGS,
     "dispatch() -> (worker, task) for the next task, or None when no worker can take it"},
    {"next", Pool_next, METH_VARARGS,
     "next(timeout=None) -> (worker, kind, task, refs, payload) of the next result in turn,\n"
     "or None when the epoch is over.  A worker whose iterable ended gives POOL_END, and\n"
     "one whose process ended POOL_DIED, with refs and payload None.  Raises queue.Empty\n"
     "when nothing came in time."},
    {"get_raw", Pool_get_raw, METH_VARARGS,
     "get_raw(timeout=None) -> (worker, kind, task, refs, payload) of the next message,\n"
     "outside the books (used while the epoch restarts)."},
    {"delivered", Pool_delivered, METH_O, "delivered(worker): a result was handed out"},
    {"deactivate", Pool_deactivate, METH_O, "deactivate(worker): no more tasks for it"},
    {"active", Pool_active, METH_O, "active(worker) -> bool"},
    {"start_at", Pool_start_at, METH_O,
     "start_at(worker): the round robin looks at that worker first for the next task"},
    {"reset", Pool_reset, METH_NOARGS, "reset(): a new epoch; kept results are dropped"},
    {"watch", Pool_watch, METH_VARARGS,
     "watch(worker, pid): a POOL_DIED message comes when that process ends (from the\n"
     "first wait on); call for every worker before waiting"},
    {"unwatch", Pool_unwatch, METH_NOARGS,
     "unwatch(): stop watching the workers; no POOL_DIED message comes after it"},
    {NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"outstanding", Pool_get_outstanding, NULL, "tasks sent whose result has not arrived", NULL},
    {"kept", Pool_get_kept, NULL, "results that arrived early and wait for their turn", NULL},
    {NULL},
};

static PyType_Slot Pool_slots[] = {
    {Py_tp_new, Pool_new},
    {Py_tp_dealloc, Pool_dealloc},
    {Py_tp_methods, Pool_methods},
    {Py_tp_getset, Pool_getset},
    {Py_tp_doc, "Pool(ring, nworkers, prefetch, in_order=True): books on DataLoader workers\n"
                "whose results arrive on ring (NOTE [ Dispatch and reassembly ] in pool.c)."},
    {0, NULL},
};

static PyType_Spec Pool_spec = {
    .name = "mpcore._core.Pool",
    .basicsize = sizeof(PoolObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Pool_slots,
};

int mpc_py_pool_exec(PyObject *m, mpc_state *st) {
    PyObject *type = PyType_FromModuleAndSpec(m, &Pool_spec, NULL);
    if (type == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "Pool", type);
    Py_DECREF(type);
    if (r < 0)
        return -1;
    /* The wire format of pool messages (mpc_pool_msg), for data/_worker.py. */
    static const struct {
        const char *name;
        long value;
    } consts[] = {
        {"POOL_HEADER_SIZE", (long)sizeof(mpc_pool_msg)},
        {"POOL_HEADER_TASK", (long)offsetof(mpc_pool_msg, task)},
        {"POOL_HEADER_WORKER", (long)offsetof(mpc_pool_msg, worker)},
        {"POOL_HEADER_KIND", (long)offsetof(mpc_pool_msg, kind)},
        {"POOL_COLLATED", MPC_POOL_COLLATED},
        {"POOL_PICKLED", MPC_POOL_PICKLED},
        {"POOL_ERROR", MPC_POOL_ERROR},
        {"POOL_END", MPC_POOL_END},
        {"POOL_RESUME", MPC_POOL_RESUME},
        {"POOL_DIED", MPC_POOL_DIED},
    };
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++)
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0)
            return -1;
    return 0;
}
