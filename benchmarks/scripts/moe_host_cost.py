"""Where the time of a Mixtral-like MoE layer goes at decode sizes, on one GPU.

1. Host time per call, back to back with no synchronisation (H1's method),
   of the experts forward (grouped_mm against the "idempotent" fused path),
   the whole sparse-MoE block (router included) and each piece of the fused
   path (moe_dispatch, gated_act, moe_combine, the binding alone with its
   outputs preallocated), beside one torch elementwise op and torch.empty.
2. CUDA kernels per forward (torch profiler) at 1 and 8 tokens.
3. The ceiling of replacing the experts: decode tokens/s of M1's models
   (Mixtral-like, Qwen3-MoE-like) at batch 1, 8 and 32 with grouped_mm, with
   "idempotent" (alone and with its options, "+gemm+router"; --impls picks), and with
   experts that cost nothing (a forward that returns zeros), with
   transformers' routers and with the fused ones: the speed the rest of the
   model allows. --cache static measures the compiled decode instead.

    python benchmarks/scripts/moe_host_cost.py [--out FILE.json] [--skip-ceiling] [--cache static]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import idempotent_moe.integrations as hf
import torch
from idempotent_moe.integrations import hf_router
from idempotent_moe.moe import gated_act, grouped_gemm, moe_combine, moe_dispatch
from imoe_bench import runner
from imoe_bench.internals import native
from imoe_bench.model import raise_recompile_limit
from torch.profiler import ProfilerActivity, profile
from transformers import MixtralConfig
from transformers.integrations.moe import ExpertsInterface
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock


def per_call_us(fn, calls=400, rounds=5):
    """Median over rounds of the host time per call, `calls` back to back."""
    times = []
    for _ in range(rounds):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        times.append((t1 - t0) / calls * 1e6)
    return round(statistics.median(times), 2)


def kernels(fn) -> list:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def block(hidden=2048, intermediate=7168, experts=8, top_k=2):
    config = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts,
                           num_experts_per_tok=top_k)
    with torch.device("cuda"):
        b = MixtralSparseMoeBlock(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.02)
    return b


def use(b, name):
    b.experts.config._experts_implementation = name
    setattr(b.experts.config, hf.CAPACITY_FACTOR_ATTR, None)


def host_costs(b, tokens):
    x = torch.randn(tokens, b.experts.down_proj.shape[1], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, w, idx = b.gate(x)
    y = torch.empty(1024, device="cuda")
    d = moe_dispatch(x, idx, b.experts.num_experts)
    h = torch.randn(tokens * idx.shape[1], 2 * 7168, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(tokens * idx.shape[1], x.shape[1], device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream or 1
    out = {}

    def experts(name):
        use(b, name)
        return lambda: b.experts(x, idx, w)

    def whole(name):
        use(b, name)
        return lambda: b(x.view(1, tokens, -1))

    with torch.no_grad():
        out["torch add_ [1024]"] = per_call_us(lambda: y.add_(1.0))
        out["torch.empty(16, int32)"] = per_call_us(lambda: torch.empty(16, dtype=torch.int32, device="cuda"))
        for name in ("grouped_mm", "batched_mm", "idempotent"):
            out[f"experts forward, {name}"] = per_call_us(experts(name))
            out[f"MoE block (router included), {name}"] = per_call_us(whole(name))
        out["router (gate: linear, softmax, top-k, renormalise)"] = per_call_us(lambda: b.gate(x))
        out["router, fused (linear, topk_softmax)"] = per_call_us(lambda: hf_router.fused_route(b.gate, x))
        w_up = b.experts.gate_up_proj.transpose(-2, -1).detach()
        out["torch._grouped_mm, gate-up GEMM alone"] = per_call_us(
            lambda: torch._grouped_mm(d.rows, w_up, offs=d.offsets))
        out["grouped_gemm, gate-up GEMM alone"] = per_call_us(lambda: grouped_gemm(d.rows, w_up, d.offsets))
        out["moe_dispatch"] = per_call_us(lambda: moe_dispatch(x, idx, b.experts.num_experts))
        out["_C.moe_dispatch, outputs given"] = per_call_us(lambda: native().moe_dispatch(
            hidden=x, top_k_index=idx, num_experts=b.experts.num_experts, out_rows=d.rows,
            out_offsets=d.offsets, out_dest=d.dest, out_src=d.src, num_threads=0, stream=stream))
        out["gated_act"] = per_call_us(lambda: gated_act(h, "silu", limit=d.offsets))
        out["moe_combine"] = per_call_us(lambda: moe_combine(rows, d.dest, w))
        counts = {}
        for name in ("grouped_mm", "batched_mm", "idempotent"):
            counts[f"experts forward, {name}"] = kernels(experts(name))
            counts[f"MoE block, {name}"] = kernels(whole(name))
    return out, counts


CEILING_IMPLS = ("grouped_mm", "idempotent", "idempotent+gemm+router", "zero-cost", "zero-cost+router")


def switch(model, name):
    """An M1 implementation name (model_families.parse_impl), or "zero-cost"
    experts, "+router" with the routers fused."""
    from imoe_bench.model_families import parse_impl, use_impl

    base, _, option = name.partition("+")
    if base != "zero-cost":
        use_impl(model, parse_impl(name))
        return
    use_impl(model, parse_impl("grouped_mm"))  # options off, routers unfused
    model.set_experts_implementation("zero-cost")
    if option == "router":
        hf.fuse_routers(model)


def decode_ceiling(family, batch, cache="dynamic", rounds=3, new_tokens=48, names=CEILING_IMPLS):
    """Decode tokens/s (all sequences) of one M1 model at one batch size per
    experts implementation, interleaved rounds, medians."""
    from imoe_bench.model_families import MOE_FAMILIES, build_model

    ExpertsInterface.register("zero-cost", lambda self, h, i, w: torch.zeros_like(h))
    hf.register()
    model = build_model(MOE_FAMILIES[family], "cuda")
    ids = torch.randint(0, model.config.vocab_size, (batch, 128), device="cuda")
    mask = torch.ones_like(ids)
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}

    def gen(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    samples = {n: [] for n in names}
    for r in range(rounds + 1):
        for name in (names if r % 2 else names[::-1]):
            switch(model, name)
            t_long, t_one = gen(new_tokens), gen(1)
            if r:  # round 0 warms up
                samples[name].append(batch * (new_tokens - 1) / (t_long - t_one))
    return {n: round(statistics.median(v), 1) for n, v in samples.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-ceiling", action="store_true")
    ap.add_argument("--families", default="mixtral,qwen3moe")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="the ceiling's interleaved rounds (medians)")
    ap.add_argument("--new-tokens", type=int, default=48, help="the ceiling's decoded tokens per generate()")
    ap.add_argument("--impls", default=",".join(CEILING_IMPLS),
                    help="M1 names (idempotent+xg), zero-cost, zero-cost+router")
    ap.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                    help="the ceiling's cache (static: transformers compiles the decode)")
    opts = ap.parse_args()
    if opts.rounds < 1 or opts.new_tokens < 2:
        ap.error("--rounds must be at least 1 and --new-tokens at least 2")
    if opts.cache == "static":
        raise_recompile_limit()
    hf.register()
    b = block()
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "commit": runner.git_commit(), "ceiling_cache": opts.cache}
    for tokens in (1, 8):
        costs, counts = host_costs(b, tokens)
        result[f"host_us_{tokens}_tokens"] = costs
        result[f"kernels_{tokens}_tokens"] = {k: len(v) for k, v in counts.items()}
        result[f"kernel_names_{tokens}_tokens"] = counts
    del b
    if not opts.skip_ceiling:
        names = tuple(opts.impls.split(","))
        result["ceiling_rounds"], result["ceiling_new_tokens"] = opts.rounds, opts.new_tokens
        result["decode_tokens_per_s"] = {
            f"{family}, batch {batch}": decode_ceiling(family, int(batch), opts.cache, opts.rounds,
                                                       opts.new_tokens, names)
            for family in opts.families.split(",") for batch in opts.batches.split(",")}
    text = json.dumps(result, indent=1)
    print(text)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
