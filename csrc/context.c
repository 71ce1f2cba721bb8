/* moe_rt core: the context (driver, device, kernel cache, plan cache), errors, launches and the memory
 * helpers of the C ABI. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#ifndef MOE_RT_SOURCE_HASH
#define MOE_RT_SOURCE_HASH ""
#endif

/* ---- errors -------------------------------------------------------------------------------------- */

static _Thread_local char g_error[1024];

moe_rt_status mrt_fail(moe_rt_status status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_error, sizeof g_error, fmt, ap);
  va_end(ap);
  return status;
}

void mrt_clear_error(void) { g_error[0] = 0; }

const char* moe_rt_last_error(void) { return g_error; }

const char* moe_rt_status_name(moe_rt_status s) {
  switch (s) {
    case MOE_RT_SUCCESS: return "MOE_RT_SUCCESS";
    case MOE_RT_ERROR_INVALID_ARGUMENT: return "MOE_RT_ERROR_INVALID_ARGUMENT";
    case MOE_RT_ERROR_NO_DRIVER: return "MOE_RT_ERROR_NO_DRIVER";
    case MOE_RT_ERROR_NO_DEVICE: return "MOE_RT_ERROR_NO_DEVICE";
    case MOE_RT_ERROR_KERNEL_CACHE: return "MOE_RT_ERROR_KERNEL_CACHE";
    case MOE_RT_ERROR_CUDA: return "MOE_RT_ERROR_CUDA";
    case MOE_RT_ERROR_BAD_EXPERT_ID: return "MOE_RT_ERROR_BAD_EXPERT_ID";
    case MOE_RT_ERROR_NOT_SUPPORTED: return "MOE_RT_ERROR_NOT_SUPPORTED";
    case MOE_RT_ERROR_NO_NCCL: return "MOE_RT_ERROR_NO_NCCL";
    case MOE_RT_ERROR_NCCL: return "MOE_RT_ERROR_NCCL";
    case MOE_RT_ERROR_TIMEOUT: return "MOE_RT_ERROR_TIMEOUT";
  }
  return "unknown moe_rt_status";
}

moe_rt_status mrt_cuda_fail(const mrt_driver* d, CUresult r, const char* what) {
  const char* s = NULL;
  if (d && d->cuGetErrorString) d->cuGetErrorString(r, &s);
  return mrt_fail(MOE_RT_ERROR_CUDA, "%s failed: CUDA error %d (%s)", what, r, s ? s : "no description");
}

/* ---- dtypes ---------------------------------------------------------------------------------------- */

int mrt_dtype_size(int dtype) {
  switch (dtype) {
    case MOE_RT_FLOAT32: case MOE_RT_INT32: return 4;
    case MOE_RT_FLOAT16: case MOE_RT_BFLOAT16: return 2;
    case MOE_RT_INT64: case MOE_RT_UINT64: case MOE_RT_FLOAT64: return 8;
    case MOE_RT_UINT32: return 4;
    case MOE_RT_INT16: return 2;
    case MOE_RT_BOOL: case MOE_RT_UINT8: case MOE_RT_INT8: case MOE_RT_FLOAT8_E4M3: case MOE_RT_FLOAT8_E5M2:
      return 1;
  }
  return 0;
}

int mrt_is_float_dtype(int dtype) {
  return dtype == MOE_RT_FLOAT32 || dtype == MOE_RT_FLOAT16 || dtype == MOE_RT_BFLOAT16;
}

const char* mrt_ctype(int dtype) {
  switch (dtype) {
    case MOE_RT_FLOAT32: return "float";
    case MOE_RT_FLOAT16: return "__half";
    case MOE_RT_BFLOAT16: return "__nv_bfloat16";
  }
  return "?";
}

const char* mrt_dtype_name(int dtype) {
  static const char* names[] = {"float32", "float16", "bfloat16", "int32", "int64", "bool",
                                "uint8", "int8", "float8_e4m3", "float8_e5m2", "int16", "uint32", "uint64",
                                "float64"};
  return dtype >= 0 && dtype <= MOE_RT_FLOAT64 ? names[dtype] : "an unknown dtype code";
}

/* ---- the context ------------------------------------------------------------------------------------ */

struct mrt_row { /* a kernel row of manifest.json */
  char *file, *name, *lowered, *arch, *image;
};

typedef struct mrt_entry { /* a kernel of the manifest for the chosen architecture */
  char* file;
  char* name;
  char* lowered;
  char* image; /* path relative to the cache folder */
} mrt_entry;

typedef struct mrt_loaded {
  char file[32];
  char name[MOE_RT_KERNEL_NAME_MAX];
  CUmodule mod;
  CUfunction fn;
  int regs;
  int max_threads; /* CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK */
  int smem_optin;  /* dynamic shared memory the function was opted in to */
  /* a stand-in (moe_rt_context_load_stand_in): the kernel it stands in for ("" for a kernel loaded as
   * itself), and whether it was retired (moe_rt_context_end_stand_ins) */
  char stands_in_for[MOE_RT_KERNEL_NAME_MAX];
  int retired;
} mrt_loaded;

#define MRT_KEY_MAX 160
#define MRT_CACHE_SLOTS 1024
#define MRT_CACHE_LIMIT 512

typedef struct mrt_cached {
  uint64_t hash;
  size_t key_bytes; /* 0 = empty slot */
  unsigned char key[MRT_KEY_MAX];
  mrt_plan plan;
} mrt_cached;

struct moe_rt_context {
  int planning;
  moe_rt_device_info dev;
  mrt_driver drv;
  int device;
  CUdevice cudev;
  CUcontext cuctx;
  char* root;
  char arch[32];
  struct mrt_row* rows; /* the manifest's rows until the architecture is chosen */
  int num_rows;
  mrt_entry* entries;
  int num_entries;
  mrt_loaded* loaded;
  int num_loaded, cap_loaded;
  unsigned long long error_word;
  mrt_cached* cache;
  int cache_count;
  mrt_plan last; /* planning contexts: the last op's plan */
  int last_nargs[MRT_MAX_LAUNCHES]; /* and its launches' arguments, where the op recorded them */
  int64_t last_args[MRT_MAX_LAUNCHES][MRT_MAX_ARGS];
  pthread_mutex_t lock;
};

const moe_rt_device_info* mrt_device(const moe_rt_context* ctx) { return &ctx->dev; }
int mrt_is_planning(const moe_rt_context* ctx) { return ctx->planning; }

moe_rt_status mrt_check_ctx(const moe_rt_context* ctx, const char* op) {
  mrt_clear_error();
  if (ctx == NULL)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: ctx is NULL; make one with moe_rt_context_create", op);
  return MOE_RT_SUCCESS;
}

moe_rt_status mrt_check_ptr(const char* op, const char* name, const void* p) {
  if (p == NULL) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: %s is NULL", op, name);
  return MOE_RT_SUCCESS;
}

moe_rt_status mrt_check_data(const char* op, const char* name, const void* p, int64_t n) {
  return n > 0 ? mrt_check_ptr(op, name, p) : MOE_RT_SUCCESS;
}

static moe_rt_status load_driver(mrt_driver* d) {
  memset(d, 0, sizeof *d);
  const char* libname = getenv("MOE_RT_LIBCUDA");
  if (libname == NULL || !*libname) libname = "libcuda.so.1";
  d->lib = dlopen(libname, RTLD_NOW | RTLD_LOCAL);
  if (d->lib == NULL) {
    const char* why = dlerror();
    return mrt_fail(MOE_RT_ERROR_NO_DRIVER, "no CUDA driver: cannot load %s (%s)", libname, why ? why : "?");
  }
#define SYM(field, name)                                                                               \
  do {                                                                                                 \
    *(void**)(&d->field) = dlsym(d->lib, name);                                                        \
    if (d->field == NULL) {                                                                            \
      dlclose(d->lib);                                                                                 \
      d->lib = NULL;                                                                                   \
      return mrt_fail(MOE_RT_ERROR_NO_DRIVER, "the CUDA driver %s lacks %s (driver too old?)", libname, \
                      name);                                                                           \
    }                                                                                                  \
  } while (0)
  SYM(cuInit, "cuInit");
  SYM(cuDeviceGetCount, "cuDeviceGetCount");
  SYM(cuDeviceGet, "cuDeviceGet");
  SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute");
  SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  SYM(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
  SYM(cuCtxGetCurrent, "cuCtxGetCurrent");
  SYM(cuCtxSetCurrent, "cuCtxSetCurrent");
  SYM(cuModuleLoadData, "cuModuleLoadData");
  SYM(cuModuleUnload, "cuModuleUnload");
  SYM(cuModuleGetFunction, "cuModuleGetFunction");
  SYM(cuModuleGetGlobal, "cuModuleGetGlobal_v2");
  SYM(cuFuncGetAttribute, "cuFuncGetAttribute");
  SYM(cuFuncSetAttribute, "cuFuncSetAttribute");
  SYM(cuLaunchKernel, "cuLaunchKernel");
  SYM(cuMemAlloc, "cuMemAlloc_v2");
  SYM(cuMemFree, "cuMemFree_v2");
  SYM(cuMemsetD8Async, "cuMemsetD8Async");
  SYM(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
  SYM(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
  SYM(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
  SYM(cuStreamSynchronize, "cuStreamSynchronize");
  SYM(cuStreamIsCapturing, "cuStreamIsCapturing");
  SYM(cuGetErrorString, "cuGetErrorString");
#undef SYM
  /* needed by the fused EP kernels' grids alone (mrt_resident_blocks says so when it is missing) */
  *(void**)(&d->cuOccupancyMaxActiveBlocksPerMultiprocessor) =
      dlsym(d->lib, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  /* needed by the peer buffers alone (moe_rt_peer_buffer_create says which is missing) */
  *(void**)(&d->cuIpcGetMemHandle) = dlsym(d->lib, "cuIpcGetMemHandle");
  *(void**)(&d->cuIpcOpenMemHandle) = dlsym(d->lib, "cuIpcOpenMemHandle_v2");
  if (d->cuIpcOpenMemHandle == NULL) *(void**)(&d->cuIpcOpenMemHandle) = dlsym(d->lib, "cuIpcOpenMemHandle");
  *(void**)(&d->cuIpcCloseMemHandle) = dlsym(d->lib, "cuIpcCloseMemHandle");
  *(void**)(&d->cuStreamQuery) = dlsym(d->lib, "cuStreamQuery");
  *(void**)(&d->cuMemcpyHtoDAsync) = dlsym(d->lib, "cuMemcpyHtoDAsync_v2");
  return MOE_RT_SUCCESS;
}

/* ---- manifest.json: a small JSON reader (objects, arrays, strings, numbers, literals) ---------------- */

typedef struct jreader {
  const char* p;
  const char* end;
} jreader;

static void jws(jreader* r) {
  while (r->p < r->end && (*r->p == ' ' || *r->p == '\n' || *r->p == '\r' || *r->p == '\t')) r->p++;
}

/* A string at r->p (after the quote is checked): a malloc'ed UTF-8 copy, NULL on malformed input. */
static char* jstring(jreader* r) {
  jws(r);
  if (r->p >= r->end || *r->p != '"') return NULL;
  r->p++;
  size_t cap = 64, n = 0;
  char* out = malloc(cap);
  if (!out) return NULL;
  while (r->p < r->end && *r->p != '"') {
    unsigned c = (unsigned char)*r->p++;
    if (c == '\\') {
      if (r->p >= r->end) break;
      char e = *r->p++;
      switch (e) {
        case 'n': c = '\n'; break;
        case 't': c = '\t'; break;
        case 'r': c = '\r'; break;
        case 'b': c = '\b'; break;
        case 'f': c = '\f'; break;
        case 'u': {
          if (r->end - r->p < 4) { free(out); return NULL; }
          char hex[5] = {r->p[0], r->p[1], r->p[2], r->p[3], 0};
          r->p += 4;
          c = (unsigned)strtoul(hex, NULL, 16);
          if (c >= 0x80) { /* non-ASCII never occurs in kernel names or paths written by moe_rt */
            free(out);
            return NULL;
          }
          break;
        }
        default: c = (unsigned char)e; /* \" \\ \/ */
      }
    }
    if (n + 2 > cap) {
      cap *= 2;
      char* q = realloc(out, cap);
      if (!q) { free(out); return NULL; }
      out = q;
    }
    out[n++] = (char)c;
  }
  if (r->p >= r->end) { free(out); return NULL; }
  r->p++; /* closing quote */
  out[n] = 0;
  return out;
}

static int jskip(jreader* r, int depth);

static int jskip_container(jreader* r, char close, int depth) {
  r->p++;
  jws(r);
  if (r->p < r->end && *r->p == close) { r->p++; return 1; }
  for (;;) {
    if (close == '}') {
      char* k = jstring(r);
      if (!k) return 0;
      free(k);
      jws(r);
      if (r->p >= r->end || *r->p != ':') return 0;
      r->p++;
    }
    if (!jskip(r, depth + 1)) return 0;
    jws(r);
    if (r->p >= r->end) return 0;
    if (*r->p == ',') { r->p++; continue; }
    if (*r->p == close) { r->p++; return 1; }
    return 0;
  }
}

static int jskip(jreader* r, int depth) {
  jws(r);
  if (r->p >= r->end || depth > 64) return 0;
  char c = *r->p;
  if (c == '"') {
    char* s = jstring(r);
    if (!s) return 0;
    free(s);
    return 1;
  }
  if (c == '{') return jskip_container(r, '}', depth);
  if (c == '[') return jskip_container(r, ']', depth);
  const char* start = r->p;
  while (r->p < r->end && (strchr("+-.eE", *r->p) || (*r->p >= '0' && *r->p <= '9') ||
                           (*r->p >= 'a' && *r->p <= 'z')))
    r->p++;
  return r->p > start;
}

typedef struct mrt_row mrt_row;

static void free_row(mrt_row* w) {
  free(w->file); free(w->name); free(w->lowered); free(w->arch); free(w->image);
  memset(w, 0, sizeof *w);
}

/* One kernel object: its string fields of interest (other keys skipped). */
static int jrow(jreader* r, mrt_row* w) {
  memset(w, 0, sizeof *w);
  jws(r);
  if (r->p >= r->end || *r->p != '{') return 0;
  r->p++;
  jws(r);
  if (r->p < r->end && *r->p == '}') { r->p++; return 1; }
  for (;;) {
    char* k = jstring(r);
    if (!k) return 0;
    jws(r);
    if (r->p >= r->end || *r->p != ':') { free(k); return 0; }
    r->p++;
    char** slot = !strcmp(k, "file") ? &w->file : !strcmp(k, "name") ? &w->name
                : !strcmp(k, "lowered") ? &w->lowered : !strcmp(k, "arch") ? &w->arch
                : !strcmp(k, "image") ? &w->image : NULL;
    free(k);
    if (slot) {
      free(*slot);
      *slot = jstring(r);
      if (!*slot) return 0;
    } else if (!jskip(r, 1)) {
      return 0;
    }
    jws(r);
    if (r->p >= r->end) return 0;
    if (*r->p == ',') { r->p++; continue; }
    if (*r->p == '}') { r->p++; return 1; }
    return 0;
  }
}

static char* read_file(const char* path, size_t* size) {
  FILE* f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, n = 0;
  char* buf = malloc(cap + 1);
  while (buf) {
    size_t got = fread(buf + n, 1, cap - n, f);
    n += got;
    if (n < cap) break;
    cap *= 2;
    char* q = realloc(buf, cap + 1);
    if (!q) { free(buf); buf = NULL; break; }
    buf = q;
  }
  int err = ferror(f);
  fclose(f);
  if (!buf || err) { free(buf); return NULL; }
  buf[n] = 0; /* PTX images are loaded as NUL-terminated text */
  *size = n;
  return buf;
}

static int arch_number(const char* arch, const char* prefix) {
  size_t n = strlen(prefix);
  if (strncmp(arch, prefix, n) != 0) return -1;
  char* end = NULL;
  long v = strtol(arch + n, &end, 10);
  if (end == arch + n || (*end != 0)) return -1;
  return (int)v;
}

/* Read root/manifest.json (before the driver is touched, so that a bad folder is reported on any machine):
 * every kernel row, checked for its fields and for the kernel sources this library was built from. */
static moe_rt_status read_manifest(moe_rt_context* ctx) {
  char path[4096];
  snprintf(path, sizeof path, "%s/manifest.json", ctx->root);
  size_t size = 0;
  char* text = read_file(path, &size);
  if (!text)
    return mrt_fail(MOE_RT_ERROR_KERNEL_CACHE,
                    "kernel cache: cannot read %s (%s); write the folder with `python3 -m moe_rt warmup --out %s`",
                    path, strerror(errno), ctx->root);
  jreader r = {text, text + size};
  moe_rt_status st = MOE_RT_SUCCESS;
  char* source_hash = NULL;
  mrt_row* rows = NULL;
  int nrows = 0, caprows = 0, ok = 0;
  jws(&r);
  if (r.p < r.end && *r.p == '{') {
    r.p++;
    for (;;) {
      char* k = jstring(&r);
      if (!k) break;
      jws(&r);
      if (r.p >= r.end || *r.p != ':') { free(k); break; }
      r.p++;
      int good = 1;
      if (!strcmp(k, "source_hash")) {
        free(source_hash);
        source_hash = jstring(&r);
        good = source_hash != NULL;
      } else if (!strcmp(k, "kernels")) {
        jws(&r);
        if (r.p >= r.end || *r.p != '[') good = 0;
        else {
          r.p++;
          jws(&r);
          if (r.p < r.end && *r.p == ']') r.p++;
          else {
            for (;;) {
              if (nrows == caprows) {
                caprows = caprows ? 2 * caprows : 256;
                mrt_row* q = realloc(rows, sizeof *rows * caprows);
                if (!q) { good = 0; break; }
                rows = q;
              }
              if (!jrow(&r, &rows[nrows])) { free_row(&rows[nrows]); good = 0; break; }
              nrows++;
              jws(&r);
              if (r.p < r.end && *r.p == ',') { r.p++; continue; }
              if (r.p < r.end && *r.p == ']') { r.p++; break; }
              good = 0;
              break;
            }
          }
        }
      } else {
        good = jskip(&r, 1);
      }
      free(k);
      if (!good) break;
      jws(&r);
      if (r.p < r.end && *r.p == ',') { r.p++; continue; }
      if (r.p < r.end && *r.p == '}') { ok = 1; }
      break;
    }
  }
  free(text);
  if (!ok) {
    st = mrt_fail(MOE_RT_ERROR_KERNEL_CACHE, "kernel cache: %s is not a moe_rt manifest (malformed JSON)", path);
    goto done;
  }
  if (MOE_RT_SOURCE_HASH[0] && (!source_hash || strcmp(source_hash, MOE_RT_SOURCE_HASH) != 0)) {
    st = mrt_fail(MOE_RT_ERROR_KERNEL_CACHE,
                  "kernel cache: %s was written from kernel sources %.12s but this library was built from %.12s; "
                  "run `python3 -m moe_rt warmup --out %s` with the moe_rt this library belongs to",
                  path, source_hash ? source_hash : "(none)", MOE_RT_SOURCE_HASH, ctx->root);
    goto done;
  }
  for (int i = 0; i < nrows; ++i) {
    if (!rows[i].arch || !rows[i].file || !rows[i].name || !rows[i].lowered || !rows[i].image) {
      st = mrt_fail(MOE_RT_ERROR_KERNEL_CACHE, "kernel cache: %s has a kernel entry without file, name, lowered, "
                    "arch or image", path);
      goto done;
    }
  }
  ctx->rows = rows;
  ctx->num_rows = nrows;
  rows = NULL;
  nrows = 0;
done:
  for (int i = 0; i < nrows; ++i) free_row(&rows[i]);
  free(rows);
  free(source_hash);
  return st;
}

/* Keep the manifest's kernels of the architecture the device runs: sm_<cc> machine code, else PTX of the
 * newest architecture at or below it. */
static moe_rt_status select_arch(moe_rt_context* ctx) {
  mrt_row* rows = ctx->rows;
  const int nrows = ctx->num_rows;
  char path[4096];
  snprintf(path, sizeof path, "%s/manifest.json", ctx->root);
  int want = ctx->dev.cc_major * 10 + ctx->dev.cc_minor, best_ptx = -1, have_sm = 0;
  for (int i = 0; i < nrows; ++i) {
    if (arch_number(rows[i].arch, "sm_") == want) have_sm = 1;
    int c = arch_number(rows[i].arch, "compute_");
    if (c >= 0 && c <= want && c > best_ptx) best_ptx = c;
  }
  if (have_sm) snprintf(ctx->arch, sizeof ctx->arch, "sm_%d", want);
  else if (best_ptx >= 0) snprintf(ctx->arch, sizeof ctx->arch, "compute_%d", best_ptx);
  else
    return mrt_fail(MOE_RT_ERROR_KERNEL_CACHE,
                    "kernel cache: %s holds no kernels for sm_%d (the device's architecture); run "
                    "`python3 -m moe_rt warmup --arch sm_%d --out %s`", path, want, want, ctx->root);
  ctx->entries = calloc(nrows ? nrows : 1, sizeof *ctx->entries);
  if (!ctx->entries) return mrt_fail(MOE_RT_ERROR_KERNEL_CACHE, "kernel cache: out of host memory");
  for (int i = 0; i < nrows; ++i) {
    if (strcmp(rows[i].arch, ctx->arch) != 0) continue;
    mrt_entry* e = &ctx->entries[ctx->num_entries++];
    e->file = rows[i].file; e->name = rows[i].name; e->lowered = rows[i].lowered; e->image = rows[i].image;
    rows[i].file = rows[i].name = rows[i].lowered = rows[i].image = NULL;
  }
  for (int i = 0; i < nrows; ++i) free_row(&rows[i]);
  free(ctx->rows);
  ctx->rows = NULL;
  ctx->num_rows = 0;
  return MOE_RT_SUCCESS;
}

static void free_entries(moe_rt_context* ctx) {
  for (int i = 0; i < ctx->num_entries; ++i) {
    free(ctx->entries[i].file); free(ctx->entries[i].name); free(ctx->entries[i].lowered);
    free(ctx->entries[i].image);
  }
  free(ctx->entries);
  ctx->entries = NULL;
  ctx->num_entries = 0;
}

static moe_rt_status bind(moe_rt_context* ctx) {
  CUcontext cur = NULL;
  CUresult r = ctx->drv.cuCtxGetCurrent(&cur);
  if (r == 0 && cur == ctx->cuctx) return MOE_RT_SUCCESS;
  r = ctx->drv.cuCtxSetCurrent(ctx->cuctx);
  return r ? mrt_cuda_fail(&ctx->drv, r, "cuCtxSetCurrent") : MOE_RT_SUCCESS;
}

static void context_free(moe_rt_context* ctx) {
  if (!ctx) return;
  if (ctx->drv.lib) {
    if (ctx->cuctx) {
      bind(ctx);
      for (int i = 0; i < ctx->num_loaded; ++i)
        if (ctx->loaded[i].mod) ctx->drv.cuModuleUnload(ctx->loaded[i].mod);
      ctx->drv.cuDevicePrimaryCtxRelease(ctx->cudev);
    }
    dlclose(ctx->drv.lib);
  }
  free_entries(ctx);
  for (int i = 0; i < ctx->num_rows; ++i) free_row(&ctx->rows[i]);
  free(ctx->rows);
  free(ctx->loaded);
  free(ctx->cache);
  free(ctx->root);
  pthread_mutex_destroy(&ctx->lock);
  free(ctx);
}

static moe_rt_context* context_new(void) {
  moe_rt_context* ctx = calloc(1, sizeof *ctx);
  if (!ctx) return NULL;
  ctx->cache = calloc(MRT_CACHE_SLOTS, sizeof *ctx->cache);
  if (!ctx->cache) { free(ctx); return NULL; }
  pthread_mutex_init(&ctx->lock, NULL);
  return ctx;
}

moe_rt_status moe_rt_context_create(const char* kernel_cache_dir, int device, moe_rt_context** out) {
  mrt_clear_error();
  if (out == NULL) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_context_create: ctx is NULL");
  *out = NULL;
  if (device < 0)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_context_create: device must be >= 0, got %d", device);
  const char* dir = kernel_cache_dir;
  if (dir == NULL || !*dir) dir = getenv("MOE_RT_KERNEL_CACHE");
  if (dir == NULL || !*dir)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT,
                    "moe_rt_context_create: kernel_cache_dir is NULL and MOE_RT_KERNEL_CACHE is not set; write a "
                    "folder with `python3 -m moe_rt warmup --out DIR` and pass it");
  moe_rt_context* ctx = context_new();
  if (!ctx) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_context_create: out of host memory");
  ctx->root = strdup(dir);
  ctx->device = device;
  moe_rt_status st = read_manifest(ctx);
  if (st) goto fail;
  if ((st = load_driver(&ctx->drv))) goto fail;
  mrt_driver* d = &ctx->drv;
  CUresult r = d->cuInit(0);
  if (r) {
    const char* s = NULL;
    d->cuGetErrorString(r, &s);
    st = mrt_fail(r == 100 ? MOE_RT_ERROR_NO_DEVICE : MOE_RT_ERROR_NO_DRIVER,
                  "moe_rt_context_create: cuInit failed: CUDA error %d (%s)", r, s ? s : "no description");
    goto fail;
  }
  int count = 0;
  r = d->cuDeviceGetCount(&count);
  if (r) { st = mrt_cuda_fail(d, r, "cuDeviceGetCount"); goto fail; }
  if (device >= count) {
    st = mrt_fail(MOE_RT_ERROR_NO_DEVICE, "moe_rt_context_create: device %d is not a CUDA device of this machine "
                  "(%d found)", device, count);
    goto fail;
  }
  if ((r = d->cuDeviceGet(&ctx->cudev, device))) { st = mrt_cuda_fail(d, r, "cuDeviceGet"); goto fail; }
  int attrs[5] = {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                  CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR};
  int vals[5];
  for (int i = 0; i < 5; ++i)
    if ((r = d->cuDeviceGetAttribute(&vals[i], attrs[i], ctx->cudev))) {
      st = mrt_cuda_fail(d, r, "cuDeviceGetAttribute");
      goto fail;
    }
  ctx->dev.sm_count = vals[0];
  ctx->dev.smem_per_sm = vals[1];
  ctx->dev.smem_per_block_optin = vals[2];
  ctx->dev.cc_major = vals[3];
  ctx->dev.cc_minor = vals[4];
  if ((r = d->cuDevicePrimaryCtxRetain(&ctx->cuctx, ctx->cudev))) {
    st = mrt_cuda_fail(d, r, "cuDevicePrimaryCtxRetain");
    goto fail;
  }
  if ((st = bind(ctx))) goto fail;
  if ((st = select_arch(ctx))) goto fail;
  *out = ctx;
  return MOE_RT_SUCCESS;
fail:
  context_free(ctx);
  return st;
}

moe_rt_status moe_rt_context_create_planning(const moe_rt_device_info* device, moe_rt_context** out) {
  mrt_clear_error();
  if (out == NULL) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_context_create_planning: ctx is NULL");
  *out = NULL;
  if (device == NULL)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_context_create_planning: device is NULL");
  if (device->sm_count < 1 || device->smem_per_sm < 0 || device->smem_per_block_optin < 0 ||
      device->assumed_regs < 0 || device->cc_major < 1)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT,
                    "moe_rt_context_create_planning: device: expected sm_count >= 1, cc_major >= 1 and sizes >= 0, "
                    "got sm_count=%d cc=%d.%d smem_per_sm=%d smem_per_block_optin=%d assumed_regs=%d",
                    device->sm_count, device->cc_major, device->cc_minor, device->smem_per_sm,
                    device->smem_per_block_optin, device->assumed_regs);
  moe_rt_context* ctx = context_new();
  if (!ctx) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_context_create_planning: out of host memory");
  ctx->planning = 1;
  ctx->dev = *device;
  *out = ctx;
  return MOE_RT_SUCCESS;
}

void moe_rt_context_destroy(moe_rt_context* ctx) { context_free(ctx); }

moe_rt_status moe_rt_context_device_info(const moe_rt_context* ctx, moe_rt_device_info* info) {
  moe_rt_status st = mrt_check_ctx(ctx, "moe_rt_context_device_info");
  if (st) return st;
  if (!info) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_context_device_info: info is NULL");
  *info = ctx->dev;
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_last_plan(const moe_rt_context* ctx, moe_rt_plan_info* info) {
  moe_rt_status st = mrt_check_ctx(ctx, "moe_rt_last_plan");
  if (st) return st;
  if (!info) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_last_plan: info is NULL");
  if (!ctx->planning)
    return mrt_fail(MOE_RT_ERROR_NOT_SUPPORTED, "moe_rt_last_plan: ctx is a device context; plans are recorded "
                    "by planning contexts (moe_rt_context_create_planning)");
  memset(info, 0, sizeof *info);
  pthread_mutex_lock((pthread_mutex_t*)&ctx->lock);
  info->num_launches = ctx->last.num_launches;
  for (int i = 0; i < ctx->last.num_launches; ++i) {
    const mrt_launch* l = &ctx->last.launch[i];
    snprintf(info->launch[i].file, sizeof info->launch[i].file, "%s", l->file);
    snprintf(info->launch[i].kernel, sizeof info->launch[i].kernel, "%s", l->name);
    info->launch[i].grid = l->grid;
    info->launch[i].block = l->block;
    info->launch[i].shared_mem = l->smem;
    info->launch[i].scalars[0] = l->scalars[0];
    info->launch[i].scalars[1] = l->scalars[1];
  }
  pthread_mutex_unlock((pthread_mutex_t*)&ctx->lock);
  return MOE_RT_SUCCESS;
}

/* Planning contexts: lock ctx with `launch` a launch of its last plan (MOE_RT_SUCCESS; the caller unlocks), or
 * fail unlocked. */
static moe_rt_status lock_last_launch(const moe_rt_context* ctx, const char* op, int launch) {
  if (!ctx->planning)
    return mrt_fail(MOE_RT_ERROR_NOT_SUPPORTED, "%s: ctx is a device context; plans are recorded by planning "
                    "contexts (moe_rt_context_create_planning)", op);
  pthread_mutex_lock((pthread_mutex_t*)&ctx->lock);
  if (launch < 0 || launch >= ctx->last.num_launches) {
    pthread_mutex_unlock((pthread_mutex_t*)&ctx->lock);
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: launch must be in [0, %d), got %d", op,
                    ctx->last.num_launches, launch);
  }
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_last_plan_stand_in(const moe_rt_context* ctx, int launch, char* name, size_t size) {
  static const char op[] = "moe_rt_last_plan_stand_in";
  moe_rt_status st = mrt_check_ctx(ctx, op);
  if (st || (st = mrt_check_ptr(op, "name", name))) return st;
  if (size < MOE_RT_KERNEL_NAME_MAX)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: size must be >= %d, got %zu", op, MOE_RT_KERNEL_NAME_MAX,
                    size);
  if ((st = lock_last_launch(ctx, op, launch))) return st;
  snprintf(name, size, "%s", ctx->last.launch[launch].stand_in);
  pthread_mutex_unlock((pthread_mutex_t*)&ctx->lock);
  return MOE_RT_SUCCESS;
}

void mrt_record(moe_rt_context* ctx, const mrt_plan* plan) {
  pthread_mutex_lock(&ctx->lock);
  ctx->last = *plan;
  memset(ctx->last_nargs, 0, sizeof ctx->last_nargs);
  pthread_mutex_unlock(&ctx->lock);
}

void mrt_record_args(moe_rt_context* ctx, int launch, const mrt_args* a) {
  if (launch < 0 || launch >= MRT_MAX_LAUNCHES) return;
  pthread_mutex_lock(&ctx->lock);
  for (int i = 0; i < a->n; ++i) {
    int64_t v;
    switch (a->type[i]) {
      case 'i': v = a->val[i].i32; break;
      case 'u': v = a->val[i].u32; break;
      case 'f': { uint32_t bits; memcpy(&bits, &a->val[i].f32, 4); v = bits; break; }
      case 'p': v = (int64_t)a->val[i].p; break;
      default: v = a->val[i].i64;
    }
    ctx->last_args[launch][i] = v;
  }
  ctx->last_nargs[launch] = a->n;
  pthread_mutex_unlock(&ctx->lock);
}

moe_rt_status moe_rt_last_plan_args(const moe_rt_context* ctx, int launch, int64_t* args, int capacity, int* count) {
  static const char op[] = "moe_rt_last_plan_args";
  moe_rt_status st = mrt_check_ctx(ctx, op);
  if (st || (st = mrt_check_ptr(op, "count", count)) || (st = lock_last_launch(ctx, op, launch))) return st;
  const int n = ctx->last_nargs[launch];
  *count = n;
  if (n > capacity || (n > 0 && args == NULL)) {
    pthread_mutex_unlock((pthread_mutex_t*)&ctx->lock);
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: the launch has %d arguments; args holds %d", op, n, capacity);
  }
  if (n) memcpy(args, ctx->last_args[launch], sizeof(int64_t) * (size_t)n);
  pthread_mutex_unlock((pthread_mutex_t*)&ctx->lock);
  return MOE_RT_SUCCESS;
}

moe_rt_status mrt_resident_blocks(moe_rt_context* ctx, const mrt_launch* l, int threads, int regs, int64_t* blocks) {
  return mrt_resident_blocks_smem(ctx, l, threads, 0, regs, blocks);
}

moe_rt_status mrt_resident_blocks_smem(moe_rt_context* ctx, const mrt_launch* l, int threads, int smem, int regs,
                                       int64_t* blocks) {
  if (ctx->planning) {
    *blocks = mrt_resident_grid(&ctx->dev, INT64_MAX, threads, smem, regs);
    return MOE_RT_SUCCESS;
  }
  moe_rt_status st = bind(ctx);
  if (st) return st;
  int per_sm = 0;
  if (!ctx->drv.cuOccupancyMaxActiveBlocksPerMultiprocessor)
    return mrt_fail(MOE_RT_ERROR_NO_DRIVER, "the CUDA driver lacks cuOccupancyMaxActiveBlocksPerMultiprocessor");
  if (smem > 48 * 1024) { /* the occupancy of a kernel opted in to more shared memory than the default */
    CUresult r = ctx->drv.cuFuncSetAttribute(l->fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem);
    if (r) return mrt_cuda_fail(&ctx->drv, r, "cuFuncSetAttribute (dynamic shared memory)");
  }
  CUresult r = ctx->drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, l->fn, threads, (size_t)smem);
  if (r) return mrt_cuda_fail(&ctx->drv, r, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  *blocks = (int64_t)mrt_max(1, per_sm) * ctx->dev.sm_count;
  return MOE_RT_SUCCESS;
}

/* ---- kernels --------------------------------------------------------------------------------------- */

static const mrt_entry* find_entry(const moe_rt_context* ctx, const char* file, const char* name) {
  for (int i = 0; i < ctx->num_entries; ++i)
    if (!strcmp(ctx->entries[i].name, name) && !strcmp(ctx->entries[i].file, file)) return &ctx->entries[i];
  return NULL;
}

/* Read the manifest again and keep its kernels of the context's architecture (loaded kernels stay loaded);
 * the caller holds ctx->lock. On failure the old entries are kept. */
static moe_rt_status reload_manifest(moe_rt_context* ctx) {
  mrt_entry* old = ctx->entries;
  const int num_old = ctx->num_entries;
  char arch[sizeof ctx->arch];
  memcpy(arch, ctx->arch, sizeof arch);
  ctx->entries = NULL;
  ctx->num_entries = 0;
  moe_rt_status st = read_manifest(ctx);
  if (!st) st = select_arch(ctx);
  if (st) {
    for (int i = 0; i < ctx->num_rows; ++i) free_row(&ctx->rows[i]);
    free(ctx->rows);
    ctx->rows = NULL;
    ctx->num_rows = 0;
    free_entries(ctx);
    ctx->entries = old;
    ctx->num_entries = num_old;
    memcpy(ctx->arch, arch, sizeof arch);
    return st;
  }
  mrt_entry* fresh = ctx->entries;
  const int num_fresh = ctx->num_entries;
  ctx->entries = old;
  ctx->num_entries = num_old;
  free_entries(ctx);
  ctx->entries = fresh;
  ctx->num_entries = num_fresh;
  return MOE_RT_SUCCESS;
}

/* The loaded kernel `name` of `file`: loaded as itself (for = ""), or as a stand-in for kernel `for` and not
 * retired; NULL when there is none. The caller holds ctx->lock. */
static mrt_loaded* find_loaded(moe_rt_context* ctx, const char* file, const char* name, const char* for_) {
  for (int i = 0; i < ctx->num_loaded; ++i) {
    mrt_loaded* k = &ctx->loaded[i];
    if (!strcmp(k->name, name) && !strcmp(k->file, file) && !strcmp(k->stands_in_for, for_) && !k->retired)
      return k;
  }
  return NULL;
}

/* Load (once) kernel `name` of `file`, as itself (for_ = "") or as a stand-in for kernel `for_`; the caller
 * holds ctx->lock. The entry is added to the table only once its function and registers are known (a planner
 * on another thread never sees a half-loaded kernel). */
static moe_rt_status load_kernel_for(moe_rt_context* ctx, const char* file, const char* name, const char* for_,
                                     mrt_loaded** out) {
  mrt_loaded* have = find_loaded(ctx, file, name, for_);
  if (have) {
    *out = have;
    return MOE_RT_SUCCESS;
  }
  const mrt_entry* e = find_entry(ctx, file, name);
  if (!e) {
    /* the folder may have gained kernels since the manifest was read (moe_rt.jax adds the kernels an op
     * needs when it is traced): read it again */
    moe_rt_status st = reload_manifest(ctx);
    if (st) return st;
    e = find_entry(ctx, file, name);
  }
  if (!e)
    return mrt_fail(MOE_RT_ERROR_KERNEL_CACHE, "kernel cache: %s has no kernel %s (%s) for %s; write it with "
                    "`python3 -m moe_rt warmup --out %s`", ctx->root, name, file, ctx->arch, ctx->root);
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", ctx->root, e->image);
  size_t size = 0;
  char* image = read_file(path, &size);
  if (!image || !size) {
    free(image);
    return mrt_fail(MOE_RT_ERROR_KERNEL_CACHE, "kernel cache: cannot read %s (kernel %s)", path, name);
  }
  moe_rt_status st = bind(ctx);
  if (st) { free(image); return st; }
  CUmodule mod = NULL;
  CUfunction fn = NULL;
  CUresult r = ctx->drv.cuModuleLoadData(&mod, image);
  free(image);
  if (r) return mrt_cuda_fail(&ctx->drv, r, "cuModuleLoadData (kernel cache image)");
  if ((r = ctx->drv.cuModuleGetFunction(&fn, mod, e->lowered))) {
    ctx->drv.cuModuleUnload(mod);
    return mrt_cuda_fail(&ctx->drv, r, "cuModuleGetFunction");
  }
  int regs = 0, max_threads = 0;
  if ((r = ctx->drv.cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, fn)) ||
      (r = ctx->drv.cuFuncGetAttribute(&max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn))) {
    ctx->drv.cuModuleUnload(mod);
    return mrt_cuda_fail(&ctx->drv, r, "cuFuncGetAttribute");
  }
  if (ctx->num_loaded == ctx->cap_loaded) {
    int cap = ctx->cap_loaded ? 2 * ctx->cap_loaded : 32;
    mrt_loaded* q = realloc(ctx->loaded, sizeof *q * cap);
    if (!q) { ctx->drv.cuModuleUnload(mod); return mrt_fail(MOE_RT_ERROR_CUDA, "out of host memory"); }
    ctx->loaded = q;
    ctx->cap_loaded = cap;
  }
  mrt_loaded* l = &ctx->loaded[ctx->num_loaded];
  memset(l, 0, sizeof *l);
  snprintf(l->file, sizeof l->file, "%s", file);
  snprintf(l->name, sizeof l->name, "%s", name);
  snprintf(l->stands_in_for, sizeof l->stands_in_for, "%s", for_);
  l->mod = mod;
  l->fn = fn;
  l->regs = regs;
  l->max_threads = max_threads;
  l->smem_optin = 48 * 1024;
  ctx->num_loaded++;
  *out = l;
  return MOE_RT_SUCCESS;
}

static moe_rt_status load_kernel(moe_rt_context* ctx, const char* file, const char* name, mrt_loaded** out) {
  return load_kernel_for(ctx, file, name, "", out);
}

moe_rt_status mrt_kernel_threads(moe_rt_context* ctx, mrt_launch* l, const char* file, int* regs, int* max_threads) {
  l->file = file;
  if (ctx->planning) {
    l->fn = NULL;
    *regs = ctx->dev.assumed_regs;
    *max_threads = 0;
    return MOE_RT_SUCCESS;
  }
  pthread_mutex_lock(&ctx->lock);
  mrt_loaded* k = NULL;
  moe_rt_status st = load_kernel(ctx, file, l->name, &k);
  if (!st) {
    l->fn = k->fn;
    *regs = k->regs;
    *max_threads = k->max_threads;
  }
  pthread_mutex_unlock(&ctx->lock);
  return st;
}

moe_rt_status mrt_kernel(moe_rt_context* ctx, mrt_launch* l, const char* file, int* regs) {
  int max_threads = 0;
  return mrt_kernel_threads(ctx, l, file, regs, &max_threads);
}

moe_rt_status mrt_kernel_or_stand_in(moe_rt_context* ctx, mrt_launch* l, const char* file, const char* stand_in,
                                     int* regs, int* standing) {
  *standing = 0;
  if (ctx->planning) {
    snprintf(l->stand_in, sizeof l->stand_in, "%s", stand_in ? stand_in : "");
    return mrt_kernel(ctx, l, file, regs);
  }
  l->file = file;
  l->stand_in[0] = 0;
  pthread_mutex_lock(&ctx->lock);
  mrt_loaded* k = find_loaded(ctx, file, l->name, "");
  if (!k && stand_in && *stand_in && (k = find_loaded(ctx, file, stand_in, l->name))) *standing = 1;
  moe_rt_status st = k ? MOE_RT_SUCCESS : load_kernel(ctx, file, l->name, &k);
  if (!st) {
    l->fn = k->fn;
    *regs = k->regs;
    if (*standing) snprintf(l->name, sizeof l->name, "%s", stand_in);
  }
  pthread_mutex_unlock(&ctx->lock);
  return st;
}

static moe_rt_status check_kernel_names(const char* op, const char* file, const char* name, const char* name2) {
  moe_rt_status st;
  if ((st = mrt_check_ptr(op, "file", file)) || (st = mrt_check_ptr(op, "name", name))) return st;
  if (strlen(file) >= sizeof(((mrt_loaded*)0)->file) || strlen(name) >= MOE_RT_KERNEL_NAME_MAX ||
      (name2 && strlen(name2) >= MOE_RT_KERNEL_NAME_MAX))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: file or name too long (at most %d characters)", op,
                    MOE_RT_KERNEL_NAME_MAX - 1);
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_context_load_stand_in(moe_rt_context* ctx, const char* file, const char* name,
                                           const char* stand_in) {
  static const char op[] = "moe_rt_context_load_stand_in";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = mrt_check_ptr(op, "stand_in", stand_in)) ||
      (st = check_kernel_names(op, file, name, stand_in)))
    return st;
  if (!*stand_in || !strcmp(stand_in, name))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: stand_in must name another kernel than name (%s)", op,
                    name);
  if (ctx->planning) return MOE_RT_SUCCESS;
  pthread_mutex_lock(&ctx->lock);
  mrt_loaded* k = NULL;
  st = load_kernel_for(ctx, file, stand_in, name, &k);
  pthread_mutex_unlock(&ctx->lock);
  return st;
}

moe_rt_status moe_rt_context_end_stand_ins(moe_rt_context* ctx, const char* file, const char* name, int load,
                                           moe_rt_stream stream) {
  static const char op[] = "moe_rt_context_end_stand_ins";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_kernel_names(op, file, name, NULL))) return st;
  if (ctx->planning) return MOE_RT_SUCCESS;
  if (load) {
    /* loading a module while the stream is captured could break the capture: the caller tries again later */
    int capturing = 0;
    if ((st = bind(ctx))) return st;
    CUresult r = ctx->drv.cuStreamIsCapturing((CUstream)stream, &capturing);
    /* 900-908: the CUDA_ERROR_STREAM_CAPTURE_* errors (e.g. the legacy stream queried while another stream
     * captures in global mode): a capture is under way */
    if (r >= 900 && r <= 908) capturing = 1;
    else if (r) return mrt_cuda_fail(&ctx->drv, r, "cuStreamIsCapturing");
    if (capturing)
      return mrt_fail(MOE_RT_ERROR_NOT_SUPPORTED, "%s: the stream is being captured into a CUDA graph; %s is "
                      "loaded after the capture", op, name);
  }
  pthread_mutex_lock(&ctx->lock);
  mrt_loaded* k = NULL;
  if (load) st = load_kernel(ctx, file, name, &k);
  if (!st)
    for (int i = 0; i < ctx->num_loaded; ++i)
      if (!strcmp(ctx->loaded[i].stands_in_for, name) && !strcmp(ctx->loaded[i].file, file))
        ctx->loaded[i].retired = 1;
  pthread_mutex_unlock(&ctx->lock);
  return st;
}

moe_rt_status moe_rt_context_load_kernel(moe_rt_context* ctx, const char* file, const char* name) {
  static const char op[] = "moe_rt_context_load_kernel";
  moe_rt_status st;
  if ((st = mrt_check_ctx(ctx, op)) || (st = check_kernel_names(op, file, name, NULL))) return st;
  if (ctx->planning) return MOE_RT_SUCCESS;
  pthread_mutex_lock(&ctx->lock);
  mrt_loaded* k = NULL;
  st = load_kernel(ctx, file, name, &k);
  pthread_mutex_unlock(&ctx->lock);
  return st;
}

/* Opt the launch's function in to its dynamic shared memory (needed above 48 KiB). */
static moe_rt_status opt_in_smem(moe_rt_context* ctx, const mrt_launch* l) {
  if (l->smem <= 48 * 1024) return MOE_RT_SUCCESS;
  moe_rt_status st = MOE_RT_SUCCESS;
  pthread_mutex_lock(&ctx->lock);
  for (int i = 0; i < ctx->num_loaded; ++i) {
    mrt_loaded* k = &ctx->loaded[i];
    if (k->fn != l->fn) continue;
    if (k->smem_optin < l->smem) {
      CUresult r = ctx->drv.cuFuncSetAttribute(k->fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, l->smem);
      if (r) st = mrt_cuda_fail(&ctx->drv, r, "cuFuncSetAttribute (dynamic shared memory)");
      else k->smem_optin = l->smem;
    }
    break;
  }
  pthread_mutex_unlock(&ctx->lock);
  return st;
}

#define ARG(a, field, t, v) \
  do { (a)->val[(a)->n].field = (v); (a)->type[(a)->n] = (t); (a)->ptr[(a)->n] = &(a)->val[(a)->n]; (a)->n++; } while (0)
void mrt_arg_i32(mrt_args* a, int32_t v) { ARG(a, i32, 'i', v); }
void mrt_arg_u32(mrt_args* a, uint32_t v) { ARG(a, u32, 'u', v); }
void mrt_arg_i64(mrt_args* a, int64_t v) { ARG(a, i64, 'l', v); }
void mrt_arg_f32(mrt_args* a, float v) { ARG(a, f32, 'f', v); }
void mrt_arg_ptr(mrt_args* a, const void* v) { ARG(a, p, 'p', (unsigned long long)(uintptr_t)v); }
#undef ARG

moe_rt_status mrt_launch_one(moe_rt_context* ctx, const mrt_launch* l, mrt_args* args, moe_rt_stream stream) {
  if (ctx->planning || l->grid <= 0) return MOE_RT_SUCCESS;
  if (l->grid > 0x7fffffffLL)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: a grid of %lld blocks is too large", l->name,
                    (long long)l->grid);
  moe_rt_status st = bind(ctx);
  if (st) return st;
  if ((st = opt_in_smem(ctx, l))) return st;
  if (l->grid_y > 65535)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: a grid y dimension of %lld is too large", l->name,
                    (long long)l->grid_y);
  const unsigned gy = l->grid_y > 1 ? (unsigned)l->grid_y : 1u;
  CUresult r = ctx->drv.cuLaunchKernel(l->fn, (unsigned)l->grid, gy, 1, (unsigned)l->block, 1, 1, (unsigned)l->smem,
                                       (CUstream)stream, args->ptr, NULL);
  if (r) {
    char what[MOE_RT_KERNEL_NAME_MAX + 32];
    snprintf(what, sizeof what, "cuLaunchKernel(%s)", l->name);
    return mrt_cuda_fail(&ctx->drv, r, what);
  }
  return MOE_RT_SUCCESS;
}

moe_rt_status mrt_memset0(moe_rt_context* ctx, void* p, size_t nbytes, moe_rt_stream stream) {
  if (ctx->planning || nbytes == 0) return MOE_RT_SUCCESS;
  moe_rt_status st = bind(ctx);
  if (st) return st;
  CUresult r = ctx->drv.cuMemsetD8Async((CUdeviceptr)(uintptr_t)p, 0, nbytes, (CUstream)stream);
  return r ? mrt_cuda_fail(&ctx->drv, r, "cuMemsetD8Async") : MOE_RT_SUCCESS;
}

moe_rt_status mrt_copy_d2d(moe_rt_context* ctx, void* dst, const void* src, size_t nbytes, moe_rt_stream stream) {
  if (ctx->planning || nbytes == 0) return MOE_RT_SUCCESS;
  moe_rt_status st = bind(ctx);
  if (st) return st;
  CUresult r = ctx->drv.cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, nbytes,
                                          (CUstream)stream);
  return r ? mrt_cuda_fail(&ctx->drv, r, "cuMemcpyDtoDAsync") : MOE_RT_SUCCESS;
}

#define ERRORS_FILE "errors.cu"
#define ERRORS_CLEAR "error_word_clear"

moe_rt_status mrt_error_word(moe_rt_context* ctx, unsigned long long* ptr) {
  *ptr = 0;
  if (ctx->planning) return MOE_RT_SUCCESS;
  pthread_mutex_lock(&ctx->lock);
  moe_rt_status st = MOE_RT_SUCCESS;
  if (!ctx->error_word) {
    mrt_loaded* k = NULL;
    st = load_kernel(ctx, ERRORS_FILE, ERRORS_CLEAR, &k);
    if (!st) {
      CUdeviceptr p = 0;
      size_t bytes = 0;
      CUresult r = ctx->drv.cuModuleGetGlobal(&p, &bytes, k->mod, "moe_rt_error_word");
      if (r) st = mrt_cuda_fail(&ctx->drv, r, "cuModuleGetGlobal(moe_rt_error_word)");
      else ctx->error_word = p;
    }
  }
  *ptr = ctx->error_word;
  pthread_mutex_unlock(&ctx->lock);
  return st;
}

moe_rt_status moe_rt_check(moe_rt_context* ctx, moe_rt_stream stream) {
  moe_rt_status st = mrt_check_ctx(ctx, "moe_rt_check");
  if (st) return st;
  if (ctx->planning) return MOE_RT_SUCCESS;
  unsigned long long word = 0;
  if ((st = mrt_error_word(ctx, &word)) || (st = bind(ctx))) return st;
  unsigned host[8];
  CUresult r = ctx->drv.cuStreamSynchronize((CUstream)stream);
  if (r) return mrt_cuda_fail(&ctx->drv, r, "cuStreamSynchronize");
  if ((r = ctx->drv.cuMemcpyDtoHAsync(host, word, sizeof host, (CUstream)stream)) ||
      (r = ctx->drv.cuStreamSynchronize((CUstream)stream)))
    return mrt_cuda_fail(&ctx->drv, r, "reading the error word");
  if (host[0] == 0) return MOE_RT_SUCCESS;
  mrt_launch clear;
  memset(&clear, 0, sizeof clear);
  snprintf(clear.name, sizeof clear.name, "%s", ERRORS_CLEAR);
  int regs = 0;
  if ((st = mrt_kernel(ctx, &clear, ERRORS_FILE, &regs))) return st;
  clear.grid = 1;
  clear.block = 8;
  mrt_args args = {0};
  if ((st = mrt_launch_one(ctx, &clear, &args, stream))) return st;
  if ((r = ctx->drv.cuStreamSynchronize((CUstream)stream))) return mrt_cuda_fail(&ctx->drv, r, "cuStreamSynchronize");
  long long value = (long long)((unsigned long long)host[2] | ((unsigned long long)host[3] << 32));
  /* the argument the Python side's message names, by the op family that met the id (MOE_RT_ERR_* bits) */
  const char* arg = host[7] == 4u ? "topk_indices" : (host[7] == 2u || host[7] == 8u) ? "topk_idx" : "routing";
  return mrt_fail(MOE_RT_ERROR_BAD_EXPERT_ID, "%s: expert ids must be in [-1, num_experts=%d), got %lld", arg,
                  (int)host[6], value);
}

/* ---- the plan cache -------------------------------------------------------------------------------- */

static uint64_t fnv1a(const void* key, size_t n) {
  const unsigned char* p = key;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

const mrt_plan* mrt_plan_get(moe_rt_context* ctx, const void* key, size_t n) {
  if (n > MRT_KEY_MAX) return NULL;
  uint64_t h = fnv1a(key, n);
  const mrt_plan* found = NULL;
  pthread_mutex_lock(&ctx->lock);
  for (size_t i = 0; i < MRT_CACHE_SLOTS; ++i) {
    mrt_cached* c = &ctx->cache[(h + i) % MRT_CACHE_SLOTS];
    if (c->key_bytes == 0) break;
    if (c->hash == h && c->key_bytes == n && !memcmp(c->key, key, n)) { found = &c->plan; break; }
  }
  pthread_mutex_unlock(&ctx->lock);
  return found; /* entries are never moved or freed while the context lives, except by mrt_plan_put's clear */
}

int mrt_plan_lookup(moe_rt_context* ctx, const void* key, size_t n, mrt_plan* plan) {
  const mrt_plan* hit = mrt_plan_get(ctx, key, n);
  if (hit) {
    *plan = *hit;
    return 1;
  }
  memset(plan, 0, sizeof *plan);
  return 0;
}

void mrt_plan_put(moe_rt_context* ctx, const void* key, size_t n, const mrt_plan* plan) {
  if (n > MRT_KEY_MAX) return;
  uint64_t h = fnv1a(key, n);
  pthread_mutex_lock(&ctx->lock);
  if (ctx->cache_count >= MRT_CACHE_LIMIT) {
    /* Full: start over (a plan is a few microseconds of host work to make again). Readers copy a plan
     * before using it, under no lock; a clear while another thread copies is avoided by never clearing:
     * the table stops taking new signatures instead. */
    pthread_mutex_unlock(&ctx->lock);
    return;
  }
  for (size_t i = 0; i < MRT_CACHE_SLOTS; ++i) {
    mrt_cached* c = &ctx->cache[(h + i) % MRT_CACHE_SLOTS];
    if (c->key_bytes == n && c->hash == h && !memcmp(c->key, key, n)) break;
    if (c->key_bytes == 0) {
      c->plan = *plan;
      memcpy(c->key, key, n);
      c->hash = h;
      c->key_bytes = n; /* written last: a reader that sees the key sees the plan */
      ctx->cache_count++;
      break;
    }
  }
  pthread_mutex_unlock(&ctx->lock);
}

/* ---- memory helpers -------------------------------------------------------------------------------- */

static moe_rt_status device_ctx(moe_rt_context* ctx, const char* op) {
  moe_rt_status st = mrt_check_ctx(ctx, op);
  if (st) return st;
  if (ctx->planning)
    return mrt_fail(MOE_RT_ERROR_NOT_SUPPORTED, "%s: ctx is a planning context (no device)", op);
  return bind(ctx);
}

moe_rt_status mrt_device_driver(moe_rt_context* ctx, const char* op, const mrt_driver** d) {
  moe_rt_status st = device_ctx(ctx, op);
  if (st == MOE_RT_SUCCESS) *d = &ctx->drv;
  return st;
}

moe_rt_status moe_rt_malloc(moe_rt_context* ctx, size_t bytes, void** ptr) {
  moe_rt_status st = device_ctx(ctx, "moe_rt_malloc");
  if (st) return st;
  if (!ptr) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_malloc: ptr is NULL");
  *ptr = NULL;
  CUdeviceptr p = 0;
  CUresult r = ctx->drv.cuMemAlloc(&p, bytes ? bytes : 1);
  if (r) return mrt_cuda_fail(&ctx->drv, r, "cuMemAlloc");
  *ptr = (void*)(uintptr_t)p;
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_free(moe_rt_context* ctx, void* ptr) {
  moe_rt_status st = device_ctx(ctx, "moe_rt_free");
  if (st || !ptr) return st;
  CUresult r = ctx->drv.cuMemFree((CUdeviceptr)(uintptr_t)ptr);
  return r ? mrt_cuda_fail(&ctx->drv, r, "cuMemFree") : MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_copy_to_device(moe_rt_context* ctx, void* dst, const void* src, size_t bytes) {
  moe_rt_status st = device_ctx(ctx, "moe_rt_copy_to_device");
  if (st || !bytes) return st;
  if (!dst || !src) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_copy_to_device: %s is NULL",
                                    dst ? "src" : "dst");
  CUresult r = ctx->drv.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, bytes);
  return r ? mrt_cuda_fail(&ctx->drv, r, "cuMemcpyHtoD") : MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_copy_on_device(moe_rt_context* ctx, void* dst, const void* src, size_t bytes,
                                   moe_rt_stream stream) {
  moe_rt_status st = device_ctx(ctx, "moe_rt_copy_on_device");
  if (st || !bytes) return st;
  if (!dst || !src) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_copy_on_device: %s is NULL",
                                    dst ? "src" : "dst");
  CUresult r = ctx->drv.cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, bytes,
                                          (CUstream)stream);
  return r ? mrt_cuda_fail(&ctx->drv, r, "cuMemcpyDtoDAsync") : MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_copy_to_host(moe_rt_context* ctx, void* dst, const void* src, size_t bytes) {
  moe_rt_status st = device_ctx(ctx, "moe_rt_copy_to_host");
  if (st || !bytes) return st;
  if (!dst || !src) return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "moe_rt_copy_to_host: %s is NULL",
                                    dst ? "src" : "dst");
  CUresult r = ctx->drv.cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, bytes);
  return r ? mrt_cuda_fail(&ctx->drv, r, "cuMemcpyDtoH") : MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_stream_synchronize(moe_rt_context* ctx, moe_rt_stream stream) {
  moe_rt_status st = device_ctx(ctx, "moe_rt_stream_synchronize");
  if (st) return st;
  CUresult r = ctx->drv.cuStreamSynchronize((CUstream)stream);
  return r ? mrt_cuda_fail(&ctx->drv, r, "cuStreamSynchronize") : MOE_RT_SUCCESS;
}

/* ---- shared planning arithmetic --------------------------------------------------------------------- */

int64_t mrt_resident_grid(const moe_rt_device_info* dev, int64_t n_needed, int threads, int smem, int regs) {
  int64_t smem_sm = dev->smem_per_sm ? dev->smem_per_sm : 228 * 1024;
  int64_t per_sm = mrt_max(1, mrt_min(mrt_min(2048 / threads, 32), smem_sm / (smem + 1024)));
  if (regs) per_sm = mrt_max(1, mrt_min(per_sm, 65536 / ((int64_t)threads * (mrt_cdiv(regs, 8) * 8))));
  return mrt_max(1, mrt_min(n_needed, (int64_t)dev->sm_count * per_sm));
}

/* ---- what the EP groups share (csrc/ep_ll.c, csrc/ep_direct.c) ---------------------------------------- */

moe_rt_status mrt_run_plan(moe_rt_context* ctx, const mrt_plan* p, mrt_args* args, moe_rt_stream stream) {
  if (mrt_is_planning(ctx)) {
    mrt_record(ctx, p);
    for (int i = 0; i < p->num_launches; ++i) mrt_record_args(ctx, i, &args[i]);
    return MOE_RT_SUCCESS;
  }
  for (int i = 0; i < p->num_launches; ++i) {
    moe_rt_status st = mrt_launch_one(ctx, &p->launch[i], &args[i], stream);
    if (st) return st;
  }
  return MOE_RT_SUCCESS;
}

void mrt_barrier_args(mrt_args* a, const void* peer_barrier, int32_t R, int32_t rank, const void* state,
                      int64_t timeout_ns, const void* timeout_word, int32_t op, int32_t lo, int32_t hi) {
  mrt_arg_ptr(a, peer_barrier);
  mrt_arg_i32(a, R);
  mrt_arg_i32(a, rank);
  mrt_arg_ptr(a, state);
  mrt_arg_i64(a, timeout_ns);
  mrt_arg_ptr(a, timeout_word);
  mrt_arg_i32(a, op);
  mrt_arg_i32(a, lo);
  mrt_arg_i32(a, hi);
}

void mrt_group_plans_init(mrt_group_plans* c) {
  pthread_mutex_init(&c->lock, NULL);
  c->num = 0;
}

void mrt_group_plans_destroy(mrt_group_plans* c) { pthread_mutex_destroy(&c->lock); }

/* ---- registries of live groups -------------------------------------------------------------------------- */

struct mrt_registry_entry {
  void* group;
  mrt_live* live;
};

static int64_t g_next_serial = 1; /* shared by every registry (atomic) */

int mrt_registry_add(mrt_registry* r, void* group, mrt_live* live) {
  pthread_mutex_lock(&r->lock);
  int ok = 1;
  if (r->len == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 16;
    struct mrt_registry_entry* e = realloc(r->entries, cap * sizeof *e);
    if (e) {
      r->entries = e;
      r->cap = cap;
    } else {
      ok = 0;
    }
  }
  if (ok) {
    live->serial = __atomic_fetch_add(&g_next_serial, 1, __ATOMIC_RELAXED);
    r->entries[r->len].group = group;
    r->entries[r->len++].live = live;
  }
  pthread_mutex_unlock(&r->lock);
  return ok;
}

int mrt_registry_remove(mrt_registry* r, void* group, mrt_live* live) {
  pthread_mutex_lock(&r->lock);
  for (size_t i = 0; i < r->len; ++i)
    if (r->entries[i].group == group) {
      r->entries[i] = r->entries[--r->len];
      break;
    }
  const int held = live->users > 0;
  if (held) live->destroyed = 1;
  pthread_mutex_unlock(&r->lock);
  return !held;
}

void* mrt_registry_acquire(mrt_registry* r, int64_t address, int64_t serial) {
  void* found = NULL;
  pthread_mutex_lock(&r->lock);
  for (size_t i = 0; i < r->len; ++i)
    if ((int64_t)(uintptr_t)r->entries[i].group == address && r->entries[i].live->serial == serial) {
      found = r->entries[i].group;
      r->entries[i].live->users++;
      break;
    }
  pthread_mutex_unlock(&r->lock);
  return found;
}

int mrt_registry_release(mrt_registry* r, mrt_live* live) {
  pthread_mutex_lock(&r->lock);
  const int last = --live->users == 0 && live->destroyed;
  pthread_mutex_unlock(&r->lock);
  return last;
}

int mrt_group_plan_get(mrt_group_plans* c, const void* key, size_t key_bytes, mrt_plan* plan) {
  int found = 0;
  pthread_mutex_lock(&c->lock);
  for (int i = 0; i < c->num; ++i)
    if (c->entry[i].key_bytes == key_bytes && !memcmp(c->entry[i].key, key, key_bytes)) {
      *plan = c->entry[i].plan;
      found = 1;
      break;
    }
  pthread_mutex_unlock(&c->lock);
  return found;
}

void mrt_group_plan_put(mrt_group_plans* c, const void* key, size_t key_bytes, const mrt_plan* plan) {
  if (key_bytes > MRT_GROUP_KEY_BYTES) return; /* not kept: planned again next time */
  pthread_mutex_lock(&c->lock);
  if (c->num == MRT_GROUP_PLANS) c->num = 0;
  c->entry[c->num].key_bytes = key_bytes;
  memcpy(c->entry[c->num].key, key, key_bytes);
  c->entry[c->num].plan = *plan;
  c->num++;
  pthread_mutex_unlock(&c->lock);
}
