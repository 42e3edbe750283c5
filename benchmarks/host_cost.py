"""H1 of WORKLOADS.md: host time per call, back to back with no synchronisation.

For each call, 2,000 calls are issued in a row and timed on the host (the
GPU queue absorbs them; one synchronisation at the end), beside one torch
elementwise op on the same host. Prints one JSON object.

    python benchmarks/host_cost.py [--device cuda] [--calls 2000] [--rounds 5]
"""

import argparse
import json
import statistics
import time

import idempotent_moe as imoe
import torch


def per_call_us(fn, calls, sync):
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    opts = ap.parse_args()
    dev = torch.device(opts.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(0)

    def case(e, t, d, c):
        x = torch.randn(e, t, d, generator=g).to(dev, torch.float16)
        s = torch.rand(e, t, generator=g).to(dev)
        idx = torch.empty(e, c, dtype=torch.int64, device=dev)
        return x, s, idx

    tiny = case(8, 64, 128, 32)
    w1 = case(8, 4096, 1024, 2048)
    y = torch.empty(1024, device=dev)
    calls = {
        "torch add_ (one elementwise op)": lambda: y.add_(1.0),
        "compact_ [8, 64, 128], out_indices": lambda: imoe.compact_(
            tiny[0], tiny[1], 32, out_indices=tiny[2]),
        "compact_ W1, out_indices": lambda: imoe.compact_(w1[0], w1[1], 2048, out_indices=w1[2]),
        "apply_map_ [8, 64, 128]": lambda: imoe.apply_map_(tiny[0], tiny[2]),
    }
    rounds = {name: [] for name in calls}
    for _ in range(opts.rounds):  # interleaved rounds
        for name, fn in calls.items():
            rounds[name].append(per_call_us(fn, opts.calls, sync))
    out = {"device": str(dev), "calls": opts.calls, "rounds": opts.rounds,
           "us_per_call_median": {k: round(statistics.median(v), 2) for k, v in rounds.items()},
           "us_per_call_min": {k: round(min(v), 2) for k, v in rounds.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
