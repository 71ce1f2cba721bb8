"""Benchmark of FP8 block quantization on one GPU: moe_rt's quantize / dequantize kernels against torch eager.

For each T (tokens) at H=7168 and 128-channel blocks, bf16 and fp32 x, it times: the sender-side quantize of a
one-pass FP8 dispatch (`moe_rt.fp8.launch_quantize_packed`: codes and scales into packed rows), `quantize_fp8`
(codes and scales apart, torch arrays) and `dequantize_fp8`, beside the same steps written in torch eager
(per-block amax, divide, cast to float8_e4m3fn; multiply back). Bytes counted: x read once and the codes and
scales written once (quantize), the reverse (dequantize). The copy bandwidth is a device-to-device copy in the
same run.

    python tools/bench_fp8.py [--quick] [--json PATH] [--tokens 4096,16384]
"""
from __future__ import annotations

import sys
from moe_rt.bench import _lib as benchlib

COLUMNS = ["op", "dtype", "T", "H", "ms", "GB/s", "% copy", "torch ms", "x torch"]
H, BLOCK = 7168, 128


def main(argv=None):
    ap = benchlib.parser(__doc__)
    ap.add_argument("--tokens", type=benchlib.positive_int_list, default=None,
                    help="comma-separated token counts (default 4096,16384; --quick: 4096)")
    args = ap.parse_args(argv)
    benchlib.require_gpu(ap.prog)
    import cupy as cp
    import torch

    import moe_rt
    from moe_rt import fp8 as F

    Ts = [4096] if args.quick else (args.tokens or [4096, 16384])
    bw = benchlib.copy_bandwidth()
    table = benchlib.Table("FP8 block quantization (moe_rt kernels vs torch eager)", COLUMNS)
    table.meta["copy_GBps"] = round(bw, 1)
    table.header()
    S, _, rb = F.packed_layout(H, BLOCK)

    def torch_quantize(x):
        xb = x.float().view(x.shape[0], S, BLOCK)
        amax = xb.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        return (xb / scale).to(torch.float8_e4m3fn).view(x.shape), scale.view(x.shape[0], S)

    def torch_dequantize(q, s, dtype):
        return (q.float().view(q.shape[0], S, BLOCK) * s.view(q.shape[0], S, 1)).to(dtype).view(q.shape)

    dtypes = (torch.bfloat16, torch.float32)
    benchlib.progress_start("fp8", len(dtypes) * len(Ts))
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        for T in Ts:
            xt = torch.randn(T, H, device="cuda", dtype=dtype)
            x = cp.from_dlpack(xt)
            packed = cp.empty((T, rb), cp.uint8)
            qb, sb, xb = T * H, T * S * 4, T * H * xt.element_size()  # code, scale and x bytes

            def row(op, fn, nbytes, base):
                ms = benchlib.time_cuda(fn, iters=args.iters, warmup=args.warmup)
                tms = benchlib.time_cuda(base, iters=args.iters, warmup=args.warmup)
                gbs = nbytes / (ms * 1e-3) / 1e9
                table.add(op=op, dtype=name, T=T, H=H, ms=ms, **{"GB/s": gbs, "% copy": 100 * gbs / bw,
                                                                 "torch ms": tms, "x torch": tms / ms})

            stream = cp.cuda.get_current_stream()
            torch.cuda.synchronize()
            row("quantize (packed rows)", lambda: F.launch_quantize_packed(x, packed, BLOCK, x.device.id, stream.ptr),
                xb + T * rb, lambda: torch_quantize(xt))
            row("quantize_fp8", lambda: moe_rt.quantize_fp8(xt), xb + qb + sb, lambda: torch_quantize(xt))
            q, s = moe_rt.quantize_fp8(xt)
            row("dequantize_fp8", lambda: moe_rt.dequantize_fp8(q, s, dtype=name), qb + sb + xb,
                lambda: torch_dequantize(q, s, dtype))
            del xt, x, packed, q, s
            benchlib.progress_advance(f"{name} T={T}")
    table.finish(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
