// FP8 block quantization (docs/fp8.md): one fp32 scale per `block` channels of a token, e4m3 values.
//
//   quantize_fp8    one warp per (token, block): amax = max |x| (integer max of the fp32 bit patterns, so the
//                   order of the reduction cannot matter), scale = amax / 448 (1 where that is 0),
//                   q = e4m3(x / scale), round to nearest even, saturating to +-448
//   dequantize_fp8  one warp per (token, block): y = T(float(q) * scale)
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

// x [T, H] (T's elements), q [T, H] e4m3 bytes, scales [T, nb] fp32, nb = ceil(H / block).
template <typename T, bool V4>
__global__ void quantize_fp8(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scales,
                             i64 num_tokens, int H, int block, int nb) {
  const int lane = threadIdx.x & 31;
  for (BlockSpan sp(num_tokens, H, block, nb); sp.next();) {
    const i64 w = sp.w;
    const int c0 = sp.c0, c1 = sp.c1;
    const T* row = x + sp.t * (i64)H;
    unsigned char* qrow = q + sp.t * (i64)H;
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
    if (lane == 0) scales[w] = scale;
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
