"""NCCL and the communicator through the C ABI (csrc/comm.c, include/moe_rt/moe_rt.h): bad arguments return
MOE_RT_ERROR_INVALID_ARGUMENT with a message naming the argument, before NCCL is touched; a missing or wrong
NCCL library gives MOE_RT_ERROR_NO_NCCL and a clear message, never a crash (in a fresh process each, since a
loaded NCCL stays for the process); with NCCL present the loader, version, unique ids and error strings agree
with moe_rt._comm; on a GPU a one-rank communicator moves data through every data call."""
from __future__ import annotations

import ctypes as C
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from moe_rt import _comm
from test_c_abi import ROOT, _err, _ok, libpath, load_library  # noqa: F401 - libpath: the library built for the test

OK, INVALID, NO_NCCL, NCCL = 0, 1, 8, 9
F32, F16, BF16, I32, I64, BOOL, U8, I8, FP8, I16, U32, U64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13
NCCL_TYPES = {I8: 0, U8: 1, I32: 2, U32: 3, I64: 4, U64: 5, F16: 6, F32: 7, F64: 8, BF16: 9}


class Failure(C.Structure):
    _fields_ = [("result", C.c_int32), ("call", C.c_char * 64), ("message", C.c_char * 1024)]


class FakeComm(C.Structure):
    """csrc/comm.c's struct moe_rt_comm, for argument checks that fail before NCCL is called."""
    _fields_ = [("comm", C.c_void_p), ("nranks", C.c_int), ("rank", C.c_int), ("aborted", C.c_int)]


P, I, L, S = C.c_void_p, C.c_int, C.c_int64, C.c_size_t
PI = C.POINTER(C.c_int)
SIGNATURES = {
    "moe_rt_last_error": (C.c_char_p, []),
    "moe_rt_status_name": (C.c_char_p, [I]),
    "moe_rt_nccl_load": (I, [C.c_char_p]),
    "moe_rt_nccl_library_path": (I, [C.POINTER(C.c_char_p)]),
    "moe_rt_nccl_version": (I, [PI, PI, PI]),
    "moe_rt_nccl_error_string": (I, [I, C.POINTER(C.c_char_p)]),
    "moe_rt_nccl_last_failure": (I, [C.POINTER(Failure)]),
    "moe_rt_nccl_dtype": (I, [I, PI]),
    "moe_rt_nccl_get_unique_id": (I, [P]),
    "moe_rt_comm_init_rank": (I, [P, I, I, C.POINTER(P)]),
    "moe_rt_comm_destroy": (I, [P]),
    "moe_rt_comm_abort": (I, [P]),
    "moe_rt_comm_async_error": (I, [P, PI, C.c_char_p, S]),
    "moe_rt_comm_count": (I, [P, PI]),
    "moe_rt_comm_user_rank": (I, [P, PI]),
    "moe_rt_comm_nccl_handle": (I, [P, C.POINTER(P)]),
    "moe_rt_comm_group_start": (I, []),
    "moe_rt_comm_group_end": (I, [P]),
    "moe_rt_comm_send": (I, [P, P, L, I, I, P]),
    "moe_rt_comm_recv": (I, [P, P, L, I, I, P]),
    "moe_rt_comm_all_gather": (I, [P, P, P, L, I, P]),
    "moe_rt_comm_all_reduce": (I, [P, P, P, L, I, I, P]),
    "moe_rt_comm_broadcast": (I, [P, P, P, L, I, I, P]),
}


def _nccl_path():
    try:
        _comm.nccl_version()
    except (OSError, _comm.NcclError):
        return None
    return _comm.library_path()


NCCL_PATH = _nccl_path()
needs_nccl = pytest.mark.skipif(NCCL_PATH is None, reason="needs the NCCL library")


def _load(path, signatures=None):
    return load_library(path, SIGNATURES if signatures is None else signatures)


@pytest.fixture(scope="module")
def lib(libpath):
    return _load(libpath)


def test_status_names(lib):
    assert lib.moe_rt_status_name(NO_NCCL) == b"MOE_RT_ERROR_NO_NCCL"
    assert lib.moe_rt_status_name(NCCL) == b"MOE_RT_ERROR_NCCL"


def test_dtype_codes(lib):
    t = C.c_int(-5)
    for code, nccl in NCCL_TYPES.items():
        _ok(lib, lib.moe_rt_nccl_dtype(code, C.byref(t)))
        assert t.value == nccl
    for bad in (BOOL, FP8, I16, 14, -1, 1 << 20):
        _err(lib, lib.moe_rt_nccl_dtype(bad, C.byref(t)), INVALID, "dtype", "no NCCL data type")
    _err(lib, lib.moe_rt_nccl_dtype(F32, None), INVALID, "nccl_type is NULL")
    # the Python names map onto the same codes
    assert {n: _comm.nccl_dtype(n) for n in _comm._CODES} == {
        "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
        "float64": 8, "bfloat16": 9}
    with pytest.raises(TypeError, match="no NCCL data type"):
        _comm.nccl_dtype("bool")


def test_bad_arguments(lib):
    """Every check happens before NCCL is loaded or called (a fake communicator is never passed to NCCL)."""
    v = C.c_int()
    _err(lib, lib.moe_rt_nccl_version(None, C.byref(v), C.byref(v)), INVALID, "moe_rt_nccl_version", "major is NULL")
    _err(lib, lib.moe_rt_nccl_version(C.byref(v), C.byref(v), None), INVALID, "patch is NULL")
    _err(lib, lib.moe_rt_nccl_library_path(None), INVALID, "path is NULL")
    _err(lib, lib.moe_rt_nccl_error_string(4, None), INVALID, "text is NULL")
    _err(lib, lib.moe_rt_nccl_get_unique_id(None), INVALID, "id is NULL")
    _err(lib, lib.moe_rt_nccl_last_failure(None), INVALID, "out is NULL")
    uid = (C.c_char * 128)()
    out = P(1234)
    _err(lib, lib.moe_rt_comm_init_rank(uid, 1, 0, None), INVALID, "moe_rt_comm_init_rank", "comm is NULL")
    _err(lib, lib.moe_rt_comm_init_rank(None, 1, 0, C.byref(out)), INVALID, "unique_id is NULL")
    assert out.value is None  # cleared on failure
    _err(lib, lib.moe_rt_comm_init_rank(uid, 0, 0, C.byref(out)), INVALID, "nranks must be >= 1, got 0")
    _err(lib, lib.moe_rt_comm_init_rank(uid, 2, 2, C.byref(out)), INVALID, "rank must be in [0, 2), got 2")
    _err(lib, lib.moe_rt_comm_init_rank(uid, 2, -1, C.byref(out)), INVALID, "rank must be in [0, 2)")
    for name in ("moe_rt_comm_count", "moe_rt_comm_user_rank"):
        _err(lib, getattr(lib, name)(None, C.byref(v)), INVALID, name, "comm is NULL")
    _err(lib, lib.moe_rt_comm_async_error(None, C.byref(v), None, 0), INVALID, "comm is NULL")
    _err(lib, lib.moe_rt_comm_nccl_handle(None, C.byref(out)), INVALID, "comm is NULL")
    # destroy and abort of NULL are no-ops
    _ok(lib, lib.moe_rt_comm_destroy(None))
    _ok(lib, lib.moe_rt_comm_abort(None))

    fake = FakeComm(None, 4, 1)
    comm = C.cast(C.byref(fake), P)
    _err(lib, lib.moe_rt_comm_count(comm, None), INVALID, "count is NULL")
    _err(lib, lib.moe_rt_comm_user_rank(comm, None), INVALID, "rank is NULL")
    _err(lib, lib.moe_rt_comm_async_error(comm, None, None, 0), INVALID, "result is NULL")
    buf = C.create_string_buffer(8)
    _err(lib, lib.moe_rt_comm_async_error(comm, C.byref(v), buf, 0), INVALID, "message_bytes")
    _err(lib, lib.moe_rt_comm_nccl_handle(comm, None), INVALID, "nccl_comm is NULL")
    A = 0x10000
    for name in ("moe_rt_comm_send", "moe_rt_comm_recv"):
        _err(lib, getattr(lib, name)(None, A, 4, F32, 0, None), INVALID, name, "comm is NULL")
        _err(lib, getattr(lib, name)(comm, A, -1, F32, 0, None), INVALID, name, "count must be >= 0, got -1")
        _err(lib, getattr(lib, name)(comm, A, 4, BOOL, 0, None), INVALID, "dtype", "bool")
        _err(lib, getattr(lib, name)(comm, A, 4, 99, 0, None), INVALID, "dtype", "unknown dtype code (99)")
        _err(lib, getattr(lib, name)(comm, None, 4, F32, 0, None), INVALID, "buf is NULL")
        _err(lib, getattr(lib, name)(comm, A, 4, F32, 4, None), INVALID, "peer must be in [0, 4), got 4")
        _err(lib, getattr(lib, name)(comm, A, 4, F32, -1, None), INVALID, "peer must be in [0, 4), got -1")
    _err(lib, lib.moe_rt_comm_all_gather(comm, A, A, -3, F32, None), INVALID, "count must be >= 0")
    _err(lib, lib.moe_rt_comm_all_gather(comm, None, A, 3, F32, None), INVALID, "send is NULL")
    _err(lib, lib.moe_rt_comm_all_gather(comm, A, None, 3, F32, None), INVALID, "recv is NULL")
    _err(lib, lib.moe_rt_comm_all_gather(comm, A, A, 3, FP8, None), INVALID, "no NCCL data type", "float8_e4m3")
    _err(lib, lib.moe_rt_comm_all_reduce(comm, A, A, 3, F32, 2, None), INVALID, "op must be", "got 2")
    _err(lib, lib.moe_rt_comm_all_reduce(comm, A, None, 3, F32, 0, None), INVALID, "recv is NULL")
    _err(lib, lib.moe_rt_comm_all_reduce(comm, A, A, 3, I16, 0, None), INVALID, "int16")
    _err(lib, lib.moe_rt_comm_broadcast(comm, A, A, 3, F32, 4, None), INVALID, "root must be in [0, 4), got 4")
    _err(lib, lib.moe_rt_comm_broadcast(comm, A, None, 3, F32, 0, None), INVALID, "recv is NULL")
    fake.rank = 0  # the root's send is read
    _err(lib, lib.moe_rt_comm_broadcast(comm, None, A, 3, F32, 0, None), INVALID, "send is NULL")
    f = Failure()
    _ok(lib, lib.moe_rt_nccl_last_failure(C.byref(f)))
    assert f.call == b"" and f.result == 0  # argument errors are not NCCL's


_MISSING = """
import ctypes as C, json, sys
sys.path.insert(0, {tests!r})
from test_c_comm import Failure, FakeComm, _load
lib = _load({lib!r})
out = {{}}
v, p, uid, comm = C.c_int(), C.c_char_p(), (C.c_char * 128)(), C.c_void_p()
fake = FakeComm(None, 1, 0)
calls = {{
    "version": lambda: lib.moe_rt_nccl_version(C.byref(v), C.byref(v), C.byref(v)),
    "path": lambda: lib.moe_rt_nccl_library_path(C.byref(p)),
    "error_string": lambda: lib.moe_rt_nccl_error_string(4, C.byref(p)),
    "unique_id": lambda: lib.moe_rt_nccl_get_unique_id(uid),
    "init_rank": lambda: lib.moe_rt_comm_init_rank(uid, 1, 0, C.byref(comm)),
    "group_start": lambda: lib.moe_rt_comm_group_start(),
    "group_end": lambda: lib.moe_rt_comm_group_end(None),
    "send": lambda: lib.moe_rt_comm_send(C.byref(fake), 0x10000, 4, 0, 0, None),
    "count": lambda: lib.moe_rt_comm_count(C.byref(fake), C.byref(v)),
    "load": lambda: lib.moe_rt_nccl_load({explicit!r}),
}}
for name, call in calls.items():
    st = call()
    f = Failure()
    lib.moe_rt_nccl_last_failure(C.byref(f))
    out[name] = [st, lib.moe_rt_last_error().decode(), f.call.decode(), f.result, f.message.decode()]
print(json.dumps(out))
"""


def _run_fresh(libpath, env_path, explicit):
    env = dict(os.environ, MOE_RT_NCCL_PATH=env_path)
    code = _MISSING.format(tests=str(ROOT / "tests"), lib=str(libpath), explicit=explicit)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_nccl_missing(libpath, tmp_path):
    missing = str(tmp_path / "libnccl-missing.so.2")
    out = _run_fresh(libpath, missing, str(tmp_path / "also-missing.so").encode())
    for name, (st, msg, call, result, _) in out.items():
        assert st == NO_NCCL, (name, st, msg)
        assert "cannot load NCCL from" in msg and "missing" in msg, (name, msg)
        assert call == "" and result == 0, name
    assert missing in out["version"][1]
    assert "also-missing.so" in out["load"][1]  # an explicit path is the one tried


def test_nccl_lacking_functions(libpath):
    """A library that is not NCCL: the first function missing is named, as an NCCL failure with result -1."""
    out = _run_fresh(libpath, str(libpath), None)
    for name, (st, msg, call, result, fmsg) in out.items():
        assert st == NO_NCCL, (name, st, msg)
        assert call == "ncclGetVersion" and result == -1, (name, call, result)
        assert f"symbol not found in {libpath}" in fmsg
        assert msg == f"ncclGetVersion failed: {fmsg} (ncclResult_t -1)"


def test_python_layer_without_nccl(tmp_path):
    """moe_rt._comm over the core: a missing NCCL is an OSError naming the path (the loader tests skip on it)."""
    code = textwrap.dedent("""
        from moe_rt import _comm
        try:
            _comm.nccl_version()
        except OSError as e:
            print("OSError:", e)
        try:
            _comm.get_unique_id()
        except OSError as e:
            print("OSError:", e)
        print(_comm.nccl_dtype("uint64"))
    """)
    env = dict(os.environ, MOE_RT_NCCL_PATH=str(tmp_path / "libnccl-none.so.2"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("OSError: cannot load NCCL from") and "libnccl-none.so.2" in lines[0], lines
    assert lines[1].startswith("OSError: cannot load NCCL from"), lines
    assert lines[2] == "5"


@needs_nccl
def test_loader_agrees_with_python(lib):
    _ok(lib, lib.moe_rt_nccl_load(NCCL_PATH.encode()))
    _ok(lib, lib.moe_rt_nccl_load(b"/another/libnccl.so.2"))  # one copy a process: the loaded one stays
    p = C.c_char_p()
    _ok(lib, lib.moe_rt_nccl_library_path(C.byref(p)))
    assert p.value.decode() == NCCL_PATH == _comm.library_path()
    a, b, c = C.c_int(), C.c_int(), C.c_int()
    _ok(lib, lib.moe_rt_nccl_version(C.byref(a), C.byref(b), C.byref(c)))
    assert (a.value, b.value, c.value) == _comm.nccl_version() and (a.value, b.value) >= (2, 18)
    _ok(lib, lib.moe_rt_nccl_error_string(4, C.byref(p)))
    assert "invalid argument" in p.value.decode() and p.value.decode() == _comm.error_string(4)
    u1, u2 = (C.c_char * 128)(), (C.c_char * 128)()
    _ok(lib, lib.moe_rt_nccl_get_unique_id(u1))
    _ok(lib, lib.moe_rt_nccl_get_unique_id(u2))
    assert bytes(u1) != bytes(u2) and any(bytes(u1))


@pytest.mark.gpu
@needs_nccl
def test_one_rank_communicator_through_the_c_abi(lib):
    import cupy

    _ok(lib, lib.moe_rt_nccl_load(NCCL_PATH.encode()))
    uid = (C.c_char * 128)()
    _ok(lib, lib.moe_rt_nccl_get_unique_id(uid))
    comm = P()
    with cupy.cuda.Device(0):
        _ok(lib, lib.moe_rt_comm_init_rank(uid, 1, 0, C.byref(comm)))
        try:
            v = C.c_int(-1)
            _ok(lib, lib.moe_rt_comm_count(comm, C.byref(v)))
            assert v.value == 1
            _ok(lib, lib.moe_rt_comm_user_rank(comm, C.byref(v)))
            assert v.value == 0
            h = P()
            _ok(lib, lib.moe_rt_comm_nccl_handle(comm, C.byref(h)))
            assert h.value
            rng = np.random.default_rng(7)
            s = cupy.cuda.Stream(non_blocking=True)
            x = cupy.asarray(rng.standard_normal(37).astype(np.float32))
            xi = cupy.asarray(rng.integers(0, 2**40, 37, dtype=np.uint64))
            outs = [cupy.full(37, np.nan, dtype=cupy.float32) for _ in range(4)]
            zi = cupy.zeros(37, dtype=cupy.uint64)
            _ok(lib, lib.moe_rt_comm_all_gather(comm, x.data.ptr, outs[0].data.ptr, 37, F32, s.ptr))
            _ok(lib, lib.moe_rt_comm_all_reduce(comm, x.data.ptr, outs[1].data.ptr, 37, F32, 1, s.ptr))
            _ok(lib, lib.moe_rt_comm_broadcast(comm, x.data.ptr, outs[2].data.ptr, 37, F32, 0, s.ptr))
            _ok(lib, lib.moe_rt_comm_group_start())
            _ok(lib, lib.moe_rt_comm_send(comm, x.data.ptr, 37, F32, 0, s.ptr))
            _ok(lib, lib.moe_rt_comm_recv(comm, outs[3].data.ptr, 37, F32, 0, s.ptr))
            _ok(lib, lib.moe_rt_comm_group_end(comm))
            _ok(lib, lib.moe_rt_comm_all_reduce(comm, xi.data.ptr, zi.data.ptr, 37, U64, 0, s.ptr))
            s.synchronize()
            for o in outs:
                np.testing.assert_array_equal(o.get(), x.get())
            np.testing.assert_array_equal(zi.get(), xi.get())
            msg = C.create_string_buffer(256)
            _ok(lib, lib.moe_rt_comm_async_error(comm, C.byref(v), msg, 256))
            assert v.value in (0, 7) and msg.value == b""
        finally:
            _ok(lib, lib.moe_rt_comm_destroy(comm))
