"""Sweep of the selected-entry router backward's builds on the bit-packed map against the byte map
(T=65536, E=2304, K=36 softmax by default): each kernel launched directly with its own grid, CUDA-event
median, the output checked bit for bit against the byte map kernel's. Run under different
MOE_RT_NVRTC_OPTIONS for the macros (MOE_RT_SELR_*)."""
import argparse

import cupy as cp
import numpy as np

import moe_rt.router as R
from moe_rt import _jit

ap = argparse.ArgumentParser()
ap.add_argument("--T", type=int, default=0, help="0: about 151M elements")
ap.add_argument("--E", default="2304")
ap.add_argument("--K", type=int, default=0, help="0: 36 at E=2304, else 8")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--iters", type=int, default=30)
ap.add_argument("--variants", default="byte128,bit128,bit32,byte32,bit256,bit512,selbit128,selbyte128")
a = ap.parse_args()
dt = np.dtype(a.dtype) if a.dtype != "bfloat16" else None
ct = _jit.CTYPES[a.dtype]
if a.dtype == "bfloat16":
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16)
rng = np.random.default_rng(0)


def config(E):
    T = a.T or max(4096, (151 << 20) // E)
    K = a.K or (36 if E == 2304 else 8)
    print(f"E={E} T={T} K={K} {a.dtype}", flush=True)

    x = cp.asarray(rng.standard_normal((T, E), dtype=np.float32)).astype(dt)
    g = cp.asarray(rng.standard_normal((T, E), dtype=np.float32)).astype(dt)
    _, bmap, inter = R.topk_with_score(x, K, routing_map_format="bitmap_u8")
    _, ymap, inter2 = R.topk_with_score(x, K)
    assert bool(cp.all(inter == inter2))
    cp.cuda.Device().synchronize()


    def variant(v):
        sel = "router_bwd_sel" if v.startswith("sel") else "router_bwd_sel_reg"
        rest = v[3:] if v.startswith("sel") else v
        bit = rest.startswith("bit")
        team = int(rest[3:] if bit else rest[4:])
        name = f"{sel}<{ct}, {team}{', true' if bit else ''}>"
        return name, bit, team


    def run(v):
        name, bit, team = variant(v)
        _jit.register("router.cu", [name])
        fn = _jit.function("router.cu", name)
        spb = 4 if team == 32 else 1
        grid = (T + spb - 1) // spb
        out = cp.full((T, E), np.nan, dtype=np.float32).astype(dt)
        args = (g, bmap if bit else ymap, inter, np.int64(T), np.int32(E), np.int32(K), np.int32(1),
                np.float32(1.0), out)
        launch = lambda: _jit.launch(fn, grid, team * spb, args)
        for _ in range(3):
            launch()
        ts = []
        for _ in range(a.iters):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            for _ in range(4):
                launch()
            e1.record()
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 4)
        regs = fn.num_regs
        return float(np.median(ts)), out, regs, name


    ref = None
    for v in a.variants.split(","):
        try:
            ms, out, regs, name = run(v)
        except Exception as e:  # a build that does not compile or launch is reported, the sweep goes on
            print(f"{v:12s} FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        if ref is None:
            ref = out
        same = bool(cp.all(out.view(cp.uint16 if out.dtype.itemsize == 2 else cp.uint32)
                           == ref.view(cp.uint16 if ref.dtype.itemsize == 2 else cp.uint32)))
        print(f"{v:12s} {name:48s} regs {regs:4d}  {ms * 1e3:8.1f} us  bitwise_equal_to_first={same}")


for E in a.E.split(','):
    config(int(E))
