/* py_mpcore.h: what the binding files (py_*.c) share.  Only they include
 * Python.h; the core (mpcore.h) never does. */
#ifndef PY_MPCORE_H
#define PY_MPCORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <numpy/npy_common.h> /* npy_intp, for the views of a Block */

#include "mpcore.h"

/* The module's state: the exception types the core's codes map to. */
typedef struct {
    PyObject *HandleError; /* mpcore.HandleError(ValueError) */
    PyObject *QueueEmpty;  /* queue.Empty */
    PyObject *QueueFull;   /* queue.Full */
    PyTypeObject *BlockType;
    PyTypeObject *RingType;
    PyTypeObject *GroupBufferType;
} mpc_state;

/* Returns the state of the module object.  Never fails. */
mpc_state *mpc_get_state(PyObject *module);
/* Returns the state of the module that defined `type` (for methods of our
 * types), or NULL (no exception set) if the type is not the module's. */
mpc_state *mpc_type_state(PyTypeObject *type);

/* Turns a negative code from the core into the matching exception, with
 * mpc_errmsg() as its message when there is one.  Always returns NULL.
 *   -MPC_ENOSHM -> MemoryError ("out of shared memory" when no message),
 *   -ENOMEM -> MemoryError, -MPC_EHANDLE/-MPC_ESTALE/-MPC_ENOSEG ->
 *   HandleError, -ETIMEDOUT -> TimeoutError, -EINVAL -> ValueError, other
 *   errnos -> OSError(errno, message) (so -ENOENT is FileNotFoundError). */
PyObject *mpc_py_raise(mpc_state *st, int err);

/* Converts a Python timeout (None = forever, number of seconds) into a
 * deadline for the core: -1 forever, else an absolute monotonic time in ns.
 * block == 0 gives 0 (do not wait).  Returns -2 with ValueError set for a
 * negative timeout. */
int64_t mpc_py_deadline(int block, PyObject *timeout);

/* Returns a Python timeout as nanoseconds from now: -1 forever (None, or
 * more than 1e9 s), else 0 or more; -2 with ValueError or TypeError set
 * for a negative or NaN timeout or one that is not a number. */
int64_t mpc_py_timeout_ns(PyObject *timeout);

/* Returns mpc_py_deadline's deadline for ns from mpc_py_timeout_ns (-1
 * for -1), reading the clock only now; never fails. */
int64_t mpc_py_after(int64_t ns);

/* A vectorcall method's arguments (METH_FASTCALL | METH_KEYWORDS) by name
 * (NOTE [ Arguments read without a tuple ] in py_core.c): a[i] is the
 * argument for names[i] (at most MPC_PY_ARGS_MAX names), borrowed, or NULL
 * where not given. */
#define MPC_PY_ARGS_MAX 8
typedef struct {
    const char *fname;
    const char *const *names;
    PyObject *a[MPC_PY_ARGS_MAX];
} mpc_py_argv;

/* Fills av from args and kwnames for fname's names (a NULL-terminated
 * list).  Returns 0, or -1 with TypeError naming fname for too many
 * arguments, an unknown or repeated keyword, or one of the first
 * `required` names missing: what PyArg_ParseTupleAndKeywords checks. */
int mpc_py_args(mpc_py_argv *av, const char *fname, const char *const *names, int required,
                PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* Reads argument i of av (an int, or what has __index__) into *v.  Returns
 * 0, or -1 with TypeError (not an int) or OverflowError (out of range,
 * negative for mpc_py_u64), each naming the function and the argument. */
int mpc_py_u64(const mpc_py_argv *av, int i, uint64_t *v);
int mpc_py_int(const mpc_py_argv *av, int i, int *v);

/* A NULL-terminated, malloc'd copy of a sequence of str (a command), or
 * NULL with an exception set; freed by mpc_py_argv_free. */
char **mpc_py_argv_new(PyObject *seq);

/* A name a binding file looks attributes up by, interned once. */
typedef struct {
    PyObject **s;     /* where the interned string goes (kept once set) */
    const char *text;
} mpc_py_name;

/* Interns each of n names not interned yet.  Returns 0, or -1 with an
 * exception set. */
int mpc_py_intern(const mpc_py_name *names, size_t n);
void mpc_py_argv_free(char **argv);

/* Rings (py_ring.c), for other bindings that wait on one.
 * mpc_py_ring_of: the ring of a Ring object, or NULL with TypeError.
 * mpc_py_ring_get: mpc_ring_get that waits until deadline with the GIL
 *   released, running signal handlers; returns 0 or -errno (-EINTR with an
 *   exception set when a handler raised).
 * mpc_py_ring_message: (refs, payload) as Ring.get returns them.
 * mpc_py_ring_raise: the exception for a failed get (Empty on timeout);
 *   returns NULL. */
mpc_ring *mpc_py_ring_of(mpc_state *st, PyObject *o);
int mpc_py_ring_get(mpc_ring *r, int64_t deadline, mpc_ref **refs, uint32_t *nrefs,
                    void **payload, uint64_t *len);
PyObject *mpc_py_ring_message(const mpc_ref *refs, uint32_t nrefs, const void *payload,
                              uint64_t len);
PyObject *mpc_py_ring_raise(PyObject *ring, int rc);

/* ------------------------------------------------------------------ */
/* Blocks (py_block.c)                                                 */
/* ------------------------------------------------------------------ */

/* A Block object: this process's hold on one block (NOTE [ One Block
 * object per block ] in py_block.c).  keys is the torch side's
 * (py_tensor.c): its entries of _torch._storages for this block, or NULL. */
typedef struct BlockObject {
    PyObject_HEAD
    mpc_block b;
    int held;
    PyObject *weakreflist;
    PyObject *keys;
    struct BlockObject *next; /* in py_block.c's table */
} BlockObject;

/* A new Block of nbytes, with its first byte in *addr; NULL with
 * MemoryError (naming the sizes) or another exception on failure. */
PyObject *mpc_py_block_alloc(mpc_state *st, uint64_t nbytes, void **addr);

/* Returns the Block object of a block this process has just come to hold
 * (its hold passes to the object), or NULL with an exception set, the
 * block then released. */
PyObject *mpc_py_block_wrap(mpc_state *st, const mpc_block *b);

/* Returns a new data Block holding a copy of n bytes at src (copied with
 * the GIL released), or NULL with an exception set. */
PyObject *mpc_py_block_copy(mpc_state *st, const void *src, uint64_t n);

/* Redeems ref's ticket: returns this process's Block for it (a new
 * reference; the one it already has, if any), or NULL with an exception
 * set (the ticket then unredeemed).  Only connecting to the keeper and
 * mapping a new segment release the GIL. */
PyObject *mpc_py_block_attach(mpc_state *st, mpc_ref ref);

/* Returns the Block object this process holds for a block (a borrowed
 * reference), or NULL (no exception set) when it holds none.  Never
 * fails. */
BlockObject *mpc_py_block_lookup(uint64_t seg, uint32_t index, uint32_t gen);

/* Checks that a view (itemsize, shape, strides in bytes, byte offset)
 * lies inside bytes [start, end) of the block (end < 0: its end).
 * Returns 0, or -1 with HandleError set. */
int mpc_py_block_check_view(BlockObject *self, Py_ssize_t itemsize, int nd,
                            const npy_intp *shape, const npy_intp *strides, Py_ssize_t offset,
                            Py_ssize_t start, Py_ssize_t end);

/* Reads a sequence of at most NPY_MAXDIMS integers (a shape or strides)
 * into out and its length into *nd.  Returns 0, or -1 with an exception
 * set; with E set, a value out of range raises E (a handle's fault)
 * instead of OverflowError. */
int mpc_py_parse_dims(PyObject *seq, npy_intp *out, int *nd, const char *what, PyObject *E);

/* Reads a (segment, index, generation) tuple into *ref.  Returns 0, or -1
 * with TypeError or OverflowError set when it is not three integers in
 * range. */
int mpc_py_parse_ref(PyObject *t, mpc_ref *ref);

/* Sets the function that a Block's dealloc calls first, while the Block
 * is still whole (the torch side's, which drops its entries for the
 * block; it must keep any exception already set).  Never fails. */
void mpc_py_block_set_forget(void (*fn)(BlockObject *));

/* The lane's lock (py_lanelock.c), taken for ever or given back once by
 * this thread when lock is a LaneLock: 1 when done, 0 when lock is of
 * another type (nothing done: the caller calls its methods), -1 with an
 * exception set (a signal's handler raised while it waited, the count
 * would overflow, or the lock is not held by this thread). */
int mpc_py_lanelock_take(PyObject *lock);
int mpc_py_lanelock_give(PyObject *lock);

/* Each binding file adds its types and functions to the module; each
 * returns 0, or -1 with an exception set. */
int mpc_py_block_exec(PyObject *m, mpc_state *st);
int mpc_py_tensor_exec(PyObject *m, mpc_state *st);
int mpc_py_ring_exec(PyObject *m, mpc_state *st);
int mpc_py_proc_exec(PyObject *m, mpc_state *st);
int mpc_py_pool_exec(PyObject *m, mpc_state *st);
int mpc_py_coll_exec(PyObject *m, mpc_state *st);
int mpc_py_nccl_exec(PyObject *m, mpc_state *st);
int mpc_py_lanelock_exec(PyObject *m, mpc_state *st);
int mpc_py_lane_exec(PyObject *m, mpc_state *st);
int mpc_py_fastpath_exec(PyObject *m, mpc_state *st);
extern PyMethodDef mpc_py_block_methods[];
extern PyMethodDef mpc_py_shm_methods[];
extern PyMethodDef mpc_py_tensor_methods[];
extern PyMethodDef mpc_py_ring_methods[];
extern PyMethodDef mpc_py_proc_methods[];
extern PyMethodDef mpc_py_collate_methods[];
extern PyMethodDef mpc_py_coll_methods[];
extern PyMethodDef mpc_py_pieces_methods[];
extern PyMethodDef mpc_py_nccl_methods[];
extern PyMethodDef mpc_py_fastpath_methods[];

/* A Group's barrier, all_reduce and broadcast (py_coll.c), with their
 * arguments as Group's methods take them (b: the group buffer, or NULL).
 * Each returns None, or NULL with the exception the method raises
 * (TypeError when op is not a Group). */
PyObject *mpc_py_group_barrier(PyObject *op, PyObject *timeout);
PyObject *mpc_py_group_all_reduce(PyObject *op, uint64_t addr, uint64_t count, int dtype,
                                  int rop, mpc_coll_buf *b, PyObject *timeout);
PyObject *mpc_py_group_broadcast(PyObject *op, uint64_t addr, uint64_t nbytes, int root,
                                 PyObject *timeout);

/* The calls queued on a Lane (py_lane.c), or -1 (no exception set) when
 * lane is not one. */
Py_ssize_t mpc_py_lane_queued(PyObject *lane);

/* lane.post(work_type, result, fn, args, keep, small) for a Lane (which
 * the caller has checked, mpc_py_lane_queued): the Work of fn(*args,
 * timeout) queued there; NULL with an exception. */
PyObject *mpc_py_lane_post(PyObject *lane, PyObject *work_type, PyObject *result, PyObject *fn,
                           PyObject *args, PyObject *keep, int small);

#endif
