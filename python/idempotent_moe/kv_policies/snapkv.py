"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for
Before Generation"): the last `window` queries of the prompt (the observation
window, where the question is) vote for the tokens they attend to; the votes
are pooled along the sequence so that a selected token brings its
neighbours; the window itself is kept."""

from __future__ import annotations

import math

import torch

from .base import Observation, ScoringPolicy, group_mean

POOLINGS = ("avg", "max")


class SnapKV(ScoringPolicy):
    """score_i = pool_k(sum over the window's queries of their softmax
    attention to token i), averaged over the query heads of each KV head;
    +inf for the window's own tokens. `kernel` is the pooling width (odd),
    `pooling` "avg" or "max"."""

    name = "snapkv"
    needs = ("queries",)

    def __init__(self, window: int = 32, kernel: int = 5, pooling: str = "avg"):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"kernel must be odd and >= 1, got {kernel}")
        self.window, self.kernel, self.pooling = window, kernel, pooling

    def score(self, obs: Observation) -> torch.Tensor:
        votes = obs.window_attention().sum(dim=2)  # [B, Hq, L]
        if self.kernel > 1:
            b, h, n = votes.shape
            flat = votes.reshape(b * h, 1, n)
            pad = self.kernel // 2
            if self.pooling == "avg":
                flat = torch.nn.functional.avg_pool1d(flat, self.kernel, 1, pad,
                                                      count_include_pad=False)
            else:
                flat = torch.nn.functional.max_pool1d(flat, self.kernel, 1, pad)
            votes = flat.reshape(b, h, n)
        s = group_mean(votes, obs.keys.shape[1])
        w = 0 if obs.queries is None else obs.queries.shape[2]
        return torch.where(obs.positions >= obs.seen - w, math.inf, s)
