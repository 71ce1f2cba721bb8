"""Host time of eager EpGroup ops on CUDA arrays, on a machine without a GPU (issue 30, item 4: an eager EP op
in capacity mode costs at most 30 us of host time, not growing with R). The device is stood in for as in
tools/profile_ll_host.py (kernels, launches counted not made, the op's array import, CuPy allocations
counted over fake addresses) and, for EpGroup, the direct transport's shared buffers (stages, prepare's box,
grid_sync's words), the occupancy query and exact mode's host read of the counts. CuPy's own kernels on the
handle's buffer (a copy of a region, a slice assignment) cannot run without a GPU: they are counted in the
``cupy`` column and return at once (their host cost, some microseconds each on a GPU, is left out).
Everything else is the real code path: checks, the handle, tables, kernel and argument set-up, barriers, views.
Per op: microseconds of this thread's CPU time per call (the best of 7 rounds), launches, allocations and
CuPy kernels and memcpys per call. Group: direct transport, E=256, H=7168, T=Tmax=4096, K=8, bf16; R=2 and R=4; capacity
and exact mode. Ops: prepare, dispatch, combine, dispatch_bwd, combine_bwd, the round trip, and the FP8 dispatch
(``fp8=True``, and with ``dequantize=True``).

    python tools/profile_ep_host.py [--calls 200] [--ranks 2 4] [--modes capacity exact] [--profile OP]

``--gpu`` profiles the same ops on real GPUs instead (tools/host_gpu.py: time_host's median, wall and thread CPU
time, device time, a breakdown by wrapped function, a cProfile, reference floors), T=4096 (``--tokens``), both
modes, the direct transport (``--transport nccl``), torch arrays as tools/bench_ep.py passes them:

    python tools/launch.py -n 4 tools/profile_ep_host.py --gpu [--json FILE]
    python tools/profile_ep_host.py --gpu [-n R] ...     # launches itself (R: MOE_RT_BENCH_EP_NPROC or 2)
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's moe_rt


def _ll_tool():
    spec = importlib.util.spec_from_file_location("profile_ll_host", pathlib.Path(__file__).with_name(
        "profile_ll_host.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_LL = _ll_tool()


class EpStandIns(_LL.StandIns):
    """tools/profile_ll_host.py's stand-ins plus what EpGroup's CUDA path reaches: dynamic shared memory
    opt-in, the occupancy query of prepare's grid-synchronized kernels (``resident`` blocks), CuPy arrays
    whose ``copy()`` and slice assignment (CuPy kernels) are counted in ``cupy_kernels`` and not run, and
    ``cudaMemcpyAsync`` (counted in ``memcpys``; ``on_memcpy(dst, src, nbytes, kind, stream)``), the Python
    side's and the direct core dispatch's copy of tokens_per_expert (made in C after its launches where no
    dispatch kernel runs) alike."""

    def __init__(self, setattr_=setattr, resident=264, sm_count=132):
        super().__init__(setattr_, resident, sm_count)
        import cupy

        from cupy.cuda import runtime

        from moe_rt import _arrays, _jit

        self.cupy_kernels = self.memcpys = 0
        self.on_memcpy = None
        st = self

        def memcpy(dst, src, nbytes, kind, stream):
            st.memcpys += 1
            if st.on_memcpy is not None:
                st.on_memcpy(dst, src, nbytes, kind, stream)

        class Arr(cupy.ndarray):
            def copy(self, order="C"):
                st.cupy_kernels += 1
                st.allocs += 1
                return st.array(self.shape, self.dtype)

            def __setitem__(self, key, value):
                st.cupy_kernels += 1

        self._cls = Arr

        class Call(_arrays.Call):  # the op's allocations through Call.empty, as the lean CUDA path's
            def empty(self, shape, dtype):
                return self.xp.empty(shape, dtype)

            scratch = empty

        setattr_(_arrays, "Call", Call)
        setattr_(runtime, "memcpyAsync", memcpy)
        from moe_rt import _core, _handle

        inner, tpe_src = _core.ep_direct_dispatch, {}  # inner: the launches recorded (StandIns)

        def dispatch(*a):
            inner(*a)
            # the core call's copy of tokens_per_expert after its launches (a memcpy too), made where no dispatch
            # kernel runs (rows of no bytes; else the kernel's block 0 copies them)
            if a[20:] and a[20] and not a[4]:
                h = a[2]  # (buffer, R, L, Tmax, K, P, rows, N, T, exact)
                src = tpe_src.get(h)
                if src is None:
                    src = tpe_src[h] = h[0] + _handle.layout(*h[1:8])[0]["tokens_per_expert"][0]
                memcpy(a[20], src, 4 * h[2], runtime.memcpyDeviceToDevice, a[18])

        setattr_(_core, "ep_direct_dispatch", dispatch)
        setattr_(_jit, "set_max_dynamic_shared", lambda fn, n: None)

    def array(self, shape, dtype):
        a = super().array(shape, dtype)
        return a.view(self._cls)

    def shared(self, R, nbytes):
        """A stand-in of the direct transport's IPC-shared buffer (_Shared): this rank's allocation, every
        rank's address and their device table."""
        from moe_rt import _ep_direct

        s = object.__new__(_ep_direct._Shared)
        s.local = next(self.addrs)
        s.ptrs = [s.local + (r << 32) for r in range(R)]
        s._buf, s.nbytes = None, int(nbytes)  # no core peer buffer: close_mappings and free do nothing
        s.table = self.array((R,), np.int64)
        return s

    def ep_group(self, R, me, E, H, Tmax, K, mode="capacity", dtype="bfloat16"):
        """An EpGroup of rank ``me`` of R on the direct transport whose shared buffers are stand-ins (made as
        its first ops would make them: prepare's box for K, the stages of ``H``-wide rows and of K weights),
        and whose exact-mode host read returns every pair full."""
        from moe_rt import _core, _ep_direct, _handle
        from moe_rt import ep as ep_mod
        from moe_rt.fp8 import packed_layout

        comm = type("Comm", (), {"rank": me, "size": R, "device": 0, "all_gather": None, "send": None,
                                 "recv": None, "group_start": None, "group_end": None})()
        g = ep_mod.EpGroup(comm, E, H, Tmax, mode=mode, dtype=dtype, topk=K, transport="nccl")
        P = g.pair_capacity if mode == "capacity" else Tmax
        d = object.__new__(_ep_direct.DirectTransport)
        d.comm, d.device, d.R, d.me, d.lo, d.hi, d.P = comm, 0, R, me, 0, R, P
        d.timeout_ns, d._stages, d._order, d.closed, d._err_ptr = 10**9, {}, [], False, 96
        d._pairs, d._views = {}, {}
        d._scratch_mem, d._retired = {}, []
        d._wait, d._op_wait = None, lambda op: None
        d.state = self.array((4,), np.uint32)
        d.bar, d.flags = self.shared(R, 4 * R), self.shared(R, 4 * R * P)
        d._core = _core.ep_direct_group_create(_core.device(0), R, me, 0, R, P, d.timeout_ns, d.bar.table.data.ptr,
                                               d.flags.table.data.ptr, d.state.data.ptr, d._err_ptr)
        rb = H * np.dtype(g.dtype).itemsize
        L = E // R
        half = R * (L + 2 + P * (2 * K + 1))
        rb8 = packed_layout(H)[2]  # the packed rows of an FP8 dispatch
        for key, nb in ((("prepare", K), 8 * half), (("rows", rb), R * P * rb), (("rows", rb8), R * P * rb8),
                        (("weights", K), R * P * 4 * K)):
            d._stages[key] = self.shared(R, nb)
            d._order.append(key)
        g.transport, g._transport = "direct", d
        g._gsync[(0, 7)] = type("M", (), {"ptr": next(self.addrs)})()  # grid_sync's words on stream 7
        if mode == "exact":  # the host read of the counts: every rank sends this one T tokens of 1 slot each
            host = np.zeros(5 * R + 10, np.int32)
            mi = _handle.meta_index
            host[mi("send_counts", R):mi("send_counts", R) + R] = Tmax
            host[mi("recv_counts", R):mi("recv_counts", R) + R] = Tmax
            host[mi("recv_rows", R)] = R * Tmax
            host[mi("total_slots", R)] = R * Tmax * K // R
            g._read_meta = lambda meta, stream, dev: host
        return g


def _time(st, f, n):
    """(microseconds of this thread's CPU time per call: the best of 7 rounds of ``n`` calls; launches,
    allocations, CuPy kernels and memcpys per call)."""
    for _ in range(20):
        f()
    best = None
    for _ in range(7):
        c0 = (st.launches, st.allocs, st.cupy_kernels, st.memcpys)
        t = time.thread_time()
        for _ in range(n):
            f()
        dt = (time.thread_time() - t) / n * 1e6
        best = dt if best is None else min(best, dt)
    return (best, (st.launches - c0[0]) / n, (st.allocs - c0[1]) / n, (st.cupy_kernels - c0[2]) / n,
            (st.memcpys - c0[3]) / n)


def ops(st, R, mode, T=4096, H=7168, E=256, K=8):
    """{op name: a call} for one group."""
    g = st.ep_group(R, R - 1, E, H, T, K, mode)
    bf = g.dtype
    x, idx, w = st.dev((T, H), bf), st.dev((T, K), np.int32), st.dev((T, K), np.float32)
    h = g.prepare(idx)
    N = h.sizes["N"]
    y, gx, gw, gout = st.dev((N, H), bf), st.dev((N, H), bf), st.dev((N,), np.float32), st.dev((T, H), bf)
    g.dispatch(h, x, w)

    def round_trip():
        hh = g.prepare(idx)
        g.combine(hh, g.dispatch(hh, x, w)[0])

    table = {"prepare": lambda: g.prepare(idx), "dispatch": lambda: g.dispatch(h, x, w),
             "combine": lambda: g.combine(h, y), "dispatch_bwd": lambda: g.dispatch_bwd(h, gx, gw),
             "combine_bwd": lambda: g.combine_bwd(h, gout),
             "round trip": round_trip, "dispatch fp8": lambda: g.dispatch(h, x, w, fp8=True),
             "dispatch fp8 dequantize": lambda: g.dispatch(h, x, w, fp8=True, dequantize=True)}
    for op in ("combine", "dispatch_bwd", "combine_bwd"):  # first calls (the transport's scratch made), as --gpu's
        table[op]()
    return table


def _host_gpu():
    """tools/host_gpu.py (the GPU mode's machinery)."""
    return _LL._host_gpu()


def parser():
    ap = argparse.ArgumentParser(prog=pathlib.Path(__file__).name, description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per round (default 200)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="group sizes (default 2 4)")
    ap.add_argument("--modes", nargs="+", default=["capacity", "exact"], choices=["capacity", "exact"])
    ap.add_argument("--profile", default=None, metavar="OP", help="cProfile one op (its name as printed) at the "
                    "first group size and mode")
    gp = _host_gpu().add_arguments(ap, GPU_OPS, 4096, "device time")
    gp.add_argument("--transport", default="direct", choices=["direct", "nccl"], help="the EP transport")
    return ap


GPU_OPS = ("prepare", "dispatch", "combine", "dispatch_bwd", "combine_bwd")


def parse_args(argv=None):
    return _host_gpu().parse(parser, argv)


def gpu_ops(g, T, idx, x, w):
    """{op name: a call} of an EpGroup on torch CUDA arrays, as tools/bench_ep.py calls them (torch tensors on
    torch's current stream); the handle, received rows and gradients made once."""
    import torch

    h = g.prepare(idx)
    rx, _, _ = g.dispatch(h, x, w)
    gx = rx.clone()
    gw = torch.rand(rx.shape[0], device=rx.device)
    gout = torch.randn(T, x.shape[1], device=x.device).to(x.dtype)
    return {"prepare": lambda: g.prepare(idx), "dispatch": lambda: g.dispatch(h, x, w),
            "combine": lambda: g.combine(h, rx), "dispatch_bwd": lambda: g.dispatch_bwd(h, gx, gw),
            "combine_bwd": lambda: g.combine_bwd(h, gout)}


def gpu_rank(a):
    """One rank of the GPU mode (under the launcher)."""
    import cupy as cp
    import torch

    from moe_rt import _ep_direct, _jit
    from moe_rt.ep import EpGroup

    hg = _host_gpu()
    rank = hg.Rank()
    me, world = rank.rank, rank.world
    E, K, H, T = 256, 8, 7168, a.tokens
    if a.transport == "direct" and not _ep_direct.probe_peers(rank.comm, rank.dev, lambda s: s.synchronize())[0]:
        raise SystemExit("--transport direct: some pair of ranks has no peer access")
    gen = torch.Generator(device="cuda").manual_seed(1234 + me)
    idx = torch.topk(torch.rand(T, E, device="cuda", generator=gen), K, dim=1).indices.to(torch.int32)
    w = torch.rand(T, K, device="cuda", generator=gen)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    stream = cp.cuda.get_current_stream()  # torch's current stream too (the legacy default one)
    out = print if me == 0 else (lambda *_: None)

    time_host, time_event = hg.timers(rank, a.iters, stream)
    m = hg.meta(rank, tool="profile_ep_host --gpu", tokens=T, hidden=H, experts=E, topk=K, dtype="bfloat16",
                transport=a.transport, iters=a.iters)
    out(f"## host profile of eager EpGroup ops: {world} x {m['device']}, T={T} H={H} E={E} K={K} bf16, transport "
        f"{a.transport}, commit {m['commit']}, {a.iters} calls per measurement")
    rows, fl = [], None
    for mode in a.modes:
        g = EpGroup(rank.comm, E, H, T, mode=mode, transport=a.transport)
        ops = gpu_ops(g, T, idx, x, w)
        ops = {k: v for k, v in ops.items() if k in a.ops}
        for op in ops:  # first calls: kernels loaded (and compiled on a cold cache)
            ops[op]()
        _jit.settle()
        rank.barrier()
        got = hg.profile_ops(ops, n=a.iters, sync=stream.synchronize, rank0=me == 0, time_host=time_host,
                             time_event=time_event, top=a.top, cprofile_top=a.top, groups=(g,), out=out,
                             title=f" ({mode}, {a.transport}, R={world}, T={T})")
        for r in got:
            r.update(mode=mode, transport=a.transport, host_us_ranks=rank.gather(r["host_us"]),
                     cpu_us_ranks=rank.gather(r["cpu_us"]))
        rows += got
        if fl is None and g.transport == "direct":
            fl = hg.floors(rank, (T * K * H * 2, T * H * 2), a.iters, g._transport, stream)
        rank.barrier()
        g.close()
        del ops, g
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    if fl is None:
        fl = hg.floors(rank, (T * K * H * 2, T * H * 2), a.iters)
    if me == 0:
        hg.finish(rows, fl, m, a.json)
    rank.close()
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap, a = parse_args(argv)
    if a.gpu:
        return _host_gpu().run(ap, a, argv, __file__, gpu_rank)
    st = EpStandIns()
    if a.profile is not None:
        import cProfile
        import pstats

        table = ops(st, a.ranks[0], a.modes[0])
        if a.profile not in table:
            ap.error(f"--profile: one of {', '.join(table)}")
        f = table[a.profile]
        prof = cProfile.Profile()
        prof.runcall(lambda: [f() for _ in range(a.calls)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return 0
    print(f"{'op':14s} {'mode':9s} {'R':>2s} {'host us':>8s} {'launches':>9s} {'allocs':>7s} {'cupy':>5s} "
          f"{'memcpy':>6s}")
    for mode in a.modes:
        for R in a.ranks:
            for name, f in ops(st, R, mode).items():
                us, launches, allocs, ck, mc = _time(st, f, a.calls)
                print(f"{name:14s} {mode:9s} {R:2d} {us:8.1f} {launches:9.0f} {allocs:7.0f} {ck:5.0f} {mc:6.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
