"""Q1's scoring cost, memory (`--settings memory`): the bytes of the K and V
tensors the cache holds (distinct storages), sampled at the end of every
attention layer's forward, before and after its compression (hooks
registered around the library's or kvpress's own), during one 2,048-token
prefill; the peak is the largest sample. The transient buffer of a layer's
compaction (the library's steady buffer, kvpress's gathered copy, each at
most budget + 128 tokens of one layer) is not sampled. On a GPU, also the
peak of torch's CUDA allocations during the prefill, above what was
allocated before it (the K/V, activations and the compactions' transient
buffers). Imports the library's half or kvpress only to run it."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .steps import forward


def public_tensors(layer) -> tuple:
    """A transformers cache layer's K and V."""
    return getattr(layer, "keys", None), getattr(layer, "values", None)


def kv_bytes(cache, tensors_of=public_tensors) -> int:
    """Bytes of the distinct storages behind the K and V tensors a cache
    holds (`tensors_of(layer)` gives them)."""
    seen, total = set(), 0
    for layer in cache.layers:
        for t in tensors_of(layer):
            if isinstance(t, torch.Tensor) and t.numel():
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
    return total


def memory_run(model, ids, lib: str, policy: str, budget: int | None) -> dict:
    """Peak K/V bytes of one prefill, sampled before and after each layer's
    compression; on a GPU also the peak of torch's allocations during it,
    above what was allocated before (see the module's docstring)."""
    samples = []
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
               and hasattr(m, "num_key_value_groups")]
    hooks = []

    def sample(*_):
        samples.append(kv_bytes(cache, tensors_of))

    def hook_all():
        return [m.register_forward_hook(sample) for m in modules]

    press, tensors_of = None, public_tensors
    if lib == "library":  # its layers' whole buffers, not only the published views
        from imoe_bench.internals import kv_layer_tensors as tensors_of
    if policy == "full":
        cache = DynamicCache(config=model.config) if lib == "library" else DynamicCache()
    elif lib == "library":
        from .cost_library import lib_prefill_cache

        cache = lib_prefill_cache(model, policy, budget)
    else:
        import kvpress

        cache = DynamicCache()
        press = getattr(kvpress, policy)(compression_ratio=1 - (budget + 0.5) / ids.shape[1])
    if ids.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        hooks += hook_all()  # before the compression's own hook
        with torch.no_grad():
            if press is not None:
                with press(model):
                    hooks += hook_all()  # after it
                    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            else:
                if lib == "library" and policy != "full":
                    cache.attach(model)
                    hooks += hook_all()
                forward(model, ids, cache, keep=1)
    finally:
        for h in hooks:
            h.remove()
        if lib == "library" and policy != "full":
            cache.detach()
    out = {"lib": lib, "policy": policy, "budget": budget, "peak_kv_bytes": max(samples),
           "final_kv_bytes": kv_bytes(cache, tensors_of)}
    if ids.is_cuda:
        torch.cuda.synchronize()
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    return out
