// The device's error word (layout and the recording helper in moe_rt/common.cuh; read by
// moe_rt/_errors.py). A module global of this file's one program, so it exists, zero, once that program
// is loaded on a device, with no allocation or memset on any stream (safe while a stream is captured);
// the kernels that record into it get its address as an argument.
#include "moe_rt/common.cuh"

extern "C" {
__device__ unsigned moe_rt_error_word[MOE_RT_ERR_WORDS];
}

// Zero the error word (one block of MOE_RT_ERR_WORDS threads): the clear after the host has read it,
// ordered on the caller's stream.
extern "C" __global__ void error_word_clear() {
  if (blockIdx.x == 0 && threadIdx.x < MOE_RT_ERR_WORDS) moe_rt_error_word[threadIdx.x] = 0u;
}
