"""ExpectedAttention (Devoto et al., 2025, "Expected Attention: KV Cache
Compression by Estimating Attention from Future Queries Distribution"): model
the coming queries as a Gaussian N(mu, Sigma), score each key by the
attention it is expected to receive, E[exp(q.k s)] = exp(mu.k s +
s^2 k^T Sigma k / 2), normalised over the keys, weighted by the value's norm."""

from __future__ import annotations

import torch

from .base import Observation, ScoringPolicy, group_mean


class ExpectedAttention(ScoringPolicy):
    """mu and Sigma are the mean and covariance of the last `window` queries
    (RoPE applied: the next queries are taken to be distributed like the
    latest ones, where the paper also averages the rotation over the coming
    positions); per query head, the expected attention softmax-normalised
    over the cached tokens, averaged over the query heads of each KV head,
    plus `epsilon`, times ||v||."""

    name = "expected_attention"
    needs = ("queries",)

    def __init__(self, window: int = 32, epsilon: float = 0.0, use_covariance: bool = True):
        self.window, self.epsilon, self.use_covariance = window, epsilon, use_covariance

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.queries is None:
            raise ValueError("ExpectedAttention needs the queries of the observation window")
        q = obs.queries.float()  # [B, Hq, w, D]
        b, hq, w, d = q.shape
        hkv = obs.keys.shape[1]
        k = obs.keys.float().repeat_interleave(hq // hkv, dim=1)  # [B, Hq, L, D]
        s = obs.scale
        mu = q.mean(dim=2)  # [B, Hq, D]
        logits = torch.einsum("bhd,bhld->bhl", mu, k) * s
        if self.use_covariance and w > 1:
            centred = q - mu[:, :, None]
            cov = torch.einsum("bhwd,bhwe->bhde", centred, centred) / (w - 1)
            logits = logits + 0.5 * s * s * torch.einsum("bhld,bhde,bhle->bhl", k, cov, k)
        expected = torch.softmax(logits, dim=-1)
        expected = group_mean(expected, hkv) + self.epsilon
        return expected * torch.linalg.vector_norm(obs.values.float(), dim=-1)
