"""The models of M1 and M2: transformers configs with random weights, at the
sizes of docs/results.md#workloads and at a tiny size for the CPU smoke test (--quick)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DECODE_PROMPT, QUICK_DECODE_PROMPT = 128, 8      # prompt tokens before the timed decode
PREFILL_TOKENS, QUICK_PREFILL_TOKENS = 4096, 64  # M1's prefill
INIT_STD = 0.02                                  # N(0, 0.02): transformers' initializer_range


@dataclass(frozen=True)
class Family:
    """One model: `key` (the --families name), a `name` for tables, the
    transformers config class and its arguments, the weights' dtype."""

    key: str
    name: str
    config_class: str
    config: dict = field(hash=False)
    dtype: str


_ATTENTION = dict(num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, eos_token_id=2)
_QUICK_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=256, eos_token_id=2)

MOE_FAMILIES = {
    "mixtral": Family("mixtral", "Mixtral-like", "MixtralConfig", dict(
        num_hidden_layers=8, hidden_size=2048, intermediate_size=7168, num_local_experts=8,
        num_experts_per_tok=2, **_ATTENTION), "bfloat16"),
    "qwen3moe": Family("qwen3moe", "Qwen3-MoE-like", "Qwen3MoeConfig", dict(
        num_hidden_layers=8, hidden_size=2048, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, **_ATTENTION), "bfloat16"),
}
QUICK_MOE_FAMILIES = {
    "mixtral": Family("mixtral", "Mixtral-like (quick)", "MixtralConfig", dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_local_experts=4,
        num_experts_per_tok=2, **_QUICK_ATTENTION), "float32"),
    "qwen3moe": Family("qwen3moe", "Qwen3-MoE-like (quick)", "Qwen3MoeConfig", dict(
        num_hidden_layers=2, hidden_size=64, moe_intermediate_size=32, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, **_QUICK_ATTENTION), "float32"),
}

LLAMA = Family("llama", "Llama-like", "LlamaConfig", dict(
    num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, max_position_embeddings=32768 + 1024,
    **_ATTENTION), "float16")
QUICK_LLAMA = Family("llama", "Llama-like (quick)", "LlamaConfig", dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, max_position_embeddings=2048,
    **_QUICK_ATTENTION), "float32")

# The experts implementations M1 compares: transformers' own by name, ours
# dropless ("idempotent") or in capacity mode ("idempotent-cap1.25").
IMPLS = ("eager", "grouped_mm", "idempotent", "idempotent-cap1.25")
BASELINE = "grouped_mm"
_CAPACITY = re.compile(r"idempotent-cap(\d+(?:\.\d+)?)")


# Options of ours, appended to an "idempotent" name: "+gemm" runs the decode
# GEMMs with the library's grouped_gemm (config.idempotent_small_m_gemm True),
# "+xg" runs both GEMMs on the library's experts_gemm at every size
# (config.idempotent_experts_gemm True), "+router" fuses the routers
# (integrations.fuse_routers). Without them the GEMMs are the default's
# choice (both attributes unset).
OPTIONS = ("gemm", "xg", "router")


@dataclass(frozen=True)
class Impl:
    name: str                       # as given to --impls
    experts_implementation: str     # transformers' name
    capacity_factor: float | None   # capacity mode of "idempotent"
    small_m_gemm: bool = False      # "+gemm"
    experts_gemm: bool = False      # "+xg"
    fused_router: bool = False      # "+router"


def parse_impl(name: str) -> Impl:
    """'eager', 'grouped_mm', 'batched_mm', 'idempotent' or 'idempotent-cap<factor>' (factor > 0),
    the last two with any of OPTIONS appended ('idempotent+gemm+router').

    transformers' generate() runs "grouped_mm" models with "batched_mm" for
    the decode steps on a GPU (GenerationMixin._optimize_model_for_decode):
    the grouped_mm rows' decode figures are batched_mm's."""
    base, *options = name.split("+")
    if name in ("eager", "grouped_mm", "batched_mm"):
        return Impl(name, name, None)
    match = _CAPACITY.fullmatch(base)
    if (base == "idempotent" or (match and float(match[1]) > 0)) and set(options) <= set(OPTIONS) \
            and len(set(options)) == len(options):
        return Impl(name, "idempotent", float(match[1]) if match else None,
                    small_m_gemm="gemm" in options, experts_gemm="xg" in options,
                    fused_router="router" in options)
    raise ValueError(f"unknown experts implementation {name!r}: eager, grouped_mm, batched_mm, idempotent or "
                     "idempotent-cap<factor> (e.g. idempotent-cap1.25), the last two with options "
                     f"{', '.join('+' + o for o in OPTIONS)} (e.g. idempotent+gemm+router)")


def use_impl(model, impl: Impl) -> None:
    """Switch every experts module of `model` (the same weights) to `impl`."""
    from idempotent_moe.integrations import (
        routers_fused,
        set_capacity_factor,
        unfuse_routers,
        use_idempotent_experts,
    )

    if routers_fused(model) and not impl.fused_router:
        unfuse_routers(model)
    if impl.experts_implementation == "idempotent":
        use_idempotent_experts(model, impl.capacity_factor, fuse_routers=impl.fused_router,
                               small_m_gemm=True if impl.small_m_gemm else None,
                               experts_gemm=True if impl.experts_gemm else None)
        _unset_unnamed_options(model, impl)
    else:  # the small-M switch is read by "idempotent" alone
        set_capacity_factor(model, None)
        model.set_experts_implementation(impl.experts_implementation)


def _unset_unnamed_options(model, impl: Impl) -> None:
    """An option the name leaves out is the default's choice: its config
    attribute None (unset) on every config of the model's modules, whatever
    an earlier implementation of the same model set."""
    from idempotent_moe.integrations import EXPERTS_GEMM_ATTR, SMALL_M_GEMM_ATTR

    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    for config in configs.values():
        for attr, named in ((SMALL_M_GEMM_ATTR, impl.small_m_gemm), (EXPERTS_GEMM_ATTR, impl.experts_gemm)):
            if not named:
                setattr(config, attr, None)


def build_model(family: Family, device: str, seed: int = 0):
    """The family's causal LM with N(0, INIT_STD) matrices from a seeded
    generator (norm weights stay 1), in eval mode, on `device`."""
    import torch
    import transformers

    config = getattr(transformers, family.config_class)(**family.config)
    dtype = getattr(torch, family.dtype)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD, generator=g)
    model.generation_config.pad_token_id = config.eos_token_id
    return model.eval()


def describe(family: Family) -> dict:
    """The family's name, config class, arguments and dtype, for the JSON."""
    return {"key": family.key, "name": family.name, "config_class": family.config_class,
            "config": dict(family.config), "dtype": family.dtype}


def random_prompt(batch: int, length: int, vocab: int, device: str, seed: int):
    """[batch, length] token ids, uniform over the vocabulary past the special ids."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).to(device)
