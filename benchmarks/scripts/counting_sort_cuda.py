"""Time the dispatcher's first counting sort (one-hot [S, K] + cumsum over
dim 0, kept here as `outer_axis`) against a transposed one-hot ([K, S],
cumsum over the last dim), the library's `counting_sort` (that layout, in
int32) and a stable torch.sort, at the sizes of the expert-parallel
benchmark; check that they give equal perms."""
import statistics

import torch
from imoe_bench.internals import counting_sort


def outer_axis(keys, num_keys):
    n = keys.numel()
    onehot = torch.zeros(n, num_keys, dtype=torch.int64, device=keys.device)
    onehot.scatter_(1, keys.view(-1, 1), 1)
    rank = onehot.cumsum(0)  # where set: 1 + the element's position among its key's elements
    counts = rank[-1] if n else torch.zeros(num_keys, dtype=torch.int64, device=keys.device)
    first_row = counts.cumsum(0) - counts - 1
    dest = (rank + first_row).gather(1, keys.view(-1, 1)).view(-1)
    perm = torch.empty_like(dest).scatter_(0, dest, torch.arange(n, device=keys.device))
    return perm, dest


def library(keys, num_keys):
    perm, dest, _ = counting_sort(keys, num_keys)
    return perm, dest


def transposed(keys, num_keys):
    n = keys.numel()
    onehot = torch.zeros(num_keys, n, dtype=torch.int64, device=keys.device)
    onehot.scatter_(0, keys.view(1, -1), 1)
    rank = onehot.cumsum(1)
    counts = rank[:, -1]
    first_row = counts.cumsum(0) - counts - 1
    dest = (rank + first_row[:, None]).gather(0, keys.view(1, -1)).view(-1)
    perm = torch.empty_like(dest).scatter_(0, dest, torch.arange(n, device=keys.device))
    return perm, dest


def stable_sort(keys, num_keys):
    perm = torch.sort(keys, stable=True).indices
    dest = torch.empty_like(perm).scatter_(0, perm, torch.arange(keys.numel(), device=keys.device))
    return perm, dest


def timed(fn, keys, k, runs=20):
    for _ in range(3):
        fn(keys, k)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(keys, k)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(runs):
        s.record()
        fn(keys, k)
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out), peak


def same_perms(keys, k) -> bool:
    ref = outer_axis(keys, k)
    return all(torch.equal(ref[0], p.long()) and torch.equal(ref[1], d.long())
               for p, d in (f(keys, k) for f in (transposed, library, stable_sort)))


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in [(8192, 8), (32768, 8), (8192, 4), (32768, 256), (32768, 128), (131072, 256),
                 (131072, 128)]:
        keys = torch.randint(0, k, (n,), device="cuda", generator=g)
        row = [f"S={n:6d} K={k:3d} same={same_perms(keys, k)}"]
        for name, f in (("onehot[S,K].cumsum(0)", outer_axis), ("onehot[K,S].cumsum(1)", transposed),
                        ("sort(stable)", stable_sort), ("counting_sort", library)):
            ms, mib = timed(f, keys, k)
            row.append(f"{name} {ms:8.3f} ms {mib:7.1f} MiB")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
