/* py_fastpath.c: what torch.distributed's fast paths (dist/_fastpath.py)
 * do in C: ask whether anything observes a collective right now (torch's
 * profiler, a dispatch mode), of torch's own C++ functions through
 * pointers that the table of torch changes found and checked (NOTE
 * [ Observers asked in C ]), and the whole blocking fast paths of
 * dist.barrier, dist.all_reduce and dist.broadcast (NOTE [ dist.barrier in
 * C ], NOTE [ Small collectives in C ]). */
#include "py_mpcore.h"

#include <structmember.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* NOTE [ Observers asked in C ]
 * Every fast path of a collective first asks whether something observes
 * the call (NOTE [ Fast paths nobody sees ] in dist/_fastpath.py): torch's
 * profiler (torch._C._autograd._profiler_enabled) or a dispatch mode
 * (torch._C._len_torch_dispatch_stack).  Those two are pybind11 functions,
 * about 0.05 us a call each; the C++ functions they bind,
 * torch::profiler::impl::profilerEnabled() and
 * c10::impl::TorchDispatchModeTLS::stack_len(), take no arguments and read
 * this thread's state in a few nanoseconds.  mpcore/_torchapi.py finds them
 * in torch's libraries (rows "libtorch_cpu.so!..." and "libc10.so!..."),
 * checks that each answers what its Python binding answers, and hands
 * their addresses to set_observers(); observed() then asks both in one
 * call.  Where a torch lacks them, set_observers() is never called and the
 * fast paths ask the Python bindings, and barrier_now() serves nothing.
 * Neither function throws or takes the GIL. */

static bool (*profiler_enabled)(void);
static int64_t (*dispatch_stack_len)(void);

static PyObject *set_observers(PyObject *m, PyObject *args) {
    unsigned long long prof, modes;
    if (!PyArg_ParseTuple(args, "KK:set_observers", &prof, &modes))
        return NULL;
    if (prof == 0 || modes == 0) {
        PyErr_SetString(PyExc_ValueError, "set_observers takes two functions' addresses, not 0");
        return NULL;
    }
    profiler_enabled = (bool (*)(void))(uintptr_t)prof;
    dispatch_stack_len = (int64_t (*)(void))(uintptr_t)modes;
    Py_RETURN_NONE;
}

static PyObject *observed(PyObject *m, PyObject *noargs) {
    if (profiler_enabled == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "observed() before set_observers()");
        return NULL;
    }
    return PyBool_FromLong(profiler_enabled() || dispatch_stack_len() != 0);
}

/* NOTE [ dist.barrier in C ]
 * dist.barrier() with none of its arguments (or a group) is a program's
 * most common barrier, and its fast path in Python read nine attributes
 * and made three calls before the core's barrier: about 0.25 us, where the
 * core's own barrier between two ranks costs about as much.  barrier_now
 * makes the same checks in C, in the same order, and the core's barrier:
 * the default group (world._default_pg) or the group given is of the
 * backend's class, nothing observes the call, the group gathers no batch
 * and has no gloo group beside it, it has a shared-memory group (shm) with
 * nothing queued on its collectives' lane; then
 * shm.core.barrier(group.timeout_s).  It returns None, what dist.barrier
 * returns, when it made the barrier, and False, having done nothing,
 * whenever one check fails: the
 * Python function then goes its own way (draining the lane, torch's
 * function), as before.  The Python function leaves it out for a timeout,
 * device_ids, async_op and while compiling.  An error of the barrier
 * itself is raised from here as from the core's call.
 *
 * NOTE [ Small collectives in C ]
 * all_reduce_now and broadcast_now are dist.all_reduce's and
 * dist.broadcast's blocking fast paths the same way, for the calls a
 * latency-bound program makes most (metrics, a loss, tensor parallelism's
 * small sums).  On one rank with 4 KB, the Python fast path cost 0.6 us
 * over the core's own all_reduce: about 0.3 us of it torch's own getters
 * (is_cpu, is_contiguous(), dtype, numel(), data_ptr()), which cost as
 * much called from C, and the rest the interpreter's reads and tests
 * between them, which C makes in a few nanoseconds.  Each makes the
 * Python path's checks in its order (dist/_fastpath.py: all_reduce also
 * the op, a RedOpType the core reduces for the dtype, and a group outside
 * torch's coalescing manager; broadcast the source a global rank of the
 * group) and serves what that path serves at once; an all_reduce of
 * buffer_min bytes or more, which may move into a group buffer (NOTE
 * [ Memory reduced again and again ] in dist/_buffers.py), returns False
 * like any call the checks turn away, and the Python path serves it.
 * What these compare with (the world, the backend's class, torch.Tensor,
 * torch's has_torch_function, the coalescing manager's groups, SUM, the
 * rows of codes) is set once by set_fastpath, after set_observers: until
 * then, and on a torch without the C observers, they serve nothing.
 * Measured, CPU per call on one rank with 4 KB (python
 * benchmarks/fastpath_calls.py --runs 5 --calls 10000, the package before
 * and after alternated, two rounds): dist.all_reduce 0.95 and 0.96 us
 * before, 0.82 and 0.86 after, for the core's 0.33; dist.broadcast 0.72
 * and 0.73, 0.68 and 0.70, for the core's 0.24.  What is left over the
 * core's call is mostly torch's getters.
 * An async call (async_op=True) is served here too, with the same checks
 * but for the lane, where it goes behind whatever is queued: the Work of
 * lane.post(work_type, [tensor], shm.core.all_reduce (or broadcast),
 * (address, count, dtype, op), tensor, bytes <= small), as the Python
 * path posts it (NOTE [ Asynchronous calls on the fast path ] in
 * dist/_fastpath.py).  Each returns what the dist.* call returns (None,
 * or the Work) or False.  Measured (fastpath_calls.py, as above, the
 * package before and after alternated, two rounds; after also holds NOTE
 * [ The group's slots read in place ]): dist.all_reduce(t,
 * async_op=True).wait() 1.87 and 1.96 us before, 1.73 and 1.73 after;
 * broadcast 1.66 and 1.74, 1.50 and 1.57; blocking all_reduce 0.93 and
 * 1.02, 0.89 and 0.85; barrier 0.27 and 0.28, 0.18 and 0.19.  What an
 * async call costs over a blocking one is now mostly the lane's: post()
 * and the wait that runs the call took 0.80 us in a loop of their own,
 * the core's call 0.39 of it. */

/* getattr(o, name), or o.name() when call, is want: 1, 0 (it is not), -1
 * (error). */
static int read_is(PyObject *o, PyObject *name, int call, PyObject *want) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(o, name) : PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int r = v == want;
    Py_DECREF(v);
    return r;
}

#define attr_is(o, name, want) read_is(o, name, 0, want)

/* o.name() (name NULL: o itself) as an unsigned 64-bit int in *out: 1, or
 * -1 with an exception. */
static int u64_of(PyObject *o, PyObject *name, uint64_t *out) {
    PyObject *v = name != NULL ? PyObject_CallMethodNoArgs(o, name) : Py_NewRef(o);
    if (v == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 1;
}

static PyObject *s_default_pg, *s_batch, *s_gloo, *s_shm, *s_collectives, *s_core, *s_timeout_s,
    *s_timeout, *s_is_cpu, *s_is_contiguous, *s_dtype, *s_numel, *s_nbytes, *s_data_ptr,
    *s_value, *s_group_ranks, *s_all_reduce, *s_broadcast;

/* NOTE [ The group's slots read in place ]
 * The fast paths read a group's shm, gloo, batch, timeout_s and
 * group_ranks on every call, and those are slots of the backend's class
 * (NOTE [ The fast paths' attributes are slots ] in dist/_group.py).  A
 * call serves only a group of exactly that class, so set_fastpath notes
 * each slot's offset from its member descriptor, and g_attr() reads it
 * there: a few nanoseconds, where getattr by name walks the type's lookup
 * and the descriptor (about 0.01 us each).  A name that is no plain slot
 * of the class (another class, a property put in its place) is read by
 * name, as before. */
enum { G_SHM, G_GLOO, G_BATCH, G_TIMEOUT_S, G_GROUP_RANKS, G_SLOTS };
static PyObject **const g_names[G_SLOTS] = {&s_shm, &s_gloo, &s_batch, &s_timeout_s,
                                            &s_group_ranks};

static struct {
    PyObject *world, *pg_type, *tensor_type, *has_torch_function, *coalescing, *sum, *sums,
        *rows, *work_type;
    uint64_t buffer_min, small;
    Py_ssize_t g_offset[G_SLOTS]; /* 0: read by name */
} fp; /* set_fastpath's (NOTE [ Small collectives in C ]); world is NULL until then */

/* Where pg_type's instances keep attribute i when it is an object slot of
 * the class (NOTE [ The group's slots read in place ]), else 0; -1 with an
 * exception. */
static Py_ssize_t slot_offset(PyObject *pg_type, int i) {
    PyObject *d = PyObject_GetAttr(pg_type, *g_names[i]);
    if (d == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t off = 0;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *md = ((PyMemberDescrObject *)d)->d_member;
        if (md->type == T_OBJECT_EX && md->offset > 0)
            off = md->offset;
    }
    Py_DECREF(d);
    return off;
}

/* g's attribute i (g of exactly fp.pg_type): a new reference, or NULL
 * with an exception (AttributeError for a slot never set). */
static PyObject *g_attr(PyObject *g, int i) {
    Py_ssize_t off = fp.g_offset[i];
    PyObject *v = off > 0 ? *(PyObject **)((char *)g + off) : NULL;
    return v != NULL ? Py_NewRef(v) : PyObject_GetAttr(g, *g_names[i]);
}

/* Whether g's attribute i is want: 1, 0, -1 with an exception. */
static int g_is(PyObject *g, int i, PyObject *want) {
    PyObject *v = g_attr(g, i);
    if (v == NULL)
        return -1;
    Py_DECREF(v);
    return v == want;
}

static PyObject *set_fastpath(PyObject *m, PyObject *args) {
    PyObject *o[9];
    unsigned long long buffer_min, small;
    if (!PyArg_ParseTuple(args, "OOOOOOO!O!KOK:set_fastpath", &o[0], &o[1], &o[2], &o[3], &o[4],
                          &o[5], &PyDict_Type, &o[6], &PyDict_Type, &o[7], &buffer_min, &o[8],
                          &small))
        return NULL;
    if (profiler_enabled == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "set_fastpath() before set_observers()");
        return NULL;
    }
    Py_ssize_t offsets[G_SLOTS];
    for (int i = 0; i < G_SLOTS; i++)
        if ((offsets[i] = PyType_Check(o[1]) ? slot_offset(o[1], i) : 0) < 0)
            return NULL;
    memcpy(fp.g_offset, offsets, sizeof offsets);
    PyObject **slots[9] = {&fp.world, &fp.pg_type, &fp.tensor_type, &fp.has_torch_function,
                           &fp.coalescing, &fp.sum, &fp.sums, &fp.rows, &fp.work_type};
    for (int i = 0; i < 9; i++)
        Py_XSETREF(*slots[i], Py_NewRef(o[i]));
    fp.buffer_min = buffer_min;
    fp.small = small;
    Py_RETURN_NONE;
}

/* The first checks of every fast path here: nothing observes this thread's
 * calls, and the group a call names (world._default_pg for None), left in
 * *g as a new reference, is of the backend's class and gathers no batch.
 * 1, 0 (a check failed), or -1 with an exception. */
static int served(PyObject *group, PyObject **g) {
    *g = NULL;
    if (fp.world == NULL || profiler_enabled() || dispatch_stack_len() != 0)
        return 0;
    *g = group == Py_None ? PyObject_GetAttr(fp.world, s_default_pg) : Py_NewRef(group);
    if (*g == NULL)
        return -1;
    if ((PyObject *)Py_TYPE(*g) != fp.pg_type)
        return 0;
    return g_is(*g, G_BATCH, Py_None);
}

/* Whether t is a plain contiguous CPU tensor that no torch-function mode
 * sees: 1, 0, or -1 with an exception. */
static int plain_tensor(PyObject *t) {
    if ((PyObject *)Py_TYPE(t) != fp.tensor_type)
        return 0;
    int r = attr_is(t, s_is_cpu, Py_True);
    if (r == 1)
        r = read_is(t, s_is_contiguous, 1, Py_True);
    if (r != 1)
        return r;
    PyObject *ts = PyTuple_Pack(1, t);
    PyObject *v = ts != NULL ? PyObject_CallOneArg(fp.has_torch_function, ts) : NULL;
    Py_XDECREF(ts);
    if (v == NULL)
        return -1;
    r = v == Py_False;
    Py_DECREF(v);
    return r;
}

/* g's shared-memory group and its collectives' lane, left in *shm and
 * *lane as new references, where a call can go: for a blocking one
 * (!async) nothing may be queued there (Python's way drains the lane
 * first), an async one goes behind what is.  1, 0 (no shm, no Lane, or
 * calls queued), or -1 with an exception. */
static int shm_lane(PyObject *g, int async, PyObject **shm, PyObject **lane) {
    *lane = NULL;
    if ((*shm = g_attr(g, G_SHM)) == NULL)
        return -1;
    if (*shm == Py_None)
        return 0;
    if ((*lane = PyObject_GetAttr(*shm, s_collectives)) == NULL)
        return -1;
    Py_ssize_t queued = mpc_py_lane_queued(*lane); /* -1: not a Lane, Python's way */
    return async ? queued >= 0 : queued == 0;
}

/* What a fast path returns for its checks' verdict ok (1, 0, -1) and the
 * call's result res (used when ok is 1: the core's None, or an async
 * call's Work): res, False, or NULL. */
static PyObject *verdict(int ok, PyObject *res) {
    if (ok == 0)
        return Py_NewRef(Py_False);
    return ok < 0 ? NULL : res;
}

/* A tuple of the n ints v: new, or NULL with an exception. */
static PyObject *ints(int n, const uint64_t *v) {
    PyObject *tup = PyTuple_New(n);
    for (int i = 0; tup != NULL && i < n; i++) {
        PyObject *x = PyLong_FromUnsignedLongLong(v[i]);
        if (x == NULL)
            Py_CLEAR(tup);
        else
            PyTuple_SET_ITEM(tup, i, x);
    }
    return tup;
}

/* Queues core.<name>(*args, timeout) on lane as the Python path does
 * (NOTE [ Small collectives in C ]): the lane's thread or the caller's
 * wait makes it.  Returns its Work (result [t], keeping t, small when
 * nbytes <= fp.small), or NULL with an exception.  Takes args' reference
 * (NULL: making it failed). */
static PyObject *post_core(PyObject *lane, PyObject *core, PyObject *name, PyObject *args,
                           PyObject *t, uint64_t nbytes) {
    PyObject *fn = PyObject_GetAttr(core, name), *result = NULL, *work = NULL;
    if (fn != NULL && args != NULL && (result = PyList_New(1)) != NULL) {
        PyList_SET_ITEM(result, 0, Py_NewRef(t));
        work = mpc_py_lane_post(lane, fp.work_type, result, fn, args, t, nbytes <= fp.small);
    }
    Py_XDECREF(fn);
    Py_XDECREF(args);
    Py_XDECREF(result);
    return work;
}

#define NARGS(name, n, sig)                                                                \
    if (nargs != (n)) {                                                                    \
        PyErr_SetString(PyExc_TypeError, name "(" sig ") takes " #n " arguments");         \
        return NULL;                                                                       \
    }

static PyObject *barrier_now(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("barrier_now", 1, "group")
    PyObject *g, *shm = NULL, *lane = NULL, *core = NULL, *timeout = NULL, *res = NULL;
    int ok = served(args[0], &g);
    if (ok == 1)
        ok = g_is(g, G_GLOO, Py_None);
    if (ok == 1)
        ok = shm_lane(g, 0, &shm, &lane);
    if (ok == 1 && ((core = PyObject_GetAttr(shm, s_core)) == NULL ||
                    (timeout = g_attr(g, G_TIMEOUT_S)) == NULL))
        ok = -1;
    if (ok == 1)
        res = mpc_py_group_barrier(core, timeout);
    Py_XDECREF(g);
    Py_XDECREF(shm);
    Py_XDECREF(lane);
    Py_XDECREF(core);
    Py_XDECREF(timeout);
    return verdict(ok, res);
}

/* The core's codes (dtype, op) for t's dtype reduced with op, as the Python
 * path finds them: from fp.sums for SUM, else from fp.rows by op.value.
 * 1 with *dtype and *rop set, 0 (not a RedOpType, or no codes), -1. */
static int codes_of(PyObject *t, PyObject *op, int *dtype, int *rop) {
    if (op != fp.sum && Py_TYPE(op) != Py_TYPE(fp.sum))
        return 0;
    PyObject *dt = PyObject_GetAttr(t, s_dtype);
    if (dt == NULL)
        return -1;
    PyObject *codes = NULL; /* a new reference, or None */
    PyObject *row = PyDict_GetItemWithError(op == fp.sum ? fp.sums : fp.rows, dt);
    Py_DECREF(dt);
    if (row == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (op == fp.sum) {
        codes = Py_NewRef(row);
    } else {
        PyObject *value = PyObject_GetAttr(op, s_value);
        codes = value != NULL ? PyObject_GetItem(row, value) : NULL;
        Py_XDECREF(value);
        if (codes == NULL)
            return -1;
    }
    int r = codes != Py_None;
    if (r && (!PyTuple_Check(codes) || PyTuple_GET_SIZE(codes) != 2)) {
        PyErr_SetString(PyExc_TypeError, "the core's codes must be a pair of ints");
        r = -1;
    } else if (r) {
        *dtype = (int)PyLong_AsLong(PyTuple_GET_ITEM(codes, 0));
        *rop = (int)PyLong_AsLong(PyTuple_GET_ITEM(codes, 1));
        r = PyErr_Occurred() ? -1 : 1;
    }
    Py_DECREF(codes);
    return r;
}

static PyObject *all_reduce_now(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("all_reduce_now", 4, "tensor, op, group, async_op")
    PyObject *t = args[0], *op = args[1];
    PyObject *g, *shm = NULL, *lane = NULL, *core = NULL, *timeout = NULL, *res = NULL;
    int dtype = 0, rop = 0, async = PyObject_IsTrue(args[3]);
    uint64_t n = 0, addr = 0;
    if (async < 0)
        return NULL;
    int ok = served(args[2], &g);
    if (ok == 1 && fp.coalescing != Py_None) { /* inside a coalescing manager: Python's way */
        int in = PySequence_Contains(fp.coalescing, g);
        ok = in < 0 ? -1 : !in;
    }
    if (ok == 1)
        ok = plain_tensor(t);
    if (ok == 1)
        ok = codes_of(t, op, &dtype, &rop);
    if (ok == 1)
        ok = shm_lane(g, async, &shm, &lane);
    uint64_t nbytes = 0;
    if (ok == 1 && (ok = u64_of(t, s_numel, &n)) == 1 &&
        (nbytes = n * mpc_coll_dtype_size(dtype)) >= fp.buffer_min)
        ok = 0; /* it may move into a group buffer: Python's way */
    if (ok == 1 && ((core = PyObject_GetAttr(shm, s_core)) == NULL ||
                    (!async && (timeout = PyObject_GetAttr(shm, s_timeout)) == NULL)))
        ok = -1;
    if (ok == 1)
        ok = u64_of(t, s_data_ptr, &addr);
    if (ok == 1 && async)
        ok = (res = post_core(lane, core, s_all_reduce,
                              ints(4, (uint64_t[]){addr, n, (uint64_t)dtype, (uint64_t)rop}),
                              t, nbytes)) != NULL ? 1 : -1;
    else if (ok == 1)
        res = mpc_py_group_all_reduce(core, addr, n, dtype, rop, NULL, timeout);
    Py_XDECREF(g);
    Py_XDECREF(shm);
    Py_XDECREF(lane);
    Py_XDECREF(core);
    Py_XDECREF(timeout);
    return verdict(ok, res);
}

static PyObject *broadcast_now(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("broadcast_now", 4, "tensor, src, group, async_op")
    PyObject *t = args[0], *src = args[1];
    PyObject *g, *ranks = NULL, *shm = NULL, *lane = NULL, *core = NULL, *timeout = NULL,
                 *res = NULL;
    long root = -1;
    uint64_t nbytes = 0, addr = 0;
    int async = PyObject_IsTrue(args[3]);
    if (async < 0)
        return NULL;
    int ok = served(args[2], &g);
    if (ok == 1)
        ok = plain_tensor(t);
    if (ok == 1 && (ranks = g_attr(g, G_GROUP_RANKS)) == NULL)
        ok = -1;
    if (ok == 1) { /* group_ranks.get(src): the source's rank in the group */
        PyObject *r = PyDict_Check(ranks) ? PyDict_GetItemWithError(ranks, src) : NULL;
        ok = r != NULL ? 1 : PyErr_Occurred() ? -1 : 0;
        if (ok == 1 && (root = PyLong_AsLong(r)) == -1 && PyErr_Occurred())
            ok = -1;
    }
    if (ok == 1)
        ok = shm_lane(g, async, &shm, &lane);
    if (ok == 1 && ((core = PyObject_GetAttr(shm, s_core)) == NULL ||
                    (!async && (timeout = PyObject_GetAttr(shm, s_timeout)) == NULL)))
        ok = -1;
    if (ok == 1) {
        PyObject *nb = PyObject_GetAttr(t, s_nbytes);
        ok = nb != NULL ? u64_of(nb, NULL, &nbytes) : -1;
        Py_XDECREF(nb);
    }
    if (ok == 1)
        ok = u64_of(t, s_data_ptr, &addr);
    if (ok == 1 && async)
        ok = (res = post_core(lane, core, s_broadcast,
                              ints(3, (uint64_t[]){addr, nbytes, (uint64_t)root}),
                              t, nbytes)) != NULL ? 1 : -1;
    else if (ok == 1)
        res = mpc_py_group_broadcast(core, addr, nbytes, (int)root, timeout);
    Py_XDECREF(g);
    Py_XDECREF(ranks);
    Py_XDECREF(shm);
    Py_XDECREF(lane);
    Py_XDECREF(core);
    Py_XDECREF(timeout);
    return verdict(ok, res);
}

PyMethodDef mpc_py_fastpath_methods[] = {
    {"set_observers", set_observers, METH_VARARGS,
     "set_observers(profiler_enabled, dispatch_stack_len): the addresses of torch's C++ "
     "functions that observed() calls (NOTE [ Observers asked in C ])."},
    {"observed", observed, METH_NOARGS,
     "observed() -> bool: torch's profiler is on, or a dispatch mode is set, on this thread."},
    {"set_fastpath", set_fastpath, METH_VARARGS,
     "set_fastpath(world, pg_type, tensor_type, has_torch_function, coalescing, sum, sums, "
     "rows, buffer_min, work_type, small): what the fast paths below compare with and make "
     "(NOTE [ Small collectives in C ])."},
    {"barrier_now", (PyCFunction)(void (*)(void))barrier_now, METH_FASTCALL,
     "barrier_now(group) -> None or False: dist.barrier's fast path made here (None, as "
     "dist.barrier returns), or False having done nothing (NOTE [ dist.barrier in C ])."},
    {"all_reduce_now", (PyCFunction)(void (*)(void))all_reduce_now, METH_FASTCALL,
     "all_reduce_now(tensor, op, group, async_op) -> None, a Work or False: dist.all_reduce's "
     "fast path made here (what it returns), or False having done nothing (NOTE [ Small "
     "collectives in C ])."},
    {"broadcast_now", (PyCFunction)(void (*)(void))broadcast_now, METH_FASTCALL,
     "broadcast_now(tensor, src, group, async_op) -> None, a Work or False: dist.broadcast's "
     "fast path made here (what it returns), or False having done nothing (NOTE [ Small "
     "collectives in C ])."},
    {NULL, NULL, 0, NULL},
};

int mpc_py_fastpath_exec(PyObject *m, mpc_state *st) {
    (void)m;
    (void)st;
    static const mpc_py_name names[] = {
        {&s_default_pg, "_default_pg"}, {&s_batch, "batch"}, {&s_gloo, "gloo"},
        {&s_shm, "shm"}, {&s_collectives, "collectives"}, {&s_core, "core"},
        {&s_timeout_s, "timeout_s"}, {&s_timeout, "timeout"}, {&s_is_cpu, "is_cpu"},
        {&s_is_contiguous, "is_contiguous"}, {&s_dtype, "dtype"}, {&s_numel, "numel"},
        {&s_nbytes, "nbytes"}, {&s_data_ptr, "data_ptr"}, {&s_value, "value"},
        {&s_group_ranks, "group_ranks"}, {&s_all_reduce, "all_reduce"},
        {&s_broadcast, "broadcast"},
    };
    return mpc_py_intern(names, sizeof names / sizeof names[0]);
}
