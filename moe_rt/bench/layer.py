"""Benchmark of the whole MoE layer step (forward + backward) on moe_rt against the plain framework layer.

The layer (as in ``python -m moe_rt demo``): fp32 router logits ``x @ w_router`` -> top-k with softmax over
the K selected, plus the Switch aux loss -> dispatch into expert-major rows -> SwiGLU experts (torch:
``torch._grouped_mm``; JAX: dense batched matmuls over a static per-expert capacity, see
``jax_capacity_matmul``) -> weighted combine. The moe_rt layer runs router,
dispatch and combine on moe_rt's adapters (``moe_rt.torch``, ``moe_rt.jax``); the plain layer writes them
the way MaxText / Megatron do (top-k + softmax, stable argsort of the expert ids, row gathers, gather back
and an fp32 weighted sum). Both layers share the expert code. Rows:

- the layer step, forward + backward with given cotangents (torch: eager moe_rt, plain eager, plain under
  ``torch.compile``, moe_rt under ``torch.compile``; JAX: ``jax.jit`` of moe_rt and of the plain layer);
- each stage forward + backward in isolation (router, dispatch, combine, experts), each its own eager call,
  compiled function or jitted function, written as inside the layer; their sum router+dispatch+combine is
  what the targets compare, and "layer - experts" is the same share measured inside the layer;
- adapter overhead per call at a small size (T=128) where launch overhead dominates: ``moe_rt.torch.<op>``
  against the moe_rt op called directly on the same torch tensors, ``jax.jit(moe_rt.jax.<op>)`` against the
  moe_rt op on CuPy views of the same buffers (written to ``<json stem>_overhead.json``); and per op inside
  one autograd graph / one jitted program, where the framework's fixed cost of a backward pass or a jitted
  call is paid once for a chain of 40 ops, as in a training step.

torch rows are timed with CUDA events on torch's stream (median of ``--iters`` steps after warm-up, host
launch gaps included, as a training step sees them); JAX rows with wall clock around each jitted call up to
``block_until_ready`` (JAX runs on its own streams). GB/s counts the fewest bytes a stage must move.

    python tools/bench_layer.py [--quick] [--json PATH] [--no-compile] [--iters N]
                                [--jax-experts capacity|blocked|ragged]
"""
from __future__ import annotations

import gc
import os
import statistics
import time
import traceback

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside torch in one process
from moe_rt.bench import _lib as benchlib  # noqa: E402

COLUMNS = ["part", "impl", "ms", "GB/s", "% copy", "x moe_rt"]
OVERHEAD_COLUMNS = ["framework", "op", "pass", "adapter us", "direct us", "overhead us/call", "adapter GPU us",
                    "direct GPU us"]
COEFF = 1e-2


class Shape:
    def __init__(self, T, H, E, K, F):
        self.T, self.H, self.E, self.K, self.F = T, H, E, K, F
        self.N = T * K

    def stage_bytes(self):
        """Fewest bytes each stage moves, forward + backward (bf16 tokens)."""
        T, H, N, E = self.T, self.H, self.N, self.E
        return {"router": 3 * T * H * 2 + 6 * T * E * 4,  # read x twice, write grad x; fp32 logits/grads
                "dispatch": 2 * (T + N) * H * 2,  # rows out and back
                "combine": (3 * N + 2 * T) * H * 2}  # y_perm read twice (fwd, probs grad), grad y_perm written


def moe_rt_stages(m, s: Shape, as_f32, count_i32):
    """Router, dispatch and combine of the moe_rt layer over the adapter module ``m`` (moe_rt.torch or
    moe_rt.jax, which share the API); ``as_f32`` and ``count_i32`` are the framework's casts."""
    T, E, K = s.T, s.E, s.K

    def router(x, wr):
        logits = as_f32(x) @ as_f32(wr)  # fp32 router: bf16 logits would tie between experts
        probs, rmap = m.topk_with_score(logits, K, score_function="softmax")
        scores, smap = m.scores_for_aux_loss(logits, K, "softmax")
        return probs, m.aux_loss(scores, count_i32(smap), T, E, K, COEFF), rmap

    def dispatch(x, rmap):
        plan = m.make_plan(rmap, E, num_out_tokens=T * K)
        return m.dispatch(x, plan)[0], plan

    def combine(ys, plan, probs):
        return m.combine(ys, plan, probs)

    return router, dispatch, combine


# ---- torch ------------------------------------------------------------------------------------------------

def torch_parts(s: Shape, experts_kind: str):
    import torch
    import torch.nn.functional as Fn

    import moe_rt.torch as mt

    T, E, K = s.T, s.E, s.K
    c_aux = E * COEFF / K / T / T

    def experts(xs, offs, w1, w3, w2):
        # w1, w3: [E, F, H], w2: [E, H, F] (out x in); offs: [E] int32 cumulative row ends
        if experts_kind == "grouped_mm":
            h1 = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
            h3 = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(Fn.silu(h1) * h3, w2.transpose(-2, -1), offs=offs)
        ends = offs.tolist()
        outs, a0 = [], 0
        for e, a1 in enumerate(ends):
            h = xs[a0:a1]
            outs.append((Fn.silu(h @ w1[e].t()) * (h @ w3[e].t())) @ w2[e].t())
            a0 = a1
        return torch.cat(outs + [xs[a0:] * 0])

    mr_router, mr_dispatch, mr_combine = moe_rt_stages(mt, s, lambda t: t.float(),
                                                       lambda m: m.sum(0, dtype=torch.int32))

    def mr_layer(x, wr, w1, w3, w2):
        probs, aux, rmap = mr_router(x, wr)
        xs, plan = mr_dispatch(x, rmap)
        ys = experts(xs, plan.seg_start[1:], w1, w3, w2)
        return mr_combine(ys, plan, probs), aux

    # plain stages
    def pl_router(x, wr):
        logits = x.float() @ wr.float()
        v, idx = logits.topk(K, dim=-1)
        w = torch.softmax(v, -1)
        sc = torch.softmax(logits, -1)
        tpe = torch.zeros_like(sc).scatter(1, sc.topk(K, dim=-1)[1], 1.0).sum(0)
        aux = c_aux * (sc.sum(0) * tpe).sum()
        return w, aux, idx

    def pl_dispatch(x, idx):
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
        return x.index_select(0, order // K), order, offs

    def pl_combine(ys, order, w):
        inv = torch.argsort(order)
        y = (ys.index_select(0, inv).view(T, K, -1).float() * w.unsqueeze(-1)).sum(1)
        return y.to(ys.dtype)

    def pl_layer(x, wr, w1, w3, w2):
        w, aux, idx = pl_router(x, wr)
        xs, order, offs = pl_dispatch(x, idx)
        return pl_combine(experts(xs, offs, w1, w3, w2), order, w), aux

    return dict(experts=experts, mr_router=mr_router, mr_dispatch=mr_dispatch, mr_combine=mr_combine,
                mr_layer=mr_layer, pl_router=pl_router, pl_dispatch=pl_dispatch, pl_combine=pl_combine,
                pl_layer=pl_layer)


def pick_torch_experts() -> str:
    """``grouped_mm`` when torch._grouped_mm runs forward and backward here and matches a per-expert loop
    (unaligned group sizes, an empty group), else ``loop``."""
    import torch

    try:
        s = Shape(40, 64, 4, 2, 32)
        g = torch.Generator(device="cuda").manual_seed(0)
        xs = torch.randn(s.N, s.H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        ws = [(torch.randn(s.E, *sh, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
              for sh in ((s.F, s.H), (s.F, s.H), (s.H, s.F))]
        offs = torch.tensor([13, 13, 50, 80], device="cuda", dtype=torch.int32)
        gy = torch.randn(s.N, s.H, device="cuda", dtype=torch.bfloat16, generator=g)
        outs = []
        for kind in ("grouped_mm", "loop"):
            y = torch_parts(s, kind)["experts"](xs, offs, *ws)
            outs.append([y.float()] + [t.float() for t in torch.autograd.grad(y, [xs, *ws], gy)])
        ok = all(torch.allclose(a, b, rtol=3e-2, atol=3e-2) for a, b in zip(*outs))
        return "grouped_mm" if ok else "loop"
    except Exception as e:  # noqa: BLE001 - any failure: fall back to the loop
        print(f"torch._grouped_mm unusable here ({type(e).__name__}: {e}); per-expert loop", flush=True)
        return "loop"


def torch_step(fwd, inputs, cots):
    """A callable running ``fwd(*inputs)`` then the gradients of its differentiable outputs (the first
    ``len(cots)``) w.r.t. the inputs that require grad."""
    import torch

    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        out = fwd(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        return out, torch.autograd.grad(out[:len(cots)], wrt, cots)

    return step


def bench_torch(s: Shape, args, table, save):
    import torch

    kind = pick_torch_experts()
    table.meta["torch experts"] = ("torch._grouped_mm" if kind == "grouped_mm" else "per-expert loop (host sync)")
    table.meta["torch"] = torch.__version__
    P = torch_parts(s, kind)
    g = torch.Generator(device="cuda").manual_seed(0)
    T, E, K, H, F, N = s.T, s.E, s.K, s.H, s.F, s.N

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16, grad=True):
        t = (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)
        return t.requires_grad_() if grad else t

    x, wr = rnd(T, H), rnd(H, E, scale=H ** -0.5)
    w1, w3, w2 = rnd(E, F, H, scale=H ** -0.5), rnd(E, F, H, scale=H ** -0.5), rnd(E, H, F, scale=F ** -0.5)
    gy = rnd(T, H, grad=False)
    one = torch.ones((), device="cuda")
    it = dict(iters=args.iters, warmup=args.warmup)
    compile_ok = not args.no_compile
    times = {}
    add = row_adder(table, times, "moe_rt (torch)", lambda fn: benchlib.time_cuda(fn, **it), save)

    layer_cots = [gy, one]
    impls = [("moe_rt (torch)", P["mr_layer"]), ("torch eager", P["pl_layer"])]
    if compile_ok:
        impls += [("torch.compile", torch.compile(P["pl_layer"])),
                  ("moe_rt + torch.compile", torch.compile(P["mr_layer"]))]
    for impl, f in impls:
        add("layer step", impl, torch_step(f, (x, wr, w1, w3, w2), layer_cots))

    # stage inputs, as inside the layer
    with torch.no_grad():
        probs, _, rmap = P["mr_router"](x, wr)
        xs_m, plan = P["mr_dispatch"](x, rmap)
        w, _, idx = P["pl_router"](x, wr)
        xs_p, order, offs = P["pl_dispatch"](x, idx)
    b = s.stage_bytes()
    ys = rnd(N, H)
    g_probs = rnd(T, E, dtype=torch.float32, grad=False)
    g_w = rnd(T, K, dtype=torch.float32, grad=False)
    g_xs = rnd(N, H, grad=False)
    probs_g = probs.detach().requires_grad_()
    w_g = w.detach().requires_grad_()
    stages = {
        "router": [("moe_rt (torch)", P["mr_router"], (x, wr), [g_probs, one]),
                   ("torch eager", P["pl_router"], (x, wr), [g_w, one])],
        "dispatch": [("moe_rt (torch)", P["mr_dispatch"], (x, rmap), [g_xs]),
                     ("torch eager", P["pl_dispatch"], (x, idx), [g_xs])],
        "combine": [("moe_rt (torch)", P["mr_combine"], (ys, plan, probs_g), [gy]),
                    ("torch eager", P["pl_combine"], (ys, order, w_g), [gy])],
        "experts": [("moe_rt (torch)", P["experts"], (xs_m.detach().requires_grad_(), plan.seg_start[1:], w1, w3, w2),
                     [g_xs]),
                    ("torch eager", P["experts"], (xs_p.detach().requires_grad_(), offs, w1, w3, w2), [g_xs])],
    }
    if compile_ok:
        for part, key in (("router", "pl_router"), ("dispatch", "pl_dispatch"), ("combine", "pl_combine")):
            plain = stages[part][1]
            stages[part].append(("torch.compile", torch.compile(P[key]), plain[2], plain[3]))
    for part, rows in stages.items():
        for impl, f, inputs, cots in rows:
            add(f"{part} fwd+bwd", impl, torch_step(f, inputs, cots), b.get(part))
    summary_rows(table, times, ["moe_rt (torch)", "torch eager", "torch.compile"], "moe_rt (torch)", save)
    del x, wr, w1, w3, w2, P, stages
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()


def row_adder(table, times, base_impl, timer, save):
    """``add(part, impl, fn, nbytes=None)``: time ``fn`` with ``timer``, record it in ``times`` and add a row
    (GB/s and % copy when ``nbytes`` is given; the ratio to ``base_impl`` of the same part)."""

    def add(part, impl, fn, nbytes=None):
        try:
            ms = timer(fn)
        except Exception as e:  # noqa: BLE001 - report and go on with the other rows
            print(f"{part} / {impl} failed: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            return None
        times[(part, impl)] = ms
        row = {"part": part, "impl": impl, "ms": ms}
        if nbytes:
            gbs = nbytes / (ms * 1e-3) / 1e9
            row.update({"GB/s": gbs, "% copy": 100 * gbs / table.meta["copy GB/s"]})
        base = times.get((part, base_impl))
        if base and impl != base_impl:
            row["x moe_rt"] = ms / base
        table.add(**row)
        save()
        return ms

    return add


def summary_rows(table, times, impls, base_impl, save):
    """router+dispatch+combine as the sum of the isolated stages, and layer step - experts."""
    parts = ["router fwd+bwd", "dispatch fwd+bwd", "combine fwd+bwd"]
    sums = {}
    for impl in impls:
        if all((p, impl) in times for p in parts):
            sums[impl] = sum(times[(p, impl)] for p in parts)
    for impl, ms in sums.items():
        row = {"part": "router+dispatch+combine (sum of stages)", "impl": impl, "ms": ms}
        if impl != base_impl and base_impl in sums:
            row["x moe_rt"] = ms / sums[base_impl]
        table.add(**row)
    inside = {}
    for impl in impls:
        if ("layer step", impl) in times and ("experts fwd+bwd", impl) in times:
            inside[impl] = times[("layer step", impl)] - times[("experts fwd+bwd", impl)]
    for impl, ms in inside.items():
        row = {"part": "layer step - experts fwd+bwd", "impl": impl, "ms": ms}
        if impl != base_impl and base_impl in inside:
            row["x moe_rt"] = ms / inside[base_impl]
        table.add(**row)
    save()


# ---- JAX --------------------------------------------------------------------------------------------------

def jax_grouped_matmul(block=256):
    """``gmm(lhs[N, H], rhs[G, H, F], group_sizes[G]) -> [N, F]``: ``jax.lax.ragged_dot`` with a VJP whose
    weight gradient works block by block. XLA's own gradient of ragged_dot with respect to ``rhs`` builds a
    dense ``[G, N, H]`` operand (32 GiB at the benchmark's shape, more than an H100 holds). Here the rows of
    each group are cut into blocks of ``block`` rows (the last one masked), and a scan adds
    ``lhs_block^T @ grad_block`` (fp32) into the group's slice: at most ``N // block + G`` blocks, no buffer
    beyond the fp32 gradient itself. The input gradient is a ragged_dot with the transposed weights."""
    import jax
    import jax.numpy as jnp

    def weight_grad(lhs, g, gs, G):
        N, H = lhs.shape
        F = g.shape[1]
        gs = gs.astype(jnp.int32)
        start = jnp.cumsum(gs) - gs
        nblk = (gs + block - 1) // block
        first = jnp.cumsum(nblk) - nblk
        M = N // block + G  # sum of ceil(gs / block) <= N / block + G
        item = jnp.arange(M, dtype=jnp.int32)
        grp = jnp.minimum(jnp.searchsorted(jnp.cumsum(nblk), item, side="right"), G - 1).astype(jnp.int32)
        j = item - first[grp]
        row0 = start[grp] + j * block
        nrows = jnp.where(item < nblk.sum(), jnp.clip(gs[grp] - j * block, 0, block), 0)
        pad = lambda a: jnp.concatenate([a, jnp.zeros((block, a.shape[1]), a.dtype)])  # noqa: E731
        lhs_p, g_p = pad(lhs), pad(g)  # a slice that starts in range never gets shifted back

        def body(acc, i):
            keep = (jnp.arange(block) < nrows[i])[:, None]
            a = jnp.where(keep, jax.lax.dynamic_slice_in_dim(lhs_p, row0[i], block), 0)
            b = jax.lax.dynamic_slice_in_dim(g_p, row0[i], block)
            prod = jnp.dot(a.T, b, preferred_element_type=jnp.float32)
            cur = jax.lax.dynamic_index_in_dim(acc, grp[i], keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(acc, cur + prod, grp[i], 0), None

        acc, _ = jax.lax.scan(body, jnp.zeros((G, H, F), jnp.float32), item)
        return acc

    @jax.custom_vjp
    def gmm(lhs, rhs, gs):
        return jax.lax.ragged_dot(lhs, rhs, gs)

    def fwd(lhs, rhs, gs):
        return gmm(lhs, rhs, gs), (lhs, rhs, gs)

    def bwd(res, g):
        lhs, rhs, gs = res
        g = g.astype(lhs.dtype)
        dlhs = jax.lax.ragged_dot(g, jnp.swapaxes(rhs, 1, 2), gs).astype(lhs.dtype)
        drhs = weight_grad(lhs, g, gs, rhs.shape[0]).astype(rhs.dtype)
        return dlhs, drhs, None

    gmm.defvjp(fwd, bwd)
    return gmm


def jax_capacity_matmul(capacity: int):
    """``gmm(lhs[N, H], rhs[G, H, F], group_sizes[G]) -> [N, F]`` as dense batched matmuls over a static
    capacity of ``capacity`` rows per group, forward and backward (custom VJP). With ragged_dot's own
    forward and input gradient (``jax_grouped_matmul``), XLA on an H100 (JAX 0.11.2) tried a 32 GiB dense
    [E, N, H] buffer and the moe_rt layer step took 539 ms at the benchmark's shape; here no intermediate
    has a [G, N] prefix. Group g owns rows start[g] .. start[g] + gs[g] - 1 (start: exclusive
    cumsum); its rows are gathered into slot [g, :gs[g]] of a [G, C, *] array (the other slots read 0), the
    product is an einsum over G with fp32 accumulation, and row n reads its slot back (a gather, so no
    scatter). Rows past sum(gs) give 0 output and 0 gradient. A group longer than C loses its rows past C:
    the caller sizes C from the real group sizes. Largest buffers: the fp32 products [G, C, F] / [G, C, H]
    and the fp32 [G, H, F] weight gradient."""
    import jax
    import jax.numpy as jnp

    C = int(capacity)
    if C <= 0:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")

    def index(gs, N):
        """(slot -> row [G, C], N where the slot is empty; row -> flat slot [N], G * C past the groups)."""
        G = gs.shape[0]
        gs = gs.astype(jnp.int32)
        ends = jnp.cumsum(gs)
        start = ends - gs
        c = jnp.arange(C, dtype=jnp.int32)
        rows = jnp.where(c < gs[:, None], start[:, None] + c, N)
        n = jnp.arange(N, dtype=jnp.int32)
        g = jnp.searchsorted(ends, n, side="right").astype(jnp.int32)  # G past the last group
        j = n - start[jnp.minimum(g, G - 1)]
        slot = jnp.where((g < G) & (j < C), g * C + j, G * C)
        return rows, slot

    def gather(a, rows):  # [N, X] -> [G, C, X], empty slots 0
        return jnp.take(a, rows, axis=0, mode="fill", fill_value=0)

    def ungather(v, slot):  # [G, C, X] -> [N, X], rows past the groups 0
        return jnp.take(v.reshape(-1, v.shape[-1]), slot, axis=0, mode="fill", fill_value=0)

    @jax.custom_vjp
    def gmm(lhs, rhs, gs):
        rows, slot = index(gs, lhs.shape[0])
        out = jnp.einsum("gch,ghf->gcf", gather(lhs, rows), rhs, preferred_element_type=jnp.float32)
        return ungather(out.astype(lhs.dtype), slot)

    def fwd(lhs, rhs, gs):
        return gmm(lhs, rhs, gs), (lhs, rhs, gs)  # the gathers are cheap to redo; [G, C, H] is not kept

    def bwd(res, g):
        lhs, rhs, gs = res
        rows, slot = index(gs, lhs.shape[0])
        g_c = gather(g.astype(lhs.dtype), rows)
        dlhs = jnp.einsum("gcf,ghf->gch", g_c, rhs, preferred_element_type=jnp.float32)
        drhs = jnp.einsum("gch,gcf->ghf", gather(lhs, rows), g_c, preferred_element_type=jnp.float32)
        return ungather(dlhs.astype(lhs.dtype), slot), drhs.astype(rhs.dtype), None

    gmm.defvjp(fwd, bwd)
    return gmm


def jax_parts(s: Shape, experts_kind: str = "capacity", capacity: int | None = None):
    """The JAX layers' stages. ``capacity`` (rows per expert, a static int) is needed by the "capacity"
    experts only; without it the router and dispatch stages still run (they give the group sizes)."""
    import jax
    import jax.numpy as jnp

    import moe_rt.jax as mj

    T, E, K = s.T, s.E, s.K
    c_aux = E * COEFF / K / T / T
    if experts_kind == "capacity":
        mm = jax_capacity_matmul(capacity) if capacity is not None else None
    else:
        mm = jax_grouped_matmul() if experts_kind == "blocked" else jax.lax.ragged_dot

    def experts(xs, gs, w1, w3, w2):
        if mm is None:
            raise ValueError("capacity experts need jax_parts(..., capacity=C)")
        h = jax.nn.silu(mm(xs, w1, gs)) * mm(xs, w3, gs)
        return mm(h.astype(xs.dtype), w2, gs).astype(xs.dtype)

    router, mr_dispatch, combine = moe_rt_stages(mj, s, lambda a: a.astype(jnp.float32),
                                                 lambda m: m.sum(0).astype(jnp.int32))

    def mr_router(x, wr):  # (differentiable outputs), non-differentiable ones: the form jax.vjp takes
        probs, aux, rmap = router(x, wr)
        return (probs, aux), rmap

    def mr_combine(ys, probs, plan):
        return combine(ys, plan, probs)

    def mr_layer(x, wr, w1, w3, w2):
        (probs, aux), rmap = mr_router(x, wr)
        xs, plan = mr_dispatch(x, rmap)
        return mr_combine(experts(xs, plan.counts, w1, w3, w2), probs, plan), aux

    def pl_router(x, wr):
        logits = x.astype(jnp.float32) @ wr.astype(jnp.float32)
        v, idx = jax.lax.top_k(logits, K)
        w = jax.nn.softmax(v, -1)
        sc = jax.nn.softmax(logits, -1)
        _, si = jax.lax.top_k(sc, K)
        tpe = jax.lax.stop_gradient(jnp.zeros_like(sc).at[jnp.arange(T)[:, None], si].set(1.0).sum(0))
        return (w, c_aux * (sc.sum(0) * tpe).sum()), idx

    def pl_dispatch(x, idx):
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        gs = jnp.bincount(flat, length=E).astype(jnp.int32)
        return x[order // K], (order, gs)

    def pl_combine(ys, w, order):
        inv = jnp.argsort(order)
        return (ys[inv].reshape(T, K, -1).astype(jnp.float32) * w[..., None]).sum(1).astype(ys.dtype)

    def pl_layer(x, wr, w1, w3, w2):
        (w, aux), idx = pl_router(x, wr)
        xs, (order, gs) = pl_dispatch(x, idx)
        return pl_combine(experts(xs, gs, w1, w3, w2), w, order), aux

    return dict(experts=experts, mr_router=mr_router, mr_dispatch=mr_dispatch, mr_combine=mr_combine,
                mr_layer=mr_layer, pl_router=pl_router, pl_dispatch=pl_dispatch, pl_combine=pl_combine,
                pl_layer=pl_layer)


def jax_capacity(P, s: Shape, x, wr, multiple=128):
    """Rows per expert for ``jax_capacity_matmul``: the largest group of either layer for the fixed inputs
    (the moe_rt plan's counts, the plain layer's bincount; both route by top-K of the fp32 logits), rounded
    up to ``multiple``. Raises unless it covers every group: a longer group would lose rows."""
    import jax

    def sizes(router, dispatch, take):
        return np.asarray(jax.jit(lambda x_, wr_: take(dispatch(x_, router(x_, wr_)[1])[1]))(x, wr))

    groups = {"moe_rt": sizes(P["mr_router"], P["mr_dispatch"], lambda plan: plan.counts),
              "plain": sizes(P["pl_router"], P["pl_dispatch"], lambda aux: aux[1])}
    C = -(-max(int(g.max()) for g in groups.values()) // multiple) * multiple
    for name, g in groups.items():
        if g.shape != (s.E,) or int(g.sum()) != s.N or int(g.max()) > C:
            raise RuntimeError(f"{name} layer: group sizes {g.tolist()} (sum {int(g.sum())}, want {s.N}) "
                               f"not covered by capacity {C}")
    print(f"JAX expert capacity C={C} (largest group: moe_rt {int(groups['moe_rt'].max())}, "
          f"plain {int(groups['plain'].max())}; mean {s.N // s.E})", flush=True)
    return C


def jax_step(fwd, n_diff, has_aux):
    """jit(forward + VJP): ``fwd(*diff_args, *other_args)``; returns (outputs, grads of the diff args)."""
    import jax

    def step(diff, other, cots):
        out = jax.vjp(lambda *d: fwd(*d, *other), *diff, has_aux=has_aux)
        primal, vjp_fn, aux = out[0], out[1], (out[2] if has_aux else None)
        return (primal, aux), vjp_fn(cots)

    return jax.jit(step)


def time_wall(fn, iters, warmup):
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def bench_jax(s: Shape, args, table, save):
    import jax
    import jax.numpy as jnp

    table.meta["jax"] = jax.__version__
    table.meta["jax experts"] = {
        "capacity": "dense batched matmuls over a static per-expert capacity C, forward and backward "
                    "(jax_capacity_matmul)",
        "blocked": "jax.lax.ragged_dot, weight gradient by blocks (jax_grouped_matmul)",
        "ragged": "jax.lax.ragged_dot with XLA's gradient"}[args.jax_experts]
    P = jax_parts(s, args.jax_experts)
    T, E, K, H, F, N = s.T, s.E, s.K, s.H, s.F, s.N
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    bf = jnp.bfloat16

    def rnd(shape, scale=1.0, dtype=bf):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    x, wr = rnd((T, H)), rnd((H, E), H ** -0.5)
    w1, w3, w2 = rnd((E, H, F), H ** -0.5), rnd((E, H, F), H ** -0.5), rnd((E, F, H), F ** -0.5)
    gy = rnd((T, H))
    one = jnp.ones((), jnp.float32)
    if args.jax_experts == "capacity":  # C is a static shape: taken from the fixed inputs before any trace
        C = jax_capacity(P, s, x, wr)
        table.meta["jax expert capacity C"] = C
        P = jax_parts(s, "capacity", capacity=C)
    times = {}
    add = row_adder(table, times, "moe_rt (jax.jit)", lambda fn: time_wall(fn, args.iters, args.warmup),
                     save)

    params = (x, wr, w1, w3, w2)
    for impl, f in (("moe_rt (jax.jit)", P["mr_layer"]), ("jax.jit", P["pl_layer"])):
        st = jax_step(f, 5, False)
        add("layer step", impl, lambda st=st: st(params, (), (gy, one)))

    (probs, _), rmap = jax.jit(P["mr_router"])(x, wr)
    xs_m, plan = jax.jit(P["mr_dispatch"])(x, rmap)
    (w, _), idx = jax.jit(P["pl_router"])(x, wr)
    xs_p, (order, gs) = jax.jit(P["pl_dispatch"])(x, idx)
    ys = rnd((N, H))
    g_probs, g_w, g_xs = rnd((T, E), dtype=jnp.float32), rnd((T, K), dtype=jnp.float32), rnd((N, H))
    b = s.stage_bytes()
    stages = {
        "router": [("moe_rt (jax.jit)", P["mr_router"], (x, wr), (), (g_probs, one), True),
                   ("jax.jit", P["pl_router"], (x, wr), (), (g_w, one), True)],
        "dispatch": [("moe_rt (jax.jit)", P["mr_dispatch"], (x,), (rmap,), g_xs, True),
                     ("jax.jit", P["pl_dispatch"], (x,), (idx,), g_xs, True)],
        "combine": [("moe_rt (jax.jit)", P["mr_combine"], (ys, probs), (plan,), gy, False),
                    ("jax.jit", P["pl_combine"], (ys, w), (order,), gy, False)],
        "experts": [("moe_rt (jax.jit)", P["experts"], (xs_m, plan.counts, w1, w3, w2), (), g_xs, False),
                    ("jax.jit", P["experts"], (xs_p, gs, w1, w3, w2), (), g_xs, False)],
    }
    for part, rows in stages.items():
        for impl, f, diff, other, cots, has_aux in rows:
            if part == "experts":  # group sizes are integer: pass them as a non-differentiable argument
                diff, other = (diff[0],) + diff[2:], (diff[1],)
                f = (lambda f: lambda xs_, a, b_, c, gs_: f(xs_, gs_, a, b_, c))(f)
            st = jax_step(f, len(diff), has_aux)
            add(f"{part} fwd+bwd", impl, lambda st=st, d=diff, o=other, c=cots: st(d, o, c), b.get(part))
    summary_rows(table, times, ["moe_rt (jax.jit)", "jax.jit"], "moe_rt (jax.jit)", save)


# ---- adapter overhead ---------------------------------------------------------------------------------------

def device_us(fn, iters=50):
    """Device us per call of ``fn`` with the host hidden (bench_router.time_device). ``iters`` calls a batch:
    a chain of many launches takes fewer, since once the driver's launch queue (about a thousand launches) is
    full the host waits and the GPU idles behind it (seen as 2x a chain's kernel time at 50 calls of 40 ops)."""
    from moe_rt.bench.router import time_device

    return time_device(fn, iters) * 1e3


def interleaved_us(fns, n=100, reps=7):
    """Wall us per call of each ``(name, fn, sync)``, timed in turns: each of ``reps`` rounds times a batch of
    ``n`` back-to-back calls of every fn, ended by its ``sync()``, the order rotated from round to round, so
    that the host's drift (these machines' host speed moves by 2x within minutes) hits all of them alike.
    Medians over the rounds, with Python's garbage collector paused as ``timeit`` does."""
    fns = list(fns)
    for _, fn, sync in fns:
        for _ in range(10):
            fn()
        sync()
    per = {name: [] for name, _, _ in fns}
    gc.collect()
    gc.disable()
    try:
        for r in range(reps):
            k = r % len(fns)
            for name, fn, sync in fns[k:] + fns[:k]:
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                sync()
                per[name].append((time.perf_counter() - t0) / n * 1e6)
    finally:
        gc.enable()
    return {name: statistics.median(v) for name, v in per.items()}


PAIRED_REPS = 11  # rounds of the adapter / direct turns of an overhead row


def overhead_rows(table, save, framework, cases, adapter_sync, direct_sync, adapter_gpu=True):
    """One row per (op, pass, adapter call, direct call): host us per call of the adapter and the direct call
    timed in turns (:func:`interleaved_us`), device us per call, and the overhead per adapter call (a fwd+bwd
    pass makes two). ``adapter_sync(fn)`` gives ``(fn to time, its sync)``; ``direct_sync`` is the direct
    calls' sync."""
    for op, pas, adapter, direct, *floor in cases:
        try:
            a_fn, a_sync = adapter_sync(adapter)
            timed = [("a", a_fn, a_sync), ("d", direct, direct_sync)]
            if floor:  # the framework's floor for this op, timed in the same turns
                timed.append(("f",) + adapter_sync(floor[0]))
            us = interleaved_us(timed, n=100, reps=PAIRED_REPS)
            a_host, d_host = us["a"], us["d"]
            a_dev = device_us(a_fn) if adapter_gpu else None
            d_dev = device_us(direct)
        except Exception as e:  # noqa: BLE001 - report and go on with the other rows
            print(f"overhead {framework} {op} {pas} failed: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            continue
        calls = 2 if pas == "fwd+bwd" else 1
        if floor:
            table.add(framework=framework, op=f"(no-op custom call with {op}'s inputs and outputs)",
                      **{"pass": pas, "adapter us": us["f"]})
        table.add(framework=framework, op=op, **{"pass": pas, "adapter us": a_host, "direct us": d_host,
                                                 "overhead us/call": (a_host - d_host) / calls,
                                                 "adapter GPU us": a_dev, "direct GPU us": d_dev})
        save()


_NOOP = {}


def _noop_py(x):
    return x.new_empty((0,))


def _noop_op(x):
    """torch's floor for a custom op: one registered with torch.library that does nothing."""
    op = _NOOP.get("op")
    if op is None:
        import torch

        op = _NOOP["op"] = torch.library.custom_op("moe_rt_bench::noop", mutates_args=(),
                                                   schema="(Tensor x) -> Tensor")(_noop_py)
        op.register_fake(_noop_py)
    return op(x)


def _empty_functions():
    """torch's floors: (an autograd.Function that does nothing, one with the outputs of topk_with_score: one
    differentiable output of three)."""
    fns = _NOOP.get("functions")
    if fns is not None:
        return fns
    import torch

    class _Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g

    class _Three(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.set_materialize_grads(False)
            m, i = a.new_empty(a.shape, dtype=torch.bool), a.new_empty(a.shape)
            ctx.mark_non_differentiable(m, i)
            ctx.save_for_backward(m, i)
            return a.view_as(a), m, i

        @staticmethod
        def backward(ctx, g, gm, gi):
            return g

    fns = _NOOP["functions"] = (_Identity, _Three)
    return fns


def _bare_functions():
    """The least an autograd.Function wrapper of the moe_rt calls does (dispatch, combine, top-k): its forward
    and backward call moe_rt and keep what the backward needs, nothing else (no checks, one fixed plan and
    score function). Timed in a graph, the part of the adapters' cost that any Function wrapper pays."""
    fns = _NOOP.get("bare")
    if fns is not None:
        return fns
    import torch

    import moe_rt

    class _BareD(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, plan):
            ctx.plan = plan
            return moe_rt.dispatch(x, plan)[0]

        @staticmethod
        def backward(ctx, g):
            return moe_rt.dispatch_backward(g, ctx.plan)[0], None

    class _BareC(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, probs, plan):
            ctx.plan = plan
            ctx.save_for_backward(y, probs)
            return moe_rt.combine(y, plan, probs)

        @staticmethod
        def backward(ctx, g):
            y, probs = ctx.saved_tensors
            gy, gp = moe_rt.combine_backward(g, ctx.plan, y, probs)
            return gy, gp, None

    class _BareTopk(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, k):
            ctx.set_materialize_grads(False)
            probs, m, i = moe_rt.topk_with_score(logits, k)
            ctx.k = k
            ctx.mark_non_differentiable(m, i)
            ctx.save_for_backward(m, i)
            return probs, m, i

        @staticmethod
        def backward(ctx, g, gm, gi):
            m, i = ctx.saved_tensors
            return moe_rt.topk_with_score_backward(g, m, i, ctx.k, score_function="softmax"), None

    fns = _NOOP["bare"] = (_BareD, _BareC, _BareTopk)
    return fns


def bench_overhead_torch(table, save, T=128, H=1024, E=64, K=8):
    import torch

    import moe_rt
    import moe_rt.torch as mt

    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(T, E, device="cuda", generator=g)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    probs, rmap, inter = moe_rt.topk_with_score(logits, K)
    scores, smap, s_inter = moe_rt.scores_for_aux_loss(logits, K, "softmax")
    tpe = smap.sum(0, dtype=torch.int32)
    core_plan = moe_rt.make_plan(rmap, E, num_out_tokens=T * K)
    t_plan = mt.make_plan(rmap, E, num_out_tokens=T * K)
    ys = torch.randn(T * K, H, device="cuda", generator=g).bfloat16()
    gy, g_ys, g_probs = torch.randn_like(x), torch.randn_like(ys), torch.randn_like(probs)
    lg, xg, ysg, pg = (t.clone().requires_grad_() for t in (logits, x, ys, probs))
    sync = torch.cuda.synchronize  # the direct calls run on torch's current stream, as the adapters do

    def grad(out, wrt, cot):
        return torch.autograd.grad(out, wrt, cot)

    cases = [
        ("topk_with_score", "fwd", lambda: mt.topk_with_score(logits, K), lambda: moe_rt.topk_with_score(logits, K)),
        ("scores_for_aux_loss", "fwd", lambda: mt.scores_for_aux_loss(logits, K, "softmax"),
         lambda: moe_rt.scores_for_aux_loss(logits, K, "softmax")),
        ("aux_loss", "fwd", lambda: mt.aux_loss(scores, tpe, T, E, K, COEFF),
         lambda: moe_rt.aux_loss(scores, tpe, T, E, K, COEFF)),
        ("make_plan", "fwd", lambda: mt.make_plan(rmap, E, num_out_tokens=T * K),
         lambda: moe_rt.make_plan(rmap, E, num_out_tokens=T * K)),
        ("dispatch", "fwd", lambda: mt.dispatch(x, t_plan), lambda: moe_rt.dispatch(x, core_plan)),
        ("combine", "fwd", lambda: mt.combine(ys, t_plan, probs), lambda: moe_rt.combine(ys, core_plan, probs)),
        ("topk_with_score", "fwd+bwd", lambda: grad(mt.topk_with_score(lg, K)[0], lg, g_probs),
         lambda: moe_rt.topk_with_score_backward(g_probs, *moe_rt.topk_with_score(logits, K)[1:], K,
                                                 score_function="softmax")),
        ("dispatch", "fwd+bwd", lambda: grad(mt.dispatch(xg, t_plan)[0], xg, g_ys),
         lambda: (moe_rt.dispatch(x, core_plan), moe_rt.dispatch_backward(g_ys, core_plan))),
        ("combine", "fwd+bwd", lambda: grad(mt.combine(ysg, t_plan, pg), (ysg, pg), gy),
         lambda: (moe_rt.combine(ys, core_plan, probs), moe_rt.combine_backward(gy, core_plan, ys, probs))),
    ]
    cases.append(("(empty custom op)", "fwd", lambda: _noop_op(x), lambda: _noop_py(x)))

    _Identity, _Three = _empty_functions()
    # torch's floor for a fwd+bwd pass: autograd.grad through a Function that does nothing (the autograd
    # engine's own cost, which every differentiable op pays)
    cases.append(("(empty autograd.Function)", "fwd+bwd", lambda: grad(_Identity.apply(xg), xg, gy), lambda: None))
    cases.append(("(empty autograd.Function, 3 outputs)", "fwd+bwd", lambda: grad(_Three.apply(lg)[0], lg, g_probs),
                  lambda: None))
    overhead_rows(table, save, "torch", cases, lambda f: (f, sync), sync)
    in_graph_chain_torch(table, save, dict(x=x, probs=probs, logits=logits, gy=gy, g_probs=g_probs), t_plan,
                         core_plan, K, sync)


def _direct_chain_fwd_bwd(x, plan, probs, gy):
    """The direct moe_rt calls of ``CHAIN`` rounds of dispatch + combine, forward then backward in reverse,
    with the probs gradients summed as autograd sums them (the baseline of the in-graph / in-jit rows)."""
    import moe_rt

    y, saved = x, []
    for _ in range(CHAIN):
        xp = moe_rt.dispatch(y, plan)[0]
        saved.append(xp)
        y = moe_rt.combine(xp, plan, probs)
    g, gp_sum = gy, None
    for xp in reversed(saved):
        gxp, gp = moe_rt.combine_backward(g, plan, xp, probs)
        gp_sum = gp if gp_sum is None else gp_sum + gp
        g = moe_rt.dispatch_backward(gxp, plan)[0]
    return g, gp_sum


def _chain_row(table, save, framework, op, what, ops, adapter_us, direct_us, gpu_us=None):
    """One 'in one graph / jit' row: us per op (a fwd+bwd op is two calls: its forward and its backward);
    ``gpu_us``: the direct calls' device time per op, if measured."""
    calls = 2 if "fwd+bwd" in what else 1
    a, d = adapter_us / ops, direct_us / ops
    table.add(framework=framework, op=op, **{"pass": what, "adapter us": a, "direct us": d,
                                             "overhead us/call": (a - d) / calls, "direct GPU us": gpu_us})
    save()


def in_graph_chain_torch(table, save, t, t_plan, core_plan, K, sync):
    """Per call inside one autograd graph, as in a training step (the autograd engine starts once for the
    whole chain): ``CHAIN`` rounds of dispatch + combine with gradients to x and probs, and ``2 * CHAIN``
    top-k ops on one logits tensor, each differentiated by one ``autograd.grad``. Against the same graphs
    of empty autograd.Functions (torch's floor) and the direct moe_rt calls (forward chain, then the
    backward chain in reverse with the shared input's gradients summed, as autograd does)."""
    import torch

    import moe_rt
    import moe_rt.torch as mt

    x, probs, logits, gy, g_probs = t["x"], t["probs"], t["logits"], t["gy"], t["g_probs"]
    xg, pg, lg = (a.clone().requires_grad_() for a in (x, probs, logits))
    n = 2 * CHAIN
    p_zero = torch.zeros_like(probs)

    def perm_adapter():
        y = xg
        for _ in range(CHAIN):
            y = mt.combine(mt.dispatch(y, t_plan)[0], t_plan, pg)
        return torch.autograd.grad(y, (xg, pg), gy)

    def perm_direct():
        return _direct_chain_fwd_bwd(x, core_plan, probs, gy)

    _EmptyD, _EmptyTopk = _empty_functions()

    class _EmptyC(torch.autograd.Function):  # two differentiable inputs, like combine
        @staticmethod
        def forward(ctx, a, p):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g, p_zero

    def perm_empty():
        y = xg
        for _ in range(CHAIN):
            y = _EmptyC.apply(_EmptyD.apply(y), pg)
        return torch.autograd.grad(y, (xg, pg), gy)

    _BareD, _BareC, _BareTopk = _bare_functions()

    def perm_bare():
        y = xg
        for _ in range(CHAIN):
            y = _BareC.apply(_BareD.apply(y, core_plan), pg, core_plan)
        return torch.autograd.grad(y, (xg, pg), gy)

    def topk_bare():
        outs = [_BareTopk.apply(lg, K)[0] for _ in range(n)]
        return torch.autograd.grad(outs, lg, [g_probs] * n)

    def topk_adapter():
        outs = [mt.topk_with_score(lg, K)[0] for _ in range(n)]
        return torch.autograd.grad(outs, lg, [g_probs] * n)

    def topk_empty():
        outs = [_EmptyTopk.apply(lg)[0] for _ in range(n)]
        return torch.autograd.grad(outs, lg, [g_probs] * n)

    def topk_direct():
        res = [moe_rt.topk_with_score(logits, K) for _ in range(n)]
        g_sum = None
        for _, m, i in res:
            g = moe_rt.topk_with_score_backward(g_probs, m, i, K, score_function="softmax")
            g_sum = g if g_sum is None else g_sum + g
        return g_sum

    what = f"fwd+bwd, in one graph ({n} ops)"
    try:
        us = interleaved_us([(name, f, sync) for name, f in (("perm", perm_adapter), ("perm direct", perm_direct),
                                                              ("perm empty", perm_empty), ("perm bare", perm_bare))],
                            n=10, reps=15)
        us.update(interleaved_us([(name, f, sync) for name, f in (("topk", topk_adapter), ("topk direct", topk_direct),
                                                                   ("topk empty", topk_empty), ("topk bare", topk_bare))],
                                 n=10, reps=15))
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"in-graph chain failed: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        return
    _chain_row(table, save, "torch", "(empty autograd.Function)", what, n, us["perm empty"], 0.0)
    _chain_row(table, save, "torch", "(bare autograd.Function over the moe_rt calls)", what, n, us["perm bare"],
               us["perm direct"])
    _chain_row(table, save, "torch", "dispatch / combine", what, n, us["perm"], us["perm direct"])
    _chain_row(table, save, "torch", "(empty autograd.Function, 3 outputs)", what, n, us["topk empty"], 0.0)
    _chain_row(table, save, "torch", "(bare autograd.Function over topk_with_score)", what, n, us["topk bare"],
               us["topk direct"])
    _chain_row(table, save, "torch", "topk_with_score", what, n, us["topk"], us["topk direct"])


def bench_overhead_jax(table, save, T=128, H=1024, E=64, K=8):
    import cupy
    import jax
    import jax.numpy as jnp

    import moe_rt
    import moe_rt.jax as mj

    keys = iter(jax.random.split(jax.random.PRNGKey(1), 8))
    logits = jax.random.normal(next(keys), (T, E), jnp.float32)
    x = jax.random.normal(next(keys), (T, H), jnp.float32).astype(jnp.bfloat16)
    ys = jax.random.normal(next(keys), (T * K, H), jnp.float32).astype(jnp.bfloat16)
    probs, rmap = jax.jit(lambda l: mj.topk_with_score(l, K))(logits)
    plan = jax.jit(lambda r: mj.make_plan(r, E, num_out_tokens=T * K))(rmap)
    gy, g_ys, g_probs = x * 0.5, ys * 0.5, probs * 0.5
    jax.block_until_ready((probs, plan, gy, g_ys, g_probs))
    # the same buffers as CuPy arrays for the direct calls
    c = {k: cupy.from_dlpack(v) for k, v in dict(logits=logits, x=x, ys=ys, probs=probs, rmap=rmap, gy=gy,
                                                   g_ys=g_ys, g_probs=g_probs).items()}
    c_plan = moe_rt.make_plan(c["rmap"], E, num_out_tokens=T * K)
    _, c_map, c_inter = moe_rt.topk_with_score(c["logits"], K)

    def csync():
        cupy.cuda.get_current_stream().synchronize()

    topk_j = jax.jit(lambda l: mj.topk_with_score(l, K))
    disp_j = jax.jit(lambda x_, p: mj.dispatch(x_, p)[0])
    comb_j = jax.jit(lambda y_, p, pr: mj.combine(y_, p, pr))
    plan_j = jax.jit(lambda r: mj.make_plan(r, E, num_out_tokens=T * K))
    topk_vjp = jax.jit(lambda l, g: jax.vjp(lambda l_: mj.topk_with_score(l_, K)[0], l)[1](g))
    disp_vjp = jax.jit(lambda x_, p, g: jax.vjp(lambda a: mj.dispatch(a, p)[0], x_)[1](g))
    comb_vjp = jax.jit(lambda y_, p, pr, g: jax.vjp(lambda a, b_: mj.combine(a, p, b_), y_, pr)[1](g))
    # JAX's floor for each op: a jitted custom call of a registered XLA FFI handler that does nothing, with the
    # op's inputs and outputs (the router, plan, dispatch and combine lower to one such call each)
    from moe_rt import _xla

    _xla.library()

    def noop_like(jf, *args):
        leaves = jax.tree_util.tree_leaves(args)
        specs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in jax.tree_util.tree_leaves(jax.eval_shape(jf, *args))]
        floor = jax.jit(lambda *a: jax.ffi.ffi_call(_xla.target("noop"), specs)(*a))
        return lambda: floor(*leaves)

    cases = [
        ("topk_with_score", "fwd", lambda: topk_j(logits), lambda: moe_rt.topk_with_score(c["logits"], K),
         noop_like(topk_j, logits)),
        ("make_plan", "fwd", lambda: plan_j(rmap), lambda: moe_rt.make_plan(c["rmap"], E, num_out_tokens=T * K),
         noop_like(plan_j, rmap)),
        ("dispatch", "fwd", lambda: disp_j(x, plan), lambda: moe_rt.dispatch(c["x"], c_plan),
         noop_like(disp_j, x, plan)),
        ("combine", "fwd", lambda: comb_j(ys, plan, probs), lambda: moe_rt.combine(c["ys"], c_plan, c["probs"]),
         noop_like(comb_j, ys, plan, probs)),
        ("topk_with_score", "fwd+bwd", lambda: topk_vjp(logits, g_probs),
         lambda: (moe_rt.topk_with_score(c["logits"], K),
                  moe_rt.topk_with_score_backward(c["g_probs"], c_map, c_inter, K, score_function="softmax"))),
        ("dispatch", "fwd+bwd", lambda: disp_vjp(x, plan, g_ys),
         lambda: (moe_rt.dispatch(c["x"], c_plan), moe_rt.dispatch_backward(c["g_ys"], c_plan))),
        ("combine", "fwd+bwd", lambda: comb_vjp(ys, plan, probs, gy),
         lambda: (moe_rt.combine(c["ys"], c_plan, c["probs"]),
                  moe_rt.combine_backward(c["gy"], c_plan, c["ys"], c["probs"]))),
    ]
    def adapter_sync(adapter):
        holder = {}

        def call():
            holder["out"] = adapter()

        return call, lambda: jax.block_until_ready(holder["out"])

    overhead_rows(table, save, "jax", cases, adapter_sync, csync, adapter_gpu=False)
    in_jit_chain(table, save, x, plan, probs, gy, c, c_plan, csync)


CHAIN = 20  # rounds of dispatch + combine in one jitted program


def in_jit_chain(table, save, x, plan, probs, gy, c, c_plan, csync):
    """Per op inside one jitted program (as in a training step): ``CHAIN`` rounds of dispatch + combine,
    against the same chain of no-op XLA FFI custom calls with the same buffers, XLA element-wise ops, the
    direct moe_rt calls on CuPy views, and the device time of those calls' kernels (host hidden): issue 31's
    target is the jitted chain within 2 us an op of its kernels."""
    import jax

    import moe_rt
    import moe_rt.jax as mj
    from moe_rt import _xla

    def chain_moe(x_, p, pr):
        for _ in range(CHAIN):
            x_ = mj.combine(mj.dispatch(x_, p)[0], p, pr)
        return x_

    noop = _xla.target("noop")

    def chain_empty(x_, p, pr):
        for _ in range(CHAIN):
            y_ = jax.ffi.ffi_call(noop, jax.ShapeDtypeStruct((p.num_rows, x_.shape[1]), x_.dtype))(x_, *p.arrays)
            x_ = jax.ffi.ffi_call(noop, jax.ShapeDtypeStruct(x_.shape, x_.dtype))(y_, pr, *p.arrays)
        return x_

    def chain_xla(x_, p, pr):
        for _ in range(2 * CHAIN):
            x_ = (x_ * 1.001).astype(x_.dtype)
        return x_

    def direct():
        y_ = c["x"]
        for _ in range(CHAIN):
            y_ = moe_rt.combine(moe_rt.dispatch(y_, c_plan)[0], c_plan, c["probs"])
        return y_

    def blocked(f):
        jf = jax.jit(f)
        return lambda: jax.block_until_ready(jf(x, plan, probs))

    # fwd+bwd: the chain differentiated in the same jitted program (gradients to x and probs), against the
    # direct forward chain, then the backward chain in reverse with the probs gradients summed
    def chain_moe_vjp(x_, p, pr, g):
        return jax.vjp(lambda a, b: chain_moe(a, p, b), x_, pr)[1](g)

    def chain_empty2(x_, p, pr, g):  # as many empty callbacks as the fwd+bwd chain makes
        return chain_empty(chain_empty(x_, p, pr), p, pr)

    def direct_fb():
        return _direct_chain_fwd_bwd(c["x"], c_plan, c["probs"], c["gy"])

    def blocked_fb(f):
        jf = jax.jit(f)
        return lambda: jax.block_until_ready(jf(x, plan, probs, gy))

    n = 2 * CHAIN
    try:
        none = lambda: None  # noqa: E731 - the blocked calls return when their results are ready
        us = interleaved_us([("moe", blocked(chain_moe), none), ("empty", blocked(chain_empty), none),
                             ("xla", blocked(chain_xla), none), ("direct", direct, csync)], n=10, reps=15)
        moe_us, empty_us, xla_us, direct_us = (us[k] / n for k in ("moe", "empty", "xla", "direct"))
        us = interleaved_us([("moe", blocked_fb(chain_moe_vjp), none), ("empty", blocked_fb(chain_empty2), none),
                             ("direct", direct_fb, csync)], n=10, reps=15)
        fb_us, fb_empty_us, fb_direct_us = us["moe"], us["empty"], us["direct"]
        kernel_us, fb_kernel_us = device_us(direct, iters=5) / n, device_us(direct_fb, iters=5) / n
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"in-jit chain failed: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        return
    what = f"fwd, in one jit ({n} ops)"
    table.add(framework="jax", op="(no-op custom call)", **{"pass": what, "adapter us": empty_us,
                                                             "direct us": xla_us,
                                                             "overhead us/call": empty_us - xla_us})
    table.add(framework="jax", op="dispatch / combine", **{"pass": what, "adapter us": moe_us,
                                                           "direct us": direct_us,
                                                           "overhead us/call": moe_us - direct_us,
                                                           "direct GPU us": kernel_us})
    fb = f"fwd+bwd, in one jit ({n} ops)"
    _chain_row(table, save, "jax", "(no-op custom call)", fb, n, fb_empty_us, 0.0)
    _chain_row(table, save, "jax", "dispatch / combine", fb, n, fb_us, fb_direct_us, gpu_us=fb_kernel_us)


# ---- main -------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = benchlib.parser(__doc__.splitlines()[0])
    ap.add_argument("--ffn", type=benchlib.positive_int, default=1408, help="expert FFN size F")
    ap.add_argument("--frameworks", default="torch,jax", help="comma list of torch, jax")
    ap.add_argument("--overhead-only", action="store_true", help="only the adapter overhead table")
    ap.add_argument("--jax-experts", default="capacity", choices=["capacity", "blocked", "ragged"],
                    help="JAX experts: capacity = dense batched matmuls over a static per-expert capacity "
                         "(jax_capacity_matmul, default; C from the real group sizes); blocked = ragged_dot "
                         "with the weight gradient by blocks (jax_grouped_matmul); ragged = ragged_dot with "
                         "XLA's gradient (on an H100 at the default shape: blocked 539 ms per moe_rt layer step "
                         "with a 32 GiB allocation attempt, out of memory in the plain layer)")
    args = ap.parse_args(argv)
    unknown = sorted({f for f in args.frameworks.split(",") if f} - {"torch", "jax"})
    if unknown or not args.frameworks.strip(","):
        ap.error(f"--frameworks: expected a comma list of torch, jax, got {args.frameworks!r}")
    benchlib.require_gpu(ap.prog)
    if args.quick:
        s = Shape(2048, 1024, 64, 8, 512)
        args.iters, args.warmup = min(args.iters, 10), min(args.warmup, 3)
    else:
        s = Shape(8192, 4096, 64, 8, args.ffn)
    fws = [f for f in args.frameworks.split(",") if f]
    table = benchlib.Table(f"MoE layer step (forward + backward), T={s.T} H={s.H} E={s.E} K={s.K} "
                           f"F={s.F}, bf16", COLUMNS)
    table.meta["copy GB/s"] = round(benchlib.copy_bandwidth(), 1)
    table.meta["timing"] = (f"median of {args.iters} steps after {args.warmup} warm-up; torch: CUDA events on "
                            f"torch's stream; JAX: wall clock to block_until_ready of the jitted step")
    table.meta["x moe_rt"] = "time of the row / time of moe_rt in the same framework (> 1: moe_rt faster)"
    over = benchlib.Table("moe_rt adapter overhead per call, T=128 H=1024 E=64 K=8", OVERHEAD_COLUMNS)
    over.meta["timing"] = ("us per call: the adapter and the direct call timed in turns, the median over 11 "
                           "rounds of one batch of 100 back-to-back calls each (the order rotated per round), "
                           "each batch ended by one sync, garbage collector paused (host-bound at this size); "
                           "the chains of a row and its floor likewise, 15 rounds of 10; GPU us: device time per "
                           "call with the host hidden behind a spin kernel; "
                           "overhead = (adapter - direct) / ops in the pass; direct = the moe_rt op on the "
                           "same torch tensors, or on CuPy views of the JAX buffers; 'in one jit' / 'in one graph' "
                           "rows: us per op of a chain of 40 ops (dispatch and combine; top-k) in one jitted "
                           "call, blocked on, or differentiated by one autograd.grad (fwd+bwd: an op is two "
                           "calls; the empty custom op / autograd.Function and no-op custom call rows are the "
                           "frameworks' floors: direct = an XLA element-wise op, or nothing; each jax fwd row "
                           "has its floor above it (a no-op custom call with its inputs and outputs, timed in the "
                           "same turns); the in-jit dispatch / combine rows' direct GPU us: the "
                           "kernels' device time an op; the bare autograd.Function rows: "
                           "Functions whose forward and backward call the moe_rt ops and nothing else, the "
                           "floor of any autograd.Function wrapper of them)")
    out_path = args.json
    over_path = None
    if out_path:
        root, ext = os.path.splitext(out_path)
        over_path = f"{root}_overhead{ext or '.json'}"

    def save():
        import json

        for t, p in ((table, out_path), (over, over_path)):
            if p:
                with open(p, "w") as f:
                    json.dump({"meta": t.meta, "rows": t.rows}, f, indent=1)

    table.header()
    t_start = time.perf_counter()
    layer_fws = [] if args.overhead_only else [fw for fw in ("torch", "jax") if fw in fws]
    over_fws = [fw for fw in ("torch", "jax") if fw in fws]
    benchlib.progress_start("layer", len(layer_fws) + len(over_fws))
    for fw in layer_fws:
        try:
            (bench_torch if fw == "torch" else bench_jax)(s, args, table, save)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        benchlib.progress_advance(f"{fw} layer")
    print(f"(layer rows took {time.perf_counter() - t_start:.0f} s)", flush=True)
    over.header()
    for fw in over_fws:
        try:
            (bench_overhead_torch if fw == "torch" else bench_overhead_jax)(over, save)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        benchlib.progress_advance(f"{fw} adapter overhead")
    if not benchlib.QUIET:
        print(f"\n## {table.title}\n" + table.markdown())
        print(f"\n## {over.title}\n" + over.markdown())
        print_targets(table, over)
    save()


def print_targets(table, over):
    t = {(r["part"], r["impl"]): r["ms"] for r in table.rows}
    key = "router+dispatch+combine (sum of stages)"
    print("\ntargets:")
    for base, impl, need in (("moe_rt (torch)", "torch eager", 2.0), ("moe_rt (jax.jit)", "jax.jit", 1.3),
                             ("moe_rt (torch)", "jax.jit", 1.3)):
        for part in (key, "layer step - experts fwd+bwd"):
            if (part, base) in t and (part, impl) in t:
                x = t[(part, impl)] / t[(part, base)]
                print(f"  {part}: {base} vs {impl}: {x:.2f}x (target >= {need}x) "
                      f"{'met' if x >= need else 'MISSED'}")
    overhead_targets(over.rows)


def overhead_targets(rows):
    """Print the adapter targets (issue 31) against the overhead table's ``rows``: a torch forward at most 3 us
    over the direct call; fwd+bwd in one autograd graph at most 3 us a call over an empty autograd.Function of
    the same outputs; a single jitted JAX op at its floor (a no-op custom call with its inputs and outputs) and,
    inside one jitted program, at most 2 us an op over its kernels."""
    def get(fw, op, pas):
        return next((r for r in rows if r["framework"] == fw and r["op"] == op and r["pass"] == pas), None)

    def line(what, value, limit, unit="us"):
        print(f"  {what}: {value:.1f} {unit} (target <= {limit:g}) {'met' if value <= limit else 'MISSED'}")

    for r in rows:
        if r["framework"] == "torch" and r["pass"] == "fwd" and not r["op"].startswith("("):
            line(f"torch {r['op']} fwd over the direct call", r["overhead us/call"], 3.0)
    graph = [p for p in dict.fromkeys(r["pass"] for r in rows) if "in one graph" in p]
    for pas in graph:
        for op, floor in (("dispatch / combine", "(empty autograd.Function)"),
                          ("topk_with_score", "(empty autograd.Function, 3 outputs)")):
            r, f = get("torch", op, pas), get("torch", floor, pas)
            if r and f:
                line(f"torch {op} {pas} over {floor} a call", r["overhead us/call"] - f["overhead us/call"], 3.0)
    for r in rows:
        if r["framework"] != "jax" or r["op"].startswith("("):
            continue
        if r["pass"] == "fwd":
            f = get("jax", f"(no-op custom call with {r['op']}'s inputs and outputs)", "fwd")
            if f:
                line(f"jax jitted {r['op']} over its no-op custom call", r["adapter us"] - f["adapter us"], 0.0)
        elif "in one jit" in r["pass"] and r.get("direct GPU us") is not None:
            line(f"jax {r['op']} {r['pass']} over its kernels an op", r["adapter us"] - r["direct GPU us"], 2.0)


if __name__ == "__main__":
    main()
