"""The MoE rules the front ends share: the capacity rule, the checks of routing
inputs and per-expert buffers, the order of assignments by expert, and the
weighted combine back to token order.

Front ends: `moe.InplaceMoERouter`, `integrations.HuggingFaceMoEInplaceHook`
(per-expert buffers [E, T, D]), the transformers experts implementation
(`integrations._dispatch`) and `distributed.ExpertParallelDispatcher`.

Shapes: T tokens, k experts per token, E experts, S = T * k assignments,
H hidden size. `top_k_index` [T, k] holds distinct experts per token (what
torch.topk gives), `top_k_weights` [T, k] their routing weights.

Capacity rule: with capacity factor f, each expert keeps at most
C = min(T, ceil(T * k / E * f)) assignments (an expert sees a token once),
those of highest routing weight, ties to the lower token index, NaN weights
lowest; a dropped assignment adds nothing to its token.

Importing this module does not import torch; the functions that take tensors
import it when called.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _arrays
from .functional import cuda_available

if TYPE_CHECKING:
    import torch


def check_capacity_factor(factor: Any, name: str) -> float | None:
    """None (dropless), or the capacity factor as a float: TypeError unless
    a real number, ValueError unless finite and > 0."""
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(f"{name} must be a number or None, got {type(factor).__name__}")
    factor = float(factor)
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {factor}")
    return factor


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(T * k / E * factor), at most T (an expert sees a token once)."""
    return min(num_tokens, math.ceil(num_tokens * top_k / num_experts * capacity_factor))


def check_capacity_device(device: torch.device) -> None:
    """RuntimeError for capacity mode on a CUDA device without the library's
    CUDA kernels: the capacity selection runs in them."""
    if device.type == "cuda" and not cuda_available():
        raise RuntimeError("capacity mode on CUDA tensors needs idempotent_moe built with its CUDA "
                           "kernels (nvcc at build time); dropless mode needs none")


def check_top_k_index(top_k_index: torch.Tensor, num_experts: int, name: str, *,
                      sentinels: bool = False, weights: torch.Tensor | None = None) -> None:
    """ValueError when top_k_index [T, k] names an expert outside [0, E) or
    repeats an expert within a token. With `sentinels` (expert parallelism:
    ids >= E name other ranks' experts), any id >= E is accepted and may
    repeat; only negative ids and repeated local experts are errors. With
    the routing `weights`, an assignment of weight 0 (it adds nothing) may
    repeat an expert.

    Checked on CPU tensors only, and not while torch.compile traces (reading
    the result is a data-dependent branch there, and on a GPU a host
    synchronisation)."""
    from . import _tracing
    from ._sorting import check_distinct_per_row

    if top_k_index.device.type != "cpu" or not top_k_index.numel() or _tracing.compiling():
        return
    lo, hi = int(top_k_index.min()), int(top_k_index.max())
    if lo < 0 or (hi >= num_experts and not sentinels):
        raise ValueError(f"{name} must lie in [0, {num_experts}), got [{lo}, {hi}]")
    check_distinct_per_row(top_k_index, name, below=num_experts if sentinels else None,
                           weights=None if weights is None else weights.detach())


def check_expert_buffer(x: Any, name: str, num_experts: int | None = None,
                        hidden_dim: int | None = None) -> tuple:
    """The shape (E, T, D) of a per-expert buffer; ValueError unless it is 3-d
    with the given expert count and hidden size (None: any)."""
    shape = _arrays.shape_of(x)
    if (len(shape) != 3 or num_experts not in (None, shape[0])
            or hidden_dim not in (None, shape[2])):
        experts = "num_experts" if num_experts is None else f"num_experts={num_experts}"
        hidden = "hidden_dim" if hidden_dim is None else f"hidden_dim={hidden_dim}"
        raise ValueError(f"{name} must be [{experts}, T, {hidden}], got {list(shape)}")
    return shape


def expert_scores(top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  num_experts: int) -> torch.Tensor:
    """Routing scores per expert [E, T] float32: the routing weight of token t
    at [e, t] when t is routed to e, -inf elsewhere (so never kept over a
    routed token). Ids >= E (other ranks' experts under expert parallelism)
    are left out. Detached: selection has no gradient."""
    import torch

    num_tokens = top_k_index.shape[0]
    scores = torch.full((num_experts + 1, num_tokens), -math.inf, dtype=torch.float32,
                        device=top_k_weights.device)
    index = top_k_index.long().clamp(max=num_experts).t()
    return scores.scatter_(0, index, top_k_weights.detach().t().float())[:num_experts]


class ExpertOrder(NamedTuple):
    """The S assignments in expert order: sorted row r holds assignment
    perm[r] (= t * k + j), that is token src_token[r]; assignment (t, j) sits
    in sorted row dest[t, j]; counts[e] rows belong to expert e (int64)."""

    perm: torch.Tensor
    src_token: torch.Tensor
    dest: torch.Tensor
    counts: torch.Tensor


def order_by_expert(top_k_index: torch.Tensor, num_experts: int) -> ExpertOrder:
    """Counting sort of the assignments by expert, stable in token order: no
    argsort and no host synchronisation (see _sorting.counting_sort)."""
    from ._sorting import counting_sort

    num_tokens, top_k = top_k_index.shape
    perm, dest, counts = counting_sort(top_k_index.reshape(-1), num_experts)
    return ExpertOrder(perm, perm // top_k, dest.view(num_tokens, top_k), counts)


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype a combine sums in: the promoted dtype, fp32 for half precision."""
    import torch

    acc = dtypes[0]
    for dtype in dtypes[1:]:
        acc = torch.promote_types(acc, dtype)
    return torch.float32 if acc in (torch.float16, torch.bfloat16) else acc


def combine(y: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype, *,
            keep: torch.Tensor | None = None, upcast_terms: bool = False) -> torch.Tensor:
    """out[t] = sum_j keep[t, j] * weights[t, j] * y[dest[t, j]]: [T, H] in out_dtype.

    Gathers one [T, H] slice per j (never a permuted copy of all of y) and sums
    them in j order (deterministic, no atomics) in the accumulation dtype
    (fp32 for half precision), rounding once at the end. Each term is formed
    in y's and weights' promoted dtype, as transformers' experts do (half
    precision rounds it), or with `upcast_terms` in the accumulation dtype.
    A dropped assignment (keep False) adds exactly nothing. Differentiable.
    """
    import torch

    num_tokens, top_k = dest.shape
    acc = accumulation_dtype(y.dtype, weights.dtype)
    out = torch.zeros(num_tokens, y.shape[-1], dtype=acc, device=y.device)
    for j in range(top_k):
        term = y.index_select(0, dest[:, j])
        if upcast_terms:
            term = term.to(acc) * weights[:, j, None].to(acc)
        else:
            term = term * weights[:, j, None]
        if keep is not None:
            term = term.masked_fill(~keep[:, j, None], 0)
        out.add_(term)
    return out.to(out_dtype)


def combine_slots(expert_outputs: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                  num_tokens: int) -> torch.Tensor:
    """HuggingFaceMoEInplaceHook.combine (documented there): each kept slot's
    weighted output [E, C, D] added into its token, out [T, D]."""
    import torch

    for name, t in (("expert_outputs", expert_outputs), ("indices", indices), ("weights", weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    num_tokens = _arrays.check_int(num_tokens, "num_tokens", minimum=0)
    for name, t in (("expert_outputs", expert_outputs), ("weights", weights)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if expert_outputs.dim() != 3:
        raise ValueError(f"expert_outputs must be [E, C, D], got {list(expert_outputs.shape)}")
    num_experts, kept, dim = expert_outputs.shape
    for name, t in (("indices", indices), ("weights", weights)):
        if tuple(t.shape) != (num_experts, kept):
            raise ValueError(f"{name} must be [E, C] = {[num_experts, kept]} like expert_outputs, "
                             f"got {list(t.shape)}")
        if t.device != expert_outputs.device:
            raise ValueError(f"{name} is on {t.device}, expert_outputs on {expert_outputs.device}")
    # The tokens named: read on CPU tensors only (on a GPU a host
    # synchronisation), and not while torch.compile traces (a data-dependent
    # branch there).
    from . import _tracing

    if indices.device.type == "cpu" and indices.numel() and not _tracing.compiling():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= num_tokens:
            raise ValueError(f"indices must lie in [0, num_tokens = {num_tokens}), got [{lo}, {hi}]")
    acc = accumulation_dtype(expert_outputs.dtype, weights.dtype)
    out = torch.zeros(num_tokens, dim, dtype=acc, device=expert_outputs.device)
    terms = (expert_outputs.to(acc) * weights.to(acc).unsqueeze(-1)).reshape(num_experts * kept, dim)
    return out.index_add(0, indices.reshape(-1), terms).to(expert_outputs.dtype)
