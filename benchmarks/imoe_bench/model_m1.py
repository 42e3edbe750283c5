"""M1 (docs/results.md#workloads): a whole MoE model in generate(), one family at a time.

On ONE model (the same weights), the experts implementations are switched
between calls: transformers' "eager" and "grouped_mm", ours dropless and in
capacity mode. Per family:

- prefill: one forward of [1, prefill_tokens] with the default (dynamic)
  cache, as generate() runs it (logits of the last token only): median time
  over the rounds and the peak memory (torch.cuda.max_memory_allocated(),
  reset before each prefill; reported beyond the weights and in all);
- decode: greedy generate() of `new_tokens` tokens (min_new_tokens =
  max_new_tokens, so every run generates as many) after a short prompt, at
  each batch size, with the default (dynamic) cache and with
  cache_implementation="static" (which transformers compiles on CUDA). The
  decode rate is batch x (new tokens - 1) over the time from the first new
  token to the last one. The first call of each implementation and batch is
  a warm-up (compilation, for the static cache): its time is reported apart.
  Compiled rows keep, per timed round, what torch.compile did during it
  (`compile_events_rounds`: frames compiled, CUDA graphs recorded, seconds
  recording): a round that records a graph again pays for it in its time.
  Beside the rate, the median step (`step_median_ms`, the median of each
  round's step-to-step times, then over the rounds) and its rate
  (`step_tokens_per_s`, `step_speedup_vs_grouped_mm`): the pace of a decode
  step without a call's one-off costs. transformers makes a new static cache
  for every generate(), so every compiled call records its CUDA graph again
  on its first decode step; the rate pays for it, the median step does not.

Implementations run in interleaved rounds (A B C D, D C B A, ...) and every
figure is the median over the rounds. A row that fails (an exception, e.g.
compilation) keeps its error message; the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import model_agreement as agreement
from .model_families import BASELINE, Family, build_model, parse_impl, random_prompt, use_impl
from .model_timing import (
    Samples,
    attempt,
    compile_events,
    compile_events_since,
    error_text,
    log,
    peak_since,
    reset_peak,
    round_order,
    sync,
    timed_generate,
)


@dataclass
class M1Options:
    device: str
    batches: tuple
    caches: tuple
    impls: tuple           # names, as --impls
    rounds: int
    new_tokens: int
    prefill_tokens: int
    decode_prompt: int
    tie_ulps: float


def _forbidden(model) -> list:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def measure_prefill(model, family: Family, impls: list, opts: M1Options) -> list:
    """One row per implementation: the prefill of [1, prefill_tokens]."""
    import time

    import torch
    from idempotent_moe.integrations import capacity_stats

    device = opts.device
    ids = random_prompt(1, opts.prefill_tokens, model.config.vocab_size, device, seed=11)
    rows = {impl.name: {"family": family.key, "impl": impl.name, "tokens": opts.prefill_tokens,
                        "capacity_factor": impl.capacity_factor} for impl in impls}
    samples = {impl.name: Samples() for impl in impls}

    def forward():
        with torch.no_grad():
            return model(ids, use_cache=True, logits_to_keep=1).logits

    def timed(impl):
        use_impl(model, impl)
        before = reset_peak(device)
        t0 = time.perf_counter()
        forward()
        sync(device)
        return time.perf_counter() - t0, peak_since(device), before

    for impl in impls:  # warm-up, and the rows that cannot run
        attempt(rows[impl.name], f"M1 {family.key} prefill {impl.name}", lambda impl=impl: timed(impl))
    for r in range(opts.rounds):
        for impl in (i for i in round_order(impls, r) if "error" not in rows[i.name]):
            result = attempt(rows[impl.name], f"M1 {family.key} prefill {impl.name}",
                             lambda impl=impl: timed(impl))
            if result is None:
                continue
            elapsed, peak, before = result
            samples[impl.name].add(ms=elapsed * 1e3)
            if peak is not None:
                samples[impl.name].add(peak=peak, beyond=peak - before)
    for impl in impls:
        row = rows[impl.name]
        if "error" in row:
            continue
        s = samples[impl.name]
        row.update(median_ms=s.median("ms"), min_ms=s.minimum("ms"), rounds=opts.rounds)
        if "peak" in s.values:
            row.update(peak_allocated_bytes=int(max(s.values["beyond"])),
                       peak_total_bytes=int(max(s.values["peak"])))
        if impl.capacity_factor is not None:
            use_impl(model, impl)
            forward()
            stats = capacity_stats(model).values()
            row.update(assignments=sum(st.assignments for st in stats),
                       dropped=sum(st.dropped for st in stats))
    log(f"M1 {family.key} prefill of {opts.prefill_tokens} tokens done")
    return list(rows.values())


def _generate(model, ids, cache: str, new_tokens: int):
    """generate(streamer): greedy, exactly `new_tokens` new tokens, no padding."""
    import torch

    mask = torch.ones_like(ids)
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}

    def call(streamer):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, streamer=streamer, **kwargs)
    return call


def measure_decode(model, family: Family, impls: list, cache: str, batch: int, opts: M1Options) -> list:
    """One row per implementation: greedy decode at `batch` with `cache`."""
    device, prompt_len = opts.device, opts.decode_prompt
    ids = random_prompt(batch, prompt_len, model.config.vocab_size, device, seed=100 + batch)
    generate = _generate(model, ids, cache, opts.new_tokens)
    rows = {impl.name: {"family": family.key, "impl": impl.name, "cache": cache, "batch": batch,
                        "capacity_factor": impl.capacity_factor, "new_tokens": opts.new_tokens,
                        "prompt_tokens": prompt_len,
                        "compiled": cache == "static" and device == "cuda"} for impl in impls}
    samples = {impl.name: Samples() for impl in impls}
    tokens: dict = {}
    def timed(impl):
        use_impl(model, impl)
        out, timing = timed_generate(device, generate)
        new = out[:, prompt_len:]
        if new.shape[1] != opts.new_tokens or timing.decode_steps != opts.new_tokens - 1:
            raise RuntimeError(f"generate() made {new.shape[1]} tokens in {timing.decode_steps + 1} "
                               f"steps, not {opts.new_tokens}")
        return new, timing

    for impl in impls:  # warm-up: compilation for the static cache
        label = f"M1 {family.key} {cache} batch {batch} {impl.name}"
        result = attempt(rows[impl.name], label, lambda impl=impl: timed(impl))
        if result is not None:
            rows[impl.name]["warmup_s"] = result[1].total_s
    for r in range(opts.rounds):
        for impl in (i for i in round_order(impls, r) if "error" not in rows[i.name]):
            label = f"M1 {family.key} {cache} batch {batch} {impl.name}"
            events = compile_events()
            result = attempt(rows[impl.name], label, lambda impl=impl: timed(impl))
            if result is None:
                tokens.pop(impl.name, None)
                continue
            if rows[impl.name]["compiled"]:
                rows[impl.name].setdefault("compile_events_rounds", []).append(compile_events_since(events))
            new, timing = result
            previous = tokens.get(impl.name)
            if previous is not None and not bool((previous == new).all()):
                rows[impl.name]["same_tokens_every_round"] = False
            tokens[impl.name] = new
            samples[impl.name].add(
                total_ms=timing.total_s * 1e3, first_token_ms=timing.first_token_s * 1e3,
                decode_tokens_per_s=batch * timing.decode_steps / timing.decode_s,
                step_median_ms=timing.step_median_s * 1e3)
    for impl in impls:
        row, s = rows[impl.name], samples[impl.name]
        if "error" in row:
            continue
        row.setdefault("same_tokens_every_round", True)
        row.update(rounds=opts.rounds, generate_ms=s.median("total_ms"),
                   first_token_ms=s.median("first_token_ms"),
                   decode_tokens_per_s=s.median("decode_tokens_per_s"),
                   decode_tokens_per_s_rounds=s.values["decode_tokens_per_s"],
                   step_median_ms=s.median("step_median_ms"))
        row["step_tokens_per_s"] = batch * 1e3 / row["step_median_ms"]
    _check_agreement(model, ids, impls, rows, tokens, opts.tie_ulps)
    return list(rows.values())


def _check_agreement(model, ids, impls: list, rows: dict, tokens: dict, tie_ulps: float) -> None:
    """Judge every implementation's tokens by the baseline (see model_agreement)."""
    import torch

    use_impl(model, parse_impl(BASELINE))
    forbidden = _forbidden(model)
    dtype = next(model.parameters()).dtype
    reference = tokens.get(BASELINE)
    judged = []
    for impl in impls:
        if impl.name not in tokens:
            continue
        row = rows[impl.name]
        try:
            logits = agreement.baseline_logits(model, ids, tokens[impl.name], forbidden)
        except torch.cuda.OutOfMemoryError as e:
            row["agreement_error"] = error_text(e)
            continue
        verdict = agreement.judge(logits, tokens[impl.name], dtype, tie_ulps)
        del logits
        if reference is not None:
            verdict.update(agreement.equal_to(tokens[impl.name], reference))
        row["agreement"] = verdict
        # Capacity mode drops assignments: its tokens are reported, not judged.
        row["agreement_checked"] = impl.capacity_factor is None
        verdict["identical"] = (reference is not None
                                and verdict["sequences_equal_baseline"] == verdict["sequences"])
        judged.append((impl, row, verdict))
    own = rows.get(BASELINE, {}).get("agreement", {}).get("disagree")
    for impl, row, verdict in judged:
        verdict["baseline_disagree"] = own
        verdict["disagree_allowed"] = agreement.allowed_disagreements(own)
        row["ok"] = (verdict["identical"] or verdict["disagree"] <= verdict["disagree_allowed"]
                     if impl.capacity_factor is None else None)


def run_family(family: Family, opts: M1Options) -> dict:
    """Prefill and decode rows of one family, on one model built here and
    freed before returning."""
    import gc

    import torch

    impls = [parse_impl(name) for name in opts.impls]
    log(f"M1 {family.key}: building {family.name} ({family.dtype}) on {opts.device}")
    model = build_model(family, opts.device)
    try:
        prefill = measure_prefill(model, family, impls, opts)
        decode = []
        for cache in opts.caches:
            for batch in opts.batches:
                decode += measure_decode(model, family, impls, cache, batch, opts)
                log(f"M1 {family.key} decode, {cache} cache, batch {batch} done")
    finally:
        del model
        gc.collect()
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    return {"prefill": prefill, "decode": decode}


def add_ratios(rows: list, key: str, higher_is_better: bool, group: tuple, name: str = "speedup") -> None:
    """x faster than grouped_mm and than eager (`{name}_vs_grouped_mm`, ...),
    per group of rows (same family, cache, batch): baseline over this row for
    times, this row over baseline for rates."""
    for row in rows:
        if key not in row:
            continue
        for base in ("grouped_mm", "eager"):
            ref = next((r for r in rows if r["impl"] == base and key in r
                        and all(r.get(g) == row.get(g) for g in group)), None)
            if ref is not None:
                ratio = row[key] / ref[key] if higher_is_better else ref[key] / row[key]
                row[f"{name}_vs_{base}"] = ratio


def add_memory_ratios(prefill: list) -> None:
    """peak / grouped_mm: this row's peak memory over grouped_mm's (same family)."""
    for row in prefill:
        base = next((r for r in prefill if r["family"] == row["family"] and r["impl"] == "grouped_mm"
                     and r.get("peak_allocated_bytes")), None)
        if base is not None and row.get("peak_allocated_bytes") is not None:
            row["peak_over_grouped_mm"] = row["peak_allocated_bytes"] / base["peak_allocated_bytes"]
