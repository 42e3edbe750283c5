"""The "idempotent" experts implementation of transformers' experts
interface, on tiny random models built from configs and on standalone
experts, on the CPU: dropless against eager (logits, greedy generate(),
from_pretrained, skewed routing, the per-expert loop, the gate in column or
row chunks, the counting-sort dispatch), capacity mode against a plain
reference (the lowest-weight overflow dropped, ties to the lower token), the
post-expert norm, and the gradients. torch.compile, expert parallelism and
CUDA: the other test_hf_experts* and test_hf_expert_parallel* files."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers' experts interface")

from _helpers.hf_models import (  # noqa: E402
    FAMILIES,
    capacity_reference,
    expert_mlp,
    experts_grads,
    experts_modules,
    logits,
    run_experts,
    skewed_routing,
    standalone_experts,
    tiny_model,
    token_ids,
)
from idempotent_moe import integrations as hf  # noqa: E402
from idempotent_moe.integrations import _dispatch  # noqa: E402
from transformers import MixtralForCausalLM  # noqa: E402

# --------------------------------------------------------------------------- dropless mode


@pytest.mark.parametrize("family", FAMILIES)
def test_dropless_matches_eager(family):
    model = tiny_model(family)
    ids = token_ids(3, 20)
    eager = logits(model, ids, "eager")
    ours = logits(model, ids, "idempotent")
    assert model.config._experts_implementation == "idempotent"
    assert all(m.config._experts_implementation == "idempotent" for m in experts_modules(model))
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    assert hf.capacity_stats(model) == {}  # dropless records no drops
    # and back: the model is eager again
    torch.testing.assert_close(logits(model, ids, "eager"), eager, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_greedy_generate_is_identical_to_eager(family):
    model = tiny_model(family, seed=3)
    ids = token_ids(2, 10, seed=4)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                  pad_token_id=0)
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = model.generate(ids, **kwargs)
        model.set_experts_implementation("idempotent")
        ours = model.generate(ids, **kwargs)
    assert eager.shape == (2, 22)
    assert torch.equal(ours, eager)


def test_from_pretrained_with_experts_implementation(tmp_path):
    model = tiny_model("mixtral")
    hf.set_capacity_factor(model, 0.75)  # a config attribute: saved with the model
    model.save_pretrained(tmp_path)
    loaded = MixtralForCausalLM.from_pretrained(tmp_path, experts_implementation="idempotent")
    assert loaded.config._experts_implementation == "idempotent"
    assert getattr(loaded.config, hf.CAPACITY_FACTOR_ATTR) == 0.75
    ids = token_ids(2, 16)
    with torch.no_grad():
        out = loaded(ids).logits
    stats = hf.capacity_stats(loaded)
    assert sorted(stats) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(s.capacity == math.ceil(32 * 2 / 8 * 0.75) for s in stats.values())
    model.set_experts_implementation("idempotent")
    torch.testing.assert_close(out, logits(model, ids, "idempotent"), rtol=0, atol=0)


def test_use_idempotent_experts_switches_mode_and_implementation():
    model = tiny_model("qwen3_moe")
    ids = token_ids(2, 12)
    eager = logits(model, ids, "eager")
    assert hf.use_idempotent_experts(model) is model
    assert model.config._experts_implementation == "idempotent"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, eager, rtol=1e-5, atol=1e-5)
    hf.use_idempotent_experts(model, capacity_factor=0.5)
    with torch.no_grad():
        model(ids)
    assert all(s.dropped > 0 for s in hf.capacity_stats(model).values())
    hf.set_capacity_factor(model, None)
    with torch.no_grad():
        model(ids)
    assert hf.capacity_stats(model) == {}


def test_dropless_experts_match_eager_on_skewed_routing():
    experts = standalone_experts()
    hidden = torch.randn(40, 16, generator=torch.Generator().manual_seed(5))
    index, weights = skewed_routing(40, 8, 2)
    with torch.no_grad():
        eager = run_experts(experts, hidden, index, weights, "eager")
        ours = run_experts(experts, hidden, index, weights, "idempotent")
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-6)


def test_per_expert_loop_matches_grouped_mm(monkeypatch):
    """Where torch has no grouped_mm, a loop over the experts stands in."""
    experts = standalone_experts()
    hidden = torch.randn(33, 16, generator=torch.Generator().manual_seed(6))
    index, weights = skewed_routing(33, 8, 2, seed=1)
    with torch.no_grad():
        grouped = run_experts(experts, hidden, index, weights, "idempotent")
        monkeypatch.setattr(_dispatch, "grouped_mm_usable", lambda x, w: False)
        looped = run_experts(experts, hidden, index, weights, "idempotent")
    torch.testing.assert_close(looped, grouped, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", [None, torch.nn.Tanh()], ids=["silu", "tanh"])
@pytest.mark.parametrize("factor", [None, 0.9])
def test_large_batches_run_the_gate_in_column_chunks(monkeypatch, factor, act):
    """Above GATE_UP_CHUNK_BYTES the gate/up projection runs in column chunks
    (multiples of 64 features, the last one short): same result as whole,
    with an activation the library runs in place (SiLU) or the module's own
    (Tanh, not one it knows)."""
    experts = standalone_experts(hidden=16, intermediate=200)
    if act is not None:
        experts.act_fn = act
    hidden = torch.randn(64, 16, generator=torch.Generator().manual_seed(7))
    index, weights = skewed_routing(64, 8, 2, seed=2)
    with torch.no_grad():
        whole = run_experts(experts, hidden, index, weights, "idempotent", factor)
        monkeypatch.setattr(_dispatch, "GATE_UP_CHUNK_BYTES", 4096)
        calls = []
        real = _dispatch._gated_chunked
        monkeypatch.setattr(_dispatch, "_gated_chunked",
                            lambda *a: calls.append(a[-1]) or real(*a))
        chunked = run_experts(experts, hidden, index, weights, "idempotent", factor)
    assert calls and calls[0] > 1  # 200 features in chunks of 64: 64, 64, 64, 8
    # a CPU GEMM's sums may block differently by output width: not bit for bit
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("chunks", [2, 3, 7])
def test_row_chunks_compute_each_chunks_fused_gate(chunks, act):
    """gated_row_chunks: each row chunk's grouped GEMM over its clipped
    offsets, then gated_act into its rows, is the whole fused gate, with
    experts that start and end inside chunks, an empty expert, and rows past
    offsets[-1] (no expert's) left unwritten."""
    from idempotent_moe.integrations import _fused
    from idempotent_moe.moe import gated_act

    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 16, generator=g)
    w_up = torch.randn(4, 16, 2 * 24, generator=g) * 0.3  # [E, in, 2I], GEMM layout
    offsets = torch.tensor([9, 9, 23, 37], dtype=torch.int32)  # expert 1 empty; rows 37-39 no one's

    def gemm(a, w, offs):
        return _dispatch.grouped_linear(a, w, offs, True)

    seen = []

    def spy(a, w, offs):
        seen.append(offs.tolist())
        return gemm(a, w, offs)

    with torch.no_grad():
        got = _fused.gated_row_chunks(spy, x, w_up, offsets, act, chunks)
        want = gated_act(gemm(x, w_up, offsets), act, limit=offsets)
    step = -(-40 // chunks)
    last = step * (chunks - 1)
    assert len(seen) == chunks
    assert seen[0] == [min(o, step) for o in (9, 9, 23, 37)]
    assert seen[-1] == [min(max(o, last), 40) - last for o in (9, 9, 23, 37)]
    assert got.shape == (40, 24)
    torch.testing.assert_close(got[:37], want[:37], rtol=1e-6, atol=1e-6)
    if torch.utils.deterministic.fill_uninitialized_memory and torch.are_deterministic_algorithms_enabled():
        assert torch.isnan(got[37:]).all()  # never written (conftest poisons new memory)


@pytest.mark.parametrize("module,name", [
    (torch.nn.SiLU(), "silu"), (torch.nn.ReLU(), "relu"),
    (torch.nn.GELU(), "gelu"), (torch.nn.GELU(approximate="tanh"), "gelu_tanh")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_chunks_apply_the_activation_in_place_bit_for_bit(module, name, dtype):
    """A chunk's activation runs in its gate buffer (one temporary fewer at
    prefill sizes) with the module's own values."""
    x = (torch.randn(257, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    assert _dispatch.activation_name(module) == name
    buf = x.clone()
    got = _dispatch._INPLACE_ACT[name](buf)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(got, module(x))


@pytest.mark.parametrize("factor", [None, 0.9])
def test_the_gathered_rows_are_freed_before_the_down_projection(monkeypatch, factor):
    """The fused forward holds the dispatch's rows [S, H] only through the
    up projection: at prefill sizes the down projection's output [S, H] then
    takes their place instead of adding to the peak."""
    import weakref

    from idempotent_moe.integrations import _fused

    experts = standalone_experts(hidden=16, intermediate=200)
    hidden = torch.randn(64, 16, generator=torch.Generator().manual_seed(7))
    index, weights = skewed_routing(64, 8, 2, seed=2)
    with torch.no_grad():
        want = run_experts(experts, hidden, index, weights, "idempotent", factor)
        seen, alive = [], []
        real_dispatch, real_output = _fused.moe_dispatch, _dispatch.expert_output

        def dispatch(*a, **k):
            d = real_dispatch(*a, **k)
            seen.append(weakref.ref(d.rows))
            return d

        def output(*a):
            alive.append(seen[-1]() is not None)
            return real_output(*a)

        monkeypatch.setattr(_fused, "moe_dispatch", dispatch)
        monkeypatch.setattr(_dispatch, "expert_output", output)
        got = run_experts(experts, hidden, index, weights, "idempotent", factor)
    assert alive == [False]
    assert torch.equal(got, want)


def test_column_chunks_only_without_gradients_and_with_the_default_gate(monkeypatch):
    monkeypatch.setattr(_dispatch, "GATE_UP_CHUNK_BYTES", 4096)
    experts = standalone_experts(hidden=16, intermediate=200)
    x = torch.zeros(64, 16)
    with torch.no_grad():
        assert _dispatch._gated_chunks(experts, x, torch.float32) > 1
    assert _dispatch._gated_chunks(experts, x, torch.float32) == 1  # parameters require grad
    gpt_oss = experts_modules(tiny_model("gpt_oss"))[0]  # its own interleaved gate
    with torch.no_grad():
        assert _dispatch._gated_chunks(gpt_oss, torch.zeros(64, 32), torch.float32) == 1


def test_zero_tokens():
    experts = standalone_experts()
    empty = torch.zeros(0, 16)
    index = torch.zeros(0, 2, dtype=torch.long)
    for factor in (None, 1.0):
        out = run_experts(experts, empty, index, torch.zeros(0, 2), "idempotent", factor)
        assert out.shape == (0, 16)


def test_sort_by_expert_is_a_stable_counting_sort():
    num_tokens, num_experts, top_k = 50, 6, 3
    index, _ = skewed_routing(num_tokens, num_experts, top_k, seed=2)
    d = _dispatch.sort_by_expert(index, num_experts)
    counts = torch.bincount(index.reshape(-1), minlength=num_experts)
    assert d.offsets.dtype == torch.int32
    assert d.offsets.tolist() == counts.cumsum(0).tolist()
    # rows are sorted by expert, and by token within an expert
    assert torch.equal(d.expert_of, torch.sort(index.reshape(-1)).values)
    key = d.expert_of * num_tokens + d.src_token
    assert bool((key[1:] > key[:-1]).all())
    # dest is where each assignment went
    tokens = torch.arange(num_tokens).unsqueeze(1).expand(num_tokens, top_k)
    assert torch.equal(d.src_token[d.dest], tokens)
    assert torch.equal(d.expert_of[d.dest], index)
    assert sorted(d.dest.reshape(-1).tolist()) == list(range(num_tokens * top_k))


def test_sort_by_expert_rejects_a_repeated_expert():
    index = torch.tensor([[0, 1], [2, 2]])
    with pytest.raises(ValueError, match="distinct"):
        _dispatch.sort_by_expert(index, 4)


def test_sort_by_expert_rejects_an_expert_out_of_range():
    for bad in (torch.tensor([[0, 1], [2, 4]]), torch.tensor([[0, -1], [2, 3]])):
        with pytest.raises(ValueError, match=r"top_k_index must lie in \[0, 4\)"):
            _dispatch.sort_by_expert(bad, 4)


# --------------------------------------------------------------------------- post-expert norm


def _with_post_expert_norm(experts):
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    experts.post_expert_norm = norm
    experts.has_post_expert_norm = True
    return experts


@pytest.mark.parametrize("factor", [None, 0.75])
def test_post_expert_norm_is_applied_before_the_routing_weights(factor):
    experts = _with_post_expert_norm(standalone_experts())
    hidden = torch.randn(30, 16, generator=torch.Generator().manual_seed(15))
    index, weights = skewed_routing(30, 8, 2, seed=11)
    with torch.no_grad():
        ours = run_experts(experts, hidden, index, weights, "idempotent", factor)
        capacity = 30 if factor is None else math.ceil(30 * 2 / 8 * factor)
        expected = torch.zeros_like(hidden)
        _, _, kept = capacity_reference(experts, hidden, index, weights, capacity)
        for e, tokens in kept.items():
            tokens = torch.tensor(tokens, dtype=torch.long)
            slots = (index[tokens] == e).long().argmax(1)
            y = experts.post_expert_norm(expert_mlp(experts, hidden[tokens], e))
            expected = expected.index_add(0, tokens, y * weights[tokens, slots, None])
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_post_expert_norm_matches_transformers_grouped_mm():
    import inspect

    from transformers.integrations import moe

    if "has_post_expert_norm" not in inspect.getsource(moe.grouped_mm_experts_forward):
        pytest.skip("this transformers has no post-expert norm")
    experts = _with_post_expert_norm(standalone_experts())
    hidden = torch.randn(30, 16, generator=torch.Generator().manual_seed(16))
    index, weights = skewed_routing(30, 8, 2, seed=12)
    with torch.no_grad():
        ours = run_experts(experts, hidden, index, weights, "idempotent")
        grouped = run_experts(experts, hidden, index, weights, "grouped_mm")
    torch.testing.assert_close(ours, grouped, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- capacity mode


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.3])
def test_capacity_drops_the_lowest_weight_overflow(factor, ties):
    num_tokens, num_experts, top_k = 37, 8, 2
    experts = standalone_experts(num_experts)
    hidden = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(7))
    index, weights = skewed_routing(num_tokens, num_experts, top_k, seed=3, ties=ties)
    capacity = math.ceil(num_tokens * top_k / num_experts * factor)
    with torch.no_grad():
        out = run_experts(experts, hidden, index, weights, "idempotent", factor)
        expected, dropped, _ = capacity_reference(experts, hidden, index, weights, capacity)
    assert dropped > 0
    assert experts.idempotent_stats[:2] == (num_tokens * top_k, capacity)
    assert int(experts.idempotent_stats[2]) == dropped
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_capacity_keeps_the_lower_token_on_a_tie():
    """Four tokens, all on expert 0 with equal weight, capacity 2: tokens 0
    and 1 are kept; a token dropped from one expert still gets its other."""
    experts = standalone_experts(num_experts=4)
    hidden = torch.randn(4, 16, generator=torch.Generator().manual_seed(8))
    index = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]])
    weights = torch.full((4, 2), 0.5)
    with torch.no_grad():  # C = ceil(4 * 2 / 4 * 1.0) = 2
        out = run_experts(experts, hidden, index, weights, "idempotent", 1.0)
        expected, dropped, kept = capacity_reference(experts, hidden, index, weights, 2)
    assert kept == {0: [0, 1], 1: [0, 3], 2: [1], 3: [2]} and dropped == 2
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[2], 0.5 * expert_mlp(experts, hidden[2:3], 3)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_capacity_mode_in_a_model_matches_the_reference_per_layer(family):
    model = tiny_model(family, seed=5)
    hf.use_idempotent_experts(model, capacity_factor=0.6)
    captured = []
    handles = [m.register_forward_hook(lambda mod, args, out: captured.append((mod, args, out)))
               for m in experts_modules(model)]
    ids = token_ids(2, 24, seed=6)
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    stats = hf.capacity_stats(model)
    assert len(captured) == len(stats) == 2
    k = model.config.num_experts_per_tok
    for (module, (hidden, index, weights), out), s in zip(captured, stats.values()):
        capacity = math.ceil(48 * k / 8 * 0.6)
        expected, dropped, _ = capacity_reference(module, hidden, index, weights, capacity)
        assert s == hf.CapacityStats(48 * k, capacity, dropped) and dropped > 0
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_a_large_capacity_factor_drops_nothing_and_equals_dropless(family):
    model = tiny_model(family, seed=2)
    ids = token_ids(2, 16)
    dropless = logits(model, ids, "idempotent")
    hf.set_capacity_factor(model, 8.0)  # C = ceil(T * k / E * 8) >= T: every assignment fits
    with torch.no_grad():
        capped = model(ids).logits
    stats = hf.capacity_stats(model)
    assert stats and all(s.dropped == 0 and s.capacity == 32 for s in stats.values())
    torch.testing.assert_close(capped, dropless, rtol=1e-5, atol=1e-5)


def test_capacity_factor_is_validated():
    model = tiny_model("mixtral")
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            hf.set_capacity_factor(model, bad)
    for bad in ("1.0", True):
        with pytest.raises(TypeError):
            hf.set_capacity_factor(model, bad)
    with pytest.raises(ValueError, match="experts"):
        hf.set_capacity_factor(torch.nn.Linear(2, 2), 1.0)
    model.config.idempotent_capacity_factor = -2  # set by hand: caught at the forward
    model.set_experts_implementation("idempotent")
    with pytest.raises(ValueError), torch.no_grad():
        model(token_ids(1, 4))


# --------------------------------------------------------------------------- gradients of the experts


def test_dropless_gradients_match_eager():
    experts = standalone_experts()
    hidden = torch.randn(30, 16, generator=torch.Generator().manual_seed(9))
    index, weights = skewed_routing(30, 8, 2, seed=4)
    ours = experts_grads(experts, hidden, index, weights, "idempotent")
    eager = experts_grads(experts, hidden, index, weights, "eager")
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_capacity_gradients_match_the_reference():
    experts = standalone_experts()
    hidden = torch.randn(30, 16, generator=torch.Generator().manual_seed(10))
    index, weights = skewed_routing(30, 8, 2, seed=5)
    ours = experts_grads(experts, hidden, index, weights, "idempotent", 0.75)

    h = hidden.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    experts.zero_grad()
    out, _, _ = capacity_reference(experts, h, index, w, math.ceil(30 * 2 / 8 * 0.75))
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    reference = (out, h.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("xg_attr", [None, True, False])
@pytest.mark.parametrize("small_m_attr", [None, True, False])
def test_the_gemm_is_chosen_in_one_place_by_rows_per_expert_and_the_switches(xg_attr, small_m_attr):
    """_fused._gemm: where the plan allows experts_gemm (eager, CUDA,
    fp16/bf16, the fused gate) and a switch is unset, the default takes
    grouped_gemm at one row per expert, experts_gemm up to
    XG_ROWS_PER_EXPERT, grouped_mm above; a switch set True or False decides
    for its GEMM; a plan without experts_gemm (traced, float32) keeps
    grouped_mm unless small_m_gemm is True."""
    import types

    from idempotent_moe.integrations import _fused

    experts = types.SimpleNamespace(num_experts=8, config=types.SimpleNamespace())
    for attr, value in ((hf.EXPERTS_GEMM_ATTR, xg_attr), (hf.SMALL_M_GEMM_ATTR, small_m_attr)):
        if value is not None:
            setattr(experts.config, attr, value)
    limit = _fused.XG_ROWS_PER_EXPERT
    for xg_plan in (True, False):
        plan = _fused._Plan(None, None, None, True, "silu", 16, True, True, xg_plan)
        for rows in (1, 2, 8, 9, 16, 32, 8 * limit, 8 * limit + 1, 4096):
            per_expert = -(-rows // min(8, rows))
            if xg_plan and xg_attr is True:
                want = "xg"
            elif small_m_attr is True and rows <= _fused.SMALL_M_ROWS_PER_EXPERT * 8:
                want = "small_m"
            elif xg_plan and small_m_attr is None and per_expert == 1:
                want = "small_m"
            elif xg_plan and xg_attr is None and per_expert <= limit:
                want = "xg"
            else:
                want = "grouped_mm"
            assert _fused._gemm(experts, plan, rows) == want, (xg_plan, rows)
    # the default itself, spelled out
    if xg_attr is None and small_m_attr is None:
        plan = _fused._Plan(None, None, None, True, "silu", 16, True, True, True)
        assert [_fused._gemm(experts, plan, r) for r in (2, 8, 16, 512, 513)] == \
            ["small_m", "small_m", "xg", "xg", "grouped_mm"]
