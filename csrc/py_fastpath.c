/* py_fastpath.c: what torch.distributed's fast paths (dist/_fastpath.py)
 * do in C: ask whether anything observes a collective right now (torch's
 * profiler, a dispatch mode), of torch's own C++ functions through
 * pointers that the table of torch changes found and checked (NOTE
 * [ Observers asked in C ]), and dist.barrier's whole fast path (NOTE
 * [ dist.barrier in C ]). */
#include "py_mpcore.h"

#include <stdbool.h>
#include <stdint.h>

/* NOTE [ Observers asked in C ]
 * Every fast path of a collective first asks whether something observes
 * the call (NOTE [ Fast paths nobody sees ] in dist/_fastpath.py): torch's
 * profiler (torch._C._autograd._profiler_enabled) or a dispatch mode
 * (torch._C._len_torch_dispatch_stack).  Those two are pybind11 functions,
 * about 0.05 us a call each; the C++ functions they bind,
 * torch::profiler::impl::profilerEnabled() and
 * c10::impl::TorchDispatchModeTLS::stack_len(), take no arguments and read
 * this thread's state in a few nanoseconds.  mpcore/_torchapi.py finds them
 * in torch's libraries (rows "libtorch_cpu.so!..." and "libc10.so!..."),
 * checks that each answers what its Python binding answers, and hands
 * their addresses to set_observers(); observed() then asks both in one
 * call.  Where a torch lacks them, set_observers() is never called and the
 * fast paths ask the Python bindings, and barrier_now() serves nothing.
 * Neither function throws or takes the GIL. */

static bool (*profiler_enabled)(void);
static int64_t (*dispatch_stack_len)(void);

static PyObject *set_observers(PyObject *m, PyObject *args) {
    unsigned long long prof, modes;
    if (!PyArg_ParseTuple(args, "KK:set_observers", &prof, &modes))
        return NULL;
    if (prof == 0 || modes == 0) {
        PyErr_SetString(PyExc_ValueError, "set_observers takes two functions' addresses, not 0");
        return NULL;
    }
    profiler_enabled = (bool (*)(void))(uintptr_t)prof;
    dispatch_stack_len = (int64_t (*)(void))(uintptr_t)modes;
    Py_RETURN_NONE;
}

static PyObject *observed(PyObject *m, PyObject *noargs) {
    if (profiler_enabled == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "observed() before set_observers()");
        return NULL;
    }
    return PyBool_FromLong(profiler_enabled() || dispatch_stack_len() != 0);
}

/* NOTE [ dist.barrier in C ]
 * dist.barrier() with none of its arguments (or a group) is a program's
 * most common barrier, and its fast path in Python read nine attributes
 * and made three calls before the core's barrier: about 0.25 us, where the
 * core's own barrier between two ranks costs about as much.  barrier_now
 * makes the same checks in C, in the same order, and the core's barrier:
 * the default group (world._default_pg) or the group given is of the
 * backend's class (pg_type), nothing observes the call, the group gathers
 * no batch and has no gloo group beside it, it has a shared-memory group
 * (shm) with nothing queued on its collectives' lane; then
 * shm.core.barrier(group.timeout_s).  It returns True when it made the
 * barrier, and False, having done nothing, whenever one check fails: the
 * Python function then goes its own way (draining the lane, torch's
 * function), as before.  The Python function leaves it out for a timeout,
 * device_ids, async_op and while compiling.  An error of the barrier
 * itself is raised from here as from the core's call. */

/* getattr(o, name) is None: 1, 0 (not None), -1 (error). */
static int attr_is_none(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int r = v == Py_None;
    Py_DECREF(v);
    return r;
}

static PyObject *s_default_pg, *s_batch, *s_gloo, *s_shm, *s_collectives, *s_core, *s_timeout_s;

static PyObject *barrier_now(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "barrier_now(group, world, pg_type) takes 3 arguments");
        return NULL;
    }
    PyObject *group = args[0], *world = args[1], *pg_type = args[2];
    if (profiler_enabled == NULL || profiler_enabled() || dispatch_stack_len() != 0)
        Py_RETURN_FALSE;
    PyObject *g = group == Py_None ? PyObject_GetAttr(world, s_default_pg) : Py_NewRef(group);
    if (g == NULL)
        return NULL;
    PyObject *shm = NULL, *lane = NULL, *core = NULL, *timeout = NULL, *res = NULL;
    int ok = (PyObject *)Py_TYPE(g) == pg_type;
    if (ok && (ok = attr_is_none(g, s_batch)) == 1)
        ok = attr_is_none(g, s_gloo);
    if (ok == 1 && ((shm = PyObject_GetAttr(g, s_shm)) == NULL || shm == Py_None))
        ok = shm == NULL ? -1 : 0;
    if (ok == 1 && (lane = PyObject_GetAttr(shm, s_collectives)) == NULL)
        ok = -1;
    if (ok == 1 && mpc_py_lane_queued(lane) != 0) /* queued, or not a Lane: Python's way */
        ok = 0;
    if (ok == 1 && ((core = PyObject_GetAttr(shm, s_core)) == NULL ||
                    (timeout = PyObject_GetAttr(g, s_timeout_s)) == NULL))
        ok = -1;
    if (ok == 1 && (res = mpc_py_group_barrier(core, timeout)) != NULL) {
        Py_DECREF(res);
        res = Py_NewRef(Py_True);
    } else if (ok == 0) {
        res = Py_NewRef(Py_False);
    }
    Py_DECREF(g);
    Py_XDECREF(shm);
    Py_XDECREF(lane);
    Py_XDECREF(core);
    Py_XDECREF(timeout);
    return res;
}

PyMethodDef mpc_py_fastpath_methods[] = {
    {"set_observers", set_observers, METH_VARARGS,
     "set_observers(profiler_enabled, dispatch_stack_len): the addresses of torch's C++ "
     "functions that observed() calls (NOTE [ Observers asked in C ])."},
    {"observed", observed, METH_NOARGS,
     "observed() -> bool: torch's profiler is on, or a dispatch mode is set, on this thread."},
    {"barrier_now", (PyCFunction)(void (*)(void))barrier_now, METH_FASTCALL,
     "barrier_now(group, world, pg_type) -> bool: dist.barrier's fast path made here, or "
     "False having done nothing (NOTE [ dist.barrier in C ])."},
    {NULL, NULL, 0, NULL},
};

int mpc_py_fastpath_exec(PyObject *m, mpc_state *st) {
    (void)m;
    (void)st;
    static const mpc_py_name names[] = {
        {&s_default_pg, "_default_pg"}, {&s_batch, "batch"}, {&s_gloo, "gloo"},
        {&s_shm, "shm"}, {&s_collectives, "collectives"}, {&s_core, "core"},
        {&s_timeout_s, "timeout_s"},
    };
    return mpc_py_intern(names, sizeof names / sizeof names[0]);
}
