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


def block_scales(x32: np.ndarray, block: int) -> np.ndarray:
    """fp32 ``[T, ceil(H/block)]`` scales of fp32 ``x32 [T, H]`` (the rule of this module)."""
    T, H = x32.shape
    nb = num_blocks(H, block)
    # amax as the largest |x| bit pattern: for non-negative floats the integer order is the float order
    mag = (np.ascontiguousarray(x32).view(np.uint32) & np.uint32(0x7FFFFFFF))
    pad = nb * block - H
    if pad:
        mag = np.concatenate([mag, np.zeros((T, pad), np.uint32)], axis=1)
    amax = mag.reshape(T, nb, block).max(axis=2, initial=0).view(np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        scale = amax / np.float32(E4M3_MAX)
    return np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)


def _expand(scales: np.ndarray, H: int, block: int) -> np.ndarray:
    return np.repeat(scales, block, axis=1)[:, :H]


def quantize_fp8(x: np.ndarray, block: int = 128):
    """``x [T,H]`` fp32/bf16/fp16 -> ``(q [T,H] float8_e4m3fn, scales [T, ceil(H/block)] float32)``."""
    import ml_dtypes

    x32 = np.asarray(x).astype(np.float32)
    T, H = x32.shape
    scales = block_scales(x32, block)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        quot = x32 / _expand(scales, H, block)
    return f32_to_e4m3_bits(quot).view(ml_dtypes.float8_e4m3fn), scales


def dequantize_fp8(q: np.ndarray, scales: np.ndarray, dtype, block: int = 128) -> np.ndarray:
    """``q [T,H] float8_e4m3fn``, ``scales [T, ceil(H/block)] float32`` -> ``[T,H]`` in ``dtype``."""
    q = np.asarray(q)
    T, H = q.shape
    vals = e4m3_bits_to_f32(q.view(np.uint8))
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        y = vals * _expand(np.asarray(scales, np.float32), H, block)
    return y.astype(np.float32).astype(dtype)
