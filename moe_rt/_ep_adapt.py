"""Framework-neutral pieces of the expert-parallel adapters (``moe_rt.torch.ep_*``, ``moe_rt.jax.ep_*``).

A framework carries an EP handle as a plain uint8 array (the :class:`moe_rt.Handle` buffer, whose layout
is in ``include/moe_rt/moe_rt.h``) plus a few static ints, never as a Python object: that is what lets the
handle go through ``torch.compile``, ``jax.jit``, autograd residuals and ``jax.checkpoint``. Each op
rebuilds a :class:`Handle` over that buffer (no copy) with :func:`handle_from`:

- capacity mode: every size is static, so the buffer alone describes the plan;
- exact mode: the received row count and the NCCL counts were read on the host by ``prepare``; the
  framework carries that host copy of the ``meta`` region (int32, CPU) next to the buffer;
- CPU (1-rank reference groups): the plan is recomputed from the routing stored in the buffer (the
  reference is deterministic, so it is the same plan).

Groups are found by id (:func:`register`, :func:`lookup`), so only ints travel through the frameworks.

Weighted combine takes the received weights ``[N]`` explicitly (the output of dispatch, or any other
weights the caller wants): :func:`with_weights` writes them into the slots of a copy of the handle, so the
forward uses exactly the array the framework differentiates.
"""
from __future__ import annotations

import numpy as np

from moe_rt import _arrays, _handle
from moe_rt._handle import Handle, meta_index
from moe_rt.reference import permutation as _perm_ref

def register(group) -> int:
    """Check ``group`` and return its id (every EpGroup is findable by id while it lives; plain attribute
    reads, so this traces under torch.compile)."""
    from moe_rt.ep import EpGroup

    if not isinstance(group, EpGroup):
        raise TypeError(f"group: expected a moe_rt.EpGroup, got {type(group).__name__}")
    if group.closed:
        raise ValueError("group: the EP group is closed")
    return group.id


def check_bool(v, name) -> None:
    """A flag of an EP op (a bool or NumPy bool): TypeError naming it otherwise."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")


def check_fp8_flags(fp8, dequantize) -> None:
    """The ``fp8`` / ``dequantize`` flags of an EP dispatch, as :meth:`moe_rt.EpGroup.dispatch` checks them."""
    check_bool(fp8, "fp8")
    check_bool(dequantize, "dequantize")
    if dequantize and not fp8:
        raise ValueError("dequantize: only meaningful with fp8=True")


def check_ll_fp8(group, fp8, dequantize) -> None:
    """The FP8 flags of a differentiable low-latency dispatch (moe_rt.torch / moe_rt.jax ``ll_dispatch``): the
    dequantized form only (the codes carry no gradient), on a group with FP8 receive buffers."""
    check_fp8_flags(fp8, dequantize)
    if fp8 and not dequantize:
        raise ValueError("fp8=True without dequantize=True: the FP8 codes and scales carry no gradient; take them "
                         "from LowLatencyGroup.dispatch(x, topk_idx, topk_weights, fp8=True), or pass "
                         "dequantize=True for the differentiable form")
    group._check_fp8(fp8)


def check_pair_arity(x, fp8) -> None:
    """``x`` given as a tuple/list: an ``(x_fp8, scales)`` pair, and only with ``fp8=True``."""
    if len(x) != 2:
        raise TypeError(f"x: expected an array [T,H] or an (x_fp8, scales) pair, got a {type(x).__name__} of "
                        f"{len(x)} items")
    if not fp8:
        raise TypeError("x: an (x_fp8, scales) pair is FP8 input: pass fp8=True (the result is then the FP8 rows "
                        "and their scales)")


def lookup(group_id: int):
    from moe_rt.ep import _live_groups

    group = _live_groups.get(int(group_id))
    if group is None:
        raise ValueError(f"EP group {group_id} is gone (closed or garbage collected); keep the EpGroup alive "
                         "while its handles are used")
    return group


def rows_of(group, T: int, K: int, host_meta=None):
    """``(rows, N)``: received rows and expert-major rows of a handle of ``group`` for ``T`` tokens of
    top-``K``: static in capacity mode; from the host copy of the meta region in exact mode. Plain Python
    (no extension calls), so it traces under torch.compile."""
    sz = group._sizes(T, K)
    R, L, A = sz["R"], sz["L"], sz["A"]
    if group.mode == "capacity":
        rows = R * sz["P"]
        return rows, _perm_ref.num_rows(rows, K, L, A, sz["capacity"])
    if host_meta is None:
        raise ValueError("an exact-mode EP handle needs its host meta (made by prepare)")
    m = np.asarray(host_meta)
    rows = int(m[meta_index("recv_rows", R)])
    return rows, _perm_ref.num_rows(rows, K, L, A, int(m[meta_index("total_slots", R)]))


def sizes(group, T: int, K: int, host_meta=None):
    """``(rows, N, nbytes)`` of a handle of ``group`` (see :func:`rows_of`)."""
    rows, N = rows_of(group, T, K, host_meta)
    sz = group._sizes(T, K)
    _, total = _handle.layout(sz["R"], sz["L"], sz["Tmax"], K, sz["P"], rows, N)
    return rows, N, total


def host_meta_of(handle):
    """The int32 host copy of the meta region an exact-mode handle needs (empty for capacity mode)."""
    if handle.mode == "capacity":
        return np.zeros(0, np.int32)
    m = handle.state.get("host_meta")
    if m is None:
        m = handle.view("meta")
        m = m.get() if hasattr(m, "get") else m
    return np.array(m, np.int32)


def handle_from(group, buf, T: int, K: int, host_meta=None, *, copy: bool = False) -> Handle:
    """A :class:`Handle` of ``group`` over ``buf`` (a CuPy or NumPy uint8 array made by ``prepare``; no
    copy unless ``copy``)."""
    rows, N, total = sizes(group, T, K, None if group.mode == "capacity" else host_meta)
    if buf.ndim != 1 or np.dtype(buf.dtype) != np.uint8 or int(buf.size) != total:
        raise ValueError(f"handle buffer: expected uint8 [{total}] for T={T}, K={K} in this group, got "
                         f"{np.dtype(buf.dtype).name} {tuple(buf.shape)}")
    sz = group._sizes(T, K)
    if isinstance(buf, np.ndarray):
        off = group_layout(group, T, K, rows, N)["routing"][0]
        row = buf[off:off + 4 * (sz["Tmax"] * K + 1)].view(np.int32)
        if int(row[-1]) != T:
            raise ValueError(f"handle buffer: made for T={int(row[-1])} tokens, not {T}")
        return group._prepare_cpu(np.array(row[:T * K]).reshape(T, K), T, K)
    sz.update(rows=rows, N=N, num_out=sz["capacity"] if group.mode == "capacity" else
              int(np.asarray(host_meta)[meta_index("total_slots", sz["R"])]))
    lay, _ = _handle.layout(sz["R"], sz["L"], sz["Tmax"], K, sz["P"], rows, N)
    h = Handle(buf.copy() if copy else buf, lay, group.id, group.mode, sz)
    h.state.update(backend="cuda", device_id=int(buf.device.id),
                   host_meta=None if group.mode == "capacity" else np.asarray(host_meta, np.int32))
    return h


def group_layout(group, T, K, rows, N):
    sz = group._sizes(T, K)
    return _handle.layout(sz["R"], sz["L"], sz["Tmax"], K, sz["P"], rows, N)[0]


def with_weights(handle: Handle, recv_weights, xp) -> Handle:
    """A copy of ``handle`` whose slot weights are ``recv_weights [N]`` (expert-major, as dispatch returns
    them): slot ``s`` gets ``recv_weights[dst_row[s]]`` (0 for slots with no row)."""
    sz = handle.sizes
    rows, K, N = sz["rows"], sz["K"], sz["N"]
    _arrays.check_ndim(recv_weights, "recv_weights", 1)
    _arrays.check_dtype(recv_weights, "recv_weights", _arrays.FLOAT_DTYPES + (np.dtype(np.float64),))
    _arrays.check_shape(recv_weights, "recv_weights", (N,))
    w = recv_weights.astype(np.float32, copy=False)
    if handle.state.get("backend") == "cpu":
        dst = np.asarray(handle.state["ref"]["plan"]["dst_row"]).reshape(rows, K)
        wk = np.where(dst >= 0, w[np.maximum(dst, 0)] if N else 0, 0).astype(np.float32)
        h = Handle(handle.buffer, handle.layout, handle.group_id, handle.mode, sz)
        h.state = {k: v for k, v in handle.state.items() if k != "plan"}
        h.state["ref"] = dict(handle.state["ref"], recv_weights_slots=wk)
    else:
        dst = handle.view("dst_row")[:rows * K]
        h = Handle(handle.buffer.copy(), handle.layout, handle.group_id, handle.mode, sz)
        h.state = {k: v for k, v in handle.state.items() if k != "plan"}
        slots = h.view("recv_wk")[:rows * K]
        if N:
            slots[...] = xp.where(dst >= 0, w[xp.maximum(dst, 0)], xp.float32(0))
        else:
            slots.fill(0)
    h.state["has_weights"] = True
    return h
