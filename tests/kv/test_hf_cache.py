"""The Hugging Face cache that evicts in place (transformers 5.x), on a tiny
random Llama built from a config (no download):

- greedy generate() gives the same tokens and the same logits, bit for bit,
  as a reference cache that evicts the same tokens out of place (topk, then
  gather into new tensors), for every scorer, head policy, mode and order;
- an independent check of the positions and masks: the evicting cache's
  logits equal those of a full cache whose attention masks out exactly the
  tokens the evicting cache dropped (eager attention, a 4-D mask);
- memory: one buffer per layer that never moves or grows during decoding,
  and a prompt longer than the buffer freed after its eviction;
- the GPU peak-memory comparison with DynamicCache (marked `gpu`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("the cache targets transformers 5.x", allow_module_level=True)

from _helpers.hf_models import CACHE_ARG, tiny_llama  # noqa: E402
from idempotent_moe._native import native  # noqa: E402
from idempotent_moe.integrations.hf_cache import (  # noqa: E402
    InplaceEvictionCache,
    InplaceEvictionLayer,
)
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402

FLT_MAX = float(torch.finfo(torch.float32).max)
ORDERS = native().ORDERS


def prompt(batch=1, length=30, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 101, (batch, length), generator=g)


# --------------------------------------------------------------------------- the reference


class GatherLayer(CacheLayerMixin):
    """The same policy, out of place: torch.cat to append, and an eviction by
    a stable descending sort of the scores (ties to the lower slot), then a
    gather of K, V, positions and scores into new tensors, laid out in the
    order `order` names."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache, layer_idx):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.pos = self.acc = None
        self.seen, self.since, self.pending = 0, 0, False

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        c = self.cache
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys = key_states[:, :, :0]
            self.values = value_states[:, :, :0]
            b, h = key_states.shape[:2]
            self.pos = torch.empty((b, h, 0), dtype=torch.int32)
            self.acc = torch.empty((b, h, 0), dtype=torch.float32)
        if self.pending:
            self.evict()
        b, h, q = key_states.shape[:3]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        new_pos = torch.arange(self.seen, self.seen + q, dtype=torch.int32).expand(b, h, q)
        self.pos = torch.cat([self.pos, new_pos], dim=-1)
        self.acc = torch.cat([self.acc, torch.zeros(b, h, q)], dim=-1)
        self.seen += q
        n = self.keys.shape[2]
        if q > 1:
            self.since, self.pending = 0, n > c.budget
        else:
            self.since += 1
            self.pending = c.every is not None and self.since >= c.every and n > c.budget
        return self.keys, self.values

    def get_mask_sizes(self, query_length):
        n = self.keys.shape[2] if self.keys is not None else 0
        n = min(n, self.cache.budget) if self.pending else n
        return n + query_length, self.seen - n

    def get_seq_length(self):
        return self.seen

    def get_max_length(self):
        return -1

    def scores(self):
        c, k = self.cache, self.keys
        b, h, n = k.shape[:3]
        if c.score == "key_norm":
            s = torch.linalg.vector_norm(k, dim=-1).float().neg()
        elif c.score == "attention":
            s = self.acc
        else:
            s = c.score(k, self.values, self.pos, self.layer_idx)
        if s.shape[1] != h:  # per query head: reduce each group
            g = s.shape[1] // h
            s = s.float().reshape(b, h, g, n)
            s = s.mean(2) if c.head_reduce == "mean" else s.amax(2)
        if not c.per_head:
            s = s.float().mean(1, keepdim=True) if c.head_reduce == "mean" \
                else s.float().amax(1, keepdim=True)
        return s

    def evict(self):
        c = self.cache
        self.pending, self.since = False, 0
        b, h, n = self.keys.shape[:3]
        if n <= c.budget:
            return
        protect = self.pos < c.sinks
        if c.recent:
            protect = protect | (self.pos >= self.seen - c.recent)
        s = torch.where(protect, math.inf, self.scores().float().clamp(max=FLT_MAX))
        ranked = torch.sort(s, dim=-1, descending=True, stable=True).indices
        top = ranked[..., : c.budget]
        if c.order == "score":
            idx = top
        elif c.order == "stable":
            idx = torch.sort(top, dim=-1).values
        else:  # inplace: kept slots below C stay, holes take the kept tail ascending
            kept = torch.zeros(b, h, n, dtype=torch.bool)
            kept.scatter_(-1, top, True)
            idx = torch.arange(c.budget).repeat(b, h, 1)
            for i in range(b):
                for j in range(h):
                    holes = (~kept[i, j, : c.budget]).nonzero().flatten()
                    tail = kept[i, j, c.budget:].nonzero().flatten() + c.budget
                    idx[i, j, holes] = tail
        self.keys = torch.gather(self.keys, 2, idx[..., None].expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = torch.gather(self.values, 2,
                                   idx[..., None].expand(-1, -1, -1, self.values.shape[-1]))
        self.pos = torch.gather(self.pos, 2, idx)
        self.acc = torch.gather(self.acc, 2, idx)


class GatherCache(Cache):
    def __init__(self, budget, sinks=4, recent=0, every=None, score="key_norm", head_reduce="mean",
                 per_head=True, order="inplace"):
        super().__init__(layers=[])
        self.budget, self.sinks, self.recent, self.every = budget, sinks, recent, every
        self.score, self.head_reduce, self.per_head, self.order = score, head_reduce, per_head, order

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(GatherLayer(self, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states)

    def attach(self, model):
        def hook(module, args, output):
            layer = self.layers[module.layer_idx]
            w = output[1].sum(dim=2, dtype=torch.float32)
            b, hq, n = w.shape
            h = layer.acc.shape[1]
            w = w.reshape(b, h, hq // h, n)
            layer.acc = layer.acc + (w.mean(2) if self.head_reduce == "mean" else w.amax(2))

        for module in model.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.register_forward_hook(hook)


def run_generate(model, ids, cache, new_tokens=24):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **{CACHE_ARG: cache},
                             output_logits=True, return_dict_in_generate=True, min_new_tokens=new_tokens)
    return out.sequences, torch.stack(out.logits)


POLICIES = {
    # name: (cache kwargs, reference kwargs)
    "key_norm": (dict(budget=12, sink_tokens=2, recent_window=3, evict_every=4),
                 dict(budget=12, sinks=2, recent=3, every=4)),
    "key_norm_no_decode_eviction": (dict(budget=10, sink_tokens=4, max_cache_len=14),
                                    dict(budget=10, sinks=4)),
    "shared_heads_max": (dict(budget=9, sink_tokens=1, evict_every=3, per_head=False,
                              head_reduce="max"),
                         dict(budget=9, sinks=1, every=3, per_head=False, head_reduce="max")),
    "prompt_fits_the_buffer": (dict(budget=12, evict_every=20), dict(budget=12, every=20)),
    # NumPy integers count as ints, as everywhere in the library (_arrays.check_int)
    "numpy_counts": (dict(budget=np.int64(12), sink_tokens=np.int32(2), recent_window=np.int64(3),
                          evict_every=np.int64(4)),
                     dict(budget=12, sinks=2, recent=3, every=4)),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["move", "swap"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_generate_matches_gather_reference(policy, mode, order):
    model, config = tiny_llama()
    ours_kw, ref_kw = POLICIES[policy]
    ids = prompt()
    cache = InplaceEvictionCache(config=config, mode=mode, order=order, **{"score": "key_norm", **ours_kw})
    seq, logits = run_generate(model, ids, cache)
    ref = GatherCache(order=order, **ref_kw)
    ref_seq, ref_logits = run_generate(model, ids, ref)
    assert torch.equal(seq, ref_seq)
    assert torch.equal(logits, ref_logits)
    for ours, theirs in zip(cache.layers, ref.layers):
        assert torch.equal(ours.positions, theirs.pos)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    full_seq, full_logits = run_generate(model, ids, DynamicCache(config=config))
    assert not torch.equal(logits, full_logits), "nothing was evicted: the test would be vacuous"
    layer = cache.layers[0]
    assert layer.evictions >= 1 and layer.seen == ids.shape[1] + 23  # the last token is not fed back


@pytest.mark.parametrize("head_reduce", ["mean", "max"])
def test_attention_scores_match_reference(head_reduce):
    model, config = tiny_llama(attn="eager")
    ids = prompt(length=26)
    kw = dict(budget=11, sink_tokens=2, recent_window=2, evict_every=5, score="attention",
              head_reduce=head_reduce)
    cache = InplaceEvictionCache(config=config, **kw).attach(model)
    seq, logits = run_generate(model, ids, cache)
    cache.detach()
    ref = GatherCache(budget=11, sinks=2, recent=2, every=5, score="attention",
                      head_reduce=head_reduce)
    ref.attach(model)
    ref_seq, ref_logits = run_generate(model, ids, ref)
    assert torch.equal(seq, ref_seq)
    assert torch.equal(logits, ref_logits)


def test_attention_scores_need_attach_and_eager():
    model, config = tiny_llama(attn="eager")
    with pytest.raises(RuntimeError, match="attach"):
        run_generate(model, prompt(), InplaceEvictionCache(8, score="attention", config=config))
    model, config = tiny_llama(attn="sdpa")
    cache = InplaceEvictionCache(8, score="attention", config=config).attach(model)
    with pytest.raises(RuntimeError, match="eager"):
        run_generate(model, prompt(), cache)


def test_callable_scores_per_query_head_and_batch():
    model, config = tiny_llama(kv_heads=1)

    def score(keys, values, positions, layer_idx):
        # per query head (4 of them for 1 KV head): reduced by head_reduce
        base = values.float().sum(-1, keepdim=False)
        return torch.cat([base * (i + 1) % 3 for i in range(4)], dim=1)

    ids = prompt(batch=2, length=22)
    cache = InplaceEvictionCache(10, sink_tokens=1, recent_window=2, evict_every=6, score=score,
                                 config=config)
    seq, logits = run_generate(model, ids, cache)
    ref = GatherCache(10, sinks=1, recent=2, every=6, score=score)
    ref_seq, ref_logits = run_generate(model, ids, ref)
    assert torch.equal(seq, ref_seq) and torch.equal(logits, ref_logits)


@pytest.mark.skipif(CACHE_ARG == "past_key_values",
                    reason="this transformers does not deprecate past_key_values")
def test_transformers_deprecations_fail_the_tests():
    """conftest.py makes transformers' deprecation warnings errors: a call in
    the deprecated style fails, so none creeps back into the tests."""
    model, config = tiny_llama()
    with pytest.raises(FutureWarning, match="past_key_values"), torch.no_grad():
        model(prompt(length=4), past_key_values=DynamicCache(config=config))


# --------------------------------------------------------------------------- positions and masks


def masked_reference_logits(model, config, ids, cache, steps):
    """Step by step: the evicting cache, then a full DynamicCache whose 4-D
    eager mask lets each query head see exactly the logical positions the
    evicting cache held for its KV head at that step. Every layer keeps the
    same positions (the score depends on positions and heads only)."""
    full = DynamicCache(config=config)
    group = config.num_attention_heads // config.num_key_value_heads
    tokens, ours, theirs = ids, [], []
    chunks = [ids[:, :17], ids[:, 17:]]  # a prefill in two chunks: a mask with an offset
    with torch.no_grad():
        for step in range(len(chunks) + steps):
            x = chunks[step] if step < len(chunks) else tokens[:, -1:]
            out = model(x, **{CACHE_ARG: cache})
            held = cache.layers[0].positions  # [B, Hkv, L]
            for layer in cache.layers[1:]:
                assert torch.equal(layer.positions, held)
            total, q = cache.get_seq_length(), x.shape[1]
            allowed = torch.zeros(held.shape[0], held.shape[1], q, total, dtype=torch.bool)
            qpos = torch.arange(total - q, total)
            for b in range(held.shape[0]):
                for h in range(held.shape[1]):
                    kept = torch.zeros(total, dtype=torch.bool)
                    kept[held[b, h].long()] = True
                    allowed[b, h] = kept[None, :] & (torch.arange(total)[None, :] <= qpos[:, None])
            allowed = allowed.repeat_interleave(group, dim=1)
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            ref = model(x, **{CACHE_ARG: full}, attention_mask=mask,
                        position_ids=qpos[None].expand(x.shape[0], -1))
            ours.append(out.logits[:, -1])
            theirs.append(ref.logits[:, -1])
            tokens = torch.cat([tokens, out.logits[:, -1:].argmax(-1)], dim=-1)
    return torch.stack(ours), torch.stack(theirs)


@pytest.mark.parametrize("per_head", [True, False])
def test_logits_equal_a_full_cache_masking_the_evicted_tokens(per_head):
    model, config = tiny_llama(attn="eager")

    def score(keys, values, positions, layer_idx):  # the same on every layer
        heads = torch.arange(positions.shape[1])[None, :, None]
        return torch.sin(positions.float() * 0.7 + heads * 1.3)

    # "whole": every layer still holds after a forward what the forward saw (the
    # layer-by-layer prefill eviction is checked against it in test_kv_policies.py).
    cache = InplaceEvictionCache(9, sink_tokens=2, recent_window=2, evict_every=3, score=score,
                                 per_head=per_head, config=config, prefill_eviction="whole")
    ours, ref = masked_reference_logits(model, config, prompt(batch=2, length=29), cache, steps=14)
    assert cache.layers[0].evictions >= 4
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_positions_count_from_the_true_length():
    """A forward without position ids takes them from get_seq_length(): the
    tokens seen, not the slots held; generate() passes the same ones."""
    model, config = tiny_llama()
    ids = prompt(length=25)
    cache = InplaceEvictionCache(8, evict_every=2, config=config)
    seq, logits = run_generate(model, ids, cache, new_tokens=10)
    manual = InplaceEvictionCache(8, evict_every=2, config=config)
    got = []
    with torch.no_grad():
        x = ids
        for _ in range(10):
            out = model(x, **{CACHE_ARG: manual}, logits_to_keep=1)
            got.append(out.logits[:, -1])
            x = out.logits[:, -1:].argmax(-1)
    assert manual.get_seq_length() == 25 + 9
    assert manual.layers[0].length <= 8 + 2
    assert torch.equal(torch.stack(got), logits)


def test_positions_written_when_read_follow_every_step_and_reorder():
    """A decode step writes K and V only; the positions of the tokens appended
    since are written when read: through `positions`, an eviction, growth,
    and a beam reorder, always the logical positions of the tokens held."""
    model, config = tiny_llama()
    cache = InplaceEvictionCache(10, sink_tokens=2, evict_every=5, max_cache_len=12, config=config)
    with torch.no_grad():
        x = prompt(batch=2, length=14)
        for step in range(13):
            out = model(x, **{CACHE_ARG: cache})
            x = out.logits[:, -1:].argmax(-1)
            layer = cache.layers[0]
            pos = layer.positions
            if step:  # decode: the appended slots waited to be written, and now are
                assert layer._pos_upto == layer.length
            assert pos.shape[-1] == layer.length
            # after an eviction the kept positions are a subset in slot order;
            # the appended ones run up to the last token seen
            assert int(pos.max()) == layer.seen - 1 and bool((pos[..., :2] < 2).all())
            assert len(set(pos[0, 0].tolist())) == layer.length
        since = layer._since  # decode tokens appended since the last eviction: in order at the end
        assert since >= 2
        tail = layer.positions[:, :, layer.length - since:]
        appended = torch.arange(layer.seen - since, layer.seen, dtype=torch.int32)
        assert torch.equal(tail, appended.expand_as(tail))
        out = model(x, **{CACHE_ARG: cache})  # one more token, left unwritten
        assert layer._pos_upto == layer.length - 1
        expected = layer._pos[:, :, :layer.length].clone()
        expected[..., -1] = layer.seen - 1
        cache.reorder_cache(torch.tensor([1, 0]))
        assert torch.equal(layer.positions, expected[[1, 0]])


# --------------------------------------------------------------------------- memory


def test_one_buffer_per_layer_reused_by_new_tokens():
    model, config = tiny_llama()
    budget, every = 12, 4
    cache = InplaceEvictionCache(budget, evict_every=every, config=config)
    ids = prompt(length=40)  # longer than the buffer: held in the prompt's tensors first
    pointers = []
    with torch.no_grad():
        x = ids
        for _ in range(20):
            out = model(x, **{CACHE_ARG: cache})
            x = out.logits[:, -1:].argmax(-1)
            pointers.append([(layer._k.data_ptr(), layer._v.data_ptr()) for layer in cache.layers])
    # the prefill's own tensors were replaced by the steady buffer at the first eviction
    assert pointers[0] != pointers[1]
    assert all(p == pointers[1] for p in pointers[1:]), "a buffer moved during decoding"
    for layer in cache.layers:
        assert isinstance(layer, InplaceEvictionLayer)
        assert layer.slots == budget + every and not layer._adopted
        assert layer.evictions >= 4
    b, h, d = 1, config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    per_layer = b * h * (budget + every) * (2 * d * 4 + 4)  # K and V fp32, int32 positions
    assert cache.buffer_bytes() == config.num_hidden_layers * per_layer


def test_growth_without_decode_eviction_is_geometric():
    model, config = tiny_llama()
    cache = InplaceEvictionCache(6, sink_tokens=2, max_cache_len=8, config=config)
    sizes = []
    with torch.no_grad():
        x = prompt(length=12)
        for _ in range(30):
            out = model(x, **{CACHE_ARG: cache})
            x = out.logits[:, -1:].argmax(-1)
            sizes.append(cache.layers[0].slots)
    assert cache.layers[0].length == 6 + 29 and cache.layers[0].evictions == 1
    assert len(set(sizes[1:])) <= 4  # 8 -> 16 -> 32 -> 64: a few reallocations, not one per step


@pytest.mark.skipif(CACHE_ARG == "past_key_values",
                    reason="transformers before 5.24 does not pass the position ids to the cache")
def test_a_padded_batch_is_refused_before_anything_is_written():
    """generate() numbers a left-padded row from its first real token: its
    position ids do not follow the tokens the cache has seen, and the
    padding mask could not follow the tokens an eviction moves."""
    model, config = tiny_llama()
    ids = prompt(batch=2, length=14)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = InplaceEvictionCache(8, evict_every=2, config=config)
    with pytest.raises(ValueError, match="padded batches.*row 1"), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                       **{CACHE_ARG: cache})
    assert all(layer.seen == 0 and layer.length == 0 and layer.slots == 0 for layer in cache.layers)
    # the same prompts unpadded (an all-ones mask) generate as without a mask
    ours = InplaceEvictionCache(8, evict_every=2, config=config)
    with torch.no_grad():
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             do_sample=False, pad_token_id=0, **{CACHE_ARG: ours})
    ref_seq, _ = run_generate(model, ids, InplaceEvictionCache(8, evict_every=2, config=config),
                              new_tokens=6)
    assert ours.layers[0].evictions >= 1 and torch.equal(seq, ref_seq)
    # position ids that skip ahead of the tokens seen are refused alike
    with pytest.raises(ValueError, match="padded batches"), torch.no_grad():
        model(ids[:1], position_ids=torch.arange(5, 19)[None], **{CACHE_ARG: InplaceEvictionCache(8)})


@pytest.mark.skipif(CACHE_ARG == "past_key_values",
                    reason="transformers before 5.24 does not pass the position ids to the cache")
def test_a_hybrid_model_keeps_its_sliding_layers_and_refuses_padding_first():
    """A sliding-window first layer (as in GPT-OSS or Gemma) stays
    transformers' own; a padded batch is refused before even that layer has
    cached anything."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    model = Qwen2ForCausalLM(config).eval()
    cache = InplaceEvictionCache(8, evict_every=2, config=config)
    assert not isinstance(cache.layers[0], InplaceEvictionLayer)
    assert isinstance(cache.layers[1], InplaceEvictionLayer)
    ids = prompt(batch=2, length=12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="padded batches"), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       **{CACHE_ARG: cache})
    assert [layer.get_seq_length() for layer in cache.layers] == [0, 0]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             **{CACHE_ARG: cache})
    assert out.shape == (2, 18) and cache.layers[1].evictions >= 2
    assert [layer.get_seq_length() for layer in cache.layers] == [17, 17]


def test_bad_policies():
    for kwargs in (dict(budget=0), dict(budget=4, sink_tokens=3, recent_window=2),
                   dict(budget=4, evict_every=0), dict(budget=4, score="entropy"),
                   dict(budget=4, mode="gather"), dict(budget=4, order="random"),
                   dict(budget=4, head_reduce="sum"), dict(budget=4, max_cache_len=4)):
        with pytest.raises(ValueError):
            InplaceEvictionCache(**kwargs)


def test_crop_is_refused_and_evict_on_demand():
    model, config = tiny_llama()
    cache = InplaceEvictionCache(50, config=config)
    with torch.no_grad():
        model(prompt(length=30), **{CACHE_ARG: cache})
    assert cache.evict(budget=10) == 2 * 20
    assert cache.layers[0].length == 10 and cache.get_seq_length() == 30
    with pytest.raises(NotImplementedError):
        cache.crop(-1)


@pytest.mark.gpu
def test_gpu_peak_memory_below_dynamic_cache():
    """Generation on the GPU, a short prompt and a long answer: DynamicCache
    grows to every token (and copies itself at each step), the evicting cache
    stays at budget + evict_every slots per layer after the prompt."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=8192)
    model = LlamaForCausalLM(config).to("cuda", torch.float16).eval()
    ids = torch.randint(0, 1000, (1, 512), device="cuda")

    def peak(cache):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=2048, min_new_tokens=2048, do_sample=False,
                                 **{CACHE_ARG: cache})
        torch.cuda.synchronize()
        assert out.shape[1] == 512 + 2048
        return torch.cuda.max_memory_allocated() - before

    dynamic = peak(DynamicCache(config=config))
    cache = InplaceEvictionCache(256, sink_tokens=4, recent_window=32, evict_every=64, config=config)
    ours = peak(cache)
    kv_per_token = 2 * config.num_hidden_layers * config.hidden_size * 2  # K and V, fp16
    assert all(layer.slots == 256 + 64 for layer in cache.layers)
    # DynamicCache ends with 2560 tokens; ours holds 320 slots after the prompt's 512
    assert ours < dynamic - 1024 * kv_per_token, (ours, dynamic)
