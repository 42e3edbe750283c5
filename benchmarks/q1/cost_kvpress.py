"""Q1's scoring cost, kvpress's half (its own environment: kvpress 0.5.5
needs transformers < 5.3): each press compressing the prompt during its
forward (prefill), or `DecodingPress(press, compression_interval=64,
target_size=budget)` (decode), timed by wrapping the press's `score` and
`compress` (score, then topk and gather: the compaction is compress minus
score). Imports kvpress when it runs, never idempotent_moe."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .cost import TIMERS, timed


def wrap_press(press) -> None:
    """Time a kvpress ScorerPress instance's score and compress (per layer:
    the attention module is their first argument)."""
    TIMERS.wrap(press, "score", "score", lambda a: a[0].layer_idx)
    TIMERS.wrap(press, "compress", "compress", lambda a: a[0].layer_idx)


def kv_prefill(model, ids, press_name, budget) -> dict:
    import kvpress

    cache = DynamicCache()
    n = ids.shape[1]
    with torch.no_grad():
        if press_name == "full":
            return timed(lambda: model(input_ids=ids, past_key_values=cache, use_cache=True,
                                       logits_to_keep=1))
        # kvpress keeps int(n * (1 - ratio)) tokens: half a token above the budget lands on it
        press = getattr(kvpress, press_name)(compression_ratio=1 - (budget + 0.5) / n)
        wrap_press(press)
        try:
            with press(model):
                out = timed(lambda: model(input_ids=ids, past_key_values=cache, use_cache=True,
                                          logits_to_keep=1))
        finally:
            TIMERS.unwrap()
    if cache.get_seq_length() != budget:
        raise RuntimeError(f"{press_name} kept {cache.get_seq_length()} tokens, not {budget}")
    return out


def kv_decode(model, ids, press_name, budget, context, steps) -> dict:
    import kvpress

    cache = DynamicCache()
    pos = [0]

    def step(lo, hi):
        # positions count on from the tokens seen
        p = torch.arange(pos[0], pos[0] + hi - lo, device=ids.device)[None]
        model(input_ids=ids[:, lo:hi], past_key_values=cache, position_ids=p, use_cache=True,
              logits_to_keep=1)
        pos[0] += hi - lo

    def run():
        for i in range(context + steps, context + 2 * steps):
            step(i, i + 1)

    with torch.no_grad():
        if press_name == "full":
            step(0, context)
            for i in range(context, context + steps):
                step(i, i + 1)
            out = timed(run)
        else:
            press = kvpress.DecodingPress(base_press=getattr(kvpress, press_name)(),
                                          compression_interval=steps, target_size=budget)
            wrap_press(press.base_press)
            try:
                with press(model):
                    step(0, context)  # kvpress compresses nothing while prefilling here
                    for i in range(context, context + steps):  # the first eviction, at step 64
                        step(i, i + 1)
                    out = timed(run)  # the second, at the 64th timed step
            finally:
                TIMERS.unwrap()
            if cache.get_seq_length() != budget:
                raise RuntimeError(f"decode {press_name}@{budget}: {cache.get_seq_length()} tokens")
    out["step_ms"] = out["wall_ms"] / steps
    return out
