"""Host time of eager LowLatencyGroup ops on CUDA arrays, on a machine without a GPU (issue 32: the eager round
trip's host share). The device is stood in for: kernels, launches (counted, not made), the transport's device
buffers, the op's array import (``_arrays.Call``) and CuPy's allocations (counted; CuPy arrays over fake
addresses, so the memory pool's own cost is left out). Everything else is the real code path: checks, tables,
kernel and argument set-up, barrier, views. Per op: microseconds of this thread's CPU time per call (the best
of 7 rounds), launches and allocations per call. Group: 2 ranks, E=256, H=7168, Tmax=T=128, K=8, bf16, FP8.

    python tools/profile_ll_host.py [--calls 400] [--profile OP]
"""
from __future__ import annotations

import argparse
import itertools
import math
import time

import numpy as np

_addrs = itertools.count(1 << 40, 1 << 24)
counts = {"launches": 0, "allocs": 0}


def _stand_ins():
    """Put the device's stand-ins in place (this process only)."""
    import cupy

    from moe_rt import _arrays, _ep_direct, _errors, _jit

    class Xp:
        @staticmethod
        def empty(shape, dtype):
            counts["allocs"] += 1
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            n = math.prod(shape) * np.dtype(dtype).itemsize
            mem = cupy.cuda.UnownedMemory(next(_addrs) if n else 0, max(n, 1), None, 0)
            return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))

    class Stream:
        ptr = 7

    class Call:
        def __init__(self, arrays, stream=None, **kw):
            self.backend, self.xp, self.device_id, self.stream, self.framework = "cuda", Xp, 0, Stream(), "devarray"
            self.views = dict(arrays)

        def __getitem__(self, k):
            return self.views[k]

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def out(self, a):
            return a

    class Device:  # the current device stays 0
        def __init__(self, i=None):
            self.id = 0

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    class Kernel:
        def __init__(self, name):
            self.name, self.ptr = name, id(self)

    fns = {}

    def function(file, name):  # the real one: a dict lookup under the current device
        key = (file, name, 0)
        fn = fns.get(key)
        if fn is None:
            fn = fns[key] = Kernel(name)
        return fn

    def launch_raw(fn, grid, block, args, smem, stream):
        counts["launches"] += 1

    _arrays.Call = Call
    _arrays.as_cupy_stream = lambda stream, device_id: Stream()
    _jit.function = function
    _jit.launch_raw = launch_raw
    _jit.device_properties = {0: {"sm_count": 132}}.get
    _errors._words[0] = 64
    _ep_direct._resident_ctas = lambda fn, threads, dev: 264
    cupy.cuda.Device = Device
    return Xp


def _dev(shape, dtype):
    from moe_rt import _arrays

    return _arrays.DevArray(next(_addrs), tuple(shape), np.dtype(dtype), None, 0)


def _group(Xp):
    """Rank 0 of a 2-rank group whose transport and shared buffers are stand-ins (what _setup makes)."""
    from moe_rt import _ep_direct
    from moe_rt.ep_ll import LowLatencyGroup

    comm = type("Comm", (), {"rank": 0, "size": 2, "device": 0, "all_gather": None})()
    g = LowLatencyGroup(comm, 256, 7168, 128, topk=8, fp8=True)
    d = object.__new__(_ep_direct.DirectTransport)
    d.comm, d.device, d.R, d.me, d.lo, d.hi, d.P = comm, 0, 2, 0, 0, 2, 256
    d.timeout_ns, d._stages, d._order, d.closed, d._err_ptr = 10**9, {}, [], False, 64
    d.state = _dev((2,), np.uint32)
    d.bar = type("Sh", (), {"table": _dev((2,), np.int64)})()
    d.flags = type("Sh", (), {"table": _dev((2,), np.int64)})()
    offs, o = {}, 0
    for name, nb in g._regions():
        offs[name] = (o, nb)
        o += -(-nb // 256) * 256
    buf = type("Sh", (), {"local": 1 << 44, "table": _dev((2,), np.int64)})()
    g._transport, g._buf, g._offs = d, buf, offs
    g._tables = {n: buf.table.ptr + off for n, (off, _) in offs.items()}
    g._set_epoch = Xp.empty(1, np.uint32)
    return g


def _time(f, n):
    for _ in range(50):
        f()
    best = None
    for _ in range(7):  # the best of 7 rounds (a shared machine)
        c0 = dict(counts)
        t = time.thread_time()
        for _ in range(n):
            f()
        dt = (time.thread_time() - t) / n * 1e6
        best = dt if best is None else min(best, dt)
    return best, {k: (counts[k] - c0[k]) / n for k in counts}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400, help="calls per round (default 400)")
    ap.add_argument("--profile", default=None, metavar="OP", help="cProfile one op (its name as printed)")
    a = ap.parse_args(argv)
    if a.calls < 1:
        ap.error("--calls: expected a positive number")
    import ml_dtypes

    g = _group(_stand_ins())
    T, K, H = 128, 8, 7168
    bf = np.dtype(ml_dtypes.bfloat16)
    x, idx, w = _dev((T, H), bf), _dev((T, K), np.int32), _dev((T, K), np.float32)
    y, gout, yk = _dev(g._slots_shape(), bf), _dev((T, H), bf), _dev(g._slots_shape(), bf)
    gsw = _dev(g._slots_shape()[:2], np.float32)
    import cupy

    pair = (cupy.ndarray((T, H), np.uint8, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(next(_addrs), T * H,
                                                                                            None, 0), 0)),
            cupy.ndarray((T, g.num_scales), np.float32, cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(next(_addrs), T * g.num_scales * 4, None, 0), 0)))
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
        prof.runcall(lambda: [f() for _ in range(a.calls)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0
    print(f"{'op':30s} {'host us':>8s} {'launches':>9s} {'allocs':>7s}")
    for name, f in ops.items():
        us, c = _time(f, a.calls)
        print(f"{name:30s} {us:8.1f} {c['launches']:9.0f} {c['allocs']:7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
