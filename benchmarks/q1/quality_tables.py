"""Q1's quality figures from measured losses and trials, and the markdown
tables of docs/kv.md: perplexity as a multiple of the full cache's, the
passkey trials passed per run, rendered from a result JSON (a run's or a
merged one). No model, no idempotent_moe."""

from __future__ import annotations

import math

from .steps import mean


def ppl_ratios(setting: dict) -> dict:
    """{label: {budget: mean over docs of ppl / full ppl}}."""
    table: dict = {}
    for row in setting.values():
        full = math.exp(mean(row["full"]))
        for key, losses in row.items():
            if key == "full" or ":" in key:
                continue
            label, budget = key.rsplit("@", 1)
            table.setdefault(label, {}).setdefault(int(budget), []).append(math.exp(mean(losses)) / full)
    return {label: {b: mean(v) for b, v in sorted(per.items())} for label, per in table.items()}


def passkey_table(pk: dict) -> dict:
    """{run: {"passed", "trials"}} of passkey trials (as run, or compact)."""
    table: dict = {}
    for row in pk["trials"]:
        if "passed" in row and isinstance(row["passed"], list):
            runs = pk_runs(pk)
            row = {k: k in row["passed"] for k in runs}
        for key, ok in row.items():
            if key in ("trial", "depth", "key"):
                continue
            table.setdefault(key, []).append(bool(ok))
    return {k: {"passed": sum(v), "trials": len(v)} for k, v in table.items()}


def pk_runs(pk: dict) -> list:
    """Every run of a compact passkey setting: full and policy@budget."""
    return ["full"] + [f"{p}@{b}" for p in pk["policies"] for b in pk["budgets"]]


def markdown_tables(result: dict) -> str:
    """The Q1 tables of docs/kv.md from a result JSON."""
    budgets = result["budgets"]
    head = "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |\n"
    rule = "|---|" + "---|" * len(budgets) + "\n"

    def rows(table, prefix):
        out = ""
        for label, per in table.items():
            per = {int(k): v for k, v in per.items()}  # JSON keys are strings
            cells = [f"{per[b]:.3f}" if b in per else "" for b in budgets]
            out += f"| {prefix}{label} | " + " | ".join(cells) + " |\n"
        return out

    def passkey_rows(pk, prefix):
        out = ""
        full = pk.get("full")
        if full:
            cell = f"{full['passed']}/{full['trials']}"
            out += f"| {prefix}full cache | " + " | ".join(cell for _ in budgets) + " |\n"
        labels = list(dict.fromkeys(k.rsplit("@", 1)[0] for k in pk if "@" in k))
        for label in labels:
            cells = []
            for b in budgets:
                c = pk.get(f"{label}@{b}")
                cells.append(f"{c['passed']}/{c['trials']}" if c else "")
            out += f"| {prefix}{label} | " + " | ".join(cells) + " |\n"
        return out

    text = ""
    if "prefill_ppl_ratio" in result:
        text += "Prefill (prompt compressed once), perplexity / full cache's:\n\n" + head + rule
        text += rows(result["prefill_ppl_ratio"], "library: ")
        text += rows(result.get("kvpress_prefill_ppl_ratio", {}), "kvpress: ") + "\n"
    if "decode_ppl_ratio" in result:
        text += (f"Decode (eviction every {result['evict_every']} tokens, teacher-forced), "
                 "perplexity / full cache's:\n\n" + head + rule)
        text += rows(result["decode_ppl_ratio"], "library: ") + "\n"
    if "passkey_table" in result:
        text += "Passkey retrieval, prefill setting (passed / trials):\n\n" + head + rule
        text += passkey_rows(result["passkey_table"], "library: ")
        text += passkey_rows(result.get("kvpress_passkey_table", {}), "kvpress: ") + "\n"
    if "passkey_decode_table" in result:
        text += ("Passkey retrieval, decode setting (the prompt streamed through the cache, "
                 "passed / trials):\n\n" + head + rule)
        full = {"full": result["passkey_table"]["full"]} if "passkey_table" in result else {}
        text += passkey_rows({**full, **result["passkey_decode_table"]}, "library: ")
    return text.rstrip("\n") + "\n"
