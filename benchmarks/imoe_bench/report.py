"""Results: speedups, the printed table, JSON, the plot, and the main-job tables
of README.md and docs/results.md (always regenerated from the JSON)."""

from __future__ import annotations

import json
import os
import re

# Where a run writes its JSON and plot unless told otherwise: a folder that git
# ignores (.gitignore), so that running a benchmark in a clone changes no
# tracked file. The committed results (benchmarks/results/ and the tables of
# README.md and docs/, which benchmarks/tests/test_results_tables.py checks against each
# other) change only when asked: --out benchmarks/results, --readme, --doc.
DEFAULT_OUT = "imoe-results"
COMMITTED_OUT = os.path.join("benchmarks", "results")


def output_dir(out: str | None, doc: str | None) -> str:
    """The folder a run writes to: `out` when given; else, when the run is to
    regenerate a document's table (`doc`), the committed results, so that the
    table and the JSON it is checked against change together; else DEFAULT_OUT."""
    if out:
        return out
    return COMMITTED_OUT if doc else DEFAULT_OUT


# The one ratio convention of every table and plot: how many times faster
# than torch (the baseline's median over this row's; above 1, we are faster).
SPEEDUP_HEAD = "x faster than torch"


def legend_outside(ax, **kwargs) -> None:
    """The legend to the right of the axes, where it hides no bar or line
    (savefig(bbox_inches="tight") keeps it in the picture)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


def add_speedups(rows: list) -> None:
    """speedup = torch baseline median / this median, same workload and dtype."""
    base = {(r["workload"], r["dtype"]): r["median_ms"]
            for r in rows if r["impl"].startswith("torch")}
    for r in rows:
        r["speedup_vs_torch"] = base[(r["workload"], r["dtype"])] / r["median_ms"]
        if "time_over_floor" not in r:  # rows not made by runner.measure
            r["time_over_floor"] = r["median_ms"] / r["floor_ms"] if r["floor_ms"] else None


def _mib(nbytes) -> str:
    return "" if nbytes is None else f"{nbytes / 2**20:.2f}"


def table(data: dict, markdown: bool = True) -> str:
    rows = data["results"]
    has_mem = any("peak_allocated_bytes" in r for r in rows)
    head = ["workload", "dtype", "implementation", "median ms", "min ms", SPEEDUP_HEAD,
            "time / floor", "bit-exact"]
    if has_mem:
        head += ["host ms / call", "peak alloc MiB", "reserved MiB before -> after"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["workload"], r["dtype"], r["impl"], f"{r['median_ms']:.3f}",
                 f"{r['min_ms']:.3f}", f"{r['speedup_vs_torch']:.2f}x",
                 f"{r['time_over_floor']:.2f}" if r["time_over_floor"] else "",
                 "yes" if r["bit_exact"] else "NO"]
        if has_mem:
            cells += [f"{r['host_ms']:.3f}" if "host_ms" in r else "",
                      _mib(r.get("peak_allocated_bytes")),
                      f"{_mib(r.get('reserved_before_bytes'))} -> {_mib(r.get('reserved_after_bytes'))}"]
        lines.append("| " + " | ".join(cells) + " |")
    m = data["machine"]
    where = m.get("gpu") or m.get("cpu")
    lines.append("")
    lines.append(f"{where}; {m['threads']} threads; torch {m['torch']}; copy bandwidth "
                 f"{m['copy_bandwidth_GBps']:.1f} GB/s (read + write); {m['date']}"
                 + (" (quick sizes)" if data.get("quick") else ""))
    return "\n".join(lines)


def _stem(data: dict) -> str:
    return f"main-{data['machine']['device']}" + ("-quick" if data.get("quick") else "")


def read_json(path: str) -> dict:
    """A results JSON, as written by write_results."""
    with open(path) as f:
        return json.load(f)


def dumps(data) -> str:
    """The results' JSON layout: objects one key a line, and every list of
    objects (a table's rows) one object a line, so that a rerun's diff shows
    the rows that changed."""
    def render(obj, level: int) -> str:
        pad = " " * (level + 1)
        if isinstance(obj, dict) and obj:
            items = [f"{pad}{json.dumps(k)}: {render(v, level + 1)}" for k, v in obj.items()]
            return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
        if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
            return "[\n" + ",\n".join(pad + json.dumps(x) for x in obj) + "\n" + " " * level + "]"
        return json.dumps(obj)
    return render(data, 0) + "\n"


def write_results(data: dict, out_dir: str, stem: str, plot=None) -> list:
    """stem.json under out_dir, and stem.png drawn by plot(data, path) when given."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem + ".json")
    with open(path, "w") as f:
        f.write(dumps(data))
    paths = [path]
    if plot is not None:
        paths.append(plot(data, os.path.join(out_dir, stem + ".png")))
    return paths


def write(data: dict, out_dir: str, plot: bool = True) -> list:
    return write_results(data, out_dir, _stem(data), _plot if plot else None)


def _section_text(path: str, key: str) -> str:
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    try:
        with open(path) as f:
            content = f.read()
    except OSError as e:
        raise SystemExit(f"cannot read {path}: {e.strerror}") from None
    if start not in content or end not in content:
        raise SystemExit(f"{path} has no {start} ... {end} section to update")
    return content


def require_section(path: str, key: str) -> None:
    """Exit before a run whose table could not be written: `path` must hold
    a <!-- key --> ... <!-- /key --> section."""
    _section_text(path, key)


def replace_section(path: str, key: str, render) -> None:
    """Replace what stands between <!-- key --> and <!-- /key --> in a file
    with render(), called once the markers are found."""
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    content = _section_text(path, key)
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = render()
    with open(path, "w") as f:
        f.write(pattern.sub(lambda _: f"{start}\n{text}\n{end}", content))


def _series(row: dict) -> str:
    """Baselines differ in name between workloads (W2 sorts): one bar series each."""
    if row["kind"] == "baseline":
        return row["impl"].split(" ")[0] + " baseline"
    return row["impl"]


def _plot(data: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    groups = list(dict.fromkeys((r["workload"], r["dtype"]) for r in rows))
    impls = list(dict.fromkeys(_series(r) for r in rows))
    fig, ax = plt.subplots(figsize=(2.2 + 1.8 * len(groups), 4.2))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        xs, ys = [], []
        for g, (w, d) in enumerate(groups):
            for r in rows:
                if (r["workload"], r["dtype"], _series(r)) == (w, d, impl):
                    xs.append(g + i * width)
                    ys.append(r["median_ms"])
        ax.bar(xs, ys, width, label=impl)
    floors = [min(r["floor_ms"] for r in rows if (r["workload"], r["dtype"]) == g) for g in groups]
    ax.hlines(floors, [g - width / 2 for g in range(len(groups))],
              [g + 0.8 - width / 2 for g in range(len(groups))], colors="black",
              label="floor of move mode", zorder=3)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{w} {d}" for w, d in groups])
    ax.set_yscale("log")
    ax.set_ylabel("median time, ms (log)")
    m = data["machine"]
    ax.set_title(f"end to end, scores to compacted buffer + indices: {m.get('gpu') or m['cpu']}",
                 fontsize=9)
    legend_outside(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def update_readme(readme: str, data: dict) -> None:
    """Replace the table between <!-- bench:DEVICE --> and <!-- /bench:DEVICE -->."""
    replace_section(readme, f"bench:{data['machine']['device']}", lambda: table(data))
