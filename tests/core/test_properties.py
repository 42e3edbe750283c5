"""Hypothesis properties: the kept set is the top-C set, compacting twice is
compacting once, swap + restore is the identity, the map applied on its own
equals the fused compaction, and the original MoE API agrees with itself."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
from _helpers import (
    PROPERTY_DTYPES,
    PROPERTY_FRAMEWORKS,
    TIE_VALUES,
    assert_involution,
    bits,
    clone,
    expected_after,
    make_data,
    property_settings,
    reference_indices,
    reference_kept,
    rows,
    scores_from_values,
    target_map_from_indices,
    to_numpy,
)
from hypothesis import given
from hypothesis import strategies as st

SETTINGS = property_settings(150)
FRAMEWORKS = PROPERTY_FRAMEWORKS
DATA_DTYPES = PROPERTY_DTYPES


@st.composite
def problems(draw, window: bool = True):
    """A compaction problem: buffer, scores, capacity, prefix and window."""
    framework = draw(st.sampled_from(FRAMEWORKS))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n = draw(st.integers(1, 40))
    capacity = draw(st.integers(0, n + 3))
    kept = min(capacity, n)
    prefix = draw(st.integers(0, kept))
    recent = draw(st.integers(0, kept - prefix)) if window else 0
    row = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=2)))
    data_dtype = draw(st.sampled_from(DATA_DTYPES + (["bfloat16"] if framework == "torch" else [])))
    score_dtype = draw(st.sampled_from(
        ["float32", "float16"] + (["bfloat16"] if framework == "torch" else [])))
    value = st.one_of(st.sampled_from(list(TIE_VALUES)),
                      st.floats(-1e4, 1e4, allow_nan=False, width=16))
    values = draw(st.lists(value, min_size=int(np.prod(lead + (n,))),
                           max_size=int(np.prod(lead + (n,)))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = make_data(lead + (n,) + row, data_dtype, framework, rng)
    scores = scores_from_values(np.array(values).reshape(lead + (n,)), score_dtype, framework)
    return dict(x=x, scores=scores, capacity=capacity, prefix=prefix, window=recent,
                dim=len(lead), framework=framework)


@SETTINGS
@given(p=problems(), index_dtype=st.sampled_from(["int32", "int64"]))
def test_kept_set_is_the_top_c_set(p, index_dtype):
    idx = imoe.idempotent_map(p["scores"], p["capacity"], protected_prefix=p["prefix"],
                              recent_window=p["window"], index_dtype=index_dtype)
    n = p["scores"].shape[-1]
    kept = reference_kept(p["scores"], p["capacity"], p["prefix"], p["window"])
    got = to_numpy(idx)
    assert str(got.dtype) == index_dtype
    flat = rows(got)
    for r, kept_row in enumerate(kept):
        assert sorted(flat[r].tolist()) == kept_row.tolist()
    np.testing.assert_array_equal(
        got, reference_indices(kept, n, p["capacity"], p["scores"].shape[:-1]))


@SETTINGS
@given(p=problems(window=False))
def test_compacting_twice_is_compacting_once(p):
    """Tokens and their scores move together (swap); the compacted scores then
    select exactly [0, C'): the second compaction is the identity and moves
    nothing. (Not so in move mode: the tail keeps copies of the kept tokens.)"""
    mode = "swap"
    x, scores, dim = p["x"], p["scores"], p["dim"]
    carried = clone(scores)
    first = imoe.compact_([x, carried], clone(scores), p["capacity"], dim=dim, mode=mode,
                          protected_prefix=p["prefix"])
    after_once = [bits(x), bits(carried)]
    second = imoe.compact_([x, carried], clone(carried), p["capacity"], dim=dim, mode=mode,
                           protected_prefix=p["prefix"])
    idx = to_numpy(second.indices)
    np.testing.assert_array_equal(idx, np.broadcast_to(np.arange(idx.shape[-1]), idx.shape))
    np.testing.assert_array_equal(bits(x), after_once[0])
    np.testing.assert_array_equal(bits(carried), after_once[1])
    assert to_numpy(first.indices).shape == idx.shape


@SETTINGS
@given(p=problems())
def test_swap_then_restore_is_the_identity(p):
    x, dim = p["x"], p["dim"]
    carried = clone(p["scores"])
    original = [bits(x), bits(carried)]
    res = imoe.compact_([x, carried], p["scores"], p["capacity"], dim=dim, mode="swap",
                        protected_prefix=p["prefix"], recent_window=p["window"])
    out = imoe.restore_([x, carried], res.indices, dim=dim)
    assert out[0] is x
    np.testing.assert_array_equal(bits(x), original[0])
    np.testing.assert_array_equal(bits(carried), original[1])


@SETTINGS
@given(p=problems(), mode=st.sampled_from(["swap", "move"]),
       index_dtype=st.sampled_from(["int32", "int64"]))
def test_apply_map_equals_compact(p, mode, index_dtype):
    x, dim = p["x"], p["dim"]
    before = bits(x)
    by_indices, by_target_map = clone(x), clone(x)
    kwargs = dict(protected_prefix=p["prefix"], recent_window=p["window"])
    res = imoe.compact_(x, p["scores"], p["capacity"], dim=dim, mode=mode, **kwargs)
    idx, tm = imoe.idempotent_map(p["scores"], p["capacity"], form="both",
                                  index_dtype=index_dtype, **kwargs)
    np.testing.assert_array_equal(to_numpy(idx), to_numpy(res.indices))
    assert_involution(to_numpy(tm))
    np.testing.assert_array_equal(to_numpy(tm),
                                  target_map_from_indices(to_numpy(idx), x.shape[dim]))

    view = imoe.apply_map_(by_indices, idx, dim=dim, mode=mode)
    assert tuple(view.shape) == tuple(res.values.shape)
    assert imoe.apply_map_(by_target_map, target_map=tm, dim=dim, mode=mode) is by_target_map
    np.testing.assert_array_equal(bits(by_indices), bits(x))
    np.testing.assert_array_equal(bits(by_target_map), bits(x))
    np.testing.assert_array_equal(bits(x), expected_after(before, dim, to_numpy(idx), mode))


@SETTINGS
@given(p=problems())
def test_thread_count_does_not_change_the_result(p):
    x, dim = p["x"], p["dim"]
    other = clone(x)
    kwargs = dict(dim=dim, protected_prefix=p["prefix"], recent_window=p["window"])
    one = imoe.compact_(x, p["scores"], p["capacity"], num_threads=1, **kwargs)
    two = imoe.compact_(other, p["scores"], p["capacity"], num_threads=2, **kwargs)
    np.testing.assert_array_equal(to_numpy(one.indices), to_numpy(two.indices))
    np.testing.assert_array_equal(bits(x), bits(other))


@st.composite
def involutions(draw):
    """Any involution [R, N]: random disjoint pairs, the rest fixed points."""
    r, n = draw(st.integers(1, 3)), draw(st.integers(1, 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tm = np.tile(np.arange(n), (r, 1))
    for row in tm:
        order = rng.permutation(n)
        pairs = draw(st.integers(0, n // 2))
        for a, b in order[: 2 * pairs].reshape(-1, 2):
            row[a], row[b] = b, a
    return tm


@SETTINGS
@given(tm=involutions(), mode=st.sampled_from(["swap", "move"]),
       index_dtype=st.sampled_from(["int32", "int64"]), seed=st.integers(0, 2**32 - 1))
def test_apply_any_involution(tm, mode, index_dtype, seed):
    """Swap exchanges every 2-cycle; move copies the higher slot into the lower."""
    r, n = tm.shape
    x = make_data((r, n, 3), "float16", "numpy", np.random.default_rng(seed))
    before = bits(x)
    imoe.apply_map_(x, target_map=tm.astype(index_dtype), mode=mode)
    expected = before.copy()
    for row in range(r):
        for a in range(n):
            b = tm[row, a]
            if mode == "swap" or a < b:
                expected[row, a] = before[row, b]
    np.testing.assert_array_equal(bits(x), expected)


@st.composite
def moe_problems(draw):
    framework = draw(st.sampled_from(FRAMEWORKS))
    experts, tokens, hidden = draw(st.integers(1, 4)), draw(st.integers(1, 40)), draw(
        st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = "bfloat16" if framework == "torch" else "float16"
    x = make_data((experts, tokens, hidden), dtype, framework, rng)
    values = rng.choice(TIE_VALUES, size=(experts, tokens)) if draw(st.booleans()) else \
        rng.standard_normal((experts, tokens))
    scores = scores_from_values(values, "float32", framework)
    return x, scores, draw(st.integers(0, tokens + 2))


@SETTINGS
@given(problem=moe_problems())
def test_moe_map_then_apply_equals_router(problem):
    x, scores, capacity = problem
    experts, tokens, hidden = x.shape
    via_map = clone(x)
    router = imoe.InplaceMoERouter(hidden, experts)
    values, indices = router(x, scores, expert_capacity=capacity, return_indices=True)
    target_map = imoe.generate_idempotent_moe_map(scores, capacity)
    assert imoe.compact_moe_tokens_inplace(via_map, target_map) is via_map
    np.testing.assert_array_equal(bits(via_map), bits(x))
    np.testing.assert_array_equal(to_numpy(target_map),
                                  target_map_from_indices(to_numpy(indices), tokens))
    assert tuple(values.shape) == (experts, min(capacity, tokens), hidden)
