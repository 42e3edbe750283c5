"""The permutation engine on CUDA: permute_, ungroup_, group_by_expert_ and
ordered apply/restore, bit for bit against the CPU core and torch gathers;
bad input changes nothing and is raised by check_errors; the caller's stream;
no allocation when the workspace is passed. Skipped (see conftest.py) unless
torch sees a GPU and idempotent_moe has its CUDA build."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import bits, make_data, torch

pytestmark = pytest.mark.gpu


def cpu_permute(x, perm, dim, inverse=False):
    """The CPU core's result, as bits."""
    xc = x.cpu().clone()
    imoe.permute_(xc, perm.cpu(), dim=dim, inverse=inverse)
    return bits(xc)


def torch_gather(x, perm, dim, inverse=False):
    """torch's answer: index_select for a shared perm, gather for per-row perms."""
    if perm.dim() == 1:
        if inverse:
            out = torch.empty_like(x)
            out.index_copy_(dim, perm.long(), x)
            return out
        return x.index_select(dim, perm.long())
    idx = perm.long()
    if inverse:
        idx = torch.argsort(idx, dim=-1)
    shape = list(idx.shape) + [1] * (x.dim() - idx.dim())
    idx = idx.view(shape).expand(*idx.shape, *x.shape[idx.dim():])
    return torch.gather(x, dim, idx)


def random_perms(gen, rows, n, kind, device="cuda"):
    if kind == "random":
        return torch.stack([torch.randperm(n, generator=gen) for _ in range(rows)]).to(device)
    base = torch.arange(n)
    if kind == "identity":
        p = base
    elif kind == "long_cycle":
        p = torch.roll(base, -1)
    elif kind == "two_cycles":
        p = base.clone()
        p[0 : n - n % 2 : 2], p[1 : n - n % 2 : 2] = base[1 : n - n % 2 : 2], base[0 : n - n % 2 : 2]
    elif kind == "reverse":
        p = base.flip(0)
    else:
        raise AssertionError(kind)
    return p.repeat(rows, 1).to(device)


@pytest.mark.parametrize("dtype", ["uint8", "float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_permute_dtypes(dtype, inverse, shared, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    x = make_data((3, 777, 24), dtype, "torch", rng).cuda()
    perm = random_perms(gen, 1 if shared else 3, 777, "random")
    perm = perm[0] if shared else perm
    expected = torch_gather(x, perm, 1, inverse)
    ref = cpu_permute(x, perm, 1, inverse)
    assert imoe.permute_(x, perm, dim=1, inverse=inverse) is x
    imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), bits(expected))
    np.testing.assert_array_equal(bits(x), ref)


# (R, N, row elements of uint8/float32): rows of 1 B to 16 KiB, N 1 .. 65537, R 1 .. 64
SHAPES = [(1, 1, (1,)), (2, 2, (3,)), (64, 3, (5,)), (1, 1000, (1,)), (5, 4097, (130,)),
          (64, 513, (16,)), (1, 65537, (4,)), (2, 65536, (8,)), (1, 4096, (4096,)),
          (3, 2048, (16384,))]


@pytest.mark.parametrize("r,n,row", SHAPES)
@pytest.mark.parametrize("kind", ["random", "identity", "long_cycle", "two_cycles", "reverse"])
def test_permute_shapes_and_cycle_kinds(r, n, row, kind, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    dtype = "float32" if row[0] == 4096 else "uint8"
    x = make_data((r, n) + row, dtype, "torch", rng).cuda()
    index_dtypes = [torch.int64, torch.int32] if kind == "random" else [torch.int64]
    for index_dtype in index_dtypes:
        for shared in (True, False):
            perm = random_perms(gen, 1 if shared else r, n, kind).to(index_dtype)
            perm = perm[0] if shared else perm
            for inverse in (False, True):
                expected = torch_gather(x, perm, 1, inverse)
                imoe.permute_(x, perm, dim=1, inverse=inverse)
                imoe.check_errors(x)
                np.testing.assert_array_equal(bits(x), bits(expected))


def test_permute_then_inverse_restores_and_matches_cpu_core(rng):
    gen = torch.Generator().manual_seed(5)
    x = make_data((4, 3000, 40), "float16", "torch", rng).cuda()
    before = bits(x)
    perm = random_perms(gen, 4, 3000, "random")
    ref = cpu_permute(x, perm, 1)
    imoe.permute_(x, perm, dim=1)
    np.testing.assert_array_equal(bits(x), ref)
    imoe.ungroup_(x, perm, dim=1)  # the inverse permutation
    imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), before)


def test_permute_strided_views_and_many_buffers(rng):
    gen = torch.Generator().manual_seed(7)
    n = 1500
    # slot axis strided (every other slot of a bigger buffer), lead axis after it in memory
    big = make_data((2 * n, 6, 10), "float32", "torch", rng).cuda()
    x = big[::2].transpose(0, 1)  # [6, n, 10], slot stride 2 x 6 x 10 elements
    untouched = bits(big[1::2])
    y = make_data((6, n, 3), "int8", "torch", rng).cuda()
    extra = [make_data((6, n, 2 + i % 5), "uint8", "torch", rng).cuda() for i in range(17)]
    perm = random_perms(gen, 6, n, "random")
    expected = [torch_gather(t, perm, 1) for t in [x, y] + extra]
    imoe.permute_([x, y] + extra, perm, dim=1)
    imoe.check_errors(x)
    for got, want in zip([x, y] + extra, expected):
        np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(bits(big[1::2]), untouched)


SLICE_TABLES = 512  # bytes of row tables k_perm_slices keeps ahead of its stage


def slice_limit(width):
    """The most slots whose slices of `width` bytes k_perm_slices stages in one block."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    optin = getattr(props, "shared_memory_per_block_optin", 232448)
    return (optin - SLICE_TABLES) // width


@pytest.mark.parametrize("width,row,dtype", [(16, (4,), "float32"), (2, (3,), "float16"),
                                             (1, (), "int8")])
@pytest.mark.parametrize("over", [0, 1])
def test_permute_slices_at_and_over_the_shared_memory_limit(width, row, dtype, over, rng):
    """N = the most slots whose W-byte slices fit one block (k_perm_slices),
    then one more (the cycle engine): forward and inverse, shared and per-row."""
    gen = torch.Generator().manual_seed(17 + width)
    n = slice_limit(width) + over
    x = make_data((2, n) + row, dtype, "torch", rng).cuda()
    for shared in (True, False):
        perm = random_perms(gen, 1 if shared else 2, n, "random")
        perm = perm[0] if shared else perm
        for inverse in (False, True):
            ref = cpu_permute(x, perm, 1, inverse)
            imoe.permute_(x, perm, dim=1, inverse=inverse)
            imoe.check_errors(x)
            np.testing.assert_array_equal(bits(x), ref)


@pytest.mark.parametrize("r,n", [(37, 5), (3, 100), (2, 1000), (1, 4096)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_permute_slices_of_odd_rows_strided_views_and_lists(r, n, inverse, shared, rng):
    """k_perm_slices with slices of 16, 8, 2 and 1 bytes (rows of 3 fp16, of
    one int8 byte, of 1000 bytes, of 32 bytes from an odd address), lead axes
    that are not contiguous, units of several slices (the last chunk partial)
    and of several rows (the last group partial), K and V lists in one call,
    against the CPU core."""
    gen = torch.Generator().manual_seed(r * 10007 + n)
    big = make_data((2 * r, n, 16), "float32", "torch", rng).cuda()
    wide = make_data((r, n, 33), "uint8", "torch", rng).cuda()
    bufs = [make_data((r, n, 3), "float16", "torch", rng).cuda(),  # W = 2
            make_data((r, n), "int8", "torch", rng).cuda(),  # W = 1
            big[::2],  # lead stride 2 x n x 64 bytes
            wide[:, :, 1:],  # 32 bytes from an odd address: W = 1
            make_data((r, n, 500), "float16", "torch", rng).cuda(),  # 1000 bytes: W = 8
            make_data((n, r, 4), "float32", "torch", rng).cuda().transpose(0, 1)]  # lead stride 16 bytes
    untouched = [bits(big[1::2]), bits(wide[:, :, :1])]
    perm = random_perms(gen, 1 if shared else r, n, "random")
    perm = perm[0] if shared else perm
    refs = [cpu_permute(b, perm, 1, inverse) for b in bufs]
    keys, values = bufs[:3], bufs[3:]
    imoe.permute_(keys + values, perm, dim=1, inverse=inverse)
    imoe.check_errors(bufs[0])
    for got, want in zip(bufs, refs):
        np.testing.assert_array_equal(bits(got), want)
    np.testing.assert_array_equal(bits(big[1::2]), untouched[0])
    np.testing.assert_array_equal(bits(wide[:, :, :1]), untouched[1])

def chunk_edge_perms(n, gen):
    """Cycles placed around the rotation chunks (16 layout positions): runs of
    equal cycles of length 15, 16, 17, 33 and 3, 2-cycles shifted by one slot
    (every chunk boundary cuts one), cycles among fixed points, one long cycle
    through scattered slots, and a random permutation."""
    base = torch.arange(n)
    out = [torch.randperm(n, generator=gen)]
    for length in (15, 16, 17, 33, 3):
        p = base.clone()
        for s in range(0, n - length + 1, length):
            p[s : s + length] = torch.roll(base[s : s + length], 1)
        out.append(p)
    p = base.clone()
    m = (n - 1) - (n - 1) % 2
    p[1 : 1 + m : 2], p[2 : 2 + m : 2] = base[2 : 2 + m : 2], base[1 : 1 + m : 2]
    out.append(p)
    p = base.clone()
    picked = torch.randperm(n, generator=gen)[: max(2, n // 3)]
    p[picked] = picked[torch.roll(torch.arange(len(picked)), 1)]
    out.append(p)
    return out


@pytest.mark.parametrize("n", [2, 15, 16, 17, 33, 100, 1000, 4099])
def test_permute_cycles_across_rotation_chunks(n, rng):
    """One data pass rotates inside chunks of the cycle layout, a second fixes
    each chunk's first (forward) or last (inverse) slot: cycles shorter than,
    equal to and longer than a chunk, cut by chunk boundaries, in rows of
    aligned vectors, of misaligned bytes (head and tail) and of single bytes."""
    gen = torch.Generator().manual_seed(1000 + n)
    wide = make_data((2, n, 48), "uint8", "torch", rng).cuda()
    x = wide[:, :, 1:]  # 47 bytes a row from an odd address: 15 head bytes, 2 vectors
    y = make_data((2, n, 8), "float32", "torch", rng).cuda()
    z = make_data((2, n), "uint8", "torch", rng).cuda()
    before_first = bits(wide[:, :, :1])
    for p in chunk_edge_perms(n, gen):
        for shared in (True, False):
            perm = p.cuda() if shared else torch.stack([p, torch.randperm(n, generator=gen)]).cuda()
            for inverse in (False, True):
                want = [torch_gather(t, perm, 1, inverse) for t in (x, y, z)]
                imoe.permute_([x, y, z], perm, dim=1, inverse=inverse)
                imoe.check_errors(x)
                for got, w in zip((x, y, z), want):
                    np.testing.assert_array_equal(bits(got), bits(w))
    np.testing.assert_array_equal(bits(wide[:, :, :1]), before_first)


@pytest.mark.parametrize("shared", [True, False])
def test_permute_many_slots_scans_block_sums_in_a_kernel(shared, rng):
    """More than 2048 x 256 slots of permutation: the cycle bases come from a
    separate scan of the block sums."""
    gen = torch.Generator().manual_seed(11)
    r, n = (1, 600_001) if shared else (9, 60_013)
    x = make_data((3, n, 2) if shared else (r, n, 2), "uint8", "torch", rng).cuda()
    for kind in ("random", "long_cycle", "two_cycles"):
        perm = random_perms(gen, r, n, kind)
        perm = perm[0] if shared else perm
        for inverse in (False, True):
            want = torch_gather(x, perm, 1, inverse)
            imoe.permute_(x, perm, dim=1, inverse=inverse)
            imoe.check_errors(x)
            np.testing.assert_array_equal(bits(x), bits(want))


@pytest.mark.parametrize("case", ["range", "negative", "repeat", "range_and_repeat", "shared_repeat"])
def test_permute_bad_perm_changes_nothing(case, rng):
    x = make_data((3, 300, 8), "float32", "torch", rng).cuda()
    y = make_data((3, 300, 2), "uint8", "torch", rng).cuda()
    before = [bits(x), bits(y)]
    perm = torch.stack([torch.randperm(300) for _ in range(3)]).cuda()
    if case == "range":
        perm[2, 299] = 300
    elif case == "negative":
        perm[0, 5] = -1
    elif case == "repeat":
        perm[1, 7] = perm[1, 8]
    elif case == "range_and_repeat":
        perm[1, 7] = perm[1, 8]
        perm[1, 200] = 1000
    else:
        perm = perm[0].clone()
        perm[3] = perm[4]
    imoe.permute_([x, y], perm, dim=1)
    expected = "INDEX_RANGE" if case in ("range", "negative", "range_and_repeat") else "BAD_MAP"
    with pytest.raises(ValueError, match=expected):
        imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), before[0])
    np.testing.assert_array_equal(bits(y), before[1])
    # a valid call right after the failed one works
    good = torch.stack([torch.randperm(300) for _ in range(3)]).cuda()
    want = torch_gather(x, good, 1)
    imoe.permute_([x, y], good, dim=1)
    imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), bits(want))


def test_permute_workspace_checks_and_zero_allocation(rng):
    x = make_data((8, 4096, 256), "bfloat16", "torch", rng).cuda()
    perm = torch.randperm(4096, device="cuda")
    elems = imoe.plan_workspace_elems("permute", 1, 4096, cuda=True)
    assert elems == 6 * 4096
    assert imoe.plan_workspace_elems("group", 8, 4096, cuda=True) == 7 * 8 * 4096
    assert imoe.plan_workspace_elems("permute", 1, 4096, cuda=False) == 4096
    with pytest.raises(ValueError, match="workspace"):
        imoe.permute_(x, perm, workspace=torch.empty(elems - 1, dtype=torch.int32, device="cuda"))
    ws = torch.empty(elems, dtype=torch.int32, device="cuda")
    expected = x.index_select(1, perm)
    imoe.permute_(x, perm, workspace=ws)  # warm-up
    imoe.permute_(x, perm, workspace=ws, inverse=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    imoe.permute_(x, perm, workspace=ws)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved
    np.testing.assert_array_equal(bits(x), bits(expected))


def test_permute_on_side_stream(rng):
    """Work runs on the caller's current stream, ordered after earlier work on it."""
    src = make_data((4, 4096, 128), "float16", "torch", rng).cuda()
    perm = torch.randperm(4096, device="cuda")
    want = bits(src.index_select(1, perm))
    stream = torch.cuda.Stream()
    x = torch.empty_like(src)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # a wrong stream would see the copy unfinished
        x.copy_(src)
        imoe.permute_(x, perm)
        seen = x.clone()
    stream.synchronize()
    np.testing.assert_array_equal(bits(seen), want)


@pytest.mark.parametrize("experts,t,r", [(1, 100, 1), (8, 4096, 1), (8, 1000, 3), (64, 5000, 2),
                                         (1000, 3000, 1), (1024, 2049, 2), (3, 1, 1), (5, 0, 2)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_group_by_expert_matches_cpu(experts, t, r, index_dtype, rng):
    x = make_data((r, t, 12), "bfloat16", "torch", rng).cuda()
    w = make_data((r, t), "float32", "torch", rng).cuda()
    ids = torch.from_numpy(rng.integers(0, experts, size=(r, t))).to(index_dtype).cuda()
    xc, wc = x.cpu().clone(), w.cpu().clone()
    ref = imoe.group_by_expert_([xc, wc], ids.cpu(), experts, dim=1)
    before = bits(x)
    got = imoe.group_by_expert_([x, w], ids, experts, dim=1, index_dtype="int32")
    imoe.check_errors(x)
    np.testing.assert_array_equal(got.offsets.cpu().numpy(), ref.offsets.numpy())
    np.testing.assert_array_equal(got.perm.cpu().numpy(), ref.perm.numpy())
    np.testing.assert_array_equal(bits(x), bits(xc))
    np.testing.assert_array_equal(bits(w), bits(wc))
    if t:  # torch: a stable argsort of the ids gives the same permutation
        order = torch.sort(ids.long(), dim=1, stable=True).indices
        np.testing.assert_array_equal(got.perm.long().cpu().numpy(), order.cpu().numpy())
    imoe.ungroup_(x, got.perm, dim=1)
    imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), before)


def test_group_by_expert_bad_ids_change_nothing(rng):
    x = make_data((2, 500, 16), "float16", "torch", rng).cuda()
    ids = torch.from_numpy(rng.integers(0, 8, size=(2, 500))).cuda()
    ids[1, 499] = 8
    offsets = torch.full((2, 8), -7, dtype=torch.int64, device="cuda")
    perm = torch.full((2, 500), -7, dtype=torch.int64, device="cuda")
    before = bits(x)
    imoe.group_by_expert_(x, ids, 8, dim=1, out_offsets=offsets, out_perm=perm)
    with pytest.raises(ValueError, match="INDEX_RANGE"):
        imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), before)
    assert (offsets == -7).all() and (perm == -7).all()
    with pytest.raises(NotImplementedError, match="at most 1024 experts"):
        imoe.group_by_expert_(x, ids % 8, 2000, dim=1)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("mode", ["swap", "move"])
def test_ordered_apply_and_restore_match_cpu(shared, mode, rng):
    n, kept, r = 2000, 700, 4
    x = make_data((r, n, 20), "float32", "torch", rng).cuda()
    before = bits(x)
    if shared:
        idx = torch.from_numpy(rng.permutation(n)[:kept]).cuda()
    else:
        idx = torch.from_numpy(np.stack([rng.permutation(n)[:kept] for _ in range(r)])).cuda()
    xc = x.cpu().clone()
    imoe.apply_map_(xc, idx.cpu(), dim=1, order="stable", mode=mode)
    view = imoe.apply_map_(x, idx, dim=1, order="stable", mode=mode)
    imoe.check_errors(x)
    assert view.shape[1] == kept
    if mode == "swap":
        np.testing.assert_array_equal(bits(x), bits(xc))
        imoe.restore_(x, idx, dim=1, order="score")
        imoe.check_errors(x)
        np.testing.assert_array_equal(bits(x), before)
    else:  # only [0, C') is specified in move mode
        np.testing.assert_array_equal(bits(x[:, :kept]), bits(xc[:, :kept]))


@pytest.mark.parametrize("case", ["repeat", "range"])
def test_ordered_bad_indices_change_nothing(case, rng):
    x = make_data((2, 100, 4), "float32", "torch", rng).cuda()
    before = bits(x)
    idx = torch.tensor([[0, 5, 6], [1, 2, 3]], device="cuda")
    idx[0, 2] = 5 if case == "repeat" else 100
    imoe.restore_(x, idx, dim=1, order="stable")
    with pytest.raises(ValueError, match="BAD_MAP" if case == "repeat" else "INDEX_RANGE"):
        imoe.check_errors(x)
    np.testing.assert_array_equal(bits(x), before)
