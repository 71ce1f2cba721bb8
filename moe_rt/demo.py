"""``python -m moe_rt demo``: a whole MoE layer, forward and backward, on moe_rt's ops.

The layer: router logits ``x @ w_router`` -> :func:`topk_with_score` (softmax after top-k) -> dispatch
into expert-major rows -> a SwiGLU MLP per expert (the framework's matmuls) -> weighted combine, plus the
Switch aux loss on :func:`scores_for_aux_loss`. Every step but the expert matmuls is a moe_rt op. The same
layer written in plain framework code (no moe_rt) runs beside it on the same weights, and the demo checks
the output and the gradients of the input, the router weights and the expert weights against it, then
times the moe_rt layer per stage over several steps.

Frameworks: torch (autograd through :mod:`moe_rt.torch`), JAX (``jax.jit`` + ``jax.grad`` through
:mod:`moe_rt.jax`) and CuPy (no autograd: the forward and the backward written out with moe_rt's ops and
their backward ops). ``--ep N`` runs the layer with expert parallelism over N GPUs (:mod:`moe_rt.demo_ep`),
``--ep-mode low_latency`` through a :class:`moe_rt.LowLatencyGroup` (torch and JAX, at most 1024 tokens per
rank), ``--fp8`` with the dispatch sending FP8 rows (dequantized on arrival; the plain layer the ranks check
against gets the same rounding of the experts' input), in either mode.

With a GPU the demo runs on it in bf16; without one it runs moe_rt's NumPy reference path (CPU tensors, or
NumPy arrays for CuPy) at a small default size and says so.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from moe_rt import _jit


@dataclass
class Config:
    tokens: int
    experts: int
    topk: int
    hidden: int
    ffn: int
    steps: int
    seed: int = 0
    aux_coeff: float = 1e-2


def _progress(i: int, n: int, label: str, extra: str = "") -> None:
    width = 30
    done = int(width * (i + 1) / n)
    sys.stderr.write(f"\r{label} [{'#' * done}{'.' * (width - done)}] {i + 1}/{n} {extra}")
    if i + 1 == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _rel(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- PyTorch ---------------------------------------------------------------------------------------------

def run_torch(cfg: Config, device: str) -> dict:
    import torch

    import moe_rt.torch as mt

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(cfg.seed)
    T, E, K, H, F = cfg.tokens, cfg.experts, cfg.topk, cfg.hidden, cfg.ffn

    def param(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype).requires_grad_()

    x = param(T, H, scale=1.0)
    w_router = param(H, E, scale=H ** -0.5)
    w1, w3 = param(E, H, F, scale=H ** -0.5), param(E, H, F, scale=H ** -0.5)
    w2 = param(E, F, H, scale=F ** -0.5)
    params = [x, w_router, w1, w3, w2]
    gy = torch.randn(T, H, generator=gen).to(device, dtype)

    def swiglu(h, e):
        return (torch.nn.functional.silu(h @ w1[e]) * (h @ w3[e])) @ w2[e]

    timer = _Timer("torch" if device == "cuda" else None)

    def moe_rt_layer():
        with timer("router"):
            logits = x.float() @ w_router.float()  # fp32 router: bf16 logits would tie between experts
            probs, rmap = mt.topk_with_score(logits, K, score_function="softmax")
            scores, smap = mt.scores_for_aux_loss(logits.float(), K, "softmax")
            aux = mt.aux_loss(scores, smap.sum(0, dtype=torch.int32), T, E, K, cfg.aux_coeff)
        with timer("dispatch"):
            plan = mt.make_plan(rmap, E, num_out_tokens=T * K)
            xp, _ = mt.dispatch(x, plan)
        with timer("experts"):
            bounds = plan.seg_start.tolist()  # host copy of E+1 ints for the per-expert loop
            yp = torch.cat([swiglu(xp[bounds[e]:bounds[e + 1]], e) for e in range(E)]
                           + [xp[bounds[E]:] * 0])
        with timer("combine"):
            y = mt.combine(yp, plan, probs)
        return y, aux

    def plain_layer():
        logits = x.float() @ w_router.float()
        v, idx = logits.topk(K, dim=-1)
        weights = torch.softmax(v, -1)
        y = torch.zeros(T, H, device=device, dtype=torch.float32)
        for e in range(E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                y.index_add_(0, tok, weights[tok, slot, None] * swiglu(x[tok], e).float())
        s = torch.softmax(logits.float(), -1)
        _, si = s.topk(K, dim=-1)
        tpe = torch.zeros_like(s).scatter(1, si, 1.0).sum(0)
        aux = (E * cfg.aux_coeff) / K / T / T * (s.sum(0) * tpe).sum()
        return y.to(dtype), aux

    def grads(layer):
        y, aux = layer()
        with timer("backward"):
            g = torch.autograd.grad([y, aux], params, [gy, torch.ones_like(aux)])
        return y, aux, g

    y, aux, g = grads(moe_rt_layer)
    y_ref, aux_ref, g_ref = grads(plain_layer)
    host = lambda t: t.detach().float().cpu().numpy()  # noqa: E731
    checks = {"output": _rel(host(y), host(y_ref)), "aux_loss": _rel(host(aux), host(aux_ref))}
    for name, a, b in zip(["grad x", "grad w_router", "grad w1", "grad w3", "grad w2"], g, g_ref):
        checks[name] = _rel(host(a), host(b))

    _jit.settle()  # times of the kernels later calls run (no quick kernel standing in)
    timer.reset()
    for i in range(cfg.steps):
        grads(moe_rt_layer)
        timer.step()
        _progress(i, cfg.steps, "torch moe_rt layer")
    return {"checks": checks, "times": timer.medians(), "dtype": str(dtype).replace("torch.", "")}


class _Timer:
    """Per-stage wall times, medians over steps: CUDA events of ``events`` ("torch" or "cupy") on the current
    stream, or perf_counter when ``events`` is None (no GPU)."""

    def __init__(self, events):
        self.events = events
        self.samples: dict[str, list[float]] = {}
        self.pending: list = []

    def _event(self):
        if self.events == "torch":
            import torch

            ev = torch.cuda.Event(enable_timing=True)
        else:
            import cupy

            ev = cupy.cuda.Event()
        ev.record()
        return ev

    def __call__(self, name):
        timer = self

        class _Ctx:
            def __enter__(self_inner):
                if timer.events:
                    self_inner.start = timer._event()
                else:
                    self_inner.t0 = time.perf_counter()

            def __exit__(self_inner, *exc):
                if timer.events:
                    timer.pending.append((name, self_inner.start, timer._event()))
                else:
                    timer.samples.setdefault(name, []).append((time.perf_counter() - self_inner.t0) * 1e3)
                return False

        return _Ctx()

    def step(self):
        if not self.pending:
            return
        if self.events == "torch":
            import torch

            torch.cuda.synchronize()
            elapsed = [a.elapsed_time(b) for _, a, b in self.pending]
        else:
            import cupy

            self.pending[-1][2].synchronize()
            elapsed = [cupy.cuda.get_elapsed_time(a, b) for _, a, b in self.pending]
        for (name, _, _), ms in zip(self.pending, elapsed):
            self.samples.setdefault(name, []).append(ms)
        self.pending.clear()

    def reset(self):
        self.step()
        self.samples.clear()

    def medians(self) -> dict:
        return {k: float(np.median(v)) for k, v in self.samples.items()}


# ---- JAX -----------------------------------------------------------------------------------------------

def jax_plain_moe(x, wr, K, E, experts):
    """The MoE forward in plain JAX (no moe_rt), as MaxText writes it: fp32 router logits, top-k with a
    softmax over the chosen, stable argsort of the expert ids, ``experts(rows, group_sizes)`` on the sorted
    rows, gather back, fp32 weighted sum. Returns ``(y in x.dtype, logits)``."""
    import jax
    import jax.numpy as jnp

    T, H = x.shape
    logits = x.astype(jnp.float32) @ wr.astype(jnp.float32)
    v, idx = jax.lax.top_k(logits, K)
    w = jax.nn.softmax(v, -1)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    gs = jnp.bincount(flat, length=E).astype(jnp.int32)
    yp = experts(jnp.repeat(x, K, axis=0)[order], gs)
    y = (yp[jnp.argsort(order)].reshape(T, K, H).astype(jnp.float32) * w[..., None]).sum(1)
    return y.astype(x.dtype), logits


def jax_stage_times(stages: dict, steps: int, label, show: bool = True) -> dict:
    """Median wall ms of each jitted stage (``{name: fn}``, one of them ``"step"``, the whole jitted step), each
    run to ``block_until_ready``, over ``steps`` rounds after one warm-up; ``backward`` = step minus the sum of
    the other stages."""
    import jax

    samples: dict[str, list[float]] = {k: [] for k in stages}
    for f in stages.values():
        jax.block_until_ready(f())
    _jit.settle()
    for i in range(steps):
        for k, f in stages.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            samples[k].append((time.perf_counter() - t0) * 1e3)
        if show:
            _progress(i, steps, label)
    t = {k: float(np.median(v)) for k, v in samples.items()}
    t["backward"] = max(t["step"] - sum(v for k, v in t.items() if k != "step"), 0.0)
    return t


def jax_plain_aux(logits, K, E, coeff):
    """The Switch aux loss of ``logits [T,E]`` in plain JAX (softmax scores, top-k counts)."""
    import jax
    import jax.numpy as jnp

    T = logits.shape[0]
    s = jax.nn.softmax(logits, -1)
    _, si = jax.lax.top_k(s, K)
    tpe = jax.lax.stop_gradient(jnp.zeros_like(s).at[jnp.arange(T)[:, None], si].set(1.0).sum(0))
    return (E * coeff) / K / T / T * (s.sum(0) * tpe).sum()


def run_jax(cfg: Config, device: str) -> dict:
    import jax
    import jax.numpy as jnp

    import moe_rt.jax as mj

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    dtype = jnp.bfloat16 if device == "cuda" else jnp.float32
    T, E, K, H, F = cfg.tokens, cfg.experts, cfg.topk, cfg.hidden, cfg.ffn
    keys = jax.random.split(jax.random.PRNGKey(cfg.seed), 7)

    def param(k, shape, scale):
        return jax.device_put((jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype), dev)

    params = (param(keys[0], (T, H), 1.0), param(keys[1], (H, E), H ** -0.5), param(keys[2], (E, H, F), H ** -0.5),
              param(keys[3], (E, H, F), H ** -0.5), param(keys[4], (E, F, H), F ** -0.5))
    gy = param(keys[5], (T, H), 1.0)

    def experts(rows, gs, w1, w3, w2):
        h = jax.nn.silu(jax.lax.ragged_dot(rows, w1, gs)) * jax.lax.ragged_dot(rows, w3, gs)
        return jax.lax.ragged_dot(h.astype(dtype), w2, gs).astype(dtype)

    def router(x, wr):
        logits = x.astype(jnp.float32) @ wr.astype(jnp.float32)  # fp32 router, as in the torch layer
        probs, rmap = mj.topk_with_score(logits, K, score_function="softmax")
        scores, smap = mj.scores_for_aux_loss(logits.astype(jnp.float32), K, "softmax")
        aux = mj.aux_loss(scores, smap.sum(0).astype(jnp.int32), T, E, K, cfg.aux_coeff)
        return probs, rmap, aux

    def dispatch(x, rmap):
        plan = mj.make_plan(rmap, E, num_out_tokens=T * K)
        return mj.dispatch(x, plan)[0], plan

    def moe_rt_layer(p):
        x, wr, w1, w3, w2 = p
        probs, rmap, aux = router(x, wr)
        xp, plan = dispatch(x, rmap)
        yp = experts(xp, plan.counts, w1, w3, w2)
        return mj.combine(yp, plan, probs), aux

    def plain_layer(p):
        x, wr, w1, w3, w2 = p
        y, logits = jax_plain_moe(x, wr, K, E, lambda rows, gs: experts(rows, gs, w1, w3, w2))
        return y, jax_plain_aux(logits, K, E, cfg.aux_coeff)

    def loss_of(layer):
        def f(p):
            y, aux = layer(p)
            return (y.astype(jnp.float32) * gy.astype(jnp.float32)).sum() + aux, (y, aux)
        return jax.jit(jax.value_and_grad(f, has_aux=True))

    step, plain_step = loss_of(moe_rt_layer), loss_of(plain_layer)
    (_, (y, aux)), g = step(params)
    (_, (y_ref, aux_ref)), g_ref = plain_step(params)
    host = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    checks = {"output": _rel(host(y), host(y_ref)), "aux_loss": _rel(host(aux), host(aux_ref))}
    for name, a, b in zip(["grad x", "grad w_router", "grad w1", "grad w3", "grad w2"], g, g_ref):
        checks[name] = _rel(host(a), host(b))

    x, wr, w1, w3, w2 = params
    r_fn = jax.jit(router)
    probs, rmap, _ = r_fn(x, wr)
    d_fn = jax.jit(dispatch)
    xp, plan = d_fn(x, rmap)
    e_fn = jax.jit(experts)
    yp = e_fn(xp, plan.counts, w1, w3, w2)
    c_fn = jax.jit(lambda yp, plan, probs: mj.combine(yp, plan, probs))
    stages = {"router": lambda: r_fn(x, wr), "dispatch": lambda: d_fn(x, rmap),
              "experts": lambda: e_fn(xp, plan.counts, w1, w3, w2), "combine": lambda: c_fn(yp, plan, probs),
              "step": lambda: step(params)}
    t = jax_stage_times(stages, cfg.steps, "jax moe_rt layer")
    t.pop("step")
    return {"checks": checks, "times": t, "dtype": jnp.dtype(dtype).name,
            "note": "stages timed as separate jitted calls; backward = whole jitted step minus their sum"}


# ---- CuPy ----------------------------------------------------------------------------------------------
#
# No autograd here: the forward and the backward of both layers are written out by hand. The moe_rt layer
# calls moe_rt's forward ops and their backward ops; the plain layer uses no moe_rt at all (argsort
# permutation, dense gathers, softmax and its derivative spelled out). With no GPU the same code runs on
# NumPy arrays, which moe_rt's ops take to their reference path.

def _host(a) -> np.ndarray:
    """A host copy (CuPy) or the array itself (NumPy)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _bf16_ok(xp, bf16) -> bool:
    """Whether this CuPy does what the layers need in bfloat16: matmul (transposed operands too), casts,
    slice assignment, zero fill and row gathers."""
    try:
        a = xp.arange(64, dtype=np.float32).reshape(8, 8).astype(bf16)
        z = xp.zeros((8, 8), dtype=bf16)
        z[2:4] = a[:2] @ a.T[:, :8]
        g = _take_rows(a, xp.asarray([3, 1], dtype=np.int64))
        ref = np.arange(64, dtype=np.float32).reshape(8, 8)
        return (np.allclose(_host(z.astype(np.float32))[2:4], ref[:2] @ ref.T, rtol=1e-2)
                and np.array_equal(_host(g.astype(np.float32)), ref[[3, 1]]))
    except Exception:  # noqa: BLE001 - any missing bf16 piece means: compute in fp32
        return False


def _take_rows(a, idx):
    """``a[idx]`` along axis 0; 2-byte floats are moved as uint16 (a row gather is a copy of bits)."""
    if a.dtype.itemsize == 2:
        return a.view(np.uint16)[idx].view(a.dtype)
    return a[idx]


def _experts_fwd(xp, rows, bounds, w1, w3, w2):
    """SwiGLU per expert on expert-major rows (expert e owns rows bounds[e]:bounds[e+1]); matmuls in the
    weights' dtype, the gate in fp32. Returns the output rows and what the backward needs."""
    E, H = w2.shape[0], w2.shape[2]
    f32 = np.promote_types(w2.dtype, np.float32)  # fp32, or the weights' dtype when wider
    out = xp.zeros((rows.shape[0], H), dtype=w2.dtype)
    saved = []
    for e in range(E):
        a0, a1 = int(bounds[e]), int(bounds[e + 1])
        if a1 == a0:
            saved.append(None)
            continue
        h = rows[a0:a1]
        a = (h @ w1[e]).astype(f32)
        c = (h @ w3[e]).astype(f32)
        sig = 1 / (1 + xp.exp(-a))
        out[a0:a1] = (a * sig * c).astype(w2.dtype) @ w2[e]
        saved.append((a, c, sig))
    return out, saved


def _experts_bwd(xp, rows, grad_out, bounds, w1, w3, w2, saved):
    """Gradients of :func:`_experts_fwd`: (grad rows, grad w1, grad w3, grad w2)."""
    f32, dt = np.promote_types(w2.dtype, np.float32), w2.dtype
    g_rows = xp.zeros(rows.shape, dtype=rows.dtype)
    g1, g3, g2 = xp.zeros(w1.shape, dt), xp.zeros(w3.shape, dt), xp.zeros(w2.shape, dt)
    for e, s in enumerate(saved):
        if s is None:
            continue
        a0, a1 = int(bounds[e]), int(bounds[e + 1])
        a, c, sig = s
        h, go = rows[a0:a1], grad_out[a0:a1]
        g2[e] = (a * sig * c).astype(dt).T @ go
        dg = (go @ w2[e].T).astype(f32)
        da = (dg * c * sig * (1 + a * (1 - sig))).astype(dt)
        dc = (dg * a * sig).astype(dt)
        g1[e] = h.T @ da
        g3[e] = h.T @ dc
        g_rows[a0:a1] = ((da @ w1[e].T).astype(f32) + (dc @ w3[e].T).astype(f32)).astype(rows.dtype)
    return g_rows, g1, g3, g2


def _aux_coeff(cfg: Config) -> float:
    return cfg.experts * cfg.aux_coeff / cfg.topk / cfg.tokens / cfg.tokens


def moe_rt_cupy_layer(xp, params, gy, cfg: Config, timer=None):
    """The MoE layer on moe_rt's ops, forward and backward by hand. ``params`` = (x [T,H], w_router [H,E],
    w1 [E,H,F], w3 [E,H,F], w2 [E,F,H]); ``gy`` = dL/dy, and dL/d(aux) = 1. Returns (y, aux, grads)."""
    import moe_rt

    stage = timer or (lambda name: _Null())
    x, wr, w1, w3, w2 = params
    T, E, K = cfg.tokens, cfg.experts, cfg.topk
    f32 = np.float32
    with stage("router"):
        x32, wr32 = x.astype(f32), wr.astype(f32)
        logits = x32 @ wr32  # fp32 router: bf16 logits would tie between experts
        probs, rmap, inter = moe_rt.topk_with_score(logits, K, score_function="softmax")
        scores, smap, s_inter = moe_rt.scores_for_aux_loss(logits, K, "softmax")
        tpe = smap.sum(0).astype(np.int32)
        aux = moe_rt.aux_loss(scores, tpe, T, E, K, cfg.aux_coeff)
    with stage("dispatch"):
        plan = moe_rt.make_plan(rmap, E, num_out_tokens=T * K)
        xp_rows, _ = moe_rt.dispatch(x, plan)
    with stage("experts"):
        bounds = _host(plan.seg_start)  # E+1 ints on the host for the per-expert loop
        yp, saved = _experts_fwd(xp, xp_rows, bounds, w1, w3, w2)
    with stage("combine"):
        y = moe_rt.combine(yp, plan, probs)
    with stage("backward"):
        g_yp, g_probs = moe_rt.combine_backward(gy, plan, yp, probs)
        g_rows, g1, g3, g2 = _experts_bwd(xp, xp_rows, g_yp, bounds, w1, w3, w2, saved)
        g_x, _ = moe_rt.dispatch_backward(g_rows, plan)
        g_logits = moe_rt.topk_with_score_backward(g_probs, rmap, inter, K, score_function="softmax")
        g_scores = moe_rt.aux_loss_backward(xp.ones((), dtype=aux.dtype), T, tpe, T, E, K, cfg.aux_coeff)
        g_logits = g_logits + moe_rt.scores_for_aux_loss_backward(g_scores, s_inter, K, "softmax",
                                                                  dtype=f32)
        g_wr = (x32.T @ g_logits).astype(wr.dtype)
        g_x = (g_x.astype(f32) + g_logits @ wr32.T).astype(x.dtype)
    return y, aux, (g_x, g_wr, g1, g3, g2)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def plain_cupy_layer(xp, params, gy, cfg: Config):
    """The same layer without moe_rt: top-k by argsort, a stable argsort of the expert ids for the
    permutation, dense row gathers both ways, softmax derivatives written out. Same rounding points as
    :func:`moe_rt_cupy_layer` (router in fp32 or wider; expert matmuls in the weights' dtype; combine
    summed in fp32). Returns (y, aux, grads)."""
    x, wr, w1, w3, w2 = params
    T, E, K, H = cfg.tokens, cfg.experts, cfg.topk, x.shape[1]
    rt = np.promote_types(x.dtype, np.float32) if x.dtype.kind == "f" else np.dtype(np.float32)
    x32, wr32 = x.astype(rt), wr.astype(rt)
    logits = x32 @ wr32
    rows = xp.arange(T)[:, None]
    idx = xp.argsort(-logits, axis=1)[:, :K]  # top-k experts of each token
    w = _softmax_xp(xp, logits[rows, idx])  # softmax over the K selected
    flat = idx.reshape(-1)
    order = xp.argsort(flat, kind="stable")
    inv = xp.argsort(order)  # row of slot t*K+k in the expert-major order
    bounds = np.concatenate([[0], np.cumsum(_host(xp.bincount(flat, minlength=E)))])
    xs = _take_rows(x, order // K)  # dispatch: token of each expert-major row
    ys, saved = _experts_fwd(xp, xs, bounds, w1, w3, w2)
    y_slots = _take_rows(ys, inv).reshape(T, K, H).astype(rt)  # combine: back to (token, slot) order
    y = (y_slots * w[:, :, None].astype(rt)).sum(1).astype(x.dtype)
    s = _softmax_xp(xp, logits)  # aux loss: scores over all E, counts of each token's top-K
    si = xp.argsort(-s, axis=1)[:, :K]
    tpe = xp.bincount(si.reshape(-1), minlength=E).astype(rt)
    c = _aux_coeff(cfg)
    aux = c * (s.sum(0) * tpe).sum()

    gy_t = gy.astype(rt)
    g_w = (y_slots * gy_t[:, None, :]).sum(-1)  # [T,K]
    g_ys = _take_rows((gy_t[:, None, :] * w[:, :, None]).reshape(T * K, H).astype(x.dtype), order)
    g_xs, g1, g3, g2 = _experts_bwd(xp, xs, g_ys, bounds, w1, w3, w2, saved)
    g_x = _take_rows(g_xs, inv).reshape(T, K, H).astype(rt).sum(1)
    g_v = w * (g_w - (g_w * w).sum(-1, keepdims=True))  # softmax over the selected K
    g_logits = xp.zeros((T, E), dtype=rt)
    g_logits[rows, idx] = g_v
    g_s = c * xp.broadcast_to(tpe[None, :], (T, E))  # aux: d/ds, then the softmax over E
    g_logits = g_logits + s * (g_s - (g_s * s).sum(-1, keepdims=True))
    g_wr = (x32.T @ g_logits).astype(wr.dtype)
    g_x = (g_x + g_logits @ wr32.T).astype(x.dtype)
    return y, aux, (g_x, g_wr, g1, g3, g2)


def _softmax_xp(xp, z):
    e = xp.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def run_cupy(cfg: Config, device: str) -> dict:
    if device == "cuda":
        import cupy as xp
    else:
        xp = np
    from moe_rt import _arrays

    T, E, H, F = cfg.tokens, cfg.experts, cfg.hidden, cfg.ffn
    bf16 = _arrays.BFLOAT16
    note = None
    if device != "cuda":
        dtype = np.dtype(np.float32)
    elif bf16 is not None and _bf16_ok(xp, bf16):
        dtype = bf16
    else:
        dtype = np.dtype(np.float32)
        note = "this CuPy lacks the bfloat16 ops the layer needs: both layers run in float32"
    rng = np.random.default_rng(cfg.seed)

    def param(*shape, scale):
        return xp.asarray((rng.standard_normal(shape, dtype=np.float32) * scale)).astype(dtype)

    params = (param(T, H, scale=1.0), param(H, E, scale=H ** -0.5), param(E, H, F, scale=H ** -0.5),
              param(E, H, F, scale=H ** -0.5), param(E, F, H, scale=F ** -0.5))
    gy = param(T, H, scale=1.0)

    y, aux, g = moe_rt_cupy_layer(xp, params, gy, cfg)
    y_ref, aux_ref, g_ref = plain_cupy_layer(xp, params, gy, cfg)
    host = lambda a: _host(a.astype(np.float32))  # noqa: E731
    checks = {"output": _rel(host(y), host(y_ref)), "aux_loss": _rel(host(aux), host(aux_ref))}
    for name, a, b in zip(["grad x", "grad w_router", "grad w1", "grad w3", "grad w2"], g, g_ref):
        checks[name] = _rel(host(a), host(b))

    _jit.settle()
    timer = _Timer("cupy" if device == "cuda" else None)
    for i in range(cfg.steps):
        moe_rt_cupy_layer(xp, params, gy, cfg, timer)
        timer.step()
        _progress(i, cfg.steps, "cupy moe_rt layer")
    res = {"checks": checks, "times": timer.medians(), "dtype": np.dtype(dtype).name}
    if note:
        res["note"] = note
    return res


# ---- entry point -------------------------------------------------------------------------------------------

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


GPU_DEFAULTS = dict(tokens=4096, experts=64, topk=8, hidden=1024, ffn=512)
CPU_DEFAULTS = dict(tokens=256, experts=8, topk=2, hidden=64, ffn=32)


def parser():
    from moe_rt._cli import ArgumentParser, HelpFormatter, plain_text, positive_int

    p = ArgumentParser(prog="python -m moe_rt demo", description=plain_text(__doc__.split(": ", 1)[1]),
                       formatter_class=HelpFormatter)
    p.add_argument("--framework", choices=["torch", "jax", "cupy"], default="torch",
                   help="the framework of the layer (cupy: no autograd, the backward written out)")
    for k, what in (("tokens", "tokens T"), ("experts", "experts E"), ("topk", "experts per token K (<= E)"),
                    ("hidden", "hidden size H"), ("ffn", "expert FFN size F")):
        p.add_argument(f"--{k}", type=positive_int, default=None,
                       help=f"{what}; when absent {GPU_DEFAULTS[k]} on a GPU, {CPU_DEFAULTS[k]} on the CPU path")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps (median reported)")
    p.add_argument("--ep", type=positive_int, default=1, metavar="N",
                   help="expert parallelism over N GPUs, one process each (N > 1); 1 = the one-GPU layer")
    p.add_argument("--ep-mode", choices=["normal", "low_latency"], default="normal",
                   help="with --ep: normal = an EpGroup (exact mode in torch, capacity mode in JAX); low_latency "
                        "= a LowLatencyGroup (fixed slots, no prepare, no host sync; --tokens <= 1024)")
    p.add_argument("--fp8", action="store_true",
                   help="with --ep N: the dispatch sends FP8 rows (e4m3, one scale per 128 channels), dequantized "
                        "on arrival; the plain layer it is checked against gets the same rounding")
    p.add_argument("--cpu", action="store_true", help="run the NumPy reference path even with a GPU")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)

    from moe_rt.__main__ import _gpu_count
    from moe_rt.router import MAX_EXPERTS, MAX_TOPK

    gpus = 0 if args.cpu else _gpu_count()
    gpu = gpus > 0
    d = GPU_DEFAULTS if gpu else CPU_DEFAULTS
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else d[k] for k in d}
    cfg = Config(**sizes, steps=args.steps)
    if cfg.experts > MAX_EXPERTS:
        p.error(f"--experts: at most {MAX_EXPERTS}, got {cfg.experts}")
    if cfg.topk > min(cfg.experts, MAX_TOPK):
        p.error(f"--topk: must be <= the number of experts ({cfg.experts}) and <= {MAX_TOPK}, got {cfg.topk}")
    if args.ep_mode == "low_latency":
        from moe_rt.ep_ll import MAX_TOKENS_PER_RANK

        if args.ep < 2:
            p.error("--ep-mode low_latency runs the expert-parallel layer: give --ep N (N >= 2)")
        if cfg.tokens > MAX_TOKENS_PER_RANK:
            p.error(f"--ep-mode low_latency: --tokens (per rank) at most {MAX_TOKENS_PER_RANK}, got {cfg.tokens}")
    if args.fp8 and args.ep < 2:
        p.error("--fp8 sends the expert-parallel layer's rows as FP8: give --ep N (N >= 2)")
    if args.ep > 1 and cfg.experts % args.ep:
        p.error(f"--experts {cfg.experts} must be a multiple of --ep {args.ep}")
    if args.ep > 1:
        if gpus < args.ep:
            why = "--cpu was given" if args.cpu else f"{gpus} CUDA GPU(s) found"
            print(f"moe_rt demo: --ep {args.ep} needs {args.ep} CUDA GPUs (one process per GPU), but {why}; "
                  f"run without --ep for the one-GPU layer (or the NumPy reference path on a CPU)")
            return 2
        from moe_rt import demo_ep

        return demo_ep.run(cfg, args.framework, args.ep, args.ep_mode, args.fp8)
    where = "GPU (moe_rt CUDA kernels)" if gpu else "CPU: no GPU in use, running moe_rt's NumPy reference path"
    print(f"moe_rt demo: {args.framework}, {where}")
    print(f"layer: tokens={cfg.tokens} experts={cfg.experts} topk={cfg.topk} hidden={cfg.hidden} "
          f"ffn={cfg.ffn}, {cfg.steps} steps")
    runner = {"torch": run_torch, "jax": run_jax, "cupy": run_cupy}[args.framework]
    res = runner(cfg, "cuda" if gpu else "cpu")
    tol = TOLERANCE[res["dtype"]]
    print(f"check against the plain {args.framework} layer ({res['dtype']}, relative L2 error, limit {tol:g}):")
    ok = True
    for k, v in res["checks"].items():
        good = v <= tol
        ok &= good
        print(f"  {k:<14} {v:.2e}  {'ok' if good else 'MISMATCH'}")
    t = res["times"]
    total = sum(t.values())
    print("median time per step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in t.items())
          + f"; total {total:.3f}")
    print(f"throughput: {cfg.tokens / (total * 1e-3):,.0f} tokens/s (forward + backward)")
    if res.get("note"):
        print(f"({res['note']})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
