"""The library's policies and caches as Q1 runs them: each label of the
tables as a policy (`library_policy`, with the question-aware candidates
measured for "auto"), the recording cache the prefill and passkey settings
copy and evict per (policy, budget), and the decode setting's cache. The
library's half only: the kvpress environment never imports this module."""

from __future__ import annotations

import dataclasses
import math
import re

import torch
from idempotent_moe.integrations.hf_cache import InplaceEvictionCache
from idempotent_moe.kv_policies import ObservedAttention, as_policy, get_policy
from idempotent_moe.kv_policies.base import group_mean


def library_policy(name: str, budget: int | None = None):
    """A policy of the tables by its label. Besides kv_policies' names:
    "h2o_sum" (ObservedAttention's plain sum), "auto" (the cache's default),
    "vatp" (ObservedAttention weighted by the values' L1 norm, what "auto"
    scores with), "vatp_recentK" (that, with the newest budget // K kept:
    "vatp_recent8" is "auto" compressing a prompt without its question),
    "observed_attention_nosinks" (no sink kept: see `sinks_of`) and the
    question-aware candidates "qa..." (`question_aware`)."""
    if name == "h2o_sum":
        return ObservedAttention(normalize=False)
    if name == "auto":
        return "auto"  # InplaceEvictionCache's default
    if name == "vatp":
        return ObservedAttention(value_norm=1)
    if name.startswith("vatp_recent"):
        vatp, part = ObservedAttention(value_norm=1), int(name[len("vatp_recent"):])
        return as_policy(lambda obs: torch.where(obs.positions >= obs.seen - budget // part, math.inf,
                                                 vatp.score(obs)), needs=("attention",), name=name)
    if name == "observed_attention_nosinks":
        return get_policy("observed_attention")
    if name.startswith("qa"):
        return question_aware(name, budget)
    return get_policy(name)


def question_aware(name: str, budget: int):
    """The question-aware candidates measured for "auto" compressing a prompt:
    VATP with the newest budget // 8 kept, plus the attention of the prompt's
    last W queries (the observation window, where the question is), averaged
    over them and over the query heads of each KV head ("_L": over every head
    of the layer). "qamax_wW": the larger of the two scores, each normalised
    to sum 1 over the tokens not protected (sinks, the newest); "qatopK_wW":
    the budget // K tokens the window attends to most kept, VATP filling the
    rest ("auto" is "qatop4_w8_L")."""
    m = re.fullmatch(r"qa(max|top(\d+))_w(\d+)(_L)?", name)
    if m is None:
        raise ValueError(f"unknown candidate {name!r}")
    top = int(m.group(2)) if m.group(2) else None
    w, layer_mean = int(m.group(3)), bool(m.group(4))
    vatp = ObservedAttention(value_norm=1)

    def score(obs):
        v = vatp.score(obs)
        a = obs.window_attention(last=w).mean(2)
        a = a.mean(1, keepdim=True).expand_as(v) if layer_mean else group_mean(a, v.shape[1])
        recent = obs.positions >= obs.seen - budget // 8
        protect = recent | (obs.positions < 4)
        if top is None:
            v, a = v.masked_fill(protect, 0), a.masked_fill(protect, 0)
            s = torch.maximum(v / v.sum(-1, keepdim=True), a / a.sum(-1, keepdim=True))
        else:
            s = v.scatter(-1, a.masked_fill(protect, -1).topk(budget // top, dim=-1).indices, math.inf)
        return torch.where(recent, math.inf, s)

    return as_policy(score, needs=("attention", "queries"), window=w, name=name)


def sinks_of(label: str) -> int:
    return 0 if label.endswith("_nosinks") else 4


def set_sinks(cache, sinks: int) -> None:
    """A copy of a recorded cache that protects `sinks` first tokens instead of 4."""
    policy = dataclasses.replace(cache.policy, sink_tokens=sinks)
    cache.policy = policy
    for layer in cache.layers:
        if hasattr(layer, "policy"):
            layer.policy = policy


def recording_cache(model, budget: int, continuation: int, window: int = 64):
    """A cache that evicts nothing below `budget` and keeps every statistic
    the policies read: the last `window` queries and the attention totals;
    room for `continuation` more tokens."""
    record = as_policy(lambda obs: obs.keys.new_zeros(obs.keys.shape[:3]),
                       needs=("queries", "attention"), window=window, name="record")
    return InplaceEvictionCache(budget, sink_tokens=4, score=record, config=model.config,
                                max_cache_len=budget + continuation + 64).attach(model)


def decode_cache(model, label, budget, evict_every, recent_frac):
    """The decode setting's cache of one policy: the window (StreamingLLM) is
    4 sinks and the rest recent; "auto" is the cache's defaults as a user gets
    them; "vatp_recentK" its own recent window; the other scored policies
    keep a recent window of `recent_frac` of the budget."""
    own = label in ("streaming_llm", "auto") or label.startswith("vatp_recent")
    recent = 0 if own else int(budget * recent_frac)
    return InplaceEvictionCache(budget, sink_tokens=4, recent_window=recent, evict_every=evict_every,
                                score=library_policy(label, budget), config=model.config).attach(model)
