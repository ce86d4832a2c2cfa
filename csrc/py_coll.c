/* py_coll.c: mpcore._core.Group, one rank's handle on a group of
 * shared-memory collectives (coll.c and the files coll.h lists);
 * GroupBuffer, memory the other ranks map when a collective names it;
 * coll_create, which makes the group's region; and what the core reduces
 * (COLL_DTYPES, COLL_OPS, COLL_REDUCES, COLL_MAX_RANKS).  Buffers are passed as addresses (a
 * tensor's data_ptr(), an array's data address) that the caller keeps alive
 * and contiguous.  Every call takes its arguments by position or by name,
 * so a caller names `timeout` and `buffer` rather than reordering them.
 * Collectives run with the GIL released; a signal during a wait runs
 * Python's handlers, and if one raises, the collective gives up. */
#include "py_mpcore.h"

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    mpc_coll *c;
} GroupObject;

typedef struct {
    PyObject_HEAD
    mpc_coll_buf *b;
    PyObject *weakreflist;
} GroupBufferObject;

/* While a collective runs without the GIL: the thread state to take back
 * when a signal needs handling. */
typedef struct {
    PyThreadState *ts;
} wait_ctx;

/* This thread's call in progress, or NULL.  Per thread, so that a
 * collective, a send and a recv may wait on one Group from different
 * threads (NOTE [ Mailboxes ] in coll_p2p.c). */
static __thread wait_ctx *cur_wait;

static int on_signal(void *arg) {
    wait_ctx *w = cur_wait;
    if (w == NULL)
        return 0;
    PyEval_RestoreThread(w->ts);
    int r = PyErr_CheckSignals();
    w->ts = PyEval_SaveThread();
    return r < 0;
}

static mpc_coll *group_of(PyObject *op) {
    GroupObject *self = (GroupObject *)op;
    if (self->c == NULL)
        PyErr_SetString(PyExc_ValueError, "the group is closed");
    return self->c;
}

/* The exception for a failed collective: RuntimeError for a broken group
 * (a rank died or gave up), the usual mapping otherwise. */
static PyObject *coll_raise(PyObject *op, int rc) {
    if (PyErr_Occurred())
        return NULL;
    if (rc == -EPIPE || rc == -EINTR) {
        PyErr_SetString(PyExc_RuntimeError, mpc_errmsg());
        return NULL;
    }
    return mpc_py_raise(mpc_type_state(Py_TYPE(op)), rc);
}

/* Runs call (an int expression) without the GIL, with this thread's wait
 * context set for on_signal; leaves its result in rc. */
#define WAIT(rc, call)                                                                     \
    do {                                                                                   \
        wait_ctx w_;                                                                       \
        cur_wait = &w_;                                                                    \
        mpc_clear_error();                                                                 \
        w_.ts = PyEval_SaveThread();                                                       \
        rc = (call);                                                                       \
        PyEval_RestoreThread(w_.ts);                                                       \
        cur_wait = NULL;                                                                   \
    } while (0)

#define RUN(op, call)                                                                      \
    do {                                                                                   \
        int rc_;                                                                           \
        WAIT(rc_, call);                                                                   \
        if (rc_ < 0)                                                                       \
            return coll_raise(op, rc_);                                                    \
        Py_RETURN_NONE;                                                                    \
    } while (0)

static PyObject *Group_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"fd", "rank", "world", "direct", NULL};
    int fd, rank, world, direct = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iii|p:Group", kwlist, &fd, &rank, &world,
                                     &direct))
        return NULL;
    GroupObject *self = (GroupObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    mpc_clear_error();
    int r = mpc_coll_attach(fd, rank, world, direct, &self->c);
    if (r < 0) {
        Py_DECREF(self);
        return mpc_py_raise(mpc_type_state(type), r);
    }
    mpc_coll_set_interrupt(self->c, on_signal, NULL);
    return (PyObject *)self;
}

static void Group_dealloc(PyObject *op) {
    PyTypeObject *tp = Py_TYPE(op);
    mpc_coll_close(((GroupObject *)op)->c);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static int64_t deadline_of(PyObject *timeout) { return mpc_py_deadline(1, timeout); }

/* An optional argument mpc_py_args left NULL, as None. */
#define OR_NONE(o) ((o) != NULL ? (o) : Py_None)

static PyObject *Group_watch(PyObject *op, PyObject *unused) {
    mpc_coll *c = group_of(op);
    if (c == NULL)
        return NULL;
    mpc_clear_error();
    int r = mpc_coll_watch(c);
    if (r < 0)
        return mpc_py_raise(mpc_type_state(Py_TYPE(op)), r);
    Py_RETURN_NONE;
}

static PyObject *Group_set_labels(PyObject *op, PyObject *arg) {
    mpc_coll *c = group_of(op);
    if (c == NULL)
        return NULL;
    int world = mpc_coll_world(c), labels[MPC_COLL_MAX_RANKS];
    PyObject *seq = PySequence_Fast(arg, "set_labels takes a sequence of ints");
    if (seq == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != world) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "set_labels takes one label per rank (%d), not %zd",
                            world, PySequence_Fast_GET_SIZE(seq));
    }
    for (int q = 0; q < world; q++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, q));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        labels[q] = (int)v;
    }
    Py_DECREF(seq);
    mpc_coll_set_labels(c, labels);
    Py_RETURN_NONE;
}

static PyObject *Group_direct(PyObject *op, PyObject *unused) {
    mpc_coll *c = group_of(op);
    if (c == NULL)
        return NULL;
    return PyBool_FromLong(mpc_coll_direct(c));
}

static PyObject *Group_break(PyObject *op, PyObject *arg) {
    mpc_coll *c = group_of(op);
    const char *why = c ? PyUnicode_AsUTF8(arg) : NULL;
    if (why == NULL)
        return NULL;
    mpc_coll_break(c, why);
    Py_RETURN_NONE;
}

static PyObject *Group_pid(PyObject *op, PyObject *arg) {
    mpc_coll *c = group_of(op);
    long rank = c ? PyLong_AsLong(arg) : -1;
    if (c == NULL || (rank == -1 && PyErr_Occurred()))
        return NULL;
    return PyLong_FromLong(mpc_coll_pid(c, (int)rank));
}

/* The group buffer that `in` names (NULL for None) into *b; -1 with
 * TypeError naming `what` for anything else. */
static int buffer_arg(PyObject *op, PyObject *in, const char *what, mpc_coll_buf **b) {
    *b = NULL;
    if (in == Py_None)
        return 0;
    if (!PyObject_TypeCheck(in, mpc_type_state(Py_TYPE(op))->GroupBufferType)) {
        PyErr_Format(PyExc_TypeError, "%s: buffer must be a GroupBuffer, not %s", what,
                     Py_TYPE(in)->tp_name);
        return -1;
    }
    *b = ((GroupBufferObject *)in)->b;
    return 0;
}

/* The open group of op, a Group, with timeout in ns from now in *ns
 * (mpc_py_timeout_ns: the caller reads the clock, mpc_py_after, when it
 * needs the deadline); NULL with TypeError naming what when op is not a
 * Group, or the error of a closed group or a bad timeout. */
static mpc_coll *group_for(PyObject *op, const char *what, PyObject *timeout, int64_t *ns) {
    if (Py_TYPE(op)->tp_dealloc != Group_dealloc) {
        PyErr_Format(PyExc_TypeError, "%s needs a Group, not %.100s", what, Py_TYPE(op)->tp_name);
        return NULL;
    }
    mpc_coll *c = group_of(op);
    if (c != NULL && (*ns = mpc_py_timeout_ns(timeout)) == -2)
        return NULL;
    return c;
}

PyObject *mpc_py_group_all_reduce(PyObject *op, uint64_t addr, uint64_t count, int dtype,
                                  int rop, mpc_coll_buf *b, PyObject *timeout) {
    int64_t ns;
    mpc_coll *c = group_for(op, "an all_reduce", timeout, &ns);
    if (c == NULL)
        return NULL;
    int64_t dl = mpc_py_after(ns);
    RUN(op, mpc_coll_all_reduce(c, (void *)(uintptr_t)addr, count, dtype, rop, b, dl));
}

static PyObject *Group_all_reduce(PyObject *op, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames) {
    static const char *const names[] = {"address", "count", "dtype", "op", "timeout", "buffer",
                                        NULL};
    mpc_py_argv av;
    uint64_t addr, count;
    int dtype, rop;
    mpc_coll_buf *b;
    if (mpc_py_args(&av, "all_reduce", names, 4, args, nargs, kwnames) < 0 ||
        mpc_py_u64(&av, 0, &addr) < 0 ||
        mpc_py_u64(&av, 1, &count) < 0 ||
        mpc_py_int(&av, 2, &dtype) < 0 ||
        mpc_py_int(&av, 3, &rop) < 0 ||
        buffer_arg(op, OR_NONE(av.a[5]), "all_reduce", &b) < 0)
        return NULL;
    return mpc_py_group_all_reduce(op, addr, count, dtype, rop, b, OR_NONE(av.a[4]));
}

PyObject *mpc_py_group_broadcast(PyObject *op, uint64_t addr, uint64_t nbytes, int root,
                                 PyObject *timeout) {
    int64_t ns;
    mpc_coll *c = group_for(op, "a broadcast", timeout, &ns);
    if (c == NULL)
        return NULL;
    int64_t dl = mpc_py_after(ns);
    RUN(op, mpc_coll_broadcast(c, (void *)(uintptr_t)addr, nbytes, root, dl));
}

static PyObject *Group_broadcast(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"address", "nbytes", "root", "timeout", NULL};
    mpc_py_argv av;
    uint64_t addr, n;
    int root;
    if (mpc_py_args(&av, "broadcast", names, 3, args, nargs, kwnames) < 0 ||
        mpc_py_u64(&av, 0, &addr) < 0 ||
        mpc_py_u64(&av, 1, &n) < 0 ||
        mpc_py_int(&av, 2, &root) < 0)
        return NULL;
    return mpc_py_group_broadcast(op, addr, n, root, OR_NONE(av.a[3]));
}

/* NOTE [ A barrier's first looks keep the GIL ]
 * A barrier between two ranks that arrive together ends within a few
 * tenths of a microsecond, and letting the GIL go and taking it back costs
 * a good part of that.  So a Group's barrier arrives and looks at the
 * barrier's word MPC_PY_BARRIER_LOOKS times (a spin hint between looks:
 * 128 hints took 1.4 us on a 2.6 GHz Xeon) holding the GIL; only a
 * barrier that is not over by then lets the GIL go while it waits, as every
 * other wait of the core does.  Other Python threads wait for the GIL no
 * longer than those looks.  With more ranks than CPUs the core does not
 * look again after arriving (mpc_coll_barrier_start), since the ranks it
 * waits for may need this CPU. */
#define MPC_PY_BARRIER_LOOKS 128

PyObject *mpc_py_group_barrier(PyObject *op, PyObject *timeout) {
    int64_t ns;
    mpc_coll *c = group_for(op, "a barrier", timeout, &ns);
    if (c == NULL)
        return NULL;
    /* NOTE [ A barrier's first looks keep the GIL ]; the clock is read only
     * for a barrier that must wait (about 0.02 us) */
    mpc_clear_error();
    int r = mpc_coll_barrier_start(c, MPC_PY_BARRIER_LOOKS);
    if (r > 0)
        Py_RETURN_NONE;
    if (r < 0)
        return coll_raise(op, r);
    int64_t dl = mpc_py_after(ns);
    RUN(op, mpc_coll_barrier_end(c, dl));
}

static PyObject *Group_barrier(PyObject *op, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"timeout", NULL};
    mpc_py_argv av;
    if (mpc_py_args(&av, "barrier", names, 0, args, nargs, kwnames) < 0)
        return NULL;
    return mpc_py_group_barrier(op, OR_NONE(av.a[0]));
}

static PyObject *Group_all_gather(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"out_address", "in_address", "nbytes", "timeout", "buffer",
                                        NULL};
    mpc_py_argv av;
    uint64_t out, in, n;
    mpc_coll_buf *b;
    mpc_coll *c = group_of(op);
    if (c == NULL || mpc_py_args(&av, "all_gather", names, 3, args, nargs, kwnames) < 0 ||
        mpc_py_u64(&av, 0, &out) < 0 ||
        mpc_py_u64(&av, 1, &in) < 0 ||
        mpc_py_u64(&av, 2, &n) < 0 ||
        buffer_arg(op, OR_NONE(av.a[4]), "all_gather", &b) < 0)
        return NULL;
    int64_t dl = deadline_of(OR_NONE(av.a[3]));
    if (dl == -2)
        return NULL;
    RUN(op, mpc_coll_all_gather(c, (void *)(uintptr_t)out, (const void *)(uintptr_t)in, n, b, dl));
}

static PyObject *Group_reduce_scatter(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"out_address", "in_address", "count", "dtype", "op",
                                        "timeout", "buffer", NULL};
    mpc_py_argv av;
    uint64_t out, in, count;
    int dtype, rop;
    mpc_coll_buf *b;
    mpc_coll *c = group_of(op);
    if (c == NULL || mpc_py_args(&av, "reduce_scatter", names, 5, args, nargs, kwnames) < 0 ||
        mpc_py_u64(&av, 0, &out) < 0 ||
        mpc_py_u64(&av, 1, &in) < 0 ||
        mpc_py_u64(&av, 2, &count) < 0 ||
        mpc_py_int(&av, 3, &dtype) < 0 ||
        mpc_py_int(&av, 4, &rop) < 0 ||
        buffer_arg(op, OR_NONE(av.a[6]), "reduce_scatter", &b) < 0)
        return NULL;
    int64_t dl = deadline_of(OR_NONE(av.a[5]));
    if (dl == -2)
        return NULL;
    RUN(op, mpc_coll_reduce_scatter(c, (void *)(uintptr_t)out, (const void *)(uintptr_t)in,
                                    count, dtype, rop, b, dl));
}

static PyObject *Group_reduce(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"address", "count", "dtype", "op", "root", "timeout",
                                        "buffer", NULL};
    mpc_py_argv av;
    uint64_t addr, count;
    int dtype, rop, root;
    mpc_coll_buf *b;
    mpc_coll *c = group_of(op);
    if (c == NULL || mpc_py_args(&av, "reduce", names, 5, args, nargs, kwnames) < 0 ||
        mpc_py_u64(&av, 0, &addr) < 0 ||
        mpc_py_u64(&av, 1, &count) < 0 ||
        mpc_py_int(&av, 2, &dtype) < 0 ||
        mpc_py_int(&av, 3, &rop) < 0 ||
        mpc_py_int(&av, 4, &root) < 0 ||
        buffer_arg(op, OR_NONE(av.a[6]), "reduce", &b) < 0)
        return NULL;
    int64_t dl = deadline_of(OR_NONE(av.a[5]));
    if (dl == -2)
        return NULL;
    RUN(op, mpc_coll_reduce(c, (void *)(uintptr_t)addr, count, dtype, rop, root, b, dl));
}

/* Reads a sequence of `world` byte counts (or addresses) into sizes.
 * Returns 0, or -1 with a ValueError or TypeError naming `what`. */
static int sizes_of(PyObject *seq, int world, const char *what, uint64_t *sizes) {
    PyObject *fast = PySequence_Fast(seq, "sizes or addresses must be a sequence");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n != world) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s has %zd entries, not one per rank (%d)", what, n,
                     world);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        long long v = PyLong_AsLongLong(item);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (v < 0) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "%s[%zd] is %lld, a negative number", what, i, v);
            return -1;
        }
        sizes[i] = (uint64_t)v;
    }
    Py_DECREF(fast);
    return 0;
}

/* The root's buffers of a gather or scatter: `bufs` is one address (a
 * buffer of world * nbytes, rank q's piece at q * nbytes) or a sequence of
 * `world` addresses.  Returns 0, or -1 with the exception set. */
static int buffers_of(PyObject *bufs, int world, uint64_t nbytes, const char *what,
                      void **out) {
    if (PyLong_Check(bufs)) {
        unsigned long long base = PyLong_AsUnsignedLongLong(bufs);
        if (base == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        for (int q = 0; q < world; q++)
            out[q] = base ? (void *)(uintptr_t)(base + (uint64_t)q * nbytes) : NULL;
        return 0;
    }
    uint64_t a[MPC_COLL_MAX_RANKS];
    if (sizes_of(bufs, world, what, a) < 0)
        return -1;
    for (int q = 0; q < world; q++)
        out[q] = (void *)(uintptr_t)a[q];
    return 0;
}

static PyObject *Group_gather(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"outs", "in_address", "nbytes", "root", "timeout", NULL};
    mpc_py_argv av;
    uint64_t in, n;
    int root;
    void *bufs[MPC_COLL_MAX_RANKS];
    mpc_coll *c = group_of(op);
    if (c == NULL || mpc_py_args(&av, "gather", names, 4, args, nargs, kwnames) < 0 ||
        mpc_py_u64(&av, 1, &in) < 0 ||
        mpc_py_u64(&av, 2, &n) < 0 ||
        mpc_py_int(&av, 3, &root) < 0 ||
        buffers_of(av.a[0], mpc_coll_world(c), n, "gather's outputs", bufs) < 0)
        return NULL;
    int64_t dl = deadline_of(OR_NONE(av.a[4]));
    if (dl == -2)
        return NULL;
    RUN(op, mpc_coll_gather(c, bufs, (const void *)(uintptr_t)in, n, root, dl));
}

static PyObject *Group_scatter(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"out_address", "ins", "nbytes", "root", "timeout", NULL};
    mpc_py_argv av;
    uint64_t out, n;
    int root;
    void *bufs[MPC_COLL_MAX_RANKS];
    mpc_coll *c = group_of(op);
    if (c == NULL || mpc_py_args(&av, "scatter", names, 4, args, nargs, kwnames) < 0 ||
        mpc_py_u64(&av, 0, &out) < 0 ||
        mpc_py_u64(&av, 2, &n) < 0 ||
        mpc_py_int(&av, 3, &root) < 0 ||
        buffers_of(av.a[1], mpc_coll_world(c), n, "scatter's inputs", bufs) < 0)
        return NULL;
    int64_t dl = deadline_of(OR_NONE(av.a[4]));
    if (dl == -2)
        return NULL;
    RUN(op, mpc_coll_scatter(c, (void *)(uintptr_t)out, (const void *const *)bufs, n, root, dl));
}

static PyObject *Group_all_to_all(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"out_address", "in_address", "send_sizes", "recv_sizes",
                                        "timeout", "buffer", NULL};
    mpc_py_argv av;
    uint64_t out, in;
    mpc_coll_buf *b;
    mpc_coll *c = group_of(op);
    if (c == NULL || mpc_py_args(&av, "all_to_all", names, 4, args, nargs, kwnames) < 0 ||
        mpc_py_u64(&av, 0, &out) < 0 ||
        mpc_py_u64(&av, 1, &in) < 0 ||
        buffer_arg(op, OR_NONE(av.a[5]), "all_to_all", &b) < 0)
        return NULL;
    int world = mpc_coll_world(c);
    uint64_t s[MPC_COLL_MAX_RANKS], r[MPC_COLL_MAX_RANKS];
    if (sizes_of(av.a[2], world, "all_to_all's send_sizes", s) < 0 ||
        sizes_of(av.a[3], world, "all_to_all's recv_sizes", r) < 0)
        return NULL;
    int64_t dl = deadline_of(OR_NONE(av.a[4]));
    if (dl == -2)
        return NULL;
    RUN(op, mpc_coll_all_to_all(c, (void *)(uintptr_t)out, (const void *)(uintptr_t)in, s, r, b,
                                dl));
}

/* A tag: torch's are non-negative ints that fit 32 bits.  Returns 0, or -1
 * with a ValueError. */
static int tag_of(long long tag, uint32_t *out) {
    if (tag < 0 || tag > (long long)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "tag %lld is not in 0..%u", tag, UINT32_MAX);
        return -1;
    }
    *out = (uint32_t)tag;
    return 0;
}

/* The address, size, peer and tag of a send or receive (av->a[0..3], the tag
 * 0 when not given).  Returns 0, or -1 with the exception set. */
static int p2p_args(const mpc_py_argv *av, uint64_t *addr, uint64_t *n, int *peer,
                    uint32_t *tag) {
    long long t = 0;
    if (mpc_py_u64(av, 0, addr) < 0 || mpc_py_u64(av, 1, n) < 0 || mpc_py_int(av, 2, peer) < 0 ||
        (av->a[3] != NULL && (t = PyLong_AsLongLong(av->a[3])) == -1 && PyErr_Occurred()))
        return -1;
    return tag_of(t, tag);
}

static PyObject *Group_send(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"address", "nbytes", "dst", "tag", "timeout", NULL};
    mpc_py_argv av;
    uint64_t addr, n;
    int dst;
    uint32_t t;
    mpc_coll *c = group_of(op);
    if (c == NULL || mpc_py_args(&av, "send", names, 3, args, nargs, kwnames) < 0 ||
        p2p_args(&av, &addr, &n, &dst, &t) < 0)
        return NULL;
    int64_t dl = deadline_of(OR_NONE(av.a[4]));
    if (dl == -2)
        return NULL;
    RUN(op, mpc_coll_send(c, (const void *)(uintptr_t)addr, n, dst, t, dl));
}

static PyObject *Group_try_send(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"address", "nbytes", "dst", "tag", NULL};
    mpc_py_argv av;
    uint64_t addr, n;
    int dst, rc;
    uint32_t t;
    mpc_coll *c = group_of(op);
    if (c == NULL || mpc_py_args(&av, "try_send", names, 3, args, nargs, kwnames) < 0 ||
        p2p_args(&av, &addr, &n, &dst, &t) < 0)
        return NULL;
    WAIT(rc, mpc_coll_try_send(c, (const void *)(uintptr_t)addr, n, dst, t));
    if (rc < 0)
        return coll_raise(op, rc);
    return PyBool_FromLong(rc);
}

static PyObject *Group_recv(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"address", "nbytes", "src", "tag", "timeout", NULL};
    mpc_py_argv av;
    uint64_t addr, n;
    int src;
    uint32_t t;
    mpc_coll *c = group_of(op);
    if (c == NULL || mpc_py_args(&av, "recv", names, 3, args, nargs, kwnames) < 0 ||
        p2p_args(&av, &addr, &n, &src, &t) < 0)
        return NULL;
    int64_t dl = deadline_of(OR_NONE(av.a[4]));
    if (dl == -2)
        return NULL;
    int rc;
    WAIT(rc, mpc_coll_recv(c, (void *)(uintptr_t)addr, n, src, t, dl));
    if (rc < 0)
        return coll_raise(op, rc);
    return PyLong_FromLong(rc);
}

static PyObject *Group_close(PyObject *op, PyObject *unused) {
    GroupObject *self = (GroupObject *)op;
    mpc_coll_close(self->c);
    self->c = NULL;
    Py_RETURN_NONE;
}

/* A method that takes its arguments by position or by name, read without a
 * tuple (NOTE [ Arguments read without a tuple ] in py_core.c). */
#define FAST(fn) (PyCFunction)(void (*)(void))(fn), METH_FASTCALL | METH_KEYWORDS

static PyMethodDef Group_methods[] = {
    {"watch", Group_watch, METH_NOARGS, "watch(): from now on, a peer that exits breaks the group"},
    {"break_group", Group_break, METH_O,
     "break_group(why): every rank's current and later calls fail with why"},
    {"pid", Group_pid, METH_O, "pid(rank) -> the pid that rank attached with"},
    {"set_labels", Group_set_labels, METH_O,
     "set_labels(ranks): the group's messages call rank q ranks[q] (a subgroup's global ranks)"},
    {"direct", Group_direct, METH_NOARGS,
     "direct() -> whether large data movers copy straight between the ranks' memory"},
    {"all_reduce", FAST(Group_all_reduce),
     "all_reduce(address, count, dtype, op, timeout=None, buffer=None): in place; buffer:\n"
     "the GroupBuffer holding the data, if it is in one"},
    {"broadcast", FAST(Group_broadcast), "broadcast(address, nbytes, root, timeout=None)"},
    {"barrier", FAST(Group_barrier), "barrier(timeout=None)"},
    {"all_gather", FAST(Group_all_gather),
     "all_gather(out_address, in_address, nbytes, timeout=None, buffer=None)"},
    {"reduce_scatter", FAST(Group_reduce_scatter),
     "reduce_scatter(out_address, in_address, count, dtype, op, timeout=None, buffer=None)"},
    {"reduce", FAST(Group_reduce),
     "reduce(address, count, dtype, op, root, timeout=None, buffer=None): root's data\n"
     "becomes the reduction; the others' stays; buffer as all_reduce's"},
    {"gather", FAST(Group_gather),
     "gather(outs, in_address, nbytes, root, timeout=None): on root, outs (one address of\n"
     "world * nbytes, or world addresses of nbytes) gets every rank's in; ignored elsewhere"},
    {"scatter", FAST(Group_scatter),
     "scatter(out_address, ins, nbytes, root, timeout=None): out gets the root's ins[rank]\n"
     "(one address of world * nbytes, or world addresses of nbytes); ins read on root only"},
    {"all_to_all", FAST(Group_all_to_all),
     "all_to_all(out_address, in_address, send_sizes, recv_sizes, timeout=None, buffer=None):\n"
     "byte counts per rank; in and out hold the pieces for/from ranks 0..world-1 end to end;\n"
     "buffer: the GroupBuffer that holds in, if any"},
    {"send", FAST(Group_send),
     "send(address, nbytes, dst, tag=0, timeout=None)"},
    {"try_send", FAST(Group_try_send),
     "try_send(address, nbytes, dst, tag=0) -> True once sent, False (nothing done) when the "
     "message does not fit in dst's mailbox now; never waits"},
    {"recv", FAST(Group_recv),
     "recv(address, nbytes, src, tag=0, timeout=None) -> the source rank; src=-1: any"},
    {"close", Group_close, METH_NOARGS, "close(): unmaps the group"},
    {NULL},
};

static PyType_Slot Group_slots[] = {
    {Py_tp_new, Group_new},
    {Py_tp_dealloc, Group_dealloc},
    {Py_tp_methods, Group_methods},
    {Py_tp_doc, "Group(fd, rank, world): this rank's handle on a shared-memory group\n"
                "(NOTE [ Shared-memory collectives ] in coll.c)."},
    {0, NULL},
};

static PyType_Spec Group_spec = {
    .name = "mpcore._core.Group",
    .basicsize = sizeof(GroupObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Group_slots,
};

/* GroupBuffer(nbytes): shared memory that the other ranks map when an
 * all-reduce or reduce names it; a writable buffer of whole pages. */
static PyObject *GroupBuffer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"nbytes", NULL};
    unsigned long long n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "K:GroupBuffer", kwlist, &n))
        return NULL;
    GroupBufferObject *self = (GroupBufferObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    mpc_clear_error();
    int r = mpc_coll_buf_new(n, &self->b);
    if (r < 0) {
        Py_DECREF(self);
        return mpc_py_raise(mpc_type_state(type), r);
    }
    return (PyObject *)self;
}

static void GroupBuffer_dealloc(PyObject *op) {
    PyTypeObject *tp = Py_TYPE(op);
    GroupBufferObject *self = (GroupBufferObject *)op;
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs(op);
    mpc_coll_buf_free(self->b);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static int GroupBuffer_getbuffer(PyObject *op, Py_buffer *view, int flags) {
    uint64_t n;
    void *addr = mpc_coll_buf_addr(((GroupBufferObject *)op)->b, &n);
    return PyBuffer_FillInfo(view, op, addr, (Py_ssize_t)n, 0, flags);
}

static PyObject *GroupBuffer_address(PyObject *op, void *unused) {
    uint64_t n;
    return PyLong_FromVoidPtr(mpc_coll_buf_addr(((GroupBufferObject *)op)->b, &n));
}

static PyObject *GroupBuffer_nbytes(PyObject *op, void *unused) {
    uint64_t n;
    mpc_coll_buf_addr(((GroupBufferObject *)op)->b, &n);
    return PyLong_FromUnsignedLongLong(n);
}

static PyGetSetDef GroupBuffer_getset[] = {
    {"address", GroupBuffer_address, NULL, "address in this process", NULL},
    {"nbytes", GroupBuffer_nbytes, NULL, "size in bytes (whole pages)", NULL},
    {NULL},
};

static PyMemberDef GroupBuffer_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(GroupBufferObject, weakreflist), READONLY},
    {NULL},
};

static PyType_Slot GroupBuffer_slots[] = {
    {Py_tp_new, GroupBuffer_new},
    {Py_tp_dealloc, GroupBuffer_dealloc},
    {Py_tp_getset, GroupBuffer_getset},
    {Py_tp_members, GroupBuffer_members},
    {Py_bf_getbuffer, GroupBuffer_getbuffer},
    {Py_tp_doc, "GroupBuffer(nbytes): shared memory the other ranks of a group map when an\n"
                "all-reduce or reduce names it (NOTE [ Group buffers ] in coll_copy.c)."},
    {0, NULL},
};

static PyType_Spec GroupBuffer_spec = {
    .name = "mpcore._core.GroupBuffer",
    .basicsize = sizeof(GroupBufferObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = GroupBuffer_slots,
};

/* coll_create(world, chunk) -> fd of a new group's region (the caller
 * closes it). */
static PyObject *py_coll_create(PyObject *m, PyObject *args) {
    int world;
    unsigned long long chunk;
    if (!PyArg_ParseTuple(args, "iK:coll_create", &world, &chunk))
        return NULL;
    int fd, r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_coll_create(world, chunk, &fd);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return mpc_py_raise(mpc_get_state(m), r);
    return PyLong_FromLong(fd);
}

PyMethodDef mpc_py_coll_methods[] = {
    {"coll_create", py_coll_create, METH_VARARGS,
     "coll_create(world, chunk) -> fd of a new shared-memory group"},
    {NULL},
};

int mpc_py_coll_exec(PyObject *m, mpc_state *st) {
    PyObject *type = PyType_FromModuleAndSpec(m, &Group_spec, NULL);
    if (type == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "Group", type);
    Py_DECREF(type);
    if (r < 0)
        return -1;
    type = PyType_FromModuleAndSpec(m, &GroupBuffer_spec, NULL);
    if (type == NULL || PyModule_AddObjectRef(m, "GroupBuffer", type) < 0) {
        Py_XDECREF(type);
        return -1;
    }
    st->GroupBufferType = (PyTypeObject *)type; /* the state owns this reference */
    /* COLL_DTYPES and COLL_OPS: name -> code, from coll_kernels.c's tables */
    PyObject *dtypes = PyDict_New(), *ops = PyDict_New();
    int bad = dtypes == NULL || ops == NULL;
    for (int i = 0; !bad && mpc_coll_dtype_name(i) != NULL; i++) {
        PyObject *v = PyLong_FromLong(i);
        bad = v == NULL || PyDict_SetItemString(dtypes, mpc_coll_dtype_name(i), v) < 0;
        Py_XDECREF(v);
    }
    for (int i = 0; !bad && mpc_coll_op_name(i) != NULL; i++) {
        PyObject *v = PyLong_FromLong(i);
        bad = v == NULL || PyDict_SetItemString(ops, mpc_coll_op_name(i), v) < 0;
        Py_XDECREF(v);
    }
    /* COLL_REDUCES: (dtype name, op name) -> (dtype code, op code) for every
     * pair the core reduces (mpc_coll_reduces): what a caller may hand the
     * reductions, in one table, so that no caller restates the rule */
    PyObject *reduces = bad ? NULL : PyDict_New();
    bad = bad || reduces == NULL;
    for (int d = 0; !bad && mpc_coll_dtype_name(d) != NULL; d++)
        for (int o = 0; !bad && mpc_coll_op_name(o) != NULL; o++) {
            if (!mpc_coll_reduces(d, o))
                continue;
            PyObject *k = Py_BuildValue("(ss)", mpc_coll_dtype_name(d), mpc_coll_op_name(o));
            PyObject *v = Py_BuildValue("(ii)", d, o);
            bad = k == NULL || v == NULL || PyDict_SetItem(reduces, k, v) < 0;
            Py_XDECREF(k);
            Py_XDECREF(v);
        }
    if (!bad)
        bad = PyModule_AddObjectRef(m, "COLL_DTYPES", dtypes) < 0 ||
              PyModule_AddObjectRef(m, "COLL_OPS", ops) < 0 ||
              PyModule_AddObjectRef(m, "COLL_REDUCES", reduces) < 0 ||
              PyModule_AddIntConstant(m, "COLL_MAX_RANKS", MPC_COLL_MAX_RANKS) < 0;
    Py_XDECREF(dtypes);
    Py_XDECREF(ops);
    Py_XDECREF(reduces);
    return bad ? -1 : 0;
}
