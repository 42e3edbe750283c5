"""The one door from the lab to idempotent_moe's private layers.

Every other module of the lab and every script uses the library's public
names only (benchmarks/tests/test_lab_imports.py holds them to it). A few
measurements time a layer below the public API on purpose, and only those
come through here:
- `native` (the compiled binding) and `dlpack_stream`: H1's row "the core's
  call alone" and the kernel timers of scripts/moe_combine_cuda.py and
  scripts/moe_gemm_cuda.py time the binding without the Python wrapper, to
  split host cost between the wrapper and the core;
- `counting_sort`: scripts/counting_sort_cuda.py times the library's sort
  beside torch's;
- `fuse_routers_on_cpu`: scripts/guard_check.py runs the fused routers on
  the CPU (they run on CUDA only otherwise), to count a CPU step's guards;
- `_compaction` (compact_'s direct path) and `_tracing`'s compiling check:
  scripts/host_cost_floor.py times each step of compact_'s Python path;
- `KV_TIMED_STEPS` and `kv_layer_tensors`: Q1's scoring cost (q1/cost_library.py,
  q1/cost_memory.py) times InplaceEvictionLayer's private steps by wrapping
  them, and reads the K and V storage a layer of the cache holds.
These names are the library's internals and may change with it."""

from idempotent_moe import _arrays, _compaction, _tracing
from idempotent_moe._native import native
from idempotent_moe._sorting import counting_sort
from idempotent_moe.integrations.hf_cache import InplaceEvictionCache, InplaceEvictionLayer

dlpack_stream = _arrays.dlpack_stream


def fuse_routers_on_cpu() -> None:
    """Route CPU tensors through the fused routers' forward too (the
    integrations' own switch, which the tests set the same way)."""
    from idempotent_moe.integrations import hf_router

    hf_router._FUSED_ON_CPU = True


# (class, private method, timer label, the argument that is the layer or its
# attention module): the eviction's judging and scoring, its in-place
# compaction, and the statistics the cache keeps during a forward.
KV_TIMED_STEPS = (
    (InplaceEvictionLayer, "_eviction", "score", 0),
    (InplaceEvictionLayer, "_compact", "compact", 0),
    (InplaceEvictionLayer, "accumulate_attention", "stats", 0),
    (InplaceEvictionCache, "_query_hook", "stats", 1),
)


def kv_layer_tensors(layer) -> tuple:
    """The K and V tensors a cache layer holds: InplaceEvictionLayer's own
    buffers, or a transformers layer's `keys` and `values`."""
    if isinstance(layer, InplaceEvictionLayer):
        return layer._k, layer._v
    return getattr(layer, "keys", None), getattr(layer, "values", None)


__all__ = ["KV_TIMED_STEPS", "_arrays", "_compaction", "_tracing", "counting_sort", "dlpack_stream",
           "fuse_routers_on_cpu", "kv_layer_tensors", "native"]
