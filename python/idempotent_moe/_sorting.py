"""A stable counting sort on the device, for the torch-side dispatchers: no
argsort and no host synchronisation."""

from __future__ import annotations

import torch


def counting_sort(keys: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable counting sort of keys [S] (integers in [0, num_keys)).

    Returns (perm, dest, counts): perm[r] is the element in sorted row r,
    dest[i] the sorted row of element i, counts[k] how many keys equal k
    (int64). A [num_keys, S] int32 one-hot and its running sum along S (each
    element's rank among its key's elements: a contiguous scan per key, fast
    on a GPU), the counts' cumulative sum, and a scatter.
    """
    n = keys.numel()
    keys = keys.reshape(-1).long()
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64, device=keys.device)
        return empty, empty, torch.zeros(num_keys, dtype=torch.int64, device=keys.device)
    onehot = torch.zeros(num_keys, n, dtype=torch.int32, device=keys.device)
    onehot.scatter_(0, keys.view(1, -1), 1)
    rank = onehot.cumsum(1, dtype=torch.int32)  # where set: 1 + the element's rank within its key
    del onehot
    counts = rank[:, -1].long()
    first_row = counts.cumsum(0) - counts - 1
    dest = rank.gather(0, keys.view(1, -1)).view(-1).long() + first_row[keys]
    perm = torch.empty_like(dest).scatter_(0, dest, torch.arange(n, device=keys.device))
    return perm, dest, counts


def check_distinct_per_row(index: torch.Tensor, name: str, *, below: int | None = None,
                           weights: torch.Tensor | None = None) -> None:
    """ValueError when a row of index [T, k] repeats a value (a token routed
    twice to one expert); with `below`, only values < below count (the
    others, expert-parallel sentinels, may repeat); with `weights` [T, k],
    only entries of nonzero weight count (an assignment of weight 0 adds
    nothing: LongCat-Flash's zero experts, mapped onto real ones). Reads the
    result on the host: call it only where that costs no device
    synchronisation (CPU tensors)."""
    if index.shape[0] and index.shape[1] > 1:
        if weights is not None:  # each weight-0 entry a value of its own, below every id
            own = -1 - torch.arange(index.shape[1], device=index.device, dtype=index.dtype)
            index = torch.where(weights == 0, own, index)
        ordered = index.sort(dim=1).values
        repeated = ordered[:, 1:] == ordered[:, :-1]
        if below is not None:
            repeated &= ordered[:, 1:] < below
        if bool(repeated.any()):
            raise ValueError(f"{name} repeats an expert within a token: each token's k experts "
                             "must be distinct (as torch.topk gives them)")
