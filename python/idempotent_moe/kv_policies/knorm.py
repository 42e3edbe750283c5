"""KNorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy
for KV Cache Compression"): keys of small L2 norm draw the most attention;
keep them."""

from __future__ import annotations

import torch

from .base import Observation, ScoringPolicy


class KNorm(ScoringPolicy):
    """score = -||k||_2, per KV head."""

    name = "knorm"

    def score(self, obs: Observation) -> torch.Tensor:
        return torch.linalg.vector_norm(obs.keys.float(), dim=-1).neg()
