"""The device counting sort shared by the MoE dispatch and expert parallelism
(idempotent_moe._sorting), against torch's stable sort."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from idempotent_moe import _tracing  # noqa: E402
from idempotent_moe._sorting import check_distinct_per_row, counting_sort  # noqa: E402


@pytest.mark.parametrize("n,num_keys,seed", [(1, 1, 0), (7, 3, 1), (1000, 8, 2), (4096, 256, 3), (513, 1, 4)])
def test_counting_sort_equals_a_stable_sort(n, num_keys, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, num_keys, (n,), generator=g)
    perm, dest, counts = counting_sort(keys, num_keys)
    expected = torch.sort(keys, stable=True).indices
    assert torch.equal(perm, expected)
    assert torch.equal(dest[perm], torch.arange(n))  # dest is perm's inverse
    assert torch.equal(counts, torch.bincount(keys, minlength=num_keys))
    assert perm.dtype == dest.dtype == counts.dtype == torch.int64


def test_counting_sort_with_absent_keys_and_no_keys():
    keys = torch.tensor([5, 0, 5, 5, 2, 0], dtype=torch.int32)
    perm, dest, counts = counting_sort(keys, 7)
    assert perm.tolist() == [1, 5, 4, 0, 2, 3]
    assert counts.tolist() == [2, 0, 1, 0, 0, 3, 0]
    perm, dest, counts = counting_sort(torch.empty(0, dtype=torch.int64), 3)
    assert perm.numel() == dest.numel() == 0 and counts.tolist() == [0, 0, 0]


def test_distinct_per_row_below_lets_sentinels_repeat():
    index = torch.tensor([[1, 4], [4, 4], [0, 2]])
    with pytest.raises(ValueError, match="repeats an expert"):
        check_distinct_per_row(index, "ids")
    check_distinct_per_row(index, "ids", below=4)  # 4 is a sentinel: may repeat
    with pytest.raises(ValueError, match="ids repeats"):
        check_distinct_per_row(torch.tensor([[1, 1], [4, 4]]), "ids", below=4)


def test_compiling_is_true_only_while_dynamo_traces():
    seen = []

    def probe(x):
        seen.append(_tracing.compiling())
        return x + 1

    assert not _tracing.compiling()
    torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(2))
    assert seen == [True]
