"""moe_rt.jax's capacity-mode EP ops as XLA FFI custom calls (csrc/xla_ffi.c moe_rt_xla_ep_*) for groups on the
direct transport, the buffer_callback path for the others (moe_rt/_jax_ep.py ep_path).

On this machine (no GPU): the path each group takes, and the lowering for CUDA of a jitted layer (prepare,
dispatch, combine and their VJPs) over a group whose direct transport's core group is on a planning context:
the custom calls' targets and attributes, no Python callback left; a closed group refused. On GPUs
(multi_gpu: tests/ep_worker.py jax_direct on 2 and 4 ranks): jit(grad) of dispatch -> scale -> combine against
the NumPy reference and bitwise against the buffer_callback path of an NCCL group.
"""
from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import moe_rt  # noqa: E402
import moe_rt.jax as mj  # noqa: E402
from moe_rt import _core, _jax_ep, _xla  # noqa: E402

E, H, K, TMAX = 6, 40, 2, 16
TARGETS = ("ep_prepare", "ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd")


def _direct_group(monkeypatch, mode="capacity"):
    """A one-rank CPU group made to look like a group on the direct transport: its transport's core group on a
    planning context (made-up addresses; the core's registry lists it as any group), one stand-in CUDA device,
    the transport's set-up and XLA's kernel preparation recorded instead of run. Returns (group, core, setups,
    prepared)."""
    group = moe_rt.EpGroup(None, E, H, TMAX, mode=mode)
    P = group.pair_capacity if mode == "capacity" else TMAX
    ctx = _core.planning()
    core = _core.ep_direct_group_create(ctx, 1, 0, 0, 1, P, 10**9, 0x1000, 0x2000, 0x3000, 0x4000)

    class Transport:  # what EpGroup._choose_transport makes on GPUs
        _core = None

        def close(self):
            self._core.destroy()

    t = Transport()
    t._core = core
    group.transport, group._transport, group.device = "direct", t, 0

    class Device:
        compute_capability = "9.0"
        local_hardware_id = 0

    setups, prepared = [], []

    def setup(g, op, T, K_, *, row_bytes=0, idx_dtype=None):
        setups.append((op, T, K_, row_bytes, None if idx_dtype is None else np.dtype(idx_dtype).name))
        if op == "prepare":
            return dict(grid_sync=np.int64(0x5000), error_word=np.int64(0x6000), state=np.int64(0x7000),
                        peer_box=np.int64(0x8000), inbox=np.int64(0x9000), timeout_ns=np.int64(10**9)), 37, True
        return None

    monkeypatch.setattr(_xla, "cuda_devices", lambda: [Device()])
    monkeypatch.setattr(_xla, "prepare", lambda op, **kw: prepared.append((op, kw)))
    monkeypatch.setattr(_jax_ep, "_ffi_setup", setup)
    return group, core, setups, prepared


def _layer(group, T, dtype=jnp.bfloat16, weighted=True):
    def loss(x, w, idx):
        h = mj.ep_prepare(group, idx)
        rx, rw = mj.ep_dispatch(h, x, w if weighted else None)
        out = mj.ep_combine(h, (rx * 2).astype(rx.dtype), rw)
        return (out.astype(jnp.float32) ** 2).sum()

    args = (jnp.zeros((T, H), dtype), jnp.ones((T, K), jnp.float32), jnp.zeros((T, K), jnp.int32))
    return jax.jit(jax.grad(loss, argnums=(0, 1) if weighted else 0)), args


def _calls(text):
    """{target: [(attributes, operand count, result types)]} of the custom calls in a lowered module."""
    calls = {}
    for m in re.finditer(r"stablehlo\.custom_call @(\w+)\(([^)]*)\) \{[^\n]*?mhlo\.backend_config = \{([^}]*)\}"
                         r"[^\n]*-> \(?([^\n]*)", text):
        attrs = dict(kv.strip().split(" = ", 1) for kv in m.group(3).split(","))
        calls.setdefault(m.group(1), []).append((attrs, len(m.group(2).split(",")), m.group(4)))
    return calls


def test_ep_path_by_transport_and_mode(monkeypatch):
    one = moe_rt.EpGroup(None, E, H, TMAX, mode="capacity")  # one rank: no transport of its own
    assert one.transport is None and mj.ep_path(one) == "buffer_callback"
    group, _, _, _ = _direct_group(monkeypatch)
    assert mj.ep_path(group) == "ffi"
    for transport in ("nccl", "mixed"):
        group.transport = transport
        assert mj.ep_path(group) == "buffer_callback", transport
    exact, _, _, _ = _direct_group(monkeypatch, mode="exact")
    assert mj.ep_path(exact) == "buffer_callback"
    with pytest.raises(TypeError, match="group: expected a moe_rt.EpGroup"):
        mj.ep_path(object())
    one.close()
    with pytest.raises(ValueError, match="group: the EP group is closed"):
        mj.ep_path(one)


@pytest.mark.parametrize("weighted", [True, False])
def test_direct_group_lowers_to_ep_custom_calls(monkeypatch, weighted):
    T = 11
    group, core, setups, prepared = _direct_group(monkeypatch)
    step, args = _layer(group, T, weighted=weighted)
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla_buffer_python" not in text  # no Python callback left
    calls = _calls(text)
    rows, N, total = moe_rt._ep_adapt.sizes(group, T, K)
    common = {"group": f"{core.address} : i64", "group_serial": f"{core.serial} : i64", "device": "0 : i32",
              "num_local_experts": f"{E} : i32", "max_tokens_per_rank": f"{TMAX} : i32", "topk": f"{K} : i32",
              "pair_capacity": f"{group.pair_capacity} : i32", "align_size": "1 : i32", "num_tokens": f"{T} : i64",
              "recv_rows": f"{rows} : i64", "num_rows": f"{N} : i64"}
    assert core.serial > 0 and rows == group.pair_capacity
    (attrs, n_in, results), = calls[_xla.target("ep_prepare")]
    assert attrs == dict(common, rank="0 : i32", num_experts=f"{E} : i32",
                         capacity=f"{group._sizes(T, K)['capacity']} : i64", grid_sync="20480 : i64",
                         error_word="24576 : i64", state="28672 : i64", peer_box="32768 : i64", inbox="36864 : i64",
                         timeout_ns="1000000000 : i64")
    assert n_in == 1 and f"tensor<{total}xui8>" in results and "tensor<37xi32>" in results
    flag = f"{int(weighted)} : i32"
    want = {"ep_dispatch": (dict(common, has_weights=flag, zero_empty_slots="1 : i32"), 2 + weighted, 3),
            "ep_combine": (dict(common, has_weights=flag), 2 + weighted, 1),
            "ep_dispatch_bwd": (dict(common, has_weights=flag), 2 + weighted, 3),
            "ep_combine_bwd": (dict(common, has_weights=flag), 4 if weighted else 2, 2 if weighted else 1)}
    for op, (want_attrs, want_in, want_out) in want.items():
        (attrs, n_in, results), = calls[_xla.target(op)]
        assert attrs == want_attrs, (op, attrs)
        assert n_in == want_in and results.count("tensor<") == want_out, (op, n_in, results)
    # dispatch with weights returns the handle's copy it wrote the received weights into
    d_results = calls[_xla.target("ep_dispatch")][0][2]
    assert (f"tensor<{total}xui8>" if weighted else "tensor<0xui8>") in d_results
    # the transport set up at lowering: prepare's box, the receive stage of bf16 rows of H
    assert setups[0] == ("prepare", T, K, 0, "int32")
    assert {s[0] for s in setups[1:]} == {"dispatch", "combine", "dispatch_bwd", "combine_bwd"}
    assert {s[3] for s in setups[1:]} == {2 * H}
    # XLA's context gets combine_backward's kernels for a weighted combine's VJP only
    assert prepared == ([("combine_backward", dict(T=rows, K=K, E=E, N=N, align_size=1, H=H, dtype=2,
                                                   has_probs=True))] if weighted else [])
    assert "input_output_aliases" not in text


def test_other_groups_keep_buffer_callback(monkeypatch):
    group, _, setups, _ = _direct_group(monkeypatch)
    group.transport = "nccl"
    step, args = _layer(group, 5)
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla_buffer_python" in text
    assert not any(_xla.target(op) in text for op in TARGETS) and not setups
    one = moe_rt.EpGroup(None, E, H, TMAX, mode="capacity")
    step, args = _layer(one, 5)
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla_buffer_python" in text and not any(_xla.target(op) in text for op in TARGETS)


def test_direct_group_lowered_for_cpu_keeps_the_callback(monkeypatch):
    group, _, setups, _ = _direct_group(monkeypatch)
    step, args = _layer(group, 5)
    text = step.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert "xla_buffer_python" in text and not any(_xla.target(op) in text for op in TARGETS) and not setups


def collective_chain(text, targets):
    """The custom calls named ``targets`` in a lowered module, in program order, after checking that one token
    chains them (moe_rt.jax._COLLECTIVE): each is side-effecting and takes its operands only from the
    optimization barrier just before it (or values computed from them after it), whose token is the one the
    previous collective's closing barrier returned (the first: the function's token argument), and the
    barrier just after it takes its results."""
    barrier = re.compile(r"(%\w+)(?::\d+)? = stablehlo\.optimization_barrier (%[\w#]+)(.*)")
    call = re.compile(r"(%\w+)(?::\d+)? = stablehlo\.custom_call @(\w+)\(([^)]*)\) \{([^\n]*)")
    token, opened, order, last, since = None, None, [], None, set()
    for line in text.splitlines():
        line = line.strip()
        d = re.match(r"(%\w+)(?::\d+)? = ", line)
        if d:
            since.add(d.group(1))
        m = barrier.match(line)
        if m:
            if token is not None:
                assert m.group(2) == token, (line, token)
            if opened is None:
                opened, since = m.group(1), {m.group(1)}
            else:  # the closing barrier of the last call: holds its results
                assert last is not None and f"{last}" in m.group(3), (line, last)
                opened, last = None, None
            token = f"{m.group(1)}#0"
            continue
        m = call.match(line)
        if m and m.group(2) in targets:
            assert "has_side_effect = true" in m.group(4), line
            assert opened is not None and last is None, ("a collective outside its barriers", line)
            operands = [a.strip() for a in m.group(3).split(",") if a.strip()]
            assert all(a.split("#")[0] in since for a in operands), (line, opened)
            order.append(m.group(2))
            last = m.group(1)
    assert order and opened is None, order
    assert len(re.findall(r"stablehlo\.optimization_barrier", text)) == 2 * len(order)
    return order


_ORDER = ["ep_prepare", "ep_dispatch", "ep_combine", "ep_combine_bwd", "ep_dispatch_bwd"]


def test_ep_ops_chained_in_program_order(monkeypatch):
    """Every rank must run the same collectives in the same order: the lowered layer (forward and VJPs)
    threads one token through its five EP ops, each side-effecting (XLA keeps it), on both paths."""
    group, _, _, _ = _direct_group(monkeypatch)
    step, args = _layer(group, 7)
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert collective_chain(text, {_xla.target(op) for op in TARGETS}) == [_xla.target(op) for op in _ORDER]
    group.transport = "nccl"  # the buffer_callback path
    step, args = _layer(group, 7)
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert len(collective_chain(text, {"xla_buffer_python_gpu_callback"})) == 5
    assert "ordered" in str(jax.make_jaxpr(lambda *a: step(*a))(*args))


@pytest.mark.parametrize("weighted", [True, False])
def test_ep_ops_run_on_a_rank_without_tokens(weighted):
    """A rank with no tokens still takes part in every collective: XLA would drop ops whose results hold no
    element (or go unused) unless they are side-effecting. Each of the group's five ops runs once per step."""
    group = moe_rt.EpGroup(None, E, H, TMAX, mode="capacity")
    calls = []
    for name in ("prepare", "dispatch", "combine", "dispatch_bwd", "combine_bwd"):
        def counted(*a, _op=getattr(group, name), _name=name, **kw):
            calls.append(_name)
            return _op(*a, **kw)
        setattr(group, name, counted)
    step, args = _layer(group, 0, dtype=jnp.float32, weighted=weighted)
    grads = jax.block_until_ready(step(*args))
    assert sorted(calls) == sorted(["prepare", "dispatch", "combine", "combine_bwd", "dispatch_bwd"]), calls
    assert all(g.shape[0] == 0 for g in jax.tree_util.tree_leaves(grads))
    calls.clear()
    jax.block_until_ready(step(*args))
    assert len(calls) == 5, calls


def test_reset_ep_order_drops_the_effect_token():
    """A program with EP ops leaves JAX's token of their ordered effect (on the GPU, a failed program's error
    stays in it and fails the later ones: tests/test_ep_ll_adapters.py's one-GPU test); reset_ep_order drops
    it and the next program runs with a fresh one."""
    from jax._src import dispatch

    from moe_rt.jax import _COLLECTIVE

    group = moe_rt.EpGroup(None, E, H, TMAX, mode="capacity")
    step, args = _layer(group, 5, dtype=jnp.float32)
    jax.block_until_ready(step(*args))
    assert _COLLECTIVE in dispatch.runtime_tokens.current_tokens
    mj.reset_ep_order()
    assert _COLLECTIVE not in dispatch.runtime_tokens.current_tokens
    assert jax.block_until_ready(step(*args))[0].shape == (5, H)
    assert _COLLECTIVE in dispatch.runtime_tokens.current_tokens


def _registry():
    lib = ctypes.CDLL(_core.LIB_PATH)
    lib.moe_rt_last_error.restype = ctypes.c_char_p
    lib.moe_rt_ep_direct_group_acquire.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.moe_rt_ep_direct_group_release.argtypes = [ctypes.c_void_p]
    return lib


def test_closed_group_refused_at_trace_and_by_the_registry(monkeypatch):
    """After close, tracing refuses the group with a clear error, and the core's registry no longer lists its
    core group (a compiled program naming it fails in the handler: tests/test_jax_ffi.py's frames)."""
    group, core, _, _ = _direct_group(monkeypatch)
    step, args = _layer(group, 4)
    step.trace(*args).lower(lowering_platforms=("cuda",))
    address, serial = core.address, core.serial
    lib = _registry()
    held = ctypes.c_void_p()
    assert lib.moe_rt_ep_direct_group_acquire(address, serial + 1, ctypes.byref(held)) == 1
    assert b"no live direct EP group at address 0x" in lib.moe_rt_last_error()
    assert lib.moe_rt_ep_direct_group_acquire(address, serial, ctypes.byref(held)) == 0 and held.value == address
    group.close()  # destroys the core group while held: freed at the release
    lib.moe_rt_ep_direct_group_release(held)
    assert lib.moe_rt_ep_direct_group_acquire(address, serial, ctypes.byref(held)) == 1
    assert b"the EpGroup was closed" in lib.moe_rt_last_error()
    with pytest.raises(ValueError, match="group: the EP group is closed"):
        mj.ep_prepare(group, jnp.zeros((4, K), jnp.int32))
    with pytest.raises(ValueError, match="group: the EP group is closed"):
        mj.ep_path(group)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_multi_gpu_jax_ep_direct_matches_reference(n):
    """tests/ep_worker.py jax_direct: jit(value_and_grad) of prepare -> dispatch -> scale -> combine on a direct
    group (XLA custom calls) on n ranks against the NumPy R-rank reference and bitwise against an NCCL group's
    buffer_callback path; run to run bitwise; a program run after close fails with the core's message."""
    from test_ep import _run_worker

    r = _run_worker("jax_direct", n=n, timeout=480)
    assert r.returncode == 0 and "[rank 0] ALL OK" in r.stdout


@pytest.mark.gpu
def test_one_gpu_one_rank_group_takes_the_callback_path(rng):
    """A one-rank group has no transport of its own (EpGroup runs the NCCL path without an exchange; the direct
    transport needs peers), so its JAX ops stay buffer_callback on the GPU, and jit(grad) of the layer there
    matches the CPU path (the NumPy reference; the weight gradient's fp32 dots within rounding)."""
    import ml_dtypes

    gpu = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpu:
        pytest.skip("needs a CUDA GPU")
    group = moe_rt.EpGroup(None, E, H, TMAX, mode="capacity", transport="direct")
    assert group.transport is None and mj.ep_path(group) == "buffer_callback"
    T = 13
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32).astype(ml_dtypes.bfloat16)
    w = rng.random((T, K)).astype(np.float32)
    step, _ = _layer(group, T)
    outs = {}
    for dev in (gpu[0], jax.devices("cpu")[0]):
        with jax.default_device(dev):
            args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx))
            if dev is gpu[0]:
                text = step.lower(*args).as_text()
                assert "xla_buffer_python" in text and "@moe_rt_ep_" not in text
            outs[dev.platform] = [np.asarray(a) for a in step(*args)]
    (gx, gw), (rgx, rgw) = outs["gpu"], outs["cpu"]
    assert gx.dtype == rgx.dtype and gw.dtype == rgw.dtype == np.float32
    np.testing.assert_allclose(gx.astype(np.float32), rgx.astype(np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(gw, rgw, rtol=1e-4, atol=1e-4)
    group.close()
