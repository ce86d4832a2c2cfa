/* py_proc.c: bindings for the zygote (mpcore._core.Zygote) and for starting
 * the program's services.  The fork itself happens here, between
 * PyOS_BeforeFork and PyOS_AfterFork_*, as os.fork does it.  Also: dying
 * with another process (die_with). */
#include "py_mpcore.h"

#include <signal.h>
#include <stddef.h>
#include <sys/socket.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    mpc_zygote *z;
} ZygoteObject;

static PyObject *zygote_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    int root, lsock;
    if (!PyArg_ParseTuple(args, "ii", &root, &lsock))
        return NULL;
    ZygoteObject *self = (ZygoteObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    mpc_clear_error();
    int r = mpc_zygote_open(root, lsock, &self->z);
    if (r < 0) {
        Py_DECREF(self);
        return mpc_py_raise(mpc_type_state(type), r);
    }
    return (PyObject *)self;
}

static void zygote_dealloc(ZygoteObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    free(self->z);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* serve() -> None when the program has ended; in a child just forked,
 * returns the request's payload (bytes).  The zygote itself never returns
 * otherwise. */
static PyObject *zygote_serve(ZygoteObject *self, PyObject *unused) {
    mpc_state *st = mpc_type_state(Py_TYPE(self));
    if (self->z == NULL)
        return PyErr_Format(PyExc_RuntimeError, "the zygote was closed");
    pid_t me = getpid();
    for (;;) {
        mpc_zreq req;
        int r;
        mpc_clear_error();
        Py_BEGIN_ALLOW_THREADS
        r = mpc_zygote_wait(self->z, &req);
        Py_END_ALLOW_THREADS
        if (r < 0)
            return mpc_py_raise(st, r);
        if (r == 0)
            Py_RETURN_NONE;
        /* NOTE [ Zygote ]: never fork while another thread may hold a
         * lock; the requester falls back to a spawn by exec. */
        int threads = mpc_zygote_threads();
        if (threads != 1) {
            mpc_zygote_started(self->z, &req, 0, EDEADLK, threads);
            continue;
        }
        PyObject *payload = PyBytes_FromStringAndSize(req.payload, (Py_ssize_t)req.len);
        if (payload == NULL) {
            mpc_zygote_started(self->z, &req, 0, ENOMEM, 0);
            PyErr_Clear();
            continue;
        }
        PyOS_BeforeFork();
        pid_t pid = fork();
        int err = errno;
        if (pid == 0) {
            PyOS_AfterFork_Child();
            r = mpc_zygote_child_setup(self->z, &req, me);
            self->z = NULL;
            mpc_zreq_free_payload(&req);
            if (r < 0) {
                fprintf(stderr, "mpcore zygote child: %s\n", mpc_errmsg());
                _exit(70);
            }
            return payload;
        }
        PyOS_AfterFork_Parent();
        Py_DECREF(payload);
        mpc_zygote_started(self->z, &req, pid, err, 0);
    }
}

static PyMethodDef zygote_methods[] = {
    {"serve", (PyCFunction)zygote_serve, METH_NOARGS,
     "serve() -> payload in a new child, None when the program has ended"},
    {NULL},
};

static PyType_Slot zygote_slots[] = {
    {Py_tp_new, zygote_new},
    {Py_tp_dealloc, zygote_dealloc},
    {Py_tp_methods, zygote_methods},
    {Py_tp_doc, "Zygote(root_fd, listen_fd): the zygote's server loop."},
    {0, NULL},
};

static PyType_Spec zygote_spec = {
    .name = "mpcore._core.Zygote",
    .basicsize = sizeof(ZygoteObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = zygote_slots,
};

/* spawn_service(argv, prefix) -> (address, fd, pid): starts a service of
 * the program (NOTE [ Starting a service ]). */
static PyObject *py_spawn_service(PyObject *m, PyObject *args) {
    PyObject *argv_o;
    const char *prefix;
    if (!PyArg_ParseTuple(args, "Os", &argv_o, &prefix))
        return NULL;
    char **argv = mpc_py_argv_new(argv_o);
    if (argv == NULL)
        return NULL;
    char name[96];
    int sock, r;
    pid_t pid;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_spawn_service(argv, prefix, SOCK_STREAM, name, sizeof name, &sock, &pid);
    Py_END_ALLOW_THREADS
    mpc_py_argv_free(argv);
    if (r < 0)
        return mpc_py_raise(mpc_get_state(m), r);
    return Py_BuildValue("(sii)", name, sock, (int)pid);
}

/* service_sockets(prefix) -> (address, mine, theirs, listen_fd): the
 * sockets of a service this process starts by forking (mpc_service_sockets). */
static PyObject *py_service_sockets(PyObject *m, PyObject *arg) {
    const char *prefix = PyUnicode_AsUTF8(arg);
    if (prefix == NULL)
        return NULL;
    char name[96];
    int mine, theirs, lsock;
    mpc_clear_error();
    int r = mpc_service_sockets(prefix, SOCK_STREAM, name, sizeof name, &mine, &theirs, &lsock);
    if (r < 0)
        return mpc_py_raise(mpc_get_state(m), r);
    return Py_BuildValue("(siii)", name, mine, theirs, lsock);
}

/* zygote_payload_fd(buffer) -> fd: a sealed memfd holding a copy of a
 * large request payload (NOTE [ Zygote payloads ]); the caller closes it.
 * MemoryError names the size when shared memory is short. */
static PyObject *py_zygote_payload_fd(PyObject *m, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    int fd = -1, r;
    mpc_clear_error();
    Py_BEGIN_ALLOW_THREADS
    r = mpc_zygote_payload_fd(b.buf, (uint64_t)b.len, &fd);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (r < 0)
        return mpc_py_raise(mpc_get_state(m), r);
    return PyLong_FromLong(fd);
}

/* die_with(pid, sig, thread_lasts) -> None: this process gets sig once
 * process pid has ended (NOTE [ Dying with a process ]).  Raises
 * ProcessLookupError if pid is already gone. */
static PyObject *py_die_with(PyObject *m, PyObject *args) {
    int pid, sig, thread_lasts;
    if (!PyArg_ParseTuple(args, "iip", &pid, &sig, &thread_lasts))
        return NULL;
    mpc_clear_error();
    int r = mpc_die_with((pid_t)pid, sig, thread_lasts);
    if (r < 0)
        return mpc_py_raise(mpc_get_state(m), r);
    Py_RETURN_NONE;
}

PyMethodDef mpc_py_proc_methods[] = {
    {"zygote_payload_fd", py_zygote_payload_fd, METH_O,
     "zygote_payload_fd(buffer) -> fd: a sealed memfd with a copy of a large zygote payload"},
    {"die_with", py_die_with, METH_VARARGS,
     "die_with(pid, sig, thread_lasts) -> None: this process gets sig once process pid has "
     "ended; PR_SET_PDEATHSIG when pid is the parent and thread_lasts is true (the parent "
     "thread that started this process lives as long as its process), else a pidfd watched "
     "by a thread.  ProcessLookupError if pid is already gone."},
    {"service_sockets", py_service_sockets, METH_O,
     "service_sockets(prefix) -> (address, mine, theirs, listen_fd): a forked service's sockets"},
    {"spawn_service", py_spawn_service, METH_VARARGS,
     "spawn_service(argv, prefix) -> (address, fd, pid): starts a service of the program"},
    {NULL},
};

/* The zygote's wire format (mpcore.h), for _zygote.py: the header as
 * (field, offset, struct code) in order, its size, the op codes, flags and
 * limits.  The codes are checked against the fields' C types here, so that
 * Python's struct is this header or the build fails. */
#define ZFIELD(name, code, type)                                                         \
    _Static_assert(sizeof(((mpc_zmsg *)0)->name) == sizeof(type), "mpc_zmsg." #name); \
    if (zfield(layout, &i, #name, offsetof(mpc_zmsg, name), code) < 0)                 \
        goto fail;

static int zfield(PyObject *layout, Py_ssize_t *i, const char *name, size_t off,
                  const char *code) {
    PyObject *t = Py_BuildValue("(sns)", name, (Py_ssize_t)off, code);
    if (t == NULL)
        return -1;
    PyTuple_SET_ITEM(layout, (*i)++, t);
    return 0;
}

static int zygote_constants(PyObject *m) {
    PyObject *layout = PyTuple_New(9);
    if (layout == NULL)
        return -1;
    Py_ssize_t i = 0;
    ZFIELD(magic, "I", uint32_t)
    ZFIELD(op, "I", uint32_t)
    ZFIELD(token, "Q", uint64_t)
    ZFIELD(arg, "q", int64_t)
    ZFIELD(arg2, "q", int64_t)
    ZFIELD(len, "Q", uint64_t)
    ZFIELD(nfds, "I", uint32_t)
    ZFIELD(flags, "I", uint32_t)
    ZFIELD(targets, "16i", int32_t[16])
    _Static_assert(MPC_ZMAX_FDS == 16, "the targets code above says 16");
    int r = PyModule_AddObjectRef(m, "ZYGOTE_MSG_LAYOUT", layout);
    Py_DECREF(layout);
    if (r < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_MSG_SIZE", (long)sizeof(mpc_zmsg)) < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_MAGIC", (long)MPC_ZMAGIC) < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_SPAWN", MPC_ZOP_SPAWN) < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_STARTED", MPC_ZOP_STARTED) < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_FAILED", MPC_ZOP_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_EXIT", MPC_ZOP_EXIT) < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_FLAG_MEMFD", MPC_ZF_MEMFD) < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_FLAG_SIGCHLD", MPC_ZF_SIGCHLD) < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_MAX_FDS", MPC_ZMAX_FDS) < 0 ||
        PyModule_AddIntConstant(m, "ZYGOTE_INLINE_MAX", (long)MPC_ZINLINE_MAX) < 0)
        return -1;
    return 0;
fail:
    Py_DECREF(layout);
    return -1;
}

int mpc_py_proc_exec(PyObject *m, mpc_state *st) {
    if (zygote_constants(m) < 0)
        return -1;
    PyObject *t = PyType_FromModuleAndSpec(m, &zygote_spec, NULL);
    if (t == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "Zygote", t);
    Py_DECREF(t);
    return r;
}
