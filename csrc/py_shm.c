/* py_shm.c: the module functions of the keeper and of tickets in
 * transit: dropping tickets (one, or those left in this process's
 * journal), forgetting idle segments, what memory this process may still
 * commit, the counters of its shared memory, the reset after fork, and
 * starting, running and reaching the keeper.  The Block type is
 * py_block.c's, the torch side py_tensor.c's. */
#include "py_mpcore.h"

static PyObject *py_drop_ticket(PyObject *m, PyObject *args) {
    PyObject *h;
    mpc_ref ref;
    if (!PyArg_ParseTuple(args, "O", &h) || mpc_py_parse_ref(h, &ref) < 0)
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
        if (mpc_py_parse_ref(PySequence_Fast_GET_ITEM(fast, i), &ref) < 0) {
            Py_DECREF(fast);
            return NULL;
        }
        Py_BEGIN_ALLOW_THREADS
        mpc_ref_drop_journaled(&ref);
        Py_END_ALLOW_THREADS
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

static PyObject *py_forget_idle(PyObject *m, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    mpc_forget_idle();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
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

static PyObject *py_keeper_pid(PyObject *m, PyObject *unused) {
    return PyLong_FromLong((long)mpc_keeper_pid());
}

PyMethodDef mpc_py_shm_methods[] = {
    {"drop_ticket", py_drop_ticket, METH_VARARGS, "drop_ticket(handle): drops a ticket unused"},
    {"drop_journaled", py_drop_journaled, METH_O,
     "drop_journaled(refs): drops those of the tickets still in this process's journal"},
    {"forget_idle", py_forget_idle, METH_NOARGS,
     "forget_idle(): unmaps others' segments in which this process holds nothing"},
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
    {NULL},
};
