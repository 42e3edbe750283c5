"""The base of every KV scoring policy: what a policy is given (`Observation`)
and what it returns (a score per cached token, higher kept).

A policy scores; it never moves data. Every cache of the library (the dense
compaction, paged pools, the transformers cache, the vLLM-style hook) turns
its scores into one in-place compaction with the sinks and the recent window
protected. Shapes: B batch, Hkv KV heads, Hq = G x Hkv query heads (the G
query heads of one KV head consecutive, as `repeat_kv` lays them out),
L cached tokens, D head dim, w queries of the observation window."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

NEEDS = ("queries", "attention")


@dataclass
class Observation:
    """What a policy may read about one layer's cache. Tensors are views of
    the cache's own buffers: read them, never write them.

    keys, values       [B, Hkv, L, D], [B, Hkv, L, Dv], RoPE already applied.
    positions          [B, Hkv, L] int: the logical position of each token.
    seen               tokens seen by the layer (the next position).
    queries            [B, Hq, w, D] or None: the last w queries seen (RoPE
                       applied), oldest first; query i sits at position
                       seen - w + i. Given to policies that name "queries".
    attention_totals   [B, Hkv, L] float32 or None: the attention each token
                       received, summed over every query since it was
                       cached (and averaged over the G query heads of its KV
                       head). Given to policies that name "attention".
    scaling            the attention's softmax scale (D ** -0.5 by default).
    layer_idx          the layer, or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    seen: int
    queries: torch.Tensor | None = None
    attention_totals: torch.Tensor | None = None
    scaling: float | None = None
    layer_idx: int | None = None

    @property
    def attention_counts(self) -> torch.Tensor:
        """[B, Hkv, L] float32: the queries that saw each token. A token at
        position p is seen by every later query and by its own (causal
        attention): seen - p of them."""
        return (self.seen - self.positions).float().clamp(min=1)

    @property
    def scale(self) -> float:
        return self.keys.shape[-1] ** -0.5 if self.scaling is None else float(self.scaling)

    @property
    def query_positions(self) -> torch.Tensor:
        """[w] int64: the position of each query of the window."""
        w = 0 if self.queries is None else self.queries.shape[2]
        return torch.arange(self.seen - w, self.seen, device=self.keys.device)

    def window_attention(self, last: int | None = None) -> torch.Tensor:
        """Softmax attention [B, Hq, w', L] (float32) of the last `last`
        window queries (all w by default) over the cached tokens, causal by
        position: a query does not see a token cached after it. The queries
        of the window attended to at most these tokens when they ran; this
        recomputes the attention over the tokens still cached."""
        if self.queries is None:
            raise ValueError("this policy needs the queries of the observation window")
        q = self.queries if last is None else self.queries[:, :, -last:]
        b, hq, w, d = q.shape
        hkv = self.keys.shape[1]
        if hq % hkv:
            raise ValueError(f"queries have {hq} heads, not a multiple of the {hkv} KV heads")
        g = hq // hkv
        k = self.keys.float()
        logits = torch.einsum("bhgwd,bhld->bhgwl", q.float().reshape(b, hkv, g, w, d), k)
        logits = logits * self.scale
        qpos = self.query_positions[-w:]
        future = self.positions[:, :, None, None, :] > qpos[None, None, None, :, None]
        logits = logits.masked_fill(future, -math.inf)
        return torch.softmax(logits, dim=-1).reshape(b, hq, w, -1)


class ScoringPolicy:
    """A KV scoring policy. Subclass it and define `score`:

        class MyPolicy(ScoringPolicy):
            name = "my_policy"
            needs = ("queries",)  # what Observation must carry: "queries", "attention"
            window = 16           # queries of the observation window it reads
            def score(self, obs):  # -> [B, Hkv, L], [B, Hq, L] or [B, L]; higher kept
                ...

    `needs` says which running statistics a cache must keep for it: the
    last `window` queries ("queries") and the attention totals ("attention",
    from eager attention weights). Scores per query head are reduced to one
    per KV head by the cache's `head_reduce`."""

    name = "policy"
    needs: tuple = ()
    window = 0

    def score(self, obs: Observation) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, obs: Observation) -> torch.Tensor:
        return self.score(obs)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class CallablePolicy(ScoringPolicy):
    """A user's function `fn(obs: Observation) -> scores` as a policy."""

    def __init__(self, fn: Callable, needs: tuple = (), window: int = 0, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.needs = check_needs(needs)
        self.window = _check_window(window, self.needs)
        self.name = name or getattr(fn, "__name__", "callable")

    def score(self, obs: Observation) -> torch.Tensor:
        return self.fn(obs)


def as_policy(fn: Callable, *, needs: tuple = (), window: int = 0, name: str | None = None
              ) -> CallablePolicy:
    """Wrap `fn(obs) -> scores` as a ScoringPolicy that needs `needs`
    ("queries" with `window` >= 1 queries, "attention")."""
    return CallablePolicy(fn, needs, window, name)


def check_needs(needs: Any) -> tuple:
    needs = tuple(needs)
    bad = [n for n in needs if n not in NEEDS]
    if bad:
        raise ValueError(f"needs must name only {NEEDS}, got {bad}")
    return needs


def _check_window(window: Any, needs: tuple) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    if "queries" in needs and window < 1:
        raise ValueError("a policy that needs queries needs window >= 1")
    return window


def check_policy(policy: ScoringPolicy) -> ScoringPolicy:
    """A policy's declared needs, checked once when a cache takes it."""
    check_needs(policy.needs)
    _check_window(policy.window, tuple(policy.needs))
    return policy


def group_mean(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, L] -> [B, Hkv, L]: the mean over each group of query heads."""
    b, hq, n = scores.shape
    return scores.reshape(b, kv_heads, hq // kv_heads, n).mean(2)
