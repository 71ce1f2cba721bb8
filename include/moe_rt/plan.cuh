// The permutation plan's offsets (kernels/permutation.cu, and the expert-parallel prepare in kernels/ep.cu,
// which lays out received slots with the same rules).
#pragma once

#include "moe_rt/common.cuh"

namespace moe_rt {

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// kept[e] = routed slots of e among the first num_out slots in expert-major order; tokens_per_expert[e]
// = padded (align > 1) or kept; seg_start = exclusive scan of the padded counts, seg_start[E] = rows in
// use. Run by one whole CTA (blockDim multiple of 32); with L2, totals are read through L2 (written by other
// CTAs), else plainly (shared memory).
template <bool L2>
__device__ void plan_offsets_block(const int* __restrict__ totals, int E, int align, i64 num_out,
                                   int* __restrict__ kept, int* __restrict__ tokens_per_expert,
                                   int* __restrict__ seg_start) {
  __shared__ int scratch[32];
  __shared__ i64 carry[2];
  if (threadIdx.x == 0) carry[0] = carry[1] = 0;
  __syncthreads();
  for (int e0 = 0; e0 < E; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    const int n = e < E ? (L2 ? __ldcg(totals + e) : totals[e]) : 0;
    int tot;
    const int incl = block_inclusive_scan(n, scratch, &tot);
    const i64 off = carry[0] + incl - n;  // unpadded expert-major offset of expert e
    i64 k = num_out - off;
    k = k < 0 ? 0 : (k > n ? n : k);
    const int target = align > 1 ? (int)((k + align - 1) / align * align) : (int)k;
    int tot2;
    const int incl2 = block_inclusive_scan(target, scratch, &tot2);
    if (e < E) {
      kept[e] = (int)k;
      tokens_per_expert[e] = target;
      seg_start[e] = (int)(carry[1] + incl2 - target);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry[0] += tot;
      carry[1] += tot2;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) seg_start[E] = (int)carry[1];
}

}  // namespace moe_rt
