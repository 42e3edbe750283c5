"""The fused router for transformers MoE models: `fuse_routers(model)`.

transformers' routers (5.17 to 5.24) compute, per token, `logits =
F.linear(hidden, weight)`, `softmax(logits, dtype=float)`, `topk`, an
optional division by the top-k sum, and return `(router_logits, weights,
indices)`. `fuse_routers` replaces the forward of each such router by
torch's own linear for the logits and one `topk_softmax` kernel for the
rest (torch's CUDA arithmetic, so the same tuple bit for bit). It is meant
for inference next to the "idempotent" experts:

    import idempotent_moe.integrations as imoe_hf
    model.set_experts_implementation("idempotent")
    imoe_hf.fuse_routers(model)       # imoe_hf.unfuse_routers(model) undoes it

The fused forward runs only on CUDA tensors with no gradient recorded;
anywhere else (the CPU, training) the original forward runs.

A router is fused by its class: it becomes an instance of a subclass of its
own class (same name, `forward` replaced), made once per router class. No
module gains a per-instance attribute, so torch.compile guards a fused model
as it guards the original one (a bound method in a module's __dict__ costs
two identity guards per layer at every compiled step). A fused router
pickles as its original class: it loads unfused (copy.copy and
copy.deepcopy keep it fused). A per-instance forward
wrapper installed before fusing (accelerate's hooks) is kept, and calls the
forward it wrapped.
"""

from __future__ import annotations

import copy
import copyreg
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .. import moe

# A fused router class carries `_idempotent_fused_from` (the class it was made
# from) and its SUPPORTED_ROUTERS entry as two plain values,
# `_idempotent_renormalize` and `_idempotent_cast`, read through the instance
# by the fused forward. torch.compile takes a str, a bool or None as a
# constant; an object (the entry itself) reached from each layer's router
# would cost an identity guard per layer (torch 2.11) at every step.
_fused_classes: dict = {}  # router class -> its fused subclass

# The fused forward runs on CUDA; elsewhere the original forward runs (torch's
# CPU softmax differs from the kernel's in the last bits), unless this is set:
# tests route the CPU through the fused forward to read its guards.
_FUSED_ON_CPU = False


class _RouterFamily(NamedTuple):
    renormalize: str | None  # the attribute that says whether to renormalise; None: always
    cast: bool  # weights in the logits' dtype (else fp32)


# The routers whose forward is softmax + top-k [+ renormalisation], by class name.
SUPPORTED_ROUTERS = {
    "MixtralTopKRouter": _RouterFamily(None, False),
    "Qwen2MoeTopKRouter": _RouterFamily("norm_topk_prob", True),
    "Qwen3MoeTopKRouter": _RouterFamily("norm_topk_prob", True),
    "OlmoeTopKRouter": _RouterFamily("norm_topk_prob", True),
}


def fused_route(router: torch.nn.Module, hidden_states, family: _RouterFamily | None = None):
    """What a fused router returns, on any device: (router_logits, weights,
    indices) with the original forward's shapes and dtypes. `family`: the
    router's entry of SUPPORTED_ROUTERS (by its class name when None)."""
    if family is None:
        family = SUPPORTED_ROUTERS[type(router).__name__]
    return _route(router, hidden_states, family.renormalize, family.cast)


def _route(router: torch.nn.Module, hidden_states, renormalize_attr: str | None, cast: bool):
    """fused_route with the family's two values (see _RouterFamily)."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight)
    renormalize = True if renormalize_attr is None else bool(getattr(router, renormalize_attr))
    weights, indices = moe.topk_softmax(
        router_logits, router.top_k, renormalize=renormalize,
        out_dtype=router_logits.dtype if cast else torch.float32)
    return router_logits, weights, indices


def _fused_forward(self, hidden_states):
    recording = torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)
    if not (hidden_states.is_cuda or _FUSED_ON_CPU) or recording:
        return self._idempotent_fused_from.forward(self, hidden_states)
    # Class attributes read through self, not type(self): under torch.compile
    # each layer's type(...) would add an identity guard checked at every step.
    return _route(self, hidden_states, self._idempotent_renormalize, self._idempotent_cast)


def _reduce_as_original(self, protocol):
    """A fused router pickles as an instance of its original class, through
    the reconstructor pickle itself uses for protocols 0 and 1 (no reference
    to this library in the pickle)."""
    return copyreg._reconstructor, (self._idempotent_fused_from, object, None), self.__getstate__()


def _copy_fused(self):
    """copy.copy keeps the fused class (pickling alone drops it)."""
    copied = type(self).__new__(type(self))
    copied.__setstate__(self.__getstate__())
    return copied


def _deepcopy_fused(self, memo):
    """copy.deepcopy keeps the fused class (pickling alone drops it)."""
    copied = type(self).__new__(type(self))
    memo[id(self)] = copied
    copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
    return copied


def _fused_class(cls: type) -> type:
    """The fused subclass of router class `cls`, made once."""
    fused = _fused_classes.get(cls)
    if fused is None:
        fused = type(cls.__name__, (cls,), {
            "forward": _fused_forward, "__reduce_ex__": _reduce_as_original, "__copy__": _copy_fused,
            "__deepcopy__": _deepcopy_fused, "_idempotent_fused_from": cls,
            "_idempotent_renormalize": SUPPORTED_ROUTERS[cls.__name__].renormalize,
            "_idempotent_cast": SUPPORTED_ROUTERS[cls.__name__].cast,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__qualname__} with the fused forward of idempotent_moe.fuse_routers."})
        _fused_classes[cls] = fused
    return fused


def _is_fused(module: Any) -> bool:
    return "_idempotent_fused_from" in type(module).__dict__


def _is_router(module: Any) -> bool:
    name = type(module).__name__
    return name in SUPPORTED_ROUTERS or name.endswith("Router")


def fuse_routers(model: torch.nn.Module) -> int:
    """Replace the forward of every router of `model` by the fused one (see
    the module's docstring); returns how many were fused. Every module whose
    class name ends in "Router" must be one of SUPPORTED_ROUTERS, else
    TypeError and nothing changes. Fusing twice is harmless."""
    routers = [m for m in model.modules() if _is_router(m)]
    unknown = sorted({type(m).__name__ for m in routers} - set(SUPPORTED_ROUTERS))
    if unknown:
        raise TypeError(f"fuse_routers: router class(es) {', '.join(unknown)} are not supported; "
                        f"supported: {', '.join(sorted(SUPPORTED_ROUTERS))}")
    if not routers:
        raise ValueError(f"fuse_routers: {type(model).__name__} has no router module; "
                         f"supported: {', '.join(sorted(SUPPORTED_ROUTERS))}")
    for m in routers:
        if not _is_fused(m):
            m.__class__ = _fused_class(type(m))
    return len(routers)


def unfuse_routers(model: torch.nn.Module) -> int:
    """Give every fused router of `model` its original class (and forward)
    back; returns how many were restored."""
    count = 0
    for m in model.modules():
        if _is_fused(m):
            m.__class__ = m._idempotent_fused_from
            count += 1
    return count


def routers_fused(model: torch.nn.Module) -> bool:
    """Whether any router of `model` is fused."""
    return any(_is_fused(m) for m in model.modules())
