// Elementwise utility kernels: a vectorized scale-copy (the registry's smoke kernel) and a byte fill
// used to zero padding and unused tail rows of dispatch outputs.
#include "moe_rt/common.cuh"

using namespace moe_rt;

// y[i] = alpha * x[i] for i < n, computed in fp32. 16-byte vectors when both pointers are aligned,
// scalar otherwise; grid-stride so any grid size is correct.
template <typename T>
__global__ void scale_copy(const T* __restrict__ x, T* __restrict__ y, float alpha, i64 n) {
  constexpr int V = Vec<T>::N;
  const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  if (aligned16(x) && aligned16(y)) {
    const i64 nvec = n / V;
    for (i64 i = tid; i < nvec; i += stride) {
      Vec<T> v = load_vec_stream(x + i * V);
#pragma unroll
      for (int j = 0; j < V; ++j) v.v[j] = from_float<T>(alpha * to_float(v.v[j]));
      store_vec_stream(y + i * V, v);
    }
    for (i64 i = nvec * V + tid; i < n; i += stride) y[i] = from_float<T>(alpha * to_float(x[i]));
  } else {
    for (i64 i = tid; i < n; i += stride) y[i] = from_float<T>(alpha * to_float(x[i]));
  }
}

// Set nbytes bytes at p to `value`; 16-byte stores for the aligned middle.
#if MOE_RT_WANTS(fill_bytes)
extern "C" __global__ void fill_bytes(unsigned char* __restrict__ p, unsigned char value, i64 nbytes) {
  const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const unsigned long long addr = reinterpret_cast<unsigned long long>(p);
  const i64 head = (i64)(((16 - (addr & 15)) & 15) < (unsigned long long)nbytes ? ((16 - (addr & 15)) & 15) : nbytes);
  for (i64 i = tid; i < head; i += stride) p[i] = value;
  const i64 nvec = (nbytes - head) / 16;
  const unsigned int w = 0x01010101u * value;
  const uint4 v = make_uint4(w, w, w, w);
  uint4* q = reinterpret_cast<uint4*>(p + head);
  for (i64 i = tid; i < nvec; i += stride) q[i] = v;
  for (i64 i = head + nvec * 16 + tid; i < nbytes; i += stride) p[i] = value;
}
#endif
