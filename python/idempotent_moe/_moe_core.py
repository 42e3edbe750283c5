"""The MoE operations' direct calls into the C core: the outputs made (by
the binding, through `empty`, once it has judged the call) or given, the
binding's call. `moe` holds the public functions, which route a call
that torch.compile traces or autograd records to the torch ops of
`_moe_torch_ops`; those ops' real implementations call these functions.
Every docstring of the public functions holds for these."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _arrays
from ._compaction import resolve_num_threads
from ._native import native


class MoEDispatch(NamedTuple):
    """What `moe_dispatch` returns.

    rows     [R, H]: row r holds the token of one kept assignment (zeros
             where a row holds none); R = S ("grouped") or E * C ("padded").
    offsets  [E] int32: expert e's rows end at offsets[e] (grouped_mm's
             `offs`); "padded": (e + 1) * C.
    dest     [T, k] int32: the row of assignment (t, j), -1 when dropped.
    src      [R] int32: the token of row r, -1 for an empty row.
    dropped  [1] int64: assignments the capacity dropped (0 dropless).
    """

    rows: Any
    offsets: Any
    dest: Any
    src: Any
    dropped: Any


def dispatch_rows(assignments: int, num_experts: int, capacity: int | None, layout: str) -> int:
    """R, the rows of a dispatch: E x C padded, else one per assignment."""
    return num_experts * capacity if layout == "padded" and capacity is not None else assignments


def torch_outputs(hidden: Any, num_experts: int, num_tokens: int, top_k: int, rows: int) -> MoEDispatch:
    """Uninitialised outputs of a dispatch of torch `hidden` [T, H]:
    offsets, dest and src are views of one int32 allocation."""
    torch = _arrays.torch_module()
    assignments, device = num_tokens * top_k, hidden.device
    ints = torch.empty(num_experts + assignments + rows, dtype=torch.int32, device=device)
    return MoEDispatch(hidden.new_empty((rows,) + tuple(hidden.shape[1:])), ints[:num_experts],
                       ints[num_experts:num_experts + assignments].view(num_tokens, top_k),
                       ints[num_experts + assignments:], torch.empty(1, dtype=torch.int64, device=device))


def separate_outputs(hidden: Any, num_experts: int, num_tokens: int, top_k: int, rows: int) -> MoEDispatch:
    """Uninitialised outputs of a dispatch, each its own array (NumPy, or torch
    outputs that may not alias: a custom op's)."""
    return MoEDispatch(empty(hidden, (rows,) + _arrays.shape_of(hidden)[1:]),
                       empty(hidden, (num_experts,), "int32"), empty(hidden, (num_tokens, top_k), "int32"),
                       empty(hidden, (rows,), "int32"), empty(hidden, (1,), "int64"))


def dispatch_workspace(hidden: Any, assignments: int, capacity: int | None, cuda: bool) -> Any:
    """moe_dispatch's int32 workspace beside `hidden` on CUDA, or None where
    the call needs none: a capacity's (required), or a large dropless call's
    (from IMOE_MOE_MULTI_SORT_MIN assignments the sort runs in blocks, with a
    capacity too)."""
    elems = native().moe_workspace_elems(assignments, capacity, cuda) if cuda else 0
    return empty(hidden, (elems,), "int32") if elems else None


def empty(like: Any, shape: tuple, dtype: Any = None) -> Any:
    """An uninitialised array beside `like` (torch or NumPy), of `dtype`
    (a name, or None for like's dtype). The binding calls it (`new`) for the
    outputs it makes, once it has judged the call."""
    if _arrays.is_torch(like):
        torch = _arrays.torch_module()
        return torch.empty(shape, dtype=like.dtype if dtype is None else getattr(torch, dtype),
                           device=like.device)
    return np.empty(shape, dtype=like.dtype if dtype is None else dtype)


def dtype_name(dtype: Any) -> Any:
    """'float32' for torch.float32, np.float32 and np.dtype('float32'); None
    and str as they are, for the binding to judge (ValueError for a name it
    does not take); any other object as it is (its TypeError)."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    torch = _arrays.torch_module()
    if torch is not None and isinstance(dtype, torch.dtype):
        return str(dtype).rsplit(".", 1)[-1]
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        return np.dtype(dtype).name
    return dtype


def torch_dtype(dtype: Any, default: Any, name: str = "out_dtype") -> Any:
    """The torch dtype an op of `_moe_torch_ops` takes for `dtype` (its
    float64 runs the torch references): `default` for None; TypeError for
    what is neither a dtype nor a name, ValueError for a name of no
    floating-point torch dtype."""
    if dtype is None:
        return default
    torch = _arrays.torch_module()
    if isinstance(dtype, torch.dtype):
        found = dtype
    else:
        spelled = dtype_name(dtype)
        if not isinstance(spelled, str):
            raise TypeError(f"{name} must be a dtype or a dtype's name, got {type(dtype).__name__}")
        found = getattr(torch, spelled, None)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"{name}: {spelled!r} is not the name of a dtype")
    if not found.is_floating_point:
        raise ValueError(f"{name} must be a floating-point dtype, got {found}")
    return found


def moe_dispatch(hidden: Any, top_k_index: Any, num_experts: int, *, top_k_weights: Any = None,
                 capacity: int | None = None, layout: str = "grouped", skip_foreign: bool = False,
                 distinct: bool = False, out: MoEDispatch | None = None, num_threads: int | None = None,
                 _apart: bool = False) -> MoEDispatch:
    """The direct path of `moe.moe_dispatch` (its docstring)."""
    if out is None:
        new_outputs = torch_outputs if _arrays.is_torch(hidden) and not _apart else separate_outputs
        return native().moe_dispatch(
            hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights, num_experts=num_experts,
            capacity=capacity, layout=layout, skip_foreign=skip_foreign, distinct=distinct,
            new_outputs=new_outputs, new=empty, num_threads=resolve_num_threads(num_threads),
            stream=_arrays.dlpack_stream(hidden))
    if not isinstance(out, MoEDispatch):
        raise TypeError(f"out must be a MoEDispatch (rows, offsets, dest, src, dropped), not "
                        f"{type(out).__name__}")
    native().moe_dispatch(
        hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights, num_experts=num_experts,
        capacity=capacity, layout=layout, skip_foreign=skip_foreign, distinct=distinct, out_rows=out.rows,
        out_offsets=out.offsets, out_dest=out.dest, out_src=out.src, out_dropped=out.dropped, new=empty,
        num_threads=resolve_num_threads(num_threads), stream=_arrays.dlpack_stream(hidden))
    return out


def moe_combine(rows: Any, dest: Any, weights: Any, *, out: Any = None, out_dtype: Any = None,
                num_threads: int | None = None) -> Any:
    """The direct path of `moe.moe_combine` (its docstring)."""
    return native().moe_combine(rows=rows, dest=dest, weights=weights, out=out,
                                out_dtype=dtype_name(out_dtype), new=empty,
                                num_threads=resolve_num_threads(num_threads),
                                stream=_arrays.dlpack_stream(rows))


def gated_act(gate_up: Any, act: str = "silu", *, limit: Any = None, out: Any = None,
              num_threads: int | None = None) -> Any:
    """The direct path of `moe.gated_act` (its docstring)."""
    return native().gated_act(gate_up=gate_up, out=out, act=act, limit=limit, new=empty,
                              num_threads=resolve_num_threads(num_threads),
                              stream=_arrays.dlpack_stream(gate_up))


def grouped_gemm(a: Any, w: Any, offsets: Any, *, out: Any = None, num_threads: int | None = None) -> Any:
    """The direct path of `moe.grouped_gemm` (its docstring)."""
    return native().grouped_gemm(a=a, w=w, offsets=offsets, out=out, new=empty,
                                 num_threads=resolve_num_threads(num_threads),
                                 stream=_arrays.dlpack_stream(a))


def experts_gemm(x: Any, w: Any, offsets: Any, *, src: Any = None, act: str | None = None, out: Any = None,
                 num_threads: int | None = None) -> Any:
    """The direct path of `moe.experts_gemm` (its docstring)."""
    return native().experts_gemm(x=x, w=w, offsets=offsets, src=src, act=act, out=out, new=empty,
                                 num_threads=resolve_num_threads(num_threads),
                                 stream=_arrays.dlpack_stream(x))


def gated_act_backward(gate_up: Any, grad_act: Any, act: str = "silu", *, limit: Any = None,
                       row_scale: Any = None, act_out: Any = None, row_dot: Any = None, out: Any = None,
                       num_threads: int | None = None) -> Any:
    """The direct path of `moe.gated_act_backward` (its docstring)."""
    return native().gated_act_backward(gate_up=gate_up, grad_act=grad_act, out=out, act=act, limit=limit,
                                       row_scale=row_scale, act_out=act_out, row_dot=row_dot, new=empty,
                                       num_threads=resolve_num_threads(num_threads),
                                       stream=_arrays.dlpack_stream(gate_up))


def moe_gather_rows(src: Any, dest: Any, num_rows: int, *, weights: Any = None, out: Any = None,
                    out_dtype: Any = None, num_threads: int | None = None) -> Any:
    """The direct path of `moe.moe_gather_rows` (its docstring)."""
    return native().moe_gather_rows(src=src, dest=dest, weights=weights, out=out, num_rows=num_rows,
                                    out_dtype=dtype_name(out_dtype), new=empty,
                                    num_threads=resolve_num_threads(num_threads),
                                    stream=_arrays.dlpack_stream(src))


def moe_weight_grad(a: Any, b: Any, dest: Any, *, a_by_row: bool = False, out: Any = None,
                    out_dtype: Any = None, num_threads: int | None = None) -> Any:
    """The direct path of `moe.moe_weight_grad` (its docstring)."""
    return native().moe_weight_grad(a=a, b=b, dest=dest, out=out, a_by_row=a_by_row,
                                    out_dtype=dtype_name(out_dtype), new=empty,
                                    num_threads=resolve_num_threads(num_threads),
                                    stream=_arrays.dlpack_stream(a))


def topk_softmax(logits: Any, k: int, *, renormalize: bool = True, out_dtype: Any = None,
                 index_dtype: str = "int64", num_threads: int | None = None) -> tuple[Any, Any]:
    """The direct path of `moe.topk_softmax` (its docstring)."""
    return native().topk_softmax(logits=logits, k=k, renormalize=renormalize,
                                 out_dtype=dtype_name(out_dtype), index_dtype=dtype_name(index_dtype),
                                 new=empty, num_threads=resolve_num_threads(num_threads),
                                 stream=_arrays.dlpack_stream(logits))
