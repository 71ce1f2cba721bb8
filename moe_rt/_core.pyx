# cython: language_level=3, boundscheck=False, wraparound=False
"""The C core (moe_rt/lib/libmoe_rt.so, include/moe_rt/moe_rt.h) for the Python ops: one call each, over raw
device pointers (ints), sizes, dtype codes (``DTYPE_CODES``) and a cudaStream_t.

The ops in moe_rt.router and moe_rt.permutation validate their arguments, allocate their results and then
call one function here on CUDA arrays. A :class:`Context` is made once per device (:func:`device`): a core
context over the device's primary context with the kernel cache folder (``moe_rt._jit.cache_dir()``; an op on
a context whose folder has changed since, through MOE_RT_KERNEL_CACHE or MOE_RT_NVRTC_OPTIONS, raises RuntimeError:
its loaded kernels would run the old builds). A call
whose kernels are not loaded yet fails in the core with MOE_RT_ERROR_KERNEL_CACHE before it launches
anything; the call is then planned once in a planning context of the same device facts to learn its kernels,
those are compiled into the cache folder (``moe_rt._jit``), listed in its manifest and loaded into the
device's context, and the call runs again. Every other failure raises: ValueError for bad arguments and bad
expert ids, RuntimeError (with the core's message) for the rest. A planning context (:func:`planning`) runs
the same functions without a device: nothing is launched and :meth:`Context.last_plan` tells the launches.

libmoe_rt.so is opened with dlopen when this module is imported (the path next to this file), so building
this extension needs no library and no CUDA header.
"""
from libc.stdint cimport int32_t, int64_t, uint32_t, uintptr_t
from libc.stdlib cimport getenv
from libc.string cimport memset, strcmp

import functools
import os
import threading

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char* filename, int flag)
    void* dlsym(void* handle, const char* symbol)
    char* dlerror()
    int RTLD_NOW
    int RTLD_LOCAL

cdef extern from "moe_rt/moe_rt.h" nogil:
    ctypedef void* moe_rt_stream
    ctypedef struct moe_rt_context:
        pass
    ctypedef struct moe_rt_device_info:
        int32_t sm_count
        int32_t smem_per_sm
        int32_t smem_per_block_optin
        int32_t cc_major
        int32_t cc_minor
        int32_t assumed_regs
    ctypedef struct moe_rt_launch_info:
        char file[32]
        char kernel[128]
        int64_t grid
        int32_t block
        int32_t shared_mem
        int64_t scalars[2]
    ctypedef struct moe_rt_plan_info:
        int32_t num_launches
        moe_rt_launch_info launch[8]
    ctypedef struct moe_rt_plan:
        int32_t* dst_row
        int32_t* src_slot
        int32_t* seg_start
        int32_t* counts
        int32_t* tokens_per_expert
        int64_t num_tokens, topk, num_experts, num_rows, align_size
    ctypedef struct moe_rt_ll_group:
        pass
    ctypedef struct moe_rt_ll_buffer_set:
        void* recv
        const int64_t* peer_recv
        const int64_t* peer_recv_q
        const int64_t* peer_recv_s
        const int64_t* peer_route
        const int64_t* peer_rw
        const int64_t* peer_back
        const int64_t* peer_bw
        void* recv_q
        float* recv_s
        void* gather
        int32_t* gather_meta
        void* gather_q
        float* gather_s
        void* back_send
        void* back
        float* bw_send
        float* bw
    ctypedef struct moe_rt_ll_group_desc:
        int32_t num_ranks, rank, num_local_experts, max_tokens_per_rank, topk, dtype
        int64_t hidden
        int32_t chunk, num_buffers, fp8, num_scales, dedup, combine_partials, sync
        int64_t timeout_ns
        moe_rt_ll_buffer_set set[2]
        const int64_t* peer_flags
        const int64_t* peer_barrier
        uint32_t* barrier_state
        int32_t* timeout_word
        uint32_t* error_word
        uint32_t* set_epoch
        int32_t transport
        void* comm
    ctypedef struct moe_rt_ll_tables:
        int32_t* idx
        float* w
        int32_t* route
        int32_t* slot_k
        float* slot_w
        int32_t* counts
    ctypedef struct moe_rt_ep_direct_group:
        pass
    ctypedef struct moe_rt_ep_direct_group_desc:
        int32_t num_ranks, rank, node_lo, node_hi, pair_rows
        int64_t timeout_ns
        const int64_t* peer_barrier
        const int64_t* peer_flags
        uint32_t* barrier_state
        int32_t* timeout_word
    ctypedef struct moe_rt_ep_direct_stage:
        int64_t row_bytes
        int32_t topk, align
        void* rows_local
        const int64_t* peer_rows
        float* w_local
        const int64_t* peer_w
    ctypedef struct moe_rt_ep_handle_desc:
        int32_t num_ranks, num_local_experts, max_tokens_per_rank, topk, pair_capacity
        int64_t recv_rows, num_rows
    ctypedef struct moe_rt_ep_direct_handle:
        moe_rt_ep_handle_desc desc
        void* buffer
        int64_t num_tokens
        int32_t exact
    ctypedef struct moe_rt_ep_direct_outputs:
        int32_t fp8, out_dtype, hidden
        void* out
        float* out_s
        float* out_w
        int32_t fill, zero
        void* recv_buf
        int32_t* row_map
        int32_t make_row_map
        int32_t with_w
        int32_t* tokens_per_expert
        int32_t scale
    ctypedef struct moe_rt_ep_prepare_desc:
        moe_rt_ep_handle_desc handle
        int32_t rank, num_experts, align_size, idx_dtype, direct
        int64_t num_tokens, capacity, total_slots
    ctypedef struct moe_rt_ep_prepare_sizes:
        int64_t chunk_tokens, num_chunks, part_words, segment_words
        int32_t fused, whole
    ctypedef struct moe_rt_ep_prepare_buffers:
        void* handle
        const void* topk_idx
        int32_t* part
        uint32_t* grid_sync
        uint32_t* error_word
        uint32_t* state
        const int64_t* peer_box
        int32_t* inbox
        int32_t* outbox
        const int64_t* peer_barrier
        int64_t timeout_ns
        int32_t* timeout_word
        int32_t* workspace
        size_t workspace_bytes

cdef extern from "moe_rt/moe_rt.h" nogil:
    ctypedef struct moe_rt_peer_buffer:
        pass
    ctypedef struct moe_rt_peer_buffer_info:
        void* local
        void* const* ptrs
        int64_t* table
        size_t nbytes
        int32_t nranks, rank, peer_lo, peer_hi

ctypedef int st_t  # moe_rt_status

# ---- the library's functions (dlsym) ---------------------------------------------------------------------
ctypedef const char* (*f_last_error)() nogil
ctypedef st_t (*f_ctx_create)(const char*, int, moe_rt_context**) nogil
ctypedef st_t (*f_ctx_create_planning)(const moe_rt_device_info*, moe_rt_context**) nogil
ctypedef st_t (*f_ctx_load_kernel)(moe_rt_context*, const char*, const char*) nogil
ctypedef st_t (*f_load_stand_in)(moe_rt_context*, const char*, const char*, const char*) nogil
ctypedef st_t (*f_end_stand_ins)(moe_rt_context*, const char*, const char*, int, moe_rt_stream) nogil
ctypedef st_t (*f_last_stand_in)(const moe_rt_context*, int, char*, size_t) nogil
ctypedef void (*f_ctx_destroy)(moe_rt_context*) nogil
ctypedef st_t (*f_ctx_device_info)(const moe_rt_context*, moe_rt_device_info*) nogil
ctypedef st_t (*f_last_plan)(const moe_rt_context*, moe_rt_plan_info*) nogil
ctypedef st_t (*f_check)(moe_rt_context*, moe_rt_stream) nogil
ctypedef st_t (*f_size1)(int64_t, size_t*) nogil
ctypedef st_t (*f_topk)(moe_rt_context*, const void*, int, int64_t, int, int, int, int, int, int, float,
                        const float*, void*, void*, int, float*, moe_rt_stream) nogil
ctypedef st_t (*f_topk_idx)(moe_rt_context*, const void*, int, int64_t, int, int, int, int, int, int, float,
                            const float*, int32_t*, float*, moe_rt_stream) nogil
ctypedef st_t (*f_topk_bwd)(moe_rt_context*, const void*, int, const void*, int, const float*, int64_t, int, int,
                            int, int, float, void*, moe_rt_stream) nogil
ctypedef st_t (*f_scores)(moe_rt_context*, const void*, int, int64_t, int, int, int, float*, void*, int, float*,
                          moe_rt_stream) nogil
ctypedef st_t (*f_scores_bwd)(moe_rt_context*, const float*, const float*, int64_t, int, int, int, void*, int,
                              moe_rt_stream) nogil
ctypedef st_t (*f_aux)(moe_rt_context*, const void*, int, int64_t, int, const void*, int, int64_t, const void*, int,
                       int, int, float, void*, size_t, void*, moe_rt_stream) nogil
ctypedef st_t (*f_plan_ws)(int64_t, int64_t, int, size_t*) nogil
ctypedef st_t (*f_make_plan)(moe_rt_context*, const void*, int, int64_t, int64_t, int, int, int64_t, moe_rt_plan*,
                             void*, size_t, moe_rt_stream) nogil
ctypedef st_t (*f_dispatch)(moe_rt_context*, const moe_rt_plan*, const void*, int, int64_t, const float*, void*,
                            void*, int, moe_rt_stream) nogil
ctypedef st_t (*f_combine)(moe_rt_context*, const moe_rt_plan*, const void*, int, int64_t, const float*, void*,
                           moe_rt_stream) nogil
ctypedef st_t (*f_dispatch_bwd)(moe_rt_context*, const moe_rt_plan*, const void*, int, int64_t, const float*, void*,
                                float*, moe_rt_stream) nogil
ctypedef st_t (*f_combine_bwd)(moe_rt_context*, const moe_rt_plan*, const void*, int, int64_t, const void*,
                               const float*, void*, float*, moe_rt_stream) nogil
ctypedef st_t (*f_copy_kept_rows)(moe_rt_context*, const void*, void*, const int32_t*, int64_t, int64_t, int,
                                  moe_rt_stream) nogil
ctypedef st_t (*f_sort_chunks)(moe_rt_context*, const void*, int64_t, int64_t, const void*, const void*, int, int64_t,
                               const float*, void*, float*, int, void*, size_t, moe_rt_stream) nogil
ctypedef st_t (*f_fp8_q)(moe_rt_context*, const void*, int, int64_t, int64_t, int, void*, float*, moe_rt_stream) nogil
ctypedef st_t (*f_fp8_dq)(moe_rt_context*, const void*, const float*, int64_t, int64_t, int, void*, int,
                          moe_rt_stream) nogil
ctypedef st_t (*f_fp8_rows)(moe_rt_context*, const void*, int, int64_t, int64_t, int, void*, int64_t,
                            moe_rt_stream) nogil
ctypedef st_t (*f_gather_slots)(moe_rt_context*, const float*, const int32_t*, float*, int64_t, moe_rt_stream) nogil
ctypedef st_t (*f_fp8_pack)(moe_rt_context*, const void*, const float*, int64_t, int64_t, int, void*, int64_t,
                            moe_rt_stream) nogil
ctypedef st_t (*f_aux_bwd)(moe_rt_context*, const void*, int, int64_t, int, const void*, int, int64_t, const void*,
                           int, int, int, float, void*, moe_rt_stream) nogil

ctypedef st_t (*f_last_args)(const moe_rt_context*, int, int64_t*, int, int*) nogil
ctypedef st_t (*f_ll_create)(moe_rt_context*, const moe_rt_ll_group_desc*, moe_rt_ll_group**) nogil
ctypedef void (*f_ll_destroy)(moe_rt_ll_group*) nogil
ctypedef int64_t (*f_ll_serial)(const moe_rt_ll_group*) nogil
ctypedef st_t (*f_ll_dispatch)(moe_rt_ll_group*, int, int, const void*, const void*, const float*, int, int,
                               const void*, int, const float*, int64_t, const moe_rt_ll_tables*, moe_rt_stream) nogil
ctypedef st_t (*f_ll_combine)(moe_rt_ll_group*, int, int, const void*, const float*, const moe_rt_ll_tables*, int64_t,
                              void*, float*, moe_rt_stream) nogil
ctypedef st_t (*f_ll_combine_bwd)(moe_rt_ll_group*, int, const void*, const void*, const moe_rt_ll_tables*, int64_t,
                                  float*, moe_rt_stream) nogil
ctypedef st_t (*f_epd_create)(moe_rt_context*, const moe_rt_ep_direct_group_desc*, moe_rt_ep_direct_group**) nogil
ctypedef void (*f_epd_destroy)(moe_rt_ep_direct_group*) nogil
ctypedef st_t (*f_epd_add_stage)(moe_rt_ep_direct_group*, const moe_rt_ep_direct_stage*) nogil
ctypedef st_t (*f_epd_barrier)(moe_rt_ep_direct_group*, int, moe_rt_stream) nogil
ctypedef st_t (*f_epd_dispatch)(moe_rt_ep_direct_group*, int, const moe_rt_ep_direct_handle*, const void*, int64_t,
                                const float*, const moe_rt_ep_direct_outputs*, int, moe_rt_stream) nogil
ctypedef st_t (*f_epd_combine)(moe_rt_ep_direct_group*, int, const moe_rt_ep_direct_handle*, const void*, int, int64_t,
                               const float*, const float*, float*, void*, float*, int, moe_rt_stream) nogil
ctypedef int64_t (*f_epd_serial)(const moe_rt_ep_direct_group*) nogil
ctypedef st_t (*f_pb_create)(moe_rt_context*, void*, size_t, int, int, int, moe_rt_stream, int64_t,
                             moe_rt_peer_buffer**) nogil
ctypedef st_t (*f_pb_info)(const moe_rt_peer_buffer*, moe_rt_peer_buffer_info*) nogil
ctypedef st_t (*f_pb)(moe_rt_peer_buffer*) nogil
ctypedef st_t (*f_epp_sizes)(const moe_rt_ep_prepare_desc*, moe_rt_ep_prepare_sizes*) nogil
ctypedef st_t (*f_epp_step)(moe_rt_context*, const moe_rt_ep_prepare_desc*, const moe_rt_ep_prepare_buffers*,
                            moe_rt_stream) nogil

cdef f_last_error p_last_error
cdef f_last_args p_last_args
cdef f_ll_create p_ll_create
cdef f_ll_destroy p_ll_destroy
cdef f_ll_serial p_ll_serial
cdef f_ll_dispatch p_ll_dispatch
cdef f_ll_combine p_ll_combine
cdef f_ll_combine_bwd p_ll_combine_bwd
cdef f_epd_create p_epd_create
cdef f_pb_create p_pb_create
cdef f_pb_info p_pb_info
cdef f_pb p_pb_close_mappings
cdef f_pb p_pb_destroy
cdef f_epd_destroy p_epd_destroy
cdef f_epd_add_stage p_epd_add_stage
cdef f_epd_barrier p_epd_barrier
cdef f_epd_dispatch p_epd_dispatch
cdef f_epd_combine p_epd_combine
cdef f_epd_serial p_epd_serial
cdef f_epp_sizes p_epp_sizes
cdef f_epp_step p_epp_send
cdef f_epp_step p_epp_meta
cdef f_epp_step p_epp_recv
cdef f_ctx_create p_ctx_create
cdef f_ctx_create_planning p_ctx_create_planning
cdef f_ctx_load_kernel p_ctx_load_kernel
cdef f_load_stand_in p_load_stand_in
cdef f_end_stand_ins p_end_stand_ins
cdef f_last_stand_in p_last_stand_in
cdef f_ctx_destroy p_ctx_destroy
cdef f_ctx_device_info p_ctx_device_info
cdef f_last_plan p_last_plan
cdef f_check p_check
cdef f_size1 p_aux_ws
cdef f_topk p_topk
cdef f_topk_idx p_topk_idx
cdef f_topk_bwd p_topk_bwd
cdef f_scores p_scores
cdef f_scores_bwd p_scores_bwd
cdef f_aux p_aux
cdef f_aux_bwd p_aux_bwd
cdef f_plan_ws p_plan_ws
cdef f_size1 p_chunks_ws
cdef f_make_plan p_make_plan
cdef f_dispatch p_dispatch
cdef f_combine p_combine
cdef f_dispatch_bwd p_dispatch_bwd
cdef f_combine_bwd p_combine_bwd
cdef f_sort_chunks p_sort_chunks
cdef f_copy_kept_rows p_copy_kept_rows
cdef f_fp8_q p_quantize
cdef f_fp8_dq p_dequantize
cdef f_fp8_rows p_quantize_rows
cdef f_fp8_pack p_pack_rows
cdef f_gather_slots p_gather_slots

LIB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libmoe_rt.so")

# moe_rt_dtype codes (include/moe_rt/moe_rt.h), by NumPy dtype name
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int32": 3, "int64": 4, "bool": 5, "uint8": 6, "int8": 7,
               "float8_e4m3fn": 8, "float8_e5m2": 9, "int16": 10}
CODES = {}  # NumPy dtype -> moe_rt_dtype code (bfloat16 and FP8 through ml_dtypes)


def _codes():
    import numpy as np
    for name, code in DTYPE_CODES.items():
        try:
            CODES[np.dtype(name)] = code
        except TypeError:
            import ml_dtypes
            CODES[np.dtype(getattr(ml_dtypes, name))] = code


_codes()
SUCCESS, INVALID_ARGUMENT, NO_DRIVER, NO_DEVICE, KERNEL_CACHE, CUDA, BAD_EXPERT_ID, NOT_SUPPORTED = range(8)
TIMEOUT = 10
# kernels some ops reach outside their plan: the device error word's module (make_plan, the index backward)
ERRORS_KERNEL = ("errors.cu", "error_word_clear")


cdef void* _lib = NULL  # the core library's dlopen handle (_open)


cdef void* _sym(void* h, const char* name) except NULL:
    cdef void* p = dlsym(h, name)
    if p == NULL:
        raise ImportError(f"moe_rt._core: {LIB_PATH} lacks {name.decode()}; rebuild moe_rt "
                          "(python3 setup.py build_ext --inplace)")
    return p


def lib_symbol(bytes name) -> int:
    """The address of the core library's function ``name`` (ImportError where the library lacks it): the
    library this module opened, so that moe_rt._comm binds its functions without opening it again."""
    return <uintptr_t>_sym(_lib, name)


cdef _open():
    global p_last_error, p_ctx_create, p_ctx_create_planning, p_ctx_load_kernel, p_ctx_destroy, p_ctx_device_info
    global p_last_plan, p_check, p_aux_ws, p_topk, p_topk_idx, p_topk_bwd, p_scores, p_scores_bwd, p_aux, p_aux_bwd
    global p_plan_ws, p_chunks_ws, p_make_plan, p_dispatch, p_combine, p_dispatch_bwd, p_combine_bwd, p_sort_chunks
    global p_copy_kept_rows
    global p_quantize, p_dequantize, p_quantize_rows, p_pack_rows, p_gather_slots
    global p_load_stand_in, p_end_stand_ins, p_last_stand_in
    global p_last_args, p_ll_create, p_ll_destroy, p_ll_dispatch, p_ll_combine, p_ll_combine_bwd, p_ll_serial
    global p_epd_create, p_epd_destroy, p_epd_add_stage, p_epd_barrier, p_epd_dispatch, p_epd_combine
    global p_pb_create, p_pb_info, p_pb_close_mappings, p_pb_destroy
    global p_epp_sizes, p_epp_send, p_epp_meta, p_epp_recv, p_epd_serial
    global _lib
    path = LIB_PATH.encode()
    cdef void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL)
    if h == NULL:
        err = dlerror()
        raise ImportError(f"moe_rt._core: cannot load {LIB_PATH} ({err.decode() if err != NULL else '?'}); build "
                          "moe_rt (python3 setup.py build_ext --inplace, or pip install)")
    _lib = h
    p_last_error = <f_last_error>_sym(h, b"moe_rt_last_error")
    p_ctx_create = <f_ctx_create>_sym(h, b"moe_rt_context_create")
    p_ctx_create_planning = <f_ctx_create_planning>_sym(h, b"moe_rt_context_create_planning")
    p_ctx_load_kernel = <f_ctx_load_kernel>_sym(h, b"moe_rt_context_load_kernel")
    p_ctx_destroy = <f_ctx_destroy>_sym(h, b"moe_rt_context_destroy")
    p_load_stand_in = <f_load_stand_in>_sym(h, b"moe_rt_context_load_stand_in")
    p_end_stand_ins = <f_end_stand_ins>_sym(h, b"moe_rt_context_end_stand_ins")
    p_last_stand_in = <f_last_stand_in>_sym(h, b"moe_rt_last_plan_stand_in")
    p_ctx_device_info = <f_ctx_device_info>_sym(h, b"moe_rt_context_device_info")
    p_last_plan = <f_last_plan>_sym(h, b"moe_rt_last_plan")
    p_check = <f_check>_sym(h, b"moe_rt_check")
    p_aux_ws = <f_size1>_sym(h, b"moe_rt_aux_loss_workspace_size")
    p_topk = <f_topk>_sym(h, b"moe_rt_topk_with_score")
    p_topk_idx = <f_topk_idx>_sym(h, b"moe_rt_topk_indices_with_score")
    p_topk_bwd = <f_topk_bwd>_sym(h, b"moe_rt_topk_with_score_backward")
    p_scores = <f_scores>_sym(h, b"moe_rt_scores_for_aux_loss")
    p_scores_bwd = <f_scores_bwd>_sym(h, b"moe_rt_scores_for_aux_loss_backward")
    p_aux = <f_aux>_sym(h, b"moe_rt_aux_loss")
    p_aux_bwd = <f_aux_bwd>_sym(h, b"moe_rt_aux_loss_backward")
    p_plan_ws = <f_plan_ws>_sym(h, b"moe_rt_make_plan_workspace_size")
    p_chunks_ws = <f_size1>_sym(h, b"moe_rt_sort_chunks_workspace_size")
    p_make_plan = <f_make_plan>_sym(h, b"moe_rt_make_plan")
    p_dispatch = <f_dispatch>_sym(h, b"moe_rt_dispatch")
    p_combine = <f_combine>_sym(h, b"moe_rt_combine")
    p_dispatch_bwd = <f_dispatch_bwd>_sym(h, b"moe_rt_dispatch_backward")
    p_combine_bwd = <f_combine_bwd>_sym(h, b"moe_rt_combine_backward")
    p_sort_chunks = <f_sort_chunks>_sym(h, b"moe_rt_sort_chunks")
    p_copy_kept_rows = <f_copy_kept_rows>_sym(h, b"moe_rt_copy_kept_rows")
    p_quantize = <f_fp8_q>_sym(h, b"moe_rt_quantize_fp8")
    p_dequantize = <f_fp8_dq>_sym(h, b"moe_rt_dequantize_fp8")
    p_quantize_rows = <f_fp8_rows>_sym(h, b"moe_rt_quantize_fp8_rows")
    p_pack_rows = <f_fp8_pack>_sym(h, b"moe_rt_pack_fp8_rows")
    p_gather_slots = <f_gather_slots>_sym(h, b"moe_rt_ep_gather_slots")
    p_last_args = <f_last_args>_sym(h, b"moe_rt_last_plan_args")
    p_ll_create = <f_ll_create>_sym(h, b"moe_rt_ll_group_create")
    p_ll_destroy = <f_ll_destroy>_sym(h, b"moe_rt_ll_group_destroy")
    p_ll_serial = <f_ll_serial>_sym(h, b"moe_rt_ll_group_serial")
    p_ll_dispatch = <f_ll_dispatch>_sym(h, b"moe_rt_ll_dispatch")
    p_ll_combine = <f_ll_combine>_sym(h, b"moe_rt_ll_combine")
    p_ll_combine_bwd = <f_ll_combine_bwd>_sym(h, b"moe_rt_ll_combine_bwd")
    p_epd_create = <f_epd_create>_sym(h, b"moe_rt_ep_direct_group_create")
    p_pb_create = <f_pb_create>_sym(h, b"moe_rt_peer_buffer_create")
    p_pb_info = <f_pb_info>_sym(h, b"moe_rt_peer_buffer_get_info")
    p_pb_close_mappings = <f_pb>_sym(h, b"moe_rt_peer_buffer_close_mappings")
    p_pb_destroy = <f_pb>_sym(h, b"moe_rt_peer_buffer_destroy")
    p_epd_destroy = <f_epd_destroy>_sym(h, b"moe_rt_ep_direct_group_destroy")
    p_epd_add_stage = <f_epd_add_stage>_sym(h, b"moe_rt_ep_direct_add_stage")
    p_epd_barrier = <f_epd_barrier>_sym(h, b"moe_rt_ep_direct_barrier")
    p_epd_dispatch = <f_epd_dispatch>_sym(h, b"moe_rt_ep_direct_dispatch")
    p_epd_combine = <f_epd_combine>_sym(h, b"moe_rt_ep_direct_combine")
    p_epd_serial = <f_epd_serial>_sym(h, b"moe_rt_ep_direct_group_serial")
    p_epp_sizes = <f_epp_sizes>_sym(h, b"moe_rt_ep_prepare_sizes_of")
    p_epp_send = <f_epp_step>_sym(h, b"moe_rt_ep_prepare_send")
    p_epp_meta = <f_epp_step>_sym(h, b"moe_rt_ep_prepare_meta")
    p_epp_recv = <f_epp_step>_sym(h, b"moe_rt_ep_prepare_recv")


_open()


def last_error() -> str:
    """The core's message of the last failure on this thread."""
    return p_last_error().decode(errors="replace")


def error(int status, str op):
    """The Python exception of a core status: ValueError for bad arguments and bad expert ids (the core's
    message names the argument), TimeoutError for a wait past its deadline (the message names the op),
    RuntimeError otherwise; the message is the core's."""
    msg = last_error()
    if status == INVALID_ARGUMENT or status == BAD_EXPERT_ID:
        return ValueError(msg)
    if status == TIMEOUT:
        return TimeoutError(msg)
    return RuntimeError(f"moe_rt: {op}: {msg}")


_lock = threading.Lock()
_devices = {}


cdef class Context:
    """A core context: a device's (:func:`device`) or a planning one (:func:`planning`)."""
    cdef moe_rt_context* ctx
    cdef moe_rt_context* plan_ctx  # a device context's planning twin (made when a kernel is first missing)
    cdef readonly int device_id
    cdef readonly bint is_planning
    cdef object arch
    cdef object prepared  # (file, name) loaded through prepare()
    cdef readonly list pending  # (file, name, compiled) of background compiles done, to swap in (_swap)
    cdef readonly object root  # a device context's kernel cache folder (None: a planning context)
    cdef bytes env_cache, env_options, env_xdg  # the variables root was made of, as the op's check (_begin) saw them

    def __cinit__(self):
        self.pending = []

    def __dealloc__(self):
        if self.plan_ctx != NULL:
            p_ctx_destroy(self.plan_ctx)
        if self.ctx != NULL:
            p_ctx_destroy(self.ctx)

    def device_info(self) -> dict:
        cdef moe_rt_device_info d
        _check(p_ctx_device_info(self.ctx, &d), "moe_rt_context_device_info")
        return dict(sm_count=d.sm_count, smem_per_sm=d.smem_per_sm, smem_per_block_optin=d.smem_per_block_optin,
                    cc_major=d.cc_major, cc_minor=d.cc_minor, assumed_regs=d.assumed_regs)

    def last_plan(self) -> list:
        """Planning contexts: the launches of the last op, ``(file, kernel, grid, block, shared_mem,
        (scalar0, scalar1))`` each."""
        return _last_plan(self.ctx)

    def last_plan_args(self, int launch) -> list:
        """Planning contexts: the arguments of launch ``launch`` of the last op (moe_rt_last_plan_args: pointers as
        addresses, integers as values, float32 as their bits; empty for an op that records none)."""
        cdef int64_t vals[64]
        cdef int n = 0
        _check(p_last_args(self.ctx, launch, vals, 64, &n), "moe_rt_last_plan_args")
        return [vals[i] for i in range(n)]

    def check(self, uintptr_t stream=0):
        """Wait for ``stream`` (0 = the legacy default stream) and raise, as ValueError with the CPU path's
        message, the bad expert ids recorded in the device's error word since the last check (moe_rt_check:
        a host sync; the word's module is prepared first where it is not in the kernel cache yet)."""
        cdef int st = p_check(self.ctx, <moe_rt_stream>stream)
        if st == KERNEL_CACHE and not self.is_planning:
            self._prepare([])
            st = p_check(self.ctx, <moe_rt_stream>stream)
        _check(st, "moe_rt_check")

    cdef moe_rt_context* retry(self, moe_rt_context* c, int st, int* tries, const char* op) except NULL:
        """After a failed call on ``c``: the context to call next, or raise. A device context's first
        KERNEL_CACHE failure -> its planning twin (to learn the kernels); the twin's success -> the kernels
        prepared, the device context again."""
        if c == self.ctx:
            if st == KERNEL_CACHE and tries[0] < 2 and not self.is_planning:  # twice: another thread may
                tries[0] += 1                                                    # plan on the twin meanwhile
                return self._twin()
            raise error(st, op.decode())
        if st:
            raise error(st, op.decode() + " (planning its kernels)")
        self._prepare(_last_plan(c), _stand_ins(c))
        return self.ctx

    cdef moe_rt_context* _twin(self) except NULL:
        cdef moe_rt_device_info d
        if self.plan_ctx == NULL:
            _check(p_ctx_device_info(self.ctx, &d), "moe_rt_context_device_info")
            d.assumed_regs = 0
            _check(p_ctx_create_planning(&d, &self.plan_ctx), "moe_rt_context_create_planning")
        return self.plan_ctx

    cdef int _see_env(self) except -1:
        self.env_cache, self.env_options, self.env_xdg = (_env(b"MOE_RT_KERNEL_CACHE"), _env(b"MOE_RT_NVRTC_OPTIONS"),
                                                          _env(b"XDG_CACHE_HOME"))
        return 0

    cdef int _same_folder(self) except -1:
        """A variable the kernel cache folder is made of changed since this context last looked: raise where the
        folder is now another than the context's (its loaded kernels would keep running the old builds), else
        note the values (a change that keeps the folder, e.g. white space in MOE_RT_NVRTC_OPTIONS)."""
        from moe_rt import _jit

        now = _jit.cache_dir()
        if now != self.root:
            raise _jit.folder_changed(self.root, now)
        self._see_env()
        return 0

    def _prepare(self, launches, stand_ins=()):
        """Compile ``launches``' kernels (and the error word's module) into the kernel cache folder, list them
        in its manifest and load them into this device's context. A launch with a stand-in (``stand_ins``, from
        the planner; moe_rt._jit's stand-ins) whose kernel is not in the folder gets the stand-in compiled and
        loaded in its place instead, and its kernel compiled in the background (swapped in by :meth:`_swap`)."""
        from moe_rt import _jit

        root = _jit.cache_dir()
        if self.root is not None and root != self.root:
            raise _jit.folder_changed(self.root, root)
        if self.arch is None:
            info = self.device_info()
            self.arch = _jit.arch_for((info["cc_major"], info["cc_minor"]))
        names, quick = [], []
        for i, l in enumerate(launches):
            q = stand_ins[i] if i < len(stand_ins) else ""
            if q and _jit.wants_stand_in(root, l[0], l[1], self.arch):
                quick.append((l[0], l[1], q))
            else:
                names.append((l[0], l[1]))
        names.append(ERRORS_KERNEL)
        for file, name, q in quick:
            _jit.cache_kernels(root, [(file, q)], self.arch)
            _check(p_load_stand_in(self.ctx, file.encode(), name.encode(), q.encode()),
                   f"loading {q} ({file}) to stand in for {name}")
            _jit.stand_ins_loaded += 1
            _jit.compile_in_background(root, file, name, self.arch, functools.partial(self._compiled, file, name))
        _jit.cache_kernels(root, names, self.arch)
        for file, name in names:
            _jit._failed.discard((root, file, name, self.arch))  # compiled in the foreground after all
            _check(p_ctx_load_kernel(self.ctx, file.encode(), name.encode()), f"loading {name} ({file})")

    def _compiled(self, file, name, ok):
        """A background compile of ``name`` is done (on its thread): swapped in by the next call (:meth:`_swap`)."""
        self.pending.append((file, name, ok))

    def _swap(self, uintptr_t stream):
        """Swap in the kernels compiled in the background since the last call (moe_rt_context_end_stand_ins):
        each is loaded and its stand-ins retired, for every thread at once; a kernel whose compile failed has
        its stand-ins retired alone (the next call that needs it compiles it in the foreground and raises).
        While ``stream`` is being captured into a CUDA graph nothing is loaded: the call runs the stand-in
        (the same bits) and a later call swaps."""
        cdef int st
        for item in list(self.pending):
            file, name, ok = item
            st = p_end_stand_ins(self.ctx, file.encode(), name.encode(), 1 if ok else 0, <moe_rt_stream>stream)
            if st == NOT_SUPPORTED:
                continue
            try:
                self.pending.remove(item)
            except ValueError:  # another thread swapped it meanwhile
                pass
            _check(st, f"loading {name} ({file})")


cdef inline bytes _env(const char* name):
    cdef const char* v = getenv(name)
    return None if v == NULL else <bytes>v


cdef inline bint _env_is(const char* name, bytes seen):
    """The environment variable ``name`` is ``seen`` (None: unset): a scan of the environment, no allocation."""
    cdef const char* v = getenv(name)
    if v == NULL:
        return seen is None
    return seen is not None and strcmp(v, <const char*>seen) == 0


cdef inline moe_rt_context* _begin(Context d, uintptr_t stream) except NULL:
    """The device's context for an op's call, after the kernels compiled in the background since the last call
    are swapped in (:meth:`Context._swap`). Raises RuntimeError where the kernel cache folder is no longer the
    context's (MOE_RT_KERNEL_CACHE, MOE_RT_NVRTC_OPTIONS or XDG_CACHE_HOME changed after it was made): its loaded
    kernels would run the old builds (the check compares the variables' values with those seen: about 70 ns)."""
    if d.root is not None and not (_env_is(b"MOE_RT_NVRTC_OPTIONS", d.env_options)
                                   and _env_is(b"MOE_RT_KERNEL_CACHE", d.env_cache)
                                   and (d.env_cache or _env_is(b"XDG_CACHE_HOME", d.env_xdg))):
        d._same_folder()
    if d.pending:
        d._swap(stream)
    return d.ctx


cdef inline bint _done(Context d, moe_rt_context** c, int st, int* tries, const char* op) except -1:
    """After a call on ``c[0]``: True when it succeeded on the device's context; else ``c[0]`` becomes the context
    to call next (:meth:`Context.retry`), or the failure raises."""
    if st == 0 and c[0] == d.ctx:
        return True
    c[0] = d.retry(c[0], st, tries, op)
    return False


cdef list _stand_ins(const moe_rt_context* c):
    """The stand-in kernel of each launch of a planning context's last plan ("" where none)."""
    cdef moe_rt_plan_info info
    cdef char name[128]
    memset(&info, 0, sizeof(info))
    _check(p_last_plan(c, &info), "moe_rt_last_plan")
    out = []
    for i in range(info.num_launches):
        _check(p_last_stand_in(c, i, name, sizeof(name)), "moe_rt_last_plan_stand_in")
        out.append(name.decode())
    return out


cdef _last_plan(const moe_rt_context* c):
    cdef moe_rt_plan_info info
    memset(&info, 0, sizeof(info))
    _check(p_last_plan(c, &info), "moe_rt_last_plan")
    return [(info.launch[i].file.decode(), info.launch[i].kernel.decode(), info.launch[i].grid,
             info.launch[i].block, info.launch[i].shared_mem, (info.launch[i].scalars[0], info.launch[i].scalars[1]))
            for i in range(info.num_launches)]


cdef inline int _check(int st, str what) except -1:
    if st:
        raise error(st, what)
    return 0


def device(int device_id) -> Context:
    """The core context of CUDA device ``device_id`` (made on first use, kept for the process), with the
    kernel cache folder of :func:`moe_rt._jit.cache_dir` (its manifest made or extended first)."""
    c = _devices.get(device_id)
    if c is not None:
        return c
    with _lock:
        c = _devices.get(device_id)
        if c is None:
            from moe_rt import _jit

            c = Context()
            (<Context>c)._see_env()
            root = _jit.cache_dir()
            for o in _devices.values():  # one folder for the process: the other contexts' kernels came from theirs
                if isinstance(o, Context) and (<Context>o).root is not None and (<Context>o).root != root:
                    raise _jit.folder_changed((<Context>o).root, root)
            # the context reads the folder's manifest when it is made, which must list kernels of the device's
            # architecture: the error word's module is put there first (compiled once, a fraction of a second)
            arch = _jit.arch_for(_jit.device_properties(device_id)["cc"])
            _jit.cache_kernels(root, [ERRORS_KERNEL], arch)
            _check(p_ctx_create(root.encode(), device_id, &(<Context>c).ctx), f"moe_rt_context_create({device_id})")
            (<Context>c).device_id = device_id
            (<Context>c).arch = arch
            (<Context>c).root = root
            _devices[device_id] = c
    return c


def check(device_id=None, uintptr_t stream=0):
    """:meth:`Context.check` on device ``device_id`` (None: every device whose context was made); a device
    without a context ran no core op: nothing to check."""
    for d in (sorted(_devices) if device_id is None else [device_id]):
        c = _devices.get(d)
        if c is not None:
            c.check(stream)


def planning(int sm_count=132, int cc_major=9, int cc_minor=0, int smem_per_sm=228 * 1024,
             int smem_per_block_optin=227 * 1024, int assumed_regs=0) -> Context:
    """A planning context with these device facts (default: an H100's): the ops validate and plan as on a
    device, launch nothing, and :meth:`Context.last_plan` tells what they would have launched."""
    cdef moe_rt_device_info d
    d.sm_count, d.smem_per_sm, d.smem_per_block_optin = sm_count, smem_per_sm, smem_per_block_optin
    d.cc_major, d.cc_minor, d.assumed_regs = cc_major, cc_minor, assumed_regs
    c = Context()
    _check(p_ctx_create_planning(&d, &(<Context>c).ctx), "moe_rt_context_create_planning")
    (<Context>c).is_planning = True
    (<Context>c).device_id = -1
    return c


def aux_loss_workspace_bytes(int64_t num_rows) -> int:
    cdef size_t n = 0
    _check(p_aux_ws(num_rows, &n), "moe_rt_aux_loss_workspace_size")
    return n


def make_plan_workspace_bytes(int64_t num_tokens, int64_t topk, int num_experts) -> int:
    cdef size_t n = 0
    _check(p_plan_ws(num_tokens, topk, num_experts, &n), "moe_rt_make_plan_workspace_size")
    return n


def sort_chunks_workspace_bytes(int64_t num_chunks) -> int:
    cdef size_t n = 0
    _check(p_chunks_ws(num_chunks, &n), "moe_rt_sort_chunks_workspace_size")
    return n


cdef inline int _plan_of(tuple p, moe_rt_plan* out) except -1:
    """A plan as the facade hands it over: (dst_row, src_slot, seg_start, counts, tokens_per_expert pointers,
    num_tokens, topk, num_experts, num_rows, align_size)."""
    out.dst_row = <int32_t*><uintptr_t>p[0]
    out.src_slot = <int32_t*><uintptr_t>p[1]
    out.seg_start = <int32_t*><uintptr_t>p[2]
    out.counts = <int32_t*><uintptr_t>p[3]
    out.tokens_per_expert = <int32_t*><uintptr_t>p[4]
    out.num_tokens, out.topk, out.num_experts, out.num_rows, out.align_size = p[5], p[6], p[7], p[8], p[9]
    return 0


# ---- the ops: pointers are ints (0 = NULL), dtypes moe_rt_dtype codes, ``stream`` a cudaStream_t -------------

def topk_with_score(Context d, uintptr_t logits, int dtype, int64_t T, int E, int K, int score_function, int pre,
                    int G, int g, float scale, uintptr_t bias, uintptr_t probs, uintptr_t routing, int routing_dtype,
                    uintptr_t inter, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_topk(c, <const void*>logits, dtype, T, E, K, score_function, pre, G, g, scale, <const float*>bias,
                    <void*>probs, <void*>routing, routing_dtype, <float*>inter, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_topk_with_score"):
            return


def topk_indices_with_score(Context d, uintptr_t logits, int dtype, int64_t T, int E, int K, int score_function,
                            int pre, int G, int g, float scale, uintptr_t bias, uintptr_t idx, uintptr_t weights,
                            uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_topk_idx(c, <const void*>logits, dtype, T, E, K, score_function, pre, G, g, scale, <const float*>bias,
                        <int32_t*>idx, <float*>weights, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_topk_indices_with_score"):
            return


def topk_with_score_backward(Context d, uintptr_t grad, int dtype, uintptr_t routing, int routing_dtype,
                             uintptr_t inter, int64_t T, int E, int K, int score_function, int pre, float scale,
                             uintptr_t grad_logits, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_topk_bwd(c, <const void*>grad, dtype, <const void*>routing, routing_dtype, <const float*>inter, T, E, K,
                        score_function, pre, scale, <void*>grad_logits, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_topk_with_score_backward"):
            return


def scores_for_aux_loss(Context d, uintptr_t logits, int dtype, int64_t T, int E, int K, int score_function,
                        uintptr_t scores, uintptr_t routing, int routing_dtype, uintptr_t inter, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_scores(c, <const void*>logits, dtype, T, E, K, score_function, <float*>scores, <void*>routing,
                      routing_dtype, <float*>inter, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_scores_for_aux_loss"):
            return


def scores_for_aux_loss_backward(Context d, uintptr_t grad_scores, uintptr_t inter, int64_t T, int E, int K,
                                 int score_function, uintptr_t grad_logits, int grad_dtype, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_scores_bwd(c, <const float*>grad_scores, <const float*>inter, T, E, K, score_function,
                          <void*>grad_logits, grad_dtype, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_scores_for_aux_loss_backward"):
            return


def aux_loss(Context d, uintptr_t probs, int dtype, int64_t R, int C, uintptr_t tpe, int tpe_dtype, int64_t total,
             uintptr_t total_device, int total_dtype, int num_experts, int topk, float coeff, uintptr_t workspace,
             size_t workspace_bytes, uintptr_t out, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_aux(c, <const void*>probs, dtype, R, C, <const void*>tpe, tpe_dtype, total, <const void*>total_device,
                   total_dtype, num_experts, topk, coeff, <void*>workspace, workspace_bytes, <void*>out,
                   <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_aux_loss"):
            return


def aux_loss_backward(Context d, uintptr_t grad, int dtype, int64_t R, int C, uintptr_t tpe, int tpe_dtype,
                      int64_t total, uintptr_t total_device, int total_dtype, int num_experts, int topk, float coeff,
                      uintptr_t grad_probs, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_aux_bwd(c, <const void*>grad, dtype, R, C, <const void*>tpe, tpe_dtype, total,
                       <const void*>total_device, total_dtype, num_experts, topk, coeff, <void*>grad_probs,
                       <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_aux_loss_backward"):
            return


def make_plan(Context d, uintptr_t routing, int routing_dtype, int64_t T, int64_t K, int E, int align_size,
              int64_t num_out_tokens, uintptr_t dst_row, uintptr_t src_slot, uintptr_t seg_start, uintptr_t counts,
              uintptr_t tokens_per_expert, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream):
    """The plan arrays at the given addresses (sized by the caller from num_rows); num_out_tokens -1 = none."""
    cdef moe_rt_plan plan
    memset(&plan, 0, sizeof(plan))
    plan.dst_row, plan.src_slot, plan.seg_start = <int32_t*>dst_row, <int32_t*>src_slot, <int32_t*>seg_start
    plan.counts, plan.tokens_per_expert = <int32_t*>counts, <int32_t*>tokens_per_expert
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_make_plan(c, <const void*>routing, routing_dtype, T, K, E, align_size, num_out_tokens, &plan,
                         <void*>workspace, workspace_bytes, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_make_plan"):
            return


def dispatch(Context d, tuple plan, uintptr_t x, int dtype, int64_t H, uintptr_t probs, uintptr_t x_permuted,
             uintptr_t probs_permuted, int probs_dtype, uintptr_t stream):
    cdef moe_rt_plan p
    _plan_of(plan, &p)
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_dispatch(c, &p, <const void*>x, dtype, H, <const float*>probs, <void*>x_permuted,
                        <void*>probs_permuted, probs_dtype, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_dispatch"):
            return


def combine(Context d, tuple plan, uintptr_t y_permuted, int dtype, int64_t H, uintptr_t probs, uintptr_t y,
            uintptr_t stream):
    cdef moe_rt_plan p
    _plan_of(plan, &p)
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_combine(c, &p, <const void*>y_permuted, dtype, H, <const float*>probs, <void*>y,
                       <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_combine"):
            return


def dispatch_backward(Context d, tuple plan, uintptr_t grad_x_permuted, int dtype, int64_t H,
                      uintptr_t grad_probs_permuted, uintptr_t grad_x, uintptr_t grad_probs, uintptr_t stream):
    cdef moe_rt_plan p
    _plan_of(plan, &p)
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_dispatch_bwd(c, &p, <const void*>grad_x_permuted, dtype, H, <const float*>grad_probs_permuted,
                            <void*>grad_x, <float*>grad_probs, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_dispatch_backward"):
            return


def combine_backward(Context d, tuple plan, uintptr_t grad_y, int dtype, int64_t H, uintptr_t y_permuted,
                     uintptr_t probs, uintptr_t grad_y_permuted, uintptr_t grad_probs, uintptr_t stream):
    cdef moe_rt_plan p
    _plan_of(plan, &p)
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_combine_bwd(c, &p, <const void*>grad_y, dtype, H, <const void*>y_permuted, <const float*>probs,
                           <void*>grad_y_permuted, <float*>grad_probs, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_combine_backward"):
            return


def sort_chunks(Context d, uintptr_t x, int64_t N, int64_t row_bytes, uintptr_t split_sizes,
                uintptr_t sorted_indices, int index_dtype, int64_t S, uintptr_t probs, uintptr_t out,
                uintptr_t probs_out, int backward, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_sort_chunks(c, <const void*>x, N, row_bytes, <const void*>split_sizes, <const void*>sorted_indices,
                           index_dtype, S, <const float*>probs, <void*>out, <float*>probs_out, backward,
                           <void*>workspace, workspace_bytes, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_sort_chunks"):
            return


def copy_kept_rows(Context d, uintptr_t src, uintptr_t out, uintptr_t keep, int64_t N, int64_t row_bytes,
                   int zero_rest, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_copy_kept_rows(c, <const void*>src, <void*>out, <const int32_t*>keep, N, row_bytes, zero_rest,
                              <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_copy_kept_rows"):
            return


def quantize_fp8(Context d, uintptr_t x, int dtype, int64_t T, int64_t H, int block, uintptr_t x_fp8,
                 uintptr_t scales, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_quantize(c, <const void*>x, dtype, T, H, block, <void*>x_fp8, <float*>scales, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_quantize_fp8"):
            return


def quantize_fp8_rows(Context d, uintptr_t x, int dtype, int64_t T, int64_t H, int block, uintptr_t rows,
                      int64_t row_bytes, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_quantize_rows(c, <const void*>x, dtype, T, H, block, <void*>rows, row_bytes, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_quantize_fp8_rows"):
            return


def ep_gather_slots(Context d, uintptr_t slots, uintptr_t src_slot, uintptr_t out, int64_t n, uintptr_t stream):
    """moe_rt_ep_gather_slots: ``out[i] = slots[src_slot[i]]`` (0 where src_slot[i] < 0), i < n."""
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_gather_slots(c, <const float*>slots, <const int32_t*>src_slot, <float*>out, n, <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_ep_gather_slots"):
            return


def pack_fp8_rows(Context d, uintptr_t x_fp8, uintptr_t scales, int64_t T, int64_t H, int block, uintptr_t rows,
                  int64_t row_bytes, uintptr_t stream):
    """moe_rt_pack_fp8_rows: a pre-quantized pair (codes, fp32 scales) into an FP8 dispatch's packed rows."""
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_pack_rows(c, <const void*>x_fp8, <const float*>scales, T, H, block, <void*>rows, row_bytes,
                         <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_pack_fp8_rows"):
            return


def dequantize_fp8(Context d, uintptr_t x_fp8, uintptr_t scales, int64_t T, int64_t H, int block, uintptr_t y,
                   int dtype, uintptr_t stream):
    cdef moe_rt_context* c = _begin(d, stream)
    cdef int tries = 0, st
    while True:
        st = p_dequantize(c, <const void*>x_fp8, <const float*>scales, T, H, block, <void*>y, dtype,
                          <moe_rt_stream>stream)
        if _done(d, &c, st, &tries, b"moe_rt_dequantize_fp8"):
            return


# ---- low-latency expert parallelism (moe_rt.ep_ll.LowLatencyGroup) ---------------------------------------

cdef bint _group_retry(Context d, bint on_group, int st, int* tries, const char* op) except -1:
    """An EP group's :meth:`Context.retry`: after a call on the group (``on_group``) whose kernel is missing from
    the kernel cache, True: plan the call on the group's planning twin next (the caller makes the twin); after
    the twin's call, its kernels compiled and loaded, False: call the group again; any other failure raises."""
    if on_group:
        if st == KERNEL_CACHE and tries[0] < 2 and not d.is_planning:
            tries[0] += 1
            return True
        raise error(st, op.decode())
    if st:
        raise error(st, op.decode() + " (planning its kernels)")
    d._prepare(_last_plan(d.plan_ctx), _stand_ins(d.plan_ctx))
    return False


cdef class LLGroup:
    """A core low-latency EP group (moe_rt_ll_group) on a :class:`Context` (:func:`ll_group_create`), and its
    twin on the context's planning twin (made when a call first meets a kernel missing from the kernel cache:
    the call is planned there to learn its kernels, which are then compiled and loaded, as for the other ops).
    :meth:`destroy` (or the finalizer) frees both; the buffers the group names stay the caller's."""
    cdef moe_rt_ll_group* g
    cdef moe_rt_ll_group* twin
    cdef moe_rt_ll_group_desc desc
    cdef readonly Context ctx

    def __dealloc__(self):
        self.destroy()

    def destroy(self):
        """Free the core group (idempotent)."""
        if self.twin != NULL:
            p_ll_destroy(self.twin)
            self.twin = NULL
        if self.g != NULL:
            p_ll_destroy(self.g)
            self.g = NULL

    @property
    def address(self) -> int:
        """The core group's address (0 once destroyed): with :attr:`serial`, what an XLA custom call names it by
        (the core's registry of live groups checks both; csrc/xla_ffi.c)."""
        return <uintptr_t>self.g

    @property
    def serial(self) -> int:
        """The core group's serial number in this process (moe_rt_ll_group_serial; 0 once destroyed)."""
        return p_ll_serial(self.g) if self.g != NULL else 0

    def prepare(self, str op, int64_t T, int idx_dtype=3):
        """Make the kernels of ``op`` (``dispatch``: a whole dispatch of ``T`` tokens with ``idx_dtype`` indices;
        ``dispatch_fp8``: the same sending FP8 rows quantized in the push and dequantized on arrival;
        ``combine``, ``dispatch_bwd`` (with the weights' gradient) or ``combine_bwd`` (with ``expert_out``, then
        the weight gradient's gather)) ready in the device context, for a caller that launches through the core
        without Python (moe_rt.jax's XLA handlers): the op is planned on the group's planning twin with made-up
        16-byte aligned buffers (XLA's are), its kernels compiled into the kernel cache folder and loaded. A
        no-op for a group on a planning context."""
        cdef Context d = self.ctx
        self.live()
        if d.is_planning:
            return
        if self.twin == NULL:
            _check(p_ll_create(d._twin(), &self.desc, &self.twin), "moe_rt_ll_group_create (planning twin)")
        cdef moe_rt_ll_tables t
        cdef uintptr_t a = 1 << 20  # made-up addresses (a planning context checks them for NULL and alignment)
        t.idx, t.w, t.route = <int32_t*>(a * 1), <float*>(a * 2), <int32_t*>(a * 3)
        t.slot_k, t.slot_w, t.counts = <int32_t*>(a * 4), <float*>(a * 5), <int32_t*>(a * 6)
        cdef const void* x = <const void*>(a * 7)
        cdef const void* y = <const void*>(a * 8)
        cdef float* f = <float*>(a * 9)
        launches = []
        if op in ("dispatch", "dispatch_fp8"):
            q = 1 if op == "dispatch_fp8" else 0
            _check(p_ll_dispatch(self.twin, 0, 3, x, NULL, NULL, q, q, y, idx_dtype, f, T, &t, NULL),
                   "moe_rt_ll_dispatch (planning its kernels)")
            launches = _last_plan(d.plan_ctx)
        elif op in ("combine", "dispatch_bwd"):
            _check(p_ll_combine(self.twin, 0, 2 if op == "combine" else 3, x, NULL if op == "combine" else f, &t, T,
                                <void*>y, NULL if op == "combine" else <float*>(a * 10), NULL),
                   "moe_rt_ll_combine (planning its kernels)")
            launches = _last_plan(d.plan_ctx)
        elif op == "combine_bwd":
            _check(p_ll_combine_bwd(self.twin, 0, x, y, &t, T, f, NULL), "moe_rt_ll_combine_bwd (planning its kernels)")
            launches = _last_plan(d.plan_ctx)
            _check(p_ll_combine(self.twin, 0, 4, NULL, f, &t, T, NULL, <float*>(a * 10), NULL),
                   "moe_rt_ll_combine (planning its kernels)")
            launches += _last_plan(d.plan_ctx)
        else:
            raise ValueError(f"op: expected dispatch, combine, dispatch_bwd or combine_bwd, got {op!r}")
        d._prepare(launches)

    cdef moe_rt_ll_group* live(self) except NULL:
        if self.g == NULL:
            raise ValueError("the low-latency core group was destroyed")
        return self.g

    cdef moe_rt_ll_group* retry(self, moe_rt_ll_group* c, int st, int* tries, const char* op) except NULL:
        """As :meth:`Context.retry`, over the group and its twin."""
        cdef Context d = self.ctx
        if not _group_retry(d, c == self.g, st, tries, op):
            return self.g
        if self.twin == NULL:
            _check(p_ll_create(d._twin(), &self.desc, &self.twin), "moe_rt_ll_group_create (planning twin)")
        return self.twin


cdef inline moe_rt_ll_group* _ll_begin(LLGroup g, uintptr_t stream) except NULL:
    _begin(g.ctx, stream)
    return g.live()


cdef inline bint _ll_done(LLGroup g, moe_rt_ll_group** c, int st, int* tries, const char* op) except -1:
    if st == 0 and c[0] == g.g:
        return True
    c[0] = g.retry(c[0], st, tries, op)
    return False


cdef inline int _tables_of(tuple t, moe_rt_ll_tables* out) except -1:
    """A handle's tables as the facade hands them over: (idx, w, route, slot_k, slot_w, counts) addresses."""
    out.idx = <int32_t*><uintptr_t>t[0]
    out.w = <float*><uintptr_t>t[1]
    out.route = <int32_t*><uintptr_t>t[2]
    out.slot_k = <int32_t*><uintptr_t>t[3]
    out.slot_w = <float*><uintptr_t>t[4]
    out.counts = <int32_t*><uintptr_t>t[5]
    return 0


def ll_group_create(Context d, int R, int rank, int L, int Tmax, int K, int dtype, int64_t H, int chunk,
                    int num_buffers, int fp8, int num_scales, int dedup, int64_t timeout_ns, list sets,
                    uintptr_t peer_flags, uintptr_t peer_barrier, uintptr_t barrier_state, uintptr_t timeout_word,
                    uintptr_t error_word, uintptr_t set_epoch, int combine_partials=0, int sync=0, int transport=0,
                    uintptr_t comm=0, list nccl_sets=None) -> LLGroup:
    """moe_rt_ll_group_create: ``sets`` holds per buffer set ``(recv, peer_recv, peer_recv_q, peer_recv_s,
    peer_route, peer_rw, peer_back, peer_bw)`` addresses (0 = NULL); ``combine_partials`` desc's field (1: rank
    partials in combine), ``sync`` desc's field (0: MOE_RT_LL_SYNC_BARRIER, 1: MOE_RT_LL_SYNC_PAIRWISE),
    ``transport`` desc's field (0 direct, 1 NCCL), ``comm`` the moe_rt_comm address (NCCL transport), ``nccl_sets``
    per buffer set the NCCL regions ``(recv_q, recv_s, gather, gather_meta, gather_q, gather_s, back_send, back,
    bw_send, bw)``; ValueError for a bad field."""
    cdef LLGroup g = LLGroup()
    memset(&g.desc, 0, sizeof(g.desc))
    g.desc.num_ranks, g.desc.rank, g.desc.num_local_experts, g.desc.max_tokens_per_rank = R, rank, L, Tmax
    g.desc.topk, g.desc.dtype, g.desc.hidden, g.desc.chunk, g.desc.num_buffers = K, dtype, H, chunk, num_buffers
    g.desc.fp8, g.desc.num_scales, g.desc.dedup, g.desc.timeout_ns = fp8, num_scales, dedup, timeout_ns
    g.desc.combine_partials, g.desc.sync = combine_partials, sync
    if len(sets) > 2:
        raise ValueError(f"sets: at most 2 buffer sets, got {len(sets)}")
    cdef uintptr_t a
    for b, s in enumerate(sets):
        if len(s) != 8:
            raise ValueError(f"sets[{b}]: expected 8 addresses, got {len(s)}")
        a = s[0]
        g.desc.set[b].recv = <void*>a
        a = s[1]
        g.desc.set[b].peer_recv = <const int64_t*>a
        a = s[2]
        g.desc.set[b].peer_recv_q = <const int64_t*>a
        a = s[3]
        g.desc.set[b].peer_recv_s = <const int64_t*>a
        a = s[4]
        g.desc.set[b].peer_route = <const int64_t*>a
        a = s[5]
        g.desc.set[b].peer_rw = <const int64_t*>a
        a = s[6]
        g.desc.set[b].peer_back = <const int64_t*>a
        a = s[7]
        g.desc.set[b].peer_bw = <const int64_t*>a
    for b, s in enumerate(nccl_sets or ()):
        if b >= 2 or len(s) != 10:
            raise ValueError(f"nccl_sets[{b}]: expected at most 2 sets of 10 addresses")
        a = s[0]
        g.desc.set[b].recv_q = <void*>a
        a = s[1]
        g.desc.set[b].recv_s = <float*>a
        a = s[2]
        g.desc.set[b].gather = <void*>a
        a = s[3]
        g.desc.set[b].gather_meta = <int32_t*>a
        a = s[4]
        g.desc.set[b].gather_q = <void*>a
        a = s[5]
        g.desc.set[b].gather_s = <float*>a
        a = s[6]
        g.desc.set[b].back_send = <void*>a
        a = s[7]
        g.desc.set[b].back = <void*>a
        a = s[8]
        g.desc.set[b].bw_send = <float*>a
        a = s[9]
        g.desc.set[b].bw = <float*>a
    g.desc.transport, g.desc.comm = transport, <void*>comm
    g.desc.peer_flags, g.desc.peer_barrier = <const int64_t*>peer_flags, <const int64_t*>peer_barrier
    g.desc.barrier_state, g.desc.timeout_word = <uint32_t*>barrier_state, <int32_t*>timeout_word
    g.desc.error_word, g.desc.set_epoch = <uint32_t*>error_word, <uint32_t*>set_epoch
    g.ctx = d
    _check(p_ll_create(d.ctx, &g.desc, &g.g), "moe_rt_ll_group_create")
    return g


def ll_dispatch(LLGroup g, int buffer_set, int phases, uintptr_t x, uintptr_t x_fp8, uintptr_t x_scales, int fp8,
                int dequantize, uintptr_t idx, int idx_dtype, uintptr_t w, int64_t T, tuple tables, uintptr_t stream):
    """moe_rt_ll_dispatch; ``tables``: the handle's six table addresses (idx, w, route, slot_k, slot_w, counts)."""
    cdef moe_rt_ll_tables t
    _tables_of(tables, &t)
    cdef moe_rt_ll_group* c = _ll_begin(g, stream)
    cdef int tries = 0, st
    while True:
        st = p_ll_dispatch(c, buffer_set, phases, <const void*>x, <const void*>x_fp8, <const float*>x_scales, fp8,
                           dequantize, <const void*>idx, idx_dtype, <const float*>w, T, &t, <moe_rt_stream>stream)
        if _ll_done(g, &c, st, &tries, b"moe_rt_ll_dispatch"):
            return


def ll_combine(LLGroup g, int buffer_set, int op, uintptr_t y, uintptr_t slot_grads, tuple tables, int64_t T,
               uintptr_t out, uintptr_t grad_w, uintptr_t stream):
    """moe_rt_ll_combine (``op``: moe_rt._ep_direct.OP_CODES' combine, dispatch_bwd or combine_bwd)."""
    cdef moe_rt_ll_tables t
    _tables_of(tables, &t)
    cdef moe_rt_ll_group* c = _ll_begin(g, stream)
    cdef int tries = 0, st
    while True:
        st = p_ll_combine(c, buffer_set, op, <const void*>y, <const float*>slot_grads, &t, T, <void*>out,
                          <float*>grad_w, <moe_rt_stream>stream)
        if _ll_done(g, &c, st, &tries, b"moe_rt_ll_combine"):
            return


def ll_combine_bwd(LLGroup g, int buffer_set, uintptr_t grad_out, uintptr_t expert_out, tuple tables, int64_t T,
                   uintptr_t dots, uintptr_t stream):
    """moe_rt_ll_combine_bwd."""
    cdef moe_rt_ll_tables t
    _tables_of(tables, &t)
    cdef moe_rt_ll_group* c = _ll_begin(g, stream)
    cdef int tries = 0, st
    while True:
        st = p_ll_combine_bwd(c, buffer_set, <const void*>grad_out, <const void*>expert_out, &t, T, <float*>dots,
                              <moe_rt_stream>stream)
        if _ll_done(g, &c, st, &tries, b"moe_rt_ll_combine_bwd"):
            return


# ---- the direct transport of the normal EP mode (moe_rt._ep_direct.DirectTransport) ------------------------

cdef class EpDirectGroup:
    """A core direct EP group (moe_rt_ep_direct_group) on a :class:`Context` (:func:`ep_direct_group_create`), and
    its twin on the context's planning twin (made when a call first meets a kernel missing from the kernel cache,
    as :class:`LLGroup`'s). Stage pairs added (:meth:`add_stage`) go to both. :meth:`destroy` (or the finalizer)
    frees both; the buffers the group names stay the caller's."""
    cdef moe_rt_ep_direct_group* g
    cdef moe_rt_ep_direct_group* twin
    cdef moe_rt_ep_direct_group_desc desc
    cdef list stages
    cdef readonly Context ctx

    def __dealloc__(self):
        self.destroy()

    def destroy(self):
        """Free the core group (idempotent)."""
        if self.twin != NULL:
            p_epd_destroy(self.twin)
            self.twin = NULL
        if self.g != NULL:
            p_epd_destroy(self.g)
            self.g = NULL

    def add_stage(self, int64_t row_bytes, int topk, int align, uintptr_t rows_local, uintptr_t peer_rows,
                  uintptr_t w_local, uintptr_t peer_w):
        """moe_rt_ep_direct_add_stage: a receive stage pair (rows of ``row_bytes``, ``topk`` fp32 weights)."""
        t = (row_bytes, topk, align, rows_local, peer_rows, w_local, peer_w)
        _epd_add(self.live(), t, "moe_rt_ep_direct_add_stage")
        if self.twin != NULL:
            _epd_add(self.twin, t, "moe_rt_ep_direct_add_stage (planning twin)")
        self.stages.append(t)

    @property
    def address(self) -> int:
        """The core group's address (0 once destroyed): with :attr:`serial`, what an XLA custom call names it by
        (the core's registry of live direct groups checks both; csrc/xla_ffi.c ep_call)."""
        return <uintptr_t>self.g

    @property
    def serial(self) -> int:
        """The core group's serial number in this process (moe_rt_ep_direct_group_serial; 0 once destroyed)."""
        return p_epd_serial(self.g) if self.g != NULL else 0

    def prepare(self, str op, tuple handle, int64_t row_bytes, int dtype, int64_t hidden, bint with_w, bint zero=True):
        """Make the kernels of ``op`` ready in the device context for a caller that launches through the core
        without Python (moe_rt.jax's XLA handlers, csrc/xla_ffi.c ep_*): ``dispatch`` (rows of ``row_bytes``,
        expanded with their padding zeroed when ``zero``, weights when ``with_w``), ``combine`` (``dtype`` rows of
        ``hidden``, weighted when ``with_w``), ``dispatch_bwd`` (with the weights' gradient when ``with_w``),
        ``combine_bwd`` (expanded rows, or with ``with_w`` the rows left in the stage) or ``barrier``; planned on
        the group's planning twin with made-up 16-byte aligned buffers, its kernels compiled into the kernel
        cache folder and loaded. ``handle`` as :func:`ep_direct_dispatch`'s (its buffer address unused). A no-op
        on a planning context."""
        cdef Context d = self.ctx
        self.live()
        if d.is_planning:
            return
        if self.twin == NULL:
            _check(p_epd_create(d._twin(), &self.desc, &self.twin), "moe_rt_ep_direct_group_create (planning twin)")
            for t in self.stages:
                _epd_add(self.twin, t, "moe_rt_ep_direct_add_stage (planning twin)")
        cdef moe_rt_ep_direct_group* twin = self.twin
        cdef moe_rt_ep_direct_handle h
        cdef moe_rt_ep_direct_outputs o
        cdef uintptr_t a = 1 << 20  # made-up addresses (a planning context checks them for NULL and alignment)
        _epd_handle(handle, &h)
        h.buffer = <void*>(a * 1)
        memset(&o, 0, sizeof(o))
        cdef const void* x = <const void*>(a * 2)
        cdef void* out = <void*>(a * 3)
        cdef float* f1 = <float*>(a * 4)
        cdef float* f2 = <float*>(a * 5)
        cdef float* f3 = <float*>(a * 6)
        if op == "dispatch":
            o.out, o.out_w, o.fill, o.zero, o.with_w = out, (f1 if with_w else NULL), 1, zero, with_w
            _check(p_epd_dispatch(twin, 1, &h, x, row_bytes, f2 if with_w else NULL, &o, 1, NULL),
                   "moe_rt_ep_direct_dispatch (planning its kernels)")
        elif op == "combine_bwd":
            o.zero = 1
            if not with_w:
                o.out, o.fill = out, 1
            _check(p_epd_dispatch(twin, 4, &h, x, row_bytes, NULL, &o, 1, NULL),
                   "moe_rt_ep_direct_dispatch (planning its kernels)")
        elif op == "combine":
            _check(p_epd_combine(twin, 2, &h, x, dtype, hidden, f1 if with_w else NULL, NULL, NULL, out, NULL, 1,
                                 NULL), "moe_rt_ep_direct_combine (planning its kernels)")
        elif op == "dispatch_bwd":
            _check(p_epd_combine(twin, 3, &h, x, dtype, hidden, NULL, f1 if with_w else NULL, f2 if with_w else NULL,
                                 out, f3 if with_w else NULL, 1, NULL),
                   "moe_rt_ep_direct_combine (planning its kernels)")
        elif op == "barrier":
            _check(p_epd_barrier(twin, 6, NULL), "moe_rt_ep_direct_barrier (planning its kernels)")
        else:
            raise ValueError(f"op: expected dispatch, combine, dispatch_bwd, combine_bwd or barrier, got {op!r}")
        d._prepare(_last_plan(d.plan_ctx))

    cdef moe_rt_ep_direct_group* live(self) except NULL:
        if self.g == NULL:
            raise ValueError("the direct EP core group was destroyed")
        return self.g

    cdef moe_rt_ep_direct_group* retry(self, moe_rt_ep_direct_group* c, int st, int* tries,
                                       const char* op) except NULL:
        """As :meth:`Context.retry`, over the group and its twin."""
        cdef Context d = self.ctx
        if not _group_retry(d, c == self.g, st, tries, op):
            return self.g
        if self.twin == NULL:
            _check(p_epd_create(d._twin(), &self.desc, &self.twin), "moe_rt_ep_direct_group_create (planning twin)")
            for t in self.stages:
                _epd_add(self.twin, t, "moe_rt_ep_direct_add_stage (planning twin)")
        return self.twin


cdef int _epd_add(moe_rt_ep_direct_group* g, tuple t, str what) except -1:
    cdef moe_rt_ep_direct_stage s
    s.row_bytes, s.topk, s.align = t[0], t[1], t[2]
    s.rows_local, s.peer_rows = <void*><uintptr_t>t[3], <const int64_t*><uintptr_t>t[4]
    s.w_local, s.peer_w = <float*><uintptr_t>t[5], <const int64_t*><uintptr_t>t[6]
    return _check(p_epd_add_stage(g, &s), what)


cdef inline moe_rt_ep_direct_group* _epd_begin(EpDirectGroup g, uintptr_t stream) except NULL:
    _begin(g.ctx, stream)
    return g.live()


cdef inline bint _epd_done(EpDirectGroup g, moe_rt_ep_direct_group** c, int st, int* tries, const char* op) except -1:
    if st == 0 and c[0] == g.g:
        return True
    c[0] = g.retry(c[0], st, tries, op)
    return False


cdef inline int _epd_handle(tuple h, moe_rt_ep_direct_handle* out) except -1:
    """A handle as the facade hands it over: (buffer, R, L, Tmax, K, P, rows, N, T, exact)."""
    memset(out, 0, sizeof(out[0]))
    out.buffer = <void*><uintptr_t>h[0]
    out.desc.num_ranks, out.desc.num_local_experts, out.desc.max_tokens_per_rank = h[1], h[2], h[3]
    out.desc.topk, out.desc.pair_capacity, out.desc.recv_rows, out.desc.num_rows = h[4], h[5], h[6], h[7]
    out.num_tokens, out.exact = h[8], h[9]
    return 0


def ep_direct_group_create(Context d, int R, int rank, int node_lo, int node_hi, int pair_rows, int64_t timeout_ns,
                           uintptr_t peer_barrier, uintptr_t peer_flags, uintptr_t barrier_state,
                           uintptr_t timeout_word) -> EpDirectGroup:
    """moe_rt_ep_direct_group_create; ValueError for a bad field."""
    cdef EpDirectGroup g = EpDirectGroup()
    memset(&g.desc, 0, sizeof(g.desc))
    g.desc.num_ranks, g.desc.rank, g.desc.node_lo, g.desc.node_hi = R, rank, node_lo, node_hi
    g.desc.pair_rows, g.desc.timeout_ns = pair_rows, timeout_ns
    g.desc.peer_barrier, g.desc.peer_flags = <const int64_t*>peer_barrier, <const int64_t*>peer_flags
    g.desc.barrier_state, g.desc.timeout_word = <uint32_t*>barrier_state, <int32_t*>timeout_word
    g.stages = []
    g.ctx = d
    _check(p_epd_create(d.ctx, &g.desc, &g.g), "moe_rt_ep_direct_group_create")
    return g


# ---- peer buffers (moe_rt._ep_direct._Shared) --------------------------------------------------------------

cdef class PeerBuffer:
    """A core peer buffer (moe_rt_peer_buffer, :func:`peer_buffer_create`): ``local`` (this rank's allocation),
    ``ptrs`` (every rank's as mapped here, 0 outside the mapped ranks), ``table`` (the device int64 [R] table's
    address), ``nbytes``. Released by its owner alone (:meth:`close_mappings`, then :meth:`destroy` once the
    device is done with it; no finalizer: peers may still write into it until their last barrier)."""
    cdef moe_rt_peer_buffer* b
    cdef readonly Context ctx
    cdef readonly uintptr_t local
    cdef readonly uintptr_t table
    cdef readonly size_t nbytes
    cdef readonly tuple ptrs

    def close_mappings(self):
        """moe_rt_peer_buffer_close_mappings (idempotent)."""
        if self.b != NULL:
            _check(p_pb_close_mappings(self.b), "moe_rt_peer_buffer_close_mappings")

    def destroy(self):
        """moe_rt_peer_buffer_destroy: close any mapping left, free the allocation and the table (idempotent)."""
        cdef moe_rt_peer_buffer* b = self.b
        if b == NULL:
            return
        self.b = NULL
        self.local = self.table = 0
        _check(p_pb_destroy(b), "moe_rt_peer_buffer_destroy")


def peer_buffer_create(Context d, uintptr_t comm, size_t nbytes, bint zero, int peer_lo, int peer_hi,
                       uintptr_t stream, int64_t timeout_ms) -> PeerBuffer:
    """moe_rt_peer_buffer_create on ``d`` (a collective over the core communicator ``comm``, a moe_rt_comm*; 0 for
    one rank): ValueError for a bad argument, TimeoutError when the exchange ran past ``timeout_ms`` (the core
    aborted the communicator), RuntimeError otherwise."""
    cdef moe_rt_peer_buffer* b = NULL
    cdef moe_rt_peer_buffer_info info
    cdef int st
    with nogil:
        st = p_pb_create(d.ctx, <void*>comm, nbytes, 1 if zero else 0, peer_lo, peer_hi, <moe_rt_stream>stream,
                         timeout_ms, &b)
    _check(st, "moe_rt_peer_buffer_create")
    cdef PeerBuffer pb = PeerBuffer()
    pb.b, pb.ctx = b, d
    _check(p_pb_info(b, &info), "moe_rt_peer_buffer_get_info")
    pb.local, pb.table, pb.nbytes = <uintptr_t>info.local, <uintptr_t>info.table, info.nbytes
    ptrs = []
    for r in range(info.nranks):
        ptrs.append(<uintptr_t>info.ptrs[r])
    pb.ptrs = tuple(ptrs)
    return pb


def ep_direct_barrier(EpDirectGroup g, int op, uintptr_t stream):
    """moe_rt_ep_direct_barrier (``op``: moe_rt._ep_direct.OP_CODES)."""
    cdef moe_rt_ep_direct_group* c = _epd_begin(g, stream)
    cdef int tries = 0, st
    while True:
        st = p_epd_barrier(c, op, <moe_rt_stream>stream)
        if _epd_done(g, &c, st, &tries, b"moe_rt_ep_direct_barrier"):
            return


def ep_direct_dispatch(EpDirectGroup g, int op, tuple handle, uintptr_t x, int64_t row_bytes, uintptr_t w, int fp8,
                       int out_dtype, int hidden, uintptr_t out, uintptr_t out_s, uintptr_t out_w, int fill, int zero,
                       uintptr_t recv_buf, uintptr_t row_map, int make_row_map, int barrier, uintptr_t stream,
                       int with_w, uintptr_t tokens_per_expert=0, int scale=0):
    """moe_rt_ep_direct_dispatch; ``handle``: (buffer, R, L, Tmax, K, P, rows, N, T, exact); ``with_w``: whether
    weights travel (said, not read off ``w``: an empty ``w`` on a rank without tokens has address 0);
    ``tokens_per_expert``: the address of an int32 ``[L]`` output the core copies the handle's counts into after
    the launches (dispatch's third result; 0: none); ``scale``: combine_bwd's rows weighted by their slots'
    weights (``out_dtype`` the rows' dtype)."""
    cdef moe_rt_ep_direct_handle h
    cdef moe_rt_ep_direct_outputs o
    _epd_handle(handle, &h)
    memset(&o, 0, sizeof(o))
    o.fp8, o.out_dtype, o.hidden = fp8, out_dtype, hidden
    o.out, o.out_s, o.out_w = <void*>out, <float*>out_s, <float*>out_w
    o.fill, o.zero, o.recv_buf = fill, zero, <void*>recv_buf
    o.row_map, o.make_row_map = <int32_t*>row_map, make_row_map
    o.with_w = with_w
    o.tokens_per_expert = <int32_t*>tokens_per_expert
    o.scale = scale
    cdef moe_rt_ep_direct_group* c = _epd_begin(g, stream)
    cdef int tries = 0, st
    while True:
        st = p_epd_dispatch(c, op, &h, <const void*>x, row_bytes, <const float*>w, &o, barrier, <moe_rt_stream>stream)
        if _epd_done(g, &c, st, &tries, b"moe_rt_ep_direct_dispatch"):
            return


def ep_direct_combine(EpDirectGroup g, int op, tuple handle, uintptr_t y, int dtype, int64_t hidden, uintptr_t w,
                      uintptr_t grad_rows, uintptr_t slot_grads, uintptr_t out, uintptr_t grad_w, int barrier,
                      uintptr_t stream):
    """moe_rt_ep_direct_combine; ``handle`` as :func:`ep_direct_dispatch`'s."""
    cdef moe_rt_ep_direct_handle h
    _epd_handle(handle, &h)
    cdef moe_rt_ep_direct_group* c = _epd_begin(g, stream)
    cdef int tries = 0, st
    while True:
        st = p_epd_combine(c, op, &h, <const void*>y, dtype, hidden, <const float*>w, <const float*>grad_rows,
                           <float*>slot_grads, <void*>out, <float*>grad_w, barrier, <moe_rt_stream>stream)
        if _epd_done(g, &c, st, &tries, b"moe_rt_ep_direct_combine"):
            return


# ---- EpGroup.prepare's launches (csrc/ep_prepare.c) -----------------------------------------------------------

cdef int _epp_desc(tuple t, moe_rt_ep_prepare_desc* d) except -1:
    """A prepare signature as the facade hands it over: (R, rank, L, E, Tmax, K, P, A, T, capacity (-1 exact),
    idx dtype code, direct, rows, N, total_slots)."""
    memset(d, 0, sizeof(d[0]))
    d.handle.num_ranks, d.rank, d.handle.num_local_experts, d.num_experts = t[0], t[1], t[2], t[3]
    d.handle.max_tokens_per_rank, d.handle.topk, d.handle.pair_capacity, d.align_size = t[4], t[5], t[6], t[7]
    d.num_tokens, d.capacity, d.idx_dtype, d.direct = t[8], t[9], t[10], t[11]
    d.handle.recv_rows, d.handle.num_rows, d.total_slots = t[12], t[13], t[14]
    return 0


cdef int _epp_bufs(tuple t, moe_rt_ep_prepare_buffers* b) except -1:
    """Prepare's buffers as addresses: (handle, topk_idx, part, grid_sync, error_word, state, peer_box, inbox,
    outbox, peer_barrier, timeout_ns, timeout_word, workspace, workspace_bytes)."""
    memset(b, 0, sizeof(b[0]))
    b.handle, b.topk_idx = <void*><uintptr_t>t[0], <const void*><uintptr_t>t[1]
    b.part, b.grid_sync = <int32_t*><uintptr_t>t[2], <uint32_t*><uintptr_t>t[3]
    b.error_word, b.state = <uint32_t*><uintptr_t>t[4], <uint32_t*><uintptr_t>t[5]
    b.peer_box, b.inbox, b.outbox = <const int64_t*><uintptr_t>t[6], <int32_t*><uintptr_t>t[7], <int32_t*><uintptr_t>t[8]
    b.peer_barrier, b.timeout_ns = <const int64_t*><uintptr_t>t[9], t[10]
    b.timeout_word, b.workspace, b.workspace_bytes = <int32_t*><uintptr_t>t[11], <int32_t*><uintptr_t>t[12], t[13]
    return 0


def ep_prepare_sizes(tuple desc) -> tuple:
    """moe_rt_ep_prepare_sizes_of: (chunk_tokens, num_chunks, part_words, segment_words, fused, whole) of a
    signature (see :func:`ep_prepare`); ValueError for a bad one."""
    cdef moe_rt_ep_prepare_desc d
    cdef moe_rt_ep_prepare_sizes s
    _epp_desc(desc, &d)
    _check(p_epp_sizes(&d, &s), "moe_rt_ep_prepare_sizes_of")
    return s.chunk_tokens, s.num_chunks, s.part_words, s.segment_words, bool(s.fused), bool(s.whole)


def ep_prepare_kernels(Context ctx, tuple desc):
    """Make the kernels of prepare with signature ``desc`` (:func:`ep_prepare`'s; capacity mode) ready in ``ctx``
    for a caller that launches through the core without Python (moe_rt.jax's XLA handler, csrc/xla_ffi.c
    ep_prepare): moe_rt_ep_prepare_send and, unless it makes the whole prepare, moe_rt_ep_prepare_recv planned on
    the context's planning twin with made-up buffers, their kernels compiled and loaded. A no-op on a planning
    context."""
    if ctx.is_planning:
        return
    cdef moe_rt_ep_prepare_desc d
    cdef moe_rt_ep_prepare_sizes s
    cdef moe_rt_ep_prepare_buffers b
    _epp_desc(desc, &d)
    _check(p_epp_sizes(&d, &s), "moe_rt_ep_prepare_sizes_of")
    a = 1 << 20
    _epp_bufs((a, a * 2, a * 3, a * 4, a * 5, a * 6 if d.direct else 0, a * 7 if d.direct else 0, a * 8,
               0 if d.direct else a * 9, a * 10, 1, a * 11, 0 if s.fused else a * 12,
               0 if s.fused else 1 << 16), &b)
    cdef moe_rt_context* twin = ctx._twin()
    _check(p_epp_send(twin, &d, &b, NULL), "moe_rt_ep_prepare_send (planning its kernels)")
    launches = _last_plan(ctx.plan_ctx)
    if not s.whole:
        _check(p_epp_recv(twin, &d, &b, NULL), "moe_rt_ep_prepare_recv (planning its kernels)")
        launches += _last_plan(ctx.plan_ctx)
    ctx._prepare(launches)


def ep_prepare(Context ctx, int step, tuple desc, tuple bufs, uintptr_t stream):
    """One step of EpGroup.prepare's launches: ``step`` 0 moe_rt_ep_prepare_send (the whole prepare where the
    sizes say ``whole``), 1 moe_rt_ep_prepare_meta (exact mode), 2 moe_rt_ep_prepare_recv. ``desc``: the
    signature (_epp_desc), ``bufs``: the addresses (_epp_bufs)."""
    cdef moe_rt_ep_prepare_desc d
    cdef moe_rt_ep_prepare_buffers b
    _epp_desc(desc, &d)
    _epp_bufs(bufs, &b)
    cdef f_epp_step f = p_epp_send if step == 0 else p_epp_meta if step == 1 else p_epp_recv
    cdef const char* name = (b"moe_rt_ep_prepare_send" if step == 0 else b"moe_rt_ep_prepare_meta" if step == 1
                             else b"moe_rt_ep_prepare_recv")
    cdef moe_rt_context* c = _begin(ctx, stream)
    cdef int tries = 0, st
    while True:
        st = f(c, &d, &b, <moe_rt_stream>stream)
        if _done(ctx, &c, st, &tries, name):
            return
