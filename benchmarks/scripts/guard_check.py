"""What torch.compile's guard check costs before each compiled decode step,
per experts implementation, unprofiled: the host time the check of one M1
model's compiled static-cache step takes, and how many guards it holds.

Per implementation, one model (its own copy, the same seeded weights) is
switched to the implementation, a prompt fills a StaticCache, and the
model's forward is compiled (backend "eager": dynamo's guards do not depend
on the backend) and run for two decode steps (imoe_bench.guards).
The step's guards are then checked directly on the frame the next step would bring (the same model,
cache and kwargs, the next position): in rounds of --calls checks, the
implementations interleaved (order alternating), medians of --rounds. Every
check must pass (the next step would reuse the compiled graph), else the
run stops. The step here is called as model(ids, cache_position=...,
cache=..., use_cache=True); generate() passes a few more kwargs, whose
guards are the same for every implementation.

On the CPU the quick models run (--layers sets their depth), and routers
fused by "+router" take their fused forward on the CPU too (on CUDA they do
anyway), so that the CPU holds the guards a GPU step has.

    python benchmarks/scripts/guard_check.py --family qwen3moe --impls grouped_mm,idempotent+gemm+router \\
        --out imoe-results/guard-check-qwen3moe-cuda.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from imoe_bench import runner
from imoe_bench.guards import compiled_step
from imoe_bench.internals import fuse_routers_on_cpu
from imoe_bench.model import raise_recompile_limit
from imoe_bench.model_families import MOE_FAMILIES, QUICK_MOE_FAMILIES, Family


def time_checks(guards, f_locals, calls: int) -> float:
    """us per check, over `calls` checks back to back; each must pass."""
    start = time.perf_counter()
    passed = 0
    for _ in range(calls):
        passed += guards.check(f_locals)
    us = (time.perf_counter() - start) / calls * 1e6
    if passed != calls:
        raise RuntimeError(f"the step's guards failed: {guards.check_verbose(f_locals)}")
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3moe", choices=sorted(MOE_FAMILIES))
    ap.add_argument("--impls", default="grouped_mm,idempotent+router")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the family's)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    cuda = opts.device == "cuda"
    base = (MOE_FAMILIES if cuda else QUICK_MOE_FAMILIES)[opts.family]
    config = base.config if opts.layers is None else dict(base.config, num_hidden_layers=opts.layers)
    family = Family(base.key, base.name, base.config_class, config, base.dtype)
    if not cuda:
        fuse_routers_on_cpu()
    raise_recompile_limit()
    torch.set_grad_enabled(False)  # the guards hold the grad mode of the compiled steps
    impls = opts.impls.split(",")
    steps = {impl: compiled_step(family, impl, opts.device) for impl in impls}
    times: dict = {impl: [] for impl in impls}
    for r in range(opts.rounds):
        for impl in impls if r % 2 == 0 else impls[::-1]:
            guards, f_locals, _ = steps[impl]
            times[impl].append(time_checks(guards, f_locals, opts.calls))
    result = {"family": family.key, "name": family.name, "layers": config["num_hidden_layers"],
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "commit": runner.git_commit(), "rounds": opts.rounds, "calls": opts.calls, "impls": {}}
    for impl in impls:
        text = str(steps[impl][0])
        row = {"check_us": round(statistics.median(times[impl]), 2),
               "check_us_rounds": [round(t, 2) for t in times[impl]],
               "guard_lines": len(text.splitlines()), "identity_guards": text.count("LAMBDA_GUARD"),
               # the step ran the fused routers' forward (guards name its lines)
               "fused_routers_traced": "hf_router.py" in text}
        result["impls"][impl] = row
        print(f"{impl}: guard check {row['check_us']} us (median of {opts.rounds} x {opts.calls}), "
              f"{row['guard_lines']} guard lines, {row['identity_guards']} identity guards (LAMBDA_GUARD)")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
