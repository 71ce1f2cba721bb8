"""Per-rank worker of the multi-GPU low-latency EP tests (moe_rt/ep_ll.py); one process per GPU:

    python tools/launch.py -n R tests/ep_ll_worker.py correctness|graph|split|fp8|dead_peer|jax|partials

Every rank draws every rank's inputs from the same seed, runs its own share through LowLatencyGroup and
compares with the NumPy R-rank reference (moe_rt.reference.ep_ll): dispatch's valid slots, counts and slot
tables, combine and both backwards bitwise (combine_bwd's weight gradient within fp32 rounding), each case
twice (run to run bitwise, over buffers the previous case filled). Every case runs with the dedup split of
the dispatch rows (LowLatencyGroup(dedup=True): one push per token and destination rank, copied on the
receiving side) and with per-expert pushes (dedup=False), and the two runs' outputs are compared bitwise.
Prints "ALL OK" (or "DEAD PEER OK").
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the same launch environment and bootstrap
from ep_worker import RANK, WORLD, bf16, jax_init, jax_refused_after_close, log, setup  # noqa: E402


def case(seed, L, K, Ts, H, dt):
    from test_ep_ll import make_case

    return make_case(np.random.default_rng(seed), WORLD, L, K, Ts, H, dt)


DEDUPS = (True, False)  # LowLatencyGroup(dedup=...): the dedup split, then per-expert pushes


def same_bits(a, b, what):
    """Two runs' outputs (tuples of NumPy arrays) equal bit for bit."""
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape and (bits(x) == bits(y)).all(), f"{what}: output {i}"


def spread(Ts):
    return tuple(Ts[r % len(Ts)] for r in range(WORLD))


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def check_all(cp, g, seed, L, K, Ts, Tmax, H, dt):
    from moe_rt.reference import ep_ll as ref

    R, me = WORLD, RANK
    xs, idxs, ws = case(seed, L, K, Ts, H, dt)
    rng = np.random.default_rng(seed + 1)
    Y = rng.standard_normal((R, L, R * Tmax, H)).astype(dt)
    G = rng.standard_normal((R, L, R * Tmax, H)).astype(dt)
    GW = rng.standard_normal((R, L, R * Tmax)).astype(np.float32)
    GO = [rng.standard_normal((T, H)).astype(dt) for T in Ts]
    res = ref.dispatch(xs, idxs, ws, R * L, Tmax)
    handles = [h for _, _, h in res]
    rx, rc, rh = res[me]
    valid = rh["slot_k"] >= 0
    idx = idxs[me].astype(np.int32) if seed % 2 else idxs[me]  # int32 and int64 routing
    recv, counts, h = g.dispatch(cp.asarray(xs[me]), cp.asarray(idx), cp.asarray(ws[me]))
    assert recv.shape == (L, R * Tmax, H) and recv.dtype == dt
    assert (bits(cp.asnumpy(recv)[valid]) == bits(rx[valid])).all(), "dispatch rows"
    assert (cp.asnumpy(counts) == rc).all(), "counts"
    assert (cp.asnumpy(h.slot_topk) == rh["slot_k"]).all(), "slot_topk"
    assert (bits(cp.asnumpy(h.slot_weights)) == bits(rh["slot_w"])).all(), "slot_weights"
    recv_keep = recv.copy()
    out = g.combine(h, cp.asarray(Y[me]))
    assert (bits(cp.asnumpy(out)) == bits(ref.combine(handles, list(Y))[me])).all(), "combine"
    gx, gw = g.dispatch_bwd(h, cp.asarray(G[me]), cp.asarray(GW[me]))
    wx, ww = ref.dispatch_bwd(handles, list(G), list(GW))[me]
    assert (bits(cp.asnumpy(gx)) == bits(wx)).all(), "dispatch_bwd"
    assert (cp.asnumpy(gw) == ww).all(), "dispatch_bwd weights"
    assert g.dispatch_bwd(h, cp.asarray(G[me]))[1] is None
    gy, gw = g.combine_bwd(h, cp.asarray(GO[me]), cp.asarray(Y[me]))
    wy, ww = ref.combine_bwd(handles, GO, list(Y))[me]
    assert (bits(cp.asnumpy(gy)) == bits(wy)).all(), "combine_bwd (zero at invalid slots)"
    np.testing.assert_allclose(cp.asnumpy(gw), ww, rtol=2e-5, atol=2e-5, err_msg="combine_bwd weights")
    gy2, none = g.combine_bwd(h, cp.asarray(GO[me]))
    assert none is None and (bits(cp.asnumpy(gy2)) == bits(wy)).all(), "combine_bwd without y"
    g.synchronize()
    return (cp.asnumpy(recv_keep)[valid], cp.asnumpy(counts), cp.asnumpy(h.slot_topk), cp.asnumpy(h.slot_weights),
            cp.asnumpy(out), cp.asnumpy(gx), cp.asnumpy(gy2))  # (gy2 holds the receive buffer gy was a view of)


def run_cases(cp, comm, shapes, check, seed, tag, **group_kw):
    """Each dtype and (L, K, Ts, Tmax, H) of ``shapes`` through ``check`` (cp, group, seed, L, K, Ts, Tmax, H,
    dt -> outputs) on a group made with ``group_kw``, twice (run to run bitwise), dedup on and off (bitwise
    equal)."""
    from moe_rt.ep_ll import LowLatencyGroup

    n = 0
    for dt in (np.float32, bf16(), np.float16):
        for L, K, Ts, Tmax, H in shapes:
            Ts = spread(Ts)
            runs = []
            for dedup in DEDUPS:
                g = LowLatencyGroup(comm, WORLD * L, H, Tmax, topk=min(K, WORLD * L), dtype=dt, dedup=dedup,
                                    **group_kw)
                K = g.topk
                first = check(cp, g, seed + n, L, K, Ts, Tmax, H, dt)
                again = check(cp, g, seed + n, L, K, Ts, Tmax, H, dt)
                same_bits(first, again, "run to run")
                runs.append(first)
                g.close()
            same_bits(runs[0], runs[1], "dedup on and off")
            n += 1
            log(f"{tag} {n} ok: dtype={np.dtype(dt).name} L={L} K={K} Ts={Ts} Tmax={Tmax} H={H}")


def correctness(cp, comm):
    from moe_rt.ep_ll import LowLatencyGroup

    # (Tmax 257: 3 tokens a chunk, so a receiving block's columns start and end inside chunks)
    run_cases(cp, comm, [(3, 4, (7, 0, 5, 2), 7, 13), (2, 3, (4, 4), 4, 64), (8, 8, (128,), 128, 512),
                         (1, 2, (1, 3), 3, 5), (5, 6, (33, 17, 0, 40), 40, 1000),
                         (2, 3, (200, 131, 0, 257), 257, 48)], check_all, 100, "case")
    # the rank's errors: T > Tmax before anything is launched (every rank raises alike)
    g = LowLatencyGroup(comm, WORLD * 2, 8, 4, topk=2, dtype=np.float32)
    try:
        g.dispatch(cp.zeros((5, 8), np.float32), cp.zeros((5, 2), np.int32), cp.ones((5, 2), np.float32))
        raise AssertionError("T > max_tokens_per_rank accepted")
    except ValueError as e:
        assert "max_tokens_per_rank" in str(e)
    g.close()
    refused_when_ranks_disagree(cp, comm, "dedup")


def refused_when_ranks_disagree(cp, comm, name):
    """Ranks that disagree on the group setting ``name`` (on at rank 0 only): the first op's set-up refuses it
    on every rank alike, naming it."""
    from moe_rt.ep_ll import LowLatencyGroup

    g = LowLatencyGroup(comm, WORLD * 2, 8, 4, topk=2, dtype=np.float32, **{name: RANK == 0})
    try:
        g.dispatch(cp.zeros((3, 8), np.float32), cp.zeros((3, 2), np.int32), cp.ones((3, 2), np.float32))
        raise AssertionError(f"ranks disagreeing on {name} accepted")
    except ValueError as e:
        assert name in str(e) and "disagree" in str(e), e
    g.close()


def graph(cp, comm):
    """dispatch + expert stand-in + combine captured once, replayed with new routing, tokens and weights (dedup
    on and off)."""
    for dedup in DEDUPS:
        graph_one(cp, comm, dedup)


def graph_one(cp, comm, dedup, combine_partials=False):
    """dispatch + combine on a group made with ``dedup`` and ``combine_partials``, captured once and replayed 5
    times with new routing, tokens and weights, against the reference each time. Plain combine: an expert
    stand-in (a per-expert scale of the received rows) captured between them; dispatch rows, counts and combine
    checked. combine_partials: the expert rows an input of the graph, refilled with new rows at each replay
    too; the rank-partial combine checked."""
    from moe_rt.ep_ll import LowLatencyGroup
    from moe_rt.reference import ep_ll as ref

    dt = bf16()
    L, K, Tmax, H = 4, 3, 24, 256
    Ts = spread((24, 19, 0, 7))
    g = LowLatencyGroup(comm, WORLD * L, H, Tmax, topk=K, dtype=dt, dedup=dedup, combine_partials=combine_partials)
    seed, replay_seed = (9, 2000) if combine_partials else (7, 1000)
    xs, idxs, ws = case(seed, L, K, Ts, H, dt)
    x, idx, w = cp.asarray(xs[RANK]), cp.asarray(idxs[RANK]), cp.asarray(ws[RANK])
    scale = cp.asarray(np.linspace(0.5, 1.5, L).astype(np.float32))
    y = cp.zeros((L, WORLD * Tmax, H), dt)

    def expert(recv):
        return y if combine_partials else (recv.astype(cp.float32) * scale[:, None, None]).astype(dt)

    g.combine(g.dispatch(x, idx, w)[2], y)  # setup and compile first
    if not combine_partials:
        expert(g.dispatch(x, idx, w)[0])  # CuPy's kernels compiled before capture too
    g.synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        recv, counts, h = g.dispatch(x, idx, w)
        out = g.combine(h, expert(recv))
        gr = s.end_capture()
    for it in range(5):
        xs, idxs, ws = case(replay_seed + it, L, K, Ts, H, dt)
        x[...], idx[...], w[...] = cp.asarray(xs[RANK]), cp.asarray(idxs[RANK]), cp.asarray(ws[RANK])
        if combine_partials:
            Y = np.random.default_rng(3000 + it).standard_normal((WORLD, L, WORLD * Tmax, H)).astype(dt)
            y[...] = cp.asarray(Y[RANK])
        cp.cuda.get_current_stream().synchronize()  # the new inputs written before the replay reads them
        gr.launch(s)
        s.synchronize()
        res = ref.dispatch(xs, idxs, ws, WORLD * L, Tmax)
        handles = [hh for _, _, hh in res]
        if combine_partials:
            want = ref.combine_partials(handles, list(Y))[RANK]
            assert (bits(cp.asnumpy(out)) == bits(want)).all(), f"replay {it}: combine partials"
            log(f"partials replay {it} ok")
            continue
        sc = cp.asnumpy(scale)
        Y = [(r.astype(np.float32) * sc[:, None, None]).astype(dt) for r, _, _ in res]
        want = ref.combine(handles, Y)[RANK]
        valid = res[RANK][2]["slot_k"] >= 0
        assert (bits(cp.asnumpy(recv)[valid]) == bits(res[RANK][0][valid])).all(), f"replay {it}: dispatch rows"
        assert (cp.asnumpy(counts) == res[RANK][1]).all(), f"replay {it}: counts"
        assert (bits(cp.asnumpy(out)) == bits(want)).all(), f"replay {it}: combine"
        log(f"replay {it} ok (dedup={dedup})")
    g.synchronize()
    g.close()


def split(cp, comm):
    """Two micro-batches in flight (num_buffers=2): dispatch A and B with receive hooks, then both hooks, then
    both combines, against the reference; then the same sequence captured as a CUDA graph and replayed with
    new routing (dedup on and off: the copies belong to the receive hook's launch)."""
    for dedup in DEDUPS:
        split_one(cp, comm, dedup)


def split_one(cp, comm, dedup):
    from moe_rt.ep_ll import LowLatencyGroup
    from moe_rt.reference import ep_ll as ref

    dt = bf16()
    L, K, Tmax, H = 3, 4, 20, 384
    Ts = spread((20, 9, 0, 13))
    g = LowLatencyGroup(comm, WORLD * L, H, Tmax, topk=K, dtype=dt, num_buffers=2, dedup=dedup)
    rng = np.random.default_rng(5)
    Y = [cp.asarray(rng.standard_normal((L, WORLD * Tmax, H)).astype(dt)) for _ in range(2)]

    def inputs(seed):
        xs, idxs, ws = case(seed, L, K, Ts, H, dt)
        return (xs, idxs, ws), [cp.asarray(a[RANK]) for a in (xs, idxs, ws)]

    def want(host, y):
        res = ref.dispatch(*host, WORLD * L, Tmax)
        # every rank's expert output for this micro-batch: the same array on every rank (seeded alike)
        Yall = [cp.asnumpy(y)] * WORLD
        return res[RANK], ref.combine([hh for _, _, hh in res], Yall)[RANK]

    def run(dev):
        (ra, ca, ha, hook_a) = g.dispatch(*dev[0], return_recv_hook=True)
        (rb, cb, hb, hook_b) = g.dispatch(*dev[1], return_recv_hook=True)
        assert ha.buffer_set != hb.buffer_set
        hook_a()
        hook_b()
        return (ra, ca, ha, g.combine(ha, Y[0])), (rb, cb, hb, g.combine(hb, Y[1]))

    def check(outs, hosts, tag):
        for (r, c, h, out), host, y in zip(outs, hosts, Y):
            (rx, rc, rh), wout = want(host, y)
            valid = rh["slot_k"] >= 0
            assert (bits(cp.asnumpy(r)[valid]) == bits(rx[valid])).all(), f"{tag}: dispatch rows"
            assert (cp.asnumpy(c) == rc).all(), f"{tag}: counts"
            assert (bits(cp.asnumpy(out)) == bits(wout)).all(), f"{tag}: combine"

    hosts, devs = zip(*(inputs(s) for s in (11, 12)))
    outs = run(devs)
    g.synchronize()
    check(outs, hosts, "eager")
    log(f"split eager ok (dedup={dedup})")
    try:  # a third dispatch into a set whose hook is pending is refused on every rank alike
        _, _, _, hook = g.dispatch(*devs[0], return_recv_hook=True)
        g.dispatch(*devs[1], return_recv_hook=True)
        g.dispatch(*devs[0])
        raise AssertionError("dispatch into a set with a pending hook accepted")
    except ValueError as e:
        assert "receive hook" in str(e), e
    hook()
    g.dispatch(*devs[0])  # set 0 again (its hook ran); set 1's pending receive is abandoned with the group
    g.synchronize()
    g.close()
    g = LowLatencyGroup(comm, WORLD * L, H, Tmax, topk=K, dtype=dt, num_buffers=2, dedup=dedup)
    run(devs)
    g.synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        outs = run(devs)
        gr = s.end_capture()
    for it in range(3):
        hosts, new = zip(*(inputs(2000 + 2 * it + j) for j in range(2)))
        for d, n in zip(devs, new):
            for a, b in zip(d, n):
                a[...] = b
        gr.launch(s)
        s.synchronize()
        check(outs, hosts, f"replay {it}")
        log(f"split replay {it} ok (dedup={dedup})")
    g.synchronize()
    g.close()


def fp8(cp, comm):
    """FP8 dispatch (LowLatencyGroup(..., fp8=True)) against the reference's dispatch_fp8, bit for bit: a float
    x quantized in the push and dequantized on receipt, a uint8 (codes, scales) pair pushed as is; counts and
    slot tables; combine and both backwards with the FP8 dispatch's handle; each case twice (over buffers the
    first filled). Then two micro-batches in flight through receive hooks (num_buffers=2: a pair, and a float
    x dequantized), eager and captured in a CUDA graph replayed with new tokens and routing. All with dedup on
    and off, the two runs' outputs compared bitwise."""
    runs = [fp8_one(cp, comm, dedup) for dedup in DEDUPS]
    assert len(runs[0]) == len(runs[1])
    for i, (a, b) in enumerate(zip(*runs)):
        same_bits(a, b, f"fp8 dedup on and off, case {i}")


def fp8_one(cp, comm, dedup):
    """fp8()'s cases with LowLatencyGroup(dedup=dedup); returns each case's outputs (NumPy)."""
    import moe_rt
    from moe_rt.ep_ll import LowLatencyGroup
    from moe_rt.reference import ep_ll as ref
    from test_ep_ll import flushed, fp8_case, fp8_dequantized

    R, me = WORLD, RANK
    n = 0
    outs_all = []
    for dt in (bf16(), np.float32, np.float16):
        shapes = [(3, 4, (7, 0, 5, 2), 7, 200), (2, 3, (4, 4), 4, 13), (5, 6, (33, 17, 0, 40), 40, 1024),
                  (2, 3, (200, 131, 0, 257), 257, 136)]
        if dt == bf16():
            shapes.append((8, 8, (128,), 128, 7168))
        for L, K, Ts, Tmax, H in shapes:
            Ts = spread(Ts)
            g = LowLatencyGroup(comm, R * L, H, Tmax, topk=min(K, R * L), dtype=dt, fp8=True, dedup=dedup)
            K = g.topk
            for rep in range(2):
                xs, idxs, ws = fp8_case(np.random.default_rng(300 + n), R, L, K, Ts, H, dt)
                rng = np.random.default_rng(400 + n)
                Y = rng.standard_normal((R, L, R * Tmax, H)).astype(dt)
                GO = [rng.standard_normal((T, H)).astype(dt) for T in Ts]
                res = ref.dispatch_fp8(xs, idxs, ws, R * L, Tmax)
                handles = [hh for _, _, _, hh in res]
                rq, rs, rc, rh = res[me]
                valid = rh["slot_k"] >= 0
                x, idx, w = cp.asarray(xs[me]), cp.asarray(idxs[me]), cp.asarray(ws[me])
                y, counts, h = g.dispatch(x, idx, w, fp8=True, dequantize=True)
                assert y.dtype == dt and y.shape == (L, R * Tmax, H)
                want_y = fp8_dequantized(rq, rs, rh["slot_k"], dt)
                assert (bits(cp.asnumpy(y)[valid]) == bits(want_y[valid])).all(), "dequantized rows"
                assert (cp.asnumpy(counts) == rc).all(), "counts"
                assert (cp.asnumpy(h.slot_topk) == rh["slot_k"]).all(), "slot_topk"
                assert (bits(cp.asnumpy(h.slot_weights)) == bits(rh["slot_w"])).all(), "slot_weights"
                xq, xsc = moe_rt.quantize_fp8(xs[me])
                q, sc, counts2, h2 = g.dispatch((cp.asarray(xq.view(np.uint8)), cp.asarray(xsc)), idx, w, fp8=True)
                assert q.dtype == np.uint8 and sc.shape == (L, R * Tmax, -(-H // 128))
                assert (bits(cp.asnumpy(q)[valid]) == bits(rq[valid])).all(), "codes"
                assert (bits(cp.asnumpy(sc)[valid]) == bits(rs[valid])).all(), "scales"
                assert (cp.asnumpy(counts2) == rc).all(), "counts (pair)"
                outs_all.append((cp.asnumpy(y)[valid], cp.asnumpy(q)[valid], cp.asnumpy(sc)[valid],
                                 cp.asnumpy(counts2), cp.asnumpy(h.slot_topk), cp.asnumpy(h.slot_weights)))
                out = g.combine(h2, cp.asarray(Y[me]))
                assert (bits(cp.asnumpy(out)) == bits(ref.combine(handles, list(Y))[me])).all(), "combine"
                gx, _ = g.dispatch_bwd(h2, cp.asarray(Y[me]))
                assert (bits(cp.asnumpy(gx)) == bits(ref.dispatch_bwd(handles, list(Y))[me][0])).all(), "dispatch_bwd"
                gy, _ = g.combine_bwd(h2, cp.asarray(GO[me]))
                assert (bits(cp.asnumpy(gy)) == bits(ref.combine_bwd(handles, GO)[me][0])).all(), "combine_bwd"
                g.synchronize()
            g.close()
            n += 1
            log(f"fp8 case {n} ok (dedup={dedup}): dtype={np.dtype(dt).name} L={L} K={K} Ts={Ts} Tmax={Tmax} H={H}")
    # split hooks, two sets, eager and from a graph
    dt = bf16()
    L, K, Tmax, H = 3, 4, 20, 384
    Ts = spread((20, 9, 0, 13))
    g = LowLatencyGroup(comm, R * L, H, Tmax, topk=K, dtype=dt, fp8=True, num_buffers=2, dedup=dedup)
    Yd = cp.asarray(np.random.default_rng(5).standard_normal((L, R * Tmax, H)).astype(dt))

    def host(seed):
        xs, idxs, ws = fp8_case(np.random.default_rng(seed), R, L, K, Ts, H, dt)
        xq, xsc = moe_rt.quantize_fp8(xs[me])
        return (xs, idxs, ws), [xs[me], idxs[me], ws[me], xq.view(np.uint8), xsc]

    (hst, arrs) = host(21)
    x, idx, w, xq, xsc = (cp.asarray(a) for a in arrs)

    def run():
        qa, sa, ca, ha, hook_a = g.dispatch((xq, xsc), idx, w, fp8=True, return_recv_hook=True)
        yb, cb, hb, hook_b = g.dispatch(x, idx, w, fp8=True, dequantize=True, return_recv_hook=True)
        assert ha.buffer_set != hb.buffer_set
        hook_a()
        hook_b()
        return qa, sa, ca, yb, cb, g.combine(ha, Yd), g.combine(hb, yb)

    def check(outs, hst, tag):
        qa, sa, ca, yb, cb, oa, ob = outs
        res = ref.dispatch_fp8(*hst, R * L, Tmax)
        handles = [hh for _, _, _, hh in res]
        rq, rs, rc, rh = res[me]
        valid = rh["slot_k"] >= 0
        assert (bits(cp.asnumpy(qa)[valid]) == bits(rq[valid])).all(), f"{tag}: codes"
        assert (bits(cp.asnumpy(sa)[valid]) == bits(rs[valid])).all(), f"{tag}: scales"
        ys = [fp8_dequantized(r[0], r[1], r[3]["slot_k"], dt) for r in res]
        assert (bits(cp.asnumpy(yb)[valid]) == bits(ys[me][valid])).all(), f"{tag}: dequantized rows"
        assert (cp.asnumpy(ca) == rc).all() and (cp.asnumpy(cb) == rc).all(), f"{tag}: counts"
        want_a = ref.combine(handles, [cp.asnumpy(Yd)] * R)[me]  # Yd is the same on every rank
        assert (bits(cp.asnumpy(oa)) == bits(want_a)).all(), f"{tag}: combine (pair)"
        # ys hold subnormal rows (the FP8 edge cases), which the GPU's fp32 arithmetic flushes (-ftz=true)
        want_b = ref.combine(handles, [flushed(y) for y in ys])[me].astype(np.float32)
        assert (cp.asnumpy(ob).astype(np.float32) == want_b).all(), f"{tag}: combine (dequantized)"

    check(run(), hst, "split eager")
    g.synchronize()
    log(f"fp8 split eager ok (dedup={dedup})")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        outs = run()
        gr = s.end_capture()
    for it in range(3):
        hst, arrs = host(3000 + it)
        for a, b in zip((x, idx, w, xq, xsc), arrs):
            a[...] = cp.asarray(b)
        gr.launch(s)
        s.synchronize()
        check(outs, hst, f"fp8 replay {it}")
        valid = ref.dispatch_fp8(*hst, R * L, Tmax)[me][3]["slot_k"] >= 0  # rows of other slots: unspecified
        qa, sa, ca, yb, cb, oa, ob = (cp.asnumpy(o) for o in outs)
        outs_all.append((qa[valid], sa[valid], ca, yb[valid], cb, oa, ob))
        log(f"fp8 split replay {it} ok (dedup={dedup})")
    g.synchronize()
    g.close()
    return outs_all


def dead_peer(cp, comm):
    """Rank 1 skips a dispatch (and stays alive: its peers' memory stays mapped): every other rank's
    dispatch gives up on the device within the timeout, and synchronize raises TimeoutError naming it."""
    from moe_rt.ep_ll import LowLatencyGroup

    timeout = 4.0
    g = LowLatencyGroup(comm, WORLD * 2, 64, 32, topk=2, dtype=np.float32, timeout=timeout)
    assert g.sync == (os.environ.get("MOE_RT_LL_SYNC") or "pairwise"), g.sync
    log(f"sync={g.sync}")
    x = cp.ones((32, 64), cp.float32)
    idx = cp.asarray(np.tile(np.array([[0, 3]], np.int32), (32, 1)))
    w = cp.ones((32, 2), cp.float32)
    g.dispatch(x, idx, w)
    g.synchronize()
    if RANK == 1:
        log("rank 1 skips the dispatch")
        time.sleep(3 * timeout + 5)
        os._exit(0)
    t0 = time.monotonic()
    try:
        g.dispatch(x, idx, w)
        g.synchronize()
        raise AssertionError("dispatch with a dead peer completed")
    except TimeoutError as e:
        dt = time.monotonic() - t0
        log(f"got TimeoutError after {dt:.1f} s: {e}")
        assert dt < 2 * timeout + 5, dt
        # the direct transport's device wait names the op; on the NCCL transport the collective never ends and
        # the host wait that ran past the deadline names itself
        assert ("dispatch" if g.transport == "direct" else "synchronize") in str(e), e
    g.close()  # teardown after a failure: no hang
    log("DEAD PEER OK")
    os._exit(0)


def jax_ops(cp, comm):
    """moe_rt.jax ll_dispatch / ll_combine (XLA custom calls on this rank's GPU) under jit and grad: a layer
    (dispatch, a per-expert scale of a power of two, combine; loss = <out, GO> + <slot_weights, GW>) against the
    NumPy R-rank reference: the forward bitwise (recv_x's valid slots, zero elsewhere; counts; slot tables;
    out), the gradients of x (bitwise) and topk_weights (within fp32 rounding); then a program run after
    close fails with the core's message."""
    jax = jax_init(cp)
    import jax.numpy as jnp

    import moe_rt.jax as mj
    from moe_rt.ep_ll import LowLatencyGroup
    from moe_rt.reference import ep_ll as ref

    dev = jax.local_devices(backend="gpu")[0]
    assert dev.local_hardware_id == cp.cuda.Device().id, (dev, cp.cuda.Device().id)
    R, me = WORLD, RANK
    n = 0
    for dt in (np.float32, bf16()):
        for L, K, Ts, Tmax, H in [(3, 4, (7, 0, 5, 2), 7, 13), (2, 3, (4, 4), 4, 64), (5, 6, (33, 17, 0, 40), 40, 96)]:
            Ts = spread(Ts)
            g = LowLatencyGroup(comm, R * L, H, Tmax, topk=min(K, R * L), dtype=dt)
            K = g.topk
            xs, idxs, ws = case(300 + n, L, K, Ts, H, dt)
            rng = np.random.default_rng(400 + n)
            scale = np.where(rng.random(L) < 0.5, 0.5, 2.0).astype(np.float32)  # exact in every dtype
            GO = [rng.standard_normal((T, H)).astype(np.float32) for T in Ts]
            GW = [rng.standard_normal((L, R * Tmax)).astype(np.float32) for _ in range(R)]

            def loss(x, w, idx):
                rx, counts, h = mj.ll_dispatch(g, x, idx, w)
                y = (rx.astype(jnp.float32) * jnp.asarray(scale)[:, None, None]).astype(rx.dtype)
                out = mj.ll_combine(h, y)
                val = (out.astype(jnp.float32) * GO[me]).sum() + (h.slot_weights * GW[me]).sum()
                return val, (rx, counts, h, out)

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
            with jax.default_device(dev):
                args = (jnp.asarray(xs[me]), jnp.asarray(ws[me]), jnp.asarray(idxs[me].astype(np.int32)))
                (_, (rx, counts, h, out)), (gx, gw) = step(*args)
                again = step(*args)
            res = ref.dispatch(xs, idxs, ws, R * L, Tmax)
            handles = [hh for _, _, hh in res]
            r_ref, c_ref, h_ref = res[me]
            assert (bits(np.asarray(rx)) == bits(r_ref)).all(), "recv_x (zero at empty slots)"
            assert (np.asarray(counts) == c_ref).all(), "counts"
            assert (np.asarray(h.slot_topk) == h_ref["slot_k"]).all(), "slot_topk"
            assert (bits(np.asarray(h.slot_weights)) == bits(h_ref["slot_w"])).all(), "slot_weights"
            Y = [(r.astype(np.float32) * scale[:, None, None]).astype(dt) for r, _, _ in res]
            assert (bits(np.asarray(out)) == bits(ref.combine(handles, Y)[me])).all(), "combine"
            GOd = [a.astype(dt) for a in GO]
            rows = ref.combine_bwd(handles, GOd, Y)
            G = [(wy.astype(np.float32) * scale[:, None, None]).astype(dt) for wy, _ in rows]
            wx, wwd = ref.dispatch_bwd(handles, G, GW)[me]
            assert (bits(np.asarray(gx)) == bits(wx)).all(), "grad x"
            np.testing.assert_allclose(np.asarray(gw), rows[me][1] + wwd, rtol=2e-5, atol=2e-5,
                                       err_msg="grad topk_weights")
            for a, b in zip(jax.tree_util.tree_leaves((rx, counts, h, out, gx, gw)),
                            jax.tree_util.tree_leaves(again[0][1] + again[1])):
                assert (bits(np.asarray(a)) == bits(np.asarray(b))).all(), "run to run"
            g.close()
            jax_refused_after_close(jax, dev, step, args, "closed")
            n += 1
            log(f"jax case {n} ok: dtype={np.dtype(dt).name} L={L} K={K} Ts={Ts} Tmax={Tmax} H={H}")


def poison_back(cp, g):
    """Fill every buffer set's back region of ``g`` with all-one bytes (NaN in every float dtype), so that a
    row the owner reads but no rank wrote shows; stream-ordered before the next op's barrier, which no peer
    passes (to push into it) before this rank arrives."""
    for b in range(g.num_buffers):
        g._view("back", b, (g._offs[("back", b)][1],), np.uint8).fill(255)


def check_partials(cp, g, seed, L, K, Ts, Tmax, H, dt):
    """A group made with combine_partials=True: combine bitwise the reference's rank-partial combine, expert
    rows of invalid slots and the back buffer poisoned (NaN); the backward passes bitwise the reference's."""
    from moe_rt.reference import ep_ll as ref

    R, me = WORLD, RANK
    xs, idxs, ws = case(seed, L, K, Ts, H, dt)
    rng = np.random.default_rng(seed + 1)
    res = ref.dispatch(xs, idxs, ws, R * L, Tmax)
    handles = [h for _, _, h in res]
    Y = rng.standard_normal((R, L, R * Tmax, H)).astype(dt)
    for d in range(R):  # combine reads valid slots only: NaN elsewhere
        Y[d][handles[d]["slot_k"] < 0] = np.nan
    G = rng.standard_normal((R, L, R * Tmax, H)).astype(dt)
    GO = [rng.standard_normal((T, H)).astype(dt) for T in Ts]
    _, _, h = g.dispatch(cp.asarray(xs[me]), cp.asarray(idxs[me]), cp.asarray(ws[me]))
    poison_back(cp, g)
    out = g.combine(h, cp.asarray(Y[me]))
    want = ref.combine_partials(handles, list(Y))[me]
    assert out.shape == (Ts[me], H) and (bits(cp.asnumpy(out)) == bits(want)).all(), "combine partials"
    gx, _ = g.dispatch_bwd(h, cp.asarray(G[me]))
    assert (bits(cp.asnumpy(gx)) == bits(ref.dispatch_bwd(handles, list(G))[me][0])).all(), "dispatch_bwd"
    Yf = np.where(np.isnan(Y.astype(np.float32)), 0, Y).astype(dt)  # combine_bwd reads every row of y's slots
    gy, gw = g.combine_bwd(h, cp.asarray(GO[me]), cp.asarray(Yf[me]))
    wy, ww = ref.combine_bwd(handles, GO, list(Yf))[me]
    assert (bits(cp.asnumpy(gy)) == bits(wy)).all(), "combine_bwd"
    np.testing.assert_allclose(cp.asnumpy(gw), ww, rtol=2e-5, atol=2e-5, err_msg="combine_bwd weights")
    g.synchronize()
    return (cp.asnumpy(out), cp.asnumpy(gx))


def transports(cp, comm):
    """The NCCL transport (LowLatencyGroup(transport="nccl")) and the direct one give bitwise equal results
    (dispatch rows, counts, slot tables, combine, both backwards), each also checked against the reference by
    check_all / check_partials; the group reports the transport it took."""
    from moe_rt.ep_ll import LowLatencyGroup

    n = 0
    for dt in (np.float32, bf16(), np.float16):
        for L, K, Ts, Tmax, H in [(3, 4, (7, 0, 5, 2), 7, 13), (8, 8, (128,), 128, 512), (2, 3, (4, 4), 4, 64),
                                  (5, 6, (33, 17, 0, 40), 40, 1000)]:
            Ts = spread(Ts)
            for partial in (False, True):
                check = check_partials if partial else check_all
                runs = []
                for transport in ("direct", "nccl"):
                    g = LowLatencyGroup(comm, WORLD * L, H, Tmax, topk=min(K, WORLD * L), dtype=dt,
                                        transport=transport, combine_partials=partial)
                    runs.append(check(cp, g, 500 + n, L, g.topk, Ts, Tmax, H, dt))
                    assert g.transport == transport, (g.transport, transport)
                    g.close()
                same_bits(runs[0], runs[1], "direct and nccl transports")
            n += 1
            log(f"transports {n} ok: dtype={np.dtype(dt).name} L={L} K={K} Ts={Ts} Tmax={Tmax} H={H}")
    refused_when_ranks_disagree_on_transport(cp, comm)


def refused_when_ranks_disagree_on_transport(cp, comm):
    """transport='nccl' at rank 0 only (the others 'auto', which takes the direct transport here): refused on
    every rank alike at the first op, naming the setting."""
    from moe_rt.ep_ll import LowLatencyGroup

    g = LowLatencyGroup(comm, WORLD * 2, 8, 4, topk=2, dtype=np.float32, transport="nccl" if RANK == 0 else "auto")
    try:
        g.dispatch(cp.zeros((4, 8), np.float32), cp.zeros((4, 2), np.int32), cp.ones((4, 2), np.float32))
        raise AssertionError("ranks disagreeing on the transport accepted")
    except ValueError as e:
        assert "transport" in str(e), e
    g.close()


def partials(cp, comm):
    """LowLatencyGroup(combine_partials=True): combine bitwise the reference's rank-partial combine (fp32,
    fp16, bf16; odd H (the scalar path), T = 0 ranks, duplicates, holes; K above and below R: back rows
    Tmax*max(K, R)), poisoned expert rows and back buffer, run to run bitwise, dedup on and off; the
    backward passes unchanged; then dispatch + combine captured once and replayed with new routing; ranks
    disagreeing on combine_partials refused on every rank."""
    run_cases(cp, comm, [(3, 4, (7, 0, 5, 2), 7, 13), (3, 1, (6, 6), 6, 64), (8, 8, (128,), 128, 512),
                         (2, 8, (9, 0, 9, 4), 9, 40), (5, 6, (33, 17, 0, 40), 40, 1000)], check_partials, 300,
              "partials case", combine_partials=True)
    graph_one(cp, comm, None, combine_partials=True)  # new routing, tokens, weights and expert rows
    refused_when_ranks_disagree(cp, comm, "combine_partials")


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "correctness"
    cp, comm = setup()
    log(f"MOE_RT_LL_SYNC={os.environ.get('MOE_RT_LL_SYNC') or 'pairwise'}")  # every group's mode (read when made)
    log(f"MOE_RT_LL_TRANSPORT={os.environ.get('MOE_RT_LL_TRANSPORT') or 'auto'}")
    {"correctness": correctness, "graph": graph, "split": split, "fp8": fp8, "dead_peer": dead_peer,
     "jax": jax_ops, "partials": partials, "transports": transports}[what](cp, comm)
    cp.cuda.Device().synchronize()
    comm.close()
    log("ALL OK")


if __name__ == "__main__":
    main()
