// FP8 block quantization (docs/fp8.md): one fp32 scale per `block` channels of a token, e4m3 values.
//
//   quantize_fp8    one warp per (token, block): amax = max |x| (integer max of the fp32 bit patterns, so the
//                   order of the reduction cannot matter), scale = amax / 448 (1 where that is 0),
//                   q = e4m3(x / scale), round to nearest even, saturating to +-448
//   dequantize_fp8  one warp per (token, block): y = T(float(q) * scale)
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

namespace {

__device__ __forceinline__ unsigned warp_max_u32(unsigned v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const unsigned o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o > v ? o : v;
  }
  return v;
}

// Four consecutive elements of T as fp32 (8-byte loads for 16-bit T, 16-byte for fp32).
template <typename T> struct Four { T v[4]; };

template <typename T>
__device__ __forceinline__ void load4(const T* p, float* f) {
  Four<T> r;
  if (sizeof(T) == 2) *reinterpret_cast<uint2*>(&r) = *reinterpret_cast<const uint2*>(p);
  else *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int j = 0; j < 4; ++j) f[j] = to_float(r.v[j]);
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float* f) {
  Four<T> r;
#pragma unroll
  for (int j = 0; j < 4; ++j) r.v[j] = store_as<T>(f[j]);
  if (sizeof(T) == 2) *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(&r);
  else *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&r);
}

// The (token, block) work items of a grid-stride loop, one per warp: item w is token t = w / nb, channels
// [c0, c1) of block w % nb (the last block of a row may be shorter).
struct BlockSpan {
  i64 w, work, stride;
  i64 t = 0;
  int c0 = 0, c1 = 0, H, block, nb;
  bool started = false;
  __device__ BlockSpan(i64 num_tokens, int H_, int block_, int nb_)
      : w(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5), work(num_tokens * nb_),
        stride(((i64)gridDim.x * blockDim.x) >> 5), H(H_), block(block_), nb(nb_) {}
  __device__ bool next() {
    if (started) w += stride;
    started = true;
    if (w >= work) return false;
    t = w / nb;
    c0 = (int)(w - t * nb) * block;
    c1 = min(c0 + block, H);
    return true;
  }
};

}  // namespace

// x [T, H] (T's elements), q [T, q_stride] e4m3 bytes (the first H of a row), scales [T, s_stride] fp32 (the first
// nb), nb = ceil(H / block). Separate arrays: q_stride = H, s_stride = nb. Packed rows (q_stride > H): scales =
// q + ceil4(H) bytes, s_stride = q_stride / 4; the warp of a row's last block also zeroes the row's other bytes.
template <typename T, bool V4>
__global__ void quantize_fp8(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scales,
                             i64 num_tokens, int H, int block, int nb, i64 q_stride, i64 s_stride) {
  const int lane = threadIdx.x & 31;
  for (BlockSpan sp(num_tokens, H, block, nb); sp.next();) {
    const i64 blk = sp.w - sp.t * nb;
    const int c0 = sp.c0, c1 = sp.c1;
    const T* row = x + sp.t * (i64)H;
    unsigned char* qrow = q + sp.t * q_stride;
    if (q_stride > H && blk == nb - 1) {  // packed: the gap before the scales and the padding after them
      const i64 hs = ((i64)H + 3) & ~(i64)3, se = hs + 4 * (i64)nb;
      for (i64 b = H + lane; b < q_stride; b += 32)
        if (b < hs || b >= se) qrow[b] = 0;
    }
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
  const int lane = threadIdx.x & 31;
  for (BlockSpan sp(num_tokens, H, block, nb); sp.next();) {
    const int c0 = sp.c0, c1 = sp.c1;
    const unsigned char* qrow = q + sp.t * (i64)H;
    T* yrow = y + sp.t * (i64)H;
    const float scale = scales[sp.w];
    if (V4) {
      for (int c = c0 + lane * 4; c < c1; c += 128) {
        const unsigned packed = *reinterpret_cast<const unsigned*>(qrow + c);
        float f[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) f[j] = mul_rn(from_e4m3((unsigned char)(packed >> (8 * j))), scale);
        store4(yrow + c, f);
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
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const i64 t = i / per_row, b = (i - t * per_row) * W;
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
