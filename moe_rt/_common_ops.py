"""Small device utilities built on kernels/common.cu: a scale-copy (the registry's smoke kernel) and a byte
fill that zeroes padding rows of dispatch outputs."""
from __future__ import annotations

import numpy as np

from moe_rt import _arrays, _jit

_jit.register("common.cu", [f"scale_copy<{c}>" for c in _jit.CTYPES.values()] + ["fill_bytes"])

_THREADS = 256


def grid_for(n_items: int, threads: int = _THREADS, per_thread: int = 1, device_id: int = 0) -> int:
    """Blocks for a grid-stride loop over ``n_items``: enough to fill the device, no more than needed."""
    need = -(-max(n_items, 0) // (threads * per_thread))
    cap = _jit.device_properties(device_id)["sm_count"] * 8
    return max(1, min(need, cap)) if n_items > 0 else 0


def scale_copy_into(x, y, alpha: float, stream) -> None:
    """y = alpha * x elementwise (CuPy arrays, same shape, C-contiguous, a float dtype)."""
    fn = _jit.function("common.cu", f"scale_copy<{_jit.ctype(x.dtype)}>")
    n = x.size
    _jit.launch(fn, grid_for(n // 4 + 1, device_id=x.device.id), _THREADS,
                (x, y, np.float32(alpha), np.int64(n)), stream=stream)


def fill_bytes(arr, value: int, stream, *, start: int = 0, nbytes: int | None = None) -> None:
    """Set ``nbytes`` bytes of the CuPy array ``arr`` (from byte ``start``) to ``value``."""
    total = arr.nbytes - start if nbytes is None else nbytes
    if total <= 0:
        return
    fn = _jit.function("common.cu", "fill_bytes")
    _jit.launch(fn, grid_for(total // 16 + 1, device_id=arr.device.id), _THREADS,
                (arr.data.ptr + start, np.uint8(value), np.int64(total)), stream=stream)


def scale(x, alpha: float, *, stream=None):
    """``alpha * x`` for an fp32/fp16/bf16 array of any framework, computed in fp32; the result comes back
    in the caller's framework and device. On CUDA it runs the registry's vectorized kernel."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)):
        raise TypeError(f"alpha: expected a number, got {type(alpha).__name__}")
    if not np.isfinite(alpha):
        raise ValueError(f"alpha: must be finite, got {alpha}")
    with _arrays.Call({"x": x}, stream=stream) as call:
        xv = call["x"]
        _arrays.check_dtype(xv, "x", _arrays.FLOAT_DTYPES)
        xv = _arrays.contiguous(call.xp, xv)
        if call.backend == "cpu":
            y = (xv.astype(np.float32) * np.float32(alpha)).astype(xv.dtype)
        else:
            y = call.xp.empty_like(xv)
            scale_copy_into(xv, y, float(alpha), call.stream)
        return call.out(y)
