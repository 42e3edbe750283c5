"""HuggingFaceMoEInplaceHook, the original API's in-place MoE hook: the
capacity form compacts the caller's buffer, the forward form routes,
dispatches and combines (into the caller's dispatch buffer too), autograd
through both, refusals before anything is written, NumPy arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers' experts interface")

from idempotent_moe import integrations as hf  # noqa: E402

# --------------------------------------------------------------------------- the hook


def _top_c_sets(scores, capacity):
    """Per row, the top-C slots by score, ties to the lower index."""
    return [sorted(sorted(range(len(row)), key=lambda i: (-row[i], i))[:capacity]) for row in scores.tolist()]


@pytest.mark.parametrize("mode", ["swap", "move"])
def test_hook_capacity_form_compacts_the_callers_buffer(mode):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 10, 6, generator=g)
    gating = torch.rand(4, 10, generator=g)
    before = x.clone()
    hook = hf.HuggingFaceMoEInplaceHook(capacity=4, block_d=128, mode=mode)
    kept, idx = hook(x, gating, return_indices=True)
    assert kept.shape == (4, 4, 6) and kept.data_ptr() == x.data_ptr() and kept._base is x
    assert idx.dtype == torch.int64 and idx.shape == (4, 4)
    assert [sorted(r) for r in idx.tolist()] == _top_c_sets(gating, 4)
    for e in range(4):
        assert torch.equal(kept[e], before[e, idx[e]])
    # capacity given to the call wins over the constructor's; without return_indices: the view
    y = before.clone()
    view = hook(y, gating, 2)
    assert view.shape == (4, 2, 6) and view.data_ptr() == y.data_ptr()
    assert "capacity=4" in repr(hook)


def test_hook_forward_form_routes_dispatches_and_combines():
    num_experts, top_k, dim, capacity = 4, 2, 8, 3
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(2, 5, dim, generator=g)  # 10 tokens
    router_logits = torch.randn(10, num_experts, generator=g) + torch.tensor([2.0, 1.0, 0.0, 0.0])
    hook = hf.HuggingFaceMoEInplaceHook(dim, num_experts, top_k, 128)  # block_d positional, as before
    view = hook.forward(hidden, router_logits, capacity)
    assert view.shape == (num_experts, capacity, dim)

    res = hook.forward(hidden, router_logits, capacity, return_indices=True)
    assert isinstance(res, hf.SlotDispatch)
    tokens = hidden.reshape(-1, dim)
    probs = torch.softmax(router_logits, -1)
    top_w, top_i = torch.topk(probs, top_k, -1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    scores = torch.full((num_experts, 10), -math.inf).scatter(0, top_i.t(), top_w.t())
    expected_sets = _top_c_sets(scores, capacity)
    for e in range(num_experts):
        assert sorted(res.indices[e].tolist()) == expected_sets[e]
        assert torch.equal(res.expert_inputs[e], tokens[res.indices[e]])
        for c in range(capacity):
            torch.testing.assert_close(res.weights[e, c], scores[e, res.indices[e, c]].clamp(min=0))
    # combine: each token gets the weighted outputs of the experts that kept it, no more
    outputs = res.expert_inputs * 2.0
    combined = hook.combine(outputs, res.indices, res.weights, 10)
    expected = torch.zeros(10, dim)
    for e in range(num_experts):
        for t in expected_sets[e]:
            if scores[e, t] > -math.inf:
                expected[t] += scores[e, t] * 2.0 * tokens[t]
    torch.testing.assert_close(combined, expected)
    # into the caller's dispatch buffer
    buffer = torch.empty(num_experts, 10, dim)
    view = hook.forward(hidden, router_logits, capacity, dispatch_buffer=buffer)
    assert view.data_ptr() == buffer.data_ptr()
    # the constructor-form call works on a routed hook too
    assert hook(buffer.clone(), scores.nan_to_num(neginf=-1.0), 2).shape == (num_experts, 2, dim)


def test_hook_gradients_flow_back_through_the_compaction():
    """Autograd: the swap compaction is its own inverse, so the gradient of
    the kept view returns to each token's original slot."""
    g = torch.Generator().manual_seed(13)
    base = torch.randn(3, 9, 5, generator=g, requires_grad=True)
    gating = torch.rand(3, 9, generator=g, requires_grad=True)  # read, never differentiated
    upstream = torch.randn(3, 4, 5, generator=g)
    x = base * 1.0  # a non-leaf, as a dispatch output is
    kept, idx = hf.HuggingFaceMoEInplaceHook(capacity=4)(x, gating, return_indices=True)
    (kept * upstream).sum().backward()
    expected = torch.zeros(3, 9, 5)
    for e in range(3):
        expected[e, idx[e]] = upstream[e]
    assert torch.equal(base.grad, expected)
    assert gating.grad is None


def test_hook_forward_is_differentiable():
    num_experts, top_k, dim = 4, 2, 6
    g = torch.Generator().manual_seed(14)
    hidden = torch.randn(12, dim, generator=g, requires_grad=True)
    router_logits = torch.randn(12, num_experts, generator=g, requires_grad=True)
    w_out = torch.randn(num_experts, dim, dim, generator=g)
    hook = hf.HuggingFaceMoEInplaceHook(dim, num_experts, top_k)
    res = hook.forward(hidden, router_logits, 4, return_indices=True)
    out = hook.combine(torch.bmm(res.expert_inputs, w_out), res.indices, res.weights, 12)
    out.square().sum().backward()

    # the same computation out of place, from the kept indices
    h = hidden.detach().clone().requires_grad_()
    r = router_logits.detach().clone().requires_grad_()
    top_w, top_i = torch.topk(torch.softmax(r, -1), top_k, -1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    dense = torch.zeros(num_experts, 12).scatter(0, top_i.t(), top_w.t())
    y = torch.bmm(h[res.indices], w_out) * dense.gather(1, res.indices).unsqueeze(-1)
    ref = torch.zeros(12, dim).index_add(0, res.indices.reshape(-1), y.reshape(-1, dim))
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(hidden.grad, h.grad)
    torch.testing.assert_close(router_logits.grad, r.grad)


def test_hook_refusals():
    g = torch.Generator().manual_seed(15)
    gating = torch.rand(2, 6, generator=g)
    hook = hf.HuggingFaceMoEInplaceHook(capacity=3)
    leaf = torch.randn(2, 6, 4, generator=g, requires_grad=True)
    with pytest.raises(TypeError, match="leaf"):
        hook(leaf, gating)
    with pytest.raises(ValueError, match="not differentiable"):
        hf.HuggingFaceMoEInplaceHook(capacity=3, mode="move")(leaf * 1.0, gating)
    with torch.no_grad():  # where torch itself allows in-place changes of a leaf
        kept = hook(leaf, gating)
    assert kept.shape == (2, 3, 4)
    # the router of the core API refuses tensors that require grad outright
    with pytest.raises(TypeError, match="requires grad"):
        hf.InplaceMoERouter(hidden_dim=4, num_experts=2)(leaf * 1.0, gating, expert_capacity=3)
    with pytest.raises(TypeError, match="capacity"):
        hf.HuggingFaceMoEInplaceHook()(torch.randn(2, 6, 4), gating)
    with pytest.raises(TypeError, match="num_experts"):
        hook.forward(torch.randn(6, 4), torch.randn(6, 2), 3)
    with pytest.raises(ValueError, match="top_k"):
        hf.HuggingFaceMoEInplaceHook(4, 2, 3)
    with pytest.raises(ValueError, match="router_logits"):
        hf.HuggingFaceMoEInplaceHook(4, 2, 1).forward(torch.randn(6, 4), torch.randn(5, 2), 3)
    with pytest.raises(ValueError, match="expert_inputs"):
        hf.HuggingFaceMoEInplaceHook(4, 3, 1, capacity=2)(torch.randn(2, 6, 4), gating)
    with pytest.raises(ValueError, match="mode"):
        hf.HuggingFaceMoEInplaceHook(capacity=1, mode="copy")


def test_hook_on_numpy():
    x = np.arange(2 * 5 * 2, dtype=np.float16).reshape(2, 5, 2)
    s = np.array([[1, 0, 3, 2, 5], [0, 0, 0, 9, 8]], dtype=np.float32)
    kept, idx = hf.HuggingFaceMoEInplaceHook(capacity=2)(x, s, return_indices=True)
    assert idx.tolist() == [[2, 4], [3, 4]] and np.shares_memory(kept, x)
    assert kept[0].tolist() == [[4, 5], [8, 9]]


# --------------------------------------------------------------------------- the hook's contract

def _hook_case():
    g = torch.Generator().manual_seed(5)
    hook = hf.HuggingFaceMoEInplaceHook(8, 4, 2)
    return hook, torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


@pytest.mark.parametrize("bad", ["nan_logits", "strided", "dtype", "leaf", "aliases_hidden", "not_tensor"])
def test_hook_forward_refuses_before_writing_the_dispatch_buffer(bad):
    hook, hidden, logits = _hook_case()
    buffer = torch.full((4, 6, 8), 7.0)
    expected = TypeError if bad in ("leaf", "not_tensor") else ValueError
    if bad == "nan_logits":
        logits[2, 1] = float("nan")
    elif bad == "strided":
        buffer = torch.full((4, 8, 6), 7.0).transpose(1, 2)
    elif bad == "dtype":
        buffer = torch.full((4, 6, 8), 7.0, dtype=torch.float64)
    elif bad == "leaf":
        buffer.requires_grad_(True)
    elif bad == "aliases_hidden":
        buffer = torch.full((4, 6, 8), 7.0)
        hidden = buffer[3]
    before = buffer.detach().clone()
    with pytest.raises(expected):
        hook.forward(hidden, logits, 3, dispatch_buffer=buffer.numpy() if bad == "not_tensor" else buffer)
    assert torch.equal(buffer.detach(), before)


def test_hook_forward_into_a_buffer_equals_the_allocated_one():
    hook, hidden, logits = _hook_case()
    buffer = torch.full((4, 6, 8), 7.0)
    mine = hook.forward(hidden, logits, 3, dispatch_buffer=buffer, return_indices=True)
    theirs = hook.forward(hidden, logits, 3, return_indices=True)
    assert mine.expert_inputs.data_ptr() == buffer.data_ptr()
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)


def test_hook_combine_refuses_weights_of_another_shape():
    hook, hidden, logits = _hook_case()
    d = hook.forward(hidden, logits, 3, return_indices=True)
    with pytest.raises(ValueError, match=r"weights must be \[E, C\]"):
        hook.combine(d.expert_inputs, d.indices, d.weights[:, :1], 6)
    with pytest.raises(ValueError, match=r"indices must be \[E, C\]"):
        hook.combine(d.expert_inputs, d.indices.reshape(-1), d.weights, 6)
