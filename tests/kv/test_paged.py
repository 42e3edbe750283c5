"""Paged KV caches: compaction through block tables, checked against a gather
reference (each sequence's logical slots read through its table) over random
tables, geometries, dtypes, selections and modes; the freed blocks; bad input
that must leave the pool as it was."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import (
    FRAMEWORKS,
    bits,
    expected_after,
    make_data,
    reference_indices,
    reference_kept,
    requires_torch,
    to_framework,
    to_numpy,
    torch,
)
from idempotent_moe.paged import (
    PagedCompaction,
    apply_paged_map_,
    compact_paged_,
    paged_target_map,
)


def random_tables(rng, lens, block_size, num_blocks, extra_entries=2, pad=-1):
    """Disjoint random blocks for each sequence, padded with `pad` past its last block."""
    need = [-(-n // block_size) for n in lens]
    max_blocks = max(need) + extra_entries
    assert sum(need) <= num_blocks
    perm = rng.permutation(num_blocks)
    tables = np.full((len(lens), max_blocks), pad, dtype=np.int64)
    used = 0
    for s, k in enumerate(need):
        tables[s, :k] = perm[used:used + k]
        used += k
    return tables


def logical(pool_bits, table, n, block_size, layout):
    """The sequence's logical slots [n, rest...] read through its table (a gather)."""
    x = np.arange(n)
    if layout == "HND":
        return pool_bits[table[x // block_size], :, x % block_size]
    return pool_bits[table[x // block_size], x % block_size]


def pool_shape(num_blocks, block_size, heads, dim, layout):
    if heads is None:
        return (num_blocks, block_size, dim)
    if layout == "HND":
        return (num_blocks, heads, block_size, dim)
    return (num_blocks, block_size, heads, dim)


def dyadic_scores(shape, framework, rng, dtype="float32"):
    """Scores whose sums and means are exact in every float dtype."""
    values = rng.integers(-16, 16, size=shape) / 4.0
    return to_framework(values.astype(np.float32), framework) if dtype == "float32" or \
        framework == "numpy" else torch.from_numpy(values).to(getattr(torch, dtype))


def expected_sequence(before_pools, table, n, new_n, block_size, layout, kept_rows, mode):
    """Per pool, the sequence's logical bits after the compaction ([n, ...])."""
    out = []
    for pb in before_pools:
        seq = logical(pb, table, n, block_size, layout)  # [n, heads, D] or [n, row]
        if len(kept_rows) == 1:  # one map for the whole slot
            idx = reference_indices(kept_rows, n, new_n)[0]
            out.append(expected_after(seq, 0, idx, mode))
        else:
            per_head = np.moveaxis(seq, 1, 0)  # [heads, n, D]
            idx = reference_indices(kept_rows, n, new_n)
            out.append(np.moveaxis(expected_after(per_head, 1, idx, mode), 0, 1))
    return out


def check_compaction(rng, framework, *, layout="NHD", heads=2, dims=(4, 6), dtype="float16",
                     block_size=4, lens=(13, 9, 16, 1, 0), capacity=6, score_heads="kv",
                     prefix=0, window=0, mode="move", head_reduce="mean", num_threads=None,
                     device="cpu", table_dtype=np.int64, host_tables=False):
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    pools = [make_data(pool_shape(num_blocks, block_size, heads, d, layout), dtype, framework, rng)
             for d in dims]
    tables = random_tables(rng, lens, block_size, num_blocks).astype(table_dtype)
    n_max = max(lens) + 3
    s_count = len(lens)
    if score_heads == "seq":
        scores = dyadic_scores((s_count, n_max), framework, rng)
    elif score_heads == "kv":
        scores = dyadic_scores((s_count, heads, n_max), framework, rng)
    else:  # per query head: 2 query heads per KV head
        scores = dyadic_scores((s_count, 2 * heads, n_max), framework, rng)
    caps = capacity if np.isscalar(capacity) else np.asarray(capacity)
    before = [bits(p) for p in pools]
    dev_tables = to_framework(tables, framework)
    if device == "cuda":
        pools = [p.cuda() for p in pools]
        scores = scores.cuda()
        dev_tables = dev_tables if host_tables else dev_tables.cuda()

    res = compact_paged_(pools, dev_tables, list(lens), capacity, scores,
                         layout=layout, protected_prefix=prefix, recent_window=window, mode=mode,
                         head_reduce=head_reduce, num_threads=num_threads)
    assert isinstance(res, PagedCompaction)
    s_np = to_numpy(scores).astype(np.float64)
    if score_heads == "q":
        s_np = s_np.reshape(s_count, heads, 2, n_max)
        s_np = s_np.mean(2) if head_reduce == "mean" else s_np.max(2)
    after = [bits(p) for p in pools]
    touched = np.zeros(num_blocks, dtype=bool)
    for s, n in enumerate(lens):
        c = int(caps if np.isscalar(caps) else caps[s])
        new_n = min(c, n)
        assert res.seq_lens[s] == new_n
        live = -(-n // block_size)
        assert res.freed_blocks[s] == tables[s, -(-new_n // block_size):live].tolist()
        touched[tables[s, :live]] = True
        rows = s_np[s, ..., :n] if n else s_np[s, ..., :0]
        if n == 0:
            continue
        if new_n < n:
            kept = reference_kept(rows, new_n, prefix, window)
        else:
            kept = [np.arange(n)] * (1 if rows.ndim == 1 else rows.shape[0])
        want = expected_sequence(before, tables[s], n, new_n, block_size, layout, kept, mode)
        for k, (a, w) in enumerate(zip(after, want)):
            got = logical(a, tables[s], n, block_size, layout)
            np.testing.assert_array_equal(got, w, err_msg=f"sequence {s}, pool {k}")
        tm = to_numpy(res.target_map)[s]
        idx = reference_indices(kept, n, new_n)
        np.testing.assert_array_equal(tm[..., :new_n].reshape(idx.shape), idx)
        np.testing.assert_array_equal(tm[..., n:], np.broadcast_to(np.arange(n, tm.shape[-1]),
                                                                   tm[..., n:].shape))
    for a, b in zip(after, before):  # blocks of no sequence are untouched
        np.testing.assert_array_equal(a[~touched], b[~touched])
    return res


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("mode", ["move", "swap"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("score_heads", ["seq", "kv", "q"])
def test_matches_gather_reference(framework, mode, layout, score_heads, rng):
    check_compaction(rng, framework, layout=layout, mode=mode, score_heads=score_heads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_dtypes_and_block_sizes(dtype, block_size, rng):
    framework = "torch" if torch is not None else "numpy"
    if framework == "numpy" and dtype == "bfloat16":
        pytest.skip("NumPy has no bfloat16")
    check_compaction(rng, framework, dtype=dtype, block_size=block_size, lens=(40, 17, 3, 33),
                     capacity=[12, 17, 3, 20], prefix=1, window=2, heads=3, dims=(8, 2))


@pytest.mark.parametrize("head_reduce", ["mean", "max"])
def test_query_head_scores_reduce_per_group(head_reduce, rng):
    check_compaction(rng, "numpy", score_heads="q", head_reduce=head_reduce, lens=(30, 25))


def test_latent_pool_without_heads(rng):
    check_compaction(rng, "numpy", heads=None, dims=(24,), score_heads="seq", lens=(20, 11, 7))


def test_many_sequences_and_threads(rng):
    lens = tuple(int(x) for x in rng.integers(0, 90, size=12))
    caps = [int(x) for x in rng.integers(1, 60, size=12)]
    res1 = check_compaction(np.random.default_rng(7), "numpy", lens=lens, capacity=caps,
                            num_threads=1, block_size=8, prefix=1, window=1)
    res4 = check_compaction(np.random.default_rng(7), "numpy", lens=lens, capacity=caps,
                            num_threads=4, block_size=8, prefix=1, window=1)
    np.testing.assert_array_equal(res1.target_map, res4.target_map)


@requires_torch
def test_swap_twice_restores_every_pool(rng):
    lens, bs = [21, 14], 4
    k = make_data((12, bs, 2, 8), "float16", "torch", rng)
    v = make_data((12, bs, 2, 8), "float16", "torch", rng)
    tables = torch.from_numpy(random_tables(rng, lens, bs, 12))
    before = [bits(k), bits(v)]
    res = compact_paged_([k, v], tables, lens, 5, torch.rand(2, 2, 21), mode="swap")
    assert not np.array_equal(bits(k), before[0])
    apply_paged_map_([k, v], tables, res.target_map, mode="swap")
    np.testing.assert_array_equal(bits(k), before[0])
    np.testing.assert_array_equal(bits(v), before[1])


def test_active_indices_per_sequence(rng):
    lens, bs = [19, 10], 4
    pool = make_data((10, bs, 2, 3), "float32", "numpy", rng)
    tables = random_tables(rng, lens, bs, 10)
    before = bits(pool)
    shared = np.sort(rng.choice(19, size=7, replace=False))
    per_head = np.stack([rng.choice(10, size=4, replace=False) for _ in range(2)])
    # one per-sequence list of shared indices, then per-head ones
    res = compact_paged_(pool, tables, lens, active_indices=[shared, list(range(10))])
    assert res.seq_lens == [7, 10] and res.freed_blocks == [tables[0, 2:5].tolist(), []]
    want = expected_after(logical(before, tables[0], 19, bs, "NHD"), 0,
                          reference_indices([shared], 19, 7)[0], "move")
    np.testing.assert_array_equal(logical(bits(pool), tables[0], 19, bs, "NHD"), want)
    before = bits(pool)
    res = compact_paged_(pool, tables, [7, 10], active_indices=[np.stack([np.arange(7)] * 2),
                                                                  per_head])
    assert res.seq_lens == [7, 4]
    kept = [np.sort(r) for r in per_head]
    seq = np.moveaxis(logical(before, tables[1], 10, bs, "NHD"), 1, 0)
    want = np.moveaxis(expected_after(seq, 1, reference_indices(kept, 10, 4), "move"), 0, 1)
    np.testing.assert_array_equal(logical(bits(pool), tables[1], 10, bs, "NHD"), want)


def test_paged_target_map_alone_matches_compact(rng):
    scores = dyadic_scores((3, 2, 30), "numpy", rng)
    tm = paged_target_map(4, [30, 12, 25], [10, 12, 3], scores, protected_prefix=2)
    assert tm.shape == (3, 2, 30) and tm.dtype == np.int32
    for s, (n, c) in enumerate([(30, 10), (12, 12), (25, 3)]):
        kept = reference_kept(scores[s, :, :n], min(c, n), 2) if c < n else [np.arange(n)] * 2
        idx = reference_indices(kept, n, min(c, n))
        np.testing.assert_array_equal(tm[s, :, : min(c, n)], idx)


# --------------------------------------------------------------------------- bad input


def _setup(rng, lens=(9, 6), bs=4, nb=8):
    pool = make_data((nb, bs, 2, 4), "float16", "numpy", rng)
    tables = random_tables(rng, list(lens), bs, nb)
    return pool, tables


def test_shared_prefix_block_is_refused(rng):
    pool, tables = _setup(rng)
    tables[1, 0] = tables[0, 0]  # a prefix-cached block, live in both sequences
    before = bits(pool)
    with pytest.raises(ValueError, match="shared"):
        compact_paged_(pool, tables, [9, 6], 2, dyadic_scores((2, 9), "numpy", rng))
    np.testing.assert_array_equal(bits(pool), before)


def test_duplicate_block_is_refused_by_the_core(rng):
    pool, tables = _setup(rng)
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    tm[0, [1, 8]] = [8, 1]
    tm[1, [0, 5]] = [5, 0]
    tables[1, 0] = tables[0, 0]
    before = bits(pool)
    with pytest.raises(ValueError, match="block .* is written through"):
        apply_paged_map_(pool, tables, tm)
    np.testing.assert_array_equal(bits(pool), before)


@pytest.mark.parametrize("block", [-3, 8, 1000])
def test_block_out_of_range_is_refused(block, rng):
    pool, tables = _setup(rng)
    tables[0, 2] = block
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    tm[0, [0, 8]] = [8, 0]  # slot 8 lives in entry 2
    before = bits(pool)
    with pytest.raises(ValueError, match="outside"):
        apply_paged_map_(pool, tables, tm)
    np.testing.assert_array_equal(bits(pool), before)


def test_not_an_involution_is_refused(rng):
    pool, tables = _setup(rng)
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    tm[1, 3] = 4
    before = bits(pool)
    with pytest.raises(ValueError, match="involution"):
        apply_paged_map_(pool, tables, tm)
    np.testing.assert_array_equal(bits(pool), before)


@pytest.mark.parametrize("lens,shape,nan_at,where", [
    # a sequence whose length is its own: its scores are selected alone
    ((9, 6, 9), (3, 9), (1, 4), "sequence 1, slot 4"),
    # consecutive sequences of one length, selected together
    ((6, 9, 9), (3, 9), (2, 7), "sequence 2, slot 7"),
    # sequences 0 and 2 gathered for one selection, per head
    ((9, 6, 9), (3, 2, 9), (2, 1, 3), "sequence 2, head 1, slot 3"),
    ((9, 6, 9), (3, 2, 9), (1, 0, 5), "sequence 1, head 0, slot 5"),
])
def test_nan_score_names_its_sequence_and_head(lens, shape, nan_at, where, rng):
    """The core numbers the rows of the scores it is given, which are the
    rows of the sequences selected together: the message names the sequence."""
    pool = make_data((12, 4, 2, 4), "float16", "numpy", rng)
    tables = random_tables(rng, list(lens), 4, 12, extra_entries=0)
    scores = dyadic_scores(shape, "numpy", rng)
    scores[nan_at] = np.nan
    before, scores_before = bits(pool), scores.copy()
    with pytest.raises(ValueError, match=f"^scores: {where} is NaN"):
        compact_paged_(pool, tables, list(lens), 4, scores)
    np.testing.assert_array_equal(bits(pool), before)
    np.testing.assert_array_equal(scores, scores_before)


def test_entries_past_a_sequence_are_never_read(rng):
    pool, tables = _setup(rng)
    tables[0, 3:] = 10**9  # garbage padding, as engines leave it
    before = bits(pool)
    res = compact_paged_(pool, tables, [9, 6], 4, dyadic_scores((2, 2, 9), "numpy", rng))
    assert res.seq_lens == [4, 4] and len(res.freed_blocks[0]) == 2
    assert not np.array_equal(bits(pool), before)


@pytest.mark.parametrize("case", [
    "tables_1d", "lens_count", "len_too_long", "scores_rows", "map_heads", "layout", "mode",
    "pool_shapes", "pool_3d_per_head", "capacity_count",
])
def test_bad_arguments(case, rng):
    pool, tables = _setup(rng)
    scores = dyadic_scores((2, 2, 9), "numpy", rng)
    other = make_data((8, 4, 2, 4), "float16", "numpy", rng)
    calls = {
        "tables_1d": lambda: compact_paged_(pool, tables[0], [9], 4, scores[:1]),
        "lens_count": lambda: compact_paged_(pool, tables, [9], 4, scores),
        "len_too_long": lambda: compact_paged_(pool, tables, [9, 100], 4, scores),
        "scores_rows": lambda: compact_paged_(pool, tables, [9, 6], 4, scores[:1]),
        "map_heads": lambda: apply_paged_map_(pool, tables, np.zeros((2, 3, 9), np.int32)),
        "layout": lambda: compact_paged_(pool, tables, [9, 6], 4, scores, layout="NDH"),
        "mode": lambda: compact_paged_(pool, tables, [9, 6], 4, scores, mode="gather"),
        "pool_shapes": lambda: compact_paged_([pool, other[:, :3]], tables, [9, 6], 4, scores),
        "pool_3d_per_head": lambda: apply_paged_map_(pool[:, :, 0], tables,
                                                     np.zeros((2, 2, 9), np.int32)),
        "capacity_count": lambda: compact_paged_(pool, tables, [9, 6], [4, 4, 4], scores),
    }
    before = bits(pool)
    with pytest.raises(ValueError):
        calls[case]()
    np.testing.assert_array_equal(bits(pool), before)


def test_binding_rejects_bad_axes_dtypes_and_modes(rng):
    from idempotent_moe._native import native

    pool, tables = _setup(rng)
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    before = bits(pool)
    c = native()
    with pytest.raises(ValueError, match="block axis"):
        c.paged_apply_target_map([pool], [0], [2], tables, tm, "move")
    with pytest.raises(ValueError, match="mode"):
        c.paged_apply_target_map([pool], [1], [2], tables, tm, "sweep")
    with pytest.raises(TypeError, match="mode"):
        c.paged_apply_target_map([pool], [1], [2], tables, tm, 1)
    with pytest.raises(TypeError, match="block_tables"):
        c.paged_apply_target_map([pool], [1], [2], tables.astype(np.float32), tm, "move")
    with pytest.raises(ValueError, match="exceeds max_blocks"):
        c.paged_apply_target_map([pool], [1], [2], tables[:, :1], tm, "move")
    with pytest.raises(BufferError, match="read-only"):
        ro = pool.copy()
        ro.setflags(write=False)
        c.paged_apply_target_map([ro], [1], [2], tables, tm, "move")
    np.testing.assert_array_equal(bits(pool), before)


# --------------------------------------------------------------------------- CUDA
# The same checks with pools, tables, scores and maps on the GPU: the kernels
# of cuda/imoe_paged.cu against the gather reference and the CPU core, bit for bit.


def _cuda_check(mode, dtype, block_size, layout="NHD", score_heads="kv", table_dtype=np.int64,
                lens=(40, 17, 3, 33, 0, 64), capacity=(12, 17, 3, 20, 5, 31), heads=3,
                dims=(64, 8), prefix=1, window=2, seed=0, host_tables=False):
    """Compacts on CUDA (check_compaction checks it against the gather
    reference) and the same problem on the CPU; the pools must agree bit for bit."""
    import idempotent_moe as imoe

    kw = dict(mode=mode, dtype=dtype, block_size=block_size, layout=layout, score_heads=score_heads,
              lens=lens, capacity=list(capacity), heads=heads, dims=dims, prefix=prefix,
              window=window, table_dtype=table_dtype)
    res = check_compaction(np.random.default_rng(seed), "torch", device="cuda",
                           host_tables=host_tables, **kw)
    imoe.check_errors(res.target_map)
    ref = check_compaction(np.random.default_rng(seed), "torch", **kw)
    np.testing.assert_array_equal(to_numpy(res.target_map), to_numpy(ref.target_map))
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["move", "swap"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_cuda_matches_gather_reference(mode, dtype, block_size):
    _cuda_check(mode, dtype, block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("score_heads", ["seq", "kv"])
@pytest.mark.parametrize("table_dtype", [np.int32, np.int64])
def test_cuda_layouts_and_map_forms(layout, score_heads, table_dtype):
    # dims 5 and 3 (x2 bytes): rows no 16-byte vector fits, head and tail bytes
    _cuda_check("swap", "float16", 16, layout=layout, score_heads=score_heads, table_dtype=table_dtype,
                dims=(5, 3), seed=3)


@pytest.mark.gpu
def test_cuda_pools_with_host_tables():
    # lens with equal (length, capacity) in non-consecutive sequences: one
    # gathered group beside consecutive ones
    _cuda_check("move", "bfloat16", 16, lens=(30, 12, 30, 30, 7), capacity=(9, 4, 9, 9, 3),
                host_tables=True, seed=9)


@pytest.mark.gpu
def test_cuda_many_sequences_long_rows():
    rng = np.random.default_rng(11)
    lens = tuple(int(x) for x in rng.integers(0, 700, size=24))
    caps = tuple(int(x) for x in rng.integers(1, 400, size=24))
    _cuda_check("move", "float16", 16, lens=lens, capacity=caps, heads=4, dims=(128, 128), seed=5)


def _cuda_setup(rng, lens=(9, 6), bs=4, nb=8):
    pool = make_data((nb, bs, 2, 4), "float16", "torch", rng).cuda()
    tables = random_tables(rng, list(lens), bs, nb)
    return pool, tables


def _expect_device_error(pool, tables, tm, match, mode="move"):
    import idempotent_moe as imoe

    before = bits(pool)
    apply_paged_map_(pool, torch.from_numpy(tables).cuda(), torch.from_numpy(tm).cuda(), mode=mode)
    with pytest.raises(ValueError, match=match):
        imoe.check_errors(pool)
    np.testing.assert_array_equal(bits(pool), before)
    imoe.check_errors(pool)  # taken: nothing left to raise


@pytest.mark.gpu
@pytest.mark.parametrize("block", [-3, 8, 1000])
def test_cuda_block_out_of_range_changes_nothing(block, rng):
    pool, tables = _cuda_setup(rng)
    tables[0, 2] = block
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    tm[0, [0, 8]] = [8, 0]  # slot 8 lives in entry 2
    _expect_device_error(pool, tables, tm, "INDEX_RANGE")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["move", "swap"])
def test_cuda_duplicate_block_changes_nothing(mode, rng):
    pool, tables = _cuda_setup(rng)
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    tm[0, [1, 8]] = [8, 1]
    tm[1, [0, 5]] = [5, 0]
    tables[1, 0] = tables[0, 0]
    _expect_device_error(pool, tables, tm, "INDEX_DUPLICATE", mode)


@pytest.mark.gpu
def test_cuda_shared_block_that_moves_nothing_is_fine(rng):
    # two entries name one block, but only one of them moves data: allowed
    pool, tables = _cuda_setup(rng)
    tables[1, 1] = tables[0, 0]
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    tm[0, [1, 8]] = [8, 1]
    cpu_pool = pool.cpu()
    apply_paged_map_(cpu_pool, torch.from_numpy(tables), torch.from_numpy(tm))
    apply_paged_map_(pool, torch.from_numpy(tables).cuda(), torch.from_numpy(tm).cuda())
    import idempotent_moe as imoe

    imoe.check_errors(pool)
    np.testing.assert_array_equal(bits(pool), bits(cpu_pool))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["range", "involution"])
def test_cuda_bad_map_changes_nothing(case, rng):
    pool, tables = _cuda_setup(rng)
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    if case == "range":
        tm[1, 3] = 9
        _expect_device_error(pool, tables, tm, "INDEX_RANGE")
    else:
        tm[1, 3] = 4
        _expect_device_error(pool, tables, tm, "BAD_MAP")


@pytest.mark.gpu
def test_cuda_error_precedence_matches_the_cpu(rng):
    # Sequence 0, row 0 moves a slot of an out-of-range block; sequence 1 has an
    # invalid map and sequence 0, row 1 a duplicate-free map: the CPU core
    # reports sequence 0's range error, and so must the device.
    pool, tables = _cuda_setup(rng)
    tables[0, 2] = 1000
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 2, 1))
    tm[0, 0, [0, 8]] = [8, 0]
    tm[1, 1, 3] = 4  # not an involution
    with pytest.raises(ValueError, match="outside"):
        apply_paged_map_(pool.cpu(), torch.from_numpy(tables), torch.from_numpy(tm))
    _expect_device_error(pool, tables, tm, "INDEX_RANGE")
    # the other way round: an invalid map in an earlier row than the block error
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 2, 1))
    tm[0, 0, 3] = 4
    tm[0, 1, [0, 8]] = [8, 0]
    with pytest.raises(ValueError, match="involution"):
        apply_paged_map_(pool.cpu(), torch.from_numpy(tables), torch.from_numpy(tm))
    _expect_device_error(pool, tables, tm, "BAD_MAP")


@pytest.mark.gpu
def test_cuda_valid_call_after_a_failed_one(rng):
    pool, tables = _cuda_setup(rng)
    bad = tables.copy()
    bad[0, 2] = 1000
    tm = np.tile(np.arange(9, dtype=np.int32), (2, 1))
    tm[0, [0, 8]] = [8, 0]
    _expect_device_error(pool, bad, tm, "INDEX_RANGE")
    cpu_pool = pool.cpu()
    apply_paged_map_(cpu_pool, torch.from_numpy(tables), torch.from_numpy(tm))
    apply_paged_map_(pool, torch.from_numpy(tables).cuda(), torch.from_numpy(tm).cuda())
    import idempotent_moe as imoe

    imoe.check_errors(pool)
    np.testing.assert_array_equal(bits(pool), bits(cpu_pool))


@pytest.mark.gpu
def test_cuda_non_default_stream_and_workspace(rng):
    import idempotent_moe as imoe
    from idempotent_moe.paged import paged_workspace_elems

    lens, bs, nb = [21, 14], 4, 12
    k = make_data((nb, bs, 2, 8), "float16", "torch", rng)
    v = make_data((nb, bs, 2, 8), "float16", "torch", rng)
    tables = torch.from_numpy(random_tables(rng, lens, bs, nb))
    scores = torch.rand(2, 2, 21)
    ref = compact_paged_([k.clone(), v.clone()], tables, lens, 5, scores, mode="swap")
    kc, vc = k.cuda(), v.cuda()
    expect = [k.clone(), v.clone()]
    apply_paged_map_(expect, tables, ref.target_map, mode="swap")
    stream = torch.cuda.Stream()
    tm = ref.target_map.cuda()
    tc = tables.cuda()
    ws = torch.full((paged_workspace_elems(nb, 2, tables.shape[1]),), 7, dtype=torch.int32,
                    device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        apply_paged_map_([kc, vc], tc, tm, mode="swap", workspace=ws)
        imoe.check_errors(kc)
    stream.synchronize()
    np.testing.assert_array_equal(bits(kc), bits(expect[0]))
    np.testing.assert_array_equal(bits(vc), bits(expect[1]))
    with pytest.raises(ValueError, match="workspace"):
        apply_paged_map_([kc, vc], tc, tm, workspace=ws[:10])


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_tables(rng):
    # the duplicate check keeps no state between calls: a captured call
    # replayed over different tables and maps checks and moves afresh
    import idempotent_moe as imoe

    lens, bs, nb = [9, 6], 4, 8
    pool = make_data((nb, bs, 2, 4), "float16", "torch", rng).cuda()
    tables = torch.from_numpy(random_tables(rng, lens, bs, nb)).cuda()
    tm = torch.arange(9, dtype=torch.int32).repeat(2, 1).cuda()
    ws = torch.empty(nb + 2 * tables.shape[1] + 512, dtype=torch.int32, device="cuda")
    apply_paged_map_(pool, tables, tm, mode="swap", workspace=ws)  # warm-up, outside capture
    imoe.check_errors(pool)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        apply_paged_map_(pool, tables, tm, mode="swap", workspace=ws)
    torch.cuda.synchronize()
    for step in range(3):
        t_np = random_tables(rng, lens, bs, nb)
        m_np = np.tile(np.arange(9, dtype=np.int32), (2, 1))
        m_np[0, [1, 8]] = [8, 1]
        m_np[1, [0, 5]] = [5, 0]
        if step == 1:
            t_np[1, 0] = t_np[0, 0]  # duplicate: this replay must change nothing
        expect = pool.cpu()
        if step != 1:
            apply_paged_map_(expect, torch.from_numpy(t_np), torch.from_numpy(m_np), mode="swap")
        tables.copy_(torch.from_numpy(t_np))
        tm.copy_(torch.from_numpy(m_np))
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        if step == 1:
            with pytest.raises(ValueError, match="INDEX_DUPLICATE"):
                imoe.check_errors(pool)
        else:
            imoe.check_errors(pool)
        np.testing.assert_array_equal(bits(pool), bits(expect))
