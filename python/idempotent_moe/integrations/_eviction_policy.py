"""What an InplaceEvictionCache is asked to do, checked once: its
EvictionPolicy (budget, sinks, recent window, cadence, score, and the
compaction's options), the scores it takes (SCORES: "auto", "key_norm",
"attention", the kv_policies by name, a ScoringPolicy or a callable), and
the rule of score="auto" (AUTO_*). The cache and its layers
(hf_cache.py) read it; nothing here holds a tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._arrays import check_int
from .._native import native
from ..kv import HEAD_REDUCTIONS
from ..kv_policies import POLICIES, ObservedAttention, ScoringPolicy, check_policy

SCORES = ("auto", "key_norm", "attention", *POLICIES)
PREFILL_EVICTIONS = ("layer", "whole")


@dataclass(frozen=True)
class EvictionPolicy:
    """What every layer of one InplaceEvictionCache does."""

    budget: int
    sink_tokens: int = 4
    recent_window: int = 0
    evict_every: int | None = None
    score: Any = "auto"
    head_reduce: str = "mean"
    per_head: bool = True
    mode: str = "move"
    order: str = "inplace"
    slots: int = 0  # steady buffer size per layer
    prefill_eviction: str = "layer"

    @property
    def scorer(self) -> ScoringPolicy | None:
        """The ScoringPolicy behind `score` (a name of kv_policies.POLICIES or
        a policy), None for "key_norm", "attention" and a plain callable."""
        score = self.score
        if isinstance(score, ScoringPolicy):
            return score
        if isinstance(score, str) and score in POLICIES:
            return NAMED_POLICIES[score]
        return None

    @property
    def needs(self) -> tuple:
        scorer = self.scorer
        if scorer is not None:
            return tuple(scorer.needs)
        if self.score == "auto":
            return ("attention", "queries")
        return ("attention",) if self.score == "attention" else ()

    def is_prompt(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens is a prompt rather than decode
        steps: more than `evict_every` (any number above one without it; a
        chunk of `evict_every` evicts as that many decode steps do)."""
        return tokens > (self.evict_every or 1)

    @property
    def query_window(self) -> int:
        scorer = self.scorer
        if self.score == "auto":
            return AUTO_WINDOW
        return scorer.window if scorer is not None and "queries" in scorer.needs else 0

    def check(self) -> None:
        """TypeError for a kind (a non-int count, a bool or float among them;
        an option that is not a str; a score that is neither a name, a
        policy nor a callable; per_head not a bool), ValueError for a value."""
        check_int(self.budget, "budget", 1)
        check_int(self.sink_tokens, "sink_tokens", 0)
        check_int(self.recent_window, "recent_window", 0)
        if self.sink_tokens + self.recent_window > self.budget:
            raise ValueError(
                f"sink_tokens ({self.sink_tokens}) + recent_window ({self.recent_window}) must "
                f"not exceed budget ({self.budget})"
            )
        if self.evict_every is not None:
            check_int(self.evict_every, "evict_every", 1)
        check_int(self.slots, "max_cache_len", 0)
        if self.slots < self.budget + 1:
            raise ValueError(f"max_cache_len ({self.slots}) must exceed budget ({self.budget})")
        if self.slots > native().MAX_SLOTS:
            raise ValueError(f"max_cache_len ({self.slots}) exceeds the {native().MAX_SLOTS} slots a "
                             "compaction takes")
        check_score(self.score)
        check_option(self.prefill_eviction, "prefill_eviction", PREFILL_EVICTIONS)
        check_option(self.head_reduce, "head_reduce", HEAD_REDUCTIONS)
        # Checked here, when the cache is made, against the C API's names.
        check_option(self.mode, "mode", native().MODES)
        check_option(self.order, "order", native().ORDERS)
        if type(self.per_head) is not bool:
            raise TypeError(f"per_head must be True or False, got {self.per_head!r}")


def check_option(value: Any, name: str, accepted: tuple) -> str:
    """One of `accepted`: TypeError for a non-str, ValueError for another name."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {tuple(accepted)}, got {type(value).__name__}")
    if value not in accepted:
        raise ValueError(f"{name} must be one of {tuple(accepted)}, got {value!r}")
    return value


def check_score(score: Any) -> None:
    """A score the cache takes: a name of SCORES, a kv_policies.ScoringPolicy
    (checked) or a callable; TypeError for another kind, ValueError for
    another name."""
    if isinstance(score, ScoringPolicy):
        check_policy(score)
    elif isinstance(score, str):
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, a kv_policies.ScoringPolicy or a callable, "
                             f"got {score!r}")
    elif not callable(score):
        raise TypeError(f"score must be a name of {SCORES}, a kv_policies.ScoringPolicy or a callable, "
                        f"got {type(score).__name__}")


# One instance per named policy, with its defaults (policies hold no state).
NAMED_POLICIES = {name: cls() for name, cls in POLICIES.items()}
# score="auto" with attention weights: VATP's score, and the newest budget // AUTO_RECENT_PROMPT
# tokens kept when a prompt is compressed, budget // AUTO_RECENT_DECODE while decoding (Q1).
# When a prompt is compressed, the budget // AUTO_QUESTION tokens that the prompt's last
# AUTO_WINDOW queries (the observation window, where a question sits) attend to most are kept
# too, before VATP fills the rest (Q1).
AUTO_SCORER = ObservedAttention(value_norm=1)
AUTO_RECENT_PROMPT, AUTO_RECENT_DECODE = 8, 4
AUTO_WINDOW, AUTO_QUESTION = 8, 4
