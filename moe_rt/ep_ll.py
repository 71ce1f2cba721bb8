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
- ``recv_x`` is a view of the group's receive buffer, valid until the group's next dispatch-direction op
  (``dispatch`` or ``combine_bwd``): copy it to keep it (e.g. for the expert backward).
- :meth:`LowLatencyGroup.combine` ``(handle, expert_out [L, R*Tmax, H])`` -> ``out [T,H]``: barrier, then
  one kernel: each expert rank pushes each valid slot's row into its token owner's back buffer, the owner
  sums ``w[t,k] * y`` over ``k`` ascending in fp32 (products and additions each rounded to fp32, as the
  NumPy reference does) and rounds once.
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

Transport: the direct peer-memory one (:mod:`moe_rt._ep_direct`); a group of several ranks needs every
pair on one node with peer access (ValueError at creation otherwise). ``LowLatencyGroup(None, ...)`` is a
1-rank group: CPU arrays run the NumPy reference :mod:`moe_rt.reference.ep_ll`, CUDA arrays the kernels.
Memory per rank: ``(L*R*Tmax + Tmax*K) * H`` token elements plus small tables (bf16, E=256, R=4, Tmax=128,
H=7168: 470 MB, as DeepEP's low-latency buffer), per buffer set; ``fp8=True`` adds ``L*R*Tmax*(H +
4*ceil(H/128))`` bytes per set.
"""
from __future__ import annotations

import itertools

import numpy as np

from moe_rt import _arrays, _ep_adapt, _ep_direct, _errors, _jit
from moe_rt import ep as _ep
from moe_rt.reference import ep_ll as _ref
from moe_rt.reference import fp8 as _fp8_ref

__all__ = ["LowLatencyGroup", "LowLatencyHandle", "MAX_TOKENS_PER_RANK"]

MAX_TOKENS_PER_RANK = _ref.MAX_TOKENS_PER_RANK
_FILE = "ep.cu"
_THREADS = _ep_direct._THREADS  # the block of the transport's fused kernels (its _grid sizes waves of it)
_IDX = {"int32": "int", "int64": "long long"}
_names = []
for _c in _jit.CTYPES.values():
    for _v in ("true", "false"):
        _names += [f"ep_ll_dispatch<{_c}, {_i}, {_v}>" for _i in _IDX.values()]
        _names += [f"ep_ll_dispatch_fp8<{_c}, {_i}, {_v}>" for _i in _IDX.values()]
        _names += [f"ep_ll_combine<{_c}, {_v}>", f"ep_ll_slot_dot<{_c}, {_v}>"]
_jit.register(_FILE, _names)
_ids = itertools.count(1)
_ALIGN = 256
FP8_BLOCK = _ref.FP8_BLOCK  # channels per FP8 scale


_PUSH, _RECEIVE = 1, 2  # ep_ll_dispatch's phases (LL_PUSH, LL_RECEIVE in kernels/ep.cu)


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


def chunk_tokens(max_tokens_per_rank: int) -> int:
    """Tokens a flag covers, the same on every rank: at most 128 chunks per rank."""
    return max(1, -(-int(max_tokens_per_rank) // 128))


class _SelfComm:
    """The communicator of a 1-rank group on one GPU (the shared buffers' all-gather is a copy)."""
    rank, size = 0, 1

    def __init__(self, device):
        self.device = device

    def all_gather(self, src, dst, n, dtype, stream):
        if src != dst:
            from cupy.cuda import runtime

            runtime.memcpyAsync(dst, src, n * np.dtype(dtype).itemsize, runtime.memcpyDeviceToDevice, stream)


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

    A collective on several ranks (IPC buffers exchanged; a host sync, outside graph capture). ``close()``
    on every rank at the same point of its op sequence.
    """

    def __init__(self, comm, num_experts: int, hidden: int, max_tokens_per_rank: int, *, topk: int,
                 dtype="bfloat16", timeout: float | None = None, num_buffers: int = 1, fp8: bool = False):
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
        self.num_scales = _fp8_ref.num_blocks(self.hidden, FP8_BLOCK)
        self.id = next(_ids)
        self.closed = False
        self._next_set = 0
        self._pending = [None] * self.num_buffers  # per set: the handle whose receive hook has not run
        self._transport = None
        self._buf = None
        self._last_stream = None
        self.chunk = chunk_tokens(self.max_tokens_per_rank)

    # The host waits and the timeout report of EpGroup (they use comm, timeout and _transport alone).
    _wait = _ep.EpGroup._wait
    _check_transport = _ep.EpGroup._check_transport

    def __repr__(self):
        return (f"LowLatencyGroup(rank={self.rank}, size={self.size}, num_experts={self.num_experts}, "
                f"hidden={self.hidden}, max_tokens_per_rank={self.max_tokens_per_rank}, topk={self.topk}, "
                f"dtype={self.dtype.name}{', fp8=True' if self.fp8 else ''})")

    # -- buffers ---------------------------------------------------------------------------------------
    def _regions(self):
        """((name, set), bytes) of the one IPC-shared allocation, in order (each at a 256-byte boundary)."""
        R, L, Tmax, K, H = self.size, self.num_local_experts, self.max_tokens_per_rank, self.topk, self.hidden
        isz = self.dtype.itemsize
        one = [("recv", L * R * Tmax * H * isz), ("route", R * (Tmax * K + 1) * 4), ("rw", R * Tmax * K * 4),
               ("back", Tmax * K * H * isz), ("bw", Tmax * K * 4)]
        if self.fp8:  # the FP8 rows of dispatch(..., fp8=True): e4m3 codes and their per-128 scales
            one += [("recv_q", L * R * Tmax * H), ("recv_s", L * R * Tmax * self.num_scales * 4)]
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
            wait = lambda s: self._wait(s, "__init__", setup)  # noqa: E731
            comm = self.comm if self.comm is not None else _SelfComm(self.device)
            if self.size > 1:
                ok, reason = _ep_direct.probe_peers(comm, self.device, wait)
                if not ok:
                    raise ValueError(f"LowLatencyGroup needs every pair of ranks on one node with peer access: "
                                     f"{reason}")
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
                with stream:
                    self._tables = {n: sh.table + off for n, (off, _) in offs.items()}
                    self._set_epoch = cupy.zeros(self.num_buffers, np.uint32)
            except BaseException:
                d.close()
                raise
            self._transport, self._buf, self._offs = d, sh, offs

    def _view(self, name, b, shape, dtype):
        import cupy

        off, nb = self._offs[(name, b)]
        mem = cupy.cuda.UnownedMemory(self._buf.local + off, max(nb, 1), self._transport, self.device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))

    # close() (a collective on several ranks: one last barrier, then the IPC mappings are closed and the
    # buffers freed; the communicator stays open) and the closed-group check: EpGroup's.
    close = _ep.EpGroup.close
    _alive = _ep.EpGroup._alive

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
    def _call_checks(self, call, op):
        if call.backend == "cpu":
            if self.size > 1:
                raise TypeError(f"{op}: a {self.size}-rank group needs CUDA arrays")
        elif self.device is not None and call.device_id != self.device:
            raise ValueError(f"{op}: arrays are on cuda:{call.device_id} but the group uses cuda:{self.device}")

    def _check_tokens(self, arr, name, shape):
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
        returns ``(T, K)``."""
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
        return (self.num_local_experts, self.size * self.max_tokens_per_rank, self.hidden)

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
        _ep._check_bool(return_recv_hook, "return_recv_hook")
        _ep_adapt.check_fp8_flags(fp8, dequantize)
        pair = isinstance(x, (tuple, list))
        if pair:
            _ep_adapt.check_pair_arity(x, fp8)
        if fp8 and not self.fp8:
            raise ValueError("fp8: this group has no FP8 receive buffers; create it with "
                             "LowLatencyGroup(..., fp8=True)")
        arrays = {"x_fp8": x[0], "scales": x[1]} if pair else {"x": x}
        arrays.update(topk_idx=topk_idx, topk_weights=topk_weights)
        with _arrays.Call(arrays, stream=stream) as call:
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
        self._setup(call.device_id)
        xp, s = call.xp, call.stream
        R, L, Tmax = self.size, self.num_local_experts, self.max_tokens_per_rank
        b = self._next_set
        if self._pending[b] is not None:
            raise ValueError(f"dispatch: buffer set {b} still waits for the receive hook of an earlier dispatch; "
                             f"call that hook first (or create the group with num_buffers=2 for two dispatches "
                             f"in flight)")
        a = dict(idx=xp.empty((T, K), np.int32), w=xp.empty((T, K), np.float32),
                 route=xp.empty((R, Tmax, K), np.int32), slot_k=xp.empty((L, R * Tmax), np.int32),
                 slot_w=xp.empty((L, R * Tmax), np.float32), counts=xp.empty(L, np.int32))
        self._transport.barrier(s, "dispatch")
        handle = LowLatencyHandle(self, T, K, "cuda", call.device_id, a)
        handle.buffer_set = b
        if fp8:
            x, xq, xs = (None,) + xv if pair else (xv, None, None)

            def launch(c, phases):
                self._launch_dispatch_fp8(c, x, xq, xs, idx, wv, T, b, a, dequantize, phases)
        else:
            def launch(c, phases):
                self._launch_dispatch(c, xv, idx, wv, T, b, meta=True, scaled=False, out=a, zero_k=None,
                                      op="dispatch", phases=phases)
        launch(call, _PUSH if split else _PUSH | _RECEIVE)
        self._next_set = (b + 1) % self.num_buffers
        self._last_stream = s
        handle.slot_topk, handle.slot_weights = call.out(a["slot_k"]), call.out(a["slot_w"])
        handle.counts = call.out(a["counts"])
        if fp8 and not dequantize:
            q = self._view("recv_q", b, self._slots_shape(), np.uint8)
            rows = (q if codes == np.uint8 else _arrays.fp8_array(q, codes),
                    self._view("recv_s", b, self._slots_shape()[:2] + (self.num_scales,), np.float32))
        else:
            rows = (self._view("recv", b, self._slots_shape(), self.dtype),)
        res = tuple(call.out(r) for r in rows) + (handle.counts, handle)
        if not split:
            return res
        self._pending[b] = handle
        # the receive launch keeps the push's arrays (and their pointers) alive until it is queued
        return res + (_Hook(self, handle, lambda c: launch(c, _RECEIVE)),)

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

    def _vec(self, *ptrs):
        return (self.hidden * self.dtype.itemsize) % 16 == 0 and all(p % 16 == 0 for p in ptrs)

    def _launch_dispatch(self, call, xv, idx, wv, T, b, *, meta, scaled, out, zero_k, op, phases=_PUSH | _RECEIVE):
        d, R, L, Tmax, K = self._transport, self.size, self.num_local_experts, self.max_tokens_per_rank, self.topk
        xptr = xv.data.ptr if T else 0
        vec = self._vec(xptr, self._buf.local)
        fn = _jit.function(_FILE, f"ep_ll_dispatch<{_jit.ctype(self.dtype)}, {_IDX[np.dtype(idx.dtype).name]}, "
                                  f"{'true' if vec else 'false'}>")
        C = self.chunk
        NC = -(-Tmax // C)
        ptr = lambda k: out[k].data.ptr if out is not None else 0  # noqa: E731
        tab = self._tables
        _jit.launch(fn, self._transport._grid(fn, call, max(NC, L)), _THREADS,
                    (xptr, idx.data.ptr if T else 0, wv.data.ptr if T else 0, np.int32(T), np.int32(int(meta)),
                     np.int32(int(scaled)), tab[("recv", b)], tab[("route", b)], tab[("rw", b)],
                     d.flags.table, ptr("idx"), ptr("w"), ptr("route"), ptr("slot_k"), ptr("slot_w"), ptr("counts"),
                     zero_k.data.ptr if zero_k is not None else 0, _errors.word(call.device_id), d.state,
                     d._err_ptr, np.int64(d.timeout_ns), np.int32(_ep_direct.OP_CODES[op]), np.int32(R),
                     np.int32(self.rank), np.int32(L), np.int32(Tmax), np.int32(K), np.int32(C),
                     np.int64(self.hidden), np.int32(phases), np.int64(2 * R * Tmax * b),
                     self._set_epoch.data.ptr + 4 * b if phases != _PUSH | _RECEIVE else 0), stream=call.stream)

    def _launch_dispatch_fp8(self, call, x, xq, xs, idx, wv, T, b, out, dequant, phases):
        """ep_ll_dispatch_fp8: a float ``x`` quantized in the push, or the pair ``xq`` (uint8 codes) / ``xs``
        (fp32 scales) pushed as is; ``dequant``: the receive half also dequantizes the valid slots into the
        set's ``recv``."""
        d, R, L, Tmax, K, H = (self._transport, self.size, self.num_local_experts, self.max_tokens_per_rank,
                               self.topk, self.hidden)
        src = xq if xq is not None else x
        sptr = src.data.ptr if T else 0
        # 16 channels a thread: 16-byte loads of x (or of the codes) and 16-byte stores of the codes
        vec = H % 16 == 0 and sptr % 16 == 0 and self._buf.local % 16 == 0
        fn = _jit.function(_FILE, f"ep_ll_dispatch_fp8<{_jit.ctype(self.dtype)}, "
                                  f"{_IDX[np.dtype(idx.dtype).name]}, {'true' if vec else 'false'}>")
        NC = -(-Tmax // self.chunk)
        tab = self._tables
        ptr = lambda a: a.data.ptr if a is not None and T else 0  # noqa: E731
        _jit.launch(fn, self._transport._grid(fn, call, max(NC, L)), _THREADS,
                    (ptr(x), ptr(xq), ptr(xs), ptr(idx), ptr(wv), np.int32(T), tab[("recv", b)],
                     tab[("recv_q", b)], tab[("recv_s", b)], tab[("route", b)], tab[("rw", b)], d.flags.table,
                     out["idx"].data.ptr, out["w"].data.ptr, out["route"].data.ptr, out["slot_k"].data.ptr,
                     out["slot_w"].data.ptr, out["counts"].data.ptr, np.int32(int(dequant)),
                     _errors.word(call.device_id), d.state, d._err_ptr, np.int64(d.timeout_ns),
                     np.int32(_ep_direct.OP_CODES["dispatch"]), np.int32(R), np.int32(self.rank), np.int32(L),
                     np.int32(Tmax), np.int32(K), np.int32(self.chunk), np.int64(H), np.int32(self.num_scales),
                     np.int32(phases), np.int64(2 * R * Tmax * b),
                     self._set_epoch.data.ptr + 4 * b if phases != _PUSH | _RECEIVE else 0), stream=call.stream)

    def _launch_combine(self, call, handle, y, gws, w, out, grad_w, op):
        d, R, L, Tmax, K = self._transport, self.size, self.num_local_experts, self.max_tokens_per_rank, self.topk
        a, T, b = handle._a, handle.num_tokens, handle.buffer_set
        vec = self._vec(y.data.ptr if y is not None else 0, out.data.ptr if out is not None else 0, self._buf.local)
        fn = _jit.function(_FILE, f"ep_ll_combine<{_jit.ctype(self.dtype)}, {'true' if vec else 'false'}>")
        C = self.chunk
        NC = -(-Tmax // C)
        # owner items: (token, slice of _THREADS 16-byte vectors of its row)
        nv = self.hidden // (16 // self.dtype.itemsize) if vec else self.hidden
        slices = -(-nv // _THREADS) if out is not None else 1
        _jit.launch(fn, self._transport._grid(fn, call, max(NC * R, T * slices)), _THREADS,
                    (y.data.ptr if y is not None else 0, gws.data.ptr if gws is not None else 0, a["route"],
                     a["idx"].data.ptr if T else 0, w.data.ptr if w is not None and T else 0,
                     self._tables[("back", b)], self._tables[("bw", b)], d.flags.table,
                     out.data.ptr if out is not None and T else 0, grad_w.data.ptr if grad_w is not None and T else 0,
                     d.state, d._err_ptr, np.int64(d.timeout_ns), np.int32(_ep_direct.OP_CODES[op]), np.int32(R),
                     np.int32(self.rank), np.int32(L), np.int32(Tmax), np.int32(K), np.int32(T), np.int32(C),
                     np.int64(self.hidden), np.int64(2 * R * Tmax * b)), stream=call.stream)

    def combine(self, handle, expert_out, *, stream=None):
        """Reduce each token's expert outputs, weighted by ``topk_weights`` (a collective; no host sync).

        Args:
            handle: from :meth:`dispatch` of this group.
            expert_out: ``[L, R*Tmax, H]`` in the group's dtype (only valid slots are read).

        Returns:
            ``out [T,H]``: ``sum_k w[t,k] * y[slot(t,k)]``, fp32, k ascending, rounded once.
        """
        self._alive("combine")
        with _arrays.Call({"expert_out": expert_out}, stream=stream) as call:
            self._call_checks(call, "combine")
            self._check_handle(handle, call, "combine")
            y = call["expert_out"]
            self._check_tokens(y, "expert_out", self._slots_shape())
            y = _arrays.contiguous(call.xp, y)
            if call.backend == "cpu":
                return call.out(_ref.combine([handle._a], [np.asarray(y)])[0])
            T = handle.num_tokens
            out = call.xp.empty((T, self.hidden), self.dtype)
            self._transport.barrier(call.stream, "combine")
            self._launch_combine(call, handle, y, None, handle._a["w"], out, None, "combine")
            self._last_stream = call.stream
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
                          stream=stream) as call:
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
            gx = call.xp.empty((T, self.hidden), self.dtype)
            gwt = call.xp.empty((T, K), np.float32) if gw is not None else None
            self._transport.barrier(call.stream, "dispatch_bwd")
            self._launch_combine(call, handle, g, gw, None, gx, gwt, "dispatch_bwd")
            self._last_stream = call.stream
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
        with _arrays.Call({"grad_out": grad_out, "expert_out": expert_out}, stream=stream) as call:
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
            self._setup(call.device_id)
            if y is not None:
                lo, n = self._offs[("recv", handle.buffer_set)]
                lo += self._buf.local
                if y.data.ptr < lo + n and y.data.ptr + y.nbytes > lo:
                    raise ValueError("expert_out: must not be the group's receive buffer (combine_bwd overwrites "
                                     "it); pass a copy")
            a, s = handle._a, call.stream
            gy = self._view("recv", handle.buffer_set, self._slots_shape(), self.dtype)
            self._transport.barrier(s, "combine_bwd")
            self._launch_dispatch(call, g, a["idx"], a["w"], T, handle.buffer_set, meta=False, scaled=y is None,
                                  out=None, zero_k=a["slot_k"], op="combine_bwd")
            gwt = None
            if y is not None:
                n = gy.shape[0] * gy.shape[1]
                dots = call.xp.empty(n, np.float32)
                vec = self._vec(y.data.ptr, self._buf.local)
                fn = _jit.function(_FILE, f"ep_ll_slot_dot<{_jit.ctype(self.dtype)}, {'true' if vec else 'false'}>")
                grid = max(1, min(-(-n // 8), _jit.device_properties(call.device_id)["sm_count"] * 8))
                _jit.launch(fn, grid, 256, (gy, y, a["slot_k"], a["slot_w"], dots, np.int64(n), np.int64(self.hidden)),
                            stream=s)
                gwt = call.xp.empty((T, self.topk), np.float32)
                self._transport.barrier(s, "combine_bwd")
                self._launch_combine(call, handle, None, dots, None, None, gwt, "combine_bwd")
            self._last_stream = s
            return call.out(gy), (None if gwt is None else call.out(gwt))
