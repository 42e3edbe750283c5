"""moe_dispatch, moe_combine, gated_act, grouped_gemm, experts_gemm and topk_softmax as torch custom ops
(namespace `idempotent_moe`), for torch.compile and autograd: each returns
fresh tensors (no argument is written), whose shapes the fake implementations
give, so a compiled experts forward is one graph and CUDA graphs capture the
kernels. Imported when torch.compile traces a call of `moe` on torch tensors
or autograd records one (`moe` routes there); the real implementations call
the direct path, _moe_core (float64: the torch references of _moe_autograd).
`fused_experts` is the fused experts layer's entry (an eager call takes
`_moe_autograd.EagerExperts`, the same formulas without the ops' dispatch).

Backward: moe_dispatch, moe_combine, gated_act and grouped_gemm have
formulas registered with `register_autograd` (_moe_autograd), over the
backward ops defined here (gated_act_backward, moe_gather_rows,
moe_weight_grad, grouped_mm_nt, grouped_mm_dw); experts_forward /
experts_backward are the fused experts layer.
"""

from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode

from . import _moe_autograd as ag
from . import _moe_core, _tracing

AVAILABLE = hasattr(torch.library, "custom_op")  # torch 2.4 on
T = torch.Tensor


if AVAILABLE:
    @torch.library.custom_op("idempotent_moe::moe_dispatch", mutates_args=())
    def _dispatch_op(hidden: T, top_k_index: T, top_k_weights: Optional[T], num_experts: int,
                     capacity: Optional[int], layout: str, skip_foreign: bool,
                     distinct: bool = False) -> tuple[T, T, T, T, T]:
        hidden, top_k_index, top_k_weights = ag.detached(hidden, top_k_index, top_k_weights)
        if top_k_weights is not None and not ag.on_core(top_k_weights):  # float64: selection only
            top_k_weights = top_k_weights.float()
        return tuple(_moe_core.moe_dispatch(hidden, top_k_index, num_experts, top_k_weights=top_k_weights,
                                            capacity=capacity, layout=layout, skip_foreign=skip_foreign,
                                            distinct=distinct, _apart=True))  # outputs may not alias

    @_dispatch_op.register_fake
    def _(hidden, top_k_index, top_k_weights, num_experts, capacity, layout, skip_foreign, distinct=False):
        rows = _moe_core.dispatch_rows(top_k_index.numel(), num_experts, capacity, layout)
        ints = dict(dtype=torch.int32, device=hidden.device)
        return (hidden.new_empty((rows,) + tuple(hidden.shape[1:])), torch.empty(num_experts, **ints),
                torch.empty(tuple(top_k_index.shape), **ints), torch.empty(rows, **ints),
                torch.empty(1, dtype=torch.int64, device=hidden.device))

    @torch.library.custom_op("idempotent_moe::moe_combine", mutates_args=())
    def _combine_op(rows: T, dest: T, weights: T, out_dtype: torch.dtype) -> T:
        return ag.combine_direct(rows, dest, weights, out_dtype)

    @_combine_op.register_fake
    def _(rows, dest, weights, out_dtype):
        return rows.new_empty((dest.shape[0], rows.shape[-1]), dtype=out_dtype)

    @torch.library.custom_op("idempotent_moe::gated_act", mutates_args=())
    def _act_op(gate_up: T, act: str, limit: Optional[T]) -> T:
        return ag.gated_act_direct(gate_up, act, limit)

    @_act_op.register_fake
    def _(gate_up, act, limit):
        return gate_up.new_empty(tuple(gate_up.shape[:-1]) + (gate_up.shape[-1] // 2,))

    @torch.library.custom_op("idempotent_moe::grouped_gemm", mutates_args=())
    def _gemm_op(a: T, w: T, offsets: T) -> T:
        return ag.grouped_gemm_direct(a, w, offsets)

    @_gemm_op.register_fake
    def _(a, w, offsets):
        return a.new_empty((a.shape[0], w.shape[-1]))

    @torch.library.custom_op("idempotent_moe::experts_gemm", mutates_args=())
    def _experts_gemm_op(x: T, w: T, offsets: T, src: Optional[T], act: Optional[str]) -> T:
        x, w, offsets, src = ag.detached(x, w, offsets, src)
        return _moe_core.experts_gemm(x, w, offsets, src=src, act=act)

    @_experts_gemm_op.register_fake
    def _(x, w, offsets, src, act):
        rows = x.shape[0] if src is None else src.shape[0]
        return x.new_empty((rows, w.shape[-1] // 2 if act is not None else w.shape[-1]))

    @torch.library.custom_op("idempotent_moe::topk_softmax", mutates_args=())
    def _router_op(logits: T, k: int, renormalize: bool, out_dtype: torch.dtype,
                   index_dtype: str) -> tuple[T, T]:
        return _moe_core.topk_softmax(logits, k, renormalize=renormalize, out_dtype=out_dtype,
                                      index_dtype=index_dtype)

    @_router_op.register_fake
    def _(logits, k, renormalize, out_dtype, index_dtype):
        shape = (logits.shape[0], k)
        return (logits.new_empty(shape, dtype=out_dtype),
                logits.new_empty(shape, dtype=getattr(torch, index_dtype)))

    # ---- backward ops ----

    @torch.library.custom_op("idempotent_moe::gated_act_backward", mutates_args=())
    def _act_bwd_op(gate_up: T, grad: T, act: str, limit: Optional[T]) -> T:
        return ag.gated_act_backward_direct(gate_up, grad, act, limit)

    @_act_bwd_op.register_fake
    def _(gate_up, grad, act, limit):
        return torch.empty_like(gate_up)

    @torch.library.custom_op("idempotent_moe::moe_gather_rows", mutates_args=())
    def _gather_op(src: T, dest: T, weights: Optional[T], num_rows: int, out_dtype: torch.dtype) -> T:
        return ag.gather_rows_direct(src, dest, weights, num_rows, out_dtype)

    @_gather_op.register_fake
    def _(src, dest, weights, num_rows, out_dtype):
        return src.new_empty((num_rows, src.shape[-1]), dtype=out_dtype)

    @torch.library.custom_op("idempotent_moe::moe_weight_grad", mutates_args=())
    def _wgrad_op(a: T, b: T, dest: T, a_by_row: bool, out_dtype: torch.dtype) -> T:
        return ag.weight_grad_direct(a, b, dest, a_by_row, out_dtype)

    @_wgrad_op.register_fake
    def _(a, b, dest, a_by_row, out_dtype):
        return a.new_empty(tuple(dest.shape), dtype=out_dtype)

    @torch.library.custom_op("idempotent_moe::grouped_mm_nt", mutates_args=())
    def _mm_nt_op(g: T, w: T, offsets: T) -> T:
        return ag.zero_tail(ag.grouped_mm_nt(g, w, offsets).contiguous(), offsets)

    @_mm_nt_op.register_fake
    def _(g, w, offsets):
        return g.new_empty((g.shape[0], w.shape[-2]), dtype=w.dtype)

    @torch.library.custom_op("idempotent_moe::grouped_mm_dw", mutates_args=())
    def _mm_dw_op(a: T, g: T, offsets: T, num_experts: int) -> T:
        return ag.grouped_mm_dw(a, g, offsets, num_experts)

    @_mm_dw_op.register_fake
    def _(a, g, offsets, num_experts):
        return a.new_empty((num_experts, a.shape[1], g.shape[1]))

    # ---- the fused experts layer ----

    @torch.library.custom_op("idempotent_moe::experts_forward", mutates_args=())
    def _experts_op(hidden: T, top_k_index: T, top_k_weights: T, w_up: T, w_down: T, act: str,
                    num_experts: int, capacity: Optional[int], skip_foreign: bool) -> tuple[T, T, T, T, T]:
        return ag.experts_forward_direct(hidden, top_k_index, top_k_weights, w_up, w_down, act, num_experts,
                                         capacity, skip_foreign)

    @_experts_op.register_fake
    def _(hidden, top_k_index, top_k_weights, w_up, w_down, act, num_experts, capacity, skip_foreign):
        ints = dict(dtype=torch.int32, device=hidden.device)
        return (hidden.new_empty(tuple(hidden.shape)),
                w_up.new_empty((ag.kept_rows(top_k_index.numel(), num_experts, capacity), w_up.shape[-1])),
                torch.empty(num_experts, **ints), torch.empty(tuple(top_k_index.shape), **ints),
                torch.empty(1, dtype=torch.int64, device=hidden.device))

    @torch.library.custom_op("idempotent_moe::experts_backward", mutates_args=())
    def _experts_bwd_op(grad_out: T, hidden: Optional[T], top_k_weights: T, w_up: T, w_down: T, gate_up: T,
                        offsets: T, dest: T, act: str, need_hidden: bool, need_weights: bool, need_up: bool,
                        need_down: bool) -> tuple[T, T, T, T]:
        return ag.experts_backward_direct(grad_out, hidden, top_k_weights, w_up, w_down, gate_up, offsets,
                                          dest, act, need_hidden, need_weights, need_up, need_down)

    # The same, with d(gate_up) written over gate_up (the backward is the
    # saved gate_up's last reader): what a backward whose graph is not kept
    # and a compiled backward call. Traced, the mutation is functionalized:
    # inductor writes in place over the saved buffer it donates, else copies.
    @torch.library.custom_op("idempotent_moe::experts_backward_", mutates_args=("gate_up",))
    def _experts_bwd_over_op(grad_out: T, hidden: Optional[T], top_k_weights: T, w_up: T, w_down: T,
                             gate_up: T, offsets: T, dest: T, act: str, need_hidden: bool, need_weights: bool,
                             need_up: bool, need_down: bool) -> tuple[T, T, T, T]:
        return ag.experts_backward_direct(grad_out, hidden, top_k_weights, w_up, w_down, gate_up, offsets,
                                          dest, act, need_hidden, need_weights, need_up, need_down,
                                          reuse_gate_up=True)

    @_experts_bwd_op.register_fake
    @_experts_bwd_over_op.register_fake
    def _(grad_out, hidden, top_k_weights, w_up, w_down, gate_up, offsets, dest, act, need_hidden,
          need_weights, need_up, need_down):
        def shaped(need, shape, like):
            return like.new_empty(shape if need else (0,), dtype=like.dtype if need else grad_out.dtype)

        def weight_grad(need, w):  # grouped_mm_dw_as's layout: the weight's own
            if need and ag.transposed(w):
                return w.new_empty((w.shape[0], w.shape[2], w.shape[1])).transpose(-2, -1)
            return shaped(need, tuple(w.shape), w)
        return (shaped(need_hidden, tuple(grad_out.shape), grad_out),
                shaped(need_weights, tuple(dest.shape), top_k_weights),
                weight_grad(need_up, w_up), weight_grad(need_down, w_down))

    # ---- autograd ----

    _dispatch_op.register_autograd(ag.dispatch_backward, setup_context=ag.dispatch_setup)
    _combine_op.register_autograd(ag.combine_backward, setup_context=ag.combine_setup)
    _act_op.register_autograd(ag.act_backward, setup_context=ag.act_setup)
    _gemm_op.register_autograd(ag.gemm_backward, setup_context=ag.gemm_setup)
    _experts_op.register_autograd(ag.experts_backward, setup_context=ag.experts_setup)


def fused_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  w_up: torch.Tensor, w_down: torch.Tensor, act: str, num_experts: int,
                  capacity: Optional[int] = None, skip_foreign: bool = False):
    """The experts layer as one differentiable unit: (out [T, H], dropped [1]).
    w_up [E, H, 2I] and w_down [E, I, H] in GEMM layout (views are fine).
    Eager calls run the op pair's formulas as an autograd.Function (no
    custom-op dispatch: less host time per step); torch.compile, fake or
    meta tensors, torch dispatch modes and functorch transforms take the ops."""
    layer = torch.ops.idempotent_moe.experts_forward if _traced(hidden) else ag.EagerExperts.apply
    out, _, _, _, dropped = layer(hidden, top_k_index, top_k_weights, w_up, w_down, act, num_experts,
                                  capacity, skip_foreign)
    return out, dropped


def _traced(x: torch.Tensor) -> bool:
    """Whether x's call must go through the custom ops: torch.compile is
    tracing, x has no storage the kernels can read (meta, fake), or a torch
    dispatch mode or functorch transform is active."""
    return (_tracing.compiling() or x.device.type == "meta" or _dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active())
