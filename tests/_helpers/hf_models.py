"""Tiny transformers models and experts modules, built from configs with
random weights (no download), and the plain references the integration
tests compare against. Import it after `pytest.importorskip("transformers")`."""

from __future__ import annotations

import inspect

import torch
import transformers
from idempotent_moe import integrations as hf

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
              pad_token_id=0, bos_token_id=None, eos_token_id=None)
FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"]


def moe_config(family: str, **overrides):
    """The two-layer config of `family` (COMMON with `overrides`). Mixtral
    routes top-2 of 8, Qwen3-MoE top-3 of 8 (more than two terms per token in
    the combine), "qwen3_moe_plain" top-4 of 60 without renormalisation,
    OLMoE and GPT-OSS top-2 of 8 (GPT-OSS: transposed weights, biases, an
    interleaved gate of its own)."""
    common = dict(COMMON, **overrides)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=8,
                                          num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                           head_dim=8, num_experts=8, num_experts_per_tok=3,
                                           norm_topk_prob=True)
    if family == "qwen3_moe_plain":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                           head_dim=8, num_experts=60, num_experts_per_tok=4,
                                           norm_topk_prob=False)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=24, num_experts=8, num_experts_per_tok=2)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, intermediate_size=24, head_dim=8, num_local_experts=8,
                                         num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    raise ValueError(family)


_CAUSAL_LM = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "qwen3_moe_plain": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
              "gpt_oss": "GptOssForCausalLM"}


def moe_model(family: str, seed: int = 0, **overrides):
    """A random causal LM of moe_config(family, **overrides) in fp32, seeded
    with torch.manual_seed(seed), as torch builds it (train mode)."""
    torch.manual_seed(seed)
    return getattr(transformers, _CAUSAL_LM[family])(moe_config(family, **overrides))


def tiny_model(family: str, seed: int = 0):
    """moe_model in eval mode, GPT-OSS's biases drawn from N(0, 0.2)."""
    model = moe_model(family, seed)
    if family == "gpt_oss":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_bias"):
                    p.normal_(0.0, 0.2)
    return model.eval()


def token_ids(batch: int, length: int, seed: int = 1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids, implementation: str):
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(ids).logits


def experts_modules(model) -> list:
    return [m for _, m in hf.hf_experts._experts_modules(model)]


# The keyword that hands a cache to forward() and generate(): transformers 5.24
# renamed past_key_values (deprecated there, a FutureWarning) to cache.
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters \
    else "past_key_values"


def tiny_llama(attn="sdpa", kv_heads=2, layers=2, seed=0):
    """(model, config): a random Llama in eval mode with 4 query heads."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=kv_heads, max_position_embeddings=1024)
    config._attn_implementation = attn
    return transformers.LlamaForCausalLM(config).eval(), config


# --------------------------------------------------------------------------- experts modules


def standalone_experts(num_experts=8, hidden=16, intermediate=24, seed=0):
    """A MixtralExperts module with N(0, 0.3) weights, outside any model."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=hidden, intermediate_size=intermediate,
                                        num_local_experts=num_experts, num_experts_per_tok=2)
    config._experts_implementation = "idempotent"
    experts = MixtralExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return experts


def skewed_routing(num_tokens, num_experts, top_k, seed=0, ties=False):
    """top-k routing that overloads the first experts; with `ties`, weights
    from a few values so that many assignments tie."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.linspace(2.0, 0.0, num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=g) + bias
    index = torch.topk(logits, top_k, dim=-1).indices
    if ties:
        weights = torch.tensor([0.25, 0.5, 0.75])[torch.randint(0, 3, index.shape, generator=g)]
    else:
        weights = torch.rand(index.shape, generator=g) + 0.05
    return index, weights


def run_experts(experts, hidden, index, weights, implementation, capacity_factor=None):
    experts.config._experts_implementation = implementation
    setattr(experts.config, hf.CAPACITY_FACTOR_ATTR, capacity_factor)
    return experts(hidden, index, weights)


def experts_grads(experts, hidden, index, weights, implementation, factor=None):
    """(output, d hidden, d weights, d gate_up_proj, d down_proj) of one
    backward of a fixed linear function of the experts' output."""
    hidden = hidden.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    experts.zero_grad()
    out = run_experts(experts, hidden, index, weights, implementation, factor)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out, hidden.grad, weights.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()


def compiled_experts(experts, factor):
    """The experts forward with a fixed capacity factor, as torch.compile takes it."""
    def forward(hidden, index, weights):
        return hf.hf_experts.experts_forward(experts, hidden, index, weights, factor)

    return forward


# --------------------------------------------------------------------------- references


def expert_mlp(experts, x, e):
    """Expert e's MLP on x [n, H], as transformers' eager experts compute it."""
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])


def capacity_reference(experts, hidden, index, weights, capacity):
    """Straightforward capacity dropping: per expert, its assignments sorted by
    descending weight, ties to the lower token; the first C kept, the rest
    dropped. Returns (output [T, H], dropped count, {expert: kept tokens})."""
    out = torch.zeros_like(hidden)
    dropped, kept_sets = 0, {}
    for e in range(experts.num_experts):
        tokens, slots = torch.where(index == e)
        w = weights[tokens, slots]
        order = sorted(range(len(tokens)), key=lambda i: (-float(w[i].detach()), int(tokens[i])))
        keep = order[:capacity]
        dropped += len(order) - len(keep)
        kept_sets[e] = sorted(int(tokens[i]) for i in keep)
        if keep:
            keep = torch.tensor(keep, dtype=torch.long)
            y = expert_mlp(experts, hidden[tokens[keep]], e) * w[keep, None]
            out = out.index_add(0, tokens[keep], y)
    return out, dropped, kept_sets


# --------------------------------------------------------------------------- W4 blocks on CUDA


def cuda_block(hidden, intermediate, dtype, seed=0):
    """A W4 MoE block (8 experts, top-2) on CUDA."""
    from imoe_bench import w4

    return w4.build_block(w4.Block(hidden, intermediate, 8, 2, (), dtype), "cuda", seed)


def block_output(block, x, implementation, factor=None):
    from imoe_bench import w4

    w4._use(block, implementation, factor)
    with torch.no_grad():
        return block(x)
