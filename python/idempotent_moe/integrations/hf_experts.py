"""A transformers experts implementation, registered as "idempotent".

transformers (5.x) routes every MoE family that decorates its experts module
with `@use_experts_implementation` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek,
...) through one registry, `ExpertsInterface`: the function named by
`config._experts_implementation` is called as `fn(experts_module,
hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`.

Two modes, chosen by one config attribute, `idempotent_capacity_factor`:

- None (the default): dropless. Every assignment is computed; the result
  matches transformers' eager and grouped_mm implementations.
- a float f > 0: capacity. Each expert keeps at most C = ceil(T * k / E * f)
  assignments, those of highest routing weight (ties to the lower token
  index); the overflow is dropped and adds nothing to the output. The last
  forward's counts are on each experts module (see `capacity_stats`).

    import idempotent_moe.integrations as imoe_hf      # registers "idempotent"
    model.set_experts_implementation("idempotent")      # dropless
    imoe_hf.set_capacity_factor(model, 1.25)            # capacity mode
    imoe_hf.capacity_stats(model)                       # {layer: CapacityStats}
"""

from __future__ import annotations

from typing import NamedTuple

from .._moe_rules import check_capacity_factor

EXPERTS_IMPLEMENTATION = "idempotent"
CAPACITY_FACTOR_ATTR = "idempotent_capacity_factor"
# The config attribute of the small-M GEMM option (_fused.SMALL_M_GEMM_ATTR).
SMALL_M_GEMM_ATTR = "idempotent_small_m_gemm"
# The config attribute that picks the experts' GEMM (_fused.EXPERTS_GEMM_ATTR).
EXPERTS_GEMM_ATTR = "idempotent_experts_gemm"

try:
    import torch
except ImportError:  # the hook works on NumPy arrays without torch; the experts need it
    torch = None
if torch is not None:  # outside the try: their own ImportError (no native part) is not "no torch"
    from . import _dispatch, _fused

    _INDEX_DTYPES = (torch.int32, torch.int64)


class CapacityStats(NamedTuple):
    """One experts module's last forward in capacity mode: `assignments`
    routed to its experts (T * k; under expert parallelism, less those of
    other ranks' experts), the per-expert `capacity` C, and how many were
    `dropped`."""

    assignments: int
    capacity: int
    dropped: int


def idempotent_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "idempotent" experts implementation (signature of transformers'
    ExpertsInterface). `self` is the experts module: its weights
    (gate_up_proj or up_proj, down_proj, optional biases), `num_experts`, the
    layout flags set by `use_experts_implementation` (has_gate, has_bias,
    is_transposed, has_post_expert_norm) and `_apply_gate` / `act_fn`.

    The mode comes from the config attribute `idempotent_capacity_factor`;
    `experts_forward` takes it as an argument. Differentiable (through the
    GEMMs and the routing weights; which assignments a capacity keeps is a
    selection, as in any router).
    """
    factor = check_capacity_factor(getattr(self.config, CAPACITY_FACTOR_ATTR, None), CAPACITY_FACTOR_ATTR)
    return experts_forward(self, hidden_states, top_k_index, top_k_weights, factor)


def experts_forward(self, hidden_states, top_k_index, top_k_weights, capacity_factor=None):
    """`idempotent_experts_forward` with the mode given: `capacity_factor`
    None (dropless) or a checked factor > 0 (capacity mode).

    Expert parallelism (transformers' EP): ids >= num_experts name another
    rank's experts and come with weight 0; they add nothing, in both modes.

    TypeError / ValueError (check_inputs), before anything is allocated, for
    arguments no path takes; the routing's values (ids out of range, a
    token naming one expert twice) are judged by the path that reads them,
    also before anything is allocated: on CPU tensors a ValueError.
    """
    check_inputs(hidden_states, top_k_index, top_k_weights)
    if top_k_index.shape[0] == 0:
        self.idempotent_stats = None
        return torch.zeros_like(hidden_states)
    if _fused.applies(self, hidden_states):  # the library's dispatch and combine kernels
        return _fused.experts_forward(self, hidden_states, top_k_index, top_k_weights, capacity_factor)
    if capacity_factor is None:
        self.idempotent_stats = None
        return _dispatch.dropless_forward(self, hidden_states, top_k_index, top_k_weights)
    result = _dispatch.capacity_forward(self, hidden_states, top_k_index, top_k_weights, capacity_factor)
    # Kept on the device: reading the count (capacity_stats) is what synchronises.
    self.idempotent_stats = (result.assignments, result.capacity, result.dropped)
    return result.output


def check_inputs(hidden_states, top_k_index, top_k_weights) -> None:
    """What every path of the implementation needs of its arguments: torch
    tensors (TypeError), hidden_states [T, H] and top_k_index, top_k_weights
    [T, k] (ValueError), hidden_states and top_k_weights floating point,
    top_k_index int32 or int64 (TypeError)."""
    tensor = torch.Tensor
    if not (isinstance(hidden_states, tensor) and isinstance(top_k_index, tensor)
            and isinstance(top_k_weights, tensor)):
        for name, t in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                        ("top_k_weights", top_k_weights)):
            if not isinstance(t, tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shape = top_k_index.shape
    if hidden_states.dim() != 2 or len(shape) != 2 or shape[0] != hidden_states.shape[0] \
            or top_k_weights.shape != shape:
        raise ValueError(f"hidden_states must be [T, H] and top_k_index, top_k_weights [T, k], got "
                         f"hidden_states {list(hidden_states.shape)}, top_k_index {list(shape)}, "
                         f"top_k_weights {list(top_k_weights.shape)}")
    if top_k_index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if not (hidden_states.is_floating_point() and top_k_weights.is_floating_point()):
        raise TypeError(f"hidden_states and top_k_weights must be floating point, got "
                        f"{hidden_states.dtype} and {top_k_weights.dtype}")


def register(name: str = EXPERTS_IMPLEMENTATION) -> None:
    """Register the implementation with transformers' ExpertsInterface under
    `name`, so that `model.set_experts_implementation(name)` and
    `from_pretrained(..., experts_implementation=name)` accept it. Idempotent
    itself; `import idempotent_moe.integrations` calls it when transformers is
    installed."""
    if torch is None:
        raise ImportError("the transformers experts implementation needs torch")
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError(
            "registering the 'idempotent' experts implementation needs transformers >= 5.17 "
            "(its ExpertsInterface): pip install 'transformers>=5.17'"
        ) from e
    ExpertsInterface.register(name, idempotent_experts_forward)
    # Compiling a dtype grouped_mm cannot trace (anything but bf16) uses
    # transformers' own compile-safe loop, as its grouped_mm path does.
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        _dispatch.COMPILED_FALLBACK = fallback


def _experts_modules(model) -> list:
    """The experts modules that dispatch through transformers' ExpertsInterface
    (those that `use_experts_implementation` decorated)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "config") and hasattr(m, "is_transposed") and hasattr(m, "num_experts")]


def set_capacity_factor(model, capacity_factor: float | None) -> None:
    """Choose the mode of the "idempotent" implementation for every experts
    module of `model`: None for dropless, a factor f > 0 for capacity mode
    (C = ceil(T * k / E * f) per expert and forward). Stored as the config
    attribute `idempotent_capacity_factor` (saved by save_pretrained)."""
    factor = check_capacity_factor(capacity_factor, CAPACITY_FACTOR_ATTR)
    for config in _configs(model, _required_experts(model)):
        setattr(config, CAPACITY_FACTOR_ATTR, factor)


def _required_experts(model) -> list:
    """_experts_modules(model): TypeError unless model is a torch module,
    ValueError when it has no experts module."""
    if torch is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    modules = _experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no experts module that uses transformers' "
                         "experts interface (@use_experts_implementation)")
    return modules


def _configs(model, modules) -> list:
    """The configs of the experts modules and the model's, each once."""
    configs = {id(m.config): m.config for _, m in modules}
    if hasattr(model, "config"):
        configs[id(model.config)] = model.config
    return list(configs.values())


def use_idempotent_experts(model, capacity_factor: float | None = None, *, fuse_routers: bool = False,
                           small_m_gemm: bool | None = None, experts_gemm: bool | None = None):
    """Switch `model` to the "idempotent" experts implementation, dropless
    (capacity_factor None) or with capacity `capacity_factor`. Returns model.

    fuse_routers  also fuse the model's routers (integrations.fuse_routers:
                  Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; TypeError for others,
                  with nothing changed).
    small_m_gemm  True/False sets `idempotent_small_m_gemm` on the experts'
                  configs: the library's grouped GEMM up to 4 rows per
                  expert / never; None leaves it as it is.
    experts_gemm  True/False sets `idempotent_experts_gemm` on the experts'
                  configs: the library's tensor-core experts GEMM (reads the
                  tokens where they lie, the gated activation in its
                  epilogue) always / never where its kernel takes the
                  weights (CUDA, float16/bfloat16, eager); None leaves it
                  as it is.
    Unset, the fused path picks the GEMMs by rows per expert (docs/moe.md,
    "Which GEMMs run"); their rounding is not grouped_mm's below 64 rows
    per expert."""
    for name, value in (("small_m_gemm", small_m_gemm), ("experts_gemm", experts_gemm)):
        if value is not None and type(value) is not bool:
            raise TypeError(f"{name} must be True, False or None, not {value!r}")
    if type(fuse_routers) is not bool:
        raise TypeError(f"fuse_routers must be True or False, not {fuse_routers!r}")
    factor = check_capacity_factor(capacity_factor, CAPACITY_FACTOR_ATTR)
    modules = _required_experts(model)
    register()
    if fuse_routers:
        from .hf_router import fuse_routers as fuse

        fuse(model)  # checks every router before it changes one
    set_capacity_factor(model, factor)
    for attr, value in ((SMALL_M_GEMM_ATTR, small_m_gemm), (EXPERTS_GEMM_ATTR, experts_gemm)):
        if value is not None:
            for config in _configs(model, modules):
                setattr(config, attr, value)
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return model


def capacity_stats(model) -> dict:
    """{experts module name: CapacityStats} for the modules whose last forward
    ran in capacity mode. Reading the counts synchronises with the device."""
    stats = {}
    for name, module in _experts_modules(model):
        record = getattr(module, "idempotent_stats", None)
        if record is not None:
            assignments, capacity, dropped = record
            stats[name] = CapacityStats(int(assignments), capacity, int(dropped))
    return stats
