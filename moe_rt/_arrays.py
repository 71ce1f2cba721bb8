"""The boundary between the caller's arrays and moe_rt's ops.

An op opens a :class:`Call` over its array arguments. The call decides the backend from where the data
lives (CUDA: kernels on CuPy views; CPU: the NumPy reference), the device and the stream, imports every
array through DLPack with no copy, and hands results back in the caller's framework and device, again with
no copy. Inside ``with call:`` the device and the stream are current for CuPy, so CuPy allocations and
CuPy ops made by the op run where its kernels do.

Stream rule: ``stream=None`` means the caller's current stream: torch's current stream for torch tensors,
CuPy's current stream otherwise (the legacy default stream unless the caller set one). A stream may be
given as a ``cupy.cuda.Stream``, a ``torch.cuda.Stream``, any object with ``__cuda_stream__``, or an int
``cudaStream_t``.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from moe_rt import _dlpack
from moe_rt import _light as _light_ext

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
    FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
    FLOAT8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = FLOAT8_E4M3 = FLOAT8_E5M2 = None

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
# FP8 (ml_dtypes' NumPy dtypes, torch.float8_e4m3fn / float8_e5m2, jnp.float8_*): moved as raw bytes. CuPy
# holds no FP8 dtype (it refuses to make or view such arrays), so on CUDA an FP8 array is a DevArray whose
# dtype is the FP8 dtype over memory CuPy sees as uint8 (see fp8_array); results go back to torch and JAX as
# their FP8 types (DevArray.export). CuPy callers cannot pass or receive FP8 (a TypeError naming the argument).
FP8_DTYPES = tuple(d for d in (FLOAT8_E4M3, FLOAT8_E5M2) if d is not None)
_UINT8 = np.dtype(np.uint8)
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


_FRAMEWORKS = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "cupy": "cupy"}
_framework_by_type: dict = {}


def _framework_of(obj) -> str:
    t = type(obj)
    fw = _framework_by_type.get(t)
    if fw is None:
        fw = _FRAMEWORKS.get(t.__module__.split(".")[0])
        if fw is None:
            fw = "numpy" if isinstance(obj, np.ndarray) else "other"
        _framework_by_type[t] = fw
    return fw


def not_an_array(obj, name) -> TypeError:
    """The TypeError for an array argument ``name`` given ``obj``, which is no array (a list, None, ...)."""
    return TypeError(f"{name}: expected an array with __dlpack__ (torch, JAX, CuPy, NumPy), got {type(obj).__name__}")


def _device_of(obj, name, fw=None):
    if fw is None:
        fw = _framework_of(obj)
    if fw == "numpy":
        return "cpu", 0
    if fw == "devarray":
        return "cuda", obj.device_id
    if fw == "cupy":
        return "cuda", obj.device.id
    if fw == "torch":
        is_cuda = getattr(obj, "is_cuda", None)
        if is_cuda is not None:
            return ("cuda", obj.get_device()) if is_cuda else ("cpu", 0)
    if not hasattr(obj, "__dlpack__"):
        raise not_an_array(obj, name)
    if not hasattr(obj, "__dlpack_device__"):
        return "cpu", 0
    dev_type, dev_id = obj.__dlpack_device__()
    dev_type = int(dev_type)
    if dev_type in (_dlpack.DEVICE_CUDA, _dlpack.DEVICE_CUDA_MANAGED):
        return "cuda", int(dev_id)
    if dev_type in (_dlpack.DEVICE_CPU, _dlpack.DEVICE_CUDA_HOST):
        return "cpu", 0
    raise TypeError(f"{name}: arrays on DLPack device type {dev_type} are not supported (CPU and CUDA only)")


_stream_cache: dict = {}


class _RawStream:
    """A cudaStream_t (int) speaking the CUDA stream protocol."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def as_cupy_stream(stream, device_id: int):
    """A cupy Stream for ``stream`` (cupy/torch stream, ``__cuda_stream__`` object, int or None)."""
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream(device_id)
    if isinstance(stream, cupy.cuda.Stream):
        return stream
    if isinstance(stream, int):
        ptr = stream
    elif hasattr(stream, "__cuda_stream__"):
        ptr = int(stream.__cuda_stream__()[1])
    elif hasattr(stream, "cuda_stream"):
        ptr = int(stream.cuda_stream)
    else:
        raise TypeError(f"stream: expected a CUDA stream, an int cudaStream_t or None, got {type(stream).__name__}")
    if ptr == 0:
        return cupy.cuda.Stream.null
    key = (ptr, device_id)
    s = _stream_cache.get(key)
    if s is None:
        # A non-owning wrapper of a stream the caller owns; it never destroys the stream.
        s = cupy.cuda.Stream.from_external(_RawStream(ptr))
        if len(_stream_cache) > 256:
            _stream_cache.clear()
        _stream_cache[key] = s
    return s


def _default_stream(framework: str, device_id: int):
    if framework == "torch":
        return as_cupy_stream(_torch_stream_ptr(device_id), device_id)
    return as_cupy_stream(None, device_id)


_torch_raw_stream = None  # torch._C._cuda_getCurrentRawStream (or a fallback), bound on first use
_torch_cur_device = None  # torch._C._cuda_getDevice, or False where torch lacks it


def _torch_stream_ptr(device_id: int) -> int:
    """torch's current cudaStream_t on ``device_id`` (an int, no Stream object)."""
    global _torch_raw_stream
    raw = _torch_raw_stream
    if raw is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:  # pragma: no cover - older torch
            def raw(dev, _cs=torch.cuda.current_stream):
                return _cs(dev).cuda_stream
        raw = _torch_raw_stream = raw
    return int(raw(device_id))


def _torch_device_current(device_id: int) -> bool:
    """Whether ``device_id`` is torch's current CUDA device (False where torch cannot tell cheaply)."""
    global _torch_cur_device
    cur = _torch_cur_device
    if cur is None:
        import torch

        cur = _torch_cur_device = getattr(torch._C, "_cuda_getDevice", None) or False
    return cur is not False and cur() == device_id


_cupy_mod = None


def _cupy():
    global _cupy_mod
    if _cupy_mod is None:
        import cupy

        _cupy_mod = cupy
    return _cupy_mod


def _cupy_device() -> int:
    """CuPy's current device (cudaGetDevice)."""
    return _cupy().cuda.runtime.getDevice()


# The light call of this thread that is running (see Call): CuPy's device and stream are entered for it only
# when CuPy is used (DevArray.cupy, call.xp, call.stream).
_light = threading.local()


class _LazyCupy:
    """``call.xp`` of a light call: cupy, with the call's device and stream made CuPy's current ones at the
    first use of any of its attributes."""

    __slots__ = ("_call",)

    def __init__(self, call):
        self._call = call

    def __getattr__(self, name):
        self._call._enter_cupy()
        return getattr(_cupy(), name)


_TORCH_DTYPES: dict = {}


def _torch_np_dtype(tdtype):
    """The NumPy dtype of a torch dtype moe_rt handles (None for others, which go through DLPack)."""
    if not _TORCH_DTYPES:
        import torch

        pairs = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
                 torch.int32: np.int32, torch.int64: np.int64, torch.int16: np.int16, torch.int8: np.int8,
                 torch.uint8: np.uint8, torch.bool: np.bool_}
        _TORCH_DTYPES.update({k: np.dtype(v) for k, v in pairs.items()})
        if BFLOAT16 is not None:
            _TORCH_DTYPES[torch.bfloat16] = BFLOAT16
        for name, dt in (("float8_e4m3fn", FLOAT8_E4M3), ("float8_e5m2", FLOAT8_E5M2)):
            if dt is not None and hasattr(torch, name):
                _TORCH_DTYPES[getattr(torch, name)] = dt
    return _TORCH_DTYPES.get(tdtype)


def _torch_dtypes() -> dict:
    """torch dtype -> NumPy dtype of the dtypes moe_rt handles (filled on first use)."""
    _torch_np_dtype(None)
    return _TORCH_DTYPES


def _cupy_over(ptr, shape, dtype, byte_strides, owner, device_id):
    """A CuPy array over device memory at ``ptr`` that ``owner`` keeps alive (no copy)."""
    import cupy

    if any(n == 0 for n in shape):
        with cupy.cuda.Device(device_id):
            return cupy.empty(shape, dtype)
    span = (sum((n - 1) * st for n, st in zip(shape, byte_strides)) + dtype.itemsize) if shape else dtype.itemsize
    mem = cupy.cuda.UnownedMemory(ptr, span, owner, device_id)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0), strides=byte_strides)


def _cupy_over_dense(ptr, shape, dtype, nbytes, owner, device_id):
    """A C-contiguous CuPy array of ``nbytes`` > 0 bytes at ``ptr``, kept alive by ``owner`` (no copy)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device_id)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _xla_view(obj, device_id, stream=None):
    """A CuPy array over an XLA buffer inside a JAX callback (already ordered on XLA's stream, which the call
    runs on) through its ``__cuda_array_interface__`` (an FP8 buffer: a DevArray, see :func:`fp8_array`;
    ``stream``: where a strided one is copied); None if the buffer does not offer one."""
    try:
        cai = obj.__cuda_array_interface__
        dt = np.dtype(obj.dtype)
        shape = tuple(int(n) for n in cai["shape"])
        ptr = int(cai["data"][0])
        st = cai.get("strides")
    except (AttributeError, KeyError, TypeError):
        return None
    if st is None:
        st, acc = [], dt.itemsize
        for n in reversed(shape):
            st.append(acc)
            acc *= n
        st = reversed(st)
    if dt in FP8_DTYPES:
        return fp8_array(_cupy_over(ptr, shape, _UINT8, tuple(int(v) for v in st), obj, device_id), dt, stream)
    return _cupy_over(ptr, shape, dt, tuple(int(v) for v in st), obj, device_id)


def fp8_array(u8, dtype, stream=None):
    """The FP8 array of ``dtype`` over the bytes of ``u8``, a CuPy uint8 array (CuPy holds no FP8 dtype): a
    DevArray of that dtype, over ``u8``'s memory when it is C-contiguous, else over a contiguous copy of its
    bytes made on ``stream`` (a CuPy stream; None: CuPy's current stream) on ``u8``'s device."""
    if not u8.flags.c_contiguous:
        import cupy

        with u8.device, (stream if stream is not None else cupy.cuda.get_current_stream()):
            u8 = cupy.ascontiguousarray(u8)
    return DevArray(u8.data.ptr, tuple(u8.shape), dtype, u8, u8.device.id)


def _fp8_export(u8, dtype, framework: str):
    """``u8`` (a CuPy uint8 array holding FP8 values of ``dtype``) as FP8 in ``framework``, no copy in torch
    (a view), a bitcast in JAX."""
    if framework not in ("torch", "jax"):
        raise TypeError(f"an FP8 ({np.dtype(dtype).name}) result for a {framework} caller: CuPy holds no FP8 "
                        "dtype, so moe_rt hands FP8 back to torch and JAX callers only")
    return as_fp8(export(u8, framework), dtype, framework)


class _Flags:
    __slots__ = ()
    c_contiguous = True


_CONTIGUOUS = _Flags()


class DevArray(_light_ext.DevArrayBase):
    """A C-contiguous array in device memory, as moe_rt's kernels see it: ``ptr``, ``shape``, ``dtype``
    and ``owner``, the object whose memory it is (a torch tensor, an XLA buffer, a CuPy array), kept alive
    by the view; ``offset`` counts elements from the owner's start (a slice of one plan buffer).

    The hot ops' CUDA paths take these instead of CuPy arrays where the caller's memory or the caller's
    allocator is at hand (torch tensors on torch's stream, XLA buffers in a JAX callback): they read only
    what a launch needs (``data.ptr``, ``shape``, ``dtype``, ``size``, ``reshape``, 1-D slices), and
    anything else goes through :meth:`cupy`, a CuPy view of the same memory."""

    # ptr, shape, dtype, owner, device_id, offset, _cp (the CuPy view, made once) and _whole (the owner is a
    # contiguous torch tensor of exactly this shape: its export is the owner itself), and data, ndim, size,
    # nbytes: compiled in moe_rt._light
    __slots__ = ()
    flags = _CONTIGUOUS

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        if shape == self.shape:  # the ops' usual case (2-D arrays in, 2-D results out): the array itself
            return self
        if (len(shape) == 2 and len(self.shape) == 2 and shape[0] == -1 and type(shape[1]) is int
                and shape[1] == self.shape[1] and shape[1] > 0):  # rows flattened to [-1, E]: itself too
            return self
        shape = tuple(int(d) for d in shape)
        n = self.size
        if -1 in shape:
            rest = math.prod(d for d in shape if d != -1)
            shape = tuple(d if d != -1 else (n // rest if rest else 0) for d in shape)
        if math.prod(shape) != n:
            raise ValueError(f"cannot reshape an array of {n} elements into shape {shape}")
        return DevArray(self.ptr, shape, self.dtype, self.owner, self.device_id, self.offset)

    def __getitem__(self, key):
        if not isinstance(key, slice) or len(self.shape) != 1 or key.step not in (None, 1):
            return self.cupy()[key]
        start, stop, _ = key.indices(self.shape[0])
        n = max(stop - start, 0)
        return DevArray(self.ptr + start * self.dtype.itemsize, (n,), self.dtype, self.owner, self.device_id,
                        self.offset + start)

    def astype(self, dtype, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        if self.dtype in FP8_DTYPES:
            raise TypeError(f"{self.dtype.name} values cannot be converted on CUDA here (CuPy holds no FP8): "
                            "dequantize them (moe_rt.dequantize_fp8)")
        return self.cupy().astype(dtype, copy=copy)

    def cupy(self):
        """A CuPy array over the same memory (made once); for an FP8 array, its bytes as uint8 (CuPy holds no
        FP8 dtype)."""
        c = getattr(_light, "call", None)
        if c is not None:  # a light call is running: CuPy work follows, on its device and stream
            c._enter_cupy()
        if self._cp is None:
            nbytes = self.nbytes
            dt = _UINT8 if self.dtype in FP8_DTYPES else self.dtype
            if nbytes == 0:
                import cupy

                with cupy.cuda.Device(self.device_id):
                    self._cp = cupy.empty(self.shape, dt)
            else:
                self._cp = _cupy_over_dense(self.ptr, self.shape, dt, nbytes, self.owner, self.device_id)
        return self._cp

    def export(self, framework: str):
        """The array in ``framework``: a view of a torch owner, else through CuPy (no copy)."""
        o = self.owner
        if self._whole and framework == "torch":
            return o
        if framework == "torch" and _framework_of(o) == "torch":
            if self.offset == 0 and o.numel() == self.size:
                return o if o.shape == self.shape else o.view(self.shape)
            flat = o.view(-1) if o.dim() != 1 else o
            return flat[self.offset:self.offset + self.size].view(self.shape)
        if framework == "devarray":
            return self
        if self.dtype in FP8_DTYPES:
            return _fp8_export(self.cupy(), self.dtype, framework)
        return export(self.cupy(), framework)


def _torch_dtype_of(dt):
    """The torch dtype of a NumPy dtype moe_rt allocates (the inverse of :func:`_torch_np_dtype`)."""
    if not _TORCH_DTYPES:
        _torch_np_dtype(None)
    t = _TORCH_BY_NP.get(dt)
    if t is None:
        _TORCH_BY_NP.update({v: k for k, v in _TORCH_DTYPES.items()})
        t = _TORCH_BY_NP[dt]
    return t


_TORCH_BY_NP: dict = {}
_ALLOC_DTYPES: dict = {}  # a dtype as the ops pass it to Call.empty -> (its NumPy dtype, the torch dtype)
_FP8_ALLOC: dict = {}  # a dtype as the ops pass it to Call.empty -> whether it is an FP8 dtype
_torch_mod = None


def _torch_module():
    global _torch_mod
    if _torch_mod is None:
        import torch

        _torch_mod = torch
    return _torch_mod


_framework_by_type[DevArray] = "devarray"
_devices: dict = {}
_torch_devices: dict = {}


_grad_enabled = None  # torch.is_grad_enabled, bound when the first torch tensor comes


def _no_autograd(obj, name):
    """Raise for a torch tensor that would need autograd: it requires grad and grad mode is on. The core ops
    record no autograd graph, so their results would be silently cut off from the gradient."""
    global _grad_enabled
    if _grad_enabled is None:
        import torch

        _grad_enabled = torch.is_grad_enabled
    if _grad_enabled():
        raise TypeError(f"{name}: a torch tensor that requires grad (with grad mode on); moe_rt's core ops do "
                        "not record autograd, so their results would get no gradient. Use the op of the same "
                        "name in moe_rt.torch (differentiable), or pass .detach() / call under torch.no_grad()")


_Tracer = None


def _no_tracer(obj, name):
    """Raise for a JAX tracer (a core op called inside jax.jit/grad/vmap): its values are not known yet."""
    global _Tracer
    if _Tracer is None:
        import jax

        _Tracer = jax.core.Tracer
    if isinstance(obj, _Tracer):
        raise TypeError(f"{name}: a JAX tracer (the op was called inside jax.jit, grad or vmap); moe_rt's core "
                        "ops need concrete arrays. Use the op of the same name in moe_rt.jax, which works under "
                        "jit, grad and vmap")


def check_stream(stream):
    """Raise TypeError unless ``stream`` is None, an int cudaStream_t, or a stream object (CuPy, torch, or
    anything with ``__cuda_stream__``); the same on every backend (a CPU call ignores a valid one)."""
    if stream is None:
        return
    if isinstance(stream, bool) or not (isinstance(stream, (int, np.integer)) or hasattr(stream, "__cuda_stream__")
                                        or hasattr(stream, "cuda_stream")
                                        or (type(stream).__module__.startswith("cupy") and hasattr(stream, "ptr"))):
        raise TypeError(f"stream: expected a CUDA stream, an int cudaStream_t or None, got {type(stream).__name__}")
    if not isinstance(stream, (int, np.integer)):
        return
    if not 0 <= int(stream) < 1 << 64:
        raise ValueError(f"stream: an int cudaStream_t must be in [0, 2**64), got {int(stream)}")


class Call:
    """One op call's view of its arguments: ``backend`` ('cuda' or 'cpu'), ``xp`` (cupy or numpy),
    ``device_id``, ``stream`` (a cupy Stream, or None on CPU) and ``framework`` (of the first array
    argument: 'torch', 'jax', 'cupy', 'numpy' or 'other').

    Torch tensors that require grad while grad mode is on are refused with a TypeError (the core ops do not
    record autograd; ``moe_rt.torch`` does), and so are JAX tracers (``moe_rt.jax`` works under jit). A NumPy
    scalar is taken as a 0-d array."""

    # the state a call starts from (the one-pass set-ups below set only what differs; __init__ sets all)
    _fast_torch = _on_xla_stream = _lean = _light = _entered = _active = _current = False
    _stream = _tdev = None

    def __init__(self, arrays: dict, stream=None, *, xla_buffers: bool = False, lean: bool = False):
        if stream is None and ((lean and self._torch_light(arrays)) or self._cupy_plain(arrays, lean)):
            return
        self.framework = None
        self.backend = None
        self.device_id = 0
        if stream is not None:
            check_stream(stream)
        first = None
        for name, obj in arrays.items():
            if obj is None:
                continue
            fw = _framework_of(obj)
            if fw == "torch":
                if obj.requires_grad:
                    _no_autograd(obj, name)
            elif fw == "jax":
                _no_tracer(obj, name)
            elif fw == "other" and isinstance(obj, np.generic):
                obj = arrays[name] = np.asarray(obj)
            kind, dev = _device_of(obj, name, fw if fw != "other" else None)
            if first is None:
                first = name
                self.backend, self.device_id = kind, dev
                self.framework = _framework_of(obj)
            elif (kind, dev if kind == "cuda" else 0) != (self.backend, self.device_id if kind == "cuda" else 0):
                raise ValueError(f"{name} is on {kind}:{dev} but {first} is on {self.backend}:{self.device_id}; "
                                 "all arrays of one call must be on the same device")
        if first is None:
            # every array None: the first one (the op's leading, required array) is named
            raise not_an_array(None, next(iter(arrays))) if arrays else TypeError("no array argument was given")
        self._first = first
        self._fast_torch = self.backend == "cuda" and stream is None and self.framework == "torch"
        self._on_xla_stream = xla_buffers and stream is not None
        # lean: the op's CUDA path takes DevArrays (torch tensors on torch's stream) and allocates through
        # empty(): torch's allocator for torch callers
        self._lean = lean and self.backend == "cuda"
        self._tdev = None
        self._light = self._entered = self._active = self._current = False
        self._stream = None
        self.stream_ptr = None
        if self.backend == "cuda":
            cupy = _cupy()
            self.xp = cupy
            self._device = _devices.get(self.device_id)
            if self._device is None:
                self._device = _devices[self.device_id] = cupy.cuda.Device(self.device_id)
            if stream is not None:
                self._stream = as_cupy_stream(stream, self.device_id)
            elif self._lean and self._fast_torch and _torch_device_current(self.device_id):
                # a light call, if every array comes as a DevArray (below): torch's stream as an int, CuPy's
                # device and stream entered only if the op uses CuPy (_enter_cupy)
                self.stream_ptr = _torch_stream_ptr(self.device_id)
            else:
                self._stream = _default_stream(self.framework, self.device_id)
                # CuPy arrays on CuPy's current device and stream: both are current already (nothing to enter)
                self._current = self.framework == "cupy" and _cupy_device() == self.device_id
            if self._stream is not None:
                self.stream_ptr = self._stream.ptr
        else:
            self.xp = np
            self._device = None
        self.views = {name: (None if obj is None else self._import(obj, name)) for name, obj in arrays.items()}
        if self._stream is None and self.stream_ptr is not None:
            for v in self.views.values():
                if v is not None and type(v) is not DevArray:
                    break
            else:
                self._light = True
                self.xp = None  # CuPy on first use (see the xp property)

    def _torch_light(self, arrays: dict) -> bool:
        """The usual call of an op from torch, set up in one pass: every array a C-contiguous CUDA torch tensor
        of a dtype moe_rt handles (or None), on torch's current device, on torch's current stream (no
        ``stream=``): the light call :meth:`__init__` would make, with the same checks in the same order. False
        (nothing set) for any other call, which :meth:`__init__` then sets up in full."""
        # the dtype table (torch's import) only once a torch tensor came: a NumPy or CuPy caller never imports torch
        got = _light_ext.torch_views(arrays, _framework_by_type, _torch_dtypes, _framework_of, _no_autograd, DevArray)
        if got is None:
            return False
        views, first, device_id = got
        cur, raw = _torch_cur_device, _torch_raw_stream
        if cur is None or raw is None:  # first use: bind them
            if not _torch_device_current(device_id):
                return False
            cur, raw = _torch_cur_device, _torch_raw_stream
        elif cur is False or cur() != device_id:
            return False
        device = _devices.get(device_id)
        if device is None:
            device = _devices[device_id] = _cupy().cuda.Device(device_id)
        self.framework, self.backend, self.device_id, self._first = "torch", "cuda", device_id, first
        self._fast_torch = self._lean = self._light = True
        self._tdev = _torch_devices.get(device_id)
        self._device = device
        self.stream_ptr = int(raw(device_id)) if raw is not None else _torch_stream_ptr(device_id)
        self.views = views
        self._xp = None  # CuPy on first use (see the xp property)
        return True

    def _cupy_plain(self, arrays: dict, lean: bool) -> bool:
        """A call of CuPy arrays alone on CuPy's current stream (no ``stream=``), set up in one pass: what
        :meth:`__init__` would set, with the same checks in the same order; the views are the arrays. False
        (nothing set) for any other call."""
        got = _light_ext.cupy_views(arrays, _framework_by_type, _framework_of, FP8_DTYPES)
        if got is None:
            return False
        first, device_id = got
        self.framework, self.backend, self.device_id, self._first = "cupy", "cuda", device_id, first
        self._lean = lean
        self._xp = _cupy()
        device = _devices.get(device_id)
        if device is None:
            device = _devices[device_id] = self._xp.cuda.Device(device_id)
        self._device = device
        self._stream = _default_stream("cupy", device_id)
        # CuPy arrays on CuPy's current device and stream: both are current already (nothing to enter)
        self._current = _cupy_device() == device_id
        self.stream_ptr = self._stream.ptr
        self.views = dict(arrays)
        return True

    @property
    def xp(self):
        """cupy or numpy; in a light call a stand-in that makes the call's device and stream CuPy's current
        ones at the first use of any cupy attribute. That stand-in is made at each read and never kept: kept on
        the call it would tie the two in a reference cycle, and every array of the call (its outputs included)
        would live on until Python's cyclic collector ran."""
        xp = self._xp
        return _LazyCupy(self) if xp is None else xp

    @xp.setter
    def xp(self, value):
        self._xp = value

    @property
    def stream(self):
        """The call's stream as a CuPy stream (None on CPU); made on first use in a light call, whose CuPy
        device and stream are then entered (see :meth:`_enter_cupy`)."""
        if self._light and self._active and not self._entered:
            self._enter_cupy()
        s = self._stream
        if s is None and self.stream_ptr is not None:
            s = self._stream = as_cupy_stream(self.stream_ptr, self.device_id)
        return s

    def _enter_cupy(self):
        """A light call about to use CuPy: make its device and stream CuPy's current ones (left at exit)."""
        if self._entered or not self._active:
            return
        s = self._stream
        if s is None:
            s = self._stream = as_cupy_stream(self.stream_ptr, self.device_id)
        self._device.__enter__()
        try:
            s.__enter__()
        except BaseException:
            self._device.__exit__(None, None, None)
            raise
        self._entered = True

    # -- import --------------------------------------------------------------------------------------
    def _import(self, obj, name):
        if isinstance(obj, np.ndarray):
            return obj
        fw = _framework_of(obj)
        if self.backend == "cuda" and fw == "cupy":
            if obj.dtype.itemsize == 1 and obj.dtype in FP8_DTYPES:
                raise TypeError(f"{name}: a CuPy {obj.dtype.name} array; CuPy has no FP8 dtype moe_rt can use, so "
                                "FP8 on CUDA is taken from torch and JAX only (or pass the bytes as uint8 to "
                                "moe_rt.dispatch, which moves them unchanged)")
            return obj
        if fw == "devarray":
            return obj if self._lean or obj.dtype in FP8_DTYPES else obj.cupy()
        if self._fast_torch and fw == "torch":
            # torch CUDA tensor on torch's current stream (the stream this call runs on): read its pointer,
            # shape and strides directly; DLPack's stream handshake would be a no-op here.
            dt = _torch_np_dtype(obj.dtype)
            if dt is not None:  # a CUDA tensor: the call's backend (every array is on its device)
                fp8 = dt.itemsize == 1 and dt in FP8_DTYPES
                if (self._lean or fp8) and obj.is_contiguous():
                    return DevArray(obj.data_ptr(), tuple(obj.shape), dt, obj, self.device_id, 0, True)
                if fp8:
                    return fp8_array(_cupy_over(obj.data_ptr(), tuple(obj.shape), _UINT8, tuple(obj.stride()),
                                                obj, self.device_id), dt, self.stream)
                return _cupy_over(obj.data_ptr(), tuple(obj.shape), dt,
                                  tuple(st * dt.itemsize for st in obj.stride()), obj, self.device_id)
        if self.backend == "cuda" and self._on_xla_stream:
            view = _xla_view(obj, self.device_id, self.stream)
            if view is not None:
                return view
        if getattr(obj, "requires_grad", False):
            obj = obj.detach()  # torch refuses to export autograd leaves; detach is a zero-copy view
        fp8 = None
        if fw == "torch" and obj.dtype.itemsize == 1 and obj.is_floating_point():
            # float8: through DLPack as its bytes (torch releases before 2.6 refuse to export float8), then
            # the same bytes seen as the NumPy float8 dtype again
            fp8 = _torch_np_dtype(obj.dtype)
            if fp8 is None:
                raise TypeError(f"{name}: torch dtype {obj.dtype} is not supported (FP8 dtypes moe_rt moves: "
                                "float8_e4m3fn, float8_e5m2)")
            import torch

            obj = obj.view(torch.uint8)
        elif fw == "jax" and obj.dtype.itemsize == 1 and obj.dtype in FP8_DTYPES:
            # JAX FP8: through DLPack as its bytes too (FP8 is outside jax.dlpack's supported dtypes, and
            # XLA's GPU buffers of FP8 offer no __cuda_array_interface__), bitcast to uint8 in XLA (ordered
            # before this call's stream by DLPack's handshake); the FP8 dtype is put back below
            import jax

            fp8 = np.dtype(obj.dtype)
            obj = jax.lax.bitcast_convert_type(obj, np.uint8)
        ptr = self.stream.ptr if self.stream is not None else None
        if ptr == 0:
            ptr = 1  # DLPack: 1 is the legacy default stream; 0 is disallowed
        view = _dlpack.consume(obj, stream=ptr)
        if view.device_type == "cuda":
            if fp8 is None and view.dtype in FP8_DTYPES:  # another framework's FP8 array exported as FP8
                fp8 = view.dtype
            if fp8 is not None:  # CuPy holds no FP8: its bytes as uint8, the dtype on the DevArray
                return fp8_array(wrap(view, _UINT8), fp8, self.stream)
        arr = wrap(view)
        return arr if fp8 is None else arr.view(fp8)

    def __getitem__(self, name):
        return self.views[name]

    def contiguous(self, arr):
        """:func:`contiguous` on the call's ``xp``, read (in a light call: made) only for a copy."""
        return arr if arr.flags.c_contiguous else contiguous(self.xp, arr)

    # -- context ---------------------------------------------------------------------------------------
    def __enter__(self):
        if self._light:
            self._prev_light = getattr(_light, "call", None)
            _light.call = self
            self._active = True
        elif self._device is not None and not self._current:
            s = self.stream
            self._device.__enter__()
            s.__enter__()
            self._entered = True
        return self

    def __exit__(self, *exc):
        if self._light:
            self._active = False
            _light.call = self._prev_light
        if self._entered:
            self._entered = False
            self._stream.__exit__(*exc)
            self._device.__exit__(*exc)
        return False

    # -- allocation ------------------------------------------------------------------------------------
    def empty(self, shape, dtype):
        """An uninitialized result array on the call's device and stream: in a lean call from torch a torch
        tensor from torch's allocator (as a DevArray), else a CuPy (CUDA) or NumPy (CPU) array; FP8 on CUDA:
        a DevArray (see :func:`fp8_array`)."""
        if self._lean and self._fast_torch:
            pair = _ALLOC_DTYPES.get(dtype)
            tdev = self._tdev
            if pair is None or tdev is None:
                return self._torch_empty(shape, dtype)
            return _light_ext.torch_empty(_torch_mod.empty, shape, pair[1], pair[0], tdev, self.device_id, DevArray)
        if self.backend == "cuda":
            fp8 = _FP8_ALLOC.get(dtype)
            if fp8 is None:
                fp8 = _FP8_ALLOC[dtype] = np.dtype(dtype) in FP8_DTYPES
            if fp8:
                return self._fp8_empty(shape, np.dtype(dtype))
        return self.xp.empty(shape, dtype=dtype)

    scratch = empty  # working memory of one call, allocated as empty() allocates

    def _fp8_empty(self, shape, dtype):
        """An FP8 array on CUDA: uint8 memory from CuPy, the FP8 dtype on the DevArray; refused for callers
        whose framework cannot take FP8 back (CuPy)."""
        if self.framework not in ("torch", "jax", "devarray"):
            raise TypeError(f"{self._first}: a {self.framework} array, and the result would be FP8 "
                            f"({dtype.name}), which CuPy cannot hold; pass torch or JAX arrays for FP8 on CUDA")
        self._enter_cupy()
        return fp8_array(_cupy().empty(tuple(shape), dtype=_UINT8), dtype)

    def _torch_empty(self, shape, dtype):
        """A torch tensor from torch's allocator (as a DevArray) of ``shape`` and ``dtype`` (a NumPy dtype or
        its type, as the ops pass them)."""
        pair = _ALLOC_DTYPES.get(dtype)
        if pair is None:
            dt = np.dtype(dtype)
            pair = _ALLOC_DTYPES[dtype] = (dt, _torch_dtype_of(dt))
        tdev = self._tdev
        if tdev is None:
            tdev = self._tdev = _torch_devices.get(self.device_id)
            if tdev is None:
                import torch

                tdev = self._tdev = _torch_devices[self.device_id] = torch.device("cuda", self.device_id)
        shape = tuple(shape)
        t = _torch_module().empty(size=shape, dtype=pair[1], device=tdev)  # size= parses faster than a tuple
        return DevArray(t.data_ptr(), shape, pair[0], t, self.device_id, 0, True)

    # -- export ----------------------------------------------------------------------------------------
    def out(self, arr):
        """Hand ``arr`` (a CuPy or NumPy array or DevArray made by the op) back in the caller's framework,
        no copy."""
        if type(arr) is DevArray:
            if arr._whole and self.framework == "torch":
                return arr.owner
            return arr.export(self.framework)
        if self._fast_torch and not isinstance(arr, np.ndarray):
            return _torch_from_cupy(arr, self.stream.ptr)
        return export(arr, self.framework)


def _torch_from_cupy(arr, stream_ptr):
    """A torch tensor over a CuPy result made on torch's current stream (``stream_ptr``): the DLPack capsule
    goes straight to torch's importer, without ``torch.from_dlpack``'s per-call stream lookup (the producer
    and consumer streams are the same, so there is nothing to order)."""
    import torch

    importer = getattr(torch._C, "_from_dlpack", None)
    if importer is None:  # pragma: no cover - older torch
        return torch.from_dlpack(arr)
    return importer(arr.__dlpack__(stream=stream_ptr if stream_ptr else 1, max_version=(1, 0)))


def wrap(view, dtype=None):
    """A CuPy (CUDA) or NumPy (CPU) array over an :class:`moe_rt._dlpack.Imported` view, no copy; ``dtype``:
    another dtype of the same item size to see the elements as (None: the view's)."""
    itemsize = view.dtype.itemsize
    byte_strides = tuple(s * itemsize for s in view.strides)
    dt = view.dtype if dtype is None else np.dtype(dtype)
    if dt.itemsize != itemsize:
        raise ValueError(f"wrap: {dt.name} has not the item size of {view.dtype.name}")
    if view.device_type == "cuda":
        import cupy

        if view.size == 0:
            with cupy.cuda.Device(view.device_id):
                return cupy.empty(view.shape, dt)
        mem = cupy.cuda.UnownedMemory(view.ptr, view.span, view, view.device_id)
        return cupy.ndarray(view.shape, dt, cupy.cuda.MemoryPointer(mem, 0), strides=byte_strides)
    if view.size == 0:
        return np.empty(view.shape, dt)
    buf = _dlpack.HostBuffer(view.ptr, view.span, view, view.readonly)
    arr = np.ndarray(view.shape, dt, buffer=buf, strides=byte_strides)
    return arr


def export(arr, framework: str):
    """``arr`` (CuPy or NumPy) as an array of ``framework`` ('torch', 'jax', 'cupy', 'numpy', 'other'),
    on the same device, without copying."""
    if type(arr) is DevArray:
        return arr.export(framework)
    is_numpy = isinstance(arr, np.ndarray)
    if framework in ("cupy", "other", "devarray") or (framework == "numpy" and is_numpy):
        return arr
    if framework == "numpy":  # CUDA result for a NumPy caller cannot happen: backend follows the data
        return arr.get()
    src = _dlpack.Exported.from_numpy(arr) if is_numpy else arr
    if framework == "torch":
        import torch

        if is_numpy:
            return torch.from_dlpack(src)
        # what torch.from_dlpack does for a CUDA array (order CuPy's current stream before torch's current
        # stream of that device), without its per-call lookups
        return _torch_from_cupy(arr, _default_stream("torch", arr.device.id).ptr)
    if framework == "jax":
        import jax.dlpack

        if is_numpy:
            import jax.numpy as jnp

            # XLA needs aligned host buffers to alias; a NumPy result is handed over by DLPack when
            # possible, else copied once onto JAX's CPU device.
            try:
                return jax.dlpack.from_dlpack(src)
            except Exception:
                return jnp.asarray(arr)
        return jax.dlpack.from_dlpack(src)
    raise ValueError(f"unknown framework {framework!r}")


def as_fp8(arr, dtype, framework: str):
    """``arr``, a 1-byte array of ``framework`` ('torch' or 'jax'), reinterpreted as the FP8 NumPy dtype
    ``dtype`` in that framework (the same bits: a view in torch, a bitcast in JAX)."""
    if framework == "torch":
        import torch

        return arr.view(_torch_dtype_of(np.dtype(dtype)))
    if framework == "jax":
        import jax

        return jax.lax.bitcast_convert_type(arr, np.dtype(dtype))
    return arr.view(np.dtype(dtype))


# The ops keep the results of their shape, dtype and settings checks by signature: the arrays' (shape, dtype)
# and each setting with its type (True and 1, or "softmax" and a str subclass, validate apart), floats by
# their bits (0.0 and -0.0 scale apart). Only checks that passed are kept; a key that cannot be hashed (an
# unhashable setting) is checked every time.
_VALIDATED_MAX = 1024  # entries a cache keeps (then it starts again)
_UNHASHABLE = []  # the key part of something that is no array: the checks run (and raise) uncached


def sig(a):
    """An array's part of a validation key (None for None)."""
    if a is None:
        return None
    try:
        return a.shape, a.dtype
    except AttributeError:
        return _UNHASHABLE


def float_key(v):
    """A float setting's part of a validation key."""
    return (type(v), float(v).hex()) if isinstance(v, (float, np.floating)) else (type(v), v)


def validated(cache: dict, key):
    """The checks' result for ``key`` (None: not checked yet, or ``key`` cannot be hashed)."""
    try:
        return cache.get(key)
    except TypeError:
        return None


def remember(cache: dict, key, result):
    """``result`` of the checks, kept for ``key`` (where it can be hashed)."""
    try:
        hash(key)
    except TypeError:
        return result
    if len(cache) >= _VALIDATED_MAX:
        cache.clear()
    cache[key] = result
    return result


# -- validation helpers used by every op ---------------------------------------------------------------

def check_dtype(arr, name, allowed):
    try:
        dt = np.dtype(arr.dtype)
    except AttributeError:  # None (or no array) for a required array whose op met another array first
        raise not_an_array(arr, name) from None
    if dt not in allowed:
        names = ", ".join(np.dtype(a).name for a in allowed)
        raise TypeError(f"{name}: dtype must be one of {names}, got {dt.name}")


def check_ndim(arr, name, ndim):
    try:
        got = arr.ndim
    except AttributeError:
        raise not_an_array(arr, name) from None
    if got != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(arr.shape)}")


def check_shape(arr, name, shape):
    try:
        got = tuple(arr.shape)
    except AttributeError:
        raise not_an_array(arr, name) from None
    if got != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(arr.shape)}")


def contiguous(xp, arr):
    """``arr`` if C-contiguous, else a contiguous copy (made on the call's stream). FP8 arrays on CUDA are
    DevArrays, C-contiguous from their import on (see :func:`fp8_array`)."""
    if arr.flags.c_contiguous:
        return arr
    return xp.ascontiguousarray(arr)


def cupy_of(arr):
    """A CuPy or NumPy array for ``arr``: a DevArray's CuPy view, anything else as it is."""
    return arr.cupy() if type(arr) is DevArray else arr


def as_f32(xp, arr):
    """``arr`` as a C-contiguous float32 array: itself when it is one already, else a converted copy
    (made on the call's stream)."""
    if np.dtype(arr.dtype) == np.float32 and arr.flags.c_contiguous:
        return arr
    if type(arr) is DevArray and arr.dtype not in FP8_DTYPES:  # FP8: DevArray.astype refuses
        arr = arr.cupy()
    return xp.ascontiguousarray(arr.astype(np.float32))


def check_int(value, name, *, low=None, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high}, got {value}")
    return value

