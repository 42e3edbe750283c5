"""W5: sweeps of N, keep ratio and row size, time over floor beside torch
topk + gather (as W1), every point checked bit for bit."""

from __future__ import annotations

from . import report, runner, workloads
from .timing import copy_bandwidth

N_VALUES = (256, 1024, 4096, 16384, 65536, 131072)
KEEP_RATIOS = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8)
ROW_BYTES = (2, 16, 128, 1024, 4096, 16384)


def _points(total_bytes: int) -> list:
    """(axis, N, keep, row elements of fp16, rows R): R fills total_bytes."""
    points = []

    def add(axis, n, ratio, row_bytes):
        rows = max(1, min(65536, total_bytes // (n * row_bytes)))
        points.append((axis, n, max(1, int(n * ratio)), row_bytes // 2, rows))

    for n in N_VALUES:
        add("N", n, 1 / 2, 2048)
    for ratio in KEEP_RATIOS:
        add("keep ratio", 8192, ratio, 2048)
    for row in ROW_BYTES:
        add("row bytes", 4096, 1 / 2, row)
    return points


def run(device: str = "auto", runs: int = 0, out: str = report.DEFAULT_OUT,
        quick: bool = False, plot: bool = True) -> dict:
    import torch

    device = runner.pick_device(device)
    runs = runs or (100 if device == "cuda" else 10)
    total = (256 << 20) if device == "cuda" else (16 << 20)
    if quick:
        total //= 64
    bandwidth = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 28), runs=10)
    points = _points(total)
    bar = runner._progress(3 * len(points))
    rows = []
    for axis, n, keep, row, lead in points:
        shape = workloads.Shape("W5", (lead,), n, row, keep, 0, 1)
        problem = workloads.Problem(shape, torch.float16, device,
                                    flush_bytes=runner.QUICK_FLUSH if quick else runner.FLUSH)
        impls = [workloads.torch_baseline(problem), workloads.ours(problem, "swap", 0),
                 workloads.ours(problem, "move", 0)]
        label = f"W5 {axis}: N={n} keep={keep} row={2 * row}B"
        for r in runner.measure(problem, impls, device, runs, bandwidth, bar, label):
            rows.append({"axis": axis, "n": n, "keep": keep, "keep_ratio": keep / n,
                         "row_bytes": 2 * row, "rows": lead, **r})
        del problem
    bar.close()
    data = {"machine": runner._machine(device, torch.get_num_threads(), bandwidth),
            "quick": quick, "results": rows}
    stem = f"sweep-{device}" + ("-quick" if quick else "")
    for path in report.write_results(data, out, stem, _plot if plot else None):
        print(f"wrote {path}")
    if not all(r["bit_exact"] for r in rows):
        raise SystemExit("a sweep point did not match its baseline bit for bit")
    return data


def _plot(data: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = ("N", "keep ratio", "row bytes")
    key = {"N": "n", "keep ratio": "keep_ratio", "row bytes": "row_bytes"}
    fig, plots = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, axis in zip(plots, axes):
        rows = [r for r in data["results"] if r["axis"] == axis]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r[key[axis]], r["time_over_floor"]) for r in rows if r["impl"] == impl]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        if axis != "keep ratio":
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xlabel(axis)
        ax.set_ylabel("time / floor of its mode")
        ax.grid(alpha=0.3)
    report.legend_outside(plots[-1], fontsize=8)
    m = data["machine"]
    fig.suptitle(f"W5 sweeps (fp16 rows; N sweep at keep 1/2, row 2 KiB): {m.get('gpu') or m['cpu']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
