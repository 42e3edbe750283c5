"""The permutation engine on the CPU beside torch's out-of-place equivalents:
a random permutation of T x D bf16 rows (and a rotation, one cycle), dropless
grouping by expert and its inverse, and the "stable" / "score" orders of a
compaction. Every row is checked bit for bit against torch; JSON and a plot go
to OUT/permute-cpu[-quick].{json,png}. "x faster than torch" is the median
time of torch's out-of-place form over this row's (above 1: faster); torch's
time includes allocating its output, so a row with a preallocated `out=` is
given too for the permutation itself.

`python -m imoe_bench permute [--quick]`.

With `--device cuda`: a random permutation (and a rotation, one cycle) of
32768 x 4096 bf16 rows with `permute_`, and `group_by_expert_` / `ungroup_`
of the same buffer (top-1 routing over 8 experts, random ids), beside torch's
`index_select` out of place and its in-place form `x.copy_(x.index_select(...))`.
CUDA events, warm-up, median and min of >= 100 runs, each result checked bit
for bit against the out-of-place baseline, peak memory allocated by one call
(max_memory_allocated minus what was allocated before) and the reserved pool
before/after; "time / gather floor" divides by the time a plain copy of the
buffer takes (every row read and written once). Results in
OUT/permute-cuda[-quick].{json,png}.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import idempotent_moe as imoe

from . import report, runner
from .timing import copy_bandwidth, time_calls

FULL = dict(t=32768, d=512, experts=(8, 64), compact=(8, 4096, 512, 2048))
QUICK = dict(t=4096, d=256, experts=(8, 64), compact=(4, 1024, 256, 512))
CUDA_FULL = dict(t=32768, d=4096, experts=8)
CUDA_QUICK = dict(t=4096, d=512, experts=8)


@dataclass
class Case:
    workload: str
    impl: str
    kind: str  # "baseline" (the reference of its workload), "torch" (another torch form) or "ours"
    run: Callable[[], object]  # the timed call; returns what check() compares
    reset: Callable[[], object]
    transient_bytes: int  # allocated by one call (not counting caller workspaces)
    workspace_bytes: int = 0


def _bits(t):
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a, b) -> bool:
    import torch

    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a.is_floating_point():
        return torch.equal(_bits(a), _bits(b))
    return torch.equal(a, b)


def _random_rows(shape: tuple, gen):
    """Random bf16 rows (every bit pattern, NaNs included: compared bit for bit)."""
    import torch

    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)


def _permutation(t: int, kind: str, gen):
    import torch

    return torch.randperm(t, generator=gen) if kind == "random" else torch.roll(torch.arange(t), 1)


def _restorer(x, x0):
    """The reset of a case: put `x` back to `x0`."""

    def reset():
        x.copy_(x0)

    return reset


def _group_inputs(t: int, d: int, experts: int, gen, device: str, ws_elems: int):
    """Rows, random expert ids (on `device`), the rows to regroup and what group_by_expert_ writes:
    its workspace, offsets and permutation."""
    import torch

    x0 = _random_rows((t, d), gen)
    ids = torch.randint(0, experts, (t,), generator=gen)
    x0, ids = x0.to(device), ids.to(device)
    ws = torch.empty(ws_elems, dtype=torch.int32, device=device)
    offsets = torch.empty(experts, dtype=torch.int64, device=device)
    perm = torch.empty(t, dtype=torch.int64, device=device)
    return x0, ids, x0.clone(), ws, offsets, perm


def _torch_group(x, ids, experts: int):
    order, offs = _torch_order_offsets(ids, experts)
    return _bits(x).index_select(0, order), offs, order


def _torch_order_offsets(ids, experts: int):
    """torch's grouping by expert: the stable order and the experts' offsets
    (each expert's end, as grouped_mm takes them)."""
    import torch

    order = torch.argsort(ids, stable=True)
    return order, torch.cumsum(torch.bincount(ids, minlength=experts), 0)


def _ungroup_input(x0, ids):
    """Rows of `x0` grouped by expert (the input of ungroup_), its order and reset."""
    import torch

    order = torch.argsort(ids, stable=True)
    g0 = x0.index_select(0, order)
    g = g0.clone()
    return g, order, _restorer(g, g0)


def _torch_ungroup(g, order):
    import torch

    return torch.empty_like(_bits(g)).index_copy_(0, order, _bits(g))


def _permute_cases(t: int, d: int, kind: str, threads: int, gen) -> list:
    import torch

    x0 = _random_rows((t, d), gen)
    perm = _permutation(t, kind, gen)
    x = x0.clone()
    ws = torch.empty(t, dtype=torch.int32)
    out = torch.empty(t, d, dtype=torch.int16)
    row = d * x0.element_size()
    name = f"permute {kind} {t}x{d}"
    reset = _restorer(x, x0)

    def ours():
        imoe.permute_(x, perm, workspace=ws, num_threads=threads)
        return x

    def ours_alloc():
        imoe.permute_(x, perm, num_threads=threads)
        return x

    return [
        Case(name, "torch index_select (out of place)", "baseline",
             lambda: _bits(x).index_select(0, perm), reset, t * row),
        Case(name, "torch index_select into a preallocated out=", "torch",
             lambda: torch.index_select(_bits(x), 0, perm, out=out), reset, 0, t * row),
        Case(name, "idempotent_moe permute_", "ours", ours, reset, 0, 4 * t),
        Case(name, "idempotent_moe permute_ (workspace per call)", "ours", ours_alloc, reset, 4 * t),
    ]


def _group_cases(t: int, d: int, experts: int, threads: int, gen, with_ungroup: bool) -> list:

    x0, ids, x, ws, offsets, perm = _group_inputs(t, d, experts, gen, "cpu", t)
    row = d * x0.element_size()
    name = f"group E={experts} {t}x{d}"
    reset = _restorer(x, x0)

    def ours():
        imoe.group_by_expert_(x, ids, experts, out_offsets=offsets, out_perm=perm, workspace=ws,
                              num_threads=threads)
        return _bits(x), offsets, perm

    cases = [
        Case(name, "torch argsort + index_select + bincount", "baseline",
             lambda: _torch_group(x, ids, experts), reset,
             t * row + 3 * 8 * t),
        Case(name, "idempotent_moe group_by_expert_", "ours", ours, reset, 0, 4 * t),
    ]
    if with_ungroup:  # the inverse: put grouped rows back
        g, order, reset_g = _ungroup_input(x0, ids)
        ug = f"ungroup E={experts} {t}x{d}"

        def ours_ungroup():
            imoe.ungroup_(g, order, workspace=ws, num_threads=threads)
            return _bits(g)

        cases += [
            Case(ug, "torch index_copy_ (out of place)", "baseline", lambda: _torch_ungroup(g, order),
                 reset_g, t * row),
            Case(ug, "idempotent_moe ungroup_", "ours", ours_ungroup, reset_g, 0, 4 * t),
        ]
    return cases


def _compact_cases(shape: tuple, order: str, threads: int, gen) -> list:
    import torch

    e, t, d, c = shape
    x0 = _random_rows((e, t, d), gen)
    s = torch.randn(e, t, generator=gen)
    x = x0.clone()
    ws = torch.empty(e * t, dtype=torch.int32)
    idx = torch.empty(e, c, dtype=torch.int64)
    row = d * x0.element_size()
    name = f"compact order={order} {e}x{t}x{d} C={c}"
    reset = _restorer(x, x0)

    def torch_compact():
        top = torch.topk(s, c, dim=-1, sorted=True).indices
        if order == "stable":
            top = top.sort(dim=-1).values
        return torch.gather(_bits(x), 1, top.unsqueeze(-1).expand(e, c, d)), top

    def ours(mode):
        def call():
            res = imoe.compact_(x, s, c, order=order, mode=mode, out_indices=idx, workspace=ws,
                                num_threads=threads)
            return _bits(res.values), res.indices
        return call

    base = "torch topk + gather" if order == "score" else "torch topk + sort + gather"
    return [
        Case(name, base, "baseline", torch_compact, reset, e * c * row + 2 * 8 * e * c),
        Case(name, "idempotent_moe compact_ swap", "ours", ours("swap"), reset, 0, 4 * e * t),
        Case(name, "idempotent_moe compact_ move", "ours", ours("move"), reset, 0, 4 * e * t),
    ]


def _cuda_permute_cases(t: int, d: int, kind: str, gen) -> list:
    import torch

    x0 = _random_rows((t, d), gen)
    perm = _permutation(t, kind, gen)
    x0, perm = x0.cuda(), perm.cuda()
    x = x0.clone()
    ws = torch.empty(imoe.plan_workspace_elems("permute", 1, t, cuda=True), dtype=torch.int32,
                     device="cuda")
    row = d * x0.element_size()
    name = f"permute {kind} {t}x{d} bf16"
    reset = _restorer(x, x0)

    def in_place_torch():
        return _bits(x).copy_(_bits(x).index_select(0, perm))

    def ours():
        imoe.permute_(x, perm, workspace=ws)
        return _bits(x)

    def ours_alloc():
        imoe.permute_(x, perm)
        return _bits(x)

    return [
        Case(name, "torch index_select (out of place)", "baseline",
             lambda: _bits(x).index_select(0, perm), reset, t * row),
        Case(name, "torch x.copy_(x.index_select(...))", "torch", in_place_torch, reset, t * row),
        Case(name, "idempotent_moe permute_", "ours", ours, reset, 0, ws.numel() * 4),
        Case(name, "idempotent_moe permute_ (workspace per call)", "ours", ours_alloc, reset,
             ws.numel() * 4),
    ]


def _cuda_group_cases(t: int, d: int, experts: int, gen) -> list:

    x0, ids, x, ws, offsets, perm = _group_inputs(
        t, d, experts, gen, "cuda", imoe.plan_workspace_elems("group", 1, t, cuda=True))
    row = d * x0.element_size()
    name = f"group E={experts} {t}x{d} bf16"
    reset = _restorer(x, x0)

    def torch_group_in_place():
        order, offs = _torch_order_offsets(ids, experts)
        _bits(x).copy_(_bits(x).index_select(0, order))
        return _bits(x), offs, order

    def ours():
        imoe.group_by_expert_(x, ids, experts, out_offsets=offsets, out_perm=perm, workspace=ws)
        return _bits(x), offsets, perm

    g, order, reset_g = _ungroup_input(x0, ids)
    ug = f"ungroup E={experts} {t}x{d} bf16"

    def ours_ungroup():
        imoe.ungroup_(g, order, workspace=ws)
        return _bits(g)

    return [
        Case(name, "torch argsort + index_select + bincount", "baseline",
             lambda: _torch_group(x, ids, experts), reset,
             t * row + 3 * 8 * t),
        Case(name, "torch argsort + x.copy_(x.index_select(...))", "torch", torch_group_in_place,
             reset, t * row + 3 * 8 * t),
        Case(name, "idempotent_moe group_by_expert_", "ours", ours, reset, 0, ws.numel() * 4),
        Case(ug, "torch index_copy_ (out of place)", "baseline",
             lambda: _torch_ungroup(g, order), reset_g, t * row),
        Case(ug, "idempotent_moe ungroup_", "ours", ours_ungroup, reset_g, 0, ws.numel() * 4),
    ]


def _against_baseline(rows: list) -> None:
    """Each row's time beside its workload's torch baseline."""
    for r in rows:
        base = next(b for b in rows if b["workload"] == r["workload"] and b["kind"] == "baseline")
        r["time_ratio_vs_torch"] = r["median_ms"] / base["median_ms"]
        r["speedup_vs_torch"] = base["median_ms"] / r["median_ms"]


def _write(data: dict, out: str, stem: str, plot: bool) -> list:
    """Write the JSON (and the plot), print the table and the paths written."""
    paths = report.write_results(data, out, stem, _plot if plot else None)
    print(table(data))
    for p in paths:
        print(f"wrote {p}", file=sys.stderr)
    return paths


def run_cuda(runs: int = 0, quick: bool = False, out: str = report.DEFAULT_OUT,
             plot: bool = True, doc: str | None = None) -> dict:
    """The GPU half (see the module docstring); `doc`: regenerate its table there."""
    import torch

    if not (torch.cuda.is_available() and imoe.cuda_available()):
        raise SystemExit("--device cuda needs a GPU and a CUDA build of idempotent_moe")
    if doc:
        report.require_section(doc, "permute:cuda")
    sizes = CUDA_QUICK if quick else CUDA_FULL
    runs = max(runs or 100, 100) if not quick else (runs or 10)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for kind in ("random", "rotation"):
        cases += _cuda_permute_cases(sizes["t"], sizes["d"], kind, gen)
    cases += _cuda_group_cases(sizes["t"], sizes["d"], sizes["experts"], gen)
    bandwidth = copy_bandwidth("cuda", 1 << (26 if quick else 30), runs=10)
    bar = runner._progress(len(cases))
    rows, reference = [], {}
    for case in cases:
        bar.set_description(f"{case.workload}: {case.impl}")
        timing = time_calls(case.run, case.reset, device="cuda", runs=runs, warmup=5)
        case.reset()
        result = case.run()
        torch.cuda.synchronize()
        imoe.check_errors(result[0] if isinstance(result, tuple) else result)
        if case.kind == "baseline":
            reference[case.workload] = result
        data_bytes = int(sizes["t"]) * int(sizes["d"]) * 2
        floor_ms = 2 * data_bytes / bandwidth * 1e3  # every row read and written once
        rows.append({
            "workload": case.workload, "impl": case.impl, "kind": case.kind,
            "median_ms": timing.median_ms, "min_ms": timing.min_ms, "host_ms": timing.host_ms,
            "runs": timing.runs, "gather_floor_ms": floor_ms,
            "time_over_gather_floor": timing.median_ms / floor_ms,
            "bit_exact": bool(_same(result, reference[case.workload])),
            "transient_bytes": case.transient_bytes, "workspace_bytes": case.workspace_bytes,
            **runner._memory("cuda", case, case),
        })
        del result
        bar.update()
    bar.close()
    _against_baseline(rows)
    data = {"machine": runner._machine("cuda", torch.get_num_threads(), bandwidth), "quick": quick,
            "results": rows}
    paths = _write(data, out, "permute-cuda" + ("-quick" if quick else ""), plot)
    if doc:
        doc_from_json(doc, paths[0])
        print(f"updated {doc}", file=sys.stderr)
    if not all(r["bit_exact"] for r in rows):
        raise SystemExit("a result differs from torch's: see bit_exact in " + paths[0])
    return data


def doc_from_json(doc: str, json_path: str) -> None:
    """Regenerate the permute table of `doc` (docs/results.md) for the device of the JSON:
    the section between <!-- permute:cpu|cuda --> markers."""
    import json

    with open(json_path) as f:
        data = json.load(f)
    report.replace_section(doc, f"permute:{data['machine']['device']}", lambda: table(data))


def run(runs: int = 0, threads: int = 0, quick: bool = False,
        out: str = report.DEFAULT_OUT, plot: bool = True) -> dict:
    import torch

    sizes = QUICK if quick else FULL
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    runs = runs or (5 if quick else 15)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for kind in ("random", "rotation"):
        cases += _permute_cases(sizes["t"], sizes["d"], kind, threads, gen)
    for i, experts in enumerate(sizes["experts"]):
        cases += _group_cases(sizes["t"], sizes["d"], experts, threads, gen, with_ungroup=i == 0)
    for order in ("stable", "score"):
        cases += _compact_cases(sizes["compact"], order, threads, gen)

    bandwidth = copy_bandwidth("cpu", 1 << (24 if quick else 27), runs=5)
    bar = runner._progress(len(cases))
    rows, reference = [], {}
    for case in cases:
        bar.set_description(f"{case.workload}: {case.impl}")
        timing = time_calls(case.run, case.reset, device="cpu", runs=runs, warmup=2)
        case.reset()
        result = case.run()
        if case.kind == "baseline":
            reference[case.workload] = result
        rows.append({
            "workload": case.workload, "impl": case.impl, "kind": case.kind,
            "median_ms": timing.median_ms, "min_ms": timing.min_ms, "runs": timing.runs,
            "bit_exact": bool(_same(result, reference[case.workload])),
            "transient_bytes": case.transient_bytes, "workspace_bytes": case.workspace_bytes,
        })
        bar.update()
    bar.close()
    _against_baseline(rows)
    data = {"machine": runner._machine("cpu", threads, bandwidth), "quick": quick, "results": rows}
    paths = _write(data, out, "permute-cpu" + ("-quick" if quick else ""), plot)
    path = paths[0]
    if not all(r["bit_exact"] for r in rows):
        raise SystemExit("a result differs from torch's: see bit_exact in " + path)
    return data


def _speedup(r: dict) -> float:
    """Times faster than the workload's torch baseline; result files written
    before speedup_vs_torch was recorded have its inverse only."""
    return r["speedup_vs_torch"] if "speedup_vs_torch" in r else 1.0 / r["time_ratio_vs_torch"]


def table(data: dict) -> str:
    rows = data["results"]
    if any("peak_allocated_bytes" in r for r in rows):  # CUDA: measured memory
        lines = [f"| workload | impl | median ms | min ms | {report.SPEEDUP_HEAD} | time / gather floor | "
                 "bit-exact | peak alloc MiB | reserved MiB before -> after |",
                 "|---|---|---:|---:|---:|---:|:-:|---:|---|"]
        for r in rows:
            lines.append(
                f"| {r['workload']} | {r['impl']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | "
                f"{_speedup(r):.2f}x | {r['time_over_gather_floor']:.2f} | "
                f"{'yes' if r['bit_exact'] else 'NO'} | {r['peak_allocated_bytes'] / 2**20:.2f} | "
                f"{r['reserved_before_bytes'] / 2**20:.0f} -> {r['reserved_after_bytes'] / 2**20:.0f} |")
    else:
        lines = [f"| workload | impl | median ms | min ms | {report.SPEEDUP_HEAD} | bit-exact | "
                 "transient MiB |",
                 "|---|---|---:|---:|---:|:-:|---:|"]
        for r in rows:
            lines.append(f"| {r['workload']} | {r['impl']} | {r['median_ms']:.3f} | "
                         f"{r['min_ms']:.3f} | {_speedup(r):.2f}x | "
                         f"{'yes' if r['bit_exact'] else 'NO'} | {r['transient_bytes'] / 2**20:.2f} |")
    m = data["machine"]
    where = m.get("gpu") or f"{m['cpu']}, {m['threads']} threads"
    lines.append("")
    quick = " (quick sizes)" if data.get("quick") else ""
    lines.append(f"{where}; torch {m['torch']}; {m['date']}{quick}")
    return "\n".join(lines)


def _plot(data: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 0.5 + 0.55 * len(rows)))
    labels, values, colors = [], [], []
    for w in workloads:
        for r in (r for r in rows if r["workload"] == w):
            labels.append(f"{w}: {r['impl']}")
            values.append(r["median_ms"])
            colors.append("tab:blue" if r["kind"] == "ours" else "tab:gray")
    y = list(range(len(labels)))[::-1]
    ax.barh(y, values, color=colors)
    for yy, v, r in zip(y, values, [r for w in workloads for r in rows if r["workload"] == w]):
        what = "the torch baseline" if r["kind"] == "baseline" else f"{_speedup(r):.2f}x faster than torch"
        ax.text(v, yy, f" {v:.2f} ms ({what})", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(min(values) / 1.5, max(values) * 4)
    ax.set_xlabel("median time, ms (log); gray: torch, blue: idempotent_moe in place")
    m = data["machine"]
    if m["device"] == "cuda":
        ax.set_title(f"permutation engine on the GPU ({m.get('gpu')})", fontsize=9)
    else:
        ax.set_title(f"permutation engine on the CPU ({m['cpu']}, {m['threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
