"""moe_rt.jax's XLA FFI side: the handler library (``libmoe_rt_xla.so``, csrc/xla_ffi.c), its registration
with XLA for CUDA, and the trace-time preparation of each op's kernels.

An op traced for the GPU runs as an XLA custom call whose handler, compiled C, calls the C core on XLA's
stream. What the handler's C context needs is made ready when the op is traced, in Python: the kernels the
op will launch (found by planning the op in a planning context of the C core, with the traced shapes, dtypes
and settings) are compiled into the kernel cache folder for each local GPU's architecture, listed in the
folder's ``manifest.json``, and loaded into the device's context (outside any CUDA graph capture). At run
time no Python runs.

The library is built by setup.py where jaxlib's FFI headers are present at build time; otherwise it is built
here on first use (with the C compiler, into the kernel cache folder, said on stderr) from the source tree.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import threading
from pathlib import Path

from moe_rt import _jit

LIB_DIR = Path(__file__).resolve().parent / "lib"
SRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
XLA_LIB = "libmoe_rt_xla.so"
TARGET_PREFIX = "moe_rt_"
HANDLERS = ("topk_with_score", "topk_with_score_backward", "topk_with_score_qb", "scores_for_aux_loss",
            "scores_for_aux_loss_backward", "aux_loss", "aux_loss_backward", "make_plan", "dispatch",
            "dispatch_backward", "combine", "combine_backward", "sort_chunks", "quantize_fp8", "dequantize_fp8", "noop",
            # the low-latency EP ops (moe_rt.jax ll_dispatch / ll_combine and their VJPs)
            "ll_dispatch", "ll_combine", "ll_dispatch_bwd", "ll_combine_bwd",
            # the capacity-mode EP ops on the direct transport (moe_rt.jax ep_prepare / ep_dispatch / ep_combine)
            "ep_prepare", "ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd")
# Handlers XLA may not capture in command buffers: a replay would run the group's launches without the
# handler's check that the group is still open (csrc/xla_ffi.c ll_call, ep_call).
NOT_CAPTURABLE = frozenset({"ll_dispatch", "ll_combine", "ll_dispatch_bwd", "ll_combine_bwd", "ep_prepare",
                            "ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd"})  # noop: a custom call that does nothing (the benchmark's floor)
SCORE_CODES = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}
QB_MODE_CODES = {"two_kernel": 0, "fused_atomic": 1}  # moe_rt_qb_histogram_mode
# moe_rt_dtype codes (include/moe_rt/moe_rt.h)
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int32": 3, "int64": 4, "bool": 5, "uint8": 6, "int8": 7,
               "float8_e4m3fn": 8, "float8_e5m2": 9, "int16": 10}

INDEX_CODES = (DTYPE_CODES["int16"], DTYPE_CODES["int32"], DTYPE_CODES["int64"])  # the top-k's index forms

_lock = threading.RLock()
_lib = None
_core = None
_prepared: set = set()
_devices: set = set()  # CUDA ordinals whose handler context was made
BAD_EXPERT_ID = 6  # MOE_RT_ERROR_BAD_EXPERT_ID


def target(op: str) -> str:
    """The XLA custom call target of handler ``op``."""
    return TARGET_PREFIX + op


# ---- the C core through ctypes (planning) ---------------------------------------------------------------

class _DeviceInfo(ctypes.Structure):
    _fields_ = [("sm_count", ctypes.c_int32), ("smem_per_sm", ctypes.c_int32),
                ("smem_per_block_optin", ctypes.c_int32), ("cc_major", ctypes.c_int32),
                ("cc_minor", ctypes.c_int32), ("assumed_regs", ctypes.c_int32)]


class _LaunchInfo(ctypes.Structure):
    _fields_ = [("file", ctypes.c_char * 32), ("kernel", ctypes.c_char * 128), ("grid", ctypes.c_int64),
                ("block", ctypes.c_int32), ("shared_mem", ctypes.c_int32), ("scalars", ctypes.c_int64 * 2)]


class _PlanInfo(ctypes.Structure):
    _fields_ = [("num_launches", ctypes.c_int32), ("launch", _LaunchInfo * 8)]


class _Plan(ctypes.Structure):
    _fields_ = [("dst_row", ctypes.c_void_p), ("src_slot", ctypes.c_void_p), ("seg_start", ctypes.c_void_p),
                ("counts", ctypes.c_void_p), ("tokens_per_expert", ctypes.c_void_p), ("num_tokens", ctypes.c_int64),
                ("topk", ctypes.c_int64), ("num_experts", ctypes.c_int64), ("num_rows", ctypes.c_int64),
                ("align_size", ctypes.c_int64)]


def core() -> ctypes.CDLL:
    """libmoe_rt.so of this package (the one libmoe_rt_xla.so links to)."""
    global _core
    with _lock:
        if _core is None:
            path = LIB_DIR / "libmoe_rt.so"
            if not path.is_file():
                raise RuntimeError(f"moe_rt.jax: {path} is missing; build moe_rt (python3 setup.py build_ext "
                                   "--inplace, or pip install)")
            lib = ctypes.CDLL(str(path))
            lib.moe_rt_last_error.restype = ctypes.c_char_p
            lib.moe_rt_make_plan_workspace_size.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                                            ctypes.POINTER(ctypes.c_size_t)]
            lib.moe_rt_aux_loss_workspace_size.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_size_t)]
            lib.moe_rt_sort_chunks_workspace_size.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_size_t)]
            _core = lib
        return _core


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"moe_rt.jax: {what}: {core().moe_rt_last_error().decode()}")


def make_plan_workspace_bytes(num_tokens: int, topk: int, num_experts: int) -> int:
    """Device workspace of the C make_plan, bytes."""
    n = ctypes.c_size_t()
    _check(core().moe_rt_make_plan_workspace_size(num_tokens, topk, num_experts, ctypes.byref(n)),
           "moe_rt_make_plan_workspace_size")
    return int(n.value)


def aux_loss_workspace_bytes(num_rows: int) -> int:
    """Device workspace of the C aux_loss, bytes."""
    n = ctypes.c_size_t()
    _check(core().moe_rt_aux_loss_workspace_size(num_rows, ctypes.byref(n)), "moe_rt_aux_loss_workspace_size")
    return int(n.value)


def sort_chunks_workspace_bytes(num_chunks: int) -> int:
    """Device workspace of the C sort_chunks, bytes."""
    n = ctypes.c_size_t()
    _check(core().moe_rt_sort_chunks_workspace_size(num_chunks, ctypes.byref(n)),
           "moe_rt_sort_chunks_workspace_size")
    return int(n.value)


# Distinct 256-byte aligned stand-ins for device pointers: a planning context checks them for NULL and
# alignment only, and XLA's buffers are aligned at least as well.
def _ptr(i: int) -> ctypes.c_void_p:
    return ctypes.c_void_p((i + 1) << 20)


# (SM count, shared memory per SM, per block with opt-in) an H100 or H200 has: what planned_kernels assumes
# without the device's own figures (a kernel choice can depend on them: the QB histogram pass's width on the
# opt-in shared memory)
H100_SHAPE = (132, 228 * 1024, 227 * 1024)


def planned_kernels(op: str, cc: tuple[int, int], *, shape: tuple[int, int, int] = H100_SHAPE,
                    **kw) -> list[tuple[str, str]]:
    """The kernels ((file, name expression) each) the C core launches for handler ``op`` with these static
    facts, on a device of compute capability ``cc`` and ``shape`` (SM count, shared memory per SM and per block
    with opt-in, bytes: see :func:`device_shape`); planned with 16-byte aligned buffers, as XLA gives."""
    lib = core()
    dev = _DeviceInfo(int(shape[0]), int(shape[1]), int(shape[2]), int(cc[0]), int(cc[1]), 0)
    ctx = ctypes.c_void_p()
    _check(lib.moe_rt_context_create_planning(ctypes.byref(dev), ctypes.byref(ctx)), "planning context")
    try:
        i64, c_int, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
        if op == "topk_with_score":
            st = lib.moe_rt_topk_with_score(
                ctx, _ptr(0), c_int(kw["dtype"]), i64(kw["T"]), c_int(kw["E"]), c_int(kw["topk"]),
                c_int(kw["score_function"]), c_int(kw["use_pre_softmax"]), c_int(kw["num_groups"]),
                c_int(kw["group_topk"]), f32(kw["scaling_factor"]), _ptr(1) if kw["has_bias"] else None, _ptr(2),
                _ptr(3), c_int(kw["routing_dtype"]), _ptr(4), None)
        elif op == "topk_with_score_backward":
            st = lib.moe_rt_topk_with_score_backward(
                ctx, _ptr(0), c_int(kw["dtype"]), _ptr(1), c_int(kw["routing_dtype"]), _ptr(2), i64(kw["T"]),
                c_int(kw["E"]), c_int(kw["topk"]), c_int(kw["score_function"]), c_int(kw["use_pre_softmax"]),
                f32(kw["scaling_factor"]), _ptr(3), None)
        elif op == "topk_with_score_qb":
            st = lib.moe_rt_topk_with_score_qb(
                ctx, _ptr(0), c_int(kw["dtype"]), i64(kw["T"]), c_int(kw["E"]), c_int(kw["topk"]),
                f32(kw["scaling_factor"]), _ptr(1), _ptr(2), _ptr(3), c_int(kw["num_bins"]),
                c_int(kw["qb_histogram_mode"]), _ptr(4), _ptr(5), _ptr(6), _ptr(7), None)
        elif op == "scores_for_aux_loss":
            st = lib.moe_rt_scores_for_aux_loss(ctx, _ptr(0), c_int(kw["dtype"]), i64(kw["T"]), c_int(kw["E"]),
                                                c_int(kw["topk"]), c_int(kw["score_function"]), _ptr(1), _ptr(2),
                                                c_int(kw["routing_dtype"]), _ptr(3), None)
        elif op == "scores_for_aux_loss_backward":
            st = lib.moe_rt_scores_for_aux_loss_backward(ctx, _ptr(0), _ptr(1), i64(kw["T"]), c_int(kw["E"]),
                                                         c_int(kw["topk"]), c_int(kw["score_function"]), _ptr(2),
                                                         c_int(kw["dtype"]), None)
        elif op == "sort_chunks":
            ws = sort_chunks_workspace_bytes(kw["S"])
            probs = kw["has_probs"]
            st = lib.moe_rt_sort_chunks(ctx, _ptr(0), i64(kw["N"]), i64(kw["row_bytes"]), _ptr(1), _ptr(2),
                                        c_int(kw["index_dtype"]), i64(kw["S"]), _ptr(3) if probs else None, _ptr(4),
                                        _ptr(5) if probs else None, c_int(kw["backward"]), _ptr(6),
                                        ctypes.c_size_t(ws), None)
        elif op == "copy_kept_rows":  # the low-latency handlers' copy of the receive rows
            st = lib.moe_rt_copy_kept_rows(ctx, _ptr(0), _ptr(1), _ptr(2), i64(kw["N"]), i64(kw["row_bytes"]),
                                           c_int(kw["zero_rest"]), None)
        elif op == "quantize_fp8":
            st = lib.moe_rt_quantize_fp8(ctx, _ptr(0), c_int(kw["dtype"]), i64(kw["T"]), i64(kw["H"]),
                                         c_int(kw["block"]), _ptr(1), _ptr(2), None)
        elif op == "dequantize_fp8":
            st = lib.moe_rt_dequantize_fp8(ctx, _ptr(0), _ptr(1), i64(kw["T"]), i64(kw["H"]), c_int(kw["block"]),
                                           _ptr(2), c_int(kw["dtype"]), None)
        elif op in ("aux_loss", "aux_loss_backward"):
            # the kernels depend on the dtype, the sizes and (the backward's) whether the total is a device
            # scalar (dev_total), not on the total itself: planned with a host total of 1 or an int32 device one
            dev = bool(kw.get("dev_total", False))
            common = (c_int(kw["dtype"]), i64(kw["R"]), c_int(kw["C"]), _ptr(1), c_int(kw["tpe_dtype"]),
                      i64(0 if dev else 1), _ptr(9) if dev else None, c_int(DTYPE_CODES["int32"] if dev else 0),
                      c_int(kw["num_experts"]), c_int(kw["topk"]), f32(kw["coeff"]))
            if op == "aux_loss":
                ws = aux_loss_workspace_bytes(kw["R"])
                st = lib.moe_rt_aux_loss(ctx, _ptr(0), *common, _ptr(2), ctypes.c_size_t(ws), _ptr(3), None)
            else:
                st = lib.moe_rt_aux_loss_backward(ctx, _ptr(0), *common, _ptr(2), None)
        elif op == "make_plan":
            plan = _Plan(_ptr(1), _ptr(2), _ptr(3), _ptr(4), _ptr(5))
            ws = make_plan_workspace_bytes(kw["T"], kw["K"], kw["E"])
            st = lib.moe_rt_make_plan(ctx, _ptr(0), c_int(kw["routing_dtype"]), i64(kw["T"]), i64(kw["K"]),
                                      c_int(kw["E"]), c_int(kw["align_size"]), i64(kw["num_out_tokens"]),
                                      ctypes.byref(plan), _ptr(6), ctypes.c_size_t(ws), None)
        else:
            plan = _Plan(_ptr(1), _ptr(2), _ptr(3), _ptr(4), _ptr(5), kw["T"], kw["K"], kw["E"], kw["N"],
                         kw["align_size"])
            H, dt, probs = i64(kw["H"]), c_int(kw["dtype"]), kw["has_probs"]
            if op == "dispatch":
                st = lib.moe_rt_dispatch(ctx, ctypes.byref(plan), _ptr(6), dt, H, _ptr(7) if probs else None, _ptr(8),
                                         _ptr(9) if probs else None, c_int(kw.get("probs_dtype", 0)), None)
            elif op == "dispatch_backward":
                st = lib.moe_rt_dispatch_backward(ctx, ctypes.byref(plan), _ptr(6), dt, H, _ptr(7) if probs else None,
                                                  _ptr(8), _ptr(9) if probs else None, None)
            elif op == "combine":
                st = lib.moe_rt_combine(ctx, ctypes.byref(plan), _ptr(6), dt, H, _ptr(7) if probs else None, _ptr(8),
                                        None)
            elif op == "combine_backward":
                st = lib.moe_rt_combine_backward(ctx, ctypes.byref(plan), _ptr(6), dt, H, _ptr(7) if probs else None,
                                                 _ptr(8) if probs else None, _ptr(9), _ptr(10) if probs else None, None)
            else:
                raise ValueError(f"unknown moe_rt XLA op {op!r}")
        _check(st, f"planning {op}")
        info = _PlanInfo()
        _check(lib.moe_rt_last_plan(ctx, ctypes.byref(info)), "moe_rt_last_plan")
        names = [(info.launch[i].file.decode(), info.launch[i].kernel.decode()) for i in range(info.num_launches)]
    finally:
        lib.moe_rt_context_destroy(ctx)
    if op == "make_plan" or (op == "topk_with_score_backward" and kw["routing_dtype"] in INDEX_CODES):
        names.append(ERROR_WORD_KERNEL)  # the device error word's module
    return names


ERROR_WORD_KERNEL = ("errors.cu", "error_word_clear")


def device_shape(device_id: int) -> tuple[int, int, int]:
    """(SM count, shared memory per SM, per block with opt-in) of CUDA device ``device_id``, as the handlers'
    contexts read them (planned_kernels plans with it, so a kernel choice that depends on it is the one the
    handler makes on that device)."""
    got = _shapes.get(device_id)
    if got is None:
        p = _jit.device_properties(device_id)
        got = _shapes[device_id] = (p["sm_count"], p["smem_per_sm"], p["smem_per_block_optin"])
    return got


_shapes: dict = {}


# ---- the handler library ----------------------------------------------------------------------------------

def _libbuild():
    spec = importlib.util.spec_from_file_location("moe_rt_libbuild", SRC_DIR / "libbuild.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def library_path() -> Path:
    """libmoe_rt_xla.so: the one built with the package, else one built now from the source tree into the
    kernel cache folder (keyed by the sources, jaxlib's FFI header and the core library's path)."""
    packaged = LIB_DIR / XLA_LIB
    if packaged.is_file():
        return packaged
    if not (SRC_DIR / "xla_ffi.c").is_file():
        raise RuntimeError(f"moe_rt.jax: {packaged} was not built (jaxlib's XLA FFI headers were absent when moe_rt "
                           "was built) and the C sources are not here to build it; reinstall moe_rt with jax "
                           "installed: pip install --no-build-isolation .")
    lb = _libbuild()
    include = lb.xla_include_dir()
    if include is None:
        raise RuntimeError("moe_rt.jax: jaxlib's XLA FFI headers (jax.ffi.include_dir()) are missing")
    h = hashlib.sha256()
    for p in [SRC_DIR / s for s in lb.XLA_SOURCES] + [SRC_DIR.parent / "include" / "moe_rt" / "moe_rt.h",
                                                      Path(include) / "xla" / "ffi" / "api" / "c_api.h"]:
        h.update(p.read_bytes())
    h.update(str(LIB_DIR / "libmoe_rt.so").encode())
    out = Path(_jit.cache_dir()) / "xla" / f"libmoe_rt_xla-{h.hexdigest()[:20]}.so"
    if not out.is_file():
        tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            lb.build_xla(tmp, LIB_DIR / "libmoe_rt.so", include)
        except Exception as e:  # the compiler's own output says why
            msg = getattr(e, "stdout", "") + getattr(e, "stderr", "")
            raise RuntimeError(f"moe_rt.jax: building {XLA_LIB} failed: {e}\n{msg}") from e
        os.replace(tmp, out)
        _jit.say(f"moe_rt: built {XLA_LIB} (moe_rt.jax's XLA FFI handlers) into {out}")
    return out


def library() -> ctypes.CDLL:
    """The handler library, loaded and its handlers registered with XLA for CUDA (once per process)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        import jax.ffi
        from jaxlib import xla_client

        lib = ctypes.CDLL(str(library_path()))
        lib.moe_rt_xla_last_error.restype = ctypes.c_char_p
        lib.moe_rt_xla_set_kernel_cache.argtypes = [ctypes.c_char_p]
        lib.moe_rt_xla_load_kernel.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]
        lib.moe_rt_xla_check.argtypes = [ctypes.c_int]
        traits = xla_client.CustomCallTargetTraits
        for op in HANDLERS:
            jax.ffi.register_ffi_target(target(op), jax.ffi.pycapsule(getattr(lib, "moe_rt_xla_" + op)),
                                        platform="CUDA", api_version=1,
                                        traits=traits.DEFAULT if op in NOT_CAPTURABLE else
                                        traits.COMMAND_BUFFER_COMPATIBLE)
        _lib = lib
        return lib


def cuda_devices() -> list:
    """JAX's local CUDA devices ([] without a CUDA backend)."""
    import jax

    try:
        return list(jax.local_devices(backend="cuda"))
    except RuntimeError:
        return []


def prepare(op: str, **facts) -> None:
    """Make handler ``op`` ready to run with these static facts on every local GPU: the library loaded and
    registered, the kernels it launches compiled into the kernel cache folder, listed in its manifest and
    loaded into each device's context. Called when the op is traced; a no-op without a CUDA backend (the
    op then lowers for another platform). Raises RuntimeError saying what is missing."""
    devices = cuda_devices()
    if not devices:
        return
    key = (op, tuple(sorted(facts.items())))
    with _lock:
        if key in _prepared:
            return
        lib = library()
        root = _jit.cache_dir()
        if lib.moe_rt_xla_set_kernel_cache(root.encode()):
            raise RuntimeError(lib.moe_rt_xla_last_error().decode())
        by_kind: dict = {}
        for d in devices:
            cc = tuple(int(v) for v in str(d.compute_capability).split("."))
            arch, shape = _jit.arch_for(cc), device_shape(int(d.local_hardware_id))
            if (arch, shape) not in by_kind:
                names = planned_kernels(op, cc, shape=shape, **facts)
                if ERROR_WORD_KERNEL not in names:  # moe_rt.check() reads each prepared device's error word
                    names.append(ERROR_WORD_KERNEL)
                by_kind[arch, shape] = names
                _jit.cache_kernels(root, names, arch, where=" for moe_rt.jax")
            names = by_kind[arch, shape]
            for file, name in names:
                if lib.moe_rt_xla_load_kernel(int(d.local_hardware_id), file.encode(), name.encode()):
                    raise RuntimeError(f"moe_rt.jax: loading {name} ({file}) on {d}: "
                                       f"{lib.moe_rt_xla_last_error().decode()}")
            _devices.add(int(d.local_hardware_id))
        _prepared.add(key)


def check(device=None) -> None:
    """Raise, as ValueError with the CPU path's message, the bad expert ids the handlers' make_plan
    recorded on ``device`` (None: every device with a handler context) since the last check; waits for the
    device first (a host sync). A no-op where no handler ran."""
    if _lib is None:
        return
    for d in sorted(_devices) if device is None else [int(device)]:
        if d not in _devices:
            continue
        import cupy

        with cupy.cuda.Device(d):
            cupy.cuda.runtime.deviceSynchronize()
        st = _lib.moe_rt_xla_check(d)
        if st == BAD_EXPERT_ID:
            raise ValueError(_lib.moe_rt_xla_last_error().decode())
        if st:
            raise RuntimeError(f"moe_rt.jax: reading the error word of device {d}: "
                               f"{_lib.moe_rt_xla_last_error().decode()}")
