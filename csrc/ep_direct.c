/* moe_rt core: the direct transport of the normal EP mode (kernels/ep.cu: ep_direct_barrier, ep_direct_dispatch,
 * ep_direct_combine, ep_direct_row_map, ep_copy_rows, ep_fill_rows, ep_slot_values) over a group whose shared
 * buffers, peer tables and receive stages the caller made (moe_rt/_ep_direct.py DirectTransport, or a C program).
 * The launches are those DirectTransport and moe_rt/_ep_rows.py made through their own launch set-ups before
 * they moved here (tests/test_ep_direct_core.py compares them, argument by argument, in a planning context).
 * Each op plans once per signature (kernel variants, grids, blocks; cached in the group), then launches on the
 * caller's stream. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define FILE_EP "ep.cu"
#define EPD_THREADS 512 /* the fused kernels: one warp per row, 16 rows of a chunk at a time */
#define EPD_MAX_CHUNK 32
#define EPD_UNROLL 8    /* 16-byte units a lane has in flight while copying or expanding a row */
#define EPD_MAX_STAGES 32
#define EPD_MAX_RANKS 65536
#define EPD_MAX_TOPK 1024 /* EpGroup's limit (docs/ep.md §6) */

enum {
  L_BARRIER = 1, L_DISPATCH, L_ROW_MAP, L_COPY_W, L_COPY_RECV, L_FILL, L_FILL_S, L_SLOT_VALUES, L_COMBINE, L_SCALE
};

typedef struct epd_key {
  int64_t kind, op, barrier, rb, u, K, P, T, N, rows, H, dtype, vec, fp8, piece, out_dtype, hidden;
  int64_t stage, make_map, copy_w, u_w, recv, u_recv, fill, u_fill, u_fill_s, out, out_w, slot_values;
  int64_t zero_rows; /* the dispatch kernel writes the empty rows' zeros (no ep_fill_rows of the rows) */
  int64_t scale;     /* 1: the kernel's sink weights the rows (RowScale); 2: ep_scale_rows after it */
} epd_key;

struct moe_rt_ep_direct_group {
  moe_rt_context* ctx;
  moe_rt_ep_direct_group_desc d;
  int num_stages;
  moe_rt_ep_direct_stage stages[EPD_MAX_STAGES];
  pthread_mutex_t lock; /* the stages */
  mrt_group_plans plans;
  mrt_live live; /* its entry in the registry of live groups (moe_rt_ep_direct_group_acquire) */
};

static mrt_registry g_registry = MRT_REGISTRY_INIT;

static void group_free(moe_rt_ep_direct_group* g) {
  pthread_mutex_destroy(&g->lock);
  mrt_group_plans_destroy(&g->plans);
  free(g);
}

#define BAD(...) mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, __VA_ARGS__)

static const char* const UNITS[17] = {[16] = "uint4", [8] = "uint2", [4] = "unsigned", [2] = "unsigned short",
                                      [1] = "unsigned char"};

/* The widest copy unit (16 to 1 bytes) dividing row_bytes and every address (moe_rt._ep_rows.unit). */
static int64_t unit_of(int64_t row_bytes, uintptr_t a, uintptr_t b) {
  const uint64_t m = (uint64_t)row_bytes | 16u | a | b;
  return (int64_t)(m & (~m + 1));
}

moe_rt_status moe_rt_ep_direct_group_create(moe_rt_context* ctx, const moe_rt_ep_direct_group_desc* d,
                                            moe_rt_ep_direct_group** out) {
  static const char op[] = "moe_rt_ep_direct_group_create";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = mrt_check_ptr(op, "out", out))) return st;
  *out = NULL;
  if ((st = mrt_check_ptr(op, "desc", d))) return st;
  if (d->num_ranks < 1 || d->num_ranks > EPD_MAX_RANKS)
    return BAD("%s: desc.num_ranks must be in [1, %d], got %d", op, EPD_MAX_RANKS, d->num_ranks);
  if (d->rank < 0 || d->rank >= d->num_ranks)
    return BAD("%s: desc.rank must be in [0, %d), got %d", op, d->num_ranks, d->rank);
  if (!(0 <= d->node_lo && d->node_lo <= d->rank && d->rank < d->node_hi && d->node_hi <= d->num_ranks))
    return BAD("%s: desc.node_lo, node_hi must satisfy 0 <= node_lo <= rank=%d < node_hi <= num_ranks=%d, got "
               "[%d, %d)", op, d->rank, d->num_ranks, d->node_lo, d->node_hi);
  if (d->pair_rows < 1) return BAD("%s: desc.pair_rows must be >= 1, got %d", op, d->pair_rows);
  if (d->timeout_ns < 1) return BAD("%s: desc.timeout_ns must be > 0, got %lld", op, (long long)d->timeout_ns);
  const void* need[] = {d->peer_barrier, d->peer_flags, d->barrier_state, d->timeout_word};
  static const char* names[] = {"peer_barrier", "peer_flags", "barrier_state", "timeout_word"};
  for (int i = 0; i < 4; ++i)
    if (!need[i]) return BAD("%s: desc.%s is NULL", op, names[i]);
  if ((uintptr_t)d->barrier_state % 8)
    return BAD("%s: desc.barrier_state must be 8-byte aligned (uint32 [4], a uint64 at word 2)", op);
  moe_rt_ep_direct_group* g = calloc(1, sizeof *g);
  if (!g) return BAD("%s: out of host memory", op);
  g->ctx = ctx;
  g->d = *d;
  pthread_mutex_init(&g->lock, NULL);
  mrt_group_plans_init(&g->plans);
  if (!mrt_registry_add(&g_registry, g, &g->live)) {
    group_free(g);
    return BAD("%s: out of host memory (the registry of live groups)", op);
  }
  *out = g;
  return MOE_RT_SUCCESS;
}

void moe_rt_ep_direct_group_destroy(moe_rt_ep_direct_group* g) {
  if (g && mrt_registry_remove(&g_registry, g, &g->live)) group_free(g); /* held: the last release frees */
}

int64_t moe_rt_ep_direct_group_serial(const moe_rt_ep_direct_group* g) { return g ? g->live.serial : 0; }

moe_rt_status moe_rt_ep_direct_group_acquire(int64_t address, int64_t serial, moe_rt_ep_direct_group** out) {
  static const char op[] = "moe_rt_ep_direct_group_acquire";
  mrt_clear_error();
  if (!out) return BAD("%s: out is NULL", op);
  *out = NULL;
  moe_rt_ep_direct_group* found = mrt_registry_acquire(&g_registry, address, serial);
  if (!found)
    return BAD("%s: no live direct EP group at address 0x%llx with serial %lld: it was destroyed (the EpGroup "
               "was closed) or never made in this process", op, (unsigned long long)address, (long long)serial);
  *out = found;
  return MOE_RT_SUCCESS;
}

void moe_rt_ep_direct_group_release(moe_rt_ep_direct_group* g) {
  if (g && mrt_registry_release(&g_registry, &g->live)) group_free(g);
}

moe_rt_status moe_rt_ep_direct_group_get_desc(const moe_rt_ep_direct_group* g, moe_rt_ep_direct_group_desc* out,
                                              moe_rt_context** ctx) {
  mrt_clear_error();
  if (!g || !out) return BAD("moe_rt_ep_direct_group_get_desc: group or out is NULL");
  *out = g->d;
  if (ctx) *ctx = g->ctx;
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_ep_direct_add_stage(moe_rt_ep_direct_group* g, const moe_rt_ep_direct_stage* s) {
  static const char op[] = "moe_rt_ep_direct_add_stage";
  mrt_clear_error();
  if (!g) return BAD("%s: group is NULL", op);
  if (!s) return BAD("%s: stage is NULL", op);
  if (s->row_bytes < 1) return BAD("%s: stage.row_bytes must be >= 1, got %lld", op, (long long)s->row_bytes);
  if (s->topk < 1 || s->topk > EPD_MAX_TOPK)
    return BAD("%s: stage.topk must be in [1, %d], got %d", op, EPD_MAX_TOPK, s->topk);
  if (s->align < 1 || s->align > 16 || (s->align & (s->align - 1)))
    return BAD("%s: stage.align must be 1, 2, 4, 8 or 16, got %d", op, s->align);
  const void* need[] = {s->rows_local, s->peer_rows, s->w_local, s->peer_w};
  static const char* names[] = {"rows_local", "peer_rows", "w_local", "peer_w"};
  for (int i = 0; i < 4; ++i)
    if (!need[i]) return BAD("%s: stage.%s is NULL", op, names[i]);
  pthread_mutex_lock(&g->lock);
  int i = 0;
  while (i < g->num_stages && !(g->stages[i].row_bytes == s->row_bytes && g->stages[i].topk == s->topk)) ++i;
  if (i == EPD_MAX_STAGES) {
    pthread_mutex_unlock(&g->lock);
    return BAD("%s: the group holds %d stage pairs already", op, EPD_MAX_STAGES);
  }
  g->stages[i] = *s;
  if (i == g->num_stages) g->num_stages++;
  pthread_mutex_unlock(&g->lock);
  return MOE_RT_SUCCESS;
}

static int find_stage(moe_rt_ep_direct_group* g, int64_t rb, int K, moe_rt_ep_direct_stage* out);

moe_rt_status moe_rt_ep_direct_get_stage(moe_rt_ep_direct_group* g, int64_t row_bytes, int topk,
                                         moe_rt_ep_direct_stage* out) {
  mrt_clear_error();
  if (!g || !out) return BAD("moe_rt_ep_direct_get_stage: group or out is NULL");
  if (!find_stage(g, row_bytes, topk, out))
    return BAD("moe_rt_ep_direct_get_stage: the group has no stage pair for %lld-byte rows and topk=%d (made by "
               "the first op that needs it)", (long long)row_bytes, topk);
  return MOE_RT_SUCCESS;
}

static int find_stage(moe_rt_ep_direct_group* g, int64_t rb, int K, moe_rt_ep_direct_stage* out) {
  int found = 0;
  pthread_mutex_lock(&g->lock);
  for (int i = 0; i < g->num_stages; ++i)
    if (g->stages[i].row_bytes == rb && g->stages[i].topk == K) {
      *out = g->stages[i];
      found = 1;
      break;
    }
  pthread_mutex_unlock(&g->lock);
  return found;
}

/* ---- planning ------------------------------------------------------------------------------------- */

static moe_rt_status load(moe_rt_ep_direct_group* g, mrt_launch* l, int kind, int* regs) {
  int r = 0;
  l->kind = kind;
  moe_rt_status st = mrt_kernel(g->ctx, l, FILE_EP, &r);
  if (regs) *regs = r;
  return st;
}

static int64_t sms(const moe_rt_ep_direct_group* g) { return mrt_device(g->ctx)->sm_count; }

/* Rows a chunk flag covers (DirectTransport.chunk_rows: the same on every rank). */
static int64_t chunk_rows(const moe_rt_ep_direct_group* g, int64_t P) {
  const int64_t others = mrt_max(1, g->d.node_hi - g->d.node_lo - 1);
  const int64_t c = mrt_max(EPD_THREADS / 32, mrt_cdiv(P * others, 4 * 2 * 132));
  return mrt_max(1, mrt_min(mrt_min(EPD_MAX_CHUNK, P), c));
}

static moe_rt_status plan_barrier(moe_rt_ep_direct_group* g, mrt_launch* l) {
  snprintf(l->name, sizeof l->name, "ep_direct_barrier");
  moe_rt_status st = load(g, l, L_BARRIER, NULL);
  l->grid = 1;
  l->block = (int32_t)mrt_max(32, mrt_cdiv(g->d.node_hi - g->d.node_lo, 32) * 32);
  return st;
}

/* A fused kernel: at most one resident wave (its blocks wait on each other's peers), at most `work` blocks. */
static moe_rt_status plan_fused(moe_rt_ep_direct_group* g, mrt_launch* l, int kind, int64_t work) {
  int regs = 0;
  int64_t resident = 0;
  moe_rt_status st = load(g, l, kind, &regs);
  if (!st) st = mrt_resident_blocks(g->ctx, l, EPD_THREADS, regs, &resident);
  l->block = EPD_THREADS;
  l->grid = mrt_max(1, mrt_min(work, resident));
  return st;
}

static moe_rt_status plan_copy(moe_rt_ep_direct_group* g, mrt_launch* l, int kind, int64_t rows, int64_t rb,
                               int64_t u) {
  snprintf(l->name, sizeof l->name, "ep_copy_rows<%s>", UNITS[u]);
  moe_rt_status st = load(g, l, kind, NULL);
  const int64_t units = rb / u;
  l->grid = mrt_max(1, mrt_min(rows, sms(g) * 16));
  l->block = (int32_t)mrt_min(512, mrt_max(32, mrt_cdiv(units, 32) * 32));
  l->arg[0] = units;
  return st;
}

static moe_rt_status plan_fill(moe_rt_ep_direct_group* g, mrt_launch* l, int kind, int64_t N, int64_t rb, int64_t u) {
  snprintf(l->name, sizeof l->name, "ep_fill_rows<%s>", UNITS[u]);
  moe_rt_status st = load(g, l, kind, NULL);
  l->grid = mrt_max(1, mrt_min(mrt_cdiv(N, 8), sms(g) * 16));
  l->block = 256;
  l->arg[0] = rb / u;
  return st;
}

static moe_rt_status plan_of(moe_rt_ep_direct_group* g, const epd_key* k, mrt_plan* p) {
  if (mrt_group_plan_get(&g->plans, k, sizeof *k, p)) return MOE_RT_SUCCESS;
  memset(p, 0, sizeof *p);
  moe_rt_status st = MOE_RT_SUCCESS;
  int n = 0;
  const int64_t span = g->d.node_hi - g->d.node_lo;
  if (k->kind == L_DISPATCH) {
    if (k->barrier) st = plan_barrier(g, &p->launch[n++]);
    if (!st && k->rb > 0) {
      mrt_launch* l = &p->launch[n++];
      if (k->scale == 1)
        snprintf(l->name, sizeof l->name, "ep_direct_dispatch<uint4, %d, RowScale<%s>>", EPD_UNROLL,
                 mrt_ctype((int)k->out_dtype));
      else if (!k->fp8)
        snprintf(l->name, sizeof l->name, "ep_direct_dispatch<%s, %d>", UNITS[k->u], EPD_UNROLL);
      else if (k->fp8 == 1)
        snprintf(l->name, sizeof l->name, "ep_direct_dispatch<uint4, %d, Fp8Rows<%d>>", EPD_UNROLL, (int)k->piece);
      else
        snprintf(l->name, sizeof l->name, "ep_direct_dispatch<uint4, %d, Fp8Dequant<%s, %d>>", EPD_UNROLL,
                 mrt_ctype((int)k->out_dtype), (int)k->piece);
      const int64_t C = chunk_rows(g, k->P);
      st = plan_fused(g, l, L_DISPATCH, mrt_cdiv(k->P, C) * span);
      l->arg[0] = C;
    }
    if (!st && k->make_map && k->rows > 0) {
      mrt_launch* l = &p->launch[n++];
      snprintf(l->name, sizeof l->name, "ep_direct_row_map");
      st = load(g, l, L_ROW_MAP, NULL);
      l->grid = mrt_max(1, mrt_min(mrt_cdiv(k->rows, 256), sms(g) * 8));
      l->block = 256;
    }
    /* with the kernel (rb > 0) the weights are its (recv_wk, out_w), as are the rows' zeros (zero_rows) */
    if (!st && k->copy_w && k->rows > 0 && k->rb == 0)
      st = plan_copy(g, &p->launch[n++], L_COPY_W, k->rows, 4 * k->K, k->u_w);
    if (!st && k->recv && k->rows > 0 && k->rb > 0)
      st = plan_copy(g, &p->launch[n++], L_COPY_RECV, k->rows, k->rb, k->u_recv);
    if (!st && k->fill && k->N > 0 && (k->out || (k->out_w && k->rb == 0))) {
      const int64_t orb = !k->out        ? 0
                          : k->fp8 == 1  ? k->hidden
                          : k->fp8 == 2  ? k->hidden * mrt_dtype_size((int)k->out_dtype)
                                         : k->rb;
      st = plan_fill(g, &p->launch[n++], L_FILL, k->N, orb, k->u_fill);
      if (!st && k->out && k->fp8 == 1)
        st = plan_fill(g, &p->launch[n++], L_FILL_S, k->N, 4 * mrt_cdiv(k->hidden, 128), k->u_fill_s);
    }
    if (!st && k->scale == 2 && k->N > 0) { /* rows not 16-byte aligned: ep_scale_rows (moe_rt/_ep_rows.py's grid) */
      mrt_launch* l = &p->launch[n++];
      const int64_t isz = mrt_dtype_size((int)k->out_dtype), H = k->rb / isz, vec = k->vec;
      snprintf(l->name, sizeof l->name, "ep_scale_rows<%s, %s>", mrt_ctype((int)k->out_dtype), vec ? "true" : "false");
      st = load(g, l, L_SCALE, NULL);
      l->grid = mrt_max(1, mrt_min(k->N, sms(g) * 8));
      l->block = (int32_t)mrt_min(512, mrt_max(32, mrt_cdiv(H / (vec ? 16 / isz : 1), 32) * 32));
    }
  } else if (k->kind == L_COMBINE) {
    if (k->slot_values && k->rows * k->K > 0) {
      mrt_launch* l = &p->launch[n++];
      snprintf(l->name, sizeof l->name, "ep_slot_values");
      st = load(g, l, L_SLOT_VALUES, NULL);
      l->grid = mrt_max(1, mrt_min(mrt_cdiv(k->rows * k->K, 256), sms(g) * 8));
      l->block = 256;
    }
    if (!st && k->barrier) st = plan_barrier(g, &p->launch[n++]);
    if (!st) {
      mrt_launch* l = &p->launch[n++];
      snprintf(l->name, sizeof l->name, "ep_direct_combine<%s, %s>", mrt_ctype((int)k->dtype),
               k->vec ? "true" : "false");
      const int64_t C = chunk_rows(g, k->P);
      st = plan_fused(g, l, L_COMBINE, mrt_max(mrt_cdiv(k->P, C) * span, mrt_cdiv(k->T, EPD_THREADS / 32)));
      l->arg[0] = C;
    }
  } else {
    st = plan_barrier(g, &p->launch[n++]);
  }
  if (st) return st;
  p->num_launches = n;
  mrt_group_plan_put(&g->plans, k, sizeof *k, p);
  return MOE_RT_SUCCESS;
}

/* ---- execution ------------------------------------------------------------------------------------ */

static void barrier_args(const moe_rt_ep_direct_group* g, int op, mrt_args* a) {
  const moe_rt_ep_direct_group_desc* d = &g->d;
  mrt_barrier_args(a, d->peer_barrier, d->num_ranks, d->rank, d->barrier_state, d->timeout_ns, d->timeout_word, op,
                   d->node_lo, d->node_hi);
}

moe_rt_status moe_rt_ep_direct_barrier(moe_rt_ep_direct_group* g, int op, moe_rt_stream stream) {
  mrt_clear_error();
  if (!g) return BAD("moe_rt_ep_direct_barrier: group is NULL");
  if (op < 1 || op > 6) return BAD("moe_rt_ep_direct_barrier: op must be in [1, 6], got %d", op);
  epd_key k;
  memset(&k, 0, sizeof k);
  k.kind = L_BARRIER;
  mrt_plan p;
  moe_rt_status st = plan_of(g, &k, &p);
  if (st) return st;
  mrt_args a;
  memset(&a, 0, sizeof a);
  barrier_args(g, op, &a);
  return mrt_run_plan(g->ctx, &p, &a, stream);
}

/* The handle's regions (moe_rt_ep_handle_layout over its sizes). */
typedef struct epd_regions {
  char* at[MOE_RT_EP_NUM_REGIONS];
} epd_regions;

static moe_rt_status check_handle(const moe_rt_ep_direct_group* g, const char* op, const moe_rt_ep_direct_handle* h,
                                  epd_regions* r) {
  moe_rt_status st;
  if ((st = mrt_check_ptr(op, "handle", h)) || (st = mrt_check_ptr(op, "handle->buffer", h->buffer))) return st;
  const moe_rt_ep_handle_desc* d = &h->desc;
  if (d->num_ranks != g->d.num_ranks)
    return BAD("%s: handle->desc.num_ranks must be the group's %d, got %d", op, g->d.num_ranks, d->num_ranks);
  if (d->pair_capacity < 1 || d->pair_capacity > g->d.pair_rows)
    return BAD("%s: handle->desc.pair_capacity must be in [1, %d], got %d", op, g->d.pair_rows, d->pair_capacity);
  if (d->num_local_experts < 1 || d->max_tokens_per_rank < 1 || d->topk < 1 || d->topk > EPD_MAX_TOPK)
    return BAD("%s: handle->desc: num_local_experts and max_tokens_per_rank must be >= 1 and topk in [1, %d]", op,
               EPD_MAX_TOPK);
  if (d->recv_rows < 0 || d->recv_rows > (int64_t)d->num_ranks * d->pair_capacity || d->num_rows < 0)
    return BAD("%s: handle->desc: recv_rows must be in [0, num_ranks*pair_capacity] and num_rows >= 0", op);
  if (h->num_tokens < 0 || h->num_tokens > d->max_tokens_per_rank)
    return BAD("%s: handle->num_tokens must be in [0, max_tokens_per_rank=%d], got %lld", op, d->max_tokens_per_rank,
               (long long)h->num_tokens);
  if (h->exact != 0 && h->exact != 1) return BAD("%s: handle->exact must be 0 or 1, got %d", op, h->exact);
  moe_rt_ep_handle_desc lay = *d;
  moe_rt_ep_handle_layout(&lay);
  for (int i = 0; i < MOE_RT_EP_NUM_REGIONS; ++i) r->at[i] = (char*)h->buffer + lay.offset[i];
  return MOE_RT_SUCCESS;
}

static moe_rt_status get_stage(moe_rt_ep_direct_group* g, const char* op, int64_t rb, int K,
                               moe_rt_ep_direct_stage* s) {
  if (!find_stage(g, rb, K, s))
    return BAD("%s: no stage pair for %lld-byte rows and topk=%d (moe_rt_ep_direct_add_stage)", op, (long long)rb, K);
  return MOE_RT_SUCCESS;
}

/* The fused kernels' arguments after the stage tables and the op's pointers: state .. me. */
static void head_args(const moe_rt_ep_direct_group* g, int op, mrt_args* a) {
  mrt_arg_ptr(a, g->d.barrier_state);
  mrt_arg_ptr(a, g->d.timeout_word);
  mrt_arg_i64(a, g->d.timeout_ns);
  mrt_arg_i32(a, op);
  mrt_arg_i32(a, g->d.num_ranks);
  mrt_arg_i32(a, g->d.rank);
}

static void copy_args(const moe_rt_ep_direct_group* g, const mrt_launch* l, const void* src, const void* src_map,
                      void* dst, int64_t rows, mrt_args* a) {
  mrt_arg_ptr(a, src);
  mrt_arg_ptr(a, src_map);
  mrt_arg_ptr(a, dst);
  mrt_arg_ptr(a, NULL);
  mrt_arg_ptr(a, g->d.barrier_state);
  mrt_arg_i64(a, rows);
  mrt_arg_i64(a, l->arg[0]);
}

/* A call's signature: what every op's has (the rest zero, filled by the op). */
static epd_key key_of(int kind, int op, int barrier, const moe_rt_ep_handle_desc* hd) {
  epd_key k;
  memset(&k, 0, sizeof k);
  k.kind = kind;
  k.op = op;
  k.barrier = barrier;
  k.K = hd->topk;
  k.P = hd->pair_capacity;
  return k;
}

static const int64_t FP8_PIECES[3] = {16, 4, 1};

moe_rt_status moe_rt_ep_direct_dispatch(moe_rt_ep_direct_group* g, int op_code, const moe_rt_ep_direct_handle* h,
                                        const void* x, int64_t rb, const float* w, const moe_rt_ep_direct_outputs* o,
                                        int barrier, moe_rt_stream stream) {
  static const char op[] = "moe_rt_ep_direct_dispatch";
  mrt_clear_error();
  moe_rt_status st;
  if (!g) return BAD("%s: group is NULL; make one with moe_rt_ep_direct_group_create", op);
  if (op_code != MOE_RT_EP_OP_DISPATCH && op_code != MOE_RT_EP_OP_COMBINE_BWD)
    return BAD("%s: op must be MOE_RT_EP_OP_DISPATCH (1) or MOE_RT_EP_OP_COMBINE_BWD (4), got %d", op, op_code);
  epd_regions r;
  if ((st = check_handle(g, op, h, &r)) || (st = mrt_check_ptr(op, "outputs", o))) return st;
  const moe_rt_ep_handle_desc* hd = &h->desc;
  const int64_t T = h->num_tokens, rows = hd->recv_rows, N = hd->num_rows;
  const int K = hd->topk;
  if (rb < 0 || rb >= ((int64_t)1 << 40)) return BAD("%s: row_bytes must be in [0, 2^40), got %lld", op, (long long)rb);
  if (barrier != 0 && barrier != 1) return BAD("%s: barrier must be 0 or 1, got %d", op, barrier);
  if (o->fp8 < 0 || o->fp8 > 2) return BAD("%s: outputs->fp8 must be 0, 1 or 2, got %d", op, o->fp8);
  if (o->fill != 0 && o->fill != 1) return BAD("%s: outputs->fill must be 0 or 1, got %d", op, o->fill);
  if (o->zero != 0 && o->zero != 1) return BAD("%s: outputs->zero must be 0 or 1, got %d", op, o->zero);
  if (o->fp8 && !o->out && N > 0) return BAD("%s: outputs->out is NULL (an FP8 dispatch expands)", op);
  if (o->fp8 == 1 && !o->out_s && N > 0) return BAD("%s: outputs->out_s is NULL (FP8 codes and scales)", op);
  if (o->fp8 == 2 && !mrt_is_float_dtype(o->out_dtype))
    return BAD("%s: outputs->out_dtype: expected float32, float16 or bfloat16, got %s (%d)", op,
               mrt_dtype_name(o->out_dtype), o->out_dtype);
  if (o->fp8 && (o->hidden < 1 || rb % 16))
    return BAD("%s: an FP8 dispatch needs outputs->hidden >= 1 and packed rows of a multiple of 16 bytes", op);
  if (o->recv_buf && o->out) return BAD("%s: outputs->recv_buf and outputs->out exclude each other", op);
  if (h->exact && !o->row_map) return BAD("%s: outputs->row_map is NULL (exact mode)", op);
  if (T > 0 && rb > 0 && (st = mrt_check_ptr(op, "x", x))) return st;
  if (o->with_w != 0 && o->with_w != 1) return BAD("%s: outputs->with_w must be 0 or 1, got %d", op, o->with_w);
  if ((o->with_w || w) && op_code != MOE_RT_EP_OP_DISPATCH)
    return BAD("%s: weights travel only with MOE_RT_EP_OP_DISPATCH (w NULL, outputs->with_w 0)", op);
  if (w && !o->with_w) return BAD("%s: w is given but outputs->with_w is 0", op);
  if (o->with_w && !w && T > 0) return BAD("%s: outputs->with_w is 1 but w is NULL (T = %lld)", op, (long long)T);
  if (o->tokens_per_expert && op_code != MOE_RT_EP_OP_DISPATCH)
    return BAD("%s: outputs->tokens_per_expert is copied only by MOE_RT_EP_OP_DISPATCH", op);
  if (o->scale != 0 && o->scale != 1) return BAD("%s: outputs->scale must be 0 or 1, got %d", op, o->scale);
  if (o->scale) {
    if (op_code != MOE_RT_EP_OP_COMBINE_BWD || o->fp8 || !o->fill || (N > 0 && (!o->out || !o->out_w)))
      return BAD("%s: outputs->scale needs MOE_RT_EP_OP_COMBINE_BWD, fp8 = 0, fill = 1, out and out_w", op);
    if (!mrt_is_float_dtype(o->out_dtype))
      return BAD("%s: outputs->out_dtype (scale): expected float32, float16 or bfloat16, got %s (%d)", op,
                 mrt_dtype_name(o->out_dtype), o->out_dtype);
    if (rb % mrt_dtype_size(o->out_dtype))
      return BAD("%s: row_bytes %lld is not a whole number of %s elements", op, (long long)rb,
                 mrt_dtype_name(o->out_dtype));
  }
  moe_rt_ep_direct_stage s;
  if ((st = get_stage(g, op, rb, K, &s))) return st;
  const uintptr_t xp = (uintptr_t)x, outp = (uintptr_t)o->out;
  epd_key k = key_of(L_DISPATCH, op_code, barrier, hd);
  k.rb = rb;
  k.N = N;
  k.rows = rows;
  k.fp8 = o->fp8;
  k.out = o->out != NULL;
  k.out_w = o->out_w != NULL;
  k.hidden = o->fp8 ? o->hidden : 0;
  k.out_dtype = o->fp8 == 2 ? o->out_dtype : 0;
  k.stage = (int64_t)(uintptr_t)s.rows_local;
  if (!o->fp8) {
    k.u = mrt_min(unit_of(rb, xp, outp), s.align);
  } else {
    k.u = mrt_min(unit_of(rb, xp, 0), s.align);
    if (k.u != 16) return BAD("%s: packed FP8 rows need 16-byte aligned x and stages", op);
    const int64_t H = o->hidden, S = mrt_cdiv(H, 128), at = mrt_cdiv(H, 4) * 4;
    int64_t piece = 1;
    for (int i = 0; i < 3; ++i)
      if (H % FP8_PIECES[i] == 0 && at % FP8_PIECES[i] == 0 && (4 * S) % FP8_PIECES[i] == 0) {
        piece = FP8_PIECES[i];
        break;
      }
    const int64_t isz = o->fp8 == 1 ? 1 : mrt_dtype_size(o->out_dtype);
    for (int i = 0; i < 3; ++i) {
      const int64_t gp = FP8_PIECES[i], al = mrt_min(16, gp * isz);
      if (gp > piece) continue;
      if (outp % al == 0 && (o->fp8 != 1 || (uintptr_t)o->out_s % al == 0)) {
        k.piece = gp;
        break;
      }
    }
    if (!k.piece) return BAD("%s: outputs->out is not aligned to its dtype's size", op);
  }
  if (o->scale && rb > 0) {
    k.scale = k.u == 16 ? 1 : 2;
    k.out_dtype = o->out_dtype;
    k.vec = rb % 16 == 0 && outp % 16 == 0; /* ep_scale_rows' 16-byte vectors (scale 2) */
  }
  k.make_map = h->exact && o->make_row_map;
  k.copy_w = o->with_w; /* w is NULL on a rank without tokens: its peers' weights still land in recv_wk */
  if (k.copy_w && rb == 0) /* ep_copy_rows of the weights: only where no dispatch kernel runs */
    k.u_w = unit_of(4 * K, (uintptr_t)s.w_local, (uintptr_t)r.at[MOE_RT_EP_RECV_WK]);
  k.recv = h->exact && o->recv_buf != NULL;
  if (k.recv) k.u_recv = unit_of(rb, (uintptr_t)s.rows_local, (uintptr_t)o->recv_buf);
  k.fill = o->fill;
  if (o->fill) {
    /* the empty rows' zeros: written by the dispatch kernel where it runs (its blocks whose pushes are done
       write them while the link carries the rows), else by ep_fill_rows */
    k.zero_rows = o->zero && o->out && rb > 0 && N > 0;
    const int zero = o->zero && o->out && !k.zero_rows;
    k.out = zero;
    const int64_t orb = !zero         ? 0
                        : o->fp8 == 1 ? o->hidden
                        : o->fp8 == 2 ? o->hidden * mrt_dtype_size(o->out_dtype)
                                      : rb;
    k.u_fill = zero ? unit_of(orb, outp, 0) : 16;
    if (zero && o->fp8 == 1) k.u_fill_s = unit_of(4 * mrt_cdiv(o->hidden, 128), (uintptr_t)o->out_s, 0);
  }
  mrt_plan p;
  if ((st = plan_of(g, &k, &p))) return st;
  mrt_args a[MRT_MAX_LAUNCHES];
  memset(a, 0, sizeof a);
  const void* map = h->exact ? o->row_map : NULL;
  for (int i = 0; i < p.num_launches; ++i) {
    const mrt_launch* l = &p.launch[i];
    mrt_args* c = &a[i];
    switch (l->kind) {
      case L_BARRIER: barrier_args(g, op_code, c); break;
      case L_DISPATCH:
        mrt_arg_ptr(c, x);
        mrt_arg_ptr(c, w);
        mrt_arg_ptr(c, s.peer_rows);
        mrt_arg_ptr(c, s.peer_w);
        mrt_arg_ptr(c, g->d.peer_flags);
        mrt_arg_ptr(c, r.at[MOE_RT_EP_SEND_TOK]);
        mrt_arg_ptr(c, r.at[MOE_RT_EP_META]);
        mrt_arg_ptr(c, r.at[MOE_RT_EP_DST_ROW]);
        mrt_arg_ptr(c, o->out);
        mrt_arg_ptr(c, o->fp8 == 1 ? o->out_s : NULL);
        mrt_arg_i32(c, o->fp8 ? o->hidden : 0);
      {
        const int lay_w = o->fill && o->out_w; /* out_w laid out here, its empty rows zeroed by the zero items */
        const int zero_items = (k.zero_rows || lay_w) && N > 0;
        mrt_arg_ptr(c, zero_items ? r.at[MOE_RT_EP_SRC_SLOT] : NULL);
        mrt_arg_i64(c, zero_items ? N : 0);
        mrt_arg_i32(c, (int32_t)k.zero_rows);
        mrt_arg_ptr(c, k.copy_w || lay_w ? r.at[MOE_RT_EP_RECV_WK] : NULL);
        mrt_arg_i32(c, (int32_t)k.copy_w);
        mrt_arg_ptr(c, lay_w ? o->out_w : NULL);
        mrt_arg_ptr(c, r.at[MOE_RT_EP_TOKENS_PER_EXPERT]);
        mrt_arg_ptr(c, o->tokens_per_expert);
        mrt_arg_i32(c, hd->num_local_experts);
      }
        head_args(g, op_code, c);
        mrt_arg_i32(c, hd->pair_capacity);
        mrt_arg_i32(c, K);
        mrt_arg_i32(c, (int32_t)l->arg[0]);
        mrt_arg_i64(c, rb / k.u);
        mrt_arg_i32(c, g->d.node_lo);
        mrt_arg_i32(c, g->d.node_hi);
        break;
      case L_ROW_MAP:
        mrt_arg_ptr(c, r.at[MOE_RT_EP_META]);
        mrt_arg_i32(c, g->d.num_ranks);
        mrt_arg_i32(c, hd->pair_capacity);
        mrt_arg_i64(c, rows);
        mrt_arg_ptr(c, o->row_map);
        break;
      case L_COPY_W: copy_args(g, l, s.w_local, map, r.at[MOE_RT_EP_RECV_WK], rows, c); break;
      case L_COPY_RECV: copy_args(g, l, s.rows_local, map, o->recv_buf, rows, c); break;
      case L_SCALE:
        mrt_arg_ptr(c, o->out);
        mrt_arg_ptr(c, o->out_w);
        mrt_arg_i64(c, N);
        mrt_arg_i64(c, rb / mrt_dtype_size(o->out_dtype));
        break;
      case L_FILL:
      case L_FILL_S:
        mrt_arg_ptr(c, !k.out ? NULL : l->kind == L_FILL ? o->out : (void*)o->out_s);
        mrt_arg_ptr(c, l->kind == L_FILL ? o->out_w : NULL);
        mrt_arg_ptr(c, l->kind == L_FILL && o->out_w ? r.at[MOE_RT_EP_RECV_WK] : NULL);
        mrt_arg_ptr(c, r.at[MOE_RT_EP_SRC_SLOT]);
        mrt_arg_i64(c, N);
        mrt_arg_i64(c, l->arg[0]);
        break;
    }
  }
  if ((st = mrt_run_plan(g->ctx, &p, a, stream))) return st;
  if (!o->tokens_per_expert || k.rb > 0) return MOE_RT_SUCCESS; /* the dispatch kernel copied it */
  return mrt_copy_d2d(g->ctx, o->tokens_per_expert, r.at[MOE_RT_EP_TOKENS_PER_EXPERT],
                      4 * (size_t)hd->num_local_experts, stream);
}

moe_rt_status moe_rt_ep_direct_combine(moe_rt_ep_direct_group* g, int op_code, const moe_rt_ep_direct_handle* h,
                                       const void* y, int dtype, int64_t H, const float* w, const float* grad_rows,
                                       float* slot_grads, void* out, float* grad_w, int barrier, moe_rt_stream stream) {
  static const char op[] = "moe_rt_ep_direct_combine";
  mrt_clear_error();
  moe_rt_status st;
  if (!g) return BAD("%s: group is NULL; make one with moe_rt_ep_direct_group_create", op);
  if (op_code != MOE_RT_EP_OP_COMBINE && op_code != MOE_RT_EP_OP_DISPATCH_BWD)
    return BAD("%s: op must be MOE_RT_EP_OP_COMBINE (2) or MOE_RT_EP_OP_DISPATCH_BWD (3), got %d", op, op_code);
  epd_regions r;
  if ((st = check_handle(g, op, h, &r))) return st;
  if (!mrt_is_float_dtype(dtype))
    return BAD("%s: dtype: expected float32, float16 or bfloat16, got %s (%d)", op, mrt_dtype_name(dtype), dtype);
  if (H < 0 || H >= ((int64_t)1 << 31)) return BAD("%s: hidden must be in [0, 2^31), got %lld", op, (long long)H);
  if (barrier != 0 && barrier != 1) return BAD("%s: barrier must be 0 or 1, got %d", op, barrier);
  const moe_rt_ep_handle_desc* hd = &h->desc;
  const int64_t T = h->num_tokens, N = hd->num_rows, rows = hd->recv_rows;
  const int K = hd->topk;
  if ((st = mrt_check_data(op, "out", out, T * H))) return st;
  /* empty arrays may come as NULL: the pairs are checked where both hold elements */
  if (grad_rows && !slot_grads && rows * K > 0) return BAD("%s: grad_rows needs slot_grads", op);
  if (op_code == MOE_RT_EP_OP_COMBINE && (grad_rows || slot_grads || grad_w))
    return BAD("%s: grad_rows, slot_grads and grad_w must be NULL for MOE_RT_EP_OP_COMBINE", op);
  if (!slot_grads != !grad_w && rows * K > 0 && T > 0) return BAD("%s: slot_grads and grad_w come together", op);
  if (N > 0 && H > 0 && (st = mrt_check_ptr(op, "y", y))) return st;
  moe_rt_ep_direct_stage s;
  if ((st = get_stage(g, op, H * mrt_dtype_size(dtype), K, &s))) return st;
  const uintptr_t yp = (uintptr_t)(N > 0 && H > 0 ? y : NULL), outp = (uintptr_t)out;
  epd_key k = key_of(L_COMBINE, op_code, barrier, hd);
  k.T = T;
  k.H = H;
  k.rows = rows;
  k.dtype = dtype;
  k.slot_values = grad_rows != NULL;
  k.vec = (H * mrt_dtype_size(dtype)) % 16 == 0 && yp % 16 == 0 && outp % 16 == 0 && s.align == 16;
  mrt_plan p;
  if ((st = plan_of(g, &k, &p))) return st;
  mrt_args a[MRT_MAX_LAUNCHES];
  memset(a, 0, sizeof a);
  for (int i = 0; i < p.num_launches; ++i) {
    const mrt_launch* l = &p.launch[i];
    mrt_args* c = &a[i];
    if (l->kind == L_SLOT_VALUES) {
      mrt_arg_ptr(c, N ? grad_rows : NULL);
      mrt_arg_ptr(c, r.at[MOE_RT_EP_DST_ROW]);
      mrt_arg_ptr(c, slot_grads);
      mrt_arg_i64(c, rows * K);
    } else if (l->kind == L_BARRIER) {
      barrier_args(g, op_code, c);
    } else {
      mrt_arg_ptr(c, (const void*)yp);
      mrt_arg_ptr(c, w);
      mrt_arg_ptr(c, slot_grads);
      mrt_arg_ptr(c, s.peer_rows);
      mrt_arg_ptr(c, s.peer_w);
      mrt_arg_ptr(c, g->d.peer_flags);
      mrt_arg_ptr(c, r.at[MOE_RT_EP_DST_ROW]);
      mrt_arg_ptr(c, r.at[MOE_RT_EP_SEND_POS]);
      mrt_arg_ptr(c, r.at[MOE_RT_EP_ROUTING]);
      mrt_arg_ptr(c, r.at[MOE_RT_EP_META]);
      mrt_arg_ptr(c, out);
      mrt_arg_ptr(c, grad_w);
      head_args(g, op_code, c);
      mrt_arg_i32(c, hd->pair_capacity);
      mrt_arg_i32(c, K);
      mrt_arg_i32(c, hd->num_local_experts);
      mrt_arg_i32(c, hd->max_tokens_per_rank);
      mrt_arg_i32(c, (int32_t)T);
      mrt_arg_i32(c, (int32_t)l->arg[0]);
      mrt_arg_i64(c, H);
      mrt_arg_i32(c, g->d.node_lo);
      mrt_arg_i32(c, g->d.node_hi);
    }
  }
  return mrt_run_plan(g->ctx, &p, a, stream);
}
