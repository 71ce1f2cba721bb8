"""Peer buffers through the C ABI (csrc/peer.c, include/moe_rt/moe_rt.h "Peer buffers") and the Python layer over
them (moe_rt._ep_direct._Shared): every bad argument returns MOE_RT_ERROR_INVALID_ARGUMENT with a message naming
it, a planning context MOE_RT_ERROR_NOT_SUPPORTED, never a crash; a communicator the core aborted refuses every
call but freeing; a timeout of the core's wait becomes the group's TimeoutError naming the op, with the
communicator released. On GPUs (tests/peer_worker.py under tools/launch.py) 2 and 4 ranks make peer buffers
through the C ABI, write a rank-specific pattern into every mapped peer's buffer through the device table, check
what each rank received, tear down, and a rank whose peers never come times out."""
from __future__ import annotations

import ctypes as C
import os
import subprocess
import sys

import pytest

from moe_rt import _core, _ep_direct
import test_c_abi
import test_c_comm
from conftest import GPU_COUNT
from test_c_abi import ROOT, H100, DeviceInfo, _err, _ok, libpath  # noqa: F401 - libpath: the library built here
from test_c_comm import FakeComm

OK, INVALID, NOT_SUPPORTED, TIMEOUT = 0, 1, 7, 10
P, I, L, S = C.c_void_p, C.c_int, C.c_int64, C.c_size_t


class PeerInfo(C.Structure):
    """moe_rt_peer_buffer_info."""
    _fields_ = [("local", C.c_void_p), ("ptrs", C.POINTER(C.c_void_p)), ("table", C.c_void_p), ("nbytes", C.c_size_t),
                ("nranks", C.c_int32), ("rank", C.c_int32), ("peer_lo", C.c_int32), ("peer_hi", C.c_int32)]


SIGNATURES = {
    **test_c_comm.SIGNATURES,
    **{n: test_c_abi.SIGNATURES[n] for n in ("moe_rt_context_create", "moe_rt_context_create_planning",
                                             "moe_rt_context_destroy")},
    "moe_rt_comm_aborted": (I, [P, C.POINTER(C.c_int)]),
    "moe_rt_peer_buffer_create": (I, [P, P, S, I, I, I, P, L, C.POINTER(P)]),
    "moe_rt_peer_buffer_get_info": (I, [P, C.POINTER(PeerInfo)]),
    "moe_rt_peer_buffer_close_mappings": (I, [P]),
    "moe_rt_peer_buffer_destroy": (I, [P]),
}


def load(path):
    return test_c_comm._load(path, SIGNATURES)


@pytest.fixture(scope="module")
def lib(libpath):
    return load(libpath)


@pytest.fixture
def planning(lib):
    info, ctx = DeviceInfo(**H100), P()
    _ok(lib, lib.moe_rt_context_create_planning(C.byref(info), C.byref(ctx)))
    yield ctx
    lib.moe_rt_context_destroy(ctx)


def test_status_name(lib):
    assert lib.moe_rt_status_name(TIMEOUT) == b"MOE_RT_ERROR_TIMEOUT"


def test_create_checks_every_argument(lib, planning):
    """Checked in order before the device is touched; then a planning context (no device) is refused."""
    create, out = lib.moe_rt_peer_buffer_create, P(1234)
    fake = FakeComm(None, 4, 1, 0)
    comm = C.cast(C.byref(fake), P)
    good = dict(ctx=planning, comm=comm, nbytes=1000, zero=1, lo=0, hi=4, stream=None, timeout=5000)

    def call(out=C.byref(out), **kw):
        a = {**good, **kw}
        return create(a["ctx"], a["comm"], a["nbytes"], a["zero"], a["lo"], a["hi"], a["stream"], a["timeout"], out)

    _err(lib, call(out=None), INVALID, "moe_rt_peer_buffer_create", "out is NULL")
    _err(lib, call(ctx=None), INVALID, "moe_rt_peer_buffer_create", "ctx is NULL", "moe_rt_context_create")
    assert out.value is None  # cleared on failure
    _err(lib, call(nbytes=(1 << 48) + 1), INVALID, "nbytes must be at most 2^48")
    _err(lib, call(zero=2), INVALID, "zero must be 0 or 1, got 2")
    _err(lib, call(zero=-1), INVALID, "zero must be 0 or 1, got -1")
    for lo, hi in ((2, 4), (-1, 4), (0, 5), (0, 1), (1, 1), (3, 2)):  # rank 1 of 4 must lie in [lo, hi)
        _err(lib, call(lo=lo, hi=hi), INVALID, "peer_lo <= rank < peer_hi <= nranks", "rank 1 of 4",
             f"got [{lo}, {hi})")
    for t in (0, -5):
        _err(lib, call(timeout=t), INVALID, f"timeout_ms must be >= 1, got {t}")
    # no communicator: one rank, [0, 1) the only range
    _err(lib, call(comm=None, lo=0, hi=2), INVALID, "rank 0 of 1", "got [0, 2)")
    # a good call on a planning context: refused, not crashed
    _err(lib, call(), NOT_SUPPORTED, "moe_rt_peer_buffer_create", "planning context")
    _err(lib, call(comm=None, lo=0, hi=1), NOT_SUPPORTED, "planning context")
    _err(lib, call(lo=1, hi=2, zero=0, nbytes=0), NOT_SUPPORTED, "planning context")
    assert out.value is None
    # a communicator the core aborted (a timed-out wait) is refused by name
    fake.aborted = 1
    _err(lib, call(), INVALID, "moe_rt_peer_buffer_create", "comm was aborted", "moe_rt_comm_destroy")


def test_buffer_calls_check_their_arguments(lib):
    info = PeerInfo()
    _err(lib, lib.moe_rt_peer_buffer_get_info(None, C.byref(info)), INVALID, "moe_rt_peer_buffer_get_info",
         "buf is NULL", "moe_rt_peer_buffer_create")
    _err(lib, lib.moe_rt_peer_buffer_get_info(P(0x1000), None), INVALID, "moe_rt_peer_buffer_get_info", "out is NULL")
    _err(lib, lib.moe_rt_peer_buffer_close_mappings(None), INVALID, "moe_rt_peer_buffer_close_mappings",
         "buf is NULL")
    _ok(lib, lib.moe_rt_peer_buffer_destroy(None))  # a no-op


def test_aborted_communicator(lib):
    """A communicator aborted in place by a wait of the core: moe_rt_comm_aborted says so, the other calls refuse it
    (before NCCL is touched; freeing it is moe_rt_comm_abort's / _destroy's, not tried on this stand-in)."""
    v = C.c_int(-1)
    _err(lib, lib.moe_rt_comm_aborted(None, C.byref(v)), INVALID, "moe_rt_comm_aborted", "comm is NULL")
    fake = FakeComm(None, 2, 0, 0)
    comm = C.cast(C.byref(fake), P)
    _err(lib, lib.moe_rt_comm_aborted(comm, None), INVALID, "aborted is NULL")
    _ok(lib, lib.moe_rt_comm_aborted(comm, C.byref(v)))
    assert v.value == 0
    fake.aborted = 1
    _ok(lib, lib.moe_rt_comm_aborted(comm, C.byref(v)))
    assert v.value == 1
    _err(lib, lib.moe_rt_comm_count(comm, C.byref(v)), INVALID, "moe_rt_comm_count", "comm was aborted")
    _err(lib, lib.moe_rt_comm_all_gather(comm, 0x1000, 0x1000, 4, 0, None), INVALID, "moe_rt_comm_all_gather",
         "comm was aborted")


# ---- the Python layer --------------------------------------------------------------------------------------------

def test_core_layer_maps_statuses():
    """moe_rt._core.peer_buffer_create: ValueError naming the argument, RuntimeError for a planning context;
    a timeout status is a TimeoutError."""
    ctx = _core.planning()
    with pytest.raises(ValueError, match=r"peer_lo <= rank < peer_hi <= nranks \(rank 0 of 1\), got \[0, 2\)"):
        _core.peer_buffer_create(ctx, 0, 64, True, 0, 2, 0, 1000)
    with pytest.raises(ValueError, match="timeout_ms must be >= 1, got 0"):
        _core.peer_buffer_create(ctx, 0, 64, True, 0, 1, 0, 0)
    with pytest.raises(RuntimeError, match="moe_rt_peer_buffer_create: ctx is a planning context"):
        _core.peer_buffer_create(ctx, 0, 64, True, 0, 1, 0, 1000)
    assert type(_core.error(_core.TIMEOUT, "op")) is TimeoutError
    assert type(_core.error(_core.CUDA, "op")) is RuntimeError


class _Group:
    """What Wait reads of a group: its timeout, _wait and _check_transport."""
    timeout = 2.5

    def __init__(self, failed=None):
        self.failed, self.waits = failed, []

    def _wait(self, stream, op, timeout=None):
        self.waits.append((stream, op, timeout))

    def _check_transport(self):
        if self.failed:
            raise TimeoutError(f"_Group.{self.failed}: a peer rank did not reach the direct transport's barrier")


class _Comm:
    """A core communicator's Python side as _Shared uses it (handle, size, release_if_aborted)."""

    def __init__(self, size, handle=0x5000):
        self.size, self.handle, self.released = size, handle, 0

    def release_if_aborted(self):
        self.released += 1
        return True


class _Stream:
    ptr = 0x77


def _fake_runtime(monkeypatch):
    import types

    fake = types.SimpleNamespace(getDevice=lambda: 0)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=fake)))
    monkeypatch.setitem(sys.modules, "cupy.cuda", types.SimpleNamespace(runtime=fake))
    monkeypatch.setattr(_core, "device", lambda d: ("ctx", d))


def test_wait_gives_the_deadline_and_the_groups_timeout():
    g = _Group()
    w = _ep_direct.Wait(g, "dispatch")
    w("s1")
    assert g.waits == [("s1", "dispatch", None)]
    assert w.seconds == 2.5 and w.timeout_ms == 2500
    w2 = _ep_direct.Wait(g, "__init__", 300)
    assert w2.seconds == 300.0 and w2.timeout_ms == 300000
    assert _ep_direct.Wait(g, "x", 1e-6).timeout_ms == 1  # never 0 (refused by the core)
    e = w2.error(TimeoutError("moe_rt_peer_buffer_create: ... within 300000 ms"))
    assert type(e) is TimeoutError and str(e) == _ep_direct.no_progress(g, "__init__", 300.0)
    assert str(e).startswith("_Group.__init__: no progress within 300 s") and "communicator was aborted" in str(e)
    other = RuntimeError("moe_rt: cuIpcOpenMemHandle failed")
    assert w2.error(other) is other
    with pytest.raises(TimeoutError, match="_Group.combine: a peer rank did not reach"):  # a barrier's timeout wins
        _ep_direct.Wait(_Group(failed="combine"), "dispatch").error(TimeoutError("x"))


@pytest.mark.parametrize("size,peers,want", [(4, None, (0, 4)), (4, range(2, 4), (2, 4)), (1, None, (0, 1))])
def test_shared_passes_the_core_its_arguments(monkeypatch, size, peers, want):
    """_Shared makes one core call with the communicator's handle, the mapped range, the stream and the wait's
    deadline; a core timeout releases the communicator and raises the group's TimeoutError naming the op."""
    _fake_runtime(monkeypatch)
    calls = []

    def create(ctx, comm, nbytes, zero, lo, hi, stream, timeout_ms):
        calls.append((ctx, comm, nbytes, zero, lo, hi, stream, timeout_ms))
        raise TimeoutError("moe_rt_peer_buffer_create: the exchange of the IPC handles made no progress")

    monkeypatch.setattr(_core, "peer_buffer_create", create)
    comm = _Comm(size)
    with pytest.raises(TimeoutError, match=r"_Group.prepare: no progress within 2.5 s .*communicator was aborted"):
        _ep_direct._Shared(comm, 1001, _Stream(), _ep_direct.Wait(_Group(), "prepare"), zero=True, peers=peers)
    assert calls == [(("ctx", 0), 0x5000, 1001, True, *want, 0x77, 2500)]
    assert comm.released == 1
    # a bad argument (ValueError) is raised as it is, the communicator untouched
    monkeypatch.setattr(_core, "peer_buffer_create", lambda *a: (_ for _ in ()).throw(ValueError("nbytes bad")))
    with pytest.raises(ValueError, match="nbytes bad"):
        _ep_direct._Shared(comm, 1, _Stream(), _ep_direct.Wait(_Group(), "prepare"))
    assert comm.released == 1


def test_one_rank_comm_has_no_core_handle():
    from moe_rt import ep_ll

    c = ep_ll._SelfComm(3)
    assert (c.rank, c.size, c.handle, c.device) == (0, 1, 0, 3)


# ---- on GPUs -----------------------------------------------------------------------------------------------------

def _run_worker(mode, n, timeout=180):
    if n > GPU_COUNT:
        pytest.skip(f"needs {n} CUDA GPUs")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), "-n", str(n), "--timeout", str(timeout),
                        str(ROOT / "tests" / "peer_worker.py"), mode], capture_output=True, text=True,
                       env=dict(os.environ), timeout=timeout + 60)
    print(r.stdout[-20000:])
    print(r.stderr[-5000:])
    return r


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_peer_buffers_through_the_c_abi(n):
    # every rank: peer buffers over every rank and over its half of the ranks (the mixed transport's node), zeroed
    # or not, of an odd size, and one without a communicator; each rank writes a pattern naming (source, reader,
    # word) into each mapped peer's buffer through the device table; every rank checks what it received, the host
    # array, the table and the zeroed tail; then the mappings are closed and the buffers destroyed
    r = _run_worker("exchange", n)
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.multi_gpu
def test_multi_gpu_peer_buffer_times_out():
    # rank 0 makes a peer buffer that its peer never makes: MOE_RT_ERROR_TIMEOUT naming the op within the deadline,
    # the communicator aborted (moe_rt_comm_aborted), released by the Python layer
    r = _run_worker("timeout", 2, timeout=120)
    assert r.returncode == 0 and "[rank 0] TIMEOUT OK" in r.stdout
