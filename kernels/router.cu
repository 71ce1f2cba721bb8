// Router kernels: top-k with a score function (softmax pre/post, sigmoid, sqrtsoftplus; grouped top-k;
// expert bias for selection only; scaling), its backward, the dense scores for the aux loss and their
// backward, and a deterministic aux loss (forward and backward). Semantics: docs/router.md.
//
// Row kernels: a "team" of TEAM threads handles one token (TEAM = 32: one warp, 4 tokens per block;
// TEAM > 32: the whole block). The row's selection keys are order-preserving uint32 keys (NaN = largest,
// all NaNs equal; ties by lowest index). router_fwd keeps them in shared memory; router_fwd_reg (E <= 1024,
// 16-byte rows) keeps the row in registers, one warp per token (short rows: 2 to 8 tokens a warp, one on each
// segment of lanes), and prefetches the next token's logits.
// Selection: iterative warp argmax for k <= 8 (TEAM = 32), else a 4-bit radix select whose digit counts
// live in registers (8-bit packed counters, reduced with shuffles; no shared-memory atomics) and that
// stops as soon as the threshold bin is taken whole. On long rows a prefilter runs first: a threshold
// taken from each lane's two largest keys leaves a short list that holds the top k; when it has at most 64
// entries, each warp sorts them by (key, index) with a bitonic network and reads the k-th off (the radix
// passes run only when the list overflows). Phase 1 is compiled per score function. Grouped top-k with
// k/g > 8 works on every group at once, one lane segment per group: a threshold from each lane's four
// largest keys lists the group's candidates (radix select per segment when the list would be too long).
// In router_fwd_reg with at most 32 groups whose chunks sit on aligned lanes, the group keys, the choice of
// groups and the mask stay in registers (shuffles and one ballot), and for k <= 8 the argmax rounds hand
// each winner to a lane, which places it in index order by ranking the winners' indices (no pass over the
// row); with groups and 8 keys a lane, each lane sorts its keys and the max rounds pop the lanes' heads.
// On 16-bit rows in one warp (k/g > 8), phase 1 keeps each 8-key chunk's largest key: the group scores and
// the top-k prefilter over the selected groups read only the chunks whose maximum reaches their bound.
// Every sum is done in a fixed order, so outputs are bitwise reproducible. Global traffic: logits read once,
// each output written once with 16-byte vectors (the K nonzero probs are patched in after the zero fill,
// while the lines are still in L2). The top-k backward reads, where its gradient is zero off the map,
// only the map and the selected entries (router_bwd_sel, router_bwd_sel_reg). The row kernels' BITMAP flag
// writes (forward) or reads (backward) the routing map bit-packed instead of one byte per expert; the same
// selection and sums otherwise. router_bwd_idx: the backward from dense top-k indices (no map).
#include "moe_rt/common.cuh"

using namespace moe_rt;

#define FULL_MASK 0xffffffffu

namespace {

constexpr float kEps = 1e-20f;
constexpr int SIGMOID = 0, SOFTMAX = 1, SQRTSOFTPLUS = 2;
constexpr int kIntMax = 0x7fffffff;
constexpr int kList = 64;  // radix select: keys still in play are compacted once they are this few
#define kInf __int_as_float(0x7f800000)
// Blocks per multiprocessor the forward kernels are built for (register budget), and the other tuning
// constants below: defaults measured on H100, overridable with -D for experiments.
#ifndef MOE_RT_FWD_MINB_512
#define MOE_RT_FWD_MINB_512 2
#endif
// router_fwd_reg with 8 keys a lane (H100, E = 256, T = 65536): bf16 6 blocks (80 registers, 32-36 bytes of
// spills; since LANESEL it runs only the grouped rows that kernel does not take), and 8 for the kernel
// without groups (softmax 70.3 us at 8 blocks, 72.1 at 6); fp32 5 blocks, where 80 registers spill
// (softmax 86.7 us at 5, 91.8 at 6; grouped sigmoid 109.5 at 5, 108.0 to 115 at 6 depending on the build).
// For fp32 the kernel without groups was slower at 80 registers (softmax 89.5 us): fp32 uses the one kernel.
#ifndef MOE_RT_FWD_REG_MINB_8
#define MOE_RT_FWD_REG_MINB_8 6
#endif
#ifndef MOE_RT_FWD_REG_MINB_8_F32
#define MOE_RT_FWD_REG_MINB_8_F32 5
#endif
#ifndef MOE_RT_FWD_REG_MINB_8_NG
#define MOE_RT_FWD_REG_MINB_8_NG 8
#endif
// Chunks each thread loads before using the first. Forward (generic kernel), on H100: on one-warp teams 9
// (the whole bf16 row at E = 2304, or two rounds of fp32 instead of three), but 6 for 16-bit logits in the
// kernel with groups. E = 2304, T = 65536, 6 -> 9: bf16 softmax 613 -> 563 us, bf16 grouped sigmoid 779 ->
// 1013 us, fp32 grouped sigmoid 970 -> 949 us, fp32 softmax 736 either way (earlier, fp32: 0.958 ms with 2,
// 0.872 with 4, 0.820 with 6, 0.830 with 8). Different counts for the score functions of one kernel made
// ptxas spill. 2 on the larger teams (4 was 4% slower for bf16 E=16384). Backward: on the 512-thread team
// MOE_RT_BWD_ELEMS_512 elements per thread; on H100 loading more than one chunk slowed the smaller teams.
#ifndef MOE_RT_FWD_U_32
#define MOE_RT_FWD_U_32 9
#endif
#ifndef MOE_RT_FWD_U_32_H_G
#define MOE_RT_FWD_U_32_H_G 6
#endif
#ifndef MOE_RT_FWD_U
#define MOE_RT_FWD_U 2
#endif
#ifndef MOE_RT_BWD_ELEMS_512
#define MOE_RT_BWD_ELEMS_512 16
#endif
#define MOE_RT_BWD_U(TEAM, CH) ((TEAM) == 512 && MOE_RT_BWD_ELEMS_512 > (CH) ? MOE_RT_BWD_ELEMS_512 / (CH) : 1)
#define MOE_RT_FWD_MINB(TEAM) ((TEAM) == 128 ? 6 : ((TEAM) == 32 ? 4 : MOE_RT_FWD_MINB_512))
#define MOE_RT_FWD_REG_MINB8(T, GROUPS) \
  (sizeof(T) == 4 ? MOE_RT_FWD_REG_MINB_8_F32 : ((GROUPS) ? MOE_RT_FWD_REG_MINB_8 : MOE_RT_FWD_REG_MINB_8_NG))
// The kernel for groups held in the lanes (LANESEL): 8 blocks for bf16 (64 registers; grouped sigmoid at E = 256
// 87.5 us, 89.3 at its natural 72 registers, 96.8 for the kernel with every path, which spills at 80), 7 for fp32
// (64 registers since its smaller shared-memory slot and selection bits; 100.8 us at 72, 110.7 for the full kernel).
#ifndef MOE_RT_FWD_REG_MINB_LS
#define MOE_RT_FWD_REG_MINB_LS 8
#endif
#ifndef MOE_RT_FWD_REG_MINB_LS_F32
#define MOE_RT_FWD_REG_MINB_LS_F32 7
#endif
// Segments of W < 32 lanes a token (short rows, one chunk a lane): 8 blocks (64 registers).
#ifndef MOE_RT_FWD_REG_MINB_SEG
#define MOE_RT_FWD_REG_MINB_SEG 8
#endif
#define MOE_RT_FWD_REG_MINB(V, T, GROUPS, LANESEL)                                                    \
  ((LANESEL) ? (sizeof(T) == 4 ? MOE_RT_FWD_REG_MINB_LS_F32 : MOE_RT_FWD_REG_MINB_LS)                  \
             : ((V) <= 8 ? MOE_RT_FWD_REG_MINB8(T, GROUPS) : ((V) <= 16 ? 4 : 3)))
template <int N> struct IC { static constexpr int value = N; };
template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

// fkey for v computed by fp32 arithmetic (add, multiply, MUFU): the GPU gives every NaN result as the one
// canonical NaN 0x7fffffff, whose key is already 0xffffffff, so the NaN test is left out. Raw inputs (a logit
// as read) keep fkey: their NaNs may carry a sign and a payload. Negative values flip every bit, others the
// sign bit: one shift and one xor (a select on the sign compiled to 3 instructions).
__device__ __forceinline__ unsigned fkey_arith(float v) {
  const unsigned b = __float_as_uint(v);
  return b ^ ((unsigned)((int)b >> 31) | 0x80000000u);
}

__device__ __forceinline__ unsigned fkey(float v) { return (v != v) ? 0xffffffffu : fkey_arith(v); }

__device__ __forceinline__ float fdecode(unsigned k) {
  if (k == 0xffffffffu) return __uint_as_float(0x7fffffffu);
  const unsigned b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  return __uint_as_float(b);
}

// __frcp_rn is the correctly rounded reciprocal: the same bits as 1.0f / y, without the general division.
__device__ __forceinline__ float sigmoidf(float x) { return __frcp_rn(1.0f + expf(-x)); }
// The forward's sigma: the hardware exp2 and reciprocal (ex2.approx.ftz, rcp.approx.ftz), 4 instructions
// against about 20 for sigmoidf (ncu, grouped router_fwd<float, 32> at E = 2304: 15% of its instructions).
// Relative error about 1e-6 for |x| < 10, growing with |x| (x log2 e is rounded before the exp2), inside the
// tests' fp32 tolerance (max(1e-5, 4e-7 E) absolute and relative; docs/router.md §6); values below about
// 1e-38 flush to zero.
// The backward reads the saved values, not this function.
// (rcp.approx written out: __fdividef(1, y) left a multiply by 1 after the reciprocal, as an add of -0.)
__device__ __forceinline__ float sigmoid_fwd(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + __expf(-x)));
  return r;
}
__device__ __forceinline__ float sqrtsoftplusf(float x) { return x > 20.0f ? sqrtf(x) : sqrtf(log1pf(expf(x))); }

__device__ __forceinline__ bool selected(unsigned key, int i, unsigned thr, int ilast) {
  return key > thr || (key == thr && i <= ilast);
}

// ---- vector load/store of N elements (N * sizeof(T) in {4, 8, 16, 32, ...} bytes) ----------------------
// Element v of a chunk as a float; bf16 pairs unpacked from their 32-bit word with one shift or one mask
// (the conversion compiled to a byte permute and a shift for the upper half).
template <int N, typename T>
__device__ __forceinline__ float elem_f(const T (&x)[N], int v) {
  if constexpr (IsBf16<T>::value) {
    const unsigned w = reinterpret_cast<const unsigned*>(x)[v >> 1];
    return __uint_as_float((v & 1) ? (w & 0xffff0000u) : (w << 16));
  } else {
    return to_float(x[v]);
  }
}

template <int N, typename T>
__device__ __forceinline__ void ldn(const T* p, T (&v)[N]) {
  constexpr int B = N * (int)sizeof(T);
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) reinterpret_cast<uint4*>(v)[i] = reinterpret_cast<const uint4*>(p)[i];
  } else if constexpr (B == 8) {
    *reinterpret_cast<uint2*>(v) = *reinterpret_cast<const uint2*>(p);
  } else if constexpr (B == 4) {
    *reinterpret_cast<unsigned*>(v) = *reinterpret_cast<const unsigned*>(p);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = p[i];
  }
}

template <int N, typename T>
__device__ __forceinline__ void stn(T* p, const T (&v)[N]) {
  constexpr int B = N * (int)sizeof(T);
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) reinterpret_cast<uint4*>(p)[i] = reinterpret_cast<const uint4*>(v)[i];
  } else if constexpr (B == 8) {
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(v);
  } else if constexpr (B == 4) {
    *reinterpret_cast<unsigned*>(p) = *reinterpret_cast<const unsigned*>(v);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = v[i];
  }
}

// ---- team helpers ------------------------------------------------------------------------------------
template <int TEAM>
struct Team {
  static constexpr int NW = TEAM / 32;
  __device__ __forceinline__ static int rank() { return TEAM == 32 ? (int)(threadIdx.x & 31) : (int)threadIdx.x; }
  __device__ __forceinline__ static void sync() {
    if constexpr (TEAM == 32) __syncwarp(); else __syncthreads();
  }
  // Fixed-order sum / max over the team; every thread gets the result.
  __device__ __forceinline__ static float sum(float v, float* red) {
    v = warp_sum(v);
    if constexpr (TEAM == 32) {
      return v;
    } else {
      __syncthreads();
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
      __syncthreads();
      float t = 0.0f;
#pragma unroll
      for (int w = 0; w < NW; ++w) t += red[w];
      return t;
    }
  }
  // Two sums at once, each in the order of sum() (red: 2 * NW words).
  __device__ __forceinline__ static void sum2(float& a, float& b, float* red) {
    a = warp_sum(a);
    b = warp_sum(b);
    if constexpr (TEAM > 32) {
      __syncthreads();
      if ((threadIdx.x & 31) == 0) { red[threadIdx.x >> 5] = a; red[NW + (threadIdx.x >> 5)] = b; }
      __syncthreads();
      float ta = 0.0f, tb = 0.0f;
#pragma unroll
      for (int w = 0; w < NW; ++w) { ta += red[w]; tb += red[NW + w]; }
      a = ta;
      b = tb;
    }
  }
  __device__ __forceinline__ static float max(float v, float* red) {
    v = warp_max(v);
    if constexpr (TEAM == 32) {
      return v;
    } else {
      __syncthreads();
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
      __syncthreads();
      float t = red[0];
#pragma unroll
      for (int w = 1; w < NW; ++w) t = fmaxf(t, red[w]);
      return t;
    }
  }
  // Max of an int or unsigned over the team (redi: scratch of NW words).
  template <typename V>
  __device__ __forceinline__ static V vmax(V v, int* redi) {
    v = __reduce_max_sync(FULL_MASK, v);
    if constexpr (TEAM == 32) {
      return v;
    } else {
      V* red = reinterpret_cast<V*>(redi);
      __syncthreads();
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
      __syncthreads();
      V t = red[0];
#pragma unroll
      for (int w = 1; w < NW; ++w) t = t > red[w] ? t : red[w];
      return t;
    }
  }
  // Exclusive count of `pred` over team ranks below this one; *total = team count.
  __device__ __forceinline__ static int excl_count(bool pred, int* total, int* redi) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned b = __ballot_sync(FULL_MASK, pred);
    const int wr = __popc(b & ((1u << lane) - 1u)), wt = __popc(b);
    if constexpr (TEAM == 32) {
      *total = wt;
      return wr;
    } else {
      __syncthreads();
      if (lane == 0) redi[threadIdx.x >> 5] = wt;
      __syncthreads();
      int off = 0, tot = 0;
      const int me = threadIdx.x >> 5;
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const int c = redi[w];
        off += w < me ? c : 0;
        tot += c;
      }
      *total = tot;
      return off + wr;
    }
  }
};

// ---- selection -----------------------------------------------------------------------------------------
// Both return (thr, ilast): element i of keys[0, n) is selected iff selected(keys[i], i, thr, ilast), and
// exactly k elements are, the k first in the order (key desc, index asc). Requires 1 <= k <= n.

// Iterative warp argmax (TEAM = 32, small k): each lane caches its best; the winner rescans.
__device__ __forceinline__ void argmax_select(const unsigned* keys, int n, int k, unsigned& thr, int& ilast) {
  const int lane = threadIdx.x & 31;
  unsigned bk = 0;
  int bi = kIntMax;
  for (int i = lane; i < n; i += 32) {
    const unsigned key = keys[i];
    if (bi == kIntMax || key > bk) { bk = key; bi = i; }
  }
  for (int round = 0;; ++round) {
    const unsigned mk = __reduce_max_sync(FULL_MASK, bk);
    const int mi = (int)__reduce_min_sync(FULL_MASK, (unsigned)(bk == mk ? bi : kIntMax));
    if (round == k - 1) { thr = mk; ilast = mi; return; }
    if (bi == mi) {
      unsigned nk = 0;
      int ni = kIntMax;
      for (int i = lane; i < n; i += 32) {
        const unsigned key = keys[i];
        const bool after = key < mk || (key == mk && i > mi);
        if (after && (ni == kIntMax || key > nk)) { nk = key; ni = i; }
      }
      bk = nk; bi = ni;
    }
  }
}

// Per-thread digit counts: 8-bit counters packed in 4 registers (no shared-memory atomics, whose
// same-address chains serialize), drained into 16 plain counters at least every 255 keys.
__device__ __forceinline__ void digit_add(unsigned (&pk)[4], unsigned d) {
  const unsigned inc = 1u << ((d & 3u) << 3), h = d >> 2;
  pk[0] += h == 0u ? inc : 0u;
  pk[1] += h == 1u ? inc : 0u;
  pk[2] += h == 2u ? inc : 0u;
  pk[3] += h == 3u ? inc : 0u;
}

__device__ __forceinline__ void digit_drain(unsigned (&pk)[4], unsigned (&v)[16]) {
#pragma unroll
  for (int b = 0; b < 16; ++b) v[b] += (pk[b >> 2] >> ((b & 3) * 8)) & 255u;
#pragma unroll
  for (int i = 0; i < 4; ++i) pk[i] = 0u;
}

// Counts of digit (key >> shift) & 15 of keys[i] (i = first, first + step, ... < n) matching prefix/mask.
__device__ __forceinline__ void count_digits(const unsigned* keys, int first, int n, int step, int rot,
                                             unsigned prefix, unsigned mask, int shift, unsigned (&v)[16]) {
  unsigned pk[4] = {0u, 0u, 0u, 0u};
  int since = 0;
#pragma unroll
  for (int b = 0; b < 16; ++b) v[b] = 0u;
  for (int i = first; i < n; i += step) {
    int e = i + rot;
    if (e >= n) e -= n;
    const unsigned key = keys[e];
    if ((key & mask) == prefix) {
      digit_add(pk, (key >> shift) & 15u);
      if (++since == 255) { digit_drain(pk, v); since = 0; }
    }
  }
  digit_drain(pk, v);
}

// One step of the transposed butterfly over 16 counters (compile-time indices keep v[] in registers).
template <int W, int M>
__device__ __forceinline__ void butterfly_step(unsigned (&v)[16], int lane) {
  const bool up = (lane & M) != 0;
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const unsigned lo = v[i], hi = v[i + W];
    v[i] = (up ? hi : lo) + __shfl_xor_sync(FULL_MASK, up ? lo : hi, M);
  }
}

// One radix pass after the counting: reduce the per-thread digit counts v[16] over the team, pick
// the bin holding the need-th largest key, narrow (prefix, mask) and `need`. True when that bin is taken
// whole (the selection is then every key >= prefix).
template <int TEAM>
__device__ __forceinline__ bool radix_pick(unsigned (&v)[16], unsigned* wcnt, int pass, int shift, int& need,
                                           unsigned& prefix, unsigned& mask, unsigned* bin_count = nullptr) {
  const int r = Team<TEAM>::rank(), lane = threadIdx.x & 31, warp = r >> 5;
  // Transposed butterfly: afterwards lanes 2b and 2b+1 hold the warp's count of bin b.
  butterfly_step<8, 16>(v, lane);
  butterfly_step<4, 8>(v, lane);
  butterfly_step<2, 4>(v, lane);
  butterfly_step<1, 2>(v, lane);
  unsigned cnt = v[0] + __shfl_xor_sync(FULL_MASK, v[0], 1);
  if constexpr (TEAM > 32) {
    unsigned* wc = wcnt + (pass & 1) * Team<TEAM>::NW * 16;
    if ((lane & 1) == 0) wc[warp * 16 + (lane >> 1)] = cnt;
    __syncthreads();
    cnt = 0;
#pragma unroll
    for (int w = 0; w < Team<TEAM>::NW; ++w) cnt += wc[w * 16 + (lane >> 1)];
  }
  // Suffix sums over bins: even lane 2b: count of bins >= b; odd lane 2b+1: count of bins > b.
  unsigned s = (lane & 1) ? 0u : cnt;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned o = __shfl_down_sync(FULL_MASK, s, d);
    if (lane + d < 32) s += o;
  }
  const unsigned bal = __ballot_sync(FULL_MASK, ((lane & 1) == 0) && s >= (unsigned)need);
  const int p = 31 - __clz(bal);
  const unsigned gt = __shfl_sync(FULL_MASK, s, p + 1);
  const unsigned cb = __shfl_sync(FULL_MASK, cnt, p);
  need -= (int)gt;
  prefix |= (unsigned)(p >> 1) << shift;
  mask |= 15u << shift;
  if (bin_count) *bin_count = cb;
  return cb == (unsigned)need;
}

// Bitonic sort of a warp's 64 values, element 2 * lane + s in v[s]: afterwards in descending order.
template <typename V>
__device__ __forceinline__ void sort64_desc(V (&v)[2], int lane) {
#pragma unroll
  for (int kk = 2; kk <= 64; kk <<= 1) {
#pragma unroll
    for (int j = kk >> 1; j > 0; j >>= 1) {
      if (j == 1) {
        const bool desc = ((lane * 2) & kk) == 0;
        const V hi = max(v[0], v[1]), lo = min(v[0], v[1]);
        v[0] = desc ? hi : lo;
        v[1] = desc ? lo : hi;
      } else {
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const V p = __shfl_xor_sync(FULL_MASK, v[s], j >> 1);
          const int i = lane * 2 + s;
          const bool keep_max = ((i & j) == 0) == ((i & kk) == 0);
          v[s] = keep_max ? max(v[s], p) : min(v[s], p);
        }
      }
    }
  }
}

// Prefilter of the radix select for long rows (at least 8 keys per thread, k <= 64): each lane takes its
// two largest keys and every warp sorts its 64 candidates (bitonic network, descending); the warp's k-th
// candidate tau_w has at least k keys at or above it, so tau = max over the warps of tau_w does too, and
// the row's top k all lie at or above tau. Every key >= tau is appended to the list (any order; list[2 *
// kList] counts them). Returns their number, or -1 (count reset to zero) when more than kList pass.
// The n keys are read through `map`: key i is keys[4 * map(i / 4) + i % 4] (IdChunks: keys[i]); a map
// with kIdentity false requires n % 4 == 0 and 16-byte aligned keys.
struct IdChunks {
  static constexpr bool kIdentity = true;
  __device__ __forceinline__ int operator()(int c) const { return c; }
};

// Chunk c of the selected groups' keys laid end to end -> its chunk in the row: delta[i] = (group of the i-th
// selected group - i) * chunks per group; magic divides by the group size (4 c < row length).
struct GroupChunks {
  static constexpr bool kIdentity = false;
  const int* delta;
  unsigned magic;
  __device__ __forceinline__ int operator()(int c) const { return c + delta[__umulhi(4u * (unsigned)c, magic)]; }
};

// tau0 != 0: a bound the caller already has (at least k of the n keys are >= tau0); the first pass is skipped.
template <int TEAM, typename Map>
__device__ int prefilter_list(const unsigned* keys, int n, int k, unsigned* list, int* redi, Map map,
                              unsigned tau0 = 0u) {
  using TM = Team<TEAM>;
  constexpr bool kId = Map::kIdentity;
  const int r = TM::rank(), lane = threadIdx.x & 31;
  // Keys read 4 at a time where they are 16-byte vectors (which keys a thread sees changes tau, not the result).
  const bool vec4 = !kId || ((n & 3) == 0 && (reinterpret_cast<size_t>(keys) & 15) == 0);
  const uint4* keys4 = reinterpret_cast<const uint4*>(keys);
  unsigned tau = tau0;
  if (tau == 0u) {
    unsigned v[2] = {0u, 0u};  // v[0] >= v[1]: this thread's two largest keys (0 is below every real key)
    auto top2 = [&](unsigned key) {
      v[1] = max(v[1], min(key, v[0]));
      v[0] = max(v[0], key);
    };
    if (vec4) {
      for (int c = r; c < (n >> 2); c += TEAM) {
        const uint4 k4 = keys4[map(c)];
        top2(k4.x); top2(k4.y); top2(k4.z); top2(k4.w);
      }
    } else if constexpr (kId) {
      for (int i = r; i < n; i += TEAM) top2(keys[i]);
    }
    sort64_desc(v, lane);
    tau = __shfl_sync(FULL_MASK, ((k - 1) & 1) ? v[1] : v[0], (k - 1) >> 1);
    tau = TM::vmax(tau, redi);
  }
  unsigned* lcount = list + 2 * kList;
  int* lexp = reinterpret_cast<int*>(list + kList);
  auto append = [&](unsigned key, int i) {
    if (key >= tau) {
      const unsigned pos = atomicAdd(lcount, 1u);
      if (pos < (unsigned)kList) { list[pos] = key; lexp[pos] = i; }
    }
  };
  if (vec4) {
    for (int c = r; c < (n >> 2); c += TEAM) {
      const int pc = map(c);
      const uint4 k4 = keys4[pc];
      if (max(max(k4.x, k4.y), max(k4.z, k4.w)) >= tau) {  // one atomic for the chunk's keys >= tau
        const bool h0 = k4.x >= tau, h1 = k4.y >= tau, h2 = k4.z >= tau, h3 = k4.w >= tau;
        unsigned pos = atomicAdd(lcount, (h0 ? 1u : 0u) + (h1 ? 1u : 0u) + (h2 ? 1u : 0u) + (h3 ? 1u : 0u));
        auto put = [&](bool h, unsigned key, int i) {
          if (h) {
            if (pos < (unsigned)kList) { list[pos] = key; lexp[pos] = i; }
            ++pos;
          }
        };
        put(h0, k4.x, 4 * pc); put(h1, k4.y, 4 * pc + 1); put(h2, k4.z, 4 * pc + 2); put(h3, k4.w, 4 * pc + 3);
      }
    }
  } else if constexpr (kId) {
    for (int i = r; i < n; i += TEAM) append(keys[i], i);
  }
  TM::sync();
  const unsigned total = *lcount;
  if (total > (unsigned)kList) {
    TM::sync();
    if (r == 0) *lcount = 0u;
    TM::sync();
    return -1;
  }
  return (int)total;
}

// prefilter_list with a bound tau for one warp over the selected groups' 8-key chunks (the first nc8 chunks
// of the selected groups laid end to end; delta as in GroupChunks), reading only the chunks whose maximum in
// cmax reaches tau.
__device__ int prefilter_cmax(const unsigned* keys, const unsigned* cmax, int nc8, unsigned* list, const int* delta,
                              unsigned magic, unsigned tau) {
  const int lane = threadIdx.x & 31;
  unsigned* lcount = list + 2 * kList;
  int* lexp = reinterpret_cast<int*>(list + kList);
  for (int i = lane; i < nc8; i += 32) {
    const int pc = i + (delta[__umulhi(8u * (unsigned)i, magic)] >> 1);  // delta counts 4-key chunks
    if (cmax[pc] >= tau) {
      const unsigned* ck = keys + 8 * pc;
      const uint4 a = reinterpret_cast<const uint4*>(ck)[0], b = reinterpret_cast<const uint4*>(ck)[1];
      const unsigned kv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      unsigned bits = 0u;
#pragma unroll
      for (int v = 0; v < 8; ++v) bits |= (kv[v] >= tau ? 1u : 0u) << v;
      unsigned pos = atomicAdd(lcount, (unsigned)__popc(bits));
      for (; bits != 0u; bits &= bits - 1u, ++pos) {
        if (pos < (unsigned)kList) {
          const int v = __ffs(bits) - 1;
          list[pos] = ck[v];
          lexp[pos] = 8 * pc + v;
        }
      }
    }
  }
  __syncwarp();
  const unsigned total = *lcount;
  if (total > (unsigned)kList) {
    __syncwarp();
    if (lane == 0) *lcount = 0u;
    __syncwarp();
    return -1;
  }
  return (int)total;
}

// The k-th of the nlist <= 64 listed (key, index) pairs in the order (key desc, index asc): every warp sorts
// the keys and reads the k-th (no radix passes); only when the (k+1)-th key equals it are the listed keys
// equal to it ranked by index. ilast is kIntMax when the (k+1)-th does not equal thr (the list holds every
// key >= thr), so that `key >= thr` alone selects. The list count is reset.
template <int TEAM>
__device__ __forceinline__ void list_select(unsigned* list, int nlist, int k, unsigned& thr, int& ilast) {
  const int lane = threadIdx.x & 31;
  const unsigned* lkeys = list;
  const int* lexp = reinterpret_cast<const int*>(list + kList);
  // The keys alone first (32-bit compares): the k-th is the threshold unless the (k+1)-th equals it.
  unsigned c32[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) c32[s] = 2 * lane + s < nlist ? lkeys[2 * lane + s] : 0u;
  sort64_desc(c32, lane);
  thr = __shfl_sync(FULL_MASK, ((k - 1) & 1) ? c32[1] : c32[0], (k - 1) >> 1);
  ilast = kIntMax;
  const unsigned kn = __shfl_sync(FULL_MASK, (k & 1) ? c32[1] : c32[0], (k >> 1) & 31);
  if (k < nlist && kn == thr) {
    // A tie across the k-th place: of the listed keys equal to thr, the first k - (count above thr) in
    // index order are selected; ilast is the last of them. Each tied entry ranks itself against the others.
    bool tie[2];
    int idx[2], above = 0;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int i = 2 * lane + s;
      const unsigned key = i < nlist ? lkeys[i] : 0u;
      above += key > thr ? 1 : 0;
      tie[s] = i < nlist && key == thr;
      idx[s] = tie[s] ? lexp[i] : kIntMax;
    }
    const int need = k - __reduce_add_sync(FULL_MASK, above);
    int rk[2] = {0, 0};
#pragma unroll
    for (int s2 = 0; s2 < 2; ++s2) {
      for (unsigned b = __ballot_sync(FULL_MASK, tie[s2]); b != 0u; b &= b - 1u) {
        const int e = __shfl_sync(FULL_MASK, idx[s2], __ffs(b) - 1);
        rk[0] += e < idx[0] ? 1 : 0;
        rk[1] += e < idx[1] ? 1 : 0;
      }
    }
    int found = -1;
#pragma unroll
    for (int s = 0; s < 2; ++s) found = tie[s] && rk[s] == need - 1 ? idx[s] : found;
    ilast = __reduce_max_sync(FULL_MASK, found);
  }
  Team<TEAM>::sync();  // every list read is done
  if (Team<TEAM>::rank() == 0) list[2 * kList] = 0u;
  Team<TEAM>::sync();
}

// Radix select, 4-bit digits from the top (wcnt: 2 * 16 * TEAM/32 words for TEAM > 32). list: 2 * kList + 4
// words, list[2 * kList] zero on entry and exit: once the keys still in play are at most kList, they are
// appended (key, index) to the list in any order and the remaining passes read only the list.
template <int TEAM, bool PREFILTER = true>
__device__ void radix_select(const unsigned* keys, int n, int k, unsigned* wcnt, int* redi, unsigned* list,
                             unsigned& thr, int& ilast) {
  using TM = Team<TEAM>;
  const int r = TM::rank();
  unsigned* lkeys = list;
  int* lexp = reinterpret_cast<int*>(list + kList);
  unsigned* lcount = list + 2 * kList;
  unsigned prefix = 0, mask = 0;
  int need = k, nlist = -1;  // -1: not compacted
  bool done = false;
#ifndef MOE_RT_ROUTER_NO_PREFILTER
  if (PREFILTER && n >= 8 * TEAM && k <= 64) {
    nlist = prefilter_list<TEAM>(keys, n, k, list, redi, IdChunks{});
    if (nlist >= 0) {
      list_select<TEAM>(list, nlist, k, thr, ilast);
      return;
    }
  }
#endif
  for (int shift = 28, pass = 0; shift >= 0; shift -= 4, ++pass) {
    unsigned v[16];
    if (nlist < 0) count_digits(keys, r, n, TEAM, 0, prefix, mask, shift, v);
    else count_digits(lkeys, r, nlist, TEAM, 0, prefix, mask, shift, v);
    unsigned cb;
    if (radix_pick<TEAM>(v, wcnt, pass, shift, need, prefix, mask, &cb)) { done = true; break; }
    if (nlist < 0 && cb <= (unsigned)kList && shift > 0) {
      for (int i = r; i < n; i += TEAM) {
        const unsigned key = keys[i];
        if ((key & mask) == prefix) {
          const unsigned pos = atomicAdd(lcount, 1u);
          lkeys[pos] = key;
          lexp[pos] = i;
        }
      }
      nlist = (int)cb;
      TM::sync();
    }
  }
  thr = prefix;
  if (done) {
    ilast = kIntMax;
  } else if (nlist >= 0) {
    // Ties at the exact k-th key: the need-th lowest index among the listed ties.
    int found = -1;
    for (int i = r; i < nlist; i += TEAM) {
      if (lkeys[i] != prefix) continue;
      const int e = lexp[i];
      int rank = 0;
      for (int u = 0; u < nlist; ++u) rank += (lkeys[u] == prefix && lexp[u] < e) ? 1 : 0;
      if (rank == need - 1) found = e;
    }
    ilast = TM::vmax(found, redi + 16);
  } else {
    // Ties at the exact k-th key: keep the first `need` in index order.
    int run = 0, found = -1;
    for (int base = 0; base < n; base += TEAM) {
      const int i = base + r;
      const bool pred = i < n && keys[i] == prefix;
      int tot;
      const int rk = TM::excl_count(pred, &tot, redi);
      if (pred && run + rk == need - 1) found = i;
      run += tot;
      if (run >= need) break;
    }
    ilast = TM::vmax(found, redi + 16);
  }
  if (nlist >= 0) {
    TM::sync();  // every list read is done
    if (r == 0) *lcount = 0u;
    TM::sync();
  }
}

// PREFILTER = false leaves out the long-row prefilter (short key sets, e.g. group scores: less code).
template <int TEAM, bool PREFILTER = true>
__device__ __forceinline__ void select_topk(const unsigned* keys, int n, int k, unsigned* wcnt, int* redi,
                                            unsigned* list, unsigned& thr, int& ilast) {
  if constexpr (TEAM == 32) {
    if (k <= 8) { argmax_select(keys, n, k, thr, ilast); return; }
  }
  radix_select<TEAM, PREFILTER>(keys, n, k, wcnt, redi, list, thr, ilast);
}

__device__ __forceinline__ int al4(int x) { return (x + 3) & ~3; }

// ---- grouped top-k: group score = sum of the top-m selection scores of the group -----------------------
template <int MM>
__device__ __forceinline__ void insert_top(unsigned (&top)[MM], unsigned key) {
  // compare-exchange down the sorted list (2 MM - 1 min/max, no branches); the smallest falls off
#pragma unroll
  for (int u = 0; u < MM; ++u) {
    const unsigned hi = max(top[u], key);
    if (u + 1 < MM) key = min(top[u], key);
    top[u] = hi;
  }
}

// Merge the sorted top-MM lists of L aligned lanes (xor butterfly): every lane ends with their union's top.
template <int MM>
__device__ __forceinline__ void merge_top_lanes(unsigned (&top)[MM], int L) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    if (off >= L) break;
    unsigned other[MM];
#pragma unroll
    for (int u = 0; u < MM; ++u) other[u] = __shfl_xor_sync(FULL_MASK, top[u], off);
#pragma unroll
    for (int u = 0; u < MM; ++u) {
      // both lists are sorted: for long lists stop at the first key that no longer enters
      if (MM > 4 && other[u] <= top[MM - 1]) break;
      insert_top<MM>(top, other[u]);
    }
  }
}

// Bitonic sort of a segment of L lanes (a power of two, aligned) holding NV values each (NV = 4 or 8),
// element NV * sub + q in v[q]: afterwards in descending order. Each merge starts by comparing mirrored
// elements (i with i ^ (kk - 1)), so every compare keeps the larger value at the lower index: no per-element
// direction.
__device__ __forceinline__ void cas_desc(unsigned& a, unsigned& b) {
  const unsigned hi = max(a, b);
  b = min(a, b);
  a = hi;
}
template <int NV, int KK>
__device__ __forceinline__ void mirror_lane(unsigned (&v)[NV]) {
#pragma unroll
  for (int q = 0; q < NV; ++q)
    if ((q & (KK >> 1)) == 0) cas_desc(v[q], v[q ^ (KK - 1)]);
}
// half-cleaners of distance J, J / 2, ..., 1 inside the lane
template <int NV, int J>
__device__ __forceinline__ void halves_lane(unsigned (&v)[NV]) {
  if constexpr (J >= 1) {
#pragma unroll
    for (int q = 0; q < NV; ++q)
      if ((q & J) == 0) cas_desc(v[q], v[q ^ J]);
    halves_lane<NV, J / 2>(v);
  }
}
template <int NV, int KK = 2>
__device__ __forceinline__ void sort_lane(unsigned (&v)[NV]) {
  mirror_lane<NV, KK>(v);
  halves_lane<NV, KK / 4>(v);
  if constexpr (2 * KK <= NV) sort_lane<NV, 2 * KK>(v);
}
template <int NV>
__device__ __forceinline__ void seg_sort_desc(unsigned (&v)[NV], int L, int sub) {
  static_assert(NV == 4 || NV == 8, "4 or 8 values a lane");
  constexpr int SH = NV == 8 ? 3 : 2;
  sort_lane<NV>(v);
  for (int kk = 2 * NV; kk <= NV * L; kk <<= 1) {
    {  // mirror across lanes: element NV sub + q against NV (sub ^ off) + (q ^ (NV - 1))
      const int off = (kk - 1) >> SH;
      const bool lower = (sub & (kk >> (SH + 1))) == 0;
      unsigned p[NV];
#pragma unroll
      for (int q = 0; q < NV; ++q) p[q] = __shfl_xor_sync(FULL_MASK, v[q ^ (NV - 1)], off);
#pragma unroll
      for (int q = 0; q < NV; ++q) v[q] = lower ? max(v[q], p[q]) : min(v[q], p[q]);
    }
    for (int j = kk >> 2; j >= NV; j >>= 1) {
      const int off = j >> SH;
      const bool lower = (sub & off) == 0;
#pragma unroll
      for (int q = 0; q < NV; ++q) {
        const unsigned p = __shfl_xor_sync(FULL_MASK, v[q], off);
        v[q] = lower ? max(v[q], p) : min(v[q], p);
      }
    }
    halves_lane<NV, NV / 2>(v);
  }
}

// Key of the group score: the sum of the first m (<= MM) values of a sorted top list, in order.
template <int MM>
__device__ __forceinline__ unsigned top_sum(const unsigned (&top)[MM], int m) {
  float s = 0.0f;
#pragma unroll
  for (int u = 0; u < MM; ++u)
    if (u < m) s += fdecode(top[u]);
  return fkey(s);
}

template <int TEAM, int MM>
__device__ void group_scores_reg(const unsigned* keys, int G, int n, int m, unsigned* gkey) {
  const int r = Team<TEAM>::rank();
  if (G <= TEAM) {
    int L = 1;
    while (L < 32 && L * 2 * G <= TEAM) L *= 2;
    const int j = r / L, sub = r % L;
    const bool act = j < G;
    unsigned top[MM];
#pragma unroll
    for (int u = 0; u < MM; ++u) top[u] = 0u;  // real keys are > 0
    if (act)
      for (int e = sub; e < n; e += L) insert_top<MM>(top, keys[j * n + e]);
    merge_top_lanes<MM>(top, L);
    if (act && sub == 0) gkey[j] = top_sum<MM>(top, m);
  } else {
    for (int j = r; j < G; j += TEAM) {
      unsigned top[MM];
#pragma unroll
      for (int u = 0; u < MM; ++u) top[u] = 0u;
      for (int e = 0; e < n; ++e) insert_top<MM>(top, keys[j * n + e]);
      gkey[j] = top_sum<MM>(top, m);
    }
  }
}

// Any m: one thread per group, m rounds of "next in order" (O(m * n); only for m > 8).
template <int TEAM>
__device__ void group_scores_any(const unsigned* keys, int G, int n, int m, unsigned* gkey) {
  for (int j = Team<TEAM>::rank(); j < G; j += TEAM) {
    unsigned pk = 0xffffffffu;
    int pi = -1;
    float s = 0.0f;
    for (int u = 0; u < m; ++u) {
      unsigned bk = 0;
      int bi = kIntMax;
      for (int e = 0; e < n; ++e) {
        const unsigned key = keys[j * n + e];
        const bool after = key < pk || (key == pk && e > pi);
        if (after && (bi == kIntMax || key > bk)) { bk = key; bi = e; }
      }
      s += fdecode(bk);
      pk = bk; pi = bi;
    }
    gkey[j] = fkey(s);
  }
}

// m > 8: the threads of the team split into segments of L lanes (a power of two, one segment per group,
// inside one warp); each segment radix-selects its group's top-m (digit counts in registers, summed over
// the segment with shuffles), then sums the m values in descending order. `scratch` (16 * TEAM words; each
// word it reads is written first, and left zero) holds each segment's sort. Requires G * L <= TEAM and
// 2 * m <= 16 * L (the caller falls back to group_scores_any otherwise).
template <int TEAM>
__device__ void group_scores_seg(const unsigned* keys, int G, int n, int m, int L, unsigned* gkey,
                                 unsigned* gy, unsigned* scratch_all) {
  const int r = Team<TEAM>::rank(), lane = threadIdx.x & 31;
  const int j = r / L, sub = r % L, seg0 = j * L;
  const bool act = j < G;
  const unsigned* gk = keys + (act ? j * n : 0);
  const unsigned segmask = L == 32 ? FULL_MASK : (((1u << L) - 1u) << (lane & ~(L - 1)));
  const int rot = act ? (j * L) % n : 0;  // spreads the segments of a warp over the banks
  unsigned prefix = 0, mask = 0;
  int need = m;
  bool done = !act;
  for (int shift = 28; shift >= 0; shift -= 4) {
    unsigned v[16];
    if (!done) {
      count_digits(gk, sub, n, L, rot, prefix, mask, shift, v);
    } else {
#pragma unroll
      for (int b = 0; b < 16; ++b) v[b] = 0u;
    }
    for (int off = 1; off < L; off <<= 1) {
#pragma unroll
      for (int b = 0; b < 16; ++b) v[b] += __shfl_xor_sync(FULL_MASK, v[b], off);
    }
    if (!done) {
      int above = 0, pb = 0, cb = 0;
      bool hit = false;
#pragma unroll
      for (int b = 15; b >= 0; --b) {
        if (!hit) {
          if (above + (int)v[b] >= need) { pb = b; cb = (int)v[b]; hit = true; }
          else above += (int)v[b];
        }
      }
      need -= above;
      prefix |= (unsigned)pb << shift;
      mask |= 15u << shift;
      if (cb == need) done = true;
    }
    if (__all_sync(FULL_MASK, done)) break;
  }
  // (prefix, il): the group's top-m are the keys > prefix and the first `need` keys == prefix (index order).
  int il = kIntMax;
  const bool ties = act && !done;
  if (__any_sync(FULL_MASK, ties)) {
    int run = 0, found = -1;
    for (int base = 0; base < n; base += L) {
      const int e = base + sub;
      const bool pred = ties && e < n && gk[e] == prefix;
      const unsigned bal = __ballot_sync(FULL_MASK, pred) & segmask;
      const int rk = __popc(bal & ((1u << lane) - 1u));
      if (pred && run + rk == need - 1) found = e;
      run += __popc(bal);
    }
    for (int off = 1; off < L; off <<= 1) found = max(found, __shfl_xor_sync(FULL_MASK, found, off));
    if (ties) il = found;
  }
  // The m selected keys of the group in index order -> scratch[0, m), then by rank -> scratch[m, 2m).
  unsigned* scratch = scratch_all + 16 * seg0;
  int cnt = 0;
  for (int base = 0; base < n; base += L) {
    const int e = base + sub;
    unsigned key = 0;
    bool pred = false;
    if (act && e < n) { key = gk[e]; pred = selected(key, e, prefix, il); }
    const unsigned bal = __ballot_sync(FULL_MASK, pred) & segmask;
    if (pred) scratch[cnt + __popc(bal & ((1u << lane) - 1u))] = key;
    cnt += __popc(bal);
    if (__all_sync(FULL_MASK, !act || cnt >= m)) break;
  }
  __syncwarp();
  for (int i = sub; act && i < m; i += L) {  // reads [0, m), writes [m, 2m)
    const unsigned ki = scratch[i];
    int rk = 0;
    for (int u = 0; u < m; ++u) {
      const unsigned ku = scratch[u];
      rk += (ku > ki || (ku == ki && u < i)) ? 1 : 0;
    }
    scratch[m + rk] = ki;
  }
  __syncwarp();
  if (act && sub == 0) {
    float s = fdecode(scratch[m]);
    for (int u = 1; u < m; ++u) s += fdecode(scratch[m + u]);
    gkey[j] = fkey(s);
    if (gy) gy[j] = scratch[2 * m - 1];
  }
  __syncwarp();
  if (act)
    for (int i = sub; i < 2 * m; i += L) scratch[i] = 0u;
  Team<TEAM>::sync();
}

// m > 8, one warp (TEAM = 32), same segments as group_scores_seg (L lanes per group), groups of n keys with
// n % 4 == 0 and n >= 16 L (16-byte aligned groups, at least 4 chunks of 4 keys per lane). Each lane takes
// the largest key of each of 4 blocks of its chunks; tau, the m-th largest of the segment's 4L block maxima
// (distinct keys of the group), has at least m keys of the group at or above it. Those keys are appended to
// the segment's list in any order (a shared-memory counter in the segment's last scratch word). A list of at
// most 8 keys a lane is sorted in registers across the segment (seg_sort_desc), a longer one placed by rank
// in shared memory; the m largest are summed in descending order (the same sum as group_scores_seg) and
// gy[j] (gy may be null) gets the m-th largest.
// False when some segment lists more than 16L - 4 - m keys (scratch left zero; the caller then runs
// group_scores_seg). Requires m <= 4L. The per-lane top-4 lists and per-key ballots it replaces took about
// 3600 of the 10600 instructions per token of router_fwd<float, 32> at E = 2304 (n = 288, L = 4, m = 9;
// ncu). Kept out of line: inlined, it made the softmax forward of the same kernel slower (bf16 E = 2304:
// 0.662 -> 0.673 ms on the H100).
__device__ __noinline__ bool group_scores_pre(const unsigned* keys, int G, int n, int m, int L, unsigned* gkey,
                                              unsigned* gy, unsigned* scratch_all) {
  const int lane = threadIdx.x & 31;
  const int j = lane / L, sub = lane % L, n4 = n >> 2;
  const bool act = j < G;
  const uint4* g4 = reinterpret_cast<const uint4*>(keys + (act ? j * n : 0));
  unsigned* scratch = scratch_all + 16 * j * L;
  uint4* s4 = reinterpret_cast<uint4*>(scratch);
  unsigned* ctr = scratch + 16 * L - 1;
  const int cap = 16 * L - 4 - m;  // list [0, cnt), ranks [al4(cnt), al4(cnt) + m), counter: the last word
  auto max4 = [](const uint4& v) { return max(max(v.x, v.y), max(v.z, v.w)); };
  unsigned c[4] = {0u, 0u, 0u, 0u};
  if (act) {
    for (int q0 = sub; q0 < n4; q0 += 4 * L) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int q = q0 + u * L;
        if (q < n4) c[u] = max(c[u], max4(g4[q]));
      }
    }
    s4[sub] = make_uint4(c[0], c[1], c[2], c[3]);
  }
  __syncwarp();
  // tau: the largest block maximum with at least m maxima of the segment at or above it
  unsigned tau = 0u;
  if (act) {
    int ge[4] = {0, 0, 0, 0};
    for (int l = 0; l < L; ++l) {
      const uint4 w = s4[l];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        ge[u] += (w.x >= c[u] ? 1 : 0) + (w.y >= c[u] ? 1 : 0) + (w.z >= c[u] ? 1 : 0) + (w.w >= c[u] ? 1 : 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (ge[u] >= m) tau = max(tau, c[u]);
  }
  for (int off = 1; off < L; off <<= 1) tau = max(tau, __shfl_xor_sync(FULL_MASK, tau, off));
  __syncwarp();  // every block maximum is read before they are cleared
  if (act) s4[sub] = make_uint4(0u, 0u, 0u, 0u);
  __syncwarp();
  // Rounds of up to 32 of the lane's chunks: first a bit per chunk holding a key >= tau, then those chunks
  // only, one atomic each (appending inside the scan cost the warp the append path on nearly every chunk).
  if (act) {
    for (int q0 = sub; q0 < n4; q0 += 32 * L) {
      unsigned hit = 0u;
      for (int i = 0; i < 32 && q0 + i * L < n4; ++i) hit |= (max4(g4[q0 + i * L]) >= tau ? 1u : 0u) << i;
      for (; hit != 0u; hit &= hit - 1u) {
        const uint4 v = g4[q0 + (__ffs(hit) - 1) * L];
        const bool h0 = v.x >= tau, h1 = v.y >= tau, h2 = v.z >= tau, h3 = v.w >= tau;
        unsigned pos = atomicAdd(ctr, (h0 ? 1u : 0u) + (h1 ? 1u : 0u) + (h2 ? 1u : 0u) + (h3 ? 1u : 0u));
        if (h0) { if (pos < (unsigned)cap) scratch[pos] = v.x; ++pos; }
        if (h1) { if (pos < (unsigned)cap) scratch[pos] = v.y; ++pos; }
        if (h2) { if (pos < (unsigned)cap) scratch[pos] = v.z; ++pos; }
        if (h3 && pos < (unsigned)cap) scratch[pos] = v.w;
      }
    }
  }
  __syncwarp();
  const int cnt = act ? (int)*ctr : 0, c4 = al4(cnt);
  const bool ok = __all_sync(FULL_MASK, cnt <= cap);
  const bool in_regs = ok && __all_sync(FULL_MASK, cnt <= 8 * L);
  if (in_regs) {
    // The segment's 8L list slots (zero beyond cnt) as 8 registers a lane, sorted in descending order
    // across the segment; the first m summed in that order.
    unsigned v[8];
    const uint4* mine = s4 + 2 * sub;
    const uint4 a = act ? mine[0] : make_uint4(0u, 0u, 0u, 0u), b = act ? mine[1] : make_uint4(0u, 0u, 0u, 0u);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    seg_sort_desc<8>(v, L, sub);
    // The segment's first lane holds the 8 largest (m > 8): it adds its own, then the rest from the next
    // lanes (only the m - 8 needed are shuffled).
    const int seg0 = lane - sub;
    float s = fdecode(v[0]);
#pragma unroll
    for (int q = 1; q < 8; ++q) s += fdecode(v[q]);
    unsigned y = v[7];
    for (int blk = 1; 8 * blk < m; ++blk) {
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        if (8 * blk + q < m) {  // warp-uniform
          const unsigned x = __shfl_sync(FULL_MASK, v[q], seg0 + blk);
          s += fdecode(x);
          y = x;
        }
      }
    }
    if (act && sub == 0) {
      gkey[j] = fkey(s);
      if (gy) gy[j] = y;
    }
  } else if (ok) {
    // Slot r of [c4, c4 + m) gets the key with exactly r larger keys in the list; equal keys share a slot,
    // so an empty slot (0, below every real key) inside the top m repeats the slot before it.
    if (act) {
      for (int i = sub; i < cnt; i += L) {  // reads [0, c4) (zero beyond cnt)
        const unsigned ki = scratch[i];
        int rk = 0;
        for (int u = 0; u < c4; u += 4) {
          const uint4 w = s4[u >> 2];
          rk += (w.x > ki ? 1 : 0) + (w.y > ki ? 1 : 0) + (w.z > ki ? 1 : 0) + (w.w > ki ? 1 : 0);
        }
        if (rk < m) scratch[c4 + rk] = ki;
      }
    }
    __syncwarp();
    if (act && sub == 0) {
      unsigned kp = scratch[c4];
      float s = fdecode(kp);
      for (int u = 1; u < m; ++u) {
        const unsigned ku = scratch[c4 + u];
        kp = ku != 0u ? ku : kp;
        s += fdecode(kp);
      }
      gkey[j] = fkey(s);
      if (gy) gy[j] = kp;
    }
  }
  __syncwarp();
  if (act) {
    const int used = in_regs ? c4 : ok ? al4(c4 + m) : al4(min(cnt, cap));
    for (int q = sub; q < (used >> 2); q += L) s4[q] = make_uint4(0u, 0u, 0u, 0u);
    if (sub == 0) *ctr = 0u;
  }
  __syncwarp();
  return ok;
}

// Element i of a segment sorted by seg_sort_desc (NV values a lane), taken to every lane of the segment.
template <int NV>
__device__ __forceinline__ unsigned seg_elem(const unsigned (&v)[NV], int i, int seg0) {
  // masks, not a select chain: ptxas turned the chain into an indexed load from local memory
  unsigned x = 0u;
#pragma unroll
  for (int q = 0; q < NV; ++q) x |= v[q] & (0u - (unsigned)((i % NV) == q));
  return __shfl_sync(FULL_MASK, x, seg0 + i / NV);
}

// The segment's NV L sorted values: the sum of the first m in descending order (the sum of group_scores_seg)
// and the m-th, both valid in the segment's first lane.
template <int NV>
__device__ __forceinline__ float seg_top_sum(const unsigned (&v)[NV], int m, int seg0, unsigned& y) {
  float s = fdecode(v[0]);
#pragma unroll
  for (int q = 1; q < NV; ++q) s += fdecode(v[q]);  // m > 8 >= NV
  y = v[NV - 1];
  for (int u = NV; u < m; u += NV) {
#pragma unroll
    for (int q = 0; q < NV; ++q) {
      if (u + q < m) {  // warp-uniform
        const unsigned x = __shfl_sync(FULL_MASK, v[q], seg0 + u / NV);
        s += fdecode(x);
        y = x;
      }
    }
  }
  return s;
}

// m > 8, one warp, 8-key chunks (16-bit logits) whose largest keys phase 1 left in cmax (cmax[c]: chunk c of
// the row), groups of nc whole chunks, on segments of L lanes (L G <= 32, m <= 4 L, nc <= kCmaxQ L). Lane sub of
// group j takes the group's chunks sub, sub + L, ... (their maxima held in registers): its 4 largest chunk
// maxima, sorted across the segment, give tau (the m-th largest of those 4 L), so at least m keys of the group
// are >= tau. Only the chunks whose maximum reaches tau are read; their keys >= tau go to the group's list
// (lists + j * cap, any order; cap a multiple of 4, counters ctrs[0, G)), which is sorted in registers (4 or 8
// a lane) to sum the m largest in descending order. gy[j] (gy may be null) gets the m-th largest. False (gkey
// and gy untouched) when some list would pass cap or 8 L keys; the caller then runs group_scores_seg. Kept
// out of line, as group_scores_pre. On H100 (bf16 grouped sigmoid at E = 2304, T = 65536): 780 -> 670 us
// with prefilter_cmax and the 32-bit list_select, against group_scores_pre.
constexpr int kCmaxQ = 12;
__device__ __noinline__ bool group_scores_cmax(const unsigned* keys, const unsigned* cmax, int G, int nc, int m,
                                               int L, unsigned* gkey, unsigned* gy, unsigned* lists, int cap,
                                               unsigned* ctrs) {
  const int lane = threadIdx.x & 31, lg = __ffs(L) - 1;
  const int j = lane >> lg, sub = lane & (L - 1), seg0 = lane - sub;
  const bool act = j < G;
  const unsigned* cm = cmax + (act ? j * nc : 0);
  const unsigned* gk = keys + (act ? 8 * j * nc : 0);
  unsigned* list = lists + (act ? j * cap : 0);
  if (act && sub == 0) ctrs[j] = 0u;
  const int nq = act ? (nc - sub + L - 1) >> lg : 0;  // this lane's chunks
  unsigned c[kCmaxQ], t[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < kCmaxQ; ++i) c[i] = i < nq ? cm[sub + i * L] : 0u;
#pragma unroll
  for (int i = 0; i < kCmaxQ; ++i)
    if (i < nq) insert_top<4>(t, c[i]);
  seg_sort_desc<4>(t, L, sub);
  const unsigned tau = seg_elem<4>(t, m - 1, seg0);
  __syncwarp();  // the counters are zero
  // a bit per chunk of this lane that reaches tau, then those chunks only, then their keys >= tau only
  unsigned hit = 0u;
#pragma unroll
  for (int i = 0; i < kCmaxQ; ++i) hit |= (i < nq && c[i] >= tau ? 1u : 0u) << i;
  for (; hit != 0u; hit &= hit - 1u) {
    const unsigned* ck = gk + 8 * (sub + (__ffs(hit) - 1) * L);
    const uint4 a = reinterpret_cast<const uint4*>(ck)[0], b = reinterpret_cast<const uint4*>(ck)[1];
    const unsigned kv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    unsigned bits = 0u;
#pragma unroll
    for (int v = 0; v < 8; ++v) bits |= (kv[v] >= tau ? 1u : 0u) << v;
    unsigned pos = atomicAdd(ctrs + j, (unsigned)__popc(bits));
    for (; bits != 0u; bits &= bits - 1u, ++pos)
      if (pos < (unsigned)cap) list[pos] = ck[__ffs(bits) - 1];
  }
  __syncwarp();
  const int cnt = act ? (int)ctrs[j] : 0;
  const int cmaxn = __reduce_max_sync(FULL_MASK, cnt);
  if (cmaxn > cap || cmaxn > 8 * L) return false;
  float s;
  unsigned y;
  if (cmaxn <= 4 * L) {
    unsigned v[4];
    const uint4 a = act && 4 * sub < cnt ? reinterpret_cast<const uint4*>(list)[sub] : make_uint4(0u, 0u, 0u, 0u);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = 4 * sub + q < cnt ? v[q] : 0u;
    seg_sort_desc<4>(v, L, sub);
    s = seg_top_sum<4>(v, m, seg0, y);
  } else {
    unsigned v[8];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c0 = 8 * sub + 4 * h;
      const uint4 a = act && c0 < cnt ? reinterpret_cast<const uint4*>(list)[2 * sub + h] : make_uint4(0u, 0u, 0u, 0u);
      v[4 * h] = a.x; v[4 * h + 1] = a.y; v[4 * h + 2] = a.z; v[4 * h + 3] = a.w;
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = 8 * sub + q < cnt ? v[q] : 0u;
    seg_sort_desc<8>(v, L, sub);
    s = seg_top_sum<8>(v, m, seg0, y);
  }
  if (act && sub == 0) {
    gkey[j] = fkey(s);
    if (gy) gy[j] = y;
  }
  __syncwarp();
  return true;
}

// gkey[j]: the key of group j's score. Where m > 8 and the groups fit the team's segments, also gy[j] (gy may
// be null): the m-th largest key of group j, so that each group has at least m keys >= gy[j]; returns
// whether gy was written. SMALLM (a quick kernel for m <= 8): the top 8 kept for every m, whose first m are
// the top m (the same keys summed in the same order: the same bits), and no code for m > 8.
template <int TEAM, bool SMALLM = false>
__device__ __forceinline__ bool group_scores(const unsigned* keys, int G, int n, int m, unsigned* gkey,
                                             unsigned* gy, unsigned* hist) {
  if constexpr (SMALLM) {
    group_scores_reg<TEAM, 8>(keys, G, n, m, gkey);
    return false;
  }
  if (m == 1) group_scores_reg<TEAM, 1>(keys, G, n, m, gkey);
  else if (m == 2) group_scores_reg<TEAM, 2>(keys, G, n, m, gkey);
  else if (m <= 4) group_scores_reg<TEAM, 4>(keys, G, n, m, gkey);
  else if (m <= 8) group_scores_reg<TEAM, 8>(keys, G, n, m, gkey);
  else {
    int L = 1;
    while (L < 32 && L * 2 * G <= TEAM) L *= 2;
    if (G <= TEAM && 2 * m <= 16 * L) {
#ifndef MOE_RT_ROUTER_NO_PREFILTER
      if constexpr (TEAM == 32) {
        if (m <= 4 * L && (n & 3) == 0 && n >= 16 * L && group_scores_pre(keys, G, n, m, L, gkey, gy, hist))
          return gy != nullptr;
      }
#endif
      group_scores_seg<TEAM>(keys, G, n, m, L, gkey, gy, hist);
      return gy != nullptr;
    }
    group_scores_any<TEAM>(keys, G, n, m, gkey);
  }
  return false;
}

// ---- shared-memory layout of one token slot (in 32-bit words; mirrored in moe_rt/router.py) ----------
struct Layout {
  int keys, gkey, hist, wcnt, red, wcount, wlist, list, lidx, lkey, lw, lp, total;
};

// The layout's common tail from word `list` on: radix list, then the K selected experts, keys, weights.
template <typename LT>
__device__ __forceinline__ void layout_tail(LT& L, int list, int K) {
  const int Kp = al4(K);
  L.list = list;
  L.lidx = L.list + 2 * kList + 4;
  L.lkey = L.lidx + Kp;
  L.lw = L.lkey + Kp;
  L.lp = L.lw + Kp;
  L.total = L.lp + Kp;
}

template <int TEAM>
__device__ __forceinline__ Layout slot_layout(int E, int G, int K) {
  constexpr int NW = TEAM / 32;
  Layout L;
  const int Kp = al4(K);
  L.keys = 0;
  L.gkey = L.keys + al4(E);
  L.hist = L.gkey + al4(G);
  L.wcnt = L.hist + 16 * TEAM;
  L.red = L.wcnt + 32 * NW;
  L.wcount = L.red + 64;
  L.wlist = L.wcount + 16;
  layout_tail(L, L.wlist + NW * Kp, K);
  return L;
}

// Phase 6 for one 16-byte chunk (experts e0 .. e0 + CH - 1; bit v of sel: expert e0 + v is selected): the
// routing map, zero probs and the -inf post-softmax intermediate (each pointer may be null: not written).
template <typename T, int CH>
__device__ __forceinline__ void dense_chunk_out(unsigned sel, int e0, i64 row, bool* __restrict__ rmap,
                                                T* __restrict__ probs, float* __restrict__ inter) {
  if (rmap) {
    // bit v -> byte v: sel * (1 + 2^7 + 2^14 + 2^21) puts bit v at bit 8v with no two terms overlapping
    auto bytes4 = [](unsigned b) { return (b * 0x204081u) & 0x01010101u; };
    if constexpr (CH == 4) {
      *reinterpret_cast<unsigned*>(rmap + row + e0) = bytes4(sel);
    } else if constexpr (CH == 8) {
      *reinterpret_cast<uint2*>(rmap + row + e0) = make_uint2(bytes4(sel & 15u), bytes4(sel >> 4));
    } else {
#pragma unroll
      for (int v = 0; v < CH; ++v) rmap[row + e0 + v] = (sel >> v) & 1u;
    }
  }
  if (probs) {
    alignas(16) T z[CH];
#pragma unroll
    for (int v = 0; v < CH; ++v) z[v] = from_float<T>(0.0f);
    stn<CH>(probs + row + e0, z);
  }
  if (inter) {
    alignas(16) float z[CH];
#pragma unroll
    for (int v = 0; v < CH; ++v) z[v] = -kInf;
    stn<CH>(inter + row + e0, z);
  }
}

// Bit v: expert e0 + v is selected. The tie rule is applied only when the selection left ilast set (keys
// equal to thr may then lie after ilast); otherwise `key >= thr` alone selects.
template <int CH>
__device__ __forceinline__ unsigned chunk_selection(const unsigned (&kv)[CH], int e0, unsigned thr, int il) {
  unsigned sel = 0u;
  if (il == kIntMax) {
#pragma unroll
    for (int v = 0; v < CH; ++v) sel |= kv[v] >= thr ? 1u << v : 0u;
  } else {
#pragma unroll
    for (int v = 0; v < CH; ++v) sel |= selected(kv[v], e0 + v, thr, il) ? 1u << v : 0u;
  }
  return sel;
}

template <typename T, int CH>
__device__ __forceinline__ void dense_chunk_out(const unsigned (&kv)[CH], int e0, unsigned thr, int il, i64 row,
                                                bool* __restrict__ rmap, T* __restrict__ probs,
                                                float* __restrict__ inter) {
  dense_chunk_out<T, CH>(rmap ? chunk_selection<CH>(kv, e0, thr, il) : 0u, e0, row, rmap, probs, inter);
}

// The bit-packed routing map (BITMAP kernels): row t is ceil(E / 8) bytes, bit e % 8 of byte e / 8 (LSB
// first), padding bits 0; every byte is written by one thread with one store (no two threads share a byte).
// One chunk's CH selection bits (sel; chunk c = experts c * CH ..): with CH = 8 its byte. With CH = 4 lanes
// 2i and 2i + 1 hold chunks c and c + 1 of one byte, so every lane of the warp calls this (sel = 0 and
// in_row = false past the row) and the even lane stores both halves.
template <int CH>
__device__ __forceinline__ void bitmap_chunk_out(unsigned sel, int c, bool in_row, unsigned char* __restrict__ brow) {
  static_assert(CH == 4 || CH == 8, "4- or 8-expert chunks");
  if constexpr (CH == 8) {
    if (in_row) brow[c] = (unsigned char)sel;
  } else {
    const unsigned hi = __shfl_down_sync(FULL_MASK, sel, 1);
    if (in_row && (c & 1) == 0) brow[c >> 1] = (unsigned char)(sel | (hi << 4));
  }
}

// The whole bit-packed row from the keys in shared memory (the selection rule over keys whose unselected
// groups were zeroed): thread r of the team takes bytes r, r + TEAM, ...
template <int TEAM>
__device__ __forceinline__ void bitmap_from_keys(const unsigned* keys, int E, unsigned thr, int il, int r,
                                                 unsigned char* __restrict__ brow) {
  const int nb = (E + 7) >> 3;
  for (int b = r; b < nb; b += TEAM) {
    unsigned byte = 0u;
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const int e = 8 * b + v;
      if (e < E && selected(keys[e], e, thr, il)) byte |= 1u << v;
    }
    brow[b] = (unsigned char)byte;
  }
}

// Segments of W lanes (router_fwd_reg with W < 32: 32 / W tokens a warp, one 16-byte chunk a lane). The lane
// within the segment, the segment's lanes as a mask, and its butterfly sum and max. Every lane of the warp
// calls these together (xor offsets below W stay within a segment). They give the bits warp_sum / warp_max
// give over 32 lanes whose lanes past the segment's hold 0 / -inf: the first 32-lane step adds +0 (max:
// -inf), which turns -0 into +0 and drops a NaN; later such steps change nothing.
template <int W>
__device__ __forceinline__ int seg_lane() { return (int)(threadIdx.x & 31) & (W - 1); }
template <int W>
__device__ __forceinline__ unsigned seg_mask() {
  return W == 32 ? FULL_MASK : ((1u << (W & 31)) - 1u) << ((threadIdx.x & 31) & ~(unsigned)(W - 1));
}
template <int W>
__device__ __forceinline__ float seg_sum(float v) {
  if constexpr (W == 32) {
    return warp_sum(v);
  } else {
    v += 0.0f;
#pragma unroll
    for (int m = W / 2; m > 0; m >>= 1) v += __shfl_xor_sync(FULL_MASK, v, m);
    return v;
  }
}
template <int W>
__device__ __forceinline__ float seg_max(float v) {
  if constexpr (W == 32) {
    return warp_max(v);
  } else {
    v = fmaxf(v, -kInf);
#pragma unroll
    for (int m = W / 2; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, m));
    return v;
  }
}

// Expert id v at slot i of an index output of idx_bytes-byte integers (2, 4 or 8).
__device__ __forceinline__ void store_idx(void* __restrict__ p, int idx_bytes, i64 i, int v) {
  if (idx_bytes == 4) static_cast<int*>(p)[i] = v;
  else if (idx_bytes == 2) static_cast<short*>(p)[i] = (short)v;
  else static_cast<i64*>(p)[i] = v;
}

// The K weights of token t from its selection in index order (lidx, lkey): one warp (or segment of W lanes,
// K <= W), two per lane, fixed order. Writes lw (the probs before the cast), lp (post-softmax intermediate) and the compact outputs
// (topk_idx of idx_bytes-byte ints; topk_w may be null: the indices alone).
template <int W = 32>
__device__ __forceinline__ void topk_weights(i64 t, int K, int score_fn, int pre_softmax, float scale,
                                             const float* __restrict__ bias, const int* lidx, const unsigned* lkey,
                                             float* lw, float* lp, void* __restrict__ topk_idx, int idx_bytes,
                                             float* __restrict__ topk_w) {
  const int lane = seg_lane<W>();
  const int j0 = lane, j1 = lane + 32;
  // h1 only when K > 32 (warp-uniform). The divisions run on the lanes holding a selection only.
  const bool h0 = j0 < K, h1 = K > 32 && j1 < K;
  const float x0 = h0 ? fdecode(lkey[j0]) : 0.0f, x1 = h1 ? fdecode(lkey[j1]) : 0.0f;
  float w0 = 0.0f, w1 = 0.0f, q0 = 0.0f, q1 = 0.0f;
  if (score_fn == SOFTMAX) {
    if (pre_softmax) {
      w0 = scale * x0; w1 = scale * x1;
    } else {
      const float mx = seg_max<W>(fmaxf(h0 ? x0 : -kInf, h1 ? x1 : -kInf));
      const float e0 = h0 ? expf(x0 - mx) : 0.0f, e1 = h1 ? expf(x1 - mx) : 0.0f;
      const float rs = 1.0f / seg_sum<W>(e0 + e1);
      q0 = e0 * rs; q1 = e1 * rs;
      w0 = scale * q0; w1 = scale * q1;
    }
  } else {
    float p0 = 0.0f, p1v = 0.0f;
    if (h0) p0 = bias ? x0 - bias[lidx[j0]] : x0;
    if (h1) p1v = bias ? x1 - bias[lidx[j1]] : x1;
    if (K > 1) {
      const float den = seg_sum<W>(p0 + p1v) + kEps;
      // __fdividef: p * rcp(den), within 2 ulp for den below 2^126 (a sum of at most 64 sigmoid or
      // sqrt-softplus values); the IEEE division cost about 20 instructions a token (H100, grouped bf16
      // E = 256: 74.7 -> 73.4 us)
      if (h0) w0 = scale * __fdividef(p0, den);
      if (h1) w1 = scale * __fdividef(p1v, den);
    } else {
      w0 = scale * p0; w1 = scale * p1v;
    }
  }
  if (h0) { lw[j0] = w0; lp[j0] = q0; }
  if (h1) { lw[j1] = w1; lp[j1] = q1; }
  if (topk_idx) {
    if (h0) store_idx(topk_idx, idx_bytes, t * K + j0, lidx[j0]);
    if (h1) store_idx(topk_idx, idx_bytes, t * K + j1, lidx[j1]);
    if (topk_w) {
      if (h0) topk_w[t * K + j0] = w0;
      if (h1) topk_w[t * K + j1] = w1;
    }
  }
}

// The k selected experts of a row (the team's selection (thr, il) over keys[0, E)) in index order -> lidx/lkey.
// One warp: ballots over the row. Larger teams: each warp lists the selected experts of its share of the row
// (wlist: NW * Kp words, wcount: NW words), then each thread r < k places the r-th by the warps' counts. r: the
// thread's rank in the team, lane and warp its lane and warp in the team.
template <int TEAM>
__device__ __forceinline__ void selected_in_order(const unsigned* keys, int E, int K, int Kp, unsigned thr, int il,
                                                  int* lidx, unsigned* lkey, int* wlist, int* wcount, int r, int lane,
                                                  int warp) {
  if constexpr (TEAM == 32) {
    int cnt = 0;
    for (int b0 = 0; b0 < E && cnt < K; b0 += 32) {
      const int i = b0 + lane;
      const unsigned key = i < E ? keys[i] : 0u;
      const bool pred = i < E && selected(key, i, thr, il);
      const unsigned bal = __ballot_sync(FULL_MASK, pred);
      if (pred) {
        const int pos = cnt + __popc(bal & ((1u << lane) - 1u));
        lidx[pos] = i;
        lkey[pos] = key;
      }
      cnt += __popc(bal);
    }
    __syncwarp();
  } else {
    constexpr int NW = TEAM / 32;
    const int R = ((E + NW - 1) / NW + 31) & ~31;
    const int lo = warp * R, hi = min(E, lo + R);
    int cnt = 0;
    for (int b0 = lo; b0 < hi && cnt < K; b0 += 32) {
      const int i = b0 + lane;
      const bool pred = i < hi && selected(keys[i], i, thr, il);
      const unsigned bal = __ballot_sync(FULL_MASK, pred);
      if (pred) wlist[warp * Kp + cnt + __popc(bal & ((1u << lane) - 1u))] = i;
      cnt += __popc(bal);
    }
    if (lane == 0) wcount[warp] = cnt;
    __syncthreads();
    if (r < K) {
      int j = r, w = 0;
      while (j >= wcount[w]) { j -= wcount[w]; ++w; }
      const int i = wlist[w * Kp + j];
      lidx[r] = i;
      lkey[r] = keys[i];
    }
    __syncthreads();
  }
}

// ---- row in registers (one warp per token) ----------------------------------------------------------
// Lane l holds the 16-byte chunks c = l + 32 j (j < NJ = V / CH) of the row: register q = j * CH + v is
// expert (l + 32 j) * CH + v; chunks c >= E / CH hold key 0 (below every real key) and are never counted.
template <int CH>
__device__ __forceinline__ int reg_expert(int lane, int q) { return (lane + 32 * (q / CH)) * CH + q % CH; }

// Iterative warp argmax over the registers (small k): each lane caches its best two keys; a lane that
// wins twice without a fresh cache rescans its registers for the two next ones. Lane r < k also gets the
// r-th winner (wk, wi) (key descending, then index ascending). W < 32: over each segment's lanes (k <= W).
template <int V, int CH, int W = 32>
__device__ __forceinline__ void argmax_reg(const unsigned (&key)[V], int k, unsigned& thr, int& ilast,
                                           unsigned& wk, int& wi) {
  const int lane = seg_lane<W>();
  const unsigned mask = seg_mask<W>();
  unsigned b0k = 0, b1k = 0;
  int b0i = kIntMax, b1i = kIntMax;
#pragma unroll
  for (int q = 0; q < V; ++q) {
    const unsigned kk = key[q];
    const int e = reg_expert<CH>(lane, q);
    if (kk > b0k) { b1k = b0k; b1i = b0i; b0k = kk; b0i = e; }
    else if (kk > b1k) { b1k = kk; b1i = e; }
  }
  bool stale = false;
  for (int round = 0;; ++round) {
    const unsigned mk = __reduce_max_sync(mask, b0k);
    const int mi = (int)__reduce_min_sync(mask, b0k == mk ? (unsigned)b0i : (unsigned)kIntMax);
    if (lane == round) { wk = mk; wi = mi; }
    if (round == k - 1) { thr = mk; ilast = mi; return; }
    if (b0i == mi) {
      if (!stale) {
        b0k = b1k; b0i = b1i; b1k = 0; b1i = kIntMax;
        stale = true;
      } else {
        b0k = 0; b1k = 0; b0i = kIntMax; b1i = kIntMax;
#pragma unroll
        for (int q = 0; q < V; ++q) {
          const unsigned kk = key[q];
          const int e = reg_expert<CH>(lane, q);
          if (kk < mk || (kk == mk && e > mi)) {
            if (kk > b0k) { b1k = b0k; b1i = b0i; b0k = kk; b0i = e; }
            else if (kk > b1k) { b1k = kk; b1i = e; }
          }
        }
        stale = false;
      }
    }
  }
}

// argmax_reg for the keys of bf16 logits (fkey of a float whose low 16 bits are zero: the key's low half is
// all zeros or all ones). (high half, 0xffff - expert) packs key and tie rule into one distinct word, so a
// round takes one max reduction and no index compare. Same results as argmax_reg; requires E <= 65536.
template <int V, int CH, int W = 32>
__device__ __forceinline__ void argmax_reg_bf16(const unsigned (&key)[V], int k, unsigned& thr, int& ilast,
                                                unsigned& wk, int& wi) {
  const int lane = seg_lane<W>();
  const unsigned mask = seg_mask<W>();
  auto pack = [&](int q) { return (key[q] & 0xffff0000u) | (0xffffu - (unsigned)reg_expert<CH>(lane, q)); };
  // the key back from its high half (0xffff: NaN, whose key is all ones)
  auto key_of = [](unsigned p) {
    const unsigned h = p & 0xffff0000u;
    return h == 0xffff0000u ? 0xffffffffu : ((h & 0x80000000u) ? h : (h | 0xffffu));
  };
  auto expert_of = [](unsigned p) { return (int)(0xffffu - (p & 0xffffu)); };
  unsigned b0 = 0u, b1 = 0u;  // this lane's two largest packed words not yet taken
  auto top2 = [&](unsigned p) {
    b1 = max(b1, min(p, b0));
    b0 = max(b0, p);
  };
#pragma unroll
  for (int q = 0; q < V; ++q) top2(pack(q));
  bool stale = false;  // b1 no longer known
  unsigned mine = 0u;  // lane r: the r-th winner, packed (decoded once, after the rounds)
  for (int round = 0;; ++round) {
    const unsigned mk = __reduce_max_sync(mask, b0);
    if (lane == round) mine = mk;
    if (round == k - 1) {
      thr = key_of(mk);
      ilast = expert_of(mk);
      if (lane < k) { wk = key_of(mine); wi = expert_of(mine); }
      return;
    }
    if (b0 == mk) {
      if (!stale) {
        b0 = b1;
        b1 = 0u;
        stale = true;
      } else {
        b0 = 0u;
        b1 = 0u;
#pragma unroll
        for (int q = 0; q < V; ++q) {
          const unsigned p = pack(q);
          if (p < mk) top2(p);
        }
        stale = false;
      }
    }
  }
}

// Sorts 8 words in descending order (19 compare-exchanges).
__device__ __forceinline__ void sort8_desc(unsigned (&s)[8]) {
  auto ce = [&](int i, int j) { const unsigned hi = max(s[i], s[j]); s[j] = min(s[i], s[j]); s[i] = hi; };
  ce(0, 2); ce(1, 3); ce(4, 6); ce(5, 7);
  ce(0, 4); ce(1, 5); ce(2, 6); ce(3, 7);
  ce(0, 1); ce(2, 3); ce(4, 5); ce(6, 7);
  ce(2, 4); ce(3, 5);
  ce(1, 4); ce(3, 6);
  ce(1, 2); ce(3, 4); ce(5, 6);
}

__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int o = __shfl_up_sync(FULL_MASK, v, d);
    if (lane >= d) v += o;
  }
  return v;
}

// Calls visit(position, key, expert) for the registers where pred(key, expert) holds, positions counted in
// index order (chunk round, lane, v); stops after the chunk round that reaches `limit`. Returns the count.
template <int V, int CH, typename Pred, typename Visit>
__device__ __forceinline__ int compact_reg(const unsigned (&key)[V], int nch, int limit, Pred pred, Visit visit) {
  const int lane = threadIdx.x & 31;
  int run = 0;
#pragma unroll
  for (int j = 0; j < V / CH; ++j) {
    if (run < limit) {
      const bool valid = lane + 32 * j < nch;
      int c = 0;
#pragma unroll
      for (int v = 0; v < CH; ++v) c += (valid && pred(key[j * CH + v], reg_expert<CH>(lane, j * CH + v))) ? 1 : 0;
      if (__any_sync(FULL_MASK, c > 0)) {
        const int incl = warp_inclusive_scan(c);
        int pos = run + incl - c;
#pragma unroll
        for (int v = 0; v < CH; ++v) {
          const int e = reg_expert<CH>(lane, j * CH + v);
          if (valid && pred(key[j * CH + v], e)) visit(pos++, key[j * CH + v], e);
        }
        run += __shfl_sync(FULL_MASK, incl, 31);
      }
    }
  }
  return run;
}

// Top-k (k <= 8) over 8 registers a lane (V = 8): each lane's keys sorted, each round's max reduction
// takes the largest head key and every lane holding it drops it, until k keys are taken: thr, the k-th key.
// ilast = kIntMax when no key equal to thr is left out (then `key >= thr` alone selects), else the index
// of the last one taken in index order. Same selection as argmax_reg. The selection goes in index order
// to (lkey, lidx), its bits per chunk round to selm. (Sorting argmax_reg_bf16's packed words instead was
// 8% slower than its rounds for bf16 post-softmax at E = 256.) s: the lane's keys sorted in descending order
// (sort8_desc; the caller may have sorted them for the group keys), consumed.
template <int CH>
__device__ __forceinline__ void select_reg8(const unsigned (&key)[8], unsigned (&s)[8], int k, unsigned* lkey,
                                            int* lidx, unsigned& thr, int& ilast, unsigned (&selm)[8 / CH]) {
  constexpr int NJ = 8 / CH;
  const int lane = threadIdx.x & 31;
  // At most k <= 8 rounds (each takes at least one key), unrolled: after round r (from 0) at most 7 - r rounds
  // follow, which read at most s[0 .. 6 - r], so only those are shifted (28 selects in all, not 56). Deeper
  // entries go stale; s[1] is read after the last round only to detect ties, and a stale entry there (a key
  // already taken, never below thr) at most sends the row down the exact tie path.
  int taken = 0;
  unsigned mk = 0u;
  bool win = false;
#pragma unroll
  for (int rd = 0; rd < 8; ++rd) {
    mk = __reduce_max_sync(FULL_MASK, s[0]);
    win = s[0] == mk;
    taken += __popc(__ballot_sync(FULL_MASK, win));
    if (taken >= k) break;
#pragma unroll
    for (int q = 0; q < 7 - rd; ++q) s[q] = win ? s[q + 1] : s[q];
  }
  // No key equal to thr is left out when exactly k were taken and no winner's next key equals thr (the
  // other lanes hold only smaller keys). Real keys are > 0: the zero keys of padding and masked groups
  // never count.
  thr = mk;
  ilast = kIntMax;
  if (taken != k || __any_sync(FULL_MASK, win && s[1] == mk)) {
    // ties at thr: the first `need` equal keys in index order (chunk round, lane, v)
    int ge = 0, eq = 0;
#pragma unroll
    for (int q = 0; q < 8; ++q) { ge += key[q] >= thr ? 1 : 0; eq += key[q] == thr ? 1 : 0; }
    const int tot = (int)__reduce_add_sync(FULL_MASK, (unsigned)ge);
    const int need = k - (tot - (int)__reduce_add_sync(FULL_MASK, (unsigned)eq));
    int found = -1;
    compact_reg<8, CH>(key, 32 * NJ, need, [&](unsigned kk, int) { return kk == thr; },
                       [&](int pos, unsigned, int e) { if (pos == need - 1) found = e; });
    ilast = __reduce_max_sync(FULL_MASK, found);
  }
  // the selection in index order: per-lane bit masks, a warp scan of their counts
  int run = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    unsigned kv[CH];
#pragma unroll
    for (int v = 0; v < CH; ++v) kv[v] = key[j * CH + v];
    const unsigned sel = chunk_selection<CH>(kv, reg_expert<CH>(lane, j * CH), thr, ilast);
    selm[j] = sel;
    const int c = __popc(sel);
    const int incl = warp_inclusive_scan(c);
    unsigned* kp = lkey + (run + incl - c);
    int* ip = lidx + (run + incl - c);
#pragma unroll
    for (int v = 0; v < CH; ++v)
      if ((sel >> v) & 1u) { *kp++ = key[j * CH + v]; *ip++ = reg_expert<CH>(lane, j * CH + v); }
    run += __shfl_sync(FULL_MASK, incl, 31);
  }
}

// Radix select over the registers (same rule and result as radix_select<32>). list: 2 * kList words. As
// soon as the keys still in play (those matching the prefix) are at most kList, they are compacted with
// their experts into `list` and the remaining passes read only the list.

template <int V, int CH>
__device__ __forceinline__ void radix_select_reg(const unsigned (&key)[V], int nch, int k, unsigned* list,
                                                 unsigned& thr, int& ilast) {
  static_assert(V <= 255, "8-bit digit counters");
  const int lane = threadIdx.x & 31;
  unsigned prefix = 0, mask = 0;
  int need = k, nlist = -1;  // -1: not compacted
  unsigned* lkeys = list;
  int* lexp = reinterpret_cast<int*>(list + kList);
  for (int shift = 28, pass = 0; shift >= 0; shift -= 4, ++pass) {
    unsigned v[16];
    if (nlist < 0) {
      unsigned pk[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int b = 0; b < 16; ++b) v[b] = 0u;
#pragma unroll
      for (int q = 0; q < V; ++q)
        if (lane + 32 * (q / CH) < nch && (key[q] & mask) == prefix) digit_add(pk, (key[q] >> shift) & 15u);
      digit_drain(pk, v);
    } else {
      count_digits(lkeys, lane, nlist, 32, 0, prefix, mask, shift, v);
    }
    unsigned cb;
    if (radix_pick<32>(v, nullptr, pass, shift, need, prefix, mask, &cb)) { thr = prefix; ilast = kIntMax; return; }
    if (nlist < 0 && cb <= (unsigned)kList && shift > 0) {
      // Compact the keys matching the new prefix, in index order (chunk round, lane, v).
      const int run = compact_reg<V, CH>(
          key, nch, kList, [&](unsigned kk, int) { return (kk & mask) == prefix; },
          [&](int pos, unsigned kk, int e) { lkeys[pos] = kk; lexp[pos] = e; });
      nlist = run;
      __syncwarp();
    }
  }
  // Ties at the exact k-th key: the first `need` in index order.
  thr = prefix;
  int found = -1;
  if (nlist >= 0) {  // the list is in index order
    int run = 0;
    for (int base = 0; base < nlist && run < need; base += 32) {
      const int i = base + lane;
      const bool pred = i < nlist && lkeys[i] == prefix;
      const unsigned bal = __ballot_sync(FULL_MASK, pred);
      if (pred && run + __popc(bal & ((1u << lane) - 1u)) == need - 1) found = lexp[i];
      run += __popc(bal);
    }
  } else {  // chunk round, then lane, then v
    compact_reg<V, CH>(key, nch, need, [&](unsigned kk, int) { return kk == prefix; },
                       [&](int pos, unsigned, int e) { if (pos == need - 1) found = e; });
  }
  ilast = __reduce_max_sync(FULL_MASK, found);
  __syncwarp();
}

// Group scores from the registers when every chunk lies in one group and a group's chunks are S aligned
// lanes of one chunk round (n % CH == 0, S = n / CH a power of two <= 32), m <= MM <= 8: each lane takes the
// top-MM of its chunk, the S lanes merge their lists with shuffles, and the first lane of each group writes
// gkey (same sum, in the same order, as group_scores_reg).
template <int V, int CH, int MM>
__device__ __forceinline__ unsigned chunk_group_key(const unsigned (&key)[V], int j, int S, int m) {
  unsigned top[MM];
#pragma unroll
  for (int u = 0; u < MM; ++u) top[u] = 0u;
#pragma unroll
  for (int v = 0; v < CH; ++v) insert_top<MM>(top, key[j * CH + v]);
  merge_top_lanes<MM>(top, S);
  return top_sum<MM>(top, m);  // every lane of the group gets its group's key
}

template <int V, int CH, int MM>
__device__ __forceinline__ void group_scores_lanes(const unsigned (&key)[V], int nch, int S, int m, unsigned* gkey) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < V / CH; ++j) {
    const int c = lane + 32 * j;
    const unsigned gk = chunk_group_key<V, CH, MM>(key, j, S, m);
    if (c < nch && (c & (S - 1)) == 0) gkey[c / S] = gk;
  }
}

// Lane l < G holds group l's key (G <= 32, the whole warp calls): the bit mask of the g groups first in the
// order (key desc, index asc), the ones select_topk picks. g rounds of one max reduction: the lowest lane
// holding the largest key still in play is taken (every key is nonzero; lane = group index).
__device__ __forceinline__ unsigned rank_groups(unsigned mine, int G, int g) {
  const int lane = threadIdx.x & 31;
  bool avail = lane < G;
  unsigned taken = 0u;
  for (int r = 0; r < g; ++r) {
    const unsigned mk = __reduce_max_sync(FULL_MASK, avail ? mine : 0u);
    const unsigned b = __ballot_sync(FULL_MASK, avail && mine == mk);
    const unsigned w = b & (0u - b);
    taken |= w;
    avail = avail && !((w >> lane) & 1u);
  }
  return taken;
}

// The same group-limited selection as group_scores_lanes + select_topk + the mask, kept in registers when
// there are at most 32 groups: returns the bit mask of the g selected groups (top g by group key, ties
// to the lower group index, exactly as select_topk picks them). Lane l < G ranks group l against every
// group key with G shuffles; one ballot gathers the mask.
template <int V, int CH, int MM>
__device__ __forceinline__ unsigned group_mask_lanes(const unsigned (&key)[V], int S, int sh, int m, int G,
                                                     int g) {
  constexpr int NJ = V / CH;
  const int lane = threadIdx.x & 31;
  unsigned gk[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) gk[j] = chunk_group_key<V, CH, MM>(key, j, S, m);
  const int c0 = lane << sh;  // the first chunk of group `lane`
  unsigned mine = 0u;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const unsigned t = __shfl_sync(FULL_MASK, gk[j], c0 & 31);
    if ((c0 >> 5) == j) mine = t;
  }
  return rank_groups(mine, G, g);
}

// group_mask_lanes for one chunk of 8 keys a lane (V = CH = 8) already sorted in descending order: the lane's
// top-MM list is the head of s (the same list insert_top builds, so the same group keys and mask).
template <int MM>
__device__ __forceinline__ unsigned group_mask_sorted8(const unsigned (&s)[8], int S, int sh, int m, int G, int g) {
  const int lane = threadIdx.x & 31;
  unsigned top[MM];
#pragma unroll
  for (int u = 0; u < MM; ++u) top[u] = s[u];
  merge_top_lanes<MM>(top, S);
  const unsigned gk = top_sum<MM>(top, m);
  const int c0 = lane << sh;  // the first chunk of group `lane`
  const unsigned t = __shfl_sync(FULL_MASK, gk, c0 & 31);
  return rank_groups(c0 < 32 ? t : 0u, G, g);
}

struct RegLayout {
  int keys, gkey, hist, list, lidx, lkey, lw, lp, total;
};

// Shared memory of one token slot of router_fwd_reg (32-bit words; mirrored in moe_rt/router.py). The
// row's keys are staged in shared memory only for the group scores.
template <bool LANESEL>
__device__ __forceinline__ RegLayout reg_layout(int E, int G, int K) {
  RegLayout L;
  if constexpr (LANESEL) {  // the selected experts, keys and weights only
    const int Kp = al4(K);
    L.keys = L.gkey = L.hist = L.list = L.lidx = 0;
    L.lkey = Kp;
    L.lw = 2 * Kp;
    L.lp = 3 * Kp;
    L.total = 4 * Kp;
    return L;
  }
  L.keys = 0;
  L.gkey = G > 0 ? al4(E) : 0;
  L.hist = L.gkey + al4(G);
  layout_tail(L, L.hist + 16 * 32, K);
  return L;
}

// f(j, c) for the chunk rounds j < NJ whose chunk c = lane + 32 j lies in the row (nch chunks).
template <int NJ, int W = 32, typename F>
__device__ __forceinline__ void for_chunks(int nch, F f) {
  const int lane = seg_lane<W>();
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if (lane + 32 * j < nch) f(j, lane + 32 * j);
}

// Shared-memory pointers of one token slot (either layout).
struct SlotPtrs {
  unsigned *keys, *gkey, *hist, *list, *lkey;
  int* lidx;
  float *lw, *lp;
};

template <typename LT>
__device__ __forceinline__ SlotPtrs slot_ptrs(unsigned* base, const LT& L) {
  SlotPtrs P;
  P.keys = base + L.keys;
  P.gkey = base + L.gkey;
  P.hist = base + L.hist;
  P.list = base + L.list;
  P.lidx = reinterpret_cast<int*>(base + L.lidx);
  P.lkey = base + L.lkey;
  P.lw = reinterpret_cast<float*>(base + L.lw);
  P.lp = reinterpret_cast<float*>(base + L.lp);
  return P;
}

// ---- phase 1, compiled per score function -------------------------------------------------------------
// One element: the selection key of logit x (b: its bias); iv: the intermediate (the logit for softmax and
// sqrtsoftplus, sigmoid(x) for sigmoid); pmax (softmax) and psum (aux, sigmoid-like) accumulate.
// ARITH: keys of sigmoid values (and of biased values) by fkey_arith (false: fkey's NaN test kept; bf16
// grouped sigmoid at E = 2304 on the H100: 670 us with the test, 662 without).
template <int SF, bool AUX, bool BIAS, bool ARITH = true>
__device__ __forceinline__ unsigned p1_elem(float x, float b, float& iv, float& pmax, float& psum) {
  if constexpr (SF == SOFTMAX) {
    pmax = fmaxf(pmax, x);
    iv = x;
    return fkey(x);
  } else {
    const float a = SF == SIGMOID ? sigmoid_fwd(x) : sqrtsoftplusf(x);
    iv = SF == SIGMOID ? a : x;
    // sigmoid_fwd ends in a MUFU reciprocal and the bias in an add: canonical NaNs (fkey_arith). sqrtsoftplusf
    // without a bias keeps the NaN test (sqrtf's special-case path).
    if constexpr (AUX) {
      psum += a;
      return ARITH && SF == SIGMOID ? fkey_arith(a) : fkey(a);
    } else {
      return ARITH && (SF == SIGMOID || BIAS) ? fkey_arith(BIAS ? a + b : a) : fkey(BIAS ? a + b : a);
    }
  }
}

// Calls f.template run<SF, AUX, BIAS>() for the runtime score function, aux mode and bias flag, so that each
// phase-1 loop is compiled for one case. With the score function switched per element the unrolled bf16
// loop carried every function's code, and its fetches missed the instruction cache (ncu, router_fwd<bf16>
// at E=2304: 40% of the stall samples waiting for instructions).
// SFO >= 0 (a quick kernel, see router_fwd): only that case is compiled, in the order of the branches below
// (0 softmax; 1, 2, 3 sigmoid aux, bias, plain; 4, 5, 6 sqrtsoftplus aux, bias, plain); the host launches
// it for that case alone.
template <int SFO = -1, typename F>
__device__ __forceinline__ void with_score_fn(int score_fn, bool aux, bool use_bias, F& f) {
  if constexpr (SFO == 0) {
    f.template run<SOFTMAX, false, false>();
  } else if constexpr (SFO == 1) {
    f.template run<SIGMOID, true, false>();
  } else if constexpr (SFO == 2) {
    f.template run<SIGMOID, false, true>();
  } else if constexpr (SFO == 3) {
    f.template run<SIGMOID, false, false>();
  } else if constexpr (SFO == 4) {
    f.template run<SQRTSOFTPLUS, true, false>();
  } else if constexpr (SFO == 5) {
    f.template run<SQRTSOFTPLUS, false, true>();
  } else if constexpr (SFO == 6) {
    f.template run<SQRTSOFTPLUS, false, false>();
  } else if (score_fn == SOFTMAX) {
    f.template run<SOFTMAX, false, false>();
  } else if (score_fn == SIGMOID) {
    if (aux) f.template run<SIGMOID, true, false>();
    else if (use_bias) f.template run<SIGMOID, false, true>();
    else f.template run<SIGMOID, false, false>();
  } else {
    if (aux) f.template run<SQRTSOFTPLUS, true, false>();
    else if (use_bias) f.template run<SQRTSOFTPLUS, false, true>();
    else f.template run<SQRTSOFTPLUS, false, false>();
  }
}

// Phase 1 of router_fwd on 16-byte rows: TEAM threads, U chunks loaded before the first is used.
template <typename T, int TEAM, int U>
struct Phase1Vec {
  static constexpr int CH = 16 / (int)sizeof(T);
  const T* __restrict__ lrow;
  const float* __restrict__ bias;
  unsigned* keys;
  float* __restrict__ irow;  // intermediate row, written for sigmoid-like functions (may be null)
  unsigned* cmax;            // one warp, 8-key chunks: each chunk's largest key (may be null)
  int nch, r;
  float &pmax, &psum;
  template <int SF, bool AUX, bool BIAS>
  __device__ __forceinline__ void run() {
    for (int c0 = r; c0 < nch; c0 += U * TEAM) {
      alignas(16) T xv[U][CH];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + u * TEAM < nch) ldn<CH>(lrow + (i64)(c0 + u * TEAM) * CH, xv[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * TEAM;
        if (c < nch) {
          alignas(16) unsigned kv[CH];
          alignas(16) float iv[CH], bv[CH];
          if constexpr (BIAS) ldn<CH>(bias + c * CH, bv);
#pragma unroll
          for (int v = 0; v < CH; ++v)
            kv[v] = p1_elem<SF, AUX, BIAS>(elem_f(xv[u], v), BIAS ? bv[v] : 0.0f, iv[v], pmax, psum);
          stn<CH>(keys + c * CH, kv);
          if (SF != SOFTMAX && irow != nullptr) stn<CH>(irow + (i64)c * CH, iv);
          if constexpr (TEAM == 32 && CH == 8) {
            if (cmax != nullptr)
              cmax[c] = max(max(max(kv[0], kv[1]), max(kv[2], kv[3])), max(max(kv[4], kv[5]), max(kv[6], kv[7])));
          }
        }
      }
    }
  }
};

// Phase 1 of router_fwd_reg: the row's NJ chunks in registers (xv) -> keys in registers (key).
template <typename T, int NJ>
struct Phase1Reg {
  static constexpr int CH = 16 / (int)sizeof(T);
  const T (&xv)[NJ][CH];
  unsigned (&key)[NJ * CH];
  const float* __restrict__ bias;
  float* __restrict__ irow;  // as in Phase1Vec
  int nch, lane;
  float &pmax, &psum;
  template <int SF, bool AUX, bool BIAS>
  __device__ __forceinline__ void run() {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int c = lane + 32 * j;
      if (c < nch) {
        alignas(16) float bv[CH];
        if constexpr (BIAS) ldn<CH>(bias + c * CH, bv);
        alignas(16) float iv[CH];
#pragma unroll
        for (int v = 0; v < CH; ++v)
          key[j * CH + v] = p1_elem<SF, AUX, BIAS>(elem_f(xv[j], v), BIAS ? bv[v] : 0.0f, iv[v], pmax, psum);
        if (SF != SOFTMAX && irow != nullptr) stn<CH>(irow + (i64)c * CH, iv);
      } else {
#pragma unroll
        for (int v = 0; v < CH; ++v) key[j * CH + v] = 0u;
      }
    }
  }
};

}  // namespace

// ---- forward: top-k with score function, or (aux_mode) the dense scores for the aux loss --------------
// probs/scores/rmap/inter/topk_idx/topk_w may be null (not written). vec: all pointers 16-byte aligned
// and E % (16 / sizeof(T)) == 0. G = 0: no grouping; GROUPS = false compiles the kernel without it (G = 0 only:
// the softmax forward of one warp measured up to 2.6% slower with the group code in the kernel). BITMAP: rmap
// is the bit-packed map (uint8 [T, ceil(E / 8)], bitmap_chunk_out). topk_idx: idx_bytes-byte ints (2, 4, 8).
// SFO >= 0: a quick kernel (moe_rt/_jit.py, tiered compiles), the same bits for the one score case SFO
// (with_score_fn) with phase 1 unrolled less: the first call of a shape runs it while the kernel for every
// case compiles in the background (a sixth to a third of the compile time: bf16 without groups at E = 2304
// 1.2 against 6.1 s on one CPU core). SMALLK (a quick kernel with groups, for K <= 8 only): compiled without
// the paths of K > 8 (group scores of m = K / g > 8, the chunk-maxima group scores and the in-place group
// prefilter): the same bits for K <= 8 in about two thirds of the compile time (fp32, E = 1024, sigmoid with
// a bias: 2.0 against 3.1 s on one CPU core).
template <typename T, int TEAM, bool GROUPS = true, bool BITMAP = false, int SFO = -1, bool SMALLK = false>
__global__ void __launch_bounds__(TEAM == 32 ? 128 : TEAM, MOE_RT_FWD_MINB(TEAM))
router_fwd(const T* __restrict__ logits, i64 num_tokens, int E, int K, int score_fn, int pre_softmax,
           int aux_mode, int G, int g, int m, unsigned gmagic, float scale, const float* __restrict__ bias,
           T* __restrict__ probs, float* __restrict__ scores, bool* __restrict__ rmap,
           float* __restrict__ inter, void* __restrict__ topk_idx, float* __restrict__ topk_w, int vec, int gcm,
           int idx_bytes) {
  using TM = Team<TEAM>;
  constexpr int SPB = TEAM == 32 ? 4 : 1;
  constexpr int CH = 16 / (int)sizeof(T);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int slot = threadIdx.x / TEAM, r = threadIdx.x % TEAM, lane = threadIdx.x & 31, warp = r >> 5;
  const Layout L = slot_layout<TEAM>(E, G, K);
  unsigned* base = reinterpret_cast<unsigned*>(smem_raw) + (size_t)slot * L.total;
  const SlotPtrs P = slot_ptrs(base, L);
  unsigned *keys = P.keys, *gkey = P.gkey, *hist = P.hist, *list = P.list, *lkey = P.lkey;
  int* lidx = P.lidx;
  float *lw = P.lw, *lp = P.lp;
  unsigned* wcnt = base + L.wcnt;
  float* red = reinterpret_cast<float*>(base + L.red);
  int* redi = reinterpret_cast<int*>(base + L.red + 32);
  int* wcount = reinterpret_cast<int*>(base + L.wcount);
  int* wlist = reinterpret_cast<int*>(base + L.wlist);
  // gcm != 0 (set by the host where group_scores_cmax applies): group scores from phase 1's chunk maxima,
  // cmax at hist[0, nch), then the groups' lists of cm_cap keys (the counters in the reduction scratch, unused
  // by one warp until phase 2's gdelta); cm_L lanes a group.
  const int cm_cap = gcm & 0xffff, cm_L = gcm >> 16;
  static_assert(!SMALLK || (SFO >= 0 && GROUPS && TEAM == 32), "SMALLK: a quick kernel of one warp with groups");
  // (the host sets gcm only where m > 8: never with K <= 8)
  const bool cm_groups = TEAM == 32 && GROUPS && !SMALLK && CH == 8 && cm_cap != 0;
  if (!cm_groups) {
#pragma unroll
    for (int b = 0; b < 16; ++b) hist[b * TEAM + r] = 0u;
  }
  if (r == 0) list[2 * kList] = 0u;

  const bool sig_like = score_fn != SOFTMAX;
  const bool post = !aux_mode && score_fn == SOFTMAX && !pre_softmax;
  const bool dense_norm = aux_mode || (score_fn == SOFTMAX && pre_softmax);
  const int nch = vec ? E / CH : 0;
  const int Kp = al4(K);
  // the byte map the dense outputs write (none in a BITMAP kernel: its bytes are written apart)
  bool* const bmap = BITMAP ? nullptr : rmap;
  const i64 nbytes = (E + 7) >> 3;

  for (i64 t = (i64)blockIdx.x * SPB + slot; t < num_tokens; t += (i64)gridDim.x * SPB) {
    const i64 row = t * (i64)E;
    float pmax = -kInf, psum = 0.0f;
    // Phase 1: activations, intermediate (sigmoid-like), selection keys.
    // b: the expert's bias (read only when there is one). Rows that are not 16-byte vectors keep this
    // per-element switch: compiled per score function like Phase1Vec, router_fwd<T, 512> spilled more
    // registers (bf16 aux scores at E = 16384: 4.8% slower on the H100).
    auto p1 = [&](float x, float b, float& iv) -> unsigned {
      if (score_fn == SOFTMAX) {
        pmax = fmaxf(pmax, x);
        iv = x;
        return fkey(x);
      }
      const float a = score_fn == SIGMOID ? sigmoid_fwd(x) : sqrtsoftplusf(x);
      iv = score_fn == SIGMOID ? a : x;
      if (aux_mode) { psum += a; return fkey(a); }
      return fkey(bias ? a + b : a);
    };
    const bool use_bias = bias != nullptr && sig_like && !aux_mode;
    const bool write_inter1 = inter != nullptr && sig_like;
    if (vec) {
      constexpr int U = TEAM != 32 || SFO >= 0 ? MOE_RT_FWD_U
                        : sizeof(T) == 2 && GROUPS ? MOE_RT_FWD_U_32_H_G : MOE_RT_FWD_U_32;
      Phase1Vec<T, TEAM, U> ph{
          logits + row, bias, keys, write_inter1 ? inter + row : nullptr, cm_groups ? hist : nullptr, nch, r, pmax, psum};
      with_score_fn<SFO>(score_fn, aux_mode, use_bias, ph);
    } else {
      for (int e = r; e < E; e += TEAM) {
        float iv;
        keys[e] = p1(to_float(logits[row + e]), use_bias ? bias[e] : 0.0f, iv);
        if (write_inter1) inter[row + e] = iv;
      }
    }
    // Dense normalization: softmax over all E (pre-softmax, aux) or v / (sum v + eps) (aux sigmoid-like).
    if (dense_norm) {
      float mul;
      if (score_fn == SOFTMAX) {
        const float M = TM::max(pmax, red);
        psum = 0.0f;
        if (vec) {
          for (int c = r; c < nch; c += TEAM) {
            alignas(16) unsigned kv[CH];
            ldn<CH>(keys + c * CH, kv);
#pragma unroll
            for (int v = 0; v < CH; ++v) {
              const float ex = expf(fdecode(kv[v]) - M);
              psum += ex;
              kv[v] = __float_as_uint(ex);
            }
            stn<CH>(keys + c * CH, kv);
          }
        } else {
          for (int e = r; e < E; e += TEAM) {
            const float ex = expf(fdecode(keys[e]) - M);
            psum += ex;
            keys[e] = __float_as_uint(ex);
          }
        }
        mul = 1.0f / TM::sum(psum, red);
      } else {
        mul = TM::sum(psum, red) + kEps;
      }
      auto p1c = [&](unsigned k) -> float {
        return score_fn == SOFTMAX ? __uint_as_float(k) * mul : fdecode(k) / mul;
      };
      float* drow = aux_mode ? scores : inter;  // dense output of the normalized scores
      const bool wi = aux_mode && score_fn == SOFTMAX && inter != nullptr;
      if (vec) {
        for (int c = r; c < nch; c += TEAM) {
          alignas(16) unsigned kv[CH];
          alignas(16) float av[CH];
          ldn<CH>(keys + c * CH, kv);
#pragma unroll
          for (int v = 0; v < CH; ++v) { av[v] = p1c(kv[v]); kv[v] = fkey(av[v]); }
          stn<CH>(keys + c * CH, kv);
          if (drow) stn<CH>(drow + row + (i64)c * CH, av);
          if (wi) stn<CH>(inter + row + (i64)c * CH, av);
        }
      } else {
        for (int e = r; e < E; e += TEAM) {
          const float a = p1c(keys[e]);
          keys[e] = fkey(a);
          if (drow) drow[row + e] = a;
          if (wi) inter[row + e] = a;
        }
      }
    }
    TM::sync();

    // Phase 2: group-limited selection. One warp on 16-byte rows whose chunks each lie in one group (at most 32
    // groups, k > 8) leaves the keys in place: the top-k prefilter reads only the selected groups' chunks and
    // phase 4 drops the other groups' (gsel: their bit mask). Otherwise (or when the prefilter's list
    // overflows) the other groups' keys are zeroed and phase 3 selects over the whole row.
    unsigned thr, gsel = 0u;
    int il;
    if (GROUPS && G > 0) {
      const int n = E / G;
      // gy (one warp, at most 32 groups): each group's m-th largest key, in the second half of the reduction
      // scratch (the first half takes gdelta below)
      unsigned* gy = reinterpret_cast<unsigned*>(red) + 32;
      bool have_y, cm_ok = false;  // cm_ok: the chunk maxima are still in hist
      if (cm_groups) {
        have_y = true;
        cm_ok = group_scores_cmax(keys, hist, G, n >> 3, m, cm_L, gkey, gy, hist + al4(nch), cm_cap,
                                  reinterpret_cast<unsigned*>(red));
        if (!cm_ok) group_scores_seg<TEAM>(keys, G, n, m, cm_L, gkey, gy, hist);
      } else {
        have_y = group_scores<TEAM, SMALLK>(keys, G, n, m, gkey, TEAM == 32 && G <= 32 ? gy : nullptr, hist);
      }
      TM::sync();
      // the selected groups: by rank in one warp with at most 32 groups (gm: their bit mask), else select_topk
      unsigned gthr = 0u, gm = 0u;
      int gil = 0;
      const bool by_rank = TEAM == 32 && G <= 32;
      if (by_rank) gm = rank_groups(lane < G ? gkey[lane] : 0u, G, g);
      else select_topk<TEAM, false>(gkey, G, g, wcnt, redi, list, gthr, gil);
      auto gin = [&](int j) { return by_rank ? ((gm >> j) & 1u) != 0u : selected(gkey[j], j, gthr, gil); };
      if constexpr (TEAM == 32 && !SMALLK) {
        if (by_rank && vec && K > 8 && n % CH == 0 && g * n >= 8 * TEAM) {
          const bool in = (gm >> lane) & 1u;
          int* gdelta = reinterpret_cast<int*>(red);  // the reduction scratch, unused by one warp
          if (in) {
            const int rk = __popc(gm & ((1u << lane) - 1u));
            gdelta[rk] = (lane - rk) * (n >> 2);
          }
          // The selected groups hold g m = K keys at or above the least of their gy: the prefilter's bound.
          const unsigned tau0 = have_y ? __reduce_min_sync(FULL_MASK, in ? gy[lane] : 0xffffffffu) : 0u;
          __syncwarp();
          const int nl = cm_ok ? prefilter_cmax(keys, hist, g * (n >> 3), list, gdelta, gmagic, tau0)
                               : prefilter_list<32>(keys, g * n, K, list, redi, GroupChunks{gdelta, gmagic}, tau0);
          if (nl >= 0) {
            list_select<32>(list, nl, K, thr, il);
            gsel = gm;
          }
        }
      }
      if (gsel == 0u) {
        if ((n & 3) == 0) {  // 4 keys at a time, all of one group
          uint4* keys4 = reinterpret_cast<uint4*>(keys);
          for (int c = r; c < (E >> 2); c += TEAM) {
            const int j = (int)__umulhi((unsigned)(4 * c), gmagic);
            if (!gin(j)) keys4[c] = make_uint4(0u, 0u, 0u, 0u);
          }
        } else {
          for (int e = r; e < E; e += TEAM) {
            const int j = n == 1 ? e : (int)__umulhi((unsigned)e, gmagic);
            if (!gin(j)) keys[e] = 0u;
          }
        }
      }
      TM::sync();
    }

    // Phase 3: top-k.
    if (gsel == 0u) select_topk<TEAM>(keys, E, K, wcnt, redi, list, thr, il);

    // Phase 4: the selected experts in index order -> lidx/lkey. One warp on 16-byte rows does phase 6's
    // dense outputs in the same pass: rounds of 32 chunks (lane order = index order), each lane's selected
    // experts placed by a warp scan of the lanes' counts.
    const bool wprobs = !aux_mode && probs != nullptr, winter = post && inter != nullptr;
    const bool dense_done = TEAM == 32 && vec;
    // A lane takes P keys a round: 8 where the row (and each group) is whole 8-key units, so that fp32 rows
    // run half the rounds of 4-key chunks (H100, fp32 E = 2304 softmax: 775 -> 735 us).
    auto dense_pass = [&](auto pk) {
      constexpr int P = decltype(pk)::value;
      const int np = E / P;
      int cnt = 0;
      for (int b0 = 0; b0 < np; b0 += 32) {
        const int c = b0 + lane;
        alignas(16) unsigned kv[P];
        unsigned sel = 0u;
        if (c < np) {
          ldn<P>(keys + c * P, kv);
          sel = chunk_selection<P>(kv, c * P, thr, il);
          if (GROUPS && gsel != 0u && !((gsel >> __umulhi((unsigned)(c * P), gmagic)) & 1u)) sel = 0u;
          dense_chunk_out<T, P>(sel, c * P, row, bmap, wprobs ? probs : nullptr, winter ? inter : nullptr);
        }
        if constexpr (BITMAP) {
          if (rmap) bitmap_chunk_out<P>(sel, c, c < np, reinterpret_cast<unsigned char*>(rmap) + t * nbytes);
        }
        // This lane's first position: a ballot when no lane has two selected experts, else a warp scan.
        const unsigned lanes = __ballot_sync(FULL_MASK, sel != 0u);
        int excl, tot;
        if (__any_sync(FULL_MASK, (sel & (sel - 1u)) != 0u)) {
          const int n = __popc(sel);
          const int incl = warp_inclusive_scan(n);
          excl = incl - n;
          tot = __shfl_sync(FULL_MASK, incl, 31);
        } else {
          excl = __popc(lanes & ((1u << lane) - 1u));
          tot = __popc(lanes);
        }
        if (!aux_mode && sel) {
          // only the set bits (a lane rarely has more than one; a loop over all P bits cost ~600
          // instructions per token at E=2304)
          int pos = cnt + excl;
          for (unsigned b = sel; b != 0u; b &= b - 1u, ++pos) {
            const int e = c * P + __ffs(b) - 1;
            if (pos < K) { lidx[pos] = e; lkey[pos] = keys[e]; }
          }
        }
        cnt += tot;
      }
      __syncwarp();
    };
    if (dense_done) {
      if constexpr (CH == 8) {
        dense_pass(IC<8>{});
      } else {
        if (E % 8 == 0 && (G == 0 || (E / G) % 8 == 0)) dense_pass(IC<8>{});
        else dense_pass(IC<CH>{});
      }
    } else {
      selected_in_order<TEAM>(keys, E, K, Kp, thr, il, lidx, lkey, wlist, wcount, r, lane, warp);
    }

    // Phase 5: the K weights (warp 0 of the team).
    if (!aux_mode && warp == 0)
      topk_weights(t, K, score_fn, pre_softmax, scale, bias, lidx, lkey, lw, lp, topk_idx, idx_bytes, topk_w);
    TM::sync();

    // Phase 6: dense outputs: map, zero probs (-inf intermediate for post-softmax), then the K values.
    if (rmap || wprobs || winter) {
      if (dense_done) {
        // written with phase 4
      } else if (vec) {
        for (int c = r; c < nch; c += TEAM) {
          alignas(16) unsigned kv[CH];
          ldn<CH>(keys + c * CH, kv);
          dense_chunk_out<T, CH>(kv, c * CH, thr, il, row, bmap, wprobs ? probs : nullptr, winter ? inter : nullptr);
        }
      } else {
        for (int e = r; e < E; e += TEAM) {
          if (bmap) bmap[row + e] = selected(keys[e], e, thr, il);
          if (wprobs) probs[row + e] = from_float<T>(0.0f);
          if (winter) inter[row + e] = -kInf;
        }
      }
      if constexpr (BITMAP) {
        if (rmap && !dense_done)
          bitmap_from_keys<TEAM>(keys, E, thr, il, r, reinterpret_cast<unsigned char*>(rmap) + t * nbytes);
      }
      if (wprobs || winter) {
        TM::sync();  // orders the fill before the patch (same block)
        for (int j = r; j < K; j += TEAM) {
          const int e = lidx[j];
          if (wprobs) probs[row + e] = from_float<T>(lw[j]);
          if (winter) inter[row + e] = lp[j];
        }
      }
    }
    TM::sync();
  }
}

namespace {

// The rows of a register kernel (one warp a token, 4 tokens a block, `stride` tokens apart): lane `lane` holds
// chunks lane + 32 j (j < NJ) of 16 bytes. PREFETCH (small rows): the next token's chunks are loaded while
// this one is processed. (router_fwd_reg keeps the same steps inline: written with this struct, its code
// changed (H100 SASS 128-256 bytes longer), unmeasured.)
template <typename T, int NJ, bool PREFETCH>
struct RegRows {
  static constexpr int CH = 16 / (int)sizeof(T);
  const T* __restrict__ logits;
  i64 num_tokens, stride;
  int E, nch, lane;
  alignas(16) T next[NJ][CH];
  __device__ __forceinline__ void load(i64 tt, T (&xv)[NJ][CH]) const {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (lane + 32 * j < nch) ldn<CH>(logits + tt * (i64)E + (i64)(lane + 32 * j) * CH, xv[j]);
  }
  // before the first token t0
  __device__ __forceinline__ void start(i64 t0) {
    if (PREFETCH && t0 < num_tokens) load(t0, next);
  }
  // token t's chunks into xv
  __device__ __forceinline__ void get(i64 t, T (&xv)[NJ][CH]) {
    if constexpr (PREFETCH) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int v = 0; v < CH; ++v) xv[j][v] = next[j][v];
      if (t + stride < num_tokens) load(t + stride, next);
    } else {
      load(t, xv);
    }
  }
};

}  // namespace

// ---- forward with the row in registers: one warp per token (or per segment of W lanes), 4 warps a block ----
// Same parameters, outputs and bits as router_fwd<T, 32>; requires vec and E / CH <= 32 * V / CH. GROUPS =
// false: compiled without the group-limited selection (G = 0 only), which frees registers. LANESEL = true
// (V = 8): compiled for one path alone, the group-limited selection held in the lanes (at most 32 groups,
// each on a power-of-two count of aligned lanes, k / g <= 8) and select_reg8 (k <= 8); no aux mode; its
// shared memory holds only the K selected experts, keys and weights. BITMAP: as in router_fwd. SFO >= 0: a
// quick kernel for the one score case SFO (router_fwd, with_score_fn). W < 32 (short rows: V = CH, no groups,
// k <= W, k <= 8, E / CH <= W): a token on each segment of W lanes, so a warp takes 32 / W tokens at once
// (one chunk a lane, the same bits: seg_sum); the segments past the last token repeat it (the same values
// written to the same places, in the same warp).
template <typename T, int V, bool GROUPS = true, bool LANESEL = false, bool BITMAP = false, int SFO = -1, int W = 32>
__global__ void __launch_bounds__(128, W < 32 ? MOE_RT_FWD_REG_MINB_SEG : MOE_RT_FWD_REG_MINB(V, T, GROUPS, LANESEL))
router_fwd_reg(const T* __restrict__ logits, i64 num_tokens, int E, int K, int score_fn, int pre_softmax,
               int aux_mode, int G, int g, int m, unsigned gmagic, float scale, const float* __restrict__ bias,
               T* __restrict__ probs, float* __restrict__ scores, bool* __restrict__ rmap,
               float* __restrict__ inter, void* __restrict__ topk_idx, float* __restrict__ topk_w, int vec,
               int /* gcm: router_fwd's */, int idx_bytes) {
  constexpr int CH = 16 / (int)sizeof(T);
  constexpr int NJ = V / CH;
  static_assert(NJ * CH == V, "V must be a multiple of the chunk size");
  static_assert(!LANESEL || (V == 8 && GROUPS), "LANESEL: 8 keys a lane, with groups");
  static_assert(W == 32 || (NJ == 1 && !GROUPS && W >= 4 && W <= 16), "segments: one chunk a lane, no groups");
  constexpr int S = 32 / W;                // tokens a warp at once
  constexpr bool kSlim = LANESEL || W < 32;  // shared memory: the selected experts, keys and weights only
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int seg = (int)(threadIdx.x & 31) / W, lane = seg_lane<W>();
  const int slot = (int)(threadIdx.x >> 5) * S + seg;
  const RegLayout L = reg_layout<kSlim>(E, G, K);
  const SlotPtrs P = slot_ptrs(reinterpret_cast<unsigned*>(smem_raw) + (size_t)slot * L.total, L);
  unsigned *skeys = P.keys, *gkey = P.gkey, *hist = P.hist, *list = P.list, *lkey = P.lkey;
  int* lidx = P.lidx;
  float *lw = P.lw, *lp = P.lp;
  if constexpr (!kSlim) {
#pragma unroll
    for (int b = 0; b < 16; ++b) hist[b * 32 + lane] = 0u;
    if (lane == 0) list[2 * kList] = 0u;
  }

  const bool sig_like = score_fn != SOFTMAX;
  const bool post = !aux_mode && score_fn == SOFTMAX && !pre_softmax;
  const bool dense_norm = aux_mode || (score_fn == SOFTMAX && pre_softmax);
  const bool use_bias = bias != nullptr && sig_like && !aux_mode;
  const int nch = E / CH;
  const int gn = G > 0 ? E / G : 1, gS = gn / CH;  // group size in experts and in chunks

  // Small rows: the next token's logits are loaded while this one is processed.
  constexpr bool kPrefetch = V <= 16;
  const i64 stride = (i64)gridDim.x * 4 * S;
  auto load_row = [&](i64 tt, T (&xv)[NJ][CH]) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (lane + 32 * j < nch) ldn<CH>(logits + tt * (i64)E + (i64)(lane + 32 * j) * CH, xv[j]);
  };
  // the token of this segment in the round whose warp tokens start at tw (W < 32: the last one past the end)
  auto token = [&](i64 tw) { return W == 32 ? tw : min(tw + seg, num_tokens - 1); };
  const i64 tw0 = ((i64)blockIdx.x * 4 + (threadIdx.x >> 5)) * S;
  alignas(16) T xnext[NJ][CH];
  if (kPrefetch && tw0 < num_tokens) load_row(token(tw0), xnext);

  for (i64 tw = tw0; tw < num_tokens; tw += stride) {
    const i64 t = token(tw);
    const i64 row = t * (i64)E;
    unsigned key[V];
    float pmax = -kInf, psum = 0.0f;
    {
      alignas(16) T xv[NJ][CH];
      if constexpr (kPrefetch) {
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int v = 0; v < CH; ++v) xv[j][v] = xnext[j][v];
        if (tw + stride < num_tokens) load_row(token(tw + stride), xnext);
      } else {
        load_row(t, xv);
      }
      // Phase 1: activations, intermediate (sigmoid-like), selection keys.
      Phase1Reg<T, NJ> ph{xv, key, bias, inter != nullptr ? inter + row : nullptr, nch, lane, pmax, psum};
      with_score_fn<SFO>(score_fn, aux_mode, use_bias, ph);
    }
    // Dense normalization: softmax over all E (pre-softmax, aux) or v / (sum v + eps) (aux sigmoid-like).
    if (dense_norm) {
      float mul;
      if (score_fn == SOFTMAX) {
        const float M = seg_max<W>(pmax);
        psum = 0.0f;
#pragma unroll
        for (int q = 0; q < V; ++q) {
          if (lane + 32 * (q / CH) < nch) {
            const float ex = expf(fdecode(key[q]) - M);
            psum += ex;
            key[q] = __float_as_uint(ex);
          }
        }
        mul = 1.0f / seg_sum<W>(psum);
      } else {
        mul = seg_sum<W>(psum) + kEps;
      }
      float* drow = aux_mode ? scores : inter;
      const bool wi = aux_mode && score_fn == SOFTMAX && inter != nullptr;
      for_chunks<NJ, W>(nch, [&](int j, int c) {
        alignas(16) float av[CH];
#pragma unroll
        for (int v = 0; v < CH; ++v) {
          const unsigned kk = key[j * CH + v];
          av[v] = score_fn == SOFTMAX ? __uint_as_float(kk) * mul : fdecode(kk) / mul;
          key[j * CH + v] = fkey(av[v]);
        }
        if (drow) stn<CH>(drow + row + (i64)c * CH, av);
        if (wi) stn<CH>(inter + row + (i64)c * CH, av);
      });
    }

    // Phase 2: group-limited selection mask: in registers (group_mask_lanes) when every chunk lies in one
    // group, a group's chunks are S aligned lanes and there are at most 32 groups; otherwise group scores
    // from the registers or from the keys staged in shared memory, then select_topk over them.
    // s8: the lane's keys sorted for select_reg8. With one chunk of 8 keys a lane (LANESEL, 16-bit logits)
    // they are sorted before the group mask, whose top lists are then their heads.
    unsigned s8[8];
    constexpr bool kSortFirst = LANESEL && CH == 8;
    if constexpr (kSortFirst) {
#pragma unroll
      for (int q = 0; q < 8; ++q) s8[q] = key[q];
      sort8_desc(s8);
    }
    if (GROUPS && G > 0) {
      const int n = gn, S = gS;
      const bool lanes = m <= 8 && n % CH == 0 && S <= 32 && (S & (S - 1)) == 0;
      if (LANESEL || (lanes && G <= 32)) {
        const int sh = __ffs(S) - 1;
        unsigned gm;
        if constexpr (kSortFirst) {
          if (m == 1) gm = group_mask_sorted8<1>(s8, S, sh, m, G, g);
          else if (m == 2) gm = group_mask_sorted8<2>(s8, S, sh, m, G, g);
          else if (m <= 4) gm = group_mask_sorted8<4>(s8, S, sh, m, G, g);
          else gm = group_mask_sorted8<8>(s8, S, sh, m, G, g);
        } else {
          if (m == 1) gm = group_mask_lanes<V, CH, 1>(key, S, sh, m, G, g);
          else if (m == 2) gm = group_mask_lanes<V, CH, 2>(key, S, sh, m, G, g);
          else if (m <= 4) gm = group_mask_lanes<V, CH, 4>(key, S, sh, m, G, g);
          else gm = group_mask_lanes<V, CH, 8>(key, S, sh, m, G, g);
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int c = lane + 32 * j;
          if (c < nch && !((gm >> (c >> sh)) & 1u)) {
#pragma unroll
            for (int v = 0; v < CH; ++v) key[j * CH + v] = 0u;
            if constexpr (kSortFirst) {
#pragma unroll
              for (int q = 0; q < 8; ++q) s8[q] = 0u;
            }
          }
        }
      } else if constexpr (!LANESEL) {
        if (lanes) {
          if (m == 1) group_scores_lanes<V, CH, 1>(key, nch, S, m, gkey);
          else if (m == 2) group_scores_lanes<V, CH, 2>(key, nch, S, m, gkey);
          else if (m <= 4) group_scores_lanes<V, CH, 4>(key, nch, S, m, gkey);
          else group_scores_lanes<V, CH, 8>(key, nch, S, m, gkey);
        } else {
          for_chunks<NJ>(nch, [&](int j, int c) {
            alignas(16) unsigned kv[CH];
#pragma unroll
            for (int v = 0; v < CH; ++v) kv[v] = key[j * CH + v];
            stn<CH>(skeys + c * CH, kv);
          });
          __syncwarp();
          group_scores<32>(skeys, G, n, m, gkey, nullptr, hist);
        }
        __syncwarp();
        unsigned gthr;
        int gil;
        select_topk<32, false>(gkey, G, g, nullptr, nullptr, list, gthr, gil);
#pragma unroll
        for (int q = 0; q < V; ++q) {
          const int e = reg_expert<CH>(lane, q);
          const int jg = n == 1 ? e : (int)__umulhi((unsigned)e, gmagic);
          if (lane + 32 * (q / CH) < nch && !selected(gkey[jg], jg, gthr, gil)) key[q] = 0u;
        }
      }
    }

    // Phase 3: top-k; Phase 4: the selected experts in index order -> lidx/lkey. With groups, V = 8 and
    // k <= 8: select_reg8 (on H100 at E = 256, T = 65536, 17-20% faster than the argmax rounds, whose rescans
    // are frequent when the winners lie in few lanes; 2-4% slower than them without groups). Other k <= 8:
    // the argmax rounds hand lane r its r-th winner; its place in index order is the count of winners with
    // a lower index (the indices are distinct). Otherwise the registers are compacted by the selection rule.
    unsigned thr;
    int il;
    bool sel8 = false;
    unsigned selm[NJ];  // select_reg8: the selection bits of each chunk round
    if constexpr (V == 8 && GROUPS) {
      if (LANESEL || (K <= 8 && G > 0)) {
        if constexpr (!kSortFirst) {
#pragma unroll
          for (int q = 0; q < 8; ++q) s8[q] = key[q];
          sort8_desc(s8);
        }
        select_reg8<CH>(key, s8, K, lkey, lidx, thr, il, selm);
        sel8 = true;
      }
    }
    if constexpr (!LANESEL) {
      if (!sel8 && (W < 32 || K <= 8)) {
        unsigned wk = 0u;
        int wi = kIntMax;
        if (IsBf16<T>::value && post) argmax_reg_bf16<V, CH, W>(key, K, thr, il, wk, wi);
        else argmax_reg<V, CH, W>(key, K, thr, il, wk, wi);
        int pos = 0;  // lanes >= K hold wi = kIntMax, which counts for no lane
#pragma unroll
        for (int i = 0; i < (W < 8 ? W : 8); ++i) pos += __shfl_sync(FULL_MASK, wi, i, W) < wi ? 1 : 0;
        if (lane < K) { lkey[pos] = wk; lidx[pos] = wi; }
      } else if (W == 32 && !sel8) {
        radix_select_reg<V, CH>(key, nch, K, list, thr, il);
        compact_reg<V, CH>(key, nch, K, [&](unsigned kk, int e) { return selected(kk, e, thr, il); },
                           [&](int pos, unsigned kk, int e) { lkey[pos] = kk; lidx[pos] = e; });
      }
    }
    __syncwarp();

    // Phase 5: the K weights.
    if (!aux_mode) topk_weights<W>(t, K, score_fn, pre_softmax, scale, bias, lidx, lkey, lw, lp, topk_idx, idx_bytes, topk_w);
    __syncwarp();

    // Phase 6: dense outputs: map, zero probs (-inf intermediate for post-softmax), then the K values.
    const bool wprobs = !aux_mode && probs != nullptr, winter = post && inter != nullptr;
    bool* const bmap = BITMAP ? nullptr : rmap;  // as in router_fwd
    for_chunks<NJ, W>(nch, [&](int j, int c) {
      unsigned kv[CH];
#pragma unroll
      for (int v = 0; v < CH; ++v) kv[v] = key[j * CH + v];
      if (sel8)
        dense_chunk_out<T, CH>(bmap ? selm[j] : 0u, c * CH, row, bmap, wprobs ? probs : nullptr,
                               winter ? inter : nullptr);
      else
        dense_chunk_out<T, CH>(kv, c * CH, thr, il, row, bmap, wprobs ? probs : nullptr, winter ? inter : nullptr);
    });
    if constexpr (BITMAP) {
      if (rmap) {
        unsigned char* brow = reinterpret_cast<unsigned char*>(rmap) + t * (i64)((E + 7) >> 3);
#pragma unroll
        for (int j = 0; j < NJ; ++j) {  // every lane, every round (bitmap_chunk_out's shuffle)
          const int c = lane + 32 * j;
          unsigned sel = 0u;
          if (c < nch) {
            unsigned kv[CH];
#pragma unroll
            for (int v = 0; v < CH; ++v) kv[v] = key[j * CH + v];
            sel = sel8 ? selm[j] : chunk_selection<CH>(kv, c * CH, thr, il);
          }
          bitmap_chunk_out<CH>(sel, c, c < nch, brow);
        }
      }
    }
    if (wprobs || winter) {
      __syncwarp();  // orders the fill before the patch
      for (int jj = lane; jj < K; jj += 32) {
        const int e = lidx[jj];
        if (wprobs) probs[row + e] = from_float<T>(lw[jj]);
        if (winter) inter[row + e] = lp[jj];
      }
    }
    __syncwarp();
  }
}

// ---- Quantile Balancing (docs/router.md "Quantile Balancing") ------------------------------------------
// sigmoid + expert bias: the top k + 1 by biased score in the order (key desc, index asc); the last of them
// (the least biased score, the larger id on ties) is the token's cutoff, the other k are its routes (the
// same k as the plain sigmoid + bias forward selects) with the plain forward's probs. Every expert e of
// token t adds one count to hist[e, bin(cutoff_t - raw_te)], raw = sigmoid(logit) before the bias:
//   bin = clamp(floor((r - lower) * (B / (upper - lower))), 0, B - 1)  in fp32, NaN -> 0,
// with the bounds read on the device at every launch (a CUDA graph replays with the values in memory).
// Integer atomics only: the counts are exact and do not depend on the order. The forward kernels
// (router_fwd_qb_reg, router_fwd_qb) add them in their epilogue ("fused_atomic" where the histogram of a block
// fits its shared memory, or T E is small); qb_histogram_accumulate adds them from (raw, cutoff) in a second
// kernel ("two_kernel", and "fused_atomic" otherwise); all bin through qb_bin, so the modes count the same
// bins.
//
// The selection of k + 1 (thr, il) holds the cutoff: its key is the least selected key, its expert the
// largest index among the selected keys equal to it. Where the selection left il set, that is (thr, il).
// Where it left il = kIntMax (the selection is every key >= thr), thr may be no key at all: the radix
// selects stop early with thr a digit prefix below the selected keys. The cutoff is then the least key >= thr
// and the largest index holding it (router_fwd_qb takes the least of its k + 1 listed keys; router_fwd_qb_reg
// reduces over its registers). With (ck, cidx) the cutoff, the routes are the experts with
// selected(key, e, ck, cidx - 1): the k + 1 without the cutoff.
//
// The forward kernels' histogram (hmode): 0 none (qb_histogram_accumulate counts after the kernel), 1 one
// global int32 atomic a sample, 2 a histogram of the block in shared memory after the token slots, 16-bit
// counters two to a word (E ceil(B / 2) words; qb_smem_word), added to hist by global atomics at the block's
// end. The host keeps every block under 65536 tokens, so no counter passes 0xffff (a
// sample adds one to one counter per token). Modes 1 and 2 add the same integers. In mode 2 the flush is the
// cost that grows with the blocks (up to E B atomics each, at the end of a single resident wave), so
// router_fwd_qb_reg then runs one block of every warp a multiprocessor holds (blockDim a multiple of 32).
#ifndef MOE_RT_QB_ARGMAX_K1
#define MOE_RT_QB_ARGMAX_K1 9  // router_fwd_qb_reg: the argmax rounds select k + 1 up to this, radix select above
#endif
static_assert(MOE_RT_QB_ARGMAX_K1 >= 2 && MOE_RT_QB_ARGMAX_K1 <= 33, "the argmax rounds' k + 1 winners sit in lanes");
namespace {

__device__ __forceinline__ float qb_scale(const float* __restrict__ bounds, int B, float& lo) {
  lo = bounds[0];
  return __fdiv_rn((float)B, __fsub_rn(bounds[1], lo));
}

// Explicitly rounded operations: no contraction into a fused multiply-add, so the reference's fp32 steps
// give the same bins. The floor, clamp and conversion are exact in integers: __float2uint_rd floors and
// saturates to [0, 2^32 - 1] (-inf and every v < 0 to 0, +inf to 2^32 - 1) and turns a NaN into 0, so the bin
// is the reference's clamp(floor(v), 0, B - 1), a NaN in bin 0.
__device__ __forceinline__ int qb_bin(float cut, float raw, float lo, float sc, int B) {
  return (int)min(__float2uint_rd(__fmul_rn(__fsub_rn(__fsub_rn(cut, raw), lo), sc)), (unsigned)(B - 1));
}

// hmode 2's layout: expert e's bins in R = ceil(B / 2) words from word e R, bins 2 p and 2 p + 1 in word p
// (low and high half) rotated by the expert's 16-byte chunk (e >> csh) modulo a power of two <= R: word
// e R + (p + rot) mod R. The lanes of a warp add to the experts of consecutive chunks at once; without the
// rotation their words would share a bank whenever their bins' halves agree (R a multiple of 32, e.g. B = 64:
// bank = p), and the bins of one token's experts bunch around a few values, so most lanes would wait on a
// few banks. With it, lanes with equal p (and R a multiple of 32) use distinct banks.
__device__ __forceinline__ int qb_rot_mask(int R) { return (1 << (31 - __clz(R))) - 1; }
__device__ __forceinline__ int qb_smem_word(int e, int p, int R, int csh) {
  const int q = p + ((e >> csh) & qb_rot_mask(R));
  return e * R + (q >= R ? q - R : q);
}

// The histogram of a forward kernel (hmode 1 or 2 above).
struct QbHist {
  int* __restrict__ g;  // [E, B] int32 in global memory
  unsigned* s;          // hmode 2: the block's 16-bit counters (qb_smem_word)
  int B, mode;
  float lo, sc;
  int csh;  // log2 of the experts a 16-byte chunk holds (the rotation's unit)
  __device__ __forceinline__ void add(int e, float cut, float raw) const {
    const int bin = qb_bin(cut, raw, lo, sc, B);
    if (mode == 2) {
      atomicAdd(s + qb_smem_word(e, bin >> 1, (B + 1) >> 1, csh), 1u << ((bin & 1) << 4));
    } else {
      atomicAdd(g + (i64)e * B + bin, 1);
    }
  }
  // add() of the CH experts of 16-byte chunk c (expert c CH + v's raw value raw_of(v)). hmode 2 with the
  // chunk's constants out of the experts' loop: the rotation is the chunk's (c & rmask; csh = log2 CH), so
  // bin 2 p + (0 or 1) of expert c CH + v is word (c CH + v) R + q, q = p + rot less R where q >= R: q < 2 R,
  // and min(q, q - R) in unsigned is q - R there and q below (q - R wraps); the half is bit 4 of bin << 4 (the
  // funnel shift takes its amount mod 32).
  template <int CH, typename F>
  __device__ __forceinline__ void add_chunk(int c, float cut, F raw_of) const {
    if (mode == 2) {
      const int R = (B + 1) >> 1;
      const unsigned rot = c & qb_rot_mask(R);
      unsigned* w = s + c * CH * R;
#pragma unroll
      for (int v = 0; v < CH; ++v, w += R) {
        const unsigned bin = qb_bin(cut, raw_of(v), lo, sc, B), q = (bin >> 1) + rot;
        atomicAdd(w + min(q, q - R), __funnelshift_l(0u, 1u, bin << 4));
      }
    } else {
#pragma unroll
      for (int v = 0; v < CH; ++v) add(c * CH + v, cut, raw_of(v));
    }
  }
};

// hmode 2: zero the block's counters (before the first token; the caller syncs the block after).
__device__ __forceinline__ void qb_smem_zero(unsigned* s, int E, int B) {
  const int words = E * ((B + 1) >> 1);
  for (int w = threadIdx.x; w < words; w += blockDim.x) s[w] = 0u;
}

// hmode 2: the block's counts into hist (after the last token; the caller syncs the block before). Each block
// starts at its own word, so that blocks ending together send their atomics to different addresses.
__device__ __forceinline__ void qb_smem_flush(const unsigned* s, int* __restrict__ g, int E, int B, int csh) {
  const int R = (B + 1) >> 1, words = E * R, rmask = qb_rot_mask(R);
  const int first = (int)(((unsigned long long)blockIdx.x * 4099u) % (unsigned)words);
  for (int i = threadIdx.x; i < words; i += blockDim.x) {
    const int w = i < words - first ? i + first : i - (words - first);
    const unsigned c = s[w];
    if (c == 0u) continue;
    const int e = (int)((unsigned)w / (unsigned)R);
    int p = w - e * R - ((e >> csh) & rmask);  // qb_smem_word inverted
    p = p < 0 ? p + R : p;
    int* const ge = g + (i64)e * B + 2 * p;
    if (c & 0xffffu) atomicAdd(ge, (int)(c & 0xffffu));
    if (c >> 16) atomicAdd(ge + 1, (int)(c >> 16));  // bin 2 p + 1 < B: an odd B's last high half stays 0
  }
}

// router_fwd_qb's element-wise writes of the routing map: entry e of the row at `row`.
__device__ __forceinline__ void qb_map_out(bool* __restrict__ rmap, i64 row, int e, bool routed) {
  rmap[row + e] = routed;
}

// router_fwd_qb's selection pass for one warp on 16-byte rows (router_fwd's phase 4 with phase 6, the
// selection (thr, il) of the k + 1): the routing map of the k + 1 (the caller clears the cutoff's byte) and
// zero probs, and the k + 1 in index order -> lidx/lkey, in rounds of 32 units of P keys (lane order = index
// order), each lane's selected experts placed by a ballot or a warp scan of the lanes' counts (router_fwd's
// code; a helper shared with it changed router_fwd's SASS (sm_90, fp32), so router_fwd keeps its own).
template <typename T, int P>
__device__ __forceinline__ void qb_dense_in_order(const unsigned* keys, int E, int K1, unsigned thr, int il,
                                                  i64 row, bool* __restrict__ rmap, T* __restrict__ probs,
                                                  int* lidx, unsigned* lkey) {
  const int lane = threadIdx.x & 31, np = E / P;
  int cnt = 0;
  for (int b0 = 0; b0 < np; b0 += 32) {
    const int c = b0 + lane;
    unsigned sel = 0u;
    if (c < np) {
      alignas(16) unsigned kv[P];
      ldn<P>(keys + c * P, kv);
      sel = chunk_selection<P>(kv, c * P, thr, il);
      dense_chunk_out<T, P>(sel, c * P, row, rmap, probs, nullptr);
    }
    const unsigned lanes = __ballot_sync(FULL_MASK, sel != 0u);
    int excl, tot;
    if (__any_sync(FULL_MASK, (sel & (sel - 1u)) != 0u)) {
      const int n = __popc(sel);
      const int incl = warp_inclusive_scan(n);
      excl = incl - n;
      tot = __shfl_sync(FULL_MASK, incl, 31);
    } else {
      excl = __popc(lanes & ((1u << lane) - 1u));
      tot = __popc(lanes);
    }
    int pos = cnt + excl;
    for (unsigned b = sel; b != 0u; b &= b - 1u, ++pos) {
      const int e = c * P + __ffs(b) - 1;
      if (pos < K1) { lidx[pos] = e; lkey[pos] = keys[e]; }
    }
    cnt += tot;
  }
  __syncwarp();
}

}  // namespace

// The QB forward with the row in registers (router_fwd_reg's machinery: one warp a token, a token slot a
// warp, 16-byte rows, V keys a lane; requires vec and E / CH <= 32 * V / CH). probs, rmap (byte map), inter
// and cutoff are written for every token; hist [E, B] int32 is accumulated by hmode (above; 0: not touched).
// Shared memory: a slot a warp of the radix list and the k routes' experts, keys and weights (layout_tail
// from word 0: no group scratch), then (hmode 2) E ceil(B / 2) words of counters. Built for the register
// budget of router_fwd_reg's blocks a multiprocessor with groups (fp32 5, bf16 6 blocks of 128 threads at
// V = 8), taken as one block of up to 128 times as many threads: launched with 128 threads (hmode 0, 1) as
// router_fwd_reg, or (hmode 2) with every warp a multiprocessor holds sharing one histogram.
template <typename T, int V>
__global__ void __launch_bounds__(128 * MOE_RT_FWD_REG_MINB(V, T, true, false), 1)
router_fwd_qb_reg(const T* __restrict__ logits, i64 num_tokens, int E, int K, float scale,
                  const float* __restrict__ bias, T* __restrict__ probs, bool* __restrict__ rmap,
                  float* __restrict__ inter, float* __restrict__ cutoff, const float* __restrict__ bounds,
                  int* __restrict__ hist, int B, int hmode) {
  constexpr int CH = 16 / (int)sizeof(T);
  constexpr int NJ = V / CH;
  static_assert(NJ * CH == V, "V must be a multiple of the chunk size");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int slot = threadIdx.x >> 5, lane = threadIdx.x & 31;
  RegLayout L;
  L.keys = L.gkey = L.hist = 0;
  layout_tail(L, 0, K);
  unsigned* const sbase = reinterpret_cast<unsigned*>(smem_raw);
  const SlotPtrs P = slot_ptrs(sbase + (size_t)slot * L.total, L);
  unsigned *list = P.list, *lkey = P.lkey;
  int* lidx = P.lidx;
  float *lw = P.lw, *lp = P.lp;
  if (lane == 0) list[2 * kList] = 0u;
  const int spb = blockDim.x >> 5;  // token slots a block
  QbHist H{hist, sbase + (size_t)spb * L.total, B, hmode, 0.0f, 0.0f, CH == 8 ? 3 : 2};
  if (hmode) H.sc = qb_scale(bounds, B, H.lo);
  if (hmode == 2) qb_smem_zero(H.s, E, B);
  __syncthreads();

  const int nch = E / CH;
  const int K1 = K + 1;
  const i64 stride = (i64)gridDim.x * spb;
  RegRows<T, NJ, (V <= 16)> rows{logits, num_tokens, stride, E, nch, lane};
  rows.start((i64)blockIdx.x * spb + slot);

  for (i64 t = (i64)blockIdx.x * spb + slot; t < num_tokens; t += stride) {
    const i64 row = t * (i64)E;
    unsigned key[V];
    float raw[V];
    {
      alignas(16) T xv[NJ][CH];
      rows.get(t, xv);
      // Phase 1 (router_fwd_reg's sigmoid + bias case, p1_elem): raw -> intermediate, keys of raw + bias.
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int c = lane + 32 * j;
        if (c < nch) {
          alignas(16) float bv[CH];
          alignas(16) float av[CH];
          ldn<CH>(bias + c * CH, bv);
#pragma unroll
          for (int v = 0; v < CH; ++v) {
            av[v] = sigmoid_fwd(elem_f(xv[j], v));
            raw[j * CH + v] = av[v];
            key[j * CH + v] = fkey_arith(av[v] + bv[v]);
          }
          stn<CH>(inter + row + (i64)c * CH, av);
        } else {
#pragma unroll
          for (int v = 0; v < CH; ++v) { key[j * CH + v] = 0u; raw[j * CH + v] = 0.0f; }
        }
      }
    }

    // Top k + 1 -> (thr, il); the cutoff expert cidx; the k routes in index order -> lidx/lkey.
    unsigned thr;
    int il, cidx;
    if (K1 <= MOE_RT_QB_ARGMAX_K1) {
      // lane r < k + 1 gets the r-th winner; the last (lane k) is the cutoff, il its expert
      unsigned wk = 0u;
      int wi = kIntMax;
      argmax_reg<V, CH>(key, K1, thr, il, wk, wi);
      cidx = il;
      const int wr = lane < K ? wi : kIntMax;  // the routes; lanes >= k count for no lane
      // over a fixed count of lanes (k <= MOE_RT_QB_ARGMAX_K1 - 1): unrolled, no loop; the sign bit of the
      // difference of two ints in [0, kIntMax] is their order (no overflow)
      unsigned pos = 0u;
#pragma unroll
      for (int i = 0; i < MOE_RT_QB_ARGMAX_K1 - 1; ++i) pos += (unsigned)(__shfl_sync(FULL_MASK, wr, i) - wr) >> 31;
      if (lane < K) { lkey[pos] = wk; lidx[pos] = wi; }
    } else {
      radix_select_reg<V, CH>(key, nch, K1, list, thr, il);
      cidx = il;
      if (il == kIntMax) {
        // The k + 1 are exactly the keys >= thr, but thr need not be one of them: the radix select stops at
        // the first digit whose bin holds exactly the keys still needed, and its thr is then that digit's
        // prefix with zero low bits, a bound below them. The cutoff is their least key (thr from here on),
        // on ties the last in index order.
        unsigned least = 0xffffffffu;
#pragma unroll
        for (int q = 0; q < V; ++q)
          if (lane + 32 * (q / CH) < nch && key[q] >= thr) least = min(least, key[q]);
        thr = __reduce_min_sync(FULL_MASK, least);
        int last = -1;
#pragma unroll
        for (int q = 0; q < V; ++q)
          if (lane + 32 * (q / CH) < nch && key[q] == thr) last = max(last, reg_expert<CH>(lane, q));
        cidx = __reduce_max_sync(FULL_MASK, last);
      }
      compact_reg<V, CH>(key, nch, K, [&](unsigned kk, int e) { return selected(kk, e, thr, cidx - 1); },
                         [&](int pos, unsigned kk, int e) { lkey[pos] = kk; lidx[pos] = e; });
    }
    const int ilr = cidx - 1;  // the routes: selected(key, e, thr, ilr)
    const float cut = fdecode(thr);  // the cutoff, also the histogram's
    if (lane == 0) cutoff[t] = cut;
    __syncwarp();

    // The k weights (the plain sigmoid + bias forward's).
    topk_weights(t, K, SIGMOID, 0, scale, bias, lidx, lkey, lw, lp, nullptr, 4, nullptr);
    __syncwarp();

    // Dense outputs: the map (the k routes), zero probs, then the k probs; the histogram from the registers.
    for_chunks<NJ>(nch, [&](int j, int c) {
      unsigned kv[CH];
#pragma unroll
      for (int v = 0; v < CH; ++v) kv[v] = key[j * CH + v];
      dense_chunk_out<T, CH>(kv, c * CH, thr, ilr, row, rmap, probs, nullptr);
    });
    __syncwarp();  // orders the fill before the patch
    if (K <= 32) {  // one route a lane at most: no loop
      if (lane < K) probs[row + lidx[lane]] = from_float<T>(lw[lane]);
    } else {
      for (int jj = lane; jj < K; jj += 32) probs[row + lidx[jj]] = from_float<T>(lw[jj]);
    }
    if (hmode)
      for_chunks<NJ>(nch, [&](int j, int c) { H.add_chunk<CH>(c, cut, [&](int v) { return raw[j * CH + v]; }); });
    __syncwarp();
  }
  if (hmode == 2) {
    __syncthreads();
    qb_smem_flush(H.s, hist, E, B, H.csh);
  }
}

// The QB forward of any row: one team of TEAM threads per token (TEAM = 32: 4 tokens a block), the row's keys
// in shared memory (the slot layout of router_fwd for k + 1 and no groups); vec (16-byte rows, as in
// router_fwd): phase 1 and the dense outputs in 16-byte chunks, and with one warp a token the k + 1 listed in
// index order in the pass that writes the map and zero probs (qb_dense_in_order), the histogram after it in a
// pass of its own (it needs the cutoff). probs, rmap, inter and cutoff are written for every token; hist
// [E, B] int32 is accumulated by hmode (above; 0: not touched). Shared memory: SPB slots, then (hmode 2)
// E ceil(B / 2) words of counters. HIST = false: compiled without the histogram (hmode 0 only; the planners
// name it where the histogram pass follows): 3-4% faster at E = 2304 (H100, T = 65536).
template <typename T, int TEAM, bool HIST = true>
__global__ void __launch_bounds__(TEAM == 32 ? 128 : TEAM, MOE_RT_FWD_MINB(TEAM))
router_fwd_qb(const T* __restrict__ logits, i64 num_tokens, int E, int K, float scale,
              const float* __restrict__ bias, T* __restrict__ probs, bool* __restrict__ rmap,
              float* __restrict__ inter, float* __restrict__ cutoff, const float* __restrict__ bounds,
              int* __restrict__ hist, int B, int hmode, int vec) {
  using TM = Team<TEAM>;
  constexpr int SPB = TEAM == 32 ? 4 : 1;
  constexpr int CH = 16 / (int)sizeof(T);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int slot = threadIdx.x / TEAM, r = threadIdx.x % TEAM, lane = threadIdx.x & 31, warp = r >> 5;
  const int K1 = K + 1, Kp = al4(K1);
  if constexpr (!HIST) hmode = 0;
  const Layout L = slot_layout<TEAM>(E, 0, K1);
  unsigned* const sbase = reinterpret_cast<unsigned*>(smem_raw);
  unsigned* base = sbase + (size_t)slot * L.total;
  const SlotPtrs P = slot_ptrs(base, L);
  unsigned *keys = P.keys, *list = P.list, *lkey = P.lkey;
  unsigned* cut_word = P.hist;  // the slot's group scratch, unused without groups: the cutoff's (key, index)
  int* lidx = P.lidx;
  unsigned* wcnt = base + L.wcnt;
  int* redi = reinterpret_cast<int*>(base + L.red + 32);
  int* wcount = reinterpret_cast<int*>(base + L.wcount);
  int* wlist = reinterpret_cast<int*>(base + L.wlist);
  if (r == 0) list[2 * kList] = 0u;
  QbHist H{hist, sbase + SPB * L.total, B, hmode, 0.0f, 0.0f, CH == 8 ? 3 : 2};
  if (hmode) H.sc = qb_scale(bounds, B, H.lo);
  if (hmode == 2) qb_smem_zero(H.s, E, B);
  __syncthreads();
  const int nch = vec ? E / CH : 0;

  for (i64 t = (i64)blockIdx.x * SPB + slot; t < num_tokens; t += (i64)gridDim.x * SPB) {
    const i64 row = t * (i64)E;
    if (vec) {  // router_fwd's phase 1 on 16-byte rows, sigmoid + bias (its chunks loaded ahead without groups)
      constexpr int U = TEAM == 32 ? MOE_RT_FWD_U_32 : MOE_RT_FWD_U;
      float pmax = -kInf, psum = 0.0f;
      Phase1Vec<T, TEAM, U> ph{logits + row, bias, keys, inter + row, nullptr, nch, r, pmax, psum};
      ph.template run<SIGMOID, false, true>();
    } else {
      for (int e = r; e < E; e += TEAM) {
        const float a = sigmoid_fwd(to_float(logits[row + e]));
        inter[row + e] = a;
        keys[e] = fkey_arith(a + bias[e]);
      }
    }
    TM::sync();
    unsigned thr;
    int il;
    select_topk<TEAM>(keys, E, K1, wcnt, redi, list, thr, il);

    // The k + 1 candidates in index order -> lidx/lkey. One warp on 16-byte rows writes the dense outputs
    // (the map of the k + 1, zero probs) in the same pass, P keys a lane a round as router_fwd's phase 4.
    bool dense_done = false;
    if constexpr (TEAM == 32) {
      if (vec) {
        dense_done = true;
        if (CH == 8 || E % 8 == 0) qb_dense_in_order<T, 8>(keys, E, K1, thr, il, row, rmap, probs, lidx, lkey);
        else qb_dense_in_order<T, CH>(keys, E, K1, thr, il, row, rmap, probs, lidx, lkey);
      }
    }
    if (!dense_done) selected_in_order<TEAM>(keys, E, K1, Kp, thr, il, lidx, lkey, wlist, wcount, r, lane, warp);

    // The cutoff: the least key among the k + 1, the last such position (the larger id) on ties; it leaves
    // the list, the other k keep their index order.
    if (warp == 0) {
      unsigned ck[3];
      int ci[3];
      unsigned best = 0xffffffffu;
      int bpos = -1;
#pragma unroll
      for (int s = 0; s < 3; ++s) {
        const int j = lane + 32 * s;
        ck[s] = j < K1 ? lkey[j] : 0u;
        ci[s] = j < K1 ? lidx[j] : 0;
        if (j < K1 && (bpos < 0 || ck[s] <= best)) { best = ck[s]; bpos = j; }
      }
      const unsigned mk = __reduce_min_sync(FULL_MASK, bpos >= 0 ? best : 0xffffffffu);
      const int mp = (int)__reduce_max_sync(FULL_MASK, (unsigned)(bpos >= 0 && best == mk ? bpos + 1 : 0)) - 1;
      __syncwarp();
#pragma unroll
      for (int s = 0; s < 3; ++s) {
        const int j = lane + 32 * s;
        if (j < K1 && j != mp) {
          const int d = j > mp ? j - 1 : j;
          lidx[d] = ci[s];
          lkey[d] = ck[s];
        }
      }
#pragma unroll
      for (int s = 0; s < 3; ++s)
        if (lane + 32 * s == mp) {
          cutoff[t] = fdecode(mk);
          cut_word[0] = mk;
          cut_word[1] = (unsigned)ci[s];
          // the cutoff expert is not routed (the pass's write of its byte is ordered by the pass's last
          // __syncwarp and the one above)
          if (dense_done) qb_map_out(rmap, row, ci[s], false);
        }
      __syncwarp();
      topk_weights(t, K, SIGMOID, 0, scale, bias, lidx, lkey, P.lw, P.lp, nullptr, 4, nullptr);
    }
    TM::sync();

    // Dense outputs: the map (the k routes; the cutoff expert is not routed), zero probs, then the k probs;
    // the histogram in the same pass (this thread wrote these raw values above: same thread, same addresses,
    // no fence needed). dense_done: the map and zeros are written; the histogram alone, then the k probs.
    const unsigned ck = cut_word[0];
    const int cidx = (int)cut_word[1];
    const float cut = fdecode(ck);
    auto hist_chunk = [&](int c) {
      alignas(16) float av[CH];
      ldn<CH>(inter + row + (i64)c * CH, av);
      H.add_chunk<CH>(c, cut, [&](int v) { return av[v]; });
    };
    if (dense_done) {
      if (hmode)
        for (int c = r; c < nch; c += TEAM) hist_chunk(c);
    } else if (vec) {
      for (int c = r; c < nch; c += TEAM) {
        alignas(16) unsigned kv[CH];
        ldn<CH>(keys + c * CH, kv);
        dense_chunk_out<T, CH>(kv, c * CH, ck, cidx - 1, row, rmap, probs, nullptr);
        if (hmode) hist_chunk(c);
      }
    } else {
      for (int e = r; e < E; e += TEAM) {
        qb_map_out(rmap, row, e, e != cidx && selected(keys[e], e, thr, il));
        probs[row + e] = from_float<T>(0.0f);
        if (hmode) H.add(e, cut, inter[row + e]);
      }
    }
    if (!dense_done) TM::sync();  // orders the fill before the patch (same block; dense_done: the sync above)
    for (int j = r; j < K; j += TEAM) probs[row + lidx[j]] = from_float<T>(P.lw[j]);
    TM::sync();
  }
  if (hmode == 2) {
    __syncthreads();
    qb_smem_flush(H.s, hist, E, B, H.csh);
  }
}

// The histogram from (raw, cutoff) after the forward kernel (the two-kernel mode; "fused_atomic" where the
// forward keeps no histogram): block (bx, by) counts the strip of S = 32 VPL experts from S bx (lane l:
// experts S bx + VPL l .. + VPL - 1, one VPL * 4-byte load a row, so a warp reads 128 VPL contiguous bytes of
// a row; VPL = 4 where E % 4 == 0 and raw is 16-byte aligned) over the by-th share of the tokens (warp w:
// tokens t0 + w, t0 + w + nw, ...; U rows loaded before the first is counted). SMEM: the strip's bins in
// shared memory, expert el's B words from el B, bin b at (b + rot) mod B with rot = l & (the largest power of
// two <= B, less 1): lanes with equal bins meet on distinct banks; added to hist at the block's end. Without
// it, straight global atomics. raw [T, E] fp32 (sigmoid before the bias), cutoff [T] fp32; blockDim a
// multiple of 32. At E = 2304, T = 65536 on H200, 1024 threads and VPL = 4 read raw at 3.95 TB/s (0.153 ms,
// the 151M shared atomics bound it as much as the bytes), where VPL = 1 with 256 threads took 0.267 ms.
template <int VPL> struct QbLoad { using type = float; };
template <> struct QbLoad<4> { using type = float4; };
template <int VPL>
__global__ void __launch_bounds__(1024)
qb_histogram_accumulate(const float* __restrict__ raw, const float* __restrict__ cutoff, long long num_tokens,
                        int E, const float* __restrict__ bounds, int* __restrict__ hist, int B, int use_smem) {
  constexpr int U = VPL == 1 ? 8 : 4;
  using V = typename QbLoad<VPL>::type;
  static_assert(VPL == 1 || VPL == 4, "one or four experts a lane");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int* sh = reinterpret_cast<int*>(smem_raw);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int e0 = blockIdx.x * 32 * VPL, el0 = lane * VPL;
  const bool valid = e0 + el0 < E;  // VPL = 4: E % 4 == 0, so a lane's experts are all in the row or none
  const long long per = (num_tokens + gridDim.y - 1) / gridDim.y;
  const long long t0 = (long long)blockIdx.y * per, t1 = min(num_tokens, t0 + per);
  float lo;
  const float sc = qb_scale(bounds, B, lo);
  const int rmask = qb_rot_mask(B), rot = lane & rmask;
  if (use_smem) {
    for (int i = threadIdx.x; i < 32 * VPL * B; i += blockDim.x) sh[i] = 0;
    __syncthreads();
  }
  int* const hp = use_smem ? sh + el0 * B : hist + (long long)(e0 + el0) * B;
  const float* __restrict__ rp = raw + e0 + el0;
  for (long long t = t0 + warp; t < t1; t += (long long)nw * U) {
    V r[U];
    float c[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long tt = t + (long long)u * nw;
      c[u] = 0.0f;
      if (valid && tt < t1) { r[u] = *reinterpret_cast<const V*>(rp + tt * E); c[u] = cutoff[tt]; }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (valid && t + (long long)u * nw < t1) {
        const float* rv = reinterpret_cast<const float*>(&r[u]);
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
          const int bin = qb_bin(c[u], rv[v], lo, sc, B);
          if (use_smem) {
            const int q = bin + rot;
            atomicAdd(hp + v * B + (q >= B ? q - B : q), 1);
          } else {
            atomicAdd(hp + v * B + bin, 1);
          }
        }
      }
  }
  if (use_smem) {
    __syncthreads();
    const int ne = min(32 * VPL, E - e0);
    for (int i = threadIdx.x; i < ne * B; i += blockDim.x) {
      const int cnt = sh[i];
      if (!cnt) continue;
      const int el = i / B;
      int bin = i - el * B - ((el / VPL) & rmask);  // the rotation of lane el / VPL undone
      bin = bin < 0 ? bin + B : bin;
      atomicAdd(hist + (long long)(e0 + el) * B + bin, cnt);
    }
  }
}

// ---- backward of top-k (TG = TO = logits dtype) and of the aux scores (TG = float) --------------------
// The per-element math of both backward kernels. A row's sums: A = sum of g*y (softmax), or A = sum of the
// selection scores v and B = sum of g*v (sigmoid-like), over the routing map (the whole row in aux mode).
__device__ __forceinline__ void bwd_acc(bool sig_like, int score_fn, float g, bool msk, float y, float& A,
                                        float& B) {
  // explicit fused multiply-adds: every caller (inline or out of line) rounds them alike
  if (sig_like) {
    const float v = score_fn == SIGMOID ? y : sqrtsoftplusf(y);
    if (msk) { A += v; B = __fmaf_rn(g, v, B); }
  } else if (msk) {
    A = __fmaf_rn(g, y, A);
  }
}

__device__ __forceinline__ float bwd_dx(bool sig_like, int score_fn, bool normalize, bool aux_mode,
                                        bool pre_softmax, float A, float Ae, float B, float g, bool msk, float y) {
  if (sig_like) {
    if (!msk) return 0.0f;
    const float gh = normalize ? g / Ae - B / (Ae * Ae) : g;
    if (score_fn == SIGMOID) return gh * y * (1.0f - y);
    const float v = sqrtsoftplusf(y), den = __fmaf_rn(2.0f, v, kEps);
    return y > 20.0f ? gh / den : gh * sigmoidf(y) / den;
  }
  if (aux_mode) return y * (g - A);
  if (pre_softmax) return y * ((msk ? g : 0.0f) - A);
  return msk ? y * (g - A) : 0.0f;
}

// BITMAP: rmap is the bit-packed map (router_fwd's); the same math on its bits.
template <typename TG, typename TO, int TEAM, bool BITMAP = false>
__global__ void __launch_bounds__(TEAM == 32 ? 128 : TEAM)
router_bwd(const TG* __restrict__ grad, const bool* __restrict__ rmap, const float* __restrict__ inter,
           i64 num_tokens, int E, int K, int score_fn, int pre_softmax, int aux_mode, float scale,
           TO* __restrict__ out, int vec) {
  using TM = Team<TEAM>;
  constexpr int SPB = TEAM == 32 ? 4 : 1;
  constexpr int CH = (sizeof(TG) == 2 || sizeof(TO) == 2) ? 8 : 4;
  __shared__ float red[32];
  const int slot = threadIdx.x / TEAM, r = threadIdx.x % TEAM;
  const bool sig_like = score_fn != SOFTMAX;
  const bool normalize = aux_mode || K > 1;
  const int nch = vec ? E / CH : 0;

  for (i64 t = (i64)blockIdx.x * SPB + slot; t < num_tokens; t += (i64)gridDim.x * SPB) {
    const i64 row = t * (i64)E;
    float A = 0.0f, B = 0.0f;
    const unsigned char* brow = BITMAP ? reinterpret_cast<const unsigned char*>(rmap) + t * (i64)((E + 7) >> 3)
                                       : nullptr;
    // entry e of the map (rmap non-null)
    auto map_at = [&](int e) -> bool { return BITMAP ? ((brow[e >> 3] >> (e & 7)) & 1u) != 0u : rmap[row + e]; };
    // U chunks are loaded before the first is used. (The two passes keep their own loops: one helper that
    // runs both through a lambda measured 9-25% slower for fp32 rows on H100.)
    constexpr int U = MOE_RT_BWD_U(TEAM, CH);
    auto load_u = [&](int c0, TG (&gv)[U][CH], float (&yv)[U][CH], bool (&mv)[U][CH]) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * TEAM;
        if (c < nch) {
          ldn<CH>(grad + row + (i64)c * CH, gv[u]);
          ldn<CH>(inter + row + (i64)c * CH, yv[u]);
          if constexpr (BITMAP) {
            if (rmap) {
              const unsigned bits = CH == 8 ? brow[c] : (brow[c >> 1] >> ((c & 1) << 2)) & 15u;
#pragma unroll
              for (int v = 0; v < CH; ++v) mv[u][v] = ((bits >> v) & 1u) != 0u;
            }
          } else {
            if (rmap) ldn<CH>(rmap + row + (i64)c * CH, mv[u]);
          }
        }
      }
    };
    auto acc = [&](float g, bool msk, float y) { bwd_acc(sig_like, score_fn, g, msk, y, A, B); };
    if (vec) {
      for (int c0 = r; c0 < nch; c0 += U * TEAM) {
        alignas(16) TG gv[U][CH];
        alignas(16) float yv[U][CH];
        alignas(16) bool mv[U][CH];
        load_u(c0, gv, yv, mv);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (c0 + u * TEAM < nch) {
#pragma unroll
            for (int v = 0; v < CH; ++v) acc(__fmul_rn(scale, to_float(gv[u][v])), rmap ? mv[u][v] : true, yv[u][v]);
          }
      }
    } else {
      for (int e = r; e < E; e += TEAM)
        acc(__fmul_rn(scale, to_float(grad[row + e])), rmap ? map_at(e) : true, inter[row + e]);
    }
    A = TM::sum(A, red);
    if (sig_like) B = TM::sum(B, red);
    const float Ae = A + kEps;
    auto dx = [&](float g, bool msk, float y) -> float {
      return bwd_dx(sig_like, score_fn, normalize, aux_mode, pre_softmax, A, Ae, B, g, msk, y);
    };
    if (vec) {
      for (int c0 = r; c0 < nch; c0 += U * TEAM) {
        alignas(16) TG gv[U][CH];
        alignas(16) float yv[U][CH];
        alignas(16) bool mv[U][CH];
        load_u(c0, gv, yv, mv);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int c = c0 + u * TEAM;
          if (c < nch) {
            alignas(16) TO ov[CH];
#pragma unroll
            for (int v = 0; v < CH; ++v)
              ov[v] = from_float<TO>(dx(__fmul_rn(scale, to_float(gv[u][v])), rmap ? mv[u][v] : true, yv[u][v]));
            stn<CH>(out + row + (i64)c * CH, ov);
          }
        }
      }
    } else {
      for (int e = r; e < E; e += TEAM)
        out[row + e] = from_float<TO>(dx(__fmul_rn(scale, to_float(grad[row + e])), rmap ? map_at(e) : true, inter[row + e]));
    }
  }
}

// Backward of top-k when the gradient is zero off the routing map (post-softmax, sigmoid, sqrtsoftplus):
// two kernels read the map and, of grad and intermediate, only the selected entries (K per row instead of
// E), and write every output element: a 16-byte vector of zeros per chunk, then the chunk's selected
// elements. A thread takes chunks c = r, r + TEAM, ... (the order of router_bwd, so the sums and the output
// bits are the same) and reads each chunk's CH map bytes as one word (nonzero byte = selected). Both need
// 16-byte rows (E % CH == 0, aligned).
// - router_bwd_sel (few chunks per thread): two passes, each reading the map words and the entries they
//   select (the second mostly from cache); SEL_U map chunks are loaded before the entries they select.
// - router_bwd_sel_reg (several chunks per thread, where the second pass costs more than registers do; not for
//   the bit-packed map on teams of 128 or 512 threads, whose second pass reads a few map bytes from cache:
//   csrc/router.c states the rule and its measurements):
//   one pass; a thread keeps its first SELR_NR entries (offset, grad, intermediate) in registers from the
//   sum to the write and reads any further ones again (sel_rest); the map words of its first SELR_U chunks
//   of the next token load while this one is processed.
// SEL_U on H100 (T = 65536, one token per warp): one warp, fp32 (E = 256: 2 chunks a thread) 2, where 1 was 4%
// slower; bf16 (E = 256: 1 chunk a thread) 1, where 2 was 1.3-2.4% slower; wider teams 3 (bf16 E = 2304, 2.25
// chunks a thread: 3% faster than 4).
#ifndef MOE_RT_SEL_U_32
#define MOE_RT_SEL_U_32 2
#endif
#ifndef MOE_RT_SEL_U_32_BF
#define MOE_RT_SEL_U_32_BF 1
#endif
#ifndef MOE_RT_SEL_U_WIDE
#define MOE_RT_SEL_U_WIDE 3
#endif
#define MOE_RT_SEL_U(TEAM, CH) ((TEAM) == 32 ? ((CH) == 8 ? MOE_RT_SEL_U_32_BF : MOE_RT_SEL_U_32) : MOE_RT_SEL_U_WIDE)
#ifndef MOE_RT_SELR_U
#define MOE_RT_SELR_U 5
#endif
#ifndef MOE_RT_SELR_NR
#define MOE_RT_SELR_NR 4
#endif
template <int CH> struct MapWord {
  using type = unsigned;
  // bit 8*i set where byte i is nonzero
  __device__ __forceinline__ static unsigned long long bits(unsigned w) { return __vcmpne4(w, 0u) & 0x01010101u; }
};
template <> struct MapWord<8> {
  using type = unsigned long long;
  __device__ __forceinline__ static unsigned long long bits(unsigned long long w) {
    return (unsigned long long)(__vcmpne4((unsigned)w, 0u) & 0x01010101u) |
           ((unsigned long long)(__vcmpne4((unsigned)(w >> 32), 0u) & 0x01010101u) << 32);
  }
};

// One token's routing map as one word per chunk c of CH entries, and bits(word): bit 8 i set where entry i
// is selected. The byte map: the chunk's CH bytes. BITMAP: the chunk's CH bits of the bit-packed row (a byte,
// or half of one), spread to bit 8 i.
template <int CH, bool BITMAP>
struct MapRow {
  using W = typename MapWord<CH>::type;
  const W* __restrict__ p;
  __device__ __forceinline__ static MapRow at(const bool* m, i64 t, int E) {
    return {reinterpret_cast<const W*>(m) + t * (i64)(E / CH)};
  }
  __device__ __forceinline__ W operator[](int c) const { return p[c]; }
  __device__ __forceinline__ static unsigned long long bits(W w) { return MapWord<CH>::bits(w); }
};
template <int CH>
struct MapRow<CH, true> {
  using W = unsigned;
  const unsigned char* __restrict__ p;
  __device__ __forceinline__ static MapRow at(const bool* m, i64 t, int E) {
    return {reinterpret_cast<const unsigned char*>(m) + t * (i64)((E + 7) >> 3)};
  }
  __device__ __forceinline__ W operator[](int c) const {
    return CH == 8 ? (unsigned)p[c] : ((unsigned)p[c >> 1] >> ((c & 1) << 2)) & 15u;
  }
  __device__ __forceinline__ static unsigned long long bits(W w) {
    // 4 bits to bytes: w * (1 + 2^7 + 2^14 + 2^21) puts bit v at bit 8 v with no two terms overlapping
    const unsigned lo = ((w & 15u) * 0x204081u) & 0x01010101u;
    if constexpr (CH == 4) return lo;
    return (unsigned long long)lo | ((unsigned long long)((((w >> 4) & 15u) * 0x204081u) & 0x01010101u) << 32);
  }
};

// Constants and map-word type shared by the two selected-entry backward kernels: 4 token slots of one warp per
// block (TEAM = 32), 16-byte chunks of CH entries, one map word per chunk.
template <typename T, int TEAM, bool BITMAP = false>
struct SelBwd {
  static constexpr int SPB = TEAM == 32 ? 4 : 1;
  static constexpr int CH = sizeof(T) == 2 ? 8 : 4;
  using MW = MapRow<CH, BITMAP>;
  using W = typename MW::W;
};

// router_bwd_sel_reg's entries past a thread's first `skip`, in order, read from memory: with out == nullptr
// their sums are added to ab and returned; otherwise their gradients are written (A = ab.x, Ae, B). Kept
// out of line: it runs only for a thread with more selected entries than it holds in registers.
template <typename T, int CH, int TEAM, typename MR>
__device__ __noinline__ float2 sel_rest(const T* __restrict__ grad, const float* __restrict__ inter, MR wrow,
                                        i64 row, int nch, int r, int skip, float scale, bool sig_like, int score_fn,
                                        int K, float2 ab, float Ae, float B, T* __restrict__ out) {
  int seen = 0;
  for (int c = r; c < nch; c += TEAM)
    for (unsigned long long b = MR::bits(wrow[c]); b; b &= b - 1) {
      if (seen++ < skip) continue;
      const i64 e = row + (i64)c * CH + ((__ffsll((long long)b) - 1) >> 3);
      const float g = __fmul_rn(scale, to_float(grad[e])), y = inter[e];
      if (out == nullptr) bwd_acc(sig_like, score_fn, g, true, y, ab.x, ab.y);
      else out[e] = from_float<T>(bwd_dx(sig_like, score_fn, K > 1, false, false, ab.x, Ae, B, g, true, y));
    }
  return ab;
}

template <typename T, int TEAM, bool BITMAP = false>
__global__ void __launch_bounds__(TEAM == 32 ? 128 : TEAM, TEAM == 32 ? 16 : 1)
router_bwd_sel(const T* __restrict__ grad, const bool* __restrict__ rmap, const float* __restrict__ inter,
               i64 num_tokens, int E, int K, int score_fn, float scale, T* __restrict__ out) {
  using S = SelBwd<T, TEAM, BITMAP>;
  using TM = Team<TEAM>;
  using MW = typename S::MW;
  using W = typename S::W;
  constexpr int SPB = S::SPB, CH = S::CH, U = MOE_RT_SEL_U(TEAM, CH);
  __shared__ float red[32];
  const int slot = threadIdx.x / TEAM, r = threadIdx.x % TEAM;
  const bool sig_like = score_fn != SOFTMAX;
  const int nch = E / CH;

  for (i64 t = (i64)blockIdx.x * SPB + slot; t < num_tokens; t += (i64)gridDim.x * SPB) {
    const i64 row = t * (i64)E;
    const MW wrow = MW::at(rmap, t, E);
    float A = 0.0f, B = 0.0f;
    if (TEAM == 32 && nch <= U * TEAM) {
      // One warp, one round of chunks: the map words and each chunk's first selected entry stay in registers,
      // and each chunk is written once, its first entry placed in the zero vector (later entries of the chunk,
      // rare, are read again and written after it). H100, T = 65536, E = 256: bf16 softmax 39.6 -> 38.4 us,
      // fp32 55.0 -> 53.1 us (against reading the map and the entries again after the sums).
      W w[U];
      float g0[U], y0[U];
      int p0[U];
#pragma unroll
      for (int u = 0; u < U; ++u) w[u] = r + u * TEAM < nch ? wrow[r + u * TEAM] : (W)0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        unsigned long long b = MW::bits(w[u]);
        p0[u] = -1;
        g0[u] = y0[u] = 0.0f;
        if (b) {
          p0[u] = (__ffsll((long long)b) - 1) >> 3;
          const i64 e = row + (i64)(r + u * TEAM) * CH + p0[u];
          g0[u] = __fmul_rn(scale, to_float(grad[e]));
          y0[u] = inter[e];
          bwd_acc(sig_like, score_fn, g0[u], true, y0[u], A, B);
          for (b &= b - 1; b; b &= b - 1) {
            const i64 e2 = row + (i64)(r + u * TEAM) * CH + ((__ffsll((long long)b) - 1) >> 3);
            bwd_acc(sig_like, score_fn, __fmul_rn(scale, to_float(grad[e2])), true, inter[e2], A, B);
          }
        }
      }
      A = TM::sum(A, red);
      if (sig_like) B = TM::sum(B, red);
      const float Ae = A + kEps;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = r + u * TEAM;
        if (c < nch) {
          alignas(16) T o[CH];
          const T d = from_float<T>(p0[u] >= 0 ? bwd_dx(sig_like, score_fn, K > 1, false, false, A, Ae, B, g0[u],
                                                        true, y0[u])
                                               : 0.0f);
#pragma unroll
          for (int v = 0; v < CH; ++v) o[v] = v == p0[u] ? d : from_float<T>(0.0f);
          stn<CH>(out + row + (i64)c * CH, o);
          unsigned long long b = MW::bits(w[u]);
          for (b &= b - 1; b; b &= b - 1) {  // same thread: after the vector
            const i64 e = row + (i64)c * CH + ((__ffsll((long long)b) - 1) >> 3);
            out[e] = from_float<T>(bwd_dx(sig_like, score_fn, K > 1, false, false, A, Ae, B,
                                          __fmul_rn(scale, to_float(grad[e])), true, inter[e]));
          }
        }
      }
      continue;
    }
    for (int c0 = r; c0 < nch; c0 += U * TEAM) {
      W w[U];
#pragma unroll
      for (int u = 0; u < U; ++u) w[u] = c0 + u * TEAM < nch ? wrow[c0 + u * TEAM] : (W)0;
#pragma unroll
      for (int u = 0; u < U; ++u)
        for (unsigned long long b = MW::bits(w[u]); b; b &= b - 1) {
          const i64 e = row + (i64)(c0 + u * TEAM) * CH + ((__ffsll((long long)b) - 1) >> 3);
          bwd_acc(sig_like, score_fn, __fmul_rn(scale, to_float(grad[e])), true, inter[e], A, B);
        }
    }
    A = TM::sum(A, red);
    if (sig_like) B = TM::sum(B, red);
    const float Ae = A + kEps;
    // the map words and the selected entries are read again (L1 hits) rather than kept in registers
    for (int c0 = r; c0 < nch; c0 += U * TEAM) {
      W w[U];
#pragma unroll
      for (int u = 0; u < U; ++u) w[u] = c0 + u * TEAM < nch ? wrow[c0 + u * TEAM] : (W)0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * TEAM;
        if (c < nch) {
          alignas(16) T zero[CH];
#pragma unroll
          for (int v = 0; v < CH; ++v) zero[v] = from_float<T>(0.0f);
          stn<CH>(out + row + (i64)c * CH, zero);
          for (unsigned long long b = MW::bits(w[u]); b; b &= b - 1) {  // same thread: after the zeros
            const i64 e = row + (i64)c * CH + ((__ffsll((long long)b) - 1) >> 3);
            out[e] = from_float<T>(bwd_dx(sig_like, score_fn, K > 1, false, false, A, Ae, B,
                                          __fmul_rn(scale, to_float(grad[e])), true, inter[e]));
          }
        }
      }
    }
  }
}

// Blocks a multiprocessor router_bwd_sel_reg is built for: 0 (no bound: the code of no bound given), but 8 for the bit-packed map with
// fp32 rows on teams of up to 128 threads: left free it took 72 registers where the byte map's kernel takes 64
// (7 blocks of 128 threads against 8). (At E = 2304 on 128-thread teams it still ran 12% slower than the byte
// map's, 0.444 against 0.395 ms on the H100; the planner takes router_bwd_sel there now.)
#ifndef MOE_RT_SELR_MINB_BITMAP_F32
#define MOE_RT_SELR_MINB_BITMAP_F32 8
#endif
#define MOE_RT_SELR_MINB(T, TEAM, BITMAP) \
  ((BITMAP) && sizeof(T) == 4 && (TEAM) <= 128 ? MOE_RT_SELR_MINB_BITMAP_F32 : 0)

template <typename T, int TEAM, bool BITMAP = false>
__global__ void __launch_bounds__(TEAM == 32 ? 128 : TEAM, MOE_RT_SELR_MINB(T, TEAM, BITMAP))
router_bwd_sel_reg(const T* __restrict__ grad, const bool* __restrict__ rmap, const float* __restrict__ inter,
                   i64 num_tokens, int E, int K, int score_fn, float scale, T* __restrict__ out) {
  using S = SelBwd<T, TEAM, BITMAP>;
  using TM = Team<TEAM>;
  using MW = typename S::MW;
  using W = typename S::W;
  constexpr int SPB = S::SPB, CH = S::CH, U = MOE_RT_SELR_U, NR = MOE_RT_SELR_NR;
  __shared__ float red[64];
  const int slot = threadIdx.x / TEAM, r = threadIdx.x % TEAM;
  const bool sig_like = score_fn != SOFTMAX;
  const int nch = E / CH;
  const i64 stride = (i64)gridDim.x * SPB;
  auto load_words = [&](i64 tt, int c0, W (&w)[U]) {
    const MW wrow = MW::at(rmap, tt, E);
#pragma unroll
    for (int u = 0; u < U; ++u) w[u] = tt < num_tokens && c0 + u * TEAM < nch ? wrow[c0 + u * TEAM] : (W)0;
  };
  alignas(16) T zero[CH];
#pragma unroll
  for (int v = 0; v < CH; ++v) zero[v] = from_float<T>(0.0f);

  W wnext[U];
  i64 t = (i64)blockIdx.x * SPB + slot;
  load_words(t, r, wnext);
  for (; t < num_tokens; t += stride) {
    W w[U];
#pragma unroll
    for (int u = 0; u < U; ++u) w[u] = wnext[u];
    load_words(t + stride, r, wnext);
    const i64 row = t * (i64)E;
    // Zeros for every chunk (this thread patches its entries below), and the offsets in the row of its
    // first NR selected entries, in order.
    int off[NR];
    int ne = 0;
    bool more = false;
    for (int c0 = r; c0 < nch; c0 += U * TEAM) {
      if (c0 != r) load_words(t, c0, w);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * TEAM;
        if (c < nch) {
          stn<CH>(out + row + (i64)c * CH, zero);
          for (unsigned long long b = MW::bits(w[u]); b; b &= b - 1) {
            const int o = c * CH + ((__ffsll((long long)b) - 1) >> 3);
#pragma unroll
            for (int q = 0; q < NR; ++q)
              if (q == ne) off[q] = o;
            more |= ne == NR;
            ne += ne < NR ? 1 : 0;
          }
        }
      }
    }
    float gq[NR], yq[NR];
#pragma unroll
    for (int q = 0; q < NR; ++q)
      if (q < ne) {
        gq[q] = __fmul_rn(scale, to_float(grad[row + off[q]]));
        yq[q] = inter[row + off[q]];
      }
    float A = 0.0f, B = 0.0f;
#pragma unroll
    for (int q = 0; q < NR; ++q)
      if (q < ne) bwd_acc(sig_like, score_fn, gq[q], true, yq[q], A, B);
    if (more) {  // entries past the first NR, in order, read from memory (rare)
      const float2 ab = sel_rest<T, CH, TEAM>(grad, inter, MW::at(rmap, t, E), row, nch, r, NR, scale, sig_like,
                                             score_fn, K, make_float2(A, B), 0.0f, 0.0f, nullptr);
      A = ab.x;
      B = ab.y;
    }
    if (sig_like) {
      TM::sum2(A, B, red);
    } else {
      A = TM::sum(A, red);
    }
    const float Ae = A + kEps;
#pragma unroll
    for (int q = 0; q < NR; ++q)
      if (q < ne)
        out[row + off[q]] = from_float<T>(bwd_dx(sig_like, score_fn, K > 1, false, false, A, Ae, B, gq[q], true, yq[q]));
    if (more)
      sel_rest<T, CH, TEAM>(grad, inter, MW::at(rmap, t, E), row, nch, r, NR, scale, sig_like, score_fn, K,
                            make_float2(A, B), Ae, B, out);
  }
}

// ---- backward of top-k from the dense indices (no routing map) -----------------------------------------
// One warp per token, 4 tokens a block. Lane j holds the row's selected entries j and j + 32 of topk_idx
// (idx_bytes-byte ints, any order): their sums in a fixed order (each lane, then warp_sum), then the row:
// zeros (pre-softmax: y * (0 - A), dense), and after them the K selected entries. An id outside [-1, E) is
// recorded in the device's error word (err) and, like -1, selects nothing. vec: 16-byte rows (E % CH == 0,
// grad, inter and out aligned).
template <typename T>
__global__ void __launch_bounds__(128)
router_bwd_idx(const T* __restrict__ grad, const void* __restrict__ topk_idx, int idx_bytes,
               const float* __restrict__ inter, i64 num_tokens, int E, int K, int score_fn, int pre_softmax,
               float scale, T* __restrict__ out, int vec, unsigned* __restrict__ err) {
  constexpr int CH = sizeof(T) == 2 ? 8 : 4;
  const int slot = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool sig_like = score_fn != SOFTMAX;
  const int nch = vec ? E / CH : 0;
  for (i64 t = (i64)blockIdx.x * 4 + slot; t < num_tokens; t += (i64)gridDim.x * 4) {
    const i64 row = t * (i64)E;
    auto load = [&](int j, int& e, float& g, float& y) {
      const i64 i = t * K + j;
      const i64 v = idx_bytes == 4   ? (i64) static_cast<const int*>(topk_idx)[i]
                    : idx_bytes == 2 ? (i64) static_cast<const short*>(topk_idx)[i]
                                     : static_cast<const i64*>(topk_idx)[i];
      if (v >= 0 && v < E) {
        e = (int)v;
        g = __fmul_rn(scale, to_float(grad[row + e]));
        y = inter[row + e];
      } else if (v != -1) {
        record_bad_expert_id(err, MOE_RT_ERR_ROUTER_BWD, v, i, E);
      }
    };
    int e0 = -1, e1 = -1;
    float g0 = 0.0f, y0 = 0.0f, g1 = 0.0f, y1 = 0.0f;
    if (lane < K) load(lane, e0, g0, y0);
    if (lane + 32 < K) load(lane + 32, e1, g1, y1);
    float A = 0.0f, B = 0.0f;
    bwd_acc(sig_like, score_fn, g0, e0 >= 0, y0, A, B);
    bwd_acc(sig_like, score_fn, g1, e1 >= 0, y1, A, B);
    A = warp_sum(A);
    if (sig_like) B = warp_sum(B);
    const float Ae = A + kEps;
    auto dx = [&](float g, bool msk, float y) {
      return from_float<T>(bwd_dx(sig_like, score_fn, K > 1, false, pre_softmax, A, Ae, B, g, msk, y));
    };
    if (pre_softmax) {
      if (vec) {
        for (int c = lane; c < nch; c += 32) {
          alignas(16) float yv[CH];
          alignas(16) T o[CH];
          ldn<CH>(inter + row + (i64)c * CH, yv);
#pragma unroll
          for (int v = 0; v < CH; ++v) o[v] = dx(0.0f, false, yv[v]);
          stn<CH>(out + row + (i64)c * CH, o);
        }
      } else {
        for (int e = lane; e < E; e += 32) out[row + e] = dx(0.0f, false, inter[row + e]);
      }
    } else if (vec) {
      alignas(16) T zero[CH];
#pragma unroll
      for (int v = 0; v < CH; ++v) zero[v] = from_float<T>(0.0f);
      for (int c = lane; c < nch; c += 32) stn<CH>(out + row + (i64)c * CH, zero);
    } else {
      for (int e = lane; e < E; e += 32) out[row + e] = from_float<T>(0.0f);
    }
    __syncwarp();  // orders the row before the patch
    if (e0 >= 0) out[row + e0] = dx(g0, true, y0);
    if (e1 >= 0) out[row + e1] = dx(g1, true, y1);
    __syncwarp();
  }
}

// ---- aux loss -----------------------------------------------------------------------------------------
// tokens_per_expert is read as given: float (tkind 0), int32 (1) or int64 (2), converted to float (round to
// nearest, as a cast on the host would).
__device__ __forceinline__ float tpe_at(const void* t, int tkind, i64 c) {
  if (tkind == 1) return (float)static_cast<const int*>(t)[c];
  if (tkind == 2) return (float)static_cast<const long long*>(t)[c];
  return static_cast<const float*>(t)[c];
}

// loss = coeff * sum_c tpe[c] * sum_r probs[r, c]. Block b sums rows [b*rpb, (b+1)*rpb) per column, dots
// with tpe and writes partial[b]; aux_loss_final adds the partials in a fixed order. No atomics.
template <typename T>
__global__ void __launch_bounds__(256)
aux_loss_partial(const T* __restrict__ probs, i64 R, int C, const void* __restrict__ tpe, int tkind, i64 rpb,
                 float* __restrict__ partial, int vec) {
  __shared__ float scratch[32];
  constexpr int CHV = 16 / (int)sizeof(T);
  const int tid = threadIdx.x;
  const i64 r0 = (i64)blockIdx.x * rpb, r1 = min(R, r0 + rpb);
  float acc = 0.0f;
  auto run = [&](auto chv) {
    constexpr int CH = decltype(chv)::value;
    const int nch = C / CH;
    const int RS = nch >= 256 ? 1 : 256 / nch;
    const int rsub = tid / (nch < 256 ? nch : 256);
    if (rsub >= RS) return;
    for (int c = tid % (nch < 256 ? nch : 256); c < nch; c += 256) {
      float cs[CH];
#pragma unroll
      for (int v = 0; v < CH; ++v) cs[v] = 0.0f;
      i64 r = r0 + rsub;
      for (; r + 3 * RS < r1; r += 4 * RS) {
        alignas(16) T a[CH], b[CH], d[CH], e[CH];
        ldn<CH>(probs + r * C + (i64)c * CH, a);
        ldn<CH>(probs + (r + RS) * C + (i64)c * CH, b);
        ldn<CH>(probs + (r + 2 * RS) * C + (i64)c * CH, d);
        ldn<CH>(probs + (r + 3 * RS) * C + (i64)c * CH, e);
#pragma unroll
        for (int v = 0; v < CH; ++v)
          cs[v] += ((to_float(a[v]) + to_float(b[v])) + (to_float(d[v]) + to_float(e[v])));
      }
      for (; r < r1; r += RS) {
        alignas(16) T a[CH];
        ldn<CH>(probs + r * C + (i64)c * CH, a);
#pragma unroll
        for (int v = 0; v < CH; ++v) cs[v] += to_float(a[v]);
      }
#pragma unroll
      for (int v = 0; v < CH; ++v) acc += tpe_at(tpe, tkind, (i64)c * CH + v) * cs[v];
    }
  };
  if (vec) run(IC<CHV>{});
  else run(IC<1>{});
  const float s = block_sum(acc, scratch);
  if (tid == 0) partial[blockIdx.x] = s;
}

// total_num_tokens read on the device (total_kind 1: int32, 2: int64; 0: none, coeff is final): coeff
// arrives as fl(fl(E*coeff)/topk) and is divided by T twice here, the host's order (no host read, so a
// CUDA graph replays with the value in memory at launch).
__device__ __forceinline__ float aux_coeff(float coeff, const void* total, int total_kind) {
  if (total_kind == 0) return coeff;
  const float t = total_kind == 1 ? (float)static_cast<const int*>(total)[0]
                                  : (float)static_cast<const long long*>(total)[0];
  return (coeff / t) / t;
}

template <typename T>
__global__ void __launch_bounds__(256)
aux_loss_final(const float* __restrict__ partial, int nb, float coeff, T* __restrict__ out,
               const void* __restrict__ total, int total_kind) {
  __shared__ float scratch[32];
  coeff = aux_coeff(coeff, total, total_kind);
  float acc = 0.0f;
  for (int i = threadIdx.x; i < nb; i += 256) acc += partial[i];
  const float s = block_sum(acc, scratch);
  if (threadIdx.x == 0) out[0] = from_float<T>(coeff * s);
}

// grad_probs[r, c] = (coeff * tpe[c]) * grad. DEV_TOTAL: total_num_tokens read on the device (aux_coeff,
// total_kind 1 or 2); without it coeff is final and total is not read. A template argument, not the run-time
// total_kind == 0 test: that test took the host-total build from 40 to 48 registers (6 -> 5 resident blocks).
template <typename T, bool DEV_TOTAL>
__global__ void __launch_bounds__(256)
aux_loss_bwd(const T* __restrict__ grad, const void* __restrict__ tpe, int tkind, i64 R, int C, float coeff,
             i64 rpb, T* __restrict__ out, int vec, const void* __restrict__ total, int total_kind) {
  const int tid = threadIdx.x;
  if (DEV_TOTAL) coeff = aux_coeff(coeff, total, total_kind);
  const float g = to_float(grad[0]);
  const i64 r0 = (i64)blockIdx.x * rpb, r1 = min(R, r0 + rpb);
  auto run = [&](auto chv) {
    constexpr int CH = decltype(chv)::value;
    const int nch = C / CH;
    const int RS = nch >= 256 ? 1 : 256 / nch;
    const int rsub = tid / (nch < 256 ? nch : 256);
    if (rsub >= RS) return;
    for (int c = tid % (nch < 256 ? nch : 256); c < nch; c += 256) {
      alignas(16) T o[CH];
#pragma unroll
      for (int v = 0; v < CH; ++v) o[v] = from_float<T>((coeff * tpe_at(tpe, tkind, (i64)c * CH + v)) * g);
      for (i64 r = r0 + rsub; r < r1; r += RS) stn<CH>(out + r * C + (i64)c * CH, o);
    }
  };
  if (vec) run(IC<16 / (int)sizeof(T)>{});
  else run(IC<1>{});
}
