"""Q1: what KV eviction costs in quality, on a real trained model: the
library's settings.

SmolLM2-135M-Instruct (data.load_model), on the CPU, one thread. Two
measures, at budgets (tokens kept per layer and KV head) 128, 256, 512 and
1,024, the full cache as the reference:

- perplexity of the last 512 tokens of 2,560-token documents of real prose
  (licence texts on the machine), as a multiple of the full cache's, in two
  settings: "prefill" (the first 2,048 tokens are one prompt, compressed once;
  the last 512 are then fed in one forward, teacher-forced) and "decode" (the
  first `budget` tokens are a prompt, the rest are teacher-forced in chunks
  of `evict_every` tokens with an eviction after each: the same keys seen and
  the same evictions as decoding one token at a time with that
  `evict_every`);
- passkey retrieval: a five-digit key stated at a depth of a ~1,000-token
  prompt of prose, the question ("What is the pass key?") at the prompt's
  end; the prompt is compressed once, then " The pass key is" is fed and five
  tokens are generated greedily; a trial passes when they spell the key.

In the prefill setting the library compresses each layer as its forward
ends, so the prompt's forward is the full cache's whatever the policy: the
prompt therefore runs once per document with a cache that keeps every
statistic the policies read (policies.recording_cache), and a copy of it is
evicted per (policy, budget) (`InplaceEvictionCache.evict(budget,
score=policy)`); the check (`prefill_check`) runs one (policy, budget) end
to end the way a user would, and the script records that both give the same
perplexity. The memory setting records the prefill's peak KV bytes with
layer-by-layer and whole-cache compression. kvpress's half of the same
measures: quality_kvpress.py."""

from __future__ import annotations

import copy
import math
import time

import torch
from idempotent_moe.integrations.hf_cache import InplaceEvictionCache
from transformers import DynamicCache

from .policies import decode_cache, library_policy, recording_cache, set_sinks, sinks_of
from .settings import FULL, Lengths
from .steps import forward, generate_answer, mean, nll, passkey_passed


def prefill_setting(model, docs, budgets, policies, log, lengths: Lengths = FULL) -> dict:
    """Per doc: the full cache's NLL of the continuation, and each (policy,
    budget)'s, from copies of one recorded prompt."""
    out = {}
    with torch.no_grad():
        for name, ids in docs.items():
            ids_t = torch.tensor([ids])
            prompt, cont = ids_t[:, :lengths.prompt], ids_t[:, lengths.prompt:]
            t0 = time.time()
            rec = recording_cache(model, lengths.prompt, lengths.continuation)
            forward(model, prompt, rec, keep=1)
            rec.detach()
            log(f"prefill {name}: recorded prompt in {time.time() - t0:.1f}s")
            row = {}
            full = copy.deepcopy(rec)
            logits = forward(model, cont, full, keep=lengths.continuation)
            row["full"] = nll(logits[:, :-1], cont[:, 1:]).tolist()
            del full
            for label, pname in policies:
                for budget in budgets:
                    if budget >= lengths.prompt:
                        continue
                    c = copy.deepcopy(rec)
                    if sinks_of(label) != 4:
                        set_sinks(c, sinks_of(label))
                    t0 = time.time()
                    c.evict(budget, score=library_policy(pname, budget))
                    scored = time.time() - t0
                    logits = forward(model, cont, c, keep=lengths.continuation)
                    row[f"{label}@{budget}"] = nll(logits[:, :-1], cont[:, 1:]).tolist()
                    row[f"{label}@{budget}:evict_s"] = scored
                    del c
                log(f"  {name} {label} done")
            out[name] = row
    return out


def prefill_check(model, doc, budget, policy, lengths: Lengths = FULL) -> dict:
    """One (policy, budget) the way a user runs it: a cache with that policy,
    the prompt compressed layer by layer during its forward."""
    ids_t = torch.tensor([doc])
    prompt, cont = ids_t[:, :lengths.prompt], ids_t[:, lengths.prompt:]
    with torch.no_grad():
        cache = InplaceEvictionCache(budget, sink_tokens=4, score=library_policy(policy),
                                     config=model.config, max_cache_len=budget + lengths.continuation + 64)
        cache.attach(model)
        forward(model, prompt, cache, keep=1)
        logits = forward(model, cont, cache, keep=lengths.continuation)
        cache.detach()
    return {"policy": policy, "budget": budget, "nll": nll(logits[:, :-1], cont[:, 1:]).tolist()}


def decode_setting(model, docs, budgets, policies, evict_every, recent_frac, log, out=None,
                   save=lambda: None, lengths: Lengths = FULL) -> dict:
    out = {} if out is None else out
    total = lengths.prompt + lengths.continuation
    with torch.no_grad():
        for label in ("full", *policies):
            for budget in (budgets if label != "full" else (None,)):
                for name, ids in docs.items():
                    ids_t = torch.tensor([ids])
                    row = out.setdefault(name, {})
                    if (f"{label}@{budget}" if label != "full" else "full") in row:
                        continue  # resumed from an earlier run's --out
                    t0 = time.time()
                    if label == "full":
                        cache = DynamicCache(config=model.config)
                        start = lengths.prompt
                    else:
                        cache = decode_cache(model, label, budget, evict_every, recent_frac)
                        start = budget
                    losses = []
                    forward(model, ids_t[:, :start], cache, keep=1)
                    pos = start
                    while pos < total:
                        end = min(total, pos + (evict_every if label != "full" else lengths.continuation))
                        keep = max(0, end - max(pos, lengths.prompt - 1))
                        # logits_to_keep=0 would mean all of them: keep one and ignore it
                        logits = forward(model, ids_t[:, pos:end], cache, keep=keep or 1)
                        if keep:
                            # logits of positions [end - keep, end) predict tokens [end - keep + 1, end]
                            first = end - keep
                            tgt = ids_t[:, first + 1:end + 1]
                            losses += nll(logits[:, : tgt.shape[1]], tgt).tolist()
                        pos = end
                    if label != "full":
                        cache.detach()
                    key = "full" if label == "full" else f"{label}@{budget}"
                    row[key] = losses[-(lengths.continuation - 1):]
                    log(f"decode {name} {key}: {time.time() - t0:.1f}s ppl {math.exp(mean(row[key])):.3f}")
                    save()
    return out


def passkey_setting(model, tok, trials, budgets, policies, log, results=None,
                    save=lambda: None, first_trial=0, last_trial=None, lengths: Lengths = FULL) -> dict:
    """Prefill setting: each prompt recorded once, a copy evicted per (policy,
    budget) as in prefill_setting, then the answer generated. Trials
    [first_trial, last_trial) only: the others are left to other runs."""
    last_trial = len(trials) if last_trial is None else last_trial
    results = {} if results is None else results
    results.update({"trials": [], "policies": list(policies), "budgets": list(budgets)})
    with torch.no_grad():
        for i, trial in enumerate(trials):
            if not first_trial <= i < last_trial:
                continue
            prompt = torch.tensor([trial["prompt"]])
            t0 = time.time()
            # a budget above everything the trial caches: the full cache evicts nothing, the answer
            # included
            rec = recording_cache(model, prompt.shape[1] + 64, lengths.continuation)
            forward(model, prompt, rec, keep=1)
            rec.detach()
            n = len(trial["key"]) + 1
            row = {"trial": i, "depth": trial["depth"], "key": trial["key_text"]}
            c = copy.deepcopy(rec)
            row["full"] = passkey_passed(tok, trial, generate_answer(model, c, trial["answer_prefix"], n))
            for pname in policies:
                for budget in budgets:
                    if budget >= prompt.shape[1]:
                        continue
                    c = copy.deepcopy(rec)
                    c.evict(budget, score=library_policy(pname, budget))
                    got = generate_answer(model, c, trial["answer_prefix"], n)
                    row[f"{pname}@{budget}"] = passkey_passed(tok, trial, got)
            results["trials"].append(row)
            log(f"passkey trial {i} depth {trial['depth']}: {time.time() - t0:.1f}s full={row['full']}")
            save()
    return results


def passkey_decode_setting(model, tok, trials, budgets, policies, evict_every, recent_frac, log,
                           results=None, save=lambda: None) -> dict:
    """Decode setting: each prompt streams through the decode setting's cache
    (its first `budget` tokens in one forward, the rest in chunks of
    `evict_every` with an eviction after each, the last chunk shorter), then
    the answer is generated as in passkey_setting."""
    results = {} if results is None else results
    results.update({"trials": [], "policies": list(policies), "budgets": list(budgets)})
    with torch.no_grad():
        for i, trial in enumerate(trials):
            prompt = torch.tensor([trial["prompt"]])
            t0 = time.time()
            n = len(trial["key"]) + 1
            row = {"trial": i, "depth": trial["depth"], "key": trial["key_text"]}
            for pname in policies:
                for budget in budgets:
                    if budget >= prompt.shape[1]:
                        continue
                    cache = decode_cache(model, pname, budget, evict_every, recent_frac)
                    forward(model, prompt[:, :budget], cache, keep=1)
                    for pos in range(budget, prompt.shape[1], evict_every):
                        forward(model, prompt[:, pos:pos + evict_every], cache, keep=1)
                    got = generate_answer(model, cache, trial["answer_prefix"], n)
                    cache.detach()
                    row[f"{pname}@{budget}"] = passkey_passed(tok, trial, got)
            results["trials"].append(row)
            log(f"passkey (decode) trial {i} depth {trial['depth']}: {time.time() - t0:.1f}s")
            save()
    return results


def memory_setting(model, doc, budget, policy, lengths: Lengths = FULL) -> dict:
    out = {"budget": budget, "policy": policy, "prompt_tokens": lengths.prompt}
    with torch.no_grad():
        for mode in ("layer", "whole"):
            cache = InplaceEvictionCache(budget, sink_tokens=4, score=library_policy(policy),
                                         config=model.config, prefill_eviction=mode).attach(model)
            forward(model, torch.tensor([doc[:lengths.prompt]]), cache, keep=1)
            cache.evict()
            out[f"peak_kv_bytes_{mode}"] = cache.peak_kv_bytes
            out[f"final_kv_bytes_{mode}"] = cache.buffer_bytes()
            cache.detach()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out["full_prompt_kv_bytes"] = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * lengths.prompt
                                   * head_dim * 4)
    return out
