"""The original API users already know: InplaceMoERouter, the MoE map functions,
InplaceKVCompactor and compact_kv_cache_inplace, plus set_num_threads,
cuda_available, cuda_compiled and an import that needs neither torch nor transformers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import (
    FRAMEWORKS,
    assert_involution,
    bits,
    clone,
    data_ptr,
    expected_after,
    is_torch,
    make_data,
    make_scores,
    package_env,
    reference_indices,
    reference_kept,
    requires_torch,
    target_map_from_indices,
    to_framework,
    to_numpy,
    torch,
)

E, T, D, CAP = 4, 64, 24, 20


def shares_memory(view, base) -> bool:
    if is_torch(base):
        start, end = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
        return start <= view.data_ptr() < end and view.untyped_storage().data_ptr() == \
            base.untyped_storage().data_ptr()
    return np.shares_memory(view, base)


# --------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_router_returns_a_view_of_the_tokens(framework, rng):
    tokens = make_data((E, T, D), "float16", framework, rng)
    scores = make_scores((E, T), "float32", framework, rng)
    before = bits(tokens)
    router = imoe.InplaceMoERouter(hidden_dim=D, num_experts=E, block_d=128)
    kept = router(tokens, scores, expert_capacity=CAP)
    assert tuple(kept.shape) == (E, CAP, D)
    assert data_ptr(kept) == data_ptr(tokens)
    assert shares_memory(kept, tokens)
    ref = reference_indices(reference_kept(scores, CAP), T, CAP)
    np.testing.assert_array_equal(bits(tokens), expected_after(before, 1, ref, "swap"))
    np.testing.assert_array_equal(bits(kept), np.take_along_axis(before, ref[..., None], axis=1))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_router_return_indices(framework, rng):
    tokens = make_data((E, T, D), "bfloat16" if framework == "torch" else "float32",
                       framework, rng)
    scores = make_scores((E, T), "float16", framework, rng)
    before = bits(tokens)
    router = imoe.InplaceMoERouter(D, E)
    kept, indices = router.forward(tokens, scores, expert_capacity=CAP, return_indices=True)
    assert is_torch(indices) == (framework == "torch")
    idx = to_numpy(indices)
    assert idx.shape == (E, CAP)
    np.testing.assert_array_equal(idx, reference_indices(reference_kept(scores, CAP), T, CAP))
    # the kept tokens are the originals at `indices`, in the slots they now fill
    np.testing.assert_array_equal(bits(kept), np.take_along_axis(before, idx[..., None], axis=1))


@pytest.mark.parametrize("hidden", [1, 7, 1000, 4099])
def test_router_any_hidden_size(hidden, rng):
    """Every hidden size works, whatever block_d says."""
    tokens = make_data((2, 16, hidden), "float32", "numpy", rng)
    scores = make_scores((2, 16), "float32", "numpy", rng)
    before = bits(tokens)
    kept, idx = imoe.InplaceMoERouter(hidden, 2, block_d=128)(
        tokens, scores, expert_capacity=5, return_indices=True)
    np.testing.assert_array_equal(bits(tokens), expected_after(before, 1, to_numpy(idx), "swap"))
    assert kept.shape == (2, 5, hidden)


@pytest.mark.parametrize("block_d", [1, 7, 64, 4099])
def test_block_d_is_accepted_and_has_no_effect(block_d, rng):
    """block_d, a tuning hint of the original API, is taken where that API
    took it (keyword or positional) and changes nothing: not the buffer, not
    the returned arrays, not the object."""
    from idempotent_moe.integrations import HuggingFaceMoEInplaceHook

    tokens = make_data((E, T, D), "float16", "numpy", rng)
    scores = make_scores((E, T), "float32", "numpy", rng)
    tm = imoe.generate_idempotent_moe_map(scores, CAP)

    def run(call):
        """The bits of the buffer after `call` and of each array it returns."""
        x = tokens.copy()
        out = call(x)
        return [bits(a) for a in (x, *(out if isinstance(out, tuple) else (out,)))]

    def assert_same(got, want):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)

    plain = imoe.InplaceMoERouter(D, E)
    want = run(lambda x: plain(x, scores, expert_capacity=CAP, return_indices=True))
    for router in (imoe.InplaceMoERouter(D, E, block_d), imoe.InplaceMoERouter(D, E, block_d=block_d)):
        assert_same(run(lambda x, r=router: r(x, scores, expert_capacity=CAP, return_indices=True)), want)
        assert repr(router) == repr(plain) and vars(router) == vars(plain)

    want = run(lambda x: imoe.compact_moe_tokens_inplace(x, tm))
    assert_same(run(lambda x: imoe.compact_moe_tokens_inplace(x, tm, block_d)), want)
    assert_same(run(lambda x: imoe.compact_moe_tokens_inplace(x, tm, block_d=block_d)), want)

    plain = HuggingFaceMoEInplaceHook(D, E, capacity=CAP)
    want = run(lambda x: plain(x, scores, return_indices=True))
    for hook in (HuggingFaceMoEInplaceHook(D, E, None, block_d, capacity=CAP),
                 HuggingFaceMoEInplaceHook(D, E, block_d=block_d, capacity=CAP)):
        assert_same(run(lambda x, h=hook: h(x, scores, return_indices=True)), want)
        assert repr(hook) == repr(plain) and vars(hook) == vars(plain)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_generate_map_is_an_int32_involution(framework, rng):
    scores = make_scores((E, T), "float32", framework, rng)
    tm = imoe.generate_idempotent_moe_map(scores, CAP)
    assert is_torch(tm) == (framework == "torch")
    tm_np = to_numpy(tm)
    assert tm_np.dtype == np.int32 and tm_np.shape == (E, T)
    assert_involution(tm_np)
    ref = reference_indices(reference_kept(scores, CAP), T, CAP)
    np.testing.assert_array_equal(tm_np, target_map_from_indices(ref, T))


@pytest.mark.parametrize("mode", ["swap", "move"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_compact_moe_tokens_inplace(framework, mode, rng):
    tokens = make_data((E, T, D), "int8", framework, rng)
    scores = make_scores((E, T), "float32", framework, rng)
    before = bits(tokens)
    tm = imoe.generate_idempotent_moe_map(scores, CAP)
    assert imoe.compact_moe_tokens_inplace(tokens, tm, block_d=64, mode=mode) is tokens
    ref = reference_indices(reference_kept(scores, CAP), T, CAP)
    np.testing.assert_array_equal(bits(tokens), expected_after(before, 1, ref, mode))


def test_compact_moe_tokens_twice_restores(rng):
    tokens = make_data((E, T, D), "float64", "numpy", rng)
    before = bits(tokens)
    tm = imoe.generate_idempotent_moe_map(make_scores((E, T), "float16", "numpy", rng), CAP)
    imoe.compact_moe_tokens_inplace(tokens, tm)
    assert not np.array_equal(bits(tokens), before)
    imoe.compact_moe_tokens_inplace(tokens, tm)
    np.testing.assert_array_equal(bits(tokens), before)


# --------------------------------------------------------------------------- KV cache

B, H, S, HD, KEEP = 2, 3, 40, 8, 16


def _caches(framework, rng):
    k = make_data((B, H, S, HD), "float16", framework, rng)
    v = make_data((B, H, S, 2 * HD), "float32", framework, rng)
    return k, v


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_kv_build_map_shared_active(framework, rng):
    chosen = rng.choice(S, size=KEEP, replace=False)
    compactor = imoe.InplaceKVCompactor()
    for active in (chosen.tolist(), to_framework(chosen.astype(np.int32), framework)):
        tm = compactor.build_idempotent_map(B, H, S, active, capacity=KEEP)
        tm_np = to_numpy(tm)
        assert tm_np.shape == (B, H, S) and tm_np.dtype == np.int32
        assert_involution(tm_np)
        ref = reference_indices([np.sort(chosen)] * (B * H), S, KEEP, (B, H))
        np.testing.assert_array_equal(tm_np, target_map_from_indices(ref, S))


@requires_torch
def test_kv_build_map_list_on_a_torch_device(rng):
    chosen = rng.choice(S, size=KEEP, replace=False).tolist()
    tm = imoe.InplaceKVCompactor().build_idempotent_map(B, H, S, chosen, KEEP, device="cpu")
    assert is_torch(tm) and tm.dtype == torch.int32
    assert_involution(to_numpy(tm))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_kv_build_map_per_head_active_and_compact(framework, rng):
    chosen = np.stack([rng.choice(S, size=KEEP, replace=False) for _ in range(B * H)])
    active = to_framework(chosen.reshape(B, H, KEEP).astype(np.int64), framework)
    compactor = imoe.InplaceKVCompactor()
    tm = compactor.build_idempotent_map(B, H, S, active)
    ref = reference_indices([np.sort(r) for r in chosen], S, KEEP, (B, H))
    np.testing.assert_array_equal(to_numpy(tm), target_map_from_indices(ref, S))

    k, v = _caches(framework, rng)
    k0, v0 = bits(k), bits(v)
    k_view, v_view = compactor.compact(k, v, tm, KEEP)
    assert tuple(k_view.shape) == (B, H, KEEP, HD) and tuple(v_view.shape) == (B, H, KEEP, 2 * HD)
    assert data_ptr(k_view) == data_ptr(k) and data_ptr(v_view) == data_ptr(v)
    np.testing.assert_array_equal(bits(k), expected_after(k0, 2, ref, "swap"))
    np.testing.assert_array_equal(bits(v), expected_after(v0, 2, ref, "swap"))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_kv_compact_from_scores_keeps_sinks(framework, rng):
    k, v = _caches(framework, rng)
    k0, v0 = bits(k), bits(v)
    scores = make_scores((B, H, S), "float32", framework, rng, ties=False)
    scores[..., :4] = -1e30  # the sinks would never win on score
    k_view, v_view, indices = imoe.InplaceKVCompactor().compact_from_scores(
        k, v, scores, KEEP, protected_prefix_len=4, return_indices=True)
    idx = to_numpy(indices)
    np.testing.assert_array_equal(idx[..., :4], np.broadcast_to(np.arange(4), (B, H, 4)))
    ref = reference_indices(reference_kept(scores, KEEP, prefix=4), S, KEEP, (B, H))
    np.testing.assert_array_equal(idx, ref)
    np.testing.assert_array_equal(bits(k_view), np.take_along_axis(k0, ref[..., None], axis=2))
    np.testing.assert_array_equal(bits(v), expected_after(v0, 2, ref, "swap"))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_kv_compact_from_scores_default_sinks(framework, rng):
    k, v = _caches(framework, rng)
    scores = make_scores((B, H, S), "float16", framework, rng, ties=False)
    scores[..., :4] = -60000.0
    k_view, v_view = imoe.InplaceKVCompactor().compact_from_scores(k, v, scores, KEEP)
    assert tuple(v_view.shape) == (B, H, KEEP, 2 * HD)
    k2, v2 = _caches(framework, np.random.default_rng(0))
    _, _, idx = imoe.compact_kv_cache_inplace(k2, v2, scores, KEEP, return_indices=True)
    assert (to_numpy(idx)[..., :4] == np.arange(4)).all()


@pytest.mark.parametrize("mode", ["swap", "move"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_compact_kv_cache_inplace(framework, mode, rng):
    k, v = _caches(framework, rng)
    k0, v0 = bits(k), bits(v)
    scores = make_scores((B, H, S), "float32", framework, rng)
    k_view, v_view, indices = imoe.compact_kv_cache_inplace(
        k, v, scores, KEEP, protected_prefix_len=2, recent_window=3, mode=mode,
        return_indices=True)
    ref = reference_indices(reference_kept(scores, KEEP, 2, 3), S, KEEP, (B, H))
    np.testing.assert_array_equal(to_numpy(indices), ref)
    np.testing.assert_array_equal(bits(k), expected_after(k0, 2, ref, mode))
    np.testing.assert_array_equal(bits(v), expected_after(v0, 2, ref, mode))
    assert data_ptr(k_view) == data_ptr(k)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_compact_kv_cache_inplace_active(framework, rng):
    k, v = _caches(framework, rng)
    v0 = bits(v)
    chosen = rng.choice(S, size=KEEP, replace=False)
    k_view, v_view = imoe.compact_kv_cache_inplace(
        k, v, active_indices=to_framework(chosen, framework))
    ref = reference_indices([np.sort(chosen)] * (B * H), S, KEEP, (B, H))
    np.testing.assert_array_equal(bits(v), expected_after(v0, 2, ref, "swap"))
    assert tuple(k_view.shape) == (B, H, KEEP, HD)


# --------------------------------------------------------------------------- functional


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_idempotent_map_forms_with_active_indices(framework, rng):
    chosen = rng.choice(S, size=KEEP, replace=False)
    ref = reference_indices([np.sort(chosen)] * (B * H), S, KEEP, (B, H))
    shared = to_framework(chosen.astype(np.int64), framework)
    idx = imoe.idempotent_map(active_indices=shared, num_slots=S, lead_shape=(B, H))
    np.testing.assert_array_equal(to_numpy(idx), ref)
    per_row = to_framework(np.broadcast_to(chosen, (B, H, KEEP)).astype(np.int32), framework)
    idx, tm = imoe.idempotent_map(active_indices=per_row, num_slots=S, form="both",
                                  index_dtype="int32")
    assert to_numpy(idx).dtype == np.int32
    np.testing.assert_array_equal(to_numpy(idx), ref)
    np.testing.assert_array_equal(to_numpy(tm), target_map_from_indices(ref, S))


def test_tuple_of_buffers_gives_a_tuple_of_views(rng):
    k, v = _caches("numpy", rng)
    scores = make_scores((B, H, S), "float32", "numpy", rng)
    res = imoe.compact_((k, v), scores, KEEP)
    assert isinstance(res.values, tuple) and len(res.values) == 2
    assert np.shares_memory(res.values[0], k) and np.shares_memory(res.values[1], v)
    assert res.values[1].shape == (B, H, KEEP, 2 * HD)


# --------------------------------------------------------------------------- library


def test_set_num_threads(rng):
    x = make_data((8, 300, 16), "float32", "numpy", rng)
    scores = make_scores((8, 300), "float32", "numpy", rng)
    results = []
    try:
        for n in (1, 2, 0):
            imoe.set_num_threads(n)
            assert imoe.get_num_threads() == n
            y = clone(x)
            res = imoe.compact_(y, scores, 100)
            results.append((bits(y), to_numpy(res.indices)))
        with pytest.raises(ValueError, match="num_threads"):
            imoe.set_num_threads(-1)
        with pytest.raises(TypeError, match="num_threads"):
            imoe.set_num_threads(1.5)
        assert imoe.get_num_threads() == 0
    finally:
        imoe.set_num_threads(0)
    for y, idx in results[1:]:
        np.testing.assert_array_equal(y, results[0][0])
        np.testing.assert_array_equal(idx, results[0][1])


def test_cuda_available_and_compiled():
    from idempotent_moe import _C

    compiled, available = imoe.cuda_compiled(), imoe.cuda_available()
    assert isinstance(compiled, bool) and isinstance(available, bool)
    assert compiled == bool(_C.cuda_compiled())
    assert available == (_C.cuda_device_count() > 0)
    assert not available or compiled  # a device is only usable by a build that has the kernels
    assert imoe.cuda_available() == available  # stable, and the first call left no error behind


def test_public_names():
    for name in imoe.__all__:
        assert hasattr(imoe, name), name
    assert imoe.Compacted._fields == ("values", "indices")


def test_import_without_torch_or_transformers():
    """`import idempotent_moe` must not need torch or transformers, and NumPy
    arrays must compact without them."""
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None          # any import of torch now fails
        sys.modules["transformers"] = None
        import numpy as np
        import idempotent_moe as imoe
        x = np.arange(2 * 6 * 3, dtype=np.float32).reshape(2, 6, 3)
        s = np.array([[0, 5, 1, 4, 2, 3], [9, 0, 0, 0, 8, 7]], dtype=np.float32)
        res = imoe.compact_(x, s, 3)
        assert res.indices.tolist() == [[3, 1, 5], [0, 4, 5]], res.indices.tolist()
        assert x[0, 0].tolist() == [9.0, 10.0, 11.0] and x[1, 1].tolist() == [30.0, 31.0, 32.0]
        tm = imoe.generate_idempotent_moe_map(s, 3)
        assert isinstance(tm, np.ndarray) and tm.dtype == np.int32
        assert "torch" not in {m for m, v in sys.modules.items() if v is not None}
        print("ok")
    """)
    env = package_env()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("mode", ["swap", "move"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_torch_buffer_lists_take_the_same_call_as_numpy(mode, as_tuple, rng):
    """K and V as a list (or tuple) of torch tensors with the slot axis given:
    the same bytes, indices and views as the same call on NumPy arrays; an
    axis out of range and mismatched slot counts raise what the NumPy call
    raises, leaving every buffer as it was."""
    torch = pytest.importorskip("torch")
    k = rng.standard_normal((2, 3, 40, 8)).astype(np.float16)
    v = rng.standard_normal((2, 3, 40, 5)).astype(np.float32)
    scores = rng.random((2, 3, 40)).astype(np.float32)
    tk, tv = torch.from_numpy(k.copy()), torch.from_numpy(v.copy())
    bufs = (tk, tv) if as_tuple else [tk, tv]
    got = imoe.compact_(bufs, torch.from_numpy(scores), 17, dim=2, mode=mode)
    want = imoe.compact_([k, v], scores, 17, dim=2, mode=mode)
    assert isinstance(got.values, tuple) and len(got.values) == 2
    np.testing.assert_array_equal(got.indices.numpy(), want.indices)
    for t, a, view in zip((tk, tv), (k, v), got.values):
        np.testing.assert_array_equal(t.numpy(), a)
        assert view.shape == (2, 3, 17, a.shape[-1]) and view.data_ptr() == t.data_ptr()
    for dim in (4, -5):
        with pytest.raises(ValueError, match="dim"):
            imoe.compact_([tk, tv], torch.from_numpy(scores), 17, dim=dim)
    short = torch.zeros(2, 3, 39, 5)
    before = tk.clone()
    with pytest.raises(Exception) as torch_error:
        imoe.compact_([tk, short], torch.from_numpy(scores), 17, dim=2)
    with pytest.raises(Exception) as numpy_error:
        imoe.compact_([k, short.numpy()], scores, 17, dim=2)
    assert type(torch_error.value) is type(numpy_error.value)
    assert str(torch_error.value) == str(numpy_error.value)
    assert torch.equal(tk, before)
