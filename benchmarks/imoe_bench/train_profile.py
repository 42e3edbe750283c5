"""T1's steps taken apart: where one forward + backward of the experts
layer spends its time, kernel by kernel, and what autograd keeps for the
backward, tensor by tensor; and where a model's training step spends its
time (attention, the LM head and the router beside the experts).

For each layer shape of T1 (balanced and skewed router) and each model
family, and each of grouped_mm, the library's dropless mode and its
capacity 1.0, on the same weights, routing and tokens as `train`:

- kernels: torch.profiler over `reps` steps after a warm-up step; on a GPU
  each CUDA kernel's device time per step, on the CPU each operator's own CPU
  time per step; the top ones, the rest summed, their total beside the
  step's wall time (the gap is the host's and the launch queue's);
- saved: every tensor autograd saves inside the layer (parameters excluded),
  one line per tensor however often it is saved, named by its shape against
  the layer's (T tokens, k assignments each, R = T k rows, H, I).

The model rows have kernels only (the layer rows name the saved tensors).

    python -m imoe_bench train --profile             # the GPU: tables and JSON
    python -m imoe_bench train --profile --only model  # one half
    python -m imoe_bench train --profile --quick     # tiny shapes on the CPU
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from . import report
from .model_timing import log
from .train import (
    SavedBytes,
    _sync,
    each_model_step,
    layer_inputs,
    layer_routing,
    layer_step,
    make_experts,
    set_mode,
    setup,
)
from .train_report import label as train_label

MODES = [("grouped_mm", None), ("idempotent", None), ("idempotent", 1.0)]
TOP = 12


def _label(impl: str, cap) -> str:
    return train_label(dict(implementation=impl, capacity=cap))


def tensor_name(shape: tuple, dtype: torch.dtype, dims: dict) -> str:
    """What a saved tensor of this shape is in a layer of dims (T, k, H, I)."""
    t, k, h, i = dims["T"], dims["k"], dims["H"], dims["I"]
    r = t * k
    floating = dtype.is_floating_point
    names = {(t, h): "[T, H] token rows (the hidden states)", (r, h): "[T k, H] assignment rows",
             (r, 2 * i): "[T k, 2I] gate/up output", (r, i): "[T k, I] intermediate",
             (t, k): "[T, k] routing weights" if floating else "[T, k] routing index"}
    if len(shape) == 2 and tuple(shape) in names:
        return names[tuple(shape)]
    if not floating:
        return f"int {list(shape)} (dispatch)"
    return f"{list(shape)}"


def saved_tensors(experts, hidden, idx, w, dims: dict) -> list:
    """One line per tensor autograd saves in one forward (T1's SavedBytes):
    name, shape, dtype, bytes and how often it is saved."""
    counter = SavedBytes(experts.parameters())
    h = hidden.detach().requires_grad_()
    ww = w.detach().requires_grad_()
    counter.active = True
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = experts(h, idx, ww)
    counter.active = False
    del out
    lines = [dict(name=tensor_name(shape, dtype, dims), shape=list(shape),
                  dtype=str(dtype).removeprefix("torch."), bytes=size, times=times)
             for (_, shape, dtype), (size, times) in counter.tensors.items()]
    return sorted(lines, key=lambda s: -s["bytes"])


def kernel_times(step, device, reps: int) -> dict:
    """Per step: each kernel's (GPU) or operator's own (CPU) time in seconds,
    and the step's median wall time."""
    from torch.profiler import ProfilerActivity, profile

    step()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    walls = []
    with profile(activities=acts) as prof:
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            _sync(device)
            walls.append(time.perf_counter() - t0)
    cuda = device.type == "cuda"
    rows = []
    for e in prof.key_averages():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append(dict(name=e.key, calls=e.count / reps, s=us / reps * 1e-6))
    rows.sort(key=lambda r: -r["s"])
    total = sum(r["s"] for r in rows)
    top = rows[:TOP]
    rest = rows[TOP:]
    if rest:
        top.append(dict(name=f"{len(rest)} more", calls=sum(r["calls"] for r in rest),
                        s=sum(r["s"] for r in rest)))
    return dict(kind="cuda kernels" if cuda else "cpu operators (self time)", total_s=total,
                wall_s=statistics.median(walls), top=top)


def _layers(cfg, dev, dtype, reps) -> list:
    tokens = cfg["layer_tokens"]
    results = []
    for name, shape in cfg["layer"].items():
        experts = make_experts(shape, dev, dtype)
        dims = dict(T=tokens, k=shape["top_k"], H=shape["hidden"], I=shape["inter"])
        hidden, logits, grad = layer_inputs(shape, tokens, dev, dtype)
        for skew in (False, True):
            w, idx = layer_routing(logits, shape["top_k"], skew, dtype)
            for impl, cap in MODES:
                log(f"T1 profile {name}{' skewed' if skew else ''}: {_label(impl, cap)}")
                set_mode(experts, experts.config, impl, cap)
                step = functools.partial(layer_step, experts, hidden, w, idx, grad)

                saved = saved_tensors(experts, hidden, idx, w, dims)
                results.append(dict(case="layer", shape=name, skewed=skew, implementation=impl, capacity=cap,
                                    tokens=tokens, saved=saved,
                                    saved_bytes=sum(s["bytes"] for s in saved),
                                    kernels=kernel_times(step, dev, reps)))
        del experts
    return results


def _models(cfg, dev, dtype, reps) -> list:
    tokens = cfg["batch"] * cfg["seq"]
    return [dict(case="model", shape=family, skewed=False, implementation=impl, capacity=cap, tokens=tokens,
                 kernels=kernel_times(step, dev, reps))
            for family, impl, cap, step in each_model_step(cfg, dev, dtype, MODES, "profile")]


def run(device: str = "auto", quick: bool = False, reps: int = 0, only: str | None = None) -> dict:
    """Both halves of T1 (`only`: "layer" or "model")."""
    from .w4 import _machine

    dev, cfg, dtype = setup(device, quick)
    reps = reps or (1 if quick else 3)
    results = (_layers(cfg, dev, dtype, reps) if only != "model" else []) + \
        (_models(cfg, dev, dtype, reps) if only != "layer" else [])
    return dict(workload="T1 profile", machine=_machine(dev.type), quick=quick,
                dtype=str(dtype).removeprefix("torch."), reps=reps, config=cfg, results=results)


def tables(data: dict) -> str:
    """Per (shape, router, mode): its saved tensors, then its top kernels."""
    out = []
    for r in data["results"]:
        k = r["kernels"]
        if r.get("case") == "model":
            out.append(f"### model {r['shape']}, {_label(r['implementation'], r['capacity'])}")
            out.append("")
        else:
            out.append(f"### {r['shape']}, {'skewed' if r['skewed'] else 'balanced'} router, "
                       f"{_label(r['implementation'], r['capacity'])}")
            out.append("")
            out.append(f"saved for backward: {r['saved_bytes'] / 2**20:,.1f} MiB")
            out.append("")
            out.append("| saved tensor | shape | dtype | MiB | saved |")
            out.append("|---|---|---|---|---|")
            for s in r["saved"]:
                out.append(f"| {s['name']} | {s['shape']} | {s['dtype']} | {s['bytes'] / 2**20:,.2f} | "
                           f"{s['times']}x |")
            out.append("")
        out.append(f"{k['kind']}: {k['total_s'] * 1e3:.3f} ms per step, wall {k['wall_s'] * 1e3:.3f} ms")
        out.append("")
        out.append("| kernel | calls per step | ms per step | share |")
        out.append("|---|---|---|---|")
        for e in k["top"]:
            share = e["s"] / k["total_s"] if k["total_s"] else 0.0
            out.append(f"| {e['name'][:90]} | {e['calls']:g} | {e['s'] * 1e3:.3f} | {share:.0%} |")
        out.append("")
    m = data["machine"]
    out.append(f"{m.get('gpu') or m.get('cpu')}; torch {m['torch']}; {data['dtype']}; "
               f"{data['reps']} profiled steps after one warm-up; {m['date']}"
               + (" (quick sizes)" if data["quick"] else ""))
    return "\n".join(out)


def write(data: dict, out_dir: str) -> list:
    stem = f"t1-profile-{data['machine']['device']}" + ("-quick" if data.get("quick") else "")
    return report.write_results(data, out_dir, stem)
