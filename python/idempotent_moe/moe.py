"""The MoE operations of idempotent-moe, every public MoE name in one module.

The fused operations route an experts layer in and out of the expert-sorted
rows that grouped GEMMs take, in the C core (two CUDA kernels for the
dispatch, one each for the combine and the gated activation; no host
synchronisation).

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
weights transposed). Its rounding is not grouped_mm's. `experts_gemm` is
the tensor-core one that reads the tokens through a dispatch's `src`.

The router in front of it, fused: `top_k_weights, top_k_index =
topk_softmax(router_logits, k)` (softmax in fp32, top-k, renormalised:
torch's CUDA routing bit for bit, one kernel).

With `capacity=C`, each expert keeps its C assignments of highest weight
(ties to the lower token, NaN lowest); the others are dropped (dest -1)
and counted on the device (`dropped`, read when needed: that read
synchronises). Works on torch tensors and NumPy arrays (CPU), and torch
CUDA tensors with the CUDA kernels.

Each operation is routed once, here: a call that torch.compile traces, or
that autograd records (the differentiable ones), goes to its torch op
(`_moe_torch_ops`, imported then, and torch with it); any other call to the
direct path of the same name in `_moe_core`. Importing this module does not
import torch.

Expert capacity on per-expert token buffers [E, T, D], the original API:
`InplaceMoERouter`, `generate_idempotent_moe_map` and
`compact_moe_tokens_inplace`, through `functional`'s compaction. `block_d`,
a tuning hint of that API (`InplaceMoERouter`, `compact_moe_tokens_inplace`,
`integrations.HuggingFaceMoEInplaceHook`), is still accepted and is
ignored: every hidden size works.
"""

from __future__ import annotations

import re
from typing import Any

from . import _arrays, _moe_core, _tracing
from ._moe_core import MoEDispatch, dispatch_rows, dispatch_workspace, torch_outputs
from ._moe_rules import check_expert_buffer
from ._native import native
from .functional import apply_map_, compact_, idempotent_map


def _ops(x: Any, *more: Any) -> Any:
    """The torch ops (`_moe_torch_ops`, differentiable) when torch.compile is
    tracing a call on torch tensors, or when autograd records one (x or one
    of `more` requires grad), else None."""
    if not _arrays.is_torch(x):
        return None
    torch = _arrays.torch_module()
    if not _tracing.compiling():
        # Attribute reads first: the no-grad path pays the least.
        if not x.requires_grad:
            for m in more:
                if getattr(m, "requires_grad", False):  # None, or not a tensor: the binding names it
                    break
            else:
                return None
        if not torch.is_grad_enabled():
            return None
    from . import _moe_torch_ops

    return torch.ops.idempotent_moe if _moe_torch_ops.AVAILABLE else None


# torch's refusal of an argument of another type than an op's schema says
# (before the op runs): a TypeError naming the argument, as on the direct path.
_SCHEMA_TYPE = re.compile(r"Expected a value of type '([^']*)' for argument '(\w+)' but instead found "
                          r"type '([^']*)'")


def _op(fn: Any, *args: Any) -> Any:
    """fn(*args), an op of `_moe_torch_ops`, with torch's schema errors as
    TypeErrors naming the argument."""
    try:
        return fn(*args)
    except RuntimeError as e:
        found = _SCHEMA_TYPE.search(str(e))
        if found is None:
            raise
        raise TypeError(f"{found[2]} must be {found[1]}, got {found[3]}") from e


def moe_dispatch(hidden: Any, top_k_index: Any, num_experts: int, *, top_k_weights: Any = None,
                 capacity: int | None = None, layout: str = "grouped", skip_foreign: bool = False,
                 distinct: bool = False, out: MoEDispatch | None = None, num_threads: int | None = None,
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
    distinct       refuse a token that names one of this call's experts
                   twice (ValueError; checked on the CPU, not on CUDA),
                   unless one of the two has weight 0 in top_k_weights (it
                   adds nothing); otherwise such a token is two assignments.
    out            a MoEDispatch of arrays to write (every field, with the
                   shapes and dtypes above; `torch_outputs` makes one for
                   torch tensors), returned; nothing is allocated but the
                   workspace on CUDA (a capacity's, or a dropless call's of
                   32,768 assignments or more; from 32,768 assignments the
                   sort runs in several blocks).

    Every argument is judged before anything is allocated or written: a call
    that raises leaves `out` as it was.
    """
    ops = _ops(hidden, top_k_weights) if out is None else None
    if ops is not None:
        return MoEDispatch(*_op(ops.moe_dispatch, hidden, top_k_index, top_k_weights, num_experts, capacity,
                                layout, skip_foreign, distinct))
    return _moe_core.moe_dispatch(hidden, top_k_index, num_experts, top_k_weights=top_k_weights,
                                  capacity=capacity, layout=layout, skip_foreign=skip_foreign,
                                  distinct=distinct, out=out, num_threads=num_threads, _apart=_apart)


def moe_combine(rows: Any, dest: Any, weights: Any, *, out: Any = None, out_dtype: Any = None,
                num_threads: int | None = None) -> Any:
    """out[t] = sum over j of weights[t, j] * rows[dest[t, j]] ([T, H]),
    skipping dest -1: each term rounded to the promoted dtype of rows and
    weights, summed in fp32 in j order, rounded once (the arithmetic of
    `acc.add_(rows[dest[:, j]] * weights[:, j, None])` in an fp32 `acc`).
    `out` (or a new array of `out_dtype`, default rows' dtype) is returned."""
    ops = _ops(rows, weights) if out is None else None
    if ops is not None:
        return _op(ops.moe_combine, rows, dest, weights, _moe_core.torch_dtype(out_dtype, rows.dtype))
    return _moe_core.moe_combine(rows, dest, weights, out=out, out_dtype=out_dtype, num_threads=num_threads)


def gated_act(gate_up: Any, act: str = "silu", *, limit: Any = None, out: Any = None,
              num_threads: int | None = None) -> Any:
    """act(gate_up[:, :I]) * gate_up[:, I:] ([R, I]), each factor rounded
    to gate_up's dtype as torch rounds `act(gate) * up`. act: "silu",
    "gelu", "gelu_tanh" or "relu". With `limit` (a dispatch's offsets),
    only rows below limit[-1] are computed; the others are left as they
    were (uninitialised in a new `out`)."""
    ops = _ops(gate_up) if out is None else None
    if ops is not None:
        return _op(ops.gated_act, gate_up, act, limit)
    return _moe_core.gated_act(gate_up, act, limit=limit, out=out, num_threads=num_threads)


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
        return _op(ops.grouped_gemm, a, w, offsets)
    return _moe_core.grouped_gemm(a, w, offsets, out=out, num_threads=num_threads)


def experts_gemm(x: Any, w: Any, offsets: Any, *, src: Any = None, act: str | None = None, out: Any = None,
                 num_threads: int | None = None) -> Any:
    """The experts' grouped GEMM on tensor cores, each row's input read where
    it lies: y[r] = x[src[r]] @ w[e(r)] for rows r < offsets[-1] (x [T, K]
    in token order, src [R] int32 a dispatch's `src`: no gathered copy of
    the rows is made), or y[r] = x[r] @ w[e(r)] without src (x [R, K]).
    Returns y [R, N], or with `act` ("silu", "gelu", "gelu_tanh", "relu")
    the gated activation of y ([R, N / 2]: act(gate) * up as `gated_act`
    computes it from y rounded to x's dtype; w's first N / 2 columns the
    gate, as transformers' gate_up_proj). Rows from offsets[-1] on are left
    as they were (uninitialised in a new `out`). w [E, K, N] of x's dtype
    (transformers' [E, N, K] weights transposed), offsets [E] int32.

    Sums in fp32, one rounding (grouped_mm's rounding class; the CPU sums in
    increasing k, CUDA in the tensor cores' order: close, not bit-identical).
    On CUDA float16 and bfloat16 with K a multiple of 8. Bad offsets or src
    are a ValueError on the CPU and a recorded error on CUDA (check_errors),
    with nothing written. Not differentiable (x or w requiring grad is a
    TypeError): training runs the fused experts layer, which has a backward."""
    if _arrays.is_torch(x) and (x.requires_grad or getattr(w, "requires_grad", False)):
        raise TypeError("experts_gemm is not differentiable: x and w must not require grad")
    ops = _ops(x, w) if out is None else None  # refused above when recorded: traced only
    if ops is not None:
        return _op(ops.experts_gemm, x, w, offsets, src, act)
    return _moe_core.experts_gemm(x, w, offsets, src=src, act=act, out=out, num_threads=num_threads)


def gated_act_backward(gate_up: Any, grad_act: Any, act: str = "silu", *, limit: Any = None,
                       row_scale: Any = None, act_out: Any = None, row_dot: Any = None, out: Any = None,
                       num_threads: int | None = None) -> Any:
    """d(gate_up) [R, 2I] of `gated_act(gate_up, act, limit=limit)` given its
    output's gradient `grad_act` [R, I]: d(gate) = grad * up * act'(gate),
    d(up) = grad * act(gate), in fp32, rounded once to gate_up's dtype. Rows
    at or past limit[-1] get zeros.

    The fused experts layer's backward in the same pass (each optional):
    `row_scale` [R, 1] multiplies each row's grad first (in fp32);
    `act_out` [R, I] (gate_up's dtype) receives the forward's value
    act(gate) * up times row_scale, and may be grad_act itself (each element
    is read before it is written); `row_dot` [R, 1] float32 receives
    <grad_act[r], act(gate) * up> per row (unscaled). act_out and row_dot are
    written in place (the direct path, as with `out`); rows past the limit
    get zeros. `out` may be gate_up itself (gate and up are read before
    their gradients are written over them); any other overlap is refused."""
    direct = out is not None or row_scale is not None or act_out is not None or row_dot is not None
    ops = None if direct else _ops(gate_up, grad_act)
    if ops is not None:
        return _op(ops.gated_act_backward, gate_up, grad_act, act, limit)
    return _moe_core.gated_act_backward(gate_up, grad_act, act, limit=limit, row_scale=row_scale,
                                        act_out=act_out, row_dot=row_dot, out=out, num_threads=num_threads)


def moe_gather_rows(src: Any, dest: Any, num_rows: int, *, weights: Any = None, out: Any = None,
                    out_dtype: Any = None, num_threads: int | None = None) -> Any:
    """[num_rows, H]: row dest[t, j] = weights[t, j] * src[t] (weights None:
    src[t]) for each kept assignment, zeros in every other row; fp32 products
    rounded once. The combine's d(rows) from its output's gradient `src`
    [T, H], and the re-gather of a dispatch's rows from hidden (weights None).
    A given `out` must be [num_rows, H]."""
    ops = _ops(src, weights) if out is None else None
    if ops is not None:
        dtype = _moe_core.torch_dtype(out_dtype, src.dtype)
        return _op(ops.moe_gather_rows, src, dest, weights, num_rows, dtype)
    return _moe_core.moe_gather_rows(src, dest, num_rows, weights=weights, out=out, out_dtype=out_dtype,
                                     num_threads=num_threads)


def moe_weight_grad(a: Any, b: Any, dest: Any, *, a_by_row: bool = False, out: Any = None,
                    out_dtype: Any = None, num_threads: int | None = None) -> Any:
    """[T, k]: <a[i], b[dest[t, j]]> with i = dest[t, j] (`a_by_row`) or t,
    0 where dest is -1; fp32 sums in a fixed order (idempotent_moe.h), one
    rounding to `out_dtype` (default a's). The combine's d(top_k_weights):
    a its output's gradient [T, H], b its rows [R, H]."""
    ops = _ops(a, b) if out is None else None
    if ops is not None:
        return _op(ops.moe_weight_grad, a, b, dest, a_by_row, _moe_core.torch_dtype(out_dtype, a.dtype))
    return _moe_core.moe_weight_grad(a, b, dest, a_by_row=a_by_row, out=out, out_dtype=out_dtype,
                                     num_threads=num_threads)


def topk_softmax(logits: Any, k: int, *, renormalize: bool = True, out_dtype: Any = None,
                 index_dtype: str = "int64", num_threads: int | None = None) -> tuple[Any, Any]:
    """The router after its linear: per row of `logits` [T, E] (E <= 1024),
    p = softmax in fp32, the k largest p in descending order (equal values
    in the order torch's CUDA topk gives them: gathered in expert order,
    then its bitonic network; see `imoe_topk_softmax` in idempotent_moe.h),
    divided by their sum when `renormalize`.
    Returns (weights [T, k] of `out_dtype`, default float32; indices [T, k]
    of `index_dtype`, "int64" or "int32", or their dtypes). k <= min(E, 32).

    The arithmetic is torch's CUDA routing (`softmax(logits.float())`,
    `topk`, `w / w.sum(-1, keepdim=True)`, `.to(out_dtype)`), so on CUDA the
    result is transformers' router output bit for bit; on the CPU the same
    order of operations, with exp correctly rounded where CUDA's expf uses
    the hardware's approximation (a few ulp apart at most). A row with a
    NaN or +inf logit, or only -inf logits, gets NaN weights (as torch's
    softmax gives) and experts 0 .. k-1 in torch's order for equal values
    (1, 0 for k = 2). Not differentiable: logits that require grad are a
    TypeError."""
    ops = _ops(logits) if _arrays.is_torch(logits) and _tracing.compiling() else None
    if ops is not None:
        torch = _arrays.torch_module()
        index_dtype = _moe_core.dtype_name(index_dtype)
        if index_dtype not in native().INDEX_DTYPES:
            raise ValueError(f"index_dtype must be one of {native().INDEX_DTYPES}, got {index_dtype!r}")
        dtype = _moe_core.torch_dtype(out_dtype, torch.float32)
        return tuple(_op(ops.topk_softmax, logits, k, renormalize, dtype, index_dtype))
    return _moe_core.topk_softmax(logits, k, renormalize=renormalize, out_dtype=out_dtype,
                                  index_dtype=index_dtype, num_threads=num_threads)


# Expert capacity on per-expert buffers [E, T, D] (the original API).


class InplaceMoERouter:
    """Capacity dropping for per-expert token buffers.

    router = InplaceMoERouter(hidden_dim=1024, num_experts=8)
    kept = router(tokens, scores, expert_capacity=2048)

    tokens [E, T, D] (any dtype, D == hidden_dim) is compacted in place;
    scores [E, T] float32/float16/bfloat16 are the routing scores. Returns the
    view tokens[:, :C] ([E, C, D]), and with return_indices=True also the
    indices [E, C] (int64) of the original token held by each kept slot.
    """

    def __init__(self, hidden_dim: int, num_experts: int, block_d: int = 128) -> None:
        # block_d: accepted and ignored (the module docstring).
        self.hidden_dim = _arrays.check_int(hidden_dim, "hidden_dim", minimum=1)
        self.num_experts = _arrays.check_int(num_experts, "num_experts", minimum=1)

    def __repr__(self) -> str:
        return f"InplaceMoERouter(hidden_dim={self.hidden_dim}, num_experts={self.num_experts})"

    def __call__(
        self,
        tokens: Any,
        scores: Any,
        expert_capacity: int,
        *,
        return_indices: bool = False,
        mode: str = "swap",
        out_indices: Any = None,
    ) -> Any:
        _arrays.check_array(tokens, "tokens")
        check_expert_buffer(tokens, "tokens", self.num_experts, self.hidden_dim)
        result = compact_(tokens, scores, expert_capacity, dim=1, mode=mode, out_indices=out_indices)
        return (result.values, result.indices) if return_indices else result.values

    forward = __call__


def generate_idempotent_moe_map(scores: Any, capacity: int, *, nan: str = "raise") -> Any:
    """The idempotent map of top-`capacity` selection per expert, as the
    involution target_map [E, T] int32: target_map[e, t] is the slot that
    token t is exchanged with (t itself when it stays). Moves no data."""
    return idempotent_map(scores, capacity, form="target_map", nan=nan)


def compact_moe_tokens_inplace(
    tokens: Any, target_map: Any, block_d: int = 128, *, mode: str = "swap"
) -> Any:
    """Apply a target_map from `generate_idempotent_moe_map` to tokens [E, T, D]
    in place (the map is validated first). Returns tokens."""
    # block_d: accepted and ignored (the module docstring).
    return apply_map_(tokens, target_map=target_map, dim=1, mode=mode)


__all__ = ["InplaceMoERouter", "MoEDispatch", "compact_moe_tokens_inplace", "dispatch_rows",
           "dispatch_workspace", "experts_gemm", "gated_act", "gated_act_backward",
           "generate_idempotent_moe_map", "grouped_gemm", "moe_combine", "moe_dispatch", "moe_gather_rows",
           "moe_weight_grad", "topk_softmax", "torch_outputs"]
