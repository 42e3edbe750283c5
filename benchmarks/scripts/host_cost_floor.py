"""What H1's compact_ and K/V calls are made of on this host: each piece of
the call timed alone, back to back (2,000 calls, no synchronisation; then
again with a synchronisation every 20 calls), five interleaved rounds,
median and minimum in us per call. Unlike H1 (bench/hostcost.py), the clock
stops after the last call's device work has drained; over 2,000 calls whose
device work is shorter than their host work that adds well under 0.1 us a
call.

The floor of a call that returns torch views is the core's call plus one
torch narrow per view; everything above it is the Python between them.

    python benchmarks/scripts/host_cost_floor.py --out imoe-results/host-cost-floor-cuda.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import idempotent_moe as imoe
import torch
from imoe_bench.internals import _arrays, _compaction, _tracing, native
from imoe_bench.runner import git_commit


def cases(dev: str) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, 128, generator=g).to(dev, torch.float16)
    s = torch.rand(8, 64, generator=g).to(dev)
    idx = torch.empty(8, 32, dtype=torch.int64, device=dev)
    y = torch.empty(1024, device=dev)
    k = torch.randn(1, 8, 256, 64, generator=g).to(dev, torch.float16)
    v = torch.randn(1, 8, 256, 64, generator=g).to(dev, torch.float16)
    kvs = torch.rand(1, 8, 256, generator=g).to(dev)
    kvi = torch.empty(1, 8, 128, dtype=torch.int64, device=dev)
    lib, st = native(), _arrays.dlpack_stream(x)
    common = dict(active_indices=None, protected_prefix=0, recent_window=0, nan="raise", order="inplace",
                  out_target_map=None, mode="swap", workspace=None, stream=st)

    def nothing(a, b, c, out_indices=None):
        return None

    return {
        "torch add_ [1024]": lambda: y.add_(1.0),
        "torch narrow": lambda: x.narrow(1, 0, 32),
        "an empty Python function": lambda: nothing(x, s, 32, out_indices=idx),
        "compiling()": lambda: _tracing.compiling(),
        "direct_axis()": lambda: _compaction.direct_axis(torch, x, s, 32, None, "inplace"),
        "dlpack_stream()": lambda: _arrays.dlpack_stream(x),
        "the core's call, a list, 1 thread": lambda: lib.compact(
            [x], [1], [1], scores=s, capacity=32, out_indices=idx, num_threads=1, **common),
        "the core's call, a tuple, 0 threads": lambda: lib.compact(
            (x,), (1,), (1,), scores=s, capacity=32, out_indices=idx, num_threads=0, **common),
        "compact_tensors()": lambda: _compaction.compact_tensors(torch, x, s, 32, 1, "swap", 0, 0, "raise",
                                                                 idx, None, "int64"),
        "compact_": lambda: imoe.compact_(x, s, 32, out_indices=idx),
        "compact_kv_cache_inplace": lambda: imoe.compact_kv_cache_inplace(k, v, kvs, 128, out_indices=kvi),
        "the core's call, K and V": lambda: lib.compact(
            (k, v), (2, 2), (1, 1), scores=kvs, capacity=128, out_indices=kvi, num_threads=0, **common),
    }


def per_call(fn, calls: int, sync_every: int | None) -> float:
    """us per call of `calls` calls, the device drained before and after
    (and every `sync_every` calls when given)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn()
        if sync_every and i % sync_every == sync_every - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    calls = cases("cuda")
    result = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "calls": args.calls, "rounds": args.rounds}
    for sync_every in (None, 20):
        samples = {name: [] for name in calls}
        for fn in calls.values():
            per_call(fn, 200, None)
        for _ in range(args.rounds):
            for name, fn in calls.items():
                samples[name].append(per_call(fn, args.calls, sync_every))
        key = f"sync_every_{sync_every}"
        result[key] = {n: {"median": statistics.median(v), "min": min(v)} for n, v in samples.items()}
        print(f"-- synchronised every {sync_every} calls")
        for n, d in result[key].items():
            print(f"{n:38s} {d['median']:7.2f} {d['min']:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
