"""Every registered kernel instantiation compiles alone, as its own NVRTC program, for sm_80 and sm_90 with no
GPU or driver present, through ``python -m moe_rt warmup`` (low-level NVRTC; CuPy's high-level compile needs a
device); the kernel cache those programs land in is shared between processes and complete after a warmup."""
import json
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

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
ARCH = "sm_90"
ARCHS = ("sm_80", "sm_90")


def test_every_kernel_file_is_registered():
    assert FILES, "no kernel files found"
    for f in FILES:
        assert _jit.REGISTRY.get(f), f"{f} has no registered kernels: an op module must register them"


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A kernel cache folder filled by ``python -m moe_rt warmup --arch sm_80,sm_90 --out DIR`` in a fresh
    process: every registered instantiation compiled as its own program, for each architecture."""
    out = tmp_path_factory.mktemp("kernel_cache")
    env = dict(os.environ, MOE_RT_KERNEL_CACHE=str(out / "unused"))
    r = subprocess.run([sys.executable, "-m", "moe_rt", "warmup", "--arch", ",".join(ARCHS), "--out", str(out),
                        "--quiet",
                        "--jobs", str(max(2, os.cpu_count() or 1))],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(_jit.registered(quick=False)) * len(ARCHS)
    assert f"{n} kernels for {','.join(ARCHS)}" in r.stdout, r.stdout
    assert f"{n} compiled, 0 already cached" in r.stdout, r.stdout
    return out


def test_warmup_compiles_every_registered_kernel_alone(warm_cache):
    manifest = json.loads((warm_cache / "manifest.json").read_text())
    rows = {(k["arch"], k["file"], k["name"]): k for k in manifest["kernels"]}
    assert set(rows) == {(a, f, n) for a in ARCHS for f, n in _jit.registered(quick=False)}
    assert manifest["source_hash"] == _jit.source_hash()
    for (a, f, n), k in rows.items():
        image = (warm_cache / k["image"]).read_bytes()
        assert image[:4] == b"\x7fELF" and len(image) > 1000, (a, f, n)
        assert k["image"].startswith(a + "/") and k["lowered"]
        assert k["lowered"].encode() in image, (a, f, n)  # the program holds the kernel it was built for


def _compile_quick(args):
    from moe_rt import _jit as j

    f, n = args
    image, lowered = j.compile_offline(f, ARCH, [n])
    return f, n, image[:4] == b"\x7fELF" and lowered[n].encode() in image


def test_every_quick_kernel_compiles_alone():
    """The quick kernels (compiled on a first call while the kernel they stand in for compiles in the
    background; warmup leaves them out) compile, each as its own program, for sm_90."""
    quick = sorted(_jit.QUICK)
    assert quick and all(f in _jit.REGISTRY and n in _jit.REGISTRY[f] for f, n in quick)
    with ProcessPoolExecutor(max(2, os.cpu_count() or 1), mp_context=multiprocessing.get_context("spawn")) as ex:
        rows = list(ex.map(_compile_quick, quick))
    assert [r[:2] for r in rows if not r[2]] == []


def test_a_program_holds_only_its_own_instantiation(warm_cache):
    """One instantiation per program: the image built for a name holds no other registered kernel of its
    file (checked for the first three names of each file against all the others)."""
    rows = [k for k in json.loads((warm_cache / "manifest.json").read_text())["kernels"] if k["arch"] == ARCH]
    for f in FILES:
        mine = [k for k in rows if k["file"] == f]
        for k in mine[:3]:
            image = (warm_cache / k["image"]).read_bytes()
            others = [o["lowered"] for o in mine if o["name"] != k["name"]]
            assert not [o for o in others if o.encode() in image], (f, k["name"])


def test_a_process_using_the_warmed_folder_compiles_nothing(warm_cache):
    code = ("import moe_rt; from moe_rt import _jit\n"
            "print(sum(_jit.kernel_image(f, n, 'sm_90')[2] for f, n in _jit.registered(quick=False)))\n")
    env = dict(os.environ, MOE_RT_KERNEL_CACHE=str(warm_cache))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0", r.stdout
    assert "compiled" not in r.stderr


def test_info_counts_the_cached_kernels(warm_cache):
    env = dict(os.environ, MOE_RT_KERNEL_CACHE=str(warm_cache))
    r = subprocess.run([sys.executable, "-m", "moe_rt", "info"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    n = len(_jit.registered(quick=False))
    assert f"kernel cache {warm_cache}" in r.stdout
    assert f"{ARCH}: {n} of {n} kernels of this build cached" in r.stdout, r.stdout


def test_compile_error_carries_the_log(tmp_path, monkeypatch):
    bad = tmp_path / "kernels"
    bad.mkdir()
    (bad / "broken.cu").write_text('extern "C" __global__ void k() { this is not C++; }\n')
    monkeypatch.setattr(_jit, "kernels_dir", lambda: bad)
    with pytest.raises(RuntimeError, match="NVRTC failed on broken.cu"):
        _jit.compile_offline("broken.cu", "sm_90", names=["k"])


def test_cache_key_covers_headers_and_sources(monkeypatch):
    h = _jit.source_hash()
    assert len(h) == 40
    assert any(o.startswith("-DMOE_RT_SOURCE_HASH=0x") for o in _jit.options())
    assert str(_jit.include_dir()) in " ".join(_jit.options())
    key = _jit.cache_key("common.cu", "fill_bytes", "sm_90")
    assert key != _jit.cache_key("common.cu", "fill_bytes", "sm_80")
    assert key != _jit.cache_key("common.cu", "scale_copy<float>", "sm_90")
    monkeypatch.setattr(_jit, "nvrtc_version", lambda: (99, 0))
    assert key != _jit.cache_key("common.cu", "fill_bytes", "sm_90")
    monkeypatch.undo()
    monkeypatch.setenv("MOE_RT_NVRTC_OPTIONS", "-lineinfo")
    assert key != _jit.cache_key("common.cu", "fill_bytes", "sm_90")
    monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS")
    monkeypatch.setattr(_jit, "source_hash", lambda: "0" * 40)
    assert key != _jit.cache_key("common.cu", "fill_bytes", "sm_90")
    monkeypatch.undo()
    # folder paths are not part of the key: a folder copied to another machine serves there
    monkeypatch.setattr(_jit, "include_dir", lambda: _jit.Path("/elsewhere/include"))
    assert key == _jit.cache_key("common.cu", "fill_bytes", "sm_90")


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
