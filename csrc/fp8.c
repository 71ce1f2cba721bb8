/* moe_rt core: the FP8 block casts (kernels/fp8.cu). The kernel choices are those of moe_rt/fp8.py
 * (launch_quantize, launch_dequantize; tests/test_c_abi.py compares the two). */
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define FILE_FP8 "fp8.cu"
#define FP8_THREADS 256
#define FP8_MAX_BLOCK 65536

typedef struct fp8_key {
  int32_t op, dtype, v4, pad;
} fp8_key;

/* Validate, plan and launch one cast: `in`/`out` as the kernel takes them (quantize: x, q, scales; dequantize:
 * q, scales, y); `data` is the float side (x or y) and `codes` the e4m3 side (q). Quantize: q_stride, s_stride
 * are the row strides of the codes (bytes) and scales (floats): H and nb for separate arrays, row_bytes and
 * row_bytes / 4 for packed rows (0, 0: those of separate arrays). */
static moe_rt_status cast(moe_rt_context* ctx, const char* op, int quantize, int dtype, int64_t T, int64_t H,
                          int block, const void* data, const void* codes, const void* scales, const void* a0,
                          const void* a1, const void* a2, int64_t q_stride, int64_t s_stride, moe_rt_stream stream) {
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op))) return st;
  if (!mrt_is_float_dtype(dtype))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: dtype: expected float32, float16 or bfloat16, got %s (%d)", op,
                    mrt_dtype_name(dtype), dtype);
  if (T < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_tokens must be >= 0, got %lld", op, (long long)T);
  if (block < 1 || block > FP8_MAX_BLOCK)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: block must be in [1, %d], got %d", op, FP8_MAX_BLOCK, block);
  if (H < 0 || H + block >= ((int64_t)1 << 31))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: hidden must be >= 0 with hidden + block below 2^31, got %lld",
                    op, (long long)H);
  const int64_t nb = mrt_cdiv(H, block);
  /* arrays of no element may be NULL (XLA may pass those so) */
  if ((st = mrt_check_data(op, quantize ? "x" : "y", data, T * H)) || (st = mrt_check_data(op, "x_fp8", codes, T * H)) ||
      (st = mrt_check_data(op, "scales", scales, T * nb)))
    return st;
  mrt_plan p;
  memset(&p, 0, sizeof p);
  if (T == 0 || H == 0) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  const int isz = mrt_dtype_size(dtype);
  const int v4 = block % 128 == 0 && H % 4 == 0 && ((uintptr_t)data % (uintptr_t)(4 * isz)) == 0 &&
                 ((uintptr_t)codes % 4) == 0 && (q_stride == 0 || q_stride % 4 == 0);
  fp8_key key = {quantize ? 7 : 8, dtype, v4, 0};
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    p.num_launches = 1;
    snprintf(p.launch[0].name, sizeof p.launch[0].name, "%s<%s, %s>", quantize ? "quantize_fp8" : "dequantize_fp8",
             mrt_ctype(dtype), v4 ? "true" : "false");
    int regs = 0;
    if ((st = mrt_kernel(ctx, &p.launch[0], FILE_FP8, &regs))) return st;
    p.launch[0].block = FP8_THREADS;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  p.launch[0].grid = mrt_max(1, mrt_min(mrt_cdiv(T * nb, FP8_THREADS / 32), (int64_t)mrt_device(ctx)->sm_count * 32));
  mrt_args a = {0};
  mrt_arg_ptr(&a, a0);
  mrt_arg_ptr(&a, a1);
  mrt_arg_ptr(&a, a2);
  mrt_arg_i64(&a, T);
  mrt_arg_i32(&a, (int32_t)H);
  mrt_arg_i32(&a, block);
  mrt_arg_i32(&a, (int32_t)nb);
  if (quantize) {  /* row strides of the codes and scales (kernels/fp8.cu: packed rows use wider ones) */
    mrt_arg_i64(&a, q_stride ? q_stride : H);
    mrt_arg_i64(&a, q_stride ? s_stride : nb);
  }
  return mrt_run_plan(ctx, &p, &a, stream);  /* a planning context records the plan and these arguments */
}

moe_rt_status moe_rt_quantize_fp8(moe_rt_context* ctx, const void* x, int dtype, int64_t T, int64_t H, int block,
                                  void* x_fp8, float* scales, moe_rt_stream stream) {
  return cast(ctx, "moe_rt_quantize_fp8", 1, dtype, T, H, block, x, x_fp8, scales, x, x_fp8, scales, 0, 0, stream);
}

/* The row checks of the packed-row entries: block and hidden as cast() checks them, row_bytes large enough and a
 * multiple of 4, rows non-NULL and 4-byte aligned; *at: the scales' byte offset ceil4(H). */
static moe_rt_status check_rows(const char* op, int block, int64_t H, const void* rows, int64_t row_bytes,
                                int64_t* at) {
  moe_rt_status st;
  if (block < 1 || block > FP8_MAX_BLOCK)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: block must be in [1, %d], got %d", op, FP8_MAX_BLOCK, block);
  if (H < 0 || H + block >= ((int64_t)1 << 31))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: hidden must be >= 0 with hidden + block below 2^31, got %lld",
                    op, (long long)H);
  *at = (H + 3) / 4 * 4;
  const int64_t need = *at + 4 * mrt_cdiv(H, block);
  if (row_bytes < need || row_bytes % 4 != 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT,
                    "%s: row_bytes must be a multiple of 4 and at least ceil4(hidden) + 4*ceil(hidden/block) = %lld, "
                    "got %lld", op, (long long)need, (long long)row_bytes);
  if ((st = mrt_check_ptr(op, "rows", rows))) return st;
  if ((uintptr_t)rows % 4 != 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: rows must be 4-byte aligned", op);
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_quantize_fp8_rows(moe_rt_context* ctx, const void* x, int dtype, int64_t T, int64_t H, int block,
                                       void* rows, int64_t row_bytes, moe_rt_stream stream) {
  static const char op[] = "moe_rt_quantize_fp8_rows";
  moe_rt_status st;
  int64_t at;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_rows(op, block, H, rows, row_bytes, &at))) return st;
  unsigned char* scales = (unsigned char*)rows + at;
  return cast(ctx, op, 1, dtype, T, H, block, x, rows, scales, x, rows, scales, row_bytes, row_bytes / 4, stream);
}

moe_rt_status moe_rt_pack_fp8_rows(moe_rt_context* ctx, const void* x_fp8, const float* scales, int64_t T, int64_t H,
                                   int block, void* rows, int64_t row_bytes, moe_rt_stream stream) {
  static const char op[] = "moe_rt_pack_fp8_rows";
  moe_rt_status st;
  int64_t at;
  if ((st = mrt_check_ctx(ctx, op))) return st;
  if (T < 0) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: num_tokens must be >= 0, got %lld", op, (long long)T);
  if ((st = check_rows(op, block, H, rows, row_bytes, &at)) || (st = mrt_check_ptr(op, "x_fp8", x_fp8)) ||
      (st = mrt_check_ptr(op, "scales", scales)))
    return st;
  if ((uintptr_t)scales % 4 != 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: scales must be 4-byte aligned", op);
  mrt_plan p;
  memset(&p, 0, sizeof p);
  if (T == 0 || row_bytes == 0) {
    if (mrt_is_planning(ctx)) mrt_record(ctx, &p);
    return MOE_RT_SUCCESS;
  }
  /* W4: a thread a 4-byte word of a row (the codes' rows 4-byte aligned), else a byte */
  const int w4 = H % 4 == 0 && (uintptr_t)x_fp8 % 4 == 0;
  fp8_key key = {9, 0, w4, 0};
  if (!mrt_plan_lookup(ctx, &key, sizeof key, &p)) {
    p.num_launches = 1;
    snprintf(p.launch[0].name, sizeof p.launch[0].name, "fp8_pack_rows<%s>", w4 ? "true" : "false");
    int regs = 0;
    if ((st = mrt_kernel(ctx, &p.launch[0], FILE_FP8, &regs))) return st;
    p.launch[0].block = FP8_THREADS;
    mrt_plan_put(ctx, &key, sizeof key, &p);
  }
  const int64_t warps = mrt_cdiv(mrt_cdiv(T * row_bytes, w4 ? 4 : 1), 32);
  p.launch[0].grid = mrt_max(1, mrt_min(mrt_cdiv(warps, FP8_THREADS / 32), (int64_t)mrt_device(ctx)->sm_count * 32));
  mrt_args a = {0};
  mrt_arg_ptr(&a, x_fp8);
  mrt_arg_ptr(&a, scales);
  mrt_arg_ptr(&a, rows);
  mrt_arg_i64(&a, T);
  mrt_arg_i32(&a, (int32_t)H);
  mrt_arg_i32(&a, (int32_t)mrt_cdiv(H, block));
  mrt_arg_i64(&a, row_bytes);
  return mrt_run_plan(ctx, &p, &a, stream);
}

moe_rt_status moe_rt_dequantize_fp8(moe_rt_context* ctx, const void* x_fp8, const float* scales, int64_t T, int64_t H,
                                    int block, void* y, int dtype, moe_rt_stream stream) {
  return cast(ctx, "moe_rt_dequantize_fp8", 0, dtype, T, H, block, y, x_fp8, scales, x_fp8, scales, y, 0, 0, stream);
}
