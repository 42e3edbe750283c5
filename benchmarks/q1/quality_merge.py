"""Merging Q1's quality runs into the committed result: settings run apart
(in parallel, passkey trials split over processes) and kvpress's runs
combined into one compact JSON of figures (`--merge`), and a merged result
updated with newer runs' figures (`--update`)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from .quality_tables import passkey_table, ppl_ratios
from .settings import DECODE_POLICIES, PASSKEY_POLICIES, PREFILL_POLICIES

# What a merged result keeps of each run: its settings and figures, not the per-token losses or
# the token ids (rerun the script to get them).
META = ("measurement", "model", "quick", "dtype", "threads", "budgets", "device", "prompt_tokens",
        "continuation_tokens", "evict_every", "decode_recent_fraction", "sink_tokens", "docs",
        "passkey_prompt_tokens", "passkey_trial_count", "torch", "transformers", "python", "commit",
        "dirty")


def compact_trials(pk: dict) -> dict:
    """Passkey trials as figures: each trial's depth, key and the runs that passed."""
    trials = [{"depth": row["depth"], "key": row["key"],
               "passed": [k for k, ok in row.items() if k not in ("trial", "depth", "key") and ok]}
              for row in pk["trials"]]
    return {k: v for k, v in pk.items() if k != "trials"} | {"trials": trials}


def add_trials(pk: dict | None, more: dict) -> dict:
    """Passkey trials split over runs, merged in order, each trial once (a
    row without its index is at its place in its run)."""
    pk = {"trials": []} if pk is None else pk
    pk.update({k: v for k, v in more.items() if k != "trials"})
    have = {row["trial"] for row in pk["trials"]}
    pk["trials"] = sorted(pk["trials"] + [{**row, "trial": row.get("trial", i)}
                                          for i, row in enumerate(more["trials"])
                                          if row.get("trial", i) not in have],
                          key=lambda row: row["trial"])
    return pk


def merge_runs(paths: list, kvpress_json: list | None) -> dict:
    """One compact result of several runs of this script (settings run apart,
    in parallel) and of kvpress's runs: the settings, the runs, and the
    figures (perplexity ratios, passkey trials and counts, memory, check)."""
    merged: dict = {"runs": []}
    raw: dict = {"prefill": {}, "decode": {}}
    for path in paths:
        run = json.loads(Path(path).read_text())
        for key in META:
            if key in run and key not in merged:
                merged[key] = run[key]
        merged["runs"].append({"file": Path(path).name, "settings": run.get("settings"),
                               "commit": run.get("commit"), "dirty": run.get("dirty"),
                               "started": run.get("started"), "finished": run.get("finished"),
                               **({"superseded": run["superseded"]} if "superseded" in run else {})})
        for setting in ("prefill", "decode"):  # rows of each document, merged
            for doc, row in run.get(setting, {}).items():
                raw[setting].setdefault(doc, {}).update(row)
        for key in ("passkey", "passkey_decode"):
            if run.get(key, {}).get("trials"):
                merged[key] = add_trials(merged.get(key), run[key])
        if "memory" in run:
            merged["memory"] = run["memory"]
        if "check" in run:
            merged["check"] = {k: v for k, v in run["check"].items() if k != "nll"}
    for setting in ("prefill", "decode"):
        if raw[setting]:
            merged[f"{setting}_ppl_ratio"] = ppl_ratios(raw[setting])
    for key in ("passkey", "passkey_decode"):
        if key in merged:
            merged[f"{key}_table"] = passkey_table(merged[key])
            merged[key] = compact_trials(merged[key])
    if kvpress_json:
        kv_raw: dict = {"prefill": {}, "passkey": {"trials": []}}
        merged["kvpress"] = {"runs": []}
        for path in kvpress_json:
            kv = json.loads(Path(path).read_text())
            for key in ("kvpress_version", "transformers", "torch"):
                merged["kvpress"].setdefault(key, kv.get(key))
            merged["kvpress"]["runs"].append({"file": Path(path).name, "threads": kv.get("threads"),
                                              "commit": kv.get("commit"), "dirty": kv.get("dirty"),
                                              "started": kv.get("started"),
                                              "finished": kv.get("finished")})
            for doc, row in kv.get("prefill", {}).items():
                kv_raw["prefill"].setdefault(doc, {}).update(row)
            if kv.get("passkey", {}).get("trials"):
                kv_raw["passkey"] = add_trials(kv_raw["passkey"], kv["passkey"])
        if kv_raw["prefill"]:
            merged["kvpress_prefill_ppl_ratio"] = kvpress_ratios(kv_raw, raw["prefill"])
        if kv_raw["passkey"]["trials"]:
            merged["kvpress_passkey_table"] = passkey_table(kv_raw["passkey"])
            merged["kvpress"]["passkey"] = compact_trials(kv_raw["passkey"])
    return merged


def update_merged(base: dict, paths: list) -> dict:
    """A merged result (`--merge`'s) with the figures of newer runs of this
    script replacing its own where both measured: a perplexity row (label
    and budget), a run's outcome in each passkey trial (the new run must
    cover every trial of the base, with the same prompts: its full cache
    must pass the same trials), the check. The new runs are listed after
    the base's, each with its commit."""
    merged = copy.deepcopy(base)
    raw: dict = {"prefill": {}, "decode": {}}
    for path in paths:
        run = json.loads(Path(path).read_text())
        merged["runs"].append({"file": Path(path).name, "settings": run.get("settings"),
                               "commit": run.get("commit"), "dirty": run.get("dirty"),
                               "started": run.get("started"), "finished": run.get("finished"),
                               "updates": "the rows it measured"})
        for setting in ("prefill", "decode"):
            for doc, row in run.get(setting, {}).items():
                raw[setting].setdefault(doc, {}).update(row)
        for key in ("passkey", "passkey_decode"):
            new = run.get(key, {}).get("trials")
            if not new:
                continue
            pk = merged[key]
            # rows of the decode setting's older runs carry no index: their place is it
            at = {row.get("trial", i): row for i, row in enumerate(pk["trials"])}
            new = [{"trial": i, **row} for i, row in enumerate(new)]
            if sorted(at) != sorted(row["trial"] for row in new):
                raise SystemExit(f"{path}: {key} trials {[r['trial'] for r in new]} are not the base's")
            measured = [k for k in new[0] if "@" in k]
            for row in new:
                old = at[row["trial"]]
                # the full cache's outcome, where the setting measures one (the decode setting does not)
                full = ("full" in old["passed"]) if "passed" in old else old.get("full")
                if old["key"] != row["key"] or ("full" in row and full != row["full"]):
                    raise SystemExit(f"{path}: trial {row['trial']} is not the base's")
                if "passed" in old:
                    old["passed"] = [k for k in old["passed"] if k not in measured] + \
                        [k for k in measured if row[k]]
                else:
                    old.update({k: row[k] for k in measured})
            table = merged[f"{key}_table"]
            for k in measured:
                table[k] = {"passed": sum(bool(r[k]) for r in new), "trials": len(new)}
            order = ["full", *PASSKEY_POLICIES]  # rows in the script's order
            merged[f"{key}_table"] = dict(sorted(table.items(), key=lambda kv: _rank(order, kv[0])))
            pk["policies"] += [p for p in dict.fromkeys(k.rsplit("@", 1)[0] for k in measured)
                               if p not in pk["policies"]]
        if "check" in run:
            merged["check"] = {k: v for k, v in run["check"].items() if k != "nll"}
    prefill_order = [label for label, _ in PREFILL_POLICIES]
    for setting, order in (("prefill", prefill_order), ("decode", DECODE_POLICIES)):
        if raw[setting]:
            table = merged[f"{setting}_ppl_ratio"]
            for label, per in ppl_ratios(raw[setting]).items():
                table.setdefault(label, {}).update({str(b): v for b, v in per.items()})
            merged[f"{setting}_ppl_ratio"] = dict(sorted(table.items(), key=lambda kv: _rank(order, kv[0])))
    return merged


def _rank(order: list, key: str) -> int:
    """Where a row (a label, or label@budget) sorts: its label's place in
    `order`, rows of other labels after them in their own order."""
    label = key.rsplit("@", 1)[0]
    return order.index(label) if label in order else len(order)


def dumps(result: dict) -> str:
    """JSON with one line per innermost list or dict of figures."""
    text = json.dumps(result, indent=1)
    # a passkey trial, or a ratio row, on one line
    return re.sub(r"\{\n\s*(\"depth\"[^{}]*?)\n\s*\}",
                  lambda m: "{" + re.sub(r"\s*\n\s*", " ", m.group(1)).replace("[ ", "[")
                  .replace(" ]", "]") + "}", text)


def kvpress_ratios(kv: dict, library_prefill: dict) -> dict:
    """kvpress's perplexity over its own full cache (else the library's) on the same tokens."""
    merged = {}
    for name, row in kv.get("prefill", {}).items():
        if "full" in row:
            merged[name] = row
        elif name in library_prefill:
            merged[name] = {"full": library_prefill[name]["full"], **row}
    return ppl_ratios(merged)


