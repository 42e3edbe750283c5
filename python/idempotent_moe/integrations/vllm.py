"""A vLLM-style compaction hook: evict KV-cache tokens in place, in contiguous
caches [batch, kv_heads, seq, head_dim] or in paged pools with block tables.

hook = VLLMInplaceCompactionHook(capacity=4096, protected_prefix_len=4)
k, v = hook(key_cache, value_cache, attention_scores=scores)          # contiguous
res = hook(k_pool, v_pool, attention_scores=scores,                  # paged
           block_tables=block_tables, seq_lens=seq_lens)
engine.free(res.freed_blocks)

Needs neither vLLM nor torch: any array the library takes works.
"""

from __future__ import annotations

from typing import Any

from .._arrays import check_int
from ..kv import compact_kv_cache_inplace
from ..paged import PagedCompaction, compact_paged_, paged_policy_scores


class VLLMInplaceCompactionHook:
    """Keeps `capacity` tokens per sequence and KV head, in place.

    capacity              C: tokens kept (per KV head) after a call.
    protected_prefix_len  sink tokens, always kept (with attention scores).
    recent_window         the last tokens of each sequence, always kept.
    mode                  "move" (default: kept tail tokens are copied into the
                          holes, dropped tokens are gone: what an eviction
                          wants, half the traffic of a swap) or "swap".
    head_reduce           "mean" or "max": how scores given per query head
                          [.., G x Hkv, S] become one per KV head.
    layout                paged pools: "NHD" ([num_blocks, block_size, heads,
                          head_dim], vLLM's) or "HND".
    policy                a kv_policies policy (name, ScoringPolicy or
                          callable) that scores the tokens when a call gives
                          neither attention_scores nor active_indices; a call's
                          `observation` dict carries what it needs ("queries",
                          "attention_totals", ...: kv_policies.score_kv).

    hook(key_cache, value_cache, attention_scores=None, active_indices=None)
      contiguous caches [B, Hkv, S, D]: attention_scores [B, Hkv, S],
      [B, G x Hkv, S] or [B, S]; or active_indices [K] / [B, Hkv, K] (then K
      tokens are kept, and no prefix is protected). Returns views
      (key_cache[:, :, :C], value_cache[:, :, :C]), or with
      return_indices=True also the original slot of each kept token.
    hook(..., block_tables=[S, max_blocks], seq_lens=[S])
      paged pools: attention_scores [S, N], [S, Hkv, N] or [S, G x Hkv, N], or
      active_indices as S arrays. Returns a PagedCompaction: new lengths, the
      blocks each sequence no longer needs (for the engine to free), the map.
    `calls` and `last` record what the hook did.
    """

    def __init__(
        self,
        capacity: int,
        protected_prefix_len: int = 4,
        *,
        recent_window: int = 0,
        mode: str = "move",
        head_reduce: str = "mean",
        layout: str = "NHD",
        nan: str = "raise",
        policy: Any = None,
    ) -> None:
        capacity = check_int(capacity, "capacity")
        protected_prefix_len = check_int(protected_prefix_len, "protected_prefix_len")
        recent_window = check_int(recent_window, "recent_window")
        if protected_prefix_len + recent_window > capacity:
            raise ValueError(
                f"protected_prefix_len ({protected_prefix_len}) + recent_window ({recent_window}) "
                f"must not exceed capacity ({capacity})"
            )
        self.capacity = capacity
        self.protected_prefix_len = protected_prefix_len
        self.recent_window = recent_window
        self.mode = mode
        self.head_reduce = head_reduce
        self.layout = layout
        self.nan = nan
        self.policy = None
        if policy is not None:
            from ..kv_policies import get_policy

            self.policy = get_policy(policy)
        self.calls = 0
        self.last: Any = None

    def __repr__(self) -> str:
        return (f"VLLMInplaceCompactionHook(capacity={self.capacity}, "
                f"protected_prefix_len={self.protected_prefix_len}, mode={self.mode!r})")

    def __call__(
        self,
        key_cache: Any,
        value_cache: Any,
        attention_scores: Any = None,
        active_indices: Any = None,
        *,
        block_tables: Any = None,
        seq_lens: Any = None,
        return_indices: bool = False,
        observation: dict | None = None,
    ) -> Any:
        if self.policy is not None and attention_scores is None and active_indices is None:
            if block_tables is not None:
                if seq_lens is None:
                    raise TypeError("seq_lens is required with block_tables")
                attention_scores = paged_policy_scores(self.policy, [key_cache, value_cache],
                                                       block_tables, seq_lens, layout=self.layout,
                                                       observation=observation)
            else:
                from ..kv_policies import score_kv

                attention_scores = score_kv(self.policy, key_cache, value_cache, **(observation or {}))
        elif observation is not None:
            raise ValueError("observation goes with a hook made with a policy")
        if (attention_scores is None) == (active_indices is None):
            raise ValueError("give exactly one of attention_scores and active_indices")
        if block_tables is not None:
            if seq_lens is None:
                raise TypeError("seq_lens is required with block_tables")
            result: Any = compact_paged_(
                [key_cache, value_cache], block_tables, seq_lens,
                None if active_indices is not None else self.capacity, attention_scores,
                active_indices=active_indices, layout=self.layout, head_reduce=self.head_reduce,
                protected_prefix=0 if active_indices is not None else self.protected_prefix_len,
                recent_window=0 if active_indices is not None else self.recent_window,
                mode=self.mode, nan=self.nan,
            )
        else:
            if seq_lens is not None:
                raise TypeError("seq_lens goes with block_tables (paged caches)")
            result = compact_kv_cache_inplace(
                key_cache, value_cache, attention_scores,
                None if active_indices is not None else self.capacity,
                active_indices=active_indices, protected_prefix_len=self.protected_prefix_len,
                recent_window=0 if active_indices is not None else self.recent_window,
                mode=self.mode, nan=self.nan, return_indices=return_indices,
                head_reduce=self.head_reduce,
            )
        self.calls += 1
        self.last = result
        return result


__all__ = ["PagedCompaction", "VLLMInplaceCompactionHook"]
