"""Router ops: top-k with a score function, the dense scores for the aux loss, and the aux loss itself,
each with its backward (docs/router.md). CUDA arrays run kernels/router.cu through the C core (moe_rt._core:
the ops validate here, allocate their results and make one core call; the Quantile Balancing ops plan here,
the core has none); CPU arrays run :mod:`moe_rt.reference.router`. Results come back in the caller's framework and device.

Shared conventions (both backends):

- ``T`` is the number of tokens (the product of the leading dims of ``logits``), ``E`` the number of
  experts (last dim, 1..16384), ``K`` = ``topk`` (1..64, <= E).
- Selection order is (value desc, index asc) on the fp32 value. **NaN**: every NaN ranks above +inf (all
  NaNs equal, lowest index first), so a NaN logit is always selected and NaN propagates into the probs of
  its row's selected experts (post-softmax, pre-softmax and normalized sigmoid rows become NaN on the
  selection; a pre-softmax row with a NaN is NaN everywhere and selects its K lowest indices).
- Outputs are bitwise reproducible run to run (fixed summation orders, no float atomics).
- No autograd: torch tensors that require grad while grad mode is on are refused with a TypeError (the
  differentiable ops are in :mod:`moe_rt.torch`; or pass ``.detach()`` / call under ``torch.no_grad()``), and
  so are JAX tracers (inside ``jax.jit``: use :mod:`moe_rt.jax`).
"""
from __future__ import annotations

import math

import numpy as np

from moe_rt import _arrays, _core, _errors, _jit
from moe_rt.reference import router as ref

SCORE_FUNCTIONS = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}
# routing_map_format: "bytemap" (bool [..., E]) or "bitmap_u8" (uint8 [..., ceil(E/8)], bit e % 8 of byte e // 8)
MAP_FORMATS = ("bytemap", "bitmap_u8")
INDEX_DTYPES = (np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64))
MAX_EXPERTS = 16384
MAX_TOPK = 64
_TEAMS = (32, 128, 512)
_REG_V = (8, 16, 32)  # keys per lane of router_fwd_reg (E <= 1024)
_FILE = "router.cu"
# The kernel choices of the ops the C core runs (top-k and its backward, the aux scores and loss) are the
# core's (csrc/router.c); this module plans only the Quantile Balancing ops, which the core lacks. Their
# kernel variants for benchmarks and tests, read once (tests patch these attributes):
# a value they do not know is a ValueError at import (a misspelt variant would time the default silently)
_FWD_VARIANT = _jit.env_choice("MOE_RT_ROUTER_FWD", ("default", "generic"), None)
_TEAM_VARIANT = _jit.env_choice("MOE_RT_ROUTER_TEAM", ("32", "128"), None)
# tokens per warp of the QB forward's row kernels, 0 = one resident wave (MOE_RT_ROUTER_TPW="f" at import
# overrides the default of _fwd_tpw: a benchmark variant)
_TPW_VARIANT = _jit.env_ints("MOE_RT_ROUTER_TPW", None)

_jit.register(_FILE, [f"router_fwd<{c}, {team}>" for c in _jit.CTYPES.values() for team in _TEAMS]
              + [f"router_fwd<{c}, 32, false>" for c in _jit.CTYPES.values()]
              + [f"router_fwd_reg<{c}, {v}>" for c in ("float", "__nv_bfloat16") for v in _REG_V]
              + [f"router_fwd_reg<{c}, 8, false>" for c in ("float", "__nv_bfloat16")]
              + [f"router_fwd_reg<{c}, 8, true, true>" for c in ("float", "__nv_bfloat16")]
              # short rows: a token on each segment of 4, 8 or 16 lanes (byte map, bit-packed map)
              + [f"router_fwd_reg<{c}, {ch}, false, false, {b}, -1, {w}>" for c, ch in (("float", 4), ("__nv_bfloat16", 8))
                 for b in ("false", "true") for w in (4, 8, 16)]
              + [f"router_bwd<{c}, {c}, {team}>" for c in _jit.CTYPES.values() for team in _TEAMS]
              + [f"router_bwd<float, {c}, {team}>" for c in ("__half", "__nv_bfloat16") for team in _TEAMS]
              + [f"router_bwd_sel<{c}, {team}>" for c in _jit.CTYPES.values() for team in _TEAMS]
              + [f"router_bwd_sel_reg<{c}, {team}>" for c in _jit.CTYPES.values() for team in _TEAMS]
              # the bit-packed routing map (routing_map_format="bitmap_u8"), and the backward from dense indices
              + [f"router_fwd<{c}, {team}, true, true>" for c in _jit.CTYPES.values() for team in _TEAMS]
              + [f"router_fwd<{c}, 32, false, true>" for c in _jit.CTYPES.values()]
              + [f"router_fwd_reg<{c}, {v}, true, false, true>" for c in ("float", "__nv_bfloat16") for v in _REG_V]
              + [f"router_fwd_reg<{c}, 8, false, false, true>" for c in ("float", "__nv_bfloat16")]
              + [f"router_fwd_reg<{c}, 8, true, true, true>" for c in ("float", "__nv_bfloat16")]
              + [f"router_bwd<{c}, {c}, {team}, true>" for c in _jit.CTYPES.values() for team in _TEAMS]
              + [f"router_bwd_sel<{c}, {team}, true>" for c in _jit.CTYPES.values() for team in _TEAMS]
              + [f"router_bwd_sel_reg<{c}, {team}, true>" for c in _jit.CTYPES.values() for team in _TEAMS]
              + [f"router_bwd_idx<{c}>" for c in _jit.CTYPES.values()]
              + [f"aux_loss_partial<{c}>" for c in _jit.CTYPES.values()]
              + [f"aux_loss_final<{c}>" for c in _jit.CTYPES.values()]
              + [f"aux_loss_bwd<{c}, {d}>" for c in _jit.CTYPES.values() for d in ("false", "true")]
              + [f"router_fwd_qb<{c}, {team}>" for c in _jit.CTYPES.values() for team in _TEAMS]
              + [f"router_fwd_qb<{c}, {team}, false>" for c in _jit.CTYPES.values() for team in _TEAMS]
              + [f"router_fwd_qb_reg<{c}, {v}>" for c in ("float", "__nv_bfloat16") for v in _REG_V]
              + [f"qb_histogram_accumulate<{v}>" for v in (1, 4)])
# Quick kernels (stand-ins while a kernel compiles on a first call: moe_rt._jit.compile_in_background; the C
# core's planner names them, csrc/router.c fwd_stand_in): compiled for one score case alone, each computes the
# bits of the kernel it stands in for in that case: a row of one warp, with groups (for the one-warp and
# register kernels with groups; no aux mode there; for K <= 8 compiled without the paths of K > 8) or without,
# and 8 to 32 keys a lane without groups (for bf16 at 8 keys the kernel itself compiles in about a second).
# Warmup leaves them out.
_jit.register(_FILE, [f"router_fwd<{c}, 32, {gr}, false, {s}>" for c in _jit.CTYPES.values()
                      for gr, cases in (("false", range(7)), ("true", (0, 2, 3, 5, 6))) for s in cases]
              + [f"router_fwd<{c}, 32, true, false, {s}, true>" for c in _jit.CTYPES.values() for s in (0, 2, 3, 5, 6)]
              + [f"router_fwd_reg<{c}, {v}, false, false, false, {s}>" for c in ("float", "__nv_bfloat16")
                 for v in _REG_V if v != 8 or c == "float" for s in range(7)], quick=True)
__all__ = ["topk_with_score", "topk_with_score_backward", "topk_indices_with_score", "scores_for_aux_loss",
           "scores_for_aux_loss_backward", "aux_loss", "aux_loss_backward", "topk_with_score_qb",
           "qb_histogram_accumulate", "update_expert_bias_with_quantile"]


# ---- validation ---------------------------------------------------------------------------------------

def _check_choice(value, name, choices):
    """TypeError unless ``value`` is a str, ValueError unless it is one of ``choices`` (a list)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, one of {choices}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def _check_score_function(score_function):
    _check_choice(score_function, "score_function", sorted(SCORE_FUNCTIONS))


def _check_bool(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def check_map_format(routing_map_format) -> bool:
    """``routing_map_format``: ``"bytemap"`` or ``"bitmap_u8"`` (exact strings); True for the bitmap."""
    if not isinstance(routing_map_format, str):
        raise TypeError(f"routing_map_format: expected a str, one of {list(MAP_FORMATS)}, got "
                        f"{type(routing_map_format).__name__}")
    if routing_map_format not in MAP_FORMATS:
        raise ValueError(f"routing_map_format: expected one of {list(MAP_FORMATS)}, got {routing_map_format!r}")
    return routing_map_format == "bitmap_u8"


def bitmap_bytes(num_experts: int) -> int:
    """Bytes a row of the bit-packed routing map takes: ceil(E / 8)."""
    return (num_experts + 7) // 8


def parse_index_dtype(dtype, name="topk_indices_dtype") -> np.dtype:
    """An index dtype given as a NumPy, torch or JAX dtype (or its name): int16, int32 or int64."""
    if isinstance(dtype, bool) or dtype is None:
        raise TypeError(f"{name}: expected int16, int32 or int64 (a dtype or its name), got {dtype!r}")
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    try:
        dt = np.dtype(text if isinstance(dtype, str) or str(dtype).startswith("torch.") else dtype)
    except TypeError:
        raise TypeError(f"{name}: expected int16, int32 or int64 (a dtype or its name), got {dtype!r}") from None
    if dt not in INDEX_DTYPES:
        raise ValueError(f"{name}: expected int16, int32 or int64, got {dt.name}")
    return dt


def check_topk_outputs(xv, topk, routing_map_format, topk_indices, topk_indices_dtype):
    """The routing output of :func:`topk_with_score`: ``(bitmap, index dtype or None)``. ``topk_indices``:
    a caller buffer (anything with ``shape`` and ``dtype``), ``topk_indices_dtype``: a dtype; at most one."""
    bitmap = check_map_format(routing_map_format)
    if topk_indices is None and topk_indices_dtype is None:
        return bitmap, None
    if topk_indices is not None and topk_indices_dtype is not None:
        raise ValueError("topk_indices, topk_indices_dtype: pass a buffer or a dtype, not both")
    if bitmap:
        raise ValueError("topk_indices: the dense index output cannot be combined with "
                         "routing_map_format='bitmap_u8' (pass one routing output)")
    if topk_indices is not None:
        if not hasattr(topk_indices, "shape") or not hasattr(topk_indices, "dtype"):
            raise TypeError(f"topk_indices: expected an int16/int32/int64 array (a buffer for the indices), got "
                            f"{type(topk_indices).__name__}")
        try:
            dt = parse_index_dtype(topk_indices.dtype, "topk_indices")
        except ValueError as e:
            raise TypeError(str(e)) from None
    else:
        dt = parse_index_dtype(topk_indices_dtype)
    E = int(xv.shape[-1]) if len(xv.shape) else 0
    if dt == np.int16 and E > 32767:
        raise ValueError(f"topk_indices: int16 indices need num_experts <= 32767, got {E}")
    return bitmap, dt


def _check_topk_flags(E, topk, score_function, use_pre_softmax, scaling_factor):
    """The settings :func:`topk_with_score` and its backward share, validated one way for both:
    ``(K, scale, pre)``."""
    _check_score_function(score_function)
    K = _check_topk(topk, E)
    scale = _check_scaling(scaling_factor)
    pre = _check_bool(use_pre_softmax, "use_pre_softmax") and score_function == "softmax"
    return K, scale, pre


# float32's largest value, and half its last step above it: from there on float32(value) rounds to inf
_F32_MAX = float(np.finfo(np.float32).max)
_F32_INF_AT = _F32_MAX + 2.0 ** 103


def _check_float(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be finite, got {value}")
    if abs(value) >= _F32_INF_AT:  # the kernels and the reference take it as float32: inf there
        raise ValueError(f"{name}: must be finite in float32 (|{name}| <= {_F32_MAX:.7g}), got {value}")
    return value


def _check_logits(lv, name="logits"):
    _arrays.check_dtype(lv, name, _arrays.FLOAT_DTYPES)
    if lv.ndim < 2:
        raise ValueError(f"{name}: expected a [..., num_experts] array with at least 2 dims, got shape "
                         f"{tuple(lv.shape)}")
    E = int(lv.shape[-1])
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"{name}: num_experts (last dim) must be in [1, {MAX_EXPERTS}], got {E}")
    return E


def _check_topk(topk, E):
    topk = _arrays.check_int(topk, "topk", low=1)
    if topk > E:
        raise ValueError(f"topk: must be <= num_experts ({E}), got {topk}")
    if topk > MAX_TOPK:
        raise ValueError(f"topk: at most {MAX_TOPK} is supported, got {topk}")
    return topk


def _check_groups(num_groups, group_topk, topk, E):
    """(G, g) with G = 0 when grouping is off."""
    if group_topk is None:
        if num_groups is not None:
            _arrays.check_int(num_groups, "num_groups", low=1)
        return 0, 0
    g = _arrays.check_int(group_topk, "group_topk", low=1)
    if num_groups is None:
        raise ValueError("group_topk: given without num_groups; pass num_groups too (or group_topk=None)")
    G = _arrays.check_int(num_groups, "num_groups", low=1)
    if E % G != 0:
        raise ValueError(f"num_groups: must divide num_experts ({E}), got {G}")
    if g > G:
        raise ValueError(f"group_topk: must be <= num_groups ({G}), got {g}")
    if topk % g != 0:
        raise ValueError(f"group_topk: must divide topk ({topk}), got {g}")
    if topk // g > E // G:
        raise ValueError(f"topk/group_topk ({topk // g}) must be <= num_experts/num_groups ({E // G})")
    return G, g


def _check_scaling(scaling_factor):
    return 1.0 if scaling_factor is None else _check_float(scaling_factor, "scaling_factor")


def _vec_ok(arrays, E, ch):
    return E % ch == 0 and all(a is None or a.data.ptr % 16 == 0 for a in arrays)


def _team(E, fwd=False):
    """Threads per token of the generic kernels: one warp up to E = 1024 (and for the forward up to 2304,
    where it measured faster than 128 threads; the backward is faster with 128). ``_TEAM_VARIANT`` (32 or
    128, from MOE_RT_ROUTER_TEAM at import) picks it for 1024 < E <= 4096 (a benchmark and test variant)."""
    if E <= 1024:
        return 32
    if E <= 4096:
        forced = _TEAM_VARIANT
        if forced in ("32", "128"):
            return int(forced)
        return 32 if fwd and E <= 2304 else 128
    return 512


def _slot_words(E, G, K, team):
    al4 = lambda x: (x + 3) & ~3  # noqa: E731
    nw = team // 32
    kp = al4(K)
    return al4(E) + al4(G) + 16 * team + 32 * nw + 64 + 16 + nw * kp + 2 * 64 + 4 + 4 * kp


def _qb_reg_slot_words(K):
    """A token slot of router_fwd_qb_reg: the radix list, then the K routes' experts, keys, weights, probs."""
    return 2 * 64 + 4 + 4 * ((K + 3) & ~3)


def _reg_v(E, ch, vec, dtype):
    """Keys per lane of the register kernel (float32, bfloat16; E <= 1024) for this row, or 0 (generic
    kernel). ``_FWD_VARIANT = "generic"`` (MOE_RT_ROUTER_FWD at import) forces the generic kernel (a benchmark
    and test variant)."""
    if not vec or dtype == np.float16 or _FWD_VARIANT == "generic":
        return 0
    need = -(-(E // ch) // 32) * ch
    return next((v for v in _REG_V if v >= need), 0)


def _tpw_grid(T, spb, tpw, resident):
    """Blocks for T tokens: tpw tokens per warp (token slot), or with tpw = 0 at most one resident wave
    that strides over the rows."""
    if tpw:
        return max(1, -(-T // (spb * tpw)))
    return max(1, min(-(-T // spb), resident))


def _fwd_tpw(dtype, v, ls, team=32):
    """Tokens per warp of the one-warp forward kernels. On H100 at T = 65536 (us, one resident wave -> this
    setting): generic kernel, E = 2304: fp32 softmax 801 -> 771, grouped 1077 -> 1030, bf16 softmax 658 -> 600,
    grouped 892 -> 848 (1 token); register kernel, E = 256: bf16 softmax 69.9 -> 65.0, grouped 84.8 -> 77.9,
    fp32 grouped 97.7 -> 89.4 (2 tokens; 1 token: 68.9 / 80.6 / 91.7). fp32 without groups was faster as
    one wave (softmax 87.2 us, 90.4 with 4 tokens, 108 with 1)."""
    if _TPW_VARIANT is not None:
        return _TPW_VARIANT[0]
    if not v:
        return 1 if team == 32 else 0
    if v == 8 and (dtype.itemsize == 2 or ls):
        return 2
    return 0


def _grid(n_slots_needed, threads, smem, device_id, regs=0):
    p = _jit.device_properties(device_id)
    per_sm = max(1, min(2048 // threads, 32, (p["smem_per_sm"] or 228 * 1024) // (smem + 1024)))
    if regs:
        per_sm = max(1, min(per_sm, 65536 // (threads * (-(-regs // 8) * 8))))
    return max(1, min(n_slots_needed, p["sm_count"] * per_sm))


def _check_topk_agreement(m, y, K, score_function, pre):
    """CPU check that the forward's routing map ``m`` and intermediate ``y`` ([T, E] NumPy) agree with
    ``topk`` and the score function given to the backward (NaN entries pass)."""
    if m.size == 0:
        return
    rows = np.count_nonzero(m, axis=1)
    if (rows != K).any():
        bad = int(rows[rows != K][0])
        raise ValueError(f"topk: the routing_map has {bad} experts in a row but topk is {K}; pass the topk "
                         "given to the forward")
    if score_function == "softmax" and not pre:
        off = y[~m]
        if off.size and (off != -np.inf).any():
            raise ValueError("score_function/use_pre_softmax: the intermediate is not a post-softmax one "
                             "(-inf off the routing map); pass the settings given to the forward")
    elif score_function == "sigmoid" or pre:
        if ((y < 0) | (y > 1)).any():
            what = "use_pre_softmax" if pre else "score_function"
            raise ValueError(f"{what}: the intermediate has values outside [0, 1], which a "
                             f"{'pre-softmax' if pre else 'sigmoid'} forward does not make; pass the settings "
                             "given to the forward")
        if pre:
            sums = y.sum(axis=1, dtype=np.float64)
            if (np.abs(sums - 1.0) > 1e-3).any():  # NaN rows compare False and pass
                raise ValueError("use_pre_softmax: the intermediate's rows do not sum to 1, so it is not a "
                                 "pre-softmax one; pass the settings given to the forward")


def _flat(xp, arr, E):
    arr = _arrays.contiguous(xp, arr)
    if arr.ndim == 2 and E > 0 and arr.shape[1] == E:  # [T, E] already (the usual case): no new view
        return arr
    return arr.reshape(-1, E)


def _rows(call, arr, E, shape=None):
    """:func:`_flat` of the call's ``arr`` (``[..., E]``): ``(rows, lead, T)``, ``lead`` the leading shape (a
    tuple); ``shape``: ``arr``'s shape when the caller has it (the shape is read once at most)."""
    arr = call.contiguous(arr)
    shape = tuple(arr.shape) if shape is None else shape
    if len(shape) == 2 and E > 0 and shape[1] == E:  # [T, E] already (the usual case): no new view
        return arr, shape[:1], shape[0]
    arr = arr.reshape(-1, E)
    return arr, shape[:-1], arr.shape[0]


def _out_rows(call, arr, lead):
    """A result of ``[T, ...]`` rows handed back with the leading shape ``lead`` (a tuple) in place of T."""
    return call.out(arr if len(lead) == 1 else arr.reshape(lead + tuple(arr.shape[1:])))


def _shaped(arr, shape, have=None):
    """``arr`` reshaped to ``shape`` (a tuple): itself when it has that shape already (``have``: its shape,
    when the caller knows it)."""
    return arr if (tuple(arr.shape) if have is None else have) == shape else arr.reshape(shape)


_CODES = _core.CODES  # NumPy dtype -> the core's dtype code

# the checks' results by signature (see moe_rt._arrays.validated)
_sig, _fkey, _validated, _remember = _arrays.sig, _arrays.float_key, _arrays.validated, _arrays.remember


def _ptr(a) -> int:
    """The device address of a CUDA array (a CuPy array or DevArray; 0 for None), as the core takes it."""
    return 0 if a is None else a.data.ptr


def _check_bias(bv, E, score_function):
    if bv is None:
        return None
    if score_function == "softmax":
        raise ValueError("expert_bias: not allowed with score_function='softmax' (sigmoid or sqrtsoftplus only)")
    _arrays.check_dtype(bv, "expert_bias", _arrays.FLOAT_DTYPES)
    _arrays.check_shape(bv, "expert_bias", (E,))
    return bv


def check_topk_args(xv, bv, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor):
    """Every check of :func:`topk_with_score` (and :func:`topk_indices_with_score`) that needs only shapes,
    dtypes and the settings: ``(E, K, G, g, scale, pre)``. ``xv``, ``bv``: anything with ``shape``, ``ndim``
    and ``dtype`` (arrays, or JAX tracers when ``moe_rt.jax`` traces)."""
    key = (_sig(xv), _sig(bv), type(topk), topk, type(score_function), score_function,
           type(use_pre_softmax), use_pre_softmax, type(num_groups), num_groups, type(group_topk), group_topk,
           _fkey(scaling_factor))
    hit = _validated(_TOPK_ARGS, key)
    if hit is not None:
        return hit
    E = _check_logits(xv)
    K, scale, pre = _check_topk_flags(E, topk, score_function, use_pre_softmax, scaling_factor)
    G, g = _check_groups(num_groups, group_topk, K, E)
    _check_bias(bv, E, score_function)
    return _remember(_TOPK_ARGS, key, (E, K, G, g, scale, pre))


_TOPK_ARGS: dict = {}


def _topk_checks(xv, bv, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor,
                 routing_map_format, topk_indices, topk_indices_dtype):
    """:func:`check_topk_outputs` then :func:`check_topk_args`, kept by signature (``topk_indices``: the
    caller's buffer or None): ``(bitmap, index dtype or None, E, K, G, g, scale, pre)``."""
    key = (_sig(xv), _sig(bv), _sig(topk_indices), type(topk), topk, type(score_function), score_function,
           type(use_pre_softmax), use_pre_softmax, type(num_groups), num_groups, type(group_topk), group_topk,
           _fkey(scaling_factor), type(routing_map_format), routing_map_format, type(topk_indices_dtype),
           topk_indices_dtype)
    hit = _validated(_TOPK_CALLS, key)
    if hit is not None:
        return hit
    outputs = check_topk_outputs(xv, topk, routing_map_format, topk_indices, topk_indices_dtype)
    return _remember(_TOPK_CALLS, key, outputs + check_topk_args(xv, bv, topk, score_function, use_pre_softmax,
                                                                  num_groups, group_topk, scaling_factor))


_TOPK_CALLS: dict = {}


def _prepare_topk(call, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor,
                  expert_bias):
    xv, bv = call["logits"], call["expert_bias"]
    E, K, G, g, scale, pre = check_topk_args(xv, bv, topk, score_function, use_pre_softmax, num_groups,
                                             group_topk, scaling_factor)
    # rows flattened to [T, E]; ``lead`` restores the leading shape of the outputs
    return tuple(xv.shape[:-1]), _flat(call.xp, xv, E), E, K, G, g, scale, pre, bv


def _ref_kwargs(score_function, pre, G, g, scale, bv):
    return dict(use_pre_softmax=pre, num_groups=G if G else None, group_topk=g if G else None,
                scaling_factor=scale, score_function=score_function,
                expert_bias=None if bv is None else np.asarray(bv))


# ---- top-k with score function ---------------------------------------------------------------------

def topk_with_score(logits, topk, *, score_function="softmax", use_pre_softmax=False, num_groups=None,
                    group_topk=None, scaling_factor=None, expert_bias=None, routing_map_format="bytemap",
                    topk_indices=None, topk_indices_dtype=None, stream=None):
    """Route each token to its ``topk`` experts (TE ``fused_topk_with_score_function``).

    Records no autograd: use the op of the same name in ``moe_rt.torch`` / ``moe_rt.jax`` to differentiate
    (torch tensors that require grad, and JAX tracers, are refused with a TypeError).

    Args:
        logits: ``[..., E]`` fp32, bf16 or fp16 router logits (T = product of the leading dims).
        topk: int K, 1 <= K <= min(E, 64).
        score_function: ``"softmax"``, ``"sigmoid"`` or ``"sqrtsoftplus"``.
        use_pre_softmax: softmax only: softmax over all E before the top-k, with no renormalization;
            otherwise (default) top-k on raw logits, then softmax over the K selected.
        num_groups, group_topk: group-limited top-k (both ints, or ``group_topk=None`` for none): E is
            split into ``num_groups`` groups of E/num_groups, a group's score is the sum of its top
            K/group_topk selection scores, and only the best ``group_topk`` groups are eligible.
        scaling_factor: float multiplied into the probs (None = 1.0; 0.0 zeroes them); finite.
        expert_bias: ``[E]`` fp32/bf16/fp16, sigmoid/sqrtsoftplus only; added for selection only.
        routing_map_format: ``"bytemap"`` (default: routing_map bool ``[..., E]``) or ``"bitmap_u8"``:
            routing_map uint8 ``[..., ceil(E/8)]``, bit ``e % 8`` of byte ``e // 8`` set where the token
            routes to e (LSB first: ``np.packbits(m, axis=-1, bitorder="little")``), padding bits 0; each byte
            written once, so the bytes are reproducible. :func:`topk_with_score_backward` takes it with
            ``routing_map_format="bitmap_u8"`` and gives the byte map's gradient bit for bit. The dispatch
            ops take no bitmap (:func:`moe_rt.reference.router.unpack_bitmap` or ``np.unpackbits`` first).
        topk_indices: instead of a map, the dense top-k indices into this caller buffer: ``[..., K]``
            int16/int32/int64, C-contiguous, writable, on the logits' device (not a JAX array: use
            ``topk_indices_dtype``). It is written in place and returned as the routing output (the same
            object). No ``[T, E]`` map is built; probs stay dense. int16 needs E <= 32767.
        topk_indices_dtype: the same output, allocated: int16, int32 or int64 (a NumPy, torch or JAX dtype,
            or its name). Not with ``topk_indices``. Neither combines with ``routing_map_format="bitmap_u8"``.
        stream: CUDA stream (None = the caller's current stream).

    Returns:
        ``(probs, routing_map, intermediate)``: probs ``[..., E]`` in the logits dtype (nonzero only on the
        selection), routing_map ``[..., E]`` bool (K trues per row) or the bitmap, or with an index output
        the indices ``[..., K]``: each row's experts in ascending expert id (the order of
        :func:`topk_indices_with_score`, not by score); intermediate ``[..., E]`` fp32 (what
        :func:`topk_with_score_backward` needs: sigmoid values, raw logits for sqrtsoftplus, the full
        softmax for pre-softmax, the selection's softmax and -inf elsewhere for post-softmax).
    """
    arrays = {"logits": logits, "expert_bias": expert_bias}
    if topk_indices is not None:
        arrays["topk_indices"] = topk_indices
    with _arrays.Call(arrays, stream=stream, lean=True) as call:
        xv, bv = call["logits"], call["expert_bias"]
        bitmap, idt, E, K, G, g, scale, pre = _topk_checks(xv, bv, topk, score_function, use_pre_softmax, num_groups,
                                                           group_topk, scaling_factor, routing_map_format,
                                                           topk_indices, topk_indices_dtype)
        # rows flattened to [T, E]; ``lead`` restores the leading shape of the outputs
        x, lead, T = _rows(call, xv, E)
        buf = None
        if topk_indices is not None:
            buf = _index_buffer(call, topk_indices, lead + (K,))
        if call.backend == "cpu":
            probs, rmap, inter = ref.topk_with_score_fwd(x, K, **_ref_kwargs(score_function, pre, G, g, scale, bv))
            if bitmap:
                rmap = ref.pack_bitmap(rmap)
            elif idt is not None:
                idx = ref.map_to_indices(rmap, K).astype(idt)
                if buf is not None:
                    buf[...] = idx.reshape(buf.shape)
                rmap = idx
        else:
            dt = x.dtype
            probs = call.empty((T, E), dtype=dt)
            rmap = idx = None
            if idt is None:
                rmap = call.empty((T, bitmap_bytes(E)) if bitmap else (T, E), dtype=np.uint8 if bitmap else np.bool_)
            elif buf is None:
                idx = call.empty((T, K), dtype=idt)
            else:
                idx = buf.reshape(T, K)
            inter = call.empty((T, E), dtype=np.float32)
            if idx is not None:
                rmap = idx
            if T > 0:
                b32 = None if bv is None else _arrays.as_f32(call.xp, bv)
                _core.topk_with_score(_core.device(call.device_id), _ptr(x), _CODES[dt], T, E, K,
                                      SCORE_FUNCTIONS[score_function], pre, G, g, scale, _ptr(b32), _ptr(probs),
                                      _ptr(rmap), _CODES[rmap.dtype], _ptr(inter), call.stream_ptr)
        routing = topk_indices if topk_indices is not None else _out_rows(call, rmap, lead)
        return _out_rows(call, probs, lead), routing, _out_rows(call, inter, lead)


def _index_buffer(call, obj, shape):
    """The view of the caller's ``topk_indices`` buffer ``obj``, checked: shape, contiguity, writability (its
    dtype and device were checked with the call)."""
    if type(obj).__module__.startswith("jax"):
        raise TypeError("topk_indices: JAX arrays cannot be written in place; pass topk_indices_dtype instead")
    v = call["topk_indices"]
    _arrays.check_shape(v, "topk_indices", shape)
    if hasattr(obj, "is_contiguous") and not obj.is_contiguous():  # torch
        raise ValueError("topk_indices: the buffer must be C-contiguous")
    flags = getattr(v, "flags", None)
    if flags is not None and not flags.c_contiguous:
        raise ValueError("topk_indices: the buffer must be C-contiguous")
    if flags is not None and hasattr(flags, "writeable") and not flags.writeable:
        raise ValueError("topk_indices: the buffer is read-only")
    return v


def topk_indices_with_score(logits, topk, *, score_function="softmax", use_pre_softmax=False, num_groups=None,
                            group_topk=None, scaling_factor=None, expert_bias=None, stream=None):
    """Compact form of :func:`topk_with_score` (same arguments), the input of the dispatch ops.

    Returns:
        ``(topk_idx, topk_weights)``: topk_idx ``[..., K]`` int32, the selected experts in ascending
        expert id; topk_weights ``[..., K]`` fp32, their probs (before the cast to the logits dtype).
    """
    with _arrays.Call({"logits": logits, "expert_bias": expert_bias}, stream=stream, lean=True) as call:
        lead, x, E, K, G, g, scale, pre, bv = _prepare_topk(call, topk, score_function, use_pre_softmax,
                                                            num_groups, group_topk, scaling_factor, expert_bias)
        T = x.shape[0]
        if call.backend == "cpu":
            idx, w = ref.topk_indices_fwd(x, K, **_ref_kwargs(score_function, pre, G, g, scale, bv))
        else:
            xp = call.xp
            idx = call.empty((T, K), dtype=np.int32)
            w = call.empty((T, K), dtype=np.float32)
            if T > 0:
                b32 = None if bv is None else _arrays.as_f32(call.xp, bv)
                _core.topk_indices_with_score(_core.device(call.device_id), _ptr(x), _CODES[x.dtype], T, E, K,
                                              SCORE_FUNCTIONS[score_function], pre, G, g, scale, _ptr(b32),
                                              _ptr(idx), _ptr(w), call.stream_ptr)
        return call.out(idx.reshape(lead + (K,))), call.out(w.reshape(lead + (K,)))


_TOPK_BWD_ARGS: dict = {}


def _check_topk_bwd_args(gv, mv, yv, iv, topk, score_function, use_pre_softmax, scaling_factor,
                         routing_map_format):
    """The shape, dtype and settings checks of :func:`topk_with_score_backward`: ``(bitmap, E, K, scale,
    pre)``."""
    key = (_sig(gv), _sig(mv), _sig(yv), _sig(iv), type(topk), topk, type(score_function),
           score_function, type(use_pre_softmax), use_pre_softmax, _fkey(scaling_factor), type(routing_map_format),
           routing_map_format)
    hit = _validated(_TOPK_BWD_ARGS, key)
    if hit is not None:
        return hit
    bitmap = check_map_format(routing_map_format)
    E = _check_logits(gv, "grad_probs")
    if iv is not None:
        if mv is not None:
            raise ValueError("routing_map, topk_indices: pass one (routing_map=None with topk_indices)")
        if bitmap:
            raise ValueError("topk_indices: cannot be combined with routing_map_format='bitmap_u8'")
        _arrays.check_dtype(iv, "topk_indices", INDEX_DTYPES)
    elif mv is None:
        raise TypeError("routing_map: expected the forward's routing map (or topk_indices=), got None")
    elif bitmap:
        _arrays.check_dtype(mv, "routing_map", (np.dtype(np.uint8),))
        _arrays.check_shape(mv, "routing_map", tuple(gv.shape[:-1]) + (bitmap_bytes(E),))
    else:
        _arrays.check_dtype(mv, "routing_map", (np.dtype(np.bool_),))
        _arrays.check_shape(mv, "routing_map", gv.shape)
    _arrays.check_dtype(yv, "intermediate", (np.dtype(np.float32),))
    _arrays.check_shape(yv, "intermediate", gv.shape)
    K, scale, pre = _check_topk_flags(E, topk, score_function, use_pre_softmax, scaling_factor)
    if iv is not None:
        _arrays.check_shape(iv, "topk_indices", tuple(gv.shape[:-1]) + (K,))
    return _remember(_TOPK_BWD_ARGS, key, (bitmap, E, K, scale, pre))


def topk_with_score_backward(grad_probs, routing_map, intermediate, topk, *, score_function,
                             use_pre_softmax=False, scaling_factor=None, routing_map_format="bytemap",
                             topk_indices=None, stream=None):
    """Backward of :func:`topk_with_score`.

    Args:
        grad_probs: ``[..., E]`` fp32/bf16/fp16, gradient of ``probs``.
        routing_map: ``[..., E]`` bool, from the forward; with ``routing_map_format="bitmap_u8"`` the
            forward's bitmap, uint8 ``[..., ceil(E/8)]``. None when ``topk_indices`` is given.
        intermediate: ``[..., E]`` fp32, from the forward.
        topk, score_function, use_pre_softmax, scaling_factor: as given to the forward.
        routing_map_format: ``"bytemap"`` or ``"bitmap_u8"``: what ``routing_map`` is.
        topk_indices: instead of a map, the forward's dense indices ``[..., K]`` int16/int32/int64 (any
            order within a row; -1 selects nothing). The sums then run over each row's K entries (fp32, in a
            fixed order; the map's backward sums in another order, so the two may differ in the last bits).
            Ids outside [-1, E) raise ValueError: at once on CPU; on CUDA the kernel records the id in the
            device's error word and skips it, and the error is raised at the next host-visible point
            (:func:`moe_rt.check`, or at once under the debug switch, :mod:`moe_rt._errors`).

    Returns:
        grad_logits ``[..., E]`` in the grad_probs dtype (every element written; zero off the selection
        except for pre-softmax, whose gradient is dense).

    The flags are validated as the forward validates them. On the CPU backend the routing map and the
    intermediate are also checked against them (K trues per row; -inf off the map for post-softmax; values in
    [0, 1] for sigmoid and pre-softmax, rows summing to 1 for pre-softmax): a ValueError names a setting the forward's outputs cannot have come
    from. On CUDA those checks would read the arrays on the host, so they are not made there; neither
    backend can tell ``scaling_factor`` or (between sigmoid-like rows) a differing score function apart.

    Off the routing map the gradient is zero (post-softmax, sigmoid, sqrtsoftplus), so on 16-byte rows the
    kernel reads the map and only the selected entries of ``grad_probs`` and ``intermediate``: their values
    elsewhere (NaN included) never reach the result, as in the reference. The bitmap gives the byte map's
    gradient bit for bit (the same kernels, reading bits).
    """
    with _arrays.Call({"grad_probs": grad_probs, "routing_map": routing_map, "intermediate": intermediate,
                       "topk_indices": topk_indices}, stream=stream, lean=True) as call:
        gv, mv, yv, iv = call["grad_probs"], call["routing_map"], call["intermediate"], call["topk_indices"]
        bitmap, E, K, scale, pre = _check_topk_bwd_args(gv, mv, yv, iv, topk, score_function, use_pre_softmax,
                                                        scaling_factor, routing_map_format)
        shape = tuple(gv.shape)
        g, _, T = _rows(call, gv, E, shape)
        y = _rows(call, yv, E, shape)[0]  # the intermediate has the grad's shape (checked)
        if iv is not None:
            idx = call.contiguous(iv).reshape(T, K)
            if call.backend == "cpu":
                _errors.check_ids(idx, E, "topk_indices")
                out = ref.topk_with_score_bwd_indices(g, idx, y, K, pre, scale, score_function)
            else:
                out = call.empty((T, E), dtype=g.dtype)
                if T > 0:
                    core = _core.device(call.device_id)
                    _core.topk_with_score_backward(core, _ptr(g), _CODES[g.dtype], _ptr(idx), _CODES[idx.dtype],
                                                   _ptr(y), T, E, K, SCORE_FUNCTIONS[score_function], pre, scale,
                                                   _ptr(out), call.stream_ptr)
                    if _errors.DEBUG:
                        core.check(call.stream_ptr)
            return call.out(_shaped(out, shape, (T, E)))
        mshape = tuple(mv.shape)
        m = _shaped(call.contiguous(mv), (T, int(mshape[-1])), mshape)
        if call.backend == "cpu":
            if bitmap:
                if E % 8 and (m[:, -1] >> (E % 8)).any():
                    raise ValueError("routing_map: padding bits past num_experts are set; a bitmap_u8 map from "
                                     "the forward has them 0")
                m = ref.unpack_bitmap(m, E)
            _check_topk_agreement(m, y, K, score_function, pre)
            out = ref.topk_with_score_bwd(g, m, y, K, pre, scale, score_function)
        else:
            dt = g.dtype
            out = call.empty((T, E), dtype=dt)
            if T > 0:
                _core.topk_with_score_backward(_core.device(call.device_id), _ptr(g), _CODES[dt], _ptr(m),
                                               _CODES[m.dtype], _ptr(y), T, E, K, SCORE_FUNCTIONS[score_function],
                                               pre, scale, _ptr(out), call.stream_ptr)
        return call.out(_shaped(out, shape, (T, E)))


# ---- Quantile Balancing ------------------------------------------------------------------------------

QB_HISTOGRAM_MODES = ("two_kernel", "fused_atomic")
MAX_QB_BINS = 1 << 24  # bins are counted in fp32 arithmetic: B - 1 must be exact
_I32 = np.dtype(np.int32)
_F32 = np.dtype(np.float32)


def _check_qb_mode(mode):
    _check_choice(mode, "qb_histogram_mode", list(QB_HISTOGRAM_MODES))
    return mode == "fused_atomic"


def _check_qb_histogram(hv, E):
    _arrays.check_dtype(hv, "qb_histogram", (_I32,))
    if hv.ndim != 2 or int(hv.shape[0]) != E or int(hv.shape[1]) < 1:
        raise ValueError(f"qb_histogram: expected an int32 [num_experts, num_bins] array with num_experts = {E} "
                         f"and num_bins >= 1, got shape {tuple(hv.shape)}")
    B = int(hv.shape[1])
    if B > MAX_QB_BINS:
        raise ValueError(f"qb_histogram: at most {MAX_QB_BINS} bins are supported, got {B}")
    return B


def _check_qb_bounds(dv):
    _arrays.check_dtype(dv, "qb_bin_bounds", (_F32,))
    _arrays.check_shape(dv, "qb_bin_bounds", (2,))


def check_qb_bounds_values(lower, upper):
    """ValueError unless the bin bounds are finite with lower < upper (TE's check of ``qb_bin_bounds``)."""
    lower, upper = float(lower), float(upper)
    if not (math.isfinite(lower) and math.isfinite(upper) and lower < upper):
        raise ValueError(f"qb_bin_bounds: must be finite with lower < upper, got [{lower}, {upper}]")


def check_qb_args(xv, bv, hv, dv, topk, score_function, num_groups, group_topk, scaling_factor,
                  qb_histogram_mode):
    """Every check of :func:`topk_with_score_qb` that needs only shapes, dtypes and the settings (not the
    bounds' values): ``(E, K, B, scale, fused)``. Arrays: anything with ``shape``, ``ndim`` and ``dtype``
    (JAX tracers too)."""
    E = _check_logits(xv)
    _check_score_function(score_function)
    if score_function != "sigmoid":
        raise ValueError(f"score_function: Quantile Balancing supports 'sigmoid' only, got {score_function!r}")
    if num_groups is not None or group_topk is not None:
        raise ValueError("num_groups/group_topk: Quantile Balancing does not support group-limited top-k; pass "
                         "None for both")
    if bv is None:
        raise TypeError("expert_bias: Quantile Balancing requires an expert bias ([num_experts] float), got None")
    _check_bias(bv, E, score_function)
    K = _check_topk(topk, E)
    if K >= E:
        raise ValueError(f"topk: Quantile Balancing selects topk + 1 experts, so topk must be < num_experts "
                         f"({E}), got {K}")
    scale = _check_scaling(scaling_factor)
    fused = _check_qb_mode(qb_histogram_mode)
    for name, v in (("qb_histogram", hv), ("qb_bin_bounds", dv)):
        if v is None:
            raise TypeError(f"{name}: Quantile Balancing needs qb_histogram and qb_bin_bounds (and "
                            f"qb_histogram_mode), got None")
    B = _check_qb_histogram(hv, E)
    _check_qb_bounds(dv)
    return E, K, B, scale, fused


def _read_only(obj, v, backend) -> bool:
    """Whether the caller's array ``obj`` (its view ``v``) must not be written in place: a JAX array on any
    backend (immutable; the view JAX exports of its buffer is writable, so the flags do not say it), or a
    read-only host array."""
    return _arrays._framework_of(obj) == "jax" or (backend == "cpu" and not v.flags.writeable)


def _writable_histogram(obj, hv, backend):
    """The histogram is accumulated in place: it must be C-contiguous, and writable (no JAX array)."""
    if not hv.flags.c_contiguous:
        raise ValueError("qb_histogram: must be C-contiguous (it is accumulated in place)")
    if _read_only(obj, hv, backend):
        raise TypeError("qb_histogram: a read-only array (JAX arrays are immutable); it is accumulated in "
                        "place: pass a writable one, or use moe_rt.jax.topk_with_score_qb, which returns the "
                        "new histogram")


def _bounds_checked(call, dv, validated):
    """The bounds for the kernels (fp32 [2], contiguous), their values checked unless ``validated``: on CUDA
    that is a read on the host (a sync)."""
    d = _arrays.contiguous(call.xp, dv)
    if call.backend == "cpu":
        check_qb_bounds_values(d[0], d[1])
    elif not validated:
        lo, hi = _arrays.cupy_of(d).get()
        check_qb_bounds_values(lo, hi)
    return d


def _qb_hist_vpl(E, B, vec, device_id):
    """Experts a lane of qb_histogram_accumulate<VPL> counts: 4 (16-byte loads of raw) where ``vec`` (raw
    16-byte aligned), E % 4 == 0 and the strip's 128 B int32 counters fit a block; else 1."""
    optin = _jit.device_properties(device_id)["smem_per_block_optin"]
    return 4 if vec and E % 4 == 0 and 4 * 128 * B <= optin else 1


def _qb_hist_shape(T, E, B, vpl, device_id, regs=0):
    """(grid, threads, shared memory bytes, use_smem) of qb_histogram_accumulate<vpl>: strips of 32 vpl experts
    (1024 threads at vpl = 4, else 256) x shares of the tokens, as many shares as fill one resident wave with
    the strips, each of at least max(256, 4 B) tokens (a block's flush, up to 32 vpl B atomics, stays under a
    quarter of its samples); the strip's bins in shared memory when they fit a block, else global atomics."""
    threads = 1024 if vpl == 4 else 256
    smem = 4 * 32 * vpl * B
    use = smem <= _jit.device_properties(device_id)["smem_per_block_optin"]
    smem = smem if use else 0
    gx = -(-E // (32 * vpl))
    resident = _grid(1 << 30, threads, smem, device_id, regs)
    gy = max(1, min(resident // gx, T // max(256, 4 * B)))
    return (gx, gy), threads, smem, use


def _qb_hist_cfg(T, E, B, vec, device_id, regs=0):
    """(kernel name, grid, threads, shared memory bytes, use_smem) of the histogram pass (_qb_hist_vpl,
    _qb_hist_shape; csrc/router.c qb_hist_plan states the same)."""
    vpl = _qb_hist_vpl(E, B, vec, device_id)
    return (f"qb_histogram_accumulate<{vpl}>",) + _qb_hist_shape(T, E, B, vpl, device_id, regs)


def _launch_qb_hist(call, raw, cut, T, E, bounds, hist, B):
    vpl = _qb_hist_vpl(E, B, raw.data.ptr % 16 == 0, call.device_id)
    fn = _jit.function(_FILE, f"qb_histogram_accumulate<{vpl}>")
    grid, threads, smem, use = _qb_hist_shape(T, E, B, vpl, call.device_id, getattr(fn, "num_regs", 0))
    _jit.set_max_dynamic_shared(fn, smem)
    _jit.launch(fn, grid, threads, (raw, cut, np.int64(T), np.int32(E), bounds, hist, np.int32(B), np.int32(use)),
                shared_mem=smem, stream=call.stream)


# The "fused_atomic" histogram: in the forward kernel, a per-block histogram of 16-bit counters in shared
# memory (flushed by global atomics at the block's end) where its E ceil(B / 2) words take at most this many
# bytes; else, up to _QB_ATOMIC_SAMPLES samples (T E), one global atomic a sample in the forward kernel; else
# the forward kernel counts nothing and qb_histogram_accumulate runs after it, as in the two-kernel mode (on
# H100, E = 2304, T = 65536: 151M global atomics from the forward took 2.42 ms, the two kernels 1.27 ms; the
# atomics' rate there, about 1e11 a second, puts 2^18 of them near 3 us, a second launch's cost). All add the
# same integers. MOE_RT_QB_SMEM_HIST_BYTES at import sets the first (0: never the shared histogram; a benchmark
# and test variant); tests patch the attributes.
_QB_SMEM_HIST_BYTES = _jit.env_ints("MOE_RT_QB_SMEM_HIST_BYTES", 48 * 1024, one=True)
_QB_ATOMIC_SAMPLES = 1 << 18
_QB_BLOCK_TOKENS = 65535  # hmode 2: tokens a block at most (below 2^16: no counter wraps)
# router_fwd_qb_reg with the shared histogram: warps a block at most (0: every warp the kernel takes on a
# multiprocessor; 4: the plain forward's blocks, 5-6 histograms and flushes a multiprocessor). A benchmark
# variant, MOE_RT_QB_REG_WARPS at import; tests patch the attribute.
_QB_REG_WARPS = _jit.env_ints("MOE_RT_QB_REG_WARPS", 0, one=True)


def _qb_hmode(T, E, B, fused):
    """hmode of the QB forward kernels: 0 none (the histogram by qb_histogram_accumulate after the kernel:
    the two-kernel mode, and "fused_atomic" for large T E whose histogram does not fit shared memory), 1 global
    atomics, 2 the block's shared histogram (kernels/router.cu, "Quantile Balancing")."""
    if not fused:
        return 0
    if 4 * E * ((B + 1) // 2) <= _QB_SMEM_HIST_BYTES:
        return 2
    return 1 if T * E <= _QB_ATOMIC_SAMPLES else 0


def _qb_fwd_cfg(dtype, T, E, K, B, vec, fused):
    """(kernel name, threads, slots a block, shared memory bytes, tokens a warp, hmode) of the QB forward:
    router_fwd_qb_reg (the row in registers, as router_fwd_reg) where the plain forward takes
    router_fwd_reg (16-byte rows, float32/bfloat16, E / 8 chunks within 32 lanes of 32 keys), else
    router_fwd_qb (the team of _team(E, fwd=True), 16-byte chunks where vec; compiled without the histogram
    where hmode is 0). threads = slots = None:
    router_fwd_qb_reg with the shared histogram, one block a multiprocessor of as many warps as the kernel
    takes (resolved at launch; shared memory: the histogram's bytes here, plus a slot a warp then)."""
    ct = _jit.ctype(dtype)
    hmode = _qb_hmode(T, E, B, fused)
    hbytes = 4 * E * ((B + 1) // 2) if hmode == 2 else 0
    v = _reg_v(E, 16 // dtype.itemsize, vec, dtype)
    if v:
        name = f"router_fwd_qb_reg<{ct}, {v}>"
        if hmode == 2:  # one resident wave, one histogram (and one flush) a multiprocessor
            return name, None, None, hbytes, 0, hmode
        # tokens a warp as the plain forward's register kernel (no lane groups)
        return name, 128, 4, 4 * 4 * _qb_reg_slot_words(K), _fwd_tpw(dtype, v, False), hmode
    team = _team(E, fwd=True)
    spb = 4 if team == 32 else 1
    name = f"router_fwd_qb<{ct}, {team}>" if hmode else f"router_fwd_qb<{ct}, {team}, false>"  # no histogram
    return (name, team * spb, spb, 4 * spb * _slot_words(E, 0, K + 1, team) + hbytes,
            0, hmode)


def _launch_qb_fwd(call, x, T, E, K, scale, b32, probs, rmap, inter, cut, bounds, hist, B, fused):
    ch = 16 // x.dtype.itemsize
    vec = _vec_ok([x, probs, rmap, inter, b32], E, ch)
    name, threads, spb, smem, tpw, hmode = _qb_fwd_cfg(x.dtype, T, E, K, B, vec, fused)
    fn = _jit.function(_FILE, name)
    if threads is None:
        spb = fn.max_threads_per_block // 32
        spb = min(spb, _QB_REG_WARPS) if _QB_REG_WARPS > 0 else spb
        threads = 32 * spb
        smem += 4 * spb * _qb_reg_slot_words(K)
    _jit.set_max_dynamic_shared(fn, smem)
    resident = _grid(1 << 30, threads, smem, call.device_id, getattr(fn, "num_regs", 0))
    grid = _tpw_grid(T, spb, tpw, resident)
    if hmode == 2:
        # every block under 2^16 tokens (its 16-bit counters do not wrap): a block takes at most spb tokens
        # for every spb * grid, so at most spb * ceil(T / (spb * grid)) <= spb * max(1, limit // spb)
        grid = max(grid, -(-T // (spb * max(1, _QB_BLOCK_TOKENS // spb))))
    args = (x, np.int64(T), np.int32(E), np.int32(K), np.float32(scale), b32, probs, rmap, inter, cut, bounds,
            hist if hmode else 0, np.int32(B), np.int32(hmode))
    if name.startswith("router_fwd_qb<"):
        args += (np.int32(vec),)
    _jit.launch(fn, grid, threads, args, shared_mem=smem, stream=call.stream)
    return hmode


def topk_with_score_qb(logits, topk, *, expert_bias, qb_histogram, qb_bin_bounds, qb_histogram_mode="fused_atomic",
                       score_function="sigmoid", num_groups=None, group_topk=None, scaling_factor=None,
                       bounds_validated=False, stream=None):
    """Top-k routing with Quantile-Balancing histogram accumulation (TE ``fused_topk_with_score_function``
    with ``qb_histogram``/``qb_bin_bounds``/``qb_histogram_mode``; docs/router.md "Quantile Balancing").

    Per token t: raw = sigmoid(logits) (fp32), biased = raw + expert_bias; the top ``topk + 1`` by biased
    score in the order (value desc, index asc); the last of them (the least biased score, the larger expert
    id on ties) is the **cutoff** and is dropped; the other ``topk`` are the routes, with exactly the probs,
    map and intermediate of :func:`topk_with_score` with ``score_function="sigmoid"`` and the same bias
    (the same experts, as the dropped one is the (k+1)-th in that order). Then for **every** expert e:
    ``r = cutoff_t - raw_te``, ``bin = clamp(floor((r - lower) * (B / (upper - lower))), 0, B - 1)`` in
    fp32 (a NaN r counts in bin 0), ``qb_histogram[e, bin] += 1``: each call adds T to every expert's row.
    The histogram is never zeroed here (:func:`update_expert_bias_with_quantile` consumes and zeroes it).

    Records no autograd: use the op of the same name in ``moe_rt.torch`` / ``moe_rt.jax`` (backward: the
    sigmoid backward of :func:`topk_with_score_backward` over the ``topk`` routes; no gradient for the bias,
    histogram or bounds).

    Args:
        logits: ``[..., E]`` fp32/bf16/fp16.
        topk: int K, 1 <= K < E, K <= 64.
        expert_bias: ``[E]`` fp32/bf16/fp16 (required; used as fp32).
        qb_histogram: ``[E, B]`` int32, C-contiguous, on the logits' device: **accumulated in place**.
        qb_bin_bounds: ``[2]`` fp32 ``[lower, upper]`` on the logits' device, finite with lower < upper.
            The kernels read it on the device at launch, so a CUDA graph replays with the values then in
            memory.
        qb_histogram_mode: ``"fused_atomic"`` (the router kernel adds the counts with integer atomics where
            its block's histogram fits shared memory or T E is small; otherwise the two-kernel mode's second
            kernel counts them, which is faster there) or ``"two_kernel"`` (the router writes the cutoff, then
            a second kernel bins (raw, cutoff) through shared-memory histograms). Both give the same bits in
            every output and the same counts.
        score_function, num_groups, group_topk: accepted for the signature of :func:`topk_with_score`;
            only ``"sigmoid"`` and no groups are allowed (ValueError).
        scaling_factor: as in :func:`topk_with_score`.
        bounds_validated: False (default) checks the bounds' values first: on CUDA a host read of two
            floats (a sync; not allowed while a stream is captured). True skips it (values then unchecked:
            for CUDA graph capture after a checked call). On the CPU backend they are always checked.
        stream: CUDA stream (None = the caller's current stream).

    Returns:
        ``(probs, routing_map, intermediate, cutoff)``: as :func:`topk_with_score` (intermediate = raw
        sigmoid values), cutoff ``[...]`` fp32 (the leading dims: each token's cutoff biased score).
    """
    arrays = {"logits": logits, "expert_bias": expert_bias, "qb_histogram": qb_histogram,
              "qb_bin_bounds": qb_bin_bounds}
    with _arrays.Call(arrays, stream=stream, lean=True) as call:
        xv, bv, hv, dv = (call[n] for n in arrays)
        E, K, B, scale, fused = check_qb_args(xv, bv, hv, dv, topk, score_function, num_groups, group_topk,
                                              scaling_factor, qb_histogram_mode)
        _check_bool(bounds_validated, "bounds_validated")
        _writable_histogram(qb_histogram, hv, call.backend)
        lead = tuple(xv.shape[:-1])
        x = _flat(call.xp, xv, E)
        T = x.shape[0]
        d = _bounds_checked(call, dv, bounds_validated)
        if call.backend == "cpu":
            probs, rmap, inter, cut = ref.topk_with_score_qb_fwd(x, K, np.asarray(bv), scale)
            ref.qb_histogram_accumulate(inter, cut, d, hv)
        else:
            xp = call.xp
            probs = call.empty((T, E), dtype=x.dtype)
            rmap = call.empty((T, E), dtype=np.bool_)
            inter = call.empty((T, E), dtype=np.float32)
            cut = call.empty((T,), dtype=np.float32)
            if T > 0:
                b32 = _arrays.as_f32(xp, bv)
                if _launch_qb_fwd(call, x, T, E, K, scale, b32, probs, rmap, inter, cut, d, hv, B, fused) == 0:
                    _launch_qb_hist(call, inter, cut, T, E, d, hv, B)
        shape = lead + (E,)
        return (call.out(probs.reshape(shape)), call.out(rmap.reshape(shape)), call.out(inter.reshape(shape)),
                call.out(cut.reshape(lead)))


def qb_histogram_accumulate(raw, cutoff, qb_bin_bounds, qb_histogram, *, bounds_validated=False, stream=None):
    """The two-kernel mode's second step alone (TE ``nvte_qb_histogram_accumulate``): for every token t and
    expert e, ``qb_histogram[e, bin(cutoff[t] - raw[t, e])] += 1`` with the binning of
    :func:`topk_with_score_qb`, in place.

    Args:
        raw: ``[..., E]`` fp32 (the sigmoid values before the bias: the QB forward's intermediate).
        cutoff: ``[...]`` fp32 (the leading dims of ``raw``).
        qb_bin_bounds: ``[2]`` fp32, finite with lower < upper (checked as in :func:`topk_with_score_qb`,
            per ``bounds_validated``).
        qb_histogram: ``[E, B]`` int32, C-contiguous: accumulated in place.

    Returns:
        None.
    """
    arrays = {"raw": raw, "cutoff": cutoff, "qb_bin_bounds": qb_bin_bounds, "qb_histogram": qb_histogram}
    with _arrays.Call(arrays, stream=stream, lean=True) as call:
        rv, cv, dv, hv = (call[n] for n in arrays)
        _arrays.check_dtype(rv, "raw", (_F32,))
        if rv.ndim < 1:
            raise ValueError(f"raw: expected a [..., num_experts] array, got shape {tuple(rv.shape)}")
        E = int(rv.shape[-1])
        if E < 1:
            raise ValueError("raw: num_experts (last dim) must be >= 1, got 0")
        _arrays.check_dtype(cv, "cutoff", (_F32,))
        _arrays.check_shape(cv, "cutoff", tuple(rv.shape[:-1]))
        B = _check_qb_histogram(hv, E)
        _check_qb_bounds(dv)
        _check_bool(bounds_validated, "bounds_validated")
        _writable_histogram(qb_histogram, hv, call.backend)
        d = _bounds_checked(call, dv, bounds_validated)
        xp = call.xp
        r = _flat(xp, rv, E)
        c = _arrays.contiguous(xp, cv).reshape(-1)
        T = r.shape[0]
        if call.backend == "cpu":
            ref.qb_histogram_accumulate(r, c, d, hv)
        elif T > 0:
            _launch_qb_hist(call, r, c, T, E, d, hv, B)
        return None


def update_expert_bias_with_quantile(qb_histogram, qb_bin_bounds, expert_bias, topk, *, stream=None):
    """The bias update that consumes QB histograms (Megatron's ``get_updated_expert_bias_with_quantile``),
    **in place** on all three arrays (pointers stay put, so CUDA graphs that read them stay valid); no sync.

    For each expert (leading dims ``...`` are independent problems, e.g. one per layer): C = cumsum of its
    histogram row, N = C[-1] of expert 0 (the tokens counted), target = N * topk / E, rank = max(1,
    ceil(target)), j = the first bin with C >= rank, before = C[j-1] (0 for j = 0),
    frac = clamp((target - before) / max(hist[j], 1), 0, 1), b = lower + (j + frac) * (upper - lower) / B;
    then b is centred (its mean over the experts subtracted) and written into ``expert_bias``, the bounds
    become ``[min b - 1, max b + 1]``, and the histogram is zeroed. Where N = 0 the bias and bounds are kept
    (the histogram is zero already). The arithmetic is float64, rounded once into fp32.

    Args:
        qb_histogram: ``[..., E, B]`` int32 (all-reduced over the data-parallel ranks by the caller).
        qb_bin_bounds: ``[..., 2]`` fp32.
        expert_bias: ``[..., E]`` fp32.
        topk: int K, 1 <= K < E.

    Returns:
        None.
    """
    arrays = {"qb_histogram": qb_histogram, "qb_bin_bounds": qb_bin_bounds, "expert_bias": expert_bias}
    with _arrays.Call(arrays, stream=stream) as call:
        hv, dv, bv = (call[n] for n in arrays)
        _arrays.check_dtype(hv, "qb_histogram", (_I32,))
        if hv.ndim < 2 or int(hv.shape[-1]) < 1 or int(hv.shape[-2]) < 1:
            raise ValueError(f"qb_histogram: expected an int32 [..., num_experts, num_bins] array, got shape "
                             f"{tuple(hv.shape)}")
        lead, E = tuple(hv.shape[:-2]), int(hv.shape[-2])
        _arrays.check_dtype(dv, "qb_bin_bounds", (_F32,))
        _arrays.check_shape(dv, "qb_bin_bounds", lead + (2,))
        _arrays.check_dtype(bv, "expert_bias", (_F32,))
        _arrays.check_shape(bv, "expert_bias", lead + (E,))
        K = _arrays.check_int(topk, "topk", low=1)
        if K >= E:
            raise ValueError(f"topk: must be < num_experts ({E}), got {K}")
        for name, v in (("qb_histogram", hv), ("qb_bin_bounds", dv), ("expert_bias", bv)):
            if not v.flags.c_contiguous:
                raise ValueError(f"{name}: must be C-contiguous (updated in place)")
            if _read_only(arrays[name], v, call.backend):
                raise TypeError(f"{name}: a read-only array (JAX arrays are immutable); it is updated in place")
        bias, bounds = ref.expert_bias_from_quantile(call.xp, hv, dv, bv, K)
        bv[...] = bias.astype(bv.dtype)
        dv[...] = bounds.astype(dv.dtype)
        hv[...] = 0
        return None


# ---- scores for the aux loss -----------------------------------------------------------------------

def scores_for_aux_loss(logits, topk, score_function, *, routing_map_format="bytemap", stream=None):
    """Dense router scores and a plain top-k map for the aux loss (TE ``fused_score_for_moe_aux_loss``;
    no bias, groups or scaling).

    Records no autograd: use the op of the same name in ``moe_rt.torch`` / ``moe_rt.jax`` to differentiate
    (torch tensors that require grad, and JAX tracers, are refused with a TypeError).

    Args:
        logits: ``[..., E]`` fp32/bf16/fp16.
        topk: int K, 1 <= K <= min(E, 64).
        score_function: ``"softmax"`` (softmax over E) or ``"sigmoid"``/``"sqrtsoftplus"`` (f(x) / (sum f + 1e-20),
            always normalized, also for K = 1).
        routing_map_format: ``"bytemap"`` or ``"bitmap_u8"`` (as for :func:`topk_with_score`).

    Returns:
        ``(scores, routing_map, intermediate)``: scores ``[..., E]`` fp32, routing_map ``[..., E]`` bool
        (top-K of the scores; bitmap_u8: uint8 ``[..., ceil(E/8)]``), intermediate ``[..., E]`` fp32 (softmax values, sigmoid values, or the raw
        logits for sqrtsoftplus).
    """
    with _arrays.Call({"logits": logits}, stream=stream, lean=True) as call:
        xv = call["logits"]
        bitmap = check_map_format(routing_map_format)
        E, K = check_scores_args(xv, topk, score_function)
        x, lead, T = _rows(call, xv, E)
        if call.backend == "cpu":
            scores, rmap, inter = ref.scores_for_aux_loss_fwd(x, K, score_function)
            if bitmap:
                rmap = ref.pack_bitmap(rmap)
        else:
            scores = call.empty((T, E), dtype=np.float32)
            rmap = call.empty((T, bitmap_bytes(E)) if bitmap else (T, E), dtype=np.uint8 if bitmap else np.bool_)
            inter = call.empty((T, E), dtype=np.float32)
            if T > 0:
                _core.scores_for_aux_loss(_core.device(call.device_id), _ptr(x), _CODES[x.dtype], T, E, K,
                                          SCORE_FUNCTIONS[score_function], _ptr(scores), _ptr(rmap),
                                          _CODES[rmap.dtype], _ptr(inter), call.stream_ptr)
        return _out_rows(call, scores, lead), _out_rows(call, rmap, lead), _out_rows(call, inter, lead)


def check_scores_args(xv, topk, score_function):
    """The shape, dtype and settings checks of :func:`scores_for_aux_loss`: ``(E, K)``."""
    key = (_sig(xv), type(topk), topk, type(score_function), score_function)
    hit = _validated(_SCORES_ARGS, key)
    if hit is not None:
        return hit
    E = _check_logits(xv)
    _check_score_function(score_function)
    return _remember(_SCORES_ARGS, key, (E, _check_topk(topk, E)))


_SCORES_ARGS: dict = {}


def _parse_dtype(dtype):
    if dtype is None:
        return np.dtype(np.float32)
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    try:
        dt = _arrays.BFLOAT16 if name == "bfloat16" else np.dtype(dtype if not isinstance(dtype, str) else name)
    except TypeError:
        dt = np.dtype(name)
    if dt not in _arrays.FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    return dt


_SCORES_BWD_ARGS: dict = {}


def _check_scores_bwd_args(gv, yv, topk, score_function, dtype):
    """The shape, dtype and settings checks of :func:`scores_for_aux_loss_backward`: ``(E, K, grad dtype)``."""
    key = (_sig(gv), _sig(yv), type(topk), topk, type(score_function), score_function,
           type(dtype), dtype)
    hit = _validated(_SCORES_BWD_ARGS, key)
    if hit is not None:
        return hit
    E = _check_logits(gv, "grad_scores")
    _arrays.check_dtype(gv, "grad_scores", (np.dtype(np.float32),))
    _arrays.check_dtype(yv, "intermediate", (np.dtype(np.float32),))
    _arrays.check_shape(yv, "intermediate", gv.shape)
    _check_score_function(score_function)
    K = _check_topk(topk, E)
    return _remember(_SCORES_BWD_ARGS, key, (E, K, _parse_dtype(dtype)))


def scores_for_aux_loss_backward(grad_scores, intermediate, topk, score_function, *, dtype=None, stream=None):
    """Backward of :func:`scores_for_aux_loss`.

    Args:
        grad_scores: ``[..., E]`` fp32.
        intermediate: ``[..., E]`` fp32, from the forward.
        topk: as given to the forward (unused by the math; validated as the forward does, but it cannot be
            checked against the forward's: the intermediate does not record it).
        score_function: as given to the forward. On the CPU backend an intermediate outside [0, 1] is
            refused for softmax and sigmoid (sqrtsoftplus keeps raw logits); on CUDA that check would read
            the array on the host and is not made.
        dtype: dtype of grad_logits, normally the logits dtype (float32, float16, bfloat16, as a NumPy,
            torch or string dtype); None = float32.

    Returns:
        grad_logits ``[..., E]`` in ``dtype`` (dense).
    """
    with _arrays.Call({"grad_scores": grad_scores, "intermediate": intermediate}, stream=stream,
                      lean=True) as call:
        gv, yv = call["grad_scores"], call["intermediate"]
        E, K, odt = _check_scores_bwd_args(gv, yv, topk, score_function, dtype)
        shape = tuple(gv.shape)
        g, _, T = _rows(call, gv, E, shape)
        y = _rows(call, yv, E, shape)[0]  # the intermediate has the grad's shape (checked)
        if call.backend == "cpu":
            if score_function != "sqrtsoftplus" and ((y < 0) | (y > 1)).any():
                raise ValueError(f"score_function: the intermediate has values outside [0, 1], which a "
                                 f"{score_function} forward does not make; pass the score_function given to "
                                 "the forward")
            out = ref.scores_for_aux_loss_bwd(g, y, K, score_function).astype(odt)
        else:
            out = call.empty((T, E), dtype=odt)
            if T > 0:
                _core.scores_for_aux_loss_backward(_core.device(call.device_id), _ptr(g), _ptr(y), T, E, K,
                                                   SCORE_FUNCTIONS[score_function], _ptr(out), _CODES[odt],
                                                   call.stream_ptr)
        return call.out(_shaped(out, shape, (T, E)))


# ---- aux loss ---------------------------------------------------------------------------------------

_TPE_DTYPES = (np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.float16),
               _arrays.BFLOAT16)


def _check_aux_args(tv, C, total_num_tokens, num_experts, topk, coeff):
    _arrays.check_dtype(tv, "tokens_per_expert", _TPE_DTYPES)
    _arrays.check_shape(tv, "tokens_per_expert", (C,))
    check_total_num_tokens(total_num_tokens)
    E = _arrays.check_int(num_experts, "num_experts", low=1)
    if C % E != 0:
        raise ValueError(f"num_experts: must divide the number of columns ({C}), got {E}")
    _arrays.check_int(topk, "topk", low=1)
    return _check_float(coeff, "coeff")


def check_aux_loss_args(pv, tv, total_num_tokens, num_experts, topk, coeff):
    """The shape, dtype and settings checks of :func:`aux_loss`: ``(R, C, coeff)``."""
    key = (_sig(pv), _sig(tv), _total_key(total_num_tokens), type(num_experts), num_experts,
           type(topk), topk, _fkey(coeff))
    hit = _validated(_AUX_ARGS, key)
    if hit is not None:
        return hit
    _arrays.check_dtype(pv, "probs", _arrays.FLOAT_DTYPES)
    _arrays.check_ndim(pv, "probs", 2)
    R, C = (int(s) for s in pv.shape)
    return _remember(_AUX_ARGS, key, (R, C, _check_aux_args(tv, C, total_num_tokens, num_experts, topk, coeff)))


_AUX_ARGS: dict = {}


def _total_key(total_num_tokens):
    """``total_num_tokens``' part of a validation key: an array's (shape, dtype), else its type and value."""
    if not isinstance(total_num_tokens, (bool, np.bool_, int, np.integer)) and hasattr(total_num_tokens, "shape"):
        return "array", total_num_tokens.shape, total_num_tokens.dtype
    return type(total_num_tokens), total_num_tokens


_TPE_CORE = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64))


def _tpe_arg(call, tv):
    """tokens_per_expert for the core's aux loss, which reads float32, int32 and int64 as they are (other
    dtypes are converted to float32 first)."""
    if tv.dtype in _TPE_CORE and tv.flags.c_contiguous:
        return tv
    return _arrays.as_f32(call.xp, tv)


def _total_core(total, total_num_tokens, kind):
    """The core's (host total, device total pointer, its dtype code) for ``_total_arg``'s result."""
    if total is None:
        return int(total_num_tokens), 0, 0
    return 0, _ptr(total), _CODES[np.dtype(np.int32) if kind == 1 else np.dtype(np.int64)]


_TOTAL_KINDS = {np.dtype(np.int32): 1, np.dtype(np.int64): 2}


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_total_num_tokens(total_num_tokens):
    """``total_num_tokens`` of the aux loss: an int >= 1, or a 0-d (or shape ``(1,)``) int32/int64 array
    (anything with ``shape``, ``ndim``, ``dtype``: arrays, or JAX tracers when ``moe_rt.jax`` traces); its
    value is not checked (that would need a device sync)."""
    if _is_int(total_num_tokens):
        _arrays.check_int(total_num_tokens, "total_num_tokens", low=1)
        return
    if not hasattr(total_num_tokens, "shape") or isinstance(total_num_tokens, (bool, np.bool_)):
        raise TypeError(f"total_num_tokens: expected an int or a 0-d int32/int64 array on the probs' device, "
                        f"got {type(total_num_tokens).__name__}")
    _arrays.check_dtype(total_num_tokens, "total_num_tokens", tuple(_TOTAL_KINDS))
    shape = tuple(total_num_tokens.shape)
    if shape not in ((), (1,)):
        raise ValueError(f"total_num_tokens: expected an int or a 0-d (or shape (1,)) int32/int64 array, "
                         f"got shape {shape}")


def _total_arg(call, total_num_tokens):
    """A device ``total_num_tokens`` (the call's ``"total_num_tokens"`` array, checked by
    :func:`check_total_num_tokens`): ``(array, kind)`` for the kernels (kind 1 int32, 2 int64), or on the
    CPU backend its value. An int gives ``(None, 0)``."""
    if _is_int(total_num_tokens):
        return None, 0
    tt = call["total_num_tokens"]
    if call.backend == "cpu":
        return np.asarray(tt).reshape(()), 0
    return call.contiguous(tt), _TOTAL_KINDS[tt.dtype]


def _aux_arrays(tensors: dict, total_num_tokens) -> dict:
    """The call's arrays, with a device ``total_num_tokens`` among them (anything else is left to
    :func:`check_total_num_tokens`)."""
    if not _is_int(total_num_tokens) and hasattr(total_num_tokens, "shape"):
        tensors["total_num_tokens"] = total_num_tokens
    return tensors


def aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff, *, stream=None):
    """Switch load-balancing loss (TE ``fused_moe_aux_loss``), deterministic.

    Records no autograd: use the op of the same name in ``moe_rt.torch`` / ``moe_rt.jax`` to differentiate
    (torch tensors that require grad, and JAX tracers, are refused with a TypeError).

    ``loss = C_coeff * sum_c tokens_per_expert[c] * sum_r probs[r, c]`` with
    ``C_coeff = (num_experts * coeff) / topk / total_num_tokens / total_num_tokens`` (fp32, host; the two
    divisions by T on the device when T is a device array).

    Args:
        probs: ``[R, C]`` fp32/bf16/fp16; C a multiple of ``num_experts`` (C = B * E for the seq aux loss).
        tokens_per_expert: ``[C]`` int32, int64, fp32 (or fp16/bf16), one count per column.
        total_num_tokens: an int >= 1, or a 0-d (or shape ``(1,)``) int32/int64 array on the probs'
            device, read by the kernel at launch (no host sync: a CUDA graph replays with the value in
            memory then). A device value is not checked: T <= 0 gives inf/NaN, on every backend.
        num_experts, topk: ints >= 1.  coeff: finite float.

    Returns:
        The loss as a 0-d array in the probs dtype. Bitwise reproducible (no atomics).
    """
    arrays = _aux_arrays({"probs": probs, "tokens_per_expert": tokens_per_expert}, total_num_tokens)
    with _arrays.Call(arrays, stream=stream, lean=True) as call:
        pv, tv = call["probs"], call["tokens_per_expert"]
        tt = call["total_num_tokens"] if "total_num_tokens" in arrays else total_num_tokens
        R, C, coeff = check_aux_loss_args(pv, tv, tt, num_experts, topk, coeff)
        total, tot_kind = _total_arg(call, total_num_tokens)
        if call.backend == "cpu":
            t = total_num_tokens if total is None else total
            out = ref.aux_loss_fwd(pv, tv, t, num_experts, topk, coeff)
            return call.out(np.array(out, copy=True))
        p = call.contiguous(pv)
        tpe = _tpe_arg(call, tv)
        nws = _core.aux_loss_workspace_bytes(R)
        ws = call.scratch((max(nws, 1),), dtype=np.uint8)
        dt = p.dtype
        out = call.empty((), dtype=dt)
        _core.aux_loss(_core.device(call.device_id), _ptr(p), _CODES[dt], R, C, _ptr(tpe), _CODES[tpe.dtype],
                       *_total_core(total, total_num_tokens, tot_kind), num_experts, topk, coeff, _ptr(ws), nws,
                       _ptr(out), call.stream_ptr)
        return call.out(out)


_AUX_BWD_ARGS: dict = {}


def _check_aux_bwd_args(gv, tv, num_rows, total_num_tokens, num_experts, topk, coeff):
    """The shape, dtype and settings checks of :func:`aux_loss_backward`: ``(R, C, coeff)``."""
    key = (_sig(gv), _sig(tv), type(num_rows), num_rows, _total_key(total_num_tokens),
           type(num_experts), num_experts, type(topk), topk, _fkey(coeff))
    hit = _validated(_AUX_BWD_ARGS, key)
    if hit is not None:
        return hit
    _arrays.check_dtype(gv, "grad_aux_loss", _arrays.FLOAT_DTYPES)
    if gv.size != 1 or gv.ndim > 1:
        raise ValueError(f"grad_aux_loss: expected a 0-d (or shape (1,)) array, got shape {tuple(gv.shape)}")
    R = _arrays.check_int(num_rows, "num_rows", low=0)
    _arrays.check_ndim(tv, "tokens_per_expert", 1)
    C = int(tv.shape[0])
    return _remember(_AUX_BWD_ARGS, key, (R, C, _check_aux_args(tv, C, total_num_tokens, num_experts, topk, coeff)))


def aux_loss_backward(grad_aux_loss, num_rows, tokens_per_expert, total_num_tokens, num_experts, topk, coeff,
                      *, stream=None):
    """Backward of :func:`aux_loss`: ``grad_probs[r, c] = (C_coeff * tokens_per_expert[c]) * grad``.

    Args:
        grad_aux_loss: 0-d (or shape ``(1,)``) fp32/bf16/fp16, read on the device (no host sync).
        num_rows: int R, rows of ``probs``.
        tokens_per_expert, total_num_tokens, num_experts, topk, coeff: as given to the forward (a device
            ``total_num_tokens`` is read at this launch).

    Returns:
        grad_probs ``[R, C]`` in the grad_aux_loss dtype.
    """
    arrays = _aux_arrays({"grad_aux_loss": grad_aux_loss, "tokens_per_expert": tokens_per_expert},
                         total_num_tokens)
    with _arrays.Call(arrays, stream=stream, lean=True) as call:
        gv, tv = call["grad_aux_loss"], call["tokens_per_expert"]
        tt = call["total_num_tokens"] if "total_num_tokens" in arrays else total_num_tokens
        R, C, coeff = _check_aux_bwd_args(gv, tv, num_rows, tt, num_experts, topk, coeff)
        total, tot_kind = _total_arg(call, total_num_tokens)
        if call.backend == "cpu":
            t = total_num_tokens if total is None else total
            out = ref.aux_loss_bwd(gv, R, tv, t, num_experts, topk, coeff)
            return call.out(np.array(out, copy=True))
        tpe = _tpe_arg(call, tv)
        g = call.contiguous(gv)
        dt = g.dtype
        out = call.empty((R, C), dtype=dt)
        _core.aux_loss_backward(_core.device(call.device_id), _ptr(g), _CODES[dt], R, C, _ptr(tpe),
                                _CODES[tpe.dtype], *_total_core(total, total_num_tokens, tot_kind), num_experts,
                                topk, coeff, _ptr(out), call.stream_ptr)
        return call.out(out)
