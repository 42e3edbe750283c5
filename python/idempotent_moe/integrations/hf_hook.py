"""HuggingFaceMoEInplaceHook: expert-capacity dropping in place, with the two
call forms of the original API, and gradients that flow through the compaction.

    hook = HuggingFaceMoEInplaceHook(capacity=2048)
    kept, idx = hook(expert_inputs, gating_weights, return_indices=True)

    hook = HuggingFaceMoEInplaceHook(hidden_dim=1024, num_experts=8, top_k=2)
    kept = hook.forward(hidden_states, router_logits, capacity=512)

Autograd: a swap compaction is a permutation made of disjoint exchanges, so
its own inverse: the gradient of the compacted buffer is sent back to the
original slots by applying the same exchanges to it (`restore_`). When the
buffer requires grad (and grad mode is on), the hook compacts it inside an
autograd Function that marks it modified in place and does exactly that in
backward. Selection itself has no gradient: scores are read, never
differentiated (the routing weights get their gradient where the caller uses
them). Leaf tensors that require grad cannot be changed in place, and move
mode (not a permutation) has no such backward: both are refused.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from .. import _arrays
from .._moe_rules import check_expert_buffer, combine_slots, expert_scores
from ..functional import apply_map_, compact_, idempotent_map, restore_


class SlotDispatch(NamedTuple):
    """What `HuggingFaceMoEInplaceHook.forward(..., return_indices=True)`
    returns: expert_inputs [E, C, D] (a view into the dispatch buffer),
    indices [E, C] (the token in each slot) and weights [E, C] (its routing
    weight; 0 where an expert with fewer than C tokens holds an unrouted one)."""

    expert_inputs: Any
    indices: Any
    weights: Any


def _torch():
    import torch

    return torch


_compact_swap = None  # the autograd Function, once built


def _compact_function():
    """The autograd Function, built on first use so that torch stays optional.
    Kept in a module global (not functools.cache, whose wrapped body
    torch.compile would trace, class statement and all, at every compile)."""
    global _compact_swap
    if _compact_swap is None:
        _compact_swap = _build_compact_function()
    return _compact_swap[0]


def _apply_function():
    _compact_function()
    return _compact_swap[1]


def _build_compact_function():
    torch = _torch()

    class CompactSwap(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scores, capacity, out_indices):
            result = compact_(x.detach(), scores, capacity, dim=1, mode="swap", out_indices=out_indices)
            ctx.mark_dirty(x)
            ctx.mark_non_differentiable(result.indices)
            ctx.save_for_backward(result.indices)
            return x, result.indices

        @staticmethod
        def backward(ctx, grad_x, _grad_indices):
            (indices,) = ctx.saved_tensors
            grad = grad_x.clone(memory_format=torch.contiguous_format)
            restore_(grad, indices, dim=1)  # the same exchanges: the permutation is its own inverse
            return grad, None, None, None

    class ApplySwap(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, indices):
            apply_map_(x.detach(), indices, dim=1, mode="swap")
            ctx.mark_dirty(x)
            ctx.save_for_backward(indices)
            return x

        @staticmethod
        def backward(ctx, grad_x):
            (indices,) = ctx.saved_tensors
            grad = grad_x.clone(memory_format=torch.contiguous_format)
            restore_(grad, indices, dim=1)
            return grad, None

    return CompactSwap, ApplySwap


def _check_differentiable(tokens: Any, mode: str) -> bool:
    """True when tokens take the autograd route; TypeError / ValueError where
    they cannot be changed in place under autograd."""
    if not (_arrays.is_torch(tokens) and tokens.requires_grad and _torch().is_grad_enabled()):
        return False
    if tokens.is_leaf:
        raise TypeError(
            "expert_inputs is a leaf tensor that requires grad: it cannot be changed in "
            "place. Compact a tensor computed from it (the dispatch output), or its .clone()"
        )
    if mode != "swap":
        raise ValueError(f"mode={mode!r} is not differentiable (it overwrites dropped tokens); "
                         "use mode='swap', or run under torch.no_grad()")
    return True


def _byte_span(t: Any) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _check_dispatch_buffer(buffer: Any, shape: tuple, tokens: Any, reads: dict) -> None:
    """Everything `forward` needs of a caller's dispatch buffer, judged before
    it is written: kind, shape, dtype, device, rows of contiguous features, a
    buffer autograd lets us change, and no memory shared with what is read."""
    torch = _torch()
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"dispatch_buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if tuple(buffer.shape) != shape:
        raise ValueError(f"dispatch_buffer must be {list(shape)}, got {list(buffer.shape)}")
    if buffer.dtype != tokens.dtype or buffer.device != tokens.device:
        raise ValueError(f"dispatch_buffer must be {tokens.dtype} on {tokens.device} like hidden_states, "
                         f"got {buffer.dtype} on {buffer.device}")
    if buffer.numel() and buffer.stride(-1) != 1:
        raise ValueError("dispatch_buffer's last axis (the features of a token) must be contiguous, "
                         f"got strides {list(buffer.stride())}")
    if buffer.requires_grad and buffer.is_leaf and torch.is_grad_enabled():
        raise TypeError("dispatch_buffer is a leaf tensor that requires grad: it cannot be written in place")
    span = _byte_span(buffer)
    for name, t in reads.items():
        other = _byte_span(t)
        if span and other and span[0] < other[1] and other[0] < span[1]:
            raise ValueError(f"dispatch_buffer shares memory with {name}, which forward reads")


def _renamed(error: Exception, names: dict) -> Exception:
    """`error` (raised by a call of the core API, before it wrote anything)
    with the core API's argument names in its message replaced by the hook's
    (the message names the argument the caller passed)."""
    pattern = "|".join(re.escape(k) for k in names)
    text = re.sub(rf"(?<![\w\[])({pattern})(?![\w\[])", lambda m: names[m.group(1)], str(error))
    return type(error)(text)


# The core's names of what the hook's __call__ passes compact_ (expert_inputs
# is judged by the hook before, as an array of three axes).
_CALL_NAMES = {"scores": "gating_weights", "buffers[0]": "expert_inputs"}


def _compact_experts(tokens: Any, scores: Any, capacity: int, mode: str, out_indices: Any) -> tuple:
    """compact_ on [E, T, D] along T, through autograd when tokens require grad."""
    if _arrays.is_torch(scores):
        scores = scores.detach()
    if _check_differentiable(tokens, mode):
        full, indices = _compact_function().apply(tokens, scores, capacity, out_indices)
        return full.narrow(1, 0, indices.shape[-1]), indices
    if _arrays.is_torch(tokens) and tokens.requires_grad:
        tokens = tokens.detach()  # no_grad: a plain in-place change, as torch allows there
    result = compact_(tokens, scores, capacity, dim=1, mode=mode, out_indices=out_indices)
    return result.values, result.indices


class HuggingFaceMoEInplaceHook:
    """Expert-capacity dropping for Hugging Face style MoE layers, in place.

    HuggingFaceMoEInplaceHook(capacity=C)
        hook(expert_inputs [E, T, D], gating_weights [E, T]) compacts each
        expert's top-C tokens by gating weight (ties to the lower token index)
        into expert_inputs[:, :C] and returns that view; return_indices=True
        adds indices [E, C] (int64), the original token of each kept slot.

    HuggingFaceMoEInplaceHook(hidden_dim, num_experts, top_k)
        hook.forward(hidden_states [..., D], router_logits [T, E], capacity)
        routes each token to its top_k experts (softmax, renormalised over the
        top k when normalize_top_k), fills a per-expert dispatch buffer
        [E, T, D] (allocated, or the caller's `dispatch_buffer`), compacts it
        in place and returns the view [E, C, D]; return_indices=True returns
        SlotDispatch(expert_inputs, indices, weights), which `combine` takes.

    Both forms accept both calls where they have what they need (`block_d`:
    see idempotent_moe.moe). For the experts of a transformers model, prefer
    the "idempotent" experts implementation (hf_experts), which never builds
    an [E, T, D] buffer.
    """

    def __init__(self, hidden_dim: int | None = None, num_experts: int | None = None,
                 top_k: int | None = None, block_d: int = 128, *, capacity: int | None = None,
                 mode: str = "swap", normalize_top_k: bool = True) -> None:
        # block_d: accepted and ignored (idempotent_moe.moe's docstring).
        def optional(value, name, minimum):
            return None if value is None else _arrays.check_int(value, name, minimum=minimum)

        self.hidden_dim = optional(hidden_dim, "hidden_dim", 1)
        self.num_experts = optional(num_experts, "num_experts", 1)
        self.top_k = optional(top_k, "top_k", 1)
        if self.top_k is not None and self.num_experts is not None and self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        self.capacity = optional(capacity, "capacity", 0)
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a str ('swap' or 'move'), got {type(mode).__name__}")
        if mode not in ("swap", "move"):
            raise ValueError(f"mode must be 'swap' or 'move', got {mode!r}")
        self.mode = mode
        if type(normalize_top_k) is not bool:
            raise TypeError(f"normalize_top_k must be True or False, got {normalize_top_k!r}")
        self.normalize_top_k = normalize_top_k
        if _arrays.torch_module() is not None:
            _compact_function()  # built here, outside any compiled region that calls the hook

    def __repr__(self) -> str:
        fields = [f"{k}={getattr(self, k)!r}" for k in
                  ("hidden_dim", "num_experts", "top_k", "capacity") if getattr(self, k) is not None]
        return f"HuggingFaceMoEInplaceHook({', '.join(fields)})"

    def _capacity(self, capacity: int | None) -> int:
        if capacity is None:
            if self.capacity is None:
                raise TypeError("capacity is required: pass it to the call or to the constructor")
            return self.capacity
        return _arrays.check_int(capacity, "capacity", minimum=0)

    def __call__(self, expert_inputs: Any, gating_weights: Any, capacity: int | None = None, *,
                 return_indices: bool = False, out_indices: Any = None) -> Any:
        """Compact expert_inputs [E, T, D] (any dtype; modified in place) by
        gating_weights [E, T] (float32/float16/bfloat16). Returns the view
        [E, C', D], C' = min(C, T), and with return_indices the indices [E, C']."""
        if not _arrays.is_torch(expert_inputs):  # torch tensors that require grad are handled below
            _arrays.check_array(expert_inputs, "expert_inputs")
        check_expert_buffer(expert_inputs, "expert_inputs", self.num_experts, self.hidden_dim)
        capacity = self._capacity(capacity)
        try:
            kept, indices = _compact_experts(expert_inputs, gating_weights, capacity, self.mode, out_indices)
        except (TypeError, ValueError, BufferError) as e:  # raised before anything was written
            raise _renamed(e, _CALL_NAMES) from e
        return (kept, indices) if return_indices else kept

    def forward(self, hidden_states: Any, router_logits: Any, capacity: int | None = None, *,
                return_indices: bool = False, dispatch_buffer: Any = None) -> Any:
        """Route, dispatch and drop each expert's overflow (torch tensors).

        hidden_states [..., D] (T tokens once flattened), router_logits [T, E].
        Allocates the dispatch buffer [E, T, D] unless `dispatch_buffer` is
        given (then filled and compacted in place). Differentiable with
        respect to hidden_states and router_logits (through the weights).
        """
        torch = _torch()
        if self.num_experts is None or self.top_k is None:
            raise TypeError("forward needs the hook built with num_experts and top_k: "
                            "HuggingFaceMoEInplaceHook(hidden_dim, num_experts, top_k)")
        for name, t in (("hidden_states", hidden_states), ("router_logits", router_logits)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{name} must be floating point, got {t.dtype}")
        capacity = self._capacity(capacity)
        if hidden_states.dim() < 1:
            raise ValueError("hidden_states must be [..., D], got a 0-dimensional tensor")
        dim = hidden_states.shape[-1]
        if self.hidden_dim is not None and dim != self.hidden_dim:
            raise ValueError(f"hidden_states has hidden size {dim}, the hook {self.hidden_dim}")
        tokens = hidden_states.reshape(-1, dim)
        num_tokens = tokens.shape[0]
        if tuple(router_logits.shape) != (num_tokens, self.num_experts):
            raise ValueError(f"router_logits must be [T={num_tokens}, num_experts={self.num_experts}], "
                             f"got {list(router_logits.shape)}")
        if router_logits.device != hidden_states.device:
            raise ValueError(f"router_logits is on {router_logits.device}, hidden_states on "
                             f"{hidden_states.device}")
        probs = torch.softmax(router_logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        scores = expert_scores(top_i, top_w, self.num_experts)  # [E, T], -inf where not routed
        shape = (self.num_experts, num_tokens, dim)
        if dispatch_buffer is not None:
            _check_dispatch_buffer(dispatch_buffer, shape, tokens,
                                   {"hidden_states": hidden_states, "router_logits": router_logits})
        # The kept set before any write: scores the core refuses (NaN logits)
        # leave a caller's buffer as it was.
        try:
            indices = idempotent_map(scores.detach(), capacity)
        except ValueError as e:  # NaN logits: NaN routing weights
            raise ValueError(f"router_logits give routing weights [E, T] the selection refuses: {e}") from e
        if dispatch_buffer is None:
            buffer = tokens.unsqueeze(0).expand(shape).clone()
        else:
            buffer = dispatch_buffer
            buffer.copy_(tokens.unsqueeze(0).expand(shape))
        if _check_differentiable(buffer, self.mode):
            buffer = _apply_function().apply(buffer, indices)
        else:
            apply_map_(buffer.detach() if buffer.requires_grad else buffer, indices, dim=1, mode=self.mode)
        kept = buffer.narrow(1, 0, indices.shape[-1])
        if not return_indices:
            return kept
        # weights [E, C]: differentiable routing weights of the kept slots, 0 for unrouted tokens
        dense = torch.zeros(self.num_experts, num_tokens, dtype=top_w.dtype, device=tokens.device)
        dense = dense.scatter(0, top_i.t(), top_w.t())
        return SlotDispatch(kept, indices, dense.gather(1, indices))

    @staticmethod
    def combine(expert_outputs: Any, indices: Any, weights: Any, num_tokens: int) -> Any:
        """out [T, D] = sum over kept slots (e, c) of weights[e, c] *
        expert_outputs[e, c] into token indices[e, c] (torch tensors; fp32
        accumulation for half precision). Uses index_add_, whose float
        atomics make it run-to-run nondeterministic on CUDA."""
        return combine_slots(expert_outputs, indices, weights, num_tokens)
