/* py_lane.c: the state of a group's lane (mpcore.dist._dist._Lane, a Python
 * subclass of Lane), the lane's two calls on an asynchronous collective's
 * path, post and wait_for (NOTE [ A lane's hot path in C ] in _dist.py),
 * and the lane's lock, LaneLock (NOTE [ The lane's lock in C ]).  The rest
 * of the lane is Python, under the same lock: every change of the state
 * here is made holding the lane's lock, as the Python methods do. */
#include "py_mpcore.h"

#include <limits.h>
#include <stddef.h>

#include <structmember.h>

/* NOTE [ The lane's lock in C ]
 * post and wait_for take the lane's lock three times a call (NOTE [ A
 * call's end ]).  A threading.RLock is taken through its Python methods:
 * acquire parses its arguments from a tuple, and a pair of acquire and
 * release cost about 0.09 us over two empty calls, where taking a free
 * lock is a few nanoseconds.  So the lane's lock is a LaneLock: a
 * reentrant lock as threading.RLock is (an owner, a count and a lock of
 * the interpreter's, PyThread_type_lock), with the methods that `with`
 * and threading.Condition use (acquire, release, __enter__, __exit__,
 * _is_owned, _release_save, _acquire_restore), which post and wait_for
 * take and release by C calls.  A blocked acquire waits as CPython's
 * locks wait: without the GIL, running signal handlers when interrupted
 * and raising what they raise, its timeout kept across them.  For the
 * same reason the lane's queue is a list, which they append to and take
 * the head of by the list's C calls (a deque has none; the queue is a
 * few calls long).  Measured, one process, the lanes before (RLock,
 * deque) and after alternated run by run, best of 9 runs: post and
 * wait_for of a call that does nothing (20,000 a run), 0.99 us before and
 * 0.84 after on quiet cores, 1.66 to 2.51 and 1.28 to 1.79 on loaded ones;
 * dist.*(async_op=True).wait() over the blocking call, one rank, 4 KB
 * (10,000 a run, two runs): all_reduce +1.36 and +1.39 us before, +1.12
 * and +1.18 after; barrier +1.13 and +2.27, +0.94 and +1.99; broadcast
 * +1.60 and +1.30, +1.39 and +1.11. */
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner; /* the holder's thread ident, when count > 0 */
    unsigned long count; /* the holder's acquisitions; 0: free */
} LaneLockObject;

static PyTypeObject *lock_type; /* LaneLock, for post and wait_for's check */

/* Takes l for this thread, waiting up to timeout_us (-1: for ever; 0: not
 * at all) without the GIL.  Returns 1 when taken, 0 when the time ran
 * out, -1 with an exception set (a signal's handler raised, or the count
 * would overflow). */
static int lock_take(LaneLockObject *l, int64_t timeout_us) {
    unsigned long me = PyThread_get_thread_ident();
    if (l->count > 0 && l->owner == me) {
        if (l->count == ULONG_MAX) {
            PyErr_SetString(PyExc_OverflowError, "LaneLock taken too many times");
            return -1;
        }
        l->count++;
        return 1;
    }
    PyLockStatus r = PyThread_acquire_lock_timed(l->lock, 0, 0);
    if (r != PY_LOCK_ACQUIRED && timeout_us != 0) {
        int64_t end = timeout_us > 0 ? mpc_now_ns() + timeout_us * 1000 : -1;
        for (;;) {
            int64_t left = end < 0 ? -1 : (end - mpc_now_ns()) / 1000;
            if (end >= 0 && left <= 0) {
                r = PyThread_acquire_lock_timed(l->lock, 0, 0);
                break;
            }
            Py_BEGIN_ALLOW_THREADS
            r = PyThread_acquire_lock_timed(l->lock, left, 1);
            Py_END_ALLOW_THREADS
            if (r != PY_LOCK_INTR)
                break;
            if (Py_MakePendingCalls() < 0)
                return -1;
        }
    }
    if (r != PY_LOCK_ACQUIRED)
        return 0;
    l->owner = me;
    l->count = 1;
    return 1;
}

/* Releases one acquisition of l by this thread.  Returns 0, or -1 with
 * RuntimeError when this thread does not hold it. */
static int lock_give(LaneLockObject *l) {
    if (l->count == 0 || l->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return -1;
    }
    if (--l->count == 0) {
        l->owner = 0;
        PyThread_release_lock(l->lock);
    }
    return 0;
}

static PyObject *lock_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) != 0 || (kw != NULL && PyDict_GET_SIZE(kw) != 0)) {
        PyErr_SetString(PyExc_TypeError, "LaneLock() takes no arguments");
        return NULL;
    }
    LaneLockObject *l = (LaneLockObject *)type->tp_alloc(type, 0);
    if (l == NULL)
        return NULL;
    if ((l->lock = PyThread_allocate_lock()) == NULL) {
        Py_DECREF(l);
        PyErr_SetString(PyExc_MemoryError, "cannot allocate a lock");
        return NULL;
    }
    return (PyObject *)l;
}

static void lock_dealloc(LaneLockObject *l) {
    PyTypeObject *tp = Py_TYPE(l);
    if (l->lock != NULL) {
        if (l->count > 0)
            PyThread_release_lock(l->lock);
        PyThread_free_lock(l->lock);
    }
    tp->tp_free((PyObject *)l);
    Py_DECREF(tp);
}

/* LaneLock.acquire(blocking=True, timeout=-1), as RLock's: True once
 * taken, False when not (blocking false, or the timeout passed). */
static PyObject *lock_acquire(LaneLockObject *l, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    static const char *const names[] = {"blocking", "timeout", NULL};
    mpc_py_argv av;
    if (mpc_py_args(&av, "acquire", names, 0, args, nargs, kwnames) < 0)
        return NULL;
    PyObject *const *a = av.a;
    int blocking = a[0] == NULL ? 1 : PyObject_IsTrue(a[0]);
    if (blocking < 0)
        return NULL;
    double t = a[1] == NULL ? -1 : PyFloat_AsDouble(a[1]);
    if (t == -1 && PyErr_Occurred())
        return NULL;
    if (!blocking && t != -1) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (t < 0 && t != -1) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    if (t * 1e6 >= (double)PY_TIMEOUT_MAX) { /* as CPython's locks refuse it */
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return NULL;
    }
    int64_t us = !blocking ? 0 : t < 0 ? -1 : (int64_t)(t * 1e6 + 0.999);
    int r = lock_take(l, us);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *lock_release(LaneLockObject *l, PyObject *unused) {
    if (lock_give(l) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *lock_exit(LaneLockObject *l, PyObject *const *args, Py_ssize_t nargs) {
    return lock_release(l, NULL);
}

static PyObject *lock_is_owned(LaneLockObject *l, PyObject *unused) {
    return PyBool_FromLong(l->count > 0 && l->owner == PyThread_get_thread_ident());
}

/* threading.Condition.wait's: releases every acquisition of this thread;
 * returns (count, owner) for _acquire_restore. */
static PyObject *lock_release_save(LaneLockObject *l, PyObject *unused) {
    if (l->count == 0 || l->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    PyObject *state = Py_BuildValue("(kk)", l->count, l->owner);
    if (state == NULL)
        return NULL;
    l->count = 0;
    l->owner = 0;
    PyThread_release_lock(l->lock);
    return state;
}

static PyObject *lock_acquire_restore(LaneLockObject *l, PyObject *state) {
    unsigned long count, owner;
    if (!PyArg_ParseTuple(state, "kk:_acquire_restore", &count, &owner))
        return NULL;
    int r = lock_take(l, -1);
    if (r < 0)
        return NULL;
    l->count = count;
    l->owner = owner;
    Py_RETURN_NONE;
}

static PyObject *lock_repr(LaneLockObject *l) {
    return PyUnicode_FromFormat("<mpcore._core.LaneLock %s owner=%lu count=%lu>",
                                l->count ? "locked" : "unlocked", l->count ? l->owner : 0UL,
                                l->count);
}

static PyMethodDef lock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))lock_acquire, METH_FASTCALL | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> True once taken (reentrant), as RLock's"},
    {"__enter__", (PyCFunction)(void (*)(void))lock_acquire, METH_FASTCALL | METH_KEYWORDS,
     NULL},
    {"release", (PyCFunction)lock_release, METH_NOARGS, "release(): one acquisition"},
    {"__exit__", (PyCFunction)(void (*)(void))lock_exit, METH_FASTCALL, NULL},
    {"_is_owned", (PyCFunction)lock_is_owned, METH_NOARGS, NULL},
    {"_release_save", (PyCFunction)lock_release_save, METH_NOARGS, NULL},
    {"_acquire_restore", (PyCFunction)lock_acquire_restore, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot lock_slots[] = {
    {Py_tp_doc, "A reentrant lock, as threading.RLock, that the lane takes from C "
                "(NOTE [ The lane's lock in C ] in py_lane.c)."},
    {Py_tp_new, lock_new},
    {Py_tp_dealloc, lock_dealloc},
    {Py_tp_methods, lock_methods},
    {Py_tp_repr, lock_repr},
    {0, NULL},
};

static PyType_Spec lock_spec = {
    .name = "mpcore._core.LaneLock",
    .basicsize = sizeof(LaneLockObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = lock_slots,
};

/* the lane's methods that post and wait_for call (NOTE [ The lane's methods bound once ]) */
enum { B_ACQUIRE, B_RELEASE, B_NOTIFY, B_NOTIFY_ALL, B_WAIT, B_APPEND, B_POPLEFT, B_COUNT };

typedef struct {
    PyObject_HEAD
    PyObject *name;
    PyObject *timeout;
    PyObject *queue;  /* a list of (work, fn, args, keep) (None as an item: stop) */
    PyObject *lock;   /* a LaneLock (or another lock with threading.RLock's methods) */
    PyObject *cond;   /* threading.Condition(lock) */
    PyObject *thread;
    PyObject *ident;  /* the thread's ident, or None */
    PyObject *spare;  /* NOTE [ A Work used again ] */
    Py_ssize_t queued;
    Py_ssize_t waiting;
    Py_ssize_t small_puts;
    char running;
    char polling;
    /* NOTE [ The lane's methods bound once ] */
    PyObject *bound[B_COUNT];
    PyObject *bound_of[B_COUNT]; /* the object each was bound to: borrowed, kept alive by it */
} LaneObject;

/* NOTE [ The lane's methods bound once ]
 * post and wait_for call the lane's lock, condition and deque nine times
 * a call; looking each method up by name (the type's lookup, a bound
 * method made and dropped) cost more than a third of those calls.  So each
 * is bound once, on first use, and bound again only if the lane's
 * attribute now holds another object.  Measured on one rank, builds
 * alternated (best of 5 runs of 20,000): post and wait_for of a call that
 * does nothing, 0.92 to 0.99 us before, 0.82 to 0.84 after; in
 * fastpath_calls.py's async - dist the gain is inside the run-to-run
 * spread (+1.2 to +1.7 us either way, at load 5).  The lock and the
 * queue are since taken by C calls (NOTE [ The lane's lock in C ]); the
 * bound methods serve the condition, and a lock or queue of another type. */

/* A Work's own attributes (Work.__init__ in _dist.py): one with more was
 * given some by a program and is not given again. */
#define WORK_FIELDS 5
#define STACK_ARGS 16

static PyObject *s_acquire, *s_release, *s_append, *s_popleft, *s_notify, *s_notify_all,
    *s_wait, *s_done, *s_exc, *s_future, *s_tensors, *s_lane, *s_reusable, *s_events,
    *s_settle, *s_drain, *s_start, *s_end_events;

static int lane_traverse(LaneObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->name);
    Py_VISIT(self->timeout);
    Py_VISIT(self->queue);
    Py_VISIT(self->lock);
    Py_VISIT(self->cond);
    Py_VISIT(self->thread);
    Py_VISIT(self->ident);
    Py_VISIT(self->spare);
    for (int i = 0; i < B_COUNT; i++)
        Py_VISIT(self->bound[i]);
    return 0;
}

static int lane_clear(LaneObject *self) {
    Py_CLEAR(self->name);
    Py_CLEAR(self->timeout);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->lock);
    Py_CLEAR(self->cond);
    Py_CLEAR(self->thread);
    Py_CLEAR(self->ident);
    Py_CLEAR(self->spare);
    for (int i = 0; i < B_COUNT; i++) {
        Py_CLEAR(self->bound[i]);
        self->bound_of[i] = NULL;
    }
    return 0;
}

static void lane_dealloc(LaneObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    lane_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Calls obj.name() and drops the result.  Returns 0, or -1 with an
 * exception set. */
static int call0(PyObject *obj, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The lane's method `which` (B_*), bound to its lock, condition or queue
 * as they are now: a new reference, or NULL with an exception set. */
static PyObject *lane_method(LaneObject *self, int which) {
    static PyObject **const names[B_COUNT] = {&s_acquire, &s_release, &s_notify, &s_notify_all,
                                        &s_wait, &s_append, &s_popleft};
    PyObject *obj = which <= B_RELEASE ? self->lock : which <= B_WAIT ? self->cond : self->queue;
    if (obj == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the lane is not set up");
        return NULL;
    }
    if (self->bound[which] == NULL || self->bound_of[which] != obj) {
        PyObject *m = PyObject_GetAttr(obj, *names[which]);
        if (m == NULL)
            return NULL;
        Py_XSETREF(self->bound[which], m);
        self->bound_of[which] = obj;
    }
    return Py_NewRef(self->bound[which]);
}

/* Calls the lane's method `which` with arg (none when NULL).  Returns its
 * result (a new reference), or NULL with an exception set. */
static PyObject *lane_call(LaneObject *self, int which, PyObject *arg) {
    PyObject *m = lane_method(self, which);
    if (m == NULL)
        return NULL;
    PyObject *r = arg == NULL ? PyObject_CallNoArgs(m) : PyObject_CallOneArg(m, arg);
    Py_DECREF(m);
    return r;
}

/* lane_call dropping the result: 0, or -1 with an exception set.  The
 * lane's lock taken or released by C calls when it is a LaneLock (NOTE
 * [ The lane's lock in C ]). */
static int lane_call0(LaneObject *self, int which) {
    if ((which == B_ACQUIRE || which == B_RELEASE) && self->lock != NULL &&
        Py_IS_TYPE(self->lock, lock_type))
        return which == B_ACQUIRE ? (lock_take((LaneLockObject *)self->lock, -1) < 0 ? -1 : 0)
                                  : lock_give((LaneLockObject *)self->lock);
    PyObject *r = lane_call(self, which, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Releases the lane's lock keeping the exception that is set, if any.
 * Returns -1 (for the caller's error path). */
static int unlock_keeping_error(LaneObject *self) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (lane_call0(self, B_RELEASE) < 0)
        PyErr_Clear();
    PyErr_Restore(t, v, tb);
    return -1;
}

/* Whether this thread is the lane's own.  Never fails. */
static int lane_here(LaneObject *self) {
    if (self->ident == NULL || !PyLong_Check(self->ident))
        return 0;
    unsigned long id = PyLong_AsUnsignedLong(self->ident);
    if (id == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return id == PyThread_get_thread_ident();
}

/* work._done as 1 or 0, or -1 with an exception set. */
static int work_done(PyObject *work) {
    PyObject *d = PyObject_GetAttr(work, s_done);
    if (d == NULL)
        return -1;
    int r = PyObject_IsTrue(d);
    Py_DECREF(d);
    return r;
}

/* Whether the spare Work may be given again: the lane holds the only
 * reference, no weak reference sees it, it has only its own attributes
 * and its call is done (NOTE [ A Work used again ]).  Returns 1 or 0, or
 * -1 with an exception set. */
static int spare_free(PyObject *work) {
    if (Py_REFCNT(work) != 1)
        return 0;
    PyTypeObject *tp = Py_TYPE(work);
    if (tp->tp_weaklistoffset <= 0)
        return 0; /* a layout not known here: never given again */
    if (*(PyObject **)((char *)work + tp->tp_weaklistoffset) != NULL)
        return 0;
    PyObject *d = PyObject_GenericGetDict(work, NULL);
    if (d == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t n = PyDict_GET_SIZE(d);
    Py_DECREF(d);
    if (n != WORK_FIELDS)
        return 0;
    return work_done(work);
}

/* Lane.post(work_type, result, fn, args, keep, small): queues fn(*args,
 * timeout) with its Work, the spare when spare_free says so, else a new
 * work_type(result) (kept as the spare when its `reusable` is true).
 * Returns the Work, or NULL with an exception set (nothing queued, unless
 * the lane's drain, run on its own thread, raised). */
static PyObject *lane_post(LaneObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "post() takes work_type, result, fn, args, keep and small");
        return NULL;
    }
    PyObject *result = args[1];
    int small = PyObject_IsTrue(args[5]);
    if (small < 0)
        return NULL;
    PyObject *work = self->spare;
    int free = work != NULL && work != Py_None ? spare_free(work) : 0;
    if (free < 0)
        return NULL;
    if (free) {
        Py_INCREF(work);
        if (PyObject_SetAttr(work, s_tensors, result) < 0 ||
            PyObject_SetAttr(work, s_done, Py_False) < 0 ||
            PyObject_SetAttr(work, s_exc, Py_None) < 0 ||
            PyObject_SetAttr(work, s_future, Py_None) < 0)
            goto err_work;
    } else {
        work = PyObject_CallOneArg(args[0], result);
        if (work == NULL)
            return NULL;
        if (PyObject_SetAttr(work, s_lane, (PyObject *)self) < 0)
            goto err_work;
        PyObject *re = PyObject_GetAttr(work, s_reusable);
        int r = re == NULL ? -1 : PyObject_IsTrue(re);
        Py_XDECREF(re);
        if (r < 0)
            goto err_work;
        if (r) {
            PyObject *old = self->spare;
            Py_INCREF(work);
            self->spare = work;
            Py_XDECREF(old);
        }
    }
    PyObject *item = PyTuple_Pack(4, work, args[2], args[3], args[4]);
    if (item == NULL)
        goto err_work;
    if (lane_call0(self, B_ACQUIRE) < 0)
        goto err_item;
    if ((self->thread == NULL || self->thread == Py_None) && call0((PyObject *)self, s_start) < 0)
        goto err_locked;
    PyObject *r;
    if (self->queue != NULL && PyList_CheckExact(self->queue)) {
        if (PyList_Append(self->queue, item) < 0)
            goto err_locked;
    } else {
        if ((r = lane_call(self, B_APPEND, item)) == NULL)
            goto err_locked;
        Py_DECREF(r);
    }
    self->queued++;
    if (small)
        self->small_puts++;
    int here = lane_here(self);
    if (!(here || (small && self->polling)) && lane_call0(self, B_NOTIFY) < 0)
        goto err_locked_queued;
    Py_DECREF(item);
    if (lane_call0(self, B_RELEASE) < 0)
        goto err_work;
    /* a callback on the lane's thread (NOTE [ Callbacks that call again ]) */
    if (here && (r = PyObject_CallMethodOneArg((PyObject *)self, s_drain, work)) == NULL)
        goto err_work;
    if (here)
        Py_DECREF(r);
    return work;
err_locked_queued:
err_locked:
    unlock_keeping_error(self);
err_item:
    Py_DECREF(item);
err_work:
    Py_DECREF(work);
    return NULL;
}

/* Takes the exception that is set, normalized, its traceback on it.
 * Returns it (a new reference; NULL only when none was set). */
static PyObject *take_error(void) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb != NULL && v != NULL)
        PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
}

/* Calls fn(*args, timeout).  Returns its result, or NULL with the
 * exception it raised taken into *exc (a new reference). */
static PyObject *run_call(PyObject *fn, PyObject *fargs, PyObject *timeout, PyObject **exc) {
    PyObject *r;
    if (PyTuple_Check(fargs) && PyTuple_GET_SIZE(fargs) < STACK_ARGS) {
        PyObject *stack[STACK_ARGS];
        Py_ssize_t n = PyTuple_GET_SIZE(fargs);
        for (Py_ssize_t i = 0; i < n; i++)
            stack[i] = PyTuple_GET_ITEM(fargs, i);
        stack[n] = timeout;
        r = PyObject_Vectorcall(fn, stack, (size_t)n + 1, NULL);
    } else {
        PyObject *t = PySequence_Tuple(fargs);
        PyObject *all = NULL;
        if (t != NULL) {
            PyObject *last = PyTuple_Pack(1, timeout);
            if (last != NULL)
                all = PySequence_Concat(t, last);
            Py_XDECREF(last);
            Py_DECREF(t);
        }
        r = all == NULL ? NULL : PyObject_Call(fn, all, NULL);
        Py_XDECREF(all);
    }
    if (r == NULL)
        *exc = take_error();
    return r;
}

/* Lane.wait_for(work): until `work`, a call of this lane, is done, running
 * it on this thread when it is next and nobody runs it (NOTE [ A waiter
 * runs its own call ]); on the lane's own thread, drain(work).  Returns
 * None (the call's own error is the Work's, raised by Work.wait), or NULL
 * with an exception set when waiting failed (a signal's handler raised). */
static PyObject *lane_wait_for(LaneObject *self, PyObject *work) {
    if (lane_here(self)) /* NOTE [ Callbacks that call again ] */
        return PyObject_CallMethodOneArg((PyObject *)self, s_drain, work);
    if (lane_call0(self, B_ACQUIRE) < 0)
        return NULL;
    PyObject *item = NULL;
    for (;;) {
        int d = work_done(work);
        if (d < 0)
            return unlock_keeping_error(self), NULL;
        if (d) {
            if (lane_call0(self, B_RELEASE) < 0)
                return NULL;
            Py_RETURN_NONE;
        }
        if (!self->running && self->queue != NULL && self->queue != Py_None) {
            Py_ssize_t n = PyObject_Size(self->queue);
            if (n < 0)
                return unlock_keeping_error(self), NULL;
            if (n > 0) {
                PyObject *head = PySequence_GetItem(self->queue, 0);
                if (head == NULL)
                    return unlock_keeping_error(self), NULL;
                int next = PyTuple_Check(head) && PyTuple_GET_SIZE(head) == 4 &&
                           PyTuple_GET_ITEM(head, 0) == work;
                Py_DECREF(head);
                if (next)
                    break;
            }
        }
        self->waiting++;
        PyObject *r = lane_call(self, B_WAIT, NULL);
        self->waiting--;
        if (r == NULL)
            return unlock_keeping_error(self), NULL;
        Py_DECREF(r);
    }
    self->running = 1;
    if (PyList_CheckExact(self->queue)) { /* the head, checked above */
        item = Py_NewRef(PyList_GET_ITEM(self->queue, 0));
        if (PyList_SetSlice(self->queue, 0, 1, NULL) < 0)
            Py_CLEAR(item);
    } else {
        item = lane_call(self, B_POPLEFT, NULL);
    }
    if (item == NULL) {
        self->running = 0;
        return unlock_keeping_error(self), NULL;
    }
    if (lane_call0(self, B_RELEASE) < 0) {
        Py_DECREF(item);
        return NULL;
    }
    /* the call, as _Lane._call runs it */
    Py_INCREF(work);
    PyObject *exc = NULL, *fail = NULL;
    PyObject *r = run_call(PyTuple_GET_ITEM(item, 1), PyTuple_GET_ITEM(item, 2), self->timeout,
                           &exc);
    Py_XDECREF(r);
    Py_DECREF(item); /* nothing of a finished call is held until the next one */
    PyObject *events = PyObject_GetAttr(work, s_events);
    if (events == NULL) {
        fail = take_error();
    } else {
        if (events != Py_None) {
            r = PyObject_CallMethodOneArg((PyObject *)self, s_end_events, work);
            if (r == NULL)
                fail = take_error();
            Py_XDECREF(r);
        }
        Py_DECREF(events);
    }
    /* NOTE [ A call's end ]: the lane's bookkeeping never skipped */
    PyObject *fut = NULL;
    int ok = lane_call0(self, B_ACQUIRE) == 0;
    if (ok) {
        ok = PyObject_SetAttr(work, s_exc, exc != NULL ? exc : Py_None) == 0 &&
             PyObject_SetAttr(work, s_done, Py_True) == 0 &&
             (fut = PyObject_GetAttr(work, s_future)) != NULL;
        self->running = 0;
        self->queued--;
        Py_ssize_t n = self->queue != NULL && self->queue != Py_None ? PyObject_Size(self->queue)
                                                                    : 0;
        if (ok && (n > 0 || self->waiting) && lane_call0(self, B_NOTIFY_ALL) < 0)
            ok = 0;
        if (!ok)
            unlock_keeping_error(self);
        else if (lane_call0(self, B_RELEASE) < 0)
            ok = 0;
    }
    Py_XDECREF(exc);
    if (ok && fut != Py_None && /* NOTE [ Callbacks that call again ] */
        (r = PyObject_CallMethodOneArg(work, s_settle, fut)) == NULL)
        ok = 0;
    else if (ok && fut != Py_None)
        Py_DECREF(r);
    Py_XDECREF(fut);
    Py_DECREF(work);
    if (!ok) {
        Py_XDECREF(fail);
        return NULL;
    }
    if (fail != NULL) { /* the profiler's events failed to end: as _call, raised here */
        PyErr_SetObject((PyObject *)Py_TYPE(fail), fail);
        Py_DECREF(fail);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef lane_methods[] = {
    {"post", (PyCFunction)(void (*)(void))lane_post, METH_FASTCALL,
     "post(work_type, result, fn, args, keep, small): queue fn(*args, timeout); its Work"},
    {"wait_for", (PyCFunction)lane_wait_for, METH_O,
     "wait_for(work): until work's call is done, running it here when it is next"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef lane_members[] = {
    {"name", T_OBJECT, offsetof(LaneObject, name), 0, NULL},
    {"timeout", T_OBJECT, offsetof(LaneObject, timeout), 0, NULL},
    {"queue", T_OBJECT, offsetof(LaneObject, queue), 0, NULL},
    {"lock", T_OBJECT, offsetof(LaneObject, lock), 0, NULL},
    {"cond", T_OBJECT, offsetof(LaneObject, cond), 0, NULL},
    {"thread", T_OBJECT, offsetof(LaneObject, thread), 0, NULL},
    {"ident", T_OBJECT, offsetof(LaneObject, ident), 0, NULL},
    {"spare", T_OBJECT, offsetof(LaneObject, spare), 0, NULL},
    {"queued", T_PYSSIZET, offsetof(LaneObject, queued), 0, NULL},
    {"waiting", T_PYSSIZET, offsetof(LaneObject, waiting), 0, NULL},
    {"small_puts", T_PYSSIZET, offsetof(LaneObject, small_puts), 0, NULL},
    {"running", T_BOOL, offsetof(LaneObject, running), 0, NULL},
    {"polling", T_BOOL, offsetof(LaneObject, polling), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot lane_slots[] = {
    {Py_tp_doc, "The state of a group's lane, and its post and wait_for (py_lane.c)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, lane_dealloc},
    {Py_tp_traverse, lane_traverse},
    {Py_tp_clear, lane_clear},
    {Py_tp_methods, lane_methods},
    {Py_tp_members, lane_members},
    {0, NULL},
};

static PyType_Spec lane_spec = {
    .name = "mpcore._core.Lane",
    .basicsize = sizeof(LaneObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = lane_slots,
};

int mpc_py_lane_exec(PyObject *m, mpc_state *st) {
    (void)st;
    struct {
        PyObject **s;
        const char *text;
    } names[] = {
        {&s_acquire, "acquire"}, {&s_release, "release"}, {&s_append, "append"},
        {&s_popleft, "popleft"}, {&s_notify, "notify"}, {&s_notify_all, "notify_all"},
        {&s_wait, "wait"}, {&s_done, "_done"}, {&s_exc, "_exc"}, {&s_future, "_future"},
        {&s_tensors, "_tensors"}, {&s_lane, "lane"}, {&s_reusable, "reusable"},
        {&s_events, "profiler_events"}, {&s_settle, "settle"}, {&s_drain, "drain"},
        {&s_start, "_start"}, {&s_end_events, "_end_events"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].s == NULL && (*names[i].s = PyUnicode_InternFromString(names[i].text)) == NULL)
            return -1;
    }
    PyObject *lock = PyType_FromModuleAndSpec(m, &lock_spec, NULL);
    if (lock == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "LaneLock", lock);
    lock_type = (PyTypeObject *)lock; /* the module holds it */
    Py_DECREF(lock);
    if (r < 0)
        return -1;
    PyObject *type = PyType_FromModuleAndSpec(m, &lane_spec, NULL);
    if (type == NULL)
        return -1;
    r = PyModule_AddObjectRef(m, "Lane", type);
    Py_DECREF(type);
    return r;
}
