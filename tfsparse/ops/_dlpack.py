"""Zero-copy views of DLPack producers (TensorFlow tensors) for the kernels.

TensorFlow's ``Tensor.__dlpack__`` refuses a ``stream`` argument, which the generic
consumers pass, so this module reads the legacy ``"dltensor"`` capsule itself (dlpack.h,
``DLManagedTensor``): it takes ownership of the tensor (renames the capsule to
``"used_dltensor"``) and calls the producer's deleter when the view is garbage collected.

:func:`view` returns a numpy array for host memory (``kDLCPU``) and a ``numba.cuda``
device array for CUDA memory (``kDLCUDA``/``kDLCUDAHost``/``kDLCUDAManaged``); both keep
the owner alive.  The caller is responsible for stream ordering (tfsparse synchronises
the device around its kernels, see :mod:`tfsparse.ops.tf`).
"""
from __future__ import annotations

import ctypes

import numpy as np

CPU, CUDA, CUDA_HOST, CUDA_MANAGED = 1, 2, 3, 13
CUDA_DEVICE_TYPES = (CUDA, CUDA_HOST, CUDA_MANAGED)
_CODES = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}  # DLDataTypeCode -> numpy kind


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    pass


_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                     ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed)))]

_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]


class Owner:
    """Owns one consumed ``DLManagedTensor``; calls its deleter once, when collected."""

    def __init__(self, capsule):
        if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
            raise ValueError("not an unconsumed DLPack 'dltensor' capsule")
        self._ptr = ctypes.cast(_api.PyCapsule_GetPointer(capsule, b"dltensor"), ctypes.POINTER(_Managed))
        _api.PyCapsule_SetName(capsule, b"used_dltensor")  # we own it now
        t = self._ptr.contents.dl_tensor
        if t.dtype.lanes != 1 or t.dtype.code not in _CODES:
            self.close()
            raise TypeError(f"unsupported DLPack dtype (code={t.dtype.code}, bits={t.dtype.bits}, "
                            f"lanes={t.dtype.lanes})")
        self.device_type = int(t.device.device_type)
        self.device_id = int(t.device.device_id)
        self.dtype = np.dtype(f"{_CODES[t.dtype.code]}{t.dtype.bits // 8}") if t.dtype.code != 6 else np.dtype(bool)
        self.shape = tuple(int(t.shape[i]) for i in range(t.ndim))
        self.strides = None if not t.strides else tuple(int(t.strides[i]) * self.dtype.itemsize
                                                        for i in range(t.ndim))
        self.address = (t.data or 0) + int(t.byte_offset)

    def interface(self) -> dict:
        """``__array_interface__`` / ``__cuda_array_interface__`` (version 3) description."""
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.address, False),
                "strides": self.strides, "version": 3}

    def close(self):
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr and ptr.contents.deleter:
            ptr.contents.deleter(ptr)

    def __del__(self):
        self.close()


class _HostArray:
    def __init__(self, owner: Owner):
        self._owner = owner
        self.__array_interface__ = owner.interface()


def view(obj):
    """Zero-copy view of a DLPack producer: numpy for host memory, numba.cuda for CUDA memory."""
    owner = Owner(obj.__dlpack__())
    if owner.device_type == CPU:
        return np.asarray(_HostArray(owner))
    if owner.device_type in CUDA_DEVICE_TYPES:
        from numba import cuda

        return cuda.from_cuda_array_interface(owner.interface(), owner=owner, sync=False)
    raise TypeError(f"DLPack device type {owner.device_type} is neither CPU nor CUDA")


def device_type(obj) -> int | None:
    """The DLPack device type of ``obj`` (None when it is no DLPack producer)."""
    dev = getattr(obj, "__dlpack_device__", None)
    return None if dev is None else int(dev()[0])
