/* A MoE layer through moe_rt's C ABI, with no Python and no CUDA header: router -> plan -> dispatch -> a simple
 * expert (row r of expert e times scale[e], computed on the host) -> combine, then the backward of each step
 * and the aux loss, every result checked against the NumPy reference's numbers.
 *
 *   python3 -m moe_rt warmup --out kernels          # the kernels, as cubins, with manifest.json
 *   python3 examples/make_reference.py moe_layer.bin  # inputs and the reference's outputs
 *   make -C examples                                  # or: cc -std=c11 -Iinclude examples/moe_layer.c ...
 *   examples/moe_layer kernels moe_layer.bin          # prints "moe_layer: OK" on success
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_rt/moe_rt.h"

static moe_rt_context* g_ctx;

static void die(const char* what) {
  fprintf(stderr, "moe_layer: %s: %s\n", what, moe_rt_last_error());
  moe_rt_context_destroy(g_ctx);
  exit(2);
}

#define CHECK(call)                                      \
  do {                                                   \
    moe_rt_status st_ = (call);                          \
    if (st_ != MOE_RT_SUCCESS) die(#call);               \
  } while (0)

/* ---- the reference file (examples/make_reference.py) ---------------------------------------------------- */

typedef struct {
  int64_t T, E, K, H, A, N;
  float coeff;
  float *logits, *x, *expert_scale, *grad_y;
  int32_t* topk_idx;
  float *topk_weights, *probs;
  uint8_t* routing_map;
  int32_t *counts, *tokens_per_expert, *seg_start;
  float *x_permuted, *probs_permuted, *y, *grad_y_permuted, *grad_weights, *grad_x, *grad_logits, *aux_scores;
  float *aux_loss, *aux_grad_logits;
} reference;

static void* take(FILE* f, size_t bytes, const char* name) {
  void* p = malloc(bytes ? bytes : 1);
  if (!p || fread(p, 1, bytes, f) != bytes) {
    fprintf(stderr, "moe_layer: the reference file ends before %s\n", name);
    exit(2);
  }
  return p;
}

static void read_reference(const char* path, reference* r) {
  FILE* f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "moe_layer: cannot open %s (write it with python3 examples/make_reference.py %s)\n", path, path);
    exit(2);
  }
  char magic[8];
  int64_t dims[6];
  if (fread(magic, 1, 8, f) != 8 || memcmp(magic, "MOERTEX1", 8) != 0 || fread(dims, 8, 6, f) != 6 ||
      fread(&r->coeff, 4, 1, f) != 1) {
    fprintf(stderr, "moe_layer: %s is not a make_reference.py file\n", path);
    exit(2);
  }
  r->T = dims[0]; r->E = dims[1]; r->K = dims[2]; r->H = dims[3]; r->A = dims[4]; r->N = dims[5];
  const size_t T = r->T, E = r->E, K = r->K, H = r->H, N = r->N, f4 = 4;
  r->logits = take(f, T * E * f4, "logits");
  r->x = take(f, T * H * f4, "x");
  r->expert_scale = take(f, E * f4, "expert_scale");
  r->grad_y = take(f, T * H * f4, "grad_y");
  r->topk_idx = take(f, T * K * f4, "topk_idx");
  r->topk_weights = take(f, T * K * f4, "topk_weights");
  r->probs = take(f, T * E * f4, "probs");
  r->routing_map = take(f, T * E, "routing_map");
  r->counts = take(f, E * f4, "counts");
  r->tokens_per_expert = take(f, E * f4, "tokens_per_expert");
  r->seg_start = take(f, (E + 1) * f4, "seg_start");
  r->x_permuted = take(f, N * H * f4, "x_permuted");
  r->probs_permuted = take(f, N * f4, "probs_permuted");
  r->y = take(f, T * H * f4, "y");
  r->grad_y_permuted = take(f, N * H * f4, "grad_y_permuted");
  r->grad_weights = take(f, T * K * f4, "grad_weights");
  r->grad_x = take(f, T * H * f4, "grad_x");
  r->grad_logits = take(f, T * E * f4, "grad_logits");
  r->aux_scores = take(f, T * E * f4, "aux_scores");
  r->aux_loss = take(f, f4, "aux_loss");
  r->aux_grad_logits = take(f, T * E * f4, "aux_grad_logits");
  fclose(f);
}

/* ---- checks -------------------------------------------------------------------------------------------------- */

static int g_failures;

static void check_f32(const char* name, const float* got, const float* want, size_t n, float rtol, float atol) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!(fabsf(got[i] - want[i]) <= atol + rtol * fabsf(want[i]))) {
      if (!bad) first = i;
      ++bad;
    }
  }
  if (bad) {
    printf("  %-18s MISMATCH: %zu of %zu values, first at %zu: %.9g, expected %.9g\n", name, bad, n, first,
           (double)got[first], (double)want[first]);
    ++g_failures;
  } else {
    printf("  %-18s ok (%zu values)\n", name, n);
  }
}

static void check_i32(const char* name, const int32_t* got, const int32_t* want, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (got[i] != want[i]) {
      printf("  %-18s MISMATCH at %zu: %d, expected %d\n", name, i, got[i], want[i]);
      ++g_failures;
      return;
    }
  printf("  %-18s ok (%zu values, exact)\n", name, n);
}

static void check_u8(const char* name, const uint8_t* got, const uint8_t* want, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if ((got[i] != 0) != (want[i] != 0)) {
      printf("  %-18s MISMATCH at %zu: %d, expected %d\n", name, i, got[i], want[i]);
      ++g_failures;
      return;
    }
  printf("  %-18s ok (%zu values, exact)\n", name, n);
}

/* ---- device buffers ------------------------------------------------------------------------------------------ */

static void* dev(size_t bytes) {
  void* p = NULL;
  CHECK(moe_rt_malloc(g_ctx, bytes, &p));
  return p;
}

static void* upload(const void* host, size_t bytes) {
  void* p = dev(bytes);
  CHECK(moe_rt_copy_to_device(g_ctx, p, host, bytes));
  return p;
}

static void* download(const void* device, size_t bytes) {
  void* p = malloc(bytes ? bytes : 1);
  if (!p) exit(2);
  CHECK(moe_rt_copy_to_host(g_ctx, p, device, bytes));
  return p;
}

/* The expert, on the host: rows [seg_start[e], seg_start[e+1]) times scale[e]; rows past seg_start[E] zero. */
static void expert(float* rows, const int32_t* seg_start, const float* scale, int64_t E, int64_t N, int64_t H) {
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = seg_start[e]; r < seg_start[e + 1]; ++r)
      for (int64_t h = 0; h < H; ++h) rows[r * H + h] *= scale[e];
  for (int64_t r = seg_start[E]; r < N; ++r)
    for (int64_t h = 0; h < H; ++h) rows[r * H + h] = 0.0f;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s KERNEL_CACHE_DIR REFERENCE_FILE\n", argv[0]);
    return 2;
  }
  CHECK(moe_rt_context_create(argv[1], 0, &g_ctx));
  reference r;
  read_reference(argv[2], &r);
  const int64_t T = r.T, E = r.E, K = r.K, H = r.H, A = r.A;
  const moe_rt_stream s = NULL;
  const size_t f4 = 4;

  /* router: top-k with softmax, compact (for the plan) and dense (for the router's backward) */
  float* d_logits = upload(r.logits, T * E * f4);
  int32_t* d_idx = dev(T * K * f4);
  float* d_w = dev(T * K * f4);
  float* d_probs = dev(T * E * f4);
  uint8_t* d_rmap = dev(T * E);
  float* d_inter = dev(T * E * f4);
  CHECK(moe_rt_topk_indices_with_score(g_ctx, d_logits, MOE_RT_FLOAT32, T, E, K, MOE_RT_SCORE_SOFTMAX, 0, 0, 0, 1.0f,
                                       NULL, d_idx, d_w, s));
  CHECK(moe_rt_topk_with_score(g_ctx, d_logits, MOE_RT_FLOAT32, T, E, K, MOE_RT_SCORE_SOFTMAX, 0, 0, 0, 1.0f, NULL,
                               d_probs, d_rmap, MOE_RT_BOOL, d_inter, s));

  /* plan: rows grouped by expert, each expert padded to a multiple of A */
  int64_t N = 0;
  CHECK(moe_rt_plan_num_rows(T, K, (int)E, (int)A, -1, &N));
  if (N != r.N) {
    fprintf(stderr, "moe_layer: %lld rows, the reference has %lld\n", (long long)N, (long long)r.N);
    return 1;
  }
  size_t ws_bytes = 0;
  CHECK(moe_rt_make_plan_workspace_size(T, K, (int)E, &ws_bytes));
  void* d_ws = dev(ws_bytes);
  moe_rt_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.dst_row = dev(T * K * f4);
  plan.src_slot = dev(N * f4);
  plan.seg_start = dev((E + 1) * f4);
  plan.counts = dev(E * f4);
  plan.tokens_per_expert = dev(E * f4);
  CHECK(moe_rt_make_plan(g_ctx, d_idx, MOE_RT_INT32, T, K, (int)E, (int)A, -1, &plan, d_ws, ws_bytes, s));

  /* dispatch the tokens and their weights */
  float* d_x = upload(r.x, T * H * f4);
  float* d_xp = dev(N * H * f4);
  float* d_pp = dev(N * f4);
  CHECK(moe_rt_dispatch(g_ctx, &plan, d_x, MOE_RT_FLOAT32, H, d_w, d_xp, d_pp, MOE_RT_FLOAT32, s));

  /* the expert, on the host */
  int32_t* seg = download(plan.seg_start, (E + 1) * f4);
  float* yp = download(d_xp, N * H * f4);
  float* xp_host = download(d_xp, N * H * f4);
  expert(yp, seg, r.expert_scale, E, N, H);
  float* d_yp = upload(yp, N * H * f4);

  /* combine: y[t] = sum_k w[t,k] * y_permuted[dst_row[t,k]] */
  float* d_y = dev(T * H * f4);
  CHECK(moe_rt_combine(g_ctx, &plan, d_yp, MOE_RT_FLOAT32, H, d_w, d_y, s));

  /* backward: combine, the expert (linear: the same scaling), dispatch, the router */
  float* d_gy = upload(r.grad_y, T * H * f4);
  float* d_gyp = dev(N * H * f4);
  float* d_gw = dev(T * K * f4);
  CHECK(moe_rt_combine_backward(g_ctx, &plan, d_gy, MOE_RT_FLOAT32, H, d_yp, d_w, d_gyp, d_gw, s));
  float* gxp = download(d_gyp, N * H * f4);
  float* gyp_host = download(d_gyp, N * H * f4);
  expert(gxp, seg, r.expert_scale, E, N, H);
  float* d_gxp = upload(gxp, N * H * f4);
  float* d_gx = dev(T * H * f4);
  CHECK(moe_rt_dispatch_backward(g_ctx, &plan, d_gxp, MOE_RT_FLOAT32, H, NULL, d_gx, NULL, s));
  int32_t* idx = download(d_idx, T * K * f4);
  float* gw = download(d_gw, T * K * f4);
  float* grad_probs = calloc((size_t)(T * E), f4);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) grad_probs[t * E + idx[t * K + k]] = gw[t * K + k];
  float* d_gprobs = upload(grad_probs, T * E * f4);
  float* d_glogits = dev(T * E * f4);
  CHECK(moe_rt_topk_with_score_backward(g_ctx, d_gprobs, MOE_RT_FLOAT32, d_rmap, MOE_RT_BOOL, d_inter, T, E, K,
                                        MOE_RT_SCORE_SOFTMAX, 0, 1.0f, d_glogits, s));

  /* the aux loss over the dense scores, with the plan's per-expert counts, and its backward */
  float* d_scores = dev(T * E * f4);
  uint8_t* d_rmap_aux = dev(T * E);
  float* d_inter_aux = dev(T * E * f4);
  CHECK(moe_rt_scores_for_aux_loss(g_ctx, d_logits, MOE_RT_FLOAT32, T, E, K, MOE_RT_SCORE_SOFTMAX, d_scores,
                                   d_rmap_aux, MOE_RT_BOOL, d_inter_aux, s));
  size_t aux_ws_bytes = 0;
  CHECK(moe_rt_aux_loss_workspace_size(T, &aux_ws_bytes));
  void* d_aux_ws = dev(aux_ws_bytes);
  float* d_loss = dev(f4);
  CHECK(moe_rt_aux_loss(g_ctx, d_scores, MOE_RT_FLOAT32, T, (int)E, plan.counts, MOE_RT_INT32, T, NULL, 0, (int)E,
                        (int)K, r.coeff, d_aux_ws, aux_ws_bytes, d_loss, s));
  const float one = 1.0f;
  float* d_gloss = upload(&one, f4);
  float* d_gscores = dev(T * E * f4);
  float* d_aux_glogits = dev(T * E * f4);
  CHECK(moe_rt_aux_loss_backward(g_ctx, d_gloss, MOE_RT_FLOAT32, T, (int)E, plan.counts, MOE_RT_INT32, T, NULL, 0,
                                 (int)E, (int)K, r.coeff, d_gscores, s));
  CHECK(moe_rt_scores_for_aux_loss_backward(g_ctx, d_gscores, d_inter_aux, T, E, K, MOE_RT_SCORE_SOFTMAX,
                                            d_aux_glogits, MOE_RT_FLOAT32, s));
  CHECK(moe_rt_check(g_ctx, s)); /* waits; raises bad expert ids make_plan met (none here) */

  printf("moe_layer: T=%lld E=%lld K=%lld H=%lld align_size=%lld rows=%lld\n", (long long)T, (long long)E,
         (long long)K, (long long)H, (long long)A, (long long)N);
  const float rt = 2e-5f, at = 1e-6f;
  check_i32("topk_idx", idx, r.topk_idx, T * K);
  check_f32("topk_weights", download(d_w, T * K * f4), r.topk_weights, T * K, rt, at);
  check_f32("probs", download(d_probs, T * E * f4), r.probs, T * E, rt, at);
  check_u8("routing_map", download(d_rmap, T * E), r.routing_map, T * E);
  check_i32("counts", download(plan.counts, E * f4), r.counts, E);
  check_i32("tokens_per_expert", download(plan.tokens_per_expert, E * f4), r.tokens_per_expert, E);
  check_i32("seg_start", seg, r.seg_start, E + 1);
  check_f32("x_permuted", xp_host, r.x_permuted, N * H, 0.0f, 0.0f);
  check_f32("probs_permuted", download(d_pp, N * f4), r.probs_permuted, N, rt, at);
  check_f32("y", download(d_y, T * H * f4), r.y, T * H, 1e-4f, 1e-5f);
  check_f32("grad_y_permuted", gyp_host, r.grad_y_permuted, N * H, rt, at);
  check_f32("grad_weights", gw, r.grad_weights, T * K, 1e-4f, 1e-5f);
  check_f32("grad_x", download(d_gx, T * H * f4), r.grad_x, T * H, 1e-4f, 1e-5f);
  check_f32("grad_logits", download(d_glogits, T * E * f4), r.grad_logits, T * E, 1e-3f, 1e-5f);
  check_f32("aux_scores", download(d_scores, T * E * f4), r.aux_scores, T * E, rt, at);
  check_f32("aux_loss", download(d_loss, f4), r.aux_loss, 1, 1e-4f, 1e-7f);
  check_f32("aux_grad_logits", download(d_aux_glogits, T * E * f4), r.aux_grad_logits, T * E, 1e-3f, 1e-7f);
  moe_rt_context_destroy(g_ctx); /* the process exits next: the host and device buffers go with it */
  if (g_failures) {
    printf("moe_layer: FAILED (%d arrays differ from the reference)\n", g_failures);
    return 1;
  }
  printf("moe_layer: OK\n");
  return 0;
}
