// Device helpers shared by every moe_rt kernel file: dtype conversion, 16-byte vector access,
// warp and block reductions. Header-only; compiled by NVRTC with the kernels that include it.
#pragma once

// One kernel per NVRTC program (moe_rt/_jit.py): a program built for one kernel defines MOE_RT_ONE_KERNEL, and
// for a kernel that is not a template also MOE_RT_KERNEL_<name>. A kernel that is not a template is emitted
// wherever it is defined, so each is wrapped in `#if MOE_RT_WANTS(name)`: a program then holds its own kernel
// alone. Names not defined read as 0 in #if, so a program built without MOE_RT_ONE_KERNEL holds every kernel.
#define MOE_RT_WANTS(name) (!MOE_RT_ONE_KERNEL || MOE_RT_KERNEL_##name)

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace moe_rt {

using i64 = long long;

// ---- dtype <-> float ---------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ---- 16-byte vectors -----------------------------------------------------------------------------
// A Vec<T> is 16 bytes: 4 floats or 8 halves/bf16s. Loads through uint4 so the compiler emits
// LDG.128 / STG.128; callers check 16-byte alignment of base pointer and row pitch on the host.
template <typename T> struct Vec {
  static constexpr int N = 16 / sizeof(T);
  union { uint4 raw; T v[N]; };
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  Vec<T> r;
  r.raw = *reinterpret_cast<const uint4*>(p);
  return r;
}

// Streaming load: read once, do not keep in L1 (rows are touched exactly once).
template <typename T>
__device__ __forceinline__ Vec<T> load_vec_stream(const T* p) {
  Vec<T> r;
  r.raw = __ldcs(reinterpret_cast<const uint4*>(p));
  return r;
}

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<uint4*>(p) = v.raw;
}

template <typename T>
__device__ __forceinline__ void store_vec_stream(T* p, const Vec<T>& v) {
  __stcs(reinterpret_cast<uint4*>(p), v.raw);
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// ---- reductions ----------------------------------------------------------------------------------
// Butterfly reductions: every lane ends with the result, and the order of additions is fixed, so the
// result is bitwise reproducible run to run.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Block-wide sum in a fixed order. `scratch` holds at least blockDim.x/32 floats of shared memory.
// Every thread returns the total. Contains __syncthreads: call from all threads of the block.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : 0.0f;
  return warp_sum(t);
}

// Inclusive prefix sum of ints over the block (blockDim.x <= 1024, multiple of 32). `scratch` holds
// 32 ints of shared memory. Returns the inclusive scan value; *total receives the block total.
__device__ __forceinline__ int block_inclusive_scan(int v, int* scratch, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    int n = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += n;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nwarps ? scratch[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      int n = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += n;
    }
    if (lane < nwarps) scratch[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v += scratch[warp - 1];
  *total = scratch[nwarps - 1];
  return v;
}

// ---- the device's error word (moe_rt/_errors.py) ---------------------------------------------------
// Kernels that read expert ids record an id outside [-1, E) here and go on treating it as -1, so nothing
// is written out of bounds; the host raises it at its next host-visible point (moe_rt.check). Layout, 8
// unsigned ints: [0] a bit per op family (atomicOr); [1] 0 until the first offender claims the record
// (atomicCAS), which then writes [2..3] its value (int64, low word first), [4..5] its flat slot,
// [6] num_experts, [7] its family's bit. Integer atomics only; graph replays write it like any launch.
#define MOE_RT_ERR_WORDS 8
#define MOE_RT_ERR_MAKE_PLAN 1u
#define MOE_RT_ERR_EP_PREPARE 2u
#define MOE_RT_ERR_ROUTER_BWD 4u
#define MOE_RT_ERR_EP_LL_DISPATCH 8u

static __device__ __noinline__ void record_bad_expert_id(unsigned* err, unsigned family, i64 value, i64 slot,
                                                         int E) {
  if (err == nullptr) return;
  atomicOr(err, family);
  if (atomicCAS(err + 1, 0u, 1u) == 0u) {
    err[2] = (unsigned)((unsigned long long)value & 0xffffffffull);
    err[3] = (unsigned)((unsigned long long)value >> 32);
    err[4] = (unsigned)((unsigned long long)slot & 0xffffffffull);
    err[5] = (unsigned)((unsigned long long)slot >> 32);
    err[6] = (unsigned)E;
    err[7] = family;
  }
}

}  // namespace moe_rt
