/* py_shm.c: bindings for shared-memory blocks (mpcore._core.Block) and the
 * keeper.  A Block object is this process's hold on one block: the hold is
 * dropped when the object is freed, and numpy arrays (and, through them,
 * torch storages) made over the block keep it alive as their base. */
#include "py_mpcore.h"

#include <structmember.h>
#include <numpy/arrayobject.h>
#include <numpy/npy_2_compat.h>
#include <string.h>

typedef struct BlockObject {
    PyObject_HEAD
    mpc_block b;
    int held;
    PyObject *weakreflist;
    PyObject *keys;           /* list: its entries in _torch._storages, or NULL */
    struct BlockObject *next; /* in the table below */
} BlockObject;

/* NOTE [ One Block object per block ]
 * A process holds a block once (one bit in the block's metadata), and the
 * Block object is that hold.  This table maps each block to its one live
 * Block object, so that attaching a handle twice gives the same object
 * (and, for torch, the same storage), so that an address can be mapped back
 * to its Block, and so that fork can find every block the child inherits.
 * The table is only touched with the GIL held; attach runs its fast path
 * with the GIL held too, so two threads cannot make two objects for one
 * hold. */
#define BLOCK_TABLE 4096
static BlockObject *block_table[BLOCK_TABLE];
static Py_ssize_t block_count;

static inline size_t block_hash(uint64_t seg, uint32_t index, uint32_t gen) {
    uint64_t h = seg ^ ((uint64_t)index * 0x9E3779B97F4A7C15ULL) ^ ((uint64_t)gen << 17);
    return (size_t)((h ^ (h >> 29)) % BLOCK_TABLE);
}

static BlockObject *block_lookup(uint64_t seg, uint32_t index, uint32_t gen) {
    for (BlockObject *o = block_table[block_hash(seg, index, gen)]; o; o = o->next)
        if (o->b.seg_id == seg && o->b.index == index && o->b.gen == gen)
            return o;
    return NULL;
}

static void block_unlink(BlockObject *self) {
    BlockObject **pp = &block_table[block_hash(self->b.seg_id, self->b.index, self->b.gen)];
    while (*pp && *pp != self)
        pp = &(*pp)->next;
    if (*pp) {
        *pp = self->next;
        block_count--;
    }
}

static PyObject *block_new_from(PyTypeObject *type, const mpc_block *b) {
    BlockObject *self = PyObject_GC_New(BlockObject, type);
    if (self == NULL) {
        Py_BEGIN_ALLOW_THREADS
        mpc_block_release(b);
        Py_END_ALLOW_THREADS
        return NULL;
    }
    self->b = *b;
    self->held = 1;
    self->weakreflist = NULL;
    self->keys = NULL;
    size_t h = block_hash(b->seg_id, b->index, b->gen);
    self->next = block_table[h];
    block_table[h] = self;
    block_count++;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static void trec_forget_block(BlockObject *self);

static void block_dealloc(BlockObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist)
        PyObject_ClearWeakRefs((PyObject *)self);
    trec_forget_block(self);
    block_unlink(self);
    if (self->held) {
        self->held = 0;
        Py_BEGIN_ALLOW_THREADS
        mpc_block_release(&self->b);
        Py_END_ALLOW_THREADS
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int block_traverse(BlockObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int block_getbuffer(BlockObject *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->b.addr, (Py_ssize_t)self->b.length, 0,
                             flags);
}

/* ticket(journal=False): with journal, the ticket is recorded in this
 * process's journal until a queue takes it (NOTE [ Journal ]). */
static PyObject *block_ticket(BlockObject *self, PyObject *args) {
    int journal = 0;
    if (!PyArg_ParseTuple(args, "|p", &journal))
        return NULL;
    mpc_clear_error();
    int r = mpc_block_ticket(&self->b);
    if (r < 0)
        return mpc_py_raise(mpc_type_state(Py_TYPE(self)), r);
    if (journal) {
        mpc_ref ref = {self->b.seg_id, self->b.index, self->b.gen};
        mpc_journal_add(&ref);
    }
    return Py_BuildValue("(KII)", (unsigned long long)self->b.seg_id, self->b.index, self->b.gen);
}

static PyObject *block_claim(BlockObject *self, PyObject *unused) {
    mpc_clear_error();
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = mpc_block_claim(&self->b);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return mpc_py_raise(mpc_type_state(Py_TYPE(self)), r);
    Py_RETURN_NONE;
}

/* Checks that a view (itemsize, shape, strides, byte offset) lies inside
 * the block.  Returns 0, or -1 with HandleError set. */
static int block_check_view(BlockObject *self, Py_ssize_t itemsize, int nd, const npy_intp *shape,
                            const npy_intp *strides, Py_ssize_t offset, Py_ssize_t start,
                            Py_ssize_t end) {
    mpc_state *st = mpc_type_state(Py_TYPE(self));
    PyObject *E = st ? st->HandleError : PyExc_ValueError;
    if (end < 0 || (uint64_t)end > self->b.length)
        end = (Py_ssize_t)self->b.length;
    if (start < 0 || start > end)
        start = 0;
    if (itemsize <= 0 || offset < start || offset > end) {
        PyErr_Format(E, "handle offset %zd is outside bytes [%zd, %zd) of its block", offset,
                     start, end);
        return -1;
    }
    int64_t lo = 0, hi = 0;
    for (int i = 0; i < nd; i++) {
        if (shape[i] < 0) {
            PyErr_Format(E, "handle has a negative dimension (%lld)", (long long)shape[i]);
            return -1;
        }
        if (shape[i] == 0)
            return 0; /* an empty view touches nothing */
        int64_t ext;
        if (__builtin_mul_overflow((int64_t)(shape[i] - 1), (int64_t)strides[i], &ext) ||
            __builtin_add_overflow(ext > 0 ? hi : lo, ext, ext > 0 ? &hi : &lo)) {
            PyErr_Format(E, "handle has an absurd shape or strides");
            return -1;
        }
    }
    if (offset + lo < start || offset + hi + itemsize > end) {
        PyErr_Format(E, "handle describes bytes [%lld, %lld), outside bytes [%zd, %zd) of its "
                     "%llu-byte block", (long long)(offset + lo), (long long)(offset + hi + itemsize),
                     start, end, (unsigned long long)self->b.length);
        return -1;
    }
    return 0;
}

/* Reads a sequence of integers (a shape or strides).  With E set, a value
 * out of range raises E (a handle's fault) instead of OverflowError. */
static int parse_dims(PyObject *seq, npy_intp *out, int *nd, const char *what, PyObject *E) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > NPY_MAXDIMS) {
        Py_DECREF(fast);
        PyErr_Format(E ? E : PyExc_ValueError, "%s has %zd dimensions, more than %d", what, n,
                     NPY_MAXDIMS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = (npy_intp)PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            if (E != NULL && (PyErr_ExceptionMatches(PyExc_OverflowError) ||
                              PyErr_ExceptionMatches(PyExc_TypeError))) {
                PyErr_Clear();
                PyErr_Format(E, "handle has an absurd %s", what);
            }
            return -1;
        }
    }
    *nd = (int)n;
    Py_DECREF(fast);
    return 0;
}

/* Block.check_view(itemsize, shape, strides, offset): raises HandleError
 * if the view does not lie inside the block. */
static PyObject *block_check_view_py(BlockObject *self, PyObject *args) {
    Py_ssize_t itemsize, offset, start = 0, end = -1, unit = 1;
    PyObject *shape_o, *strides_o;
    npy_intp shape[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    int nd, nd2;
    if (!PyArg_ParseTuple(args, "nOOn|nnn", &itemsize, &shape_o, &strides_o, &offset, &start, &end,
                          &unit))
        return NULL;
    mpc_state *st = mpc_type_state(Py_TYPE(self));
    if (parse_dims(shape_o, shape, &nd, "shape", st->HandleError) < 0 ||
        parse_dims(strides_o, strides, &nd2, "strides", st->HandleError) < 0)
        return NULL;
    if (nd != nd2)
        return PyErr_Format(st->HandleError, "handle has %d sizes but %d strides", nd, nd2);
    for (int i = 0; i < nd; i++)
        if (__builtin_mul_overflow(strides[i], (npy_intp)unit, &strides[i]))
            return PyErr_Format(st->HandleError, "handle has absurd strides");
    if (block_check_view(self, itemsize, nd, shape, strides, offset, start, end) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Block.array(dtype, shape, strides=None, offset=0) -> numpy array over the
 * block (strides in bytes; None means C-contiguous), after a bounds check. */
static PyObject *block_array(BlockObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dtype", "shape", "strides", "offset", NULL};
    PyObject *dtype_o, *shape_o, *strides_o = Py_None;
    Py_ssize_t offset = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|On", kwlist, &dtype_o, &shape_o, &strides_o,
                                     &offset))
        return NULL;
    if (PyArray_ImportNumPyAPI() < 0)
        return NULL;
    mpc_state *st = mpc_type_state(Py_TYPE(self));
    PyArray_Descr *descr = NULL;
    if (!PyArray_DescrConverter(dtype_o, &descr))
        return NULL;
    /* Shared bytes can never be object references: reading them as such
     * would hand out pointers from another process. */
    if (PyDataType_FLAGCHK(descr, NPY_ITEM_REFCOUNT)) {
        PyErr_Format(st->HandleError, "arrays of Python objects cannot live in shared memory");
        goto fail;
    }
    npy_intp shape[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    int nd, nd2;
    if (PyLong_Check(shape_o)) {
        PyObject *one = PyTuple_Pack(1, shape_o);
        int r = one ? parse_dims(one, shape, &nd, "shape", st->HandleError) : -1;
        Py_XDECREF(one);
        if (r < 0)
            goto fail;
    } else if (parse_dims(shape_o, shape, &nd, "shape", st->HandleError) < 0)
        goto fail;
    Py_ssize_t itemsize = PyDataType_ELSIZE(descr);
    if (strides_o == Py_None) {
        npy_intp s = itemsize;
        for (int i = nd - 1; i >= 0; i--) {
            strides[i] = s;
            s *= shape[i] > 0 ? shape[i] : 1;
        }
    } else {
        if (parse_dims(strides_o, strides, &nd2, "strides", st->HandleError) < 0)
            goto fail;
        if (nd2 != nd) {
            PyErr_Format(st->HandleError, "handle has %d sizes but %d strides", nd, nd2);
            goto fail;
        }
    }
    if (block_check_view(self, itemsize, nd, shape, strides, offset, 0, -1) < 0)
        goto fail;
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, nd, shape, strides,
                                         (char *)self->b.addr + offset, NPY_ARRAY_WRITEABLE, NULL);
    if (arr == NULL)
        return NULL; /* descr was stolen */
    PyArray_UpdateFlags((PyArrayObject *)arr, NPY_ARRAY_UPDATE_ALL);
    Py_INCREF(self);
    if (PyArray_SetBaseObject((PyArrayObject *)arr, (PyObject *)self) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
fail:
    Py_XDECREF(descr);
    return NULL;
}

static PyObject *block_get_handle(BlockObject *self, void *c) {
    return Py_BuildValue("(KII)", (unsigned long long)self->b.seg_id, self->b.index, self->b.gen);
}
static PyObject *block_get_nbytes(BlockObject *self, void *c) {
    return PyLong_FromUnsignedLongLong(self->b.length);
}
static PyObject *block_get_address(BlockObject *self, void *c) {
    return PyLong_FromVoidPtr(self->b.addr);
}
static PyObject *block_get_kind(BlockObject *self, void *c) {
    return PyLong_FromUnsignedLong(self->b.kind);
}

static PyObject *block_repr(BlockObject *self) {
    char buf[128];
    snprintf(buf, sizeof buf, "<mpcore Block %016llx:%u gen %u, %llu bytes>",
             (unsigned long long)self->b.seg_id, self->b.index, self->b.gen,
             (unsigned long long)self->b.length);
    return PyUnicode_FromString(buf);
}

static PyMethodDef block_methods[] = {
    {"ticket", (PyCFunction)block_ticket, METH_VARARGS,
     "Takes a ticket that keeps the block alive in transit; returns its reference."},
    {"claim", (PyCFunction)block_claim, METH_NOARGS,
     "In a forked child: turns the ticket its parent took into this process's hold."},
    {"check_view", (PyCFunction)block_check_view_py, METH_VARARGS,
     "check_view(itemsize, shape, strides, offset, start=0, end=-1, unit=1): HandleError\n"
     "unless the view (strides in units of `unit` bytes) lies in bytes [start, end)."},
    {"array", (PyCFunction)(void (*)(void))block_array, METH_VARARGS | METH_KEYWORDS,
     "array(dtype, shape, strides=None, offset=0): a numpy array over the block."},
    {NULL},
};

static PyGetSetDef block_getset[] = {
    {"handle", (getter)block_get_handle, NULL, "(segment id, index, generation)", NULL},
    {"nbytes", (getter)block_get_nbytes, NULL, "usable bytes", NULL},
    {"address", (getter)block_get_address, NULL, "address in this process", NULL},
    {"kind", (getter)block_get_kind, NULL, "1 data, 2 queue", NULL},
    {NULL},
};

static PyMemberDef block_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(BlockObject, weakreflist), READONLY},
    {NULL},
};

static PyType_Slot block_slots[] = {
    {Py_tp_dealloc, block_dealloc},
    {Py_tp_traverse, block_traverse},
    {Py_tp_methods, block_methods},
    {Py_tp_getset, block_getset},
    {Py_tp_members, block_members},
    {Py_tp_repr, block_repr},
    {Py_bf_getbuffer, block_getbuffer},
    {Py_tp_doc, "This process's hold on a block of mpcore shared memory."},
    {0, NULL},
};

static PyType_Spec block_spec = {
    .name = "mpcore._core.Block",
    .basicsize = sizeof(BlockObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = block_slots,
};

/* ---------------------------------------------------------------- */
/* Module functions                                                 */
/* ---------------------------------------------------------------- */

static PyObject *py_alloc(PyObject *m, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"nbytes", "zero", "kind", NULL};
    unsigned long long n;
    int zero = 0;
    unsigned int kind = MPC_BLOCK_DATA;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|pI", kwlist, &n, &zero, &kind))
        return NULL;
    mpc_state *st = mpc_get_state(m);
    mpc_block b;
    int r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_block_alloc(n, kind, zero, &b);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return mpc_py_raise(st, r);
    return block_new_from(st->BlockType, &b);
}

PyObject *mpc_py_block_alloc(mpc_state *st, uint64_t nbytes, void **addr) {
    mpc_block b;
    int r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_block_alloc(nbytes, MPC_BLOCK_DATA, 0, &b);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return mpc_py_raise(st, r);
    *addr = b.addr;
    return block_new_from(st->BlockType, &b);
}

PyObject *mpc_py_block_wrap(mpc_state *st, const mpc_block *b) {
    return block_new_from(st->BlockType, b);
}

/* A new data Block holding a copy of n bytes at src (the GIL released
 * around the copy); NULL with an exception set. */
static PyObject *block_copy_of(mpc_state *st, const void *src, uint64_t n) {
    mpc_block b;
    int r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_block_alloc(n, MPC_BLOCK_DATA, 0, &b);
    if (r == 0)
        mpc_copy(b.addr, src, n);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return mpc_py_raise(st, r);
    return block_new_from(st->BlockType, &b);
}

/* Reads a (segment, index, generation) tuple; -1 with an exception set if
 * it is not three integers in range. */
static int parse_ref(PyObject *t, mpc_ref *ref) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
        PyErr_SetString(PyExc_TypeError, "expected a 3-tuple");
        return -1;
    }
    unsigned long long v[3];
    for (int i = 0; i < 3; i++) {
        PyObject *o = PyTuple_GET_ITEM(t, i);
        if (!PyLong_Check(o)) {
            PyErr_SetString(PyExc_TypeError, "expected integers");
            return -1;
        }
        v[i] = PyLong_AsUnsignedLongLong(o);
        if (PyErr_Occurred() || (i > 0 && v[i] > UINT32_MAX)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_OverflowError, "handle field out of range");
            return -1;
        }
    }
    ref->seg_id = v[0];
    ref->index = (uint32_t)v[1];
    ref->gen = (uint32_t)v[2];
    return 0;
}

/* attach((seg_id, index, gen)) -> Block: redeems a handle's ticket and
 * returns this process's Block for the block.  The fast path runs with the
 * GIL held (NOTE [ One Block object per block ]); only connecting to the
 * keeper and mapping a new segment release it. */
static PyObject *attach_ref(mpc_state *st, mpc_ref ref);

static PyObject *py_attach(PyObject *m, PyObject *h) {
    mpc_ref ref;
    mpc_state *st = mpc_get_state(m);
    if (parse_ref(h, &ref) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(st->HandleError, "corrupt shared-memory handle: expected "
                                             "(segment, index, generation) integers");
        }
        return NULL;
    }
    return attach_ref(st, ref);
}

/* Redeems ref's ticket: returns this process's Block for it (new
 * reference), or NULL with an exception set (the ticket then unredeemed). */
static PyObject *attach_ref(mpc_state *st, mpc_ref ref) {
    mpc_clear_error();
    for (;;) {
        mpc_block b;
        BlockObject *o = block_lookup(ref.seg_id, ref.index, ref.gen);
        int r = mpc_block_attach(&ref, o != NULL, 0, &b);
        if (r == -EAGAIN && o == NULL) {
            Py_BEGIN_ALLOW_THREADS
            r = mpc_segment_prepare(ref.seg_id);
            Py_END_ALLOW_THREADS
            if (r < 0)
                return mpc_py_raise(st, r);
            continue;
        }
        if (r < 0)
            return mpc_py_raise(st, r);
        if (o != NULL)
            return Py_NewRef((PyObject *)o);
        return block_new_from(st->BlockType, &b);
    }
}

static PyObject *py_drop_ticket(PyObject *m, PyObject *args) {
    PyObject *h;
    mpc_ref ref;
    if (!PyArg_ParseTuple(args, "O", &h) || parse_ref(h, &ref) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    mpc_ref_drop(&ref);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* drop_journaled(refs): for each ref, forgets one journaled ticket of that
 * block and drops it (tickets a get took off a queue that unpickling did
 * not redeem; tickets of one block are interchangeable). */
static PyObject *py_drop_journaled(PyObject *m, PyObject *refs) {
    PyObject *fast = PySequence_Fast(refs, "refs must be a sequence");
    if (fast == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        mpc_ref ref;
        if (parse_ref(PySequence_Fast_GET_ITEM(fast, i), &ref) < 0) {
            Py_DECREF(fast);
            return NULL;
        }
        if (mpc_journal_clear(&ref)) {
            Py_BEGIN_ALLOW_THREADS
            mpc_ref_drop(&ref);
            Py_END_ALLOW_THREADS
        }
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

/* find(address, nbytes) -> (Block, offset) for the block held here that
 * contains the range, or None. */
static PyObject *py_forget_idle(PyObject *m, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    mpc_forget_idle();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_find(PyObject *m, PyObject *args) {
    unsigned long long addr, n;
    if (!PyArg_ParseTuple(args, "KK", &addr, &n))
        return NULL;
    mpc_block b;
    if (!mpc_block_find((const void *)(uintptr_t)addr, n ? n : 1, &b))
        Py_RETURN_NONE;
    BlockObject *o = block_lookup(b.seg_id, b.index, b.gen);
    if (o == NULL)
        Py_RETURN_NONE;
    return Py_BuildValue("(OK)", (PyObject *)o, addr - (unsigned long long)(uintptr_t)b.addr);
}

static PyObject *py_live_blocks(PyObject *m, PyObject *unused) {
    PyObject *list = PyList_New(0);
    for (int i = 0; list && i < BLOCK_TABLE; i++)
        for (BlockObject *o = block_table[i]; o; o = o->next)
            if (PyList_Append(list, (PyObject *)o) < 0) {
                Py_CLEAR(list);
                break;
            }
    return list;
}

static PyObject *py_mem_available(PyObject *m, PyObject *unused) {
    uint64_t avail;
    char why[512];
    mpc_clear_error();
    int r = mpc_mem_available(&avail, why, sizeof why);
    if (r < 0)
        return mpc_py_raise(mpc_get_state(m), r);
    return Py_BuildValue("(Ks)", (unsigned long long)avail, why);
}

static PyObject *py_stats(PyObject *m, PyObject *unused) {
    mpc_shm_stats s;
    mpc_shm_get_stats(&s);
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "segments", (unsigned long long)s.segments,
                         "mapped_bytes", (unsigned long long)s.mapped_bytes, "blocks_allocated",
                         (unsigned long long)s.blocks_allocated, "fd_fetches",
                         (unsigned long long)s.fd_fetches, "segments_created",
                         (unsigned long long)s.segments_created, "handles_sent",
                         (unsigned long long)s.tickets, "handles_received",
                         (unsigned long long)s.attaches);
}

static PyObject *py_after_fork_child(PyObject *m, PyObject *unused) {
    mpc_after_fork_child();
    Py_RETURN_NONE;
}

static char **keeper_argv; /* kept for the life of the process */

static PyObject *py_set_keeper_command(PyObject *m, PyObject *arg) {
    char **argv = mpc_py_argv_new(arg);
    if (argv == NULL)
        return NULL;
    /* The previous command may be in use by another thread: leak it. */
    keeper_argv = argv;
    mpc_set_keeper_argv(keeper_argv);
    Py_RETURN_NONE;
}

static PyObject *py_keeper_main(PyObject *m, PyObject *args) {
    int fd, lsock;
    if (!PyArg_ParseTuple(args, "ii", &fd, &lsock))
        return NULL;
    int r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_keeper_main(fd, lsock);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return mpc_py_raise(mpc_get_state(m), r);
    Py_RETURN_NONE;
}

/* ensure_keeper() -> address: connects to the program's keeper, starting
 * it if none runs, without waiting for it. */
static PyObject *py_ensure_keeper(PyObject *m, PyObject *unused) {
    const char *name = NULL;
    int r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_client_connect(&name);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return mpc_py_raise(mpc_get_state(m), r);
    return PyUnicode_FromString(name);
}

/* connect() -> slot: connects to the program's keeper (starting it if
 * none runs) and returns this process's slot. */
static PyObject *py_connect(PyObject *m, PyObject *unused) {
    uint32_t slot;
    int r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_client_slot(&slot);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return mpc_py_raise(mpc_get_state(m), r);
    return PyLong_FromUnsignedLong(slot);
}

/* NOTE [ Tensor records ]
 * A bare tensor put on a Queue (the commonest message of all) travels as a
 * fixed binary record instead of a pickle: pickling it costs a Pickler, a
 * reduction tuple and the unpickler's calls back into Python, which is most
 * of what a 4 KB tensor costs to send.  The record is one block reference
 * (the message's only ref, its ticket taken here) and a header naming the
 * storage's bytes in the block and one strided view of them, in the same
 * terms as the pickled handle (NOTE [ What the fast path carries ] in
 * _torch.py).  Its first byte is never 0x80, the first byte of every pickle
 * a Queue sends, so a getter tells the two apart by the payload alone.
 * The dtype is a small code that the Python layer defines (both ends run
 * the same mpcore); itemsize travels too, so the bounds check needs no
 * Python.  This is the record's one definition. */
#define TREC_MAGIC 0x4854504du /* "MPTH" */
#define TREC_MAXDIM NPY_MAXDIMS
typedef struct {
    uint32_t magic;
    uint32_t ndim;
    uint64_t offset;         /* the storage's first byte in the block */
    uint64_t nbytes;         /* the storage's length */
    int64_t storage_offset;  /* the view's first element in the storage */
    uint32_t dtype;          /* code of the Python layer's table */
    uint32_t itemsize;
    /* then ndim int64 sizes and ndim int64 strides (in elements) */
} trec_header;

/* Builds the record of a view of block b, with a journaled ticket on the
 * block: (refs, payload), or NULL with an exception set (no ticket then).
 * size and stride (in elements) have nd <= TREC_MAXDIM entries. */
static PyObject *trec_build(mpc_state *st, BlockObject *b, uint64_t offset, uint64_t nbytes,
                            uint32_t dtype, uint32_t itemsize, int64_t soff, int nd,
                            const npy_intp *size, const npy_intp *stride) {
    if (offset > b->b.length || nbytes > b->b.length - offset)
        return PyErr_Format(PyExc_ValueError, "bytes [%llu, +%llu) are outside the %llu-byte block",
                            (unsigned long long)offset, (unsigned long long)nbytes,
                            (unsigned long long)b->b.length);
    size_t len = sizeof(trec_header) + 2 * (size_t)nd * sizeof(int64_t);
    PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
    if (payload == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(payload);
    trec_header h = {TREC_MAGIC, (uint32_t)nd, offset, nbytes, soff, dtype, itemsize};
    memcpy(p, &h, sizeof h);
    int64_t *dims = (int64_t *)(p + sizeof h);
    for (int i = 0; i < nd; i++) {
        dims[i] = size[i];
        dims[nd + i] = stride[i];
    }
    mpc_clear_error();
    int r = mpc_block_ticket(&b->b);
    if (r < 0) {
        Py_DECREF(payload);
        return mpc_py_raise(st, r);
    }
    mpc_ref ref = {b->b.seg_id, b->b.index, b->b.gen};
    mpc_journal_add(&ref);
    PyObject *res = Py_BuildValue("([(KII)]N)", (unsigned long long)ref.seg_id, ref.index, ref.gen,
                                  payload);
    if (res == NULL && mpc_journal_clear(&ref)) {
        Py_BEGIN_ALLOW_THREADS
        mpc_ref_drop(&ref);
        Py_END_ALLOW_THREADS
    }
    return res;
}

/* tensor_message(block, offset, nbytes, dtype, itemsize, storage_offset,
 * size, stride) -> (refs, payload): the record of that view of block, with
 * a journaled ticket on the block; None (no ticket) for a view of more
 * than TREC_MAXDIM dimensions.  Raises HandleError for a block no longer
 * live and ValueError for values out of range. */
static PyObject *py_tensor_message(PyObject *m, PyObject *args) {
    mpc_state *st = mpc_get_state(m);
    PyObject *blk, *size_o, *stride_o;
    unsigned long long offset, nbytes;
    unsigned int dtype, itemsize;
    long long soff;
    if (!PyArg_ParseTuple(args, "O!KKIILOO:tensor_message", st->BlockType, &blk, &offset, &nbytes,
                          &dtype, &itemsize, &soff, &size_o, &stride_o))
        return NULL;
    npy_intp size[TREC_MAXDIM], stride[TREC_MAXDIM];
    int nd, nd2;
    PyObject *fs = PySequence_Fast(size_o, "size must be a sequence");
    if (fs == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fs);
    Py_DECREF(fs);
    if (n > TREC_MAXDIM)
        Py_RETURN_NONE;
    if (parse_dims(size_o, size, &nd, "size", NULL) < 0 ||
        parse_dims(stride_o, stride, &nd2, "stride", NULL) < 0)
        return NULL;
    if (nd != nd2)
        return PyErr_Format(PyExc_ValueError, "%d sizes but %d strides", nd, nd2);
    return trec_build(st, (BlockObject *)blk, offset, nbytes, dtype, itemsize, soff, nd, size,
                      stride);
}

/* Reads a message as a tensor record.  Returns 0 if it is not one (nothing
 * redeemed); 1 with *h, *bp (a new reference: the Block, its ticket
 * redeemed), size[] and stride[] (in bytes) filled, the view checked to lie
 * inside the storage's bytes and those inside the block; -1 with
 * HandleError (or another exception) set for a malformed record, its ticket
 * dropped. */
static int trec_open(mpc_state *st, PyObject *refs, PyObject *payload, trec_header *h,
                     BlockObject **bp, npy_intp *size, npy_intp *stride) {
    if (!PyBytes_Check(payload) || PyBytes_GET_SIZE(payload) < (Py_ssize_t)sizeof *h)
        return 0;
    const char *p = PyBytes_AS_STRING(payload);
    memcpy(h, p, sizeof *h);
    if (h->magic != TREC_MAGIC)
        return 0;
    if (!PyList_Check(refs) || PyList_GET_SIZE(refs) != 1) {
        PyErr_Format(st->HandleError, "tensor record with %zd refs, not 1",
                     PyList_Check(refs) ? PyList_GET_SIZE(refs) : (Py_ssize_t)-1);
        return -1;
    }
    mpc_ref ref;
    if (parse_ref(PyList_GET_ITEM(refs, 0), &ref) < 0)
        return -1;
    BlockObject *b = NULL;
    if (h->ndim > TREC_MAXDIM ||
        (size_t)PyBytes_GET_SIZE(payload) != sizeof *h + 2 * (size_t)h->ndim * sizeof(int64_t)) {
        PyErr_Format(st->HandleError, "corrupt tensor record (%u dimensions, %zd bytes)", h->ndim,
                     PyBytes_GET_SIZE(payload));
        goto drop;
    }
    b = (BlockObject *)attach_ref(st, ref);
    if (b == NULL)
        goto drop;
    int nd = (int)h->ndim;
    const int64_t *dims = (const int64_t *)(p + sizeof *h);
    for (int i = 0; i < nd; i++) {
        size[i] = (npy_intp)dims[i];
        if (__builtin_mul_overflow((npy_intp)dims[nd + i], (npy_intp)h->itemsize, &stride[i])) {
            PyErr_SetString(st->HandleError, "tensor record has absurd strides");
            goto fail;
        }
    }
    npy_intp first;
    if (h->offset > b->b.length || h->nbytes > b->b.length - h->offset ||
        __builtin_mul_overflow((npy_intp)h->storage_offset, (npy_intp)h->itemsize, &first) ||
        __builtin_add_overflow(first, (npy_intp)h->offset, &first)) {
        PyErr_Format(st->HandleError, "tensor record names bytes outside its %llu-byte block",
                     (unsigned long long)b->b.length);
        goto fail;
    }
    if (block_check_view(b, (Py_ssize_t)h->itemsize, nd, size, stride, (Py_ssize_t)first,
                         (Py_ssize_t)h->offset, (Py_ssize_t)(h->offset + h->nbytes)) < 0)
        goto fail;
    *bp = b;
    return 1;
fail:
    Py_DECREF(b);
    return -1;
drop:
    if (mpc_journal_clear(&ref)) {
        Py_BEGIN_ALLOW_THREADS
        mpc_ref_drop(&ref);
        Py_END_ALLOW_THREADS
    }
    return -1;
}

/* A tuple of nd integers, each vals[i] / unit; NULL with an exception set. */
static PyObject *dims_tuple(int nd, const npy_intp *vals, npy_intp unit) {
    PyObject *t = PyTuple_New(nd);
    if (t == NULL)
        return NULL;
    for (int i = 0; i < nd; i++) {
        PyObject *v = PyLong_FromSsize_t((Py_ssize_t)(vals[i] / unit));
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

/* NOTE [ Tensor records in C ]
 * The per-item path of a bare tensor on a Queue (NOTE [ The per-item path
 * of a tensor ] in _tensormsg.py) is two calls: tensor_record(t) on the put
 * side and tensor_from_record(refs, payload) on the get side.  The build
 * does not link libtorch, so both reach torch only through the Python
 * objects _tensormsg hands over once (torch_hooks()); what they save is the
 * Python around those calls: about a dozen frames, lookups and tuples an
 * item, most of what a 4 KB tensor cost once the ring itself was cheap.
 *
 * The get side also makes the tensor in one step where it can.  A fresh
 * tensor (nearly every put) is a view that starts at its storage's first
 * element and ends at its last byte; for such a view, with a dtype numpy
 * has, torch.from_numpy of an array with the view's dtype, shape and
 * strides gives a tensor whose storage is exactly the storage's bytes, as
 * set_() over a byte storage would, for one torch call instead of four
 * (from_numpy, untyped_storage, new, set_) and one tensor less to free.  A
 * byte range seen before in this process keeps its one storage (NOTE
 * [ Storage identity ] in _torch.py), so it, and every other view, takes
 * set_() over that storage. */
static struct {
    PyObject *tensor_type;       /* torch.Tensor: records carry only that class */
    PyObject *dispatch_keys;     /* torch._C._dispatch_keys */
    PyObject *plain_keys;        /* tuple: key sets of plain tensors (_torch.fast_path) */
    PyObject *codes;             /* dict: dtype -> (code, itemsize) */
    PyObject *descrs;            /* tuple: code -> numpy dtype that from_numpy takes, or None */
    PyObject *proto;             /* callable: code -> empty tensor (HandleError if corrupt) */
    PyObject *from_numpy;        /* torch.from_numpy */
    PyObject *storages;          /* _torch._storages: key -> weak reference */
    PyObject *new_with_weak_ptr; /* torch.UntypedStorage._new_with_weak_ptr */
    PyObject *free_weak_ref;     /* torch.UntypedStorage._free_weak_ref */
    PyObject *expired;           /* torch.UntypedStorage._expired */
    PyObject *swap;              /* torch.UntypedStorage._swap_data_ptr_, or None where torch
                                  * lacks it: then nothing is moved in place */
    PyObject *counts;            /* _stats._counts: "storages_shared" counts the moves */
    Py_ssize_t limit;            /* prune once storages holds twice this many */
    PyObject *protos;            /* list: code -> proto's result, None until asked */
    Py_ssize_t *itemsizes;       /* code -> the itemsize of its proto, once in protos */
} trec_torch;

static PyObject *s_requires_grad, *s_dtype, *s_shape, *s_stride, *s_storage_offset,
    *s_untyped_storage, *s_nbytes, *s_data_ptr, *s_new, *s_set_, *s_weak_ref,
    *s_storages_shared;

static int trec_intern(void) {
    if (s_set_ != NULL)
        return 0;
#define TREC_INTERN(v, name) if ((v = PyUnicode_InternFromString(name)) == NULL) return -1
    TREC_INTERN(s_requires_grad, "requires_grad");
    TREC_INTERN(s_dtype, "dtype");
    TREC_INTERN(s_shape, "shape");
    TREC_INTERN(s_stride, "stride");
    TREC_INTERN(s_storage_offset, "storage_offset");
    TREC_INTERN(s_untyped_storage, "untyped_storage");
    TREC_INTERN(s_nbytes, "nbytes");
    TREC_INTERN(s_data_ptr, "data_ptr");
    TREC_INTERN(s_new, "new");
    TREC_INTERN(s_weak_ref, "_weak_ref");
    TREC_INTERN(s_storages_shared, "storages_shared");
    TREC_INTERN(s_set_, "set_"); /* last: trec_intern() is done once it is set */
#undef TREC_INTERN
    return 0;
}

/* torch_hooks(tensor_type, dispatch_keys, plain_keys, codes, descrs, proto,
 * from_numpy, storages, new_with_weak_ptr, free_weak_ref, expired, counts,
 * swap): the torch objects of NOTE [ Tensor records in C ], as _tensormsg
 * reads them through _torchapi's table.  swap is None where torch cannot
 * move a storage in place: tensor_record then records only tensors already
 * in a block, and move_storage raises.  Called once torch is imported;
 * calling it again replaces them.  On a bad argument, TypeError and
 * nothing changed. */

static PyObject *py_torch_hooks(PyObject *m, PyObject *args) {
    PyObject *o[13];
    if (!PyArg_ParseTuple(args, "OOO!O!O!OOO!OOOO!O:torch_hooks", &o[0], &o[1], &PyTuple_Type,
                          &o[2], &PyDict_Type, &o[3], &PyTuple_Type, &o[4], &o[5], &o[6],
                          &PyDict_Type, &o[7], &o[8], &o[9], &o[10], &PyDict_Type, &o[11],
                          &o[12]))
        return NULL;
    if (o[12] != Py_None && !PyCallable_Check(o[12]))
        return PyErr_Format(PyExc_TypeError, "torch_hooks(): swap must be callable or None");
    if (trec_intern() < 0 || PyArray_ImportNumPyAPI() < 0)
        return NULL;
    PyObject **slot[13] = {&trec_torch.tensor_type, &trec_torch.dispatch_keys,
                           &trec_torch.plain_keys, &trec_torch.codes, &trec_torch.descrs,
                           &trec_torch.proto, &trec_torch.from_numpy, &trec_torch.storages,
                           &trec_torch.new_with_weak_ptr, &trec_torch.free_weak_ref,
                           &trec_torch.expired, &trec_torch.counts, &trec_torch.swap};
    for (int i = 0; i < 13; i++)
        Py_XSETREF(*slot[i], Py_NewRef(o[i]));
    trec_torch.limit = 1024;
    Py_CLEAR(trec_torch.protos);
    PyMem_Free(trec_torch.itemsizes);
    trec_torch.itemsizes = NULL;
    Py_RETURN_NONE;
}

/* A new numpy array over bytes of block b from `offset` (NULL with an
 * exception set); steals descr.  The array holds the Block. */
static PyObject *trec_array(BlockObject *b, PyArray_Descr *descr, int nd, npy_intp *shape,
                            npy_intp *strides, uint64_t offset) {
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, nd, shape, strides,
                                         (char *)b->b.addr + offset, NPY_ARRAY_WRITEABLE, NULL);
    if (arr == NULL)
        return NULL;
    PyArray_UpdateFlags((PyArrayObject *)arr, NPY_ARRAY_UPDATE_ALL);
    if (PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef((PyObject *)b)) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

/* The key of _torch._storages for bytes [offset, offset + nbytes) of b. */
static PyObject *trec_key(BlockObject *b, uint64_t offset, uint64_t nbytes) {
    return Py_BuildValue("((KII)KK)", (unsigned long long)b->b.seg_id, b->b.index, b->b.gen,
                         (unsigned long long)offset, (unsigned long long)nbytes);
}

/* A new untyped storage over bytes [offset, offset + nbytes) of b, made
 * with torch.from_numpy (the storage holds the Block); NULL with an
 * exception set. */
static PyObject *trec_byte_storage(BlockObject *b, uint64_t offset, uint64_t nbytes) {
    npy_intp n = (npy_intp)nbytes;
    PyObject *arr = trec_array(b, PyArray_DescrFromType(NPY_UINT8), 1, &n, NULL, offset);
    if (arr == NULL)
        return NULL;
    PyObject *t = PyObject_CallOneArg(trec_torch.from_numpy, arr);
    Py_DECREF(arr);
    if (t == NULL)
        return NULL;
    PyObject *s = PyObject_CallMethodNoArgs(t, s_untyped_storage);
    Py_DECREF(t);
    return s;
}

/* NOTE [ Storage entries go with their block ]
 * _torch._storages keeps torch's weak reference to each storage this
 * process made over a block or moved into one (NOTE [ Storage identity ] in
 * _torch.py).  Such a reference keeps the storage's StorageImpl, a small
 * allocation of the C heap, until it is freed.  Every one of those storages
 * holds its block's one Block object (through the numpy array that
 * torch.from_numpy keeps), so once the Block object is freed, every storage
 * over it is gone: its entries (the Block keeps their keys) are dropped
 * then and their references freed.  That happens inside the last storage's
 * release, while torch still counts the storage's own weak reference, so
 * freeing ours there never frees the StorageImpl under torch.  Entries
 * whose storage went while its Block lives on (held by another storage or
 * by Python) are pruned once the table has doubled.
 *
 * Why it matters: one small chunk pinned per tensor that a loop makes and
 * moves fragments the heap.  The next tensor's small allocations split the
 * large chunk the move has just freed (the tensor's old memory); the next
 * large tensor no longer fits there and comes from fresh pages at the top
 * of the heap, so every item faults its whole size in and the process grows
 * by that size per item.  With entries pruned only at doubling, a producer
 * of 16 MB tensors grew by 5 GB in 300 items; with the entries of the last
 * two moves dropped at the next move (this note's predecessor), a process
 * holding eight such tensors at once still grew by about 110 MB a round of
 * eight, and one holding sixteen ran out of memory at 24 GB. */

/* Drops key's entry of _torch._storages and frees its reference; with
 * expect, only if the entry still holds that very reference.  0 (also when
 * there is no such entry), or -1 with an exception set. */
static int trec_drop_entry(PyObject *key, PyObject *expect) {
    PyObject *ref = PyDict_GetItemWithError(trec_torch.storages, key); /* borrowed */
    if (ref == NULL || (expect != NULL && ref != expect))
        return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(ref);
    PyObject *x = PyDict_DelItem(trec_torch.storages, key) < 0
                      ? NULL : PyObject_CallOneArg(trec_torch.free_weak_ref, ref);
    Py_DECREF(ref);
    int r = x == NULL ? -1 : 0;
    Py_XDECREF(x);
    return r;
}

/* Drops the entries of _torch._storages whose storage is gone and frees
 * their references; returns how many entries are left, or -1 with an
 * exception set.  It works on a copy of the items and drops an entry only
 * if it still holds the reference found expired: a Block freed meanwhile
 * (by a collection that the copy's allocation ran) has dropped its own. */
static Py_ssize_t trec_prune(void) {
    PyObject *items = PyDict_Items(trec_torch.storages);
    if (items == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        PyObject *ref = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
        PyObject *e = PyObject_CallOneArg(trec_torch.expired, ref);
        int gone = e == NULL ? -1 : PyObject_IsTrue(e);
        Py_XDECREF(e);
        if (gone < 0 || (gone && trec_drop_entry(key, ref) < 0)) {
            Py_DECREF(items);
            return -1;
        }
    }
    Py_DECREF(items);
    return PyDict_GET_SIZE(trec_torch.storages);
}

/* Records storage, made over b or moved into it, as the one of its key,
 * and the key as one of b's (NOTE [ Storage entries go with their block ]);
 * the expired entries are pruned (trec_prune) once the table has doubled
 * since the last pruning.  0, or -1 with an exception set. */
static int trec_remember(BlockObject *b, PyObject *key, PyObject *storage) {
    if (b->keys == NULL && (b->keys = PyList_New(0)) == NULL)
        return -1;
    int known = PySequence_Contains(b->keys, key);
    if (known < 0 || (!known && PyList_Append(b->keys, key) < 0))
        return -1;
    PyObject *ref = PyObject_CallMethodNoArgs(storage, s_weak_ref);
    if (ref == NULL)
        return -1;
    PyObject *old = PyDict_GetItemWithError(trec_torch.storages, key); /* borrowed */
    Py_XINCREF(old);
    int r = old == NULL && PyErr_Occurred() ? -1 : PyDict_SetItem(trec_torch.storages, key, ref);
    Py_DECREF(ref);
    if (old != NULL) {
        PyObject *x = PyObject_CallOneArg(trec_torch.free_weak_ref, old);
        Py_DECREF(old);
        Py_XDECREF(x);
        if (x == NULL)
            r = -1;
    }
    if (r == 0 && PyDict_GET_SIZE(trec_torch.storages) >= 2 * trec_torch.limit) {
        Py_ssize_t left = trec_prune();
        if (left < 0)
            return -1;
        trec_torch.limit = left > 1024 ? left : 1024;
    }
    return r;
}

/* Drops the entries of _torch._storages that were made for self, which is
 * being freed (NOTE [ Storage entries go with their block ]).  Never
 * fails: an error is reported as unraisable, and an exception already set
 * is kept. */
static void trec_forget_block(BlockObject *self) {
    PyObject *keys = self->keys;
    if (keys == NULL)
        return;
    self->keys = NULL;
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
#endif
    for (Py_ssize_t i = 0; trec_torch.storages != NULL && i < PyList_GET_SIZE(keys); i++)
        if (trec_drop_entry(PyList_GET_ITEM(keys, i), NULL) < 0)
            PyErr_WriteUnraisable(NULL);
    Py_DECREF(keys);
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(et, ev, etb);
#endif
}

/* Counts a storage moved into shared memory in _stats; 0, or -1 with an
 * exception set. */
static int trec_count_move(void) {
    PyObject *c = PyDict_GetItemWithError(trec_torch.counts, s_storages_shared);
    if (c == NULL && PyErr_Occurred())
        return -1;
    long long v = c == NULL ? 0 : PyLong_AsLongLong(c);
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *nv = PyLong_FromLongLong(v + 1);
    if (nv == NULL)
        return -1;
    int r = PyDict_SetItem(trec_torch.counts, s_storages_shared, nv);
    Py_DECREF(nv);
    return r;
}

/* Reads an integer method result (nbytes(), data_ptr(), ...) of o into *v;
 * 0, or -1 with an exception set. */
static int trec_call_ll(PyObject *o, PyObject *name, long long *v) {
    PyObject *r = PyObject_CallMethodNoArgs(o, name);
    if (r == NULL)
        return -1;
    *v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Reads a tuple of at most TREC_MAXDIM integers (torch.Size or a stride
 * tuple) into out; returns its length, TREC_MAXDIM + 1 if longer, or -1
 * with an exception set. */
static int trec_read_dims(PyObject *t, npy_intp *out) {
    if (!PyTuple_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "expected a tuple of dimensions");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    if (n > TREC_MAXDIM)
        return TREC_MAXDIM + 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = (npy_intp)PyLong_AsSsize_t(PyTuple_GET_ITEM(t, i));
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return (int)n;
}

/* Moves storage (nbytes at ptr) into a new block in place (NOTE [ Moving a
 * storage in place ] in _torch.py): returns the Block (new reference), or
 * NULL with an exception set, the storage then unchanged. */
static PyObject *trec_move(mpc_state *st, PyObject *storage, long long ptr, uint64_t nbytes) {
    BlockObject *b = (BlockObject *)block_copy_of(st, (const void *)(uintptr_t)ptr, nbytes);
    if (b == NULL)
        return NULL;
    PyObject *key = NULL, *res, *tmp = trec_byte_storage(b, 0, nbytes);
    if (tmp == NULL)
        goto fail;
    res = PyObject_CallFunctionObjArgs(trec_torch.swap, storage, tmp, NULL);
    Py_DECREF(tmp); /* takes the storage's old memory away with it */
    if (res == NULL)
        goto fail;
    Py_DECREF(res);
    key = trec_key(b, 0, nbytes);
    if (key == NULL || trec_remember(b, key, storage) < 0)
        goto fail;
    Py_CLEAR(key);
    if (trec_count_move() < 0)
        goto fail;
    return (PyObject *)b;
fail:
    Py_XDECREF(key);
    Py_DECREF(b);
    return NULL;
}

/* move_storage(storage) -> Block: moves a CPU storage that is in no block
 * into a new one in place, as tensor_record does (trec_move), for the
 * pickle path (_torch._move).  ValueError for an empty storage;
 * MemoryError when out of shared memory, the storage then unchanged. */
static PyObject *py_move_storage(PyObject *m, PyObject *storage) {
    if (trec_torch.storages == NULL)
        return PyErr_Format(PyExc_RuntimeError, "move_storage() before torch_hooks()");
    if (trec_torch.swap == Py_None)
        return PyErr_Format(PyExc_RuntimeError, "move_storage(): this torch cannot move a "
                            "storage in place (it lacks UntypedStorage._swap_data_ptr_)");
    long long nbytes, ptr;
    if (trec_call_ll(storage, s_nbytes, &nbytes) < 0 || trec_call_ll(storage, s_data_ptr, &ptr) < 0)
        return NULL;
    if (nbytes <= 0)
        return PyErr_Format(PyExc_ValueError, "move_storage() of an empty storage");
    return trec_move(mpc_get_state(m), storage, ptr, (uint64_t)nbytes);
}

/* tensor_record(t) -> (refs, payload) of the tensor record of t (its
 * storage moved into a block first if it is not in one, as pickling would),
 * with a journaled ticket on the block; None, having changed nothing, when
 * t must be pickled instead: not of the base class, requires grad, not
 * plain (NOTE [ What the fast path carries ] in _torch.py), empty storage,
 * a dtype without a code, more than TREC_MAXDIM dimensions.  Raises what
 * torch or the allocation raised (MemoryError when out of shared memory). */
static PyObject *py_tensor_record(PyObject *m, PyObject *t) {
    mpc_state *st = mpc_get_state(m);
    if (trec_torch.tensor_type == NULL)
        return PyErr_Format(PyExc_RuntimeError, "tensor_record() before torch_hooks()");
    if ((PyObject *)Py_TYPE(t) != trec_torch.tensor_type)
        Py_RETURN_NONE;
    PyObject *o = PyObject_GetAttr(t, s_requires_grad);
    if (o == NULL)
        return NULL;
    int v = PyObject_IsTrue(o);
    Py_DECREF(o);
    if (v != 0)
        return v < 0 ? NULL : Py_NewRef(Py_None);
    o = PyObject_CallOneArg(trec_torch.dispatch_keys, t);
    if (o == NULL)
        return NULL;
    v = PySequence_Contains(trec_torch.plain_keys, o);
    Py_DECREF(o);
    if (v != 1)
        return v < 0 ? NULL : Py_NewRef(Py_None);
    o = PyObject_GetAttr(t, s_dtype);
    if (o == NULL)
        return NULL;
    PyObject *ci = PyDict_GetItemWithError(trec_torch.codes, o); /* borrowed */
    Py_DECREF(o);
    if (ci == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    unsigned int code, itemsize;
    if (!PyArg_ParseTuple(ci, "II", &code, &itemsize))
        return NULL;

    npy_intp size[TREC_MAXDIM], stride[TREC_MAXDIM];
    int nd, nd2;
    o = PyObject_GetAttr(t, s_shape); /* cheaper than size(): no argument parsing */
    if (o == NULL)
        return NULL;
    nd = trec_read_dims(o, size);
    Py_DECREF(o);
    if (nd < 0)
        return NULL;
    if (nd > TREC_MAXDIM)
        Py_RETURN_NONE;
    o = PyObject_CallMethodNoArgs(t, s_stride);
    if (o == NULL)
        return NULL;
    nd2 = trec_read_dims(o, stride);
    Py_DECREF(o);
    if (nd2 < 0)
        return NULL;
    if (nd2 != nd)
        return PyErr_Format(PyExc_ValueError, "%d sizes but %d strides", nd, nd2);
    long long soff, nbytes, ptr;
    if (trec_call_ll(t, s_storage_offset, &soff) < 0)
        return NULL;

    PyObject *storage = PyObject_CallMethodNoArgs(t, s_untyped_storage);
    if (storage == NULL)
        return NULL;
    PyObject *res = NULL, *blk = NULL;
    if (trec_call_ll(storage, s_nbytes, &nbytes) < 0 || trec_call_ll(storage, s_data_ptr, &ptr) < 0)
        goto done;
    if (nbytes <= 0) {
        res = Py_NewRef(Py_None);
        goto done;
    }
    uint64_t off = 0;
    mpc_block found;
    BlockObject *bo;
    if (mpc_block_find((const void *)(uintptr_t)ptr, (uint64_t)nbytes, &found) &&
        (bo = block_lookup(found.seg_id, found.index, found.gen)) != NULL) {
        blk = Py_NewRef((PyObject *)bo);
        off = (uint64_t)ptr - (uint64_t)(uintptr_t)found.addr;
    } else if (trec_torch.swap == Py_None) {
        res = Py_NewRef(Py_None); /* no move in place on this torch: pickled by torch's way */
        goto done;
    } else if ((blk = trec_move(st, storage, ptr, (uint64_t)nbytes)) == NULL) {
        goto done;
    }
    res = trec_build(st, (BlockObject *)blk, off, (uint64_t)nbytes, code, itemsize, soff, nd, size,
                     stride);
done:
    Py_XDECREF(blk);
    Py_DECREF(storage);
    return res;
}

/* The empty tensor of a dtype code (a new reference), from the proto hook
 * once per code, with its itemsize in *itemsize; NULL with an exception set
 * (HandleError for a code that names no dtype). */
static PyObject *trec_proto(uint32_t code, Py_ssize_t *itemsize) {
    Py_ssize_t n = PyTuple_GET_SIZE(trec_torch.descrs); /* one entry per code */
    if (code < (uint32_t)n && trec_torch.protos != NULL) {
        PyObject *p = PyList_GET_ITEM(trec_torch.protos, code);
        if (p != Py_None) {
            *itemsize = trec_torch.itemsizes[code];
            return Py_NewRef(p);
        }
    }
    PyObject *c = PyLong_FromUnsignedLong(code);
    PyObject *p = c ? PyObject_CallOneArg(trec_torch.proto, c) : NULL;
    Py_XDECREF(c);
    if (p == NULL)
        return NULL;
    PyObject *isz = PyObject_GetAttrString(p, "itemsize");
    *itemsize = isz ? PyLong_AsSsize_t(isz) : -1;
    Py_XDECREF(isz);
    if (*itemsize < 0 || code >= (uint32_t)n) {
        if (*itemsize < 0) {
            Py_CLEAR(p);
        }
        return p;
    }
    if (trec_torch.protos == NULL) {
        trec_torch.itemsizes = PyMem_Calloc((size_t)n, sizeof(Py_ssize_t));
        trec_torch.protos = trec_torch.itemsizes ? PyList_New(n) : PyErr_NoMemory();
        if (trec_torch.protos == NULL) {
            PyMem_Free(trec_torch.itemsizes);
            trec_torch.itemsizes = NULL;
            Py_DECREF(p);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            PyList_SET_ITEM(trec_torch.protos, i, Py_NewRef(Py_None));
    }
    trec_torch.itemsizes[code] = *itemsize;
    PyList_SetItem(trec_torch.protos, code, Py_NewRef(p)); /* steals; cannot fail */
    return p;
}

/* The storage for bytes [offset, offset + nbytes) of b that this process
 * already has (NOTE [ Storage identity ]): a new reference, NULL (no
 * exception) if there is none, or NULL with an exception set. */
static PyObject *trec_lookup(PyObject *key) {
    PyObject *ref = PyDict_GetItemWithError(trec_torch.storages, key); /* borrowed */
    if (ref == NULL)
        return NULL;
    Py_INCREF(ref);
    PyObject *s = PyObject_CallOneArg(trec_torch.new_with_weak_ptr, ref);
    Py_DECREF(ref);
    if (s == Py_None)
        Py_CLEAR(s);
    return s;
}

/* storage_over(block, offset, nbytes) -> the untyped storage over those
 * bytes of block: the one this process has for them (NOTE [ Storage
 * identity ] in _torch.py), else a new one, remembered.  HandleError when
 * the bytes do not lie inside the block. */
static PyObject *py_storage_over(PyObject *m, PyObject *args) {
    mpc_state *st = mpc_get_state(m);
    BlockObject *b;
    Py_ssize_t offset, nbytes;
    if (!PyArg_ParseTuple(args, "O!nn:storage_over", st->BlockType, &b, &offset, &nbytes))
        return NULL;
    if (trec_torch.storages == NULL)
        return PyErr_Format(PyExc_RuntimeError, "storage_over() before torch_hooks()");
    npy_intp n = (npy_intp)nbytes, one = 1;
    if (block_check_view(b, 1, 1, &n, &one, offset, 0, -1) < 0)
        return NULL;
    PyObject *key = trec_key(b, (uint64_t)offset, (uint64_t)nbytes);
    if (key == NULL)
        return NULL;
    PyObject *s = trec_lookup(key);
    if (s == NULL && !PyErr_Occurred()) {
        s = trec_byte_storage(b, (uint64_t)offset, (uint64_t)nbytes);
        if (s != NULL && trec_remember(b, key, s) < 0)
            Py_CLEAR(s);
    }
    Py_DECREF(key);
    return s;
}

/* tensor_from_record(refs, payload) -> None if the message is not a tensor
 * record, else the tensor it carries (its ticket redeemed): a view of the
 * one storage of its byte range in this process (NOTE [ Tensor records in
 * C ]).  A malformed record raises HandleError, its ticket dropped. */
static PyObject *py_tensor_from_record(PyObject *m, PyObject *args) {
    mpc_state *st = mpc_get_state(m);
    PyObject *refs, *payload;
    if (!PyArg_ParseTuple(args, "OO:tensor_from_record", &refs, &payload))
        return NULL;
    if (trec_torch.tensor_type == NULL)
        return PyErr_Format(PyExc_RuntimeError, "tensor_from_record() before torch_hooks()");
    trec_header h;
    BlockObject *b;
    npy_intp size[TREC_MAXDIM], stride[TREC_MAXDIM];
    int r = trec_open(st, refs, payload, &h, &b, size, stride);
    if (r <= 0)
        return r == 0 ? Py_NewRef(Py_None) : NULL;
    int nd = (int)h.ndim;
    PyObject *res = NULL, *s = NULL, *key = trec_key(b, h.offset, h.nbytes);
    if (key == NULL)
        goto done;
    s = trec_lookup(key);
    if (s == NULL && PyErr_Occurred())
        goto done;
    if (s == NULL && h.storage_offset == 0 && h.dtype < (uint32_t)PyTuple_GET_SIZE(trec_torch.descrs)) {
        PyObject *d = PyTuple_GET_ITEM(trec_torch.descrs, h.dtype);
        /* The view's last byte, when it starts at the storage's first. */
        int direct = d != Py_None && PyArray_DescrCheck(d) &&
                     PyDataType_ELSIZE((PyArray_Descr *)d) == (npy_intp)h.itemsize;
        uint64_t end = h.itemsize;
        for (int i = 0; direct && i < nd; i++) {
            if (size[i] == 0 || stride[i] < 0)
                direct = 0;
            else
                end += (uint64_t)(size[i] - 1) * (uint64_t)stride[i];
        }
        if (direct && end == h.nbytes) {
            Py_INCREF(d);
            PyObject *arr = trec_array(b, (PyArray_Descr *)d, nd, size, stride, h.offset);
            if (arr == NULL)
                goto done;
            PyObject *t = PyObject_CallOneArg(trec_torch.from_numpy, arr);
            Py_DECREF(arr);
            if (t == NULL)
                goto done;
            s = PyObject_CallMethodNoArgs(t, s_untyped_storage);
            if (s == NULL || trec_remember(b, key, s) < 0) {
                Py_DECREF(t);
                goto done;
            }
            res = t;
            goto done;
        }
    }
    if (s == NULL) {
        s = trec_byte_storage(b, h.offset, h.nbytes);
        if (s == NULL || trec_remember(b, key, s) < 0)
            goto done;
    }
    Py_ssize_t itemsize;
    PyObject *proto = trec_proto(h.dtype, &itemsize);
    if (proto == NULL)
        goto done;
    if (itemsize != (Py_ssize_t)h.itemsize) {
        /* The view was checked with the record's itemsize: it must be the
         * dtype's. */
        Py_DECREF(proto);
        PyErr_Format(st->HandleError, "tensor record says %u-byte items for a dtype of %zd",
                     h.itemsize, itemsize);
        goto done;
    }
    PyObject *t = PyObject_CallMethodNoArgs(proto, s_new);
    Py_DECREF(proto);
    if (t == NULL)
        goto done;
    PyObject *so = PyLong_FromLongLong((long long)h.storage_offset);
    PyObject *sz = dims_tuple(nd, size, 1);
    PyObject *sd = dims_tuple(nd, stride, (npy_intp)h.itemsize);
    if (so && sz && sd)
        res = PyObject_CallMethodObjArgs(t, s_set_, s, so, sz, sd, NULL);
    Py_XDECREF(so);
    Py_XDECREF(sz);
    Py_XDECREF(sd);
    Py_DECREF(t);
done:
    Py_XDECREF(s);
    Py_XDECREF(key);
    Py_DECREF(b);
    return res;
}

static PyObject *py_keeper_pid(PyObject *m, PyObject *unused) {
    return PyLong_FromLong((long)mpc_keeper_pid());
}

PyMethodDef mpc_py_shm_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))py_alloc, METH_VARARGS | METH_KEYWORDS,
     "alloc(nbytes, zero=False, kind=1) -> Block"},
    {"attach", py_attach, METH_O, "attach(handle) -> Block: redeems a handle's ticket"},
    {"live_blocks", py_live_blocks, METH_NOARGS, "live_blocks() -> the Blocks held here"},
    {"drop_ticket", py_drop_ticket, METH_VARARGS, "drop_ticket(handle): drops a ticket unused"},
    {"drop_journaled", py_drop_journaled, METH_O,
     "drop_journaled(refs): drops those of the tickets still in this process's journal"},
    {"forget_idle", py_forget_idle, METH_NOARGS,
     "forget_idle(): unmaps others' segments in which this process holds nothing"},
    {"find", py_find, METH_VARARGS, "find(address, nbytes) -> ((seg, index, gen), base) or None"},
    {"mem_available", py_mem_available, METH_NOARGS,
     "mem_available() -> (bytes, which bound): what this process may still commit"},
    {"stats", py_stats, METH_NOARGS, "counters of this process's shared memory"},
    {"after_fork_child", py_after_fork_child, METH_NOARGS, "resets per-process state in a child"},
    {"set_keeper_command", py_set_keeper_command, METH_O,
     "set_keeper_command(argv): how to start the keeper when none runs"},
    {"keeper_main", py_keeper_main, METH_VARARGS,
     "keeper_main(fd, listen_fd): runs the keeper"},
    {"ensure_keeper", py_ensure_keeper, METH_NOARGS,
     "ensure_keeper() -> address: connects to (or starts) this program's keeper"},
    {"connect", py_connect, METH_NOARGS, "connect() -> slot"},
    {"keeper_pid", py_keeper_pid, METH_NOARGS, "pid of the keeper this process started, or 0"},
    {"tensor_message", py_tensor_message, METH_VARARGS,
     "tensor_message(block, offset, nbytes, dtype, itemsize, storage_offset, size, stride)\n"
     "-> (refs, payload): a Queue message carrying that view of block as a tensor record"},
    {"torch_hooks", py_torch_hooks, METH_VARARGS,
     "torch_hooks(tensor_type, dispatch_keys, plain_keys, codes, descrs, proto, from_numpy,\n"
     "storages, new_with_weak_ptr, free_weak_ref, expired, counts, swap): torch's objects for\n"
     "tensor records (swap None: nothing is moved in place)"},
    {"storage_over", py_storage_over, METH_VARARGS,
     "storage_over(block, offset, nbytes) -> the one storage over those bytes here"},
    {"move_storage", py_move_storage, METH_O,
     "move_storage(storage) -> Block: the storage moved into a new block in place"},
    {"tensor_record", py_tensor_record, METH_O,
     "tensor_record(t) -> (refs, payload) of t's tensor record, or None: pickle it"},
    {"tensor_from_record", py_tensor_from_record, METH_VARARGS,
     "tensor_from_record(refs, payload) -> the tensor of a tensor record, or None"},
    {NULL},
};

int mpc_py_shm_exec(PyObject *m, mpc_state *st) {
    st->BlockType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &block_spec, NULL);
    if (st->BlockType == NULL)
        return -1;
    if (PyModule_AddObjectRef(m, "Block", (PyObject *)st->BlockType) < 0)
        return -1;
    uint32_t magic = TREC_MAGIC;
    PyObject *tag = PyBytes_FromStringAndSize((const char *)&magic, sizeof magic);
    if (tag == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "TENSOR_RECORD_TAG", tag);
    Py_DECREF(tag);
    return r;
}
