"""The fused MoE dispatch and combine: the routing of an experts layer in
and out of the expert-sorted rows that grouped GEMMs take, in the C core
(two CUDA kernels for the dispatch, one each for the combine and the gated
activation; no host synchronisation).

Shapes: T tokens, k experts per token, S = T * k assignments (t, j), E
experts, H features. `top_k_index` [T, k] names each assignment's expert,
`top_k_weights` [T, k] its routing weight.

    d = moe_dispatch(hidden, top_k_index, E)                # dropless
    h = grouped_mm(d.rows, w_gate_up, offs=d.offsets)       # [S, 2I]
    a = gated_act(h, "silu", limit=d.offsets)               # act(gate) * up
    y = grouped_mm(a, w_down, offs=d.offsets)               # [S, H]
    out = moe_combine(y, d.dest, top_k_weights)             # [T, H]

`grouped_gemm(rows, w, offsets)` is the library's own grouped GEMM for a
few rows per expert (decode): out[r] = rows[r] @ w[e(r)], each dot product
summed in fp32 in one documented order (32 lane sums fed 16-byte vectors
of K with fused multiply-adds, then a butterfly; idempotent_moe.h), the
same bit for bit on the CPU and CUDA. On CUDA it reads the weights once, as
an [E, K, N] view whose K axis is contiguous (transformers' [E, N, K]
weights transposed). Its rounding is not grouped_mm's.

The router in front of it, fused: `top_k_weights, top_k_index =
topk_softmax(router_logits, k)` (softmax in fp32, top-k, renormalised:
torch's CUDA routing bit for bit, one kernel).

With `capacity=C`, each expert keeps its C assignments of highest weight
(ties to the lower token, NaN lowest); the others are dropped (dest -1)
and counted on the device (`dropped`, read when needed: that read
synchronises). Works on torch tensors and NumPy arrays (CPU), and torch
CUDA tensors with the CUDA kernels.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _arrays, _tracing
from ._native import native
from .functional import resolve_num_threads


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


def _ops(x: Any, *more: Any) -> Any:
    """The torch ops (`_moe_torch_ops`, differentiable) when torch.compile is
    tracing a call on torch tensors, or when autograd records one (x or one
    of `more` requires grad), else None."""
    if _tracing.depth or not _arrays.is_torch(x):
        return None
    torch = _arrays.torch_module()
    if not _tracing.compiling():
        # Attribute reads first: the no-grad path pays the least.
        if not x.requires_grad:
            for m in more:
                if m is not None and m.requires_grad:
                    break
            else:
                return None
        if not torch.is_grad_enabled():
            return None
    from . import _moe_torch_ops

    return torch.ops.idempotent_moe if _moe_torch_ops.AVAILABLE else None


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


def dispatch_workspace(hidden: Any, assignments: int, capacity: int | None, cuda: bool) -> Any:
    """moe_dispatch's int32 workspace beside `hidden` (a capacity on CUDA), or None."""
    elems = native().moe_workspace_elems(assignments, capacity, cuda) if cuda and capacity is not None else 0
    return _empty(hidden, (elems,), "int32") if elems else None


def _empty(like: Any, shape: tuple, dtype: Any = None) -> Any:
    """An uninitialised array beside `like` (torch or NumPy), of `dtype`
    (a name, or None for like's dtype)."""
    if _arrays.is_torch(like):
        torch = _arrays.torch_module()
        return torch.empty(shape, dtype=like.dtype if dtype is None else getattr(torch, dtype),
                           device=like.device)
    return np.empty(shape, dtype=like.dtype if dtype is None else dtype)


def moe_dispatch(hidden: Any, top_k_index: Any, num_experts: int, *, top_k_weights: Any = None,
                 capacity: int | None = None, layout: str = "grouped", skip_foreign: bool = False,
                 out: MoEDispatch | None = None, num_threads: int | None = None,
                 _apart: bool = False) -> MoEDispatch:
    """The assignments sorted by expert, stable in token order, and their
    tokens' rows of `hidden` [T, H] gathered (see MoEDispatch). For torch
    tensors, offsets, dest and src are views of one int32 allocation.

    top_k_index    [T, k] int32/int64, each in [0, num_experts); with
                   `skip_foreign`, ids >= num_experts (another rank's
                   experts under expert parallelism) are skipped.
    top_k_weights  [T, k] float, required with a capacity.
    capacity       None: dropless. C >= 0: each expert keeps at most C.
    layout         "grouped" (the kept rows of expert 0, then expert 1,
                   ...) or "padded" (expert e owns rows [e*C, e*C + C):
                   static shapes for batched GEMMs; needs a capacity).
    out            a MoEDispatch of arrays to write (every field, with the
                   shapes and dtypes above; `torch_outputs` makes one for
                   torch tensors), returned; nothing is allocated but a capacity's
                   workspace on CUDA.
    """
    ops = _ops(hidden) if out is None else None
    if ops is not None:
        return MoEDispatch(*ops.moe_dispatch(hidden, top_k_index, top_k_weights, num_experts, capacity,
                                             layout, skip_foreign))
    shape = top_k_index.shape
    # Another shape is the core's to name.
    num_tokens, top_k = (int(shape[0]), int(shape[1])) if len(shape) == 2 else (0, 0)
    assignments = num_tokens * top_k
    torch_hidden = _arrays.is_torch(hidden)
    if out is not None:
        if not isinstance(out, MoEDispatch):
            raise TypeError(f"out must be a MoEDispatch (rows, offsets, dest, src, dropped), not "
                            f"{type(out).__name__}")
    elif torch_hidden and not _apart:
        out = torch_outputs(hidden, num_experts, num_tokens, top_k,
                            dispatch_rows(assignments, num_experts, capacity, layout))
    else:
        rows = dispatch_rows(assignments, num_experts, capacity, layout)
        hshape = _arrays.shape_of(hidden)
        out = MoEDispatch(_empty(hidden, (rows,) + hshape[1:]), _empty(hidden, (num_experts,), "int32"),
                          _empty(hidden, (num_tokens, top_k), "int32"), _empty(hidden, (rows,), "int32"),
                          _empty(hidden, (1,), "int64"))
    cuda = hidden.is_cuda if torch_hidden else _arrays.cuda_device_of(hidden) is not None
    stream = _arrays.dlpack_stream(hidden)
    native().moe_dispatch(
        hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights,
        num_experts=num_experts, capacity=capacity, layout=layout, skip_foreign=skip_foreign,
        out_rows=out.rows, out_offsets=out.offsets, out_dest=out.dest, out_src=out.src,
        out_dropped=out.dropped, workspace=dispatch_workspace(hidden, assignments, capacity, cuda),
        num_threads=resolve_num_threads(num_threads), stream=stream)
    return out


def moe_combine(rows: Any, dest: Any, weights: Any, *, out: Any = None, out_dtype: Any = None,
                num_threads: int | None = None) -> Any:
    """out[t] = sum over j of weights[t, j] * rows[dest[t, j]] ([T, H]),
    skipping dest -1: each term rounded to the promoted dtype of rows and
    weights, summed in fp32 in j order, rounded once (the arithmetic of
    `acc.add_(rows[dest[:, j]] * weights[:, j, None])` in an fp32 `acc`).
    `out` (or a new array of `out_dtype`, default rows' dtype) is returned."""
    ops = _ops(rows, weights) if out is None else None
    if ops is not None:
        return ops.moe_combine(rows, dest, weights, rows.dtype if out_dtype is None else out_dtype)
    if out is None:
        shape = (_arrays.shape_of(dest)[0], _arrays.shape_of(rows)[-1])
        out = _empty(rows, shape, _dtype_name(out_dtype))
    native().moe_combine(rows=rows, dest=dest, weights=weights, out=out,
                         num_threads=resolve_num_threads(num_threads),
                         stream=_arrays.dlpack_stream(rows))
    return out


def gated_act(gate_up: Any, act: str = "silu", *, limit: Any = None, out: Any = None,
              num_threads: int | None = None) -> Any:
    """act(gate_up[:, :I]) * gate_up[:, I:] ([R, I]), each factor rounded
    to gate_up's dtype as torch rounds `act(gate) * up`. act: "silu",
    "gelu", "gelu_tanh" or "relu". With `limit` (a dispatch's offsets),
    only rows below limit[-1] are computed; the others are left as they
    were (uninitialised in a new `out`)."""
    ops = _ops(gate_up) if out is None else None
    if ops is not None:
        return ops.gated_act(gate_up, act, limit)
    if out is None:
        shape = _arrays.shape_of(gate_up)
        out = _empty(gate_up, shape[:-1] + (shape[-1] // 2,))
    native().gated_act(gate_up=gate_up, out=out, act=act, limit=limit,
                       num_threads=resolve_num_threads(num_threads),
                       stream=_arrays.dlpack_stream(gate_up))
    return out


def grouped_gemm(a: Any, w: Any, offsets: Any, *, out: Any = None, num_threads: int | None = None) -> Any:
    """out[r] = a[r] @ w[e(r)] ([R, N]) for rows r < offsets[-1], e(r) the
    first e with offsets[e] > r; rows from offsets[-1] on are left as they
    were (uninitialised in a new `out`). a [R, K], w [E, K, N] (any
    strides; on CUDA its K axis contiguous), offsets [E] int32 (a
    dispatch's), all of one float dtype. Each sum is fp32 in the order of
    idempotent_moe.h, rounded once; CPU and CUDA agree bit for bit.
    Bad offsets (decreasing, or beyond R) are a ValueError on the CPU and a
    recorded error on CUDA (check_errors), with nothing written."""
    ops = _ops(a, w) if out is None else None
    if ops is not None:
        return ops.grouped_gemm(a, w, offsets)
    if out is None:
        out = _empty(a, (_arrays.shape_of(a)[0], _arrays.shape_of(w)[-1]))
    native().grouped_gemm(a=a, w=w, offsets=offsets, out=out, num_threads=resolve_num_threads(num_threads),
                          stream=_arrays.dlpack_stream(a))
    return out


def gated_act_backward(gate_up: Any, grad_act: Any, act: str = "silu", *, limit: Any = None,
                       out: Any = None, num_threads: int | None = None) -> Any:
    """d(gate_up) [R, 2I] of `gated_act(gate_up, act, limit=limit)` given its
    output's gradient `grad_act` [R, I]: d(gate) = grad * up * act'(gate),
    d(up) = grad * act(gate), in fp32, rounded once to gate_up's dtype. Rows
    at or past limit[-1] get zeros."""
    ops = _ops(gate_up, grad_act) if out is None else None
    if ops is not None:
        return ops.gated_act_backward(gate_up, grad_act, act, limit)
    if out is None:
        out = _empty(gate_up, _arrays.shape_of(gate_up))
    native().gated_act_backward(gate_up=gate_up, grad_act=grad_act, out=out, act=act, limit=limit,
                                num_threads=resolve_num_threads(num_threads),
                                stream=_arrays.dlpack_stream(gate_up))
    return out


def moe_gather_rows(src: Any, dest: Any, num_rows: int, *, weights: Any = None, out: Any = None,
                    out_dtype: Any = None, num_threads: int | None = None) -> Any:
    """[num_rows, H]: row dest[t, j] = weights[t, j] * src[t] (weights None:
    src[t]) for each kept assignment, zeros in every other row; fp32 products
    rounded once. The combine's d(rows) from its output's gradient `src`
    [T, H], and the re-gather of a dispatch's rows from hidden (weights None)."""
    ops = _ops(src, weights) if out is None else None
    if ops is not None:
        torch = _arrays.torch_module()
        dtype = src.dtype if out_dtype is None else getattr(torch, _dtype_name(out_dtype))
        return ops.moe_gather_rows(src, dest, weights, num_rows, dtype)
    if out is None:
        out = _empty(src, (num_rows, _arrays.shape_of(src)[-1]), _dtype_name(out_dtype))
    native().moe_gather_rows(src=src, dest=dest, weights=weights, out=out,
                             num_threads=resolve_num_threads(num_threads), stream=_arrays.dlpack_stream(src))
    return out


def moe_weight_grad(a: Any, b: Any, dest: Any, *, a_by_row: bool = False, out: Any = None,
                    out_dtype: Any = None, num_threads: int | None = None) -> Any:
    """[T, k]: <a[i], b[dest[t, j]]> with i = dest[t, j] (`a_by_row`) or t,
    0 where dest is -1; fp32 sums in a fixed order (idempotent_moe.h), one
    rounding to `out_dtype` (default a's). The combine's d(top_k_weights):
    a its output's gradient [T, H], b its rows [R, H]."""
    ops = _ops(a, b) if out is None else None
    if ops is not None:
        torch = _arrays.torch_module()
        dtype = a.dtype if out_dtype is None else getattr(torch, _dtype_name(out_dtype))
        return ops.moe_weight_grad(a, b, dest, a_by_row, dtype)
    if out is None:
        out = _empty(a, tuple(_arrays.shape_of(dest)), _dtype_name(out_dtype))
    native().moe_weight_grad(a=a, b=b, dest=dest, out=out, a_by_row=a_by_row,
                             num_threads=resolve_num_threads(num_threads), stream=_arrays.dlpack_stream(a))
    return out


def _dtype_name(dtype: Any) -> str | None:
    """'float32' for torch.float32, np.float32, 'float32'; None for None."""
    if dtype is None:
        return None
    return str(np.dtype(dtype) if isinstance(dtype, type) else dtype).rsplit(".", 1)[-1]


def topk_softmax(logits: Any, k: int, *, renormalize: bool = True, out_dtype: Any = None,
                 index_dtype: str = "int64", num_threads: int | None = None) -> tuple[Any, Any]:
    """The router after its linear: per row of `logits` [T, E] (E <= 1024),
    p = softmax in fp32, the k largest p in descending order (equal values
    in the order torch's CUDA topk gives them: gathered in expert order,
    then its bitonic network; see `imoe_topk_softmax` in idempotent_moe.h),
    divided by their sum when `renormalize`.
    Returns (weights [T, k] of `out_dtype`, default float32; indices [T, k]
    of `index_dtype`, "int64" or "int32"). k <= min(E, 32).

    The arithmetic is torch's CUDA routing (`softmax(logits.float())`,
    `topk`, `w / w.sum(-1, keepdim=True)`, `.to(out_dtype)`), so on CUDA the
    result is transformers' router output bit for bit; on the CPU the same
    order of operations, with exp correctly rounded where CUDA's expf uses
    the hardware's approximation (a few ulp apart at most). A row with a
    NaN or +inf logit, or only -inf logits, gets NaN weights (as torch's
    softmax gives) and experts 0 .. k-1 in torch's order for equal values
    (1, 0 for k = 2)."""
    ops = _ops(logits) if _arrays.is_torch(logits) and _tracing.compiling() else None
    if ops is not None:
        torch = _arrays.torch_module()
        dtype = torch.float32 if out_dtype is None else getattr(torch, _dtype_name(out_dtype))
        return tuple(ops.topk_softmax(logits, k, renormalize, dtype, index_dtype))
    shape = _arrays.shape_of(logits)
    tokens = int(shape[0]) if len(shape) == 2 else 0  # another shape is the core's to name
    cols = max(int(k), 0)
    weights = _empty(logits, (tokens, cols), _dtype_name(out_dtype) or "float32")
    indices = _empty(logits, (tokens, cols), index_dtype)
    native().topk_softmax(logits=logits, k=k, renormalize=renormalize, out_weights=weights,
                          out_indices=indices, num_threads=resolve_num_threads(num_threads),
                          stream=_arrays.dlpack_stream(logits))
    return weights, indices
