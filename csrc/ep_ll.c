/* moe_rt core: the low-latency expert-parallel ops (kernels/ep.cu: ep_direct_barrier, ep_ll_dispatch,
 * ep_ll_dispatch_fp8, ep_ll_combine, ep_ll_slot_dot) over a group whose shared buffers and peer tables the
 * caller made (moe_rt/ep_ll.py LowLatencyGroup, or a C program). The launches are those moe_rt/ep_ll.py made
 * through its own launch set-ups before they moved here (tests/test_ep_ll_core.py compares them, argument by
 * argument, in a planning context). Each op plans once per signature (kernel variant, grid, block; cached in
 * the group), then launches the barrier and its kernel(s) on the caller's stream (desc.sync
 * MOE_RT_LL_SYNC_PAIRWISE: no barrier, the fused kernels' *_pairwise builds; the mode is the group's, so the plan
 * keys need no field for it). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define FILE_EP "ep.cu"
#define LL_THREADS 512  /* the fused kernels' block (moe_rt._ep_direct._THREADS) */
#define DOT_THREADS 256 /* ep_ll_slot_dot: a warp per slot */
#define LL_MAX_RANKS 65536

enum { K_DISPATCH = 1, K_COMBINE = 2, K_COMBINE_BWD = 3 };

typedef struct ll_key {
  int32_t kind, op, buffer_set, phases, vec, idx64, scaled, fp8, dequant, rows, dot, dot_vec, partials;
} ll_key;

struct moe_rt_ll_group {
  moe_rt_context* ctx;
  moe_rt_ll_group_desc d;
  uint32_t* error_word; /* desc's, or the context's */
  int vec16, vec16_fp8; /* the 16-byte vector paths' conditions that hold for every call */
  mrt_group_plans plans;
  mrt_live live;  /* its entry in the registry of live groups (moe_rt_ll_group_acquire) */
};

static mrt_registry g_registry = MRT_REGISTRY_INIT;

static void group_free(moe_rt_ll_group* g) {
  mrt_group_plans_destroy(&g->plans);
  free(g);
}

/* ---- the group ------------------------------------------------------------------------------------- */

#define BAD(...) mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, __VA_ARGS__)

/* The NCCL transport's fields (check_desc's tail): the communicator's shape, each set's own regions. */
static moe_rt_status check_nccl_desc(const moe_rt_ll_group_desc* d, int planning) {
  static const char op[] = "moe_rt_ll_group_create";
  if (d->num_ranks > 1 && !d->comm)
    return BAD("%s: desc.comm is NULL; the NCCL transport of %d ranks needs the group's communicator", op,
               d->num_ranks);
  if (d->comm && !planning) { /* a planning context's made-up address is checked for NULL only */
    int R = 0, rank = 0;
    mrt_comm_shape(d->comm, &R, &rank);
    if (R != d->num_ranks || rank != d->rank)
      return BAD("%s: desc.comm has %d ranks and this rank at %d, but desc says %d ranks and rank %d", op, R, rank,
                 d->num_ranks, d->rank);
  }
  for (int b = 0; b < d->num_buffers; ++b) {
    const moe_rt_ll_buffer_set* s = &d->set[b];
    const void* need[] = {s->recv, s->gather, s->gather_meta, s->back_send, s->back, s->bw_send, s->bw,
                          d->fp8 ? s->recv_q : (const void*)1, d->fp8 ? (const void*)s->recv_s : (const void*)1,
                          d->fp8 ? s->gather_q : (const void*)1, d->fp8 ? (const void*)s->gather_s : (const void*)1};
    static const char* names[] = {"recv", "gather", "gather_meta", "back_send", "back", "bw_send", "bw",
                                  "recv_q", "recv_s", "gather_q", "gather_s"};
    for (int i = 0; i < 11; ++i)
      if (!need[i]) return BAD("%s: desc.set[%d].%s is NULL%s", op, b, names[i], i >= 7 ? " (an fp8 group)" : "");
    if (!d->fp8 && (s->recv_q || s->recv_s || s->gather_q || s->gather_s))
      return BAD("%s: desc.set[%d]: recv_q, recv_s, gather_q and gather_s must be NULL when desc.fp8 is 0", op, b);
    const void* all[] = {s->recv, s->gather, s->gather_meta, s->back_send, s->back, s->bw_send, s->bw, s->recv_q,
                         s->recv_s, s->gather_q, s->gather_s};
    for (int i = 0; i < 11; ++i)
      if (!mrt_aligned16(all[i])) return BAD("%s: desc.set[%d].%s must be 16-byte aligned", op, b, names[i]);
  }
  return MOE_RT_SUCCESS;
}

static moe_rt_status check_desc(const moe_rt_ll_group_desc* d, int planning) {
  static const char op[] = "moe_rt_ll_group_create";
  const int64_t R = d->num_ranks, L = d->num_local_experts, Tmax = d->max_tokens_per_rank;
  if (R < 1 || R > LL_MAX_RANKS)
    return BAD("%s: desc.num_ranks must be in [1, %d], got %lld", op, LL_MAX_RANKS, (long long)R);
  if (d->rank < 0 || d->rank >= R) return BAD("%s: desc.rank must be in [0, %lld), got %d", op, (long long)R, d->rank);
  if (L < 1) return BAD("%s: desc.num_local_experts must be >= 1, got %lld", op, (long long)L);
  if (Tmax < 1 || Tmax > MOE_RT_LL_MAX_TOKENS)
    return BAD("%s: desc.max_tokens_per_rank must be in [1, %d], got %lld", op, MOE_RT_LL_MAX_TOKENS, (long long)Tmax);
  if (d->topk < 1 || d->topk > MOE_RT_MAX_TOPK)
    return BAD("%s: desc.topk must be in [1, %d], got %d", op, MOE_RT_MAX_TOPK, d->topk);
  if (!mrt_is_float_dtype(d->dtype))
    return BAD("%s: desc.dtype: expected float32, float16 or bfloat16, got %s (%d)", op, mrt_dtype_name(d->dtype),
               d->dtype);
  if (d->hidden < 1 || d->hidden >= ((int64_t)1 << 31))
    return BAD("%s: desc.hidden must be in [1, 2^31), got %lld", op, (long long)d->hidden);
  if ((double)L * (double)R * (double)Tmax * (double)d->hidden >= 4.611686018427388e18)
    return BAD("%s: the receive buffer [L, R*max_tokens_per_rank, hidden] is too large", op);
  if (d->chunk < 1 || d->chunk > Tmax)
    return BAD("%s: desc.chunk must be in [1, max_tokens_per_rank=%lld], got %d", op, (long long)Tmax, d->chunk);
  if (d->num_buffers < 1 || d->num_buffers > MOE_RT_LL_MAX_BUFFERS)
    return BAD("%s: desc.num_buffers must be 1 or 2, got %d", op, d->num_buffers);
  if (d->fp8 != 0 && d->fp8 != 1) return BAD("%s: desc.fp8 must be 0 or 1, got %d", op, d->fp8);
  if (d->fp8 && d->num_scales != mrt_cdiv(d->hidden, MOE_RT_LL_FP8_BLOCK))
    return BAD("%s: desc.num_scales must be ceil(hidden/128) = %lld, got %d", op,
               (long long)mrt_cdiv(d->hidden, MOE_RT_LL_FP8_BLOCK), d->num_scales);
  if (d->dedup != 0 && d->dedup != 1) return BAD("%s: desc.dedup must be 0 or 1, got %d", op, d->dedup);
  if (d->combine_partials != 0 && d->combine_partials != 1)
    return BAD("%s: desc.combine_partials must be 0 or 1, got %d", op, d->combine_partials);
  if (d->sync != MOE_RT_LL_SYNC_BARRIER && d->sync != MOE_RT_LL_SYNC_PAIRWISE)
    return BAD("%s: desc.sync must be MOE_RT_LL_SYNC_BARRIER (0) or MOE_RT_LL_SYNC_PAIRWISE (1), got %d", op, d->sync);
  if (d->timeout_ns < 1) return BAD("%s: desc.timeout_ns must be > 0, got %lld", op, (long long)d->timeout_ns);
  if (d->transport == MOE_RT_LL_TRANSPORT_NCCL) return check_nccl_desc(d, planning);
  if (d->transport != MOE_RT_LL_TRANSPORT_DIRECT)
    return BAD("%s: desc.transport must be MOE_RT_LL_TRANSPORT_DIRECT (0) or MOE_RT_LL_TRANSPORT_NCCL (1), got %d", op,
               d->transport);
  for (int b = 0; b < d->num_buffers; ++b) {
    const moe_rt_ll_buffer_set* s = &d->set[b];
    const void* need[] = {s->recv, s->peer_recv, s->peer_route, s->peer_rw, s->peer_back, s->peer_bw,
                          d->fp8 ? (const void*)s->peer_recv_q : (const void*)1,
                          d->fp8 ? (const void*)s->peer_recv_s : (const void*)1};
    static const char* names[] = {"recv", "peer_recv", "peer_route", "peer_rw", "peer_back", "peer_bw",
                                  "peer_recv_q", "peer_recv_s"};
    for (int i = 0; i < 8; ++i)
      if (!need[i]) return BAD("%s: desc.set[%d].%s is NULL%s", op, b, names[i], i >= 6 ? " (an fp8 group)" : "");
    if (!d->fp8 && (s->peer_recv_q || s->peer_recv_s))
      return BAD("%s: desc.set[%d]: peer_recv_q and peer_recv_s must be NULL when desc.fp8 is 0", op, b);
  }
  const void* need[] = {d->peer_flags, d->peer_barrier, d->barrier_state, d->timeout_word, d->set_epoch};
  static const char* names[] = {"peer_flags", "peer_barrier", "barrier_state", "timeout_word", "set_epoch"};
  for (int i = 0; i < 5; ++i)
    if (!need[i]) return BAD("%s: desc.%s is NULL", op, names[i]);
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_ll_group_create(moe_rt_context* ctx, const moe_rt_ll_group_desc* desc, moe_rt_ll_group** out) {
  static const char op[] = "moe_rt_ll_group_create";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = mrt_check_ptr(op, "out", out))) return st;
  *out = NULL;
  if ((st = mrt_check_ptr(op, "desc", desc)) || (st = check_desc(desc, mrt_is_planning(ctx)))) return st;
  unsigned long long word = (unsigned long long)(uintptr_t)desc->error_word;
  if (!word && (st = mrt_error_word(ctx, &word))) return st;
  moe_rt_ll_group* g = calloc(1, sizeof *g);
  if (!g) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: out of host memory", op);
  g->ctx = ctx;
  g->d = *desc;
  for (int b = desc->num_buffers; b < MOE_RT_LL_MAX_BUFFERS; ++b) memset(&g->d.set[b], 0, sizeof g->d.set[b]);
  g->error_word = (uint32_t*)(uintptr_t)word;
  const int local_aligned = mrt_aligned16(desc->set[0].recv);
  g->vec16 = (desc->hidden * mrt_dtype_size(desc->dtype)) % 16 == 0 && local_aligned;
  g->vec16_fp8 = desc->hidden % 16 == 0 && local_aligned;
  mrt_group_plans_init(&g->plans);
  if (!mrt_registry_add(&g_registry, g, &g->live)) {
    group_free(g);
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: out of host memory (the registry of live groups)", op);
  }
  *out = g;
  return MOE_RT_SUCCESS;
}

void moe_rt_ll_group_destroy(moe_rt_ll_group* g) {
  if (g && mrt_registry_remove(&g_registry, g, &g->live)) group_free(g); /* held: the last release frees */
}

int64_t moe_rt_ll_group_serial(const moe_rt_ll_group* g) { return g ? g->live.serial : 0; }

moe_rt_status moe_rt_ll_group_acquire(int64_t address, int64_t serial, moe_rt_ll_group** out) {
  static const char op[] = "moe_rt_ll_group_acquire";
  mrt_clear_error();
  if (!out) return BAD("%s: out is NULL", op);
  *out = NULL;
  moe_rt_ll_group* found = mrt_registry_acquire(&g_registry, address, serial);
  if (!found)
    return BAD("%s: no live low-latency group at address 0x%llx with serial %lld: it was destroyed (the "
               "LowLatencyGroup was closed) or never made in this process", op, (unsigned long long)address,
               (long long)serial);
  *out = found;
  return MOE_RT_SUCCESS;
}

void moe_rt_ll_group_release(moe_rt_ll_group* g) {
  if (g && mrt_registry_release(&g_registry, &g->live)) group_free(g);
}

moe_rt_status moe_rt_ll_group_get_desc(const moe_rt_ll_group* g, moe_rt_ll_group_desc* out) {
  mrt_clear_error();
  if (!g) return BAD("moe_rt_ll_group_get_desc: group is NULL");
  if (!out) return BAD("moe_rt_ll_group_get_desc: out is NULL");
  *out = g->d;
  return MOE_RT_SUCCESS;
}

/* ---- planning ------------------------------------------------------------------------------------- */

static moe_rt_status plan_barrier(moe_rt_ll_group* g, mrt_launch* l) {
  snprintf(l->name, sizeof l->name, "ep_direct_barrier");
  int regs = 0;
  moe_rt_status st = mrt_kernel(g->ctx, l, FILE_EP, &regs);
  if (st) return st;
  l->grid = 1;
  l->block = (int32_t)mrt_max(32, mrt_cdiv(g->d.num_ranks, 32) * 32);
  return MOE_RT_SUCCESS;
}

/* A fused kernel (its blocks wait on each other's peers): loaded, and its most resident blocks in *resident. */
static moe_rt_status plan_fused(moe_rt_ll_group* g, mrt_launch* l, int64_t* resident) {
  int regs = 0;
  moe_rt_status st = mrt_kernel(g->ctx, l, FILE_EP, &regs);
  if (st) return st;
  l->block = LL_THREADS;
  return mrt_resident_blocks(g->ctx, l, LL_THREADS, regs, resident);
}

/* desc.sync MOE_RT_LL_SYNC_PAIRWISE: no barrier launch; the fused kernels' pairwise builds. */
static int pairwise(const moe_rt_ll_group* g) { return g->d.sync == MOE_RT_LL_SYNC_PAIRWISE; }

static const char* idx_ctype(int idx64) { return idx64 ? "long long" : "int"; }

/* The dispatch-direction launch (ep_ll_dispatch or ep_ll_dispatch_fp8). */
static moe_rt_status plan_push(moe_rt_ll_group* g, const ll_key* k, mrt_launch* l) {
  snprintf(l->name, sizeof l->name, "%s%s<%s, %s, %s>", k->fp8 ? "ep_ll_dispatch_fp8" : "ep_ll_dispatch",
           pairwise(g) ? "_pairwise" : "", mrt_ctype(g->d.dtype), idx_ctype(k->idx64), k->vec ? "true" : "false");
  int64_t resident = 0;
  moe_rt_status st = plan_fused(g, l, &resident);
  if (st) return st;
  const int64_t work = mrt_max(mrt_cdiv(g->d.max_tokens_per_rank, g->d.chunk), g->d.num_local_experts);
  l->grid = mrt_max(1, mrt_min(work, resident));
  l->kind = K_DISPATCH;
  return MOE_RT_SUCCESS;
}

/* ep_ll_combine: arg[0] = most resident blocks, arg[1] = owner items per token; the grid follows T. */
static moe_rt_status plan_combine(moe_rt_ll_group* g, const ll_key* k, mrt_launch* l) {
  snprintf(l->name, sizeof l->name, "ep_ll_combine%s<%s, %s, %s>", pairwise(g) ? "_pairwise" : "",
           mrt_ctype(g->d.dtype), k->vec ? "true" : "false", k->partials ? "true" : "false");
  int64_t resident = 0;
  moe_rt_status st = plan_fused(g, l, &resident);
  if (st) return st;
  /* owner items: (token, slice of LL_THREADS 16-byte vectors of its row) */
  const int64_t nv = k->vec ? g->d.hidden / (16 / mrt_dtype_size(g->d.dtype)) : g->d.hidden;
  l->arg[0] = resident;
  l->arg[1] = k->rows ? mrt_cdiv(nv, LL_THREADS) : 1;
  l->kind = K_COMBINE;
  return MOE_RT_SUCCESS;
}

static int64_t combine_grid(const moe_rt_ll_group* g, const mrt_launch* l, int64_t T) {
  const int64_t work = mrt_cdiv(g->d.max_tokens_per_rank, g->d.chunk) * g->d.num_ranks;
  return mrt_max(1, mrt_min(mrt_max(work, T * l->arg[1]), l->arg[0]));
}

static moe_rt_status plan_dot(moe_rt_ll_group* g, const ll_key* k, mrt_launch* l) {
  snprintf(l->name, sizeof l->name, "ep_ll_slot_dot<%s, %s>", mrt_ctype(g->d.dtype), k->dot_vec ? "true" : "false");
  int regs = 0;
  moe_rt_status st = mrt_kernel(g->ctx, l, FILE_EP, &regs);
  if (st) return st;
  const int64_t n = (int64_t)g->d.num_local_experts * g->d.num_ranks * g->d.max_tokens_per_rank;
  l->block = DOT_THREADS;
  l->grid = mrt_max(1, mrt_min(mrt_cdiv(n, 8), (int64_t)mrt_device(g->ctx)->sm_count * 8));
  return MOE_RT_SUCCESS;
}

/* The plan of key k (cached in the group): launch 0 the barrier (where the op has one: not in pairwise mode),
 * then the kernels. */
static moe_rt_status plan_of(moe_rt_ll_group* g, const ll_key* k, mrt_plan* p) {
  if (mrt_group_plan_get(&g->plans, k, sizeof *k, p)) return MOE_RT_SUCCESS;
  memset(p, 0, sizeof *p);
  moe_rt_status st = MOE_RT_SUCCESS;
  int n = 0;
  if (!pairwise(g) && (k->kind != K_DISPATCH || (k->phases & MOE_RT_LL_PUSH))) st = plan_barrier(g, &p->launch[n++]);
  if (!st && k->kind != K_COMBINE) st = plan_push(g, k, &p->launch[n++]);
  if (!st && k->kind == K_COMBINE) st = plan_combine(g, k, &p->launch[n++]);
  if (!st && k->kind == K_COMBINE_BWD && k->dot) st = plan_dot(g, k, &p->launch[n++]);
  if (st) return st;
  p->num_launches = n;
  mrt_group_plan_put(&g->plans, k, sizeof *k, p);
  return MOE_RT_SUCCESS;
}

/* ---- execution ------------------------------------------------------------------------------------ */

static void barrier_args(const moe_rt_ll_group* g, int op, mrt_args* a) {
  const moe_rt_ll_group_desc* d = &g->d; /* the node's ranks: all of them */
  mrt_barrier_args(a, d->peer_barrier, d->num_ranks, d->rank, d->barrier_state, d->timeout_ns, d->timeout_word, op, 0,
                   d->num_ranks);
}

/* The pairwise builds' last arguments: the barrier slots' peer table (the announces) and the block count. */
static void pairwise_args(const moe_rt_ll_group* g, mrt_args* a) {
  mrt_arg_ptr(a, g->d.peer_barrier);
  mrt_arg_ptr(a, g->d.set_epoch + g->d.num_buffers);
}

/* The arguments every fused kernel ends with, from op to C: op, R, me, L, Tmax, K (then C). */
static void sizes_args(const moe_rt_ll_group* g, int op, mrt_args* a) {
  const moe_rt_ll_group_desc* d = &g->d;
  mrt_arg_i32(a, op);
  mrt_arg_i32(a, d->num_ranks);
  mrt_arg_i32(a, d->rank);
  mrt_arg_i32(a, d->num_local_experts);
  mrt_arg_i32(a, d->max_tokens_per_rank);
  mrt_arg_i32(a, d->topk);
}

static moe_rt_status check_call(const moe_rt_ll_group* g, const char* op, int buffer_set, int64_t T) {
  mrt_clear_error();
  if (!g) return BAD("%s: group is NULL; make one with moe_rt_ll_group_create", op);
  if (buffer_set < 0 || buffer_set >= g->d.num_buffers)
    return BAD("%s: buffer_set must be in [0, num_buffers=%d), got %d", op, g->d.num_buffers, buffer_set);
  if (T < 0 || T > g->d.max_tokens_per_rank)
    return BAD("%s: num_tokens must be in [0, max_tokens_per_rank=%d], got %lld", op, g->d.max_tokens_per_rank,
               (long long)T);
  return MOE_RT_SUCCESS;
}

/* The dispatch direction's kernel arguments (ep_ll_dispatch or ep_ll_dispatch_fp8, as k->fp8 says). Token
 * pointers are 0 for T = 0, as the handle's idx and w tables. */
typedef struct push_args {
  const void *x, *xq, *xs, *idx, *w;
  const moe_rt_ll_tables* out; /* NULL: none (combine_bwd) */
  const void *zero_k, *recv_route;
  int meta, scaled, op;
} push_args;

static void push_kernel_args(const moe_rt_ll_group* g, const ll_key* k, const push_args* q, int64_t T, mrt_args* a) {
  const moe_rt_ll_group_desc* d = &g->d;
  const moe_rt_ll_buffer_set* s = &d->set[k->buffer_set];
  const moe_rt_ll_tables none = {0};
  const moe_rt_ll_tables* o = q->out ? q->out : &none;
  mrt_arg_ptr(a, T ? q->x : NULL);
  if (k->fp8) {
    mrt_arg_ptr(a, T ? q->xq : NULL);
    mrt_arg_ptr(a, T ? q->xs : NULL);
  }
  mrt_arg_ptr(a, T ? q->idx : NULL);
  mrt_arg_ptr(a, T ? q->w : NULL);
  mrt_arg_i32(a, (int32_t)T);
  if (!k->fp8) {
    mrt_arg_i32(a, q->meta);
    mrt_arg_i32(a, q->scaled);
    mrt_arg_i32(a, d->dedup && !q->scaled);
  }
  mrt_arg_ptr(a, s->peer_recv);
  if (k->fp8) {
    mrt_arg_ptr(a, s->peer_recv_q);
    mrt_arg_ptr(a, s->peer_recv_s);
  }
  mrt_arg_ptr(a, s->peer_route);
  mrt_arg_ptr(a, s->peer_rw);
  mrt_arg_ptr(a, d->peer_flags);
  mrt_arg_ptr(a, T ? o->idx : NULL);
  mrt_arg_ptr(a, T ? o->w : NULL);
  mrt_arg_ptr(a, o->route);
  mrt_arg_ptr(a, o->slot_k);
  mrt_arg_ptr(a, o->slot_w);
  mrt_arg_ptr(a, o->counts);
  if (k->fp8) {
    mrt_arg_i32(a, k->dequant);
    mrt_arg_i32(a, d->dedup);
  } else {
    mrt_arg_ptr(a, q->zero_k);
    mrt_arg_ptr(a, q->recv_route);
  }
  mrt_arg_ptr(a, g->error_word);
  mrt_arg_ptr(a, d->barrier_state);
  mrt_arg_ptr(a, d->timeout_word);
  mrt_arg_i64(a, d->timeout_ns);
  sizes_args(g, q->op, a);
  mrt_arg_i32(a, d->chunk);
  mrt_arg_i64(a, d->hidden);
  if (k->fp8) mrt_arg_i32(a, d->num_scales);
  mrt_arg_i32(a, k->phases);
  mrt_arg_i64(a, (int64_t)2 * d->num_ranks * d->max_tokens_per_rank * k->buffer_set);
  mrt_arg_ptr(a, k->phases != (MOE_RT_LL_PUSH | MOE_RT_LL_RECEIVE) ? (const void*)(d->set_epoch + k->buffer_set)
                                                                  : NULL);
  if (pairwise(g)) pairwise_args(g, a);
}

/* ---- the NCCL transport (desc.transport MOE_RT_LL_TRANSPORT_NCCL) ----------------------------------------- */
/* Each op is its launches with one NCCL exchange of fixed size between them (kernels/ep.cu: ep_ll_nccl_*):
 * dispatch: ep_ll_nccl_pack, the all-gather of the gather regions, ep_ll_nccl_expand (a split dispatch: the
 * push is the pack and the all-gather, the receive the expand); combine_bwd: the pack of grad_out's rows, their
 * all-gather, the expand's MODE 3, ep_ll_slot_dot with expert_out; the combine direction: ep_ll_nccl_reduce,
 * the grouped send/recv of the back regions, ep_ll_nccl_owner. No barrier, epoch or flag: NCCL orders the
 * collectives of the ranks, and every buffer is written and read in this rank's stream order. */

#define NL_PACK_THREADS 512
#define NL_THREADS 256    /* ep_ll_nccl_expand, _reduce, _owner: NL_WARPS warps */
#define NL_PACK_TOKENS 4  /* kernels/ep.cu's */
#define NL_SLICE 128      /* units of a row one warp moves (kernels/ep.cu's NL_SLICE) */

enum { K_NL_DISPATCH = 4, K_NL_COMBINE = 5, K_NL_COMBINE_BWD = 6 };
enum { NL_META = 1, NL_ROWS = 2, NL_CODES = 4 }; /* what an all-gather moves */

static int nccl_transport(const moe_rt_ll_group* g) { return g->d.transport == MOE_RT_LL_TRANSPORT_NCCL; }

static int64_t nl_meta_words(const moe_rt_ll_group_desc* d) {
  return 4 + (int64_t)2 * d->max_tokens_per_rank * d->topk;
}

/* Slices of a row of H elements in units of `unit` elements (the kernels' ns). */
static int64_t nl_slices(int64_t H, int unit) { return mrt_cdiv(H / unit, NL_SLICE); }

static moe_rt_status nl_plan_kernel(moe_rt_ll_group* g, mrt_launch* l, int block) {
  int regs = 0;
  moe_rt_status st = mrt_kernel(g->ctx, l, FILE_EP, &regs);
  l->block = block;
  return st;
}

/* A grid of warp items (NL_THREADS / 32 a block), at most 8 blocks a multiprocessor. */
static int64_t nl_grid(const moe_rt_ll_group* g, int64_t items) {
  return mrt_max(1, mrt_min(mrt_cdiv(items, NL_THREADS / 32), (int64_t)mrt_device(g->ctx)->sm_count * 8));
}

static moe_rt_status nl_plan_pack(moe_rt_ll_group* g, int idx64, int vec, int fp8, mrt_launch* l) {
  snprintf(l->name, sizeof l->name, "ep_ll_nccl_pack<%s, %s, %s, %s>", mrt_ctype(g->d.dtype), idx_ctype(idx64),
           vec ? "true" : "false", fp8 ? "true" : "false");
  moe_rt_status st = nl_plan_kernel(g, l, NL_PACK_THREADS);
  l->grid = mrt_cdiv(g->d.max_tokens_per_rank, NL_PACK_TOKENS);
  return st;
}

/* ep_ll_nccl_expand's MODE: 0 rows, 1 FP8 codes and scales, 2 FP8 dequantized, 3 combine_bwd's rows. */
static moe_rt_status nl_plan_expand(moe_rt_ll_group* g, int mode, mrt_launch* l) {
  const int codes = mode == 1 || mode == 2;
  const int vec = codes ? g->vec16_fp8 : g->vec16;
  snprintf(l->name, sizeof l->name, "ep_ll_nccl_expand<%s, %s, %d>", mrt_ctype(g->d.dtype), vec ? "true" : "false",
           mode);
  moe_rt_status st = nl_plan_kernel(g, l, NL_THREADS);
  const int unit = codes ? (vec ? 16 : 1) : (vec ? 16 / mrt_dtype_size(g->d.dtype) : 1);
  l->grid = nl_grid(g, (int64_t)g->d.num_ranks * g->d.max_tokens_per_rank * nl_slices(g->d.hidden, unit));
  return st;
}

typedef struct nl_exchange {
  int what;      /* all-gather: NL_META | NL_ROWS | NL_CODES; 0: the back regions' send/recv */
  int64_t rows;  /* send/recv: rows of H a part (0: none) */
  int values;    /* send/recv: the slot values too */
} nl_exchange;

/* The exchange of buffer set b on stream, as one NCCL group (nothing for one rank). */
static moe_rt_status nl_exchange_run(moe_rt_ll_group* g, int b, const nl_exchange* x, moe_rt_stream stream) {
  const moe_rt_ll_group_desc* d = &g->d;
  const moe_rt_ll_buffer_set* s = &d->set[b];
  if (d->num_ranks == 1 || !d->comm) return MOE_RT_SUCCESS;
  const int me = d->rank, isz = mrt_dtype_size(d->dtype);
  const int64_t Tmax = d->max_tokens_per_rank, H = d->hidden, TK = Tmax * d->topk;
  moe_rt_status st = moe_rt_comm_group_start();
  if (st) return st;
  if (x->what) {
    const int64_t mw = nl_meta_words(d), nr = Tmax * H, ns = Tmax * d->num_scales;
    if (!st && (x->what & NL_META))
      st = moe_rt_comm_all_gather(d->comm, s->gather_meta + me * mw, s->gather_meta, mw, MOE_RT_INT32, stream);
    if (!st && (x->what & NL_ROWS))
      st = moe_rt_comm_all_gather(d->comm, (char*)s->gather + me * nr * isz, s->gather, nr, d->dtype, stream);
    if (!st && (x->what & NL_CODES))
      st = moe_rt_comm_all_gather(d->comm, (char*)s->gather_q + me * nr, s->gather_q, nr, MOE_RT_UINT8, stream);
    if (!st && (x->what & NL_CODES))
      st = moe_rt_comm_all_gather(d->comm, s->gather_s + me * ns, s->gather_s, ns, MOE_RT_FLOAT32, stream);
  } else {
    const int64_t part = TK * H * isz;
    for (int p = 0; p < d->num_ranks && !st; ++p) {
      if (p == me) continue;
      if (x->rows) {
        st = moe_rt_comm_send(d->comm, (char*)s->back_send + p * part, x->rows * H, d->dtype, p, stream);
        if (!st) st = moe_rt_comm_recv(d->comm, (char*)s->back + p * part, x->rows * H, d->dtype, p, stream);
      }
      if (x->values && !st) {
        st = moe_rt_comm_send(d->comm, s->bw_send + p * TK, TK, MOE_RT_FLOAT32, p, stream);
        if (!st) st = moe_rt_comm_recv(d->comm, s->bw + p * TK, TK, MOE_RT_FLOAT32, p, stream);
      }
    }
  }
  const moe_rt_status end = moe_rt_comm_group_end(d->comm); /* always closes the group */
  return st ? st : end;
}

/* Launches [0, at) of the plan, the exchange (x NULL: none), then launches [at, n); a planning context records
 * the plan and every launch's arguments instead. */
static moe_rt_status nl_run(moe_rt_ll_group* g, const mrt_plan* p, mrt_args* a, int at, int b, const nl_exchange* x,
                            moe_rt_stream stream) {
  if (mrt_is_planning(g->ctx)) return mrt_run_plan(g->ctx, p, a, stream);
  moe_rt_status st = MOE_RT_SUCCESS;
  for (int i = 0; i < at && !st; ++i) st = mrt_launch_one(g->ctx, &p->launch[i], &a[i], stream);
  if (!st && x) st = nl_exchange_run(g, b, x, stream);
  for (int i = at; i < p->num_launches && !st; ++i) st = mrt_launch_one(g->ctx, &p->launch[i], &a[i], stream);
  return st;
}

/* The sizes the NCCL transport's kernels end with: R, rank, L, Tmax, K, H, then S when `scales`. */
static void nl_sizes_args(const moe_rt_ll_group* g, mrt_args* a, int scales) {
  const moe_rt_ll_group_desc* d = &g->d;
  mrt_arg_i32(a, d->num_ranks);
  mrt_arg_i32(a, d->rank);
  mrt_arg_i32(a, d->num_local_experts);
  mrt_arg_i32(a, d->max_tokens_per_rank);
  mrt_arg_i32(a, d->topk);
  mrt_arg_i64(a, d->hidden);
  if (scales) mrt_arg_i32(a, d->num_scales);
}

static void nl_pack_args(const moe_rt_ll_group* g, int b, const void* x, const void* xq, const void* xs,
                         const void* idx, const void* w, int64_t T, int meta, const moe_rt_ll_tables* t, mrt_args* a) {
  const moe_rt_ll_group_desc* d = &g->d;
  const moe_rt_ll_buffer_set* s = &d->set[b];
  mrt_arg_ptr(a, T ? x : NULL);
  mrt_arg_ptr(a, T ? xq : NULL);
  mrt_arg_ptr(a, T ? xs : NULL);
  mrt_arg_ptr(a, T ? idx : NULL);
  mrt_arg_ptr(a, T ? w : NULL);
  mrt_arg_i32(a, (int32_t)T);
  mrt_arg_i32(a, meta);
  mrt_arg_ptr(a, meta && T ? t->idx : NULL);
  mrt_arg_ptr(a, meta && T ? t->w : NULL);
  mrt_arg_ptr(a, meta ? t->counts : NULL);
  mrt_arg_ptr(a, s->gather);
  mrt_arg_ptr(a, s->gather_q);
  mrt_arg_ptr(a, s->gather_s);
  mrt_arg_ptr(a, s->gather_meta);
  mrt_arg_ptr(a, g->error_word);
  nl_sizes_args(g, a, 1);
}

/* `tables`: dispatch's expand, which writes the handle's route and counts (combine_bwd's reads slot_k/slot_w). */
static void nl_expand_args(const moe_rt_ll_group* g, int b, const moe_rt_ll_tables* t, int tables, int scaled,
                           mrt_args* a) {
  const moe_rt_ll_group_desc* d = &g->d;
  const moe_rt_ll_buffer_set* s = &d->set[b];
  mrt_arg_ptr(a, s->gather);
  mrt_arg_ptr(a, s->gather_q);
  mrt_arg_ptr(a, s->gather_s);
  mrt_arg_ptr(a, s->gather_meta);
  mrt_arg_ptr(a, s->recv);
  mrt_arg_ptr(a, s->recv_q);
  mrt_arg_ptr(a, s->recv_s);
  mrt_arg_ptr(a, tables ? t->route : NULL);
  mrt_arg_ptr(a, t->slot_k);
  mrt_arg_ptr(a, t->slot_w);
  mrt_arg_ptr(a, tables ? t->counts : NULL);
  mrt_arg_i32(a, scaled);
  nl_sizes_args(g, a, 1);
}

static moe_rt_status nl_dispatch(moe_rt_ll_group* g, int b, int phases, const void* x, const void* xq, const float* xs,
                                 int fp8, int dequantize, const void* idx, int idx64, const float* w, int64_t T,
                                 const moe_rt_ll_tables* t, moe_rt_stream stream) {
  ll_key k;
  memset(&k, 0, sizeof k);
  k.kind = K_NL_DISPATCH;
  k.phases = phases;
  k.idx64 = idx64;
  k.fp8 = fp8;
  k.dequant = dequantize;
  k.vec = fp8 ? g->vec16_fp8 && !(((uintptr_t)(xq ? xq : x)) & 15) : g->vec16 && !(((uintptr_t)x) & 15);
  mrt_plan p;
  moe_rt_status st = MOE_RT_SUCCESS;
  if (!mrt_group_plan_get(&g->plans, &k, sizeof k, &p)) {
    memset(&p, 0, sizeof p);
    int n = 0;
    if (phases & MOE_RT_LL_PUSH) st = nl_plan_pack(g, idx64, k.vec, fp8, &p.launch[n++]);
    if (!st && (phases & MOE_RT_LL_RECEIVE)) st = nl_plan_expand(g, fp8 ? (dequantize ? 2 : 1) : 0, &p.launch[n++]);
    if (st) return st;
    p.num_launches = n;
    mrt_group_plan_put(&g->plans, &k, sizeof k, &p);
  }
  mrt_args a[2];
  memset(a, 0, sizeof a);
  int i = 0;
  if (phases & MOE_RT_LL_PUSH) nl_pack_args(g, b, x, xq, xs, idx, w, T, 1, t, &a[i++]);
  if (phases & MOE_RT_LL_RECEIVE) nl_expand_args(g, b, t, 1, 0, &a[i]);
  const nl_exchange ex = {NL_META | (fp8 ? NL_CODES : NL_ROWS), 0, 0};
  return nl_run(g, &p, a, (phases & MOE_RT_LL_PUSH) ? 1 : 0, b, (phases & MOE_RT_LL_PUSH) ? &ex : NULL, stream);
}

/* The combine direction: ep_ll_nccl_reduce, the back regions' exchange, ep_ll_nccl_owner (MODE 0 weighted,
 * 1 unweighted, 2 rank partials). */
static moe_rt_status nl_combine(moe_rt_ll_group* g, int b, int op_code, const void* y, const float* slot_grads,
                                const moe_rt_ll_tables* t, int64_t T, void* out, float* grad_w, int partials,
                                moe_rt_stream stream) {
  const moe_rt_ll_group_desc* d = &g->d;
  const moe_rt_ll_buffer_set* s = &d->set[b];
  const int rows = out != NULL || op_code != MOE_RT_EP_OP_COMBINE_BWD;
  const int mode = op_code == MOE_RT_EP_OP_COMBINE ? (partials ? 2 : 0) : 1;
  ll_key k;
  memset(&k, 0, sizeof k);
  k.kind = K_NL_COMBINE;
  k.op = op_code;
  k.rows = rows;
  k.partials = partials;
  k.vec = g->vec16 && !(((uintptr_t)y | (uintptr_t)out) & 15);
  mrt_plan p;
  moe_rt_status st = MOE_RT_SUCCESS;
  const int unit = k.vec ? 16 / mrt_dtype_size(d->dtype) : 1;
  if (!mrt_group_plan_get(&g->plans, &k, sizeof k, &p)) {
    memset(&p, 0, sizeof p);
    mrt_launch* r = &p.launch[0];
    snprintf(r->name, sizeof r->name, "ep_ll_nccl_reduce<%s, %s, %s>", mrt_ctype(d->dtype), k.vec ? "true" : "false",
             partials ? "true" : "false");
    st = nl_plan_kernel(g, r, NL_THREADS);
    r->grid = nl_grid(g, (int64_t)d->num_ranks * d->max_tokens_per_rank * (rows ? nl_slices(d->hidden, unit) : 1));
    mrt_launch* o = &p.launch[1];
    snprintf(o->name, sizeof o->name, "ep_ll_nccl_owner<%s, %s, %d>", mrt_ctype(d->dtype), k.vec ? "true" : "false",
             mode);
    if (!st) st = nl_plan_kernel(g, o, NL_THREADS);
    if (st) return st;
    p.num_launches = 2;
    mrt_group_plan_put(&g->plans, &k, sizeof k, &p);
  }
  p.launch[1].grid = T ? nl_grid(g, T * (rows ? nl_slices(d->hidden, unit) : 1)) : 0;
  mrt_args a[2];
  memset(a, 0, sizeof a);
  mrt_arg_ptr(&a[0], rows ? y : NULL);
  mrt_arg_ptr(&a[0], slot_grads);
  mrt_arg_ptr(&a[0], t->route);
  mrt_arg_ptr(&a[0], partials ? t->slot_w : NULL);
  mrt_arg_ptr(&a[0], s->back_send);
  mrt_arg_ptr(&a[0], s->back);
  mrt_arg_ptr(&a[0], s->bw_send);
  mrt_arg_ptr(&a[0], s->bw);
  mrt_arg_i32(&a[0], rows);
  nl_sizes_args(g, &a[0], 0);
  mrt_arg_ptr(&a[1], s->back);
  mrt_arg_ptr(&a[1], s->bw);
  mrt_arg_ptr(&a[1], T ? t->idx : NULL);
  mrt_arg_ptr(&a[1], mode == 0 && T ? t->w : NULL);
  mrt_arg_ptr(&a[1], rows && T ? out : NULL);
  mrt_arg_ptr(&a[1], T ? grad_w : NULL);
  mrt_arg_i32(&a[1], rows);
  mrt_arg_i32(&a[1], (int32_t)T);
  mrt_arg_i32(&a[1], d->num_local_experts);
  mrt_arg_i32(&a[1], d->max_tokens_per_rank);
  mrt_arg_i32(&a[1], d->topk);
  mrt_arg_i64(&a[1], d->hidden);
  const nl_exchange ex = {0, rows ? (partials ? (int64_t)d->max_tokens_per_rank
                                              : (int64_t)d->max_tokens_per_rank * d->topk) : 0,
                          slot_grads != NULL};
  return nl_run(g, &p, a, 1, b, &ex, stream);
}

/* combine_bwd's rows: the pack of grad_out, the all-gather of the rows, the expand's MODE 3, the slot dot. */
static moe_rt_status nl_combine_bwd(moe_rt_ll_group* g, int b, const void* grad_out, const void* expert_out,
                                    const moe_rt_ll_tables* t, int64_t T, float* dots, moe_rt_stream stream) {
  const moe_rt_ll_group_desc* d = &g->d;
  const int scaled = expert_out == NULL;
  ll_key k;
  memset(&k, 0, sizeof k);
  k.kind = K_NL_COMBINE_BWD;
  k.scaled = scaled;
  k.vec = g->vec16 && !((uintptr_t)(T ? grad_out : NULL) & 15);
  k.dot = !scaled;
  k.dot_vec = !scaled && g->vec16 && !((uintptr_t)expert_out & 15);
  mrt_plan p;
  moe_rt_status st = MOE_RT_SUCCESS;
  if (!mrt_group_plan_get(&g->plans, &k, sizeof k, &p)) {
    memset(&p, 0, sizeof p);
    st = nl_plan_pack(g, 0, k.vec, 0, &p.launch[0]);
    if (!st) st = nl_plan_expand(g, 3, &p.launch[1]);
    if (!st && k.dot) st = plan_dot(g, &k, &p.launch[2]);
    if (st) return st;
    p.num_launches = k.dot ? 3 : 2;
    mrt_group_plan_put(&g->plans, &k, sizeof k, &p);
  }
  mrt_args a[3];
  memset(a, 0, sizeof a);
  const moe_rt_ll_tables none = {0};
  nl_pack_args(g, b, grad_out, NULL, NULL, NULL, NULL, T, 0, &none, &a[0]);
  nl_expand_args(g, b, t, 0, scaled, &a[1]);
  if (k.dot) {
    mrt_args* c = &a[2];
    mrt_arg_ptr(c, d->set[b].recv);
    mrt_arg_ptr(c, expert_out);
    mrt_arg_ptr(c, t->slot_k);
    mrt_arg_ptr(c, t->slot_w);
    mrt_arg_ptr(c, dots);
    mrt_arg_i64(c, (int64_t)d->num_local_experts * d->num_ranks * d->max_tokens_per_rank);
    mrt_arg_i64(c, d->hidden);
  }
  const nl_exchange ex = {NL_ROWS, 0, 0};
  return nl_run(g, &p, a, 1, b, &ex, stream);
}

moe_rt_status moe_rt_ll_dispatch(moe_rt_ll_group* g, int buffer_set, int phases, const void* x, const void* x_fp8,
                                 const float* x_scales, int fp8, int dequantize, const void* topk_idx, int idx_dtype,
                                 const float* topk_weights, int64_t T, const moe_rt_ll_tables* tables,
                                 moe_rt_stream stream) {
  static const char op[] = "moe_rt_ll_dispatch";
  moe_rt_status st;
  if ((st = check_call(g, op, buffer_set, T))) return st;
  if (phases < 1 || phases > 3)
    return BAD("%s: phases must be MOE_RT_LL_PUSH (1), MOE_RT_LL_RECEIVE (2) or both (3), got %d", op, phases);
  if (idx_dtype != MOE_RT_INT32 && idx_dtype != MOE_RT_INT64)
    return BAD("%s: idx_dtype: expected int32 or int64, got %s (%d)", op, mrt_dtype_name(idx_dtype), idx_dtype);
  if (fp8 != 0 && fp8 != 1) return BAD("%s: fp8 must be 0 or 1, got %d", op, fp8);
  if (dequantize != 0 && dequantize != 1) return BAD("%s: dequantize must be 0 or 1, got %d", op, dequantize);
  if (fp8 && !g->d.fp8) return BAD("%s: fp8: the group has no FP8 receive buffers (desc.fp8 = 0)", op);
  if (!fp8 && (dequantize || x_fp8 || x_scales))
    return BAD("%s: dequantize, x_fp8 and x_scales need fp8 = 1", op);
  const int pair = x_fp8 != NULL || x_scales != NULL;
  if (pair && x) return BAD("%s: pass either x or the pair (x_fp8, x_scales), not both", op);
  if ((st = mrt_check_ptr(op, "tables", tables))) return st;
  if (T > 0) {
    if (pair) {
      if ((st = mrt_check_ptr(op, "x_fp8", x_fp8)) || (st = mrt_check_ptr(op, "x_scales", x_scales))) return st;
    } else if ((st = mrt_check_ptr(op, "x", x))) {
      return st;
    }
    if ((st = mrt_check_ptr(op, "topk_idx", topk_idx)) || (st = mrt_check_ptr(op, "topk_weights", topk_weights)) ||
        (st = mrt_check_ptr(op, "tables->idx", tables->idx)) || (st = mrt_check_ptr(op, "tables->w", tables->w)))
      return st;
  }
  if ((st = mrt_check_ptr(op, "tables->route", tables->route)) ||
      (st = mrt_check_ptr(op, "tables->slot_k", tables->slot_k)) ||
      (st = mrt_check_ptr(op, "tables->slot_w", tables->slot_w)) ||
      (st = mrt_check_ptr(op, "tables->counts", tables->counts)))
    return st;
  const void* xe = T && !pair ? x : NULL;
  const void* xq = T && pair ? x_fp8 : NULL;
  if (nccl_transport(g))
    return nl_dispatch(g, buffer_set, phases, xe, xq, T && pair ? x_scales : NULL, fp8, dequantize, topk_idx,
                       idx_dtype == MOE_RT_INT64, topk_weights, T, tables, stream);
  ll_key k;
  memset(&k, 0, sizeof k);
  k.kind = K_DISPATCH;
  k.op = MOE_RT_EP_OP_DISPATCH;
  k.buffer_set = buffer_set;
  k.phases = phases;
  k.idx64 = idx_dtype == MOE_RT_INT64;
  k.fp8 = fp8;
  k.dequant = dequantize;
  k.vec = fp8 ? g->vec16_fp8 && !(((uintptr_t)(xq ? xq : xe)) & 15) : g->vec16 && !(((uintptr_t)xe) & 15);
  mrt_plan p;
  if ((st = plan_of(g, &k, &p))) return st;
  mrt_args a[2];
  memset(a, 0, sizeof a);
  int i = 0;
  if ((phases & MOE_RT_LL_PUSH) && !pairwise(g)) barrier_args(g, MOE_RT_EP_OP_DISPATCH, &a[i++]);
  push_args q = {xe, xq, T && pair ? x_scales : NULL, topk_idx, topk_weights, tables, NULL, NULL, 1, 0,
                 MOE_RT_EP_OP_DISPATCH};
  push_kernel_args(g, &k, &q, T, &a[i]);
  return mrt_run_plan(g->ctx, &p, a, stream);
}

moe_rt_status moe_rt_ll_combine(moe_rt_ll_group* g, int buffer_set, int op_code, const void* y,
                                const float* slot_grads, const moe_rt_ll_tables* tables, int64_t T, void* out,
                                float* grad_w, moe_rt_stream stream) {
  static const char op[] = "moe_rt_ll_combine";
  moe_rt_status st;
  if ((st = check_call(g, op, buffer_set, T)) || (st = mrt_check_ptr(op, "tables", tables)) ||
      (st = mrt_check_ptr(op, "tables->route", tables->route)))
    return st;
  if (op_code == MOE_RT_EP_OP_COMBINE || op_code == MOE_RT_EP_OP_DISPATCH_BWD) {
    if ((st = mrt_check_ptr(op, "y", y)) || (st = mrt_check_data(op, "out", out, T))) return st;
    if (op_code == MOE_RT_EP_OP_COMBINE && (slot_grads || grad_w))
      return BAD("%s: slot_grads and grad_w must be NULL for MOE_RT_EP_OP_COMBINE", op);
    if ((slot_grads == NULL) != (grad_w == NULL) && T > 0)
      return BAD("%s: slot_grads and grad_w come together (both NULL or both given)", op);
    if (slot_grads == NULL && grad_w != NULL) return BAD("%s: grad_w needs slot_grads", op);
  } else if (op_code == MOE_RT_EP_OP_COMBINE_BWD) {
    if (y || out) return BAD("%s: y and out must be NULL for MOE_RT_EP_OP_COMBINE_BWD (the weight gradient)", op);
    if ((st = mrt_check_ptr(op, "slot_grads", slot_grads)) || (st = mrt_check_data(op, "grad_w", grad_w, T)))
      return st;
  } else {
    return BAD("%s: op must be MOE_RT_EP_OP_COMBINE (2), MOE_RT_EP_OP_DISPATCH_BWD (3) or MOE_RT_EP_OP_COMBINE_BWD "
               "(4), got %d", op, op_code);
  }
  const int weighted = op_code == MOE_RT_EP_OP_COMBINE;
  /* the group's rank partials (desc.combine_partials): the expert side weights each slot by the handle's
   * slot_w and pushes one row per (token, rank); the owner's sum is unweighted */
  const int partials = weighted && g->d.combine_partials;
  if (T > 0 && ((st = mrt_check_ptr(op, "tables->idx", tables->idx)) ||
                (weighted && !partials && (st = mrt_check_ptr(op, "tables->w", tables->w)))))
    return st;
  if (partials && (st = mrt_check_ptr(op, "tables->slot_w", tables->slot_w))) return st;
  if (nccl_transport(g))
    return nl_combine(g, buffer_set, op_code, y, slot_grads, tables, T, out, grad_w, partials, stream);
  ll_key k;
  memset(&k, 0, sizeof k);
  k.kind = K_COMBINE;
  k.op = op_code;
  k.buffer_set = buffer_set;
  k.rows = out != NULL || op_code != MOE_RT_EP_OP_COMBINE_BWD;
  k.vec = g->vec16 && !(((uintptr_t)y | (uintptr_t)out) & 15);
  k.partials = partials;
  mrt_plan p;
  if ((st = plan_of(g, &k, &p))) return st;
  const int i = pairwise(g) ? 0 : 1; /* the combine launch */
  p.launch[i].grid = combine_grid(g, &p.launch[i], T);
  const moe_rt_ll_group_desc* d = &g->d;
  const moe_rt_ll_buffer_set* s = &d->set[buffer_set];
  mrt_args a[2];
  memset(a, 0, sizeof a);
  if (i) barrier_args(g, op_code, &a[0]);
  mrt_args* c = &a[i];
  mrt_arg_ptr(c, y);
  mrt_arg_ptr(c, slot_grads);
  mrt_arg_ptr(c, tables->route);
  mrt_arg_ptr(c, T ? tables->idx : NULL);
  mrt_arg_ptr(c, weighted && !partials && T ? tables->w : NULL);
  mrt_arg_ptr(c, partials ? tables->slot_w : NULL);
  mrt_arg_ptr(c, s->peer_back);
  mrt_arg_ptr(c, s->peer_bw);
  mrt_arg_ptr(c, d->peer_flags);
  mrt_arg_ptr(c, T ? out : NULL);
  mrt_arg_ptr(c, T ? grad_w : NULL);
  mrt_arg_ptr(c, d->barrier_state);
  mrt_arg_ptr(c, d->timeout_word);
  mrt_arg_i64(c, d->timeout_ns);
  sizes_args(g, op_code, c);
  mrt_arg_i32(c, (int32_t)T);
  mrt_arg_i32(c, d->chunk);
  mrt_arg_i64(c, d->hidden);
  mrt_arg_i64(c, (int64_t)2 * d->num_ranks * d->max_tokens_per_rank * buffer_set);
  if (!i) pairwise_args(g, c);
  return mrt_run_plan(g->ctx, &p, a, stream);
}

moe_rt_status moe_rt_ll_combine_bwd(moe_rt_ll_group* g, int buffer_set, const void* grad_out, const void* expert_out,
                                    const moe_rt_ll_tables* tables, int64_t T, float* dots, moe_rt_stream stream) {
  static const char op[] = "moe_rt_ll_combine_bwd";
  moe_rt_status st;
  if ((st = check_call(g, op, buffer_set, T)) || (st = mrt_check_ptr(op, "tables", tables)) ||
      (st = mrt_check_ptr(op, "tables->slot_k", tables->slot_k)) ||
      (st = mrt_check_ptr(op, "tables->route", tables->route)))
    return st;
  if (T > 0 && ((st = mrt_check_ptr(op, "grad_out", grad_out)) ||
                (st = mrt_check_ptr(op, "tables->idx", tables->idx)) ||
                (st = mrt_check_ptr(op, "tables->w", tables->w))))
    return st;
  const moe_rt_ll_group_desc* d = &g->d;
  const moe_rt_ll_buffer_set* s = &d->set[buffer_set];
  const int64_t n = (int64_t)d->num_local_experts * d->num_ranks * d->max_tokens_per_rank;
  if (expert_out) {
    if ((st = mrt_check_ptr(op, "dots", dots)) || (st = mrt_check_ptr(op, "tables->slot_w", tables->slot_w)))
      return st;
    const uintptr_t lo = (uintptr_t)s->recv, hi = lo + (uintptr_t)(n * d->hidden * mrt_dtype_size(d->dtype));
    const uintptr_t y0 = (uintptr_t)expert_out, y1 = y0 + (uintptr_t)(n * d->hidden * mrt_dtype_size(d->dtype));
    if (y0 < hi && y1 > lo)
      return BAD("%s: expert_out: must not be the group's receive buffer (combine_bwd overwrites it); pass a copy",
                 op);
  } else if (dots) {
    return BAD("%s: dots must be NULL without expert_out", op);
  }
  if (nccl_transport(g)) return nl_combine_bwd(g, buffer_set, grad_out, expert_out, tables, T, dots, stream);
  const int scaled = expert_out == NULL;
  ll_key k;
  memset(&k, 0, sizeof k);
  k.kind = K_COMBINE_BWD;
  k.op = MOE_RT_EP_OP_COMBINE_BWD;
  k.buffer_set = buffer_set;
  k.phases = MOE_RT_LL_PUSH | MOE_RT_LL_RECEIVE;
  k.scaled = scaled;
  k.vec = g->vec16 && !((uintptr_t)(T ? grad_out : NULL) & 15);
  k.dot = !scaled;
  k.dot_vec = !scaled && g->vec16 && !((uintptr_t)expert_out & 15); /* the slot dot's own vector path */
  mrt_plan p;
  if ((st = plan_of(g, &k, &p))) return st;
  mrt_args a[3];
  memset(a, 0, sizeof a);
  const int i = pairwise(g) ? 0 : 1; /* the dispatch-direction launch */
  if (i) barrier_args(g, MOE_RT_EP_OP_COMBINE_BWD, &a[0]);
  /* unscaled rows (expert_out given) take the dedup split, its copies mapped by the handle's route */
  push_args q = {grad_out, NULL, NULL, tables->idx, tables->w, NULL, tables->slot_k,
                 d->dedup && !scaled ? (const void*)tables->route : NULL, 0, scaled, MOE_RT_EP_OP_COMBINE_BWD};
  push_kernel_args(g, &k, &q, T, &a[i]);
  if (!scaled) {
    mrt_args* c = &a[i + 1];
    mrt_arg_ptr(c, s->recv);
    mrt_arg_ptr(c, expert_out);
    mrt_arg_ptr(c, tables->slot_k);
    mrt_arg_ptr(c, tables->slot_w);
    mrt_arg_ptr(c, dots);
    mrt_arg_i64(c, n);
    mrt_arg_i64(c, d->hidden);
  }
  return mrt_run_plan(g->ctx, &p, a, stream);
}
