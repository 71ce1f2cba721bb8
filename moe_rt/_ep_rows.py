"""Row kernels and handle views shared by :class:`moe_rt.ep.EpGroup` and its transports (docs/ep.md).

The group and both transports (:mod:`moe_rt._ep_nccl`, :mod:`moe_rt._ep_direct`) launch these kernels of
``kernels/ep.cu`` (their names are registered by :mod:`moe_rt.ep`): zeroing the expert-major rows that hold
no slot and laying out their weights (``fill_rows``; ``fill_outputs`` after a transport's expand, which may
leave those rows unwritten), taking expert-major values back to the received rows' slots (``slot_values``),
scaling rows by a weight (``scale_rows``); the handle's regions as arrays (``recv_wk``) or as a permutation
plan (``plan_view``); and :class:`Fp8Rows`, what the transports' expand writes from the packed rows of a
one-pass FP8 dispatch.
"""
from __future__ import annotations

import numpy as np

from moe_rt import _arrays, _jit, permutation
from moe_rt.fp8 import packed_layout

FILE = "ep.cu"
UNITS = {16: "uint4", 8: "uint2", 4: "unsigned", 2: "unsigned short", 1: "unsigned char"}
# launch set-ups (kernel, grid, threads, constant arguments) by what they depend on, made once
_launches: dict = {}
_MAX_SETUPS = 256


def bound(cache: dict) -> None:
    """Empty a cache of launch set-ups that reached _MAX_SETUPS entries (sizes that keep changing)."""
    if len(cache) >= _MAX_SETUPS:
        cache.clear()


def unit(row_bytes: int, *ptrs) -> int:
    """The widest copy unit (16 to 1 bytes) dividing ``row_bytes`` and every pointer: the lowest set bit of
    their union, at most 16."""
    m = row_bytes | 16
    for p in ptrs:
        m |= p
    return m & -m


def regions(h):
    """``{region: device address}`` of a CUDA handle's buffer (plain ints for the launches, made once per
    handle: a handle's views are CuPy arrays, each a construction per call)."""
    a = h.state.get("addr")
    if a is None:
        base = h.buffer.data.ptr
        a = h.state["addr"] = {k: base + v[0] for k, v in h.layout.items()}
    return a


def grid(n, device_id, threads=256):
    """Blocks of ``threads`` for ``n`` items, at most eight per SM."""
    if n <= 0:
        return 0
    cap = _jit.device_properties(device_id)["sm_count"] * 8
    return max(1, min(-(-n // threads), cap))


def tokens_per_expert(call, h, out=None):
    """A copy of a CUDA handle's tokens_per_expert (int32 ``[L]``, what dispatch returns): one device-to-device
    copy on the call's stream into ``out`` (int32 ``[L]``), or a fresh array when None."""
    L = h.sizes["L"]
    if out is None:
        out = call.empty((L,), np.int32)
    rt = _rt[0] or _runtime()  # on the call's stream by its address (a light call's CuPy stream is not entered)
    rt.memcpyAsync(out.data.ptr, regions(h)["tokens_per_expert"], 4 * L, rt.memcpyDeviceToDevice, call.stream_ptr)
    return out


def copy_bytes(dst, src, nbytes, stream):
    """``nbytes`` from device address ``src`` to ``dst``: one cudaMemcpyAsync on ``stream`` (a CuPy stream), no
    kernel."""
    rt = _rt[0] or _runtime()
    rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream.ptr)


_rt = [None]  # CuPy's CUDA runtime module, imported on first use


def _runtime():
    from cupy.cuda import runtime

    _rt[0] = runtime
    return runtime


def recv_wk(h):
    """The received rows' slot weights (fp32 ``[rows,K]``, a view of the handle; made once per handle)."""
    v = h.state.get("recv_wk")
    if v is None:
        sz = h.sizes
        v = h.state["recv_wk"] = h.view("recv_wk")[:sz["rows"] * sz["K"]].reshape(sz["rows"], sz["K"])
    return v


def plan_view(h):
    """A permutation Plan over the handle's regions (no copy), cached on the handle."""
    plan = h.state.get("plan")
    if plan is not None:
        return plan
    sz = h.sizes
    rows, K, N = sz["rows"], sz["K"], sz["N"]
    arrays = (h.view("dst_row")[:rows * K].reshape(rows, K), h.view("src_slot")[:N], h.view("seg_start"),
              h.view("expert_counts"), h.view("tokens_per_expert"))
    if hasattr(permutation.Plan, "from_arrays"):
        plan = permutation.Plan.from_arrays(*arrays, num_rows=N, align_size=sz["A"], num_out_tokens=sz["num_out"])
    else:  # pragma: no cover - older permutation module: fill the documented fields directly
        plan = permutation.Plan._blank()
        plan.num_tokens, plan.topk, plan.num_experts, plan.num_rows = rows, K, sz["L"], N
        plan.align_size, plan.num_out_tokens, plan.from_routing_map = sz["A"], sz["num_out"], False
        plan.backend, plan.device_id = h.state["backend"], h.state["device_id"]
        plan._v = dict(zip(("dst_row", "src_slot", "seg_start", "counts", "tokens_per_expert"), arrays))
    h.state["plan"] = plan
    return plan


def fill_rows(call, h, out, pp, pv):
    """Zero the expert-major rows of ``out`` that hold no slot; ``pp[n] = pv[src_slot[n]]`` (0 for those)."""
    N = h.sizes["N"]
    if N == 0 or (out is None and pp is None):
        return
    rb = out.shape[1] * out.dtype.itemsize if out is not None else 0
    u = unit(rb, out.data.ptr) if out is not None else 16
    key = ("fill", N, rb, u, call.device_id)
    c = _launches.get(key)
    if c is None:
        bound(_launches)
        sms = _jit.device_properties(call.device_id)["sm_count"]
        c = _launches[key] = (_jit.function(FILE, f"ep_fill_rows<{UNITS[u]}>"), max(1, min(-(-N // 8), sms * 16)),
                              (np.int64(N), np.int64(rb // u)))
    _jit.launch_raw(c[0], c[1], 256, (out.data.ptr if out is not None else 0, pp if pp is not None else 0,
                                      pv if pv is not None else 0, regions(h)["src_slot"], *c[2]), 0, call.stream)


def fill_outputs(call, h, out, pp, pv, fp8=None, zero=True):
    """What every transport's forward runs after its expand: zero the expert-major rows that hold no slot
    (padding, the unused tail) of ``out`` (with ``fp8``, an :class:`Fp8Rows`: of each output in the tuple
    ``out``) and ``pp[n] = pv[src_slot[n]]`` (0 for those rows) when ``pp`` is given. ``zero=False``
    (dispatch's ``zero_empty_slots=False``): the rows are not written at all (ep_fill_rows gets no ``out``: its
    weights only, or no launch without ``pp``)."""
    if not zero:
        fill_rows(call, h, None, pp, pv)
    elif fp8 is None:
        fill_rows(call, h, out, pp, pv)
    else:
        fp8.fill(call, h, out, pp, pv)


def slot_values(call, h, vals):
    """[rows,K] float32: vals[dst_row[r,k]] (0 for slots with no row): the expert-major row values back to
    the received rows' slots."""
    sz = h.sizes
    out = call.xp.empty((sz["rows"], sz["K"]), np.float32)
    n = out.size
    if n:
        key = ("slot_values", n, call.device_id)
        c = _launches.get(key)
        if c is None:
            bound(_launches)
            c = _launches[key] = (_jit.function(FILE, "ep_slot_values"), grid(n, call.device_id), np.int64(n))
        _jit.launch_raw(c[0], c[1], 256, (vals if vals.size else 0, regions(h)["dst_row"], out, c[2]), 0, call.stream)
    return out


def scale_rows(call, rows, w):
    """``rows[n] *= w[n]`` (fp32 product, one rounding), in place."""
    n, H = int(rows.shape[0]), int(rows.shape[1])
    if n == 0 or H == 0:
        return
    isz = rows.dtype.itemsize
    vec = (H * isz) % 16 == 0 and rows.data.ptr % 16 == 0
    key = ("scale", rows.dtype, vec, n, H, call.device_id)
    c = _launches.get(key)
    if c is None:
        bound(_launches)
        nper = 16 // isz if vec else 1
        c = _launches[key] = (
            _jit.function(FILE, f"ep_scale_rows<{_jit.ctype(rows.dtype)}, {'true' if vec else 'false'}>"),
            grid(n * 8, call.device_id, threads=8), int(min(512, max(32, -(-(H // nper) // 32) * 32))),
            (np.int64(n), np.int64(H)))
    # the call's stream as a CuPy stream, not entered (a light call enters CuPy's device and stream for call.stream)
    _jit.launch_raw(c[0], c[1], c[2], (rows, w, *c[3]), 0, _arrays.as_cupy_stream(call.stream_ptr, call.device_id))


_FP8_PIECES = (16, 4, 1)


class Fp8Rows:
    """The packed rows of a one-pass FP8 dispatch (docs/ep.md §9; :func:`moe_rt.fp8.packed_layout`: ``H`` e4m3
    codes, at byte ``scale_at`` the ``S`` fp32 scales, zero padding to ``row_bytes``, a multiple of 16) and the
    outputs the transports' expand step splits them into as it writes the expert-major rows (the sinks of
    kernels/ep.cu): ``dtype=None``: codes ``[N,H]`` uint8 and scales ``[N,S]`` fp32 (``Fp8Rows<G>``); else the
    rows dequantized into ``[N,H]`` of ``dtype`` (``Fp8Dequant<T, G>``). Passed as ``fp8=`` to a transport's
    ``forward``, whose ``x`` is then the packed ``[T, row_bytes]`` uint8 rows and whose ``rows`` the tuple of
    outputs (padding rows zero: zero codes and zero scales)."""

    def __init__(self, hidden, dtype=None, codes=np.uint8):
        self.H = int(hidden)
        self.S, self.scale_at, self.row_bytes = packed_layout(self.H)
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.codes = np.dtype(codes)  # the codes' dtype the caller gets back (uint8, or an FP8 dtype over them)
        # the widest piece (bytes) that H, scale_at and 4S all divide: a piece is all codes, scales or padding
        self.piece = next(g for g in _FP8_PIECES
                          if self.H % g == 0 and self.scale_at % g == 0 and (4 * self.S) % g == 0)

    @staticmethod
    def sink_names():
        """Every sink's name expression (kernel registration: ``kernel<uint4, UNROLL, sink>``)."""
        return [f"Fp8Rows<{g}>" for g in _FP8_PIECES] + [f"Fp8Dequant<{c}, {g}>" for c in _jit.CTYPES.values()
                                                           for g in _FP8_PIECES]

    def empty(self, alloc, N, codes=np.uint8):
        """The outputs of ``N`` expert-major rows from ``alloc(shape, dtype)`` (``cupy.empty``, or a call's
        ``empty``): ``(codes, scales)``, the codes of dtype ``codes`` (uint8, or :attr:`codes` where the
        allocator makes FP8 arrays), or ``(rows,)``."""
        if self.dtype is None:
            return alloc((N, self.H), codes), alloc((N, self.S), np.float32)
        return (alloc((N, self.H), self.dtype),)

    def sink(self, outs):
        """``(sink name, out, out_s, fp8_h)``: the kernel's template argument and its output arguments; the
        piece narrowed where an output is not aligned to it."""
        isz = 1 if self.dtype is None else self.dtype.itemsize
        g = next(g for g in _FP8_PIECES if g <= self.piece and all(o.data.ptr % min(16, g * isz) == 0 for o in outs))
        name = f"Fp8Rows<{g}>" if self.dtype is None else f"Fp8Dequant<{_jit.ctype(self.dtype)}, {g}>"
        return name, outs[0].data.ptr, outs[1].data.ptr if len(outs) > 1 else 0, np.int32(self.H)

    @staticmethod
    def check_unit(u):
        if u != 16:  # pragma: no cover - packed rows are whole 16-byte units in aligned buffers
            raise RuntimeError(f"internal: packed FP8 rows need 16-byte copy units, got {u}")

    @staticmethod
    def fill(call, h, outs, pp, pv):
        """fill_rows over every output (the weights ``pp[n] = pv[src_slot[n]]`` with the first)."""
        fill_rows(call, h, outs[0], pp, pv)
        for o in outs[1:]:
            fill_rows(call, h, o, None, None)
