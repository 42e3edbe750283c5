"""KV-cache eviction in place: keep the top-K tokens per head (plus sink
tokens) inside the existing K and V caches [batch, heads, seq, head_dim].

Grouped-query attention: K and V have Hkv heads, and each KV head gets one
selection. Scores may come per KV head [B, Hkv, S], per query head
[B, Hq, S] with Hq = G x Hkv (the G query heads that share a KV head are
reduced to one score by their mean or max: `head_reduce`), or once per
sequence [B, S] / [B, 1, S] (one selection shared by every head).
`reduce_head_scores` (defined in `_heads.py`, which paged caches read too)
is importable from here. Paged caches are in `paged.py`, the Hugging Face
cache in `integrations/hf_cache.py`."""

from __future__ import annotations

from typing import Any

from . import _arrays, _tracing
from ._compaction import compact_tensors, direct_axis
from ._heads import HEAD_REDUCTIONS, reduce_head_scores
from .functional import apply_map_, compact_, idempotent_map

SEQ_DIM = 2


def _check_cache(key_cache: Any, value_cache: Any) -> None:
    torch = _arrays.torch_module()
    if torch is not None and type(key_cache) is torch.Tensor and type(value_cache) is torch.Tensor:
        k_shape, v_shape = key_cache.shape, value_cache.shape  # torch.Size: a tuple
    else:
        _arrays.check_array(key_cache, "key_cache")
        _arrays.check_array(value_cache, "value_cache")
        k_shape, v_shape = _arrays.shape_of(key_cache), _arrays.shape_of(value_cache)
    if len(k_shape) != 4:
        raise ValueError(f"key_cache must be [batch, heads, seq, head_dim], got {list(k_shape)}")
    if k_shape[:3] != v_shape[:3] or len(v_shape) != 4:
        raise ValueError(
            f"value_cache {list(v_shape)} must match key_cache {list(k_shape)} on batch, heads, seq"
        )


def _direct(key_cache: Any, value_cache: Any, scores: Any, capacity: Any, active_indices: Any,
            head_reduce: str, order: str) -> Any:
    """torch when compact_kv_cache_inplace may call the core as compact_ does
    on its direct path (_compaction.direct_axis), with nothing to work out
    here: K and V 4-d, scores [B, H, S] one per KV head (as many heads as K),
    no active indices, not traced by torch.compile; else None. The core
    judges the rest: K and V [B, H, S, D] with the scores' B, H and S."""
    torch = _arrays.torch_module()
    direct = (active_indices is None and head_reduce in HEAD_REDUCTIONS and not _tracing.compiling()
              and direct_axis(torch, (key_cache, value_cache), scores, capacity, SEQ_DIM,
                              order) == SEQ_DIM
              and key_cache.ndim == 4 and value_cache.ndim == 4 and scores.ndim == 3
              and scores.shape[1] == key_cache.shape[1])
    return torch if direct else None


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
    head_reduce: str = "mean",
    order: str = "inplace",
    policy: Any = None,
    observation: dict | None = None,
) -> Any:
    """Keep `capacity` tokens per (batch, KV head) in K and V [B, Hkv, S, D], in place.

    Or `policy` scores them (torch tensors only): a name of
    `kv_policies.POLICIES`, a `kv_policies.ScoringPolicy` or a callable
    `fn(obs) -> scores`, given keys, values, positions (the slots, unless
    `observation` names them) and what `observation` holds ("queries",
    "attention_totals", "positions", "seen", "scaling"; see
    kv_policies.score_kv). The scores it returns are used as
    attention_scores below (allocated: [B, H, S] scores, and whatever the
    policy computes on the way).

    attention_scores pick the top tokens: [B, Hkv, S] (float32/float16/
    bfloat16) one selection per KV head; [B, G x Hkv, S] per query head,
    reduced over each group of G query heads by `head_reduce` ("mean" or
    "max"); [B, S] or [B, 1, S] one selection shared by all heads. The first
    `protected_prefix_len` (sink) tokens and the last `recent_window` tokens
    are always kept. Or active_indices [K] / [B, Hkv, K] name the kept slots
    (then capacity = K and no prefix is protected). K and V move together
    under one map, in one call; D may differ between them. `mode`: "swap"
    (the dropped tokens end in [C, S)) or "move" (half the traffic, the tail
    is left stale). `order`: "inplace" (kept tokens below C stay put) or, where
    compact_ offers it, "stable" (kept tokens in their original, recency,
    order). Returns (key_view, value_view), views [B, Hkv, C, D] of
    the caches, plus indices [B, Hkv, C] (the original slot now in each slot)
    with return_indices=True. Allocates the indices (unless out_indices is
    given) and, for per-query-head scores, the reduced [B, Hkv, S] scores.
    """
    if policy is not None:
        if attention_scores is not None or active_indices is not None:
            raise ValueError("give policy, attention_scores or active_indices: one of them")
        _check_cache(key_cache, value_cache)
        from .kv_policies import score_kv

        attention_scores = score_kv(policy, key_cache, value_cache, **(observation or {}))
    elif observation is not None:
        raise ValueError("observation goes with policy")
    torch = _direct(key_cache, value_cache, attention_scores, capacity, active_indices, head_reduce, order)
    if torch is not None:
        # The common call: the core judges every value; a refusal is named
        # by the caches' own check where it is theirs (nothing has moved).
        try:
            result = compact_tensors(
                torch, (key_cache, value_cache), attention_scores, capacity, SEQ_DIM, mode,
                protected_prefix_len, recent_window, nan, out_indices, None, "int64")
        except ValueError:
            _check_cache(key_cache, value_cache)
            raise
        k, v = result.values
        return (k, v, result.indices) if return_indices else (k, v)
    _check_cache(key_cache, value_cache)
    if active_indices is not None:
        protected_prefix_len = 0
    elif attention_scores is not None:
        attention_scores = reduce_head_scores(
            attention_scores, _arrays.shape_of(key_cache)[1], head_reduce)
    result = compact_(
        (key_cache, value_cache), attention_scores, capacity, active_indices=active_indices,
        dim=SEQ_DIM, mode=mode, protected_prefix=protected_prefix_len,
        recent_window=recent_window, nan=nan, out_indices=out_indices, order=order,
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
        head_reduce: str = "mean",
    ) -> Any:
        """Select per KV head from attention_scores ([B, Hkv, S], or per query
        head [B, G x Hkv, S] reduced by `head_reduce`, or [B, S] shared by all
        heads) and compact K and V in one pass; see compact_kv_cache_inplace."""
        return compact_kv_cache_inplace(
            key_cache, value_cache, attention_scores, capacity,
            protected_prefix_len=protected_prefix_len, recent_window=recent_window,
            mode=self.mode, return_indices=return_indices, head_reduce=head_reduce,
        )
