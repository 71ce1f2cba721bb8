"""Benchmark the router ops against the same math in torch eager and torch.compile.

Rows: topk_with_score forward and backward (softmax post-softmax; sigmoid with num_groups=8,
group_topk=4 and an expert bias), and the aux-loss path (scores_for_aux_loss + aux_loss, forward and
backward together). GB/s counts the minimal bytes each op must move: every input read once, every output
written once; for the top-k backward, whose gradient is zero off the routing map, grad and intermediate
count only at the selected entries (the 32-byte sectors that hold them). "ms" is device time per call (host
overhead hidden behind a spin kernel, for every column; the median of 5 batches); "call ms" is the plain
per-call time including moe_rt's Python overhead. Inputs are drawn on the
GPU. torch.compile baselines are compiled once per shape (dynamic=False) and only at T=65536, the target
shape (``--compile-all`` compiles at every T). ``--quick`` runs T=65536 only with fewer iterations;
``--T`` picks the token counts, ``--ops fwd`` / ``bwd`` only the forward / top-k backward rows, ``--ops qb`` only the
Quantile-Balancing rows (plain sigmoid + bias, QB fused and two-kernel; variants by the
MOE_RT_QB_* variables, docs/router.md §7), ``--dtype`` one dtype's rows, ``--E`` those expert counts' rows (32,
64, 128: short rows, a token on each segment of 4 to 16 lanes where the row allows; 256; 2304) (for
the QB rows' kernel variants selected by MOE_RT_ROUTER_FWD, MOE_RT_ROUTER_TEAM and MOE_RT_ROUTER_TPW, see
moe_rt/router.py; the other rows run the C core's kernel choices, which these do not change).
``--l2-fetch 32`` sets the L2 fetch granularity first (the opt-in ``moe_rt.l2_fetch_granularity``; the default
leaves the device's, 64 bytes on an H100).

    python tools/bench_router.py [--quick] [--T 4096,16384,65536] [--ops all|fwd|bwd|qb] [--dtype float32|bfloat16]
                                 [--E 32,64,128,256,2304] [--l2-fetch 32|64|128]
                                 [--json PATH] [--no-compile]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from moe_rt.bench import _lib as benchlib  # noqa: E402


# ---- the bytes an op must move ------------------------------------------------------------------------

def _sel_bwd_bytes(cp, rmap, isz):
    """Least traffic of the top-k backward (post-softmax, sigmoid): the gradient is zero off the routing map,
    so grad and intermediate are needed only at the K selected entries of a row. Counted as the 32-byte
    sectors holding them (the unit a GPU reads), plus the map read and grad_logits written whole."""
    def sectors(itemsize):
        per = 32 // itemsize
        m = rmap.ravel()
        pad = (-m.size) % per
        if pad:
            m = cp.concatenate([m, cp.zeros(pad, dtype=m.dtype)])
        return int(m.reshape(-1, per).any(axis=1).sum())

    return rmap.size * (1 + isz) + 32 * (sectors(isz) + sectors(4))


# ---- the same math in torch (what a user would write) ------------------------------------------------

def torch_topk_softmax_fwd(x, k):
    import torch

    v, i = torch.topk(x.float(), k, dim=-1)
    p = torch.softmax(v, dim=-1)
    probs = torch.zeros_like(x).scatter(1, i, p.to(x.dtype))
    rmap = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(1, i, True)
    inter = torch.full(x.shape, float("-inf"), device=x.device).scatter(1, i, p)
    return probs, rmap, inter


def torch_topk_softmax_bwd(g, rmap, inter):
    import torch

    gf = g.float()
    y = torch.where(rmap, inter, 0.0)
    D = (gf * y).sum(-1, keepdim=True)
    return torch.where(rmap, y * (gf - D), 0.0).to(g.dtype)


def torch_topk_sigmoid_grouped_fwd(x, k, bias, G, g):
    import torch

    T, E = x.shape
    a = torch.sigmoid(x.float())
    r = a + bias
    gs = r.view(T, G, E // G).topk(k // g, dim=-1).values.sum(-1)
    gi = torch.topk(gs, g, dim=-1).indices
    gm = torch.zeros_like(gs).scatter(1, gi, 1.0).bool()
    mask = gm.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
    masked = r.masked_fill(~mask, float("-inf"))
    i = torch.topk(masked, k, dim=-1).indices
    p = r.gather(1, i) - bias[i]
    p = p / (p.sum(-1, keepdim=True) + 1e-20)
    probs = torch.zeros_like(x).scatter(1, i, p.to(x.dtype))
    rmap = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(1, i, True)
    return probs, rmap, a


def torch_topk_sigmoid_bwd(grad, rmap, y):
    import torch

    g = grad.float()
    v = torch.where(rmap, y, 0.0)
    A = v.sum(-1, keepdim=True) + 1e-20
    B = (g * v).sum(-1, keepdim=True)
    gh = torch.where(rmap, g / A - B / (A * A), 0.0)
    return (gh * y * (1 - y)).to(grad.dtype)


def torch_aux_fwd_bwd(x, k, tpe, coeff):
    import torch

    scores = torch.softmax(x.float(), dim=-1)
    i = torch.topk(scores, k, dim=-1).indices
    rmap = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(1, i, True)
    loss = coeff * (tpe * scores.sum(0)).sum()
    gs = (coeff * tpe).unsqueeze(0).expand_as(scores)
    dx = scores * (gs - (gs * scores).sum(-1, keepdim=True))
    return loss, rmap, dx.to(x.dtype)


# ---- harness ------------------------------------------------------------------------------------------

_SPIN = None


# expert counts of the top-k rows and their K: short rows (a token on each segment of 4 to 16 lanes), E = 256, 2304
SHAPES = {32: 4, 64: 8, 128: 8, 256: 8, 2304: 36}


def _expert_counts(text):
    """``--E``: a comma list of expert counts from SHAPES."""
    try:
        es = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    bad = [e for e in es if e not in SHAPES]
    if bad:
        raise argparse.ArgumentTypeError(f"expert counts {bad} not among {sorted(SHAPES)}")
    return es


def time_device(fn, iters, warmup=3, batches=5):
    """Device time per call in ms, host overhead excluded: a spin kernel keeps the GPU busy while the host
    enqueues all ``iters`` calls, so the events measure back-to-back execution only. The median over
    ``batches`` such batches: a host stall longer than the spin lets the GPU idle inside one batch (seen once
    in a run as 1.72 ms for a 0.07 ms row), which a single batch would report."""
    import cupy as cp

    global _SPIN
    if _SPIN is None:
        _SPIN = cp.RawKernel(
            'extern "C" __global__ void spin(long long c) { long long s = clock64(); while (clock64() - s < c) {} }',
            "spin")
    from moe_rt import _jit

    for i in range(max(1, warmup)):
        fn()
        if i == 0:
            _jit.settle()  # time the kernels later calls run (no quick kernel standing in)
    st = cp.cuda.get_current_stream()
    st.synchronize()
    t0 = cp.cuda.Event(); t1 = cp.cuda.Event()
    import time
    h = time.perf_counter(); fn(); st.synchronize(); host = time.perf_counter() - h
    cycles = int(min(2e9, max(1e6, 2.0e9 * host * iters * 1.5)))
    per_call = []
    for _ in range(batches):
        _SPIN((1,), (1,), (np.int64(cycles),))
        t0.record(st)
        for _ in range(iters):
            fn()
        t1.record(st)
        t1.synchronize()
        per_call.append(cp.cuda.get_elapsed_time(t0, t1) / iters)
    return float(np.median(per_call))


def _normal(cp, shape, dt, seed):
    """Standard normal fp32 values drawn on the GPU, cast to dt."""
    return cp.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(dt)


def _compiler(enabled):
    """torch.compile(fn, dynamic=False) (one static graph per shape), or None when off or unavailable."""
    if not enabled:
        return lambda fn: None
    try:
        import torch

        return lambda fn: torch.compile(fn, dynamic=False)
    except Exception as e:  # pragma: no cover - depends on the machine
        print(f"torch.compile unavailable: {e}", file=sys.stderr)
        return lambda fn: None


def main(argv=None):
    ap = benchlib.parser(__doc__)
    ap.add_argument("--T", type=benchlib.positive_int_list, default=None,
                    help="comma-separated token counts (default 4096,16384,65536; --quick: 65536)")
    ap.add_argument("--ops", default="all", choices=["all", "fwd", "bwd", "qb"],
                    help="fwd: forward rows only; bwd: top-k backward rows only; qb: the Quantile-Balancing rows only "
                         "(the plain sigmoid + bias forward, QB fused and two-kernel; "
                         "MOE_RT_QB_REG_WARPS, MOE_RT_QB_SMEM_HIST_BYTES pick their variants)")
    ap.add_argument("--compile-all", action="store_true", help="torch.compile baselines at every T")
    ap.add_argument("--formats", action="store_true",
                    help="also the other routing outputs (bit-packed map, int32 indices: forward and backward) and "
                         "the Quantile-Balancing forward (sigmoid + bias, top-(k+1); fused histogram, and the two-kernel "
                         "mode), each beside "
                         "the byte-map row it extends")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="this dtype's rows only")
    ap.add_argument("--E", type=_expert_counts, default=None,
                    help="these expert counts' top-k rows only, a comma list of " + ", ".join(
                        f"{e} (K={k})" for e, k in SHAPES.items()) + "; no aux-loss rows (default 256,2304)")
    ap.add_argument("--l2-fetch", type=int, default=None, choices=[32, 64, 128],
                    help="set the L2 fetch granularity first (moe_rt.l2_fetch_granularity; default: leave it)")
    args = ap.parse_args(argv)
    benchlib.require_gpu(ap.prog)
    import cupy as cp
    import torch

    import moe_rt.router as R
    from moe_rt import _arrays, _jit

    iters = 20 if args.quick else args.iters
    if args.l2_fetch is not None:
        _jit.l2_fetch_granularity(args.l2_fetch)
    l2 = _jit.device_properties(cp.cuda.Device().id)["l2_bytes"]
    table = benchlib.Table("router", ["dtype", "T", "E", "K", "op", "ms", "call ms", "GB/s", "% copy", "eager ms",
                                      "x eager", "compile ms", "x compile"])
    bw = benchlib.copy_bandwidth()
    table.meta["copy_GBps"] = round(bw, 1)
    table.header()

    if args.T:
        Ts = args.T
    else:
        Ts = [65536] if args.quick else [4096, 16384, 65536]
    table.meta["l2_fetch_bytes"] = _jit.l2_fetch_granularity()
    # the QB rows' kernel variants (moe_rt/router.py plans the QB ops alone: the other rows run the C core's
    # kernel choices whatever these say)
    table.meta["qb_variant"] = {v: os.environ.get(v) or "default" for v in
                                ("MOE_RT_ROUTER_FWD", "MOE_RT_ROUTER_TEAM", "MOE_RT_ROUTER_TPW",
                                 "MOE_RT_QB_REG_WARPS", "MOE_RT_QB_SMEM_HIST_BYTES")}
    shapes = [(E, SHAPES[E]) for E in (args.E or (256, 2304))]
    dtypes = [(n, d) for n, d in [("float32", np.float32), ("bfloat16", _arrays.BFLOAT16)] if args.dtype in (None, n)]
    compile_fn = _compiler(not args.no_compile)
    compiled = {}
    state = {"T": 0}
    t_start = time.perf_counter()

    def cmp(name, fn):
        # one compiled callable per name; dynamic=False recompiles once per new shape/dtype
        if not args.compile_all and state["T"] != max(Ts):
            return None
        if name not in compiled:
            compiled[name] = compile_fn(fn)
        return compiled[name]

    def row(dtname, T, E, K, op, nbytes, ours, eager, comp):
        t0 = time.perf_counter()
        call_ms = benchlib.time_cuda(ours, iters=iters, warmup=args.warmup)
        ms = time_device(ours, iters)
        gbs = nbytes / (ms * 1e-3) / 1e9
        e_ms = time_device(eager, iters) if eager else None
        c_ms = None
        if comp is not None:
            try:
                c_ms = time_device(comp, iters)
            except Exception as ex:  # pragma: no cover
                print(f"torch.compile failed for {op}: {ex}", file=sys.stderr)
        table.add(dtype=dtname, T=T, E=E, K=K, op=op, ms=ms, **{"call ms": call_ms}, **{"GB/s": gbs, "% copy": 100 * gbs / bw},
                  **{"eager ms": e_ms, "x eager": (e_ms / ms) if e_ms else None, "compile ms": c_ms,
                     "x compile": (c_ms / ms) if c_ms else None})
        if benchlib.PROGRESS is None:
            print(f"  [{op}: {time.perf_counter() - t0:.1f} s, total {time.perf_counter() - t_start:.0f} s]",
                  file=sys.stderr, flush=True)

    fwd_only, bwd_only = args.ops == "fwd", args.ops == "bwd"
    benchlib.progress_start("router", len(dtypes) * len(Ts))
    for dtname, dt in dtypes:
        isz = np.dtype(dt).itemsize
        for T in Ts:
            state["T"] = T
            for E, K in shapes:
                n = T * E
                ncopy = benchlib.num_copies(n * isz, l2)
                rng = np.random.default_rng(0)
                xs = [_normal(cp, (T, E), dt, 10 + i) for i in range(ncopy)]
                xt = [torch.from_dlpack(x) for x in xs]
                nx = benchlib.rotating(list(range(ncopy)))
                bias = cp.asarray((rng.permutation(E) * (0.1 / E)).astype(np.float32))
                bias_t = torch.from_dlpack(bias)
                fwd_b = n * (isz + isz + 1 + 4)
                if args.ops == "qb":
                    _qb_rows(R, cp, row, xs, nx, bias, dtname, T, E, K, fwd_b)
                    continue
                # softmax (post) fwd: read x, write probs, map, intermediate
                outs = [R.topk_with_score(x, K) for x in xs]
                if not bwd_only:
                    cs = cmp(f"sm_fwd{K}", lambda x, K=K: torch_topk_softmax_fwd(x, K))
                    row(dtname, T, E, K, "softmax fwd", fwd_b, lambda: R.topk_with_score(xs[nx()], K),
                        lambda: torch_topk_softmax_fwd(xt[nx()], K), (lambda: cs(xt[nx()])) if cs else None)
                gs = [_normal(cp, (T, E), dt, 20 + i) for i in range(ncopy)]
                gt = [torch.from_dlpack(g) for g in gs]
                ot = [tuple(torch.from_dlpack(a) for a in o) for o in outs]
                bwd_b = _sel_bwd_bytes(cp, outs[0][1], isz)

                def sm_bwd():
                    i = nx()
                    return R.topk_with_score_backward(gs[i], outs[i][1], outs[i][2], K, score_function="softmax")

                def sm_bwd_t(fn=torch_topk_softmax_bwd):
                    i = nx()
                    return fn(gt[i], ot[i][1], ot[i][2])

                if not fwd_only:
                    cb = cmp("sm_bwd", torch_topk_softmax_bwd)
                    row(dtname, T, E, K, "softmax bwd", bwd_b, sm_bwd, sm_bwd_t,
                        (lambda: sm_bwd_t(cb)) if cb else None)
                if args.formats:
                    _format_rows(R, cp, row, args, xs, gs, outs, nx, bias, dtname, isz, T, E, K, fwd_b, bwd_b)
                del outs, ot
                # sigmoid, groups 8/4, bias
                kw = dict(score_function="sigmoid", num_groups=8, group_topk=4, expert_bias=bias)
                outs = [R.topk_with_score(x, K, **kw) for x in xs]
                if not bwd_only:
                    cg = cmp(f"sig_fwd{K}", lambda x, K=K: torch_topk_sigmoid_grouped_fwd(x, K, bias_t, 8, 4))
                    row(dtname, T, E, K, "sigmoid g8/4 bias fwd", fwd_b + 4 * E,
                        lambda: R.topk_with_score(xs[nx()], K, **kw),
                        lambda: torch_topk_sigmoid_grouped_fwd(xt[nx()], K, bias_t, 8, 4),
                        (lambda: cg(xt[nx()])) if cg else None)
                ot = [tuple(torch.from_dlpack(a) for a in o) for o in outs]
                sg_bwd_b = _sel_bwd_bytes(cp, outs[0][1], isz)

                def sg_bwd():
                    i = nx()
                    return R.topk_with_score_backward(gs[i], outs[i][1], outs[i][2], K, score_function="sigmoid")

                def sg_bwd_t(fn=torch_topk_sigmoid_bwd):
                    i = nx()
                    return fn(gt[i], ot[i][1], ot[i][2])

                if not fwd_only:
                    cb2 = cmp("sig_bwd", torch_topk_sigmoid_bwd)
                    row(dtname, T, E, K, "sigmoid bwd", sg_bwd_b, sg_bwd, sg_bwd_t,
                        (lambda: sg_bwd_t(cb2)) if cb2 else None)
                del outs, ot, gs, gt, xs, xt
                cp.get_default_memory_pool().free_all_blocks()
                torch.cuda.empty_cache()
            for E, K in ([] if fwd_only or bwd_only or args.E or args.ops == "qb" else [(256, 8), (16384, 8)]):
                _aux_rows(R, cp, torch, table, row, cmp, dtname, dt, isz, T, E, K, l2)
                cp.get_default_memory_pool().free_all_blocks()
                torch.cuda.empty_cache()
            benchlib.progress_advance(f"{dtname} T={T}")
    table.finish(args.json)


def _format_rows(R, cp, row, args, xs, gs, outs, nx, bias, dtname, isz, T, E, K, fwd_b, bwd_b):
    """The routing outputs beside the byte map (softmax): the bit-packed map and int32 indices, forward and
    backward; and the Quantile-Balancing forward. Bytes: the byte-map row's with the map's T*E bytes replaced
    by the output's (T*ceil(E/8) bytes, or T*K*4); the index backward reads the indices and the K selected
    entries of grad and intermediate (32-byte sectors, as the byte-map backward's count) and writes grad."""
    n, nb = T * E, T * ((E + 7) // 8)
    if args.ops != "bwd":
        row(dtname, T, E, K, "softmax fwd bitmap", fwd_b - n + nb,
            lambda: R.topk_with_score(xs[nx()], K, routing_map_format="bitmap_u8"), None, None)
        row(dtname, T, E, K, "softmax fwd idx32", fwd_b - n + T * K * 4,
            lambda: R.topk_with_score(xs[nx()], K, topk_indices_dtype=np.int32), None, None)
    if args.ops != "fwd":
        bm = [R.topk_with_score(x, K, routing_map_format="bitmap_u8") for x in xs]
        ix = [R.topk_with_score(x, K, topk_indices_dtype=np.int32) for x in xs]

        def bwd_bitmap():
            i = nx()
            return R.topk_with_score_backward(gs[i], bm[i][1], bm[i][2], K, score_function="softmax",
                                              routing_map_format="bitmap_u8")

        def bwd_idx():
            i = nx()
            return R.topk_with_score_backward(gs[i], None, ix[i][2], K, score_function="softmax",
                                              topk_indices=ix[i][1])

        row(dtname, T, E, K, "softmax bwd bitmap", bwd_b - n + nb, bwd_bitmap, None, None)
        row(dtname, T, E, K, "softmax bwd idx32", bwd_b - n + T * K * 4, bwd_idx, None, None)
        del bm, ix
    if args.ops != "bwd":
        _qb_rows(R, cp, row, xs, nx, bias, dtname, T, E, K, fwd_b)


def _qb_rows(R, cp, row, xs, nx, bias, dtname, T, E, K, fwd_b):
    """The plain sigmoid + bias forward and the Quantile-Balancing forward beside it (B = 64, fused and
    two-kernel); QB's bytes: the plain forward's plus the 4 T cutoff (docs/router.md §7)."""
    hist = cp.zeros((E, 64), np.int32)
    bounds = cp.asarray(np.array([-1.0, 1.0], np.float32))
    row(dtname, T, E, K, "sigmoid bias fwd", fwd_b + 4 * E,
        lambda: R.topk_with_score(xs[nx()], K, score_function="sigmoid", expert_bias=bias), None, None)
    row(dtname, T, E, K, "sigmoid qb fwd (fused hist)", fwd_b + 4 * E + 4 * T,
        lambda: R.topk_with_score_qb(xs[nx()], K, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds,
                                     qb_histogram_mode="fused_atomic", bounds_validated=True), None, None)
    row(dtname, T, E, K, "sigmoid qb fwd (two kernel)", fwd_b + 4 * E + 4 * T,
        lambda: R.topk_with_score_qb(xs[nx()], K, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds,
                                     qb_histogram_mode="two_kernel", bounds_validated=True), None, None)


def _aux_rows(R, cp, torch, table, row, cmp, dtname, dt, isz, T, E, K, l2):
    n = T * E
    ncopy = min(benchlib.num_copies(n * isz, l2), 3)
    rng = np.random.default_rng(1)
    xs = [_normal(cp, (T, E), dt, 30 + i) for i in range(ncopy)]
    xt = [torch.from_dlpack(x) for x in xs]
    nx = benchlib.rotating(list(range(ncopy)))
    tpe = cp.asarray(rng.integers(1, 1000, E).astype(np.int32))
    tpe_t = torch.from_dlpack(tpe).float().clone()
    one = cp.ones((), dtype=np.float32)
    coeff = 0.01
    c = float(np.float32(E * coeff) / K / T / T)

    def ours():
        x = xs[nx()]
        s, m, i = R.scores_for_aux_loss(x, K, "softmax")
        loss = R.aux_loss(s, tpe, T, E, K, coeff)
        gs = R.aux_loss_backward(one, T, tpe, T, E, K, coeff)
        return loss, m, R.scores_for_aux_loss_backward(gs, i, K, "softmax", dtype=x.dtype)

    # x, scores w+r, map w, inter w+r, grad_scores w+r, dx w
    nbytes = n * (isz + 8 + 1 + 8 + 8 + isz)
    ca = cmp(f"aux{K}-{E}", lambda x, K=K, t=tpe_t, c=c: torch_aux_fwd_bwd(x, K, t, c))
    row(dtname, T, E, K, "aux scores+loss fwd+bwd", nbytes, ours,
        lambda: torch_aux_fwd_bwd(xt[nx()], K, tpe_t, c), (lambda: ca(xt[nx()])) if ca else None)


if __name__ == "__main__":
    main()
