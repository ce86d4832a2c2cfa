/* py_lane.c: the state of a group's lane (mpcore.dist._dist._Lane, a Python
 * subclass of Lane), the lane's two calls on an asynchronous collective's
 * path, post and wait_for (NOTE [ A lane's hot path in C ] in _dist.py),
 * and the third, its Work's wait (WorkWait, NOTE [ Work.wait in C ]).  The
 * rest of the lane is Python, under the same lock (LaneLock, in
 * py_lanelock.c): every change of the state here is made holding the
 * lane's lock, as the Python methods do. */
#include "py_mpcore.h"

#include <stddef.h>

#include <structmember.h>

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
#define WORK_FIELDS 6
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

/* The dealloc of this file's types, which the GC tracks: untracks self,
 * clears its references with `clear`, frees it and drops its heap type. */
static void gc_dealloc(PyObject *self, inquiry clear) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static void lane_dealloc(LaneObject *self) { gc_dealloc((PyObject *)self, (inquiry)lane_clear); }

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
    if ((which == B_ACQUIRE || which == B_RELEASE) && self->lock != NULL) {
        int r = which == B_ACQUIRE ? mpc_py_lanelock_take(self->lock)
                                   : mpc_py_lanelock_give(self->lock);
        if (r != 0)
            return r < 0 ? -1 : 0;
    }
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

/* NOTE [ A Work's fields in its dict ]
 * post and wait_for read and write a Work's fields (_done, _exc, _future,
 * _tensors, profiler_events) ten times a call.  PyObject_GetAttr and
 * PyObject_SetAttr look each name up along the type's bases first (a
 * Python class over a pybind class and torch's Work) for a descriptor
 * that would take it, then in the instance's dict.  Where the type has no
 * data descriptor of those names, which is what Work.__init__ in _dist.py
 * relies on, the dict is the whole answer, so they read and write it
 * directly.  Whether a type has none is looked up once and kept with the
 * type's version tag, which CPython changes whenever the type or a base
 * changes; any other type, or a Work with no dict, goes by name as
 * before.  Measured on one rank, a call that does nothing posted and
 * waited on (best of 7 runs of 20,000, the builds alternated): 0.70 to
 * 0.74 us by name, 0.59 to 0.61 in the dict. */
static PyTypeObject *plain_type; /* the type found plain, while its tag is plain_tag */
static unsigned int plain_tag;

/* Whether work's fields live in its dict alone (NOTE [ A Work's fields in
 * its dict ]).  Never fails. */
static int fields_plain(PyObject *work) {
    PyTypeObject *tp = Py_TYPE(work);
#ifdef Py_TPFLAGS_VALID_VERSION_TAG
    int tagged = PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG) && tp->tp_version_tag != 0;
#else
    int tagged = tp->tp_version_tag != 0;
#endif
    if (tp == plain_type && tagged && tp->tp_version_tag == plain_tag)
        return 1;
    PyObject *const names[] = {s_done, s_exc, s_future, s_tensors, s_events};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        PyObject *descr = _PyType_Lookup(tp, names[i]);
        if (descr != NULL && Py_TYPE(descr)->tp_descr_set != NULL)
            return 0;
    }
    if (tagged) { /* the lookups above gave the type a tag when it had none */
        plain_type = tp;
        plain_tag = tp->tp_version_tag;
    }
    return 1;
}

/* work's dict when its fields live there (a new reference), else NULL;
 * NULL with an exception set only when making the dict failed. */
static PyObject *fields_of(PyObject *work) {
    if (!fields_plain(work))
        return NULL;
    PyObject *d = PyObject_GenericGetDict(work, NULL);
    if (d == NULL && PyErr_ExceptionMatches(PyExc_AttributeError))
        PyErr_Clear(); /* no dict: by name */
    return d;
}

/* work's field `name`, from its dict d (NULL: by name).  A new reference,
 * or NULL with an exception set. */
static PyObject *field_get(PyObject *work, PyObject *d, PyObject *name) {
    if (d != NULL) {
        PyObject *v = PyDict_GetItemWithError(d, name);
        if (v != NULL)
            return Py_NewRef(v);
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_GetAttr(work, name); /* a class's default, or by name */
}

/* Sets work's field `name` to v, in its dict d (NULL: by name).  Returns
 * 0, or -1 with an exception set. */
static int field_set(PyObject *work, PyObject *d, PyObject *name, PyObject *v) {
    return d != NULL ? PyDict_SetItem(d, name, v) : PyObject_SetAttr(work, name, v);
}

/* work._done as 1 or 0, or -1 with an exception set; d as field_get's. */
static int work_done(PyObject *work, PyObject *d) {
    PyObject *v = field_get(work, d, s_done);
    if (v == NULL)
        return -1;
    int r = v == Py_True ? 1 : v == Py_False ? 0 : PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* Whether the spare Work may be given again: the lane holds the only
 * reference, no weak reference sees it, it has only its own attributes
 * (in d, its dict from fields_of; NULL: never given again) and its call
 * is done (NOTE [ A Work used again ]).  Returns 1 or 0, or -1 with an
 * exception set. */
static int spare_free(PyObject *work, PyObject *d) {
    if (Py_REFCNT(work) != 1)
        return 0;
    PyTypeObject *tp = Py_TYPE(work);
    if (tp->tp_weaklistoffset <= 0)
        return 0; /* a layout not known here: never given again */
    if (*(PyObject **)((char *)work + tp->tp_weaklistoffset) != NULL)
        return 0;
    if (d == NULL || PyDict_GET_SIZE(d) != WORK_FIELDS)
        return 0;
    return work_done(work, d);
}

/* Lane.post(work_type, result, fn, args, keep, small), made by post()
 * (args: the first five; small: the sixth's truth): queues fn(*args,
 * timeout) with its Work, the spare when spare_free says so, else a new
 * work_type(result) (kept as the spare when its `reusable` is true).
 * Returns the Work, or NULL with an exception set (nothing queued, unless
 * the lane's drain, run on its own thread, raised). */
static PyObject *post(LaneObject *self, PyObject *const *args, int small);

static PyObject *lane_post(LaneObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "post() takes work_type, result, fn, args, keep and small");
        return NULL;
    }
    int small = PyObject_IsTrue(args[5]);
    return small < 0 ? NULL : post(self, args, small);
}

PyObject *mpc_py_lane_post(PyObject *lane, PyObject *work_type, PyObject *result, PyObject *fn,
                           PyObject *args, PyObject *keep, int small) {
    PyObject *const a[5] = {work_type, result, fn, args, keep};
    return post((LaneObject *)lane, a, small);
}

static PyObject *post(LaneObject *self, PyObject *const *args, int small) {
    PyObject *result = args[1];
    PyObject *work = self->spare, *d = NULL;
    int free = 0;
    if (work != NULL && work != Py_None && Py_REFCNT(work) == 1) {
        if ((d = fields_of(work)) == NULL && PyErr_Occurred())
            return NULL;
        free = spare_free(work, d);
    }
    if (free < 0) {
        Py_XDECREF(d);
        return NULL;
    }
    if (free) {
        Py_INCREF(work);
        int bad = field_set(work, d, s_tensors, result) < 0 ||
                  field_set(work, d, s_done, Py_False) < 0 ||
                  field_set(work, d, s_exc, Py_None) < 0 ||
                  field_set(work, d, s_future, Py_None) < 0;
        Py_DECREF(d);
        if (bad)
            goto err_work;
    } else {
        Py_XDECREF(d);
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

/* lane_wait_for's work, with fields, work's dict from fields_of (NULL: by
 * name).  The same returns. */
static PyObject *wait_and_run(LaneObject *self, PyObject *work, PyObject *fields) {
    if (lane_call0(self, B_ACQUIRE) < 0)
        return NULL;
    PyObject *item = NULL;
    for (;;) {
        int d = work_done(work, fields);
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
    PyObject *events = field_get(work, fields, s_events);
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
        ok = field_set(work, fields, s_exc, exc != NULL ? exc : Py_None) == 0 &&
             field_set(work, fields, s_done, Py_True) == 0 &&
             (fut = field_get(work, fields, s_future)) != NULL;
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

/* Lane.wait_for's work, with fields, work's dict from fields_of (NULL: by
 * name): on the lane's own thread drain(work) (NOTE [ Callbacks that call
 * again ]), elsewhere wait_and_run.  The same returns. */
static PyObject *wait_in(LaneObject *self, PyObject *work, PyObject *fields) {
    if (lane_here(self))
        return PyObject_CallMethodOneArg((PyObject *)self, s_drain, work);
    return wait_and_run(self, work, fields);
}

/* Lane.wait_for(work): until `work`, a call of this lane, is done, running
 * it on this thread when it is next and nobody runs it (NOTE [ A waiter
 * runs its own call ]); on the lane's own thread, drain(work).  Returns
 * None (the call's own error is the Work's, raised by Work.wait), or NULL
 * with an exception set when waiting failed (a signal's handler raised). */
static PyObject *lane_wait_for(LaneObject *self, PyObject *work) {
    PyObject *fields = fields_of(work);
    if (fields == NULL && PyErr_Occurred())
        return NULL;
    PyObject *ret = wait_in(self, work, fields);
    Py_XDECREF(fields);
    return ret;
}

/* NOTE [ Work.wait in C ]
 * An asynchronous call's Work is waited on at once in most programs
 * (dist.all_reduce(t, async_op=True).wait(), a functional collective's
 * wait), and Work.wait in Python cost a tenth of such a call over a
 * blocking one (4 KB, one rank: 0.15 us of the lane's 0.6).  So it is a C
 * callable, WorkWait(slow): called with the Work alone, it reads the
 * Work's fields in its dict (NOTE [ A Work's fields in its dict ]), has
 * the lane run or await the call (lane_wait_for), and raises the call's
 * error or returns True, as the Python method it stands for; with a
 * timeout, or for a Work whose fields are not plain, it calls `slow`, that
 * method.  torch's C++ holders call wait through pybind, which takes an
 * attribute for a Python override unless it is a built-in function (it
 * would call torch's own wait of the base Work then, which never ends):
 * a WorkWait bound to a Work is a bound method (types.MethodType) of a
 * callable that is no built-in function, as a Python function's is.
 * Measured as above: wait() over the lane's own wait_for, 0.145 us in
 * Python, 0.057 in C. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *slow; /* the Python method: timeouts, Works of another layout */
} WorkWaitObject;

static PyTypeObject *lane_type; /* Lane, for WorkWait's check of a Work's lane */

static PyObject *work_wait_call(PyObject *op, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames) {
    WorkWaitObject *self = (WorkWaitObject *)op;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *work = args[0];
    PyObject *d = fields_of(work);
    if (d == NULL)
        return PyErr_Occurred() ? NULL : PyObject_Vectorcall(self->slow, args, nargsf, NULL);
    PyObject *done = PyDict_GetItemWithError(d, s_done); /* borrowed, as the next two */
    PyObject *lane = done == Py_False ? PyDict_GetItemWithError(d, s_lane) : NULL;
    if (done == NULL || (done != Py_True && (lane == NULL || !PyObject_TypeCheck(lane, lane_type)))) {
        Py_DECREF(d);
        return PyErr_Occurred() ? NULL : PyObject_Vectorcall(self->slow, args, nargsf, NULL);
    }
    if (lane != NULL) {
        Py_INCREF(lane);
        PyObject *r = wait_in((LaneObject *)lane, work, d);
        Py_DECREF(lane);
        if (r == NULL) {
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(r);
    }
    PyObject *exc = PyDict_GetItemWithError(d, s_exc);
    if (exc == NULL && !PyErr_Occurred())
        exc = Py_None; /* no field: as the Python method, which would raise AttributeError */
    Py_XINCREF(exc);
    Py_DECREF(d);
    if (exc == NULL)
        return NULL;
    if (exc != Py_None) {
        if (PyExceptionInstance_Check(exc))
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        else
            PyErr_SetString(PyExc_TypeError, "a Work's error is not an exception");
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(exc);
    Py_RETURN_TRUE;
}

static PyObject *work_wait_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *slow;
    if (kw != NULL && PyDict_GET_SIZE(kw) > 0) {
        PyErr_SetString(PyExc_TypeError, "WorkWait(slow) takes no keywords");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O:WorkWait", &slow))
        return NULL;
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "WorkWait(slow): slow must be callable");
        return NULL;
    }
    WorkWaitObject *self = (WorkWaitObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = work_wait_call;
    self->slow = Py_NewRef(slow);
    return (PyObject *)self;
}

/* Bound to a Work, a bound method (see NOTE [ Work.wait in C ]). */
static PyObject *work_wait_get(PyObject *self, PyObject *obj, PyObject *type) {
    (void)type;
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static int work_wait_traverse(WorkWaitObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->slow);
    return 0;
}

static int work_wait_clear(WorkWaitObject *self) {
    Py_CLEAR(self->slow);
    return 0;
}

static void work_wait_dealloc(WorkWaitObject *self) {
    gc_dealloc((PyObject *)self, (inquiry)work_wait_clear);
}

static PyMemberDef work_wait_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(WorkWaitObject, vectorcall), READONLY, NULL},
    {"slow", T_OBJECT, offsetof(WorkWaitObject, slow), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot work_wait_slots[] = {
    {Py_tp_doc, "wait(timeout=None) of a group's Work, in C (NOTE [ Work.wait in C ] in "
                "py_lane.c); slow: the Python method it calls with a timeout."},
    {Py_tp_new, work_wait_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, work_wait_get},
    {Py_tp_dealloc, work_wait_dealloc},
    {Py_tp_traverse, work_wait_traverse},
    {Py_tp_clear, work_wait_clear},
    {Py_tp_members, work_wait_members},
    {0, NULL},
};

static PyType_Spec work_wait_spec = {
    .name = "mpcore._core.WorkWait",
    .basicsize = sizeof(WorkWaitObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = work_wait_slots,
};

Py_ssize_t mpc_py_lane_queued(PyObject *lane) {
    return lane_type != NULL && PyObject_TypeCheck(lane, lane_type) ? ((LaneObject *)lane)->queued
                                                                   : -1;
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
    static const mpc_py_name names[] = {
        {&s_acquire, "acquire"}, {&s_release, "release"}, {&s_append, "append"},
        {&s_popleft, "popleft"}, {&s_notify, "notify"}, {&s_notify_all, "notify_all"},
        {&s_wait, "wait"}, {&s_done, "_done"}, {&s_exc, "_exc"}, {&s_future, "_future"},
        {&s_tensors, "_tensors"}, {&s_lane, "lane"}, {&s_reusable, "reusable"},
        {&s_events, "profiler_events"}, {&s_settle, "settle"}, {&s_drain, "drain"},
        {&s_start, "_start"}, {&s_end_events, "_end_events"},
    };
    if (mpc_py_intern(names, sizeof names / sizeof names[0]) < 0)
        return -1;
    PyObject *type = PyType_FromModuleAndSpec(m, &lane_spec, NULL);
    if (type == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "Lane", type);
    lane_type = (PyTypeObject *)type; /* the module holds it */
    Py_DECREF(type);
    if (r < 0)
        return -1;
    PyObject *wait = PyType_FromModuleAndSpec(m, &work_wait_spec, NULL);
    if (wait == NULL)
        return -1;
    r = PyModule_AddObjectRef(m, "WorkWait", wait);
    Py_DECREF(wait);
    return r;
}
