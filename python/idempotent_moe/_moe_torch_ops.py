"""moe_dispatch, moe_combine, gated_act, grouped_gemm and topk_softmax as torch custom ops
(namespace `idempotent_moe`), for torch.compile: each returns fresh tensors (no
argument is written), whose shapes the fake implementations give, so a
compiled experts forward is one graph and CUDA graphs capture the kernels.
Imported only while torch.compile traces a call of moe_ops on torch tensors
(moe_ops routes there); the real implementations call moe_ops' direct path.
"""

from typing import Optional

import torch

from . import _op_depth, moe_ops

AVAILABLE = hasattr(torch.library, "custom_op")  # torch 2.4 on
T = torch.Tensor


if AVAILABLE:
    @torch.library.custom_op("idempotent_moe::moe_dispatch", mutates_args=())
    def _dispatch_op(hidden: T, top_k_index: T, top_k_weights: Optional[T], num_experts: int,
                     capacity: Optional[int], layout: str, skip_foreign: bool) -> tuple[T, T, T, T, T]:
        with _op_depth.inside_op():
            return tuple(moe_ops.moe_dispatch(hidden, top_k_index, num_experts, top_k_weights=top_k_weights,
                                              capacity=capacity, layout=layout, skip_foreign=skip_foreign,
                                              _apart=True))  # outputs may not alias

    @_dispatch_op.register_fake
    def _(hidden, top_k_index, top_k_weights, num_experts, capacity, layout, skip_foreign):
        rows = moe_ops.dispatch_rows(top_k_index.numel(), num_experts, capacity, layout)
        ints = dict(dtype=torch.int32, device=hidden.device)
        return (hidden.new_empty((rows,) + tuple(hidden.shape[1:])), torch.empty(num_experts, **ints),
                torch.empty(tuple(top_k_index.shape), **ints), torch.empty(rows, **ints),
                torch.empty(1, dtype=torch.int64, device=hidden.device))

    @torch.library.custom_op("idempotent_moe::moe_combine", mutates_args=())
    def _combine_op(rows: T, dest: T, weights: T, out_dtype: torch.dtype) -> T:
        with _op_depth.inside_op():
            return moe_ops.moe_combine(rows, dest, weights, out_dtype=out_dtype)

    @_combine_op.register_fake
    def _(rows, dest, weights, out_dtype):
        return rows.new_empty((dest.shape[0], rows.shape[-1]), dtype=out_dtype)

    @torch.library.custom_op("idempotent_moe::gated_act", mutates_args=())
    def _act_op(gate_up: T, act: str, limit: Optional[T]) -> T:
        with _op_depth.inside_op():
            return moe_ops.gated_act(gate_up, act, limit=limit)

    @_act_op.register_fake
    def _(gate_up, act, limit):
        return gate_up.new_empty(tuple(gate_up.shape[:-1]) + (gate_up.shape[-1] // 2,))

    @torch.library.custom_op("idempotent_moe::grouped_gemm", mutates_args=())
    def _gemm_op(a: T, w: T, offsets: T) -> T:
        with _op_depth.inside_op():
            return moe_ops.grouped_gemm(a, w, offsets)

    @_gemm_op.register_fake
    def _(a, w, offsets):
        return a.new_empty((a.shape[0], w.shape[-1]))

    @torch.library.custom_op("idempotent_moe::topk_softmax", mutates_args=())
    def _router_op(logits: T, k: int, renormalize: bool, out_dtype: torch.dtype,
                   index_dtype: str) -> tuple[T, T]:
        with _op_depth.inside_op():
            return moe_ops.topk_softmax(logits, k, renormalize=renormalize, out_dtype=out_dtype,
                                        index_dtype=index_dtype)

    @_router_op.register_fake
    def _(logits, k, renormalize, out_dtype, index_dtype):
        shape = (logits.shape[0], k)
        return (logits.new_empty(shape, dtype=out_dtype),
                logits.new_empty(shape, dtype=getattr(torch, index_dtype)))
