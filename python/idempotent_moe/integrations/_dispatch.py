"""The torch side of an experts layer: routing assignments sorted by expert
(counting sort), grouped GEMMs over the sorted buffer, per-expert capacity
with idempotent_moe.compact_, and the combine back to token order (the
capacity rule, the sort and the combine come from idempotent_moe._moe_rules,
shared with the expert-parallel dispatcher; shapes are named there).

No function here synchronises the host with the device, except the per-expert
loop that stands in for grouped_mm where torch has none (it reads the group
offsets once; while torch.compile traces a CUDA forward, grouped_gemm stands
in instead, so a CUDA graph can hold it).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _tracing
from .._moe_rules import (
    check_capacity_device,
    check_top_k_index,
    combine,
    expert_capacity,
    expert_scores,
    order_by_expert,
)
from ..functional import compact_
from ..moe import grouped_gemm


class SortedDispatch(NamedTuple):
    """Assignments in expert order: row dest[t, j] of the sorted buffer holds
    assignment (t, j); row r holds token src_token[r] for expert expert_of[r];
    expert e owns rows [offsets[e-1], offsets[e]) (offsets int32, as grouped_mm
    wants them). With sentinels (expert parallelism), the assignments to other
    ranks' experts (ids >= E) sort last, beyond offsets[-1]: no GEMM computes
    them, `local` [T, k] is False for them and their expert_of is E - 1 (a
    valid row for per-expert biases); without, `local` is None."""

    dest: torch.Tensor
    src_token: torch.Tensor
    expert_of: torch.Tensor
    offsets: torch.Tensor
    local: torch.Tensor | None = None


def expert_parallel(experts) -> bool:
    """Whether transformers split this module's experts across ranks
    (`_is_expert_parallel`): ids >= num_experts then name other ranks'
    experts, with routing weight 0, and must add nothing."""
    return bool(getattr(experts, "_is_expert_parallel", False))


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int, *, sentinels: bool = False,
                   weights: torch.Tensor | None = None) -> SortedDispatch:
    """Counting sort of the S assignments by expert, stable in token order.

    No argsort and no host synchronisation (idempotent_moe._sorting): an
    [E, S] one-hot, its running sum along the assignments, the per-expert
    counts and their cumulative sum (the offsets), and a scatter. Allocates
    O(E x S) int32. Bad routing (an expert out of range or repeated within a
    token) is a ValueError on CPU tensors; on a GPU it is not checked. With
    `sentinels`, ids >= E are other ranks' experts (SortedDispatch says where
    they go). With the routing `weights`, a repeat of weight 0 (it adds
    nothing) is accepted.
    """
    index = top_k_index.long()
    check_top_k_index(index, num_experts, "top_k_index", sentinels=sentinels, weights=weights)
    if not sentinels:
        order = order_by_expert(index, num_experts)
        expert_of = index.reshape(-1)[order.perm]
        return SortedDispatch(order.dest, order.src_token, expert_of,
                              order.counts.cumsum(0).to(torch.int32))
    keys = index.clamp(max=num_experts)  # every sentinel in one extra bucket, E
    order = order_by_expert(keys, num_experts + 1)
    expert_of = keys.reshape(-1)[order.perm].clamp(max=num_experts - 1)
    offsets = order.counts[:num_experts].cumsum(0).to(torch.int32)
    return SortedDispatch(order.dest, order.src_token, expert_of, offsets, index < num_experts)


_grouped_mm_probe: dict = {}


def _torch_version() -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])


def grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped_mm takes these operands (probed once per device
    kind and dtype on tiny tensors, outside any hot path)."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    device = weight.device
    if device.type == "cpu" and _torch_version() < (2, 11) and (
            x.data_ptr() % 16 or weight.data_ptr() % 16):
        return False  # older CPU kernels need 16-byte aligned operands
    key = (device.type, device.index, weight.dtype)
    if key not in _grouped_mm_probe:
        try:
            a = torch.zeros(2, 16, dtype=weight.dtype, device=device)
            b = torch.zeros(2, 16, 16, dtype=weight.dtype, device=device)
            fn(a, b, offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
            _grouped_mm_probe[key] = True
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            _grouped_mm_probe[key] = False
    return _grouped_mm_probe[key]


# transformers' compile-safe grouped GEMM (a torch custom op that loops over
# the experts), set by hf_experts.register() when transformers has one.
COMPILED_FALLBACK = None


def grouped_mm_compiles(weight: torch.Tensor) -> bool:
    """Whether grouped_mm may be used while torch.compile traces: transformers'
    `_can_use_grouped_mm` rules. Its fake (tracing) implementation takes bf16
    only; on CUDA it needs sm80 or later (torch < 2.9: sm90 only); on the CPU,
    torch 2.9 or later (alignment cannot be read from fake tensors, and
    torch <= 2.10 needs it: those use the fallback)."""
    if weight.dtype != torch.bfloat16:
        return False
    if getattr(F, "grouped_mm", None) is None and getattr(torch, "_grouped_mm", None) is None:
        return False
    if weight.device.type == "cuda":
        capability = torch.cuda.get_device_capability(weight.device)
        if hasattr(F, "grouped_mm") or _torch_version() >= (2, 9):
            return capability >= (8, 0)
        return capability[0] == 9
    if weight.device.type == "cpu":
        return _torch_version() >= (2, 11)
    return False


def grouped_gemm_takes(w: torch.Tensor, tracing: bool) -> bool:
    """Whether grouped_gemm's CUDA kernel reads the GEMM-layout weight w
    [E, K, N]: K contiguous, every column 16-byte aligned. A traced weight
    has no address to read (nor an offset torch.compile traces without a
    graph break): there the base is taken as aligned, as a parameter's is,
    and the kernel's launcher refuses one that is not."""
    size = w.element_size()
    e, k, n = w.shape
    return (w.stride(1) == 1 and (tracing or w.data_ptr() % 16 == 0) and k * size % 16 == 0
            and (e == 1 or w.stride(0) * size % 16 == 0) and (n == 1 or w.stride(2) * size % 16 == 0))


# While tracing, grouped_gemm stands in for transformers' fallback up to this
# many rows per expert on average (decode sizes). Its fp32 sums take no tensor
# cores: at prefill sizes it is many times slower than the fallback's cuBLAS
# GEMMs, which keep those (and which, reading the offsets on the host, a CUDA
# graph cannot hold).
GRAPH_SAFE_ROWS_PER_EXPERT = 32


def _graph_safe_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether, while torch.compile traces a CUDA forward that grouped_mm does
    not take (fp32, fp16), our grouped_gemm stands in for transformers'
    fallback: that op reads the offsets on the host, which a CUDA graph
    (generate()'s static cache) cannot capture. grouped_gemm reads each
    active expert's weights once and syncs nothing; it needs weights it
    takes (grouped_gemm_takes) and int32 offsets, and is used up to
    GRAPH_SAFE_ROWS_PER_EXPERT rows per expert. It has no backward, so a
    traced forward that records gradients keeps the fallback."""
    return (w.device.type == "cuda" and grouped_gemm_takes(w, True) and offsets.dtype == torch.int32
            and x.dtype == w.dtype and x.shape[0] <= GRAPH_SAFE_ROWS_PER_EXPERT * w.shape[0]
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   transposed: bool) -> torch.Tensor:
    """x [S, in] sorted by expert times each expert's weight: [E, out, in]
    (nn.Linear layout) or, when `transposed`, [E, in, out]. Returns [S, out];
    rows at or beyond offsets[-1] belong to no expert: zero, or left
    unwritten by grouped_mm (callers mask them).

    torch's grouped_mm where it takes these operands (no host sync). Else, in
    eager mode, a loop over the experts, which reads the offsets once (one
    host sync); while torch.compile traces, on CUDA our grouped_gemm
    (_graph_safe_gemm), else transformers' grouped_mm fallback op (the same
    loop as one custom op, so the graph does not break)."""
    w = weight if transposed else weight.transpose(-2, -1)
    x = x.to(w.dtype)  # grouped_mm is not autocast-aware
    tracing = _tracing.compiling()
    if grouped_mm_compiles(w) if tracing else grouped_mm_usable(x, w):
        fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
        return fn(x, w, offs=offsets)
    if tracing and _graph_safe_gemm(x, w, offsets):
        return grouped_gemm(x, w, offsets)
    if tracing and COMPILED_FALLBACK is not None:
        return COMPILED_FALLBACK(x, w, offsets)
    pieces, start = [], 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            pieces.append(x[start:end] @ w[expert])
        start = end
    if start < x.shape[0]:
        pieces.append(x.new_zeros(x.shape[0] - start, w.shape[-1]))
    return torch.cat(pieces) if pieces else x.new_empty(0, w.shape[-1])


# Above this many bytes, the gate/up projection's output (rows x 2I) is not
# made whole: the fused forward of an eager, unbiased module runs the rows in
# chunks (_fused.gated_row_chunks); elsewhere the intermediate features run in
# column chunks (see _gated_chunks). Below it, the GEMMs have grouped_mm's own
# shapes.
GATE_UP_CHUNK_BYTES = 128 << 20


_DEFAULT_GATE = "_idempotent_default_gate"  # default_gate's answer, kept on the module


def default_gate(experts) -> bool:
    """Whether the module gates the transformers way: gate = the first I
    output features of gate_up_proj, up = the last I, act(gate) * up. Worked
    out from the module's class once, in an eager forward, and kept on the
    module: under torch.compile, type(experts) in every layer would add an
    identity guard that every compiled step checks. Read as an attribute:
    a read of experts.__dict__ would keep a compiled step from skipping the
    module's guards while its __dict__ is unchanged."""
    known = getattr(experts, _DEFAULT_GATE, None)
    if known is not None:
        return known
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    known = getattr(type(experts), "_apply_gate", None) is _default_apply_gate
    if not _tracing.compiling():
        experts.__dict__[_DEFAULT_GATE] = known
    return known


def activation_name(act) -> str | None:
    """The library's name of an activation module ("silu", "gelu",
    "gelu_tanh", "relu"), or None when it is not one the gated kernel
    computes exactly as torch does."""
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.ReLU):
        return "relu"
    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    # transformers' activation classes by name: nothing is imported, so that
    # torch.compile traces this without a graph break.
    kind = type(act)
    hf = kind.__module__ == "transformers.activations"
    if hf and kind.__name__ == "SiLUActivation":
        return "silu"
    inner = getattr(act, "act", None)
    if hf and kind.__name__ == "GELUActivation" and inner is F.gelu:
        return "gelu"
    if hf and kind.__name__ == "GELUTanh" and getattr(inner, "func", None) is F.gelu and \
            getattr(inner, "keywords", {}) == {"approximate": "tanh"}:
        return "gelu_tanh"
    return None


# act(x) in place, for the activations activation_name knows: the same
# torch kernels as the module's, so the values are the same bit for bit.
_INPLACE_ACT = {
    "silu": lambda x: F.silu(x, inplace=True),
    "relu": torch.relu_,
    "gelu": lambda x: torch.ops.aten.gelu_(x),
    "gelu_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
}


def _gated_chunks(experts, x: torch.Tensor, dtype: torch.dtype) -> int:
    """How many column chunks the gated MLP of `rows` rows runs in: 1 (whole)
    unless the gate/up output would exceed GATE_UP_CHUNK_BYTES, the module
    uses the default gate, and no gradient is being recorded (the chunks
    write into one buffer in place)."""
    if not experts.has_gate or not default_gate(experts):
        return 1
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in experts.parameters())):
        return 1
    inter = experts.down_proj.shape[-1 if not experts.is_transposed else -2]
    return gate_chunks(x.shape[:-1].numel(), inter, dtype)


def gate_chunks(rows: int, inter: int, dtype: torch.dtype) -> int:
    """The chunks of a [rows, 2 * inter] gate/up output of `dtype` (1:
    whole) under GATE_UP_CHUNK_BYTES, column chunks of at least 64 features;
    the fused forward's row chunks are as many."""
    total = rows * 2 * inter * torch.finfo(dtype).bits // 8
    return max(1, min(-(-total // GATE_UP_CHUNK_BYTES), inter // 64))


def _out_features(weight: torch.Tensor, transposed: bool, start: int, stop: int) -> torch.Tensor:
    """Output features [start, stop) of an expert weight, as a view."""
    return weight[..., start:stop] if transposed else weight[..., start:stop, :]


def _expert_mlp(experts, x: torch.Tensor, linear, bias_of) -> torch.Tensor:
    """The experts' MLP: expert_hidden, then expert_output (see both)."""
    return expert_output(experts, expert_hidden(experts, x, linear, bias_of), linear, bias_of)


def expert_hidden(experts, x: torch.Tensor, linear, bias_of) -> torch.Tensor:
    """The experts' hidden activations [rows, I]: the up (or gate-up)
    projection, then the gate or the activation; `linear(x, weight)` applies
    each row's expert weight and `bias_of(bias)` gives each row's bias.

    With the default gate and a large batch (inference), the gate and up
    projections run in column chunks of the intermediate features, each
    chunk's act(gate) * up written into one [rows, I] buffer: the [rows, 2I]
    projection and its two [rows, I] temporaries are never whole, which more
    than halves the transient memory at the same FLOPs and weight reads.
    A caller that drops x before expert_output lowers the peak again."""
    dtype = (experts.gate_up_proj if experts.has_gate else experts.up_proj).dtype
    chunks = _gated_chunks(experts, x, dtype)
    if chunks > 1:
        return _gated_chunked(experts, x, linear, bias_of, chunks)
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    h = linear(x, up)
    if experts.has_bias:
        h = h + bias_of(experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias)
    return experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)


def expert_output(experts, h: torch.Tensor, linear, bias_of) -> torch.Tensor:
    """The down projection of expert_hidden's h, its bias, and the
    post-expert norm where the module has one (`has_post_expert_norm`)."""
    y = linear(h, experts.down_proj)
    if experts.has_bias:
        y = y + bias_of(experts.down_proj_bias)
    if getattr(experts, "has_post_expert_norm", False):  # transformers >= 5.2x
        y = experts.post_expert_norm(y)
    return y


def _gated_chunked(experts, x: torch.Tensor, linear, bias_of, chunks: int) -> torch.Tensor:
    """act(x W_gate) * (x W_up) in `chunks` column chunks (multiples of 64
    features), element for element the operations of transformers' default
    gate. An activation activation_name knows runs in place: a chunk then
    holds two temporaries (gate, up), not three."""
    weight, transposed = experts.gate_up_proj, experts.is_transposed
    bias = experts.gate_up_proj_bias if experts.has_bias else None
    inter = weight.shape[-1 if transposed else -2] // 2
    width = -(-inter // chunks)
    width = -(-width // 64) * 64
    act = _INPLACE_ACT.get(activation_name(experts.act_fn), experts.act_fn)
    h = None
    for start in range(0, inter, width):
        stop = min(inter, start + width)
        gate = linear(x, _out_features(weight, transposed, start, stop))
        up = linear(x, _out_features(weight, transposed, inter + start, inter + stop))
        if bias is not None:
            gate = gate + bias_of(bias[..., start:stop])
            up = up + bias_of(bias[..., inter + start:inter + stop])
        gate = act(gate)
        if h is None:
            h = gate.new_empty(*gate.shape[:-1], inter)
        torch.mul(gate, up, out=h[..., start:stop])
        del gate, up
    return h


def expert_mlp_sorted(experts, x: torch.Tensor, dispatch: SortedDispatch) -> torch.Tensor:
    """Over the expert-sorted buffer x [S, H] (grouped GEMMs): [S, H]."""
    return _expert_mlp(
        experts, x,
        lambda a, w: grouped_linear(a, w, dispatch.offsets, experts.is_transposed),
        lambda bias: bias[dispatch.expert_of],
    )


def expert_mlp_capacity(experts, x: torch.Tensor) -> torch.Tensor:
    """Over capacity buffers x [E, C, H] (static shapes, batched GEMMs): [E, C, H]."""
    def linear(a, weight):
        w = weight if experts.is_transposed else weight.transpose(-2, -1)
        return torch.bmm(a.to(w.dtype), w)

    return _expert_mlp(experts, x, linear, lambda bias: bias.unsqueeze(1))


def dropless_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every assignment computed: sort by expert, one gathered buffer [S, H],
    grouped GEMMs, combine by the sort's indices. Under expert parallelism the
    other ranks' assignments (ids >= E) sort last, are computed by no GEMM and
    add nothing. grouped_mm leaves their rows unwritten both ways, so they
    are zeroed on both sides of the GEMMs: after them, or a NaN in the output
    would reach the routing weights' gradient through the combine (0 * NaN);
    before them, or one in the input's gradient would reach hidden_states'."""
    dispatch = sort_by_expert(top_k_index, experts.num_experts, sentinels=expert_parallel(experts),
                              weights=top_k_weights)
    x = hidden_states.index_select(0, dispatch.src_token)  # the one gathered buffer
    if dispatch.local is None:
        y = expert_mlp_sorted(experts, x, dispatch)
    else:  # the sorted rows at or beyond offsets[-1] are other ranks'
        foreign = (torch.arange(x.shape[0], device=x.device) >= dispatch.offsets[-1]).unsqueeze(-1)
        y = expert_mlp_sorted(experts, x.masked_fill(foreign, 0), dispatch).masked_fill(foreign, 0)
    return combine(y, dispatch.dest, top_k_weights, hidden_states.dtype, keep=dispatch.local)


class CapacityResult(NamedTuple):
    output: torch.Tensor  # [T, H]
    capacity: int
    dropped: torch.Tensor  # 0-d int64, on the device: reading it synchronises
    assignments: torch.Tensor | int = 0  # routed to this module's experts (T * k less EP sentinels)


def capacity_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, capacity_factor: float) -> CapacityResult:
    """Each expert keeps at most C assignments, those of highest routing weight
    (ties to the lower token index); the overflow is dropped and adds nothing.

    Per-expert buffers over the token axis: scores [E, T] (the routing weight,
    -inf where the token is not routed to the expert) choose, and the record
    `routed` [E, T, 1] is compacted in place by idempotent_moe.compact_
    (move mode), which also writes the kept tokens' ids [E, C]. Then one
    gathered buffer [E, C, H], batched GEMMs (static shapes), and the combine.
    Slots of an expert with fewer than C assignments hold unrouted tokens: they
    are computed (static shapes) and never combined. Under expert parallelism
    the other ranks' assignments (ids >= E) are routed to no expert here and
    add nothing.
    """
    num_tokens, top_k = top_k_index.shape
    num_experts = experts.num_experts
    device = hidden_states.device
    check_capacity_device(device)
    sentinels = expert_parallel(experts)
    # Every repeat refused, weight 0 or not: the [E, T] selection below holds
    # one assignment per (expert, token).
    check_top_k_index(top_k_index, num_experts, "top_k_index", sentinels=sentinels)
    capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    # [k, T]: the expert of assignment (t, j) at [j, t]; other ranks' experts as row E
    index_et = top_k_index.long().t().clamp(max=num_experts)
    scores = expert_scores(top_k_index, top_k_weights, num_experts)
    routed = torch.zeros(num_experts + 1, num_tokens, 1, dtype=torch.bool, device=device)
    routed.scatter_(0, index_et.unsqueeze(-1), True)
    routed = routed[:num_experts]
    assignments = routed.sum() if sentinels else num_tokens * top_k
    kept_tokens = torch.empty(num_experts, capacity, dtype=torch.int64, device=device)
    kept = compact_(routed, scores, capacity, dim=1, mode="move", nan="lowest",
                    out_indices=kept_tokens)
    kept_routed = kept.values[..., 0]  # [E, C]: the slot holds a real assignment
    dropped = assignments - kept_routed.sum()

    x = hidden_states.index_select(0, kept_tokens.reshape(-1)).view(num_experts, capacity, -1)
    y = expert_mlp_capacity(experts, x).reshape(num_experts * capacity, -1)

    # Each assignment's slot in y, and whether it was kept (read at [expert, token];
    # row E, other ranks' experts, is never kept).
    slots = torch.arange(num_experts * capacity, device=device).view(num_experts, capacity)
    slot_of = torch.zeros(num_experts + 1, num_tokens, dtype=torch.int64, device=device)
    slot_of[:num_experts].scatter_(1, kept_tokens, slots)
    kept_of = torch.zeros(num_experts + 1, num_tokens, dtype=torch.bool, device=device)
    kept_of[:num_experts].scatter_(1, kept_tokens, kept_routed)
    dest = slot_of.gather(0, index_et).t()
    keep = kept_of.gather(0, index_et).t()
    out = combine(y, dest, top_k_weights, hidden_states.dtype, keep=keep)
    return CapacityResult(out, capacity, dropped, assignments)
