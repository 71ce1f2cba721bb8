"""The direct peer-memory transport of expert parallelism within a node (moe_rt/ep.py; specs/ep.md §8.4,
backend ``ipc``).

:class:`moe_rt.ep.EpGroup` is the algorithm (validation, the plan, the handle); this module moves its rows,
behind the interface every transport offers (see :mod:`moe_rt.ep`): :meth:`DirectTransport.forward` (the
dispatch direction) and :meth:`DirectTransport.reduce` (the combine direction), each a barrier and one
fused kernel, plus ``failed_op`` and ``close``. Every rank
owns a few plain ``cudaMalloc`` buffers (not CuPy pool sub-allocations: a CUDA IPC handle covers a whole
allocation) and maps every peer's buffers into its own address space with ``cudaIpcOpenMemHandle`` (lazy
peer access). The IPC handles travel once per buffer through the group's communicator (an all-gather on a
device uint8 buffer, then a host read: buffers are made outside CUDA-graph capture). The mapped addresses
of each buffer kind are kept in a small device int64 table ``[R]`` (this rank's own address at ``me``).

Buffers:

- the barrier region: uint32 slots ``[R]`` per rank (slot ``s`` of rank ``r`` = the last epoch rank ``s``
  reached), made with the transport (at group creation);
- ``state``: uint32 ``[2]`` in this rank's device memory: the barrier epoch (advanced by the barrier
  kernel itself, so CUDA-graph replays stay valid) and a sticky failure flag;
- the error word: one int32 of pinned host memory mapped into the device (``cudaHostAllocMapped``; with
  unified addressing its host address is valid on the device): a timed-out barrier writes its op code
  there, and host waits poll it (:meth:`DirectTransport.failed_op`);
- receive stages, made on the first op that needs them (a collective: every rank issues the ops of a
  group in the same order): ``R * P`` rows per rank (row ``(src s, pos j)`` at ``s*P + j``, ``P`` the
  pair capacity: ``max_tokens_per_rank`` in exact mode), one per row size, plus one fp32 weight stage
  ``[R*P, K]``. Both directions push rows into the reader's stage: dispatch each sent row, combine each
  received row's partial over the local experts, back into its owner's stage;
- prepare's box (one per top-k, made on the first ``prepare`` with it, a collective): int32, two halves
  alternating with the barrier epoch, each one segment per source (counts, then rows), pushed into it over
  peer memory by each source's send side before prepare's barrier and read by this rank after it
  (:meth:`DirectTransport.prepare_box`; kernels/ep.cu: in capacity mode one kernel, ``ep_prepare_direct``,
  runs the send side, the barrier and the received side);
- chunk flags: uint32 ``[R*P]`` per rank (flag ``s*P + c``: the epoch in which rank ``s`` finished chunk
  ``c``, ``C`` consecutive positions of its pair with this rank, of its writes into this rank's stages),
  made at group creation.

One op: barrier (every rank has finished the previous op, so nobody still reads a stage about to be
written) -> one kernel (``ep_direct_dispatch`` / ``ep_direct_combine``) whose blocks write their chunks into
the peers' stages, each chunk followed by its flag, and consume the chunks written to this rank as their
flags arrive (expand into the expert-major rows; sum over ranks, in ascending rank order). The next op's
leading barrier protects the stages from being overwritten early.

Teardown (:meth:`DirectTransport.close`, called by ``EpGroup.close``; a collective): wait for the device,
one last barrier (no peer still touches this rank's buffers; bounded by the timeout), close every IPC
mapping of the peers' buffers, then free this rank's buffers and the error word. The caller closes its
handles first; the communicator is borrowed and stays open (the group never closes it). Every rank closes
the group at the same point of its op sequence.
"""
from __future__ import annotations

import ctypes
import hashlib
import socket

import numpy as np

from moe_rt import _jit
from moe_rt._ep_rows import Fp8Rows, bound, fill_outputs, regions, slot_values
from moe_rt._ep_rows import unit as _unit
from moe_rt.permutation import _resident_ctas

_FILE = "ep.cu"
_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned", 2: "unsigned short", 1: "unsigned char"}
_PUSH_UNROLL = 8  # 16-byte units a lane has in flight while copying or expanding a row
_names = ["ep_direct_barrier", "ep_direct_row_map"]
_names += [f"ep_copy_rows<{u}>" for u in _UNITS.values()]
_names += [f"ep_direct_dispatch<{u}, {_PUSH_UNROLL}>" for u in _UNITS.values()]
_names += [f"ep_direct_dispatch<uint4, {_PUSH_UNROLL}, {k}>" for k in Fp8Rows.sink_names()]
for _c in _jit.CTYPES.values():
    for _v in ("true", "false"):
        _names.append(f"ep_direct_combine<{_c}, {_v}>")
_THREADS = 512  # the fused kernels: one warp per row, 16 rows of a chunk at a time
_MAX_CHUNK = 32  # rows a chunk flag covers, at most
_jit.register(_FILE, _names)

OPS = {1: "dispatch", 2: "combine", 3: "dispatch_bwd", 4: "combine_bwd", 5: "close", 6: "prepare"}
OP_CODES = {v: k for k, v in OPS.items()}
_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def host_identity() -> int:
    """A 63-bit hash of this machine's hostname and boot id (two processes share it iff they run on one
    node, up to hash collisions)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    d = hashlib.blake2b(f"{socket.gethostname()}\0{boot}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") & ((1 << 63) - 1)


def _bus_code(bus_id: str) -> int:
    """'dddd:bb:dd.f' (hex) -> one int64."""
    try:
        dom, bus, rest = bus_id.strip().split(":")
        dev, fn = rest.split(".")
        return (int(dom, 16) << 24) | (int(bus, 16) << 16) | (int(dev, 16) << 8) | int(fn, 16)
    except ValueError:
        raise RuntimeError(f"unexpected PCI bus id {bus_id!r}") from None


def _bus_string(code: int) -> str:
    return f"{code >> 24:04x}:{(code >> 16) & 0xff:02x}:{(code >> 8) & 0xff:02x}.{code & 0xf}"


def all_gather_int64(comm, values, stream, wait) -> np.ndarray:
    """``[R, n]`` int64: every rank's ``values`` (n int64), all-gathered through ``comm`` on a device buffer
    on ``stream``; ``wait(stream)`` waits with the group's deadline before the host read."""
    import cupy

    v = np.asarray(values, np.int64).reshape(-1)
    n, R, me = v.size, comm.size, comm.rank
    with stream:
        buf = cupy.zeros(R * n, np.int64)
        buf[me * n:(me + 1) * n].set(v, stream=stream)
        comm.all_gather(buf.data.ptr + me * n * 8, buf.data.ptr, n, "int64", stream.ptr)
    wait(stream)
    return buf.get(stream=stream).reshape(R, n)


def probe_peers(comm, device, wait):
    """Whether every pair of ranks is on one node with peer access (a collective: two all-gathers on the
    device's current stream). Returns ``(ok, reason)``: ``ok`` the same on every rank; ``reason`` names
    the first pair that fails (as this rank sees it)."""
    import cupy
    from cupy.cuda import runtime

    with cupy.cuda.Device(device):
        return _decide(comm, device, cupy.cuda.get_current_stream(), wait, runtime)


def _decide(comm, device, stream, wait, runtime):
    ident = all_gather_int64(comm, [host_identity(), _bus_code(runtime.deviceGetPCIBusId(device)), device],
                             stream, wait)
    reason = local_reason(ident, comm.rank, device, runtime)
    oks = all_gather_int64(comm, [0 if reason else 1], stream, wait)
    if all(int(o) for o in oks[:, 0]):
        return True, ""
    if reason:
        return False, reason
    return False, f"rank {int(np.argmin(oks[:, 0]))} has a peer on another node or without peer access"


def probe_nodes(comm, device, wait, local_size=None):
    """The group's nodes and whether every pair of ranks within a node has peer access (a collective: two
    all-gathers on the device's current stream, as :func:`probe_peers`). ``local_size``: the ranks per node
    (node n = ranks ``[n*local_size, (n+1)*local_size)``), or None to derive it from the ranks' hosts
    (:func:`node_size`). Returns ``(local_size, ok, reason)``, the same on every rank but ``reason`` (as
    this rank sees it); ``local_size`` is None, and ``ok`` False, when the hosts do not form such nodes."""
    import cupy
    from cupy.cuda import runtime

    with cupy.cuda.Device(device):
        return _decide_nodes(comm, device, cupy.cuda.get_current_stream(), wait, runtime, local_size)


def node_size(hosts):
    """Ranks per node from each rank's host identity: ``n`` when ranks ``[k*n, (k+1)*n)`` share a host and
    each such block has a host of its own (``n`` = the ranks on rank 0's host), else None."""
    R = len(hosts)
    n = sum(1 for h in hosts if h == hosts[0])
    if R % n:
        return None
    blocks = [list(hosts[k * n:(k + 1) * n]) for k in range(R // n)]
    if any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        return None
    return n


def _decide_nodes(comm, device, stream, wait, runtime, local_size):
    ident = all_gather_int64(comm, [host_identity(), _bus_code(runtime.deviceGetPCIBusId(device)), device],
                             stream, wait)
    me = comm.rank
    n = local_size if local_size is not None else node_size([int(v) for v in ident[:, 0]])
    if n is None:  # every rank sees the same identities: none of them takes the second all-gather
        return None, False, "the ranks' hosts do not form nodes of consecutive ranks of equal size"
    lo = me // n * n
    reason = local_reason(ident, me, device, runtime, peers=range(lo, lo + n))
    oks = all_gather_int64(comm, [0 if reason else 1], stream, wait)
    if all(int(o) for o in oks[:, 0]):
        return n, True, ""
    if reason:
        return n, False, reason
    return n, False, f"rank {int(np.argmin(oks[:, 0]))} has a node peer on another host or without peer access"


def local_reason(ident, me, device, runtime, peers=None) -> str:
    """Why rank ``me`` (on local device ordinal ``device``) cannot reach some peer directly ("" if it can
    reach all): ``ident[r]`` = (host identity, PCI bus code, ordinal) of rank r; ``peers``: the ranks to
    check (default every rank)."""
    for p in (range(len(ident)) if peers is None else peers):
        if p == me:
            continue
        if ident[p][0] != ident[me][0]:
            return f"ranks {me} and {p} are on different nodes"
        bus = _bus_string(int(ident[p][1]))
        try:
            local = runtime.deviceGetByPCIBusId(bus)
        except runtime.CUDARuntimeError:
            return f"rank {p}'s GPU ({bus}) is not visible to rank {me} (CUDA_VISIBLE_DEVICES)"
        if local == device:
            return f"ranks {me} and {p} use the same GPU ({bus})"
        if not runtime.deviceCanAccessPeer(device, local):
            return f"rank {me}'s GPU cannot access rank {p}'s GPU ({bus}) as a peer"
    return ""


class _Shared:
    """One IPC-shared allocation per rank: ``local`` (this rank's, from cudaMalloc), ``ptrs`` (every rank's,
    as mapped here; 0 for a rank outside ``peers``), ``table`` (the same as a device int64 [R] array).
    ``peers``: the ranks whose allocations this rank maps (default every rank; the mixed transport's node:
    IPC handles of another node's GPUs cannot be opened). The handles are all-gathered over every rank."""

    def __init__(self, comm, nbytes, stream, wait, zero=False, peers=None):
        import cupy
        from cupy.cuda import runtime

        R, me = comm.size, comm.rank
        self.local = 0
        self.opened = []
        self.local = int(runtime.malloc(max(int(nbytes), 256)))
        try:
            if zero:
                runtime.memsetAsync(self.local, 0, max(int(nbytes), 256), stream.ptr)
            handle = np.frombuffer(bytes(runtime.ipcGetMemHandle(self.local)), np.uint8)
            if handle.size != _HANDLE_BYTES:  # pragma: no cover - fixed by the CUDA ABI
                raise RuntimeError(f"unexpected IPC handle size {handle.size}")
            with stream:
                buf = cupy.zeros(R * _HANDLE_BYTES, np.uint8)
                buf[me * _HANDLE_BYTES:(me + 1) * _HANDLE_BYTES].set(handle, stream=stream)
                comm.all_gather(buf.data.ptr + me * _HANDLE_BYTES, buf.data.ptr, _HANDLE_BYTES, "uint8",
                                stream.ptr)
            wait(stream)
            handles = buf.get(stream=stream).reshape(R, _HANDLE_BYTES)
            ptrs = []
            peers = range(R) if peers is None else peers
            for r in range(R):
                if r == me:
                    ptrs.append(self.local)
                elif r not in peers:
                    ptrs.append(0)
                else:
                    p = int(runtime.ipcOpenMemHandle(handles[r].tobytes(), runtime.cudaIpcMemLazyEnablePeerAccess))
                    self.opened.append(p)
                    ptrs.append(p)
            self.ptrs = ptrs
            with stream:
                self.table = cupy.asarray(np.array(ptrs, np.int64))
        except BaseException:
            self.close()
            raise
        self.nbytes = int(nbytes)

    def close_mappings(self):
        """Close this process's mappings of the peers' allocations (idempotent)."""
        from cupy.cuda import runtime

        opened, self.opened = self.opened, []
        for p in opened:
            runtime.ipcCloseMemHandle(p)

    def free(self):
        """Free this rank's allocation (idempotent; the device must be idle)."""
        from cupy.cuda import runtime

        if self.local:
            local, self.local = self.local, 0
            runtime.free(local)

    def close(self):
        self.close_mappings()
        self.free()


def _stage_unit(st):
    """The widest copy unit (16 to 1 bytes) dividing every address of shared buffer ``st`` (made once)."""
    u = getattr(st, "unit_", None)
    if u is None:
        u = st.unit_ = _unit(16, *st.ptrs)
    return u


class DirectTransport:
    """Rows between the ranks of one node through peer memory. Made by EpGroup (a collective).

    ``wait(stream)`` waits for the exchanges of the creation (with the creation's deadline);
    ``op_wait(stream, op)`` (default: ``wait``) those of an op that makes a receive stage (with the op's
    deadline, naming the op). ``node``: ``(lo, hi)``, the ranks this rank reaches through peer memory
    (default every rank; the mixed transport (:mod:`moe_rt._ep_mixed`) passes this rank's node): only
    their buffers are mapped, the barrier and the fused kernels serve only them."""

    def __init__(self, comm, device, pair_rows, timeout, wait, op_wait=None, node=None):
        import cupy
        from cupy.cuda import runtime

        self.comm, self.device = comm, int(device)
        self.R, self.me = int(comm.size), int(comm.rank)
        self.lo, self.hi = (0, self.R) if node is None else (int(node[0]), int(node[1]))
        if not self.lo <= self.me < self.hi <= self.R:  # pragma: no cover - made by EpGroup
            raise RuntimeError(f"internal: rank {self.me} outside its node [{self.lo}, {self.hi})")
        self.P = int(pair_rows)
        self.timeout_ns = int(min(float(timeout) * 1e9, 2**62))
        self._wait = wait
        self._op_wait = op_wait if op_wait is not None else (lambda stream, op: wait(stream))
        self._stages = {}
        self._order = []
        # per-call work made once: (row bytes, K) -> the stage pair; launch set-ups (kernel, grid, constant
        # arguments) by what they depend on; stage views by (address, rows, cols, dtype)
        self._pairs, self._launches, self._views = {}, {}, {}
        self.closed = False
        self._err_ptr = 0
        self.bar = self.flags = None
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            self._err_ptr = int(runtime.hostAlloc(64, runtime.hostAllocMapped))
            self._err = (ctypes.c_int32 * 1).from_address(self._err_ptr)
            self._err[0] = 0
            try:
                with stream:
                    self.state = cupy.zeros(2, np.uint32)
                peers = range(self.lo, self.hi)
                self.bar = _Shared(comm, 4 * self.R, stream, wait, zero=True, peers=peers)
                self.flags = _Shared(comm, 4 * self.R * self.P, stream, wait, zero=True, peers=peers)
            except BaseException:
                self.close()
                raise

    # -- errors ----------------------------------------------------------------------------------------
    def failed_op(self):
        """The op whose barrier timed out (read from the mapped error word), or None."""
        if self.closed or not self._err_ptr:
            return None
        code = int(self._err[0])
        return OPS.get(code, f"op {code}") if code else None

    # -- buffers ---------------------------------------------------------------------------------------
    def stages(self, row_bytes, K, stream, wait=None):
        """``(rows stage, weights stage)`` for rows of ``row_bytes`` and K fp32 weights, made on first use (a
        collective: every rank asks in the same order; a host sync, so never inside CUDA-graph capture).
        ``wait(stream)``: the calling op's deadline wait for that exchange (default: the group creation's)."""
        pair = self._pairs.get((row_bytes, K))
        if pair is not None:
            return pair
        out = []
        for key, rb in ((("rows", int(row_bytes)), int(row_bytes)), (("weights", int(K)), 4 * int(K))):
            st = self._stages.get(key)
            if st is None:
                st = self._shared(key, self.R * self.P * rb, f"its {rb}-byte-row receive stage", stream, wait)
            out.append(st)
        pair = self._pairs[(row_bytes, K)] = (out[0], out[1])
        return pair

    def prepare_box(self, K, half, stream, wait=None):
        """prepare's box for top-``K`` routing (kernels/ep.cu, prepare): per rank two halves of ``half`` int32
        words (counts, then rows; the group sizes them), IPC-shared; made on the first prepare with this K (a
        collective with a host sync, so never inside CUDA-graph capture)."""
        key = ("prepare", int(K))
        st = self._stages.get(key)
        if st is None:
            st = self._shared(key, 8 * int(half), f"the box of prepare for topk={int(K)}", stream, wait)
        return st

    def _shared(self, key, nbytes, what, stream, wait):
        """Make and keep the shared buffer ``key`` (a collective; refused during CUDA-graph capture)."""
        from cupy.cuda import runtime

        if runtime.streamIsCapturing(stream.ptr):
            raise RuntimeError(f"the direct EP transport makes {what} on the first op that needs it (a collective "
                               "with a host sync): run that op once before CUDA-graph capture")
        st = self._stages[key] = _Shared(self.comm, nbytes, stream, wait or self._wait,
                                         peers=range(self.lo, self.hi))
        self._order.append(key)
        return st

    def view(self, st, rows, cols, dtype):
        """A CuPy ``[rows, cols]`` array over this rank's part of stage ``st`` (no copy, not owned; made once)."""
        key = (st.local, rows, cols, dtype)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = self._view(st, rows, cols, dtype)
        return v

    def _view(self, st, rows, cols, dtype):
        import cupy

        dtype = np.dtype(dtype)
        nbytes = rows * cols * dtype.itemsize
        if nbytes > st.nbytes:  # pragma: no cover - sizes come from the group
            raise RuntimeError(f"internal: stage of {st.nbytes} bytes, view of {nbytes}")
        mem = cupy.cuda.UnownedMemory(st.local, max(nbytes, 1), self, self.device)
        return cupy.ndarray((rows, cols), dtype, cupy.cuda.MemoryPointer(mem, 0))

    # -- the interface ---------------------------------------------------------------------------------
    def forward(self, call, h, x, w, op, *, expand=True, want_w=False, fp8=None, zero=True):
        """The dispatch direction (``op``: ``"dispatch"`` or ``"combine_bwd"``): barrier (every rank finished
        the previous op) -> one kernel pushing this rank's rows of ``x [T,H]`` (and fp32 weights ``w [T,K]``
        or None, received into the handle's recv_wk) into the destinations' stages chunk by chunk.

        Returns, with ``expand``, ``(rows [N,H] expert-major, weights [N] fp32 or None)``: the kernel expands
        each received chunk as it lands, then padding rows are zeroed (left unwritten with ``zero=False``) and
        ``weights[n] = recv_wk[src_slot[n]]`` laid out when ``want_w``; without, the received rows ``[rows,H]``
        in the handle's layout (the stage itself in capacity mode, a packed copy in exact mode). ``fp8``: an
        :class:`moe_rt._ep_rows.Fp8Rows` (with ``expand``): ``x`` holds packed FP8 rows, which the kernel
        splits (or dequantizes) into ``fp8``'s outputs as it expands them; ``rows`` is their tuple."""
        if not expand:
            stage, row_map = self._push(call, h, x, w, op, None)
            return self._recv_buf(call, h, stage, row_map)
        N = h.sizes["N"]
        out = call.empty((N, int(x.shape[1])), x.dtype) if fp8 is None else fp8.empty(call.xp, N)
        out_w = call.empty((N,), np.float32) if want_w else None
        self._push(call, h, x, w, op, out, False, fp8)
        fill_outputs(call, h, out, out_w, regions(h)["recv_wk"] if want_w else None, fp8, zero)
        return out, out_w

    def reduce(self, call, h, y, w, gw, op):
        """The combine direction (``op``: ``"combine"`` or ``"dispatch_bwd"``): barrier (every rank finished
        reading the stages of the previous op) -> one kernel reducing each received row over this rank's
        experts (``y [N,H]`` expert-major, weights ``w [rows,K]`` fp32 (or their device address) or None;
        ``gw [N]`` fp32 or None taken back to the slots as weight partials) straight into its owner's stage
        chunk by chunk, and summing this rank's tokens over ranks as their chunks land.

        Returns ``(out [T,H] y.dtype, grad_w [T,K] fp32, or None when gw is None)``."""
        zw = None if gw is None else slot_values(call, h, gw)
        s, sz = call.stream, h.sizes
        rows_st, w_st = self.stages(int(y.shape[1]) * y.dtype.itemsize, sz["K"], s,
                                    lambda st: self._op_wait(st, op))
        self.barrier(s, op)
        return self.combine(call, h, y, w, zw, rows_st, w_st, sz["T"], gw is not None, op)

    def _push(self, call, h, x, w, op, out, want_stage=True, fp8=None):
        """The stages for x's rows, the op's barrier, then :meth:`dispatch` expanding into ``out`` (expert-major
        [N,H], or ``fp8``'s outputs; None: only wait for every chunk). Returns ``(stage [R*P,H] view (None
        unless want_stage), row map or None)``: received row r sits at stage row ``map[r]`` (capacity mode: at
        r; the own share is not in the stage unless ``out`` is None). The received weights are copied into the
        handle's recv_wk."""
        s = call.stream
        sz = h.sizes
        K, H = sz["K"], x.shape[1]
        rows_st, w_st = self.stages(H * x.dtype.itemsize, K, s, lambda st: self._op_wait(st, op))
        self.barrier(s, op)
        self.dispatch(call, h, x, w, rows_st, w_st, out, op, fp8)
        row_map = self._row_map(call, h)
        if w is not None:
            self.copy_rows(call, w_st.local, row_map, regions(h)["recv_wk"], None, sz["rows"], K * 4)
        return (self.view(rows_st, sz["R"] * sz["P"], H, x.dtype) if want_stage else None), row_map

    def _row_map(self, call, h):
        """None in capacity mode (received row r is stage row r: recv_off[s] = s*P); in exact mode the stage
        row s*P + j of each packed received row recv_off[s] + j (int32 [rows] on the device, made on first
        use and cached on the handle: handles rebuilt from a buffer by the adapters make it again)."""
        if h.mode == "capacity":
            return None
        m = h.state.get("row_map")
        if m is None:
            m = h.state["row_map"] = self.row_map(call, h)
        return m

    def _recv_buf(self, call, h, stage, row_map):
        """The received rows in the handle's layout ([rows,H]): the stage itself in capacity mode, a packed
        copy in exact mode."""
        if row_map is None:
            return stage
        rows, H = h.sizes["rows"], int(stage.shape[1])
        buf = call.xp.empty((rows, H), stage.dtype)
        self.copy_rows(call, stage.data.ptr, row_map, buf.data.ptr, None, rows, H * stage.dtype.itemsize)
        return buf

    # -- kernels ---------------------------------------------------------------------------------------
    def barrier(self, stream, op):
        """ep_direct_barrier on ``stream`` among the ranks of the node (``op`` names the op in a timeout)."""
        c = self._launches.get(op)
        if c is None:  # every argument is fixed per op
            bound(self._launches)
            c = self._launches[op] = (
                _jit.function(_FILE, "ep_direct_barrier"), max(32, -(-(self.hi - self.lo) // 32) * 32),
                (self.bar.table, np.int32(self.R), np.int32(self.me), self.state, np.int64(self.timeout_ns),
                 self._err_ptr, np.int32(OP_CODES[op]), np.int32(self.lo), np.int32(self.hi)))
        _jit.launch_raw(c[0], 1, c[1], c[2], 0, stream)

    def _grid(self, fn, call, work):
        """Blocks of a fused kernel: at most one resident wave (its blocks wait on each other's peers), at
        most ``work`` items."""
        return max(1, min(int(work), _resident_ctas(fn, _THREADS, call.device_id)))

    def chunk_rows(self, h):
        """Rows a chunk flag covers, the same on every rank (writers and readers index flags by it): from the
        pair capacity P, about four push items per block of a wave of two blocks on each of 132 SMs when
        the pairs are full, at least one row per warp of a block (the kernels move a chunk's rows one warp
        each: a smaller chunk leaves warps idle; measured on 2 H100 at T=4096, C=4 kept 4 of 16 warps
        busy), at most _MAX_CHUNK rows; never more than P. (The pairs pushed: those with the node's other
        ranks.)"""
        P = h.sizes["P"]
        c = max(_THREADS // 32, -(-P * max(1, self.hi - self.lo - 1) // (4 * 2 * 132)))
        return int(max(1, min(_MAX_CHUNK, P, c)))

    def dispatch(self, call, h, x, w, rows_st, w_st, out, op, fp8=None):
        """ep_direct_dispatch (after the op's leading barrier): this rank's rows (and fp32 weights [T,K], or
        None) pushed into the peers' stages chunk by chunk, and every received row expanded into ``out``
        (the expert-major [N,H] rows, or None: only wait for every chunk; with ``fp8``, an Fp8Rows, the tuple
        of its outputs, which the kernel's sink splits the packed rows into) as its chunk lands; the own share
        straight from x."""
        sz = h.sizes
        K, P = sz["K"], sz["P"]
        rb = x.shape[1] * x.dtype.itemsize
        if rb == 0:
            return
        xp_ = x.data.ptr
        if fp8 is None:
            sink, outs = None, (out.data.ptr if out is not None else 0, 0, np.int32(0))
            u = min(_unit(rb, xp_, outs[0]), _stage_unit(rows_st))  # powers of two: the unit of every address
        else:
            u = min(_unit(rb, xp_), _stage_unit(rows_st))
            Fp8Rows.check_unit(u)
            sink, *outs = fp8.sink(out)
        key = ("dispatch", rb, u, K, P, op, sink, call.device_id)
        c = self._launches.get(key)
        if c is None:  # the kernel, its grid, the stage tables and the arguments after the op's pointers
            bound(self._launches)
            fn = _jit.function(_FILE, f"ep_direct_dispatch<{_UNITS[u]}, {_PUSH_UNROLL}>" if sink is None
                               else f"ep_direct_dispatch<uint4, {_PUSH_UNROLL}, {sink}>")
            C = self.chunk_rows(h)
            c = self._launches[key] = (
                fn, self._grid(fn, call, -(-P // C) * (self.hi - self.lo)), (rows_st.table, w_st.table, self.flags.table),
                (self.state, self._err_ptr, np.int64(self.timeout_ns), np.int32(OP_CODES[op]), np.int32(self.R),
                 np.int32(self.me), np.int32(P), np.int32(K), np.int32(C), np.int64(rb // u), np.int32(self.lo),
                 np.int32(self.hi)))
        a = regions(h)
        _jit.launch_raw(c[0], c[1], _THREADS,
                        (xp_, w.data.ptr if w is not None else 0, *c[2], a["send_tok"], a["meta"], a["dst_row"], *outs,
                         *c[3]), 0, call.stream)

    def combine(self, call, h, y, w, zw, rows_st, w_st, T, want_w, op):
        """ep_direct_combine (after the op's leading barrier): each received row's partial over its local
        experts (weights w [rows,K] or none; weight partials zw [rows,K] or None) pushed into its owner's stage
        chunk by chunk, then this rank's tokens summed over ranks from its own stage as the chunks land.
        Returns ``(out [T,H] in y's dtype, grad_w [T,K] fp32 or None)``."""
        sz = h.sizes
        K, H = sz["K"], y.shape[1]
        out = call.empty((T, H), y.dtype)
        gw = call.empty((T, K), np.float32) if want_w else None
        yp, outp = (y.data.ptr if y.size else 0), out.data.ptr
        vec = (H * y.dtype.itemsize) % 16 == 0 and yp % 16 == 0 and outp % 16 == 0 and _stage_unit(rows_st) == 16
        key = ("combine", y.dtype, vec, K, T, H, op, call.device_id)
        c = self._launches.get(key)
        if c is None:  # the kernel, its grid, the stage tables and the arguments after the op's pointers
            bound(self._launches)
            L, Tmax, P = sz["L"], sz["Tmax"], sz["P"]
            fn = _jit.function(_FILE, f"ep_direct_combine<{_jit.ctype(y.dtype)}, {'true' if vec else 'false'}>")
            C = self.chunk_rows(h)
            work = max(-(-P // C) * (self.hi - self.lo), -(-T // (_THREADS // 32)))
            c = self._launches[key] = (
                fn, self._grid(fn, call, work), (rows_st.table, w_st.table, self.flags.table),
                (self.state, self._err_ptr, np.int64(self.timeout_ns), np.int32(OP_CODES[op]), np.int32(self.R),
                 np.int32(self.me), np.int32(P), np.int32(K), np.int32(L), np.int32(Tmax), np.int32(T), np.int32(C),
                 np.int64(H), np.int32(self.lo), np.int32(self.hi)))
        a = regions(h)
        _jit.launch_raw(c[0], c[1], _THREADS,
                        (yp, w if w is not None else 0, zw if zw is not None else 0, *c[2], a["dst_row"],
                         a["send_pos"], a["routing"], a["meta"], outp, gw if gw is not None else 0,
                         *c[3]), 0, call.stream)
        return out, gw

    def copy_rows(self, call, src_ptr, src_map, dst_ptr, dst_map, rows, row_bytes, guarded=True):
        """ep_copy_rows: ``rows`` rows of ``row_bytes`` from src (row ``src_map[r]`` when a map is given) to dst
        (row ``dst_map[r]``); skipped on the device after a failed barrier when ``guarded``."""
        if rows <= 0 or row_bytes <= 0:
            return
        u = _unit(row_bytes, src_ptr, dst_ptr)
        key = ("copy", rows, row_bytes, u, guarded, call.device_id)
        c = self._launches.get(key)
        if c is None:
            bound(self._launches)
            units = row_bytes // u
            c = self._launches[key] = (
                _jit.function(_FILE, f"ep_copy_rows<{_UNITS[u]}>"),
                max(1, min(rows, _jit.device_properties(call.device_id)["sm_count"] * 16)),
                int(min(512, max(32, -(-units // 32) * 32))),
                (self.state if guarded else 0, np.int64(rows), np.int64(units)))
        _jit.launch_raw(c[0], c[1], c[2], (src_ptr, src_map if src_map is not None else 0, dst_ptr,
                                           dst_map if dst_map is not None else 0, *c[3]), 0, call.stream)

    def row_map(self, call, h):
        """int32 [rows]: the stage row (s*P + j) of each received row of the handle's layout."""
        sz = h.sizes
        rows = sz["rows"]
        m = call.xp.empty(max(rows, 1), np.int32)
        if rows:
            key = ("row_map", rows, sz["P"], call.device_id)
            c = self._launches.get(key)
            if c is None:
                bound(self._launches)
                c = self._launches[key] = (
                    _jit.function(_FILE, "ep_direct_row_map"),
                    max(1, min(-(-rows // 256), _jit.device_properties(call.device_id)["sm_count"] * 8)),
                    (np.int32(self.R), np.int32(sz["P"]), np.int64(rows)))
            _jit.launch_raw(c[0], c[1], 256, (regions(h)["meta"], *c[2], m), 0, call.stream)
        return m

    def close(self):
        """Teardown (a collective; idempotent): wait for this device, one last barrier (every rank has
        finished every op, so no peer still reads or writes this rank's buffers; it ends within the
        group's timeout even if a peer never comes), close every IPC mapping of the peers' buffers, then
        free this rank's own buffers and the error word."""
        if self.closed:
            return
        import cupy
        from cupy.cuda import runtime

        with cupy.cuda.Device(self.device):
            try:
                runtime.deviceSynchronize()
                if self.bar is not None and self.failed_op() is None:
                    stream = cupy.cuda.get_current_stream()
                    self.barrier(stream, "close")
                    stream.synchronize()
            finally:
                self.closed = True
                shared = [self._stages[k] for k in reversed(self._order)] + [b for b in (self.flags, self.bar) if b]
                self._stages, self._order, self.bar, self.flags = {}, [], None, None
                self._pairs, self._launches, self._views = {}, {}, {}
                for st in shared:  # every IPC mapping of the peers' buffers first
                    st.close_mappings()
                for st in shared:  # then this rank's own allocations
                    st.free()
                self.state = None
                if self._err_ptr:
                    p, self._err_ptr = self._err_ptr, 0
                    self._err = None
                    runtime.freeHost(p)
