/* moe_rt core: NCCL, loaded at run time with dlopen, and the communicator of the C ABI (include/moe_rt/moe_rt.h,
 * "NCCL and the communicator"). The NCCL API is declared here by hand (the ABI of nccl.h, NCCL >= 2.18), so no
 * NCCL header is needed to build. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- the NCCL API, by hand ------------------------------------------------------------------------------- */
typedef int ncclResult_t;
typedef struct ncclComm* ncclComm_t;
typedef struct {
  char internal[MOE_RT_NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

enum { ncclSuccess = 0, ncclInProgress = 7 };
/* ncclDataType_t */
enum {
  ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
  ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9
};
/* ncclRedOp_t */
enum { ncclSum = 0, ncclMax = 2 };

typedef struct nccl_api {
  ncclResult_t (*GetVersion)(int*);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*CommCount)(ncclComm_t, int*);
  ncclResult_t (*CommUserRank)(ncclComm_t, int*);
  const char* (*GetErrorString)(ncclResult_t);
  const char* (*GetLastError)(ncclComm_t);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  ncclResult_t (*Send)(const void*, size_t, int, int, ncclComm_t, void*);
  ncclResult_t (*Recv)(void*, size_t, int, int, ncclComm_t, void*);
  ncclResult_t (*AllGather)(const void*, void*, size_t, int, ncclComm_t, void*);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, int, int, ncclComm_t, void*);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, int, int, ncclComm_t, void*);
} nccl_api;

struct moe_rt_comm {
  ncclComm_t comm;
  int nranks, rank;
  int aborted; /* ncclCommAbort'ed by a wait of the core (mrt_comm_abort_in_place): only freeing is left */
};

static nccl_api g_nccl;           /* filled once, under g_load_lock, before g_loaded is set */
static atomic_int g_loaded;       /* 1 once g_nccl is complete */
static char g_path[4096];         /* the path NCCL was opened by */
static pthread_mutex_t g_load_lock = PTHREAD_MUTEX_INITIALIZER;

static _Thread_local moe_rt_nccl_failure g_failure;

static void clear(void) {
  mrt_clear_error();
  g_failure.result = 0;
  g_failure.call[0] = 0;
  g_failure.message[0] = 0;
}

/* NCCL's text for result, then "; " and comm's ncclGetLastError when it has one. */
static void nccl_message(ncclResult_t result, ncclComm_t comm, char* out, size_t bytes) {
  const char* s = g_nccl.GetErrorString ? g_nccl.GetErrorString(result) : NULL;
  const char* last = g_nccl.GetLastError ? g_nccl.GetLastError(comm) : NULL;
  if (last != NULL && last[0] != 0)
    snprintf(out, bytes, "%s; %s", s ? s : "unknown error", last);
  else
    snprintf(out, bytes, "%s", s ? s : "unknown error");
}

static moe_rt_status nccl_fail(moe_rt_status status, const char* call, ncclResult_t result) {
  g_failure.result = result;
  snprintf(g_failure.call, sizeof g_failure.call, "%s", call);
  return mrt_fail(status, "%s failed: %s (ncclResult_t %d)", call, g_failure.message, result);
}

/* MOE_RT_SUCCESS for ncclSuccess and ncclInProgress, else MOE_RT_ERROR_NCCL naming the call. */
static moe_rt_status check(ncclResult_t result, const char* call, ncclComm_t comm) {
  if (result == ncclSuccess || result == ncclInProgress) return MOE_RT_SUCCESS;
  nccl_message(result, comm, g_failure.message, sizeof g_failure.message);
  return nccl_fail(MOE_RT_ERROR_NCCL, call, result);
}

/* ---- loading ---------------------------------------------------------------------------------------------- */

static moe_rt_status load_locked(const char* path) {
  char found[sizeof g_path];
  if (path == NULL || !*path) {
    const char* env = getenv("MOE_RT_NCCL_PATH");
    if (env != NULL && *env) {
      path = env;
    } else {
      /* a copy already loaded in the process (by torch, CuPy or the nvidia-nccl wheel's loader) */
      void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
      path = "libnccl.so.2";
      if (h != NULL) {
        Dl_info info;
        void* sym = dlsym(h, "ncclGetVersion");
        if (sym != NULL && dladdr(sym, &info) && info.dli_fname && *info.dli_fname) {
          snprintf(found, sizeof found, "%s", info.dli_fname);
          path = found;
        }
        dlclose(h);
      }
    }
  }
  void* lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (lib == NULL) {
    const char* why = dlerror();
    return mrt_fail(MOE_RT_ERROR_NO_NCCL, "cannot load NCCL from %s: %s", path, why ? why : "unknown error");
  }
  nccl_api api;
  memset(&api, 0, sizeof api);
#define SYM(field, name)                                                                                   \
  do {                                                                                                     \
    *(void**)(&api.field) = dlsym(lib, name);                                                              \
    if (api.field == NULL) {                                                                               \
      dlclose(lib);                                                                                        \
      snprintf(g_failure.message, sizeof g_failure.message, "symbol not found in %.900s", path);           \
      return nccl_fail(MOE_RT_ERROR_NO_NCCL, name, -1);                                                    \
    }                                                                                                      \
  } while (0)
  SYM(GetVersion, "ncclGetVersion");
  SYM(GetUniqueId, "ncclGetUniqueId");
  SYM(CommInitRank, "ncclCommInitRank");
  SYM(CommDestroy, "ncclCommDestroy");
  SYM(CommAbort, "ncclCommAbort");
  SYM(CommGetAsyncError, "ncclCommGetAsyncError");
  SYM(CommCount, "ncclCommCount");
  SYM(CommUserRank, "ncclCommUserRank");
  SYM(GetErrorString, "ncclGetErrorString");
  SYM(GetLastError, "ncclGetLastError");
  SYM(GroupStart, "ncclGroupStart");
  SYM(GroupEnd, "ncclGroupEnd");
  SYM(Send, "ncclSend");
  SYM(Recv, "ncclRecv");
  SYM(AllGather, "ncclAllGather");
  SYM(AllReduce, "ncclAllReduce");
  SYM(Broadcast, "ncclBroadcast");
#undef SYM
  snprintf(g_path, sizeof g_path, "%s", path);
  g_nccl = api;
  atomic_store_explicit(&g_loaded, 1, memory_order_release);
  return MOE_RT_SUCCESS;
}

static moe_rt_status ensure(const char* path) {
  if (atomic_load_explicit(&g_loaded, memory_order_acquire)) return MOE_RT_SUCCESS;
  pthread_mutex_lock(&g_load_lock);
  moe_rt_status st = atomic_load_explicit(&g_loaded, memory_order_relaxed) ? MOE_RT_SUCCESS : load_locked(path);
  pthread_mutex_unlock(&g_load_lock);
  return st;
}

moe_rt_status moe_rt_nccl_load(const char* path) {
  clear();
  return ensure(path);
}

moe_rt_status moe_rt_nccl_library_path(const char** path) {
  clear();
  if (path == NULL) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_nccl_library_path: path is NULL");
  moe_rt_status st = ensure(NULL);
  if (st) return st;
  *path = g_path;
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_nccl_version(int* major, int* minor, int* patch) {
  clear();
  const char* op = "moe_rt_nccl_version";
  moe_rt_status st;
  if ((st = mrt_check_ptr(op, "major", major)) || (st = mrt_check_ptr(op, "minor", minor)) ||
      (st = mrt_check_ptr(op, "patch", patch)) || (st = ensure(NULL)))
    return st;
  int v = 0;
  if ((st = check(g_nccl.GetVersion(&v), "ncclGetVersion", NULL))) return st;
  if (v >= 10000) {
    *major = v / 10000, *minor = (v % 10000) / 100, *patch = v % 100;
  } else {
    *major = v / 1000, *minor = (v % 1000) / 100, *patch = v % 100;
  }
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_nccl_error_string(int result, const char** text) {
  clear();
  moe_rt_status st;
  if ((st = mrt_check_ptr("moe_rt_nccl_error_string", "text", text)) || (st = ensure(NULL))) return st;
  const char* s = g_nccl.GetErrorString(result);
  *text = s ? s : "unknown error";
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_nccl_last_failure(moe_rt_nccl_failure* out) {
  if (out == NULL) {
    mrt_clear_error();
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_nccl_last_failure: out is NULL");
  }
  *out = g_failure; /* read before anything clears it */
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_nccl_get_unique_id(void* id) {
  clear();
  moe_rt_status st;
  if ((st = mrt_check_ptr("moe_rt_nccl_get_unique_id", "id", id)) || (st = ensure(NULL))) return st;
  ncclUniqueId uid;
  if ((st = check(g_nccl.GetUniqueId(&uid), "ncclGetUniqueId", NULL))) return st;
  memcpy(id, uid.internal, sizeof uid.internal);
  return MOE_RT_SUCCESS;
}

/* ---- the communicator --------------------------------------------------------------------------------------- */

static moe_rt_status comm_null(const char* op, const moe_rt_comm* comm) {
  clear();
  if (comm == NULL)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: comm is NULL; make one with moe_rt_comm_init_rank", op);
  if (comm->aborted)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: comm was aborted (a wait of the core timed out or met an "
                    "NCCL error); free it with moe_rt_comm_abort or moe_rt_comm_destroy", op);
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_comm_init_rank(const void* unique_id, int nranks, int rank, moe_rt_comm** comm) {
  clear();
  const char* op = "moe_rt_comm_init_rank";
  moe_rt_status st;
  if ((st = mrt_check_ptr(op, "comm", comm))) return st;
  *comm = NULL;
  if ((st = mrt_check_ptr(op, "unique_id", unique_id))) return st;
  if (nranks < 1) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: nranks must be >= 1, got %d", op, nranks);
  if (rank < 0 || rank >= nranks)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: rank must be in [0, %d), got %d", op, nranks, rank);
  if ((st = ensure(NULL))) return st;
  moe_rt_comm* c = calloc(1, sizeof *c);
  if (c == NULL) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: out of host memory", op);
  ncclUniqueId uid;
  memcpy(uid.internal, unique_id, sizeof uid.internal);
  ncclComm_t nc = NULL;
  if ((st = check(g_nccl.CommInitRank(&nc, nranks, uid, rank), "ncclCommInitRank", NULL))) {
    free(c);
    return st;
  }
  c->comm = nc, c->nranks = nranks, c->rank = rank;
  *comm = c;
  return MOE_RT_SUCCESS;
}

/* End comm: ncclCommDestroy (abort 0) or ncclCommAbort (abort 1), then free it; one a wait of the core already
 * aborted (mrt_comm_abort_in_place) is only freed. */
static moe_rt_status comm_end(moe_rt_comm* comm, int abort) {
  clear();
  if (comm == NULL) return MOE_RT_SUCCESS;
  moe_rt_status st = MOE_RT_SUCCESS;
  if (!comm->aborted && (st = ensure(NULL)) == MOE_RT_SUCCESS)
    st = abort ? check(g_nccl.CommAbort(comm->comm), "ncclCommAbort", NULL)
               : check(g_nccl.CommDestroy(comm->comm), "ncclCommDestroy", NULL);
  free(comm);
  return st;
}

moe_rt_status moe_rt_comm_destroy(moe_rt_comm* comm) { return comm_end(comm, 0); }

moe_rt_status moe_rt_comm_abort(moe_rt_comm* comm) { return comm_end(comm, 1); }

moe_rt_status moe_rt_comm_async_error(moe_rt_comm* comm, int* result, char* message, size_t message_bytes) {
  const char* op = "moe_rt_comm_async_error";
  moe_rt_status st;
  if ((st = comm_null(op, comm)) || (st = mrt_check_ptr(op, "result", result))) return st;
  if (message != NULL && message_bytes < 1)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: message_bytes must be >= 1 with a message buffer", op);
  if ((st = ensure(NULL))) return st;
  ncclResult_t res = 0;
  if ((st = check(g_nccl.CommGetAsyncError(comm->comm, &res), "ncclCommGetAsyncError", comm->comm))) return st;
  *result = res;
  if (message != NULL) {
    message[0] = 0;
    if (res != ncclSuccess && res != ncclInProgress) nccl_message(res, comm->comm, message, message_bytes);
  }
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_comm_aborted(const moe_rt_comm* comm, int* aborted) {
  clear();
  moe_rt_status st;
  if ((st = mrt_check_ptr("moe_rt_comm_aborted", "aborted", aborted))) return st;
  if (comm == NULL)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_comm_aborted: comm is NULL; make one with "
                    "moe_rt_comm_init_rank");
  *aborted = comm->aborted;
  return MOE_RT_SUCCESS;
}

/* ---- for the core's own collectives (internal.h) ------------------------------------------------------------ */

void mrt_comm_shape(const moe_rt_comm* comm, int* nranks, int* rank) {
  *nranks = comm ? comm->nranks : 1;
  *rank = comm ? comm->rank : 0;
}

void mrt_comm_abort_in_place(moe_rt_comm* comm) {
  if (comm == NULL || comm->aborted) return;
  comm->aborted = 1;
  if (atomic_load_explicit(&g_loaded, memory_order_acquire)) g_nccl.CommAbort(comm->comm);
}

moe_rt_status mrt_comm_poll(moe_rt_comm* comm, const char* op) {
  if (comm == NULL || comm->aborted || !atomic_load_explicit(&g_loaded, memory_order_acquire)) return MOE_RT_SUCCESS;
  ncclResult_t res = 0;
  if (g_nccl.CommGetAsyncError(comm->comm, &res) != ncclSuccess || res == ncclSuccess || res == ncclInProgress)
    return MOE_RT_SUCCESS;
  nccl_message(res, comm->comm, g_failure.message, sizeof g_failure.message);
  g_failure.result = res;
  snprintf(g_failure.call, sizeof g_failure.call, "%s", "ncclCommGetAsyncError");
  mrt_comm_abort_in_place(comm);
  return mrt_fail(MOE_RT_ERROR_NCCL, "%s: the communicator failed while waiting: %s (ncclResult_t %d); the "
                  "communicator was aborted", op, g_failure.message, res);
}

moe_rt_status moe_rt_comm_count(const moe_rt_comm* comm, int* count) {
  moe_rt_status st;
  if ((st = comm_null("moe_rt_comm_count", comm)) || (st = mrt_check_ptr("moe_rt_comm_count", "count", count)) ||
      (st = ensure(NULL)))
    return st;
  return check(g_nccl.CommCount(comm->comm, count), "ncclCommCount", comm->comm);
}

moe_rt_status moe_rt_comm_user_rank(const moe_rt_comm* comm, int* rank) {
  moe_rt_status st;
  if ((st = comm_null("moe_rt_comm_user_rank", comm)) || (st = mrt_check_ptr("moe_rt_comm_user_rank", "rank", rank)) ||
      (st = ensure(NULL)))
    return st;
  return check(g_nccl.CommUserRank(comm->comm, rank), "ncclCommUserRank", comm->comm);
}

moe_rt_status moe_rt_comm_nccl_handle(const moe_rt_comm* comm, void** nccl_comm) {
  moe_rt_status st;
  if ((st = comm_null("moe_rt_comm_nccl_handle", comm)) ||
      (st = mrt_check_ptr("moe_rt_comm_nccl_handle", "nccl_comm", nccl_comm)))
    return st;
  *nccl_comm = comm->comm;
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_comm_group_start(void) {
  clear();
  moe_rt_status st = ensure(NULL);
  return st ? st : check(g_nccl.GroupStart(), "ncclGroupStart", NULL);
}

moe_rt_status moe_rt_comm_group_end(const moe_rt_comm* comm) {
  clear();
  moe_rt_status st = ensure(NULL);
  return st ? st : check(g_nccl.GroupEnd(), "ncclGroupEnd", comm ? comm->comm : NULL);
}

/* The ncclDataType_t of a moe_rt dtype code, -1 for one NCCL has no type for. */
static int nccl_type_of(int dtype) {
  switch (dtype) {
    case MOE_RT_INT8: return ncclInt8;
    case MOE_RT_UINT8: return ncclUint8;
    case MOE_RT_INT32: return ncclInt32;
    case MOE_RT_UINT32: return ncclUint32;
    case MOE_RT_INT64: return ncclInt64;
    case MOE_RT_UINT64: return ncclUint64;
    case MOE_RT_FLOAT16: return ncclFloat16;
    case MOE_RT_FLOAT32: return ncclFloat32;
    case MOE_RT_FLOAT64: return ncclFloat64;
    case MOE_RT_BFLOAT16: return ncclBfloat16;
  }
  return -1;
}

static moe_rt_status bad_dtype(const char* op, int dtype) {
  return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT,
                  "%s: dtype: no NCCL data type for %s (%d); expected int8, uint8, int32, uint32, int64, uint64, "
                  "float16, float32, float64 or bfloat16", op, mrt_dtype_name(dtype), dtype);
}

moe_rt_status moe_rt_nccl_dtype(int dtype, int* nccl_type) {
  clear();
  moe_rt_status st;
  if ((st = mrt_check_ptr("moe_rt_nccl_dtype", "nccl_type", nccl_type))) return st;
  const int t = nccl_type_of(dtype);
  if (t < 0) return bad_dtype("moe_rt_nccl_dtype", dtype);
  *nccl_type = t;
  return MOE_RT_SUCCESS;
}

/* The data calls' checks: comm, count >= 0, dtype, the buffers (NULL allowed with count 0), the peer or root. */
static moe_rt_status check_data(const char* op, const moe_rt_comm* comm, int64_t count, int dtype, int* type,
                                const char* n1, const void* p1, const char* n2, const void* p2, const char* rank_name,
                                int r) {
  moe_rt_status st;
  if ((st = comm_null(op, comm))) return st;
  if (count < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: count must be >= 0, got %lld", op, (long long)count);
  if ((*type = nccl_type_of(dtype)) < 0) return bad_dtype(op, dtype);
  if ((st = mrt_check_data(op, n1, p1, count))) return st;
  if (n2 != NULL && (st = mrt_check_data(op, n2, p2, count))) return st;
  if (rank_name != NULL && (r < 0 || r >= comm->nranks))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: %s must be in [0, %d), got %d", op, rank_name, comm->nranks, r);
  return ensure(NULL);
}

moe_rt_status moe_rt_comm_send(moe_rt_comm* comm, const void* buf, int64_t count, int dtype, int peer,
                               moe_rt_stream stream) {
  int t;
  moe_rt_status st = check_data("moe_rt_comm_send", comm, count, dtype, &t, "buf", buf, NULL, NULL, "peer", peer);
  return st ? st : check(g_nccl.Send(buf, (size_t)count, t, peer, comm->comm, stream), "ncclSend", comm->comm);
}

moe_rt_status moe_rt_comm_recv(moe_rt_comm* comm, void* buf, int64_t count, int dtype, int peer,
                               moe_rt_stream stream) {
  int t;
  moe_rt_status st = check_data("moe_rt_comm_recv", comm, count, dtype, &t, "buf", buf, NULL, NULL, "peer", peer);
  return st ? st : check(g_nccl.Recv(buf, (size_t)count, t, peer, comm->comm, stream), "ncclRecv", comm->comm);
}

moe_rt_status moe_rt_comm_all_gather(moe_rt_comm* comm, const void* send, void* recv, int64_t count, int dtype,
                                     moe_rt_stream stream) {
  int t;
  moe_rt_status st = check_data("moe_rt_comm_all_gather", comm, count, dtype, &t, "send", send, "recv", recv, NULL, 0);
  return st ? st
            : check(g_nccl.AllGather(send, recv, (size_t)count, t, comm->comm, stream), "ncclAllGather", comm->comm);
}

moe_rt_status moe_rt_comm_all_reduce(moe_rt_comm* comm, const void* send, void* recv, int64_t count, int dtype,
                                     int op, moe_rt_stream stream) {
  int t;
  moe_rt_status st = check_data("moe_rt_comm_all_reduce", comm, count, dtype, &t, "send", send, "recv", recv, NULL, 0);
  if (st) return st;
  if (op != MOE_RT_REDUCE_SUM && op != MOE_RT_REDUCE_MAX)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT,
                    "moe_rt_comm_all_reduce: op must be MOE_RT_REDUCE_SUM (0) or MOE_RT_REDUCE_MAX (1), got %d", op);
  const int nop = op == MOE_RT_REDUCE_SUM ? ncclSum : ncclMax;
  return check(g_nccl.AllReduce(send, recv, (size_t)count, t, nop, comm->comm, stream), "ncclAllReduce", comm->comm);
}

moe_rt_status moe_rt_comm_broadcast(moe_rt_comm* comm, const void* send, void* recv, int64_t count, int dtype,
                                    int root, moe_rt_stream stream) {
  int t;
  moe_rt_status st = check_data("moe_rt_comm_broadcast", comm, count, dtype, &t, "recv", recv, NULL, NULL, "root", root);
  if (st) return st;
  if (comm->rank == root && (st = mrt_check_data("moe_rt_comm_broadcast", "send", send, count))) return st;
  return check(g_nccl.Broadcast(send, recv, (size_t)count, t, root, comm->comm, stream), "ncclBroadcast", comm->comm);
}
