"""CPU checks of the benchmarks (moe_rt/bench, tools/): helpers that carry math of their own, the report's
tables and plot on synthetic rows, the progress bar, and the tools' command lines without a GPU."""
import io
import os
import subprocess
import sys

import numpy as np
import pytest

from moe_rt.bench import _lib
from moe_rt.bench import layer as bench_layer
from moe_rt.bench import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def _against_ragged_dot(make_gmm, sizes, extra_rows, seed):
    """A grouped matmul of bench_layer against jax.lax.ragged_dot and XLA's gradient of it (fp32): the value,
    and the gradients of lhs and rhs; rows past the last group get zero output and zero gradient."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    G, H, F = len(sizes), 6, 5
    N = sum(sizes) + extra_rows
    lhs = jnp.asarray(rng.standard_normal((N, H)).astype(np.float32))
    rhs = jnp.asarray(rng.standard_normal((G, H, F)).astype(np.float32))
    gs = jnp.asarray(np.array(sizes, np.int32))
    cot = jnp.asarray(rng.standard_normal((N, F)).astype(np.float32))
    gmm = make_gmm(bench_layer)

    def loss(f):
        return lambda a, b: (f(a, b, gs) * cot).sum()

    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    got = jax.jit(jax.grad(loss(gmm), argnums=(0, 1)))(lhs, rhs)
    out = np.asarray(jax.jit(gmm)(lhs, rhs, gs))
    np.testing.assert_allclose(out, np.asarray(jax.lax.ragged_dot(lhs, rhs, gs)), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[sum(sizes):], 0)
    np.testing.assert_array_equal(np.asarray(got[0])[sum(sizes):], 0)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [[5, 0, 17, 3], [0, 0, 0, 9], [16, 16, 16, 16], [1, 40, 0, 2]])
@pytest.mark.parametrize("extra_rows", [0, 7])
def test_jax_grouped_matmul_matches_ragged_dot_gradient(sizes, extra_rows):
    """The blocked weight gradient (jax_grouped_matmul, blocks of 8 rows): groups that are empty, shorter
    than a block, exactly a block and several blocks, and rows past the last group."""
    _against_ragged_dot(lambda bl: bl.jax_grouped_matmul(block=8), sizes, extra_rows, 0)


@pytest.mark.parametrize("sizes,capacity", [([5, 0, 17, 3], 17), ([0, 0, 0, 9], 16), ([16, 16, 16, 16], 16),
                                            ([1, 40, 0, 2], 48)])
@pytest.mark.parametrize("extra_rows", [0, 7])
def test_jax_capacity_matmul_matches_ragged_dot(sizes, capacity, extra_rows):
    """The capacity grouped matmul (dense einsums over [G, C, *]): empty groups, groups equal to the
    capacity and shorter, and rows past the last group."""
    _against_ragged_dot(lambda bl: bl.jax_capacity_matmul(capacity), sizes, extra_rows, 1)


def test_profile_router_cases():
    """tools/profile_router.py names one case per (op, score function, dtype, E) and refuses others."""
    import profile_router

    assert len(profile_router.CASES) == 44 and "bwd-softmax-f32-E2304" in profile_router.CASES
    assert "fwd-sigbias-bf16-E2304" in profile_router.CASES
    assert "bwdbits-softmax-f32-E2304" in profile_router.CASES and "qb-fused-bf16-E256" in profile_router.CASES
    sys_argv = sys.argv
    sys.argv = ["profile_router.py", "fwd-softmax-f64-E2304"]
    try:
        with pytest.raises(SystemExit, match="unknown case"):
            profile_router.main()
    finally:
        sys.argv = sys_argv


def test_bench_router_expert_counts():
    """bench_router's --E: a comma list of the expert counts it has rows for (each with its K)."""
    import argparse

    from moe_rt.bench import router as bench_router

    assert bench_router._expert_counts("64,32,2304") == [64, 32, 2304]
    assert all(bench_router.SHAPES[e] <= e for e in bench_router.SHAPES)
    for bad, word in (("77", "not among"), ("64,x", "comma list of integers"), ("", "comma list of integers")):
        with pytest.raises(argparse.ArgumentTypeError, match=word):
            bench_router._expert_counts(bad)


def test_profile_layer_router_command_line(capsys):
    """tools/profile_layer_router.py: the layer benchmark's router shape by default; sizes checked."""
    import profile_layer_router as plr

    a = plr.parse([])
    assert (a.T, a.H, a.E, a.K) == (8192, 4096, 64, 8) and not a.profile
    for bad in (["--K", "9", "--E", "8"], ["--T", "0"]):
        with pytest.raises(SystemExit):
            plr.parse(bad)
        assert "must be positive, and K <= E" in capsys.readouterr().err


def test_interleaved_timing_takes_turns(monkeypatch):
    """bench_layer.interleaved_us: every function timed once per round in a rotated order (so that the host's
    drift hits all alike), each batch closed by its own sync; per-call times are the medians over rounds."""
    clock = [0.0]
    monkeypatch.setattr(bench_layer.time, "perf_counter", lambda: clock[0])
    order, syncs = [], []

    def fn(name, cost):
        def call():
            clock[0] += cost
            if not order or order[-1] != name:
                order.append(name)
        return call

    fns = [(k, fn(k, c), lambda k=k: syncs.append(k)) for k, c in (("a", 2e-6), ("b", 5e-6), ("c", 1e-6))]
    us = bench_layer.interleaved_us(fns, n=4, reps=3)
    assert us == pytest.approx({"a": 2.0, "b": 5.0, "c": 1.0})
    # warm-up: each in turn; then three rounds, rotated: abc, bca, cab
    assert order == list("abc") + list("abc") + list("bca") + list("cab")
    assert syncs == list("abc") + list("abc") + list("bca") + list("cab")


def test_overhead_targets_read_every_row_kind(capsys):
    """The adapter targets printed from an overhead table of every row kind the benchmark writes (floor rows
    with no direct call among them): each target's figure from the rows it names, met or MISSED."""
    rows = [
        dict(framework="torch", op="dispatch", **{"pass": "fwd", "adapter us": 20.0, "direct us": 18.0,
                                                 "overhead us/call": 2.0}),
        dict(framework="torch", op="make_plan", **{"pass": "fwd", "adapter us": 40.0, "direct us": 24.0,
                                                  "overhead us/call": 16.0}),
        dict(framework="torch", op="(empty custom op)", **{"pass": "fwd", "adapter us": 14.0, "direct us": 2.0,
                                                           "overhead us/call": 12.0}),
        dict(framework="torch", op="(empty autograd.Function)", **{"pass": "fwd+bwd, in one graph (40 ops)",
                                                                   "adapter us": 31.0, "direct us": 0.0,
                                                                   "overhead us/call": 15.5}),
        dict(framework="torch", op="dispatch / combine", **{"pass": "fwd+bwd, in one graph (40 ops)",
                                                            "adapter us": 125.0, "direct us": 53.0,
                                                            "overhead us/call": 17.0}),
        dict(framework="jax", op="(no-op custom call with combine's inputs and outputs)",
             **{"pass": "fwd", "adapter us": 49.0}),
        dict(framework="jax", op="combine", **{"pass": "fwd", "adapter us": 60.5, "direct us": 26.6,
                                              "overhead us/call": 33.9}),
        dict(framework="jax", op="dispatch / combine", **{"pass": "fwd, in one jit (40 ops)", "adapter us": 8.5,
                                                          "direct us": 27.8, "overhead us/call": -19.3,
                                                          "direct GPU us": 7.0}),
    ]
    bench_layer.overhead_targets(rows)
    out = capsys.readouterr().out.splitlines()
    assert "  torch dispatch fwd over the direct call: 2.0 us (target <= 3) met" in out
    assert "  torch make_plan fwd over the direct call: 16.0 us (target <= 3) MISSED" in out
    assert ("  torch dispatch / combine fwd+bwd, in one graph (40 ops) over (empty autograd.Function) a call: 1.5 us "
            "(target <= 3) met") in out
    assert "  jax jitted combine over its no-op custom call: 11.5 us (target <= 0) MISSED" in out
    assert "  jax dispatch / combine fwd, in one jit (40 ops) over its kernels an op: 1.5 us (target <= 2) met" in out
    assert len(out) == 5  # the floors and the absent pairs give no line


def test_run_sides_runs_each_side_in_its_own_process(tmp_path, capsys):
    """_lib.run_sides: each side a process of the script with its switches in the environment, its last line's
    JSON returned by name; a failing side's output goes to stderr and its exit status ends the caller."""
    script = tmp_path / "side.py"
    script.write_text("import json, os, sys\nprint('noise')\nside = sys.argv[sys.argv.index('--side') + 1]\n"
                      "sys.exit(3) if side == 'bad' else print(json.dumps([side, sys.argv[1], os.environ['KNOB']]))\n")
    got = _lib.run_sides(str(script), ["arg"], [("a", {"KNOB": "0"}), ("b", {"KNOB": "7"})])
    assert got == {"a": ["a", "arg", "0"], "b": ["b", "arg", "7"]}
    with pytest.raises(SystemExit) as e:
        _lib.run_sides(str(script), ["arg"], [("bad", {"KNOB": "1"})])
    assert e.value.code == 3 and "noise" in capsys.readouterr().err


def test_host_us_back_to_back(monkeypatch):
    """_lib.host_us_back_to_back: warm-up calls and a sync, then the mean over back-to-back calls with no sync
    inside the timed span, and a sync after it."""
    import time

    clock, log = [0.0], []
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def fn():
        clock[0] += 3e-6
        log.append("f")

    us = _lib.host_us_back_to_back(fn, 4, 2, lambda: log.append("s"))
    assert us == pytest.approx(3.0)
    assert log == ["f", "f", "s", "f", "f", "f", "f", "s"]


def test_bare_functions_match_the_adapters():
    """bench_layer's bare autograd.Functions (the in-graph floor of any Function wrapper of the moe_rt calls)
    compute what the torch adapters compute: the same values and gradients, on the reference path."""
    torch = pytest.importorskip("torch")
    import moe_rt.torch as mt

    bare_d, bare_c, bare_topk = bench_layer._bare_functions()
    g = torch.Generator().manual_seed(3)
    T, H, E, K = 13, 24, 8, 3
    logits = torch.randn(T, E, generator=g) + torch.arange(E) * (1e-3 / E)  # no ties
    x = torch.randn(T, H, generator=g)
    gy, gl = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    probs, rmap = mt.topk_with_score(logits, K)
    plan = mt.make_plan(rmap, E)
    core = mt._plan_of(plan)
    got = []
    for bare in (False, True):
        xg, pg, lg = (t.clone().requires_grad_() for t in (x, probs, logits))
        if bare:
            y, p = bare_c.apply(bare_d.apply(xg, core), pg, core), bare_topk.apply(lg, K)[0]
        else:
            y, p = mt.combine(mt.dispatch(xg, plan)[0], plan, pg), mt.topk_with_score(lg, K)[0]
        got.append((y.detach(), p.detach(), *torch.autograd.grad((y, p), (xg, pg, lg), (gy, gl))))
    for a, b in zip(*got):
        assert torch.equal(a, b)


# ---- python -m moe_rt bench: the report on synthetic rows ------------------------------------------------

ROUTER_ROWS = [
    {"dtype": "bfloat16", "T": 4096, "E": 256, "K": 8, "op": "softmax fwd", "ms": 0.05, "GB/s": 2400.0,
     "% copy": 80.0, "eager ms": 0.4, "x eager": 8.0, "compile ms": None, "x compile": None},
    {"dtype": "float32", "T": 65536, "E": 2304, "K": 36, "op": "sigmoid bwd", "ms": 0.9, "GB/s": 1500.0,
     "% copy": 50.0, "eager ms": 1.8, "x eager": 2.0, "compile ms": 1.0, "x compile": 1.1},
]
PERMUTATION_ROWS = [
    {"op": "dispatch", "T": 8192, "E": 256, "K": 8, "H": 7168, "ms": 0.3, "GB/s": 2900.0, "% copy": 95.0,
     "torch ms": 0.9, "x torch": 3.0},
    {"op": "combine [cta128 k8 cs]", "T": 8192, "E": 256, "K": 8, "H": 7168, "ms": 0.4, "GB/s": 2000.0,
     "% copy": 66.0},
    {"op": "dispatch at copy floor", "T": 8192, "E": 256, "K": 8, "H": 7168, "ms": 0.28, "GB/s": 3000.0,
     "% copy": 100.0, "torch ms": 0.9, "x torch": 3.2},
    {"op": "make_plan (graph replay)", "T": 8192, "E": 256, "K": 8, "H": 7168, "ms": 0.02},
]
FP8_ROWS = [
    {"op": "quantize (packed rows)", "dtype": "bfloat16", "T": 4096, "H": 7168, "ms": 0.06, "GB/s": 1500.0,
     "% copy": 36.0, "torch ms": 0.36, "x torch": 6.0},
]
EP_ROWS = [
    {"op": "dispatch", "mode": "exact", "chunks": "2", "T": 4096, "ms": 1.0, "wire_MB": 200.0,
     "wire_GB/s": 200.0, "torch_ms": 3.0, "raw_a2a_ms": 0.9, "x_vs_torch": 3.0, "x_vs_raw": 1.1},
    {"op": "prepare", "mode": "exact", "chunks": None, "T": 4096, "ms": 0.1, "wire_MB": 0.0},
]
LAYER_ROWS = [
    {"part": "dispatch fwd+bwd", "impl": "moe_rt (torch)", "ms": 1.0, "GB/s": 2000.0, "% copy": 70.0},
    {"part": "dispatch fwd+bwd", "impl": "torch eager", "ms": 4.0, "GB/s": 500.0, "% copy": 17.0,
     "x moe_rt": 4.0},
    {"part": "layer step", "impl": "torch.compile", "ms": 9.0, "x moe_rt": 1.5},
]


def _results():
    meta = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-01-01", "commit": "abc1234", "copy GB/s": 3000.0}
    return {"router": {"meta": dict(meta, title="router", columns=list(ROUTER_ROWS[0])), "rows": ROUTER_ROWS},
            "permutation": {"meta": dict(meta, title="dispatch/combine"), "rows": PERMUTATION_ROWS},
            "ep": {"meta": dict(meta, title="EP"), "rows": EP_ROWS},
            "layer": {"meta": dict(meta, title="layer"), "rows": LAYER_ROWS}}


def test_report_points():
    pts = report.points("router", ROUTER_ROWS)
    assert [(p["pct_copy"], p["speedup"]) for p in pts] == [(80.0, 8.0), (50.0, 2.0)]
    assert pts[0]["label"] == "softmax fwd bfloat16 T=4096 E=256" and pts[0]["baseline"] == "torch eager"
    # permutation: the five ops only (variants, floors and replays stay in the table)
    assert [p["label"] for p in report.points("permutation", PERMUTATION_ROWS)] == ["dispatch T=8192 E=256 K=8"]
    assert report.points("fp8", FP8_ROWS) == [{"label": "quantize (packed rows) bfloat16 T=4096", "pct_copy": 36.0,
                                                "speedup": 6.0, "baseline": "torch eager"}]
    ep = report.points("ep", EP_ROWS)  # EP: no copy share (the wire is not device memory); prepare: no baseline
    assert len(ep) == 1 and ep[0]["pct_copy"] is None and ep[0]["speedup"] == 3.0
    assert ep[0]["label"] == "dispatch exact chunks 2 T=4096" and ep[0]["baseline"] == "torch.distributed"
    layer = report.points("layer", LAYER_ROWS)  # moe_rt's share of copy; speed-up over eager, not compile
    assert [(p["label"], p["pct_copy"], p["speedup"]) for p in layer] == [
        ("dispatch fwd+bwd [moe_rt (torch)]", 70.0, None), ("dispatch fwd+bwd vs torch eager", None, 4.0)]
    with pytest.raises(ValueError, match="bench"):
        report.points("nope", [])


def test_report_tables():
    text = report.tables(_results())
    assert text.count("## ") == 4
    assert "## router: router (NVIDIA H100 80GB HBM3, 2026-01-01, commit abc1234, copy 3000.0 GB/s)" in text
    lines = text.splitlines()
    head = lines.index("| " + " | ".join(ROUTER_ROWS[0]) + " |")
    assert lines[head + 2] == "| bfloat16 | 4096 | 256 | 8 | softmax fwd | 0.05 | 2400 | 80.0 | 0.4 | 8 | - | - |"
    # columns from the rows when the meta names none, in first-seen order
    assert "| op | T | E | K | H | ms | GB/s | % copy | torch ms | x torch |" in text
    assert "| op | mode | chunks | T | ms | wire_MB | wire_GB/s | torch_ms | raw_a2a_ms | x_vs_torch | x_vs_raw |" \
        in text


def test_report_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    import struct

    path = tmp_path / "bench.png"
    n = report.plot(_results(), str(path))
    assert n == (2 + 1 + 1) + (2 + 1 + 1 + 1)  # bandwidth: router, permutation, layer; speed-up: and ep
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    assert w > 1000 and h > 200
    assert data[-8:-4] == b"IEND"


def test_report_plot_with_no_rows(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no rows to plot"):
        report.plot({"ep": {"meta": {}, "rows": [EP_ROWS[1]]}}, str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_report_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(RuntimeError, match=r'pip install "moe_rt\[bench\]"'):
        report.plot(_results(), str(tmp_path / "x.png"))


def test_progress_bar():
    out = io.StringIO()
    bar = _lib.Progress(stream=out, width=10)
    bar.start("router", 4)
    for i in range(4):
        bar.advance(f"T={i}")
    text = out.getvalue()
    frames = text.split("\r")[1:]
    assert len(frames) == 5 and text.endswith("\n") and text.count("\n") == 1
    assert frames[0].startswith("router [..........] 0/4")
    assert frames[2].startswith("router [#####.....] 2/4 T=1")
    assert frames[4].startswith("router [##########] 4/4 T=3")


def test_quiet_table_keeps_rows(monkeypatch, capsys):
    monkeypatch.setattr(_lib, "device_name", lambda: "test device")
    monkeypatch.setattr(_lib, "QUIET", True)
    t = _lib.Table("t", ["op", "ms"])
    t.header()
    t.add(op="dispatch", ms=0.5)
    t.finish(None)
    assert capsys.readouterr().out == "" and t.rows == [{"op": "dispatch", "ms": 0.5}]
    monkeypatch.setattr(_lib, "QUIET", False)
    t.add(op="combine", ms=1.25)
    assert capsys.readouterr().out == "combine | 1.25\n"


# ---- command lines: flag errors and no GPU, on CPU --------------------------------------------------------

def _run(args, timeout=120, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)


def _one_line_error(r, *needles):
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("tool", ["bench_router", "bench_permutation", "bench_fp8", "bench_layer", "bench_ep",
                                  "bench_plan"])
def test_tool_help(tool):
    r = _run([f"tools/{tool}.py", "--help"], env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stdout + r.stderr
    assert "--iters ITERS" in r.stdout and "(default: 50)" in r.stdout
    assert "[rank" not in r.stdout + r.stderr and "``" not in r.stdout  # bench_ep: no rank started


@pytest.mark.parametrize("args, needle", [
    (["tools/bench_router.py", "--T", "0,5"], "--T"),
    (["tools/bench_router.py", "--iters", "0"], "--iters"),
    (["tools/bench_permutation.py", "--batch", "-1"], "--batch"),
    (["tools/bench_layer.py", "--frameworks", "torch,tf"], "--frameworks"),
    (["tools/bench_plan.py", "--T", "0,5"], "--T"),
    (["tools/bench_plan.py", "--iters", "0"], "--iters"),
    (["tools/bench_layer.py", "--warmup", "-1"], "--warmup"),
    (["tools/bench_ep.py", "--chunks", "x1"], "--chunks"),
    (["tools/bench_ep.py", "--chunks", "m0"], "--chunks"),
    (["tools/bench_ep.py", "--chunks", "s1,m"], "--chunks"),
    (["tools/bench_ep.py", "--tokens", "512,zero"], "--tokens"),
    (["-m", "moe_rt", "bench", "--iters", "0"], "--iters"),
    (["-m", "moe_rt", "bench", "--warmup", "-2"], "--warmup"),
    (["-m", "moe_rt", "bench", "everything"], "invalid choice"),
    (["-m", "moe_rt", "bench", "--plot", "/nonexistent-folder/b.png"], "--plot"),
])
def test_flag_errors(args, needle):
    _one_line_error(_run(args), "error:", needle)


def test_bench_ep_chunks_accepts_mixed_groups():
    from moe_rt.bench import ep as bench_ep

    assert bench_ep._chunk_list("m2") == ["m2"]
    assert bench_ep._chunk_list("s1, o2,2,m1,m4") == ["s1", "o2", "2", "m1", "m4"]
    assert bench_ep.parser().parse_args(["--chunks", "m2,2"]).chunks == ["m2", "2"]
    for bad in ("m0", "m", "mm2", "m-1", "2m"):
        with pytest.raises(Exception, match="m<n>"):
            bench_ep._chunk_list(bad)


def _no_gpu():
    from conftest import GPU_COUNT

    if GPU_COUNT:
        pytest.skip("a CUDA GPU is present")


@pytest.mark.parametrize("args", [["tools/bench_router.py", "--quick"], ["tools/bench_permutation.py"],
                                  ["tools/bench_layer.py", "--quick"], ["tools/bench_ep.py", "--quick"],
                                  ["tools/launch.py", "-n", "2", "tests/ep_worker.py"],
                                  ["-m", "moe_rt", "bench", "--no-plot"], ["-m", "moe_rt", "bench", "router"]])
def test_no_gpu_is_one_line(args):
    _no_gpu()
    if args[-1] == "router":
        pytest.importorskip("matplotlib")  # without it the plot's error comes first (its own test)
    line = _one_line_error(_run(args), "no CUDA GPU")
    assert "insufficient" not in line


def test_bench_without_matplotlib_names_the_extra(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['matplotlib'] = None  # import matplotlib raises ImportError\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    _one_line_error(_run(["-m", "moe_rt", "bench", "--plot", str(tmp_path / "b.png")], env=env),
                    'pip install "moe_rt[bench]"', "--no-plot")


def test_bench_help_shows_defaults():
    r = _run(["-m", "moe_rt", "bench", "--help"], env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0, r.stderr
    for s in ("{router,permutation,fp8,ep,layer,all}", "(default: all)", "(default: bench.png)", "(default: 50)",
              "(default: 10)", "--no-compile", "--quick"):
        assert s in r.stdout, (s, r.stdout)


# ---- GPU: the bench command end to end ---------------------------------------------------------------------

def _bench_on_gpu(tmp_path, which):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    png, js = tmp_path / "b.png", tmp_path / "b.json"
    r = _run(["-m", "moe_rt", "bench", which, "--quick", "--iters", "3", "--warmup", "1", "--no-compile",
              "--plot", str(png), "--json", str(js)], timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{which} [" in r.stderr and f"plot: {png}" in r.stdout  # the progress bar; the plot
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import json

    rows = json.loads(js.read_text())[which]["rows"]
    pts = report.points(which, rows)
    assert pts and all(p["speedup"] is None or p["speedup"] > 0 for p in pts)
    assert "| op |" in r.stdout
    return pts


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["permutation", "router"])
def test_bench_command_on_the_gpu(tmp_path, which):
    pts = _bench_on_gpu(tmp_path, which)
    assert all(0 < p["pct_copy"] < 150 for p in pts if p["pct_copy"] is not None)


@pytest.mark.multi_gpu
def test_bench_ep_command_on_two_gpus(tmp_path):
    _bench_on_gpu(tmp_path, "ep")
