"""Aliasing is part of validation: an argument a call reads that shares memory
with one it writes (or two written ones that share a byte) is refused with a
ValueError naming both, and every byte of every array is left as it was.
The two layouts that are well defined are accepted: scores that are one of
the buffers slot for slot, and buffers interleaved without sharing a byte.
Empty inputs return at once, whatever their lead shape.

Cases repeat a little on purpose: each is one aliasing class spelled out."""

from __future__ import annotations

import time

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import assert_unchanged, snapshot
from idempotent_moe.paged import apply_paged_map_

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def both(*names):
    return "(?s)^" + "".join(f"(?=.*{n})" for n in names)


@case
def indices_inside_the_buffer():
    """The issue's example: a map read from memory the move rewrites."""
    x = np.zeros((8, 2), np.int64)
    idx = x.reshape(-1)[:4]
    idx[:] = [4, 1, 2, 3]
    x[4, 1] = 10**12
    return (lambda: imoe.apply_map_(x, idx, dim=0)), [x], both("indices", "buffers")


@case
def restore_indices_inside_the_buffer():
    x = np.zeros((8, 2), np.int64)
    idx = x.reshape(-1)[:4]
    idx[:] = [4, 1, 2, 3]
    return (lambda: imoe.restore_(x, idx, dim=0)), [x], both("indices", "buffers")


@case
def target_map_inside_the_buffer():
    x = np.zeros((3, 8, 2), np.int32)
    tm = x[:, :, 0]
    tm[:] = np.arange(8)
    return (lambda: imoe.apply_map_(x, target_map=tm, dim=1)), [x], both("target_map", "buffers")


@case
def out_indices_over_the_scores():
    s = np.random.default_rng(0).random((4, 16)).astype(np.float32)
    x = np.zeros((4, 16, 3), np.float32)
    out = s.view(np.int32)[:, :4]  # the first 4 columns of the scores' memory
    return (lambda: imoe.compact_(x, s, 4, out_indices=out)), [x, s], both("scores", "out_indices")


@case
def out_indices_over_the_buffer():
    x = np.zeros((4, 16, 2), np.int64)
    s = np.random.default_rng(1).random((4, 16)).astype(np.float32)
    out = x[:, :4, 0]
    return (lambda: imoe.compact_(x, s, 4, out_indices=out)), [x, s], both("out_indices", "buffers")


@case
def active_indices_inside_the_buffer():
    x = np.zeros((16, 2), np.int64)
    act = x[:, 0][:4]
    act[:] = [15, 3, 7, 1]
    return (lambda: imoe.compact_(x, active_indices=act, dim=0)), [x], both("active_indices", "buffers")


@case
def out_target_map_over_out_indices():
    s = np.random.default_rng(2).random((2, 10)).astype(np.float32)
    store = np.zeros(64, np.int32)
    out = store[:8].reshape(2, 4)
    tm = store[4:24].reshape(2, 10)
    return (lambda: imoe.idempotent_map(s, 4, form="both", out_indices=out, out_target_map=tm)), \
        [s, store], both("out_indices", "out_target_map")


@case
def two_buffers_sharing_bytes():
    x = np.zeros((4, 16, 4), np.float32)
    s = np.random.default_rng(3).random((4, 16)).astype(np.float32)
    return (lambda: imoe.compact_([x[..., :3], x[..., 2:]], s, 4)), [x, s], \
        both(r"buffers\[0\]", r"buffers\[1\]", "overlap")


@case
def perm_inside_the_buffer():
    x = np.zeros((8, 3), np.int64)
    perm = x[:, 0]
    perm[:] = np.arange(8)[::-1]
    return (lambda: imoe.permute_(x, perm, dim=0)), [x], both("perm", "buffers")


@case
def workspace_over_expert_ids():
    ids = np.zeros(64, np.int32)
    ids[:16] = np.random.default_rng(4).integers(0, 4, 16)
    x = np.zeros((16, 2), np.float32)
    return (lambda: imoe.group_by_expert_(x, ids[:16], 4, workspace=ids)), [x, ids], \
        both("expert_ids", "workspace")


@case
def workspace_over_the_buffer():
    x = np.zeros((3, 8, 4), np.float32)
    ws = x.view(np.int32).reshape(-1)
    perm = np.arange(8)[::-1].copy()
    return (lambda: imoe.permute_(x, perm, dim=1, workspace=ws)), [x], both("workspace", "buffers")


@case
def paged_target_map_inside_the_pool():
    pool = np.zeros((4, 4, 2), np.int32)  # [num_blocks, block_size, row]
    tables = np.array([[0, 1], [2, 3]], np.int32)
    tm = pool.reshape(-1)[:16].reshape(2, 8)
    tm[:] = np.arange(8)
    return (lambda: apply_paged_map_(pool, tables, tm)), [pool, tables], both("target_map", "buffers")


@pytest.mark.parametrize("name", sorted(CASES))
def test_aliased_arguments_are_refused_and_nothing_changes(name):
    call, arrays, pattern = CASES[name]()
    snaps = snapshot(*arrays)
    with pytest.raises(ValueError, match=pattern):
        call()
    assert_unchanged(arrays, snaps)


# --------------------------------------------------------------------------- CUDA
# The same classes on CUDA tensors. Aliasing is a property of the arguments,
# not of their data, so a CUDA call refuses it at once (ValueError, nothing
# queued), as on the CPU; check_errors has nothing recorded afterwards.

GPU_CASES = {}


def gpu_case(fn):
    GPU_CASES[fn.__name__] = fn
    return fn


def _cuda():
    torch = pytest.importorskip("torch")
    return torch, torch.device("cuda")


@gpu_case
def cuda_indices_inside_the_buffer():
    torch, dev = _cuda()
    x = torch.zeros((8, 2), dtype=torch.int64, device=dev)
    idx = x.view(-1)[:4]
    idx.copy_(torch.tensor([4, 1, 2, 3]))
    x[4, 1] = 10**12
    return (lambda: imoe.apply_map_(x, idx, dim=0)), [x], both("indices", "buffers")


@gpu_case
def cuda_restore_indices_inside_the_buffer():
    torch, dev = _cuda()
    x = torch.zeros((8, 2), dtype=torch.int64, device=dev)
    idx = x.view(-1)[:4]
    idx.copy_(torch.tensor([4, 1, 2, 3]))
    return (lambda: imoe.restore_(x, idx, dim=0)), [x], both("indices", "buffers")


@gpu_case
def cuda_target_map_inside_the_buffer():
    torch, dev = _cuda()
    x = torch.zeros((3, 8, 2), dtype=torch.int32, device=dev)
    tm = x[:, :, 0]
    tm.copy_(torch.arange(8, dtype=torch.int32).expand(3, 8))
    return (lambda: imoe.apply_map_(x, target_map=tm, dim=1)), [x], both("target_map", "buffers")


@gpu_case
def cuda_out_indices_over_the_scores():
    torch, dev = _cuda()
    s = torch.rand((4, 16), generator=torch.Generator().manual_seed(0)).to(dev)
    x = torch.zeros((4, 16, 3), device=dev)
    out = s.view(torch.int32)[:, :4]  # the first 4 columns of the scores' memory
    return (lambda: imoe.compact_(x, s, 4, out_indices=out)), [x, s], both("scores", "out_indices")


@gpu_case
def cuda_out_indices_over_the_buffer():
    torch, dev = _cuda()
    x = torch.zeros((4, 16, 2), dtype=torch.int64, device=dev)
    s = torch.rand((4, 16), generator=torch.Generator().manual_seed(1)).to(dev)
    out = x[:, :4, 0]
    return (lambda: imoe.compact_(x, s, 4, out_indices=out)), [x, s], both("out_indices", "buffers")


@gpu_case
def cuda_active_indices_inside_the_buffer():
    torch, dev = _cuda()
    x = torch.zeros((16, 2), dtype=torch.int64, device=dev)
    act = x[:, 0][:4]
    act.copy_(torch.tensor([15, 3, 7, 1]))
    return (lambda: imoe.compact_(x, active_indices=act, dim=0)), [x], \
        both("active_indices", "buffers")


@gpu_case
def cuda_out_target_map_over_out_indices():
    torch, dev = _cuda()
    s = torch.rand((2, 10), generator=torch.Generator().manual_seed(2)).to(dev)
    store = torch.zeros(64, dtype=torch.int32, device=dev)
    out = store[:8].view(2, 4)
    tm = store[4:24].view(2, 10)
    return (lambda: imoe.idempotent_map(s, 4, form="both", out_indices=out, out_target_map=tm)), \
        [s, store], both("out_indices", "out_target_map")


@gpu_case
def cuda_two_buffers_sharing_bytes():
    torch, dev = _cuda()
    x = torch.zeros((4, 16, 4), device=dev)
    s = torch.rand((4, 16), generator=torch.Generator().manual_seed(3)).to(dev)
    return (lambda: imoe.compact_([x[..., :3], x[..., 2:]], s, 4)), [x, s], \
        both(r"buffers\[0\]", r"buffers\[1\]", "overlap")


@gpu_case
def cuda_perm_inside_the_buffer():
    torch, dev = _cuda()
    x = torch.zeros((8, 3), dtype=torch.int64, device=dev)
    perm = x[:, 0]
    perm.copy_(torch.arange(7, -1, -1))
    return (lambda: imoe.permute_(x, perm, dim=0)), [x], both("perm", "buffers")


@gpu_case
def cuda_workspace_over_expert_ids():
    torch, dev = _cuda()
    # 7 x rows x T = 112 int32: large enough for a CUDA plan workspace.
    ids = torch.zeros(256, dtype=torch.int32, device=dev)
    ids[:16] = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(4),
                             dtype=torch.int32).to(dev)
    x = torch.zeros((16, 2), device=dev)
    return (lambda: imoe.group_by_expert_(x, ids[:16], 4, workspace=ids)), [x, ids], \
        both("expert_ids", "workspace")


@gpu_case
def cuda_workspace_over_the_buffer():
    torch, dev = _cuda()
    x = torch.zeros((3, 8, 16), device=dev)  # 384 int32 >= 7 x 3 x 8
    ws = x.view(torch.int32).view(-1)
    perm = torch.arange(7, -1, -1, device=dev)
    return (lambda: imoe.permute_(x, perm, dim=1, workspace=ws)), [x], both("workspace", "buffers")


@gpu_case
def cuda_paged_target_map_inside_the_pool():
    torch, dev = _cuda()
    pool = torch.zeros((4, 4, 2), dtype=torch.int32, device=dev)  # [num_blocks, block_size, row]
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev)
    tm = pool.view(-1)[:16].view(2, 8)
    tm.copy_(torch.arange(8, dtype=torch.int32).expand(2, 8))
    return (lambda: apply_paged_map_(pool, tables, tm)), [pool, tables], \
        both("target_map", "buffers")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_cuda_aliased_arguments_are_refused_and_nothing_changes(name):
    torch, _ = _cuda()
    call, arrays, pattern = GPU_CASES[name]()
    torch.cuda.synchronize()
    snaps = snapshot(*arrays)
    with pytest.raises(ValueError, match=pattern):
        call()
    torch.cuda.synchronize()
    assert_unchanged(arrays, snaps)
    imoe.check_errors(arrays[0])  # nothing was queued, so nothing was recorded


@pytest.mark.gpu
def test_cuda_call_after_a_refused_one_works():
    torch, dev = _cuda()
    call, _, _ = GPU_CASES["cuda_out_indices_over_the_buffer"]()
    with pytest.raises(ValueError):
        call()
    s = torch.rand((4, 16), generator=torch.Generator().manual_seed(11)).to(dev)
    x = torch.arange(4 * 16, dtype=torch.float32, device=dev).view(4, 16, 1)
    res = imoe.compact_(x, s, 4)
    imoe.check_errors(x)
    want = torch.topk(s, 4, dim=1).indices.sort(dim=1).values
    assert torch.equal(res.indices.sort(dim=1).values, want)
    assert torch.equal(x[:, :4, 0].long() % 16, res.indices)


def test_scores_that_are_a_buffer_are_read_before_anything_moves():
    s = np.random.default_rng(5).random((3, 20)).astype(np.float32)
    x = np.random.default_rng(6).random((3, 20, 2)).astype(np.float32)
    want = np.sort(s, axis=1)[:, ::-1][:, :6]
    res = imoe.compact_([x, s], s, 6)
    np.testing.assert_array_equal(np.sort(res.values[1], axis=1)[:, ::-1], want)


def test_interleaved_halves_share_no_byte():
    kv = np.random.default_rng(7).random((2, 30, 8)).astype(np.float16)
    s = np.random.default_rng(8).random((2, 30)).astype(np.float32)
    imoe.compact_([kv[..., :4], kv[..., 4:]], s, 10)  # accepted: no byte in common


@pytest.mark.parametrize("lead", [(2**20, 2**20, 2**20), (2**62, 0)])
def test_empty_inputs_return_at_once_whatever_their_lead_shape(lead):
    torch = pytest.importorskip("torch")
    t0 = time.perf_counter()
    scores = torch.empty(*lead, 0)
    assert imoe.idempotent_map(scores, 3).shape == (*lead, 0)
    x = torch.empty(*lead, 0, 4)
    assert imoe.compact_(x, scores, 3).values.shape == (*lead, 0, 4)
    assert time.perf_counter() - t0 < 2.0


class _ShapeOnlyProducer:
    """A DLPack producer with a shape but no __getitem__: it cannot be sliced."""

    def __init__(self, array):
        self._array = array
        self.shape = array.shape

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**{k: v for k, v in kwargs.items() if k == "stream"})

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_a_producer_that_cannot_be_sliced_is_compacted_and_returned_whole():
    """compact_ used to move the data, then fail to narrow such a buffer and
    raise: the move-mode indices were lost. Now nothing can raise after the
    write, and the buffer itself comes back."""
    data = np.random.default_rng(9).random((3, 12, 2)).astype(np.float32)
    scores = np.random.default_rng(10).random((3, 12)).astype(np.float32)
    producer = _ShapeOnlyProducer(data)
    res = imoe.compact_(producer, scores, 4, mode="move")
    assert res.values is producer
    want = np.sort(scores, axis=1)[:, ::-1][:, :4]
    got = np.take_along_axis(scores, np.asarray(res.indices), axis=1)
    np.testing.assert_array_equal(np.sort(got, axis=1)[:, ::-1], want)
