"""experts_gemm (idempotent_moe.moe): the experts' grouped GEMM that reads
each row's input through the dispatch's src and may apply the gated
activation. The C core against a float64 reference (every dtype, gated and
not, with and without src, rows past offsets[-1] untouched), bad inputs
refused with nothing written, the torch op under torch.compile; in the gpu
tests the tensor-core kernel against the C core for every tile
configuration the plan picks, bad src / offsets recorded with nothing
written, and the experts forward on it against grouped_mm's error."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from idempotent_moe import check_errors  # noqa: E402
from idempotent_moe.moe import experts_gemm, gated_act, moe_dispatch  # noqa: E402

ACTS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}
# One rounding of the output (and, gated, of gate and up first) above the
# float32 sums: a multiple of the dtype's epsilon, relative to the scale.
EPS = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def problem(tokens, experts, top_k, k, n, dtype, seed, skew=None, device="cpu"):
    """(x [T, K], w [E, K, N] as a view of [E, N, K], dispatch) on `device`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    w = (torch.randn(experts, n, k, generator=g) / k ** 0.5).to(dtype).transpose(1, 2)
    scores = torch.rand(tokens, experts, generator=g)
    if skew is not None:
        scores[:, skew] += 2.0
    ids = scores.topk(top_k, dim=1).indices
    x, w, ids = x.to(device), w.to(device), ids.to(device)
    return x, w, moe_dispatch(x[:, :1], ids, experts)


def reference(x, w, d, act, dtype):
    """float64 y[r] = x[src[r]] @ w[e(r)] for rows below offsets[-1]; gated
    as gated_act computes it from y rounded to dtype."""
    ends = d.offsets.cpu().tolist()
    src = d.src.cpu().long()
    y = torch.zeros(src.shape[0], w.shape[-1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            y[start:end] = x.cpu().double()[src[start:end]] @ w[e].cpu().double()
        start = end
    if act is None:
        return y, ends[-1]
    return gated_act(y.to(dtype), act).double(), ends[-1]


def close(out, ref, end, dtype):
    scale = ref[:end].abs().max().clamp(min=1.0)
    err = (out[:end].double().cpu() - ref[:end]).abs().max()
    assert err <= 4 * EPS[dtype] * scale, (float(err), float(scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", [None, "silu", "gelu", "relu", "gelu_tanh"])
@pytest.mark.parametrize("gather", [True, False])
def test_cpu_against_float64(dtype, act, gather):
    x, w, d = problem(13, 6, 2, 40, 24, dtype, seed=1)
    a = x if gather else x[d.src.long().clamp(min=0)]
    out = experts_gemm(a, w, d.offsets, src=d.src if gather else None, act=act)
    assert out.shape == (26, 12 if act else 24) and out.dtype == dtype
    close(out, *reference(x, w, d, act, dtype), dtype)


def test_rows_past_the_end_keep_their_bytes_and_empty_experts():
    x, w, d = problem(20, 5, 1, 16, 8, torch.float32, seed=2)
    offsets = d.offsets.clone()
    offsets[3:] = offsets[2]  # experts 3 and 4 empty: rows from offsets[2] on computed by none
    out = torch.full((20, 8), 7.0)
    experts_gemm(x, w, offsets, src=d.src, out=out)
    end = int(offsets[-1])
    assert 0 < end < 20 and bool((out[end:] == 7.0).all())
    dd = d._replace(offsets=offsets)
    close(out, *reference(x, w, dd, None, torch.float32), torch.float32)


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.src.__setitem__(0, 13), r"src\[0\] = 13 is outside \[0, T = 13\)"),
    (lambda d: d.src.__setitem__(5, -1), r"src\[5\] = -1"),
    (lambda d: d.offsets.__setitem__(0, 30), r"offsets\[0\] = 30"),
    (lambda d: d.offsets.__setitem__(2, 0), r"offsets\[2\] = 0 is outside"),
])
def test_bad_data_is_refused_and_nothing_is_written(mutate, match):
    x, w, d = problem(13, 4, 2, 16, 8, torch.float32, seed=3)
    mutate(d)
    out = torch.full((26, 8), 7.0)
    with pytest.raises(ValueError, match=match):
        experts_gemm(x, w, d.offsets, src=d.src, out=out)
    assert bool((out == 7.0).all())


def test_bad_arguments_name_the_argument():
    x, w, d = problem(5, 4, 2, 16, 8, torch.float32, seed=4)
    with pytest.raises(ValueError, match="w must be"):
        experts_gemm(x, w[:3], d.offsets, src=d.src)
    with pytest.raises(TypeError, match="w"):
        experts_gemm(x, w.double(), d.offsets, src=d.src)
    with pytest.raises(ValueError, match="even"):
        experts_gemm(x, w[:, :, :7], d.offsets, src=d.src, act="silu")
    with pytest.raises(ValueError, match="act"):
        experts_gemm(x, w, d.offsets, src=d.src, act="swish")
    with pytest.raises(TypeError, match="src"):
        experts_gemm(x, w, d.offsets, src=d.src.long())
    with pytest.raises(ValueError, match="out"):
        experts_gemm(x, w, d.offsets, src=d.src, out=torch.empty(10, 7))
    with pytest.raises(TypeError, match="not differentiable"):
        experts_gemm(x.requires_grad_(), w, d.offsets, src=d.src)


def test_the_torch_op_compiles_without_a_graph_break():
    x, w, d = problem(11, 4, 2, 32, 16, torch.bfloat16, seed=5)
    compiled = torch.compile(lambda x, w, o, s: experts_gemm(x, w, o, src=s, act="silu"), fullgraph=True)
    assert torch.equal(compiled(x, w, d.offsets, d.src), experts_gemm(x, w, d.offsets, src=d.src, act="silu"))


# ------------------------------------------------------------------ GPU (on the GPU machine)

# (tokens, experts, top-k, K, N): every tile configuration of the plan (16 rows
# per slot with 64 or 128 columns, 64, 128), K and N off the tiles, skew.
GPU_CASES = [
    (1, 8, 2, 4096, 1024), (3, 8, 2, 4096, 28672), (32, 8, 2, 2048, 14336), (5, 128, 8, 2048, 1536),
    (40, 128, 8, 768, 2048), (300, 8, 2, 1024, 2048), (512, 64, 8, 1024, 1536), (2048, 8, 2, 1024, 512),
    (77, 16, 4, 72, 200), (9, 4, 2, 136, 24),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_against_float64(case, act, dtype):
    tokens, experts, top_k, k, n = case
    x, w, d = problem(tokens, experts, top_k, k, n, dtype, seed=tokens + k, device="cuda")
    out = experts_gemm(x, w, d.offsets, src=d.src, act=act)
    check_errors(out)
    close(out, *reference(x, w, d, act, dtype), dtype)
    # without src, on the rows the dispatch would have gathered: the same bits
    rows = x[d.src.long().clamp(min=0)]
    assert torch.equal(experts_gemm(rows, w, d.offsets, act=act), out)


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [0, 5])
def test_gpu_skewed_routing_and_capacity(skew):
    x, w, d = problem(600, 8, 2, 512, 256, torch.bfloat16, seed=7, skew=skew, device="cuda")
    offsets = d.offsets.clone()
    offsets[skew:] = offsets[skew:] - (offsets[skew] - (offsets[skew - 1] if skew else 0)) // 2  # drop rows
    out = torch.full((1200, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    experts_gemm(x, w, offsets, src=d.src, act="gelu", out=out)
    check_errors(out)
    end = int(offsets[-1])
    assert bool((out[end:] == 7.0).all())
    ref, _ = reference(x, w, d._replace(offsets=offsets), "gelu", torch.bfloat16)
    close(out, ref, end, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["src", "offsets"])
def test_gpu_bad_data_writes_nothing_and_is_recorded(what):
    x, w, d = problem(40, 8, 2, 64, 32, torch.bfloat16, seed=8, device="cuda")
    if what == "src":
        d.src[3] = 40
    else:
        d.offsets[2] = d.offsets[1] - 1
    out = torch.full((80, 16), 7.0, dtype=torch.bfloat16, device="cuda")
    experts_gemm(x, w, d.offsets, src=d.src, act="silu", out=out)
    with pytest.raises(ValueError, match="found bad data"):
        check_errors(out)
    assert bool((out == 7.0).all())


@pytest.mark.gpu
def test_gpu_refuses_what_the_kernel_does_not_read():
    x, w, d = problem(4, 2, 1, 64, 16, torch.float32, seed=9, device="cuda")
    with pytest.raises(NotImplementedError, match="float16 or bfloat16"):
        experts_gemm(x, w, d.offsets, src=d.src)
    x, w, d = problem(4, 2, 1, 60, 16, torch.bfloat16, seed=9, device="cuda")
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        experts_gemm(x, w, d.offsets, src=d.src)
