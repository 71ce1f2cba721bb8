# NCCL C API, declared by hand (the ABI of nccl.h, NCCL >= 2.18). No NCCL or CUDA header is needed to
# build; the library is dlopen'ed at run time and every entry point is resolved with dlsym.
from libc.stddef cimport size_t

ctypedef void* cudaStream_t
ctypedef void* ncclComm_t
ctypedef int ncclResult_t

cdef enum:
    NCCL_UNIQUE_ID_BYTES = 128

ctypedef struct ncclUniqueId:
    char internal[128]

# ncclResult_t values
cdef enum:
    ncclSuccess = 0
    ncclUnhandledCudaError = 1
    ncclSystemError = 2
    ncclInternalError = 3
    ncclInvalidArgument = 4
    ncclInvalidUsage = 5
    ncclRemoteError = 6
    ncclInProgress = 7

# ncclDataType_t values
cdef enum:
    ncclInt8 = 0
    ncclUint8 = 1
    ncclInt32 = 2
    ncclUint32 = 3
    ncclInt64 = 4
    ncclUint64 = 5
    ncclFloat16 = 6
    ncclFloat32 = 7
    ncclFloat64 = 8
    ncclBfloat16 = 9

# ncclRedOp_t
cdef enum:
    ncclSum = 0
    ncclMax = 2

ctypedef ncclResult_t (*ncclGetVersion_t)(int*) noexcept nogil
ctypedef ncclResult_t (*ncclGetUniqueId_t)(ncclUniqueId*) noexcept nogil
ctypedef ncclResult_t (*ncclCommInitRank_t)(ncclComm_t*, int, ncclUniqueId, int) noexcept nogil
ctypedef ncclResult_t (*ncclCommDestroy_t)(ncclComm_t) noexcept nogil
ctypedef ncclResult_t (*ncclCommAbort_t)(ncclComm_t) noexcept nogil
ctypedef ncclResult_t (*ncclCommGetAsyncError_t)(ncclComm_t, ncclResult_t*) noexcept nogil
ctypedef ncclResult_t (*ncclCommCount_t)(ncclComm_t, int*) noexcept nogil
ctypedef ncclResult_t (*ncclCommUserRank_t)(ncclComm_t, int*) noexcept nogil
ctypedef const char* (*ncclGetErrorString_t)(ncclResult_t) noexcept nogil
ctypedef const char* (*ncclGetLastError_t)(ncclComm_t) noexcept nogil
ctypedef ncclResult_t (*ncclGroupStart_t)() noexcept nogil
ctypedef ncclResult_t (*ncclGroupEnd_t)() noexcept nogil
ctypedef ncclResult_t (*ncclSend_t)(const void*, size_t, int, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*ncclRecv_t)(void*, size_t, int, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*ncclAllGather_t)(const void*, void*, size_t, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*ncclAllReduce_t)(const void*, void*, size_t, int, int, ncclComm_t,
                                         cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*ncclBroadcast_t)(const void*, void*, size_t, int, int, ncclComm_t,
                                         cudaStream_t) noexcept nogil
