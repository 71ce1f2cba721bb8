"""Host time of eager LowLatencyGroup ops on CUDA arrays, on a machine without a GPU (issue 32: the eager round
trip's host share). The device is stood in for: kernels, launches (counted, not made), the transport's device
buffers, the op's array import (``_arrays.Call``) and CuPy's allocations (counted; CuPy arrays over fake
addresses, so the memory pool's own cost is left out). Everything else is the real code path: checks, tables,
kernel and argument set-up, barrier, views. Per op: microseconds of this thread's CPU time per call (the best
of 7 rounds), launches and allocations per call. Group: 2 ranks, E=256, H=7168, Tmax=T=128, K=8, bf16, FP8.

    python tools/profile_ll_host.py [--calls 400] [--profile OP]

``--gpu`` profiles the ops on real GPUs instead (tools/host_gpu.py: time_host's median, wall and thread CPU time,
eager device time and, for dispatch and combine, the device time of the op alone in a CUDA graph, a breakdown
by wrapped function, a cProfile, reference floors), T=128 (``--tokens``), CuPy arrays on a non-blocking
stream as tools/bench_ep.py --mode low_latency passes them:

    python tools/launch.py -n 4 tools/profile_ll_host.py --gpu [--json FILE]
    python tools/profile_ll_host.py --gpu [-n R] ...     # launches itself (R: MOE_RT_BENCH_EP_NPROC or 2)
"""
from __future__ import annotations

import argparse
import itertools
import math
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's moe_rt


class StandIns:
    """The device stood in for, through ``setattr_`` (default: for good, in this process; a test passes its
    monkeypatch's setattr): kernels loaded from Python (each lookup counted in ``lookups``), launches
    (``on_launch(fn, grid, block, args)``, ``fn.name`` the kernel; default: counted in ``launches``) made
    through ``_jit.launch_raw`` or by the core: its device context (``moe_rt._core.device``) is a planning
    context of ``sm_count`` SMs on which a fused kernel has ``resident`` blocks resident (``resident`` a
    multiple of ``sm_count``), and after each low-latency core call its recorded launches are reported (the
    arguments as the values of the kernel's parameters, in order); the op's array import
    (``moe_rt._arrays.Call``: a CUDA call of framework 'devarray' on stream 7 or an int stream given, results
    handed back as they are, its allocations CuPy's), CuPy allocations (counted in ``allocs``: CuPy arrays
    over fake addresses, an empty one at 0 as CuPy's), streams, the current device (0), the device's error
    word (64), ``resident`` blocks of a fused kernel and ``sm_count`` SMs."""

    def __init__(self, setattr_=setattr, resident=264, sm_count=132):
        import cupy

        from moe_rt import _arrays, _core, _errors, _jit

        self.cupy, self.launches, self.allocs, self.lookups = cupy, 0, 0, 0
        self.addrs = itertools.count(1 << 40, 1 << 24)
        self.on_launch = None
        self._streams = {}
        st = self

        class Xp:
            @staticmethod
            def empty(shape, dtype):
                st.allocs += 1
                return st.array(shape, dtype)

        class Call:
            def __init__(self, arrays, stream=None, **kw):
                self.backend, self.xp, self.device_id, self.framework = "cuda", Xp, 0, "devarray"
                # stream 7, or an int stream given (a test's second stream)
                self.stream = st.stream(stream if type(stream) is int else 7)
                self.stream_ptr = self.stream.ptr
                self.views = dict(arrays)

            def __getitem__(self, k):
                return self.views[k]

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

            def out(self, a):
                return a

            def empty(self, shape, dtype):
                return Xp.empty(shape, dtype)

            scratch = empty

        class Device:
            def __init__(self, i=None):
                self.id = 0

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        class Kernel:
            def __init__(self, name):
                self.name, self.ptr = name, id(self)

        def function(file, name):
            st.lookups += 1
            return Kernel(name)

        def launch_raw(fn, grid, block, args, smem, stream):
            st.launches += 1
            if st.on_launch is not None:
                st.on_launch(fn, grid, block, args)

        per_sm = resident // sm_count  # the fused kernels' 512-thread blocks an SM holds: set by their registers
        if per_sm < 1 or per_sm > 4 or per_sm * sm_count != resident:
            raise ValueError(f"resident={resident}: expected 1 to 4 blocks on each of the {sm_count} SMs")
        ctx = _core.planning(sm_count=sm_count, assumed_regs=65536 // (512 * per_sm) // 8 * 8)

        def recorded(f):  # a core call, then its launches as the planning context recorded them
            def call(*args):
                f(*args)
                if st.on_launch is None:  # counted alone (the least time of the stand-in's own in the op's)
                    st.launches += len(ctx.last_plan())
                    return
                for i, launch in enumerate(ctx.last_plan()):
                    launch_raw(Kernel(launch[1]), launch[2], launch[3], ctx.last_plan_args(i), 0, args[-1])
            return call

        setattr_(_jit, "function", function)
        setattr_(_jit, "launch_raw", launch_raw)
        setattr_(_jit, "device_properties", lambda dev: {"sm_count": sm_count})
        setattr_(_errors, "word", lambda dev: 64)
        setattr_(_core, "device", lambda dev: ctx)
        for name in ("ll_dispatch", "ll_combine", "ll_combine_bwd", "ep_direct_barrier", "ep_direct_dispatch",
                     "ep_direct_combine", "ep_prepare", "quantize_fp8_rows", "pack_fp8_rows", "ep_gather_slots"):
            setattr_(_core, name, recorded(getattr(_core, name)))
        setattr_(_arrays, "Call", Call)
        setattr_(_arrays, "as_cupy_stream", lambda stream, dev: st.stream(9))
        setattr_(cupy.cuda, "Device", Device)

    def stream(self, ptr):
        """A stand-in CuPy stream of address ``ptr`` (one object per address, as made once: the stand-ins'
        own cost stays out of the op's time)."""
        s = self._streams.get(ptr)
        if s is None:
            s = self._streams[ptr] = type("Stream", (), {"ptr": ptr})()
        return s

    def array(self, shape, dtype):
        """A CuPy array over a fake address (nothing reads or writes its memory); an empty one at address 0,
        as CuPy's."""
        cupy = self.cupy
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = math.prod(shape) * np.dtype(dtype).itemsize
        mem = cupy.cuda.UnownedMemory(next(self.addrs) if n else 0, max(n, 1), None, 0)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))

    def dev(self, shape, dtype):
        """A DevArray over a fake address."""
        from moe_rt import _arrays

        return _arrays.DevArray(next(self.addrs), tuple(shape), np.dtype(dtype), None, 0)

    def group(self, R, me, E, H, Tmax, K, dtype="bfloat16", num_buffers=1, fp8=False, combine_partials=False,
              transport="direct"):
        """A LowLatencyGroup of rank ``me`` of R whose transport and shared buffers are stand-ins (what its
        _setup makes, without CUDA): the error word at 96, the peer tables of the shared buffers at 2**50 plus
        their offsets; ``transport="nccl"``: the NCCL transport's regions from 2**56 and a made-up
        communicator at 0x7000 (the planning context records the launches, not the exchanges)."""
        from moe_rt import _core, _ep_direct
        from moe_rt.ep_ll import LowLatencyGroup

        comm = type("Comm", (), {"rank": me, "size": R, "device": 0, "all_gather": None, "handle": 0x7000})()
        g = LowLatencyGroup(comm, E, H, Tmax, topk=K, dtype=dtype, num_buffers=num_buffers, fp8=fp8,
                            combine_partials=combine_partials, transport=transport)
        if transport == "nccl":
            offs, o = {}, 0
            for name, nb in g._nccl_regions():
                offs[name] = (o, nb)
                o += -(-nb // 256) * 256
            buf = type("Nccl", (), {"local": 1 << 56, "failed_op": lambda self: None, "close": lambda self: None})()
            g._adopt(buf, buf, offs)
            g.transport = "nccl"
            g._wait = lambda stream, op, timeout=None: None  # the first call's host wait for its stream
            return g
        d = object.__new__(_ep_direct.DirectTransport)
        d.comm, d.device, d.R, d.me, d.lo, d.hi, d.P = comm, 0, R, me, 0, R, 2 * Tmax * num_buffers
        d.timeout_ns, d._stages, d._order, d.closed, d._err_ptr = 10**9, {}, [], False, 96
        d._pairs, d._views = {}, {}
        d._scratch_mem, d._retired = {}, []
        d.state = self.dev((4,), np.uint32)
        d.bar = type("Sh", (), {"table": self.dev((R,), np.int64)})()
        d.flags = type("Sh", (), {"table": self.dev((R,), np.int64)})()
        d._core = _core.ep_direct_group_create(_core.device(0), R, me, 0, R, d.P, d.timeout_ns, d.bar.table.data.ptr,
                                               d.flags.table.data.ptr, d.state.data.ptr, d._err_ptr)
        offs, o = {}, 0
        for name, nb in g._regions():
            offs[name] = (o, nb)
            o += -(-nb // 256) * 256
        buf = type("Sh", (), {"local": 1 << 56, "table": self.dev((R,), np.int64)})()  # apart from the arrays
        g._adopt(d, buf, offs)
        g._tables = {n: (1 << 50) + off for n, (off, _) in offs.items()}
        g._set_epoch = self.array(num_buffers + 1, np.uint32)
        return g


def _time(st, f, n):
    """(the best of 7 rounds of ``n`` calls: microseconds of this thread's CPU time per call, launches per call,
    allocations per call)."""
    for _ in range(50):
        f()
    best = None
    for _ in range(7):  # the best of 7 rounds (a shared machine)
        c0 = (st.launches, st.allocs)
        t = time.thread_time()
        for _ in range(n):
            f()
        dt = (time.thread_time() - t) / n * 1e6
        best = dt if best is None else min(best, dt)
    return best, (st.launches - c0[0]) / n, (st.allocs - c0[1]) / n


GPU_OPS = ("dispatch", "combine", "dispatch_bwd", "combine_bwd", "dispatch+combine")


def _host_gpu():
    """tools/host_gpu.py (the GPU mode's machinery), loaded once by path."""
    import importlib.util

    mod = sys.modules.get("host_gpu")
    if mod is None:
        spec = importlib.util.spec_from_file_location("host_gpu", pathlib.Path(__file__).with_name("host_gpu.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["host_gpu"] = mod
        spec.loader.exec_module(mod)
    return mod


def parser():
    ap = argparse.ArgumentParser(prog=pathlib.Path(__file__).name, description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400, help="calls per round (default 400)")
    ap.add_argument("--profile", default=None, metavar="OP", help="cProfile one op (its name as printed)")
    ap.add_argument("--transport", default="direct", choices=("direct", "nccl"),
                    help="the group's transport (without --gpu; the NCCL transport's exchanges are not stood in "
                         "for: its host time here leaves them out); with --gpu set MOE_RT_LL_TRANSPORT")
    _host_gpu().add_arguments(ap, GPU_OPS, 128, "device time (eager; dispatch and combine also as a CUDA graph)")
    return ap


def parse_args(argv=None):
    return _host_gpu().parse(parser, argv)


def gpu_rank(a):
    """One rank of the GPU mode (under the launcher): LowLatencyGroup on CuPy arrays on a non-blocking stream,
    as tools/bench_ep.py --mode low_latency calls it."""
    import cupy as cp
    import torch

    from moe_rt import _jit
    from moe_rt.ep_ll import LowLatencyGroup

    hg = _host_gpu()
    rank = hg.Rank()
    me, world = rank.rank, rank.world
    E, K, H, T = 256, 8, 7168, a.tokens
    gen = torch.Generator(device="cuda").manual_seed(1234 + me)
    idx_t = torch.topk(torch.rand(T, E, device="cuda", generator=gen), K, dim=1).indices.to(torch.int32)
    w_t = torch.rand(T, K, device="cuda", generator=gen)
    x_t = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    gout_t = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    torch.cuda.synchronize()
    x, w, idx, gout = cp.from_dlpack(x_t), cp.from_dlpack(w_t), cp.from_dlpack(idx_t), cp.from_dlpack(gout_t)
    out = print if me == 0 else (lambda *_: None)
    m = hg.meta(rank, tool="profile_ll_host --gpu", tokens=T, hidden=H, experts=E, topk=K, dtype="bfloat16",
                transport="direct (LowLatencyGroup)", iters=a.iters)
    out(f"## host profile of eager LowLatencyGroup ops: {world} x {m['device']}, T={T} H={H} E={E} K={K} bf16, "
        f"commit {m['commit']}, {a.iters} calls per measurement")
    g = LowLatencyGroup(rank.comm, E, H, T, topk=K, dtype="bfloat16")
    stream = cp.cuda.Stream(non_blocking=True)

    time_host, time_event = hg.timers(rank, a.iters, stream)

    with stream:
        recv, counts, h = g.dispatch(x, idx, w)
        y = recv.copy()
        gsw = cp.ones(g._slots_shape()[:2], cp.float32)
        g.combine(h, y)
        g.synchronize()
        ops = {"dispatch": lambda: g.dispatch(x, idx, w), "combine": lambda: g.combine(h, y),
               "dispatch_bwd": lambda: g.dispatch_bwd(h, y, gsw), "combine_bwd": lambda: g.combine_bwd(h, gout),
               "dispatch+combine": lambda: g.combine(g.dispatch(x, idx, w)[-1], y)}
        ops = {k: v for k, v in ops.items() if k in a.ops}
        for f in ops.values():
            f()
        _jit.settle()
        rank.barrier()
        rows = hg.profile_ops(ops, n=a.iters, sync=stream.synchronize, rank0=me == 0, time_host=time_host,
                              time_event=time_event, top=a.top, cprofile_top=a.top, groups=(g,), out=out,
                              title=f" (low latency, R={world}, T={T})")
        for r in rows:  # the same op captured alone in a CUDA graph: its device time
            graph_us = None
            if r["op"] in ("dispatch", "combine"):
                f = ops[r["op"]]
                f()
                stream.synchronize()
                stream.begin_capture()
                keep = f()  # noqa: F841  (the captured call's outputs live as long as the graph)
                graph = stream.end_capture()
                graph_us = time_event(lambda: graph.launch(stream))
                del graph, keep
            r.update(mode="low_lat", graph_us=graph_us, host_us_ranks=rank.gather(r["host_us"]),
                     cpu_us_ranks=rank.gather(r["cpu_us"]))
        g.synchronize()
        fl = hg.floors(rank, (int(y.nbytes), T * H * 2), a.iters, g._transport, stream)
    if me == 0:
        hg.finish(rows, fl, m, a.json, ["graph (CUDA events, the op alone in a CUDA graph): " + ", ".join(
            f"{r['op']} {r['graph_us']:.1f} us" for r in rows if r.get("graph_us") is not None)])
    rank.barrier()
    g.close()
    rank.close()
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap, a = parse_args(argv)
    if a.gpu:
        return _host_gpu().run(ap, a, argv, __file__, gpu_rank)
    st = StandIns()
    T, K, H = 128, 8, 7168
    g = st.group(2, 0, 256, H, T, K, fp8=True, transport=a.transport)
    bf = g.dtype
    x, idx, w = st.dev((T, H), bf), st.dev((T, K), np.int32), st.dev((T, K), np.float32)
    y, gout, yk = st.dev(g._slots_shape(), bf), st.dev((T, H), bf), st.dev(g._slots_shape(), bf)
    gsw = st.dev(g._slots_shape()[:2], np.float32)
    pair = (st.array((T, H), np.uint8), st.array((T, g.num_scales), np.float32))  # CuPy, as a pair is taken
    h = g.dispatch(x, idx, w)[-1]

    def round_trip():
        g.combine(g.dispatch(x, idx, w)[-1], y)

    def split():
        g.dispatch(x, idx, w, return_recv_hook=True)[-1]()

    ops = {"dispatch": lambda: g.dispatch(x, idx, w), "combine": lambda: g.combine(h, y),
           "dispatch+combine": round_trip, "dispatch split+hook": split,
           "dispatch fp8 (uint8 pair)": lambda: g.dispatch(pair, idx, w, fp8=True),
           "dispatch fp8 dequantize": lambda: g.dispatch(x, idx, w, fp8=True, dequantize=True),
           "dispatch_bwd": lambda: g.dispatch_bwd(h, y, gsw), "combine_bwd": lambda: g.combine_bwd(h, gout),
           "combine_bwd with expert_out": lambda: g.combine_bwd(h, gout, yk)}
    if a.profile is not None:
        import cProfile
        import pstats

        if a.profile not in ops:
            ap.error(f"--profile: one of {', '.join(ops)}")
        prof = cProfile.Profile()
        f = ops[a.profile]


        def run():  # each result dropped before the next call, as in the timed rounds
            for _ in range(a.calls):
                f()

        prof.runcall(run)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0
    print(f"{'op':30s} {'host us':>8s} {'launches':>9s} {'allocs':>7s}")
    for name, f in ops.items():
        us, launches, allocs = _time(st, f, a.calls)
        print(f"{name:30s} {us:8.1f} {launches:9.0f} {allocs:7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
