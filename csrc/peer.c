/* moe_rt core: peer buffers (include/moe_rt/moe_rt.h, "Peer buffers"): one device allocation per rank, mapped
 * into every rank of a range through CUDA IPC, with the addresses as a host array and a device int64 table. The
 * IPC handles travel once through the communicator (an all-gather on a device byte buffer), then a host read
 * after a wait on the stream bounded by a deadline. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#define HANDLE_BYTES MOE_RT_IPC_HANDLE_BYTES
_Static_assert(sizeof(CUipcMemHandle) == HANDLE_BYTES, "CUipcMemHandle is 64 bytes");
#define MIN_BYTES 256   /* every allocation has at least this many bytes */

struct moe_rt_peer_buffer {
  moe_rt_context* ctx;
  const mrt_driver* d;
  int nranks, rank, peer_lo, peer_hi;
  size_t nbytes;
  CUdeviceptr local; /* this rank's allocation (0: not made) */
  CUdeviceptr table; /* device int64 [nranks] (0: not made) */
  void** ptrs;       /* host [nranks]: each rank's allocation as mapped here (NULL outside the range) */
  char* opened;      /* host [nranks]: 1 while ptrs[r] is an open IPC mapping */
};

static moe_rt_status cu(const mrt_driver* d, CUresult r, const char* op, const char* what) {
  if (r == 0) return MOE_RT_SUCCESS;
  const char* s = NULL;
  if (d->cuGetErrorString) d->cuGetErrorString(r, &s);
  return mrt_fail(MOE_RT_ERROR_CUDA, "%s: %s failed: CUDA error %d (%s)", op, what, r, s ? s : "no description");
}

/* Close every open mapping; the first failure's status (the others are still closed). */
static moe_rt_status close_mappings(moe_rt_peer_buffer* b, const char* op) {
  moe_rt_status first = MOE_RT_SUCCESS;
  if (b->opened == NULL) return first;
  for (int r = 0; r < b->nranks; ++r) {
    if (!b->opened[r]) continue;
    b->opened[r] = 0;
    CUresult res = b->d->cuIpcCloseMemHandle((CUdeviceptr)(uintptr_t)b->ptrs[r]);
    b->ptrs[r] = NULL;
    moe_rt_status st = cu(b->d, res, op, "cuIpcCloseMemHandle");
    if (first == MOE_RT_SUCCESS) first = st;
  }
  return first;
}

/* Close the mappings, then free the table and this rank's allocation, then the struct; the first failure. */
static moe_rt_status destroy(moe_rt_peer_buffer* b, const char* op) {
  moe_rt_status first = close_mappings(b, op), st;
  if (b->table) {
    st = cu(b->d, b->d->cuMemFree(b->table), op, "cuMemFree (the table)");
    if (first == MOE_RT_SUCCESS) first = st;
  }
  if (b->local) {
    st = cu(b->d, b->d->cuMemFree(b->local), op, "cuMemFree");
    if (first == MOE_RT_SUCCESS) first = st;
  }
  free(b->ptrs);
  free(b->opened);
  free(b);
  return first;
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

/* Wait for stream (cuStreamQuery, backing off from 10 us to 5 ms) until timeout_ms, polling comm's asynchronous
 * error; on the deadline abort comm (in place) and return MOE_RT_ERROR_TIMEOUT naming op. */
static moe_rt_status wait_stream(const mrt_driver* d, moe_rt_comm* comm, moe_rt_stream stream, int64_t timeout_ms,
                                 const char* op) {
  const double deadline = now_ms() + (double)timeout_ms;
  long delay_ns = 10000;
  for (;;) {
    CUresult r = d->cuStreamQuery((CUstream)stream);
    if (r == 0) return MOE_RT_SUCCESS;
    if (r != CUDA_ERROR_NOT_READY) return cu(d, r, op, "cuStreamQuery");
    moe_rt_status st = mrt_comm_poll(comm, op);
    if (st) return st;
    if (now_ms() > deadline) {
      if (d->cuStreamQuery((CUstream)stream) == 0) return MOE_RT_SUCCESS;
      mrt_comm_abort_in_place(comm);
      return mrt_fail(MOE_RT_ERROR_TIMEOUT, "%s: the exchange of the IPC handles made no progress within %lld ms "
                      "(a peer rank is dead or did not call the same op); the communicator was aborted", op,
                      (long long)timeout_ms);
    }
    struct timespec ts = {0, delay_ns};
    nanosleep(&ts, NULL);
    delay_ns = delay_ns * 2 > 5000000 ? 5000000 : delay_ns * 2;
  }
}

/* The all-gather of the handles (R > 1): every rank's handle into handles [R][HANDLE_BYTES]. */
static moe_rt_status exchange(moe_rt_peer_buffer* b, moe_rt_comm* comm, const CUipcMemHandle* mine,
                              unsigned char* handles, moe_rt_stream stream, int64_t timeout_ms, const char* op) {
  const mrt_driver* d = b->d;
  const size_t bytes = (size_t)b->nranks * HANDLE_BYTES;
  CUdeviceptr buf = 0;
  moe_rt_status st = cu(d, d->cuMemAlloc(&buf, bytes), op, "cuMemAlloc (the exchange buffer)");
  if (st) return st;
  CUdeviceptr slot = buf + (CUdeviceptr)b->rank * HANDLE_BYTES;
  st = cu(d, d->cuMemcpyHtoDAsync(slot, mine, HANDLE_BYTES, (CUstream)stream), op, "cuMemcpyHtoDAsync");
  if (!st && (st = moe_rt_comm_all_gather(comm, (const void*)(uintptr_t)slot, (void*)(uintptr_t)buf, HANDLE_BYTES,
                                          MOE_RT_UINT8, stream))) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", moe_rt_last_error());
    mrt_fail(st, "%s: %s", op, msg); /* the all-gather's message, naming this op */
  }
  if (!st && !(st = wait_stream(d, comm, stream, timeout_ms, op)))
    st = cu(d, d->cuMemcpyDtoH(handles, buf, bytes), op, "cuMemcpyDtoH (the handles)");
  if (st == MOE_RT_ERROR_TIMEOUT) {
    d->cuMemFree(buf); /* after the abort (the all-gather's kernel has returned) */
  } else {
    CUresult r = d->cuMemFree(buf);
    if (st == MOE_RT_SUCCESS) st = cu(d, r, op, "cuMemFree (the exchange buffer)");
  }
  return st;
}

moe_rt_status moe_rt_peer_buffer_create(moe_rt_context* ctx, moe_rt_comm* comm, size_t nbytes, int zero,
                                        int peer_lo, int peer_hi, moe_rt_stream stream, int64_t timeout_ms,
                                        moe_rt_peer_buffer** out) {
  const char* op = "moe_rt_peer_buffer_create";
  mrt_clear_error();
  moe_rt_status st;
  if ((st = mrt_check_ptr(op, "out", out))) return st;
  *out = NULL;
  if ((st = mrt_check_ctx(ctx, op))) return st;
  int R, me;
  if (comm != NULL) {
    int aborted = 0;
    if ((st = moe_rt_comm_aborted(comm, &aborted))) return st;
    if (aborted)
      return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: comm was aborted (a wait of the core timed out or met an "
                      "NCCL error); free it with moe_rt_comm_abort or moe_rt_comm_destroy", op);
  }
  mrt_comm_shape(comm, &R, &me);
  if (nbytes > ((size_t)1 << 48))
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: nbytes must be at most 2^48, got %zu", op, nbytes);
  if (zero != 0 && zero != 1)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: zero must be 0 or 1, got %d", op, zero);
  if (peer_lo < 0 || peer_lo > me || peer_hi <= me || peer_hi > R)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: the mapped ranks [peer_lo, peer_hi) must satisfy 0 <= "
                    "peer_lo <= rank < peer_hi <= nranks (rank %d of %d), got [%d, %d)", op, me, R, peer_lo, peer_hi);
  if (timeout_ms < 1)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: timeout_ms must be >= 1, got %lld", op,
                    (long long)timeout_ms);
  const mrt_driver* d = NULL;
  if ((st = mrt_device_driver(ctx, op, &d))) return st;
  const char* missing = !d->cuIpcGetMemHandle ? "cuIpcGetMemHandle" : !d->cuIpcOpenMemHandle ? "cuIpcOpenMemHandle"
                        : !d->cuIpcCloseMemHandle ? "cuIpcCloseMemHandle" : !d->cuStreamQuery ? "cuStreamQuery"
                        : !d->cuMemcpyHtoDAsync ? "cuMemcpyHtoDAsync_v2" : NULL;
  if (missing) return mrt_fail(MOE_RT_ERROR_NO_DRIVER, "%s: the CUDA driver lacks %s", op, missing);
  int capturing = 0;
  if ((st = cu(d, d->cuStreamIsCapturing((CUstream)stream, &capturing), op, "cuStreamIsCapturing"))) return st;
  if (capturing)
    return mrt_fail(MOE_RT_ERROR_NOT_SUPPORTED, "%s: stream is being captured into a CUDA graph; a peer buffer is "
                    "made by a collective with a host wait: make it before capture", op);

  moe_rt_peer_buffer* b = calloc(1, sizeof *b);
  if (b) {
    b->ptrs = calloc((size_t)R, sizeof *b->ptrs);
    b->opened = calloc((size_t)R, 1);
  }
  if (!b || !b->ptrs || !b->opened) {
    if (b) { free(b->ptrs); free(b->opened); free(b); }
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: out of host memory", op);
  }
  b->ctx = ctx, b->d = d, b->nranks = R, b->rank = me, b->peer_lo = peer_lo, b->peer_hi = peer_hi;
  b->nbytes = nbytes;
  const size_t alloc = nbytes > MIN_BYTES ? nbytes : MIN_BYTES;
  unsigned char* handles = NULL;
  CUipcMemHandle mine;
  if ((st = cu(d, d->cuMemAlloc(&b->local, alloc), op, "cuMemAlloc"))) goto fail;
  if (zero && (st = cu(d, d->cuMemsetD8Async(b->local, 0, alloc, (CUstream)stream), op, "cuMemsetD8Async")))
    goto fail;
  b->ptrs[me] = (void*)(uintptr_t)b->local;
  if (R > 1) {
    if ((st = cu(d, d->cuIpcGetMemHandle(&mine, b->local), op, "cuIpcGetMemHandle"))) goto fail;
    handles = malloc((size_t)R * HANDLE_BYTES);
    if (!handles) {
      st = mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: out of host memory", op);
      goto fail;
    }
    if ((st = exchange(b, comm, &mine, handles, stream, timeout_ms, op))) goto fail;
    for (int r = peer_lo; r < peer_hi; ++r) {
      if (r == me) continue;
      CUipcMemHandle h;
      memcpy(h.reserved, handles + (size_t)r * HANDLE_BYTES, HANDLE_BYTES);
      CUdeviceptr p = 0;
      CUresult res = d->cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      if (res) {
        char what[64];
        snprintf(what, sizeof what, "cuIpcOpenMemHandle (rank %d's buffer)", r);
        st = cu(d, res, op, what);
        goto fail;
      }
      b->ptrs[r] = (void*)(uintptr_t)p;
      b->opened[r] = 1;
    }
  }
  if ((st = cu(d, d->cuMemAlloc(&b->table, (size_t)R * sizeof(int64_t)), op, "cuMemAlloc (the table)"))) goto fail;
  /* the host array lives with the buffer, so the copy may still be in flight when this returns */
  if ((st = cu(d, d->cuMemcpyHtoDAsync(b->table, b->ptrs, (size_t)R * sizeof(int64_t), (CUstream)stream), op,
               "cuMemcpyHtoDAsync (the table)")))
    goto fail;
  free(handles);
  *out = b;
  return MOE_RT_SUCCESS;
fail:
  free(handles);
  {
    /* keep the first failure's message over the teardown's */
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", moe_rt_last_error());
    destroy(b, op);
    mrt_fail(st, "%s", msg);
  }
  return st;
}

static moe_rt_status buf_null(const char* op, const moe_rt_peer_buffer* b) {
  mrt_clear_error();
  if (b == NULL)
    return mrt_fail(MOE_RT_ERROR_INVALID_ARGUMENT, "%s: buf is NULL; make one with moe_rt_peer_buffer_create", op);
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_peer_buffer_get_info(const moe_rt_peer_buffer* buf, moe_rt_peer_buffer_info* out) {
  const char* op = "moe_rt_peer_buffer_get_info";
  moe_rt_status st;
  if ((st = buf_null(op, buf)) || (st = mrt_check_ptr(op, "out", out))) return st;
  out->local = (void*)(uintptr_t)buf->local;
  out->ptrs = (void* const*)buf->ptrs;
  out->table = (int64_t*)(uintptr_t)buf->table;
  out->nbytes = buf->nbytes;
  out->nranks = buf->nranks, out->rank = buf->rank, out->peer_lo = buf->peer_lo, out->peer_hi = buf->peer_hi;
  return MOE_RT_SUCCESS;
}

moe_rt_status moe_rt_peer_buffer_close_mappings(moe_rt_peer_buffer* buf) {
  const char* op = "moe_rt_peer_buffer_close_mappings";
  moe_rt_status st;
  if ((st = buf_null(op, buf)) || (st = mrt_device_driver(buf->ctx, op, &buf->d))) return st;
  return close_mappings(buf, op);
}

moe_rt_status moe_rt_peer_buffer_destroy(moe_rt_peer_buffer* buf) {
  const char* op = "moe_rt_peer_buffer_destroy";
  mrt_clear_error();
  if (buf == NULL) return MOE_RT_SUCCESS;
  moe_rt_status st = mrt_device_driver(buf->ctx, op, &buf->d);
  if (st) { /* the device memory cannot be reached: the host parts are freed, the failure returned */
    free(buf->ptrs);
    free(buf->opened);
    free(buf);
    return st;
  }
  return destroy(buf, op);
}
