// Expert parallelism (moe_rt/ep.py, docs/ep.md §2-§3): the device side of prepare (per-pair membership
// scans and counts, offsets and flags, the received rows' local routing), the row pack
// before the NCCL send/recv, and the owner-side fixed-order sum over ranks after the reverse transfer.
//
// Handle regions (include/moe_rt/moe_rt.h) are passed as separate pointers. Every result is written by
// exactly one thread in a fixed order: no atomics, so plans and sums are bitwise reproducible (the one
// atomic is the error word's record of a bad expert id, which no result depends on).
#include "moe_rt/common.cuh"
#include "moe_rt/fp8.cuh"
#include "moe_rt/plan.cuh"

using namespace moe_rt;

// int32 indices in the meta region (moe_rt.h: MOE_RT_EP_META_*).
#define META_SEND_COUNTS(R) 0
#define META_RECV_COUNTS(R) (R)
#define META_RECV_SLOTS(R) (2 * (R))
#define META_SEND_OFF(R) (3 * (R))
#define META_RECV_OFF(R) (4 * (R) + 1)
#define META_PAIR_OVERFLOW(R) (5 * (R) + 2)
#define META_EXPERT_OVERFLOW(R) (5 * (R) + 3)
#define META_TOTAL_SLOTS(R) (5 * (R) + 4)
#define META_NUM_TOKENS(R) (5 * (R) + 5)
#define META_RECV_ROWS(R) (5 * (R) + 6)
#define META_SEND_ROWS(R) (5 * (R) + 7)

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The phase trace (MOE_RT_LL_TRACE, off by default; tools/profile_ll_phases.py reads it): thread 0 of each
// block b < LL_TRACE_BLOCKS stores %globaltimer (ns) at phase points into moe_rt_ll_trace[b][p], a module
// global (each kernel's program has its own copy; the host zeroes it before a run), and at entry (p = 0) its
// SM id and the grid size into [b][LL_TRACE_POINTS - 1] (smid << 32 | gridDim.x). LL_TRACE(p): the last time
// the block passes p; LL_TRACE_FIRST(p): the first; LL_TRACE_SYNC(p): after a block barrier (every thread's
// loads and stores before it issued). The points (ep_ll_dispatch and ep_ll_dispatch_fp8 / ep_ll_combine):
//   0 entry, 1 after block_epoch, 2 first push item's start, 3 first push item's rows start (after its row
//   table), 4 last push item's rows issued, 5 last push item's flags signaled;
//   dispatch: 6 flag wait start, 7 flag wait end, 8 dedup copies (or FP8 dequantization) end, 9 slot tables
//   end, 10 exit;
//   combine: 6 owner items start, 7 first owner item's flags acquired, 8 last owner item's flags acquired,
//   9 owner sums issued, 10 exit;
//   ep_prepare_direct: 0 entry, 1 routing copied, 2 chunk counts done, 3 after the first grid barrier, 4 chunks
//   placed and pushed, 6 after the peers' barrier, 7 the plan's counts and offsets (after its block barrier),
//   8 the received rows placed, 10 exit; a chunk's steps (the block's last chunk): 11 its counts before, 12 its
//   tokens placed, 13 its slots counted, 14 its slot prefixes.
// Without the macro the points expand to nothing: the kernels' code is unchanged.
#ifdef MOE_RT_LL_TRACE
constexpr int LL_TRACE_BLOCKS = 1024, LL_TRACE_POINTS = 16;
__device__ unsigned long long moe_rt_ll_trace[LL_TRACE_BLOCKS * LL_TRACE_POINTS];
__device__ __forceinline__ void ll_trace(int p, bool first) {
  if (threadIdx.x != 0 || blockIdx.x >= LL_TRACE_BLOCKS) return;
  unsigned long long* row = moe_rt_ll_trace + (i64)blockIdx.x * LL_TRACE_POINTS;
  if (first && row[p] != 0) return;
  row[p] = global_timer_ns();
  if (p == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    row[LL_TRACE_POINTS - 1] = ((unsigned long long)sm << 32) | gridDim.x;
  }
}
#define LL_TRACE(p) ll_trace(p, false)
#define LL_TRACE_FIRST(p) ll_trace(p, true)
#define LL_TRACE_SYNC(p) (__syncthreads(), ll_trace(p, false))
#else
#define LL_TRACE(p) ((void)0)
#define LL_TRACE_FIRST(p) ((void)0)
#define LL_TRACE_SYNC(p) ((void)0)
#endif

// ---- prepare (moe_rt/ep.py _prepare_cuda) -----------------------------------------------------------
// Only counts and the sent rows' own routing cross between ranks; no rank sees another's whole routing table.
// A "box" holds one segment of SEG = CW + P*W int32 words per (source, destination) pair: the counts (CW = L
// + 2 words: tokens of the pair before pair-capacity drops, local expert slots of the kept tokens, then those
// of each local expert l) and the rows (P rows of W = 2K + 1 words: row j the j-th kept token t of the pair,
// then the local ids of its K experts on the destination (-1 for the others), then each such slot's rank
// among the pair's kept slots of that local expert in (t, k) order). Where the segments go (Segments below):
// - direct transport: every rank's box (IPC-shared, peer_box[r]) holds the segments its sources push into it
//   (segment s from source s, written over peer memory: stores never wait) in two halves of half_ints words
//   picked by the parity of the barrier epoch: a source writes the half of epoch state[0] + 1 before
//   prepare's barrier advances the epoch to it, and the destination reads its own box after; a source
//   rewrites a half only two epochs later, after its destination has passed a barrier (or a prepare's
//   barrier) that follows its read;
// - NCCL transport: a local outbox (segment d for destination d != me) sent with grouped send/recv into the
//   destinations' inbox (segment s from source s); the own segment is written to the inbox straight away.
// With the ranks and every source's per-expert counts, the destination places every slot in the expert-major
// layout without another pass over the slots (ep_prepare_plan).
//
// The send side runs on many blocks: the tokens of each destination d are split into B chunks of TC tokens
// (work item d*B + c); a first phase counts each chunk's member tokens and its slots per local expert (into
// the scratch `part`: [R*B] token counts, then [R*B][L] slot counts), a grid-wide barrier (grid_sync), then
// every item places its chunk from the counts of the chunks before it. The grid is at most one resident wave.

__device__ __forceinline__ unsigned ld_acquire_gpu_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A barrier over every block of the grid (all resident). gs: two uint32 of the group's device memory
// (arrivals, generation), zero when made; the last block to arrive resets the arrivals and advances the
// generation, so any grid size may use them next and CUDA-graph replays stay valid. SYS: the blocks' earlier
// writes (to peer memory too) are fenced at system scope before they arrive.
template <bool SYS>
__device__ __forceinline__ void grid_sync(unsigned* gs) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = ld_acquire_gpu_u32(gs + 1);
    if (SYS) __threadfence_system(); else __threadfence();
    if (atomicAdd(gs, 1u) == gridDim.x - 1) {
      atomicExch(gs, 0u);
      __threadfence();
      atomicAdd(gs + 1, 1u);
    } else {
      while (ld_acquire_gpu_u32(gs + 1) == gen) __nanosleep(32);
    }
    __threadfence();
  }
  __syncthreads();
}

// Block-wide sums of a and b (every thread gets them).
__device__ __forceinline__ void block_sum2(int a, int b, int* scratch, int* sa, int* sb) {
  block_inclusive_scan(a, scratch, sa);
  block_inclusive_scan(b, scratch, sb);
}

// The key of each flat slot g = f + 32 u (u < U; g < end) of the chunk from token t0: its local expert when that
// lives on [lo, hi) and its token is kept for the pair (kp[g / K - t0] >= 0, shared memory), else -1. The U ids
// are loaded before any is looked at.
template <int U, typename IdxT>
__device__ __forceinline__ void kept_slot_keys(const IdxT* __restrict__ idx, i64 f, i64 end, int K, i64 lo, i64 hi,
                                               i64 t0, const int* kp, int* key) {
  i64 e[U];
#pragma unroll
  for (int u = 0; u < U; ++u) e[u] = f + 32 * u < end ? (i64)idx[f + 32 * u] : -1;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const i64 g = f + 32 * u;
    key[u] = (g < end && e[u] >= lo && e[u] < hi && kp[g / K - t0] >= 0) ? (int)(e[u] - lo) : -1;
  }
}

// The send side of prepare, run by every block of the grid (the kernels ep_prepare_send and
// ep_prepare_direct). Spread over the blocks, this rank's routing into the handle: routing[i] for i <
// Tmax*K the expert id of flat slot i (-1 for no expert, ids outside [0, E) and rows t >= T),
// routing[Tmax*K] = T; ids outside [-1, E) are recorded in the device's error word `err` (common.cuh) and
// count as -1. Per destination d the tokens in ascending order (a token is a member of the pair (me, d)
// when one of its experts lives on d): send_tok[d][pos] = t, send_pos[d][t] = pos (or -1), meta
// send_counts[d]; positions >= P (pair capacity) are dropped, list entries past the kept count are -1; each
// kept token's box row and the pair's counts go to segment `me` of d's box (direct: peer_box[d], the half
// of epoch state[0] + 1) or segment d of the outbox (NCCL; the inbox for d = me). The ranks: within a
// chunk, warps [0, nw) take contiguous ranges of its flat slots t*K + k (each a multiple of 32 long): a
// per-warp count of each local expert's kept slots (warp match), an exclusive scan over the warps starting
// from the kept slots of the chunks before, then the same walk again assigning ranks (the permutation plan's
// method). The item holding the pair's last kept token (item c = 0 when none is kept) writes the counts.
// Dynamic shared memory: (nw + 1)*L + TC ints (sm), and where it holds them TC*(2K + 1) more (the staged rows).
template <typename IdxT>
__device__ void prepare_send_body(const IdxT* __restrict__ idx, i64 T, int Tmax, int K, int E, int R, int me,
                                  int L, int P, int TC, int B, int* __restrict__ routing, int* __restrict__ send_tok,
                                  int* __restrict__ send_pos, int* __restrict__ meta, unsigned s0,
                                  i64 half_ints, const long long* __restrict__ peer_box, int* __restrict__ outbox,
                                  int* __restrict__ inbox, unsigned* __restrict__ err, int nw, int* __restrict__ part,
                                  unsigned* __restrict__ gs, int* sm) {
  __shared__ int scratch[32];
  const i64 n = (i64)Tmax * K;
  const i64 valid = T * K;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i <= n; i += (i64)gridDim.x * blockDim.x) {
    if (i == n) {
      routing[i] = (int)T;
    } else if (i < valid) {
      const i64 e = (i64)idx[i];
      const bool ok = e >= 0 && e < E;
      if (!ok && e != -1) record_bad_expert_id(err, MOE_RT_ERR_EP_PREPARE, e, i, E);
      routing[i] = ok ? (int)e : -1;
    } else {
      routing[i] = -1;
    }
  }
  LL_TRACE(1);
  const int items = R * B;
  int* tok_part = part;              // [R*B] member tokens of each chunk
  int* slot_part = part + items;     // [R*B][L] member slots of each local expert in each chunk
  int* kp = sm + (i64)nw * L;        // [TC]: phase 1 membership, phase 2 the kept position (-1: not kept)
  int* pre = kp + TC;                // [L]: phase 2, each local expert's slots in the chunks before
  // [TC][2K + 1]: phase 2, the chunk's kept box rows, staged where the dynamic shared memory holds them (the
  // planner adds them when they fit), then copied into the destination's box whole: coalesced stores into the
  // peer's memory, not each row's words scattered one by one.
  int* stg = pre + L;
  unsigned dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  const bool staged = (i64)dyn_smem >= 4 * ((i64)(nw + 1) * L + TC + (i64)TC * (2 * K + 1));
  // phase 1: each chunk's counts
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int d = item / B, c = item - d * B;
    const i64 lo = (i64)d * L, hi = lo + L;
    const i64 t0 = (i64)c * TC, t1 = min(t0 + TC, T);
    for (int l = threadIdx.x; l < L; l += blockDim.x) sm[l] = 0;
    for (int j = threadIdx.x; j < TC; j += blockDim.x) kp[j] = 0;
    __syncthreads();
    for (i64 f = t0 * K + threadIdx.x; f < t1 * K; f += blockDim.x) {
      const i64 e = (i64)idx[f];
      if (e >= lo && e < hi) {
        atomicAdd(sm + (e - lo), 1);
        kp[f / K - t0] = 1;
      }
    }
    __syncthreads();
    int members = 0;
    for (int j = threadIdx.x; j < TC; j += blockDim.x) members += kp[j];
    int total;
    block_inclusive_scan(members, scratch, &total);
    if (threadIdx.x == 0) tok_part[item] = total;
    for (int l = threadIdx.x; l < L; l += blockDim.x) slot_part[(i64)item * L + l] = sm[l];
    __syncthreads();
  }
  LL_TRACE(2);
  grid_sync<false>(gs);
  LL_TRACE(3);
  const int W = 2 * K + 1, CW = L + 2;
  const i64 SEG = CW + (i64)P * W;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // phase 2: each chunk placed after the chunks before it
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int d = item / B, c = item - d * B;
    const i64 lo = (i64)d * L, hi = lo + L;
    const i64 t0 = (i64)c * TC, t1 = min(t0 + TC, T);
    int* cnt_d = peer_box != nullptr
                     ? reinterpret_cast<int*>(peer_box[d]) + (i64)((s0 + 1u) & 1u) * half_ints + SEG * me
                     : (d == me ? inbox : outbox) + SEG * d;
    int* rows_d = cnt_d + CW;
    if (item == 0 && threadIdx.x == 0) meta[META_NUM_TOKENS(R)] = (int)T;
    // The chunk's first loads, issued together: the member tokens of d's chunks (before c, and all) and the
    // slots of each local expert in the chunks before c, summed into pre[l] (shared-memory adds of integers:
    // their order does not matter) after the barrier that follows the previous chunk's last read of pre; the
    // barriers of block_sum2 order the adds before any read.
    constexpr int PU = 8;
    const int* sp = slot_part + (i64)d * B * L;
    const int n = c * L;
    int pv[PU];
#pragma unroll
    for (int u = 0; u < PU; ++u) {
      const int i = threadIdx.x + u * blockDim.x;
      pv[u] = i < n ? __ldcg(sp + i) : 0;
    }
    int before = 0, all = 0;
    for (int j = threadIdx.x; j < B; j += blockDim.x) {
      const int v = __ldcg(tok_part + (i64)d * B + j);
      all += v;
      before += j < c ? v : 0;
    }
    for (int l = threadIdx.x; l < L; l += blockDim.x) pre[l] = 0;
    __syncthreads();
#pragma unroll
    for (int u = 0; u < PU; ++u)
      if (pv[u] != 0) atomicAdd(pre + (threadIdx.x + u * blockDim.x) % L, pv[u]);
    for (int i0 = threadIdx.x + PU * blockDim.x; i0 < n; i0 += PU * blockDim.x) {  // c*L > PU*blockDim
#pragma unroll
      for (int u = 0; u < PU; ++u) {
        const int i = i0 + u * blockDim.x;
        pv[u] = i < n ? __ldcg(sp + i) : 0;
      }
#pragma unroll
      for (int u = 0; u < PU; ++u)
        if (pv[u] != 0) atomicAdd(pre + (i0 + u * blockDim.x) % L, pv[u]);
    }
    int base, carry;
    block_sum2(before, all, scratch, &base, &carry);
    LL_TRACE(11);
    int run = base;
    for (i64 r0 = t0; r0 < t0 + TC; r0 += blockDim.x) {
      const i64 t = r0 + threadIdx.x;
      int flag = 0;
      if (t < t1) {
        const IdxT* row = idx + t * K;
        for (int k = 0; k < K; ++k) {
          const i64 e = (i64)row[k];
          flag |= e >= lo && e < hi;
        }
      }
      int total;
      const int incl = block_inclusive_scan(flag, scratch, &total);
      const int pos = run + incl - flag;
      const bool kept = flag && pos < P;
      if (t < t0 + TC) kp[t - t0] = kept ? pos : -1;
      if (kept) {
        send_tok[(i64)d * P + pos] = (int)t;
        const IdxT* row = idx + t * K;
        int* o = staged ? stg + (i64)(pos - base) * W : rows_d + (i64)pos * W;
        o[0] = (int)t;
        for (int k = 0; k < K; ++k) {
          const i64 e = (i64)row[k];
          o[1 + k] = (e >= lo && e < hi) ? (int)(e - lo) : -1;
        }
      }
      if (t < t1) send_pos[(i64)d * Tmax + t] = kept ? pos : -1;
      run += total;
    }
    __syncthreads();  // kp complete
    LL_TRACE(12);
    // the rest of d's lists, spread over its chunks: send_pos of rows t >= T, send_tok past the kept count
    const int kept_n = carry < P ? carry : P;
    for (i64 t = T + (i64)c * blockDim.x + threadIdx.x; t < Tmax; t += (i64)B * blockDim.x)
      send_pos[(i64)d * Tmax + t] = -1;
    for (i64 p = kept_n + (i64)c * blockDim.x + threadIdx.x; p < P; p += (i64)B * blockDim.x)
      send_tok[(i64)d * P + p] = -1;
    const bool writer = kept_n == 0 ? c == 0 : (base <= kept_n - 1 && kept_n - 1 < run);
    if (base >= P && !writer) continue;  // nothing of this chunk is kept (uniform over the block)
    int* hw = sm + (i64)warp * L;
    constexpr int GU = 4;  // groups of 32 slots whose ids a lane loads before it matches the first
    const i64 nslots = (t1 - t0) * K;
    const i64 span = nslots > 0 ? ((nslots + nw - 1) / nw + 31) / 32 * 32 : 0;
    const i64 begin = t0 * K + (i64)warp * span, end = min(begin + span, t1 * K);
    if (warp < nw) {
      for (int l = lane; l < L; l += 32) hw[l] = 0;
      __syncwarp();
      for (i64 f0 = begin; f0 < end; f0 += 32 * GU) {
        int key[GU];
        kept_slot_keys<GU>(idx, f0 + lane, end, K, lo, hi, t0, kp, key);
#pragma unroll
        for (int u = 0; u < GU; ++u) {
          const unsigned peers = __match_any_sync(0xffffffffu, key[u]);
          if (key[u] >= 0 && lane == __ffs(peers) - 1) hw[key[u]] += __popc(peers);
          __syncwarp();
        }
      }
    }
    __syncthreads();
    LL_TRACE(13);
    int slots = 0;
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      int acc = pre[l];  // kept slots of l in the chunks before (every one of them is wholly kept)
      for (int w = 0; w < nw; ++w) {
        const int v = sm[(i64)w * L + l];
        sm[(i64)w * L + l] = acc;
        acc += v;
      }
      if (writer) cnt_d[2 + l] = acc;
      slots += acc;
    }
    LL_TRACE(14);
    int slots_total;
    block_inclusive_scan(slots, scratch, &slots_total);
    if (writer && threadIdx.x == 0) {
      meta[META_SEND_COUNTS(R) + d] = carry;
      cnt_d[0] = carry;
      cnt_d[1] = slots_total;
    }
    __syncthreads();
    if (warp < nw) {
      const unsigned lt = lanemask_lt();
      for (i64 f0 = begin; f0 < end; f0 += 32 * GU) {
        int key[GU];
        kept_slot_keys<GU>(idx, f0 + lane, end, K, lo, hi, t0, kp, key);
#pragma unroll
        for (int u = 0; u < GU; ++u) {
          const i64 f = f0 + 32 * u + lane;
          const unsigned peers = __match_any_sync(0xffffffffu, key[u]);
          if (key[u] >= 0) {
            const i64 t = f / K;
            const int pr = kp[t - t0];
            (staged ? stg + (i64)(pr - base) * W : rows_d + (i64)pr * W)[1 + K + (f - t * K)] =
                hw[key[u]] + __popc(peers & lt);
          }
          __syncwarp();
          if (key[u] >= 0 && lane == __ffs(peers) - 1) hw[key[u]] += __popc(peers);
          __syncwarp();
        }
      }
    }
    __syncthreads();
    if (staged) {  // the kept rows [base, min(run, P)): one contiguous run of words in the box
      const i64 words = (i64)max(0, min(run, P) - base) * W;
      int* dst = rows_d + (i64)base * W;
      for (i64 i = threadIdx.x; i < words; i += blockDim.x) dst[i] = stg[i];
    }
  }
}

// NCCL transport, and the direct transport in exact mode (Segments: peer_box given, each destination's
// segment pushed into its box; state: the transport's, whose barrier follows). gs: grid_sync's words.
template <typename IdxT>
__global__ void __launch_bounds__(256, 2) ep_prepare_send(const IdxT* __restrict__ idx, i64 T, int Tmax, int K, int E, int R, int me, int L,
                                int P, int TC, int B, int* __restrict__ routing, int* __restrict__ send_tok,
                                int* __restrict__ send_pos, int* __restrict__ meta, const unsigned* __restrict__ state,
                                i64 half_ints, const long long* __restrict__ peer_box, int* __restrict__ outbox,
                                int* __restrict__ inbox, unsigned* __restrict__ err, int nw, int* __restrict__ part,
                                unsigned* __restrict__ gs) {
  extern __shared__ int sm[];
  prepare_send_body(idx, T, Tmax, K, E, R, me, L, P, TC, B, routing, send_tok, send_pos, meta,
                    state != nullptr ? state[0] : 0u, half_ints, peer_box, outbox, inbox, err, nw, part, gs, sm);
}

// Where a destination finds the segment source s sent it: segment s of `inbox` (the NCCL inbox, or the
// direct transport's own box from word `at`: the half of the current epoch).
struct Segments {
  const int* inbox;
  i64 seg;

  __device__ Segments(const int* inbox_, i64 seg_, i64 at) : inbox(inbox_ + at), seg(seg_) {}

  __device__ __forceinline__ const int* of(int s) const { return inbox + s * seg; }
};

// The word of a box where the half of the current epoch (state[0], advanced by prepare's barrier) starts:
// 0 without state (NCCL).
__device__ __forceinline__ i64 box_half(const unsigned* state, i64 half_ints) {
  return state != nullptr ? (i64)(state[0] & 1u) * half_ints : 0;
}

// Offsets and flags (one thread; R is small), after the segments arrived (word 0 of source s's segment: its
// tokens for this rank, word 1: the kept slots). Exact mode (exact = 1): segments packed back to back with
// the kept counts; capacity mode: every segment is P rows. The own destination takes no send rows.
// capacity < 0: no expert-major capacity.
__device__ void plan_meta_body(int* __restrict__ meta, const Segments& in, int R, int me, int P, int exact,
                               i64 capacity) {
  int pair_over = 0;
  i64 o = 0, send_rows = 0;
  for (int d = 0; d < R; ++d) {
    const int c = meta[META_SEND_COUNTS(R) + d];
    pair_over |= c > P;
    meta[META_SEND_OFF(R) + d] = (int)o;
    if (d != me) {
      const int kept = c < P ? c : P;
      o += exact ? kept : P;
      send_rows += kept;
    }
  }
  meta[META_SEND_OFF(R) + R] = (int)o;
  o = 0;
  i64 recv_rows = 0, slots = 0;
  for (int s = 0; s < R; ++s) {
    const int* cs = in.of(s);
    const int c = cs[0], sl = cs[1];
    meta[META_RECV_COUNTS(R) + s] = c;
    meta[META_RECV_SLOTS(R) + s] = sl;
    pair_over |= c > P;
    const int kept = c < P ? c : P;
    meta[META_RECV_OFF(R) + s] = (int)o;
    o += exact ? kept : P;
    recv_rows += kept;
    slots += sl;
  }
  meta[META_RECV_OFF(R) + R] = (int)o;
  meta[META_PAIR_OVERFLOW(R)] = pair_over;
  meta[META_EXPERT_OVERFLOW(R)] = (capacity >= 0 && slots > capacity) ? 1 : 0;
  meta[META_TOTAL_SLOTS(R)] = (int)slots;
  meta[META_RECV_ROWS(R)] = (int)recv_rows;
  meta[META_SEND_ROWS(R)] = (int)send_rows;
  meta[META_SEND_ROWS(R) + 1] = 0;  // the region's spare words
  meta[META_SEND_ROWS(R) + 2] = 0;
}

// The received side's common start (thread 0 of each block): block 0 writes meta (plan_meta_body); every block
// derives the received rows' segments: seg[s] = first row of source s (s <= R), seg[R + 1 + s] = its kept
// count (seg: 2R + 1 ints of shared memory).
__device__ void recv_segments(int* __restrict__ meta, const Segments& in, int R, int me, int P, int exact,
                              i64 capacity, int* __restrict__ seg) {
  if (blockIdx.x == 0) plan_meta_body(meta, in, R, me, P, exact, capacity);
  int o = 0;
  for (int s = 0; s < R; ++s) {
    const int c = in.of(s)[0];
    const int kept = c < P ? c : P;
    seg[s] = o;
    seg[R + 1 + s] = kept;
    o += exact ? kept : P;
  }
  seg[R] = o;
}

// recv_tok[s][j] = the token of row j of source s's segment (rows at word CW; -1 past the kept count),
// grid-stride from `first`.
__device__ void recv_tokens(const Segments& in, int CW, const int* __restrict__ seg, int R, int P, int W, i64 first,
                            i64 step, int* __restrict__ recv_tok) {
  for (i64 i = first; i < (i64)R * P; i += step) {
    const int s = (int)(i / P);
    const i64 j = i - (i64)s * P;
    recv_tok[i] = j < seg[R + 1 + s] ? in.of(s)[CW + j * W] : -1;
  }
}

// The segment row of received row `row` (nullptr for an unused row) and its source (*src).
__device__ __forceinline__ const int* recv_box_row(i64 row, const Segments& in, int CW,
                                                   const int* __restrict__ seg, int R, int W, int* src) {
  for (int s = 0; s < R; ++s) {
    if (row >= seg[s] && row < (i64)seg[s] + seg[R + 1 + s]) {
      *src = s;
      return in.of(s) + CW + (row - seg[s]) * W;
    }
  }
  return nullptr;
}

// plan_meta_body as a kernel of one thread: exact mode, whose host read of the counts sizes the handle
// before the received side's kernel runs (which writes the same meta again). Segments: the NCCL inbox or
// the direct transport's own box (with state and half_ints); seg words each.
#if MOE_RT_WANTS(ep_plan_meta)
extern "C" __global__ void ep_plan_meta(int* __restrict__ meta, const int* __restrict__ inbox, i64 seg_words,
                                        const unsigned* __restrict__ state, i64 half_ints, int R, int me, int P,
                                        int exact, i64 capacity) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  plan_meta_body(meta, Segments(inbox, seg_words, box_half(state, half_ints)), R, me, P, exact, capacity);
}
#endif

// The received side of the plan once the segments arrived (Segments as ep_plan_meta). Block 0's thread 0 writes
// the meta region (plan_meta_body); every block derives the received rows' segments itself (dynamic shared
// memory: 2R + 1 ints). recv_tok[s][j] = the token (-1 past the kept count); recv_local[row][k] = the local
// id of the k-th expert of the token received in `row` when it lives on this rank, else -1 (-1 for every k of
// an unused row): a routing for the permutation plan with L experts.
#if MOE_RT_WANTS(ep_prepare_recv)
extern "C" __global__ void ep_prepare_recv(int* __restrict__ meta, const int* __restrict__ inbox, i64 seg_words,
                                           const unsigned* __restrict__ state, i64 half_ints, int R, int me, int P,
                                           int K, int L, int exact, i64 capacity, i64 rows,
                                           int* __restrict__ recv_tok, int* __restrict__ recv_local) {
  extern __shared__ int seg[];  // recv_segments
  const Segments in(inbox, seg_words, box_half(state, half_ints));
  if (threadIdx.x == 0) recv_segments(meta, in, R, me, P, exact, capacity, seg);
  __syncthreads();
  const int W = 2 * K + 1, CW = L + 2;
  const i64 step = (i64)gridDim.x * blockDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  recv_tokens(in, CW, seg, R, P, W, first, step, recv_tok);
  for (i64 row = first; row < rows; row += step) {
    int src;
    const int* r = recv_box_row(row, in, CW, seg, R, W, &src);
    int* out = recv_local + row * K;
    for (int k = 0; k < K; ++k) out[k] = r != nullptr ? r[1 + k] : -1;
  }
}
#endif

// The whole received side of the plan (ep_prepare_recv's outputs, and the permutation plan's of recv_local
// without a pass of its own), run by every block of the grid (the kernels ep_prepare_plan and
// ep_prepare_direct). Every block loads every source's counts into shared memory (one pass) and derives from
// the per-expert ones: pre[s][l] = slots of local expert l from sources before s, the totals, and the plan's
// offsets (plan_offsets_block: num_out = capacity, or every slot when capacity < 0). Slot (row, k) of source
// s with local expert l and rank q (the sender's) is the expert-major slot p = pre[s][l] + q of l: kept when
// p < kept[l], at row seg_start[l] + p (dst_row; src_slot there = row*K + k), else dropped (-1). src_slot is
// -1 on padding rows and past seg_start[L] (the rows no slot reaches). Block 0 writes meta (plan_meta_body),
// seg_start, expert_counts and tokens_per_expert. Shared memory (sm): 2R + 1 + R*(L + 2) + 4L + 1 ints.
__device__ void prepare_plan_body(int* __restrict__ meta, const Segments& in, int R, int me, int P, int K, int L,
                                  int align, int exact, i64 capacity, i64 rows, i64 N, int* __restrict__ recv_tok,
                                  int* __restrict__ recv_local, int* __restrict__ dst_row, int* __restrict__ src_slot,
                                  int* __restrict__ seg_start, int* __restrict__ expert_counts,
                                  int* __restrict__ tokens_per_expert, int* sm) {
  const int W = 2 * K + 1, CW = L + 2;
  int* seg = sm;                 // recv_segments
  int* cnt = seg + 2 * R + 1;    // [R][CW]: every source's counts; then word 2 + l holds pre[s][l]
  int* tot = cnt + (i64)R * CW;  // [L]
  int* kept = tot + L;           // [L]
  int* padded = kept + L;        // [L]
  int* start = padded + L;       // [L + 1]
  for (i64 i = threadIdx.x; i < (i64)R * CW; i += blockDim.x) {  // one pass of loads
    const int s = (int)(i / CW);
    cnt[i] = in.of(s)[i - (i64)s * CW];
  }
  __syncthreads();
  const Segments counts(cnt, CW, 0);  // the same counts, from shared memory
  if (threadIdx.x == 0) recv_segments(meta, counts, R, me, P, exact, capacity, seg);
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int run = 0;
    for (int s = 0; s < R; ++s) {
      int* c = cnt + (i64)s * CW + 2 + l;
      const int v = *c;
      *c = run;
      run += v;
    }
    tot[l] = run;
  }
  __syncthreads();
  plan_offsets_block<false>(tot, L, align, capacity < 0 ? ((i64)1 << 62) : capacity, kept, padded, start);
  __syncthreads();
  LL_TRACE(7);
  if (blockIdx.x == 0) {
    for (int l = threadIdx.x; l <= L; l += blockDim.x) {
      seg_start[l] = start[l];
      if (l < L) {
        expert_counts[l] = kept[l];
        tokens_per_expert[l] = padded[l];
      }
    }
  }
  const i64 step = (i64)gridDim.x * blockDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  recv_tokens(in, CW, seg, R, P, W, first, step, recv_tok);
  // one slot (row, k) a thread: its two words of the box row loaded together, every store coalesced
  for (i64 i = first; i < rows * K; i += step) {
    const i64 row = i / K;
    const int k = (int)(i - row * K);
    int src = 0;
    const int* r = recv_box_row(row, in, CW, seg, R, W, &src);
    const int l = r != nullptr ? r[1 + k] : -1;
    const int q = r != nullptr ? r[1 + K + k] : 0;
    int d = -1;
    if (l >= 0) {
      const i64 p = (i64)cnt[(i64)src * CW + 2 + l] + q;
      if (p < kept[l]) {
        d = (int)(start[l] + p);
        src_slot[d] = (int)i;
      }
    }
    recv_local[i] = l;
    dst_row[i] = d;
  }
  LL_TRACE(8);
  for (i64 n = first; n < N; n += step) {
    if (n >= start[L]) {
      src_slot[n] = -1;
      continue;
    }
    int a = 0, b = L - 1;  // the last l with start[l] <= n (start[0] = 0 <= n)
    while (a < b) {
      const int m = (a + b + 1) >> 1;
      if (start[m] <= n) a = m; else b = m - 1;
    }
    if (n - start[a] >= kept[a]) src_slot[n] = -1;
  }
}

// The received side in one kernel (prepare_plan_body; Segments as ep_plan_meta). Dynamic shared memory:
// 2R + 1 + R*(L + 2) + 4L + 1 ints.
#if MOE_RT_WANTS(ep_prepare_plan)
extern "C" __global__ void ep_prepare_plan(int* __restrict__ meta, const int* __restrict__ inbox, i64 seg_words,
                                           const unsigned* __restrict__ state, i64 half_ints, int R, int me, int P,
                                           int K, int L, int align, int exact, i64 capacity, i64 rows, i64 N,
                                           int* __restrict__ recv_tok, int* __restrict__ recv_local,
                                           int* __restrict__ dst_row, int* __restrict__ src_slot,
                                           int* __restrict__ seg_start, int* __restrict__ expert_counts,
                                           int* __restrict__ tokens_per_expert) {
  extern __shared__ int sm[];
  prepare_plan_body(meta, Segments(inbox, seg_words, box_half(state, half_ints)), R, me, P, K, L, align, exact,
                    capacity, rows, N, recv_tok, recv_local, dst_row, src_slot, seg_start, expert_counts,
                    tokens_per_expert, sm);
}
#endif

// Pack the rows this rank sends: block row (blockIdx.y = dst) copies x[send_tok[dst][pos]] to the send
// buffer (dst != me, at send_off[dst] + pos) or straight into the receive buffer (dst == me, at
// recv_off[me] + pos: the own share never goes through NCCL). U is the copy unit (16..1 bytes);
// `units` units per row. Optional fp32 [T,K] weights travel the same way into [rows,K] buffers.
// sel: 0 = every destination (grid.y = R); 1 = the destinations outside this rank's node [node_lo, node_hi)
// only (grid.y = R; the NCCL transport's node is [me, me + 1): every remote destination; the mixed transport's
// node peers get their rows through peer memory); 2 = the own share only (grid.y = 1); 3 = the own share's
// weights only (its rows are expanded straight from x by ep_expand_rows).
template <typename U>
__global__ void ep_pack_rows(const U* __restrict__ x, U* __restrict__ send_buf, U* __restrict__ recv_buf,
                             const float* __restrict__ w, float* __restrict__ send_w, float* __restrict__ recv_w,
                             const int* __restrict__ send_tok, const int* __restrict__ meta, int R, int me, int P,
                             int K, i64 units, int sel, int node_lo, int node_hi) {
  const int dst = sel >= 2 ? me : (int)blockIdx.y;
  if (sel == 1 && (dst == me || (dst >= node_lo && dst < node_hi))) return;
  int count = meta[META_SEND_COUNTS(R) + dst];
  count = count < P ? count : P;
  const bool own = dst == me;
  const i64 base = own ? meta[META_RECV_OFF(R) + me] : meta[META_SEND_OFF(R) + dst];
  U* out = own ? recv_buf : send_buf;
  float* out_w = own ? recv_w : send_w;
  for (int pos = blockIdx.x; pos < count; pos += gridDim.x) {
    const i64 t = send_tok[(i64)dst * P + pos];
    const i64 row = base + pos;
    if (sel != 3) {
      const U* src = x + t * units;
      U* d = out + row * units;
#pragma unroll 4
      for (i64 u = threadIdx.x; u < units; u += blockDim.x) d[u] = src[u];
    }
    if (w != nullptr) {
      for (int k = threadIdx.x; k < K; k += blockDim.x) out_w[row * K + k] = w[t * K + k];
    }
  }
}

// The owner's fixed-order sum of the NCCL path (ep_direct_combine's second phase sums in the same order
// with the same rounding, so the transports' results are bitwise equal):
// out[t] = sum over ranks r ascending of the partial row of (t, r), accumulated in fp32 from 0 and rounded
// once; pos = send_pos[r][t] (-1: not sent to r, contributes nothing), the partial at row src.base(r) + pos
// of src.row(r, ...). With grad_w: grad_w[t][k] = the weight partial of slot k taken from the rank of its
// expert (src.wrow). `src` names where the rows are (NcclOwnerRows: the returned rows and the own ones).
template <typename T, bool VEC, typename Src>
__device__ __forceinline__ void owner_sum_body(const Src& src, T* __restrict__ out, float* __restrict__ grad_w,
                                               const int* __restrict__ send_pos,
                                               const int* __restrict__ routing_me, int R, int Tmax, int K,
                                               int L, int Tn, i64 H) {
  extern __shared__ long long s_mem[];
  i64* s_row = reinterpret_cast<i64*>(s_mem);  // [R]: row of (t, r), -1 = not sent
  for (int t = blockIdx.x; t < Tn; t += gridDim.x) {
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
      const int pos = send_pos[(i64)r * Tmax + t];
      s_row[r] = pos >= 0 ? src.base(r) + pos : -1;
    }
    __syncthreads();
    T* o = out + (i64)t * H;
    if (VEC) {
      constexpr int N = Vec<T>::N;
      const i64 nv = H / N;
      for (i64 v = threadIdx.x; v < nv; v += blockDim.x) {
        float acc[N];
#pragma unroll
        for (int j = 0; j < N; ++j) acc[j] = 0.0f;
        for (int r = 0; r < R; ++r) {
          const i64 row = s_row[r];
          if (row < 0) continue;
          const Vec<T> a = load_vec(src.row(r, row, H) + v * N);
#pragma unroll
          for (int j = 0; j < N; ++j) acc[j] += to_float(a.v[j]);
        }
        Vec<T> res;
#pragma unroll
        for (int j = 0; j < N; ++j) res.v[j] = from_float<T>(acc[j]);
        store_vec(o + v * N, res);
      }
    } else {
      for (i64 h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < R; ++r) {
          const i64 row = s_row[r];
          if (row >= 0) acc += to_float(src.row(r, row, H)[h]);
        }
        o[h] = from_float<T>(acc);
      }
    }
    if (grad_w != nullptr) {
      for (int k = threadIdx.x; k < K; k += blockDim.x) {
        const int e = routing_me[(i64)t * K + k];
        float g = 0.0f;
        if (e >= 0) {
          const int r = e / L;
          const i64 row = s_row[r];
          if (row >= 0) g = src.wrow(r, row, K)[k];
        }
        grad_w[(i64)t * K + k] = g;
      }
    }
  }
}

// The NCCL path's rows: the partial of rank r sits in `back` at send_off[r] + pos (rows returned by r) or,
// for r == me, in `own` at recv_off[me] + pos - own_shift (own_shift = recv_off[me] when `own` holds just
// the own share, 0 when it is the whole [rows,H] array); `own_w` is always the whole [rows,K] array.
template <typename T>
struct NcclOwnerRows {
  const T* back;
  const T* own;
  const float* back_w;
  const float* own_w;
  const int* meta;
  int R, me;
  i64 own_shift;
  __device__ __forceinline__ i64 base(int r) const {
    return r == me ? meta[META_RECV_OFF(R) + me] : meta[META_SEND_OFF(R) + r];
  }
  __device__ __forceinline__ const T* row(int r, i64 row, i64 H) const {
    return r == me ? own + (row - own_shift) * H : back + row * H;
  }
  __device__ __forceinline__ const float* wrow(int r, i64 row, int K) const {
    return (r == me ? own_w : back_w) + row * K;
  }
};

// Owner side of combine / dispatch_bwd after the NCCL transfer (owner_sum_body over NcclOwnerRows).
template <typename T, bool VEC>
__global__ void ep_owner_sum(const T* __restrict__ back, const T* __restrict__ own, T* __restrict__ out,
                             const float* __restrict__ back_w, const float* __restrict__ own_w,
                             float* __restrict__ grad_w, const int* __restrict__ send_pos,
                             const int* __restrict__ routing_me, const int* __restrict__ meta, int R, int me,
                             int Tmax, int K, int L, int Tn, i64 H, i64 own_shift) {
  const NcclOwnerRows<T> src{back, own, back_w, own_w, meta, R, me, own_shift};
  owner_sum_body<T, VEC>(src, out, grad_w, send_pos, routing_me, R, Tmax, K, L, Tn, H);
}

// out[n] = slots[src_slot[n]] (0 where src_slot is -1): a [rows,K] slot array in expert-major order.
#if MOE_RT_WANTS(ep_gather_slots)
extern "C" __global__ void ep_gather_slots(const float* __restrict__ slots, const int* __restrict__ src_slot,
                                           float* __restrict__ out, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const int s = src_slot[i];
    out[i] = s >= 0 ? slots[s] : 0.0f;
  }
}
#endif

// rows[n] = round(w[n] * float(rows[n])) in place: the weighted gradient of combine when y is not given.
template <typename T, bool VEC>
__global__ void ep_scale_rows(T* __restrict__ rows, const float* __restrict__ w, i64 n, i64 H) {
  for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
    const float s = w[r];
    T* p = rows + r * H;
    if (VEC) {
      constexpr int N = Vec<T>::N;
      for (i64 v = threadIdx.x; v < H / N; v += blockDim.x) {
        Vec<T> a = load_vec(p + v * N);
#pragma unroll
        for (int j = 0; j < N; ++j) a.v[j] = from_float<T>(s * to_float(a.v[j]));
        store_vec(p + v * N, a);
      }
    } else {
      for (i64 h = threadIdx.x; h < H; h += blockDim.x) p[h] = from_float<T>(s * to_float(p[h]));
    }
  }
}

// ---- Where an expanded row goes (ep_expand_rows, ep_direct_dispatch) ---------------------------------------
// A sink takes a received row unit by unit (U, the copy unit) and writes it into expert-major row d:
// - RowCopy<U>: out [N, units] as is (every row set but a one-pass FP8 dispatch's);
// - Fp8Rows<G>, Fp8Dequant<T, G> (U = uint4): the packed rows of a one-pass FP8 dispatch (docs/ep.md §9;
//   kernels/fp8.cu: H e4m3 codes, at byte HS = ceil4(H) the S = ceil(H/128) fp32 scales, zero padding to a
//   multiple of 16 bytes) split into the codes out [N,H] bytes and the scales out_s [N,S] (Fp8Rows), or
//   dequantized into out [N,H] of T (Fp8Dequant: dequantize_fp8's rule, bit for bit). G (16, 4 or 1) divides
//   H, HS and 4S, so a G-byte piece of a unit is all codes, all scales or all padding and is stored whole
//   (the host picks G, and checks the outputs' alignment).
// aux<FRESH>(row, i): what put needs besides the unit. ONCE (Fp8Dequant): the row is read as the sink's
// slices instead of units, each slice the codes of 16 bytes of output (8 codes for 16-bit T, 4 for fp32), so that
// a warp's stores cover whole 32-byte sectors (a 16-code unit a lane gave 32 or 64 bytes a lane, stored 16 at a
// time: every store instruction wrote half sectors); aux is the slice's scale, put takes the slice converted once
// (convert), and the expand loops over a slice's K rows inside its loop over slices (once_row; converting inside
// the loop over k would be hoisted out of it by the compiler: every slice of a lane's UNROLL converted at once,
// spilling). The other sinks keep the loop over units inside the loop over k (sink_span).
constexpr int EP_FP8_BLOCK = 128;  // channels per scale of an FP8 dispatch

struct NoAux {};

template <int B>
__device__ __forceinline__ void store_bytes(void* p, const void* v) {  // B bytes, streaming, widest units
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int q = 0; q < B / 16; ++q) __stcs(reinterpret_cast<uint4*>(p) + q, reinterpret_cast<const uint4*>(v)[q]);
  } else if constexpr (B % 8 == 0) {
#pragma unroll
    for (int q = 0; q < B / 8; ++q) __stcs(reinterpret_cast<uint2*>(p) + q, reinterpret_cast<const uint2*>(v)[q]);
  } else if constexpr (B % 4 == 0) {
#pragma unroll
    for (int q = 0; q < B / 4; ++q)
      __stcs(reinterpret_cast<unsigned*>(p) + q, reinterpret_cast<const unsigned*>(v)[q]);
  } else if constexpr (B % 2 == 0) {
#pragma unroll
    for (int q = 0; q < B / 2; ++q)
      reinterpret_cast<unsigned short*>(p)[q] = reinterpret_cast<const unsigned short*>(v)[q];
  } else {
#pragma unroll
    for (int q = 0; q < B; ++q) reinterpret_cast<unsigned char*>(p)[q] = reinterpret_cast<const unsigned char*>(v)[q];
  }
}

template <typename U>
struct RowCopy {
  using Aux = NoAux;
  static constexpr bool ONCE = false, SCALE = false;
  U* out;
  i64 units;
  __device__ RowCopy(void* o, float*, int, i64 units_) : out(static_cast<U*>(o)), units(units_) {}
  template <bool FRESH>
  __device__ Aux aux(const U*, i64) const { return {}; }
  __device__ void put(int d, i64 i, const U& v, const Aux&) const { __stcs(out + (i64)d * units + i, v); }
};

// combine_bwd's weighted rows without y: out[d] = T(w[d] * float(row)), each element one fp32 product and one
// rounding (ep_scale_rows' expression, so the same bits), w [N] the slots' weights, which the kernel lays out
// (out_w) before it expands a row. put() stores a unit as is (the zero rows).
template <typename T>
struct RowScale {
  using Aux = NoAux;
  static constexpr bool ONCE = false, SCALE = true;
  static constexpr int E = 16 / (int)sizeof(T);  // elements a unit
  uint4* out;
  const float* w;
  i64 units;
  __device__ RowScale(void* o, float* w_, int, i64 units_) : out(static_cast<uint4*>(o)), w(w_), units(units_) {}
  template <bool FRESH>
  __device__ Aux aux(const uint4*, i64) const { return {}; }
  // the factor of row d: its weight, written by this warp before the row's expansion (after a __syncwarp)
  __device__ float factor(int d) const { return w[d]; }
  __device__ void put(int d, i64 i, const uint4& v, const Aux&) const { __stcs(out + (i64)d * units + i, v); }
  __device__ void put_scaled(int d, i64 i, const uint4& v, float f) const {
    struct alignas(16) {
      T e[E];
    } a;
    *reinterpret_cast<uint4*>(&a) = v;
#pragma unroll
    for (int j = 0; j < E; ++j) a.e[j] = from_float<T>(f * to_float(a.e[j]));
    __stcs(out + (i64)d * units + i, *reinterpret_cast<const uint4*>(&a));
  }
};

template <int G>
struct Fp8Rows {
  using Aux = NoAux;
  static constexpr bool ONCE = false, SCALE = false;
  unsigned char* codes;
  unsigned char* scales;
  i64 H, HS, SB;  // SB: the scale bytes of a row (4S)
  __device__ Fp8Rows(void* o, float* s, int H_, i64)
      : codes(static_cast<unsigned char*>(o)), scales(reinterpret_cast<unsigned char*>(s)), H(H_),
        HS(((i64)H_ + 3) & ~(i64)3), SB(4 * (((i64)H_ + EP_FP8_BLOCK - 1) / EP_FP8_BLOCK)) {}
  template <bool FRESH>
  __device__ Aux aux(const uint4*, i64) const { return {}; }
  __device__ void put(int d, i64 i, const uint4& v, const Aux&) const {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&v);
#pragma unroll
    for (int q = 0; q < 16 / G; ++q) {
      const i64 o = i * 16 + q * G;
      if (o < H) store_bytes<G>(codes + (i64)d * H + o, b + q * G);
      else if (o >= HS && o < HS + SB) store_bytes<G>(scales + (i64)d * SB + (o - HS), b + q * G);
    }
  }
};

template <int B> struct SliceOf;
template <> struct SliceOf<8> { using type = uint2; };
template <> struct SliceOf<4> { using type = unsigned; };

template <typename T, int G>
struct Fp8Dequant {
  using Aux = float;
  static constexpr bool ONCE = true, SCALE = false;
  static constexpr int NC = 16 / (int)sizeof(T);  // codes a slice: 16 bytes of output
  using Slice = typename SliceOf<NC>::type;
  struct Vals {
    alignas(16) T v[NC];
  };
  T* y;
  i64 H, HS;
  __device__ Fp8Dequant(void* o, float*, int H_, i64) : y(static_cast<T*>(o)), H(H_), HS(((i64)H_ + 3) & ~(i64)3) {}
  // the scale of slice i, read from the row itself (past L1 when FRESH: a peer wrote it during this kernel)
  template <bool FRESH>
  __device__ float aux(const Slice* row, i64 i) const {
    if (i * NC >= H) return 0.0f;  // no codes in this slice
    const float* s = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(row) + HS) +
                     i * NC / EP_FP8_BLOCK;  // a slice's channels share one block
    return FRESH ? __ldcg(s) : __ldg(s);
  }
  // the slice's bytes as codes (those past H are never stored)
  __device__ Vals convert(const Slice& v, const float& s) const {
    const unsigned* w = reinterpret_cast<const unsigned*>(&v);
    Vals r;
#pragma unroll
    for (int q = 0; q < NC / 4; ++q) dequant4(w[q], s, *reinterpret_cast<T(*)[4]>(r.v + 4 * q));
    return r;
  }
  // slice i's values into row d: one 16-byte store where G >= NC (the lanes of a warp hold consecutive slices,
  // so each store of the warp covers 512 consecutive bytes), else G-code stores up to H
  __device__ void put(int d, i64 i, const Vals& r) const {
    constexpr int GQ = G < NC ? G : NC;
#pragma unroll
    for (int q = 0; q < NC / GQ; ++q) {
      const i64 o = i * NC + q * GQ;
      if (o >= H) break;
      store_bytes<GQ * (int)sizeof(T)>(y + (i64)d * H + o, r.v + q * GQ);
    }
  }
  // row d all +0 (what dequantizing zero codes and scales gives: ep_fill_rows' bits), by one warp, stores only;
  // each store of the warp covers 32 * Q consecutive bytes (Q: 16, or G * sizeof(T) when smaller; it divides
  // the row's bytes and its alignment)
  __device__ void zero(int d, int lane) const {
    constexpr int W = G * (int)sizeof(T), Q = W % 16 == 0 ? 16 : W;
    const uint4 z = {};
    unsigned char* row = reinterpret_cast<unsigned char*>(y + (i64)d * H);
    const i64 nb = H * (i64)sizeof(T);
    for (i64 o = (i64)lane * Q; o < nb; o += 32 * Q) store_bytes<Q>(row + o, &z);
  }
};

// A ONCE sink's pass over one row of `units` 16-byte units (warp_expand_row: a warp, first = lane, step = 32;
// ep_expand_rows: a CTA): the row read as the sink's slices (16 bytes of output each), this thread's slices
// first + step*j, UNROLL in flight, each converted once and stored into the expert-major rows dst(k) >= 0.
template <int UNROLL, bool FRESH, typename Sink, typename Dst>
__device__ __forceinline__ void once_row(const void* row, const Sink& sink, i64 units, i64 first, i64 step, int K,
                                         Dst dst) {
  using P = typename Sink::Slice;
  const P* src = static_cast<const P*>(row);
  const i64 n = units * (16 / (i64)sizeof(P));
  for (i64 i0 = first; i0 < n; i0 += step * UNROLL) {
    P v[UNROLL];
    float a[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const i64 i = i0 + step * j;
      if (i < n) {
        v[j] = FRESH ? __ldcg(src + i) : __ldg(src + i);
        a[j] = sink.template aux<FRESH>(src, i);
      }
    }
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const i64 i = i0 + step * j;
      if (i >= n) continue;
      const auto c = sink.convert(v[j], a[j]);
      for (int k = 0; k < K; ++k) {
        const int d = dst(k);
        if (d >= 0) sink.put(d, i, c);
      }
    }
  }
}

// The stores of one loaded span of a row (ep_expand_rows, warp_expand_row; not a ONCE sink's: once_row): units
// i0 + step*j (j < UNROLL, i < units) into the expert-major rows dst(k) >= 0 (k < K).
template <typename U, int UNROLL, typename Sink, typename Dst>
__device__ __forceinline__ void sink_span(const Sink& sink, const U (&v)[UNROLL], const typename Sink::Aux (&a)[UNROLL],
                                          i64 i0, i64 step, i64 units, int K, Dst dst) {
  for (int k = 0; k < K; ++k) {
    const int d = dst(k);
    if (d < 0) continue;
    if constexpr (Sink::SCALE) {
      const float f = sink.factor(d);
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        const i64 i = i0 + step * j;
        if (i < units) sink.put_scaled(d, i, v[j], f);
      }
    } else {
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        const i64 i = i0 + step * j;
        if (i < units) sink.put(d, i, v[j], a[j]);
      }
    }
  }
}

// The overlapped dispatch direction (EpGroup with chunks > 1) expands received rows range by range as
// they land, into the expert-major layout of the permutation plan (same result as the permutation
// family's dispatch: a raw copy per kept slot, zero rows where no slot lands, probs following rows).

// A CTA per received row r of a range (grid-stride over the range's nrows rows; src, dst_row passed at the
// range's first row): out[dst_row[r][k]]
// = src[r] (src[src_rows[r]] when src_rows is given: the own share read straight from x) for every k with
// dst_row >= 0. The row is read once (UNROLL units per thread in flight) and
// stored with streaming stores, through the Sink (RowCopy: out as is; a one-pass FP8 dispatch's packed rows
// split into codes out and scales out_s, or dequantized into out; fp8_h = H, unused by RowCopy).
template <typename U, int UNROLL, typename Sink = RowCopy<U>>
__global__ void ep_expand_rows(const U* __restrict__ src, void* __restrict__ out, const int* __restrict__ dst_row,
                               const int* __restrict__ src_rows, int K, i64 units, i64 nrows,
                               float* __restrict__ out_s, int fp8_h) {
  extern __shared__ int s_dst[];
  const Sink sink(out, out_s, fp8_h, units);
  for (i64 r = blockIdx.x; r < nrows; r += gridDim.x) {
    __syncthreads();  // the previous row's s_dst reads are done
    for (int k = threadIdx.x; k < K; k += blockDim.x) s_dst[k] = dst_row[r * K + k];
    __syncthreads();
    bool any = false;
    for (int k = 0; k < K; ++k) any |= s_dst[k] >= 0;
    if (!any) continue;  // an unused row (capacity-mode tail): nothing to read
    const U* in = src + (src_rows != nullptr ? (i64)src_rows[r] : r) * units;
    if constexpr (Sink::ONCE) {
      once_row<UNROLL, false>(in, sink, units, threadIdx.x, blockDim.x, K, [&](int k) { return s_dst[k]; });
    } else {
      for (i64 i0 = threadIdx.x; i0 < units; i0 += (i64)blockDim.x * UNROLL) {
        U v[UNROLL];
        typename Sink::Aux a[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
          const i64 i = i0 + (i64)j * blockDim.x;
          if (i < units) {
            v[j] = __ldcs(in + i);
            a[j] = sink.template aux<false>(in, i);
          }
        }
        sink_span<U, UNROLL>(sink, v, a, i0, (i64)blockDim.x, units, K, [&](int k) { return s_dst[k]; });
      }
    }
  }
}

// One warp per expert-major row n (grid-stride): rows with src_slot -1 become zero (when out is given);
// probs_out[n] = src_slot >= 0 ? probs_flat[src_slot] : 0 (when probs_out is given).
template <typename U>
__global__ void ep_fill_rows(U* __restrict__ out, float* __restrict__ probs_out, const float* __restrict__ probs_flat,
                             const int* __restrict__ src_slot, i64 N, i64 units) {
  const int lane = threadIdx.x & 31;
  const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
  for (i64 n = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); n < N; n += warps) {
    const int s = src_slot[n];
    if (probs_out != nullptr && lane == 0) probs_out[n] = s >= 0 ? probs_flat[s] : 0.0f;
    if (s < 0 && out != nullptr) {
      U* o = out + n * units;
      const U z{};
      for (i64 i = lane; i < units; i += 32) __stcs(o + i, z);
    }
  }
}

// out[i] = dst_row[i] >= 0 ? vals[dst_row[i]] : 0 for i < n: expert-major row values back to the received
// rows' [rows,K] slots (the probs gradient of dispatch_bwd).
#if MOE_RT_WANTS(ep_slot_values)
extern "C" __global__ void ep_slot_values(const float* __restrict__ vals, const int* __restrict__ dst_row,
                                          float* __restrict__ out, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const int d = dst_row[i];
    out[i] = d >= 0 ? vals[d] : 0.0f;
  }
}
#endif

// ---- The direct peer-memory transport within a node (moe_rt/_ep_direct.py) -----------------------------
// Every rank holds IPC-shared buffers; the tables `peer_*` (int64 [R], device) hold each rank's buffer
// address as mapped in this process (this rank's own buffer at [me]). A receive stage holds R*P rows:
// row (src s, pos j) at s*P + j (P = pair capacity). `state` (uint32 [4], this rank's device memory):
// [0] = the barrier epoch, advanced by ep_direct_barrier (so CUDA-graph replays stay valid), [1] = a sticky
// failure flag (a barrier timed out: the later kernels of the transport do nothing), [2..3] = a uint64 work
// counter of ep_direct_dispatch (claim_item).

__device__ __forceinline__ unsigned ld_acquire_sys_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_u32(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys_u32(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One block. Every rank's barrier region (peer_bar[r]) holds uint32 slots [R]: slot s = the last epoch
// rank s reached. Advances the epoch to e, stores e into the slot[me] of every rank of this rank's node
// [lo, hi) (a system-scope release after a system fence: this rank's earlier writes, to its own or peers'
// memory, are visible first), then waits until its own slots of the node's ranks all reach e (acquire
// loads). The direct transport's node is every rank ([0, R)); the mixed transport's the ranks it reaches
// through peer memory (peer_bar holds no address for the others). After timeout_ns (%globaltimer) it gives up:
// writes `op` to the host-mapped error word, raises the sticky failure flag and returns (never hangs).
// Epochs compare with wrap-around (a signed difference).
// Whether the barrier slot *slot reaches e (acquire loads) before timeout_ns have passed since t0
// (%globaltimer); false after the timeout.
__device__ __forceinline__ bool wait_slot(const unsigned* slot, unsigned e, unsigned long long t0, i64 timeout_ns) {
  while ((int)(ld_acquire_sys_u32(slot) - e) < 0) {
    if (global_timer_ns() - t0 > (unsigned long long)timeout_ns) return false;
    __nanosleep(64);
  }
  return true;
}

// The barrier's body, run by one whole block (ep_direct_barrier).
__device__ void direct_barrier_block(const long long* __restrict__ peer_bar, int R, int me,
                                     unsigned* __restrict__ state, i64 timeout_ns, int* __restrict__ err_word,
                                     int op, int lo, int hi) {
  __shared__ unsigned s_epoch;
  __shared__ int s_skip;
  __shared__ int s_timeout;
  if (threadIdx.x == 0) {
    s_epoch = state[0] + 1u;
    s_skip = (int)state[1];
    s_timeout = 0;
  }
  __syncthreads();
  if (s_skip) return;  // uniform: an earlier barrier failed
  const unsigned e = s_epoch;
  __threadfence_system();
  for (int r = lo + threadIdx.x; r < hi; r += blockDim.x) {
    st_release_sys_u32(reinterpret_cast<unsigned*>(peer_bar[r]) + me, e);
  }
  const unsigned* mine = reinterpret_cast<const unsigned*>(peer_bar[me]);
  const unsigned long long t0 = global_timer_ns();
  for (int r = lo + threadIdx.x; r < hi; r += blockDim.x)
    if (!wait_slot(mine + r, e, t0, timeout_ns)) atomicExch(&s_timeout, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    state[0] = e;
    if (s_timeout) {
      state[1] = 1u;
      *reinterpret_cast<volatile int*>(err_word) = op;
    }
    __threadfence_system();
  }
}

#if MOE_RT_WANTS(ep_direct_barrier)
extern "C" __global__ void ep_direct_barrier(const long long* __restrict__ peer_bar, int R, int me,
                                             unsigned* __restrict__ state, i64 timeout_ns,
                                             int* __restrict__ err_word, int op, int lo, int hi) {
  direct_barrier_block(peer_bar, R, me, state, timeout_ns, err_word, op, lo, hi);
}
#endif

// ep_prepare_direct's barrier with the peers (direct_barrier_block's slots, epoch e = s0 + 1 over [0, R)) made
// by the whole grid with one count of arrivals (gs[0], as grid_sync): each block fences its writes (to peer
// memory too) at system scope and arrives; the last block to arrive (every block's writes fenced) resets the
// count and stores e into slot[me] of every rank; then each block waits itself (thread 0, acquire loads of its
// own slots) until every rank's slot reaches e, so no second grid barrier passes the peers' arrival on. After
// timeout_ns a block stops waiting; block 0 then writes `op` to the host-mapped error word and raises the
// sticky failure flag (state[1]); with the flag already raised nobody waits. Block 0 records the epoch.
__device__ void prepare_peer_barrier(unsigned* __restrict__ gs, const long long* __restrict__ peer_bar, int R, int me,
                                     unsigned* __restrict__ state, unsigned s0, i64 timeout_ns,
                                     int* __restrict__ err_word, int op) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned e = s0 + 1u;
    const bool skip = *reinterpret_cast<volatile unsigned*>(state + 1) != 0u;  // an earlier barrier failed
    __threadfence_system();
    if (atomicAdd(gs, 1u) == gridDim.x - 1) {
      atomicExch(gs, 0u);
      __threadfence_system();
      if (!skip)
        for (int r = 0; r < R; ++r) st_release_sys_u32(reinterpret_cast<unsigned*>(peer_bar[r]) + me, e);
    }
    bool timed_out = false;
    if (!skip) {
      const unsigned* mine = reinterpret_cast<const unsigned*>(peer_bar[me]);
      const unsigned long long t0 = global_timer_ns();
      for (int r = 0; r < R && !timed_out; ++r) timed_out = !wait_slot(mine + r, e, t0, timeout_ns);
    }
    if (blockIdx.x == 0) {
      state[0] = e;
      if (timed_out) {
        state[1] = 1u;
        *reinterpret_cast<volatile int*>(err_word) = op;
      }
      __threadfence_system();
    }
  }
  __syncthreads();
}

// Capacity-mode prepare on the direct transport in one kernel (moe_rt/ep.py _prepare_cuda): the send side
// (prepare_send_body: each destination's segment pushed into its box, the half of epoch state[0] + 1),
// prepare's barrier with the peers (prepare_peer_barrier: every block's writes fenced at system scope first;
// timeout: op in the error word, the failure flag raised), then the received side from this rank's own box
// (prepare_plan_body). The grid is at most one resident wave (grid_sync). Dynamic shared memory: the larger
// of the two bodies'.
template <typename IdxT>
__global__ void __launch_bounds__(256, 2) ep_prepare_direct(const IdxT* __restrict__ idx, i64 T, int Tmax, int K, int E, int R, int me, int L,
                                  int P, int TC, int B, int* __restrict__ routing, int* __restrict__ send_tok,
                                  int* __restrict__ send_pos, int* __restrict__ meta, unsigned* __restrict__ state,
                                  i64 half_ints, const long long* __restrict__ peer_box, unsigned* __restrict__ err,
                                  int nw, int* __restrict__ part, unsigned* __restrict__ gs,
                                  const long long* __restrict__ peer_bar, i64 timeout_ns, int* __restrict__ err_word,
                                  int op, int align, i64 capacity, i64 rows, i64 N, int* __restrict__ recv_tok,
                                  int* __restrict__ recv_local, int* __restrict__ dst_row, int* __restrict__ src_slot,
                                  int* __restrict__ seg_start, int* __restrict__ expert_counts,
                                  int* __restrict__ tokens_per_expert) {
  extern __shared__ int sm[];
  LL_TRACE(0);
  const unsigned s0 = state[0];  // the epoch before this prepare's barrier
  prepare_send_body(idx, T, Tmax, K, E, R, me, L, P, TC, B, routing, send_tok, send_pos, meta, s0, half_ints,
                    peer_box, nullptr, nullptr, err, nw, part, gs, sm);
  LL_TRACE(4);
  prepare_peer_barrier(gs, peer_bar, R, me, state, s0, timeout_ns, err_word, op);
  LL_TRACE(6);
  const i64 seg_words = (i64)(L + 2) + (i64)P * (2 * K + 1);
  prepare_plan_body(meta, Segments(reinterpret_cast<const int*>(peer_box[me]), seg_words,
                                   (i64)((s0 + 1u) & 1u) * half_ints),
                    R, me, P, K, L, align, 0, capacity, rows, N, recv_tok, recv_local, dst_row, src_slot, seg_start,
                    expert_counts, tokens_per_expert, sm);
  LL_TRACE(10);
}

// map[r] = s*P + (r - recv_off[s]) for received row r (recv_off[s] <= r < recv_off[s+1]): the stage row
// of each row of the handle's received-row layout (the identity in capacity mode, where recv_off[s] = s*P).
#if MOE_RT_WANTS(ep_direct_row_map)
extern "C" __global__ void ep_direct_row_map(const int* __restrict__ meta, int R, int P, i64 rows,
                                             int* __restrict__ map) {
  const int* off = meta + META_RECV_OFF(R);
  for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (i64)gridDim.x * blockDim.x) {
    int s = 0;
    while (s + 1 < R && r >= off[s + 1]) ++s;
    map[r] = (int)((i64)s * P + (r - off[s]));
  }
}
#endif

// A CTA per row r < rows (grid-stride): dst[dst_map ? dst_map[r] : r] = src[src_map ? src_map[r] : r],
// `units` units of U per row. Skipped after a failed barrier (state given).
template <typename U>
__global__ void ep_copy_rows(const U* __restrict__ src, const int* __restrict__ src_map, U* __restrict__ dst,
                             const int* __restrict__ dst_map, const unsigned* __restrict__ state, i64 rows,
                             i64 units) {
  if (state != nullptr && state[1]) return;
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const i64 sr = src_map != nullptr ? (i64)src_map[r] : r;
    const i64 dr = dst_map != nullptr ? (i64)dst_map[r] : r;
    const U* in = src + sr * units;
    U* o = dst + dr * units;
    for (i64 i = threadIdx.x; i < units; i += blockDim.x) o[i] = in[i];
  }
}

// ---- The direct transport's fused kernels: chunk flags instead of a closing barrier --------------------
// Every rank holds flags (uint32 [R*P], IPC-shared): flags[s*P + c] = the epoch of the last op in which rank s
// finished chunk c (positions [c*C, c*C + C) of its pair with this rank) of its writes into this rank's stages.
// A writer block stores a chunk's rows, then (after the block barrier) one system-scope release of the flag
// in the reader's memory; a reader block acquires the flag before reading the rows, so rows are consumed as
// their chunks land while other chunks are still on the wire. The op's leading ep_direct_barrier advanced
// the epoch e (state[0]), so flags never need resetting and CUDA-graph replays stay valid. The grid is at most
// one resident wave and every block does all of its writes before it waits on anything (a dispatch block
// only polls, without waiting, until its writes are done), so no block waits on a block that cannot run.
// A wait longer than timeout_ns records `op` in the error word, raises the sticky failure flag (state[1])
// and ends the kernel; every later kernel of the transport then does nothing.

__device__ __forceinline__ bool flag_reached(const unsigned* f, unsigned e) {
  return (int)(ld_acquire_sys_u32(f) - e) >= 0;
}

// One thread waits until *f reaches e. False after a timeout (recorded: op in the error word, the failure
// flag raised) or a failure another block recorded.
// The poll reads the flag alone; the failure flag and the clock are looked at every 32nd poll (each look is
// one more dependent load: looking every poll doubled the time between polls, the delay before a waiter sees
// its flag).
__device__ __noinline__ bool thread_wait_flag(const unsigned* f, unsigned e, unsigned* state, int* err_word,
                                              i64 timeout_ns, int op) {
  if (flag_reached(f, e)) return true;
  const unsigned long long t0 = global_timer_ns();
  for (unsigned n = 1;; ++n) {
    if (flag_reached(f, e)) return true;
    if ((n & 31u) == 0u) {
      if (*reinterpret_cast<volatile unsigned*>(state + 1)) return false;
      if (global_timer_ns() - t0 > (unsigned long long)timeout_ns) {
        atomicExch(state + 1, 1u);
        *reinterpret_cast<volatile int*>(err_word) = op;
        __threadfence_system();
        return false;
      }
    }
    __nanosleep(32);
  }
}

// Thread 0 waits until *f reaches e; the block learns the outcome (thread_wait_flag's).
__device__ __forceinline__ bool block_wait_flag(const unsigned* f, unsigned e, unsigned* state, int* err_word,
                                                i64 timeout_ns, int op) {
  __shared__ int s_ok;
  __syncthreads();
  if (threadIdx.x == 0) s_ok = thread_wait_flag(f, e, state, err_word, timeout_ns, op) ? 1 : 0;
  __syncthreads();
  return s_ok != 0;
}

// Whether *f has reached e (thread 0 looks once; the block learns it).
__device__ __forceinline__ bool block_poll_flag(const unsigned* f, unsigned e) {
  __shared__ int s_ready;
  __syncthreads();
  if (threadIdx.x == 0) s_ready = flag_reached(f, e) ? 1 : 0;
  __syncthreads();
  return s_ready != 0;
}

// The op's epoch (state[0], advanced by its leading barrier) for the block; false when an earlier barrier or
// wait failed (state[1]): the kernel then does nothing.
__device__ __forceinline__ bool block_epoch(const unsigned* state, unsigned& e) {
  __shared__ unsigned s_e;
  __shared__ int s_failed;
  if (threadIdx.x == 0) {
    s_e = state[0];
    s_failed = (int)state[1];
  }
  __syncthreads();
  e = s_e;
  return s_failed == 0;
}

// After the block's writes of a chunk: publish them by setting *f (in the reader's memory) to e.
__device__ __forceinline__ void block_signal(unsigned* f, unsigned e) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    st_release_sys_u32(f, e);
  }
}

// One warp copies a row of `units` U: dst[i] = src[i] (src read with ld.global.cg when `fresh`: it may have
// been written by a peer during this kernel).
template <typename U, int UNROLL>
__device__ __forceinline__ void warp_copy_row(const U* __restrict__ src, U* __restrict__ dst, i64 units, int lane) {
  for (i64 i0 = lane; i0 < units; i0 += 32 * UNROLL) {
    U v[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const i64 i = i0 + 32 * j;
      if (i < units) v[j] = __ldg(src + i);
    }
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const i64 i = i0 + 32 * j;
      if (i < units) dst[i] = v[j];
    }
  }
}

// One warp writes a row to the expert-major rows drow[k] (k < K, drow[k] >= 0) through the sink, reading it once.
template <typename U, int UNROLL, bool FRESH, typename Sink>
__device__ __forceinline__ void warp_expand_row(const U* __restrict__ src, const Sink& sink,
                                                const int* __restrict__ drow, int K, i64 units, int lane) {
  if constexpr (Sink::ONCE) {
    once_row<UNROLL, FRESH>(src, sink, units, lane, 32, K, [&](int k) { return __ldg(drow + k); });
  } else {
    for (i64 i0 = lane; i0 < units; i0 += 32 * UNROLL) {
      U v[UNROLL];
      typename Sink::Aux a[UNROLL];
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        const i64 i = i0 + 32 * j;
        if (i < units) {
          v[j] = FRESH ? __ldcg(src + i) : __ldg(src + i);
          a[j] = sink.template aux<FRESH>(src, i);
        }
      }
      sink_span<U, UNROLL>(sink, v, a, i0, 32, units, K, [&](int k) { return __ldg(drow + k); });
    }
  }
}

// The next item of an op's work counter for the block (thread 0 claims it, the block learns it): *ctr holds
// (epoch << 32) | items taken. A claim is one atomicAdd; a counter still of an earlier epoch (this op's first
// claims) is started over at (e << 32) | 1 by one compare-and-swap, whose winner takes item 0 (the others,
// whose adds it wiped out, add again). So the counter needs no reset between ops or graph replays (each op
// runs in an epoch of its own, after its barrier), and once an op's epoch is set no claim retries (a CAS loop
// for every claim serialized the blocks: 2-3x the dispatch time on 2 H200).
__device__ __forceinline__ i64 claim_item(unsigned long long* ctr, unsigned e) {
  __shared__ long long s_item;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long v = atomicAdd(ctr, 1ull);
    while ((unsigned)(v >> 32) != e) {
      const unsigned long long now = v + 1ull;  // the value after this add, unless others added too
      const unsigned long long got = atomicCAS(ctr, now, ((unsigned long long)e << 32) | 1ull);
      if (got == now) {
        v = (unsigned long long)e << 32;  // item 0
        break;
      }
      v = (unsigned)(got >> 32) == e ? atomicAdd(ctr, 1ull) : got - 1ull;  // started by another; or retry
    }
    s_item = (long long)(v & 0xffffffffull);
  }
  __syncthreads();
  return s_item;
}

// One warp writes zeros into expert-major row d through the sink, a unit a lane at a time (stores only:
// nothing to hold in flight), units of zero bits: Fp8Rows stores zero codes and scales; a dequantizing sink
// (ONCE) writes the row's +0 values itself (Fp8Dequant::zero; ep_fill_rows' bits).
template <typename U, typename Sink>
__device__ __forceinline__ void warp_zero_row(const Sink& sink, int d, i64 units, int lane) {
  if constexpr (Sink::ONCE) {  // a dequantizing sink: zeros of the output dtype straight away
    sink.zero(d, lane);
  } else {
    const U v = U{};
    const typename Sink::Aux a = typename Sink::Aux{};
    for (i64 i = lane; i < units; i += 32) sink.put(d, i, v, a);  // as is (a scaling sink's zeros too)
  }
}

// The dispatch direction in one kernel. Push items (chunk c of the pair (me, d), d != me; chunk-major): x's
// rows x[send_tok[d][j]] into rank d's stage rows me*P + j (weights w [T,K] into its weight stage), then
// rank d's flag me*P + c. Expand items: first the own share (chunks of the pair (me, me), read straight
// from x: the own rows never go through a stage; their weights go to the own weight stage), then the
// chunks of each source s != me (chunk-major), each after its flag: stage row s*P + j -> out[dst_row[r][k]]
// with r = recv_off[s] + j the row's place in the handle's received-row layout. out == nullptr: the own rows
// are copied into the own stage and the other chunks only waited for (the caller reads the stage). Blocks
// b < Pb = min(push items, G/2) push (items b, b + Pb, ...); expand item i goes to block (i + Pb) % G, so the
// blocks that do not push begin with the own share while the pushes hold the link (with every block pushing
// first, the own rows' expansion waited for the pushes' stores to drain). A pushing block alternates: one
// push item, then one expand item if it is ready; once its pushes are done it waits for its remaining expand
// items.
// Zero items (zero_src given: the handle's src_slot [zero_n]): item z covers the expert-major rows
// [z*nw, (z+1)*nw), one a warp; the rows with src_slot < 0 (no slot lands there: padding, a capacity-mode
// tail) are written as zeros through the sink, ep_fill_rows' work done here so that these HBM writes run while
// the link holds the pushes (zero_rows = 0: the rows are left unwritten, only out_w's zeros are written). A
// block claims them one at a time from the op's counter (claim_item, state[2..3]) once its pushes are done:
// whenever its next expand item's chunk has not landed, then after its expand items until none is left. No
// zero row is a slot's row, so the order against the expansion is free.
// Weights (w_travel: they travel): each expanded row's K weights (the own rows' from w, the others' from this
// rank's weight stage) go into the handle's recv_wk [rows,K] (the own rows' never go through the stage); with
// out_w, each row's K weights (those, or with w_travel = 0 the ones recv_wk holds, as combine_bwd's laid-out
// weights) go into out_w [N] at its slots' rows (zero at the rows holding no slot: the zero items).
// tpe_out given: block 0 copies the handle's tokens_per_expert [L] there first.
// One warp per row; blockDim.x a multiple of 32. Only the ranks of this rank's node [lo, hi) are pushed to
// and expanded from (the direct transport: [0, R); the mixed transport moves the other pairs through NCCL
// into the same expert-major rows). The expanded rows go through the Sink (ep_expand_rows: RowCopy into out,
// or a one-pass FP8 dispatch's packed rows into codes out and scales out_s or dequantized into out; fp8_h = H).
template <typename U, int UNROLL, typename Sink = RowCopy<U>>
__global__ void __launch_bounds__(512) ep_direct_dispatch(
    const U* __restrict__ x, const float* __restrict__ w, const long long* __restrict__ peer_rows,
    const long long* __restrict__ peer_w, const long long* __restrict__ peer_flags,
    const int* __restrict__ send_tok, const int* __restrict__ meta, const int* __restrict__ dst_row,
    void* __restrict__ out, float* __restrict__ out_s, int fp8_h, const int* __restrict__ zero_src, i64 zero_n,
    int zero_rows, float* __restrict__ recv_wk, int w_travel, float* __restrict__ out_w, const int* __restrict__ tpe_src,
    int* __restrict__ tpe_out, int L, unsigned* __restrict__ state, int* __restrict__ err_word, i64 timeout_ns,
    int op, int R, int me, int P, int K, int C, i64 units, int lo, int hi) {
  if (tpe_out != nullptr && blockIdx.x == 0)
    for (int i = threadIdx.x; i < L; i += blockDim.x) tpe_out[i] = tpe_src[i];
  unsigned e;
  if (!block_epoch(state, e)) return;
  const Sink sink(out, Sink::SCALE ? out_w : out_s, fp8_h, units);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int* send_counts = meta + META_SEND_COUNTS(R);
  const int* recv_counts = meta + META_RECV_COUNTS(R);
  const int* recv_off = meta + META_RECV_OFF(R);
  int smax = 0, rmax = 0;  // the longest pair with another rank of the node, out and in (rows kept)
  for (int r = lo; r < hi; ++r) {
    if (r == me) continue;
    smax = max(smax, min(send_counts[r], P));
    rmax = max(rmax, min(recv_counts[r], P));
  }
  const int Rm = hi - lo - 1;  // the node's other ranks
  const int Rd = Rm > 0 ? Rm : 1;  // a divisor (with Rm = 0 there are no push or remote expand items)
  auto peer = [&](int i) { const int d = lo + i; return d < me ? d : d + 1; };  // the node's i-th other rank
  const int own = min(send_counts[me], P);
  const int n_push = (smax + C - 1) / C * Rm;
  const int n_own = (own + C - 1) / C;
  const int n_exp = n_own + (rmax + C - 1) / C * Rm;
  const U* stage = reinterpret_cast<const U*>(peer_rows[me]);
  const unsigned* my_flags = reinterpret_cast<const unsigned*>(peer_flags[me]);
  const float* wstage = w_travel ? reinterpret_cast<const float*>(peer_w[me]) : nullptr;

  auto push = [&](int item) {
    const int c = item / Rd, d = peer(item - c * Rd);
    const int kept = min(send_counts[d], P), j0 = c * C, j1 = min(j0 + C, kept);
    if (j0 >= j1) return;
    U* dst = reinterpret_cast<U*>(peer_rows[d]);
    float* dw = w != nullptr ? reinterpret_cast<float*>(peer_w[d]) : nullptr;
    for (int j = j0 + warp; j < j1; j += nw) {
      const i64 t = send_tok[(i64)d * P + j];
      const i64 row = (i64)me * P + j;
      warp_copy_row<U, UNROLL>(x + t * units, dst + row * units, units, lane);
      if (dw != nullptr)
        for (int k = lane; k < K; k += 32) dw[row * K + k] = w[t * K + k];
    }
    block_signal(reinterpret_cast<unsigned*>(peer_flags[d]) + (i64)me * P + c, e);
  };
  // expand item -> (source, chunk); a remote chunk with no rows needs no flag
  auto exp_src = [&](int item, int& s, int& c) {
    if (item < n_own) {
      s = me;
      c = item;
    } else {
      const int q = item - n_own;
      c = q / Rd;
      s = peer(q - c * Rd);
    }
  };
  // received row r's weights: with w_travel from src (fresh: a peer wrote them during this kernel) into recv_wk
  // [rows,K], else read from recv_wk (a dispatch's, for combine_bwd); and into each of its slots' expert-major
  // rows of out_w (ep_copy_rows' and ep_fill_rows' work)
  auto put_w = [&](const float* src, bool fresh, i64 r) {
    if (recv_wk == nullptr || (!w_travel && out_w == nullptr)) return;
    for (int k = lane; k < K; k += 32) {
      float v;
      if (w_travel) {
        v = fresh ? __ldcg(src + k) : __ldg(src + k);
        recv_wk[r * K + k] = v;
      } else {
        v = recv_wk[r * K + k];
      }
      if (out_w != nullptr) {
        const int d = __ldg(dst_row + r * K + k);
        if (d >= 0) out_w[d] = v;
      }
    }
  };
  auto expand = [&](int s, int c) {
    const int kept = min(recv_counts[s], P), j0 = c * C, j1 = min(j0 + C, kept);
    for (int j = j0 + warp; j < j1; j += nw) {
      const i64 r = (i64)recv_off[s] + j;
      if constexpr (Sink::SCALE) {  // the row's weights laid out first: the sink scales by them
        put_w(nullptr, false, r);
        __syncwarp();
      }
      if (s == me) {
        const i64 t = send_tok[(i64)me * P + j];
        if (out != nullptr)
          warp_expand_row<U, UNROLL, false>(x + t * units, sink, dst_row + r * K, K, units, lane);
        else  // the caller reads the stage: the own rows go there too
          warp_copy_row<U, UNROLL>(x + t * units, const_cast<U*>(stage) + ((i64)me * P + j) * units, units, lane);
        if constexpr (!Sink::SCALE) put_w(w_travel ? w + t * K : nullptr, false, r);
      } else {
        if (out != nullptr)
          warp_expand_row<U, UNROLL, true>(stage + ((i64)s * P + j) * units, sink, dst_row + r * K, K, units, lane);
        if constexpr (!Sink::SCALE) put_w(w_travel ? wstage + ((i64)s * P + j) * K : nullptr, true, r);
      }
    }
  };
  auto has_rows = [&](int s, int c) { return c * C < min(recv_counts[s], P); };

  // the schedule above: Pb pushing blocks, the expand items rotated by Pb
  const int G = gridDim.x, Pb = min(n_push, max(1, G / 2));
  int pi = blockIdx.x < Pb ? blockIdx.x : n_push, ei = (blockIdx.x + G - Pb) % G;
  // zero items, claimed from the op's counter; zleft: this block may still find one
  const i64 nz = zero_src != nullptr ? (zero_n + nw - 1) / nw : 0;
  bool zleft = nz > 0;
  auto zero_item = [&]() {  // one item, or none left (then zleft turns false)
    const i64 z = claim_item(reinterpret_cast<unsigned long long*>(state + 2), e);
    if (z >= nz) {
      zleft = false;
      return;
    }
    const i64 n = z * nw + warp;
    if (n < zero_n && __ldg(zero_src + n) < 0) {
      if (zero_rows) warp_zero_row<U>(sink, (int)n, units, lane);
      if (out_w != nullptr && lane == 0) out_w[n] = 0.0f;
    }
  };
  while (pi < n_push) {
    push(pi);
    pi += Pb;
    if (ei < n_exp) {
      int s, c;
      exp_src(ei, s, c);
      if (s == me || !has_rows(s, c) || block_poll_flag(my_flags + (i64)s * P + c, e)) {
        expand(s, c);
        ei += gridDim.x;
      }
    }
  }
  for (; ei < n_exp; ei += gridDim.x) {
    int s, c;
    exp_src(ei, s, c);
    if (s != me && has_rows(s, c)) {
      const unsigned* f = my_flags + (i64)s * P + c;
      while (zleft && !block_poll_flag(f, e)) zero_item();
      if (!block_wait_flag(f, e, state, err_word, timeout_ns, op)) return;
    }
    expand(s, c);
  }
  while (zleft) zero_item();
}

// p[0, N) = the fp32 values a rounded to T (one 16-byte store when VEC, N = Vec<T>::N; else N = 1).
template <typename T, bool VEC>
__device__ __forceinline__ void store_rounded(T* p, const float* a) {
  if constexpr (VEC) {
    Vec<T> res;
#pragma unroll
    for (int q = 0; q < Vec<T>::N; ++q) res.v[q] = from_float<T>(a[q]);
    store_vec(p, res);
  } else {
    p[0] = from_float<T>(a[0]);
  }
}

// The partial of a received row over this rank's experts for vector v of H/N: the sum of wk * y[drow[k]]
// (k ascending, fp32 fused multiply-adds from 0, wk = wr[k] or 1 (wr == nullptr): the arithmetic of the
// permutation family's combine), KU slots' loads in flight before their FMAs in k order.
template <typename T, bool VEC>
__device__ __forceinline__ void row_partial(const T* __restrict__ y, const int* __restrict__ drow,
                                            const float* __restrict__ wr, int K, i64 H, i64 v,
                                            float (&acc)[VEC ? Vec<T>::N : 1]) {
  constexpr int N = VEC ? Vec<T>::N : 1;
  constexpr int KU = 4;
#pragma unroll
  for (int q = 0; q < N; ++q) acc[q] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += KU) {
    int d[KU];
    float wk[KU];
    Vec<T> a[KU];
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      d[u] = k0 + u < K ? __ldg(drow + k0 + u) : -1;
      wk[u] = d[u] >= 0 && wr != nullptr ? __ldg(wr + k0 + u) : 1.0f;
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      if (d[u] < 0) continue;
      if constexpr (VEC) a[u] = load_vec(y + (i64)d[u] * H + v * N);
      else a[u].v[0] = y[(i64)d[u] * H + v];
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      if (d[u] < 0) continue;
#pragma unroll
      for (int q = 0; q < N; ++q) acc[q] = fmaf(wk[u], to_float(a[u].v[q]), acc[q]);
    }
  }
}

// The combine direction in one kernel. Phase 1 (every pair, the own one too; chunk-major): for each received
// row r = recv_off[s] + j of chunk c of the pair (s, me), the partial z = row_partial(r) rounded to T, stored
// into rank s's stage row me*P + j (zw's K weight partials [rows,K] into its weight stage), then rank s's flag
// me*P + c. Phase 2 (after a block's phase-1 items): tokens t < Tn in groups of one per warp: out[t] = the
// fp32 sum over ranks q ascending of stage row q*P + send_pos[q][t] (each after its chunk's flag), rounded
// once (ep_owner_sum's order); grad_w[t][k] from the weight stage row of the rank of slot k's expert. One
// warp per row or token. Two blocks a multiprocessor (64 registers): the loads in flight bound the reduce
// (docs/ep.md §2). Phase 1 serves the sources of this rank's node [lo, hi) only, and phase 2 waits for the
// flags of those ranks only: the mixed transport has put the other ranks' partials into this rank's stage
// (rows q*P + pos, through NCCL) before this kernel (the direct transport: [0, R)).
template <typename T, bool VEC>
__global__ void __launch_bounds__(512, 2) ep_direct_combine(
    const T* __restrict__ y, const float* __restrict__ w, const float* __restrict__ zw,
    const long long* __restrict__ peer_rows, const long long* __restrict__ peer_w,
    const long long* __restrict__ peer_flags, const int* __restrict__ dst_row, const int* __restrict__ send_pos,
    const int* __restrict__ routing_me, const int* __restrict__ meta, T* __restrict__ out,
    float* __restrict__ grad_w, unsigned* __restrict__ state, int* __restrict__ err_word, i64 timeout_ns,
    int op, int R, int me, int P, int K, int L, int Tmax, int Tn, int C, i64 H, int lo, int hi) {
  __shared__ int s_fail;
  __shared__ int s_pos[16][32];  // per warp: send_pos of its token for each rank (R <= 32)
  unsigned e;
  if (!block_epoch(state, e)) return;
  if (threadIdx.x == 0) s_fail = 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int* recv_counts = meta + META_RECV_COUNTS(R);
  const int* recv_off = meta + META_RECV_OFF(R);
  int rmax = 0;
  for (int s = lo; s < hi; ++s) rmax = max(rmax, min(recv_counts[s], P));
  const int Rn = hi - lo;  // the node's ranks
  const int n_red = (rmax + C - 1) / C * Rn;
  constexpr int N = VEC ? Vec<T>::N : 1;
  const i64 nv = H / N;

  auto reduce = [&](int item) {
    const int c = item / Rn, s = lo + item - c * Rn;
    const int kept = min(recv_counts[s], P), j0 = c * C, j1 = min(j0 + C, kept);
    if (j0 >= j1) return;
    T* dst = reinterpret_cast<T*>(peer_rows[s]);
    float* dw = zw != nullptr ? reinterpret_cast<float*>(peer_w[s]) : nullptr;
    for (int j = j0 + warp; j < j1; j += nw) {
      const i64 r = (i64)recv_off[s] + j;
      const i64 row = (i64)me * P + j;
      T* o = dst + row * H;
      for (i64 v = lane; v < nv; v += 32) {
        float acc[N];
        row_partial<T, VEC>(y, dst_row + r * K, w != nullptr ? w + r * K : nullptr, K, H, v, acc);
        store_rounded<T, VEC>(o + v * N, acc);
      }
      if (dw != nullptr)
        for (int k = lane; k < K; k += 32) dw[row * K + k] = zw[r * K + k];
    }
    block_signal(reinterpret_cast<unsigned*>(peer_flags[s]) + (i64)me * P + c, e);
  };

  const T* stage = reinterpret_cast<const T*>(peer_rows[me]);
  const float* wstage = reinterpret_cast<const float*>(peer_w[me]);
  const unsigned* my_flags = reinterpret_cast<const unsigned*>(peer_flags[me]);
  const int n_tok = (Tn + nw - 1) / nw;
  // Sum item: tokens [item*nw, item*nw + nw), one a warp. 1 when summed; 0 when not all its chunks have landed
  // (wait = false: nothing done); -1 after a failed wait.
  auto sum = [&](int item, bool wait) -> int {
    const int t = item * nw + warp;
    if (t < Tn && lane < R) s_pos[warp][lane] = send_pos[(i64)lane * Tmax + t];
    __syncthreads();
    if (threadIdx.x == 0) {  // every chunk this group of tokens reads (positions ascend with t: few distinct)
      int ok = 1;
      for (int q = lo; q < hi && ok == 1; ++q) {  // the other ranks' rows arrived before the kernel
        int last = -1;
        for (int ww = 0; ww < nw && item * nw + ww < Tn; ++ww) {
          const int pos = s_pos[ww][q];
          if (pos < 0 || pos / C == last) continue;
          last = pos / C;
          const unsigned* f = my_flags + (i64)q * P + last;
          if (!wait) {
            if (!flag_reached(f, e)) { ok = 0; break; }
          } else if (!thread_wait_flag(f, e, state, err_word, timeout_ns, op)) {
            ok = -1;
            break;
          }
        }
      }
      s_fail = ok;
    }
    __syncthreads();
    const int ok = s_fail;
    if (ok == 1 && t < Tn) {
      T* o = out + (i64)t * H;
      for (i64 v = lane; v < nv; v += 32) {
        float acc[N];
#pragma unroll
        for (int q = 0; q < N; ++q) acc[q] = 0.0f;
        for (int r = 0; r < R; ++r) {
          const int pos = s_pos[warp][r];
          if (pos < 0) continue;
          const T* src = stage + ((i64)r * P + pos) * H;
          if constexpr (VEC) {
            Vec<T> a;
            a.raw = __ldcg(reinterpret_cast<const uint4*>(src + v * N));
#pragma unroll
            for (int q = 0; q < N; ++q) acc[q] += to_float(a.v[q]);
          } else {
            acc[0] += to_float(__ldcg(src + v));
          }
        }
        store_rounded<T, VEC>(o + v * N, acc);
      }
      if (grad_w != nullptr) {
        for (int k = lane; k < K; k += 32) {
          const int ex = routing_me[(i64)t * K + k];
          float g = 0.0f;
          if (ex >= 0) {
            const int q = ex / L;
            const int pos = s_pos[warp][q];
            if (pos >= 0) g = __ldcg(wstage + ((i64)q * P + pos) * K + k);
          }
          grad_w[(i64)t * K + k] = g;
        }
      }
    }
    __syncthreads();  // s_pos and s_fail are rewritten by the next item
    return ok;
  };

  // A block alternates: one reduce item, then its next sum item if that one's chunks have all landed; once its
  // reduce items are done it waits for its remaining sum items.
  int ri = blockIdx.x, si = blockIdx.x;
  while (ri < n_red) {
    reduce(ri);
    ri += gridDim.x;
    if (si < n_tok && sum(si, false) == 1) si += gridDim.x;
  }
  for (; si < n_tok; si += gridDim.x)
    if (sum(si, true) < 0) return;
}

// ---- The low-latency mode (moe_rt/ep_ll.py, docs/ep.md §8) --------------------------------------------
// Fixed slots, no plan: token t of source s for local expert l of rank d lands in rank d's receive buffer
// recv [L, R*Tmax, H] at row (l, s*Tmax + t). Every rank's IPC-shared buffers (tables peer_*, [R]):
//   recv   [L, R*Tmax, H]      dispatch direction (dispatch, combine_bwd): rows pushed by the sources
//   route  int32 [R, Tmax*K+1] per source s: local expert of each (t, k) on this rank or -1, then T_s
//   rw     fp32  [R, Tmax*K]   per source s: the weight of each (t, k) on this rank, else 0
//   back   [Tmax*K, H]         combine direction (combine, dispatch_bwd): row t*K + kf of this rank's token t
//                              from the rank holding its expert idx[t][kf] (kf: the first k of that expert)
//   bw     fp32  [Tmax*K]      combine direction: the value of slot (t, kf)
//   flags  uint32 [2, R, Tmax] flags[dir][s][c] = the epoch in which rank s finished chunk c (tokens
//                              [c*C, c*C + C)) of its writes into this rank's buffers of direction dir
// A group of num_buffers sets has these buffers once per set (the tables passed are the set's; flag_base
// = set * 2*R*Tmax offsets the flags). The op's leading ep_direct_barrier advanced the epoch (state[0]); flags
// are epoch-valued (never reset, graph replays stay valid). The grid is at most one resident wave and every block does all of its pushes
// before it waits, so no block waits on one that cannot run; a wait past timeout_ns records `op` in the
// host-mapped error word and raises the sticky failure flag (state[1]). Sums: fp32, k ascending, products
// and additions rounded separately (__fmul_rn, __fadd_rn: the NumPy reference's fp32 arithmetic, bit for
// bit), one final rounding.

// Publish a block's writes of chunk c to every rank's flag [dir][me][c] (threads 0..R-1).
__device__ __forceinline__ void ll_signal_all(const long long* __restrict__ peer_flags, int R, i64 idx,
                                              unsigned e) {
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    __threadfence_system();
    st_release_sys_u32(reinterpret_cast<unsigned*>(peer_flags[r]) + idx, e);
  }
}

// The whole block waits until flags f[c] (c_lo <= c <= c_hi, and c = 0 when `first`) all reach e, one flag a
// thread; false after a failed wait (thread_wait_flag's timeout report).
__device__ __forceinline__ bool ll_block_wait_range(const unsigned* f, int c_lo, int c_hi, bool first, unsigned e,
                                                    unsigned* state, int* err_word, i64 timeout_ns, int op) {
  const int n = c_hi - c_lo + 1, m = n + (first && c_lo > 0 ? 1 : 0);
  int ok = 1;
  for (int i = threadIdx.x; i < m && ok; i += blockDim.x)
    if (!thread_wait_flag(f + (i < n ? c_lo + i : 0), e, state, err_word, timeout_ns, op)) ok = 0;
  return __syncthreads_and(ok) != 0;
}

// The whole block waits until flags f[i] (i < n) all reach e; false after a failed wait.
__device__ __forceinline__ bool ll_block_wait_all(const unsigned* f, int n, unsigned e, unsigned* state,
                                                  int* err_word, i64 timeout_ns, int op) {
  return ll_block_wait_range(f, 0, n - 1, false, e, state, err_word, timeout_ns, op);
}

// ---- Pairwise synchronisation (MOE_RT_LL_SYNC=pairwise; docs/ep.md §8) -------------------------------------
// No ep_direct_barrier before the op: its fused kernel (the *_pairwise builds, PAIRWISE = true) takes the epoch
// e = state[0] + 1 itself and announces it into its slot [me] of every rank's barrier region (the barrier's
// slots: slot s of rank r = the last epoch rank s reached); a block waits, before its first store into rank d's
// buffers, until d's announce in this rank's region reaches e (d started op e: everything earlier on its
// stream, which reads those buffers, is done). Every block announces (threads r < R, system-scope releases), so
// a peer needs one running block of this rank, never a particular one. *count (zeroed once) counts the blocks
// that took e; the last advances state[0] to e and zeroes the count, so the next op (or a graph replay) takes
// e + 1. A wait past timeout_ns reports as the flag waits do (thread_wait_flag).

// The block's epoch of a pairwise op (every block is counted, failed or not), then its announce; false after an
// earlier failure (state[1]): the kernel then does nothing. Only the read of state[0] holds the block up: the
// announce goes out right after it, and thread 0 counts the block after that (its wait for the count's atomic
// overlaps the peers' announces). The announce is a relaxed store: it publishes no data of this kernel, only
// that this rank's earlier work on the stream, which read the buffers the peer will write, has completed
// (kernel boundaries order that); a release would put a system fence before it. (Counting from another warp
// took ep_ll_combine_pairwise from 64 to 92 registers: one resident block a multiprocessor instead of two.)
__device__ __forceinline__ bool ll_pair_begin(const long long* __restrict__ peer_bar, unsigned* __restrict__ count,
                                              unsigned* __restrict__ state, int R, int me, unsigned& e) {
  __shared__ unsigned s_e;
  __shared__ int s_failed;
  if (threadIdx.x == 0) {
    s_e = *reinterpret_cast<volatile unsigned*>(state) + 1u;
    s_failed = (int)*reinterpret_cast<volatile unsigned*>(state + 1);
  }
  __syncthreads();
  e = s_e;
  const bool failed = s_failed != 0;
  if (!failed)
    for (int r = threadIdx.x; r < R; r += blockDim.x)
      st_relaxed_sys_u32(reinterpret_cast<unsigned*>(peer_bar[r]) + me, e);
  if (threadIdx.x == 0) {
    __threadfence();  // the block's read of state[0] before its count
    if (atomicAdd(count, 1u) == gridDim.x - 1u) {  // every block has read state[0]
      __threadfence();
      *count = 0u;
      state[0] = e;
    }
  }
  return !failed;
}

// Before the block's first store into rank d's buffers (d < 0: every rank's): the announce of d (of every rank
// but this one; thread r waits for rank r) in this rank's region reaches e. False after a failed wait.
__device__ __forceinline__ bool ll_block_wait_announce(const long long* __restrict__ peer_bar, int R, int me, int d,
                                                       unsigned e, unsigned* state, int* err_word, i64 timeout_ns,
                                                       int op) {
  if (d == me) return true;  // block-uniform: this rank's own buffers
  const unsigned* mine = reinterpret_cast<const unsigned*>(peer_bar[me]);
  int ok = 1;
  if (d >= 0) {
    if (threadIdx.x == 0) ok = thread_wait_flag(mine + d, e, state, err_word, timeout_ns, op) ? 1 : 0;
  } else {
    for (int r = threadIdx.x; r < R && ok; r += blockDim.x)
      if (r != me && !thread_wait_flag(mine + r, e, state, err_word, timeout_ns, op)) ok = 0;
  }
  return __syncthreads_and(ok) != 0;
}

// The rows a block moves for one chunk: at most LL_MAX_ROWS (chunk_tokens() <= 8 tokens times K <= 64).
constexpr int LL_MAX_ROWS = 512;
constexpr int LL_UNROLL = 4;  // 16-byte loads a thread has in flight before its stores
constexpr int LL_PUSH = 1, LL_RECEIVE = 2;  // ep_ll_dispatch's phases (both: 3)

// The whole block moves n rows of H elements: dst[i][h] = src[i][h], or (`scaled`) the rounded fp32
// product scale[i] * src[i][h]; rows with dst[i] == nullptr are skipped. The
// (row, vector) pairs are spread over every thread of the block, each with LL_UNROLL loads in flight, so a
// chunk of a few rows still keeps the block's loads and peer stores pipelined. Sources are local arrays
// written before the kernel (plain loads).
template <typename T, bool VEC>
__device__ __forceinline__ void ll_block_rows(const T* const* src, T* const* dst, const float* scale, int n,
                                              i64 H, bool scaled) {
  constexpr int N = VEC ? Vec<T>::N : 1;
  const int nv = (int)(H / N);
  const int total = n * nv;
  for (int i0 = threadIdx.x; i0 < total; i0 += blockDim.x * LL_UNROLL) {
    Vec<T> a[LL_UNROLL];
    T b[LL_UNROLL];
    int r[LL_UNROLL], v[LL_UNROLL];
#pragma unroll
    for (int u = 0; u < LL_UNROLL; ++u) {
      const int i = i0 + u * (int)blockDim.x;
      r[u] = -1;
      if (i < total) {
        const int q = i / nv;
        if (dst[q] != nullptr) {
          r[u] = q;
          v[u] = i - q * nv;
          if constexpr (VEC) a[u] = load_vec(src[q] + (i64)v[u] * N);
          else b[u] = src[q][v[u]];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < LL_UNROLL; ++u) {
      if (r[u] < 0) continue;
      const float sc = scale[r[u]];
      if constexpr (VEC) {
        if (scaled) {
#pragma unroll
          for (int q = 0; q < N; ++q) a[u].v[q] = from_float<T>(__fmul_rn(sc, to_float(a[u].v[q])));
        }
        store_vec(dst[r[u]] + (i64)v[u] * N, a[u]);
      } else {
        dst[r[u]][v[u]] = scaled ? from_float<T>(__fmul_rn(sc, to_float(b[u]))) : b[u];
      }
    }
  }
}

// FP8 rows (ep_ll_dispatch_fp8): each slot row travels as H e4m3 codes into recv_q [L, R*Tmax, H] and
// S = ceil(H/128) fp32 scales into recv_s [L, R*Tmax, S] (H + 4S bytes instead of H * sizeof(T)).
constexpr int LL_FP8_BLOCK = EP_FP8_BLOCK;            // channels per scale (docs/fp8.md)
constexpr int LL_FP8_CH = 16;                         // channels a thread takes: 16 codes, one 16-byte store
constexpr int LL_FP8_LANES = LL_FP8_BLOCK / LL_FP8_CH;  // threads per 128-channel block
constexpr int LL_FP8_UNROLL = 2;                      // blocks a thread has loaded before it stores

// The FP8 push of one chunk (tokens t0 .. t0 + n - 1) by the whole block, in (token, 128-channel block)
// items of LL_FP8_LANES threads, each thread 16 channels: a float x is read once and quantized (quantize_fp8's
// rule: amax as the largest |x| bit pattern, scale = e4m3_block_scale(amax), codes e4m3(x / scale)), a
// pre-quantized pair (xq codes [T,H], xs scales [T,S]) is read as is; the item's codes and scale go to every
// destination row of its token (qdst[i*K + k], sdst likewise; nullptr skipped). Items are spread over every
// thread of the block (a chunk of a few tokens keeps the loads and peer stores pipelined); the loop bound is
// the same for every thread, so the 8-lane amax shuffles always see full warps. VEC: H % 16 == 0 and the
// sources 16-byte aligned (the host checks).
template <typename T, bool VEC>
__device__ __forceinline__ void ll_block_fp8(const T* x, const unsigned char* xq, const float* xs, int t0, int n,
                                             int K, unsigned char* const* qdst, float* const* sdst, i64 H, int S) {
  union Codes {
    uint4 raw;
    unsigned char b[LL_FP8_CH];
  };
  const int g = threadIdx.x % LL_FP8_LANES, slot = threadIdx.x / LL_FP8_LANES;
  const int per_pass = blockDim.x / LL_FP8_LANES;
  const int items = n * S;
  for (int i0 = 0; i0 < items; i0 += per_pass * LL_FP8_UNROLL) {  // the same trip count in every thread
    Codes q[LL_FP8_UNROLL];
    float f[LL_FP8_UNROLL][LL_FP8_CH], sc[LL_FP8_UNROLL];
    int tok[LL_FP8_UNROLL], blk[LL_FP8_UNROLL], c0[LL_FP8_UNROLL], c1[LL_FP8_UNROLL];
#pragma unroll
    for (int u = 0; u < LL_FP8_UNROLL; ++u) {
      const int it = i0 + u * per_pass + slot;
      tok[u] = -1;
      if (it < items) {
        tok[u] = it / S;
        blk[u] = it - tok[u] * S;
        c0[u] = blk[u] * LL_FP8_BLOCK + g * LL_FP8_CH;
        c1[u] = (int)min((i64)(blk[u] + 1) * LL_FP8_BLOCK, H);
        const i64 row = (i64)(t0 + tok[u]) * H;
        if (xq != nullptr) {
          sc[u] = xs[(i64)(t0 + tok[u]) * S + blk[u]];
          if constexpr (VEC) {
            if (c0[u] < c1[u]) q[u].raw = *reinterpret_cast<const uint4*>(xq + row + c0[u]);
          } else {
#pragma unroll
            for (int j = 0; j < LL_FP8_CH; ++j) q[u].b[j] = c0[u] + j < c1[u] ? xq[row + c0[u] + j] : 0;
          }
        } else if (VEC) {
          if (c0[u] < c1[u]) {
#pragma unroll
            for (int j = 0; j < LL_FP8_CH; j += Vec<T>::N) {
              const Vec<T> v = load_vec(x + row + c0[u] + j);
#pragma unroll
              for (int q2 = 0; q2 < Vec<T>::N; ++q2) f[u][j + q2] = to_float(v.v[q2]);
            }
          } else {
#pragma unroll
            for (int j = 0; j < LL_FP8_CH; ++j) f[u][j] = 0.0f;
          }
        } else {
#pragma unroll
          for (int j = 0; j < LL_FP8_CH; ++j) f[u][j] = c0[u] + j < c1[u] ? to_float(x[row + c0[u] + j]) : 0.0f;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < LL_FP8_UNROLL; ++u) {
      if (xq == nullptr) {  // quantize: every thread shuffles (inactive items give 0), lanes of one item reduce
        unsigned m = 0;
        if (tok[u] >= 0) {
#pragma unroll
          for (int j = 0; j < LL_FP8_CH; ++j) m = max(m, abs_bits(f[u][j]));
        }
#pragma unroll
        for (int o = LL_FP8_LANES / 2; o > 0; o >>= 1) {
          const unsigned v = __shfl_xor_sync(0xffffffffu, m, o);
          m = v > m ? v : m;
        }
        if (tok[u] >= 0) {
          sc[u] = e4m3_block_scale(m);
          unsigned c[LL_FP8_CH / 4];
          e4m3_codes<LL_FP8_CH>(f[u], sc[u], c);
          q[u].raw = make_uint4(c[0], c[1], c[2], c[3]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < LL_FP8_UNROLL; ++u) {
      if (tok[u] < 0) continue;
      for (int k = 0; k < K; ++k) {
        unsigned char* dst = qdst[tok[u] * K + k];
        if (dst == nullptr) continue;
        if (g == 0) sdst[tok[u] * K + k][blk[u]] = sc[u];
        if constexpr (VEC) {
          if (c0[u] < c1[u]) *reinterpret_cast<uint4*>(dst + c0[u]) = q[u].raw;
        } else {
          for (int j = 0; j < LL_FP8_CH && c0[u] + j < c1[u]; ++j) dst[c0[u] + j] = q[u].b[j];
        }
      }
    }
  }
}

// The receiver's view of a dispatch's routing (LlRoute::row(s, t)[k]: the local expert of source s's token t's
// k on this rank, or -1): the route table the launch's own pushes wrote (stride Tmax*K + 1, source s's T_s in
// its last word: rows t >= T_s are stale), or a handle's route [R, Tmax, K] (rows t >= T_s already -1).
struct LlRoute {
  const int* p;
  i64 stride;
  int counted;
  // token (s, t)'s K entries, or nullptr for a token the source does not have (counted tables)
  __device__ __forceinline__ const int* row(int s, int t, int K) const {
    const int* r = p + (i64)s * stride;
    if (counted && t >= __ldcg(r + stride - 1)) return nullptr;
    return r + (i64)t * K;
  }
};

// The receiving side's row moves, by the whole block: for i < n, unit o of row dst[i] = f(unit o of row
// src[i]) (rows of `units` units), the (row, unit) pairs spread over every thread with LL_UNROLL loads in
// flight: v = load(src row, o) for each, then store(dst row * units + o, v). The sources were written by peers
// before the flags this block acquired: the loads read past L1 (ldcg).
template <typename V, typename Load, typename Store>
__device__ __forceinline__ void ll_block_move(i64 units, const i64* src, const i64* dst, int n, Load load,
                                              Store store) {
  const i64 total = (i64)n * units;
  for (i64 i0 = threadIdx.x; i0 < total; i0 += (i64)blockDim.x * LL_UNROLL) {
    V v[LL_UNROLL];
    i64 at[LL_UNROLL];
#pragma unroll
    for (int u = 0; u < LL_UNROLL; ++u) {
      const i64 i = i0 + (i64)u * blockDim.x;
      at[u] = -1;
      if (i < total) {
        const i64 q = i / units, o = i - q * units;
        v[u] = load(src[q], o);
        at[u] = dst[q] * units + o;
      }
    }
#pragma unroll
    for (int u = 0; u < LL_UNROLL; ++u)
      if (at[u] >= 0) store(at[u], v[u]);
  }
}

// The dedup split's copies: rows dst[i] = src[i] (i < n; row indices in units of `units` U from base).
template <typename U>
__device__ __forceinline__ void ll_block_copy(U* base, i64 units, const i64* src, const i64* dst, int n) {
  ll_block_move<U>(units, src, dst, n, [&](i64 r, i64 o) { return __ldcg(base + r * units + o); },
                   [&](i64 at, U v) { base[at] = v; });
}

// The dequantization of FP8 rows (codes q [., H], scales sc [., S]) into rows of y [., H]: y row dst[i] =
// dequantize(row src[i]) (dequantize_fp8's rule: store_as<T>(mul_rn(e4m3 code, its block's scale))), in
// groups of 16 codes (VEC) or single codes.
struct LlCodes {
  uint4 raw;
  float scale;
};
template <typename T, bool VEC>
__device__ __forceinline__ void ll_block_dequant(const unsigned char* q, const float* sc, T* y, i64 H, int S,
                                                 const i64* src, const i64* dst, int n) {
  constexpr int G = VEC ? LL_FP8_CH : 1;  // codes a unit
  ll_block_move<LlCodes>(
      H / G, src, dst, n,
      [&](i64 r, i64 o) {
        LlCodes v;
        if constexpr (VEC) v.raw = __ldcg(reinterpret_cast<const uint4*>(q + r * H) + o);
        else v.raw.x = __ldcg(q + r * H + o);
        v.scale = __ldcg(sc + r * S + o * G / LL_FP8_BLOCK);
        return v;
      },
      [&](i64 at, const LlCodes& v) {  // unit `at` of y: codes at * G onwards
        const unsigned char* b = reinterpret_cast<const unsigned char*>(&v.raw);
        if constexpr (VEC) {
#pragma unroll
          for (int j = 0; j < G; j += Vec<T>::N) {
            Vec<T> w;
#pragma unroll
            for (int e = 0; e < Vec<T>::N; e += 4)
              dequant4(*reinterpret_cast<const unsigned*>(b + j + e), v.scale, *reinterpret_cast<T(*)[4]>(w.v + e));
            store_vec(y + at * G + j, w);
          }
        } else {
          y[at] = store_as<T>(mul_rn(from_e4m3(b[0]), v.scale));
        }
      });
}

// Unsigned units of a float element (the non-vector copies of ll_block_copy).
template <int B> struct LlUnit;
template <> struct LlUnit<2> { typedef unsigned short type; };
template <> struct LlUnit<4> { typedef unsigned type; };

// The dispatch direction, one kernel (ll_dispatch: the body of ep_ll_dispatch and ep_ll_dispatch_fp8).
// Push items (chunks c of this rank's tokens, C tokens each):
//   meta (dispatch): every rank r gets route[me][t*K+k] = l for its experts (else -1), rw[me][t*K+k] the
//     weight (else 0), and, from chunk 0, route[me][Tmax*K] = Tn; idx_out/w_out get the owner's copies
//     (int32 ids, outside [-1, E) recorded in `err` and taken as -1; fp32 weights);
//   rows, per-expert pushes (dedup off, or `scaled`): for each (t, k) whose expert e = idx[t][k] is valid and
//     not chosen by an earlier k of t: x[t] into rank e/L's recv row (e%L, me*Tmax + t); scaled: times ws =
//     the fp32 sum (k ascending) of the weights of t's slots with expert e, rounded once;
//   rows, dedup split (`dedup`, not `scaled`): a token's row crosses to each destination rank once: for each
//     (t, k) whose expert e is valid and whose rank d = e/L no earlier k of t names, x[t] into rank d's recv
//     row (e%L, me*Tmax + t) only (the slot of t's first expert on d); the receiver copies it to the slots
//     (l, me*Tmax + t) of t's other local experts l there (the same column j of every local expert's block, so
//     the copy is one local row copy in HBM instead of one more row over NVLink: at T=128, K=8, E=256 a
//     token's 8 experts lie on about 2 distinct ranks at R=2 and 3.6 at R=4);
//   FP8: the row's codes and scales (ll_block_fp8) into recv_q and recv_s rows instead, either way;
//   then flags[0][me][c] of every rank.
// Receiver items (local experts l): zero_k given: zero recv rows (l, j) whose zero_k[l][j] < 0 (not waited
// for: no peer and no copy writes them, both write valid slots only); then wait for every rank's every
// chunk; then, when slot_k is given, slot_k[l][j] = the first k of source s = j / Tmax's token t = j % Tmax
// (< T_s) with local expert l, or -1, slot_w[l][j] = the fp32 sum of those slots' weights (k ascending; 0
// when invalid), counts[l] = the valid slots; route_out (a share of [R, Tmax, K] per item) = route with the
// rows t >= T_s as -1.
// The dedup split's copies (the receive phase, before the expert items' wait): every block, expert item or not,
// takes a contiguous share of the R*Tmax token columns j, waits for the flags of the chunks those columns lie
// in (and chunk 0 of their sources, which carries T_s; so each copying block has itself acquired the flag of
// every row it reads, and copies while other chunks still arrive) and, for each token (s, t) with the route's
// local experts l0 (its first k's) and l (a later k's, distinct from l0 and from earlier k's), copies row
// (l0, j) to (l, j): recv rows, or FP8 codes and scales. FP8 with `dequant` takes the same pass (with or
// without the dedup split) and dequantizes instead: every valid slot (l, j) of recv from its pushed slot's
// codes and scales ((l0, j), or (l, j) without the split; ll_block_dequant), the codes' copies not made
// (nothing returns them), so the dequantization runs on every block as the chunks land. The route: the table
// this launch's pushes wrote (meta), or
// recv_route (a launch without meta, combine_bwd: the handle's route [R, Tmax, K]; without it the pushes stay
// per expert).
// phases: LL_PUSH | LL_RECEIVE in one launch, or split (a receive hook): the push launch records its epoch in
// *set_epoch (given), the later LL_RECEIVE launch (no barrier before it) waits for that epoch's flags; the
// copies belong to the receive launch.
// PAIRWISE: the pairwise build (ll_pair_begin; a push block waits for every rank's announce before its first
// item); peer_bar and count its arguments (unused otherwise). A receive launch takes no epoch of its own.
template <typename T, typename IdxT, bool VEC, bool FP8, bool PAIRWISE>
__device__ __forceinline__ void ll_dispatch(
    const T* __restrict__ x, const unsigned char* __restrict__ xq, const float* __restrict__ xs,
    const IdxT* __restrict__ idx, const float* __restrict__ w, int Tn, int meta, int scaled, int dedup,
    const long long* __restrict__ peer_recv, const long long* __restrict__ peer_recv_q,
    const long long* __restrict__ peer_recv_s, const long long* __restrict__ peer_route,
    const long long* __restrict__ peer_rw, const long long* __restrict__ peer_flags, int* __restrict__ idx_out,
    float* __restrict__ w_out, int* __restrict__ route_out, int* __restrict__ slot_k, float* __restrict__ slot_w,
    int* __restrict__ counts, const int* __restrict__ zero_k, const int* __restrict__ recv_route, int dequant,
    unsigned* __restrict__ err, unsigned* __restrict__ state, int* __restrict__ err_word, i64 timeout_ns, int op,
    int R, int me, int L, int Tmax, int K, int C, i64 H, int S, int phases, i64 flag_base,
    unsigned* __restrict__ set_epoch, const long long* __restrict__ peer_bar, unsigned* __restrict__ count) {
  __shared__ const T* s_src[FP8 ? 1 : LL_MAX_ROWS];
  __shared__ T* s_dst[FP8 ? 1 : LL_MAX_ROWS];
  __shared__ float s_scale[FP8 ? 1 : LL_MAX_ROWS];
  __shared__ unsigned char* s_qdst[FP8 ? LL_MAX_ROWS : 1];
  __shared__ float* s_sdst[FP8 ? LL_MAX_ROWS : 1];
  unsigned e;
  LL_TRACE(0);
  if constexpr (PAIRWISE) {
    if (!((phases & LL_PUSH) ? ll_pair_begin(peer_bar, count, state, R, me, e) : block_epoch(state, e))) return;
  } else {
    if (!block_epoch(state, e)) return;
  }
  LL_TRACE(1);
  if (phases == LL_RECEIVE) {  // a receive hook: the epoch its push launch ran in
    e = *reinterpret_cast<volatile unsigned*>(set_epoch);
  } else if (set_epoch != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    *set_epoch = e;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int E = L * R;
  const int NC = (Tmax + C - 1) / C;
  const i64 RT = (i64)R * Tmax;
  const i64 route_stride = (i64)Tmax * K + 1;
  // the dedup split: not for scaled rows (the scale differs per expert), and only with a route the receiver
  // can read (meta, or the handle's)
  const bool dd = dedup != 0 && scaled == 0 && (meta != 0 || recv_route != nullptr);
  auto expert = [&](i64 i) -> int {  // the validated expert id of flat slot i (t < Tn)
    const i64 v = (i64)idx[i];
    return v >= 0 && v < E ? (int)v : -1;
  };
  for (int c = blockIdx.x; c < NC && (phases & LL_PUSH); c += gridDim.x) {
    const int t0 = c * C, t1 = min(t0 + C, Tn);
    LL_TRACE_FIRST(2);
    // The item's local work first (its ids checked, the owner's copies, the row table), so that the block's
    // first item does it while the peers' announces arrive; its stores into peers after the wait: the rows,
    // then the route rows (small: they land while the rows are on the wire), then the flags.
    if (meta) {
      for (i64 i = (i64)t0 * K + threadIdx.x; i < (i64)t1 * K; i += blockDim.x) {
        const i64 v = (i64)idx[i];
        if (expert(i) < 0 && v != -1) record_bad_expert_id(err, MOE_RT_ERR_EP_LL_DISPATCH, v, i, E);
        if (idx_out != nullptr) idx_out[i] = expert(i);
        if (w_out != nullptr) w_out[i] = w != nullptr ? w[i] : 0.0f;
      }
    }
    // the chunk's rows: one entry per (t, k), nullptr where the slot is invalid or repeats an earlier k's
    // expert (dedup split: an earlier k's rank) — that k's row carries it
    for (int p = threadIdx.x; p < (t1 - t0) * K; p += blockDim.x) {
      const int t = t0 + p / K, k = p - (p / K) * K;
      const i64 base = (i64)t * K;
      const int ex = expert(base + k);
      bool first = ex >= 0;
      const int d = first ? ex / L : 0;
      for (int q = 0; q < k && first; ++q) {
        const int eq = expert(base + q);
        first = dd ? eq < 0 || eq / L != d : eq != ex;
      }
      const i64 row = first ? (i64)(ex - d * L) * RT + (i64)me * Tmax + t : 0;
      if constexpr (FP8) {
        s_qdst[p] = first ? reinterpret_cast<unsigned char*>(peer_recv_q[d]) + row * H : nullptr;
        s_sdst[p] = first ? reinterpret_cast<float*>(peer_recv_s[d]) + row * S : nullptr;
      } else {
        float ws = 0.0f;
        if (first && scaled)
          for (int q = 0; q < K; ++q)
            if (expert(base + q) == ex) ws = __fadd_rn(ws, w[base + q]);
        s_src[p] = x + (i64)t * H;
        s_dst[p] = first ? reinterpret_cast<T*>(peer_recv[d]) + row * H : nullptr;
        s_scale[p] = ws;
      }
    }
    bool waited = false;
    if constexpr (PAIRWISE) {  // the block's first item: rows, route rows and flags go to every rank
      if (c == (int)blockIdx.x) {
        if (!ll_block_wait_announce(peer_bar, R, me, -1, e, state, err_word, timeout_ns, op)) return;
        waited = true;  // its block barrier orders the row table too
      }
    }
    if (!waited) __syncthreads();
    LL_TRACE_FIRST(3);
    if constexpr (FP8) ll_block_fp8<T, VEC>(x, xq, xs, t0, t1 - t0, K, s_qdst, s_sdst, H, S);
    else ll_block_rows<T, VEC>(s_src, s_dst, s_scale, (t1 - t0) * K, H, scaled != 0);
    if (meta) {
      for (i64 i = (i64)t0 * K + threadIdx.x; i < (i64)t1 * K; i += blockDim.x) {
        const int ex = expert(i);
        const float wk = w != nullptr ? w[i] : 0.0f;
        const int d = ex >= 0 ? ex / L : -1;
        for (int r = 0; r < R; ++r) {
          reinterpret_cast<int*>(peer_route[r])[(i64)me * route_stride + i] = r == d ? ex - d * L : -1;
          reinterpret_cast<float*>(peer_rw[r])[(i64)me * (route_stride - 1) + i] = r == d ? wk : 0.0f;
        }
      }
      if (c == 0)
        for (int r = threadIdx.x; r < R; r += blockDim.x)
          reinterpret_cast<int*>(peer_route[r])[(i64)me * route_stride + route_stride - 1] = Tn;
    }
    LL_TRACE_SYNC(4);
    ll_signal_all(peer_flags, R, flag_base + (i64)me * Tmax + c, e);
    LL_TRACE_SYNC(5);
  }
  if (!(phases & LL_RECEIVE)) {
    LL_TRACE(10);
    return;
  }
  // receiver items
  const unsigned* my_flags = reinterpret_cast<const unsigned*>(peer_flags[me]) + flag_base;
  const int* st_route = reinterpret_cast<const int*>(peer_route[me]);
  const float* st_rw = reinterpret_cast<const float*>(peer_rw[me]);
  T* my_recv = reinterpret_cast<T*>(peer_recv[me]);
  if (zero_k != nullptr) {
    for (int l = blockIdx.x; l < L; l += gridDim.x) {
      for (i64 j = warp; j < RT; j += nw) {
        if (zero_k[(i64)l * RT + j] >= 0) continue;
        T* row = my_recv + ((i64)l * RT + j) * H;
        if constexpr (VEC) {
          for (i64 v = lane; v < H / Vec<T>::N; v += 32)
            *reinterpret_cast<uint4*>(row + v * Vec<T>::N) = make_uint4(0u, 0u, 0u, 0u);
        } else {
          for (i64 h = lane; h < H; h += 32) row[h] = from_float<T>(0.0f);
        }
      }
    }
  }
  // The dedup split's copies (every block: a contiguous share [j_lo, j_hi) of the token columns) wait only for
  // the chunks their columns read: column j = s*Tmax + t reads source s's route row of t (rrow: the dedup
  // decision looks at that token's own K entries only), with a counted route also T_s (route[s][Tmax*K],
  // written with chunk 0), and the pushed row (l0, j) (codes and scales with FP8): all written by rank s
  // before its flag [0][s][t / C] (chunk 0's for T_s), which its fence publishes. The copy's destinations
  // (l, j), l != l0, are no peer's in this launch (the dedup split pushes t's row to one slot of this rank)
  // nor zero_k's (valid slots), so the copies need no other chunk. Then the expert items wait for every chunk
  // of every rank (each rank's flags [0][s][c] for c < NC): the slot tables, counts and route_out read every
  // source's whole route. The loads after a wait read past L1 (__ldcg), as the acquiring thread may differ
  // from the reading one. FP8 rows asked dequantized take the same pass (the header above).
  const bool deq = FP8 && dequant != 0;  // FP8 launches are dispatch's: meta, so a route to read
  const bool copies = dd || deq;
  if (blockIdx.x >= L && !copies) {
    LL_TRACE(10);
    return;
  }
  LL_TRACE(6);
  const LlRoute rt = meta ? LlRoute{st_route, route_stride, 1} : LlRoute{recv_route, (i64)Tmax * K, 0};
  if (copies) {
    __shared__ i64 s_csrc[LL_MAX_ROWS], s_cdst[LL_MAX_ROWS];
    __shared__ int s_nc;
    const i64 per = (RT + gridDim.x - 1) / gridDim.x;  // token columns of this block
    const i64 j_lo = min((i64)blockIdx.x * per, RT), j_hi = min(j_lo + per, RT);
    for (int s = (int)(j_lo / Tmax); s < R && (i64)s * Tmax < j_hi; ++s) {  // the sources of [j_lo, j_hi)
      const int t_lo = (int)max(j_lo - (i64)s * Tmax, (i64)0), t_hi = (int)min(j_hi - (i64)s * Tmax, (i64)Tmax);
      if (!ll_block_wait_range(my_flags + (i64)s * Tmax, t_lo / C, (t_hi - 1) / C, rt.counted != 0, e, state,
                               err_word, timeout_ns, op))
        return;
    }
    const int batch = LL_MAX_ROWS / K;  // columns per pass: at most one copy per (column, k)
    for (i64 jb = j_lo; jb < j_hi; jb += batch) {
      const int nb = (int)min((i64)batch, j_hi - jb);
      if (threadIdx.x == 0) s_nc = 0;
      __syncthreads();
      for (int p = threadIdx.x; p < nb * K; p += blockDim.x) {
        const i64 j = jb + p / K;
        const int k = p - (p / K) * K, s = (int)(j / Tmax);
        const int* rrow = rt.row(s, (int)(j - (i64)s * Tmax), K);
        if (rrow == nullptr) continue;
        const int l = __ldcg(rrow + k);
        if (l < 0) continue;
        int l0 = -1;
        bool dup = false;
        for (int q = 0; q < k; ++q) {
          const int v = __ldcg(rrow + q);
          if (v < 0) continue;
          if (l0 < 0) l0 = v;
          dup = dup || v == l;
        }
        if (dup) continue;  // a repeat of an earlier k's expert
        if (!dd || l0 < 0) {  // l's own pushed slot: dequantized in place of l, else nothing to copy
          if (!deq) continue;
          l0 = l;
        }
        const int n = atomicAdd(&s_nc, 1);  // the list's order does not matter: distinct destinations
        s_csrc[n] = (i64)l0 * RT + j;
        s_cdst[n] = (i64)l * RT + j;
      }
      __syncthreads();
      const int n = s_nc;
      if constexpr (FP8) {
        unsigned char* q = reinterpret_cast<unsigned char*>(peer_recv_q[me]);
        float* qs = reinterpret_cast<float*>(peer_recv_s[me]);
        if (deq) {
          ll_block_dequant<T, VEC>(q, qs, my_recv, H, S, s_csrc, s_cdst, n);
        } else {
          if constexpr (VEC) ll_block_copy<uint4>(reinterpret_cast<uint4*>(q), H / 16, s_csrc, s_cdst, n);
          else ll_block_copy<unsigned char>(q, H, s_csrc, s_cdst, n);
          ll_block_copy<float>(qs, S, s_csrc, s_cdst, n);
        }
      } else if constexpr (VEC) {
        ll_block_copy<uint4>(reinterpret_cast<uint4*>(my_recv), H / Vec<T>::N, s_csrc, s_cdst, n);
      } else {
        typedef typename LlUnit<sizeof(T)>::type U;
        ll_block_copy<U>(reinterpret_cast<U*>(my_recv), H, s_csrc, s_cdst, n);
      }
      __syncthreads();  // s_nc and the list are reset by the next pass
    }
    LL_TRACE_SYNC(8);
  }
  if (blockIdx.x >= L) {
    LL_TRACE(10);
    return;
  }
  int ok = 1;
  for (int s = 0; s < R && ok; ++s)
    ok = ll_block_wait_all(my_flags + (i64)s * Tmax, NC, e, state, err_word, timeout_ns, op) ? 1 : 0;
  if (!ok) return;
  LL_TRACE(7);
  for (int l = blockIdx.x; l < L; l += gridDim.x) {
    if (slot_k != nullptr) {
      int cnt = 0;
      for (i64 j0 = 0; j0 < RT; j0 += blockDim.x) {
        const i64 j = j0 + threadIdx.x;
        int kf = -1;
        if (j < RT) {
          const int s = (int)(j / Tmax), t = (int)(j - (i64)s * Tmax);
          const int* rrow = st_route + (i64)s * route_stride;
          float ws = 0.0f;
          if (t < __ldcg(rrow + route_stride - 1)) {
            for (int k = 0; k < K; ++k) {
              if (__ldcg(rrow + (i64)t * K + k) != l) continue;
              if (kf < 0) kf = k;
              ws = __fadd_rn(ws, __ldcg(st_rw + (i64)s * (route_stride - 1) + (i64)t * K + k));
            }
          }
          slot_k[(i64)l * RT + j] = kf;
          slot_w[(i64)l * RT + j] = ws;
        }
        cnt += __syncthreads_count(kf >= 0);
      }
      if (threadIdx.x == 0) counts[l] = cnt;
    }
    if (route_out != nullptr) {
      const i64 n = RT * K, lo = n * l / L, hi = n * (l + 1) / L;
      for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const int s = (int)(i / ((i64)Tmax * K));
        const i64 q = i - (i64)s * Tmax * K;
        const int t = (int)(q / K);
        const int* rrow = st_route + (i64)s * route_stride;
        route_out[i] = t < __ldcg(rrow + route_stride - 1) ? __ldcg(rrow + q) : -1;
      }
    }
    LL_TRACE_SYNC(9);
  }
  LL_TRACE_SYNC(10);
}

// dedup: the dedup split of the rows (ll_dispatch); recv_route: its route for a launch without meta
// (combine_bwd: the handle's route [R, Tmax, K]), else nullptr.
template <typename T, typename IdxT, bool VEC>
__global__ void __launch_bounds__(512) ep_ll_dispatch(
    const T* __restrict__ x, const IdxT* __restrict__ idx, const float* __restrict__ w, int Tn, int meta,
    int scaled, int dedup, const long long* __restrict__ peer_recv, const long long* __restrict__ peer_route,
    const long long* __restrict__ peer_rw, const long long* __restrict__ peer_flags, int* __restrict__ idx_out,
    float* __restrict__ w_out, int* __restrict__ route_out, int* __restrict__ slot_k, float* __restrict__ slot_w,
    int* __restrict__ counts, const int* __restrict__ zero_k, const int* __restrict__ recv_route,
    unsigned* __restrict__ err, unsigned* __restrict__ state, int* __restrict__ err_word, i64 timeout_ns, int op,
    int R, int me, int L, int Tmax, int K, int C, i64 H, int phases, i64 flag_base,
    unsigned* __restrict__ set_epoch) {
  ll_dispatch<T, IdxT, VEC, false, false>(x, nullptr, nullptr, idx, w, Tn, meta, scaled, dedup, peer_recv, nullptr,
                                          nullptr, peer_route, peer_rw, peer_flags, idx_out, w_out, route_out,
                                          slot_k, slot_w, counts, zero_k, recv_route, 0, err, state, err_word,
                                          timeout_ns, op, R, me, L, Tmax, K, C, H, 0, phases, flag_base, set_epoch,
                                          nullptr, nullptr);
}

// ep_ll_dispatch's pairwise build (MOE_RT_LL_SYNC=pairwise, no barrier launch before it): peer_bar the barrier
// slots' peer table, count the op's block count (ll_pair_begin).
template <typename T, typename IdxT, bool VEC>
__global__ void __launch_bounds__(512) ep_ll_dispatch_pairwise(
    const T* __restrict__ x, const IdxT* __restrict__ idx, const float* __restrict__ w, int Tn, int meta,
    int scaled, int dedup, const long long* __restrict__ peer_recv, const long long* __restrict__ peer_route,
    const long long* __restrict__ peer_rw, const long long* __restrict__ peer_flags, int* __restrict__ idx_out,
    float* __restrict__ w_out, int* __restrict__ route_out, int* __restrict__ slot_k, float* __restrict__ slot_w,
    int* __restrict__ counts, const int* __restrict__ zero_k, const int* __restrict__ recv_route,
    unsigned* __restrict__ err, unsigned* __restrict__ state, int* __restrict__ err_word, i64 timeout_ns, int op,
    int R, int me, int L, int Tmax, int K, int C, i64 H, int phases, i64 flag_base,
    unsigned* __restrict__ set_epoch, const long long* __restrict__ peer_bar, unsigned* __restrict__ count) {
  ll_dispatch<T, IdxT, VEC, false, true>(x, nullptr, nullptr, idx, w, Tn, meta, scaled, dedup, peer_recv, nullptr,
                                         nullptr, peer_route, peer_rw, peer_flags, idx_out, w_out, route_out,
                                         slot_k, slot_w, counts, zero_k, recv_route, 0, err, state, err_word,
                                         timeout_ns, op, R, me, L, Tmax, K, C, H, 0, phases, flag_base, set_epoch,
                                         peer_bar, count);
}

// dispatch with FP8 rows (docs/ep.md §8): x (a float x in T, quantized here) or the pair xq / xs (pushed as
// is); T is the group's dtype (of x, and of the rows dequantized into recv when `dequant`); dedup: the dedup
// split of the rows (ll_dispatch).
template <typename T, typename IdxT, bool VEC>
__global__ void __launch_bounds__(512) ep_ll_dispatch_fp8(
    const T* __restrict__ x, const unsigned char* __restrict__ xq, const float* __restrict__ xs,
    const IdxT* __restrict__ idx, const float* __restrict__ w, int Tn, const long long* __restrict__ peer_recv,
    const long long* __restrict__ peer_recv_q, const long long* __restrict__ peer_recv_s,
    const long long* __restrict__ peer_route, const long long* __restrict__ peer_rw,
    const long long* __restrict__ peer_flags, int* __restrict__ idx_out, float* __restrict__ w_out,
    int* __restrict__ route_out, int* __restrict__ slot_k, float* __restrict__ slot_w, int* __restrict__ counts,
    int dequant, int dedup, unsigned* __restrict__ err, unsigned* __restrict__ state, int* __restrict__ err_word,
    i64 timeout_ns, int op, int R, int me, int L, int Tmax, int K, int C, i64 H, int S, int phases,
    i64 flag_base, unsigned* __restrict__ set_epoch) {
  ll_dispatch<T, IdxT, VEC, true, false>(x, xq, xs, idx, w, Tn, 1, 0, dedup, peer_recv, peer_recv_q, peer_recv_s,
                                         peer_route, peer_rw, peer_flags, idx_out, w_out, route_out, slot_k, slot_w,
                                         counts, nullptr, nullptr, dequant, err, state, err_word, timeout_ns, op, R,
                                         me, L, Tmax, K, C, H, S, phases, flag_base, set_epoch, nullptr, nullptr);
}

// ep_ll_dispatch_fp8's pairwise build (as ep_ll_dispatch_pairwise).
template <typename T, typename IdxT, bool VEC>
__global__ void __launch_bounds__(512) ep_ll_dispatch_fp8_pairwise(
    const T* __restrict__ x, const unsigned char* __restrict__ xq, const float* __restrict__ xs,
    const IdxT* __restrict__ idx, const float* __restrict__ w, int Tn, const long long* __restrict__ peer_recv,
    const long long* __restrict__ peer_recv_q, const long long* __restrict__ peer_recv_s,
    const long long* __restrict__ peer_route, const long long* __restrict__ peer_rw,
    const long long* __restrict__ peer_flags, int* __restrict__ idx_out, float* __restrict__ w_out,
    int* __restrict__ route_out, int* __restrict__ slot_k, float* __restrict__ slot_w, int* __restrict__ counts,
    int dequant, int dedup, unsigned* __restrict__ err, unsigned* __restrict__ state, int* __restrict__ err_word,
    i64 timeout_ns, int op, int R, int me, int L, int Tmax, int K, int C, i64 H, int S, int phases,
    i64 flag_base, unsigned* __restrict__ set_epoch, const long long* __restrict__ peer_bar,
    unsigned* __restrict__ count) {
  ll_dispatch<T, IdxT, VEC, true, true>(x, xq, xs, idx, w, Tn, 1, 0, dedup, peer_recv, peer_recv_q, peer_recv_s,
                                        peer_route, peer_rw, peer_flags, idx_out, w_out, route_out, slot_k, slot_w,
                                        counts, nullptr, nullptr, dequant, err, state, err_word, timeout_ns, op, R,
                                        me, L, Tmax, K, C, H, S, phases, flag_base, set_epoch, peer_bar, count);
}

// The partial rows of one combine chunk (a group's combine_partials) by the whole block: for each token q < n
// of the chunk, src[q*K + k] (k < K) are its slots' y rows on this rank at their first k (nullptr elsewhere),
// scale[q*K + k] their slot weights; dst + q*stride = the token's row in the owner's back buffer: the fp32 sum
// over k ascending of __fmul_rn(scale, y) (__fadd_rn, from 0), rounded once to T; tokens with no slot here
// write nothing. (token, vector) pairs are spread over every thread of the block, each thread loading up to
// LL_PART_KB slot rows together before it sums them.
constexpr int LL_PART_KB = 8;
template <typename T, bool VEC>
__device__ __forceinline__ void ll_block_partials(const T* const* src, const float* scale, int n, int K, T* dst,
                                                  i64 stride, i64 H) {
  constexpr int N = VEC ? Vec<T>::N : 1;
  const int nv = (int)(H / N);
  for (int i = threadIdx.x; i < n * nv; i += blockDim.x) {
    const int q = i / nv, v = i - q * nv;
    const T* const* rs = src + q * K;
    const float* ws = scale + q * K;
    float acc[N];
#pragma unroll
    for (int u = 0; u < N; ++u) acc[u] = 0.0f;
    bool any = false;
    for (int k0 = 0; k0 < K; k0 += LL_PART_KB) {
      Vec<T> a[LL_PART_KB];
      T b[LL_PART_KB];
#pragma unroll
      for (int j = 0; j < LL_PART_KB; ++j) {
        const int k = k0 + j;
        if (k < K && rs[k] != nullptr) {
          if constexpr (VEC) a[j] = load_vec(rs[k] + (i64)v * N);
          else b[j] = rs[k][v];
        }
      }
#pragma unroll
      for (int j = 0; j < LL_PART_KB; ++j) {
        const int k = k0 + j;
        if (k >= K || rs[k] == nullptr) continue;
        any = true;
        const float wk = ws[k];
        if constexpr (VEC) {
#pragma unroll
          for (int u = 0; u < N; ++u) acc[u] = __fadd_rn(acc[u], __fmul_rn(wk, to_float(a[j].v[u])));
        } else {
          acc[0] = __fadd_rn(acc[0], __fmul_rn(wk, to_float(b[j])));
        }
      }
    }
    if (any) store_rounded<T, VEC>(dst + q * stride + (i64)v * N, acc);
  }
}

// The combine direction, one kernel. Push items (chunk c of source rank s's tokens; item c*R + s): for each
// (t, k) with l = route[s][t][k] >= 0 not taken by an earlier k of the row: y row (l, s*Tmax + t) (y given)
// into rank s's back row t*K + k and gws[l][s*Tmax + t] (given) into its bw[t*K + k]; then rank s's flag
// [1][me][c]. Owner items (one warp per token t < Tn, nw tokens an item): after the flags [1][d][c(t)] of
// every rank d: out[t] = sum over k ascending with e = idx[t][k] >= 0 of (w given: __fmul_rn(w[t][k],
// back[t*K + kf]); else only k == kf: back[t*K + k]), fp32, rounded once (out given); grad_w[t][k] =
// bw[t*K + kf] (0 for e < 0; grad_w given).
// PARTIALS (combine of a group made with combine_partials; y, slot_w and out given, w and gws null): the
// push sends one row per (token, rank): for each t of the chunk with any valid slot here, z = the fp32 sum
// over its slots in k ascending order (each slot at its first k) of __fmul_rn(slot_w[slot], y[slot]) (each
// addition __fadd_rn, from 0), rounded to T, into rank s's back row t*R + me; the owner sums, for each t, the
// rows t*R + d of the distinct ranks d of its experts, d ascending (__fadd_rn from 0), and rounds once.
// PARTIALS is a template argument, not a run-time flag: as a flag it took the plain bf16 build from 63 to
// 99 registers (one resident 512-thread block a multiprocessor instead of two). MOE_RT_LL_PARTIALS_MINB
// (an occupancy build through MOE_RT_NVRTC_OPTIONS) asks the PARTIALS build for that many resident blocks;
// 0, the default, leaves the bound on threads alone (an explicit minimum of 1 block is not the same: it took
// the plain build to 80 registers).
#ifndef MOE_RT_LL_PARTIALS_MINB
#define MOE_RT_LL_PARTIALS_MINB 0
#endif
// PAIRWISE: the pairwise build (ll_pair_begin; a push item waits for its destination's announce before its
// first store there); peer_bar and count its arguments (unused otherwise).
template <typename T, bool VEC, bool PARTIALS, bool PAIRWISE>
__device__ __forceinline__ void ll_combine(
    const T* __restrict__ y, const float* __restrict__ gws, const int* __restrict__ route,
    const int* __restrict__ idx, const float* __restrict__ w, const float* __restrict__ slot_w,
    const long long* __restrict__ peer_back, const long long* __restrict__ peer_bw,
    const long long* __restrict__ peer_flags, T* __restrict__ out, float* __restrict__ grad_w,
    unsigned* __restrict__ state, int* __restrict__ err_word, i64 timeout_ns, int op, int R, int me, int L, int Tmax,
    int K, int Tn, int C, i64 H, i64 flag_base, const long long* __restrict__ peer_bar,
    unsigned* __restrict__ count) {
  __shared__ const T* s_src[LL_MAX_ROWS];
  __shared__ T* s_dst[LL_MAX_ROWS];
  __shared__ float s_scale[LL_MAX_ROWS];
  __shared__ int s_kf[64];
  __shared__ float s_w[64];
  __shared__ int s_rk[64];
  unsigned e;
  LL_TRACE(0);
  if constexpr (PAIRWISE) {
    if (!ll_pair_begin(peer_bar, count, state, R, me, e)) return;
  } else {
    if (!block_epoch(state, e)) return;
  }
  LL_TRACE(1);
  const int NC = (Tmax + C - 1) / C;
  const i64 RT = (i64)R * Tmax;
  unsigned long long announced = 0;  // PAIRWISE: ranks s < 64 whose announce this block saw (block-uniform)
  for (int item = blockIdx.x; item < NC * R; item += gridDim.x) {
    const int c = item / R, s = item - c * R;
    const int t0 = c * C, t1 = min(t0 + C, Tmax);
    LL_TRACE_FIRST(2);
    T* dst = reinterpret_cast<T*>(peer_back[s]);
    float* dw = reinterpret_cast<float*>(peer_bw[s]);
    // the row table (local reads) before the wait for rank s's announce, the stores into s after it
    auto slot_of = [&](int p, int& t, int& k) -> i64 {  // (t, k)'s slot, or -1 (no expert, or a repeat)
      t = t0 + p / K;
      k = p - (p / K) * K;
      const int* rrow = route + ((i64)s * Tmax + t) * K;
      const int l = rrow[k];
      bool first = l >= 0;
      for (int q = 0; q < k && first; ++q) first = rrow[q] != l;
      return first ? (i64)l * RT + (i64)s * Tmax + t : -1;
    };
    for (int p = threadIdx.x; p < (t1 - t0) * K; p += blockDim.x) {
      int t, k;
      const i64 slot = slot_of(p, t, k);
      const bool first = slot >= 0;
      s_src[p] = first && y != nullptr ? y + slot * H : nullptr;
      s_dst[p] = first && y != nullptr && !PARTIALS ? dst + ((i64)t * K + k) * H : nullptr;
      s_scale[p] = first && PARTIALS ? slot_w[slot] : 0.0f;
    }
    bool waited = false;
    if constexpr (PAIRWISE) {  // the item writes into rank s's buffers only
      if (s >= 64 || !((announced >> s) & 1ull)) {
        if (!ll_block_wait_announce(peer_bar, R, me, s, e, state, err_word, timeout_ns, op)) return;
        if (s < 64) announced |= 1ull << s;
        waited = s != me;  // its block barrier orders the row table too (none for this rank's own)
      }
    }
    if (!waited) __syncthreads();
    if (gws != nullptr)
      for (int p = threadIdx.x; p < (t1 - t0) * K; p += blockDim.x) {
        int t, k;
        const i64 slot = slot_of(p, t, k);
        if (slot >= 0) dw[(i64)t * K + k] = gws[slot];
      }
    LL_TRACE_FIRST(3);
    if constexpr (PARTIALS)
      ll_block_partials<T, VEC>(s_src, s_scale, t1 - t0, K, dst + ((i64)t0 * R + me) * H, (i64)R * H, H);
    else if (y != nullptr)
      ll_block_rows<T, VEC>(s_src, s_dst, s_scale, (t1 - t0) * K, H, false);
    LL_TRACE_SYNC(4);
    __syncthreads();  // the next item refills s_src / s_dst / s_scale
  }
  // The block's push items' flags once all of them are pushed, each thread one item's: rank s's flag
  // [1][me][c] after a system-scope fence. (A fence per item held the block's next item back until the
  // previous one's peer stores had landed; the owner items below wait for every rank's chunk anyway.)
  for (int item = blockIdx.x + threadIdx.x * gridDim.x; item < NC * R; item += blockDim.x * gridDim.x) {
    const int c = item / R, s = item - c * R;
    __threadfence_system();
    st_release_sys_u32(reinterpret_cast<unsigned*>(peer_flags[s]) + flag_base + RT + (i64)me * Tmax + c, e);
  }
  LL_TRACE(5);
  LL_TRACE(6);
  // Owner items: (token t, slice of its row's 16-byte vectors), so that a few tokens still spread over every
  // block; each thread loads the row's K slots together, then sums them in k order.
  const unsigned* my_flags = reinterpret_cast<const unsigned*>(peer_flags[me]) + flag_base + RT;
  const T* back = reinterpret_cast<const T*>(peer_back[me]);
  const float* bw = reinterpret_cast<const float*>(peer_bw[me]);
  constexpr int N = VEC ? Vec<T>::N : 1;
  const int nv = (int)(H / N);
  const int S = out != nullptr ? (nv + blockDim.x - 1) / blockDim.x : 1;
  for (int item = blockIdx.x; item < Tn * S; item += gridDim.x) {
    const int t = item / S, sl = item - t * S;
    // chunk t / C of every rank d
    __syncthreads();  // the previous item's s_kf / s_w readers are done
    int ok = 1;
    if (threadIdx.x < R)
      ok = thread_wait_flag(my_flags + (i64)threadIdx.x * Tmax + t / C, e, state, err_word, timeout_ns, op) ? 1 : 0;
    const int* irow = idx + (i64)t * K;
    if constexpr (PARTIALS) {  // s_kf: the token's experts' distinct ranks, ascending (then -1): rows t*R + d
      if (threadIdx.x < K) {
        const int k = threadIdx.x, ex = irow[k];
        int d = ex >= 0 ? ex / L : -1;
        for (int q = 0; q < k && d >= 0; ++q)
          if (irow[q] >= 0 && irow[q] / L == d) d = -1;  // an earlier k has this rank
        s_rk[k] = d;
      }
      __syncthreads();
      if (threadIdx.x < K) {
        const int k = threadIdx.x, d = s_rk[k];
        int pos = 0, nd = 0;
        for (int q = 0; q < K; ++q) {
          nd += s_rk[q] >= 0;
          pos += s_rk[q] >= 0 && s_rk[q] < d;
        }
        if (d >= 0) s_kf[pos] = d;
        if (k >= nd) s_kf[k] = -1;
        s_w[k] = 1.0f;
      }
    } else if (threadIdx.x < K) {
      const int k = threadIdx.x, ex = irow[k];
      int kf = -1;
      if (ex >= 0) {
        kf = 0;
        while (irow[kf] != ex) ++kf;
        if (w == nullptr && kf != k) kf = -1;  // unweighted: each expert's row once
      }
      s_kf[k] = kf;
      s_w[k] = w != nullptr ? w[(i64)t * K + k] : 1.0f;
    }
    if (!__syncthreads_and(ok)) return;
    LL_TRACE_FIRST(7);
    LL_TRACE(8);
    if (grad_w != nullptr && sl == 0) {
      for (int k = threadIdx.x; k < K; k += blockDim.x) {
        const int ex = irow[k];
        float g = 0.0f;
        if (ex >= 0) {
          int kf = 0;
          while (irow[kf] != ex) ++kf;
          g = __ldcg(bw + (i64)t * K + kf);
        }
        grad_w[(i64)t * K + k] = g;
      }
    }
    if (out == nullptr) continue;
    const int v = sl * blockDim.x + threadIdx.x;
    if (v >= nv) continue;
    const T* rows = back + (i64)t * (PARTIALS ? R : K) * H + (i64)v * N;
    float acc[N];
#pragma unroll
    for (int q = 0; q < N; ++q) acc[q] = 0.0f;
    constexpr int KB = 8;  // slots loaded together
    for (int k0 = 0; k0 < K; k0 += KB) {
      Vec<T> a[KB];
      T b[KB];
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const int k = k0 + j;
        if (k < K && s_kf[k] >= 0) {
          if constexpr (VEC) a[j].raw = __ldcg(reinterpret_cast<const uint4*>(rows + (i64)s_kf[k] * H));
          else b[j] = __ldcg(rows + (i64)s_kf[k] * H);
        }
      }
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const int k = k0 + j;
        if (k >= K || s_kf[k] < 0) continue;
        const float wk = s_w[k];
        if constexpr (VEC) {
#pragma unroll
          for (int q = 0; q < N; ++q)
            acc[q] = __fadd_rn(acc[q], w != nullptr ? __fmul_rn(wk, to_float(a[j].v[q])) : to_float(a[j].v[q]));
        } else {
          const float x = to_float(b[j]);
          acc[0] = __fadd_rn(acc[0], w != nullptr ? __fmul_rn(wk, x) : x);
        }
      }
    }
    store_rounded<T, VEC>(out + (i64)t * H + (i64)v * N, acc);
  }
  LL_TRACE_SYNC(9);
  LL_TRACE(10);
}

template <typename T, bool VEC, bool PARTIALS>
__global__ void __launch_bounds__(512, PARTIALS ? MOE_RT_LL_PARTIALS_MINB : 0) ep_ll_combine(
    const T* __restrict__ y, const float* __restrict__ gws, const int* __restrict__ route,
    const int* __restrict__ idx, const float* __restrict__ w, const float* __restrict__ slot_w,
    const long long* __restrict__ peer_back, const long long* __restrict__ peer_bw,
    const long long* __restrict__ peer_flags, T* __restrict__ out, float* __restrict__ grad_w,
    unsigned* __restrict__ state, int* __restrict__ err_word, i64 timeout_ns, int op, int R, int me, int L, int Tmax,
    int K, int Tn, int C, i64 H, i64 flag_base) {
  ll_combine<T, VEC, PARTIALS, false>(y, gws, route, idx, w, slot_w, peer_back, peer_bw, peer_flags, out, grad_w,
                                      state, err_word, timeout_ns, op, R, me, L, Tmax, K, Tn, C, H, flag_base,
                                      nullptr, nullptr);
}

// ep_ll_combine's pairwise build (MOE_RT_LL_SYNC=pairwise, no barrier launch before it): peer_bar the barrier
// slots' peer table, count the op's block count (ll_pair_begin).
template <typename T, bool VEC, bool PARTIALS>
__global__ void __launch_bounds__(512, PARTIALS ? MOE_RT_LL_PARTIALS_MINB : 0) ep_ll_combine_pairwise(
    const T* __restrict__ y, const float* __restrict__ gws, const int* __restrict__ route,
    const int* __restrict__ idx, const float* __restrict__ w, const float* __restrict__ slot_w,
    const long long* __restrict__ peer_back, const long long* __restrict__ peer_bw,
    const long long* __restrict__ peer_flags, T* __restrict__ out, float* __restrict__ grad_w,
    unsigned* __restrict__ state, int* __restrict__ err_word, i64 timeout_ns, int op, int R, int me, int L, int Tmax,
    int K, int Tn, int C, i64 H, i64 flag_base, const long long* __restrict__ peer_bar,
    unsigned* __restrict__ count) {
  ll_combine<T, VEC, PARTIALS, true>(y, gws, route, idx, w, slot_w, peer_back, peer_bw, peer_flags, out, grad_w,
                                     state, err_word, timeout_ns, op, R, me, L, Tmax, K, Tn, C, H, flag_base,
                                     peer_bar, count);
}

// combine_bwd's expert side with y (local; after the dispatch-direction kernel delivered the unscaled
// gradient rows into g = recv): one warp per slot j < n: valid (slot_k[j] >= 0): dots[j] = sum_h y[j][h] *
// g[j][h] in fp32 (each lane's elements in order, then a fixed butterfly over lanes), then g[j] = the rounded
// fp32 product slot_w[j] * g[j]; invalid: dots[j] = 0.
template <typename T, bool VEC>
__global__ void ep_ll_slot_dot(T* __restrict__ g, const T* __restrict__ y, const int* __restrict__ slot_k,
                               const float* __restrict__ slot_w, float* __restrict__ dots, i64 n, i64 H) {
  const int lane = threadIdx.x & 31;
  const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
  constexpr int N = VEC ? Vec<T>::N : 1;
  const i64 nv = H / N;
  for (i64 j = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); j < n; j += warps) {
    if (slot_k[j] < 0) {
      if (lane == 0) dots[j] = 0.0f;
      continue;
    }
    const float s = slot_w[j];
    T* gr = g + j * H;
    const T* yr = y + j * H;
    float acc = 0.0f;
    for (i64 v = lane; v < nv; v += 32) {
      if constexpr (VEC) {
        Vec<T> a = load_vec(gr + v * N), b = load_vec(yr + v * N);
#pragma unroll
        for (int q = 0; q < N; ++q) {
          const float gv = to_float(a.v[q]);
          acc = fmaf(to_float(b.v[q]), gv, acc);
          a.v[q] = from_float<T>(__fmul_rn(s, gv));
        }
        store_vec(gr + v * N, a);
      } else {
        const float gv = to_float(gr[v]);
        acc = fmaf(to_float(yr[v]), gv, acc);
        gr[v] = from_float<T>(__fmul_rn(s, gv));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) dots[j] = acc;
  }
}

// ---- The low-latency mode over NCCL (LowLatencyGroup(transport="nccl"); docs/ep.md §8) ----------------------
// For ranks without peer access (other nodes, no P2P). Every buffer is this rank's own; the rows move by NCCL
// collectives of fixed sizes between the launches below (moe_rt_ll_* in csrc/ep_ll.c), so the ops stay
// graph-capturable and never sync with the host:
//   dispatch: ep_ll_nccl_pack writes this rank's token rows (or their FP8 codes and scales) and its routing
//     into its own share of the gather buffers, an in-place all-gather brings every rank's share, then
//     ep_ll_nccl_expand fills the handle's tables and copies each gathered row into its slots here;
//   combine_bwd: the same with grad_out's rows and the handle's tables (scaled, zero at empty slots);
//   combine, dispatch_bwd, combine_bwd's weight gradient: ep_ll_nccl_reduce writes, per owner, the rows of
//     each (token, first k) slot here (or the token's weighted rank partial) and the slot values, a grouped
//     send/recv of fixed size brings each owner its rows, then ep_ll_nccl_owner sums them.
// The arithmetic is the direct kernels' (and the reference's) operation for operation, so the two transports
// agree bit for bit. Work items are (token column, slice of NL_SLICE units of its row), one warp each.
constexpr int NL_UN = 4;                 // units (16-byte vectors, or elements) a lane has in flight
constexpr int NL_SLICE = 32 * NL_UN;     // units of a row one warp moves
constexpr int NL_WARPS = 8;              // warps a block (256 threads)
constexpr int NL_PACK_TOKENS = 4;        // tokens a block of ep_ll_nccl_pack takes
constexpr int NL_META_HEAD = 4;          // gather_meta per rank: T, three unused words, idx [Tmax*K], w [Tmax*K]

// The first-k list of a token column: le[k] (the local expert of (token, k) on this rank, or -1) -> hits
// l[i], k[i] in k ascending order, one per distinct local expert. Warp-wide; returns the count.
__device__ __forceinline__ int nl_hits(const int* le, int K, int* hl, int* hk, int lane) {
  int n = 0;
  for (int b = 0; b < K; b += 32) {
    const int k = b + lane;
    bool first = false;
    if (k < K && le[k] >= 0) {
      first = true;
      for (int q = 0; q < k && first; ++q) first = le[q] != le[k];
    }
    const unsigned m = __ballot_sync(0xffffffffu, first);
    if (first) {
      const int pos = n + __popc(m & ((1u << lane) - 1u));
      hl[pos] = le[k];
      hk[pos] = k;
    }
    n += __popc(m);
  }
  __syncwarp();
  return n;
}

// The send half of dispatch (and of combine_bwd, meta = 0): rows t < Tn of x (or, FP8, x quantized by
// quantize_fp8's rule, or the pair xq/xs as is) into this rank's share of the gather buffers; with meta the
// routing into gather_meta[me] (ids outside [-1, E) recorded in err and taken as -1; entries t >= Tn: -1 and
// 0), the owner's idx_out/w_out copies, and counts zeroed for the receive half. Blocks take NL_PACK_TOKENS
// tokens each (grid ceil(Tmax / NL_PACK_TOKENS)).
template <typename T, typename IdxT, bool VEC, bool FP8>
__global__ void __launch_bounds__(512) ep_ll_nccl_pack(
    const T* __restrict__ x, const unsigned char* __restrict__ xq, const float* __restrict__ xs,
    const IdxT* __restrict__ idx, const float* __restrict__ w, int Tn, int meta, int* __restrict__ idx_out,
    float* __restrict__ w_out, int* __restrict__ counts, T* __restrict__ gather, unsigned char* __restrict__ gather_q,
    float* __restrict__ gather_s, int* __restrict__ gather_meta, unsigned* __restrict__ err, int R, int me, int L,
    int Tmax, int K, i64 H, int S) {
  __shared__ const T* s_src[NL_PACK_TOKENS];
  __shared__ T* s_dst[NL_PACK_TOKENS];
  __shared__ float s_scale[NL_PACK_TOKENS];
  __shared__ unsigned char* s_qdst[NL_PACK_TOKENS];
  __shared__ float* s_sdst[NL_PACK_TOKENS];
  const int E = L * R;
  const i64 TK = (i64)Tmax * K;
  const int t0 = blockIdx.x * NL_PACK_TOKENS, t1 = min(t0 + NL_PACK_TOKENS, Tmax);
  if (meta) {
    int* gm = gather_meta + (i64)me * (NL_META_HEAD + 2 * TK);
    for (i64 i = (i64)t0 * K + threadIdx.x; i < (i64)t1 * K; i += blockDim.x) {
      int ex = -1;
      float wk = 0.0f;
      if (i < (i64)Tn * K) {
        const i64 v = (i64)idx[i];
        ex = v >= 0 && v < E ? (int)v : -1;
        if (ex < 0 && v != -1) record_bad_expert_id(err, MOE_RT_ERR_EP_LL_DISPATCH, v, i, E);
        wk = w[i];
        idx_out[i] = ex;
        w_out[i] = wk;
      }
      gm[NL_META_HEAD + i] = ex;
      gm[NL_META_HEAD + TK + i] = __float_as_int(wk);
    }
    if (blockIdx.x == 0) {
      for (int i = threadIdx.x; i < NL_META_HEAD; i += blockDim.x) gm[i] = i == 0 ? Tn : 0;
      for (int l = threadIdx.x; l < L; l += blockDim.x) counts[l] = 0;
    }
  }
  const int n = max(0, min(t1, Tn) - t0);
  if (n == 0) return;
  if (threadIdx.x < n) {
    const i64 row = (i64)me * Tmax + t0 + threadIdx.x;
    if constexpr (FP8) {
      s_qdst[threadIdx.x] = gather_q + row * H;
      s_sdst[threadIdx.x] = gather_s + row * S;
    } else {
      s_src[threadIdx.x] = x + (i64)(t0 + threadIdx.x) * H;
      s_dst[threadIdx.x] = gather + row * H;
      s_scale[threadIdx.x] = 0.0f;
    }
  }
  __syncthreads();
  if constexpr (FP8) ll_block_fp8<T, VEC>(x, xq, xs, t0, n, 1, s_qdst, s_sdst, H, S);
  else ll_block_rows<T, VEC>(s_src, s_dst, s_scale, n, H, false);
}

// The receive half of dispatch: one warp per (token column j = s*Tmax + t of the slots, slice of its row).
// MODE 0: rows: the handle's tables from gather_meta (route_out [R, Tmax, K], slot_k / slot_w [L, R*Tmax]:
//   the first k of each local expert of the token and the fp32 sum of its weights, k ascending; counts by
//   atomics, zeroed by the pack) and the gathered row into each slot (l, j) of the token's local experts;
// MODE 1: FP8 codes and scales into recv_q / recv_s likewise; MODE 2: FP8 rows dequantized into recv
//   (dequantize_fp8's rule);
// MODE 3 (combine_bwd): the handle's slot_k / slot_w: every slot (l, j) of the column gets the gathered
//   grad_out row, times slot_w rounded once when `scaled`, or zero where no token.
// VEC: 16-byte units (rows of a multiple of 16 bytes, buffers 16-byte aligned); else single elements.
template <typename T, bool VEC, int MODE>
__global__ void __launch_bounds__(NL_WARPS * 32) ep_ll_nccl_expand(
    const T* __restrict__ gather, const unsigned char* __restrict__ gather_q, const float* __restrict__ gather_s,
    const int* __restrict__ gather_meta, T* __restrict__ recv, unsigned char* __restrict__ recv_q,
    float* __restrict__ recv_s, int* __restrict__ route_out, int* __restrict__ slot_k, float* __restrict__ slot_w,
    int* __restrict__ counts, int scaled, int R, int me, int L, int Tmax, int K, i64 H, int S) {
  __shared__ int s_le[NL_WARPS][64], s_hl[NL_WARPS][64], s_hk[NL_WARPS][64];
  __shared__ float s_w[NL_WARPS][64];
  constexpr bool CODES = MODE == 1 || MODE == 2;
  // units of a row: T vectors or elements; FP8 codes in 16-byte groups or single codes
  constexpr int N = CODES ? (VEC ? 16 : 1) : (VEC ? Vec<T>::N : 1);
  const i64 nu = H / N;
  const i64 ns = (nu + NL_SLICE - 1) / NL_SLICE;
  const i64 RT = (i64)R * Tmax, TK = (i64)Tmax * K;
  const int lane = threadIdx.x & 31, wb = threadIdx.x >> 5;
  const i64 warps = (i64)gridDim.x * NL_WARPS;
  int* le = s_le[wb];
  for (i64 item = (i64)blockIdx.x * NL_WARPS + wb; item < RT * ns; item += warps) {
    const i64 j = item / ns, slice = item - j * ns;
    const int s = (int)(j / Tmax), t = (int)(j - (i64)s * Tmax);
    const i64 u0 = slice * NL_SLICE;
    if constexpr (MODE == 3) {
      const T* src = gather + j * H;
      for (int l = 0; l < L; ++l) {
        const i64 at = (i64)l * RT + j;
        const bool valid = slot_k[at] >= 0;
        const float sc = valid ? slot_w[at] : 0.0f;
        T* dst = recv + at * H;
#pragma unroll
        for (int u = 0; u < NL_UN; ++u) {
          const i64 o = u0 + lane + 32 * u;
          if (o >= nu) break;
          if constexpr (VEC) {
            Vec<T> a;
            if (valid) {
              a = load_vec(src + o * N);
              if (scaled) {
#pragma unroll
                for (int q = 0; q < N; ++q) a.v[q] = from_float<T>(__fmul_rn(sc, to_float(a.v[q])));
              }
            } else {
              a.raw = make_uint4(0u, 0u, 0u, 0u);
            }
            store_vec(dst + o * N, a);
          } else {
            dst[o] = valid ? (scaled ? from_float<T>(__fmul_rn(sc, to_float(src[o]))) : src[o]) : from_float<T>(0.0f);
          }
        }
      }
      continue;
    }
    // the column's local experts, from the source's gathered routing
    const int* gm = gather_meta + (i64)s * (NL_META_HEAD + 2 * TK);
    const bool has = t < gm[0];
    for (int k = lane; k < K; k += 32) {
      const int e = has ? gm[NL_META_HEAD + (i64)t * K + k] : -1;
      le[k] = e >= 0 && e / L == me ? e - me * L : -1;
      s_w[wb][k] = has ? __int_as_float(gm[NL_META_HEAD + TK + (i64)t * K + k]) : 0.0f;
    }
    __syncwarp();
    const int nh = nl_hits(le, K, s_hl[wb], s_hk[wb], lane);
    if (slice == 0) {
      for (int k = lane; k < K; k += 32) route_out[j * K + k] = le[k];
      for (int l = lane; l < L; l += 32) {
        int kf = -1;
        for (int i = 0; i < nh && kf < 0; ++i)
          if (s_hl[wb][i] == l) kf = s_hk[wb][i];
        float ws = 0.0f;
        if (kf >= 0) {
          for (int k = 0; k < K; ++k)
            if (le[k] == l) ws = __fadd_rn(ws, s_w[wb][k]);
          atomicAdd(counts + l, 1);
        }
        slot_k[(i64)l * RT + j] = kf;
        slot_w[(i64)l * RT + j] = ws;
      }
    }
    if (nh > 0) {
      if constexpr (MODE == 0) {
        const T* src = gather + j * H;
#pragma unroll
        for (int u = 0; u < NL_UN; ++u) {
          const i64 o = u0 + lane + 32 * u;
          if (o >= nu) break;
          if constexpr (VEC) {
            const Vec<T> a = load_vec(src + o * N);
            for (int i = 0; i < nh; ++i) store_vec(recv + ((i64)s_hl[wb][i] * RT + j) * H + o * N, a);
          } else {
            const T a = src[o];
            for (int i = 0; i < nh; ++i) recv[((i64)s_hl[wb][i] * RT + j) * H + o] = a;
          }
        }
      } else {
        const unsigned char* q = gather_q + j * H;
        const float* sc = gather_s + j * S;
#pragma unroll
        for (int u = 0; u < NL_UN; ++u) {
          const i64 o = u0 + lane + 32 * u;
          if (o >= nu) break;
          if constexpr (MODE == 1) {
            if constexpr (VEC) {
              const uint4 a = reinterpret_cast<const uint4*>(q)[o];
              for (int i = 0; i < nh; ++i)
                reinterpret_cast<uint4*>(recv_q + ((i64)s_hl[wb][i] * RT + j) * H)[o] = a;
            } else {
              const unsigned char a = q[o];
              for (int i = 0; i < nh; ++i) recv_q[((i64)s_hl[wb][i] * RT + j) * H + o] = a;
            }
          } else {
            const float f = sc[o * N / LL_FP8_BLOCK];
            if constexpr (VEC) {
              union {
                uint4 raw;
                unsigned char b[16];
              } c;
              c.raw = reinterpret_cast<const uint4*>(q)[o];
#pragma unroll
              for (int g = 0; g < 16; g += Vec<T>::N) {
                Vec<T> y;
#pragma unroll
                for (int e = 0; e < Vec<T>::N; ++e) y.v[e] = store_as<T>(mul_rn(from_e4m3(c.b[g + e]), f));
                for (int i = 0; i < nh; ++i) store_vec(recv + ((i64)s_hl[wb][i] * RT + j) * H + o * 16 + g, y);
              }
            } else {
              const T y = store_as<T>(mul_rn(from_e4m3(q[o]), f));
              for (int i = 0; i < nh; ++i) recv[((i64)s_hl[wb][i] * RT + j) * H + o] = y;
            }
          }
        }
        if (MODE == 1 && slice == 0)
          for (int i = 0; i < nh; ++i)
            for (int b = lane; b < S; b += 32) recv_s[((i64)s_hl[wb][i] * RT + j) * S + b] = sc[b];
      }
    }
    __syncwarp();  // the warp's shared lists are rewritten by its next item
  }
}

// The expert side of the combine direction over NCCL: one warp per (token column j = s*Tmax + t, slice). From
// the handle's route [R, Tmax, K] (the local expert of each (s, t, k) here, or -1): with `rows`, PARTIALS 0:
// the row y[l, j] of each first-k slot (l, kf) into row t*K + kf of owner s's part (combine, dispatch_bwd);
// PARTIALS 1: z = fadd(z, fmul(slot_w[l, j], y[l, j])) over those slots, k ascending, rounded once, into row t
// (combine with rank partials); with slot_grads, slot_grads[l, j] into entry t*K + k of owner s's values for
// every k routed here. Owner s's part: back_send[s] (sent by the grouped send/recv), this rank's own in back[me]
// directly. Parts hold Tmax*K rows of H and Tmax*K values.
template <typename T, bool VEC, bool PARTIALS>
__global__ void __launch_bounds__(NL_WARPS * 32) ep_ll_nccl_reduce(
    const T* __restrict__ y, const float* __restrict__ slot_grads, const int* __restrict__ route,
    const float* __restrict__ slot_w, T* __restrict__ back_send, T* __restrict__ back, float* __restrict__ bw_send,
    float* __restrict__ bw, int rows, int R, int me, int L, int Tmax, int K, i64 H) {
  __shared__ int s_le[NL_WARPS][64], s_hl[NL_WARPS][64], s_hk[NL_WARPS][64];
  constexpr int N = VEC ? Vec<T>::N : 1;
  const i64 nu = H / N;
  const i64 ns = rows ? (nu + NL_SLICE - 1) / NL_SLICE : 1;
  const i64 RT = (i64)R * Tmax, TK = (i64)Tmax * K;
  const int lane = threadIdx.x & 31, wb = threadIdx.x >> 5;
  const i64 warps = (i64)gridDim.x * NL_WARPS;
  int* le = s_le[wb];
  for (i64 item = (i64)blockIdx.x * NL_WARPS + wb; item < RT * ns; item += warps) {
    const i64 j = item / ns, slice = item - j * ns;
    const int s = (int)(j / Tmax), t = (int)(j - (i64)s * Tmax);
    for (int k = lane; k < K; k += 32) le[k] = route[j * K + k];
    __syncwarp();
    const int nh = nl_hits(le, K, s_hl[wb], s_hk[wb], lane);
    if (nh == 0) continue;  // (the lists are rewritten only after every lane passed this point)
    T* part = (s == me ? back : back_send) + (i64)s * TK * H;
    if (slot_grads != nullptr && slice == 0) {
      float* v = (s == me ? bw : bw_send) + (i64)s * TK;
      for (int k = lane; k < K; k += 32)
        if (le[k] >= 0) v[(i64)t * K + k] = slot_grads[(i64)le[k] * RT + j];
    }
    if (rows) {
      const i64 u0 = slice * NL_SLICE;
#pragma unroll
      for (int u = 0; u < NL_UN; ++u) {
        const i64 o = u0 + lane + 32 * u;
        if (o >= nu) break;
        if constexpr (PARTIALS) {
          float z[N];
#pragma unroll
          for (int q = 0; q < N; ++q) z[q] = 0.0f;
          for (int i = 0; i < nh; ++i) {
            const i64 at = (i64)s_hl[wb][i] * RT + j;
            const float sw = slot_w[at];
            if constexpr (VEC) {
              const Vec<T> a = load_vec(y + at * H + o * N);
#pragma unroll
              for (int q = 0; q < N; ++q) z[q] = __fadd_rn(z[q], __fmul_rn(sw, to_float(a.v[q])));
            } else {
              z[0] = __fadd_rn(z[0], __fmul_rn(sw, to_float(y[at * H + o])));
            }
          }
          if constexpr (VEC) {
            Vec<T> r;
#pragma unroll
            for (int q = 0; q < N; ++q) r.v[q] = from_float<T>(z[q]);
            store_vec(part + (i64)t * H + o * N, r);
          } else {
            part[(i64)t * H + o] = from_float<T>(z[0]);
          }
        } else {
          for (int i = 0; i < nh; ++i) {
            const i64 at = (i64)s_hl[wb][i] * RT + j;
            T* dst = part + ((i64)t * K + s_hk[wb][i]) * H;
            if constexpr (VEC) store_vec(dst + o * N, load_vec(y + at * H + o * N));
            else dst[o] = y[at * H + o];
          }
        }
      }
    }
    __syncwarp();
  }
}

// The owner side of the combine direction over NCCL: one warp per (token t < Tn, slice). back [R] parts of
// Tmax*K rows of H (part d: what expert rank d sent), bw [R] parts of Tmax*K values. With `rows`: MODE 0
// (combine): out[t] = sum over k ascending (idx >= 0) of fmul(w[t, k], row t*K + kf of part idx/L), fp32, one
// rounding; MODE 1 (dispatch_bwd): the unweighted sum over the first-k slots; MODE 2 (combine with rank
// partials): the sum of row t of the parts of the token's distinct ranks, ascending. A token with no expert:
// 0. With grad_w: grad_w[t, k] = entry t*K + k of part idx/L (0 where idx < 0).
template <typename T, bool VEC, int MODE>
__global__ void __launch_bounds__(NL_WARPS * 32) ep_ll_nccl_owner(
    const T* __restrict__ back, const float* __restrict__ bw, const int* __restrict__ idx,
    const float* __restrict__ w, T* __restrict__ out, float* __restrict__ grad_w, int rows, int Tn, int L, int Tmax,
    int K, i64 H) {
  __shared__ int s_d[NL_WARPS][64], s_kf[NL_WARPS][64];
  __shared__ float s_w[NL_WARPS][64];
  constexpr int N = VEC ? Vec<T>::N : 1;
  const i64 nu = H / N;
  const i64 ns = rows ? (nu + NL_SLICE - 1) / NL_SLICE : 1;
  const i64 TK = (i64)Tmax * K;
  const int lane = threadIdx.x & 31, wb = threadIdx.x >> 5;
  const i64 warps = (i64)gridDim.x * NL_WARPS;
  for (i64 item = (i64)blockIdx.x * NL_WARPS + wb; item < (i64)Tn * ns; item += warps) {
    const int t = (int)(item / ns);
    const i64 slice = item - (i64)t * ns;
    for (int k = lane; k < K; k += 32) {
      const int e = idx[(i64)t * K + k];
      s_d[wb][k] = e >= 0 ? e / L : -1;
      s_w[wb][k] = MODE == 0 ? w[(i64)t * K + k] : 0.0f;
      int kf = k;
      for (int q = 0; q < k; ++q)
        if (idx[(i64)t * K + q] == e) {
          kf = q;
          break;
        }
      s_kf[wb][k] = kf;
    }
    __syncwarp();
    if (grad_w != nullptr && slice == 0)
      for (int k = lane; k < K; k += 32) {
        const int d = s_d[wb][k];
        grad_w[(i64)t * K + k] = d >= 0 ? bw[(i64)d * TK + (i64)t * K + k] : 0.0f;
      }
    if (rows) {
      const i64 u0 = slice * NL_SLICE;
#pragma unroll
      for (int u = 0; u < NL_UN; ++u) {
        const i64 o = u0 + lane + 32 * u;
        if (o >= nu) break;
        float acc[N];
#pragma unroll
        for (int q = 0; q < N; ++q) acc[q] = 0.0f;
        int last = -1;  // MODE 2: the rank added last (ranks ascending)
        for (int n = 0; n < K; ++n) {
          int d = s_d[wb][n];
          i64 row;
          if constexpr (MODE == 2) {
            d = -1;  // the next distinct rank above `last`
            for (int k = 0; k < K; ++k) {
              const int v = s_d[wb][k];
              if (v > last && (d < 0 || v < d)) d = v;
            }
            if (d < 0) break;
            last = d;
            row = (i64)d * TK + t;
          } else {
            if (d < 0 || (MODE == 1 && s_kf[wb][n] != n)) continue;
            row = (i64)d * TK + (i64)t * K + s_kf[wb][n];
          }
          if constexpr (VEC) {
            const Vec<T> a = load_vec(back + row * H + o * N);
#pragma unroll
            for (int q = 0; q < N; ++q)
              acc[q] = __fadd_rn(acc[q], MODE == 0 ? __fmul_rn(s_w[wb][n], to_float(a.v[q])) : to_float(a.v[q]));
          } else {
            const float a = to_float(back[row * H + o]);
            acc[0] = __fadd_rn(acc[0], MODE == 0 ? __fmul_rn(s_w[wb][n], a) : a);
          }
        }
        if constexpr (VEC) {
          Vec<T> r;
#pragma unroll
          for (int q = 0; q < N; ++q) r.v[q] = from_float<T>(acc[q]);
          store_vec(out + (i64)t * H + o * N, r);
        } else {
          out[(i64)t * H + o] = from_float<T>(acc[0]);
        }
      }
    }
    __syncwarp();
  }
}
