"""The direct peer-memory transport of expert parallelism within a node (moe_rt/ep.py; specs/ep.md §8.4,
backend ``ipc``).

:class:`moe_rt.ep.EpGroup` is the algorithm (validation, the plan, the handle); this module moves its rows,
behind the interface every transport offers (see :mod:`moe_rt.ep`): :meth:`DirectTransport.forward` (the
dispatch direction) and :meth:`DirectTransport.reduce` (the combine direction), each a barrier and one
fused kernel (one call into the C core's direct group, csrc/ep_direct.c, which plans and launches them; the
dispatch kernel also writes the received weights, the padding rows' zeros and the laid-out weights), plus
``failed_op`` and ``close``. Every rank
owns a few plain device allocations (not CuPy pool sub-allocations: a CUDA IPC handle covers a whole
allocation) and maps every peer's buffers into its own address space with ``cuIpcOpenMemHandle`` (lazy
peer access): the C core's peer buffers (``moe_rt_peer_buffer_*``, csrc/peer.c; :class:`_Shared`). The IPC
handles travel once per buffer through the group's communicator (an all-gather on a device uint8 buffer, then
a host read after a wait with the op's deadline: buffers are made outside CUDA-graph capture). The mapped
addresses of each buffer kind are kept in a small device int64 table ``[R]`` (this rank's own address at
``me``).

Buffers:

- the barrier region: uint32 slots ``[R]`` per rank (slot ``s`` of rank ``r`` = the last epoch rank ``s``
  reached), made with the transport (at group creation);
- ``state``: uint32 ``[4]`` in this rank's device memory: the barrier epoch (advanced by the barrier
  kernel itself, so CUDA-graph replays stay valid), a sticky failure flag, and a uint64 counter the
  dispatch kernel's blocks claim its zero rows from (tagged with the epoch: no reset between ops);
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
import math
import socket

import numpy as np

from moe_rt import _core, _jit
from moe_rt._ep_rows import Fp8Rows
from moe_rt._ep_rows import unit as _unit

_FILE = "ep.cu"
_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned", 2: "unsigned short", 1: "unsigned char"}
_PUSH_UNROLL = 8  # 16-byte units a lane has in flight while copying or expanding a row
_names = ["ep_direct_barrier", "ep_direct_row_map"]
_names += [f"ep_copy_rows<{u}>" for u in _UNITS.values()]
_names += [f"ep_direct_dispatch<{u}, {_PUSH_UNROLL}>" for u in _UNITS.values()]
_names += [f"ep_direct_dispatch<uint4, {_PUSH_UNROLL}, {k}>" for k in Fp8Rows.sink_names()]
# combine_bwd's weighted rows (forward's scale): the sink that weights each expanded row
_names += [f"ep_direct_dispatch<uint4, {_PUSH_UNROLL}, RowScale<{c}>>" for c in _jit.CTYPES.values()]
for _c in _jit.CTYPES.values():
    for _v in ("true", "false"):
        _names.append(f"ep_direct_combine<{_c}, {_v}>")
_jit.register(_FILE, _names)

OPS = {1: "dispatch", 2: "combine", 3: "dispatch_bwd", 4: "combine_bwd", 5: "close", 6: "prepare"}
OP_CODES = {v: k for k, v in OPS.items()}


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


def no_progress(group, op, timeout) -> str:
    """The message of a group's host wait that ran past its deadline (``EpGroup._wait``, :class:`Wait`)."""
    return (f"{type(group).__name__}.{op}: no progress within {timeout:g} s (a peer rank is dead or did not call "
            "the same op); the communicator was aborted")


class Wait:
    """A group's host wait for op ``op`` with its deadline: ``wait(stream)`` is ``group._wait(stream, op,
    timeout)`` (it polls the stream and the communicator; past the deadline it aborts the communicator and raises
    TimeoutError naming the op). The core's peer buffers wait in C (moe_rt_peer_buffer_create) with
    :attr:`timeout_ms`; :meth:`error` turns that wait's timeout into the group's own TimeoutError."""

    def __init__(self, group, op, timeout=None):
        self.group, self.op, self.timeout = group, op, timeout

    def __call__(self, stream):
        self.group._wait(stream, self.op, self.timeout)

    @property
    def seconds(self) -> float:
        return float(self.group.timeout if self.timeout is None else self.timeout)

    @property
    def timeout_ms(self) -> int:
        return max(1, min(math.ceil(self.seconds * 1e3), 2**62))

    def error(self, exc):
        """The exception for the core wait's failure ``exc``: the group's TimeoutError naming the op for a timeout
        (or a barrier of the direct transport that timed out meanwhile), else ``exc``."""
        if isinstance(exc, TimeoutError):
            self.group._check_transport()
            return TimeoutError(no_progress(self.group, self.op, self.seconds))
        return exc


class _Shared:
    """One IPC-shared allocation per rank, a thin layer over the core's peer buffer (moe_rt_peer_buffer_*,
    csrc/peer.c): ``local`` (this rank's), ``ptrs`` (every rank's, as mapped here; 0 for a rank outside
    ``peers``), ``table`` (the same as a device int64 [R] array, the core's), ``nbytes``. ``peers``: the ranks
    whose allocations this rank maps, a range (default every rank; the mixed transport's node: IPC handles of
    another node's GPUs cannot be opened). The handles are all-gathered over every rank on ``stream``; the core
    waits for that exchange with ``wait``'s deadline (a :class:`Wait`): past it the core aborts the
    communicator, released here, and the group's TimeoutError naming the op is raised."""

    def __init__(self, comm, nbytes, stream, wait, zero=False, peers=None):
        import cupy
        from cupy.cuda import runtime

        R = int(comm.size)
        lo, hi = (0, R) if peers is None else (peers.start, peers.stop)
        if peers is not None and peers.step != 1:  # pragma: no cover - made by the transports
            raise RuntimeError(f"internal: peers must be a range of step 1, got {peers}")
        device = runtime.getDevice()
        self.local, self._buf, self.table = 0, None, None
        try:
            self._buf = _core.peer_buffer_create(_core.device(device), comm.handle, int(nbytes), bool(zero), lo, hi,
                                                 stream.ptr, wait.timeout_ms)
        except (TimeoutError, RuntimeError) as e:
            if comm.handle:
                comm.release_if_aborted()  # the core aborted it: release it as abort() does
            raise wait.error(e) from None
        b = self._buf
        self.local, self.ptrs, self.nbytes = b.local, list(b.ptrs), int(nbytes)
        mem = cupy.cuda.UnownedMemory(b.table, 8 * R, b, device)
        self.table = cupy.ndarray((R,), np.int64, cupy.cuda.MemoryPointer(mem, 0))

    def close_mappings(self):
        """Close this process's mappings of the peers' allocations (idempotent)."""
        if self._buf is not None:
            self._buf.close_mappings()

    def free(self):
        """Close any mapping left, then free this rank's allocation and the table (idempotent; the device must be
        idle)."""
        if self._buf is not None:
            b, self._buf = self._buf, None
            self.local, self.table = 0, None
            b.destroy()

    def close(self):
        self.close_mappings()
        self.free()


def _addr(a):
    """The device address of array ``a``, of an address given as an int (a transport's scratch), or 0 for None."""
    return 0 if a is None else a if type(a) is int else a.data.ptr


def _stage_unit(st):
    """The widest copy unit (16 to 1 bytes) dividing every address of shared buffer ``st`` (made once)."""
    u = getattr(st, "unit_", None)
    if u is None:
        u = st.unit_ = _unit(16, *st.ptrs)
    return u


class DirectTransport:
    """Rows between the ranks of one node through peer memory. Made by EpGroup (a collective).

    ``wait`` (a :class:`Wait`) waits for the exchanges of the creation (with the creation's deadline);
    ``op_wait(op)`` (default: ``wait``) is the :class:`Wait` of an op that makes a receive stage (with the op's
    deadline, naming the op). ``node``: ``(lo, hi)``, the ranks this rank reaches through peer memory
    (default every rank; the mixed transport (:mod:`moe_rt._ep_mixed`) passes this rank's node): only
    their buffers are mapped, the barrier and the fused kernels serve only them."""

    nccl = None  # no NCCL exchange (EpGroup._op_key / _first_call read it; the mixed transport has one)

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
        self._op_wait = op_wait if op_wait is not None else (lambda op: wait)
        self._stages = {}
        self._order = []
        # per-call work made once: (row bytes, K) -> the stage pair; stage views by (address, rows, cols, dtype)
        self._pairs, self._views = {}, {}
        self._scratch_mem, self._retired = {}, []  # _scratch: name -> (memory, words); superseded memory
        self.closed = False
        self._err_ptr = 0
        self.bar = self.flags = None
        self._core = None  # the core group (moe_rt_ep_direct_group): plans and launches every op's kernels
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            self._err_ptr = int(runtime.hostAlloc(64, runtime.hostAllocMapped))
            self._err = (ctypes.c_int32 * 1).from_address(self._err_ptr)
            self._err[0] = 0
            try:
                with stream:
                    self.state = cupy.zeros(4, np.uint32)
                peers = range(self.lo, self.hi)
                self.bar = _Shared(comm, 4 * self.R, stream, wait, zero=True, peers=peers)
                self.flags = _Shared(comm, 4 * self.R * self.P, stream, wait, zero=True, peers=peers)
                self._core = _core.ep_direct_group_create(
                    _core.device(self.device), self.R, self.me, self.lo, self.hi, self.P, self.timeout_ns,
                    self.bar.table.data.ptr, self.flags.table.data.ptr, self.state.data.ptr, self._err_ptr)
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
        self._core.add_stage(int(row_bytes), int(K), _stage_unit(out[0]), out[0].local, out[0].table.data.ptr,
                             out[1].local, out[1].table.data.ptr)
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
    def forward(self, call, h, x, w, op, *, expand=True, want_w=False, fp8=None, zero=True, tpe=None, scale=False):
        """The dispatch direction (``op``: ``"dispatch"`` or ``"combine_bwd"``): one core call
        (moe_rt_ep_direct_dispatch): barrier (every rank finished the previous op) -> one kernel pushing this rank's
        rows of ``x [T,H]`` (and fp32 weights ``w [T,K]`` or None, received into the handle's recv_wk) into the
        destinations' stages chunk by chunk -> the handle's row map (exact mode, first use).

        Returns, with ``expand``, ``(rows [N,H] expert-major, weights [N] fp32 or None)``: the kernel expands
        each received chunk as it lands (its weights into recv_wk and ``weights[n] = recv_wk[src_slot[n]]`` at
        its slots' rows when ``want_w``) and zeroes the padding rows (left unwritten with ``zero=False``; their
        weights zero either way) while the link carries the rows (``op`` combine_bwd: the weights' address in the
        group's scratch, :meth:`_scratch`, valid until the group's next op); without, the received rows ``[rows,H]``
        in the handle's layout (the stage itself in capacity mode, a packed copy in exact mode). ``fp8``: an
        :class:`moe_rt._ep_rows.Fp8Rows` (with ``expand``): ``x`` holds packed FP8 rows, which the kernel
        splits (or dequantizes) into ``fp8``'s outputs as it expands them; ``rows`` is their tuple. ``tpe``: None
        or an int32 ``[L]`` array (``op`` dispatch) the kernel copies the handle's tokens_per_expert into.
        ``scale`` (combine_bwd, ``want_w``): the kernel's sink weights each expanded row by its slot's weight as it
        writes it (rows and addresses 16-byte aligned; else the core adds ep_scale_rows after the kernel); the
        weights come back None."""
        if not expand:
            return self.push(call, h, x, w, op, recv=True)
        N = h.sizes["N"]
        out = call.empty((N, int(x.shape[1])), x.dtype) if fp8 is None else fp8.empty(call.empty, N, fp8.codes)
        out_w = None
        if want_w:  # combine_bwd's laid-out weights only scale its rows (EpGroup.combine_bwd): the handle's scratch
            out_w = call.empty((N,), np.float32) if op != "combine_bwd" else self._scratch(call, "row_w", N)
        self.push(call, h, x, w, op, out, fp8, fill=True, out_w=out_w, zero=zero, tpe=tpe, scale=scale)
        return out, None if scale else out_w

    def reduce(self, call, h, y, w, gw, op):
        """The combine direction (``op``: ``"combine"`` or ``"dispatch_bwd"``): one core call
        (moe_rt_ep_direct_combine): the weight partials' slots (with ``gw``), barrier (every rank finished reading
        the stages of the previous op) -> one kernel reducing each received row over this rank's experts
        (``y [N,H]`` expert-major, weights ``w [rows,K]`` fp32 (or their device address) or None; ``gw [N]`` fp32
        or None taken back to the slots as weight partials) straight into its owner's stage chunk by chunk, and
        summing this rank's tokens over ranks as their chunks land.

        Returns ``(out [T,H] y.dtype, grad_w [T,K] fp32, or None when gw is None)``."""
        return self.combine(call, h, y, w, op, gw=gw)

    def push(self, call, h, x, w, op, out=None, fp8=None, *, fill=False, out_w=None, zero=True, recv=False,
             tpe=None, scale=False):
        """The stages for x's rows (made on first use), then one core call: the op's barrier, ep_direct_dispatch
        expanding into ``out`` (expert-major [N,H], or ``fp8``'s outputs; None: only wait for every chunk) and
        writing the received weights into the handle's recv_wk, with ``fill`` the padding rows zeroed / ``out_w``
        laid out (:meth:`forward`), then the handle's row map (exact mode, first use). ``recv``: returns the
        received rows ``[rows,H]`` in the handle's layout (the stage itself in capacity mode (received row r is
        stage row r), a packed copy in exact mode); else None."""
        sz = h.sizes
        K, H = sz["K"], int(x.shape[1])
        rb = H * x.dtype.itemsize
        pair = self._pairs.get((rb, K))
        if pair is None:
            pair = self.stages(rb, K, call.stream, self._op_wait(op))
        rows_st = pair[0]
        m, make = self._row_map(call, h) if h.mode != "capacity" else (None, 0)
        buf = None
        if recv:
            buf = (self.view(rows_st, sz["R"] * sz["P"], H, x.dtype) if m is None
                   else call.xp.empty((sz["rows"], H), x.dtype))
        if fp8 is None:  # scale: the rows' dtype, for the sink that weights them
            dt = _core.CODES[x.dtype] if scale else 0
            kind, hid, o0, o1 = 0, 0, (out.data.ptr if out is not None else 0), 0
        elif fp8.dtype is None:
            kind, dt, hid, o0, o1 = 1, 0, fp8.H, out[0].data.ptr, out[1].data.ptr
        else:
            kind, dt, hid, o0, o1 = 2, _core.CODES[fp8.dtype], fp8.H, out[0].data.ptr, 0
        _core.ep_direct_dispatch(self._core, OP_CODES[op], self._handle(h), x.data.ptr, rb,
                                 w.data.ptr if w is not None else 0, kind, dt, hid, o0, o1,
                                 _addr(out_w), int(fill), int(zero),
                                 buf.data.ptr if recv and m is not None else 0, m.data.ptr if m is not None else 0,
                                 make, 1, call.stream_ptr, int(w is not None), 0 if tpe is None else tpe.data.ptr,
                                 int(scale))
        return buf

    def combine(self, call, h, y, w, op, *, gw=None, zw=None, barrier=True):
        """One core call (moe_rt_ep_direct_combine): [``gw`` taken back to the slots], [the op's barrier],
        ep_direct_combine: each received row's partial over its local experts (weights ``w [rows,K]`` or their
        address, or None; weight partials: ``gw [N]`` expert-major, or ``zw [rows,K]`` already laid out (the
        mixed transport), or None) pushed into its owner's stage chunk by chunk, then this rank's tokens summed
        over ranks from its own stage as the chunks land. Returns ``(out [T,H] in y's dtype, grad_w [T,K] fp32
        or None)``."""
        sz = h.sizes
        K, H, T = sz["K"], int(y.shape[1]), sz["T"]
        if gw is not None:
            zw = self._scratch(call, "slot_grads", sz["rows"] * K)
        rb = H * y.dtype.itemsize
        if (rb, K) not in self._pairs:
            self.stages(rb, K, call.stream, self._op_wait(op))
        out = call.empty((T, H), y.dtype)
        gwt = call.empty((T, K), np.float32) if zw is not None else None
        _core.ep_direct_combine(self._core, OP_CODES[op], self._handle(h), y.data.ptr, _core.CODES[y.dtype], H,
                                0 if w is None else w if isinstance(w, int) else w.data.ptr,
                                gw.data.ptr if gw is not None else 0, _addr(zw),
                                out.data.ptr, gwt.data.ptr if gwt is not None else 0, int(barrier), call.stream_ptr)
        return out, gwt

    def _handle(self, h):
        """The handle as the core takes it: (buffer, R, L, Tmax, K, P, rows, N, T, exact), made once per handle."""
        a = h.state.get("epd")
        if a is None:
            sz = h.sizes
            a = h.state["epd"] = (h.buffer.data.ptr, sz["R"], sz["L"], sz["Tmax"], sz["K"], sz["P"], sz["rows"],
                                  sz["N"], sz["T"], int(h.mode != "capacity"))
        return a

    def _scratch(self, call, name, n):
        """The address of fp32 working memory of ``n`` words, ``name``'s (combine_bwd's laid-out weights, the
        slots' weight partials of dispatch_bwd): written and read by one op's core call and kernels, kept by
        the group and reused by every op, as its stages are (the ops of a group run one after another on the
        device: each starts with a barrier and writes the same stages, so one op's use ends before the next
        one's begins). Made on first use through ``call.empty`` (like the stages: run an op once before
        CUDA-graph capture) and grown by doubling; a superseded one stays allocated until ``close``, as a
        captured graph may hold its address."""
        m = self._scratch_mem.get(name)
        if m is None or m.size < n:
            if m is not None:
                self._retired.append(m)
            m = self._scratch_mem[name] = call.empty((max(int(n), 1 if m is None else 2 * m.size),), np.float32)
        return m.data.ptr

    def _row_map(self, call, h):
        """``(map, make)``: None in capacity mode (received row r is stage row r: recv_off[s] = s*P); in exact mode
        int32 [max(rows,1)] on the device, the stage row s*P + j of each packed received row recv_off[s] + j,
        cached on the handle (handles rebuilt from a buffer by the adapters make it again) and computed by the
        core call that gets ``make`` = 1."""
        if h.mode == "capacity":
            return None, 0
        m = h.state.get("row_map")
        if m is not None:
            return m, 0
        m = h.state["row_map"] = call.xp.empty(max(h.sizes["rows"], 1), np.int32)
        return m, 1

    # -- kernels ---------------------------------------------------------------------------------------
    def barrier(self, stream, op):
        """ep_direct_barrier on ``stream`` among the ranks of the node (``op`` names the op in a timeout)."""
        _core.ep_direct_barrier(self._core, OP_CODES[op], stream.ptr)

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
                self._pairs, self._views = {}, {}
                self._scratch_mem, self._retired = {}, []
                if self._core is not None:
                    self._core.destroy()
                    self._core = None
                for st in shared:  # every IPC mapping of the peers' buffers first
                    st.close_mappings()
                for st in shared:  # then this rank's own allocations
                    st.free()
                self.state = None
                if self._err_ptr:
                    p, self._err_ptr = self._err_ptr, 0
                    self._err = None
                    runtime.freeHost(p)
