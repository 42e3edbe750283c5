"""Q1's scoring cost, its output: the JSON (one row per line), the merge of
kvpress's half into the library's (the same token ids, device, dtype,
prompt and weights, or no merge), and the scoring-cost tables of docs/kv.md."""

from __future__ import annotations

import json


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
