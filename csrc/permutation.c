/* moe_rt core: dispatch on one GPU (kernels/permutation.cu): make_plan, dispatch, combine and their
 * backwards. The kernel choices are those of moe_rt/permutation.py (tests/test_c_abi.py compares them). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define FILE_PERM "permutation.cu"
#define UNROLL 4
#define INT32_MAX_ 2147483647LL
/* combine_slices configuration (permutation.py _COMBINE_CFG): largest CTA, element groups per thread,
 * slots whose loads are issued together, load kind, CTAs per SM asked of the register allocator (the
 * grid is not persistent). */
#define COMBINE_BLOCK_MAX 128
#define COMBINE_UNROLL 1
#define COMBINE_KU 8
#define COMBINE_LM 1
#define COMBINE_MINB 8

static const char* unit_type(int u) {
  switch (u) {
    case 16: return "uint4";
    case 8: return "uint2";
    case 4: return "unsigned";
    case 2: return "unsigned short";
  }
  return "unsigned char";
}

/* ---- sizes -------------------------------------------------------------------------------------------- */

static int64_t num_rows_of(int64_t T, int64_t K, int64_t E, int64_t A, int64_t num_out) {
  int64_t kept = num_out < 0 ? T * K : num_out;
  if (A == 1) return kept;
  return (kept + E * (A - 1)) / A * A;
}

static moe_rt_status check_plan_sizes(const char* op, int64_t T, int64_t K, int E, int A, int64_t num_out) {
  if (T < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_tokens must be >= 0, got %lld", op, (long long)T);
  if (K < 1) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: topk must be >= 1, got %lld", op, (long long)K);
  if (E < 1 || E > MOE_RT_MAX_EXPERTS)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_experts must be in [1, %d], got %d", op, MOE_RT_MAX_EXPERTS, E);
  if (A < 1 || A > (1 << 20))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: align_size must be in [1, %d], got %d", op, 1 << 20, A);
  if (K > INT32_MAX_ || T > INT32_MAX_ / K)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: routing: T*K = %lld*%lld slots must stay below 2^31", op,
                    (long long)T, (long long)K);
  if (num_out < -1 || num_out > INT32_MAX_)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_out_tokens must be -1 (keep all) or in [0, 2^31), got %lld",
                    op, (long long)num_out);
  if (num_out > T * K)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_out_tokens: must be <= T*K = %lld*%lld = %lld (the routed "
                    "slots), got %lld", op, (long long)T, (long long)K, (long long)(T * K), (long long)num_out);
  int64_t N = num_rows_of(T, K, E, A, num_out);
  if (N > INT32_MAX_)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_rows = %lld (from T*K / num_out_tokens and align_size) "
                    "must stay below 2^31", op, (long long)N);
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_plan_num_rows(int64_t T, int64_t K, int E, int A, int64_t num_out, int64_t* num_rows) {
  static const char op[] = "moe_rt_plan_num_rows";
  mrt_clear_error();
  moe_rt_status st;
  if ((st = mrt_check_ptr(op, "num_rows", num_rows)) || (st = check_plan_sizes(op, T, K, E, A, num_out))) return st;
  *num_rows = num_rows_of(T, K, E, A, num_out);
  return MOE_RT_SUCCESS;
}

/* Slots per warp of the plan kernels: 256, more when the [chunks, E] partial table would pass 4M ints. */
static int64_t chunk_for(int64_t L, int64_t E) {
  int64_t chunk = 256;
  while (mrt_cdiv(L, chunk) * E > (4 << 20) && chunk < (1 << 20)) chunk *= 2;
  return chunk;
}

/* make_plan in one CTA (plan_fused) where the L = T*K slots are few: the largest L it takes (the three kernels
 * above it; MOE_RT_PLAN_FUSED_SLOTS, read once, sets it for measurements, 0 turning the fused kernel off).
 * Device time on one H200 (BENCHMARKS.md, "make_plan in one CTA"), one CTA against three kernels, E = 64 to
 * 1024: L = 128 4.2-4.6 us against 13.0-14.9; L = 4096 13.7-16.8 against 17.2-20.9; L = 8192 21.8-29.1 against
 * 17.7-21.5. A routing map (L = T*E, one slot in E/K routed) has its own limit, MOE_RT_PLAN_FUSED_MAP_SLOTS: at
 * K = 8, E = 64 and 256, L = 8192 took 12.0 / 10.5 us against 16.1 / 16.0, L = 16384 19.4 / 16.7 against 16.8 /
 * 16.7 (BENCHMARKS.md, "make_plan in one CTA for a routing map"). */
#define PLAN_FUSED_SLOTS 4096
#define PLAN_FUSED_MAP_SLOTS 8192

/* dispatch (and combine_backward without probs) in one launch, fill_rows's gather form, where the tokens' rows
 * fit in L2 (each is read once per kept slot): the most rows it takes (dispatch_rows then fill_rows above it)
 * and the most bytes of x. MOE_RT_GATHER_ROWS and MOE_RT_GATHER_X_BYTES, read once, set them for measurements
 * (0: off). Device time on one H200 (tools/bench_rows.py, bf16, K = 8; BENCHMARKS.md, "dispatch in one
 * launch"), one launch against two: 1024 rows 2.8 / 5.3 us (H = 1024), 6.4 / 7.8 (H = 7168); 8192 rows 6.8 /
 * 9.0 (H = 1024), 40.4 / 42.3 (H = 7168, x 14.7 MB); 65536 rows of H = 1024 (x 16 MiB) 43.5 / 46.8; every size
 * with x of at most 16 MiB won, up to the 65536 rows measured. With x of 29 MB and more the two kernels win:
 * 16384 rows of H = 7168 88.7 / 76.0, 65536 rows of H = 2048 (33.5 MB) 105 / 89.1. */
#define GATHER_ROWS 65536
#define GATHER_X_BYTES (16LL << 20)

/* The planners' size limits, each from its environment variable (read once): the default above when unset or
 * empty, the integer >= 0 it holds, else -1 (the op that needs it fails with knob_fail). */
enum { KNOB_PLAN_FUSED, KNOB_PLAN_FUSED_MAP, KNOB_GATHER_ROWS, KNOB_GATHER_X_BYTES, N_KNOBS };
static const struct {
  const char* name;
  int64_t dflt;
} knob_spec[N_KNOBS] = {{"MOE_RT_PLAN_FUSED_SLOTS", PLAN_FUSED_SLOTS},
                        {"MOE_RT_PLAN_FUSED_MAP_SLOTS", PLAN_FUSED_MAP_SLOTS},
                        {"MOE_RT_GATHER_ROWS", GATHER_ROWS},
                        {"MOE_RT_GATHER_X_BYTES", GATHER_X_BYTES}};

static int64_t knob(int k) {
  static int64_t cache[N_KNOBS] = {-2, -2, -2, -2};
  if (cache[k] == -2) {
    const char* env = getenv(knob_spec[k].name);
    int64_t r = knob_spec[k].dflt;
    if (env && *env) {
      size_t n = strspn(env, "0123456789");
      r = env[n] == 0 && n <= 18 ? strtoll(env, NULL, 10) : -1;
    }
    cache[k] = r;
  }
  return cache[k];
}

static moe_rt_status knob_fail(const char* op, int k) {
  return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: %s: expected an integer >= 0, got '%s'", op, knob_spec[k].name,
                  getenv(knob_spec[k].name));
}

/* Whether a row copy (x -> out by the plan, with its fill) runs as one gather launch; -1 for a bad knob. */
static int gather_rows(const char* op, const moe_rt_plan* plan, int64_t row_bytes) {
  const int64_t limit = knob(KNOB_GATHER_ROWS), x_limit = knob(KNOB_GATHER_X_BYTES);
  if (limit < 0 || x_limit < 0) {
    knob_fail(op, limit < 0 ? KNOB_GATHER_ROWS : KNOB_GATHER_X_BYTES);
    return -1;
  }
  return plan->num_tokens > 0 && plan->num_rows > 0 && row_bytes > 0 && plan->num_rows <= limit &&
         plan->num_tokens * row_bytes <= x_limit;
}

/* plan_fused's chunk (0: not fused) and *nchunks: at most 32 chunks (a warp each) of a multiple of 32 slots,
 * their counts and the totals ((nchunks + 1) * E ints) in the default 48 KiB of shared memory, less 256 bytes
 * for the kernel's own (plan_offsets_block's scratch). */
static int64_t fused_chunk(int64_t L, int64_t E, int64_t limit, int64_t* nchunks) {
  const int64_t room = (48 * 1024 - 256) / 4 / E - 1;
  if (L > limit || room < 1) return 0;
  const int64_t n = mrt_min(mrt_min(32, room), mrt_max(1, mrt_cdiv(L, 32)));
  const int64_t chunk = mrt_max(1, mrt_cdiv(mrt_cdiv(L, n), 32)) * 32;
  *nchunks = mrt_max(1, mrt_cdiv(L, chunk));
  return chunk;
}

static int64_t plan_workspace_ints(int64_t L, int64_t E) {
  int64_t nchunks = mrt_cdiv(L, chunk_for(L, E));
  return 2 * nchunks * E + E + 1; /* partial, base, totals, the last-CTA counter */
}

moe_rt_status moe_rt_make_plan_workspace_size(int64_t T, int64_t K, int E, size_t* bytes) {
  static const char op[] = "moe_rt_make_plan_workspace_size";
  mrt_clear_error();
  moe_rt_status st;
  if ((st = mrt_check_ptr(op, "bytes", bytes)) || (st = check_plan_sizes(op, T, K, E, 1, -1))) return st;
  *bytes = (size_t)plan_workspace_ints(T * K, E) * 4;
  return MOE_RT_SUCCESS;
}

/* ---- make_plan (permutation.py _plan_cfg, _plan_cuda) ----------------------------------------------- */

typedef struct plan_key {
  int32_t op, idx_dtype, E, A;
  int64_t T, K, num_out;
} plan_key;

moe_rt_status moe_rt_make_plan(moe_rt_context* ctx, const void* routing, int routing_dtype, int64_t T, int64_t K,
                               int E, int A, int64_t num_out, moe_rt_plan* plan, void* workspace,
                               size_t workspace_bytes, moe_rt_stream stream) {
  static const char op[] = "moe_rt_make_plan";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = mrt_check_ptr(op, "plan", plan))) return st;
  const char* ic = routing_dtype == MOE_RT_INT32 ? "int" : routing_dtype == MOE_RT_INT64 ? "long long"
                 : routing_dtype == MOE_RT_BOOL ? "bool" : NULL;
  if (!ic)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: routing_dtype: expected MOE_RT_INT32 or MOE_RT_INT64 (topk_idx) "
                    "or MOE_RT_BOOL (a routing map), got %s (%d)", op, mrt_dtype_name(routing_dtype), routing_dtype);
  if ((st = check_plan_sizes(op, T, K, E, A, num_out))) return st;
  if (routing_dtype == MOE_RT_BOOL && K != E)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: routing: a routing map must have shape [T, num_experts=%d]; "
                    "pass topk = %d, got %lld", op, E, E, (long long)K);
  const int64_t L = T * K, N = num_rows_of(T, K, E, A, num_out);
  /* arrays of no element may be NULL (XLA may pass those so) */
  if ((st = mrt_check_data(op, "plan->dst_row", plan->dst_row, L)) ||
      (st = mrt_check_data(op, "plan->src_slot", plan->src_slot, N)) ||
      (st = mrt_check_ptr(op, "plan->seg_start", plan->seg_start)) || (st = mrt_check_ptr(op, "plan->counts", plan->counts)) ||
      (st = mrt_check_ptr(op, "plan->tokens_per_expert", plan->tokens_per_expert)) ||
      (L > 0 && (st = mrt_check_ptr(op, "routing", routing))) || (st = mrt_check_ptr(op, "workspace", workspace)))
    return st;
  const size_t need = (size_t)plan_workspace_ints(L, E) * 4;
  if (workspace_bytes < need)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: workspace_bytes: need %zu (moe_rt_make_plan_workspace_size), "
                    "got %zu", op, need, workspace_bytes);
  plan->num_tokens = T;
  plan->topk = K;
  plan->num_experts = E;
  plan->num_rows = N;
  plan->align_size = A;

  plan_key key;
  memset(&key, 0, sizeof key);
  key.op = 3; key.idx_dtype = routing_dtype; key.E = E; key.A = A; key.T = T; key.K = K; key.num_out = num_out;
  mrt_plan p;
  const int limit_knob = routing_dtype == MOE_RT_BOOL ? KNOB_PLAN_FUSED_MAP : KNOB_PLAN_FUSED;
  const int64_t limit = knob(limit_knob);
  if (limit < 0) return knob_fail(op, limit_knob);
  int64_t nchunks = 0;
  const int64_t chunk = fused_chunk(L, E, limit, &nchunks);
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    if (chunk) {
      memset(&p, 0, sizeof p);
      p.num_launches = 1;
      snprintf(p.launch[0].name, sizeof p.launch[0].name, "plan_fused<%s>", ic);
      int regs = 0;
      if ((st = mrt_kernel(ctx, &p.launch[0], FILE_PERM, &regs))) return st;
      p.launch[0].grid = 1;
      p.launch[0].block = 1024;
      p.launch[0].smem = (int32_t)((nchunks + 1) * E * 4);
    } else {
      p.num_launches = 3;
      if ((st = mrt_plan_kernels(ctx, routing_dtype, L, E, p.launch))) return st;
    }
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  unsigned long long err = 0;
  if ((st = mrt_error_word(ctx, &err))) return st;
  mrt_args a[3];
  if (p.num_launches == 1) {
    memset(a, 0, sizeof a[0]);
    mrt_arg_ptr(&a[0], routing);
    mrt_arg_i64(&a[0], L);
    mrt_arg_i32(&a[0], E);
    mrt_arg_i32(&a[0], (int32_t)chunk);
    mrt_arg_i32(&a[0], (int32_t)nchunks);
    mrt_arg_i32(&a[0], A);
    mrt_arg_i64(&a[0], num_out < 0 ? L : num_out);
    mrt_arg_ptr(&a[0], plan->counts);
    mrt_arg_ptr(&a[0], plan->tokens_per_expert);
    mrt_arg_ptr(&a[0], plan->seg_start);
    mrt_arg_ptr(&a[0], plan->dst_row);
    mrt_arg_ptr(&a[0], plan->src_slot);
    mrt_arg_i64(&a[0], N);
    mrt_arg_ptr(&a[0], (const void*)(uintptr_t)err);
  } else {
    mrt_plan_kernel_args(routing, L, E, A, num_out, plan, workspace, err, a);
  }
  for (int i = 0; i < p.num_launches; ++i)
    if ((st = mrt_launch_one(ctx, &p.launch[i], &a[i], stream))) return st;
  return MOE_RT_SUCCESS;
}

moe_rt_status mrt_plan_kernels(moe_rt_context* ctx, int routing_dtype, int64_t L, int E, mrt_launch* l) {
  const char* ic = routing_dtype == MOE_RT_INT32 ? "int" : routing_dtype == MOE_RT_INT64 ? "long long" : "bool";
  const int64_t chunk = chunk_for(L, E), nchunks = mrt_cdiv(L, chunk);
  const int smem_warp = E * 4;
  const int wpb = (int)mrt_max(1, mrt_min(8, (48 * 1024) / smem_warp));
  const int smem = wpb * smem_warp;
  snprintf(l[0].name, sizeof l[0].name, "plan_count<%s>", ic);
  snprintf(l[1].name, sizeof l[1].name, "plan_scan");
  snprintf(l[2].name, sizeof l[2].name, "plan_assign<%s>", ic);
  int regs = 0;
  moe_rt_status st;
  for (int i = 0; i < 3; ++i)
    if ((st = mrt_kernel(ctx, &l[i], FILE_PERM, &regs))) return st;
  l[0].grid = mrt_max(mrt_cdiv(nchunks, wpb), 1);
  l[0].block = 32 * wpb;
  l[0].smem = smem;
  l[1].grid = mrt_cdiv(E, 32);
  l[1].block = 1024;
  l[2].grid = mrt_cdiv(nchunks, wpb);
  l[2].block = 32 * wpb;
  l[2].smem = smem;
  return MOE_RT_SUCCESS;
}

void mrt_plan_kernel_args(const void* routing, int64_t L, int E, int A, int64_t num_out, const moe_rt_plan* plan,
                          void* workspace, unsigned long long err, mrt_args* a) {
  const int64_t chunk = chunk_for(L, E), nchunks = mrt_cdiv(L, chunk), N = plan->num_rows;
  int32_t* partial = workspace;
  int32_t* base = partial + nchunks * E;
  int32_t* totals = base + nchunks * E;
  int32_t* done = totals + E;
  memset(a, 0, 3 * sizeof *a);
  /* plan_count always runs (it zeroes plan_scan's counter and fills src_slot with -1) */
  mrt_arg_ptr(&a[0], routing);
  mrt_arg_i64(&a[0], L);
  mrt_arg_i32(&a[0], E);
  mrt_arg_i32(&a[0], (int32_t)chunk);
  mrt_arg_i32(&a[0], (int32_t)nchunks);
  mrt_arg_ptr(&a[0], partial);
  mrt_arg_ptr(&a[0], plan->src_slot);
  mrt_arg_i64(&a[0], N);
  mrt_arg_ptr(&a[0], done);
  mrt_arg_ptr(&a[0], (const void*)(uintptr_t)err);
  mrt_arg_ptr(&a[1], partial);
  mrt_arg_ptr(&a[1], base);
  mrt_arg_ptr(&a[1], totals);
  mrt_arg_i32(&a[1], (int32_t)nchunks);
  mrt_arg_i32(&a[1], E);
  mrt_arg_i32(&a[1], A);
  mrt_arg_i64(&a[1], num_out < 0 ? L : num_out);
  mrt_arg_ptr(&a[1], plan->counts);
  mrt_arg_ptr(&a[1], plan->tokens_per_expert);
  mrt_arg_ptr(&a[1], plan->seg_start);
  mrt_arg_ptr(&a[1], done);
  mrt_arg_ptr(&a[2], routing);
  mrt_arg_i64(&a[2], L);
  mrt_arg_i32(&a[2], E);
  mrt_arg_i32(&a[2], (int32_t)chunk);
  mrt_arg_i32(&a[2], (int32_t)nchunks);
  mrt_arg_ptr(&a[2], base);
  mrt_arg_ptr(&a[2], plan->counts);
  mrt_arg_ptr(&a[2], plan->seg_start);
  mrt_arg_ptr(&a[2], plan->dst_row);
  mrt_arg_ptr(&a[2], plan->src_slot);
}

/* ---- shared launch shapes (permutation.py _unit, _threads, _row_grid, _slices) ---------------------- */

static int unit_of(int64_t row_bytes, const void* p, const void* q) {
  static const int us[5] = {16, 8, 4, 2, 1};
  for (int i = 0; i < 5; ++i) {
    int u = us[i];
    if (row_bytes % u == 0 && (uintptr_t)p % u == 0 && (q == NULL || (uintptr_t)q % u == 0)) return u;
  }
  return 1;
}

static int threads_for(int64_t units) {
  int64_t per = mrt_cdiv(units, UNROLL);
  return (int)mrt_min(1024, mrt_max(32, mrt_cdiv(per, 32) * 32));
}

static int64_t row_grid(const moe_rt_context* ctx, int64_t n_rows) {
  if (n_rows <= 0) return 0;
  return mrt_max(1, mrt_min(mrt_cdiv(n_rows, 8), (int64_t)mrt_device(ctx)->sm_count * 16));
}

static moe_rt_status check_plan_arg(const char* op, const moe_rt_plan* plan) {
  if (!plan) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: plan is NULL", op);
  moe_rt_status st = check_plan_sizes(op, plan->num_tokens, plan->topk, (int)mrt_min(plan->num_experts, INT32_MAX_),
                                      plan->align_size < 1 || plan->align_size > (1 << 20) ? 0 : (int)plan->align_size,
                                      -1);
  if (st) return st;
  if (plan->num_rows < 0 || plan->num_rows > INT32_MAX_)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: plan->num_rows must be in [0, 2^31), got %lld", op,
                    (long long)plan->num_rows);
  if ((st = mrt_check_data(op, "plan->dst_row", plan->dst_row, plan->num_tokens * plan->topk)) ||
      (st = mrt_check_data(op, "plan->src_slot", plan->src_slot, plan->num_rows)))
    return st;
  return MOE_RT_SUCCESS;
}

static moe_rt_status check_hidden(const char* op, int64_t H, int dtype) {
  if (H < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: hidden must be >= 0, got %lld", op, (long long)H);
  if (H > ((int64_t)1 << 40) / (mrt_dtype_size(dtype) ? mrt_dtype_size(dtype) : 1))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: hidden %lld is too large", op, (long long)H);
  return MOE_RT_SUCCESS;
}

static moe_rt_status check_token_dtype(const char* op, const char* name, int dtype, int bytes_ok) {
  if (mrt_is_float_dtype(dtype)) return MOE_RT_SUCCESS;
  if (bytes_ok && mrt_dtype_size(dtype) == 1 && dtype != MOE_RT_BOOL) return MOE_RT_SUCCESS;
  return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: %s: expected dtype float32, float16 or bfloat16%s, got %s (%d)",
                  op, name, bytes_ok ? " (or 1-byte uint8, int8, float8)" : "", mrt_dtype_name(dtype), dtype);
}

/* ---- the row ops' plans: launches appended to p, no launching (executed by run_rows) -------------------- */

enum { K_COPY = 1, K_FILL, K_COMBINE, K_GATHER, K_COMBINE_BWD };

static mrt_launch* add_launch(mrt_plan* p, int kind) {
  mrt_launch* l = &p->launch[p->num_launches++];
  memset(l, 0, sizeof *l);
  l->kind = kind;
  return l;
}

/* out[dst_row[t,k]] = src[t] for every kept slot, as raw bytes (permutation.py _copy_rows). */
static moe_rt_status plan_copy(moe_rt_context* ctx, mrt_plan* p, const moe_rt_plan* plan, const void* src,
                               const void* out, int64_t row_bytes) {
  if (plan->num_tokens == 0 || row_bytes == 0 || plan->num_rows == 0) return MOE_RT_SUCCESS;
  const int u = unit_of(row_bytes, src, out);
  const int64_t units = row_bytes / u;
  mrt_launch* l = add_launch(p, K_COPY);
  snprintf(l->name, sizeof l->name, "dispatch_rows<%s, %d, true>", unit_type(u), UNROLL);
  int regs = 0;
  moe_rt_status st = mrt_kernel(ctx, l, FILE_PERM, &regs);
  l->grid = plan->num_tokens;
  l->block = threads_for(units);
  l->smem = (int32_t)(plan->topk * 4);
  l->arg[0] = units;
  return st;
}

/* Zero the rows of out holding no slot; pp[row] = pv[src_slot[row]] (0 for those rows) (_fill); with x (the
 * gather form, where gather_rows says so) the other rows get x[src_slot / K]: the copy of plan_copy too. */
static moe_rt_status plan_fill(moe_rt_context* ctx, mrt_plan* p, const moe_rt_plan* plan, const void* out,
                               int64_t row_bytes, int with_pp, int pp_dtype, const void* x) {
  if (plan->num_rows == 0) return MOE_RT_SUCCESS;
  const int u = unit_of(row_bytes, out, x);
  if (row_bytes == 0 && !with_pp) return MOE_RT_SUCCESS; /* nothing to zero and no probs to write */
  mrt_launch* l = add_launch(p, K_FILL);
  if (!with_pp || pp_dtype == MOE_RT_FLOAT32)
    snprintf(l->name, sizeof l->name, "fill_rows<%s>", unit_type(u));
  else
    snprintf(l->name, sizeof l->name, "fill_rows<%s, float, %s>", unit_type(u), mrt_ctype(pp_dtype));
  int regs = 0;
  moe_rt_status st = mrt_kernel(ctx, l, FILE_PERM, &regs);
  l->grid = row_grid(ctx, plan->num_rows);
  l->block = 256;
  l->arg[0] = row_bytes / u;
  l->arg[1] = (row_bytes != 0) | (x != NULL && row_bytes != 0) << 1; /* 1: rows to zero; 2: rows to gather */
  return st;
}

/* y[t] = sum_k w[t,k] y_p[dst_row[t,k]] (_combine_cuda, _slices). */
static moe_rt_status plan_combine(moe_rt_context* ctx, mrt_plan* p, const moe_rt_plan* plan, const void* y_p,
                                  int dtype, int64_t H, const void* out) {
  const int64_t T = plan->num_tokens;
  if (T == 0 || H == 0) return MOE_RT_SUCCESS;
  const int isz = mrt_dtype_size(dtype);
  const int vec = (H * isz) % 16 == 0 && mrt_aligned16(y_p) && mrt_aligned16(out);
  const int64_t units = H / (vec ? 16 / isz : 1);
  const int64_t slices = mrt_max(1, mrt_cdiv(units, COMBINE_BLOCK_MAX * COMBINE_UNROLL));
  const int64_t per = mrt_cdiv(units, slices * COMBINE_UNROLL);
  mrt_launch* l = add_launch(p, K_COMBINE);
  snprintf(l->name, sizeof l->name, "combine_slices<%s, %s, %d, %d, %d, %d, %d>", mrt_ctype(dtype),
           vec ? "true" : "false", COMBINE_UNROLL, COMBINE_KU, COMBINE_LM, COMBINE_BLOCK_MAX, COMBINE_MINB);
  int regs = 0;
  moe_rt_status st = mrt_kernel(ctx, l, FILE_PERM, &regs);
  l->grid = mrt_min(T * slices, INT32_MAX_); /* grid-stride beyond */
  l->block = (int)mrt_min(COMBINE_BLOCK_MAX, mrt_max(32, mrt_cdiv(per, 32) * 32));
  l->arg[0] = slices;
  l->arg[1] = T * slices;
  return st;
}

/* grad_probs[t,k] = vals[dst_row[t,k]] (dispatch_backward). */
static moe_rt_status plan_gather(moe_rt_context* ctx, mrt_plan* p, int64_t L) {
  if (L == 0) return MOE_RT_SUCCESS;
  mrt_launch* l = add_launch(p, K_GATHER);
  snprintf(l->name, sizeof l->name, "gather_slots");
  int regs = 0;
  moe_rt_status st = mrt_kernel(ctx, l, FILE_PERM, &regs);
  l->grid = row_grid(ctx, L / 32 + 1);
  l->block = 256;
  l->arg[0] = L;
  return st;
}

/* The fused backward of a weighted combine (combine_backward with probs). */
static moe_rt_status plan_combine_bwd(moe_rt_context* ctx, mrt_plan* p, const moe_rt_plan* plan, int dtype, int64_t H,
                                      const void* g, const void* y_p, const void* g_p) {
  const int64_t T = plan->num_tokens, K = plan->topk;
  if (!T || !K || !H || !plan->num_rows) return MOE_RT_SUCCESS;
  const int isz = mrt_dtype_size(dtype);
  const int vec = (H * isz) % 16 == 0 && mrt_aligned16(g) && mrt_aligned16(y_p) && mrt_aligned16(g_p);
  const int threads = threads_for(H / (vec ? 16 / isz : 1));
  mrt_launch* l = add_launch(p, K_COMBINE_BWD);
  snprintf(l->name, sizeof l->name, "combine_bwd_rows<%s, %s, %d>", mrt_ctype(dtype), vec ? "true" : "false", UNROLL);
  int regs = 0;
  moe_rt_status st = mrt_kernel(ctx, l, FILE_PERM, &regs);
  l->grid = T;
  l->block = threads;
  l->smem = (int32_t)(K * 8 + (threads / 32) * K * 4);
  return st;
}

/* ---- the row ops' executor --------------------------------------------------------------------------------- */

typedef struct rows_io {
  const void* copy_src; void* copy_dst;                   /* K_COPY */
  void* fill_out; void* fill_pp; const float* fill_pv;    /* K_FILL */
  const void* comb_in; void* comb_out; const float* comb_w; /* K_COMBINE */
  const float* gather_vals; float* gather_out;            /* K_GATHER */
  const void* cb_g; const void* cb_yp; void* cb_gp; const float* cb_w; float* cb_dw; /* K_COMBINE_BWD */
  int64_t hidden;
} rows_io;

static moe_rt_status run_rows(moe_rt_context* ctx, const mrt_plan* p, const moe_rt_plan* plan, const rows_io* io,
                              moe_rt_stream stream) {
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, p);
    return MOE_RT_SUCCESS;
  }
  for (int i = 0; i < p->num_launches; ++i) {
    const mrt_launch* l = &p->launch[i];
    mrt_args a = {0};
    switch (l->kind) {
      case K_COPY:
        mrt_arg_ptr(&a, io->copy_src);
        mrt_arg_ptr(&a, io->copy_dst);
        mrt_arg_ptr(&a, plan->dst_row);
        mrt_arg_i32(&a, (int32_t)plan->topk);
        mrt_arg_i64(&a, l->arg[0]);
        break;
      case K_FILL:
        mrt_arg_ptr(&a, l->arg[1] & 1 ? io->fill_out : NULL);
        mrt_arg_ptr(&a, io->fill_pp);
        mrt_arg_ptr(&a, io->fill_pv);
        mrt_arg_ptr(&a, plan->src_slot);
        mrt_arg_i64(&a, plan->num_rows);
        mrt_arg_i64(&a, l->arg[0]);
        mrt_arg_ptr(&a, l->arg[1] & 2 ? io->copy_src : NULL);
        mrt_arg_i32(&a, (int32_t)plan->topk);
        break;
      case K_COMBINE:
        mrt_arg_ptr(&a, io->comb_in);
        mrt_arg_ptr(&a, io->comb_out);
        mrt_arg_ptr(&a, plan->dst_row);
        mrt_arg_ptr(&a, io->comb_w);
        mrt_arg_i32(&a, (int32_t)plan->topk);
        mrt_arg_i64(&a, io->hidden);
        mrt_arg_i32(&a, (int32_t)l->arg[0]);
        mrt_arg_i64(&a, l->arg[1]);
        break;
      case K_GATHER:
        mrt_arg_ptr(&a, io->gather_vals);
        mrt_arg_ptr(&a, plan->dst_row);
        mrt_arg_ptr(&a, io->gather_out);
        mrt_arg_i64(&a, l->arg[0]);
        break;
      case K_COMBINE_BWD:
        mrt_arg_ptr(&a, io->cb_g);
        mrt_arg_ptr(&a, io->cb_yp);
        mrt_arg_ptr(&a, io->cb_gp);
        mrt_arg_ptr(&a, plan->dst_row);
        mrt_arg_ptr(&a, io->cb_w);
        mrt_arg_ptr(&a, io->cb_dw);
        mrt_arg_i32(&a, (int32_t)plan->topk);
        mrt_arg_i64(&a, io->hidden);
        break;
    }
    moe_rt_status st = mrt_launch_one(ctx, l, &a, stream);
    if (st) return st;
  }
  return MOE_RT_SUCCESS;
}

/* The signature a row op's plan is cached by: the op, dtypes, sizes, and each pointer's alignment (16 = NULL). */
typedef struct rows_key {
  int32_t op, dtype, pdt, flags;
  int64_t T, K, N, H;
  uint8_t align[6];
} rows_key;

static rows_key make_key(int op, int dtype, int pdt, int flags, const moe_rt_plan* plan, int64_t H,
                         const void* const* ptrs, int n) {
  rows_key k;
  memset(&k, 0, sizeof k);
  k.op = op; k.dtype = dtype; k.pdt = pdt; k.flags = flags;
  k.T = plan->num_tokens; k.K = plan->topk; k.N = plan->num_rows; k.H = H;
  for (int i = 0; i < n && i < 6; ++i) k.align[i] = ptrs[i] ? (uint8_t)((uintptr_t)ptrs[i] & 15u) : 16;
  return k;
}

/* ---- the ops ------------------------------------------------------------------------------------------ */

moe_rt_status moe_rt_dispatch(moe_rt_context* ctx, const moe_rt_plan* plan, const void* x, int dtype, int64_t H,
                              const float* probs, void* x_permuted, void* probs_permuted, int probs_dtype,
                              moe_rt_stream stream) {
  static const char op[] = "moe_rt_dispatch";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_plan_arg(op, plan)) ||
      (st = check_token_dtype(op, "dtype", dtype, 1)) || (st = check_hidden(op, H, dtype)))
    return st;
  const int64_t T = plan->num_tokens, N = plan->num_rows;
  /* with probs: either pointer given (one of no element may be NULL: with T = 0 the rows' probs are all zero) */
  const int with_pp = probs != NULL || probs_permuted != NULL;
  if (with_pp && !probs_permuted && N > 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: probs_permuted is NULL but probs is given", op);
  if (with_pp && !probs && T * plan->topk > 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: probs_permuted is given but probs is NULL", op);
  if (with_pp && !mrt_is_float_dtype(probs_dtype))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: probs_dtype: expected float32, float16 or bfloat16, got %s (%d)",
                    op, mrt_dtype_name(probs_dtype), probs_dtype);
  if ((T * H > 0 && (st = mrt_check_ptr(op, "x", x))) || (N * H > 0 && (st = mrt_check_ptr(op, "x_permuted", x_permuted))))
    return st;
  const int64_t row_bytes = H * mrt_dtype_size(dtype);
  const void* ptrs[2] = {x, x_permuted};
  const int pdt = with_pp ? probs_dtype : -1;
  rows_key key = make_key(1, mrt_dtype_size(dtype), pdt, 0, plan, H, ptrs, 2);
  mrt_plan p;
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    /* (the limits are fixed for the process: decided once per plan; a bad knob stores no plan) */
    const int gather = gather_rows(op, plan, row_bytes);
    if (gather < 0) return MOE_RT_ERROR_INVALID_ARGUMENT;
    if ((!gather && (st = plan_copy(ctx, &p, plan, x, x_permuted, row_bytes))) ||
        (st = plan_fill(ctx, &p, plan, x_permuted, row_bytes, with_pp, probs_dtype, gather ? x : NULL)))
      return st;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  rows_io io = {0};
  io.copy_src = x; io.copy_dst = x_permuted;
  io.fill_out = x_permuted; io.fill_pp = probs_permuted; io.fill_pv = probs;
  io.hidden = H;
  return run_rows(ctx, &p, plan, &io, stream);
}

moe_rt_status moe_rt_combine(moe_rt_context* ctx, const moe_rt_plan* plan, const void* y_permuted, int dtype,
                             int64_t H, const float* probs, void* y, moe_rt_stream stream) {
  static const char op[] = "moe_rt_combine";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_plan_arg(op, plan)) ||
      (st = check_token_dtype(op, "dtype", dtype, 0)) || (st = check_hidden(op, H, dtype)))
    return st;
  const int64_t T = plan->num_tokens, N = plan->num_rows;
  if ((N * H > 0 && (st = mrt_check_ptr(op, "y_permuted", y_permuted))) || (T * H > 0 && (st = mrt_check_ptr(op, "y", y))))
    return st;
  const void* ptrs[2] = {y_permuted, y};
  rows_key key = make_key(2, dtype, -1, 0, plan, H, ptrs, 2);
  mrt_plan p;
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    if ((st = plan_combine(ctx, &p, plan, y_permuted, dtype, H, y))) return st;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  rows_io io = {0};
  io.comb_in = y_permuted; io.comb_out = y; io.comb_w = probs;
  io.hidden = H;
  return run_rows(ctx, &p, plan, &io, stream);
}

moe_rt_status moe_rt_dispatch_backward(moe_rt_context* ctx, const moe_rt_plan* plan, const void* grad_x_permuted,
                                       int dtype, int64_t H, const float* grad_probs_permuted, void* grad_x,
                                       float* grad_probs, moe_rt_stream stream) {
  static const char op[] = "moe_rt_dispatch_backward";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_plan_arg(op, plan)) ||
      (st = check_token_dtype(op, "dtype", dtype, 0)) || (st = check_hidden(op, H, dtype)))
    return st;
  const int64_t T = plan->num_tokens, N = plan->num_rows;
  if ((N * H > 0 && (st = mrt_check_ptr(op, "grad_x_permuted", grad_x_permuted))) ||
      (T * H > 0 && (st = mrt_check_ptr(op, "grad_x", grad_x))))
    return st;
  /* the two go together; one of no element may be NULL */
  const int with_gp = grad_probs_permuted != NULL || grad_probs != NULL;
  if (with_gp && ((!grad_probs_permuted && N > 0) || (!grad_probs && T * plan->topk > 0)))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: grad_probs_permuted and grad_probs go together; %s is NULL", op,
                    grad_probs ? "grad_probs_permuted" : "grad_probs");
  const void* ptrs[2] = {grad_x_permuted, grad_x};
  rows_key key = make_key(3, dtype, -1, with_gp, plan, H, ptrs, 2);
  mrt_plan p;
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    if ((st = plan_combine(ctx, &p, plan, grad_x_permuted, dtype, H, grad_x)) ||
        (with_gp && (st = plan_gather(ctx, &p, T * plan->topk))))
      return st;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  rows_io io = {0};
  io.comb_in = grad_x_permuted; io.comb_out = grad_x;
  io.gather_vals = grad_probs_permuted; io.gather_out = grad_probs;
  io.hidden = H;
  return run_rows(ctx, &p, plan, &io, stream);
}

moe_rt_status moe_rt_combine_backward(moe_rt_context* ctx, const moe_rt_plan* plan, const void* grad_y, int dtype,
                                      int64_t H, const void* y_permuted, const float* probs, void* grad_y_permuted,
                                      float* grad_probs, moe_rt_stream stream) {
  static const char op[] = "moe_rt_combine_backward";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_plan_arg(op, plan)) ||
      (st = check_token_dtype(op, "dtype", dtype, 0)) || (st = check_hidden(op, H, dtype)))
    return st;
  const int64_t T = plan->num_tokens, K = plan->topk, N = plan->num_rows;
  if ((T * H > 0 && (st = mrt_check_ptr(op, "grad_y", grad_y))) ||
      (N * H > 0 && (st = mrt_check_ptr(op, "grad_y_permuted", grad_y_permuted))))
    return st;
  const int with_p = probs != NULL;
  if (with_p) {
    if (!y_permuted && N * H > 0)
      return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: y_permuted: the forward input is needed to differentiate with "
                      "probs", op);
    if ((st = mrt_check_data(op, "grad_probs", grad_probs, T * K))) return st;
  } else if (grad_probs && T * K > 0) {  /* (with T*K = 0 the two are of no element: either may be NULL) */
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: grad_probs is given but probs is NULL", op);
  }
  const int64_t row_bytes = H * mrt_dtype_size(dtype);
  const void* ptrs[3] = {grad_y, grad_y_permuted, y_permuted};
  rows_key key = make_key(4, dtype, -1, with_p, plan, H, ptrs, 3);
  mrt_plan p;
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    const int gather = with_p ? 0 : gather_rows(op, plan, row_bytes);  /* once per plan, as dispatch's */
    if (gather < 0) return MOE_RT_ERROR_INVALID_ARGUMENT;
    if ((st = plan_fill(ctx, &p, plan, grad_y_permuted, row_bytes, 0, MOE_RT_FLOAT32, gather ? grad_y : NULL)) ||
        (!with_p && !gather && (st = plan_copy(ctx, &p, plan, grad_y, grad_y_permuted, row_bytes))) ||
        (with_p && (st = plan_combine_bwd(ctx, &p, plan, dtype, H, grad_y, y_permuted, grad_y_permuted))))
      return st;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  /* with probs but nothing to reduce (H or N zero): the probs' gradient is zero */
  if (with_p && T && K && (H == 0 || N == 0) && (st = mrt_memset0(ctx, grad_probs, (size_t)(T * K) * 4, stream)))
    return st;
  rows_io io = {0};
  io.fill_out = grad_y_permuted;
  io.copy_src = grad_y; io.copy_dst = grad_y_permuted;
  io.cb_g = grad_y; io.cb_yp = y_permuted; io.cb_gp = grad_y_permuted; io.cb_w = probs; io.cb_dw = grad_probs;
  io.hidden = H;
  return run_rows(ctx, &p, plan, &io, stream);
}

/* ---- sort_chunks (permutation.py _sort_chunks_cuda) ------------------------------------------------------ */

typedef struct chunks_key {
  int32_t op, unit, bwd, idx_dtype;
} chunks_key;

moe_rt_status moe_rt_sort_chunks_workspace_size(int64_t num_chunks, size_t* bytes) {
  mrt_clear_error();
  if (!bytes) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_sort_chunks_workspace_size: bytes is NULL");
  if (num_chunks < 0 || num_chunks > INT32_MAX / 2)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_sort_chunks_workspace_size: num_chunks must be in [0, "
                    "2^30), got %lld", (long long)num_chunks);
  *bytes = (size_t)(2 * num_chunks + 1) * sizeof(int32_t);
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_sort_chunks(moe_rt_context* ctx, const void* x, int64_t N, int64_t row_bytes,
                                 const void* split_sizes, const void* sorted_indices, int index_dtype, int64_t S,
                                 const float* probs, void* out, float* probs_out, int backward, void* workspace,
                                 size_t workspace_bytes, moe_rt_stream stream) {
  static const char op[] = "moe_rt_sort_chunks";
  moe_rt_status st;
  size_t need = 0;
  if ((st = mrt_check_ctx(ctx, op))) return st;
  if (N < 0 || N > INT32_MAX)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_rows must be in [0, 2^31), got %lld", op, (long long)N);
  if (row_bytes < 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: row_bytes must be >= 0, got %lld", op, (long long)row_bytes);
  if (index_dtype != MOE_RT_INT32 && index_dtype != MOE_RT_INT64)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: index_dtype: expected int32 or int64 (split_sizes and "
                    "sorted_indices alike), got %s (%d)", op, mrt_dtype_name(index_dtype), index_dtype);
  if ((st = moe_rt_sort_chunks_workspace_size(S, &need))) return st;
  if (workspace_bytes < need)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: workspace_bytes: need %zu "
                    "(moe_rt_sort_chunks_workspace_size), got %zu", op, need, workspace_bytes);
  if (N > 0 && (probs == NULL) != (probs_out == NULL))  /* (of no row, either may be NULL) */
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: probs and probs_out: pass both or neither", op);
  if ((st = mrt_check_data(op, "x", x, N * row_bytes)) || (st = mrt_check_data(op, "out", out, N * row_bytes)) ||
      (st = mrt_check_ptr(op, "workspace", workspace)) ||
      (S > 0 && ((st = mrt_check_ptr(op, "split_sizes", split_sizes)) ||
                 (st = mrt_check_ptr(op, "sorted_indices", sorted_indices)))))
    return st;
  mrt_plan p;
  memset(&p, 0, sizeof p);
  if (N == 0) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  int u = 16;
  if (row_bytes) {
    static const int units[5] = {16, 8, 4, 2, 1};
    for (int i = 0; i < 5; ++i) {
      u = units[i];
      if (row_bytes % u == 0 && (uintptr_t)x % (uintptr_t)u == 0 && (uintptr_t)out % (uintptr_t)u == 0) break;
    }
  }
  const int64_t row_units = row_bytes / u;
  chunks_key key = {9, u, backward != 0, index_dtype};
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    p.num_launches = 2;
    int regs = 0;
    snprintf(p.launch[0].name, sizeof p.launch[0].name, "chunk_offsets<%s>",
             index_dtype == MOE_RT_INT32 ? "int" : "long long");
    snprintf(p.launch[1].name, sizeof p.launch[1].name, "chunk_sort_rows<%s, %s>", unit_type(u),
             backward ? "true" : "false");
    if ((st = mrt_kernel(ctx, &p.launch[0], FILE_PERM, &regs)) || (st = mrt_kernel(ctx, &p.launch[1], FILE_PERM, &regs)))
      return st;
    p.launch[0].block = 1024;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  p.launch[0].grid = S > 0;
  p.launch[1].grid = N;
  p.launch[1].block = (int32_t)mrt_min(256, mrt_max(32, mrt_cdiv(row_units, 32) * 32));
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  int32_t* in_start = workspace;
  int32_t* out_start = in_start + S + 1;
  if (S > 0) {
    mrt_args a = {0};
    mrt_arg_ptr(&a, split_sizes);
    mrt_arg_ptr(&a, sorted_indices);
    mrt_arg_i32(&a, (int32_t)S);
    mrt_arg_ptr(&a, in_start);
    mrt_arg_ptr(&a, out_start);
    if ((st = mrt_launch_one(ctx, &p.launch[0], &a, stream))) return st;
  } else if ((st = mrt_memset0(ctx, in_start, sizeof(int32_t), stream))) {
    return st;
  }
  mrt_args b = {0};
  mrt_arg_ptr(&b, x);
  mrt_arg_ptr(&b, out);
  mrt_arg_ptr(&b, in_start);
  mrt_arg_ptr(&b, out_start);
  mrt_arg_i32(&b, (int32_t)S);
  mrt_arg_i64(&b, N);
  mrt_arg_i64(&b, row_units);
  mrt_arg_ptr(&b, probs);
  mrt_arg_ptr(&b, probs_out);
  return mrt_launch_one(ctx, &p.launch[1], &b, stream);
}

/* ---- copy_kept_rows (the JAX low-latency adapter's receive rows) ----------------------------------------- */

typedef struct kept_key {
  int32_t op, unit, pad0, pad1;
} kept_key;

moe_rt_status moe_rt_copy_kept_rows(moe_rt_context* ctx, const void* src, void* out, const int32_t* keep, int64_t N,
                                    int64_t row_bytes, int zero_rest, moe_rt_stream stream) {
  static const char op[] = "moe_rt_copy_kept_rows";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op))) return st;
  if (N < 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_rows must be >= 0, got %lld", op, (long long)N);
  if (row_bytes < 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: row_bytes must be >= 0, got %lld", op, (long long)row_bytes);
  if (zero_rest != 0 && zero_rest != 1)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: zero_rest must be 0 or 1, got %d", op, zero_rest);
  mrt_plan p;
  memset(&p, 0, sizeof p);
  if (N == 0 || row_bytes == 0) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  if ((st = mrt_check_ptr(op, "src", src)) || (st = mrt_check_ptr(op, "out", out)) ||
      (st = mrt_check_ptr(op, "keep", keep)))
    return st;
  const int u = unit_of(row_bytes, src, out);
  kept_key key = {10, u, 0, 0};
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    p.num_launches = 1;
    snprintf(p.launch[0].name, sizeof p.launch[0].name, "copy_kept_rows<%s>", unit_type(u));
    int regs = 0;
    if ((st = mrt_kernel(ctx, &p.launch[0], FILE_PERM, &regs))) return st;
    p.launch[0].block = 256;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  p.launch[0].grid = row_grid(ctx, N);
  mrt_args a = {0};
  mrt_arg_ptr(&a, src);
  mrt_arg_ptr(&a, out);
  mrt_arg_ptr(&a, keep);
  mrt_arg_i64(&a, N);
  mrt_arg_i64(&a, row_bytes / u);
  mrt_arg_i32(&a, zero_rest);
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, &p);
    mrt_record_args(ctx, 0, &a);
    return MOE_RT_SUCCESS;
  }
  return mrt_launch_one(ctx, &p.launch[0], &a, stream);
}
