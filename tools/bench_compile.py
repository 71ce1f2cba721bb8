"""First use on an empty kernel cache: how long the first call of each op family takes (compile included),
how long ``python -m moe_rt demo`` takes from nothing, and how long ``warmup`` of every kernel takes.

Each case runs in a fresh Python process with its own empty ``MOE_RT_KERNEL_CACHE``; a call's time is
measured around the call and a device synchronize, after the imports. The second call of the same op is
timed too (its kernels are loaded then). Targets (BENCHMARKS.md): first top-k <= 5 s, first dispatch <= 3 s,
demo <= 40 s, ``demo --framework torch --ep 4 --tokens 2048`` <= 60 s, warmup of everything <= 60 s.

    python tools/bench_compile.py [--json PATH] [--no-demo] [--ep N] [--jobs N]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

FIRST_CALL = r"""
import json, sys, time
import cupy as cp, numpy as np
import moe_rt
case = sys.argv[1]
rng = np.random.default_rng(0)

def timed(fn):
    t0 = time.perf_counter(); fn(); cp.cuda.Device().synchronize(); return time.perf_counter() - t0

if case.startswith("topk"):
    _, score, dtype, E, K, G = case.split(":")
    E, K, G = int(E), int(K), int(G)
    logits = cp.asarray(rng.standard_normal((4096, E), dtype=np.float32)).astype(dtype)
    kw = dict(score_function=score)
    if G:
        kw.update(num_groups=G, group_topk=G // 2, expert_bias=cp.asarray(rng.standard_normal(E, dtype=np.float32)))
    fn = lambda: moe_rt.topk_with_score(logits, K, **kw)
else:
    _, dtype = case.split(":")
    T, E, K, H = 4096, 64, 8, 4096
    idx = cp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32))
    x = cp.asarray(rng.standard_normal((T, H), dtype=np.float32)).astype(dtype)
    w = cp.asarray(rng.random((T, K), dtype=np.float32))
    fn = lambda: moe_rt.dispatch(x, moe_rt.make_plan(idx, E, align_size=16), w)
cp.cuda.Device().synchronize()
t0 = time.perf_counter()
first = timed(fn)
second = timed(fn)
from moe_rt import _jit
_jit.settle()  # the kernels a stand-in ran for (compiled in the background on the first call)
settled = time.perf_counter() - t0
third = timed(fn)  # swaps them in
fourth = timed(fn)
print(json.dumps({"first_s": first, "second_s": second, "settled_s": settled, "fourth_s": fourth,
                  "quick": _jit.stand_ins_loaded}))
"""

CASES = [  # (case, label, target seconds)
    ("topk:softmax:float32:256:8:0", "first topk_with_score (softmax, fp32, E=256 K=8)", 5.0),
    ("topk:sigmoid:bfloat16:256:8:8", "first topk_with_score (sigmoid, bf16, E=256 K=8, groups, bias)", 5.0),
    ("topk:sqrtsoftplus:float32:2304:36:0", "first topk_with_score (sqrtsoftplus, fp32, E=2304 K=36)", 5.0),
    ("topk:softmax:bfloat16:2304:8:0", "first topk_with_score (softmax, bf16, E=2304 K=8)", 5.0),
    ("topk:sigmoid:float32:512:8:0", "first topk_with_score (sigmoid, fp32, E=512 K=8)", 5.0),
    ("topk:sigmoid:float32:256:8:8", "first topk_with_score (sigmoid, fp32, E=256 K=8, groups, bias)", 5.0),
    ("topk:sigmoid:float32:1024:8:8", "first topk_with_score (sigmoid, fp32, E=1024 K=8, groups, bias)", 5.0),
    ("dispatch:bfloat16", "first make_plan + dispatch (bf16, H=4096)", 3.0),
]


def compiled_in(cache):
    """``name seconds`` of each kernel compiled into ``cache`` (its entries' records), slowest first."""
    rows = []
    for root, _, files in os.walk(cache):
        for f in files:
            if f.endswith(".json") and f != "manifest.json":
                with open(os.path.join(root, f)) as fh:
                    d = json.load(fh)
                rows.append((d["seconds"], d["name"]))
    return sorted(rows, reverse=True)


def run(cmd, cache, timeout=900):
    env = dict(os.environ, MOE_RT_KERNEL_CACHE=cache, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    return r, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--no-demo", action="store_true", help="skip the demo rows")
    p.add_argument("--ep", type=int, default=0, help="also time `demo --framework torch --ep N --tokens 2048`")
    p.add_argument("--no-warmup", action="store_true", help="skip the warmup row")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="warmup worker processes")
    a = p.parse_args(argv)
    try:
        import cupy

        ngpu = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        ngpu = 0
    if not ngpu:
        print("bench_compile: no CUDA GPU found", file=sys.stderr)
        return 2
    rows = []

    def row(what, seconds, target, extra=""):
        rows.append({"what": what, "s": round(seconds, 2), "target_s": target,
                     "ok": bool(target is None or seconds <= target), "note": extra})
        print(f"{what:<66} {seconds:8.2f} s  target {'-' if target is None else f'<= {target:g} s'}  {extra}",
              flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for i, (case, label, target) in enumerate(CASES):
            r, _ = run([sys.executable, "-c", FIRST_CALL, case], os.path.join(tmp, f"c{i}"))
            if r.returncode:
                print(r.stdout + r.stderr, file=sys.stderr)
                return 1
            d = json.loads(r.stdout.strip().splitlines()[-1])
            kernels = compiled_in(os.path.join(tmp, f"c{i}"))
            quick = (f"a quick kernel stood in until the final one was ready, {d['settled_s']:.2f} s after the "
                     f"first call began; " if d["quick"] else "")
            row(label, d["first_s"], target, f"second call {1e3 * d['second_s']:.2f} ms; {quick}later call "
                f"{1e3 * d['fourth_s']:.2f} ms; compiled " + ", ".join(f"{n} {t:.2f} s" for t, n in kernels))
        if not a.no_demo:
            r, wall = run([sys.executable, "-m", "moe_rt", "demo"], os.path.join(tmp, "demo"))
            row("python -m moe_rt demo, empty cache (process wall time)", wall, 40.0, f"rc={r.returncode}")
            if r.returncode:
                print(r.stdout[-3000:] + r.stderr[-3000:], file=sys.stderr)
            if a.ep:
                if ngpu < a.ep:
                    print(f"bench_compile: --ep {a.ep} needs {a.ep} GPUs, {ngpu} found", file=sys.stderr)
                else:
                    r, wall = run([sys.executable, "-m", "moe_rt", "demo", "--framework", "torch", "--ep",
                                   str(a.ep), "--tokens", "2048"], os.path.join(tmp, "demo_ep"))
                    row(f"python -m moe_rt demo --framework torch --ep {a.ep} --tokens 2048, empty cache", wall,
                        60.0, f"rc={r.returncode}")
                    if r.returncode:
                        print(r.stdout[-3000:] + r.stderr[-3000:], file=sys.stderr)
        if not a.no_warmup:
            r, wall = run([sys.executable, "-m", "moe_rt", "warmup", "--quiet", "--jobs", str(a.jobs)],
                          os.path.join(tmp, "warm"))
            row(f"python -m moe_rt warmup (every kernel, {a.jobs} jobs)", wall, 60.0,
                (r.stdout.strip().splitlines() or [""])[-1][:80] if not r.returncode else f"rc={r.returncode}")
            if r.returncode:
                print(r.stdout + r.stderr, file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": rows}, f,
                      indent=1)
    ok = all(r["ok"] for r in rows)
    print("bench_compile: all targets met" if ok else "bench_compile: targets missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
