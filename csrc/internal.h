/* moe_rt core: what the C sources share (not installed; the public ABI is include/moe_rt/moe_rt.h). */
#ifndef MOE_RT_INTERNAL_H_
#define MOE_RT_INTERNAL_H_

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_rt/moe_rt.h"

/* Everything below is internal to the library (only moe_rt_* symbols are exported). */
#pragma GCC visibility push(hidden)

/* ---- the CUDA driver API, reached through dlopen("libcuda.so.1") ---------------------------------- */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef unsigned long long CUdeviceptr;
typedef struct CUipcMemHandle_st {
  char reserved[64];
} CUipcMemHandle;

#define CUDA_ERROR_NOT_READY 600
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1

#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR 81
#define CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN 97
#define CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK 0
#define CU_FUNC_ATTRIBUTE_NUM_REGS 4
#define CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8

typedef struct mrt_driver {
  void* lib;
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuModuleGetGlobal)(CUdeviceptr*, size_t*, CUmodule, const char*);
  CUresult (*cuFuncGetAttribute)(int*, int, CUfunction);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t);
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamIsCapturing)(CUstream, int*); /* *status: 0 none, 1 active, 2 invalidated */
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
  /* the peer buffers' (csrc/peer.c; NULL where the driver lacks them, and moe_rt_peer_buffer_create says so) */
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  CUresult (*cuStreamQuery)(CUstream);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
} mrt_driver;

/* ---- the last error (thread-local) ---------------------------------------------------------------- */
moe_rt_status mrt_fail(moe_rt_status status, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));
void mrt_clear_error(void);
/* A driver call's failure as MOE_RT_ERROR_CUDA, naming the call and cuGetErrorString's text. */
moe_rt_status mrt_cuda_fail(const mrt_driver* d, CUresult r, const char* what);

/* A device context's driver, its CUDA context made current on the calling thread (MOE_RT_ERROR_NOT_SUPPORTED
 * naming op for a planning context; ctx checked for NULL). */
moe_rt_status mrt_device_driver(moe_rt_context* ctx, const char* op, const mrt_driver** d);

/* ---- the communicator (csrc/comm.c), for the core's own collectives --------------------------------- */
/* R and this rank of a communicator (NULL: a group of one rank). */
void mrt_comm_shape(const moe_rt_comm* comm, int* nranks, int* rank);
/* MOE_RT_SUCCESS while comm (NULL: none) is healthy; else abort it in place (mrt_comm_abort_in_place) and
 * return MOE_RT_ERROR_NCCL with NCCL's text, naming op. */
moe_rt_status mrt_comm_poll(moe_rt_comm* comm, const char* op);
/* ncclCommAbort, keeping the struct: later calls on it fail, moe_rt_comm_destroy / _abort only free it. */
void mrt_comm_abort_in_place(moe_rt_comm* comm);

/* ---- planning ------------------------------------------------------------------------------------- */
/* One kernel launch of a plan: the kernel (file and name expression), its loaded function (NULL in a
 * planning context) and the launch shape. */
typedef struct mrt_launch {
  const char* file;
  char name[MOE_RT_KERNEL_NAME_MAX];
  CUfunction fn;
  int64_t grid;
  int64_t grid_y;     /* the grid's y dimension (0 or 1: a 1-D grid) */
  int32_t block;
  int32_t smem;
  int64_t scalars[2]; /* moe_rt_launch_info.scalars */
  int32_t kind;       /* which launch of its op it is (an op's executor builds the arguments by kind) */
  int64_t arg[2];     /* sizes the planner worked out for the arguments */
  /* planning contexts: the kernel that may stand in for `name` in this call while `name` compiles ("" when
   * none; moe_rt_context_load_stand_in) */
  char stand_in[MOE_RT_KERNEL_NAME_MAX];
} mrt_launch;

#define MRT_MAX_LAUNCHES 8

typedef struct mrt_plan {
  int num_launches;
  mrt_launch launch[MRT_MAX_LAUNCHES];
  int64_t ints[8]; /* op-specific values worked out with the plan (e.g. the router's gcm word) */
  uint64_t workspace_bytes;
} mrt_plan;

/* Planning helpers a planner calls: the kernel's registers (loads it in a device context; the planning
 * context's assumed value otherwise). Returns a status; *regs set on success. */
moe_rt_status mrt_kernel(moe_rt_context* ctx, mrt_launch* l, const char* file, int* regs);
/* As mrt_kernel, with the kernel's most threads a block (CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK; 0 in a
 * planning context, where the caller works it out from the kernel's launch bounds). */
moe_rt_status mrt_kernel_threads(moe_rt_context* ctx, mrt_launch* l, const char* file, int* regs, int* max_threads);
/* mrt_kernel for a launch that `stand_in` may stand in for (a kernel computing the same bits for this call):
 * a device context takes l->name when it is loaded, else the stand-in loaded for it by
 * moe_rt_context_load_stand_in (then *standing = 1 and l->name becomes the stand-in's name: the plan is the
 * stand-in's and is not to be cached), else l->name from the kernel cache. A planning context records
 * `stand_in` in l->stand_in. */
moe_rt_status mrt_kernel_or_stand_in(moe_rt_context* ctx, mrt_launch* l, const char* file, const char* stand_in,
                                     int* regs, int* standing);
const moe_rt_device_info* mrt_device(const moe_rt_context* ctx);

/* The plan cache: a plan by its signature (key bytes), NULL when absent; mrt_plan_put stores a copy. */
const mrt_plan* mrt_plan_get(moe_rt_context* ctx, const void* key, size_t key_bytes);
void mrt_plan_put(moe_rt_context* ctx, const void* key, size_t key_bytes, const mrt_plan* plan);
/* *plan = the cached plan of this signature (returns 1), or zeroed to be planned and put (returns 0). */
int mrt_plan_lookup(moe_rt_context* ctx, const void* key, size_t key_bytes, mrt_plan* plan);

/* Execute: launch each of plan's launches with grid > 0, with its argument list; or, in a planning
 * context, record the plan as the context's last one. */
#define MRT_MAX_ARGS 40

typedef struct mrt_args {
  int n;
  void* ptr[MRT_MAX_ARGS];
  union {
    int32_t i32;
    uint32_t u32;
    int64_t i64;
    float f32;
    unsigned long long p;
  } val[MRT_MAX_ARGS];
  char type[MRT_MAX_ARGS]; /* 'i' int32, 'u' uint32, 'l' int64, 'f' float32, 'p' pointer */
} mrt_args;
void mrt_arg_i32(mrt_args* a, int32_t v);
void mrt_arg_u32(mrt_args* a, uint32_t v);
void mrt_arg_i64(mrt_args* a, int64_t v);
void mrt_arg_f32(mrt_args* a, float v);
void mrt_arg_ptr(mrt_args* a, const void* v);

int mrt_is_planning(const moe_rt_context* ctx);
void mrt_record(moe_rt_context* ctx, const mrt_plan* plan);
/* Planning contexts: record the arguments of launch `launch` of the plan just recorded (moe_rt_last_plan_args;
 * mrt_record forgets the previous op's). */
void mrt_record_args(moe_rt_context* ctx, int launch, const mrt_args* args);
moe_rt_status mrt_launch_one(moe_rt_context* ctx, const mrt_launch* l, mrt_args* args, moe_rt_stream stream);
/* Zero nbytes at p on stream (a no-op in a planning context). */
moe_rt_status mrt_memset0(moe_rt_context* ctx, void* p, size_t nbytes, moe_rt_stream stream);
/* Copy nbytes from device address src to dst on stream (a no-op in a planning context). */
moe_rt_status mrt_copy_d2d(moe_rt_context* ctx, void* dst, const void* src, size_t nbytes, moe_rt_stream stream);
/* Blocks of the launch's kernel with `threads` threads and no dynamic shared memory resident on the whole device
 * at once (cuOccupancyMaxActiveBlocksPerMultiprocessor, at least 1, times the SMs); a planning context models
 * it from its device facts and the registers given (mrt_resident_grid). */
moe_rt_status mrt_resident_blocks(moe_rt_context* ctx, const mrt_launch* l, int threads, int regs, int64_t* blocks);
/* As mrt_resident_blocks, with `smem` bytes of dynamic shared memory a block (opted in above 48 KiB). */
moe_rt_status mrt_resident_blocks_smem(moe_rt_context* ctx, const mrt_launch* l, int threads, int smem, int regs,
                                       int64_t* blocks);
/* The device's error word of this context (0 in a planning context). */
moe_rt_status mrt_error_word(moe_rt_context* ctx, unsigned long long* ptr);

/* Launch the plan's launches in order with their arguments on stream; a planning context records the plan and
 * every launch's arguments instead (the EP groups' executors). */
moe_rt_status mrt_run_plan(moe_rt_context* ctx, const mrt_plan* plan, mrt_args* args, moe_rt_stream stream);
/* ep_direct_barrier's arguments: the peer table of the barrier slots, R, rank, the barrier state, the timeout,
 * the timeout word, the op and the node's ranks [lo, hi). */
void mrt_barrier_args(mrt_args* a, const void* peer_barrier, int32_t R, int32_t rank, const void* state,
                      int64_t timeout_ns, const void* timeout_word, int32_t op, int32_t lo, int32_t hi);

/* An EP group's plans by signature (key bytes, at most MRT_GROUP_KEY_BYTES), MRT_GROUP_PLANS of them (emptied
 * when full); thread-safe. */
#define MRT_GROUP_PLANS 64
#define MRT_GROUP_KEY_BYTES 256
typedef struct mrt_group_plans {
  pthread_mutex_t lock;
  int num;
  struct {
    size_t key_bytes;
    unsigned char key[MRT_GROUP_KEY_BYTES];
    mrt_plan plan;
  } entry[MRT_GROUP_PLANS];
} mrt_group_plans;
void mrt_group_plans_init(mrt_group_plans* c);

/* A registry of live EP groups (the low-latency ones, csrc/ep_ll.c; the direct ones, csrc/ep_direct.c): every
 * group made is listed until destroyed, so that a caller holding only its address and serial (an XLA custom
 * call's attributes, fixed when a JAX function was traced) can check that the group is still alive and hold it
 * while an op runs, never reaching a freed one. Each group embeds an mrt_live; serials are this process's,
 * never reused. */
typedef struct mrt_live {
  int64_t serial; /* the registry's key with the address */
  int64_t users;  /* holds not yet released (under the registry's lock) */
  int destroyed;  /* destroy came while held: the last release frees (under the registry's lock) */
} mrt_live;

typedef struct mrt_registry {
  pthread_mutex_t lock;
  struct mrt_registry_entry* entries;
  size_t len, cap;
} mrt_registry;

#define MRT_REGISTRY_INIT {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0}

int mrt_registry_add(mrt_registry* r, void* group, mrt_live* live);    /* 0: out of host memory */
int mrt_registry_remove(mrt_registry* r, void* group, mrt_live* live); /* 1: not held, free it now */
/* The live group of that address and serial, held (its mrt_live's users counted), or NULL. */
void* mrt_registry_acquire(mrt_registry* r, int64_t address, int64_t serial);
int mrt_registry_release(mrt_registry* r, mrt_live* live); /* 1: the last hold of a destroyed group: free it */
void mrt_group_plans_destroy(mrt_group_plans* c);
/* *plan = the plan of this key (returns 1), or 0 when absent. */
int mrt_group_plan_get(mrt_group_plans* c, const void* key, size_t key_bytes, mrt_plan* plan);
void mrt_group_plan_put(mrt_group_plans* c, const void* key, size_t key_bytes, const mrt_plan* plan);

/* ---- validation helpers --------------------------------------------------------------------------- */
moe_rt_status mrt_check_ctx(const moe_rt_context* ctx, const char* op);
moe_rt_status mrt_check_ptr(const char* op, const char* name, const void* p); /* "op: name is NULL" */
moe_rt_status mrt_check_data(const char* op, const char* name, const void* p, int64_t n); /* NULL allowed when n == 0 */
int mrt_dtype_size(int dtype);
int mrt_is_float_dtype(int dtype); /* float32, float16, bfloat16 */
const char* mrt_ctype(int dtype);   /* the kernels' C++ type of a float dtype */
const char* mrt_dtype_name(int dtype);
static inline int mrt_aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }
static inline int64_t mrt_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t mrt_min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t mrt_max(int64_t a, int64_t b) { return a > b ? a : b; }

/* The permutation plan's three kernels (plan_count, plan_scan, plan_assign) over L = T*K slots of routing_dtype and
 * E experts as launches l[0..2] (csrc/permutation.c; moe_rt_make_plan's), and their arguments a[0..2] for the plan
 * arrays of `plan` (its num_rows set), the workspace (moe_rt_make_plan_workspace_size) and the error word. */
moe_rt_status mrt_plan_kernels(moe_rt_context* ctx, int routing_dtype, int64_t L, int E, mrt_launch* l);
void mrt_plan_kernel_args(const void* routing, int64_t L, int E, int A, int64_t num_out, const moe_rt_plan* plan,
                          void* workspace, unsigned long long err, mrt_args* a);

/* Resident-wave grid of the router kernels (router.py _grid). */
int64_t mrt_resident_grid(const moe_rt_device_info* dev, int64_t n_needed, int threads, int smem, int regs);

#pragma GCC visibility pop

#endif /* MOE_RT_INTERNAL_H_ */
