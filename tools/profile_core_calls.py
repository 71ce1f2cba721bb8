"""Count what one call of each core-facade op does on the host, on a machine without a GPU: every CUDA driver
call the C core makes (through a counting stand-in driver given as MOE_RT_LIBCUDA, on a device context over a
made-up kernel cache), and every torch / CuPy call the Python side makes (torch tensors and CuPy arrays stood
in by counting objects at made-up device addresses; torch.empty, torch's current-stream query, cupy.empty, the
CuPy device and stream context managers replaced by counting ones). Also the host time per call with those
stand-ins (not the GPU's: a real torch.empty, CuPy context switch or cuLaunchKernel costs more).

    python3 tools/profile_core_calls.py [--framework torch|cupy|both] [--time] [--cycles]

``--cycles`` also counts the objects each call leaves in reference cycles (freed only when Python's cyclic
collector runs: a call's arrays caught in one outlive it, which on a GPU holds their memory); every op must
leave none (tests/test_call_setup.py runs it).

What a stand-in hides and the report names: each ``cupy.Device.__enter__`` is a cudaGetDevice (+ cudaSetDevice
when another device is current) and each ``__exit__`` a cudaSetDevice; each CuPy stream ``__enter__`` /
``__exit__`` a cudaGetDevice and a thread-local stack push / pop.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_rt

import numpy as np  # noqa: E402

DRIVER_FNS = ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain",
              "cuDevicePrimaryCtxRelease_v2", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuModuleLoadData",
              "cuModuleUnload", "cuModuleGetFunction", "cuModuleGetGlobal_v2", "cuFuncGetAttribute",
              "cuFuncSetAttribute", "cuLaunchKernel", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemsetD8Async",
              "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoHAsync_v2", "cuStreamSynchronize",
              "cuStreamIsCapturing", "cuGetErrorString", "cuMemcpyDtoDAsync_v2"]

STUB = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define N %(n)d
static long long counts[N];
static __thread void* cur;
long long stub_count(int i) { return counts[i]; }
void stub_reset(void) { memset(counts, 0, sizeof counts); }
int cuInit(unsigned f) { counts[0]++; (void)f; return 0; }
int cuDeviceGetCount(int* n) { counts[1]++; *n = 1; return 0; }
int cuDeviceGet(int* d, int i) { counts[2]++; *d = i; return 0; }
int cuDeviceGetAttribute(int* v, int a, int d) {
  counts[3]++; (void)d;
  *v = a == 16 ? 132 : a == 75 ? 9 : a == 76 ? 0 : a == 81 ? 233472 : a == 97 ? 232448 : 0;
  return 0;
}
int cuDevicePrimaryCtxRetain(void** c, int d) { counts[4]++; (void)d; *c = (void*)0x1000; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { counts[5]++; (void)d; return 0; }
int cuCtxGetCurrent(void** c) { counts[6]++; *c = cur; return 0; }
int cuCtxSetCurrent(void* c) { counts[7]++; cur = c; return 0; }
int cuModuleLoadData(void** m, const void* image) { counts[8]++; (void)image; *m = malloc(8); return 0; }
int cuModuleUnload(void* m) { counts[9]++; free(m); return 0; }
int cuModuleGetFunction(void** f, void* m, const char* name) { counts[10]++; (void)name; *f = m; return 0; }
int cuModuleGetGlobal_v2(unsigned long long* p, size_t* b, void* m, const char* n) {
  counts[11]++; (void)m; (void)n; *p = 0x2000; *b = 32; return 0;
}
int cuFuncGetAttribute(int* v, int a, void* f) { counts[12]++; (void)f; *v = a == 4 ? 40 : 0; return 0; }
int cuFuncSetAttribute(void* f, int a, int v) { counts[13]++; (void)f; (void)a; (void)v; return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void* s, void** args, void** extra) {
  counts[14]++; (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)smem; (void)s;
  (void)args; (void)extra; return 0;
}
int cuMemAlloc_v2(unsigned long long* p, size_t n) { counts[15]++; *p = (unsigned long long)(size_t)malloc(n ? n : 1); return 0; }
int cuMemFree_v2(unsigned long long p) { counts[16]++; free((void*)(size_t)p); return 0; }
int cuMemsetD8Async(unsigned long long p, unsigned char c, size_t n, void* s) { counts[17]++; (void)p; (void)c; (void)n; (void)s; return 0; }
int cuMemcpyHtoD_v2(unsigned long long d, const void* s, size_t n) { counts[18]++; (void)d; (void)s; (void)n; return 0; }
int cuMemcpyDtoH_v2(void* d, unsigned long long s, size_t n) { counts[19]++; (void)s; memset(d, 0, n); return 0; }
int cuMemcpyDtoHAsync_v2(void* d, unsigned long long s, size_t n, void* st) { counts[20]++; (void)s; (void)st; memset(d, 0, n); return 0; }
int cuStreamSynchronize(void* s) { counts[21]++; (void)s; return 0; }
int cuStreamIsCapturing(void* s, int* st) { counts[22]++; (void)s; *st = 0; return 0; }
int cuGetErrorString(int r, const char** s) { counts[23]++; (void)r; *s = "stub error"; return 0; }
int cuMemcpyDtoDAsync_v2(unsigned long long d, unsigned long long s, size_t n, void* st) {
  counts[24]++; (void)d; (void)s; (void)n; (void)st; return 0;
}
"""

COUNTS: collections.Counter = collections.Counter()


def build_stub(folder: str) -> ctypes.CDLL:
    src = os.path.join(folder, "stub.c")
    out = os.path.join(folder, "libcuda.so.1")
    with open(src, "w") as f:
        f.write(STUB % {"n": len(DRIVER_FNS)})
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", out, src], check=True)
    lib = ctypes.CDLL(out)
    lib.stub_count.restype = ctypes.c_longlong
    lib.stub_count.argtypes = [ctypes.c_int]
    lib.path = out
    return lib


def driver_counts(stub) -> dict:
    return {name: stub.stub_count(i) for i, name in enumerate(DRIVER_FNS) if stub.stub_count(i)}


# ---- counting stand-ins for torch tensors, CuPy arrays and their runtime entry points ---------------------

_next = [0x7F0000000000]


def _addr(nbytes: int) -> int:
    p = _next[0]
    _next[0] += (nbytes + 4096) // 256 * 256
    return p


class _Counted:
    """Counts each attribute read of its public names as ``<kind>.<name>``."""

    _kind = "?"

    def __getattribute__(self, name):
        if not name.startswith("_"):
            COUNTS[f"{object.__getattribute__(self, '_kind')}.{name}"] += 1
        return object.__getattribute__(self, name)


class _Array(_Counted):
    """A counting array stand-in: ``_shape``, ``_dtype`` set by the subclass."""

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._dtype


def make_fake_torch():
    import torch

    sizes = {}
    real_empty = torch.empty

    def itemsize(dt):
        n = sizes.get(dt)
        if n is None:
            n = sizes[dt] = real_empty((), dtype=dt).element_size()
        return n

    class Tensor(_Array):
        _kind = "tensor"

        def __init__(self, shape, dtype, ptr=None):
            self._shape = torch.Size(shape)
            self._dtype = dtype
            n = 1
            for d in shape:
                n *= d
            self._n = n
            self._ptr = _addr(n * itemsize(dtype)) if ptr is None else ptr

        requires_grad = False
        is_cuda = True

        def get_device(self):
            return 0

        def is_contiguous(self):
            return True

        def data_ptr(self):
            return self._ptr

        def numel(self):
            return self._n

        def dim(self):
            return len(self._shape)

        def stride(self):
            st, acc = [], 1
            for d in reversed(self._shape):
                st.append(acc)
                acc *= d
            return tuple(reversed(st))

        def view(self, *shape):
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            if shape == (-1,):
                shape = (self._n,)
            return Tensor(shape, self._dtype, self._ptr)

    Tensor.__module__ = "torch.counting"
    Tensor.__qualname__ = Tensor.__name__ = "Tensor"

    def empty(*args, size=None, dtype=None, device=None):
        COUNTS["torch.empty"] += 1
        return Tensor(tuple(size if size is not None else args[0] if len(args) == 1 else args), dtype)

    def raw_stream(dev):
        COUNTS["torch._C._cuda_getCurrentRawStream"] += 1
        return 0

    def cur_device():
        COUNTS["torch._C._cuda_getDevice"] += 1
        return 0

    return Tensor, empty, raw_stream, cur_device


class FakeDevice(_Counted):
    _kind = "cupy.Device"

    def __init__(self, i):
        self._id = i

    def __enter__(self):
        COUNTS["cupy.Device.__enter__"] += 1
        return self

    def __exit__(self, *exc):
        COUNTS["cupy.Device.__exit__"] += 1
        return False

    @property
    def id(self):
        return self._id


class FakeStream(_Counted):
    _kind = "cupy.Stream"

    def __init__(self, ptr):
        self._ptr = ptr

    @property
    def ptr(self):
        return self._ptr

    def __enter__(self):
        COUNTS["cupy.Stream.__enter__"] += 1
        return self

    def __exit__(self, *exc):
        COUNTS["cupy.Stream.__exit__"] += 1
        return False


def make_fake_cupy():
    class _Mem:
        def __init__(self, ptr):
            self.ptr = ptr

    class _Flags:
        c_contiguous = True
        writeable = True

    class ndarray(_Array):
        _kind = "cupy.ndarray"

        def __init__(self, shape, dtype, ptr=None):
            self._shape = tuple(int(d) for d in shape)
            self._dtype = np.dtype(dtype)
            n = 1
            for d in self._shape:
                n *= d
            self._size = n
            self._ptr = _addr(n * self._dtype.itemsize) if ptr is None else ptr

        flags = _Flags()

        @property
        def ndim(self):
            return len(self._shape)

        @property
        def size(self):
            return self._size

        @property
        def nbytes(self):
            return self._size * self._dtype.itemsize

        @property
        def data(self):
            return _Mem(self._ptr)

        @property
        def device(self):
            return FakeDevice(0)

        def reshape(self, *shape):
            if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
                shape = shape[0]
            shape = tuple(shape)
            if -1 in shape:
                rest = 1
                for d in shape:
                    if d != -1:
                        rest *= d
                shape = tuple(d if d != -1 else self._size // rest for d in shape)
            return ndarray(shape, self._dtype, self._ptr)

        def astype(self, dtype, copy=True):
            if not copy and np.dtype(dtype) == self._dtype:
                return self
            COUNTS["cupy kernel (astype)"] += 1
            return ndarray(self._shape, dtype)

    ndarray.__module__ = "cupy._core.core"

    def empty(shape, dtype=float):
        COUNTS["cupy.empty"] += 1
        if isinstance(shape, int):
            shape = (shape,)
        return ndarray(shape, dtype)

    return ndarray, empty


# ---- the core over the counting driver --------------------------------------------------------------------

def device_context(stub, root):
    """moe_rt._core's context of device 0 over the counting driver and a kernel cache at ``root`` that lists
    whatever kernel the ops ask for (each image: a made-up name the stand-in driver loads)."""
    from moe_rt import _core, _jit

    os.environ["MOE_RT_LIBCUDA"] = stub.path
    os.environ["MOE_RT_KERNEL_CACHE"] = root
    rows = {}

    def cache_kernels(root_, names, arch, where=""):
        for file, name in names:
            img = f"{arch}/k{hashlib.sha1((file + name).encode()).hexdigest()[:12]}.img"
            os.makedirs(os.path.join(root, arch), exist_ok=True)
            with open(os.path.join(root, img), "w") as f:
                f.write(f"{name}\n40")
            rows[(file, name)] = {"file": file, "name": name, "lowered": "k", "arch": arch, "image": img}
        with open(os.path.join(root, "manifest.json"), "w") as f:
            json.dump({"format": 2, "source_hash": _jit.source_hash(), "nvrtc": "12.8",
                       "kernels": list(rows.values())}, f)

    _jit.cache_kernels = cache_kernels
    _jit.device_properties = lambda dev: {"name": "stand-in H100", "sm_count": 132, "smem_per_block_optin": 232448,
                                          "smem_per_sm": 233472, "l2_bytes": 50 << 20, "cc": (9, 0),
                                          "total_memory": 80 << 30}
    _jit.arch_for = lambda cc: "sm_90"
    _jit.TIERED = False
    return _core.device(0)


# ---- the ops --------------------------------------------------------------------------------------------

def op_cases(new, K=8, T=128, H=1024, E=64, bf16=None):
    """(name, fn) of each op at the overhead benchmark's size (tools/bench_layer.py --overhead-only), with
    ``new(shape, dtype)`` making an input array."""
    import moe_rt

    logits = new((T, E), "float32")
    x = new((T, H), bf16)
    probs, rmap, inter = moe_rt.topk_with_score(logits, K)
    scores, smap, s_inter = moe_rt.scores_for_aux_loss(logits, K, "softmax")
    tpe = new((E,), "int32")
    plan = moe_rt.make_plan(rmap, E, num_out_tokens=T * K)
    ys = new((T * K, H), bf16)
    gy, g_ys, g_probs = new((T, H), bf16), new((T * K, H), bf16), new((T, E), "float32")
    g_scores = new((T, E), "float32")
    g_aux = new((), "float32")
    return [
        ("topk_with_score", lambda: moe_rt.topk_with_score(logits, K)),
        ("topk_with_score_backward", lambda: moe_rt.topk_with_score_backward(g_probs, rmap, inter, K,
                                                                             score_function="softmax")),
        ("scores_for_aux_loss", lambda: moe_rt.scores_for_aux_loss(logits, K, "softmax")),
        ("scores_for_aux_loss_backward", lambda: moe_rt.scores_for_aux_loss_backward(g_scores, s_inter, K,
                                                                                     "softmax")),
        ("aux_loss", lambda: moe_rt.aux_loss(scores, tpe, T, E, K, 1e-2)),
        ("aux_loss_backward", lambda: moe_rt.aux_loss_backward(g_aux, T, tpe, T, E, K, 1e-2)),
        ("make_plan", lambda: moe_rt.make_plan(rmap, E, num_out_tokens=T * K)),
        ("dispatch", lambda: moe_rt.dispatch(x, plan)),
        ("dispatch_backward", lambda: moe_rt.dispatch_backward(g_ys, plan)),
        ("combine", lambda: moe_rt.combine(ys, plan, probs)),
        ("combine_backward", lambda: moe_rt.combine_backward(gy, plan, ys, probs)),
    ]


def cyclic_garbage(fn, calls: int = 20) -> collections.Counter:
    """The objects ``calls`` calls of ``fn`` leave in reference cycles, by type, per call (the collector off
    meanwhile; what it then finds unreachable)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(calls):
            fn()
        gc.collect()
        found = collections.Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        if was:
            gc.enable()
    return collections.Counter({k: v / calls for k, v in found.items()})


def run(framework: str, stub, timing: bool, cycles: bool = False):
    import torch

    from moe_rt import _arrays

    dev = FakeDevice(0)
    _arrays._devices[0] = dev
    streams = {}

    def as_cupy_stream(stream, device_id):
        COUNTS["moe_rt as_cupy_stream"] += 1
        ptr = 0 if stream is None else int(stream)
        s = streams.get(ptr)
        if s is None:
            s = streams[ptr] = FakeStream(ptr)
        return s

    _arrays.as_cupy_stream = as_cupy_stream
    if framework == "torch":
        Tensor, empty, raw, cur = make_fake_torch()
        torch.empty = empty
        torch._C._cuda_getCurrentRawStream = raw
        torch._C._cuda_getDevice = cur
        tdt = {"float32": torch.float32, "int32": torch.int32, None: torch.bfloat16}

        def new(shape, dtype):
            return Tensor(shape, tdt[dtype])
    else:
        import cupy

        ndarray, empty = make_fake_cupy()
        cupy.empty = empty
        from moe_rt._arrays import BFLOAT16

        def new(shape, dtype):
            return ndarray(shape, BFLOAT16 if dtype is None else dtype)

        old = _arrays._default_stream

        def default_stream(fw, device_id):
            COUNTS["cupy.cuda.get_current_stream"] += 1
            return as_cupy_stream(None, device_id)

        _arrays._default_stream = default_stream
        del old

        def cupy_device():
            COUNTS["cupy.cuda.runtime.getDevice"] += 1
            return 0

        _arrays._cupy_device = cupy_device
    rows = []
    for name, fn in op_cases(new, bf16=None):
        for _ in range(3):
            fn()
        COUNTS.clear()
        stub.stub_reset()
        fn()
        calls = dict(COUNTS)
        calls.update({f"driver {k}": v for k, v in driver_counts(stub).items()})
        if cycles:
            calls.update({f"cyclic {k}": v for k, v in cyclic_garbage(fn).items()})
        us = None
        if timing:
            # the objects made so far (torch, the stand-ins) out of the collector's way: a full collection of
            # them would otherwise land in one op's loop at random and add tens of us per call to it
            gc.collect()
            gc.freeze()
            n = 2000
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            us = (time.perf_counter() - t0) / n * 1e6
        rows.append((name, calls, us))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--framework", choices=("torch", "cupy", "both"), default="torch",
                    help="both: the torch rows, then the CuPy rows (each named with its framework)")
    ap.add_argument("--time", action="store_true", help="also the host us per call with the stand-ins")
    ap.add_argument("--cycles", action="store_true", help="also the objects a call leaves in reference cycles "
                    "('cyclic <type>' per call; there should be none)")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="moe_rt_profile_")
    stub = build_stub(tmp)
    root = os.path.join(tmp, "cache")
    os.makedirs(root)
    device_context(stub, root)
    both = args.framework == "both"
    for fw in ("torch", "cupy") if both else (args.framework,):
        for name, calls, us in run(fw, stub, args.time, args.cycles):
            head = (f"{fw} " if both else "") + name + (f" ({us:.1f} us host here)" if us is not None else "")
            print(head + ": " + ", ".join(f"{k} x{v}" for k, v in sorted(calls.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
