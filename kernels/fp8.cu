// FP8 block quantization (docs/fp8.md): one fp32 scale per `block` channels of a token, e4m3 values.
//
//   quantize_fp8    one warp per (token, block): amax = max |x| (integer max of the fp32 bit patterns, so the
//                   order of the reduction cannot matter), scale = amax / 448 (1 where that is 0),
//                   q = e4m3(x / scale), round to nearest even, saturating to +-448; with block = 128, H % 8
//                   == 0 and 16-byte rows (the common case), a half-warp per block (quantize_pairs_128)
//   dequantize_fp8  one warp per (token, block): y = T(float(q) * scale); with block = 128, H % 8 == 0 and
//                   aligned rows, a half-warp per block (dequant_pairs_128)
//   fp8_pack_rows   a pre-quantized pair (codes, scales) into the packed rows of a one-pass FP8 dispatch
//
// Packed rows (EpGroup.dispatch(fp8=True), docs/ep.md §9): row t holds its H codes, then at byte HS = ceil4(H)
// its nb fp32 scales, then zero bytes up to the row stride (a multiple of 16 bytes), so that the transports
// move codes and scales in one pass of 16-byte units. quantize_fp8 writes that layout directly when given
// q_stride > H (scales = q + HS, s_stride = q_stride / 4); fp8_pack_rows builds it from a pair.
//
// Bit-exact with the NumPy reference (moe_rt/reference/fp8.py): the divisions and products are IEEE fp32
// (div.rn / mul.rn without .ftz, whatever -ftz says: subnormal scales and products are kept), the zero test
// of the scale is on its bits, and fp32 -> bf16 rounds on the bits. V4: each lane takes 4 consecutive
// channels (block % 128 == 0, H % 4 == 0, pointers aligned; the host checks); else one channel per lane.
#include "moe_rt/fp8.cuh"

using namespace moe_rt;

// quantize_fp8's two-block items (quantize_pairs_128): items a warp holds in flight; 0: by type, 2 for bf16
// (its words need fewer registers: 2 was level at T = 4096 and 6% faster at 16384 on H200, no spills), 1 for
// fp32 and fp16 (2 spills there)
#ifndef MOE_RT_QUANT_U
#define MOE_RT_QUANT_U 0
#endif
// dequantize_fp8's two-block items (dequant_pairs_128) a warp holds in flight
#ifndef MOE_RT_DEQUANT_U
#define MOE_RT_DEQUANT_U 2
#endif
// quantize_fp8's blocks of 256 threads a multiprocessor (5: 48 registers)
#ifndef MOE_RT_QUANT_MINB
#define MOE_RT_QUANT_MINB 5
#endif

namespace {

__device__ __forceinline__ unsigned warp_max_u32(unsigned v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);  // one instruction (sm_80+)
#else
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const unsigned o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o > v ? o : v;
  }
  return v;
#endif
}

// q, r = divmod(i, d) of a grid-stride index i, kept as i advances by a fixed stride: two divisions when made
// (32-bit where i, stride and d fit), none a step (a 64-bit division per work item cost the quantize more
// than its arithmetic).
struct StepDivmod {
  i64 q, r, sq, sr, d;
  __device__ StepDivmod(i64 i, i64 stride, i64 d_) : d(d_) {
    if (((unsigned long long)(i | stride | d_) >> 32) == 0) {
      q = (unsigned)i / (unsigned)d_;
      sq = (unsigned)stride / (unsigned)d_;
    } else {
      q = i / d_;
      sq = stride / d_;
    }
    r = i - q * d_;
    sr = stride - sq * d_;
  }
  __device__ __forceinline__ void advance() {
    q += sq;
    r += sr;
    if (r >= d) {
      r -= d;
      ++q;
    }
  }
};

// Four consecutive elements of T (loaded as fp32 by load4: 8-byte loads for 16-bit T, 16-byte for fp32).
template <typename T> struct alignas(4 * sizeof(T)) Four { T v[4]; };

template <typename T>
__device__ __forceinline__ void load4(const T* p, float* f) {
  Four<T> r;
  if (sizeof(T) == 2) *reinterpret_cast<uint2*>(&r) = *reinterpret_cast<const uint2*>(p);
  else *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int j = 0; j < 4; ++j) f[j] = to_float(r.v[j]);
}

// The (token, block) work items of a grid-stride loop, one per warp: item w is token t = w / nb, channels
// [c0, c1) of block w % nb (the last block of a row may be shorter).
struct BlockSpan {
  i64 w, work, stride;
  i64 t = 0;
  int c0 = 0, c1 = 0, H, block, nb;
  bool started = false;
  StepDivmod tb;  // (t, w % nb) of w
  __device__ BlockSpan(i64 num_tokens, int H_, int block_, int nb_)
      : w(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5), work(num_tokens * nb_),
        stride(((i64)gridDim.x * blockDim.x) >> 5), H(H_), block(block_), nb(nb_), tb(w, stride, nb_) {}
  __device__ bool next() {
    if (started) {
      w += stride;
      tb.advance();
    }
    started = true;
    if (w >= work) return false;
    t = tb.q;
    c0 = (int)tb.r * block;
    c1 = min(c0 + block, H);
    return true;
  }
};

// Eight consecutive channels of a block for quantize_pairs_128 (one 16-byte load of 16-bit T, two of fp32):
// amax_bits() is the largest |x| as fp32 bits, codes() the e4m3 codes of x / s (e4m3_codes' bits).
template <typename T> struct Chunk8 {
  float f[8];
  __device__ __forceinline__ void load(const T* p) {
    T r[8];
#pragma unroll
    for (int k = 0; k < (int)(sizeof(r) / 16); ++k)
      reinterpret_cast<uint4*>(r)[k] = reinterpret_cast<const uint4*>(p)[k];
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = to_float(r[j]);
  }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = 0.0f;
  }
  __device__ __forceinline__ unsigned amax_bits() const {
    unsigned m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = max(m, abs_bits(f[j]));
    return m;
  }
  __device__ __forceinline__ void codes(float s, unsigned (&c)[2]) const { e4m3_codes<8>(f, s, c); }
};

// bf16 stays in its words: |x| of two channels is one mask, their largest a 16-bit pair max (bf16 -> fp32
// is a shift, so the order of the bits is kept: the same amax bits), the quotients are formed from |x| and
// the signs go into the codes' sign bits at the end (e4m3 rounds and saturates symmetrically: the same
// codes, -0 included). Outside scale_in_fast_range (NaN, inf, extreme scales) the signed values take div_rn.
template <> struct Chunk8<__nv_bfloat16> {
  unsigned w[4];
  __device__ __forceinline__ void load(const __nv_bfloat16* p) {
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    w[0] = r.x, w[1] = r.y, w[2] = r.z, w[3] = r.w;
  }
  __device__ __forceinline__ void clear() { w[0] = w[1] = w[2] = w[3] = 0u; }
  __device__ __forceinline__ unsigned amax_bits() const {
    const unsigned m = __vmaxu2(__vmaxu2(w[0] & 0x7fff7fffu, w[1] & 0x7fff7fffu),
                                __vmaxu2(w[2] & 0x7fff7fffu, w[3] & 0x7fff7fffu));
    return max(m << 16, m & 0xffff0000u);
  }
  __device__ __forceinline__ void codes(float s, unsigned (&c)[2]) const {
    if (scale_in_fast_range(s)) {
      const float r = div_rn(1.0f, s), ns = -s;
      unsigned h[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const unsigned a = w[k] & 0x7fff7fffu;
        h[k] = to_e4m3x2(div_by_scale_pos(__uint_as_float(a << 16), ns, r),
                         div_by_scale_pos(__uint_as_float(a & 0xffff0000u), ns, r));
      }
      // byte j of __byte_perm(w[2q], w[2q + 1], 0x7531) holds channel 4q + j's sign in its bit 7
      c[0] = (h[0] | h[1] << 16) | (__byte_perm(w[0], w[1], 0x7531) & 0x80808080u);
      c[1] = (h[2] | h[3] << 16) | (__byte_perm(w[2], w[3], 0x7531) & 0x80808080u);
    } else {
      float f[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
      }
      e4m3_codes<8>(f, s, c);
    }
  }
};

template <typename T> struct QuantItems { static constexpr int value = MOE_RT_QUANT_U ? MOE_RT_QUANT_U : 1; };
template <> struct QuantItems<__nv_bfloat16> { static constexpr int value = MOE_RT_QUANT_U ? MOE_RT_QUANT_U : 2; };

__device__ __forceinline__ unsigned half_warp_max_u32(unsigned v) {
#pragma unroll
  for (int m = 8; m > 0; m >>= 1) {
    const unsigned o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o > v ? o : v;
  }
  return v;
}

// quantize_fp8 where block = 128, H % 8 == 0, x 16-byte and q 8-byte aligned and q_stride % 8 == 0. An item is
// two blocks of a row, a half-warp each, 8 channels a lane, so the per-block work (the max, the scale, its
// reciprocal) is shared by 128 values; U items a warp are loaded before the first is reduced; the quotients
// by div_by_scale where the scale allows (same bits as div_rn). Measured on H200 (bf16, H = 7168, T = 16384,
// ncu): the earlier form (one block a warp, 4 channels and four div_rn a lane, four items in flight) ran 164
// warp instructions a block at 63% issue, 40% of the copy rate; this one ran 106 at 73%, 53%. I = unsigned
// (32-bit item counters) and bf16 kept in its words (Chunk8) then took it from 0.138 to 0.116 ms, 73% of the
// copy rate (BENCHMARKS.md).
template <typename T, int U, typename I>
__device__ __forceinline__ void quantize_pairs_128(const T* __restrict__ x, unsigned char* __restrict__ q,
                                                   float* __restrict__ scales, I num_tokens, int H, int nb,
                                                   i64 q_stride, i64 s_stride) {
  const int lane = threadIdx.x & 31, hl = lane & 15;
  const I np = (I)((nb + 1) >> 1);  // block pairs a row
  const I work = num_tokens * np, stride = (I)(((i64)gridDim.x * blockDim.x) >> 5);
  const I first = (I)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  I tq = first / np, tr = first - tq * np;  // (token, pair) of the warp's next item, stepped by stride
  const I sq = stride / np, sr = stride - sq * np;
  for (I w0 = first; w0 < work; w0 += U * stride) {
    Chunk8<T> v[U];
    I t[U];
    int c[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      t[u] = tq;
      c[u] = ((int)tr * 2 + (lane >> 4)) * 128 + hl * 8;  // this half's block, this lane's 8 channels
      tq += sq;
      tr += sr;
      if (tr >= np) tr -= np, ++tq;
      if (t[u] < num_tokens && c[u] < H) v[u].load(x + t[u] * (i64)H + c[u]);  // H % 8 == 0: all in or out
      else v[u].clear();
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t[u] >= num_tokens) break;  // the warp's item: every lane leaves together
      const int blk = c[u] >> 7;
      unsigned char* qrow = q + t[u] * q_stride;
      if (q_stride > H && blk == nb - 1) zero_packed_gaps(qrow, H, nb, q_stride, hl, 16);  // packed rows
      const float scale = e4m3_block_scale(half_warp_max_u32(v[u].amax_bits()));
      if (c[u] >= H) continue;  // the second half of a row's odd last block (no shuffle follows)
      if (hl == 0) scales[t[u] * s_stride + blk] = scale;
      unsigned codes[2];
      v[u].codes(scale, codes);
      *reinterpret_cast<uint2*>(qrow + c[u]) = make_uint2(codes[0], codes[1]);
    }
  }
}

// dequantize_fp8 where block = 128, H % 8 == 0, codes 8-byte and y 16-byte aligned: items of two blocks as in
// quantize_pairs_128, 8 codes a lane, U items loaded before the first is converted. 16-bit T: a lane's 8
// channels are consecutive (one 8-byte load, one 16-byte store); fp32: channels [4 hl, 4 hl + 4) and 64 past
// them, so that each 16-byte store instruction of a half-warp covers 256 consecutive bytes (8 consecutive
// fp32 channels a lane made every store write half sectors: 1.4x slower at T = 16384 on H200). The
// one-block-a-warp form (4 codes a lane) ran at 35-63% of the copy rate for bf16 on H200 (BENCHMARKS.md).
template <typename T, int U, typename I>
__device__ __forceinline__ void dequant_pairs_128(const unsigned char* __restrict__ q, const float* __restrict__ scales,
                                                  T* __restrict__ y, I num_tokens, int H, int nb) {
  constexpr bool SPLIT = sizeof(T) == 4;
  constexpr int GAP = SPLIT ? 64 : 4;  // channels from a lane's first four to its second four
  const int lane = threadIdx.x & 31, hl = lane & 15;
  const I np = (I)((nb + 1) >> 1);
  const I work = num_tokens * np, stride = (I)(((i64)gridDim.x * blockDim.x) >> 5);
  const I first = (I)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  I tq = first / np, tr = first - tq * np;
  const I sq = stride / np, sr = stride - sq * np;
  for (I w0 = first; w0 < work; w0 += U * stride) {
    unsigned cw[U][2];
    float sc[U];
    i64 at[U];    // the lane's first element, or -1
    bool two[U];  // the lane's second four channels are in the row (a short last block may end before them)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const I t = tq;
      const int c = ((int)tr * 2 + (lane >> 4)) * 128 + hl * (SPLIT ? 4 : 8);
      tq += sq;
      tr += sr;
      if (tr >= np) tr -= np, ++tq;
      at[u] = -1;
      two[u] = !SPLIT || c + GAP < H;  // H % 8 == 0: each four channels all in or all out
      if (t < num_tokens && c < H) {
        at[u] = t * (i64)H + c;
        if (SPLIT) {
          cw[u][0] = *reinterpret_cast<const unsigned*>(q + at[u]);
          cw[u][1] = two[u] ? *reinterpret_cast<const unsigned*>(q + at[u] + GAP) : 0u;
        } else {
          const uint2 w = *reinterpret_cast<const uint2*>(q + at[u]);
          cw[u][0] = w.x, cw[u][1] = w.y;
        }
        sc[u] = scales[t * (i64)nb + (c >> 7)];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (at[u] < 0) continue;
      struct alignas(16) { T v[4]; } lo, hi;
      dequant4(cw[u][0], sc[u], lo.v);
      dequant4(cw[u][1], sc[u], hi.v);
      if (SPLIT) {
        *reinterpret_cast<uint4*>(y + at[u]) = *reinterpret_cast<const uint4*>(&lo);
        if (two[u]) *reinterpret_cast<uint4*>(y + at[u] + GAP) = *reinterpret_cast<const uint4*>(&hi);
      } else {
        const uint2 a = *reinterpret_cast<const uint2*>(&lo), b = *reinterpret_cast<const uint2*>(&hi);
        *reinterpret_cast<uint4*>(y + at[u]) = make_uint4(a.x, a.y, b.x, b.y);
      }
    }
  }
}

}  // namespace

// x [T, H] (T's elements), q [T, q_stride] e4m3 bytes (the first H of a row), scales [T, s_stride] fp32 (the first
// nb), nb = ceil(H / block). Separate arrays: q_stride = H, s_stride = nb. Packed rows (q_stride > H): scales =
// q + ceil4(H) bytes, s_stride = q_stride / 4; the warp of a row's last block also zeroes the row's other bytes.
template <typename T, bool V4>
__global__ void __launch_bounds__(256, MOE_RT_QUANT_MINB)
    quantize_fp8(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scales, i64 num_tokens,
                 int H, int block, int nb, i64 q_stride, i64 s_stride) {
  if constexpr (V4) {
    if (block == 128 && H % 8 == 0 && (reinterpret_cast<unsigned long long>(x) & 15) == 0 &&
        (reinterpret_cast<unsigned long long>(q) & 7) == 0 && (q_stride & 7) == 0) {
      // 32-bit item counters where the items and a grid stride past them fit (any real shape): fewer
      // instructions an item than 64-bit ones
      const i64 items = num_tokens * ((nb + 1) >> 1), warps = ((i64)gridDim.x * blockDim.x) >> 5;
      if (items + (i64)QuantItems<T>::value * warps < ((i64)1 << 32))
        quantize_pairs_128<T, QuantItems<T>::value, unsigned>(x, q, scales, (unsigned)num_tokens, H, nb, q_stride,
                                                              s_stride);
      else
        quantize_pairs_128<T, QuantItems<T>::value, i64>(x, q, scales, num_tokens, H, nb, q_stride, s_stride);
      return;
    }
  }
  const int lane = threadIdx.x & 31;
  for (BlockSpan sp(num_tokens, H, block, nb); sp.next();) {
    const int blk = (int)sp.tb.r;
    const int c0 = sp.c0, c1 = sp.c1;
    const T* row = x + sp.t * (i64)H;
    unsigned char* qrow = q + sp.t * q_stride;
    if (q_stride > H && blk == nb - 1) zero_packed_gaps(qrow, H, nb, q_stride, lane, 32);  // packed rows
    unsigned m = 0;
    if (V4) {
      for (int c = c0 + lane * 4; c < c1; c += 128) {
        float f[4];
        load4(row + c, f);
#pragma unroll
        for (int j = 0; j < 4; ++j) m = max(m, abs_bits(f[j]));
      }
    } else {
      for (int c = c0 + lane; c < c1; c += 32) m = max(m, abs_bits(to_float(row[c])));
    }
    m = warp_max_u32(m);
    const float scale = e4m3_block_scale(m);
    if (lane == 0) scales[sp.t * s_stride + blk] = scale;
    if (V4) {
      for (int c = c0 + lane * 4; c < c1; c += 128) {
        float f[4];
        load4(row + c, f);
        unsigned packed = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) packed |= (unsigned)to_e4m3(div_rn(f[j], scale)) << (8 * j);
        *reinterpret_cast<unsigned*>(qrow + c) = packed;
      }
    } else {
      for (int c = c0 + lane; c < c1; c += 32) qrow[c] = to_e4m3(div_rn(to_float(row[c]), scale));
    }
  }
}

// q [T, H] e4m3 bytes, scales [T, nb] fp32 -> y [T, H] (T's elements).
template <typename T, bool V4>
__global__ void dequantize_fp8(const unsigned char* __restrict__ q, const float* __restrict__ scales,
                               T* __restrict__ y, i64 num_tokens, int H, int block, int nb) {
  if constexpr (V4) {
    if (block == 128 && H % 8 == 0 && (reinterpret_cast<unsigned long long>(q) & 7) == 0 &&
        (reinterpret_cast<unsigned long long>(y) & 15) == 0) {
      const i64 items = num_tokens * ((nb + 1) >> 1), warps = ((i64)gridDim.x * blockDim.x) >> 5;
      if (items + (i64)MOE_RT_DEQUANT_U * warps < ((i64)1 << 32))
        dequant_pairs_128<T, MOE_RT_DEQUANT_U, unsigned>(q, scales, y, (unsigned)num_tokens, H, nb);
      else
        dequant_pairs_128<T, MOE_RT_DEQUANT_U, i64>(q, scales, y, num_tokens, H, nb);
      return;
    }
  }
  const int lane = threadIdx.x & 31;
  for (BlockSpan sp(num_tokens, H, block, nb); sp.next();) {
    const int c0 = sp.c0, c1 = sp.c1;
    const unsigned char* qrow = q + sp.t * (i64)H;
    T* yrow = y + sp.t * (i64)H;
    const float scale = scales[sp.w];
    if (V4) {
      for (int c = c0 + lane * 4; c < c1; c += 128) {
        Four<T> r;
        dequant4(*reinterpret_cast<const unsigned*>(qrow + c), scale, r.v);
        if (sizeof(T) == 2) *reinterpret_cast<uint2*>(yrow + c) = *reinterpret_cast<const uint2*>(&r);
        else *reinterpret_cast<uint4*>(yrow + c) = *reinterpret_cast<const uint4*>(&r);
      }
    } else {
      for (int c = c0 + lane; c < c1; c += 32) yrow[c] = store_as<T>(mul_rn(from_e4m3(qrow[c]), scale));
    }
  }
}

// out [T, row_bytes]: the packed rows of codes q [T, H] and scales [T, nb] (layout above). W4: one thread per
// 4-byte word (H % 4 == 0 and q 4-byte aligned; the host checks), else one per byte; grid-stride.
template <bool W4>
__global__ void fp8_pack_rows(const unsigned char* __restrict__ q, const float* __restrict__ scales,
                              unsigned char* __restrict__ out, i64 num_tokens, int H, int nb, i64 row_bytes) {
  const i64 hs = ((i64)H + 3) & ~(i64)3, se = hs + 4 * (i64)nb;
  const unsigned char* sb = reinterpret_cast<const unsigned char*>(scales);
  constexpr int W = W4 ? 4 : 1;
  const i64 per_row = row_bytes / W, n = num_tokens * per_row;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
  StepDivmod it(first, stride, per_row);  // (row, word) of i
  for (i64 i = first; i < n; i += stride, it.advance()) {
    const i64 t = it.q, b = it.r * W;
    if constexpr (W4) {
      unsigned v = 0;
      if (b < H) v = *reinterpret_cast<const unsigned*>(q + t * H + b);
      else if (b >= hs && b < se) v = __float_as_uint(scales[t * nb + (b - hs) / 4]);
      *reinterpret_cast<unsigned*>(out + t * row_bytes + b) = v;
    } else {
      unsigned char v = 0;
      if (b < H) v = q[t * H + b];
      else if (b >= hs && b < se) v = sb[t * 4 * (i64)nb + (b - hs)];
      out[t * row_bytes + b] = v;
    }
  }
}
