"""Q1: what KV eviction costs in quality, on a real trained model.

The command line of `benchmarks/q1_kv_quality.py`: the library's settings
(quality.py, which defines the measures) on SmolLM2-135M-Instruct, kvpress's
half in its own environment (`--kvpress-run`, quality_kvpress.py: this
module imports the library's half only when it runs it), the merge of runs
into the committed JSON (`--merge`, `--update`, quality_merge.py) and the
tables of docs/kv.md (`--tables`, quality_tables.py).

    python benchmarks/q1_kv_quality.py --out q1.json            # the library
    python benchmarks/q1_kv_quality.py --quick --out q.json     # seconds: a tiny random model
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from .data import DOCS, GGUF, PASSKEY_TOKENS, documents, load_model, passkey_trials
from .provenance import git_commit, version
from .quality_merge import dumps, merge_runs, update_merged
from .quality_tables import markdown_tables, passkey_table, ppl_ratios
from .settings import (
    BUDGETS,
    DECODE_POLICIES,
    FULL,
    KVPRESS_PRESSES,
    PASSKEY_DECODE_POLICIES,
    PASSKEY_POLICIES,
    PREFILL_POLICIES,
    QUICK,
)
from .steps import log


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="a tiny random model and short inputs: seconds")
    p.add_argument("--settings", default="prefill,decode,passkey,passkey_decode,memory,check",
                   help="any of prefill, decode, passkey, passkey_decode, memory, check; none: only "
                        "the token ids (for --kvpress-run)")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--trials", type=int, default=20, help="passkey trials, cycling over the depths")
    p.add_argument("--evict-every", type=int, default=64)
    p.add_argument("--decode-recent", type=float, default=0.25,
                   help="recent window of the scored policies while decoding, a fraction of the budget")
    p.add_argument("--decode-policies", default=",".join(DECODE_POLICIES))
    p.add_argument("--passkey-policies", default=",".join(PASSKEY_POLICIES))
    p.add_argument("--passkey-decode-policies", default=",".join(PASSKEY_DECODE_POLICIES))
    p.add_argument("--prefill-policies", default=",".join(label for label, _ in PREFILL_POLICIES))
    p.add_argument("--docs", type=int, default=len(DOCS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (a CUDA build of idempotent_moe)")
    p.add_argument("--kvpress-run", action="store_true", help="run kvpress (in its own environment)")
    p.add_argument("--kvpress-presses", default=",".join(KVPRESS_PRESSES))
    p.add_argument("--kvpress-settings", default="prefill,passkey")
    p.add_argument("--first-trial", type=int, default=0,
                   help="passkey (prefill setting, and kvpress's) from this trial on: trials split "
                        "over processes, merged by --merge")
    p.add_argument("--last-trial", type=int, default=None,
                   help="passkey (prefill setting) up to this trial, excluded")
    p.add_argument("--tokens", help="a JSON of this script whose token ids kvpress runs on")
    p.add_argument("--kvpress-json", nargs="+", help="kvpress's JSON (one or more) to merge into --out")
    p.add_argument("--merge", nargs="+",
                   help="combine the settings of these runs' JSON into --out: figures only")
    p.add_argument("--update", nargs="+",
                   help="replace the figures of --out (a merged result) with these runs' where both "
                        "measured (update_merged)")
    p.add_argument("--resume", action="store_true", help="keep the decode runs already in --out")
    p.add_argument("--tables", action="store_true", help="print the markdown tables of --out and exit")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.tables:
        print(markdown_tables(json.loads(Path(args.out).read_text())))
        return 0
    if args.merge:
        Path(args.out).write_text(dumps(merge_runs(args.merge, args.kvpress_json)))
        return 0
    if args.update:
        base = json.loads(Path(args.out).read_text())
        Path(args.out).write_text(dumps(update_merged(base, args.update)))
        return 0
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.kvpress_run:
        kvpress_half(args, budgets)
    else:
        library_half(args, budgets)
    return 0


def kvpress_half(args, budgets) -> None:
    """kvpress's presses on the token ids of --tokens, --out rewritten after each unit of work."""
    from .quality_kvpress import kvpress_run

    data = json.loads(Path(args.tokens).read_text())
    out = Path(args.out)
    earlier = json.loads(out.read_text()) if args.resume and out.exists() else None
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    for partial in kvpress_run(data, budgets, args.kvpress_presses.split(","),
                               args.kvpress_settings.split(","), log, earlier, args.first_trial):
        partial.setdefault("started", started)
        partial["threads"] = args.threads
        partial["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        out.write_text(json.dumps(partial))


def library_half(args, budgets) -> dict:
    """The library's settings named by --settings, --out rewritten after each unit of work."""
    from .quality import (
        decode_setting,
        memory_setting,
        passkey_decode_setting,
        passkey_setting,
        prefill_check,
        prefill_setting,
    )

    lengths = FULL
    if args.quick:
        lengths = QUICK
        budgets = [16, 32]
        args.trials = min(args.trials, 3)
        args.evict_every = 8
    model, tok = load_model(args.quick, args.device)
    docs = dict(list(documents(tok, args.quick, lengths.prompt + lengths.continuation).items())[: args.docs])
    trials = passkey_trials(tok, args.quick, args.trials)
    settings = args.settings.split(",")
    result = {
        "measurement": "Q1",
        "model": "random tiny Llama" if args.quick else f"SmolLM2-135M-Instruct ({GGUF})",
        "quick": args.quick, "dtype": "float32", "threads": args.threads, "budgets": budgets,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "prompt_tokens": lengths.prompt, "continuation_tokens": lengths.continuation,
        "evict_every": args.evict_every,
        "decode_recent_fraction": args.decode_recent, "sink_tokens": 4, "docs": list(docs),
        "passkey_prompt_tokens": PASSKEY_TOKENS, "passkey_trial_count": len(trials),
        "torch": torch.__version__, "transformers": version("transformers"),
        "python": platform.python_version(), **git_commit(), "settings": settings,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tokens": docs,
        "passkey_trials": [{k: t[k] for k in ("prompt", "answer_prefix", "key", "key_text", "depth")}
                           for t in trials],
    }
    out = Path(args.out)
    if args.resume and out.exists():
        earlier = json.loads(out.read_text())
        if "decode" in earlier:
            result["decode"] = {k: v for k, v in earlier["decode"].items() if k in docs}

    def save():
        out.write_text(json.dumps(result, indent=1))

    save()
    if "memory" in settings:
        result["memory"] = memory_setting(model, next(iter(docs.values())), budgets[1 % len(budgets)],
                                          "snapkv", lengths)
        log(f"memory: {result['memory']}")
        save()
    if "prefill" in settings:
        chosen = [(p, p) for p in args.prefill_policies.split(",")]
        result["prefill"] = prefill_setting(model, docs, budgets, chosen, log, lengths)
        result["prefill_ppl_ratio"] = ppl_ratios(result["prefill"])
        save()
    if "check" in settings and "prefill" in settings:
        name, doc = next(iter(docs.items()))
        chk = prefill_check(model, doc, budgets[0], "auto", lengths)
        shared = result["prefill"][name][f"auto@{budgets[0]}"]
        chk["max_abs_nll_diff_vs_shared"] = max(abs(a - b) for a, b in zip(chk["nll"], shared))
        result["check"] = chk
        log(f"check: max |nll diff| {chk['max_abs_nll_diff_vs_shared']:.2e}")
        save()
    if "passkey" in settings:
        result["passkey"] = {}
        passkey_setting(model, tok, trials, budgets, args.passkey_policies.split(","), log,
                        result["passkey"], save, args.first_trial, args.last_trial, lengths)
        result["passkey_table"] = passkey_table(result["passkey"])
        save()
    if "passkey_decode" in settings:
        result["passkey_decode"] = {}
        passkey_decode_setting(model, tok, trials, budgets, args.passkey_decode_policies.split(","),
                               args.evict_every, args.decode_recent, log, result["passkey_decode"], save)
        result["passkey_decode_table"] = passkey_table(result["passkey_decode"])
        save()
    if "decode" in settings:
        result.setdefault("decode", {})
        decode_setting(model, docs, budgets, args.decode_policies.split(","), args.evict_every,
                       args.decode_recent, log, result["decode"], save, lengths)
        result["decode_ppl_ratio"] = ppl_ratios(result["decode"])
        save()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save()
