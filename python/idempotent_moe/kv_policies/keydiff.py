"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache
Eviction for Long-Context LLM Inference"): keep the keys least similar to the
others, measured by the cosine similarity to the mean key (the anchor)."""

from __future__ import annotations

import torch

from .base import Observation, ScoringPolicy


class KeyDiff(ScoringPolicy):
    """score = -cos(k_i, mean_j k_j), per KV head (the anchor is the mean of
    the cached keys of that head)."""

    name = "keydiff"

    def score(self, obs: Observation) -> torch.Tensor:
        k = obs.keys.float()
        anchor = k.mean(dim=2, keepdim=True)
        return torch.nn.functional.cosine_similarity(k, anchor, dim=-1).neg()
