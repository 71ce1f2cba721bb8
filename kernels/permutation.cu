// Single-GPU dispatch/combine (token permutation) kernels; semantics in docs/permutation.md §1.
//
// Plan (no atomics affect the result; every step is a deterministic integer computation):
//   plan_count     one warp per chunk of flat slots (t*K+k): per-chunk expert histogram -> partial[c][e]
//                  (ids outside [-1, E) count as -1 and are recorded in the device's error word)
//   plan_scan      per expert, exclusive scan of partial over chunks -> base[c][e]; totals[e]; then the
//                  last CTA: kept counts under num_out_tokens, align_size padding, segment starts
//   plan_assign    one warp per chunk again: stable rank of each slot inside its expert (warp match +
//                  popc of the lower lanes, chunks in order) -> dst_row[t*K+k] and src_slot[row]
//   plan_fused     the three in one CTA where the slots are few (one launch; the same plan)
// Data movement (rows moved as raw units U of 1..16 bytes, so any dtype is a pure copy):
//   dispatch_rows  one CTA per token: read the row once, write it to each of its K destination rows
//   fill_rows      rows whose src_slot is -1 (padding, unused tail) become zero; probs follow rows; with x,
//                  the other rows get x[src / K] (dispatch in one launch where the rows are few)
//   copy_kept_rows out[r] = src[r] where keep[r] >= 0, else zero (only kept rows read)
//   combine_slices y[t] = sum_k w[t,k] * y_p[dst[t,k]], fp32, k ascending; a CTA sums a slice of H of
//                  one token with the loads of all K rows in flight (small CTAs, many per SM)
//   combine_bwd_rows  one CTA per token: g_p[dst] = w*g[t], dw[t,k] = <y_p[dst], g[t]> (block reduce)
//   gather_slots   out[t*K+k] = vals[dst[t,k]] (0 where dropped)
//   chunk_offsets / chunk_sort_rows   sort_chunks forward (scatter) and backward (gather)
// Row offsets are 64-bit everywhere (row * row_units can exceed 2^31).
#include "moe_rt/common.cuh"
#include "moe_rt/plan.cuh"

using namespace moe_rt;

namespace {

// The expert of flat slot i (-1: none). Ids outside [-1, E) are taken as -1, so no kernel writes out of
// bounds; with `err` (plan_count, the one kernel that reports them) they are recorded in the device's
// error word first.
template <typename IdxT>
__device__ __forceinline__ int expert_key(const IdxT* idx, i64 i, i64 L, int E, unsigned* err = nullptr) {
  if (i >= L) return -1;
  const i64 v = (i64)idx[i];
  if (v >= 0 && v < E) return (int)v;
  if (v != -1 && err != nullptr) record_bad_expert_id(err, MOE_RT_ERR_MAKE_PLAN, v, i, E);
  return -1;
}

// A routing map [T, E] read as E slots per token: slot i = t*E + e holds expert e when set (L < 2^31).
__device__ __forceinline__ int expert_key(const bool* map, i64 i, i64 L, int E, unsigned* = nullptr) {
  if (i >= L) return -1;
  return map[i] ? (int)i % E : -1;
}

// Raw-unit streaming access; U is one of uint4, uint2, unsigned, unsigned short, unsigned char.
template <typename U> __device__ __forceinline__ U ld_stream(const U* p) { return __ldcs(p); }
template <typename U> __device__ __forceinline__ void st_stream(U* p, U v) { __stcs(p, v); }
template <typename U> __device__ __forceinline__ U zero_unit();
template <> __device__ __forceinline__ uint4 zero_unit<uint4>() { return make_uint4(0, 0, 0, 0); }
template <> __device__ __forceinline__ uint2 zero_unit<uint2>() { return make_uint2(0, 0); }
template <> __device__ __forceinline__ unsigned zero_unit<unsigned>() { return 0u; }
template <> __device__ __forceinline__ unsigned short zero_unit<unsigned short>() { return 0; }
template <> __device__ __forceinline__ unsigned char zero_unit<unsigned char>() { return 0; }

// Elements of T as fp32 in groups: VEC -> one 16-byte Vec<T>, else one scalar.
template <typename T, bool VEC> struct Pack {
  static constexpr int N = VEC ? Vec<T>::N : 1;
  float f[N];
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (VEC) {
      Vec<T> v = load_vec_stream(p);
#pragma unroll
      for (int j = 0; j < N; ++j) f[j] = to_float(v.v[j]);
    } else {
      f[0] = to_float(p[0]);
    }
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (VEC) {
      Vec<T> v;
#pragma unroll
      for (int j = 0; j < N; ++j) v.v[j] = from_float<T>(f[j]);
      store_vec_stream(p, v);
    } else {
      p[0] = from_float<T>(f[0]);
    }
  }
};

}  // namespace

// ---- plan ----------------------------------------------------------------------------------------------

// One warp counts slots [begin, begin + chunk) of idx into hist[e] (chunk a multiple of 32; ids outside
// [-1, E) recorded in `err` when given, and counted as -1).
template <typename IdxT>
__device__ __forceinline__ void count_chunk(const IdxT* __restrict__ idx, i64 begin, int chunk, i64 L, int E,
                                            int* hist, unsigned* err) {
  const int lane = threadIdx.x & 31;
  for (int j = 0; j < chunk; j += 32) {
    const int key = expert_key(idx, begin + j + lane, L, E, err);
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    if (key >= 0 && lane == __ffs(peers) - 1) hist[key] += __popc(peers);
    __syncwarp();
  }
}

// One warp assigns slots [begin, begin + chunk): the rank of slot i inside its expert e is run[e] (the
// chunk's base, advanced here) + the earlier lanes of the same expert; kept ranks get row seg_start[e] + rank
// (dst_row[i], src_slot[row] = i), the others -1.
template <typename IdxT>
__device__ __forceinline__ void assign_chunk(const IdxT* __restrict__ idx, i64 begin, int chunk, i64 L, int E,
                                             int* run, const int* kept, const int* seg_start,
                                             int* __restrict__ dst_row, int* __restrict__ src_slot) {
  const int lane = threadIdx.x & 31;
  const unsigned lt = lanemask_lt();
  for (int j = 0; j < chunk; j += 32) {
    const i64 i = begin + j + lane;
    const int key = expert_key(idx, i, L, E);
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    int d = -1;
    if (key >= 0) {
      const int rank = run[key] + __popc(peers & lt);
      if (rank < kept[key]) {
        d = seg_start[key] + rank;
        src_slot[d] = (int)i;
      }
    }
    if (i < L) dst_row[i] = d;
    __syncwarp();
    if (key >= 0 && lane == __ffs(peers) - 1) run[key] += __popc(peers);
    __syncwarp();
  }
}

// partial[c*E + e] = number of slots of chunk c routed to expert e. One warp per chunk of `chunk` slots
// (a multiple of 32); dynamic shared memory: warps_per_block * E ints.
// Also sets src_slot[0..N) to -1 (grid-stride), ready for plan_assign, and zeroes plan_scan's counter.
// Ids outside [-1, E) are recorded in the error word `err` (common.cuh) and counted as -1.
template <typename IdxT>
__global__ void plan_count(const IdxT* __restrict__ idx, i64 L, int E, int chunk, int nchunks,
                           int* __restrict__ partial, int* __restrict__ src_slot, i64 N,
                           unsigned* __restrict__ done, unsigned* __restrict__ err) {
  extern __shared__ int s_hist[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (blockIdx.x == 0 && threadIdx.x == 0) *done = 0u;  // for plan_scan's last-CTA step
  for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < N; r += (i64)gridDim.x * blockDim.x)
    src_slot[r] = -1;
  const int c = blockIdx.x * (blockDim.x >> 5) + warp;
  if (c >= nchunks) return;
  int* hist = s_hist + (i64)warp * E;
  for (int e = lane; e < E; e += 32) hist[e] = 0;
  __syncwarp();
  count_chunk(idx, (i64)c * chunk, chunk, L, E, hist, err);
  int* out = partial + (i64)c * E;
  for (int e = lane; e < E; e += 32) out[e] = hist[e];
}

// Block of 1024 threads: lane (threadIdx.x & 31) picks the expert (32 per block), warp one of 32
// contiguous ranges of chunks. base[c*E+e] = sum_{c'<c} partial[c'*E+e]; totals[e] = sum over all
// chunks. The last CTA to finish (counter `done`, zeroed by plan_count) then runs plan_offsets_block:
// an integer computation on the final totals, so the result does not depend on which CTA is last.
#if MOE_RT_WANTS(plan_scan)
__global__ void __launch_bounds__(1024) plan_scan(const int* __restrict__ partial, int* __restrict__ base,
                                                  int* __restrict__ totals, int nchunks, int E, int align,
                                                  i64 num_out, int* __restrict__ kept,
                                                  int* __restrict__ tokens_per_expert,
                                                  int* __restrict__ seg_start, unsigned* __restrict__ done) {
  __shared__ int s[32][33];
  __shared__ bool s_last;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int e = blockIdx.x * 32 + tx;
  const int per = (nchunks + 31) / 32;
  const int c0 = min(ty * per, nchunks), c1 = min(c0 + per, nchunks);
  int sum = 0;
  if (e < E)
    for (int c = c0; c < c1; ++c) sum += partial[(i64)c * E + e];
  s[ty][tx] = sum;
  __syncthreads();
  if (ty == 0) {
    int run = 0;
    for (int r = 0; r < 32; ++r) {
      const int v = s[r][tx];
      s[r][tx] = run;
      run += v;
    }
    if (e < E) totals[e] = run;
  }
  __syncthreads();
  if (e < E) {
    int run = s[ty][tx];
    for (int c = c0; c < c1; ++c) {
      const int v = partial[(i64)c * E + e];
      base[(i64)c * E + e] = run;
      run += v;
    }
  }
  __threadfence();  // totals visible device-wide before this CTA counts itself done
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  plan_offsets_block<true>(totals, E, align, num_out, kept, tokens_per_expert, seg_start);
}
#endif

// dst_row[i] = seg_start[e] + rank (or -1 if dropped); src_slot[dst] = i. The rank of slot i inside expert
// e is base[c][e] + the number of earlier slots of chunk c routed to e: stable, hence token-ascending.
// src_slot was filled with -1 by plan_count. Dynamic shared memory: warps_per_block * E ints.
template <typename IdxT>
__global__ void plan_assign(const IdxT* __restrict__ idx, i64 L, int E, int chunk, int nchunks,
                            const int* __restrict__ base, const int* __restrict__ kept,
                            const int* __restrict__ seg_start, int* __restrict__ dst_row,
                            int* __restrict__ src_slot) {
  extern __shared__ int s_run[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = blockIdx.x * (blockDim.x >> 5) + warp;
  if (c >= nchunks) return;
  int* run = s_run + (i64)warp * E;
  const int* b = base + (i64)c * E;
  for (int e = lane; e < E; e += 32) run[e] = b[e];
  __syncwarp();
  assign_chunk(idx, (i64)c * chunk, chunk, L, E, run, kept, seg_start, dst_row, src_slot);
}

// make_plan in one CTA where the slots are few (csrc/permutation.c fused_chunk): plan_count's, plan_scan's and
// plan_assign's steps with the block's barriers between them, a warp per chunk (nchunks <= 32), the chunks'
// counts and the totals in shared memory ((nchunks + 1) * E ints, dynamic). The same integers, so the same
// plan bit for bit, in one launch instead of three.
template <typename IdxT>
__global__ void __launch_bounds__(1024) plan_fused(const IdxT* __restrict__ idx, i64 L, int E, int chunk,
                                                   int nchunks, int align, i64 num_out, int* kept,
                                                   int* tokens_per_expert, int* seg_start,
                                                   int* __restrict__ dst_row, int* __restrict__ src_slot, i64 N,
                                                   unsigned* __restrict__ err) {
  extern __shared__ int s_part[];  // [nchunks][E] counts, then (in place) each chunk's base; then [E] totals
  int* s_tot = s_part + nchunks * E;
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (i64 r = threadIdx.x; r < N; r += blockDim.x) src_slot[r] = -1;
  for (int i = threadIdx.x; i < nchunks * E; i += blockDim.x) s_part[i] = 0;
  __syncthreads();
  for (int c = warp; c < nchunks; c += nwarps) count_chunk(idx, (i64)c * chunk, chunk, L, E, s_part + c * E, err);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
    for (int c = 0; c < nchunks; ++c) {
      const int v = s_part[c * E + e];
      s_part[c * E + e] = run;
      run += v;
    }
    s_tot[e] = run;
  }
  __syncthreads();
  plan_offsets_block<false>(s_tot, E, align, num_out, kept, tokens_per_expert, seg_start);
  __syncthreads();  // kept and seg_start (global, this block's writes) read below
  for (int c = warp; c < nchunks; c += nwarps)
    assign_chunk(idx, (i64)c * chunk, chunk, L, E, s_part + c * E, kept, seg_start, dst_row, src_slot);
}

// ---- dispatch ----------------------------------------------------------------------------------------

// One CTA per token: read x[t] once (UNROLL units per thread in flight), store it to each kept destination.
// Dynamic shared memory: K ints.
template <typename U, int UNROLL, bool STREAM>
__global__ void dispatch_rows(const U* __restrict__ x, U* __restrict__ out, const int* __restrict__ dst_row,
                              int K, i64 row_units) {
  extern __shared__ int s_dst[];
  const i64 t = blockIdx.x;
  for (int k = threadIdx.x; k < K; k += blockDim.x) s_dst[k] = dst_row[t * K + k];
  __syncthreads();
  const U* src = x + t * row_units;
  for (i64 i0 = threadIdx.x; i0 < row_units; i0 += (i64)blockDim.x * UNROLL) {
    U v[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const i64 i = i0 + (i64)j * blockDim.x;
      if (i < row_units) v[j] = ld_stream(src + i);
    }
    for (int k = 0; k < K; ++k) {
      const int d = s_dst[k];
      if (d < 0) continue;
      U* o = out + (i64)d * row_units;
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        const i64 i = i0 + (i64)j * blockDim.x;
        if (i < row_units) {
          if constexpr (STREAM) st_stream(o + i, v[j]); else o[i] = v[j];
        }
      }
    }
  }
}

// Permuted probs in their output dtype: from fp32 slot probs (exact for fp16/bf16 probs, whose values fp32
// holds exactly), or fp64 kept as it is.
__device__ __forceinline__ float prob_cvt(float v, float*) { return v; }
__device__ __forceinline__ __half prob_cvt(float v, __half*) { return __float2half_rn(v); }
__device__ __forceinline__ __nv_bfloat16 prob_cvt(float v, __nv_bfloat16*) { return __float2bfloat16_rn(v); }
__device__ __forceinline__ double prob_cvt(double v, double*) { return v; }

// One warp per row (grid-stride): rows with src_slot -1 are zeroed (skipped when out is null);
// probs_out[row] = src >= 0 ? probs_flat[src] : 0 (when probs_out is given), written as PO. With x (the
// gather form of dispatch_rows, for few rows: one launch instead of two), the other rows are copied:
// out[row] = x[src / K], 4 units a lane in flight (a token's row is read by each of its K rows' warps,
// from L2 at the sizes the planner gives it).
template <typename U, typename PI = float, typename PO = float>
__global__ void fill_rows(U* __restrict__ out, PO* __restrict__ probs_out,
                          const PI* __restrict__ probs_flat, const int* __restrict__ src_slot, i64 N,
                          i64 row_units, const U* __restrict__ x, int K) {
  const int lane = threadIdx.x & 31;
  const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
  for (i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < N; r += warps) {
    const int s = src_slot[r];
    if (probs_out != nullptr && lane == 0) probs_out[r] = prob_cvt(s >= 0 ? probs_flat[s] : PI(0), (PO*)nullptr);
    if (out == nullptr) continue;
    U* o = out + r * row_units;
    if (s < 0) {
      const U z = zero_unit<U>();
      for (i64 i = lane; i < row_units; i += 32) st_stream(o + i, z);
    } else if (x != nullptr) {
      const U* src = x + (i64)(s / K) * row_units;
      for (i64 i0 = lane; i0 < row_units; i0 += 32 * 4) {
        U v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (i0 + 32 * j < row_units) v[j] = src[i0 + 32 * j];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (i0 + 32 * j < row_units) st_stream(o + i0 + 32 * j, v[j]);
      }
    }
  }
}

// out[r] = src[r] for the rows whose keep[r] >= 0, zero for the others (left as they are when zero_rest is
// 0): one warp per row (grid-stride), 4 units per lane in flight; only kept rows are read. (The JAX
// low-latency adapter's copy of the receive buffer into XLA's output: keep = the slot table.)
template <typename U>
__global__ void copy_kept_rows(const U* __restrict__ src, U* __restrict__ out, const int* __restrict__ keep,
                               i64 N, i64 row_units, int zero_rest) {
  const int lane = threadIdx.x & 31;
  const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
  for (i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < N; r += warps) {
    U* o = out + r * row_units;
    if (keep[r] >= 0) {
      const U* s = src + r * row_units;
      for (i64 i = lane; i < row_units; i += 32 * 4) {
        U v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (i + 32 * j < row_units) v[j] = ld_stream(s + i + 32 * j);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (i + 32 * j < row_units) st_stream(o + i + 32 * j, v[j]);
      }
    } else if (zero_rest) {
      const U z = zero_unit<U>();
      for (i64 i = lane; i < row_units; i += 32) st_stream(o + i, z);
    }
  }
}

// ---- combine -----------------------------------------------------------------------------------------

// Row element groups of T kept raw (16-byte Vec<T> when VEC, else one T) between load and use, so many
// loads can be in flight in few registers; LM picks the load: 0 ld.global.cs (streaming, evict first),
// 1 ld.global.nc, 2 ld.global.nc.L1::no_allocate with a 256-byte L2 prefetch.
template <typename T, bool VEC, int LM> struct RawPack {
  static constexpr int N = Vec<T>::N;
  Vec<T> r;
  __device__ __forceinline__ void load(const T* p) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    if constexpr (LM == 0) {
      r.raw = __ldcs(q);
    } else if constexpr (LM == 1) {
      r.raw = __ldg(q);
    } else {
      asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r.raw.x), "=r"(r.raw.y), "=r"(r.raw.z), "=r"(r.raw.w) : "l"(q));
    }
  }
  __device__ __forceinline__ float get(int q) const { return to_float(r.v[q]); }
};
template <typename T, int LM> struct RawPack<T, false, LM> {
  static constexpr int N = 1;
  T r;
  __device__ __forceinline__ void load(const T* p) { r = p[0]; }
  __device__ __forceinline__ float get(int) const { return to_float(r); }
};

// Combine by slices: work item (t, s) sums slice s (blockDim.x * UNROLL element groups) of token t's
// rows: out[t] = sum_k w[t,k] * y_p[dst[t,k]] in fp32, k ascending, w null meaning 1 (the same
// arithmetic and order in every configuration, so the same bits). Small CTAs, several resident per SM, each with the
// loads of KU slots (all UNROLL groups) issued before the first FMA: many bytes in flight per SM. Work
// items run in a grid-stride loop (grid = work for one item per CTA, or a persistent grid). At most
// MAXT threads per CTA; MINB CTAs per SM asked of the register allocator.
// H counts elements of T; VEC needs H % Vec<T>::N == 0 and 16-byte aligned pointers.
template <typename T, bool VEC, int UNROLL, int KU, int LM, int MAXT, int MINB>
__global__ void __launch_bounds__(MAXT, MINB) combine_slices(const T* __restrict__ y_p, T* __restrict__ out, const int* __restrict__ dst_row,
                               const float* __restrict__ w, int K, i64 H, int slices, i64 work) {
  using R = RawPack<T, VEC, LM>;
  using P = Pack<T, VEC>;
  const i64 units = H / R::N;
  const i64 span = (i64)blockDim.x * UNROLL;
  for (i64 item = blockIdx.x; item < work; item += gridDim.x) {
    const i64 t = item / slices;
    const i64 i0 = (item - t * slices) * span + threadIdx.x;
    P acc[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j)
#pragma unroll
      for (int q = 0; q < R::N; ++q) acc[j].f[q] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += KU) {
      int d[KU];
      float wk[KU];
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const bool in = k0 + u < K;
        d[u] = in ? __ldg(dst_row + t * K + k0 + u) : -1;
        wk[u] = (in && w != nullptr) ? __ldg(w + t * K + k0 + u) : 1.0f;
      }
      R v[KU][UNROLL];
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const T* row = y_p + (i64)(d[u] < 0 ? 0 : d[u]) * H;
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
          const i64 i = i0 + (i64)j * blockDim.x;
          if (d[u] >= 0 && i < units) v[u][j].load(row + i * R::N);
        }
      }
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        if (d[u] < 0) continue;
#pragma unroll
        for (int j = 0; j < UNROLL; ++j)
#pragma unroll
          for (int q = 0; q < R::N; ++q) acc[j].f[q] = fmaf(wk[u], v[u][j].get(q), acc[j].f[q]);
      }
    }
    T* o = out + t * H;
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const i64 i = i0 + (i64)j * blockDim.x;
      if (i < units) acc[j].store(o + i * R::N);
    }
  }
}

// One CTA per token, for combine with weights: g_p[dst] = T(w * g[t]); dw[t,k] = sum_h y_p[dst,h]*g[t,h]
// (fp32; per-warp shuffle sums added per warp in chunk order, then warps summed in order: deterministic).
// dw is 0 for dropped slots. Dynamic shared memory: K ints + K floats + (blockDim/32)*K floats.
template <typename T, bool VEC, int UNROLL>
__global__ void combine_bwd_rows(const T* __restrict__ g, const T* __restrict__ y_p, T* __restrict__ g_p,
                                 const int* __restrict__ dst_row, const float* __restrict__ w,
                                 float* __restrict__ dw, int K, i64 H) {
  using P = Pack<T, VEC>;
  extern __shared__ int s_mem[];
  const int nwarps = blockDim.x >> 5, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int* s_dst = s_mem;
  float* s_w = reinterpret_cast<float*>(s_mem + K);
  float* s_part = s_w + K;
  const i64 t = blockIdx.x;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    s_dst[k] = dst_row[t * K + k];
    s_w[k] = w[t * K + k];
  }
  for (int q = threadIdx.x; q < nwarps * K; q += blockDim.x) s_part[q] = 0.0f;
  __syncthreads();
  const i64 units = H / P::N;
  const T* grow = g + t * H;
  // The loop bound is uniform over the block: every lane takes part in each warp_sum.
  for (i64 b0 = 0; b0 < units; b0 += (i64)blockDim.x * UNROLL) {
    const i64 i0 = b0 + threadIdx.x;
    P gv[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
      const i64 i = i0 + (i64)j * blockDim.x;
      if (i < units) {
        gv[j].load(grow + i * P::N);
      } else {
#pragma unroll
        for (int q = 0; q < P::N; ++q) gv[j].f[q] = 0.0f;
      }
    }
    for (int k = 0; k < K; ++k) {
      const int d = s_dst[k];
      if (d < 0) continue;  // uniform over the block
      const float wk = s_w[k];
      const T* yrow = y_p + (i64)d * H;
      T* orow = g_p + (i64)d * H;
      float part = 0.0f;
#pragma unroll
      for (int j = 0; j < UNROLL; ++j) {
        const i64 i = i0 + (i64)j * blockDim.x;
        if (i < units) {
          P yv;
          yv.load(yrow + i * P::N);
          P ov;
#pragma unroll
          for (int q = 0; q < P::N; ++q) {
            part = fmaf(yv.f[q], gv[j].f[q], part);
            ov.f[q] = wk * gv[j].f[q];
          }
          ov.store(orow + i * P::N);
        }
      }
      part = warp_sum(part);
      if (lane == 0) s_part[warp * K + k] += part;
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    float s = 0.0f;
    for (int q = 0; q < nwarps; ++q) s += s_part[q * K + k];
    dw[t * K + k] = s_dst[k] >= 0 ? s : 0.0f;
  }
}

// out[i] = dst_row[i] >= 0 ? vals[dst_row[i]] : 0 for i < L (grad of permuted probs back to [T,K]).
#if MOE_RT_WANTS(gather_slots)
extern "C" __global__ void gather_slots(const float* __restrict__ vals, const int* __restrict__ dst_row,
                                        float* __restrict__ out, i64 L) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < L; i += (i64)gridDim.x * blockDim.x) {
    const int d = dst_row[i];
    out[i] = d >= 0 ? vals[d] : 0.0f;
  }
}
#endif

// ---- chunk sort --------------------------------------------------------------------------------------

// One CTA: in_start[c] = sum_{j<c} split[j] (in_start[S] = total); out_start[order[j]] =
// sum_{j'<j} split[order[j']]. Order entries outside [0, S) are skipped (their chunk keeps start 0).
template <typename IdxT>
__global__ void chunk_offsets(const IdxT* __restrict__ split, const IdxT* __restrict__ order, int S,
                              int* __restrict__ in_start, int* __restrict__ out_start) {
  __shared__ int scratch[32];
  __shared__ int carry[2];
  if (threadIdx.x == 0) carry[0] = carry[1] = 0;
  for (int c = threadIdx.x; c < S; c += blockDim.x) out_start[c] = 0;
  __syncthreads();
  for (int c0 = 0; c0 < S; c0 += blockDim.x) {
    const int c = c0 + threadIdx.x;
    const int s = c < S ? max((int)split[c], 0) : 0;
    int tot;
    const int incl = block_inclusive_scan(s, scratch, &tot);
    const int o = c < S ? (int)order[c] : -1;
    const int so = (o >= 0 && o < S) ? max((int)split[o], 0) : 0;
    int tot2;
    const int incl2 = block_inclusive_scan(so, scratch, &tot2);
    if (c < S) in_start[c] = carry[0] + incl - s;
    if (o >= 0 && o < S) out_start[o] = carry[1] + incl2 - so;
    __syncthreads();
    if (threadIdx.x == 0) {
      carry[0] += tot;
      carry[1] += tot2;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) in_start[S] = carry[0];
}

// One CTA per input row i. dst(i) = out_start[c] + i - in_start[c] for the chunk c holding i, or i when
// i >= in_start[S]. Forward (BWD false): out[dst] = in[i]; backward: out[i] = in[dst]. Probs follow rows.
// Destinations outside [0, N) (inconsistent split sizes) are skipped.
template <typename U, bool BWD>
__global__ void chunk_sort_rows(const U* __restrict__ in, U* __restrict__ out, const int* __restrict__ in_start,
                                const int* __restrict__ out_start, int S, i64 N, i64 row_units,
                                const float* __restrict__ p_in, float* __restrict__ p_out) {
  const i64 i = blockIdx.x;
  const int total = in_start[S];
  i64 d = i;
  if (i < total) {
    int lo = 0, hi = S - 1;  // last c with in_start[c] <= i
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (in_start[mid] <= i) lo = mid; else hi = mid - 1;
    }
    d = (i64)out_start[lo] + (i - in_start[lo]);
  }
  if (d < 0 || d >= N) return;
  const i64 from = BWD ? d : i, to = BWD ? i : d;
  const U* s = in + from * row_units;
  U* o = out + to * row_units;
  for (i64 u = threadIdx.x; u < row_units; u += blockDim.x) st_stream(o + u, ld_stream(s + u));
  if (p_in != nullptr && threadIdx.x == 0) p_out[to] = p_in[from];
}
