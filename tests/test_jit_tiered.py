"""Tiered compiles (moe_rt._jit.function_tiered): on a first call whose kernel is neither loaded nor cached, a
quick kernel stands in while the kernel compiles on a background thread; later calls get the kernel. CPU tests
over stand-ins for the device, the loader and NVRTC; the GPU tests of the router check that the quick kernels
compute the same bits."""
import threading
import time

import pytest

from moe_rt import _jit


@pytest.fixture
def tiered(monkeypatch, tmp_path):
    """function_tiered over a fake device 0 (sm_90), a loader that names what it loads and an NVRTC stand-in
    that waits for ``gate``."""
    gate = threading.Event()
    compiled = []

    def kernel_image(file, name, arch, *, root=None, where=""):
        compiled.append((name, where))
        assert gate.wait(30)
        return b"image of " + name.encode(), "lowered_" + name, True

    loaded = []

    def function(file, name):
        loaded.append(name)
        got = _jit._compiled.pop((file, name, "sm_90"), None)
        return ("kernel", name, got is not None)

    monkeypatch.setattr(_jit, "TIERED", True)
    monkeypatch.setattr(_jit, "_device_id", lambda: 0)
    monkeypatch.setattr(_jit, "device_properties", lambda dev: {"cc": (9, 0)})
    monkeypatch.setattr(_jit, "arch_for", lambda cc: "sm_90")
    monkeypatch.setattr(_jit, "kernel_image", kernel_image)
    monkeypatch.setattr(_jit, "function", function)
    monkeypatch.setattr(_jit, "cache_key", lambda file, name, arch: "k")
    monkeypatch.setattr(_jit, "_functions", {})
    monkeypatch.setattr(_jit, "_background", {})
    monkeypatch.setattr(_jit, "_compiled", {})
    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(tmp_path))
    return gate, compiled, loaded


def test_the_quick_kernel_stands_in_until_the_kernel_is_compiled(tiered):
    gate, compiled, loaded = tiered
    n0 = _jit.provisional_calls
    assert _jit.function_tiered("router.cu", "big<float>", "small<float, 0>") == (("kernel", "small<float, 0>", False), False)
    assert _jit.function_tiered("router.cu", "big<float>", "small<float, 3>") == (("kernel", "small<float, 3>", False), False)
    assert _jit.provisional_calls == n0 + 2
    assert compiled == [("big<float>", " (in the background)")]  # one background compile, said as such
    assert not _jit.settle(timeout=0.05)  # still compiling
    gate.set()
    assert _jit.settle(timeout=30)
    # the compiled image is loaded (not compiled again), and the kernel is final from now on
    assert _jit.function_tiered("router.cu", "big<float>", "small<float, 0>") == (("kernel", "big<float>", True), True)
    assert len(compiled) == 1 and loaded[-1] == "big<float>"


def test_a_cached_kernel_is_taken_at_once(tiered, tmp_path):
    gate, compiled, loaded = tiered
    entry = _jit._entry(str(tmp_path), "router.cu", "big<float>", "sm_90")
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"cubin")
    assert _jit.function_tiered("router.cu", "big<float>", "small<float, 0>") == (("kernel", "big<float>", False), True)
    assert compiled == [] and not _jit._background


def test_without_a_quick_kernel_or_with_tiering_off_the_kernel_compiles_in_the_foreground(tiered, monkeypatch):
    gate, compiled, loaded = tiered
    gate.set()
    assert _jit.function_tiered("router.cu", "big<float>", None) == (("kernel", "big<float>", False), True)
    monkeypatch.setattr(_jit, "TIERED", False)
    assert _jit.function_tiered("router.cu", "other<float>", "small<float, 0>") == (("kernel", "other<float>", False), True)
    assert not _jit._background


def test_a_failed_background_compile_is_compiled_again_in_the_foreground(tiered, monkeypatch):
    gate, compiled, loaded = tiered

    def broken(file, name, arch, *, root=None, where=""):
        compiled.append(name)
        assert gate.wait(30)
        raise RuntimeError("NVRTC failed")

    monkeypatch.setattr(_jit, "kernel_image", broken)
    assert _jit.function_tiered("router.cu", "big<float>", "small<float, 0>")[1] is False
    gate.set()
    assert _jit.settle(timeout=30)
    # nothing compiled was kept: function() compiles it in the foreground (and raises there on a real error)
    assert _jit.function_tiered("router.cu", "big<float>", "small<float, 0>") == (("kernel", "big<float>", False), True)


def test_every_quick_kernel_is_registered_beside_its_kernel():
    import moe_rt  # noqa: F401 - registers the kernels

    quick = sorted(n for f, n in _jit.QUICK)
    assert quick and all((f, n) in set(_jit.registered()) for f, n in _jit.QUICK)
    assert not set(_jit.QUICK) & set(_jit.registered(quick=False))
    assert len(_jit.registered()) == len(_jit.registered(quick=False)) + len(_jit.QUICK)
