"""A compiled decode step's guards: one M1 model's forward compiled by
torch.compile over a StaticCache, run for two decode steps, and the guard
manager dynamo made for it, with the frame the next step would bring (for
checking the guards directly: benchmarks/scripts/guard_check.py; for reading them:
the guard tests)."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

from .model_families import Family, build_model, parse_impl, use_impl

PROMPT = 4  # tokens in the cache before the compiled steps


class CompiledStep(NamedTuple):
    guards: Any       # the step's guard manager (str() prints the guards)
    f_locals: dict    # the frame of the next step: check(f_locals) passes while nothing changed
    model: Any


def frame_locals(fn, *args, **kwargs) -> dict:
    """The locals a call fn(*args, **kwargs) starts its frame with: the bound
    arguments and the closure's cells (a decorated forward's wrapper reads
    the function it wraps)."""
    bound = inspect.signature(fn, follow_wrapped=False).bind(*args, **kwargs)
    bound.apply_defaults()
    f_locals = dict(bound.arguments)
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        f_locals[name] = cell.cell_contents
    return f_locals


def compiled_step(family: Family, impl: str, device: str) -> CompiledStep:
    """The family's model (seeded weights) switched to `impl`, a prompt in a
    StaticCache, its forward compiled (backend "eager": dynamo's guards do
    not depend on the backend) and run for two decode steps (no gradient).
    The guards are those of the newest compiled entry of the forward."""
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from transformers import StaticCache

    model = build_model(family, device)
    use_impl(model, parse_impl(impl))
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + 4)
    # The cache's keyword: `cache` from transformers 5.2x, `past_key_values` before.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kw = {name: cache, "use_cache": True}
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT + 3),
                        generator=torch.Generator().manual_seed(0)).to(device)
    step = torch.compile(model.forward, backend="eager")
    with torch.no_grad():
        model(ids[:, :PROMPT], cache_position=torch.arange(PROMPT, device=device), **kw)
        for pos in (PROMPT, PROMPT + 1):
            step(ids[:, pos:pos + 1], cache_position=torch.tensor([pos], device=device), **kw)
    forward = type(model).forward
    entry = _debug_get_cache_entry_list(forward.__code__)[0]  # the newest
    pos = PROMPT + 2
    return CompiledStep(entry.guard_manager, frame_locals(
        forward, model, ids[:, pos:pos + 1], cache_position=torch.tensor([pos], device=device), **kw), model)
