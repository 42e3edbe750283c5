"""topk_softmax (idempotent_moe.moe): the C core against torch's CPU
routing (softmax, topk, renormalisation; a few ulp apart, as torch's CPU exp
and summation order are not CUDA's), ties, NaN rows, the argument checks;
equal probabilities in torch's CUDA order, against a pure-Python
transcription of torch's CUDA topk (gatherTopK's write order and
SmallBitonicSort's network). GPU tests: the kernel against the C core and
against torch's own CUDA routing bit for bit, with and without ties.
fuse_routers (transformers' routers on this kernel): tests/hf/test_hf_router.py."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _helpers import ulps  # noqa: E402
from idempotent_moe import _C  # noqa: E402
from idempotent_moe.moe import topk_softmax  # noqa: E402

SHAPES = [(8, 1), (8, 2), (60, 4), (64, 8), (128, 8), (3, 3), (1, 1), (1024, 32), (33, 5)]


def logits_of(tokens, experts, dtype=torch.float32, seed=0, distinct=False):
    """Random logits [T, E]; `distinct`: no two equal in a row (bf16 included)."""
    g = torch.Generator().manual_seed(seed)
    if not distinct:
        return torch.randn(tokens, experts, generator=g).to(dtype)
    # every bf16 value in [2^-7, 4) and its negative: 2304 distinct values, exact in f16 and f32
    pos = torch.arange(0x3C00, 0x4080, dtype=torch.int16).view(torch.bfloat16).float()
    pool = torch.cat([pos, -pos])
    pick = torch.rand(tokens, pool.numel(), generator=g).argsort(dim=1)[:, :experts]
    return pool[pick].to(dtype)


def torch_routing(logits, k, renormalize=True, out_dtype=torch.float32):
    """transformers' router after its linear, in torch."""
    p = torch.softmax(logits, dim=-1, dtype=torch.float32)
    v, i = torch.topk(p, k, dim=-1)
    if renormalize:
        v = v / v.sum(dim=-1, keepdim=True)
    return v.to(out_dtype), i


def check_against_torch(logits, k, renormalize, max_ulp):
    w, i = topk_softmax(logits, k, renormalize=renormalize)
    ref_w, ref_i = torch_routing(logits.float(), k, renormalize)
    p = torch.softmax(logits.float(), dim=-1)
    # the chosen experts carry torch's top-k probabilities (equal values may swap places)
    assert ulps(p.gather(1, i), p.gather(1, ref_i)) <= max_ulp
    assert ulps(w, ref_w) <= max_ulp
    # descending
    chosen = p.gather(1, i)
    assert bool((chosen[:, :-1] >= chosen[:, 1:]).all())
    return w, i, ref_w, ref_i


@pytest.mark.parametrize("experts,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_torch_cpu_routing(experts, k, dtype, renormalize):
    logits = logits_of(67, experts, dtype, seed=experts * 7 + k, distinct=True)
    w, i, ref_w, ref_i = check_against_torch(logits, k, renormalize, max_ulp=8)
    assert torch.equal(i, ref_i)  # distinct logits: the same experts in the same order
    assert w.dtype == torch.float32 and i.dtype == torch.int64 and w.shape == (67, k)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_cast_is_round_to_nearest_even_of_the_fp32_weights(out_dtype):
    logits = logits_of(50, 64, torch.bfloat16, seed=3, distinct=True)
    w32, i32 = topk_softmax(logits, 8)
    w, i = topk_softmax(logits, 8, out_dtype=out_dtype, index_dtype="int32")
    assert w.dtype == out_dtype and i.dtype == torch.int32
    assert torch.equal(w, w32.to(out_dtype)) and torch.equal(i.long(), i32)


def test_renormalisation_adds_in_torchs_cuda_order():
    """The sum of the k values: lanes l < B = 2^floor(log2 k) add v[l + B],
    then shfl_down B/2 .. 1 (Reduce.cuh)."""
    def cuda_order(v):
        k = len(v)
        b = 1 << (k.bit_length() - 1)
        part = [np.float32(v[j] + v[j + b]) if j + b < k else v[j] for j in range(b)]
        o = b // 2
        while o:
            part = [np.float32(part[j] + part[j + o]) if j < o else part[j] for j in range(len(part))]
            o //= 2
        return part[0]

    for k in (2, 3, 5, 6, 8, 13, 32):
        logits = logits_of(40, 64, seed=k)
        plain, i = topk_softmax(logits, k, renormalize=False)
        w, i2 = topk_softmax(logits, k)
        assert torch.equal(i, i2)
        v = plain.numpy()
        for t in range(v.shape[0]):
            s = cuda_order(list(v[t]))
            assert np.array_equal(w[t].numpy(), (v[t] / s).astype(np.float32)), (k, t)


# ------------------------------------------------- torch's CUDA topk, in Python
def _radix_key(x):
    """TopKTypeConfig<float>::convert (SortingRadixSelect.cuh): the
    order-preserving bits of a float32, every NaN 0xFFFFFFFF (the largest)."""
    if math.isnan(x):
        return 0xFFFFFFFF
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return b ^ (0xFFFFFFFF if b & 0x80000000 else 0x80000000)


def _gt_op(a, b):
    """GTOp<float, /*handleNaN=*/true> (SortingCommon.cuh)."""
    return (math.isnan(a) and not math.isnan(b)) or a > b


def _small_bitonic_sort(keys, values):
    """sortKeyValueInplace -> SmallBitonicSort -> bitonicSortKVInPlace with
    block_x = 16 threads of 2 items (SortImpl.cuh, SortUtils.cuh): the slice
    in slots 0 .. n-1 of 32, the rest invalid; bitonicSort's stages, thread
    by thread, with bitonicSwap's rule and GTOp."""
    n, slots = len(keys), 32
    k = list(keys) + [0.0] * (slots - n)
    v = list(values) + [0] * (slots - n)
    ok = [True] * n + [False] * (slots - n)

    def bitonic_swap(a, b, flag):
        swap = (_gt_op(k[a], k[b]) and ok[a]) or not ok[b]  # invalid entries sort to the end
        if swap == flag:
            k[a], k[b] = k[b], k[a]
            v[a], v[b] = v[b], v[a]
            ok[a], ok[b] = ok[b], ok[a]

    size = 2
    while size < slots:
        stride = size // 2
        while stride > 0:
            for tid in range(slots // 2):
                pos = 2 * tid - (tid & (stride - 1))
                bitonic_swap(pos, pos + stride, (tid & (size // 2)) != 0)
            stride //= 2
        size *= 2
    stride = slots // 2
    while stride > 0:
        for tid in range(slots // 2):
            pos = 2 * tid - (tid & (stride - 1))
            bitonic_swap(pos, pos + stride, False)
        stride //= 2
    return k[:n], v[:n]


def cuda_topk_reference(row, k):
    """torch.topk(row, k) (largest, sorted) as torch's CUDA kernels order it
    for k <= 32 (TensorTopK.cu, TensorTopK.cpp): radixSelect's k-th largest
    key; gatherTopK writes the keys above it in index order, then the keys
    equal to it in index order while fewer than k are written; then, for
    k >= 2, SmallBitonicSort. Returns (values, indices) as lists."""
    keys = [_radix_key(x) for x in row]
    kth = sorted(keys, reverse=True)[k - 1]
    order = [j for j, key in enumerate(keys) if key > kth]
    order += [j for j, key in enumerate(keys) if key == kth][:k - len(order)]
    values = [row[j] for j in order]
    if k == 1:  # sortKeyValueInplace: a slice of one is already sorted
        return values, order
    return _small_bitonic_sort(values, order)


def test_reference_sorts_and_orders_equal_values_as_torch_cuda_did():
    # on an H200 (torch 2.11) routers with two equal top probabilities at
    # experts 6 and 7 of 8 gave [7, 6]
    assert cuda_topk_reference([0.0] * 6 + [1.0, 1.0], 2)[1] == [7, 6]
    assert cuda_topk_reference([1.0] * 4, 4)[1] == [1, 0, 2, 3]
    assert cuda_topk_reference([1.0] * 8, 8)[1] == [7, 6, 4, 5, 1, 0, 2, 3]
    assert cuda_topk_reference([1.0] * 64, 8)[1] == [7, 6, 4, 5, 1, 0, 2, 3]
    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 3, 5, 8, 13, 32):  # distinct values: a plain descending sort
        row = torch.randn(40, generator=g).tolist()
        values, order = cuda_topk_reference(row, k)
        ref = torch.topk(torch.tensor(row, dtype=torch.float64), k)
        assert order == ref.indices.tolist() and values == ref.values.tolist()
    nan = float("nan")
    # NaN is the largest: gathered [1, 3, 4] (above 3.0), then [0]; torch 2.11's CUDA topk
    # returns these indices for this row
    values, order = cuda_topk_reference([3.0, nan, 1.0, 5.0, nan, 2.0], 4)
    assert order == [1, 4, 3, 0] and values[2:] == [5.0, 3.0]


POOL = torch.tensor([-1.5, -0.5, 0.0, 0.25, 1.0, 2.0])  # exact in bf16 and f16, 0.25 apart at least


def tied_logits(tokens, experts, seed, values=3):
    """Logits drawn from `values` entries of POOL: ties everywhere. Equal
    logits give equal probabilities and distinct ones distinct
    probabilities in the same order, so the reference may rank the logits."""
    g = torch.Generator().manual_seed(seed)
    pool = POOL[torch.randperm(len(POOL), generator=g)[:values]]
    return pool[torch.randint(0, values, (tokens, experts), generator=g)]


def reference_indices(logits, k):
    """cuda_topk_reference's experts per row; a row with a NaN or +inf
    logit, or only -inf logits, is all NaN (softmax)."""
    out = []
    for row in logits.float().tolist():
        nan_row = any(math.isnan(x) or x == math.inf for x in row) or all(x == -math.inf for x in row)
        out.append(cuda_topk_reference([math.nan] * len(row) if nan_row else row, k)[1])
    return torch.tensor(out, dtype=torch.int64)


def designed_ties(experts):
    """Seven rows whose ties sit where the order matters: the top value at
    both ends, the top value at the last two experts, equal values around
    the k-th place, one above a long tie, all equal, the larger values at
    the odd experts, and a NaN row."""
    e = experts
    rows = []
    r = torch.zeros(e)
    r[0] = r[e - 1] = 2.0
    rows.append(r)
    r = torch.zeros(e)
    r[-2:] = 2.0
    rows.append(r)
    r = -1.0 - torch.arange(e) / (2.0 * e)
    r[1::3] = 1.0
    rows.append(r)
    r = torch.full((e,), -1.5)
    r[3 * e // 4:] = 1.0
    r[e // 2] = 2.0
    rows.append(r)
    rows.append(torch.ones(e))
    r = torch.full((e,), 2.0)
    r[::2] = -0.5
    rows.append(r)
    r = torch.zeros(e)
    r[e // 3] = float("nan")
    rows.append(r)
    return torch.stack(rows)


@pytest.mark.parametrize("experts", [3, 8, 60, 64, 128, 1024])
@pytest.mark.parametrize("k", [1, 2, 4, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equal_probabilities_in_torchs_cuda_order(experts, k, dtype):
    if k > experts:
        pytest.skip("k > E")
    logits = torch.cat([designed_ties(experts), tied_logits(60, experts, seed=experts + k)]).to(dtype)
    want = reference_indices(logits, k)
    p = torch.softmax(logits.float(), dim=-1)
    finite = ~p.isnan().any(dim=1)
    for renormalize in (True, False):
        w, i = topk_softmax(logits, k, renormalize=renormalize)
        assert torch.equal(i, want), (renormalize, (i != want).nonzero()[:4].tolist())
        chosen = p.gather(1, i)[finite]
        assert bool((chosen[:, :-1] >= chosen[:, 1:]).all())  # descending
        assert bool(w[~finite].isnan().all()) and not bool(w[finite].isnan().any())


def test_ties_in_torchs_cuda_order():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0],
                           [5.0, -1.0, 5.0, 5.0, -1.0]])
    w, i = topk_softmax(logits, 3)
    assert i.tolist() == [[4, 2, 1], [2, 1, 0], [3, 2, 0]]
    assert bool((w[1] == w[1, 0]).all()) and abs(w[1, 0].item() - 1 / 3) < 1e-7  # equal values
    _, i = topk_softmax(logits, 2)
    assert i.tolist() == [[2, 1], [1, 0], [2, 0]]
    _, i = topk_softmax(logits, 1)  # the first of the equal largest (gatherTopK), no sort
    assert i.tolist() == [[1], [0], [0]]


def test_nan_rows_are_nan_with_experts_in_torchs_order():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.5, nan, 2.0, 1.0],     # a NaN logit
                           [0.5, inf, 2.0, 1.0],     # +inf: inf - inf
                           [-inf, -inf, -inf, -inf],  # only -inf
                           [0.5, -inf, 2.0, 1.0]])   # -inf alone is a probability of 0
    for renormalize in (True, False):
        w, i = topk_softmax(logits, 2, renormalize=renormalize)
        # every probability NaN, equal under torch's comparators: experts 0 and 1
        # gathered, then the network's first exchange swaps them
        assert bool(w[:3].isnan().all()) and i[:3].tolist() == [[1, 0]] * 3
        ref_w, ref_i = torch_routing(logits[3:], 2, renormalize)
        assert i[3].tolist() == ref_i[0].tolist() and ulps(w[3:], ref_w) <= 2
    w, i = topk_softmax(logits[3:], 4, renormalize=False)
    assert i.tolist() == [[2, 3, 0, 1]] and w[0, 3].item() == 0.0
    assert topk_softmax(logits[:3], 4)[1].tolist() == [[1, 0, 2, 3]] * 3
    assert topk_softmax(logits[:3], 1)[1].tolist() == [[0]] * 3


def test_k_of_one_and_of_every_expert():
    logits = logits_of(31, 60, seed=5)
    w, i = topk_softmax(logits, 1)
    assert torch.equal(w, torch.ones(31, 1)) and torch.equal(i[:, 0], logits.argmax(dim=1))
    w, i = topk_softmax(logits, 60 if 60 <= 32 else 32, renormalize=False)
    ref_w, ref_i = torch_routing(logits, 32, renormalize=False)
    assert torch.equal(i, ref_i) and ulps(w, ref_w) <= 4
    logits = logits_of(9, 16, seed=6)
    w, i = topk_softmax(logits, 16)
    assert torch.equal(i.sort(dim=1).values, torch.arange(16).expand(9, 16))
    assert torch.allclose(w.sum(dim=1), torch.ones(9))


def test_threads_numpy_and_int32_indices_agree():
    logits = logits_of(1000, 128, seed=7)
    one = topk_softmax(logits, 8, num_threads=1)
    four = topk_softmax(logits, 8, num_threads=4)
    w_np, i_np = topk_softmax(logits.numpy(), 8, index_dtype="int32")
    assert torch.equal(one[0], four[0]) and torch.equal(one[1], four[1])
    assert np.array_equal(w_np, one[0].numpy()) and np.array_equal(i_np, one[1].numpy().astype(np.int32))


def test_strided_views_are_read_and_written_in_place():
    big = logits_of(20, 128, seed=8)
    logits = big[::2, ::2]  # [10, 64], strided both ways
    out_w = torch.zeros(10, 8)[:, ::2]
    out_i = torch.zeros(10, 8, dtype=torch.int64)[:, 1::2]
    _C.topk_softmax(logits=logits, k=4, out_weights=out_w, out_indices=out_i, num_threads=None)
    w, i = topk_softmax(logits.contiguous(), 4)
    assert torch.equal(out_w, w) and torch.equal(out_i, i)


def _outputs(tokens, k, w_dtype=torch.float32, i_dtype=torch.int64):
    return torch.full((tokens, k), 7.0, dtype=w_dtype), torch.full((tokens, k), -5, dtype=i_dtype)


@pytest.mark.parametrize("case,error,match", [
    ("logits 1-d", ValueError, "logits must be"),
    ("logits 3-d", ValueError, "logits must be"),
    ("logits int", TypeError, "logits"),
    ("no experts", ValueError, "experts"),
    ("1025 experts", ValueError, "1025 experts"),
    ("k 0", ValueError, "k = 0"),
    ("k > E", ValueError, "k = 9"),
    ("k 33", ValueError, "k = 33"),
    ("weights shape", ValueError, "out_weights must be"),
    ("weights int", TypeError, "out_weights"),
    ("indices shape", ValueError, "out_indices must be"),
    ("indices float", TypeError, "out_indices"),
    ("outputs overlap", ValueError, "out_indices"),
])
def test_bad_arguments_are_refused_before_anything_is_written(case, error, match):
    logits, k = logits_of(6, 8), 2
    out_w, out_i = _outputs(6, k)
    if case == "logits 1-d":
        logits = logits[0]
    elif case == "logits 3-d":
        logits = logits.view(2, 3, 8)
    elif case == "logits int":
        logits = logits.to(torch.int32)
    elif case == "no experts":
        logits = torch.empty(6, 0)
    elif case == "1025 experts":
        logits = logits_of(6, 1025)
    elif case == "k 0":
        k = 0
    elif case == "k > E":
        k, (out_w, out_i) = 9, _outputs(6, 9)
    elif case == "k 33":
        logits, k = logits_of(6, 64), 33
        out_w, out_i = _outputs(6, 33)
    elif case == "weights shape":
        out_w = torch.zeros(6, 3)
    elif case == "weights int":
        out_w = torch.zeros(6, k, dtype=torch.int32)
    elif case == "indices shape":
        out_i = torch.zeros(5, k, dtype=torch.int64)
    elif case == "indices float":
        out_i = torch.zeros(6, k)
    elif case == "outputs overlap":
        out_i = out_w.view(torch.int32)
    snaps = [logits.clone(), out_w.clone(), out_i.clone()]
    with pytest.raises(error, match=match):
        _C.topk_softmax(logits=logits, k=k, renormalize=True, out_weights=out_w, out_indices=out_i,
                        num_threads=None)
    for before, after in zip(snaps, (logits, out_w, out_i)):
        assert torch.equal(before.view(torch.uint8) if before.dtype != after.dtype else before, after)


def test_no_tokens_is_a_no_op():
    w, i = topk_softmax(torch.empty(0, 8), 2)
    assert w.shape == (0, 2) and i.shape == (0, 2)


def test_compiles_into_one_graph():
    f = torch.compile(lambda x: topk_softmax(x, 2, out_dtype=torch.bfloat16), fullgraph=True)
    logits = logits_of(12, 8, seed=9)
    w, i = f(logits)
    ref = topk_softmax(logits, 2, out_dtype=torch.bfloat16)
    assert torch.equal(w, ref[0]) and torch.equal(i, ref[1])


# ------------------------------------------------------------------ on the GPU
def _cuda_ulps_ok(gpu_w, cpu_w, limit):
    return ulps(gpu_w.cpu(), cpu_w) <= limit


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [8, 60, 64, 128])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 3, 129, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_equals_the_cpu(experts, k, tokens, dtype):
    """Same experts; weights equal up to CUDA's expf, whose ex2.approx the
    CPU replaces by a correctly rounded 2^f (a few ulp). The exact-bits
    fraction is printed: 1.0 would mean ex2.approx rounds correctly here."""
    logits = logits_of(tokens, experts, dtype, seed=tokens + experts + k, distinct=True)
    for renormalize in (True, False):
        cpu_w, cpu_i = topk_softmax(logits, k, renormalize=renormalize)
        gpu_w, gpu_i = topk_softmax(logits.cuda(), k, renormalize=renormalize)
        assert torch.equal(gpu_i.cpu(), cpu_i)
        assert _cuda_ulps_ok(gpu_w, cpu_w, 8)
        print(f"E={experts} k={k} T={tokens} {dtype}: exact bits "
              f"{(gpu_w.cpu().view(torch.int32) == cpu_w.view(torch.int32)).float().mean().item():.4f}")


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [1, 3, 8, 33, 60, 64, 128, 1024])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gpu_is_torchs_cuda_routing_bit_for_bit(experts, k, dtype):
    if k > experts:
        pytest.skip("k > E")
    logits = logits_of(4096, experts, dtype, seed=experts * 10 + k, distinct=True).cuda()
    for renormalize in (True, False):
        for out_dtype in {torch.float32, dtype}:
            w, i = topk_softmax(logits, k, renormalize=renormalize, out_dtype=out_dtype)
            ref_w, ref_i = torch_routing(logits, k, renormalize, out_dtype)
            assert torch.equal(i, ref_i), (renormalize, out_dtype)
            assert torch.equal(w, ref_w), (renormalize, out_dtype, ulps(w.cpu(), ref_w.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [3, 8, 60, 64, 128, 1024])
@pytest.mark.parametrize("k", [1, 2, 4, 8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gpu_ties_are_torchs_cuda_routing_bit_for_bit(experts, k, dtype):
    """Logits from a few distinct values (rows full of equal probabilities)
    against torch's own CUDA routing: the same experts in the same order,
    the same bits; the C core and the Python transcription name the same
    experts. T = 4096 with E = 1024 is torch's multi-block topk
    (should_use_multiblock), whose write order is the single block's."""
    if k > experts:
        pytest.skip("k > E")
    cpu = torch.cat([designed_ties(experts), tied_logits(4096 - 7, experts, seed=experts * 3 + k)])
    cpu = cpu.to(dtype)
    logits = cpu.cuda()
    for renormalize in (True, False):
        for out_dtype in {torch.float32, dtype}:
            w, i = topk_softmax(logits, k, renormalize=renormalize, out_dtype=out_dtype)
            ref_w, ref_i = torch_routing(logits, k, renormalize, out_dtype)
            assert torch.equal(i, ref_i), (renormalize, out_dtype, (i != ref_i).nonzero()[:4].tolist())
            assert torch.equal(w.view(torch.uint8), ref_w.view(torch.uint8)), (renormalize, out_dtype)
        _, cpu_i = topk_softmax(cpu, k, renormalize=renormalize)
        assert torch.equal(cpu_i, i.cpu())
    assert torch.equal(i[:100].cpu(), reference_indices(cpu[:100], k))


@pytest.mark.gpu
def test_gpu_nan_rows_and_stream_order():
    logits = torch.tensor([[0.5, float("nan"), 2.0, 1.0], [0.5, -1.0, 2.0, 1.0]])
    w, i = topk_softmax(logits.cuda(), 2)
    assert bool(w[0].isnan().all()) and i.cpu().tolist()[0] == [1, 0]
    cpu_w, cpu_i = topk_softmax(logits, 2)
    assert torch.equal(i.cpu(), cpu_i) and _cuda_ulps_ok(w[1:], cpu_w[1:], 8)


