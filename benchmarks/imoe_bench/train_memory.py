"""T1's steps taken apart by memory: what is alive at the peak of one
training step, and who allocated it.

For each model family and each layer shape of T1 (balanced router) and
each of grouped_mm, eager and the library's dropless and capacity 1.0
modes, on the same model (layer) and tokens as `train`:
one warm-up step, then one step, both recorded by the CUDA caching
allocator's history (`torch.cuda.memory._record_memory_history`, Python
stacks). The step's alloc and free events are replayed: the peak is the
most bytes that blocks allocated during the step hold at once (blocks
allocated before it are left out, also where the step frees them, as it
does the warm-up's gradients), and the blocks alive at that moment are
summed by the code that allocated them (the innermost frame outside torch,
and the innermost frame). Beside it: torch's allocated bytes before the
step and its max_memory_allocated during it (T1's "peak"), and the blocks
still held after the step by site (a cache kept between steps shows there).
On the CPU (--quick) only the peak of torch.profiler's memory events is
reported, attributed to nothing.

    python -m imoe_bench train --memory              # the GPU: tables and JSON
    python -m imoe_bench train --memory --only layer # the layer half alone
    python -m imoe_bench train --memory --quick      # tiny shapes on the CPU
"""

from __future__ import annotations

import functools

import torch

from . import report
from .model_timing import log
from .train import each_model_step, layer_inputs, layer_routing, layer_step, make_experts, set_mode, setup
from .train_report import label as train_label

MODES = [("grouped_mm", None), ("eager", None), ("idempotent", None), ("idempotent", 1.0)]
TOP = 12
FREES = ("free_requested", "free_completed")


def _site(frames: list, skip: tuple = ("/torch/",)) -> str:
    """`file:line name` of the innermost frame outside `skip` (or the
    innermost frame), file names from their package directory on; a block
    without frames was allocated before the recording began."""
    if not frames:
        return "(before the recording)"
    for f in frames:
        if not any(s in f["filename"] for s in skip):
            break
    else:
        f = frames[0]
    name = f["filename"]
    for root in ("site-packages/", "python/", "benchmarks/"):
        if root in name:
            name = name.split(root, 1)[1]
            break
    return f"{name}:{f['line']} {f['name']}"


def peak_of(events: list) -> tuple[int, list]:
    """(peak bytes, the allocations alive then [(bytes, frames)]) of a CUDA
    allocator trace: `alloc` adds a block, the first `free_requested` or
    `free_completed` of its address removes it (a block freed that was
    allocated before the trace began is not counted either way)."""
    live: dict = {}
    total = peak = 0
    at = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] in FREES and e["addr"] in live:
            total -= live.pop(e["addr"])
    alive: dict = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] in FREES:
            alive.pop(e["addr"], None)
    return peak, sorted(alive.values(), key=lambda a: -a[0])


def by_site(alive: list, top: int = TOP) -> list:
    """The allocations alive at the peak summed by allocating site (outside
    torch), largest first: [{site, inner, bytes, blocks}], the rest summed."""
    sites: dict = {}
    for size, frames in alive:
        key = (_site(frames), _site(frames, skip=()))
        s = sites.setdefault(key, [0, 0])
        s[0] += size
        s[1] += 1
    rows = [dict(site=k[0], inner=k[1], bytes=v[0], blocks=v[1])
            for k, v in sorted(sites.items(), key=lambda kv: -kv[1][0])]
    rest = rows[top:]
    rows = rows[:top]
    if rest:
        rows.append(dict(site=f"{len(rest)} more sites", inner="", bytes=sum(r["bytes"] for r in rest),
                         blocks=sum(r["blocks"] for r in rest)))
    return rows


def cpu_peak(step) -> int:
    """The peak bytes of one step from torch.profiler's CPU memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    total = peak = 0
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return peak


def held_blocks(snapshot: dict, top: int = TOP) -> list:
    """The blocks a snapshot shows in use (`active_allocated`), summed by
    allocating site as by_site does (blocks allocated before the recording
    began carry no frames and sum as one site)."""
    alive = [(b["size"], b.get("frames") or []) for seg in snapshot["segments"] for b in seg["blocks"]
             if b["state"] == "active_allocated"]
    return by_site(alive, top)


def cuda_peak(step) -> dict:
    """One warm-up step and one step, both recorded by the allocator's
    history: the step's peak and the blocks alive at it (peak_of, by_site),
    torch's allocated bytes before the step and its max_memory_allocated
    during it (T1's peak), and the blocks held after it (held_blocks: a cache
    kept between steps shows there, attributed to the warm-up that made it)."""
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        start = len(torch.cuda.memory._snapshot()["device_traces"][device])
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize()
        most = torch.cuda.max_memory_allocated(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, alive = peak_of(snapshot["device_traces"][device][start:])
    return dict(peak_bytes=peak, allocated_before=before, max_allocated=most, sites=by_site(alive),
                held_after=held_blocks(snapshot))


def _measure(dev, step, row: dict) -> dict:
    if dev.type == "cuda":
        row.update(cuda_peak(step))
    else:
        step()
        row.update(peak_bytes=cpu_peak(step), sites=[])
    return row


def _models(cfg, dev, dtype) -> list:
    return [_measure(dev, step, dict(case="model", family=family, implementation=impl, capacity=cap))
            for family, impl, cap, step in each_model_step(cfg, dev, dtype, MODES, "memory")]


def _layers(cfg, dev, dtype) -> list:
    """The experts layer alone at T1's layer shapes, balanced router, the
    step `train` times (train.layer_step)."""
    rows = []
    for name, shape in cfg["layer"].items():
        experts = make_experts(shape, dev, dtype)
        hidden, logits, grad = layer_inputs(shape, cfg["layer_tokens"], dev, dtype)
        w, idx = layer_routing(logits, shape["top_k"], False, dtype)
        for impl, cap in MODES:
            log(f"T1 memory layer {name}: {train_label(dict(implementation=impl, capacity=cap))}")
            set_mode(experts, experts.config, impl, cap)
            step = functools.partial(layer_step, experts, hidden, w, idx, grad)
            rows.append(_measure(dev, step, dict(case="layer", family=name, implementation=impl,
                                                 capacity=cap)))
        experts.zero_grad(set_to_none=True)
        del experts
    return rows


def run(device: str = "auto", quick: bool = False, only: str | None = None) -> dict:
    """Both halves of T1 (`only`: "model" or "layer")."""
    from .w4 import _machine

    dev, cfg, dtype = setup(device, quick)
    results = (_models(cfg, dev, dtype) if only != "layer" else []) + \
        (_layers(cfg, dev, dtype) if only != "model" else [])
    return dict(workload="T1 memory", machine=_machine(dev.type), quick=quick,
                dtype=str(dtype).removeprefix("torch."), config=cfg, results=results)


def tables(data: dict) -> str:
    """Per (family, mode): the step's peak, then what is alive at it by site."""
    out = []
    for r in data["results"]:
        case = "layer " if r.get("case") == "layer" else ""
        out.append(f"### {case}{r['family']}, {train_label(r)}: peak {r['peak_bytes'] / 2**20:,.1f} MiB "
                   "of the step's blocks")
        out.append("")
        if "max_allocated" in r:
            out.append(f"allocated before the step {r['allocated_before'] / 2**20:,.1f} MiB, "
                       f"max_memory_allocated during it {r['max_allocated'] / 2**20:,.1f} MiB")
            out.append("")
        for title, rows in (("alive at the peak", r["sites"]), ("held after the step", r.get("held_after"))):
            if not rows:
                continue
            out.append(f"| {title}: allocated at (outside torch) | innermost frame | MiB | blocks |")
            out.append("|---|---|---|---|")
            for s in rows:
                out.append(f"| {s['site']} | {s['inner']} | {s['bytes'] / 2**20:,.1f} | {s['blocks']} |")
            out.append("")
    m = data["machine"]
    out.append(f"{m.get('gpu') or m.get('cpu')}; torch {m['torch']}; {data['dtype']}; one recorded step "
               f"after one warm-up; {m['date']}" + (" (quick sizes)" if data["quick"] else ""))
    return "\n".join(out)


def write(data: dict, out_dir: str) -> list:
    stem = f"t1-memory-{data['machine']['device']}" + ("-quick" if data.get("quick") else "")
    return report.write_results(data, out_dir, stem)
