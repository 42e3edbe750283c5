"""Tables and the plot of the model benchmark's JSON (M1, M2, H1), and the
README headline: M1 and M2 with T1 (the training JSON, where one lies
beside) and W1-W3 (the main job's JSON) beside them.

Every ratio reads "x faster than": the baseline's time over this row's, or
this row's rate over the baseline's; above 1, this row is faster. Memory
ratios ("peak / ...") put this row on top.
"""

from __future__ import annotations

import os

from . import report, train_report

HEADLINE_KEY = "headline"  # <!-- headline:DEVICE --> in README.md


def _mib(nbytes) -> str:
    return "" if nbytes is None else f"{nbytes / 2**20:.0f}"


def _x(value) -> str:
    return "" if value is None else f"{value:.2f}x"


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _family_names(data: dict) -> dict:
    return {key: fam["name"] for key, fam in data.get("families", {}).items()}


def _agreement_cell(row: dict) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    if "agreement_error" in row:
        return f"not checked: {row['agreement_error']}"
    a = row.get("agreement")
    if a is None:
        return ""
    counts = f"{a['exact']} exact, {a['near_tie']} near-tie, {a['disagree']} disagree"
    if "sequences" in a:
        counts = f"{a['sequences_equal_baseline']} of {a['sequences']} sequences identical; " + counts
    if not row.get("agreement_checked", True):
        return f"capacity (not judged): {counts}"
    if not a.get("identical") and a.get("baseline_disagree"):
        counts += f" (grouped_mm's own tokens: {a['baseline_disagree']}; allowed {a['disagree_allowed']})"
    return f"{'ok' if row.get('ok') else 'FAILED'}: {counts}"


def _table(head: list, rows: list) -> list:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


def prefill_table(data: dict) -> list:
    names = _family_names(data)
    rows = []
    for r in data["m1"]["prefill"]:
        dropped = "" if r.get("dropped") is None else f"{r['dropped']} of {r['assignments']}"
        rows.append([names.get(r["family"], r["family"]), r["impl"], _num(r.get("median_ms"), ".2f"),
                     _x(r.get("speedup_vs_grouped_mm")), _mib(r.get("peak_allocated_bytes")),
                     _num(r.get("peak_over_grouped_mm"), ".2f"), dropped,
                     f"error: {r['error']}" if "error" in r else ""])
    head = ["model", "implementation", "prefill ms", "x faster than grouped_mm", "peak alloc MiB",
            "peak / grouped_mm", "dropped", "error"]
    return _table(head, rows)


def decode_table(data: dict) -> list:
    """One row per decode row; the median step's two columns when the rows
    have it (results from before it was kept have not)."""
    names = _family_names(data)
    decode = data["m1"]["decode"]
    steps = any("step_median_ms" in r for r in decode)
    rows = []
    for r in decode:
        step = ([_num(r.get("step_median_ms"), ".2f"), _x(r.get("step_speedup_vs_grouped_mm"))]
                if steps else [])
        rows.append([names.get(r["family"], r["family"]), r["cache"], str(r["batch"]), r["impl"],
                     _num(r.get("decode_tokens_per_s"), ".1f"), _x(r.get("speedup_vs_grouped_mm")),
                     _x(r.get("speedup_vs_eager")), *step, _num(r.get("first_token_ms"), ".1f"),
                     _num(r.get("warmup_s"), ".1f"), _agreement_cell(r)])
    head = ["model", "cache", "batch", "implementation", "decode tokens/s", "x faster than grouped_mm",
            "x faster than eager", *(["median step ms", "step x grouped_mm"] if steps else []),
            "first token ms", "warm-up s", "tokens vs grouped_mm"]
    return _table(head, rows)


def m2_table(data: dict) -> list:
    rows = []
    for r in data["m2"]["rows"]:
        rows.append([r["cache"], _num(r.get("total_ms"), ".1f"), _x(r.get("speedup_vs_dynamic_cache")),
                     _num(r.get("first_token_ms"), ".1f"), _num(r.get("decode_tokens_per_s"), ".1f"),
                     _x(r.get("decode_speedup_vs_dynamic_cache")), _mib(r.get("peak_allocated_bytes")),
                     _num(r.get("peak_over_dynamic_cache"), ".2f"),
                     _num(r.get("tokens_equal_full_cache"), "d"),
                     f"error: {r['error']}" if "error" in r else ""])
    head = ["cache", "total ms", "x faster than DynamicCache", "first token ms", "decode tokens/s",
            "decode x faster than DynamicCache", "peak alloc MiB", "peak / DynamicCache",
            "tokens equal to DynamicCache's", "error"]
    return _table(head, rows)


def h1_table(data: dict) -> list:
    rows = [[r["call"], f"{r['us_per_call']:.1f}", f"{r['us_per_call_min']:.1f}",
             f"{r['over_one_torch_op']:.1f}"] for r in data["h1"]["rows"]]
    return _table(["call", "host us / call", "min", "cost in torch ops"], rows)


def _footer(m: dict) -> str:
    where = m.get("gpu") or m.get("cpu")
    extra = f"; driver {m['driver']}" if m.get("driver") else ""
    return (f"{where}{extra}; torch {m['torch']}; transformers {m['transformers']}; "
            f"commit {m.get('commit') or 'unknown'}; {m['date']}")


def _prefill_run(data: dict) -> str:
    """Where M1's prefill rows come from a later run than the rest
    (m1.prefill_machine: the same machine block), its commit and date."""
    m = (data.get("m1") or {}).get("prefill_machine")
    return f"; prefill rows: commit {m.get('commit') or 'unknown'}, {m['date']}" if m else ""


def table(data: dict) -> str:
    """Every section the JSON holds, as markdown."""
    out = []
    if data.get("m1"):
        opts = data["options"]
        out += [f"M1 prefill, {opts['prefill_tokens']} tokens, dynamic cache:", ""] + prefill_table(data)
        out += ["", f"M1 decode, {opts['new_tokens']} new tokens after {opts['decode_prompt']} prompt "
                    f"tokens, greedy, median of {opts['rounds']} interleaved rounds:", ""]
        out += decode_table(data)
    if data.get("m2"):
        o = data["m2"]["options"]
        out += ["", f"M2: {o['prompt_tokens']}-token prompt, chunked prefill of {o['prefill_chunk']}, "
                    f"{o['new_tokens']} new tokens; eviction budget {o['budget']}, every "
                    f"{o['evict_every']} steps:", ""]
        out += m2_table(data)
    if data.get("h1"):
        out += ["", f"H1: host time per call, {data['h1']['calls']} calls back to back:", ""] + h1_table(data)
    quick = " (quick sizes)" if data.get("quick") else ""
    out += ["", _footer(data["machine"]) + _prefill_run(data) + quick]
    return "\n".join(out)


# --------------------------------------------------------------------------- README headline


def _find(rows: list, **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _ms_mib(row: dict) -> str:
    if "error" in row:
        return "error"
    mem = f", {_mib(row['peak_allocated_bytes'])} MiB" if row.get("peak_allocated_bytes") is not None else ""
    return f"{row['median_ms']:.1f} ms{mem}"


# The decode rows of ours in the headline: the default, and the options
# (use_idempotent_experts(model, small_m_gemm=True, fuse_routers=True)) where the run has them.
HEADLINE_DECODE = {"idempotent": "dropless", "idempotent+gemm+router": "dropless, small-M GEMM, fused router"}


def _headline_m1(data: dict) -> list:
    rows = []
    for key, fam in data["families"].items():
        prefill = data["m1"]["prefill"]
        base = _find(prefill, family=key, impl="grouped_mm")
        ours = _find(prefill, family=key, impl="idempotent")
        if base and ours:
            rows.append([f"M1 {fam['name']}", f"prefill {data['options']['prefill_tokens']:,} tokens "
                         "(time, peak alloc)", "grouped_mm", _ms_mib(base), "dropless", _ms_mib(ours),
                         _x(ours.get("speedup_vs_grouped_mm")), ""])
        for r in data["m1"]["decode"]:
            label = HEADLINE_DECODE.get(r["impl"])
            if r["family"] != key or label is None:
                continue
            base = _find(data["m1"]["decode"], family=key, impl="grouped_mm", cache=r["cache"],
                         batch=r["batch"])
            if base is None:
                continue
            rows.append([f"M1 {fam['name']}", f"decode tokens/s, batch {r['batch']}, {r['cache']} cache",
                         "grouped_mm", "error" if "error" in base else f"{base['decode_tokens_per_s']:.0f}",
                         label, "error" if "error" in r else f"{r['decode_tokens_per_s']:.0f}",
                         _x(r.get("speedup_vs_grouped_mm")), _agreement_cell(r)])
    return rows


def _headline_m2(data: dict) -> list:
    m2 = data.get("m2")
    if not m2 or len(m2["rows"]) < 2:
        return []
    base, ours = m2["rows"][0], m2["rows"][1]
    o = m2["options"]

    def cell(r):
        if "error" in r:
            return "error"
        return (f"{r['total_ms'] / 1e3:.2f} s, {r['decode_tokens_per_s']:.0f} tokens/s, "
                f"{_mib(r.get('peak_allocated_bytes'))} MiB")

    return [["M2 " + m2["model"]["name"], f"{o['prompt_tokens']:,}-token prompt + {o['new_tokens']} tokens "
             "(total, decode rate, peak alloc)", base["cache"], cell(base), ours["cache"], cell(ours),
             _x(ours.get("speedup_vs_dynamic_cache")), f"budget {o['budget']}: tokens differ by design"]]


def _main_cell(row: dict) -> str:
    mem = row.get("peak_allocated_bytes")
    return f"{row['median_ms']:.3f} ms" + ("" if mem is None else f", {mem / 2**20:.1f} MiB")


def _headline_main(main: dict) -> list:
    """Per workload: torch's row and our fastest row."""
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in main["results"]):
        mine = [r for r in main["results"] if r["workload"] == workload]
        base = next(r for r in mine if r["kind"] == "baseline")
        best = min((r for r in mine if r["kind"] != "baseline"), key=lambda r: r["median_ms"])
        rows.append([workload, f"{base['dtype']} compaction, end to end (time, peak alloc)", base["impl"],
                     _main_cell(base), best["impl"].replace("idempotent_moe ", ""), _main_cell(best),
                     _x(best["speedup_vs_torch"]), "bit-exact" if best["bit_exact"] else "NOT bit-exact"])
    return rows


def headline(model: dict, main: dict, t1: dict | None = None) -> str:
    """The README's headline table: M1 and M2 from the model JSON, W1-W3 from
    the main job's JSON, T1 from the training JSON where given (same device)."""
    head = ["workload", "measure", "baseline", "baseline's figure", "idempotent_moe", "our figure",
            "x faster than baseline", "check"]
    t1_rows = train_report.headline_rows(t1) if t1 else []
    rows = _headline_m1(model) + _headline_m2(model) + t1_rows + _headline_main(main)
    lines = _table(head, rows)
    lines += ["", f"M1, M2: {_footer(model['machine'])}{_prefill_run(model)}. "
                  + (f"{train_report.footer(t1)}. " if t1_rows else "")
                  + f"W1-W3: {_footer_main(main['machine'])}."]
    return "\n".join(lines)


def _footer_main(m: dict) -> str:
    return f"torch {m['torch']}; commit {m.get('commit') or 'unknown'}; {m['date']}"


def _beside(model_json: str, model: dict, stem: str) -> str:
    """The JSON of workload `stem` ("main", "t1") on the model JSON's device,
    in its folder."""
    folder = os.path.dirname(os.path.abspath(model_json))
    return os.path.join(folder, f"{stem}-{model['machine']['device']}.json")


def update_headline(readme: str, model: dict, main: dict, t1: dict | None = None) -> None:
    """Replace <!-- headline:DEVICE --> ... <!-- /headline:DEVICE --> in `readme`."""
    report.replace_section(readme, f"{HEADLINE_KEY}:{model['machine']['device']}",
                           lambda: headline(model, main, t1))


def headline_from_json(readme: str, model_json: str, main_json: str | None = None) -> None:
    """The headline from a model JSON, (default: beside it) the main job's
    JSON, and T1's (t1-DEVICE.json) where one lies beside it."""
    model = report.read_json(model_json)
    main_json = main_json or _beside(model_json, model, "main")
    try:
        main = report.read_json(main_json)
    except OSError as e:
        raise SystemExit(f"the headline needs the main job's JSON (W1-W3) beside {model_json}: "
                         f"{main_json}: {e.strerror}") from None
    t1_json = _beside(model_json, model, "t1")
    update_headline(readme, model, main, report.read_json(t1_json) if os.path.exists(t1_json) else None)


def update_doc(path: str, data: dict, name: str = "model") -> None:
    """Replace <!-- NAME:DEVICE --> ... <!-- /NAME:DEVICE --> (docs/results.md) with every table."""
    report.replace_section(path, f"{name}:{data['machine']['device']}", lambda: table(data))


def doc_from_json(path: str, json_path: str) -> None:
    """The section named by the JSON's file: model-cuda.json fills
    <!-- model:cuda -->, model-NAME-cuda.json <!-- model-NAME:cuda -->."""
    data = report.read_json(json_path)
    stem = os.path.basename(json_path).removesuffix(".json").removesuffix(f"-{data['machine']['device']}")
    update_doc(path, data, stem)


# --------------------------------------------------------------------------- plot


def plot(data: dict, path: str) -> str:
    """Per family: prefill time and peak memory, and decode tokens/s against
    batch for each cache; M2: time, decode rate and peak memory per cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(data["families"]) if data.get("m1") else []
    caches = list(dict.fromkeys(r["cache"] for r in data["m1"]["decode"])) if families else []
    cols = max(2 + len(caches), 3)
    nrows = len(families) + (1 if data.get("m2") else 0)
    if nrows == 0:
        return None
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for i, key in enumerate(families):
        name = data["families"][key]["name"]
        pre = [r for r in data["m1"]["prefill"] if r["family"] == key and "median_ms" in r]
        ax = axes[i][0]
        ax.bar([r["impl"] for r in pre], [r["median_ms"] for r in pre])
        ax.set_title(f"{name}: prefill {data['options']['prefill_tokens']} tokens", fontsize=9)
        ax.set_ylabel("ms")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        ax = axes[i][1]
        mem = [r for r in pre if r.get("peak_allocated_bytes") is not None]
        ax.bar([r["impl"] for r in mem], [r["peak_allocated_bytes"] / 2**20 for r in mem])
        ax.set_title(f"{name}: prefill peak alloc", fontsize=9)
        ax.set_ylabel("MiB")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        for j, cache in enumerate(caches):
            ax = axes[i][2 + j]
            rows = [r for r in data["m1"]["decode"] if r["family"] == key and r["cache"] == cache]
            for impl in dict.fromkeys(r["impl"] for r in rows):
                pts = [(r["batch"], r["decode_tokens_per_s"]) for r in rows
                       if r["impl"] == impl and "decode_tokens_per_s" in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch")
            ax.set_ylabel("decode tokens/s (log)")
            ax.set_title(f"{name}: {cache} cache", fontsize=9)
        if caches:
            report.legend_outside(axes[i][1 + len(caches)], fontsize=7)
        for j in range(2 + len(caches), cols):
            axes[i][j].axis("off")
    if data.get("m2"):
        rows = [r for r in data["m2"]["rows"] if "total_ms" in r]
        panels = [("total_ms", "total ms"), ("decode_tokens_per_s", "decode tokens/s"),
                  ("peak_allocated_bytes", "peak alloc MiB")]
        for j in range(cols):
            ax = axes[-1][j]
            if j >= len(panels) or not all(panels[j][0] in r for r in rows) or not rows:
                ax.axis("off")
                continue
            key, label = panels[j]
            scale = 2**20 if key.endswith("bytes") else 1
            ax.bar([r["cache"].split("(")[0] for r in rows], [r[key] / scale for r in rows])
            ax.set_title(f"M2 {data['m2']['model']['name']}: {label}", fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
    m = data["machine"]
    fig.suptitle(f"M1 / M2: {m.get('gpu') or m.get('cpu')}, commit {m.get('commit') or 'unknown'}"
                 f"{_prefill_run(data)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def readme_from_json(readme: str, json_path: str) -> None:
    """The table of `json_path` in `readme`: the main job's table, or for the
    model benchmark's JSON (M1, M2) the headline, with W1-W3 from the main
    job's JSON beside it."""
    data = report.read_json(json_path)
    if "m1" in data:
        headline_from_json(readme, json_path)
    else:
        report.update_readme(readme, data)
