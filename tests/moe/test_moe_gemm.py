"""grouped_gemm (idempotent_moe.moe): the C core against a NumPy model of
the documented summation order (bit for bit, every dtype) and a float64
reference on the CPU; the CUDA kernel against the C core bit for bit, and
the experts forward with `idempotent_small_m_gemm` against the fp32
reference, in the gpu tests."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import idempotent_moe as imoe  # noqa: E402
from idempotent_moe import check_errors  # noqa: E402
from idempotent_moe.moe import grouped_gemm  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fmaf(x, y, z):
    """x * y + z rounded once to float32 (NumPy float32 arrays): the product
    is exact in float64, the sum's rounding error comes from TwoSum, and a
    float64 sum that lands on a float32 midpoint is rounded toward that
    error instead of to even."""
    p = x.astype(np.float64) * y.astype(np.float64)
    zd = z.astype(np.float64)
    s = p + zd
    bp = s - zd
    err = (p - bp) + (zd - (s - bp))
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)))
    mid = (r64 + other.astype(np.float64)) / 2
    toward_other = (s == mid) & (err != 0) & ((err > 0) == (other > r))
    return np.where(toward_other, other, r)


def lane_order_gemm(a, w, offsets, out):
    """The documented order, row by row: 32 lane sums, element k to lane
    (k // V) % 32 in increasing k by fmaf, then the butterfly, rounded once
    to out's dtype. a [R, K], w [E, K, N] torch tensors (any dtype),
    offsets [E]; writes rows < offsets[-1] of a copy of out."""
    vec = 4 if a.dtype == torch.float32 else 8
    af = a.float().numpy()
    wf = w.float().numpy()
    result = out.clone()
    lanes = (np.arange(a.shape[1]) // vec) % 32
    ends = offsets.tolist()
    for r in range(ends[-1]):
        e = next(i for i, end in enumerate(ends) if end > r)
        p = np.zeros((32, w.shape[-1]), dtype=np.float32)
        for k in range(a.shape[1]):
            p[lanes[k]] = fmaf(np.full(w.shape[-1], af[r, k], dtype=np.float32), wf[e, k], p[lanes[k]])
        h = 16
        while h:
            p[:h] = p[:h] + p[h:2 * h]
            h //= 2
        result[r] = torch.from_numpy(p[0].copy()).to(out.dtype)
    return result


def float64_gemm(a, w, offsets):
    ends = [0] + offsets.tolist()
    y = torch.zeros(a.shape[0], w.shape[-1], dtype=torch.float64)
    for e in range(w.shape[0]):
        lo, hi = ends[e], ends[e + 1]
        y[lo:hi] = a[lo:hi].double() @ w[e].double()
    return y


def problem(rows, experts, k, n, dtype, seed, counts=None, transposed=True):
    """a [R, K], w [E, K, N] (transformers' [E, N, K] weight transposed, or
    a contiguous [E, K, N]) and offsets [E] int32 with `counts` rows per
    expert (random by default; they may leave rows past the end)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, k, generator=g).to(dtype)
    if transposed:
        w = (torch.randn(experts, n, k, generator=g) / k ** 0.5).to(dtype).transpose(1, 2)
    else:
        w = (torch.randn(experts, k, n, generator=g) / k ** 0.5).to(dtype)
    if counts is None:
        cuts = torch.randint(0, rows + 1, (experts - 1,), generator=g).sort().values
        ends = torch.cat([cuts, torch.tensor([rows])])
    else:
        ends = torch.tensor(counts).cumsum(0)
    return a, w, ends.to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [8, 96, 300])
def test_cpu_is_the_documented_order_bit_for_bit(dtype, k):
    a, w, offsets = problem(13, 4, k, 7, dtype, seed=k)
    out = torch.full((13, 7), 5.0, dtype=dtype)
    got = grouped_gemm(a, w, offsets, out=out.clone())
    assert torch.equal(got, lane_order_gemm(a, w, offsets, out))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_is_within_one_rounding_of_float64(dtype):
    a, w, offsets = problem(40, 8, 512, 96, dtype, seed=2, counts=[5, 0, 9, 0, 0, 20, 6, 0])
    got = grouped_gemm(a, w, offsets).double()
    ref = float64_gemm(a, w, offsets)
    # One rounding into the dtype (unit roundoff u), plus the fp32 summation
    # error: at most (K / 32 + 5) x 2^-24 of sum |a w| (fma chains, then the butterfly).
    u = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    magnitude = float64_gemm(a.abs(), w.abs(), offsets)
    summed = (512 / 32 + 5) * 2.0 ** -24 * magnitude
    bound = u * (ref.abs() + 2 * summed) + summed
    assert bool(((got - ref).abs() <= bound).all())


def test_empty_experts_one_expert_and_rows_past_the_end():
    a, w, _ = problem(12, 5, 64, 9, torch.float32, seed=4)
    for counts in ([0, 0, 12, 0, 0], [12, 0, 0, 0, 0], [0, 0, 0, 0, 12], [3, 0, 0, 2, 1], [0, 0, 0, 0, 0]):
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        out = torch.full((12, 9), -3.0)
        got = grouped_gemm(a, w, offsets, out=out)
        assert got is out
        end = int(offsets[-1])
        assert bool((out[end:] == -3.0).all())
        assert torch.equal(out[:end], lane_order_gemm(a, w, offsets, torch.full((12, 9), -3.0))[:end])
        assert torch.allclose(out[:end].double(), float64_gemm(a, w, offsets)[:end], atol=1e-5)


def test_any_weight_strides_on_the_cpu():
    a, w, offsets = problem(10, 3, 48, 16, torch.bfloat16, seed=5)
    contiguous = grouped_gemm(a, w.contiguous(), offsets)
    assert torch.equal(grouped_gemm(a, w, offsets), contiguous)
    wide = torch.zeros(3, 48, 40, dtype=torch.bfloat16)
    wide[:, :, ::2][:, :, :16] = w  # every other column of a wider tensor
    assert torch.equal(grouped_gemm(a, wide[:, :, :32:2], offsets), contiguous)


def test_numpy_arrays():
    a, w, offsets = problem(9, 3, 32, 5, torch.float32, seed=6)
    got = grouped_gemm(a.numpy(), np.ascontiguousarray(w.numpy()), offsets.numpy())
    assert isinstance(got, np.ndarray)
    assert np.array_equal(got, grouped_gemm(a, w, offsets).numpy())


@pytest.mark.parametrize("offsets,match", [([3, 2, 9], r"offsets\[1\] = 2 is outside \[3, R = 9\]"),
                                           ([3, 5, 10], r"offsets\[2\] = 10 is outside \[5, R = 9\]"),
                                           ([-1, 5, 9], r"offsets\[0\] = -1 is outside \[0, R = 9\]")])
def test_bad_offsets_are_refused_and_nothing_is_written(offsets, match):
    a, w, _ = problem(9, 3, 16, 4, torch.float32, seed=7)
    out = torch.full((9, 4), 2.0)
    before = (a.clone(), w.clone())
    with pytest.raises(ValueError, match=match):
        grouped_gemm(a, w, torch.tensor(offsets, dtype=torch.int32), out=out)
    assert bool((out == 2.0).all()) and torch.equal(a, before[0]) and torch.equal(w, before[1])


def test_bad_arguments_name_the_argument():
    a, w, offsets = problem(6, 2, 16, 4, torch.bfloat16, seed=8)
    out = torch.full((6, 4), 1.0, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="w: dtype F16 is not accepted here"):
        grouped_gemm(a, w.half(), offsets, out=out)
    with pytest.raises(TypeError, match="out: dtype F32 is not accepted here"):
        grouped_gemm(a, w, offsets, out=out.float())
    with pytest.raises(TypeError, match="offsets: dtype I64"):
        grouped_gemm(a, w, offsets.long(), out=out)
    with pytest.raises(TypeError, match="a must have dtype"):
        grouped_gemm(a.to(torch.int32), w, offsets, out=out)
    with pytest.raises(ValueError, match=r"w must be \[E = 2, K = 16, N\], got \[2, 15, 4\]"):
        grouped_gemm(a, w[:, :15], offsets, out=out)
    with pytest.raises(ValueError, match=r"w must be \[E = 3, K = 16, N\]"):
        grouped_gemm(a, w, torch.tensor([2, 4, 6], dtype=torch.int32), out=out)
    with pytest.raises(ValueError, match=r"out must be \[6, 4\], got \[6, 3\]"):
        grouped_gemm(a, w, offsets, out=out[:, :3])
    shared = torch.zeros(6, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a shares memory with out|out .*a"):
        grouped_gemm(shared, w, offsets, out=shared[:, :4])
    assert bool((out == 1.0).all())


def test_the_torch_op_traces():
    from idempotent_moe import _moe_torch_ops

    if not _moe_torch_ops.AVAILABLE:
        pytest.skip("torch.library.custom_op needs torch 2.4")
    a, w, offsets = problem(8, 2, 32, 8, torch.float32, seed=9, counts=[3, 5])
    torch.library.opcheck(torch.ops.idempotent_moe.grouped_gemm.default, (a, w, offsets))


# ------------------------------------------------------------------ GPU (on the GPU machine)

def _cuda_equals_cpu(rows, experts, k, n, dtype, seed, counts=None):
    a, w, offsets = problem(rows, experts, k, n, dtype, seed, counts)
    cpu = grouped_gemm(a, w, offsets, out=torch.zeros(rows, n, dtype=dtype))
    out = torch.zeros(rows, n, dtype=dtype, device="cuda")
    gpu = grouped_gemm(a.cuda(), w.cuda(), offsets.cuda(), out=out)
    check_errors(gpu)
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,experts,k,n", [
    (1, 8, 2048, 14336), (2, 8, 2048, 14336), (16, 8, 2048, 14336),   # Mixtral-like gate-up
    (2, 8, 7168, 2048), (64, 8, 7168, 2048),                          # Mixtral-like down
    (8, 128, 2048, 1536), (64, 128, 2048, 1536),                      # Qwen3-like gate-up
    (8, 128, 768, 2048), (64, 128, 768, 2048),                        # Qwen3-like down
    (33, 8, 2048, 776), (5, 128, 7168, 800)])                         # N not a multiple of the tile
def test_gpu_equals_the_cpu_bit_for_bit(rows, experts, k, n):
    _cuda_equals_cpu(rows, experts, k, n, torch.bfloat16, seed=rows + k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k", [2048, 7168])
def test_gpu_equals_the_cpu_for_every_dtype(dtype, k):
    _cuda_equals_cpu(24, 8, k, 768, dtype, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[64, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 61, 0, 0, 1, 2],
                                    [1, 0, 30, 0, 0, 0, 0, 0]])
def test_gpu_skewed_routing(counts):
    """An expert with many rows runs its rows in chunks; rows past the end stay."""
    _cuda_equals_cpu(64, 8, 2048, 1024, torch.bfloat16, seed=11, counts=counts)


@pytest.mark.gpu
@pytest.mark.parametrize("offsets", [[3, 2, 9], [3, 5, 10], [-4, 5, 9], [0, 2**31 - 1, 9]])
def test_gpu_bad_offsets_write_nothing_and_are_recorded(offsets):
    a, w, _ = problem(9, 3, 64, 40, torch.bfloat16, seed=12)
    arena = torch.full((11, 48), 7.0, dtype=torch.bfloat16, device="cuda")
    out = arena[1:10, 4:44]
    grouped_gemm(a.cuda(), w.cuda(), torch.tensor(offsets, dtype=torch.int32, device="cuda"), out=out)
    with pytest.raises(ValueError, match="found bad data"):
        check_errors(out)
    assert bool((arena == 7.0).all())


@pytest.mark.gpu
def test_gpu_refuses_layouts_the_kernel_does_not_read():
    a, w, offsets = problem(4, 2, 64, 16, torch.bfloat16, seed=13, transposed=False)
    with pytest.raises(NotImplementedError, match="K axis must be contiguous"):
        grouped_gemm(a.cuda(), w.cuda(), offsets.cuda())
    a, w, offsets = problem(4, 2, 60, 16, torch.bfloat16, seed=13)
    with pytest.raises(NotImplementedError, match="multiple of 16 bytes"):
        grouped_gemm(a.cuda(), w.cuda(), offsets.cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_gpu_small_m_experts_forward_is_no_worse_than_grouped_mm(tokens):
    """With idempotent_small_m_gemm the decode path's GEMMs are grouped_gemm
    (its kernel runs), and the output is as close to the fp32 experts as
    grouped_mm's."""
    import idempotent_moe.integrations as hf
    from _helpers.hf_models import block_output, cuda_block
    from idempotent_moe.integrations import _fused
    from imoe_bench import w4
    from torch.profiler import ProfilerActivity, profile

    hf.register()
    block = cuda_block(2048, 7168, "bfloat16")
    x = torch.randn(1, tokens, 2048, device="cuda", dtype=torch.bfloat16)
    grouped = block_output(block, x, "grouped_mm")
    setattr(block.experts.config, hf.SMALL_M_GEMM_ATTR, True)
    try:
        ours = block_output(block, x, "idempotent")
        assert _fused._plan(block.experts, x.view(tokens, -1)).small_m
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            block(x)
            torch.cuda.synchronize()
    finally:
        delattr(block.experts.config, hf.SMALL_M_GEMM_ATTR)
    assert any("k_grouped_gemm" in e.name for e in prof.events())
    with torch.no_grad():
        exact = w4.fp32_reference(block, x)
    err_ours = (ours.float() - exact).abs().mean()
    err_grouped = (grouped.float() - exact).abs().mean()
    assert err_ours <= err_grouped * 1.02, (float(err_ours), float(err_grouped))


def _kernels(fn) -> set:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, {e.name for e in prof.events()}


@pytest.mark.gpu
def test_gpu_small_m_compiled_is_the_eager_path_and_large_batches_keep_grouped_mm():
    """Under torch.compile (the static cache's decode) the switch runs the
    same kernels as the eager decode path, bit for bit (the experts on the
    same routing); above SMALL_M_ROWS_PER_EXPERT rows per expert both paths
    keep torch's grouped_mm (eager: with experts_gemm switched off, which
    the eager default would take there)."""
    import idempotent_moe.integrations as hf
    from _helpers.hf_models import cuda_block
    from idempotent_moe.integrations import _fused

    hf.register()
    block = cuda_block(1024, 3584, "bfloat16")
    from imoe_bench import w4

    w4._use(block, "idempotent", None)
    experts = block.experts
    setattr(experts.config, hf.SMALL_M_GEMM_ATTR, True)
    setattr(experts.config, hf.EXPERTS_GEMM_ATTR, False)
    try:
        for tokens in (8, _fused.SMALL_M_ROWS_PER_EXPERT * 8 // 2 + 1):
            x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                _, weights, index = block.gate(x)
                eager = experts(x, index, weights)
            compiled = torch.compile(experts, fullgraph=True, dynamic=False)
            out, names = _kernels(lambda c=compiled, x=x, i=index, w=weights: c(x, i, w))
            small = tokens * 2 <= _fused.SMALL_M_ROWS_PER_EXPERT * 8
            assert any("k_grouped_gemm" in n for n in names) == small, (tokens, sorted(names))
            assert torch.equal(out, eager), tokens
            torch._dynamo.reset()
    finally:
        delattr(experts.config, hf.SMALL_M_GEMM_ATTR)
        delattr(experts.config, hf.EXPERTS_GEMM_ATTR)


def test_the_switch_is_the_config_attribute_idempotent_small_m_gemm():
    from idempotent_moe.integrations import hf_experts

    assert hf_experts.SMALL_M_GEMM_ATTR == "idempotent_small_m_gemm"
    assert imoe.moe.grouped_gemm is grouped_gemm
