"""What ``python -m moe_rt bench`` shows of the benchmarks' rows: the tables, and a PNG plot of the achieved
bandwidth of each op and size against the copy bandwidth measured in the same run, beside the speed-up over
the torch baseline. Works on the rows the benchmarks write with ``--json`` (``{"meta": ..., "rows": [...]}``)."""
from __future__ import annotations

BENCHES = ("router", "permutation", "fp8", "ep", "layer")
PERMUTATION_OPS = ("make_plan", "dispatch", "combine", "dispatch_backward", "combine_backward")
MATPLOTLIB_MISSING = 'the bench plot needs matplotlib: pip install "moe_rt[bench]" (or pass --no-plot)'


def _num(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def points(bench: str, rows: list[dict]) -> list[dict]:
    """One point per op and size: ``{"label", "pct_copy", "speedup", "baseline"}``. ``pct_copy``: the op's
    bytes per second as a percentage of the copy bandwidth (None where it does not apply, as for EP, whose
    wire is NVLink or the network); ``speedup``: the baseline's time over moe_rt's (> 1: moe_rt faster)."""
    if bench not in BENCHES:
        raise ValueError(f"bench: expected one of {', '.join(BENCHES)}, got {bench!r}")
    out = []
    for r in rows:
        if bench == "router":
            label = f"{r.get('op')} {r.get('dtype')} T={r.get('T')} E={r.get('E')}"
            out.append({"label": label, "pct_copy": _num(r.get("% copy")), "speedup": _num(r.get("x eager")),
                        "baseline": "torch eager"})
        elif bench == "permutation":
            if r.get("op") not in PERMUTATION_OPS:
                continue  # variants, floors and replays: in the table, not the plot
            label = f"{r['op']} T={r.get('T')} E={r.get('E')} K={r.get('K')}"
            out.append({"label": label, "pct_copy": _num(r.get("% copy")), "speedup": _num(r.get("x torch")),
                        "baseline": "torch eager"})
        elif bench == "fp8":
            label = f"{r.get('op')} {r.get('dtype')} T={r.get('T')}"
            out.append({"label": label, "pct_copy": _num(r.get("% copy")), "speedup": _num(r.get("x torch")),
                        "baseline": "torch eager"})
        elif bench == "ep":
            chunks = f" chunks {r['chunks']}" if r.get("chunks") not in (None, "") else ""
            label = f"{r.get('op')} {r.get('mode')}{chunks} T={r.get('T')}"
            out.append({"label": label, "pct_copy": None, "speedup": _num(r.get("x_vs_torch")),
                        "baseline": "torch.distributed"})
        elif bench == "layer":
            impl = str(r.get("impl", ""))
            if impl.startswith("moe_rt"):
                out.append({"label": f"{r.get('part')} [{impl}]", "pct_copy": _num(r.get("% copy")),
                            "speedup": None, "baseline": None})
            elif impl in ("torch eager", "jax.jit"):
                out.append({"label": f"{r.get('part')} vs {impl}", "pct_copy": None,
                            "speedup": _num(r.get("x moe_rt")), "baseline": impl})
    return [p for p in out if p["pct_copy"] is not None or p["speedup"] is not None]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3g}"
    return str(v)


def markdown(columns: list[str], rows: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def tables(results: dict) -> str:
    """Each result (``{name: {"meta", "rows"}}``) as a Markdown table under a heading naming its device,
    date, commit and copy bandwidth."""
    parts = []
    for name, res in results.items():
        meta, rows = res.get("meta", {}), res.get("rows", [])
        cols = meta.get("columns") or list(dict.fromkeys(k for r in rows for k in r))
        copy = meta.get("copy GB/s", meta.get("copy_GBps"))
        where = ", ".join(str(x) for x in (meta.get("device"), meta.get("date"),
                                           f"commit {meta['commit']}" if meta.get("commit") else None,
                                           f"copy {copy} GB/s" if copy else None) if x)
        parts.append(f"## {name}: {meta.get('title', '')}" + (f" ({where})" if where else "") + "\n"
                     + markdown(cols, rows))
    return "\n\n".join(parts)


def require_matplotlib():
    """matplotlib's pyplot on the Agg backend, or RuntimeError naming the extra that installs it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(results: dict, path: str) -> int:
    """Write the PNG: left, achieved bandwidth as % of the copy bandwidth per op and size; right, the
    speed-up over the torch baseline. Returns the number of points drawn; ValueError if the
    results hold none."""
    plt = require_matplotlib()
    pts = [(b, p) for b, res in results.items() if b in BENCHES for p in points(b, res.get("rows", []))]
    bw = [(f"{b}: {p['label']}", p["pct_copy"]) for b, p in pts if p["pct_copy"] is not None]
    sp = [(f"{b}: {p['label']}", p["speedup"]) for b, p in pts if p["speedup"] is not None]
    if not bw and not sp:
        raise ValueError("no rows to plot: the benchmarks returned no bandwidth or speed-up figures")
    n = max(len(bw), len(sp), 1)
    fig, axes = plt.subplots(1, 2, figsize=(18, max(3.0, 0.24 * n + 1.8)), squeeze=False,
                             constrained_layout=True)
    devices = sorted({str(res.get("meta", {}).get("device")) for res in results.values()
                      if res.get("meta", {}).get("device")})
    fig.suptitle("moe_rt benchmarks" + (f" on {', '.join(devices)}" if devices else ""))
    for ax, data, title, ref, xlabel in (
            (axes[0][0], bw, "achieved bandwidth (fewest bytes the op must move)", 100.0,
             "% of the measured device-to-device copy bandwidth"),
            (axes[0][1], sp, "speed-up over the torch baseline", 1.0,
             "baseline time / moe_rt time (> 1: moe_rt faster)")):
        ax.set_title(title)
        if not data:
            ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        labels, values = zip(*data)
        y = list(range(len(values)))
        if ref == 100.0:  # a share of the copy ceiling
            colors = ["tab:blue"] * len(values)
        else:  # a speed-up: faster or slower than the baseline
            colors = ["tab:green" if v >= ref else "tab:red" for v in values]
        ax.barh(y, values, color=colors)
        ax.axvline(ref, color="black", linewidth=1, linestyle="--")
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_xlim(0, max(max(values), ref) * 1.12)
        unit = "%" if ref == 100.0 else "x"
        for yi, v in zip(y, values):
            ax.text(v, yi, f" {v:.3g}{unit}", va="center", fontsize=6)
    fig.savefig(path, dpi=110, format="png", bbox_inches="tight")
    plt.close(fig)
    return len(bw) + len(sp)
