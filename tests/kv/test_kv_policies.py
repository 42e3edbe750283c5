"""The KV scoring policies (idempotent_moe.kv_policies) and where they plug in:

- each policy against a plain torch reference of its paper's definition,
  written with loops over heads, queries and tokens, on small seeded tensors
  with grouped-query attention (2 query heads per KV head);
- the transformers cache: with nothing evicted its logits equal a full
  cache's for every policy; the queries it records and the attention totals
  it keeps equal the model's own (eager attention weights); a prompt
  compressed layer by layer gives the logits of whole-cache compression at a
  lower peak, and those of a prompt cached whole and evicted afterwards
  (`evict(budget, score=...)`); teacher-forcing in chunks of evict_every
  equals decoding one token at a time;
- a user's policy through the protocol, and the dense, paged and vLLM-style
  entry points fed by a policy.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("the cache targets transformers 5.x", allow_module_level=True)

import idempotent_moe as imoe  # noqa: E402
from _helpers.hf_models import CACHE_ARG, tiny_llama  # noqa: E402
from idempotent_moe.integrations.hf_cache import InplaceEvictionCache  # noqa: E402
from idempotent_moe.integrations.vllm import VLLMInplaceCompactionHook  # noqa: E402
from idempotent_moe.kv_policies import (  # noqa: E402
    POLICIES,
    TOVA,
    ExpectedAttention,
    KeyDiff,
    KNorm,
    Observation,
    ObservedAttention,
    ScoringPolicy,
    SnapKV,
    StreamingLLM,
    as_policy,
    get_policy,
    score_kv,
)
from idempotent_moe.paged import compact_paged_, paged_policy_scores  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

B, HKV, G, L, D, W = 2, 2, 2, 13, 8, 4
HQ = HKV * G


def observation(seed=0, seen=None, with_totals=True):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, HKV, L, D, generator=g)
    values = torch.randn(B, HKV, L, D + 2, generator=g)
    # positions with gaps (some tokens were evicted), not in slot order
    base = torch.tensor([0, 1, 2, 5, 6, 8, 9, 11, 12, 14, 15, 16, 17])
    positions = torch.stack([base[torch.randperm(L, generator=g)] for _ in range(B * HKV)]).reshape(B, HKV, L)
    seen = 18 if seen is None else seen
    queries = torch.randn(B, HQ, W, D, generator=g)
    totals = torch.rand(B, HKV, L, generator=g) * 5 if with_totals else None
    return Observation(keys, values, positions, seen, queries, totals, None, 0)


def ref_attention_of_query(obs, b, hq, i):
    """Softmax over the cached tokens a window query i (position seen - W + i) sees."""
    h = hq // G
    qpos = obs.seen - W + i
    logits = torch.tensor([float(obs.queries[b, hq, i] @ obs.keys[b, h, j]) * D ** -0.5
                           if obs.positions[b, h, j] <= qpos else -math.inf for j in range(L)])
    return torch.softmax(logits, 0)


def test_streaming_llm_keeps_sinks_then_the_newest():
    obs = observation()
    s = StreamingLLM(sink_tokens=3).score(obs)
    for b in range(B):
        for h in range(HKV):
            for j in range(L):
                p = int(obs.positions[b, h, j])
                assert s[b, h, j] == (math.inf if p < 3 else float(p))


def test_knorm_and_keydiff_match_their_definitions():
    obs = observation(1)
    kn, kd = KNorm().score(obs), KeyDiff().score(obs)
    for b in range(B):
        for h in range(HKV):
            anchor = sum(obs.keys[b, h, j] for j in range(L)) / L
            for j in range(L):
                k = obs.keys[b, h, j]
                assert kn[b, h, j] == pytest.approx(-math.sqrt(float(k @ k)), rel=1e-5)
                cos = float(k @ anchor) / math.sqrt(float(k @ k) * float(anchor @ anchor))
                assert kd[b, h, j] == pytest.approx(-cos, rel=1e-4, abs=1e-6)


def test_tova_is_the_last_querys_attention_averaged_over_the_group():
    obs = observation(2)
    s = TOVA().score(obs)
    for b in range(B):
        for h in range(HKV):
            ref = sum(ref_attention_of_query(obs, b, h * G + g, W - 1) for g in range(G)) / G
            torch.testing.assert_close(s[b, h], ref, rtol=1e-5, atol=1e-6)


def test_observed_attention_is_the_mean_over_the_queries_that_saw_each_token():
    obs = observation(3)
    norm, plain = ObservedAttention().score(obs), ObservedAttention(normalize=False).score(obs)
    vatp = ObservedAttention(value_norm=1).score(obs)
    for b in range(B):
        for h in range(HKV):
            for j in range(L):
                seen_by = obs.seen - int(obs.positions[b, h, j])  # queries at positions >= p
                assert norm[b, h, j] == pytest.approx(float(obs.attention_totals[b, h, j]) / seen_by)
                assert plain[b, h, j] == obs.attention_totals[b, h, j]
                l1 = sum(abs(float(x)) for x in obs.values[b, h, j])  # VATP: times ||v||_1
                assert vatp[b, h, j] == pytest.approx(float(obs.attention_totals[b, h, j]) / seen_by * l1)
    with pytest.raises(ValueError):
        ObservedAttention(value_norm=0)


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_pools_the_windows_votes_and_keeps_the_window(pooling):
    obs = observation(4)
    kernel = 3
    s = SnapKV(window=W, kernel=kernel, pooling=pooling).score(obs)
    for b in range(B):
        for h in range(HKV):
            per_head = []
            for g in range(G):
                votes = sum(ref_attention_of_query(obs, b, h * G + g, i) for i in range(W))
                pooled = []
                for j in range(L):  # pooled along the slots, as cached
                    near = votes[max(0, j - kernel // 2): j + kernel // 2 + 1]
                    pooled.append(float(near.mean()) if pooling == "avg" else float(near.max()))
                per_head.append(torch.tensor(pooled))
            ref = sum(per_head) / G
            for j in range(L):
                if obs.positions[b, h, j] >= obs.seen - W:
                    assert s[b, h, j] == math.inf
                else:
                    assert float(s[b, h, j]) == pytest.approx(float(ref[j]), rel=1e-5, abs=1e-7)


def test_expected_attention_matches_the_gaussian_expectation():
    obs = observation(5)
    s = ExpectedAttention(window=W).score(obs)
    for b in range(B):
        for h in range(HKV):
            expected = torch.zeros(L, dtype=torch.float64)
            for g in range(G):
                q = obs.queries[b, h * G + g].double()  # [W, D]
                mu = q.mean(0)
                cov = (q - mu).T @ (q - mu) / (W - 1)
                logits = torch.tensor([float(mu @ obs.keys[b, h, j].double()) * D ** -0.5
                                       + 0.5 * D ** -1.0 * float(obs.keys[b, h, j].double() @ cov
                                                                  @ obs.keys[b, h, j].double())
                                       for j in range(L)], dtype=torch.float64)
                expected += torch.softmax(logits, 0) / G
            vnorm = obs.values[b, h].double().norm(dim=-1)
            torch.testing.assert_close(s[b, h].double(), expected * vnorm, rtol=1e-4, atol=1e-7)


def test_registry_and_bad_policies():
    assert set(POLICIES) == {"streaming_llm", "knorm", "keydiff", "tova", "observed_attention", "snapkv",
                             "expected_attention"}
    assert isinstance(get_policy("tova"), TOVA)
    with pytest.raises(ValueError, match="unknown policy"):
        get_policy("nope")
    with pytest.raises(TypeError):
        get_policy(3)
    with pytest.raises(ValueError, match="window >= 1"):
        as_policy(lambda obs: obs.keys[..., 0], needs=("queries",))
    with pytest.raises(ValueError, match="needs must name"):
        as_policy(lambda obs: obs.keys[..., 0], needs=("gradients",))
    with pytest.raises(ValueError, match="needs"):
        score_kv("tova", torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))
    with pytest.raises(ValueError, match="pooling"):
        SnapKV(pooling="median")


# --------------------------------------------------------------------------- the transformers cache


def ids(length=40, seed=1, batch=1):
    return torch.randint(0, 101, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(model, cache, tokens, steps, chunk=None):
    """A prompt, then `steps` tokens teacher-forced one at a time (or in
    chunks of `chunk`); the logits of every fed token after the prompt."""
    out = []
    with torch.no_grad():
        model(input_ids=tokens[:, :-steps], **{CACHE_ARG: cache})
        pos, end = tokens.shape[1] - steps, tokens.shape[1]
        while pos < end:
            stop = min(end, pos + (chunk or 1))
            out.append(model(input_ids=tokens[:, pos:stop], **{CACHE_ARG: cache}).logits)
            pos = stop
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_nothing_evicted_equals_the_full_cache(name):
    model, config = tiny_llama(attn="eager")
    tokens = ids(30)
    cache = InplaceEvictionCache(64, score=name, evict_every=4, config=config).attach(model)
    ours = run(model, cache, tokens, steps=8)
    ref = run(model, DynamicCache(config=config), tokens, steps=8)
    assert cache.layers[0].evictions == 0
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_recorded_queries_and_totals_are_the_models_own():
    model, config = tiny_llama(attn="eager")
    tokens = ids(20)
    window = 6
    policy = as_policy(lambda obs: obs.keys[..., 0], needs=("queries", "attention"), window=window)
    cache = InplaceEvictionCache(64, score=policy, config=config).attach(model)
    with torch.no_grad():
        model(input_ids=tokens[:, :14], **{CACHE_ARG: cache})
        for t in range(14, 20):  # decode steps: the window rolls in place
            model(input_ids=tokens[:, t:t + 1], **{CACHE_ARG: cache})
        full = model(input_ids=tokens, output_attentions=True)
    for layer, attn in zip(cache.layers, full.attentions):  # attn [1, Hq, 20, 20]
        obs = layer.observation()
        assert obs.queries.shape == (1, 4, window, 16)
        # the window's attention, recomputed from the recorded queries, is the model's
        torch.testing.assert_close(obs.window_attention(), attn[:, :, -window:], rtol=1e-5, atol=1e-6)
        totals = attn.sum(2).reshape(1, 2, 2, 20).mean(2)  # summed over queries, mean over the group
        torch.testing.assert_close(obs.attention_totals, totals, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(obs.attention_counts[0, 0], torch.arange(20, 0, -1).float())


@pytest.mark.parametrize("name", ["tova", "snapkv", "observed_attention", "keydiff", "auto"])
def test_chunks_of_evict_every_equal_one_token_at_a_time(name):
    model, config = tiny_llama(attn="eager")
    tokens = ids(60)
    policy = SnapKV(window=4) if name == "snapkv" else name

    def cache():
        return InplaceEvictionCache(16, sink_tokens=2, recent_window=3, evict_every=5, score=policy,
                                    config=config).attach(model)

    stepwise, chunked = cache(), cache()
    a = run(model, stepwise, tokens, steps=40)
    b = run(model, chunked, tokens, steps=40, chunk=5)
    # a chunk is compressed as its forward ends (layer by layer), one token's
    # eviction waits for the next step: the chunks have done one more, the last
    assert stepwise.layers[0].evictions + 1 == chunked.layers[0].evictions >= 8
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attach", [True, False])
def test_layer_by_layer_prefill_equals_whole_at_a_lower_peak(attach):
    model, config = tiny_llama(attn="eager", layers=4)
    tokens = ids(120)
    policy = "tova" if attach else "keydiff"  # without attach: a policy that reads keys only

    def go(mode):
        cache = InplaceEvictionCache(24, score=policy, evict_every=4, recent_window=4, config=config,
                                     prefill_eviction=mode)
        if attach:
            cache.attach(model)
        return cache, run(model, cache, tokens, steps=12)

    (layer_cache, a), (whole_cache, b) = go("layer"), go("whole")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x, y in zip(layer_cache.layers, whole_cache.layers):
        assert torch.equal(x.positions, y.positions)
    per_layer_prompt = 2 * 2 * 108 * 16 * 4  # K and V of the 108-token prompt, one layer
    assert whole_cache.peak_kv_bytes >= 4 * per_layer_prompt
    # one full layer (two without attach: the next layer caches before the last is evicted)
    assert layer_cache.peak_kv_bytes <= (1 if attach else 2) * per_layer_prompt + 4 * 2 * 2 * 32 * 16 * 4 * 2


def test_policies_need_attach_and_eager_weights():
    model, config = tiny_llama(attn="sdpa")
    with pytest.raises(RuntimeError, match="attach"):
        run(model, InplaceEvictionCache(8, score="tova", config=config), ids(30), steps=2)
    cache = InplaceEvictionCache(8, score="observed_attention", config=config).attach(model)
    with pytest.raises(RuntimeError, match="eager"):
        run(model, cache, ids(30), steps=2)
    with pytest.raises(ValueError, match="prefill_eviction"):
        InplaceEvictionCache(8, prefill_eviction="soon")


class EveryThird(ScoringPolicy):
    """A user's policy: keeps positions divisible by 3, checks what it is given."""

    name = "every_third"
    needs = ("queries", "attention")
    window = 3
    calls = 0

    def score(self, obs):
        assert obs.queries.shape[2] == 3 and obs.attention_totals.shape == obs.positions.shape
        assert obs.keys.shape[:3] == obs.positions.shape and obs.seen >= obs.positions.max() + 1
        EveryThird.calls += 1
        return (obs.positions % 3 == 0).float() - obs.positions.float() * 1e-3


def test_a_user_policy_through_the_protocol():
    model, config = tiny_llama(attn="eager")
    cache = InplaceEvictionCache(12, sink_tokens=0, score=EveryThird(), config=config).attach(model)
    run(model, cache, ids(40), steps=3)
    assert EveryThird.calls >= 2
    held = cache.layers[1].positions[0, 0].sort().values
    # the prompt (37 tokens) cut to 12: its 12 lowest positions divisible by 3, then 2 new tokens
    assert held[:12].tolist()[:10] == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27]


# --------------------------------------------------------------------------- dense, paged, vLLM hook


def test_dense_compaction_and_the_hook_take_a_policy():
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)
    queries = torch.randn(2, 4, 4, 8, generator=g)
    scores = score_kv("snapkv", k, v, queries=queries)
    ref_k, ref_v = imoe.compact_kv_cache_inplace(k.clone(), v.clone(), scores, 9)
    ours = imoe.compact_kv_cache_inplace(k.clone(), v.clone(), None, 9, policy="snapkv",
                                         observation={"queries": queries})
    assert torch.equal(ours[0], ref_k) and torch.equal(ours[1], ref_v)
    hook = VLLMInplaceCompactionHook(9, policy=KNorm())
    hk, hv = hook(k.clone(), v.clone())
    ref_k, ref_v = imoe.compact_kv_cache_inplace(k.clone(), v.clone(), KNorm().score(
        Observation(k, v, torch.arange(20).expand(2, 2, 20), 20)), 9, mode="move")
    assert torch.equal(hk, ref_k) and torch.equal(hv, ref_v)
    with pytest.raises(ValueError, match="one of them"):
        imoe.compact_kv_cache_inplace(k, v, scores, 9, policy="knorm")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_pools_scored_by_a_policy(layout):
    g = torch.Generator().manual_seed(8)
    bs, heads, d = 4, 2, 8
    lens = [13, 9]
    tables = torch.tensor([[5, 1, 7, 3], [0, 6, 2, 4]])
    shape = (8, bs, heads, d) if layout == "NHD" else (8, heads, bs, d)
    kp, vp = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    scores = paged_policy_scores("keydiff", [kp, vp], tables, lens, layout=layout)
    for s, n in enumerate(lens):  # the same scores from the sequence's keys gathered by hand
        rows = [kp[tables[s, x // bs], x % bs] if layout == "NHD" else kp[tables[s, x // bs], :, x % bs]
                for x in range(n)]
        keys = torch.stack(rows, dim=1)[None]  # [1, H, n, D]
        torch.testing.assert_close(scores[s, :, :n], KeyDiff().score(
            Observation(keys, keys, torch.arange(n).expand(1, heads, n), n))[0])
        assert torch.isinf(scores[s, :, n:]).all()
    ref = compact_paged_([kp.clone(), vp.clone()], tables, lens, 6, scores, layout=layout,
                         protected_prefix=4)
    k2, v2 = kp.clone(), vp.clone()
    res = VLLMInplaceCompactionHook(6, policy="keydiff", layout=layout)(k2, v2, block_tables=tables,
                                                                       seq_lens=lens)
    assert res.seq_lens == ref.seq_lens == [6, 6] and torch.equal(res.target_map, ref.target_map)


@pytest.mark.parametrize("name", ["auto", "tova", "snapkv", "observed_attention", "expected_attention"])
def test_a_recorded_prompt_evicted_later_equals_compression_during_its_forward(name):
    """A prompt cached whole with every statistic the policies read (the last
    64 queries, the attention totals), then evicted with `evict(budget,
    score=name)`, continues as a cache with that policy that compressed the
    prompt layer by layer during its forward: the prompt's forward is the
    full cache's either way, so one recorded prompt serves every (policy,
    budget)."""
    model, config = tiny_llama(attn="eager")
    tokens = ids(120)
    prompt, cont = tokens[:, :96], tokens[:, 96:]
    record = as_policy(lambda obs: obs.keys.new_zeros(obs.keys.shape[:3]), needs=("queries", "attention"),
                       window=64, name="record")
    with torch.no_grad():
        recorded = InplaceEvictionCache(96, score=record, config=config).attach(model)
        model(input_ids=prompt, **{CACHE_ARG: recorded})
        recorded.detach()
        recorded.evict(16, score=name)
        assert {layer.length for layer in recorded.layers} == {16}
        later = model(input_ids=cont, **{CACHE_ARG: recorded}).logits
        users = InplaceEvictionCache(16, score=name, config=config).attach(model)
        model(input_ids=prompt, **{CACHE_ARG: users})
        during = model(input_ids=cont, **{CACHE_ARG: users}).logits
        users.detach()
    torch.testing.assert_close(later, during, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_gpu_policies_match_the_cpu(name):
    model, config = tiny_llama(attn="eager", layers=3)
    tokens = ids(90)

    def go(device):
        m = model.to(device)
        cache = InplaceEvictionCache(24, recent_window=4, evict_every=6, score=name, config=config).attach(m)
        logits = run(m, cache, tokens.to(device), steps=30)
        cache.detach()
        return logits.float().cpu(), cache.layers[0].evictions

    (cpu, n_cpu), (gpu, n_gpu) = go("cpu"), go("cuda")
    assert n_cpu == n_gpu >= 5
    torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_gpu_layer_by_layer_prefill_peak():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=8192)
    model = LlamaForCausalLM(config).to("cuda", torch.float16).eval()
    prompt = torch.randint(0, 1000, (1, 4096), device="cuda")

    def peak(mode):
        cache = InplaceEvictionCache(256, score="keydiff", config=config, prefill_eviction=mode)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            model(input_ids=prompt, **{CACHE_ARG: cache}, logits_to_keep=1)
        cache.evict()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), cache.peak_kv_bytes

    (layer, layer_kv), (whole, whole_kv) = peak("layer"), peak("whole")
    per_layer = 2 * 8 * 4096 * 64 * 2  # K and V of the prompt, one layer, fp16
    assert whole_kv >= 8 * per_layer and layer_kv <= 2 * per_layer + 8 * 2 * 8 * 384 * 64 * 2 * 2
    assert layer < whole - 4 * per_layer, (layer, whole)


def auto_prompt_reference(budget, sinks, window=8):
    """score="auto" compressing a prompt, written out: VATP; the newest
    budget // 8 kept; and the budget // 4 others (no sink) that the last
    `window` queries attend to most, averaged over those queries and every
    query head of the layer."""
    vatp = ObservedAttention(value_norm=1)

    def score(obs):
        s = vatp.score(obs)
        recent = obs.positions >= obs.seen - budget // 8
        b, hkv, n = s.shape
        attn = obs.window_attention()  # [B, Hq, window, n]
        assert attn.shape[2] == window
        question = attn.mean(dim=(1, 2))  # [B, n]
        for i in range(b):
            for h in range(hkv):
                free = [j for j in range(n) if not recent[i, h, j] and obs.positions[i, h, j] >= sinks]
                free.sort(key=lambda j: -float(question[i, j]))
                for j in free[: budget // 4]:
                    s[i, h, j] = math.inf
        return torch.where(recent, math.inf, s)

    return as_policy(score, needs=("attention", "queries"), window=window, name="auto_prompt")


def test_auto_keeps_what_the_prompts_question_attends_to():
    """A prompt compressed by "auto": the tokens the prompt's last queries
    attend to most are kept, where VATP alone would evict some of them."""
    model, config = tiny_llama(attn="eager")
    tokens = ids(70, seed=5)
    prompt = tokens[:, :-1]
    caches = {
        "auto": InplaceEvictionCache(24, sink_tokens=2, config=config),
        "ref": InplaceEvictionCache(24, sink_tokens=2, config=config, score=auto_prompt_reference(24, 2)),
        "vatp": InplaceEvictionCache(24, sink_tokens=2, recent_window=3, config=config,
                                     score=ObservedAttention(value_norm=1)),
    }
    held = {}
    for name, cache in caches.items():
        cache.attach(model)
        with torch.no_grad():
            model(input_ids=prompt, **{CACHE_ARG: cache})
        held[name] = [set(layer.positions[0, h].tolist()) for layer in cache.layers for h in range(2)]
    assert caches["auto"].layers[0].evictions == 1
    assert held["auto"] == held["ref"]
    assert held["auto"] != held["vatp"]  # the question decided some of what is kept


def test_auto_projects_no_queries_while_decoding():
    """"auto" reads the recorded queries only when it compresses a prompt:
    the hook projects the prompt's last queries, and a decode step runs no
    q_proj beyond the attention's own (SnapKV, which scores from them while
    decoding, still records them every step)."""
    model, config = tiny_llama(attn="eager")
    tokens = ids(50)
    layers = config.num_hidden_layers
    calls = []
    handles = [m.q_proj.register_forward_hook(lambda *a: calls.append(1))
               for m in model.modules() if hasattr(m, "q_proj")]
    try:
        for score, per_step in (("auto", layers), ("snapkv", 2 * layers)):
            cache = InplaceEvictionCache(16, sink_tokens=2, evict_every=4, score=score, config=config)
            cache.attach(model)
            with torch.no_grad():
                model(input_ids=tokens[:, :40], **{CACHE_ARG: cache})
                del calls[:]
                model(input_ids=tokens[:, 40:41], **{CACHE_ARG: cache})
            cache.detach()
            assert len(calls) == per_step, score
    finally:
        for h in handles:
            h.remove()


def test_auto_is_vatp_with_a_recent_window_when_attached_else_the_window():
    model, config = tiny_llama(attn="eager")
    tokens = ids(50)
    window = InplaceEvictionCache(16, sink_tokens=2, config=config)  # no attach: the newest tokens
    run(model, window, tokens, steps=2)
    held = window.layers[0].positions[0, 0].sort().values.tolist()
    assert held[:16] == [0, 1] + list(range(34, 48))

    def pair(ref_recent, score=None, **kw):
        auto = InplaceEvictionCache(16, sink_tokens=2, config=config, **kw).attach(model)
        ref = InplaceEvictionCache(16, sink_tokens=2, recent_window=ref_recent, config=config,
                                   score=score or ObservedAttention(value_norm=1), **kw).attach(model)
        return auto, ref

    # a prompt compressed: the newest budget // 8 = 2 kept, the budget // 4 = 4 that the prompt's
    # last 8 queries attend to most, then VATP
    auto, ref = pair(0, auto_prompt_reference(16, sinks=2))
    a, b = run(model, auto, tokens, steps=6), run(model, ref, tokens, steps=6)
    assert auto.layers[0].evictions == 1
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # decoding (a prompt within the budget, then evictions every 4 steps): budget // 4 = 4
    auto, ref = pair(4, evict_every=4)
    a, b = run(model, auto, tokens, steps=36), run(model, ref, tokens, steps=36)
    assert auto.layers[0].evictions >= 5
    torch.testing.assert_close(a, b, rtol=0, atol=0)
