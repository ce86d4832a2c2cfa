/* py_pieces.c: tensor_pieces, which reads a list of tensors (their checks
 * and addresses) for the fast paths of the collectives that take lists
 * (mpcore.dist._fastpath): NOTE [ A list of tensors read in one call ].
 * It knows no tensor's layout, only the attribute names below. */
#include "py_mpcore.h"

/* NOTE [ A list of tensors read in one call ]
 * A collective that takes a list of tensors (all_gather's outputs,
 * reduce_scatter's and all_to_all's inputs, gather's and scatter's root
 * list) must check every tensor as torch's function does and read its
 * address.  Written in Python that loop (a list built, the pieces' end to
 * end test, a call per tensor's check) cost more than the core's whole
 * call for one tensor, so the list is read here, through the objects' own
 * attributes: nothing here knows a tensor's layout, only the names
 * `is_cpu`, `dtype`, `shape`, `is_contiguous()` and `data_ptr()` of
 * objects of the exact type the caller names.  The attribute reads
 * themselves cost as much from here as from Python (torch's getters are
 * most of it); what this saves is the loop around them, about a third of
 * the Python function's time for one tensor and more for several. */

static PyObject *str_is_cpu, *str_dtype, *str_shape, *str_is_contiguous, *str_data_ptr;

/* Interns the attribute names tensor_pieces reads, those not interned yet.
 * Returns 0, or -1 with MemoryError set. */
static int piece_names(void) {
    static const mpc_py_name names[] = {
        {&str_is_cpu, "is_cpu"}, {&str_dtype, "dtype"}, {&str_shape, "shape"},
        {&str_is_contiguous, "is_contiguous"}, {&str_data_ptr, "data_ptr"},
    };
    return mpc_py_intern(names, sizeof names / sizeof names[0]);
}

/* 1 when t is of type `type` exactly, on the CPU, of dtype `dtype` (by
 * identity), contiguous and of shape `shape`, with its address in *addr;
 * 0 when it is not; -1 with the exception set when reading an attribute
 * raised.  dtype and shape NULL: t is the item they were read from, and
 * neither is looked at again. */
static int piece_of(PyObject *t, PyObject *type, PyObject *dtype, PyObject *shape,
                    unsigned long long *addr) {
    if ((PyObject *)Py_TYPE(t) != type)
        return 0;
    PyObject *v = PyObject_GetAttr(t, str_is_cpu);
    if (v == NULL)
        return -1;
    int ok = v == Py_True;
    Py_DECREF(v);
    if (!ok)
        return 0;
    if (dtype != NULL) {
        if ((v = PyObject_GetAttr(t, str_dtype)) == NULL)
            return -1;
        ok = v == dtype;
        Py_DECREF(v);
        if (!ok)
            return 0;
    }
    if ((v = PyObject_CallMethodNoArgs(t, str_is_contiguous)) == NULL)
        return -1;
    ok = v == Py_True;
    Py_DECREF(v);
    if (!ok)
        return 0;
    if (shape != NULL) {
        if ((v = PyObject_GetAttr(t, str_shape)) == NULL)
            return -1;
        ok = PyObject_RichCompareBool(v, shape, Py_EQ);
        Py_DECREF(v);
        if (ok <= 0)
            return ok;
    }
    if ((v = PyObject_CallMethodNoArgs(t, str_data_ptr)) == NULL)
        return -1;
    *addr = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (*addr == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return 1;
}

/* The pieces of list ts (see tensor_pieces below), each of type `type`
 * exactly, dtype `dtype` and shape `shape`; with dtype NULL, those of ts's
 * first item, which is then checked for the rest only.  Returns a new
 * reference (an int, a list, or None), or NULL with the exception set.
 * *dtype_out and *shape_out, when not NULL, receive new references to the
 * dtype and shape used (NULL on any return but a piece's int or list). */
static PyObject *pieces_of(PyObject *ts, PyObject *type, PyObject *dtype, PyObject *shape,
                           Py_ssize_t w, unsigned long long nb, PyObject **dtype_out,
                           PyObject **shape_out) {
    if (dtype_out != NULL)
        *dtype_out = *shape_out = NULL;
    if (!PyList_CheckExact(ts) || PyList_GET_SIZE(ts) != w || w < 1 || w > MPC_COLL_MAX_RANKS)
        Py_RETURN_NONE;
    if (piece_names() < 0)
        return NULL;
    unsigned long long addrs[MPC_COLL_MAX_RANKS];
    int apart = nb == 0;
    PyObject *own_dtype = NULL, *own_shape = NULL, *res = NULL;
    for (Py_ssize_t q = 0; q < w; q++) {
        /* attribute reads run code that could change the list: hold the
         * item, and look at the list's size again */
        PyObject *t = PyList_GET_ITEM(ts, q);
        Py_INCREF(t);
        int r;
        if (q == 0 && dtype == NULL) {
            /* the first item sets dtype and shape: read them, check the rest */
            r = (PyObject *)Py_TYPE(t) == type;
            if (r && (dtype = own_dtype = PyObject_GetAttr(t, str_dtype)) == NULL)
                r = -1;
            if (r > 0 && (shape = own_shape = PyObject_GetAttr(t, str_shape)) == NULL)
                r = -1;
            if (r > 0)
                r = piece_of(t, type, NULL, NULL, &addrs[q]);
        } else {
            r = piece_of(t, type, dtype, shape, &addrs[q]);
        }
        Py_DECREF(t);
        if (r < 0)
            goto done;
        if (r == 0 || PyList_GET_SIZE(ts) != w) {
            res = Py_NewRef(Py_None);
            goto done;
        }
        apart = apart || addrs[q] == 0 || addrs[q] != addrs[0] + (unsigned long long)q * nb;
    }
    if (!apart) {
        res = PyLong_FromUnsignedLongLong(addrs[0]);
    } else if ((res = PyList_New(w)) != NULL) {
        for (Py_ssize_t q = 0; q < w; q++) {
            PyObject *a = PyLong_FromUnsignedLongLong(addrs[q]);
            if (a == NULL) {
                Py_CLEAR(res);
                break;
            }
            PyList_SET_ITEM(res, q, a);
        }
    }
    if (res != NULL && dtype_out != NULL) {
        *dtype_out = Py_NewRef(dtype);
        *shape_out = Py_NewRef(shape);
    }
done:
    Py_XDECREF(own_dtype);
    Py_XDECREF(own_shape);
    return res;
}

/* tensor_pieces(ts, type, dtype, shape, world, nbytes[, more]): ts as the
 * core's gather, scatter and the list forms take `world` pieces, when ts
 * is a list of `world` objects each of type `type` exactly, on the CPU,
 * of dtype `dtype`, contiguous and of shape `shape` (the caller reads
 * these and nbytes, the bytes of one piece, from the tensor it checked
 * itself; dtype and shape None: those of ts's first item): the first's
 * address (an int) when they lie end to end (rank q's piece at q * nbytes,
 * none empty or at address 0), else the list of their addresses.  With
 * `more`, a second list checked alike (all_to_all's outputs beside its
 * inputs): the pair of both, or None when either is None.  None for any
 * other ts (the caller then goes to torch's function, which raises its
 * own errors).  An exception raised by reading an attribute propagates;
 * nothing is changed either way. */
static PyObject *py_tensor_pieces(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 && nargs != 7)
        return PyErr_Format(PyExc_TypeError, "tensor_pieces takes 6 or 7 arguments (%zd given)",
                            nargs);
    PyObject *type = args[1], *dtype = args[2], *shape = args[3];
    Py_ssize_t w = PyLong_AsSsize_t(args[4]);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long nb = PyLong_AsUnsignedLongLong(args[5]);
    if (nb == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if ((dtype == Py_None) != (shape == Py_None))
        return PyErr_Format(PyExc_TypeError, "tensor_pieces: dtype and shape are both None or "
                                             "neither");
    if (dtype == Py_None)
        dtype = shape = NULL;
    if (nargs == 6)
        return pieces_of(args[0], type, dtype, shape, w, nb, NULL, NULL);
    PyObject *dt, *sh;
    PyObject *first = pieces_of(args[0], type, dtype, shape, w, nb, &dt, &sh);
    if (first == NULL || first == Py_None)
        return first;
    PyObject *second = pieces_of(args[6], type, dt, sh, w, nb, NULL, NULL);
    Py_DECREF(dt);
    Py_DECREF(sh);
    if (second == NULL || second == Py_None) {
        Py_DECREF(first);
        return second;
    }
    PyObject *pair = PyTuple_Pack(2, first, second);
    Py_DECREF(first);
    Py_DECREF(second);
    return pair;
}

PyMethodDef mpc_py_pieces_methods[] = {
    {"tensor_pieces", (PyCFunction)(void (*)(void))py_tensor_pieces, METH_FASTCALL,
     "tensor_pieces(ts, type, dtype, shape, world, nbytes[, more]) -> the first address\n"
     "(end to end), the list of addresses (with more: the pair of both), or None:\n"
     "NOTE [ A list of tensors read in one call ]"},
    {NULL},
};
