"""Where a decode step's (or a prefill's) time goes, per experts implementation:
one M1 model in generate(), profiled (torch.profiler, CPU and CUDA activities).

Per implementation, after a warm-up generate() (the compile, for the static
cache), two profiled generate() calls, of --new-tokens tokens and of one;
their difference over --new-tokens - 1 is one decode step (the prefill and
the first token cancel), each step one token per sequence:
  - wall: the step's time on the host clock (the profiled run, so a little
    slower than M1's);
  - device busy: the union of the CUDA kernels' intervals (what the GPU
    worked), and wall - busy (the GPU idle: the host is the bound there);
    the idle gaps between kernels split at 10 us: short ones (kernel
    boundaries, e.g. inside a CUDA graph) and long ones (the GPU waiting for
    the host);
  - kernels launched, and CUDA graph launches;
  - the kernels by device time (name, launches, us per token), top --top;
  - the host's ops and ranges by self time (name, calls, us per token: where
    the host's time goes, dynamo's guards and the compiled graph's wrapper
    included), top --top.
On the CPU only the wall time and the host ops are there (a smoke test).

With --prefill N, M1's prefill is profiled instead: one forward of a
[1, N] prompt with the default cache, the last token's logits only (as
bench/model_m1.py times it), after two warm-up forwards; each "step"
figure is then the whole prefill. --batch, --prompt and --new-tokens
shape the decode only; --cache, which would not apply, is refused.

    python benchmarks/scripts/decode_profile.py --family mixtral --batch 1 --cache static \\
        --impls grouped_mm,idempotent,idempotent+gemm --out FILE.json
    python benchmarks/scripts/decode_profile.py --family mixtral --prefill 4096 \\
        --impls grouped_mm,idempotent+gemm+router --out FILE.json
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import idempotent_moe.integrations as hf
import torch
from imoe_bench import runner
from imoe_bench.model import raise_recompile_limit
from imoe_bench.model_families import (
    MOE_FAMILIES,
    QUICK_MOE_FAMILIES,
    build_model,
    parse_impl,
    random_prompt,
    use_impl,
)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def busy_us(intervals: list) -> float:
    """The length of the union of [start, end) intervals (us)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


SHORT_GAP_US = 10.0  # an idle gap shorter than this is a kernel boundary, not the host


def gaps_us(intervals: list, short: float = SHORT_GAP_US) -> tuple:
    """(short, long): the idle time between consecutive stretches of kernel
    activity, split at `short` us. Short gaps are the boundaries between
    kernels the GPU already had (inside a CUDA graph, or a queue the host
    keeps ahead); long ones are the GPU waiting for the host."""
    short_total, long_total, end = 0.0, 0.0, None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            if a - end < short:
                short_total += a - end
            else:
                long_total += a - end
        end = b if end is None or b > end else end
    return short_total, long_total


def _by_name(events, duration) -> dict:
    """name -> [count, total of duration(e) us] over events."""
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by_name[e.name][0] += 1
        by_name[e.name][1] += duration(e)
    return dict(by_name)


def totals(prof, wall_s: float) -> dict:
    """One profiled generate(): wall and busy us, kernels by name
    (launches, us), host ops and ranges by name (calls, self us: the time
    in them outside their children), kernel and CUDA graph launch counts."""
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    graphs = sum(1 for e in host if e.name == "cudaGraphLaunch")
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    short, long = gaps_us(spans)
    return {"wall": wall_s * 1e6, "busy": busy_us(spans), "short_gaps": short, "long_gaps": long,
            "kernels": len(kernels), "graphs": graphs, "cuda": bool(kernels),
            "by_name": _by_name(kernels, lambda e: e.time_range.end - e.time_range.start),
            "host_by_name": _by_name(host, lambda e: e.self_cpu_time_total)}


def _per_step(long: dict, one: dict, steps: int, top: int, count_key: str, time_key: str) -> list:
    """The top names of long - one by time, per step."""
    diff = {n: (c - one.get(n, (0, 0.0))[0], t - one.get(n, (0, 0.0))[1]) for n, (c, t) in long.items()}
    ranked = sorted(diff.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": name[:120], count_key: round(c / steps, 2), time_key: round(t / steps, 2)}
            for name, (c, t) in ranked]


def step_profile(long: dict, one: dict | None, steps: int, top: int) -> dict:
    """Per decode step: (long - one) / steps; one None: long is the one step
    (a prefill), nothing subtracted."""
    one = one or {}

    def per(key):
        return (long[key] - one.get(key, 0)) / steps

    cuda = long["cuda"]
    return {
        "wall_us_per_step": round(per("wall"), 1),
        "device_busy_us_per_step": round(per("busy"), 1) if cuda else None,
        "device_idle_us_per_step": round(per("wall") - per("busy"), 1) if cuda else None,
        # of that idle time: kernel boundaries (gaps under SHORT_GAP_US) and waits for the host
        "device_short_gaps_us_per_step": round(per("short_gaps"), 1) if cuda else None,
        "device_long_gaps_us_per_step": round(per("long_gaps"), 1) if cuda else None,
        "kernels_per_step": round(per("kernels"), 1),
        "graph_launches_per_step": round(per("graphs"), 2),
        "top_kernels": _per_step(long["by_name"], one.get("by_name", {}), steps, top, "launches_per_step",
                                 "us_per_step"),
        "top_host": _per_step(long.get("host_by_name", {}), one.get("host_by_name", {}), steps, top,
                              "calls_per_step", "self_us_per_step"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="mixtral", choices=sorted(MOE_FAMILIES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache", choices=("dynamic", "static"), default=None,
                    help="the decode's cache (default static); not with --prefill")
    ap.add_argument("--prefill", type=int, default=0,
                    help="profile M1's prefill of this many tokens (batch 1) instead of a decode step; "
                         "--batch, --prompt and --new-tokens are the decode's")
    ap.add_argument("--impls", default="grouped_mm,idempotent,idempotent+gemm")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    if opts.prefill and opts.cache is not None:
        ap.error("--cache is the decode's; the prefill runs with the default cache, as M1's does")
    if opts.prefill < 0:
        ap.error("--prefill must be a token count > 0")
    opts.cache = "prefill" if opts.prefill else opts.cache or "static"
    cuda = opts.device == "cuda"
    if opts.cache == "static":
        raise_recompile_limit()
    family = (MOE_FAMILIES if cuda else QUICK_MOE_FAMILIES)[opts.family]
    hf.register()
    model = build_model(family, opts.device)
    if opts.prefill:
        ids = random_prompt(1, opts.prefill, model.config.vocab_size, opts.device, seed=11)
    else:
        ids = random_prompt(opts.batch, opts.prompt, model.config.vocab_size, opts.device, seed=0)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    if opts.cache == "static":
        kwargs["cache_implementation"] = "static"

    def generate(n=opts.new_tokens):
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)

    def prefill():
        with torch.no_grad():
            return model(ids, use_cache=True, logits_to_keep=1).logits

    def sync():
        if cuda:
            torch.cuda.synchronize()

    result = {"family": family.key, "batch": 1 if opts.prefill else opts.batch, "cache": opts.cache,
              "new_tokens": 0 if opts.prefill else opts.new_tokens, "prefill_tokens": opts.prefill,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "commit": runner.git_commit(), "impls": {}}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def profiled(run):
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            run()
            sync()
            wall = time.perf_counter() - t0
        return totals(prof, wall)

    for name in opts.impls.split(","):
        use_impl(model, parse_impl(name))
        if opts.prefill:
            prefill(), prefill()  # warm-up
            row = step_profile(profiled(prefill), None, 1, opts.top)
        else:
            generate()  # warm-up (the compile, for the static cache)
            generate(1)
            row = step_profile(profiled(generate), profiled(lambda: generate(1)), opts.new_tokens - 1,
                               opts.top)
        result["impls"][name] = row
        print(f"{name}: wall {row['wall_us_per_step']} us/step, "
              f"device busy {row['device_busy_us_per_step']}, idle {row['device_idle_us_per_step']} "
              f"(gaps under {SHORT_GAP_US:g} us {row['device_short_gaps_us_per_step']}, "
              f"longer {row['device_long_gaps_us_per_step']}), "
              f"kernels {row['kernels_per_step']}, graph launches {row['graph_launches_per_step']}")
        for k in row["top_kernels"]:
            print(f"    {k['us_per_step']:9.2f} us  x{k['launches_per_step']:6.2f}  {k['name']}")
        print("  host, self time:")
        for k in row["top_host"]:
            print(f"    {k['self_us_per_step']:9.2f} us  x{k['calls_per_step']:6.2f}  {k['name']}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
