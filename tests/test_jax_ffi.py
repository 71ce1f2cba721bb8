"""moe_rt.jax through XLA FFI: the handler library (csrc/xla_ffi.c -> libmoe_rt_xla.so) builds against
jaxlib's FFI headers and registers with XLA; the moved ops (the router top-k in every routing form, the Quantile
Balancing top-k, the aux scores and loss, make_plan, dispatch, combine, sort_chunks, the FP8 casts; forward and
backward) lower for CUDA to custom calls carrying their static facts as attributes (checked here by lowering
for CUDA on a CPU machine), and for the CPU to the NumPy reference; the handlers, called with hand-built call
frames, answer XLA's metadata query and fail cleanly with an FFI error (no crash) where there is no kernel cache
or no GPU. On a GPU: every moved op under jit, grad, vmap and checkpoint against the NumPy reference and bitwise
equal to the direct (CuPy) path, and the layer step and the Quantile Balancing forward with XLA command buffers
enabled."""
from __future__ import annotations

import importlib.util
from functools import partial
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: moe_rt.jax and its XLA FFI handlers need it")
jnp = jax.numpy
mj = pytest.importorskip("moe_rt.jax")

from moe_rt import _jit, _xla  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("moe_rt_libbuild", ROOT / "csrc" / "libbuild.py")
cbuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cbuild)


def _cc():
    cc = cbuild.compiler()
    if cc is None:
        pytest.skip("no C compiler on PATH")
    return cc


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """libmoe_rt.so and libmoe_rt_xla.so built from this tree into a temporary folder."""
    _cc()
    out = tmp_path_factory.mktemp("xla_lib")
    include = cbuild.xla_include_dir()
    assert include is not None, "jax is installed but jax.ffi.include_dir() holds no xla/ffi/api/c_api.h"
    try:
        core = cbuild.build(out / "libmoe_rt.so")
        xla = cbuild.build_xla(out / cbuild.XLA_LIB, core, include)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"the libraries did not build:\n{e.stdout}{e.stderr}")
    return core, xla, include


def test_ffi_library_builds_and_exports_the_handlers(built):
    import ctypes

    _, xla, _ = built
    lib = ctypes.CDLL(str(xla))
    for op in _xla.HANDLERS:
        assert getattr(lib, "moe_rt_xla_" + op)
    for name in ("moe_rt_xla_set_kernel_cache", "moe_rt_xla_load_kernel", "moe_rt_xla_last_error"):
        assert getattr(lib, name)
    nm = subprocess.run(["nm", "-D", "--defined-only", str(xla)], capture_output=True, text=True)
    if nm.returncode == 0:  # only moe_rt_xla_* symbols are exported
        syms = [line.split()[-1] for line in nm.stdout.splitlines() if line.split()[1:2] == ["T"]]
        assert syms and all(s.startswith("moe_rt_xla_") for s in syms), syms


# The hand-built call frames' common part: XLA's API table with stand-in error, stream and device-ordinal
# functions, a frame at the execute stage, XLA's metadata query (the traits a handler declares), and report().
_FRAME_COMMON = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "xla/ffi/api/c_api.h"

struct XLA_FFI_Error { XLA_FFI_Error_Code code; char msg[2048]; };
static XLA_FFI_Error* err_create(XLA_FFI_Error_Create_Args* a) {
  XLA_FFI_Error* e = calloc(1, sizeof *e);
  e->code = a->errc;
  snprintf(e->msg, sizeof e->msg, "%s", a->message);
  return e;
}
static int g_ordinal = 0;
static XLA_FFI_Error* stream_get(XLA_FFI_Stream_Get_Args* a) { a->stream = NULL; return NULL; }
static XLA_FFI_Error* ordinal_get(XLA_FFI_DeviceOrdinal_Get_Args* a) { a->device_ordinal = g_ordinal; return NULL; }

static void report(const char* what, XLA_FFI_Error* e) {
  if (!e) printf("%s: ok\n", what);
  else { printf("%s: code=%d msg=%s\n", what, (int)e->code, e->msg); free(e); }
}

/* report(what, call) with `field` set to `bad` for the call (then restored) */
#define WITH(field, bad, what, call)    \
  do {                                  \
    __typeof__(field) keep_ = (field);  \
    (field) = (bad);                    \
    report(what, call);                 \
    (field) = keep_;                    \
  } while (0)

static void frame_init(XLA_FFI_Api* api, XLA_FFI_CallFrame* f) {
  memset(api, 0, sizeof *api);
  api->struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  api->api_version.major_version = XLA_FFI_API_MAJOR;
  api->api_version.minor_version = XLA_FFI_API_MINOR;
  api->XLA_FFI_Error_Create = err_create;
  api->XLA_FFI_Stream_Get = stream_get;
  api->XLA_FFI_DeviceOrdinal_Get = ordinal_get;
  memset(f, 0, sizeof *f);
  f->struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  f->api = api;
  f->stage = XLA_FFI_ExecutionStage_EXECUTE;
}

/* XLA's metadata query to `handler`: reports "metadata", prints "traits=<traits> api=<major>.<minor>" */
static void metadata(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*), XLA_FFI_CallFrame* f) {
  XLA_FFI_Metadata md;
  memset(&md, 0, sizeof md);
  md.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension ext;
  memset(&ext, 0, sizeof ext);
  ext.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  ext.extension_base.type = XLA_FFI_Extension_Metadata;
  ext.metadata = &md;
  f->extension_start = &ext.extension_base;
  report("metadata", handler(f));
  printf("traits=%u api=%d.%d\n", md.traits, md.api_version.major_version, md.api_version.minor_version);
  f->extension_start = NULL;
}
"""

_FRAME_TEST = _FRAME_COMMON + r"""
XLA_FFI_Error* moe_rt_xla_topk_with_score(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_make_plan(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_scores_for_aux_loss(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_aux_loss(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_sort_chunks(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_quantize_fp8(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_topk_with_score_qb(XLA_FFI_CallFrame*);
int moe_rt_xla_set_kernel_cache(const char*);

int main(int argc, char** argv) {
  XLA_FFI_Api api;
  XLA_FFI_CallFrame f;
  frame_init(&api, &f);
  metadata(moe_rt_xla_topk_with_score, &f);

  /* router top-k over host buffers: logits [5, 8] float32 -> probs, routing_map, intermediate */
  float logits[40], probs[40], inter[40];
  unsigned char rmap[40];
  for (int i = 0; i < 40; ++i) logits[i] = (float)i / 40.0f;
  int64_t dims[2] = {5, 8};
  XLA_FFI_Buffer in = {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_F32, logits, 2, dims};
  XLA_FFI_Buffer out0 = {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_F32, probs, 2, dims};
  XLA_FFI_Buffer out1 = {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_PRED, rmap, 2, dims};
  XLA_FFI_Buffer out2 = {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_F32, inter, 2, dims};
  XLA_FFI_ArgType at[1] = {XLA_FFI_ArgType_BUFFER};
  void* args[1] = {&in};
  XLA_FFI_RetType rt[3] = {XLA_FFI_RetType_BUFFER, XLA_FFI_RetType_BUFFER, XLA_FFI_RetType_BUFFER};
  void* rets[3] = {&out0, &out1, &out2};
  f.args.struct_size = XLA_FFI_Args_STRUCT_SIZE;
  f.args.size = 1; f.args.types = at; f.args.args = args;
  f.rets.struct_size = XLA_FFI_Rets_STRUCT_SIZE;
  f.rets.size = 3; f.rets.types = rt; f.rets.rets = rets;
  /* attributes, sorted by name as XLA gives them */
  static const char* names[7] = {"group_topk", "has_bias", "num_groups", "scaling_factor", "score_function", "topk",
                                 "use_pre_softmax"};
  int32_t iv[7] = {0, 0, 0, 0, 0, 2, 0};
  float scale = 1.0f;
  XLA_FFI_ByteSpan spans[7];
  XLA_FFI_ByteSpan* span_ptrs[7];
  XLA_FFI_Scalar sc[7];
  void* attrs[7];
  XLA_FFI_AttrType types[7];
  for (int i = 0; i < 7; ++i) {
    spans[i].ptr = names[i]; spans[i].len = strlen(names[i]); span_ptrs[i] = &spans[i];
    sc[i].dtype = i == 3 ? XLA_FFI_DataType_F32 : XLA_FFI_DataType_S32;
    sc[i].value = i == 3 ? (void*)&scale : (void*)&iv[i];
    attrs[i] = &sc[i];
    types[i] = XLA_FFI_AttrType_SCALAR;
  }
  f.attrs.struct_size = XLA_FFI_Attrs_STRUCT_SIZE;
  f.attrs.size = 7; f.attrs.types = types; f.attrs.names = span_ptrs; f.attrs.attrs = attrs;

  report("no kernel cache set", moe_rt_xla_topk_with_score(&f));
  if (moe_rt_xla_set_kernel_cache(argv[1])) { printf("set_kernel_cache failed\n"); return 1; }
  report("empty kernel cache", moe_rt_xla_topk_with_score(&f));
  if (moe_rt_xla_set_kernel_cache(argv[2])) { printf("set_kernel_cache failed\n"); return 1; }
  report("no driver", moe_rt_xla_topk_with_score(&f));
  report("scores no driver", moe_rt_xla_scores_for_aux_loss(&f)); /* its attributes are among the top-k's */
  report("aux missing attribute", moe_rt_xla_aux_loss(&f));
  report("sort missing attribute", moe_rt_xla_sort_chunks(&f));
  report("fp8 missing attribute", moe_rt_xla_quantize_fp8(&f));
  f.attrs.size = 5; /* score_function is the last one left: topk is missing */
  report("missing attribute", moe_rt_xla_topk_with_score(&f));
  f.attrs.size = 7;
  f.args.size = 0;
  report("missing argument", moe_rt_xla_topk_with_score(&f));
  f.args.size = 1;
  f.stage = XLA_FFI_ExecutionStage_PREPARE;
  report("prepare stage", moe_rt_xla_topk_with_score(&f));
  f.stage = XLA_FFI_ExecutionStage_EXECUTE;
  api.api_version.major_version = XLA_FFI_API_MAJOR + 1;
  report("other major version", moe_rt_xla_topk_with_score(&f));
  api.api_version.major_version = XLA_FFI_API_MAJOR;
  report("qb missing attribute", moe_rt_xla_topk_with_score_qb(&f));

  /* Quantile Balancing: logits [5, 8], bias [8], histogram [8, 4] -> probs, map, intermediate, histogram,
   * cutoff [5]; attributes qb_histogram_mode, scaling_factor, topk */
  float qbias[8] = {0}, bounds[2] = {-1.0f, 1.0f}, cutoff[5];
  int32_t hist[32] = {0}, hist2[32] = {0};
  int64_t bdims[1] = {8}, hdims[2] = {8, 4}, two[1] = {2}, tdims[1] = {5};
  XLA_FFI_Buffer qa[4] = {{XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_F32, logits, 2, dims},
                          {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_F32, qbias, 1, bdims},
                          {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_S32, hist, 2, hdims},
                          {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_F32, bounds, 1, two}};
  XLA_FFI_Buffer qr[5] = {out0, out1, out2, {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_S32, hist2, 2, hdims},
                          {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_F32, cutoff, 1, tdims}};
  XLA_FFI_ArgType qat[4] = {XLA_FFI_ArgType_BUFFER, XLA_FFI_ArgType_BUFFER, XLA_FFI_ArgType_BUFFER,
                            XLA_FFI_ArgType_BUFFER};
  XLA_FFI_RetType qrt[5] = {XLA_FFI_RetType_BUFFER, XLA_FFI_RetType_BUFFER, XLA_FFI_RetType_BUFFER,
                            XLA_FFI_RetType_BUFFER, XLA_FFI_RetType_BUFFER};
  void* qargs[4] = {&qa[0], &qa[1], &qa[2], &qa[3]};
  void* qrets[5] = {&qr[0], &qr[1], &qr[2], &qr[3], &qr[4]};
  f.args.size = 4; f.args.types = qat; f.args.args = qargs;
  f.rets.size = 5; f.rets.types = qrt; f.rets.rets = qrets;
  static const char* qnames[3] = {"qb_histogram_mode", "scaling_factor", "topk"};
  int32_t qiv[3] = {1, 0, 2};
  XLA_FFI_ByteSpan qspans[3];
  XLA_FFI_ByteSpan* qspan_ptrs[3];
  XLA_FFI_Scalar qsc[3];
  void* qattrs[3];
  XLA_FFI_AttrType qtypes[3];
  for (int i = 0; i < 3; ++i) {
    qspans[i].ptr = qnames[i]; qspans[i].len = strlen(qnames[i]); qspan_ptrs[i] = &qspans[i];
    qsc[i].dtype = i == 1 ? XLA_FFI_DataType_F32 : XLA_FFI_DataType_S32;
    qsc[i].value = i == 1 ? (void*)&scale : (void*)&qiv[i];
    qattrs[i] = &qsc[i];
    qtypes[i] = XLA_FFI_AttrType_SCALAR;
  }
  f.attrs.size = 3; f.attrs.types = qtypes; f.attrs.names = qspan_ptrs; f.attrs.attrs = qattrs;
  report("qb not aliased", moe_rt_xla_topk_with_score_qb(&f));
  qr[3].data = hist;
  report("qb no driver", moe_rt_xla_topk_with_score_qb(&f));
  bdims[0] = 7;
  report("qb bad shape", moe_rt_xla_topk_with_score_qb(&f));
  bdims[0] = 8;
  qa[2].dtype = XLA_FFI_DataType_S64;
  report("qb bad histogram dtype", moe_rt_xla_topk_with_score_qb(&f));
  return 0;
}
"""


def test_handlers_with_hand_built_call_frames(built, tmp_path):
    # No GPU is touched: every call ends in an FFI error with the core's message, or answers metadata.
    core, xla, include = built
    src = tmp_path / "frames.c"
    src.write_text(_FRAME_TEST)
    exe = tmp_path / "frames"
    subprocess.run([*_cc().split(), "-std=c11", "-Wall", f"-I{include}", str(src), f"-L{xla.parent}",
                    "-l:" + xla.name, f"-Wl,-rpath,{xla.parent}", "-o", str(exe)], check=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"format": 2, "source_hash": cbuild.source_hash(),
                                                     "kernels": []}))
    env = dict(os.environ, MOE_RT_LIBCUDA=str(tmp_path / "no_libcuda.so"))
    r = subprocess.run([str(exe), str(empty), str(cache)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert lines["metadata"] == "ok"
    assert "traits=1 api=0." in r.stdout  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE
    assert lines["no kernel cache set"].startswith("code=5 ") and "no kernel cache folder" in lines["no kernel cache set"]
    assert lines["empty kernel cache"].startswith("code=5 ")  # NOT_FOUND, the core's message
    assert f"cannot read {empty}/manifest.json" in lines["empty kernel cache"]
    assert "MOE_RT_ERROR_KERNEL_CACHE" in lines["empty kernel cache"]
    assert lines["no driver"].startswith("code=14 ")  # UNAVAILABLE
    assert "no CUDA driver: cannot load" in lines["no driver"] and "MOE_RT_ERROR_NO_DRIVER" in lines["no driver"]
    assert "moe_rt_xla_topk_with_score: attribute topk is missing" in lines["missing attribute"]
    assert lines["scores no driver"].startswith("code=14 ") and "MOE_RT_ERROR_NO_DRIVER" in lines["scores no driver"]
    assert "moe_rt_xla_aux_loss: attribute num_experts is missing" in lines["aux missing attribute"]
    assert "moe_rt_xla_sort_chunks: attribute backward is missing" in lines["sort missing attribute"]
    assert "moe_rt_xla_quantize_fp8: attribute block is missing" in lines["fp8 missing attribute"]
    assert lines["missing argument"].startswith("code=3 ")
    assert "execution stage 1" in lines["prepare stage"]
    assert "this library was built for major" in lines["other major version"]
    assert "moe_rt_xla_topk_with_score_qb: attribute qb_histogram_mode is missing" in lines["qb missing attribute"]
    # a result histogram in a buffer of its own is accepted (the handler copies the old one into it on the device)
    assert lines["qb not aliased"].startswith("code=14 ") and "MOE_RT_ERROR_NO_DRIVER" in lines["qb not aliased"]
    assert lines["qb no driver"].startswith("code=14 ") and "MOE_RT_ERROR_NO_DRIVER" in lines["qb no driver"]
    assert lines["qb bad shape"].startswith("code=3 ") and "expert_bias [7]" in lines["qb bad shape"]
    assert lines["qb bad histogram dtype"].startswith("code=3 ") and "qb_histogram" in lines["qb bad histogram dtype"]


_LL_FRAME_TEST = _FRAME_COMMON + r"""
#include "moe_rt/moe_rt.h"

XLA_FFI_Error* moe_rt_xla_ll_dispatch(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_ll_combine(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_ll_dispatch_bwd(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_ll_combine_bwd(XLA_FFI_CallFrame*);

/* sizes: R = 1, L = 3, Tmax = 7, K = 2, H = 6 (float32 group), T = 5 */
enum { L = 3, TM = 7, KK = 2, HH = 6, T = 5 };
static char mem[1 << 16];

static XLA_FFI_Buffer mk(XLA_FFI_DataType t, int64_t* dims, int rank) {
  XLA_FFI_Buffer b = {XLA_FFI_Buffer_STRUCT_SIZE, NULL, t, mem, rank, dims};
  return b;
}

int main(void) {
  XLA_FFI_Api api;
  XLA_FFI_CallFrame f;
  frame_init(&api, &f);

  /* a group on a planning context, with made-up addresses (the registry lists it all the same) */
  moe_rt_device_info dev = {132, 228 * 1024, 227 * 1024, 9, 0, 0};
  moe_rt_context* ctx = NULL;
  if (moe_rt_context_create_planning(&dev, &ctx)) { printf("planning context failed\n"); return 1; }
  moe_rt_ll_group_desc d;
  memset(&d, 0, sizeof d);
  d.num_ranks = 1; d.rank = 0; d.num_local_experts = L; d.max_tokens_per_rank = TM; d.topk = KK;
  d.dtype = MOE_RT_FLOAT32; d.hidden = HH; d.chunk = 1; d.num_buffers = 1; d.timeout_ns = 1000000000LL;
  const int64_t a = (int64_t)1 << 40;
  d.set[0].recv = (void*)(a + 0x100000);
  d.set[0].peer_recv = (const int64_t*)(a + 0x200000);
  d.set[0].peer_route = (const int64_t*)(a + 0x300000);
  d.set[0].peer_rw = (const int64_t*)(a + 0x400000);
  d.set[0].peer_back = (const int64_t*)(a + 0x500000);
  d.set[0].peer_bw = (const int64_t*)(a + 0x600000);
  d.peer_flags = (const int64_t*)(a + 0x700000); d.peer_barrier = (const int64_t*)(a + 0x800000);
  d.barrier_state = (uint32_t*)(a + 0x900000); d.timeout_word = (int32_t*)(a + 0xa00000);
  d.set_epoch = (uint32_t*)(a + 0xb00000);
  moe_rt_ll_group* g = NULL;
  if (moe_rt_ll_group_create(ctx, &d, &g)) { printf("group failed: %s\n", moe_rt_last_error()); return 1; }
  int64_t address = (int64_t)(uintptr_t)g, serial = moe_rt_ll_group_serial(g);
  metadata(moe_rt_xla_ll_dispatch, &f);

  /* dispatch: x [T, H] f32, idx [T, K] s32, w [T, K] f32 -> recv [L, Tmax, H], the six tables */
  int64_t xd[2] = {T, HH}, kd[2] = {T, KK}, sd[3] = {L, TM, HH}, rd[3] = {1, TM, KK}, ld[2] = {L, TM}, cd[1] = {L};
  XLA_FFI_Buffer da[3] = {mk(XLA_FFI_DataType_F32, xd, 2), mk(XLA_FFI_DataType_S32, kd, 2),
                          mk(XLA_FFI_DataType_F32, kd, 2)};
  XLA_FFI_Buffer dr[7] = {mk(XLA_FFI_DataType_F32, sd, 3), mk(XLA_FFI_DataType_S32, kd, 2),
                          mk(XLA_FFI_DataType_F32, kd, 2), mk(XLA_FFI_DataType_S32, rd, 3),
                          mk(XLA_FFI_DataType_S32, ld, 2), mk(XLA_FFI_DataType_F32, ld, 2),
                          mk(XLA_FFI_DataType_S32, cd, 1)};
  XLA_FFI_ArgType at[8];
  XLA_FFI_RetType rt[7];
  for (int i = 0; i < 8; ++i) at[i] = XLA_FFI_ArgType_BUFFER;
  for (int i = 0; i < 7; ++i) rt[i] = XLA_FFI_RetType_BUFFER;
  void* dargs[3] = {&da[0], &da[1], &da[2]};
  void* drets[7] = {&dr[0], &dr[1], &dr[2], &dr[3], &dr[4], &dr[5], &dr[6]};
  f.args.struct_size = XLA_FFI_Args_STRUCT_SIZE;
  f.args.size = 3; f.args.types = at; f.args.args = dargs;
  f.rets.struct_size = XLA_FFI_Rets_STRUCT_SIZE;
  f.rets.size = 7; f.rets.types = rt; f.rets.rets = drets;
  /* attributes (the handlers look them up by name): the group's, then dispatch's two */
  static const char* names[5] = {"device", "group", "group_serial", "zero_empty_slots", "fp8"};
  int32_t dev_attr = 0, zero = 1, fp8 = 0, one = 1, two = 2;
  int64_t bad_address = address + 4096;
  XLA_FFI_ByteSpan spans[5];
  XLA_FFI_ByteSpan* span_ptrs[5];
  XLA_FFI_Scalar sc[5] = {{XLA_FFI_DataType_S32, &dev_attr}, {XLA_FFI_DataType_S64, &address},
                          {XLA_FFI_DataType_S64, &serial}, {XLA_FFI_DataType_S32, &zero},
                          {XLA_FFI_DataType_S32, &fp8}};
  void* attrs[5];
  XLA_FFI_AttrType types[5];
  for (int i = 0; i < 5; ++i) {
    spans[i].ptr = names[i]; spans[i].len = strlen(names[i]); span_ptrs[i] = &spans[i];
    attrs[i] = &sc[i];
    types[i] = XLA_FFI_AttrType_SCALAR;
  }
  f.attrs.struct_size = XLA_FFI_Attrs_STRUCT_SIZE;
  f.attrs.size = 5; f.attrs.types = types; f.attrs.names = span_ptrs; f.attrs.attrs = attrs;

  /* every check passes: the handler reaches XLA's device context (no kernel cache folder is set here) */
  report("dispatch valid", moe_rt_xla_ll_dispatch(&f));
  WITH(f.attrs.size, 3, "dispatch missing attribute", moe_rt_xla_ll_dispatch(&f));
  WITH(f.attrs.size, 4, "dispatch missing fp8", moe_rt_xla_ll_dispatch(&f));
  WITH(sc[4].value, &one, "dispatch fp8 valid", moe_rt_xla_ll_dispatch(&f));
  WITH(sc[4].value, &two, "dispatch bad fp8", moe_rt_xla_ll_dispatch(&f));
  WITH(sc[1].value, &bad_address, "dispatch bad address", moe_rt_xla_ll_dispatch(&f));
  int64_t other_serial = serial + 1;
  WITH(sc[2].value, &other_serial, "dispatch bad serial", moe_rt_xla_ll_dispatch(&f));
  WITH(g_ordinal, 1, "dispatch other device", moe_rt_xla_ll_dispatch(&f));
  WITH(xd[1], HH + 1, "dispatch bad x shape", moe_rt_xla_ll_dispatch(&f));
  WITH(da[0].dtype, XLA_FFI_DataType_BF16, "dispatch bad x dtype", moe_rt_xla_ll_dispatch(&f));
  WITH(da[1].dtype, XLA_FFI_DataType_F32, "dispatch bad idx dtype", moe_rt_xla_ll_dispatch(&f));
  WITH(sd[1], TM + 1, "dispatch bad recv shape", moe_rt_xla_ll_dispatch(&f));
  WITH(dr[4].dtype, XLA_FFI_DataType_F32, "dispatch bad slot_topk dtype", moe_rt_xla_ll_dispatch(&f));
  WITH(f.rets.size, 6, "dispatch missing result", moe_rt_xla_ll_dispatch(&f));

  /* combine: y [L, Tmax, H], the six tables -> out [T, H] */
  XLA_FFI_Buffer ca[7] = {mk(XLA_FFI_DataType_F32, sd, 3), dr[1], dr[2], dr[3], dr[4], dr[5], dr[6]};
  XLA_FFI_Buffer cr[1] = {mk(XLA_FFI_DataType_F32, xd, 2)};
  void* cargs[7] = {&ca[0], &ca[1], &ca[2], &ca[3], &ca[4], &ca[5], &ca[6]};
  void* crets[1] = {&cr[0]};
  f.args.size = 7; f.args.args = cargs;
  f.rets.size = 1; f.rets.rets = crets;
  f.attrs.size = 3; /* no zero_empty_slots */
  report("combine valid", moe_rt_xla_ll_combine(&f));
  WITH(rd[2], KK + 1, "combine bad route shape", moe_rt_xla_ll_combine(&f));
  WITH(cr[0].dtype, XLA_FFI_DataType_F16, "combine bad out dtype", moe_rt_xla_ll_combine(&f));

  /* dispatch_bwd: g [L, Tmax, H], g_slot_w [L, Tmax] f32, the six tables -> gx [T, H], gw [T, K] f32 */
  XLA_FFI_Buffer ba[8] = {mk(XLA_FFI_DataType_F32, sd, 3), mk(XLA_FFI_DataType_F32, ld, 2), dr[1], dr[2], dr[3],
                          dr[4], dr[5], dr[6]};
  XLA_FFI_Buffer br[2] = {mk(XLA_FFI_DataType_F32, xd, 2), mk(XLA_FFI_DataType_F32, kd, 2)};
  void* bargs[8] = {&ba[0], &ba[1], &ba[2], &ba[3], &ba[4], &ba[5], &ba[6], &ba[7]};
  void* brets[2] = {&br[0], &br[1]};
  f.args.size = 8; f.args.args = bargs;
  f.rets.size = 2; f.rets.rets = brets;
  report("dispatch_bwd valid", moe_rt_xla_ll_dispatch_bwd(&f));
  WITH(ba[1].dtype, XLA_FFI_DataType_BF16, "dispatch_bwd bad grad_slot_weights dtype",
       moe_rt_xla_ll_dispatch_bwd(&f));

  /* combine_bwd: g [T, H], y [L, Tmax, H], the six tables -> gy [L, Tmax, H], gw [T, K] f32, dots [L*Tmax] */
  int64_t nd[1] = {L * TM};
  XLA_FFI_Buffer ea[8] = {mk(XLA_FFI_DataType_F32, xd, 2), mk(XLA_FFI_DataType_F32, sd, 3), dr[1], dr[2], dr[3],
                          dr[4], dr[5], dr[6]};
  XLA_FFI_Buffer er[3] = {mk(XLA_FFI_DataType_F32, sd, 3), mk(XLA_FFI_DataType_F32, kd, 2),
                          mk(XLA_FFI_DataType_F32, nd, 1)};
  void* eargs[8] = {&ea[0], &ea[1], &ea[2], &ea[3], &ea[4], &ea[5], &ea[6], &ea[7]};
  void* erets[3] = {&er[0], &er[1], &er[2]};
  f.args.args = eargs;
  f.rets.size = 3; f.rets.rets = erets;
  report("combine_bwd valid", moe_rt_xla_ll_combine_bwd(&f));
  WITH(nd[0], L * TM - 1, "combine_bwd bad dots", moe_rt_xla_ll_combine_bwd(&f));

  /* the group destroyed: every handler refuses it, naming it */
  moe_rt_ll_group_destroy(g);
  report("combine_bwd after destroy", moe_rt_xla_ll_combine_bwd(&f));
  moe_rt_context_destroy(ctx);
  return 0;
}
"""


def _run_group_frames(built, tmp_path, name, source):
    """Compile and run a frame program over the EP handlers (linked to the built libraries, no libcuda):
    ``(the completed process, {case: its report})``."""
    core, xla, include = built
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    exe = tmp_path / name
    subprocess.run([*_cc().split(), "-std=gnu11", "-Wall", f"-I{include}", f"-I{ROOT / 'include'}", str(src),
                    f"-L{xla.parent}", "-l:" + xla.name, "-l:" + core.name, f"-Wl,-rpath,{xla.parent}", "-o",
                    str(exe)], check=True)
    env = dict(os.environ, MOE_RT_LIBCUDA=str(tmp_path / "no_libcuda.so"))
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r, dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)


def test_ll_handlers_with_hand_built_call_frames(built, tmp_path):
    """The low-latency handlers over a core group on a planning context (the registry lists it as any group):
    every check passes and the call reaches XLA's device context (no kernel cache set: an FFI error, no crash);
    a group the registry does not list (an address or serial of no live group, or the group destroyed), a
    missing attribute, another device, and wrong shapes or dtypes fail with INVALID_ARGUMENT and a message."""
    r, lines = _run_group_frames(built, tmp_path, "ll_frames", _LL_FRAME_TEST)
    # not command-buffer compatible: a replay would skip the registry check (csrc/xla_ffi.c ll_call)
    assert lines["metadata"] == "ok" and "traits=0 api=0." in r.stdout
    for op in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"):
        got = lines[f"{op} valid"]
        assert got.startswith("code=5 ") and "no kernel cache folder" in got, (op, got)
    assert "moe_rt_xla_ll_dispatch: attribute zero_empty_slots is missing" in lines["dispatch missing attribute"]
    assert "moe_rt_xla_ll_dispatch: attribute fp8 is missing" in lines["dispatch missing fp8"]
    got = lines["dispatch fp8 valid"]  # fp8 = 1 passes the handler's checks too
    assert got.startswith("code=5 ") and "no kernel cache folder" in got, got
    assert lines["dispatch bad fp8"].startswith("code=3 ") and "attribute fp8: expected 0 or 1, got 2" in lines[
        "dispatch bad fp8"]
    for case in ("dispatch bad address", "dispatch bad serial", "combine_bwd after destroy"):
        got = lines[case]
        assert got.startswith("code=3 ") and "no live low-latency group at address 0x" in got, (case, got)
        assert "closed" in got and "MOE_RT_ERROR_INVALID_ARGUMENT" in got
    assert lines["combine_bwd after destroy"].startswith("code=3 msg=moe_rt_xla_ll_combine_bwd: ")
    assert "lives on cuda:0, but XLA runs this call on cuda:1" in lines["dispatch other device"]
    expect = {"dispatch bad x shape": "x: expected shape [5, 6] of dtype code 0, got [5, 7]",
              "dispatch bad x dtype": "x: expected shape [5, 6] of dtype code 0, got [5, 6] of dtype code 2",
              "dispatch bad idx dtype": "topk_idx: expected int32 or int64, got dtype code 0",
              "dispatch bad recv shape": "recv_x: expected shape [3, 7, 6] of dtype code 0, got [3, 8, 6]",
              "dispatch bad slot_topk dtype": "slot_topk: expected shape [3, 7] of dtype code 3, got [3, 7] of dtype "
                                              "code 0",
              "dispatch missing result": "expected 3 arguments and 7 results, got 3 and 6",
              "combine bad route shape": "route: expected shape [1, 7, 2] of dtype code 3, got [1, 7, 3]",
              "combine bad out dtype": "out: expected shape [5, 6] of dtype code 0",
              "dispatch_bwd bad grad_slot_weights dtype": "grad_slot_weights: expected shape [3, 7] of dtype code 0",
              "combine_bwd bad dots": "dots: expected shape [21] of dtype code 0, got [20]"}
    for case, msg in expect.items():
        assert lines[case].startswith("code=3 ") and msg in lines[case], (case, lines[case])


_EP_FRAME_TEST = _FRAME_COMMON + r"""
#include "moe_rt/moe_rt.h"

XLA_FFI_Error* moe_rt_xla_ep_prepare(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_ep_dispatch(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_ep_combine(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_ep_dispatch_bwd(XLA_FFI_CallFrame*);
XLA_FFI_Error* moe_rt_xla_ep_combine_bwd(XLA_FFI_CallFrame*);

/* sizes: R = 1, L = 3, Tmax = P = 7, K = 2, H = 6 (float32 rows), T = 5; capacity 14: N = 14 rows */
enum { L = 3, TM = 7, KK = 2, HH = 6, T = 5, NN = 14, NA = 16 };
static char mem[1 << 16] __attribute__((aligned(256)));

static XLA_FFI_Buffer mk(XLA_FFI_DataType t, int64_t* dims, int rank) {
  XLA_FFI_Buffer b = {XLA_FFI_Buffer_STRUCT_SIZE, NULL, t, mem, rank, dims};
  return b;
}

static const char* names[NA] = {"align_size", "device", "group", "group_serial", "max_tokens_per_rank",
                                "num_local_experts", "num_rows", "num_tokens", "pair_capacity", "recv_rows", "topk",
                                "has_weights", "zero_empty_slots", "rank", "num_experts", "capacity"};
static XLA_FFI_ByteSpan spans[NA + 6];
static XLA_FFI_ByteSpan* span_ptrs[NA + 6];
static XLA_FFI_Scalar sc[NA + 6];
static void* attrs[NA + 6];
static XLA_FFI_AttrType types[NA + 6];

static void set_attr(int i, const char* name, XLA_FFI_DataType t, void* v) {
  spans[i].ptr = name; spans[i].len = strlen(name); span_ptrs[i] = &spans[i];
  sc[i].dtype = t; sc[i].value = v; attrs[i] = &sc[i]; types[i] = XLA_FFI_AttrType_SCALAR;
}

static void call_with(XLA_FFI_CallFrame* f, int nargs, void** args, int nrets, void** rets, int nattrs) {
  f->args.size = nargs; f->args.args = args;
  f->rets.size = nrets; f->rets.rets = rets;
  f->attrs.size = nattrs;
}

int main(void) {
  XLA_FFI_Api api;
  XLA_FFI_CallFrame f;
  frame_init(&api, &f);
  moe_rt_device_info dev = {132, 228 * 1024, 227 * 1024, 9, 0, 64};
  moe_rt_context* ctx = NULL;
  if (moe_rt_context_create_planning(&dev, &ctx)) { printf("planning context failed\n"); return 1; }
  const int64_t a = (int64_t)1 << 40;
  moe_rt_ep_direct_group_desc d;
  memset(&d, 0, sizeof d);
  d.num_ranks = 1; d.rank = 0; d.node_lo = 0; d.node_hi = 1; d.pair_rows = TM; d.timeout_ns = 1000000000LL;
  d.peer_barrier = (const int64_t*)(a + 0x100000); d.peer_flags = (const int64_t*)(a + 0x200000);
  d.barrier_state = (uint32_t*)(a + 0x300000); d.timeout_word = (int32_t*)(a + 0x400000);
  moe_rt_ep_direct_group* g = NULL;
  if (moe_rt_ep_direct_group_create(ctx, &d, &g)) { printf("group failed: %s\n", moe_rt_last_error()); return 1; }
  moe_rt_ep_direct_stage st = {HH * 4, KK, 16, (void*)(a + 0x500000), (const int64_t*)(a + 0x600000),
                               (float*)(a + 0x700000), (const int64_t*)(a + 0x800000)};
  if (moe_rt_ep_direct_add_stage(g, &st)) { printf("stage failed: %s\n", moe_rt_last_error()); return 1; }
  int64_t address = (int64_t)(uintptr_t)g, serial = moe_rt_ep_direct_group_serial(g);
  moe_rt_ep_handle_desc hd;
  memset(&hd, 0, sizeof hd);
  hd.num_ranks = 1; hd.num_local_experts = L; hd.max_tokens_per_rank = TM; hd.topk = KK; hd.pair_capacity = TM;
  hd.recv_rows = TM; hd.num_rows = NN;
  int64_t total = (int64_t)moe_rt_ep_handle_layout(&hd);
  if (total > (int64_t)sizeof mem) { printf("handle too large\n"); return 1; }
  printf("total: %lld\n", (long long)total);
  metadata(moe_rt_xla_ep_dispatch, &f);

  int32_t one = 1, zero = 0, dev_attr = 0, tm = TM, l = L, kk = KK, p = TM, has_w = 0, zero_slots = 1, E = L;
  int64_t n_rows = NN, n_tok = T, rows = TM, cap = NN, bad_address = address + 4096, other_serial = serial + 1;
  set_attr(0, names[0], XLA_FFI_DataType_S32, &one);
  set_attr(1, names[1], XLA_FFI_DataType_S32, &dev_attr);
  set_attr(2, names[2], XLA_FFI_DataType_S64, &address);
  set_attr(3, names[3], XLA_FFI_DataType_S64, &serial);
  set_attr(4, names[4], XLA_FFI_DataType_S32, &tm);
  set_attr(5, names[5], XLA_FFI_DataType_S32, &l);
  set_attr(6, names[6], XLA_FFI_DataType_S64, &n_rows);
  set_attr(7, names[7], XLA_FFI_DataType_S64, &n_tok);
  set_attr(8, names[8], XLA_FFI_DataType_S32, &p);
  set_attr(9, names[9], XLA_FFI_DataType_S64, &rows);
  set_attr(10, names[10], XLA_FFI_DataType_S32, &kk);
  set_attr(11, names[11], XLA_FFI_DataType_S32, &has_w);
  set_attr(12, names[12], XLA_FFI_DataType_S32, &zero_slots);
  set_attr(13, names[13], XLA_FFI_DataType_S32, &zero);
  set_attr(14, names[14], XLA_FFI_DataType_S32, &E);
  set_attr(15, names[15], XLA_FFI_DataType_S64, &cap);
  /* prepare's buffer addresses */
  static const char* pnames[6] = {"grid_sync", "error_word", "state", "peer_box", "inbox", "timeout_ns"};
  int64_t pv[6] = {a + 0x900000, a + 0xa00000, a + 0xb00000, a + 0xc00000, a + 0xd00000, 1000000000LL};
  for (int i = 0; i < 6; ++i) set_attr(NA + i, pnames[i], XLA_FFI_DataType_S64, &pv[i]);
  f.attrs.struct_size = XLA_FFI_Attrs_STRUCT_SIZE;
  f.attrs.types = types; f.attrs.names = span_ptrs; f.attrs.attrs = attrs;
  XLA_FFI_ArgType at[8];
  XLA_FFI_RetType rt[8];
  for (int i = 0; i < 8; ++i) { at[i] = XLA_FFI_ArgType_BUFFER; rt[i] = XLA_FFI_RetType_BUFFER; }
  f.args.struct_size = XLA_FFI_Args_STRUCT_SIZE; f.args.types = at;
  f.rets.struct_size = XLA_FFI_Rets_STRUCT_SIZE; f.rets.types = rt;

  int64_t hdims[1] = {total}, zd[1] = {0}, xd[2] = {T, HH}, kd[2] = {T, KK}, nd[2] = {NN, HH}, wd[1] = {NN},
          sd[1] = {TM * KK}, ld[1] = {L}, wk[1] = {4096}, slot[2] = {TM, KK};
  XLA_FFI_Buffer hb = mk(XLA_FFI_DataType_U8, hdims, 1), x = mk(XLA_FFI_DataType_F32, xd, 2),
                 w = mk(XLA_FFI_DataType_F32, kd, 2), rx = mk(XLA_FFI_DataType_F32, nd, 2),
                 rw0 = mk(XLA_FFI_DataType_F32, zd, 1), h0 = mk(XLA_FFI_DataType_U8, zd, 1),
                 rw = mk(XLA_FFI_DataType_F32, wd, 1), sg = mk(XLA_FFI_DataType_F32, sd, 1),
                 idx = mk(XLA_FFI_DataType_S32, kd, 2), tpe = mk(XLA_FFI_DataType_S32, ld, 1),
                 work = mk(XLA_FFI_DataType_S32, wk, 1), sw = mk(XLA_FFI_DataType_F32, slot, 2);

  /* dispatch without weights: handle, x -> recv_x [N, H], recv_w [0], the handle's copy [0] */
  void* da[2] = {&hb, &x};
  void* dr[3] = {&rx, &rw0, &h0};
  call_with(&f, 2, da, 3, dr, 13);
  report("dispatch valid", moe_rt_xla_ep_dispatch(&f));
  WITH(f.attrs.size, 12, "dispatch missing attribute", moe_rt_xla_ep_dispatch(&f));
  WITH(sc[2].value, &bad_address, "dispatch bad address", moe_rt_xla_ep_dispatch(&f));
  WITH(sc[3].value, &other_serial, "dispatch bad serial", moe_rt_xla_ep_dispatch(&f));
  WITH(g_ordinal, 1, "dispatch other device", moe_rt_xla_ep_dispatch(&f));
  WITH(hdims[0], total + 1, "dispatch bad handle", moe_rt_xla_ep_dispatch(&f));
  WITH(x.dtype, XLA_FFI_DataType_S32, "dispatch bad x dtype", moe_rt_xla_ep_dispatch(&f));
  WITH(nd[0], NN + 1, "dispatch bad recv_x", moe_rt_xla_ep_dispatch(&f));
  WITH(p, TM + 1, "dispatch bad pair_capacity", moe_rt_xla_ep_dispatch(&f));
  WITH(f.rets.size, 2, "dispatch missing result", moe_rt_xla_ep_dispatch(&f));

  /* with weights: the handle copied first (a device copy: refused on a planning context) */
  has_w = 1;
  void* dwa[3] = {&hb, &x, &w};
  XLA_FFI_Buffer hcopy = mk(XLA_FFI_DataType_U8, hdims, 1);
  void* dwr[3] = {&rx, &rw, &hcopy};
  call_with(&f, 3, dwa, 3, dwr, 13);
  report("dispatch weighted", moe_rt_xla_ep_dispatch(&f));
  WITH(w.dtype, XLA_FFI_DataType_BF16, "dispatch bad weights dtype", moe_rt_xla_ep_dispatch(&f));

  /* combine: handle, y [N, H], slot weights [rows, K] -> out [T, H] */
  XLA_FFI_Buffer out = mk(XLA_FFI_DataType_F32, xd, 2);
  void* ca[3] = {&hb, &rx, &sw};
  void* cr[1] = {&out};
  call_with(&f, 3, ca, 1, cr, 12);
  report("combine valid", moe_rt_xla_ep_combine(&f));
  WITH(slot[1], KK + 1, "combine bad slot weights", moe_rt_xla_ep_combine(&f));
  WITH(out.dtype, XLA_FFI_DataType_F16, "combine bad out dtype", moe_rt_xla_ep_combine(&f));

  /* dispatch_bwd: handle, g [N, H], g_w [N] -> gx [T, H], gw [T, K], slot_grads [rows*K] */
  XLA_FFI_Buffer gx = mk(XLA_FFI_DataType_F32, xd, 2), gw = mk(XLA_FFI_DataType_F32, kd, 2);
  void* ba[3] = {&hb, &rx, &rw};
  void* br[3] = {&gx, &gw, &sg};
  call_with(&f, 3, ba, 3, br, 12);
  report("dispatch_bwd valid", moe_rt_xla_ep_dispatch_bwd(&f));
  WITH(sd[0], TM * KK - 1, "dispatch_bwd bad slot_grads", moe_rt_xla_ep_dispatch_bwd(&f));

  /* combine_bwd unweighted: handle, g [T, H] -> gy [N, H]; weighted: + y, slot weights -> + grad_slot */
  has_w = 0;
  XLA_FFI_Buffer gy = mk(XLA_FFI_DataType_F32, nd, 2), gp = mk(XLA_FFI_DataType_F32, slot, 2);
  void* ea[4] = {&hb, &x, &rx, &sw};
  void* er[2] = {&gy, &gp};
  call_with(&f, 2, ea, 1, er, 12);
  report("combine_bwd valid", moe_rt_xla_ep_combine_bwd(&f));
  has_w = 1;
  call_with(&f, 4, ea, 2, er, 12);
  report("combine_bwd weighted", moe_rt_xla_ep_combine_bwd(&f));

  /* prepare: topk_idx [T, K] -> handle, tokens_per_expert [L], work */
  void* pa[1] = {&idx};
  void* pr[3] = {&hb, &tpe, &work};
  /* the common attributes, then rank, num_experts, capacity and prepare's buffers */
  for (int i = 0; i < 3; ++i) { span_ptrs[11 + i] = span_ptrs[13 + i]; attrs[11 + i] = attrs[13 + i]; }
  for (int i = 0; i < 6; ++i) { span_ptrs[14 + i] = span_ptrs[NA + i]; attrs[14 + i] = attrs[NA + i]; }
  call_with(&f, 1, pa, 3, pr, 20);
  report("prepare valid", moe_rt_xla_ep_prepare(&f));
  WITH(wk[0], 1, "prepare small work", moe_rt_xla_ep_prepare(&f));
  WITH(idx.dtype, XLA_FFI_DataType_F32, "prepare bad idx dtype", moe_rt_xla_ep_prepare(&f));

  moe_rt_ep_direct_group_destroy(g);
  report("prepare after destroy", moe_rt_xla_ep_prepare(&f));
  moe_rt_context_destroy(ctx);
  return 0;
}
"""


def test_ep_handlers_with_hand_built_call_frames(built, tmp_path):
    """The direct EP handlers over a core direct group on a planning context (listed in the core's registry as
    any group): every check passes and the core plans the launches (a planning context launches nothing;
    device copies and XLA's device context are refused there, with the core's message); a group the registry
    does not list (another address or serial, or destroyed), a missing attribute, attributes that do not fit
    the group, another device, and wrong shapes or dtypes fail with INVALID_ARGUMENT and a message."""
    r, lines = _run_group_frames(built, tmp_path, "ep_frames", _EP_FRAME_TEST)
    # not command-buffer compatible: a replay would skip the registry check (csrc/xla_ffi.c ep_call)
    assert lines["metadata"] == "ok" and "traits=0 api=0." in r.stdout
    for case in ("dispatch valid", "combine valid", "dispatch_bwd valid", "combine_bwd valid"):
        assert lines[case] == "ok", (case, lines[case])
    assert "moe_rt_copy_on_device" in lines["dispatch weighted"]  # reached the handle's copy
    assert "moe_rt_copy_on_device" in lines["prepare valid"]  # planned send side, then tokens_per_expert's copy
    assert "no kernel cache folder" in lines["combine_bwd weighted"]  # XLA's context: combine_backward
    for case in ("dispatch bad address", "dispatch bad serial", "prepare after destroy"):
        got = lines[case]
        assert got.startswith("code=3 ") and "no live direct EP group at address 0x" in got, (case, got)
        assert "closed" in got and "MOE_RT_ERROR_INVALID_ARGUMENT" in got
    assert lines["prepare after destroy"].startswith("code=3 msg=moe_rt_xla_ep_prepare: ")
    expect = {"dispatch missing attribute": "moe_rt_xla_ep_dispatch: attribute zero_empty_slots is missing",
              "dispatch other device": "the EP group lives on cuda:0, but XLA runs this call on cuda:1",
              "dispatch bad handle": "handle: expected shape [%s] of dtype code 6, got [%s]",
              "dispatch bad x dtype": "x: expected a float32, float16 or bfloat16 array [rows, H], got rank 2 of "
                                      "dtype code 3",
              "dispatch bad recv_x": "recv_x: expected shape [14, 6] of dtype code 0, got [15, 6]",
              "dispatch bad pair_capacity": "attributes pair_capacity=8, recv_rows=7, num_tokens=5 do not fit the "
                                            "group (1 ranks, pair capacity 7",
              "dispatch missing result": "expected 2 arguments and 3 results, got 2 and 2",
              "dispatch bad weights dtype": "topk_weights: expected shape [5, 2] of dtype code 0, got [5, 2] of "
                                            "dtype code 2",
              "combine bad slot weights": "slot_weights: expected shape [7, 2] of dtype code 0, got [7, 3]",
              "combine bad out dtype": "out: expected shape [5, 6] of dtype code 0, got [5, 6] of dtype code 1",
              "dispatch_bwd bad slot_grads": "slot_grads: expected shape [14] of dtype code 0, got [13]",
              "prepare small work": "work: expected int32 [>= ",
              "prepare bad idx dtype": "topk_idx: expected int32 or int64, got dtype code 0"}
    total = lines["total"]
    expect["dispatch bad handle"] = expect["dispatch bad handle"] % (total, int(total) + 1)
    for case, msg in expect.items():
        assert lines[case].startswith("code=3 ") and msg in lines[case], (case, lines[case])


def test_handlers_register_with_xla_for_cuda():
    lib = _xla.library()
    assert _xla.library() is lib  # once per process
    if not _xla.cuda_devices():
        # no CUDA backend: XLA keeps the registrations until the CUDA plugin loads
        from jaxlib import xla_client

        pending = {entry[0]: entry for entry in getattr(xla_client, "_custom_callback", {}).get("CUDA", [])}
        for op in _xla.HANDLERS:
            name, _, api_version, traits = pending[_xla.target(op)]
            assert api_version == 1 and int(traits) == (0 if op in _xla.NOT_CAPTURABLE else 1), op
        assert _xla.NOT_CAPTURABLE == {"ll_dispatch", "ll_combine", "ll_dispatch_bwd", "ll_combine_bwd", "ep_prepare",
                                       "ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd"}


def test_library_built_on_first_use_when_not_packaged(tmp_path, monkeypatch):
    _cc()
    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(_xla, "XLA_LIB", "libmoe_rt_xla_absent.so")
    path = _xla.library_path()
    assert path.parent == tmp_path / "xla" and path.is_file()
    import ctypes

    assert ctypes.CDLL(str(path)).moe_rt_xla_topk_with_score
    assert _xla.library_path() == path  # built once, then found


def test_prepare_compiles_lists_and_loads_the_kernels(tmp_path, monkeypatch):
    # A stand-in CUDA device (sm_90) on this machine: the op's kernels are compiled by NVRTC into the kernel
    # cache folder and listed in its manifest; loading them then needs the driver, and says so.
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        _jit.cuda_include_dir()
    except Exception as e:  # noqa: BLE001 - any reason NVRTC cannot run here
        pytest.skip(f"NVRTC or CUDA headers not installed ({e})")

    class Device:
        compute_capability = "9.0"
        local_hardware_id = 0

    monkeypatch.setenv("MOE_RT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("MOE_RT_LIBCUDA", str(tmp_path / "no_libcuda.so"))
    monkeypatch.setattr(_xla, "cuda_devices", lambda: [Device()])
    monkeypatch.setattr(_xla, "device_shape", lambda i: _xla.H100_SHAPE)  # (read through CuPy on a GPU)
    facts = dict(T=37, K=2, E=8, N=74, align_size=1, H=16, dtype=0, has_probs=False, probs_dtype=0)
    with pytest.raises(RuntimeError, match="no CUDA driver: cannot load"):
        _xla.prepare("dispatch", **facts)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["source_hash"] == _jit.source_hash()
    want = _xla.planned_kernels("dispatch", (9, 0), **facts) + [_xla.ERROR_WORD_KERNEL]  # moe_rt.check() reads it
    assert want and [(r["file"], r["name"]) for r in manifest["kernels"]] == want
    for row in manifest["kernels"]:
        assert row["arch"] == _jit.arch_for((9, 0)) and (tmp_path / row["image"]).is_file()
    _jit.add_to_manifest(str(tmp_path), [(f, n, row["arch"]) for f, n in want])  # merging adds nothing twice
    assert json.loads((tmp_path / "manifest.json").read_text())["kernels"] == manifest["kernels"]


# ---- lowering --------------------------------------------------------------------------------------------

T, E, K, H = 23, 8, 2, 16


def _layer(logits, x, bias):
    probs, _ = mj.topk_with_score(logits, K, score_function="sigmoid", num_groups=4, group_topk=2,
                                  scaling_factor=2.5, expert_bias=bias)
    w, idx = jax.lax.top_k(probs.astype(jnp.float32), K)
    plan = mj.make_plan(idx.astype(jnp.int32), E, align_size=8)
    xp, pp = mj.dispatch(x, plan, w)
    y = mj.combine(xp * 2, plan, w)
    return (y.astype(jnp.float32) ** 2).sum() + (pp ** 2).sum()


def _inputs():
    return (jnp.zeros((T, E), jnp.float32), jnp.zeros((T, H), jnp.bfloat16), jnp.zeros((E,), jnp.float32))


def _custom_calls(text):
    """{target: [(attribute dict, operand count, result types)]} of the lowered module's custom calls."""
    calls: dict = {}
    for m in re.finditer(r"stablehlo\.custom_call @(\w+)\(([^)]*)\) \{[^\n]*?mhlo\.backend_config = \{([^}]*)\}"
                         r"[^\n]*-> \(?([^\n]*)", text):
        attrs = dict(kv.strip().split(" = ", 1) for kv in m.group(3).split(","))
        calls.setdefault(m.group(1), []).append((attrs, len([a for a in m.group(2).split(",") if a.strip()]),
                                                 m.group(4)))
    return calls


def test_lowering_for_cuda_gives_custom_calls_with_the_static_facts():
    f = jax.jit(jax.value_and_grad(_layer, argnums=(0, 1)))
    text = f.trace(*_inputs()).lower(lowering_platforms=("cuda",)).as_text()
    calls = _custom_calls(text)
    assert "xla_buffer_python_gpu_callback" not in text
    for op in ("topk_with_score", "topk_with_score_backward", "make_plan", "dispatch", "dispatch_backward",
               "combine", "combine_backward"):
        assert _xla.target(op) in calls, (op, sorted(calls))
    (topk, n_in, _), = calls["moe_rt_topk_with_score"]
    assert topk == {"group_topk": "2 : i32", "has_bias": "1 : i32", "num_groups": "4 : i32",
                    "scaling_factor": "2.500000e+00 : f32", "score_function": "0 : i32", "topk": "2 : i32",
                    "use_pre_softmax": "0 : i32"}
    assert n_in == 2  # logits, expert_bias
    (bwd, n_in, _), = calls["moe_rt_topk_with_score_backward"]
    assert bwd == {"scaling_factor": "2.500000e+00 : f32", "score_function": "0 : i32", "topk": "2 : i32",
                   "use_pre_softmax": "0 : i32"} and n_in == 3
    (plan, n_in, results), = calls["moe_rt_make_plan"]
    assert plan == {"align_size": "8 : i32", "num_experts": "8 : i32", "num_out_tokens": "-1 : i64"} and n_in == 1
    ws = _xla.make_plan_workspace_bytes(T, K, E)
    assert f"tensor<{ws}xui8>" in results  # the workspace comes from XLA, as a result
    (disp, n_in, results), = calls["moe_rt_dispatch"]
    assert disp == {"align_size": "8 : i32"} and n_in == 7  # the plan's five arrays, x, probs
    N = (T * K + E * 7) // 8 * 8
    assert f"tensor<{N}x{H}xbf16>" in results and f"tensor<{N}xf32>" in results
    assert calls["moe_rt_combine_backward"][0][1] == 8  # the plan, grad_y, y_permuted, probs
    assert calls["moe_rt_dispatch_backward"][0][1] == 7


def test_lowering_for_cpu_runs_the_reference():
    text = jax.jit(_layer).trace(*_inputs()).lower(lowering_platforms=("cpu",)).as_text()
    assert "@moe_rt_" not in text and "xla_buffer_python" in text


def test_lowering_without_probs_and_under_vmap():
    def f(idx, x):
        plan = mj.make_plan(idx, E, num_out_tokens=T)
        xp, pp = mj.dispatch(x, plan)
        assert pp is None
        return mj.combine(xp, plan)

    idx = jnp.zeros((3, T, K), jnp.int32)
    x = jnp.zeros((3, T, H), jnp.float32)
    text = jax.jit(jax.vmap(f)).trace(idx, x).lower(lowering_platforms=("cuda",)).as_text()
    calls = _custom_calls(text)
    assert calls["moe_rt_make_plan"][0][0]["num_out_tokens"] == f"{T} : i64"
    assert calls["moe_rt_dispatch"][0][1] == 6 and calls["moe_rt_combine"][0][1] == 6
    assert "stablehlo.while" in text  # once per batch element, in order


def _router_layer(logits, tpe, total):
    """Every router op moved to FFI in one differentiated step: the top-k in its other forms, the aux scores
    (both map forms) and the aux loss (a static and a device total)."""
    p_bits, _ = mj.topk_with_score(logits, K, score_function="sigmoid", routing_map_format="bitmap_u8")
    p_idx, _ = mj.topk_with_score(logits, K, topk_indices_dtype="int16", scaling_factor=1.5)
    scores, _ = mj.scores_for_aux_loss(logits, K, "softmax")
    s_bits, _ = mj.scores_for_aux_loss(logits, K, "sigmoid", routing_map_format="bitmap_u8")
    loss = mj.aux_loss(scores, tpe, T, E, K, 0.01) + mj.aux_loss(s_bits, tpe.astype(jnp.float16), total, E, K, 0.5)
    return loss + (p_bits.astype(jnp.float32) ** 2).sum() + (p_idx.astype(jnp.float32) ** 2).sum()


def _router_inputs():
    return jnp.zeros((T, E), jnp.bfloat16), jnp.zeros((E,), jnp.int32), jnp.asarray(T, jnp.int32)


def test_router_ops_lower_to_custom_calls_in_every_form():
    text = jax.jit(jax.value_and_grad(_router_layer)).trace(*_router_inputs()).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla_buffer_python_gpu_callback" not in text
    calls = _custom_calls(text)
    fwd = calls["moe_rt_topk_with_score"]
    assert len(fwd) == 2
    assert any("tensor<23x1xui8>" in r for _, _, r in fwd) and any("tensor<23x2xi16>" in r for _, _, r in fwd)
    assert {a["scaling_factor"] for a, _, _ in fwd} == {"1.000000e+00 : f32", "1.500000e+00 : f32"}
    assert len(calls["moe_rt_topk_with_score_backward"]) == 2  # from the bitmap and from the int16 indices
    sc = calls["moe_rt_scores_for_aux_loss"]
    assert sorted(a["score_function"] for a, _, _ in sc) == ["0 : i32", "1 : i32"]
    assert all(a["topk"] == "2 : i32" for a, _, _ in sc) and any("tensor<23x1xui8>" in r for _, _, r in sc)
    assert len(calls["moe_rt_scores_for_aux_loss_backward"]) == 2
    aux = calls["moe_rt_aux_loss"]
    assert sorted((a["total_num_tokens"], n) for a, n, _ in aux) == [("0 : i64", 3), (f"{T} : i64", 2)]
    ws = _xla.aux_loss_workspace_bytes(T)
    assert all(f"tensor<{ws}xui8>" in r for _, _, r in aux)  # the workspace comes from XLA, as a result
    assert {a["coeff"] for a, _, _ in aux} == {"0.00999999977 : f32", "5.000000e-01 : f32"}  # fp32 0.01
    assert sorted(n for _, n, _ in calls["moe_rt_aux_loss_backward"]) == [2, 3]
    # the float16 counts reach the kernel as float32 (it reads int32, int64 and float32 as they are)
    assert "tensor<8xf16>) -> tensor<8xf32>" in text


def test_aux_ops_prepare_the_device_totals_build(monkeypatch):
    """At trace time each aux-loss handler is prepared with whether its total is a device scalar (the backward's
    kernel differs: aux_loss_bwd<T, true>), so a fresh kernel cache gets the build that runs."""
    seen = []
    monkeypatch.setattr(_xla, "prepare", lambda op, **facts: seen.append((op, facts.get("dev_total"))))
    jax.jit(jax.value_and_grad(_router_layer)).trace(*_router_inputs()).lower(lowering_platforms=("cuda",))
    aux = sorted(x for x in seen if x[0] in ("aux_loss", "aux_loss_backward"))
    assert aux == [("aux_loss", False), ("aux_loss", True), ("aux_loss_backward", False),
                   ("aux_loss_backward", True)]
    for op, dev in aux:  # and what is planned for it
        names = _xla.planned_kernels(op, (9, 0), dtype=0, R=T, C=E, tpe_dtype=3, num_experts=E, topk=K, coeff=0.1,
                                     dev_total=dev)
        if op == "aux_loss_backward":
            assert names == [("router.cu", f"aux_loss_bwd<float, {'true' if dev else 'false'}>")]


def test_router_ops_on_cpu_run_the_reference(rng):
    logits = jnp.asarray(rng.standard_normal((T, E)), jnp.bfloat16)
    tpe = jnp.asarray(rng.integers(0, 9, E), jnp.int32)
    text = jax.jit(jax.grad(_router_layer)).trace(logits, tpe, jnp.asarray(T, jnp.int32)).lower(
        lowering_platforms=("cpu",)).as_text()
    assert "@moe_rt_" not in text and "xla_buffer_python" in text
    g = jax.jit(jax.grad(_router_layer))(logits, tpe, jnp.asarray(T, jnp.int32))
    assert g.shape == (T, E) and np.isfinite(np.asarray(g, np.float32)).all()


@pytest.mark.parametrize("op,facts,extra", [
    ("topk_with_score", dict(dtype=2, T=37, E=64, topk=8, score_function=0, use_pre_softmax=0, num_groups=8,
                             group_topk=4, scaling_factor=2.5, has_bias=True, routing_dtype=6), []),
    ("topk_with_score", dict(dtype=0, T=37, E=7, topk=3, score_function=1, use_pre_softmax=1, num_groups=0,
                             group_topk=0, scaling_factor=1.0, has_bias=False, routing_dtype=10), []),
    ("topk_with_score_backward", dict(dtype=2, T=37, E=64, topk=8, score_function=1, use_pre_softmax=0,
                                      scaling_factor=1.0, routing_dtype=6), []),
    ("topk_with_score_backward", dict(dtype=0, T=37, E=64, topk=8, score_function=1, use_pre_softmax=0,
                                      scaling_factor=1.0, routing_dtype=4), [("errors.cu", "error_word_clear")]),
    ("scores_for_aux_loss", dict(dtype=1, T=5, E=100, topk=6, score_function=2, routing_dtype=6), []),
    ("scores_for_aux_loss_backward", dict(dtype=2, T=5, E=100, topk=6, score_function=0), []),
    ("aux_loss", dict(dtype=2, R=4096, C=256, tpe_dtype=3, num_experts=64, topk=8, coeff=0.01), []),
    ("aux_loss_backward", dict(dtype=0, R=37, C=7, tpe_dtype=0, num_experts=7, topk=2, coeff=1.0), []),
    ("aux_loss", dict(dtype=1, R=37, C=7, tpe_dtype=0, num_experts=7, topk=2, coeff=1.0, dev_total=True), []),
    ("aux_loss_backward", dict(dtype=1, R=37, C=7, tpe_dtype=0, num_experts=7, topk=2, coeff=1.0, dev_total=True),
     []),
])
def test_planned_kernels_of_the_router_ops(op, facts, extra):
    # what moe_rt.jax prepares at trace time: the C planner's launches (tests/test_c_abi.py compares those
    # with the Python side's), every one a kernel that warmup writes
    names = _xla.planned_kernels(op, (9, 0), **facts)
    assert names and names[-len(extra):] == extra if extra else names
    for file, name in names[:len(names) - len(extra)]:
        assert file == "router.cu" and name in _jit.REGISTRY["router.cu"], name
    if op == "topk_with_score" and facts["routing_dtype"] == 6:
        assert names[0][1].endswith(", true>")  # the bit-packed map's instantiation
    if op == "aux_loss_backward":  # the device total's build is the one a device total runs
        ctype = {0: "float", 1: "__half", 2: "__nv_bfloat16"}[facts["dtype"]]
        assert names == [("router.cu", f"aux_loss_bwd<{ctype}, {'true' if facts.get('dev_total') else 'false'}>")]


def test_planning_bad_facts_raises_with_the_core_message():
    with pytest.raises(RuntimeError, match="routing_dtype"):
        _xla.planned_kernels("scores_for_aux_loss", (9, 0), dtype=0, T=5, E=8, topk=2, score_function=1,
                             routing_dtype=3)
    with pytest.raises(RuntimeError, match="num_experts: must divide"):
        _xla.planned_kernels("aux_loss", (9, 0), dtype=0, R=5, C=8, tpe_dtype=3, num_experts=3, topk=2, coeff=0.1)


def test_fp8_casts_lower_to_custom_calls():
    def f(x):
        q, s = mj.quantize_fp8(x, 64)
        return mj.dequantize_fp8(q, s, jnp.float16, 64)

    text = jax.jit(f).trace(jnp.zeros((T, 130), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla_buffer_python_gpu_callback" not in text
    calls = _custom_calls(text)
    (attrs, n_in, results), = calls["moe_rt_quantize_fp8"]
    assert attrs == {"block": "64 : i32"} and n_in == 1
    assert f"tensor<{T}x130xf8E4M3FN>" in results and f"tensor<{T}x3xf32>" in results
    (attrs, n_in, results), = calls["moe_rt_dequantize_fp8"]
    assert attrs == {"block": "64 : i32"} and n_in == 2 and f"tensor<{T}x130xf16>" in results
    assert _xla.planned_kernels("quantize_fp8", (9, 0), dtype=2, T=T, H=128, block=64) == [
        ("fp8.cu", "quantize_fp8<__nv_bfloat16, false>")]
    assert _xla.planned_kernels("dequantize_fp8", (9, 0), dtype=0, T=T, H=256, block=128) == [
        ("fp8.cu", "dequantize_fp8<float, true>")]


def test_sort_chunks_lowers_to_custom_calls():
    def f(x, p, split, order):
        out, po = mj.sort_chunks(x, split, order, probs=p)
        return (out.astype(jnp.float32) ** 2).sum() + (po ** 2).sum() + mj.sort_chunks(x[:, :3], [T], [0]).sum()

    args = (jnp.zeros((T, H), jnp.bfloat16), jnp.zeros((T,), jnp.bfloat16), jnp.asarray([5, 7, 11], jnp.int32),
            jnp.asarray([2, 0, 1], jnp.int32))
    text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla_buffer_python_gpu_callback" not in text
    calls = _custom_calls(text)["moe_rt_sort_chunks"]
    assert sorted((a["backward"], n) for a, n, _ in calls) == [("0 : i32", 3), ("0 : i32", 4), ("1 : i32", 3),
                                                               ("1 : i32", 4)]
    ws = _xla.sort_chunks_workspace_bytes(3)
    assert any(f"tensor<{ws}xui8>" in r and f"tensor<{T}x{H}xbf16>" in r for _, _, r in calls)
    assert _xla.planned_kernels("sort_chunks", (9, 0), N=T, row_bytes=6, S=3, index_dtype=3, backward=1,
                                has_probs=True) == [("permutation.cu", "chunk_offsets<int>"),
                                                    ("permutation.cu", "chunk_sort_rows<unsigned short, true>")]
    with pytest.raises(TypeError, match="x: dtype must be one of"):
        jax.jit(lambda x: mj.sort_chunks(x, [T], [0])).trace(jnp.zeros((T, 2), jnp.bool_))


# Quantile Balancing: (T, E, K, B) of the lowering tests
QB_T, QB_E, QB_K, QB_B = 23, 8, 2, 16


def _qb_step(mode="fused_atomic", scaling_factor=2.5):
    def f(logits, bias, hist, bounds):
        probs, rmap, new = mj.topk_with_score_qb(logits, QB_K, expert_bias=bias, qb_histogram=hist,
                                                 qb_bin_bounds=bounds, qb_histogram_mode=mode,
                                                 scaling_factor=scaling_factor)
        return (probs.astype(jnp.float32) ** 2).sum(), (rmap, new)

    return jax.value_and_grad(f, has_aux=True)


def _qb_inputs(dtype=jnp.bfloat16, bias_dtype=jnp.float32):
    return (jnp.zeros((QB_T, QB_E), dtype), jnp.zeros((QB_E,), bias_dtype), jnp.zeros((QB_E, QB_B), jnp.int32),
            jnp.asarray([-1.0, 1.0], jnp.float32))


@pytest.mark.parametrize("mode,code", [("fused_atomic", 1), ("two_kernel", 0)])
def test_qb_forward_lowers_to_a_custom_call(mode, code):
    text = jax.jit(_qb_step(mode)).trace(*_qb_inputs(bias_dtype=jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla_buffer_python_gpu_callback" not in text
    calls = _custom_calls(text)
    (attrs, n_in, results), = calls["moe_rt_topk_with_score_qb"]
    assert attrs == {"qb_histogram_mode": f"{code} : i32", "scaling_factor": "2.500000e+00 : f32", "topk": "2 : i32"}
    assert n_in == 4  # logits, expert_bias, qb_histogram, qb_bin_bounds
    for r in (f"tensor<{QB_T}x{QB_E}xbf16>", f"tensor<{QB_T}x{QB_E}xi1>", f"tensor<{QB_T}x{QB_E}xf32>",
              f"tensor<{QB_E}x{QB_B}xi32>", f"tensor<{QB_T}xf32>"):  # probs, map, intermediate, histogram, cutoff
        assert r in results, (r, results)
    # the new histogram (result 3) is the old one's buffer (argument 2): the counts are added in place
    line = next(x for x in text.splitlines() if "@moe_rt_topk_with_score_qb" in x)
    assert re.search(r"output_operand_alias<output_tuple_indices = \[3\], operand_index = 2, "
                     r"operand_tuple_indices = \[\]>", line), line
    assert f"tensor<{QB_E}xbf16>) -> tensor<{QB_E}xf32>" in text  # the bias reaches the kernel as float32
    (bwd, n_in, _), = calls["moe_rt_topk_with_score_backward"]  # the backward: the sigmoid top-k's call
    assert bwd == {"scaling_factor": "2.500000e+00 : f32", "score_function": "0 : i32", "topk": "2 : i32",
                   "use_pre_softmax": "0 : i32"} and n_in == 3


def test_qb_forward_under_vmap_and_with_donation_lowers_to_custom_calls():
    step = _qb_step(scaling_factor=None)
    batched = tuple(jnp.stack([a] * 3) for a in _qb_inputs(jnp.float32))
    text = jax.jit(jax.vmap(step)).trace(*batched).lower(lowering_platforms=("cuda",)).as_text()
    calls = _custom_calls(text)
    assert "xla_buffer_python_gpu_callback" not in text and "stablehlo.while" in text  # once per element, in order
    assert calls["moe_rt_topk_with_score_qb"][0][0]["scaling_factor"] == "1.000000e+00 : f32"
    fwd = jax.jit(lambda l, b, h, d: mj.topk_with_score_qb(l, QB_K, expert_bias=b, qb_histogram=h, qb_bin_bounds=d),
                  donate_argnums=2)
    text = fwd.trace(*_qb_inputs()).lower(lowering_platforms=("cuda",)).as_text()
    assert "@moe_rt_topk_with_score_qb" in text and "tf.aliasing_output" in text  # the donated histogram


def test_qb_forward_lowering_for_cpu_runs_the_reference(rng):
    args = list(_qb_inputs(jnp.float32))
    args[0] = jnp.asarray(rng.standard_normal((QB_T, QB_E)), jnp.float32)
    args[2] = jnp.asarray(rng.integers(0, 50, (QB_E, QB_B)), jnp.int32)
    step = jax.jit(_qb_step("two_kernel", None))
    text = step.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert "@moe_rt_" not in text and "xla_buffer_python" in text
    with jax.default_device(jax.devices("cpu")[0]):
        (_, (rmap, new)), g = step(*args)
    import moe_rt

    hist = np.array(args[2])
    probs, want_map, _, _ = moe_rt.topk_with_score_qb(np.asarray(args[0]), QB_K, expert_bias=np.asarray(args[1]),
                                                      qb_histogram=hist, qb_bin_bounds=np.asarray(args[3]))
    np.testing.assert_array_equal(np.asarray(rmap), want_map)
    np.testing.assert_array_equal(np.asarray(new), hist)  # the old histogram plus this call's counts
    assert int(np.asarray(new).sum() - np.asarray(args[2]).sum()) == QB_T * QB_E
    np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.grad(
        lambda l: (mj.topk_with_score(l, QB_K, score_function="sigmoid", expert_bias=args[1])[0] ** 2).sum())(
        args[0])))


A100_SHAPE, SM89_SHAPE = (108, 164 * 1024, 163 * 1024), (142, 100 * 1024, 99 * 1024)


@pytest.mark.parametrize("shape,B,width", [(_xla.H100_SHAPE, 400, 4), (A100_SHAPE, 400, 1), (A100_SHAPE, 300, 4),
                                           (SM89_SHAPE, 250, 1), (SM89_SHAPE, 150, 4)])
def test_planned_qb_histogram_follows_the_devices_shared_memory(shape, B, width):
    """The QB histogram pass takes 128-expert strips only where 4 * 128 * B counters fit the device's opt-in
    shared memory: planned with the device's own shape, what prepare() readies is what the handler runs there."""
    names = _xla.planned_kernels("topk_with_score_qb", (8, 0), shape=shape, dtype=2, T=8192, E=64, topk=4,
                                 scaling_factor=1.0, num_bins=B, qb_histogram_mode=0)
    assert names[-1] == ("router.cu", f"qb_histogram_accumulate<{width}>")


def test_prepare_plans_per_device_shape_and_readies_the_error_word(monkeypatch):
    """prepare() plans each device with its own shape (devices of one architecture but other shared memory get
    their own kernels) and readies the error word's kernel with every op, so moe_rt.check() can read it."""
    devs = [types.SimpleNamespace(compute_capability="8.0", local_hardware_id=i) for i in range(3)]
    shapes = {0: _xla.H100_SHAPE, 1: A100_SHAPE, 2: A100_SHAPE}
    loaded, cached = [], []

    class Lib:
        def moe_rt_xla_set_kernel_cache(self, root):
            return 0

        def moe_rt_xla_load_kernel(self, dev, file, name):
            loaded.append((dev, file.decode(), name.decode()))
            return 0

    monkeypatch.setattr(_xla, "cuda_devices", lambda: devs)
    monkeypatch.setattr(_xla, "device_shape", lambda i: shapes[i])
    monkeypatch.setattr(_xla, "library", lambda: Lib())
    monkeypatch.setattr(_xla._jit, "cache_kernels", lambda root, names, arch, where="": cached.append(list(names)))
    monkeypatch.setattr(_xla, "_prepared", set())
    monkeypatch.setattr(_xla, "_devices", set())
    _xla.prepare("topk_with_score_qb", dtype=2, T=8192, E=64, topk=4, scaling_factor=1.0, num_bins=400,
                 qb_histogram_mode=0)
    assert len(cached) == 2  # one planning per (architecture, shape)
    by_dev = {d: [n for dd, _, n in loaded if dd == d] for d in range(3)}
    assert by_dev[0][-2:] == ["qb_histogram_accumulate<4>", "error_word_clear"]
    assert by_dev[1][-2:] == by_dev[2][-2:] == ["qb_histogram_accumulate<1>", "error_word_clear"]
    assert _xla._devices == {0, 1, 2}
    _xla.prepare("dispatch", dtype=2, T=5, K=2, E=4, N=10, H=64, align_size=1, has_probs=False)
    assert [n for d, _, n in loaded if d == 0][-1] == "error_word_clear"


@pytest.mark.parametrize("dtype,T,E,K,B,mode,want", [
    (0, 37, 256, 8, 64, 1, ["router_fwd_qb_reg<float, 8>"]),  # the block's shared histogram
    (2, 37, 256, 8, 64, 0, ["router_fwd_qb_reg<__nv_bfloat16, 8>", "qb_histogram_accumulate<4>"]),
    (2, 113, 2304, 36, 64, 1, ["router_fwd_qb<__nv_bfloat16, 32>"]),  # global atomics (T E <= 2^18)
    (0, 517, 2304, 36, 64, 1, ["router_fwd_qb<float, 32, false>", "qb_histogram_accumulate<4>"]),  # then the second kernel
    (1, 5, 61, 5, 7, 1, ["router_fwd_qb<__half, 32>"]),
    (0, 0, 256, 8, 64, 0, []),  # no tokens: nothing launched
])
def test_planned_kernels_of_the_qb_forward(dtype, T, E, K, B, mode, want):
    names = _xla.planned_kernels("topk_with_score_qb", (9, 0), dtype=dtype, T=T, E=E, topk=K, num_bins=B,
                                 qb_histogram_mode=mode, scaling_factor=1.0)
    assert names == [("router.cu", n) for n in want]
    assert all(n in _jit.REGISTRY["router.cu"] for n in want)
    with pytest.raises(RuntimeError, match="topk: Quantile Balancing selects topk \\+ 1" if E <= 64 else "topk"):
        _xla.planned_kernels("topk_with_score_qb", (9, 0), dtype=dtype, T=T, E=E, topk=E, num_bins=B,
                             qb_histogram_mode=mode, scaling_factor=1.0)
    with pytest.raises(RuntimeError, match="num_bins"):
        _xla.planned_kernels("topk_with_score_qb", (9, 0), dtype=dtype, T=T, E=E, topk=K, num_bins=0,
                             qb_histogram_mode=mode, scaling_factor=1.0)


def test_qb_bad_input_raises_when_traced_as_before():
    lg, bias, hist, bounds = _qb_inputs()

    def trace(topk=QB_K, **kw):
        a = dict(expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds)
        a.update(kw)
        return jax.jit(lambda l: mj.topk_with_score_qb(l, topk, **a)).trace(lg)

    trace()
    with pytest.raises(ValueError, match="topk: Quantile Balancing selects topk \\+ 1"):
        trace(topk=QB_E)
    with pytest.raises(TypeError, match="expert_bias"):
        trace(expert_bias=None)
    with pytest.raises(ValueError, match="expert_bias"):
        trace(expert_bias=bias[:-1])
    with pytest.raises(TypeError, match="qb_histogram"):
        trace(qb_histogram=hist.astype(jnp.float32))
    with pytest.raises(ValueError, match="qb_histogram"):
        trace(qb_histogram=hist[:-1])
    with pytest.raises(TypeError, match="qb_bin_bounds"):
        trace(qb_bin_bounds=bounds.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="qb_bin_bounds"):
        trace(qb_bin_bounds=jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="finite with lower < upper"):
        trace(qb_bin_bounds=jnp.asarray([1.0, -1.0], jnp.float32))  # concrete bounds: checked on the host
    with pytest.raises(ValueError, match="qb_histogram_mode"):
        trace(qb_histogram_mode="atomic")
    with pytest.raises(ValueError, match="scaling_factor"):
        trace(scaling_factor=float("nan"))
    # traced bounds are read on the device unchecked: tracing succeeds
    jax.jit(lambda l, d: mj.topk_with_score_qb(l, QB_K, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=d)).trace(
        lg, bounds)


def test_bad_input_raises_when_traced_as_before():
    lg, x, bias = _inputs()
    with pytest.raises(ValueError, match="topk"):
        jax.jit(lambda l: mj.topk_with_score(l, E + 1)).trace(lg)
    with pytest.raises(ValueError, match="expert_bias"):
        jax.jit(lambda l, b: mj.topk_with_score(l, K, score_function="softmax", expert_bias=b)).trace(lg, bias)
    with pytest.raises(ValueError, match="align_size"):
        jax.jit(lambda i: mj.make_plan(i, E, align_size=0)).trace(jnp.zeros((T, K), jnp.int32))
    with pytest.raises(TypeError, match="routing"):
        jax.jit(lambda i: mj.make_plan(i, E)).trace(jnp.zeros((T, K), jnp.float32))

    def bad_x(x):
        plan = mj.make_plan(jnp.zeros((T, K), jnp.int32), E)
        return mj.dispatch(x[:-1], plan)

    with pytest.raises(ValueError, match="x: expected 23 rows"):
        jax.jit(bad_x).trace(x)


def test_vmap_on_cpu_equals_a_loop(rng):
    idx = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(T)]) for _ in range(3)]).astype(np.int32)
    idx[:, ::5, -1] = -1
    x = rng.standard_normal((3, T, H)).astype(np.float32)
    w = rng.random((3, T, K)).astype(np.float32)

    def f(i, x, w):
        plan = mj.make_plan(i, E, align_size=4)
        xp, pp = mj.dispatch(x, plan, w)
        return mj.combine(xp * 3, plan, w), pp

    with jax.default_device(jax.devices("cpu")[0]):
        got = jax.jit(jax.vmap(f))(idx, x, w)
        for b in range(3):
            want = f(idx[b], x[b], w[b])
            for g, v in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g[b]), np.asarray(v))


# ---- on a GPU -----------------------------------------------------------------------------------------------

def _router_case(rng, T, E, dtype):
    # tie-free logits: a permutation of distinct values
    logits = jnp.asarray((rng.permutation(T * E).reshape(T, E) / (T * E) - 0.5) * 8, dtype)
    return logits, jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32)


def _bits(a):
    a = a.get() if type(a).__module__.startswith("cupy") else np.asarray(a)
    return a.dtype, a.shape, a.tobytes()


ROUTER_CASES = [  # the byte map (E = 64), then the other routing forms (odd E: bitmap padding bits)
    dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5, bias=True),
    dict(score_function="softmax", use_pre_softmax=True),
    dict(score_function="softmax"),
    dict(score_function="sqrtsoftplus", bias=True),
    dict(routing_map_format="bitmap_u8", score_function="sigmoid", num_groups=8, group_topk=4, bias=True),
    dict(routing_map_format="bitmap_u8", score_function="softmax", E=61),
    dict(topk_indices_dtype="int16", score_function="softmax", scaling_factor=1.5, E=61),
    dict(topk_indices_dtype="int32", score_function="softmax", use_pre_softmax=True),
    dict(topk_indices_dtype="int32", score_function="sqrtsoftplus", bias=True, E=100),
]


def _router_id(c):
    form = c.get("topk_indices_dtype") or c.get("routing_map_format", "bytemap")
    return f"{form}-{c['score_function']}{'-pre' if c.get('use_pre_softmax') else ''}-{c.get('E', 64)}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ROUTER_CASES, ids=_router_id)
def test_router_ffi_matches_reference_and_direct_path(dtype, case, rng):
    import moe_rt

    case = dict(case)
    T, K, E = 517, 8, case.pop("E", 64)
    bias_on = case.pop("bias", False)
    logits, bias = _router_case(rng, T, E, jnp.dtype(dtype))
    bias = bias if bias_on else None
    gy = jnp.asarray(rng.standard_normal((T, E)), jnp.dtype(dtype))

    def fwd(l, b):
        return mj.topk_with_score(l, K, expert_bias=b, **case)

    def loss(l, b):
        return (fwd(l, b)[0].astype(jnp.float32) * gy.astype(jnp.float32)).sum()

    probs, routing = jax.jit(fwd)(logits, bias)
    grad = jax.jit(jax.grad(loss))(logits, bias)
    assert _bits(jax.jit(jax.grad(jax.checkpoint(loss)))(logits, bias)) == _bits(grad)
    # the direct path (moe_rt's op on the same device arrays, kernels through CuPy): the same bits
    dp, dr, di = moe_rt.topk_with_score(logits, K, expert_bias=bias, **case)
    assert _bits(probs) == _bits(dp) and _bits(routing) == _bits(dr)
    kw = dict(score_function=case["score_function"], use_pre_softmax=case.get("use_pre_softmax", False),
              scaling_factor=case.get("scaling_factor"))
    if "topk_indices_dtype" in case:
        g_direct = moe_rt.topk_with_score_backward(gy, None, di, K, topk_indices=dr, **kw)
    else:
        g_direct = moe_rt.topk_with_score_backward(gy, dr, di, K, routing_map_format=case.get(
            "routing_map_format", "bytemap"), **kw)
    assert _bits(grad) == _bits(g_direct)
    # the NumPy reference (the same function on the CPU)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        lc, bc = jax.device_put(logits, cpu), None if bias is None else jax.device_put(bias, cpu)
        rp, rr = jax.jit(fwd)(lc, bc)
        rg = jax.jit(jax.grad(loss))(lc, bc)
    np.testing.assert_array_equal(np.asarray(routing), np.asarray(rr))
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(np.asarray(probs, np.float32), np.asarray(rp, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(rg, np.float32), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["bytemap", "bitmap_u8"])
@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("device_total", [False, True])
def test_aux_ops_ffi_match_reference_and_direct_path(dtype, fmt, sf, device_total, rng):
    import moe_rt

    T, E, K = 333, 37, 5
    logits, _ = _router_case(rng, T, E, jnp.dtype(dtype))
    tpe = jnp.asarray(rng.integers(0, 3 * T, E), jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    total = jnp.asarray(T * 3, jnp.int32) if device_total else T * 3
    gs = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)

    def f(l, total):
        scores, rmap = mj.scores_for_aux_loss(l, K, sf, routing_map_format=fmt)
        loss = mj.aux_loss(scores.astype(l.dtype), tpe, total, E, K, 0.01)
        return loss.astype(jnp.float32) + (scores * gs).sum(), (scores, rmap, loss)

    step = jax.jit(jax.value_and_grad(f, has_aux=True), static_argnums=() if device_total else (1,))
    (val, (scores, rmap, loss)), grad = step(logits, total)
    (_, _), grad_remat = jax.jit(jax.value_and_grad(jax.checkpoint(f, static_argnums=() if device_total else (1,)),
                                                    has_aux=True), static_argnums=() if device_total else (1,))(
        logits, total)
    assert _bits(grad_remat) == _bits(grad)
    # the direct path: the same bits
    ds, dm, di = moe_rt.scores_for_aux_loss(logits, K, sf, routing_map_format=fmt)
    assert _bits(scores) == _bits(ds) and _bits(rmap) == _bits(dm)
    dl = moe_rt.aux_loss(ds.astype(logits.dtype), tpe, total, E, K, 0.01)
    assert _bits(loss) == _bits(jnp.asarray(dl).reshape(()))
    # the NumPy reference
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        lc = jax.device_put(logits, cpu)
        tc = jax.device_put(total, cpu) if device_total else total
        (rv, (rs, rm, rl)), rg = step(lc, tc)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(rm))
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    for got, want in ((scores, rs), (loss, rl), (grad, rg), (val, rv)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("T,H,block", [(517, 7168, 128), (37, 130, 128), (9, 100, 7)])
def test_fp8_ffi_matches_reference_and_direct_path(dtype, T, H, block, rng):
    from moe_rt import fp8

    x = jnp.asarray(rng.standard_normal((T, H)) * 10, jnp.dtype(dtype))
    x = x.at[3, : min(H, block)].set(0)  # an all-zero block: scale 1
    q, s = jax.jit(lambda v: mj.quantize_fp8(v, block))(x)
    y = jax.jit(lambda a, b: mj.dequantize_fp8(a, b, jnp.dtype(dtype), block))(q, s)
    dq, ds = fp8.quantize_fp8(x, block)  # the direct path: the same bits
    assert _bits(q) == _bits(dq) and _bits(s) == _bits(ds)
    assert _bits(y) == _bits(fp8.dequantize_fp8(dq, ds, dtype, block))
    rq, rs = fp8.quantize_fp8(np.asarray(x), block)  # the NumPy reference: bitwise equal on every backend
    assert _bits(q) == _bits(rq) and _bits(s) == _bits(rs)
    assert _bits(jax.jit(jax.vmap(lambda v: mj.quantize_fp8(v, block)[0]))(jnp.stack([x, x]))[1]) == _bits(q)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,row", [("bfloat16", (136,)), ("float32", (3, 5)), ("float8_e4m3fn", (129,)),
                                       ("int64", ())])
@pytest.mark.parametrize("traced", [False, True])
def test_sort_chunks_ffi_matches_reference_and_direct_path(dtype, row, traced, rng):
    import moe_rt

    N, S = 517, 12
    split = rng.multinomial(N - 20, np.ones(S) / S).astype(np.int32)  # 20 rows past the chunks stay put
    order = rng.permutation(S).astype(np.int32)
    raw = rng.standard_normal((N,) + row) * 100
    x = jnp.asarray(raw).astype(jnp.dtype(dtype))
    p = jnp.asarray(rng.random(N), jnp.bfloat16)
    gy = jnp.asarray(rng.standard_normal((N,) + row), jnp.float32)
    sv, ov = (jnp.asarray(split, jnp.int64 if jax.config.jax_enable_x64 else jnp.int32), jnp.asarray(order)) \
        if traced else (split, order)

    def f(x, p, sv, ov):
        return mj.sort_chunks(x, sv, ov, probs=p)

    def loss(xf, p, sv, ov):
        out, po = f(xf, p, sv, ov)
        return (out * gy).sum() + (po.astype(jnp.float32) ** 2).sum()

    out, po = jax.jit(f)(x, p, sv, ov)
    d_out, d_po = moe_rt.sort_chunks(x, split, order, probs=p)  # the direct path: the same bits
    assert _bits(out) == _bits(d_out) and _bits(po) == _bits(d_po)
    ref, rp = moe_rt.sort_chunks(np.asarray(x), split, order, probs=np.asarray(p, np.float32))
    assert _bits(out) == _bits(ref) and _bits(po) == _bits(rp)
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float8_e4m3fn:
        xf = x.astype(jnp.float32)
        gx, gp = jax.jit(jax.grad(loss, argnums=(0, 1)))(xf, p, sv, ov)
        gx2, gp2 = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(xf, p, sv, ov)
        assert _bits(gx) == _bits(gx2) and _bits(gp) == _bits(gp2)
        want, wp = moe_rt.sort_chunks_backward(np.asarray(gy), split, order,
                                               grad_probs=2 * np.asarray(rp, np.float32))
        assert _bits(gx) == _bits(want)
        np.testing.assert_allclose(np.asarray(gp, np.float32), wp, rtol=1e-2, atol=1e-2)
    got = jax.jit(jax.vmap(lambda a: mj.sort_chunks(a, sv, ov)))(jnp.stack([x, x[::-1]]))
    assert _bits(got[0]) == _bits(out) and _bits(got[1]) == _bits(moe_rt.sort_chunks(x[::-1], split, order))


@pytest.mark.gpu
def test_router_forms_under_vmap_equal_a_loop_on_gpu(rng):
    T, E, K = 129, 24, 4
    logits = jnp.stack([_router_case(rng, T, E, jnp.bfloat16)[0] for _ in range(3)])
    tpe = jnp.asarray(rng.integers(0, T, (3, E)), jnp.int32)

    def f(l, t):
        p1, m1 = mj.topk_with_score(l, K, routing_map_format="bitmap_u8")
        p2, i2 = mj.topk_with_score(l, K, topk_indices_dtype="int16")
        s, m3 = mj.scores_for_aux_loss(l, K, "sigmoid")
        return p1, m1, p2, i2, s, m3, mj.aux_loss(s, t, T, E, K, 0.1)

    got = jax.jit(jax.vmap(f))(logits, tpe)
    for b in range(3):
        want = jax.jit(f)(logits[b], tpe[b])
        for g, v in zip(got, want):
            assert _bits(g[b]) == _bits(v)


# (T, E, K, B): the router benchmark's E = 256 (the block's shared histogram in the fused mode) and E = 2304 (global
# atomics at T E <= 2^18, the second kernel above) with TE's 64 bins, and odd sizes (the generic kernel)
QB_GPU_CASES = [(517, 256, 8, 64), (113, 2304, 36, 64), (517, 2304, 36, 64), (37, 61, 5, 7)]


def _qb_gpu_case(rng, T, E, B, dtype):
    logits, _ = _router_case(rng, T, E, dtype)
    bias = jnp.asarray(rng.permutation(np.linspace(-0.2, 0.2, E)), jnp.float32)
    return logits, bias, jnp.asarray([-1.2, 1.2], jnp.float32), jnp.asarray(rng.integers(0, 1000, (E, B)), jnp.int32)


def _qb_semantics(raw, bias, bounds, K, start):
    """The routing map and the new histogram the semantics give for the device's own raw sigmoid values: the
    top k + 1 by (raw + bias) in (key desc, index asc), the last of them the cutoff; one count a token and
    expert in its bin (the NumPy reference's binning)."""
    from moe_rt.reference import router as ref

    r = (raw + bias[None, :]).astype(np.float32)
    order = np.argsort(~ref.float_keys(r), axis=-1, kind="stable")
    sel = np.zeros(raw.shape, bool)
    np.put_along_axis(sel, order[:, :K], True, axis=-1)
    cut = np.take_along_axis(r, order[:, K:K + 1], axis=-1)[:, 0]
    hist = np.array(start, np.int32)
    ref.qb_histogram_accumulate(raw, cut, bounds, hist)
    return sel, hist


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fused_atomic", "two_kernel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", QB_GPU_CASES, ids=lambda c: "T{}-E{}-K{}-B{}".format(*c))
def test_qb_ffi_matches_reference_and_direct_path(case, dtype, mode, rng):
    import moe_rt

    T, E, K, B = case
    logits, bias, bounds, h0 = _qb_gpu_case(rng, T, E, B, jnp.dtype(dtype))
    gy = jnp.asarray(rng.standard_normal((T, E)), jnp.dtype(dtype))

    def fwd(l, h, mode=mode):
        return mj.topk_with_score_qb(l, K, expert_bias=bias, qb_histogram=h, qb_bin_bounds=bounds,
                                     qb_histogram_mode=mode, scaling_factor=1.5)

    def loss(l, h):
        return (fwd(l, h)[0].astype(jnp.float32) * gy.astype(jnp.float32)).sum()

    probs, rmap, hist = jax.jit(fwd)(logits, h0)
    grad = jax.jit(jax.grad(loss))(logits, h0)
    assert _bits(jax.jit(jax.grad(jax.checkpoint(loss)))(logits, h0)) == _bits(grad)
    # the other mode: the same bits, counts included
    other = jax.jit(partial(fwd, mode="two_kernel" if mode == "fused_atomic" else "fused_atomic"))(logits, h0)
    assert [_bits(a) for a in other] == [_bits(a) for a in (probs, rmap, hist)]
    # exact against the semantics on the device's raw values (the plain sigmoid + bias forward's intermediate:
    # its probs and map are the QB forward's, bit for bit)
    dp, dm, di = moe_rt.topk_with_score(logits, K, score_function="sigmoid", expert_bias=bias, scaling_factor=1.5)
    assert _bits(probs) == _bits(dp) and _bits(rmap) == _bits(dm)
    sel, want_hist = _qb_semantics(np.asarray(di), np.asarray(bias), np.asarray(bounds), K, np.asarray(h0))
    np.testing.assert_array_equal(np.asarray(rmap), sel)
    np.testing.assert_array_equal(np.asarray(hist), want_hist)
    assert _bits(grad) == _bits(moe_rt.topk_with_score_backward(gy, dm, di, K, score_function="sigmoid",
                                                                scaling_factor=1.5))
    # the old histogram donated: the same bits, and threading it through counts again
    donated = jax.jit(fwd, donate_argnums=1)
    p1, m1, h1 = donated(logits, jnp.array(h0, copy=True))
    assert _bits(p1) == _bits(probs) and _bits(m1) == _bits(rmap) and _bits(h1) == _bits(hist)
    h2 = donated(logits, h1)[2]
    np.testing.assert_array_equal(np.asarray(h2) - np.asarray(hist), np.asarray(hist) - np.asarray(h0))
    # vmap: once per element, in order, each with its own histogram
    lb, hb = jnp.stack([logits, logits[::-1]]), jnp.stack([h0, h0[::-1]])
    got = jax.jit(jax.vmap(fwd))(lb, hb)
    for b in range(2):
        want = jax.jit(fwd)(lb[b], hb[b])
        assert [_bits(g[b]) for g in got] == [_bits(w) for w in want]
    # the NumPy reference (the same function on the CPU): maps agree on all but rows near a tie in fp32
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        rp, rm, rh = jax.jit(fwd)(jax.device_put(logits, cpu), jax.device_put(h0, cpu))
    ok = (np.asarray(rmap) == np.asarray(rm)).all(1)
    assert ok.sum() >= T - max(1, T // 100)
    assert int(np.asarray(rh).sum()) == int(np.asarray(hist).sum())  # T counts a row each
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(np.asarray(probs, np.float32)[ok], np.asarray(rp, np.float32)[ok], rtol=tol, atol=tol)


def _perm_case(rng, T, E, K, H, dtype):
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    idx[::7, -1] = -1
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    gy = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    return jnp.asarray(idx), x, w, gy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("align_size,num_out", [(1, None), (16, None), (8, 900)])
@pytest.mark.parametrize("remat", [False, True])
def test_permutation_ffi_matches_reference_and_direct_path(dtype, align_size, num_out, remat, rng):
    import moe_rt

    T, E, K, H = 517, 64, 8, 136
    idx, x, w, gy = _perm_case(rng, T, E, K, H, jnp.dtype(dtype))

    def step(x, w, idx, gy):
        plan = mj.make_plan(idx, E, align_size=align_size, num_out_tokens=num_out)
        xp, pp = mj.dispatch(x, plan, w)
        y = mj.combine(xp * 2, plan, w)
        return (y.astype(jnp.float32) * gy).sum() + (pp ** 2).sum(), (plan, xp, pp, y)

    f = jax.checkpoint(step) if remat else step
    (val, (plan, xp, pp, y)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w, idx, gy)
    # the direct path, op by op, on the same device arrays
    dplan = moe_rt.make_plan(idx, E, align_size=align_size, num_out_tokens=num_out)
    for name, a in zip(mj._PLAN_ARRAYS, plan.arrays):
        assert _bits(a) == _bits(getattr(dplan, name)), name
    dxp, dpp = moe_rt.dispatch(x, dplan, w)
    assert _bits(xp) == _bits(dxp) and _bits(pp) == _bits(dpp)
    dy = moe_rt.combine(dxp * 2, dplan, w)
    assert _bits(y) == _bits(dy)
    # the reference: the same step on the CPU
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        rv, rg = jax.jit(jax.value_and_grad(lambda *a: f(*a)[0], argnums=(0, 1)))(
            *(jax.device_put(a, cpu) for a in (x, w, idx, gy)))
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(float(val), float(rv), rtol=tol)
    for g, r in zip(grads, rg):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=tol, atol=tol)
    # checkpointed and plain give the same bits
    if remat:
        _, plain = jax.jit(jax.value_and_grad(lambda *a: step(*a)[0], argnums=(0, 1)))(x, w, idx, gy)
        for a, b in zip(grads, plain):
            assert _bits(a) == _bits(b)


@pytest.mark.gpu
def test_ffi_under_vmap_equals_a_loop_on_gpu(rng):
    T, E, K, H = 129, 16, 4, 72
    cases = [_perm_case(rng, T, E, K, H, jnp.bfloat16) for _ in range(3)]
    idx, x, w, _ = (jnp.stack(a) for a in zip(*cases))

    def f(i, x, w):
        plan = mj.make_plan(i, E, align_size=8)
        xp, pp = mj.dispatch(x, plan, w)
        return mj.combine(xp, plan, w), pp, plan.tokens_per_expert

    got = jax.jit(jax.vmap(f))(idx, x, w)
    for b in range(3):
        want = jax.jit(f)(idx[b], x[b], w[b])
        for g, v in zip(got, want):
            assert _bits(g[b]) == _bits(v)


@pytest.mark.gpu
def test_bad_expert_ids_raise_at_check(rng):
    import moe_rt

    T, E, K = 37, 8, 2
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    idx[5, 1] = E + 3
    moe_rt.check()
    plan = jax.jit(lambda i: mj.make_plan(i, E))(jnp.asarray(idx))
    jax.block_until_ready(plan.arrays)
    with pytest.raises(ValueError, match=rf"routing: expert ids must be in \[-1, num_experts={E}\), got {E + 3}"):
        moe_rt.check()
    moe_rt.check()  # read and cleared
    assert int(np.asarray(plan.counts).sum()) == T * K - 1  # the bad slot was dropped


_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    import moe_rt.jax as mj

    T, E, K, H = 517, 64, 8, 136
    rng = np.random.default_rng(3)

    def loss(logits, x, bias, gy):
        probs, _ = mj.topk_with_score(logits, K, score_function="sigmoid", num_groups=8, group_topk=4,
                                      scaling_factor=2.5, expert_bias=bias)
        w, idx = jax.lax.top_k(probs.astype(jnp.float32), K)
        plan = mj.make_plan(idx.astype(jnp.int32), E, align_size=8)
        xp, pp = mj.dispatch(x, plan, w)
        y = mj.combine(xp * 2, plan, w)
        p_bits, _ = mj.topk_with_score(logits, K, routing_map_format="bitmap_u8")
        p_idx, _ = mj.topk_with_score(logits, K, topk_indices_dtype="int16", score_function="sigmoid")
        scores, _ = mj.scores_for_aux_loss(logits, K, "softmax", routing_map_format="bitmap_u8")
        aux = mj.aux_loss(scores, plan.tokens_per_expert, jnp.asarray(T, jnp.int32), E, K, 0.01)
        xq = mj.dequantize_fp8(*mj.quantize_fp8(jax.lax.stop_gradient(x)), jnp.float32)
        xs = mj.sort_chunks(y, jnp.asarray([100, 17, 300], jnp.int32), jnp.asarray([2, 0, 1], jnp.int32))
        return ((y.astype(jnp.float32) * gy).sum() + (pp ** 2).sum() + aux + (p_bits * gy[:, :E]).sum()
                + (p_idx * gy[:, E:2 * E]).sum() + (xq * gy).sum() + (xs.astype(jnp.float32) * gy).sum())

    args = (jnp.asarray(rng.permutation(T * E).reshape(T, E) / (T * E), jnp.float32),
            jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32),
            jnp.asarray(rng.standard_normal((T, H)), jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    compiled = step.lower(*args).compile()
    print("COMMAND_BUFFER_HLO", "command_buffer" in compiled.as_text())
    outs = [step(*args) for _ in range(3)]
    leaves = [np.asarray(a) for a in jax.tree_util.tree_leaves(outs[-1])]
    for o in outs[:-1]:
        assert all(np.asarray(a).tobytes() == b.tobytes() for a, b in zip(jax.tree_util.tree_leaves(o), leaves))
    np.savez(sys.argv[1], *leaves)
""")


def _mentions_command_buffer(dump: Path) -> bool:
    """Whether XLA's dumps show a command buffer (not counting the flags themselves)."""
    for p in dump.rglob("*"):
        if not p.is_file() or "debug_options" in p.name:
            continue
        for line in p.read_text(errors="ignore").lower().splitlines():
            if ("command_buffer" in line or "commandbuffer" in line) and "xla_gpu_" not in line:
                return True
    return False


_QB_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    import moe_rt.jax as mj

    rng = np.random.default_rng(5)
    bounds = jnp.asarray([-1.2, 1.2], jnp.float32)

    def qb(l, bias, h, mode):
        return mj.topk_with_score_qb(l, 8 if l.shape[1] == 256 else 36, expert_bias=bias, qb_histogram=h,
                                     qb_bin_bounds=bounds, qb_histogram_mode=mode, scaling_factor=1.5)

    def loss(l1, l2, b1, b2, h1, h2, h3, gy1, gy2):
        # E = 256: the block's shared histogram, and the two-kernel mode; E = 2304: the second kernel after the
        # router kernel in the fused mode (T E > 2^18)
        p1, m1, n1 = qb(l1, b1, h1, "fused_atomic")
        p2, m2, n2 = qb(l1, b1, h2, "two_kernel")
        p3, m3, n3 = qb(l2, b2, h3, "fused_atomic")
        val = ((p1.astype(jnp.float32) + p2.astype(jnp.float32)) * gy1).sum() + (p3.astype(jnp.float32) * gy2).sum()
        return val, (m1, m2, m3, n1, n2, n3)

    l1 = jnp.asarray(rng.permutation(517 * 256).reshape(517, 256) / (517 * 256) * 8 - 4, jnp.bfloat16)
    l2 = jnp.asarray(rng.permutation(129 * 2304).reshape(129, 2304) / (129 * 2304) * 8 - 4, jnp.float32)
    b1 = jnp.asarray(rng.permutation(np.linspace(-0.2, 0.2, 256)), jnp.float32)
    b2 = jnp.asarray(rng.permutation(np.linspace(-0.2, 0.2, 2304)), jnp.float32)
    hists = [jnp.asarray(rng.integers(0, 1000, (e, 64)), jnp.int32) for e in (256, 256, 2304)]
    start = [np.asarray(h) for h in hists]
    gy1 = jnp.asarray(rng.standard_normal((517, 256)), jnp.float32)
    gy2 = jnp.asarray(rng.standard_normal((129, 2304)), jnp.float32)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    compiled = step.lower(l1, l2, b1, b2, *hists, gy1, gy2).compile()
    print("COMMAND_BUFFER_HLO", "command_buffer" in compiled.as_text())
    outs = []
    for _ in range(3):  # the histograms threaded through the steps
        (val, aux), grads = step(l1, l2, b1, b2, *hists, gy1, gy2)
        hists = list(aux[3:])
        outs.append([np.asarray(a) for a in jax.tree_util.tree_leaves((val, aux[:3], grads))])
    for o in outs[:-1]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(o, outs[-1]))
    (_, aux), _ = step(l1, l2, b1, b2, *[jnp.asarray(s) for s in start], gy1, gy2)
    for s, one, h in zip(start, aux[3:], hists):  # three steps added three times one step's counts
        assert (np.asarray(h) - s == 3 * (np.asarray(one) - s)).all()
    np.savez(sys.argv[1], *outs[-1], *[np.asarray(h) for h in hists])
""")


@pytest.mark.gpu
def test_layer_step_with_command_buffers_gives_the_same_bits(tmp_path):
    _same_bits_with_command_buffers(tmp_path, _COMMAND_BUFFER_SCRIPT)


@pytest.mark.gpu
def test_qb_forward_with_command_buffers_gives_the_same_bits(tmp_path):
    _same_bits_with_command_buffers(tmp_path, _QB_COMMAND_BUFFER_SCRIPT)


def _same_bits_with_command_buffers(tmp_path, text):
    """Runs the script ``text`` (which saves its results to argv[1]) with XLA command buffers off and on: a
    command buffer is formed when on, and the results are the same bits."""
    script = tmp_path / "step.py"
    script.write_text(text)
    results = {}
    # XLA's autotuner off in both: it picks tilings of XLA's own reductions by timing, so the loss (a sum XLA
    # computes) could differ in its last bits from process to process whatever moe_rt does (one H200: two of
    # four runs differed in the loss alone, every gradient the same bits; with autotuning off six runs, fresh and
    # warm kernel cache, command buffers on and off, gave the same bits)
    for name, flags in (("off", "--xla_gpu_enable_command_buffer="),
                        ("on", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")):
        dump = tmp_path / f"dump_{name}"
        env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_gpu_autotune_level=0 --xla_dump_to={dump}")
        r = subprocess.run([sys.executable, str(script), str(tmp_path / f"{name}.npz")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        # command buffers show in the optimized HLO or, where XLA forms them from thunks, in its dumps
        results[name] = "COMMAND_BUFFER_HLO True" in r.stdout or _mentions_command_buffer(dump)
    assert results["on"], "no command buffer was formed with command buffers enabled"
    off, on = np.load(tmp_path / "off.npz"), np.load(tmp_path / "on.npz")
    assert sorted(off.files) == sorted(on.files)
    for k in off.files:
        assert off[k].dtype == on[k].dtype and off[k].tobytes() == on[k].tobytes(), k
