"""idempotent-moe: in-place MoE token dropping and KV-cache eviction.

Buffers are compacted where they are, with an idempotent map: kept tokens
below the capacity stay, each kept token beyond it is paired with a dropped
slot below it, and all pairs move at once, bit-exact, with no scratch buffer.
Takes torch tensors, NumPy arrays and any DLPack producer; `import
idempotent_moe` needs neither torch nor transformers, and registers the
"idempotent" experts implementation with transformers when (and if) that
is imported, before or after.
"""

from ._hf_registration import register_when_transformers_loads
from .functional import (
    Compacted,
    Grouped,
    apply_map_,
    check_errors,
    compact_,
    cuda_available,
    cuda_compiled,
    get_num_threads,
    group_by_expert_,
    idempotent_map,
    permute_,
    plan_workspace_elems,
    restore_,
    set_num_threads,
    ungroup_,
)
from .kv import InplaceKVCompactor, compact_kv_cache_inplace, reduce_head_scores
from .moe import (
    InplaceMoERouter,
    MoEDispatch,
    compact_moe_tokens_inplace,
    gated_act,
    generate_idempotent_moe_map,
    grouped_gemm,
    moe_combine,
    moe_dispatch,
    topk_softmax,
)
from .paged import PagedCompaction, apply_paged_map_, compact_paged_, paged_target_map

register_when_transformers_loads()
del register_when_transformers_loads

__version__ = "0.1.0"

__all__ = [
    "Compacted",
    "Grouped",
    "InplaceKVCompactor",
    "InplaceMoERouter",
    "MoEDispatch",
    "PagedCompaction",
    "apply_map_",
    "apply_paged_map_",
    "check_errors",
    "compact_",
    "compact_kv_cache_inplace",
    "compact_moe_tokens_inplace",
    "compact_paged_",
    "cuda_available",
    "cuda_compiled",
    "gated_act",
    "generate_idempotent_moe_map",
    "get_num_threads",
    "group_by_expert_",
    "grouped_gemm",
    "idempotent_map",
    "moe_combine",
    "moe_dispatch",
    "paged_target_map",
    "permute_",
    "plan_workspace_elems",
    "reduce_head_scores",
    "restore_",
    "set_num_threads",
    "topk_softmax",
    "ungroup_",
]
