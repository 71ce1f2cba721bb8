"""``python -m moe_rt``."""
import importlib
import os
import subprocess
import sys

import numpy as np


def _importable(module):
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def test_info_runs_everywhere():
    r = subprocess.run([sys.executable, "-m", "moe_rt", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for key in ("moe_rt", "numpy", "cupy", "nccl", "torch", "jax"):
        assert key in r.stdout, (key, r.stdout)
    assert "gpu" in r.stdout
    if not _importable("cupy"):
        assert "CPU reference only" in r.stdout, r.stdout
    else:
        assert "kernel cache" in r.stdout, r.stdout


def test_unknown_command_fails():
    r = subprocess.run([sys.executable, "-m", "moe_rt", "nope"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0


import pytest  # noqa: E402


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_demo_on_the_reference_path(framework):
    pytest.importorskip(framework)
    r = subprocess.run([sys.executable, "-m", "moe_rt", "demo", "--framework", framework, "--cpu", "--steps",
                        "2", "--tokens", "96"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NumPy reference path" in r.stdout
    assert "MISMATCH" not in r.stdout and r.stdout.count(" ok") == 7
    assert "tokens/s" in r.stdout


def test_demo_cupy_framework_and_ep_1_on_the_reference_path():
    r = subprocess.run([sys.executable, "-m", "moe_rt", "demo", "--framework", "cupy", "--cpu", "--steps", "2",
                        "--tokens", "80", "--ep", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "moe_rt demo: cupy" in r.stdout and "NumPy reference path" in r.stdout
    assert "MISMATCH" not in r.stdout and r.stdout.count(" ok") == 7
    for stage in ("router", "dispatch", "experts", "combine", "backward", "tokens/s"):
        assert stage in r.stdout, stage
    assert "cupy moe_rt layer [" in r.stderr  # the progress bar


@pytest.mark.parametrize("extra", [["--cpu"], []])
def test_demo_ep_without_gpus_says_so(extra):
    from conftest import GPU_COUNT

    if not extra and GPU_COUNT >= 2:
        pytest.skip("two GPUs present: --ep 2 would run")
    r = subprocess.run([sys.executable, "-m", "moe_rt", "demo", "--ep", "2", *extra], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--ep 2 needs 2 CUDA GPUs" in r.stdout


def test_demo_rejects_bad_ep():
    r = subprocess.run([sys.executable, "-m", "moe_rt", "demo", "--ep", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--ep" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--tokens", "0"], "--tokens"), (["--topk", "0"], "--topk"), (["--hidden", "0"], "--hidden"),
    (["--experts", "0"], "--experts"), (["--ffn", "0"], "--ffn"), (["--tokens", "-5"], "--tokens"),
    (["--hidden", "-1"], "--hidden"), (["--steps", "0"], "--steps"), (["--steps", "-2"], "--steps"),
    (["--topk", "9", "--experts", "8"], "--topk"), (["--topk", "9", "--cpu"], "--topk"),
    (["--topk", "65", "--experts", "128"], "--topk"), (["--experts", "20000"], "--experts"),
    (["--ep", "2", "--experts", "7", "--cpu"], "--ep 2"), (["--tokens", "many"], "--tokens"),
    (["--framework", "tf"], "--framework"),
])
def test_demo_rejects_bad_flags(args, needle):
    r = subprocess.run([sys.executable, "-m", "moe_rt", "demo", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and not r.stdout, r.stdout + r.stderr
    assert lines[0].startswith("python -m moe_rt demo: error:") and needle in lines[0], lines[0]


def test_demo_takes_the_sizes_given():
    # every size given is used as given (none replaced by a default); the others keep the CPU defaults
    r = subprocess.run([sys.executable, "-m", "moe_rt", "demo", "--framework", "cupy", "--cpu", "--steps", "1",
                        "--tokens", "1", "--experts", "3", "--topk", "3", "--hidden", "5"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "layer: tokens=1 experts=3 topk=3 hidden=5 ffn=32, 1 steps" in r.stdout, r.stdout


def test_demo_help_shows_text_and_defaults():
    r = subprocess.run([sys.executable, "-m", "moe_rt", "demo", "--help"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, COLUMNS="200"))  # help lines unwrapped
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m moe_rt demo"), r.stdout + r.stderr
    for s in ("A whole MoE layer", "(default: torch)", "(default: 10)", "(default: 1)",
              "when absent 4096 on a GPU, 256 on the CPU path", "experts per token K (<= E)"):
        assert s in r.stdout, (s, r.stdout)
    assert "``" not in r.stdout and ":func:" not in r.stdout and "(default: None)" not in r.stdout


def test_top_level_help_is_plain_text():
    r = subprocess.run([sys.executable, "-m", "moe_rt", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "``" not in r.stdout and ":func:" not in r.stdout and ":mod:" not in r.stdout, r.stdout
    for s in ("{info,demo,warmup,bench}", "info    versions", "demo    a MoE layer", "bench   the benchmarks",
              'pip install "moe_rt[bench]"'):
        assert s in r.stdout, (s, r.stdout)


def _layer_inputs(cfg, dtype, seed=0):
    rng = np.random.default_rng(seed)
    T, E, H, F = cfg.tokens, cfg.experts, cfg.hidden, cfg.ffn
    shapes = [(T, H), (H, E), (E, H, F), (E, H, F), (E, F, H)]
    params = [rng.standard_normal(s).astype(dtype) * (0.5 if i else 1.0) for i, s in enumerate(shapes)]
    return params, rng.standard_normal((T, H)).astype(dtype)


def test_plain_cupy_layer_gradients_match_finite_differences():
    # The plain layer's backward is written by hand; check it against central differences in float64
    # (random directions, top-k selection far from ties at this size and step).
    from moe_rt.demo import Config, plain_cupy_layer

    cfg = Config(tokens=12, experts=6, topk=2, hidden=5, ffn=4, steps=1, aux_coeff=0.3)
    params, gy = _layer_inputs(cfg, np.float64)

    def loss(ps):
        y, aux, _ = plain_cupy_layer(np, ps, gy, cfg)
        return float((y * gy).sum() + aux)

    _, _, grads = plain_cupy_layer(np, params, gy, cfg)
    rng = np.random.default_rng(1)
    eps = 1e-6
    for i, g in enumerate(grads):
        d = rng.standard_normal(params[i].shape)
        plus = [p + eps * d if j == i else p for j, p in enumerate(params)]
        minus = [p - eps * d if j == i else p for j, p in enumerate(params)]
        fd = (loss(plus) - loss(minus)) / (2 * eps)
        assert abs(fd - float((g * d).sum())) <= 1e-6 * max(1.0, abs(fd)), (i, fd, float((g * d).sum()))


def test_moe_rt_cupy_layer_matches_the_plain_layer_on_numpy():
    from moe_rt.demo import Config, moe_rt_cupy_layer, plain_cupy_layer

    cfg = Config(tokens=33, experts=5, topk=3, hidden=8, ffn=6, steps=1)
    params, gy = _layer_inputs(cfg, np.float32, seed=3)
    y, aux, g = moe_rt_cupy_layer(np, params, gy, cfg)
    y_ref, aux_ref, g_ref = plain_cupy_layer(np, params, gy, cfg)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux, aux_ref, rtol=1e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch", "jax"])
def test_demo_on_the_gpu(framework):
    pytest.importorskip(framework)
    r = subprocess.run([sys.executable, "-m", "moe_rt", "demo", "--framework", framework, "--steps", "3",
                        "--tokens", "1000", "--experts", "16", "--topk", "4", "--hidden", "256", "--ffn", "128"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU (moe_rt CUDA kernels)" in r.stdout and "bfloat16" in r.stdout, r.stdout
    assert "MISMATCH" not in r.stdout and r.stdout.count(" ok") == 7, r.stdout
