/* py_block.c: mpcore._core.Block, this process's hold on one block of
 * shared memory: the hold is dropped when the object is freed, and numpy
 * arrays (and, through them, torch storages) made over the block keep it
 * alive as their base.  It owns the table of every Block object of this
 * process (NOTE [ One Block object per block ]), views over a block and
 * their bounds, and the module functions that make, redeem and find
 * Blocks (alloc, attach, find, live_blocks).  It knows nothing of torch:
 * the torch side (py_tensor.c) keeps its own entries on a Block and is
 * told when one is freed (mpc_py_block_set_forget). */
#include "py_mpcore.h"

#include <structmember.h>
#include <numpy/arrayobject.h>
#include <numpy/npy_2_compat.h>
#include <string.h>

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

BlockObject *mpc_py_block_lookup(uint64_t seg, uint32_t index, uint32_t gen) {
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

/* What a Block's dealloc calls first, once the torch side has set it
 * (mpc_py_block_set_forget). */
static void (*block_forget)(BlockObject *);

void mpc_py_block_set_forget(void (*fn)(BlockObject *)) { block_forget = fn; }

static void block_dealloc(BlockObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist)
        PyObject_ClearWeakRefs((PyObject *)self);
    if (block_forget != NULL)
        block_forget(self);
    Py_CLEAR(self->keys);
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

/* disown(): NOTE [ A disowned segment ] in arena.c. */
static PyObject *block_disown(BlockObject *self, PyObject *unused) {
    mpc_clear_error();
    int r = mpc_block_disown(&self->b);
    if (r < 0)
        return mpc_py_raise(mpc_type_state(Py_TYPE(self)), r);
    return PyBool_FromLong(r);
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
int mpc_py_block_check_view(BlockObject *self, Py_ssize_t itemsize, int nd, const npy_intp *shape,
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
int mpc_py_parse_dims(PyObject *seq, npy_intp *out, int *nd, const char *what, PyObject *E) {
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
    if (mpc_py_parse_dims(shape_o, shape, &nd, "shape", st->HandleError) < 0 ||
        mpc_py_parse_dims(strides_o, strides, &nd2, "strides", st->HandleError) < 0)
        return NULL;
    if (nd != nd2)
        return PyErr_Format(st->HandleError, "handle has %d sizes but %d strides", nd, nd2);
    for (int i = 0; i < nd; i++)
        if (__builtin_mul_overflow(strides[i], (npy_intp)unit, &strides[i]))
            return PyErr_Format(st->HandleError, "handle has absurd strides");
    if (mpc_py_block_check_view(self, itemsize, nd, shape, strides, offset, start, end) < 0)
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
        int r = one ? mpc_py_parse_dims(one, shape, &nd, "shape", st->HandleError) : -1;
        Py_XDECREF(one);
        if (r < 0)
            goto fail;
    } else if (mpc_py_parse_dims(shape_o, shape, &nd, "shape", st->HandleError) < 0)
        goto fail;
    Py_ssize_t itemsize = PyDataType_ELSIZE(descr);
    if (strides_o == Py_None) {
        npy_intp s = itemsize;
        for (int i = nd - 1; i >= 0; i--) {
            strides[i] = s;
            s *= shape[i] > 0 ? shape[i] : 1;
        }
    } else {
        if (mpc_py_parse_dims(strides_o, strides, &nd2, "strides", st->HandleError) < 0)
            goto fail;
        if (nd2 != nd) {
            PyErr_Format(st->HandleError, "handle has %d sizes but %d strides", nd, nd2);
            goto fail;
        }
    }
    if (mpc_py_block_check_view(self, itemsize, nd, shape, strides, offset, 0, -1) < 0)
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
    {"disown", (PyCFunction)block_disown, METH_NOARGS,
     "Gives up this process's ownership of the block's own segment (a large block it made\n"
     "and holds): the segment is retired once the block is freed, by whichever process frees\n"
     "it, and each mapping goes with its process's last hold.  True when disowned; False\n"
     "for a block in an arena (shared with small blocks), which is left as it is."},
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
/* Module functions: making, redeeming and finding Blocks           */
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
PyObject *mpc_py_block_copy(mpc_state *st, const void *src, uint64_t n) {
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
int mpc_py_parse_ref(PyObject *t, mpc_ref *ref) {
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
static PyObject *py_attach(PyObject *m, PyObject *h) {
    mpc_ref ref;
    mpc_state *st = mpc_get_state(m);
    if (mpc_py_parse_ref(h, &ref) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(st->HandleError, "corrupt shared-memory handle: expected "
                                             "(segment, index, generation) integers");
        }
        return NULL;
    }
    return mpc_py_block_attach(st, ref);
}

/* Redeems ref's ticket: returns this process's Block for it (new
 * reference), or NULL with an exception set (the ticket then unredeemed). */
PyObject *mpc_py_block_attach(mpc_state *st, mpc_ref ref) {
    mpc_clear_error();
    for (;;) {
        mpc_block b;
        BlockObject *o = mpc_py_block_lookup(ref.seg_id, ref.index, ref.gen);
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

/* find(address, nbytes) -> (Block, offset) for the block held here that
 * contains the range, or None. */
static PyObject *py_find(PyObject *m, PyObject *args) {
    unsigned long long addr, n;
    if (!PyArg_ParseTuple(args, "KK", &addr, &n))
        return NULL;
    mpc_block b;
    if (!mpc_block_find((const void *)(uintptr_t)addr, n ? n : 1, &b))
        Py_RETURN_NONE;
    BlockObject *o = mpc_py_block_lookup(b.seg_id, b.index, b.gen);
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

PyMethodDef mpc_py_block_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))py_alloc, METH_VARARGS | METH_KEYWORDS,
     "alloc(nbytes, zero=False, kind=1) -> Block"},
    {"attach", py_attach, METH_O, "attach(handle) -> Block: redeems a handle's ticket"},
    {"live_blocks", py_live_blocks, METH_NOARGS, "live_blocks() -> the Blocks held here"},
    {"find", py_find, METH_VARARGS, "find(address, nbytes) -> (Block, offset) or None"},
    {NULL},
};

int mpc_py_block_exec(PyObject *m, mpc_state *st) {
    st->BlockType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &block_spec, NULL);
    if (st->BlockType == NULL)
        return -1;
    return PyModule_AddObjectRef(m, "Block", (PyObject *)st->BlockType);
}
