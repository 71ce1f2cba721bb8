"""Write BENCHMARKS.md from the JSON files that tools/bench_*.py wrote (``--json``).

    python3 tools/benchmarks_md.py LOGDIR [LOGDIR ...] [-o BENCHMARKS.md]

Each JSON holds ``meta`` (title, device, date, commit, extra facts) and ``rows``; the tables are printed
exactly as measured, one section per file, newest run first when several folders are given.
"""
from __future__ import annotations

import argparse
import glob
import json
import os


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.3g}"
    return str(v)


def section(data: dict) -> str:
    meta, rows = data["meta"], data["rows"]
    cols = meta.get("columns") or (list(rows[0].keys()) if rows else [])
    out = [f"## {meta.get('title', 'benchmark')}", "",
           f"{meta.get('device', '?')}, {meta.get('date', '?')}, commit {meta.get('commit', '?')}"]
    extra = {k: v for k, v in meta.items() if k not in ("title", "device", "date", "commit", "columns")}
    for k, v in extra.items():
        out.append(f"- {k}: {_fmt(v)}")
    out += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+")
    p.add_argument("-o", "--output", default="BENCHMARKS.md")
    p.add_argument("--preamble", default="", help="text placed under the title")
    args = p.parse_args(argv)
    parts = ["# moe_rt benchmarks", "",
             "Latest measured tables, written by `tools/benchmarks_md.py` from the JSON output of "
             "`tools/bench_*.py` (run by `tools/gpu_check.sh`). Times are medians over many runs with CUDA "
             "events after warm-up, inputs rotated beyond L2; `% copy` is the share of the device-to-device "
             "copy bandwidth (read + write) measured in the same run.", ""]
    if args.preamble:
        parts += [args.preamble, ""]
    for d in args.dirs:
        for f in sorted(glob.glob(os.path.join(d, "bench_*.json"))):
            with open(f) as fh:
                parts.append(section(json.load(fh)))
    with open(args.output, "w") as fh:
        fh.write("\n".join(parts))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
