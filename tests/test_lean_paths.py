"""The lean host paths of the hot ops: torch CUDA tensors (results allocated by torch, no DLPack) must give
exactly the bits the same ops give on CuPy arrays (moe_rt.jax's XLA FFI calls: tests/test_jax_ffi.py). CPU part: the DevArray view arithmetic and the launcher's packing."""
import numpy as np
import pytest

from moe_rt import _arrays

BF16 = _arrays.BFLOAT16


# ---- CPU: DevArray ---------------------------------------------------------------------------------------

def test_devarray_views():
    a = _arrays.DevArray(4096, (6, 10), np.dtype(np.float32), owner=None, device_id=0)
    assert (a.size, a.nbytes, a.ndim, a.data.ptr, a.flags.c_contiguous) == (60, 240, 2, 4096, True)
    b = a.reshape(-1)
    assert b.shape == (60,) and b.ptr == 4096
    assert a.reshape(3, -1).shape == (3, 20) and a.reshape((2, 30)).shape == (2, 30)
    c = b[7:19]
    assert c.shape == (12,) and c.ptr == 4096 + 7 * 4 and c.offset == 7
    d = c[2:]
    assert d.shape == (10,) and d.ptr == 4096 + 9 * 4 and d.offset == 9
    assert b[50:80].shape == (10,) and b[70:].shape == (0,)
    assert a.astype(np.float32, copy=False) is a
    with pytest.raises(ValueError, match="cannot reshape"):
        a.reshape(7, 9)


def test_launcher_packs_devarray_pointer():
    from moe_rt import _launch

    a = _arrays.DevArray(0x1234560, (4,), np.dtype(np.int32), owner=None, device_id=0)
    packed = _launch.pack((a, np.int32(-2)))
    assert packed[:8] == (0x1234560).to_bytes(8, "little")
    assert packed[8:12] == np.int32(-2).tobytes()


# ---- GPU: the same bits as on CuPy arrays ----------------------------------------------------------------

def _tie_free(rng, T, E):
    # distinct values per row (a shuffled grid), so the top-k is the same for every implementation
    base = np.arange(E, dtype=np.float64) * (4.0 / E) - 2.0
    return np.stack([rng.permutation(base) for _ in range(T)]).astype(np.float32)


def _np(a):
    if hasattr(a, "detach"):  # torch
        import torch

        a = a.detach()
        return (a.view(torch.int16) if a.dtype == torch.bfloat16 else a).cpu().numpy()
    import cupy

    a = cupy.asnumpy(a)
    return a.view(np.int16) if a.dtype == BF16 else a


def _same(x, y, what):
    xa, ya = _np(x), _np(y)
    assert xa.shape == ya.shape, what
    np.testing.assert_array_equal(xa, ya, err_msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_results_are_torch_tensors_with_cupy_bits(dtype, rng):
    torch = pytest.importorskip("torch")
    import cupy as cp

    import moe_rt

    T, E, K, H = 67, 72, 6, 136
    tdt = getattr(torch, dtype)
    logits_t = torch.tensor(_tie_free(rng, T, E)).cuda().to(tdt)
    bias_t = torch.tensor(rng.standard_normal(E).astype(np.float32) * 0.1).cuda().to(tdt)
    logits_c, bias_c = cp.from_dlpack(logits_t), cp.from_dlpack(bias_t)
    torch.cuda.synchronize()

    def both(fn, *args, **kw):
        tin = [a for a in args]
        cin = [cp.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args]
        r_t = fn(*tin, **kw)
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            r_c = fn(*cin, **{k: (cp.from_dlpack(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
        torch.cuda.synchronize()
        return r_t, r_c

    def check(r_t, r_c, what):
        r_t = r_t if isinstance(r_t, tuple) else (r_t,)
        r_c = r_c if isinstance(r_c, tuple) else (r_c,)
        for i, (a, b) in enumerate(zip(r_t, r_c)):
            if a is None:
                assert b is None
                continue
            assert isinstance(a, torch.Tensor) and a.is_cuda and a.is_contiguous(), what
            _same(a, b, f"{what}[{i}]")

    # router
    for sf, kw in (("softmax", {}), ("sigmoid", {"expert_bias": bias_t, "num_groups": 8, "group_topk": 3})):
        r_t, r_c = both(moe_rt.topk_with_score, logits_t, K, score_function=sf, **kw)
        check(r_t, r_c, f"topk_with_score {sf}")
        probs_t, rmap_t, inter_t = r_t
        g = torch.tensor(rng.standard_normal((T, E)).astype(np.float32)).cuda().to(tdt)
        check(*both(moe_rt.topk_with_score_backward, g, rmap_t, inter_t, K, score_function=sf),
              f"topk_with_score_backward {sf}")
    r_t, r_c = both(moe_rt.scores_for_aux_loss, logits_t, K, "softmax")
    check(r_t, r_c, "scores_for_aux_loss")
    scores_t, smap_t, sinter_t = r_t
    gs = torch.tensor(rng.standard_normal((T, E)).astype(np.float32)).cuda()
    check(*both(moe_rt.scores_for_aux_loss_backward, gs, sinter_t, K, "softmax", dtype=dtype),
          "scores_for_aux_loss_backward")
    counts = smap_t.sum(0)
    losses = []
    for tdt_c in (torch.int32, torch.int64, torch.float32, torch.bfloat16):
        tpe = counts.to(tdt_c)
        r_t, r_c = both(moe_rt.aux_loss, scores_t, tpe, T, E, K, 0.01)
        check(r_t, r_c, f"aux_loss tpe {tdt_c}")
        losses.append(_np(r_t))
        gl = torch.tensor(1.7, device="cuda")
        check(*both(moe_rt.aux_loss_backward, gl, T, tpe, T, E, K, 0.01), f"aux_loss_backward tpe {tdt_c}")
    for v in losses[1:]:  # integer counts read as int32, int64 or float give the same bits
        np.testing.assert_array_equal(v, losses[0])

    # dispatch / combine over plans from an index array and from a routing map
    idx_t = torch.topk(logits_t.float(), K).indices.to(torch.int64)
    idx_t[3, 1] = -1
    x_t = torch.tensor(rng.standard_normal((T, H)).astype(np.float32)).cuda().to(tdt)
    for name, routing, probs in (("idx", idx_t, torch.rand(T, K, device="cuda")),
                                 ("map", rmap_t, probs_t)):
        plan_t = moe_rt.make_plan(routing, E, align_size=4)
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            plan_c = moe_rt.make_plan(cp.from_dlpack(routing), E, align_size=4)
        torch.cuda.synchronize()
        for k in ("dst_row", "src_slot", "seg_start", "counts", "tokens_per_expert"):
            assert isinstance(getattr(plan_t, k), torch.Tensor)
            _same(getattr(plan_t, k), getattr(plan_c, k), f"make_plan {name} {k}")
        pc = cp.from_dlpack(probs)
        xp_t, pp_t = moe_rt.dispatch(x_t, plan_t, probs)
        xp_c, pp_c = moe_rt.dispatch(cp.from_dlpack(x_t), plan_c, pc, stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        check((xp_t, pp_t), (xp_c, pp_c), f"dispatch {name}")
        y_t = moe_rt.combine(xp_t, plan_t, probs)
        y_c = moe_rt.combine(xp_c, plan_c, pc, stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        check(y_t, y_c, f"combine {name}")
        gpp_t = torch.rand(plan_t.num_rows, device="cuda")
        r_t = moe_rt.dispatch_backward(xp_t, plan_t, gpp_t)
        r_c = moe_rt.dispatch_backward(xp_c, plan_c, cp.from_dlpack(gpp_t),
                                       stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        check(r_t, r_c, f"dispatch_backward {name}")
        r_t = moe_rt.combine_backward(y_t, plan_t, xp_t, probs)
        r_c = moe_rt.combine_backward(y_c, plan_c, xp_c, pc, stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        check(r_t, r_c, f"combine_backward {name}")
