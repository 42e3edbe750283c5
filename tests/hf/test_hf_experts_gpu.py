"""The "idempotent" experts implementation on CUDA (`gpu` marker): W4 blocks
against grouped_mm (the bits, the memory peak), the fused gate in row
chunks, the decode path, no host synchronisation, CUDA graphs (captured,
and compiled with reduce-overhead), capacity mode against the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers' experts interface")

from _helpers.hf_models import (  # noqa: E402
    block_output,
    compiled_experts,
    cuda_block,
    run_experts,
    skewed_routing,
    standalone_experts,
)
from idempotent_moe import integrations as hf  # noqa: E402
from idempotent_moe.integrations import _dispatch  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("factor", [None, 1.25])
def test_gpu_large_batches_run_the_fused_gate_in_row_chunks(monkeypatch, factor):
    """Above GATE_UP_CHUNK_BYTES an eager CUDA forward runs the fused gate in
    row chunks (gated_row_chunks), dropless and with a capacity, and gives
    the whole fused gate's output up to bf16 rounding (its GEMMs have other
    row counts)."""
    from idempotent_moe.integrations import _fused

    hf.register()
    block = cuda_block(1024, 3584, "bfloat16")
    x = torch.randn(1, 4096, 1024, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(4))
    calls = []
    real = _fused.gated_row_chunks
    monkeypatch.setattr(_fused, "gated_row_chunks", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(_dispatch, "GATE_UP_CHUNK_BYTES", 16 << 20)
    chunked = block_output(block, x, "idempotent", factor)
    assert calls and calls[0] > 1, calls
    monkeypatch.setattr(_dispatch, "GATE_UP_CHUNK_BYTES", 1 << 40)
    whole = block_output(block, x, "idempotent", factor)
    assert len(calls) == 1
    torch.testing.assert_close(chunked, whole, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("hidden,intermediate", [(1024, 3584), (4096, 14336)])
def test_gpu_dropless_matches_grouped_mm(hidden, intermediate, tokens):
    """Bit-identical to grouped_mm where the default's GEMMs are grouped_mm on
    grouped_mm's own shapes (many rows per expert, the gate whole); where they
    are the library's (grouped_gemm at one row per expert, experts_gemm up to
    XG_ROWS_PER_EXPERT) or the gate runs in row chunks, its error against the
    experts in fp32 is within 10% of grouped_mm's own (mean absolute error,
    bf16). The kernel the default names is the one that runs."""
    from idempotent_moe.integrations import _fused
    from imoe_bench import w4

    hf.register()
    block = cuda_block(hidden, intermediate, "bfloat16")
    x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16)
    grouped = block_output(block, x, "grouped_mm")
    ours = block_output(block, x, "idempotent")
    with torch.no_grad():
        chunks = _dispatch._gated_chunks(block.experts, torch.empty(tokens * 2, hidden, device="meta"),
                                         torch.bfloat16)
        exact = w4.fp32_reference(block, x)
        gemm = _fused._gemm(block.experts, _fused._plan(block.experts, x.view(tokens, -1)), tokens * 2)
        names = _cuda_kernels(lambda: block(x))
    kernel = {"xg": "k_xg", "small_m": "k_grouped_gemm", "grouped_mm": "cutlass"}[gemm]
    assert any(kernel in n for n in names), (gemm, sorted(names))
    if chunks == 1 and gemm == "grouped_mm":
        assert torch.equal(ours, grouped)
    else:
        err_ours = (ours.float() - exact).abs().mean()
        err_grouped = (grouped.float() - exact).abs().mean()
        assert err_ours <= err_grouped * 1.1, (gemm, float(err_ours), float(err_grouped))


def _cuda_kernels(fn) -> set:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gpu_dropless_runs_in_a_cuda_graph_where_grouped_mm_does_not_compile(dtype):
    """generate()'s static cache replays the compiled forward as a CUDA graph
    (mode="reduce-overhead"). grouped_mm does not trace fp32 or fp16, and
    transformers' fallback reads the group offsets on the host, which a
    capture refuses: the traced forward takes grouped_gemm, syncs nothing,
    and replays the eager output on new routing."""
    torch._dynamo.reset()
    experts = standalone_experts().to("cuda", dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    compiled = torch.compile(compiled_experts(experts, None), mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(21)
    hidden = torch.empty(24, 16, device="cuda", dtype=dtype)
    index = torch.empty(24, 2, device="cuda", dtype=torch.int64)
    weights = torch.empty(24, 2, device="cuda", dtype=dtype)
    with torch.no_grad():
        for step in range(4):  # warm-up, record, then replays on new data
            i, w = skewed_routing(24, 8, 2, seed=30 + step)
            hidden.copy_(torch.randn(24, 16, generator=g))
            index.copy_(i)
            weights.copy_(w)
            out = compiled(hidden, index, weights).clone()
            eager = run_experts(experts, hidden, index, weights, "idempotent")
            torch.testing.assert_close(out, eager, **tol)


@pytest.mark.gpu
def test_gpu_decode_path_equals_the_general_fused_path():
    """The decode path (straight calls over the module's scratch
    intermediates) gives the general fused path's bits at every batch size,
    dropless and with a capacity, as the batch size changes between
    forwards; an earlier output is never touched by a later forward."""
    from idempotent_moe.integrations import _fused

    hf.register()
    block = cuda_block(1024, 3584, "bfloat16")
    experts = block.experts
    g = torch.Generator(device="cuda").manual_seed(3)
    kept = []
    for tokens, factor in [(1, None), (8, None), (1, None), (32, 1.0), (8, 0.5), (8, None)]:
        x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            _, weights, index = block.gate(x)
            capacity = None if factor is None else _fused.expert_capacity(tokens, 2, 8, factor)
            plan = _fused._plan(experts, x)
            assert plan.lean
            lean, lean_dropped = _fused.forward(experts, x, index, weights, capacity)
            assert experts.__dict__["_idempotent_scratch"].key[:3] == (tokens, 2, capacity)
            experts.__dict__["_idempotent_plan"] = plan._replace(lean=False)
            general, general_dropped = _fused.forward(experts, x, index, weights, capacity)
            experts.__dict__["_idempotent_plan"] = plan
        assert torch.equal(lean, general)
        if capacity is not None:
            assert int(lean_dropped) == int(general_dropped)
        kept.append((lean, lean.clone()))
    torch.cuda.synchronize()
    assert all(torch.equal(out, copy) for out, copy in kept)


@pytest.mark.gpu
def test_gpu_dropless_peak_memory_is_at_most_half_of_grouped_mm():
    """W4 at 4096 tokens: the dropless forward's peak transient allocation is
    at most half of grouped_mm's."""
    hf.register()
    block = cuda_block(4096, 14336, "bfloat16")
    x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    for name in ("grouped_mm", "idempotent"):
        block_output(block, x, name)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = block_output(block, x, name)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - before
        del out
    assert peaks["idempotent"] * 2 <= peaks["grouped_mm"], peaks


@pytest.mark.gpu
# tokens: the default's three GEMMs (grouped_gemm, experts_gemm, grouped_mm)
@pytest.mark.parametrize("tokens", [1, 40, 300])
@pytest.mark.parametrize("factor", [None, 1.0])
def test_gpu_forward_never_synchronises_the_host(factor, tokens):
    hf.register()
    block = cuda_block(512, 1024, "bfloat16")
    x = torch.randn(1, tokens, 512, device="cuda", dtype=torch.bfloat16)
    block_output(block, x, "idempotent", factor)  # warm up (grouped_mm probe, allocator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            _, weights, index = block.gate(x.view(-1, 512))
            block.experts(x.view(-1, 512), index, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 40, 300])
@pytest.mark.parametrize("factor", [None, 0.8])
def test_gpu_forward_captures_in_a_cuda_graph(factor, tokens):
    hf.register()
    block = cuda_block(512, 1024, "bfloat16")
    x = torch.randn(1, tokens, 512, device="cuda", dtype=torch.bfloat16)
    expected = block_output(block, x, "idempotent", factor)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            block(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = block(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_gpu_capacity_mode_matches_the_cpu():
    """The same routing (computed once, on the CPU) through capacity mode on
    both devices: the same drops, and outputs equal within fp32 rounding."""
    hf.register()
    cpu_experts = standalone_experts(num_experts=8, hidden=256, intermediate=512)
    gpu_experts = standalone_experts(num_experts=8, hidden=256, intermediate=512).cuda()
    gpu_experts.load_state_dict(cpu_experts.state_dict())
    hidden = torch.randn(500, 256, generator=torch.Generator().manual_seed(16))
    index, weights = skewed_routing(500, 8, 2, seed=6, ties=True)
    with torch.no_grad():
        cpu = run_experts(cpu_experts, hidden, index, weights, "idempotent", 0.9)
        gpu = run_experts(gpu_experts, hidden.cuda(), index.cuda(), weights.cuda(), "idempotent", 0.9)
    cpu_stats, gpu_stats = cpu_experts.idempotent_stats, gpu_experts.idempotent_stats
    assert gpu_stats[:2] == cpu_stats[:2] and int(gpu_stats[2]) == int(cpu_stats[2]) > 0
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-3, atol=1e-3)  # GEMM shapes differ by device


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_gpu_hidden_states_in_another_dtype_keep_grouped_mm(tokens):
    """fp32 hidden states into bf16 experts: the library's GEMMs take one
    dtype, so the default keeps grouped_mm (which casts them) at every
    size, one row per expert included: its fp32 output, rounded to bf16, is
    what bf16 hidden states give through grouped_mm (the combine sums in
    fp32 and rounds once either way)."""
    from idempotent_moe.integrations import _fused

    hf.register()
    experts = standalone_experts(hidden=64, intermediate=96).to("cuda", torch.bfloat16)
    hidden = torch.randn(tokens, 64, device="cuda")
    index, weights = skewed_routing(tokens, 8, 2, seed=3)
    index, weights = index.cuda(), weights.cuda().to(torch.bfloat16)
    with torch.no_grad():
        plan = _fused._plan(experts, hidden)
        assert not plan.xg and _fused._gemm(experts, plan, tokens * 2) == "grouped_mm"
        mixed = run_experts(experts, hidden, index, weights, "idempotent")
        setattr(experts.config, hf.SMALL_M_GEMM_ATTR, False)
        setattr(experts.config, hf.EXPERTS_GEMM_ATTR, False)
        alike = run_experts(experts, hidden.to(torch.bfloat16), index, weights, "idempotent")
    assert mixed.dtype == torch.float32 and torch.equal(mixed.to(torch.bfloat16), alike)
