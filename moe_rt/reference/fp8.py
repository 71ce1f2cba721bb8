"""NumPy reference of FP8 block quantization (docs/fp8.md), bit for bit what kernels/fp8.cu computes.

Per token ``t`` and block ``b`` of ``block`` channels (the last block of a row may be shorter):

- ``amax = max |x[t, c]|`` over the block, in fp32 (bf16/fp16 inputs widened exactly);
- ``scale = fl32(amax / 448)`` (one IEEE fp32 division, round to nearest even); ``scale = 1`` where that is 0
  (an all-zero block, or amax so small that amax / 448 underflows);
- ``q[t, c] = e4m3(fl32(x[t, c] / scale))``: the fp32 quotient rounded to nearest even into
  float8_e4m3fn, saturating to +-448 (a quotient past 448 by rounding stays 448);
- dequantization: ``y = out_dtype(fl32(float(q) * scale))``, one fp32 product, one rounding to the output
  dtype (nearest even).

The scale stored is the dequantization multiplier (``x ~= q * scale``; TransformerEngine calls it
``scale_inv``). The fp32 -> e4m3 rounding is implemented here on the bit patterns, independently of
ml_dtypes (whose casts do not saturate); the tests compare the two where they agree.
"""
from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
_E4M3_MAX_CODE = 0x7E  # 448 = 1.75 * 2**8
_E4M3_NAN = 0x7F


def num_blocks(hidden: int, block: int) -> int:
    """Scale columns per token: ``ceil(hidden / block)``."""
    return -(-hidden // block)


def f32_to_e4m3_bits(v: np.ndarray) -> np.ndarray:
    """fp32 values -> float8_e4m3fn bit patterns (uint8): round to nearest even, saturating to +-448;
    NaN -> 0x7F/0xFF (its sign kept), +-inf -> +-448."""
    v = np.ascontiguousarray(v, dtype=np.float32)
    bits = v.view(np.uint32)
    sign = ((bits >> 31) << 7).astype(np.uint8)
    mag = bits & np.uint32(0x7FFFFFFF)
    a = mag.view(np.float32)
    code = np.zeros(v.shape, np.uint8)
    # normal e4m3 range [2^-6, 448): 3 mantissa bits kept of 23, round to nearest even on the 20 dropped
    normal = (a >= np.float32(2.0 ** -6)) & (a < np.float32(E4M3_MAX))
    m = mag[normal]
    e = (m >> 23).astype(np.int64) - 127  # -6 .. 8
    keep = (m >> 20) & np.uint32(7)
    rest = m & np.uint32(0xFFFFF)
    up = (rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))
    q = (e + 7) * 8 + keep.astype(np.int64) + up.astype(np.int64)  # a carry into the exponent is exact
    code[normal] = np.minimum(q, _E4M3_MAX_CODE).astype(np.uint8)
    # subnormal range (< 2^-6): multiples of 2^-9, rounded to nearest even (a * 512 is exact); 8 is 2^-6
    sub = a < np.float32(2.0 ** -6)
    code[sub] = np.rint(a[sub].astype(np.float64) * 512.0).astype(np.uint8)
    code[(a >= np.float32(E4M3_MAX)) & ~np.isnan(a)] = _E4M3_MAX_CODE  # saturation (inf included)
    code[np.isnan(a)] = _E4M3_NAN
    return code | sign


def e4m3_bits_to_f32(code: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bit patterns (uint8) -> their exact fp32 values (0x7F/0xFF: NaN)."""
    c = np.asarray(code, np.uint8).astype(np.int64)
    s = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 15
    m = c & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e - 10.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return (s * mag).astype(np.float32)


# Everything below computes on bit patterns, integers and float64 values that are normal: the result cannot
# depend on the CPU's floating-point mode (a JAX CPU callback runs with subnormals flushed to zero).

def f32_bits_to_f64(b: np.ndarray) -> np.ndarray:
    """fp32 bit patterns (uint32) -> their exact values as float64 (subnormals included)."""
    b = np.asarray(b, np.uint32)
    e = ((b >> 23) & np.uint32(0xFF)).astype(np.int64)
    m = (b & np.uint32(0x7FFFFF)).astype(np.int64)
    mag = np.ldexp(np.where(e == 0, m, m | 0x800000).astype(np.float64), np.where(e == 0, -149, e - 150))
    mag = np.where(e == 255, np.where(m == 0, np.inf, np.nan), mag)
    return np.where((b >> 31) == 1, -mag, mag)


def f64_to_f32_bits(v: np.ndarray) -> np.ndarray:
    """float64 values -> fp32 bit patterns (uint32), round to nearest even (subnormals included; past the
    largest fp32: inf)."""
    v = np.asarray(v, np.float64)
    sign = np.signbit(v).astype(np.uint32) << np.uint32(31)
    a = np.abs(v)
    b64 = a.view(np.uint64)
    e32 = (b64 >> np.uint64(52)).astype(np.int64) - 1023 + 127
    m52 = b64 & np.uint64((1 << 52) - 1)
    keep = (m52 >> np.uint64(29)).astype(np.int64)
    rest = m52 & np.uint64((1 << 29) - 1)
    up = (rest > (1 << 28)) | ((rest == (1 << 28)) & ((keep & 1) == 1))
    normal = (e32 << 23) + keep + up.astype(np.int64)  # a carry into the exponent is exact
    sub = a < 2.0 ** -126
    with np.errstate(under="ignore"):
        tiny = np.rint(np.where(sub, a, 0.0) * 2.0 ** 149).astype(np.int64)  # multiples of 2^-149
    out = np.where(sub, tiny, np.minimum(normal, 0x7F800000))
    out = np.where(np.isnan(a), 0x7FC00000, out)
    return out.astype(np.uint32) | sign


def f32_bits_to_bf16_bits(b: np.ndarray) -> np.ndarray:
    """fp32 bit patterns -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    b = np.asarray(b, np.uint32).astype(np.uint64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (b >> 16) | 0x40, r).astype(np.uint16)


def f32_bits_to_f16_bits(b: np.ndarray) -> np.ndarray:
    """fp32 bit patterns -> fp16 bit patterns (uint16), round to nearest even (subnormals included; past
    65504 by rounding: inf); NaN -> 0x7E00 with its sign."""
    b = np.asarray(b, np.uint32)
    sign = ((b >> 31) << 15).astype(np.int64)
    mag = b & np.uint32(0x7FFFFFFF)
    a = f32_bits_to_f64(mag)
    e16 = ((mag >> 23).astype(np.int64)) - 127 + 15
    m23 = (mag & np.uint32(0x7FFFFF)).astype(np.int64)
    keep, rest = m23 >> 13, m23 & 0x1FFF
    up = (rest > 0x1000) | ((rest == 0x1000) & ((keep & 1) == 1))
    normal = (e16 << 10) + keep + up.astype(np.int64)
    sub = a < 2.0 ** -14
    tiny = np.rint(np.where(sub, a, 0.0) * 2.0 ** 24).astype(np.int64)  # multiples of 2^-24 (1024: 2^-14)
    out = np.where(sub, tiny, np.minimum(normal, 0x7C00))
    out = np.where(np.isnan(a), 0x7E00, out)
    return (out | sign).astype(np.uint16)


def _f32_bits(x) -> np.ndarray:
    """``x`` (fp32/bf16/fp16) widened to fp32, as bit patterns (exact; no arithmetic on the values)."""
    x = np.asarray(x)
    if x.dtype == np.float32:
        return np.ascontiguousarray(x).view(np.uint32)
    if x.dtype == np.float16:  # sign, exponent rebias, mantissa; subnormals normalized exactly
        h = np.ascontiguousarray(x).view(np.uint16).astype(np.uint32)
        sign = (h >> 15) << 31
        e = ((h >> 10) & 0x1F).astype(np.int64)
        m = (h & 0x3FF).astype(np.int64)
        val = f64_to_f32_bits(np.ldexp(np.where(e == 0, m, m | 0x400).astype(np.float64),
                                       np.where(e == 0, -24, e - 25)))
        val = np.where(e == 31, 0x7F800000 | (m << 13), val).astype(np.uint32)
        return val | sign.astype(np.uint32)
    # bf16: the upper half of an fp32
    return np.ascontiguousarray(x).view(np.uint16).astype(np.uint32) << np.uint32(16)


def block_scales(x_bits: np.ndarray, block: int) -> np.ndarray:
    """fp32 bit patterns ``[T, ceil(H/block)]`` of the scales of fp32 bit patterns ``x_bits [T, H]``."""
    T, H = x_bits.shape
    nb = num_blocks(H, block)
    # amax as the largest |x| bit pattern: for non-negative floats the integer order is the float order
    mag = x_bits & np.uint32(0x7FFFFFFF)
    pad = nb * block - H
    if pad:
        mag = np.concatenate([mag, np.zeros((T, pad), np.uint32)], axis=1)
    amax = mag.reshape(T, nb, block).max(axis=2, initial=0)
    # fp32 amax / 448 rounded once: the float64 quotient is rounded once more to fp32, which is the single
    # rounding (53 >= 2*24 + 2 bits, and no quotient of an fp32 by 448 lands on an fp32 midpoint inexactly)
    scale = f64_to_f32_bits(f32_bits_to_f64(amax) / E4M3_MAX)
    return np.where(scale == 0, np.uint32(0x3F800000), scale)


def _expand(scales: np.ndarray, H: int, block: int) -> np.ndarray:
    return np.repeat(scales, block, axis=1)[:, :H]


def quantize_fp8(x: np.ndarray, block: int = 128):
    """``x [T,H]`` fp32/bf16/fp16 -> ``(q [T,H] float8_e4m3fn, scales [T, ceil(H/block)] float32)``."""
    import ml_dtypes

    xb = _f32_bits(x)
    T, H = xb.shape
    sb = block_scales(xb, block)
    # the fp32 quotient: float64 division of the exact values, rounded once more to fp32 (a single rounding:
    # 53 >= 2*24 + 2 bits)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        quot = f64_to_f32_bits(f32_bits_to_f64(xb) / _expand(f32_bits_to_f64(sb), H, block))
    q = f32_to_e4m3_bits(quot.view(np.float32))
    return q.view(ml_dtypes.float8_e4m3fn), sb.view(np.float32)


def dequantize_fp8(q: np.ndarray, scales: np.ndarray, dtype, block: int = 128) -> np.ndarray:
    """``q [T,H] float8_e4m3fn``, ``scales [T, ceil(H/block)] float32`` -> ``[T,H]`` in ``dtype``."""
    import ml_dtypes

    q = np.asarray(q)
    T, H = q.shape
    vals = e4m3_bits_to_f32(q.view(np.uint8)).astype(np.float64)  # exact (normal values)
    s = f32_bits_to_f64(np.ascontiguousarray(scales, np.float32).view(np.uint32))
    with np.errstate(over="ignore", invalid="ignore"):
        y = f64_to_f32_bits(vals * _expand(s, H, block))  # the product is exact in float64: one rounding
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return y.view(np.float32)
    if dtype == np.float16:
        return f32_bits_to_f16_bits(y).view(np.float16)
    return f32_bits_to_bf16_bits(y).view(ml_dtypes.bfloat16)
