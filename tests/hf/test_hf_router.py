"""fuse_routers: transformers' routers (Mixtral, Qwen3-MoE with and without
renormalisation, OLMoE) on the library's topk_softmax. On the CPU a fused
router keeps its original forward (the fused computation, run directly,
returns what the router returns); fused models copy, pickle and unfuse;
unknown routers are refused; use_idempotent_experts fuses them and sets the
small-M GEMM switch. GPU tests: the fused router bit for bit, generate()
with fused routers, the original forward under grad. topk_softmax itself:
tests/moe/test_moe_router.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _helpers import ulps  # noqa: E402
from _helpers.hf_models import VOCAB, moe_model  # noqa: E402
from idempotent_moe import integrations as hf  # noqa: E402
from idempotent_moe.integrations import hf_router  # noqa: E402


def tiny_model(family, seed=0, dtype=torch.float32):
    """moe_model(family) with its routers' weights from N(0, 0.5) (they start
    at zeros in some families: the routing would be trivial), in `dtype`,
    eval mode."""
    model = moe_model(family, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model.to(dtype).eval()


def routers(model):
    return [m for m in model.modules() if type(m).__name__ in hf.SUPPORTED_ROUTERS]


FAMILIES = ["mixtral", "qwen3_moe", "qwen3_moe_plain", "olmoe"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_route_returns_what_the_router_returns(family, dtype):
    """The fused computation (run here on the CPU) against the original
    forward: same tuple, shapes and dtypes, the same experts, weights a few
    ulp apart (torch's CPU softmax; on CUDA they are equal bit for bit)."""
    model = tiny_model(family, dtype=dtype)
    hidden = torch.randn(2, 5, 32).to(dtype)
    for router in routers(model):
        with torch.no_grad():
            ref = router(hidden)
            ours = hf_router.fused_route(router, hidden)
        assert len(ours) == len(ref) == 3
        for a, b in zip(ours, ref):
            assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[2], ref[2])
        tol = 8 if ref[1].dtype == torch.float32 else 0x10000  # bf16: one bf16 ulp
        assert ulps(ours[1], ref[1]) <= tol


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fuse_keeps_the_original_forward_on_the_cpu_and_unfuse_restores_it(family, monkeypatch):
    model = tiny_model(family)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    original = type(routers(model)[0])
    before_keys = [set(m.__dict__) for m in routers(model)]
    assert hf.fuse_routers(model) == len(routers(model)) == 2
    assert hf.routers_fused(model) and hf.fuse_routers(model) == 2  # twice is harmless
    classes = {type(m) for m in routers(model)}
    assert len(classes) == 1 and classes.pop().__mro__[1] is original
    # No per-instance attribute: torch.compile guards the module as before.
    assert all(m.__dict__.keys() == keys for m, keys in zip(routers(model), before_keys))
    assert all(isinstance(m, original) and type(m).__name__ == original.__name__
               for m in routers(model))

    def boom(*args, **kwargs):
        raise AssertionError("the fused router ran on the CPU")

    monkeypatch.setattr(hf_router.moe, "topk_softmax", boom)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert hf.unfuse_routers(model) == 2 and not hf.routers_fused(model)
    assert all(type(m) is original for m in routers(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_copies_of_a_fused_model_stay_fused():
    import copy

    model = tiny_model("mixtral")
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    hf.fuse_routers(model)
    deep = copy.deepcopy(model)
    assert hf.routers_fused(deep) and all(hf_router._is_fused(m) for m in routers(deep))
    assert routers(deep)[0].weight is not routers(model)[0].weight
    with torch.no_grad():
        assert torch.equal(deep(ids).logits, model(ids).logits)
    router = routers(model)[0]
    shallow = copy.copy(router)
    assert type(shallow) is type(router) and shallow.weight is router.weight
    assert hf.unfuse_routers(deep) == 2 and hf.routers_fused(model)


def test_a_fused_model_pickles_and_loads_unfused():
    import pickle

    model = tiny_model("qwen3_moe")
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    original = type(routers(model)[0])
    hf.fuse_routers(model)
    data = pickle.dumps(model)
    assert b"idempotent_moe" not in data  # loads without the library
    loaded = pickle.loads(data)
    assert hf.routers_fused(model) and not hf.routers_fused(loaded)
    assert all(type(m) is original for m in routers(loaded))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_unknown_routers_are_refused_and_nothing_changes():
    model = tiny_model("gpt_oss")
    with pytest.raises(TypeError, match="GptOssTopKRouter.*supported: MixtralTopKRouter"):
        hf.fuse_routers(model)
    assert not hf.routers_fused(model)
    with pytest.raises(ValueError, match="no router"):
        hf.fuse_routers(torch.nn.Linear(4, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_router_is_the_router_bit_for_bit(family, dtype):
    model = tiny_model(family, dtype=dtype).cuda()
    hidden = torch.randn(3, 7, 32, device="cuda").to(dtype)
    for router in routers(model):
        with torch.no_grad():
            ref = router(hidden)
            ours = hf_router.fused_route(router, hidden)
        for a, b in zip(ours, ref):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe_plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_routers_generate_the_same_tokens(family, dtype):
    model = tiny_model(family, dtype=dtype).cuda()
    model.set_experts_implementation("idempotent")
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2)).cuda()
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(ids, **kwargs)
        hf.fuse_routers(model)
        fused = model.generate(ids, **kwargs)
        hf.unfuse_routers(model)
    assert torch.equal(fused, plain)


@pytest.mark.gpu
def test_gpu_fused_router_under_grad_runs_the_original(monkeypatch):
    model = tiny_model("mixtral").cuda()
    hf.fuse_routers(model)
    hidden = torch.randn(4, 32, device="cuda", requires_grad=True)

    def boom(*args, **kwargs):
        raise AssertionError("the fused router ran with a gradient recorded")

    monkeypatch.setattr(hf_router.moe, "topk_softmax", boom)
    _, w, _ = routers(model)[0](hidden)
    w.sum().backward()
    assert hidden.grad is not None


def test_use_idempotent_experts_fuses_routers_and_sets_the_gemm_switch():
    model = tiny_model("qwen3_moe")
    hf.use_idempotent_experts(model, fuse_routers=True, small_m_gemm=True)
    assert hf.routers_fused(model) and model.config._experts_implementation == "idempotent"
    assert getattr(model.config, hf.SMALL_M_GEMM_ATTR) is True
    hf.use_idempotent_experts(model, 1.25, small_m_gemm=False)  # routers as they were
    assert hf.routers_fused(model) and getattr(model.config, hf.SMALL_M_GEMM_ATTR) is False
    assert getattr(model.config, hf.CAPACITY_FACTOR_ATTR) == 1.25
    hf.unfuse_routers(model)


@pytest.mark.parametrize("bad, error", [(dict(small_m_gemm="yes"), TypeError),
                                        (dict(capacity_factor=0.0), ValueError),
                                        (dict(fuse_routers=True), TypeError)])
def test_use_idempotent_experts_refuses_and_changes_nothing(bad, error):
    model = tiny_model("gpt_oss" if bad.get("fuse_routers") else "mixtral")

    def state():
        config = model.config
        return (config._experts_implementation, getattr(config, hf.CAPACITY_FACTOR_ATTR, None),
                getattr(config, hf.SMALL_M_GEMM_ATTR, None), hf.routers_fused(model))

    before = state()
    with pytest.raises(error):
        hf.use_idempotent_experts(model, **bad)
    assert state() == before
