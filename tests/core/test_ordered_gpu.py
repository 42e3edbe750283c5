"""Ordered compaction on CUDA: compact_ and idempotent_map with order "stable"
and "score", bit for bit against the CPU core and torch (stable: gather of the
sorted kept indices; score: descending score, ties to the lower slot); bad
input changes nothing and is raised by check_errors; no allocation with a
workspace; CUDA graphs; the caller's stream. Skipped (see conftest.py) unless
torch sees a GPU and idempotent_moe has its CUDA build."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import TIE_VALUES, bits, make_data, make_scores, scores_from_values, torch

pytestmark = pytest.mark.gpu

ORDERS = ["stable", "score"]


def cpu_compact(xs, selector, capacity, **kw):
    """The CPU core's indices and buffers (as bits) for the same call."""
    xc = [x.cpu().clone() for x in xs]
    sel = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in selector.items()}
    res = imoe.compact_(xc, capacity=capacity, **sel, **kw)
    return res.indices.numpy(), [bits(x) for x in xc]


def torch_order(scores, capacity, order):
    """torch's answer for plain scores (no NaN, no -0): a stable descending
    sort is topk with ties to the lower slot; "stable" sorts those slots."""
    keep = min(capacity, scores.shape[-1])
    top = torch.sort(scores.float().cpu(), dim=-1, descending=True, stable=True).indices[..., :keep]
    return top.sort(dim=-1).values if order == "stable" else top


def torch_gather(x, idx):
    """x's first C' slots after the compaction, by torch.gather (slot axis 1)."""
    idx = idx.long().to(x.device)
    shape = list(idx.shape) + [1] * (x.dim() - idx.dim())
    return torch.gather(x, 1, idx.view(shape).expand(*idx.shape, *x.shape[2:]))


def check_call(xs, scores, capacity, order, mode, index_dtype="int64", **kw):
    """One GPU call against the CPU core: indices, [0, C') of every buffer,
    and in swap mode every buffer whole (dropped slots ascending in [C', N))."""
    want_idx, want = cpu_compact(xs, {"scores": scores}, capacity, order=order, mode=mode,
                                 index_dtype=index_dtype, **kw)
    res = imoe.compact_(xs, scores, capacity, order=order, mode=mode, index_dtype=index_dtype,
                        **kw)
    imoe.check_errors(xs[0])
    got_idx = res.indices.cpu().numpy()
    np.testing.assert_array_equal(got_idx, want_idx)
    kept = want_idx.shape[-1]
    for x, w in zip(xs, want):
        if mode == "swap":
            np.testing.assert_array_equal(bits(x), w)
        else:
            np.testing.assert_array_equal(bits(x[:, :kept]), w[:, :kept])
    return res


@pytest.mark.parametrize("score_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["swap", "move"])
def test_parity_with_cpu_and_torch(score_dtype, order, mode, rng):
    r, n, c = 3, 1000, 300
    x = make_data((r, n, 24), "float16", "torch", rng).cuda()
    y = make_data((r, n, 5), "uint8", "torch", rng).cuda()
    before = [x.clone(), y.clone()]
    scores = make_scores((r, n), score_dtype, "torch", rng, ties=False).cuda()
    res = check_call([x, y], scores, c, order, mode, index_dtype="int32")
    assert res.indices.dtype == torch.int32
    top = torch_order(scores, c, order)
    np.testing.assert_array_equal(res.indices.long().cpu().numpy(), top.numpy())
    np.testing.assert_array_equal(bits(res.values[0]), bits(torch_gather(before[0], top)))
    np.testing.assert_array_equal(bits(res.values[1]), bits(torch_gather(before[1], top)))
    if mode == "swap":  # restore_ with the same order undoes it
        imoe.restore_([x, y], res.indices, dim=1, order=order)
        imoe.check_errors(x)
        np.testing.assert_array_equal(bits(x), bits(before[0]))
        np.testing.assert_array_equal(bits(y), bits(before[1]))


@pytest.mark.parametrize("dtype", ["uint8", "bfloat16", "float32", "float64", "int8"])
def test_buffer_dtypes(dtype, rng):
    x = make_data((2, 777, 7), dtype, "torch", rng).cuda()
    scores = make_scores((2, 777), "float32", "torch", rng).cuda()
    for order in ORDERS:
        check_call([x], scores, 400, order, "swap")


# (R, N, C): N 1 .. 70000, C' = 0 and N, rows short and long (k_select_small and k_select)
SHAPES = [(1, 1, 0), (1, 1, 1), (2, 2, 1), (3, 5, 5), (4, 100, 0), (4, 100, 100), (2, 100, 250),
          (2, 1000, 999), (64, 300, 17), (1, 4097, 2048), (8, 4096, 2048), (2, 16385, 8000),
          (1, 70000, 35000), (1, 70000, 1), (2, 65537, 60000)]


@pytest.mark.parametrize("r,n,c", SHAPES)
@pytest.mark.parametrize("order", ORDERS)
def test_shapes(r, n, c, order, rng):
    x = make_data((r, n, 4), "float32", "torch", rng).cuda()
    before = x.clone()
    scores = make_scores((r, n), "float32", "torch", rng, ties=False).cuda()
    res = check_call([x], scores, c, order, "swap")
    top = torch_order(scores, c, order)
    np.testing.assert_array_equal(res.indices.cpu().numpy(), top.numpy())
    np.testing.assert_array_equal(bits(res.values[0]), bits(torch_gather(before, top)))


@pytest.mark.parametrize("score_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("order", ORDERS)
def test_ties_signed_zeros_infinities_and_nan_lowest(score_dtype, order, rng):
    r, n = 4, 3000
    values = rng.choice(np.append(TIE_VALUES, np.nan), size=(r, n))
    scores = scores_from_values(values, score_dtype, "torch").cuda()
    x = make_data((r, n, 3), "int8", "torch", rng).cuda()
    for c in (1, 700, 2999, 3000):
        for mode in ("swap", "move"):
            check_call([x], scores, c, order, mode, nan="lowest")


@pytest.mark.parametrize("c", [4096, 4097])
@pytest.mark.parametrize("score_dtype", ["float32", "float16"])
@pytest.mark.parametrize("mode", ["swap", "move"])
def test_score_order_at_and_over_the_rank_sort_limit(c, score_dtype, mode, rng):
    """C' = 4096 kept slots take the rank sort (k_ord_rank, many blocks a
    row), 4097 the radix sort: many equal scores, -0 / +0, infinities and NaN
    (nan="lowest"), one row of distinct scores, K and V buffers."""
    r, n = 3, 9000
    values = rng.choice(np.append(TIE_VALUES, np.nan), size=(r, n))
    values[0] = rng.standard_normal(n)
    scores = scores_from_values(values, score_dtype, "torch").cuda()
    k = make_data((r, n, 3), "float16", "torch", rng).cuda()
    v = make_data((r, n, 64), "bfloat16", "torch", rng).cuda()
    for order in ORDERS:
        check_call([k, v], scores, c, order, mode, nan="lowest")


@pytest.mark.parametrize("c", [2048, 4097])
@pytest.mark.parametrize("order", ORDERS)
def test_nan_raise_changes_no_buffer_and_no_index(c, order, rng):
    """A NaN under nan="raise" in a call that would take the rank sort (or the
    radix sort) and the slice permutation: every buffer and out_indices keep
    their bytes."""
    r, n = 4, 8192
    k = make_data((r, n, 16), "float16", "torch", rng).cuda()
    v = make_data((r, n, 3), "uint8", "torch", rng).cuda()
    before = [bits(k), bits(v)]
    scores = make_scores((r, n), "float32", "torch", rng, ties=False).cuda()
    scores[2, 17] = float("nan")
    out = torch.full((r, c), -7, dtype=torch.int64, device="cuda")
    imoe.compact_([k, v], scores, c, dim=1, order=order, nan="raise", out_indices=out)
    with pytest.raises(ValueError, match="NaN"):
        imoe.check_errors(k)
    np.testing.assert_array_equal(bits(k), before[0])
    np.testing.assert_array_equal(bits(v), before[1])
    assert (out == -7).all()

@pytest.mark.parametrize("order", ORDERS)
def test_all_equal_scores_keep_the_slot_order(order, rng):
    x = make_data((3, 5000, 8), "uint8", "torch", rng).cuda()
    scores = torch.full((3, 5000), -0.0, device="cuda")
    scores[:, ::3] = 0.0  # -0 and +0 tie
    res = check_call([x], scores, 1234, order, "swap")
    want = np.broadcast_to(np.arange(1234), (3, 1234))
    np.testing.assert_array_equal(res.indices.cpu().numpy(), want)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("prefix,window", [(4, 0), (0, 16), (4, 16), (100, 100)])
def test_protected_prefix_and_recent_window(order, prefix, window, rng):
    for n, c in ((2000, 500), (20000, 3000)):
        x = make_data((2, n, 16), "float16", "torch", rng).cuda()
        scores = make_scores((2, n), "bfloat16", "torch", rng).cuda()
        for mode in ("swap", "move"):
            check_call([x], scores, c, order, mode, protected_prefix=prefix, recent_window=window)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("mode", ["swap", "move"])
def test_active_indices_stable(shared, index_dtype, mode, rng):
    r, n, k = 3, 4000, 900
    x = make_data((r, n, 12), "bfloat16", "torch", rng).cuda()
    before = x.clone()
    if shared:
        active = torch.from_numpy(rng.permutation(n)[:k]).to(index_dtype).cuda()
    else:
        active = torch.from_numpy(np.stack([rng.permutation(n)[:k] for _ in range(r)]))
        active = active.to(index_dtype).cuda()
    want_idx, want = cpu_compact([x], {"active_indices": active}, None, dim=1, order="stable",
                                 mode=mode)
    res = imoe.compact_(x, active_indices=active, dim=1, order="stable", mode=mode)
    imoe.check_errors(x)
    np.testing.assert_array_equal(res.indices.cpu().numpy(), want_idx)
    top = active.long().cpu().sort(dim=-1).values.expand(r, k)
    np.testing.assert_array_equal(res.indices.cpu().numpy(), top.numpy())
    np.testing.assert_array_equal(bits(res.values), bits(torch_gather(before, top)))
    if mode == "swap":
        np.testing.assert_array_equal(bits(x), want[0])
    with pytest.raises(ValueError, match="score"):
        imoe.compact_(x, active_indices=active, dim=1, order="score")


def test_strided_views_many_buffers_and_strided_indices(rng):
    n, c = 1500, 600
    big = make_data((2 * n, 6, 10), "float32", "torch", rng).cuda()
    x = big[::2].transpose(0, 1)  # [6, n, 10], slot stride 2 x 6 x 10 elements
    untouched = bits(big[1::2])
    y = make_data((6, n, 3), "int8", "torch", rng).cuda()
    extra = [make_data((6, n, 2 + i % 5), "uint8", "torch", rng).cuda() for i in range(17)]
    sbig = make_scores((n, 6), "float16", "torch", rng).cuda()
    scores = sbig.t()  # [6, n], slot stride 6
    for order in ORDERS:
        for mode in ("swap", "move"):
            obig = torch.full((6, 2 * c), -7, dtype=torch.int32, device="cuda")
            out = obig[:, ::2]  # strided out_indices
            want_idx, want = cpu_compact([x, y] + extra, {"scores": scores}, c, dim=1,
                                         order=order, mode=mode, index_dtype="int32")
            imoe.compact_([x, y] + extra, scores, c, dim=1, order=order, mode=mode,
                          out_indices=out)
            imoe.check_errors(x)
            np.testing.assert_array_equal(out.cpu().numpy(), want_idx)
            assert (obig[:, 1::2] == -7).all()
            for got, w in zip([x, y] + extra, want):
                if mode == "swap":
                    np.testing.assert_array_equal(bits(got), w)
                else:
                    np.testing.assert_array_equal(bits(got[:, :c]), w[:, :c])
            np.testing.assert_array_equal(bits(big[1::2]), untouched)


@pytest.mark.parametrize("order", ORDERS)
def test_scores_that_are_also_a_buffer(order, rng):
    """Tokens and their scores compacted by one map: the scores move too."""
    x = make_data((4, 3000, 16), "float16", "torch", rng).cuda()
    scores = make_scores((4, 3000), "float32", "torch", rng).cuda()
    s_col = scores.unsqueeze(-1)  # the scores as a [4, 3000, 1] buffer
    want_idx, want = cpu_compact([x, s_col], {"scores": scores.clone()}, 1000, order=order,
                                 dim=1)
    res = imoe.compact_([x, s_col], scores, 1000, dim=1, order=order)
    imoe.check_errors(x)
    np.testing.assert_array_equal(res.indices.cpu().numpy(), want_idx)
    np.testing.assert_array_equal(bits(x), want[0])
    np.testing.assert_array_equal(bits(s_col), want[1])


@pytest.mark.parametrize("order", ORDERS)
def test_idempotent_map_orders(order, rng):
    for score_dtype, (r, n, c) in (("float32", (5, 3000, 1000)), ("float16", (1, 70000, 9000)),
                                   ("bfloat16", (8, 4096, 2048))):
        scores = make_scores((r, n), score_dtype, "torch", rng).cuda()
        got = imoe.idempotent_map(scores, c, order=order, protected_prefix=3, recent_window=5,
                                  index_dtype="int32")
        imoe.check_errors(scores)
        want = imoe.idempotent_map(scores.cpu(), c, order=order, protected_prefix=3,
                                   recent_window=5, index_dtype="int32")
        np.testing.assert_array_equal(got.cpu().numpy(), want.numpy())
    active = torch.tensor([[9, 2, 5], [0, 7, 1]], device="cuda")
    if order == "stable":
        got = imoe.idempotent_map(active_indices=active, num_slots=10, order="stable")
        imoe.check_errors(active)
        np.testing.assert_array_equal(got.cpu().numpy(), [[2, 5, 9], [0, 1, 7]])
        shared = torch.tensor([4, 0, 3], device="cuda")
        got = imoe.idempotent_map(active_indices=shared, num_slots=6, lead_shape=(2, 2),
                                  order="stable")
        imoe.check_errors(shared)
        np.testing.assert_array_equal(got.cpu().numpy(), np.full((2, 2, 3), [0, 3, 4]))


@pytest.mark.parametrize("case", ["nan", "nan_map", "active_range", "active_duplicate",
                                  "active_map"])
@pytest.mark.parametrize("order", ORDERS)
def test_bad_input_changes_nothing_then_a_valid_call_works(case, order, rng):
    if order == "score" and case.startswith("active"):
        pytest.skip("score needs scores")
    r, n, c = 3, 2000, 500
    x = make_data((r, n, 8), "float32", "torch", rng).cuda()
    y = make_data((r, n, 3), "uint8", "torch", rng).cuda()
    out = torch.full((r, c), -7, dtype=torch.int64, device="cuda")
    before = [bits(x), bits(y)]
    scores = make_scores((r, n), "float16", "torch", rng).cuda()
    active = torch.from_numpy(np.stack([rng.permutation(n)[:c] for _ in range(r)])).cuda()
    if case.startswith("nan"):
        scores[r - 1, n - 1] = float("nan")
        expected = "NaN"
    elif case in ("active_range", "active_map"):
        active[1, 7] = n
        expected = "INDEX_RANGE"
    else:
        active[1, 7] = active[1, 8]
        expected = "INDEX_DUPLICATE"
    selector = {"active_indices": active} if case.startswith("active") else {"scores": scores}
    if case.endswith("map"):
        imoe.idempotent_map(**selector, capacity=c, num_slots=n, order=order, out_indices=out)
    else:
        imoe.compact_([x, y], **selector, capacity=c, dim=1, order=order, out_indices=out)
    with pytest.raises(ValueError, match=expected):
        imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), before[0])
    np.testing.assert_array_equal(bits(y), before[1])
    assert (out == -7).all()
    # a valid call right after the failed one works
    scores[r - 1, n - 1] = 0.25
    active = torch.from_numpy(np.stack([rng.permutation(n)[:c] for _ in range(r)])).cuda()
    selector = {"active_indices": active} if case.startswith("active") else {"scores": scores}
    want_idx, want = cpu_compact([x, y], selector, c, dim=1, order=order)
    imoe.compact_([x, y], **selector, capacity=c, dim=1, order=order, out_indices=out)
    imoe.check_errors(x)
    np.testing.assert_array_equal(out.cpu().numpy(), want_idx)
    np.testing.assert_array_equal(bits(x), want[0])
    np.testing.assert_array_equal(bits(y), want[1])


def test_workspace_checks_and_zero_allocation(rng):
    r, n, c = 8, 4096, 2048
    x = make_data((r, n, 256), "float16", "torch", rng).cuda()
    scores = make_scores((r, n), "float16", "torch", rng).cuda()
    elems = imoe.plan_workspace_elems("ordered", r, n, cuda=True)
    assert elems == 7 * r * n
    out = torch.empty((r, c), dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="workspace"):
        imoe.compact_(x, scores, c, order="score", out_indices=out,
                      workspace=torch.empty(elems - 1, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="workspace"):
        imoe.idempotent_map(scores, c, order="score", out_indices=out,
                            workspace=torch.empty(elems - 1, dtype=torch.int32, device="cuda"))
    ws = torch.empty(elems, dtype=torch.int32, device="cuda")
    for order in ORDERS:  # warm-up
        imoe.compact_(x, scores, c, order=order, out_indices=out, workspace=ws)
        imoe.idempotent_map(scores, c, order=order, out_indices=out, workspace=ws)
    imoe.check_errors(x)
    want_idx, want = cpu_compact([x], {"scores": scores}, c, order="score", index_dtype="int32")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    imoe.compact_(x, scores, c, order="score", out_indices=out, workspace=ws)
    imoe.idempotent_map(scores, c, order="stable", out_indices=out, workspace=ws)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved
    np.testing.assert_array_equal(bits(x), want[0])
    stable = imoe.idempotent_map(scores.cpu(), c, order="stable", index_dtype="int32")
    np.testing.assert_array_equal(out.cpu().numpy(), stable.numpy())


@pytest.mark.parametrize("order", ORDERS)
def test_cuda_graph_capture_and_replay(order, rng):
    r, n, c = 8, 2048, 512
    x = make_data((r, n, 64), "float16", "torch", rng).cuda()
    scores = make_scores((r, n), "float32", "torch", rng).cuda()
    out = torch.empty((r, c), dtype=torch.int64, device="cuda")
    ws = torch.empty(imoe.plan_workspace_elems("ordered", r, n, cuda=True), dtype=torch.int32,
                     device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        imoe.compact_(x, scores, c, order=order, out_indices=out, workspace=ws)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        imoe.compact_(x, scores, c, order=order, out_indices=out, workspace=ws)
    for step in range(3):
        x.copy_(make_data((r, n, 64), "float16", "torch", rng).cuda())
        scores.copy_(make_scores((r, n), "float32", "torch", rng).cuda())
        if step == 1:
            scores[2, 100] = float("nan")
        want_idx, want = cpu_compact([x], {"scores": scores}, c, order=order,
                                     nan="lowest" if step == 1 else "raise")
        before, out_before = bits(x), bits(out)
        graph.replay()
        torch.cuda.synchronize()
        if step == 1:  # a NaN replay changes nothing; the next clean one works
            with pytest.raises(ValueError, match="NaN"):
                imoe.check_errors(x)
            np.testing.assert_array_equal(bits(x), before)
            np.testing.assert_array_equal(bits(out), out_before)
            continue
        imoe.check_errors(x)
        np.testing.assert_array_equal(out.cpu().numpy(), want_idx)
        np.testing.assert_array_equal(bits(x), want[0])


def test_on_side_stream(rng):
    """Work runs on the caller's current stream, ordered after earlier work on it."""
    src = make_data((4, 4096, 128), "float16", "torch", rng).cuda()
    scores = make_scores((4, 4096), "float32", "torch", rng).cuda()
    want_idx, want = cpu_compact([src], {"scores": scores}, 1000, order="score")
    stream = torch.cuda.Stream()
    x = torch.empty_like(src)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # a wrong stream would see the copy unfinished
        x.copy_(src)
        res = imoe.compact_(x, scores, 1000, order="score")
        seen, seen_idx = x.clone(), res.indices.clone()
    stream.synchronize()
    np.testing.assert_array_equal(bits(seen), want[0])
    np.testing.assert_array_equal(seen_idx.cpu().numpy(), want_idx)


@pytest.mark.parametrize("order", ["sorted", ["stable"]])
def test_a_bad_order_on_cuda_is_named_as_the_order(order):
    """The plan workspace is allocated for orders only: a name that is no
    order reaches the core, whose message names `order` (not a plan kind)."""
    x = torch.randn(2, 16, 4, device="cuda")
    s = torch.rand(2, 16, device="cuda")
    before = x.clone()
    with pytest.raises((ValueError, TypeError), match="order"):
        imoe.compact_(x, s, 4, order=order)
    assert torch.equal(x, before)
