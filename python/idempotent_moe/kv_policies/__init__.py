"""KV scoring policies: one per file over `base.ScoringPolicy`, each written
from its paper's definition. A policy scores the cached tokens of one layer
(higher kept); every cache of the library turns the scores into one in-place
compaction (see docs/kv.md, "Scoring policies").

    from idempotent_moe.kv_policies import SnapKV, get_policy
    cache = InplaceEvictionCache(budget=256, score=SnapKV(window=32), ...)

Needs torch."""

from __future__ import annotations

from typing import Any

from .base import NEEDS, CallablePolicy, Observation, ScoringPolicy, as_policy, check_policy
from .expected_attention import ExpectedAttention
from .keydiff import KeyDiff
from .knorm import KNorm
from .observed_attention import ObservedAttention
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM
from .tova import TOVA

POLICIES = {cls.name: cls for cls in (StreamingLLM, KNorm, KeyDiff, TOVA, ObservedAttention, SnapKV,
                                      ExpectedAttention)}


def get_policy(spec: Any) -> ScoringPolicy:
    """A policy from its name (one of POLICIES, default arguments), a
    ScoringPolicy (returned as it is), or a callable `fn(obs) -> scores`
    (wrapped by as_policy, needing nothing)."""
    if isinstance(spec, ScoringPolicy):
        return check_policy(spec)
    if isinstance(spec, str):
        if spec not in POLICIES:
            raise ValueError(f"unknown policy {spec!r}: one of {sorted(POLICIES)}")
        return POLICIES[spec]()
    if callable(spec):
        return as_policy(spec)
    raise TypeError(f"a policy is a name, a ScoringPolicy or a callable, got {type(spec).__name__}")


def score_kv(policy: Any, keys: Any, values: Any, *, positions: Any = None, seen: int | None = None,
             queries: Any = None, attention_totals: Any = None, scaling: float | None = None,
             layer_idx: int | None = None) -> Any:
    """Scores [B, Hkv, L] (or what the policy returns: [B, Hq, L], [B, L])
    of the tokens of a contiguous cache keys/values [B, Hkv, L, D]. Positions
    default to 0..L-1 (the slot is the position) and `seen` to L."""
    import torch

    policy = get_policy(policy)
    b, h, n = keys.shape[:3]
    if positions is None:
        positions = torch.arange(n, device=keys.device).expand(b, h, n)
    if seen is None:
        seen = n
    missing = [need for need, got in (("queries", queries), ("attention", attention_totals))
               if need in policy.needs and got is None]
    if missing:
        raise ValueError(f"policy {policy.name!r} needs {missing}")
    obs = Observation(keys, values, positions, seen, queries, attention_totals, scaling, layer_idx)
    return policy.score(obs)


__all__ = ["NEEDS", "POLICIES", "CallablePolicy", "ExpectedAttention", "KNorm", "KeyDiff",
           "Observation", "ObservedAttention", "ScoringPolicy", "SnapKV", "StreamingLLM", "TOVA",
           "as_policy", "check_policy", "get_policy", "score_kv"]
