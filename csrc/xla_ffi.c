/* moe_rt for XLA: the single-GPU ops and the low-latency EP ops as XLA FFI handlers (libmoe_rt_xla.so, linked
 * to libmoe_rt.so).
 *
 * Each handler decodes XLA's call frame by hand (buffers, results, attributes by name, the stream and the
 * device ordinal through the API), then calls the C core's op on XLA's stream: no Python, no host sync, no
 * allocation (scratch comes as an extra result). The static facts of a call (topk, score function, groups,
 * scaling, align size, ...) are attributes fixed when the op was traced; sizes and dtypes come from the
 * buffers. One moe_rt context per device, created on first use (moe_rt.jax makes it when an op is traced,
 * outside any graph capture) and kept for the process. Every handler declares itself command-buffer
 * compatible (the low-latency EP handlers excepted, below): the launches depend on the attributes, shapes and
 * buffer addresses alone. A failure returns
 * an XLA FFI error carrying moe_rt_last_error().
 *
 * Built against xla/ffi/api/c_api.h of the installed jaxlib (jax.ffi.include_dir()); the API's major
 * version and the struct sizes this file relies on are checked at every call. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_rt/moe_rt.h"
#include "xla/ffi/api/c_api.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 256

/* ---- the contexts ------------------------------------------------------------------------------- */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static char* g_cache_dir;
static moe_rt_context* g_ctx[MAX_DEVICES];
static char g_message[1200]; /* the last failure of the functions below that are called from Python */

EXPORT const char* moe_rt_xla_last_error(void) { return g_message; }

/* The kernel-cache folder the contexts load from (moe_rt.jax sets it when it traces an op). Returns 0, or
 * 1 when contexts were made from another folder already (the message says which). */
EXPORT int moe_rt_xla_set_kernel_cache(const char* dir) {
  int rc = 0;
  pthread_mutex_lock(&g_lock);
  if (g_cache_dir && strcmp(g_cache_dir, dir) != 0) {
    int made = 0;
    for (int i = 0; i < MAX_DEVICES; ++i) made |= g_ctx[i] != NULL;
    if (made) {
      snprintf(g_message, sizeof g_message, "moe_rt.jax: the kernel cache folder changed from %s to %s after XLA "
               "ops ran (MOE_RT_KERNEL_CACHE or MOE_RT_NVRTC_OPTIONS changed); set MOE_RT_NVRTC_OPTIONS / "
               "MOE_RT_KERNEL_CACHE before the first op of the process", g_cache_dir, dir);
      rc = 1;
    }
  }
  if (!rc) {
    free(g_cache_dir);
    g_cache_dir = strdup(dir);
  }
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* The context of CUDA device `device` (made on first use). Returns a moe_rt_status. */
static moe_rt_status context_for(int device, moe_rt_context** out) {
  if (device < 0 || device >= MAX_DEVICES) {
    pthread_mutex_lock(&g_lock);
    snprintf(g_message, sizeof g_message, "moe_rt.jax: device ordinal %d is out of range", device);
    pthread_mutex_unlock(&g_lock);
    return MOE_RT_ERROR_NO_DEVICE;
  }
  moe_rt_context* c = __atomic_load_n(&g_ctx[device], __ATOMIC_ACQUIRE);
  if (c) {
    *out = c;
    return MOE_RT_SUCCESS;
  }
  moe_rt_status st = MOE_RT_SUCCESS;
  pthread_mutex_lock(&g_lock);
  c = g_ctx[device];
  if (!c) {
    if (!g_cache_dir) {
      snprintf(g_message, sizeof g_message, "moe_rt.jax: no kernel cache folder is set (moe_rt.jax sets it when an "
               "op is traced)");
      st = MOE_RT_ERROR_KERNEL_CACHE;
    } else if ((st = moe_rt_context_create(g_cache_dir, device, &c)) != MOE_RT_SUCCESS) {
      snprintf(g_message, sizeof g_message, "%s", moe_rt_last_error());
      c = NULL;
    } else {
      __atomic_store_n(&g_ctx[device], c, __ATOMIC_RELEASE);
    }
  }
  pthread_mutex_unlock(&g_lock);
  *out = c;
  return st;
}

/* Make device `device`'s context (if needed) and load kernel `name` of kernels/`file` into it, outside any
 * graph capture. Returns a moe_rt_status; moe_rt_xla_last_error() says why on failure. */
EXPORT int moe_rt_xla_load_kernel(int device, const char* file, const char* name) {
  moe_rt_context* c = NULL;
  moe_rt_status st = context_for(device, &c);
  if (st) return st;
  st = moe_rt_context_load_kernel(c, file, name);
  if (st) snprintf(g_message, sizeof g_message, "%s", moe_rt_last_error());
  return st;
}

/* Read and clear the error word of device `device`'s context (bad expert ids met by make_plan), after the
 * caller waited for the device: MOE_RT_ERROR_BAD_EXPERT_ID with the Python side's message, or success (also
 * without a context). A host sync (moe_rt_check). */
EXPORT int moe_rt_xla_check(int device) {
  if (device < 0 || device >= MAX_DEVICES) return MOE_RT_SUCCESS;
  moe_rt_context* c = __atomic_load_n(&g_ctx[device], __ATOMIC_ACQUIRE);
  if (!c) return MOE_RT_SUCCESS;
  moe_rt_status st = moe_rt_check(c, NULL);
  if (st) {
    pthread_mutex_lock(&g_lock);
    snprintf(g_message, sizeof g_message, "%s", moe_rt_last_error());
    pthread_mutex_unlock(&g_lock);
  }
  return st;
}

/* ---- decoding a call frame ------------------------------------------------------------------------ */

typedef struct frame {
  XLA_FFI_CallFrame* f;
  const XLA_FFI_Api* api;
  const char* op;
} frame;

static XLA_FFI_Error* fail(const frame* fr, XLA_FFI_Error_Code code, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));

static XLA_FFI_Error* fail(const frame* fr, XLA_FFI_Error_Code code, const char* fmt, ...) {
  char msg[1400];
  int n = snprintf(msg, sizeof msg, "%s: ", fr->op);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
  va_end(ap);
  XLA_FFI_Error_Create_Args a;
  memset(&a, 0, sizeof a);
  a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  a.message = msg;
  a.errc = code;
  return fr->api->XLA_FFI_Error_Create(&a);
}

static XLA_FFI_Error_Code code_of(moe_rt_status st) {
  switch (st) {
    case MOE_RT_ERROR_INVALID_ARGUMENT: return XLA_FFI_Error_Code_INVALID_ARGUMENT;
    case MOE_RT_ERROR_NO_DRIVER: case MOE_RT_ERROR_NO_DEVICE: return XLA_FFI_Error_Code_UNAVAILABLE;
    case MOE_RT_ERROR_KERNEL_CACHE: return XLA_FFI_Error_Code_NOT_FOUND;
    case MOE_RT_ERROR_NOT_SUPPORTED: return XLA_FFI_Error_Code_UNIMPLEMENTED;
    default: return XLA_FFI_Error_Code_INTERNAL;
  }
}

/* The core's failure as an FFI error carrying moe_rt_last_error(). */
static XLA_FFI_Error* fail_core(const frame* fr, moe_rt_status st, const char* message) {
  return fail(fr, code_of(st), "%s (%s)", message, moe_rt_status_name(st));
}

/* Checks the frame; answers XLA's metadata query (API version, `traits`) with *done set. NULL = go on. */
static XLA_FFI_Error* begin(XLA_FFI_CallFrame* f, frame* fr, const char* op, XLA_FFI_Handler_Traits traits,
                            int* done) {
  *done = 0;
  fr->f = f;
  fr->api = f->api;
  fr->op = op;
  /* without the API no error can be made: the sizes below are what XLA of any version provides */
  if (f->struct_size < XLA_FFI_CallFrame_STRUCT_SIZE)
    return fail(fr, XLA_FFI_Error_Code_FAILED_PRECONDITION, "the XLA call frame is smaller (%zu bytes) than this "
                "library was built for (%zu)", f->struct_size, (size_t)XLA_FFI_CallFrame_STRUCT_SIZE);
  if (f->api->api_version.major_version != XLA_FFI_API_MAJOR)
    return fail(fr, XLA_FFI_Error_Code_FAILED_PRECONDITION, "XLA FFI API %d.%d; this library was built for major "
                "version %d", f->api->api_version.major_version, f->api->api_version.minor_version,
                XLA_FFI_API_MAJOR);
  if (f->extension_start && f->extension_start->type == XLA_FFI_Extension_Metadata) {
    XLA_FFI_Metadata_Extension* ext = (XLA_FFI_Metadata_Extension*)f->extension_start;
    if (ext->extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE ||
        ext->metadata->struct_size < XLA_FFI_Metadata_STRUCT_SIZE)
      return fail(fr, XLA_FFI_Error_Code_FAILED_PRECONDITION, "XLA's metadata structs are smaller than expected");
    ext->metadata->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
    ext->metadata->api_version.extension_start = NULL;
    ext->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    ext->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
    ext->metadata->traits = traits;
    ext->metadata->state_type_id.type_id = 0;
    *done = 1;
    return NULL;
  }
  if (f->api->struct_size < XLA_FFI_Api_STRUCT_SIZE)
    return fail(fr, XLA_FFI_Error_Code_FAILED_PRECONDITION, "the XLA FFI API table is smaller (%zu bytes) than "
                "this library needs (%zu: the device ordinal getter)", f->api->struct_size,
                (size_t)XLA_FFI_Api_STRUCT_SIZE);
  if (f->stage != XLA_FFI_ExecutionStage_EXECUTE)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "called at execution stage %d; only execute (%d) is "
                "handled", (int)f->stage, (int)XLA_FFI_ExecutionStage_EXECUTE);
  return NULL;
}

static int dtype_code(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_F32: return MOE_RT_FLOAT32;
    case XLA_FFI_DataType_F16: return MOE_RT_FLOAT16;
    case XLA_FFI_DataType_BF16: return MOE_RT_BFLOAT16;
    case XLA_FFI_DataType_S32: return MOE_RT_INT32;
    case XLA_FFI_DataType_S64: return MOE_RT_INT64;
    case XLA_FFI_DataType_S16: return MOE_RT_INT16;
    case XLA_FFI_DataType_PRED: return MOE_RT_BOOL;
    case XLA_FFI_DataType_U8: return MOE_RT_UINT8;
    case XLA_FFI_DataType_S8: return MOE_RT_INT8;
    case XLA_FFI_DataType_F8E4M3FN: return MOE_RT_FLOAT8_E4M3;
    case XLA_FFI_DataType_F8E5M2: return MOE_RT_FLOAT8_E5M2;
    default: return -1;
  }
}

typedef struct buf {
  void* data;
  int dtype; /* moe_rt_dtype, -1 for others */
  int64_t rank;
  const int64_t* dims;
} buf;

static XLA_FFI_Error* one_buffer(const frame* fr, XLA_FFI_Buffer* b, const char* what, int64_t i, int rank,
                                 buf* out) {
  if (b->struct_size < XLA_FFI_Buffer_STRUCT_SIZE)
    return fail(fr, XLA_FFI_Error_Code_FAILED_PRECONDITION, "%s %lld: buffer struct too small", what, (long long)i);
  if (rank >= 0 && b->rank != rank)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "%s %lld: expected rank %d, got %lld", what, (long long)i,
                rank, (long long)b->rank);
  out->data = b->data;
  out->dtype = dtype_code(b->dtype);
  out->rank = b->rank;
  out->dims = b->dims;
  return NULL;
}

/* Argument i as a buffer of `rank` (-1: any). */
static XLA_FFI_Error* arg(const frame* fr, int64_t i, int rank, buf* out) {
  const XLA_FFI_Args* a = &fr->f->args;
  if (i >= a->size)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "expected more than %lld arguments", (long long)a->size);
  if (a->types[i] != XLA_FFI_ArgType_BUFFER)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "argument %lld is not a buffer", (long long)i);
  return one_buffer(fr, (XLA_FFI_Buffer*)a->args[i], "argument", i, rank, out);
}

static XLA_FFI_Error* ret(const frame* fr, int64_t i, int rank, buf* out) {
  const XLA_FFI_Rets* r = &fr->f->rets;
  if (i >= r->size)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "expected more than %lld results", (long long)r->size);
  if (r->types[i] != XLA_FFI_RetType_BUFFER)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "result %lld is not a buffer", (long long)i);
  return one_buffer(fr, (XLA_FFI_Buffer*)r->rets[i], "result", i, rank, out);
}

static XLA_FFI_Error* counts(const frame* fr, int64_t nargs, int64_t nrets) {
  if (fr->f->args.size != nargs || fr->f->rets.size != nrets)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "expected %lld arguments and %lld results, got %lld and "
                "%lld", (long long)nargs, (long long)nrets, (long long)fr->f->args.size, (long long)fr->f->rets.size);
  return NULL;
}

static const XLA_FFI_Scalar* scalar_attr(const frame* fr, const char* name, XLA_FFI_Error** err) {
  const XLA_FFI_Attrs* a = &fr->f->attrs;
  const size_t n = strlen(name);
  for (int64_t i = 0; i < a->size; ++i) {
    const XLA_FFI_ByteSpan* s = a->names[i];
    if (s->len != n || memcmp(s->ptr, name, n) != 0) continue;
    if (a->types[i] != XLA_FFI_AttrType_SCALAR) {
      *err = fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "attribute %s is not a scalar", name);
      return NULL;
    }
    return (const XLA_FFI_Scalar*)a->attrs[i];
  }
  *err = fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "attribute %s is missing", name);
  return NULL;
}

static XLA_FFI_Error* attr_i64(const frame* fr, const char* name, int64_t* out) {
  XLA_FFI_Error* err = NULL;
  const XLA_FFI_Scalar* s = scalar_attr(fr, name, &err);
  if (!s) return err;
  switch (s->dtype) {
    case XLA_FFI_DataType_PRED: *out = *(const uint8_t*)s->value != 0; return NULL;
    case XLA_FFI_DataType_S8: *out = *(const int8_t*)s->value; return NULL;
    case XLA_FFI_DataType_S16: *out = *(const int16_t*)s->value; return NULL;
    case XLA_FFI_DataType_S32: *out = *(const int32_t*)s->value; return NULL;
    case XLA_FFI_DataType_S64: *out = *(const int64_t*)s->value; return NULL;
    case XLA_FFI_DataType_U8: *out = *(const uint8_t*)s->value; return NULL;
    case XLA_FFI_DataType_U32: *out = *(const uint32_t*)s->value; return NULL;
    default:
      return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "attribute %s: expected an integer, got XLA type %d", name,
                  (int)s->dtype);
  }
}

static XLA_FFI_Error* attr_int(const frame* fr, const char* name, int* out) {
  int64_t v = 0;
  XLA_FFI_Error* err = attr_i64(fr, name, &v);
  if (err) return err;
  if (v < -2147483647LL - 1 || v > 2147483647LL)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "attribute %s: %lld does not fit in 32 bits", name,
                (long long)v);
  *out = (int)v;
  return NULL;
}

static XLA_FFI_Error* attr_f32(const frame* fr, const char* name, float* out) {
  XLA_FFI_Error* err = NULL;
  const XLA_FFI_Scalar* s = scalar_attr(fr, name, &err);
  if (!s) return err;
  if (s->dtype == XLA_FFI_DataType_F32) *out = *(const float*)s->value;
  else if (s->dtype == XLA_FFI_DataType_F64) *out = (float)*(const double*)s->value;
  else
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "attribute %s: expected a float, got XLA type %d", name,
                (int)s->dtype);
  return NULL;
}

/* The ordinal of the device XLA runs the call on. */
static XLA_FFI_Error* ordinal_of(const frame* fr, int* ordinal) {
  XLA_FFI_DeviceOrdinal_Get_Args da;
  memset(&da, 0, sizeof da);
  da.struct_size = XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE;
  da.ctx = fr->f->ctx;
  XLA_FFI_Error* err = fr->api->XLA_FFI_DeviceOrdinal_Get(&da);
  if (err) return err;
  *ordinal = da.device_ordinal;
  return NULL;
}

/* XLA's stream and this device's moe_rt context. */
static XLA_FFI_Error* device(const frame* fr, moe_rt_context** ctx, moe_rt_stream* stream) {
  XLA_FFI_Stream_Get_Args sa;
  memset(&sa, 0, sizeof sa);
  sa.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  sa.ctx = fr->f->ctx;
  XLA_FFI_Error* err = fr->api->XLA_FFI_Stream_Get(&sa);
  if (err) return err;
  int ordinal = -1;
  if ((err = ordinal_of(fr, &ordinal))) return err;
  moe_rt_status st = context_for(ordinal, ctx);
  if (st) {
    char msg[sizeof g_message];
    pthread_mutex_lock(&g_lock);
    snprintf(msg, sizeof msg, "%s", g_message);
    pthread_mutex_unlock(&g_lock);
    return fail_core(fr, st, msg);
  }
  *stream = (moe_rt_stream)sa.stream;
  return NULL;
}

#define TRY(x)                       \
  do {                               \
    XLA_FFI_Error* err_ = (x);       \
    if (err_) return err_;           \
  } while (0)

#define BEGIN_TRAITS(op, traits)                   \
  frame fr;                                        \
  int done_ = 0;                                   \
  TRY(begin(f, &fr, op, traits, &done_));          \
  if (done_) return NULL

#define BEGIN(op) BEGIN_TRAITS(op, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE)

#define CORE(call)                                                   \
  do {                                                               \
    moe_rt_status st_ = (call);                                      \
    if (st_) return fail_core(&fr, st_, moe_rt_last_error());        \
  } while (0)

static XLA_FFI_Error* want_dtype(const frame* fr, const buf* b, const char* name, int dtype) {
  if (b->dtype != dtype)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "%s: expected dtype code %d, got %d", name, dtype, b->dtype);
  return NULL;
}

/* Does nothing (after the frame checks every handler makes): JAX's floor for a custom call, which
 * tools/bench_layer.py times beside the ops. */
EXPORT XLA_FFI_Error* moe_rt_xla_noop(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_noop");
  return NULL;
}

/* ---- router --------------------------------------------------------------------------------------- */

/* T, E of a router array [T, E] (E within the core's bound, so that it fits an int). */
static XLA_FFI_Error* router_dims(const frame* fr, const buf* b, int64_t* T, int* E) {
  if (b->dims[1] > MOE_RT_MAX_EXPERTS)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "num_experts %lld is too large", (long long)b->dims[1]);
  *T = b->dims[0];
  *E = (int)b->dims[1];
  return NULL;
}

/* args: logits [T, E] (float), then expert_bias [E] float32 when has_bias; rets: probs [T, E] (logits'
 * dtype), the routing (its dtype says the form: routing_map [T, E] bool, the bit-packed map [T, ceil(E/8)]
 * uint8, or the indices [T, K] int16/int32/int64), intermediate [T, E] float32. attrs: topk, score_function,
 * use_pre_softmax, num_groups, group_topk, scaling_factor, has_bias. */
EXPORT XLA_FFI_Error* moe_rt_xla_topk_with_score(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_topk_with_score");
  int topk, score, pre, groups, gtopk, has_bias;
  float scale;
  TRY(attr_int(&fr, "topk", &topk));
  TRY(attr_int(&fr, "score_function", &score));
  TRY(attr_int(&fr, "use_pre_softmax", &pre));
  TRY(attr_int(&fr, "num_groups", &groups));
  TRY(attr_int(&fr, "group_topk", &gtopk));
  TRY(attr_int(&fr, "has_bias", &has_bias));
  TRY(attr_f32(&fr, "scaling_factor", &scale));
  TRY(counts(&fr, has_bias ? 2 : 1, 3));
  buf logits, bias = {0}, probs, rmap, inter;
  TRY(arg(&fr, 0, 2, &logits));
  if (has_bias) {
    TRY(arg(&fr, 1, 1, &bias));
    TRY(want_dtype(&fr, &bias, "expert_bias", MOE_RT_FLOAT32));
  }
  TRY(ret(&fr, 0, 2, &probs));
  TRY(ret(&fr, 1, 2, &rmap));
  TRY(ret(&fr, 2, 2, &inter));
  TRY(want_dtype(&fr, &probs, "probs", logits.dtype));
  TRY(want_dtype(&fr, &inter, "intermediate", MOE_RT_FLOAT32));
  int64_t T;
  int E;
  TRY(router_dims(&fr, &logits, &T, &E));
  moe_rt_context* ctx;
  moe_rt_stream stream;
  TRY(device(&fr, &ctx, &stream));
  CORE(moe_rt_topk_with_score(ctx, logits.data, logits.dtype, T, E, topk, score, pre, groups, gtopk, scale,
                              has_bias ? bias.data : NULL, probs.data, rmap.data, rmap.dtype, inter.data, stream));
  return NULL;
}

/* args: grad_probs [T, E], the forward's routing (any of its forms), intermediate [T, E] float32; rets:
 * grad_logits [T, E] (grad_probs' dtype). attrs: topk, score_function, use_pre_softmax, scaling_factor. */
EXPORT XLA_FFI_Error* moe_rt_xla_topk_with_score_backward(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_topk_with_score_backward");
  int topk, score, pre;
  float scale;
  TRY(attr_int(&fr, "topk", &topk));
  TRY(attr_int(&fr, "score_function", &score));
  TRY(attr_int(&fr, "use_pre_softmax", &pre));
  TRY(attr_f32(&fr, "scaling_factor", &scale));
  TRY(counts(&fr, 3, 1));
  buf g, rmap, inter, out;
  TRY(arg(&fr, 0, 2, &g));
  TRY(arg(&fr, 1, 2, &rmap));
  TRY(arg(&fr, 2, 2, &inter));
  TRY(ret(&fr, 0, 2, &out));
  TRY(want_dtype(&fr, &inter, "intermediate", MOE_RT_FLOAT32));
  TRY(want_dtype(&fr, &out, "grad_logits", g.dtype));
  int64_t T;
  int E;
  TRY(router_dims(&fr, &g, &T, &E));
  moe_rt_context* ctx;
  moe_rt_stream stream;
  TRY(device(&fr, &ctx, &stream));
  CORE(moe_rt_topk_with_score_backward(ctx, g.data, g.dtype, rmap.data, rmap.dtype, inter.data, T, E, topk,
                                       score, pre, scale, out.data, stream));
  return NULL;
}

/* Quantile Balancing's forward. args: logits [T, E] (float), expert_bias [E] float32, qb_histogram [E, B] int32,
 * qb_bin_bounds [2] float32; rets: probs [T, E] (logits' dtype), routing_map [T, E] bool, intermediate [T, E]
 * float32, the new histogram [E, B] int32, cutoff [T] float32 (scratch of the two-kernel step). The new
 * histogram is the old one plus this call's counts: the call aliases it to qb_histogram (XLA copies the old
 * one into it first unless that buffer may be overwritten), and the core adds to it in place. attrs: topk,
 * scaling_factor, qb_histogram_mode (moe_rt_qb_histogram_mode). */
EXPORT XLA_FFI_Error* moe_rt_xla_topk_with_score_qb(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_topk_with_score_qb");
  int topk, mode;
  float scale;
  TRY(attr_int(&fr, "topk", &topk));
  TRY(attr_int(&fr, "qb_histogram_mode", &mode));
  TRY(attr_f32(&fr, "scaling_factor", &scale));
  TRY(counts(&fr, 4, 5));
  buf logits, bias, hist, bounds, probs, rmap, inter, out_hist, cut;
  TRY(arg(&fr, 0, 2, &logits));
  TRY(arg(&fr, 1, 1, &bias));
  TRY(arg(&fr, 2, 2, &hist));
  TRY(arg(&fr, 3, 1, &bounds));
  TRY(ret(&fr, 0, 2, &probs));
  TRY(ret(&fr, 1, 2, &rmap));
  TRY(ret(&fr, 2, 2, &inter));
  TRY(ret(&fr, 3, 2, &out_hist));
  TRY(ret(&fr, 4, 1, &cut));
  TRY(want_dtype(&fr, &bias, "expert_bias", MOE_RT_FLOAT32));
  TRY(want_dtype(&fr, &hist, "qb_histogram", MOE_RT_INT32));
  TRY(want_dtype(&fr, &bounds, "qb_bin_bounds", MOE_RT_FLOAT32));
  TRY(want_dtype(&fr, &probs, "probs", logits.dtype));
  TRY(want_dtype(&fr, &rmap, "routing_map", MOE_RT_BOOL));
  TRY(want_dtype(&fr, &inter, "intermediate", MOE_RT_FLOAT32));
  TRY(want_dtype(&fr, &out_hist, "histogram", MOE_RT_INT32));
  TRY(want_dtype(&fr, &cut, "cutoff", MOE_RT_FLOAT32));
  int64_t T;
  int E;
  TRY(router_dims(&fr, &logits, &T, &E));
  if (hist.dims[0] != E || out_hist.dims[0] != E || out_hist.dims[1] != hist.dims[1] || hist.dims[1] > 2147483647LL ||
      bias.dims[0] != E || bounds.dims[0] != 2 || cut.dims[0] != T)
    return fail(&fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "shapes: logits [%lld, %d], expert_bias [%lld], "
                "qb_histogram [%lld, %lld] -> [%lld, %lld], qb_bin_bounds [%lld], cutoff [%lld]", (long long)T, E,
                (long long)bias.dims[0], (long long)hist.dims[0], (long long)hist.dims[1],
                (long long)out_hist.dims[0], (long long)out_hist.dims[1], (long long)bounds.dims[0],
                (long long)cut.dims[0]);
  moe_rt_context* ctx;
  moe_rt_stream stream;
  TRY(device(&fr, &ctx, &stream));
  /* The call is lowered with input_output_aliases={2: 3}, so XLA normally hands both the same buffer and the
   * counts accumulate in place; where it gives the result a buffer of its own (seen inside the while loop of a
   * sequential vmap), the old histogram is copied into it first: the result is the same. */
  if (out_hist.data != hist.data)
    CORE(moe_rt_copy_on_device(ctx, out_hist.data, hist.data, (size_t)E * (size_t)hist.dims[1] * sizeof(int32_t),
                               stream));
  CORE(moe_rt_topk_with_score_qb(ctx, logits.data, logits.dtype, T, E, topk, scale, bias.data, bounds.data,
                                 out_hist.data, (int)hist.dims[1], mode, probs.data, rmap.data, inter.data, cut.data,
                                 stream));
  return NULL;
}

/* forward: args logits [T, E] (float); rets scores [T, E] float32, the routing map ([T, E] bool or bit-packed
 * [T, ceil(E/8)] uint8), intermediate [T, E] float32. backward: args grad_scores [T, E] float32,
 * intermediate [T, E] float32; rets grad_logits [T, E] (float, the logits' dtype). attrs: topk,
 * score_function. */
static XLA_FFI_Error* aux_scores(XLA_FFI_CallFrame* f, int backward) {
  BEGIN(backward ? "moe_rt_xla_scores_for_aux_loss_backward" : "moe_rt_xla_scores_for_aux_loss");
  int topk, score;
  TRY(attr_int(&fr, "topk", &topk));
  TRY(attr_int(&fr, "score_function", &score));
  TRY(counts(&fr, backward ? 2 : 1, backward ? 1 : 3));
  buf in, inter, out, rmap; /* in: logits or grad_scores; out: scores or grad_logits */
  TRY(arg(&fr, 0, 2, &in));
  TRY(backward ? arg(&fr, 1, 2, &inter) : ret(&fr, 2, 2, &inter));
  TRY(ret(&fr, 0, 2, &out));
  if (!backward) {
    TRY(ret(&fr, 1, 2, &rmap));
    TRY(want_dtype(&fr, &out, "scores", MOE_RT_FLOAT32));
  } else {
    TRY(want_dtype(&fr, &in, "grad_scores", MOE_RT_FLOAT32));
  }
  TRY(want_dtype(&fr, &inter, "intermediate", MOE_RT_FLOAT32));
  int64_t T;
  int E;
  TRY(router_dims(&fr, &in, &T, &E));
  moe_rt_context* ctx;
  moe_rt_stream stream;
  TRY(device(&fr, &ctx, &stream));
  if (backward)
    CORE(moe_rt_scores_for_aux_loss_backward(ctx, in.data, inter.data, T, E, topk, score, out.data, out.dtype,
                                             stream));
  else
    CORE(moe_rt_scores_for_aux_loss(ctx, in.data, in.dtype, T, E, topk, score, out.data, rmap.data, rmap.dtype,
                                    inter.data, stream));
  return NULL;
}

EXPORT XLA_FFI_Error* moe_rt_xla_scores_for_aux_loss(XLA_FFI_CallFrame* f) { return aux_scores(f, 0); }
EXPORT XLA_FFI_Error* moe_rt_xla_scores_for_aux_loss_backward(XLA_FFI_CallFrame* f) { return aux_scores(f, 1); }

/* The aux loss's frame: the first argument (probs [R, C] or the loss's gradient, 0-d), tokens_per_expert
 * [C], then total_num_tokens (0-d int32/int64) when read on the device; attrs num_experts, topk, coeff,
 * total_num_tokens (the host value; 0 with the device one). */
typedef struct aux_frame {
  buf first, tpe, total;
  int has_total, E, topk;
  float coeff;
  int64_t host_total;
} aux_frame;

static XLA_FFI_Error* aux_begin(const frame* fr, int first_rank, int n_rets, aux_frame* a) {
  memset(a, 0, sizeof *a);
  TRY(attr_int(fr, "num_experts", &a->E));
  TRY(attr_int(fr, "topk", &a->topk));
  TRY(attr_f32(fr, "coeff", &a->coeff));
  TRY(attr_i64(fr, "total_num_tokens", &a->host_total));
  a->has_total = fr->f->args.size == 3;
  TRY(counts(fr, a->has_total ? 3 : 2, n_rets));
  TRY(arg(fr, 0, first_rank, &a->first));
  TRY(arg(fr, 1, 1, &a->tpe));
  if (a->has_total) TRY(arg(fr, 2, -1, &a->total));
  return NULL;
}

/* args: probs [R, C] (float), tokens_per_expert [C] (int32, int64, float32), [total_num_tokens]; rets: the
 * loss (0-d, probs' dtype), the workspace (uint8, moe_rt_aux_loss_workspace_size(R) bytes). */
EXPORT XLA_FFI_Error* moe_rt_xla_aux_loss(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_aux_loss");
  aux_frame a;
  TRY(aux_begin(&fr, 2, 2, &a));
  buf loss, ws;
  TRY(ret(&fr, 0, 0, &loss));
  TRY(ret(&fr, 1, 1, &ws));
  TRY(want_dtype(&fr, &loss, "loss", a.first.dtype));
  moe_rt_context* ctx;
  moe_rt_stream stream;
  TRY(device(&fr, &ctx, &stream));
  if (a.first.dims[1] != a.tpe.dims[0] || a.first.dims[1] > 2147483647LL)
    return fail(&fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "probs: %lld columns, tokens_per_expert %lld",
                (long long)a.first.dims[1], (long long)a.tpe.dims[0]);
  CORE(moe_rt_aux_loss(ctx, a.first.data, a.first.dtype, a.first.dims[0], (int)a.first.dims[1], a.tpe.data,
                       a.tpe.dtype, a.host_total, a.has_total ? a.total.data : NULL, a.total.dtype, a.E, a.topk,
                       a.coeff, ws.data, (size_t)ws.dims[0], loss.data, stream));
  return NULL;
}

/* args: grad_aux_loss (0-d, float), tokens_per_expert [C], [total_num_tokens]; rets: grad_probs [R, C]
 * (grad_aux_loss' dtype). */
EXPORT XLA_FFI_Error* moe_rt_xla_aux_loss_backward(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_aux_loss_backward");
  aux_frame a;
  TRY(aux_begin(&fr, 0, 1, &a));
  buf out;
  TRY(ret(&fr, 0, 2, &out));
  TRY(want_dtype(&fr, &out, "grad_probs", a.first.dtype));
  if (out.dims[1] != a.tpe.dims[0] || out.dims[1] > 2147483647LL)
    return fail(&fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "grad_probs: %lld columns, tokens_per_expert %lld",
                (long long)out.dims[1], (long long)a.tpe.dims[0]);
  moe_rt_context* ctx;
  moe_rt_stream stream;
  TRY(device(&fr, &ctx, &stream));
  CORE(moe_rt_aux_loss_backward(ctx, a.first.data, a.first.dtype, out.dims[0], (int)out.dims[1], a.tpe.data,
                                a.tpe.dtype, a.host_total, a.has_total ? a.total.data : NULL, a.total.dtype, a.E,
                                a.topk, a.coeff, out.data, stream));
  return NULL;
}

/* ---- dispatch on one GPU -------------------------------------------------------------------------- */

/* The plan over the first five arguments: dst_row [T, K], src_slot [N], seg_start [E+1], counts [E],
 * tokens_per_expert [E] (int32); attr align_size. */
static XLA_FFI_Error* plan_args(const frame* fr, moe_rt_plan* p) {
  buf b[5];
  static const char* names[5] = {"dst_row", "src_slot", "seg_start", "counts", "tokens_per_expert"};
  static const int ranks[5] = {2, 1, 1, 1, 1};
  for (int i = 0; i < 5; ++i) {
    TRY(arg(fr, i, ranks[i], &b[i]));
    TRY(want_dtype(fr, &b[i], names[i], MOE_RT_INT32));
  }
  int64_t align = 0;
  TRY(attr_i64(fr, "align_size", &align));
  memset(p, 0, sizeof *p);
  p->dst_row = b[0].data;
  p->src_slot = b[1].data;
  p->seg_start = b[2].data;
  p->counts = b[3].data;
  p->tokens_per_expert = b[4].data;
  p->num_tokens = b[0].dims[0];
  p->topk = b[0].dims[1];
  p->num_rows = b[1].dims[0];
  p->num_experts = b[3].dims[0];
  p->align_size = align;
  return NULL;
}

/* args: routing: topk_idx [T, K] int32/int64 or a routing map [T, E] bool; rets: the plan's five arrays,
 * then the workspace (uint8, moe_rt_make_plan_workspace_size bytes). attrs: num_experts, align_size,
 * num_out_tokens (-1 = keep all). */
EXPORT XLA_FFI_Error* moe_rt_xla_make_plan(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_make_plan");
  int E, A;
  int64_t num_out;
  TRY(attr_int(&fr, "num_experts", &E));
  TRY(attr_int(&fr, "align_size", &A));
  TRY(attr_i64(&fr, "num_out_tokens", &num_out));
  TRY(counts(&fr, 1, 6));
  buf routing, r[6];
  TRY(arg(&fr, 0, 2, &routing));
  for (int i = 0; i < 6; ++i) TRY(ret(&fr, i, i == 0 ? 2 : 1, &r[i]));
  moe_rt_plan p;
  memset(&p, 0, sizeof p);
  p.dst_row = r[0].data;
  p.src_slot = r[1].data;
  p.seg_start = r[2].data;
  p.counts = r[3].data;
  p.tokens_per_expert = r[4].data;
  const size_t ws_bytes = (size_t)r[5].dims[0];
  moe_rt_context* ctx;
  moe_rt_stream stream;
  TRY(device(&fr, &ctx, &stream));
  CORE(moe_rt_make_plan(ctx, routing.data, routing.dtype, routing.dims[0], routing.dims[1], E, A, num_out, &p,
                        r[5].data, ws_bytes, stream));
  return NULL;
}

/* The row ops' frame: the plan (arguments 0-4), the data argument [rows, H] (5), then the optional
 * arguments (all present or none), and the results (the first [rows, H]); with the device and stream. */
typedef struct opt_spec {
  const char* name;
  int rank;
  int dtype; /* -1: the data argument's dtype */
} opt_spec;

typedef struct rows_frame {
  moe_rt_plan plan;
  buf data, opt[2], out[2];
  int has_opt;
  moe_rt_context* ctx;
  moe_rt_stream stream;
} rows_frame;

static XLA_FFI_Error* rows_begin(const frame* fr, const opt_spec* opts, int n_opt, int n_rets, rows_frame* r) {
  memset(r, 0, sizeof *r);
  r->has_opt = fr->f->args.size == 6 + n_opt;
  TRY(counts(fr, r->has_opt ? 6 + n_opt : 6, n_rets));
  TRY(plan_args(fr, &r->plan));
  TRY(arg(fr, 5, 2, &r->data));
  for (int i = 0; r->has_opt && i < n_opt; ++i) {
    TRY(arg(fr, 6 + i, opts[i].rank, &r->opt[i]));
    TRY(want_dtype(fr, &r->opt[i], opts[i].name, opts[i].dtype < 0 ? r->data.dtype : opts[i].dtype));
  }
  for (int i = 0; i < n_rets; ++i) TRY(ret(fr, i, i == 0 ? 2 : -1, &r->out[i]));
  return device(fr, &r->ctx, &r->stream);
}

#define OPT(r, i) ((r).has_opt ? (r).opt[i].data : NULL)

/* args: the plan (5), x [T, H], then probs [T, K] float32 when present; rets: x_permuted [N, H],
 * probs_permuted [N] (float32/16, bfloat16; [0] without probs). attrs: align_size. */
EXPORT XLA_FFI_Error* moe_rt_xla_dispatch(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_dispatch");
  static const opt_spec opts[1] = {{"probs", 2, MOE_RT_FLOAT32}};
  rows_frame r;
  TRY(rows_begin(&fr, opts, 1, 2, &r));
  CORE(moe_rt_dispatch(r.ctx, &r.plan, r.data.data, r.data.dtype, r.data.dims[1], OPT(r, 0), r.out[0].data,
                       r.has_opt ? r.out[1].data : NULL, r.has_opt ? r.out[1].dtype : MOE_RT_FLOAT32, r.stream));
  return NULL;
}

/* args: the plan (5), grad_x_permuted [N, H], then grad_probs_permuted [N] float32 when present; rets:
 * grad_x [T, H], grad_probs [T, K] float32 ([0] without). attrs: align_size. */
EXPORT XLA_FFI_Error* moe_rt_xla_dispatch_backward(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_dispatch_backward");
  static const opt_spec opts[1] = {{"grad_probs_permuted", 1, MOE_RT_FLOAT32}};
  rows_frame r;
  TRY(rows_begin(&fr, opts, 1, 2, &r));
  CORE(moe_rt_dispatch_backward(r.ctx, &r.plan, r.data.data, r.data.dtype, r.data.dims[1], OPT(r, 0), r.out[0].data,
                                r.has_opt ? r.out[1].data : NULL, r.stream));
  return NULL;
}

/* args: the plan (5), y_permuted [N, H], then probs [T, K] float32 when present; rets: y [T, H].
 * attrs: align_size. */
EXPORT XLA_FFI_Error* moe_rt_xla_combine(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_combine");
  static const opt_spec opts[1] = {{"probs", 2, MOE_RT_FLOAT32}};
  rows_frame r;
  TRY(rows_begin(&fr, opts, 1, 1, &r));
  CORE(moe_rt_combine(r.ctx, &r.plan, r.data.data, r.data.dtype, r.data.dims[1], OPT(r, 0), r.out[0].data,
                      r.stream));
  return NULL;
}

/* args: the plan (5), grad_y [T, H], then y_permuted [N, H] and probs [T, K] float32 when probs were
 * given; rets: grad_y_permuted [N, H], grad_probs [T, K] float32 ([0] without). attrs: align_size. */
EXPORT XLA_FFI_Error* moe_rt_xla_combine_backward(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_combine_backward");
  static const opt_spec opts[2] = {{"y_permuted", 2, -1}, {"probs", 2, MOE_RT_FLOAT32}};
  rows_frame r;
  TRY(rows_begin(&fr, opts, 2, 2, &r));
  CORE(moe_rt_combine_backward(r.ctx, &r.plan, r.data.data, r.data.dtype, r.data.dims[1], OPT(r, 0), OPT(r, 1),
                               r.out[0].data, r.has_opt ? r.out[1].data : NULL, r.stream));
  return NULL;
}

/* ---- sort_chunks ---------------------------------------------------------------------------------- */

/* Bytes of one element of an XLA type (0 for types without a fixed size). */
static int64_t xla_size(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_PRED: case XLA_FFI_DataType_S8: case XLA_FFI_DataType_U8:
    case XLA_FFI_DataType_F8E4M3FN: case XLA_FFI_DataType_F8E5M2: return 1;
    case XLA_FFI_DataType_S16: case XLA_FFI_DataType_U16: case XLA_FFI_DataType_F16: case XLA_FFI_DataType_BF16:
      return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_U32: case XLA_FFI_DataType_F32: return 4;
    case XLA_FFI_DataType_S64: case XLA_FFI_DataType_U64: case XLA_FFI_DataType_F64: return 8;
    default: return 0;
  }
}

/* args: x [N, ...] (any type of fixed size: rows moved as bytes), split_sizes [S], sorted_indices [S] (both
 * int32 or both int64), then probs [N] float32 when present; rets: out (x's shape and type), probs_out [N]
 * float32 ([0] without probs), the workspace (uint8, moe_rt_sort_chunks_workspace_size(S) bytes). attrs:
 * backward. */
EXPORT XLA_FFI_Error* moe_rt_xla_sort_chunks(XLA_FFI_CallFrame* f) {
  BEGIN("moe_rt_xla_sort_chunks");
  int backward;
  TRY(attr_int(&fr, "backward", &backward));
  const int has_probs = fr.f->args.size == 4;
  TRY(counts(&fr, has_probs ? 4 : 3, 3));
  buf x, split, order, probs = {0}, out, pout, ws;
  TRY(arg(&fr, 0, -1, &x));
  TRY(arg(&fr, 1, 1, &split));
  TRY(arg(&fr, 2, 1, &order));
  if (has_probs) {
    TRY(arg(&fr, 3, 1, &probs));
    TRY(want_dtype(&fr, &probs, "probs", MOE_RT_FLOAT32));
  }
  TRY(ret(&fr, 0, (int)x.rank, &out));
  TRY(ret(&fr, 1, 1, &pout));
  TRY(ret(&fr, 2, 1, &ws));
  TRY(want_dtype(&fr, &order, "sorted_indices", split.dtype));
  const XLA_FFI_Buffer* xb = (const XLA_FFI_Buffer*)fr.f->args.args[0];
  const int64_t isz = xla_size(xb->dtype);
  if (x.rank < 1 || isz == 0)
    return fail(&fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "x: expected at least 1 dimension and a type of fixed "
                "size, got rank %lld, XLA type %d", (long long)x.rank, (int)xb->dtype);
  int64_t row_bytes = isz;
  for (int64_t i = 1; i < x.rank; ++i) row_bytes *= x.dims[i];
  moe_rt_context* ctx;
  moe_rt_stream stream;
  TRY(device(&fr, &ctx, &stream));
  CORE(moe_rt_sort_chunks(ctx, x.data, x.dims[0], row_bytes, split.data, order.data, split.dtype, split.dims[0],
                          has_probs ? probs.data : NULL, out.data, has_probs ? pout.data : NULL, backward, ws.data,
                          (size_t)ws.dims[0], stream));
  return NULL;
}

/* ---- FP8 block casts ------------------------------------------------------------------------------ */

/* quantize: args x [T, H] (float); rets x_fp8 [T, H] float8_e4m3fn, scales [T, ceil(H/block)] float32.
 * dequantize: args x_fp8, scales; rets y [T, H] (float). attrs: block. */
static XLA_FFI_Error* fp8_cast(XLA_FFI_CallFrame* f, int quantize) {
  BEGIN(quantize ? "moe_rt_xla_quantize_fp8" : "moe_rt_xla_dequantize_fp8");
  int block;
  TRY(attr_int(&fr, "block", &block));
  TRY(counts(&fr, quantize ? 1 : 2, quantize ? 2 : 1));
  buf x, q, s; /* x: the float side (the input, or the result y) */
  if (quantize) {
    TRY(arg(&fr, 0, 2, &x));
    TRY(ret(&fr, 0, 2, &q));
    TRY(ret(&fr, 1, 2, &s));
  } else {
    TRY(arg(&fr, 0, 2, &q));
    TRY(arg(&fr, 1, 2, &s));
    TRY(ret(&fr, 0, 2, &x));
  }
  TRY(want_dtype(&fr, &q, "x_fp8", MOE_RT_FLOAT8_E4M3));
  TRY(want_dtype(&fr, &s, "scales", MOE_RT_FLOAT32));
  moe_rt_context* ctx;
  moe_rt_stream stream;
  TRY(device(&fr, &ctx, &stream));
  if (quantize) CORE(moe_rt_quantize_fp8(ctx, x.data, x.dtype, x.dims[0], x.dims[1], block, q.data, s.data, stream));
  else CORE(moe_rt_dequantize_fp8(ctx, q.data, s.data, q.dims[0], q.dims[1], block, x.data, x.dtype, stream));
  return NULL;
}

EXPORT XLA_FFI_Error* moe_rt_xla_quantize_fp8(XLA_FFI_CallFrame* f) { return fp8_cast(f, 1); }
EXPORT XLA_FFI_Error* moe_rt_xla_dequantize_fp8(XLA_FFI_CallFrame* f) { return fp8_cast(f, 0); }

/* ---- low-latency expert parallelism (moe_rt.jax ll_dispatch / ll_combine and their VJPs) ------------------
 *
 * The group is moe_rt.LowLatencyGroup's core group (moe_rt_ll_group, made by the Python side on the group's
 * device context with its kernels loaded when the op was traced): attributes `group` (its address), and
 * `group_serial` (moe_rt_ll_group_serial) name it and are checked against the core's registry of live groups,
 * which holds it for the call (a closed group fails with the core's message; a freed one is never reached);
 * `device` is the CUDA ordinal the group lives on. Sizes come from the group (R ranks, L local experts, Tmax,
 * K, H, its dtype) and the buffers (T tokens); buffer set 0 (moe_rt.jax takes groups with one set). The
 * handle's six tables are XLA's buffers: results of dispatch (the core writes them), arguments of the others.
 * The receive rows the group's ops leave in its receive buffer reach XLA's result through
 * moe_rt_copy_kept_rows (valid slots read, the others zero where asked) on the same stream. */

typedef struct ll_frame {
  moe_rt_ll_group* g;
  moe_rt_ll_group_desc d;
  int64_t slots; /* L*R*Tmax rows of the receive buffer */
  moe_rt_context* ctx; /* XLA's context of the device (the copy; set by the body, after its checks) */
  moe_rt_stream stream;
} ll_frame;

static XLA_FFI_Error* want(const frame* fr, const buf* b, const char* name, int dtype, int rank, int64_t d0,
                           int64_t d1, int64_t d2) {
  const int64_t want_dims[3] = {d0, d1, d2};
  int ok = b->rank == rank && (dtype < 0 || b->dtype == dtype);
  for (int i = 0; ok && i < rank; ++i) ok = b->dims[i] == want_dims[i];
  if (ok) return NULL;
  char got[96] = "", exp[96] = "";
  int n = 0, m = 0;
  for (int i = 0; i < b->rank && i < 4 && n < (int)sizeof got; ++i)
    n += snprintf(got + n, sizeof got - (size_t)n, "%s%lld", i ? ", " : "", (long long)b->dims[i]);
  for (int i = 0; i < rank && m < (int)sizeof exp; ++i)
    m += snprintf(exp + m, sizeof exp - (size_t)m, "%s%lld", i ? ", " : "", (long long)want_dims[i]);
  return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "%s: expected shape [%s] of dtype code %d, got [%s]%s of "
              "dtype code %d", name, exp, dtype < 0 ? b->dtype : dtype, got, b->rank > 4 ? "..." : "", b->dtype);
}

/* The handle's six tables at argument (rets = 0) or result (rets = 1) positions first .. first+5, for T tokens:
 * idx [T, K] int32, w [T, K] float32, route [R, Tmax, K] int32, slot_topk [L, R*Tmax] int32, slot_weights
 * [L, R*Tmax] float32, counts [L] int32. */
static XLA_FFI_Error* ll_tables(const frame* fr, const ll_frame* l, int rets, int64_t first, int64_t T,
                                moe_rt_ll_tables* t) {
  static const char* names[6] = {"topk_idx", "topk_weights", "route", "slot_topk", "slot_weights", "counts"};
  const moe_rt_ll_group_desc* d = &l->d;
  const int64_t K = d->topk, R = d->num_ranks, L = d->num_local_experts, Tmax = d->max_tokens_per_rank;
  const int dt[6] = {MOE_RT_INT32, MOE_RT_FLOAT32, MOE_RT_INT32, MOE_RT_INT32, MOE_RT_FLOAT32, MOE_RT_INT32};
  const int rank[6] = {2, 2, 3, 2, 2, 1};
  const int64_t dims[6][3] = {{T, K, 0}, {T, K, 0}, {R, Tmax, K}, {L, R * Tmax, 0}, {L, R * Tmax, 0}, {L, 0, 0}};
  void* p[6];
  for (int i = 0; i < 6; ++i) {
    buf b;
    TRY(rets ? ret(fr, first + i, -1, &b) : arg(fr, first + i, -1, &b));
    TRY(want(fr, &b, names[i], dt[i], rank[i], dims[i][0], dims[i][1], dims[i][2]));
    p[i] = b.data;
  }
  t->idx = p[0];
  t->w = p[1];
  t->route = p[2];
  t->slot_k = p[3];
  t->slot_w = p[4];
  t->counts = p[5];
  return NULL;
}

/* Rows of the receive buffer's layout [L, R*Tmax, H] in the group's dtype. */
static XLA_FFI_Error* ll_slots(const frame* fr, const ll_frame* l, const buf* b, const char* name) {
  return want(fr, b, name, l->d.dtype, 3, l->d.num_local_experts,
              (int64_t)l->d.num_ranks * l->d.max_tokens_per_rank, l->d.hidden);
}

/* The group's receive rows into XLA's `out` [L, R*Tmax, H]: valid slots (slot_k >= 0) copied, the rest zero
 * when `zero`. */
static moe_rt_status ll_copy_rows(const ll_frame* l, void* out, const int32_t* slot_k, int zero) {
  const int64_t row_bytes = l->d.hidden * (l->d.dtype == MOE_RT_FLOAT32 ? 4 : 2);
  return moe_rt_copy_kept_rows(l->ctx, l->d.set[0].recv, out, slot_k, l->slots, row_bytes, zero, l->stream);
}

typedef XLA_FFI_Error* (*ll_body)(const frame* fr, ll_frame* l);

/* Decode the group's attributes, hold the group for the call, check the device, run `body`, release. Not
 * command-buffer compatible: a replayed command buffer would run the group's launches without this check,
 * reaching the group's buffers after LowLatencyGroup.close freed them. */
static XLA_FFI_Error* ll_call(XLA_FFI_CallFrame* f, const char* op, ll_body body) {
  BEGIN_TRAITS(op, 0);
  int64_t address = 0, serial = 0;
  int want_device = 0, ordinal = -1;
  TRY(attr_i64(&fr, "group", &address));
  TRY(attr_i64(&fr, "group_serial", &serial));
  TRY(attr_int(&fr, "device", &want_device));
  TRY(ordinal_of(&fr, &ordinal));
  if (ordinal != want_device)
    return fail(&fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "the low-latency group lives on cuda:%d, but XLA runs "
                "this call on cuda:%d", want_device, ordinal);
  ll_frame l;
  memset(&l, 0, sizeof l);
  CORE(moe_rt_ll_group_acquire(address, serial, &l.g));
  XLA_FFI_Error* err = NULL;
  moe_rt_status st = moe_rt_ll_group_get_desc(l.g, &l.d);
  if (st) err = fail_core(&fr, st, moe_rt_last_error());
  if (!err) {
    l.slots = (int64_t)l.d.num_local_experts * l.d.num_ranks * l.d.max_tokens_per_rank;
    err = body(&fr, &l);
  }
  moe_rt_ll_group_release(l.g);
  return err;
}

#define LL_CORE(call)                                                \
  do {                                                               \
    moe_rt_status st_ = (call);                                      \
    if (st_) return fail_core(fr, st_, moe_rt_last_error());         \
  } while (0)

/* args: x [T, H] (the group's dtype), topk_idx [T, K] int32/int64, topk_weights [T, K] float32; rets: recv_x
 * [L, R*Tmax, H], then the handle's six tables. attrs: the group's (above), zero_empty_slots, fp8
 * (1: FP8 rows on the wire, quantized in the push and dequantized into the receive buffer: a group made with
 * fp8=1). */
static XLA_FFI_Error* ll_dispatch_body(const frame* fr, ll_frame* l) {
  int zero = 0, fp8 = 0;
  TRY(attr_int(fr, "zero_empty_slots", &zero));
  TRY(attr_int(fr, "fp8", &fp8));
  if (fp8 != 0 && fp8 != 1)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "attribute fp8: expected 0 or 1, got %d", fp8);
  TRY(counts(fr, 3, 7));
  buf x, idx, w, recv;
  TRY(arg(fr, 1, 2, &idx));
  const int64_t T = idx.dims[0], K = l->d.topk, H = l->d.hidden;
  if (idx.dtype != MOE_RT_INT32 && idx.dtype != MOE_RT_INT64)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "topk_idx: expected int32 or int64, got dtype code %d",
                idx.dtype);
  TRY(want(fr, &idx, "topk_idx", idx.dtype, 2, T, K, 0));
  TRY(arg(fr, 0, -1, &x));
  TRY(want(fr, &x, "x", l->d.dtype, 2, T, H, 0));
  TRY(arg(fr, 2, -1, &w));
  TRY(want(fr, &w, "topk_weights", MOE_RT_FLOAT32, 2, T, K, 0));
  TRY(ret(fr, 0, -1, &recv));
  TRY(ll_slots(fr, l, &recv, "recv_x"));
  moe_rt_ll_tables t;
  TRY(ll_tables(fr, l, 1, 1, T, &t));
  TRY(device(fr, &l->ctx, &l->stream));
  LL_CORE(moe_rt_ll_dispatch(l->g, 0, MOE_RT_LL_PUSH | MOE_RT_LL_RECEIVE, x.data, NULL, NULL, fp8 != 0, fp8 != 0,
                             idx.data, idx.dtype, w.data, T, &t, l->stream));
  LL_CORE(ll_copy_rows(l, recv.data, t.slot_k, zero != 0));
  return NULL;
}

/* args: expert_out [L, R*Tmax, H], the handle's six tables; rets: out [T, H]. attrs: the group's. */
static XLA_FFI_Error* ll_combine_body(const frame* fr, ll_frame* l) {
  TRY(counts(fr, 7, 1));
  buf y, idx, out;
  TRY(arg(fr, 1, 2, &idx));
  const int64_t T = idx.dims[0];
  TRY(arg(fr, 0, -1, &y));
  TRY(ll_slots(fr, l, &y, "expert_out"));
  moe_rt_ll_tables t;
  TRY(ll_tables(fr, l, 0, 1, T, &t));
  TRY(ret(fr, 0, -1, &out));
  TRY(want(fr, &out, "out", l->d.dtype, 2, T, l->d.hidden, 0));
  TRY(device(fr, &l->ctx, &l->stream));
  LL_CORE(moe_rt_ll_combine(l->g, 0, MOE_RT_EP_OP_COMBINE, y.data, NULL, &t, T, out.data, NULL, l->stream));
  return NULL;
}

/* VJP of dispatch. args: grad_recv_x [L, R*Tmax, H], grad_slot_weights [L, R*Tmax] float32, the handle's six
 * tables; rets: grad_x [T, H], grad_topk_weights [T, K] float32. attrs: the group's. */
static XLA_FFI_Error* ll_dispatch_bwd_body(const frame* fr, ll_frame* l) {
  TRY(counts(fr, 8, 2));
  buf g, gsw, idx, gx, gw;
  TRY(arg(fr, 2, 2, &idx));
  const int64_t T = idx.dims[0];
  TRY(arg(fr, 0, -1, &g));
  TRY(ll_slots(fr, l, &g, "grad_recv_x"));
  TRY(arg(fr, 1, -1, &gsw));
  TRY(want(fr, &gsw, "grad_slot_weights", MOE_RT_FLOAT32, 2, l->d.num_local_experts,
           (int64_t)l->d.num_ranks * l->d.max_tokens_per_rank, 0));
  moe_rt_ll_tables t;
  TRY(ll_tables(fr, l, 0, 2, T, &t));
  TRY(ret(fr, 0, -1, &gx));
  TRY(want(fr, &gx, "grad_x", l->d.dtype, 2, T, l->d.hidden, 0));
  TRY(ret(fr, 1, -1, &gw));
  TRY(want(fr, &gw, "grad_topk_weights", MOE_RT_FLOAT32, 2, T, l->d.topk, 0));
  TRY(device(fr, &l->ctx, &l->stream));
  LL_CORE(moe_rt_ll_combine(l->g, 0, MOE_RT_EP_OP_DISPATCH_BWD, g.data, gsw.data, &t, T, gx.data, gw.data,
                            l->stream));
  return NULL;
}

/* VJP of combine. args: grad_out [T, H], expert_out [L, R*Tmax, H] (the forward's), the handle's six tables;
 * rets: grad_expert_out [L, R*Tmax, H] (zero at empty slots), grad_topk_weights [T, K] float32, dots
 * [L*R*Tmax] float32 (scratch: the per-slot dot products). attrs: the group's. */
static XLA_FFI_Error* ll_combine_bwd_body(const frame* fr, ll_frame* l) {
  TRY(counts(fr, 8, 3));
  buf g, y, idx, gy, gw, dots;
  TRY(arg(fr, 2, 2, &idx));
  const int64_t T = idx.dims[0];
  TRY(arg(fr, 0, -1, &g));
  TRY(want(fr, &g, "grad_out", l->d.dtype, 2, T, l->d.hidden, 0));
  TRY(arg(fr, 1, -1, &y));
  TRY(ll_slots(fr, l, &y, "expert_out"));
  moe_rt_ll_tables t;
  TRY(ll_tables(fr, l, 0, 2, T, &t));
  TRY(ret(fr, 0, -1, &gy));
  TRY(ll_slots(fr, l, &gy, "grad_expert_out"));
  TRY(ret(fr, 1, -1, &gw));
  TRY(want(fr, &gw, "grad_topk_weights", MOE_RT_FLOAT32, 2, T, l->d.topk, 0));
  TRY(ret(fr, 2, -1, &dots));
  TRY(want(fr, &dots, "dots", MOE_RT_FLOAT32, 1, l->slots, 0, 0));
  TRY(device(fr, &l->ctx, &l->stream));
  /* the rows (scaled by the slot weights) into the receive buffer, and the dots; then the weight gradient
   * (the dots gathered back to [T, K]); then the rows into XLA's result, zero at empty slots */
  LL_CORE(moe_rt_ll_combine_bwd(l->g, 0, g.data, y.data, &t, T, dots.data, l->stream));
  LL_CORE(moe_rt_ll_combine(l->g, 0, MOE_RT_EP_OP_COMBINE_BWD, NULL, dots.data, &t, T, NULL, gw.data, l->stream));
  LL_CORE(ll_copy_rows(l, gy.data, t.slot_k, 1));
  return NULL;
}

EXPORT XLA_FFI_Error* moe_rt_xla_ll_dispatch(XLA_FFI_CallFrame* f) {
  return ll_call(f, "moe_rt_xla_ll_dispatch", ll_dispatch_body);
}
EXPORT XLA_FFI_Error* moe_rt_xla_ll_combine(XLA_FFI_CallFrame* f) {
  return ll_call(f, "moe_rt_xla_ll_combine", ll_combine_body);
}
EXPORT XLA_FFI_Error* moe_rt_xla_ll_dispatch_bwd(XLA_FFI_CallFrame* f) {
  return ll_call(f, "moe_rt_xla_ll_dispatch_bwd", ll_dispatch_bwd_body);
}
EXPORT XLA_FFI_Error* moe_rt_xla_ll_combine_bwd(XLA_FFI_CallFrame* f) {
  return ll_call(f, "moe_rt_xla_ll_combine_bwd", ll_combine_bwd_body);
}

/* ---- expert parallelism, capacity mode on the direct transport (moe_rt.jax ep_prepare / ep_dispatch /
 * ep_combine and their VJPs) ------------------------------------------------------------------------------
 *
 * The group is moe_rt.EpGroup's direct transport's core group (moe_rt_ep_direct_group, on the group's device
 * context, its stage pairs and kernels made when the op was lowered): attributes `group` and `group_serial`
 * name it, checked against the core's registry of live direct groups, which holds it for the call (a closed
 * group fails with the core's message); `device` is its CUDA ordinal. The handle is XLA's uint8 buffer (the
 * layout of moe_rt_ep_handle_layout over the attributes' sizes: ranks from the group, num_local_experts,
 * max_tokens_per_rank, topk, pair_capacity, recv_rows, num_rows; num_tokens T). The launches are the core's,
 * on the group's context and XLA's stream. Not command-buffer compatible, for ll_call's reason: a replay
 * would reach the transport's buffers without the registry's check, after EpGroup.close freed them. */

typedef struct ep_frame {
  moe_rt_ep_direct_group* g;
  moe_rt_ep_direct_group_desc d;
  moe_rt_context* ctx; /* the group's */
  moe_rt_stream stream;
  moe_rt_ep_direct_handle h;
  int align; /* the group's align_size */
} ep_frame;

/* Bytes of a float row element (the EP ops move fp32, fp16 and bf16 rows); 0 for other dtypes. */
static int64_t ep_float_size(int dtype) {
  return dtype == MOE_RT_FLOAT32 ? 4 : (dtype == MOE_RT_FLOAT16 || dtype == MOE_RT_BFLOAT16) ? 2 : 0;
}

static XLA_FFI_Error* ep_rows(const frame* fr, const buf* b, const char* name, int64_t* rb) {
  *rb = b->rank == 2 ? b->dims[1] * ep_float_size(b->dtype) : 0;
  if (b->rank != 2 || !ep_float_size(b->dtype))
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "%s: expected a float32, float16 or bfloat16 array [rows, "
                "H], got rank %lld of dtype code %d", name, (long long)b->rank, b->dtype);
  return NULL;
}

typedef XLA_FFI_Error* (*ep_body)(const frame* fr, ep_frame* e);

static XLA_FFI_Error* ep_call(XLA_FFI_CallFrame* f, const char* op, ep_body body) {
  BEGIN_TRAITS(op, 0);
  int64_t address = 0, serial = 0, T = 0, rows = 0, N = 0;
  int want_device = 0, ordinal = -1, L = 0, Tmax = 0, K = 0, P = 0, A = 0;
  TRY(attr_i64(&fr, "group", &address));
  TRY(attr_i64(&fr, "group_serial", &serial));
  TRY(attr_int(&fr, "device", &want_device));
  TRY(attr_int(&fr, "num_local_experts", &L));
  TRY(attr_int(&fr, "max_tokens_per_rank", &Tmax));
  TRY(attr_int(&fr, "topk", &K));
  TRY(attr_int(&fr, "pair_capacity", &P));
  TRY(attr_int(&fr, "align_size", &A));
  TRY(attr_i64(&fr, "num_tokens", &T));
  TRY(attr_i64(&fr, "recv_rows", &rows));
  TRY(attr_i64(&fr, "num_rows", &N));
  TRY(ordinal_of(&fr, &ordinal));
  if (ordinal != want_device)
    return fail(&fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "the EP group lives on cuda:%d, but XLA runs this call "
                "on cuda:%d", want_device, ordinal);
  XLA_FFI_Stream_Get_Args sa;
  memset(&sa, 0, sizeof sa);
  sa.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  sa.ctx = fr.f->ctx;
  TRY(fr.api->XLA_FFI_Stream_Get(&sa));
  ep_frame e;
  memset(&e, 0, sizeof e);
  e.stream = (moe_rt_stream)sa.stream;
  e.align = A;
  CORE(moe_rt_ep_direct_group_acquire(address, serial, &e.g));
  XLA_FFI_Error* err = NULL;
  moe_rt_status st = moe_rt_ep_direct_group_get_desc(e.g, &e.d, &e.ctx);
  if (st) err = fail_core(&fr, st, moe_rt_last_error());
  if (!err && (P != e.d.pair_rows || rows != (int64_t)e.d.num_ranks * P || T < 0 || T > Tmax))
    err = fail(&fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "attributes pair_capacity=%d, recv_rows=%lld, "
               "num_tokens=%lld do not fit the group (%d ranks, pair capacity %d, max_tokens_per_rank %d)", P,
               (long long)rows, (long long)T, e.d.num_ranks, e.d.pair_rows, Tmax);
  if (!err) {
    moe_rt_ep_handle_desc* hd = &e.h.desc;
    hd->num_ranks = e.d.num_ranks;
    hd->num_local_experts = L;
    hd->max_tokens_per_rank = Tmax;
    hd->topk = K;
    hd->pair_capacity = P;
    hd->recv_rows = rows;
    hd->num_rows = N;
    moe_rt_ep_handle_layout(hd);
    e.h.num_tokens = T;
    e.h.exact = 0;
    err = body(&fr, &e);
  }
  moe_rt_ep_direct_group_release(e.g);
  return err;
}

/* The handle buffer at argument (rets = 0) or result (rets = 1) i: uint8 [total_bytes]. */
static XLA_FFI_Error* ep_handle_buf(const frame* fr, ep_frame* e, int rets, int64_t i, void** out) {
  buf b;
  TRY(rets ? ret(fr, i, -1, &b) : arg(fr, i, -1, &b));
  TRY(want(fr, &b, "handle", MOE_RT_UINT8, 1, (int64_t)e->h.desc.total_bytes, 0, 0));
  *out = b.data;
  return NULL;
}

static void* ep_region(const ep_frame* e, int region) {
  return (char*)e->h.buffer + e->h.desc.offset[region];
}

/* args: topk_idx [T, K] int32/int64; rets: handle, tokens_per_expert [L] int32, work int32 (scratch: the send
 * side's chunk counts, then the plan kernels' workspace where the received side is not one kernel). attrs:
 * the group's (above), rank, num_experts, align_size, capacity, and prepare's buffers as addresses (grid_sync,
 * error_word, state, peer_box, inbox, timeout_ns; the transport's, alive while the core group is). */
static XLA_FFI_Error* ep_prepare_body(const frame* fr, ep_frame* e) {
  int rank, E;
  int64_t cap, gs, ew, state, box, inbox, timeout;
  TRY(attr_int(fr, "rank", &rank));
  TRY(attr_int(fr, "num_experts", &E));
  TRY(attr_i64(fr, "capacity", &cap));
  TRY(attr_i64(fr, "grid_sync", &gs));
  TRY(attr_i64(fr, "error_word", &ew));
  TRY(attr_i64(fr, "state", &state));
  TRY(attr_i64(fr, "peer_box", &box));
  TRY(attr_i64(fr, "inbox", &inbox));
  TRY(attr_i64(fr, "timeout_ns", &timeout));
  TRY(counts(fr, 1, 3));
  buf idx, tpe, work;
  TRY(arg(fr, 0, -1, &idx));
  if (idx.dtype != MOE_RT_INT32 && idx.dtype != MOE_RT_INT64)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "topk_idx: expected int32 or int64, got dtype code %d",
                idx.dtype);
  TRY(want(fr, &idx, "topk_idx", idx.dtype, 2, e->h.num_tokens, e->h.desc.topk, 0));
  TRY(ep_handle_buf(fr, e, 1, 0, &e->h.buffer));
  TRY(ret(fr, 1, -1, &tpe));
  TRY(want(fr, &tpe, "tokens_per_expert", MOE_RT_INT32, 1, e->h.desc.num_local_experts, 0, 0));
  TRY(ret(fr, 2, 1, &work));
  moe_rt_ep_prepare_desc pd;
  memset(&pd, 0, sizeof pd);
  pd.handle = e->h.desc;
  pd.rank = rank;
  pd.num_experts = E;
  pd.align_size = e->align;
  pd.idx_dtype = idx.dtype;
  pd.direct = 1;
  pd.num_tokens = e->h.num_tokens;
  pd.capacity = cap;
  moe_rt_ep_prepare_sizes sz;
  LL_CORE(moe_rt_ep_prepare_sizes_of(&pd, &sz));
  size_t ws_bytes = 0;
  if (!sz.fused) LL_CORE(moe_rt_make_plan_workspace_size(pd.handle.recv_rows, pd.handle.topk,
                                                         pd.handle.num_local_experts, &ws_bytes));
  const int64_t words = sz.part_words + (int64_t)((ws_bytes + 3) / 4);
  if (work.dtype != MOE_RT_INT32 || work.dims[0] < words)
    return fail(fr, XLA_FFI_Error_Code_INVALID_ARGUMENT, "work: expected int32 [>= %lld], got dtype code %d [%lld]",
                (long long)words, work.dtype, (long long)work.dims[0]);
  moe_rt_ep_prepare_buffers b;
  memset(&b, 0, sizeof b);
  b.handle = e->h.buffer;
  b.topk_idx = e->h.num_tokens ? idx.data : NULL;
  b.part = (int32_t*)work.data;
  b.grid_sync = (uint32_t*)(uintptr_t)gs;
  b.error_word = (uint32_t*)(uintptr_t)ew;
  b.state = (uint32_t*)(uintptr_t)state;
  b.peer_box = (const int64_t*)(uintptr_t)box;
  b.inbox = (int32_t*)(uintptr_t)inbox;
  b.peer_barrier = e->d.peer_barrier;
  b.timeout_ns = timeout;
  b.timeout_word = e->d.timeout_word;
  b.workspace = (int32_t*)work.data + sz.part_words; /* as EpGroup._prepare_cuda: after the chunk counts */
  b.workspace_bytes = ws_bytes;
  LL_CORE(moe_rt_ep_prepare_send(e->ctx, &pd, &b, e->stream));
  if (!sz.whole) {
    LL_CORE(moe_rt_ep_direct_barrier(e->g, MOE_RT_EP_OP_PREPARE, e->stream));
    LL_CORE(moe_rt_ep_prepare_recv(e->ctx, &pd, &b, e->stream));
  }
  LL_CORE(moe_rt_copy_on_device(e->ctx, tpe.data, ep_region(e, MOE_RT_EP_TOKENS_PER_EXPERT),
                                4 * (size_t)e->h.desc.num_local_experts, e->stream));
  return NULL;
}

/* args: handle, x [T, H] (float), then topk_weights [T, K] float32 when has_weights; rets: recv_x [N, H],
 * recv_weights [N] float32 ([0] without weights), the handle's copy (uint8; [0] without weights: dispatch
 * writes the received weights into a handle, here a copy, XLA's argument staying as it is). attrs: the group's,
 * has_weights, zero_empty_slots. */
static XLA_FFI_Error* ep_dispatch_body(const frame* fr, ep_frame* e) {
  int has_w, zero;
  TRY(attr_int(fr, "has_weights", &has_w));
  TRY(attr_int(fr, "zero_empty_slots", &zero));
  TRY(counts(fr, has_w ? 3 : 2, 3));
  void* hin;
  TRY(ep_handle_buf(fr, e, 0, 0, &hin));
  buf x, w = {0}, rx, rw, hcopy;
  TRY(arg(fr, 1, 2, &x));
  int64_t rb;
  TRY(ep_rows(fr, &x, "x", &rb));
  const int64_t T = e->h.num_tokens, N = e->h.desc.num_rows, H = x.dims[1];
  TRY(want(fr, &x, "x", x.dtype, 2, T, H, 0));
  if (has_w) {
    TRY(arg(fr, 2, -1, &w));
    TRY(want(fr, &w, "topk_weights", MOE_RT_FLOAT32, 2, T, e->h.desc.topk, 0));
  }
  TRY(ret(fr, 0, -1, &rx));
  TRY(want(fr, &rx, "recv_x", x.dtype, 2, N, H, 0));
  TRY(ret(fr, 1, -1, &rw));
  TRY(want(fr, &rw, "recv_weights", MOE_RT_FLOAT32, 1, has_w ? N : 0, 0, 0));
  TRY(ret(fr, 2, -1, &hcopy));
  e->h.buffer = hin;
  if (has_w) {
    TRY(ep_handle_buf(fr, e, 1, 2, &e->h.buffer));
    LL_CORE(moe_rt_copy_on_device(e->ctx, e->h.buffer, hin, e->h.desc.total_bytes, e->stream));
  } else {
    TRY(want(fr, &hcopy, "handle copy", MOE_RT_UINT8, 1, 0, 0, 0));
  }
  moe_rt_ep_direct_outputs o;
  memset(&o, 0, sizeof o);
  o.out = rx.data;
  o.out_w = has_w ? (float*)rw.data : NULL;
  o.fill = 1;
  o.zero = zero != 0;
  o.with_w = has_w != 0;
  LL_CORE(moe_rt_ep_direct_dispatch(e->g, MOE_RT_EP_OP_DISPATCH, &e->h, x.data, rb, has_w ? w.data : NULL, &o, 1,
                                    e->stream));
  return NULL;
}

/* args: handle, y [N, H] (float), then slot weights [rows, K] float32 when has_weights (recv_weights laid out on
 * the slots by moe_rt.jax); rets: out [T, H]. attrs: the group's, has_weights. */
static XLA_FFI_Error* ep_combine_body(const frame* fr, ep_frame* e) {
  int has_w;
  TRY(attr_int(fr, "has_weights", &has_w));
  TRY(counts(fr, has_w ? 3 : 2, 1));
  TRY(ep_handle_buf(fr, e, 0, 0, &e->h.buffer));
  buf y, w = {0}, out;
  TRY(arg(fr, 1, 2, &y));
  int64_t rb;
  TRY(ep_rows(fr, &y, "y", &rb));
  const int64_t H = y.dims[1];
  TRY(want(fr, &y, "y", y.dtype, 2, e->h.desc.num_rows, H, 0));
  if (has_w) {
    TRY(arg(fr, 2, -1, &w));
    TRY(want(fr, &w, "slot_weights", MOE_RT_FLOAT32, 2, e->h.desc.recv_rows, e->h.desc.topk, 0));
  }
  TRY(ret(fr, 0, -1, &out));
  TRY(want(fr, &out, "out", y.dtype, 2, e->h.num_tokens, H, 0));
  LL_CORE(moe_rt_ep_direct_combine(e->g, MOE_RT_EP_OP_COMBINE, &e->h, y.data, y.dtype, H, has_w ? w.data : NULL,
                                   NULL, NULL, out.data, NULL, 1, e->stream));
  return NULL;
}

/* VJP of dispatch. args: handle, grad_recv_x [N, H], then grad_recv_w [N] float32 when has_weights; rets:
 * grad_x [T, H], grad_topk_weights [T, K] float32 ([0] without), slot_grads [rows*K] float32 (scratch; [0]
 * without). attrs: the group's, has_weights. */
static XLA_FFI_Error* ep_dispatch_bwd_body(const frame* fr, ep_frame* e) {
  int has_w;
  TRY(attr_int(fr, "has_weights", &has_w));
  TRY(counts(fr, has_w ? 3 : 2, 3));
  TRY(ep_handle_buf(fr, e, 0, 0, &e->h.buffer));
  const int64_t T = e->h.num_tokens, N = e->h.desc.num_rows, K = e->h.desc.topk;
  buf g, gw = {0}, gx, gwt, sg;
  TRY(arg(fr, 1, 2, &g));
  int64_t rb;
  TRY(ep_rows(fr, &g, "grad_recv_x", &rb));
  const int64_t H = g.dims[1];
  TRY(want(fr, &g, "grad_recv_x", g.dtype, 2, N, H, 0));
  if (has_w) {
    TRY(arg(fr, 2, -1, &gw));
    TRY(want(fr, &gw, "grad_recv_w", MOE_RT_FLOAT32, 1, N, 0, 0));
  }
  TRY(ret(fr, 0, -1, &gx));
  TRY(want(fr, &gx, "grad_x", g.dtype, 2, T, H, 0));
  TRY(ret(fr, 1, -1, &gwt));
  TRY(ret(fr, 2, -1, &sg));
  if (has_w) {
    TRY(want(fr, &gwt, "grad_topk_weights", MOE_RT_FLOAT32, 2, T, K, 0));
    TRY(want(fr, &sg, "slot_grads", MOE_RT_FLOAT32, 1, e->h.desc.recv_rows * K, 0, 0));
  }
  LL_CORE(moe_rt_ep_direct_combine(e->g, MOE_RT_EP_OP_DISPATCH_BWD, &e->h, g.data, g.dtype, H, NULL,
                                   has_w ? gw.data : NULL, has_w ? sg.data : NULL, gx.data,
                                   has_w ? gwt.data : NULL, 1, e->stream));
  return NULL;
}

/* VJP of combine. Unweighted: args handle, grad_out [T, H]; rets grad_y [N, H] (the dispatch direction, zero
 * padding rows). Weighted: args handle, grad_out, y [N, H], slot weights [rows, K] float32; rets grad_y [N, H],
 * grad_slot [rows, K] float32 (the per-slot dots; moe_rt.jax gathers them to the rows): the rows land in the
 * stage (ep_direct_dispatch without outputs), then the permutation family's combine_backward over the handle's
 * plan on XLA's context. attrs: the group's, has_weights. */
static XLA_FFI_Error* ep_combine_bwd_body(const frame* fr, ep_frame* e) {
  int has_w;
  TRY(attr_int(fr, "has_weights", &has_w));
  TRY(counts(fr, has_w ? 4 : 2, has_w ? 2 : 1));
  TRY(ep_handle_buf(fr, e, 0, 0, &e->h.buffer));
  const int64_t T = e->h.num_tokens, N = e->h.desc.num_rows, K = e->h.desc.topk, rows = e->h.desc.recv_rows;
  buf g, y, w, gy, gp;
  TRY(arg(fr, 1, 2, &g));
  int64_t rb;
  TRY(ep_rows(fr, &g, "grad_out", &rb));
  const int64_t H = g.dims[1];
  TRY(want(fr, &g, "grad_out", g.dtype, 2, T, H, 0));
  TRY(ret(fr, 0, -1, &gy));
  TRY(want(fr, &gy, "grad_y", g.dtype, 2, N, H, 0));
  moe_rt_ep_direct_outputs o; /* as DirectTransport.push: zero set, the rest only with outputs */
  memset(&o, 0, sizeof o);
  o.zero = 1;
  if (!has_w) {
    o.out = gy.data;
    o.fill = 1;
    LL_CORE(moe_rt_ep_direct_dispatch(e->g, MOE_RT_EP_OP_COMBINE_BWD, &e->h, g.data, rb, NULL, &o, 1, e->stream));
    return NULL;
  }
  TRY(arg(fr, 2, -1, &y));
  TRY(want(fr, &y, "y", g.dtype, 2, N, H, 0));
  TRY(arg(fr, 3, -1, &w));
  TRY(want(fr, &w, "slot_weights", MOE_RT_FLOAT32, 2, rows, K, 0));
  TRY(ret(fr, 1, -1, &gp));
  TRY(want(fr, &gp, "grad_slot", MOE_RT_FLOAT32, 2, rows, K, 0));
  moe_rt_ep_direct_stage stage;
  LL_CORE(moe_rt_ep_direct_get_stage(e->g, rb, (int)K, &stage));
  LL_CORE(moe_rt_ep_direct_dispatch(e->g, MOE_RT_EP_OP_COMBINE_BWD, &e->h, g.data, rb, NULL, &o, 1, e->stream));
  moe_rt_context* xctx;
  moe_rt_stream xs;
  TRY(device(fr, &xctx, &xs));
  moe_rt_plan plan;
  memset(&plan, 0, sizeof plan);
  plan.dst_row = ep_region(e, MOE_RT_EP_DST_ROW);
  plan.src_slot = ep_region(e, MOE_RT_EP_SRC_SLOT);
  plan.seg_start = ep_region(e, MOE_RT_EP_SEG_START);
  plan.counts = ep_region(e, MOE_RT_EP_EXPERT_COUNTS);
  plan.tokens_per_expert = ep_region(e, MOE_RT_EP_TOKENS_PER_EXPERT);
  plan.num_tokens = rows;
  plan.topk = K;
  plan.num_experts = e->h.desc.num_local_experts;
  plan.num_rows = N;
  plan.align_size = e->align;
  LL_CORE(moe_rt_combine_backward(xctx, &plan, stage.rows_local, g.dtype, H, y.data, w.data, gy.data, gp.data,
                                  e->stream));
  return NULL;
}

EXPORT XLA_FFI_Error* moe_rt_xla_ep_prepare(XLA_FFI_CallFrame* f) {
  return ep_call(f, "moe_rt_xla_ep_prepare", ep_prepare_body);
}
EXPORT XLA_FFI_Error* moe_rt_xla_ep_dispatch(XLA_FFI_CallFrame* f) {
  return ep_call(f, "moe_rt_xla_ep_dispatch", ep_dispatch_body);
}
EXPORT XLA_FFI_Error* moe_rt_xla_ep_combine(XLA_FFI_CallFrame* f) {
  return ep_call(f, "moe_rt_xla_ep_combine", ep_combine_body);
}
EXPORT XLA_FFI_Error* moe_rt_xla_ep_dispatch_bwd(XLA_FFI_CallFrame* f) {
  return ep_call(f, "moe_rt_xla_ep_dispatch_bwd", ep_dispatch_bwd_body);
}
EXPORT XLA_FFI_Error* moe_rt_xla_ep_combine_bwd(XLA_FFI_CallFrame* f) {
  return ep_call(f, "moe_rt_xla_ep_combine_bwd", ep_combine_bwd_body);
}
