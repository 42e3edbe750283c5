"""The permutation engine: `permute_` against index gathers, the "stable" and
"score" orders of a compaction against sorted kept sets and torch.topk, their
restore, and bad input (right exception, every array left as it was)."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import (
    PROPERTY_DTYPES,
    PROPERTY_FRAMEWORKS,
    TIE_VALUES,
    assert_unchanged,
    bits,
    make_data,
    property_settings,
    reference_kept,
    requires_torch,
    rows,
    scores_f64,
    scores_from_values,
    snapshot,
    to_framework,
    to_numpy,
    torch,
)
from hypothesis import given
from hypothesis import strategies as st

SETTINGS = property_settings(120)
FRAMEWORKS = PROPERTY_FRAMEWORKS
DATA_DTYPES = PROPERTY_DTYPES


def gather(before: np.ndarray, dim: int, perm: np.ndarray) -> np.ndarray:
    """What x holds after x.copy_(x.index_select(dim, perm)), row by row:
    perm is [N] (shared) or [lead..., N]; before are bits [lead..., N, row...]."""
    perm = np.asarray(perm, dtype=np.int64)
    if perm.ndim == 1:
        return np.take(before, perm, axis=dim)
    idx = perm.reshape(perm.shape + (1,) * (before.ndim - dim - 1))
    shape = before.shape[:dim] + (perm.shape[-1],) + before.shape[dim + 1:]
    return np.take_along_axis(before, np.broadcast_to(idx, shape), axis=dim)


def random_perm(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "identity":
        return np.arange(n)
    if kind == "rotation":
        return np.roll(np.arange(n), int(rng.integers(0, max(n, 1))))
    if kind == "reversal":
        return np.arange(n)[::-1].copy()
    return rng.permutation(n)


# --------------------------------------------------------------------------- permute_


@st.composite
def permute_problems(draw):
    framework = draw(st.sampled_from(FRAMEWORKS))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n = draw(st.integers(0, 60))
    row = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=2)))
    dtype = draw(st.sampled_from(DATA_DTYPES + (["bfloat16"] if framework == "torch" else [])))
    shared = draw(st.booleans()) or not lead
    kind = draw(st.sampled_from(["random", "random", "rotation", "reversal", "identity"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    perm_rows = 1 if shared else int(np.prod(lead))
    perm = np.stack([random_perm(rng, n, kind) for _ in range(perm_rows)]) if perm_rows else (
        np.zeros((0, n), dtype=np.int64))
    perm = perm.reshape((n,) if shared else lead + (n,))
    index_dtype = draw(st.sampled_from(["int32", "int64"]))
    x = make_data(lead + (n,) + row, dtype, framework, rng)
    if draw(st.booleans()):  # strided slots: every other slot of a longer buffer
        x = make_data(lead + (2 * n,) + row, dtype, framework, rng)[(slice(None),) * len(lead) + (
            slice(None, None, 2),)]
    return dict(x=x, perm=to_framework(perm.astype(index_dtype), framework), dim=len(lead),
                framework=framework, rng=rng, shared=shared,
                inverse=draw(st.booleans()), threads=draw(st.sampled_from([None, 1, 2, 3])),
                workspace=draw(st.booleans()), two=draw(st.booleans()))


@SETTINGS
@given(p=permute_problems())
def test_permute_matches_index_gather(p):
    x, perm, dim = p["x"], p["perm"], p["dim"]
    bufs = [x]
    if p["two"]:
        bufs.append(make_data(x.shape[: dim + 1] + (3,), "float32", p["framework"], p["rng"]))
    before = [bits(b) for b in bufs]
    perm_np = to_numpy(perm).astype(np.int64)
    workspace = None
    if p["workspace"]:
        workspace = np.zeros(max(1, perm_np.size), dtype=np.int32)
        workspace = to_framework(workspace, p["framework"])
    out = imoe.permute_(bufs if p["two"] else x, perm, dim=dim, inverse=p["inverse"],
                        workspace=workspace, num_threads=p["threads"])
    assert out is (bufs if p["two"] else x)
    if p["inverse"]:
        inv = np.empty_like(perm_np)
        np.put_along_axis(inv, perm_np, np.broadcast_to(np.arange(perm_np.shape[-1]), perm_np.shape),
                          axis=-1)
        perm_np = inv
    for b, bb in zip(bufs, before):
        np.testing.assert_array_equal(bits(b), gather(bb, dim, perm_np))
    # inverse undoes forward, bit for bit
    imoe.permute_(bufs, perm, dim=dim, inverse=not p["inverse"], num_threads=p["threads"])
    for b, bb in zip(bufs, before):
        np.testing.assert_array_equal(bits(b), bb)


@requires_torch
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["random", "rotation", "reversal"])
def test_permute_large_rows_match_torch_index_select(rng, threads, kind):
    """Rows longer than the 4 KiB tile (rotated in several chunks) and a
    single row spread over threads by byte ranges."""
    x = make_data((700, 2100), "bfloat16", "torch", rng)  # 4200-byte rows
    perm = torch.from_numpy(random_perm(rng, 700, kind))
    want = x.view(torch.int16).index_select(0, perm)
    imoe.permute_(x, perm, num_threads=threads)
    assert torch.equal(x.view(torch.int16), want)


@requires_torch
def test_permute_other_axes_and_negative_strides(rng):
    """dim in the middle, a flipped (negative-stride) slot axis, rows of two axes."""
    base = make_data((3, 16, 2, 5), "float16", "torch", rng)
    x = base.flip(1)  # negative slot stride
    perm = torch.from_numpy(np.stack([rng.permutation(16) for _ in range(3)]))
    want = torch.stack([x[i].view(torch.int16).index_select(0, perm[i]) for i in range(3)])
    imoe.permute_(x, perm, dim=1)
    assert torch.equal(x.view(torch.int16), want)
    # a 1-d buffer permutes single elements
    v = torch.arange(10, dtype=torch.int64)
    p = torch.from_numpy(rng.permutation(10))
    imoe.permute_(v, p)
    assert torch.equal(v, p)


def test_permute_accepts_lists_and_numpy(rng):
    x = np.arange(12, dtype=np.int32).reshape(6, 2)
    imoe.permute_(x, [5, 4, 3, 2, 1, 0])
    np.testing.assert_array_equal(x[:, 0], [10, 8, 6, 4, 2, 0])


# --------------------------------------------------------------------------- orders


def reference_order(scores, capacity, prefix, window, order, nan_lowest=False) -> list:
    """The kept slots of every row in `order`: ascending, or (score desc, slot asc)."""
    kept = reference_kept(scores, capacity, prefix, window, nan_lowest=nan_lowest)
    if order == "stable":
        return kept
    s = rows(scores_f64(scores))
    out = []
    for r, k in enumerate(kept):
        values = s[r][k] + 0.0
        nan = np.isnan(values)
        out.append(k[np.lexsort((k, np.where(nan, 0.0, -values), nan))])
    return out


def full_permutation(indices_row: np.ndarray, n: int) -> np.ndarray:
    listed = np.zeros(n, dtype=bool)
    listed[indices_row] = True
    return np.concatenate([indices_row, np.flatnonzero(~listed)]).astype(np.int64)


@st.composite
def order_problems(draw):
    framework = draw(st.sampled_from(FRAMEWORKS))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n = draw(st.integers(1, 40))
    capacity = draw(st.integers(0, n + 3))
    kept = min(capacity, n)
    prefix = draw(st.integers(0, kept))
    window = draw(st.integers(0, kept - prefix))
    row = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=2)))
    dtype = draw(st.sampled_from(DATA_DTYPES + (["bfloat16"] if framework == "torch" else [])))
    score_dtype = draw(st.sampled_from(
        ["float32", "float16"] + (["bfloat16"] if framework == "torch" else [])))
    value = st.one_of(st.sampled_from(list(TIE_VALUES)),
                      st.floats(-1e4, 1e4, allow_nan=False, width=16))
    count = int(np.prod(lead + (n,)))
    values = np.array(draw(st.lists(value, min_size=count, max_size=count))).reshape(lead + (n,))
    nan_lowest = draw(st.booleans())
    if nan_lowest and count:
        values.flat[draw(st.integers(0, count - 1))] = np.nan
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return dict(x=make_data(lead + (n,) + row, dtype, framework, rng),
                scores=scores_from_values(values, score_dtype, framework), capacity=capacity,
                prefix=prefix, window=window, dim=len(lead), nan="lowest" if nan_lowest else "raise",
                order=draw(st.sampled_from(["stable", "score"])),
                index_dtype=draw(st.sampled_from(["int32", "int64"])),
                threads=draw(st.sampled_from([None, 1, 3])), framework=framework)


@SETTINGS
@given(p=order_problems(), mode=st.sampled_from(["swap", "move"]))
def test_ordered_compaction_matches_sorted_gather(p, mode):
    x, s, dim = p["x"], p["scores"], p["dim"]
    before = bits(x)
    n = s.shape[-1]
    lead = tuple(s.shape[:-1])
    res = imoe.compact_(x, s, p["capacity"], dim=dim, mode=mode, order=p["order"],
                        protected_prefix=p["prefix"], recent_window=p["window"], nan=p["nan"],
                        index_dtype=p["index_dtype"], num_threads=p["threads"])
    want = reference_order(s, p["capacity"], p["prefix"], p["window"], p["order"],
                           nan_lowest=p["nan"] == "lowest")
    got = to_numpy(res.indices)
    assert str(got.dtype) == p["index_dtype"]
    kept = min(p["capacity"], n)
    assert got.shape == lead + (kept,)
    np.testing.assert_array_equal(rows(got), np.array(want).reshape(len(want), kept))
    # the values view is the gather of the kept slots in order, bit for bit
    np.testing.assert_array_equal(bits(res.values), gather(before, dim, got))
    if mode == "swap":
        full = np.stack([full_permutation(r, n) for r in rows(got)]).reshape(lead + (n,))
        np.testing.assert_array_equal(bits(x), gather(before, dim, full))
        # idempotent_map and apply_map_ reproduce it; restore_ undoes it
        idx = imoe.idempotent_map(s, p["capacity"], order=p["order"], protected_prefix=p["prefix"],
                                  recent_window=p["window"], nan=p["nan"],
                                  index_dtype=p["index_dtype"])
        np.testing.assert_array_equal(to_numpy(idx), got)
        imoe.restore_(x, res.indices, dim=dim, order=p["order"])
        np.testing.assert_array_equal(bits(x), before)
        imoe.apply_map_(x, idx, dim=dim, order=p["order"])
        np.testing.assert_array_equal(bits(x), gather(before, dim, full))


@requires_torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_score_order_is_torch_topk_gather(rng, dtype):
    """With distinct scores, torch.topk(sorted=True) + gather is exactly what
    order="score" gives, indices and values bit for bit. (The gather runs on
    the int16 view: torch.gather of bfloat16 on the CPU canonicalises NaN
    payloads, so it is not bit-preserving itself.)"""
    e, t, d, c = 4, 300, 24, 77
    if dtype == "bfloat16":  # 8 significant bits: small integers stay distinct
        values = np.stack([rng.permutation(t) for _ in range(e)]).astype(np.float32) - t / 2
    else:
        values = rng.permutation(e * t).reshape(e, t).astype(np.float32) / 8
    s = torch.from_numpy(values).to(getattr(torch, dtype))
    assert all(len(torch.unique(r)) == t for r in s.float())
    x = make_data((e, t, d), "bfloat16", "torch", rng)
    top = torch.topk(s.float(), c, dim=-1, sorted=True).indices
    want = torch.gather(x.view(torch.int16), 1, top.unsqueeze(-1).expand(e, c, d))
    res = imoe.compact_(x, s, c, order="score")
    assert torch.equal(res.indices, top)
    assert torch.equal(res.values.view(torch.int16), want)


@requires_torch
def test_stable_order_is_gather_of_sorted_kept(rng):
    """The KV-cache form: [B, H, N, D] with a sink prefix and a recent window."""
    b, h, n, d, c = 2, 3, 200, 16, 64
    k = make_data((b, h, n, d), "float16", "torch", rng)
    v = make_data((b, h, n, d), "float16", "torch", rng)
    s = torch.from_numpy(rng.standard_normal((b, h, n)).astype(np.float32))
    kept = torch.from_numpy(np.stack(reference_kept(s, c, 4, 8)).reshape(b, h, c))
    want_k = torch.gather(k.view(torch.int16), 2, kept.unsqueeze(-1).expand(b, h, c, d))
    want_v = torch.gather(v.view(torch.int16), 2, kept.unsqueeze(-1).expand(b, h, c, d))
    ws = torch.empty(b * h * n, dtype=torch.int32)
    res = imoe.compact_([k, v], s, c, order="stable", protected_prefix=4, recent_window=8,
                        workspace=ws)
    assert torch.equal(res.indices, kept)
    assert torch.equal(res.values[0].view(torch.int16), want_k)
    assert torch.equal(res.values[1].view(torch.int16), want_v)


def test_stable_order_with_active_indices(rng):
    x = np.arange(2 * 10 * 3, dtype=np.float32).reshape(2, 10, 3)
    before = x.copy()
    res = imoe.compact_(x, active_indices=[7, 2, 9], order="stable")
    np.testing.assert_array_equal(res.indices, [[2, 7, 9], [2, 7, 9]])
    np.testing.assert_array_equal(res.values, before[:, [2, 7, 9]])
    np.testing.assert_array_equal(x[:, 3:], before[:, [0, 1, 3, 4, 5, 6, 8]])
    imoe.restore_(x, res.indices, order="stable")
    np.testing.assert_array_equal(x, before)
    idx = imoe.idempotent_map(active_indices=np.array([7, 2, 9]), num_slots=10, order="stable")
    np.testing.assert_array_equal(idx, [2, 7, 9])


def test_restore_semantics_per_order(rng):
    """restore_ takes the compaction's order: the inplace indices are an
    involution, the ordered ones a permutation with a canonical tail."""
    s = np.array([[0.1, 0.9, 0.5, 0.7, 0.2, 0.8]], dtype=np.float32)
    for order in ("inplace", "stable", "score"):
        x = np.arange(6, dtype=np.int64).reshape(1, 6, 1).copy()
        res = imoe.compact_(x, s, 3, order=order)
        assert x[0, :3, 0].tolist() == res.indices[0].tolist()
        if order == "score":
            assert res.indices[0].tolist() == [1, 5, 3]
            assert x[0, 3:, 0].tolist() == [0, 2, 4]  # dropped, ascending
        imoe.restore_(x, res.indices, order=order)
        assert x[:, :, 0].tolist() == [[0, 1, 2, 3, 4, 5]]


def test_move_mode_ordered_writes_only_the_head(rng):
    x = np.arange(8, dtype=np.int32).reshape(8, 1)
    s = np.array([3, 0, 7, 1, 6, 2, 5, 4], dtype=np.float32)
    res = imoe.compact_(x, s, 4, dim=0, mode="move", order="score")
    assert res.indices.tolist() == [2, 4, 6, 7]
    assert x[:4, 0].tolist() == [2, 4, 6, 7]


# --------------------------------------------------------------------------- bad input

N = 9


def _perm_case(fw, rng, values, dtype="int64", **kwargs):
    x = make_data((2, N, 3), "float32", fw, rng)
    perm = to_framework(np.asarray(values, dtype=dtype), fw)
    return (lambda: imoe.permute_(x, perm, **kwargs)), [x, perm]


def _bad_values():
    yield "repeat", ValueError, r"positions 2 and 6 both hold 4", [0, 1, 4, 3, 5, 2, 4, 7, 8]
    yield "below", ValueError, r"position 3 holds -1", [0, 1, 2, -1, 4, 5, 6, 7, 8]
    yield "above", ValueError, r"position 8 holds 9", [0, 1, 2, 3, 4, 5, 6, 7, 9]
    yield "huge", ValueError, r"holds 4294967296", [0, 1, 2, 3, 4, 5, 6, 7, 2**32]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("inverse", [False, True])
def test_permute_rejects_non_permutations_and_changes_nothing(fw, inverse, rng):
    for _kind, exc, message, values in _bad_values():
        call, arrays = _perm_case(fw, rng, values, inverse=inverse)
        snaps = snapshot(*arrays)
        with pytest.raises(exc, match=message):
            call()
        assert_unchanged(arrays, snaps)
    # the bad row is the last of several: the first must not have moved either
    x = make_data((3, N, 2), "int8", fw, rng)
    perm = np.stack([rng.permutation(N) for _ in range(3)])
    perm[2, 5] = perm[2, 0]
    perm = to_framework(perm, fw)
    snaps = snapshot(x, perm)
    with pytest.raises(ValueError, match="row 2"):
        imoe.permute_(x, perm, inverse=inverse)
    assert_unchanged([x, perm], snaps)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_permute_bad_arguments(fw, rng):
    x = make_data((N, 4), "float32", fw, rng)
    good = rng.permutation(N)
    cases = [
        (TypeError, "perm must have dtype int32 or int64",
         dict(perm=to_framework(good.astype(np.float32), fw))),
        (ValueError, "n = 8 must equal", dict(perm=to_framework(good[:8].copy(), fw))),
        (ValueError, "lead shape", dict(perm=to_framework(np.stack([good, good]), fw))),
        (ValueError, "workspace: 8 int32 elements",
         dict(perm=to_framework(good, fw), workspace=to_framework(np.zeros(8, np.int32), fw))),
        (TypeError, "workspace must have dtype int32",
         dict(perm=to_framework(good, fw), workspace=to_framework(np.zeros(9, np.int64), fw))),
        (ValueError, "workspace must be C-contiguous",
         dict(perm=to_framework(good, fw), workspace=to_framework(np.zeros(18, np.int32), fw)[::2])),
    ]
    for exc, message, kwargs in cases:
        arrays = [x] + [a for a in kwargs.values()]
        snaps = snapshot(*arrays)
        with pytest.raises(exc, match=message):
            imoe.permute_(x, **kwargs)
        assert_unchanged(arrays, snaps)
    with pytest.raises(ValueError, match="out of range"):
        imoe.permute_(x, to_framework(good, fw), dim=2)
    ro = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    ro.setflags(write=False)
    with pytest.raises(BufferError, match="read-only"):
        imoe.permute_(ro, good)
    ws = to_framework(np.zeros(N, np.int32), fw)
    with pytest.raises(ValueError, match="overlap"):
        imoe.permute_(ws.reshape(N, 1), to_framework(good, fw), workspace=ws)


@requires_torch
def test_permute_refuses_grad(rng):
    x = torch.zeros(4, 2, requires_grad=True)
    with pytest.raises(TypeError, match="requires grad"):
        imoe.permute_(x, torch.arange(4))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_ordered_bad_arguments(fw, rng):
    x = make_data((2, N, 3), "float32", fw, rng)
    s = to_framework(rng.standard_normal((2, N)).astype(np.float32), fw)
    snaps = snapshot(x, s)
    with pytest.raises(ValueError, match="order must be one of"):
        imoe.compact_(x, s, 4, order="sorted")
    with pytest.raises(ValueError, match="needs scores"):
        imoe.compact_(x, active_indices=[1, 2], order="score")
    with pytest.raises(ValueError, match="target-map"):
        imoe.compact_(x, s, 4, order="stable", out_target_map=to_framework(np.zeros((2, N), np.int32), fw))
    with pytest.raises(ValueError, match="workspace: 17 int32 elements"):
        imoe.compact_(x, s, 4, order="stable", workspace=to_framework(np.zeros(17, np.int32), fw))
    bad = s.copy() if fw == "numpy" else s.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        imoe.compact_(x, bad, 4, order="score")
    with pytest.raises(ValueError, match="only order='inplace' has a target-map form"):
        imoe.idempotent_map(s, 4, order="stable", form="both")
    assert_unchanged([x, s], snaps)
    # restore / apply with broken ordered indices
    for values, message in [([[0, 5, 5], [1, 2, 3]], "both hold 5"), ([[0, 1, 2], [3, 9, 1]], "holds 9")]:
        idx = to_framework(np.array(values, dtype=np.int64), fw)
        with pytest.raises(ValueError, match=message):
            imoe.restore_(x, idx, order="stable")
        with pytest.raises(ValueError, match=message):
            imoe.apply_map_(x, idx, order="score")
        assert_unchanged([x, s], snaps)


def test_plan_workspace_elems_per_device():
    assert imoe.plan_workspace_elems("permute", 3, 10, cuda=False) == 30
    assert imoe.plan_workspace_elems("group", 3, 10, cuda=False) == 30
    assert imoe.plan_workspace_elems("permute", 3, 10, cuda=True) == 6 * 30
    assert imoe.plan_workspace_elems("ordered", 1, 10, cuda=True) == 7 * 10
    assert imoe.plan_workspace_elems("group", 0, 10, cuda=True) == 0
    with pytest.raises(ValueError, match="kind"):
        imoe.plan_workspace_elems("sort", 1, 10, cuda=True)
    with pytest.raises(ValueError, match="too large"):
        imoe.plan_workspace_elems("permute", 2**62, 2**10, cuda=True)
