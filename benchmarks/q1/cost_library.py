"""Q1's scoring cost, the library's half: its prefill and decode measures
(see cost.py), the eviction timed by wrapping InplaceEvictionLayer's
`_eviction` (judging and scoring) and `_compact` (the in-place compaction
and the move into the steady buffer), and the statistics its hooks keep
during the forward (`accumulate_attention`, the query hook: "stats")."""

from __future__ import annotations

import torch
from idempotent_moe.integrations.hf_cache import InplaceEvictionCache
from imoe_bench.internals import KV_TIMED_STEPS
from transformers import DynamicCache

from .cost import TIMERS, timed
from .policies import decode_cache, library_policy
from .steps import forward


def wrap_library() -> None:
    for cls, method, label, at in KV_TIMED_STEPS:
        TIMERS.wrap(cls, method, label, lambda a, at=at: a[at].layer_idx)



def lib_prefill_cache(model, policy, budget):
    if policy == "full":
        return DynamicCache(config=model.config)
    return InplaceEvictionCache(budget, sink_tokens=4, score=library_policy(policy, budget),
                                config=model.config)


def lib_prefill(model, ids, policy, budget) -> dict:
    cache = lib_prefill_cache(model, policy, budget)
    if policy != "full":
        cache.attach(model)
    try:
        with torch.no_grad():
            out = timed(lambda: forward(model, ids, cache, keep=1))
    finally:
        if policy != "full":
            cache.detach()
    if policy != "full":
        kept = {layer.length for layer in cache.layers}
        if kept != {min(budget, ids.shape[1])}:
            raise RuntimeError(f"{policy}@{budget} kept {kept}")
    return out


def lib_decode(model, ids, policy, budget, context, steps) -> dict:
    if policy == "full":
        cache = DynamicCache(config=model.config)
    else:
        cache = decode_cache(model, policy, budget, steps, 0.25)
    try:
        with torch.no_grad():
            forward(model, ids[:, :context], cache, keep=1)
            for i in range(context, context + steps):  # fill the buffer: the eviction falls due
                forward(model, ids[:, i:i + 1], cache, keep=1)

            def run():
                for i in range(context + steps, context + 2 * steps):
                    forward(model, ids[:, i:i + 1], cache, keep=1)

            out = timed(run)
    finally:
        if policy != "full":
            cache.detach()
    if policy != "full":
        ev = {layer.evictions for layer in cache.layers}
        # the prompt's own eviction, then the one due after the 64 filling steps, done at the
        # first timed step (the 64th timed step makes the next one due)
        expected = (1 if context > budget else 0) + 1
        if ev != {expected}:
            raise RuntimeError(f"decode {policy}@{budget}: evictions {ev}, expected {expected}")
    out["step_ms"] = out["wall_ms"] / steps
    return out
