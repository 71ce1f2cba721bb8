"""Dispatch and combine on one GPU: token permutation into expert-major rows and back (docs/permutation.md).

A MoE layer routes each token ``t`` to up to ``K`` experts. :func:`make_plan` turns that routing into a
:class:`Plan`: where each routed slot ``(t, k)`` lands in the permuted buffer (``dst_row``) and which slot
each permuted row holds (``src_slot``). Rows are grouped by expert (expert id ascending) and, within an
expert, by token (ascending), so expert ``e`` owns rows ``[seg_start[e], seg_start[e+1])``: the layout a
grouped GEMM consumes. :func:`dispatch` copies tokens (and their routing probs) into that layout,
:func:`combine` sums expert outputs back per token; both backwards and :func:`sort_chunks` (the local
reordering around expert-parallel all-to-alls) complete the family.

The number of permuted rows ``num_rows`` is always known on the host without a device sync:
``T*K`` (or ``num_out_tokens``) rows, and with ``align_size = A > 1`` the bound
``floor((kept + E*(A-1)) / A) * A``. Rows that hold no routed slot (padding, the unused tail, dropped
routes) are zero in every output this module produces.

CUDA arrays run the kernels of ``kernels/permutation.cu`` through the C core (:mod:`moe_rt._core`: each op
validates here, allocates its results and makes one core call, whose planner makes the kernel choices,
csrc/permutation.c); CPU arrays run the NumPy reference (:mod:`moe_rt.reference.permutation`). This module
still plans one thing the core lacks: float64 permuted probs (:func:`_fill`).
Everything is deterministic: integer plan construction with no
atomics, and fixed summation orders (k ascending, fp32) in every reduction.

Expert ids outside ``[-1, E)`` given to :func:`make_plan` are a ValueError on every backend, raised later
on CUDA than on the CPU: the CPU path raises in the call; the CUDA plan kernel records the id in the
device's error word, drops the slot (as ``-1``) and the error is raised by :func:`moe_rt.check` or the next
host wait of an ``EpGroup``, or in the call itself with ``validate=True`` / ``MOE_RT_DEBUG=1``
(:mod:`moe_rt._errors`).

No autograd: torch tensors that require grad while grad mode is on are refused with a TypeError (the
differentiable ops are in :mod:`moe_rt.torch`; or pass ``.detach()`` / call under ``torch.no_grad()``), and
so are JAX tracers (inside ``jax.jit``: use :mod:`moe_rt.jax`).
"""
from __future__ import annotations

import os

import numpy as np

from moe_rt import _arrays, _core, _errors, _jit
from moe_rt.reference import permutation as _ref

__all__ = ["Plan", "make_plan", "dispatch", "combine", "dispatch_backward", "combine_backward",
           "sort_chunks", "sort_chunks_backward"]

_FILE = "permutation.cu"
_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned", 2: "unsigned short", 1: "unsigned char"}
_IDX = {"int32": "int", "int64": "long long"}
_UNROLL = 4
# combine_slices configuration the C core launches (csrc/permutation.c; benchmarked in
# tools/bench_permutation.py): (largest CTA, element groups per thread, slots whose loads are issued together,
# load kind, persistent grid, CTAs per SM asked of the register allocator); registered for warmup here.
_COMBINE_CFG = (128, 1, 8, 1, False, 8)


def _combine_name(c: str, vec: bool, cfg=None) -> str:
    block_max, unroll, ku, lm, _, minb = cfg or _COMBINE_CFG
    return f"combine_slices<{c}, {'true' if vec else 'false'}, {unroll}, {ku}, {lm}, {block_max}, {minb}>"


# fill_rows's (slot probs type, permuted probs type) per probs dtype other than fp32
_PROB_OUT = {"float16": ("float", "__half"), "bfloat16": ("float", "__nv_bfloat16"), "float64": ("double", "double")}
# the C core's limits of the one-CTA make_plan, top-k ids and routing maps (docs/permutation.md §1.2), checked at
# import as every switch is
_jit.env_ints("MOE_RT_PLAN_FUSED_SLOTS", None, one=True)
_jit.env_ints("MOE_RT_PLAN_FUSED_MAP_SLOTS", None, one=True)
# the limits of dispatch's one-launch gather form (csrc/permutation.c, docs/permutation.md §1.5)
_jit.env_ints("MOE_RT_GATHER_ROWS", None, one=True)
_jit.env_ints("MOE_RT_GATHER_X_BYTES", None, one=True)
_names = ["plan_count<bool>", "plan_assign<bool>", "plan_fused<bool>"]  # routing maps, read in place
for _i in _IDX.values():
    _names += [f"plan_count<{_i}>", f"plan_assign<{_i}>", f"plan_fused<{_i}>", f"chunk_offsets<{_i}>"]
for _u in _UNITS.values():
    _names += [f"dispatch_rows<{_u}, {_UNROLL}, true>",
               f"fill_rows<{_u}>", f"chunk_sort_rows<{_u}, false>", f"chunk_sort_rows<{_u}, true>",
               f"copy_kept_rows<{_u}>"]
    # permuted probs in the probs' dtype (fp16/bf16 from fp32 slot probs; fp64 as it is)
    _names += [f"fill_rows<{_u}, {_pi}, {_po}>" for _pi, _po in _PROB_OUT.values()]
for _c in _jit.CTYPES.values():
    for _v in (True, False):
        _names += [_combine_name(_c, _v), f"combine_bwd_rows<{_c}, {'true' if _v else 'false'}, {_UNROLL}>"]
_names += ["plan_scan", "gather_slots"]
_jit.register(_FILE, _names)

# Loaded kernels (CuPy Function objects) by (name expression, device): a launch then skips the registry's
# lookup.
_fns: dict = {}


def _fn(name: str, device_id: int, shared_mem: int = 0):
    """Kernel ``name`` of permutation.cu for ``device_id`` (the current device inside an op's call),
    opted in to ``shared_mem`` bytes of dynamic shared memory."""
    key = (name, device_id)
    f = _fns.get(key)
    if f is None:
        f = _fns[key] = [_jit.function(_FILE, name).kernel, 48 * 1024]
    if shared_mem > f[1]:
        _jit.set_max_dynamic_shared(_jit.function(_FILE, name), shared_mem)
        f[1] = shared_mem
    return f[0]


def _launch(fn, grid: int, block, args, stream, shared_mem: int = 0) -> None:
    # Straight to the launcher (args: CuPy arrays, NumPy scalars, or ints passed as 64-bit values).
    if grid > 0:
        _jit.launch_raw(fn, grid, block, args, shared_mem, stream)


MAX_EXPERTS = 16384
_INT32_MAX = 2**31 - 1
_BYTE_DTYPES = tuple(np.dtype(d) for d in (np.uint8, np.int8))
try:
    import ml_dtypes as _mld

    _BYTE_DTYPES += tuple(np.dtype(getattr(_mld, n)) for n in ("float8_e4m3fn", "float8_e5m2")
                          if hasattr(_mld, n))
except ImportError:  # pragma: no cover
    pass
_TOKEN_DTYPES = tuple(d for d in _arrays.FLOAT_DTYPES if d is not None)
_PROB_DTYPES = _TOKEN_DTYPES + (np.dtype(np.float64),)


# -- the plan --------------------------------------------------------------------------------------------

class Plan:
    """Where every routed slot goes; made by :func:`make_plan`, consumed by the other ops.

    Arrays (in the framework and on the device of the routing given to :func:`make_plan`):

    - ``dst_row [T,K] int32``: permuted row of slot ``(t, k)``; -1 when the slot has no expert (id -1 or
      out of range) or was dropped by ``num_out_tokens``.
    - ``src_slot [N] int32``: flat slot ``t*K + k`` held by each permuted row; -1 for padding/unused rows.
    - ``seg_start [E+1] int32``: expert ``e`` owns rows ``[seg_start[e], seg_start[e+1])``;
      ``seg_start[E]`` is the number of rows in use (the rest, up to ``num_rows``, is unused and zero).
    - ``counts [E] int32``: routed (kept) slots per expert, without padding.
    - ``tokens_per_expert [E] int32``: the group sizes for a grouped GEMM: the padded counts
      ``ceil(counts/A)*A`` when ``align_size > 1``, else ``counts``.

    Ints: ``num_tokens`` (T), ``topk`` (K; ``num_experts`` for a routing map), ``num_experts`` (E),
    ``num_rows`` (N), ``align_size`` (A), ``num_out_tokens`` (None or the kept-slot limit).
    """

    __slots__ = ("num_tokens", "topk", "num_experts", "num_rows", "align_size", "num_out_tokens",
                 "from_routing_map", "backend", "device_id", "_v", "_framework", "_exported", "_core")

    def __init__(self, *args, **kwargs):
        raise TypeError("Plan: plans are made by moe_rt.make_plan (or Plan.from_arrays over a plan's five "
                        "arrays), not by calling Plan()")

    @classmethod
    def _blank(cls) -> "Plan":
        """An empty plan for this module's makers to fill in (``Plan()`` itself refuses)."""
        return object.__new__(cls)

    def _array(self, name):
        # Exported to the caller's framework on first access (zero copy), then cached.
        a = self._exported.get(name)
        if a is None:
            a = self._exported[name] = _arrays.export(self._v[name], self._framework)
        return a

    dst_row = property(lambda self: self._array("dst_row"))
    src_slot = property(lambda self: self._array("src_slot"))
    seg_start = property(lambda self: self._array("seg_start"))
    counts = property(lambda self: self._array("counts"))
    tokens_per_expert = property(lambda self: self._array("tokens_per_expert"))

    @classmethod
    def from_arrays(cls, dst_row, src_slot, seg_start, counts, tokens_per_expert, *, num_rows: int,
                    align_size: int = 1, num_out_tokens: int | None = None) -> "Plan":
        """Rebuild a plan from its five int32 arrays (any framework, one device; no copy), e.g. after
        they travelled through a framework graph as plain tensors. Shapes are checked against each other;
        the contents are trusted to come from :func:`make_plan`."""
        names = ("dst_row", "src_slot", "seg_start", "counts", "tokens_per_expert")
        given = dict(zip(names, (dst_row, src_slot, seg_start, counts, tokens_per_expert)))
        call = _arrays.Call(given)
        v = {k: call[k] for k in names}
        for k, a in v.items():
            _arrays.check_dtype(a, k, (np.dtype(np.int32),))
        _arrays.check_ndim(v["dst_row"], "dst_row", 2)
        T, K = (int(d) for d in v["dst_row"].shape)
        E = int(v["counts"].shape[0]) if v["counts"].ndim == 1 else -1
        N = _arrays.check_int(num_rows, "num_rows", low=0)
        _arrays.check_shape(v["src_slot"], "src_slot", (N,))
        _arrays.check_shape(v["seg_start"], "seg_start", (E + 1,))
        _arrays.check_shape(v["counts"], "counts", (E,))
        _arrays.check_shape(v["tokens_per_expert"], "tokens_per_expert", (E,))
        plan = cls._blank()
        plan.num_tokens, plan.topk, plan.num_experts, plan.num_rows = T, K, E, N
        plan.align_size = _arrays.check_int(align_size, "align_size", low=1)
        plan.num_out_tokens = None if num_out_tokens is None or num_out_tokens < 0 else int(num_out_tokens)
        plan.from_routing_map = False
        plan.backend, plan.device_id = call.backend, call.device_id
        plan._v = {k: _arrays.contiguous(call.xp, a) for k, a in v.items()}
        plan._framework = call.framework
        plan._exported = {k: a for k, a in given.items() if plan._v[k] is v[k]}
        return plan

    def __repr__(self):
        return (f"Plan(num_tokens={self.num_tokens}, topk={self.topk}, num_experts={self.num_experts}, "
                f"num_rows={self.num_rows}, align_size={self.align_size}, "
                f"num_out_tokens={self.num_out_tokens}, backend={self.backend!r})")

    def _dict(self):
        d = dict(self._v)
        d.update(num_tokens=self.num_tokens, topk=self.topk, num_experts=self.num_experts,
                 num_rows=self.num_rows, align_size=self.align_size)
        return d


_PLAN_NAMES = ("dst_row", "src_slot", "seg_start", "counts", "tokens_per_expert")
_CODES = _core.CODES  # NumPy dtype -> the core's dtype code


def _core_plan(plan):
    """A CUDA plan as the core takes it: its five arrays' addresses and (T, K, E, N, A); worked out once per
    plan (plans are immutable)."""
    t = getattr(plan, "_core", None)
    if t is None:
        v = plan._v
        if type(v) is _PlanViews:  # the addresses inside the one buffer, without making the views
            b = v._buf.data.ptr
            ptrs = tuple(b + 4 * v._spec[k][0] for k in _PLAN_NAMES)
        else:
            ptrs = tuple(v[k].data.ptr for k in _PLAN_NAMES)
        t = plan._core = ptrs + (plan.num_tokens, plan.topk, plan.num_experts, plan.num_rows, plan.align_size)
    return t



def _check_plan(plan, call: _arrays.Call):
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a moe_rt Plan from make_plan, got {type(plan).__name__}")
    if plan.backend != call.backend or (call.backend == "cuda" and plan.device_id != call.device_id):
        where = f"{plan.backend}:{plan.device_id}" if plan.backend == "cuda" else "cpu"
        here = f"{call.backend}:{call.device_id}" if call.backend == "cuda" else "cpu"
        raise ValueError(f"plan: was made on {where} but the arrays are on {here}")


def _num_rows(T, K, E, A, num_out_tokens):
    return _ref.num_rows(T, K, E, A, num_out_tokens)


def check_plan_settings(num_experts, align_size, num_out_tokens, map_type=None):
    """:func:`make_plan`'s settings, validated: ``(E, A, num_out_tokens)`` (``map_type`` is None, ``"mask"``
    or ``"index"``)."""
    key = (type(num_experts), num_experts, type(align_size), align_size, type(num_out_tokens), num_out_tokens,
           type(map_type), map_type)
    hit = _validated(_PLAN_SETTINGS, key)
    if hit is not None:
        return hit
    E = _arrays.check_int(num_experts, "num_experts", low=1, high=MAX_EXPERTS)
    A = _arrays.check_int(align_size, "align_size", low=1, high=1 << 20)
    if num_out_tokens is not None:
        num_out_tokens = _arrays.check_int(num_out_tokens, "num_out_tokens", low=0, high=_INT32_MAX)
    _check_map_type(map_type)
    return _remember(_PLAN_SETTINGS, key, (E, A, num_out_tokens))


_PLAN_SETTINGS: dict = {}
_ROUTING_ARGS: dict = {}


_MAP_TYPES = ("mask", "index")
_MASK_INT_DTYPES = _arrays.INDEX_DTYPES + (np.dtype(np.int8), np.dtype(np.uint8))


def _check_map_type(map_type):
    if map_type is not None and (not isinstance(map_type, str) or map_type not in _MAP_TYPES):
        raise ValueError(f"map_type: expected None, 'mask' or 'index', got {map_type!r}")


def routing_kind(dtype, shape, num_experts: int, map_type) -> str:
    """What a routing of ``dtype`` (a NumPy dtype) and ``shape`` is, by the rule of :func:`make_plan`:
    ``"bool_map"`` (a bool routing map), ``"int_map"`` (an integer 0/1 map, ``map_type="mask"``) or
    ``"index"`` (``topk_idx``). Judged from dtypes and shapes only (values would need a device sync);
    raises TypeError/ValueError naming ``routing`` or ``map_type``. Shared by the adapters."""
    _check_map_type(map_type)
    dt = np.dtype(dtype)
    if dt == np.uint8 and len(shape) == 2 and shape[1] != num_experts and shape[1] == (num_experts + 7) // 8:
        raise TypeError("routing: this looks like a bit-packed routing map (routing_map_format='bitmap_u8', uint8 "
                        f"[T, ceil(num_experts/8)={shape[1]}]), which the dispatch ops do not take; unpack it "
                        "first (np.unpackbits(m, axis=-1, count=num_experts, bitorder='little')) or route with "
                        "the default 'bytemap'")
    if dt == np.bool_:
        if map_type == "index":
            raise TypeError("routing: map_type='index' takes topk_idx (int32 or int64), got a bool array")
        return "bool_map"
    if map_type == "mask":
        if dt not in _MASK_INT_DTYPES:
            raise TypeError(f"routing: a routing map is bool or integer 0/1 (int8, uint8, int32, int64), "
                            f"got dtype {dt.name}")
        if len(shape) != 2 or shape[1] != num_experts:
            raise ValueError(f"routing: a routing_map must have shape [T, num_experts={num_experts}], "
                             f"got {tuple(shape)}")
        return "int_map"
    if dt not in _arrays.INDEX_DTYPES:
        raise TypeError(f"routing: expected topk_idx (int32 or int64) or a routing_map (bool), got dtype {dt.name}")
    if map_type is None and len(shape) == 2 and shape[1] == num_experts:
        raise ValueError(f"routing: an integer array of shape [T, num_experts={num_experts}] could be a 0/1 "
                         f"routing map or topk_idx with topk == num_experts; pass map_type='mask' or "
                         f"map_type='index'")
    return "index"


def check_routing(r, E, A, num_out_tokens, map_type=None):
    """The shape and dtype checks of :func:`make_plan`'s routing (anything with ``shape``, ``ndim``,
    ``dtype``; the settings from :func:`check_plan_settings`; the routing's kind by :func:`routing_kind`):
    ``(T, K, is_map, N)`` (``is_map`` also for an integer 0/1 map)."""
    key = (_sig(r), E, A, num_out_tokens, type(map_type), map_type)
    hit = _validated(_ROUTING_ARGS, key)
    if hit is not None:
        return hit
    _arrays.check_ndim(r, "routing", 2)
    is_map = routing_kind(r.dtype, tuple(r.shape), E, map_type) != "index"
    T = int(r.shape[0])
    if is_map:
        if r.shape[1] != E:
            raise ValueError(f"routing: a routing_map must have shape [T, num_experts={E}], "
                             f"got {tuple(r.shape)}")
        K = E
    else:
        K = int(r.shape[1])
    L = T * K
    if L > _INT32_MAX:
        raise ValueError(f"routing: T*K = {T}*{K} slots must stay below 2^31")
    if num_out_tokens is not None and num_out_tokens > L:
        raise ValueError(f"num_out_tokens: must be <= T*K = {T}*{K} = {L} (the routed slots), got "
                         f"{num_out_tokens}")
    N = _num_rows(T, K, E, A, num_out_tokens)
    if N > _INT32_MAX:
        raise ValueError(f"num_rows = {N} (from T*K / num_out_tokens and align_size) must stay below 2^31")
    return _remember(_ROUTING_ARGS, key, (T, K, is_map, N))


def make_plan(routing, num_experts: int, *, align_size: int = 1, num_out_tokens: int | None = None,
              map_type: str | None = None, stream=None, validate: bool | None = None,
              _apart: bool = False) -> Plan:
    """Build the dispatch plan of a routing, on the routing's device, without a host sync.

    Args:
        routing: either ``topk_idx [T,K]`` int32/int64 (expert id of slot ``(t,k)``; ``-1`` = no expert),
            or ``routing_map [T,E]`` bool. A routing map is taken as ``K = E`` slots per token, slot ``k``
            being expert ``k`` (so slots are listed in ascending expert id and dense ``[T,E]`` probs are
            the slot probs); prefer ``num_out_tokens`` with a map, else ``N = T*E`` rows are allocated.
        num_experts: E, 1..16384.
        align_size: A >= 1; each expert's segment is padded with zero rows to a multiple of A.
        num_out_tokens: None (keep every routed slot) or an int >= 0: keep only the first
            ``num_out_tokens`` routed slots in expert-major order (index-style capacity drop); the
            unpadded row count is then ``num_out_tokens`` instead of ``T*K``.
        map_type: what ``routing`` is: None (from its dtype: bool is a routing map, int32/int64
            ``topk_idx``), ``"mask"`` (a ``[T,E]`` routing map, bool or integer 0/1, nonzero = routed) or
            ``"index"`` (``topk_idx``). An integer ``[T, num_experts]`` array is ambiguous (a 0/1 map, or
            ids with ``topk == num_experts``): without ``map_type`` it raises ValueError rather than be
            read one way silently. The rule looks at shapes only (no device sync).
        stream: CUDA stream (None = the caller's current stream).
        validate: None (follow ``MOE_RT_DEBUG`` / :func:`moe_rt.set_debug`) or a bool: on CUDA, wait for
            the stream after the plan is made and raise a bad expert id at once (a device sync).
        _apart: (internal) give each plan array its own allocation instead of views of one buffer
            (torch custom ops may not return outputs that alias each other).

    Expert ids outside ``[-1, E)`` raise ``ValueError("routing: expert ids must be in [-1,
    num_experts=E), got V")`` on every backend, but not at the same moment: the CPU backend raises at once;
    on CUDA the plan kernel records the id in the device's error word and treats it as ``-1`` (the slot
    is dropped; nothing is written out of bounds), and the error is raised at the next host-visible point
    (:func:`moe_rt.check`, an ``EpGroup`` host wait), or here with ``validate=True`` (see
    :mod:`moe_rt._errors`).

    Returns:
        :class:`Plan`. ``num_rows`` is ``T*K`` (or ``num_out_tokens``) for ``A == 1``, else
        ``floor((kept + E*(A-1)) / A) * A``.
    """
    E, A, num_out_tokens = check_plan_settings(num_experts, align_size, num_out_tokens, map_type)
    validate = _errors.DEBUG if validate is None else _errors.resolve_validate(validate)
    with _arrays.Call({"routing": routing}, stream=stream, lean=True) as call:
        r = call["routing"]
        T, K, is_map, N = check_routing(r, E, A, num_out_tokens, map_type)
        if is_map and r.dtype != np.bool_:  # an integer 0/1 map: nonzero = routed
            r = np.asarray(r) != 0 if call.backend == "cpu" else _arrays.cupy_of(r) != 0
        L = T * K
        if call.backend == "cpu":
            _check_host_memory(L, N)

        plan = Plan._blank()
        plan.num_tokens, plan.topk, plan.num_experts, plan.num_rows = T, K, E, N
        plan.align_size, plan.num_out_tokens, plan.from_routing_map = A, num_out_tokens, is_map
        plan.backend, plan.device_id = call.backend, call.device_id

        if call.backend == "cpu":
            if is_map:
                idx = _ref.routing_map_to_topk(r)
            else:
                idx = np.asarray(r)
                _errors.check_ids(idx, E, "routing")
            d = _ref.make_plan(idx, E, A, num_out_tokens)
            v = {k: d[k] for k in ("dst_row", "src_slot", "seg_start", "counts", "tokens_per_expert")}
        else:
            validate = validate and not is_map  # a routing map holds no expert ids
            v = _plan_cuda(call, r, T, K, E, A, N, num_out_tokens, _apart)
            if validate:
                _core.device(call.device_id).check(call.stream_ptr)
        plan._v = v
        plan._framework = call.framework
        plan._exported = {}
        return plan


# bytes the CPU reference's plan holds at once per slot (the int64 ids, keys, sort order, rows, their int32
# results and the routing's copy) and per row (src_slot in int64 and int32)
_REF_BYTES_PER_SLOT = 64
_REF_BYTES_PER_ROW = 12


def _host_memory() -> int:
    """This host's physical memory in bytes (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not a POSIX host
        return 0


def _check_host_memory(L: int, N: int) -> None:
    """Refuse a CPU plan the reference cannot hold before it allocates anything (rather than exhausting the
    host's memory)."""
    need = L * _REF_BYTES_PER_SLOT + N * _REF_BYTES_PER_ROW
    have = _host_memory()
    if have and need > have // 2:
        raise ValueError(f"routing: a plan of T*K = {L} slots and {N} rows needs about {need / 2**30:.1f} GiB on "
                         f"the CPU backend, more than half of this host's {have / 2**30:.1f} GiB")


class _PlanViews(dict):
    """A CUDA plan's arrays, made on first use as views of the plan's one int32 buffer (the kernels take
    raw pointers, so most plans never need all five)."""

    __slots__ = ("_buf", "_spec")

    def __missing__(self, name):
        off, shape = self._spec[name]
        n = 1
        for d in shape:
            n *= d
        a = self._buf[off:off + n]
        if len(shape) != 1:
            a = a.reshape(shape)
        self[name] = a
        return a


def _plan_spec(T, K, E, N):
    """Where each plan array lies in a plan's one int32 buffer: name -> (word offset, shape)."""
    L = T * K
    return {"dst_row": (0, (T, K)), "src_slot": (L, (N,)), "seg_start": (L + N, (E + 1,)),
            "counts": (L + N + E + 1, (E,)), "tokens_per_expert": (L + N + 2 * E + 1, (E,))}


_plan_sizes: dict = {}  # (T, K, E, N) -> (the plan buffer's layout, the core's working memory bytes)


def _plan_cuda(call, r, T, K, E, A, N, num_out_tokens, apart=False):
    """make_plan in the C core: the plan's arrays as views of one int32 buffer that holds the core's working
    memory after them (``apart``: five allocations and the working memory apart)."""
    idx = call.contiguous(r)  # a routing map is read in place (slot t*E + e is expert e)
    key = (T, K, E, N)
    sizes = _plan_sizes.get(key)
    if sizes is None:
        if len(_plan_sizes) > 512:
            _plan_sizes.clear()
        sizes = _plan_sizes[key] = (_plan_spec(T, K, E, N), _core.make_plan_workspace_bytes(T, K, E))
    spec, nws = sizes
    if apart:
        views = {k: call.empty(shape, np.int32) for k, (_, shape) in spec.items()}
        ptrs = [views[k].data.ptr for k in _PLAN_NAMES]
        ws = call.scratch((max(nws, 1),), np.uint8).data.ptr
    else:
        # one allocation: the plan's arrays, then the core's working memory (int32 words: the plan kernels'
        # tables and counter), which the plan keeps (a torch plan's split takes it as its last piece)
        words = T * K + N + 3 * E + 1
        buf = call.empty((words + (nws + 3) // 4,), np.int32)
        b = buf.data.ptr
        ptrs = [b + 4 * spec[k][0] for k in _PLAN_NAMES]
        ws = b + 4 * words
        views = _PlanViews()
        views._buf, views._spec = buf, spec
    _core.make_plan(_core.device(call.device_id), idx.data.ptr, _CODES[idx.dtype], T, K, E, A,
                    -1 if num_out_tokens is None else num_out_tokens, *ptrs, ws, nws, call.stream_ptr)
    return views


# -- helpers ---------------------------------------------------------------------------------------------

def _unit(row_bytes: int, *ptrs) -> int:
    for u in (16, 8, 4, 2, 1):
        if row_bytes % u == 0 and all(p % u == 0 for p in ptrs):
            return u
    return 1


def _row_grid(n_rows: int, device_id: int) -> int:
    if n_rows <= 0:
        return 0
    cap = _jit.device_properties(device_id)["sm_count"] * 16
    return max(1, min(-(-n_rows // 8), cap))


def _check_tokens(arr, name, T, dtypes, what="plan.num_tokens"):
    _arrays.check_ndim(arr, name, 2)
    dt = np.dtype(arr.dtype)
    if dt not in dtypes and dt in _BYTE_DTYPES:
        raise TypeError(f"{name}: {dt.name} rows cannot be summed (a weighted sum needs float32, float16 or "
                        f"bfloat16; FP8 values mean something only with their scales, as in TransformerEngine, "
                        f"which refuses FP8 in unpermute): dequantize them first (moe_rt.dequantize_fp8)")
    _arrays.check_dtype(arr, name, dtypes)
    if arr.shape[0] != T:
        raise ValueError(f"{name}: expected {T} rows ({what}), got shape {tuple(arr.shape)}")


def _slot_probs(call, probs, plan: Plan, name: str, keep_f64: bool = False, checked: bool = False):
    """``probs`` ([T,K] slot probs, or dense [T,E]) as contiguous float32 [T,K] (None stays None);
    ``keep_f64``: float64 probs stay float64; ``checked``: :func:`check_probs` passed already."""
    if probs is None:
        return None
    T, K, E = plan.num_tokens, plan.topk, plan.num_experts
    if not checked:
        check_probs(probs, name, T, K, E)
    if tuple(probs.shape) == (T, K):
        p = probs
    else:
        # Dense [T,E] probs for an index plan: pick each slot's expert (ids out of range read 0).
        p = _dense_to_slots(call.xp, probs, plan, keep_f64)
    return call.contiguous(_as_dtype(p, _F64 if keep_f64 and probs.dtype == _F64 else _F32))


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def _as_dtype(a, dt):
    """``a.astype(dt, copy=False)``, without the call where ``a`` has ``dt`` already (what it would keep)."""
    return a if a.dtype == dt else a.astype(dt, copy=False)


def check_probs(probs, name, T, K, E):
    """Slot probs ``[T,K]`` or dense ``[T,E]`` of a float dtype (anything with ``shape``, ``ndim``, ``dtype``)."""
    _arrays.check_ndim(probs, name, 2)
    _arrays.check_dtype(probs, name, _PROB_DTYPES)
    shape = tuple(probs.shape)
    if shape != (T, K) and shape != (T, E):
        raise ValueError(f"{name}: expected shape [T,K] = {(T, K)} or dense [T,E] = {(T, E)}, got {shape}")


def check_dispatch_args(x, probs, T, K, E, probs_dtype=None):
    """The shape, dtype and settings checks of :func:`dispatch` for a plan of T tokens, K slots, E experts:
    the dtype of the permuted probs (None without probs)."""
    key = (_sig(x), _sig(probs), T, K, E, type(probs_dtype), probs_dtype)
    hit = _validated(_DISPATCH_ARGS, key)
    if hit is not None:
        return hit[0]
    _check_tokens(x, "x", T, _TOKEN_DTYPES + _BYTE_DTYPES)
    pdt = _probs_dtype(probs_dtype, probs)
    if probs is not None:
        check_probs(probs, "probs", T, K, E)
    return _remember(_DISPATCH_ARGS, key, (pdt,))[0]


# the checks' results by signature (see moe_rt._arrays.validated)
_sig, _validated, _remember = _arrays.sig, _arrays.validated, _arrays.remember
_DISPATCH_ARGS: dict = {}
_COMBINE_ARGS: dict = {}
_DISPATCH_BWD_ARGS: dict = {}
_COMBINE_BWD_ARGS: dict = {}


def check_combine_args(y_permuted, probs, T, K, E, N):
    """The shape and dtype checks of :func:`combine` for a plan of T tokens, K slots, E experts, N rows."""
    key = (_sig(y_permuted), _sig(probs), T, K, E, N)
    if _validated(_COMBINE_ARGS, key) is not None:
        return
    _check_tokens(y_permuted, "y_permuted", N, _TOKEN_DTYPES, "plan.num_rows")
    if probs is not None:
        check_probs(probs, "probs", T, K, E)
    _remember(_COMBINE_ARGS, key, True)


def _check_dispatch_bwd_args(g, gpp, T, N):
    """The shape and dtype checks of :func:`dispatch_backward` for a plan of T tokens and N rows."""
    key = (_sig(g), _sig(gpp), T, N)
    if _validated(_DISPATCH_BWD_ARGS, key) is not None:
        return
    _check_tokens(g, "grad_x_permuted", N, _TOKEN_DTYPES, "plan.num_rows")
    if gpp is not None:
        _arrays.check_dtype(gpp, "grad_probs_permuted", _PROB_DTYPES)
        _arrays.check_shape(gpp, "grad_probs_permuted", (N,))
    _remember(_DISPATCH_BWD_ARGS, key, True)


def _check_combine_bwd_args(g, probs, yv, T, K, E, N):
    """The shape and dtype checks of :func:`combine_backward` for a plan of T tokens, K slots, E experts, N
    rows."""
    key = (_sig(g), _sig(probs), _sig(yv), T, K, E, N)
    if _validated(_COMBINE_BWD_ARGS, key) is not None:
        return
    _check_tokens(g, "grad_y", T, _TOKEN_DTYPES)
    if probs is not None:
        check_probs(probs, "probs", T, K, E)
        if yv is None:
            raise ValueError("y_permuted: the forward input is needed to differentiate with probs")
        _arrays.check_ndim(yv, "y_permuted", 2)
        _arrays.check_dtype(yv, "y_permuted", (np.dtype(g.dtype),))
        _arrays.check_shape(yv, "y_permuted", (N, g.shape[1]))
    _remember(_COMBINE_BWD_ARGS, key, True)


def _dense_to_slots(xp, probs, plan, keep_f64=False):
    # plan.src_slot / dst_row do not keep expert ids; recover them from the segments.
    T, K, E = plan.num_tokens, plan.topk, plan.num_experts
    probs = _arrays.cupy_of(probs)
    dst = _arrays.cupy_of(plan._v["dst_row"])
    seg = _arrays.cupy_of(plan._v["seg_start"])
    e = xp.searchsorted(seg[1:], dst, side="right")  # segment of each row
    e = xp.minimum(e, E - 1)
    g = xp.take_along_axis(probs, e.astype(np.int64), axis=1)
    keep = keep_f64 and np.dtype(probs.dtype) == np.float64
    return xp.where(dst >= 0, g, 0).astype(np.float64 if keep else np.float32)


# -- dispatch / combine ----------------------------------------------------------------------------------

def _probs_dtype(probs_dtype, probs):
    """The dtype of the permuted probs: ``probs_dtype`` None means the probs' own dtype; else float32."""
    if probs_dtype is not None:
        if str(probs_dtype) not in ("float32", "torch.float32") and not (
                isinstance(probs_dtype, (type, np.dtype)) and _np_dtype(probs_dtype) == np.float32):
            raise ValueError(f"probs_dtype: expected None (the probs' dtype) or 'float32', got {probs_dtype!r}")
        return np.dtype(np.float32)
    return None if probs is None else np.dtype(probs.dtype)


def _np_dtype(d):
    try:
        return np.dtype(d)
    except TypeError:
        return None


def dispatch(x, plan: Plan, probs=None, *, probs_dtype=None, stream=None):
    """Permute tokens (and their routing probs) into the plan's expert-major rows.

    Records no autograd: use the op of the same name in ``moe_rt.torch`` / ``moe_rt.jax`` to differentiate
    (torch tensors that require grad, and JAX tracers, are refused with a TypeError).

    Args:
        x: ``[T,H]`` fp32/fp16/bf16, or 1-byte data (uint8, int8, fp8) copied as raw bytes.
        plan: from :func:`make_plan` on the same device; ``T == plan.num_tokens``.
        probs: None, ``[T,K]`` slot probs (the layout of ``topk_idx``), or dense ``[T,E]``; any float dtype.
        probs_dtype: None (the permuted probs in the probs' dtype, bit-exact copies) or ``"float32"``.
        stream: CUDA stream (None = the caller's current stream).

    Returns:
        ``(x_permuted [N,H] x.dtype, probs_permuted [N] or None)``, the probs in ``probs_dtype``; rows
        holding no routed slot (padding, unused tail) are zero, and so are their probs.
    """
    with _arrays.Call({"x": x, "probs": probs}, stream=stream, lean=True) as call:
        _check_plan(plan, call)
        xv = call["x"]
        pdt = check_dispatch_args(xv, call["probs"], plan.num_tokens, plan.topk, plan.num_experts, probs_dtype)
        pv = _slot_probs(call, call["probs"], plan, "probs", keep_f64=pdt == np.float64, checked=True)
        xv = call.contiguous(xv)
        if call.backend == "cpu":
            out, pp = _ref.dispatch(xv, plan._dict(), pv, probs_dtype=pdt)
        else:
            out, pp = _dispatch_cuda(call, xv, plan, pv, pdt)
        return call.out(out), (None if pp is None else call.out(pp))


def _dispatch_cuda(call, xv, plan, pv, pdt=None):
    N = plan.num_rows
    H, dt = int(xv.shape[1]), xv.dtype
    out = call.empty((N, H), dt)
    pp = None if pv is None else call.empty((N,), np.float32 if pdt is None else pdt)
    # the core moves float32 slot probs into float32/16 or bfloat16 rows (zero where no slot, all zero with no
    # slot at all); float64 ones are filled below
    core_pp = pp is not None and pp.dtype != np.float64
    _core.dispatch(_core.device(call.device_id), _core_plan(plan), xv.data.ptr, _CODES[dt], H,
                   pv.data.ptr if core_pp else 0, out.data.ptr, pp.data.ptr if core_pp else 0,
                   _CODES[pp.dtype] if core_pp else 0, call.stream_ptr)
    if pp is not None and not core_pp:
        _fill(call, None, pp, pv, plan)  # float64 permuted probs: this module's fill_rows
    return out, pp


def _fill(call, out, pp, pv, plan):
    """Zero the rows of ``out`` holding no slot; ``pp[row] = pv[src_slot[row]]`` (0 for those rows)."""
    N = plan.num_rows
    if N == 0:
        return
    row_bytes = int(out.shape[1]) * out.dtype.itemsize if out is not None else 0
    u = _unit(row_bytes, out.data.ptr) if out is not None else 16
    args = (out.data.ptr if out is not None and row_bytes else 0, pp if pp is not None else 0,
            pv if pv is not None else 0, plan._v["src_slot"], np.int64(N), np.int64(row_bytes // u), 0,
            np.int32(1))  # no x (fill_rows's plain form): its K is not read
    if args[0] == 0 and pp is None:  # nothing to zero (no row bytes) and no probs to write
        return
    po = _PROB_OUT.get(np.dtype(pp.dtype).name) if pp is not None else None
    name = f"fill_rows<{_UNITS[u]}>" if po is None else f"fill_rows<{_UNITS[u]}, {po[0]}, {po[1]}>"
    _launch(_fn(name, call.device_id), _row_grid(N, call.device_id), 256, args, call.stream)


def copy_kept_rows(src, out, keep, *, zero_rest: bool, device_id: int, stream) -> None:
    """``out[r] = src[r]`` for the rows with ``keep[r] >= 0`` (only those are read), zero for the others
    (left as they are unless ``zero_rest``). CuPy arrays on ``device_id``: ``src``/``out`` C-contiguous of
    one shape ``[..., H]`` and dtype, ``keep`` int32 with one entry per row; ``stream`` a CuPy stream."""
    row_bytes = int(src.shape[-1]) * src.dtype.itemsize if src.ndim else 0
    _core.copy_kept_rows(_core.device(device_id), src.data.ptr, out.data.ptr, keep.data.ptr, int(keep.size),
                         row_bytes, int(bool(zero_rest)), stream.ptr)


def combine(y_permuted, plan: Plan, probs=None, *, stream=None):
    """Weighted sum of each token's expert outputs: ``y[t] = sum_k w[t,k] * y_permuted[dst_row[t,k]]``.

    Records no autograd: use the op of the same name in ``moe_rt.torch`` / ``moe_rt.jax`` to differentiate
    (torch tensors that require grad, and JAX tracers, are refused with a TypeError).

    Args:
        y_permuted: ``[N,H]`` fp32/fp16/bf16, ``N == plan.num_rows``.
        plan: from :func:`make_plan` on the same device.
        probs: None (w = 1), ``[T,K]`` slot weights, or dense ``[T,E]``; any float dtype, used as fp32.
        stream: CUDA stream (None = the caller's current stream).

    Returns:
        ``y [T,H]`` in ``y_permuted.dtype``: fp32 accumulation in k-ascending order (dropped slots skipped),
        one rounding at the end; tokens with no route give zero rows. Bitwise reproducible.
    """
    with _arrays.Call({"y_permuted": y_permuted, "probs": probs}, stream=stream, lean=True) as call:
        _check_plan(plan, call)
        yv = call["y_permuted"]
        check_combine_args(yv, call["probs"], plan.num_tokens, plan.topk, plan.num_experts, plan.num_rows)
        pv = _slot_probs(call, call["probs"], plan, "probs", checked=True)
        yv = call.contiguous(yv)
        if call.backend == "cpu":
            return call.out(_ref.combine(yv, plan._dict(), pv))
        return call.out(_combine_cuda(call, yv, plan, pv))


def _combine_cuda(call, yv, plan, pv):
    T = plan.num_tokens
    H, dt = int(yv.shape[1]), yv.dtype
    out = call.empty((T, H), dt)
    _core.combine(_core.device(call.device_id), _core_plan(plan), yv.data.ptr, _CODES[dt], H,
                  0 if pv is None else pv.data.ptr, out.data.ptr, call.stream_ptr)
    return out


def dispatch_backward(grad_x_permuted, plan: Plan, grad_probs_permuted=None, *, stream=None):
    """VJP of :func:`dispatch`.

    Args:
        grad_x_permuted: ``[N,H]`` fp32/fp16/bf16.
        plan: the plan of the forward.
        grad_probs_permuted: None or ``[N]`` float (gradient of ``probs_permuted``).

    Returns:
        ``(grad_x [T,H], grad_probs [T,K] float32 or None)``: ``grad_x`` is the unweighted :func:`combine`
        of ``grad_x_permuted`` (fp32 sum, k ascending); ``grad_probs[t,k] = grad_probs_permuted[dst_row[t,k]]``,
        0 for dropped slots. The probs gradient is in slot layout ``[T,K]`` (for a routing-map plan that is
        the dense ``[T,E]``).
    """
    with _arrays.Call({"grad_x_permuted": grad_x_permuted, "grad_probs_permuted": grad_probs_permuted},
                      stream=stream, lean=True) as call:
        _check_plan(plan, call)
        g = call["grad_x_permuted"]
        gpp = call["grad_probs_permuted"]
        _check_dispatch_bwd_args(g, gpp, plan.num_tokens, plan.num_rows)
        if gpp is not None:
            gpp = call.contiguous(_as_dtype(gpp, _F32))
        g = call.contiguous(g)
        if call.backend == "cpu":
            gx, gp = _ref.dispatch_backward(g, plan._dict(), gpp)
        else:
            H, dt = int(g.shape[1]), g.dtype
            gx = call.empty((plan.num_tokens, H), dt)
            gp = None if gpp is None else call.empty((plan.num_tokens, plan.topk), np.float32)
            # with no rows (N = 0) every slot was dropped: the core writes its gradient 0
            _core.dispatch_backward(_core.device(call.device_id), _core_plan(plan), g.data.ptr,
                                    _CODES[dt], H, 0 if gp is None else gpp.data.ptr, gx.data.ptr,
                                    0 if gp is None else gp.data.ptr, call.stream_ptr)
        return call.out(gx), (None if gp is None else call.out(gp))


def combine_backward(grad_y, plan: Plan, y_permuted=None, probs=None, *, stream=None):
    """VJP of :func:`combine`.

    Args:
        grad_y: ``[T,H]`` fp32/fp16/bf16.
        plan: the plan of the forward.
        y_permuted: ``[N,H]``, same dtype as ``grad_y``: the forward's input (needed only with probs).
        probs: None, ``[T,K]`` or dense ``[T,E]`` weights of the forward.

    Returns:
        ``(grad_y_permuted [N,H] grad_y.dtype, grad_probs [T,K] float32 or None)``:
        ``grad_y_permuted[dst_row[t,k]] = w[t,k] * grad_y[t]`` (fp32 product, one rounding; rows holding
        no slot are zero) and ``grad_probs[t,k] = sum_h y_permuted[dst_row[t,k], h] * grad_y[t, h]`` (fp32,
        fixed order; 0 for dropped slots), in slot layout ``[T,K]``.
    """
    with _arrays.Call({"grad_y": grad_y, "y_permuted": y_permuted, "probs": probs}, stream=stream,
                      lean=True) as call:
        _check_plan(plan, call)
        g = call["grad_y"]
        yv = call["y_permuted"]
        _check_combine_bwd_args(g, call["probs"], yv, plan.num_tokens, plan.topk, plan.num_experts, plan.num_rows)
        pv = _slot_probs(call, call["probs"], plan, "probs", checked=True)
        if pv is not None:
            yv = call.contiguous(yv)
        g = call.contiguous(g)
        if call.backend == "cpu":
            gyp, gp = _ref.combine_backward(g, plan._dict(), yv, pv)
            return call.out(gyp), (None if gp is None else call.out(gp))
        T, K, N = plan.num_tokens, plan.topk, plan.num_rows
        H, dt = int(g.shape[1]), g.dtype
        gyp = call.empty((N, H), dt)
        gp = None if pv is None else call.empty((T, K), np.float32)
        weighted = gp is not None and gp.size > 0  # T*K = 0: no slot, nothing weighted
        _core.combine_backward(_core.device(call.device_id), _core_plan(plan), g.data.ptr, _CODES[dt],
                               H, yv.data.ptr if weighted else 0, pv.data.ptr if weighted else 0, gyp.data.ptr,
                               gp.data.ptr if weighted else 0, call.stream_ptr)
        return call.out(gyp), (None if gp is None else call.out(gp))


# -- chunk sort ------------------------------------------------------------------------------------------

def _is_host(a) -> bool:
    return isinstance(a, (list, tuple, np.ndarray, np.generic)) or not hasattr(a, "__dlpack__")


def host_chunk_array(a, name):
    """``split_sizes`` or ``sorted_indices`` given on the host (a sequence, a NumPy array): 1-D int32 NumPy,
    its values unchecked; None for an array of a framework (checked for dtype and shape with the call)."""
    if a is None:
        raise TypeError(f"{name}: expected a 1-D sequence of ints or an int32/int64 array, got None")
    if not _is_host(a):
        return None
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype.name}")
    return arr.astype(np.int32)


def _chunk_args(split_sizes, sorted_indices, n_rows):
    """Host-side split/order: validated, int32 NumPy. Device ones are validated for dtype/shape only."""
    s, o = host_chunk_array(split_sizes, "split_sizes"), host_chunk_array(sorted_indices, "sorted_indices")
    check_chunk_values(s, o, n_rows)
    return s, o


def check_chunk_values(s, o, n_rows):
    """The values of split sizes ``s`` and sorted indices ``o`` (1-D int NumPy arrays, either None): sizes >= 0
    summing to at most ``n_rows``, ``o`` a permutation of as many entries."""
    if s is not None:
        if s.size and s.min() < 0:
            raise ValueError(f"split_sizes: must be >= 0, got {s.tolist()[:16]}")
        if int(s.sum()) > n_rows:
            raise ValueError(f"split_sizes: sum {int(s.sum())} exceeds the {n_rows} rows of x")
    if o is not None and not np.array_equal(np.sort(o), np.arange(o.size)):
        raise ValueError(f"sorted_indices: expected a permutation of 0..{o.size - 1}, got {o.tolist()[:16]}")
    if s is not None and o is not None and s.size != o.size:
        raise ValueError(f"sorted_indices: expected {s.size} entries (one per chunk of split_sizes), got {o.size}")


CHUNK_DTYPES = _TOKEN_DTYPES + _BYTE_DTYPES + (np.dtype(np.float64),) + _arrays.INDEX_DTYPES  # sort_chunks' rows


def _sort_chunks(x, split_sizes, sorted_indices, probs, stream, bwd):
    xname, pname = ("grad_out", "grad_probs") if bwd else ("x", "probs")
    if not hasattr(x, "shape"):  # None, a list, ...
        raise _arrays.not_an_array(x, xname)
    hs, ho = _chunk_args(split_sizes, sorted_indices, int(x.shape[0]) if len(x.shape) else 0)
    arrays = {xname: x, pname: probs}
    if hs is None:
        arrays["split_sizes"] = split_sizes
    if ho is None:
        arrays["sorted_indices"] = sorted_indices
    with _arrays.Call(arrays, stream=stream, lean=True) as call:
        xp = call.xp
        xv = call[xname]
        if xv.ndim < 1:
            raise ValueError(f"{xname}: expected at least 1 dimension, got shape {tuple(xv.shape)}")
        _arrays.check_dtype(xv, xname, CHUNK_DTYPES)
        N = int(xv.shape[0])
        pv = call[pname]
        if pv is not None:
            _arrays.check_shape(pv, pname, (N,))
            _arrays.check_dtype(pv, pname, _PROB_DTYPES)
            pv = _arrays.contiguous(xp, pv.astype(np.float32, copy=False))
        dev = []
        for name, h in (("split_sizes", hs), ("sorted_indices", ho)):
            if h is not None:
                dev.append(h if call.backend == "cpu" else xp.asarray(h))
            else:
                a = call[name]
                _arrays.check_ndim(a, name, 1)
                _arrays.check_dtype(a, name, _arrays.INDEX_DTYPES)
                dev.append(a)
        s, o = dev
        if s.shape[0] != o.shape[0]:
            raise ValueError(f"sorted_indices: expected {s.shape[0]} entries (one per chunk of split_sizes), "
                             f"got {o.shape[0]}")
        xv = _arrays.contiguous(xp, xv)
        if call.backend == "cpu":
            if hs is None or ho is None:  # arrays of a framework, in host memory: checked as host ones are
                check_chunk_values(None if hs is not None else np.asarray(s), None if ho is not None else np.asarray(o),
                                   N)
            f = _ref.sort_chunks_backward if bwd else _ref.sort_chunks
            out, po = f(xv, np.asarray(s), np.asarray(o), pv)
        else:
            out, po = _sort_chunks_cuda(call, xv, s, o, pv, bwd)
        out = call.out(out)
        return out if probs is None else (out, call.out(po))


def _sort_chunks_cuda(call, xv, s, o, pv, bwd):
    xp = call.xp
    N = int(xv.shape[0])
    S = int(s.shape[0])
    if np.dtype(s.dtype) != np.dtype(o.dtype) or np.dtype(s.dtype) not in _CHUNK_INDEX:
        s, o = s.astype(np.int32), o.astype(np.int32)
    s, o = _arrays.contiguous(xp, s), _arrays.contiguous(xp, o)
    out = call.empty(xv.shape, xv.dtype)  # FP8 rows: a DevArray over uint8 memory (CuPy holds no FP8)
    po = None if pv is None else call.empty((N,), np.float32)
    if N == 0:
        return out, po
    row_bytes = (xv.size // N) * xv.dtype.itemsize
    nws = _core.sort_chunks_workspace_bytes(S)
    ws = call.scratch((max(nws, 1),), np.uint8)
    _core.sort_chunks(_core.device(call.device_id), xv.data.ptr, N, row_bytes, s.data.ptr if S else 0,
                      o.data.ptr if S else 0, _CODES[np.dtype(s.dtype)], S, 0 if pv is None else pv.data.ptr,
                      out.data.ptr, 0 if po is None else po.data.ptr, int(bwd), ws.data.ptr, nws, call.stream_ptr)
    return out, po


_CHUNK_INDEX = (np.dtype(np.int32), np.dtype(np.int64))  # the core's split_sizes / sorted_indices dtypes


def sort_chunks(x, split_sizes, sorted_indices, *, probs=None, stream=None):
    """Reorder chunks of rows (docs/permutation.md §1.7): the rows of ``x`` form ``S`` consecutive chunks
    of sizes ``split_sizes``; the output holds them in the order ``sorted_indices``. Rows at or beyond
    ``sum(split_sizes)`` stay in place.

    Args:
        x: ``[N, ...]`` any moe_rt dtype (moved as raw bytes).
        split_sizes: ``[S]`` int (list, NumPy, or an int32/int64 array on x's device).
        sorted_indices: ``[S]`` int, a permutation of ``0..S-1`` (same kinds).
        probs: optional ``[N]`` float, reordered with the rows (returned as float32).
        stream: CUDA stream (None = the caller's current stream).

    Host-side split sizes and indices are validated (sizes >= 0, sum <= N, a permutation); device-side
    ones cannot be without a sync: there, inconsistent values never write out of bounds, but the rows they
    affect are unspecified.

    Returns:
        ``out [N, ...]`` (x's dtype), or ``(out, probs_out)`` when ``probs`` is given.
    """
    return _sort_chunks(x, split_sizes, sorted_indices, probs, stream, bwd=False)


def sort_chunks_backward(grad_out, split_sizes, sorted_indices, *, grad_probs=None, stream=None):
    """VJP of :func:`sort_chunks` with the same ``split_sizes`` and ``sorted_indices`` (the inverse
    reordering): ``grad_x[i] = grad_out[dst(i)]``. Returns ``grad_x`` or ``(grad_x, grad_probs_x)``."""
    return _sort_chunks(grad_out, split_sizes, sorted_indices, grad_probs, stream, bwd=True)
