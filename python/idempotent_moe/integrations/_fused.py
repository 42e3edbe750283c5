"""The experts forward over the library's fused dispatch and combine
(idempotent_moe.moe): from top_k_index / top_k_weights to the combined
output in eight kernels at decode sizes on CUDA (the sort and the gather of
the dispatch, the gate-up grouped GEMM, act(gate) * up, the down grouped
GEMM, the combine; torch's grouped_mm launches two kernels per GEMM), with
no host synchronisation, dropless or with a capacity folded into the sort.

Taken by the "idempotent" experts implementation (hf_experts) when it
applies (`applies`); otherwise the torch path of _dispatch runs. A forward that
records a gradient runs the fused experts layer as one differentiable op pair
(`train_forward`, _moe_autograd) where the module has the default gate and no
bias or post-expert norm; other modules take the torch path in training.
What does not change between forwards of a module (its activation, whether
grouped_mm takes its weights, the weights' GEMM layout) is worked out once
and kept on the module (`_Plan`): decode is bound by the host, and every microsecond of Python counts there.

At decode sizes on CUDA (`_lean_forward`) the forward is five calls: the
dispatch, grouped_mm, gated_act, grouped_mm and the combine, straight into
the core, over intermediates kept on the module between forwards (`_Scratch`:
the gathered rows, the routing ints, the activations and the dispatch's
workspace, at most SCRATCH_BYTES; the output is always a new tensor). Reusing them is safe in
stream order: every reader of one forward's intermediates is queued before
the next forward writes them, on the same stream (the key holds it).

Which GEMMs a forward runs is decided in one place (`_gemm`): in bf16/fp16,
eager, by default the fastest by rows per expert (the library's grouped_gemm
at one, its experts_gemm up to XG_ROWS_PER_EXPERT, which reads the tokens
where they lie and applies the activation in its epilogue, torch's
grouped_mm above: their sums are fp32 in different orders, so below
XG_ROWS_PER_EXPERT the bits are not grouped_mm's); the config attributes
`idempotent_experts_gemm` and `idempotent_small_m_gemm` override it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import _tracing
from .._moe_rules import expert_capacity
from .._native import native
from ..functional import cuda_available
from ..moe import (
    MoEDispatch,
    dispatch_workspace,
    experts_gemm,
    gated_act,
    grouped_gemm,
    moe_combine,
    moe_dispatch,
    torch_outputs,
)
from . import _dispatch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_MAX_EXPERTS = native().MOE_MAX_EXPERTS
_OPS = hasattr(torch.library, "custom_op")
_RAW_MM = getattr(torch, "_grouped_mm", None)  # F.grouped_mm's op, less one Python frame
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# True: the fused path's two GEMMs run the library's grouped_gemm instead of
# torch's grouped_mm at decode sizes (at most SMALL_M_ROWS_PER_EXPERT rows per
# expert; eager and compiled); False: never; unset: the default's choice (_gemm).
SMALL_M_GEMM_ATTR = "idempotent_small_m_gemm"
SCRATCH_BYTES = 8 << 20  # per module: decode sizes only (prefill allocates per forward)


class _Plan(NamedTuple):
    """A module's forward decisions for one device and dtype, valid while its
    weights are the same tensors."""

    key: tuple       # (device, dtype, weights' addresses, weights): when the plan holds
    up: torch.Tensor     # gate-up (or up) weight in GEMM layout [E, in, out]
    down: torch.Tensor   # down weight in GEMM layout
    grouped_mm: bool     # torch's grouped_mm takes these weights
    act: str | None      # the fused gated activation (CUDA, default gate), or None
    inter: int           # intermediate features I
    lean: bool           # _lean_forward applies (CUDA, grouped_mm, fused gate, no bias or norm, no EP)
    small_m: bool        # CUDA, fused gate, no bias or norm, grouped_gemm's kernel reads both weights
    xg: bool             # small_m's, float16/bfloat16 hidden states and weights alike, eager: experts_gemm's


def _plan(experts, hidden_states: torch.Tensor) -> _Plan:
    """The module's plan, made once and kept on it (made afresh, and not kept,
    while torch.compile traces: there the graph holds the decisions)."""
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    down = experts.down_proj
    tracing = _tracing.compiling()
    key = None
    if not tracing:
        # Addresses too: module.to() swaps a parameter's storage, not the parameter.
        key = (hidden_states.device, hidden_states.dtype, up.data_ptr(), down.data_ptr(), up, down)
        plan = experts.__dict__.get("_idempotent_plan")
        if plan is not None and plan.key[:4] == key[:4] and plan.key[4] is up and plan.key[5] is down:
            return plan
    # Detached: the fused path runs without gradient (applies()), and the
    # library's kernels take no tensor that requires one (DLPack refuses it).
    w_up = (up if experts.is_transposed else up.transpose(-2, -1)).detach()
    w_down = (down if experts.is_transposed else down.transpose(-2, -1)).detach()
    act = None
    if hidden_states.device.type == "cuda" and experts.has_gate and _dispatch.default_gate(experts):
        act = _dispatch.activation_name(experts.act_fn)
    usable = (_dispatch.grouped_mm_compiles(w_up) if tracing
              else _dispatch.grouped_mm_usable(hidden_states, w_up))
    lean = (act is not None and usable and not tracing and _RAW_MM is not None and _RAW_STREAM is not None
            and not experts.has_bias and not getattr(experts, "has_post_expert_norm", False)
            and not _dispatch.expert_parallel(experts))
    small_m = (act is not None and usable and not experts.has_bias
               and not getattr(experts, "has_post_expert_norm", False)
               and _dispatch.grouped_gemm_takes(w_up, tracing)
               and _dispatch.grouped_gemm_takes(w_down, tracing))
    # and the hidden states in the weights' dtype: the library's kernels take
    # one dtype (the plan is made per hidden dtype), grouped_mm's path casts
    xg = (small_m and w_up.dtype in (torch.float16, torch.bfloat16) and hidden_states.dtype is w_up.dtype
          and not tracing)
    plan = _Plan(key, w_up, w_down, usable, act, w_down.shape[-2], lean, small_m, xg)
    if not tracing:
        experts.__dict__["_idempotent_plan"] = plan
    return plan


SMALL_M_ROWS_PER_EXPERT = 4  # grouped_gemm beats grouped_mm up to about this many rows per expert (H200)
# The default's thresholds (workload P1, H100, bf16, four MoE shapes at 1 to
# 4,096 tokens; the figures: docs/moe.md, "Which GEMMs run"): grouped_gemm is
# the fastest at one row per expert, experts_gemm from two to
# XG_ROWS_PER_EXPERT, grouped_mm on the gathered rows from 128 on.
XG_ROWS_PER_EXPERT = 64

# The config attribute that picks the experts' GEMM: True, the library's
# experts_gemm wherever its kernel takes the weights (eager, CUDA, fp16/bf16,
# the fused gate); False, never; unset, the default's choice (_gemm).
EXPERTS_GEMM_ATTR = "idempotent_experts_gemm"  # hf_experts.EXPERTS_GEMM_ATTR


def _gemm(experts, plan: _Plan, rows: int) -> str:
    """This forward's GEMMs (`rows` dispatched rows): "xg" (experts_gemm:
    the tokens read through src, the activation in its epilogue), "small_m"
    (grouped_gemm) or "grouped_mm". The two config attributes decide where
    set (read every forward: they may be switched): experts_gemm True, "xg"
    wherever the plan allows it; small_m_gemm True, "small_m" at most
    SMALL_M_ROWS_PER_EXPERT rows per expert; False, never that one. Where the
    plan allows experts_gemm (eager, CUDA, fp16/bf16, the fused gate) and an
    attribute is unset, the default takes the fastest by rows per expert
    (rows over min(E, rows) experts): grouped_gemm at one, experts_gemm up to
    XG_ROWS_PER_EXPERT, grouped_mm above. Traced, or in float32, the default
    is grouped_mm."""
    # experts.config read as an attribute (every experts module of transformers'
    # interface has one): under torch.compile the config is then guarded where
    # the model's own reads guard it, and the module stays one whose guards a
    # compiled step skips while its __dict__ is unchanged (test_hf_experts_compile).
    config = experts.config
    xg = getattr(config, EXPERTS_GEMM_ATTR, None)
    small_m = getattr(config, SMALL_M_GEMM_ATTR, None)
    if plan.xg and xg is True:
        return "xg"
    num_experts = experts.num_experts
    if plan.small_m and small_m is True and rows <= SMALL_M_ROWS_PER_EXPERT * num_experts:
        return "small_m"
    if plan.xg:
        per_expert = -(-rows // max(1, min(num_experts, rows)))
        if small_m is None and per_expert <= 1:
            return "small_m"
        if xg is None and per_expert <= XG_ROWS_PER_EXPERT:
            return "xg"
    return "grouped_mm"


def _grouped(lib, a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, stream: int, small_m: bool):
    """Each row of a times its expert's weight w [E, K, N]: torch's grouped_mm,
    or the library's grouped_gemm (rows past offsets[-1] left unwritten:
    nothing downstream reads them)."""
    if not small_m:
        return _RAW_MM(a, w, offs=offsets)
    out = a.new_empty((a.shape[0], w.shape[-1]))
    lib.grouped_gemm(a=a, w=w, offsets=offsets, out=out, num_threads=0, stream=stream)
    return out


_cuda_ok = None  # cuda_available(), asked once


@torch.compiler.assume_constant_result
def _cuda_runs() -> bool:
    """cuda_available(), asked once per process. torch.compile cannot trace
    the native call, so while it traces (a model compiled before any eager
    CUDA forward) the answer is taken as a constant of the graph."""
    global _cuda_ok
    if _cuda_ok is None:
        _cuda_ok = cuda_available()
    return _cuda_ok


def applies(experts, hidden_states: torch.Tensor) -> bool:
    """Whether the fused path runs this forward: float16/bfloat16/float32
    hidden states on the CPU or on a CUDA device the kernels run on, at
    most MOE_MAX_EXPERTS experts, no gradient recorded; under torch.compile
    where torch has custom ops (2.4 on: the fused ops are torch ops there)."""
    device = hidden_states.device.type
    if (hidden_states.dtype not in _FLOATS or (device != "cpu" and device != "cuda")
            or experts.num_experts > _MAX_EXPERTS):
        return False
    if _tracing.compiling() and not _OPS:
        return False
    if device == "cuda" and not _cuda_runs():
        return False
    if torch.is_grad_enabled() and (hidden_states.requires_grad or
                                    any(p.requires_grad for p in experts.parameters())):
        return trains(experts)
    return True


def trains(experts) -> bool:
    """Whether a forward that records a gradient runs the fused experts layer
    (`_moe_torch_ops.fused_experts`: one differentiable op pair): the default
    gate with an activation the kernels compute, no biases, no post-expert
    norm."""
    return (experts.has_gate and not experts.has_bias and not getattr(experts, "has_post_expert_norm", False)
            and _dispatch.default_gate(experts) and _dispatch.activation_name(experts.act_fn) is not None)


def train_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, capacity: int | None):
    """forward() where autograd records it: the experts layer's output and
    dropped count from the fused op pair, which keeps for backward the
    gate/up output, the int32 dispatch and the routing weights (and hidden
    only where gate_up_proj needs a gradient), never a [rows, H] copy. The
    weights are the module's parameters in GEMM layout, as views."""
    from .._moe_torch_ops import fused_experts  # registers the ops on first use

    up, down = experts.gate_up_proj, experts.down_proj
    w_up = up if experts.is_transposed else up.transpose(-2, -1)
    w_down = down if experts.is_transposed else down.transpose(-2, -1)
    return fused_experts(hidden_states, top_k_index, top_k_weights, w_up, w_down,
                         _dispatch.activation_name(experts.act_fn), experts.num_experts, capacity,
                         _dispatch.expert_parallel(experts))


def _rows_expert(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each row (for biases): the first e with offsets[e] > r."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype),
                              right=True).clamp_(max=offsets.numel() - 1)


class _Scratch(NamedTuple):
    """A module's decode intermediates for one (T, k, capacity, stream)."""

    key: tuple
    d: MoEDispatch       # the dispatch's outputs (dropped: used dropless only)
    act: torch.Tensor    # [S, I] act(gate) * up
    ws: torch.Tensor | None  # the dispatch's workspace (a capacity's), made once with the rest


def _scratch(experts, plan: _Plan, hidden: torch.Tensor, num_tokens: int, top_k: int, capacity, stream: int):
    """The module's intermediates for this forward's shape and stream: the
    ones it holds when they match, else new ones (replacing them), or None
    above SCRATCH_BYTES."""
    key = (num_tokens, top_k, capacity, stream, hidden.dtype, plan.key[0])
    held = experts.__dict__.get("_idempotent_scratch")
    if held is not None and held.key == key:
        return held
    s = num_tokens * top_k
    if s * (hidden.shape[1] + plan.inter) * hidden.element_size() > SCRATCH_BYTES:
        return None
    held = _Scratch(key, torch_outputs(hidden, experts.num_experts, num_tokens, top_k, s),
                    hidden.new_empty((s, plan.inter)), dispatch_workspace(hidden, s, capacity, True))
    experts.__dict__["_idempotent_scratch"] = held
    return held


def _lean_forward(experts, plan: _Plan, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, capacity: int | None):
    """forward()'s result at decode sizes on CUDA (plan.lean), or None where
    it does not apply: the same kernels as forward's fused gate, called
    straight into the core (which judges every value) over the module's
    scratch intermediates; the dropped count is a new tensor with a capacity."""
    if hidden.dtype is not plan.up.dtype or hidden.dim() != 2 or top_k_index.dim() != 2:
        return None
    num_tokens, top_k = top_k_index.shape
    if _dispatch.gate_chunks(num_tokens * top_k, plan.inter, hidden.dtype) > 1:
        return None
    stream = _RAW_STREAM(hidden.get_device()) or 1
    sc = _scratch(experts, plan, hidden, num_tokens, top_k, capacity, stream)
    if sc is None:
        return None
    lib, d = native(), sc.d
    dropped = d.dropped if capacity is None else torch.empty(1, dtype=torch.int64, device=hidden.device)
    gemm = _gemm(experts, plan, num_tokens * top_k)
    xg = gemm == "xg"
    # experts_gemm reads the tokens through src: the dispatch sorts and
    # gathers one column only (the rows it would copy are never read).
    lib.moe_dispatch(hidden=hidden[:, :1] if xg else hidden, top_k_index=top_k_index,
                     top_k_weights=top_k_weights, num_experts=experts.num_experts, capacity=capacity,
                     out_rows=d.rows[:, :1] if xg else d.rows, out_offsets=d.offsets, out_dest=d.dest,
                     out_src=d.src, out_dropped=dropped,
                     workspace=sc.ws,
                     num_threads=0, stream=stream)
    if xg:
        lib.experts_gemm(x=hidden, w=plan.up, offsets=d.offsets, src=d.src, act=plan.act, out=sc.act,
                         num_threads=0, stream=stream)
        y = hidden.new_empty((num_tokens * top_k, hidden.shape[1]))
        lib.experts_gemm(x=sc.act, w=plan.down, offsets=d.offsets, out=y, num_threads=0, stream=stream)
    else:
        small_m = gemm == "small_m"
        h = _grouped(lib, d.rows, plan.up, d.offsets, stream, small_m)
        lib.gated_act(gate_up=h, out=sc.act, act=plan.act, limit=d.offsets, num_threads=0, stream=stream)
        y = _grouped(lib, sc.act, plan.down, d.offsets, stream, small_m)
    out = hidden.new_empty((num_tokens, hidden.shape[1]))
    lib.moe_combine(rows=y, dest=d.dest, weights=top_k_weights, out=out, num_threads=0, stream=stream)
    return out, dropped


def gated_row_chunks(gemm, x: torch.Tensor, w_up: torch.Tensor, offsets: torch.Tensor, act: str,
                     chunks: int) -> torch.Tensor:
    """act(gate) * up [S, I] of the expert-sorted rows x [S, H] (the fused
    gate) in `chunks` row chunks: each chunk's whole gate/up projection, one
    grouped GEMM `gemm(rows, w_up, offs)` with the offsets clipped to the
    chunk, then one gated_act into the chunk's rows of the result. A chunk's
    transient [S / chunks, 2I] is what a column chunk of torch's gate holds
    ([S, 2I / chunks], _dispatch._gated_chunked), for one GEMM and one
    activation kernel instead of two GEMMs, the activation and the product.
    Rows at or beyond offsets[-1] (no expert's) are left unwritten."""
    rows = x.shape[0]
    h = x.new_empty((rows, w_up.shape[-1] // 2), dtype=w_up.dtype)
    step = -(-rows // chunks)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        offs = offsets.clamp(start, stop).sub_(start)
        gated_act(gemm(x[start:stop], w_up, offs), act, limit=offs, out=h[start:stop])
    return h


def _xg_forward(experts, plan: _Plan, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, capacity: int | None):
    """forward()'s result on experts_gemm at any size: the dispatch sorts
    (one column gathered), the gate/up GEMM reads the tokens through src and
    writes act(gate) * up [S, I] (never the [S, 2I] gate/up output), the
    down GEMM writes [S, H], the combine sums in token order."""
    d = moe_dispatch(hidden[:, :1], top_k_index, experts.num_experts, top_k_weights=top_k_weights,
                     capacity=capacity, skip_foreign=getattr(experts, "_is_expert_parallel", False),
                     distinct=True)
    h = experts_gemm(hidden, plan.up, d.offsets, src=d.src, act=plan.act)
    y = experts_gemm(h, plan.down, d.offsets)
    del h
    return moe_combine(y, d.dest, top_k_weights, out_dtype=hidden.dtype), d.dropped


def forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, capacity: int | None):
    """The experts' output [T, H] and the dropped count ([1] int64 on the
    device; zero dropless)."""
    if torch.is_grad_enabled() and (hidden_states.requires_grad or experts.down_proj.requires_grad
                                    or experts.gate_up_proj.requires_grad or top_k_weights.requires_grad):
        return train_forward(experts, hidden_states, top_k_index, top_k_weights, capacity)
    plan = _plan(experts, hidden_states)
    if plan.lean and hidden_states.device.type == "cuda":
        result = _lean_forward(experts, plan, hidden_states, top_k_index, top_k_weights, capacity)
        if result is not None:
            return result
    if (hidden_states.device.type == "cuda" and hidden_states.dtype is plan.up.dtype
            and hidden_states.dim() == 2 and top_k_index.dim() == 2
            and _gemm(experts, plan, top_k_index.numel()) == "xg"):
        return _xg_forward(experts, plan, hidden_states, top_k_index, top_k_weights, capacity)
    num_experts = experts.num_experts
    grouped = capacity is None or plan.grouped_mm
    d = moe_dispatch(hidden_states, top_k_index, num_experts, top_k_weights=top_k_weights,
                     capacity=capacity, layout="grouped" if grouped else "padded",
                     skip_foreign=getattr(experts, "_is_expert_parallel", False), distinct=True)
    # The gathered rows are dropped before the down projection (a prefill's
    # peak): nothing below holds `d`, only its other outputs.
    x, offsets, dest, dropped = d.rows, d.offsets, d.dest, d.dropped
    del d
    rows = x.shape[0]
    chunks = _dispatch.gate_chunks(rows, plan.inter, plan.up.dtype)  # > 1: the gate/up output is not whole
    whole = chunks == 1
    # gemm(a, w, offs): each row of a times its expert's weight w in GEMM
    # layout [E, in, out] (offs: the rows' expert ends): on CUDA grouped_mm
    # directly where it takes the weights; elsewhere grouped_linear, which
    # also checks each operand's alignment. linear(a, w): over all rows.
    if grouped and plan.act is not None and whole and _gemm(experts, plan, rows) == "small_m":
        def gemm(a, w, offs):  # the fused gate's two GEMMs only (plan.up, plan.down)
            return grouped_gemm(a, w, offs)
    elif grouped and plan.grouped_mm and hidden_states.device.type == "cuda":
        def gemm(a, w, offs):
            return _GROUPED_MM(a if a.dtype == w.dtype else a.to(w.dtype), w, offs=offs)
    else:
        def gemm(a, w, offs):
            return _dispatch.grouped_linear(a, w, offs, True)
    if grouped:
        expert_of = _rows_expert(offsets, rows) if experts.has_bias else None

        def linear(a, w):
            return gemm(a, w, offsets)

        def bias_of(bias):
            return bias[expert_of]
    else:  # padded [E, C, H]: batched GEMMs, static shapes
        x = x.view(num_experts, capacity, -1)

        def linear(a, w):
            return torch.bmm(a.to(w.dtype), w)

        def bias_of(bias):
            return bias.unsqueeze(1)
    lead = x.shape[:-1]

    # Large and eager, the fused gate runs in row chunks (gated_row_chunks);
    # traced, or with a bias, torch's gate in column chunks.
    row_chunks = (not whole and grouped and plan.act is not None and not experts.has_bias
                  and not _tracing.compiling())
    if plan.act is None or not (whole or row_chunks):
        # torch's gate (column chunks when large) over the module's weights
        def module_linear(a, weight):
            return linear(a, weight if experts.is_transposed else weight.transpose(-2, -1))
        h = _dispatch.expert_hidden(experts, x, module_linear, bias_of)
        del x
        y = _dispatch.expert_output(experts, h, module_linear, bias_of)
    else:  # the fused gate: at decode sizes two grouped GEMMs, gated_act and nothing else
        if row_chunks:
            h = gated_row_chunks(gemm, x, plan.up, offsets, plan.act, chunks)
            del x
        else:
            h = linear(x, plan.up)
            del x
            if experts.has_bias:
                h = h + bias_of(experts.gate_up_proj_bias)
            h = gated_act(h.view(-1, h.shape[-1]), plan.act, limit=offsets if grouped else None)
        y = linear(h.view(*lead, -1), plan.down)
        if experts.has_bias:
            y = y + bias_of(experts.down_proj_bias)
        if getattr(experts, "has_post_expert_norm", False):
            y = experts.post_expert_norm(y)
    del h
    out = moe_combine(y.reshape(rows, -1), dest, top_k_weights, out_dtype=hidden_states.dtype)
    return out, dropped


def experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, capacity_factor: float | None) -> torch.Tensor:
    """hf_experts.experts_forward on the fused path: the output, and the
    module's `idempotent_stats` (capacity mode: assignments, C and the
    dropped count, kept on the device)."""
    if capacity_factor is None:
        out, _ = forward(experts, hidden_states, top_k_index, top_k_weights, None)
        # Stored only where it is not None already: a compiled decode step
        # then replays no module attribute write per layer. Read as an
        # attribute, not through __dict__, which would keep torch.compile from
        # skipping the module's guards (see _gemm).
        if getattr(experts, "idempotent_stats", False) is not None:
            experts.idempotent_stats = None
        return out
    num_tokens, top_k = top_k_index.shape
    capacity = expert_capacity(num_tokens, top_k, experts.num_experts, capacity_factor)
    out, dropped = forward(experts, hidden_states, top_k_index, top_k_weights, capacity)
    assignments = ((top_k_index < experts.num_experts).sum() if _dispatch.expert_parallel(experts)
                   else num_tokens * top_k)
    experts.idempotent_stats = (assignments, capacity, dropped)
    return out
