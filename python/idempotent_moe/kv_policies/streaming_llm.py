"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with
Attention Sinks"): keep the first `sink_tokens` (the attention sinks) and the
most recent tokens; nothing else is scored."""

from __future__ import annotations

import math

import torch

from .base import Observation, ScoringPolicy


class StreamingLLM(ScoringPolicy):
    """score = the token's position (newer kept), +inf for the first
    `sink_tokens` positions. One selection, the same for every head."""

    name = "streaming_llm"

    def __init__(self, sink_tokens: int = 4):
        self.sink_tokens = sink_tokens

    def score(self, obs: Observation) -> torch.Tensor:
        pos = obs.positions
        return torch.where(pos < self.sink_tokens, math.inf, pos.float())
