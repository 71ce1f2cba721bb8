"""The mixed transport of expert parallelism (moe_rt/ep.py; docs/ep.md §2): a group whose ranks span several
nodes moves rows to the ranks of its own node through peer memory (:class:`moe_rt._ep_direct.DirectTransport`
restricted to the node) and to the other nodes' ranks through NCCL grouped send/recv
(:class:`moe_rt._ep_nccl.NcclTransport`'s pack and exchange), within the same op and into the same receive
layout, behind the interface every transport offers (see :mod:`moe_rt.ep`).

Nodes: ranks ``[n*local_size, (n+1)*local_size)`` form node ``n`` (``EpGroup(local_size=)``). With
``local_size=1`` every peer is remote (all NCCL, through this module); with ``local_size=R`` the group uses
the direct transport itself, so this module never sees one node.

- Dispatch direction (:meth:`MixedTransport.forward`): the direct pass first: the node's barrier, then one
  ``ep_direct_dispatch`` that pushes this rank's rows to the node's other ranks and expands the node's rows
  (the own share straight from ``x``) into the expert-major rows; then the NCCL pass on the same stream:
  ``ep_pack_rows`` packs the rows for the other nodes' ranks only, one grouped send/recv per part
  (``chunks``) with those ranks, and ``ep_expand_rows`` writes each remote source's received rows into the
  same expert-major rows. Padding rows and the received weights (``recv_wk``: the direct pass copies its
  rows' weights from its stage, the NCCL pass then receives the remote rows' weights in place) are laid out
  last. Without ``expand`` the remote rows are received straight into the buffer the direct pass returns
  (its stage in capacity mode, whose row ``s*P + j`` is the received row ``s*P + j``; the packed rows in
  exact mode).
- Combine direction (:meth:`MixedTransport.reduce`): the node's barrier; the partial rows of the rows
  received from other nodes (the permutation family's combine / dispatch_backward over the handle's plan
  restricted to those rows) go back through NCCL straight into their owners' direct stages (row ``q*P +
  pos``: where a node peer ``q`` would have pushed them; weight partials into the weight stage alike); then
  one ``ep_direct_combine`` reduces the node's rows into their owners' stages and sums every token over all
  ranks in ascending rank order from the stage (waiting only for the node's chunk flags: the other ranks'
  rows are in before the kernel starts). The order and rounding are the NCCL transport's owner sum, so the
  results are bitwise those of the other transports.

Serial and overlapped: inside the direct kernel, pushes and expands (or reductions and sums) of the node's
chunks overlap as on the direct transport; the NCCL pass runs on the caller's stream after the direct
kernel (dispatch direction) or before it (combine direction), not beside it: the fused kernel's grid fills
the device while it waits for its node's flags, and an NCCL kernel beside it could wait for SMs that a peer
needs to finish (``overlap`` does not apply). prepare exchanges its segments through NCCL with every peer
(the NCCL transport's :meth:`exchange_box`).

Dead peers: a node peer that never reaches the barrier is reported through the direct transport's error
word (``failed_op``); a remote one shows as NCCL work that never ends, which the group's host waits time
out (docs/ep.md §5).
"""
from __future__ import annotations

import numpy as np

from moe_rt import permutation
from moe_rt._ep_nccl import _expand_rows, _subplan
from moe_rt._ep_rows import fill_outputs, recv_wk, scale_rows, slot_values, tokens_per_expert


class MixedTransport:
    """Rows to the ranks of this rank's node ``[lo, hi)`` through ``direct`` (a DirectTransport made with
    ``node=(lo, hi)``), to every other rank through ``nccl`` (an NcclTransport). Made by EpGroup."""

    def __init__(self, direct, nccl):
        self.direct, self.nccl = direct, nccl
        self.lo, self.hi = direct.lo, direct.hi
        self.R, self.me = nccl.size, nccl.rank

    def failed_op(self):
        """The op whose wait on a node peer timed out (the direct transport's error word), or None."""
        return self.direct.failed_op()

    def close(self):
        """The direct transport's teardown (a collective among the node's ranks; the communicator stays open)."""
        self.direct.close()

    def exchange_box(self, s, outbox, inbox, send, recv, seg, off):
        """prepare's segments: through NCCL with every peer (NcclTransport.exchange_box)."""
        self.nccl.exchange_box(s, outbox, inbox, send, recv, seg, off)

    def remote(self, counts):
        """``counts`` over ranks with the node's entries zeroed (the NCCL pass leaves them to peer memory)."""
        return [0 if self.lo <= p < self.hi else int(c) for p, c in enumerate(counts)]

    def remote_ranges(self):
        """The other nodes' ranks as at most two ranges of sources: ``[0, lo)`` and ``[hi, R)``."""
        return [(a, b) for a, b in ((0, self.lo), (self.hi, self.R)) if a < b]

    # -- the interface ---------------------------------------------------------------------------------
    def forward(self, call, h, x, w, op, *, expand=True, want_w=False, fp8=None, zero=True, tpe=None, scale=False):
        """The dispatch direction (``op``: ``"dispatch"`` or ``"combine_bwd"``), as every transport's: returns,
        with ``expand``, ``(rows [N,H] expert-major, weights [N] fp32 or None)`` (padding rows zero, or left
        unwritten with ``zero=False``); without, the received rows ``[rows,H]`` in the handle's layout. The
        direct pass, then the NCCL pass (module notes). ``fp8`` (an :class:`moe_rt._ep_rows.Fp8Rows`, with
        ``expand``): ``x`` holds packed FP8 rows, which both passes' expand split (or dequantize) into its
        outputs; ``rows`` is their tuple. ``tpe``: None or an int32 ``[L]`` array the handle's tokens_per_expert
        is copied into (dispatch's third result; one device-to-device copy on the call's stream, queued first).
        ``scale`` (with ``want_w``): the rows times their weights by ep_scale_rows after both passes (weights None)."""
        if scale:
            out, out_w = self.forward(call, h, x, w, op, expand=expand, want_w=True, fp8=fp8, zero=zero, tpe=tpe)
            scale_rows(call, out, out_w)
            return out, None
        if tpe is not None:
            tokens_per_expert(call, h, tpe)
        d = self.direct
        if not expand:
            buf = d.push(call, h, x, w, op, recv=True)
            self._forward_remote(call, h, x, w, buf, None)
            return buf
        N, xp = h.sizes["N"], call.xp
        out = xp.empty((N, int(x.shape[1])), x.dtype) if fp8 is None else fp8.empty(xp.empty, N)
        out_w = xp.empty(N, np.float32) if want_w else None
        d.push(call, h, x, w, op, out, fp8)
        self._forward_remote(call, h, x, w, None, out, fp8)
        fill_outputs(call, h, out, out_w, recv_wk(h) if want_w else None, fp8, zero)
        return out, out_w

    def reduce(self, call, h, y, w, gw, op):
        """The combine direction (``op``: ``"combine"`` or ``"dispatch_bwd"``), as every transport's: returns
        ``(out [T,H] y.dtype, grad_w [T,K] fp32, or None when gw is None)``. The node's barrier, the remote
        partials through NCCL into the owners' stages, then the direct kernel (module notes)."""
        d, nc = self.direct, self.nccl
        zw = None if gw is None else slot_values(call, h, gw)
        s, sz = call.stream, h.sizes
        R, P, K, H = sz["R"], sz["P"], sz["K"], int(y.shape[1])
        rb = H * y.dtype.itemsize
        rows_st, w_st = d.stages(rb, K, s, d._op_wait(op))
        d.barrier(s, op)
        sc, so, rc, ro = nc._host_counts(h)
        back, back_off = self.remote(rc), ro  # what this rank received from another node goes back
        ret, ret_off = self.remote(sc), [p * P for p in range(R)]  # into the stage row of (source p, pos)
        parts = nc._chunk_plan(back, back_off, ret, ret_off, rb)
        if parts:
            pieces = []  # (first received row, partial rows [n,H]) per range of remote sources
            for a, b in self.remote_ranges():
                lo_row, hi_row = ro[a], ro[b - 1] + rc[b - 1]
                if hi_row <= lo_row:
                    continue
                sub = _subplan(h, lo_row, hi_row)
                if op == "combine":
                    z = permutation.combine(y, sub, None if w is None else w[lo_row:hi_row], stream=s)
                else:
                    z = permutation.dispatch_backward(y, sub, stream=s)[0]
                pieces.append((lo_row, hi_row, z))

            def rows_of(first, n):
                for lo_row, hi_row, z in pieces:
                    if lo_row <= first and first + n <= hi_row:
                        return z[first - lo_row:first - lo_row + n]
                raise RuntimeError(f"internal: received rows [{first}, {first + n}) have no partials")

            stage = d.view(rows_st, R * P, H, y.dtype)
            wstage = d.view(w_st, R * P, K, np.float32) if zw is not None else None
            for c_sc, c_so, c_rc, c_ro in parts:
                send = [rows_of(c_so[p], c_sc[p]) if c_sc[p] else None for p in range(R)]
                nc._exchange(s, rb, K, (send, zw, c_sc, c_so), (stage, wstage, c_rc, c_ro))
        return d.combine(call, h, y, w, op, zw=zw, barrier=False)

    # -- the NCCL pass ---------------------------------------------------------------------------------
    def _forward_remote(self, call, h, x, w, buf, out, fp8=None):
        """The rows of ``x`` (and weights ``w``, received into recv_wk) to and from the other nodes' ranks:
        pack, grouped send/recv in parts; received rows land in ``buf`` ([rows,H] in the handle's layout:
        row ``ro[s] + j``), or, when ``buf`` is None, in a buffer of their own and are expanded into ``out``
        (expert-major [N,H]; with ``fp8``, the tuple of its outputs)."""
        nc, xp, sz = self.nccl, call.xp, h.sizes
        K, H = sz["K"], int(x.shape[1])
        rb = H * x.dtype.itemsize
        sc, so, rc, ro = nc._host_counts(h)
        parts = nc._chunk_plan(self.remote(sc), so, self.remote(rc), ro, rb)
        if not parts:
            return
        send_rows = nc._send_rows(h)  # send_off covers every peer; the node's rows stay unused
        send_buf = xp.empty((send_rows, H), x.dtype)
        send_w = xp.empty((send_rows, K), np.float32) if w is not None else None
        recv_buf = buf if buf is not None else xp.empty((sz["rows"], H), x.dtype)
        recv_w = h.view("recv_wk") if w is not None else None
        nc._pack(call, h, x, w, send_buf, recv_buf, send_w, recv_w, 1, node=(self.lo, self.hi))
        for c_sc, c_so, c_rc, c_ro in parts:
            nc._exchange(call.stream, rb, K, (send_buf, send_w, c_sc, c_so), (recv_buf, recv_w, c_rc, c_ro))
        if out is not None:
            for a, b in self.remote_ranges():
                _expand_rows(call, h, recv_buf, out, ro[a], ro[b - 1] + rc[b - 1], fp8=fp8)
