"""Time the library's small-M grouped GEMM (idempotent_moe.moe.grouped_gemm,
one kernel) against torch._grouped_mm at two MoE models' decode shapes, both
GEMMs of the experts (gate-up [S, H] x [E, H, 2I], down [S, I] x [E, I, H],
weights as transformers stores them, [E, N, K] viewed as [E, K, N]).

Per shape: device time (CUDA events after a device spin, the L2 flushed
first, both implementations interleaved round by round, medians), the
host's time per call back to back, the HBM floor (bytes of the active
experts' weights, a and out at --bandwidth TB/s; active experts counted from
the offsets) and the error of each against an fp64 reference.

    python benchmarks/scripts/moe_gemm_cuda.py --out imoe-results/moe-gemm-cuda.json
"""

from __future__ import annotations

import argparse
import json

import torch
from imoe_bench.internals import native
from imoe_bench.runner import git_commit
from imoe_bench.timing import interleaved_cuda

MODELS = {  # hidden, intermediate, experts, top-k, rows S
    "mixtral": (2048, 7168, 8, 2, [1, 8, 16, 32, 64]),
    "qwen3": (2048, 768, 128, 8, [8, 64, 256]),
}


def routed_rows(rows: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """offsets [E] int32 of `rows` assignments: tokens of top_k distinct
    random experts, the first `rows` assignments kept, sorted by expert."""
    tokens = -(-rows // top_k)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.reshape(-1)[:rows]
    return torch.bincount(ids, minlength=experts).cumsum(0).to(torch.int32)


def ours(lib, stream: int):
    def run(a, w, offsets, out):
        lib.grouped_gemm(a=a, w=w, offsets=offsets, out=out, num_threads=0, stream=stream)
        return out
    return run


def theirs(a, w, offsets, out):
    return torch._grouped_mm(a, w, offs=offsets)


def reference(a, w, offsets) -> torch.Tensor:
    ends = [0] + offsets.tolist()
    y = torch.zeros(a.shape[0], w.shape[-1], dtype=torch.float64, device=a.device)
    for e in range(w.shape[0]):
        if ends[e + 1] > ends[e]:
            y[ends[e]:ends[e + 1]] = a[ends[e]:ends[e + 1]].double() @ w[e].double()
    return y


def one_shape(model: str, gemm: str, rows: int, k: int, n: int, experts: int, top_k: int, w: torch.Tensor,
              args: argparse.Namespace, lib, flush: torch.Tensor) -> dict:
    gen = torch.Generator().manual_seed(rows)
    offsets = routed_rows(rows, experts, top_k, gen).cuda()
    a = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream or 1
    impls = {"grouped_gemm": ours(lib, stream), "grouped_mm": theirs}
    times = interleaved_cuda({name: (lambda fn=fn: fn(a, w, offsets, out)) for name, fn in impls.items()},
                             args.rounds, before=flush.zero_)
    counts = torch.diff(offsets.cpu(), prepend=torch.zeros(1, dtype=torch.int32))
    active = int((counts > 0).sum())
    size = w.element_size()
    floor_bytes = active * k * n * size + rows * k * size + rows * n * size
    floor_us = floor_bytes / (args.bandwidth * 1e12) * 1e6
    exact = reference(a, w, offsets)
    errors = {}
    for name, fn in impls.items():
        y = fn(a, w, offsets, out).double()
        diff = (y - exact).abs()
        errors[name] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean())}
    row = {"model": model, "gemm": gemm, "rows": rows, "K": k, "N": n, "experts": experts,
           "active_experts": active, "floor_bytes": floor_bytes, "floor_us": floor_us}
    for name, (dev_ms, host_ms) in times.items():
        row[name] = {"device_us": dev_ms * 1e3, "host_us": host_ms * 1e3, "x_floor": dev_ms * 1e3 / floor_us,
                     **errors[name]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--bandwidth", type=float, default=4.3, help="HBM copy bandwidth, TB/s (H200: 4.3)")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    lib = native()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # > L2: every call reads HBM
    results = []
    for model in args.models:
        hidden, inter, experts, top_k, row_counts = MODELS[model]
        gen = torch.Generator().manual_seed(0)
        # transformers' layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]; GEMM views [E, K, N].
        gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16)
        down = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(torch.bfloat16)
        shapes = [("gate_up", hidden, 2 * inter, gate_up.cuda().transpose(1, 2)),
                  ("down", inter, hidden, down.cuda().transpose(1, 2))]
        del gate_up, down
        for gemm, k, n, w in shapes:
            for rows in row_counts:
                row = one_shape(model, gemm, rows, k, n, experts, top_k, w, args, lib, flush)
                results.append(row)
                ours_, theirs_ = row["grouped_gemm"], row["grouped_mm"]
                print(f"{model:8s} {gemm:8s} S={rows:4d} active={row['active_experts']:3d} "
                      f"floor {row['floor_us']:7.1f} us | ours {ours_['device_us']:7.1f} us "
                      f"({ours_['x_floor']:.2f}x, host {ours_['host_us']:.1f} us, "
                      f"err {ours_['max_abs']:.2e}) | "
                      f"grouped_mm {theirs_['device_us']:7.1f} us ({theirs_['x_floor']:.2f}x, "
                      f"host {theirs_['host_us']:.1f} us, err {theirs_['max_abs']:.2e})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": git_commit(), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "bandwidth_tbs": args.bandwidth, "rounds": args.rounds,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
