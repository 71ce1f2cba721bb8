"""moe_rt installed without a CUDA extra: no CuPy, no NCCL library. In a child Python where ``import cupy``
fails (a meta-path finder from a ``sitecustomize`` on PYTHONPATH refuses cupy, cupy_backends and cupyx) and
NCCL cannot be loaded, the package imports and runs its NumPy path, ``python -m moe_rt info`` reports the
absence, and the test files that need CuPy or NCCL skip (never fail)."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCKER = textwrap.dedent('''
    import sys


    class _NoCupy:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("cupy", "cupy_backends", "cupyx"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, _NoCupy())
''')

OPS = textwrap.dedent('''
    import sys

    import numpy as np

    import moe_rt

    rng = np.random.default_rng(7)
    T, E, K, H = 37, 8, 3, 12
    base = np.arange(E, dtype=np.float32) * (4.0 / E) - 2.0  # distinct values per row: no ties
    logits = np.stack([rng.permutation(base) for _ in range(T)])
    probs, rmap, _ = moe_rt.topk_with_score(logits, K, score_function="softmax")
    top = np.argsort(-logits, axis=1)[:, :K]
    v = np.take_along_axis(logits, top, 1).astype(np.float64)
    w = np.exp(v - v.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    want = np.zeros((T, E))
    np.put_along_axis(want, top, w, 1)
    np.testing.assert_allclose(probs, want, rtol=1e-6, atol=1e-7)
    assert (rmap == (want > 0)).all()

    plan = moe_rt.make_plan(rmap, E)
    x = rng.standard_normal((T, H)).astype(np.float32)
    xp, _ = moe_rt.dispatch(x, plan)
    seg = np.asarray(plan.seg_start)
    for e in range(E):  # expert-major rows, tokens in order within an expert
        np.testing.assert_array_equal(xp[seg[e]:seg[e + 1]], x[np.nonzero(rmap[:, e])[0]])
    scale = np.zeros((xp.shape[0], 1), np.float32)
    for e in range(E):
        scale[seg[e]:seg[e + 1]] = e + 1
    y = moe_rt.combine(xp * scale, plan, probs)
    want_y = x * (want * np.arange(1, E + 1)).sum(1, keepdims=True)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    assert "cupy" not in sys.modules
    print("ops ok")
''')


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("no_cupy")
    (d / "sitecustomize.py").write_text(BLOCKER)
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(d), ROOT] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e["MOE_RT_NCCL_PATH"] = str(d / "libnccl.so.2")  # no such file: NCCL absent as well
    return e


def _run(args, env, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def test_cupy_is_blocked(env):
    r = _run(["-c", "import cupy"], env)
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, r.stderr


def test_import_and_reference_ops_without_cupy(env):
    r = _run(["-c", OPS], env)
    assert r.returncode == 0 and "ops ok" in r.stdout, r.stdout + r.stderr


def test_info_without_cupy(env):
    r = _run(["-m", "moe_rt", "info"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^cupy\s+not installed", r.stdout, re.M), r.stdout
    assert re.search(r"^nccl\s+not found", r.stdout, re.M), r.stdout
    assert "gpus        none" in r.stdout, r.stdout


def test_suite_skips_without_cupy(env):
    files = ["tests/test_core_facade.py", "tests/test_nccl.py", "tests/test_cli.py", "tests/test_permutation.py"]
    r = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *files], env, timeout=600)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary and "passed" in summary, summary
    # what needs CuPy or NCCL says why it skipped
    assert "the CUDA paths under test need CuPy" in r.stdout and "needs the NCCL library" in r.stdout, tail
