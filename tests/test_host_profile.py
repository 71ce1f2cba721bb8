"""The GPU mode of the host profilers (tools/profile_ep_host.py, tools/profile_ll_host.py --gpu; the machinery
in tools/host_gpu.py) on this machine: its arguments, and its breakdown wrappers against the stand-in device
(installed, every wrapped function reported, consistent accounting, removed without a trace)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def ep_tool():
    pytest.importorskip("cupy")
    return _tool("profile_ep_host")


@pytest.mark.parametrize("name", ["profile_ep_host", "profile_ll_host"])
def test_gpu_arguments(monkeypatch, name):
    """--gpu and its options parse (R from -n, else MOE_RT_BENCH_EP_NPROC, else 2); bad values and the
    stand-in's --profile with --gpu are refused (status 2) before anything starts; without --gpu the stand-in's
    arguments are as they were."""
    pytest.importorskip("cupy")
    mod = _tool(name)
    monkeypatch.delenv("MOE_RT_BENCH_EP_NPROC", raising=False)
    _, a = mod.parse_args([])
    assert not a.gpu and a.nproc == 2 and a.iters == 50 and a.json is None and a.profile is None
    assert a.calls == (200 if name == "profile_ep_host" else 400)
    assert a.tokens == (4096 if name == "profile_ep_host" else 128)
    monkeypatch.setenv("MOE_RT_BENCH_EP_NPROC", "3")
    _, a = mod.parse_args(["--gpu"])
    assert a.gpu and a.nproc == 3 and a.ops == list(mod.GPU_OPS)
    _, a = mod.parse_args(["--gpu", "-n", "4", "--tokens", "1000", "--iters", "7", "--top", "5", "--json", "o.json",
                           "--ops", "dispatch", "combine"])
    assert (a.nproc, a.tokens, a.iters, a.top, a.json, a.ops) == (4, 1000, 7, 5, "o.json", ["dispatch", "combine"])
    bad = [["--gpu", "--tokens", "0"], ["--gpu", "-n", "0"], ["--gpu", "--iters", "-1"], ["--gpu", "--ops", "nope"],
           ["--gpu", "--profile", "dispatch"]]
    if name == "profile_ep_host":
        _, a = mod.parse_args(["--gpu", "--transport", "nccl", "--modes", "exact"])
        assert a.transport == "nccl" and a.modes == ["exact"]
        assert mod.parse_args(["--gpu"])[1].transport == "direct"
        bad.append(["--gpu", "--transport", "ib"])
    for argv in bad:
        with pytest.raises(SystemExit) as e:
            mod.parse_args(argv)
        assert e.value.code == 2, argv


@pytest.mark.parametrize("name", ["profile_ep_host", "profile_ll_host"])
def test_gpu_mode_without_gpu(capsys, name):
    """--gpu on a machine without a GPU: status 2 and one line saying why, no rank started."""
    pytest.importorskip("cupy")
    from moe_rt import _jit

    if _jit.no_gpu_reason() is None:
        pytest.skip("a GPU is here")
    assert _tool(name).main(["--gpu", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{name}.py: --gpu: ") and len(err.strip().splitlines()) == 1, err


def _snapshot(hg):
    """Every attribute of what the breakdown may patch: moe_rt's modules and their classes, the stand-in's
    classes standing at _arrays.Call (and their bases), CuPy, its runtime, time, torch; and CuPy's allocator."""
    import time

    import cupy
    from cupy.cuda import runtime

    from moe_rt import _arrays, _jit

    spaces = []
    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == "moe_rt" or name.startswith("moe_rt.")):
            spaces.append(mod)
            spaces += [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == name]
    spaces += list(_arrays.Call.__mro__[:-1]) + [cupy, cupy.cuda, cupy.ndarray, runtime, time, _jit._driver]
    torch = sys.modules.get("torch")
    if torch is not None:
        spaces += [torch, torch._C, torch.Tensor]
    snap = {(id(sp), n): v for sp in spaces for n, v in list(vars(sp).items())}
    return spaces, snap, cupy.cuda.get_allocator()


def test_breakdown_wraps_and_unwraps_against_stand_in(monkeypatch, ep_tool):
    """Installed against the stand-in device: the leaves (launches per kernel, Call's allocations, the
    memcpy, the barrier) and every function and method of the EP modules are wrapped, each binding of a
    function too; per op the counts are the stand-in's own (launches, allocations, memcpys), every wrapped
    label is in the report, and the items' own times plus the unaccounted part and the release add up to the
    measured total; uninstalled, every attribute and CuPy's allocator are what they were and calls no longer
    count."""
    try:
        import torch  # noqa: F401  (its wrappers are installed too when torch is loaded)
    except ImportError:
        pass
    from moe_rt import _ep_direct, _ep_rows, _jit, ep

    hg = ep_tool._host_gpu()
    for name in hg.MODULES:
        __import__(name)
    monkeypatch.setattr(_ep_rows, "_launches", {})  # set-ups made with the stand-in kernels stay here
    st = ep_tool.EpStandIns(monkeypatch.setattr, resident=8, sm_count=4)
    ops = ep_tool.ops(st, 2, "capacity")
    spaces, before, allocator = _snapshot(hg)
    stand_in_launch = _jit.launch_raw
    bd = hg.Breakdown()
    bd.overhead = bd.calibrate(2000)
    assert bd.overhead[0] > 0
    bd.install()
    try:
        assert _jit.launch_raw.__wrapped__ is stand_in_launch
        assert ep.EpGroup.dispatch.__wrapped__ is vars(ep.EpGroup)["dispatch"].__wrapped__
        assert _ep_direct.DirectTransport.barrier._breakdown_label == "_ep_direct.DirectTransport.barrier"
        # a function imported by name elsewhere is wrapped at both bindings
        assert ep.regions is _ep_rows.regions and hasattr(ep.regions, "_breakdown_label")
        for label in ("Call.empty", "runtime.memcpyAsync", "runtime.streamIsCapturing", "cupy pool malloc",
                      "cupy.ndarray.copy", "time.sleep", "cuLaunchKernel", "_dlpack.consume", "ep.EpGroup._wait"):
            assert label in bd.labels, label
        assert len(bd.labels) == len(set(bd.labels)) > 100
        # launches, allocations (tests/test_ep.py's counts), of them through Call.empty, memcpys per call; of the
        # launches those the core makes in one call (the direct group's barrier and kernels, prepare's kernel; the
        # rest through launch_raw)
        want = {"prepare": (1, 2, 0, 0, 1), "dispatch": (2, 3, 3, 0, 2), "combine": (2, 1, 1, 0, 2),
                "dispatch_bwd": (3, 2, 2, 0, 3), "combine_bwd": (2, 1, 1, 0, 2)}  # its rows scaled in the core's kernel
        n = 3
        for op, (launches, allocs, call_empty, memcpys, core) in want.items():
            bd.reset()
            l0, a0, m0 = st.launches, st.allocs, st.memcpys
            for _ in range(n):
                bd.measure(ops[op])
            rep = bd.report(bd.overhead, every=True)
            assert rep["calls"] == n
            items = {it["label"]: it for it in rep["items"]}
            assert set(bd.labels) <= set(items), set(bd.labels) - set(items)
            assert all(it["category"] for it in rep["items"])
            count = lambda pre: sum(it["count"] for lab, it in items.items() if lab.startswith(pre))  # noqa: E731
            assert count("_jit.launch_raw[") == launches - core and launches == (st.launches - l0) / n, op
            assert count("_core.ep_direct_") + count("_core.ep_prepare") == (1 if core else 0), op
            assert (st.allocs - a0) / n == allocs
            assert count("Call.empty") == call_empty, op
            # dispatch's copy of tokens_per_expert is made in the core's call (the stand-in counts it): none through
            # CuPy's runtime from Python
            assert count("runtime.memcpyAsync") == 0 and memcpys == (st.memcpys - m0) / n, op
            assert items["_ep_direct.DirectTransport.barrier"]["count"] == 0, op  # inside the core's call
            assert items[f"ep.EpGroup.{op}"]["count"] == 1
            assert items["ep.EpGroup._check_handle"]["count"] == (0 if op == "prepare" else 1)
            own = sum(it["own_us"] for it in rep["items"] if it["label"] != "(gc)")
            assert own + rep["unaccounted_us"] + rep["release_us"] == pytest.approx(rep["total_us"], rel=1e-9)
            assert rep["total_us"] > 0 and rep["wrapped_calls"] > 10
            assert rep["wrapper_overhead_us"] == pytest.approx(rep["wrapped_calls"] * bd.overhead[0] / 1e3)
            # the op's span holds everything wrapped beneath it
            assert items[f"ep.EpGroup.{op}"]["span_us"] <= rep["total_us"]
            text = hg.format_breakdown(rep, top=5)
            assert f"ep.EpGroup.{op}" in text or "(unaccounted" in text
    finally:
        bd.uninstall()
    spaces2, after, allocator2 = _snapshot(hg)
    assert allocator2 is allocator
    assert set(after) == set(before)
    changed = [k for k in before if after[k] is not before[k]]
    assert not changed, changed[:5]
    calls = sum(a[0] for a in bd.acc.values())
    ops["dispatch"]()
    assert sum(a[0] for a in bd.acc.values()) == calls


def test_profile_ops_in_lockstep(ep_tool):
    """profile_ops: rank 0 (breakdown and cProfile on top of the timing) and any other rank call each op the
    same number of times, with a sync after every call; rank 0's rows carry the breakdown and the cProfile's
    top functions."""
    import io

    hg = ep_tool._host_gpu()
    from moe_rt import _ep_rows

    saved = _ep_rows._launches
    _ep_rows._launches = {}
    mp = pytest.MonkeyPatch()
    try:
        st = ep_tool.EpStandIns(mp.setattr, resident=8, sm_count=4)
        base = ep_tool.ops(st, 2, "capacity")
        counts = {"syncs": 0}

        def counted(name):
            f = base[name]

            def g():
                counts[name] = counts.get(name, 0) + 1
                return f()
            return g

        ops = {k: counted(k) for k in ("prepare", "dispatch")}

        def sync():
            counts["syncs"] += 1

        buf = io.StringIO()
        rows = hg.profile_ops(ops, n=4, sync=sync, rank0=True, top=6, cprofile_top=6,
                              out=lambda s: buf.write(s + "\n"), time_host=lambda f: 1.0)
        rank0 = dict(counts)
        counts.clear()
        counts["syncs"] = 0
        rows1 = hg.profile_ops(ops, n=4, sync=sync, rank0=False, out=None, time_host=lambda f: 1.0)
        assert counts == rank0
    finally:
        mp.undo()
        _ep_rows._launches = saved
    assert [r["op"] for r in rows] == ["prepare", "dispatch"] and all("breakdown" not in r for r in rows1)
    for r in rows:
        assert r["breakdown"]["calls"] == 4 and 0 < len(r["cprofile"]) <= 6
        assert r["wall_us"] > 0 and r["cpu_us"] > 0 and r["host_us"] == 1.0
        assert any("dispatch" in c["function"] for c in r["cprofile"]) or r["op"] == "prepare"
    text = buf.getvalue()
    assert "### prepare" in text and "### dispatch" in text and "cProfile, 4 calls" in text
    table = hg.summary_table([dict(r, mode="capacity", host_us_ranks=[1.0, 2.0]) for r in rows])
    assert len(table.splitlines()) == 3 and "capacity" in table
    dg = hg.digest(rows).splitlines()
    assert len(dg) == 4 and dg[0].startswith("prepare") and dg[1].startswith("    top: ")
