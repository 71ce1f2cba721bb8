/* moe_rt core: EpGroup.prepare's launches (kernels/ep.cu: ep_prepare_direct, ep_prepare_send, ep_plan_meta,
 * ep_prepare_plan, ep_prepare_recv; then the permutation plan's kernels, moe_rt_make_plan) over a handle buffer
 * and scratch the caller allocated. The exchange of the segments between the send side and the received side
 * (NCCL, or the direct transport's barrier) and exact mode's host read of the counts stay the caller's
 * (moe_rt/ep.py EpGroup._prepare_cuda). The launches are those moe_rt/ep.py _PrepCfg and _prep_grid set up
 * before they moved here (tests/test_ep_prepare_core.py compares them in a planning context). Each step plans
 * once per signature (variant, grid, block, shared memory; the context's plan cache), then launches. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define FILE_EP "ep.cu"
#define PREP_THREADS 256      /* the send side's blocks (ep_prepare_send, ep_prepare_direct) and the received side's */
#define PREP_FUSED_SMEM (40 * 1024) /* ep_prepare_plan's shared memory must fit; larger R*L take ep_prepare_recv */
#define PREP_MAX_CHUNKS 64    /* chunks per destination, at most (each item sums the counts of the chunks before) */
#define PREP_MIN_CHUNK 128    /* tokens of a chunk, at least (below, the blocks do too little) */
#define PREP_MAX_CHUNK 8192   /* tokens of a chunk, at most (shared memory: one int each) */
#define PREP_MAX_RANKS 65536
#define PREP_MAX_TOPK 1024

enum { P_DIRECT = 1, P_SEND, P_META, P_PLAN, P_RECV };

typedef struct prep_key {
  int64_t op, step, R, me, L, E, Tmax, K, P, A, T, cap, rows, N, idx, direct;
} prep_key;

#define BAD(...) mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, __VA_ARGS__)

/* ---- sizes ------------------------------------------------------------------------------------------ */

static int64_t plan_smem(int64_t R, int64_t L) { return 4 * (2 * R + 1 + R * (L + 2) + 4 * L + 1); }

static void sizes_of(const moe_rt_ep_prepare_desc* d, moe_rt_ep_prepare_sizes* s) {
  const moe_rt_ep_handle_desc* h = &d->handle;
  const int64_t T = d->num_tokens, R = h->num_ranks, L = h->num_local_experts;
  int64_t B = mrt_max(mrt_max(1, mrt_min(PREP_MAX_CHUNKS, mrt_cdiv(T, PREP_MIN_CHUNK))), mrt_cdiv(T, PREP_MAX_CHUNK));
  const int64_t per = mrt_cdiv(T, B);
  s->chunk_tokens = mrt_max(32, mrt_cdiv(per, 32) * 32);
  s->num_chunks = B = mrt_max(1, mrt_cdiv(T, s->chunk_tokens)); /* no chunk left empty by the rounding */
  s->part_words = R * B * (L + 1);
  s->segment_words = (L + 2) + (int64_t)h->pair_capacity * (2 * h->topk + 1);
  s->fused = plan_smem(R, L) <= PREP_FUSED_SMEM;
  s->whole = d->direct && d->capacity >= 0 && s->fused;
}

static moe_rt_status check_desc(const char* op, const moe_rt_ep_prepare_desc* d) {
  moe_rt_status st;
  if ((st = mrt_check_ptr(op, "desc", d))) return st;
  const moe_rt_ep_handle_desc* h = &d->handle;
  if (h->num_ranks < 1 || h->num_ranks > PREP_MAX_RANKS)
    return BAD("%s: desc->handle.num_ranks must be in [1, %d], got %d", op, PREP_MAX_RANKS, h->num_ranks);
  if (d->rank < 0 || d->rank >= h->num_ranks)
    return BAD("%s: desc->rank must be in [0, %d), got %d", op, h->num_ranks, d->rank);
  if (h->num_local_experts < 1 || (int64_t)h->num_local_experts * h->num_ranks != d->num_experts)
    return BAD("%s: desc->num_experts must be num_ranks * num_local_experts = %d * %d >= 1, got %d", op,
               h->num_ranks, h->num_local_experts, d->num_experts);
  if (h->max_tokens_per_rank < 1) return BAD("%s: desc->handle.max_tokens_per_rank must be >= 1, got %d", op,
                                             h->max_tokens_per_rank);
  if (h->topk < 1 || h->topk > PREP_MAX_TOPK)
    return BAD("%s: desc->handle.topk must be in [1, %d], got %d", op, PREP_MAX_TOPK, h->topk);
  if (h->pair_capacity < 1) return BAD("%s: desc->handle.pair_capacity must be >= 1, got %d", op, h->pair_capacity);
  if (d->num_tokens < 0 || d->num_tokens > h->max_tokens_per_rank)
    return BAD("%s: desc->num_tokens must be in [0, max_tokens_per_rank=%d], got %lld", op, h->max_tokens_per_rank,
               (long long)d->num_tokens);
  if (d->align_size < 1 || d->align_size > (1 << 20))
    return BAD("%s: desc->align_size must be in [1, 2^20], got %d", op, d->align_size);
  if (d->idx_dtype != MOE_RT_INT32 && d->idx_dtype != MOE_RT_INT64)
    return BAD("%s: desc->idx_dtype: expected MOE_RT_INT32 or MOE_RT_INT64, got %s (%d)", op,
               mrt_dtype_name(d->idx_dtype), d->idx_dtype);
  if (d->direct != 0 && d->direct != 1) return BAD("%s: desc->direct must be 0 or 1, got %d", op, d->direct);
  if (d->capacity < -1 || d->capacity >= ((int64_t)1 << 31))
    return BAD("%s: desc->capacity must be -1 (exact mode) or in [0, 2^31), got %lld", op, (long long)d->capacity);
  const int64_t RP = (int64_t)h->num_ranks * h->pair_capacity;
  if (h->recv_rows < 0 || h->recv_rows > RP || h->num_rows < 0 || h->num_rows >= ((int64_t)1 << 31) ||
      h->recv_rows * h->topk >= ((int64_t)1 << 31))
    return BAD("%s: desc->handle: recv_rows must be in [0, num_ranks*pair_capacity=%lld] and num_rows, "
               "recv_rows*topk below 2^31, got %lld and %lld", op, (long long)RP, (long long)h->recv_rows,
               (long long)h->num_rows);
  if (d->capacity >= 0 && h->recv_rows != RP)
    return BAD("%s: desc->handle.recv_rows must be num_ranks*pair_capacity = %lld in capacity mode, got %lld", op,
               (long long)RP, (long long)h->recv_rows);
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_ep_prepare_sizes_of(const moe_rt_ep_prepare_desc* desc, moe_rt_ep_prepare_sizes* out) {
  static const char op[] = "moe_rt_ep_prepare_sizes_of";
  mrt_clear_error();
  moe_rt_status st;
  if ((st = check_desc(op, desc)) || (st = mrt_check_ptr(op, "out", out))) return st;
  sizes_of(desc, out);
  return MOE_RT_SUCCESS;
}

/* ---- planning ------------------------------------------------------------------------------------- */

static prep_key key_of(int step, const moe_rt_ep_prepare_desc* d) {
  prep_key k;
  memset(&k, 0, sizeof k);
  const moe_rt_ep_handle_desc* h = &d->handle;
  k.op = 0x70726570; /* this file's plans in the context's cache */
  k.step = step;
  k.R = h->num_ranks;
  k.me = d->rank;
  k.L = h->num_local_experts;
  k.E = d->num_experts;
  k.Tmax = h->max_tokens_per_rank;
  k.K = h->topk;
  k.P = h->pair_capacity;
  k.A = d->align_size;
  k.T = d->num_tokens;
  k.cap = d->capacity;
  k.rows = h->recv_rows;
  k.N = h->num_rows;
  k.idx = d->idx_dtype;
  k.direct = d->direct;
  return k;
}

/* Blocks of PREP_THREADS for the received side over n items: ep_prepare_plan's blocks each derive the offsets
 * of every (source, local expert) first, so at most two per SM; ep_prepare_recv's at most eight per SM. */
static int64_t recv_grid(const moe_rt_context* ctx, int fused, int64_t n) {
  const int64_t sm = mrt_device(ctx)->sm_count;
  if (!fused && n <= 0) return 0;
  return mrt_max(1, mrt_min(mrt_cdiv(n, PREP_THREADS), (fused ? 2 : 8) * sm));
}

/* A grid-synchronized send side: its smem (the ranking warps' L ints each, the chunk's TC, the chunks-before
 * prefix's L, then the chunk's TC box rows of 2K + 1 ints where they fit: the kernel stages the rows there when
 * its dynamic shared memory holds them), warps and grid
 * (at most one resident wave, at most 2 blocks per SM, at most `work` blocks). */
static moe_rt_status plan_send(moe_rt_context* ctx, mrt_launch* l, const moe_rt_ep_prepare_desc* d,
                               const moe_rt_ep_prepare_sizes* s, int whole) {
  const moe_rt_device_info* dev = mrt_device(ctx);
  const int64_t L = d->handle.num_local_experts, TC = s->chunk_tokens;
  const char* ic = d->idx_dtype == MOE_RT_INT32 ? "int" : "long long";
  snprintf(l->name, sizeof l->name, "%s<%s>", whole ? "ep_prepare_direct" : "ep_prepare_send", ic);
  l->kind = whole ? P_DIRECT : P_SEND;
  const int64_t room = mrt_max(48 * 1024, dev->smem_per_block_optin) - 1024;
  const int64_t nw = mrt_max(1, mrt_min(PREP_THREADS / 32, (room - 4 * TC - 4 * L) / (4 * L)));
  int64_t send_smem = 4 * (L * (nw + 1) + TC);
  const int64_t stage = 4 * TC * (2 * (int64_t)d->handle.topk + 1); /* the chunk's box rows, staged where they fit */
  if (send_smem + stage <= room) send_smem += stage;
  l->smem = (int32_t)(whole ? mrt_max(send_smem, plan_smem(d->handle.num_ranks, L)) : send_smem);
  l->block = PREP_THREADS;
  l->arg[0] = nw;
  int regs = 0;
  int64_t resident = 0;
  moe_rt_status st = mrt_kernel(ctx, l, FILE_EP, &regs);
  if (!st) st = mrt_resident_blocks_smem(ctx, l, PREP_THREADS, l->smem, regs, &resident);
  int64_t work = d->handle.num_ranks * s->num_chunks;
  if (whole) work = mrt_max(work, recv_grid(ctx, 1, mrt_max(d->handle.recv_rows, d->handle.num_rows)));
  l->grid = mrt_max(1, mrt_min(mrt_min(work, 2 * (int64_t)dev->sm_count), resident));
  return st;
}

static moe_rt_status plan_step(moe_rt_context* ctx, int step, const moe_rt_ep_prepare_desc* d,
                               const moe_rt_ep_prepare_sizes* s, mrt_plan* p) {
  const prep_key k = key_of(step, d);
  if (mrt_plan_lookup(ctx, &k, sizeof k, p)) return MOE_RT_SUCCESS;
  moe_rt_status st = MOE_RT_SUCCESS;
  mrt_launch* l = &p->launch[0];
  int regs = 0;
  const int64_t R = d->handle.num_ranks, L = d->handle.num_local_experts;
  const int64_t n = mrt_max(d->handle.recv_rows, d->handle.num_rows);
  p->num_launches = 1;
  if (step == P_SEND) {
    st = plan_send(ctx, l, d, s, s->whole);
  } else if (step == P_META) {
    snprintf(l->name, sizeof l->name, "ep_plan_meta");
    l->kind = P_META;
    st = mrt_kernel(ctx, l, FILE_EP, &regs);
    l->grid = 1;
    l->block = 32;
  } else if (s->fused) {
    snprintf(l->name, sizeof l->name, "ep_prepare_plan");
    l->kind = P_PLAN;
    st = mrt_kernel(ctx, l, FILE_EP, &regs);
    l->grid = recv_grid(ctx, 1, mrt_max(n, d->capacity >= 0 ? 0 : R * d->handle.pair_capacity));
    l->block = PREP_THREADS;
    l->smem = (int32_t)plan_smem(R, L);
  } else {
    snprintf(l->name, sizeof l->name, "ep_prepare_recv");
    l->kind = P_RECV;
    st = mrt_kernel(ctx, l, FILE_EP, &regs);
    l->grid = recv_grid(ctx, 0, mrt_max(n, d->capacity >= 0 ? 0 : R * d->handle.pair_capacity));
    l->block = PREP_THREADS;
    l->smem = (int32_t)(4 * (2 * R + 1));
    /* then the permutation plan of recv_local: rows x K slots over L experts */
    if (!st) st = mrt_plan_kernels(ctx, MOE_RT_INT32, d->handle.recv_rows * d->handle.topk, (int)L, &p->launch[1]);
    p->num_launches = 4;
  }
  if (st) return st;
  mrt_plan_put(ctx, &k, sizeof k, p);
  return MOE_RT_SUCCESS;
}

/* desc's num_rows against the plan of recv_rows x topk slots over L experts keeping num_out. */
static moe_rt_status check_rows(const char* op, const moe_rt_ep_prepare_desc* d, int64_t num_out) {
  const moe_rt_ep_handle_desc* h = &d->handle;
  int64_t N = 0;
  moe_rt_status st = moe_rt_plan_num_rows(h->recv_rows, h->topk, h->num_local_experts, d->align_size, num_out, &N);
  if (st) return st;
  if (N != h->num_rows)
    return BAD("%s: desc->handle.num_rows must be the plan's %lld rows, got %lld", op, (long long)N,
               (long long)h->num_rows);
  return MOE_RT_SUCCESS;
}

/* ---- execution ------------------------------------------------------------------------------------ */

typedef struct prep_regions {
  char* at[MOE_RT_EP_NUM_REGIONS];
} prep_regions;

static moe_rt_status begin(moe_rt_context* ctx, const char* op, const moe_rt_ep_prepare_desc* d,
                           const moe_rt_ep_prepare_buffers* b, moe_rt_ep_prepare_sizes* s, prep_regions* r,
                           unsigned long long* err) {
  moe_rt_status st;
  mrt_clear_error();
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_desc(op, d)) || (st = mrt_check_ptr(op, "bufs", b)) ||
      (st = mrt_check_ptr(op, "bufs->handle", b->handle)))
    return st;
  sizes_of(d, s);
  if (d->direct && (!b->state || !b->inbox))
    return BAD("%s: bufs->state and bufs->inbox (the direct transport's box) are NULL", op);
  if (!d->direct && !b->inbox) return BAD("%s: bufs->inbox is NULL", op);
  if (!mrt_aligned16(b->handle)) return BAD("%s: bufs->handle must be 16-byte aligned", op);
  moe_rt_ep_handle_desc lay = d->handle;
  moe_rt_ep_handle_layout(&lay);
  for (int i = 0; i < MOE_RT_EP_NUM_REGIONS; ++i) r->at[i] = (char*)b->handle + lay.offset[i];
  *err = (unsigned long long)(uintptr_t)b->error_word;
  if (!*err && (st = mrt_error_word(ctx, err))) return st;
  return MOE_RT_SUCCESS;
}

/* The receiving kernels' leading arguments: the meta region; where they find the segments (the inbox, its segment
 * stride, the state, the half); R, rank, P. */
static void receiving_args(const moe_rt_ep_prepare_desc* d, const moe_rt_ep_prepare_sizes* s,
                           const moe_rt_ep_prepare_buffers* b, const prep_regions* r, mrt_args* a) {
  mrt_arg_ptr(a, r->at[MOE_RT_EP_META]);
  mrt_arg_ptr(a, b->inbox);
  mrt_arg_i64(a, s->segment_words);
  mrt_arg_ptr(a, d->direct ? b->state : NULL);
  mrt_arg_i64(a, d->direct ? d->handle.num_ranks * s->segment_words : 0);
  mrt_arg_i32(a, d->handle.num_ranks);
  mrt_arg_i32(a, d->rank);
  mrt_arg_i32(a, d->handle.pair_capacity);
}

static void recv_region_args(const prep_regions* r, int all, mrt_args* a) {
  static const int regions[7] = {MOE_RT_EP_RECV_TOK,  MOE_RT_EP_RECV_LOCAL,     MOE_RT_EP_DST_ROW,
                                 MOE_RT_EP_SRC_SLOT,  MOE_RT_EP_SEG_START,      MOE_RT_EP_EXPERT_COUNTS,
                                 MOE_RT_EP_TOKENS_PER_EXPERT};
  for (int i = 0; i < (all ? 7 : 2); ++i) mrt_arg_ptr(a, r->at[regions[i]]);
}

moe_rt_status moe_rt_ep_prepare_send(moe_rt_context* ctx, const moe_rt_ep_prepare_desc* d,
                                     const moe_rt_ep_prepare_buffers* b, moe_rt_stream stream) {
  static const char op[] = "moe_rt_ep_prepare_send";
  moe_rt_ep_prepare_sizes s;
  prep_regions r;
  unsigned long long err = 0;
  moe_rt_status st = begin(ctx, op, d, b, &s, &r, &err);
  if (st) return st;
  const moe_rt_ep_handle_desc* h = &d->handle;
  if (d->num_tokens > 0 && (st = mrt_check_ptr(op, "bufs->topk_idx", b->topk_idx))) return st;
  if ((st = mrt_check_ptr(op, "bufs->part", b->part)) || (st = mrt_check_ptr(op, "bufs->grid_sync", b->grid_sync)))
    return st;
  if (d->direct && !b->peer_box) return BAD("%s: bufs->peer_box (the direct transport's box table) is NULL", op);
  if (!d->direct && h->num_ranks > 1 && !b->outbox) return BAD("%s: bufs->outbox is NULL (NCCL, R > 1)", op);
  if (s.whole && (!b->peer_barrier || !b->timeout_word || b->timeout_ns < 1))
    return BAD("%s: the whole prepare (ep_prepare_direct) needs bufs->peer_barrier, bufs->timeout_word and "
               "bufs->timeout_ns > 0", op);
  if (s.whole && (st = check_rows(op, d, d->capacity))) return st;
  mrt_plan p;
  if ((st = plan_step(ctx, P_SEND, d, &s, &p))) return st;
  const mrt_launch* l = &p.launch[0];
  mrt_args a;
  memset(&a, 0, sizeof a);
  mrt_arg_ptr(&a, b->topk_idx);
  mrt_arg_i64(&a, d->num_tokens);
  mrt_arg_i32(&a, h->max_tokens_per_rank);
  mrt_arg_i32(&a, h->topk);
  mrt_arg_i32(&a, d->num_experts);
  mrt_arg_i32(&a, h->num_ranks);
  mrt_arg_i32(&a, d->rank);
  mrt_arg_i32(&a, h->num_local_experts);
  mrt_arg_i32(&a, h->pair_capacity);
  mrt_arg_i32(&a, (int32_t)s.chunk_tokens);
  mrt_arg_i32(&a, (int32_t)s.num_chunks);
  mrt_arg_ptr(&a, r.at[MOE_RT_EP_ROUTING]);
  mrt_arg_ptr(&a, r.at[MOE_RT_EP_SEND_TOK]);
  mrt_arg_ptr(&a, r.at[MOE_RT_EP_SEND_POS]);
  mrt_arg_ptr(&a, r.at[MOE_RT_EP_META]);
  const int64_t half = d->direct ? h->num_ranks * s.segment_words : 0;
  mrt_arg_ptr(&a, d->direct ? b->state : NULL);
  mrt_arg_i64(&a, half);
  mrt_arg_ptr(&a, d->direct ? b->peer_box : NULL);
  if (!s.whole) {
    mrt_arg_ptr(&a, d->direct ? NULL : h->num_ranks > 1 ? b->outbox : b->inbox);
    mrt_arg_ptr(&a, d->direct ? NULL : b->inbox);
  }
  mrt_arg_ptr(&a, (const void*)(uintptr_t)err);
  mrt_arg_i32(&a, (int32_t)l->arg[0]);
  mrt_arg_ptr(&a, b->part);
  mrt_arg_ptr(&a, b->grid_sync);
  if (s.whole) {
    mrt_arg_ptr(&a, b->peer_barrier);
    mrt_arg_i64(&a, b->timeout_ns);
    mrt_arg_ptr(&a, b->timeout_word);
    mrt_arg_i32(&a, MOE_RT_EP_OP_PREPARE);
    mrt_arg_i32(&a, d->align_size);
    mrt_arg_i64(&a, d->capacity);
    mrt_arg_i64(&a, h->recv_rows);
    mrt_arg_i64(&a, h->num_rows);
    recv_region_args(&r, 1, &a);
  }
  return mrt_run_plan(ctx, &p, &a, stream);
}

moe_rt_status moe_rt_ep_prepare_meta(moe_rt_context* ctx, const moe_rt_ep_prepare_desc* d,
                                     const moe_rt_ep_prepare_buffers* b, moe_rt_stream stream) {
  static const char op[] = "moe_rt_ep_prepare_meta";
  moe_rt_ep_prepare_sizes s;
  prep_regions r;
  unsigned long long err = 0;
  moe_rt_status st = begin(ctx, op, d, b, &s, &r, &err);
  if (st) return st;
  if (d->capacity >= 0) return BAD("%s: exact mode only (desc->capacity -1), got capacity %lld", op,
                                   (long long)d->capacity);
  mrt_plan p;
  if ((st = plan_step(ctx, P_META, d, &s, &p))) return st;
  mrt_args a;
  memset(&a, 0, sizeof a);
  receiving_args(d, &s, b, &r, &a);
  mrt_arg_i32(&a, 1);
  mrt_arg_i64(&a, -1);
  return mrt_run_plan(ctx, &p, &a, stream);
}

moe_rt_status moe_rt_ep_prepare_recv(moe_rt_context* ctx, const moe_rt_ep_prepare_desc* d,
                                     const moe_rt_ep_prepare_buffers* b, moe_rt_stream stream) {
  static const char op[] = "moe_rt_ep_prepare_recv";
  moe_rt_ep_prepare_sizes s;
  prep_regions r;
  unsigned long long err = 0;
  moe_rt_status st = begin(ctx, op, d, b, &s, &r, &err);
  if (st) return st;
  const moe_rt_ep_handle_desc* h = &d->handle;
  if (s.whole) return BAD("%s: capacity mode on the direct transport with a fused received side is one kernel "
                          "(moe_rt_ep_prepare_send made it whole)", op);
  /* the plan of recv_local (rows x K, L experts) keeps the capacity's slots, or in exact mode every one */
  const int64_t num_out = d->capacity >= 0 ? d->capacity : d->total_slots;
  if (d->capacity < 0 && (d->total_slots < 0 || d->total_slots > h->recv_rows * h->topk))
    return BAD("%s: desc->total_slots must be in [0, recv_rows*topk = %lld] in exact mode, got %lld", op,
               (long long)(h->recv_rows * h->topk), (long long)d->total_slots);
  if ((st = check_rows(op, d, num_out))) return st;
  if (!s.fused) {
    size_t need = 0;
    if ((st = moe_rt_make_plan_workspace_size(h->recv_rows, h->topk, h->num_local_experts, &need))) return st;
    if (!b->workspace || b->workspace_bytes < need)
      return BAD("%s: bufs->workspace: need %zu bytes (moe_rt_make_plan_workspace_size), got %zu%s", op, need,
                 b->workspace_bytes, b->workspace ? "" : " (NULL)");
  }
  mrt_plan p;
  if ((st = plan_step(ctx, s.fused ? P_PLAN : P_RECV, d, &s, &p))) return st;
  mrt_args a[4];
  memset(a, 0, sizeof a);
  receiving_args(d, &s, b, &r, &a[0]);
  mrt_arg_i32(&a[0], h->topk);
  mrt_arg_i32(&a[0], h->num_local_experts);
  if (s.fused) mrt_arg_i32(&a[0], d->align_size);
  mrt_arg_i32(&a[0], d->capacity < 0);
  mrt_arg_i64(&a[0], d->capacity);
  mrt_arg_i64(&a[0], h->recv_rows);
  if (s.fused) mrt_arg_i64(&a[0], h->num_rows);
  recv_region_args(&r, s.fused, &a[0]);
  if (!s.fused) {
    moe_rt_plan plan;
    memset(&plan, 0, sizeof plan);
    plan.dst_row = (int32_t*)r.at[MOE_RT_EP_DST_ROW];
    plan.src_slot = (int32_t*)r.at[MOE_RT_EP_SRC_SLOT];
    plan.seg_start = (int32_t*)r.at[MOE_RT_EP_SEG_START];
    plan.counts = (int32_t*)r.at[MOE_RT_EP_EXPERT_COUNTS];
    plan.tokens_per_expert = (int32_t*)r.at[MOE_RT_EP_TOKENS_PER_EXPERT];
    plan.num_rows = h->num_rows;
    mrt_plan_kernel_args(r.at[MOE_RT_EP_RECV_LOCAL], h->recv_rows * h->topk, h->num_local_experts, d->align_size,
                         num_out, &plan, b->workspace, err, &a[1]);
  }
  return mrt_run_plan(ctx, &p, a, stream);
}

/* combine_bwd's weight gradient from the per-slot dots (EpGroup.combine_bwd with y): out[n] = slots[src_slot[n]],
 * 0 where src_slot[n] < 0 (ep_gather_slots; moe_rt/ep.py launched it with this grid and block). */
moe_rt_status moe_rt_ep_gather_slots(moe_rt_context* ctx, const float* slots, const int32_t* src_slot, float* out,
                                     int64_t n, moe_rt_stream stream) {
  static const char op[] = "moe_rt_ep_gather_slots";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op))) return st;
  if (n < 0) return BAD("%s: n must be >= 0, got %lld", op, (long long)n);
  mrt_plan p;
  memset(&p, 0, sizeof p);
  if (n == 0) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  if ((st = mrt_check_ptr(op, "slots", slots)) || (st = mrt_check_ptr(op, "src_slot", src_slot)) ||
      (st = mrt_check_ptr(op, "out", out)))
    return st;
  static const char key[] = "ep_gather_slots"; /* one plan (the kernel), its own key bytes; the grid follows n */
  if (!mrt_plan_lookup(ctx, key, sizeof key, &p)) {
    p.num_launches = 1;
    snprintf(p.launch[0].name, sizeof p.launch[0].name, "ep_gather_slots");
    int regs = 0;
    if ((st = mrt_kernel(ctx, &p.launch[0], FILE_EP, &regs))) return st;
    p.launch[0].block = 256;
    mrt_plan_put(ctx, key, sizeof key, &p);
  }
  p.launch[0].grid = mrt_max(1, mrt_min(mrt_cdiv(n, 256), (int64_t)mrt_device(ctx)->sm_count * 8));
  mrt_args a;
  memset(&a, 0, sizeof a);
  mrt_arg_ptr(&a, slots);
  mrt_arg_ptr(&a, src_slot);
  mrt_arg_ptr(&a, out);
  mrt_arg_i64(&a, n);
  return mrt_run_plan(ctx, &p, &a, stream);
}
