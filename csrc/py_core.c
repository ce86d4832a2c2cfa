/* py_core.c: the mpcore._core module: its state, its exec slot, and the one
 * place where the core's error codes become Python exceptions. */
#include "py_mpcore.h"

#include <limits.h>
#include <string.h>

#include <numpy/numpyconfig.h>

static struct PyModuleDef mpc_module;

mpc_state *mpc_get_state(PyObject *module) {
    return (mpc_state *)PyModule_GetState(module);
}

/* NOTE [ Module state from a type ]
 * Methods of our types find the module's state through the type that
 * defines them, which may be a subclass's base.  Python 3.11 has
 * PyType_GetModuleByDef for that; on 3.10 the same walk is done here, as
 * 3.11 does it: the first heap type in the MRO whose module is this one.
 * This is the only place that knows how. */
mpc_state *mpc_type_state(PyTypeObject *type) {
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *m = PyType_GetModuleByDef(type, &mpc_module);
    if (m == NULL) {
        PyErr_Clear();
        return NULL;
    }
    return mpc_get_state(m);
#else
    PyObject *mro = type->tp_mro;
    if (mro == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *t = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if (!PyType_HasFeature(t, Py_TPFLAGS_HEAPTYPE))
            continue;
        PyObject *m = ((PyHeapTypeObject *)t)->ht_module;
        if (m != NULL && PyModule_GetDef(m) == &mpc_module)
            return mpc_get_state(m);
    }
    return NULL;
#endif
}

PyObject *mpc_py_raise(mpc_state *st, int err) {
    /* NOTE [ mpcore's error codes ] in mpcore.h: only mpcore's own codes
     * mean a bad handle or a shortage of shared memory; an errno means
     * what its name says. */
    const char *msg = mpc_errmsg();
    int e = err < 0 ? -err : err;
    if (e == MPC_ENOSHM) {
        PyErr_SetString(PyExc_MemoryError, *msg ? msg : "out of shared memory");
    } else if (e == ENOMEM) {
        PyErr_SetString(PyExc_MemoryError, *msg ? msg : strerror(ENOMEM));
    } else if (e == MPC_EHANDLE || e == MPC_ESTALE || e == MPC_ENOSEG) {
        PyErr_SetString(st ? st->HandleError : PyExc_ValueError,
                        *msg ? msg : mpc_strerror(e));
    } else if (e >= MPC_ERR_BASE && e < MPC_ERR_END) {
        PyErr_Format(PyExc_RuntimeError, "mpcore error %d: %s", e, *msg ? msg : mpc_strerror(e));
    } else if (e == ETIMEDOUT) {
        PyErr_SetString(PyExc_TimeoutError, *msg ? msg : "timed out");
    } else if (e == EINVAL) {
        PyErr_SetString(PyExc_ValueError, *msg ? msg : "invalid argument");
    } else if (*msg) {
        PyObject *args = Py_BuildValue("(is)", e, msg);
        if (args) {
            PyErr_SetObject(PyExc_OSError, args);
            Py_DECREF(args);
        }
    } else {
        errno = e;
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return NULL;
}

/* NOTE [ Arguments read without a tuple ]
 * The collectives' bindings are called once per collective, and at 4 KB
 * the core's own work is a few hundred nanoseconds: a METH_VARARGS method
 * first gets its arguments packed into a tuple, then unpacked by
 * PyArg_ParseTupleAndKeywords reading its format string, together about a
 * tenth of a microsecond of a barrier's fifth.  So those bindings are
 * vectorcall methods (METH_FASTCALL | METH_KEYWORDS), which get the
 * caller's argument array as it is, and read it by name here, then convert
 * each argument themselves (mpc_py_u64, mpc_py_int).  The checks are
 * PyArg's: too many, unknown or repeated keywords, missing required ones.
 * Measured, builds alternated in one sitting (benchmarks/fastpath_calls.py,
 * one rank, 4 KB, the core's own call, CPU us, best of 5 runs, five rounds
 * on cores slower that day than usual): barrier 0.22 to 0.37 after, 0.39
 * to 0.55 before; all_reduce 0.67 to 1.12, 0.99 to 1.40.  On two ranks
 * (`mpcore bench --only mpi-2r-...`, one run each): the core's barrier
 * 0.686 us after, 0.771 before; all_reduce 4 KB through torch.distributed
 * 4.49, 5.27; broadcast 4 KB 3.21, 4.53. */
int mpc_py_args(mpc_py_argv *av, const char *fname, const char *const *names, int required,
                PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject **out = av->a;
    int n = 0;
    while (names[n] != NULL)
        n++;
    av->fname = fname;
    av->names = names;
    if (n > MPC_PY_ARGS_MAX) {
        PyErr_Format(PyExc_SystemError, "%s() names more than %d arguments", fname,
                     MPC_PY_ARGS_MAX);
        return -1;
    }
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fname, n,
                     nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0));
        return -1;
    }
    for (int i = 0; i < n; i++)
        out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        for (; i < n; i++)
            if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0)
                break;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname,
                         key);
            return -1;
        }
        if (out[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                         names[i]);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (int i = 0; i < required; i++)
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)", fname,
                         names[i], i + 1);
            return -1;
        }
    return 0;
}

/* o's value, or -1 with its error told as fname's argument `name`'s. */
static int int_arg(PyObject *o, const char *fname, const char *name, long long lo,
                   unsigned long long hi, unsigned long long *v) {
    if (!PyLong_Check(o)) { /* as PyArg's formats, what has __index__ */
        PyObject *i = PyNumber_Index(o);
        if (i == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() argument '%s' must be int, not %s", fname,
                         name, Py_TYPE(o)->tp_name);
            return -1;
        }
        int r = int_arg(i, fname, name, lo, hi, v);
        Py_DECREF(i);
        return r;
    }
    int over = 0;
    long long s = PyLong_AsLongLongAndOverflow(o, &over);
    if (s == -1 && PyErr_Occurred())
        return -1;
    if (over == 0 && s >= lo && (s < 0 || (unsigned long long)s <= hi)) {
        *v = (unsigned long long)s;
        return 0;
    }
    if (over > 0 && lo >= 0 && hi == ULLONG_MAX) { /* past LLONG_MAX: a u64 still */
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (!(u == (unsigned long long)-1 && PyErr_Occurred())) {
            *v = u;
            return 0;
        }
        PyErr_Clear();
    }
    PyErr_Format(PyExc_OverflowError, "%s() argument '%s' is out of range", fname, name);
    return -1;
}

int mpc_py_u64(const mpc_py_argv *av, int i, uint64_t *v) {
    unsigned long long u;
    if (int_arg(av->a[i], av->fname, av->names[i], 0, ULLONG_MAX, &u) < 0)
        return -1;
    *v = (uint64_t)u;
    return 0;
}

int mpc_py_int(const mpc_py_argv *av, int i, int *v) {
    unsigned long long u;
    if (int_arg(av->a[i], av->fname, av->names[i], INT_MIN, INT_MAX, &u) < 0)
        return -1;
    *v = (int)(long long)u;
    return 0;
}

int64_t mpc_py_deadline(int block, PyObject *timeout) {
    if (!block)
        return 0;
    int64_t ns = mpc_py_timeout_ns(timeout);
    return ns < -1 ? ns : mpc_py_after(ns);
}

int64_t mpc_py_after(int64_t ns) { return ns < 0 ? -1 : mpc_now_ns() + ns; }

int64_t mpc_py_timeout_ns(PyObject *timeout) {
    if (timeout == NULL || timeout == Py_None)
        return -1;
    double t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred())
        return -2;
    if (!(t >= 0)) { /* NaN too */
        PyErr_SetString(PyExc_ValueError, "'timeout' must be a non-negative number");
        return -2;
    }
    if (t > 1e9)
        return -1;
    return (int64_t)(t * 1e9);
}

int mpc_py_intern(const mpc_py_name *names, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (*names[i].s == NULL && (*names[i].s = PyUnicode_InternFromString(names[i].text)) == NULL)
            return -1;
    return 0;
}

char **mpc_py_argv_new(PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "a command must be a sequence of str");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    char **argv = calloc((size_t)n + 1, sizeof *argv);
    if (argv == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *s = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(fast, i));
        if (s == NULL || (argv[i] = strdup(s)) == NULL) {
            if (s != NULL)
                PyErr_NoMemory();
            mpc_py_argv_free(argv);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    return argv;
}

void mpc_py_argv_free(char **argv) {
    for (char **a = argv; a && *a; a++)
        free(*a);
    free(argv);
}

/* Adds BUILD, what this extension was compiled against: the Python
 * headers' version and the numpy headers' ABI and C-API versions, with the
 * oldest numpy C API it needs (NPY_FEATURE_VERSION, numpy >= 2 headers
 * target older numpy too).  `mpcore doctor` reports them.  Returns 0, or -1
 * with an exception set. */
static int mpc_add_build(PyObject *m) {
#ifdef NPY_FEATURE_VERSION_STRING
    const char *oldest = NPY_FEATURE_VERSION_STRING;
#else
    const char *oldest = "";
#endif
    PyObject *build = Py_BuildValue(
        "{s:s,s:k,s:k,s:k,s:k,s:s}", "python", PY_VERSION, "python_hex",
        (unsigned long)PY_VERSION_HEX, "numpy_abi", (unsigned long)NPY_ABI_VERSION,
        "numpy_api", (unsigned long)NPY_API_VERSION, "numpy_feature",
        (unsigned long)NPY_FEATURE_VERSION, "numpy_oldest", oldest);
    if (build == NULL)
        return -1;
    int r = PyModule_AddObjectRef(m, "BUILD", build);
    Py_DECREF(build);
    return r;
}

static int mpc_exec(PyObject *m) {
    mpc_state *st = mpc_get_state(m);
    st->HandleError = PyErr_NewExceptionWithDoc(
        "mpcore.HandleError",
        "A shared-memory handle that is forged, corrupt, stale or out of bounds.",
        PyExc_ValueError, NULL);
    if (st->HandleError == NULL || PyModule_AddObjectRef(m, "HandleError", st->HandleError) < 0)
        return -1;
    mpc_clear_error();
    int rc = mpc_core_init();
    if (rc < 0) {
        mpc_py_raise(st, rc);
        return -1;
    }
    if (mpc_add_build(m) < 0)
        return -1;
    PyObject *queue = PyImport_ImportModule("queue");
    if (queue == NULL)
        return -1;
    st->QueueEmpty = PyObject_GetAttrString(queue, "Empty");
    st->QueueFull = PyObject_GetAttrString(queue, "Full");
    Py_DECREF(queue);
    if (st->QueueEmpty == NULL || st->QueueFull == NULL)
        return -1;
    if (PyModule_AddFunctions(m, mpc_py_block_methods) < 0 ||
        PyModule_AddFunctions(m, mpc_py_shm_methods) < 0 ||
        PyModule_AddFunctions(m, mpc_py_tensor_methods) < 0 ||
        PyModule_AddFunctions(m, mpc_py_ring_methods) < 0 ||
        PyModule_AddFunctions(m, mpc_py_proc_methods) < 0 ||
        PyModule_AddFunctions(m, mpc_py_collate_methods) < 0 ||
        PyModule_AddFunctions(m, mpc_py_coll_methods) < 0 ||
        PyModule_AddFunctions(m, mpc_py_pieces_methods) < 0 ||
        PyModule_AddFunctions(m, mpc_py_nccl_methods) < 0 ||
        PyModule_AddFunctions(m, mpc_py_fastpath_methods) < 0)
        return -1;
    if (mpc_py_block_exec(m, st) < 0 || mpc_py_tensor_exec(m, st) < 0 ||
        mpc_py_ring_exec(m, st) < 0 ||
        mpc_py_proc_exec(m, st) < 0 || mpc_py_pool_exec(m, st) < 0 ||
        mpc_py_coll_exec(m, st) < 0 || mpc_py_nccl_exec(m, st) < 0 ||
        mpc_py_lanelock_exec(m, st) < 0 || mpc_py_lane_exec(m, st) < 0 ||
        mpc_py_fastpath_exec(m, st) < 0)
        return -1;
    return 0;
}

static int mpc_traverse(PyObject *m, visitproc visit, void *arg) {
    mpc_state *st = mpc_get_state(m);
    Py_VISIT(st->HandleError);
    Py_VISIT(st->QueueEmpty);
    Py_VISIT(st->QueueFull);
    Py_VISIT(st->BlockType);
    Py_VISIT(st->RingType);
    Py_VISIT(st->GroupBufferType);
    return 0;
}

static int mpc_clear(PyObject *m) {
    mpc_state *st = mpc_get_state(m);
    Py_CLEAR(st->HandleError);
    Py_CLEAR(st->QueueEmpty);
    Py_CLEAR(st->QueueFull);
    Py_CLEAR(st->BlockType);
    Py_CLEAR(st->RingType);
    Py_CLEAR(st->GroupBufferType);
    return 0;
}

static void mpc_free(void *m) { mpc_clear((PyObject *)m); }

static PyModuleDef_Slot mpc_slots[] = {
    {Py_mod_exec, mpc_exec},
    {0, NULL},
};

static struct PyModuleDef mpc_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mpcore._core",
    .m_doc = "mpcore's C core: shared-memory blocks, the keeper, message rings.",
    .m_size = sizeof(mpc_state),
    .m_slots = mpc_slots,
    .m_traverse = mpc_traverse,
    .m_clear = mpc_clear,
    .m_free = mpc_free,
};

/* The module's entry point: returns its definition for multi-phase
 * initialisation (mpc_exec does the work).  Never fails. */
PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&mpc_module); }
