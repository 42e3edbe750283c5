"""Q1, scoring cost: what each KV policy's eviction costs in time, against
kvpress's presses. The measurement: its timers and its rounds.

SmolLM2-135M-Instruct as in Q1 (data.load_model: fp32, eager attention,
CPU, one thread; pin the process to one core: `taskset -c 1`). Two
settings, both libraries (cost_library.py, cost_kvpress.py):

- prefill: a 2,048-token prompt (the first document of Q1) compressed once to
  `budget` (256 and 1,024) as each layer's forward ends (the library's
  `attach(model)` default, kvpress's forward hook). Per forward: the host
  wall time of the whole prompt forward, and inside it the eviction of each
  layer, timed by wrapping the calls: the library's `_eviction` (judging and
  scoring) and `_compact` (the in-place compaction and the move into the
  steady buffer), and the statistics its hooks keep during the forward
  (`accumulate_attention`, the query hook: "stats"); kvpress's
  `press.score` and `press.compress` (score, then topk and gather: the
  compaction is compress minus score).
- decode: a 1,024-token prompt (compressed to the budget as above when it
  is larger), 64 steps of one token to fill the buffer to budget + 64, then
  64 timed steps of one token each (teacher-forced from the document),
  which hold exactly one eviction (`evict_every` = 64): the library's
  decode cache of Q1 (`policies.decode_cache`: a recent window of a quarter of the
  budget for the scored policies), kvpress's `DecodingPress(press,
  compression_interval=64, target_size=budget)`. The step time is the 64
  steps' wall time / 64.

Configurations are interleaved within each round (the order rotated each
round); figures are medians over the rounds. The full cache
(transformers' DynamicCache) is timed in the same rounds.

On a GPU (`--device cuda`, bf16 unless `--dtype float32`) the model and
inputs live on the device and every timed boundary (the whole forward, each
wrapped call, the statistics) synchronises the device before the clock is
read (`TIMERS.sync`): the host cannot run ahead of the GPU inside a timed
forward, alike for both libraries and the full cache. Nothing here imports
idempotent_moe or kvpress."""

from __future__ import annotations

import gc
import statistics
import time

import torch


class Timers:
    """Seconds spent in wrapped calls, per name and layer, while `on`."""

    def __init__(self):
        self.on = False
        self.t: dict = {}
        self._undo: list = []
        self.sync = None  # torch.cuda.synchronize on a GPU: called before each clock reading

    def reset(self):
        self.t = {}

    def wrap(self, owner, attr: str, name: str, layer_of) -> None:
        orig = getattr(owner, attr)
        had_own = attr in vars(owner)

        def timed(*args, **kwargs):
            if not self.on:
                return orig(*args, **kwargs)
            if self.sync:
                self.sync()
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                if self.sync:
                    self.sync()
                per = self.t.setdefault(name, {})
                layer = layer_of(args)
                per[layer] = per.get(layer, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, orig if had_own else None))

    def unwrap(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
        self._undo = []

    def totals(self) -> dict:
        """{name: (seconds over every layer, layers)}."""
        return {name: (sum(per.values()), len(per)) for name, per in self.t.items()}


TIMERS = Timers()


def timed(run) -> dict:
    """Wall time of run() and the wrapped calls inside it, in ms."""
    gc.collect()
    TIMERS.reset()
    TIMERS.on = True
    if TIMERS.sync:
        TIMERS.sync()
    t0 = time.perf_counter()
    try:
        run()
    finally:
        if TIMERS.sync:
            TIMERS.sync()
        wall = time.perf_counter() - t0
        TIMERS.on = False
    out = {"wall_ms": wall * 1e3}
    for name, (s, layers) in TIMERS.totals().items():
        out[f"{name}_ms"] = s * 1e3
        out["layers"] = max(out.get("layers", 0), layers)
    if "compress_ms" in out:  # kvpress: compress = score + topk + gather
        out["evict_ms"] = out.pop("compress_ms")
        out["compact_ms"] = out["evict_ms"] - out.get("score_ms", 0.0)
    elif "score_ms" in out or "compact_ms" in out:
        out["evict_ms"] = out.get("score_ms", 0.0) + out.get("compact_ms", 0.0)
    return out


def run_rounds(lib: str, prefill, decode, model, ids, budgets, policies, settings, rounds, prompt, context,
               steps, log, checkpoint=None) -> list:
    """Every configuration of `lib` (its `prefill` and `decode` measures,
    cost_library's or cost_kvpress's), each setting's rounds interleaved,
    the order rotated each round: a row per configuration, its medians (or
    the error it raised). `checkpoint(rows)`, where given, receives the rows
    measured so far after every round (a run stopped by a time limit keeps
    them)."""
    configs = [("full", None)] + [(p, b) for b in budgets for p in policies]
    runs = {}
    with torch.no_grad():  # warm-up: every configuration once on a short prompt, untimed
        prefill(model, ids[:, :prompt], "full", None)
        for p in policies:
            b = min(budgets)
            n = min(prompt, 2 * b + 64)
            try:
                prefill(model, ids[:, :n], p, b)
            except Exception as e:  # noqa: BLE001  recorded by the rounds below
                log(f"warm-up {p}: {type(e).__name__}: {e}")
    for setting in settings:
        if setting not in ("prefill", "decode"):
            continue
        for r in range(rounds):
            k = r % len(configs)
            for policy, budget in configs[k:] + configs[:k]:
                key = (setting, policy, budget)
                if key in runs and runs[key] is None:
                    continue  # failed before
                try:
                    if setting == "prefill":
                        res = prefill(model, ids[:, :prompt], policy, budget)
                    else:
                        res = decode(model, ids, policy, budget, context, steps)
                except Exception as e:  # noqa: BLE001  a press that cannot run here: recorded
                    log(f"{setting} {policy}@{budget}: {type(e).__name__}: {e}")
                    runs[key] = None
                    runs[(setting, policy, budget, "error")] = f"{type(e).__name__}: {e}"[:200]
                    continue
                runs.setdefault(key, []).append(res)
            log(f"{lib} {setting} round {r + 1}/{rounds} done")
            if checkpoint is not None:
                checkpoint(_rows(lib, runs, configs))
    return _rows(lib, runs, configs)


def _rows(lib: str, runs: dict, configs: list) -> list:
    """run_rounds' rows from its runs so far: medians, or the error."""
    rows = []
    for key, got in runs.items():
        if len(key) == 4:
            continue
        setting, policy, budget = key
        row = {"lib": lib, "setting": setting, "policy": policy, "budget": budget}
        if got is None:
            row["error"] = runs[(*key, "error")]
        else:
            for field in got[0]:
                vals = [g[field] for g in got if field in g]
                med = statistics.median(vals)
                row[field] = int(med) if field == "layers" else round(med, 3)
            row["rounds"] = len(got)
            if row.get("layers") and "evict_ms" in row:
                row["evict_layer_ms"] = round(row["evict_ms"] / row["layers"], 3)
        rows.append(row)
    order = {c: i for i, c in enumerate(configs)}
    rows.sort(key=lambda r: (r["setting"] != "prefill", order[(r["policy"], r["budget"])]))
    return rows
