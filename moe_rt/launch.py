#!/usr/bin/env python3
"""Run N local copies of a Python script, one per GPU:

    python tools/launch.py -n 2 script.py [args...]     (or python -m moe_rt.launch ...)

Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MOE_RT_UID_FILE (a fresh path in a temp
folder, for moe_rt.bootstrap's shared-file exchange) and NCCL_NVLS_ENABLE=0. Output lines are forwarded
with a ``[rank i]`` prefix. If a child fails, the others are terminated (then killed after a grace
period); the launcher exits with the first failing child's status (non-zero), else 0. ``--timeout S``
kills everything after S seconds (exit 124).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


def _pump(stream, prefix, out, lock):
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line.decode(errors="replace"))
            out.flush()
    stream.close()


def main(argv=None) -> int:
    from moe_rt._cli import HelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    ap.add_argument("--timeout", type=float, default=None, help="kill all children after this many seconds")
    ap.add_argument("--grace", type=float, default=10.0, help="seconds between terminate and kill")
    ap.add_argument("--cpu", action="store_true", help="the ranks use no GPU: start them without one")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.nproc < 1:
        ap.error("-n must be >= 1")
    if not a.cpu:  # each rank takes a GPU: without one, say so before starting any
        from moe_rt import _jit

        why = _jit.no_gpu_reason()
        if why is not None:
            sys.stderr.write(f"{ap.prog}: {why} (--cpu starts ranks that need none)\n")
            return 2
    tmp = tempfile.mkdtemp(prefix="moe_rt_launch_")
    lock = threading.Lock()
    procs, pumps = [], []
    try:
        for r in range(a.nproc):
            env = dict(os.environ)
            env.update(RANK=str(r), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(a.nproc),
                       MOE_RT_UID_FILE=os.path.join(tmp, "nccl_uid"), NCCL_NVLS_ENABLE="0",
                       PYTHONUNBUFFERED="1")
            p = subprocess.Popen([sys.executable, a.script, *a.args], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[rank {r}] ", sys.stdout, lock), daemon=True)
            t.start()
            pumps.append(t)
        status = 0
        deadline = None if a.timeout is None else time.monotonic() + a.timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, c = failed[0]
                with lock:
                    print(f"[launch] rank {r} exited with status {c}; stopping the others", flush=True)
                status = c if c > 0 else 128 - c
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                with lock:
                    print(f"[launch] timeout after {a.timeout:g} s; stopping all ranks", flush=True)
                status = 124
                break
            time.sleep(0.05)
        _stop(procs, a.grace)
        for t in pumps:
            t.join(timeout=5)
        return status
    finally:
        _stop(procs, 0)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(procs, grace):
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
