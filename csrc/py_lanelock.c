/* py_lanelock.c: LaneLock, the reentrant lock of a group's lane (NOTE
 * [ The lane's lock in C ]), which the lane's post and wait_for (py_lane.c)
 * take and release by C calls, and Python by threading.RLock's methods. */
#include "py_mpcore.h"

#include <limits.h>

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

static PyTypeObject *lock_type; /* LaneLock: mpc_py_lanelock_take and _give check it */

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
                "(NOTE [ The lane's lock in C ] in py_lanelock.c)."},
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

int mpc_py_lanelock_take(PyObject *lock) {
    if (!Py_IS_TYPE(lock, lock_type))
        return 0;
    return lock_take((LaneLockObject *)lock, -1) < 0 ? -1 : 1;
}

int mpc_py_lanelock_give(PyObject *lock) {
    if (!Py_IS_TYPE(lock, lock_type))
        return 0;
    return lock_give((LaneLockObject *)lock) < 0 ? -1 : 1;
}

int mpc_py_lanelock_exec(PyObject *m, mpc_state *st) {
    (void)st;
    PyObject *lock = PyType_FromModuleAndSpec(m, &lock_spec, NULL);
    if (lock == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "LaneLock", lock);
    lock_type = (PyTypeObject *)lock; /* the module holds it */
    Py_DECREF(lock);
    return r;
}
