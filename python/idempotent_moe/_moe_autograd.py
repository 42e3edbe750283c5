"""The backward of the MoE ops and of the fused experts layer.

The backward formulas that `_moe_torch_ops` registers with torch.library
(`register_autograd`) on moe_dispatch, moe_combine, gated_act and
grouped_gemm, and the fused experts layer as one differentiable pair of
ops (`experts_forward` / `experts_backward`; an eager call runs the same
formulas as `EagerExperts`, an autograd.Function without the ops' dispatch):

    forward   d = dispatch(hidden) (where M < R: a sort, then a gather of
              the M kept rows); gate_up = d.rows @ W_up[e];
              A = act(gate) * up; Y = A @ W_down[e]; out = combine(Y, w)
    saved     gate_up [M, 2I] (M = kept_rows: R, or E C with a capacity C
              that keeps fewer), offsets, dest (int32), the routing weights,
              the weights (parameters), and hidden only when W_up needs a
              gradient (it is alive anyway: the layer's input). Never the
              gathered rows [R, H] nor the expert outputs Y [R, H].
    backward  gdo = gather(dOut) [R, H]; G = gdo @ W_down[e]^T [R, I];
              one pass over gate_up and G (gated_act_backward with
              row_scale w_row) gives d(gate_up) of dA = w_row * G (over
              the saved gate_up itself unless the graph is kept), the
              recomputed A times w_row (written over G) and <G[row], A[row]>
              per row; d(w)[t, j] = that dot (= <dOut[t], Y[row]>: Y is
              never needed); dW_down[e] = (w_row * A)^T gdo;
              dW_up[e] = gather(hidden)^T d(gate_up);
              d(hidden) = combine(d(gate_up) @ W_up[e]^T, dest, 1).

Only rows below offsets[-1] (the kept assignments) are computed by any GEMM;
a dropped assignment (dest -1) gets exactly zero gradient. Frozen weights
(requires_grad False) get no dW and nothing is kept for one.

The library's kernels take float32, float16 and bfloat16; float64 (for
torch.autograd.gradcheck) runs the plain torch references below, the same
formulas. GEMMs: torch's grouped_mm where it takes the operands, else a loop
over the experts (inside an op's real implementation: never traced).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _moe_core, _tracing
from ._moe_rules import combine as _torch_combine

CORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_GMM = getattr(torch, "_grouped_mm", None)


def on_core(*xs: torch.Tensor) -> bool:
    """Whether the library's kernels take these tensors' dtypes."""
    return all(x.dtype in CORE_DTYPES for x in xs)


# ---- plain torch references (float64, and the tests' truth) -------------------------

_ACT = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _limit_mask(rows: int, limit: torch.Tensor | None, device) -> torch.Tensor | None:
    """[rows, 1] bool: the rows below limit[-1], or None without a limit."""
    if limit is None:
        return None
    return (torch.arange(rows, device=device) < limit[-1].to(torch.int64)).unsqueeze(-1)


def ref_gated_act(gate_up: torch.Tensor, act: str, limit: torch.Tensor | None) -> torch.Tensor:
    """act(gate) * up; rows at or past limit[-1] zero (the kernel leaves them)."""
    inter = gate_up.shape[-1] // 2
    out = _ACT[act](gate_up[:, :inter]) * gate_up[:, inter:]
    keep = _limit_mask(gate_up.shape[0], limit, gate_up.device)
    return out if keep is None else out.masked_fill(~keep, 0)


def _act_slope(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(x) and act'(x), closed forms in x's dtype."""
    if act == "silu":
        s = torch.sigmoid(x)
        return x * s, s * (1 + x * (1 - s))
    if act == "relu":
        return x.clamp(min=0), (x > 0).to(x.dtype)
    if act == "gelu":
        cdf = 0.5 * (1 + torch.erf(x * 0.7071067811865476))
        return x * cdf, cdf + x * 0.3989422804014327 * torch.exp(-0.5 * x * x)
    beta, kappa = 0.7978845608028654, 0.044715
    t = torch.tanh(beta * (x + kappa * x ** 3))
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * beta * (1 + 3 * kappa * x * x)


def ref_gated_act_backward(gate_up: torch.Tensor, grad: torch.Tensor, act: str,
                           limit: torch.Tensor | None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """d(gate_up) of ref_gated_act: [d * up * act'(gate), d * act(gate)]
    with d = grad (times row_scale [R, 1] when given), in float32 for
    narrower dtypes (the kernel's math), rounded once."""
    acc = torch.promote_types(gate_up.dtype, torch.float32)
    inter = gate_up.shape[-1] // 2
    g, u, d = gate_up[:, :inter].to(acc), gate_up[:, inter:].to(acc), grad.to(acc)
    if row_scale is not None:
        d = d * row_scale.to(acc)
    a, slope = _act_slope(g, act)
    out = torch.cat([d * u * slope, d * a], dim=-1).to(gate_up.dtype)
    keep = _limit_mask(gate_up.shape[0], limit, gate_up.device)
    return out if keep is None else out.masked_fill(~keep, 0)


def ref_combine(rows: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """moe_combine's sum with torch ops (dest -1 adds nothing)."""
    keep = dest >= 0
    return _torch_combine(rows, dest.long().clamp(min=0), weights, out_dtype, keep=keep)


def ref_gather_rows(src: torch.Tensor, dest: torch.Tensor, num_rows: int,
                    weights: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """moe_gather_rows with torch ops."""
    flat = dest.reshape(-1).long()
    token = torch.arange(dest.numel(), device=src.device) // dest.shape[1]
    acc = torch.promote_types(torch.promote_types(src.dtype, out_dtype), torch.float32)
    terms = src.index_select(0, token).to(acc)  # products in float32 at least, rounded once
    if weights is not None:
        terms = terms * weights.reshape(-1, 1).to(acc)
    out = src.new_zeros((num_rows + 1, src.shape[-1]), dtype=terms.dtype)
    out.index_copy_(0, torch.where(flat < 0, num_rows, flat), terms)  # dropped: the extra row
    return out[:num_rows].to(out_dtype)


def ref_weight_grad(a: torch.Tensor, b: torch.Tensor, dest: torch.Tensor, a_by_row: bool,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """moe_weight_grad with torch ops (float32 sums where a and b are narrower)."""
    acc = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    d = dest.long()
    rows = d.clamp(min=0)
    left = a.index_select(0, rows.reshape(-1)).view(*d.shape, -1) if a_by_row else a.unsqueeze(1)
    right = b.index_select(0, rows.reshape(-1)).view(*d.shape, -1)
    dots = (left.to(acc) * right.to(acc)).sum(-1)
    return dots.masked_fill(d < 0, 0).to(out_dtype)


# ---- grouped GEMMs over a dispatch's offsets ------------------------------------------

def _loop(a: torch.Tensor, offsets: torch.Tensor, fn, out: torch.Tensor) -> torch.Tensor:
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            fn(expert, start, end, out)
        start = end
    return out


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[r] = a[r] @ w[e(r)] [R, N] for rows below offsets[-1]; the rows past
    it are zero or (grouped_mm) unwritten: no caller reads them."""
    if _GMM is not None and a.dtype == w.dtype and a.dtype in CORE_DTYPES:
        try:
            return _GMM(a, w, offs=offsets)
        except (RuntimeError, NotImplementedError, ValueError):
            pass

    def one(e, s, t, out):
        torch.matmul(a[s:t].to(w.dtype), w[e], out=out[s:t])
    return _loop(a, offsets, one, a.new_zeros((a.shape[0], w.shape[-1]), dtype=w.dtype))


def grouped_mm_nt(g: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[r] = g[r] @ w[e(r)]^T [R, K] (w [E, K, N]): a grouped GEMM's dX."""
    return grouped_mm(g, w.transpose(-2, -1), offsets)


def transposed(w: torch.Tensor) -> bool:
    """Whether w [E, K, N] is the transposed view of a contiguous [E, N, K]
    (transformers' weights as the experts' GEMMs take them)."""
    return w.dim() == 3 and w.stride(-2) == 1 and w.stride(-1) == w.shape[-2] and w.shape[-2] > 1


def grouped_mm_dw_as(w_transposed: bool, a: torch.Tensor, g: torch.Tensor, offsets: torch.Tensor,
                     num_experts: int, dw=None) -> torch.Tensor:
    """grouped_mm_dw(a, g) [E, K, N] (or `dw`, the op of that name) laid out
    as its weight is: for a transposed weight (`transposed`), the transposed
    view of dw(g, a) [E, N, K], so the parameter's .grad arrives contiguous
    and autograd keeps it instead of copying it (a transient of the whole
    weight's size)."""
    dw = dw or grouped_mm_dw
    if w_transposed:
        return dw(g, a, offsets, num_experts).transpose(-2, -1)
    return dw(a, g, offsets, num_experts)


def grouped_mm_dw(a: torch.Tensor, g: torch.Tensor, offsets: torch.Tensor, num_experts: int) -> torch.Tensor:
    """dW[e] = a[rows of e]^T @ g[rows of e] [E, K, N] (zero for an expert
    without rows): a grouped GEMM's weight gradient."""
    if _GMM is not None and a.dtype == g.dtype and a.dtype in CORE_DTYPES:
        try:
            return _GMM(a.t(), g, offs=offsets)
        except (RuntimeError, NotImplementedError, ValueError):
            pass

    def one(e, s, t, out):
        torch.matmul(a[s:t].t(), g[s:t], out=out[e])
    return _loop(a, offsets, one, a.new_zeros((num_experts, a.shape[1], g.shape[1])))


def zero_tail(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x with its rows at or past offsets[-1] zeroed (in place, no host sync)."""
    keep = torch.arange(x.shape[0], device=x.device) < offsets[-1].to(torch.int64)
    return x.masked_fill_(~keep.unsqueeze(-1), 0)


# ---- the primitive ops' direct implementations (float64: the references) -------------
# An op's real implementation sees its inputs as autograd recorded them
# (requires_grad set, which DLPack refuses): each is detached first.

def detached(*xs):
    return tuple(None if x is None else x.detach() for x in xs)


def gated_act_direct(gate_up, act, limit):
    gate_up, limit = detached(gate_up, limit)
    if on_core(gate_up):
        return _moe_core.gated_act(gate_up, act, limit=limit)
    return ref_gated_act(gate_up, act, limit)


def gated_act_backward_direct(gate_up, grad, act, limit):
    gate_up, grad, limit = detached(gate_up, grad, limit)
    if on_core(gate_up, grad):
        return _moe_core.gated_act_backward(gate_up, grad.contiguous(), act, limit=limit)
    return ref_gated_act_backward(gate_up, grad, act, limit)


def gated_act_backward_rows(gate_up, g, act, limit, w_row, need_act, need_dot, over_gate_up=False):
    """The fused layer's activation backward in one pass over gate_up and g:
    (d(gate_up) of w_row * g, A * w_row or None, <g, A> per row [R, 1]
    float32 or None), A the forward's act(gate) * up. A * w_row is written
    over g (g is not read again); with `over_gate_up`, d(gate_up) is written
    over gate_up itself (its last reader: no [R, 2I] allocation)."""
    if on_core(gate_up, g, w_row):
        dot = g.new_empty((g.shape[0], 1), dtype=torch.float32) if need_dot else None
        d_gate_up = _moe_core.gated_act_backward(gate_up, g, act, limit=limit, row_scale=w_row,
                                                 act_out=g if need_act else None, row_dot=dot,
                                                 out=gate_up if over_gate_up else None)
        return d_gate_up, g if need_act else None, dot
    a = gated_act_direct(gate_up, act, limit)
    dot = (g.to(torch.float32) * a.to(torch.float32)).sum(-1, keepdim=True) if need_dot else None
    d_gate_up = ref_gated_act_backward(gate_up, g, act, limit, row_scale=w_row)
    if over_gate_up:
        d_gate_up = gate_up.copy_(d_gate_up)
    return d_gate_up, a.mul_(w_row.to(a.dtype)) if need_act else None, dot


def per_assignment(row_values: torch.Tensor, dest: torch.Tensor, dtype) -> torch.Tensor:
    """[T, k]: row_values[dest[t, j]] ([R, 1]), 0 where dest is -1. On the
    library's kernels one call, moe_weight_grad's <row_values[d], 1> (a sum
    of one product: the value itself, rounded once into dtype)."""
    if on_core(row_values) and dtype in CORE_DTYPES:
        return weight_grad_direct(row_values, row_values.new_ones(row_values.shape), dest, True, dtype)
    flat = row_values.reshape(-1)
    kept = dest >= 0
    return torch.where(kept, flat[dest.clamp(min=0).long()], 0).to(dtype)


def combine_direct(rows, dest, weights, out_dtype):
    rows, dest, weights = detached(rows, dest, weights)
    if on_core(rows, weights) and out_dtype in CORE_DTYPES:
        return _moe_core.moe_combine(rows.contiguous(), dest, weights, out_dtype=out_dtype)
    return ref_combine(rows, dest, weights, out_dtype)


def gather_rows_direct(src, dest, weights, num_rows, out_dtype):
    src, dest, weights = detached(src, dest, weights)
    if on_core(src) and out_dtype in CORE_DTYPES and (weights is None or on_core(weights)):
        return _moe_core.moe_gather_rows(src.contiguous(), dest, num_rows, weights=weights,
                                         out_dtype=out_dtype)
    return ref_gather_rows(src, dest, num_rows, weights, out_dtype)


def weight_grad_direct(a, b, dest, a_by_row, out_dtype):
    a, b, dest = detached(a, b, dest)
    if on_core(a, b) and out_dtype in CORE_DTYPES:
        return _moe_core.moe_weight_grad(a.contiguous(), b.contiguous(), dest, a_by_row=a_by_row,
                                         out_dtype=out_dtype)
    return ref_weight_grad(a, b, dest, a_by_row, out_dtype)


def grouped_gemm_direct(a, w, offsets):
    a, w, offsets = detached(a, w, offsets)
    if on_core(a, w):
        return _moe_core.grouped_gemm(a, w, offsets)
    return grouped_mm(a, w, offsets)


# ---- the fused experts layer ---------------------------------------------------------

def row_weights(dest: torch.Tensor, weights: torch.Tensor, num_rows: int, dtype) -> torch.Tensor:
    """[R, 1]: each row's routing weight (0 for a row without an assignment).
    On the library's kernels one call, moe_gather_rows of a column of ones
    scaled by the weights (each product exact in float32)."""
    if on_core(weights) and dtype in CORE_DTYPES:
        ones = weights.new_ones((dest.shape[0], 1), dtype=dtype)
        return gather_rows_direct(ones, dest, weights, num_rows, dtype)
    flat = dest.reshape(-1).long()
    w = weights.new_zeros(num_rows + 1, dtype=dtype)
    w.index_copy_(0, torch.where(flat < 0, num_rows, flat), weights.reshape(-1).to(dtype))
    return w[:num_rows].unsqueeze(-1)


def kept_rows(assignments: int, num_experts: int, capacity: int | None) -> int:
    """The rows of the gate/up output the layer keeps: every assignment's
    (R = T k), or with a capacity C at most E C (each expert keeps at most C),
    so what a capacity saves for the backward is bounded whatever the routing.
    At least one row where there are assignments: capacity 0 drops them all
    and keeps one unread row, so no kernel meets an empty operand that a
    dropless call of the same T never gives it. (sym_min: no guard on T
    where a compiled step's T is symbolic.)"""
    return assignments if capacity is None else torch.sym_min(assignments, max(1, num_experts * capacity))


def experts_forward_direct(hidden, top_k_index, top_k_weights, w_up, w_down, act, num_experts,
                           capacity, skip_foreign):
    """(out [T, H], gate_up [M, 2I], offsets, dest, dropped); see the module."""
    hidden, top_k_index, top_k_weights, w_up, w_down = detached(hidden, top_k_index, top_k_weights, w_up,
                                                              w_down)
    # Read for the capacity's selection; and for the check that each
    # token's local experts of nonzero weight are distinct (on the CPU),
    # as on every path of the experts implementation.
    select = top_k_weights if top_k_weights.dtype in CORE_DTYPES else top_k_weights.float()
    assignments = top_k_index.numel()
    rows = kept_rows(assignments, num_experts, capacity)  # the kept rows lie below offsets[-1] <= E C
    # A capacity that keeps fewer rows than there are assignments: the
    # dispatch sorts only (one column), and the kept rows alone are gathered.
    sort_only = rows < assignments
    d = _moe_core.moe_dispatch(hidden[:, :1] if sort_only else hidden, top_k_index, num_experts,
                               top_k_weights=select, capacity=capacity, skip_foreign=skip_foreign,
                               distinct=True, _apart=True)
    offsets, dest, dropped = d.offsets, d.dest, d.dropped
    x = gather_rows_direct(hidden, dest, None, rows, w_up.dtype) if sort_only else d.rows
    del d
    gate_up = grouped_mm(x if x.dtype == w_up.dtype else x.to(w_up.dtype), w_up, offsets)
    del x
    a = gated_act_direct(gate_up, act, offsets)
    y = grouped_mm(a, w_down, offsets)
    del a
    out = combine_direct(y, dest, top_k_weights, hidden.dtype)
    return out, gate_up, offsets, dest, dropped


def experts_backward_direct(grad_out, hidden, top_k_weights, w_up, w_down, gate_up, offsets, dest, act,
                            need_hidden, need_weights, need_up, need_down, reuse_gate_up=False):
    """(d_hidden, d_weights, d_w_up, d_w_down), each an empty tensor where not
    needed. `reuse_gate_up`: d(gate_up) is written over the saved gate_up
    (whose last reader this is), which the caller must never read again."""
    grad_out, hidden, top_k_weights, w_up, w_down, gate_up, offsets, dest = detached(
        grad_out, hidden, top_k_weights, w_up, w_down, gate_up, offsets, dest)
    rows, num_experts = gate_up.shape[0], w_up.shape[0]
    dt = gate_up.dtype
    def none():  # a fresh empty per output (custom op outputs may not alias)
        return grad_out.new_empty(0)
    gdo = gather_rows_direct(grad_out, dest, None, rows, w_down.dtype)      # [R, H]
    g = grouped_mm_nt(gdo, w_down, offsets)                                # [R, I]
    w_row = row_weights(dest, top_k_weights, rows, torch.float32 if dt in CORE_DTYPES else dt)
    # One pass: d(gate_up) of w_row * G, w_row * A over G, <G, A> per row.
    d_gate_up, a_w, dot = gated_act_backward_rows(gate_up, g, act, offsets, w_row, need_down, need_weights,
                                                  over_gate_up=reuse_gate_up)
    del g
    d_weights, d_down = none(), none()
    if need_weights:
        d_weights = per_assignment(dot, dest, top_k_weights.dtype)
    if need_down:
        d_down = grouped_mm_dw_as(transposed(w_down), a_w, gdo, offsets, num_experts)
    del gdo, a_w, dot
    d_up, d_hidden = none(), none()
    if need_up:
        x = gather_rows_direct(hidden, dest, None, rows, dt)
        d_up = grouped_mm_dw_as(transposed(w_up), x, d_gate_up, offsets, num_experts)
        del x
    if need_hidden:
        d_rows = grouped_mm_nt(d_gate_up, w_up, offsets)
        ones = torch.ones(dest.shape, dtype=d_rows.dtype, device=d_rows.device)
        d_hidden = combine_direct(d_rows, dest, ones, grad_out.dtype)
    return d_hidden, d_weights, d_up, d_down


# ---- autograd formulas (registered by _moe_torch_ops) --------------------------------

def _needs(ctx, i: int) -> bool:
    needs = getattr(ctx, "needs_input_grad", None)
    return True if needs is None else bool(needs[i])


def dispatch_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zeros for the int32 outputs (offsets, dest, dropped)
    ctx.hidden_dtype = inputs[0].dtype
    ctx.save_for_backward(output[2])  # dest


def dispatch_backward(ctx, g_rows, *_):
    (dest,) = ctx.saved_tensors
    d_hidden = None
    if g_rows is not None:
        ones = torch.ones(dest.shape, dtype=g_rows.dtype, device=g_rows.device)
        d_hidden = torch.ops.idempotent_moe.moe_combine(g_rows.contiguous(), dest, ones, ctx.hidden_dtype)
    return d_hidden, None, None, None, None, None, None, None  # one per input of the op


def combine_setup(ctx, inputs, output):
    rows, dest, weights, _ = inputs
    ctx.rows_shape = (rows.shape[0], rows.dtype)
    ctx.weights_dtype = weights.dtype
    ctx.save_for_backward(rows if _needs(ctx, 2) else None, dest, weights if _needs(ctx, 0) else None)


def combine_backward(ctx, grad):
    rows, dest, weights = ctx.saved_tensors
    ops = torch.ops.idempotent_moe
    grad = grad.contiguous()
    d_rows = d_w = None
    if ctx.needs_input_grad[0]:
        d_rows = ops.moe_gather_rows(grad, dest, weights, ctx.rows_shape[0], ctx.rows_shape[1])
    if ctx.needs_input_grad[2]:
        d_w = ops.moe_weight_grad(grad, rows, dest, False, ctx.weights_dtype)
    return d_rows, None, d_w, None


def act_setup(ctx, inputs, output):
    gate_up, act, limit = inputs
    ctx.act = act
    ctx.save_for_backward(gate_up, limit)


def act_backward(ctx, grad):
    gate_up, limit = ctx.saved_tensors
    return torch.ops.idempotent_moe.gated_act_backward(gate_up, grad.contiguous(), ctx.act, limit), None, None


def gemm_setup(ctx, inputs, output):
    a, w, offsets = inputs
    ctx.save_for_backward(a if _needs(ctx, 1) else None, w if _needs(ctx, 0) else None, offsets)
    ctx.num_experts, ctx.w_transposed = w.shape[0], transposed(w)


def gemm_backward(ctx, grad):
    a, w, offsets = ctx.saved_tensors
    ops = torch.ops.idempotent_moe
    grad = grad.contiguous()
    d_a = ops.grouped_mm_nt(grad, w, offsets) if ctx.needs_input_grad[0] else None
    d_w = (grouped_mm_dw_as(ctx.w_transposed, a, grad, offsets, ctx.num_experts, ops.grouped_mm_dw)
           if ctx.needs_input_grad[1] else None)
    return d_a, d_w, None


def experts_setup(ctx, inputs, output):
    hidden, _, top_k_weights, w_up, w_down, act, _, _, _ = inputs
    _, gate_up, offsets, dest, _ = output
    ctx.act = act
    ctx.needs = tuple(_needs(ctx, i) for i in (0, 2, 3, 4))
    ctx.mark_non_differentiable(gate_up)
    # autograd would otherwise hand the backward a zero-filled tensor for each
    # output without a gradient: gate_up's [M, 2I] among them (a fill of its size)
    ctx.set_materialize_grads(False)
    # hidden only for dW_up (its gather is recomputed); nothing kept for a frozen dW
    ctx.save_for_backward(hidden if ctx.needs[2] else None, top_k_weights, w_up, w_down, gate_up, offsets,
                          dest)


def overwrite_saved() -> bool:
    """Whether the backward running now may write over what its forward
    saved: while torch.compile traces it (the traced mutation is
    functionalized: inductor writes in place over a donated saved buffer and
    copies otherwise; torch refuses retain_graph on a backward with donated
    buffers), or when its graph is not kept (retain_graph or create_graph:
    a later backward reads the saved tensors again)."""
    return _tracing.compiling() or not torch._C._autograd._get_current_graph_task_keep_graph()


def experts_backward(ctx, grad_out, *_, backward=None):
    """The layer's gradients: `backward` (default: the backward ops, which
    torch.compile traces; eager: experts_backward_direct). d(gate_up) is
    written over the saved gate_up where `overwrite_saved` allows."""
    if grad_out is None:  # the output reached no loss
        return (None,) * 9
    hidden, top_k_weights, w_up, w_down, gate_up, offsets, dest = ctx.saved_tensors
    n_hidden, n_weights, n_up, n_down = ctx.needs
    args = (grad_out.contiguous(), hidden, top_k_weights, w_up, w_down, gate_up, offsets, dest, ctx.act,
            n_hidden, n_weights, n_up, n_down)
    over = overwrite_saved()
    if backward is None:
        ops = torch.ops.idempotent_moe
        d = (ops.experts_backward_ if over else ops.experts_backward)(*args)
    else:
        d = backward(*args, reuse_gate_up=over)
    d_hidden, d_weights, d_up, d_down = (t if need else None for t, need in zip(d, ctx.needs))
    return d_hidden, None, d_weights, d_up, d_down, None, None, None, None


class EagerExperts(torch.autograd.Function):
    """The fused experts layer in eager mode: the op pair's formulas
    (experts_setup, experts_backward) over the direct paths, without the
    custom ops' dispatch (torch.compile, fake tensors and functorch take the
    ops: `_moe_torch_ops.fused_experts` chooses)."""

    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, w_up, w_down, act, num_experts, capacity,
                skip_foreign):
        inputs = (hidden, top_k_index, top_k_weights, w_up, w_down, act, num_experts, capacity, skip_foreign)
        output = experts_forward_direct(*inputs)
        experts_setup(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_out, *_):
        return experts_backward(ctx, grad_out, backward=experts_backward_direct)
