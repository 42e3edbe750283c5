"""ObservedAttention: the attention each token has received (H2O, Zhang et
al., 2023, "H2O: Heavy-Hitter Oracle"), as a mean over the queries that saw
it rather than a sum; optionally weighted by the norm of the token's value
(VATP, Guo et al., 2024, "Attention Score is not All You Need for Token
Importance Indicator in KV Cache Reduction: Value Also Matters")."""

from __future__ import annotations

import torch

from .base import Observation, ScoringPolicy


class ObservedAttention(ScoringPolicy):
    """score = attention_totals / attention_counts with normalize=True (the
    default): the mean attention a token received from the queries that saw
    it. H2O's plain sum (normalize=False) grows with the number of queries
    that came after a token, so after a prompt it favours the oldest tokens:
    a positional bias, not a measure of importance. With `value_norm=p` the
    score is multiplied by ||v||_p, the p-norm of the token's value (VATP
    uses p = 1): a token that draws attention but whose value is small adds
    little to the attention's output. Needs the attention totals (eager
    attention weights)."""

    name = "observed_attention"
    needs = ("attention",)

    def __init__(self, normalize: bool = True, value_norm: float | None = None):
        if value_norm is not None and (isinstance(value_norm, bool) or not value_norm > 0):
            raise ValueError(f"value_norm must be None or a norm order > 0, got {value_norm!r}")
        self.normalize, self.value_norm = normalize, value_norm

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.attention_totals is None:
            raise ValueError("ObservedAttention needs the attention totals")
        totals = obs.attention_totals.float()
        s = totals / obs.attention_counts if self.normalize else totals
        if self.value_norm is not None:
            s = s * torch.linalg.vector_norm(obs.values.float(), ord=self.value_norm, dim=-1)
        return s
