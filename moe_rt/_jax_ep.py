"""JAX adapters for expert parallelism (re-exported by :mod:`moe_rt.jax`).

JAX needs static shapes, so the group must be in capacity mode (``EpGroup(..., mode="capacity")``): no
host sync, fixed buffer sizes, overflow flagged in the handle. The handle travels as a :class:`JaxEpHandle`
pytree (the uint8 handle buffer and ``tokens_per_expert``; the group id, T, K and N as static data), so it
passes through ``jit``, ``grad``, ``checkpoint`` and ``custom_vjp`` residuals. ``ep_dispatch`` and
``ep_combine`` are ``custom_vjp`` functions over ``buffer_callback`` whose backward passes call
:meth:`EpGroup.dispatch_bwd` / :meth:`EpGroup.combine_bwd`.

Every op is a collective: each process (one GPU each, e.g. under ``jax.distributed``) must run the same
program, so the EP calls happen in the same order on every rank.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from moe_rt import _arrays
from moe_rt import _ep_adapt as _A
from moe_rt import ep as _ep
from moe_rt.jax import _run, _spec

__all__ = ["JaxEpHandle", "ep_prepare", "ep_dispatch", "ep_combine"]


@jax.tree_util.register_pytree_node_class
class JaxEpHandle:
    """An EP plan as JAX arrays: ``buffer`` (uint8, the :class:`moe_rt.Handle` buffer) and
    ``tokens_per_expert`` (int32 ``[L]``); static ``group_id``, ``num_tokens`` (T), ``topk`` (K),
    ``num_rows`` (N, the rows of ``recv_x``)."""

    def __init__(self, buffer, tokens_per_expert, group_id, num_tokens, topk, num_rows):
        self.buffer, self.tokens_per_expert = buffer, tokens_per_expert
        self.group_id, self.num_tokens, self.topk, self.num_rows = (int(group_id), int(num_tokens), int(topk),
                                                                    int(num_rows))

    @property
    def static(self):
        return (self.group_id, self.num_tokens, self.topk, self.num_rows)

    def tree_flatten(self):
        return (self.buffer, self.tokens_per_expert), self.static

    @classmethod
    def tree_unflatten(cls, static, arrays):
        return cls(*arrays, *static)


def ep_prepare(group, topk_idx) -> JaxEpHandle:
    """:meth:`moe_rt.EpGroup.prepare` for JAX (a collective; jit-compatible; not differentiable).
    ``topk_idx [T,K]`` int32 (-1 = no expert)."""
    gid = _A.register(group)
    if group.mode != "capacity":
        raise ValueError("ep_prepare: JAX needs static shapes; create the EpGroup with mode='capacity'")
    topk_idx = jax.lax.stop_gradient(jnp.asarray(topk_idx))
    T, K = group._check_routing(topk_idx)  # shapes and dtypes are known when traced
    _, N, total = _A.sizes(group, T, K)

    def fn(idx):
        h = group.prepare(idx)
        return [h.buffer, h.view("tokens_per_expert")]

    buf, tpe = _run(fn, [_spec((total,), np.uint8), _spec((group.num_local_experts,), np.int32)], topk_idx)
    return JaxEpHandle(buf, tpe, gid, T, K, N)


def _check(handle):
    if not isinstance(handle, JaxEpHandle):
        raise TypeError(f"handle: expected a JaxEpHandle from moe_rt.jax.ep_prepare, got {type(handle).__name__}")
    return handle


def _handle(static, buf, *, copy=False):
    gid, T, K, _ = static
    group = _A.lookup(gid)
    return group, _A.handle_from(group, buf, T, K, copy=copy)


def _xp(arr):
    if isinstance(arr, np.ndarray):
        return np
    import cupy

    return cupy


def _f32_empty(like):
    return like[:0, 0].astype(np.float32) if like.ndim == 2 else like[:0].astype(np.float32)


# -- dispatch --------------------------------------------------------------------------------------------

def _dispatch_impl(static, fp8, buf, x, w):
    N = static[3]
    specs = [_spec((N, x.shape[1]), x.dtype), _spec((N if w is not None else 0,), np.float32)]

    def fn(bv, xv, wv):
        # dispatch stores the received weights in the handle: run it on a copy (XLA's input stays as is)
        group, h = _handle(static, bv, copy=wv is not None)
        # fp8: FP8 on the wire, rows dequantized on the receiving side (the same VJP: straight-through)
        rx, rw, _ = group.dispatch(h, xv, wv, fp8=fp8, dequantize=fp8)
        return [rx, _f32_empty(xv) if rw is None else rw]

    rx, rw = _run(fn, specs, buf, x, w)
    return rx, (rw if w is not None else None)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch(static, fp8, buf, x, w):
    return _dispatch_impl(static, fp8, buf, x, w)


def _dispatch_fwd(static, fp8, buf, x, w):
    return _dispatch_impl(static, fp8, buf, x, w), (buf, None if w is None else jnp.zeros((0,), w.dtype))


def _dispatch_bwd(static, fp8, res, cts):
    buf, w_tag = res
    g_rx, g_rw = cts
    gx, gw = _dispatch_bwd_run(static, buf, g_rx, g_rw if w_tag is not None else None)
    return None, gx, (gw.astype(w_tag.dtype) if w_tag is not None else None)


def _dispatch_bwd_run(static, buf, g_rx, g_rw):
    """EpGroup.dispatch_bwd of ``g_rx [N,H]`` (and ``g_rw [N]`` or None): ``(grad_x [T,H], grad_w [T,K] fp32 or
    an empty array)``."""
    _, T, K, _ = static
    has_w = g_rw is not None
    specs = [_spec((T, g_rx.shape[1]), g_rx.dtype), _spec((T, K) if has_w else (0,), np.float32)]

    def fn(bv, gv, gwv):
        group, h = _handle(static, bv)
        gx, gw = group.dispatch_bwd(h, gv, gwv)
        return [gx, _f32_empty(gv) if gw is None else gw]

    return _run(fn, specs, buf, g_rx, g_rw)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _grad_dtype(group, x):
    """The float dtype of an FP8 dispatch's gradient path: x's for a float x, else the group's (bfloat16)."""
    dt = np.dtype(x.dtype)
    if dt in _ep._TOKEN_DTYPES:
        return dt
    return group.dtype or _ep._BF16


def _dev(v):
    """A CuPy view inside the callback as a DevArray (so the core may hand FP8 rows back); others as they are."""
    if isinstance(v, np.ndarray) or v is None or type(v) is _arrays.DevArray:
        return v
    return _arrays.DevArray(v.data.ptr, tuple(v.shape), np.dtype(v.dtype), v, v.device.id)


def _dispatch_fp8_impl(static, dequantize, buf, x, scales, w):
    N = static[3]
    group = _A.lookup(static[0])
    H = group.hidden
    if dequantize:
        specs = [_spec((N, H), _grad_dtype(group, x)), _spec((0,), np.float32)]
    else:
        specs = [_spec((N, H), _arrays.FLOAT8_E4M3 if scales is None else x.dtype),
                 _spec((N, -(-H // _ep.FP8_BLOCK)), np.float32)]
    specs.append(_spec((N if w is not None else 0,), np.float32))

    def fn(bv, xv, sv, wv):
        group, h = _handle(static, bv, copy=wv is not None)
        xin = _dev(xv) if sv is None else (xv, sv)
        out = group.dispatch(h, xin, wv, fp8=True, dequantize=dequantize)
        if dequantize:
            (ry, rw, _), rs = out, np.zeros(0, np.float32)
        else:
            ry, rs, rw, _ = out
        return [ry, rs, np.zeros(0, np.float32) if rw is None else rw]

    ry, rs, rw = _run(fn, specs, buf, x, scales, w)
    return ry, rs, (rw if w is not None else None)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch_fp8(static, dequantize, buf, x, scales, w):
    return _dispatch_fp8_impl(static, dequantize, buf, x, scales, w)


def _dispatch_fp8_fwd(static, dequantize, buf, x, scales, w):
    gdt = _grad_dtype(_A.lookup(static[0]), x)
    return (_dispatch_fp8_impl(static, dequantize, buf, x, scales, w),
            (buf, jnp.zeros((0,), gdt), None if w is None else jnp.zeros((0,), w.dtype)))


def _dispatch_fp8_bwd(static, dequantize, res, cts):
    """Only the received weights carry a gradient (to topk_weights): dispatch_bwd of zero rows."""
    buf, g_tag, w_tag = res
    if w_tag is None:
        return None, None, None, None
    N, H = static[3], _A.lookup(static[0]).hidden
    _, gw = _dispatch_bwd_run(static, buf, jnp.zeros((N, H), g_tag.dtype), cts[2])
    return None, None, None, gw.astype(w_tag.dtype)


_dispatch_fp8.defvjp(_dispatch_fp8_fwd, _dispatch_fp8_bwd)


def ep_dispatch(handle: JaxEpHandle, x, topk_weights=None, *, fp8: bool = False, dequantize: bool = False):
    """Differentiable :meth:`moe_rt.EpGroup.dispatch` (a collective): ``x [T,H]`` goes once to each rank
    holding one of its experts, in expert-major order there.

    - ``fp8=False``: returns ``(recv_x [N,H], recv_weights [N] fp32 or None)``; gradients flow to ``x`` and
      ``topk_weights``.
    - ``fp8=True``: FP8 on the wire (``H + 4*ceil(H/128)`` bytes a row; docs/ep.md). ``x`` is a float array
      (quantized on the sending side) or a pre-quantized pair ``(x_fp8 [T,H] jnp.float8_e4m3fn or uint8,
      scales [T, ceil(H/128)] float32)``. Returns ``(recv_x_fp8 [N,H] jnp.float8_e4m3fn (uint8 for a uint8
      pair), recv_scales [N, ceil(H/128)] float32, recv_weights [N] fp32 or None)``. The FP8 rows and
      scales carry **no gradient** (``x`` gets a zero cotangent from this call; for training pass
      ``dequantize=True``); ``recv_weights`` stays differentiable (its VJP runs a dispatch_bwd of zero rows).
    - ``fp8=True, dequantize=True``: returns ``(recv_x [N,H], recv_weights)`` dequantized on the receiving
      side, in x's dtype (a pair: the group's dtype, bfloat16 without one). For a float ``x`` the VJP is
      **straight-through**: the quantization counts as the identity, so ``x`` gets the bf16
      ``dispatch_bwd`` of ``recv_x``'s cotangent (the usual FP8-training convention). A pair gets none.
    """
    _check(handle)
    _A.check_fp8_flags(fp8, dequantize)
    group = _A.lookup(handle.group_id)
    pair = isinstance(x, (tuple, list))
    if pair:
        _A.check_pair_arity(x, fp8)
        x = (jnp.asarray(x[0]), jnp.asarray(x[1]))
        group.check_fp8_pair(x[0], x[1], handle.num_tokens)  # shapes and dtypes are known when traced
    else:
        group._check_rows(x, "x", handle.num_tokens)
    if topk_weights is not None:
        _ep.check_weights(topk_weights, "topk_weights", (handle.num_tokens, handle.topk))
    if not fp8 or (dequantize and not pair):
        return _dispatch(handle.static, fp8, handle.buffer, x, topk_weights)
    x0, sc = x if pair else (x, None)
    ry, rs, rw = _dispatch_fp8(handle.static, dequantize, handle.buffer, x0, sc, topk_weights)
    return (ry, rw) if dequantize else (ry, rs, rw)


# -- combine ---------------------------------------------------------------------------------------------

def _combine_impl(static, buf, y, w):
    T = static[1]

    def fn(bv, yv, wv):
        group, h = _handle(static, bv)
        if wv is not None:
            h = _A.with_weights(h, wv, _xp(wv))
        return [group.combine(h, yv, weighted=wv is not None)]

    return _run(fn, [_spec((T, y.shape[1]), y.dtype)], buf, y, w)[0]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(static, buf, y, w):
    return _combine_impl(static, buf, y, w)


def _combine_fwd(static, buf, y, w):
    return _combine_impl(static, buf, y, w), (buf, y if w is not None else None, w)


def _combine_bwd(static, res, g):
    buf, y, w = res
    N = static[3]
    specs = [_spec((N, g.shape[1]), g.dtype), _spec((N if w is not None else 0,), np.float32)]

    def fn(bv, gv, yv, wv):
        group, h = _handle(static, bv)
        if wv is not None:
            h = _A.with_weights(h, wv, _xp(wv))
        gy, gw = group.combine_bwd(h, gv, yv, weighted=wv is not None)
        return [gy, _f32_empty(gv) if gw is None else gw]

    gy, gw = _run(fn, specs, buf, g, y, w)
    return None, gy, (gw.astype(w.dtype) if w is not None else None)


_combine.defvjp(_combine_fwd, _combine_bwd)


def ep_combine(handle: JaxEpHandle, y, recv_weights=None):
    """Differentiable :meth:`moe_rt.EpGroup.combine` (a collective): ``y [N,H]`` (expert outputs in
    ``recv_x``'s layout) back to each token's rank, ``out[t] = sum over its slots of w * y`` (fp32
    accumulation, fixed order). ``recv_weights [N]`` weights the rows (None: unweighted). Gradients flow to
    ``y`` and ``recv_weights``."""
    _check(handle)
    group = _A.lookup(handle.group_id)
    group._check_rows(y, "y", handle.num_rows)  # shapes and dtypes are known when traced
    if recv_weights is not None:
        _ep.check_weights(recv_weights, "recv_weights", (handle.num_rows,))
    return _combine(handle.static, handle.buffer, y, recv_weights)
