/* py_tensor.c: the torch side of shared memory, without linking libtorch:
 * tensor records, the binary form of a bare tensor on a Queue (NOTE
 * [ Tensor records ]), made and read in C (NOTE [ Tensor records in C ]);
 * the one storage over each byte range of a block in this process, and the
 * entries that remember it (NOTE [ Storage entries go with their block ]);
 * and moving a storage into a block in place.  It reaches torch only
 * through the objects torch_hooks() hands over, and Blocks only through
 * py_block.c's calls.  It stays one file of about 850 lines: making a
 * record, reading one and the storages both make share those objects and
 * the rules of the storage table, which a split would put on both sides.
 *
 * NOTE [ Tensor records ]
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
#include "py_mpcore.h"

#include <numpy/arrayobject.h>
#include <numpy/npy_2_compat.h>
#include <string.h>

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
    if (res == NULL) {
        Py_BEGIN_ALLOW_THREADS
        mpc_ref_drop_journaled(&ref);
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
    if (mpc_py_parse_dims(size_o, size, &nd, "size", NULL) < 0 ||
        mpc_py_parse_dims(stride_o, stride, &nd2, "stride", NULL) < 0)
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
    if (mpc_py_parse_ref(PyList_GET_ITEM(refs, 0), &ref) < 0)
        return -1;
    BlockObject *b = NULL;
    if (h->ndim > TREC_MAXDIM ||
        (size_t)PyBytes_GET_SIZE(payload) != sizeof *h + 2 * (size_t)h->ndim * sizeof(int64_t)) {
        PyErr_Format(st->HandleError, "corrupt tensor record (%u dimensions, %zd bytes)", h->ndim,
                     PyBytes_GET_SIZE(payload));
        goto drop;
    }
    b = (BlockObject *)mpc_py_block_attach(st, ref);
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
    if (mpc_py_block_check_view(b, (Py_ssize_t)h->itemsize, nd, size, stride, (Py_ssize_t)first,
                         (Py_ssize_t)h->offset, (Py_ssize_t)(h->offset + h->nbytes)) < 0)
        goto fail;
    *bp = b;
    return 1;
fail:
    Py_DECREF(b);
    return -1;
drop:
    Py_BEGIN_ALLOW_THREADS
    mpc_ref_drop_journaled(&ref);
    Py_END_ALLOW_THREADS
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
 * of a tensor ] in queue/_records.py) is two calls: tensor_record(t) on the put
 * side and tensor_from_record(refs, payload) on the get side.  The build
 * does not link libtorch, so both reach torch only through the Python
 * objects shm/_torch.py hands over once (torch_hooks()); what they save is the
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
    static const mpc_py_name names[] = {
        {&s_requires_grad, "requires_grad"}, {&s_dtype, "dtype"}, {&s_shape, "shape"},
        {&s_stride, "stride"}, {&s_storage_offset, "storage_offset"},
        {&s_untyped_storage, "untyped_storage"}, {&s_nbytes, "nbytes"},
        {&s_data_ptr, "data_ptr"}, {&s_new, "new"}, {&s_weak_ref, "_weak_ref"},
        {&s_storages_shared, "storages_shared"}, {&s_set_, "set_"},
    };
    return mpc_py_intern(names, sizeof names / sizeof names[0]);
}

/* torch_hooks(tensor_type, dispatch_keys, plain_keys, codes, descrs, proto,
 * from_numpy, storages, new_with_weak_ptr, free_weak_ref, expired, counts,
 * swap): the torch objects of NOTE [ Tensor records in C ], as shm/_torch.py
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
    BlockObject *b = (BlockObject *)mpc_py_block_copy(st, (const void *)(uintptr_t)ptr, nbytes);
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
        (bo = mpc_py_block_lookup(found.seg_id, found.index, found.gen)) != NULL) {
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
    if (mpc_py_block_check_view(b, 1, 1, &n, &one, offset, 0, -1) < 0)
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

PyMethodDef mpc_py_tensor_methods[] = {
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

int mpc_py_tensor_exec(PyObject *m, mpc_state *st) {
    mpc_py_block_set_forget(trec_forget_block);
    uint32_t magic = TREC_MAGIC;
    PyObject *tag = PyBytes_FromStringAndSize((const char *)&magic, sizeof magic);
    if (tag == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "TENSOR_RECORD_TAG", tag);
    Py_DECREF(tag);
    return r;
}
