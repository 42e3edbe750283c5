"""KV-cache eviction in place: keep the top-K tokens per head (plus sink
tokens) inside the existing K and V caches [batch, heads, seq, head_dim]."""

from __future__ import annotations

from typing import Any

from . import _arrays
from .functional import apply_map_, compact_, idempotent_map

SEQ_DIM = 2


def _check_cache(key_cache: Any, value_cache: Any) -> None:
    _arrays.check_array(key_cache, "key_cache")
    _arrays.check_array(value_cache, "value_cache")
    k_shape, v_shape = _arrays.shape_of(key_cache), _arrays.shape_of(value_cache)
    if len(k_shape) != 4:
        raise ValueError(f"key_cache must be [batch, heads, seq, head_dim], got {list(k_shape)}")
    if k_shape[:3] != v_shape[:3] or len(v_shape) != 4:
        raise ValueError(
            f"value_cache {list(v_shape)} must match key_cache {list(k_shape)} on batch, heads, seq"
        )


def compact_kv_cache_inplace(
    key_cache: Any,
    value_cache: Any,
    attention_scores: Any = None,
    capacity: int | None = None,
    *,
    active_indices: Any = None,
    protected_prefix_len: int = 4,
    recent_window: int = 0,
    mode: str = "swap",
    nan: str = "raise",
    return_indices: bool = False,
    out_indices: Any = None,
) -> Any:
    """Keep `capacity` tokens per (batch, head) in K and V [B, H, S, D], in place.

    attention_scores [B, H, S] (float32/float16/bfloat16) pick the top tokens,
    the first `protected_prefix_len` (sink) tokens and the last `recent_window`
    tokens always kept; or active_indices [K] / [B, H, K] name them. K and V
    move together under one map. Returns (key_view, value_view), each
    [B, H, C, D], plus indices [B, H, C] with return_indices=True.
    """
    _check_cache(key_cache, value_cache)
    if active_indices is not None:
        protected_prefix_len = 0
    result = compact_(
        [key_cache, value_cache], attention_scores, capacity, active_indices=active_indices,
        dim=SEQ_DIM, mode=mode, protected_prefix=protected_prefix_len,
        recent_window=recent_window, nan=nan, out_indices=out_indices,
    )
    k, v = result.values
    return (k, v, result.indices) if return_indices else (k, v)


class InplaceKVCompactor:
    """In-place KV-cache eviction for caches [batch, heads, seq, head_dim].

    compactor = InplaceKVCompactor()
    k, v = compactor.compact_from_scores(k_cache, v_cache, scores, capacity=4096)
    """

    def __init__(self, mode: str = "swap") -> None:
        self.mode = mode

    def __repr__(self) -> str:
        return f"InplaceKVCompactor(mode={self.mode!r})"

    def build_idempotent_map(
        self,
        batch: int,
        heads: int,
        seq_len: int,
        active_indices: Any,
        capacity: int | None = None,
        device: Any = None,
    ) -> Any:
        """The involution target_map [batch, heads, seq_len] int32 that keeps
        `active_indices` ([K] for every head, or [batch, heads, K]).
        `capacity` must equal K when given. With `device` set (a torch device
        or string), active indices given as a list become a torch tensor there."""
        batch = _arrays.check_int(batch, "batch")
        heads = _arrays.check_int(heads, "heads")
        if isinstance(active_indices, (list, tuple, range)) and device is not None:
            import torch  # the caller asked for a torch device

            active_indices = torch.as_tensor(list(active_indices), dtype=torch.int64, device=device)
        return idempotent_map(
            active_indices=active_indices, capacity=capacity, num_slots=seq_len,
            lead_shape=(batch, heads), form="target_map",
        )

    def compact(self, key_cache: Any, value_cache: Any, target_map: Any, capacity: int) -> Any:
        """Apply target_map [B, H, S] to K and V in place; returns the views
        (key_cache[:, :, :capacity], value_cache[:, :, :capacity])."""
        _check_cache(key_cache, value_cache)
        capacity = _arrays.check_int(capacity, "capacity")
        apply_map_([key_cache, value_cache], target_map=target_map, dim=SEQ_DIM, mode=self.mode)
        kept = min(capacity, _arrays.shape_of(key_cache)[SEQ_DIM])
        return _arrays.narrow(key_cache, SEQ_DIM, kept), _arrays.narrow(value_cache, SEQ_DIM, kept)

    def compact_from_scores(
        self,
        key_cache: Any,
        value_cache: Any,
        attention_scores: Any,
        capacity: int,
        protected_prefix_len: int = 4,
        recent_window: int = 0,
        return_indices: bool = False,
    ) -> Any:
        """Select per head from attention_scores [B, H, S] and compact K and V
        in one pass; see compact_kv_cache_inplace."""
        return compact_kv_cache_inplace(
            key_cache, value_cache, attention_scores, capacity,
            protected_prefix_len=protected_prefix_len, recent_window=recent_window,
            mode=self.mode, return_indices=return_indices,
        )
