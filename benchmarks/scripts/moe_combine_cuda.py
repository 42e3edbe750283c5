"""Time the library's MoE combine (idempotent_moe.moe.moe_combine, one
kernel) against the weighted sum transformers' grouped_mm experts do
(index_select of the rows back to token order, times the weights, summed
over top-k), and the library's dispatch (counting sort and row gather, two
kernels), at two MoE models' decode and prefill shapes.

Per shape: device time (CUDA events after a device spin, both combines
interleaved round by round, medians), the host's time per call back to back,
the HBM floor of the combine (rows read once, out written once, at
--bandwidth TB/s), and whether ours equals the CPU core bit for bit.

    python benchmarks/scripts/moe_combine_cuda.py --out imoe-results/moe-combine-cuda.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from idempotent_moe.moe import moe_combine, moe_dispatch
from imoe_bench.internals import native
from imoe_bench.runner import git_commit
from imoe_bench.timing import interleaved_cuda

MODELS = {  # hidden, experts, top-k, tokens
    "mixtral": (2048, 8, 2, [1, 8, 32, 4096]),
    "qwen3": (2048, 128, 8, [1, 8, 32, 4096]),
}


def one_shape(model: str, hidden: int, experts: int, top_k: int, tokens: int, args, lib) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    index = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=gen).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    d = moe_dispatch(x, index, experts)  # dropless, grouped: rows [T * k, H]
    rows = torch.randn(tokens * top_k, hidden, generator=gen).to(torch.bfloat16)
    cpu = moe_combine(rows, d.dest, weights)
    x_c, index_c, weights_c, rows_c, dest_c = (t.cuda() for t in (x, index, weights, rows, d.dest))
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream or 1
    dest_flat = dest_c.long().reshape(-1)
    dd = moe_dispatch(x_c, index_c, experts)

    def ours():
        lib.moe_combine(rows=rows_c, dest=dest_c, weights=weights_c, out=out, num_threads=0, stream=stream)

    def torch_sum():
        return (rows_c.index_select(0, dest_flat).view(tokens, top_k, hidden)
                * weights_c[..., None]).sum(dim=1)

    def dispatch():
        lib.moe_dispatch(hidden=x_c, top_k_index=index_c, num_experts=experts, out_rows=dd.rows,
                         out_offsets=dd.offsets, out_dest=dd.dest, out_src=dd.src, num_threads=0,
                         stream=stream)

    impls = {"moe_combine": ours, "torch_weighted_sum": torch_sum, "moe_dispatch": dispatch}
    times = {name: {"device_us": dev_ms * 1e3, "host_us": host_ms * 1e3}
             for name, (dev_ms, host_ms) in interleaved_cuda(impls, args.rounds).items()}
    ours()
    torch.cuda.synchronize()
    exact = torch.equal(out.cpu(), cpu)
    gathered = torch.equal(dd.rows.cpu(), x[d.src.long()]) if tokens else True
    floor_bytes = (tokens * top_k + tokens) * hidden * 2
    row = {"model": model, "tokens": tokens, "hidden": hidden, "top_k": top_k, "experts": experts,
           "floor_us": floor_bytes / (args.bandwidth * 1e12) * 1e6,
           "combine_bit_exact_vs_cpu": exact, "dispatch_rows_exact": gathered, **times}
    speedup = times["torch_weighted_sum"]["device_us"] / times["moe_combine"]["device_us"]
    row["combine_speedup_vs_torch"] = speedup
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--bandwidth", type=float, default=4.3, help="HBM copy bandwidth, TB/s (H200: 4.3)")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--label", default="", help="a name for this build, kept in the JSON")
    args = parser.parse_args()
    lib = native()
    results = []
    for model in args.models:
        hidden, experts, top_k, token_counts = MODELS[model]
        for tokens in token_counts:
            row = one_shape(model, hidden, experts, top_k, tokens, args, lib)
            results.append(row)
            c, t, dsp = row["moe_combine"], row["torch_weighted_sum"], row["moe_dispatch"]
            print(f"{model:8s} T={tokens:5d} k={top_k} | combine {c['device_us']:7.2f} us "
                  f"(host {c['host_us']:5.1f}, exact {row['combine_bit_exact_vs_cpu']}) | torch "
                  f"{t['device_us']:7.2f} us (host {t['host_us']:5.1f}) "
                  f"| x{row['combine_speedup_vs_torch']:.2f} "
                  f"| floor {row['floor_us']:6.2f} us | dispatch {dsp['device_us']:7.2f} us "
                  f"(rows exact {row['dispatch_rows_exact']})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": git_commit(), "label": args.label, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "bandwidth_tbs": args.bandwidth, "rounds": args.rounds,
                       "results": results}, f, indent=1)
    if not all(r["combine_bit_exact_vs_cpu"] and r["dispatch_rows_exact"] for r in results):
        sys.exit("a combine or a gather differs from the CPU core")


if __name__ == "__main__":
    main()
