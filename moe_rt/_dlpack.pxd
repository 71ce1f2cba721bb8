# DLPack C structures, declared by hand from dlpack.h (v1.x ABI); no header is needed at build time.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from *:
    """
    typedef struct { int32_t device_type; int32_t device_id; } moe_rt_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } moe_rt_DLDataType;
    typedef struct {
      void* data; moe_rt_DLDevice device; int32_t ndim; moe_rt_DLDataType dtype;
      int64_t* shape; int64_t* strides; uint64_t byte_offset;
    } moe_rt_DLTensor;
    typedef struct moe_rt_DLManagedTensor {
      moe_rt_DLTensor dl_tensor; void* manager_ctx;
      void (*deleter)(struct moe_rt_DLManagedTensor*);
    } moe_rt_DLManagedTensor;
    typedef struct { uint32_t major; uint32_t minor; } moe_rt_DLPackVersion;
    typedef struct moe_rt_DLManagedTensorVersioned {
      moe_rt_DLPackVersion version; void* manager_ctx;
      void (*deleter)(struct moe_rt_DLManagedTensorVersioned*);
      uint64_t flags; moe_rt_DLTensor dl_tensor;
    } moe_rt_DLManagedTensorVersioned;
    """
    ctypedef struct DLDevice "moe_rt_DLDevice":
        int32_t device_type
        int32_t device_id
    ctypedef struct DLDataType "moe_rt_DLDataType":
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct DLTensor "moe_rt_DLTensor":
        void* data
        DLDevice device
        int32_t ndim
        DLDataType dtype
        int64_t* shape
        int64_t* strides
        uint64_t byte_offset
    ctypedef struct DLManagedTensor "moe_rt_DLManagedTensor":
        DLTensor dl_tensor
        void* manager_ctx
        void (*deleter)(DLManagedTensor*) noexcept
    ctypedef struct DLPackVersion "moe_rt_DLPackVersion":
        uint32_t major
        uint32_t minor
    ctypedef struct DLManagedTensorVersioned "moe_rt_DLManagedTensorVersioned":
        DLPackVersion version
        void* manager_ctx
        void (*deleter)(DLManagedTensorVersioned*) noexcept
        uint64_t flags
        DLTensor dl_tensor

cdef enum:
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLCUDAManaged = 13

cdef enum:
    kDLInt = 0
    kDLUInt = 1
    kDLFloat = 2
    kDLBfloat = 4
    kDLBool = 6
    kDLFloat8_e4m3fn = 10
    kDLFloat8_e5m2 = 12

cdef enum:
    DLPACK_FLAG_BITMASK_READ_ONLY = 1
    DLPACK_FLAG_BITMASK_IS_COPIED = 2
