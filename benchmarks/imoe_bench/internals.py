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
  scripts/host_cost_floor.py times each step of compact_'s Python path.
These names are the library's internals and may change with it."""

from idempotent_moe import _arrays, _compaction, _tracing
from idempotent_moe._native import native
from idempotent_moe._sorting import counting_sort

dlpack_stream = _arrays.dlpack_stream


def fuse_routers_on_cpu() -> None:
    """Route CPU tensors through the fused routers' forward too (the
    integrations' own switch, which the tests set the same way)."""
    from idempotent_moe.integrations import hf_router

    hf_router._FUSED_ON_CPU = True

__all__ = ["_arrays", "_compaction", "_tracing", "counting_sort", "dlpack_stream", "fuse_routers_on_cpu",
           "native"]
