"""Every kernel file and every registered template instantiation compiles with NVRTC for sm_80 and sm_90,
with no GPU or driver present (low-level NVRTC; CuPy's high-level compile needs a device)."""
import pytest

import moe_rt  # noqa: F401 - imports every op module, which registers its kernels
from moe_rt import _jit

FILES = _jit.kernel_files()


def _nvrtc_available():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        _jit.cuda_include_dir()
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC or CUDA headers not installed")


def test_every_kernel_file_is_registered():
    assert FILES, "no kernel files found"
    for f in FILES:
        assert _jit.REGISTRY.get(f), f"{f} has no registered kernels: an op module must register them"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("file", FILES)
def test_compiles(file, arch):
    cubin, lowered = _jit.compile_offline(file, arch)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
    assert set(lowered) == set(_jit.REGISTRY[file])
    assert all(lowered.values())


def test_compile_error_carries_the_log(tmp_path, monkeypatch):
    bad = tmp_path / "kernels"
    bad.mkdir()
    (bad / "broken.cu").write_text('extern "C" __global__ void k() { this is not C++; }\n')
    monkeypatch.setattr(_jit, "kernels_dir", lambda: bad)
    with pytest.raises(RuntimeError, match="NVRTC failed on broken.cu"):
        _jit.compile_offline("broken.cu", "sm_90", names=["k"])


def test_cache_key_covers_headers_and_sources():
    h = _jit.source_hash()
    assert len(h) == 40
    assert any(o.startswith("-DMOE_RT_SOURCE_HASH=0x") for o in _jit.options())
    assert str(_jit.include_dir()) in " ".join(_jit.options())


def test_package_data_is_found():
    assert (_jit.include_dir() / "moe_rt" / "common.cuh").is_file()
    assert (_jit.kernels_dir() / "common.cu").is_file()


def test_ctype_rejects_other_dtypes():
    assert _jit.ctype("bfloat16") == "__nv_bfloat16"
    with pytest.raises(TypeError, match="no kernel instantiation for dtype float64"):
        _jit.ctype("float64")


def test_driver_launcher_packs_arguments():
    """The driver launcher's argument block: each argument at the start of an 8-byte slot, in the width of
    its type (Python int: 64-bit; NumPy scalars: their own); other types are refused (CuPy launches)."""
    import struct

    import numpy as np

    from moe_rt import _launch

    args = (5, -3, np.int32(-2), np.uint32(7), np.float32(1.5), np.int64(-9), np.float64(2.5), np.uint64(3),
            2**63 + 1)
    want = struct.pack("<qqi4xI4xf4xqdQQ", 5, -3, -2, 7, 1.5, -9, 2.5, 3, 2**63 + 1)
    assert _launch.pack(args) == want
    assert _launch.pack(()) == b""
    assert _launch.pack((1, "x")) is None
    assert _launch.pack((np.int16(1),)) is None
    assert _launch.pack(tuple(range(49))) is None  # more arguments than the block holds
    assert _launch.launch(0, 1, 1, (np.int16(1),), 0) is False  # refused before any driver call


def test_packed_launches_write_each_calls_pointers():
    """``Launches``: constant arguments packed once, each run writes ``ptrs[key] + offset`` into the pointer
    slots (a list or a dict of pointers) and launches with the recorded grid, block, shared memory; what
    the stand-in for cuLaunchKernel gets is what ``launch`` would pass for the same arguments."""
    import numpy as np

    from moe_rt import _launch

    seq = [(0x1230, 7, 256, 64, (0, np.int32(-3), 0, np.float32(1.5), np.int64(9)), ((0, 2, 16), (2, 0, 0))),
           (0x990, (2, 3), (32, 4, 1), 0, (5, 0), ((1, 1, 8),))]
    packed = _launch.Launches(seq)
    assert len(packed) == 2
    _launch._fake_driver(True)
    try:
        assert packed.run([1000, 2000, 3000], 77)
        assert packed.run({0: 1 << 40, 1: 2, 2: 3}, 78)
        got = _launch._fake_driver(True)
        assert _launch.launch(0x1230, 7, 256, (19, np.int32(-3), 1 << 40, np.float32(1.5), np.int64(9)), 78, 64)
        direct = _launch._fake_driver(True)
    finally:
        _launch._fake_driver(False)
    want = [
        (0x1230, (7, 1, 1), (256, 1, 1), 64, 77, (3016, np.int32(-3), 1000, np.float32(1.5), np.int64(9))),
        (0x990, (2, 3, 1), (32, 4, 1), 0, 77, (5, 2008)),
        (0x1230, (7, 1, 1), (256, 1, 1), 64, 78, (19, np.int32(-3), 1 << 40, np.float32(1.5), np.int64(9))),
        (0x990, (2, 3, 1), (32, 4, 1), 0, 78, (5, 10)),
    ]
    assert got == [w[:5] + (_launch.pack(w[5]),) for w in want]
    assert direct == got[2:3]
    bad = [
        [(1, 1, 1, 0, ("x",), ())],  # an argument type the launcher does not take
        [(1, 1, 1, 0, (0,), ((1, 0, 0),))],  # a ref past the arguments
        [(1, 1, 1, 0, (0,), ((0, -1, 0),))],  # a negative key
        [(1, (1, 2, 3, 4), 1, 0, (0,), ())],  # a grid of four dimensions
    ]
    for b in bad:
        with pytest.raises(ValueError):
            _launch.Launches(b)
