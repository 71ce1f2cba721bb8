"""Where the time goes inside the low-latency EP kernels (issue 32): the in-kernel phase trace of ep_ll_dispatch
and ep_ll_combine (kernels/ep.cu, MOE_RT_LL_TRACE: per block, %globaltimer at phase points), read after each run
of a LowLatencyGroup's dispatch and combine, eager and as a CUDA graph. Nsight Compute cannot profile these
kernels (its replay of a kernel that waits on peers hangs); this trace can.

    MOE_RT_NVRTC_OPTIONS=-DMOE_RT_LL_TRACE python3 tools/launch.py -n 4 tools/profile_ll_phases.py \\
        [--tokens 128] [--partials] [--iters 20]

``--prepare`` traces EpGroup.prepare instead (capacity mode, direct transport, T=4096 unless --tokens: the
one kernel ep_prepare_direct, issue 30's device-time target of 40 us): its send side, barriers and received
side.

Rank 0 prints, per op and mode, each phase's start (relative to the earliest block's kernel entry) and duration:
the median over iterations of the (min, median, max) over blocks, in us, and the kernel span (the last block's
exit less the first block's entry); then every rank's median span. Group: E=256, H=7168, K=8, Tmax = T, bf16.

Phases that span several items of a block (the combine's push, R items per chunk) run from the first item's
start point to the last item's end point. The trace lives in a global of each kernel's module; the tool finds
the module the C core loaded through a CUDA graph of the op (the kernel node's function, cuFuncGetModule,
cuModuleGetGlobal). Kernels built without the macro have no trace: the tool refuses. A trace build keeps its
kernels in a cache folder of its own (MOE_RT_KERNEL_CACHE, unless set): the cache's manifest does not tell
apart builds with other NVRTC options.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's moe_rt

MACRO = "-DMOE_RT_LL_TRACE"
SYMBOL = b"moe_rt_ll_trace"
POINTS = 16  # kernels/ep.cu LL_TRACE_POINTS: points 0..10, the last the block's (smid << 32 | gridDim.x)
# (name, start points (the first recorded one counts), end point), kernels/ep.cu's trace points
PHASES = {
    "dispatch": (("epoch", (0,), 1), ("push table", (2,), 3), ("push rows", (3,), 4), ("fence+signal", (4,), 5),
                 ("push", (2,), 5), ("zero rows", (5, 1), 6), ("own chunks' waits + copies", (6,), 8),
                 ("wait for all", (8, 6), 7), ("slot tables", (7,), 9), ("block", (0,), 10)),
    "combine": (("epoch", (0,), 1), ("push table", (2,), 3), ("push rows", (3,), 4), ("signal", (4,), 5),
                ("push", (2,), 5), ("first flag wait", (6,), 7), ("flag waits", (6,), 8),
                ("owner sums", (7,), 9), ("block", (0,), 10)),
    # EpGroup.prepare in capacity mode on the direct transport: the one kernel ep_prepare_direct (point 5, the
    # system-scope grid barrier before the peers' barrier, exists in builds before 9779b9f only: its two phases
    # show for them; "all barriers" spans both kinds)
    "prepare": (("routing copy", (0,), 1), ("chunk counts", (1,), 2), ("grid barrier", (2,), 3),
                ("place + push", (3,), 4), ("- counts before", (3,), 11), ("- tokens", (11,), 12),
                ("- slot counts", (12,), 13), ("- slot prefixes", (13,), 14), ("- ranks", (14,), 4),
                ("send side", (0,), 4), ("sys grid barrier", (4,), 5),
                ("peer barrier", (5,), 6), ("all barriers", (4,), 6), ("plan offsets", (6,), 7), ("plan rows", (7,), 8),
                ("plan tail", (8,), 10), ("received side", (6,), 10), ("block", (0,), 10)),
}
KERNELS = {"dispatch": "ep_ll_dispatch", "combine": "ep_ll_combine", "prepare": "ep_prepare_direct"}


def parser():
    ap = argparse.ArgumentParser(prog=pathlib.Path(__file__).name, description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per rank, also max_tokens_per_rank (128; 4096 with --prepare)")
    ap.add_argument("--prepare", action="store_true",
                    help="trace EpGroup.prepare (capacity mode, direct transport: ep_prepare_direct) instead of "
                         "the low-latency kernels")
    ap.add_argument("--partials", action="store_true", help="a group with combine_partials=True")
    ap.add_argument("--iters", type=int, default=20, help="traced iterations per op and mode (20)")
    ap.add_argument("--warmup", type=int, default=5, help="untraced iterations first (5)")
    return ap


def traced() -> bool:
    return MACRO in os.environ.get("MOE_RT_NVRTC_OPTIONS", "").split()


class Driver:
    """The few CUDA driver calls that find a loaded kernel's module global (ctypes on libcuda)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def _call(self, name, *args):
        r = getattr(self.lib, name)(*args)
        if r:
            raise RuntimeError(f"{name} failed (CUresult {r})")

    def kernel_globals(self, graph: int) -> list:
        """``(lowered name or None, block size, address, bytes)`` of the trace of each kernel node of ``graph``
        (a CUgraph) whose module has one (the name: None where the driver lacks cuFuncGetName)."""
        n = ctypes.c_size_t(0)
        self._call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(n))
        nodes = (ctypes.c_void_p * n.value)()
        self._call("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(n))
        get_params = getattr(self.lib, "cuGraphKernelNodeGetParams_v2", None) or self.lib.cuGraphKernelNodeGetParams
        get_name = getattr(self.lib, "cuFuncGetName", None)
        found = []
        for node in nodes:
            kind = ctypes.c_int(-1)
            self._call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
            if kind.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
                continue
            # CUDA_KERNEL_NODE_PARAMS(_v2): the CUfunction, then grid x, y, z and block x, y, z (unsigned)
            params = ctypes.create_string_buffer(256)
            r = get_params(ctypes.c_void_p(node), params)
            if r:
                raise RuntimeError(f"cuGraphKernelNodeGetParams failed (CUresult {r})")
            func = ctypes.c_void_p.from_buffer(params, 0)
            block = ctypes.c_uint.from_buffer(params, 20).value
            name = None
            if get_name is not None:
                c = ctypes.c_char_p()
                if get_name(ctypes.byref(c), func) == 0 and c.value:
                    name = c.value.decode()
            mod = ctypes.c_void_p()
            self._call("cuFuncGetModule", ctypes.byref(mod), func)
            ptr, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
            if self.lib.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), mod, SYMBOL) == 0:
                found.append((name, block, ptr.value, size.value))
        return found


def pick(found, op: str):
    """The trace of op's kernel among :meth:`Driver.kernel_globals`' (its name has KERNELS[op]; unnamed: the
    one 512-thread kernel, the barrier being smaller, or prepare's one kernel): ``(address, bytes)``, or None."""
    named = [f for f in found if f[0] is not None and KERNELS[op] in f[0]]
    if not named:
        named = [f for f in found if f[0] is None and (f[1] == 512 or op == "prepare")]
    return named[0][2:] if len(named) == 1 else None


def block_stats(tr: np.ndarray, phases) -> tuple[dict, float, int]:
    """One run's trace ``[blocks, POINTS]`` (ns, 0 where not recorded): ({phase: (start (min, median, max) us
    relative to the earliest entry, duration (min, median, max) us)}, kernel span us, grid)."""
    grid = int(tr[0, POINTS - 1] & 0xFFFFFFFF)
    if grid <= 0:
        raise RuntimeError("the trace has no block: the traced kernel did not run (or another variant ran than the one the CUDA graph captured)")
    tr = tr[:min(grid, tr.shape[0])].astype(np.int64)
    t0 = tr[:, 0][tr[:, 0] > 0].min()
    out = {}
    for name, starts, end in phases:
        s = np.zeros(len(tr), np.int64)
        for p in reversed(starts):  # the first recorded of the start points
            s = np.where(tr[:, p] > 0, tr[:, p], s)
        ok = (s > 0) & (tr[:, end] > 0)
        if not ok.any():
            continue
        st, du = (s[ok] - t0) / 1e3, (tr[ok, end] - s[ok]) / 1e3
        out[name] = (tuple(np.percentile(st, [0, 50, 100])), tuple(np.percentile(du, [0, 50, 100])), int(ok.sum()))
    span = (tr[:, 10][tr[:, 10] > 0].max() - t0) / 1e3 if (tr[:, 10] > 0).any() else float("nan")
    return out, float(span), grid


def timer_step(tr: np.ndarray) -> int:
    """The smallest positive difference between the run's timestamps (ns): the timer's visible resolution."""
    v = np.unique(tr[:, :POINTS - 1][tr[:, :POINTS - 1] > 0])
    d = np.diff(v)
    return int(d[d > 0].min()) if (d > 0).any() else 0


def summarize(runs, phases) -> list[str]:
    """Rank 0's table of one op and mode: per phase the median over ``runs`` (block_stats each)."""
    spans = [r[1] for r in runs]
    lines = [f"  kernel span {np.median(spans):7.2f} us (min {min(spans):.2f}, max {max(spans):.2f} over "
             f"{len(runs)} runs), grid {runs[0][2]}",
             f"  {'phase':16s} {'blocks':>6s}  {'start min / med / max (us)':>28s}  {'duration min / med / max (us)':>30s}"]
    for name, _, _ in phases:
        got = [r[0][name] for r in runs if name in r[0]]
        if not got:
            continue
        st = np.median(np.array([g[0] for g in got]), axis=0)
        du = np.median(np.array([g[1] for g in got]), axis=0)
        nb = int(np.median([g[2] for g in got]))
        lines.append(f"  {name:16s} {nb:6d}  {st[0]:8.2f} {st[1]:9.2f} {st[2]:9.2f}  {du[0]:9.2f} {du[1]:9.2f} "
                     f"{du[2]:9.2f}")
    return lines


def rank_main(a) -> int:
    import importlib.util

    import cupy as cp

    from moe_rt.ep import EpGroup
    from moe_rt.ep_ll import LowLatencyGroup

    spec = importlib.util.spec_from_file_location("host_gpu", pathlib.Path(__file__).with_name("host_gpu.py"))
    hg = importlib.util.module_from_spec(spec)  # tools/host_gpu.py: the rank under the launcher
    spec.loader.exec_module(hg)

    rank = hg.Rank()
    me, world = rank.rank, rank.world
    E, K, H, T = 256, 8, 7168, a.tokens
    out = print if me == 0 else (lambda *_: None)
    x, idx, w = rank.inputs(T, E, H, K)
    if a.prepare:
        g = EpGroup(rank.comm, E, H, T, mode="capacity", transport="direct")
    else:
        g = LowLatencyGroup(rank.comm, E, H, T, topk=K, dtype="bfloat16", combine_partials=a.partials)
    stream = cp.cuda.Stream(non_blocking=True)
    drv = Driver()
    with stream:
        if a.prepare:
            ops = {"prepare": lambda: g.prepare(idx)}
        else:
            recv, counts, h = g.dispatch(x, idx, w)
            y = recv.copy()
            ops = {"dispatch": lambda: g.dispatch(x, idx, w), "combine": lambda: g.combine(h, y)}
        for f in ops.values():
            f()
        stream.synchronize()
        graphs, traces = {}, {}
        for op, f in ops.items():  # a CUDA graph of each op; its kernel node names the module the core loaded
            stream.begin_capture()
            keep = f()
            graphs[op] = (stream.end_capture(), keep)
            got = pick(drv.kernel_globals(graphs[op][0].graph), op)
            if got is None:
                raise RuntimeError(
                    f"the {op} kernel the C core loaded has no {SYMBOL.decode()}: it was built without "
                    f"{MACRO} (its kernel cache {os.environ.get('MOE_RT_KERNEL_CACHE')} holds a build without it?)")
            ptr, size = got
            mem = cp.cuda.UnownedMemory(ptr, size, None, rank.dev)
            traces[op] = cp.ndarray((size // (8 * POINTS), POINTS), cp.uint64, cp.cuda.MemoryPointer(mem, 0))
        out(f"## {'EpGroup.prepare (capacity, direct)' if a.prepare else 'low-latency'} kernel phases: {world} ranks, {rank.torch.cuda.get_device_name()}, T={T} H={H} E={E} "
            f"K={K} bf16{', combine_partials' if a.partials else ''}; {a.iters} traced runs (after {a.warmup})"
            f"; kernel cache {os.environ.get('MOE_RT_KERNEL_CACHE')}")
        for mode in ("eager", "graph"):
            for op, f in ops.items():
                run = (lambda gr=graphs[op][0]: gr.launch(stream)) if mode == "graph" else f
                runs, step = [], []
                for i in range(a.warmup + a.iters):
                    rank.barrier()
                    traces[op].fill(0)
                    run()
                    stream.synchronize()
                    if i >= a.warmup:
                        tr = traces[op].get()
                        runs.append(block_stats(tr, PHASES[op]))
                        step.append(timer_step(tr))
                spans = rank.gather(float(np.median([r[1] for r in runs])))
                out(f"\n# {op}, {mode} (globaltimer step seen: {min(step)} ns)")
                for line in summarize(runs, PHASES[op]):
                    out(line)
                out("  median kernel span per rank (us): " + ", ".join(f"{s:.2f}" for s in spans))
        g.synchronize()
        del graphs
    rank.barrier()
    g.close()
    rank.close()
    return 0


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.tokens is None:
        a.tokens = 4096 if a.prepare else 128
    if a.tokens < 1 or a.iters < 1 or a.warmup < 0:
        ap.error("--tokens and --iters: at least 1; --warmup: at least 0")
    if not traced():
        sys.stderr.write(f"{ap.prog}: the kernels are built without the phase trace: run with "
                         f"MOE_RT_NVRTC_OPTIONS={MACRO} (e.g. MOE_RT_NVRTC_OPTIONS={MACRO} python3 tools/launch.py "
                         f"-n 4 tools/{ap.prog})\n")
        return 2
    from moe_rt import _jit

    why = _jit.no_gpu_reason()
    if why is not None:
        sys.stderr.write(f"{ap.prog}: {why}\n")
        return 2
    if "WORLD_SIZE" not in os.environ:
        sys.stderr.write(f"{ap.prog}: run one process per GPU under the launcher: "
                         f"MOE_RT_NVRTC_OPTIONS={MACRO} python3 tools/launch.py -n R tools/{ap.prog}\n")
        return 2
    os.environ.setdefault("MOE_RT_KERNEL_CACHE", _jit.cache_dir() + "-lltrace")
    return rank_main(a)


if __name__ == "__main__":
    raise SystemExit(main())
