"""The model steps both halves of Q1 take (the library's and kvpress's):
a forward through a cache, the per-token losses, the greedy answer of a
passkey trial and its verdict. Nothing here imports idempotent_moe."""

from __future__ import annotations

import inspect
import time

import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def mean(xs):
    return sum(xs) / len(xs)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1).to(logits.device), reduction="none")


def forward(model, ids, cache, keep=0):
    # transformers 5.24 renamed forward()'s past_key_values to cache
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=ids.to(model.device), **{arg: cache}, use_cache=True,
                 logits_to_keep=keep).logits


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
