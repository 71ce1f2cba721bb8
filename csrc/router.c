/* moe_rt core: the router ops (kernels/router.cu). Each op validates, plans (kernel variant, grid, block,
 * shared memory; cached by signature) and launches. The variant choices are those of moe_rt/router.py
 * (tests/test_c_abi.py compares the two for a table of shapes). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define FILE_ROUTER "router.cu"
#define SEL_REG_CHUNKS 4

static int al4(int x) { return (x + 3) & ~3; }

/* ---- validation (router.py _check_*) ----------------------------------------------------------------- */

static moe_rt_status check_float_dtype(const char* op, const char* name, int dtype) {
  if (!mrt_is_float_dtype(dtype))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: %s: expected dtype float32, float16 or bfloat16 "
                    "(MOE_RT_FLOAT32/FLOAT16/BFLOAT16), got %s (%d)", op, name, mrt_dtype_name(dtype), dtype);
  return MOE_RT_SUCCESS;
}

static moe_rt_status check_sizes(const char* op, int64_t T, int E, int K) {
  if (T < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_tokens must be >= 0, got %lld", op, (long long)T);
  if (E < 1 || E > MOE_RT_MAX_EXPERTS)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_experts must be in [1, %d], got %d", op,
                    MOE_RT_MAX_EXPERTS, E);
  if (K < 1) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: topk must be >= 1, got %d", op, K);
  if (K > E)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: topk: must be <= num_experts (%d), got %d", op, E, K);
  if (K > MOE_RT_MAX_TOPK)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: topk: at most %d is supported, got %d", op, MOE_RT_MAX_TOPK, K);
  if (T > ((int64_t)1 << 62) / E)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_tokens * num_experts overflows", op);
  return MOE_RT_SUCCESS;
}

static moe_rt_status check_score(const char* op, int score_function) {
  if (score_function < MOE_RT_SCORE_SIGMOID || score_function > MOE_RT_SCORE_SQRTSOFTPLUS)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: score_function: expected MOE_RT_SCORE_SIGMOID (0), "
                    "MOE_RT_SCORE_SOFTMAX (1) or MOE_RT_SCORE_SQRTSOFTPLUS (2), got %d", op, score_function);
  return MOE_RT_SUCCESS;
}

static moe_rt_status check_groups(const char* op, int G, int g, int K, int E) {
  if (G < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_groups must be >= 0, got %d", op, G);
  if (g < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: group_topk must be >= 0 (0 = no groups), got %d", op, g);
  if (g == 0) return MOE_RT_SUCCESS;
  if (G == 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: group_topk: given without num_groups; pass num_groups too "
                    "(or group_topk = 0)", op);
  if (E % G) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_groups: must divide num_experts (%d), got %d", op, E, G);
  if (g > G) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: group_topk: must be <= num_groups (%d), got %d", op, G, g);
  if (K % g) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: group_topk: must divide topk (%d), got %d", op, K, g);
  if (K / g > E / G)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: topk/group_topk (%d) must be <= num_experts/num_groups (%d)",
                    op, K / g, E / G);
  return MOE_RT_SUCCESS;
}

static moe_rt_status check_scale(const char* op, float scale) {
  if (!isfinite(scale))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: scaling_factor: must be finite, got %g", op, (double)scale);
  return MOE_RT_SUCCESS;
}

/* ---- the forward's plan (router.py _fwd_cfg, _launch_fwd) ------------------------------------------- */

static int team_for(int E, int fwd) {
  if (E <= 1024) return 32;
  if (E <= 4096) return fwd && E <= 2304 ? 32 : 128;
  return 512;
}

static int slot_words(int E, int G, int K, int team) {
  int nw = team / 32, kp = al4(K);
  return al4(E) + al4(G) + 16 * team + 32 * nw + 64 + 16 + nw * kp + 2 * 64 + 4 + 4 * kp;
}

static int reg_slot_words(int E, int G, int K, int lanesel) {
  if (lanesel) return 4 * al4(K);
  return (G ? al4(E) : 0) + al4(G) + 16 * 32 + 2 * 64 + 4 + 4 * al4(K);
}

static int reg_v(int E, int ch, int vec, int dtype) {
  if (!vec || dtype == MOE_RT_FLOAT16) return 0;
  int need = (int)mrt_cdiv(E / ch, 32) * ch;
  static const int vs[3] = {8, 16, 32};
  for (int i = 0; i < 3; ++i)
    if (vs[i] >= need) return vs[i];
  return 0;
}

/* Lanes a token of router_fwd_reg (W < 32: a token on each segment of W lanes, one 16-byte chunk a lane): for
 * rows of at most 16 chunks without groups and k <= 8, the least power of two from 4 up holding the row's
 * chunks and k; else 32 (a warp a token). The kernel's cost a token hardly depends on E up to 256 (issue and
 * latency bound), so short rows on a whole warp left most lanes idle: on H200 at T = 65536 the segments took
 * the softmax forward from 62.9 to 22.3 us (fp32, E = 32), 80.5 to 45.8 (fp32, E = 64), 66.9 to 32.5 (bf16,
 * E = 64) and 64.8 to 46.2 (bf16, E = 128); BENCHMARKS.md "Short rows". Two tokens a segment (tpw 2): the
 * fastest or within 3% of it at each of these shapes, against one resident wave (10% slower at bf16 E = 128)
 * and four tokens a segment (32% slower at bf16 E = 32). Where two a segment launch fewer blocks than a
 * resident wave (FWD_SEG: T = 8192 and below), one a segment up to a wave: at T = 8192 bf16 E = 64 7.5 against
 * 10.7 us. */
static int seg_lanes(int E, int K, int G, int ch, int v) {
  if (!v || G || K > 8 || E / ch > 16) return 32;
  int w = 4;
  while (w < E / ch || w < K) w *= 2;
  return w;
}

static int lane_groups(int E, int K, int G, int g, int ch) {
  if (!G || G > 32 || (E / G) % ch) return 0;
  int S = E / G / ch;
  return K / g <= 8 && S <= 32 && (S & (S - 1)) == 0;
}

static int cmax_word(int E, int K, int G, int g, int ch, int vec, int team) {
  if (team != 32 || ch != 8 || !vec || !G || G > 32 || (E / G) % 8) return 0;
  int L = 1;
  while (L < 32 && L * 2 * G <= 32) L *= 2;
  int m = K / g, nc = E / G / 8;
  int cap = ((16 * 32 - ((E / 8 + 3) & ~3)) / G) & ~3;
  if (!(8 < m && m <= 4 * L && nc <= 12 * L && cap >= 4 * L)) return 0;
  return cap | (L << 16);
}

static int64_t tpw_grid(int64_t T, int spb, int tpw, int64_t resident) {
  if (tpw) return mrt_max(1, mrt_cdiv(T, (int64_t)spb * tpw));
  return mrt_max(1, mrt_min(mrt_cdiv(T, spb), resident));
}

typedef struct fwd_key {
  int32_t op, dtype, E, K, G, g, vec, bitmap;
} fwd_key;

enum { FWD_SPB = 0, FWD_TPW = 1, FWD_RESIDENT = 2, FWD_GCM = 3, FWD_SEG = 4 };

/* A forward kernel's launch shape in plan p (launch 0): threads, shared memory, token slots a block, tokens
 * a warp and the resident grid. */
static void fwd_shape(moe_rt_context* ctx, mrt_plan* p, int threads, int smem, int regs, int spb, int tpw) {
  p->launch[0].block = threads;
  p->launch[0].smem = smem;
  p->ints[FWD_SPB] = spb;
  p->ints[FWD_TPW] = tpw;
  p->ints[FWD_RESIDENT] = mrt_resident_grid(mrt_device(ctx), (int64_t)1 << 30, threads, smem, regs);
}

/* The score case of the router kernels' with_score_fn (kernels/router.cu): 0 softmax; 1, 2, 3 sigmoid with
 * aux, bias, plain; 4, 5, 6 the same for sqrtsoftplus. */
static int score_case(int score_fn, int aux, int bias) {
  if (score_fn == MOE_RT_SCORE_SOFTMAX) return 0;
  return (score_fn == MOE_RT_SCORE_SIGMOID ? 1 : 4) + (aux ? 0 : bias ? 1 : 2);
}

/* The forward's stand-in (mrt_kernel_or_stand_in) for score case `scase`: the same template compiled for that
 * case alone (SFO), which computes the bits of the kernel fwd_plan names for such a call and compiles in a
 * fraction of its time; "" when there is none. *row = 1: the stand-in is the one-warp row kernel, launched with
 * its own configuration (with groups and 16 or 32 keys a lane: router_fwd_reg computes router_fwd<T, 32>'s
 * bits). With groups and K <= 8 the row kernel compiled without the paths of K > 8 (SMALLK: about two thirds
 * of the compile time). None for the bit-packed map, for bf16 at 8 keys a lane without groups (that kernel
 * compiles in about a second), for short rows on segments of lanes (compiled without groups: 1.0 s against
 * 7.7 s for router_fwd_reg<float, 8>, sm_90, one CPU core), for groups held in the lanes (a kernel compiled
 * for that path alone), nor for teams above 32. */
static void fwd_stand_in(int dtype, int E, int K, int G, int g, int vec, int bitmap, int scase, char* name,
                         int* row) {
  const int isz = mrt_dtype_size(dtype), ch = 16 / isz;
  const char* ct = mrt_ctype(dtype);
  const int v = reg_v(E, ch, vec, dtype);
  name[0] = 0;
  *row = 0;
  if (bitmap || seg_lanes(E, K, G, ch, v) < 32) return;
  if (v) {
    if (!G) {
      if (!(v == 8 && isz == 2))
        snprintf(name, MOE_RT_KERNEL_NAME_MAX, "router_fwd_reg<%s, %d, false, false, false, %d>", ct, v, scase);
    } else if (!(v == 8 && K <= 8 && lane_groups(E, K, G, g, ch))) {
      snprintf(name, MOE_RT_KERNEL_NAME_MAX, "router_fwd<%s, 32, true, false, %d%s>", ct, scase,
               K <= 8 ? ", true" : "");
      *row = 1;
    }
  } else if (team_for(E, 1) == 32) {
    snprintf(name, MOE_RT_KERNEL_NAME_MAX, "router_fwd<%s, 32, %s, false, %d%s>", ct, G ? "true" : "false", scase,
             G && K <= 8 ? ", true" : "");
  }
}

/* The row kernel's configuration (router_fwd<T, team>): threads, shared memory, slots a block, tokens a warp,
 * gcm word. */
static void fwd_row_cfg(int E, int K, int G, int g, int ch, int vec, int team, int* threads, int* smem, int* spb,
                        int* tpw, int* gcm) {
  *spb = team == 32 ? 4 : 1;
  *smem = 4 * slot_words(E, G, K, team) * *spb;
  *threads = team * *spb;
  *tpw = team == 32 ? 1 : 0;
  *gcm = cmax_word(E, K, G, g, ch, vec, team);
}

static moe_rt_status fwd_plan(moe_rt_context* ctx, int dtype, int E, int K, int G, int g, int vec, int bitmap,
                              int scase, mrt_plan* out) {
  fwd_key key;
  memset(&key, 0, sizeof key);
  key.op = 1; key.dtype = dtype; key.E = E; key.K = K; key.G = G; key.g = g; key.vec = vec; key.bitmap = bitmap;
  char stand_in[MOE_RT_KERNEL_NAME_MAX];
  int row = 0;
  const mrt_plan* hit = mrt_plan_get(ctx, &key, sizeof key);
  if (hit) { /* plans made with a stand-in are never cached */
    *out = *hit;
    if (mrt_is_planning(ctx)) fwd_stand_in(dtype, E, K, G, g, vec, bitmap, scase, out->launch[0].stand_in, &row);
    return MOE_RT_SUCCESS;
  }
  mrt_plan p;
  memset(&p, 0, sizeof p);
  p.num_launches = 1;
  mrt_launch* l = &p.launch[0];
  const int isz = mrt_dtype_size(dtype), ch = 16 / isz;
  const char* ct = mrt_ctype(dtype);
  int v = reg_v(E, ch, vec, dtype), spb, threads, smem, tpw, gcm = 0;
  const int w = seg_lanes(E, K, G, ch, v);
  if (w < 32) {
    snprintf(l->name, sizeof l->name, "router_fwd_reg<%s, %d, false, false, %s, -1, %d>", ct, ch,
             bitmap ? "true" : "false", w);
    spb = 4 * (32 / w); /* token slots a block */
    threads = 128;
    smem = 4 * reg_slot_words(E, G, K, 1) * spb;
    tpw = 2;
  } else if (v) {
    /* 8 keys a lane, no groups, bf16: the kernel compiled without the group-limited selection; 8 keys a lane
     * with groups held in the lanes and k <= 8: the kernel compiled for that path alone. The bit-packed map:
     * the same kernel's BITMAP instantiation (every template argument spelled out). */
    int ng = v == 8 && !G && isz == 2;
    int ls = v == 8 && K <= 8 && lane_groups(E, K, G, g, ch);
    if (bitmap)
      snprintf(l->name, sizeof l->name, "router_fwd_reg<%s, %d, %s, %s, true>", ct, v, ng ? "false" : "true",
               ls ? "true" : "false");
    else
      snprintf(l->name, sizeof l->name, "router_fwd_reg<%s, %d%s%s>", ct, v, ng ? ", false" : "",
               ls ? ", true, true" : "");
    spb = 4;
    threads = 128;
    smem = 4 * reg_slot_words(E, G, K, ls) * spb;
    tpw = v == 8 && (isz == 2 || ls) ? 2 : 0;
  } else {
    int team = team_for(E, 1);
    const int groups = G || team != 32;
    if (bitmap)
      snprintf(l->name, sizeof l->name, "router_fwd<%s, %d, %s, true>", ct, team, groups ? "true" : "false");
    else
      snprintf(l->name, sizeof l->name, "router_fwd<%s, %d%s>", ct, team, groups ? "" : ", false");
    fwd_row_cfg(E, K, G, g, ch, vec, team, &threads, &smem, &spb, &tpw, &gcm);
  }
  fwd_stand_in(dtype, E, K, G, g, vec, bitmap, scase, stand_in, &row);
  int regs = 0, standing = 0;
  moe_rt_status st = mrt_kernel_or_stand_in(ctx, l, FILE_ROUTER, stand_in, &regs, &standing);
  if (st) return st;
  if (standing && row) fwd_row_cfg(E, K, G, g, ch, vec, 32, &threads, &smem, &spb, &tpw, &gcm);
  fwd_shape(ctx, &p, threads, smem, regs, spb, tpw);
  p.ints[FWD_GCM] = gcm;
  p.ints[FWD_SEG] = w < 32;
  if (!standing) mrt_plan_put(ctx, &key, sizeof key, &p);
  *out = p;
  return MOE_RT_SUCCESS;
}

/* Whether a forward's rows take 16-byte vectors: E a multiple of a vector's elements and every given array
 * (NULL: none) 16-byte aligned. */
static int fwd_vec(int dtype, int E, const void* const* ptrs, int n) {
  int vec = E % (16 / mrt_dtype_size(dtype)) == 0;
  for (int i = 0; i < n; ++i) vec = vec && (ptrs[i] == NULL || mrt_aligned16(ptrs[i]));
  return vec;
}

/* rmap: the byte map, or with `bitmap` the bit-packed one; idx: indices of idx_bytes each. */
static moe_rt_status router_fwd(moe_rt_context* ctx, const void* x, int dtype, int64_t T, int E, int K, int score_fn,
                                int pre, int aux, int G, int g, float scale, const float* bias, void* probs,
                                float* scores, void* rmap, int bitmap, float* inter, void* idx, int idx_bytes,
                                float* w, moe_rt_stream stream) {
  mrt_plan p;
  memset(&p, 0, sizeof p);
  if (T == 0) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  const void* ptrs[6] = {x, probs, scores, bitmap ? NULL : rmap, inter, bias};
  const int vec = fwd_vec(dtype, E, ptrs, 6);
  moe_rt_status st = fwd_plan(ctx, dtype, E, K, G, g, vec, bitmap, score_case(score_fn, aux, bias != NULL), &p);
  if (st) return st;
  p.launch[0].grid = tpw_grid(T, (int)p.ints[FWD_SPB], (int)p.ints[FWD_TPW], p.ints[FWD_RESIDENT]);
  if (p.ints[FWD_SEG] && p.launch[0].grid < p.ints[FWD_RESIDENT]) /* segments, fewer tokens than 2 a wave */
    p.launch[0].grid = tpw_grid(T, (int)p.ints[FWD_SPB], 0, p.ints[FWD_RESIDENT]);
  const int32_t gcm = aux || pre ? 0 : (int32_t)p.ints[FWD_GCM];
  p.launch[0].scalars[0] = vec;
  p.launch[0].scalars[1] = gcm;
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  int n = G ? E / G : 1;
  uint32_t gmagic = n > 1 ? (uint32_t)((((uint64_t)1 << 32) + (uint64_t)n - 1) / (uint64_t)n) : 0u;
  mrt_args a = {0};
  mrt_arg_ptr(&a, x);
  mrt_arg_i64(&a, T);
  mrt_arg_i32(&a, E);
  mrt_arg_i32(&a, K);
  mrt_arg_i32(&a, score_fn);
  mrt_arg_i32(&a, pre);
  mrt_arg_i32(&a, aux);
  mrt_arg_i32(&a, G);
  mrt_arg_i32(&a, g);
  mrt_arg_i32(&a, G ? K / g : 0);
  mrt_arg_u32(&a, gmagic);
  mrt_arg_f32(&a, scale);
  mrt_arg_ptr(&a, bias);
  mrt_arg_ptr(&a, probs);
  mrt_arg_ptr(&a, scores);
  mrt_arg_ptr(&a, rmap);
  mrt_arg_ptr(&a, inter);
  mrt_arg_ptr(&a, idx);
  mrt_arg_ptr(&a, w);
  mrt_arg_i32(&a, vec);
  mrt_arg_i32(&a, gcm);
  mrt_arg_i32(&a, idx_bytes);
  return mrt_launch_one(ctx, &p.launch[0], &a, stream);
}

static moe_rt_status check_topk_settings(const char* op, int dtype, int64_t T, int E, int K, int score_function,
                                         int num_groups, int group_topk, float scale, const float* bias) {
  moe_rt_status st;
  if ((st = check_float_dtype(op, "dtype", dtype)) || (st = check_sizes(op, T, E, K)) ||
      (st = check_score(op, score_function)) || (st = check_groups(op, num_groups, group_topk, K, E)) ||
      (st = check_scale(op, scale)))
    return st;
  if (bias && score_function == MOE_RT_SCORE_SOFTMAX)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: expert_bias: not allowed with score_function softmax "
                    "(sigmoid or sqrtsoftplus only)", op);
  return MOE_RT_SUCCESS;
}

/* The routing form of routing_dtype: *bitmap for the bit-packed map, *idx_bytes for indices (0 otherwise). */
static moe_rt_status routing_form(const char* op, int routing_dtype, int indices_ok, int* bitmap, int* idx_bytes) {
  *bitmap = routing_dtype == MOE_RT_UINT8;
  *idx_bytes = !indices_ok ? 0 : routing_dtype == MOE_RT_INT16 ? 2 : routing_dtype == MOE_RT_INT32 ? 4
               : routing_dtype == MOE_RT_INT64 ? 8 : 0;
  if (routing_dtype == MOE_RT_BOOL || *bitmap || *idx_bytes) return MOE_RT_SUCCESS;
  return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: routing_dtype: expected MOE_RT_BOOL (a routing map) or "
                  "MOE_RT_UINT8 (bit-packed)%s, got %s (%d)", op,
                  indices_ok ? ", or MOE_RT_INT16/INT32/INT64 (indices)" : "", mrt_dtype_name(routing_dtype),
                  routing_dtype);
}

moe_rt_status moe_rt_topk_with_score(moe_rt_context* ctx, const void* logits, int dtype, int64_t T, int E, int K,
                                     int score_function, int use_pre_softmax, int num_groups, int group_topk,
                                     float scaling_factor, const float* expert_bias, void* probs, void* routing,
                                     int routing_dtype, float* intermediate, moe_rt_stream stream) {
  static const char op[] = "moe_rt_topk_with_score";
  moe_rt_status st;
  int bitmap, idx_bytes;
  if ((st = mrt_check_ctx(ctx, op)) ||
      (st = check_topk_settings(op, dtype, T, E, K, score_function, num_groups, group_topk, scaling_factor,
                                expert_bias)) ||
      (st = routing_form(op, routing_dtype, 1, &bitmap, &idx_bytes)) ||
      (st = mrt_check_data(op, "logits", logits, T)) || (st = mrt_check_data(op, "probs", probs, T)) ||
      (st = mrt_check_data(op, "routing", routing, T)) || (st = mrt_check_data(op, "intermediate", intermediate, T)))
    return st;
  int G = group_topk ? num_groups : 0, g = group_topk ? group_topk : 0;
  int pre = use_pre_softmax && score_function == MOE_RT_SCORE_SOFTMAX;
  return router_fwd(ctx, logits, dtype, T, E, K, score_function, pre, 0, G, g, scaling_factor, expert_bias, probs,
                    NULL, idx_bytes ? NULL : routing, bitmap, intermediate, idx_bytes ? routing : NULL,
                    idx_bytes ? idx_bytes : 4, NULL, stream);
}

moe_rt_status moe_rt_topk_indices_with_score(moe_rt_context* ctx, const void* logits, int dtype, int64_t T, int E,
                                             int K, int score_function, int use_pre_softmax, int num_groups,
                                             int group_topk, float scaling_factor, const float* expert_bias,
                                             int32_t* topk_idx, float* topk_weights, moe_rt_stream stream) {
  static const char op[] = "moe_rt_topk_indices_with_score";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) ||
      (st = check_topk_settings(op, dtype, T, E, K, score_function, num_groups, group_topk, scaling_factor,
                                expert_bias)) ||
      (st = mrt_check_data(op, "logits", logits, T)) || (st = mrt_check_data(op, "topk_idx", topk_idx, T)) ||
      (st = mrt_check_data(op, "topk_weights", topk_weights, T)))
    return st;
  int G = group_topk ? num_groups : 0, g = group_topk ? group_topk : 0;
  int pre = use_pre_softmax && score_function == MOE_RT_SCORE_SOFTMAX;
  return router_fwd(ctx, logits, dtype, T, E, K, score_function, pre, 0, G, g, scaling_factor, expert_bias, NULL,
                    NULL, NULL, 0, NULL, topk_idx, 4, topk_weights, stream);
}

moe_rt_status moe_rt_scores_for_aux_loss(moe_rt_context* ctx, const void* logits, int dtype, int64_t T, int E,
                                         int K, int score_function, float* scores, void* routing_map,
                                         int routing_dtype, float* intermediate, moe_rt_stream stream) {
  static const char op[] = "moe_rt_scores_for_aux_loss";
  moe_rt_status st;
  int bitmap, idx_bytes;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_float_dtype(op, "dtype", dtype)) ||
      (st = check_sizes(op, T, E, K)) || (st = check_score(op, score_function)) ||
      (st = routing_form(op, routing_dtype, 0, &bitmap, &idx_bytes)) ||
      (st = mrt_check_data(op, "logits", logits, T)) || (st = mrt_check_data(op, "scores", scores, T)) ||
      (st = mrt_check_data(op, "routing_map", routing_map, T)) || (st = mrt_check_data(op, "intermediate", intermediate, T)))
    return st;
  return router_fwd(ctx, logits, dtype, T, E, K, score_function, 0, 1, 0, 0, 1.0f, NULL, NULL, scores, routing_map,
                    bitmap, intermediate, NULL, 4, NULL, stream);
}

/* ---- the backward's plan (router.py _launch_bwd) ---------------------------------------------------- */

typedef struct bwd_key {
  int32_t op, tg, to, E, vec, sel, bitmap;
} bwd_key;

enum { BWD_SPB = 0, BWD_TPW = 1, BWD_RESIDENT_REGS = 2 };

/* rmap: the byte map, or with `bitmap` the bit-packed one (the kernels' BITMAP instantiations). */
static moe_rt_status router_bwd(moe_rt_context* ctx, const void* grad, int tg, const void* rmap, int bitmap,
                                const float* inter, void* out, int to, int64_t T, int E, int K, int score_fn,
                                int pre, int aux, float scale, moe_rt_stream stream) {
  mrt_plan p;
  memset(&p, 0, sizeof p);
  if (T == 0) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  const int team = team_for(E, 0), spb = team == 32 ? 4 : 1, threads = team * spb;
  const int ch = (mrt_dtype_size(tg) == 2 || mrt_dtype_size(to) == 2) ? 8 : 4;
  const void* ptrs[4] = {grad, bitmap ? NULL : rmap, inter, out};
  int vec = E % ch == 0;
  for (int i = 0; i < 4; ++i) vec = vec && (ptrs[i] == NULL || mrt_aligned16(ptrs[i]));
  const int sel = vec && !pre && !aux;
  const char* bm = bitmap ? ", true" : "";
  bwd_key key;
  memset(&key, 0, sizeof key);
  key.op = 2; key.tg = tg; key.to = to; key.E = E; key.vec = vec; key.sel = sel; key.bitmap = bitmap;
  const mrt_plan* hit = mrt_plan_get(ctx, &key, sizeof key);
  mrt_launch* l = &p.launch[0];
  if (hit) {
    p = *hit;
  } else {
    p.num_launches = 1;
    if (sel) {
      /* zero gradient off the map: the K selected entries only; in one pass with them in registers
       * (router_bwd_sel_reg) from SEL_REG_CHUNKS 16-byte chunks per thread, else in two passes (router_bwd_sel).
       * Teams of 128 and 512 threads take the two passes at every size with the bit-packed map, and with the
       * byte map of 16-bit rows at exactly SEL_REG_CHUNKS chunks. Each kernel launched alone on one H100
       * (tools/sweep_bwd_bitmap.py, about 151M entries, K = 8, 36 at E = 2304), two passes against one, us:
       * bitmap fp32 E = 2048 301 / 371, 2304 409 / 465, 3072 268 / 338, 4096 262 / 300, 8192 297 / 394,
       * 16384 249 / 297; bitmap bf16 4096 166 / 164, 16384 157 / 155; byte map bf16 4096 211 / 227, 16384
       * 200 / 199; byte map fp32 (one pass kept) 2304 472 / 415, 4096 336 / 304. One-warp teams keep the
       * rule (fp32 E = 1024: bitmap 366 / 323 us). Both kernels give the same bits. */
      const int chunks = mrt_cdiv(E / ch, team);
      int reg = chunks >= SEL_REG_CHUNKS;
      if (team > 32 && (bitmap || (ch == 8 && chunks == SEL_REG_CHUNKS))) reg = 0;
      snprintf(l->name, sizeof l->name, "router_bwd_sel%s<%s, %d%s>", reg ? "_reg" : "", mrt_ctype(tg), team, bm);
      p.ints[BWD_TPW] = team <= 128 ? 1 : 0;
    } else {
      snprintf(l->name, sizeof l->name, "router_bwd<%s, %s, %d%s>", mrt_ctype(tg), mrt_ctype(to), team, bm);
    }
    int regs = 0;
    moe_rt_status st = mrt_kernel(ctx, l, FILE_ROUTER, &regs);
    if (st) return st;
    l->block = threads;
    l->smem = 0;
    p.ints[BWD_SPB] = spb;
    p.ints[BWD_RESIDENT_REGS] = sel ? regs : 0; /* the dense kernel's grid ignores registers */
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  l->scalars[0] = sel ? 0 : vec;
  if (p.ints[BWD_TPW]) l->grid = tpw_grid(T, spb, (int)p.ints[BWD_TPW], 0);
  else l->grid = mrt_resident_grid(mrt_device(ctx), mrt_cdiv(T, spb), threads, 0, (int)p.ints[BWD_RESIDENT_REGS]);
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  mrt_args a = {0};
  mrt_arg_ptr(&a, grad);
  mrt_arg_ptr(&a, rmap);
  mrt_arg_ptr(&a, inter);
  mrt_arg_i64(&a, T);
  mrt_arg_i32(&a, E);
  mrt_arg_i32(&a, K);
  mrt_arg_i32(&a, score_fn);
  if (sel) {
    mrt_arg_f32(&a, scale);
    mrt_arg_ptr(&a, out);
  } else {
    mrt_arg_i32(&a, pre);
    mrt_arg_i32(&a, aux);
    mrt_arg_f32(&a, scale);
    mrt_arg_ptr(&a, out);
    mrt_arg_i32(&a, vec);
  }
  return mrt_launch_one(ctx, l, &a, stream);
}

/* The backward from indices (router.py _launch_bwd_idx: router_bwd_idx, one warp a token); ids outside
 * [-1, E) go to the error word. */
static moe_rt_status router_bwd_idx(moe_rt_context* ctx, const void* grad, int dtype, const void* idx, int idx_bytes,
                                    const float* inter, void* out, int64_t T, int E, int K, int score_fn, int pre,
                                    float scale, moe_rt_stream stream) {
  mrt_plan p;
  memset(&p, 0, sizeof p);
  if (T == 0) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  const int ch = mrt_dtype_size(dtype) == 2 ? 8 : 4;
  const int vec = E % ch == 0 && mrt_aligned16(grad) && mrt_aligned16(inter) && mrt_aligned16(out);
  bwd_key key;
  memset(&key, 0, sizeof key);
  key.op = 3; key.tg = dtype; key.to = dtype;
  mrt_launch* l = &p.launch[0];
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    p.num_launches = 1;
    snprintf(l->name, sizeof l->name, "router_bwd_idx<%s>", mrt_ctype(dtype));
    int regs = 0;
    moe_rt_status st = mrt_kernel(ctx, l, FILE_ROUTER, &regs);
    if (st) return st;
    l->block = 128;
    p.ints[BWD_RESIDENT_REGS] = regs;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  l->grid = mrt_resident_grid(mrt_device(ctx), mrt_cdiv(T, 4), 128, 0, (int)p.ints[BWD_RESIDENT_REGS]);
  l->scalars[0] = vec;
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  unsigned long long err = 0;
  moe_rt_status st = mrt_error_word(ctx, &err);
  if (st) return st;
  mrt_args a = {0};
  mrt_arg_ptr(&a, grad);
  mrt_arg_ptr(&a, idx);
  mrt_arg_i32(&a, idx_bytes);
  mrt_arg_ptr(&a, inter);
  mrt_arg_i64(&a, T);
  mrt_arg_i32(&a, E);
  mrt_arg_i32(&a, K);
  mrt_arg_i32(&a, score_fn);
  mrt_arg_i32(&a, pre);
  mrt_arg_f32(&a, scale);
  mrt_arg_ptr(&a, out);
  mrt_arg_i32(&a, vec);
  mrt_arg_ptr(&a, (const void*)(uintptr_t)err);
  return mrt_launch_one(ctx, l, &a, stream);
}

moe_rt_status moe_rt_topk_with_score_backward(moe_rt_context* ctx, const void* grad_probs, int dtype,
                                              const void* routing, int routing_dtype, const float* intermediate,
                                              int64_t T, int E, int K, int score_function, int use_pre_softmax,
                                              float scaling_factor, void* grad_logits, moe_rt_stream stream) {
  static const char op[] = "moe_rt_topk_with_score_backward";
  moe_rt_status st;
  int bitmap, idx_bytes;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_float_dtype(op, "dtype", dtype)) ||
      (st = check_sizes(op, T, E, K)) || (st = check_score(op, score_function)) ||
      (st = check_scale(op, scaling_factor)) || (st = routing_form(op, routing_dtype, 1, &bitmap, &idx_bytes)) ||
      (st = mrt_check_data(op, "grad_probs", grad_probs, T)) || (st = mrt_check_data(op, "routing", routing, T)) ||
      (st = mrt_check_data(op, "intermediate", intermediate, T)) || (st = mrt_check_data(op, "grad_logits", grad_logits, T)))
    return st;
  int pre = use_pre_softmax && score_function == MOE_RT_SCORE_SOFTMAX;
  if (idx_bytes)
    return router_bwd_idx(ctx, grad_probs, dtype, routing, idx_bytes, intermediate, grad_logits, T, E, K,
                          score_function, pre, scaling_factor, stream);
  return router_bwd(ctx, grad_probs, dtype, routing, bitmap, intermediate, grad_logits, dtype, T, E, K,
                    score_function, pre, 0, scaling_factor, stream);
}

moe_rt_status moe_rt_scores_for_aux_loss_backward(moe_rt_context* ctx, const float* grad_scores,
                                                  const float* intermediate, int64_t T, int E, int K,
                                                  int score_function, void* grad_logits, int grad_dtype,
                                                  moe_rt_stream stream) {
  static const char op[] = "moe_rt_scores_for_aux_loss_backward";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_float_dtype(op, "grad_dtype", grad_dtype)) ||
      (st = check_sizes(op, T, E, K)) || (st = check_score(op, score_function)) ||
      (st = mrt_check_data(op, "grad_scores", grad_scores, T)) || (st = mrt_check_data(op, "intermediate", intermediate, T)) ||
      (st = mrt_check_data(op, "grad_logits", grad_logits, T)))
    return st;
  return router_bwd(ctx, grad_scores, MOE_RT_FLOAT32, NULL, 0, intermediate, grad_logits, grad_dtype, T, E, K,
                    score_function, 0, 1, 1.0f, stream);
}

/* ---- aux loss (router.py aux_loss, aux_loss_backward) ----------------------------------------------- */

typedef struct aux_key {
  int32_t op, dtype, C, dev_total; /* dev_total: the backward's build (aux_loss_bwd's DEV_TOTAL) */
  int64_t R;
} aux_key;

static void aux_blocks(int64_t R, int64_t* rpb, int64_t* nb) {
  *rpb = mrt_max(1, mrt_cdiv(R, 1024)); /* the partition depends on R only: same bits on every device */
  *nb = R > 0 ? mrt_cdiv(R, *rpb) : 0;
}

moe_rt_status moe_rt_aux_loss_workspace_size(int64_t R, size_t* bytes) {
  mrt_clear_error();
  if (!bytes) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_aux_loss_workspace_size: bytes is NULL");
  if (R < 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_aux_loss_workspace_size: num_rows must be >= 0, got %lld",
                    (long long)R);
  int64_t rpb, nb;
  aux_blocks(R, &rpb, &nb);
  *bytes = (size_t)mrt_max(nb, 1) * sizeof(float);
  return MOE_RT_SUCCESS;
}

static int tpe_kind(int dtype) {
  return dtype == MOE_RT_FLOAT32 ? 0 : dtype == MOE_RT_INT32 ? 1 : dtype == MOE_RT_INT64 ? 2 : -1;
}

/* The fp32 coefficient of the kernels (reference/router.py aux_loss_coeff): (E*coeff)/topk, then /T/T when
 * T is on the host (the device divides by a device T). */
static float aux_coeff(int64_t total, int E, int topk, float coeff) {
  volatile float c = (float)E * coeff;
  c = c / (float)topk;
  if (total > 0) {
    float t = (float)total;
    c = c / t;
    c = c / t;
  }
  return c;
}

static moe_rt_status check_aux(const char* op, int64_t R, int C, const void* tpe, int tpe_dtype, int64_t total,
                               const void* total_device, int total_dtype, int E, int topk, float coeff) {
  moe_rt_status st;
  if (R < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_rows must be >= 0, got %lld", op, (long long)R);
  if (C < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_cols must be >= 0, got %d", op, C);
  if (E < 1) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_experts must be >= 1, got %d", op, E);
  if (C % E)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_experts: must divide the number of columns (%d), got %d",
                    op, C, E);
  if (topk < 1) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: topk must be >= 1, got %d", op, topk);
  if (!isfinite(coeff)) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: coeff: must be finite, got %g", op, (double)coeff);
  if (tpe_kind(tpe_dtype) < 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: tokens_per_expert: expected dtype int32, int64 or float32, "
                    "got %s (%d)", op, mrt_dtype_name(tpe_dtype), tpe_dtype);
  if ((st = mrt_check_ptr(op, "tokens_per_expert", tpe))) return st;
  if (total_device) {
    if (total != 0)
      return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: total_num_tokens: pass 0 with total_device (got %lld)", op,
                      (long long)total);
    if (total_dtype != MOE_RT_INT32 && total_dtype != MOE_RT_INT64)
      return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: total_dtype: expected int32 or int64 for total_device, got "
                      "%s (%d)", op, mrt_dtype_name(total_dtype), total_dtype);
  } else if (total < 1) {
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: total_num_tokens: must be >= 1 (or 0 with total_device), got "
                    "%lld", op, (long long)total);
  }
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_aux_loss(moe_rt_context* ctx, const void* probs, int dtype, int64_t R, int C,
                              const void* tpe, int tpe_dtype, int64_t total, const void* total_device, int total_dtype,
                              int E, int topk, float coeff, void* workspace, size_t workspace_bytes, void* out,
                              moe_rt_stream stream) {
  static const char op[] = "moe_rt_aux_loss";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_float_dtype(op, "dtype", dtype)) ||
      (st = check_aux(op, R, C, tpe, tpe_dtype, total, total_device, total_dtype, E, topk, coeff)) ||
      (st = mrt_check_data(op, "probs", probs, R * C)) || (st = mrt_check_ptr(op, "out", out)) ||
      (st = mrt_check_ptr(op, "workspace", workspace)))
    return st;
  size_t need = 0;
  moe_rt_aux_loss_workspace_size(R, &need);
  if (workspace_bytes < need)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: workspace_bytes: need %zu (moe_rt_aux_loss_workspace_size), "
                    "got %zu", op, need, workspace_bytes);
  int64_t rpb, nb;
  aux_blocks(R, &rpb, &nb);
  const int vec = C > 0 && C % (16 / mrt_dtype_size(dtype)) == 0 && mrt_aligned16(probs);
  if (!(nb > 0 && C > 0)) nb = 0;
  aux_key key;
  memset(&key, 0, sizeof key);
  key.op = 5; key.dtype = dtype; key.R = R; key.C = C;
  mrt_plan p;
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    p.num_launches = 2;
    int regs = 0;
    snprintf(p.launch[0].name, sizeof p.launch[0].name, "aux_loss_partial<%s>", mrt_ctype(dtype));
    snprintf(p.launch[1].name, sizeof p.launch[1].name, "aux_loss_final<%s>", mrt_ctype(dtype));
    if ((nb && (st = mrt_kernel(ctx, &p.launch[0], FILE_ROUTER, &regs))) ||
        (st = mrt_kernel(ctx, &p.launch[1], FILE_ROUTER, &regs)))
      return st;
    p.launch[0].file = FILE_ROUTER;
    p.launch[0].grid = nb;
    p.launch[0].block = 256;
    p.launch[1].grid = 1;
    p.launch[1].block = 256;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  const int tkind = tpe_kind(tpe_dtype), tot_kind = total_device ? (total_dtype == MOE_RT_INT32 ? 1 : 2) : 0;
  const float c = aux_coeff(total_device ? 0 : total, E, topk, coeff);
  if (nb) {
    mrt_args a = {0};
    mrt_arg_ptr(&a, probs);
    mrt_arg_i64(&a, R);
    mrt_arg_i32(&a, C);
    mrt_arg_ptr(&a, tpe);
    mrt_arg_i32(&a, tkind);
    mrt_arg_i64(&a, rpb);
    mrt_arg_ptr(&a, workspace);
    mrt_arg_i32(&a, vec);
    if ((st = mrt_launch_one(ctx, &p.launch[0], &a, stream))) return st;
  }
  mrt_args b = {0};
  mrt_arg_ptr(&b, workspace);
  mrt_arg_i32(&b, (int32_t)nb);
  mrt_arg_f32(&b, c);
  mrt_arg_ptr(&b, out);
  mrt_arg_ptr(&b, total_device);
  mrt_arg_i32(&b, tot_kind);
  return mrt_launch_one(ctx, &p.launch[1], &b, stream);
}

moe_rt_status moe_rt_aux_loss_backward(moe_rt_context* ctx, const void* grad, int dtype, int64_t R, int C,
                                       const void* tpe, int tpe_dtype, int64_t total, const void* total_device,
                                       int total_dtype, int E, int topk, float coeff, void* grad_probs,
                                       moe_rt_stream stream) {
  static const char op[] = "moe_rt_aux_loss_backward";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_float_dtype(op, "dtype", dtype)) ||
      (st = check_aux(op, R, C, tpe, tpe_dtype, total, total_device, total_dtype, E, topk, coeff)) ||
      (st = mrt_check_ptr(op, "grad_aux_loss", grad)) || (st = mrt_check_data(op, "grad_probs", grad_probs, R * C)))
    return st;
  int64_t rpb, nb;
  aux_blocks(R, &rpb, &nb);
  const int vec = C % (16 / mrt_dtype_size(dtype)) == 0 && mrt_aligned16(grad_probs);
  aux_key key;
  memset(&key, 0, sizeof key);
  key.op = 6; key.dtype = dtype; key.R = R; key.C = C; key.dev_total = total_device != 0;
  mrt_plan p;
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    if (nb > 0 && C > 0) {
      p.num_launches = 1;
      snprintf(p.launch[0].name, sizeof p.launch[0].name, "aux_loss_bwd<%s, %s>", mrt_ctype(dtype),
               key.dev_total ? "true" : "false");
      int regs = 0;
      if ((st = mrt_kernel(ctx, &p.launch[0], FILE_ROUTER, &regs))) return st;
      p.launch[0].grid = nb;
      p.launch[0].block = 256;
    }
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  if (mrt_is_planning(ctx) || !p.num_launches) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  mrt_args a = {0};
  mrt_arg_ptr(&a, grad);
  mrt_arg_ptr(&a, tpe);
  mrt_arg_i32(&a, tpe_kind(tpe_dtype));
  mrt_arg_i64(&a, R);
  mrt_arg_i32(&a, C);
  mrt_arg_f32(&a, aux_coeff(total_device ? 0 : total, E, topk, coeff));
  mrt_arg_i64(&a, rpb);
  mrt_arg_ptr(&a, grad_probs);
  mrt_arg_i32(&a, vec);
  mrt_arg_ptr(&a, total_device);
  mrt_arg_i32(&a, total_device ? (total_dtype == MOE_RT_INT32 ? 1 : 2) : 0);
  return mrt_launch_one(ctx, &p.launch[0], &a, stream);
}

/* ---- Quantile Balancing (router.py topk_with_score_qb, _qb_fwd_cfg, _launch_qb_fwd, _qb_hist_grid) ------ */

#define QB_SMEM_HIST_BYTES (48 * 1024) /* router.py _QB_SMEM_HIST_BYTES (its default) */
#define QB_ATOMIC_SAMPLES ((int64_t)1 << 18)
#define QB_BLOCK_TOKENS 65535
#define QB_HIST_KERNEL "qb_histogram_accumulate"

/* The forward kernels' histogram: 0 none (qb_histogram_accumulate after the kernel), 1 global atomics, 2 the
 * block's shared histogram (kernels/router.cu, "Quantile Balancing"). */
static int qb_hmode(int64_t T, int E, int B, int fused) {
  if (!fused) return 0;
  if ((int64_t)4 * E * ((B + 1) / 2) <= QB_SMEM_HIST_BYTES) return 2;
  return T * E <= QB_ATOMIC_SAMPLES ? 1 : 0;
}

static int qb_reg_slot_words(int K) { return 2 * 64 + 4 + 4 * al4(K); }

/* router_fwd_qb_reg<T, V>'s launch bound, 128 * MOE_RT_FWD_REG_MINB(V, T, true, false): its most threads a
 * block (what a planning context assumes; a device context reads the loaded kernel's). */
static int qb_reg_bound(int dtype, int v) {
  return 128 * (v <= 8 ? (dtype == MOE_RT_FLOAT32 ? 5 : 6) : v <= 16 ? 4 : 3);
}

typedef struct qb_key {
  int32_t op, dtype, E, K, B, vec, hmode, pad;
} qb_key;

enum { QB_HMODE = 3, QB_HIST_RESIDENT = 4 }; /* beside the forward's FWD_SPB, FWD_TPW, FWD_RESIDENT */

/* The forward's launch (router_fwd_qb_reg where the plain forward takes router_fwd_reg, else router_fwd_qb),
 * without its grid; cached by (dtype, E, K, B, vec, hmode). */
static moe_rt_status qb_fwd_plan(moe_rt_context* ctx, int dtype, int E, int K, int B, int vec, int hmode,
                                 mrt_plan* out) {
  qb_key key;
  memset(&key, 0, sizeof key);
  key.op = 7; key.dtype = dtype; key.E = E; key.K = K; key.B = B; key.vec = vec; key.hmode = hmode;
  if (mrt_plan_lookup(ctx, &key, sizeof key, out)) return MOE_RT_SUCCESS;
  mrt_plan p;
  memset(&p, 0, sizeof p);
  p.num_launches = 1;
  mrt_launch* l = &p.launch[0];
  const int isz = mrt_dtype_size(dtype), ch = 16 / isz;
  const char* ct = mrt_ctype(dtype);
  const int hbytes = hmode == 2 ? 4 * E * ((B + 1) / 2) : 0;
  const int v = reg_v(E, ch, vec, dtype);
  int spb, threads, smem, tpw = 0, regs = 0, max_threads = 0;
  moe_rt_status st;
  if (v) {
    snprintf(l->name, sizeof l->name, "router_fwd_qb_reg<%s, %d>", ct, v);
    if ((st = mrt_kernel_threads(ctx, l, FILE_ROUTER, &regs, &max_threads))) return st;
    if (hmode == 2) {
      /* one resident wave, one histogram (and one flush) a multiprocessor: a block of every warp it takes */
      spb = (max_threads ? max_threads : qb_reg_bound(dtype, v)) / 32;
      threads = 32 * spb;
      smem = hbytes + 4 * spb * qb_reg_slot_words(K);
    } else {
      spb = 4;
      threads = 128;
      smem = 4 * 4 * qb_reg_slot_words(K);
      tpw = v == 8 && isz == 2 ? 2 : 0; /* tokens a warp as router_fwd_reg's (no lane groups) */
    }
  } else {
    const int team = team_for(E, 1);
    /* hmode 0: the kernel compiled without the histogram */
    snprintf(l->name, sizeof l->name, "router_fwd_qb<%s, %d%s>", ct, team, hmode ? "" : ", false");
    if ((st = mrt_kernel(ctx, l, FILE_ROUTER, &regs))) return st;
    spb = team == 32 ? 4 : 1;
    threads = team * spb;
    smem = 4 * spb * slot_words(E, 0, K + 1, team) + hbytes;
  }
  fwd_shape(ctx, &p, threads, smem, regs, spb, tpw);
  p.ints[QB_HMODE] = hmode;
  mrt_plan_put(ctx, &key, sizeof key, &p);
  *out = p;
  return MOE_RT_SUCCESS;
}

/* qb_histogram_accumulate<VPL>: strips of 32 VPL experts (VPL = 4: 16-byte loads of raw where `vec` (E % 4 == 0,
 * raw 16-byte aligned) and the strip's 128 B int32 counters fit a block, 1024 threads; else VPL = 1, 256
 * threads) (grid x) times shares of the tokens (grid y, as many as fill one resident wave with the strips, each
 * of at least max(256, 4 B) tokens); the strip's bins in shared memory (32 VPL B int32) when they fit a block.
 * Into launch `l`, without grid y. router.py _qb_hist_cfg. */
static moe_rt_status qb_hist_plan(moe_rt_context* ctx, int E, int B, int vec, mrt_launch* l, int64_t* resident) {
  qb_key key;
  memset(&key, 0, sizeof key);
  key.op = 8; key.E = E; key.B = B; key.vec = vec;
  mrt_plan p;
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    p.num_launches = 1;
    mrt_launch* h = &p.launch[0];
    const int64_t optin = mrt_device(ctx)->smem_per_block_optin;
    const int vpl = vec && E % 4 == 0 && (int64_t)4 * 128 * B <= optin ? 4 : 1;
    snprintf(h->name, sizeof h->name, "%s<%d>", QB_HIST_KERNEL, vpl);
    int regs = 0;
    moe_rt_status st = mrt_kernel(ctx, h, FILE_ROUTER, &regs);
    if (st) return st;
    const int64_t want = (int64_t)4 * 32 * vpl * B;
    const int use = want <= optin;
    h->block = vpl == 4 ? 1024 : 256;
    h->smem = use ? (int32_t)want : 0;
    h->grid = mrt_cdiv(E, 32 * vpl);
    h->scalars[1] = use;
    p.ints[QB_HIST_RESIDENT] = mrt_resident_grid(mrt_device(ctx), (int64_t)1 << 30, h->block, h->smem, regs);
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  *l = p.launch[0];
  *resident = p.ints[QB_HIST_RESIDENT];
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_topk_with_score_qb(moe_rt_context* ctx, const void* logits, int dtype, int64_t T, int E, int K,
                                        float scaling_factor, const float* expert_bias, const float* qb_bin_bounds,
                                        int32_t* qb_histogram, int num_bins, int qb_histogram_mode, void* probs,
                                        void* routing_map, float* intermediate, float* cutoff, moe_rt_stream stream) {
  static const char op[] = "moe_rt_topk_with_score_qb";
  moe_rt_status st;
  const int B = num_bins;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_float_dtype(op, "dtype", dtype)) ||
      (st = check_sizes(op, T, E, K)))
    return st;
  if (K >= E)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: topk: Quantile Balancing selects topk + 1 experts, so topk "
                    "must be < num_experts (%d), got %d", op, E, K);
  if ((st = check_scale(op, scaling_factor))) return st;
  if (qb_histogram_mode != MOE_RT_QB_TWO_KERNEL && qb_histogram_mode != MOE_RT_QB_FUSED_ATOMIC)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: qb_histogram_mode: expected MOE_RT_QB_TWO_KERNEL (0) or "
                    "MOE_RT_QB_FUSED_ATOMIC (1), got %d", op, qb_histogram_mode);
  if (B < 1 || B > MOE_RT_MAX_QB_BINS)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_bins must be in [1, %d], got %d", op, MOE_RT_MAX_QB_BINS,
                    B);
  if ((st = mrt_check_data(op, "logits", logits, T)) || (st = mrt_check_ptr(op, "expert_bias", expert_bias)) ||
      (st = mrt_check_ptr(op, "qb_bin_bounds", qb_bin_bounds)) ||
      (st = mrt_check_ptr(op, "qb_histogram", qb_histogram)) || (st = mrt_check_data(op, "probs", probs, T)) ||
      (st = mrt_check_data(op, "routing_map", routing_map, T)) || (st = mrt_check_data(op, "intermediate", intermediate, T)) ||
      (st = mrt_check_data(op, "cutoff", cutoff, T)))
    return st;
  mrt_plan p;
  memset(&p, 0, sizeof p);
  if (T == 0) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  const void* ptrs[5] = {logits, probs, routing_map, intermediate, expert_bias};
  const int vec = fwd_vec(dtype, E, ptrs, 5);
  const int hmode = qb_hmode(T, E, B, qb_histogram_mode == MOE_RT_QB_FUSED_ATOMIC);
  if ((st = qb_fwd_plan(ctx, dtype, E, K, B, vec, hmode, &p))) return st;
  const int spb = (int)p.ints[FWD_SPB];
  mrt_launch* l = &p.launch[0];
  l->grid = tpw_grid(T, spb, (int)p.ints[FWD_TPW], p.ints[FWD_RESIDENT]);
  if (hmode == 2) /* every block under 2^16 tokens: its 16-bit counters do not wrap */
    l->grid = mrt_max(l->grid, mrt_cdiv(T, (int64_t)spb * mrt_max(1, QB_BLOCK_TOKENS / spb)));
  l->scalars[0] = vec;
  l->scalars[1] = hmode;
  int64_t hist_resident = 0;
  if (hmode == 0) {
    mrt_launch* h = &p.launch[1];
    if ((st = qb_hist_plan(ctx, E, B, mrt_aligned16(intermediate), h, &hist_resident))) return st;
    h->grid_y = mrt_max(1, mrt_min(hist_resident / h->grid, T / mrt_max(256, (int64_t)4 * B)));
    h->scalars[0] = h->grid_y;
    p.num_launches = 2;
  }
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  const int is_generic = strncmp(l->name, "router_fwd_qb<", 14) == 0;
  mrt_args a = {0};
  mrt_arg_ptr(&a, logits);
  mrt_arg_i64(&a, T);
  mrt_arg_i32(&a, E);
  mrt_arg_i32(&a, K);
  mrt_arg_f32(&a, scaling_factor);
  mrt_arg_ptr(&a, expert_bias);
  mrt_arg_ptr(&a, probs);
  mrt_arg_ptr(&a, routing_map);
  mrt_arg_ptr(&a, intermediate);
  mrt_arg_ptr(&a, cutoff);
  mrt_arg_ptr(&a, qb_bin_bounds);
  mrt_arg_ptr(&a, hmode ? qb_histogram : NULL);
  mrt_arg_i32(&a, B);
  mrt_arg_i32(&a, hmode);
  if (is_generic) mrt_arg_i32(&a, vec);
  if ((st = mrt_launch_one(ctx, l, &a, stream)) || hmode) return st;
  const mrt_launch* h = &p.launch[1];
  mrt_args b = {0};
  mrt_arg_ptr(&b, intermediate);
  mrt_arg_ptr(&b, cutoff);
  mrt_arg_i64(&b, T);
  mrt_arg_i32(&b, E);
  mrt_arg_ptr(&b, qb_bin_bounds);
  mrt_arg_ptr(&b, qb_histogram);
  mrt_arg_i32(&b, B);
  mrt_arg_i32(&b, (int32_t)h->scalars[1]);
  return mrt_launch_one(ctx, h, &b, stream);
}
