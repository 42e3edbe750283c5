"""The Hugging Face MoE integration: the "idempotent" experts implementation
(dropless and capacity mode) against transformers' eager experts and a plain
reference, generate(), from_pretrained, the counting-sort dispatch, the
in-place hook in both call forms of the original API with its autograd, import isolation, and the
W4 benchmark at smoke size. Tiny random models built from configs, on the CPU;
GPU checks under the `gpu` marker."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers' experts interface")

import idempotent_moe as imoe  # noqa: E402
from conftest import package_env  # noqa: E402
from idempotent_moe import integrations as hf  # noqa: E402
from idempotent_moe.integrations import _dispatch  # noqa: E402
from transformers import (  # noqa: E402
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
              pad_token_id=0, bos_token_id=None, eos_token_id=None)


def tiny_model(family: str, seed: int = 0):
    """A two-layer random model in fp32, eval mode. Mixtral routes top-2 of 8,
    Qwen3-MoE top-3 of 8 (more than two terms per token in the combine), OLMoE
    and GPT-OSS top-2 of 8."""
    torch.manual_seed(seed)
    if family == "mixtral":
        config = MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
        model = MixtralForCausalLM(config)
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, head_dim=8,
                                num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(config)
    elif family == "olmoe":
        config = OlmoeConfig(**COMMON, intermediate_size=24, num_experts=8, num_experts_per_tok=2)
        model = OlmoeForCausalLM(config)
    elif family == "gpt_oss":  # transposed weights, biases, an interleaved gate of its own
        config = GptOssConfig(**COMMON, intermediate_size=24, head_dim=8, num_local_experts=8,
                              num_experts_per_tok=2, layer_types=["full_attention"] * 2)
        model = GptOssForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_bias"):
                    p.normal_(0.0, 0.2)
    else:
        raise ValueError(family)
    return model.eval()


FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"]


def token_ids(batch: int, length: int, seed: int = 1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids, implementation: str):
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(ids).logits


def experts_modules(model) -> list:
    return [m for _, m in hf.hf_experts._experts_modules(model)]


# --------------------------------------------------------------------------- references


def expert_mlp(experts, x, e):
    """Expert e's MLP on x [n, H], as transformers' eager experts compute it."""
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])


def capacity_reference(experts, hidden, index, weights, capacity):
    """Straightforward capacity dropping: per expert, its assignments sorted by
    descending weight, ties to the lower token; the first C kept, the rest
    dropped. Returns (output [T, H], dropped count, {expert: kept tokens})."""
    out = torch.zeros_like(hidden)
    dropped, kept_sets = 0, {}
    for e in range(experts.num_experts):
        tokens, slots = torch.where(index == e)
        w = weights[tokens, slots]
        order = sorted(range(len(tokens)), key=lambda i: (-float(w[i].detach()), int(tokens[i])))
        keep = order[:capacity]
        dropped += len(order) - len(keep)
        kept_sets[e] = sorted(int(tokens[i]) for i in keep)
        if keep:
            keep = torch.tensor(keep, dtype=torch.long)
            y = expert_mlp(experts, hidden[tokens[keep]], e) * w[keep, None]
            out = out.index_add(0, tokens[keep], y)
    return out, dropped, kept_sets


def standalone_experts(num_experts=8, hidden=16, intermediate=24, seed=0):
    """A MixtralExperts module with N(0, 0.3) weights, outside any model."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate,
                           num_local_experts=num_experts, num_experts_per_tok=2)
    config._experts_implementation = "idempotent"
    experts = MixtralExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return experts


def skewed_routing(num_tokens, num_experts, top_k, seed=0, ties=False):
    """top-k routing that overloads the first experts; with `ties`, weights
    from a few values so that many assignments tie."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.linspace(2.0, 0.0, num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=g) + bias
    index = torch.topk(logits, top_k, dim=-1).indices
    if ties:
        weights = torch.tensor([0.25, 0.5, 0.75])[torch.randint(0, 3, index.shape, generator=g)]
    else:
        weights = torch.rand(index.shape, generator=g) + 0.05
    return index, weights


def run_experts(experts, hidden, index, weights, implementation, capacity_factor=None):
    experts.config._experts_implementation = implementation
    setattr(experts.config, hf.CAPACITY_FACTOR_ATTR, capacity_factor)
    return experts(hidden, index, weights)


# --------------------------------------------------------------------------- import and registration


def _run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=package_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_idempotent_moe_leaves_transformers_alone_and_registers_when_it_loads():
    out = _run_python("""
        import sys
        import idempotent_moe
        assert "transformers" not in sys.modules and "torch" not in sys.modules
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        import idempotent_moe.integrations as hf
        assert ALL_EXPERTS_FUNCTIONS["idempotent"] is hf.idempotent_experts_forward
        print("ok")
    """)
    assert out == "ok"


def test_import_after_transformers_registers_at_once():
    """A model built before `import idempotent_moe` takes the name too."""
    out = _run_python("""
        from transformers import MixtralConfig, MixtralForCausalLM
        model = MixtralForCausalLM(MixtralConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, vocab_size=50))
        import idempotent_moe
        model.set_experts_implementation("idempotent")
        assert model.config._experts_implementation == "idempotent"
        print("ok")
    """)
    assert out == "ok"


def test_integrations_import_without_torch_or_transformers():
    """The hook works on NumPy arrays where neither is installed."""
    out = _run_python("""
        import sys
        sys.modules["torch"] = None
        sys.modules["transformers"] = None
        import numpy as np
        import idempotent_moe.integrations as hf
        x = np.arange(2 * 6 * 3, dtype=np.float32).reshape(2, 6, 3)
        s = np.array([[0, 5, 1, 4, 2, 3], [9, 0, 0, 0, 8, 7]], dtype=np.float32)
        kept, idx = hf.HuggingFaceMoEInplaceHook(capacity=3)(x, s, return_indices=True)
        assert idx.tolist() == [[3, 1, 5], [0, 4, 5]] and kept.shape == (2, 3, 3)
        try:
            hf.register()
        except ImportError:
            print("ok")
    """)
    assert out == "ok"


def test_integrations_without_the_native_part_say_so():
    """With torch installed but idempotent_moe._C missing (a source tree not
    built), the error names the native part, not torch."""
    out = _run_python("""
        import sys
        sys.modules["idempotent_moe._C"] = None
        try:
            import idempotent_moe.integrations
        except ImportError as e:
            assert "native part" in str(e) and "needs torch" not in str(e), e
            print("ok")
    """)
    assert out == "ok"


def test_register_is_idempotent_and_custom_names_work():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    hf.register()
    hf.register()
    assert ALL_EXPERTS_FUNCTIONS["idempotent"] is hf.idempotent_experts_forward
    hf.register("idempotent_test_alias")
    model = tiny_model("mixtral")
    ids = token_ids(1, 8)
    torch.testing.assert_close(logits(model, ids, "idempotent_test_alias"), logits(model, ids, "idempotent"),
                               rtol=0, atol=0)


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
    from idempotent_moe.moe_ops import gated_act

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


# --------------------------------------------------------------------------- torch.compile


def _compiled_experts(experts, factor):
    def forward(hidden, index, weights):
        return hf.hf_experts.experts_forward(experts, hidden, index, weights, factor)

    return forward


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
        compiled = torch.compile(_compiled_experts(experts, None), backend="aot_eager", fullgraph=True)
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
        compiled = torch.compile(_compiled_experts(experts, 1.0), backend="aot_eager", fullgraph=True)
        out = compiled(hidden, index, weights)
    assert int(eager_stats[2]) > 0 and int(experts.idempotent_stats[2]) == int(eager_stats[2])
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, eager, **tol)


def test_compiled_dropless_is_differentiable_for_fp32():
    torch._dynamo.reset()
    experts = standalone_experts()
    hidden = torch.randn(20, 16, generator=torch.Generator().manual_seed(12))
    index, weights = skewed_routing(20, 8, 2, seed=7)
    eager = _grads(experts, hidden, index, weights, "idempotent")
    compiled = torch.compile(_compiled_experts(experts, None), backend="aot_eager", fullgraph=True)
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


# --------------------------------------------------------------------------- expert parallelism


def _expert_parallel_routing(num_tokens, num_experts, top_k, seed):
    """Routing as one rank of transformers' expert parallelism sees it: ids of
    other ranks' experts become num_experts (several per token at times), with
    weight 0."""
    g = torch.Generator().manual_seed(seed)
    index = torch.topk(torch.randn(num_tokens, 2 * num_experts, generator=g), top_k, dim=-1).indices
    weights = torch.rand(index.shape, generator=g) + 0.05
    foreign = index >= num_experts
    index = index.masked_fill(foreign, num_experts)
    weights = weights.masked_fill(foreign, 0.0)
    assert foreign.any() and (foreign.sum(1) == top_k).any() and (~foreign).any()
    return index, weights


def _local_reference(experts, hidden, index, weights):
    out = torch.zeros_like(hidden)
    for e in range(experts.num_experts):
        tokens, slots = torch.where(index == e)
        y = expert_mlp(experts, hidden[tokens], e) * weights[tokens, slots, None]
        out = out.index_add(0, tokens, y)
    return out


@pytest.mark.parametrize("factor", [None, 4.0, 0.3], ids=["dropless", "capacity-drops-none", "capacity"])
def test_expert_parallel_sentinel_ids_add_nothing(factor):
    experts = standalone_experts()
    experts._is_expert_parallel = True
    hidden = torch.randn(40, 16, generator=torch.Generator().manual_seed(13))
    index, weights = _expert_parallel_routing(40, 8, 2, seed=8)
    with torch.no_grad():
        ours = run_experts(experts, hidden, index, weights, "idempotent", factor)
    if factor is None or factor == 4.0:
        expected = _local_reference(experts, hidden, index, weights)
    else:
        capacity = math.ceil(40 * 2 / 8 * factor)
        expected, dropped, _ = capacity_reference(experts, hidden, index, weights, capacity)
        assert experts.idempotent_stats[2].item() == dropped > 0
        assert int(experts.idempotent_stats[0]) == int((index < 8).sum())
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factor", [None, 4.0])
def test_expert_parallel_matches_transformers_grouped_mm(factor):
    import inspect

    from transformers.integrations import moe

    if "_is_expert_parallel" not in inspect.getsource(moe.grouped_mm_experts_forward):
        pytest.skip("this transformers' grouped_mm has no expert-parallel sentinels")
    experts = standalone_experts()
    experts._is_expert_parallel = True
    hidden = torch.randn(40, 16, generator=torch.Generator().manual_seed(14))
    index, weights = _expert_parallel_routing(40, 8, 2, seed=9)
    ours = _grads(experts, hidden, index, weights, "idempotent", factor)
    grouped = _grads(experts, hidden, index, weights, "grouped_mm")
    for a, b in zip(ours, grouped):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs keep torch's allocation defaults")
def test_cpu_runs_poison_uninitialized_memory():
    """conftest.poison_uninitialized_memory: what torch allocates and no one
    writes reads NaN, inside its ops too (the rows grouped_mm leaves past the
    last offset)."""
    assert torch.empty(8).isnan().all()
    x, w = torch.ones(4, 16), torch.ones(2, 16, 16)
    out = _dispatch.grouped_linear(x, w, torch.tensor([1, 2], dtype=torch.int32), True)
    assert (out[:2] == 16).all()
    if _dispatch.grouped_mm_usable(x, w):  # else a loop that writes zeros there
        assert out[2:].isnan().all()


def test_expert_parallel_gradients_ignore_what_grouped_mm_leaves_unwritten(monkeypatch):
    """grouped_mm leaves the rows past offsets[-1] (other ranks' assignments)
    unwritten: whatever they hold, NaN included, reaches no gradient."""
    from idempotent_moe.integrations import _dispatch as dispatch_module

    grouped_linear = dispatch_module.grouped_linear

    def unwritten_rows_nan(x, weight, offsets, transposed):
        out = grouped_linear(x, weight, offsets, transposed)
        past = (torch.arange(out.shape[0]) >= offsets[-1]).unsqueeze(-1)
        return out.masked_fill(past, float("nan"))

    experts = standalone_experts()
    experts._is_expert_parallel = True
    hidden = torch.randn(40, 16, generator=torch.Generator().manual_seed(14))
    index, weights = _expert_parallel_routing(40, 8, 2, seed=9)
    clean = _grads(experts, hidden, index, weights, "idempotent")
    monkeypatch.setattr(dispatch_module, "grouped_linear", unwritten_rows_nan)
    poisoned = _grads(experts, hidden, index, weights, "idempotent")
    for a, b in zip(poisoned, clean):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_expert_parallel_sentinels_only_where_the_module_is_split(monkeypatch):
    from idempotent_moe.integrations import _fused

    monkeypatch.setattr(_fused, "trains", lambda experts: False)  # training on the torch path
    experts = standalone_experts()
    index, weights = _expert_parallel_routing(10, 8, 2, seed=10)
    for grad in (False, True):  # the fused path (inference), the torch path
        with pytest.raises(ValueError, match=r"outside \[0, num_experts = 8\)|must lie in \[0, 8\)"):
            run_experts(experts, torch.randn(10, 16, requires_grad=grad), index, weights, "idempotent")
    experts._is_expert_parallel = True
    # Both paths check that a token's local experts are distinct (the fused
    # path in the C dispatch); other ranks' ids (8) may repeat.
    for grad in (False, True):  # a local expert twice
        with pytest.raises(ValueError, match="distinct"):
            run_experts(experts, torch.randn(2, 16, requires_grad=grad), torch.tensor([[3, 3], [8, 8]]),
                        torch.ones(2, 2), "idempotent")


def test_sort_by_expert_puts_sentinels_last():
    index = torch.tensor([[4, 1], [0, 4], [1, 2], [4, 4]])
    d = _dispatch.sort_by_expert(index, 4, sentinels=True)
    assert d.offsets.tolist() == [1, 3, 4, 4]
    assert d.local.tolist() == [[False, True], [True, False], [True, True], [False, False]]
    assert sorted(d.dest[~d.local].tolist()) == [4, 5, 6, 7]
    assert d.expert_of.tolist() == [0, 1, 1, 2, 3, 3, 3, 3]


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


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("factor", [None, 0.5, 1.0, 1.3])
def test_experts_implementation_and_expert_parallel_dispatcher_agree(tmp_path, factor, ties):
    """The same routing through the experts implementation and through
    ExpertParallelDispatcher on one gloo rank: the same capacity, the same
    assignments dropped (ties to the lower token), the same output; and both
    refuse the same capacity factors."""
    import torch.distributed as dist
    from idempotent_moe.distributed import ExpertParallelDispatcher

    num_tokens, num_experts, top_k = 37, 8, 2
    experts = standalone_experts(num_experts)
    hidden = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(9))
    index, weights = skewed_routing(num_tokens, num_experts, top_k, seed=4, ties=ties)
    with torch.no_grad():
        ours = run_experts(experts, hidden, index, weights, "idempotent", factor)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        dispatcher = ExpertParallelDispatcher(num_experts, top_k, capacity_factor=factor)
        with torch.no_grad():
            theirs = dispatcher(hidden, index, weights, lambda e, x: expert_mlp(experts, x, e))
        for bad, error in [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                           (float("inf"), ValueError), ("1.0", TypeError), (True, TypeError)]:
            with pytest.raises(error):
                ExpertParallelDispatcher(num_experts, top_k, capacity_factor=bad)
            with pytest.raises(error):
                hf.set_capacity_factor(experts, bad)
    finally:
        dist.destroy_process_group()
    stats = dispatcher.last_stats
    if factor is None:
        assert experts.idempotent_stats is None and stats.capacity is None and stats.dropped == 0
    else:
        assignments, capacity, dropped = experts.idempotent_stats
        assert (assignments, capacity) == (num_tokens * top_k, stats.capacity)
        assert int(dropped) == stats.dropped
        if factor < 1.3:
            assert stats.dropped > 0  # the skewed routing overflows the first experts
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


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


def _grads(experts, hidden, index, weights, implementation, factor=None):
    hidden = hidden.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    experts.zero_grad()
    out = run_experts(experts, hidden, index, weights, implementation, factor)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out, hidden.grad, weights.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()


def test_dropless_gradients_match_eager():
    experts = standalone_experts()
    hidden = torch.randn(30, 16, generator=torch.Generator().manual_seed(9))
    index, weights = skewed_routing(30, 8, 2, seed=4)
    ours = _grads(experts, hidden, index, weights, "idempotent")
    eager = _grads(experts, hidden, index, weights, "eager")
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_capacity_gradients_match_the_reference():
    experts = standalone_experts()
    hidden = torch.randn(30, 16, generator=torch.Generator().manual_seed(10))
    index, weights = skewed_routing(30, 8, 2, seed=5)
    ours = _grads(experts, hidden, index, weights, "idempotent", 0.75)

    h = hidden.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    experts.zero_grad()
    out, _, _ = capacity_reference(experts, h, index, w, math.ceil(30 * 2 / 8 * 0.75))
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    reference = (out, h.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


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


# --------------------------------------------------------------------------- GPU (on the GPU machine)


def _cuda_block(hidden, intermediate, dtype, seed=0):
    from imoe_bench import w4

    return w4.build_block(w4.Block(hidden, intermediate, 8, 2, (), dtype), "cuda", seed)


def _block_output(block, x, implementation, factor=None):
    from imoe_bench import w4

    w4._use(block, implementation, factor)
    with torch.no_grad():
        return block(x)


@pytest.mark.gpu
@pytest.mark.parametrize("factor", [None, 1.25])
def test_gpu_large_batches_run_the_fused_gate_in_row_chunks(monkeypatch, factor):
    """Above GATE_UP_CHUNK_BYTES an eager CUDA forward runs the fused gate in
    row chunks (gated_row_chunks), dropless and with a capacity, and gives
    the whole fused gate's output up to bf16 rounding (its GEMMs have other
    row counts)."""
    from idempotent_moe.integrations import _fused

    hf.register()
    block = _cuda_block(1024, 3584, "bfloat16")
    x = torch.randn(1, 4096, 1024, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(4))
    calls = []
    real = _fused.gated_row_chunks
    monkeypatch.setattr(_fused, "gated_row_chunks", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(_dispatch, "GATE_UP_CHUNK_BYTES", 16 << 20)
    chunked = _block_output(block, x, "idempotent", factor)
    assert calls and calls[0] > 1, calls
    monkeypatch.setattr(_dispatch, "GATE_UP_CHUNK_BYTES", 1 << 40)
    whole = _block_output(block, x, "idempotent", factor)
    assert len(calls) == 1
    torch.testing.assert_close(chunked, whole, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 4096])
@pytest.mark.parametrize("hidden,intermediate", [(1024, 3584), (4096, 14336)])
def test_gpu_dropless_matches_grouped_mm(hidden, intermediate, tokens):
    """Bit-identical to grouped_mm where the GEMM shapes are grouped_mm's own;
    where the gate runs in chunks (a large batch: row chunks of the fused
    gate), no further from the experts in fp32 than grouped_mm is."""
    from imoe_bench import w4

    hf.register()
    block = _cuda_block(hidden, intermediate, "bfloat16")
    x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16)
    grouped = _block_output(block, x, "grouped_mm")
    ours = _block_output(block, x, "idempotent")
    with torch.no_grad():
        chunks = _dispatch._gated_chunks(block.experts, torch.empty(tokens * 2, hidden, device="meta"),
                                         torch.bfloat16)
        exact = w4.fp32_reference(block, x)
    if chunks == 1:
        assert torch.equal(ours, grouped)
    else:
        err_ours = (ours.float() - exact).abs().mean()
        err_grouped = (grouped.float() - exact).abs().mean()
        assert torch.equal(ours, grouped) or err_ours <= err_grouped * 1.01


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
    compiled = torch.compile(_compiled_experts(experts, None), mode="reduce-overhead", fullgraph=True)
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
    block = _cuda_block(1024, 3584, "bfloat16")
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
    block = _cuda_block(4096, 14336, "bfloat16")
    x = torch.randn(1, 4096, 4096, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    for name in ("grouped_mm", "idempotent"):
        _block_output(block, x, name)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = _block_output(block, x, name)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - before
        del out
    assert peaks["idempotent"] * 2 <= peaks["grouped_mm"], peaks


@pytest.mark.gpu
@pytest.mark.parametrize("factor", [None, 1.0])
def test_gpu_forward_never_synchronises_the_host(factor):
    hf.register()
    block = _cuda_block(512, 1024, "bfloat16")
    x = torch.randn(1, 300, 512, device="cuda", dtype=torch.bfloat16)
    _block_output(block, x, "idempotent", factor)  # warm up (grouped_mm probe, allocator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            _, weights, index = block.gate(x.view(-1, 512))
            block.experts(x.view(-1, 512), index, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("factor", [None, 0.8])
def test_gpu_forward_captures_in_a_cuda_graph(factor):
    hf.register()
    block = _cuda_block(512, 1024, "bfloat16")
    x = torch.randn(1, 256, 512, device="cuda", dtype=torch.bfloat16)
    expected = _block_output(block, x, "idempotent", factor)
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
