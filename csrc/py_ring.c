/* py_ring.c: the Python face of message rings: the type
 * mpcore._core.Ring, which runs a ring (ring.c) in any writable buffer, and
 * the function ring_footprint.
 *
 * Every operation first tries without waiting while it holds the GIL; only
 * when it has to wait does it release the GIL, and it then waits in the
 * core, coming back with -EINTR whenever a signal arrives so that Python's
 * handlers can run (Ctrl-C raises KeyboardInterrupt) before it waits again
 * towards the same deadline.  This is the scheme of CPython's
 * _multiprocessing/semaphore.c. */
#include "py_mpcore.h"

#include <string.h>

typedef struct {
    PyObject_HEAD
    /* The buffer the ring lives in.  Holding the Py_buffer keeps its
     * exporter alive and, for bytearray and mmap, stops it from being
     * resized or closed while the ring is in use. */
    Py_buffer view;
    int have_view;
    mpc_ring *ring; /* view.buf + offset */
    uint64_t size;  /* bytes of the region */
} RingObject;

/* How many refs a put converts on the stack before it needs the heap. */
#define RING_STACK_REFS 8

static mpc_state *ring_state(PyObject *self) { return mpc_type_state(Py_TYPE(self)); }

/* Raises the exception for a failed ring operation: Full or Empty (like
 * the stdlib's, without a message) for a ring that stayed full or empty,
 * ValueError for a closed ring or a message too big, and the core's usual
 * mapping otherwise.  Returns NULL. */
static PyObject *ring_raise(PyObject *self, int rc, int is_put) {
    mpc_state *st = ring_state(self);
    if (rc == -EAGAIN || rc == -ETIMEDOUT) {
        PyErr_SetNone(is_put ? (st ? st->QueueFull : PyExc_TimeoutError)
                             : (st ? st->QueueEmpty : PyExc_TimeoutError));
        return NULL;
    }
    if (rc == -EPIPE) {
        PyErr_SetString(PyExc_ValueError, "ring is closed");
        return NULL;
    }
    if (rc == -EMSGSIZE) {
        const char *msg = mpc_errmsg();
        PyErr_SetString(PyExc_ValueError, *msg ? msg : "message too large for the ring");
        return NULL;
    }
    return mpc_py_raise(st, rc);
}

/* ------------------------------------------------------------------ */
/* Construction                                                        */
/* ------------------------------------------------------------------ */

static void Ring_dealloc(PyObject *op) {
    RingObject *self = (RingObject *)op;
    PyTypeObject *tp = Py_TYPE(op);
    if (self->have_view) {
        PyBuffer_Release(&self->view);
        self->have_view = 0;
    }
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buffer", "offset", "size", "create", "maxitems", NULL};
    PyObject *buffer, *size_obj = Py_None, *maxitems_obj = NULL;
    Py_ssize_t offset = 0;
    int create = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|nOpO:Ring", kwlist, &buffer, &offset,
                                     &size_obj, &create, &maxitems_obj))
        return NULL;
    unsigned long maxitems = 0;
    if (maxitems_obj != NULL) {
        maxitems = PyLong_AsUnsignedLong(maxitems_obj);
        if (maxitems == (unsigned long)-1 && PyErr_Occurred())
            return NULL;
        if (maxitems > UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "maxitems must be below 2**32");
            return NULL;
        }
    }

    RingObject *self = (RingObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0)
        goto fail;
    self->have_view = 1;

    Py_ssize_t len = self->view.len, size;
    if (offset < 0 || offset > len) {
        PyErr_Format(PyExc_ValueError, "offset %zd is outside the buffer of %zd bytes", offset,
                     len);
        goto fail;
    }
    if (size_obj == Py_None) {
        size = len - offset;
    } else {
        size = PyLong_AsSsize_t(size_obj);
        if (size == -1 && PyErr_Occurred())
            goto fail;
        if (size < 0 || size > len - offset) {
            PyErr_Format(PyExc_ValueError,
                         "a ring of %zd bytes at offset %zd does not fit in a buffer of %zd bytes",
                         size, offset, len);
            goto fail;
        }
    }
    self->ring = (mpc_ring *)((char *)self->view.buf + offset);
    self->size = (uint64_t)size;

    mpc_clear_error();
    int rc = create ? mpc_ring_init(self->ring, self->size, (uint32_t)maxitems)
                    : mpc_ring_check(self->ring, self->size);
    if (rc < 0) {
        mpc_py_raise(mpc_type_state(type), rc);
        goto fail;
    }
    return (PyObject *)self;

fail:
    Py_DECREF(self);
    return NULL;
}

/* ------------------------------------------------------------------ */
/* put and get                                                         */
/* ------------------------------------------------------------------ */

/* Reads an int that must fit in `bits` unsigned bits. */
static int ring_uint(PyObject *o, unsigned bits, uint64_t *out) {
    PyObject *i = PyNumber_Index(o);
    if (i == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (bits < 64 && v >> bits) {
        PyErr_Format(PyExc_OverflowError, "%llu does not fit in %u bits", v, bits);
        return -1;
    }
    *out = v;
    return 0;
}

/* Converts a sequence of (seg_id, index, gen) into refs: into stack (room
 * for RING_STACK_REFS) when they fit, else into a PyMem buffer that the
 * caller frees when *refs != stack.  Returns 0 or -1 with an exception. */
static int ring_parse_refs(PyObject *seq, mpc_ref *stack, mpc_ref **refs, uint32_t *nrefs) {
    PyObject *fast = PySequence_Fast(seq, "refs must be a sequence of (seg_id, index, gen)");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if ((uint64_t)n > UINT32_MAX) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_OverflowError, "too many refs");
        return -1;
    }
    mpc_ref *buf = stack;
    if (n > RING_STACK_REFS) {
        buf = PyMem_Malloc((size_t)n * sizeof(mpc_ref));
        if (buf == NULL) {
            Py_DECREF(fast);
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        PyObject *t = PySequence_Fast(item, "each ref must be a (seg_id, index, gen) tuple");
        if (t == NULL)
            goto fail;
        uint64_t seg = 0, index = 0, gen = 0;
        int bad = PySequence_Fast_GET_SIZE(t) != 3;
        if (bad)
            PyErr_SetString(PyExc_TypeError, "each ref must be a (seg_id, index, gen) tuple");
        else
            bad = ring_uint(PySequence_Fast_GET_ITEM(t, 0), 64, &seg) < 0 ||
                  ring_uint(PySequence_Fast_GET_ITEM(t, 1), 32, &index) < 0 ||
                  ring_uint(PySequence_Fast_GET_ITEM(t, 2), 32, &gen) < 0;
        Py_DECREF(t);
        if (bad)
            goto fail;
        buf[i].seg_id = seg;
        buf[i].index = (uint32_t)index;
        buf[i].gen = (uint32_t)gen;
    }
    Py_DECREF(fast);
    *refs = buf;
    *nrefs = (uint32_t)n;
    return 0;

fail:
    if (buf != stack)
        PyMem_Free(buf);
    Py_DECREF(fast);
    return -1;
}

static PyObject *Ring_put(PyObject *op, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"refs", "payload", "block", "timeout", "task", NULL};
    RingObject *self = (RingObject *)op;
    PyObject *refs_obj, *timeout = Py_None;
    Py_buffer pb;
    int block = 1, task = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oy*|pOp:put", kwlist, &refs_obj, &pb, &block,
                                     &timeout, &task))
        return NULL;
    PyObject *result = NULL;
    mpc_ref stack[RING_STACK_REFS], *refs = stack;
    uint32_t nrefs = 0;
    int64_t deadline = mpc_py_deadline(block, timeout);
    if (deadline == -2 || ring_parse_refs(refs_obj, stack, &refs, &nrefs) < 0)
        goto done;

    /* A payload too large for the ring is put into a block once, before
     * any wait (NOTE [ Ring ], Spilled messages); the GIL is released for
     * the copy, since the buffer stays exported meanwhile. */
    mpc_ref spill;
    int spilled = 0;
    mpc_clear_error();
    if ((uint64_t)pb.len + (uint64_t)nrefs * sizeof(mpc_ref) > mpc_ring_max_message(self->ring)) {
        Py_BEGIN_ALLOW_THREADS
        spilled = mpc_ring_spill(self->ring, nrefs, pb.buf, (uint64_t)pb.len, &spill);
        Py_END_ALLOW_THREADS
    }
    if (spilled < 0) {
        ring_raise(op, spilled, 1);
        goto done;
    }
#define RING_PUT(deadline_)                                                                 \
    (spilled ? mpc_ring_put_spilled(self->ring, refs, nrefs, &spill, (uint64_t)pb.len,      \
                                    (deadline_), task)                                      \
     : task  ? mpc_ring_put_counted(self->ring, refs, nrefs, pb.buf, (uint64_t)pb.len,      \
                                    (deadline_))                                            \
             : mpc_ring_put(self->ring, refs, nrefs, pb.buf, (uint64_t)pb.len, (deadline_)))
    int rc = RING_PUT(0);
    while (rc == -EAGAIN && deadline != 0) {
        /* A signal that came before the wait would otherwise only be seen
         * when the wait ends, which may be never. */
        if (PyErr_CheckSignals() < 0)
            break;
        Py_BEGIN_ALLOW_THREADS
        rc = RING_PUT(deadline);
        Py_END_ALLOW_THREADS
        if (rc == -EINTR)
            rc = -EAGAIN; /* check the signal, then wait again */
        else if (rc == -EAGAIN)
            rc = -ETIMEDOUT; /* cannot happen with a deadline; never loop on it */
    }
#undef RING_PUT
    if (rc < 0 && spilled) {
        Py_BEGIN_ALLOW_THREADS
        mpc_ref_drop(&spill);
        Py_END_ALLOW_THREADS
    }
    if (rc < 0) {
        if (!PyErr_Occurred())
            ring_raise(op, rc, 1);
        goto done;
    }
    result = Py_NewRef(Py_None);

done:
    if (refs != stack)
        PyMem_Free(refs);
    PyBuffer_Release(&pb);
    return result;
}

PyObject *mpc_py_ring_message(const mpc_ref *refs, uint32_t nrefs, const void *payload,
                              uint64_t len) {
    PyObject *list = PyList_New(nrefs);
    if (list == NULL)
        return NULL;
    for (uint32_t i = 0; i < nrefs; i++) {
        PyObject *t = Py_BuildValue("(KII)", (unsigned long long)refs[i].seg_id, refs[i].index,
                                    refs[i].gen);
        if (t == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, t);
    }
    PyObject *bytes = PyBytes_FromStringAndSize(payload, (Py_ssize_t)len);
    if (bytes == NULL) {
        Py_DECREF(list);
        return NULL;
    }
    PyObject *res = PyTuple_Pack(2, list, bytes);
    Py_DECREF(list);
    Py_DECREF(bytes);
    return res;
}

/* The wait loop of the gets: mpc_ring_get_block when block is not NULL
 * (returns 1 for a payload handed over in its block), else mpc_ring_get. */
static int ring_get_loop(mpc_ring *r, int64_t deadline, mpc_ref **refs, uint32_t *nrefs,
                         void **payload, uint64_t *len, mpc_block *block) {
#define RING_GET(deadline_)                                                   \
    (block ? mpc_ring_get_block(r, refs, nrefs, payload, len, block, (deadline_)) \
           : mpc_ring_get(r, refs, nrefs, payload, len, (deadline_)))
    mpc_clear_error();
    int rc = RING_GET(0);
    while (rc == -EAGAIN && deadline != 0) {
        if (PyErr_CheckSignals() < 0)
            return -EINTR;
        Py_BEGIN_ALLOW_THREADS
        rc = RING_GET(deadline);
        Py_END_ALLOW_THREADS
        if (rc == -EINTR)
            rc = -EAGAIN;
        else if (rc == -EAGAIN)
            rc = -ETIMEDOUT;
    }
    return rc;
#undef RING_GET
}

int mpc_py_ring_get(mpc_ring *r, int64_t deadline, mpc_ref **refs, uint32_t *nrefs,
                    void **payload, uint64_t *len) {
    return ring_get_loop(r, deadline, refs, nrefs, payload, len, NULL);
}

PyObject *mpc_py_ring_raise(PyObject *ring, int rc) {
    if (PyErr_Occurred())
        return NULL;
    return ring_raise(ring, rc, 0);
}

mpc_ring *mpc_py_ring_of(mpc_state *st, PyObject *o) {
    if (!PyObject_TypeCheck(o, st->RingType)) {
        PyErr_Format(PyExc_TypeError, "expected a Ring, got %.100s", Py_TYPE(o)->tp_name);
        return NULL;
    }
    return ((RingObject *)o)->ring;
}

static PyObject *ring_message(PyObject *op, int rc, mpc_ref *refs, uint32_t nrefs, void *payload,
                              uint64_t len, mpc_block *spill);

static PyObject *Ring_get(PyObject *op, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"block", "timeout", NULL};
    RingObject *self = (RingObject *)op;
    PyObject *timeout = Py_None;
    int block = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pO:get", kwlist, &block, &timeout))
        return NULL;
    int64_t deadline = mpc_py_deadline(block, timeout);
    if (deadline == -2)
        return NULL;

    mpc_ref *refs = NULL;
    uint32_t nrefs = 0;
    void *payload = NULL;
    uint64_t len = 0;
    mpc_block spill;
    int rc = ring_get_loop(self->ring, deadline, &refs, &nrefs, &payload, &len, &spill);
    if (rc < 0)
        return mpc_py_ring_raise(op, rc);
    return ring_message(op, rc, refs, nrefs, payload, len, &spill);
}

/* The (refs, payload) of a message a get has taken (rc: the get's return,
 * 1 for a payload handed over in its block *spill); frees refs and
 * payload.  The message has left the ring; if Python cannot take it now
 * (no memory), it is lost, as a message read from a pipe would be. */
static PyObject *ring_message(PyObject *op, int rc, mpc_ref *refs, uint32_t nrefs, void *payload,
                              uint64_t len, mpc_block *spill) {
    PyObject *res;
    if (rc == 1) {
        /* A spilled payload: handed out as its Block, read in place. */
        PyObject *b = mpc_py_block_wrap(ring_state(op), spill);
        res = b ? mpc_py_ring_message(refs, nrefs, "", 0) : NULL;
        if (res != NULL)
            PyTuple_SetItem(res, 1, b); /* steals b; replaces the empty bytes */
        else
            Py_XDECREF(b);
    } else {
        res = mpc_py_ring_message(refs, nrefs, payload, len);
    }
    free(refs);
    free(payload);
    return res;
}


/* get_many(block=True, timeout=None, max=2**30) -> [(refs, payload), ...]:
 * waits (as get) for one message, then takes, without waiting, those
 * that are there now, up to max in all. */
static PyObject *Ring_get_many(PyObject *op, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"block", "timeout", "max", NULL};
    RingObject *self = (RingObject *)op;
    PyObject *timeout = Py_None;
    int block = 1;
    Py_ssize_t max = (Py_ssize_t)1 << 30;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pOn:get_many", kwlist, &block, &timeout, &max))
        return NULL;
    if (max < 1)
        return PyErr_Format(PyExc_ValueError, "max_messages_to_get must be at least 1, not %zd",
                            max);
    int64_t deadline = mpc_py_deadline(block, timeout);
    if (deadline == -2)
        return NULL;
    PyObject *list = PyList_New(0);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < max; i++) {
        mpc_ref *refs = NULL;
        uint32_t nrefs = 0;
        void *payload = NULL;
        uint64_t len = 0;
        mpc_block spill;
        int rc = i == 0 ? ring_get_loop(self->ring, deadline, &refs, &nrefs, &payload, &len, &spill)
                        : (mpc_clear_error(), mpc_ring_get_block(self->ring, &refs, &nrefs, &payload,
                                                                 &len, &spill, 0));
        if (rc < 0) {
            if (i > 0 && (rc == -EAGAIN || rc == -EPIPE))
                break; /* none left now; what was taken is returned */
            /* Messages taken before a failure are returned; a failure on
             * the first one raises. */
            if (i > 0) {
                PyErr_Clear();
                break;
            }
            Py_DECREF(list);
            return mpc_py_ring_raise(op, rc);
        }
        PyObject *m = ring_message(op, rc, refs, nrefs, payload, len, &spill);
        if (m == NULL || PyList_Append(list, m) < 0) {
            Py_XDECREF(m);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(m);
    }
    return list;
}

/* put_many(msgs, block=True, timeout=None, task=False): appends every
 * (refs, payload) of msgs, all or none, together (mpc_ring_put_many).
 * Raises queue.Full when there was no room for all of them in time,
 * ValueError when the ring is closed or the batch can never fit; then
 * nothing was put. */
static PyObject *Ring_put_many(PyObject *op, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"msgs", "block", "timeout", "task", NULL};
    RingObject *self = (RingObject *)op;
    PyObject *msgs_obj, *timeout = Py_None;
    int block = 1, task = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|pOp:put_many", kwlist, &msgs_obj, &block,
                                     &timeout, &task))
        return NULL;
    int64_t deadline = mpc_py_deadline(block, timeout);
    if (deadline == -2)
        return NULL;
    PyObject *fast = PySequence_Fast(msgs_obj, "msgs must be a sequence of (refs, payload)");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if ((uint64_t)n > UINT32_MAX) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_OverflowError, "a batch of %zd messages is too large", n);
    }
    PyObject *result = NULL;
    Py_ssize_t ready = 0; /* entries of the arrays below that are filled */
    mpc_ring_msg *msgs = PyMem_Calloc(n ? (size_t)n : 1, sizeof *msgs);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof *views);
    mpc_ref *spills = PyMem_Calloc(n ? (size_t)n : 1, sizeof *spills);
    mpc_ref *refbufs = NULL;
    if (msgs == NULL || views == NULL || spills == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* All refs of the batch in one array. */
    size_t nall = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "each message must be a (refs, payload) tuple");
            goto done;
        }
        Py_ssize_t k = PyObject_Length(PyTuple_GET_ITEM(item, 0));
        if (k < 0)
            goto done;
        nall += (size_t)k;
    }
    refbufs = PyMem_Calloc(nall ? nall : 1, sizeof *refbufs);
    if (refbufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    size_t at = 0;
    mpc_clear_error();
    for (; ready < n; ready++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, ready);
        mpc_ref stack[RING_STACK_REFS], *refs = stack;
        uint32_t nrefs = 0;
        if (ring_parse_refs(PyTuple_GET_ITEM(item, 0), stack, &refs, &nrefs) < 0)
            goto done;
        if (at + nrefs > nall) { /* the sequence changed length meanwhile */
            if (refs != stack)
                PyMem_Free(refs);
            PyErr_SetString(PyExc_RuntimeError, "refs changed while being read");
            goto done;
        }
        memcpy(&refbufs[at], refs, (size_t)nrefs * sizeof(mpc_ref));
        if (refs != stack)
            PyMem_Free(refs);
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &views[ready], PyBUF_SIMPLE) < 0)
            goto done;
        mpc_ring_msg *m = &msgs[ready];
        m->refs = &refbufs[at];
        m->nrefs = nrefs;
        m->payload = views[ready].buf;
        m->len = (uint64_t)views[ready].len;
        at += nrefs;
        if ((uint64_t)views[ready].len + (uint64_t)nrefs * sizeof(mpc_ref) >
            mpc_ring_max_message(self->ring)) {
            int sp;
            Py_BEGIN_ALLOW_THREADS
            sp = mpc_ring_spill(self->ring, nrefs, m->payload, m->len, &spills[ready]);
            Py_END_ALLOW_THREADS
            if (sp < 0) {
                PyBuffer_Release(&views[ready]);
                ring_raise(op, sp, 1);
                goto done;
            }
            if (sp == 1)
                m->spill = &spills[ready];
        }
    }
    int rc = mpc_ring_put_many(self->ring, msgs, (uint32_t)n, 0, task);
    while (rc == -EAGAIN && deadline != 0) {
        if (PyErr_CheckSignals() < 0)
            break;
        Py_BEGIN_ALLOW_THREADS
        rc = mpc_ring_put_many(self->ring, msgs, (uint32_t)n, deadline, task);
        Py_END_ALLOW_THREADS
        if (rc == -EINTR)
            rc = -EAGAIN;
        else if (rc == -EAGAIN)
            rc = -ETIMEDOUT;
    }
    if (rc < 0) {
        if (!PyErr_Occurred())
            ring_raise(op, rc, 1);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        msgs[i].spill = NULL; /* the ring owns them now */
    result = Py_NewRef(Py_None);

done:
    for (Py_ssize_t i = 0; i < ready; i++) {
        if (msgs[i].spill != NULL) {
            Py_BEGIN_ALLOW_THREADS
            mpc_ref_drop(msgs[i].spill);
            Py_END_ALLOW_THREADS
        }
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(refbufs);
    PyMem_Free(spills);
    PyMem_Free(views);
    PyMem_Free(msgs);
    Py_DECREF(fast);
    return result;
}

/* ------------------------------------------------------------------ */
/* The rest                                                            */
/* ------------------------------------------------------------------ */

static PyObject *Ring_count(PyObject *op, PyObject *unused) {
    (void)unused;
    return PyLong_FromUnsignedLong(mpc_ring_count(((RingObject *)op)->ring));
}

static PyObject *Ring_max_message(PyObject *op, PyObject *unused) {
    (void)unused;
    return PyLong_FromUnsignedLongLong(mpc_ring_max_message(((RingObject *)op)->ring));
}

static PyObject *Ring_close(PyObject *op, PyObject *unused) {
    (void)unused;
    mpc_ring_close(((RingObject *)op)->ring);
    Py_RETURN_NONE;
}

static PyObject *Ring_task_add(PyObject *op, PyObject *unused) {
    (void)unused;
    mpc_clear_error();
    int rc = mpc_ring_task_add(((RingObject *)op)->ring);
    if (rc < 0)
        return ring_raise(op, rc, 0);
    Py_RETURN_NONE;
}

static PyObject *Ring_task_done(PyObject *op, PyObject *unused) {
    (void)unused;
    mpc_clear_error();
    int rc = mpc_ring_task_done(((RingObject *)op)->ring);
    if (rc < 0)
        return ring_raise(op, rc, 0);
    Py_RETURN_NONE;
}

static PyObject *Ring_join(PyObject *op, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"timeout", NULL};
    RingObject *self = (RingObject *)op;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:join", kwlist, &timeout))
        return NULL;
    int64_t deadline = mpc_py_deadline(1, timeout);
    if (deadline == -2)
        return NULL;
    mpc_clear_error();
    int rc = mpc_ring_join(self->ring, 0);
    while (rc == -ETIMEDOUT && deadline != 0 && (deadline < 0 || mpc_now_ns() < deadline)) {
        if (PyErr_CheckSignals() < 0)
            return NULL;
        Py_BEGIN_ALLOW_THREADS
        rc = mpc_ring_join(self->ring, deadline);
        Py_END_ALLOW_THREADS
        if (rc == -EINTR)
            rc = -ETIMEDOUT; /* check the signal, then wait again unless past the deadline */
        else if (rc == -ETIMEDOUT)
            break;
    }
    if (rc == -ETIMEDOUT)
        Py_RETURN_FALSE;
    if (rc < 0)
        return ring_raise(op, rc, 0);
    Py_RETURN_TRUE;
}

typedef struct {
    mpc_ref *refs;
    size_t n, cap;
    int nomem;
} ring_drained;

static void ring_collect(const mpc_ref *ref, void *arg) {
    ring_drained *d = arg;
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 64;
        mpc_ref *p = realloc(d->refs, cap * sizeof(mpc_ref));
        if (p == NULL) {
            d->nomem = 1;
            return;
        }
        d->refs = p;
        d->cap = cap;
    }
    d->refs[d->n++] = *ref;
}

static PyObject *Ring_drain(PyObject *op, PyObject *unused) {
    (void)unused;
    ring_drained d = {0};
    mpc_ring_drain(((RingObject *)op)->ring, ring_collect, &d);
    PyObject *list = NULL;
    if (d.nomem) {
        PyErr_NoMemory();
        goto done;
    }
    list = PyList_New((Py_ssize_t)d.n);
    for (size_t i = 0; list != NULL && i < d.n; i++) {
        PyObject *t = Py_BuildValue("(KII)", (unsigned long long)d.refs[i].seg_id,
                                    d.refs[i].index, d.refs[i].gen);
        if (t == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
done:
    free(d.refs);
    return list;
}

static PyObject *Ring_get_closed(PyObject *op, void *closure) {
    (void)closure;
    mpc_clear_error();
    int rc = mpc_ring_is_closed(((RingObject *)op)->ring);
    if (rc < 0)
        return ring_raise(op, rc, 0);
    return PyBool_FromLong(rc);
}

static PyObject *Ring_get_size(PyObject *op, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(((RingObject *)op)->size);
}

static PyMethodDef Ring_methods[] = {
    {"put", (PyCFunction)(void (*)(void))Ring_put, METH_VARARGS | METH_KEYWORDS,
     "put(refs, payload, block=True, timeout=None, task=False)\n--\n\n"
     "Appends a message: refs, a sequence of (seg_id, index, gen), and payload,\n"
     "any bytes-like object, of any size (one too large for the ring travels in\n"
     "a shared-memory block).  Raises queue.Full if no room comes in time,\n"
     "ValueError if the ring is closed or its refs alone can never fit,\n"
     "MemoryError if a large payload finds no shared memory.  task=True\n"
     "also counts one unfinished task (JoinableQueue), together with the message."},
    {"get", (PyCFunction)(void (*)(void))Ring_get, METH_VARARGS | METH_KEYWORDS,
     "get(block=True, timeout=None)\n--\n\n"
     "Removes the oldest message and returns (refs, payload): a list of\n"
     "(seg_id, index, gen) tuples and the payload: bytes, or for a payload\n"
     "larger than the ring the Block it travelled in (a buffer of exactly its\n"
     "length, released with the object).  Raises queue.Empty if none comes\n"
     "in time, ValueError once the ring is closed and empty."},
    {"get_many", (PyCFunction)(void (*)(void))Ring_get_many, METH_VARARGS | METH_KEYWORDS,
     "get_many(block=True, timeout=None, max=2**30)\n--\n\n"
     "Waits as get() for one message, then also takes those there now, up to\n"
     "max in all; returns a list of (refs, payload).  Raises as get() when\n"
     "none comes."},
    {"put_many", (PyCFunction)(void (*)(void))Ring_put_many, METH_VARARGS | METH_KEYWORDS,
     "put_many(msgs, block=True, timeout=None, task=False)\n--\n\n"
     "Appends every (refs, payload) of msgs, all or none, in order and\n"
     "together.  Raises queue.Full when there was no room for all of them in\n"
     "time, ValueError when the ring is closed or the batch can never fit\n"
     "(more messages than maxitems, more bytes than the ring)."},
    {"count", Ring_count, METH_NOARGS, "count()\n--\n\nMessages in the ring now."},
    {"max_message", Ring_max_message, METH_NOARGS,
     "max_message()\n--\n\nThe largest message, 16 bytes per ref plus the payload, that travels\n"
     "inline; larger payloads go through a shared-memory block."},
    {"close", Ring_close, METH_NOARGS,
     "close()\n--\n\nCloses the ring: puts fail, gets return what is left, waiters wake."},
    {"task_add", Ring_task_add, METH_NOARGS, "task_add()\n--\n\nCounts one more unfinished task."},
    {"task_done", Ring_task_done, METH_NOARGS,
     "task_done()\n--\n\nCounts one task finished; ValueError if none is unfinished."},
    {"join", (PyCFunction)(void (*)(void))Ring_join, METH_VARARGS | METH_KEYWORDS,
     "join(timeout=None)\n--\n\n"
     "Waits until no task is unfinished; returns False if the timeout passed first."},
    {"drain", Ring_drain, METH_NOARGS,
     "drain()\n--\n\n"
     "Empties the ring and returns the refs of the messages it held, so that\n"
     "their tickets can be dropped."},
    {NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"closed", Ring_get_closed, NULL, "Whether the ring was closed (by any process).", NULL},
    {"size", Ring_get_size, NULL, "Bytes of the region the ring occupies.", NULL},
    {NULL},
};

static PyType_Slot Ring_slots[] = {
    {Py_tp_new, Ring_new},
    {Py_tp_dealloc, Ring_dealloc},
    {Py_tp_methods, Ring_methods},
    {Py_tp_getset, Ring_getset},
    {Py_tp_doc,
     "Ring(buffer, offset=0, size=None, create=False, maxitems=0)\n--\n\n"
     "A message ring in bytes [offset, offset+size) of a writable buffer that\n"
     "other processes map too.  create=True initialises a ring there (the bytes\n"
     "must be zero); maxitems bounds the number of messages (0: only bytes do).\n"
     "The buffer is kept exported for the life of the Ring."},
    {0, NULL},
};

static PyType_Spec Ring_spec = {
    .name = "mpcore._core.Ring",
    .basicsize = sizeof(RingObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Ring_slots,
};

/* ------------------------------------------------------------------ */
/* Module                                                              */
/* ------------------------------------------------------------------ */

static PyObject *py_ring_footprint(PyObject *module, PyObject *arg) {
    (void)module;
    uint64_t cap;
    if (ring_uint(arg, 64, &cap) < 0)
        return NULL;
    uint64_t fp = mpc_ring_footprint(cap);
    if (fp == UINT64_MAX) {
        PyErr_Format(PyExc_OverflowError, "a ring of capacity %llu is too large",
                     (unsigned long long)cap);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(fp);
}

PyMethodDef mpc_py_ring_methods[] = {
    {"ring_footprint", py_ring_footprint, METH_O,
     "ring_footprint(capacity)\n--\n\n"
     "Bytes a Ring needs for at least `capacity` bytes of messages."},
    {NULL},
};

int mpc_py_ring_exec(PyObject *m, mpc_state *st) {
    PyObject *type = PyType_FromModuleAndSpec(m, &Ring_spec, NULL);
    if (type == NULL)
        return -1;
    st->RingType = (PyTypeObject *)type; /* the state owns this reference */
    return PyModule_AddObjectRef(m, "Ring", type);
}
