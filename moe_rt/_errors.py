"""Bad routing, one semantics on every backend: expert ids outside ``[-1, E)`` raise ValueError.

The CPU path (the NumPy reference) checks the ids before it computes and raises at once. A CUDA kernel
cannot raise, and checking on the host would need a device sync in every op, so the kernels that read
expert ids (:func:`moe_rt.make_plan`'s counting kernel, :meth:`moe_rt.EpGroup.prepare`'s routing pack)
record the first bad id they meet in the device's **error word** and go on treating it as ``-1``: nothing
is written out of bounds, the slot is dropped. The error is raised, with the CPU path's message, at the
next host-visible point:

- :func:`check` (``moe_rt.check``): waits for the device, reads and clears the word, raises (also the words
  of the C core's contexts: the one on which moe_rt.jax's XLA handlers run, and the one of the Python ops
  that call the core, :mod:`moe_rt._core`);
- the host reads moe_rt already makes: exact-mode ``EpGroup.prepare``'s count read,
  ``EpGroup.synchronize`` and ``EpGroup.check_overflow``;
- at once, with a sync after the op, under the debug switch: ``validate=True`` on ``make_plan`` /
  ``EpGroup.prepare``, or for every call ``MOE_RT_DEBUG=1`` (read once at import) / :func:`set_debug`.

So CUDA raises later than CPU, and at a point that may be several ops after the bad call; the message names
the argument and the bad value as the CPU path does. The word is 8 ints per device: a ``__device__`` global
of ``kernels/errors.cu`` (its one program, loaded once per device: the word exists, zero, with no
allocation or memset on a stream, safe while a stream is captured). Kernels get its address as an
argument, a constant per device, so recorded launches and CUDA graph replays write it like any launch. The
kernels only write it; nothing syncs unless asked (the debug switch syncs, so it is not for code under graph
capture).
"""
from __future__ import annotations

import os

import numpy as np

from moe_rt import _jit

__all__ = ["check", "set_debug"]

_FILE = "errors.cu"
_SYMBOL = "moe_rt_error_word"
_CLEAR = "error_word_clear"  # the program whose copy of the word is the device's
_jit.register(_FILE, [_CLEAR])
WORDS = 8  # MOE_RT_ERR_WORDS in include/moe_rt/common.cuh

# Op families: the bit a kernel sets (MOE_RT_ERR_* in common.cuh) -> (the op, the argument its message names)
MAKE_PLAN = 1
EP_PREPARE = 2
ROUTER_BWD = 4
EP_LL_DISPATCH = 8
_FAMILIES = {MAKE_PLAN: ("make_plan", "routing"), EP_PREPARE: ("EpGroup.prepare", "topk_idx"),
             ROUTER_BWD: ("topk_with_score_backward", "topk_indices"),
             EP_LL_DISPATCH: ("LowLatencyGroup.dispatch", "topk_idx")}

_words: dict = {}  # device id -> address of its error word


def message(name: str, num_experts: int, value) -> str:
    """The ValueError text of a bad expert id, the same on every backend."""
    return f"{name}: expert ids must be in [-1, num_experts={num_experts}), got {int(value)}"


def check_ids(idx: np.ndarray, num_experts: int, name: str) -> None:
    """The CPU path's check: raise ValueError naming the first id (in slot order) outside [-1, E)."""
    if idx.size and (idx.min() < -1 or idx.max() >= num_experts):
        bad = idx[(idx < -1) | (idx >= num_experts)][0]
        raise ValueError(message(name, num_experts, bad))


def word(device_id: int) -> int:
    """The address of ``device_id``'s error word (its module is loaded on first use)."""
    p = _words.get(device_id)
    if p is None:
        p = _words[device_id] = _jit.global_ptr(_FILE, _CLEAR, _SYMBOL, device_id)
    return p


# -- the debug switch ----------------------------------------------------------------------------------

def parse_debug(value) -> bool:
    """``MOE_RT_DEBUG``'s value: unset, empty or ``0`` = off, ``1`` = on; anything else is a ValueError."""
    if value is None or value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"MOE_RT_DEBUG: expected 0 or 1, got {value!r}")


DEBUG = parse_debug(os.environ.get("MOE_RT_DEBUG"))


def debug() -> bool:
    """Whether the debug switch is on (a replay signature's variant: recorded calls follow it)."""
    return DEBUG


def set_debug(enabled: bool) -> bool:
    """Turn the eager check of expert ids on or off for every later call (``MOE_RT_DEBUG`` sets it at
    import). On, each CUDA ``make_plan`` and ``EpGroup.prepare`` waits for its stream and raises the CPU
    path's ValueError at once (a device sync per call: for debugging, not under graph capture). Returns
    the previous setting."""
    global DEBUG
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    prev, DEBUG = DEBUG, bool(enabled)
    return prev


def resolve_validate(validate) -> bool:
    """An op's ``validate=`` keyword: None follows the debug switch; else a bool."""
    if validate is None:
        return DEBUG
    if not isinstance(validate, (bool, np.bool_)):
        raise TypeError(f"validate: expected a bool or None, got {type(validate).__name__}")
    return bool(validate)


# -- reading the word ------------------------------------------------------------------------------------

def _read(device_id: int, ptr: int, stream) -> np.ndarray:
    # On ``stream`` when given (so the copy waits for that stream only, never for other streams' work,
    # such as NCCL kernels waiting on peers), else on the legacy stream.
    import cupy

    rt = cupy.cuda.runtime
    host = np.zeros(WORDS, np.uint32)
    with cupy.cuda.Device(device_id):
        if stream is None:
            rt.memcpy(host.ctypes.data, ptr, host.nbytes, rt.memcpyDeviceToHost)
        else:
            rt.memcpyAsync(host.ctypes.data, ptr, host.nbytes, rt.memcpyDeviceToHost, stream.ptr)
            stream.synchronize()
    return host


def _clear(device_id: int, stream) -> None:
    import cupy

    with cupy.cuda.Device(device_id):
        _jit.launch(_jit.function(_FILE, _CLEAR), 1, WORDS, (), stream=stream)
        (stream if stream is not None else cupy.cuda.get_current_stream()).synchronize()


def error_of(w: np.ndarray, device_id: int) -> ValueError:
    """The ValueError a read error word stands for."""
    w = w.astype(np.uint64)
    value = int(np.int64(w[2] | (w[3] << np.uint64(32))))
    slot = int(w[4] | (w[5] << np.uint64(32)))
    op, name = _FAMILIES.get(int(w[7]), ("an op", "topk_idx"))
    err = ValueError(message(name, int(w[6]), value))
    note = (f"recorded on cuda:{device_id} by {op} at flat slot {slot} (t*K + k), which it dropped; CUDA "
            "raises bad ids at the next host-visible point (moe_rt.check, EpGroup host waits), the CPU path at once")
    others = [o for bit, (o, _) in _FAMILIES.items() if int(w[0]) & bit and bit != int(w[7])]
    if others:
        note += f"; {', '.join(others)} also met bad ids since the last check"
    if hasattr(err, "add_note"):
        err.add_note(note)
    return err


def raise_word(w: np.ndarray, device_id: int, stream=None) -> None:
    """Given the word as read from ``device_id`` (8 uint32): if it holds an error, clear the device's word
    (on ``stream``, a CuPy stream; None = CuPy's current) and raise it."""
    if w[0]:
        _clear(device_id, stream)
        raise error_of(w, device_id)


def raise_pending(device_id: int, stream=None) -> None:
    """Raise the error recorded on ``device_id`` (clearing the word), if any. The caller has waited for
    the work to check (a stream or the device); the read and the clear run on ``stream`` (a CuPy stream;
    None = the legacy stream for the read, CuPy's current stream for the clear)."""
    ptr = _words.get(device_id)
    if ptr is None:  # no kernel that records errors was ever given this device's word
        return
    raise_word(_read(device_id, ptr, stream), device_id, stream)


def _check_stream_arg(stream) -> None:
    if stream is None:
        return
    if isinstance(stream, bool) or not (isinstance(stream, int) or hasattr(stream, "__cuda_stream__")
                                        or hasattr(stream, "cuda_stream") or hasattr(stream, "ptr")):
        raise TypeError(f"stream: expected a CUDA stream, an int cudaStream_t or None, got {type(stream).__name__}")


def _check_core(core, device, stream) -> None:
    """:func:`check` for the core contexts of the Python ops: wait (the whole device, or ``stream``) and raise
    what the device's core error word holds (moe_rt_check reads and clears it)."""
    import cupy

    from moe_rt import _arrays

    if stream is not None and device is None:
        device = cupy.cuda.Device().id
    for d in ([device] if device is not None else sorted(core._devices)):
        if d not in core._devices:
            continue
        with cupy.cuda.Device(d):
            if stream is None:
                cupy.cuda.runtime.deviceSynchronize()
                core.check(d, 0)
            else:
                core.check(d, _arrays.as_cupy_stream(stream, d).ptr)


def check(device=None, *, stream=None) -> None:
    """Raise the bad expert ids the CUDA kernels recorded since the last check, as the CPU path raises them
    at once: ``ValueError("topk_idx: expert ids must be in [-1, num_experts=E), got V")`` (``routing:`` for
    :func:`moe_rt.make_plan`, ``topk_indices:`` for :func:`moe_rt.topk_with_score_backward` from indices). Reads and clears the device's error word.

    Args:
        device: None (every device moe_rt's routing kernels ran on) or a CUDA device id.
        stream: None: wait for the whole device first (every stream); or the stream (torch, CuPy,
            ``__cuda_stream__`` object, int) the checked ops ran on: wait for it only (``device`` None
            then means the current device).

    A device that never ran those kernels (a CPU-only process: the CPU path has raised already) has
    nothing to check: a no-op. A host sync; not for code under graph capture.
    """
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise TypeError(f"device: expected a CUDA device id (int) or None, got {type(device).__name__}")
        if int(device) < 0:
            raise ValueError(f"device: expected a CUDA device id >= 0, got {int(device)}")
        device = int(device)
    _check_stream_arg(stream)
    import sys

    xla = sys.modules.get("moe_rt._xla")
    if xla is not None:  # moe_rt.jax's XLA handlers run make_plan in the C core, with its own error word
        xla.check(device)
    core = sys.modules.get("moe_rt._core")
    if core is not None and core._devices:  # the Python ops' core contexts (moe_rt._core), a word each
        _check_core(core, device, stream)
    if not _words:
        return
    import cupy

    from moe_rt import _arrays

    if stream is not None and device is None:
        device = cupy.cuda.Device().id
    for d in ([device] if device is not None else sorted(_words)):
        if d not in _words:
            continue
        with cupy.cuda.Device(d):
            if stream is None:
                cupy.cuda.runtime.deviceSynchronize()
                s = None
            else:
                s = _arrays.as_cupy_stream(stream, d)
                s.synchronize()
            raise_pending(d, s)
