"""Framework-neutral helpers: shapes, views and small allocations for torch
tensors, NumPy arrays, CuPy arrays and other DLPack producers, without
importing any framework that the caller has not imported already."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

INDEX_DTYPES = ("int32", "int64")


def torch_module():
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def is_capsule(x: Any) -> bool:
    return type(x).__name__ == "PyCapsule"


def check_array(x: Any, name: str) -> None:
    """TypeError unless `x` is an array the binding can take and whose shape
    this layer can read (DLPack capsules are taken by the binding alone)."""
    if is_capsule(x):
        raise TypeError(
            f"{name}: a raw DLPack capsule has no shape to slice a view from; pass the array "
            "object itself (torch, NumPy, CuPy), or the capsule to idempotent_moe._C directly"
        )
    if not (isinstance(x, np.ndarray) or hasattr(x, "__dlpack__")) or not hasattr(x, "shape"):
        raise TypeError(
            f"{name} must be an array with __dlpack__ (torch, NumPy, CuPy), "
            f"got {type(x).__name__}"
        )
    if is_torch(x) and x.requires_grad:
        raise TypeError(
            f"{name} requires grad: in-place compaction is not differentiable; "
            f"pass {name}.detach() (or run under torch.no_grad())"
        )


def shape_of(x: Any) -> tuple:
    return tuple(int(s) for s in x.shape)


def normalize_dim(dim: int, ndim: int, name: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    d = int(dim) + ndim if dim < 0 else int(dim)
    if not 0 <= d < ndim:
        raise ValueError(f"dim {dim} is out of range for {name} with {ndim} dimensions")
    return d


def check_int(value: Any, name: str, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def narrow(x: Any, dim: int, length: int) -> Any:
    """A view of the first `length` slots of axis `dim`; an object that cannot
    be sliced (a DLPack capsule or producer without __getitem__) is returned
    whole, so that a call never fails after it has written."""
    if is_torch(x):
        return x.narrow(dim, 0, length)
    if not hasattr(x, "__getitem__") or is_capsule(x):
        return x
    return x[(slice(None),) * dim + (slice(0, length),)]


def empty_index(like: Any, shape: Sequence[int], dtype: str) -> Any:
    """An uninitialised integer array in the framework and on the device of `like`."""
    if dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype must be one of {INDEX_DTYPES}, got {dtype!r}")
    shape = tuple(int(s) for s in shape)
    if is_torch(like):
        torch = torch_module()
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if isinstance(like, np.ndarray) or like is None:
        return np.empty(shape, dtype=dtype)
    namespace = getattr(like, "__array_namespace__", None)
    if namespace is not None:
        xp = namespace()
        return xp.empty(shape, dtype=getattr(xp, dtype), device=like.device)
    return np.empty(shape, dtype=dtype)


def as_index_array(values: Any, like: Any, name: str) -> Any:
    """Lists and tuples of ints become an int64 array beside `like`."""
    if isinstance(values, (list, tuple, range)):
        arr = np.asarray(values)
        if arr.size and (arr.dtype.kind not in "iu" or arr.dtype == np.bool_):
            # np.asarray(..., dtype=int64) would truncate 1.5 to 1 silently.
            raise TypeError(f"{name} must hold ints, got {arr.dtype} values")
        arr = arr.astype(np.int64)
        if is_torch(like):
            return torch_module().from_numpy(arr).to(like.device)
        return arr
    check_array(values, name)
    return values


def dtype_name(x: Any) -> str:
    """'int32', 'float16', ... for torch, NumPy and array-API dtypes."""
    name = str(x.dtype)
    return name.rsplit(".", 1)[-1]


_DL_CUDA, _DL_CUDA_MANAGED = 2, 13


def cuda_device_of(x: Any) -> int | None:
    """The CUDA device index of x, or None for host memory."""
    if is_torch(x):
        return x.device.index if x.device.type == "cuda" else None
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return None
    kind, index = device()
    return int(index) if int(kind) in (_DL_CUDA, _DL_CUDA_MANAGED) else None


def _torch_stream(torch: Any, device: int) -> int:
    """torch's current stream on CUDA device `device`, as dlpack_stream gives it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: cheaper
    handle = raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
    return int(handle) or 1


CURRENT_STREAM = "current"  # the binding reads the framework's current stream itself
# torch.Tensor once the binding has said it reads torch's current stream
# through DLPack's C exchange table (torch >= 2.10), () when it has said it
# does not; None until the first torch tensor asks.
_exchanged: Any = None


def dlpack_stream(x: Any) -> int | str | None:
    """The stream the library launches on for x, as the binding takes it: the
    caller's current stream on x's device (producers order their work before
    it). For a torch tensor whose current stream the binding reads itself,
    "current" (no lookup here); else the DLPack stream value (`stream_value`)."""
    global _exchanged
    if type(x) is _exchanged:  # the hot case: one comparison
        return CURRENT_STREAM
    if _exchanged is None:
        torch = torch_module()
        if torch is not None and type(x) is torch.Tensor:
            from ._native import native

            _exchanged = torch.Tensor if native().exchanges(torch.Tensor) else ()
            if _exchanged is torch.Tensor:
                return CURRENT_STREAM
    return stream_value(x)


def stream_value(x: Any) -> int | None:
    """The DLPack stream value of the caller's current stream on x's device:
    None for host memory. The default stream is 1 (DLPack's legacy default)."""
    torch = torch_module()
    if torch is not None and type(x) is torch.Tensor:
        return _torch_stream(torch, x.get_device()) if x.is_cuda else None
    device = cuda_device_of(x)
    if device is None:
        return None
    if is_torch(x):
        return _torch_stream(torch, device)
    cupy = sys.modules.get("cupy")
    handle = cupy.cuda.get_current_stream().ptr if cupy is not None else 0
    return int(handle) or 1
