"""A test-only DLPack producer built with ctypes.

A `Producer` owns a NumPy array and exports it as one PyCapsule holding a
DLManagedTensorVersioned ("dltensor_versioned") or a legacy DLManagedTensor
("dltensor"). Its deleter counts its calls, so a test can check that a consumer
called it exactly once.

The producer keeps its capsule alive (`producer.capsule`) and gives the
capsule no destructor: after a call the test reads the capsule's name to see
whether the consumer took it (renamed it used_*), and then the deleter count
must be 1, or left it alone, and then 0. (A destructor written in Python could
not run safely: consumers drop capsules while an exception is being raised.)

Options: flags READ_ONLY / IS_COPIED, any version, NULL strides (compact
row-major), a byte_offset into the owned memory, any capsule name.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import numpy as np

READ_ONLY = 1 << 0
IS_COPIED = 1 << 1
K_DL_CPU = 1

# DLDataTypeCode: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6
_DTYPE_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", c_void_p),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


_DELETER_TYPE = ctypes.CFUNCTYPE(None, c_void_p)



def _pythonapi(name, argtypes, restype):
    # pythonapi["..."] makes a new function object each time; attribute access
    # would share one, and with it one set of argtypes.
    func = ctypes.pythonapi[name]
    func.argtypes, func.restype = argtypes, restype
    return func


_PyCapsule_New = _pythonapi("PyCapsule_New", [c_void_p, c_void_p, c_void_p], ctypes.py_object)
_PyCapsule_GetName = _pythonapi("PyCapsule_GetName", [ctypes.py_object], ctypes.c_char_p)

# Capsule names must outlive their capsules: module-level buffers never move.
_NAMES = {
    name: ctypes.create_string_buffer(name.encode())
    for name in ("dltensor", "dltensor_versioned", "used_dltensor", "used_dltensor_versioned")
}

# Every producer ever made, by the address of its managed tensor: the deleter
# finds its producer here, and a producer outlives its capsule whatever the
# test does with its own reference.
_LIVE: dict = {}


def _count_deleter_call(address):
    producer = _LIVE.get(address)
    if producer is not None:
        producer.deleter_calls += 1


_DELETER = _DELETER_TYPE(_count_deleter_call)


def capsule_name(capsule) -> str:
    return _PyCapsule_GetName(capsule).decode()


def offset_array(shape, dtype, byte_offset: int, fill=None) -> np.ndarray:
    """An array that starts `byte_offset` bytes into a larger allocation."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(byte_offset + nbytes + 64, dtype=np.uint8)
    arr = raw[byte_offset:byte_offset + nbytes].view(dtype).reshape(shape)
    if fill is not None:
        arr[...] = fill
    return arr


class Producer:
    """Exports `array` (kept alive here) as one DLPack capsule.

    versioned   DLManagedTensorVersioned / "dltensor_versioned" when True,
                DLManagedTensor / "dltensor" when False
    flags       DLPACK flag bits (READ_ONLY, IS_COPIED), versioned only
    version     (major, minor) written into the versioned struct
    null_strides  export strides as NULL (the array must be C-contiguous)
    byte_offset   data points `byte_offset` bytes before the array's first
                  element and byte_offset says so (the array must have that
                  many bytes of its allocation in front of it: offset_array)
    name        the capsule name, to fake e.g. an already consumed capsule
    """

    def __init__(self, array: np.ndarray, *, versioned: bool = True, flags: int = 0,
                 version=(1, 0), null_strides: bool = False, byte_offset: int = 0,
                 name: str | None = None):
        self.array = array
        self.deleter_calls = 0
        self.versioned = versioned
        itemsize = array.dtype.itemsize
        if null_strides and not array.flags.c_contiguous:
            raise ValueError("NULL strides need a C-contiguous array")
        self._shape = (c_int64 * max(array.ndim, 1))(*array.shape)
        self._strides = (c_int64 * max(array.ndim, 1))(*(s // itemsize for s in array.strides))
        tensor = DLTensor()
        tensor.data = array.__array_interface__["data"][0] - byte_offset
        tensor.device = DLDevice(K_DL_CPU, 0)
        tensor.ndim = array.ndim
        kind = "b" if array.dtype == np.bool_ else array.dtype.kind
        tensor.dtype = DLDataType(_DTYPE_CODES[kind], itemsize * 8, 1)
        tensor.shape = ctypes.cast(self._shape, POINTER(c_int64))
        tensor.strides = None if null_strides else ctypes.cast(self._strides, POINTER(c_int64))
        tensor.byte_offset = byte_offset
        deleter = ctypes.cast(_DELETER, c_void_p).value
        if versioned:
            self.managed = DLManagedTensorVersioned(
                version=DLPackVersion(*version), manager_ctx=None, deleter=deleter,
                flags=flags, dl_tensor=tensor)
        else:
            if flags:
                raise ValueError("legacy DLManagedTensor has no flags")
            self.managed = DLManagedTensor(dl_tensor=tensor, manager_ctx=None, deleter=deleter)
        self.address = ctypes.addressof(self.managed)
        _LIVE[self.address] = self
        self.name = name or ("dltensor_versioned" if versioned else "dltensor")
        self.capsule = _PyCapsule_New(self.address, ctypes.addressof(_NAMES[self.name]), None)

    @property
    def consumed(self) -> bool:
        """Whether a consumer took the capsule (renamed it used_*)."""
        return capsule_name(self.capsule).startswith("used_")


class LegacyDLPackObject:
    """An old producer: __dlpack__ takes no keyword at all and returns a
    legacy "dltensor" capsule."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.producers: list[Producer] = []

    def __dlpack__(self):
        producer = Producer(self.array, versioned=False)
        self.producers.append(producer)
        return producer.capsule

    def __dlpack_device__(self):
        return (K_DL_CPU, 0)


class ModernDLPackObject:
    """A current producer: records the keywords it was called with and returns
    a versioned capsule when max_version allows, else a legacy one."""

    def __init__(self, array: np.ndarray, flags: int = 0):
        self.array = array
        self.flags = flags
        self.calls: list[dict] = []
        self.producers: list[Producer] = []

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append(dict(stream=stream, max_version=max_version, dl_device=dl_device,
                               copy=copy))
        versioned = max_version is not None and max_version[0] >= 1
        producer = Producer(self.array, versioned=versioned, flags=self.flags if versioned else 0)
        self.producers.append(producer)
        return producer.capsule

    def __dlpack_device__(self):
        return (K_DL_CPU, 0)
