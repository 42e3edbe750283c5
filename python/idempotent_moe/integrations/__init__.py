"""Integrations with model frameworks.

KV caches:
- `VLLMInplaceCompactionHook`: in-place eviction for dense or paged caches.
- `InplaceEvictionCache` (+ `EvictionPolicy`): a transformers Cache for
  generate() that evicts in place down to a budget (loaded on first use).

Hugging Face MoE:
- `HuggingFaceMoEInplaceHook`: expert-capacity dropping in place on
  per-expert buffers (the original API's two call forms), differentiable.
- the "idempotent" experts implementation for transformers: `import
  idempotent_moe` registers it with transformers' ExpertsInterface when that
  is imported (and importing this package does, when transformers is
  installed), so that `model.set_experts_implementation("idempotent")` and
  `from_pretrained(..., experts_implementation="idempotent")` work.
  `set_capacity_factor` picks capacity mode, `capacity_stats` reads the drops.
- `fuse_routers` / `unfuse_routers`: the routers of Mixtral, Qwen2/3-MoE and
  OLMoE as one fused softmax + top-k kernel on CUDA (loaded on first use).

`import idempotent_moe` does not import this package, nor transformers.
"""

import importlib.util
import warnings

from ..moe import InplaceMoERouter
from .hf_experts import (
    CAPACITY_FACTOR_ATTR,
    EXPERTS_GEMM_ATTR,
    EXPERTS_IMPLEMENTATION,
    SMALL_M_GEMM_ATTR,
    CapacityStats,
    capacity_stats,
    idempotent_experts_forward,
    set_capacity_factor,
    use_idempotent_experts,
)
from .hf_hook import HuggingFaceMoEInplaceHook, SlotDispatch
from .vllm import VLLMInplaceCompactionHook

# The Hugging Face eviction cache subclasses transformers' Cache: it is loaded
# on first use, so that this package does not need transformers.
_HF_CACHE = ("EvictionPolicy", "InplaceEvictionCache", "InplaceEvictionLayer")
# The fused router needs torch: loaded on first use too.
_HF_ROUTER = ("SUPPORTED_ROUTERS", "fuse_routers", "routers_fused", "unfuse_routers")


def __getattr__(name: str):
    if name in _HF_CACHE:
        from . import hf_cache

        return getattr(hf_cache, name)
    if name in _HF_ROUTER:
        from . import hf_router

        return getattr(hf_router, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CAPACITY_FACTOR_ATTR",
    "SMALL_M_GEMM_ATTR",
    "EXPERTS_GEMM_ATTR",
    "EXPERTS_IMPLEMENTATION",
    "CapacityStats",
    "EvictionPolicy",
    "HuggingFaceMoEInplaceHook",
    "InplaceEvictionCache",
    "InplaceEvictionLayer",
    "InplaceMoERouter",
    "SUPPORTED_ROUTERS",
    "SlotDispatch",
    "VLLMInplaceCompactionHook",
    "capacity_stats",
    "fuse_routers",
    "idempotent_experts_forward",
    "register",
    "routers_fused",
    "set_capacity_factor",
    "unfuse_routers",
    "use_idempotent_experts",
]


def register(name: str = EXPERTS_IMPLEMENTATION) -> None:
    """Register "idempotent" with transformers: the experts implementation
    (its ExpertsInterface), so that `model.set_experts_implementation(name)`
    and `from_pretrained(..., experts_implementation=name)` accept it, and,
    where transformers has expert parallelism, the EP implementation of the
    same name (`DistributedConfig(ep_implementation=name)`). Idempotent
    itself; `import idempotent_moe` calls it once transformers is imported."""
    from . import hf_expert_parallel, hf_experts

    hf_experts.register(name)
    hf_expert_parallel.register(name)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # e.g. sys.modules[name] is None
        return False


def _register_if_installed() -> None:
    if not (_installed("torch") and _installed("transformers")):
        return
    try:
        register()
    except ImportError as e:  # an older transformers: the hook still works
        warnings.warn(f"idempotent_moe: the 'idempotent' experts implementation was not registered: {e}",
                      stacklevel=2)


_register_if_installed()
