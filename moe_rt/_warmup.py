"""``python -m moe_rt warmup``: compile every registered kernel ahead of use, in parallel worker processes,
into the kernel cache (or a folder to copy elsewhere)."""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed


def _compile_one(file: str, name: str, arch: str, root: str, source_hash: str):
    os.environ["MOE_RT_QUIET"] = "1"  # the parent reports progress
    from moe_rt import _jit

    if _jit.source_hash() != source_hash:
        raise RuntimeError(f"the kernel sources under {_jit.kernels_dir()} or {_jit.include_dir()} changed "
                           "while warmup ran; run it again")
    t0 = time.perf_counter()
    _, _, compiled = _jit.kernel_image(file, name, arch, root=root)
    return compiled, time.perf_counter() - t0


def current_arch() -> str:
    """The NVRTC target of the current CUDA device; RuntimeError when there is none."""
    from moe_rt import _jit

    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device
        n = 0
    if not n:
        raise RuntimeError("no CUDA GPU found: name the architectures to compile for with --arch "
                           "(e.g. --arch sm_80,sm_90)")
    return _jit.arch_for(_jit.device_properties(cupy.cuda.Device().id)["cc"])


class _Progress:
    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream = total, 0, stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self.last = -1

    def step(self, label: str):
        self.done += 1
        pct = 100 * self.done // max(1, self.total)
        if self.tty:
            bar = "#" * (30 * self.done // max(1, self.total))
            self.stream.write(f"\r[{bar:<30}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.1f} s "
                              f"{label[:50]:<50}")
            if self.done == self.total:
                self.stream.write("\n")
        elif pct // 10 != self.last // 10 or self.done == self.total:
            self.stream.write(f"warmup: {self.done}/{self.total} kernels, {time.perf_counter() - self.t0:.1f} s\n")
        self.last = pct
        self.stream.flush()


def warmup(archs=None, out=None, jobs=None, progress: bool = True) -> dict:
    """Compile every registered kernel for each of ``archs`` (default: the current GPU's) into ``out``
    (default: the kernel cache folder), ``jobs`` programs at a time (default: one per CPU core), and write
    the folder's ``manifest.json``. Returns counts and the wall time."""
    import moe_rt  # noqa: F401 - registers every op module's kernels
    from moe_rt import _jit

    archs = [current_arch()] if not archs else [_jit.check_arch(a) for a in archs]
    root = os.path.abspath(os.path.expanduser(out)) if out else _jit.cache_dir()
    os.makedirs(root, exist_ok=True)
    if not os.access(root, os.W_OK):
        raise PermissionError(f"cannot write the kernel cache folder {root}")
    # the largest programs first, so that the pool does not end waiting on one long compile
    order = {"router.cu": 0, "ep.cu": 1, "permutation.cu": 2}
    tasks = sorted(((f, n, a) for a in archs for f, n in _jit.registered(quick=False)),
                   key=lambda t: order.get(t[0], 3))
    jobs = max(1, int(jobs or os.cpu_count() or 1))
    bar = _Progress(len(tasks)) if progress else None
    t0 = time.perf_counter()
    compiled = 0
    with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as ex:
        futs = {ex.submit(_compile_one, f, n, a, root, _jit.source_hash()): (f, n, a) for f, n, a in tasks}
        for fut in as_completed(futs):
            f, n, a = futs[fut]
            c, _ = fut.result()  # a compile error raises here, with NVRTC's log
            compiled += bool(c)
            if bar:
                bar.step(f"{a} {n}")
    manifest = _jit.write_manifest(root, archs)
    return {"kernels": len(tasks), "compiled": compiled, "cached": len(tasks) - compiled, "archs": archs,
            "folder": root, "manifest": str(manifest), "seconds": time.perf_counter() - t0}


def main(argv) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m moe_rt warmup",
        description="Compile every moe_rt kernel ahead of use, in parallel, into the kernel cache (or into "
                    "--out DIR, a folder to copy to other machines; point moe_rt at it with "
                    "MOE_RT_KERNEL_CACHE=DIR).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", default=None,
                   help="comma-separated targets, e.g. sm_80,sm_90 (default: the current GPU's)")
    p.add_argument("--out", default=None, help="folder to fill (default: the kernel cache folder)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error(f"--jobs must be >= 1, got {a.jobs}")
    archs = [s.strip() for s in a.arch.split(",") if s.strip()] if a.arch else None
    if a.arch is not None and not archs:
        p.error("--arch: name at least one architecture, e.g. sm_90")
    try:
        r = warmup(archs, a.out, a.jobs, progress=not a.quiet)
    except (RuntimeError, ValueError, PermissionError) as e:
        print(f"warmup: {e}", file=sys.stderr)
        return 2
    print(f"warmup: {r['kernels']} kernels for {','.join(r['archs'])} in {r['folder']}: {r['compiled']} compiled, "
          f"{r['cached']} already cached, {r['seconds']:.1f} s")
    if a.out:
        print(f"use it with MOE_RT_KERNEL_CACHE={r['folder']}")
    return 0
