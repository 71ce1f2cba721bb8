"""``python -m moe_rt bench``: the benchmarks of moe_rt's ops on the GPU against the torch baselines.

router (top-k and the aux loss, torch eager and torch.compile beside), permutation (make_plan, dispatch,
combine and their backward ops; torch's argsort and index ops beside), fp8 (the FP8 block quantize and
dequantize kernels; the same steps in torch eager beside), ep (expert-parallel prepare, dispatch
and combine on 2 GPUs; torch.distributed beside), layer (a whole MoE layer step, forward and backward, in
torch and JAX). Prints each table, and writes a PNG: the achieved bandwidth of each op and size against the
copy bandwidth measured in the same run, and the speed-up over the torch baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from moe_rt.bench import _lib, report

PROG = "python -m moe_rt bench"


def parser() -> argparse.ArgumentParser:
    text = __doc__.split(": ", 1)[1].strip()
    p = _lib.ArgumentParser(prog=PROG, description=text[0].upper() + text[1:],
                                formatter_class=_lib.HelpFormatter)
    p.add_argument("which", nargs="?", default="all", choices=report.BENCHES + ("all",),
                   help="which benchmark (all: every one; ep only with 2 or more GPUs)")
    p.add_argument("--quick", action="store_true", help="the target shape only, fewer runs (minutes, not hours)")
    p.add_argument("--iters", type=_lib.positive_int, default=50, help="timed runs per case (median reported)")
    p.add_argument("--warmup", type=_lib.nonnegative_int, default=10, help="untimed runs before the timed ones")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--plot", default="bench.png", metavar="FILE", help="the PNG to write")
    p.add_argument("--no-plot", action="store_true", help="tables only (no matplotlib needed)")
    p.add_argument("--json", metavar="FILE", help="also write every table's rows to this file")
    return p


def _common(args) -> list[str]:
    a = ["--iters", str(args.iters), "--warmup", str(args.warmup)]
    return a + ["--quick"] * args.quick + ["--no-compile"] * args.no_compile


def _run_in_process(name, args, tmp) -> dict:
    """Run benchmark ``name`` here, its rows printed at the end; returns ``{table name: {"meta", "rows"}}``."""
    import importlib

    mod = importlib.import_module(f"moe_rt.bench.{name}")
    path = os.path.join(tmp, f"{name}.json")
    mod.main(_common(args) + ["--json", path])
    out = {}
    with open(path) as f:
        out[name] = json.load(f)
    extra = os.path.join(tmp, f"{name}_overhead.json")  # the layer benchmark's adapter-overhead table
    if os.path.exists(extra):
        with open(extra) as f:
            out[f"{name} adapter overhead"] = json.load(f)
    return out


def _run_ep(args, tmp) -> dict:
    """The EP benchmark on 2 GPUs, one process each (its output kept in a log, shown if it fails)."""
    path, log = os.path.join(tmp, "ep.json"), os.path.join(tmp, "ep.log")
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)  # the benchmark launches its ranks
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with open(log, "w") as f:
        code = subprocess.call([sys.executable, "-m", "moe_rt.bench.ep", *_common(args), "--json", path],
                               stdout=f, stderr=subprocess.STDOUT, env=env)
    if code != 0 or not os.path.exists(path):
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"the EP benchmark failed (exit status {code}); the end of its output:\n{tail}")
    with open(path) as f:
        return {"ep": json.load(f)}


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not args.no_plot:
        d = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(d):
            p.error(f"--plot: folder {d} does not exist")
        try:
            report.require_matplotlib()
        except RuntimeError as e:  # before hours of benchmarks, not after
            sys.stderr.write(f"{PROG}: {e}\n")
            return 2
    _lib.require_gpu(PROG)
    import cupy

    gpus = cupy.cuda.runtime.getDeviceCount()
    names = list(report.BENCHES) if args.which == "all" else [args.which]
    if "ep" in names and gpus < 2:
        if args.which == "ep":
            sys.stderr.write(f"{PROG}: ep needs 2 CUDA GPUs, found {gpus}\n")
            return 2
        names.remove("ep")
        print(f"(ep skipped: it needs 2 CUDA GPUs, found {gpus})", flush=True)
    results, failed = {}, []
    _lib.QUIET, _lib.PROGRESS = True, _lib.Progress()
    try:
        with tempfile.TemporaryDirectory(prefix="moe_rt_bench_") as tmp:
            for name in names:
                try:
                    if name == "ep":
                        _lib.PROGRESS.start("ep", 1)  # its ranks run in their own processes
                        results.update(_run_ep(args, tmp))
                        _lib.PROGRESS.advance()
                    else:
                        results.update(_run_in_process(name, args, tmp))
                except Exception as e:  # noqa: BLE001 - report it, go on with the other benchmarks
                    sys.stderr.write(f"\n{PROG}: {name} failed: {type(e).__name__}: {e}\n")
                    failed.append(name)
    finally:
        _lib.QUIET, _lib.PROGRESS = False, None
    if results:
        print(report.tables(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if results and not args.no_plot:
        try:
            n = report.plot(results, args.plot)
            print(f"\nplot: {os.path.abspath(args.plot)} ({n} bars)")
        except ValueError as e:
            sys.stderr.write(f"{PROG}: no plot: {e}\n")
            failed.append("plot")
    if failed:
        sys.stderr.write(f"{PROG}: failed: {', '.join(failed)}\n")
        return 1
    return 0
