"""ObservedAttention: the attention each token has received (H2O, Zhang et
al., 2023, "H2O: Heavy-Hitter Oracle"), as a mean over the queries that saw
it rather than a sum."""

from __future__ import annotations

import torch

from .base import Observation, ScoringPolicy


class ObservedAttention(ScoringPolicy):
    """score = attention_totals / attention_counts with normalize=True (the
    default): the mean attention a token received from the queries that saw
    it. H2O's plain sum (normalize=False) grows with the number of queries
    that came after a token, so after a prompt it favours the oldest tokens:
    a positional bias, not a measure of importance. Needs the attention
    totals (eager attention weights)."""

    name = "observed_attention"
    needs = ("attention",)

    def __init__(self, normalize: bool = True):
        self.normalize = normalize

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.attention_totals is None:
            raise ValueError("ObservedAttention needs the attention totals")
        totals = obs.attention_totals.float()
        return totals / obs.attention_counts if self.normalize else totals
