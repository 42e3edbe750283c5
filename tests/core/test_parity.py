"""Bit-exact parity of compact_ with the NumPy reference in _helpers.

The reference keeps, per row, the first C of a stable sort by (score desc,
index asc) over [P, N - W), plus [0, P) and [N - W, N); the returned indices
must follow the pairing rule, and the buffer must equal the gather of the
original at those indices (swap: the whole buffer is the permutation; move:
[:C'] is the gather and [C', N) is untouched)."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import (
    DATA_DTYPES,
    FRAMEWORKS,
    SCORE_DTYPES,
    assert_involution,
    bits,
    clone,
    data_ptr,
    expected_after,
    is_torch,
    make_data,
    make_scores,
    reference_indices,
    reference_kept,
    requires_torch,
    rows,
    scores_f64,
    scores_from_values,
    supported,
    target_map_from_indices,
    to_framework,
    to_numpy,
    torch,
)

MODES = ["swap", "move"]


def check_compact(x, scores, capacity, *, dim=None, mode="swap", prefix=0, window=0,
                  nan="raise", index_dtype=None, out_indices=None, out_target_map=None,
                  base=None, view_of=None):
    """Run compact_ on `x` (a buffer or a list of buffers) and check everything
    against the reference. `base` and `view_of` describe a view: x is
    view_of(base), and the memory of `base` outside the view must not change."""
    buffers = list(x) if isinstance(x, list) else [x]
    n_dim = (scores.ndim - 1) if dim is None else dim
    before = [bits(b) for b in buffers]
    base_before = bits(base) if base is not None else None
    kwargs = {}
    if index_dtype is not None:
        kwargs["index_dtype"] = index_dtype
    res = imoe.compact_(
        x, scores, capacity, dim=dim, mode=mode, protected_prefix=prefix, recent_window=window,
        nan=nan, out_indices=out_indices, out_target_map=out_target_map, **kwargs,
    )
    n = buffers[0].shape[n_dim]
    lead = tuple(buffers[0].shape[:n_dim])
    kept = reference_kept(scores, capacity, prefix, window, nan_lowest=(nan == "lowest"))
    ref_idx = reference_indices(kept, n, capacity, lead)
    c = ref_idx.shape[-1]

    # indices: the kept set, and the pairing rule
    if out_indices is not None:
        assert res.indices is out_indices
    idx = to_numpy(res.indices)
    assert idx.shape == lead + (c,)
    if index_dtype is not None:
        assert str(idx.dtype) == index_dtype
    flat = rows(idx)
    for r, kept_row in enumerate(kept):
        assert sorted(flat[r].tolist()) == sorted(kept_row.tolist()), f"row {r}: wrong kept set"
    np.testing.assert_array_equal(idx, ref_idx, err_msg="pairing rule violated")

    # values: views of the first C' slots, sharing the caller's memory
    values = res.values if isinstance(x, list) else (res.values,)
    assert len(values) == len(buffers)
    for v, b in zip(values, buffers):
        expected_shape = tuple(b.shape[:n_dim]) + (c,) + tuple(b.shape[n_dim + 1:])
        assert tuple(v.shape) == expected_shape
        if c > 0:
            assert data_ptr(v) == data_ptr(b)

    # buffers: bit-exact against the gather
    for k, (b, pre) in enumerate(zip(buffers, before)):
        expected = expected_after(pre, n_dim, ref_idx, mode)
        after = bits(b)
        np.testing.assert_array_equal(after, expected, err_msg=f"buffer {k} ({mode})")
        if mode == "swap":  # every row is a permutation of its original slots
            assert _slot_multiset(after, n_dim) == _slot_multiset(pre, n_dim)
    if base is not None:
        expected_base = base_before.copy()
        view_of(expected_base)[...] = expected_after(
            np.ascontiguousarray(view_of(base_before)), n_dim, ref_idx, mode)
        np.testing.assert_array_equal(bits(base), expected_base,
                                      err_msg="memory outside the view changed")

    if out_target_map is not None:
        tm = to_numpy(out_target_map)
        assert_involution(tm)
        np.testing.assert_array_equal(tm, target_map_from_indices(ref_idx, n))
    return res, ref_idx


def _slot_multiset(b: np.ndarray, dim: int) -> list:
    """Per row, the sorted byte strings of its slots."""
    slots = np.ascontiguousarray(b).reshape(int(np.prod(b.shape[:dim], dtype=np.int64)),
                                            b.shape[dim], int(np.prod(b.shape[dim + 1:])))
    return [sorted(slot.tobytes() for slot in row) for row in slots]


def _combos():
    for fw in FRAMEWORKS:
        for dt in DATA_DTYPES:
            for st in SCORE_DTYPES:
                if supported(fw.values[0], dt) and supported(fw.values[0], st):
                    yield pytest.param(fw.values[0], dt, st, marks=fw.marks,
                                       id=f"{fw.values[0]}-{dt}-scores_{st}")


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framework,data_dtype,score_dtype", list(_combos()))
def test_dtype_parity(framework, data_dtype, score_dtype, mode, rng):
    x = make_data((3, 37, 5), data_dtype, framework, rng)
    scores = make_scores((3, 37), score_dtype, framework, rng)
    check_compact(x, scores, 13, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_distinct_scores_parity(framework, mode, rng):
    x = make_data((4, 200, 3), "float32", framework, rng)
    scores = make_scores((4, 200), "float32", framework, rng, ties=False)
    check_compact(x, scores, 77, mode=mode)


@pytest.mark.parametrize("prefix,window", [(4, 0), (0, 3), (2, 5), (6, 7), (13, 0), (0, 13)])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_protected_prefix_and_window(framework, prefix, window, rng):
    x = make_data((3, 41, 4), "float16", framework, rng)
    scores = make_scores((3, 41), "float32", framework, rng)
    scores[:, :prefix] = -np.inf  # protected slots are kept whatever their score
    scores[:, 41 - window:] = -np.inf
    _, idx = check_compact(x, scores, 13, prefix=prefix, window=window)
    for row in rows(idx):
        assert set(range(prefix)) | set(range(41 - window, 41)) <= set(row.tolist())


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_negative_zero_ties_positive_zero(framework, rng):
    values = np.zeros((2, 16))
    values[:, ::2] = -0.0
    values[1, 9] = 1.0
    for score_dtype in SCORE_DTYPES:
        if not supported(framework, score_dtype):
            continue
        x = make_data((2, 16, 3), "int8", framework, rng)
        _, idx = check_compact(x, scores_from_values(values, score_dtype, framework), 5)
        # all slots tie: the lowest indices win (row 1: slot 9 first)
        assert sorted(idx[0].tolist()) == [0, 1, 2, 3, 4]
        assert sorted(idx[1].tolist()) == [0, 1, 2, 3, 9]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_nan_lowest_parity(framework, rng):
    values = rng.standard_normal((3, 30))
    values[0, [1, 5, 29]] = np.nan
    values[1, :] = np.nan
    values[2, 3] = -np.inf
    values[2, 4] = np.nan
    x = make_data((3, 30, 2), "float32", framework, rng)
    scores = to_framework(values.astype(np.float32), framework)
    check_compact(x, scores, 28, nan="lowest")


def _random_bit_scores(shape, dtype, framework, rng, nan_bits=()):
    """Scores of every bit pattern but NaN (negatives, denormals, infinities),
    then the given NaN patterns at random places of every row."""
    width = 32 if dtype == "float32" else 16
    raw = rng.integers(0, 2**width, size=shape, dtype=np.uint64).astype(f"u{width // 8}")
    exponent_all_ones = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}[dtype]
    mantissa = {"float32": 0x7FFFFF, "float16": 0x3FF, "bfloat16": 0x7F}[dtype]
    is_nan = ((raw & exponent_all_ones) == exponent_all_ones) & ((raw & mantissa) != 0)
    raw[is_nan] &= ~np.array(mantissa, dtype=raw.dtype)  # NaN -> +-inf
    for row in raw.reshape(-1, shape[-1]):
        row[rng.choice(row.size, size=len(nan_bits), replace=False)] = nan_bits
    signed = raw.view(f"i{width // 8}")
    if framework == "torch":
        return torch.from_numpy(signed.copy()).view(getattr(torch, dtype))
    return raw.view(dtype)


@pytest.mark.parametrize("score_dtype", SCORE_DTYPES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_score_bit_pattern(framework, score_dtype, rng):
    """Negative numbers, denormals and infinities rank as their values do."""
    if not supported(framework, score_dtype):
        pytest.skip("NumPy has no bfloat16")
    x = make_data((3, 3000, 2), "int8", framework, rng)
    check_compact(x, _random_bit_scores((3, 3000), score_dtype, framework, rng), 1100)


NAN_BITS = {  # quiet, signalling, negative, with payloads
    "float32": [0x7FC00000, 0x7F800001, 0xFFC00000, 0xFFFFFFFF, 0x7FABCDEF],
    "float16": [0x7E00, 0x7C01, 0xFE00, 0xFFFF, 0x7D55],
    "bfloat16": [0x7FC0, 0x7F81, 0xFFC0, 0xFFFF, 0x7FA5],
}


@pytest.mark.parametrize("score_dtype", SCORE_DTYPES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_nan_bit_pattern(framework, score_dtype, rng):
    """Every NaN, negative ones included, ranks lowest with nan="lowest" and
    is an error otherwise."""
    if not supported(framework, score_dtype):
        pytest.skip("NumPy has no bfloat16")
    for pattern in NAN_BITS[score_dtype]:
        scores = _random_bit_scores((2, 50), score_dtype, framework, rng, nan_bits=[pattern] * 4)
        x = make_data((2, 50, 3), "float16", framework, rng)
        _, idx = check_compact(x, scores, 47, nan="lowest")
        kept_nans = np.isnan(np.take_along_axis(scores_f64(scores), idx, axis=1)).sum(axis=1)
        np.testing.assert_array_equal(kept_nans, [1, 1])  # 4 NaNs a row, 3 dropped
        before = bits(x)
        with pytest.raises(ValueError, match="scores"):
            imoe.compact_(x, scores, 10)
        np.testing.assert_array_equal(bits(x), before)


@pytest.mark.parametrize("score_dtype", SCORE_DTYPES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_long_rows_with_ties(framework, score_dtype, rng):
    if not supported(framework, score_dtype):
        pytest.skip("NumPy has no bfloat16")
    x = make_data((2, 70000, 1), "uint8", framework, rng)
    check_compact(x, make_scores((2, 70000), score_dtype, framework, rng), 30001,
                  prefix=4, window=100)


@requires_torch
def test_reference_agrees_with_torch_topk(rng):
    """The reference itself: with distinct scores the kept set is torch.topk's."""
    values = torch.from_numpy(rng.permutation(500).reshape(2, 250).astype(np.float32))
    kept = reference_kept(values, 100)
    top = torch.topk(values, 100, dim=1).indices.numpy()
    for r in range(2):
        assert sorted(top[r].tolist()) == kept[r].tolist()


@pytest.mark.parametrize("dtype", [">f4", "<c16", [("a", "<i4"), ("b", "<f2")], "V3", "<M8[s]"],
                         ids=["big-endian", "complex", "structured", "void3", "datetime"])
def test_numpy_dtypes_moved_as_bytes(dtype, rng):
    raw = rng.integers(0, 256, size=(3, 30, 2 * np.dtype(dtype).itemsize), dtype=np.uint8)
    x = raw.view(dtype)
    assert x.shape == (3, 30, 2)
    check_compact(x, make_scores((3, 30), "float32", "numpy", rng), 11)


@requires_torch
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "complex64", "int16",
                                   "uint16", "int64"])
def test_torch_dtypes_moved_as_bytes(dtype, rng):
    torch_dtype = getattr(torch, dtype)
    size = torch.empty((), dtype=torch_dtype).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, size=(3, 30, 2 * size), dtype=np.uint8))
    x = raw.view(torch_dtype)
    check_compact(x, make_scores((3, 30), "float32", "torch", rng), 11)


# --------------------------------------------------------------------------- shapes


SHAPES = [
    # (x shape, scores shape, capacity)
    pytest.param((3, 1, 4), (3, 1), 0, id="N1-C0"),
    pytest.param((3, 1, 4), (3, 1), 1, id="N1-C1"),
    pytest.param((2, 9, 4), (2, 9), 0, id="C0"),
    pytest.param((2, 9, 4), (2, 9), 9, id="C=N"),
    pytest.param((2, 9, 4), (2, 9), 50, id="C>N"),
    pytest.param((4, 33), (4, 33), 10, id="one-element-row"),
    pytest.param((1, 21, 7), (1, 21), 8, id="R1"),
    pytest.param((25, 6), (25,), 11, id="lead_ndim0"),
    pytest.param((2, 3, 2, 19, 3), (2, 3, 2, 19), 7, id="three-lead-dims"),
    pytest.param((2, 11, 2, 3), (2, 11), 4, id="two-row-axes"),
    pytest.param((257, 50, 3), (257, 50), 20, id="many-rows"),
    pytest.param((2, 0, 3), (2, 0), 3, id="N0"),
    pytest.param((0, 5, 3), (0, 5), 3, id="R0"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("x_shape,s_shape,capacity", SHAPES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_odd_shapes(framework, x_shape, s_shape, capacity, mode, rng):
    x = make_data(x_shape, "float16", framework, rng)
    scores = make_scores(s_shape, "float32", framework, rng)
    res, idx = check_compact(x, scores, capacity, mode=mode)
    if capacity >= x_shape[len(s_shape) - 1]:
        n = x_shape[len(s_shape) - 1]
        np.testing.assert_array_equal(idx, np.broadcast_to(np.arange(n), idx.shape))


@pytest.mark.parametrize("x_shape", [(2, 0, 3), (0, 5, 3), (0, 0, 3)], ids=["N0", "R0", "R0-N0"])
def test_numpy_empty_arrays(x_shape):
    """NumPy gives empty arrays all-zero strides: nothing to move, nothing to refuse."""
    x = np.zeros(x_shape, np.float32)
    scores = np.zeros(x_shape[:2], np.float32)
    res = imoe.compact_(x, scores, 3)
    assert res.indices.shape == (x_shape[0], min(3, x_shape[1]))
    assert res.values.shape == (x_shape[0], min(3, x_shape[1]), 3)
    imoe.restore_(x, res.indices)
    assert imoe.idempotent_map(scores, 3, form="target_map").shape == x_shape[:2]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_restore_knows_the_indices_of_a_move_compaction(framework, rng):
    """restore_ refuses the index array a move-mode compact_ wrote (its
    refusal, buffers unchanged, is a case of test_bad_inputs_maps.py), and only
    that array while it holds a move's map: a swap compaction into the same
    out_indices, or a copy, restores as usual."""
    import gc

    from idempotent_moe import _compaction

    x = make_data((3, 30, 4), "float32", framework, rng)
    scores = make_scores((3, 30), "float32", framework, rng)
    before = bits(x)
    idx = imoe.compact_(x, scores, 9, mode="move").indices
    with pytest.raises(ValueError, match="mode='move'"):
        imoe.restore_(x, idx)
    assert not np.array_equal(bits(x), before)
    z = make_data((3, 30, 4), "float32", framework, rng)
    z_before, copy = bits(z), clone(idx)
    imoe.apply_map_(z, copy)  # the move's map applied in swap mode to another buffer
    imoe.restore_(z, copy)    # a copy is not the array the move wrote
    np.testing.assert_array_equal(bits(z), z_before)
    y = make_data((3, 30, 4), "float32", framework, rng)
    y_before = bits(y)
    imoe.compact_(y, scores, 9, out_indices=idx)  # a swap compaction rewrites the array
    imoe.restore_(y, idx)
    np.testing.assert_array_equal(bits(y), y_before)
    # the record is weak: the indices' death removes it
    idx = imoe.compact_(x, scores, 9, mode="move").indices
    entries = len(_compaction._move_indices)
    del idx
    gc.collect()
    assert len(_compaction._move_indices) == entries - 1


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_one_byte_rows(framework, rng):
    x = make_data((3, 40, 1), "uint8", framework, rng)
    check_compact(x, make_scores((3, 40), "float32", framework, rng), 17)


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_64kib_rows(framework, dtype, rng):
    d = 65536 if dtype == "uint8" else 16384
    x = make_data((2, 6, d), dtype, framework, rng)
    check_compact(x, make_scores((2, 6), "float32", framework, rng), 3)


# --------------------------------------------------------------------------- strides


VIEWS = [
    # (base shape, view, scores shape, capacity)
    pytest.param((3, 40, 4), lambda a: a[:, ::2], (3, 20), 7, id="every-other-slot"),
    pytest.param((20, 3, 4), lambda a: a.swapaxes(0, 1), (3, 20), 7, id="slot-axis-outermost"),
    pytest.param((3, 20, 8), lambda a: a[..., 1:5], (3, 20), 9, id="row-slice"),
    pytest.param((6, 20, 4), lambda a: a[::2, 3:17], (3, 14), 5, id="strided-lead"),
    pytest.param((3, 20, 4, 5), lambda a: a[:, :, 1:3], (3, 20), 6, id="row-axes-sliced-outer"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("base_shape,view_of,s_shape,capacity", VIEWS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_strided_views(framework, base_shape, view_of, s_shape, capacity, mode, rng):
    base = make_data(base_shape, "float32", framework, rng)
    x = view_of(base)
    scores = make_scores(s_shape, "bfloat16" if framework == "torch" else "float16", framework, rng)
    check_compact(x, scores, capacity, dim=1, mode=mode, base=base, view_of=view_of)


@pytest.mark.parametrize("mode", MODES)
def test_numpy_negative_strides(mode, rng):
    base = make_data((3, 30, 4), "float64", "numpy", rng)
    view_of = lambda a: a[:, ::-1]  # noqa: E731
    scores = make_scores((4, 30), "float32", "numpy", rng)[1:, ::-1]  # negative strides too
    check_compact(view_of(base), scores, 11, mode=mode, base=base, view_of=view_of)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_strided_scores(framework, rng):
    x = make_data((3, 25, 2), "int8", framework, rng)
    scores = make_scores((3, 50), "float32", framework, rng)[:, 1::2]
    check_compact(x, scores, 9)


def test_broadcast_scores(rng):
    """Inputs may be read-only and stride-0: one score row shared by all rows."""
    x = make_data((4, 30, 2), "float32", "numpy", rng)
    scores = np.broadcast_to(make_scores((30,), "float32", "numpy", rng), (4, 30))
    _, idx = check_compact(x, scores, 12)
    assert (idx == idx[0]).all()


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_reversed_out_indices(index_dtype, rng):
    x = make_data((3, 30, 2), "float32", "numpy", rng)
    out = np.full((3, 12), -7, dtype=index_dtype)
    res, idx = check_compact(x, make_scores((3, 30), "float16", "numpy", rng), 12,
                             out_indices=out[:, ::-1])
    np.testing.assert_array_equal(out[:, ::-1], idx)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fused_kv_halves(framework, rng):
    """K and V as the two halves of one fused cache: interleaved, not overlapping."""
    kv = make_data((2, 3, 40, 16), "float16", framework, rng)
    before = bits(kv)
    scores = make_scores((2, 3, 40), "float32", framework, rng)
    res = imoe.compact_([kv[..., :8], kv[..., 8:]], scores, 15)
    ref = reference_indices(reference_kept(scores, 15), 40, 15, (2, 3))
    np.testing.assert_array_equal(to_numpy(res.indices), ref)
    np.testing.assert_array_equal(bits(kv), expected_after(before, 2, ref, "swap"))


def test_unaligned_buffer(rng):
    """Buffers move as bytes: any address works."""
    raw = np.zeros(3 * 20 * 4 * 4 + 1, dtype=np.uint8)
    x = raw[1:].view(np.float32).reshape(3, 20, 4)
    x[...] = make_data((3, 20, 4), "float32", "numpy", rng)
    check_compact(x, make_scores((3, 20), "float32", "numpy", rng), 7)


@pytest.mark.parametrize("view_of", [lambda a: a[..., ::2], lambda a: a.swapaxes(1, 2)[:, :, :4]],
                         ids=["row-step-2", "row-transposed"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_non_contiguous_row_is_rejected(framework, view_of, rng):
    base = make_data((3, 8, 8), "float32", framework, rng)
    x = view_of(base)
    before = bits(base)
    with pytest.raises(ValueError, match=r"contiguous"):
        imoe.compact_(x, make_scores((3, 8), "float32", framework, rng), 3, dim=1)
    np.testing.assert_array_equal(bits(base), before)


def test_numpy_reversed_row_is_rejected(rng):
    base = make_data((3, 8, 8), "float32", "numpy", rng)
    before = bits(base)
    with pytest.raises(ValueError, match=r"contiguous"):
        imoe.compact_(base[:, :, ::-1], make_scores((3, 8), "float32", "numpy", rng), 3)
    np.testing.assert_array_equal(bits(base), before)


# --------------------------------------------------------------------------- several buffers


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_k_and_v_share_one_map(framework, mode, rng):
    k = make_data((2, 3, 50, 4), "float16", framework, rng)
    v = make_data((2, 3, 50, 12), "float32", framework, rng)
    scores = make_scores((2, 3, 50), "float32", framework, rng)
    res, _ = check_compact([k, v], scores, 20, mode=mode, prefix=2, window=3)
    assert len(res.values) == 2


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tokens_with_their_scores(framework, rng):
    tokens = make_data((4, 30, 6), "bool", framework, rng)
    scores = make_scores((4, 30), "float16", framework, rng)
    carried = scores.clone() if is_torch(scores) else scores.copy()
    res, idx = check_compact([tokens, carried], scores, 12, dim=1)
    # the carried scores now hold the kept scores in their new slots
    np.testing.assert_array_equal(
        scores_f64(res.values[1]), np.take_along_axis(scores_f64(scores), idx, axis=1))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_scores_buffer_is_the_selection_scores(framework, rng):
    """Tokens and their scores compacted in one call, the scores array being
    both the selection input and a moved buffer."""
    tokens = make_data((4, 30, 6), "float32", framework, rng)
    scores = make_scores((4, 30), "float32", framework, rng)
    original = scores_f64(scores)
    tokens_before = bits(tokens)
    res = imoe.compact_([tokens, scores], scores, 12, dim=1)
    ref_idx = reference_indices(reference_kept(original, 12), 30, 12)
    np.testing.assert_array_equal(to_numpy(res.indices), ref_idx)
    np.testing.assert_array_equal(bits(tokens), expected_after(tokens_before, 1, ref_idx, "swap"))
    np.testing.assert_array_equal(scores_f64(scores)[:, :12],
                                  np.take_along_axis(original, ref_idx, axis=1))


# --------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_out_indices_dtypes(framework, index_dtype, rng):
    x = make_data((3, 40, 4), "float32", framework, rng)
    scores = make_scores((3, 40), "float32", framework, rng)
    out = to_framework(np.full((3, 15), -7, dtype=index_dtype), framework)
    check_compact(x, scores, 15, out_indices=out, index_dtype=None)
    assert str(to_numpy(out).dtype) == index_dtype


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_allocated_index_dtype(framework, index_dtype, rng):
    x = make_data((3, 40, 4), "uint8", framework, rng)
    scores = make_scores((3, 40), "float16", framework, rng)
    res, _ = check_compact(x, scores, 15, index_dtype=index_dtype)
    assert is_torch(res.indices) == (framework == "torch")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_out_target_map(framework, mode, rng):
    x = make_data((2, 2, 35, 3), "float64", framework, rng)
    scores = make_scores((2, 2, 35), "float32", framework, rng)
    tm = to_framework(np.full((2, 2, 35), -1, dtype=np.int32), framework)
    check_compact(x, scores, 16, mode=mode, out_target_map=tm)


# --------------------------------------------------------------------------- active indices


def _check_active(x, active, kept_rows, n_dim, capacity=None, mode="swap"):
    before = bits(x)
    res = imoe.compact_(x, active_indices=active, capacity=capacity, mode=mode)
    idx = to_numpy(res.indices)
    ref_idx = reference_indices(kept_rows, x.shape[n_dim], len(kept_rows[0]), x.shape[:n_dim])
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(bits(x), expected_after(before, n_dim, ref_idx, mode))
    return res


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_shared_active_indices(framework, index_dtype, mode, rng):
    x = make_data((2, 3, 40, 4), "float16", framework, rng)
    chosen = rng.choice(40, size=14, replace=False)  # any order
    active = to_framework(chosen.astype(index_dtype), framework)
    res = _check_active(x, active, [np.sort(chosen)] * 6, 2, mode=mode)
    assert tuple(res.values.shape) == (2, 3, 14, 4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_per_row_active_indices(framework, index_dtype, mode, rng):
    x = make_data((2, 3, 40, 4), "int8", framework, rng)
    chosen = np.stack([rng.choice(40, size=14, replace=False) for _ in range(6)])
    active = to_framework(chosen.reshape(2, 3, 14).astype(index_dtype), framework)
    _check_active(x, active, [np.sort(r) for r in chosen], 2, capacity=14, mode=mode)


def test_active_indices_as_list(rng):
    x = make_data((3, 20, 2), "float32", "numpy", rng)
    _check_active(x, [19, 3, 7, 0, 12], [np.array([0, 3, 7, 12, 19])] * 3, 1)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_all_active_moves_nothing(framework, rng):
    x = make_data((2, 10, 3), "float32", framework, rng)
    before = bits(x)
    active = to_framework(rng.permutation(10).astype(np.int64), framework)
    res = imoe.compact_(x, active_indices=active)
    np.testing.assert_array_equal(to_numpy(res.indices), np.tile(np.arange(10), (2, 1)))
    np.testing.assert_array_equal(bits(x), before)
