"""Timing helpers shared by the benchmarks (moe_rt/bench/*.py, run by ``python -m moe_rt bench`` or
tools/bench_*.py).

Every benchmark times with CUDA events on one stream, warms up first, reports the median of many runs,
rotates between several input sets so repeated runs are not served from L2, and measures the device's
copy bandwidth in the same run (a large device-to-device copy, counting bytes read plus written) so each
row can say what share of that ceiling it reaches.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys

import numpy as np


from moe_rt._cli import (ArgumentParser, HelpFormatter, nonnegative_int, plain_text,  # noqa: E402,F401
                         positive_int, positive_int_list)


def parser(description: str, prog: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=plain_text(description), formatter_class=HelpFormatter)
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--iters", type=positive_int, default=50, help="timed runs per case (median reported)")
    p.add_argument("--warmup", type=nonnegative_int, default=10, help="untimed runs before the timed ones")
    p.add_argument("--quick", action="store_true", help="smallest shapes only")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    return p


def require_gpu(prog: str) -> None:
    """Leave with status 2 and one line on stderr when no CUDA GPU can be used (before any CUDA call, whose
    own error would speak of the driver version)."""
    from moe_rt import _jit

    why = _jit.no_gpu_reason()
    if why is not None:
        sys.stderr.write(f"{prog}: {why}\n")
        sys.exit(2)


# ---- what the benchmarks show while they run -------------------------------------------------------------

QUIET = False  # True: rows are kept but not printed as they come (python -m moe_rt bench prints them at the end)


class Progress:
    """A progress bar on stderr: ``start(label, total)``, then ``advance(note)`` once per unit of work."""

    def __init__(self, stream=None, width: int = 30):
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.label, self.total, self.done = "", 0, 0

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, max(int(total), 1), 0
        self._draw("")

    def advance(self, note: str = "") -> None:
        self.done = min(self.done + 1, self.total)
        self._draw(note)
        if self.done == self.total:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, note: str) -> None:
        n = self.width * self.done // self.total
        self.stream.write(f"\r{self.label} [{'#' * n}{'.' * (self.width - n)}] {self.done}/{self.total} {note}"
                          .ljust(self.width + len(self.label) + 40))
        self.stream.flush()


PROGRESS: Progress | None = None  # set by python -m moe_rt bench


def progress_start(label: str, total: int) -> None:
    if PROGRESS is not None:
        PROGRESS.start(label, total)


def progress_advance(note: str = "") -> None:
    if PROGRESS is not None:
        PROGRESS.advance(note)


def time_cuda(fn, *, iters: int = 50, warmup: int = 10, stream=None) -> float:
    """Median time of ``fn()`` in milliseconds, measured with CUDA events on ``stream`` (CuPy's current
    stream by default). ``fn`` takes no argument; rotate inputs inside it (see :func:`rotating`)."""
    import cupy

    from moe_rt import _jit

    stream = stream or cupy.cuda.get_current_stream()
    for i in range(max(1, warmup)):
        fn()
        if i == 0:
            _jit.settle()  # time the kernels later calls run, not quick ones standing in while those compile
    stream.synchronize()
    times = []
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(iters):
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def time_host(fn, *, iters: int = 50, warmup: int = 10, stream=None) -> float:
    """Median host time of ``fn()`` on the calling thread in microseconds (``time.perf_counter`` around the
    call; the stream is synchronized between calls, outside the timed span, so queued work never backs up)."""
    import time

    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    for _ in range(max(1, warmup)):
        fn()
    stream.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        stream.synchronize()
    return float(np.median(times))


def host_us_back_to_back(fn, calls: int, warmup: int, sync) -> float:
    """Mean host time of ``fn()`` in microseconds over ``calls`` back-to-back calls (no sync between them), after
    ``warmup`` calls and a ``sync()``; synchronized again at the end, outside the timed span."""
    import time

    for _ in range(max(1, warmup)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    sync()
    return us


def run_sides(script: str, argv: list, sides) -> dict:
    """Run ``script argv --side NAME`` once per ``(NAME, env)`` of ``sides``, each in its own process with
    ``env`` added to this one's environment (a switch the library reads once per process), and return
    ``{NAME: the JSON its last line printed}``. A side that fails has its output written to stderr and ends
    this process with its exit status."""
    import os

    out = {}
    for name, env in sides:
        r = subprocess.run([sys.executable, script, *argv, "--side", name], capture_output=True, text=True,
                           env={**os.environ, **env})
        if r.returncode:
            sys.stderr.write(r.stdout + r.stderr)
            raise SystemExit(r.returncode)
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def rotating(items):
    """A callable returning the next item of ``items`` round-robin (for rotating input sets)."""
    state = {"i": 0}

    def nxt():
        v = items[state["i"] % len(items)]
        state["i"] += 1
        return v

    return nxt


def num_copies(bytes_per_set: int, l2_bytes: int) -> int:
    """How many input sets to rotate so that together they exceed the L2 several times over."""
    return int(max(2, min(8, -(-4 * l2_bytes // max(bytes_per_set, 1)))))


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written, 1e9), CUDA events, median."""
    import cupy

    a = cupy.empty(nbytes // 4, dtype=cupy.float32)
    a.fill(1.0)
    b = cupy.empty_like(a)
    ms = time_cuda(lambda: b.__setitem__(Ellipsis, a), iters=iters, warmup=5)
    del a, b
    return 2 * nbytes / (ms * 1e-3) / 1e9


def device_name() -> str:
    import cupy

    p = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    n = p["name"]
    return n.decode() if isinstance(n, bytes) else n


def git_commit() -> str:
    """The commit being measured: MOE_RT_COMMIT (set by whoever copies the tree to a GPU machine without
    its .git), else git."""
    import os

    if os.environ.get("MOE_RT_COMMIT"):
        return os.environ["MOE_RT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


class Table:
    """Rows of results printed as a Markdown table and optionally written as JSON."""

    def __init__(self, title: str, columns: list[str]):
        self.title = title
        self.columns = columns
        self.rows: list[dict] = []
        self.meta = {
            "title": title,
            "device": device_name(),
            "date": datetime.date.today().isoformat(),
            "commit": git_commit(),
            "columns": columns,
        }

    def add(self, **row):
        self.rows.append(row)
        if not QUIET:
            print(" | ".join(_fmt(row.get(c)) for c in self.columns), flush=True)

    def header(self):
        if QUIET:
            return
        print(f"\n## {self.title} ({self.meta['device']}, {self.meta['date']}, commit {self.meta['commit']})")
        for k, v in self.meta.items():
            if k not in ("title", "device", "date", "commit", "columns"):
                print(f"- {k}: {v}")
        print("| " + " | ".join(self.columns) + " |")
        print("|" + "---|" * len(self.columns))

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        for r in self.rows:
            lines.append("| " + " | ".join(_fmt(r.get(c)) for c in self.columns) + " |")
        return "\n".join(lines)

    def finish(self, json_path: str | None):
        if not QUIET:
            print()
            print(self.markdown())
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v >= 100:
            return f"{v:.0f}"
        if v >= 10:
            return f"{v:.1f}"
        return f"{v:.3g}"
    return str(v)


def torch_compile_or_none(fn, enabled: bool):
    """``torch.compile(fn)`` if enabled and it works, else None (the row then shows '-')."""
    if not enabled:
        return None
    try:
        import torch

        return torch.compile(fn)
    except Exception as e:  # pragma: no cover - depends on the machine
        print(f"torch.compile unavailable: {e}", file=sys.stderr)
        return None
