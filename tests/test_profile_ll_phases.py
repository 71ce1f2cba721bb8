"""tools/profile_ll_phases.py on this machine: its help, its refusals (kernels without the trace, no GPU), the
reduction of a trace to phases, and that the low-latency kernels compile with the trace on (kernels/ep.cu,
MOE_RT_LL_TRACE) and hold its global only then. The traced run itself needs GPUs (notes' x4_lltrace.sh)."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "profile_ll_phases.py"


def _tool():
    spec = importlib.util.spec_from_file_location("profile_ll_phases", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args, options=None):
    env = dict(os.environ)
    env.pop("MOE_RT_NVRTC_OPTIONS", None)
    if options is not None:
        env["MOE_RT_NVRTC_OPTIONS"] = options
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=120)


def test_help():
    r = _run("--help")
    assert r.returncode == 0
    for opt in ("--tokens", "--partials", "--iters", "--warmup"):
        assert opt in r.stdout
    assert "MOE_RT_LL_TRACE" in r.stdout


@pytest.mark.parametrize("options", [None, "-lineinfo", "-DMOE_RT_LL_TRACE_X"])
def test_refuses_kernels_without_the_trace(options):
    r = _run("--tokens", "64", options=options)
    assert r.returncode == 2
    assert "built without the phase trace" in r.stderr and "MOE_RT_NVRTC_OPTIONS=-DMOE_RT_LL_TRACE" in r.stderr
    assert r.stdout == ""


def test_bad_arguments():
    r = _run("--iters", "0", options="-DMOE_RT_LL_TRACE")
    assert r.returncode == 2 and "--iters" in r.stderr


def test_refuses_without_gpu_or_launcher():
    pytest.importorskip("cupy")
    from moe_rt import _jit

    r = _run(options="-lineinfo -DMOE_RT_LL_TRACE")
    assert r.returncode == 2 and r.stdout == ""
    if _jit.no_gpu_reason() is not None:
        assert "no CUDA" in r.stderr or "CUDA GPU" in r.stderr
    else:
        assert "tools/launch.py" in r.stderr


def _trace(grid, points, t0=1_700_000_000_000_000_000):
    tr = np.zeros((1024, 16), np.uint64)
    for b, row in enumerate(points):
        for p, v in row.items():
            tr[b, p] = t0 + v
        tr[b, 15] = (b % 132) << 32 | grid
    return tr


def test_block_stats_of_a_known_trace():
    """Three dispatch blocks: starts relative to the earliest entry, durations per block, the copies' absence
    (the slot tables then start at the wait's end), the span from the first entry to the last exit."""
    mod = _tool()
    blocks = [
        {0: 1000, 1: 2000, 2: 2500, 3: 3000, 4: 13000, 5: 15000, 6: 15500, 8: 20000, 7: 30000, 9: 33000, 10: 34000},
        {0: 0, 1: 1500, 2: 2000, 3: 2600, 4: 11000, 5: 12000, 6: 12500, 7: 29000, 9: 36000, 10: 37000},
        {0: 3000, 1: 3500, 2: 4000, 3: 4400, 4: 20000, 5: 26000, 10: 26500},  # a push-only block
    ]
    tr = _trace(3, blocks)
    out, span, grid = mod.block_stats(tr, mod.PHASES["dispatch"])
    assert grid == 3 and span == pytest.approx(37.0)
    st, du, n = out["push rows"]
    assert n == 3
    assert st == pytest.approx((2.6, 3.0, 4.4)) and du == pytest.approx((8.4, 10.0, 15.6))
    st, du, n = out["zero rows"]  # from the push's signal to the wait (a push-only block has none)
    assert n == 2 and st == pytest.approx((12.0, 13.5, 15.0)) and du == pytest.approx((0.5, 0.5, 0.5))
    st, du, n = out["own chunks' waits + copies"]  # only block 0 copied
    assert n == 1 and st == pytest.approx((15.5, 15.5, 15.5)) and du == pytest.approx((4.5, 4.5, 4.5))
    st, du, n = out["wait for all"]  # from point 8 where the block copied, else from point 6
    assert n == 2 and st == pytest.approx((12.5, 16.25, 20.0)) and du == pytest.approx((10.0, 13.25, 16.5))
    st, du, n = out["slot tables"]
    assert n == 2 and st == pytest.approx((29.0, 29.5, 30.0)) and du == pytest.approx((3.0, 5.0, 7.0))
    assert out["block"][1] == pytest.approx((23.5, 33.0, 37.0))
    assert mod.timer_step(tr) == 100
    lines = mod.summarize([(out, span, grid), (out, span + 2, grid)], mod.PHASES["dispatch"])
    assert "kernel span   38.00 us" in lines[0] and "grid 3" in lines[0]
    assert any(line.split()[:2] == ["push", "rows"] for line in lines)


def test_block_stats_without_blocks():
    mod = _tool()
    with pytest.raises(RuntimeError, match="no block"):
        mod.block_stats(np.zeros((1024, 16), np.uint64), mod.PHASES["combine"])


def test_pick_the_op_kernel():
    mod = _tool()
    barrier = ("ep_direct_barrier", 32, 1, 10)
    disp = ("_Z14ep_ll_dispatchI13__nv_bfloat16iLb1EEv", 512, 2, 131072)
    comb = ("_Z13ep_ll_combineI13__nv_bfloat16Lb1ELb0EEv", 512, 3, 131072)
    assert mod.pick([barrier, disp], "dispatch") == (2, 131072)
    assert mod.pick([barrier, comb], "combine") == (3, 131072)
    assert mod.pick([barrier], "dispatch") is None
    assert mod.pick([(None, 32, 1, 10), (None, 512, 4, 64)], "combine") == (4, 64)


@pytest.mark.parametrize("name", ["ep_ll_dispatch<__nv_bfloat16, int, true>", "ep_ll_combine<__nv_bfloat16, true, false>",
                                  "ep_ll_dispatch_fp8<__nv_bfloat16, int, true>"])
def test_kernels_compile_with_the_trace(monkeypatch, name):
    pytest.importorskip("cupy")
    from moe_rt import _jit

    monkeypatch.setenv("MOE_RT_NVRTC_OPTIONS", "-DMOE_RT_LL_TRACE")
    image, _ = _jit.compile_offline("ep.cu", "sm_90", [name])
    assert b"moe_rt_ll_trace" in image
    monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS")
    image, _ = _jit.compile_offline("ep.cu", "sm_90", [name])
    assert b"moe_rt_ll_trace" not in image
