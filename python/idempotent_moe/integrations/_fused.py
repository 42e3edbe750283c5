"""The experts forward over the library's fused dispatch and combine
(idempotent_moe.moe_ops): from top_k_index / top_k_weights to the combined
output in six kernels at decode sizes on CUDA (the sort and the gather of
the dispatch, the gate-up grouped GEMM, act(gate) * up, the down grouped
GEMM, the combine), with no host synchronisation, dropless or with a
capacity folded into the sort.

Taken by the "idempotent" experts implementation (hf_experts) when it
applies (`applies`); otherwise the torch path of _dispatch runs. Inference
only: the fused ops are not differentiable, so a forward that records a
gradient takes the torch path.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._moe import expert_capacity
from .._native import native
from ..functional import cuda_available
from ..moe_ops import gated_act, moe_combine, moe_dispatch
from . import _dispatch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _activation_name(act) -> str | None:
    """The library's name of an activation module ("silu", "gelu",
    "gelu_tanh", "relu"), or None when it is not one the gated kernel
    computes exactly as torch does."""
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.ReLU):
        return "relu"
    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    try:
        from transformers import activations
    except ImportError:
        return None
    kind = type(act)
    if kind is activations.SiLUActivation:
        return "silu"
    inner = getattr(act, "act", None)
    if kind is activations.GELUActivation and inner is F.gelu:
        return "gelu"
    if kind is activations.GELUTanh and getattr(inner, "func", None) is F.gelu and \
            getattr(inner, "keywords", {}) == {"approximate": "tanh"}:
        return "gelu_tanh"
    return None


def _fused_gate(experts) -> str | None:
    """The activation name when the module gates the transformers way with an
    activation the kernel computes (act(gate) * up in one kernel), else None."""
    if not experts.has_gate or not _dispatch._default_gate(experts):
        return None
    return _activation_name(experts.act_fn)


def applies(experts, hidden_states: torch.Tensor) -> bool:
    """Whether the fused path runs this forward: float16/bfloat16/float32
    hidden states on the CPU or on a CUDA device the kernels run on, at
    most MOE_MAX_EXPERTS experts, no gradient recorded, not under tracing
    (the fused ops are not torch ops yet)."""
    if hidden_states.dtype not in _FLOATS or experts.num_experts > native().MOE_MAX_EXPERTS:
        return False
    if hidden_states.device.type == "cuda":
        if not cuda_available():
            return False
    elif hidden_states.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() and (hidden_states.requires_grad or
                                    any(p.requires_grad for p in experts.parameters())):
        return False
    return True


def _rows_expert(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each row (for biases): the first e with offsets[e] > r."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype),
                              right=True).clamp_(max=offsets.numel() - 1)


def forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, capacity: int | None):
    """The experts' output [T, H] and the dropped count ([1] int64 on the
    device; zero dropless)."""
    num_experts = experts.num_experts
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    grouped = capacity is None or _dispatch._grouped_mm_usable(hidden_states, up)
    d = moe_dispatch(hidden_states, top_k_index, num_experts, top_k_weights=top_k_weights,
                     capacity=capacity, layout="grouped" if grouped else "padded",
                     skip_foreign=_dispatch.expert_parallel(experts))
    if grouped:
        def linear(a, w):
            return _dispatch.grouped_linear(a, w, d.offsets, experts.is_transposed)

        expert_of = _rows_expert(d.offsets, d.rows.shape[0]) if experts.has_bias else None

        def bias_of(bias):
            return bias[expert_of]
        x = d.rows
    else:  # padded [E, C, H]: batched GEMMs, static shapes
        def linear(a, w):
            return torch.bmm(a.to(w.dtype), w if experts.is_transposed else w.transpose(-2, -1))

        def bias_of(bias):
            return bias.unsqueeze(1)
        x = d.rows.view(num_experts, capacity, -1)

    act = _fused_gate(experts) if hidden_states.device.type == "cuda" else None
    if act is None or _dispatch._gated_chunks(experts, x, up.dtype) > 1:
        y = _dispatch._expert_mlp(experts, x, linear, bias_of)  # torch's gate; column chunks when large
    else:
        h = linear(x, up)
        if experts.has_bias:
            h = h + bias_of(experts.gate_up_proj_bias)
        h = gated_act(h.view(-1, h.shape[-1]), act, limit=d.offsets if grouped else None)
        y = linear(h.view(*x.shape[:-1], -1), experts.down_proj)
        if experts.has_bias:
            y = y + bias_of(experts.down_proj_bias)
        if getattr(experts, "has_post_expert_norm", False):
            y = experts.post_expert_norm(y)
    out = moe_combine(y.reshape(d.rows.shape[0], -1), d.dest, top_k_weights, out_dtype=hidden_states.dtype)
    return out, d.dropped


def experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, capacity_factor: float | None) -> torch.Tensor:
    """hf_experts.experts_forward on the fused path: the output, and the
    module's `idempotent_stats` (capacity mode: assignments, C and the
    dropped count, kept on the device)."""
    if capacity_factor is None:
        out, _ = forward(experts, hidden_states, top_k_index, top_k_weights, None)
        experts.idempotent_stats = None
        return out
    num_tokens, top_k = top_k_index.shape
    capacity = expert_capacity(num_tokens, top_k, experts.num_experts, capacity_factor)
    out, dropped = forward(experts, hidden_states, top_k_index, top_k_weights, capacity)
    assignments = ((top_k_index < experts.num_experts).sum() if _dispatch.expert_parallel(experts)
                   else num_tokens * top_k)
    experts.idempotent_stats = (assignments, capacity, dropped)
    return out
