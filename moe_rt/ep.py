"""Expert parallelism, one process per GPU (docs/ep.md; docs/design.md).

``R`` ranks hold ``E`` experts, ``L = E / R`` each: expert ``e`` lives on rank ``e // L`` as local expert
``e % L``. Every rank has ``x [T,H]`` (``T <= max_tokens_per_rank``, ``T = 0`` allowed, ``T`` may differ
between ranks), ``topk_idx [T,K]`` (int32/int64, ``-1`` = no expert) and ``topk_weights [T,K]`` (fp32).

- :meth:`EpGroup.prepare` (a collective) computes the plan on the device, deterministically, and no rank
  sees another's whole routing: each rank lists, for each destination, the ascending tokens with at
  least one expert there (a token is sent **once** per destination rank, not K times) and gives each
  destination only its counts (tokens, local expert slots, per local expert) and, per token it sends, the
  token id, the local ids of its K experts there (``-1`` for the others) and each slot's rank among its
  expert's slots: on the direct transport the sources push these into the destinations' memory and one
  device barrier follows (capacity mode: all in one kernel), on NCCL they travel by grouped send/recv
  (nothing is all-gathered). The receiver lays
  its rows out source-major, token ascending; their local experts ``[rows, K]`` are a routing for the
  permutation plan with ``num_experts = L``, whose expert-major layout (grouped by local expert, ``(src,
  t)`` ascending inside an expert, padding rows zero) one kernel writes from the counts and ranks. The
  result is a :class:`moe_rt._handle.Handle`: one uint8 buffer laid out as in ``include/moe_rt/moe_rt.h``.
- :meth:`EpGroup.dispatch`: send each token's row once to every rank holding one of its experts (the own
  share is copied locally, never sent) and lay the received rows out expert-major.
- :meth:`EpGroup.combine`: each rank reduces the local expert rows of every received token (weighted by
  the received weights or not; fp32 accumulation; one rounding to ``y.dtype``), sends one row per
  (token, rank) back; the owner sums them over ranks in ascending rank order in fp32, rounding once.
- :meth:`EpGroup.dispatch_bwd` / :meth:`EpGroup.combine_bwd`: the transposes.
- ``dispatch(..., fp8=True)``: FP8 rows on the wire (quantized on the sending side, or a pre-quantized
  ``(x_fp8, scales)`` pair): each token's e4m3 codes and fp32 block scales packed into one row, one pass of
  the transport over them (with the same handle), whose expand step splits each row into the FP8 rows and
  scales, or with ``dequantize=True`` dequantizes it (docs/ep.md §9). The gradient path stays in the
  float dtype.

This module is the algorithm: validation, the plan and the handle, the CPU reference path, the choice of
transport. Each public op validates its arguments, then calls its transport once and returns the results.
Transports (``transport=``, ``MOE_RT_EP_TRANSPORT``; ``group.transport``) move the rows; each is a module
with one class offering the same small interface (a third transport is one more such module):

- ``forward(call, handle, x, w, op, *, expand=True, want_w=False, fp8=None, zero=True, tpe=None, scale=False)``: the
  dispatch direction (``dispatch``, ``combine_bwd``): the rows of ``x [T,H]`` (of any width) (and fp32 weights ``w
  [T,K]`` or None, received into the handle's ``recv_wk``) to the ranks of their experts. Returns ``(rows
  [N,H] expert-major, weights [N] or None)`` (padding rows zero, or not written at all with ``zero=False``:
  dispatch's ``zero_empty_slots``; weights zero there either way; ``weights[n] = recv_wk[src_slot[n]]``
  when ``want_w``), or with ``expand=False`` the received rows ``[rows,H]`` in the handle's layout
  (source-major).
  ``fp8`` (a :class:`moe_rt._ep_rows.Fp8Rows`): ``x`` holds an FP8 dispatch's packed rows and the expand
  writes them split into codes and scales, or dequantized (``rows`` is then the tuple of those outputs);
  ``tpe`` (dispatch): an int32 ``[L]`` output the handle's tokens_per_expert is copied into on the call's stream;
  ``scale`` (``combine_bwd`` with ``want_w``): the rows come back times their slots' weights (combine_bwd's
  weighted gradient without y), with weights None;
- ``reduce(call, handle, y, w, gw, op)``: the combine direction (``combine``: weights ``w [rows,K]`` or
  None; ``dispatch_bwd``: ``gw [N]`` or None, the gradient of the received weights, back to the slots).
  Returns ``(out [T,H], grad_w [T,K] fp32 or None)``;
- ``failed_op()`` (the op whose device-side wait gave up, or None) and ``close()`` (a collective where the
  transport holds shared buffers).

The transports give bitwise equal results:

- ``"nccl"`` (:mod:`moe_rt._ep_nccl`): pack the rows per destination, NCCL grouped send/recv, then the
  permutation family's kernels; the rows of a pair travel in up to ``chunks`` parts (one NCCL group per
  part), and a rank that sends at least 64 MiB of rows overlaps the transfer with its local expand or
  reduce on a second stream (``overlap=None``, the default, ``MOE_RT_EP_OVERLAP=auto``; ``True``/``False``
  always/never). The serial and overlapped paths send exactly the same groups, so each rank chooses on its
  own; results are bitwise identical. A 1-rank group on CUDA runs this path without an exchange
  (``group.transport`` is None).
- ``"direct"`` (:mod:`moe_rt._ep_direct`): peer memory within a node: after a device barrier, one kernel
  per op pushes each rank's rows chunk by chunk into every destination's IPC-mapped receive stage (row
  ``(src s, pos j)`` at ``s*P + j``), each chunk announced by an epoch flag, and expands the chunks it
  receives as they land (the own share straight from x); in the combine direction each received row's
  partial over the local experts goes straight into its owner's stage, and the owner sums its tokens over
  ranks in ep_owner_sum's order and rounding as their chunks land. Epochs advance on the device, so
  CUDA-graph replays stay valid; ``chunks`` and ``overlap`` do not apply.

- ``"mixed"`` (:mod:`moe_rt._ep_mixed`; picked by ``"auto"``, never named): a group spanning several nodes
  (``local_size``: ranks ``[n*local_size, (n+1)*local_size)`` form node n) moves rows to the ranks of its
  node through the direct transport (its barrier and fused kernels restricted to the node) and to the other
  nodes through NCCL, within the same op and into the same receive layout; the NCCL pass runs after the
  direct kernel (dispatch direction) or before it (combine direction), on the caller's stream.

``"auto"`` (the default) probes at group creation (host identity, PCI bus ids and peer access within each
node, all-gathered: a collective; ``local_size=None``, the default, or ``MOE_RT_EP_LOCAL_SIZE``, derives the
nodes from the hosts) and picks direct when the group is one node with peer access everywhere, mixed when it
spans several nodes with peer access within each, else nccl; ``"direct"`` raises ValueError at creation
otherwise. The direct transport makes its receive stage
for a row size on the first op that needs it (a collective with a host sync): run each op kind once before
CUDA-graph capture. ``close()`` the group on every rank. Row kernels that the group and both transports
share (zero rows, lay out and scale weights) live in :mod:`moe_rt._ep_rows`.

Modes:

- ``"exact"``: after the count exchange, ``prepare`` reads the counts on the host **once (a device
  sync)** and sizes every buffer exactly (with ``align_size > 1`` the expert-major row count is the
  permutation family's bound ``floor((slots + L*(A-1)) / A) * A``; rows past ``seg_start[L]`` are zero, or
  left unwritten with ``dispatch(..., zero_empty_slots=False)``, as in capacity mode).
- ``"capacity"``: fixed worst-case sizes: ``pair_capacity`` rows per (src, dst) pair (default
  ``max_tokens_per_rank``, which never overflows) and at most ``capacity`` expert slots per rank (default
  ``R * pair_capacity * min(K, L)``, which never overflows). No host sync past each op's first call (see
  Dead peers), so prepare, dispatch and combine can be captured in a CUDA graph. Tokens past a pair's
  capacity and slots past ``capacity`` (the last ones in expert-major order) are **dropped** and raise a
  device flag, read with
  :meth:`Handle.overflow` or :meth:`EpGroup.check_overflow` (those read the device: a sync). Dropped slots
  contribute nothing to combine and get zero gradients. Most of the ``capacity`` rows of a dispatch hold
  no slot: zero, or left unwritten with ``dispatch(..., zero_empty_slots=False)`` (docs/ep.md §4).

Expert ids outside ``[-1, E)`` are a ValueError (``topk_idx: expert ids must be in [-1, num_experts=E),
got V``) on every backend, raised later on CUDA: the CPU path raises in ``prepare``; on CUDA the routing
scan records the id in the device's error word and drops the slot (as ``-1``; nothing is written out of
bounds), and the error is raised at the next host-visible point: exact-mode ``prepare`` itself (at its count
read), :meth:`EpGroup.synchronize`, :meth:`EpGroup.check_overflow` or :func:`moe_rt.check`; in
capacity mode ``prepare`` raises only with ``validate=True`` or ``MOE_RT_DEBUG=1`` (a sync). In a group of
several ranks only the rank whose routing was bad raises (:mod:`moe_rt._errors`).

Dead peers: NCCL calls are asynchronous, so a missing rank shows up as a wait that never ends. Host-side
waits (exact mode's count read in ``prepare``; :meth:`EpGroup.synchronize`; :meth:`EpGroup.check_overflow`)
poll ``comm.async_error()`` and the stream until ``timeout`` seconds (default ``MOE_RT_EP_TIMEOUT`` or
300 s); then they ``abort()`` the communicator and raise ``TimeoutError`` naming the op (or the
``NcclError`` NCCL reported). The group is unusable afterwards. On the direct transport a barrier that
waits longer than ``timeout`` gives up on the device, writes the op into a host-mapped error word and
returns (later kernels of the transport do nothing); the host waits read that word and raise
``TimeoutError`` naming the op. CUDA loads a kernel on its first use, and loading waits until the device is
idle: behind an NCCL kernel waiting for a dead peer it would block the calling thread for good, before any
deadline. So on the NCCL and mixed transports the first call of each op kind (dtype, row width, flags,
overlap; ``prepare``: index dtype) waits, with the same deadline, for the work queued before it and for each
of its NCCL exchanges (:meth:`EpGroup._first_call`); later calls do not.

Streams: every op runs on the caller's current stream (``stream=None``) or the one given. The staging
buffers of an op come from CuPy's pool on that stream (on the direct transport a torch caller on torch's
current stream gets its results from torch's allocator: :meth:`EpGroup._lean`). Ops of one group must be
issued in the same order on every rank (they are collectives).

CPU: NumPy (or torch/JAX CPU) arrays work with a 1-rank group (``comm=None``) and run the NumPy oracle
:mod:`moe_rt.reference.ep`. A multi-rank group needs CUDA arrays (TypeError otherwise).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import time
import weakref

import numpy as np

from moe_rt import _arrays, _core, _errors, _jit, permutation
from moe_rt import _ep_adapt, _ep_direct, _ep_mixed, _ep_nccl, _ep_rows, _handle
from moe_rt import fp8 as _fp8
from moe_rt._ep_rows import FILE as _FILE, UNITS as _UNITS
from moe_rt._ep_rows import Fp8Rows, plan_view, recv_wk, regions
from moe_rt._arrays import DevArray
from moe_rt._handle import Handle, meta_index
from moe_rt.reference import ep as _ref
from moe_rt.reference import fp8 as _fp8_ref
from moe_rt.reference import permutation as _perm_ref

__all__ = ["EpGroup", "Handle", "DEFAULT_TIMEOUT"]

# The kernels of ep.cu that this module, moe_rt._ep_rows and moe_rt._ep_nccl launch (moe_rt._ep_direct
# registers its own).
_IDX = {"int32": "int", "int64": "long long"}
_names = [f"ep_prepare_{k}<{i}>" for k in ("send", "direct") for i in _IDX.values()]
_names += [f"ep_pack_rows<{u}>" for u in _UNITS.values()]
for _c in _jit.CTYPES.values():
    for _v in ("true", "false"):
        _names += [f"ep_owner_sum<{_c}, {_v}>", f"ep_scale_rows<{_c}, {_v}>"]
_names += [f"ep_expand_rows<{u}, 4>" for u in _UNITS.values()]
_names += [f"ep_expand_rows<uint4, 4, {k}>" for k in Fp8Rows.sink_names()]
_names += [f"ep_fill_rows<{u}>" for u in _UNITS.values()]
_names += ["ep_plan_meta", "ep_prepare_recv", "ep_prepare_plan", "ep_gather_slots", "ep_slot_values"]
_jit.register(_FILE, _names)

DEFAULT_TIMEOUT = 300.0
_SETUP_TIMEOUT = 120.0  # the least a group's creation waits for its peers
_TOKEN_DTYPES = tuple(d for d in _arrays.FLOAT_DTYPES if d is not None)
_WEIGHT_DTYPES = _TOKEN_DTYPES + (np.dtype(np.float64),)
_F32 = np.dtype(np.float32)
FP8_BLOCK = 128  # channels per fp32 scale of an FP8 dispatch
_FP8_ROW_DTYPES = (_arrays.FLOAT8_E4M3, np.dtype(np.uint8))
_BF16 = _arrays.BFLOAT16  # dequantized rows of a pre-quantized pair in a group without a dtype
_group_ids = itertools.count(1)
# Live groups by id: framework adapters carry only the id (an int) through traced code.
_live_groups: "weakref.WeakValueDictionary[int, EpGroup]" = weakref.WeakValueDictionary()
_INT32_MAX = 2**31 - 1
_CODES = _core.CODES  # NumPy dtype -> the core's dtype code

DEFAULT_CHUNKS = 2


def _env_number(name, default, conv, ok, expected):
    v = os.environ.get(name)
    if not v:
        return default
    try:
        n = conv(v)
    except ValueError:
        raise ValueError(f"{name}: expected {expected}, got {v!r}") from None
    if not ok(n):
        raise ValueError(f"{name}: expected {expected}, got {v!r}")
    return n


def _env_chunks() -> int:
    return _env_number("MOE_RT_EP_CHUNKS", DEFAULT_CHUNKS, int, lambda c: 1 <= c <= 64, "an integer in [1, 64]")


def _env_overlap():
    v = os.environ.get("MOE_RT_EP_OVERLAP", "auto") or "auto"
    if v not in ("0", "1", "auto"):
        raise ValueError(f"MOE_RT_EP_OVERLAP: expected 0, 1 or auto, got {v!r}")
    return None if v == "auto" else v == "1"


TRANSPORTS = ("auto", "direct", "nccl")


def _env_transport() -> str:
    v = os.environ.get("MOE_RT_EP_TRANSPORT", "auto") or "auto"
    if v not in TRANSPORTS:
        raise ValueError(f"MOE_RT_EP_TRANSPORT: expected auto, direct or nccl, got {v!r}")
    return v


def check_transport(transport, env):
    """A group's ``transport=``: None -> ``env()`` (its environment variable's value), else one of
    :data:`TRANSPORTS` (TypeError for another type, ValueError for another value)."""
    if transport is None:
        return env()
    if not isinstance(transport, str):
        raise TypeError(f"transport: expected a str ('auto', 'direct' or 'nccl'), got {type(transport).__name__}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected 'auto', 'direct' or 'nccl', got {transport!r}")
    return transport


def _env_local_size():
    """``MOE_RT_EP_LOCAL_SIZE``: ranks per node (an integer >= 1), or unset/empty: derived from the ranks' hosts."""
    return _env_number("MOE_RT_EP_LOCAL_SIZE", None, int, lambda n: n >= 1, "an integer >= 1")


def _env_timeout() -> float:
    return _env_number("MOE_RT_EP_TIMEOUT", DEFAULT_TIMEOUT, float, lambda t: t > 0, "seconds > 0")


def check_fp8_rows_holdable(call, codes, dequantize) -> None:
    """An FP8 dispatch whose rows come back as ``codes`` (float8_e4m3fn or uint8): CuPy cannot hold
    float8_e4m3fn, so a CuPy float ``x`` needs ``dequantize=True`` or a uint8 pair (TypeError)."""
    if (call.backend == "cuda" and not dequantize and codes != np.uint8
            and call.framework not in ("torch", "jax", "devarray")):
        raise TypeError(f"x: a {call.framework} array, and the FP8 rows would come back as float8_e4m3fn, "
                        "which CuPy cannot hold; pass torch or JAX arrays, a uint8 (x_fp8, scales) pair, "
                        "or dequantize=True")


class EpGroup:
    """An expert-parallel group over a communicator.

    Args:
        comm: a :class:`moe_rt.Communicator` of ``R`` ranks (one process per GPU; borrowed, never closed
            by the group), or None for a 1-rank local group (CPU reference or one GPU, no NCCL).
        num_experts: E, a multiple of R.
        hidden: H, the row width of ``x`` and ``y``.
        max_tokens_per_rank: Tmax, the most tokens any rank passes to ``prepare``.
        mode: ``"exact"`` (one host read of the counts in ``prepare``) or ``"capacity"`` (no host sync,
            CUDA-graph capturable, fixed sizes, overflow flagged and dropped).
        capacity: capacity mode: the most expert slots (received (token, local expert) pairs) a rank keeps;
            default ``R * pair_capacity * min(K, L)`` (never overflows).
        pair_capacity: capacity mode: rows per (src, dst) pair; default ``max_tokens_per_rank``.
        align_size: A >= 1; each local expert's rows are padded with zero rows to a multiple of A.
        dtype: None, or the token dtype every call must use (float32, float16, bfloat16).
        topk: None, or the K every ``prepare`` must use (else fixed by the first ``prepare``).
        timeout: seconds for host-side waits (and the direct transport's device barriers) before the
            communicator is aborted (default ``MOE_RT_EP_TIMEOUT`` or 300); the group's creation waits at
            least 120 s, since its first collectives also set up the connections.
        chunks: 1..64, how many parts each peer's rows travel in (default ``MOE_RT_EP_CHUNKS`` or 2); must
            be the same on every rank.
        overlap: None (default, or ``MOE_RT_EP_OVERLAP`` = ``auto``/``0``/``1``): overlap the NCCL transfer
            (on a second stream) with the local expand/reduce when this rank sends at least 64 MiB of rows;
            True/False: always/never. May differ between ranks (see the module notes). NCCL transport only.
        transport: ``"auto"`` (default, or ``MOE_RT_EP_TRANSPORT``), ``"direct"`` or ``"nccl"``: how rows
            move between ranks (``group.transport``; None for a 1-rank group). ``"direct"``: peer memory
            within a node (:mod:`moe_rt._ep_direct`); needs every pair of ranks on one node with peer
            access (ValueError at creation otherwise). ``"auto"`` picks direct when that holds, else nccl.
            Must be the same on every rank. ``"auto"`` with nodes > 1 (see ``local_size``) picks ``"mixed"``:
            peer memory within a node and NCCL between nodes (:mod:`moe_rt._ep_mixed`) when every pair of
            ranks within a node has peer access, else nccl; ``"direct"`` with nodes > 1 is a ValueError.
        local_size: ranks per node: ranks ``[n*local_size, (n+1)*local_size)`` form node ``n`` (an int that
            divides R; default ``MOE_RT_EP_LOCAL_SIZE`` (ignored by a 1-rank group), else derived at creation
            from the ranks' hosts: the ranks that share a host; ``group.local_size``, None when not probed
            (``transport="nccl"``)).
            ``local_size=1`` makes every peer remote (all NCCL through the mixed path), ``local_size=R`` one
            node (the direct transport): on one machine it simulates several nodes. The same on every rank.
    """

    def __init__(self, comm, num_experts: int, hidden: int, max_tokens_per_rank: int, *, mode: str = "exact",
                 capacity: int | None = None, pair_capacity: int | None = None, align_size: int = 1,
                 dtype=None, topk: int | None = None, timeout: float | None = None,
                 chunks: int | None = None, overlap: bool | None = None, transport: str | None = None,
                 local_size: int | None = None):
        (self.rank, self.size, self.device, self.num_experts, self.num_local_experts,
         self.hidden) = group_identity(comm, ("rank", "size", "device", "all_gather", "send", "recv", "group_start",
                                              "group_end"), num_experts, hidden)
        self.comm = comm
        R = self.size
        self.max_tokens_per_rank = _arrays.check_int(max_tokens_per_rank, "max_tokens_per_rank", low=1,
                                                     high=1 << 24)
        if mode not in ("exact", "capacity"):
            hint = " (the low-latency mode is moe_rt.LowLatencyGroup)" if mode == "low_latency" else ""
            raise ValueError(f"mode: expected 'exact' or 'capacity', got {mode!r}{hint}")
        self.mode = mode
        if mode == "exact" and (capacity is not None or pair_capacity is not None):
            raise ValueError("capacity/pair_capacity: only meaningful with mode='capacity'")
        self.pair_capacity = (self.max_tokens_per_rank if pair_capacity is None else
                              _arrays.check_int(pair_capacity, "pair_capacity", low=1,
                                                high=self.max_tokens_per_rank))
        self.capacity = None if capacity is None else _arrays.check_int(capacity, "capacity", low=0,
                                                                         high=_INT32_MAX)
        self.align_size = _arrays.check_int(align_size, "align_size", low=1, high=1 << 20)
        if dtype is not None:
            dt = np.dtype(dtype)
            if dt not in _TOKEN_DTYPES:
                raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dt.name}")
            dtype = dt
        self.dtype = dtype
        self.topk = None if topk is None else _arrays.check_int(topk, "topk", low=1, high=1024)
        if timeout is None:
            timeout = _env_timeout()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.chunks = _env_chunks() if chunks is None else _arrays.check_int(chunks, "chunks", low=1, high=64)
        if overlap is None:
            overlap = _env_overlap()
        else:
            _check_bool(overlap, "overlap")
            overlap = bool(overlap)
        self.overlap = overlap  # None: per call, by the size of the transfer
        if R * self.max_tokens_per_rank > _INT32_MAX:
            raise ValueError("R * max_tokens_per_rank must stay below 2^31")
        transport = check_transport(transport, _env_transport)
        if local_size is None:
            local_size = _env_local_size()
            if R == 1:  # a setting for the multi-rank groups of the process: a 1-rank group is one node
                local_size = None
        elif isinstance(local_size, (bool, np.bool_)) or not isinstance(local_size, (int, np.integer)):
            raise TypeError(f"local_size: expected an int (ranks per node) or None, got {type(local_size).__name__}")
        if local_size is not None:
            local_size = int(local_size)
            if local_size < 1 or R % local_size:
                raise ValueError(f"local_size: must divide the {R} ranks of the group (ranks per node), got {local_size}")
        self.local_size = 1 if R == 1 else local_size  # None: derived by the probe (transport="nccl": never)
        self.closed = False
        self._transport = None  # what moves the rows on CUDA: an NcclTransport, DirectTransport or MixedTransport
        self.transport = self._choose_transport(transport)
        self.id = next(_group_ids)
        _live_groups[self.id] = self
        self._last_stream = None
        self._last_device = self.device  # of the last prepare (a local group has no device of its own)
        self._prep_cfgs = {}  # (T, K, device, id dtype) -> prepare's set-up (_PrepCfg)
        self._gsync = {}  # (device, stream) -> grid_sync's words (prepare's send side)
        self._settled = set()  # keys of the ops whose first call waited for its NCCL exchanges (_first_call)
        self._valid = {}  # an op's array signature -> True: its checks passed (_arrays.validated / remember)
        self._fp8_rows = {}  # (dequantized dtype or None, codes dtype) -> the FP8 dispatch's Fp8Rows

    def _choose_transport(self, want):
        """Make the group's transport and return its name (None for one rank, whose CUDA ops run the NCCL
        transport's path without an exchange). A multi-rank group's choice is a collective unless ``want`` is
        'nccl': probe where every rank runs (host identity, PCI bus id, peer access within each node; two
        all-gathers), then set up the direct transport's shared buffers (over the node's ranks: "direct" when
        the group is one node, "mixed" when it spans several)."""
        R = self.size
        nccl = lambda: _ep_nccl.NcclTransport(self.comm, self.rank, R, self.device, self.hidden,  # noqa: E731
                                              self.chunks, self.overlap)
        if R == 1 or want == "nccl":
            self._transport = nccl()
            return None if R == 1 else "nccl"
        if want == "direct" and self.local_size is not None and self.local_size < R:
            raise ValueError(f"transport='direct': local_size={self.local_size} makes {R // self.local_size} nodes "
                             "and the direct transport needs one; use transport='auto' (peer memory within a node, "
                             "NCCL between nodes) or 'nccl'")
        # The group's first collectives also set up NCCL's connections (seconds): creation waits for its
        # peers at least _SETUP_TIMEOUT, whatever the (possibly short) timeout of the ops.
        setup = max(self.timeout, _SETUP_TIMEOUT)
        wait = _ep_direct.Wait(self, "__init__", setup)
        n, ok, reason = _ep_direct.probe_nodes(self.comm, self.device, wait, self.local_size)
        if n is not None:
            self.local_size = n
        if ok and want == "direct" and n < R:
            ok, reason = False, (f"the ranks are on different nodes ({R // n} nodes of {n} ranks), and the direct "
                                 "transport needs one")
        if not ok:
            if want == "direct":
                raise ValueError(f"transport='direct': {reason}; use transport='nccl' or 'auto'")
            self._transport = nccl()
            return "nccl"
        P = self.pair_capacity if self.mode == "capacity" else self.max_tokens_per_rank
        lo = self.rank // n * n
        direct = _ep_direct.DirectTransport(self.comm, self.device, P, self.timeout, wait,
                                            op_wait=lambda op: _ep_direct.Wait(self, op), node=(lo, lo + n))
        if n == R:
            self._transport = direct
            return "direct"
        self._transport = _ep_mixed.MixedTransport(direct, nccl())
        return "mixed"

    def __repr__(self):
        return (f"EpGroup(rank={self.rank}, size={self.size}, num_experts={self.num_experts}, "
                f"hidden={self.hidden}, max_tokens_per_rank={self.max_tokens_per_rank}, mode={self.mode!r}, "
                f"chunks={self.chunks}, overlap={self.overlap}, transport={self.transport!r}, "
                f"local_size={self.local_size})")

    def close(self):
        """Close the group (idempotent). Teardown order: the caller closes its handles first; the direct
        transport then waits for the device, runs one last barrier with the peers (a collective: every
        rank closes the group at the same point of its op sequence; bounded by the timeout), closes its IPC
        mappings of the peers' buffers and frees its own; the communicator is borrowed and stays open."""
        self.closed = True
        t, self._transport = self._transport, None
        if t is not None:
            t.close()

    # -- common checks ---------------------------------------------------------------------------------
    def _alive(self, op):
        if self.closed:
            raise ValueError(f"{op}: the EP group is closed")
        if self.comm is not None and getattr(self.comm, "closed", False):
            raise ValueError(f"{op}: the communicator is closed or was aborted")

    def _check_handle(self, handle, op):
        self._alive(op)
        if not isinstance(handle, Handle):
            raise TypeError(f"{op}: handle: expected a Handle from EpGroup.prepare, got {type(handle).__name__}")
        handle.check(self.id, op)

    def _check_call(self, call, op):
        if call.backend == "cpu":
            if self.size > 1:
                raise TypeError(f"{op}: a {self.size}-rank group needs CUDA arrays (CPU arrays run the "
                                "reference, which only simulates ranks in one process)")
        elif self.comm is not None and call.device_id != self.device:
            raise ValueError(f"{op}: arrays are on cuda:{call.device_id} but the communicator uses "
                             f"cuda:{self.device}")

    def _check_tokens(self, arr, name, rows, handle):
        self._check_rows(arr, name, rows, handle.state.get("dtype"))

    def _check_routing(self, idx):
        """``topk_idx``'s shape and dtype (anything with ``shape``, ``ndim``, ``dtype``): ``(T, K)``."""
        _arrays.check_ndim(idx, "topk_idx", 2)
        _arrays.check_dtype(idx, "topk_idx", _arrays.INDEX_DTYPES)
        T, K = int(idx.shape[0]), int(idx.shape[1])
        if K < 1:
            raise ValueError(f"topk_idx: K must be >= 1, got shape {tuple(idx.shape)}")
        if self.topk is not None and K != self.topk:
            raise ValueError(f"topk_idx: K must be {self.topk} (the group's topk), got {K}")
        if T > self.max_tokens_per_rank:
            raise ValueError(f"topk_idx: T={T} exceeds max_tokens_per_rank={self.max_tokens_per_rank}")
        return T, K

    def _check_rows(self, arr, name, rows, dtype=None):
        """``arr`` is ``[rows, hidden]`` of a token dtype: the group's, else ``dtype`` when given (anything
        with ``shape``, ``ndim``, ``dtype``: the JAX adapters check tracers with it)."""
        _arrays.check_ndim(arr, name, 2)
        _arrays.check_dtype(arr, name, _TOKEN_DTYPES)
        if tuple(arr.shape) != (rows, self.hidden):
            raise ValueError(f"{name}: expected shape {(rows, self.hidden)} ({rows} rows of hidden={self.hidden}), "
                             f"got {tuple(arr.shape)}")
        want = self.dtype or dtype
        if want is not None and np.dtype(arr.dtype) != want:
            raise TypeError(f"{name}: dtype must be {np.dtype(want).name} (as in dispatch / the group), "
                            f"got {np.dtype(arr.dtype).name}")

    # -- waits -----------------------------------------------------------------------------------------
    def _wait(self, stream, op, timeout=None):
        """Wait for ``stream`` with a deadline; abort the communicator and raise on failure."""
        import cupy

        timeout = self.timeout if timeout is None else float(timeout)
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        deadline = time.monotonic() + timeout
        delay = 1e-5
        while not ev.done:
            self._check_transport()
            if self.comm is not None:
                err = self.comm.async_error()
                if err is not None:
                    self.comm.abort()
                    raise err
            if time.monotonic() > deadline:
                self._check_transport()  # a barrier that timed out meanwhile names its op
                if self.comm is not None:
                    self.comm.abort()
                raise TimeoutError(_ep_direct.no_progress(self, op, timeout))
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)
        self._check_transport()

    def _check_transport(self):
        """Raise TimeoutError (after aborting the communicator) if a barrier of the direct transport timed
        out: its kernel wrote the op into the mapped error word and returned."""
        t = self._transport
        op = t.failed_op() if t is not None else None
        if op is None:
            return
        if self.comm is not None and not getattr(self.comm, "closed", False):
            self.comm.abort()
        raise TimeoutError(f"{type(self).__name__}.{op}: a peer rank did not reach the direct transport's barrier "
                           f"within {self.timeout:g} s (it is dead or did not call the same op); the group is "
                           "unusable and the communicator was aborted")

    def _first_call(self, op, key, stream):
        """A context for the transport work of an op's call. Loading a kernel waits until the device is idle
        (CUDA loads each kernel on its first use), so a kernel used for the first time behind an NCCL kernel
        that waits for a dead peer would block the calling thread for good, before any deadline. So the first
        call of each ``key`` (:meth:`_op_key`: what decides the kernels the call launches) on a group with
        NCCL exchanges waits, with the group's deadline (``_wait``: abort and TimeoutError naming ``op``),
        for the work already queued on ``stream`` when it starts and for each of its NCCL exchanges right
        after it is queued; later calls of the key wait for nothing. Nothing waits while ``stream`` is being
        captured into a CUDA graph (nothing runs then)."""
        t = self._transport
        nc = t if isinstance(t, _ep_nccl.NcclTransport) else getattr(t, "nccl", None)
        if nc is None or self.size == 1 or key in self._settled or _capturing(stream):
            return _NO_WAITS
        return _Settling(self, nc, op, key, stream)

    def _lean(self):
        """Whether an op's CUDA path takes DevArrays and allocates its results through ``Call.empty``
        (:class:`moe_rt._arrays.Call`'s ``lean``: a torch caller on torch's current stream passes its tensors'
        pointers as they are and gets torch tensors from torch's allocator back, no CuPy arrays and no DLPack
        either way): on the direct transport, whose ops read only pointers, shapes and dtypes of their
        arrays."""
        return self.transport == "direct"

    def _op_key(self, op, handle, rows, *flags):
        """What decides the kernels a call of ``op`` launches (:meth:`_first_call`): the op, the dtype, width
        and address alignment of its ``rows`` (a CuPy array), its ``flags`` and, on the NCCL transport,
        whether it overlaps the transfer; None (made at no cost) where the group has no NCCL exchange, whose
        calls wait for nothing."""
        t = self._transport
        if self.size == 1 or not (isinstance(t, _ep_nccl.NcclTransport) or getattr(t, "nccl", None) is not None):
            return None  # no NCCL exchange: _first_call waits for nothing
        rb = int(rows.shape[1]) * rows.dtype.itemsize
        ov = t._overlapped(handle, rb) if isinstance(t, _ep_nccl.NcclTransport) else None
        return (op, rows.dtype, rb, rows.data.ptr & 15, ov) + flags

    def synchronize(self, timeout: float | None = None, *, stream=None):
        """Wait until the work queued on ``stream`` (default: the stream of this group's last op) is done,
        at most ``timeout`` seconds (default: the group's); then abort and raise TimeoutError. Then raise
        the bad expert ids the device recorded (ValueError, as :func:`moe_rt.check`)."""
        self._alive("synchronize")
        if stream is None:
            stream = self._last_stream
        if stream is None:
            return
        dev = self.device if self.device is not None else (self._last_device or 0)
        s = _arrays.as_cupy_stream(stream, dev)
        self._wait(s, "synchronize", timeout)
        _errors.raise_pending(dev, s)

    def check_overflow(self, handle, *, stream=None):
        """Raise RuntimeError if ``handle`` dropped rows (capacity mode); reads the device (a sync, with the
        group's timeout), so it first raises the bad expert ids the device recorded (ValueError, as
        :func:`moe_rt.check`)."""
        self._check_handle(handle, "check_overflow")
        if handle.state.get("backend") == "cuda":
            self.synchronize(stream=stream)
        m = _meta_host(handle)
        R = self.size
        pair, expert = int(m[meta_index("pair_overflow", R)]), int(m[meta_index("expert_overflow", R)])
        if pair or expert:
            raise RuntimeError(
                f"EP capacity overflow on rank {self.rank}: "
                + ("a (src, dst) pair has more tokens than pair_capacity; " if pair else "")
                + (f"{int(m[meta_index('total_slots', R)])} expert slots arrived, capacity is "
                   f"{handle.sizes['capacity']}; " if expert else "")
                + "the excess rows were dropped")

    # -- prepare ---------------------------------------------------------------------------------------
    def prepare(self, topk_idx, *, stream=None, validate: bool | None = None) -> Handle:
        """Plan a dispatch (a collective: every rank calls it, in the same order).

        Args:
            topk_idx: ``[T,K]`` int32/int64, ``T <= max_tokens_per_rank``; ``-1`` = no expert. K must be
                the same on every rank.
            stream: CUDA stream (None = the caller's current stream).
            validate: None (follow ``MOE_RT_DEBUG`` / :func:`moe_rt.set_debug`) or a bool: on CUDA, raise
                a bad expert id in this call (capacity mode then waits for the stream, with the group's
                timeout; exact mode raises at its count read in any case).

        Returns:
            a :class:`Handle`. Exact mode reads the counts on the host (a device sync, with the group's
            timeout); capacity mode never syncs (unless ``validate``).

        Expert ids outside ``[-1, E)``: ValueError, at once on CPU and in exact mode; in capacity mode on
        CUDA at the next host-visible point (see the module notes).
        """
        self._alive("prepare")
        validate = _errors.resolve_validate(validate)
        with _arrays.Call({"topk_idx": topk_idx}, stream=stream, lean=self._lean()) as call:
            self._check_call(call, "prepare")
            idx = call["topk_idx"]
            T, K = self._check_routing(idx)
            self.topk = K
            if call.backend == "cpu":
                return self._prepare_cpu(np.asarray(idx), T, K)
            self._last_stream, self._last_device = call.stream, call.device_id
            with self._first_call("prepare", ("prepare", np.dtype(idx.dtype).str), call.stream):
                return self._prepare_cuda(call, idx, T, K, validate)

    def _sizes(self, T, K):
        R, L = self.size, self.num_local_experts
        P = self.pair_capacity if self.mode == "capacity" else self.max_tokens_per_rank
        cap = None
        if self.mode == "capacity":
            cap = self.capacity if self.capacity is not None else R * P * min(K, L)
        return dict(R=R, rank=self.rank, L=L, E=self.num_experts, Tmax=self.max_tokens_per_rank, K=K, P=P,
                    T=T, H=self.hidden, A=self.align_size, capacity=cap)

    def _prepare_cpu(self, idx, T, K):
        _errors.check_ids(idx, self.num_experts, "topk_idx")
        sz = self._sizes(T, K)
        if self.mode == "capacity":
            d = _ref.prepare([idx], self.num_experts, align_size=self.align_size, pair_capacity=sz["P"],
                             capacity=sz["capacity"])[0]
        else:
            d = _ref.prepare([idx], self.num_experts, align_size=self.align_size)[0]
        rows, N = d["num_recv_rows"], d["num_rows"]
        sz.update(rows=rows, N=N, num_out=d["total_slots"] if self.mode == "exact" else sz["capacity"])
        lay, total = _handle.layout(sz["R"], sz["L"], sz["Tmax"], K, sz["P"], rows, N)
        h = Handle(np.zeros(total, np.uint8), lay, self.id, self.mode, sz)
        _fill_from_reference(h, d)
        h.state.update(backend="cpu", ref=d, device_id=0)
        return h

    def _prep_cfg(self, T, K, dev, idx_dtype):
        """What prepare needs for (T, K) on device ``dev``, computed once in plain ints, and the core's
        signature of the call (cached, so a call's Python work does not grow with R): see
        :class:`_PrepCfg`."""
        key = (T, K, dev, idx_dtype)
        c = self._prep_cfgs.get(key)
        if c is None:
            if len(self._prep_cfgs) > 64:
                self._prep_cfgs.clear()
            c = self._prep_cfgs[key] = _PrepCfg(self, T, K, dev, idx_dtype)
        return c

    def _prepare_cuda(self, call, idx, T, K, validate=False):
        """Launches (the C core, csrc/ep_prepare.c: kernels, grids and shared memory planned there): capacity
        mode on the direct transport with the received side in one block's shared memory, one core call
        (ep_prepare_direct: send side, prepare's barrier with the peers, received side; kernels/ep.cu).
        Otherwise the send side (ep_prepare_send: routing into the handle, send lists, each destination's
        segment: counts and rows; direct: pushed into the destination's IPC-shared box); the exchange here
        (direct: ep_direct_barrier; NCCL: grouped send/recv of the segments, capacity mode whole, exact mode the
        counts, then after the host read the kept rows); exact mode: ep_plan_meta, the host read of the counts
        and a copy of the leading regions into the buffer sized from them; then the received side
        (ep_prepare_plan, or where its shared memory would not fit ep_prepare_recv and the permutation plan's
        three kernels). Capacity mode: two allocations (the handle, the scratch), no host sync."""
        xp, s, dev = call.xp, call.stream, call.device_id
        idx = _arrays.contiguous(xp, idx)
        c = self._prep_cfg(T, K, dev, idx.dtype)
        exact = self.mode == "exact"
        buf = xp.empty(c.total, np.uint8)
        # NCCL: the inbox and the outbox (R segments each); then the send side's chunk counts; then (capacity
        # mode, unfused) the plan kernels' scratch
        work = xp.empty(c.work_words, np.int32)
        w = work.data.ptr
        part = w + 4 * c.box_words
        gs = c.gs.get(s.ptr) if c.gs else None
        if gs is None:
            gs = c.gs[s.ptr] = self._grid_sync_words(dev, s)
        if c.box is None and self.transport == "direct":
            c.set_box(self._transport, K, s, _ep_direct.Wait(self, "prepare"))
        R, P, SEG = c.R, c.P, c.SEG
        direct = c.box is not None
        if direct:  # each destination's segment pushed into its box; this rank reads its own box
            state, peer, inbox = c.box
            outbox = 0
        else:
            state = peer = 0
            inbox = w
            outbox = inbox + 4 * R * SEG if R > 1 else 0
        ctx = _core.device(dev)
        ws = part + 4 * c.part_words
        bufs = (buf.data.ptr, idx.data.ptr, part, gs, c.err, state, peer, inbox, outbox, *c.bar, ws, c.ws_bytes)
        _core.ep_prepare(ctx, 0, c.desc, bufs, s.ptr)
        if c.whole or (validate and not exact):
            if validate:
                self._wait(s, "prepare")
                _errors.raise_pending(dev, s)
            if c.whole:
                return self._handle(buf, c.lay, c.sz, dev, None)
        if direct:
            self._transport.barrier(s, "prepare")
        elif R > 1:  # capacity mode: whole segments; exact mode: the counts now, the kept rows after the host read
            whole = c.full_segments if not exact else c.counts_only
            self._transport.exchange_box(s, outbox, inbox, whole, whole, SEG, 0)
        host, sz, lay, desc = None, c.sz, c.lay, c.desc
        if exact:
            _core.ep_prepare(ctx, 1, desc, bufs, s.ptr)
            host = self._read_meta(buf[lay["meta"][0]:lay["meta"][0] + 4 * lay["meta"][2]].view(np.int32), s, dev)
            rows = int(host[meta_index("recv_rows", R)])
            slots = int(host[meta_index("total_slots", R)])
            L, A = c.L, self.align_size
            N = _perm_ref.num_rows(rows, K, L, A, slots)
            _check_plan_rows(rows, K, N)
            fixed = lay["recv_local"][0]
            lay, total = _handle.layout(R, L, c.Tmax, K, P, rows, N)
            buf0, buf = buf, xp.empty(total, np.uint8)
            _ep_rows.copy_bytes(buf.data.ptr, buf0.data.ptr, fixed, s)
            sz = dict(sz, rows=rows, N=N, num_out=slots)
            if not direct and R > 1:
                sent = [min(int(v), P) * c.W for v in host[meta_index("send_counts", R):][:R]]
                got = [min(int(v), P) * c.W for v in host[meta_index("recv_counts", R):][:R]]
                self._transport.exchange_box(s, outbox, inbox, sent, got, SEG, c.CW)
            desc = desc[:12] + (rows, N, slots)
            ws_bytes = 0
            if not c.fused:  # the plan kernels' workspace (kept until the launches are queued)
                ws_bytes = _core.make_plan_workspace_bytes(rows, K, L)
                plan_ws = xp.empty(-(-ws_bytes // 4), np.int32)
                ws = plan_ws.data.ptr
            bufs = (buf.data.ptr, *bufs[1:12], ws, ws_bytes)
        _core.ep_prepare(ctx, 2, desc, bufs, s.ptr)
        return self._handle(buf, lay, sz, dev, host)

    def _grid_sync_words(self, dev, stream):
        """The address of the two uint32 words of grid_sync (kernels/ep.cu) for prepares of this group on
        ``stream`` of device ``dev``: one plain device allocation per group, device and stream (not from a
        memory pool, which a CUDA-graph user may free while the group lives; per stream, so that prepares of
        one group on two streams may run at once), zeroed on ``stream`` when made; each grid-wide barrier
        leaves them ready for the next. (A CUDA graph that holds a prepare uses the words of the stream it was
        captured on: replay it where no other prepare of the group runs on that stream at the same time.)"""
        key = (dev, stream.ptr)
        m = self._gsync.get(key)
        if m is None:
            import cupy

            m = self._gsync[key] = cupy.cuda.Memory(8)
            cupy.cuda.runtime.memsetAsync(m.ptr, 0, 8, stream.ptr)
        return m.ptr

    def _handle(self, buf, lay, sz, dev, host):
        h = Handle(buf, lay, self.id, self.mode, sz)
        h.state.update(backend="cuda", device_id=dev, host_meta=host)
        return h

    def _read_meta(self, meta, stream, device_id):
        """The documented host sync of exact mode: copy the meta region (and the device's error word, in
        the same wait) into pinned memory and wait with the group's deadline; then raise a bad expert id
        prepare's scan recorded."""
        import cupy

        n, nw = int(meta.size), _errors.WORDS
        pinned = cupy.cuda.alloc_pinned_memory((n + nw) * 4)
        host = np.frombuffer(pinned, np.int32, n + nw)
        rt = cupy.cuda.runtime
        rt.memcpyAsync(host.ctypes.data, meta.data.ptr, n * 4, rt.memcpyDeviceToHost, stream.ptr)
        rt.memcpyAsync(host.ctypes.data + n * 4, _errors.word(device_id), nw * 4, rt.memcpyDeviceToHost,
                       stream.ptr)
        self._wait(stream, "prepare")
        _errors.raise_word(host[n:].view(np.uint32).copy(), device_id, stream)
        return host[:n].copy()

    # -- ops -------------------------------------------------------------------------------------------
    def dispatch(self, handle, x, topk_weights=None, *, fp8: bool = False, dequantize: bool = False,
                 zero_empty_slots: bool = True, stream=None):
        """Send tokens to the ranks of their experts, in expert-major order (a collective).

        Args:
            handle: from :meth:`prepare` of this group.
            x: ``[T,H]`` fp32/fp16/bf16, T as in ``prepare``; or, with ``fp8=True``, a pre-quantized pair
                ``(x_fp8, scales)``: ``x_fp8 [T,H]`` float8_e4m3fn (torch, JAX or ml_dtypes) or uint8 (its
                e4m3 codes), ``scales [T, ceil(H/128)]`` fp32 (one dequantization multiplier per 128
                channels of each token, as :func:`moe_rt.quantize_fp8` returns). A pair without
                ``fp8=True`` is a TypeError (the return value depends on ``fp8``).
            topk_weights: None or ``[T,K]`` float (used as fp32).
            fp8: send FP8 rows (docs/fp8.md): a float ``x`` is quantized on the sending side
                (:func:`moe_rt.quantize_fp8`'s rule, bit for bit), and each row travels as its ``H`` e4m3
                bytes plus its ``ceil(H/128)`` fp32 scales, packed into one row (``H + 4*ceil(H/128)`` bytes
                padded to a multiple of 16, instead of ``2H`` for bf16): one pass of the transport.
            dequantize: with ``fp8=True``: return rows dequantized on the receiving side instead of the
                FP8 pair: in x's dtype for a float ``x``; for a pair, in the group's ``dtype`` (bfloat16
                when the group has none).
            zero_empty_slots: True (the default): the expert-major rows that hold no slot (each local
                expert's padding to ``align_size``, and every row past ``seg_start[L]``: in capacity mode
                most of the ``capacity`` rows) are written as zeros (zero codes and scales with ``fp8=True``,
                zero dequantized rows). False: they are left **unspecified**, not written at all (on CUDA the
                outputs are allocated uninitialized: those rows hold whatever the allocator's memory held,
                NaN or Inf bit patterns included); the filled rows (local expert ``l``'s first
                ``handle.view('expert_counts')[l]`` rows from ``seg_start[l]``; ``tokens_per_local_expert[l]``
                counts its padding too when ``align_size > 1``), the received weights (zero on the empty rows
                either way) and the counts are bitwise the same as with True. In capacity mode this saves
                writing ``(N - filled rows) * row bytes`` of HBM per dispatch (docs/ep.md §4).
                :meth:`combine` and :meth:`dispatch_bwd` read only the filled rows of their inputs, but an
                expert applied to every row gets garbage there: mask, or compute only over the filled rows,
                before anything sums over rows (a weight gradient over all rows would turn ``0 * NaN`` into
                NaN). The CPU path (the NumPy reference) writes zeros either way, which "unspecified"
                allows.
            stream: CUDA stream (None = the caller's current stream).

        Returns:
            - ``fp8=False``: ``(recv_x [N,H] x.dtype, recv_weights [N] float32 or None,
              tokens_per_local_expert [L] int32)``: rows grouped by local expert (segments
              ``handle.view('seg_start')``), padding and unused rows zero (unspecified with
              ``zero_empty_slots=False``). The received weights are also
              kept in the handle for ``combine(weighted=True)``.
            - ``fp8=True``: ``(recv_x_fp8 [N,H], recv_scales [N, ceil(H/128)] float32, recv_weights,
              tokens_per_local_expert)`` in the same layout, ready for an FP8 grouped GEMM:
              ``recv_x_fp8`` is float8_e4m3fn (torch, JAX, NumPy/ml_dtypes), or uint8 when the pair's
              ``x_fp8`` was uint8; padding rows have zero codes and zero scales (unspecified with
              ``zero_empty_slots=False``). A CuPy float ``x``
              cannot get FP8 rows back (CuPy holds no FP8): TypeError; pass uint8 codes or
              ``dequantize=True``.
            - ``fp8=True, dequantize=True``: ``(recv_x [N,H], recv_weights, tokens_per_local_expert)``
              with ``recv_x = dequantize_fp8(recv_x_fp8, recv_scales)``.

        The backward of an FP8 dispatch is the bf16 path: :meth:`dispatch_bwd` takes the gradient of the
        received rows in a float dtype (x's dtype for a float ``x``) and is the same combine-direction
        transpose as after an unquantized dispatch (gradients are never FP8).
        """
        self._check_handle(handle, "dispatch")
        if fp8 is not False or dequantize is not False:  # the defaults pass the checks
            _ep_adapt.check_fp8_flags(fp8, dequantize)
        if zero_empty_slots is not True:
            _check_bool(zero_empty_slots, "zero_empty_slots")
        zero = bool(zero_empty_slots)
        pair = isinstance(x, (tuple, list))
        if pair:
            _ep_adapt.check_pair_arity(x, fp8)
        if fp8:
            return self._dispatch_fp8(handle, x, topk_weights, pair, dequantize, zero, stream)
        with _arrays.Call({"x": x, "topk_weights": topk_weights}, stream=stream, lean=self._lean()) as call:
            self._check_call(call, "dispatch")
            _check_backend(handle, call, "dispatch")
            sz, st = handle.sizes, handle.state
            xv, wv = call["x"], call["topk_weights"]
            # the checks of x and the weights, once per signature (the same errors, in the same order)
            key = ("dispatch", sz["T"], sz["K"], st.get("dtype"), xv.shape, xv.dtype,
                   None if wv is None else (wv.shape, wv.dtype))
            if _arrays.validated(self._valid, key) is None:
                self._check_tokens(xv, "x", sz["T"], handle)
                if wv is not None:
                    check_weights(wv, "topk_weights", (sz["T"], sz["K"]))
                _arrays.remember(self._valid, key, True)
            wv = self._f32_weights(call, wv)
            if type(xv) is not DevArray:  # a DevArray is C-contiguous
                xv = _arrays.contiguous(call.xp, xv)
            st["dtype"] = np.dtype(xv.dtype)
            st["has_weights"] = wv is not None
            if call.backend == "cpu":  # zero rows either way (zero_empty_slots=False: unspecified allows it)
                rx, rw, tpe = _ref.dispatch([handle.state["ref"]], [xv], None if wv is None else [wv])[0]
                self._keep_ref_weights(handle, wv)
                return call.out(rx), (None if rw is None else call.out(rw)), call.out(tpe)
            key = self._op_key("dispatch", handle, xv, wv is not None, zero)
            # key None: no NCCL exchange, no waits (and the call's stream is not entered for CuPy: _arrays.Call)
            with self._first_call("dispatch", key, call.stream) if key is not None else _NO_WAITS:
                # tokens_per_expert: copied by the transport (the direct one: in the core call of the transfer)
                tpe = call.empty((sz["L"],), np.int32)
                rx, rw = self._transport.forward(call, handle, xv, wv, "dispatch", want_w=wv is not None, zero=zero,
                                                 tpe=tpe)
                self._last_stream = call.stream_ptr
            return call.out(rx), (None if rw is None else call.out(rw)), call.out(tpe)

    @staticmethod
    def _f32_weights(call, wv):
        """Checked weights (dispatch's ``topk_weights``, dispatch_bwd's ``grad_recv_w``) or None, as
        C-contiguous fp32 (a lean call's fp32 DevArray as it is)."""
        if wv is not None and (type(wv) is not DevArray or wv.dtype != _F32):
            wv = _arrays.contiguous(call.xp, wv.astype(np.float32, copy=False))
        return wv

    @staticmethod
    def _keep_ref_weights(handle, wv):
        if wv is not None:
            handle.view("recv_wk")[...] = handle.state["ref"]["recv_weights_slots"].reshape(-1)

    def check_fp8_pair(self, x_fp8, scales, rows):
        """An FP8 pair of ``rows`` tokens (anything with ``shape``, ``ndim``, ``dtype``: the adapters check
        tracers with it): ``x_fp8 [rows, hidden]`` float8_e4m3fn or uint8, ``scales [rows, ceil(hidden/128)]``
        float32. TypeError / ValueError naming the argument."""
        _arrays.check_ndim(x_fp8, "x_fp8", 2)
        dt = np.dtype(x_fp8.dtype)
        if dt not in _FP8_ROW_DTYPES:
            raise TypeError(f"x_fp8: expected float8_e4m3fn values or their uint8 codes, got dtype {dt.name}")
        if tuple(x_fp8.shape) != (rows, self.hidden):
            raise ValueError(f"x_fp8: expected shape {(rows, self.hidden)} ({rows} rows of hidden={self.hidden}), "
                             f"got {tuple(x_fp8.shape)}")
        _arrays.check_ndim(scales, "scales", 2)
        _arrays.check_dtype(scales, "scales", (np.dtype(np.float32),))
        S = _fp8_ref.num_blocks(self.hidden, FP8_BLOCK)
        if tuple(scales.shape) != (rows, S):
            raise ValueError(f"scales: expected shape [T, ceil(H/{FP8_BLOCK})] = {(rows, S)} (one fp32 scale per "
                             f"{FP8_BLOCK} channels of each token), got {tuple(scales.shape)}")

    def _dispatch_fp8(self, handle, x, topk_weights, pair, dequantize, zero, stream):
        """:meth:`dispatch` with ``fp8=True`` (checked flags): quantize a float x (or pack a pair) into packed
        rows of codes and scales on the sending side, one pass of the transport over them (with the weights),
        whose expand splits each row into the codes and scales, or dequantizes it when asked; ``zero``:
        zero_empty_slots."""
        arrays = {"x_fp8": x[0], "scales": x[1]} if pair else {"x": x}
        arrays["topk_weights"] = topk_weights
        # a float x on the direct transport: a lean call (torch tensors as DevArrays, results from torch's allocator)
        with _arrays.Call(arrays, stream=stream, lean=not pair and self._lean()) as call:
            self._check_call(call, "dispatch")
            _check_backend(handle, call, "dispatch")
            T, K, H = handle.sizes["T"], handle.sizes["K"], self.hidden
            wv = call["topk_weights"]
            wsig = None if wv is None else (wv.shape, wv.dtype)
            # the checks (x or the pair, then the weights), once per signature
            if pair:
                qv, sv = call["x_fp8"], call["scales"]
                key = ("dispatch_fp8 pair", T, K, qv.shape, qv.dtype, sv.shape, sv.dtype, wsig, call.framework,
                       dequantize)
                if _arrays.validated(self._valid, key) is None:
                    self.check_fp8_pair(qv, sv, T)
                    check_fp8_rows_holdable(call, np.dtype(qv.dtype), dequantize)
                    if wv is not None:
                        check_weights(wv, "topk_weights", (T, K))
                    _arrays.remember(self._valid, key, True)
                codes = np.dtype(qv.dtype)  # the rows come back in their own dtype
                out_dt = self.dtype or _BF16
            else:
                xv = call["x"]
                key = ("dispatch_fp8", T, K, handle.state.get("dtype"), xv.shape, xv.dtype, wsig, call.framework,
                       dequantize)
                if _arrays.validated(self._valid, key) is None:
                    self._check_tokens(xv, "x", T, handle)
                    check_fp8_rows_holdable(call, _arrays.FLOAT8_E4M3, dequantize)
                    if wv is not None:
                        check_weights(wv, "topk_weights", (T, K))
                    _arrays.remember(self._valid, key, True)
                codes = _arrays.FLOAT8_E4M3
                out_dt = np.dtype(xv.dtype)
            wv = self._f32_weights(call, wv)
            # the gradient path of an FP8 dispatch is the float one (dispatch_bwd, combine): in x's dtype
            handle.state["dtype"] = out_dt if not pair or dequantize else self.dtype
            handle.state["has_weights"] = wv is not None
            if call.backend == "cpu":  # zero rows either way (zero_empty_slots=False: unspecified allows it)
                if pair:
                    q = np.ascontiguousarray(call["x_fp8"])
                    sc = np.ascontiguousarray(call["scales"])
                else:
                    q, sc = _fp8_ref.quantize_fp8(np.ascontiguousarray(xv), FP8_BLOCK)
                rq, rs, rw, tpe = _ref.dispatch_fp8([handle.state["ref"]], [q], [sc],
                                                    None if wv is None else [wv])[0]
                self._keep_ref_weights(handle, wv)
                rw = None if rw is None else call.out(rw)
                if dequantize:
                    return call.out(_fp8_ref.dequantize_fp8(rq, rs, out_dt, FP8_BLOCK)), rw, call.out(tpe)
                return call.out(rq), call.out(rs), rw, call.out(tpe)
            # one pass of the transport over packed rows (codes, then scales; docs/ep.md §9), which its
            # expand splits into the codes and scales (or dequantizes) as it writes the expert-major rows
            rk = (out_dt if dequantize else None, codes)
            rows = self._fp8_rows.get(rk)
            if rows is None:
                rows = self._fp8_rows[rk] = Fp8Rows(H, rk[0], codes=codes)
            packed = call.empty((T, rows.row_bytes), np.uint8)
            if pair:
                q = call.xp.ascontiguousarray(_arrays.cupy_of(qv))  # FP8 on CUDA: its bytes as uint8
                sc = call.xp.ascontiguousarray(_arrays.cupy_of(sv))
            elif type(xv) is not DevArray:  # a DevArray is C-contiguous
                xv = _arrays.contiguous(call.xp, xv)
            key = self._op_key("dispatch_fp8", handle, packed, pair, codes, np.dtype(out_dt), dequantize,
                               wv is not None, None if pair else (xv.dtype, xv.data.ptr & 15), zero)
            # key None: no NCCL exchange, no waits; the quantize (or a pair's packing) goes through the C core on
            # the call's stream pointer (a light call makes no CuPy stream for it)
            with self._first_call("dispatch", key, call.stream) if key is not None else _NO_WAITS:
                if pair:
                    _fp8.launch_pack(q, sc, packed, FP8_BLOCK, call.device_id, call.stream_ptr)
                else:
                    _fp8.launch_quantize_packed(xv, packed, FP8_BLOCK, call.device_id, call.stream_ptr)
                tpe = call.empty((handle.sizes["L"],), np.int32)  # copied by the transport, as in dispatch
                out, rw = self._transport.forward(call, handle, packed, wv, "dispatch", want_w=wv is not None,
                                                  fp8=rows, zero=zero, tpe=tpe)
                self._last_stream = call.stream_ptr
                rw = None if rw is None else call.out(rw)
                if dequantize:
                    return call.out(out[0]), rw, call.out(tpe)
                rq, rs = out
                rq_out = rq if rq.dtype == codes else _arrays.fp8_array(rq, codes)  # uint8 memory: FP8 over it
                return call.out(rq_out), call.out(rs), rw, call.out(tpe)

    def combine(self, handle, y, *, weighted: bool = True, stream=None):
        """Sum each token's expert outputs back on its own rank (a collective).

        Args:
            handle: the handle of the dispatch.
            y: ``[N,H]`` expert outputs in ``recv_x``'s layout and dtype.
            weighted: multiply each row by its received routing weight (needs weights in dispatch).

        Returns:
            ``out [T,H]`` in y's dtype: per rank, an fp32 sum over its local experts rounded to y's dtype;
            then the owner's fp32 sum over ranks in ascending rank order, rounded once. Tokens with no
            expert get zero rows. Bitwise reproducible.
        """
        self._check_handle(handle, "combine")
        _check_bool(weighted, "weighted")
        with _arrays.Call({"y": y}, stream=stream, lean=self._lean()) as call:
            self._check_call(call, "combine")
            _check_backend(handle, call, "combine")
            yv = call["y"]
            key = ("combine", handle.sizes["N"], handle.state.get("dtype"), yv.shape, yv.dtype)
            if _arrays.validated(self._valid, key) is None:  # the checks of y, once per signature
                self._check_tokens(yv, "y", handle.sizes["N"], handle)
                _arrays.remember(self._valid, key, True)
            if weighted and not handle.state.get("has_weights"):
                raise ValueError("combine: weighted=True needs topk_weights in dispatch (or pass weighted=False)")
            if type(yv) is not DevArray:  # a DevArray is C-contiguous
                yv = _arrays.contiguous(call.xp, yv)
            if call.backend == "cpu":
                return call.out(_ref.combine([handle.state["ref"]], [yv], weighted=weighted)[0])
            # the received weights: the direct transport takes their address (no view to make per handle)
            pw = None if not weighted else regions(handle)["recv_wk"] if self.transport == "direct" else recv_wk(handle)
            key = self._op_key("combine", handle, yv, weighted)
            with self._first_call("combine", key, call.stream) if key is not None else _NO_WAITS:
                out, _ = self._transport.reduce(call, handle, yv, pw, None, "combine")
                self._last_stream = call.stream_ptr
            return call.out(out)

    def dispatch_bwd(self, handle, grad_recv_x, grad_recv_w=None, *, stream=None):
        """VJP of :meth:`dispatch` (a collective).

        Args:
            grad_recv_x: ``[N,H]`` float (gradient of ``recv_x``).
            grad_recv_w: None or ``[N]`` float (gradient of ``recv_weights``).

        Returns:
            ``(grad_x [T,H] grad_recv_x.dtype, grad_w [T,K] float32 or None)``; ``grad_x`` is computed like
            an unweighted combine; ``grad_w[t,k]`` is the gradient of the row slot ``(t,k)`` went to (0 for
            slots with no expert or dropped).
        """
        self._check_handle(handle, "dispatch_bwd")
        with _arrays.Call({"grad_recv_x": grad_recv_x, "grad_recv_w": grad_recv_w}, stream=stream,
                          lean=self._lean()) as call:
            self._check_call(call, "dispatch_bwd")
            _check_backend(handle, call, "dispatch_bwd")
            sz = handle.sizes
            g, gw = call["grad_recv_x"], call["grad_recv_w"]
            key = ("dispatch_bwd", sz["N"], handle.state.get("dtype"), g.shape, g.dtype,
                   None if gw is None else (gw.shape, gw.dtype))
            if _arrays.validated(self._valid, key) is None:  # the checks, once per signature (same order)
                self._check_tokens(g, "grad_recv_x", sz["N"], handle)
                if gw is not None:
                    check_weights(gw, "grad_recv_w", (sz["N"],))
                _arrays.remember(self._valid, key, True)
            gw = self._f32_weights(call, gw)
            if type(g) is not DevArray:  # a DevArray is C-contiguous
                g = _arrays.contiguous(call.xp, g)
            if call.backend == "cpu":
                gx, gwt = _ref.dispatch_bwd([handle.state["ref"]], [g], None if gw is None else [gw])[0]
                return call.out(gx), (None if gwt is None else call.out(gwt))
            key = self._op_key("dispatch_bwd", handle, g, gw is not None)
            with self._first_call("dispatch_bwd", key, call.stream) if key is not None else _NO_WAITS:
                out, gwt = self._transport.reduce(call, handle, g, None, gw, "dispatch_bwd")
                self._last_stream = call.stream_ptr
            return call.out(out), (None if gwt is None else call.out(gwt))

    def combine_bwd(self, handle, grad_out, y=None, *, weighted: bool = True, stream=None):
        """VJP of :meth:`combine` (a collective).

        Args:
            grad_out: ``[T,H]`` float (gradient of combine's ``out``).
            y: None or the forward's ``[N,H]`` input (needed for ``grad_recv_w``).
            weighted: as in the forward.

        Returns:
            ``(grad_y [N,H] grad_out.dtype, grad_recv_w [N] float32 or None)``: ``grad_y[n] = w[n] *
            grad_out[t]`` (fp32 product, one rounding; ``w = 1`` unweighted; padding rows zero);
            ``grad_recv_w[n] = sum_h y[n,h] * grad_out[t,h]`` (fp32), only when weighted and y is given.
        """
        self._check_handle(handle, "combine_bwd")
        _check_bool(weighted, "weighted")
        with _arrays.Call({"grad_out": grad_out, "y": y}, stream=stream, lean=self._lean()) as call:
            self._check_call(call, "combine_bwd")
            _check_backend(handle, call, "combine_bwd")
            sz = handle.sizes
            g, yv = call["grad_out"], call["y"]
            key = ("combine_bwd", sz["T"], sz["N"], handle.state.get("dtype"), g.shape, g.dtype,
                   None if yv is None else (yv.shape, yv.dtype))
            if _arrays.validated(self._valid, key) is None:  # the checks, once per signature (same order)
                self._check_tokens(g, "grad_out", sz["T"], handle)
                if yv is not None:
                    self._check_tokens(yv, "y", sz["N"], handle)
                    if np.dtype(yv.dtype) != np.dtype(g.dtype):
                        raise TypeError(f"y: dtype must match grad_out ({np.dtype(g.dtype).name}), got "
                                        f"{np.dtype(yv.dtype).name}")
                _arrays.remember(self._valid, key, True)
            if yv is not None and type(yv) is not DevArray:  # a DevArray is C-contiguous
                yv = _arrays.contiguous(call.xp, yv)
            if weighted and not handle.state.get("has_weights"):
                raise ValueError("combine_bwd: weighted=True needs topk_weights in dispatch")
            if type(g) is not DevArray:
                g = _arrays.contiguous(call.xp, g)
            if call.backend == "cpu":
                gy, gw = _ref.combine_bwd([handle.state["ref"]], [g], None if yv is None else [yv],
                                          weighted=weighted)[0]
                return call.out(gy), (None if gw is None else call.out(gw))
            key = self._op_key("combine_bwd", handle, g, weighted, yv is not None)
            with self._first_call("combine_bwd", key, call.stream) if key is not None else _NO_WAITS:
                if not weighted or yv is None:
                    # the dispatch direction into the expert-major rows (the weights are the forward's)
                    gy, _ = self._transport.forward(call, handle, g, None, "combine_bwd", want_w=weighted,
                                                    scale=weighted)
                    self._last_stream = call.stream_ptr
                    return call.out(gy), None
                # weighted with y: the received rows, then the permutation family's expert-side kernel
                recv_buf = self._transport.forward(call, handle, g, None, "combine_bwd", expand=False)
                self._last_stream = call.stream_ptr
                gy, gp = permutation.combine_backward(recv_buf, plan_view(handle), yv, recv_wk(handle),
                                                      stream=call.stream)
                N = sz["N"]
                gw = call.empty((N,), np.float32)
                # the slots' dots gathered to the expert-major rows (a core call on the call's stream)
                _core.ep_gather_slots(_core.device(call.device_id), gp.data.ptr, regions(handle)["src_slot"],
                                      gw.data.ptr, N, call.stream_ptr)
                return call.out(gy), call.out(gw)


# -- helpers ---------------------------------------------------------------------------------------------

_NO_WAITS = contextlib.nullcontext()


class _Settling:
    """EpGroup._first_call's waits for one call: on entry for the work queued on the stream, after each NCCL
    exchange of the call for that exchange (the NCCL transport's ``settle``); the key counts as settled once
    the call returned."""

    __slots__ = ("g", "nc", "op", "key", "stream")

    def __init__(self, g, nc, op, key, stream):
        self.g, self.nc, self.op, self.key, self.stream = g, nc, op, key, stream

    def __enter__(self):
        g, op = self.g, self.op
        g._wait(self.stream, op)
        self.nc.settle = lambda s: g._wait(s, op)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.nc.settle = None
        if exc_type is None:
            self.g._settled.add(self.key)
        return False


def _capturing(stream):
    """Whether ``stream`` (a CuPy stream) is being captured into a CUDA graph."""
    f = getattr(stream, "is_capturing", None)
    return bool(f()) if f is not None else False


def group_identity(comm, attrs, num_experts, hidden):
    """``(rank, size, device, E, L, H)`` of a group: its communicator's place (``(0, 1, None)`` for None, after
    checking that it has ``attrs`` (TypeError) and is open (ValueError)) and the checked expert count and row
    width."""
    if comm is None:
        rank, size, device = 0, 1, None
    else:
        for attr in attrs:
            if not hasattr(comm, attr):
                raise TypeError(f"comm: expected a moe_rt.Communicator (or None), got {type(comm).__name__}")
        if getattr(comm, "closed", False):
            raise ValueError("comm: the communicator is closed")
        rank, size, device = int(comm.rank), int(comm.size), int(comm.device)
    E = _arrays.check_int(num_experts, "num_experts", low=1, high=1 << 20)
    if E % size:
        raise ValueError(f"num_experts: {E} is not a multiple of the {size} ranks")
    return rank, size, device, E, E // size, _arrays.check_int(hidden, "hidden", low=1, high=1 << 24)


class _PrepCfg:
    """EpGroup.prepare's set-up for one (T, K, device, id dtype), in plain ints (made once, cached by the
    group): sizes, the handle layout and bytes (capacity mode: final; exact mode: of the regions before
    recv_local, which do not depend on the received rows), the box layout (kernels/ep.cu, prepare: a segment
    of SEG = CW + P*W words per source, counts (CW = L + 2) then rows (W = 2K + 1)), the scratch in int32
    words (NCCL: inbox and outbox; the send side's chunk counts; then, capacity mode, the plan kernels'
    workspace where the received side is not one kernel) and the core's signature of the call (``desc``,
    :func:`moe_rt._core.ep_prepare`). The core states the sizes that follow from the shapes (the send side's
    chunks, the segment, whether the received side is one kernel, whether prepare is one kernel) and plans
    the launches."""

    __slots__ = ("sz", "R", "L", "Tmax", "P", "CW", "W", "SEG", "lay", "total", "box_words", "part_words",
                 "work_words", "ws_bytes", "rows", "N", "TC", "B", "fused", "whole", "full_segments", "counts_only",
                 "desc", "err", "gs", "box", "bar")

    def __init__(self, g, T, K, dev, idx_dtype):
        sz = g._sizes(T, K)
        R, L, Tmax, P, A, me = sz["R"], sz["L"], sz["Tmax"], sz["P"], sz["A"], sz["rank"]
        self.R, self.L, self.Tmax, self.P = R, L, Tmax, P
        direct = g.transport == "direct"
        self.CW, self.W = L + 2, 2 * K + 1
        cap = -1
        rows = N = 0
        if g.mode == "capacity":
            cap = sz["capacity"]
            permutation.check_plan_settings(L, A, cap, "index")
            rows = R * P
            if cap > rows * K:  # make_plan's own check of num_out_tokens
                raise ValueError(f"num_out_tokens: must be <= T*K = {rows}*{K} = {rows * K} (the routed slots), "
                                 f"got {cap}")
            N = _perm_ref.num_rows(rows, K, L, A, cap)
            _check_plan_rows(rows, K, N)
            sz.update(rows=rows, N=N, num_out=cap)
        else:
            permutation.check_plan_settings(L, A, None, "index")
        self.rows, self.N = rows, N
        self.desc = (R, me, L, g.num_experts, Tmax, K, P, A, T, cap, _CODES[np.dtype(idx_dtype)], int(direct), rows,
                     N, 0)
        self.TC, self.B, self.part_words, self.SEG, self.fused, self.whole = _core.ep_prepare_sizes(self.desc)
        self.box_words = 0 if direct else R * self.SEG * (2 if R > 1 else 1)  # NCCL: inbox, outbox
        self.lay, self.total = _handle.layout(R, L, Tmax, K, P, rows, N)
        self.ws_bytes = 0
        if g.mode == "capacity" and not self.fused:
            self.ws_bytes = _core.make_plan_workspace_bytes(rows, K, L)
        self.work_words = max(self.box_words + self.part_words + -(-self.ws_bytes // 4), 1)
        self.sz = sz
        self.err = _errors.word(dev)
        self.full_segments, self.counts_only = [self.SEG] * R, [self.CW] * R
        self.box = None
        self.bar = (0, 0, 0)  # the direct transport's barrier: slot table, timeout (ns), timeout word
        self.gs = {}  # stream -> grid_sync's words (EpGroup._grid_sync_words)

    def set_box(self, t, K, stream, wait):
        """The direct transport ``t``'s box for top-``K`` routing (made on the first prepare with this K: a
        collective) as ``box = (state, box table, this rank's box)`` device addresses, and its barrier's."""
        st = t.prepare_box(K, self.R * self.SEG, stream, wait)
        self.box = (t.state.data.ptr, st.table.data.ptr, st.local)
        self.bar = (t.bar.table.data.ptr, int(t.timeout_ns), t._err_ptr)


def _check_plan_rows(rows, K, N):
    if N > _INT32_MAX or rows * K > _INT32_MAX:
        raise ValueError(f"the plan needs {N} expert-major rows / {rows}x{K} slots; must stay below 2^31")


_check_bool = _ep_adapt.check_bool


def check_weights(w, name, shape):
    """A weight array: float, ``shape`` (anything with ``shape``, ``ndim``, ``dtype``)."""
    _arrays.check_ndim(w, name, len(shape))
    _arrays.check_dtype(w, name, _WEIGHT_DTYPES)
    _arrays.check_shape(w, name, shape)


def _check_backend(handle, call, op):
    hb = handle.state.get("backend")
    if hb != call.backend or (hb == "cuda" and handle.state.get("device_id") != call.device_id):
        raise ValueError(f"{op}: the handle was made on {hb} but the arrays are on {call.backend}")


def _meta_host(h):
    m = h.view("meta")
    return m if isinstance(m, np.ndarray) else m.get()


def _fill_from_reference(h, d):
    """Write a reference plan (dict from moe_rt.reference.ep.prepare) into a CPU handle's regions."""
    sz = h.sizes
    R, me, Tmax, P = sz["R"], sz["rank"], sz["Tmax"], sz["P"]
    meta = h.view("meta")
    sc = d["send_counts"]
    rc = d["recv_counts"]
    meta[0:R] = sc
    meta[R:2 * R] = rc
    rl = d["recv_local"]
    for s in range(R):
        meta[2 * R + s] = int((rl[d["recv_src"] == s] >= 0).sum())
    kept = lambda c: c if P is None else min(c, P)  # noqa: E731
    so, o = [], 0
    for dd in range(R):
        so.append(o)
        if dd != me:
            o += kept(int(sc[dd])) if h.mode == "exact" else P
    so.append(o)
    meta[3 * R:4 * R + 1] = so
    meta[4 * R + 1:5 * R + 1] = d["recv_offsets"]
    meta[5 * R + 1] = d["num_recv_rows"]
    meta[meta_index("pair_overflow", R)] = int(d["pair_overflow"])
    meta[meta_index("expert_overflow", R)] = int(d["expert_overflow"])
    meta[meta_index("total_slots", R)] = d["total_slots"]
    meta[meta_index("num_tokens", R)] = d["num_tokens"]
    meta[meta_index("recv_rows", R)] = int((d["recv_tok"] >= 0).sum())
    meta[meta_index("send_rows", R)] = sum(kept(int(sc[x])) for x in range(R) if x != me)
    routing = h.view("routing")
    routing[...] = -1
    idx = d["topk_idx"]
    routing[:idx.size] = idx.reshape(-1)
    routing[-1] = idx.shape[0]
    send_tok = h.view("send_tok").reshape(R, P)
    send_tok[...] = -1
    send_pos = h.view("send_pos").reshape(R, Tmax)
    send_pos[...] = -1
    for dd in range(R):
        toks = d["send_tokens"][dd]
        send_tok[dd, :len(toks)] = toks
        send_pos[dd, toks] = np.arange(len(toks))
    recv_tok = h.view("recv_tok").reshape(R, P)
    recv_tok[...] = -1
    for s in range(R):
        sel = (d["recv_src"] == s) & (d["recv_tok"] >= 0)
        recv_tok[s, :int(sel.sum())] = d["recv_tok"][sel]
    plan = d["plan"]
    h.view("recv_local")[...] = rl.reshape(-1)
    h.view("dst_row")[...] = plan["dst_row"].reshape(-1)
    h.view("src_slot")[...] = plan["src_slot"]
    h.view("seg_start")[...] = plan["seg_start"]
    h.view("expert_counts")[...] = plan["counts"]
    h.view("tokens_per_expert")[...] = plan["tokens_per_expert"]
