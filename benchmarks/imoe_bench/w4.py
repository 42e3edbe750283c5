"""W4: one Mixtral sparse-MoE block (hidden 4096, intermediate 14336, 8 experts,
top-2, bf16; 16 and 4096 tokens) through transformers' experts
implementations "eager" and "grouped_mm" and ours, "idempotent" (dropless, and
capacity mode at a few capacity factors), on the same weights and inputs.

Each row: median and min time of the block's forward (router included; on a
GPU device time behind a spin longer than the host's launch work, with that
host time per forward beside it), the peak memory one forward allocates
beyond what was allocated before it and the caching allocator's reserved
pool before and after (CUDA), and a check of the
output: eager, grouped_mm and dropless rows against the experts in fp32 on the
same routing (mean and largest absolute error); dropless rows also against
grouped_mm bit for bit, or, where the GEMM shapes differ (the chunked gate of
a large batch), no further from fp32 than grouped_mm; capacity rows against a plain torch reference that
drops each expert's lowest-weight overflow (same count dropped, largest
relative difference). `--quick` runs a reduced block on the CPU in seconds.

    python -m imoe_bench w4 [--device cuda] [--quick]
"""

from __future__ import annotations

from dataclasses import dataclass

from . import report, runner
from .timing import cuda_memory, time_calls


@dataclass(frozen=True)
class Block:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: tuple
    dtype: str


FULL = Block(4096, 14336, 8, 2, (16, 4096), "bfloat16")
QUICK = Block(64, 128, 8, 2, (16, 256), "float32")
CAPACITY_FACTORS = (1.0, 1.25)
W4_BUSY_CYCLES = 10_000_000  # about 5 ms of GPU spin before each timed forward


def _device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU")
    return requested


def build_block(shape: Block, device: str, seed: int = 0):
    """A MixtralSparseMoeBlock with N(0, 0.02) weights, in eval mode."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                           num_local_experts=shape.experts, num_experts_per_tok=shape.top_k)
    with torch.device(device):
        block = MixtralSparseMoeBlock(config)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return block.to(getattr(torch, shape.dtype)).eval()


def _use(block, implementation: str, capacity_factor: float | None) -> None:
    from idempotent_moe.integrations import CAPACITY_FACTOR_ATTR

    config = block.experts.config
    config._experts_implementation = implementation
    setattr(config, CAPACITY_FACTOR_ATTR, capacity_factor)


def capacity_reference(block, hidden, capacity_factor: float):
    """The block's output with each expert's overflow dropped, out of place:
    per expert, the routed tokens by descending weight (stable: ties to the
    lower token), the first C kept, the expert MLP as eager computes it.
    Returns (output [B, S, H], number of dropped assignments)."""
    import torch
    import torch.nn.functional as F
    from idempotent_moe.distributed import expert_capacity

    experts = block.experts
    tokens = hidden.reshape(-1, hidden.shape[-1])
    _, weights, index = block.gate(tokens)
    num_tokens, top_k = index.shape
    capacity = expert_capacity(num_tokens, top_k, experts.num_experts, capacity_factor)
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    dropped = 0
    for e in range(experts.num_experts):
        token_idx, slot = torch.where(index == e)
        w = weights[token_idx, slot]
        order = torch.sort(-w.float(), stable=True).indices[:capacity]
        dropped += len(token_idx) - len(order)
        token_idx, w = token_idx[order], w[order]
        gate, up = F.linear(tokens[token_idx], experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
        out.index_add_(0, token_idx, (y * w[:, None]).float())
    return out.to(hidden.dtype).reshape(hidden.shape), dropped


def fp32_reference(block, hidden):
    """The block's experts in fp32 (eager) on the block's own routing: the
    yardstick for the no-sync rows whose GEMM shapes differ from grouped_mm's.
    Returns [B, S, H] fp32."""
    import copy

    import torch

    tokens = hidden.reshape(-1, hidden.shape[-1])
    _, weights, index = block.gate(tokens)
    experts = copy.deepcopy(block.experts).float()
    experts.config._experts_implementation = "eager"
    out = experts(tokens.float(), index, weights.float())
    del experts
    if tokens.is_cuda:
        torch.cuda.empty_cache()
    return out.reshape(hidden.shape)


def _memory(device: str, fn) -> dict:
    return cuda_memory(fn)[1] if device == "cuda" else {}


def _max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def run(device: str = "auto", runs: int = 0, quick: bool = False, tokens: tuple = (),
        capacity_factors: tuple = CAPACITY_FACTORS, out: str = report.DEFAULT_OUT,
        plot: bool = True, doc: str | None = None) -> dict:
    import idempotent_moe as imoe
    import torch
    from idempotent_moe.integrations import capacity_stats, register

    register()
    device = _device(device)
    if doc:
        report.require_section(doc, "bench:w4")
    shape = QUICK if quick else FULL
    if tokens:
        shape = Block(shape.hidden, shape.intermediate, shape.experts, shape.top_k, tuple(tokens),
                      shape.dtype)
    runs = runs or (100 if device == "cuda" else 5)
    if device == "cuda" and capacity_factors and not imoe.cuda_available():
        print("note: this build of idempotent_moe has no CUDA kernels: capacity rows are skipped")
        capacity_factors = ()
    block = build_block(shape, device)
    impls = [("eager", "eager", None), ("grouped_mm", "grouped_mm", None),
             ("idempotent dropless", "idempotent", None)]
    impls += [(f"idempotent capacity x{f:g}", "idempotent", f) for f in capacity_factors]
    g = torch.Generator(device=device).manual_seed(1)
    rows = []
    bar = runner._progress(len(shape.tokens) * len(impls))
    for num_tokens in shape.tokens:
        hidden = torch.randn(1, num_tokens, shape.hidden, generator=g, device=device,
                             dtype=getattr(torch, shape.dtype))
        outputs = {}
        with torch.no_grad():
            exact = fp32_reference(block, hidden)
        for name, implementation, factor in impls:
            bar.set_description(f"W4 {num_tokens} tokens: {name}")
            _use(block, implementation, factor)
            with torch.no_grad():
                def call(hidden=hidden):
                    return block(hidden)

                # A forward launches tens of kernels from Python (about 1-2 ms of
                # host work on a slow host): the spin covers it, so the median is
                # device time, what a captured (CUDA graph) forward costs;
                # host_ms is the eager launch cost beside it.
                timing = time_calls(call, lambda: None, device=device, runs=runs, warmup=3,
                                    busy_cycles=W4_BUSY_CYCLES)
                memory = _memory(device, call)
                result = call()
                row = {"workload": "W4", "tokens": num_tokens, "dtype": shape.dtype, "impl": name,
                       "experts_implementation": implementation, "capacity_factor": factor,
                       "median_ms": timing.median_ms, "min_ms": timing.min_ms, "runs": timing.runs,
                       "host_ms": timing.host_ms,
                       **memory}
                if factor is None:
                    outputs[name] = result
                    error = (result.float() - exact).abs()
                    row["max_abs_err_vs_fp32"] = float(error.max())
                    row["mean_abs_err_vs_fp32"] = float(error.mean())
                    if name != "eager":
                        row["max_abs_diff_vs_eager"] = _max_diff(result, outputs["eager"])
                    if name == "idempotent dropless":
                        grouped = next(r for r in rows if r["tokens"] == num_tokens
                                       and r["impl"] == "grouped_mm")
                        row["bit_exact_vs_grouped_mm"] = bool(torch.equal(result, outputs["grouped_mm"]))
                        # Where the GEMM shapes differ (a chunked gate), no further
                        # from the fp32 reference than grouped_mm is.
                        row["ok"] = row["bit_exact_vs_grouped_mm"] or (
                            row["mean_abs_err_vs_fp32"] <= grouped["mean_abs_err_vs_fp32"] * 1.01 + 1e-9)
                else:
                    reference, ref_dropped = capacity_reference(block, hidden, factor)
                    stats = next(iter(capacity_stats(block).values()))
                    scale = float(reference.float().abs().max()) or 1.0
                    row.update(capacity=stats.capacity, dropped=stats.dropped,
                               reference_dropped=ref_dropped,
                               max_rel_diff_vs_reference=_max_diff(result, reference) / scale)
                    tol = 1e-5 if shape.dtype == "float32" else 3e-2
                    row["ok"] = (stats.dropped == ref_dropped
                                 and row["max_rel_diff_vs_reference"] <= tol)
            rows.append(row)
            bar.update(1)
    bar.close()
    for row in rows:
        base = {r["impl"]: r["median_ms"] for r in rows if r["tokens"] == row["tokens"]}
        row["speedup_vs_eager"] = base["eager"] / row["median_ms"]
        row["speedup_vs_grouped_mm"] = base["grouped_mm"] / row["median_ms"]
    data = {"machine": _machine(device), "quick": quick, "block": shape.__dict__,
            "description": "W4: one Mixtral sparse-MoE block, router included; inference (no_grad)",
            "results": rows}
    print(table(data))
    for path in write(data, out, plot=plot):
        print(f"wrote {path}")
    if doc:
        update_doc(doc, data)
        print(f"updated {doc}")
    if not all(r.get("ok", True) for r in rows):
        raise SystemExit("a W4 row failed its output check")
    return data


def _machine(device: str) -> dict:
    import torch
    import transformers

    info = runner._machine(device, torch.get_num_threads(), 0.0)
    info.pop("copy_bandwidth_GBps", None)
    info["transformers"] = transformers.__version__
    return info


def _mib(nbytes) -> str:
    return "" if nbytes is None else f"{nbytes / 2**20:.1f}"


def table(data: dict) -> str:
    rows = data["results"]
    has_mem = any("peak_allocated_bytes" in r for r in rows)
    head = ["tokens", "implementation", "median ms", "min ms", "x faster than eager",
            "x faster than grouped_mm", "host ms"]
    if has_mem:
        head += ["peak alloc MiB", "reserved MiB before -> after"]
    head += ["dropped", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["tokens"]), r["impl"], f"{r['median_ms']:.3f}", f"{r['min_ms']:.3f}",
                 f"{r['speedup_vs_eager']:.2f}x", f"{r['speedup_vs_grouped_mm']:.2f}x",
                 f"{r['host_ms']:.3f}" if "host_ms" in r else ""]
        if has_mem:
            cells += [_mib(r.get("peak_allocated_bytes")),
                      f"{_mib(r.get('reserved_before_bytes'))} -> {_mib(r.get('reserved_after_bytes'))}"]
        cells.append("" if "dropped" not in r else f"{r['dropped']} (C={r['capacity']})")
        if "bit_exact_vs_grouped_mm" in r:
            check = ("bit-exact vs grouped_mm" if r["bit_exact_vs_grouped_mm"]
                     else f"{'ok' if r['ok'] else 'FAILED'}: vs fp32, mean |err| "
                          f"{r['mean_abs_err_vs_fp32']:.2e}, max {r['max_abs_err_vs_fp32']:.2e}")
        elif "reference_dropped" in r:
            check = f"{'ok' if r['ok'] else 'FAILED'} vs reference ({r['max_rel_diff_vs_reference']:.1e} rel)"
        elif "mean_abs_err_vs_fp32" in r:
            check = f"vs fp32, mean |err| {r['mean_abs_err_vs_fp32']:.2e}, max {r['max_abs_err_vs_fp32']:.2e}"
        elif "max_abs_diff_vs_eager" in r:
            check = f"max |diff| vs eager {r['max_abs_diff_vs_eager']:.2e}"
        else:
            check = "reference"
        cells.append(check)
        lines.append("| " + " | ".join(cells) + " |")
    m, b = data["machine"], data["block"]
    lines.append("")
    lines.append(f"{m.get('gpu') or m.get('cpu')}; torch {m['torch']}; transformers {m['transformers']}; "
                 f"hidden {b['hidden']}, intermediate {b['intermediate']}, {b['experts']} experts, "
                 f"top-{b['top_k']}, {b['dtype']}; {m['date']}" + (" (quick sizes)" if data["quick"] else ""))
    return "\n".join(lines)


def update_doc(path: str, data: dict) -> None:
    """Replace the table between <!-- bench:w4 --> and <!-- /bench:w4 --> (docs/results.md)."""
    report.replace_section(path, "bench:w4", lambda: table(data))


def doc_from_json(path: str, json_path: str) -> None:
    update_doc(path, report.read_json(json_path))


def _stem(data: dict) -> str:
    return f"w4-{data['machine']['device']}" + ("-quick" if data.get("quick") else "")


def write(data: dict, out_dir: str, plot: bool = True) -> list:
    return report.write_results(data, out_dir, _stem(data), _plot if plot else None)


def _plot(data: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    tokens = list(dict.fromkeys(r["tokens"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    has_mem = any("peak_allocated_bytes" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if has_mem else 1, figsize=(5.5 * (2 if has_mem else 1), 4.2),
                             squeeze=False)
    width = 0.8 / len(impls)
    panels = [("median_ms", "median time, ms (log)")]
    if has_mem:
        panels.append(("peak_allocated_bytes", "peak allocated, MiB (log)"))
    for ax, (key, label) in zip(axes[0], panels):
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for t, n in enumerate(tokens):
                for r in rows:
                    if r["tokens"] == n and r["impl"] == impl and r.get(key) is not None:
                        xs.append(t + i * width)
                        ys.append(r[key] / (2**20 if key.endswith("bytes") else 1))
            ax.bar(xs, [max(y, 1e-3) for y in ys], width, label=impl)
        ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tokens))])
        ax.set_xticklabels([f"{n} tokens" for n in tokens])
        ax.set_yscale("log")
        ax.set_ylabel(label)
    m = data["machine"]
    axes[0][0].set_title(f"W4 Mixtral MoE block: {m.get('gpu') or m.get('cpu')}", fontsize=9)
    report.legend_outside(axes[0][-1], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
