"""KV-cache eviction beyond the original-API tests of test_api.py: grouped-query
attention (one selection per KV head from per-query-head scores reduced by
mean or max, or one shared by all heads), the InplaceKVCompactor's maps, and
the vLLM-style hook on contiguous caches and on paged pools."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import (
    FRAMEWORKS,
    bits,
    data_ptr,
    expected_after,
    make_data,
    reference_indices,
    reference_kept,
    requires_torch,
    target_map_from_indices,
    to_framework,
    to_numpy,
    torch,
)
from idempotent_moe.integrations.vllm import VLLMInplaceCompactionHook
from idempotent_moe.kv import reduce_head_scores
from idempotent_moe.paged import PagedCompaction

B, HKV, G, S, HD, KEEP = 2, 3, 4, 48, 8, 20


def dyadic(shape, framework, rng):
    """Scores whose group means and maxima are exact in float32."""
    values = (rng.integers(-64, 64, size=shape) / 8.0).astype(np.float32)
    return to_framework(values, framework)


def caches(framework, rng, heads=HKV, n=S):
    k = make_data((B, heads, n, HD), "float16", framework, rng)
    v = make_data((B, heads, n, 2 * HD), "bfloat16" if framework == "torch" else "float32",
                  framework, rng)
    return k, v


def reduced(scores, how):
    s = to_numpy(scores).astype(np.float64).reshape(B, HKV, -1, S)
    return s.mean(2) if how == "mean" else s.max(2)


# --------------------------------------------------------------------------- GQA reduction


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("how", ["mean", "max"])
def test_reduce_head_scores(framework, how, rng):
    scores = dyadic((B, G * HKV, S), framework, rng)
    out = reduce_head_scores(scores, HKV, how)
    assert tuple(out.shape) == (B, HKV, S)
    np.testing.assert_array_equal(to_numpy(out).astype(np.float64), reduced(scores, how))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_reduce_head_scores_passes_kv_and_broadcasts_shared(framework, rng):
    per_kv = dyadic((B, HKV, S), framework, rng)
    assert reduce_head_scores(per_kv, HKV) is per_kv
    shared = dyadic((B, S), framework, rng)
    out = reduce_head_scores(shared, HKV)
    assert tuple(out.shape) == (B, HKV, S)
    np.testing.assert_array_equal(to_numpy(out), np.broadcast_to(to_numpy(shared)[:, None], out.shape))
    one = dyadic((B, 1, S), framework, rng)
    assert tuple(reduce_head_scores(one, HKV).shape) == (B, HKV, S)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("how", ["mean", "max"])
@pytest.mark.parametrize("mode", ["swap", "move"])
def test_per_query_head_scores_select_per_kv_head(framework, how, mode, rng):
    k, v = caches(framework, rng)
    k0, v0 = bits(k), bits(v)
    scores = dyadic((B, G * HKV, S), framework, rng)
    kv, vv, idx = imoe.compact_kv_cache_inplace(k, v, scores, KEEP, protected_prefix_len=2,
                                                recent_window=3, head_reduce=how, mode=mode,
                                                return_indices=True)
    ref = reference_indices(reference_kept(reduced(scores, how), KEEP, 2, 3), S, KEEP, (B, HKV))
    np.testing.assert_array_equal(to_numpy(idx), ref)
    np.testing.assert_array_equal(bits(k), expected_after(k0, 2, ref, mode))
    np.testing.assert_array_equal(bits(v), expected_after(v0, 2, ref, mode))
    assert data_ptr(kv) == data_ptr(k) and tuple(vv.shape) == (B, HKV, KEEP, 2 * HD)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_one_selection_shared_by_all_heads(framework, rng):
    k, v = caches(framework, rng)
    k0 = bits(k)
    scores = dyadic((B, S), framework, rng)
    _, _, idx = imoe.compact_kv_cache_inplace(k, v, scores, KEEP, return_indices=True)
    idx = to_numpy(idx)
    for h in range(1, HKV):
        np.testing.assert_array_equal(idx[:, h], idx[:, 0])
    kept = reference_kept(np.repeat(to_numpy(scores)[:, None], HKV, 1), KEEP, 4)
    ref = reference_indices(kept, S, KEEP, (B, HKV))
    np.testing.assert_array_equal(bits(k), expected_after(k0, 2, ref, "swap"))


@pytest.mark.parametrize("bad_heads", [5, 7])
def test_head_count_must_divide(bad_heads, rng):
    k, v = caches("numpy", rng)
    snaps = bits(k), bits(v)
    with pytest.raises(ValueError, match="heads"):
        imoe.compact_kv_cache_inplace(k, v, dyadic((B, bad_heads, S), "numpy", rng), KEEP)
    np.testing.assert_array_equal(bits(k), snaps[0])
    np.testing.assert_array_equal(bits(v), snaps[1])


def test_head_reduce_must_be_known(rng):
    k, v = caches("numpy", rng)
    with pytest.raises(ValueError, match="head_reduce"):
        imoe.compact_kv_cache_inplace(k, v, dyadic((B, G * HKV, S), "numpy", rng), KEEP,
                                      head_reduce="median")


# --------------------------------------------------------------------------- InplaceKVCompactor


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_compactor_shared_and_per_head_maps_then_compact(framework, rng):
    compactor = imoe.InplaceKVCompactor(mode="move")
    shared = rng.choice(S, size=KEEP, replace=False)
    per_head = np.stack([rng.choice(S, size=KEEP, replace=False) for _ in range(B * HKV)])
    for active, kept in (
        (to_framework(shared, framework), [np.sort(shared)] * (B * HKV)),
        (to_framework(per_head.reshape(B, HKV, KEEP), framework), [np.sort(r) for r in per_head]),
    ):
        tm = compactor.build_idempotent_map(B, HKV, S, active, capacity=KEEP)
        ref = reference_indices(kept, S, KEEP, (B, HKV))
        np.testing.assert_array_equal(to_numpy(tm), target_map_from_indices(ref, S))
        k, v = caches(framework, rng)
        k0, v0 = bits(k), bits(v)
        kv, vv = compactor.compact(k, v, tm, KEEP)
        np.testing.assert_array_equal(bits(kv), np.take_along_axis(k0, ref[..., None], 2))
        np.testing.assert_array_equal(bits(vv), np.take_along_axis(v0, ref[..., None], 2))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_compactor_from_query_head_scores_keeps_sinks(framework, rng):
    k, v = caches(framework, rng)
    k0 = bits(k)
    scores = dyadic((B, G * HKV, S), framework, rng)
    scores[..., :4] = -100.0  # the sinks never win on score
    kv, vv, idx = imoe.InplaceKVCompactor().compact_from_scores(
        k, v, scores, KEEP, protected_prefix_len=4, return_indices=True, head_reduce="max")
    ref = reference_indices(reference_kept(reduced(scores, "max"), KEEP, 4), S, KEEP, (B, HKV))
    np.testing.assert_array_equal(to_numpy(idx), ref)
    assert (ref[..., :4] == np.arange(4)).all()
    np.testing.assert_array_equal(bits(kv), np.take_along_axis(k0, ref[..., None], 2))


# --------------------------------------------------------------------------- the hook


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_hook_contiguous_scores(framework, rng):
    hook = VLLMInplaceCompactionHook(KEEP, protected_prefix_len=4)
    k, v = caches(framework, rng)
    k0, v0 = bits(k), bits(v)
    scores = dyadic((B, HKV, S), framework, rng)
    kv, vv = hook(k, v, attention_scores=scores)
    ref = reference_indices(reference_kept(scores, KEEP, 4), S, KEEP, (B, HKV))
    np.testing.assert_array_equal(bits(k), expected_after(k0, 2, ref, "move"))
    np.testing.assert_array_equal(bits(v), expected_after(v0, 2, ref, "move"))
    assert tuple(kv.shape) == (B, HKV, KEEP, HD) and data_ptr(vv) == data_ptr(v)
    assert hook.calls == 1


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_hook_contiguous_active_and_swap(framework, rng):
    hook = VLLMInplaceCompactionHook(KEEP, mode="swap")
    k, v = caches(framework, rng)
    k0 = bits(k)
    chosen = rng.choice(S, size=7, replace=False)
    kv, vv, idx = hook(k, v, active_indices=to_framework(chosen, framework), return_indices=True)
    ref = reference_indices([np.sort(chosen)] * (B * HKV), S, 7, (B, HKV))
    np.testing.assert_array_equal(to_numpy(idx), ref)
    np.testing.assert_array_equal(bits(k), expected_after(k0, 2, ref, "swap"))
    assert tuple(kv.shape) == (B, HKV, 7, HD)


def test_hook_paged_matches_gather(rng):
    hook = VLLMInplaceCompactionHook(6, protected_prefix_len=1, recent_window=1)
    bs, nb, lens = 4, 16, [15, 10, 5]
    k = make_data((nb, bs, HKV, HD), "float16", "numpy", rng)
    v = make_data((nb, bs, HKV, HD), "float16", "numpy", rng)
    perm = rng.permutation(nb)
    tables = np.stack([perm[0:4], perm[4:8], perm[8:12]]).astype(np.int32)
    scores = dyadic((3, G * HKV, 15), "numpy", rng)
    k0 = bits(k)
    res = hook(k, v, attention_scores=scores, block_tables=tables, seq_lens=lens)
    assert isinstance(res, PagedCompaction)
    assert res.seq_lens == [6, 6, 5]
    assert res.freed_blocks == [tables[0, 2:4].tolist(), tables[1, 2:3].tolist(), []]
    x = np.arange(15)
    before = k0[tables[0][x // bs], x % bs]                         # [15, H, D]
    per_kv = to_numpy(scores)[0].reshape(HKV, G, 15).mean(1)
    ref = reference_indices(reference_kept(per_kv, 6, 1, 1), 15, 6)  # [H, 6]
    after = bits(k)[tables[0][x[:6] // bs], x[:6] % bs]             # [6, H, D]
    for h in range(HKV):
        np.testing.assert_array_equal(after[:, h], before[ref[h], h])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["move", "swap"])
@pytest.mark.parametrize("tables_on", ["host", "cuda"])
def test_hook_paged_cuda_matches_cpu(mode, tables_on, rng):
    # the hook on CUDA pools (selection, map and moves on the device) against
    # the same call on the CPU, bit for bit; K and V of different head dims
    bs, nb, lens = 16, 40, [70, 33, 64, 0]
    k = make_data((nb, bs, HKV, 64), "float16", "torch", rng)
    v = make_data((nb, bs, HKV, 24), "float16", "torch", rng)
    perm = rng.permutation(nb)
    tables = np.stack([perm[0:5], perm[5:10], perm[10:15], perm[15:20]]).astype(np.int32)
    scores = torch.from_numpy(to_numpy(dyadic((4, G * HKV, 70), "numpy", rng)))
    hook = VLLMInplaceCompactionHook(20, protected_prefix_len=2, recent_window=3, mode=mode)
    kc, vc = k.cuda(), v.cuda()
    ref = hook(k, v, attention_scores=scores, block_tables=tables, seq_lens=lens)
    tab = torch.from_numpy(tables) if tables_on == "host" else torch.from_numpy(tables).cuda()
    res = hook(kc, vc, attention_scores=scores.cuda(), block_tables=tab, seq_lens=lens)
    imoe.check_errors(kc)
    assert res.seq_lens == ref.seq_lens and res.freed_blocks == ref.freed_blocks
    np.testing.assert_array_equal(to_numpy(res.target_map), to_numpy(ref.target_map))
    np.testing.assert_array_equal(bits(kc), bits(k))
    np.testing.assert_array_equal(bits(vc), bits(v))


def test_hook_paged_active_indices(rng):
    hook = VLLMInplaceCompactionHook(8)
    bs = 4
    k = make_data((6, bs, 2, 4), "float32", "numpy", rng)
    v = make_data((6, bs, 2, 4), "float32", "numpy", rng)
    tables = np.array([[3, 1, 5]], dtype=np.int64)
    res = hook(k, v, active_indices=[np.array([9, 0, 4])], block_tables=tables, seq_lens=[11])
    assert res.seq_lens == [3] and res.freed_blocks == [[1, 5]]


@pytest.mark.parametrize("case", ["neither", "both", "prefix", "lens_alone", "lens_missing"])
def test_hook_bad_calls(case, rng):
    k, v = caches("numpy", rng)
    s = dyadic((B, HKV, S), "numpy", rng)
    snaps = bits(k), bits(v)
    if case == "prefix":
        with pytest.raises(ValueError):
            VLLMInplaceCompactionHook(3, protected_prefix_len=4)
        return
    hook = VLLMInplaceCompactionHook(KEEP)
    call = {
        "neither": lambda: hook(k, v),
        "both": lambda: hook(k, v, s, np.arange(3)),
        "lens_alone": lambda: hook(k, v, s, seq_lens=[3]),
        "lens_missing": lambda: hook(k, v, s, block_tables=np.zeros((1, 2), np.int32)),
    }[case]
    with pytest.raises((ValueError, TypeError)):
        call()
    np.testing.assert_array_equal(bits(k), snaps[0])
    np.testing.assert_array_equal(bits(v), snaps[1])


@requires_torch
def test_hook_on_a_fused_kv_tensor(rng):
    """vLLM keeps K and V as halves of one tensor [2, num_blocks, ...]."""
    kv_cache = torch.randn(2, 8, 4, 2, 8, dtype=torch.float16)
    before = kv_cache.clone()
    tables = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    scores = torch.rand(1, 2, 12)
    res = VLLMInplaceCompactionHook(5, protected_prefix_len=0)(
        kv_cache[0], kv_cache[1], scores, block_tables=tables, seq_lens=[12])
    assert res.seq_lens == [5] and res.freed_blocks == [[7]]
    x = torch.arange(12)
    for half in range(2):
        logical = before[half][tables[0][x // 4].long(), x % 4]
        now = kv_cache[half][tables[0][x[:5] // 4].long(), x[:5] % 4]
        for h in range(2):
            top = torch.topk(scores[0, h], 5).indices
            assert set(res.target_map[0, h, :5].tolist()) == set(top.tolist())
            assert torch.equal(now[:, h], logical[res.target_map[0, h, :5].long(), h])


# --------------------------------------------------------------------------- the torch hot path


@requires_torch
@pytest.mark.parametrize("mode", ["swap", "move"])
@pytest.mark.parametrize("window", [0, 5])
def test_torch_kv_call_matches_the_general_path(mode, window, rng):
    """Per-KV-head torch scores take the direct call into the core; the same
    call with a NumPy integer capacity takes the general path: the same
    caches, views and indices."""
    k, v = caches("torch", rng)
    scores = dyadic((B, HKV, S), "torch", rng)
    k2, v2 = k.clone(), v.clone()
    out = torch.full((B, HKV, KEEP), -1, dtype=torch.int64)
    kv, vv, idx = imoe.compact_kv_cache_inplace(k, v, scores, KEEP, mode=mode, recent_window=window,
                                                return_indices=True, out_indices=out)
    ref_k, ref_v, ref_idx = imoe.compact_kv_cache_inplace(
        k2, v2, scores, np.int64(KEEP), mode=mode, recent_window=window, return_indices=True)
    assert idx is out and torch.equal(idx, ref_idx)
    np.testing.assert_array_equal(bits(k), bits(k2))
    np.testing.assert_array_equal(bits(v), bits(v2))
    for view, ref_view, cache in ((kv, ref_k, k), (vv, ref_v, v)):
        assert view.data_ptr() == cache.data_ptr() and view.shape == ref_view.shape
        assert view.stride() == ref_view.stride()
    ref = reference_indices(reference_kept(scores, KEEP, 4, window), S, KEEP, (B, HKV))
    np.testing.assert_array_equal(idx.numpy(), ref)


@requires_torch
@pytest.mark.parametrize("case", ["nan", "prefix", "capacity_dtype", "v_heads", "v_seq", "v_batch",
                                  "scores_seq"])
def test_torch_kv_call_refuses_bad_values_and_changes_nothing(case, rng):
    k, v = caches("torch", rng)
    scores = dyadic((B, HKV, S), "torch", rng)
    out = torch.full((B, HKV, KEEP), -1, dtype=torch.int64)
    kwargs = dict(out_indices=out)
    if case == "nan":
        scores[1, 2, 7] = float("nan")
    elif case == "prefix":
        kwargs["protected_prefix_len"] = -1
    elif case == "v_heads":
        v = v[:, :2]
    elif case == "v_seq":
        v = v[:, :, : S - 3]
    elif case == "v_batch":
        v = v[:1]
    elif case == "scores_seq":
        scores = scores[..., : S - 3]
    snaps = bits(k), bits(v), bits(out)
    capacity = float(KEEP) if case == "capacity_dtype" else KEEP
    with pytest.raises((ValueError, TypeError)) as info:
        imoe.compact_kv_cache_inplace(k, v, scores, capacity, **kwargs)
    assert [bits(t).tobytes() for t in (k, v, out)] == [s.tobytes() for s in snaps]
    if case.startswith("v_"):  # named by the caches' own check, not the core's buffer numbers
        assert "value_cache" in str(info.value) and "key_cache" in str(info.value)


