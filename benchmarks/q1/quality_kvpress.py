"""Q1's quality measures run by kvpress: its presses on the library's token
ids (a JSON of the quality script, `--tokens`), in kvpress's own
environment (kvpress 0.5.5 needs transformers < 5.3): `--kvpress-run`. The
prefill setting's perplexity and the passkey trials, each press compressing
the prompt during its forward as kvpress does, keeping exactly `budget`
tokens. This module, and everything it imports, imports nothing of
idempotent_moe; its JSON is merged with the library's by `--kvpress-json`
(quality_merge.py)."""

from __future__ import annotations

import math
import time

import torch
import transformers
from transformers import DynamicCache

from .data import load_model
from .provenance import git_commit, version
from .settings import FULL, Lengths
from .steps import generate_answer, mean, nll, passkey_passed


def kvpress_run(data: dict, budgets, presses, settings, log, out=None, first_trial=0,
                lengths: Lengths = FULL):
    """kvpress's presses on the token ids of `data` (a JSON of this script):
    the prefill setting's perplexity and the passkey trials, each press
    compressing the prompt during its forward as kvpress does. Yields the
    results after each unit of work; `out` (an earlier run's) is resumed."""
    import kvpress

    model, tok = load_model(False)
    out = out or {}
    out.update({"kvpress_version": getattr(kvpress, "__version__", None) or version("kvpress"),
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
                prompt, cont = ids_t[:, :lengths.prompt], ids_t[:, lengths.prompt:]
                row = out["prefill"].setdefault(name, {})
                for press_name in ("full", *presses):
                    for budget in (budgets if press_name != "full" else [None]):
                        key = "full" if press_name == "full" else f"{press_name}@{budget}"
                        if key in row:
                            continue
                        t0 = time.time()
                        cache = compressed(prompt, press_name, budget)
                        # positions as kvpress's pipeline gives them, counting on from the prompt
                        pos = torch.arange(lengths.prompt, lengths.prompt + cont.shape[1])[None]
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
