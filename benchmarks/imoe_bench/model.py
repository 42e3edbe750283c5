"""`python -m imoe_bench model`: M1, M2 and H1 (docs/results.md#workloads).

- M1 (bench/model_m1.py): whole MoE models in generate(), a Mixtral-like and
  a Qwen3-MoE-like family with random weights; prefill time and peak memory,
  decode tokens/s at several batch sizes with the dynamic and the static
  (compiled) cache, for transformers' "eager" and "grouped_mm" experts and
  ours (dropless, capacity 1.25), on one model; the token-agreement check.
- M2 (bench/model_m2.py): a Llama-like model, a long prompt with chunked
  prefill, DynamicCache beside InplaceEvictionCache.
- H1 (bench/hostcost.py): host time per hot call, back to back.

One JSON (model-DEVICE.json), a plot beside it and a printed table; --doc
FILE fills FILE's <!-- model:DEVICE --> section with every table, --readme
FILE the README headline (<!-- headline:DEVICE -->: M1, M2 and W1-W3 from the
main job's JSON beside the model JSON). A row that fails to run keeps its
error message and the run goes on; the run fails (after writing everything)
when a dropless row's tokens disagree with grouped_mm's beyond a near-tie.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import model_report, report, runner
from .hostcost import H1Options, run_h1
from .model_families import (
    DECODE_PROMPT,
    IMPLS,
    LLAMA,
    MOE_FAMILIES,
    PREFILL_TOKENS,
    QUICK_DECODE_PROMPT,
    QUICK_LLAMA,
    QUICK_MOE_FAMILIES,
    QUICK_PREFILL_TOKENS,
    describe,
)
from .model_m1 import M1Options, add_memory_ratios, add_ratios, run_family
from .model_m2 import M2Options, run_m2
from .model_timing import log

CACHES = ("dynamic", "static")
BATCHES, QUICK_BATCHES = (1, 8, 32), (1, 4)
# Dynamo recompiles the decode step per experts implementation and batch shape;
# its default limit (8) would silently fall back to eager for the later rows.
RECOMPILE_LIMIT = 64


@dataclass
class ModelOptions:
    device: str = "auto"
    families: tuple = tuple(MOE_FAMILIES)
    batches: tuple = ()          # (): 1, 8, 32 (1, 4 with --quick)
    caches: tuple = CACHES
    impls: tuple = IMPLS
    rounds: int = 3
    new_tokens: int = 0          # 0: 48 (4 with --quick)
    tie_ulps: float = 4.0
    skip_m1: bool = False
    skip_m2: bool = False
    skip_h1: bool = False
    m2_new_tokens: int = 0       # 0: 64 (8 with --quick)
    h1_calls: int = 0            # 0: 2000 (20 with --quick)
    threads: int = 0             # CPU threads of torch (0: torch's; 1 with --quick)
    quick: bool = False
    out: str = report.DEFAULT_OUT
    plot: bool = True
    doc: str | None = None
    readme: str | None = None


def _m2_options(opts: ModelOptions, device: str) -> M2Options:
    if opts.quick:
        return M2Options(device, prompt_tokens=512, chunk=128, budget=64, evict_every=4,
                         new_tokens=opts.m2_new_tokens or 8, rounds=opts.rounds)
    return M2Options(device, prompt_tokens=32768, chunk=2048, budget=2048, evict_every=32,
                     new_tokens=opts.m2_new_tokens or 64, rounds=opts.rounds)


def raise_recompile_limit() -> dict:
    import torch._dynamo

    changed = {}
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < RECOMPILE_LIMIT:
            setattr(torch._dynamo.config, name, RECOMPILE_LIMIT)
            changed[name] = RECOMPILE_LIMIT
    return changed


def _machine(device: str) -> dict:
    import torch
    import transformers

    info = runner._machine(device, torch.get_num_threads(), 0.0)
    info.pop("copy_bandwidth_GBps", None)
    info["transformers"] = transformers.__version__
    return info


def _check_options(opts: ModelOptions) -> None:
    from .model_families import parse_impl

    if opts.rounds < 1:
        raise SystemExit(f"--rounds: at least 1, got {opts.rounds}")
    if opts.new_tokens and opts.new_tokens < 2:
        raise SystemExit("--new-tokens: at least 2 (a decode rate needs two new tokens), "
                         f"got {opts.new_tokens}")
    if any(b < 1 for b in opts.batches):
        raise SystemExit(f"--batches: positive integers, got {opts.batches}")
    for name in opts.impls:
        try:
            parse_impl(name)
        except ValueError as e:
            raise SystemExit(f"--impls: {e}") from None


def run(opts: ModelOptions) -> dict:
    import torch
    from idempotent_moe.integrations import register

    _check_options(opts)
    register()
    device = runner.pick_device(opts.device)
    if opts.doc:
        report.require_section(opts.doc, f"model:{device}")
    if opts.readme:
        report.require_section(opts.readme, f"{model_report.HEADLINE_KEY}:{device}")
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(opts.threads or (1 if opts.quick else saved_threads))
    try:
        data = _measure(opts, device)
    finally:
        torch.set_num_threads(saved_threads)
    print(model_report.table(data))
    for path in write(data, opts.out, plot=opts.plot):
        print(f"wrote {path}")
    if opts.doc:
        model_report.update_doc(opts.doc, data)
        print(f"updated {opts.doc}")
    if opts.readme:
        model_report.headline_from_json(opts.readme, os.path.join(opts.out, _stem(data) + ".json"))
        print(f"updated {opts.readme}")
    failed = [r for r in (data["m1"] or {}).get("decode", []) if r.get("ok") is False]
    if failed:
        raise SystemExit("tokens disagree with grouped_mm's beyond a near-tie: " + ", ".join(
            f"{r['family']} {r['cache']} batch {r['batch']} {r['impl']}" for r in failed))
    return data


def _m1_options(opts: ModelOptions, device: str) -> M1Options:
    return M1Options(device, tuple(opts.batches) or (QUICK_BATCHES if opts.quick else BATCHES),
                     tuple(opts.caches), tuple(opts.impls), opts.rounds,
                     opts.new_tokens or (4 if opts.quick else 48),
                     QUICK_PREFILL_TOKENS if opts.quick else PREFILL_TOKENS,
                     QUICK_DECODE_PROMPT if opts.quick else DECODE_PROMPT, opts.tie_ulps)


def _measure(opts: ModelOptions, device: str) -> dict:
    """M1, M2 and H1 as the options ask, into the JSON's dict."""
    import torch

    m1 = _m1_options(opts, device)
    dynamo = raise_recompile_limit() if device == "cuda" and "static" in m1.caches else {}
    data = {"machine": _machine(device), "quick": opts.quick,
            "description": "M1, M2 and H1 of docs/results.md#workloads (python -m imoe_bench model)",
            "options": {"batches": list(m1.batches), "caches": list(m1.caches), "impls": list(m1.impls),
                        "rounds": m1.rounds, "new_tokens": m1.new_tokens,
                        "prefill_tokens": m1.prefill_tokens, "decode_prompt": m1.decode_prompt,
                        "tie_ulps": m1.tie_ulps, "dynamo": dynamo},
            "families": {}, "m1": None, "m2": None, "h1": None}
    log(f"model benchmark on {device}: M1 {'skipped' if opts.skip_m1 else ','.join(opts.families)}; "
        f"M2 {'skipped' if opts.skip_m2 else 'on'}; H1 {'skipped' if opts.skip_h1 else 'on'}")
    if not opts.skip_m1:
        families = QUICK_MOE_FAMILIES if opts.quick else MOE_FAMILIES
        rows: dict = {"prefill": [], "decode": []}
        for key in opts.families:
            data["families"][key] = describe(families[key])
            family_rows = run_family(families[key], m1)
            rows["prefill"] += family_rows["prefill"]
            rows["decode"] += family_rows["decode"]
        add_ratios(rows["prefill"], "median_ms", False, ("family",))
        add_memory_ratios(rows["prefill"])
        add_ratios(rows["decode"], "decode_tokens_per_s", True, ("family", "cache", "batch"))
        add_ratios(rows["decode"], "step_tokens_per_s", True, ("family", "cache", "batch"), "step_speedup")
        data["m1"] = rows
    if not opts.skip_m2:
        data["m2"] = run_m2(QUICK_LLAMA if opts.quick else LLAMA, _m2_options(opts, device))
    if not opts.skip_h1:
        calls = opts.h1_calls or (20 if opts.quick else 2000)
        data["h1"] = run_h1(H1Options(device, calls, max(opts.rounds, 3), opts.quick))
    if device == "cuda":
        torch.cuda.synchronize()
    return data


def _stem(data: dict) -> str:
    return f"model-{data['machine']['device']}" + ("-quick" if data.get("quick") else "")


def write(data: dict, out_dir: str, plot: bool = True) -> list:
    paths = report.write_results(data, out_dir, _stem(data), model_report.plot if plot else None)
    return [p for p in paths if p]
