"""Bad input to the front ends over the core: HuggingFaceMoEInplaceHook
(constructor, __call__, forward, combine), the "idempotent" experts
implementation (its forward, use_idempotent_experts, set_capacity_factor),
InplaceEvictionCache (constructor, update, evict, attach) and
ExpertParallelDispatcher (constructor, call). Each case asserts the exception
type, that the message names the argument at fault, and that every tensor
passed in, and every buffer and counter of the object called, is bit for
bit as it was.

A builder returns (call, tensors, state): `state()` gives what else must not
change (None: nothing)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import assert_unchanged, names, read_only, requires_torch, snapshot, torch

pytestmark = requires_torch
transformers = pytest.importorskip("transformers")

import idempotent_moe.integrations as hf  # noqa: E402
from idempotent_moe.integrations import HuggingFaceMoEInplaceHook as Hook  # noqa: E402
from idempotent_moe.integrations import InplaceEvictionCache  # noqa: E402

E, T, D, K = 4, 6, 8, 2
CASES = []


def case(id, exc, words, build):
    CASES.append(pytest.param(build, exc, names(*words), id=id))


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def tensors(*xs):
    return [x for x in xs if isinstance(x, (torch.Tensor, np.ndarray))]


# --------------------------------------------------------------------------- HuggingFaceMoEInplaceHook()
for kwargs, exc, word in [
    (dict(hidden_dim=0), ValueError, "hidden_dim"), (dict(hidden_dim=8.0), TypeError, "hidden_dim"),
    (dict(num_experts=-1), ValueError, "num_experts"), (dict(num_experts=True), TypeError, "num_experts"),
    (dict(top_k=0), ValueError, "top_k"), (dict(num_experts=2, top_k=3), ValueError, "top_k"),
    (dict(top_k=2.0), TypeError, "top_k"), (dict(capacity=-2), ValueError, "capacity"),
    (dict(capacity=1.5), TypeError, "capacity"), (dict(mode="gather"), ValueError, "mode"),
    (dict(mode=3), TypeError, "mode"), (dict(normalize_top_k="yes"), TypeError, "normalize_top_k"),
]:
    case(f"hook-init-{'-'.join(f'{k}={v}' for k, v in kwargs.items())}", exc, [word],
         lambda kw=kwargs: ((lambda: Hook(**kw)), [], None))


# ------------------------------------------------------------------ hook(expert_inputs, gating_weights)
def hook_call(x=None, g=None, *, hook=None, **kwargs):
    x = rand(E, T, D) if x is None else x
    g = torch.rand(E, T, generator=torch.Generator().manual_seed(1)) if g is None else g
    hook = Hook(capacity=3) if hook is None else hook
    return (lambda: hook(x, g, **kwargs)), tensors(x, g, kwargs.get("out_indices")), None


def _nan_gates():
    g = torch.rand(E, T)
    g[3, 5] = math.nan
    return g


case("hook-call-expert-inputs-list", TypeError, ["expert_inputs", "list"],
     lambda: hook_call(rand(E, T, D).tolist()))
case("hook-call-expert-inputs-2d", ValueError, ["expert_inputs"], lambda: hook_call(rand(T, D)))
case("hook-call-expert-inputs-other-experts", ValueError, ["expert_inputs", "num_experts=8"],
     lambda: hook_call(hook=Hook(num_experts=8, capacity=3)))
case("hook-call-gates-list", TypeError, ["gating_weights", "list"],
     lambda: hook_call(g=torch.rand(E, T).tolist()))
case("hook-call-gates-int", TypeError, ["gating_weights", "int32"],
     lambda: hook_call(g=torch.ones(E, T, dtype=torch.int32)))
case("hook-call-gates-shape", ValueError, ["gating_weights"], lambda: hook_call(g=torch.rand(E, T + 1)))
case("hook-call-gates-nan", ValueError, ["gating_weights", "NaN"], lambda: hook_call(g=_nan_gates()))
case("hook-call-capacity-negative", ValueError, ["capacity"], lambda: hook_call(capacity=-1))
case("hook-call-capacity-float", TypeError, ["capacity", "int"], lambda: hook_call(capacity=2.5))
case("hook-call-capacity-missing", TypeError, ["capacity"], lambda: hook_call(hook=Hook()))
case("hook-call-out-indices-shape", ValueError, ["out_indices"],
     lambda: hook_call(out_indices=torch.full((E, 2), -5)))
case("hook-call-out-indices-int16", TypeError, ["out_indices"],
     lambda: hook_call(out_indices=torch.full((E, 3), -5, dtype=torch.int16)))
case("hook-call-leaf-requires-grad", TypeError, ["expert_inputs", "leaf"],
     lambda: hook_call(rand(E, T, D).requires_grad_()))
case("hook-call-move-under-autograd", ValueError, ["mode='move'"],
     lambda: (lambda leaf: hook_call(leaf * 1, hook=Hook(capacity=3, mode="move")))(
         rand(E, T, D).requires_grad_()))
case("hook-call-read-only-numpy", BufferError, ["expert_inputs", "read-only"],
     lambda: hook_call(read_only(rand(E, T, D).numpy().copy()), torch.rand(E, T).numpy()))


def _gates_in_inputs():
    x = rand(E, T, D)
    return hook_call(x, x[:, :, 0])


def _indices_in_inputs():
    x = rand(E, T, D)
    return hook_call(x, out_indices=x.view(torch.int64)[:, :3, 0])


case("hook-call-gates-inside-inputs", ValueError, ["gating_weights", "expert_inputs"], _gates_in_inputs)
case("hook-call-out-indices-inside-inputs", ValueError, ["out_indices", "expert_inputs"], _indices_in_inputs)


# ----------------------------------------------------------------- hook.forward(hidden_states, router_logits)
def forward(hidden=None, logits=None, capacity=3, *, hook=None, **kwargs):
    hidden = rand(T, D, seed=2) if hidden is None else hidden
    logits = rand(T, E, seed=3) if logits is None else logits
    hook = Hook(D, E, K) if hook is None else hook
    buffer = kwargs.get("dispatch_buffer")
    return (lambda: hook.forward(hidden, logits, capacity, **kwargs)), tensors(hidden, logits, buffer), None


def _buffer(**kwargs):
    return torch.full((E, T, D), 7.0, **kwargs)


def _nan_logits():
    logits = rand(T, E, seed=3)
    logits[2, 1] = math.nan
    return logits


case("hook-forward-hidden-list", TypeError, ["hidden_states", "list"], lambda: forward(rand(T, D).tolist()))
case("hook-forward-hidden-numpy", TypeError, ["hidden_states", "ndarray"],
     lambda: forward(rand(T, D).numpy()))
case("hook-forward-logits-list", TypeError, ["router_logits", "list"],
     lambda: forward(logits=rand(T, E).tolist()))
case("hook-forward-logits-int", TypeError, ["router_logits", "int64"],
     lambda: forward(logits=torch.ones(T, E, dtype=torch.int64)))
case("hook-forward-hidden-0d", ValueError, ["hidden_states"], lambda: forward(torch.tensor(1.0)))
case("hook-forward-hidden-size", ValueError, ["hidden_states", "hidden size"],
     lambda: forward(rand(T, D + 1)))
case("hook-forward-logits-shape", ValueError, ["router_logits"], lambda: forward(logits=rand(T, E + 1)))
case("hook-forward-capacity-negative", ValueError, ["capacity"], lambda: forward(capacity=-1))
case("hook-forward-capacity-bool", TypeError, ["capacity"], lambda: forward(capacity=True))
case("hook-forward-without-experts", TypeError, ["num_experts", "top_k"], lambda: forward(hook=Hook(D)))
case("hook-forward-nan-logits-buffer", ValueError, ["router_logits", "NaN"],
     lambda: forward(logits=_nan_logits(), dispatch_buffer=_buffer()))
case("hook-forward-buffer-numpy", TypeError, ["dispatch_buffer"],
     lambda: forward(dispatch_buffer=_buffer().numpy()))
case("hook-forward-buffer-shape", ValueError, ["dispatch_buffer"],
     lambda: forward(dispatch_buffer=torch.full((E, T + 1, D), 7.0)))
case("hook-forward-buffer-dtype", ValueError, ["dispatch_buffer", "float32"],
     lambda: forward(dispatch_buffer=_buffer(dtype=torch.float64)))
case("hook-forward-buffer-strided", ValueError, ["dispatch_buffer", "contiguous"],
     lambda: forward(dispatch_buffer=torch.full((E, T, 2 * D), 7.0)[:, :, ::2]))
case("hook-forward-buffer-leaf-requires-grad", TypeError, ["dispatch_buffer", "leaf"],
     lambda: forward(dispatch_buffer=_buffer().requires_grad_()))


def _hidden_in_buffer():
    buffer = _buffer()
    return forward(buffer[3], dispatch_buffer=buffer)


def _logits_in_buffer():
    buffer = _buffer()
    return forward(logits=buffer.view(-1)[:T * E].view(T, E), dispatch_buffer=buffer)


case("hook-forward-hidden-inside-buffer", ValueError, ["dispatch_buffer", "hidden_states"], _hidden_in_buffer)
case("hook-forward-logits-inside-buffer", ValueError, ["dispatch_buffer", "router_logits"], _logits_in_buffer)


# --------------------------------------------------------------------------- Hook.combine
def combine(outputs=None, indices=None, weights=None, num_tokens=T):
    outputs = rand(E, 3, D) if outputs is None else outputs
    indices = torch.tensor([[0, 1, 2], [3, 4, 5], [0, 2, 4], [1, 3, 5]]) if indices is None else indices
    weights = torch.rand(E, 3) if weights is None else weights
    call = lambda: Hook.combine(outputs, indices, weights, num_tokens)  # noqa: E731
    return call, tensors(outputs, indices, weights), None


case("hook-combine-outputs-list", TypeError, ["expert_outputs", "list"],
     lambda: combine(rand(E, 3, D).tolist()))
case("hook-combine-outputs-int", TypeError, ["expert_outputs"],
     lambda: combine(torch.ones(E, 3, D, dtype=torch.int32)))
case("hook-combine-outputs-2d", ValueError, ["expert_outputs"], lambda: combine(rand(E, D)))
case("hook-combine-indices-float", TypeError, ["indices"], lambda: combine(indices=torch.zeros(E, 3)))
case("hook-combine-indices-shape", ValueError, ["indices"],
     lambda: combine(indices=torch.zeros(E * 3, dtype=torch.long)))
case("hook-combine-indices-too-large", ValueError, ["indices", "num_tokens"],
     lambda: combine(indices=torch.full((E, 3), T)))
case("hook-combine-indices-negative", ValueError, ["indices"],
     lambda: combine(indices=torch.full((E, 3), -1)))
case("hook-combine-weights-int", TypeError, ["weights"],
     lambda: combine(weights=torch.ones(E, 3, dtype=torch.long)))
case("hook-combine-weights-shape", ValueError, ["weights"], lambda: combine(weights=torch.rand(E, 1)))
case("hook-combine-num-tokens-negative", ValueError, ["num_tokens"], lambda: combine(num_tokens=-1))
case("hook-combine-num-tokens-float", TypeError, ["num_tokens"], lambda: combine(num_tokens=6.0))


# --------------------------------------------------------------------------- the "idempotent" experts
def experts_module():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=D, intermediate_size=12, num_local_experts=E, num_experts_per_tok=K)
    config._experts_implementation = "idempotent"
    experts = MixtralExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(rand(*p.shape, seed=9) * 0.3)
    return experts


def experts(hidden=None, index=None, weights=None, *, grad=False, factor=None):
    module = experts_module()
    hidden = rand(T, D, seed=4) if hidden is None else hidden
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]]) if index is None else index
    weights = torch.rand(T, K) if weights is None else weights
    setattr(module.config, hf.CAPACITY_FACTOR_ATTR, factor)

    def call():
        with torch.set_grad_enabled(grad):
            if grad:
                module.requires_grad_(True)
            hf.idempotent_experts_forward(module, hidden, index, weights)
    return call, tensors(hidden, index, weights) + list(module.parameters()), None


for grad in (False, True):  # the fused path, the torch path (a gradient recorded)
    p = "experts-grad" if grad else "experts"
    case(f"{p}-hidden-list", TypeError, ["hidden_states", "list"],
         lambda g=grad: experts(rand(T, D).tolist(), grad=g))
    case(f"{p}-index-list", TypeError, ["top_k_index", "list"],
         lambda g=grad: experts(index=[[0, 1]] * T, grad=g))
    case(f"{p}-weights-list", TypeError, ["top_k_weights", "list"],
         lambda g=grad: experts(weights=[[0.5, 0.5]] * T, grad=g))
    case(f"{p}-hidden-1d", ValueError, ["hidden_states"], lambda g=grad: experts(rand(T * D), grad=g))
    case(f"{p}-index-other-tokens", ValueError, ["top_k_index"],
         lambda g=grad: experts(index=torch.zeros(T - 1, K, dtype=torch.long), grad=g))
    case(f"{p}-weights-shape", ValueError, ["top_k_weights"],
         lambda g=grad: experts(weights=torch.rand(T, 1), grad=g))
    case(f"{p}-index-float", TypeError, ["top_k_index"],
         lambda g=grad: experts(index=torch.zeros(T, K), grad=g))
    case(f"{p}-weights-int", TypeError, ["top_k_weights"],
         lambda g=grad: experts(weights=torch.ones(T, K, dtype=torch.long), grad=g))
    case(f"{p}-hidden-int", TypeError, ["hidden_states"],
         lambda g=grad: experts(torch.ones(T, D, dtype=torch.long), grad=g))
    case(f"{p}-index-out-of-range", ValueError, ["top_k_index", "4"],
         lambda g=grad: experts(index=torch.full((T, K), E), grad=g))
    case(f"{p}-index-negative", ValueError, ["top_k_index", "-1"],
         lambda g=grad: experts(index=torch.full((T, K), -1), grad=g))
    for f in (None, 1.0):
        case(f"{p}-repeated-expert-factor-{f}", ValueError, ["top_k_index", "distinct"],
             lambda g=grad, f=f: experts(index=torch.tensor([[0, 1]] * 5 + [[2, 2]]), grad=g, factor=f))
for value, exc in (("1.5", TypeError), (-1.0, ValueError), (math.nan, ValueError), (True, TypeError)):
    case(f"experts-config-factor-{value}", exc, [hf.CAPACITY_FACTOR_ATTR], lambda v=value: experts(factor=v))


def _model_state(model):
    return [(type(m).__name__, getattr(m.config, hf.CAPACITY_FACTOR_ATTR, "unset"),
             getattr(m.config, "_experts_implementation", None))
            for m in model.modules() if hasattr(m, "config")]


def switch(fn, *args, model=None, **kwargs):
    model = experts_module() if model is None else model
    passed = list(model.parameters()) if hasattr(model, "parameters") else []
    return (lambda: fn(model, *args, **kwargs)), passed, \
        (lambda: _model_state(model)) if hasattr(model, "modules") else None


for value, exc in (("1.5", TypeError), (0.0, ValueError), (-2.0, ValueError), (math.inf, ValueError),
                   (True, TypeError)):
    case(f"use-idempotent-factor-{value}", exc, ["capacity_factor|" + hf.CAPACITY_FACTOR_ATTR],
         lambda v=value: switch(hf.use_idempotent_experts, v))
    case(f"set-capacity-factor-{value}", exc, [hf.CAPACITY_FACTOR_ATTR],
         lambda v=value: switch(hf.set_capacity_factor, v))
case("use-idempotent-fuse-routers-str", TypeError, ["fuse_routers"],
     lambda: switch(hf.use_idempotent_experts, fuse_routers="yes"))
case("use-idempotent-small-m-int", TypeError, ["small_m_gemm"],
     lambda: switch(hf.use_idempotent_experts, small_m_gemm=1))
case("use-idempotent-not-a-model", TypeError, ["model"],
     lambda: switch(hf.use_idempotent_experts, model="model"))
case("use-idempotent-no-experts", ValueError, ["experts"],
     lambda: switch(hf.use_idempotent_experts, model=torch.nn.Linear(2, 2)))
case("set-capacity-factor-not-a-model", TypeError, ["model"],
     lambda: switch(hf.set_capacity_factor, 1.0, model="m"))


# --------------------------------------------------------------------------- InplaceEvictionCache
for kwargs, exc, word in [
    (dict(budget=2.0), TypeError, "budget"), (dict(budget=True), TypeError, "budget"),
    (dict(budget=0), ValueError, "budget"), (dict(budget=-1), ValueError, "budget"),
    (dict(budget=8, sink_tokens=1.5), TypeError, "sink_tokens"),
    (dict(budget=8, recent_window=-1), ValueError, "recent_window"),
    (dict(budget=8, sink_tokens=5, recent_window=4), ValueError, "sink_tokens"),
    (dict(budget=8, evict_every=0), ValueError, "evict_every"),
    (dict(budget=8, evict_every=1.5), TypeError, "evict_every"),
    (dict(budget=8, max_cache_len=16.5), TypeError, "max_cache_len"),
    (dict(budget=8, max_cache_len=True), TypeError, "max_cache_len"),
    (dict(budget=8, max_cache_len=8), ValueError, "max_cache_len"),
    (dict(budget=8, max_cache_len=2**40), ValueError, "max_cache_len"),
    (dict(budget=2**40), ValueError, "max_cache_len"),
    (dict(budget=8, score=3), TypeError, "score"), (dict(budget=8, score="entropy"), ValueError, "score"),
    (dict(budget=8, head_reduce=1), TypeError, "head_reduce"),
    (dict(budget=8, head_reduce="sum"), ValueError, "head_reduce"),
    (dict(budget=8, mode=None), TypeError, "mode"), (dict(budget=8, mode="gather"), ValueError, "mode"),
    (dict(budget=8, order="random"), ValueError, "order"),
    (dict(budget=8, per_head="yes"), TypeError, "per_head"),
    (dict(budget=8, prefill_eviction="half"), ValueError, "prefill_eviction"),
    (dict(budget=8, config="config"), TypeError, "config"),
]:
    case(f"cache-init-{'-'.join(f'{k}={v}' for k, v in kwargs.items())}", exc, [word],
         lambda kw=kwargs: ((lambda: InplaceEvictionCache(**kw)), [], None))


def filled_cache(layers=2, **kwargs):
    """A cache of `layers` evicting layers, each holding a 20-token prompt
    (batch 1, 2 KV heads, head size 4)."""
    cache = InplaceEvictionCache(8, sink_tokens=2, **kwargs)
    for i in range(layers):
        cache.update(rand(1, 2, 20, 4, seed=i), rand(1, 2, 20, 4, seed=10 + i), i)
    return cache


def cache_state(cache):
    state = []
    for layer in cache.layers:
        state += [layer.length, layer.seen, layer.evictions, layer.evicted, layer._pending, layer.slots,
                  layer.keys.clone(), layer.values.clone(), layer.positions.clone()]
    return state + [len(cache._hooks), cache._attached]


def on_cache(method, *args, cache=None, **kwargs):
    cache = filled_cache() if cache is None else cache
    passed = tensors(*args)
    return (lambda: getattr(cache, method)(*args, **kwargs)), passed, lambda: cache_state(cache)


def states(q=1, b=1, h=2, d=4, dv=4, dtype=torch.float32):
    return rand(b, h, q, d, seed=5, dtype=dtype), rand(b, h, q, dv, seed=6, dtype=dtype)


case("cache-update-keys-list", TypeError, ["key_states", "list"],
     lambda: on_cache("update", states()[0].tolist(), states()[1], 0))
case("cache-update-values-list", TypeError, ["value_states", "list"],
     lambda: on_cache("update", states()[0], states()[1].tolist(), 0))
case("cache-update-3d", ValueError, ["key_states"],
     lambda: on_cache("update", states()[0][0], states()[1][0], 0))
case("cache-update-other-batch", ValueError, ["key_states", "value_states"],
     lambda: on_cache("update", states(b=2)[0], states()[1], 0))
case("cache-update-layer-negative", ValueError, ["layer_idx"], lambda: on_cache("update", *states(), -1))
case("cache-update-layer-float", TypeError, ["layer_idx"], lambda: on_cache("update", *states(), 1.0))
case("cache-update-broadcast-batch", ValueError, ["layer 0", "key_states"],
     lambda: on_cache("update", *states(b=1, h=1), 0))
case("cache-update-other-head-size", ValueError, ["layer 0", "key_states"],
     lambda: on_cache("update", *states(d=5), 0))
case("cache-update-other-value-size", ValueError, ["layer 0", "value_states"],
     lambda: on_cache("update", *states(dv=3), 0))
case("cache-update-other-dtype", TypeError, ["layer 1", "float64"],
     lambda: on_cache("update", *states(dtype=torch.float64), 1))
case("cache-evict-budget-negative", ValueError, ["budget"], lambda: on_cache("evict", -1))
case("cache-evict-budget-float", TypeError, ["budget"], lambda: on_cache("evict", 4.5))
case("cache-evict-budget-below-sinks", ValueError, ["budget", "sink_tokens"], lambda: on_cache("evict", 1))
case("cache-evict-score-int", TypeError, ["score"], lambda: on_cache("evict", 4, 3))
case("cache-evict-score-unknown", ValueError, ["score"], lambda: on_cache("evict", 4, "entropy"))
case("cache-evict-score-shape", ValueError, ["score", "layer 0"],
     lambda: on_cache("evict", 4, lambda k, v, pos, i: torch.rand(1, 2, k.shape[2] - 1)))
case("cache-evict-score-not-a-tensor", TypeError, ["score"],
     lambda: on_cache("evict", 4, lambda k, v, pos, i: [0.0] * k.shape[2]))
case("cache-evict-score-fails-on-layer-1", ValueError, ["layer 1"],
     lambda: on_cache("evict", 4, lambda k, v, pos, i: torch.rand(1, 2, k.shape[2] + i)))
case("cache-layer-evict-budget-float", TypeError, ["budget"],
     lambda: (lambda c: (lambda: c.layers[0].evict(2.5), [], lambda: cache_state(c)))(filled_cache()))
case("cache-reorder-float-index", TypeError, ["beam_idx"], lambda: on_cache("reorder_cache", torch.zeros(1)))
case("cache-reorder-2d-index", ValueError, ["beam_idx"],
     lambda: on_cache("reorder_cache", torch.zeros(1, 1, dtype=torch.long)))
case("cache-reorder-out-of-range", ValueError, ["beam_idx", "batch = 1"],
     lambda: on_cache("reorder_cache", torch.tensor([0, 1])))
case("cache-select-out-of-range", ValueError, ["indices"],
     lambda: on_cache("batch_select_indices", torch.tensor([-1])))
case("cache-repeat-zero", ValueError, ["repeats"], lambda: on_cache("batch_repeat_interleave", 0))
case("cache-repeat-float", TypeError, ["repeats"], lambda: on_cache("batch_repeat_interleave", 2.0))
case("cache-attach-not-a-module", TypeError, ["model"], lambda: on_cache("attach", "model"))
case("cache-attach-no-attention", ValueError, ["attention"],
     lambda: on_cache("attach", torch.nn.Linear(2, 2)))


# --------------------------------------------------------------------------- ExpertParallelDispatcher
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'pg'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


DISPATCHER = []


def dcase(id, exc, words, build):
    DISPATCHER.append(pytest.param(build, exc, names(*words), id=id))


def dispatcher(*args, **kwargs):
    from idempotent_moe.distributed import ExpertParallelDispatcher

    return (lambda: ExpertParallelDispatcher(*args, **kwargs)), [], None


for args, kwargs, exc, word in [
    ((4.0, 2), {}, TypeError, "num_experts"), ((0, 1), {}, ValueError, "num_experts"),
    ((4, 0), {}, ValueError, "top_k"), ((4, 5), {}, ValueError, "top_k"), ((4, True), {}, TypeError, "top_k"),
    ((4, 2), dict(capacity_factor=-1.0), ValueError, "capacity_factor"),
    ((4, 2), dict(capacity_factor="2"), TypeError, "capacity_factor"),
]:
    dcase(f"dispatcher-init-{args}-{kwargs}", exc, [word], lambda a=args, kw=kwargs: dispatcher(*a, **kw))


def dispatch_call(hidden=None, ids=None, weights=None, expert_fn=lambda e, rows: rows * 2, experts=None):
    from idempotent_moe.distributed import ExpertParallelDispatcher

    hidden = rand(T, D) if hidden is None else hidden
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]]) if ids is None else ids
    weights = torch.rand(T, K) if weights is None else weights
    d = ExpertParallelDispatcher(E, K)
    extra = () if experts is None or not isinstance(experts, tuple) else tuple(
        w for w in experts if isinstance(w, torch.Tensor))

    def call():
        return d(hidden, ids, weights, expert_fn, experts=experts)
    return call, tensors(hidden, ids, weights, *extra), lambda: [d.last_stats]


for name, kwargs, exc, word in [
    ("hidden-list", dict(hidden=[[0.0] * D] * T), TypeError, "hidden"),
    ("ids-list", dict(ids=[[0, 1]] * T), TypeError, "topk_ids"),
    ("weights-list", dict(weights=[[0.5] * K] * T), TypeError, "topk_weights"),
    ("hidden-3d", dict(hidden=rand(1, T, D)), ValueError, "hidden"),
    ("ids-shape", dict(ids=torch.zeros(T, K + 1, dtype=torch.long)), ValueError, "topk_ids"),
    ("weights-shape", dict(weights=torch.rand(T, 1)), ValueError, "topk_weights"),
    ("ids-float", dict(ids=torch.zeros(T, K)), TypeError, "topk_ids"),
    ("weights-int", dict(weights=torch.ones(T, K, dtype=torch.long)), TypeError, "topk_weights"),
    ("hidden-int", dict(hidden=torch.ones(T, D, dtype=torch.long)), TypeError, "hidden"),
    ("ids-out-of-range", dict(ids=torch.full((T, K), E)), ValueError, "topk_ids"),
    ("ids-repeated", dict(ids=torch.tensor([[0, 1]] * 5 + [[3, 3]])), ValueError, "topk_ids.*distinct"),
    ("expert-fn-none", dict(expert_fn=None), TypeError, "expert_fn"),
    ("expert-fn-not-callable", dict(expert_fn=3), TypeError, "expert_fn"),
    ("expert-fn-and-experts", dict(experts=(rand(E, D, 8), rand(E, 4, D), "silu")), TypeError, "exactly one"),
    ("experts-not-a-tuple-of-three", dict(expert_fn=None, experts=[rand(E, D, 8)]), TypeError, "experts"),
    ("experts-shapes", dict(expert_fn=None, experts=(rand(E, D, 8), rand(E, 5, D), "silu")), ValueError,
     "experts"),
    ("experts-count", dict(expert_fn=None, experts=(rand(3, D, 8), rand(3, 4, D), "silu")), ValueError,
     "experts"),
    ("experts-act", dict(expert_fn=None, experts=(rand(E, D, 8), rand(E, 4, D), "tanh")), ValueError, "act"),
    ("experts-result-shape", dict(expert_fn=None, experts=lambda rows, ids: rows[:1]), ValueError, "experts"),
    ("expert-fn-broadcast", dict(expert_fn=lambda e, rows: rows[:1]), ValueError, "expert_fn"),
]:
    dcase(f"dispatcher-call-{name}", exc, [word], lambda kw=kwargs: dispatch_call(**kw))


# --------------------------------------------------------------------------- the tests
def run_case(build, exc, pattern):
    call, passed, state = build()
    snaps = snapshot(*passed)
    before = state() if state is not None else None
    with pytest.raises(exc, match=pattern):
        call()
    assert_unchanged(passed, snaps)
    if state is not None:
        after = state()
        assert len(after) == len(before)
        for a, b in zip(after, before):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (a, b)


@pytest.mark.parametrize("build, exc, pattern", CASES)
def test_bad_input(build, exc, pattern):
    run_case(build, exc, pattern)


@pytest.mark.parametrize("build, exc, pattern", DISPATCHER)
def test_dispatcher_bad_input(build, exc, pattern, one_rank, monkeypatch):
    import torch.distributed as dist

    def exchange(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        output.copy_(input)

    monkeypatch.setattr(dist, "all_to_all_single", exchange)
    run_case(build, exc, pattern)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("torch_path", [False, True])
def test_experts_take_a_repeat_of_weight_zero(grad, torch_path, monkeypatch):
    """LongCat-Flash maps its zero experts onto real ones with weight 0: a
    token may then name an expert twice. Such an assignment adds nothing on
    every dropless path (fused, the fused training op, torch's): the same
    output as with the zero-weight id moved to another expert."""
    from idempotent_moe.integrations import _fused

    if torch_path:
        monkeypatch.setattr(_fused, "applies", lambda experts, hidden: False)
    module = experts_module()
    hidden = rand(T, D, seed=4).requires_grad_(grad)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(2))
    weights[2, 1] = 0.0
    index = torch.tensor([[0, 1], [1, 2], [2, 2], [3, 0], [0, 2], [1, 3]])
    moved = index.clone()
    moved[2, 1] = 3
    with torch.set_grad_enabled(grad):
        out = hf.idempotent_experts_forward(module, hidden, index, weights)
        want = hf.idempotent_experts_forward(module, hidden, moved, weights)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # GEMMs of other row counts
    weights[2, 1] = 0.5
    with pytest.raises(ValueError, match="distinct"), torch.set_grad_enabled(grad):
        hf.idempotent_experts_forward(module, hidden, index, weights)


def test_good_calls_of_the_front_ends_still_work(one_rank, monkeypatch):
    """The checks take what the front ends always took."""
    import torch.distributed as dist
    from idempotent_moe.distributed import ExpertParallelDispatcher

    monkeypatch.setattr(dist, "all_to_all_single", lambda o, i, *a, **k: o.copy_(i))
    hidden, weights = rand(T, D), torch.rand(T, K)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    out = ExpertParallelDispatcher(E, K)(hidden, ids, weights, lambda e, rows: rows * (e + 1))
    want = sum(weights[:, j, None] * hidden * (ids[:, j, None] + 1) for j in range(K))
    torch.testing.assert_close(out, want)
    d = Hook(D, E, K).forward(rand(T, D), rand(T, E), 3, return_indices=True)
    assert tuple(Hook.combine(d.expert_inputs, d.indices, d.weights, T).shape) == (T, D)
    cache = filled_cache()
    # layer 0's prompt went down to the budget (8) when layer 1 cached its own
    assert cache.evict(4) == 4 + 16 and cache.layers[1].length == 4
    cache.batch_repeat_interleave(2)
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.layers[0].keys.shape == (2, 2, 4, 4)
    module = experts_module()
    assert tuple(hf.idempotent_experts_forward(module, rand(T, D), ids.int(), weights.half()).shape) == (T, D)
    assert len(CASES) + len(DISPATCHER) >= 150
