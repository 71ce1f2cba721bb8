"""The NCCL transport of expert parallelism (moe_rt/ep.py; docs/ep.md §2): grouped send/recv between any ranks.

:class:`moe_rt.ep.EpGroup` is the algorithm (validation, the plan, the handle); this module moves its rows
through the group's communicator, behind the interface every transport offers (see :mod:`moe_rt.ep`):

- :meth:`NcclTransport.forward` (the dispatch direction: ``dispatch``, ``combine_bwd``): pack the rows for
  each destination (a token once per destination rank), NCCL grouped send/recv (the own share is copied
  locally, never sent), then the permutation family's dispatch into expert-major rows;
- :meth:`NcclTransport.reduce` (the combine direction: ``combine``, ``dispatch_bwd``): each rank reduces the
  local expert rows of every received token with the permutation family's kernels, sends one row per
  (token, rank) back; the owner sums them over ranks in ascending rank order in fp32, rounding once
  (``ep_owner_sum``).

A group of one rank (``comm=None``) on CUDA runs the same serial path without any exchange.

Transfer in parts and overlap. The rows each (src, dst) pair exchanges travel in up to ``chunks`` parts
(default 2; parts of at least 4 MiB), one NCCL group per part; part i of a pair travels in group i on both
of its ranks. The serial path (every op on the caller's stream: pack, the groups, expand) and the
overlapped path send exactly the same groups, so each rank chooses on its own: ``overlap=None`` (the
default, ``MOE_RT_EP_OVERLAP=auto``) overlaps a call when the rank sends at least 64 MiB of rows,
``True``/``False`` always/never. Overlapped, the NCCL groups run on a second, non-blocking stream of the
group at the device's highest priority, with events between the two streams:

- dispatch direction (``dispatch``, ``combine_bwd``): the remote rows are packed first and sent part by
  part; meanwhile the caller's stream expands the own share into the expert-major layout straight from
  ``x`` (never copied to a staging buffer) with a small grid (one CTA per two SMs), so that the NCCL
  kernel keeps its share of memory bandwidth; each received part is expanded as soon as its event fires.
  Padding rows are zeroed once (not at all with dispatch's ``zero_empty_slots=False``), the received weights
  are laid out after the last part.
- combine direction (``combine``, ``dispatch_bwd``): the rows going back to peers are reduced part by part
  and each part is sent as soon as it is ready; the own share is reduced while they travel; the owner sum
  runs after the transfer.

On 2 H200s over NVLink (T=16384 per rank, H=7168, bf16; BENCHMARKS.md) the overlap takes dispatch from
1.86 to 1.73 ms and combine from 1.68 to 1.51 ms; at small transfers the second stream costs more than it
hides.

Results are bitwise identical to the serial path. The caller's stream waits for the communication stream
before the op returns (all later work on it, and the reuse of the op's buffers by CuPy's stream-ordered
pool, follows the transfer), so capacity mode stays CUDA-graph capturable: the second stream joins the
capture through the first event and is joined back by the last. ``combine_bwd`` with ``weighted=True`` and
``y`` given sends in parts but runs its expert-side kernel after the transfer.
"""
from __future__ import annotations

import numpy as np

from moe_rt import _jit, permutation
from moe_rt._ep_rows import (FILE, UNITS, Fp8Rows, bound, fill_outputs, fill_rows, grid, plan_view, recv_wk, regions,
                             scale_rows, slot_values, tokens_per_expert, unit)
from moe_rt._handle import meta_index

# overlap=None (auto): a call overlaps its transfer with the local work when this rank sends at least this
# many bytes of rows (below it the second stream and its events cost more than they hide).
_OVERLAP_MIN_BYTES = 64 << 20
# The smallest part (bytes of rows) a (src, dst) pair's transfer is split into when chunks > 1: below it
# one more NCCL group costs more than the overlap gains. Must be the same on every rank.
_MIN_CHUNK_BYTES = 4 << 20


class NcclTransport:
    """Rows between the ranks of a group through NCCL grouped send/recv (``comm=None``: one rank, no
    exchange). Made by EpGroup; holds the communication stream and events of the overlapped path."""

    def __init__(self, comm, rank, size, device, hidden, chunks, overlap):
        self.comm, self.rank, self.size, self.device = comm, int(rank), int(size), device
        self.hidden, self.chunks = int(hidden), int(chunks)
        self.overlap = overlap  # None: per call, by the size of the transfer
        self._cstream = None  # the communication stream of the overlapped path (made on first use)
        self._events = []     # reused CUDA events of the overlapped path
        self._transfers = {}  # capacity mode: (P, row bytes, reverse) -> _transfer's result, made once
        self._launches = {}   # launch set-ups (kernel, grid, threads, constant arguments), made once
        # None, or called with the stream of each NCCL exchange right after it is queued (EpGroup._first_call:
        # the first call of an op waits for its exchanges before it loads any kernel it has not used yet)
        self.settle = None

    def failed_op(self):
        """None: NCCL reports its failures through the communicator (``comm.async_error()``)."""
        return None

    def close(self):
        """Nothing to release: the communicator is borrowed; the stream and events go with the object."""

    # -- the interface ---------------------------------------------------------------------------------
    def forward(self, call, h, x, w, op, *, expand=True, want_w=False, fp8=None, zero=True, tpe=None, scale=False):
        """The dispatch direction (``op``: ``"dispatch"`` or ``"combine_bwd"``): the rows of ``x [T,H]`` (and
        fp32 weights ``w [T,K]`` or None, received into the handle's recv_wk) to every rank that needs them.

        Returns, with ``expand``, ``(rows [N,H] expert-major, weights [N] fp32 or None)``: padding rows
        zero (``zero=False``: left unwritten), ``weights[n] = recv_wk[src_slot[n]]`` when ``want_w``;
        without, the received rows ``[rows,H]`` in the handle's layout (source-major). ``fp8``: an
        :class:`moe_rt._ep_rows.Fp8Rows` (with ``expand``): ``x`` holds packed FP8 rows, which ep_expand_rows
        splits (or dequantizes) into ``fp8``'s outputs as it writes them (on the serial path too, instead of
        the permutation family's dispatch); ``rows`` is their tuple. The serial path with ``zero=False``
        expands with ep_expand_rows too (the permutation family's dispatch zeroes the rows without a slot).
        ``tpe``: None or an int32 ``[L]`` array the handle's tokens_per_expert is copied into (dispatch's third
        result; one device-to-device copy on the call's stream, queued first: prepare wrote the counts).
        ``scale`` (with ``want_w``): the rows times their weights by ep_scale_rows after the expand (weights None)."""
        if scale:
            out, out_w = self.forward(call, h, x, w, op, expand=expand, want_w=True, fp8=fp8, zero=zero, tpe=tpe)
            scale_rows(call, out, out_w)
            return out, None
        if tpe is not None:
            tokens_per_expert(call, h, tpe)
        rb = int(x.shape[1]) * x.dtype.itemsize  # the rows' width: hidden, or packed FP8 rows
        if not expand:
            if self._overlapped(h, rb):
                # the transfer still runs in parts; the expert-side kernel runs after it
                return self._forward_overlapped(call, h, x, w, lambda buf, lo, hi: None)
            return self._forward(call, h, x, w)
        N, xp = h.sizes["N"], call.xp
        if self._overlapped(h, rb):
            # expand each part as it lands
            out = xp.empty((N, int(x.shape[1])), x.dtype) if fp8 is None else fp8.empty(xp.empty, N)
            out_w = xp.empty(N, np.float32) if want_w else None
            pv = recv_wk(h) if want_w else None
            # weights received with the rows are in after the last part; the forward's (w None) from the start
            late = w is not None
            self._forward_overlapped(
                call, h, x, w,
                lambda buf, lo, hi, rows=None, side=False: _expand_rows(call, h, buf, out, lo, hi, rows, side, fp8),
                lambda: fill_outputs(call, h, out, None if late else out_w, None if late else pv, fp8, zero),
                own_direct=True)
            if late and out_w is not None:
                fill_rows(call, h, None, out_w, pv)
            return out, out_w
        recv_buf = self._forward(call, h, x, w)
        if fp8 is not None or not zero:  # the packed rows split (or dequantized) as they are expanded
            out = xp.empty((N, int(x.shape[1])), x.dtype) if fp8 is None else fp8.empty(xp.empty, N)
            out_w = xp.empty(N, np.float32) if want_w else None
            _expand_rows(call, h, recv_buf, out, 0, h.sizes["rows"], fp8=fp8)
            fill_outputs(call, h, out, out_w, recv_wk(h) if want_w else None, fp8, zero)
            return out, out_w
        plan = plan_view(h)
        if op == "combine_bwd" and not want_w:
            return permutation.combine_backward(recv_buf, plan, stream=call.stream)[0], None
        return permutation.dispatch(recv_buf, plan, recv_wk(h) if want_w else None, stream=call.stream)

    def reduce(self, call, h, y, w, gw, op):
        """The combine direction (``op``: ``"combine"`` or ``"dispatch_bwd"``): each received token's local
        expert rows of ``y [N,H]`` reduced (``combine``: weighted by ``w [rows,K]`` or unweighted when None,
        the permutation family's combine; ``dispatch_bwd``: its dispatch_backward, with ``gw [N]`` fp32 or
        None going back to the slots), sent back and summed by the owner over ranks.

        Returns ``(out [T,H] y.dtype, grad_w [T,K] fp32, or None when gw is None)``."""
        T = h.sizes["T"]
        want_w = gw is not None
        if self._overlapped(h, self.hidden * y.dtype.itemsize):
            zw = slot_values(call, h, gw) if want_w else None
            if op == "combine":
                def produce(lo, hi):
                    return permutation.combine(y, _subplan(h, lo, hi), None if w is None else w[lo:hi],
                                               stream=call.stream)
            else:
                def produce(lo, hi):
                    return permutation.dispatch_backward(y, _subplan(h, lo, hi), stream=call.stream)[0]
            return self._backward_overlapped(call, h, produce, zw, T, y.dtype, want_w)
        if op == "combine":
            z, zw = permutation.combine(y, plan_view(h), w, stream=call.stream), None
        else:
            z, zw = permutation.dispatch_backward(y, plan_view(h), gw, stream=call.stream)
        return self._backward(call, h, z, zw, T, y.dtype, want_w)

    # -- the transfer ----------------------------------------------------------------------------------
    def _host_counts(self, h):
        """(send rows per peer, send offsets, recv rows per peer, recv offsets) on the host."""
        R, P = self.size, h.sizes["P"]
        if h.mode == "capacity":
            send_off, o = [], 0
            for d in range(R):
                send_off.append(o)
                if d != self.rank:
                    o += P
            return [P] * R, send_off, [P] * R, [s * P for s in range(R)]
        m = h.state["host_meta"]
        sc = [min(int(m[meta_index("send_counts", R) + d]), P) for d in range(R)]
        rc = [min(int(m[meta_index("recv_counts", R) + s]), P) for s in range(R)]
        so = [int(m[meta_index("send_off", R) + d]) for d in range(R)]
        ro = [int(m[meta_index("recv_off", R) + s]) for s in range(R)]
        return sc, so, rc, ro

    def _transfer(self, h, rb, reverse):
        """``(sc, so, rc, ro, parts)``: :meth:`_host_counts` and the parts of a transfer of rows of ``rb`` bytes
        (:meth:`_chunk_plan`; ``reverse``: the combine direction, what was received goes back); in capacity
        mode the same for every handle of a row size, made once."""
        key = (h.sizes["P"], rb, reverse) if h.mode == "capacity" else None
        t = self._transfers.get(key) if key is not None else None
        if t is None:
            sc, so, rc, ro = self._host_counts(h)
            parts = self._chunk_plan(rc, ro, sc, so, rb) if reverse else self._chunk_plan(sc, so, rc, ro, rb)
            t = (sc, so, rc, ro, parts)
            if key is not None:
                self._transfers[key] = t
        return t

    def _send_rows(self, h):
        R, P = self.size, h.sizes["P"]
        if h.mode == "capacity":
            return (R - 1) * P
        return int(h.state["host_meta"][meta_index("send_rows", R)])

    def _pack(self, call, h, x, w, send_buf, recv_buf, send_w, recv_w, sel, node=None):
        """ep_pack_rows: ``sel`` 0 = every destination, 1 = the destinations outside ``node`` (``(lo, hi)``,
        default this rank alone: every remote one) only, 2 = the own share only, 3 = the own share's weights
        only."""
        sz = h.sizes
        R, me, P, K, rows = sz["R"], sz["rank"], sz["P"], sz["K"], sz["rows"]
        send_rows = int(send_buf.shape[0])
        if not sz["T"] or not rows + send_rows:
            return
        rb = x.shape[1] * x.dtype.itemsize
        sp, rp = (send_buf.data.ptr if send_rows else 0), (recv_buf.data.ptr if rows else 0)
        u = unit(rb, x.data.ptr, sp, rp)
        key = ("pack", rb, u, sel, node, P, K, call.device_id)
        c = self._launches.get(key)
        if c is None:
            bound(self._launches)
            units = rb // u
            lo, hi = (me, me + 1) if node is None else node
            c = self._launches[key] = (
                _jit.function(FILE, f"ep_pack_rows<{UNITS[u]}>"),
                (max(1, min(P, _jit.device_properties(call.device_id)["sm_count"] * 8 // R)), 1 if sel >= 2 else R),
                int(min(512, max(32, -(-units // 4 // 32) * 32))),
                (np.int32(R), np.int32(me), np.int32(P), np.int32(K), np.int64(units), np.int32(sel), np.int32(lo),
                 np.int32(hi)))
        _jit.launch_raw(c[0], c[1], c[2],
                        (x.data.ptr, sp, rp, w.data.ptr if w is not None else 0,
                         send_w.data.ptr if send_w is not None and send_rows else 0,
                         recv_w.data.ptr if recv_w is not None and rows else 0, regions(h)["send_tok"],
                         regions(h)["meta"], *c[3]), 0, call.stream)

    def _forward_buffers(self, call, h, x, w):
        """(row bytes, send rows, receive rows, send weights, receive weights) of a forward transfer; the
        received weights land in the handle's recv_wk."""
        xp, sz, H = call.xp, h.sizes, int(x.shape[1])
        send_rows = self._send_rows(h)
        return (H * x.dtype.itemsize, xp.empty((send_rows, H), x.dtype), xp.empty((sz["rows"], H), x.dtype),
                xp.empty((send_rows, sz["K"]), np.float32) if w is not None else None,
                h.view("recv_wk") if w is not None else None)

    def _forward(self, call, h, x, w):
        """Rows of x (and weights [T,K]) to every rank that needs them: returns the [rows,H] receive buffer
        (source-major) and writes received weights into the handle's recv_wk. Serial, on the caller's
        stream."""
        s, K = call.stream, h.sizes["K"]
        rb, send_buf, recv_buf, send_w, recv_w = self._forward_buffers(call, h, x, w)
        self._pack(call, h, x, w, send_buf, recv_buf, send_w, recv_w, 0)
        if self.size > 1:
            for c_sc, c_so, c_rc, c_ro in self._transfer(h, rb, False)[4]:
                self._exchange(s, rb, K, (send_buf, send_w, c_sc, c_so), (recv_buf, recv_w, c_rc, c_ro))
        return recv_buf

    def _forward_overlapped(self, call, h, x, w, consume, local=None, own_direct=False):
        """The forward transfer overlapped with its consumer. The remote rows are packed first; the
        communication stream (after an event on the caller's stream) sends them in parts, one NCCL group
        and one event per part; meanwhile the caller's stream runs ``local()`` (other local work to
        overlap) and consumes the own share, then waits for each part's event and runs ``consume(recv_buf,
        lo, hi)`` on that part's received rows. The own share is packed into ``recv_buf`` and consumed
        there, or, with ``own_direct``, consumed straight from x as ``consume(x, lo, hi, rows)`` (``rows``:
        the x row of each received row; only its weights are packed).
        The caller's stream has waited for every part when this returns, so later work on it (including the
        reuse of these buffers by CuPy's pool, which is ordered on the caller's stream) follows the
        transfer."""
        s, K, me = call.stream, h.sizes["K"], self.rank
        # every buffer the communication stream touches exists before the event it first waits on
        rb, send_buf, recv_buf, send_w, recv_w = self._forward_buffers(call, h, x, w)
        sc, so, rc, ro, parts = self._transfer(h, rb, False)
        if parts:
            self._pack(call, h, x, w, send_buf, recv_buf, send_w, recv_w, 1)
            cs = self._comm_stream()
            ev = self._event(0)
            ev.record(s)
            cs.wait_event(ev)
            for i, (c_sc, c_so, c_rc, c_ro) in enumerate(parts):
                self._exchange(cs, rb, K, (send_buf, send_w, c_sc, c_so), (recv_buf, recv_w, c_rc, c_ro))
                self._event(1 + i).record(cs)
        if not own_direct:
            self._pack(call, h, x, w, send_buf, recv_buf, send_w, recv_w, 2)
        elif w is not None:
            self._pack(call, h, x, w, send_buf, recv_buf, send_w, recv_w, 3)
        if local is not None:
            local()
        if rc[me]:
            side = bool(parts)
            if own_direct:
                P = h.sizes["P"]
                consume(x, ro[me], ro[me] + rc[me], h.view("recv_tok")[me * P:me * P + rc[me]], side)
            else:
                consume(recv_buf, ro[me], ro[me] + rc[me])
        for i, (_, _, c_rc, c_ro) in enumerate(parts):
            s.wait_event(self._event(1 + i))
            for p in range(self.size):
                if c_rc[p]:
                    if own_direct:
                        consume(recv_buf, c_ro[p], c_ro[p] + c_rc[p], None, i + 1 < len(parts))
                    else:
                        consume(recv_buf, c_ro[p], c_ro[p] + c_rc[p])
        return recv_buf

    def _exchange(self, s, rb, K, send, recv):
        """One grouped NCCL exchange with every peer on stream ``s``. ``send`` and ``recv`` are ``(rows,
        weights or None, counts[R], offsets[R])``: peer p gets ``counts[p]`` rows of ``rb`` bytes (and K fp32
        weights each) from row ``offsets[p]``. The send rows may instead be a list over peers of arrays
        holding exactly the rows for that peer (the offsets then apply to the weights only). The rank's
        own share never goes through NCCL."""
        (s_rows, s_w, sc, so), (r_rows, r_w, rc, ro) = send, recv
        comm, me = self.comm, self.rank
        wb = K * 4
        comm.group_start()
        try:
            for p in range(comm.size):
                if p == me:
                    continue
                if sc[p]:
                    ptr = s_rows[p].data.ptr if isinstance(s_rows, list) else s_rows.data.ptr + so[p] * rb
                    comm.send(ptr, sc[p] * rb, "uint8", p, s.ptr)
                    if s_w is not None:
                        comm.send(s_w.data.ptr + so[p] * wb, sc[p] * wb, "uint8", p, s.ptr)
                if rc[p]:
                    comm.recv(r_rows.data.ptr + ro[p] * rb, rc[p] * rb, "uint8", p, s.ptr)
                    if r_w is not None:
                        comm.recv(r_w.data.ptr + ro[p] * wb, rc[p] * wb, "uint8", p, s.ptr)
        finally:
            comm.group_end()
        if self.settle is not None:
            self.settle(s)

    def exchange_box(self, s, outbox, inbox, send, recv, seg, off):
        """Part of prepare's box (kernels/ep.cu, prepare) in one grouped NCCL exchange on stream ``s``: peer p
        gets ``send[p]`` int32 words from ``outbox`` + ``p*seg + off`` words (its segment), and this rank
        receives ``recv[p]`` words into ``inbox`` + ``p*seg + off`` (device addresses; the own segment never
        goes through NCCL)."""
        comm, me = self.comm, self.rank
        comm.group_start()
        try:
            for p in range(comm.size):
                if p == me:
                    continue
                at = 4 * (p * seg + off)
                if send[p]:
                    comm.send(outbox + at, send[p], "int32", p, s.ptr)
                if recv[p]:
                    comm.recv(inbox + at, recv[p], "int32", p, s.ptr)
        finally:
            comm.group_end()
        if self.settle is not None:
            self.settle(s)

    def _back_buffers(self, call, h, dtype, with_w):
        """(row bytes, rows coming back [send rows, H], their weight partials [send rows, K] or None) of a
        reverse transfer: what was received goes back, into the rows that were sent."""
        xp, K, H = call.xp, h.sizes["K"], self.hidden
        send_rows = self._send_rows(h)
        return (H * np.dtype(dtype).itemsize, xp.empty((send_rows, H), dtype),
                xp.empty((send_rows, K), np.float32) if with_w else None)

    def _backward(self, call, h, z, zw, T, out_dtype, want_w):
        """Send each source's partial rows z [rows,H] (and zw [rows,K]) back; the owner sums over ranks.
        Serial, on the caller's stream."""
        s, K = call.stream, h.sizes["K"]
        rb, back, back_w = self._back_buffers(call, h, z.dtype, zw is not None)
        if self.size > 1:
            # the reverse of dispatch: what was received goes back, into the rows that were sent
            for c_sc, c_so, c_rc, c_ro in self._transfer(h, rb, True)[4]:
                self._exchange(s, rb, K, (z, zw, c_sc, c_so), (back, back_w, c_rc, c_ro))
        return self._owner_sum(call, h, z, 0, zw, back, back_w, T, out_dtype, want_w)

    def _backward_overlapped(self, call, h, produce, zw, T, dtype, want_w):
        """The reverse transfer overlapped with its producer. ``produce(lo, hi)`` returns (on the caller's
        stream) the partial rows ``[hi-lo, H]`` of received rows ``[lo, hi)``; ``zw`` is None or the whole
        ``[rows,K]`` weight partials, complete before this is called. The parts going back to peers are
        produced first, each followed by an event on the caller's stream and its NCCL group on the
        communication stream; the own share is produced while they travel; the caller's stream then waits
        for the communication stream (the produced parts stay referenced until then) and runs the owner
        sum."""
        s, K, me = call.stream, h.sizes["K"], self.rank
        rb, back, back_w = self._back_buffers(call, h, dtype, zw is not None)
        # the reverse of dispatch: what was received goes back, into the rows that were sent
        sc, so, rc, ro, parts = self._transfer(h, rb, True)
        cs = self._comm_stream() if parts else None
        sent = []
        for i, (c_sc, c_so, c_rc, c_ro) in enumerate(parts):
            pieces = [produce(c_so[p], c_so[p] + c_sc[p]) if c_sc[p] else None for p in range(self.size)]
            sent.append(pieces)
            ev = self._event(i)
            ev.record(s)
            cs.wait_event(ev)
            self._exchange(cs, rb, K, (pieces, zw, c_sc, c_so), (back, back_w, c_rc, c_ro))
        own = produce(ro[me], ro[me] + rc[me]) if rc[me] else None
        if parts:
            ev = self._event(len(parts))
            ev.record(cs)
            s.wait_event(ev)
        out = self._owner_sum(call, h, own, ro[me], zw, back, back_w, T, dtype, want_w)
        del sent
        return out

    def _owner_sum(self, call, h, own, own_shift, zw, back, back_w, T, out_dtype, want_w):
        """out [T,H] (and grad_w [T,K]): the owner's fp32 sum over ranks; ``own`` holds the own partial rows
        from received row ``own_shift`` on (the whole [rows,H] partials with 0)."""
        xp, s = call.xp, call.stream
        sz = h.sizes
        R, me, K, L, Tmax, H = sz["R"], sz["rank"], sz["K"], sz["L"], sz["Tmax"], self.hidden
        out = xp.empty((T, H), out_dtype)
        gw = xp.empty((T, K), np.float32) if want_w else None
        if T:
            dt = np.dtype(out_dtype)
            has_own = own is not None and own.size
            bp, op_, outp = (back.data.ptr if back.size else 0), (own.data.ptr if has_own else 0), out.data.ptr
            vec = (H * dt.itemsize) % 16 == 0 and outp % 16 == 0 and op_ % 16 == 0 and bp % 16 == 0
            key = ("owner_sum", dt, vec, T, K, call.device_id)
            c = self._launches.get(key)
            if c is None:
                bound(self._launches)
                nper = 16 // dt.itemsize if vec else 1
                fn = _jit.function(FILE, f"ep_owner_sum<{_jit.ctype(dt)}, {'true' if vec else 'false'}>")
                _jit.set_max_dynamic_shared(fn, R * 8)
                c = self._launches[key] = (
                    fn, grid(T * 8, call.device_id, threads=8), int(min(512, max(32, -(-(H // nper) // 32) * 32))),
                    (np.int32(R), np.int32(me), np.int32(Tmax), np.int32(K), np.int32(L), np.int32(T), np.int64(H)))
            a = regions(h)
            _jit.launch_raw(c[0], c[1], c[2],
                            (bp, op_, outp, back_w.data.ptr if back_w is not None and back_w.size else 0,
                             zw.data.ptr if zw is not None and zw.size else 0, gw if gw is not None else 0,
                             a["send_pos"], a["routing"], a["meta"], *c[3], np.int64(own_shift)),
                            R * 8, s)
        return out, gw

    # -- overlap helpers -------------------------------------------------------------------------------
    def _overlapped(self, h, row_bytes):
        """Whether this call overlaps its transfer of rows of ``row_bytes`` with the local work. A local
        choice: the serial path sends the same parts in the same NCCL groups, so ranks may choose
        differently."""
        if self.size == 1:
            return False
        if self.overlap is not None:
            return self.overlap
        return self._send_rows(h) * row_bytes >= _OVERLAP_MIN_BYTES

    def _comm_stream(self):
        """The group's communication stream (non-blocking: no implicit sync with the legacy stream)."""
        if self._cstream is None:
            import cupy

            # The highest priority (CUDA clamps -100 to the device's greatest): the NCCL kernel's blocks are
            # scheduled ahead of the expand/reduce kernels running beside it, which would otherwise hold
            # every SM while the peer's matching blocks spin.
            with cupy.cuda.Device(self.device):
                self._cstream = cupy.cuda.Stream(non_blocking=True, priority=-100)
        return self._cstream

    def _event(self, i):
        """Reused event ``i``. Re-recording is safe: a wait binds to the record made before it."""
        import cupy

        while len(self._events) <= i:
            with cupy.cuda.Device(self.device):
                self._events.append(cupy.cuda.Event(disable_timing=True))
        return self._events[i]

    def _parts(self, n, rb):
        """Row bounds of the parts of a pair's ``n`` rows (a function of n alone: both ends agree)."""
        if n <= 0:
            return []
        c = self.chunks
        if _MIN_CHUNK_BYTES > 0:
            c = min(c, max(1, n * rb // _MIN_CHUNK_BYTES))
        c = min(c, n)
        return [(n * i // c, n * (i + 1) // c) for i in range(c)]

    def _chunk_plan(self, sc, so, rc, ro, rb):
        """The transfer split into parts: ``[(send counts, send offsets, recv counts, recv offsets)]`` over
        peers, one tuple per NCCL group. Part i of the rows of a pair travels in group i on both of its
        ranks, so each group's sends and receives are matched inside it and the groups cannot deadlock."""
        R, me = self.size, self.rank
        sp = [[] if p == me else self._parts(sc[p], rb) for p in range(R)]
        rp = [[] if p == me else self._parts(rc[p], rb) for p in range(R)]
        n = max(len(x) for x in sp + rp)
        plan = []
        for i in range(n):
            c_sc, c_so, c_rc, c_ro = [0] * R, [0] * R, [0] * R, [0] * R
            for p in range(R):
                if i < len(sp[p]):
                    lo, hi = sp[p][i]
                    c_sc[p], c_so[p] = hi - lo, so[p] + lo
                if i < len(rp[p]):
                    lo, hi = rp[p][i]
                    c_rc[p], c_ro[p] = hi - lo, ro[p] + lo
            plan.append((c_sc, c_so, c_rc, c_ro))
        return plan


def _subplan(h, lo, hi):
    """The permutation plan of received rows ``[lo, hi)``: the same expert-major layout (``num_rows`` N),
    ``dst_row`` restricted to those rows; views, no copy; cached on the handle."""
    cache = h.state.setdefault("subplans", {})
    plan = cache.get((lo, hi))
    if plan is None:
        full = plan_view(h)
        v = full._v
        plan = cache[(lo, hi)] = permutation.Plan.from_arrays(
            v["dst_row"][lo:hi], v["src_slot"], v["seg_start"], v["counts"], v["tokens_per_expert"],
            num_rows=full.num_rows, align_size=full.align_size, num_out_tokens=full.num_out_tokens)
    return plan


def _expand_rows(call, h, buf, out, lo, hi, rows=None, side=False, fp8=None):
    """out[dst_row[r,k]] = buf[r] for the received rows lo <= r < hi (raw bytes; ep_expand_rows); with
    ``rows`` (int32 [hi-lo] on the device), out[dst_row[r,k]] = buf[rows[r-lo]] instead. ``fp8``: an Fp8Rows;
    buf's rows are packed FP8 rows and ``out`` the tuple of its outputs, which the kernel's sink writes."""
    sz = h.sizes
    K, N = sz["K"], sz["N"]
    rb = int(buf.shape[1]) * buf.dtype.itemsize
    if hi <= lo or N == 0 or rb == 0:
        return
    if fp8 is None:
        u = unit(rb, buf.data.ptr, out.data.ptr)
        fn = _jit.function(FILE, f"ep_expand_rows<{UNITS[u]}, 4>")
        outs = (out.data.ptr, 0, np.int32(0))
    else:
        u = unit(rb, buf.data.ptr)
        Fp8Rows.check_unit(u)
        sink, *outs = fp8.sink(out)
        fn = _jit.function(FILE, f"ep_expand_rows<uint4, 4, {sink}>")
    units = rb // u
    _jit.set_max_dynamic_shared(fn, K * 4)
    per = -(-units // 4)  # 4 units per thread in flight
    threads = int(min(1024, max(32, -(-per // 32) * 32)))
    src = buf.data.ptr if rows is not None else buf.data.ptr + lo * rb
    # beside a transfer: one CTA per two SMs, so that the NCCL kernel keeps its share of memory bandwidth
    grid = hi - lo if not side else min(hi - lo, max(1, _jit.device_properties(call.device_id)["sm_count"] // 2))
    _jit.launch(fn, grid, threads, (src, outs[0], regions(h)["dst_row"] + lo * K * 4,
                                    rows.data.ptr if rows is not None else 0, np.int32(K), np.int64(units),
                                    np.int64(hi - lo), outs[1], outs[2]),
                shared_mem=K * 4, stream=call.stream)
