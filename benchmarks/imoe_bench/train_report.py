"""The report of workload T1 (imoe_bench.train): the markdown table of
docs/moe.md, the JSON and its plot, and the README headline's T1 rows.

Every ratio reads "x faster than grouped_mm": grouped_mm's step time over
this row's (same case, same router).
"""

from __future__ import annotations

from . import report

# The names the headline gives the T1 cases (the JSON's keys).
NAMES = {"mixtral_like": "Mixtral-like", "qwen3_moe_like": "Qwen3-MoE-like",
         "mixtral_8x7b": "Mixtral-8x7B layer", "qwen3_30b_a3b": "Qwen3-30B-A3B layer"}


GRAD_NAMES = ("out", "d_hidden", "d_weights", "d_gate_up_proj", "d_down_proj")


def label(r: dict) -> str:
    """A mode's name: the implementation, and for "idempotent" its mode."""
    if r["implementation"] != "idempotent":
        return r["implementation"]
    mode = "dropless" if r["capacity"] is None else f"capacity {r['capacity']}"
    return f"idempotent {mode}"


def _case(r: dict) -> tuple:
    return r["case"], r.get("family", r.get("shape")), r["skewed"]


def _check_text(r: dict) -> str:
    c = r["check"]
    if r["case"] == "model":
        if "grads_rel_err_vs_grouped_mm" not in c:
            return "reference"
        return f"loss {c['loss_vs_grouped_mm']:+.1e}, grads {c['grads_rel_err_vs_grouped_mm']:.1e} rel"
    worst = max(c[n] for n in GRAD_NAMES)
    text = f"vs fp32: max rel {worst:.1e}"
    if "dropped_ok" in c:
        rule = "= rule" if c["dropped_ok"] else f"RULE {c['dropped_by_rule']}"
        text += f"; dropped {c['dropped']} ({rule})"
    return text


def _peak_text(r: dict) -> str:
    if r["peak_bytes"] is None:
        return ""
    before = r.get("allocated_before_bytes")  # absent from older JSON
    return f"{r['peak_bytes'] / 2**20:,.0f}" + ("" if before is None else f" ({before / 2**20:,.0f})")


def table(data: dict) -> str:
    """One markdown table: every row's time, its ratio to grouped_mm's step
    (same case, same router), memory, saved bytes and check."""
    rows = data["results"]
    base = {_case(r): r["step_s"] for r in rows if r["implementation"] == "grouped_mm"}
    head = ["case", "router", "implementation", "step ms", "x faster than grouped_mm", "tokens/s",
            "of the FLOP floor", "peak MiB (allocated before)", "MoE saved MiB", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        name = r.get("family", r.get("shape"))
        ratio = base[_case(r)] / r["step_s"]
        floor = r.get("floor_fraction")
        if floor is None:
            floor = r["moe_floor_s"] / r["step_s"]
        cells = [f"{r['case']} {name}", "skewed" if r["skewed"] else "balanced", label(r),
                 f"{r['step_s'] * 1e3:.2f}", f"{ratio:.2f}x", f"{r['tokens_per_s']:,.0f}",
                 f"{floor:.0%}" + ("" if r["case"] == "layer" else " (MoE)"),
                 _peak_text(r),
                 f"{r['moe_saved_bytes'] / 2**20:,.1f}", _check_text(r)]
        lines.append("| " + " | ".join(cells) + " |")
    m = data["machine"]
    lines.append("")
    lines.append(f"{m.get('gpu') or m.get('cpu')}; torch {m['torch']}; transformers {m['transformers']}; "
                 f"{data['dtype']}; GEMM rate {data['gemm_flops_per_s'] / 1e12:.3g} TFLOP/s; "
                 f"{data['rounds']} rounds x {data['reps']} steps; {m['date']}"
                 + (" (quick sizes)" if data["quick"] else ""))
    return "\n".join(lines)


def update_doc(path: str, data: dict) -> None:
    """Replace the table between <!-- bench:t1 --> and <!-- /bench:t1 --> (docs/moe.md)."""
    report.replace_section(path, "bench:t1", lambda: table(data))


def doc_from_json(path: str, json_path: str) -> None:
    update_doc(path, report.read_json(json_path))


def write(data: dict, out_dir: str, plot: bool = True) -> list:
    stem = f"t1-{data['machine']['device']}" + ("-quick" if data.get("quick") else "")
    return report.write_results(data, out_dir, stem, _plot if plot else None)


def _plot(data: dict, path: str) -> str:
    """Per case: step time relative to grouped_mm, and MoE saved bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    cases = list(dict.fromkeys(_case(r) for r in rows))
    labels = list(dict.fromkeys(label(r) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(labels)
    for i, mode in enumerate(labels):
        for ax, key, scale in ((axes[0], "step_s", 1e3), (axes[1], "moe_saved_bytes", 2.0 ** -20)):
            xs, ys = [], []
            for c, case in enumerate(cases):
                for r in rows:
                    if _case(r) == case and label(r) == mode:
                        xs.append(c + i * width)
                        ys.append(r[key] * scale)
            ax.bar(xs, ys, width, label=mode)
    names = [f"{case} {name}" + (" skewed" if skew else "") for case, name, skew in cases]
    for ax, title in ((axes[0], "step time, ms (log)"), (axes[1], "MoE saved activations, MiB (log)")):
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
    report.legend_outside(axes[1], handles=axes[0].get_legend_handles_labels()[0], fontsize=7)
    m = data["machine"]
    where = m.get("gpu") or m.get("cpu")
    fig.suptitle(f"T1: training steps, {where}" + (" (quick)" if data["quick"] else ""), fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def headline_rows(data: dict) -> list:
    """The README headline's T1 rows (model_report.headline's columns): each
    case's dropless step against grouped_mm's, balanced router; a model's
    time and peak, a layer's time, share of the FLOP floor and saved bytes."""
    rows = []
    bases = {_case(b): b for b in data["results"] if b["implementation"] == "grouped_mm"}
    for r in data["results"]:
        base = bases.get(_case(r))
        if r["implementation"] != "idempotent" or r["capacity"] is not None or r["skewed"] or base is None:
            continue
        name = r.get("family", r.get("shape"))
        if r["case"] == "model":
            c = data["config"]
            measure = f"training step, {c['batch']} x {c['seq']:,} tokens (time, peak alloc)"
            check = _check_text(r)
        else:
            measure = (f"forward + backward, {r['tokens']:,} tokens (time, share of the FLOP floor, "
                       "MoE saved)")
            check = f"{_check_text(r)} (grouped_mm {max(base['check'][n] for n in GRAD_NAMES):.1e})"
        rows.append([f"T1 {NAMES.get(name, name)}", measure, "grouped_mm", _headline_cell(base), "dropless",
                     _headline_cell(r), f"{base['step_s'] / r['step_s']:.2f}x", check])
    return rows


def _headline_cell(r: dict) -> str:
    text = f"{r['step_s'] * 1e3:.1f} ms"
    if r["case"] == "layer":
        return text + f", {r['floor_fraction']:.0%}, {r['moe_saved_bytes'] / 2**20:,.0f} MiB"
    return text + ("" if r["peak_bytes"] is None else f", {r['peak_bytes'] / 2**20:,.0f} MiB")


def footer(data: dict) -> str:
    """The headline's note on the T1 rows' run."""
    m = data["machine"]
    return (f"T1: {m.get('gpu') or m.get('cpu')}; torch {m['torch']}; transformers {m['transformers']}; "
            f"commit {m.get('commit') or 'unknown'}; {m['date']}")
