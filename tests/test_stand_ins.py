"""Stand-in kernels on a first call (include/moe_rt/moe_rt.h "Stand-in kernels", moe_rt._jit's stand-ins): on
CPU, through a stand-in CUDA driver (a small C library given to the core as MOE_RT_LIBCUDA) that loads "images"
naming their kernel and register count and records every launch. The C side through ctypes: a stand-in runs
only for the calls whose planner names it, planned with its own registers and configuration; swapping the
kernel in re-plans; a swap is refused while the stream is captured; calls on other threads during a swap run
either the stand-in or the kernel, each with its own plan, never a mix. The Python side (moe_rt._core): a
kernel-cache miss loads the stand-in and compiles the kernel in the background, the next call outside a capture
swaps it in, a failed background compile raises on the next call, MOE_RT_TIERED=0 and warmup take the kernels
alone. The GPU tests of moe_rt.router check that the stand-ins write the same bits."""
from __future__ import annotations

import ctypes as C
import hashlib
import importlib.util
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from moe_rt import _core, _jit, _xla, router  # noqa: F401 - router registers its kernels

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("moe_rt_libbuild", ROOT / "csrc" / "libbuild.py")
cbuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cbuild)

OK, INVALID, KERNEL_CACHE, NOT_SUPPORTED = 0, 1, 4, 7
F32, BF16, BOOL, U8 = 0, 2, 5, 6
SIGMOID, SOFTMAX, SQRTSOFTPLUS = 0, 1, 2
P, I, L, F, S = C.c_void_p, C.c_int, C.c_int64, C.c_float, C.c_size_t

STUB = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef struct fn { char name[128]; int regs; } fn;
typedef struct rec { char name[128]; long long grid; int block, smem; unsigned long tid; } rec;
#define NREC 200000
static rec recs[NREC];
static int nrec, nload, capturing;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread void* cur;
int cuInit(unsigned f) { (void)f; return 0; }
int cuDeviceGetCount(int* n) { *n = 1; return 0; }
int cuDeviceGet(int* d, int i) { *d = i; return 0; }
int cuDeviceGetAttribute(int* v, int a, int d) {
  (void)d;
  *v = a == 16 ? 132 : a == 75 ? 9 : a == 76 ? 0 : a == 81 ? 233472 : a == 97 ? 232448 : 0;
  return 0;
}
int cuDevicePrimaryCtxRetain(void** c, int d) { (void)d; *c = (void*)0x1000; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
int cuCtxGetCurrent(void** c) { *c = cur; return 0; }
int cuCtxSetCurrent(void* c) { cur = c; return 0; }
/* an image is the text "<kernel name>\n<registers>" */
int cuModuleLoadData(void** m, const void* image) {
  fn* f = calloc(1, sizeof *f);
  if (sscanf((const char*)image, "%127[^\n]\n%d", f->name, &f->regs) != 2) { free(f); return 200; }
  pthread_mutex_lock(&mu); nload++; pthread_mutex_unlock(&mu);
  *m = f;
  return 0;
}
int cuModuleUnload(void* m) { free(m); return 0; }
int cuModuleGetFunction(void** f, void* m, const char* name) { (void)name; *f = m; return 0; }
int cuModuleGetGlobal_v2(unsigned long long* p, size_t* b, void* m, const char* n) {
  (void)m; (void)n; *p = 0x2000; *b = 32; return 0;
}
int cuFuncGetAttribute(int* v, int a, void* f) { *v = a == 4 ? ((fn*)f)->regs : 0; return 0; }
int cuFuncSetAttribute(void* f, int a, int v) { (void)f; (void)a; (void)v; return 0; }
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void* s, void** args, void** extra) {
  (void)gy; (void)gz; (void)by; (void)bz; (void)s; (void)args; (void)extra;
  pthread_mutex_lock(&mu);
  if (nrec < NREC) {
    rec* r = &recs[nrec];
    memcpy(r->name, ((fn*)f)->name, 128);
    r->grid = gx; r->block = (int)bx; r->smem = (int)smem; r->tid = (unsigned long)pthread_self();
  }
  nrec++;
  pthread_mutex_unlock(&mu);
  return 0;
}
int cuMemAlloc_v2(unsigned long long* p, size_t n) { *p = (unsigned long long)(size_t)malloc(n ? n : 1); return 0; }
int cuMemFree_v2(unsigned long long p) { free((void*)(size_t)p); return 0; }
int cuMemsetD8Async(unsigned long long p, unsigned char c, size_t n, void* s) { (void)p; (void)c; (void)n; (void)s; return 0; }
int cuMemcpyHtoD_v2(unsigned long long d, const void* s, size_t n) { (void)d; (void)s; (void)n; return 0; }
int cuMemcpyDtoH_v2(void* d, unsigned long long s, size_t n) { (void)s; memset(d, 0, n); return 0; }
int cuMemcpyDtoHAsync_v2(void* d, unsigned long long s, size_t n, void* st) { (void)s; (void)st; memset(d, 0, n); return 0; }
int cuMemcpyDtoDAsync_v2(unsigned long long d, unsigned long long s, size_t n, void* st) {
  (void)d; (void)s; (void)n; (void)st; return 0;
}
int cuStreamSynchronize(void* s) { (void)s; return 0; }
int cuStreamIsCapturing(void* s, int* st) {  /* capturing 2: the query fails as for the legacy stream */
  (void)s; *st = capturing == 1;                /* while another stream captures in global mode */
  return capturing == 2 ? 906 : 0;
}
int cuGetErrorString(int r, const char** s) { (void)r; *s = "stub error"; return 0; }
/* for the tests */
void stub_reset(void) { pthread_mutex_lock(&mu); nrec = 0; pthread_mutex_unlock(&mu); }
int stub_launches(void) { pthread_mutex_lock(&mu); int n = nrec; pthread_mutex_unlock(&mu); return n; }
int stub_loads(void) { pthread_mutex_lock(&mu); int n = nload; pthread_mutex_unlock(&mu); return n; }
void stub_set_capturing(int c) { capturing = c; }
void stub_launch(int i, char* name, long long* grid, int* block, int* smem, unsigned long* tid) {
  pthread_mutex_lock(&mu);
  memcpy(name, recs[i].name, 128); *grid = recs[i].grid; *block = recs[i].block; *smem = recs[i].smem;
  *tid = recs[i].tid;
  pthread_mutex_unlock(&mu);
}
"""


DeviceInfo, PlanInfo = _xla._DeviceInfo, _xla._PlanInfo  # the C ABI's structures

SIGNATURES = {
    "moe_rt_last_error": (C.c_char_p, []),
    "moe_rt_context_create": (I, [C.c_char_p, I, C.POINTER(P)]),
    "moe_rt_context_create_planning": (I, [C.POINTER(DeviceInfo), C.POINTER(P)]),
    "moe_rt_context_destroy": (None, [P]),
    "moe_rt_last_plan": (I, [P, C.POINTER(PlanInfo)]),
    "moe_rt_last_plan_stand_in": (I, [P, I, C.c_char_p, S]),
    "moe_rt_context_load_stand_in": (I, [P, C.c_char_p, C.c_char_p, C.c_char_p]),
    "moe_rt_context_end_stand_ins": (I, [P, C.c_char_p, C.c_char_p, I, P]),
    "moe_rt_topk_with_score": (I, [P, P, I, L, I, I, I, I, I, I, F, P, P, P, I, P, P]),
    "moe_rt_topk_indices_with_score": (I, [P, P, I, L, I, I, I, I, I, I, F, P, P, P, P]),
    "moe_rt_scores_for_aux_loss": (I, [P, P, I, L, I, I, I, P, P, I, P, P]),
}
H100 = dict(sm_count=132, smem_per_sm=233472, smem_per_block_optin=232448, cc_major=9, cc_minor=0)
FILE = "router.cu"
# fp32, E=1024, K=8, 8 groups of which 4 are kept, sigmoid with a bias (score case 2): the kernel with 32 keys
# a lane and its stand-in, the one-warp row kernel compiled for that case (launched with its own configuration)
T, E, K, G, GK = 1 << 16, 1024, 8, 8, 4
FINAL = "router_fwd_reg<float, 32>"
QUICK2 = "router_fwd<float, 32, true, false, 2, true>"  # K <= 8: compiled without the paths of K > 8
QUICK3 = "router_fwd<float, 32, true, false, 3, true>"
REGS = {FINAL: 200}  # registers of each image (40 for the others): the grids differ with them
BASE = 0x7F0000000000


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    cc = cbuild.compiler() if cbuild.compiler() else None
    if cc is None:
        pytest.skip("no C compiler on PATH")
    d = tmp_path_factory.mktemp("libcuda_stub")
    (d / "stub.c").write_text(STUB)
    out = d / "libcuda.so.1"
    import subprocess

    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(d / "stub.c"), "-lpthread"], check=True)
    lib = C.CDLL(str(out))
    lib.stub_launch.argtypes = [I, C.c_char_p, C.POINTER(C.c_longlong), C.POINTER(I), C.POINTER(I),
                                C.POINTER(C.c_ulong)]
    lib.stub_set_capturing.argtypes = [I]
    lib.path = str(out)
    return lib


@pytest.fixture(scope="module")
def lib():
    lib = C.CDLL(_core.LIB_PATH)
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def _records(stub, start=0):
    out = []
    name = C.create_string_buffer(128)
    grid, block, smem, tid = C.c_longlong(), I(), I(), C.c_ulong()
    for i in range(start, stub.stub_launches()):
        stub.stub_launch(i, name, C.byref(grid), C.byref(block), C.byref(smem), C.byref(tid))
        out.append((name.value.decode(), grid.value, block.value, smem.value, tid.value))
    return out


def _write_cache(root: Path, names):
    """A kernel-cache folder whose manifest lists ``names`` (of router.cu, or (file, name)) for sm_90, each image
    naming its kernel and register count (REGS, else 40)."""
    rows = []
    (root / "sm_90").mkdir(parents=True, exist_ok=True)
    for n in names:
        file, n = n if isinstance(n, tuple) else (FILE, n)
        img = f"sm_90/k{hashlib.sha1((file + n).encode()).hexdigest()[:12]}.img"
        (root / img).write_text(f"{n}\n{REGS.get(n, 40)}")
        rows.append({"file": file, "name": n, "lowered": "k", "arch": "sm_90", "image": img})
    (root / "manifest.json").write_text(json.dumps({"format": 2, "source_hash": _jit.source_hash(), "nvrtc": "12.8",
                                                     "kernels": rows}))


def _device_ctx(lib, stub, root, monkeypatch):
    monkeypatch.setenv("MOE_RT_LIBCUDA", stub.path)
    ctx = P()
    assert lib.moe_rt_context_create(str(root).encode(), 0, C.byref(ctx)) == OK, lib.moe_rt_last_error()
    return ctx


def _topk(lib, ctx, bias=True, score=SIGMOID, dtype=F32, e=E, groups=(G, GK), routing_dtype=BOOL, t=T, k=K):
    g = groups or (0, 0)
    return lib.moe_rt_topk_with_score(ctx, BASE, dtype, t, e, k, score, 0, g[0], g[1], 1.0,
                                      BASE + (1 << 30) if bias else None, BASE + (2 << 30), BASE + (3 << 30),
                                      routing_dtype, BASE + (4 << 30), None)


def _planned(lib, regs=0, **kw):
    """The launch (kernel, grid, block, shared memory) and stand-in a planning context with ``regs`` assumed
    registers plans for _topk(**kw)."""
    ctx = P()
    assert lib.moe_rt_context_create_planning(C.byref(DeviceInfo(assumed_regs=regs, **H100)), C.byref(ctx)) == OK
    try:
        st = _topk(lib, ctx, **kw)
        assert st == OK, lib.moe_rt_last_error()
        info = PlanInfo()
        assert lib.moe_rt_last_plan(ctx, C.byref(info)) == OK
        name = C.create_string_buffer(128)
        assert lib.moe_rt_last_plan_stand_in(ctx, 0, name, 128) == OK
        l0 = info.launch[0]
        return (l0.kernel.decode(), l0.grid, l0.block, l0.shared_mem), name.value.decode()
    finally:
        lib.moe_rt_context_destroy(ctx)


def _expected(lib):
    """What the device context must launch: the kernel planned with its 200 registers; the stand-in with the
    one-warp row kernel's configuration (the plan of the same call on 4-byte aligned logits, which takes that
    kernel) and its 40 registers."""
    final, _ = _planned(lib, regs=200)
    assert final[0] == FINAL
    ctx = P()
    assert lib.moe_rt_context_create_planning(C.byref(DeviceInfo(assumed_regs=40, **H100)), C.byref(ctx)) == OK
    try:
        st = lib.moe_rt_topk_with_score(ctx, BASE + 4, F32, T, E, K, SIGMOID, 0, G, GK, 1.0, BASE + (1 << 30),
                                        BASE + (2 << 30), BASE + (3 << 30), BOOL, BASE + (4 << 30), None)
        assert st == OK, lib.moe_rt_last_error()
        info = PlanInfo()
        assert lib.moe_rt_last_plan(ctx, C.byref(info)) == OK
        row = info.launch[0]
        assert row.kernel.decode() == "router_fwd<float, 32>"
        quick = (QUICK2, row.grid, row.block, row.shared_mem)
    finally:
        lib.moe_rt_context_destroy(ctx)
    assert quick[1:] != final[1:]  # the two plans differ: a launch of one with the other's plan shows
    return final, quick


# ---- the planner's stand-ins --------------------------------------------------------------------------------

def test_the_planner_names_the_stand_ins_of_the_first_use_table(lib):
    """The router forward's stand-ins (csrc/router.c fwd_stand_in) for the shapes of BENCHMARKS.md's first-use
    table (tools/bench_compile.py), each registered as a quick kernel (compile-checked, left out of warmup)."""
    cases = [  # (kwargs of _topk, kernel, stand-in)
        (dict(score=SOFTMAX, bias=False, e=256, groups=None), "router_fwd_reg<float, 8>",
         "router_fwd_reg<float, 8, false, false, false, 0>"),
        (dict(score=SIGMOID, dtype=BF16, e=256, groups=(8, 4)), "router_fwd_reg<__nv_bfloat16, 8, true, true>", ""),
        (dict(score=SQRTSOFTPLUS, bias=False, e=2304, groups=None), "router_fwd<float, 32, false>",
         "router_fwd<float, 32, false, false, 6>"),
        (dict(score=SOFTMAX, bias=False, dtype=BF16, e=2304, groups=None), "router_fwd<__nv_bfloat16, 32, false>",
         "router_fwd<__nv_bfloat16, 32, false, false, 0>"),
        (dict(score=SIGMOID, bias=False, e=512, groups=None), "router_fwd_reg<float, 16>",
         "router_fwd_reg<float, 16, false, false, false, 3>"),
        (dict(score=SIGMOID, e=256, groups=(8, 4)), "router_fwd_reg<float, 8, true, true>", ""),
        (dict(), FINAL, QUICK2),
        (dict(bias=False), FINAL, QUICK3),
        (dict(k=16), FINAL, "router_fwd<float, 32, true, false, 2>"),  # K > 8: the row kernel with every path
        (dict(dtype=BF16, e=2304, k=16), "router_fwd<__nv_bfloat16, 32>", "router_fwd<__nv_bfloat16, 32, true, false, 2>"),
        (dict(dtype=BF16, e=2304), "router_fwd<__nv_bfloat16, 32>", "router_fwd<__nv_bfloat16, 32, true, false, 2, true>"),
        (dict(score=SOFTMAX, bias=False, dtype=BF16, e=256, groups=None), "router_fwd_reg<__nv_bfloat16, 8, false>",
         ""),  # bf16 at 8 keys a lane: the kernel compiles in about a second
        (dict(score=SOFTMAX, bias=False, e=4096, groups=None), "router_fwd<float, 128>", ""),  # teams above 32
        (dict(routing_dtype=U8), "router_fwd_reg<float, 32, true, false, true>", ""),  # the bit-packed map
    ]
    quick = {n for f, n in _jit.QUICK}
    for kw, kernel, stand_in in cases:
        (name, *_), got = _planned(lib, **kw)
        assert (name, got) == (kernel, stand_in), kw
        assert not stand_in or stand_in in quick, stand_in
    # the aux scores: score cases 1 and 4
    ctx = P()
    assert lib.moe_rt_context_create_planning(C.byref(DeviceInfo(**H100)), C.byref(ctx)) == OK
    try:
        for score, case in ((SIGMOID, 1), (SQRTSOFTPLUS, 4), (SOFTMAX, 0)):
            assert lib.moe_rt_scores_for_aux_loss(ctx, BASE, F32, 64, 512, 8, score, BASE, BASE, BOOL, BASE,
                                                  None) == OK
            name = C.create_string_buffer(128)
            assert lib.moe_rt_last_plan_stand_in(ctx, 0, name, 128) == OK
            assert name.value.decode() == f"router_fwd_reg<float, 16, false, false, false, {case}>"
            assert name.value.decode() in quick
    finally:
        lib.moe_rt_context_destroy(ctx)


def test_quick_kernels_are_registered_apart_from_the_kernels():
    assert _jit.QUICK and all((f, n) in set(_jit.registered()) for f, n in _jit.QUICK)
    assert not set(_jit.QUICK) & set(_jit.registered(quick=False))
    assert len(_jit.registered()) == len(_jit.registered(quick=False)) + len(_jit.QUICK)


def test_stand_in_arguments_are_checked(lib, stub, tmp_path, monkeypatch):
    pctx = P()
    assert lib.moe_rt_context_create_planning(C.byref(DeviceInfo(**H100)), C.byref(pctx)) == OK
    name = C.create_string_buffer(128)
    try:
        assert _topk(lib, pctx) == OK
        assert lib.moe_rt_last_plan_stand_in(pctx, 1, name, 128) == INVALID
        assert b"launch must be in [0, 1)" in lib.moe_rt_last_error()
        assert lib.moe_rt_last_plan_stand_in(pctx, 0, name, 16) == INVALID
        assert lib.moe_rt_last_plan_stand_in(pctx, 0, None, 128) == INVALID
        assert lib.moe_rt_context_load_stand_in(pctx, FILE.encode(), FINAL.encode(), FINAL.encode()) == INVALID
        assert b"another kernel" in lib.moe_rt_last_error()
        assert lib.moe_rt_context_load_stand_in(pctx, FILE.encode(), FINAL.encode(), None) == INVALID
        assert lib.moe_rt_context_load_stand_in(pctx, FILE.encode(), FINAL.encode(), QUICK2.encode()) == OK  # no-op
        assert lib.moe_rt_context_end_stand_ins(pctx, FILE.encode(), None, 1, None) == INVALID
    finally:
        lib.moe_rt_context_destroy(pctx)
    _write_cache(tmp_path, [QUICK2])
    ctx = _device_ctx(lib, stub, tmp_path, monkeypatch)
    try:
        assert lib.moe_rt_last_plan_stand_in(ctx, 0, name, 128) == NOT_SUPPORTED
        # a stand-in the folder lacks
        assert lib.moe_rt_context_load_stand_in(ctx, FILE.encode(), FINAL.encode(), QUICK3.encode()) == KERNEL_CACHE
    finally:
        lib.moe_rt_context_destroy(ctx)


# ---- the C core: stand-in, swap, capture, retirement, threads --------------------------------------------------

def test_a_stand_in_serves_its_calls_until_the_kernel_is_swapped_in(lib, stub, tmp_path, monkeypatch):
    final, quick = _expected(lib)
    _write_cache(tmp_path, [QUICK2, QUICK3])  # the kernel itself is still compiling
    ctx = _device_ctx(lib, stub, tmp_path, monkeypatch)
    try:
        stub.stub_reset()
        assert _topk(lib, ctx) == KERNEL_CACHE and FINAL.encode() in lib.moe_rt_last_error()
        loads = stub.stub_loads()
        assert lib.moe_rt_context_load_stand_in(ctx, FILE.encode(), FINAL.encode(), QUICK2.encode()) == OK
        assert stub.stub_loads() == loads + 1
        assert _topk(lib, ctx) == OK and _topk(lib, ctx) == OK
        assert lib.moe_rt_topk_indices_with_score(ctx, BASE, F32, T, E, K, SIGMOID, 0, G, GK, 1.0, BASE + (1 << 30),
                                                  BASE + (2 << 30), BASE + (3 << 30), None) == OK
        assert [r[:4] for r in _records(stub)] == [quick] * 3
        # the stand-in of score case 2 does not serve case 3 (sigmoid without a bias)
        assert _topk(lib, ctx, bias=False) == KERNEL_CACHE
        # while the stream is captured nothing is loaded; the calls go on with the stand-in
        stub.stub_set_capturing(1)
        try:
            assert lib.moe_rt_context_end_stand_ins(ctx, FILE.encode(), FINAL.encode(), 1, None) == NOT_SUPPORTED
            assert b"captured" in lib.moe_rt_last_error()
            assert stub.stub_loads() == loads + 1
            assert _topk(lib, ctx) == OK
            stub.stub_set_capturing(2)
            assert lib.moe_rt_context_end_stand_ins(ctx, FILE.encode(), FINAL.encode(), 1, None) == NOT_SUPPORTED
            assert stub.stub_loads() == loads + 1
        finally:
            stub.stub_set_capturing(0)
        # the kernel is not in the folder yet: the swap fails and the stand-in stays
        assert lib.moe_rt_context_end_stand_ins(ctx, FILE.encode(), FINAL.encode(), 1, None) == KERNEL_CACHE
        assert _topk(lib, ctx) == OK
        assert [r[:4] for r in _records(stub)] == [quick] * 5
        # compiled: swapped in, and the calls are planned again with its registers (its own grid)
        _write_cache(tmp_path, [QUICK2, QUICK3, FINAL])
        assert lib.moe_rt_context_end_stand_ins(ctx, FILE.encode(), FINAL.encode(), 1, None) == OK
        assert stub.stub_loads() == loads + 2
        assert _topk(lib, ctx) == OK and _topk(lib, ctx, bias=False) == OK and _topk(lib, ctx) == OK
        assert [r[:4] for r in _records(stub, 5)] == [final] * 3
        # a stand-in loaded after the kernel changes nothing: the kernel comes first
        assert lib.moe_rt_context_load_stand_in(ctx, FILE.encode(), FINAL.encode(), QUICK2.encode()) == OK
        assert _topk(lib, ctx) == OK and _records(stub, 8)[0][:4] == final
    finally:
        lib.moe_rt_context_destroy(ctx)


def test_retired_stand_ins_leave_the_calls_to_the_kernel(lib, stub, tmp_path, monkeypatch):
    """A failed compile retires the stand-ins alone (load 0): the calls then need the kernel again."""
    _, quick = _expected(lib)
    _write_cache(tmp_path, [QUICK2])
    ctx = _device_ctx(lib, stub, tmp_path, monkeypatch)
    try:
        stub.stub_reset()
        assert lib.moe_rt_context_load_stand_in(ctx, FILE.encode(), FINAL.encode(), QUICK2.encode()) == OK
        assert _topk(lib, ctx) == OK and _records(stub)[0][:4] == quick
        stub.stub_set_capturing(1)  # retiring loads nothing: allowed under capture
        try:
            assert lib.moe_rt_context_end_stand_ins(ctx, FILE.encode(), FINAL.encode(), 0, None) == OK
        finally:
            stub.stub_set_capturing(0)
        assert _topk(lib, ctx) == KERNEL_CACHE and FINAL.encode() in lib.moe_rt_last_error()
        assert stub.stub_launches() == 1
        # loading the stand-in again brings it back (a fresh entry)
        assert lib.moe_rt_context_load_stand_in(ctx, FILE.encode(), FINAL.encode(), QUICK2.encode()) == OK
        assert _topk(lib, ctx) == OK and _records(stub)[1][:4] == quick
    finally:
        lib.moe_rt_context_destroy(ctx)


def test_calls_on_other_threads_during_a_swap_run_one_kernel_with_its_own_plan(lib, stub, tmp_path, monkeypatch):
    final, quick = _expected(lib)
    _write_cache(tmp_path, [QUICK2, FINAL])
    for _round in range(3):
        ctx = _device_ctx(lib, stub, tmp_path, monkeypatch)
        try:
            stub.stub_reset()
            assert lib.moe_rt_context_load_stand_in(ctx, FILE.encode(), FINAL.encode(), QUICK2.encode()) == OK
            errors = []
            stop = threading.Event()

            def work():
                n = 0
                while not stop.is_set() or n < 50:  # ctypes releases the GIL for the call
                    st = _topk(lib, ctx)
                    if st != OK:
                        errors.append(lib.moe_rt_last_error())
                        return
                    n += 1

            threads = [threading.Thread(target=work) for _ in range(4)]
            for t in threads:
                t.start()
            end = time.time() + 30
            while stub.stub_launches() < 400 and time.time() < end:
                time.sleep(0.001)
            assert lib.moe_rt_context_end_stand_ins(ctx, FILE.encode(), FINAL.encode(), 1, None) == OK
            swapped = stub.stub_launches()
            while stub.stub_launches() < swapped + 400 and time.time() < end:
                time.sleep(0.001)
            stop.set()
            for t in threads:
                t.join()
            assert not errors, errors
            recs = _records(stub)
            assert {r[:4] for r in recs} == {quick, final}  # each launch: one kernel with its own plan
            seen = {}
            for r in recs:  # on each thread: the stand-in, then the kernel, never back
                if r[0] == FINAL:
                    seen[r[4]] = True
                else:
                    assert not seen.get(r[4]), "a thread ran the stand-in after it ran the kernel"
            # a call that began after the swap returned runs the kernel
            assert _topk(lib, ctx) == OK and _records(stub, stub.stub_launches() - 1)[0][:4] == final
        finally:
            lib.moe_rt_context_destroy(ctx)


# ---- moe_rt._core: the Python side ------------------------------------------------------------------------

@pytest.fixture
def pycore(lib, stub, tmp_path, monkeypatch):
    """moe_rt._core's device 0 over the stand-in driver, with an NVRTC stand-in that writes images naming their
    kernel into the cache folder (background compiles wait for ``gate``; ``fail`` makes them raise)."""
    root = tmp_path / "cache"
    state = type("State", (), {})()
    state.gate, state.fail, state.compiled = threading.Event(), False, []
    written = set()

    def cache_kernels(root_, names, arch, where=""):
        for file, name in names:
            state.compiled.append((name, where))
            if "background" in where:
                assert state.gate.wait(30)
            if state.fail and name == FINAL:
                raise RuntimeError(f"NVRTC failed on {name}")
            written.add((file, name))
            p = _jit._entry(root_, file, name, arch)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"{name}\n{REGS.get(name, 40)}")
        _write_cache(Path(root_), sorted(written))  # its own images, listed in the manifest

    monkeypatch.setenv("MOE_RT_LIBCUDA", stub.path)
    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(root))
    monkeypatch.setattr(_jit, "cache_kernels", cache_kernels)
    monkeypatch.setattr(_jit, "cache_key", lambda file, name, arch: hashlib.sha1(name.encode()).hexdigest()[:16])
    monkeypatch.setattr(_jit, "arch_for", lambda cc: "sm_90")
    monkeypatch.setattr(_jit, "device_properties", lambda dev: {"cc": (9, 0)})
    monkeypatch.setattr(_jit, "TIERED", True)
    monkeypatch.setattr(_jit, "_background", {})
    monkeypatch.setattr(_jit, "_failed", set())
    monkeypatch.setattr(_core, "_devices", {})
    root.mkdir()
    state.core = _core.device(0)
    stub.stub_reset()
    yield state
    state.gate.set()
    assert _jit.settle(30)


def _py_topk(d, bias=True, stream=0):
    _core.topk_with_score(d, BASE, F32, T, E, K, SIGMOID, 0, G, GK, 1.0, BASE + (1 << 30) if bias else 0,
                          BASE + (2 << 30), BASE + (3 << 30), BOOL, BASE + (4 << 30), stream)


def test_a_first_call_runs_the_stand_in_and_a_later_one_the_kernel(lib, stub, pycore):
    final, quick = _expected(lib)
    d = pycore.core
    n0 = _jit.stand_ins_loaded
    _py_topk(d)
    _py_topk(d)
    assert [r[:4] for r in _records(stub)] == [quick] * 2
    assert _jit.stand_ins_loaded == n0 + 1
    assert [n for n, w in pycore.compiled if w] == [FINAL]  # one background compile, said as such
    assert not _jit.settle(timeout=0.05)  # still compiling
    # another score case gets its own stand-in; the kernel is not compiled twice
    _py_topk(d, bias=False)
    assert _records(stub)[2][0] == QUICK3 and _jit.stand_ins_loaded == n0 + 2
    assert [n for n, w in pycore.compiled if w] == [FINAL]
    pycore.gate.set()
    assert _jit.settle(timeout=30)
    assert d.pending == [(FILE, FINAL, True)]
    stub.stub_set_capturing(1)  # a call under capture keeps the stand-in; nothing is loaded then
    try:
        loads = stub.stub_loads()
        _py_topk(d)
        assert _records(stub)[3][:4] == quick and stub.stub_loads() == loads and d.pending
    finally:
        stub.stub_set_capturing(0)
    _py_topk(d)
    _py_topk(d, bias=False)
    assert [r[:4] for r in _records(stub, 4)] == [final, final] and not d.pending


def test_a_changed_kernel_cache_folder_raises_on_the_next_call(lib, stub, pycore, monkeypatch, tmp_path):
    """MOE_RT_NVRTC_OPTIONS or MOE_RT_KERNEL_CACHE changed after a device's context was made: its next op raises
    RuntimeError naming the variables and launches nothing (its loaded kernels are the old folder's builds); so do
    the miss path and another device's context. A change that keeps the folder, or a change undone, runs on."""
    d = pycore.core
    pycore.gate.set()
    monkeypatch.setattr(_jit, "TIERED", False)  # the kernel itself, compiled in the foreground
    monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS", raising=False)
    _py_topk(d)
    n, loads = stub.stub_launches(), stub.stub_loads()
    assert n == 1 and _records(stub)[0][0] == FINAL
    was = _jit.cache_dir()
    for var, value in (("MOE_RT_NVRTC_OPTIONS", "-lineinfo"), ("MOE_RT_KERNEL_CACHE", str(tmp_path / "other"))):
        monkeypatch.setenv(var, value)
        for call in (lambda: _py_topk(d), lambda: _py_topk(d, bias=False), lambda: d._prepare([]),
                     lambda: _core.device(1)):
            with pytest.raises(RuntimeError, match="MOE_RT_NVRTC_OPTIONS / MOE_RT_KERNEL_CACHE before the first op") as e:
                call()
            assert was in str(e.value) and _jit.cache_dir() in str(e.value)
        assert stub.stub_launches() == n and stub.stub_loads() == loads and 1 not in _core._devices
        monkeypatch.delenv("MOE_RT_NVRTC_OPTIONS", raising=False)
        monkeypatch.setenv("MOE_RT_KERNEL_CACHE", was)
        _py_topk(d)  # undone: runs again
        n += 1
        assert stub.stub_launches() == n and _records(stub, n - 1)[0][0] == FINAL
    monkeypatch.setenv("MOE_RT_NVRTC_OPTIONS", "   ")  # no options: the same folder
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # not read while MOE_RT_KERNEL_CACHE is set
    _py_topk(d)
    assert stub.stub_launches() == n + 1


def test_a_failed_background_compile_raises_on_the_next_call(lib, stub, pycore, caplog):
    d = pycore.core
    pycore.fail = True
    _py_topk(d)  # the stand-in runs
    pycore.gate.set()
    with caplog.at_level(logging.WARNING, logger="moe_rt"):
        assert _jit.settle(timeout=30)
    assert any("in the background failed" in r.getMessage() and FINAL in r.getMessage() for r in caplog.records)
    assert d.pending == [(FILE, FINAL, False)]
    # the next call retires the stand-ins, needs the kernel, compiles it in the foreground and raises there
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        _py_topk(d)
    with pytest.raises(RuntimeError, match="NVRTC failed"):  # every call, as long as it fails
        _py_topk(d)
    assert [n for n, w in pycore.compiled if n == FINAL] == [FINAL] * 3
    pycore.fail = False
    _py_topk(d)
    assert _records(stub)[-1][0] == FINAL and not _jit._failed


def test_with_tiering_off_the_kernel_compiles_in_the_foreground(lib, stub, pycore, monkeypatch):
    monkeypatch.setattr(_jit, "TIERED", False)
    _py_topk(pycore.core)
    assert [r[0] for r in _records(stub)] == [FINAL]
    assert not _jit._background and [n for n, w in pycore.compiled if n == FINAL] == [(FINAL)]


def test_a_kernel_already_in_the_cache_is_taken_at_once(lib, stub, pycore):
    _jit.cache_kernels(_jit.cache_dir(), [(FILE, FINAL)], "sm_90")
    _py_topk(pycore.core)
    assert [r[0] for r in _records(stub)] == [FINAL] and not _jit._background


def test_a_process_ending_during_a_background_compile_waits_for_it(tmp_path):
    """Exit while NVRTC runs on the background thread: the process waits for the compile (its cache entry is
    complete) and ends cleanly. Without the wait the C runtime's teardown freed memory the compile still used:
    a segfault or a glibc abort after the script's last line."""
    import os
    import subprocess
    import sys

    code = ("from moe_rt import _jit, router\n"
            f"assert _jit.compile_in_background({str(tmp_path)!r}, 'router.cu', {FINAL!r}, 'sm_90', lambda ok: None)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert len(list(tmp_path.rglob("*.cubin"))) == 1


def test_warmup_leaves_the_quick_kernels_out(monkeypatch, tmp_path):
    """``warmup`` compiles the kernels alone: every registered kernel but the quick ones."""
    from concurrent.futures import Future

    from moe_rt import _warmup

    submitted = []

    class Pool:  # runs nothing: records what warmup hands its workers
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, f, n, a, root, source_hash):
            submitted.append((f, n, a))
            fut = Future()
            fut.set_result((True, 0.0))
            return fut

    monkeypatch.setattr(_warmup, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(_jit, "check_arch", lambda a: a)
    monkeypatch.setattr(_jit, "write_manifest", lambda root, archs: Path(root) / "manifest.json")
    r = _warmup.warmup(["sm_90"], out=str(tmp_path), jobs=1, progress=False)
    assert sorted(submitted) == sorted((f, n, "sm_90") for f, n in _jit.registered(quick=False))
    assert r["kernels"] == len(_jit.registered()) - len(_jit.QUICK)
    assert not {(f, n) for f, n, a in submitted} & _jit.QUICK


@pytest.mark.gpu
def test_gpu_a_graph_captured_with_the_stand_in_keeps_it(rng, monkeypatch, tmp_path):
    """On a fresh context over an empty kernel cache: the first call runs the stand-in while the kernel
    compiles; a call captured into a CUDA graph after the compile is done loads nothing and captures the
    stand-in; the next call outside the capture swaps the kernel in; the graph keeps replaying the stand-in,
    and every output has the same bits."""
    import cupy as cp
    import numpy as np

    from moe_rt import router as R

    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(_jit, "TIERED", True)
    monkeypatch.setattr(_jit, "_background", {})
    monkeypatch.setattr(_jit, "_failed", set())
    monkeypatch.setattr(_core, "_devices", {})
    x = cp.asarray((rng.permutation(1031 * 512).reshape(1031, 512) / (1031 * 64) - 4).astype(np.float32))  # no ties
    s = cp.cuda.Stream(non_blocking=True)
    n0 = _jit.stand_ins_loaded
    with s:
        first = R.topk_with_score(x, 8, score_function="sigmoid")  # router_fwd_reg<float, 16>'s stand-in
        s.synchronize()
    assert _jit.stand_ins_loaded == n0 + 1
    assert _jit.settle(timeout=600)
    d = _core.device(cp.cuda.Device().id)
    assert d.pending == [("router.cu", "router_fwd_reg<float, 16>", True)]
    with s:
        s.begin_capture()
        captured = R.topk_with_score(x, 8, score_function="sigmoid")
        graph = s.end_capture()
    assert d.pending  # nothing was loaded under the capture
    graph.launch(s)
    s.synchronize()
    with s:
        later = R.topk_with_score(x, 8, score_function="sigmoid")  # swaps the kernel in
        s.synchronize()
    assert not d.pending
    replay = [o.copy() for o in captured]
    graph.launch(s)  # the stand-in, still
    s.synchronize()
    for outs in (captured, later, replay):
        for a, b in zip(first, outs):
            assert (cp.asnumpy(a).view(np.uint8) == cp.asnumpy(b).view(np.uint8)).all()
