"""JAX adapters for expert parallelism (re-exported by :mod:`moe_rt.jax`).

JAX needs static shapes, so the group must be in capacity mode (``EpGroup(..., mode="capacity")``): no
host sync, fixed buffer sizes, overflow flagged in the handle. The handle travels as a :class:`JaxEpHandle`
pytree (the uint8 handle buffer and ``tokens_per_expert``; the group id, T, K and N as static data), so it
passes through ``jit``, ``grad``, ``checkpoint`` and ``custom_vjp`` residuals. ``ep_dispatch`` and
``ep_combine`` are ``custom_vjp`` functions whose backward passes are :meth:`EpGroup.dispatch_bwd` /
:meth:`EpGroup.combine_bwd`.

Two paths, chosen when an op is traced from the group alone (:func:`ep_path`; never a fallback):

- ``"ffi"``: a group on the direct transport (``transport="direct"``, or ``"auto"`` that chose it) in capacity
  mode, where every launch of prepare, dispatch, combine and their VJPs is a C core call and nothing syncs
  with the host. Lowered for CUDA, ``ep_prepare``, ``ep_dispatch`` (rows of x's float dtype) and
  ``ep_combine`` and their VJPs are XLA FFI custom calls (csrc/xla_ffi.c ``moe_rt_xla_ep_*``) running the
  group's core ops on XLA's stream with no Python at run time. Their attributes name the transport's core group
  (address and serial, checked against the core's registry of live groups: a program run after
  :meth:`EpGroup.close` fails with the core's message) and the handle's sizes; what the handlers need is made
  when the op is lowered (a collective: every rank lowers the same program): the receive stages and prepare's
  box, the kernels loaded. The handle buffer is XLA's array; dispatch, which writes the received weights into
  a handle, writes them into a copy (a result of the call); the weights combine applies are laid out on the
  slots by XLA ops over the handle's ``dst_row``, and combine's weight gradient gathered back from them over
  its ``src_slot``. The handlers are not command-buffer compatible (a replay would skip the registry's check).
  FP8 dispatches (``fp8=True``) of such a group keep the ``buffer_callback`` path.
- ``"buffer_callback"``: every other group (NCCL or mixed transport, a one-rank group) and the CPU (the NumPy
  reference): ``jax.experimental.buffer_callback`` over the group's own Python ops.

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
from moe_rt import _ep_direct
from moe_rt import ep as _ep
from moe_rt import _xla
from moe_rt.jax import _dtype_code, _ffi, _on_platform, _run, _spec


def _collective(args, on_cuda, fn, specs):
    """An EP op (a collective): ``on_cuda(*args)`` (its custom calls, made with :func:`_cffi`) when lowered
    for CUDA; ``fn`` over views of XLA's buffers in a buffer_callback on other platforms, and on CUDA too when
    ``on_cuda`` is None. Kept in program order among the other EP ops and never removed by XLA (see
    moe_rt.jax._COLLECTIVE), so that every rank runs the same collectives in the same order."""
    return _on_platform(args, on_cuda, lambda *a: _run(fn, specs, *a, collective=True), specs, ordered=True)


_cffi = partial(_ffi, collective=True)

__all__ = ["JaxEpHandle", "ep_prepare", "ep_dispatch", "ep_combine", "ep_path"]


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

    specs = [_spec((total,), np.uint8), _spec((group.num_local_experts,), np.int32)]
    if ep_path(group) == "ffi":
        def on_cuda(idx):
            attrs, work = _ffi_ready(group, "prepare", T, K, idx_dtype=idx.dtype)
            return _cffi("ep_prepare", specs + [_spec((work,), np.int32)], idx, **attrs)[:2]
    else:
        on_cuda = None
    buf, tpe = _collective((topk_idx,), on_cuda, fn, specs)
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

def _dispatch_impl(static, fp8, zero, buf, x, w):
    N = static[3]
    specs = [_spec((N, x.shape[1]), x.dtype), _spec((N if w is not None else 0,), np.float32)]

    def fn(bv, xv, wv):
        # dispatch stores the received weights in the handle: run it on a copy (XLA's input stays as is)
        group, h = _handle(static, bv, copy=wv is not None)
        # fp8: FP8 on the wire, rows dequantized on the receiving side (the same VJP: straight-through)
        rx, rw, _ = group.dispatch(h, xv, wv, fp8=fp8, dequantize=fp8, zero_empty_slots=zero)
        return [rx, _f32_empty(xv) if rw is None else rw]

    group = _A.lookup(static[0])
    if not fp8 and ep_path(group) == "ffi":
        def on_cuda(bv, xv, wv):
            H, has_w = int(xv.shape[1]), wv is not None
            attrs, nbytes = _ffi_ready(group, "dispatch", static[1], static[2], row_bytes=H * jnp.dtype(xv.dtype).itemsize,
                                       dtype=xv.dtype, hidden=H, with_w=has_w, zero=zero)
            return _cffi("ep_dispatch", specs + [_spec((nbytes if has_w else 0,), np.uint8)], bv, xv,
                        *([wv.astype(jnp.float32)] if has_w else []), has_weights=np.int32(has_w), zero_empty_slots=np.int32(zero),
                        **attrs)[:2]
    else:
        on_cuda = None
    rx, rw = _collective((buf, x, w), on_cuda, fn, specs)
    return rx, (rw if w is not None else None)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _dispatch(static, fp8, zero, buf, x, w):
    return _dispatch_impl(static, fp8, zero, buf, x, w)


def _dispatch_fwd(static, fp8, zero, buf, x, w):
    return _dispatch_impl(static, fp8, zero, buf, x, w), (buf, None if w is None else jnp.zeros((0,), w.dtype))


def _dispatch_bwd(static, fp8, zero, res, cts):
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

    group = _A.lookup(static[0])
    if ep_path(group) == "ffi":
        def on_cuda(bv, gv, gwv):
            H = int(gv.shape[1])
            attrs, _ = _ffi_ready(group, "dispatch_bwd", T, K, row_bytes=H * jnp.dtype(gv.dtype).itemsize,
                                  dtype=gv.dtype, hidden=H, with_w=has_w)
            rows = _A.rows_of(group, T, K)[0]
            return _cffi("ep_dispatch_bwd", specs + [_spec((rows * K if has_w else 0,), np.float32)], bv, gv,
                        *([gwv.astype(jnp.float32)] if has_w else []), has_weights=np.int32(has_w), **attrs)[:2]
    else:
        on_cuda = None
    return _collective((buf, g_rx, g_rw), on_cuda, fn, specs)


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


def _dispatch_fp8_impl(static, dequantize, zero, buf, x, scales, w):
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
        out = group.dispatch(h, xin, wv, fp8=True, dequantize=dequantize, zero_empty_slots=zero)
        if dequantize:
            (ry, rw, _), rs = out, np.zeros(0, np.float32)
        else:
            ry, rs, rw, _ = out
        return [ry, rs, np.zeros(0, np.float32) if rw is None else rw]

    ry, rs, rw = _collective((buf, x, scales, w), None, fn, specs)
    return ry, rs, (rw if w is not None else None)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _dispatch_fp8(static, dequantize, zero, buf, x, scales, w):
    return _dispatch_fp8_impl(static, dequantize, zero, buf, x, scales, w)


def _dispatch_fp8_fwd(static, dequantize, zero, buf, x, scales, w):
    gdt = _grad_dtype(_A.lookup(static[0]), x)
    return (_dispatch_fp8_impl(static, dequantize, zero, buf, x, scales, w),
            (buf, jnp.zeros((0,), gdt), None if w is None else jnp.zeros((0,), w.dtype)))


def _dispatch_fp8_bwd(static, dequantize, zero, res, cts):
    """Only the received weights carry a gradient (to topk_weights): dispatch_bwd of zero rows."""
    buf, g_tag, w_tag = res
    if w_tag is None:
        return None, None, None, None
    N, H = static[3], _A.lookup(static[0]).hidden
    _, gw = _dispatch_bwd_run(static, buf, jnp.zeros((N, H), g_tag.dtype), cts[2])
    return None, None, None, gw.astype(w_tag.dtype)


_dispatch_fp8.defvjp(_dispatch_fp8_fwd, _dispatch_fp8_bwd)


def ep_dispatch(handle: JaxEpHandle, x, topk_weights=None, *, fp8: bool = False, dequantize: bool = False,
                zero_empty_slots: bool = True):
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
    - ``zero_empty_slots``: as in :meth:`moe_rt.EpGroup.dispatch`. Keep the default (True: zero rows, zero
      codes and scales, past each local expert's filled rows) unless those rows never reach a sum: XLA's
      output buffer may hold non-finite bits, and an expert over all rows times the zero cotangent rows of
      combine's VJP would make NaN (docs/ep.md §4). False leaves them unspecified (not written; a static
      flag of the trace).
    """
    _check(handle)
    _A.check_fp8_flags(fp8, dequantize)
    _A.check_bool(zero_empty_slots, "zero_empty_slots")
    zero = bool(zero_empty_slots)
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
        return _dispatch(handle.static, fp8, zero, handle.buffer, x, topk_weights)
    x0, sc = x if pair else (x, None)
    ry, rs, rw = _dispatch_fp8(handle.static, dequantize, zero, handle.buffer, x0, sc, topk_weights)
    return (ry, rw) if dequantize else (ry, rs, rw)


# -- combine ---------------------------------------------------------------------------------------------

def _combine_impl(static, buf, y, w):
    T = static[1]

    def fn(bv, yv, wv):
        group, h = _handle(static, bv)
        if wv is not None:
            h = _A.with_weights(h, wv, _xp(wv))
        return [group.combine(h, yv, weighted=wv is not None)]

    specs = [_spec((T, y.shape[1]), y.dtype)]
    group = _A.lookup(static[0])
    if ep_path(group) == "ffi":
        def on_cuda(bv, yv, wv):
            H, has_w = int(yv.shape[1]), wv is not None
            attrs, _ = _ffi_ready(group, "combine", T, static[2], row_bytes=H * jnp.dtype(yv.dtype).itemsize,
                                  dtype=yv.dtype, hidden=H, with_w=has_w)
            extra = [_slot_weights(group, static, bv, wv)] if has_w else []
            return _cffi("ep_combine", specs, bv, yv, *extra, has_weights=np.int32(has_w), **attrs)
    else:
        on_cuda = None
    return _collective((buf, y, w), on_cuda, fn, specs)[0]


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

    group = _A.lookup(static[0])
    on_cuda = partial(_combine_bwd_ffi, group, static, specs) if ep_path(group) == "ffi" else None
    gy, gw = _collective((buf, g, y, w), on_cuda, fn, specs)
    return None, gy, (gw.astype(w.dtype) if w is not None else None)


def _combine_bwd_ffi(group, static, specs, bv, gv, yv, wv):
    """combine's VJP as the ep_combine_bwd custom call: unweighted, the dispatch direction into ``grad_y``;
    weighted, also the per-slot dots, gathered to the rows over the handle's ``src_slot`` (as ep_gather_slots)."""
    _, T, K, N = static
    H, has_w = int(gv.shape[1]), wv is not None
    rows = _A.rows_of(group, T, K)[0]
    attrs, _ = _ffi_ready(group, "combine_bwd", T, K, row_bytes=H * jnp.dtype(gv.dtype).itemsize, dtype=gv.dtype,
                          hidden=H, with_w=has_w)
    if not has_w:
        gy = _cffi("ep_combine_bwd", specs[:1], bv, gv, has_weights=np.int32(0), **attrs)[0]
        return [gy, jnp.zeros((0,), np.float32)]
    gy, gp = _cffi("ep_combine_bwd", [specs[0], _spec((rows, K), np.float32)], bv, gv, yv,
                  _slot_weights(group, static, bv, wv), has_weights=np.int32(1), **attrs)
    src = _region(group, static, bv, "src_slot")
    return [gy, jnp.where(src >= 0, gp.reshape(-1)[jnp.maximum(src, 0)], jnp.float32(0))]


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


# -- the FFI path (capacity mode on the direct transport; see the module's docstring) ------------------------

def ep_path(group) -> str:
    """The path moe_rt.jax's EP ops of ``group`` take when lowered for CUDA, fixed when they are traced:
    ``"ffi"`` (XLA FFI custom calls, no Python at run time) for a group in capacity mode on the direct
    transport, ``"buffer_callback"`` for any other group (NCCL or mixed transport, a one-rank group, exact
    mode). Every op of the CPU runs the buffer_callback path (the NumPy reference)."""
    _A.register(group)
    return "ffi" if group.mode == "capacity" and group.transport == "direct" else "buffer_callback"


def _region(group, static, buf, name):
    """Region ``name`` of the handle buffer ``buf`` (a JAX uint8 array) as int32/float32 values (XLA ops)."""
    _, T, K, N = static
    rows = _A.rows_of(group, T, K)[0]
    off, dt, count = _A.group_layout(group, T, K, rows, N)[name]
    b = jax.lax.slice(buf, (off,), (off + 4 * count,)).reshape(count, 4)
    return jax.lax.bitcast_convert_type(b, jnp.dtype(dt))


def _slot_weights(group, static, buf, w):
    """``recv_weights [N]`` laid out on the slots ``[rows, K]`` (float32): slot s gets ``w[dst_row[s]]``, 0
    for a slot with no row (what :func:`moe_rt._ep_adapt.with_weights` writes into a handle's copy)."""
    _, T, K, N = static
    rows = _A.rows_of(group, T, K)[0]
    dst = _region(group, static, buf, "dst_row").reshape(rows, K)
    if N == 0:
        return jnp.zeros((rows, K), jnp.float32)
    w = w.astype(jnp.float32)
    return jnp.where(dst >= 0, w[jnp.maximum(dst, 0)], jnp.float32(0))


def _ffi_grid_sync(group, dev):
    """Two uint32 words of grid_sync (kernels/ep.cu) for the prepares XLA runs of ``group`` on device ``dev``:
    a plain allocation kept by the group (as EpGroup._grid_sync_words, apart from the Python prepares'),
    zeroed when made."""
    import cupy

    key = (dev, "xla")
    m = group._gsync.get(key)
    if m is None:
        with cupy.cuda.Device(dev):
            m = cupy.cuda.Memory(8)
            cupy.cuda.runtime.memset(m.ptr, 0, 8)
        group._gsync[key] = m
    return m.ptr


def _ffi_setup(group, op, T, K, *, row_bytes=0, idx_dtype=None):
    """The transport's part of lowering ``op`` for CUDA (path "ffi"), on the group's device: prepare's box
    (made on the first prepare with this K) and prepare's kernels loaded into the group's device context,
    returning ``(prepare's buffer attributes, its scratch in int32 words, whether one kernel makes it)``; for the
    other ops the receive stage pair for rows of ``row_bytes`` (made on first use), returning None. Both makings
    are collectives with a host sync (every rank lowers the same program)."""
    import cupy

    from moe_rt import _core

    t, dev = group._transport, int(group.device)
    with cupy.cuda.Device(dev):
        s = cupy.cuda.get_current_stream()
        wait = _ep_direct.Wait(group, op)
        if op != "prepare":
            t.stages(int(row_bytes), K, s, wait)
            return None
        c = group._prep_cfg(T, K, dev, np.dtype(idx_dtype))
        if c.box is None:
            c.set_box(t, K, s, wait)
        _core.ep_prepare_kernels(_core.device(dev), c.desc)
        state, box, inbox = c.box
        addrs = dict(grid_sync=np.int64(_ffi_grid_sync(group, dev)), error_word=np.int64(c.err),
                     state=np.int64(state), peer_box=np.int64(box), inbox=np.int64(inbox),
                     timeout_ns=np.int64(c.bar[1]))
        return addrs, c.work_words, c.whole


def _ffi_ready(group, op, T, K, *, idx_dtype=None, row_bytes=0, dtype=None, hidden=0, with_w=False, zero=True):
    """When ``op`` is lowered for CUDA (path "ffi"): the group checked open, the transport's buffers the op
    needs made (:func:`_ffi_setup`), the op's kernels loaded into the group's device context (and, for a
    weighted combine_bwd, combine_backward's into XLA's), the handler library loaded. Returns ``(the attributes naming the group and the
    handle's sizes, n)``: n is prepare's scratch in int32 words, else the handle's bytes."""
    if not _xla.cuda_devices():
        raise RuntimeError(f"moe_rt.jax.ep_{op}: lowered for CUDA but JAX has no local CUDA device")
    group._alive(op)
    _xla.library()  # the handlers registered with XLA
    core = group._transport._core
    sz = group._sizes(T, K)
    rows, N, total = _A.sizes(group, T, K)
    R, L, Tmax, P, A = sz["R"], sz["L"], sz["Tmax"], sz["P"], sz["A"]
    attrs = dict(group=np.int64(core.address), group_serial=np.int64(core.serial), device=np.int32(group.device),
                 num_local_experts=np.int32(L), max_tokens_per_rank=np.int32(Tmax), topk=np.int32(K),
                 pair_capacity=np.int32(P), align_size=np.int32(A), num_tokens=np.int64(T),
                 recv_rows=np.int64(rows), num_rows=np.int64(N))
    handle = (0, R, L, Tmax, K, P, rows, N, T, 0)
    if op == "prepare":
        addrs, work, whole = _ffi_setup(group, op, T, K, idx_dtype=idx_dtype)
        if not whole:  # send side, the barrier, the received side
            core.prepare("barrier", handle, 0, 0, 0, False)
        attrs.update(rank=np.int32(sz["rank"]), num_experts=np.int32(group.num_experts),
                     capacity=np.int64(sz["capacity"]), **addrs)
        return attrs, work
    _ffi_setup(group, op, T, K, row_bytes=row_bytes)
    core.prepare(op, handle, int(row_bytes), _dtype_code(dtype), int(hidden), bool(with_w), bool(zero))
    if op == "combine_bwd" and with_w:
        _xla.prepare("combine_backward", T=rows, K=K, E=L, N=N, align_size=A, H=int(hidden), dtype=_dtype_code(dtype),
                     has_probs=True)
    return attrs, total


# -- the low-latency mode (moe_rt.LowLatencyGroup) ---------------------------------------------------------
#
# ll_dispatch / ll_combine: custom_vjp functions. On CUDA each op and each VJP is an XLA FFI custom call
# (csrc/xla_ffi.c moe_rt_xla_ll_*) that runs the group's core ops (moe_rt_ll_*) on XLA's stream with no
# Python at run time: its attributes name the core group (address and serial, checked against the core's
# registry of live groups) and the device; XLA owns every buffer: the handle's six tables are XLA's arrays
# (dispatch's results), and the rows the group leaves in its receive buffer (recv_x, and combine's VJP's rows)
# are copied into XLA's result (only valid slots read; moe_rt_copy_kept_rows). What the handlers need is made
# when the op is lowered for CUDA: the group's shared buffers (on its first CUDA use: a collective, so every
# rank lowers the same program) and core group, and the kernels loaded. On other platforms (the CPU: the
# NumPy reference behind a one-rank group) they run as buffer_callback over the group's own ops.

from moe_rt import ep_ll as _ep_ll  # noqa: E402

__all__ += ["JaxLLHandle", "ll_dispatch", "ll_combine"]

_LL_ARRAYS = ("topk_idx", "topk_weights", "route", "slot_topk", "slot_weights", "counts")


@jax.tree_util.register_pytree_node_class
class JaxLLHandle:
    """The routing of one :func:`ll_dispatch` as JAX arrays: ``topk_idx`` (int32 ``[T,K]``), ``topk_weights``
    (fp32 ``[T,K]``, the weights :func:`ll_combine` applies; its gradient reaches ``ll_dispatch``'s
    ``topk_weights``), ``route`` (int32 ``[R,Tmax,K]``), ``slot_topk`` (int32 ``[L,R*Tmax]``, -1 = empty
    slot: the validity mask is ``slot_topk >= 0``), ``slot_weights`` (fp32 ``[L,R*Tmax]``, differentiable),
    ``counts`` (int32 ``[L]``); static ``group_id``, ``num_tokens`` (T), ``topk`` (K)."""

    def __init__(self, arrays, group_id, num_tokens, topk):
        self.arrays = tuple(arrays)
        self.group_id, self.num_tokens, self.topk = int(group_id), int(num_tokens), int(topk)

    def __getattr__(self, name):
        if name in _LL_ARRAYS:
            return self.arrays[_LL_ARRAYS.index(name)]
        raise AttributeError(name)

    @property
    def static(self):
        return (self.group_id, self.num_tokens, self.topk)

    def tree_flatten(self):
        return self.arrays, self.static

    @classmethod
    def tree_unflatten(cls, static, arrays):
        return cls(arrays, *static)


def _ll_register(group) -> int:
    """Check ``group`` and keep it (strongly) in ep_ll's registry of groups a traced program may name, until
    the group is closed (a program run after that fails with the core's message)."""
    if not isinstance(group, _ep_ll.LowLatencyGroup):
        raise TypeError(f"group: expected a moe_rt.LowLatencyGroup, got {type(group).__name__}")
    group._alive("dispatch")
    if group.num_buffers != 1:
        raise ValueError(f"group: moe_rt.jax.ll_dispatch needs a LowLatencyGroup with num_buffers=1, got "
                         f"{group.num_buffers} (a dispatch takes its buffer set when it runs, and combine would "
                         f"need that choice on the host)")
    _ep_ll.adopt(group)
    return group.id


def _ll_lookup(group_id: int):
    return _ep_ll.adopted(group_id)


def _ll_core(group, T, K, arrays):
    """The reference's :class:`moe_rt.LowLatencyHandle` over the handle's arrays as seen inside a CPU callback
    (NumPy; no copy)."""
    idx, w, route, slot_k, slot_w, counts = arrays
    a = dict(idx=idx, w=w, route=route, slot_k=slot_k, slot_w=slot_w, counts=counts, rank=group.rank, R=group.size,
             L=group.num_local_experts, Tmax=group.max_tokens_per_rank, K=K, H=group.hidden, dtype=group.dtype, T=T)
    return _ep_ll.LowLatencyHandle(group, T, K, "cpu", 0, a)


def _ll_specs(group, T, K):
    R, L, Tmax = group.size, group.num_local_experts, group.max_tokens_per_rank
    i32, f32 = np.int32, np.float32
    return [_spec((T, K), i32), _spec((T, K), f32), _spec((R, Tmax, K), i32), _spec((L, R * Tmax), i32),
            _spec((L, R * Tmax), f32), _spec((L,), i32)]


def _ll_handle_arrays(a):
    return [a["idx"].astype(np.int32, copy=False), a["w"], a["route"], a["slot_k"], a["slot_w"], a["counts"]]


def _ll_ready(group, op, T, idx_dtype=None):
    """When ``op`` is lowered for CUDA: the group's device, shared buffers (on its first CUDA use: a collective
    with a host sync) and core group made, the kernels of ``op`` loaded into the group's device context, and
    those of the receive rows' copy (and the handler library) into XLA's; returns the call's attributes naming
    the group."""
    devices = _xla.cuda_devices()
    if not devices:
        raise RuntimeError(f"moe_rt.jax.ll_{op}: lowered for CUDA but JAX has no local CUDA device")
    dev = group.device if group.device is not None else int(devices[0].local_hardware_id)
    group._alive(op)
    core = group._llg
    if core is None:
        import cupy

        with cupy.cuda.Device(dev):
            if group._transport is None:
                group._setup(dev)
            core = group._core_group()
    core.prepare(op, T, _dtype_code(idx_dtype) if idx_dtype is not None else _xla.DTYPE_CODES["int32"])
    _xla.prepare("copy_kept_rows", N=group.num_local_experts * group.size * group.max_tokens_per_rank,
                 row_bytes=group.hidden * group.dtype.itemsize, zero_rest=1)
    return dict(group=np.int64(core.address), group_serial=np.int64(core.serial), device=np.int32(dev))


# -- dispatch --------------------------------------------------------------------------------------------

def _ll_dispatch_impl(static, x, idx, w):
    gid, zero, fp8 = static
    group = _ll_lookup(gid)
    T, K = int(idx.shape[0]), int(idx.shape[1])
    specs = [_spec(group._slots_shape(), x.dtype)] + _ll_specs(group, T, K)

    def on_cuda(x, idx, w):
        attrs = _ll_ready(group, "dispatch_fp8" if fp8 else "dispatch", T, idx.dtype)
        return _cffi("ll_dispatch", specs, x, idx, w, zero_empty_slots=np.int32(zero), fp8=np.int32(fp8), **attrs)

    def fn(xv, iv, wv):  # the reference's rows: new arrays, zero at empty slots
        recv, _, h = _ll_lookup(gid).dispatch(xv, iv, wv, fp8=fp8, dequantize=fp8)
        return [recv] + _ll_handle_arrays(h._a)

    out = _collective((x, idx, w), on_cuda, fn, specs)
    return out[0], out[-1], tuple(out[1:])


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_dispatch(static, x, idx, w):
    return _ll_dispatch_impl(static, x, idx, w)


def _ll_dispatch_fwd(static, x, idx, w):
    out = _ll_dispatch_impl(static, x, idx, w)
    return out, (out[2], jnp.zeros((0,), w.dtype))


def _ll_dispatch_bwd(static, res, cts):
    arrays, w_tag = res
    g_recv, _, g_arrays = cts
    gid = static[0]
    group = _ll_lookup(gid)
    T, K = int(arrays[0].shape[0]), int(arrays[0].shape[1])
    specs = [_spec((T, group.hidden), g_recv.dtype), _spec((T, K), np.float32)]

    def on_cuda(g, gsw, *hv):
        return _cffi("ll_dispatch_bwd", specs, g, gsw, *hv, **_ll_ready(group, "dispatch_bwd", T))

    def fn(gv, gsv, *hv):
        group = _ll_lookup(gid)
        gx, gw = group.dispatch_bwd(_ll_core(group, T, K, hv), gv, gsv)
        return [gx, gw]

    gx, gw = _collective((g_recv, g_arrays[4], *arrays), on_cuda, fn, specs)
    # the handle's topk_weights (what ll_combine applies) are ll_dispatch's topk_weights as fp32
    return gx, None, (gw + g_arrays[1]).astype(w_tag.dtype)


_ll_dispatch.defvjp(_ll_dispatch_fwd, _ll_dispatch_bwd)


def ll_dispatch(group, x, topk_idx, topk_weights, *, zero_empty_slots: bool = True, fp8: bool = False,
                dequantize: bool = False):
    """Differentiable :meth:`moe_rt.LowLatencyGroup.dispatch` for JAX (a collective; jit-compatible).

    Args:
        group: a :class:`moe_rt.LowLatencyGroup` (kept alive for the programs that name it until
            :meth:`~moe_rt.LowLatencyGroup.close`; a program run after close raises).
        x: ``[T,H]`` in the group's dtype, ``T <= max_tokens_per_rank``.
        topk_idx: ``[T,K]`` int32/int64, ids in ``[-1, E)`` (not differentiable).
        topk_weights: ``[T,K]`` float: the weights :func:`ll_combine` applies.
        zero_empty_slots: rows of empty slots in ``recv_x`` are zero (default); False leaves them
            unspecified (as the group's op does), saving one write of the whole ``[L, R*Tmax, H]`` output.
        fp8, dequantize: ``fp8=True, dequantize=True`` (a group made with ``fp8=True``) sends FP8 rows (e4m3
            codes and one fp32 scale per 128 channels, quantized inside the push) and returns them
            dequantized in the group's dtype as ``recv_x``; the gradient is straight-through (``x`` gets the
            float VJP of ``recv_x``'s cotangent). ``fp8=True`` alone is a ValueError: the codes carry no
            gradient (the group's own ``dispatch(..., fp8=True)`` returns them).

    Each call is a whole dispatch (no receive hook) on a group with ``num_buffers=1``. On the GPU the op and
    its VJP are XLA custom calls (no Python at run time); lowering the first one for CUDA makes the group's
    shared buffers (a collective: every rank lowers the same program).

    Returns:
        ``(recv_x [L, R*Tmax, H], counts [L] int32, handle)`` (a :class:`JaxLLHandle`): token ``t`` of rank
        ``s`` for local expert ``l`` at row ``(l, s*Tmax + t)``. ``recv_x`` is XLA's own array, copied out
        of the group's receive buffer (only valid slots are read). Zero rows keep an expert run over every
        row finite: its weight gradient multiplies them by the zero gradient rows of :func:`ll_combine`'s
        backward, which would give NaN for unspecified rows holding non-finite bits. Gradients flow to
        ``x`` and to ``topk_weights`` (through :func:`ll_combine` and ``handle.slot_weights``).
    """
    gid = _ll_register(group)
    _A.check_ll_fp8(group, fp8, dequantize)
    if isinstance(x, (tuple, list)):
        raise TypeError("x: moe_rt.jax.ll_dispatch takes a float array [T,H] (with fp8=True quantized in the push); "
                        "a pre-quantized (x_fp8, scales) pair goes to LowLatencyGroup.dispatch")
    x, topk_idx = jnp.asarray(x), jnp.asarray(topk_idx)
    topk_weights = None if topk_weights is None else jnp.asarray(topk_weights)
    T, K = group._check_dispatch(x, topk_idx, topk_weights)  # shapes and dtypes are known when traced
    recv, counts, arrays = _ll_dispatch((gid, bool(zero_empty_slots), bool(fp8)), x,
                                        jax.lax.stop_gradient(topk_idx), topk_weights)
    return recv, counts, JaxLLHandle(arrays, gid, T, K)


# -- combine ---------------------------------------------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_combine(static, y, arrays):
    gid, T, K = static
    group = _ll_lookup(gid)
    specs = [_spec((T, group.hidden), y.dtype)]

    def on_cuda(y, *hv):
        return _cffi("ll_combine", specs, y, *hv, **_ll_ready(group, "combine", T))

    def fn(yv, *hv):
        group = _ll_lookup(gid)
        return [group.combine(_ll_core(group, T, K, hv), yv)]

    return _collective((y, *arrays), on_cuda, fn, specs)[0]


def _ll_combine_fwd(static, y, arrays):
    return _ll_combine(static, y, arrays), (y, arrays)


def _ll_combine_bwd(static, res, g):
    y, arrays = res
    gid, T, K = static
    group = _ll_lookup(gid)
    slots = group._slots_shape()
    specs = [_spec(slots, y.dtype), _spec((T, K), np.float32)]
    n = slots[0] * slots[1]

    def on_cuda(g, y, *hv):
        # a third result: the per-slot dots of the weight gradient (scratch)
        out = _cffi("ll_combine_bwd", specs + [_spec((n,), np.float32)], g, y, *hv,
                   **_ll_ready(group, "combine_bwd", T))
        return out[:2]

    def fn(gv, yv, *hv):  # the reference's rows: a new array, zero at empty slots
        group = _ll_lookup(gid)
        gy, gw = group.combine_bwd(_ll_core(group, T, K, hv), gv, yv)
        return [gy, gw]

    gy, gw = _collective((g, y, *arrays), on_cuda, fn, specs)
    return gy, (None, gw, None, None, None, None)


_ll_combine.defvjp(_ll_combine_fwd, _ll_combine_bwd)


def ll_combine(handle: JaxLLHandle, expert_out):
    """Differentiable :meth:`moe_rt.LowLatencyGroup.combine` for JAX (a collective; jit-compatible):
    ``out[t] = sum_k w[t,k] * expert_out[slot(t,k)]`` (fp32, k ascending, rounded once) with the weights
    of :func:`ll_dispatch` (a group made with ``combine_partials=True``: its rank-partial sum, docs/ep.md §8). ``expert_out [L, R*Tmax, H]`` in ``recv_x``'s layout (only valid slots are
    read). Gradients flow to ``expert_out`` (zero at empty slots) and to ``topk_weights``; the backward
    always computes the weight gradient (one more exchange)."""
    if not isinstance(handle, JaxLLHandle):
        raise TypeError(f"handle: expected a JaxLLHandle from moe_rt.jax.ll_dispatch, got {type(handle).__name__}")
    group = _ll_lookup(handle.group_id)
    group._alive("combine")
    expert_out = jnp.asarray(expert_out)
    group._check_tokens(expert_out, "expert_out", group._slots_shape())  # known when traced
    return _ll_combine(handle.static, expert_out, handle.arrays)
