"""The low-latency expert-parallel mode for decode and small batches (docs/ep.md §8; issue 32 item 1).

A separate small class, :class:`LowLatencyGroup`, rather than an ``EpGroup`` mode: its ops have other
signatures (no ``prepare``; ``dispatch`` takes the routing with the data and returns the handle) and other
layouts (fixed slots instead of the expert-major plan), so sharing ``EpGroup``'s methods would only add
branches to both.

Layout: ``R`` ranks, ``E`` experts, ``L = E / R`` per rank, ``Tmax = max_tokens_per_rank <= 1024``, ``K =
topk`` (fixed at creation). Token ``t`` of source rank ``s`` routed to local expert ``l`` of rank ``d``
lands in rank ``d``'s receive buffer ``recv_x [L, R*Tmax, H]`` at the fixed slot ``(l, s*Tmax + t)``: no
counting, no plan collective, and **no overflow by construction** (every possible (expert, source, token)
has its own row). A token that names an expert twice has one slot for it.

- :meth:`LowLatencyGroup.dispatch` ``(x [T,H], topk_idx [T,K], topk_weights [T,K])`` -> ``(recv_x [L,
  R*Tmax, H], counts [L] int32, handle)``: one device barrier (every rank finished its previous op, so no
  one still reads a buffer about to be written), then one kernel that pushes each token's row into the
  slots of every destination (peer memory, 16-byte stores) with its routing and weights, announces each
  chunk of tokens with one system-scope epoch flag per destination, and on the receiving side waits for
  every rank's chunks and writes the handle's slot tables. ``counts[l]`` = the valid slots of local expert
  ``l``; :attr:`LowLatencyHandle.slot_topk` ``[L, R*Tmax]`` int32 (the first k of the slot's token with that
  expert, ``-1`` = no token: the validity mask is ``slot_topk >= 0``), :attr:`LowLatencyHandle.slot_weights`
  ``[L, R*Tmax]`` fp32 (the token's weight for that expert). The source token of slot ``j`` is ``(j // Tmax,
  j % Tmax)``. Rows of slots with no token are **unspecified** (whatever the buffer held; zeroing them
  would cost more than the transfer): a grouped GEMM may compute every row (its rows are independent) and
  :meth:`combine` reads only valid slots; a user who needs zeros there masks with ``slot_topk >= 0``.
- Rows on the wire: with ``dedup`` (the default; ``dedup=False`` or ``MOE_RT_LL_DEDUP=0`` turns it off) a
  token's row crosses to each destination rank once, into the slot of its first (lowest k) expert there, and
  the receiving half of the kernel copies it locally (HBM) into the same column of the token's other local
  experts' blocks once the chunk flags say it landed (a token's K=8 of E=256 experts lie on about 2 ranks
  at R=2 and 3.6 at R=4): the same results bit for bit, fewer bytes on the peer links. Without it, one row
  per (token, distinct expert). ``combine_bwd`` without ``expert_out`` (rows scaled per expert) pushes per
  expert either way.
- ``recv_x`` is a view of the group's receive buffer, valid until the group's next dispatch-direction op
  (``dispatch`` or ``combine_bwd``): copy it to keep it (e.g. for the expert backward).
- The handle's tables (``counts``, ``slot_topk``, ``slot_weights`` and the routing combine reads) lie in one
  of the group's table sets (:class:`_TableSet`): a later dispatch on the same stream reuses a set only once
  nothing outside the group refers to it (no handle, none of its arrays or arrays derived from them), so they
  stay valid as long as they are kept; a dispatch captured in a CUDA graph writes its set at every replay:
  keep its handle (or one of its arrays) while the graph may replay.
- :meth:`LowLatencyGroup.combine` ``(handle, expert_out [L, R*Tmax, H])`` -> ``out [T,H]``: barrier, then
  one kernel: each expert rank pushes each valid slot's row into its token owner's back buffer, the owner
  sums ``w[t,k] * y`` over ``k`` ascending in fp32 (products and additions each rounded to fp32, as the
  NumPy reference does) and rounds once. With ``combine_partials=True`` (a group setting, the same on every
  rank) each expert rank instead pushes one row per (token, rank): its fp32 partial ``sum over the token's
  slots there (k ascending) of slot_weights * y``, rounded to the dtype; the owner sums the partials of the
  token's ranks, ranks ascending, in fp32 and rounds once (fewer rows on the wire: one per (token, rank)
  instead of per (token, expert)). The backward passes are the same either way.
- :meth:`LowLatencyGroup.dispatch_bwd` (the combine direction, unweighted, once per slot, plus the weight
  gradient gathered back to ``[T,K]``) and :meth:`LowLatencyGroup.combine_bwd` (the dispatch direction:
  ``grad_expert_out[slot] = slot_weight * grad_out[t]``, rounded once, **zero** at slots with no token so
  that an expert weight gradient summed over all rows is exact; with ``expert_out`` also ``grad_topk_weights
  [t,k] = <y[slot], grad_out[t]>``; its result is again a view of the receive buffer).

``dispatch(..., fp8=True)`` (a group made with ``fp8=True``, which holds FP8 receive buffers) sends FP8 rows:
a float ``x`` is quantized inside the push kernel (each token row read once; :func:`moe_rt.quantize_fp8`'s
rule, bit for bit), a pre-quantized ``(x_fp8, scales)`` pair is pushed as is; each slot receives ``H`` e4m3
codes and ``ceil(H/128)`` fp32 scales (``recv_x_fp8``, ``recv_scales``), or with ``dequantize=True`` the row
dequantized on the receiving side in the group's dtype. The handle, combine and both backwards are the float
ones (docs/ep.md §8).

``dispatch(..., return_recv_hook=True)`` splits the op: the call pushes and returns a ``hook`` that launches
the receive half later (so compute queued in between overlaps the transfer); with ``num_buffers=2`` two
micro-batches can be in flight, their dispatches alternating between two sets of the shared buffers.

Nothing reads the device on the host: the ops are CUDA-graph capturable and replay with new routing
(epoch flags advanced on the device). Every op takes ``stream=None`` (the caller's current stream). Dead
peers: a wait longer than ``timeout`` gives up on the device and records the op in a host-mapped word;
:meth:`LowLatencyGroup.synchronize` raises ``TimeoutError`` naming it (the group is then unusable).
Expert ids outside ``[-1, E)``: ValueError at once on CPU; on CUDA the kernel records them in the device's
error word (taken as -1) and :meth:`synchronize` / :func:`moe_rt.check` raises.

Transport (``transport=``, or ``MOE_RT_LL_TRANSPORT``; ``group.transport`` once the first CUDA op chose it):
``direct``, peer memory (:mod:`moe_rt._ep_direct`; every pair of ranks on one node with peer access, ValueError
at the first op otherwise); ``nccl``, NCCL collectives of fixed sizes between local kernels, for ranks without
peer access (other nodes): dispatch all-gathers every rank's token rows (or FP8 codes and scales) and routing
and each rank copies the rows of its own experts into their slots, combine and ``dispatch_bwd`` send each owner
a part of ``Tmax*K`` rows (``Tmax`` rows of rank partials with ``combine_partials``) by grouped send/recv and
the owner sums them, ``combine_bwd`` all-gathers ``grad_out``; the results are bitwise the direct transport's;
no device wait, so a dead peer shows as a host wait past the deadline (``synchronize``: TimeoutError, the
communicator aborted); ``auto`` (the default) takes ``direct`` where every pair allows it, else ``nccl``. The
same on every rank (the first op checks: a ValueError on every rank otherwise). Split hooks on the NCCL
transport: the push is the all-gather, on the caller's stream (work queued before the hook waits for it).
``LowLatencyGroup(None, ...)`` is a 1-rank group: CPU arrays run the NumPy reference
:mod:`moe_rt.reference.ep_ll`, CUDA arrays the kernels (``transport="nccl"``: the NCCL transport's, with no
exchange).
Memory per rank: ``(L*R*Tmax + Tmax*K) * H`` token elements (``Tmax*max(K, R)`` back rows with
``combine_partials``) plus small tables (bf16, E=256, R=4, Tmax=128,
H=7168: 470 MB, as DeepEP's low-latency buffer), per buffer set; ``fp8=True`` adds ``L*R*Tmax*(H +
4*ceil(H/128))`` bytes per set.
"""
from __future__ import annotations

import itertools
import math
import os
import sys

import numpy as np

from moe_rt import _arrays, _core, _ep_adapt, _ep_direct, _errors, _jit
from moe_rt import ep as _ep
from moe_rt.reference import ep_ll as _ref
from moe_rt.reference import fp8 as _fp8_ref

__all__ = ["LowLatencyGroup", "LowLatencyHandle", "MAX_TOKENS_PER_RANK"]

MAX_TOKENS_PER_RANK = _ref.MAX_TOKENS_PER_RANK
_FILE = "ep.cu"
_IDX = {"int32": "int", "int64": "long long"}
_names = []
for _c in _jit.CTYPES.values():
    for _v in ("true", "false"):
        _names += [f"ep_ll_dispatch<{_c}, {_i}, {_v}>" for _i in _IDX.values()]
        _names += [f"ep_ll_dispatch_fp8<{_c}, {_i}, {_v}>" for _i in _IDX.values()]
        _names += [f"ep_ll_combine<{_c}, {_v}, {_p}>" for _p in ("false", "true")]
        # the pairwise builds (MOE_RT_LL_SYNC=pairwise: no barrier launch before the op)
        _names += [f"ep_ll_dispatch_pairwise<{_c}, {_i}, {_v}>" for _i in _IDX.values()]
        _names += [f"ep_ll_dispatch_fp8_pairwise<{_c}, {_i}, {_v}>" for _i in _IDX.values()]
        _names += [f"ep_ll_combine_pairwise<{_c}, {_v}, {_p}>" for _p in ("false", "true")]
        _names += [f"ep_ll_slot_dot<{_c}, {_v}>"]
        # the NCCL transport's (LowLatencyGroup(transport="nccl"))
        _names += [f"ep_ll_nccl_pack<{_c}, {_i}, {_v}, {_f}>" for _i in _IDX.values() for _f in ("false", "true")]
        _names += [f"ep_ll_nccl_expand<{_c}, {_v}, {_m}>" for _m in range(4)]
        _names += [f"ep_ll_nccl_reduce<{_c}, {_v}, {_p}>" for _p in ("false", "true")]
        _names += [f"ep_ll_nccl_owner<{_c}, {_v}, {_m}>" for _m in range(3)]
_jit.register(_FILE, _names)
_ids = itertools.count(1)
_ALIGN = 256
FP8_BLOCK = _ref.FP8_BLOCK  # channels per FP8 scale


_PUSH, _RECEIVE = 1, 2  # ep_ll_dispatch's phases (MOE_RT_LL_PUSH, MOE_RT_LL_RECEIVE in moe_rt.h)
_OP = _ep_direct.OP_CODES  # moe_rt_ep_op codes


_TABLES = ("idx", "w", "route", "slot_k", "slot_w", "counts")  # ep_ll_dispatch's handle outputs, in order
_RETURNED = ("slot_k", "slot_w", "counts")  # the tables a dispatch hands out (its views made once per set)
_RING = 4  # table sets a group keeps for reuse per stream
_RING_STREAMS = 4  # streams a group keeps table sets for
_SAME = ("cupy", "devarray")  # callers' frameworks whose results _arrays.Call.out hands back as they are


# Groups a traced JAX program may name (moe_rt.jax ll_dispatch / ll_combine: their XLA calls carry the core
# group's address), kept alive here until closed: id -> LowLatencyGroup.
_adopted: dict = {}


def adopt(group) -> None:
    """Keep ``group`` alive until its :meth:`LowLatencyGroup.close` (moe_rt.jax's programs name it by id)."""
    _adopted[group.id] = group


def adopted(group_id: int):
    """The group of ``group_id`` that :func:`adopt` keeps; ValueError once it is closed."""
    group = _adopted.get(int(group_id))
    if group is None:
        raise ValueError(f"low-latency group {group_id} is closed (or was never used with moe_rt.jax); a program "
                         "that names it cannot run after LowLatencyGroup.close")
    return group


class _TableSet:
    """One allocation of a handle's device tables (``idx`` int32 and ``w`` fp32 ``[T,K]``, sized for Tmax
    tokens, ``route`` ``[R,Tmax,K]`` int32, ``slot_k`` int32 and ``slot_w`` fp32 ``[L,R*Tmax]``, ``counts`` ``[L]``
    int32; ``layout``: name -> (byte offset, bytes at Tmax, shape at Tmax, dtype)), with the table addresses
    and the CuPy views of the tables a dispatch returns made once.

    A group keeps up to _RING sets per stream and reuses one for a dispatch on the stream it was made on once
    nothing outside the group refers to it (:meth:`free`: no handle holds it, and no array over its memory
    lives, the returned views and anything derived from them or exported included), so a handle and its
    arrays stay valid as long as they live, after any later dispatch, as with one allocation per dispatch.
    The reuse follows the stream order of its stream, as CuPy's memory pool reuses freed memory."""

    __slots__ = ("base", "mem", "layout", "ptrs", "outs", "views", "stream", "_held", "_refs")

    def __init__(self, base, layout, stream):
        import cupy

        self.base, self.mem, self.layout, self.stream = base, base.data.mem, layout, stream
        p = base.data.ptr
        self.ptrs = {name: p + off for name, (off, *_) in layout.items()}
        self.outs = tuple(self.ptrs[n] for n in _TABLES)  # the six tables (moe_rt_ll_tables), in order
        self.views = {n: cupy.ndarray(layout[n][2], layout[n][3], base.data + layout[n][0]) for n in _RETURNED}
        self._held = self._refs = None

    def settle(self):
        """Record the counts of a set held by its group alone (called where :meth:`free` is)."""
        v = self.views
        # what tells whether anything outside the group holds this set, besides the set itself (a handle's
        # tables hold it) and its memory (every array and pointer over it holds that): the arrays and
        # pointers the set holds (one derived from them, or handed out, holds them)
        self._held = (self.base, self.base.data, v["slot_k"], v["slot_w"], v["counts"], v["slot_k"].data,
                      v["slot_w"].data, v["counts"].data)
        rc = sys.getrefcount
        self._refs = (rc(self), rc(self.mem), tuple(map(rc, self._held)))

    def free(self):
        rc, r = sys.getrefcount, self._refs
        if rc(self) != r[0] or rc(self.mem) != r[1]:  # a handle or an array over the set: the common case
            return False
        return tuple(map(rc, self._held)) == r[2]


class _Tables(dict):
    """A CUDA dispatch's handle tables: the first ``T`` tokens' part of a :class:`_TableSet` (which it holds,
    so that the set is not reused while the handle lives). :meth:`ptr` gives a table's address without making
    an array; ``tables[name]`` a CuPy view of it, made on first access."""

    def __init__(self, tset, T):
        super().__init__(tset.views)  # the returned tables' views, made once per set
        self.tset, self.T = tset, T

    def ptr(self, name):
        """The address of table ``name``; 0 for an empty one (T = 0), as an empty CuPy array's."""
        return 0 if not self.T and name in ("idx", "w") else self.tset.ptrs[name]

    def __missing__(self, name):
        import cupy

        ts = self.tset
        off, _, shape, dt = ts.layout[name]
        if name in ("idx", "w"):
            shape = (self.T, shape[1])
        v = self[name] = cupy.ndarray(shape, dt, ts.base.data + off)
        return v


class _Launch:
    """The stream and device of a launch outside an array call (a receive hook)."""

    def __init__(self, stream, device_id):
        self.stream, self.device_id = stream, device_id


class _Hook:
    """The receive half of ``dispatch(..., return_recv_hook=True)``: call it once (``hook(stream=None)``).
    ``keep``: None (the reference has received already) or ``keep(launch)`` queueing the receive launch (it
    holds the push's arrays alive until then)."""

    def __init__(self, group, handle, keep):
        self._group, self._handle, self._keep = group, handle, keep
        handle.received = False

    def __call__(self, stream=None):
        if self._handle.received:
            raise ValueError("receive hook: already called (each split dispatch receives once)")
        self._group._receive(self._handle, self._keep, stream)
        self._handle.received = True
        self._keep = None


def env_dedup() -> bool:
    """``MOE_RT_LL_DEDUP``: ``1`` (the default, also when unset or empty) or ``0`` (ValueError otherwise):
    whether a :class:`LowLatencyGroup` made with ``dedup=None`` pushes each token's row once per destination
    rank (module notes)."""
    v = os.environ.get("MOE_RT_LL_DEDUP", "")
    if v not in ("", "0", "1"):
        raise ValueError(f"MOE_RT_LL_DEDUP: expected 0 or 1, got {v!r}")
    return v != "0"


TRANSPORTS = _ep.TRANSPORTS
"""``LowLatencyGroup(transport=...)``'s values (EpGroup's): ``direct`` peer memory (every pair of ranks on one node with peer
access), ``nccl`` NCCL collectives of fixed sizes (any ranks), ``auto`` direct where every pair allows it, else
nccl (docs/ep.md §8)."""

SYNC_MODES = ("barrier", "pairwise")
"""``MOE_RT_LL_SYNC``'s values, in the order of the core group's desc.sync codes (0, 1)."""


def env_sync() -> str:
    """``MOE_RT_LL_SYNC``: ``pairwise`` (the default, also when unset or empty) or ``barrier`` (ValueError
    otherwise): how a :class:`LowLatencyGroup` made now keeps a rank from writing into a peer's buffers before
    the peer's earlier ops that read them are done. ``pairwise``: no barrier launch, the fused kernel announces
    its op to every peer and waits, per destination, for that destination's announce (docs/ep.md §8);
    ``barrier``: a device barrier over every rank before each op's fused kernel. The same on every rank."""
    v = os.environ.get("MOE_RT_LL_SYNC", "")
    if v == "":
        return "pairwise"
    if v not in SYNC_MODES:
        raise ValueError(f"MOE_RT_LL_SYNC: expected 'barrier' or 'pairwise', got {v!r}")
    return v


def wire_rows(topk_idx, num_experts: int, num_ranks: int, rank: int, *, dedup: bool = True) -> int:
    """The token rows rank ``rank``'s dispatch (bf16 or FP8 rows, not combine_bwd without ``expert_out``)
    pushes to the *other* ranks for the routing ``topk_idx [T,K]`` (ids in ``[-1, E)``): one per (token,
    distinct destination rank) with ``dedup``, else one per (token, distinct expert)."""
    idx = np.asarray(topk_idx).astype(np.int64)
    L = num_experts // num_ranks
    n = 0
    for row in idx:
        keys = {int(e) // L if dedup else int(e) for e in row if e >= 0 and int(e) // L != rank}
        n += len(keys)
    return n


def _check_agrees(name, values, how) -> None:
    """Every rank's setting ``name`` (all-gathered when the group sets up) must be the same: ValueError naming
    the ranks on each side otherwise (every rank sees the same values, so all raise alike)."""
    v = [bool(int(d)) for d in values]
    if len(set(v)) > 1:
        on = [r for r, d in enumerate(v) if d]
        off = [r for r, d in enumerate(v) if not d]
        raise ValueError(f"{name}: the ranks disagree (on at ranks {on}, off at ranks {off}); pass the same "
                         f"{how} on every rank")


def check_dedup_agrees(dedups) -> None:
    """Every rank's ``dedup`` setting must be the same: a receiver without the dedup split would not copy a
    sender's once-per-rank row into the token's other slots (they would keep stale rows)."""
    _check_agrees("dedup", dedups, "LowLatencyGroup(dedup=...) or MOE_RT_LL_DEDUP")


def check_combine_partials_agree(settings) -> None:
    """Every rank's ``combine_partials`` setting must be the same: an owner summing rank partials would read
    rows a per-expert sender never writes (and the back buffers' sizes differ)."""
    _check_agrees("combine_partials", settings, "LowLatencyGroup(combine_partials=...)")


def env_transport() -> str:
    """``MOE_RT_LL_TRANSPORT``: ``auto`` (the default, also when unset or empty), ``direct`` or ``nccl``
    (ValueError otherwise): the transport of a :class:`LowLatencyGroup` made with ``transport=None``."""
    v = os.environ.get("MOE_RT_LL_TRANSPORT", "") or "auto"
    if v not in TRANSPORTS:
        raise ValueError(f"MOE_RT_LL_TRANSPORT: expected auto, direct or nccl, got {v!r}")
    return v


def check_transport_agrees(codes) -> None:
    """Every rank must take the same transport: a rank pushing into peer memory and one waiting in an NCCL
    collective would never meet (transport='auto' decides alike everywhere; 'nccl' on some ranks only does not)."""
    v = [TRANSPORTS[int(c)] if 0 <= int(c) < len(TRANSPORTS) else str(int(c)) for c in codes]
    if len(set(v)) > 1:
        raise ValueError(f"transport: the ranks disagree ({', '.join(f'rank {r}: {m}' for r, m in enumerate(v))}); "
                         "pass the same LowLatencyGroup(transport=...) on every rank")


def check_sync_agrees(codes) -> None:
    """Every rank's ``MOE_RT_LL_SYNC`` must be the same: a pairwise rank announces into the barrier slots
    without waiting for every rank, so a barrier rank beside it would pass its barrier early (and a pairwise
    rank would wait for announces a barrier rank never makes per op)."""
    v = [SYNC_MODES[int(c)] if 0 <= int(c) < len(SYNC_MODES) else str(int(c)) for c in codes]
    if len(set(v)) > 1:
        raise ValueError(f"MOE_RT_LL_SYNC: the ranks disagree ({', '.join(f'rank {r}: {m}' for r, m in enumerate(v))}"
                         f"); set the same value on every rank")



def chunk_tokens(max_tokens_per_rank: int) -> int:
    """Tokens a flag covers, the same on every rank: at most 128 chunks per rank."""
    return max(1, -(-int(max_tokens_per_rank) // 128))


class _SelfComm:
    """The communicator of a 1-rank group on one GPU (the shared buffers' all-gather is a copy; the core's peer
    buffers take no communicator: ``handle`` 0)."""
    rank, size, handle = 0, 1, 0

    def __init__(self, device):
        self.device = device

    def all_gather(self, src, dst, n, dtype, stream):
        if src != dst:
            from cupy.cuda import runtime

            runtime.memcpyAsync(dst, src, n * np.dtype(dtype).itemsize, runtime.memcpyDeviceToDevice, stream)


class _NcclBuffers:
    """The NCCL transport's memory (one plain device allocation of this rank, zeroed once) and the transport
    interface the group's waits use: ``failed_op`` (NCCL reports its failures through the communicator) and
    ``close`` (waits for the group's last stream with its deadline, then frees)."""

    def __init__(self, group, nbytes, stream):
        import cupy

        self._group = group
        self.mem = cupy.cuda.memory.alloc(max(int(nbytes), 256))
        self.local = self.mem.ptr
        self.nbytes = int(nbytes)
        cupy.cuda.runtime.memsetAsync(self.local, 0, self.nbytes, stream.ptr)

    def failed_op(self):
        return None

    def close(self):
        g, self._group = self._group, None
        try:
            if g is not None and g._last_stream is not None and not getattr(g.comm, "closed", False):
                g._wait(g._last_stream, "close")  # no NCCL kernel may still write here
        finally:
            self.mem = None


class LowLatencyHandle:
    """The routing of one low-latency dispatch, kept for combine and both backwards (belongs to one
    in-flight micro-batch). ``slot_topk`` / ``slot_weights`` ``[L, R*Tmax]`` (this rank as expert holder),
    ``counts`` ``[L]``, ``num_tokens`` T; arrays in the dispatch caller's framework."""

    def __init__(self, group, T, K, backend, device_id, arrays):
        self.group_id, self.num_tokens, self.topk = group.id, int(T), int(K)
        self.backend, self.device_id = backend, device_id
        self._a = arrays  # idx [T,K] i32, w [T,K] f32, route [R,Tmax,K] i32, slot_k, slot_w, counts (or ref)
        self.slot_topk = self.slot_weights = self.counts = None
        self.buffer_set = 0  # the group's buffer set its rows went through
        self.received = True  # False between a split dispatch and its receive hook

    def _ptr(self, name):
        """The device address of the CUDA handle's table ``name`` (0 for an empty one): from the dispatch's one
        allocation, or from the arrays a framework adapter rebuilt the handle over."""
        a = self._a
        if type(a) is _Tables:
            return a.ptr(name)
        v = a[name]
        return v.data.ptr if v.size else 0

    def _tables(self):
        """The six table addresses the core takes (moe_rt_ll_tables, in _TABLES' order)."""
        a = self._a
        if type(a) is _Tables:
            return a.tset.outs
        return tuple(map(self._ptr, _TABLES))


class LowLatencyGroup:
    """A low-latency expert-parallel group (module notes).

    Args:
        comm: a :class:`moe_rt.Communicator` of R ranks (borrowed), or None for a 1-rank group.
        num_experts: E, a multiple of R.
        hidden: H.
        max_tokens_per_rank: Tmax in [1, 1024]: the most tokens a rank passes to ``dispatch``.
        topk: K in [1, 64], the same on every rank and call.
        dtype: token dtype of every call (float32, float16, bfloat16; default bfloat16).
        timeout: seconds a device wait gives up after (default ``MOE_RT_EP_TIMEOUT`` or 300).
        num_buffers: 1 or 2 sets of shared buffers (default 1). Dispatches alternate between the sets, so
            with 2 two micro-batches can be in flight at once (``dispatch(..., return_recv_hook=True)`` of
            one while the other computes); memory doubles.
        fp8: also make the FP8 receive buffers (per set: codes ``[L, R*Tmax, H]`` uint8 and scales ``[L,
            R*Tmax, ceil(H/128)]`` fp32, ``L*R*Tmax*(H + 4*ceil(H/128))`` bytes) that ``dispatch(...,
            fp8=True)`` needs (default False: a group without them keeps that memory).
        dedup: push each token's row once per destination rank (into the slot of its first expert there;
            the receiving kernel copies it to the token's other local experts' slots, in HBM) instead of once
            per expert (default None: ``MOE_RT_LL_DEDUP``, 1 unless set to 0). The results are the same bit
            for bit; only the bytes on the peer links change (module notes). The same on every rank (the
            first op's set-up checks: a ValueError otherwise).
        transport: ``"auto"`` (default None: ``MOE_RT_LL_TRANSPORT``, else auto), ``"direct"`` or ``"nccl"``
            (module notes): how rows move between the ranks; chosen at the first CUDA op (``group.transport``).
            The NCCL transport's memory per buffer set: the receive rows (and FP8 regions) plus every rank's
            gathered rows ``R*Tmax*H`` and routing, and ``2*R*Tmax*K*H`` elements of combine rows.
        combine_partials: combine pushes one row per (token, expert rank), the rank's fp32 partial sum of the
            token's slots weighted by ``handle.slot_weights`` and rounded to the dtype, and the owner sums the
            partials, ranks ascending (default False: one row per (token, expert), the owner's sum over k).
            Fewer rows on the wire; the result is rounded once more per rank (docs/ep.md §8). The back buffer
            grows to ``Tmax*max(K, R)`` rows. The same on every rank (checked as ``dedup``).

    A collective on several ranks (IPC buffers exchanged; a host sync, outside graph capture). ``close()``
    on every rank at the same point of its op sequence.
    """

    def __init__(self, comm, num_experts: int, hidden: int, max_tokens_per_rank: int, *, topk: int,
                 dtype="bfloat16", timeout: float | None = None, num_buffers: int = 1, fp8: bool = False,
                 dedup: bool | None = None, combine_partials: bool = False, transport: str | None = None):
        (self.rank, self.size, self.device, self.num_experts, self.num_local_experts,
         self.hidden) = _ep.group_identity(comm, ("rank", "size", "device", "all_gather"), num_experts, hidden)
        self.comm = comm
        R = self.size
        self.max_tokens_per_rank = _arrays.check_int(max_tokens_per_rank, "max_tokens_per_rank", low=1,
                                                     high=MAX_TOKENS_PER_RANK)
        self.topk = _arrays.check_int(topk, "topk", low=1, high=64)
        if isinstance(dtype, str) and dtype == "bfloat16":
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype!r}") from None
        if dt not in _ep._TOKEN_DTYPES:
            raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dt.name}")
        self.dtype = dt
        if timeout is None:
            timeout = _ep._env_timeout()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        if self.num_local_experts * R * self.max_tokens_per_rank * self.hidden >= 1 << 62:
            raise ValueError("the receive buffer [L, R*max_tokens_per_rank, hidden] is too large")
        self.num_buffers = _arrays.check_int(num_buffers, "num_buffers", low=1, high=2)
        _ep._check_bool(fp8, "fp8")
        self.fp8 = bool(fp8)
        if dedup is None:
            dedup = env_dedup()
        _ep._check_bool(dedup, "dedup")
        self.dedup = bool(dedup)
        _ep._check_bool(combine_partials, "combine_partials")
        self.combine_partials = bool(combine_partials)
        self.sync = env_sync()  # MOE_RT_LL_SYNC, read once here
        self._want = _ep.check_transport(transport, env_transport)
        # "direct" or "nccl" once the first CUDA op has set the group up (None before, and for CPU arrays)
        self.transport = None
        self._settled = set()  # the NCCL transport's op keys whose first call waited (_settle)
        self.num_scales = _fp8_ref.num_blocks(self.hidden, FP8_BLOCK)
        self.id = next(_ids)
        self.closed = False
        self._next_set = 0
        self._pending = [None] * self.num_buffers  # per set: the handle whose receive hook has not run
        self._transport = None
        self._buf = None
        self._last_stream = None
        self.chunk = chunk_tokens(self.max_tokens_per_rank)
        # host-side caches of the CUDA path (made on use, after _setup; docs/ep.md §8, host time): the handle
        # tables' layout and their sets per stream (_TableSet), the views of the shared buffers and the
        # received rows dispatch returns per (set, FP8 rows, codes dtype); the core group (moe_rt_ll_group:
        # the buffers' addresses, the launch plans per signature), made on the first op after _setup
        self._layout, self._rings = None, {}
        self._views, self._row_views = {}, {}
        self._llg = None
        self._slots = (self.num_local_experts, R * self.max_tokens_per_rank, self.hidden)  # [L, R*Tmax, H]
        self._checked = {}  # argument signatures (shapes, dtypes) that passed an op's checks

    # The host waits and the timeout report of EpGroup (they use comm, timeout and _transport alone).
    _wait = _ep.EpGroup._wait
    _check_transport = _ep.EpGroup._check_transport

    def __repr__(self):
        return (f"LowLatencyGroup(rank={self.rank}, size={self.size}, num_experts={self.num_experts}, "
                f"hidden={self.hidden}, max_tokens_per_rank={self.max_tokens_per_rank}, topk={self.topk}, "
                f"dtype={self.dtype.name}{', fp8=True' if self.fp8 else ''}{'' if self.dedup else ', dedup=False'}"
                f"{', combine_partials=True' if self.combine_partials else ''}"
                f"{', sync=barrier' if self.sync == 'barrier' else ''}"
                f"{', transport=' + repr(self.transport or self._want) if (self.transport or self._want) != 'auto' else ''})")

    # -- buffers ---------------------------------------------------------------------------------------
    def _regions(self):
        """((name, set), bytes) of the one IPC-shared allocation, in order (each at a 256-byte boundary)."""
        R, L, Tmax, K, H = self.size, self.num_local_experts, self.max_tokens_per_rank, self.topk, self.hidden
        isz = self.dtype.itemsize
        # back: [Tmax*K, H] (combine's rows per (token, expert), dispatch_bwd's), [Tmax*R, H] combine's rank
        # partials with combine_partials: the larger of the two then
        back = Tmax * (max(K, R) if self.combine_partials else K) * H * isz
        one = [("recv", L * R * Tmax * H * isz), ("route", R * (Tmax * K + 1) * 4), ("rw", R * Tmax * K * 4),
               ("back", back), ("bw", Tmax * K * 4)]
        if self.fp8:  # the FP8 rows of dispatch(..., fp8=True): e4m3 codes and their per-128 scales
            one += [("recv_q", L * R * Tmax * H), ("recv_s", L * R * Tmax * self.num_scales * 4)]
        return [((name, b), nb) for b in range(self.num_buffers) for name, nb in one]

    def _nccl_regions(self):
        """((name, set), bytes) of the NCCL transport's one allocation (this rank's own memory; moe_rt.h's
        moe_rt_ll_buffer_set): the receive rows (and FP8 regions), every rank's gathered rows and routing, the
        combine direction's rows and slot values, sent and received."""
        R, L, Tmax, K, H = self.size, self.num_local_experts, self.max_tokens_per_rank, self.topk, self.hidden
        isz, S = self.dtype.itemsize, self.num_scales
        one = [("recv", L * R * Tmax * H * isz), ("gather", R * Tmax * H * isz),
               ("gather_meta", R * (4 + 2 * Tmax * K) * 4), ("back_send", R * Tmax * K * H * isz),
               ("back", R * Tmax * K * H * isz), ("bw_send", R * Tmax * K * 4), ("bw", R * Tmax * K * 4)]
        if self.fp8:
            one += [("recv_q", L * R * Tmax * H), ("recv_s", L * R * Tmax * S * 4), ("gather_q", R * Tmax * H),
                    ("gather_s", R * Tmax * S * 4)]
        return [((name, b), nb) for b in range(self.num_buffers) for name, nb in one]

    def _setup(self, device_id):
        """The transport and the shared buffers, on this group's first CUDA op (a collective with a host
        sync: run one op before capturing a graph)."""
        import cupy
        from cupy.cuda import runtime

        if self._transport is not None:
            return
        if self.device is None:
            self.device = device_id
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            if runtime.streamIsCapturing(stream.ptr):
                raise RuntimeError("LowLatencyGroup makes its shared buffers on its first op (a collective with "
                                   "a host sync): run one op before CUDA-graph capture")
            setup = max(self.timeout, _ep._SETUP_TIMEOUT)
            wait = _ep_direct.Wait(self, "__init__", setup)
            comm = self.comm if self.comm is not None else _SelfComm(self.device)
            transport = "nccl" if self._want == "nccl" else "direct"
            if self.size > 1:
                # every rank probes (the same collectives whatever it asked for, so that ranks asking for
                # different transports meet in the agreement check below); the same answer on every rank
                ok, reason = _ep_direct.probe_peers(comm, self.device, wait)
                if not ok and self._want == "direct":
                    raise ValueError(f"LowLatencyGroup(transport='direct') needs every pair of ranks on one node "
                                     f"with peer access: {reason}; use transport='auto' or 'nccl'")
                transport = "direct" if ok and self._want != "nccl" else "nccl"
                agree = _ep_direct.all_gather_int64(
                    comm, [int(self.dedup), int(self.combine_partials), SYNC_MODES.index(self.sync),
                           TRANSPORTS.index(transport)], stream, wait)
                check_dedup_agrees(agree[:, 0])
                check_combine_partials_agree(agree[:, 1])
                check_sync_agrees(agree[:, 2])
                check_transport_agrees(agree[:, 3])
            if transport == "nccl":
                self._setup_nccl(stream)
                return
            # flags [num_buffers, 2, R, Tmax]: the transport's chunk flags with a pair capacity of
            # 2*Tmax*num_buffers
            d = _ep_direct.DirectTransport(comm, self.device, 2 * self.max_tokens_per_rank * self.num_buffers,
                                           self.timeout, wait)
            try:
                offs, o = {}, 0
                for name, nb in self._regions():
                    offs[name] = (o, nb)
                    o += -(-nb // _ALIGN) * _ALIGN
                # zeroed once: the rows of slots no token has written yet read as zeros
                sh = _ep_direct._Shared(comm, o, stream, wait, zero=True)
                d._stages[("low_latency", 0)] = sh  # closed with the transport
                d._order.append(("low_latency", 0))
                with stream:  # each region's peer table (device int64 [R]), kept; the core takes addresses
                    self._table_arrays = {n: sh.table + off for n, (off, _) in offs.items()}
                    self._tables = {n: a.data.ptr for n, a in self._table_arrays.items()}
                    # each set's split push epoch, then the pairwise ops' block count (desc.set_epoch)
                    self._set_epoch = cupy.zeros(self.num_buffers + 1, np.uint32)
            except BaseException:
                d.close()
                raise
            self._adopt(d, sh, offs)
            self.transport = "direct"

    def _setup_nccl(self, stream):
        """The NCCL transport's buffers: one plain allocation of this rank (no IPC), zeroed once."""
        offs, o = {}, 0
        for name, nb in self._nccl_regions():
            offs[name] = (o, nb)
            o += -(-nb // _ALIGN) * _ALIGN
        buf = _NcclBuffers(self, o, stream)
        self._adopt(buf, buf, offs)
        self.transport = "nccl"

    def _adopt(self, transport, shared, offs):
        """Take the transport, the shared buffers and their regions' offsets (the end of _setup)."""
        self._transport, self._buf, self._offs = transport, shared, offs
        # the 16-byte vector paths' conditions that hold for every call (rows of a multiple of 16 bytes, the
        # shared buffers 16-byte aligned); a launch adds its arrays' alignment
        self._vec16 = (self.hidden * self.dtype.itemsize) % 16 == 0 and shared.local % 16 == 0
        self._vec16_fp8 = self.hidden % 16 == 0 and shared.local % 16 == 0

    def _view(self, name, b, shape, dtype):
        """A CuPy view of region ``name`` of buffer set ``b`` (made once per (region, set, shape, dtype): the
        shared buffers stay where they are until close)."""
        key = (name, b, shape, dtype)
        v = self._views.get(key)
        if v is None:
            import cupy

            off, nb = self._offs[(name, b)]
            mem = cupy.cuda.UnownedMemory(self._buf.local + off, max(nb, 1), self._transport, self.device)
            v = self._views[key] = cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))
        return v

    # close() (a collective on several ranks: one last barrier, then the IPC mappings are closed and the
    # buffers freed; the communicator stays open) and the closed-group check: EpGroup's.
    _alive = _ep.EpGroup._alive

    def close(self):
        """EpGroup.close (module notes), after the core group is freed (a JAX program naming it fails from then
        on: the core's registry no longer lists it) and moe_rt.jax's hold on the group is dropped."""
        _adopted.pop(self.id, None)
        g, self._llg = self._llg, None
        if g is not None:
            g.destroy()
        _ep.EpGroup.close(self)

    def _core_group(self):
        """The core's group over the shared buffers (moe_rt_ll_group: their addresses, the sizes; it plans and
        launches every CUDA op), made once after _setup."""
        g = self._llg
        if g is None:
            if self.transport == "nccl":
                g = self._llg = self._nccl_core_group()
                return g
            d, t, R = self._transport, self._tables, self.size
            sets = [(self._buf.local + self._offs[("recv", b)][0], t[("recv", b)], t.get(("recv_q", b), 0),
                     t.get(("recv_s", b), 0), t[("route", b)], t[("rw", b)], t[("back", b)], t[("bw", b)])
                    for b in range(self.num_buffers)]
            g = self._llg = _core.ll_group_create(
                _core.device(self.device), R, self.rank, self.num_local_experts, self.max_tokens_per_rank,
                self.topk, _core.CODES[self.dtype], self.hidden, self.chunk, self.num_buffers, int(self.fp8),
                self.num_scales, int(self.dedup), d.timeout_ns, sets, d.flags.table.data.ptr, d.bar.table.data.ptr,
                d.state.data.ptr, d._err_ptr, _errors.word(self.device), self._set_epoch.data.ptr,
                combine_partials=int(self.combine_partials), sync=SYNC_MODES.index(self.sync))
        return g

    def _nccl_core_group(self):
        """The core group of the NCCL transport: its regions' addresses and the communicator (moe_rt.h)."""
        base = self._buf.local

        def at(name, b):
            got = self._offs.get((name, b))
            return base + got[0] if got is not None else 0

        sets = [(at("recv", b), 0, 0, 0, 0, 0, 0, 0) for b in range(self.num_buffers)]
        nccl_sets = [tuple(at(n, b) for n in ("recv_q", "recv_s", "gather", "gather_meta", "gather_q", "gather_s",
                                               "back_send", "back", "bw_send", "bw"))
                     for b in range(self.num_buffers)]
        return _core.ll_group_create(
            _core.device(self.device), self.size, self.rank, self.num_local_experts, self.max_tokens_per_rank,
            self.topk, _core.CODES[self.dtype], self.hidden, self.chunk, self.num_buffers, int(self.fp8),
            self.num_scales, int(self.dedup), int(self.timeout * 1e9), sets, 0, 0, 0, 0, _errors.word(self.device), 0,
            combine_partials=int(self.combine_partials), sync=SYNC_MODES.index(self.sync), transport=1,
            comm=self.comm.handle if self.comm is not None else 0, nccl_sets=nccl_sets)

    def synchronize(self, timeout: float | None = None, *, stream=None):
        """Wait for ``stream`` (default: the last op's) with the group's deadline; raise TimeoutError for a
        device wait that gave up (naming its op), then the bad expert ids the device recorded."""
        self._alive("synchronize")
        s = self._last_stream if stream is None else _arrays.as_cupy_stream(stream, self.device or 0)
        if s is None:
            return
        self._wait(s, "synchronize", timeout)
        _errors.raise_pending(self.device, s)

    # -- checks ----------------------------------------------------------------------------------------
    def _check_fp8(self, fp8):
        if fp8 and not self.fp8:
            raise ValueError("fp8: this group has no FP8 receive buffers; create it with "
                             "LowLatencyGroup(..., fp8=True)")

    def _call_checks(self, call, op):
        if call.backend == "cpu":
            if self.size > 1:
                raise TypeError(f"{op}: a {self.size}-rank group needs CUDA arrays")
        elif self.device is not None and call.device_id != self.device:
            raise ValueError(f"{op}: arrays are on cuda:{call.device_id} but the group uses cuda:{self.device}")

    def _check_tokens(self, arr, name, shape):
        try:
            key = (name, shape, arr.shape, arr.dtype)
            if key in self._checked:  # this signature passed before
                return
        except (AttributeError, TypeError):  # not an array (or an unhashable one): the checks below say so
            key = None
        self._check_tokens_full(arr, name, shape)
        if key is not None:
            self._remember(key)

    def _settle(self, key, stream, op):
        """The NCCL transport's first call of each op ``key`` (what decides the kernels the core loads for it):
        wait, with the group's deadline (abort and TimeoutError naming ``op``), for the work already queued on
        ``stream``. Loading a kernel waits until the device is idle, so a kernel loaded for the first time behind
        an NCCL collective that waits for a dead peer would block the calling thread for good, before any
        deadline (EpGroup's rule, docs/ep.md §5); the core loads every kernel of a call before it launches any.
        Later calls of the key wait for nothing; nothing waits while ``stream`` is captured into a graph."""
        if self.transport != "nccl" or self.size == 1 or key in self._settled or _ep._capturing(stream):
            return
        self._wait(stream, op)
        self._settled.add(key)

    def _remember(self, key):
        """Note a signature that passed its checks (the cache is emptied when it grows past 256)."""
        if len(self._checked) >= 256:
            self._checked.clear()
        self._checked[key] = True

    def _check_tokens_full(self, arr, name, shape):
        _arrays.check_ndim(arr, name, len(shape))
        _arrays.check_dtype(arr, name, _ep._TOKEN_DTYPES)
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(arr.shape)}")
        if np.dtype(arr.dtype) != self.dtype:
            raise TypeError(f"{name}: dtype must be {self.dtype.name} (the group's), got {np.dtype(arr.dtype).name}")

    def _check_handle(self, handle, call, op):
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(f"{op}: handle: expected a LowLatencyHandle from dispatch, got {type(handle).__name__}")
        if handle.group_id != self.id:
            raise ValueError(f"{op}: handle: made by another group")
        if handle.backend != call.backend or (call.backend == "cuda" and handle.device_id != call.device_id):
            raise ValueError(f"{op}: the handle was made on {handle.backend} but the arrays are on {call.backend}")
        if not handle.received:
            raise ValueError(f"{op}: handle: its dispatch's receive hook has not run yet; call the hook first")

    def _check_dispatch(self, x, topk_idx, topk_weights, pair=False):
        """Shapes and dtypes of dispatch's arguments (anything with ``shape``, ``ndim`` and ``dtype``: the
        framework adapters check traced arrays with it too; ``pair``: ``x`` is an ``(x_fp8, scales)`` pair);
        returns ``(T, K)``. A signature (shapes and dtypes) that passed is remembered per group."""
        try:
            key = (pair, topk_idx.shape, topk_idx.dtype, topk_weights.shape, topk_weights.dtype) + (
                (x[0].shape, x[0].dtype, x[1].shape, x[1].dtype) if pair else (x.shape, x.dtype))
            got = self._checked.get(key)
            if got is not None:
                return got
        except (AttributeError, TypeError):  # not arrays (or unhashable): the checks below say so
            key = None
        got = self._check_dispatch_full(x, topk_idx, topk_weights, pair)
        if key is not None:
            self._remember(key)
            self._checked[key] = got
        return got

    def _check_dispatch_full(self, x, topk_idx, topk_weights, pair):
        _arrays.check_ndim(topk_idx, "topk_idx", 2)
        _arrays.check_dtype(topk_idx, "topk_idx", _arrays.INDEX_DTYPES)
        T, K = int(topk_idx.shape[0]), int(topk_idx.shape[1])
        if T > self.max_tokens_per_rank:
            raise ValueError(f"topk_idx: T={T} exceeds max_tokens_per_rank={self.max_tokens_per_rank}")
        if K != self.topk:
            raise ValueError(f"topk_idx: K must be {self.topk} (the group's topk), got {K}")
        if pair:
            self.check_fp8_pair(x[0], x[1], T)
        else:
            self._check_tokens(x, "x", (T, self.hidden))
        if topk_weights is None:
            raise TypeError("topk_weights: expected a [T, K] float array, got None")
        _ep.check_weights(topk_weights, "topk_weights", (T, K))
        return T, K

    # An (x_fp8, scales) pair of dispatch(..., fp8=True): EpGroup's check (it reads hidden alone).
    check_fp8_pair = _ep.EpGroup.check_fp8_pair

    def _slots_shape(self):
        return self._slots

    # -- ops -------------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, *, fp8: bool = False, dequantize: bool = False,
                 return_recv_hook: bool = False, stream=None):
        """Send each token to the fixed slots of its experts (a collective; no host sync).

        Args:
            x: ``[T,H]`` in the group's dtype, ``T <= max_tokens_per_rank``; or, with ``fp8=True``, a
                pre-quantized pair ``(x_fp8, scales)``: ``x_fp8 [T,H]`` float8_e4m3fn (torch, JAX or
                ml_dtypes) or uint8 (its e4m3 codes), ``scales [T, ceil(H/128)]`` float32 (as
                :func:`moe_rt.quantize_fp8` returns). A pair without ``fp8=True`` is a TypeError.
            topk_idx: ``[T,K]`` int32/int64, ids in ``[-1, E)``.
            topk_weights: ``[T,K]`` float (used as fp32).
            fp8: send FP8 rows (docs/fp8.md; the group needs ``fp8=True`` at creation, ValueError
                otherwise): a float ``x`` is quantized inside the push (each token row read once;
                :func:`moe_rt.quantize_fp8`'s rule, bit for bit: e4m3, one fp32 scale per 128 channels, round
                to nearest even), a pair is pushed as is; each slot row travels as ``H + 4*ceil(H/128)``
                bytes instead of ``H * itemsize``.
            dequantize: with ``fp8=True``: return the received rows dequantized (the valid slots, on the
                receiving side in the same kernel; :func:`moe_rt.dequantize_fp8`'s rule) in the group's dtype
                instead of the FP8 pair (ValueError without ``fp8=True``).
            return_recv_hook: False: one kernel sends and receives. True: this call only sends (it returns
                once the pushes are queued, without waiting for the peers) and also returns ``hook``;
                ``hook(stream=None)`` queues the receive (wait for every peer's rows, fill ``counts`` and the
                handle's slot tables, dequantize when asked) on ``stream`` (default: the caller's current
                one). The received rows, ``counts`` and the handle are valid after the hook, in stream order;
                combine and the backwards refuse a handle whose hook has not run. Work queued between the two
                overlaps the transfer (another micro-batch's expert compute; with ``num_buffers=2`` also its
                dispatch).

        Returns:
            - ``(recv_x [L, R*Tmax, H], counts [L] int32, handle)`` (module notes: slots, validity, lifetime);
            - ``fp8=True``: ``(recv_x_fp8 [L, R*Tmax, H], recv_scales [L, R*Tmax, ceil(H/128)] float32,
              counts, handle)``, views of the group's FP8 receive buffers with ``recv_x``'s lifetime:
              ``recv_x_fp8`` is float8_e4m3fn (torch, JAX, NumPy/ml_dtypes), or uint8 when the pair's
              ``x_fp8`` was uint8 (CuPy holds no FP8: a CuPy float ``x`` needs ``dequantize=True`` or a uint8
              pair, TypeError otherwise); rows of slots with no token unspecified, as ``recv_x``'s;
            - ``fp8=True, dequantize=True``: ``(recv_x, counts, handle)``, ``recv_x`` in the group's dtype;
            and ``hook`` last when ``return_recv_hook``. After an FP8 dispatch, combine and both backwards are
            the float ones (gradients in the group's dtype, never FP8).
        """
        self._alive("dispatch")
        if not (return_recv_hook is False and fp8 is False and dequantize is False):  # else nothing to check
            _ep._check_bool(return_recv_hook, "return_recv_hook")
            _ep_adapt.check_fp8_flags(fp8, dequantize)
        pair = isinstance(x, (tuple, list))
        if pair:
            _ep_adapt.check_pair_arity(x, fp8)
        self._check_fp8(fp8)
        arrays = ({"x_fp8": x[0], "scales": x[1], "topk_idx": topk_idx, "topk_weights": topk_weights} if pair
                  else {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights})
        with _arrays.Call(arrays, stream=stream, lean=True) as call:
            self._call_checks(call, "dispatch")
            idx, wv = call["topk_idx"], call["topk_weights"]
            xv = (call["x_fp8"], call["scales"]) if pair else call["x"]
            T, K = self._check_dispatch(xv, idx, wv, pair)
            codes = None  # the dtype FP8 rows come back in
            if fp8:
                codes = np.dtype(xv[0].dtype) if pair else _arrays.FLOAT8_E4M3
                _ep.check_fp8_rows_holdable(call, codes, dequantize)
            xp = call.xp
            idx = _arrays.contiguous(xp, idx)
            wv = _arrays.as_f32(xp, wv)
            if pair:
                xv = tuple(_arrays.contiguous(xp, _arrays.cupy_of(a) if call.backend == "cuda" else a)
                           for a in xv)  # FP8 on CUDA: its bytes as uint8
            else:
                xv = _arrays.contiguous(xp, xv)
            if call.backend == "cpu":
                return self._dispatch_cpu(call, xv, idx, wv, T, K, fp8, pair, dequantize, return_recv_hook)
            return self._dispatch_cuda(call, xv, idx, wv, T, K, return_recv_hook, fp8, pair, dequantize, codes)

    def _dispatch_cpu(self, call, xv, idx, wv, T, K, fp8, pair, dequantize, split):
        """The reference's dispatch of one rank (the 1-rank group on CPU arrays)."""
        _errors.check_ids(np.asarray(idx), self.num_experts, "topk_idx")
        args = ([np.asarray(idx)], [np.asarray(wv)], self.num_experts, self.max_tokens_per_rank)
        if fp8:
            rq, rs, counts, h = _ref.dispatch_fp8([np.asarray(xv[0] if pair else xv)], *args,
                                                  scales=[np.asarray(xv[1])] if pair else None)[0]
            if dequantize:  # [L, R*Tmax, ...] as [L*R*Tmax, ...] rows
                y = _fp8_ref.dequantize_fp8(rq.reshape(-1, self.hidden), rs.reshape(-1, self.num_scales), self.dtype,
                                            FP8_BLOCK)
                rows = (y.reshape(rq.shape),)
            else:
                rows = (rq, rs)
        else:
            recv, counts, h = _ref.dispatch([np.asarray(xv)], *args)[0]
            rows = (recv,)
        handle = LowLatencyHandle(self, T, K, "cpu", 0, h)
        handle.slot_topk, handle.slot_weights = call.out(h["slot_k"]), call.out(h["slot_w"])
        handle.counts = call.out(counts)
        res = tuple(call.out(r) for r in rows) + (handle.counts, handle)
        # the reference has already received: the hook only checks that it runs once
        return res + (_Hook(self, handle, None),) if split else res

    def _dispatch_cuda(self, call, xv, idx, wv, T, K, split, fp8=False, pair=False, dequantize=False, codes=None):
        # the call's stream first: a light call (torch's stream, _arrays.Call) makes it CuPy's current one
        # here, which _setup's collectives and capture check use
        s = call.stream
        if self._transport is None:
            self._setup(call.device_id)
        b = self._next_set
        if self._pending[b] is not None:
            raise ValueError(f"dispatch: buffer set {b} still waits for the receive hook of an earlier dispatch; "
                             f"call that hook first (or create the group with num_buffers=2 for two dispatches "
                             f"in flight)")
        ts = self._take_tables(call)  # the handle's tables: one set of the group's ring
        core = self._llg or self._core_group()
        # the core's arguments after the phases: x, or the FP8 pair's codes and scales (a float x with fp8 is
        # quantized in the push), the flags, the routing, T, the tables
        args = ((0, xv[0].data.ptr, xv[1].data.ptr) if pair else (xv.data.ptr, 0, 0)) + (
            int(fp8), int(dequantize), idx.data.ptr, _core.CODES[idx.dtype], wv.data.ptr, T, ts.outs)
        if self.transport == "nccl":
            self._settle(("dispatch", split, fp8, dequantize, pair, idx.dtype.char, (args[0] | args[1]) % 16), s,
                         "dispatch")
        _core.ll_dispatch(core, b, _PUSH if split else _PUSH | _RECEIVE, *args, s.ptr)  # barrier + kernel
        # the rest overlaps the kernel
        self._next_set = (b + 1) % self.num_buffers
        self._last_stream = s
        a = _Tables(ts, T)
        handle = LowLatencyHandle(self, T, K, "cuda", call.device_id, a)
        handle.buffer_set = b
        out = call.out
        if call.framework in _SAME:  # out() hands these back as they are
            handle.slot_topk, handle.slot_weights = a["slot_k"], a["slot_w"]
            handle.counts = a["counts"]
            res = self._rows(b, fp8 and not dequantize, codes) + (handle.counts, handle)
        else:
            handle.slot_topk, handle.slot_weights, handle.counts = out(a["slot_k"]), out(a["slot_w"]), out(a["counts"])
            res = tuple(out(r) for r in self._rows(b, fp8 and not dequantize, codes)) + (handle.counts, handle)
        if not split:
            return res
        self._pending[b] = handle

        def receive(c, arrays=(xv, idx, wv)):  # holds the push's arrays (their pointers) until it runs
            if self.transport == "nccl":
                self._settle(("receive", fp8, dequantize), c.stream, "dispatch")
            _core.ll_dispatch(core, b, _RECEIVE, *args, c.stream.ptr)

        return res + (_Hook(self, handle, receive),)

    def _rows(self, b, fp8, codes):
        """The received rows of buffer set ``b`` as dispatch returns them (before ``call.out``): ``(recv,)``, or
        with ``fp8`` the pair ``(recv_x_fp8, recv_scales)``, the codes in ``codes`` (uint8 or an FP8 dtype)."""
        key = (b, fp8, codes)
        rows = self._row_views.get(key)
        if rows is None:
            if fp8:
                q = self._view("recv_q", b, self._slots_shape(), np.uint8)
                rows = (q if codes == np.uint8 else _arrays.fp8_array(q, codes),
                        self._view("recv_s", b, self._slots_shape()[:2] + (self.num_scales,), np.float32))
            else:
                rows = (self._view("recv", b, self._slots_shape(), self.dtype),)
            self._row_views[key] = rows
        return rows

    def _table_layout(self):
        """``(bytes, layout)`` of a :class:`_TableSet` (each table at a 256-byte boundary, ``idx`` and ``w`` sized
        for Tmax tokens), made once."""
        got = self._layout
        if got is None:
            R, L, Tmax, K = self.size, self.num_local_experts, self.max_tokens_per_rank, self.topk
            layout, o = {}, 0
            for name, shape, dt in (("idx", (Tmax, K), np.int32), ("w", (Tmax, K), np.float32),
                                    ("route", (R, Tmax, K), np.int32), ("slot_k", (L, R * Tmax), np.int32),
                                    ("slot_w", (L, R * Tmax), np.float32), ("counts", (L,), np.int32)):
                nb = math.prod(shape) * 4
                layout[name] = (o, nb, shape, np.dtype(dt))
                o += -(-nb // _ALIGN) * _ALIGN
            got = self._layout = (o, layout)
        return got

    def _take_tables(self, call):
        """A :class:`_TableSet` for a dispatch on ``call``'s stream: a free one of the group's sets made on that
        stream, else a new one (kept for reuse while the stream has fewer than _RING)."""
        key = call.stream.ptr
        ring = self._rings.get(key)
        if ring is not None:
            for ts in ring:
                if ts.free():
                    return ts
        nbytes, layout = self._table_layout()
        # (inside a moe_rt.jax callback, which serves an allocation of an output's exact byte size from that
        # output's buffer, a set is larger than each output the callback has not allocated yet: it must not
        # land in one, as it outlives the callback)
        ts = _TableSet(call.xp.empty(nbytes, np.uint8), layout, key)
        if ring is None:
            if len(self._rings) >= _RING_STREAMS:
                del self._rings[next(iter(self._rings))]  # the stream kept longest
            ring = self._rings[key] = []
        if len(ring) < _RING:
            ring.append(ts)
            ts.settle()  # held here as in the loop above: by the ring and one local name
        return ts

    def _receive(self, handle, keep, stream):
        """The receive half of a split dispatch (``_Hook.__call__``)."""
        self._alive("dispatch")
        if handle.backend == "cpu":
            return
        import cupy

        s = _arrays.as_cupy_stream(stream, handle.device_id)
        with cupy.cuda.Device(handle.device_id):
            keep(_Launch(s, handle.device_id))
        self._pending[handle.buffer_set] = None
        self._last_stream = s

    def _combine(self, call, handle, op, y, gws, out, grad_w):
        """The combine direction for ``handle`` (moe_rt_ll_combine: barrier + ep_ll_combine; ``op`` names it):
        ``y`` rows and ``gws`` slot gradients read, ``out`` rows and ``grad_w`` weight gradients written (each
        an array or None)."""
        if self.transport == "nccl":
            self._settle((op, y is None, gws is None, out is None, grad_w is None,
                          ((y.data.ptr if y is not None else 0) | (out.data.ptr if out is not None else 0)) % 16),
                         call.stream, op)
        _core.ll_combine(self._llg or self._core_group(), handle.buffer_set, _OP[op],
                         y.data.ptr if y is not None else 0, gws.data.ptr if gws is not None else 0,
                         handle._tables(), handle.num_tokens, out.data.ptr if out is not None else 0,
                         grad_w.data.ptr if grad_w is not None else 0, call.stream.ptr)
        self._last_stream = call.stream

    def combine(self, handle, expert_out, *, stream=None):
        """Reduce each token's expert outputs, weighted by ``topk_weights`` (a collective; no host sync).

        Args:
            handle: from :meth:`dispatch` of this group.
            expert_out: ``[L, R*Tmax, H]`` in the group's dtype (only valid slots are read).

        Returns:
            ``out [T,H]``: ``sum_k w[t,k] * y[slot(t,k)]``, fp32, k ascending, rounded once; with the group's
            ``combine_partials``: the fp32 sum over the token's expert ranks ascending of each rank's partial
            (``sum`` over its slots there, k ascending, of ``slot_weights * y`` in fp32, rounded to the dtype),
            rounded once (docs/ep.md §8).
        """
        self._alive("combine")
        with _arrays.Call({"expert_out": expert_out}, stream=stream, lean=True) as call:
            self._call_checks(call, "combine")
            self._check_handle(handle, call, "combine")
            y = call["expert_out"]
            self._check_tokens(y, "expert_out", self._slots_shape())
            y = _arrays.contiguous(call.xp, y)
            if call.backend == "cpu":
                ref = _ref.combine_partials if self.combine_partials else _ref.combine
                return call.out(ref([handle._a], [np.asarray(y)])[0])
            out = call.empty((handle.num_tokens, self.hidden), self.dtype)
            self._combine(call, handle, "combine", y, None, out, None)
            return call.out(out)

    def dispatch_bwd(self, handle, grad_recv_x, grad_recv_weights=None, *, stream=None):
        """VJP of :meth:`dispatch` (a collective).

        Args:
            grad_recv_x: ``[L, R*Tmax, H]`` in the group's dtype (only valid slots are read).
            grad_recv_weights: None or ``[L, R*Tmax]`` float (the gradient of ``handle.slot_weights``).

        Returns:
            ``(grad_x [T,H], grad_topk_weights [T,K] float32 or None)``: the unweighted fp32 sum of each
            token's slots (once per slot, k ascending, rounded once); the slot weight gradient for each k.
        """
        self._alive("dispatch_bwd")
        with _arrays.Call({"grad_recv_x": grad_recv_x, "grad_recv_weights": grad_recv_weights},
                          stream=stream, lean=True) as call:
            self._call_checks(call, "dispatch_bwd")
            self._check_handle(handle, call, "dispatch_bwd")
            g = call["grad_recv_x"]
            self._check_tokens(g, "grad_recv_x", self._slots_shape())
            gw = call["grad_recv_weights"]
            if gw is not None:
                _ep.check_weights(gw, "grad_recv_weights", self._slots_shape()[:2])
                gw = _arrays.as_f32(call.xp, gw)
            g = _arrays.contiguous(call.xp, g)
            if call.backend == "cpu":
                gx, gwt = _ref.dispatch_bwd([handle._a], [np.asarray(g)],
                                            None if gw is None else [np.asarray(gw)])[0]
                return call.out(gx), (None if gwt is None else call.out(gwt))
            T, K = handle.num_tokens, self.topk
            gx = call.empty((T, self.hidden), self.dtype)
            gwt = call.empty((T, K), np.float32) if gw is not None else None
            self._combine(call, handle, "dispatch_bwd", g, gw, gx, gwt)
            return call.out(gx), (None if gwt is None else call.out(gwt))

    def combine_bwd(self, handle, grad_out, expert_out=None, *, stream=None):
        """VJP of :meth:`combine` (a collective).

        Args:
            grad_out: ``[T,H]`` in the group's dtype.
            expert_out: None or the forward's ``[L, R*Tmax, H]`` (needed for ``grad_topk_weights``); must not
                be the group's receive buffer (this op overwrites it).

        Returns:
            ``(grad_expert_out [L, R*Tmax, H], grad_topk_weights [T,K] float32 or None)``:
            ``grad_expert_out[slot] = round(slot_weight * grad_out[t])``, zero at slots with no token (a view
            of the receive buffer, like ``recv_x``); ``grad_topk_weights[t,k] = <y[slot(t,k)], grad_out[t]>``
            (fp32, deterministic; the reference computes it in float64).
        """
        self._alive("combine_bwd")
        with _arrays.Call({"grad_out": grad_out, "expert_out": expert_out}, stream=stream, lean=True) as call:
            self._call_checks(call, "combine_bwd")
            self._check_handle(handle, call, "combine_bwd")
            T = handle.num_tokens
            g = call["grad_out"]
            self._check_tokens(g, "grad_out", (T, self.hidden))
            y = call["expert_out"]
            if y is not None:
                self._check_tokens(y, "expert_out", self._slots_shape())
                y = _arrays.contiguous(call.xp, y)
            g = _arrays.contiguous(call.xp, g)
            if call.backend == "cpu":
                gy, gw = _ref.combine_bwd([handle._a], [np.asarray(g)], None if y is None else [np.asarray(y)])[0]
                return call.out(gy), (None if gw is None else call.out(gw))
            s, b = call.stream, handle.buffer_set  # before _setup, as in dispatch
            self._setup(call.device_id)
            gy = self._rows(b, False, None)[0]
            # barrier, the rows into the receive buffer (scaled by the slot weights; unscaled ones through the
            # dedup split, then scaled and dotted with expert_out per slot into `dots`); the core refuses an
            # expert_out inside the receive buffer (ValueError)
            dots = call.scratch((gy.shape[0] * gy.shape[1],), np.float32) if y is not None else None
            if self.transport == "nccl":
                self._settle(("combine_bwd", y is None, (g.data.ptr | (0 if y is None else y.data.ptr)) % 16), s,
                             "combine_bwd")
            _core.ll_combine_bwd(self._llg or self._core_group(), b, g.data.ptr, 0 if y is None else y.data.ptr,
                                 handle._tables(), T, 0 if dots is None else dots.data.ptr, s.ptr)
            gwt = None
            if y is not None:  # the weight gradient: the dots gathered back to [T,K] (barrier + ep_ll_combine)
                gwt = call.empty((T, self.topk), np.float32)
                self._combine(call, handle, "combine_bwd", None, dots, None, gwt)
            self._last_stream = s
            return call.out(gy), (None if gwt is None else call.out(gwt))
