"""Training through the "idempotent" transformers experts implementation on
the fused experts layer: a tiny Mixtral and a tiny Qwen3-MoE (router
auxiliary loss on), loss and gradients against transformers' grouped_mm,
capacity mode against the library's torch capacity path, gradient
checkpointing, bf16 autocast, a compiled MoE block and a compiled training
step (fullgraph)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers' experts interface")

from _helpers.hf_models import VOCAB, moe_model  # noqa: E402
from idempotent_moe import _moe_autograd as ag  # noqa: E402
from idempotent_moe import integrations as hf  # noqa: E402
from idempotent_moe.integrations import _fused  # noqa: E402

FAMILIES = ["mixtral", "qwen3_moe"]


def tiny_model(family: str, seed: int = 0):
    """A two-layer model in train mode that returns its router logits (the
    auxiliary loss on) and keeps no cache."""
    return moe_model(family, seed, output_router_logits=True, use_cache=False).train()


IDS = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def step(family, implementation, capacity=None, autocast=False, checkpointing=False, fused=True):
    """(loss, aux loss, {name: grad}, fused forwards run) of one training step."""
    model = tiny_model(family)
    if implementation == "idempotent":
        hf.use_idempotent_experts(model, capacity)
    else:
        model.set_experts_implementation(implementation)
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    real_trains, real_fwd = _fused.trains, ag.experts_forward_direct
    _fused.trains = real_trains if fused else (lambda experts: False)
    ag.experts_forward_direct = lambda *a: calls.append(1) or real_fwd(*a)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(IDS, labels=IDS)
        out.loss.backward()
    finally:
        _fused.trains, ag.experts_forward_direct = real_trains, real_fwd
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.aux_loss.detach(), grads, len(calls)


def close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = b[name].abs().max().item() + 1e-12
        assert (a[name] - b[name]).abs().max().item() <= tol * scale, name


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_matches_grouped_mm(family):
    loss, aux, grads, calls = step(family, "idempotent")
    ref_loss, ref_aux, ref_grads, _ = step(family, "grouped_mm")
    assert calls == 2  # both layers on the fused experts layer
    assert any("experts" in n for n in grads) and any("gate" in n and "experts" not in n for n in grads)
    assert torch.allclose(loss, ref_loss, rtol=1e-5) and torch.allclose(aux, ref_aux, rtol=1e-5)
    close(grads, ref_grads, 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("capacity", [1.0, 0.5])
def test_capacity_training_matches_the_torch_capacity_path(family, capacity):
    loss, _, grads, calls = step(family, "idempotent", capacity)
    ref_loss, _, ref_grads, ref_calls = step(family, "idempotent", capacity, fused=False)
    assert calls == 2 and ref_calls == 0
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    close(grads, ref_grads, 1e-4)
    model = tiny_model(family)
    hf.use_idempotent_experts(model, capacity)
    model(IDS, labels=IDS).loss.backward()
    stats = hf.capacity_stats(model)
    assert len(stats) == 2 and all(s.dropped >= 0 for s in stats.values())
    if capacity == 0.5:
        assert all(s.dropped > 0 for s in stats.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(family):
    loss, _, grads, calls = step(family, "idempotent", checkpointing=True)
    ref_loss, _, ref_grads, _ = step(family, "idempotent")
    assert calls == 4  # each layer's forward run again in the backward
    assert torch.equal(loss, ref_loss)
    close(grads, ref_grads, 1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_within_grouped_mms_own_error(family):
    """Under bf16 autocast, our gradients are as far from the fp32 step as
    grouped_mm's own bf16-autocast gradients are (within a factor)."""
    _, _, fp32, _ = step(family, "grouped_mm")
    loss, _, ours, calls = step(family, "idempotent", autocast=True)
    ref_loss, _, theirs, _ = step(family, "grouped_mm", autocast=True)
    assert calls == 2 and torch.isfinite(loss)
    for name in fp32:
        scale = fp32[name].abs().max().item() + 1e-12
        err_ours = (ours[name].float() - fp32[name]).abs().max().item() / scale
        err_theirs = (theirs[name].float() - fp32[name]).abs().max().item() / scale
        assert err_ours <= 2 * err_theirs + 2e-2, name


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_compiled_moe_block_fullgraph_forward_and_backward(capacity):
    model = tiny_model("mixtral")
    hf.use_idempotent_experts(model, capacity)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()

    def run(fn):
        block.zero_grad()
        h = x.clone().requires_grad_()
        out = fn(h)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        return out.detach(), h.grad, {n: p.grad.clone() for n, p in block.named_parameters()}

    want = run(block)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got = run(compiled)
    again = run(compiled)  # a second step: the same result
    assert torch.allclose(got[0], want[0], atol=1e-6) and torch.allclose(got[1], want[1], atol=1e-6)
    close(got[2], want[2], 1e-5)
    assert torch.equal(again[0], got[0])
    with torch._dynamo.config.patch(error_on_recompile=True):  # changing routing: no recompilation
        for seed in range(3, 6):
            h = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)
            out = compiled(h)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
            assert torch.isfinite(h.grad).all()


def compiled_model_steps(capacity, device: str, dtype, backend: str):
    """(last loss, the eager loss on the same ids) of ten whole-model training
    steps under torch.compile (fullgraph) with changing routing, a
    recompilation an error; asserts the fused layer ran and every gradient
    is finite. transformers installs its output-capturing hooks on a model's
    first call, under a threading.Lock dynamo cannot enter (a graph break
    under fullgraph, whatever the experts): one eager step comes first, as a
    training loop's would."""
    model = tiny_model("mixtral").to(device, dtype)
    hf.use_idempotent_experts(model, capacity)
    calls = []
    real_fwd = ag.experts_forward_direct
    ag.experts_forward_direct = lambda *a: calls.append(1) or real_fwd(*a)

    def train_step(ids):
        return model(ids, labels=ids).loss

    try:
        train_step(IDS.to(device))
        torch._dynamo.reset()
        compiled = torch.compile(train_step, fullgraph=True, backend=backend)
        for seed in range(10):
            ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed)).to(device)
            model.zero_grad(set_to_none=True)
            with torch._dynamo.config.patch(error_on_recompile=seed > 0):
                loss = compiled(ids)
            loss.backward()
            assert torch.isfinite(loss)
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            eager = train_step(ids)
    finally:
        ag.experts_forward_direct = real_fwd
    assert calls, "the fused experts layer never ran"
    return float(loss), float(eager)


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_compiled_training_step_fullgraph_ten_steps_no_recompile(capacity):
    """A whole model's training step compiled (aot_eager, fullgraph) on the
    CPU in fp32: the same loss as the eager step."""
    loss, eager = compiled_model_steps(capacity, "cpu", torch.float32, "aot_eager")
    assert abs(loss - eager) <= 1e-5 * abs(eager)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_cuda_compiled_training_step_inductor_ten_steps_no_recompile(capacity):
    """The same on CUDA in bf16 with inductor: the loss within bf16 reach of
    the eager step's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    loss, eager = compiled_model_steps(capacity, "cuda", torch.bfloat16, "inductor")
    assert abs(loss - eager) <= 2e-2 * abs(eager)
