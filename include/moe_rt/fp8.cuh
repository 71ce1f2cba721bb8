// FP8 e4m3 helpers shared by kernels/fp8.cu and the low-latency FP8 dispatch of kernels/ep.cu (docs/fp8.md):
// IEEE fp32 division and product without flush-to-zero (div.rn / mul.rn, whatever -ftz says: subnormal
// scales and products are kept), the saturating round-to-nearest-even conversion to e4m3 and its exact
// inverse, and the fp32 -> output dtype rounding (bf16 on the bits). Bit-exact with moe_rt/reference/fp8.py.
#pragma once

#include "moe_rt/common.cuh"
#include <cuda_fp8.h>

namespace moe_rt {

__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float fma_rn(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}

// Whether div_by_scale may stand for div_rn(., s): s in [2^-60, 2^60] (NaN and inf are not).
__device__ __forceinline__ bool scale_in_fast_range(float s) { return s >= 0x1p-60f && s <= 0x1p60f; }

// a / s for a block's |a| <= amax, s = its e4m3_block_scale (within scale_in_fast_range), r = div_rn(1, s):
// one product and two FMAs where div_rn costs a dozen instructions and a branch. q = RN(a r) is within an ulp
// of a / s; the remainder a - q s is exact by FMA, and RN(q + rem r) is then the correctly rounded quotient
// (Markstein's correction step), bit for bit div_rn(a, s) wherever |a / s| >= 2^-11 (no step underflows
// there). Below that both are smaller than half of e4m3's least subnormal (2^-10) with a's sign, so
// to_e4m3 gives both the same signed zero; the sign is taken from a for the case q = -0, rem = +0.
// ns = -s: the remainder's product takes the negated scale (-q under -ftz would cost an instruction a value).
__device__ __forceinline__ float div_by_scale(float a, float ns, float r) {
  const float q = mul_rn(a, r);
  return copysignf(fma_rn(fma_rn(q, ns, a), r, q), a);
}

// div_by_scale for a >= 0 (+0 included): no sign to restore.
__device__ __forceinline__ float div_by_scale_pos(float a, float ns, float r) {
  const float q = mul_rn(a, r);
  return fma_rn(fma_rn(q, ns, a), r, q);
}

// Two values to e4m3 (round to nearest even, saturating), v0 in the low byte: to_e4m3 of each, one instruction.
__device__ __forceinline__ unsigned to_e4m3x2(float v0, float v1) {
  return (unsigned)__nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
}

// N values of one block (N % 4 == 0) to e4m3 codes, value j in byte j % 4 of c[j / 4]: to_e4m3(f[j] / s) with
// s = the block's e4m3_block_scale, the quotients by div_by_scale where scale_in_fast_range(s) allows (div_rn's
// bits), else by div_rn.
template <int N>
__device__ __forceinline__ void e4m3_codes(const float (&f)[N], float s, unsigned (&c)[N / 4]) {
  float v[N];
  if (scale_in_fast_range(s)) {
    const float r = div_rn(1.0f, s), ns = -s;
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = div_by_scale(f[j], ns, r);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = div_rn(f[j], s);
  }
#pragma unroll
  for (int q = 0; q < N / 4; ++q) c[q] = to_e4m3x2(v[4 * q], v[4 * q + 1]) | to_e4m3x2(v[4 * q + 2], v[4 * q + 3]) << 16;
}

__device__ __forceinline__ unsigned char to_e4m3(float v) {
  return (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float from_e4m3(unsigned char c) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3);
  return __half2float(__half(h));  // both steps exact
}

// fp32 -> output dtype, round to nearest even; bf16 on the bits (subnormal products stay subnormal).
template <typename T> __device__ __forceinline__ T store_as(float v) { return from_float<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 store_as<__nv_bfloat16>(float v) {
  unsigned u = __float_as_uint(v);
  unsigned short b;
  if ((u & 0x7fffffffu) > 0x7f800000u) b = (unsigned short)((u >> 16) | 0x40u);  // NaN stays NaN
  else b = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  __nv_bfloat16_raw r;
  r.x = b;
  return __nv_bfloat16(r);
}

// Two fp32 values to a 16-bit float type, round to nearest even, one instruction (cvt.rn.{bf16,f16}x2.f32).
__device__ __forceinline__ void round2(float a, float b, __nv_bfloat16& x, __nv_bfloat16& y) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  x = h.x;
  y = h.y;
}
__device__ __forceinline__ void round2(float a, float b, __half& x, __half& y) {
  const __half2 h = __floats2half2_rn(a, b);
  x = h.x;
  y = h.y;
}

// Four e4m3 codes (code j in byte j of w) times s as T, bit for bit store_as<T>(mul_rn(from_e4m3(code j), s)):
// two codes a conversion (e4m3x2 -> f16x2, exact), and for 16-bit T two products a rounding (cvt.rn to bf16x2 /
// f16x2: round to nearest even, as store_as; a NaN product is mul.rn's canonical NaN, which both give the same
// bits: tests/test_fp8.py checks every code and scale kind against the scalar form), where the scalar form
// converts each code and rounds each product alone (bf16: several integer instructions a value). BENCHMARKS.md
// has the dequantizing dispatch with each form.
template <typename T>
__device__ __forceinline__ void dequant4(unsigned w, float s, T (&out)[4]) {
  const float2 a = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3)));
  const float2 b = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> 16), __NV_E4M3)));
  const float p[4] = {mul_rn(a.x, s), mul_rn(a.y, s), mul_rn(b.x, s), mul_rn(b.y, s)};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = from_float<T>(p[j]);
  } else {
    round2(p[0], p[1], out[0], out[1]);
    round2(p[2], p[3], out[2], out[3]);
  }
}

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// A packed FP8 row (docs/fp8.md: H codes, at byte ceil4(H) the nb fp32 scales, zero padding to q_stride bytes):
// thread i of n zeroes its share of the bytes past the codes that are not scales.
__device__ __forceinline__ void zero_packed_gaps(unsigned char* qrow, int H, int nb, i64 q_stride, int i, int n) {
  const i64 hs = ((i64)H + 3) & ~(i64)3, se = hs + 4 * (i64)nb;
  for (i64 b = H + i; b < q_stride; b += n)
    if (b < hs || b >= se) qrow[b] = 0;
}

// The scale of a block from the largest |x| bit pattern: amax / 448 (one IEEE division), 1 where that is 0
// (amax 0, or amax / 448 underflowed; tested on the bits: no ftz).
__device__ __forceinline__ float e4m3_block_scale(unsigned amax_bits) {
  const float scale = div_rn(__uint_as_float(amax_bits), 448.0f);
  return __float_as_uint(scale) == 0u ? 1.0f : scale;
}

}  // namespace moe_rt
