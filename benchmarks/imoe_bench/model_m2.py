"""M2 (docs/results.md#workloads): long context with eviction.

A Llama-like model with random weights generates `new_tokens` greedy tokens
after a long prompt, prefilled in chunks (generate()'s prefill_chunk_size),
once with transformers' DynamicCache and once with
`InplaceEvictionCache(budget, sink_tokens=4, evict_every=...)`, which evicts
in place down to `budget` tokens per layer after each prefill chunk and every
`evict_every` decode steps. Per cache, in interleaved rounds: the peak memory
of the whole generate() (beyond the weights, and in all), its total time,
the time to the first new token, and the decode rate (tokens after the first
over the time from the first to the last).

The evicting cache attends to fewer tokens, so its tokens are not expected to
equal the full cache's: how many do is reported, and never judged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from .model_families import Family, build_model, describe, random_prompt
from .model_timing import Samples, attempt, log, peak_since, reset_peak, round_order, timed_generate

SINK_TOKENS = 4


@dataclass
class M2Options:
    device: str
    prompt_tokens: int
    chunk: int
    budget: int
    evict_every: int
    new_tokens: int
    rounds: int


def _cache_argument(model) -> str:
    """generate()'s name for a Cache: `cache` from transformers 5.24 on,
    `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _make_cache(name: str, model, opts: M2Options):
    from idempotent_moe.integrations import InplaceEvictionCache
    from transformers import DynamicCache

    if name == "DynamicCache":
        return DynamicCache(config=model.config)
    return InplaceEvictionCache(opts.budget, sink_tokens=SINK_TOKENS, evict_every=opts.evict_every,
                                config=model.config)


def cache_names(opts: M2Options) -> list:
    return ["DynamicCache", f"InplaceEvictionCache({opts.budget})"]


def run_m2(family: Family, opts: M2Options) -> dict:
    import gc

    import torch

    device = opts.device
    log(f"M2: building {family.name} ({family.dtype}) on {device}")
    model = build_model(family, device)
    arg = _cache_argument(model)
    ids = random_prompt(1, opts.prompt_tokens, model.config.vocab_size, device, seed=7)
    mask = torch.ones_like(ids)
    names = cache_names(opts)
    rows = {n: {"cache": n, "prompt_tokens": opts.prompt_tokens, "prefill_chunk": opts.chunk,
                "new_tokens": opts.new_tokens} for n in names}
    samples = {n: Samples() for n in names}
    tokens: dict = {}
    caches: dict = {}

    def generate(name: str, model=model):
        def call(streamer):
            caches[name] = _make_cache(name, model, opts)
            with torch.no_grad():
                return model.generate(ids, attention_mask=mask, max_new_tokens=opts.new_tokens,
                                      min_new_tokens=opts.new_tokens, do_sample=False,
                                      prefill_chunk_size=opts.chunk, streamer=streamer,
                                      **{arg: caches[name]})
        return call

    def timed(name: str):
        before = reset_peak(device)
        out, timing = timed_generate(device, generate(name))
        return out, timing, peak_since(device), before

    try:
        for name in names:  # warm-up
            attempt(rows[name], f"M2 {name}", lambda name=name: timed(name))
            caches.pop(name, None)
        for r in range(opts.rounds):
            for name in (n for n in round_order(names, r) if "error" not in rows[n]):
                result = attempt(rows[name], f"M2 {name}", lambda name=name: timed(name))
                cache = caches.pop(name, None)
                if result is None:
                    tokens.pop(name, None)
                    continue
                out, timing, peak, before = result
                if hasattr(cache, "buffer_bytes"):
                    rows[name]["cache_buffer_bytes"] = int(cache.buffer_bytes())
                    rows[name]["evicted_tokens_layer0"] = int(cache.layers[0].evicted)
                del cache
                tokens[name] = out[:, opts.prompt_tokens:]
                samples[name].add(total_ms=timing.total_s * 1e3, first_token_ms=timing.first_token_s * 1e3,
                                  decode_tokens_per_s=timing.decode_steps / timing.decode_s)
                if peak is not None:
                    samples[name].add(peak=peak, beyond=peak - before)
            log(f"M2 round {r + 1}/{opts.rounds} done")
    finally:
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    full = tokens.get(names[0])
    for name in names:
        row, s = rows[name], samples[name]
        if "error" in row:
            continue
        row.update(rounds=opts.rounds, total_ms=s.median("total_ms"),
                   first_token_ms=s.median("first_token_ms"),
                   decode_tokens_per_s=s.median("decode_tokens_per_s"))
        if "peak" in s.values:
            row.update(peak_allocated_bytes=int(max(s.values["beyond"])),
                       peak_total_bytes=int(max(s.values["peak"])))
        if full is not None:
            row["tokens_equal_full_cache"] = int((tokens[name] == full).sum())
    base = rows[names[0]]
    for row in rows.values():
        if "total_ms" in row and "total_ms" in base:
            row["speedup_vs_dynamic_cache"] = base["total_ms"] / row["total_ms"]
            row["decode_speedup_vs_dynamic_cache"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            if "peak_allocated_bytes" in row and base.get("peak_allocated_bytes"):
                row["peak_over_dynamic_cache"] = row["peak_allocated_bytes"] / base["peak_allocated_bytes"]
    return {"model": describe(family),
            "options": {"prompt_tokens": opts.prompt_tokens, "prefill_chunk": opts.chunk,
                        "budget": opts.budget, "sink_tokens": SINK_TOKENS, "evict_every": opts.evict_every,
                        "new_tokens": opts.new_tokens, "rounds": opts.rounds,
                        "eviction_score": "key_norm"},
            "rows": list(rows.values())}
