"""CUDA tensors: bit-exact parity with the reference, validation before any
write, the caller's stream, no allocation, and CUDA graph capture. Skipped
(see conftest.py) unless torch sees a GPU and idempotent_moe has its CUDA build."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import (
    bits,
    expected_after,
    make_data,
    make_scores,
    reference_indices,
    reference_kept,
    target_map_from_indices,
    to_numpy,
    torch,
)

pytestmark = pytest.mark.gpu


def cuda(x):
    return x.cuda()


@pytest.mark.parametrize("mode", ["swap", "move"])
@pytest.mark.parametrize("data_dtype", ["float16", "bfloat16", "float32", "int8", "float64"])
@pytest.mark.parametrize("score_dtype", ["float32", "float16", "bfloat16"])
def test_cuda_parity(data_dtype, score_dtype, mode, rng):
    x = cuda(make_data((8, 512, 64), data_dtype, "torch", rng))
    scores = cuda(make_scores((8, 512), score_dtype, "torch", rng))
    before = bits(x)
    res = imoe.compact_(x, scores, 200, mode=mode, protected_prefix=3, recent_window=5)
    ref = reference_indices(reference_kept(scores, 200, 3, 5), 512, 200)
    assert res.indices.is_cuda and res.values.data_ptr() == x.data_ptr()
    np.testing.assert_array_equal(to_numpy(res.indices), ref)
    np.testing.assert_array_equal(bits(x), expected_after(before, 1, ref, mode))


@pytest.mark.parametrize("n,capacity,row", [(1, 0, 2), (1000, 1000, 2), (4097, 1, 130),
                                            (8192, 4096, 256), (300, 7, 65536)])
def test_cuda_shapes(n, capacity, row, rng):
    x = cuda(make_data((3, n, row), "uint8", "torch", rng))
    scores = cuda(make_scores((3, n), "float32", "torch", rng))
    before = bits(x)
    res = imoe.compact_(x, scores, capacity)
    ref = reference_indices(reference_kept(scores, capacity), n, capacity)
    np.testing.assert_array_equal(to_numpy(res.indices), ref)
    np.testing.assert_array_equal(bits(x), expected_after(before, 1, ref, "swap"))


def test_cuda_kv_strided_and_active(rng):
    base = cuda(make_data((2, 4, 300, 2 * 64), "float16", "torch", rng))
    k = base[..., :64]  # the rows of K are contiguous, the slots strided
    v = cuda(make_data((2, 4, 300, 32), "float32", "torch", rng))
    k0, v0 = bits(k), bits(v)
    chosen = np.stack([rng.choice(300, size=100, replace=False) for _ in range(8)]).reshape(
        2, 4, 100)
    active = cuda(torch.from_numpy(chosen))
    kv, vv, idx = imoe.compact_kv_cache_inplace(k, v, active_indices=active, return_indices=True)
    ref = reference_indices([np.sort(r) for r in chosen.reshape(8, 100)], 300, 100, (2, 4))
    np.testing.assert_array_equal(to_numpy(idx), ref)
    np.testing.assert_array_equal(bits(k), expected_after(k0, 2, ref, "swap"))
    np.testing.assert_array_equal(bits(v), expected_after(v0, 2, ref, "swap"))


def test_cuda_swap_then_restore(rng):
    x = cuda(make_data((8, 4096, 128), "bfloat16", "torch", rng))
    before = bits(x)
    res = imoe.compact_(x, cuda(make_scores((8, 4096), "float32", "torch", rng, ties=False)), 2048)
    imoe.restore_(x, res.indices)
    np.testing.assert_array_equal(bits(x), before)


def test_cuda_nan_in_last_row_changes_nothing(rng):
    """A CUDA call does not synchronise: bad data makes it change nothing, and
    check_errors() raises what it recorded (once)."""
    x = cuda(make_data((8, 1024, 32), "float16", "torch", rng))
    scores = cuda(make_scores((8, 1024), "float32", "torch", rng))
    scores[-1, -1] = float("nan")
    out = torch.full((8, 100), -5, dtype=torch.int64, device="cuda")
    snaps = [bits(x), bits(out)]
    imoe.compact_(x, scores, 100, out_indices=out)
    with pytest.raises(ValueError, match="NaN"):
        imoe.check_errors(x)
    imoe.check_errors(x)  # the error was taken: nothing left to raise
    np.testing.assert_array_equal(bits(x), snaps[0])
    np.testing.assert_array_equal(bits(out), snaps[1])
    # the next good call works as usual
    scores[-1, -1] = 0.5
    res = imoe.compact_(x, scores, 100, out_indices=out)
    imoe.check_errors(x)
    ref = reference_indices(reference_kept(scores, 100), 1024, 100)
    np.testing.assert_array_equal(to_numpy(res.indices), ref)


@pytest.mark.parametrize("score_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape,where", [
    ((8, 4096), (0, 0)), ((8, 4096), (7, 4095)), ((8, 4096), (3, 2049)),  # vector scan, free SMs
    ((8, 1000), (7, 999)),                 # rows not whole 16-byte vectors
    ((64, 16384), (63, 16383)),            # more scores than the free SMs take
])
def test_cuda_nan_found_everywhere(score_dtype, shape, where, rng):
    """The NaN check of rows of at most 16384 slots, which the select kernel
    does itself (every block its own row, then a grid barrier): odd and even
    16-bit lanes, the first and last slot, rows that are not whole 16-byte
    vectors, contiguous and strided scores."""
    rows, n = shape
    x = cuda(make_data((rows, n, 16), "float32", "torch", rng))
    scores = cuda(make_scores(shape, score_dtype, "torch", rng))
    scores[where] = float("nan")
    out = torch.full((rows, n // 2), -5, dtype=torch.int64, device="cuda")
    snaps = [bits(x), bits(out)]
    imoe.compact_(x, scores, n // 2, mode="move", out_indices=out)
    with pytest.raises(ValueError, match="NaN"):
        imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), snaps[0])
    np.testing.assert_array_equal(bits(out), snaps[1])
    strided = cuda(make_scores((rows, 2 * n), score_dtype, "torch", rng))[:, ::2]
    strided[where] = float("nan")
    imoe.compact_(x, strided, n // 2, mode="move", out_indices=out)
    with pytest.raises(ValueError, match="NaN"):
        imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), snaps[0])
    scores[where] = 0.5
    res = imoe.compact_(x, scores, n // 2, mode="move", out_indices=out)
    imoe.check_errors(x)
    ref = reference_indices(reference_kept(scores, n // 2), n, n // 2)
    np.testing.assert_array_equal(to_numpy(res.indices), ref)


def _check_with_prefix_and_window(x, scores, capacity, mode):
    """One compaction of x [rows, n, row] with a protected prefix of 3 and a
    recent window of 5: the indices, the target map and the data, bit for
    bit against the reference."""
    rows, n = scores.shape
    before = bits(x)
    tm = torch.full((rows, n), -7, dtype=torch.int32, device=x.device)
    res = imoe.compact_(x, scores, capacity, mode=mode, protected_prefix=3, recent_window=5,
                        out_target_map=tm)
    ref = reference_indices(reference_kept(scores, capacity, 3, 5), n, capacity)
    np.testing.assert_array_equal(to_numpy(res.indices), ref)
    np.testing.assert_array_equal(to_numpy(tm), target_map_from_indices(ref, n))
    np.testing.assert_array_equal(bits(x), expected_after(before, 1, ref, mode))


@pytest.mark.parametrize("rows,n,capacity", [
    (1, 131072, 65536), (2, 65536, 20000), (5, 40000, 39990), (3, 16385, 8),
    (1, 1 << 20, 300000), (64, 20000, 10000),
])
@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize("mode", ["move", "swap"])
def test_cuda_long_rows_spread_over_the_gpu(rows, n, capacity, ties, mode, rng):
    """Rows longer than 16384 slots, few of them: every row is cut into
    chunks, one block each, that meet at row barriers. Ties at the threshold
    (the lowest indices kept), a protected prefix and a recent window; the
    indices and the target map, the moved data, and a second call on the
    same slot of module memory."""
    x = cuda(make_data((rows, n, 12), "uint8", "torch", rng))
    dtype = "bfloat16" if ties else "float32"
    for _ in range(2):
        scores = cuda(make_scores((rows, n), dtype, "torch", rng, ties=ties))
        _check_with_prefix_and_window(x, scores, capacity, mode)


@pytest.mark.parametrize("rows,n,capacity,row", [
    (300, 4096, 2048, 6), (1000, 256, 100, 6), (600, 5000, 2500, 6), (280, 8192, 7000, 6),
    (4096, 64, 10, 6), (264, 4097, 9, 6),
    (264, 4096, 2048, 64),  # two blocks per row, each recomputing the row's selection
])
@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize("mode", ["move", "swap"])
def test_cuda_many_rows_several_per_multiprocessor(rows, n, capacity, row, ties, mode, rng):
    """Many rows of at most 8192 slots: a row per 256 or 512 threads, several
    rows selecting at once on one multiprocessor. Ties at the threshold, a
    protected prefix and a recent window; the indices, the target map and the
    moved data."""
    x = cuda(make_data((rows, n, row), "uint8", "torch", rng))
    scores = cuda(make_scores((rows, n), "bfloat16" if ties else "float32", "torch", rng, ties=ties))
    _check_with_prefix_and_window(x, scores, capacity, mode)


@pytest.mark.parametrize("rows,n,capacity,row", [
    (8, 4096, 2048, 2048),   # W1's shape, smaller rows: 40 of ~64 pairs per block loaded early
    (4, 1024, 512, 14336),   # rows of 896 vectors (not a power of two): 5 pairs per block
    (2, 512, 256, 2048),     # every pair of a block in the early round
    (3, 4096, 1000, 16),     # one vector per row
    (2, 300, 150, 81936),    # a row longer than the round: no early round
])
def test_cuda_moves_first_round_loaded_before_the_index_writes(rows, n, capacity, row, rng):
    """Moves of one buffer of 16-byte vectors load their first round into
    registers between the verdict and the index writes, then the mover takes
    the block's other pairs: the indices, the target map and the data, bit
    for bit, whether the early round holds some, all or none of the pairs."""
    x = cuda(make_data((rows, n, row), "uint8", "torch", rng))
    assert x.data_ptr() % 16 == 0
    for _ in range(2):
        scores = cuda(make_scores((rows, n), "float32", "torch", rng))
        _check_with_prefix_and_window(x, scores, capacity, "move")


@pytest.mark.parametrize("score_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,n,where", [
    (300, 4096, "last"), (2000, 4096, "last"), (2000, 4096, "first"), (2000, 1001, "middle"),
    (600, 8192, "middle"), (100, 20000, "last"),
])
def test_cuda_many_rows_nan_changes_nothing(score_dtype, rows, n, where, rng):
    """A NaN among many rows (nan=raise): 300 rows of 4096 fit on the GPU at
    once and check themselves at a grid barrier; the others take the check
    kernel, which reads dense scores as one flat range of 16-byte vectors
    (rows of 1001 bfloat16 scores end mid-vector) and strided scores row by
    row. Nothing is written; the next call is exact."""
    at = {"last": (rows - 1, n - 1), "first": (0, 0), "middle": (rows // 2, n // 2 + 1)}[where]
    x = cuda(make_data((rows, n, 4), "float16", "torch", rng))
    dense = cuda(make_scores((rows, n), score_dtype, "torch", rng, ties=False))
    strided = cuda(make_scores((rows, 2 * n), score_dtype, "torch", rng, ties=False))[:, ::2]
    out = torch.full((rows, n // 2), -5, dtype=torch.int64, device=x.device)
    snaps = [bits(x), bits(out)]
    for scores in (dense, strided):
        scores[at] = float("nan")
        imoe.compact_(x, scores, n // 2, mode="move", out_indices=out)
        with pytest.raises(ValueError, match="NaN"):
            imoe.check_errors(x)
        np.testing.assert_array_equal(bits(x), snaps[0])
        np.testing.assert_array_equal(bits(out), snaps[1])
    dense[at] = 0.75
    res = imoe.compact_(x, dense, n // 2, mode="move", out_indices=out)
    imoe.check_errors(x)
    ref = reference_indices(reference_kept(dense, n // 2), n, n // 2)
    np.testing.assert_array_equal(to_numpy(res.indices), ref)
    np.testing.assert_array_equal(bits(x), expected_after(snaps[0], 1, ref, "move"))


@pytest.mark.parametrize("where", [(0, 0), (1, 65535), (1, 30000)])
def test_cuda_long_rows_nan_changes_nothing(where, rng):
    """A NaN anywhere in a long row (nan=raise): no block writes, whichever
    chunk holds it; the next call is exact."""
    x = cuda(make_data((2, 65536, 16), "float16", "torch", rng))
    scores = cuda(make_scores((2, 65536), "float32", "torch", rng, ties=False))
    scores[where] = float("nan")
    out = torch.full((2, 30000), -5, dtype=torch.int64, device="cuda")
    snaps = [bits(x), bits(out)]
    imoe.compact_(x, scores, 30000, mode="move", out_indices=out)
    with pytest.raises(ValueError, match="NaN"):
        imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), snaps[0])
    np.testing.assert_array_equal(bits(out), snaps[1])
    scores[where] = 0.25
    res = imoe.compact_(x, scores, 30000, mode="move", out_indices=out)
    imoe.check_errors(x)
    ref = reference_indices(reference_kept(scores, 30000), 65536, 30000)
    np.testing.assert_array_equal(to_numpy(res.indices), ref)
    np.testing.assert_array_equal(bits(x), expected_after(snaps[0], 1, ref, "move"))



def test_cuda_nan_verdicts_in_sequence(rng):
    """Calls one after another, with and without a NaN, on grids of 1 to
    hundreds of blocks (the select's own NaN check keeps its barrier state on
    the device from call to call, per call slot; grids that cannot all be
    resident at once take the check kernel): each call's own verdict, every
    time, and a refused call changes nothing."""
    torch.manual_seed(5)
    for i in range(160):
        rows = int(rng.choice([1, 2, 3, 7, 8, 9, 40, 128, 300]))
        n = int(rng.choice([m for m in (64, 1000, 4096, 8192, 16384) if rows * m <= 1 << 20]))
        row = int(rng.choice([4, 64])) if rows * n <= 1 << 16 else 4
        x = torch.randn(rows, n, row, device="cuda")
        scores = torch.rand(rows, n, device="cuda")
        bad = bool(rng.integers(2))
        if bad:
            scores[int(rng.integers(rows)), int(rng.integers(n))] = float("nan")
        before = bits(x)
        res = imoe.compact_(x, scores, n // 2, mode="move")
        if bad:
            with pytest.raises(ValueError, match="NaN"):
                imoe.check_errors(x)
            np.testing.assert_array_equal(bits(x), before, err_msg=f"call {i}")
        else:
            imoe.check_errors(x)
            ref = reference_indices(reference_kept(scores, n // 2), n, n // 2)
            np.testing.assert_array_equal(to_numpy(res.indices), ref, err_msg=f"call {i}")


@pytest.mark.parametrize("case", ["duplicate_active", "range_active", "bad_target_map"])
def test_cuda_bad_indices_change_nothing(case, rng):
    x = cuda(make_data((2, 64, 16), "float32", "torch", rng))
    before = bits(x)
    if case == "bad_target_map":
        tm = torch.arange(64, dtype=torch.int32, device="cuda").repeat(2, 1)
        tm[1, 3] = 5  # 3 -> 5 but 5 -> 5: not an involution
        imoe.apply_map_(x, target_map=tm, dim=1)
    else:
        active = torch.arange(10, device="cuda").repeat(2, 1)
        active[1, 9] = 3 if case == "duplicate_active" else 64
        imoe.compact_(x, active_indices=active, dim=1)
    with pytest.raises(ValueError):
        imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), before)


# apply_indices: small calls check and move in one launch (one block), larger
# ones in two; the shapes straddle the bounds (4,096 indices, a window of
# 65,536 slots past C', 256 KiB of rows moved, 16 buffers).
APPLY_SHAPES = [
    pytest.param(8, 64, 32, 128, 1, id="one-block-tiny"),
    pytest.param(1, 4096, 1024, 4, 1, id="one-block-long-row"),
    pytest.param(64, 64, 63, 4, 2, id="one-block-k-and-v"),
    pytest.param(8, 4096, 2048, 64, 1, id="two-launches-entries"),
    pytest.param(2, 70000, 100, 4, 1, id="two-launches-window"),
    pytest.param(16, 256, 64, 512, 1, id="two-launches-bytes"),
]


def _apply_case(rows, n, keep, row, nbuf, index_dtype, rng):
    xs = [make_data((rows, n, row), "float16", "torch", rng) for _ in range(nbuf)]
    scores = make_scores((rows, n), "float32", "torch", rng)
    idx = imoe.idempotent_map(scores, keep, index_dtype=index_dtype)
    return xs, idx


@pytest.mark.parametrize("rows,n,keep,row,nbuf", APPLY_SHAPES)
@pytest.mark.parametrize("mode", ["swap", "move"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_cuda_apply_indices_equals_the_cpu(rows, n, keep, row, nbuf, mode, index_dtype, rng):
    xs, idx = _apply_case(rows, n, keep, row, nbuf, index_dtype, rng)
    gpu = [cuda(x) for x in xs]
    ref = [x.clone() for x in xs]
    imoe.apply_map_(ref if nbuf > 1 else ref[0], idx, mode=mode)
    views = imoe.apply_map_(gpu if nbuf > 1 else gpu[0], cuda(idx), mode=mode)
    imoe.check_errors(gpu[0])
    for g, r in zip(gpu, ref):
        np.testing.assert_array_equal(bits(g), bits(r))
    first = views[0] if nbuf > 1 else views
    assert tuple(first.shape) == (rows, keep, row) and first.data_ptr() == gpu[0].data_ptr()


@pytest.mark.parametrize("rows,n,keep,row,nbuf", APPLY_SHAPES)
@pytest.mark.parametrize("bad", ["duplicate", "range", "below_capacity"])
def test_cuda_apply_indices_bad_last_row_changes_nothing(rows, n, keep, row, nbuf, bad, rng):
    """A bad entry in the last row: the call records the error and no row of
    any buffer moves (the one-block path checks every row first)."""
    xs, idx = _apply_case(rows, n, keep, row, nbuf, "int64", rng)
    if bad == "duplicate":
        idx[-1, 0] = idx[-1, 1] = n - 1
    elif bad == "range":
        idx[-1, 0] = n
    else:
        idx[-1, 0] = 1  # below C' and not its own slot
    gpu = [cuda(x) for x in xs]
    before = [bits(g) for g in gpu]
    imoe.apply_map_(gpu if nbuf > 1 else gpu[0], cuda(idx), mode="swap")
    with pytest.raises(ValueError):
        imoe.check_errors(gpu[0])
    for g, b in zip(gpu, before):
        np.testing.assert_array_equal(bits(g), b)


@pytest.mark.parametrize("rows,n", [(8, 4096), (2, 65536)])
def test_cuda_two_streams_at_once(rows, n, rng):
    """Two compactions in flight on two streams, each on its own buffers (and,
    for long rows, its own slot of module memory)."""
    xs = [cuda(make_data((rows, n, 256), "float16", "torch", rng)) for _ in range(2)]
    ss = [cuda(make_scores((rows, n), "float32", "torch", rng, ties=False)) for _ in range(2)]
    befores = [bits(x) for x in xs]
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    results = []
    for x, s, stream in zip(xs, ss, streams):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(5_000_000)
            results.append(imoe.compact_(x, s, 1000))
    torch.cuda.synchronize()
    for x, s, before, res in zip(xs, ss, befores, results):
        ref = reference_indices(reference_kept(s, 1000), n, 1000)
        np.testing.assert_array_equal(to_numpy(res.indices), ref)
        np.testing.assert_array_equal(bits(x), expected_after(before, 1, ref, "swap"))


def test_cuda_side_stream(rng):
    """Work runs on the caller's current stream, ordered after earlier work on it."""
    src = cuda(make_data((8, 4096, 256), "float16", "torch", rng))
    scores = cuda(make_scores((8, 4096), "float32", "torch", rng, ties=False))
    expected_src = bits(src)
    stream = torch.cuda.Stream()
    x = torch.empty_like(src)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # keep the stream busy so that a wrong stream shows
        x.copy_(src)
        res = imoe.compact_(x, scores, 1024)
    stream.synchronize()
    ref = reference_indices(reference_kept(scores, 1024), 4096, 1024)
    np.testing.assert_array_equal(to_numpy(res.indices), ref)
    np.testing.assert_array_equal(bits(x), expected_after(expected_src, 1, ref, "swap"))


def test_cuda_work_is_ordered_before_later_work_on_the_stream(rng):
    """The default stream is kept busy; on a side stream, work enqueued after
    the compaction must see it done. It would not if the kernels ran on the
    default stream (or any stream but the caller's)."""
    x = cuda(make_data((8, 4096, 256), "float16", "torch", rng))
    scores = cuda(make_scores((8, 4096), "float32", "torch", rng, ties=False))
    before = bits(x)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of work on the default stream
    with torch.cuda.stream(side):
        res = imoe.compact_(x, scores, 1024)
        seen = x.clone()
    torch.cuda.synchronize()
    ref = reference_indices(reference_kept(scores, 1024), 4096, 1024)
    np.testing.assert_array_equal(to_numpy(res.indices), ref)
    np.testing.assert_array_equal(bits(seen), expected_after(before, 1, ref, "swap"))


def test_cuda_allocates_nothing_with_out_indices(rng):
    x = cuda(make_data((8, 4096, 1024), "float16", "torch", rng))
    scores = cuda(make_scores((8, 4096), "float32", "torch", rng))
    out = torch.empty((8, 2048), dtype=torch.int32, device="cuda")
    imoe.compact_(x, scores, 2048, out_indices=out)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    imoe.compact_(x, scores, 2048, out_indices=out)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved


def captured(call):
    """`call` warmed up once on a side stream, then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def test_cuda_graph_replays_nan_verdicts(rng):
    """A captured call keeps its call slot on every replay: each replay's NaN
    verdict is its own (clean, NaN, NaN, clean, ...), whatever the one before."""
    x = cuda(make_data((8, 2048, 64), "float16", "torch", rng))
    scores = cuda(make_scores((8, 2048), "float32", "torch", rng, ties=False))
    out = torch.empty((8, 512), dtype=torch.int64, device="cuda")
    graph = captured(lambda: imoe.compact_(x, scores, 512, out_indices=out, mode="move"))
    imoe.check_errors(x)  # the warm-up's clean call recorded nothing
    for step, nan in enumerate([False, True, True, False, True, False, False, True]):
        fresh = cuda(make_data((8, 2048, 64), "float16", "torch", rng))
        x.copy_(fresh)
        scores.copy_(cuda(make_scores((8, 2048), "float32", "torch", rng, ties=False)))
        if nan:
            scores[step % 8, (step * 997) % 2048] = float("nan")
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        if nan:
            with pytest.raises(ValueError, match="NaN"):
                imoe.check_errors(x)
            np.testing.assert_array_equal(bits(x), bits(fresh), err_msg=f"replay {step}")
            assert bool((out == -1).all()), f"replay {step}"
        else:
            imoe.check_errors(x)
            ref = reference_indices(reference_kept(scores, 512), 2048, 512)
            np.testing.assert_array_equal(to_numpy(out), ref, err_msg=f"replay {step}")
            np.testing.assert_array_equal(bits(x), expected_after(bits(fresh), 1, ref, "move"))


def test_cuda_graph_capture(rng):
    x = cuda(make_data((8, 2048, 64), "float16", "torch", rng))
    scores = cuda(make_scores((8, 2048), "float32", "torch", rng, ties=False))
    out = torch.empty((8, 512), dtype=torch.int64, device="cuda")
    graph = captured(lambda: imoe.compact_(x, scores, 512, out_indices=out))
    for _ in range(2):
        fresh = cuda(make_data((8, 2048, 64), "float16", "torch", rng))
        x.copy_(fresh)
        scores.copy_(cuda(make_scores((8, 2048), "float32", "torch", rng, ties=False)))
        before = bits(fresh)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_indices(reference_kept(scores, 512), 2048, 512)
        np.testing.assert_array_equal(to_numpy(out), ref)
        np.testing.assert_array_equal(bits(x), expected_after(before, 1, ref, "swap"))
