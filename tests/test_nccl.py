"""The NCCL loader and the Communicator's argument checks (no GPU needed); a single-rank communicator on a
GPU."""
import os

import numpy as np
import pytest

from moe_rt import _comm


def _nccl_missing():
    try:
        _comm.nccl_version()
    except OSError as e:  # no NCCL library (installed without the CUDA extra)
        return str(e).splitlines()[0]
    return None


_NO_NCCL = _nccl_missing()
needs_nccl = pytest.mark.skipif(_NO_NCCL is not None, reason=f"needs the NCCL library: {_NO_NCCL}")


@needs_nccl
def test_version_and_library():
    v = _comm.nccl_version()
    assert len(v) == 3 and v >= (2, 18, 0)
    assert os.path.basename(_comm.library_path()).startswith("libnccl")


@needs_nccl
def test_unique_id():
    a, b = _comm.get_unique_id(), _comm.get_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and a != b


@needs_nccl
def test_error_strings():
    assert "invalid argument" in _comm.error_string(4)
    err = _comm.NcclError("ncclSend", 4, _comm.error_string(4))
    assert "ncclSend failed" in str(err) and err.code == 4 and err.call == "ncclSend"


def test_dtype_names():
    assert _comm.nccl_dtype("bfloat16") == 9
    with pytest.raises(TypeError, match="no NCCL data type"):
        _comm.nccl_dtype("complex64")


@pytest.mark.parametrize("uid,rank,size,exc", [
    (b"short", 0, 1, ValueError),
    (None, 0, 1, ValueError),
    (b"\0" * 128, 2, 2, ValueError),
    (b"\0" * 128, 0, 0, ValueError),
])
def test_communicator_bad_arguments(uid, rank, size, exc):
    with pytest.raises(exc):
        _comm.Communicator(uid, rank, size, 0)


@pytest.mark.gpu
@needs_nccl
def test_single_rank_communicator():
    import cupy

    comm = _comm.Communicator(_comm.get_unique_id(), 0, 1, 0)
    try:
        s = cupy.cuda.Stream(non_blocking=True)
        x = cupy.arange(10, dtype=cupy.float32)
        y = cupy.full(10, np.nan, dtype=cupy.float32)
        comm.all_gather(x.data.ptr, y.data.ptr, 10, "float32", s.ptr)
        z = cupy.full(10, np.nan, dtype=cupy.float32)
        comm.group_start()
        comm.send(x.data.ptr, 10, "float32", 0, s.ptr)
        comm.recv(z.data.ptr, 10, "float32", 0, s.ptr)
        comm.group_end()
        m = cupy.full(10, np.nan, dtype=cupy.float32)
        comm.all_reduce(x.data.ptr, m.data.ptr, 10, "float32", s.ptr, op="max")
        xi = cupy.arange(7, dtype=cupy.uint32) * 3 + 1
        b = cupy.zeros(7, dtype=cupy.uint32)
        comm.broadcast(xi.data.ptr, b.data.ptr, 7, "uint32", 0, s.ptr)
        s.synchronize()
        assert comm.async_error() is None
        np.testing.assert_array_equal(y.get(), x.get())
        np.testing.assert_array_equal(z.get(), x.get())
        np.testing.assert_array_equal(m.get(), x.get())
        np.testing.assert_array_equal(b.get(), xi.get())
        assert comm.ptr and comm.handle and comm.ptr != comm.handle
        # the core checks the peer, the root and the buffers (ValueError naming them)
        with pytest.raises(ValueError, match="peer must be in"):
            comm.send(x.data.ptr, 10, "float32", 1, s.ptr)
        with pytest.raises(ValueError, match="root must be in"):
            comm.broadcast(x.data.ptr, y.data.ptr, 10, "float32", 3, s.ptr)
        with pytest.raises(ValueError, match="recv is NULL"):
            comm.all_gather(x.data.ptr, 0, 10, "float32", s.ptr)
        with pytest.raises(TypeError, match="no NCCL data type"):
            comm.send(x.data.ptr, 10, "complex64", 0, s.ptr)
    finally:
        comm.close()
    assert comm.closed
    with pytest.raises(ValueError, match="closed"):
        comm.all_gather(0, 0, 1, "float32", 0)
