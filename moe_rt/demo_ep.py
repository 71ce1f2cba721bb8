"""``python -m moe_rt demo --ep N``: the demo's MoE layer with expert parallelism over N GPUs.

The parent process starts N workers (``python -m moe_rt.demo_ep``), one per GPU (each sees only its GPU
through ``CUDA_VISIBLE_DEVICES``; in the low-latency mode, which needs peer access, every GPU, rank r using GPU
r through ``LOCAL_RANK``); they share the NCCL unique id through a file (torch) or jax.distributed's
key-value store (JAX). Each rank holds ``--tokens`` tokens and ``E/N`` experts and runs:

router (fp32 logits -> ``topk_with_score``, top-k of the probs as ``topk_idx``/``topk_weights``, the aux
loss on the rank's tokens) -> ``ep_prepare`` -> ``ep_dispatch`` -> SwiGLU of its local experts ->
``ep_combine`` weighted by the received weights, forward and backward.

Every rank draws the whole batch and every weight from the same seed and checks its EP results against
the same layer in plain framework code over the whole batch on its own GPU, all experts local: its output
rows, the gradient of its input rows, its local experts' weight gradients, and the router weight gradient
summed over ranks (NCCL all-reduce). The aux loss is per rank (each rank's tokens), in both. Then it
times the EP layer per stage and rank 0 prints tokens/s over all ranks. Exit status 0 iff every rank's
checks pass.

torch runs an exact-mode group (one host read of the counts in prepare; experts loop over the exact
segments); JAX needs static shapes, so it runs a capacity-mode group and ``jax.lax.ragged_dot`` over the
fixed-size receive buffer.

``--ep-mode low_latency`` runs the layer through a :class:`moe_rt.LowLatencyGroup` instead (``--tokens`` at
most 1024): ``ll_dispatch`` -> the SwiGLU of each local expert as one batched matmul over its fixed slots
``[L, N*T, H]`` -> ``ll_combine`` weighted by the router's weights, no prepare and no host read. torch runs
the experts on a copy of ``recv_x`` with zero rows at empty slots (``ll_dispatch(..., copy=True)``: by default
``recv_x`` is the group's receive buffer, which combine's backward overwrites); JAX's ``recv_x`` is its own
array, zero at empty slots already.

``--fp8``: the dispatch sends FP8 rows dequantized on arrival (``ep_dispatch(..., fp8=True,
dequantize=True)``; in the low-latency mode a group made with ``fp8=True`` and ``ll_dispatch(..., fp8=True,
dequantize=True)``), the gradient straight-through; the plain layer rounds the experts' input the same way.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

TOL = {"bfloat16": 3e-2, "float32": 1e-4}
EP_MODES = ("normal", "low_latency")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cfg, framework: str, n: int, ep_mode: str = "normal", fp8: bool = False) -> int:
    """Start ``n`` workers (one per GPU), wait for them, return 0 iff all passed. ``ep_mode``: "normal" (an
    EpGroup: exact mode in torch, capacity mode in JAX) or "low_latency" (a LowLatencyGroup). ``fp8``: the
    dispatch sends FP8 rows, dequantized on arrival."""
    if framework not in ("torch", "jax"):
        print(f"demo --ep: framework {framework!r} has no expert-parallel layer; use torch or jax")
        return 2
    if cfg.experts % n:
        print(f"demo --ep {n}: --experts {cfg.experts} must be a multiple of {n}")
        return 2
    tmp = tempfile.mkdtemp(prefix="moe_rt_demo_ep_")
    port = _free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK="0", CUDA_VISIBLE_DEVICES=str(r),
                   MOE_RT_UID_FILE=os.path.join(tmp, "nccl_uid"), MOE_RT_COORDINATOR=f"127.0.0.1:{port}",
                   NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
        if ep_mode == "low_latency":  # peer access needs every GPU visible: rank r uses GPU r
            env["LOCAL_RANK"] = str(r)
            if "CUDA_VISIBLE_DEVICES" in os.environ:
                env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                del env["CUDA_VISIBLE_DEVICES"]
        args = [sys.executable, "-m", "moe_rt.demo_ep", "--framework", framework]
        for k in ("tokens", "experts", "topk", "hidden", "ffn", "steps", "seed"):
            args += [f"--{k}", str(getattr(cfg, k))]
        args += ["--ep-mode", ep_mode] + (["--fp8"] if fp8 else [])
        procs.append(subprocess.Popen(args, env=env))
    codes = [None] * n
    while any(c is None for c in codes):
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            time.sleep(5)  # let the others report, then stop them
            for p in procs:
                if p.poll() is None:
                    p.kill()
            codes = [p.wait() for p in procs]
            break
        time.sleep(0.1)
    bad = [r for r, c in enumerate(codes) if c != 0]
    if bad:
        print(f"demo --ep {n}: ranks {bad} failed (exit codes {[codes[r] for r in bad]})")
        return 1
    return 0


def _cpu_dry_run(n: int) -> bool:
    """``MOE_RT_DEMO_EP_CPU=1``: one rank on the CPU with a 1-rank group (no NCCL), fp32: runs the same layer
    code through the reference path (a test of the worker without GPUs)."""
    if os.environ.get("MOE_RT_DEMO_EP_CPU") != "1":
        return False
    if n != 1:
        raise ValueError("MOE_RT_DEMO_EP_CPU=1 runs one rank")
    return True


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _report(rank, n, cfg, framework, checks, times, dtype, mode):
    tol = TOL[dtype]
    ok = all(v <= tol for v in checks.values())
    lines = [f"[rank {rank}] {framework} EP layer ({mode}) over {n} GPUs, {cfg.tokens} tokens/rank, "
             f"{cfg.experts} experts (top-{cfg.topk}), hidden {cfg.hidden}, ffn {cfg.ffn}, {dtype}: checks against the plain layer "
             f"on one GPU (relative error, tolerance {tol:g})"]
    for k, v in checks.items():
        lines.append(f"[rank {rank}]   {k:<16} {v:.2e}  {'ok' if v <= tol else 'FAIL'}")
    if rank == 0:
        step = times.pop("step")
        lines.append(f"[rank 0] per-stage ms (median of {cfg.steps} steps, rank 0): "
                     + ", ".join(f"{k} {v:.3f}" for k, v in times.items()) + f"; whole step {step:.3f}")
        lines.append(f"[rank 0] tokens/s over all ranks (forward + backward): {n * cfg.tokens / step * 1e3:,.0f}")
    print("\n".join(lines), flush=True)
    return ok


# ---- torch ----------------------------------------------------------------------------------------------

def _fp8_torch(t):
    """Straight-through FP8 round trip of t's rows (e4m3, one scale per 128 channels: what an FP8 dispatch
    delivers): the values of dequantize(quantize(t)), the gradient of the identity."""
    import moe_rt

    q = moe_rt.dequantize_fp8(*moe_rt.quantize_fp8(t.detach()), t.dtype)
    return t + (q - t.detach())


def _torch_worker(cfg, rank, n, ep_mode="normal", fp8=False):
    import torch

    import moe_rt
    import moe_rt.torch as mt
    from moe_rt.bootstrap import init_communicator
    from moe_rt.demo import _progress

    cpu = _cpu_dry_run(n)
    local = int(os.environ.get("LOCAL_RANK", "0"))  # the GPU among the visible ones
    if not cpu:
        torch.cuda.set_device(local)
    comm = None if cpu else init_communicator(rank, n, local, method="file")
    dev, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    T, E, K, H, F = cfg.tokens, cfg.experts, cfg.topk, cfg.hidden, cfg.ffn
    L = E // n
    ll = ep_mode == "low_latency"
    if ll:
        group = moe_rt.LowLatencyGroup(comm, E, H, T, topk=K, dtype=str(dtype).replace("torch.", ""), fp8=fp8)
    else:
        group = moe_rt.EpGroup(comm, E, H, T, mode="exact")
    gen = torch.Generator().manual_seed(cfg.seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    X = rand(n * T, H, scale=1.0)
    WR = rand(H, E, scale=H ** -0.5)
    W1, W3, W2 = rand(E, H, F, scale=H ** -0.5), rand(E, H, F, scale=H ** -0.5), rand(E, F, H, scale=F ** -0.5)
    GY = rand(n * T, H, scale=1.0)
    mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * L, (rank + 1) * L)
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    x, wr, w1, w3, w2 = leaf(X[mine]), leaf(WR), leaf(W1[experts]), leaf(W3[experts]), leaf(W2[experts])
    gy = GY[mine]

    def swiglu(h, a, b, c):
        return (torch.nn.functional.silu(h @ a) * (h @ b)) @ c

    def aux_of(logits, T_):
        s = torch.softmax(logits, -1)
        _, si = s.topk(K, dim=-1)
        tpe = torch.zeros_like(s).scatter(1, si, 1.0).sum(0)
        return (E * cfg.aux_coeff) / K / T_ / T_ * (s.sum(0) * tpe).sum()

    events = {}

    def mark(name):
        if cpu:
            events[name] = time.perf_counter()
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        events[name] = ev

    def elapsed(a, b):
        return (b - a) * 1e3 if cpu else a.elapsed_time(b)

    def ep_step():
        mark("start")
        logits = x.float() @ wr.float()
        probs, _ = mt.topk_with_score(logits, K, score_function="softmax")
        weights, idx = probs.topk(K, dim=-1)
        scores, smap = mt.scores_for_aux_loss(logits, K, "softmax")
        aux = mt.aux_loss(scores, smap.sum(0, dtype=torch.int32), T, E, K, cfg.aux_coeff)
        mark("router")
        if ll:
            # copy=True: recv_x as a new tensor, zero at empty slots (by default it is the group's receive
            # buffer, which combine's backward overwrites with the gradient)
            rows, _, h = mt.ll_dispatch(group, x, idx.int(), weights, copy=True, fp8=fp8, dequantize=fp8)
            mark("dispatch")
            yp = swiglu(rows, w1, w3, w2)  # each local expert: one batched matmul over its [N*T, H] slots
            mark("experts")
            y = mt.ll_combine(h, yp)
            mark("combine")
            return y, aux, backward_of(y, aux)
        h = mt.ep_prepare(group, idx.int())
        rx, rw = mt.ep_dispatch(h, x, weights, fp8=True, dequantize=True) if fp8 else mt.ep_dispatch(h, x, weights)
        mark("dispatch")
        bounds = [0] + np.cumsum(h.tokens_per_expert.tolist()).tolist()  # host copy of L counts
        yp = torch.cat([swiglu(rx[bounds[j]:bounds[j + 1]], w1[j], w3[j], w2[j]) for j in range(L)]
                       + [rx[bounds[L]:] * 0])
        mark("experts")
        y = mt.ep_combine(h, yp, rw)
        mark("combine")
        return y, aux, backward_of(y, aux)

    def backward_of(y, aux):
        loss = (y.float() * gy.float()).sum() + aux
        g = torch.autograd.grad(loss, [x, wr, w1, w3, w2])
        mark("backward")
        return g

    def plain():
        p = [leaf(t) for t in (X, WR, W1, W3, W2)]
        Xp, WRp, W1p, W3p, W2p = p
        Xe = _fp8_torch(Xp) if fp8 else Xp  # the experts' input: what the dispatch delivers
        logits = Xp.float() @ WRp.float()
        v, idx = logits.topk(K, dim=-1)
        wts = torch.softmax(v, -1)
        y = torch.zeros(n * T, H, device=dev, dtype=torch.float32)
        for e in range(E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                y.index_add_(0, tok, wts[tok, slot, None] * swiglu(Xe[tok], W1p[e], W3p[e], W2p[e]).float())
        y = y.to(dtype)
        auxes = [aux_of(logits[r * T:(r + 1) * T], T) for r in range(n)]
        loss = (y.float() * GY.float()).sum() + sum(auxes)
        return y, auxes, torch.autograd.grad(loss, p)

    y, aux, g = ep_step()
    y_ref, aux_ref, g_ref = plain()
    g_wr = g[1].float().contiguous()  # this rank's share; the sum over ranks is the whole batch's gradient
    if comm is not None:
        comm.all_reduce(g_wr.data_ptr(), g_wr.data_ptr(), g_wr.numel(), "float32",
                        torch.cuda.current_stream().cuda_stream)
    host = lambda t: t.detach().float().cpu().numpy()  # noqa: E731
    checks = {"output": _rel(host(y), host(y_ref[mine])), "aux_loss": _rel(host(aux), host(aux_ref[rank])),
              "grad x": _rel(host(g[0]), host(g_ref[0][mine])), "grad w_router": _rel(host(g_wr), host(g_ref[1]))}
    for name, a, b in zip(("grad w1", "grad w3", "grad w2"), g[2:], g_ref[2:]):
        checks[name] = _rel(host(a), host(b[experts]))

    samples = {}
    order = ("router", "dispatch", "experts", "combine", "backward")
    for i in range(cfg.steps):
        ep_step()
        if not cpu:
            torch.cuda.synchronize()
        prev = events["start"]
        for k in order:
            samples.setdefault(k, []).append(elapsed(prev, events[k]))
            prev = events[k]
        samples.setdefault("step", []).append(elapsed(events["start"], events["backward"]))
        if rank == 0:
            _progress(i, cfg.steps, f"torch EP layer ({n} GPUs)")
    times = {k: float(np.median(v)) for k, v in samples.items()}
    ok = _report(rank, n, cfg, "torch", checks, times, str(dtype).replace("torch.", ""),
                 ("low-latency mode" if ll else "exact mode") + (", FP8 dispatch" if fp8 else ""))
    if ll:
        group.close()  # a collective: its IPC mappings go before the communicator
    if comm is not None:
        comm.close()
    return ok


# ---- JAX ------------------------------------------------------------------------------------------------

def _jax_worker(cfg, rank, n, ep_mode="normal", fp8=False):
    import jax

    cpu = _cpu_dry_run(n)
    if not cpu:
        jax.distributed.initialize(coordinator_address=os.environ["MOE_RT_COORDINATOR"], num_processes=n,
                                   process_id=rank, local_device_ids=[int(os.environ.get("LOCAL_RANK", "0"))])
    import jax.numpy as jnp

    import moe_rt
    import moe_rt.jax as mj
    from moe_rt.bootstrap import init_communicator
    from moe_rt.demo import jax_plain_aux, jax_plain_moe, jax_stage_times

    comm = None if cpu else init_communicator(rank, n, int(os.environ.get("LOCAL_RANK", "0")), method="jax")
    dev = jax.devices("cpu")[0] if cpu else jax.local_devices()[0]
    dtype = jnp.float32 if cpu else jnp.bfloat16
    T, E, K, H, F = cfg.tokens, cfg.experts, cfg.topk, cfg.hidden, cfg.ffn
    L = E // n
    ll = ep_mode == "low_latency"
    if ll:
        group = moe_rt.LowLatencyGroup(comm, E, H, T, topk=K, dtype=jnp.dtype(dtype).name, fp8=fp8)
    else:
        group = moe_rt.EpGroup(comm, E, H, T, mode="capacity")
    keys = jax.random.split(jax.random.PRNGKey(cfg.seed), 6)

    def rand(k, shape, scale):
        return jax.device_put((jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype), dev)

    X, WR = rand(keys[0], (n * T, H), 1.0), rand(keys[1], (H, E), H ** -0.5)
    W1, W3 = rand(keys[2], (E, H, F), H ** -0.5), rand(keys[3], (E, H, F), H ** -0.5)
    W2, GY = rand(keys[4], (E, F, H), F ** -0.5), rand(keys[5], (n * T, H), 1.0)
    lo, le = rank * T, rank * L
    params = (X[lo:lo + T], WR, W1[le:le + L], W3[le:le + L], W2[le:le + L])
    gy = GY[lo:lo + T]

    def experts(rows, gs, w1, w3, w2):
        h = jax.nn.silu(jax.lax.ragged_dot(rows, w1, gs)) * jax.lax.ragged_dot(rows, w3, gs)
        return jax.lax.ragged_dot(h.astype(dtype), w2, gs).astype(dtype)

    def fp8_rows(rows):
        # straight-through FP8 round trip of each row (what an FP8 dispatch delivers; identity without --fp8)
        if not fp8:
            return rows
        q = mj.dequantize_fp8(*mj.quantize_fp8(jax.lax.stop_gradient(rows)), rows.dtype)
        return rows + jax.lax.stop_gradient(q - rows)

    def ll_experts(rows, w1, w3, w2):
        # each local expert's SwiGLU as one batched matmul over its fixed slots [N*T, H] (empty slots are
        # zero rows in JAX's recv_x)
        h = jax.nn.silu(rows @ w1) * (rows @ w3)
        return (h.astype(dtype) @ w2).astype(dtype)

    def router(x, wr):
        logits = x.astype(jnp.float32) @ wr.astype(jnp.float32)
        probs, _ = mj.topk_with_score(logits, K, score_function="softmax")
        weights, idx = jax.lax.top_k(probs, K)
        scores, smap = mj.scores_for_aux_loss(logits, K, "softmax")
        aux = mj.aux_loss(scores, smap.sum(0).astype(jnp.int32), T, E, K, cfg.aux_coeff)
        return weights, idx.astype(jnp.int32), aux

    def ep_loss(p):
        x, wr, w1, w3, w2 = p
        weights, idx, aux = router(x, wr)
        if ll:
            rx, _, h = mj.ll_dispatch(group, x, idx, weights, fp8=fp8, dequantize=fp8)
            y = mj.ll_combine(h, ll_experts(rx, w1, w3, w2))
            return (y.astype(jnp.float32) * gy.astype(jnp.float32)).sum() + aux, (y, aux)
        h = mj.ep_prepare(group, idx)
        rx, rw = mj.ep_dispatch(h, x, weights, fp8=True, dequantize=True) if fp8 else mj.ep_dispatch(h, x, weights)
        y = mj.ep_combine(h, experts(rx, h.tokens_per_expert, w1, w3, w2), rw)
        return (y.astype(jnp.float32) * gy.astype(jnp.float32)).sum() + aux, (y, aux)

    def plain_loss(p):
        x, wr, w1, w3, w2 = p
        y, logits = jax_plain_moe(x, wr, K, E, lambda rows, gs: experts(fp8_rows(rows), gs, w1, w3, w2))
        auxes = jnp.stack([jax_plain_aux(logits[r * T:(r + 1) * T], K, E, cfg.aux_coeff) for r in range(n)])
        return (y.astype(jnp.float32) * GY.astype(jnp.float32)).sum() + auxes.sum(), (y, auxes)

    step = jax.jit(jax.value_and_grad(ep_loss, has_aux=True))
    (_, (y, aux)), g = step(params)
    (_, (y_ref, aux_ref)), g_ref = jax.jit(jax.value_and_grad(plain_loss, has_aux=True))((X, WR, W1, W3, W2))
    g_wr = np.asarray(jnp.asarray(g[1], jnp.float32))
    if comm is not None:
        import cupy as cp

        with cp.cuda.Device(int(os.environ.get("LOCAL_RANK", "0"))):
            g_dev = cp.asarray(g_wr)  # this rank's share; the sum over ranks is the whole batch's gradient
            comm.all_reduce(g_dev.data.ptr, g_dev.data.ptr, g_dev.size, "float32", cp.cuda.get_current_stream().ptr)
            g_wr = g_dev.get()
    host = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    checks = {"output": _rel(host(y), host(y_ref[lo:lo + T])), "aux_loss": _rel(host(aux), host(aux_ref[rank])),
              "grad x": _rel(host(g[0]), host(g_ref[0][lo:lo + T])), "grad w_router": _rel(g_wr, host(g_ref[1]))}
    for name, a, b in zip(("grad w1", "grad w3", "grad w2"), g[2:], g_ref[2:]):
        checks[name] = _rel(host(a), host(b[le:le + L]))

    x, wr, w1, w3, w2 = params
    r_fn = jax.jit(router)
    weights, idx, _ = r_fn(x, wr)
    if ll:
        d_fn = jax.jit(lambda x, i, w: mj.ll_dispatch(group, x, i, w, fp8=fp8, dequantize=fp8))
        rx, _, h = d_fn(x, idx, weights)
        e_fn = jax.jit(ll_experts)
        yp = e_fn(rx, w1, w3, w2)
        c_fn = jax.jit(mj.ll_combine)
        stages = {"router": lambda: r_fn(x, wr), "dispatch": lambda: d_fn(x, idx, weights),
                  "experts": lambda: e_fn(rx, w1, w3, w2), "combine": lambda: c_fn(h, yp),
                  "step": lambda: step(params)}
    else:
        p_fn = jax.jit(lambda i: mj.ep_prepare(group, i))
        h = p_fn(idx)
        d_fn = jax.jit(lambda h, x, w: mj.ep_dispatch(h, x, w, fp8=True, dequantize=True) if fp8
                       else mj.ep_dispatch(h, x, w))
        rx, rw = d_fn(h, x, weights)
        e_fn = jax.jit(experts)
        yp = e_fn(rx, h.tokens_per_expert, w1, w3, w2)
        c_fn = jax.jit(lambda h, yp, rw: mj.ep_combine(h, yp, rw))
        stages = {"router": lambda: r_fn(x, wr), "dispatch": lambda: d_fn(p_fn(idx), x, weights),
                  "experts": lambda: e_fn(rx, h.tokens_per_expert, w1, w3, w2), "combine": lambda: c_fn(h, yp, rw),
                  "step": lambda: step(params)}
    times = jax_stage_times(stages, cfg.steps, f"jax EP layer ({n} GPUs)", show=rank == 0)
    ok = _report(rank, n, cfg, "jax", checks, times, jnp.dtype(dtype).name,
                 ("low-latency mode" if ll else "capacity mode") + (", FP8 dispatch" if fp8 else ""))
    if ll:
        group.close()  # a collective: its IPC mappings go before the communicator
    if rank == 0:
        print(f"[rank 0] (JAX stages are separate jitted calls{'' if ll else ', dispatch includes prepare'}; "
              "backward = the whole jitted step minus their sum)", flush=True)
    return ok


def main(argv=None) -> int:
    from moe_rt.demo import Config

    from moe_rt._cli import ArgumentParser, positive_int

    ap = ArgumentParser(description="one rank of `python -m moe_rt demo --ep N` (started by it)")
    ap.add_argument("--framework", choices=("torch", "jax"), required=True)
    for k in ("tokens", "experts", "topk", "hidden", "ffn", "steps"):
        ap.add_argument(f"--{k}", type=positive_int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--ep-mode", choices=EP_MODES, default="normal")
    ap.add_argument("--fp8", action="store_true")
    a = ap.parse_args(argv)
    cfg = Config(tokens=a.tokens, experts=a.experts, topk=a.topk, hidden=a.hidden, ffn=a.ffn, steps=a.steps,
                 seed=a.seed)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    worker = _torch_worker if a.framework == "torch" else _jax_worker
    return 0 if worker(cfg, rank, n, a.ep_mode, a.fp8) else 1


if __name__ == "__main__":
    sys.exit(main())
