"""Dropless grouping: `group_by_expert_` against a stable argsort + gather and
the cumulative sum of bincount (each expert's end, grouped_mm's offsets),
`ungroup_` as its exact inverse, top-1 routing end to end with grouped GEMMs
on the offsets, and bad input."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import (
    PROPERTY_DTYPES,
    PROPERTY_FRAMEWORKS,
    assert_unchanged,
    bits,
    make_data,
    property_settings,
    requires_torch,
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


def reference_group(ids: np.ndarray, num_experts: int):
    """(offsets [lead..., E], each expert's end, and perm [lead..., T]) by a
    stable argsort."""
    ids = np.asarray(ids, dtype=np.int64)
    flat = ids.reshape(int(np.prod(ids.shape[:-1], dtype=np.int64)), ids.shape[-1])
    perm = np.stack([np.argsort(r, kind="stable") for r in flat]) if flat.shape[0] else (
        np.zeros((0, ids.shape[-1]), np.int64))
    counts = np.stack([np.bincount(r, minlength=num_experts) for r in flat]) if flat.shape[0] else (
        np.zeros((0, num_experts), np.int64))
    offsets = np.cumsum(counts, axis=1)
    return offsets.reshape(ids.shape[:-1] + (num_experts,)), perm.reshape(ids.shape)


@st.composite
def group_problems(draw):
    framework = draw(st.sampled_from(FRAMEWORKS))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    t = draw(st.integers(0, 80))
    experts = draw(st.integers(1, 12))
    row = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=2)))
    dtype = draw(st.sampled_from(DATA_DTYPES + (["bfloat16"] if framework == "torch" else [])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    skew = draw(st.sampled_from([None, 0, experts - 1]))
    ids = rng.integers(0, experts, size=lead + (t,))
    if skew is not None:  # most tokens to one expert, some experts empty
        ids = np.where(rng.random(ids.shape) < 0.8, skew, ids)
    return dict(x=make_data(lead + (t,) + row, dtype, framework, rng), experts=experts,
                ids=to_framework(ids.astype(draw(st.sampled_from(["int32", "int64"]))), framework),
                dim=len(lead), framework=framework, rng=rng,
                index_dtype=draw(st.sampled_from(["int32", "int64"])),
                threads=draw(st.sampled_from([None, 1, 2, 3])), two=draw(st.booleans()))


@SETTINGS
@given(p=group_problems())
def test_grouping_matches_stable_argsort(p):
    x, ids = p["x"], p["ids"]
    bufs = [x]
    if p["two"]:  # the routing weights travel with their tokens
        bufs.append(make_data(tuple(ids.shape), "float32", p["framework"], p["rng"]))
    before = [bits(b) for b in bufs]
    g = imoe.group_by_expert_(bufs if p["two"] else x, ids, p["experts"], dim=p["dim"],
                              index_dtype=p["index_dtype"], num_threads=p["threads"])
    offsets, perm = reference_group(to_numpy(ids), p["experts"])
    got_offsets, got_perm = to_numpy(g.offsets), to_numpy(g.perm)
    assert str(got_offsets.dtype) == p["index_dtype"] == str(got_perm.dtype)
    np.testing.assert_array_equal(got_offsets, offsets)
    np.testing.assert_array_equal(got_perm, perm)
    d = p["dim"]
    for b, bb in zip(bufs, before):
        idx = perm.reshape(perm.shape + (1,) * (bb.ndim - d - 1))
        np.testing.assert_array_equal(bits(b), np.take_along_axis(bb, np.broadcast_to(idx, bb.shape),
                                                                  axis=d))
    imoe.ungroup_(bufs, g.perm, dim=d, num_threads=p["threads"])
    for b, bb in zip(bufs, before):
        np.testing.assert_array_equal(bits(b), bb)


@requires_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_top1_routing_end_to_end_with_grouped_gemms(rng, dtype):
    """Top-1 MoE: route, group the tokens in place, one matmul per expert on
    its slice [offsets[e - 1], offsets[e]) (a grouped GEMM), ungroup the
    outputs in place. Equal bit for bit to the same grouped GEMMs on a torch
    argsort + index_select grouping, and to per-token expert matmuls up to
    rounding."""
    t, d, f, e = 512, 64, 48, 6
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    x = torch.randn(t, d, generator=gen).to(dt)
    router = torch.randn(d, e, generator=gen).to(dt)
    w = (torch.randn(e, d, f, generator=gen) / d**0.5).to(dt)
    logits = x.float() @ router.float()
    gate, expert = torch.softmax(logits, dim=-1).max(dim=-1)
    expert[:40] = 2  # one hot expert, and expert 5 may stay empty
    expert[expert == 5] = 4

    def grouped_gemm(xs, offsets):
        """grouped_mm's contract: expert k's rows end at offsets[k]."""
        out = torch.empty(xs.shape[0], f, dtype=dt)
        for k in range(e):
            lo, hi = int(offsets[k - 1]) if k else 0, int(offsets[k])
            if hi > lo:
                out[lo:hi] = xs[lo:hi] @ w[k]
        return out

    # torch reference pipeline: out of place
    order = torch.argsort(expert, stable=True)
    ref_offsets = torch.cumsum(torch.bincount(expert, minlength=e), 0)
    ref_grouped_out = grouped_gemm(x.index_select(0, order), ref_offsets)
    ref = torch.empty_like(ref_grouped_out)
    ref[order] = ref_grouped_out
    ref = ref * gate.to(dt).unsqueeze(-1)

    # ours: in place, tokens and gates grouped together
    xs, gates = x.clone(), gate.clone()
    g = imoe.group_by_expert_([xs, gates], expert, e)
    assert torch.equal(g.offsets, ref_offsets) and torch.equal(g.perm, order)
    y = grouped_gemm(xs, g.offsets) * gates.to(dt).unsqueeze(-1)
    # the offsets go to the library's grouped GEMM as they are (its own rounding)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    torch.testing.assert_close(imoe.grouped_gemm(xs, w, g.offsets.int()).float(),
                               grouped_gemm(xs, g.offsets).float(), rtol=tol, atol=tol)
    imoe.ungroup_(y, g.perm)
    assert torch.equal(y.view(torch.int16 if dtype == "bfloat16" else torch.int32),
                       ref.view(torch.int16 if dtype == "bfloat16" else torch.int32))
    # and the math: each token through its own expert
    per_token = torch.stack([x[i].float() @ w[expert[i]].float() for i in range(t)]) * gate.unsqueeze(-1)
    torch.testing.assert_close(y.float(), per_token, rtol=tol, atol=tol)
    # the inputs come back too
    imoe.ungroup_([xs, gates], g.perm)
    assert torch.equal(xs, x) and torch.equal(gates, gate)


def test_grouping_edge_cases():
    x = np.zeros((0, 3), np.float32)
    g = imoe.group_by_expert_(x, np.zeros(0, np.int64), 4)
    assert g.offsets.tolist() == [0, 0, 0, 0] and g.perm.shape == (0,)
    g = imoe.group_by_expert_(np.zeros((0, 3), np.float32), np.zeros(0, np.int64), 0)
    assert g.offsets.shape == (0,)
    x = np.arange(5, dtype=np.int16).reshape(5, 1)
    g = imoe.group_by_expert_(x, [1, 1, 1, 1, 1], 3)
    assert g.offsets.tolist() == [0, 5, 5] and x[:, 0].tolist() == [0, 1, 2, 3, 4]
    out_offsets, out_perm = np.full(3, -1, np.int32), np.full(5, -1, np.int32)
    g = imoe.group_by_expert_(x, [2, 0, 2, 1, 0], 3, out_offsets=out_offsets, out_perm=out_perm)
    assert g.offsets is out_offsets and g.perm is out_perm
    assert out_offsets.tolist() == [2, 3, 5] and out_perm.tolist() == [1, 4, 3, 0, 2]
    assert x[:, 0].tolist() == [1, 4, 3, 0, 2]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_grouping_bad_input_changes_nothing(fw, rng):
    t, e = 10, 4
    x = make_data((2, t, 3), "float32", fw, rng)
    good = rng.integers(0, e, size=(2, t))
    out_offsets = to_framework(np.full((2, e), -7, np.int64), fw)
    out_perm = to_framework(np.full((2, t), -7, np.int64), fw)
    cases = []
    for value, message in [(-1, r"row 1, position 6 holds -1"), (e, r"holds 4, outside \[0, num_experts")]:
        ids = good.copy()
        ids[1, 6] = value
        cases.append((ValueError, message, to_framework(ids, fw), e))
    cases.append((TypeError, "expert_ids must have dtype int32 or int64",
                  to_framework(good.astype(np.float32), fw), e))
    cases.append((ValueError, "must equal the buffers' T", to_framework(good[:, :9].copy(), fw), e))
    cases.append((ValueError, "num_experts must be >= 0", to_framework(good, fw), -1))
    for exc, message, ids, experts in cases:
        arrays = [x, ids, out_offsets, out_perm]
        snaps = snapshot(*arrays)
        with pytest.raises(exc, match=message):
            imoe.group_by_expert_(x, ids, experts, dim=1, out_offsets=out_offsets, out_perm=out_perm)
        assert_unchanged(arrays, snaps)
    for bad_n in (e - 1, e + 1):  # one short, and [E + 1] (a leading 0 before the ends)
        bad_offsets = to_framework(np.zeros((2, bad_n), np.int64), fw)
        with pytest.raises(ValueError, match=f"out_offsets: n = {bad_n} must be {e}"):
            imoe.group_by_expert_(x, to_framework(good, fw), e, dim=1, out_offsets=bad_offsets)
    # ungroup_ with a broken permutation
    perm = np.tile(np.arange(t), (2, 1))
    perm[0, 3] = 4
    snaps = snapshot(x)
    with pytest.raises(ValueError, match="not a permutation"):
        imoe.ungroup_(x, to_framework(perm, fw), dim=1)
    assert_unchanged([x], snaps)


def test_grouping_returns_an_offsets_perm_pair():
    x = np.arange(6, dtype=np.float32).reshape(6, 1)
    offsets, perm = imoe.group_by_expert_(x, [1, 0, 1, 0, 2, 0], 3)
    assert offsets.dtype == np.int64 and offsets.tolist() == [3, 5, 6]
    assert perm.tolist() == [1, 3, 5, 0, 2, 4] and x[:, 0].tolist() == [1, 3, 5, 0, 2, 4]
