"""MoE expert-capacity dropping in place: each expert keeps its top-C tokens by
routing score, moved into the first C slots of the buffer it already has.

`block_d`, a tuning hint of the original API (`InplaceMoERouter`,
`compact_moe_tokens_inplace`, `integrations.HuggingFaceMoEInplaceHook`), is
still accepted and is ignored: every hidden size works.
"""

from __future__ import annotations

from typing import Any

from . import _arrays
from ._moe import check_expert_buffer
from .functional import apply_map_, compact_, idempotent_map


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
