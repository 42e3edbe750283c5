"""moe_dispatch, moe_combine and gated_act (idempotent_moe.moe): the C
core against plain reference implementations on the CPU, and the CUDA
kernels against the C core (and torch's activations) bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import idempotent_moe as imoe  # noqa: E402
from idempotent_moe import check_errors  # noqa: E402
from idempotent_moe._moe_rules import combine as torch_combine  # noqa: E402
from idempotent_moe.moe import gated_act, moe_combine, moe_dispatch  # noqa: E402


def routing(tokens, top_k, experts, seed, *, dtype=torch.int64, weight_dtype=torch.float32,
            ties=False, nans=False, skew=False):
    """top_k_index [T, k] (distinct experts per token) and weights [T, k]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    if skew:
        logits[:, 0] += 3.0
    index = logits.topk(top_k, dim=1).indices.to(dtype)
    weights = torch.rand(tokens, top_k, generator=g)
    if ties:
        weights = (weights * 4).floor() / 4
    if nans and tokens:
        weights.view(-1)[:: max(1, tokens * top_k // 5)] = float("nan")
    return index, weights.to(weight_dtype)


def reference_dispatch(hidden, index, weights, experts, capacity, layout, skip_foreign=False):
    """(rows, offsets, dest, src, dropped) by plain Python loops."""
    tokens, top_k = index.shape
    ids = index.tolist()
    w = weights.float().tolist() if weights is not None else None
    per = [[] for _ in range(experts)]
    for t in range(tokens):
        for j in range(top_k):
            if ids[t][j] < experts:
                per[ids[t][j]].append(t * top_k + j)
    kept = set()
    dropped = 0
    for e in range(experts):
        mine = per[e]
        if capacity is not None and len(mine) > capacity:
            def key(i):
                v = w[i // top_k][i % top_k]
                return (1, 0.0, i) if math.isnan(v) else (0, -v, i)
            best = sorted(mine, key=key)[:capacity]
            dropped += len(mine) - capacity
            kept.update(best)
        else:
            kept.update(mine)
    rows_n = experts * capacity if layout == "padded" else tokens * top_k
    dest = [[-1] * top_k for _ in range(tokens)]
    src = [-1] * rows_n
    offsets, at = [], 0
    for e in range(experts):
        row = e * capacity if layout == "padded" else at
        for i in per[e]:
            if i in kept:
                dest[i // top_k][i % top_k] = row
                src[row] = i // top_k
                row += 1
        at = row
        offsets.append((e + 1) * capacity if layout == "padded" else row)
    rows = torch.zeros(rows_n, *hidden.shape[1:], dtype=hidden.dtype)
    for r, t in enumerate(src):
        if t >= 0:
            rows[r] = hidden[t]
    dest = torch.tensor(dest, dtype=torch.int64).view(tokens, top_k)
    return rows, torch.tensor(offsets), dest, torch.tensor(src, dtype=torch.int64), dropped


def assert_dispatch_equal(got, ref):
    rows, offsets, dest, src, dropped = ref
    assert torch.equal(got.offsets.long().cpu(), offsets)
    assert torch.equal(got.dest.long().cpu(), dest)
    assert torch.equal(got.src.long().cpu(), src)
    assert int(got.dropped) == dropped
    assert torch.equal(got.rows.cpu().view(torch.uint8), rows.view(torch.uint8))


@pytest.mark.parametrize("tokens,top_k,experts", [(0, 2, 4), (1, 1, 1), (37, 2, 8), (64, 8, 128),
                                                  (300, 4, 16)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_dropless_is_a_stable_sort_by_expert(tokens, top_k, experts, index_dtype):
    index, weights = routing(tokens, top_k, experts, seed=tokens + experts, dtype=index_dtype)
    hidden = torch.randn(tokens, 24).to(torch.bfloat16)
    got = moe_dispatch(hidden, index, experts)
    assert_dispatch_equal(got, reference_dispatch(hidden, index, None, experts, None, "grouped"))


@pytest.mark.parametrize("layout", ["grouped", "padded"])
@pytest.mark.parametrize("capacity", [0, 1, 3, 40])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_capacity_keeps_each_experts_highest_weights(layout, capacity, weight_dtype):
    """Ties to the lower assignment, NaN lowest; kept rows in token order."""
    index, weights = routing(90, 2, 6, seed=capacity, weight_dtype=weight_dtype, ties=True,
                             nans=True, skew=True)
    hidden = torch.randn(90, 3, 5)
    got = moe_dispatch(hidden, index, 6, top_k_weights=weights, capacity=capacity, layout=layout)
    ref = reference_dispatch(hidden, index, weights, 6, capacity, layout)
    assert ref[4] > 0 or capacity == 40
    assert_dispatch_equal(got, ref)


def test_foreign_ids_are_skipped_only_when_asked():
    """Expert parallelism passes other ranks' experts as ids >= E."""
    index = torch.tensor([[0, 5], [4, 1], [2, 3]])
    weights = torch.ones(3, 2)
    hidden = torch.arange(6.0).view(3, 2)
    got = moe_dispatch(hidden, index, 4, top_k_weights=weights, capacity=1, skip_foreign=True)
    assert_dispatch_equal(got, reference_dispatch(hidden, index, weights, 4, 1, "grouped"))
    assert got.dest.tolist() == [[0, -1], [-1, 1], [2, 3]] and int(got.dropped) == 0
    with pytest.raises(ValueError, match=r"top_k_index\[0, 1\] = 5 is outside \[0, num_experts = 4\)"):
        moe_dispatch(hidden, index, 4)
    with pytest.raises(ValueError, match=r"top_k_index\[1, 0\] = -1"):
        moe_dispatch(hidden, torch.tensor([[0, 1], [-1, 2], [0, 3]]), 4, skip_foreign=True)


def test_bad_arguments_are_refused_before_anything_is_written():
    index, weights = routing(10, 2, 4, seed=1)
    hidden = torch.randn(10, 8)
    with pytest.raises(ValueError, match="top_k_weights is required with a capacity"):
        moe_dispatch(hidden, index, 4, capacity=3)
    with pytest.raises(ValueError, match="layout='padded' needs a capacity"):
        moe_dispatch(hidden, index, 4, layout="padded")
    with pytest.raises(ValueError, match="layout must be one of 'grouped', 'padded'"):
        moe_dispatch(hidden, index, 4, layout="sorted")
    with pytest.raises(ValueError, match=r"num_experts = 0 is outside \[1, 1024\]"):
        moe_dispatch(hidden, index, 0)
    with pytest.raises(ValueError, match="hidden must be 10 rows"):
        moe_dispatch(hidden[:9], index, 4)
    with pytest.raises(TypeError, match="top_k_index must have dtype int32 or int64"):
        moe_dispatch(hidden, index.float(), 4)
    # An output that shares memory with an input: refused, nothing written.
    offsets = torch.full((4,), -7, dtype=torch.int32)
    dest = torch.full((10, 2), -7, dtype=torch.int32)
    src = torch.full((20,), -7, dtype=torch.int32)
    alias = torch.zeros(40, 8)
    with pytest.raises(ValueError, match="hidden shares memory with out_rows"):
        imoe._C.moe_dispatch(hidden=alias[:10], top_k_index=index, num_experts=4, out_rows=alias[5:25],
                             out_offsets=offsets, out_dest=dest, out_src=src, num_threads=1)
    with pytest.raises(ValueError, match="out_dest and out_src overlap"):
        imoe._C.moe_dispatch(hidden=hidden, top_k_index=index, num_experts=4, out_rows=torch.empty(20, 8),
                             out_offsets=offsets, out_dest=src[:20].view(10, 2), out_src=src, num_threads=1)
    assert (offsets == -7).all() and (dest == -7).all() and (src == -7).all()


@pytest.mark.parametrize("capacity", [None, 3])
def test_dispatch_into_given_outputs(capacity):
    """out=: the same bytes as the allocating call, written into the given
    arrays (returned as they are), for torch and NumPy."""
    from idempotent_moe.moe import MoEDispatch, torch_outputs

    index, weights = routing(12, 2, 5, seed=8)
    hidden = torch.randn(12, 6)
    ref = moe_dispatch(hidden, index, 5, top_k_weights=weights, capacity=capacity)
    out = torch_outputs(hidden, 5, 12, 2, ref.rows.shape[0])
    got = moe_dispatch(hidden, index, 5, top_k_weights=weights, capacity=capacity, out=out)
    assert got is out
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    arrays = MoEDispatch(*(np.empty(t.shape, dtype=t.numpy().dtype) for t in ref))
    moe_dispatch(hidden.numpy(), index.numpy(), 5, top_k_weights=weights.numpy(), capacity=capacity,
                 out=arrays)
    for a, b in zip(arrays, ref):
        assert np.array_equal(a, b.numpy())


def test_dispatch_into_bad_outputs_raises_and_writes_nothing():
    from idempotent_moe.moe import MoEDispatch

    index, _ = routing(12, 2, 5, seed=8)
    hidden = torch.randn(12, 6)
    with pytest.raises(TypeError, match="out must be a MoEDispatch"):
        moe_dispatch(hidden, index, 5, out=(torch.empty(24, 6),) * 5)
    out = MoEDispatch(torch.full((24, 6), -7.0), torch.full((5,), -7, dtype=torch.int32),
                      torch.full((12, 2), -7, dtype=torch.int32), torch.full((23,), -7, dtype=torch.int32),
                      torch.full((1,), -7, dtype=torch.int64))
    with pytest.raises(ValueError):
        moe_dispatch(hidden, index, 5, out=out)
    assert all(bool((t == -7).all()) for t in out)


def test_dropless_cuda_workspace_from_the_multi_block_threshold():
    """moe_workspace_elems: 2 x S with a capacity on CUDA; S for a dropless
    CUDA call from 32,768 assignments (the multi-block sort's counts), 0
    below it and on the CPU; dispatch_workspace asks for it whenever cuda."""
    from idempotent_moe import _C
    from idempotent_moe.moe import dispatch_workspace

    elems = _C.moe_workspace_elems
    assert [elems(s, None, True) for s in (0, 8, 32767)] == [0, 0, 0]
    assert [elems(s, None, True) for s in (32768, 131072, 131077)] == [32768, 131072, 131077]
    assert [elems(s, c, True) for s, c in ((100, 5), (131072, 0))] == [200, 262144]
    assert [elems(s, c, False) for s, c in ((131072, None), (131072, 5))] == [0, 0]
    like = torch.zeros(1)
    ws = dispatch_workspace(like, 131072, None, True)
    assert ws.dtype == torch.int32 and ws.shape == (131072,)
    assert dispatch_workspace(like, 32767, None, True) is None
    assert dispatch_workspace(like, 131072, None, False) is None
    assert dispatch_workspace(like, 100, 5, True).shape == (200,)


@pytest.mark.parametrize("out_dtype", ["float16", np.float16, np.dtype("float16"), torch.float16])
def test_combine_out_dtype_by_any_name(out_dtype):
    """out_dtype as a name, a NumPy type or dtype, or a torch dtype: one judge
    of the name (a NumPy type once read "float16'>")."""
    index, weights = routing(6, 2, 3, seed=4)
    hidden = np.random.default_rng(1).standard_normal((6, 5)).astype(np.float32)
    d = moe_dispatch(hidden, index.numpy(), 3)
    out = moe_combine(d.rows, d.dest, weights.numpy(), out_dtype=out_dtype)
    assert out.dtype == np.float16
    ref = moe_combine(torch.from_numpy(d.rows), torch.from_numpy(d.dest), weights, out_dtype=torch.float16)
    assert np.array_equal(out, ref.numpy())


def test_numpy_arrays_dispatch_and_combine():
    index, weights = routing(20, 2, 5, seed=3)
    hidden = np.random.default_rng(0).standard_normal((20, 6)).astype(np.float32)
    got = moe_dispatch(hidden, index.numpy(), 5)
    ref = reference_dispatch(torch.from_numpy(hidden), index, None, 5, None, "grouped")
    assert np.array_equal(got.rows, ref[0].numpy()) and np.array_equal(got.dest, ref[2].numpy())
    out = moe_combine(got.rows, got.dest, weights.numpy())
    expected = torch_combine(torch.from_numpy(got.rows), ref[2], weights, torch.float32)
    assert np.array_equal(out, expected.numpy())


@pytest.mark.parametrize("row_dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16),
                                                    (torch.float16, torch.float16),
                                                    (torch.float32, torch.float32),
                                                    (torch.bfloat16, torch.float32),
                                                    (torch.float16, torch.bfloat16)])
def test_combine_is_the_torch_combine_bit_for_bit(row_dtype, weight_dtype):
    index, weights = routing(50, 3, 7, seed=5, weight_dtype=weight_dtype)
    d = moe_dispatch(torch.zeros(50, 1), index, 7, top_k_weights=weights, capacity=15)
    y = torch.randn(150, 40).to(row_dtype)
    keep = d.dest >= 0
    expected = torch_combine(y, d.dest.long().clamp(min=0), weights, row_dtype, keep=keep)
    assert torch.equal(moe_combine(y, d.dest, weights), expected)
    out32 = moe_combine(y, d.dest, weights, out_dtype=torch.float32)
    assert torch.equal(out32, torch_combine(y, d.dest.long().clamp(min=0), weights, torch.float32,
                                            keep=keep))


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [1, 7, 8, 43])
def test_fp16_combine_keeps_torchs_bits_for_every_value(weight_dtype, hidden):
    """fp16 rows (the CPU core converts them eight at a time where the
    processor has F16C): subnormals, infinities, NaN, values that overflow
    when weighted, and widths that leave a tail, bit for bit torch's combine
    (NaN where torch gives NaN)."""
    index, weights = routing(64, 2, 5, seed=hidden, weight_dtype=weight_dtype)
    weights = weights * 3  # products beyond fp16's range for the largest rows
    d = moe_dispatch(torch.zeros(64, 1), index, 5)
    g = torch.Generator().manual_seed(hidden)
    bits = torch.randint(0, 1 << 16, (128, hidden), generator=g, dtype=torch.int32).to(torch.int16)
    y = bits.view(torch.float16)  # every fp16 pattern: subnormals, infinities, NaNs
    y[::3] = torch.randn(43, hidden, generator=g)[: y[::3].shape[0]].to(torch.float16) * 60000
    expected = torch_combine(y, d.dest.long(), weights, torch.float16)
    got = moe_combine(y, d.dest, weights)
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


def test_combine_refuses_a_dest_out_of_range():
    y = torch.randn(6, 4)
    out = torch.full((3, 4), 7.0)
    dest = torch.tensor([[0, 1], [2, 6], [4, 5]])
    with pytest.raises(ValueError, match=r"dest\[1, 1\] = 6 is outside \[-1, rows = 6\)"):
        moe_combine(y, dest, torch.ones(3, 2), out=out)
    assert (out == 7.0).all()


GATED_ACTS = [("silu", torch.nn.functional.silu),
              ("gelu", torch.nn.functional.gelu),
              ("gelu_tanh", lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
              ("relu", torch.relu)]


def gated_act_error_bound(gate, up, act_of_gate, dtype):
    """Per-element bound on |act(gate) * up - truth| for any correct fp32
    evaluation rounded to `dtype` (ours, torch's vectorised one): a few fp32
    ulps of the activation's inputs and result (erf and exp are not correctly
    rounded, and 1 + erf(x) cancels for negative x, so the gate's error scales
    with |gate|), times |up|, plus two roundings of the product to `dtype`
    (relative, or a subnormal step where the activation or the product
    underflows: torch rounds act(gate) to `dtype` before the multiply)."""
    eps32 = torch.finfo(torch.float32).eps
    info = torch.finfo(dtype)
    subnormal_step = info.tiny * info.eps
    return ((8 * eps32 * (gate.abs() + act_of_gate.abs()) + 2 * info.eps * act_of_gate.abs()) * up.abs()
            + 2 * subnormal_step * (1 + up.abs()))


@pytest.mark.parametrize("act,fn", GATED_ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gated_act_matches_torch(act, fn, dtype, seed):
    """Ours and torch's CPU result both lie within a few roundings of the
    float64 truth, element by element (torch's vectorised exp and erf differ
    from libm's in the last bit, so neither is held to the other's bits; CUDA
    is checked bit for bit in the gpu tests)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(33, 2 * 20, generator=g) * 3).to(dtype)
    gate, up = h[:, :20].double(), h[:, 20:].double()
    act_of_gate = fn(gate)
    truth = act_of_gate * up
    bound = gated_act_error_bound(gate, up, act_of_gate, dtype)
    got = gated_act(h, act).double()
    theirs = (fn(h[:, :20]) * h[:, 20:]).double()
    assert ((theirs - truth).abs() <= bound).all(), "the bound is tighter than torch's own error"
    excess = (got - truth).abs() - bound
    assert (excess <= 0).all(), f"{act} {dtype}: worst excess {excess.max().item():.3g}"


def test_gated_act_leaves_rows_past_the_limit():
    h = torch.randn(10, 8)
    out = torch.full((10, 4), 5.0)
    gated_act(h, "relu", limit=torch.tensor([2, 6], dtype=torch.int32), out=out)
    assert torch.equal(out[:6], torch.relu(h[:6, :4]) * h[:6, 4:]) and (out[6:] == 5.0).all()
    with pytest.raises(ValueError, match="gate and up need an even count"):
        gated_act(torch.randn(3, 5))


# ------------------------------------------------------------------ CUDA

def _cuda_equal_cpu_dispatch(tokens, top_k, experts, capacity, layout, hidden_shape, dtype, seed,
                             index_dtype=torch.int64):
    index, weights = routing(tokens, top_k, experts, seed, dtype=index_dtype, ties=True, nans=True,
                             skew=True)
    hidden = torch.randn(tokens, *hidden_shape).to(dtype)
    kw = dict(top_k_weights=weights, capacity=capacity, layout=layout)
    cpu = moe_dispatch(hidden, index, experts, **kw)
    gpu = moe_dispatch(hidden.cuda(), index.cuda(), experts,
                       **{**kw, "top_k_weights": weights.cuda()})
    check_errors(gpu.rows)
    for name, a, b in zip(cpu._fields, cpu, gpu):
        if name == "rows":
            a, b = a.view(torch.uint8), b.cpu().view(torch.uint8)
        assert torch.equal(a, b.cpu()), name


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 8), (8, 2, 8), (300, 2, 8), (4096, 2, 8),
                                                  (8, 8, 128), (4096, 8, 128), (33, 6, 1024)])
@pytest.mark.parametrize("capacity", [None, "tight", "loose"])
def test_gpu_dispatch_equals_the_cpu(tokens, top_k, experts, capacity):
    cap = {None: None, "tight": max(1, tokens * top_k // experts // 2),
           "loose": tokens * top_k // experts + 5}[capacity]
    _cuda_equal_cpu_dispatch(tokens, top_k, experts, cap, "grouped", (64,), torch.bfloat16, tokens)
    if cap is not None:
        _cuda_equal_cpu_dispatch(tokens, top_k, experts, cap, "padded", (64,), torch.bfloat16, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden_shape,dtype", [((7,), torch.float16), ((3, 5), torch.uint8),
                                                ((2048,), torch.bfloat16), ((9,), torch.float64)])
def test_gpu_dispatch_moves_rows_of_any_width(hidden_shape, dtype):
    _cuda_equal_cpu_dispatch(50, 2, 4, None, "grouped", hidden_shape, dtype, 7, torch.int32)


# One token and few (the decode shapes), k past the 64 staged in shared memory,
# and the check kernel (4096 x 2 entries); rows of one feature chunk, of
# several with a partial last chunk (2056, 1032: 16-byte vectors; 1500: the
# element path), and narrow rows.
@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (3, 6), (8, 2), (5, 80), (4096, 2)])
@pytest.mark.parametrize("row_dtype,weight_dtype,hidden", [(torch.bfloat16, torch.bfloat16, 2048),
                                                           (torch.bfloat16, torch.float32, 2056),
                                                           (torch.float16, torch.float32, 100),
                                                           (torch.float32, torch.float32, 64),
                                                           (torch.float32, torch.bfloat16, 1032),
                                                           (torch.float16, torch.float16, 1500)])
def test_gpu_combine_equals_the_cpu(tokens, top_k, row_dtype, weight_dtype, hidden):
    experts = max(8, 2 * top_k)
    index, weights = routing(tokens, top_k, experts, seed=tokens, weight_dtype=weight_dtype)
    d = moe_dispatch(torch.zeros(tokens, 1), index, experts, top_k_weights=weights,
                     capacity=tokens // 5 + 1)
    y = torch.randn(tokens * top_k, hidden).to(row_dtype)
    cpu = moe_combine(y, d.dest, weights)
    gpu = moe_combine(y.cuda(), d.dest.cuda(), weights.cuda())
    check_errors(gpu)
    assert torch.equal(gpu.cpu(), cpu)


# 16-byte rows into an out whose rows start 2 bytes past a 16-byte boundary
# (element stores) or on one (vector stores); the columns around are kept.
@pytest.mark.gpu
@pytest.mark.parametrize("shift", [1, 8])
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (4096, 2)])
def test_gpu_combine_into_a_view_of_out_equals_the_cpu(shift, tokens, top_k):
    index, weights = routing(tokens, top_k, 16, seed=5)
    d = moe_dispatch(torch.zeros(tokens, 1), index, 16)
    y = torch.randn(tokens * top_k, 2056).to(torch.bfloat16)
    base = torch.full((tokens, 2056 + 16), 7.0, dtype=torch.bfloat16, device="cuda")
    out = base[:, shift:shift + 2056]
    moe_combine(y.cuda(), d.dest.cuda(), weights.cuda(), out=out)
    check_errors(out)
    assert torch.equal(out.cpu(), moe_combine(y, d.dest, weights))
    assert bool((base[:, :shift] == 7.0).all()) and bool((base[:, shift + 2056:] == 7.0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["first", "last"])
def test_gpu_combine_checks_a_long_dest_in_blocks_and_writes_nothing_on_a_bad_entry(where):
    """Past 2,048 entries a check kernel of a block per 8,192 (at most 128)
    judges dest before the combine reads it: the sum as the CPU's, and an
    entry out of range in any block (here 150,000 tokens x 8: the most blocks,
    128) records the error and leaves out untouched."""
    tokens, top_k = 150_000, 8
    index, weights = routing(tokens, top_k, 64, seed=3)
    d = moe_dispatch(torch.zeros(tokens, 1), index, 64)
    y = torch.randn(tokens * top_k, 16).to(torch.bfloat16)
    got = moe_combine(y.cuda(), d.dest.cuda(), weights.cuda())
    check_errors(got)
    assert torch.equal(got.cpu(), moe_combine(y, d.dest, weights))
    dest = d.dest.clone()
    dest.view(-1)[0 if where == "first" else -1] = tokens * top_k
    out = torch.full((tokens, 16), 2.0, dtype=torch.bfloat16, device="cuda")
    moe_combine(y.cuda(), dest.cuda(), weights.cuda(), out=out)
    with pytest.raises(ValueError, match="found bad data and changed nothing"):
        check_errors(out)
    assert bool((out == 2.0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8, 4096])
def test_gpu_bad_data_is_recorded_and_nothing_is_written(tokens):
    index, weights = routing(tokens, 2, 8, seed=2)
    index[tokens // 2, 1] = 9
    hidden = torch.randn(tokens, 16, device="cuda")
    d = moe_dispatch(hidden, index.cuda(), 8)  # outputs start uninitialised: fill and re-run
    for t in d:
        t.fill_(3)
    imoe._C.moe_dispatch(hidden=hidden, top_k_index=index.cuda(), num_experts=8, out_rows=d.rows,
                         out_offsets=d.offsets, out_dest=d.dest, out_src=d.src, num_threads=0,
                         stream=torch.cuda.current_stream().cuda_stream or 1)
    with pytest.raises(ValueError, match="found bad data and changed nothing"):
        check_errors(hidden)
    assert all(bool((t == 3).all()) for t in d)
    out = torch.full((tokens, 16), 2.0, device="cuda")
    dest = torch.zeros(tokens, 2, dtype=torch.int32, device="cuda")
    dest[-1, 0] = tokens * 2
    moe_combine(torch.randn(tokens * 2, 16, device="cuda"), dest, weights.cuda(), out=out)
    with pytest.raises(ValueError, match="found bad data"):
        check_errors(out)
    assert bool((out == 2.0).all())


# The multi-block sort: dropless and grouped from IMOE_MOE_MULTI_SORT_MIN
# (32,768) assignments, with the workspace moe_dispatch makes; below it, and
# with a capacity, the one-block sort. S just below and at the threshold, a
# training step (16,384 x 8) and an odd S (5,699 x 23 = 131,077: the last
# block partial); E from few to most; the ids drawn with repeats (not topk:
# one expert can take most of them).
def _multi_sort_ids(tokens, top_k, experts, seed, skew, foreign, dtype):
    """[T, k] ids: uniform, or (skew) nine in ten to expert 3 % E; with
    `foreign`, one in ten >= E (another rank's experts)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    if skew:
        ids[torch.rand(tokens, top_k, generator=g) < 0.9] = 3 % experts
    if foreign:
        other = experts + torch.randint(0, 50, (tokens, top_k), generator=g)
        ids = torch.where(torch.rand(tokens, top_k, generator=g) < 0.1, other, ids)
    return ids.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k", [(4095, 8), (4096, 8), (16384, 8), (5699, 23)])
@pytest.mark.parametrize("experts", [8, 128, 1000])
@pytest.mark.parametrize("skew,foreign", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_dropless_multi_block_sort_equals_the_cpu(tokens, top_k, experts, skew, foreign, index_dtype):
    """Offsets, dest, src, dropped and rows: the CPU core's bytes, with the
    ids and the index outputs (given through out=) of either dtype; and
    again with a workspace too short for the blocks (the one-block sort)."""
    from idempotent_moe.moe import MoEDispatch

    ids = _multi_sort_ids(tokens, top_k, experts, tokens + experts, skew, foreign, index_dtype)
    hidden = torch.randn(tokens, 8).to(torch.bfloat16)
    cpu = moe_dispatch(hidden, ids, experts, skip_foreign=foreign)
    s = tokens * top_k
    out = MoEDispatch(torch.full((s, 8), 7.0, dtype=torch.bfloat16, device="cuda"),
                      *(torch.full(shape, -7, dtype=index_dtype, device="cuda")
                        for shape in ((experts,), (tokens, top_k), (s,))),
                      torch.full((1,), -7, dtype=torch.int64, device="cuda"))
    hidden_gpu, ids_gpu = hidden.cuda(), ids.cuda()
    moe_dispatch(hidden_gpu, ids_gpu, experts, skip_foreign=foreign, out=out)
    short = torch.full_like(out.src, -7), torch.full_like(out.dest, -7)
    imoe._C.moe_dispatch(hidden=hidden_gpu, top_k_index=ids_gpu, num_experts=experts, skip_foreign=foreign,
                         out_rows=torch.empty_like(out.rows), out_offsets=torch.empty_like(out.offsets),
                         out_dest=short[1], out_src=short[0], workspace=torch.empty(8, dtype=torch.int32,
                                                                                     device="cuda"),
                         num_threads=0, stream=torch.cuda.current_stream().cuda_stream or 1)
    check_errors(hidden_gpu)
    assert torch.equal(out.rows.cpu().view(torch.uint8), cpu.rows.view(torch.uint8))
    for name in ("offsets", "dest", "src", "dropped"):
        assert torch.equal(getattr(out, name).cpu().long(), getattr(cpu, name).long()), name
    assert torch.equal(short[0].cpu().long(), cpu.src.long())
    assert torch.equal(short[1].cpu().long(), cpu.dest.long())


@pytest.mark.gpu
@pytest.mark.parametrize("where,bad,foreign,tokens", [("first", -1, True, 16384), ("last", 128, False, 16384),
                                                      ("middle", -5, False, 16384),
                                                      ("last", 128, False, 80000)])  # the most blocks, 128
def test_gpu_multi_block_sort_bad_id_is_recorded_and_nothing_is_written(where, bad, foreign, tokens):
    """An id out of range in one block of the count kernel: recorded, and no
    output of any kernel written (the scan and place kernels and the gather
    read every block's verdict)."""
    top_k, experts = 8, 128
    ids = _multi_sort_ids(tokens, top_k, experts, 5, False, foreign, torch.int64)
    ids.view(-1)[{"first": 3, "last": tokens * top_k - 1, "middle": tokens * top_k // 2 + 17}[where]] = bad
    hidden = torch.randn(tokens, 16, device="cuda")
    d = moe_dispatch(hidden, ids.cuda() % experts, experts)  # outputs of the right shapes: fill and re-run
    for t in d:
        t.fill_(3)
    moe_dispatch(hidden, ids.cuda(), experts, skip_foreign=foreign, out=d)
    with pytest.raises(ValueError, match="found bad data and changed nothing"):
        check_errors(hidden)
    assert all(bool((t == 3).all()) for t in d)


# The multi-block sort with a capacity (from IMOE_MOE_MULTI_SORT_MIN
# assignments, either layout): the kept set chosen per expert in the
# workspace, then the kept assignments sorted in blocks; the one-block
# sort's bytes, which are the CPU core's. S at the threshold, a training
# step and an odd S; C = 0 (none kept), 1 and 5 (radix select over every
# overloaded expert; at S = 32,768 with 1,000 experts the one block ranks
# them pairwise: the same set), about S / E (some experts over, some under)
# and S (none over).
def _capacity_weights(tokens, top_k, seed, dtype):
    """[T, k] weights with exact ties (half of them rounded to eighths, and
    bf16's own), negatives, -0.0 beside +0.0, and some NaN."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(tokens, top_k, generator=g) * 2 - 0.5
    w = torch.where(torch.rand(tokens, top_k, generator=g) < 0.5, (w * 8).round() / 8, w)
    flat = w.view(-1)
    flat[7::997] = -0.0
    flat[11::1009] = 0.0
    flat[[5, tokens * top_k // 2, tokens * top_k - 2]] = float("nan")
    flat[13::4099] = float("nan")  # NaN beside NaN: ties to the lower assignment
    return w.to(dtype)


def _capacity_of(kind, s, experts):
    return {"balanced": max(1, s // experts), "loose": s}.get(kind, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k", [(4096, 8), (16384, 8), (5699, 23)])
@pytest.mark.parametrize("experts", [8, 128, 1000])
@pytest.mark.parametrize("capacity", [0, 1, 5, "balanced", "loose"])
def test_gpu_capacity_multi_block_sort_equals_the_cpu(tokens, top_k, experts, capacity):
    """Offsets, dest, src, dropped and rows: the CPU core's bytes, for
    uniform ids with F32 weights (outputs allocated, int32), and for skewed
    ids (nine in ten to one expert) with foreign ones and BF16 weights
    (outputs given through out=, int64)."""
    from idempotent_moe.moe import MoEDispatch

    s = tokens * top_k
    cap = _capacity_of(capacity, s, experts)
    for skew, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        seed = tokens + experts + skew
        ids = _multi_sort_ids(tokens, top_k, experts, seed, skew, skew, torch.int32 if skew else torch.int64)
        weights = _capacity_weights(tokens, top_k, seed, dtype)
        hidden = torch.randn(tokens, 8).to(torch.bfloat16)
        kw = dict(top_k_weights=weights, capacity=cap, skip_foreign=skew)
        cpu = moe_dispatch(hidden, ids, experts, **kw)
        assert int(cpu.dropped) > 0 or cap == s
        hidden_gpu = hidden.cuda()
        kw["top_k_weights"] = weights.cuda()
        if skew:
            out = MoEDispatch(torch.full((s, 8), 7.0, dtype=torch.bfloat16, device="cuda"),
                              *(torch.full(shape, -7, dtype=torch.int64, device="cuda")
                                for shape in ((experts,), (tokens, top_k), (s,), (1,))))
            gpu = moe_dispatch(hidden_gpu, ids.cuda(), experts, out=out, **kw)
        else:
            gpu = moe_dispatch(hidden_gpu, ids.cuda(), experts, **kw)
        check_errors(hidden_gpu)
        assert torch.equal(gpu.rows.cpu().view(torch.uint8), cpu.rows.view(torch.uint8)), skew
        for name in ("offsets", "dest", "src", "dropped"):
            assert torch.equal(getattr(gpu, name).cpu().long(), getattr(cpu, name).long()), (name, skew)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k,experts,capacity", [(16384, 8, 128, 5), (16384, 8, 128, "balanced"),
                                                           (5699, 23, 1000, 1), (4096, 8, 8, 0),
                                                           (4096, 8, 1000, "balanced")])
def test_gpu_padded_capacity_multi_block_sort_equals_the_cpu(tokens, top_k, experts, capacity):
    """The padded layout: each expert's rows past its kept ones src -1 (and
    zero rows), offsets (e + 1) x C."""
    s = tokens * top_k
    cap = _capacity_of(capacity, s, experts)
    ids = _multi_sort_ids(tokens, top_k, experts, tokens, True, True, torch.int64)
    weights = _capacity_weights(tokens, top_k, tokens, torch.float16)
    hidden = torch.randn(tokens, 8)
    kw = dict(top_k_weights=weights, capacity=cap, skip_foreign=True, layout="padded")
    cpu = moe_dispatch(hidden, ids, experts, **kw)
    hidden_gpu = hidden.cuda()
    gpu = moe_dispatch(hidden_gpu, ids.cuda(), experts, **{**kw, "top_k_weights": weights.cuda()})
    check_errors(hidden_gpu)
    assert torch.equal(gpu.rows.cpu().view(torch.uint8), cpu.rows.view(torch.uint8))
    for name in ("offsets", "dest", "src", "dropped"):
        assert torch.equal(getattr(gpu, name).cpu().long(), getattr(cpu, name).long()), name


@pytest.mark.gpu
@pytest.mark.parametrize("where,bad,foreign,tokens,layout", [("first", -1, True, 16384, "grouped"),
                                                             ("middle", -5, False, 16384, "grouped"),
                                                             ("last", 128, False, 16384, "grouped"),
                                                             ("middle", 128, False, 16384, "padded"),
                                                             ("last", 128, False, 80000, "grouped")])
def test_gpu_capacity_multi_block_sort_bad_id_is_recorded_and_nothing_is_written(where, bad, foreign,
                                                                                 tokens, layout):
    """An id out of range in one block of the count kernel, with a capacity:
    recorded, and no output of any kernel written (each kernel after the
    count and the gather read every block's verdict). 80,000 x 8 > 128 x
    4,096: the most blocks, 128."""
    top_k, experts = 8, 128
    ids = _multi_sort_ids(tokens, top_k, experts, 5, False, foreign, torch.int64)
    ids.view(-1)[{"first": 3, "last": tokens * top_k - 1, "middle": tokens * top_k // 2 + 17}[where]] = bad
    weights = _capacity_weights(tokens, top_k, 5, torch.float32).cuda()
    hidden = torch.randn(tokens, 16, device="cuda")
    kw = dict(top_k_weights=weights, capacity=tokens * top_k // experts // 2, layout=layout)
    d = moe_dispatch(hidden, ids.cuda() % experts, experts, **kw)  # outputs of the right shapes: fill, re-run
    for t in d:
        t.fill_(3)
    moe_dispatch(hidden, ids.cuda(), experts, skip_foreign=foreign, out=d, **kw)
    with pytest.raises(ValueError, match="found bad data and changed nothing"):
        check_errors(hidden)
    assert all(bool((t == 3).all()) for t in d)


@pytest.mark.gpu
@pytest.mark.parametrize("act,fn", [("silu", torch.nn.functional.silu),
                                    ("gelu", torch.nn.functional.gelu),
                                    ("gelu_tanh", lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
                                    ("relu", torch.relu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [7168, 21])  # 16-byte vectors, and the element path
def test_gpu_gated_act_is_torchs_bit_for_bit(act, fn, dtype, inter):
    h = (torch.randn(64, 2 * inter, device="cuda") * 3).to(dtype)
    expected = fn(h[:, :inter]) * h[:, inter:]
    assert torch.equal(gated_act(h, act), expected)


@pytest.mark.gpu
def test_gpu_experts_forward_launches_at_most_eight_kernels_at_eight_tokens():
    """Issue target: top_k_index / top_k_weights in, combined output out, at
    8 tokens: the dispatch's two kernels, two grouped GEMMs, the gated
    activation and the combine."""
    import idempotent_moe.integrations as hf
    from _helpers.hf_models import cuda_block
    from torch.profiler import ProfilerActivity, profile

    hf.register()
    block = cuda_block(2048, 7168, "bfloat16")
    block.experts.config._experts_implementation = "idempotent"
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, weights, index = block.gate(x)
        for _ in range(3):
            block.experts(x, index, weights)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            block.experts(x, index, weights)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name
               and "Memset" not in e.name]
    assert len(kernels) <= 8, [e.name for e in kernels]


# ------------------------------------------------------------------ torch.compile

def _moe_pipeline(hidden, index, weights, capacity):
    d = moe_dispatch(hidden, index, 8, top_k_weights=weights, capacity=capacity)
    h = gated_act(torch.cat([d.rows, d.rows * 0.5], dim=-1), "silu", limit=d.offsets)
    return moe_combine(h, d.dest, weights), d.dropped


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("capacity", [None, 3])
def test_the_moe_operations_compile_into_one_graph(device, capacity):
    """torch.compile traces moe_dispatch, gated_act and moe_combine as torch
    ops (no graph break) and the compiled function equals eager on new data."""
    torch._dynamo.reset()
    index, weights = routing(24, 2, 8, seed=4)
    hidden = torch.randn(24, 16)
    args = [t.to(device) for t in (hidden, index, weights)]
    explained = torch._dynamo.explain(_moe_pipeline)(*args, capacity)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(_moe_pipeline, fullgraph=True)
    for seed in (5, 6):
        index, weights = routing(24, 2, 8, seed=seed)
        args = [t.to(device) for t in (torch.randn(24, 16), index, weights)]
        got, want = compiled(*args, capacity), _moe_pipeline(*args, capacity)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
