"""Peer buffers through the C ABI (csrc/peer.c, include/moe_rt/moe_rt.h "Peer buffers") and the Python layer over
them (moe_rt._ep_direct._Shared): every bad argument returns MOE_RT_ERROR_INVALID_ARGUMENT with a message naming
it, a planning context MOE_RT_ERROR_NOT_SUPPORTED, never a crash; a communicator the core aborted refuses every
call but freeing; a timeout of the core's wait becomes the group's TimeoutError naming the op, with the
communicator released. Over a stand-in driver and NCCL the whole create / teardown logic runs on the CPU (the
mapped range, the table, each mapping closed once, every allocation freed, also after a failure, a timeout or an
NCCL error). On GPUs (tests/peer_worker.py under tools/launch.py) 2 and 4 ranks make peer buffers
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


# ---- the whole create / teardown logic over a stand-in driver and NCCL (CPU) ---------------------------------

STUB_EXTRA = r"""
static long long ipc_get, ipc_open, ipc_close, allocs, frees, queries;
static int hang, fail_open_byte, bad_flags;
static long long open_addr[64];
long long peer_stub(int i) {
  long long v[] = {ipc_get, ipc_open, ipc_close, counts[15], counts[16], queries, bad_flags};
  return v[i];
}
void peer_stub_set(int h, int f) { hang = h; fail_open_byte = f; }
typedef struct { char b[64]; } H;
int cuIpcGetMemHandle(H* h, unsigned long long p) { ipc_get++; (void)p; memset(h->b, 0x7f, 64); return 0; }
int cuIpcOpenMemHandle_v2(unsigned long long* p, H h, unsigned flags) {
  if (flags != 1) bad_flags++;
  if (h.b[0] == fail_open_byte) return 201;
  ipc_open++;
  *p = (unsigned long long)(unsigned char)h.b[0] << 32;
  return 0;
}
int cuIpcCloseMemHandle(unsigned long long p) { ipc_close++; return p >> 32 ? 0 : 400; }
int cuStreamQuery(void* s) { (void)s; queries++; return hang ? 600 : 0; }
int cuMemcpyHtoDAsync_v2(unsigned long long d, const void* s, size_t n, void* st) {
  (void)st; memcpy((void*)(size_t)d, s, n); return 0;
}
"""

NCCL_STUB = r"""
#include <stdlib.h>
#include <string.h>
typedef struct { int n, r; } C;
static int aborts, destroys, async_err;
int nccl_stub(int i) { int v[] = {aborts, destroys}; return v[i]; }
void nccl_stub_async(int e) { async_err = e; }
int ncclGetVersion(int* v) { *v = 22005; return 0; }
int ncclGetUniqueId(void* id) { memset(id, 1, 128); return 0; }
typedef struct { char b[128]; } U; /* ncclUniqueId, passed by value */
int ncclCommInitRank(C** c, int n, U id, int r) {
  (void)id; *c = malloc(sizeof **c); (*c)->n = n; (*c)->r = r; return 0;
}
int ncclCommDestroy(C* c) { destroys++; free(c); return 0; }
int ncclCommAbort(C* c) { aborts++; free(c); return 0; }
int ncclCommGetAsyncError(C* c, int* e) { (void)c; *e = async_err; return 0; }
int ncclCommCount(C* c, int* n) { *n = c->n; return 0; }
int ncclCommUserRank(C* c, int* r) { *r = c->r; return 0; }
const char* ncclGetErrorString(int r) { return r == 2 ? "unhandled system error" : "stub"; }
const char* ncclGetLastError(C* c) { (void)c; return ""; }
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
int ncclSend(const void* b, size_t n, int t, int p, C* c, void* s) { return 0; }
int ncclRecv(void* b, size_t n, int t, int p, C* c, void* s) { return 0; }
/* every rank's 64-byte handle: rank r's bytes are r + 1 (this rank's as sent) */
int ncclAllGather(const void* send, void* recv, size_t n, int t, C* c, void* s) {
  for (int r = 0; r < c->n; ++r)
    if (r == c->r) memmove((char*)recv + r * n, send, n); else memset((char*)recv + r * n, r + 1, n);
  return 0;
}
int ncclAllReduce(const void* a, void* b, size_t n, int t, int o, C* c, void* s) { return 0; }
int ncclBroadcast(const void* a, void* b, size_t n, int t, int r, C* c, void* s) { return 0; }
"""

_STUBBED = r"""
import ctypes as C, json, sys
sys.path.insert(0, {tests!r})
from test_c_peer import PeerInfo, load
lib, drv, nccl = load({lib!r}), C.CDLL({drv!r}), C.CDLL({nccl!r})
drv.peer_stub.restype = C.c_longlong
out = {{}}

def counters():
    return dict(zip(("get", "open", "close", "alloc", "free", "query", "bad_flags"), map(drv.peer_stub, range(7))))

def ok(st):
    assert st == 0, (st, lib.moe_rt_last_error().decode())

ok(lib.moe_rt_nccl_load({nccl!r}.encode()))
ctx = C.c_void_p()
ok(lib.moe_rt_context_create({cache!r}.encode(), 0, C.byref(ctx)))

def comm(n=4, r=1):
    c = C.c_void_p()
    ok(lib.moe_rt_comm_init_rank((C.c_char * 128)(), n, r, C.byref(c)))
    return c

def make(c, lo, hi, timeout=5000, nbytes=1000):
    b = C.c_void_p(77)
    st = lib.moe_rt_peer_buffer_create(ctx, c, nbytes, 1, lo, hi, None, timeout, C.byref(b))
    return st, lib.moe_rt_last_error().decode(), b

def ptrs(b):
    i = PeerInfo()
    ok(lib.moe_rt_peer_buffer_get_info(b, C.byref(i)))
    local = i.local
    p = [i.ptrs[r] or 0 for r in range(i.nranks)]
    table = list((C.c_int64 * i.nranks).from_address(i.table))
    return dict(local=local, ptrs=p, table=table, nbytes=i.nbytes, shape=[i.nranks, i.rank, i.peer_lo, i.peer_hi])

c = comm()
for lo, hi in ((0, 4), (0, 2)):
    st, msg, b = make(c, lo, hi)
    ok(st)
    out[f"made {{lo}} {{hi}}"] = [ptrs(b), counters()]
    ok(lib.moe_rt_peer_buffer_close_mappings(b))
    ok(lib.moe_rt_peer_buffer_close_mappings(b))
    out[f"closed {{lo}} {{hi}}"] = [ptrs(b)["ptrs"], counters()]
    ok(lib.moe_rt_peer_buffer_destroy(b))
    out[f"destroyed {{lo}} {{hi}}"] = counters()
drv.peer_stub_set(0, 4)  # rank 3's handle cannot be opened
st, msg, b = make(c, 0, 4)
out["open fails"] = [st, msg, b.value, counters()]
drv.peer_stub_set(1, 0)  # the exchange never ends
st, msg, b = make(c, 0, 4, timeout=30)
v = C.c_int(-1)
ok(lib.moe_rt_comm_aborted(c, C.byref(v)))
st2, msg2, _ = make(c, 0, 4)
out["timeout"] = [st, msg, b.value, counters(), nccl.nccl_stub(0), v.value, st2, msg2]
ok(lib.moe_rt_comm_destroy(c))  # only frees: NCCL's destroy is not called on an aborted communicator
out["after destroy"] = [nccl.nccl_stub(0), nccl.nccl_stub(1)]
c = comm()
nccl.nccl_stub_async(2)
st, msg, b = make(c, 0, 4)
ok(lib.moe_rt_comm_aborted(c, C.byref(v)))
out["async error"] = [st, msg, b.value, counters(), nccl.nccl_stub(0), v.value]
ok(lib.moe_rt_comm_abort(c))
print(json.dumps(out))
"""


def test_create_and_teardown_over_stand_ins(libpath, tmp_path):
    """Over a stand-in driver (host memory for device memory, IPC handles the stand-in NCCL makes rank-specific) and
    a stand-in NCCL, in a fresh process: rank 1 of 4 maps exactly its range with lazy peer access, the host array and
    the table agree, close_mappings closes each mapping once (idempotent), destroy frees every allocation; a mapping
    that fails releases what was made; a wait past its deadline aborts the communicator (then only freed) and
    returns the timeout status naming the op; an asynchronous NCCL error met while waiting aborts it too."""
    import hashlib
    import json
    import re

    from moe_rt import _jit

    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_core_calls", ROOT / "tools" / "profile_core_calls.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)  # its stand-in driver
    cc = test_c_abi._compiler()
    drv, nccl = tmp_path / "libcuda-stub.so", tmp_path / "libnccl-stub.so"
    stub = profile.STUB % {"n": len(profile.DRIVER_FNS)}
    copy = ("int cuMemcpyDtoH_v2(void* d, unsigned long long s, size_t n) "
            "{ counts[19]++; memcpy(d, (void*)s, n); return 0; }")
    stub, k = re.subn(r"int cuMemcpyDtoH_v2\(.*", copy, stub)  # the handles are read back
    assert k == 1
    (tmp_path / "drv.c").write_text(stub + STUB_EXTRA)
    (tmp_path / "nccl.c").write_text(NCCL_STUB)
    for src, lib in (("drv.c", drv), ("nccl.c", nccl)):
        subprocess.run([*cc.split(), "-shared", "-fPIC", "-o", str(lib), str(tmp_path / src)], check=True)
    cache = tmp_path / "cache"
    (cache / "sm_90").mkdir(parents=True)
    img = f"sm_90/k{hashlib.sha1(b'errors').hexdigest()[:12]}.img"
    (cache / img).write_text("error_word_clear\n40")
    (cache / "manifest.json").write_text(json.dumps({
        "format": 2, "source_hash": _jit.source_hash(), "nvrtc": "12.8",
        "kernels": [{"file": "errors.cu", "name": "error_word_clear", "lowered": "k", "arch": "sm_90", "image": img}]}))
    code = _STUBBED.format(tests=str(ROOT / "tests"), lib=str(libpath), drv=str(drv), nccl=str(nccl), cache=str(cache))
    env = dict(os.environ, MOE_RT_LIBCUDA=str(drv))
    env.pop("MOE_RT_NCCL_PATH", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])

    made, n = out["made 0 4"]
    local = made["local"]
    assert made["ptrs"] == [1 << 32, local, 3 << 32, 4 << 32] and made["table"] == made["ptrs"]
    assert made["nbytes"] == 1000 and made["shape"] == [4, 1, 0, 4] and local % 16 == 0
    # the local buffer, the exchange buffer (freed), the table; three mappings; lazy peer access every time
    assert (n["get"], n["open"], n["close"], n["alloc"], n["free"], n["bad_flags"]) == (1, 3, 0, 3, 1, 0)
    assert out["closed 0 4"][0] == [0, local, 0, 0] and out["closed 0 4"][1]["close"] == 3
    assert out["destroyed 0 4"]["free"] == 3 and out["destroyed 0 4"]["close"] == 3
    made, n = out["made 0 2"]
    assert made["ptrs"] == [1 << 32, made["local"], 0, 0] and made["table"] == made["ptrs"]
    assert made["shape"] == [4, 1, 0, 2] and n["open"] == 3 + 1
    assert out["destroyed 0 2"]["close"] == 4 and out["destroyed 0 2"]["free"] == out["destroyed 0 2"]["alloc"] == 6
    st, msg, b, n = out["open fails"]
    assert st == 5 and b is None and "moe_rt_peer_buffer_create" in msg and "rank 3's buffer" in msg, msg
    assert n["close"] == n["open"] == 4 + 2 and n["free"] == n["alloc"] == 6 + 2  # the local and exchange buffers
    st, msg, b, n, aborts, aborted, st2, msg2 = out["timeout"]
    assert st == TIMEOUT and b is None and aborts == 1 and aborted == 1, msg
    assert msg.startswith("moe_rt_peer_buffer_create: ") and "within 30 ms" in msg and "communicator was aborted" in msg
    assert n["free"] == n["alloc"] and n["close"] == n["open"] and n["query"] > 1
    assert st2 == INVALID and "comm was aborted" in msg2
    assert out["after destroy"] == [1, 0]
    st, msg, b, n, aborts, aborted = out["async error"]
    assert st == 9 and b is None and aborts == 2 and aborted == 1, msg
    assert "the communicator failed while waiting" in msg and "unhandled system error" in msg, msg
    assert n["free"] == n["alloc"] and n["close"] == n["open"]
