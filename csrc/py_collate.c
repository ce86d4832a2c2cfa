/* py_collate.c: mpcore._core.collate, which collates a DataLoader batch of
 * samples straight into one shared-memory block.
 *
 * NOTE [ Collating into a block ]
 * torch's default_collate stacks each leaf of the samples' common
 * structure (nested dicts, lists, tuples and namedtuples) into one tensor.
 * We do the same in two passes over the samples:
 *   1. the first sample gives the plan: each leaf's kind, dtype, shape and
 *      bytes per sample, laid out end to end (64-byte aligned) in a block
 *      whose size is then known;
 *   2. every sample is walked against the plan and its leaves' bytes are
 *      copied into place: numbers and numpy arrays here (mpc_gather), CPU
 *      tensors by torch.stack(..., out=view of the block), through the
 *      caller's tensor_stack, so nothing is stacked twice.
 * What comes back is the block and a skeleton: the structure with each
 * leaf replaced by (0, offset, dtype, shape), a namedtuple by
 * (1, type, [children]), a column of strings or bytes by (2, list);
 * dicts and lists stay dicts and lists (tuples become lists, as torch
 * collates them).  The main process rebuilds the batch over the block.
 * Whenever the samples leave the path torch's rules take for granted
 * (types that differ between samples, lengths or keys that do not match,
 * types collate does not know, a stack that fails), collate returns None
 * and the caller runs the ordinary default_collate, which gives the same
 * result or the same error as torch.
 *
 * NOTE [ One stack per group ]
 * A stack call costs a fixed part (the call, the out view, torch's checks
 * of the arguments) beside its per-tensor part, and samples made of many
 * small tensors (a dict of a dozen features) pay the fixed part once per
 * leaf and batch.  So tensor leaves of the same dtype and shape form a
 * group, laid out one after another in the block (the leaves' bytes, then
 * the next leaf's): the group is one [members * batch, ...] tensor, and its
 * columns, end to end, are stacked into it by one call.  Each leaf is still
 * its own [batch, ...] range of the block, and the skeleton names it as
 * before; a group's stack fails exactly when one of its leaves' stacks
 * would, and the caller's collate then runs as for any failed stack. */
#include "py_mpcore.h"

#include <numpy/arrayobject.h>
#include <numpy/npy_2_compat.h>
#include <string.h>

enum { N_INT, N_BOOL, N_FLOAT, N_ARRAY, N_NPSCALAR, N_TENSOR, N_RAW, N_DICT, N_SEQ, N_NAMED };

#define ALIGN 64
#define MAX_DEPTH 64
#define FALLBACK 1
#define GROUP_SEARCH 32 /* groups a tensor leaf looks through (join_group) */

typedef struct node {
    int kind;
    Py_ssize_t n;       /* children */
    struct node *child;
    PyObject *keys;     /* N_DICT: list of keys */
    PyObject *type;     /* N_NAMED: the type; N_NPSCALAR: the scalar type */
    PyArray_Descr *descr; /* N_ARRAY, N_NPSCALAR */
    PyObject *dtype;    /* leaves: dtype name (str) */
    PyObject *shape;    /* leaves: batch shape (tuple) */
    size_t item;        /* leaves: bytes per sample */
    uint64_t offset;    /* leaves: where the leaf starts in the block */
    Py_ssize_t group;   /* N_TENSOR: its stack group (NOTE [ One stack per group ]) */
    Py_ssize_t member;  /* N_TENSOR: its place in the group */
} node;

/* Tensor leaves of the same dtype and shape, laid out one after another in
 * the block and stacked by one call (NOTE [ One stack per group ]). */
typedef struct {
    node *first;        /* the first member: dtype, shape and item bytes */
    Py_ssize_t k;       /* members */
    uint64_t offset;    /* where the group starts in the block */
    PyObject *column;   /* in pass 2: the members' columns, end to end */
} group;

typedef struct {
    Py_ssize_t batch;
    uint64_t total;
    PyObject *tensor_type, *tensor_info, *tensor_stack;
    char *base;         /* the block's first byte, in pass 2 */
    PyObject *block;
    void **ptrs;        /* scratch: batch pointers */
    group *groups;      /* tensor leaves by dtype and shape */
    Py_ssize_t ngroups, capgroups;
} ctx;

static void node_clear(node *nd) {
    for (Py_ssize_t i = 0; i < nd->n; i++)
        node_clear(&nd->child[i]);
    PyMem_Free(nd->child);
    Py_XDECREF(nd->keys);
    Py_XDECREF(nd->type);
    Py_XDECREF(nd->descr);
    Py_XDECREF(nd->dtype);
    Py_XDECREF(nd->shape);
    memset(nd, 0, sizeof *nd);
}

/* Places a leaf of `item` bytes per sample and its batch shape; a tensor
 * leaf is placed later, with its group (place_groups). */
static int leaf(node *nd, ctx *c, size_t item, PyObject *dtype_name, int nd_dims,
                const npy_intp *dims) {
    nd->item = item;
    if (nd->kind != N_TENSOR) {
        nd->offset = (c->total + ALIGN - 1) / ALIGN * ALIGN;
        c->total = nd->offset + (uint64_t)item * (uint64_t)c->batch;
    }
    nd->dtype = dtype_name; /* stolen */
    nd->shape = PyTuple_New(nd_dims + 1);
    if (nd->shape == NULL)
        return -1;
    PyTuple_SET_ITEM(nd->shape, 0, PyLong_FromSsize_t(c->batch));
    for (int i = 0; i < nd_dims; i++)
        PyTuple_SET_ITEM(nd->shape, i + 1, PyLong_FromSsize_t(dims[i]));
    for (int i = 0; i <= nd_dims; i++)
        if (PyTuple_GET_ITEM(nd->shape, i) == NULL)
            return -1;
    return 0;
}

/* Puts a tensor leaf, already planned, in the group of its dtype and shape
 * (a new one if none has them yet).  Only the first GROUP_SEARCH groups are
 * searched, so that samples of very many differently shaped tensors do
 * not cost a search through all of them per leaf: a leaf that finds no
 * group there has one of its own, which is stacked as before grouping.
 * Returns 0 or -1 with an exception. */
static int join_group(node *nd, ctx *c) {
    Py_ssize_t search = c->ngroups < GROUP_SEARCH ? c->ngroups : GROUP_SEARCH;
    for (Py_ssize_t g = 0; g < search; g++) {
        node *f = c->groups[g].first;
        if (f->item != nd->item)
            continue;
        int same = f->dtype == nd->dtype || PyUnicode_Compare(f->dtype, nd->dtype) == 0;
        if (same)
            same = PyObject_RichCompareBool(f->shape, nd->shape, Py_EQ);
        if (same < 0)
            return -1;
        if (same) {
            nd->group = g;
            nd->member = c->groups[g].k++;
            return 0;
        }
    }
    if (c->ngroups == c->capgroups) {
        Py_ssize_t cap = c->capgroups ? 2 * c->capgroups : 8;
        group *more = PyMem_Realloc(c->groups, sizeof(group) * (size_t)cap);
        if (more == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->groups = more;
        c->capgroups = cap;
    }
    c->groups[c->ngroups] = (group){.first = nd, .k = 1};
    nd->group = c->ngroups++;
    nd->member = 0;
    return 0;
}

/* After pass 1: lays the groups out after the other leaves, each group's
 * members one after another, so that a group is one [k * batch, ...]
 * tensor of the block. */
static void place_groups(ctx *c) {
    for (Py_ssize_t g = 0; g < c->ngroups; g++) {
        group *gr = &c->groups[g];
        gr->offset = (c->total + ALIGN - 1) / ALIGN * ALIGN;
        c->total = gr->offset + (uint64_t)gr->first->item * (uint64_t)c->batch * (uint64_t)gr->k;
    }
}

/* After pass 2: stacks each group's column into its place in the block,
 * one tensor_stack call per group.  Returns 0, FALLBACK (a stack failed
 * with an Exception: torch's collate will raise it, or succeed where a
 * fixed view could not), or -1 with an exception. */
static int stack_groups(ctx *c) {
    for (Py_ssize_t g = 0; g < c->ngroups; g++) {
        group *gr = &c->groups[g];
        PyObject *shape = gr->first->shape;
        if (gr->k > 1) {
            Py_ssize_t n = PyTuple_GET_SIZE(shape);
            shape = PyTuple_New(n);
            if (shape == NULL)
                return -1;
            PyObject *rows = PyLong_FromSsize_t(gr->k * c->batch);
            if (rows == NULL) {
                Py_DECREF(shape);
                return -1;
            }
            PyTuple_SET_ITEM(shape, 0, rows);
            for (Py_ssize_t i = 1; i < n; i++)
                PyTuple_SET_ITEM(shape, i, Py_NewRef(PyTuple_GET_ITEM(gr->first->shape, i)));
        } else {
            Py_INCREF(shape);
        }
        PyObject *res = PyObject_CallFunction(c->tensor_stack, "OOKOO", gr->column, c->block,
                                              (unsigned long long)gr->offset, gr->first->dtype,
                                              shape);
        Py_DECREF(shape);
        if (res == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return -1;
            PyErr_Clear();
            return FALLBACK;
        }
        Py_DECREF(res);
    }
    return 0;
}

static int alloc_children(node *nd, Py_ssize_t n) {
    nd->n = n;
    if (n == 0)
        return 0;
    nd->child = PyMem_Calloc((size_t)n, sizeof(node));
    if (nd->child == NULL) {
        nd->n = 0;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Whether torch has a dtype for numpy's (the kinds and sizes
 * torch.as_tensor takes: no long double, no strings or objects).  A numpy
 * scalar of uint64 is refused too: torch.as_tensor of a list of them is
 * an error, which the caller's collate then raises. */
static int torch_has_dtype(const PyArray_Descr *d, int scalar) {
    size_t n = (size_t)PyDataType_ELSIZE(d);
    switch (d->kind) {
    case 'b':
        return n == 1;
    case 'i':
        return n == 1 || n == 2 || n == 4 || n == 8;
    case 'u':
        return n == 1 || n == 2 || n == 4 || (n == 8 && !scalar);
    case 'f':
        return n == 2 || n == 4 || n == 8;
    case 'c':
        return n == 8 || n == 16;
    default:
        return 0;
    }
}

static int is_plain_array(PyObject *o) {
    if (!PyArray_Check(o))
        return 0;
    PyArrayObject *a = (PyArrayObject *)o;
    return torch_has_dtype(PyArray_DESCR(a), 0) && PyArray_ISNBO(PyArray_DESCR(a)->byteorder) &&
           PyArray_IS_C_CONTIGUOUS(a) && PyArray_ISALIGNED(a);
}

/* Pass 1.  Returns 0, FALLBACK, or -1 with an exception set. */
static int plan(node *nd, PyObject *e, ctx *c, int depth) {
    if (depth > MAX_DEPTH)
        return FALLBACK;
    PyTypeObject *t = Py_TYPE(e);
    if (t == &PyBool_Type) {
        nd->kind = N_BOOL;
        return leaf(nd, c, 1, PyUnicode_FromString("bool"), 0, NULL);
    }
    if (t == &PyLong_Type) {
        nd->kind = N_INT;
        return leaf(nd, c, 8, PyUnicode_FromString("int64"), 0, NULL);
    }
    if (t == &PyFloat_Type) {
        nd->kind = N_FLOAT;
        return leaf(nd, c, 8, PyUnicode_FromString("float64"), 0, NULL);
    }
    if (t == &PyUnicode_Type || t == &PyBytes_Type) {
        nd->kind = N_RAW;
        return 0;
    }
    if (c->tensor_type != Py_None && (PyObject *)t == c->tensor_type) {
        PyObject *info = PyObject_CallOneArg(c->tensor_info, e);
        if (info == NULL)
            return -1;
        if (info == Py_None) {
            Py_DECREF(info);
            return FALLBACK;
        }
        Py_ssize_t item;
        PyObject *dtype, *shape;
        if (!PyArg_ParseTuple(info, "nUO!", &item, &dtype, &PyTuple_Type, &shape)) {
            Py_DECREF(info);
            return -1;
        }
        nd->kind = N_TENSOR;
        npy_intp dims[NPY_MAXDIMS];
        Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
        if (ndim > NPY_MAXDIMS) {
            Py_DECREF(info);
            return FALLBACK;
        }
        for (Py_ssize_t i = 0; i < ndim; i++)
            dims[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        int r = leaf(nd, c, (size_t)item, Py_NewRef(dtype), (int)ndim, dims);
        Py_DECREF(info);
        return r < 0 ? r : join_group(nd, c);
    }
    if (PyArray_Check(e)) {
        if (!is_plain_array(e))
            return FALLBACK;
        PyArrayObject *a = (PyArrayObject *)e;
        nd->kind = N_ARRAY;
        nd->descr = PyArray_DESCR(a);
        Py_INCREF(nd->descr);
        PyObject *name = PyObject_GetAttrString((PyObject *)nd->descr, "name");
        if (name == NULL)
            return -1;
        return leaf(nd, c, (size_t)PyArray_NBYTES(a), name, PyArray_NDIM(a), PyArray_DIMS(a));
    }
    if (PyArray_IsScalar(e, Number) || PyArray_IsScalar(e, Bool)) {
        nd->kind = N_NPSCALAR;
        nd->type = Py_NewRef((PyObject *)t);
        nd->descr = PyArray_DescrFromScalar(e);
        if (nd->descr == NULL)
            return -1;
        if (!torch_has_dtype(nd->descr, 1))
            return FALLBACK;
        PyObject *name = PyObject_GetAttrString((PyObject *)nd->descr, "name");
        if (name == NULL)
            return -1;
        return leaf(nd, c, (size_t)PyDataType_ELSIZE(nd->descr), name, 0, NULL);
    }
    if (t == &PyDict_Type) {
        nd->kind = N_DICT;
        nd->keys = PyDict_Keys(e);
        if (nd->keys == NULL || alloc_children(nd, PyList_GET_SIZE(nd->keys)) < 0)
            return -1;
        for (Py_ssize_t i = 0; i < nd->n; i++) {
            PyObject *v = PyDict_GetItemWithError(e, PyList_GET_ITEM(nd->keys, i));
            if (v == NULL)
                return PyErr_Occurred() ? -1 : FALLBACK;
            int r = plan(&nd->child[i], v, c, depth + 1);
            if (r != 0)
                return r;
        }
        return 0;
    }
    int named = 0;
    if (PyTuple_Check(e) && t != &PyTuple_Type) {
        named = PyObject_HasAttrString((PyObject *)t, "_fields");
        if (!named)
            return FALLBACK;
    }
    if (t == &PyList_Type || PyTuple_Check(e)) {
        nd->kind = named ? N_NAMED : N_SEQ;
        if (named)
            nd->type = Py_NewRef((PyObject *)t);
        PyObject **items = PySequence_Fast_ITEMS(e);
        if (alloc_children(nd, PySequence_Fast_GET_SIZE(e)) < 0)
            return -1;
        for (Py_ssize_t i = 0; i < nd->n; i++) {
            int r = plan(&nd->child[i], items[i], c, depth + 1);
            if (r != 0)
                return r;
        }
        return 0;
    }
    return FALLBACK;
}

static PyObject *leaf_skeleton(node *nd) {
    return Py_BuildValue("(iKOO)", 0, (unsigned long long)nd->offset, nd->dtype, nd->shape);
}

/* Pass 2 for one node over a column of samples.  Sets *skel (a new
 * reference) and returns 0, or returns FALLBACK, or -1 with an exception.
 * transposed: the column is one position of sequences (zip(*batch) in
 * torch), so that a column of strings stays the tuple torch returns. */
static int fill(node *nd, PyObject **col, ctx *c, PyObject **skel, int transposed) {
    Py_ssize_t B = c->batch;
    char *dst = c->base + nd->offset;
    int r = 0;
    switch (nd->kind) {
    case N_INT:
    case N_BOOL:
        for (Py_ssize_t i = 0; i < B; i++) {
            PyTypeObject *t = Py_TYPE(col[i]);
            if (nd->kind == N_BOOL) {
                if (t != &PyBool_Type)
                    return FALLBACK;
                dst[i] = col[i] == Py_True;
                continue;
            }
            if (t != &PyLong_Type && t != &PyBool_Type)
                return FALLBACK;
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(col[i], &overflow);
            if (overflow)
                return FALLBACK;
            memcpy(dst + 8 * i, &v, 8);
        }
        break;
    case N_FLOAT:
        for (Py_ssize_t i = 0; i < B; i++) {
            PyTypeObject *t = Py_TYPE(col[i]);
            if (t != &PyFloat_Type && t != &PyLong_Type)
                return FALLBACK;
            double v = PyFloat_AsDouble(col[i]);
            if (v == -1.0 && PyErr_Occurred()) {
                PyErr_Clear();
                return FALLBACK;
            }
            memcpy(dst + 8 * i, &v, 8);
        }
        break;
    case N_ARRAY:
        for (Py_ssize_t i = 0; i < B; i++) {
            if (!is_plain_array(col[i]))
                return FALLBACK;
            PyArrayObject *a = (PyArrayObject *)col[i];
            if ((size_t)PyArray_NBYTES(a) != nd->item ||
                PyArray_NDIM(a) + 1 != PyTuple_GET_SIZE(nd->shape) ||
                !PyArray_EquivTypes(PyArray_DESCR(a), nd->descr))
                return FALLBACK;
            for (int d = 0; d < PyArray_NDIM(a); d++)
                if (PyArray_DIM(a, d) != PyLong_AsSsize_t(PyTuple_GET_ITEM(nd->shape, d + 1)))
                    return FALLBACK;
            c->ptrs[i] = PyArray_DATA(a);
        }
        mpc_gather(dst, c->ptrs, nd->item, (size_t)B);
        break;
    case N_NPSCALAR:
        for (Py_ssize_t i = 0; i < B; i++) {
            if ((PyObject *)Py_TYPE(col[i]) != nd->type)
                return FALLBACK;
            PyArray_ScalarAsCtype(col[i], dst + nd->item * (size_t)i);
        }
        break;
    case N_TENSOR: {
        /* The column joins its group's; the group is stacked at the end
         * (stack_groups). */
        group *gr = &c->groups[nd->group];
        if (gr->column == NULL && (gr->column = PyList_New(gr->k * B)) == NULL)
            return -1;
        nd->offset = gr->offset + (uint64_t)nd->member * (uint64_t)B * (uint64_t)nd->item;
        PyObject **dst_items = ((PyListObject *)gr->column)->ob_item + nd->member * B;
        for (Py_ssize_t i = 0; i < B; i++) {
            if ((PyObject *)Py_TYPE(col[i]) != c->tensor_type)
                return FALLBACK;
            dst_items[i] = Py_NewRef(col[i]);
        }
        break;
    }
    case N_RAW: {
        PyObject *list = transposed ? PyTuple_New(B) : PyList_New(B);
        if (list == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < B; i++) {
            if (transposed)
                PyTuple_SET_ITEM(list, i, Py_NewRef(col[i]));
            else
                PyList_SET_ITEM(list, i, Py_NewRef(col[i]));
        }
        *skel = Py_BuildValue("(iN)", 2, list);
        return *skel ? 0 : -1;
    }
    case N_DICT:
    case N_SEQ:
    case N_NAMED: {
        PyObject **sub = PyMem_Malloc(sizeof(PyObject *) * (size_t)B);
        PyObject *out = nd->kind == N_DICT ? PyDict_New() : PyList_New(nd->n);
        if (sub == NULL || out == NULL) {
            PyMem_Free(sub);
            Py_XDECREF(out);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < B && r == 0; i++) {
            PyTypeObject *t = Py_TYPE(col[i]);
            if (nd->kind == N_DICT ? t != &PyDict_Type
                : nd->kind == N_NAMED ? (PyObject *)t != nd->type
                : (t != &PyList_Type && t != &PyTuple_Type) ||
                  PySequence_Fast_GET_SIZE(col[i]) != nd->n)
                r = FALLBACK;
        }
        for (Py_ssize_t k = 0; k < nd->n && r == 0; k++) {
            PyObject *key = nd->kind == N_DICT ? PyList_GET_ITEM(nd->keys, k) : NULL;
            for (Py_ssize_t i = 0; i < B && r == 0; i++) {
                if (key == NULL) {
                    sub[i] = PySequence_Fast_ITEMS(col[i])[k];
                } else if ((sub[i] = PyDict_GetItemWithError(col[i], key)) == NULL) {
                    r = PyErr_Occurred() ? -1 : FALLBACK;
                }
            }
            PyObject *child = NULL;
            if (r == 0)
                r = fill(&nd->child[k], sub, c, &child, key == NULL);
            if (r == 0) {
                if (key != NULL) {
                    r = PyDict_SetItem(out, key, child);
                    Py_DECREF(child);
                } else {
                    PyList_SET_ITEM(out, k, child);
                }
            }
        }
        PyMem_Free(sub);
        if (r != 0) {
            Py_DECREF(out);
            return r;
        }
        if (nd->kind == N_NAMED) {
            *skel = Py_BuildValue("(iON)", 1, nd->type, out);
            return *skel ? 0 : -1;
        }
        *skel = out;
        return 0;
    }
    }
    *skel = leaf_skeleton(nd);
    return *skel ? 0 : -1;
}

/* collate(samples, tensor_type, tensor_info, tensor_stack)
 *   -> (Block, skeleton), or None when the caller should collate itself.
 * samples: a non-empty list.  tensor_type: torch.Tensor or None.
 * tensor_info(t) -> (bytes, dtype name, shape) or None for a tensor that
 * cannot be stacked into shared memory here.  tensor_stack(list, block,
 * offset, dtype name, batch shape) stacks a column into the block.
 * A block that cannot be allocated raises MemoryError naming the sizes. */
static PyObject *py_collate(PyObject *m, PyObject *args) {
    PyObject *samples;
    ctx c = {0};
    if (!PyArg_ParseTuple(args, "O!OOO:collate", &PyList_Type, &samples, &c.tensor_type,
                          &c.tensor_info, &c.tensor_stack))
        return NULL;
    if (PyArray_ImportNumPyAPI() < 0)
        return NULL;
    c.batch = PyList_GET_SIZE(samples);
    if (c.batch == 0)
        Py_RETURN_NONE;
    node root = {0};
    PyObject *result = NULL, *skel = NULL;
    int r = plan(&root, PyList_GET_ITEM(samples, 0), &c, 0);
    if (r == 0)
        place_groups(&c);
    if (r == 0) {
        c.ptrs = PyMem_Malloc(sizeof(void *) * (size_t)c.batch);
        if (c.ptrs == NULL) {
            PyErr_NoMemory();
            r = -1;
        }
    }
    if (r == 0) {
        c.block = mpc_py_block_alloc(mpc_get_state(m), c.total ? c.total : 1, (void **)&c.base);
        if (c.block == NULL)
            r = -1;
    }
    if (r == 0)
        r = fill(&root, ((PyListObject *)samples)->ob_item, &c, &skel, 0);
    if (r == 0)
        r = stack_groups(&c);
    if (r == 0)
        result = PyTuple_Pack(2, c.block, skel);
    else if (r == FALLBACK)
        result = Py_NewRef(Py_None);
    Py_XDECREF(skel);
    Py_XDECREF(c.block);
    PyMem_Free(c.ptrs);
    for (Py_ssize_t g = 0; g < c.ngroups; g++)
        Py_XDECREF(c.groups[g].column);
    PyMem_Free(c.groups);
    node_clear(&root);
    return result;
}

PyMethodDef mpc_py_collate_methods[] = {
    {"collate", py_collate, METH_VARARGS,
     "collate(samples, tensor_type, tensor_info, tensor_stack) -> (Block, skeleton) or None"},
    {NULL},
};
