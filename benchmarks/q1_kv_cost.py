"""Q1, scoring cost: what each KV policy's eviction costs in time, against kvpress's presses.

SmolLM2-135M-Instruct as in Q1 (`q1_kv_quality.py`'s loading, fp32, eager
attention, CPU, one thread; pin the process to one core: `taskset -c 1`).
Two settings, both libraries:

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
  decode cache of Q1 (`decode_cache`: a recent window of a quarter of the
  budget for the scored policies), kvpress's `DecodingPress(press,
  compression_interval=64, target_size=budget)`. The step time is the 64
  steps' wall time / 64.

Configurations are interleaved within each round (the order rotated each
round); figures are medians over the rounds. The full cache
(transformers' DynamicCache) is timed in the same rounds.

Memory (`--settings memory`): the bytes of the K and V tensors the cache
holds (distinct storages), sampled at the end of every attention layer's
forward, before and after its compression (hooks registered around the
library's or kvpress's own), during one 2,048-token prefill; the peak is the
largest sample. The transient buffer of a layer's compaction (the library's
steady buffer, kvpress's gathered copy, each at most budget + 128 tokens of
one layer) is not sampled.

kvpress (transformers < 5.3) runs in its own environment with
`--kvpress-run --out kv.json`; `--kvpress-json kv.json` merges it into --out.

On a GPU (`--device cuda`, bf16 unless `--dtype float32`) the model and
inputs live on the device and every timed boundary (the whole forward, each
wrapped call, the statistics) synchronises the device before the clock is
read: the host cannot run ahead of the GPU inside a timed forward, alike for
both libraries and the full cache. The memory setting adds the peak of
torch's CUDA allocations during the prefill, above what was allocated before
it (the K/V, activations and the compactions' transient buffers).
`--random-weights` builds SmolLM2-135M's architecture (`SMOLLM2_135M`) with
seeded random weights and feeds seeded pseudo-random token ids of the same
length, where the GGUF file (and its tokenizer) is not at hand: the times do
not depend on the weights or ids. `--prompt-len` sets the prefill prompt
(2,048 by default; the decode setting's prompt stays 1,024 tokens); past
SmolLM2's 8,192 positions it needs `--random-weights`, whose config then
extends `max_position_embeddings` to the prompt.

    taskset -c 1 python benchmarks/q1_kv_cost.py --out cost.json          # the library
    taskset -c 1 .../venv-kvpress/bin/python benchmarks/q1_kv_cost.py --kvpress-run --out kv.json
    python benchmarks/q1_kv_cost.py --out cost.json --kvpress-json kv.json  # merge
    python benchmarks/q1_kv_cost.py --quick --out q.json                   # seconds: a tiny model
    python benchmarks/q1_kv_cost.py --device cuda --random-weights --prompt-len 8192 --out gpu.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import q1_kv_quality as q1  # noqa: E402  (its model, documents, policies, decode cache)
import torch  # noqa: E402

BUDGETS = (256, 1024)
PROMPT, CONTEXT, EVICT_EVERY = 2048, 1024, 64
LIB_POLICIES = ("streaming_llm", "knorm", "keydiff", "tova", "observed_attention", "snapkv",
                "expected_attention", "auto")
KVPRESS_PRESSES = ("StreamingLLMPress", "KnormPress", "KeyDiffPress", "TOVAPress",
                   "ObservedAttentionPress", "SnapKVPress", "ExpectedAttentionPress")
MEMORY_POLICY = {"library": "snapkv", "kvpress": "SnapKVPress"}
# SmolLM2-135M-Instruct's architecture for --random-weights, read from the GGUF file's config the
# way q1_kv_quality.load_model loads it (AutoConfig.from_pretrained(gguf_dir(), gguf_file=GGUF),
# transformers 5.25); rms_norm_eps is the file's float32 1e-5.
SMOLLM2_135M = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


# --------------------------------------------------------------------------- timers


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


def wrap_library() -> None:
    from idempotent_moe.integrations.hf_cache import InplaceEvictionCache, InplaceEvictionLayer

    TIMERS.wrap(InplaceEvictionLayer, "_eviction", "score", lambda a: a[0].layer_idx)
    TIMERS.wrap(InplaceEvictionLayer, "_compact", "compact", lambda a: a[0].layer_idx)
    TIMERS.wrap(InplaceEvictionLayer, "accumulate_attention", "stats", lambda a: a[0].layer_idx)
    TIMERS.wrap(InplaceEvictionCache, "_query_hook", "stats", lambda a: a[1].layer_idx)


def wrap_press(press) -> None:
    """Time a kvpress ScorerPress instance's score and compress (per layer:
    the attention module is their first argument)."""
    TIMERS.wrap(press, "score", "score", lambda a: a[0].layer_idx)
    TIMERS.wrap(press, "compress", "compress", lambda a: a[0].layer_idx)


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


# --------------------------------------------------------------------------- the library


def lib_prefill_cache(model, policy, budget):
    from idempotent_moe.integrations.hf_cache import InplaceEvictionCache
    from transformers import DynamicCache

    if policy == "full":
        return DynamicCache(config=model.config)
    return InplaceEvictionCache(budget, sink_tokens=4, score=q1.library_policy(policy, budget),
                                config=model.config)


def lib_prefill(model, ids, policy, budget) -> dict:
    cache = lib_prefill_cache(model, policy, budget)
    if policy != "full":
        cache.attach(model)
    try:
        with torch.no_grad():
            out = timed(lambda: q1.forward(model, ids, cache, keep=1))
    finally:
        if policy != "full":
            cache.detach()
    if policy != "full":
        kept = {layer.length for layer in cache.layers}
        if kept != {min(budget, ids.shape[1])}:
            raise RuntimeError(f"{policy}@{budget} kept {kept}")
    return out


def lib_decode(model, ids, policy, budget, context, steps) -> dict:
    from transformers import DynamicCache

    if policy == "full":
        cache = DynamicCache(config=model.config)
    else:
        cache = q1.decode_cache(model, policy, budget, steps, 0.25)
    try:
        with torch.no_grad():
            q1.forward(model, ids[:, :context], cache, keep=1)
            for i in range(context, context + steps):  # fill the buffer: the eviction falls due
                q1.forward(model, ids[:, i:i + 1], cache, keep=1)

            def run():
                for i in range(context + steps, context + 2 * steps):
                    q1.forward(model, ids[:, i:i + 1], cache, keep=1)

            out = timed(run)
    finally:
        if policy != "full":
            cache.detach()
    if policy != "full":
        ev = {layer.evictions for layer in cache.layers}
        # the prompt's own eviction, then the one due after the 64 filling steps, done at the
        # first timed step (the 64th timed step makes the next one due)
        expected = (1 if context > budget else 0) + 1
        if ev != {expected}:
            raise RuntimeError(f"decode {policy}@{budget}: evictions {ev}, expected {expected}")
    out["step_ms"] = out["wall_ms"] / steps
    return out


# --------------------------------------------------------------------------- kvpress (its own venv)


def kv_prefill(model, ids, press_name, budget) -> dict:
    import kvpress
    from transformers import DynamicCache

    cache = DynamicCache()
    n = ids.shape[1]
    with torch.no_grad():
        if press_name == "full":
            return timed(lambda: model(input_ids=ids, past_key_values=cache, use_cache=True,
                                       logits_to_keep=1))
        # kvpress keeps int(n * (1 - ratio)) tokens: half a token above the budget lands on it
        press = getattr(kvpress, press_name)(compression_ratio=1 - (budget + 0.5) / n)
        wrap_press(press)
        try:
            with press(model):
                out = timed(lambda: model(input_ids=ids, past_key_values=cache, use_cache=True,
                                          logits_to_keep=1))
        finally:
            TIMERS.unwrap()
    if cache.get_seq_length() != budget:
        raise RuntimeError(f"{press_name} kept {cache.get_seq_length()} tokens, not {budget}")
    return out


def kv_decode(model, ids, press_name, budget, context, steps) -> dict:
    import kvpress
    from transformers import DynamicCache

    cache = DynamicCache()
    pos = [0]

    def step(lo, hi):
        # positions count on from the tokens seen
        p = torch.arange(pos[0], pos[0] + hi - lo, device=ids.device)[None]
        model(input_ids=ids[:, lo:hi], past_key_values=cache, position_ids=p, use_cache=True,
              logits_to_keep=1)
        pos[0] += hi - lo

    def run():
        for i in range(context + steps, context + 2 * steps):
            step(i, i + 1)

    with torch.no_grad():
        if press_name == "full":
            step(0, context)
            for i in range(context, context + steps):
                step(i, i + 1)
            out = timed(run)
        else:
            press = kvpress.DecodingPress(base_press=getattr(kvpress, press_name)(),
                                          compression_interval=steps, target_size=budget)
            wrap_press(press.base_press)
            try:
                with press(model):
                    step(0, context)  # kvpress compresses nothing while prefilling here
                    for i in range(context, context + steps):  # the first eviction, at step 64
                        step(i, i + 1)
                    out = timed(run)  # the second, at the 64th timed step
            finally:
                TIMERS.unwrap()
            if cache.get_seq_length() != budget:
                raise RuntimeError(f"decode {press_name}@{budget}: {cache.get_seq_length()} tokens")
    out["step_ms"] = out["wall_ms"] / steps
    return out


# --------------------------------------------------------------------------- memory


def kv_bytes(cache) -> int:
    """Bytes of the distinct storages behind the K and V tensors a cache holds."""
    seen, total = set(), 0
    for layer in cache.layers:
        for name in ("_k", "_v") if hasattr(layer, "_k") else ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel():
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
    return total


def memory_run(model, ids, lib: str, policy: str, budget: int | None) -> dict:
    """Peak K/V bytes of one prefill, sampled before and after each layer's
    compression (see the module's docstring); on a GPU also the peak of
    torch's allocations during it, above what was allocated before."""
    from transformers import DynamicCache

    samples = []
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
               and hasattr(m, "num_key_value_groups")]
    hooks = []

    def sample(*_):
        samples.append(kv_bytes(cache))

    def hook_all():
        return [m.register_forward_hook(sample) for m in modules]

    press = None
    if policy == "full":
        cache = DynamicCache(config=model.config) if lib == "library" else DynamicCache()
    elif lib == "library":
        cache = lib_prefill_cache(model, policy, budget)
    else:
        import kvpress

        cache = DynamicCache()
        press = getattr(kvpress, policy)(compression_ratio=1 - (budget + 0.5) / ids.shape[1])
    if ids.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        hooks += hook_all()  # before the compression's own hook
        with torch.no_grad():
            if press is not None:
                with press(model):
                    hooks += hook_all()  # after it
                    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            else:
                if lib == "library" and policy != "full":
                    cache.attach(model)
                    hooks += hook_all()
                q1.forward(model, ids, cache, keep=1)
    finally:
        for h in hooks:
            h.remove()
        if lib == "library" and policy != "full":
            cache.detach()
    out = {"lib": lib, "policy": policy, "budget": budget, "peak_kv_bytes": max(samples),
           "final_kv_bytes": kv_bytes(cache)}
    if ids.is_cuda:
        torch.cuda.synchronize()
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    return out


# --------------------------------------------------------------------------- rounds


def run_rounds(lib: str, model, ids, budgets, policies, settings, rounds, context, steps, log) -> list:
    prefill = (lib_prefill if lib == "library" else kv_prefill)
    decode = (lib_decode if lib == "library" else kv_decode)
    configs = [("full", None)] + [(p, b) for b in budgets for p in policies]
    runs = {}
    with torch.no_grad():  # warm-up: every configuration once on a short prompt, untimed
        prefill(model, ids[:, :PROMPT], "full", None)
        for p in policies:
            b = min(budgets)
            n = min(PROMPT, 2 * b + 64)
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
                        res = prefill(model, ids[:, :PROMPT], policy, budget)
                    else:
                        res = decode(model, ids, policy, budget, context, steps)
                except Exception as e:  # noqa: BLE001  a press that cannot run here: recorded
                    log(f"{setting} {policy}@{budget}: {type(e).__name__}: {e}")
                    runs[key] = None
                    runs[(setting, policy, budget, "error")] = f"{type(e).__name__}: {e}"[:200]
                    continue
                runs.setdefault(key, []).append(res)
            log(f"{lib} {setting} round {r + 1}/{rounds} done")
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


# --------------------------------------------------------------------------- the model


def random_config(prompt: int):
    """SmolLM2-135M's config, its positions extended to the prompt where that
    is longer than SmolLM2's 8,192; eager attention, as Q1 loads the model."""
    from transformers import LlamaConfig

    arch = dict(SMOLLM2_135M)
    arch["max_position_embeddings"] = max(arch["max_position_embeddings"], prompt)
    config = LlamaConfig(**arch)
    config._attn_implementation = "eager"
    return config


def random_model(prompt: int, device, dtype):
    """SmolLM2-135M's architecture with seeded random weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(random_config(prompt))
    return model.to(dtype).eval()


def random_ids(n: int, vocab: int) -> list:
    """Seeded pseudo-random token ids (the times do not depend on them)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3)).tolist()


# --------------------------------------------------------------------------- output


def machine(device: torch.device) -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    gpu = {}
    if device.type == "cuda":
        gpu = {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return {"cpu": cpu, "cpu_affinity": affinity, "threads": torch.get_num_threads(), **gpu,
            "torch": torch.__version__, "transformers": q1._version("transformers"),
            "python": platform.python_version(), **q1.git_commit()}


def dumps(result: dict) -> str:
    """JSON with one row per line."""
    items = list(result.items())
    lines = ["{"]
    for i, (k, v) in enumerate(items):
        if isinstance(v, list) and v and isinstance(v[0], dict):
            body = "[\n" + ",\n".join("  " + json.dumps(r) for r in v) + "\n ]"
        else:
            body = json.dumps(v)
        lines.append(f" {json.dumps(k)}: {body}" + ("," if i < len(items) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"


def merge(result: dict, kv: dict) -> dict:
    if kv.get("tokens_sha256") != result.get("tokens_sha256"):
        raise SystemExit("kvpress ran on other token ids than the library")
    for k in ("device", "dtype", "prompt_tokens", "random_weights"):
        if k in kv and k in result and kv[k] != result[k]:
            raise SystemExit(f"kvpress ran with {k} {kv[k]!r}, the library with {result[k]!r}")
    result = dict(result)
    result["kvpress"] = {k: kv[k] for k in ("kvpress_version", "started", "finished", "rounds")
                         if k in kv} | kv["machine"]
    result["rows"] = [r for r in result["rows"] if r["lib"] != "kvpress"] + kv["rows"]
    result["memory"] = [m for m in result.get("memory", []) if m["lib"] != "kvpress"] + kv.get("memory", [])
    return result


def _ms(v) -> str:
    return "" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def markdown_tables(result: dict) -> str:
    """The scoring-cost tables of docs/kv.md from a result JSON."""
    budgets = result["budgets"]
    rows = {(r["lib"], r["setting"], r["policy"], r["budget"]): r for r in result["rows"]}
    libs = [lib for lib in ("library", "kvpress") if any(k[0] == lib for k in rows)]
    text = ""
    if result.get("device", "cpu") != "cpu":
        text += (f"{result['machine'].get('gpu', result['device'])}, {result['dtype']}, "
                 f"{result['model']}:\n\n")
    for setting in ("prefill", "decode"):
        if not any(k[1] == setting for k in rows):
            continue
        if setting == "prefill":
            what = (f"Prefill ({result['prompt_tokens']:,}-token prompt compressed once), ms: eviction "
                    "= scoring + compaction over every layer (per layer); stats = the attention "
                    "totals and queries the library's hooks keep during the forward; prefill = "
                    "the whole forward")
            cols = ("eviction", "stats", "prefill")
        else:
            what = (f"Decode (a {result['context_tokens']:,}-token prompt, then steps of one token, "
                    f"an eviction every {result['evict_every']}), ms: eviction = one eviction over "
                    f"every layer (per layer); step = {result['evict_every']} steps' time / "
                    f"{result['evict_every']}, the eviction included")
            cols = ("eviction", "stats", "step")
        head = "| policy | " + " | ".join(f"{c} @{b}" for b in budgets for c in cols) + " |\n"
        text += what + f", medians of {result['rounds']} rounds:\n\n" + head
        text += "|---|" + "---|" * (len(cols) * len(budgets)) + "\n"
        for lib in libs:
            names = list(dict.fromkeys(k[2] for k in rows if k[0] == lib and k[1] == setting))
            for name in names:
                cells = []
                for b in budgets:
                    r = rows.get((lib, setting, name, None if name == "full" else b), {})
                    for c in cols:
                        if "error" in r:
                            cells.append("failed" if c == "eviction" else "")
                        elif c == "eviction":
                            cells.append(f"{_ms(r['evict_ms'])} ({_ms(r['evict_layer_ms'])})"
                                         if "evict_ms" in r else "")
                        elif c == "stats":
                            cells.append(_ms(r.get("stats_ms")))
                        elif c == "prefill":
                            cells.append(_ms(r.get("wall_ms")))
                        else:
                            cells.append(_ms(r.get("step_ms")))
                label = "full cache" if name == "full" else name
                text += f"| {lib}: {label} | " + " | ".join(cells) + " |\n"
        text += "\n"
    memory = result.get("memory") or []
    for field, what in (("peak_kv_bytes", "Peak K/V bytes of a {:,}-token prefill, MiB (sampled before "
                                          "and after each layer's compression)"),
                        ("cuda_peak_bytes", "Peak CUDA allocation during a {:,}-token prefill above what "
                                            "was allocated before it, MiB")):
        if not any(field in m for m in memory):
            continue
        text += (what.format(result["prompt_tokens"]) + ":\n\n| cache | " +
                 " | ".join(f"budget {b}" for b in budgets) + " |\n|---|" + "---|" * len(budgets) + "\n")
        mem = {(m["lib"], m["policy"], m["budget"]): m for m in memory}
        for lib, pol in dict.fromkeys((m["lib"], m["policy"]) for m in memory):
            cells = []
            for b in budgets:
                m = mem.get((lib, pol, None if pol == "full" else b), {})
                cells.append(f"{m[field] / 2**20:.1f}" if field in m else "")
            label = "full cache" if pol == "full" else pol
            text += f"| {lib}: {label} | " + " | ".join(cells) + " |\n"
        text += "\n"
    return text.rstrip("\n") + "\n"


def main(argv=None) -> int:
    global PROMPT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="a tiny random model and short inputs: seconds")
    p.add_argument("--settings", default="prefill,decode,memory")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--policies", default=",".join(LIB_POLICIES))
    p.add_argument("--kvpress-run", action="store_true", help="run kvpress (in its own environment)")
    p.add_argument("--kvpress-presses", default=",".join(KVPRESS_PRESSES))
    p.add_argument("--kvpress-json", help="kvpress's JSON to merge into --out")
    p.add_argument("--tables", action="store_true", help="print the markdown tables of --out and exit")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="float32 on the CPU, bfloat16 on cuda unless given")
    p.add_argument("--random-weights", action="store_true",
                   help="SmolLM2-135M's architecture with random weights, pseudo-random token ids")
    p.add_argument("--prompt-len", type=int, default=2048, help="the prefill prompt's tokens")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.tables:
        print(markdown_tables(json.loads(out.read_text())), end="")
        return 0
    if args.kvpress_json:
        out.write_text(dumps(merge(json.loads(out.read_text()),
                                   json.loads(Path(args.kvpress_json).read_text()))))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    positions = SMOLLM2_135M["max_position_embeddings"]
    if args.prompt_len > positions and not (args.quick or args.random_weights):
        p.error(f"--prompt-len past SmolLM2's {positions} positions needs --random-weights")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    TIMERS.sync = torch.cuda.synchronize if device.type == "cuda" else None
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    PROMPT, context, steps = args.prompt_len, CONTEXT, EVICT_EVERY
    if args.quick:
        PROMPT, context, steps = 192, 96, 8
        budgets = [16, 64]

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    lib = "kvpress" if args.kvpress_run else "library"
    if lib == "library":
        wrap_library()
    n_ids = max(PROMPT, context + 2 * steps)  # the decode setting reads past its prompt
    if args.random_weights and not args.quick:
        model = random_model(PROMPT, device, dtype)
        ids = random_ids(n_ids, SMOLLM2_135M["vocab_size"])
        name = "SmolLM2-135M-Instruct's architecture, random weights (seed 0)"
    else:
        model, tok = q1.load_model(args.quick, device)
        model = model.to(dtype)
        ids = next(iter(q1.documents(tok, args.quick, n_ids).values()))
        name = "random tiny Llama" if args.quick else f"SmolLM2-135M-Instruct ({q1.GGUF})"
    ids_t = torch.tensor([ids], device=device)
    settings = args.settings.split(",")
    result = {"measurement": "Q1 scoring cost", "model": name, "quick": args.quick,
              "random_weights": args.quick or args.random_weights,
              "dtype": str(dtype).replace("torch.", ""), "device": device.type, "budgets": budgets,
              "prompt_tokens": PROMPT, "context_tokens": context, "evict_every": steps,
              "rounds": args.rounds, "settings": settings,
              "tokens_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(device)}
    if lib == "library" and device.type == "cuda":
        import idempotent_moe

        result["machine"]["idempotent_moe_cuda"] = idempotent_moe.cuda_available()
    if lib == "kvpress":
        import kvpress

        result["kvpress_version"] = getattr(kvpress, "__version__", None) or q1._version("kvpress")
        policies = args.kvpress_presses.split(",")
    else:
        policies = args.policies.split(",")
    result["rows"] = run_rounds(lib, model, ids_t, budgets, policies, settings, args.rounds, context,
                                steps, log)
    if "memory" in settings:
        pol = MEMORY_POLICY[lib] if not args.quick or lib == "kvpress" else "snapkv"
        result["memory"] = [memory_run(model, ids_t[:, :PROMPT], lib, "full", None)]
        result["memory"] += [memory_run(model, ids_t[:, :PROMPT], lib, pol, b) for b in budgets]
        log(f"memory: {result['memory']}")
    TIMERS.unwrap()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out.write_text(dumps(result))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    sys.exit(main())
