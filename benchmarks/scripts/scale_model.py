"""A scale model of expert parallelism (idempotent_moe.distributed) from 8 to
256 GPUs: per MoE layer, the bytes the all-to-all moves and the transient
memory that in-place grouping and capacity compaction save over out-of-place
(argsort + gather, topk + gather), for DeepSeek-V3-like and Mixtral-like
shapes. Arithmetic only (no GPU needed), under uniform routing: every expert
receives T_all * k / E assignments on average.

Per GPU, with T tokens, k experts per token, hidden D, b bytes per element,
E experts over an expert-parallel group of P = min(GPUs, E) ranks (beyond E
GPUs the group is replicated data-parallel), L = E / P local experts:

- dispatch: T * k rows of D * b bytes sent (a fraction (P - 1) / P leaves
  the GPU), plus T * k fp32 routing weights in capacity mode and a
  [P, L + 1] int64 count exchange; the combine sends the same rows back;
- received: N = T * k rows on average; C = ceil(T * P * k / E * factor);
- out of place: grouping the received rows by expert copies them (N * D * b)
  and capacity compaction gathers [L, C, D] (L * C * D * b) plus int64
  indices; in place: the grouping's int32 plan workspace and int64
  permutation (N * 12 bytes) and the int64 indices [L, C].

Prints a markdown table and writes --out (default imoe-results/scale-model.json;
the committed figures are benchmarks/results/scale-model.json).
"""

from __future__ import annotations

import argparse
import math
import os

MODELS = {
    "deepseek-v3-like": dict(hidden=7168, experts=256, top_k=8, dtype="bf16", bytes=2),
    "mixtral-like": dict(hidden=4096, experts=8, top_k=2, dtype="bf16", bytes=2),
}
GPUS = [8, 16, 32, 64, 128, 256]
FACTORS = [1.0, 1.25]


def model_row(name: str, gpus: int, factor: float, tokens: int) -> dict:
    m = MODELS[name]
    d, e, k, b = m["hidden"], m["experts"], m["top_k"], m["bytes"]
    ep = min(gpus, e)
    local = e // ep
    rows = tokens * k
    row_bytes = d * b
    dispatch = rows * row_bytes + rows * 4 + ep * (local + 1) * 8
    combine = rows * row_bytes
    per_gpu = dispatch + combine
    remote = (rows * row_bytes * 2 + rows * 4) * (ep - 1) / ep
    capacity = math.ceil(tokens * ep * k / e * factor)
    received = rows  # on average, under uniform routing
    kept = local * min(capacity, tokens * ep)
    out_of_place = received * row_bytes + kept * row_bytes + kept * 8 + received * 8
    in_place = received * (4 + 8) + kept * 8
    return dict(model=name, gpus=gpus, ep_group=ep, local_experts=local, capacity_factor=factor,
                tokens_per_gpu=tokens, capacity=capacity, a2a_bytes_per_gpu=per_gpu,
                a2a_remote_bytes_per_gpu=round(remote), a2a_bytes_per_layer=per_gpu * gpus,
                recv_buffer_bytes=received * row_bytes, transient_out_of_place_bytes=out_of_place,
                transient_in_place_bytes=in_place, saved_bytes_per_gpu=out_of_place - in_place,
                saved_bytes_per_layer=(out_of_place - in_place) * gpus)


def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f} MiB"


def _gib(x: float) -> str:
    return f"{x / 2**30:,.1f} GiB"


def table(rows: list) -> str:
    head = ("| model | GPUs | EP | experts/GPU | factor | C | a2a per GPU | of it remote | a2a per layer "
            "| out-of-place transient | in-place transient | saved per GPU |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['ep_group']} | {r['local_experts']} | "
            f"{r['capacity_factor']:.2f} | {r['capacity']} | {_mib(r['a2a_bytes_per_gpu'])} | "
            f"{_mib(r['a2a_remote_bytes_per_gpu'])} | {_gib(r['a2a_bytes_per_layer'])} | "
            f"{_mib(r['transient_out_of_place_bytes'])} | {_mib(r['transient_in_place_bytes'])} | "
            f"{_mib(r['saved_bytes_per_gpu'])} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-gpu", type=int, default=4096)
    parser.add_argument("--out", default=os.path.join("imoe-results", "scale-model.json"),
                        help="the JSON to write (default imoe-results/scale-model.json, ignored by git; "
                             "benchmarks/results/scale-model.json replaces the committed one)")
    args = parser.parse_args(argv)
    rows = [model_row(name, g, f, args.tokens_per_gpu) for name in MODELS for f in FACTORS for g in GPUS]
    print(table(rows))
    result = dict(description="per MoE layer, uniform routing; bytes", models=MODELS, rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    from imoe_bench.report import dumps

    with open(args.out, "w") as f:
        f.write(dumps(result))
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
