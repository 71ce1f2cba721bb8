"""``python -m moe_rt demo``: a whole MoE layer, forward and backward, on moe_rt's ops.

The layer: router logits ``x @ w_router`` -> :func:`topk_with_score` (softmax after top-k) -> dispatch
into expert-major rows -> a SwiGLU MLP per expert (the framework's matmuls) -> weighted combine, plus the
Switch aux loss on :func:`scores_for_aux_loss`. Every step but the expert matmuls is a moe_rt op. The same
layer written in plain framework code (no moe_rt) runs beside it on the same weights, and the demo checks
the output and the gradients of the input, the router weights and the expert weights against it, then
times the moe_rt layer per stage over several steps.

With a GPU the demo runs on it in bf16; without one it runs moe_rt's NumPy reference path (CPU tensors) at a
small default size and says so.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np


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

    timer = _Timer(device)

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

    timer.reset()
    for i in range(cfg.steps):
        grads(moe_rt_layer)
        timer.step()
        _progress(i, cfg.steps, "torch moe_rt layer")
    return {"checks": checks, "times": timer.medians(), "dtype": str(dtype).replace("torch.", "")}


class _Timer:
    """Per-stage wall times (CUDA events on a GPU, perf_counter with no GPU); medians over steps."""

    def __init__(self, device: str):
        self.device = device
        self.samples: dict[str, list[float]] = {}
        self.pending: list = []

    def __call__(self, name):
        timer = self

        class _Ctx:
            def __enter__(self_inner):
                if timer.device == "cuda":
                    import torch

                    self_inner.ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    self_inner.ev[0].record()
                else:
                    self_inner.t0 = time.perf_counter()

            def __exit__(self_inner, *exc):
                if timer.device == "cuda":
                    self_inner.ev[1].record()
                    timer.pending.append((name, self_inner.ev))
                else:
                    timer.samples.setdefault(name, []).append((time.perf_counter() - self_inner.t0) * 1e3)
                return False

        return _Ctx()

    def step(self):
        if self.pending:
            import torch

            torch.cuda.synchronize()
            for name, (a, b) in self.pending:
                self.samples.setdefault(name, []).append(a.elapsed_time(b))
            self.pending.clear()

    def reset(self):
        self.step()
        self.samples.clear()

    def medians(self) -> dict:
        return {k: float(np.median(v)) for k, v in self.samples.items()}


# ---- JAX -----------------------------------------------------------------------------------------------

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
        logits = x.astype(jnp.float32) @ wr.astype(jnp.float32)
        v, idx = jax.lax.top_k(logits, K)
        w = jax.nn.softmax(v, -1)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        gs = jnp.bincount(flat, length=E).astype(jnp.int32)
        yp = experts(jnp.repeat(x, K, axis=0)[order], gs, w1, w3, w2)
        y = (yp[jnp.argsort(order)].reshape(T, K, H).astype(jnp.float32) * w[..., None]).sum(1).astype(dtype)
        s = jax.nn.softmax(logits, -1)
        _, si = jax.lax.top_k(s, K)
        tpe = jax.lax.stop_gradient(jnp.zeros_like(s).at[jnp.arange(T)[:, None], si].set(1.0).sum(0))
        return y, (E * cfg.aux_coeff) / K / T / T * (s.sum(0) * tpe).sum()

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
    samples: dict[str, list[float]] = {k: [] for k in stages}
    for f in stages.values():
        jax.block_until_ready(f())
    for i in range(cfg.steps):
        for k, f in stages.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            samples[k].append((time.perf_counter() - t0) * 1e3)
        _progress(i, cfg.steps, "jax moe_rt layer")
    t = {k: float(np.median(v)) for k, v in samples.items()}
    step_ms = t.pop("step")
    t["backward"] = max(step_ms - sum(t.values()), 0.0)
    return {"checks": checks, "times": t, "dtype": jnp.dtype(dtype).name,
            "note": "stages timed as separate jitted calls; backward = whole jitted step minus their sum"}


# ---- entry point -------------------------------------------------------------------------------------------

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m moe_rt demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=["torch", "jax"], default="torch")
    p.add_argument("--tokens", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--topk", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="run the NumPy reference path even with a GPU")
    args = p.parse_args(argv)

    from moe_rt.__main__ import _gpu_count

    gpu = not args.cpu and _gpu_count() > 0
    d = dict(tokens=4096, experts=64, topk=8, hidden=1024, ffn=512) if gpu else \
        dict(tokens=256, experts=8, topk=2, hidden=64, ffn=32)
    cfg = Config(tokens=args.tokens or d["tokens"], experts=args.experts or d["experts"],
                 topk=args.topk or d["topk"], hidden=args.hidden or d["hidden"], ffn=args.ffn or d["ffn"],
                 steps=args.steps)
    where = "GPU (moe_rt CUDA kernels)" if gpu else "CPU: no GPU in use, running moe_rt's NumPy reference path"
    print(f"moe_rt demo: {args.framework}, {where}")
    print(f"layer: tokens={cfg.tokens} experts={cfg.experts} topk={cfg.topk} hidden={cfg.hidden} "
          f"ffn={cfg.ffn}, {cfg.steps} steps")
    runner = {"torch": run_torch, "jax": run_jax}[args.framework]
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
