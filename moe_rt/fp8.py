"""FP8 on one GPU (docs/fp8.md): block quantization to e4m3 with per-token block scales, its inverse, and
dispatch of FP8 rows together with their scales.

- :func:`quantize_fp8`: ``x [T,H]`` fp32/bf16/fp16 -> ``(x_fp8 [T,H] float8_e4m3fn, scales [T, ceil(H/block)]
  float32)``, one scale per ``block`` (128) channels of each token.
- :func:`dequantize_fp8`: the inverse map, ``y = dtype(float(x_fp8) * scale)``.
- :func:`dispatch_fp8`: FP8 rows and their scale rows through one dispatch plan (the scale rows follow the
  token rows: ``scales_permuted[dst_row[t,k]] = scales[t]``; padding rows get zero scales).

The scale rule, exactly (the NumPy reference, :mod:`moe_rt.reference.fp8`, and the CUDA kernels of
``kernels/fp8.cu`` give the same bits): per token and block, ``amax = max |x|`` in fp32;
``scale = fl32(amax / 448)``, and ``scale = 1`` where that is 0 (an all-zero block, or an amax below about
3.1e-43 whose quotient underflows); ``x_fp8 = e4m3(fl32(x / scale))``, the fp32 quotient rounded to nearest
even into float8_e4m3fn and saturated to +-448. The stored scale is the dequantization multiplier
(``x ~= x_fp8 * scale``, what TransformerEngine calls ``scale_inv`` and DeepEP/DeepGEMM take as the scale
of a 1x128 FP8 block). Rows whose ``H`` is not a multiple of ``block`` end with a shorter block, which
gets its own scale. Non-finite inputs are not checked (a check would need a device sync): a block holding
an inf or NaN gets a non-finite scale and values that are unspecified.

CUDA arrays run the kernels through the C core (:mod:`moe_rt._core`; its planner, csrc/fp8.c, makes the
kernel choices), CPU arrays the NumPy reference. No autograd: quantization is not
differentiable (``moe_rt.torch`` and ``moe_rt.jax`` have the same ops for use inside compiled graphs).
"""
from __future__ import annotations

import numpy as np

from moe_rt import _arrays, _core, _jit
from moe_rt import permutation as _perm
from moe_rt.reference import fp8 as _ref

__all__ = ["quantize_fp8", "dequantize_fp8", "dispatch_fp8", "FP8_MAX"]

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MAX_BLOCK = 1 << 16
_FILE = "fp8.cu"
_TOKEN_DTYPES = tuple(d for d in _arrays.FLOAT_DTYPES if d is not None)
_E4M3 = _arrays.FLOAT8_E4M3
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.uint8))  # fp32 block scales; MXFP8's E8M0 as bytes

_names = []
for _c in _jit.CTYPES.values():
    for _v in ("true", "false"):
        _names += [f"quantize_fp8<{_c}, {_v}>", f"dequantize_fp8<{_c}, {_v}>"]
_names += ["fp8_pack_rows<true>", "fp8_pack_rows<false>"]
_jit.register(_FILE, _names)


def check_block(block) -> int:
    """``block`` as an int in [1, 65536] (TypeError/ValueError naming it)."""
    return _arrays.check_int(block, "block", low=1, high=MAX_BLOCK)


def out_dtype(dtype) -> np.dtype:
    """``dtype`` (NumPy/ml_dtypes/JAX dtype, a name, or a torch dtype) as one of float32, float16, bfloat16."""
    if type(dtype).__module__.startswith("torch"):
        dtype = str(dtype).split(".")[-1]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in _TOKEN_DTYPES:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16 for the dequantized values, got {dtype!r}")
    return dt


def check_quantize_args(x, block) -> tuple[int, int, int]:
    """:func:`quantize_fp8`'s checks (``x``: anything with ``shape``, ``ndim``, ``dtype``): ``(T, H, blocks)``."""
    block = check_block(block)
    _arrays.check_ndim(x, "x", 2)
    _arrays.check_dtype(x, "x", _TOKEN_DTYPES)
    T, H = x.shape[0], int(x.shape[1])  # T as given: torch.compile's fakes keep the token count symbolic
    if H + block >= 2**31:
        raise ValueError(f"x: rows of {H} channels; H + block must stay below 2^31")
    return T, H, _ref.num_blocks(H, block)


def _check_fp8(x_fp8, name: str):
    _arrays.check_ndim(x_fp8, name, 2)
    dt = np.dtype(x_fp8.dtype)
    if dt != _E4M3:
        raise TypeError(f"{name}: expected float8_e4m3fn values (torch.float8_e4m3fn, jnp.float8_e4m3fn, "
                        f"ml_dtypes.float8_e4m3fn), got dtype {dt.name}")


def check_dequantize_args(x_fp8, scales, dtype, block) -> tuple[int, int, int, np.dtype]:
    """:func:`dequantize_fp8`'s checks: ``(T, H, blocks, output dtype)``."""
    block = check_block(block)
    dt = out_dtype(dtype)
    _check_fp8(x_fp8, "x_fp8")
    T, H = x_fp8.shape[0], int(x_fp8.shape[1])  # T as given (symbolic in torch.compile's fakes)
    if H + block >= 2**31:
        raise ValueError(f"x_fp8: rows of {H} channels; H + block must stay below 2^31")
    nb = _ref.num_blocks(H, block)
    _arrays.check_dtype(scales, "scales", (np.dtype(np.float32),))
    if tuple(scales.shape) != (T, nb):
        raise ValueError(f"scales: expected shape [T, ceil(H/block)] = {(T, nb)} for x_fp8 of shape {(T, H)} "
                         f"and block={block}, got {tuple(scales.shape)}")
    return T, H, nb, dt


def launch_quantize(x, q, scales, block: int, device_id: int, stream_ptr: int) -> None:
    """The C core's quantize on checked, C-contiguous device arrays: ``x [T,H]`` fp32/bf16/fp16 into ``q [T,H]``
    (any 1-byte array: e4m3 codes) and ``scales [T, ceil(H/block)]`` fp32, on the cudaStream_t ``stream_ptr``."""
    T, H = int(x.shape[0]), int(x.shape[1])
    if not T or not H:
        return
    _core.quantize_fp8(_core.device(device_id), x.data.ptr, _core.CODES[np.dtype(x.dtype)], T, H, block, q.data.ptr,
                       scales.data.ptr, stream_ptr)


def packed_layout(H: int, block: int = 128) -> tuple[int, int, int]:
    """The packed rows of a one-pass FP8 dispatch (docs/ep.md §9; kernels/fp8.cu): ``(S, scale_at, row_bytes)``:
    a row holds its ``H`` e4m3 codes, then at byte ``scale_at = ceil4(H)`` its ``S = ceil(H/block)`` fp32
    scales, then zero bytes up to ``row_bytes``, the next multiple of 16 (the transports' 16-byte copy unit).
    H = 7168: 7168 + 224 = 7392 bytes."""
    S = _ref.num_blocks(H, block)
    at = -(-H // 4) * 4
    return S, at, -(-(at + 4 * S) // 16) * 16


def launch_quantize_packed(x, packed, block: int, device_id: int, stream_ptr: int) -> None:
    """The C core's quantize into packed rows (:func:`packed_layout`; ``moe_rt_quantize_fp8_rows``): ``x [T,H]``
    fp32/bf16/fp16 into ``packed [T, row_bytes]`` uint8 (C-contiguous device arrays with ``.data.ptr``), on the
    cudaStream_t ``stream_ptr``: each row of x read once."""
    T, H = int(x.shape[0]), int(x.shape[1])
    if not T or not H:
        return
    _core.quantize_fp8_rows(_core.device(device_id), x.data.ptr, _core.CODES[np.dtype(x.dtype)], T, H, block,
                            packed.data.ptr, int(packed.shape[1]), stream_ptr)


def launch_pack(q, scales, packed, block: int, device_id: int, stream_ptr: int) -> None:
    """The C core's packing of a pre-quantized pair (``moe_rt_pack_fp8_rows``): ``q [T,H]`` 1-byte codes and
    ``scales [T, ceil(H/block)]`` fp32 (C-contiguous device arrays) into ``packed [T, row_bytes]`` uint8 rows
    (:func:`packed_layout`), one kernel, on the cudaStream_t ``stream_ptr``."""
    T, H = int(q.shape[0]), int(q.shape[1])
    if not T:
        return
    _core.pack_fp8_rows(_core.device(device_id), q.data.ptr, scales.data.ptr, T, H, block, packed.data.ptr,
                        int(packed.shape[1]), stream_ptr)


def launch_dequantize(q, scales, y, block: int, device_id: int, stream_ptr: int) -> None:
    """The C core's dequantize on checked, C-contiguous device arrays: ``q [T,H]`` (1-byte e4m3 codes) and
    ``scales [T, ceil(H/block)]`` fp32 into ``y [T,H]`` (fp32/bf16/fp16), on the cudaStream_t ``stream_ptr``."""
    T, H = int(q.shape[0]), int(q.shape[1])
    if not T or not H:
        return
    _core.dequantize_fp8(_core.device(device_id), q.data.ptr, scales.data.ptr, T, H, block, y.data.ptr,
                         _core.CODES[np.dtype(y.dtype)], stream_ptr)


def quantize_fp8(x, block: int = 128, *, stream=None):
    """Quantize ``x`` to float8_e4m3fn with one fp32 scale per ``block`` channels of each token.

    Args:
        x: ``[T,H]`` fp32/bf16/fp16.
        block: channels per scale (default 128); a row whose ``H`` is not a multiple ends with a shorter block.
        stream: CUDA stream (None = the caller's current stream).

    Returns:
        ``(x_fp8 [T,H] float8_e4m3fn, scales [T, ceil(H/block)] float32)`` in x's framework and device
        (torch, JAX or NumPy: CuPy holds no FP8, so a CuPy ``x`` is refused with a TypeError):
        ``scale = amax/448`` of the block in fp32 (1 where that is 0), ``x_fp8 = e4m3(x/scale)`` (fp32
        quotient, round to nearest even, saturating to +-448), so ``x ~= x_fp8 * scale`` (the scale is the
        dequantization multiplier). Bitwise equal on every backend.
    """
    with _arrays.Call({"x": x}, stream=stream, lean=True) as call:
        xv = call["x"]
        T, H, nb = check_quantize_args(xv, block)
        xv = _arrays.contiguous(call.xp, xv)
        if call.backend == "cpu":
            q, s = _ref.quantize_fp8(np.asarray(xv), block)
            return call.out(q), call.out(s)
        q = call.empty((T, H), _E4M3)
        s = call.empty((T, nb), np.float32)
        launch_quantize(xv, q, s, block, call.device_id, call.stream_ptr)
        return call.out(q), call.out(s)


def dequantize_fp8(x_fp8, scales, dtype="bfloat16", block: int = 128, *, stream=None):
    """The inverse of :func:`quantize_fp8`: ``y[t,c] = dtype(float(x_fp8[t,c]) * scales[t, c // block])``
    (one fp32 product, one rounding to nearest even).

    Args:
        x_fp8: ``[T,H]`` float8_e4m3fn.
        scales: ``[T, ceil(H/block)]`` float32 (dequantization multipliers, as :func:`quantize_fp8` returns).
        dtype: the output dtype: float32, float16 or bfloat16 (NumPy/JAX/torch dtype or name).
        block: channels per scale (default 128).
        stream: CUDA stream (None = the caller's current stream).

    Returns:
        ``y [T,H]`` in ``dtype``, in x_fp8's framework and device.
    """
    with _arrays.Call({"x_fp8": x_fp8, "scales": scales}, stream=stream, lean=True) as call:
        qv, sv = call["x_fp8"], call["scales"]
        T, H, nb, dt = check_dequantize_args(qv, sv, dtype, block)
        qv, sv = _arrays.contiguous(call.xp, qv), _arrays.contiguous(call.xp, sv)
        if call.backend == "cpu":
            return call.out(_ref.dequantize_fp8(np.asarray(qv), np.asarray(sv), dt, block))
        y = call.empty((T, H), dt)
        launch_dequantize(qv, sv, y, block, call.device_id, call.stream_ptr)
        return call.out(y)


def check_dispatch_fp8_args(x_fp8, scales):
    """:func:`dispatch_fp8`'s own checks (the plan's are :func:`moe_rt.dispatch`'s)."""
    _arrays.check_ndim(x_fp8, "x_fp8", 2)
    dt = np.dtype(x_fp8.dtype)
    if dt not in _arrays.FP8_DTYPES:
        raise TypeError(f"x_fp8: expected FP8 values (float8_e4m3fn or float8_e5m2), got dtype {dt.name}; "
                        "moe_rt.dispatch moves other dtypes")
    _arrays.check_ndim(scales, "scales", 2)
    _arrays.check_dtype(scales, "scales", _SCALE_DTYPES)
    if scales.shape[0] != x_fp8.shape[0]:
        raise ValueError(f"scales: expected one row per token ({x_fp8.shape[0]} rows, as x_fp8), got shape "
                         f"{tuple(scales.shape)}")


def dispatch_fp8(x_fp8, scales, plan, probs=None, *, probs_dtype=None, stream=None):
    """Dispatch FP8 rows and their per-token scales with one plan (:func:`moe_rt.dispatch`, twice).

    Args:
        x_fp8: ``[T,H]`` float8_e4m3fn or float8_e5m2, moved bit for bit.
        scales: ``[T,S]`` float32 (e.g. the ``[T, H/128]`` block scales of :func:`quantize_fp8`) or uint8
            (e.g. MXFP8's E8M0 exponents), moved bit for bit with the same plan.
        plan: from :func:`moe_rt.make_plan` on the same device, ``T == plan.num_tokens``.
        probs, probs_dtype, stream: as in :func:`moe_rt.dispatch`.

    Returns:
        ``(x_fp8_permuted [N,H], scales_permuted [N,S], probs_permuted [N] or None)``:
        ``x_fp8_permuted[dst_row[t,k]] = x_fp8[t]`` and ``scales_permuted[dst_row[t,k]] = scales[t]``; rows
        holding no routed slot (padding, unused tail) are zero in both (zero scales: they dequantize to 0).
    """
    with _arrays.Call({"x_fp8": x_fp8, "scales": scales}, stream=stream) as call:
        check_dispatch_fp8_args(call["x_fp8"], call["scales"])
    xp, pp = _perm.dispatch(x_fp8, plan, probs, probs_dtype=probs_dtype, stream=stream)
    sp, _ = _perm.dispatch(scales, plan, stream=stream)
    return xp, sp, pp
