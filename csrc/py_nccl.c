/* py_nccl.c: the Python face of nccl.c: nccl_load, nccl_version,
 * nccl_unique_id, and mpcore._core.NcclComm, one rank's communicator.
 * NCCL's failures raise RuntimeError with NCCL's own message; calls that
 * may block (making a communicator) release the GIL. */
#include "py_mpcore.h"

typedef struct {
    PyObject_HEAD
    void *comm;
} CommObject;

static PyObject *nccl_raise(int rc) {
    if (rc == -ENOENT || rc == -ENOSYS || rc == -EIO) {
        PyErr_SetString(PyExc_RuntimeError, mpc_errmsg());
        return NULL;
    }
    return mpc_py_raise(NULL, rc);
}

static PyObject *py_nccl_load(PyObject *m, PyObject *paths) {
    char **argv = mpc_py_argv_new(paths);
    if (argv == NULL)
        return NULL;
    int n = 0;
    while (argv[n])
        n++;
    const char *where = NULL;
    int r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_nccl_load((const char *const *)argv, n, &where);
    Py_END_ALLOW_THREADS
    mpc_py_argv_free(argv);
    if (r < 0)
        return nccl_raise(r);
    return PyUnicode_FromString(where);
}

static PyObject *py_nccl_version(PyObject *m, PyObject *unused) {
    int v = 0;
    mpc_clear_error();
    int r = mpc_nccl_version(&v);
    return r < 0 ? nccl_raise(r) : PyLong_FromLong(v);
}

static PyObject *py_nccl_unique_id(PyObject *m, PyObject *unused) {
    mpc_nccl_id id;
    mpc_clear_error();
    int r = mpc_nccl_unique_id(&id);
    return r < 0 ? nccl_raise(r) : PyBytes_FromStringAndSize(id.internal, sizeof id.internal);
}

static PyObject *Comm_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"unique_id", "nranks", "rank", NULL};
    Py_buffer idb;
    int nranks, rank;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*ii:NcclComm", kwlist, &idb, &nranks, &rank))
        return NULL;
    if (idb.len != (Py_ssize_t)sizeof(mpc_nccl_id)) {
        PyBuffer_Release(&idb);
        return PyErr_Format(PyExc_ValueError, "an NCCL unique id has %zu bytes, not %zd",
                            sizeof(mpc_nccl_id), idb.len);
    }
    mpc_nccl_id id;
    memcpy(id.internal, idb.buf, sizeof id.internal);
    PyBuffer_Release(&idb);
    CommObject *self = (CommObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    int r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_nccl_comm_init(&self->comm, nranks, &id, rank);
    Py_END_ALLOW_THREADS
    if (r < 0) {
        Py_DECREF(self);
        return nccl_raise(r);
    }
    return (PyObject *)self;
}

static void Comm_dealloc(PyObject *op) {
    CommObject *self = (CommObject *)op;
    PyTypeObject *tp = Py_TYPE(op);
    if (self->comm != NULL)
        mpc_nccl_comm_free(self->comm, 1);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static void *comm_of(PyObject *op) {
    void *c = ((CommObject *)op)->comm;
    if (c == NULL)
        PyErr_SetString(PyExc_ValueError, "the NCCL communicator was destroyed");
    return c;
}

static PyObject *Comm_all_reduce(PyObject *op, PyObject *args) {
    unsigned long long send, recv, count, stream;
    int dtype, rop;
    void *c = comm_of(op);
    if (c == NULL || !PyArg_ParseTuple(args, "KKKiiK", &send, &recv, &count, &dtype, &rop, &stream))
        return NULL;
    mpc_clear_error();
    int r = mpc_nccl_all_reduce(c, (void *)(uintptr_t)send, (void *)(uintptr_t)recv, count, dtype,
                                rop, (void *)(uintptr_t)stream);
    if (r < 0)
        return nccl_raise(r);
    Py_RETURN_NONE;
}

static PyObject *Comm_broadcast(PyObject *op, PyObject *args) {
    unsigned long long send, recv, n, stream;
    int root;
    void *c = comm_of(op);
    if (c == NULL || !PyArg_ParseTuple(args, "KKKiK", &send, &recv, &n, &root, &stream))
        return NULL;
    mpc_clear_error();
    int r = mpc_nccl_broadcast(c, (void *)(uintptr_t)send, (void *)(uintptr_t)recv, n, root,
                               (void *)(uintptr_t)stream);
    if (r < 0)
        return nccl_raise(r);
    Py_RETURN_NONE;
}

static PyObject *Comm_all_gather(PyObject *op, PyObject *args) {
    unsigned long long send, recv, n, stream;
    void *c = comm_of(op);
    if (c == NULL || !PyArg_ParseTuple(args, "KKKK", &send, &recv, &n, &stream))
        return NULL;
    mpc_clear_error();
    int r = mpc_nccl_all_gather(c, (void *)(uintptr_t)send, (void *)(uintptr_t)recv, n,
                                (void *)(uintptr_t)stream);
    if (r < 0)
        return nccl_raise(r);
    Py_RETURN_NONE;
}

static PyObject *Comm_check(PyObject *op, PyObject *unused) {
    void *c = comm_of(op);
    if (c == NULL)
        return NULL;
    mpc_clear_error();
    int r = mpc_nccl_async_error(c);
    if (r < 0)
        return nccl_raise(r);
    Py_RETURN_NONE;
}

static PyObject *Comm_destroy(PyObject *op, PyObject *args) {
    int abort = 0;
    if (!PyArg_ParseTuple(args, "|p", &abort))
        return NULL;
    CommObject *self = (CommObject *)op;
    void *c = self->comm;
    self->comm = NULL;
    if (c == NULL)
        Py_RETURN_NONE;
    int r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_nccl_comm_free(c, abort);
    Py_END_ALLOW_THREADS
    if (r < 0)
        return nccl_raise(r);
    Py_RETURN_NONE;
}

static PyMethodDef Comm_methods[] = {
    {"all_reduce", Comm_all_reduce, METH_VARARGS,
     "all_reduce(send, recv, count, dtype, op, stream): enqueued on the stream"},
    {"broadcast", Comm_broadcast, METH_VARARGS, "broadcast(send, recv, nbytes, root, stream)"},
    {"all_gather", Comm_all_gather, METH_VARARGS, "all_gather(send, recv, nbytes, stream)"},
    {"check", Comm_check, METH_NOARGS, "check(): raises the communicator's asynchronous error"},
    {"destroy", Comm_destroy, METH_VARARGS, "destroy(abort=False)"},
    {NULL},
};

static PyType_Slot Comm_slots[] = {
    {Py_tp_new, Comm_new},
    {Py_tp_dealloc, Comm_dealloc},
    {Py_tp_methods, Comm_methods},
    {Py_tp_doc, "NcclComm(unique_id, nranks, rank): one rank's NCCL communicator."},
    {0, NULL},
};

static PyType_Spec Comm_spec = {
    .name = "mpcore._core.NcclComm",
    .basicsize = sizeof(CommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Comm_slots,
};

PyMethodDef mpc_py_nccl_methods[] = {
    {"nccl_load", py_nccl_load, METH_O,
     "nccl_load(paths) -> what was loaded: this process's libnccl.so.2, else the first of\n"
     "paths that loads, else the system's; RuntimeError naming what was tried"},
    {"nccl_version", py_nccl_version, METH_NOARGS, "nccl_version() -> NCCL's version code"},
    {"nccl_unique_id", py_nccl_unique_id, METH_NOARGS, "nccl_unique_id() -> 128 bytes"},
    {NULL},
};

int mpc_py_nccl_exec(PyObject *m, mpc_state *st) {
    PyObject *type = PyType_FromModuleAndSpec(m, &Comm_spec, NULL);
    if (type == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "NcclComm", type);
    Py_DECREF(type);
    return r;
}
