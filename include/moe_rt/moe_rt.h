/* moe_rt: the C ABI.
 *
 * Part 1: the single-GPU ops over device pointers, sizes, dtype codes and a
 * stream, for native code without Python. A context loads the kernels as cubins (or PTX) from a kernel-cache
 * folder written by `python3 -m moe_rt warmup --out DIR` (its manifest.json), reaching the CUDA driver API
 * through dlopen("libcuda.so.1"); no CUDA header is needed to compile against this file. Link with
 * -lmoe_rt (moe_rt/lib/libmoe_rt.so inside the installed package).
 *
 * Part 1 also holds NCCL, loaded at run time, the communicator (moe_rt_nccl_*, moe_rt_comm_*) and the peer
 * buffers shared through CUDA IPC (moe_rt_peer_buffer_*).
 *
 * Part 2 (after Part 1): the C view of the expert-parallel handle (moe_rt.ep.EpGroup.prepare).
 *
 * A handle is ONE byte buffer (device memory on CUDA) holding the arrays below, in this order, each
 * starting on a 256-byte boundary. The Python definition is moe_rt._handle.REGIONS / layout(); the test
 * suite compiles moe_rt_ep_handle_layout() below and checks it against Python for many sizes.
 *
 * Sizes: R ranks, L local experts, Tmax = max_tokens_per_rank, K top-k, P per-pair capacity (Tmax in
 * exact mode), rows = received rows (exact: sum of received token counts; capacity: R*P),
 * N = expert-major rows (the permutation plan's num_rows).
 *
 *   region              type     count            contents
 *   meta                int32    5*R + 10         counts, offsets, flags (MOE_RT_EP_META_* below)
 *   routing             int32    Tmax*K + 1       this rank's routing: [Tmax][K] expert ids (-1 = none or
 *                                                 out of range), then its T
 *   send_tok            int32    R*P              [dst][pos]: pos-th token this rank sends to dst (-1 unused)
 *   send_pos            int32    R*Tmax           [dst][t]: position of token t in dst's list, -1 = not sent
 *   recv_tok            int32    R*P              [src][pos]: src's token in received position pos
 *   recv_local          int32    rows*K           received rows' local expert ids (-1 = none)
 *   recv_wk             float32  rows*K           received routing weights (written by dispatch)
 *   dst_row             int32    rows*K           expert-major row of slot (row, k), -1 = none/dropped
 *   src_slot            int32    N                slot row*K + k held by expert-major row n, -1 = padding
 *   seg_start           int32    L + 1            local expert l owns rows [seg_start[l], seg_start[l+1])
 *   expert_counts       int32    L                kept slots per local expert (unpadded)
 *   tokens_per_expert   int32    L                padded counts (group sizes for a grouped GEMM)
 *
 * Received row layout: source-major, token ascending. Exact mode: source s owns rows
 * [recv_off[s], recv_off[s+1]); capacity mode: rows [s*P, s*P + min(recv_counts[s], P)).
 */
#ifndef MOE_RT_H_
#define MOE_RT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================================
 * Part 1: the single-GPU ops
 *
 * Conventions. Every function returns a moe_rt_status; on failure moe_rt_last_error() gives a readable
 * message naming the argument (thread-local, valid until the next moe_rt call on the thread). Bad input
 * (NULL pointers, negative or too large sizes, unknown dtype codes, topk > num_experts, ...) is refused
 * before anything is launched; an array of no element may be NULL (in the permutation and FP8 ops, where a
 * pair such as probs / probs_permuted goes together, a NULL member of no element keeps the pair given).
 * Arrays are C-contiguous device memory; T tokens, E experts, K = topk,
 * H hidden size, N permuted rows. Ops launch on `stream` (a cudaStream_t / CUstream; NULL = the default
 * stream) and never synchronize, except moe_rt_check and the copy helpers. The semantics are those of the
 * Python ops of the same names (docs/router.md, docs/permutation.md); the kernel choices (variant, grid,
 * block, shared memory) equal the Python side's. Each op plans (shapes, dtypes, alignment, device ->
 * kernels and launch shapes; cached by that signature in the context) and then launches.
 * A context may be used from several threads (its caches are locked); the ops on one stream are ordered.
 * ====================================================================================================== */

typedef void* moe_rt_stream; /* a cudaStream_t (CUstream); NULL = the legacy default stream */

typedef enum moe_rt_status {
  MOE_RT_SUCCESS = 0,
  MOE_RT_ERROR_INVALID_ARGUMENT = 1, /* bad pointer, size, dtype code or setting */
  MOE_RT_ERROR_NO_DRIVER = 2,        /* libcuda.so.1 cannot be loaded, or lacks a needed function */
  MOE_RT_ERROR_NO_DEVICE = 3,        /* no CUDA device, or the device index is out of range */
  MOE_RT_ERROR_KERNEL_CACHE = 4,     /* cache folder or manifest missing/unreadable, or a kernel absent */
  MOE_RT_ERROR_CUDA = 5,             /* a CUDA driver call failed (the message holds its error string) */
  MOE_RT_ERROR_BAD_EXPERT_ID = 6,    /* moe_rt_check: make_plan met expert ids outside [-1, E) */
  MOE_RT_ERROR_NOT_SUPPORTED = 7,    /* e.g. launching in a planning context */
  MOE_RT_ERROR_NO_NCCL = 8,          /* the NCCL library cannot be loaded, or lacks a needed function */
  MOE_RT_ERROR_NCCL = 9,             /* an NCCL call failed (moe_rt_nccl_last_failure: the call and result) */
  MOE_RT_ERROR_TIMEOUT = 10          /* a host wait ran past its deadline (the message names the op) */
} moe_rt_status;

typedef enum moe_rt_dtype {
  MOE_RT_FLOAT32 = 0,
  MOE_RT_FLOAT16 = 1,
  MOE_RT_BFLOAT16 = 2,
  MOE_RT_INT32 = 3,
  MOE_RT_INT64 = 4,
  MOE_RT_BOOL = 5, /* 1 byte, 0 or 1 */
  MOE_RT_UINT8 = 6,
  MOE_RT_INT8 = 7,
  MOE_RT_FLOAT8_E4M3 = 8,
  MOE_RT_FLOAT8_E5M2 = 9,
  MOE_RT_INT16 = 10,
  MOE_RT_UINT32 = 11, /* the communicator's data calls alone */
  MOE_RT_UINT64 = 12,
  MOE_RT_FLOAT64 = 13
} moe_rt_dtype;

typedef enum moe_rt_score_function {
  MOE_RT_SCORE_SIGMOID = 0,
  MOE_RT_SCORE_SOFTMAX = 1,
  MOE_RT_SCORE_SQRTSOFTPLUS = 2
} moe_rt_score_function;

#define MOE_RT_MAX_EXPERTS 16384
#define MOE_RT_MAX_TOPK 64

/* Readable message of the last failure on this thread ("" when none). */
const char* moe_rt_last_error(void);
/* A status code's name, e.g. "MOE_RT_ERROR_INVALID_ARGUMENT". */
const char* moe_rt_status_name(moe_rt_status status);

typedef struct moe_rt_context moe_rt_context;

/* What the planners read of a device. */
typedef struct moe_rt_device_info {
  int32_t sm_count;             /* multiprocessors */
  int32_t smem_per_sm;          /* shared memory per multiprocessor, bytes (0 = unknown: 228 KiB assumed) */
  int32_t smem_per_block_optin; /* opt-in shared memory per block, bytes */
  int32_t cc_major, cc_minor;   /* compute capability */
  int32_t assumed_regs;         /* planning contexts only: registers per thread assumed for every kernel
                                   (0 = not limiting); a device context reads each kernel's own */
} moe_rt_device_info;

/* A context on CUDA device `device` (its primary context, made current on the calling thread) with the
 * kernels of `kernel_cache_dir` (NULL = the MOE_RT_KERNEL_CACHE environment variable). The folder must hold
 * manifest.json from `python3 -m moe_rt warmup --out DIR` for the device's architecture (or PTX for an older
 * one), made from the sources this library was built with. Kernels are loaded on first use. The driver is
 * dlopen("libcuda.so.1") (MOE_RT_LIBCUDA names another file); without it: MOE_RT_ERROR_NO_DRIVER. */
moe_rt_status moe_rt_context_create(const char* kernel_cache_dir, int device, moe_rt_context** ctx);
/* A planning context: no driver, no device, no kernels. Ops called on it validate and plan exactly as on
 * a device context (pointers are only checked for NULL and alignment), launch nothing and return
 * MOE_RT_SUCCESS; moe_rt_last_plan() then describes the launches the op would have made. */
moe_rt_status moe_rt_context_create_planning(const moe_rt_device_info* device, moe_rt_context** ctx);
/* Load kernel `name` (a name expression, e.g. "router_fwd_reg<float, 8>") of kernels/`file` now, e.g. before
 * a CUDA graph capture (the ops otherwise load their kernels on first use). A kernel the manifest lacks makes
 * the context read the folder's manifest.json again (ops do the same), so kernels added to the folder after
 * the context was made are found. A no-op on a planning context. */
moe_rt_status moe_rt_context_load_kernel(moe_rt_context* ctx, const char* file, const char* name);
/* Frees the context's modules and memory (NULL is a no-op). */
void moe_rt_context_destroy(moe_rt_context* ctx);
moe_rt_status moe_rt_context_device_info(const moe_rt_context* ctx, moe_rt_device_info* info);

#define MOE_RT_KERNEL_NAME_MAX 128
#define MOE_RT_MAX_LAUNCHES 8

typedef struct moe_rt_launch_info {
  char file[32];                       /* kernels/<file>, e.g. "router.cu" */
  char kernel[MOE_RT_KERNEL_NAME_MAX]; /* name expression, e.g. "router_fwd_reg<float, 8>" */
  int64_t grid;                        /* blocks (1-D); 0 = not launched */
  int32_t block;                       /* threads per block */
  int32_t shared_mem;                  /* dynamic shared memory, bytes */
  int64_t scalars[2];                  /* variant arguments the planner chose: router_fwd*: the 16-byte
                                          vector flag and the grouped-selection word; router_fwd_qb*: the
                                          vector flag and the histogram mode (0 none, 1 global atomics, 2
                                          the block's shared histogram); router_bwd and router_bwd_idx: the
                                          vector flag; qb_histogram_accumulate: the grid's y dimension (its
                                          x dimension is `grid`) and the shared-memory flag; 0 otherwise */
} moe_rt_launch_info;

typedef struct moe_rt_plan_info {
  int32_t num_launches;
  moe_rt_launch_info launch[MOE_RT_MAX_LAUNCHES];
} moe_rt_plan_info;

/* Planning contexts: the launches of the last op called on ctx (from any thread). */
moe_rt_status moe_rt_last_plan(const moe_rt_context* ctx, moe_rt_plan_info* info);

/* Stand-in kernels: a first call need not wait for a kernel that compiles slowly. For some launches (the
 * router forward's) the planner names a stand-in: a kernel of the same file that computes the same bits for
 * that call (the same template compiled for the call's score case alone), which compiles in a fraction of
 * the time. moe_rt's Python side uses these on a kernel-cache miss; a C program that loads its kernels from a
 * warmed folder needs none of it.
 *
 * moe_rt_last_plan_stand_in: planning contexts: the stand-in of launch `launch` of the last plan ("" when the
 * launch has none), written to `name` (`size` bytes, at least MOE_RT_KERNEL_NAME_MAX).
 * moe_rt_context_load_stand_in: load kernel `stand_in` of kernels/`file` (from the kernel-cache folder) to
 * stand in for kernel `name`: until `name` is loaded, a call whose planner names `stand_in` as the stand-in
 * of `name` runs it, planned with its own registers (plans made with a stand-in are not cached). A no-op on a
 * planning context.
 * moe_rt_context_end_stand_ins: `load` = 1: load `name` (the final kernel, from the kernel-cache folder) and
 * retire its stand-ins, at once for every thread: calls from then on plan with `name`; refused with
 * MOE_RT_ERROR_NOT_SUPPORTED, loading nothing, while `stream` is being captured into a CUDA graph (call again
 * after the capture). `load` = 0: retire the stand-ins alone (the final kernel failed to compile: calls then
 * need `name` in the folder again). Stand-in modules stay loaded until the context is destroyed (a graph
 * captured with one keeps launching it). */
moe_rt_status moe_rt_last_plan_stand_in(const moe_rt_context* ctx, int launch, char* name, size_t size);
moe_rt_status moe_rt_context_load_stand_in(moe_rt_context* ctx, const char* file, const char* name,
                                           const char* stand_in);
moe_rt_status moe_rt_context_end_stand_ins(moe_rt_context* ctx, const char* file, const char* name, int load,
                                           moe_rt_stream stream);

/* Wait for `stream`, then read and clear the context's error word: MOE_RT_ERROR_BAD_EXPERT_ID with the
 * Python side's message ("routing: expert ids must be in [-1, num_experts=E), got V") when make_plan met
 * ids outside [-1, E) since the last check (those slots were dropped, as -1). A host sync. */
moe_rt_status moe_rt_check(moe_rt_context* ctx, moe_rt_stream stream);

/* Helpers for callers without CUDA headers (synchronous, on the context's device). */
moe_rt_status moe_rt_malloc(moe_rt_context* ctx, size_t bytes, void** ptr);
moe_rt_status moe_rt_free(moe_rt_context* ctx, void* ptr);
moe_rt_status moe_rt_copy_to_device(moe_rt_context* ctx, void* dst, const void* src, size_t bytes);
moe_rt_status moe_rt_copy_to_host(moe_rt_context* ctx, void* dst, const void* src, size_t bytes);
/* Device to device, ordered on `stream` (not synchronous). */
moe_rt_status moe_rt_copy_on_device(moe_rt_context* ctx, void* dst, const void* src, size_t bytes,
                                    moe_rt_stream stream);
moe_rt_status moe_rt_stream_synchronize(moe_rt_context* ctx, moe_rt_stream stream);

/* ---- router (moe_rt.router) ------------------------------------------------------------------------
 * logits [T, E] in `dtype` (float32, float16, bfloat16); 1 <= E <= 16384; 1 <= topk <= min(E, 64).
 * score_function: moe_rt_score_function. use_pre_softmax: softmax only (ignored otherwise).
 * Group-limited top-k: group_topk = 0 for none (num_groups is then ignored, but must be >= 0); else
 * num_groups divides E, group_topk <= num_groups, group_topk divides topk, topk/group_topk <= E/num_groups.
 * scaling_factor: finite (1 = none). expert_bias: NULL or [E] float32, sigmoid/sqrtsoftplus only. */

/* probs [T, E] `dtype` (nonzero on the selection); the routing in the form routing_dtype says:
 * MOE_RT_BOOL: the routing map [T, E] (1 byte each); MOE_RT_UINT8: the map bit-packed, [T, ceil(E/8)] (bit
 * e % 8 of byte e / 8, padding bits 0); MOE_RT_INT16, MOE_RT_INT32 or MOE_RT_INT64: the indices [T, K], each
 * row's experts in ascending expert id. intermediate [T, E] float32 (what the backward needs). */
moe_rt_status moe_rt_topk_with_score(moe_rt_context* ctx, const void* logits, int dtype, int64_t num_tokens,
                                     int num_experts, int topk, int score_function, int use_pre_softmax,
                                     int num_groups, int group_topk, float scaling_factor,
                                     const float* expert_bias, void* probs, void* routing, int routing_dtype,
                                     float* intermediate, moe_rt_stream stream);
/* The compact form: topk_idx [T, K] int32 (ascending expert id), topk_weights [T, K] float32. */
moe_rt_status moe_rt_topk_indices_with_score(moe_rt_context* ctx, const void* logits, int dtype,
                                             int64_t num_tokens, int num_experts, int topk, int score_function,
                                             int use_pre_softmax, int num_groups, int group_topk,
                                             float scaling_factor, const float* expert_bias, int32_t* topk_idx,
                                             float* topk_weights, moe_rt_stream stream);
/* grad_probs [T, E] `dtype`, the forward's routing (routing_dtype as for the forward; indices in any order
 * within a row, -1 = none; ids outside [-1, E) are skipped and recorded for moe_rt_check) and intermediate
 * -> grad_logits [T, E] `dtype`. */
moe_rt_status moe_rt_topk_with_score_backward(moe_rt_context* ctx, const void* grad_probs, int dtype,
                                              const void* routing, int routing_dtype, const float* intermediate,
                                              int64_t num_tokens, int num_experts, int topk, int score_function,
                                              int use_pre_softmax, float scaling_factor, void* grad_logits,
                                              moe_rt_stream stream);
/* scores [T, E] float32, routing_map [T, E] bool (routing_dtype MOE_RT_BOOL) or bit-packed [T, ceil(E/8)]
 * (MOE_RT_UINT8), intermediate [T, E] float32. */
moe_rt_status moe_rt_scores_for_aux_loss(moe_rt_context* ctx, const void* logits, int dtype, int64_t num_tokens,
                                         int num_experts, int topk, int score_function, float* scores,
                                         void* routing_map, int routing_dtype, float* intermediate,
                                         moe_rt_stream stream);
/* grad_scores, intermediate [T, E] float32 -> grad_logits [T, E] in grad_dtype (float32/16, bfloat16). */
moe_rt_status moe_rt_scores_for_aux_loss_backward(moe_rt_context* ctx, const float* grad_scores,
                                                  const float* intermediate, int64_t num_tokens, int num_experts,
                                                  int topk, int score_function, void* grad_logits, int grad_dtype,
                                                  moe_rt_stream stream);

/* Quantile Balancing (docs/router.md "Quantile Balancing"): the sigmoid top-k with expert_bias [E] float32
 * (required) that also selects each token's (k+1)-th expert, the cutoff, and adds to qb_histogram [E, B]
 * int32 (in place; never zeroed here) one count a token and expert, in bin
 * clamp(floor((cutoff_t - raw_te - lower) * (B / (upper - lower))), 0, B - 1) (fp32; raw = the sigmoid before
 * the bias; a NaN in bin 0). 1 <= topk < E; 1 <= B <= MOE_RT_MAX_QB_BINS. qb_bin_bounds [2] float32 device
 * memory [lower, upper], read by the kernels at launch (values not checked: finite with lower < upper is the
 * caller's to ensure). Outputs: probs [T, E] `dtype`, routing_map [T, E] bool and intermediate [T, E] float32
 * as moe_rt_topk_with_score's (sigmoid, no groups), cutoff [T] float32 (each token's cutoff biased score).
 * qb_histogram_mode: the counts added by the router kernel with integer atomics where its block's histogram
 * fits shared memory or T E is small, else by a second kernel (MOE_RT_QB_FUSED_ATOMIC), or always by the
 * second kernel from (intermediate, cutoff) (MOE_RT_QB_TWO_KERNEL); the same counts either way. */
typedef enum moe_rt_qb_histogram_mode {
  MOE_RT_QB_TWO_KERNEL = 0,
  MOE_RT_QB_FUSED_ATOMIC = 1
} moe_rt_qb_histogram_mode;

#define MOE_RT_MAX_QB_BINS (1 << 24)

moe_rt_status moe_rt_topk_with_score_qb(moe_rt_context* ctx, const void* logits, int dtype, int64_t num_tokens,
                                        int num_experts, int topk, float scaling_factor, const float* expert_bias,
                                        const float* qb_bin_bounds, int32_t* qb_histogram, int num_bins,
                                        int qb_histogram_mode, void* probs, void* routing_map, float* intermediate,
                                        float* cutoff, moe_rt_stream stream);

/* Aux loss: loss = C * sum_c tokens_per_expert[c] * sum_r probs[r, c], C = (E*coeff)/topk/T_tot/T_tot
 * (fp32). probs [R, C] `dtype`; tokens_per_expert [C] int32, int64 or float32 (tpe_dtype); C a multiple of
 * num_experts. The total token count: total_num_tokens >= 1 on the host, or total_num_tokens = 0 and
 * total_device a device int32/int64 (total_dtype) read by the kernel at launch (not checked). The forward
 * needs `workspace` of moe_rt_aux_loss_workspace_size(R) bytes (device memory, used on `stream` only) and
 * writes the loss to out[0] (`dtype`). */
moe_rt_status moe_rt_aux_loss_workspace_size(int64_t num_rows, size_t* bytes);
moe_rt_status moe_rt_aux_loss(moe_rt_context* ctx, const void* probs, int dtype, int64_t num_rows, int num_cols,
                              const void* tokens_per_expert, int tpe_dtype, int64_t total_num_tokens,
                              const void* total_device, int total_dtype, int num_experts, int topk, float coeff,
                              void* workspace, size_t workspace_bytes, void* out, moe_rt_stream stream);
/* grad_aux_loss: one element of `dtype` (device) -> grad_probs [R, C] `dtype`. */
moe_rt_status moe_rt_aux_loss_backward(moe_rt_context* ctx, const void* grad_aux_loss, int dtype, int64_t num_rows,
                                       int num_cols, const void* tokens_per_expert, int tpe_dtype,
                                       int64_t total_num_tokens, const void* total_device, int total_dtype,
                                       int num_experts, int topk, float coeff, void* grad_probs,
                                       moe_rt_stream stream);

/* ---- dispatch on one GPU (moe_rt.permutation) -------------------------------------------------------
 * A plan: where each routed slot (t, k) lands in the expert-major permuted rows (docs/permutation.md). The
 * caller allocates its five int32 arrays and sets the pointers; moe_rt_make_plan fills them and the sizes.
 *   dst_row [T, K]: row of slot (t, k), -1 when dropped;  src_slot [N]: slot t*K+k of each row, -1 = padding;
 *   seg_start [E+1]: expert e owns rows [seg_start[e], seg_start[e+1]);  counts [E]: kept slots per expert;
 *   tokens_per_expert [E]: the group sizes of a grouped GEMM (counts padded to align_size). */
typedef struct moe_rt_plan {
  int32_t* dst_row;
  int32_t* src_slot;
  int32_t* seg_start;
  int32_t* counts;
  int32_t* tokens_per_expert;
  int64_t num_tokens, topk, num_experts, num_rows, align_size;
} moe_rt_plan;

/* The permuted row count N, known on the host: kept = T*K (or num_out_tokens >= 0; -1 = none); N = kept
 * with align_size 1, else floor((kept + E*(A-1)) / A) * A. */
moe_rt_status moe_rt_plan_num_rows(int64_t num_tokens, int64_t topk, int num_experts, int align_size,
                                   int64_t num_out_tokens, int64_t* num_rows);
/* Device workspace of moe_rt_make_plan, bytes (topk = E for a routing map). */
moe_rt_status moe_rt_make_plan_workspace_size(int64_t num_tokens, int64_t topk, int num_experts, size_t* bytes);
/* routing: topk_idx [T, topk] int32/int64 (expert ids, -1 = none), or a routing map [T, E] bool
 * (routing_dtype MOE_RT_BOOL; topk must equal E). align_size 1..2^20; num_out_tokens -1 (keep all) or
 * 0..T*K. Fills plan's arrays (pointers set by the caller, sized from moe_rt_plan_num_rows) and sizes. Ids
 * outside [-1, E) are dropped and recorded for moe_rt_check. */
moe_rt_status moe_rt_make_plan(moe_rt_context* ctx, const void* routing, int routing_dtype, int64_t num_tokens,
                               int64_t topk, int num_experts, int align_size, int64_t num_out_tokens,
                               moe_rt_plan* plan, void* workspace, size_t workspace_bytes, moe_rt_stream stream);
/* x [T, H] `dtype` (float, or 1-byte data moved as bytes) -> x_permuted [N, H]; probs NULL or [T, K]
 * float32 slot probs -> probs_permuted [N] in probs_dtype (float32, float16, bfloat16; NULL with probs
 * NULL). Rows holding no slot are zero. */
moe_rt_status moe_rt_dispatch(moe_rt_context* ctx, const moe_rt_plan* plan, const void* x, int dtype,
                              int64_t hidden, const float* probs, void* x_permuted, void* probs_permuted,
                              int probs_dtype, moe_rt_stream stream);
/* y[t] = sum_k w[t,k] * y_permuted[dst_row[t,k]] (fp32, k ascending; w = 1 with probs NULL).
 * y_permuted [N, H] `dtype` (float32/16, bfloat16), probs NULL or [T, K] float32 -> y [T, H]. */
moe_rt_status moe_rt_combine(moe_rt_context* ctx, const moe_rt_plan* plan, const void* y_permuted, int dtype,
                             int64_t hidden, const float* probs, void* y, moe_rt_stream stream);
/* VJP of dispatch: grad_x [T, H] = unweighted combine of grad_x_permuted [N, H]; grad_probs [T, K] float32
 * (NULL with grad_probs_permuted NULL) = grad_probs_permuted [N] float32 gathered (0 for dropped slots). */
moe_rt_status moe_rt_dispatch_backward(moe_rt_context* ctx, const moe_rt_plan* plan, const void* grad_x_permuted,
                                       int dtype, int64_t hidden, const float* grad_probs_permuted, void* grad_x,
                                       float* grad_probs, moe_rt_stream stream);
/* VJP of combine: grad_y [T, H] -> grad_y_permuted [N, H] (w * grad_y at each slot's row, zero elsewhere);
 * with probs [T, K] float32 also y_permuted [N, H] (the forward's input) and grad_probs [T, K] float32. */
moe_rt_status moe_rt_combine_backward(moe_rt_context* ctx, const moe_rt_plan* plan, const void* grad_y, int dtype,
                                      int64_t hidden, const void* y_permuted, const float* probs,
                                      void* grad_y_permuted, float* grad_probs, moe_rt_stream stream);

/* sort_chunks: the rows of x [N, row_bytes bytes] form chunks of sizes split_sizes [S] put in the order
 * sorted_indices [S] (a permutation of 0..S-1; both int32 or both int64, index_dtype; device arrays, not
 * checked); rows past the chunks stay in place. backward != 0: the inverse (the VJP). probs NULL or [N]
 * float32 -> probs_out [N] float32 moved alike. Needs `workspace` of moe_rt_sort_chunks_workspace_size(S)
 * bytes (device memory, used on `stream` only). */
moe_rt_status moe_rt_sort_chunks_workspace_size(int64_t num_chunks, size_t* bytes);
moe_rt_status moe_rt_sort_chunks(moe_rt_context* ctx, const void* x, int64_t num_rows, int64_t row_bytes,
                                 const void* split_sizes, const void* sorted_indices, int index_dtype,
                                 int64_t num_chunks, const float* probs, void* out, float* probs_out, int backward,
                                 void* workspace, size_t workspace_bytes, moe_rt_stream stream);

/* copy_kept_rows: out[r] = src[r] for the rows r < N with keep[r] >= 0 (only those rows of src are read), zero
 * for the others when zero_rest (else left as they are). src and out [N, row_bytes bytes] (rows moved as
 * bytes), keep [N] int32 (device arrays). The JAX low-latency ops' copy of a group's receive buffer into
 * XLA's output, keep = the handle's slot_topk. */
moe_rt_status moe_rt_copy_kept_rows(moe_rt_context* ctx, const void* src, void* out, const int32_t* keep,
                                    int64_t num_rows, int64_t row_bytes, int zero_rest, moe_rt_stream stream);

/* ---- FP8 block casts (moe_rt.fp8) ------------------------------------------------------------------
 * One float32 scale per `block` channels of each token (1 <= block <= 65536; a row whose H is not a
 * multiple ends with a shorter block; H + block < 2^31). x [T, H] `dtype` (float32/16, bfloat16) ->
 * x_fp8 [T, H] float8_e4m3fn codes and scales [T, ceil(H/block)] float32: scale = amax/448 of the block
 * (1 where that is 0), x_fp8 = e4m3(x/scale). The inverse: y [T, H] `dtype` = x_fp8 * scale. */
moe_rt_status moe_rt_quantize_fp8(moe_rt_context* ctx, const void* x, int dtype, int64_t num_tokens, int64_t hidden,
                                  int block, void* x_fp8, float* scales, moe_rt_stream stream);
moe_rt_status moe_rt_dequantize_fp8(moe_rt_context* ctx, const void* x_fp8, const float* scales, int64_t num_tokens,
                                    int64_t hidden, int block, void* y, int dtype, moe_rt_stream stream);
/* The same quantization into the packed rows of an FP8 EP dispatch (moe_rt_ep_direct_outputs.fp8 = 1; docs/ep.md
 * §9): rows [T, row_bytes] bytes, row t holding its H codes, at byte ceil4(H) its ceil(H/block) float32 scales,
 * zero bytes elsewhere; row_bytes a multiple of 4, at least ceil4(H) + 4*ceil(H/block) (the dispatch's rows:
 * the next multiple of 16); rows 4-byte aligned. */
moe_rt_status moe_rt_quantize_fp8_rows(moe_rt_context* ctx, const void* x, int dtype, int64_t num_tokens,
                                       int64_t hidden, int block, void* rows, int64_t row_bytes, moe_rt_stream stream);
/* A pre-quantized pair (x_fp8 [T, H] e4m3 codes, scales [T, ceil(H/block)] float32, 4-byte aligned) into the
 * same packed rows: the codes copied to each row's start, the scales to byte ceil4(H), zero bytes elsewhere. */
moe_rt_status moe_rt_pack_fp8_rows(moe_rt_context* ctx, const void* x_fp8, const float* scales, int64_t num_tokens,
                                   int64_t hidden, int block, void* rows, int64_t row_bytes, moe_rt_stream stream);

/* Planning contexts: the arguments of launch `launch` of the last plan, in the kernel's parameter order, each as
 * a 64-bit value (pointers as addresses, int32 sign-extended, uint32 zero-extended, float32 as its bits) into
 * args[0 .. *count) (capacity values at most; *count is set either way). Ops that record no arguments give
 * *count = 0 (today: the low-latency EP ops, moe_rt_ll_*). */
moe_rt_status moe_rt_last_plan_args(const moe_rt_context* ctx, int launch, int64_t* args, int capacity, int* count);

/* ---- low-latency expert parallelism (moe_rt.ep_ll.LowLatencyGroup; docs/ep.md §8) ----------------------
 * A group of R ranks, one process (one context) per GPU, every pair with peer access. Each rank owns shared
 * device buffers (plain allocations whose CUDA IPC handles the ranks exchanged; moe_rt's Python side makes
 * them, or a C caller does) and knows every rank's address of each region through a *peer table*: a device
 * int64 array [R] (entry r = rank r's region as mapped in this process; entry `rank` = this rank's own). A
 * moe_rt_ll_group holds those addresses and the sizes, validated once; the ops below plan their launches
 * once per signature (kernel variant, grid, constant arguments; cached in the group) and then launch:
 * ep_direct_barrier (every rank finished its previous op; desc.sync MOE_RT_LL_SYNC_PAIRWISE: none, the kernel
 * synchronises with each destination itself) followed by one fused kernel of kernels/ep.cu,
 * exactly as moe_rt.ep_ll does (the same kernels, grids, blocks and arguments). Nothing syncs with the host;
 * the ops are CUDA-graph capturable (epochs live on the device). Every rank calls the same ops in the same
 * order (collectives). Layout and semantics: moe_rt/ep_ll.py's module notes.
 * The NCCL transport (desc.transport MOE_RT_LL_TRANSPORT_NCCL, for ranks without peer access): no peer table,
 * barrier or flag; each op is the ep_ll_nccl_* kernels with one NCCL exchange of fixed size through desc.comm
 * between them (dispatch: pack, all-gather, expand; the combine direction: reduce, grouped send/recv, owner
 * sum; combine_bwd: pack, all-gather, expand, slot dot), with results bitwise those of the direct transport.
 * The first call of each signature loads its kernels, which waits for an idle device: behind a collective
 * waiting for a dead peer it would block, so a caller waits for its stream (with its own deadline, polling
 * moe_rt_comm_async_error) before an op's first call (docs/ep.md §8). */
#define MOE_RT_LL_MAX_TOKENS 1024 /* max_tokens_per_rank, at most */
#define MOE_RT_LL_MAX_BUFFERS 2
#define MOE_RT_LL_FP8_BLOCK 128 /* channels per FP8 scale */

typedef enum moe_rt_ll_phase {
  MOE_RT_LL_PUSH = 1,    /* the send half: write this rank's rows into the peers' buffers, raise the flags */
  MOE_RT_LL_RECEIVE = 2  /* the receive half: wait for every rank's flags, write the handle's tables */
} moe_rt_ll_phase;

/* Op codes: what a timed-out wait records in the timeout word (moe_rt._ep_direct.OP_CODES). */
typedef enum moe_rt_ep_op {
  MOE_RT_EP_OP_DISPATCH = 1,
  MOE_RT_EP_OP_COMBINE = 2,
  MOE_RT_EP_OP_DISPATCH_BWD = 3,
  MOE_RT_EP_OP_COMBINE_BWD = 4,
  MOE_RT_EP_OP_CLOSE = 5,
  MOE_RT_EP_OP_PREPARE = 6
} moe_rt_ep_op;

/* How an op keeps a rank from writing into a peer's buffers before the peer's earlier ops that read them are
 * done (moe_rt_ll_group_desc.sync; docs/ep.md §8). */
typedef enum moe_rt_ll_sync {
  MOE_RT_LL_SYNC_BARRIER = 0, /* ep_direct_barrier over every rank, then the op's fused kernel */
  MOE_RT_LL_SYNC_PAIRWISE = 1 /* no barrier launch: the fused kernel (its *_pairwise build) announces its epoch to
                                 every peer and waits, before writing into a destination, for its announce */
} moe_rt_ll_sync;

/* One buffer set (num_buffers of them: with 2, two dispatches may be in flight). Sizes: R ranks, L local
 * experts, Tmax = max_tokens_per_rank, K topk, H hidden, S = ceil(H/128). Every region 16-byte aligned. */
typedef struct moe_rt_ll_buffer_set {
  void* recv;                 /* this rank's receive rows [L, R*Tmax, H] dtype (peer_recv[rank]) */
  const int64_t* peer_recv;   /* peer table of recv */
  const int64_t* peer_recv_q; /* fp8 groups: peer table of the FP8 codes [L, R*Tmax, H] uint8; else NULL */
  const int64_t* peer_recv_s; /* fp8 groups: peer table of the FP8 scales [L, R*Tmax, S] float32; else NULL */
  const int64_t* peer_route;  /* peer table of the routing rows [R, Tmax*K + 1] int32 */
  const int64_t* peer_rw;     /* peer table of the routing weights [R, Tmax*K] float32 */
  const int64_t* peer_back;   /* peer table of the combine rows [Tmax*K, H] dtype */
  const int64_t* peer_bw;     /* peer table of the combine weight gradients [Tmax*K] float32 */
  /* The NCCL transport's regions (desc.transport MOE_RT_LL_TRANSPORT_NCCL; NULL on the direct transport, whose
   * peer tables above are NULL on this one): this rank's own memory, 16-byte aligned; MW = 4 + 2*Tmax*K. */
  void* recv_q;              /* fp8 groups: the FP8 codes [L, R*Tmax, H] uint8; else NULL */
  float* recv_s;             /* fp8 groups: the FP8 scales [L, R*Tmax, S]; else NULL */
  void* gather;              /* every rank's token rows [R, Tmax, H] dtype (dispatch's x, combine_bwd's grad_out) */
  int32_t* gather_meta;      /* every rank's routing [R, MW] int32: T, 3 unused words, ids [Tmax*K], weights' bits */
  void* gather_q;            /* fp8 groups: every rank's FP8 codes [R, Tmax, H] uint8; else NULL */
  float* gather_s;           /* fp8 groups: every rank's FP8 scales [R, Tmax, S]; else NULL */
  void* back_send;           /* the combine direction's rows for each owner [R, Tmax*K, H] dtype */
  void* back;                /* the rows each expert rank sent here [R, Tmax*K, H] dtype */
  float* bw_send;            /* the slot values (weight gradients) for each owner [R, Tmax*K] */
  float* bw;                 /* the slot values each expert rank sent here [R, Tmax*K] */
} moe_rt_ll_buffer_set;

/* How a low-latency group's rows move between its ranks (moe_rt_ll_group_desc.transport). */
typedef enum moe_rt_ll_transport {
  MOE_RT_LL_TRANSPORT_DIRECT = 0, /* peer memory (CUDA IPC): every pair of ranks on one node with peer access */
  MOE_RT_LL_TRANSPORT_NCCL = 1    /* NCCL collectives of fixed sizes through desc.comm: any ranks (docs/ep.md §8) */
} moe_rt_ll_transport;

typedef struct moe_rt_ll_group_desc {
  int32_t num_ranks;           /* R >= 1 */
  int32_t rank;                /* this rank, in [0, R) */
  int32_t num_local_experts;   /* L >= 1 (E = R*L experts) */
  int32_t max_tokens_per_rank; /* Tmax in [1, MOE_RT_LL_MAX_TOKENS] */
  int32_t topk;                /* K in [1, MOE_RT_MAX_TOPK] */
  int32_t dtype;               /* the token dtype: MOE_RT_FLOAT32, MOE_RT_FLOAT16 or MOE_RT_BFLOAT16 */
  int64_t hidden;              /* H >= 1; L*R*Tmax*H below 2^62 */
  int32_t chunk;               /* tokens a flag covers, in [1, Tmax], the same on every rank (moe_rt.ep_ll
                                  .chunk_tokens: ceil(Tmax/128)) */
  int32_t num_buffers;         /* 1 or 2 */
  int32_t fp8;                 /* 1: the sets hold FP8 receive buffers (peer_recv_q, peer_recv_s); else 0 */
  int32_t num_scales;          /* S = ceil(H/128) (checked; any value when fp8 is 0) */
  int32_t dedup;               /* 1: a token's row crosses to each destination rank once; 0: once per expert.
                                  The same on every rank */
  int32_t combine_partials;    /* 1: combine pushes one row per (token, expert rank), the rank's fp32 partial
                                  sum of its slots (weighted by the handle's slot_w) rounded to dtype, into
                                  the owner's back buffer [Tmax*R, H] (peer_back then spans Tmax*max(K, R)
                                  rows); 0: one row per (token, distinct expert) [Tmax*K, H]. The same on
                                  every rank */
  int32_t sync;                /* moe_rt_ll_sync: MOE_RT_LL_SYNC_BARRIER (0) or MOE_RT_LL_SYNC_PAIRWISE (1). The
                                  same on every rank */
  int64_t timeout_ns;          /* > 0: how long a device wait spins before it gives up */
  moe_rt_ll_buffer_set set[MOE_RT_LL_MAX_BUFFERS]; /* set[b] for b < num_buffers (the rest ignored) */
  const int64_t* peer_flags;   /* peer table of the chunk flags: uint32 [num_buffers, 2, R, Tmax] per rank, zeroed
                                  once */
  const int64_t* peer_barrier; /* peer table of the barrier slots: uint32 [R] per rank, zeroed once */
  uint32_t* barrier_state;     /* uint32 [2] device memory of this rank, zeroed once: the barrier epoch and a
                                  sticky failure flag */
  int32_t* timeout_word;       /* int32 host memory mapped into the device (cudaHostAllocMapped), zeroed: a
                                  wait that timed out writes its op (moe_rt_ep_op) there */
  uint32_t* error_word;        /* the device error word bad expert ids are recorded in; NULL = the context's
                                  (reported by moe_rt_check) */
  uint32_t* set_epoch;         /* uint32 [num_buffers] device memory: each set's split push epoch; with sync
                                  MOE_RT_LL_SYNC_PAIRWISE [num_buffers + 1], zeroed once: the last word counts
                                  the blocks of the running op that took its epoch */
  int32_t transport;           /* moe_rt_ll_transport. MOE_RT_LL_TRANSPORT_NCCL: the sets' NCCL regions and comm are
                                  used, and peer_flags, peer_barrier, barrier_state, timeout_word, set_epoch and
                                  the peer tables may be NULL (sync and chunk are ignored) */
  struct moe_rt_comm* comm;    /* MOE_RT_LL_TRANSPORT_NCCL: the group's communicator of num_ranks ranks, this rank
                                  at desc.rank (borrowed: it must outlive the group); NULL for one rank */
} moe_rt_ll_group_desc;

/* A dispatch handle's tables (device memory the caller owns; one set per dispatch in flight). T tokens. */
typedef struct moe_rt_ll_tables {
  int32_t* idx;   /* [T, K] the routing as int32 (-1 = none) */
  float* w;       /* [T, K] float32 weights */
  int32_t* route; /* [R, Tmax, K] the routing as each expert rank saw it (local expert ids, -1 = none) */
  int32_t* slot_k;  /* [L, R*Tmax] the first k of the slot's token with that expert, -1 = no token */
  float* slot_w;    /* [L, R*Tmax] that token's weight */
  int32_t* counts;  /* [L] valid slots per local expert */
} moe_rt_ll_tables;

typedef struct moe_rt_ll_group moe_rt_ll_group;

/* Validate desc and make the group on ctx (a device or a planning context: a planning context takes made-up
 * addresses, checked for NULL only). The group refers to ctx (destroy it first) and to the buffers (they must
 * outlive it); it copies desc. */
moe_rt_status moe_rt_ll_group_create(moe_rt_context* ctx, const moe_rt_ll_group_desc* desc, moe_rt_ll_group** out);
void moe_rt_ll_group_destroy(moe_rt_ll_group* group); /* NULL is a no-op */

/* The registry of live groups. Every group made is listed, with a serial number of this process (never reused),
 * until destroyed. moe_rt_ll_group_acquire finds the live group of that address and serial and holds it (a
 * destroy meanwhile unlists it at once and frees it at the last release); it fails with
 * MOE_RT_ERROR_INVALID_ARGUMENT for a group destroyed or never made (an address reused by a later group has
 * another serial). Each acquire is paired with one release. Used by the XLA handlers (libmoe_rt_xla.so), whose
 * calls carry a group's address and serial as attributes. */
int64_t moe_rt_ll_group_serial(const moe_rt_ll_group* group); /* 0 for NULL */
moe_rt_status moe_rt_ll_group_acquire(int64_t address, int64_t serial, moe_rt_ll_group** out);
void moe_rt_ll_group_release(moe_rt_ll_group* group); /* NULL is a no-op */
/* A copy of the group's desc (its sizes and buffers). */
moe_rt_status moe_rt_ll_group_get_desc(const moe_rt_ll_group* group, moe_rt_ll_group_desc* out);

/* Dispatch into buffer set `buffer_set`: phases MOE_RT_LL_PUSH | MOE_RT_LL_RECEIVE (one kernel sends and
 * receives), MOE_RT_LL_PUSH (send now) or MOE_RT_LL_RECEIVE (later, the receive half of that push: same
 * buffer set, tables and arguments). A launch with the push first runs the barrier. 0 <= T <= Tmax.
 * fp8 = 0: x [T, H] in the group's dtype (x_fp8, x_scales NULL; dequantize 0). fp8 = 1 (an fp8 group): either
 * x (quantized in the push) or the pair x_fp8 [T, H] e4m3 codes and x_scales [T, S] float32; dequantize = 1
 * writes the received rows dequantized into recv (else the codes and scales into recv_q / recv_s).
 * topk_idx [T, K] int32 or int64 (idx_dtype; ids in [-1, E), others recorded in the error word and taken as
 * -1), topk_weights [T, K] float32; tables: the handle's six tables (idx, w only read with T > 0). */
moe_rt_status moe_rt_ll_dispatch(moe_rt_ll_group* group, int buffer_set, int phases, const void* x,
                                 const void* x_fp8, const float* x_scales, int fp8, int dequantize,
                                 const void* topk_idx, int idx_dtype, const float* topk_weights, int64_t num_tokens,
                                 const moe_rt_ll_tables* tables, moe_rt_stream stream);
/* The combine direction: barrier, then ep_ll_combine for the handle `tables` of a dispatch through buffer set
 * `buffer_set` (reads idx, w, route). op MOE_RT_EP_OP_COMBINE: out [T, H] = sum_k w * y[slot] (y [L, R*Tmax, H];
 * with desc.combine_partials: the fp32 sum over the token's ranks ascending of each rank's partial sum_slots
 * slot_w * y[slot], rounded to dtype, reading route, slot_w and idx instead of w);
 * MOE_RT_EP_OP_DISPATCH_BWD: out [T, H] = sum_k y[slot] (unweighted), and with slot_grads [L, R*Tmax] float32
 * also grad_w [T, K] float32 = slot_grads at each slot; MOE_RT_EP_OP_COMBINE_BWD: grad_w = slot_grads at each
 * slot (y, out NULL; the weight gradient after moe_rt_ll_combine_bwd's dots). */
moe_rt_status moe_rt_ll_combine(moe_rt_ll_group* group, int buffer_set, int op, const void* y,
                                const float* slot_grads, const moe_rt_ll_tables* tables, int64_t num_tokens,
                                void* out, float* grad_w, moe_rt_stream stream);
/* VJP of combine, the rows: barrier, then the dispatch direction (ep_ll_dispatch) writing grad_out [T, H]'s rows
 * into buffer set `buffer_set`'s recv: slot_w * grad_out[t] (expert_out NULL), or unscaled followed by
 * ep_ll_slot_dot (expert_out [L, R*Tmax, H], not the recv buffer): dots [L*R*Tmax] float32 = <expert_out,
 * grad rows> per slot (0 where no token) and the rows scaled by slot_w. Rows of slots with no token are zero.
 * Then moe_rt_ll_combine(MOE_RT_EP_OP_COMBINE_BWD, slot_grads = dots) gives the weight gradient. */
moe_rt_status moe_rt_ll_combine_bwd(moe_rt_ll_group* group, int buffer_set, const void* grad_out,
                                    const void* expert_out, const moe_rt_ll_tables* tables, int64_t num_tokens,
                                    float* dots, moe_rt_stream stream);

/* ======================================================================================================
 * NCCL and the communicator (csrc/comm.c; moe_rt._comm.Communicator is a thin layer over these)
 *
 * NCCL is loaded at run time with dlopen (RTLD_NOW | RTLD_GLOBAL); no NCCL header is needed to build or to
 * compile against this file. One process uses one copy: the first successful load stays, so communicators
 * made by torch or CuPy and these live in the same library. The search (a NULL path to moe_rt_nccl_load, and
 * every function below when nothing is loaded yet): the MOE_RT_NCCL_PATH environment variable; else a
 * libnccl.so.2 already loaded in the process; else libnccl.so.2 from the system search path. (The Python
 * side, moe_rt._comm, passes its own find instead: MOE_RT_NCCL_PATH, else the nvidia-nccl wheel or the copy
 * already loaded through cuda.pathfinder, else libnccl.so.2.) A load that fails is not remembered: the next
 * call tries again. Without NCCL every function returns MOE_RT_ERROR_NO_NCCL with the path and dlerror().
 *
 * An NCCL call that fails (any ncclResult_t but ncclSuccess and ncclInProgress) returns MOE_RT_ERROR_NCCL;
 * moe_rt_last_error() reads "<ncclCall> failed: <NCCL's error string>[; <ncclGetLastError>] (ncclResult_t
 * N)" and moe_rt_nccl_last_failure() gives the call, the result and the message apart. A communicator is one
 * rank of a group, one process (or thread) per GPU; the data calls take device pointers, element counts
 * (>= 0), moe_rt dtype codes (int8, uint8, int32, uint32, int64, uint64, float16, float32, float64,
 * bfloat16) and a stream, and are NCCL's (collectives: every rank calls them in the same order).
 * ====================================================================================================== */
#define MOE_RT_NCCL_UNIQUE_ID_BYTES 128

typedef struct moe_rt_comm moe_rt_comm;

typedef enum moe_rt_reduce_op {
  MOE_RT_REDUCE_SUM = 0,
  MOE_RT_REDUCE_MAX = 1
} moe_rt_reduce_op;

/* The last NCCL failure on this thread (thread-local, cleared by every moe_rt_nccl_* / moe_rt_comm_* call). */
typedef struct moe_rt_nccl_failure {
  int32_t result;     /* the ncclResult_t (-1: a function missing from the library; 0: none) */
  char call[64];      /* the NCCL function, e.g. "ncclSend" ("" when the last failure was not NCCL's) */
  char message[1024]; /* NCCL's error string, then "; " and ncclGetLastError's text when it has one */
} moe_rt_nccl_failure;

/* Load NCCL from `path` (a file name or path for dlopen; NULL = the search above) unless a copy is loaded
 * already (then MOE_RT_SUCCESS: moe_rt_nccl_library_path tells which). */
moe_rt_status moe_rt_nccl_load(const char* path);
/* The path the loaded NCCL was opened by (valid while the process lives). */
moe_rt_status moe_rt_nccl_library_path(const char** path);
/* The loaded NCCL's version (ncclGetVersion, decoded). Needs no GPU. */
moe_rt_status moe_rt_nccl_version(int* major, int* minor, int* patch);
/* NCCL's text for an ncclResult_t value (ncclGetErrorString; a static string of the library). */
moe_rt_status moe_rt_nccl_error_string(int result, const char** text);
moe_rt_status moe_rt_nccl_last_failure(moe_rt_nccl_failure* out);
/* The ncclDataType_t of a moe_rt dtype code (one of the ten above; others: MOE_RT_ERROR_INVALID_ARGUMENT).
 * Needs no NCCL. */
moe_rt_status moe_rt_nccl_dtype(int dtype, int* nccl_type);
/* A fresh unique id (MOE_RT_NCCL_UNIQUE_ID_BYTES bytes into id) for every rank of a new communicator. Without
 * NCCL_COMM_ID it starts NCCL's bootstrap listener in this process. Needs no GPU. */
moe_rt_status moe_rt_nccl_get_unique_id(void* id);
/* Rank `rank` of `nranks` (ncclCommInitRank; a collective over the ranks, which pass the same id) on the
 * calling thread's current CUDA device (cudaSetDevice / the current context's device). */
moe_rt_status moe_rt_comm_init_rank(const void* unique_id, int nranks, int rank, moe_rt_comm** comm);
/* ncclCommDestroy (a collective: every rank calls it) and free comm, also when NCCL reports a failure.
 * NULL is a no-op. */
moe_rt_status moe_rt_comm_destroy(moe_rt_comm* comm);
/* ncclCommAbort (tears the communicator down at once, for error paths) and free comm. NULL is a no-op. */
moe_rt_status moe_rt_comm_abort(moe_rt_comm* comm);
/* *result = the communicator's asynchronous error (ncclCommGetAsyncError; 0 = healthy, 7 = in progress).
 * When it is a failure and message is not NULL, message (message_bytes, at least 1) receives NCCL's text for
 * it as moe_rt_nccl_failure.message. */
moe_rt_status moe_rt_comm_async_error(moe_rt_comm* comm, int* result, char* message, size_t message_bytes);
/* *aborted = 1 when a wait of the core (moe_rt_peer_buffer_create) aborted comm (ncclCommAbort) on a timeout or
 * an NCCL error: every other call on it then fails, and moe_rt_comm_abort / moe_rt_comm_destroy only free it. */
moe_rt_status moe_rt_comm_aborted(const moe_rt_comm* comm, int* aborted);
moe_rt_status moe_rt_comm_count(const moe_rt_comm* comm, int* count);
moe_rt_status moe_rt_comm_user_rank(const moe_rt_comm* comm, int* rank);
/* The raw ncclComm_t (to hand to code using NCCL directly). */
moe_rt_status moe_rt_comm_nccl_handle(const moe_rt_comm* comm, void** nccl_comm);
/* ncclGroupStart / ncclGroupEnd. comm (NULL allowed) is a communicator of the group: a failure's message
 * carries its ncclGetLastError. */
moe_rt_status moe_rt_comm_group_start(void);
moe_rt_status moe_rt_comm_group_end(const moe_rt_comm* comm);
/* Point to point: count elements of dtype to / from rank peer in [0, nranks). */
moe_rt_status moe_rt_comm_send(moe_rt_comm* comm, const void* buf, int64_t count, int dtype, int peer,
                               moe_rt_stream stream);
moe_rt_status moe_rt_comm_recv(moe_rt_comm* comm, void* buf, int64_t count, int dtype, int peer,
                               moe_rt_stream stream);
/* recv[r*count : (r+1)*count] = send of rank r. */
moe_rt_status moe_rt_comm_all_gather(moe_rt_comm* comm, const void* send, void* recv, int64_t count, int dtype,
                                     moe_rt_stream stream);
/* recv = op over the ranks of send (count elements; send == recv: in place); op a moe_rt_reduce_op. */
moe_rt_status moe_rt_comm_all_reduce(moe_rt_comm* comm, const void* send, void* recv, int64_t count, int dtype,
                                     int op, moe_rt_stream stream);
/* recv = send of rank root, in [0, nranks) (send read on the root alone). */
moe_rt_status moe_rt_comm_broadcast(moe_rt_comm* comm, const void* send, void* recv, int64_t count, int dtype,
                                    int root, moe_rt_stream stream);

/* ======================================================================================================
 * Peer buffers (csrc/peer.c; moe_rt._ep_direct._Shared is a thin layer over these)
 *
 * One device allocation per rank (cuMemAlloc, at least 256 bytes, so 256-byte aligned), shared through CUDA
 * IPC: each rank's IPC handle travels once through the communicator (an all-gather of the 64-byte handles on
 * `stream`), and each rank maps the allocations of the ranks in [peer_lo, peer_hi) (cuIpcOpenMemHandle with
 * lazy peer access; the ranks of one node: another node's handles cannot be opened). The direct EP transport's
 * barrier slots, chunk flags, receive stages and prepare's box, and the low-latency groups' buffers, are peer
 * buffers: their peer tables are the `table` of moe_rt_peer_buffer_info (moe_rt_ep_direct_group_desc,
 * moe_rt_ll_group_desc). Made on a device context (the buffer refers to it: destroy the buffer first); a
 * planning context gets MOE_RT_ERROR_NOT_SUPPORTED.
 *
 * moe_rt_peer_buffer_create is a collective (every rank of comm calls it, in the same order as its other
 * collectives) with a host wait: it waits for `stream` (cuStreamQuery, polling the communicator's asynchronous
 * error) at most timeout_ms milliseconds; past that deadline it aborts the communicator (ncclCommAbort; see
 * moe_rt_comm_aborted) and returns MOE_RT_ERROR_TIMEOUT, its message naming the op; an asynchronous NCCL error
 * met while waiting also aborts it (MOE_RT_ERROR_NCCL). Not while `stream` is being captured into a CUDA graph
 * (MOE_RT_ERROR_NOT_SUPPORTED). comm NULL: a group of one rank (nothing exchanged). On any failure everything
 * made so far is released and *out is NULL.
 *
 * Teardown (every rank, after its last use of the buffers, and after its peers' last use: e.g. a barrier):
 * moe_rt_peer_buffer_close_mappings on every buffer of a group (the mappings of the peers' allocations closed
 * before the communicator is destroyed), then, with the device idle, moe_rt_peer_buffer_destroy on each
 * (closes any mapping left open, then frees this rank's allocation and the table).
 * ====================================================================================================== */
#define MOE_RT_IPC_HANDLE_BYTES 64

typedef struct moe_rt_peer_buffer moe_rt_peer_buffer;

typedef struct moe_rt_peer_buffer_info {
  void* local;       /* this rank's allocation (at least max(nbytes, 256) bytes) */
  void* const* ptrs; /* host [nranks]: each rank's allocation as mapped here (ptrs[rank] = local; NULL for a
                        rank outside [peer_lo, peer_hi)); valid while the buffer lives */
  int64_t* table;    /* device int64 [nranks]: the same addresses */
  size_t nbytes;     /* the size asked for */
  int32_t nranks, rank, peer_lo, peer_hi;
} moe_rt_peer_buffer_info;

/* Make this rank's peer buffer of nbytes (zero = 1: zeroed on `stream` first) and map those of the ranks in
 * [peer_lo, peer_hi) (0 <= peer_lo <= rank < peer_hi <= nranks); timeout_ms >= 1: the exchange's deadline. */
moe_rt_status moe_rt_peer_buffer_create(moe_rt_context* ctx, moe_rt_comm* comm, size_t nbytes, int zero,
                                        int peer_lo, int peer_hi, moe_rt_stream stream, int64_t timeout_ms,
                                        moe_rt_peer_buffer** out);
/* The buffer's addresses and sizes. */
moe_rt_status moe_rt_peer_buffer_get_info(const moe_rt_peer_buffer* buf, moe_rt_peer_buffer_info* out);
/* Close this process's mappings of the peers' allocations (idempotent; their entries of ptrs become NULL, the
 * device table keeps the old addresses: nothing may use it afterwards). */
moe_rt_status moe_rt_peer_buffer_close_mappings(moe_rt_peer_buffer* buf);
/* Close the mappings left open, then free this rank's allocation, the table and buf (the device must be done
 * with them). NULL is a no-op. buf is freed even when a driver call fails (the first failure is returned). */
moe_rt_status moe_rt_peer_buffer_destroy(moe_rt_peer_buffer* buf);

#ifdef __cplusplus
}
#endif

/* ======================================================================================================
 * Part 2: the expert-parallel handle
 * ====================================================================================================== */

#define MOE_RT_EP_HANDLE_ALIGN 256

enum moe_rt_ep_region {
  MOE_RT_EP_META = 0,
  MOE_RT_EP_ROUTING = 1,
  MOE_RT_EP_SEND_TOK = 2,
  MOE_RT_EP_SEND_POS = 3,
  MOE_RT_EP_RECV_TOK = 4,
  MOE_RT_EP_RECV_LOCAL = 5,
  MOE_RT_EP_RECV_WK = 6,
  MOE_RT_EP_DST_ROW = 7,
  MOE_RT_EP_SRC_SLOT = 8,
  MOE_RT_EP_SEG_START = 9,
  MOE_RT_EP_EXPERT_COUNTS = 10,
  MOE_RT_EP_TOKENS_PER_EXPERT = 11,
  MOE_RT_EP_NUM_REGIONS = 12
};

/* int32 indices inside the meta region */
#define MOE_RT_EP_META_SEND_COUNTS(R) 0
#define MOE_RT_EP_META_RECV_COUNTS(R) (R)
#define MOE_RT_EP_META_RECV_SLOTS(R) (2 * (R))
#define MOE_RT_EP_META_SEND_OFF(R) (3 * (R))
#define MOE_RT_EP_META_RECV_OFF(R) (4 * (R) + 1)
#define MOE_RT_EP_META_PAIR_OVERFLOW(R) (5 * (R) + 2)
#define MOE_RT_EP_META_EXPERT_OVERFLOW(R) (5 * (R) + 3)
#define MOE_RT_EP_META_TOTAL_SLOTS(R) (5 * (R) + 4)
#define MOE_RT_EP_META_NUM_TOKENS(R) (5 * (R) + 5)
#define MOE_RT_EP_META_RECV_ROWS(R) (5 * (R) + 6)
#define MOE_RT_EP_META_SEND_ROWS(R) (5 * (R) + 7)

typedef struct moe_rt_ep_handle_desc {
  int32_t num_ranks, num_local_experts, max_tokens_per_rank, topk, pair_capacity;
  int64_t recv_rows, num_rows;
  uint64_t offset[MOE_RT_EP_NUM_REGIONS]; /* byte offsets in the handle buffer */
  uint64_t total_bytes;
} moe_rt_ep_handle_desc;

/* Fill d->offset and d->total_bytes from the sizes already set in d; returns total_bytes. */
static inline uint64_t moe_rt_ep_handle_layout(moe_rt_ep_handle_desc* d) {
  const uint64_t R = (uint64_t)d->num_ranks, L = (uint64_t)d->num_local_experts;
  const uint64_t Tmax = (uint64_t)d->max_tokens_per_rank, K = (uint64_t)d->topk;
  const uint64_t P = (uint64_t)d->pair_capacity, rows = (uint64_t)d->recv_rows, N = (uint64_t)d->num_rows;
  const uint64_t count[MOE_RT_EP_NUM_REGIONS] = {
      5 * R + 10, Tmax * K + 1, R * P, R * Tmax, R * P, rows * K,
      rows * K,   rows * K,           N,     L + 1,    L,     L};
  uint64_t off = 0;
  for (int i = 0; i < MOE_RT_EP_NUM_REGIONS; ++i) {
    d->offset[i] = off;
    off += count[i] * 4; /* every region holds 4-byte elements */
    off = (off + MOE_RT_EP_HANDLE_ALIGN - 1) / MOE_RT_EP_HANDLE_ALIGN * MOE_RT_EP_HANDLE_ALIGN;
  }
  d->total_bytes = off;
  return off;
}

/* ======================================================================================================
 * The direct transport of the normal EP mode (moe_rt/_ep_direct.py DirectTransport; csrc/ep_direct.c):
 * the group over the peer tables, barrier state and receive stages the caller made (IPC-shared buffers),
 * whose ops launch the barrier and the fused kernels of kernels/ep.cu (plans cached per signature).
 * ====================================================================================================== */
typedef struct moe_rt_ep_direct_group moe_rt_ep_direct_group;

typedef struct moe_rt_ep_direct_group_desc {
  int32_t num_ranks, rank;
  int32_t node_lo, node_hi;      /* the ranks reached through peer memory: [node_lo, node_hi) holds rank */
  int32_t pair_rows;             /* rows per (source, destination) pair the chunk flags cover (the group's P) */
  int64_t timeout_ns;            /* the device waits' timeout, > 0 */
  const int64_t* peer_barrier;   /* peer table [R] of the barrier slots (uint32 [R] per rank) */
  const int64_t* peer_flags;     /* peer table [R] of the chunk flags (uint32 [R*pair_rows] per rank) */
  uint32_t* barrier_state;       /* uint32 [4], 8-byte aligned, zeroed once: the barrier epoch, the sticky failure
                                    flag, and a uint64 work counter of the dispatch kernel */
  int32_t* timeout_word;         /* a timed-out wait writes its op (moe_rt_ep_op, 5 close, 6 prepare) here */
} moe_rt_ep_direct_group_desc;

/* One receive stage pair (rows of row_bytes, fp32 weights [K] per row): this rank's parts and peer tables. */
typedef struct moe_rt_ep_direct_stage {
  int64_t row_bytes;
  int32_t topk;
  int32_t align;                 /* the widest power of two <= 16 dividing every rank's stage address */
  void* rows_local;              /* [R*pair_rows, row_bytes] bytes */
  const int64_t* peer_rows;
  float* w_local;                /* [R*pair_rows, topk] fp32 */
  const int64_t* peer_w;
} moe_rt_ep_direct_stage;

/* A call's handle: its buffer (the layout of moe_rt_ep_handle_layout over desc's sizes) and tokens. */
typedef struct moe_rt_ep_direct_handle {
  moe_rt_ep_handle_desc desc;
  void* buffer;
  int64_t num_tokens;
  int32_t exact;                 /* 1: exact mode (received rows packed; a row map to the stage rows) */
} moe_rt_ep_direct_handle;

/* dispatch's outputs (the dispatch direction: MOE_RT_EP_OP_DISPATCH or MOE_RT_EP_OP_COMBINE_BWD). */
typedef struct moe_rt_ep_direct_outputs {
  int32_t fp8;        /* 0: x's rows; 1: x packed FP8 rows split into codes out and scales out_s; 2: dequantized */
  int32_t out_dtype;  /* fp8 = 2: out's dtype */
  int32_t hidden;     /* fp8: H */
  void* out;          /* expert-major rows [N, .] (NULL: only wait for every chunk) */
  float* out_s;       /* fp8 = 1: scales [N, ceil(H/128)] */
  float* out_w;       /* weights [N] = recv_wk[src_slot[n]], or NULL */
  int32_t fill;       /* 1: zero the rows that hold no slot (zero) and lay out out_w after the expand */
  int32_t zero;
  void* recv_buf;     /* exact mode without out: the received rows [rows, row_bytes] packed from the stage */
  int32_t* row_map;   /* exact mode: int32 [max(rows,1)] the handle's stage-row map */
  int32_t make_row_map; /* 1: compute row_map first (its first use for this handle) */
  int32_t with_w;     /* 1: weights travel: w's rows (NULL only when T = 0) and the peers' into recv_wk; 0: w is NULL.
                       * Every rank of an op passes the same (a rank without tokens still receives weights). */
  int32_t* tokens_per_expert; /* int32 [L] or NULL: a copy of the handle's tokens_per_expert, made on the stream
                               * after the launches (one device-to-device copy: dispatch's third result) */
  int32_t scale; /* MOE_RT_EP_OP_COMBINE_BWD, fp8 = 0, fill = 1, out and out_w given: 1 weights each expanded row
                  * by its slot's weight, out[n] = out_dtype(out_w[n] * float(row)) (the weighted gradient of
                  * combine without y), in the dispatch kernel where rows and addresses are 16-byte aligned, else
                  * by a second kernel (ep_scale_rows); out_dtype: the rows' float dtype */
} moe_rt_ep_direct_outputs;

moe_rt_status moe_rt_ep_direct_group_create(moe_rt_context* ctx, const moe_rt_ep_direct_group_desc* desc,
                                            moe_rt_ep_direct_group** out);
void moe_rt_ep_direct_group_destroy(moe_rt_ep_direct_group* g);
/* The registry of live direct groups, as the low-latency groups' (moe_rt_ll_group_acquire): the XLA handlers of
 * moe_rt.jax ep_* name a group by address and serial and hold it for the call. */
int64_t moe_rt_ep_direct_group_serial(const moe_rt_ep_direct_group* g); /* 0 for NULL */
moe_rt_status moe_rt_ep_direct_group_acquire(int64_t address, int64_t serial, moe_rt_ep_direct_group** out);
void moe_rt_ep_direct_group_release(moe_rt_ep_direct_group* g); /* NULL is a no-op */
/* A copy of the group's desc, and (ctx not NULL) the context it launches on. */
moe_rt_status moe_rt_ep_direct_group_get_desc(const moe_rt_ep_direct_group* g, moe_rt_ep_direct_group_desc* out,
                                              moe_rt_context** ctx);
/* The stage pair registered for (row_bytes, topk). */
moe_rt_status moe_rt_ep_direct_get_stage(moe_rt_ep_direct_group* g, int64_t row_bytes, int topk,
                                         moe_rt_ep_direct_stage* out);
/* Register a stage pair (row_bytes, topk), made by the caller on first use (a collective). */
moe_rt_status moe_rt_ep_direct_add_stage(moe_rt_ep_direct_group* g, const moe_rt_ep_direct_stage* stage);
/* ep_direct_barrier among the node's ranks; op: what a timeout records. */
moe_rt_status moe_rt_ep_direct_barrier(moe_rt_ep_direct_group* g, int op, moe_rt_stream stream);
/* The dispatch direction: [barrier], ep_direct_dispatch of x [T, row_bytes] (weights w [T,K] fp32 into recv_wk
 * with outputs->with_w; with outputs->fill the rows holding no slot zeroed (outputs->zero) and the weights laid
 * out into outputs->out_w; outputs->tokens_per_expert copied), then the row map and the packed copy, as `o`
 * asks (with row_bytes 0, no kernel: ep_copy_rows, ep_fill_rows and a memcpy do the weights' part). */
moe_rt_status moe_rt_ep_direct_dispatch(moe_rt_ep_direct_group* g, int op, const moe_rt_ep_direct_handle* h,
                                        const void* x, int64_t row_bytes, const float* w,
                                        const moe_rt_ep_direct_outputs* o, int barrier, moe_rt_stream stream);
/* The combine direction (MOE_RT_EP_OP_COMBINE or MOE_RT_EP_OP_DISPATCH_BWD): [ep_slot_values of grad_rows [N]
 * into slot_grads [rows,K]], [barrier], ep_direct_combine of y [N, hidden] dtype (weights w [rows,K] or NULL)
 * into out [T, hidden] and grad_w [T,K] (with slot_grads). */
moe_rt_status moe_rt_ep_direct_combine(moe_rt_ep_direct_group* g, int op, const moe_rt_ep_direct_handle* h,
                                       const void* y, int dtype, int64_t hidden, const float* w,
                                       const float* grad_rows, float* slot_grads, void* out, float* grad_w,
                                       int barrier, moe_rt_stream stream);

/* ======================================================================================================
 * EpGroup.prepare's launches (kernels/ep.cu; csrc/ep_prepare.c) over a handle buffer the caller allocated
 * (moe_rt_ep_handle_layout of desc.handle) and scratch it sized with moe_rt_ep_prepare_sizes. The exchange
 * between the send and the received side (NCCL) and exact mode's host read stay the caller's.
 * ====================================================================================================== */

typedef struct moe_rt_ep_prepare_desc {
  moe_rt_ep_handle_desc handle; /* sizes; recv_rows and num_rows: capacity mode the final ones (R*P, the
                                   plan's rows), exact mode 0 for the send side and the counts */
  int32_t rank;
  int32_t num_experts;          /* E = num_ranks * num_local_experts */
  int32_t align_size;
  int32_t idx_dtype;            /* MOE_RT_INT32 or MOE_RT_INT64: topk_idx [num_tokens, topk] */
  int32_t direct;               /* 1: the direct transport's box (segments pushed into the peers' boxes) */
  int64_t num_tokens;           /* T in [0, max_tokens_per_rank] */
  int64_t capacity;             /* capacity mode: the slots kept (num_out); -1: exact mode */
  int64_t total_slots;          /* exact mode, moe_rt_ep_prepare_recv: the slots received (the meta region's
                                   total_slots, read on the host); ignored otherwise */
} moe_rt_ep_prepare_desc;

/* What the caller allocates and decides from (stated once in the core). */
typedef struct moe_rt_ep_prepare_sizes {
  int64_t chunk_tokens;   /* the send side's chunk of tokens (TC) */
  int64_t num_chunks;     /* chunks per destination (B) */
  int64_t part_words;     /* int32 words of the send side's scratch: R*B*(L + 1) */
  int64_t segment_words;  /* int32 words of one source's segment of a box: (L + 2) + P*(2K + 1) */
  int32_t fused;          /* 1: the received side is one kernel (ep_prepare_plan); 0: ep_prepare_recv and the
                             permutation plan's kernels (workspace: moe_rt_make_plan_workspace_size) */
  int32_t whole;          /* 1: moe_rt_ep_prepare_send makes the whole prepare (capacity mode on the direct
                             transport with a fused received side: ep_prepare_direct) */
} moe_rt_ep_prepare_sizes;

typedef struct moe_rt_ep_prepare_buffers {
  void* handle;                 /* the handle buffer */
  const void* topk_idx;         /* [num_tokens, topk] idx_dtype (NULL when num_tokens = 0) */
  int32_t* part;                /* part_words of scratch */
  uint32_t* grid_sync;          /* two words of device memory, zero when made (grid_sync in kernels/ep.cu) */
  uint32_t* error_word;         /* the device's error word (NULL: the context's) */
  uint32_t* state;              /* direct: the transport's epoch state; NULL on NCCL */
  const int64_t* peer_box;      /* direct: the box table (a box of 2 * R * segment_words int32 per rank) */
  int32_t* inbox;               /* R segments where this rank's received side reads (direct: its own box) */
  int32_t* outbox;              /* NCCL: R segments sent to the peers (the inbox when R = 1); direct: NULL */
  const int64_t* peer_barrier;  /* whole: ep_direct_barrier's slot table, its timeout and timeout word */
  int64_t timeout_ns;
  int32_t* timeout_word;
  int32_t* workspace;           /* unfused received side: the plan kernels' scratch */
  size_t workspace_bytes;
} moe_rt_ep_prepare_buffers;

moe_rt_status moe_rt_ep_prepare_sizes_of(const moe_rt_ep_prepare_desc* desc, moe_rt_ep_prepare_sizes* out);
/* The send side: ep_prepare_send (routing, send lists, the segments), or where sizes.whole the whole prepare
 * (ep_prepare_direct: send side, the barrier with the peers, received side). */
moe_rt_status moe_rt_ep_prepare_send(moe_rt_context* ctx, const moe_rt_ep_prepare_desc* desc,
                                     const moe_rt_ep_prepare_buffers* bufs, moe_rt_stream stream);
/* Exact mode, after the segments' counts arrived: ep_plan_meta (the meta region, for the host read). */
moe_rt_status moe_rt_ep_prepare_meta(moe_rt_context* ctx, const moe_rt_ep_prepare_desc* desc,
                                     const moe_rt_ep_prepare_buffers* bufs, moe_rt_stream stream);
/* The received side once the segments arrived (exact mode: desc.handle's recv_rows and num_rows from the host
 * read, the handle the buffer sized from them): ep_prepare_plan, or ep_prepare_recv and the plan kernels. */
moe_rt_status moe_rt_ep_prepare_recv(moe_rt_context* ctx, const moe_rt_ep_prepare_desc* desc,
                                     const moe_rt_ep_prepare_buffers* bufs, moe_rt_stream stream);
/* combine_bwd's weight gradient of the received rows from the per-slot dots: out[n] = slots[src_slot[n]], 0 where
 * src_slot[n] < 0 (n: the handle's expert-major rows; src_slot: the handle's region MOE_RT_EP_SRC_SLOT). */
moe_rt_status moe_rt_ep_gather_slots(moe_rt_context* ctx, const float* slots, const int32_t* src_slot, float* out,
                                     int64_t n, moe_rt_stream stream);

#endif /* MOE_RT_H_ */
