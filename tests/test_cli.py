"""``python -m moe_rt``."""
import subprocess
import sys


def test_info_runs_everywhere():
    r = subprocess.run([sys.executable, "-m", "moe_rt", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for key in ("moe_rt", "numpy", "cupy", "nccl", "kernel cache", "torch", "jax"):
        assert key in r.stdout, (key, r.stdout)
    assert "gpu" in r.stdout


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
