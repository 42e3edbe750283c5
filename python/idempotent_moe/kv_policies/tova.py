"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the
tokens the last query attends to most, the attention averaged over heads."""

from __future__ import annotations

import torch

from .base import Observation, ScoringPolicy, group_mean


class TOVA(ScoringPolicy):
    """score = softmax(q_last k^T * scale), the last query's attention,
    averaged over the query heads of each KV head (the paper averages over
    all heads of a layer: per_head=False in the cache gives that)."""

    name = "tova"
    needs = ("queries",)
    window = 1

    def score(self, obs: Observation) -> torch.Tensor:
        attn = obs.window_attention(last=1)[:, :, 0]  # [B, Hq, L]
        return group_mean(attn, obs.keys.shape[1])
