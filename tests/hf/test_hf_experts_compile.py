"""The "idempotent" experts implementation under torch.compile: fullgraph
for every dtype, dropless and in capacity mode, and differentiable; what a
compiled decode step guards (no guard per layer over transformers', the
experts' guards skipped as grouped_mm's are); the stand-ins while tracing
(transformers' fallback op, grouped_gemm where it is safe) and the routing
checks skipped only then."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers' experts interface")

import idempotent_moe as imoe  # noqa: E402
from _helpers.hf_models import (  # noqa: E402
    compiled_experts,
    experts_grads,
    run_experts,
    skewed_routing,
    standalone_experts,
)
from idempotent_moe import integrations as hf  # noqa: E402
from idempotent_moe.integrations import _dispatch  # noqa: E402


def _compile_case(dtype, tokens=24, seed=11, routing_seed=6):
    """A fresh dynamo, standalone experts and (hidden, index, weights) in dtype."""
    torch._dynamo.reset()
    experts = standalone_experts().to(dtype)
    hidden = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)
    index, weights = skewed_routing(tokens, 8, 2, seed=routing_seed)
    return experts, hidden, index, weights.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_dropless_compiles_with_fullgraph_for_every_dtype(dtype):
    """grouped_mm's tracing implementation takes bf16 only: fp32 and fp16 use
    transformers' compile-safe fallback op while tracing, and the CPU-side
    routing checks are skipped, so fullgraph=True traces with no break."""
    experts, hidden, index, weights = _compile_case(dtype)
    with torch.no_grad():
        eager = run_experts(experts, hidden, index, weights, "idempotent")
        compiled = torch.compile(compiled_experts(experts, None), backend="aot_eager", fullgraph=True)
        out = compiled(hidden, index, weights)
    assert out.dtype == dtype
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    if dtype != torch.bfloat16:
        assert _dispatch.COMPILED_FALLBACK is not None


def test_the_fused_paths_cuda_check_traces_in_a_model_compiled_before_any_eager_call(monkeypatch):
    """The fused path asks once whether CUDA runs its kernels; in a model
    compiled before any eager CUDA forward that first question comes while
    dynamo traces, which cannot trace the native call: it is a constant of
    the graph, and fullgraph=True compiles."""
    from idempotent_moe.integrations import _fused

    monkeypatch.setattr(_fused, "_cuda_ok", None)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + 1 if _fused._cuda_runs() else x - 1, fullgraph=True,
                             backend="eager")
    expected = 1.0 if imoe.cuda_available() else -1.0
    assert compiled(torch.zeros(2)).tolist() == [expected, expected]
    assert _fused._cuda_ok is imoe.cuda_available()


def test_a_compiled_dropless_forward_writes_no_module_attribute():
    """After an eager forward, a compiled dropless forward leaves
    `idempotent_stats` as it is (None): dynamo's frame replays no attribute
    write on the experts module, host work every layer of every compiled
    decode step would pay."""
    import dis

    debug = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if debug is None:
        pytest.skip("this torch has no _debug_get_cache_entry_list")
    experts, hidden, index, weights = _compile_case(torch.bfloat16, tokens=8, seed=13, routing_seed=8)

    def forward(h, i, w):
        return hf.hf_experts.experts_forward(experts, h, i, w, None)

    with torch.no_grad():
        eager = forward(hidden, index, weights)
        out = torch.compile(forward, backend="eager", fullgraph=True)(hidden, index, weights)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert experts.idempotent_stats is None
    (entry,) = debug(forward.__code__)
    names = {str(i.argval) for i in dis.get_instructions(entry.code)}
    assert "idempotent_stats" not in names


def test_the_default_gate_is_known_while_tracing_with_or_without_an_eager_forward():
    """_default_gate is worked out from the class: in an eager call it is kept
    on the module, and under torch.compile (fullgraph) it is read from there,
    or worked out again where no eager call came first. A wrong answer while
    tracing turns the fused activation and the small-M GEMM off."""
    from idempotent_moe.integrations import _dispatch

    for eager_first in (True, False):
        torch._dynamo.reset()
        experts = standalone_experts()
        if eager_first:
            assert _dispatch.default_gate(experts) is True
            assert experts.__dict__[_dispatch._DEFAULT_GATE] is True
        traced = torch.compile(lambda x, e=experts: x + 1 if _dispatch.default_gate(e) else x - 1,
                               backend="eager", fullgraph=True)
        assert traced(torch.zeros(2)).tolist() == [1.0, 1.0]
        assert (_dispatch._DEFAULT_GATE in experts.__dict__) is eager_first  # not written while tracing


def _step_guards(impl: str, layers: int, device: str = "cpu") -> str:
    """The guards of one compiled static-cache step of the quick
    Qwen3-MoE-like model with `layers` layers, as torch prints them."""
    from imoe_bench import model_families as mf
    from imoe_bench.guards import compiled_step

    base = mf.QUICK_MOE_FAMILIES["qwen3moe"]
    family = mf.Family(base.key, base.name, base.config_class,
                       dict(base.config, num_hidden_layers=layers), base.dtype)
    torch._dynamo.reset()
    return str(compiled_step(family, impl, device).guards)


def test_compiled_steps_gain_no_guard_per_layer_over_transformers(monkeypatch):
    """Fused routers (a class, no per-instance forward, the family as plain
    class values) and the experts forward (no type(module) calls) add no
    identity guard per layer to a compiled decode step: each would be
    checked at every step of every layer. The guards' growth from 2 to 4
    layers is transformers' own. The routers run their fused forward on the
    CPU here (on CUDA they do anyway): with torch 2.11 a family object read
    from each layer's router cost one identity guard per layer."""
    from idempotent_moe.integrations import hf_router

    pytest.importorskip("torch._dynamo.eval_frame")
    monkeypatch.setattr(hf_router, "_FUSED_ON_CPU", True)
    growth = {impl: _step_guards(impl, 4).count("LAMBDA_GUARD") - _step_guards(impl, 2).count("LAMBDA_GUARD")
              for impl in ("grouped_mm", "idempotent+router")}
    assert growth["idempotent+router"] <= growth["grouped_mm"], growth


def _experts_tag_safety(impl: str, device: str) -> list:
    """Per layer of a compiled step (three layers), with torch's recursive
    dict-tag guards on: whether the experts module's guards may be skipped
    while its __dict__ is unchanged ("tag safe", as torch prints it)."""
    pytest.importorskip("torch._dynamo.eval_frame")
    if not hasattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards"):
        pytest.skip("this torch has no recursive dict-tag guards")
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
        text = _step_guards(impl, 3, device)
    managers = [line for line in text.splitlines() if "._modules['experts'], accessed_by" in line]
    assert len(managers) == 3, managers
    return ["tag_safe=(True" in m for m in managers]


def test_a_compiled_step_can_skip_the_experts_guards():
    """torch.compile skips the guards of an nn.Module whose __dict__ is
    unchanged since the last step when the module is "tag safe" (it and what
    the step read from it are modules, dicts and immutable values). Ours
    are where grouped_mm's are (every layer's but the first, whose class is
    guarded there): a read of experts.__dict__ (the default gate,
    idempotent_stats) made the experts, their MoE block and their layer
    checked guard by guard at every step."""
    theirs = _experts_tag_safety("grouped_mm", "cpu")
    assert _experts_tag_safety("idempotent+router", "cpu") == theirs and any(theirs), theirs


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and imoe.cuda_available()),
                    reason="needs torch.cuda and a CUDA build of idempotent_moe")
def test_a_compiled_step_can_skip_the_experts_guards_with_the_small_m_gemm():
    """The same on CUDA with the small-M GEMM switch, read from the module's
    config at every forward: getattr(experts, "config", None) there made the
    config a guarded child of the module, which is not tag safe."""
    theirs = _experts_tag_safety("grouped_mm", "cuda")
    assert _experts_tag_safety("idempotent+gemm+router", "cuda") == theirs and any(theirs), theirs


def test_grouped_gemm_stands_in_while_tracing_only_where_it_is_safe_and_small():
    """_graph_safe_gemm on fake CUDA tensors (as torch.compile traces them):
    fp16/fp32 operands with the weights' K axis contiguous, int32 offsets, at
    most GRAPH_SAFE_ROWS_PER_EXPERT rows per expert, no gradient recorded."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    limit = _dispatch.GRAPH_SAFE_ROWS_PER_EXPERT
    with FakeTensorMode(), torch.no_grad():
        w = torch.empty(8, 32, 16, device="cuda", dtype=torch.float16).transpose(-2, -1)  # [E, K, N]
        offs = torch.empty(8, device="cuda", dtype=torch.int32)

        def safe(rows=8 * limit, weight=w, offsets=offs, device="cuda", dtype=torch.float16):
            x = torch.empty(rows, 16, device=device, dtype=dtype)
            return _dispatch._graph_safe_gemm(x, weight, offsets)

        assert safe() and safe(rows=1)
        assert not safe(rows=8 * limit + 1)  # prefill sizes keep the fallback's tensor cores
        assert not safe(offsets=offs.long())
        row_major = torch.empty(8, 16, 32, device="cuda", dtype=torch.float16)  # [E, K, N], N contiguous
        assert not safe(weight=row_major)
        odd_k = torch.empty(8, 32, 12, device="cuda", dtype=torch.float16).transpose(-2, -1)  # K: 24 bytes
        x = torch.empty(8, 12, device="cuda", dtype=torch.float16)
        assert not _dispatch._graph_safe_gemm(x, odd_k, offs)
        assert not safe(dtype=torch.float32)  # x and w differ
        cpu_w = torch.empty(8, 32, 16, dtype=torch.float16).transpose(-2, -1)
        assert not safe(weight=cpu_w, offsets=torch.empty(8, dtype=torch.int32), device="cpu")
    with FakeTensorMode(), torch.enable_grad():
        w = torch.empty(8, 32, 16, device="cuda", dtype=torch.float16).transpose(-2, -1)
        x = torch.empty(8, 16, device="cuda", dtype=torch.float16, requires_grad=True)
        assert not _dispatch._graph_safe_gemm(x, w, torch.empty(8, device="cuda", dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_capacity_mode_compiles_with_fullgraph(dtype):
    """Capacity mode traces into one graph too: the same kept assignments and
    dropped count as eager; the output equal in bf16 (grouped_mm on both
    sides), within fp32 rounding in fp32 (the traced GEMM is transformers'
    fallback op, eager's is grouped_mm)."""
    experts, hidden, index, weights = _compile_case(dtype)
    with torch.no_grad():
        eager = run_experts(experts, hidden, index, weights, "idempotent", capacity_factor=1.0)
        eager_stats = experts.idempotent_stats
        compiled = torch.compile(compiled_experts(experts, 1.0), backend="aot_eager", fullgraph=True)
        out = compiled(hidden, index, weights)
    assert int(eager_stats[2]) > 0 and int(experts.idempotent_stats[2]) == int(eager_stats[2])
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, eager, **tol)


def test_compiled_dropless_is_differentiable_for_fp32():
    torch._dynamo.reset()
    experts = standalone_experts()
    hidden = torch.randn(20, 16, generator=torch.Generator().manual_seed(12))
    index, weights = skewed_routing(20, 8, 2, seed=7)
    eager = experts_grads(experts, hidden, index, weights, "idempotent")
    compiled = torch.compile(compiled_experts(experts, None), backend="aot_eager", fullgraph=True)
    h = hidden.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    experts.zero_grad()
    out = compiled(h, index, w)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    for a, b in zip((out, h.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad), eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_mm_while_compiling_follows_transformers_rules():
    w = torch.zeros(2, 4, 4)
    assert not _dispatch.grouped_mm_compiles(w)
    assert not _dispatch.grouped_mm_compiles(w.half())
    expected = _dispatch._torch_version() >= (2, 11) and hasattr(torch.nn.functional, "grouped_mm")
    assert _dispatch.grouped_mm_compiles(w.bfloat16()) == expected


def test_routing_checks_are_skipped_only_while_compiling(monkeypatch):
    from idempotent_moe import _tracing

    bad = torch.tensor([[0, 1], [2, 2]])
    with pytest.raises(ValueError, match="distinct"):
        _dispatch.sort_by_expert(bad, 4)
    monkeypatch.setattr(_tracing, "compiling", lambda: True)
    _dispatch.sort_by_expert(bad, 4)  # not checked: a data-dependent branch while tracing
