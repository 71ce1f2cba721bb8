"""moe_rt's command line.

commands:
  info    versions of moe_rt, Python, NumPy, CuPy, CUDA, NVRTC, NCCL, torch and JAX; the GPUs and the
          kernel cache (runs anywhere)
  demo    a MoE layer, forward and backward, in torch, JAX or CuPy on moe_rt's ops, checked against the
          same layer in plain framework code and timed per stage (--ep N spreads it over N GPUs; without
          a GPU it runs the NumPy reference path at a small size)
  warmup  compile every kernel ahead of use into the kernel cache
  bench   the benchmarks (router, permutation, fp8, ep, layer or all) on the GPU against the torch baselines:
          tables and a PNG plot (needs matplotlib: pip install "moe_rt[bench]")

"python -m moe_rt COMMAND --help" describes each command's flags.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys


def _version_of(module: str):
    try:
        m = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - report any import failure as absent
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:120]
    return getattr(m, "__version__", "?"), None


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device
        return 0


def _fmt_cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def info_lines() -> list[str]:
    """The lines of ``python -m moe_rt info``. Never raises: absent pieces are reported as such."""
    import numpy

    import moe_rt

    lines = [f"moe_rt      {moe_rt.__version__}  ({os.path.dirname(moe_rt.__file__)})",
             f"python      {sys.version.split()[0]}",
             f"numpy       {numpy.__version__}"]
    v, err = _version_of("ml_dtypes")
    lines.append(f"ml_dtypes   {v if v else 'not installed (' + err + ')'}")

    cupy_v, err = _version_of("cupy")
    gpus, gpus_cc = [], []
    if cupy_v is None:
        lines.append(f"cupy        not installed ({err}); CUDA arrays unavailable, CPU reference only")
    else:
        import cupy

        lines.append(f"cupy        {cupy_v}")
        try:
            lines.append(f"cuda runtime {_fmt_cuda_version(cupy.cuda.runtime.runtimeGetVersion())}")
        except Exception as e:  # noqa: BLE001
            lines.append(f"cuda runtime unavailable ({e})")
        try:
            drv = cupy.cuda.runtime.driverGetVersion()
            lines.append(f"cuda driver {_fmt_cuda_version(drv) if drv else 'none'}")
        except Exception as e:  # noqa: BLE001
            lines.append(f"cuda driver none ({type(e).__name__})")
        try:
            from cupy.cuda import nvrtc

            lines.append("nvrtc       {}.{}".format(*nvrtc.getVersion()))
        except Exception as e:  # noqa: BLE001
            lines.append(f"nvrtc       not found ({str(e).splitlines()[0][:100]})")
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception:  # noqa: BLE001 - no driver or no device
            n = 0
        for i in range(n):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
            gpus_cc.append((int(p["major"]), int(p["minor"])))
            gpus.append(f"gpu {i}       {name}, sm_{p['major']}{p['minor']}, "
                        f"{p['totalGlobalMem'] / 2**30:.1f} GiB, {p['multiProcessorCount']} SMs")
    lines.extend(_cache_lines(gpus_cc))
    try:
        from moe_rt import _comm

        lines.append("nccl        {}.{}.{}  ({})".format(*_comm.nccl_version(), _comm.library_path()))
    except Exception as e:  # noqa: BLE001
        lines.append(f"nccl        not found ({str(e).splitlines()[0][:120]})")
    lines.extend(gpus or ["gpus        none (ops on CPU arrays run the NumPy reference)"])
    for fw in ("torch", "jax"):
        v, err = _version_of(fw)
        lines.append(f"{fw:<11} {v if v else 'not importable'}")
    return lines


def _cache_lines(gpus_cc) -> list[str]:
    """The kernel cache folder, its size, and how many kernels of this build it holds for each GPU's
    architecture (for each architecture folder in it, without a GPU)."""
    import moe_rt  # noqa: F401 - registers every op module's kernels
    from moe_rt import _jit

    root = _jit.cache_dir()
    lines = [f"kernel cache {root}  ({_jit.cache_size(root) / 2**20:.1f} MiB)"]
    try:
        archs = sorted({_jit.arch_for(cc) for cc in gpus_cc})
        if not archs and os.path.isdir(root):
            archs = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        total = len(_jit.registered(quick=False))
        for a in archs:
            lines.append(f"  {a}: {_jit.cached_count(a, root)} of {total} kernels of this build cached"
                         " (python -m moe_rt warmup compiles the rest)")
    except Exception as e:  # noqa: BLE001 - no NVRTC: report, never raise
        lines.append(f"  cached kernels unknown ({str(e).splitlines()[0][:100]})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_rt", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{info,demo,warmup,bench}")
    sub.add_parser("info", help="versions, GPUs, NCCL, kernel cache, frameworks")
    sub.add_parser("demo", help="a MoE layer forward+backward on moe_rt (--framework torch|jax|cupy, --ep N), "
                                "checked and timed", add_help=False)
    sub.add_parser("warmup", help="compile every kernel ahead of use into the kernel cache (or --out DIR)",
                   add_help=False)
    sub.add_parser("bench", help="the benchmarks against torch: tables and a PNG plot", add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "warmup":
        from moe_rt import _warmup

        return _warmup.main(argv[1:])
    if argv and argv[0] == "demo":
        from moe_rt import demo

        return demo.main(argv[1:])
    if argv and argv[0] == "bench":
        from moe_rt import bench

        return bench.main(argv[1:])
    args = p.parse_args(argv)
    if args.command == "info":
        print("\n".join(info_lines()))
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    code = main()
    if sys.argv[1:2] == ["demo"]:
        # The demo has finished and printed its report. It leaves without the interpreter's teardown: on
        # the H100 test machine (torch 2.11, CuPy 14, Python 3.12) the torch demo aborted at exit in 2 of 6
        # runs ("terminate called without an active exception", after all of its output), a race between a
        # library's worker thread and finalization; the exit status is the demo's own.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
