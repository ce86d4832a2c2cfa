/* nccl.c: NCCL, loaded at run time.  No header of CUDA or NCCL is needed to
 * build mpcore: the few functions used are looked up with dlsym, with the
 * types of NCCL's stable ABI declared here.  Which copy is loaded: the one
 * the process already has (torch's), else one of the paths the caller
 * names (the nvidia-nccl wheel's), else the system's.  Every NCCL failure
 * becomes -EIO with NCCL's own error string (and its last message, where
 * the library has ncclGetLastError) left in mpc_errmsg(). */
#include "internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

typedef int nccl_result;
typedef void *nccl_comm;

static struct {
    void *lib;
    nccl_result (*get_version)(int *);
    nccl_result (*get_unique_id)(mpc_nccl_id *);
    nccl_result (*comm_init_rank)(nccl_comm *, int, mpc_nccl_id, int);
    nccl_result (*comm_destroy)(nccl_comm);
    nccl_result (*comm_abort)(nccl_comm);
    nccl_result (*comm_get_async_error)(nccl_comm, nccl_result *);
    const char *(*get_error_string)(nccl_result);
    const char *(*get_last_error)(nccl_comm);
    nccl_result (*all_reduce)(const void *, void *, size_t, int, int, nccl_comm, void *);
    nccl_result (*broadcast)(const void *, void *, size_t, int, int, nccl_comm, void *);
    nccl_result (*all_gather)(const void *, void *, size_t, int, nccl_comm, void *);
    char where[256];
} nccl;

static pthread_mutex_t nccl_lock = PTHREAD_MUTEX_INITIALIZER;

void mpc__nccl_before_fork(void) { pthread_mutex_lock(&nccl_lock); }

void mpc__nccl_after_fork_parent(void) { pthread_mutex_unlock(&nccl_lock); }

void mpc__nccl_after_fork_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&nccl_lock, &fresh, sizeof fresh);
}

/* mpcore's dtype and op codes (MPC_DT_*, MPC_OP_*) in NCCL's numbering. */
/* -1: NCCL has no such dtype or op (bool, int16, uint16; the bitwise ops). */
static const int nccl_dtype[MPC_DT_COUNT] = {7, 8, 6, 9, 2, 4, 1, -1, 0, -1, -1, 3, 5};
static const int nccl_op[MPC_OP_COUNT] = {0, 4, 1, 3, 2, -1, -1, -1};

static int bind_symbols(void *lib) {
#define SYM(field, name)                                                                   \
    if ((*(void **)&nccl.field = dlsym(lib, name)) == NULL)                                 \
        return mpc_fail(ENOSYS, "the NCCL library has no %s", name);
    SYM(get_version, "ncclGetVersion")
    SYM(get_unique_id, "ncclGetUniqueId")
    SYM(comm_init_rank, "ncclCommInitRank")
    SYM(comm_destroy, "ncclCommDestroy")
    SYM(comm_abort, "ncclCommAbort")
    SYM(comm_get_async_error, "ncclCommGetAsyncError")
    SYM(get_error_string, "ncclGetErrorString")
    SYM(all_reduce, "ncclAllReduce")
    SYM(broadcast, "ncclBroadcast")
    SYM(all_gather, "ncclAllGather")
#undef SYM
    *(void **)&nccl.get_last_error = dlsym(lib, "ncclGetLastError"); /* NCCL >= 2.13 */
    nccl.lib = lib;
    return 0;
}

int mpc_nccl_load(const char *const *paths, int npaths, const char **where) {
    pthread_mutex_lock(&nccl_lock);
    int r = 0;
    if (nccl.lib != NULL)
        goto done;
    char tried[1024];
    size_t n = 0;
    tried[0] = '\0';
    void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (lib != NULL) {
        snprintf(nccl.where, sizeof nccl.where, "libnccl.so.2 already loaded in this process");
    }
    for (int i = 0; lib == NULL && i < npaths; i++) {
        lib = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
        if (lib != NULL)
            snprintf(nccl.where, sizeof nccl.where, "%s", paths[i]);
        else if (n < sizeof tried)
            n += (size_t)snprintf(tried + n, sizeof tried - n, "; %s", dlerror());
    }
    if (lib == NULL) {
        lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
        if (lib != NULL)
            snprintf(nccl.where, sizeof nccl.where, "libnccl.so.2 from the system's library path");
        else if (n < sizeof tried)
            n += (size_t)snprintf(tried + n, sizeof tried - n, "; %s", dlerror());
    }
    if (lib == NULL) {
        r = mpc_fail(ENOENT, "NCCL is not installed: no libnccl.so.2 in this process, in the "
                             "nvidia-nccl wheel or on the system's library path%s", tried);
        goto done;
    }
    if ((r = bind_symbols(lib)) < 0) {
        dlclose(lib);
        memset(&nccl, 0, sizeof nccl);
    }
done:
    if (r == 0)
        *where = nccl.where;
    pthread_mutex_unlock(&nccl_lock);
    return r;
}

/* Turns an NCCL result into 0 or -EIO with NCCL's explanation. */
static int check(nccl_result res, const char *what, nccl_comm comm) {
    if (res == 0)
        return 0;
    const char *last = nccl.get_last_error ? nccl.get_last_error(comm) : NULL;
    return mpc_fail(EIO, "NCCL %s failed: %s%s%s", what, nccl.get_error_string(res),
                    last && *last ? ": " : "", last && *last ? last : "");
}

static int loaded(void) {
    return nccl.lib ? 0 : mpc_fail(ENOENT, "NCCL is not loaded (call nccl_load first)");
}

int mpc_nccl_version(int *version) {
    int r = loaded();
    return r < 0 ? r : check(nccl.get_version(version), "ncclGetVersion", NULL);
}

int mpc_nccl_unique_id(mpc_nccl_id *id) {
    int r = loaded();
    return r < 0 ? r : check(nccl.get_unique_id(id), "ncclGetUniqueId", NULL);
}

int mpc_nccl_comm_init(void **comm, int nranks, const mpc_nccl_id *id, int rank) {
    int r = loaded();
    if (r < 0)
        return r;
    *comm = NULL;
    return check(nccl.comm_init_rank(comm, nranks, *id, rank), "ncclCommInitRank", NULL);
}

int mpc_nccl_comm_free(void *comm, int abort) {
    int r = loaded();
    if (r < 0 || comm == NULL)
        return r;
    return abort ? check(nccl.comm_abort(comm), "ncclCommAbort", NULL)
                 : check(nccl.comm_destroy(comm), "ncclCommDestroy", NULL);
}

int mpc_nccl_async_error(void *comm) {
    nccl_result res = 0;
    int r = loaded();
    if (r < 0)
        return r;
    if ((r = check(nccl.comm_get_async_error(comm, &res), "ncclCommGetAsyncError", comm)) < 0)
        return r;
    return check(res, "communicator", comm);
}

int mpc_nccl_all_reduce(void *comm, const void *send, void *recv, size_t count, int dtype,
                        int op, void *stream) {
    int r = loaded();
    if (r < 0)
        return r;
    if (dtype < 0 || dtype >= MPC_DT_COUNT || op < 0 || op >= MPC_OP_COUNT)
        return mpc_fail(EINVAL, "unknown dtype %d or op %d", dtype, op);
    if (nccl_dtype[dtype] < 0 || nccl_op[op] < 0)
        return mpc_fail(EINVAL, "NCCL has no all-reduce of %s with %s",
                        mpc_coll_dtype_name(dtype), mpc_coll_op_name(op));
    return check(nccl.all_reduce(send, recv, count, nccl_dtype[dtype], nccl_op[op], comm, stream),
                 "ncclAllReduce", comm);
}

int mpc_nccl_broadcast(void *comm, const void *send, void *recv, size_t nbytes, int root,
                       void *stream) {
    int r = loaded();
    return r < 0 ? r
                 : check(nccl.broadcast(send, recv, nbytes, nccl_dtype[MPC_DT_U8], root, comm,
                                        stream),
                         "ncclBroadcast", comm);
}

int mpc_nccl_all_gather(void *comm, const void *send, void *recv, size_t nbytes, void *stream) {
    int r = loaded();
    return r < 0 ? r
                 : check(nccl.all_gather(send, recv, nbytes, nccl_dtype[MPC_DT_U8], comm, stream),
                         "ncclAllGather", comm);
}
