"""torch.compile through the front ends over the ops: compact_kv_cache_inplace,
InplaceKVCompactor, the MoE map functions, HuggingFaceMoEInplaceHook in both
call forms and with autograd, InplaceEvictionCache, and the plan helpers of
the fused experts path: one graph, no break, eager's bits (to rounding where
inductor fuses the arithmetic around the ops)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("torch.library.custom_op needs torch 2.4", allow_module_level=True)

import idempotent_moe as imoe  # noqa: E402
from _helpers import make_data, make_scores  # noqa: E402
from _helpers.compiling import (  # noqa: E402
    DEVICES,
    assert_compiles,
    op_targets,
    same,
    seeded,
    to_device,
)

# --------------------------------------------------------------------------- KV and MoE front ends


def _kv_inplace(k, v, s):
    return imoe.compact_kv_cache_inplace(k, v, s, 16, protected_prefix_len=2, recent_window=3,
                                         return_indices=True)


def _kv_compactor(k, v, s, act):
    kv = imoe.InplaceKVCompactor()
    first = kv.compact_from_scores(k, v, s, 20, head_reduce="max")
    tm = kv.build_idempotent_map(2, 2, 40, act, 6)
    return first, tm, kv.compact(k, v, tm, 6)


def _make_kv(seed, device):
    g = seeded(seed)
    return to_device(device, make_data((2, 2, 40, 8), "float16", "torch", g),
                     make_data((2, 2, 40, 4), "float16", "torch", g),
                     make_scores((2, 4, 40), "float32", "torch", g, ties=False),
                     torch.from_numpy(np.sort(g.choice(20, 6, replace=False))))


def _make_kv_scores(seed, device):
    return _make_kv(seed, device)[:3]


def _moe(x, s):
    router = imoe.InplaceMoERouter(hidden_dim=8, num_experts=4)
    kept, idx = router(x, s, 12, return_indices=True)
    tm = imoe.generate_idempotent_moe_map(s, 5)
    return kept, idx, tm, imoe.compact_moe_tokens_inplace(x, tm)


def _make_moe(seed, device):
    g = seeded(seed)
    return to_device(device, make_data((4, 32, 8), "bfloat16", "torch", g),
                     make_scores((4, 32), "float32", "torch", g))


KV_MOE = [
    ("compact_kv_cache_inplace", _kv_inplace, _make_kv_scores, ["compact_"]),
    ("InplaceKVCompactor", _kv_compactor, _make_kv, ["compact_", "idempotent_map", "apply_map_"]),
    ("moe", _moe, _make_moe, ["compact_", "idempotent_map", "apply_map_"]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, fn, make, ops", KV_MOE, ids=[c[0] for c in KV_MOE])
def test_front_ends_compile(name, fn, make, ops, device):
    assert_compiles(fn, make, device, ops)


def _hook_call(x, s):
    from idempotent_moe.integrations import HuggingFaceMoEInplaceHook

    return HuggingFaceMoEInplaceHook(capacity=10, mode="move")(x, s, return_indices=True)


def _hook_forward(hidden, logits):
    from idempotent_moe.integrations import HuggingFaceMoEInplaceHook

    hook = HuggingFaceMoEInplaceHook(8, 4, 2)
    d = hook.forward(hidden, logits, 12, return_indices=True)
    out = hook.combine(d.expert_inputs * 2 + 1, d.indices, d.weights, hidden.shape[0])
    return out, d.expert_inputs, d.indices


def _same_routing(compiled, eager) -> None:
    """The compacted buffer and indices bit for bit; the arithmetic around
    them (softmax, combine), which inductor fuses, to rounding."""
    same(list(compiled[1:]), list(eager[1:]))
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)


def _make_routing(seed, device, grad=False):
    g = seeded(seed)
    hidden = torch.from_numpy(g.standard_normal((32, 8)).astype(np.float32)).to(device)
    logits = torch.from_numpy(g.standard_normal((32, 4)).astype(np.float32)).to(device)
    return [hidden.requires_grad_(grad), logits.requires_grad_(grad)]


@pytest.mark.parametrize("device", DEVICES)
def test_hook_compiles(device):
    assert_compiles(_hook_call, _make_moe, device, ["compact_"])
    with torch.no_grad():
        explained = torch._dynamo.explain(_hook_forward)(*_make_routing(0, device))
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        compiled = torch.compile(_hook_forward, fullgraph=True)
        for seed in (1, 2):
            _same_routing(compiled(*_make_routing(seed, device)), _hook_forward(*_make_routing(seed, device)))


@pytest.mark.parametrize("device", DEVICES)
def test_hook_backward_compiles(device):
    """With grad, the compaction runs in the hook's autograd Function (the
    op in forward, restore_'s op on the gradient in backward): no graph
    break, and the same outputs and gradients as eager (to rounding: the
    arithmetic around the compaction is fused by inductor)."""
    from idempotent_moe.integrations import HuggingFaceMoEInplaceHook

    HuggingFaceMoEInplaceHook(capacity=1)  # builds the autograd Function outside the compiled code
    explained = torch._dynamo.explain(_hook_forward)(*_make_routing(0, device, grad=True))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(_hook_forward, fullgraph=True)
    for seed in (1, 2):
        args_c, args_e = _make_routing(seed, device, True), _make_routing(seed, device, True)
        res_c, res_e = compiled(*args_c), _hook_forward(*args_e)
        (res_c[0] * res_c[0]).sum().backward()
        (res_e[0] * res_e[0]).sum().backward()
        _same_routing([t.detach() for t in res_c], [t.detach() for t in res_e])
        for a_c, a_e in zip(args_c, args_e):
            torch.testing.assert_close(a_c.grad, a_e.grad, rtol=1e-5, atol=1e-5)


def test_eviction_cache_compiles():
    """An update that evicts in place (InplaceEvictionCache: K, V, positions
    and scores moved by compact_) traces through the op with no break."""
    pytest.importorskip("transformers")
    from idempotent_moe.integrations import InplaceEvictionCache

    def fn(cache, k, v, k_next, v_next):
        cache.update(k, v, 0)       # prefill: 20 tokens, an eviction is due
        keys, values = cache.update(k_next, v_next, 0)  # evicts to 8, then appends
        layer = cache.layers[0]
        return keys, values, layer.positions

    def make(seed, device):
        g = seeded(seed)
        cache = InplaceEvictionCache(budget=8, sink_tokens=2, recent_window=2, evict_every=4,
                                     order="stable")
        # finite keys: their norms are the scores
        data = [torch.from_numpy(g.standard_normal(shape).astype(np.float32)) for shape in
                ((1, 2, 20, 8), (1, 2, 20, 8), (1, 2, 1, 8), (1, 2, 1, 8))]
        return [cache] + to_device(device, *data)

    explained = torch._dynamo.explain(fn)(*make(0, "cpu"))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    assert "idempotent_moe.compact_" in op_targets(explained.graphs[0])
    compiled = torch.compile(fn, fullgraph=True)
    for seed in (1, 2):
        args_c, args_e = make(seed, "cpu"), make(seed, "cpu")
        out_c, out_e = compiled(*args_c), fn(*args_e)
        same(out_c, out_e)
        assert out_c[0].shape[2] == 9
        assert args_c[0].layers[0].evictions == args_e[0].layers[0].evictions == 1


def test_the_fused_plan_helpers_trace_without_a_graph_break():
    """The CUDA plan's checks (transformers' activation by class, the small-M
    weight layout) run inside a compiled forward: a graph break there split
    every MoE layer of a compiled model in two."""
    activations = pytest.importorskip("transformers.activations")
    from idempotent_moe.integrations import _dispatch

    w = torch.randn(4, 128, 64).transpose(-2, -1)

    def f(x, w):
        ok = (_dispatch.activation_name(activations.SiLUActivation()) == "silu"
              and _dispatch.grouped_gemm_takes(w, True))
        return x + 1 if ok else x - 1

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(2), w), torch.full((2,), 2.0))
    assert _dispatch.activation_name(activations.GELUActivation()) == "gelu"
    assert _dispatch.activation_name(torch.nn.Tanh()) is None
