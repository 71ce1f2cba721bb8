"""Inputs and NumPy-reference outputs for examples/moe_layer.c, written to one binary file.

    python3 examples/make_reference.py moe_layer.bin [--seed N]

Layout (little-endian): the 8 bytes ``MOERTEX1``, six int64 sizes ``T E K H A N``, the float32 ``coeff`` of the
aux loss, then the arrays of ``ARRAYS`` in that order, raw and C-contiguous (float32, int32 or uint8). Every
expected value comes from moe_rt's CPU backend, the NumPy reference (moe_rt/reference/)."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt
import moe_rt  # noqa: E402

T, E, K, H, A = 37, 16, 4, 48, 8  # odd token count; each expert's rows padded to a multiple of A
COEFF = np.float32(0.01)
# (name, dtype, shape) in file order; N = the plan's row count
ARRAYS = [
    ("logits", np.float32, "TE"), ("x", np.float32, "TH"), ("expert_scale", np.float32, "E"),
    ("grad_y", np.float32, "TH"),
    ("topk_idx", np.int32, "TK"), ("topk_weights", np.float32, "TK"), ("probs", np.float32, "TE"),
    ("routing_map", np.uint8, "TE"), ("counts", np.int32, "E"), ("tokens_per_expert", np.int32, "E"),
    ("seg_start", np.int32, "e"), ("x_permuted", np.float32, "NH"), ("probs_permuted", np.float32, "N"),
    ("y", np.float32, "TH"), ("grad_y_permuted", np.float32, "NH"), ("grad_weights", np.float32, "TK"),
    ("grad_x", np.float32, "TH"), ("grad_logits", np.float32, "TE"), ("aux_scores", np.float32, "TE"),
    ("aux_loss", np.float32, "1"), ("aux_grad_logits", np.float32, "TE"),
]


def expert(rows, seg_start, scale):
    """The example's expert: row r of expert e is multiplied by scale[e] (fp32)."""
    out = np.zeros_like(rows)
    for e in range(len(scale)):
        a, b = seg_start[e], seg_start[e + 1]
        out[a:b] = rows[a:b] * scale[e]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=2026)
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    logits = rng.standard_normal((T, E)).astype(np.float32)  # continuous: no ties
    x = rng.standard_normal((T, H)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, E).astype(np.float32)
    grad_y = rng.standard_normal((T, H)).astype(np.float32)

    idx, w = moe_rt.topk_indices_with_score(logits, K, score_function="softmax")
    probs, rmap, inter = moe_rt.topk_with_score(logits, K, score_function="softmax")
    plan = moe_rt.make_plan(idx, E, align_size=A)
    N = plan.num_rows
    xp, pp = moe_rt.dispatch(x, plan, w)
    yp = expert(xp, plan.seg_start, scale)
    y = moe_rt.combine(yp, plan, w)
    gyp, gw = moe_rt.combine_backward(grad_y, plan, yp, w)
    gxp = expert(gyp, plan.seg_start, scale)  # the expert is linear: its backward scales the same way
    gx, _ = moe_rt.dispatch_backward(gxp, plan)
    # the router's gradient: grad of the dense probs from the slot weights' gradient
    grad_probs = np.zeros((T, E), np.float32)
    np.put_along_axis(grad_probs, idx.astype(np.int64), gw, axis=1)
    grad_logits = moe_rt.topk_with_score_backward(grad_probs, rmap, inter, K, score_function="softmax")
    scores, _, inter_aux = moe_rt.scores_for_aux_loss(logits, K, "softmax")
    loss = moe_rt.aux_loss(scores, plan.counts, T, E, K, float(COEFF))
    grad_scores = moe_rt.aux_loss_backward(np.float32(1.0), T, plan.counts, T, E, K, float(COEFF))
    aux_grad_logits = moe_rt.scores_for_aux_loss_backward(grad_scores, inter_aux, K, "softmax")

    values = dict(logits=logits, x=x, expert_scale=scale, grad_y=grad_y, topk_idx=idx, topk_weights=w, probs=probs,
                  routing_map=rmap.astype(np.uint8), counts=plan.counts, tokens_per_expert=plan.tokens_per_expert,
                  seg_start=plan.seg_start, x_permuted=xp, probs_permuted=pp, y=y, grad_y_permuted=gyp,
                  grad_weights=gw, grad_x=gx, grad_logits=grad_logits, aux_scores=scores,
                  aux_loss=np.asarray(loss).reshape(1), aux_grad_logits=aux_grad_logits)
    dims = {"T": T, "E": E, "K": K, "H": H, "N": N, "e": E + 1, "1": 1}
    with open(a.out, "wb") as f:
        f.write(b"MOERTEX1")
        f.write(np.array([T, E, K, H, A, N], "<i8").tobytes())
        f.write(np.array([COEFF], "<f4").tobytes())
        for name, dt, shape in ARRAYS:
            arr = np.ascontiguousarray(np.asarray(values[name]), dtype=dt)
            want = tuple(dims[c] for c in shape)
            if arr.size != int(np.prod(want)):
                raise RuntimeError(f"{name}: {arr.shape}, expected {want}")
            f.write(arr.tobytes())
    print(f"wrote {a.out}: T={T} E={E} K={K} H={H} align_size={A} rows={N}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
