"""Per-rank worker of the multi-GPU EP tests; run under the launcher, one process per GPU:

    python tools/launch.py -n R tests/ep_worker.py correctness|graph|dead_peer|transports|graph_transports|dead_peer_direct|direct_lifecycle|fp8|mixed|graph_mixed|dead_peer_mixed|torch_direct|jax_direct

Any world size R >= 2 (token counts are spread over the ranks; expert counts are multiples of R).

Every rank draws every rank's inputs from the same seed, runs its own share on its GPU through EpGroup,
and compares with the NumPy R-rank reference (moe_rt.reference.ep). Prints "ALL OK" (or "DEAD PEER OK")
on success; any mismatch raises, so the rank exits non-zero and the launcher fails.

Transfer configurations: MOE_RT_EP_TEST_CHUNKS (default "o4,s1,o1,2"): a chunk count (EpGroup ``chunks``),
prefixed "s" for the serial path (``overlap=False``) or "o" for the overlapped one (``overlap=True``), all
on the NCCL transport; or "d", the direct peer-memory transport. ``transports`` and ``graph_transports``
run "d,s1,o2" (direct first, against the reference; the NCCL ones bitwise against it). "m<n>": the group
made with ``transport="auto", local_size=n`` (nodes of n ranks): the mixed transport (peer memory within a
node, NCCL between nodes) for n < R, the direct one for n = R; ``mixed``, ``graph_mixed`` and
``dead_peer_mixed`` run it for n in {1, R/2, R}.
Every case runs with the first configuration against the reference and with the others bitwise against
the first; the graph test captures one graph per configuration. The part-size floor is lifted so that the
small test shapes are really split.

MOE_RT_EP_WORKER_STACKS=S: after S seconds every thread's Python stack is printed and the rank exits (status 1),
to see where a hanging rank waits (also inside a CUDA or NCCL call).
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHUNKS = os.environ.get("MOE_RT_EP_TEST_CHUNKS", "o4,s1,o1,2").split(",")


TRANSPORT_CHUNKS = ["d", "s1", "o2"]


def cfg(c):
    """EpGroup keywords of a configuration string ("4", "s1", "o2": NCCL; "d": direct; "m2": local_size 2)."""
    if c == "d":
        return {"transport": "direct"}
    if c.startswith("m"):
        return {"transport": "auto", "local_size": int(c[1:])}
    return {"chunks": int(c.lstrip("so")), "overlap": {"s": False, "o": True}.get(c[:1]), "transport": "nccl"}


def transport_of(c):
    """The ``group.transport`` a configuration string gives (on a machine whose GPUs all see each other)."""
    if c.startswith("m"):
        return "mixed" if int(c[1:]) < WORLD else "direct"
    return cfg(c)["transport"]


def mixed_configs():
    """"m<n>" for the node sizes n in {1, R/2 (when integral and new), R}: every code path of the mixed group."""
    sizes = sorted({1, WORLD} | ({WORLD // 2} if WORLD % 2 == 0 else set()))
    return [f"m{n}" for n in sizes]


def experts(n):
    """n experts, or the next multiple of the world size."""
    return n if n % WORLD == 0 else WORLD * -(-n // WORLD)


def spread(Ts):
    """Token counts for every rank from a pattern: rank r gets Ts[r % len] less 3 per round (0 stays 0)."""
    return tuple(max(1, Ts[r % len(Ts)] - 3 * (r // len(Ts))) if Ts[r % len(Ts)] else 0 for r in range(WORLD))
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
DEV = int(os.environ.get("LOCAL_RANK", RANK))


def log(*a):
    print(*a, flush=True)


def setup():
    import cupy as cp

    cp.cuda.Device(DEV).use()
    from moe_rt import _ep_nccl
    from moe_rt.bootstrap import init_communicator

    _ep_nccl._MIN_CHUNK_BYTES = 0  # split even the smallest transfers into parts

    return cp, init_communicator(method="file")


def routing(rng, T, E, K, kind):
    from test_ep import make_routing

    return make_routing(rng, T, E, K, kind)


def bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _np(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def close(name, got, want, dtype):
    got, want = _np(got), _np(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if np.dtype(dtype) == np.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
    else:
        tol = dict(rtol=2e-2, atol=2e-2)
    g, w = got.astype(np.float64), want.astype(np.float64)
    if not np.allclose(g, w, **tol):
        bad = np.argwhere(~np.isclose(g, w, **tol))[:5]
        raise AssertionError(f"{name}: mismatch at {bad.tolist()}: {g[tuple(bad[0])]} vs {w[tuple(bad[0])]}")


def same(name, got, want):
    got, want = _np(got), _np(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    g = got.view(np.uint8) if got.dtype.itemsize == 2 else got
    w = want.view(np.uint8) if want.dtype.itemsize == 2 else want
    if not np.array_equal(g, w):
        if g.ndim == 0 or g.size == 0:
            raise AssertionError(f"{name}: not bitwise equal")
        bad = np.flatnonzero((g.reshape(g.shape[0], -1) != w.reshape(w.shape[0], -1)).any(axis=1))
        g, w = got, want
        raise AssertionError(f"{name}: not bitwise equal: {bad.size} of {g.shape[0]} rows differ, first "
                             f"{bad[:8].tolist()}; row {bad[0]}: {g[bad[0]].ravel()[:6]} vs {w[bad[0]].ravel()[:6]}")


# The handle regions prepare (and dispatch) fill, compared with the CPU path's handle of the same plan
# (recv_wk is left out: capacity mode leaves the weights of unused rows unspecified).
PLAN_REGIONS = ("meta", "routing", "send_tok", "send_pos", "recv_tok", "recv_local", "dst_row", "src_slot",
                "seg_start", "expert_counts", "tokens_per_expert")


def same_handle(name, h, d):
    """The CUDA handle ``h`` holds, region by region, what the CPU path writes for the reference plan ``d``
    of this rank (moe_rt.reference.ep.prepare)."""
    from moe_rt import _handle, ep

    sz = h.sizes
    lay, total = _handle.layout(sz["R"], sz["L"], sz["Tmax"], sz["K"], sz["P"], sz["rows"], sz["N"])
    assert lay == h.layout and total == h.nbytes, (name, lay, h.layout)
    want = _handle.Handle(np.zeros(total, np.uint8), lay, h.group_id, h.mode, sz)
    ep._fill_from_reference(want, d)
    for region in PLAN_REGIONS:
        same(f"{name}: handle region {region}", h.view(region), want.view(region))


def poison(cp, nbytes):
    """CuPy's pool holding only blocks of ``nbytes`` of 0xFF (NaN bits): test_ep._poison_pool."""
    from test_ep import _poison_pool

    _poison_pool(cp, nbytes)


def same_filled(name, got, want, filled):
    """zero_empty_slots=False: the filled expert-major rows (``filled``: the reference plan's src_slot >= 0) of
    ``got`` bitwise equal to ``want``'s; the empty rows were not written (some still hold the poison)."""
    a, b = _np(got), _np(want)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    a, b = a.view(np.uint8).reshape(a.shape[0], -1), b.view(np.uint8).reshape(b.shape[0], -1)
    if not np.array_equal(a[filled], b[filled]):
        raise AssertionError(f"{name}: filled rows not bitwise equal")
    if (~filled).any() and a.shape[1] and not (a[~filled] == 0xFF).all(axis=1).any():
        raise AssertionError(f"{name}: no empty row holds the poison (zero_empty_slots=False writes none)")


def no_zero(cp, g, h, xd, wd, rx, rw, tpe, d, tag):
    """dispatch(zero_empty_slots=False) into a pool poisoned with NaN bits beside the default dispatch's ``rx``,
    ``rw``, ``tpe`` (checked against the reference): the filled rows bitwise equal, the empty ones unwritten,
    the same weights and counts; combine and dispatch_bwd of the rows it returns (garbage rows included) bitwise
    equal to those of ``rx`` (they read the filled rows only)."""
    N = int(rx.shape[0])
    filled = np.asarray(d["plan"]["src_slot"])[:N] >= 0
    poison(cp, rx.nbytes)
    nx, nw, ntpe = g.dispatch(h, xd, wd, zero_empty_slots=False)
    same_filled(f"no-zero recv_x {tag}", nx, rx, filled)
    same(f"no-zero recv_w {tag}", nw, rw)
    same(f"no-zero tokens_per_local_expert {tag}", ntpe, tpe)
    for weighted in (True, False):
        same(f"combine of no-zero rows w={weighted} {tag}", g.combine(h, nx, weighted=weighted),
             g.combine(h, rx, weighted=weighted))
    for name, a, b in zip(("x", "w"), g.dispatch_bwd(h, nx, nw), g.dispatch_bwd(h, rx, rw)):
        same(f"dispatch_bwd {name} of no-zero rows {tag}", a, b)


def one_case(cp, comm, seed, E, K, H, Ts, Tmax, kind, mode, align, dtype, chunks=None):
    from moe_rt.ep import EpGroup
    from moe_rt.reference import ep as ref

    chunks = CHUNKS if chunks is None else chunks
    Ts = spread(Ts)
    rng = np.random.default_rng(seed)
    idx = [routing(rng, T, E, K, kind) for T in Ts]
    x = [rng.standard_normal((T, H)).astype(np.float32).astype(dtype) for T in Ts]
    w = [rng.random((T, K)).astype(np.float32) for T in Ts]
    L = E // WORLD
    kw = {} if mode == "exact" else {"pair_capacity": Tmax, "capacity": WORLD * Tmax * min(K, L)}
    hs = ref.prepare(idx, E, align_size=align, **kw)
    routs = ref.dispatch(hs, x, w)
    g = EpGroup(comm, E, H, Tmax, mode=mode, align_size=align, timeout=60, **cfg(chunks[0]))
    assert g.transport == transport_of(chunks[0]), (g.transport, chunks[0])
    assert g.local_size == cfg(chunks[0]).get("local_size", g.local_size), (g.local_size, chunks[0])
    h = g.prepare(cp.asarray(idx[RANK]))
    tag = f"[{kind} {mode} A={align} {np.dtype(dtype).name} H={H} T={Ts}]"
    same_handle(f"prepare {tag}", h, hs[RANK])
    out_bytes = int(routs[RANK][0].shape[0]) * H * np.dtype(dtype).itemsize  # the expert-major rows [N,H]
    if mode == "capacity":  # the rows holding no slot must be written as zeros: start from NaN bits
        poison(cp, out_bytes)
    rx, rw, tpe = g.dispatch(h, cp.asarray(x[RANK]), cp.asarray(w[RANK]))
    same_handle(f"dispatch {tag}", h, hs[RANK])
    same(f"recv_x {tag}", rx, routs[RANK][0])
    same(f"recv_w {tag}", rw, routs[RANK][1])
    same(f"tokens_per_local_expert {tag}", tpe, routs[RANK][2])
    assert not h.overflow()
    if mode == "capacity":
        no_zero(cp, g, h, cp.asarray(x[RANK]), cp.asarray(w[RANK]), rx, rw, tpe, hs[RANK], f"{tag} {chunks[0]}")
    y = [rng.standard_normal(o[0].shape).astype(np.float32).astype(dtype) for o in routs]
    gout = [rng.standard_normal((T, H)).astype(np.float32).astype(dtype) for T in Ts]
    gw = [rng.standard_normal(o[1].shape).astype(np.float32) for o in routs]
    yd = cp.asarray(y[RANK])
    for weighted in (True, False):
        out = g.combine(h, yd, weighted=weighted)
        close(f"combine w={weighted} {tag}", out, ref.combine(hs, y, weighted=weighted)[RANK], dtype)
        same(f"combine determinism {tag}", out, g.combine(h, yd, weighted=weighted))
    gx, gwt = g.dispatch_bwd(h, yd, cp.asarray(gw[RANK]))
    rgx, rgw = ref.dispatch_bwd(hs, y, gw)[RANK]
    close(f"dispatch_bwd x {tag}", gx, rgx, dtype)
    same(f"dispatch_bwd w {tag}", gwt, rgw)
    gx2, none = g.dispatch_bwd(h, yd)
    assert none is None
    same(f"dispatch_bwd x without w {tag}", gx2, gx)
    god = cp.asarray(gout[RANK])
    if mode == "capacity":
        poison(cp, out_bytes)
    gy, grw = g.combine_bwd(h, god, yd, weighted=True)
    rgy, rgrw = ref.combine_bwd(hs, gout, y, weighted=True)[RANK]
    same(f"combine_bwd y {tag}", gy, rgy)
    close(f"combine_bwd w {tag}", grw, rgrw, np.float32 if np.dtype(dtype) == np.float32 else dtype)
    gy2, none = g.combine_bwd(h, god, None, weighted=True)
    assert none is None
    same(f"combine_bwd y without y {tag}", gy2, gy)
    gy3, _ = g.combine_bwd(h, god, weighted=False)
    same(f"combine_bwd unweighted {tag}", gy3, ref.combine_bwd(hs, gout, weighted=False)[RANK][0])
    got = {"recv_x": rx, "recv_w": rw, "dispatch_bwd x": gx, "dispatch_bwd w": gwt, "combine_bwd y": gy,
           "combine_bwd w": grw, "combine_bwd y without y": gy2, "combine_bwd unweighted": gy3}
    for c in chunks[1:]:
        # the same ops with another chunk count or transport: bitwise the same results
        g2 = EpGroup(comm, E, H, Tmax, mode=mode, align_size=align, timeout=60, **cfg(c))
        assert g2.transport == transport_of(c), (g2.transport, c)
        h2 = g2.prepare(cp.asarray(idx[RANK]))
        t2 = f"{tag} chunks={c} vs {chunks[0]}"
        same_handle(f"prepare {t2}", h2, hs[RANK])
        if mode == "capacity":
            poison(cp, out_bytes)
        rx2, rw2, tpe2 = g2.dispatch(h2, cp.asarray(x[RANK]), cp.asarray(w[RANK]))
        other = {"recv_x": rx2, "recv_w": rw2}
        same(f"tokens_per_local_expert {t2}", tpe2, tpe)
        if mode == "capacity":
            no_zero(cp, g2, h2, cp.asarray(x[RANK]), cp.asarray(w[RANK]), rx2, rw2, tpe2, hs[RANK], t2)
        for weighted in (True, False):
            same(f"combine w={weighted} {t2}", g2.combine(h2, yd, weighted=weighted), g.combine(h, yd, weighted=weighted))
        other["dispatch_bwd x"], other["dispatch_bwd w"] = g2.dispatch_bwd(h2, yd, cp.asarray(gw[RANK]))
        other["combine_bwd y"], other["combine_bwd w"] = g2.combine_bwd(h2, god, yd, weighted=True)
        other["combine_bwd y without y"], _ = g2.combine_bwd(h2, god, None, weighted=True)
        other["combine_bwd unweighted"], _ = g2.combine_bwd(h2, god, weighted=False)
        for k, v in got.items():
            same(f"{k} {t2}", other[k], v)
        h2.close()
        g2.close()
    h.close()
    g.close()


def correctness(cp, comm):
    f32, b16, f16 = np.float32, bf16(), np.float16
    n = 0
    for mode in ("exact", "capacity"):
        for kind, Ts in (("uniform", (48, 37)), ("skewed", (64, 20)), ("one", (30, 41)), ("holes", (33, 50)),
                         ("uniform", (40, 0)), ("holes", (0, 0))):
            for align, dtype, H in ((1, f32, 256), (8, b16, 512), (1, f16, 100)):
                one_case(cp, comm, 1000 + n, experts(16), 4, H, Ts, 64, kind, mode, align, dtype)
                n += 1
    # K > L, E = R
    one_case(cp, comm, 7, WORLD, 2, 64, (10, 12), 16, "uniform", "exact", 1, f32)
    one_case(cp, comm, 8, experts(8), 6, 64, (10, 12), 16, "holes", "capacity", 4, b16)
    # many local experts: prepare's received side in ep_prepare_recv and the permutation plan's kernels
    # (ep_prepare_plan's shared memory would not hold R*L offsets)
    one_case(cp, comm, 9, WORLD * 4096, 3, 64, (10, 12), 16, "uniform", "capacity", 2, f32)
    one_case(cp, comm, 10, WORLD * 4096, 2, 64, (9, 13), 16, "holes", "exact", 1, b16)
    # capacity overflow is flagged, never silent
    from moe_rt.ep import EpGroup

    g = EpGroup(comm, experts(4), 64, 32, mode="capacity", capacity=10, timeout=60, **cfg(CHUNKS[0]))
    idx = np.full((32, 2), -1, np.int32)
    idx[:, 0] = 0
    h = g.prepare(cp.asarray(idx))
    rx, _, tpe = g.dispatch(h, cp.ones((32, 64), cp.float32))
    if RANK == 0:
        assert h.overflow()
        try:
            g.check_overflow(h)
            raise AssertionError("no overflow error")
        except RuntimeError as e:
            assert "overflow" in str(e)
        assert int(tpe.get()[0]) == 10
    else:
        assert not h.overflow()
    log(f"{n + 5} cases OK")


def graph(cp, comm, chunks=None, replays=100, memory=True):
    from moe_rt.ep import EpGroup
    from moe_rt.reference import ep as ref

    E, K, H, Tmax = experts(16), 4, 256, 128
    dtype = bf16()
    L = E // WORLD
    chunks = CHUNKS if chunks is None else chunks
    groups = [EpGroup(comm, E, H, Tmax, mode="capacity", timeout=60, **cfg(c)) for c in chunks]
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    # one pool per captured graph, used for nothing else: the memory a capture frees (the ops' scratch) is
    # still its graph's at replay, so it must not be handed out again (CuPy has no graph-private pools)
    graph_pools = [cp.cuda.MemoryPool() for _ in chunks]

    def inputs(seed):
        rng = np.random.default_rng(seed)
        idx = [routing(rng, Tmax, E, K, "holes") for _ in range(WORLD)]
        x = [rng.standard_normal((Tmax, H)).astype(np.float32).astype(dtype) for _ in range(WORLD)]
        w = [rng.random((Tmax, K)).astype(np.float32) for _ in range(WORLD)]
        return idx, x, w

    with cp.cuda.using_allocator(pool.malloc), stream:
        idx, x, w = inputs(0)
        s_idx, s_x, s_w = cp.asarray(idx[RANK]), cp.asarray(x[RANK]), cp.asarray(w[RANK])

        def step(g):
            h = g.prepare(s_idx)
            rx, rw, tpe = g.dispatch(h, s_x, s_w)
            out = g.combine(h, rx, weighted=True)
            gx, gwt = g.dispatch_bwd(h, rx, rw)
            gy, _ = g.combine_bwd(h, out, weighted=False)
            return h, rx, rw, tpe, out, gx, gwt, gy

        eagers, graphs, outs = [], [], []
        for g, gp in zip(groups, graph_pools):
            eagers.append(step(g))
            stream.synchronize()
            with cp.cuda.using_allocator(gp.malloc):
                stream.begin_capture()
                outs.append(step(g))
                graphs.append(stream.end_capture())
        eager, captured, gr = eagers[0], outs[0], graphs[0]
    kw = {"pair_capacity": Tmax, "capacity": WORLD * Tmax * min(K, L)}
    first = None
    for i in range(replays):
        idx, x, w = inputs(i)
        s_idx.set(idx[RANK], stream=stream)
        s_x.set(x[RANK], stream=stream)
        s_w.set(w[RANK], stream=stream)
        for gg in graphs:
            gg.launch(stream)
        stream.synchronize()
        for c, o in zip(chunks[1:], outs[1:]):
            for j, name in enumerate(("recv_x", "recv_w", "tpe", "combine", "dispatch_bwd x", "dispatch_bwd w",
                                      "combine_bwd y"), start=1):
                same(f"graph {name} chunks={c} vs {chunks[0]} {i}", o[j], captured[j])
        hs = ref.prepare(idx, E, **kw)
        routs = ref.dispatch(hs, x, w)
        for c, o in zip(chunks, outs):
            same_handle(f"graph handle chunks={c} {i}", o[0], hs[RANK])
        _, rx, rw, tpe, out = captured[:5]
        same(f"graph recv_x {i}", rx, routs[RANK][0])
        same(f"graph recv_w {i}", rw, routs[RANK][1])
        same(f"graph tpe {i}", tpe, routs[RANK][2])
        close(f"graph combine {i}", out, ref.combine(hs, [o[0] for o in routs], weighted=True)[RANK], dtype)
        if i == 0:
            first = out.get()
    # bitwise identical across replays and against the eager run with the same inputs
    idx, x, w = inputs(0)
    s_idx.set(idx[RANK], stream=stream)
    s_x.set(x[RANK], stream=stream)
    s_w.set(w[RANK], stream=stream)
    gr.launch(stream)
    stream.synchronize()
    same("graph replay determinism", captured[4], first)
    same("graph vs eager", captured[4], eager[4])
    log(f"graph: {replays} replays OK (chunks {chunks})")
    if not memory:
        for g in groups:
            g.close()
        return

    # 1000 eager iterations per mode: pool memory stays flat
    mp = cp.get_default_memory_pool()
    for mode in ("exact", "capacity"):
        g2 = EpGroup(comm, E, H, Tmax, mode=mode, timeout=60, **cfg(chunks[0]))
        rng = np.random.default_rng(5)
        d_idx = cp.asarray(routing(rng, 100, E, K, "uniform"))
        d_x = cp.asarray(rng.standard_normal((100, H)).astype(np.float32))
        d_w = cp.asarray(rng.random((100, K)).astype(np.float32))
        ref_out = None
        for it in range(1000):
            h = g2.prepare(d_idx)
            rx, rw, _ = g2.dispatch(h, d_x, d_w)
            out = g2.combine(h, rx)
            h.close()
            if it == 10:
                cp.cuda.Device().synchronize()
                base = mp.total_bytes()
                ref_out = out.get()
            if it == 999:
                same(f"1000 iterations determinism {mode}", out, ref_out)
        cp.cuda.Device().synchronize()
        assert mp.total_bytes() <= base, (mode, mp.total_bytes(), base)
    log("memory: 1000 iterations flat")


def dead_peer(cp, comm, direct=False, local_size=None):
    """Rank 1 leaves after prepare (NCCL transport) or skips the dispatch and stays alive (direct, and the mixed
    transport with nodes of ``local_size`` ranks: its peers must not write into a dead process's memory):
    every other rank's dispatch + synchronize raises within the group's timeout. The direct path's error
    names the op (on the mixed transport: on the ranks of rank 1's node; the other nodes' ranks see their
    NCCL exchange with it time out), and its group closes afterwards."""
    from moe_rt import NcclError
    from moe_rt.ep import EpGroup

    mixed = local_size is not None
    direct = direct or mixed
    timeout = 4.0 if direct else 20.0
    kw = {"transport": "auto", "local_size": local_size} if mixed else {"transport": "direct" if direct else "nccl"}
    g = EpGroup(comm, experts(4), 64, 32, timeout=timeout, **kw)
    if mixed:
        assert g.transport == "mixed" and f"local_size={local_size}" in repr(g), repr(g)
    elif direct:
        assert g.transport == "direct" and "transport='direct'" in repr(g), repr(g)
    # every rank sends rows to every rank, so each waits on rank 1 (a rank that exchanges nothing with it may
    # finish its dispatch: at R = 4, [0, 3] for every token left rank 2 none to wait for)
    t = np.arange(32)
    idx = np.stack([t % 4, (t + 1) % 4], axis=1).astype(np.int32)
    h = g.prepare(cp.asarray(idx))
    if direct:  # one dispatch together first: its receive stages exist, the next one meets a barrier alone
        g.dispatch(h, cp.ones((32, 64), cp.float32))
        g.synchronize()
    if RANK == 1:
        log("rank 1 skips the dispatch" if direct else "rank 1 leaves without dispatch")
        if direct:
            time.sleep(3 * timeout + 5)
        os._exit(0)
    if not direct:
        time.sleep(1.0)
    t0 = time.monotonic()
    try:
        g.dispatch(h, cp.ones((32, 64), cp.float32))
        g.synchronize()
        raise AssertionError("dispatch with a dead peer completed")
    except (TimeoutError,) + (() if direct and not mixed else (NcclError,)) as e:
        dt = time.monotonic() - t0
        log(f"got {type(e).__name__} after {dt:.1f} s: {e}")
        assert dt < (2 * timeout + 5 if direct else 60), dt
        node_peer = not mixed or RANK // local_size == 1 // local_size  # its waits on rank 1 are the barrier's
        assert not direct or not node_peer or "dispatch" in str(e) or (mixed and isinstance(e, NcclError)), e
        if mixed:  # NCCL work with the skipping rank may still be queued: no teardown
            log("DEAD PEER OK")
            os._exit(0)
    if direct:
        h.close()
        g.close()  # teardown after a failure: IPC mappings closed, buffers freed, no hang
    log("DEAD PEER OK")
    os._exit(0)  # the aborted communicator's stream may still hold NCCL work; skip teardown


def transports(cp, comm):
    """The direct transport against the reference, the NCCL transport bitwise against it: every op, both
    modes, vector and scalar row widths."""
    f32, b16, f16 = np.float32, bf16(), np.float16
    n = 0
    for mode in ("exact", "capacity"):
        for kind, Ts, align, dtype, H in (("uniform", (48, 37), 1, f32, 256), ("holes", (33, 0), 8, b16, 512),
                                          ("skewed", (64, 20), 1, f16, 100), ("one", (30, 41), 4, b16, 72)):
            one_case(cp, comm, 3000 + n, experts(16), 4, H, Ts, 64, kind, mode, align, dtype,
                     chunks=TRANSPORT_CHUNKS)
            n += 1
    one_case(cp, comm, 3100, experts(8), 6, 64, (10, 12), 16, "holes", "capacity", 4, b16, chunks=TRANSPORT_CHUNKS)
    log(f"transports: {n + 1} cases OK ({TRANSPORT_CHUNKS})")
    try:
        import torch  # noqa: F401
    except ImportError:
        log("transports: no torch, the direct transport's torch path skipped")
        return
    torch_direct(cp, comm)


def fp8_case(cp, comm, seed, E, K, H, Ts, Tmax, kind, mode, align, dtype, configs=None):
    """FP8 dispatch (EpGroup.dispatch(fp8=True)) on every transport configuration of ``configs`` (default
    TRANSPORT_CHUNKS): the
    e4m3 rows and scales bitwise equal to quantize_fp8 then the reference dispatch of the codes and of the
    scales; a pre-quantized uint8 pair (CuPy) gives the same bits; dequantize=True equals the reference
    dequantization; the received weights, weighted combine and dispatch_bwd after an FP8 dispatch equal
    those after a dispatch of x itself; every configuration bitwise equal to the first (direct)."""
    import torch

    from moe_rt.ep import EpGroup
    from moe_rt.reference import ep as ref
    from moe_rt.reference import fp8 as fref

    Ts = spread(Ts)
    rng = np.random.default_rng(seed)
    idx = [routing(rng, T, E, K, kind) for T in Ts]
    x = [(rng.standard_normal((T, H)) * rng.choice([1e-3, 1.0, 40.0], size=(T, 1))).astype(np.float32).astype(dtype)
         for T in Ts]
    w = [rng.random((T, K)).astype(np.float32) for T in Ts]
    L = E // WORLD
    kw = {} if mode == "exact" else {"pair_capacity": Tmax, "capacity": WORLD * Tmax * min(K, L)}
    hs = ref.prepare(idx, E, align_size=align, **kw)
    qs = [fref.quantize_fp8(xi) for xi in x]
    rq = ref.dispatch(hs, [q for q, _ in qs], w)[RANK]
    rs = ref.dispatch(hs, [s for _, s in qs])[RANK][0]
    rdq = fref.dequantize_fp8(rq[0], rs, dtype)
    outs = ref.dispatch(hs, x, w)  # last: the reference's weighted combine takes the weights of this one
    plain = outs[RANK]
    y = [rng.standard_normal(o[0].shape).astype(np.float32).astype(dtype) for o in outs]
    gw = [rng.standard_normal(o[1].shape).astype(np.float32) for o in outs]

    def to_torch(a):
        a = np.ascontiguousarray(a)
        t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype == bf16() else torch.from_numpy(a)
        return t.to(f"cuda:{DEV}")

    x_t, w_t = to_torch(x[RANK]), to_torch(w[RANK])
    torch.cuda.synchronize()
    tag = f"[fp8 {kind} {mode} A={align} {np.dtype(dtype).name} H={H} T={Ts}]"
    first = None
    configs = TRANSPORT_CHUNKS if configs is None else configs
    for c in configs:
        t = f"{tag} {c}"
        g = EpGroup(comm, E, H, Tmax, mode=mode, align_size=align, timeout=60, **cfg(c))
        assert g.transport == transport_of(c), (g.transport, c)
        h = g.prepare(cp.asarray(idx[RANK]))
        got = {}
        q_t, s_t, rw_t, tpe_t = g.dispatch(h, x_t, w_t, fp8=True)
        assert q_t.dtype == torch.float8_e4m3fn and s_t.dtype == torch.float32, (q_t.dtype, s_t.dtype)
        got["recv_x_fp8"] = cp.from_dlpack(q_t.view(torch.uint8))
        got["recv_scales"] = cp.from_dlpack(s_t)
        got["recv_w"] = cp.from_dlpack(rw_t)
        same(f"recv_x_fp8 {t}", got["recv_x_fp8"], rq[0].view(np.uint8))
        same(f"recv_scales {t}", got["recv_scales"], rs)
        same(f"recv_w {t}", got["recv_w"], rq[1])
        same(f"tokens_per_local_expert {t}", cp.from_dlpack(tpe_t), rq[2])
        # weighted combine and dispatch_bwd after the FP8 dispatch: the bf16 path, as after a dispatch of x
        yd, gwd = cp.asarray(y[RANK]), cp.asarray(gw[RANK])
        got["combine"] = g.combine(h, yd, weighted=True)
        got["dispatch_bwd x"], got["dispatch_bwd w"] = g.dispatch_bwd(h, yd, gwd)
        close(f"combine after fp8 {t}", got["combine"], ref.combine(hs, y, weighted=True)[RANK], dtype)
        rgx, rgw = ref.dispatch_bwd(hs, y, gw)[RANK]
        close(f"dispatch_bwd x after fp8 {t}", got["dispatch_bwd x"], rgx, dtype)
        same(f"dispatch_bwd w after fp8 {t}", got["dispatch_bwd w"], rgw)
        # a pre-quantized uint8 pair (CuPy): the same bits
        pq, ps, prw, _ = g.dispatch(h, (cp.asarray(qs[RANK][0].view(np.uint8)), cp.asarray(qs[RANK][1])),
                                    cp.asarray(w[RANK]), fp8=True)
        assert pq.dtype == np.uint8, pq.dtype
        same(f"pair recv_x_fp8 {t}", pq, rq[0].view(np.uint8))
        same(f"pair recv_scales {t}", ps, rs)
        same(f"pair recv_w {t}", prw, rq[1])
        # dequantized on the receiving side (into poisoned memory: the empty rows' zeros must be written)
        poison(cp, int(rq[0].shape[0]) * H * np.dtype(dtype).itemsize)
        dq, drw, _ = g.dispatch(h, cp.asarray(x[RANK]), cp.asarray(w[RANK]), fp8=True, dequantize=True)
        got["dequantized"] = dq
        same(f"dequantized {t}", dq, rdq)
        same(f"dequantized recv_w {t}", drw, rq[1])
        if mode == "capacity":  # zero_empty_slots=False: codes, scales and dequantized rows, filled rows only
            filled = np.asarray(hs[RANK]["plan"]["src_slot"])[:int(pq.shape[0])] >= 0
            pair_d = (cp.asarray(qs[RANK][0].view(np.uint8)), cp.asarray(qs[RANK][1]))
            wd, xd = cp.asarray(w[RANK]), cp.asarray(x[RANK])
            poison(cp, pq.nbytes)
            nq, ns, nrw, _ = g.dispatch(h, pair_d, wd, fp8=True, zero_empty_slots=False)
            same_filled(f"no-zero pair recv_x_fp8 {t}", nq, pq, filled)
            if not np.array_equal(_np(ns)[filled], _np(ps)[filled]):
                raise AssertionError(f"no-zero pair recv_scales {t}: filled rows not bitwise equal")
            same(f"no-zero pair recv_w {t}", nrw, rq[1])
            poison(cp, dq.nbytes)
            ndq, _, _ = g.dispatch(h, xd, wd, fp8=True, dequantize=True, zero_empty_slots=False)
            same_filled(f"no-zero dequantized {t}", ndq, dq, filled)
            same(f"combine of no-zero dequantized rows {t}", g.combine(h, ndq, weighted=True),
                 g.combine(h, dq, weighted=True))
        # the same ops after a dispatch of x itself give the same bits
        bx, bw, _ = g.dispatch(h, cp.asarray(x[RANK]), cp.asarray(w[RANK]))
        same(f"bf16 dispatch beside fp8 {t}", bx, plain[0])
        same(f"combine after bf16 vs fp8 {t}", g.combine(h, yd, weighted=True), got["combine"])
        gx2, gw2 = g.dispatch_bwd(h, yd, gwd)
        same(f"dispatch_bwd x after bf16 vs fp8 {t}", gx2, got["dispatch_bwd x"])
        same(f"dispatch_bwd w after bf16 vs fp8 {t}", gw2, got["dispatch_bwd w"])
        if first is None:
            first = got
        else:
            for k, v in got.items():
                same(f"{k} {t} vs {configs[0]}", v, first[k])
        h.close()
        g.close()


def fp8(cp, comm):
    """FP8 dispatch in the exact and capacity modes on both transports (fp8_case)."""
    f32, b16, f16 = np.float32, bf16(), np.float16
    n = 0
    for mode in ("exact", "capacity"):
        for kind, Ts, align, dtype, H in (("uniform", (48, 37), 1, b16, 512), ("holes", (33, 0), 8, b16, 300),
                                          ("skewed", (64, 20), 1, f32, 100), ("one", (30, 41), 4, f16, 7168)):
            fp8_case(cp, comm, 5000 + n, experts(16), 4, H, Ts, 64, kind, mode, align, dtype)
            n += 1
    fp8_case(cp, comm, 5100, experts(8), 6, 64, (10, 12), 16, "holes", "capacity", 4, b16)
    fp8_case(cp, comm, 5101, experts(8), 2, 256, (0, 0), 16, "uniform", "exact", 1, b16)
    # H = 77: packed rows whose codes, gap (to ceil4(H) = 80) and scales are stored a byte at a time (the
    # padding rows of a bf16 dequantize: 2-byte zeros)
    fp8_case(cp, comm, 5102, experts(8), 3, 77, (21, 30), 32, "holes", "exact", 2, b16)
    fp8_case(cp, comm, 5103, experts(8), 3, 77, (21, 30), 32, "uniform", "capacity", 2, f32)
    log(f"fp8: {n + 4} cases OK ({TRANSPORT_CHUNKS})")


def direct_lifecycle(cp, comm):
    """The direct transport over a long run and its teardown: graph capture and replays, 1000 eager
    iterations per mode with flat pool memory (graph()), then the teardown order: handles closed first, then
    the group (its last barrier, the IPC mappings of the peers' buffers closed, its own buffers freed); after
    it every op of the group raises ValueError naming the op, the communicator stays usable (an all-reduce
    gives the right sum), and a new direct group on the same communicator works and closes again."""
    from moe_rt.ep import EpGroup

    graph(cp, comm, chunks=["d"], replays=20, memory=True)
    E, H, Tmax, K = experts(8), 64, 32, 2
    rng = np.random.default_rng(11)
    idx = cp.asarray(routing(rng, Tmax, E, K, "uniform"))
    x = cp.asarray(rng.standard_normal((Tmax, H)).astype(np.float32))
    for round_ in range(2):
        g = EpGroup(comm, E, H, Tmax, timeout=60, transport="direct")
        assert g.transport == "direct"
        h = g.prepare(idx)
        rx, _, _ = g.dispatch(h, x)
        out = g.combine(h, rx, weighted=False)
        cp.cuda.Device().synchronize()
        h.close()
        g.close()
        g.close()  # idempotent
        for op, call in (("prepare", lambda: g.prepare(idx)), ("dispatch", lambda: g.dispatch(h, x))):
            try:
                call()
            except ValueError as e:
                assert op in str(e) and ("closed" in str(e)), str(e)
            else:
                raise AssertionError(f"{op} after close did not raise")
        v = cp.full(4, float(RANK + 1), np.float32)
        s = cp.empty_like(v)
        comm.all_reduce(v.data.ptr, s.data.ptr, 4, "float32", cp.cuda.get_current_stream().ptr)
        cp.cuda.Device().synchronize()
        assert float(s.get()[0]) == WORLD * (WORLD + 1) / 2, s.get()
        del out, rx
    log("direct lifecycle: graph, 1000 iterations flat, teardown, communicator alive, reopened")


def zero_rows(cp, comm):
    """Capacity mode on the direct transport and the mixed groups of nodes smaller than R: each dispatch (and
    combine_bwd) into a pool poisoned with NaN bits, every row against the reference (the rows holding no slot
    zero), zero_empty_slots=False leaving them unwritten, every later op as one_case checks; bf16, fp16 and
    fp32 rows (vector and scalar units), holes and skewed routing, a large case (T near 512)."""
    f32, b16, f16 = np.float32, bf16(), np.float16
    configs = [c for c in mixed_configs() if int(c[1:]) < WORLD] + ["d"]
    n = 0
    for c in configs:
        for kind, Ts, Tmax, align, dtype, H in (("uniform", (48, 37), 64, 1, f32, 256),
                                                ("holes", (33, 0), 64, 8, b16, 512),
                                                ("skewed", (64, 20), 64, 1, f16, 100),
                                                ("uniform", (500, 311), 512, 1, b16, 1024)):
            one_case(cp, comm, 7000 + n, experts(16), 4, H, Ts, Tmax, kind, "capacity", align, dtype, chunks=[c])
            n += 1
    log(f"zero_rows: {n} cases OK ({configs})")


def graph_transports(cp, comm):
    graph(cp, comm, chunks=TRANSPORT_CHUNKS, replays=5, memory=False)


def mixed(cp, comm):
    """The group in nodes of n ranks (transport="auto", local_size=n) for n in {1, R/2, R}: every op against the
    reference, bitwise against the direct and NCCL transports, both modes, vector and scalar row widths (n = R,
    the direct transport reached through local_size, once per mode); an FP8 dispatch (with torch) bitwise
    across them."""
    f32, b16, f16 = np.float32, bf16(), np.float16
    n = 0
    shapes = (("uniform", (48, 37), 1, f32, 256), ("holes", (33, 0), 8, b16, 512), ("skewed", (64, 20), 1, f16, 100),
              ("one", (30, 41), 4, b16, 72))
    for ls in mixed_configs():
        chunks = [ls, "d", "s1"]
        for mode in ("exact", "capacity"):
            for kind, Ts, align, dtype, H in (shapes if int(ls[1:]) < WORLD else shapes[1:2]):
                one_case(cp, comm, 6000 + n, experts(16), 4, H, Ts, 64, kind, mode, align, dtype, chunks=chunks)
                n += 1
        if int(ls[1:]) < WORLD:
            one_case(cp, comm, 6000 + n, experts(8), 6, 64, (10, 12), 16, "holes", "capacity", 4, b16, chunks=chunks)
            one_case(cp, comm, 6001 + n, WORLD, 2, 64, (10, 0), 16, "uniform", "exact", 1, f32, chunks=chunks)
            n += 2
    try:
        import torch  # noqa: F401
    except ImportError:
        log("mixed: no torch, FP8 dispatch skipped")
    else:
        for mode in ("exact", "capacity"):
            fp8_case(cp, comm, 6300, experts(16), 4, 512, (48, 37), 64, "uniform", mode, 1, b16,
                     configs=mixed_configs() + ["d", "s1"])
    log(f"mixed: {n} cases OK ({mixed_configs()})")


def graph_mixed(cp, comm):
    """Capacity mode captured in a CUDA graph per node size, replayed with new routing: against the reference and
    bitwise against the direct and NCCL transports."""
    graph(cp, comm, chunks=mixed_configs() + ["d", "s1"], replays=5, memory=False)


def dead_peer_mixed(cp, comm):
    """Nodes of R/2 ranks (1 at R = 2): rank 1 skips a dispatch (dead_peer)."""
    dead_peer(cp, comm, local_size=max(1, WORLD // 2))


def dead_peer_direct(cp, comm):
    dead_peer(cp, comm, direct=True)


def torch_direct(cp, comm):
    """The direct transport's eager ops on torch tensors on torch's current stream (taken as pointers, results
    from torch's allocator, torch tensors back: EpGroup._lean) bitwise equal to the same ops on CuPy arrays,
    which the other cases check against the reference: dispatch, combine (weighted or not), dispatch_bwd (with
    and without the weights' gradient), combine_bwd (with y, without, unweighted); both modes, bf16, fp16
    and fp32, a row width off the 16-byte vector path, T = 0 on a rank."""
    import torch

    from moe_rt.ep import EpGroup

    torch.cuda.set_device(DEV)

    def to_torch(a):
        a = np.ascontiguousarray(a)
        t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype == bf16() else torch.from_numpy(a)
        return t.to(f"cuda:{DEV}")

    def from_torch(name, t, dtype):
        assert isinstance(t, torch.Tensor) and t.device == torch.device("cuda", DEV), (name, type(t))
        t = t.cpu()
        return t.view(torch.int16).numpy().view(bf16()) if t.dtype == torch.bfloat16 else t.numpy().astype(dtype)

    n = 0
    for mode in ("capacity", "exact"):
        for dtype, H, Ts in ((bf16(), 512, (48, 37)), (np.float16, 100, (33, 0)), (np.float32, 72, (20, 64))):
            Ts = spread(Ts)
            E, K, Tmax = experts(16), 4, 64
            rng = np.random.default_rng(5000 + n)
            idx = routing(rng, Ts[RANK], E, K, "uniform")
            x = rng.standard_normal((Ts[RANK], H)).astype(np.float32).astype(dtype)
            w = rng.random((Ts[RANK], K)).astype(np.float32)
            gout = rng.standard_normal((Ts[RANK], H)).astype(np.float32).astype(dtype)
            g = EpGroup(comm, E, H, Tmax, mode=mode, timeout=60, transport="direct")
            tag = f"[torch direct {mode} {np.dtype(dtype).name} H={H} T={Ts}]"
            h = g.prepare(cp.asarray(idx))
            want = {}
            want["recv_x"], want["recv_w"], want["tpe"] = g.dispatch(h, cp.asarray(x), cp.asarray(w))
            N = int(want["recv_x"].shape[0])
            y = rng.standard_normal((N, H)).astype(np.float32).astype(dtype)
            gw = rng.standard_normal(N).astype(np.float32)
            yc, gc = cp.asarray(y), cp.asarray(gout)
            want["combine"] = g.combine(h, yc)
            want["combine unweighted"] = g.combine(h, yc, weighted=False)
            want["dispatch_bwd x"], want["dispatch_bwd w"] = g.dispatch_bwd(h, yc, cp.asarray(gw))
            want["dispatch_bwd x alone"], _ = g.dispatch_bwd(h, yc)
            want["combine_bwd y"], want["combine_bwd w"] = g.combine_bwd(h, gc, yc)
            want["combine_bwd without y"], _ = g.combine_bwd(h, gc)
            want["combine_bwd unweighted"], _ = g.combine_bwd(h, gc, weighted=False)
            h.close()
            h = g.prepare(to_torch(idx))
            yt, gt = to_torch(y), to_torch(gout)
            got = {}
            got["recv_x"], got["recv_w"], got["tpe"] = g.dispatch(h, to_torch(x), to_torch(w))
            got["combine"] = g.combine(h, yt)
            got["combine unweighted"] = g.combine(h, yt, weighted=False)
            got["dispatch_bwd x"], got["dispatch_bwd w"] = g.dispatch_bwd(h, yt, to_torch(gw))
            got["dispatch_bwd x alone"], none = g.dispatch_bwd(h, yt)
            assert none is None
            got["combine_bwd y"], got["combine_bwd w"] = g.combine_bwd(h, gt, yt)
            got["combine_bwd without y"], none = g.combine_bwd(h, gt)
            assert none is None
            got["combine_bwd unweighted"], none = g.combine_bwd(h, gt, weighted=False)
            assert none is None
            torch.cuda.synchronize()
            for k, v in want.items():
                same(f"{k} {tag}", from_torch(k, got[k], _np(v).dtype), v)
            h.close()
            g.close()
            n += 1
    log(f"torch_direct: {n} cases OK")


def jax_init(cp):
    """JAX on this rank's GPU only, as a JAX job runs (moe_rt.demo_ep does the same): jax.distributed with a
    coordinator on a free port that rank 0 picks and passes to the others in a file beside the launch's NCCL id
    file. Returns the jax module."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    port_file = os.environ["MOE_RT_UID_FILE"] + ".jax_port"
    if RANK == 0:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(port_file + ".tmp", port_file)
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            assert time.monotonic() < deadline, "rank 0 wrote no JAX coordinator port"
            time.sleep(0.05)
        with open(port_file) as f:
            port = int(f.read())
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=WORLD, process_id=RANK,
                               local_device_ids=[int(cp.cuda.Device().id)])
    return jax


def jax_refused_after_close(jax, dev, step, args, message):
    """Run the compiled ``step`` naming a closed group on ``dev``: it must fail with ``message`` (the core's);
    then start a fresh token for the EP ops (the failure stays in it: moe_rt.jax.reset_ep_order)."""
    import moe_rt.jax as mj

    try:
        with jax.default_device(dev):
            jax.block_until_ready(step(*args))
    except Exception as e:  # noqa: BLE001 - XLA's error type varies with the version
        assert message in str(e), e
    else:
        raise AssertionError("a program naming a closed group ran")
    mj.reset_ep_order()


def jax_direct(cp, comm):
    """moe_rt.jax ep_prepare / ep_dispatch / ep_combine on a group on the direct transport (XLA FFI custom calls,
    moe_rt_xla_ep_*) under jit(value_and_grad): prepare -> dispatch (weights) -> scale by 2 -> weighted combine,
    loss = <out, GO>. The program over this group and the same program over a group on the NCCL transport (the
    buffer_callback path, whose lowering is checked to hold no moe_rt_ep_* call) each run twice, the second
    run queued while the first may still run; each run against the NumPy R-rank reference (recv_x and
    recv_weights bitwise, out and the gradients as the other cases check them, close), then run to run and
    across the two groups bitwise. Then a program run after close fails with the core's message."""
    jax = jax_init(cp)
    import jax.numpy as jnp

    import moe_rt.jax as mj
    from moe_rt.ep import EpGroup
    from moe_rt.reference import ep as ref

    dev = jax.local_devices(backend="gpu")[0]
    assert dev.local_hardware_id == cp.cuda.Device().id, (dev, cp.cuda.Device().id)
    n = 0
    for dtype, H, Ts, E, K, Tmax, align in ((bf16(), 256, (20, 7), experts(8), 3, 24, 1),
                                          (np.float32, 72, (13, 0), experts(6), 2, 16, 4),
                                          (bf16(), 100, (33, 17), experts(12), 4, 40, 1)):
        Ts = spread(Ts)
        rng = np.random.default_rng(7000 + n)
        idx = [routing(rng, T, E, K, "uniform") for T in Ts]
        xs = [rng.standard_normal((T, H)).astype(np.float32).astype(dtype) for T in Ts]
        ws = [rng.random((T, K)).astype(np.float32) for T in Ts]
        GO = [rng.standard_normal((T, H)).astype(np.float32) for T in Ts]
        L = E // WORLD
        groups = {t: EpGroup(comm, E, H, Tmax, mode="capacity", align_size=align, timeout=60, transport=t)
                  for t in ("direct", "nccl")}
        assert mj.ep_path(groups["direct"]) == "ffi" and mj.ep_path(groups["nccl"]) == "buffer_callback"
        P = groups["direct"].pair_capacity
        hs = ref.prepare(idx, E, align_size=align, pair_capacity=P, capacity=WORLD * P * min(K, L))
        routs = ref.dispatch(hs, xs, ws)
        Y = [(r.astype(np.float32) * 2).astype(dtype) for r, _, _ in routs]
        out_ref = ref.combine(hs, Y, weighted=True)
        GOd = [g.astype(dtype) for g in GO]
        cb = ref.combine_bwd(hs, GOd, Y, weighted=True)
        G = [(gy.astype(np.float32) * 2).astype(dtype) for gy, _ in cb]
        gx_ref, gw_ref = ref.dispatch_bwd(hs, G, [gw for _, gw in cb])[RANK]
        results = {}
        for t, g in groups.items():
            def loss(x, w, i, g=g):
                h = mj.ep_prepare(g, i)
                rx, rw = mj.ep_dispatch(h, x, w)
                out = mj.ep_combine(h, (rx * 2).astype(rx.dtype), rw)
                return (out.astype(jnp.float32) * GO[RANK]).sum(), (rx, rw, out)

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
            with jax.default_device(dev):
                args = (jnp.asarray(xs[RANK]), jnp.asarray(ws[RANK]), jnp.asarray(idx[RANK].astype(np.int32)))
                text = step.lower(*args).as_text()
                if t == "direct":
                    assert "xla_buffer_python" not in text
                    for op in ("ep_prepare", "ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd"):
                        assert f"@moe_rt_{op}(" in text, op
                else:
                    assert "xla_buffer_python" in text and "@moe_rt_ep_" not in text
                (_, (rx, rw, out)), (gx, gw) = step(*args)
                again = step(*args)  # queued while the first run may still be running
            tag = f"[jax direct {np.dtype(dtype).name} H={H} T={Ts} E={E} K={K} A={align}]"
            runs = [[np.asarray(a) for a in (rx, rw, out, gx, gw)],
                    [np.asarray(a) for a in (*again[0][1], *again[1])]]
            for i, (rx_, rw_, out_, gx_, gw_) in enumerate(runs):  # each run against the reference first
                where = f"{t} run {i + 1} {tag}"
                same(f"recv_x {where}", rx_, routs[RANK][0])
                same(f"recv_w {where}", rw_, routs[RANK][1])
                close(f"combine {where}", out_, out_ref[RANK], dtype)
                close(f"grad x {where}", gx_, gx_ref, dtype)
                close(f"grad topk_weights {where}", gw_, gw_ref,
                      np.float32 if np.dtype(dtype) == np.float32 else dtype)
            for name, a, b in zip(("recv_x", "recv_w", "out", "grad x", "grad w"), *runs):
                same(f"{t}: {name} run to run", a, b)
            results[t] = (runs[0], step, args)
        for name, a, b in zip(("recv_x", "recv_w", "out", "grad x", "grad w"), results["direct"][0],
                              results["nccl"][0]):
            same(f"{name} direct vs nccl {tag}", a, b)
        for g in groups.values():
            g.close()
        _, step, args = results["direct"]
        jax_refused_after_close(jax, dev, step, args, "no live direct EP group")
        n += 1
        log(f"jax_direct case {n} ok {tag}")


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "correctness"
    stacks = os.environ.get("MOE_RT_EP_WORKER_STACKS")
    if stacks:
        import faulthandler

        faulthandler.dump_traceback_later(float(stacks), exit=True)
    cp, comm = setup()
    {"correctness": correctness, "graph": graph, "dead_peer": dead_peer, "transports": transports,
     "graph_transports": graph_transports, "dead_peer_direct": dead_peer_direct,
     "direct_lifecycle": direct_lifecycle, "fp8": fp8, "mixed": mixed, "graph_mixed": graph_mixed,
     "dead_peer_mixed": dead_peer_mixed, "torch_direct": torch_direct, "jax_direct": jax_direct,
     "zero_rows": zero_rows}[what](cp, comm)
    cp.cuda.Device().synchronize()
    comm.close()
    log("ALL OK")


if __name__ == "__main__":
    main()
