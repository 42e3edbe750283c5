"""Workload P1: the experts forward alone, routing given.

What transformers' MoE layer calls once it has routed: `experts(hidden [T, H],
top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`, for four shapes
(Mixtral-8x7B, Mixtral-like, Qwen3-30B-A3B, Qwen3-MoE-like), bf16, T in 1, 8,
32, 128, 512, 4096. Implementations, on the same weights and the same random
routing:

- `grouped_mm`: transformers' grouped_mm experts implementation;
- `idempotent`: the library's experts implementation, default options (its
  GEMMs picked by rows per expert: docs/moe.md, "Which GEMMs run");
- `idempotent_grouped_mm`: the same with torch's grouped_mm at every size
  (`small_m_gemm=False, experts_gemm=False`);
- `idempotent_small_m`: the same with `small_m_gemm=True, experts_gemm=False`
  (the library's grouped_gemm up to 4 rows per expert, grouped_mm above);
- `idempotent_experts_gemm`: the same with `experts_gemm=True` (the
  library's tensor-core experts GEMM at every size);
- `vllm_fused_moe` (with `--vllm-path`): vLLM's Triton fused_moe with vLLM's
  tuned configs, loaded from that checkout by benchmarks/peers/vllm_fused_moe.py
  (its moe_align_block_size, silu_and_mul and moe_sum CUDA ops in torch); also
  `vllm_fused_moe_prealigned` (the block alignment computed once outside the
  timed call) and the alignment alone (`vllm_moe_align`, time only).

Per (shape, T): device time (CUDA events around back-to-back calls queued
behind a GPU spin long enough to cover their launch), host-inclusive time
(back-to-back calls timed by the wall clock from a synchronised start to the
last one's completion) and the host's enqueue time, medians over interleaved
rounds (the order reversed every other round); the floor, max(the active
experts' weights read once at the device-to-device copy rate, 2*T*k*3*H*I
FLOPs at the bf16 matmul rate), both rates measured in the same run; the
error against the experts computed in fp32 on the same routing (max abs and
relative Frobenius). JSON to --out and a plot beside it (.png).

    python benchmarks/p1_experts.py --out "$OUT/p1-cuda.json" --vllm-path .peers/vllm
    python benchmarks/p1_experts.py --quick --out /tmp/p1-cpu.json      # CPU, tiny shapes, seconds
    python benchmarks/p1_experts.py --doc docs/moe.md --from-json benchmarks/results/p1-cuda.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/: the lab (imoe_bench) and the peers
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from imoe_bench import p1_report, runner  # noqa: E402

# name: (hidden, intermediate per expert, experts, top-k, transformers family)
SHAPES = {
    "mixtral-8x7b": (4096, 14336, 8, 2, "mixtral"),
    "mixtral-like": (2048, 7168, 8, 2, "mixtral"),
    "qwen3-30b-a3b": (2048, 768, 128, 8, "qwen3_moe"),
    "qwen3-moe-like": (1024, 768, 64, 8, "qwen3_moe"),
}
TOKENS = (1, 8, 32, 128, 512, 4096)
QUICK_SHAPES = {
    "tiny-mixtral": (64, 96, 8, 2, "mixtral"),
    "tiny-qwen3": (32, 48, 16, 4, "qwen3_moe"),
}
QUICK_TOKENS = (1, 8, 32)
WEIGHT_STD = 0.02  # as a trained model's projections: the outputs stay O(1)
QUICK_WEIGHT_STD = 0.3  # the tiny shapes' fan-in is small: larger weights keep their outputs O(1)
TARGET_MS = 100.0  # about this much time per measurement of one implementation (calls capped at --calls)
QUICK_TARGET_MS = 2.0


# --------------------------------------------------------------------------- the modules and the routing


def experts_config(family: str, hidden: int, intermediate: int, experts: int, top_k: int):
    if family == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts,
                             num_experts_per_tok=top_k, hidden_act="silu")
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                              num_experts_per_tok=top_k, hidden_act="silu")
    raise ValueError(f"unknown family {family!r}")


def experts_class(family: str):
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        return MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return Qwen3MoeExperts


def build_experts(shape: tuple, device: str, dtype: torch.dtype, seed: int, std: float) -> tuple:
    """(weights module, {implementation: experts module}): one module per
    implementation, each with its own config (the implementation's name and
    options) and all sharing the same parameters, N(0, std)."""
    import idempotent_moe.integrations as imoe_hf  # registers "idempotent"

    hidden, intermediate, experts, top_k, family = shape
    config = experts_config(family, hidden, intermediate, experts, top_k)
    cls = experts_class(family)
    with torch.device("meta"):
        base = cls(config)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in list(base.named_parameters()):
        value = torch.empty(p.shape, dtype=dtype, device=device)
        for e in range(p.shape[0]):  # expert by expert: no fp32 copy of the whole stack on the host
            value[e].copy_(torch.randn(p.shape[1:], generator=gen) * std)
        setattr(base, name, torch.nn.Parameter(value, requires_grad=False))
    modules = {}
    small_m, xg = imoe_hf.SMALL_M_GEMM_ATTR, imoe_hf.EXPERTS_GEMM_ATTR
    for impl, attrs in (("grouped_mm", {}), ("idempotent", {}),
                        ("idempotent_grouped_mm", {small_m: False, xg: False}),
                        ("idempotent_small_m", {small_m: True, xg: False}),
                        ("idempotent_experts_gemm", {small_m: False, xg: True})):
        cfg = copy.deepcopy(config)
        cfg._experts_implementation = "grouped_mm" if impl == "grouped_mm" else imoe_hf.EXPERTS_IMPLEMENTATION
        for k, v in attrs.items():
            setattr(cfg, k, v)
        with torch.device("meta"):
            m = cls(cfg)
        for name, p in base.named_parameters():
            setattr(m, name, p)
        m.config = cfg
        modules[impl] = m.eval()
    return base.eval(), modules


def routing(tokens: int, experts: int, top_k: int, dtype: torch.dtype, device: str, seed: int) -> tuple:
    """(top_k_index [T, k] int64, top_k_weights [T, k] in `dtype`): k distinct
    experts per token from random logits, softmax over the k (normalised, as
    Mixtral and Qwen3's norm_topk_prob do), rounded to the model's dtype as
    transformers' routers hand them to the experts."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    values, index = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(values, dim=-1).to(dtype)
    return index.to(device), weights.to(device)


def reference(x, w1, w2, index, weights) -> torch.Tensor:
    """The experts in fp32 (no TF32), expert by expert, on the same routing:
    sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    xf = x.float()
    for e in torch.unique(index).tolist():
        token, slot = torch.where(index == e)
        h = xf[token] @ w1[e].float().t()
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = (a @ w2[e].float().t()) * weights[token, slot, None].float()
        out.index_add_(0, token, y)
    return out


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.float() - ref
    ref_norm = float(ref.norm())
    return {"max_abs_err": float(diff.abs().max()),
            "rel_err": float(diff.norm()) / ref_norm if ref_norm else 0.0,
            "max_abs_ref": float(ref.abs().max())}


# --------------------------------------------------------------------------- timing


class Timer:
    """Device and host timing of zero-argument calls on one device."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.cycles_per_ms = self._calibrate_spin() if self.cuda else None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _calibrate_spin(self) -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)
        samples = []
        for _ in range(3):
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(cycles)
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
        return cycles / statistics.median(samples)

    def host(self, fn, calls: int) -> tuple:
        """(host-inclusive ms per call: synchronised start to the last call's
        completion, enqueue ms per call: the same start to the last call
        returning on the host)."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        self.sync()
        t2 = time.perf_counter()
        return (t2 - t0) / calls * 1e3, (t1 - t0) / calls * 1e3

    def device(self, fn, calls: int, enqueue_ms: float) -> tuple:
        """(device ms per call, queue filled): CUDA events around `calls`
        back-to-back calls issued behind a spin sized to outlast their
        enqueueing; `queue filled` says the spin was still running when the
        last call had been issued (so the events saw no host gap). On the CPU:
        the host-inclusive time, and None."""
        if not self.cuda:
            return self.host(fn, calls)[0], None
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spin_ms = enqueue_ms * calls * 1.5 + 1.0
        torch.cuda.synchronize()
        torch.cuda._sleep(int(spin_ms * self.cycles_per_ms))
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        filled = not start.query()
        stop.synchronize()
        return start.elapsed_time(stop) / calls, filled


def measure_rates(device: str, quick: bool) -> dict:
    """The copy rate (bytes read + written per second of a device-to-device
    copy) and the bf16 matmul rate (FLOP/s of a square matmul), medians."""
    timer_sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    nbytes = (64 << 20) if quick else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    n = 256 if quick else 8192
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)

    def median_ms(fn, runs):
        fn()
        samples = []
        for _ in range(runs):
            if device.startswith("cuda"):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                samples.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        timer_sync()
        return statistics.median(samples)

    runs = 3 if quick else 10
    copy_ms = median_ms(lambda: dst.copy_(src), runs)
    mm_ms = median_ms(lambda: torch.mm(a, b), runs)
    return {"copy_bytes": nbytes, "copy_ms": copy_ms, "copy_bandwidth_Bps": 2 * nbytes / (copy_ms * 1e-3),
            "matmul_n": n, "matmul_ms": mm_ms, "bf16_matmul_flops": 2 * n ** 3 / (mm_ms * 1e-3)}


# --------------------------------------------------------------------------- one row


def one_row(shape_name, shape, tokens, base, modules, peer, timer, rates, args, device, dtype) -> dict:
    hidden, intermediate, experts, top_k, _ = shape
    seed = args.seed * 1_000_003 + tokens * 101 + experts
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    index, weights = routing(tokens, experts, top_k, dtype, device, seed + 1)
    w1, w2 = base.gate_up_proj.data, base.down_proj.data

    fns = {name: (lambda m=m: m(x, index, weights)) for name, m in modules.items()}
    row_extra = {}
    if peer is not None:
        ids32 = index.to(torch.int32)
        w32 = weights.float()  # vLLM's routers hand fp32 weights; the same values as the others get
        config, source = peer.config_for(tokens, experts, hidden, intermediate, top_k)
        aligned = peer.align(ids32, config, experts)
        fns["vllm_fused_moe"] = lambda: peer.forward(x, w1, w2, w32, ids32, config)
        fns["vllm_fused_moe_prealigned"] = lambda: peer.forward(x, w1, w2, w32, ids32, config, align=aligned)
        fns["vllm_moe_align"] = lambda: peer.align(ids32, config, experts)
        row_extra["vllm_config"] = dict(config, source=source)

    ref = reference(x, w1, w2, index, weights)
    result = {"shape": shape_name, "hidden": hidden, "intermediate": intermediate, "experts": experts,
              "top_k": top_k, "tokens": tokens, "active_experts": int(torch.unique(index).numel())}
    elem = torch.tensor([], dtype=dtype).element_size()
    weight_bytes = result["active_experts"] * 3 * hidden * intermediate * elem
    flops = 2 * tokens * top_k * 3 * hidden * intermediate
    floor_bw = weight_bytes / rates["copy_bandwidth_Bps"] * 1e3
    floor_flop = flops / rates["bf16_matmul_flops"] * 1e3
    result.update(weight_bytes=weight_bytes, flops=flops, floor_bw_ms=floor_bw, floor_flop_ms=floor_flop,
                  floor_ms=max(floor_bw, floor_flop), **row_extra)

    impls = {}
    with torch.no_grad():
        for name, fn in fns.items():  # warm-up (and Triton's compile), the error, a first estimate
            for _ in range(args.warmup):
                out = fn()
            timer.sync()
            entry = {}
            if name != "vllm_moe_align":
                entry.update(errors(out, ref))
            once = timer.host(fn, 1)[0]
            target = TARGET_MS if timer.cuda else QUICK_TARGET_MS
            entry["calls"] = max(3, min(args.calls, int(target / max(once, 1e-3))))
            impls[name] = entry
        samples = {name: {"device": [], "host": [], "enqueue": [], "filled": []} for name in fns}
        for r in range(args.rounds):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in order:
                calls = impls[name]["calls"]
                host, enqueue = timer.host(fns[name], calls)
                if timer.cuda:
                    dev, filled = timer.device(fns[name], calls, enqueue)
                    tries = calls
                    while filled is False and tries > 3:  # the launch queue ran full: fewer calls
                        tries = max(3, tries // 2)
                        dev, filled = timer.device(fns[name], tries, enqueue)
                else:
                    dev, filled = host, None
                s = samples[name]
                s["device"].append(dev)
                s["host"].append(host)
                s["enqueue"].append(enqueue)
                s["filled"].append(filled)
    for name, s in samples.items():
        e = impls[name]
        e.update(device_ms=statistics.median(s["device"]), device_ms_min=min(s["device"]),
                 device_ms_rounds=s["device"], host_inclusive_ms=statistics.median(s["host"]),
                 host_enqueue_ms=statistics.median(s["enqueue"]),
                 queue_filled=None if s["filled"][0] is None else all(s["filled"]))
        if name != "vllm_moe_align":
            e["device_over_floor"] = e["device_ms"] / result["floor_ms"]
    if "vllm_fused_moe" in impls:
        vllm = impls["vllm_fused_moe"]
        for name, e in impls.items():
            if name != "vllm_moe_align":
                e["device_over_vllm"] = e["device_ms"] / vllm["device_ms"]
                e["host_inclusive_over_vllm"] = e["host_inclusive_ms"] / vllm["host_inclusive_ms"]
    result["impls"] = impls
    return result


# --------------------------------------------------------------------------- environment, plot, main


def environment(device: str) -> dict:
    import transformers

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "transformers": transformers.__version__, "device": device}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["commit"] = runner.git_commit()
    if device.startswith("cuda"):
        env["gpu_name"] = torch.cuda.get_device_name()
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            env["driver"] = smi.stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["gpu_name"] = None
        env["driver"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    panels = [("device_over_floor", "device time / floor")]
    if result["vllm"] is not None:
        panels.append(("device_over_vllm", "device time / vLLM fused_moe's"))
    fig, axes = plt.subplots(len(panels), len(shapes), figsize=(4.5 * len(shapes), 4 * len(panels)),
                             squeeze=False)
    for (key, label), ax_row in zip(panels, axes):
        for ax, shape in zip(ax_row, shapes):
            rows = [r for r in result["rows"] if r["shape"] == shape]
            names = [n for n in rows[0]["impls"] if n != "vllm_moe_align"]
            for name in names:
                ax.plot([r["tokens"] for r in rows], [r["impls"][name][key] for r in rows], marker="o",
                        label=name)
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(shape)
            ax.set_xlabel("tokens T")
            ax.set_ylabel(label)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"P1 experts forward, {result['env'].get('gpu_name') or 'CPU'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv):
    p = argparse.ArgumentParser(description="Workload P1: the experts forward alone, routing given.")
    p.add_argument("--out", default=None, help="JSON path (the plot goes beside it, .png)")
    p.add_argument("--doc", default=None, help="a document whose <!-- bench:p1 --> section gets the table")
    p.add_argument("--from-json", default=None, help="with --doc: render this JSON instead of measuring")
    p.add_argument("--quick", action="store_true", help="CPU, tiny shapes, no vLLM: a smoke test in seconds")
    p.add_argument("--vllm-path", default=None, help="a vLLM checkout: adds vLLM's Triton fused_moe")
    p.add_argument("--shapes", default=None, help="comma-separated subset of the shapes")
    p.add_argument("--tokens", default=None, help="comma-separated token counts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=50, help="most back-to-back calls per measurement")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.calls < 1 or args.warmup < 1:
        p.error("--rounds, --calls and --warmup must be at least 1")
    if args.from_json and not args.doc:
        p.error("--from-json renders a table: name the document with --doc")
    if not args.out and not args.from_json:
        p.error("--out names the JSON to write")
    return args


def update_doc(path: str, result: dict) -> None:
    """The table of `result` into `path`'s bench:p1 section (imoe_bench.p1_report)."""
    p1_report.update_doc(path, result)


def write_json(result: dict, path: str) -> None:
    """The result as it stands, replacing the file whole (no half-written JSON)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def row_line(row: dict) -> str:
    """Each implementation's device time (ms) and, where checked, its relative error."""
    parts = []
    for name, e in row["impls"].items():
        err = f" ({e['rel_err']:.1e})" if "rel_err" in e else ""
        parts.append(f"{name} {e['device_ms']:.4f}{err}")
    return "  ".join(parts)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        with open(args.from_json) as f:
            update_doc(args.doc, json.load(f))
        print(f"updated {args.doc} from {args.from_json}")
        return 0
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        unknown = [s for s in args.shapes.split(",") if s not in shapes]
        if unknown:
            raise SystemExit(f"unknown shapes {unknown}; known: {sorted(shapes)}")
        shapes = {s: shapes[s] for s in args.shapes.split(",")}
    tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    if args.quick:
        if args.vllm_path:
            raise SystemExit("--quick runs on the CPU, without vLLM: drop --vllm-path")
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("P1 needs a CUDA device (or --quick for the CPU smoke test)")
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference
    dtype = torch.bfloat16
    std = QUICK_WEIGHT_STD if args.quick else WEIGHT_STD
    peer = None
    if args.vllm_path:
        from peers.vllm_fused_moe import VllmFusedMoe

        peer = VllmFusedMoe(args.vllm_path)

    env = environment(device)
    rates = measure_rates(device, args.quick)
    timer = Timer(device)
    result = {"workload": "P1", "quick": args.quick, "env": env, "dtype": "bfloat16",
              "device_timing": "cuda events, back-to-back calls behind a spin" if timer.cuda
              else "cpu wall clock, back-to-back calls (no device)",
              "settings": {"rounds": args.rounds, "max_calls": args.calls, "warmup": args.warmup,
                           "target_ms_per_measurement": TARGET_MS, "seed": args.seed, "weight_std": std},
              "rates": rates, "vllm": None, "rows": []}
    if peer is not None:
        result["vllm"] = dict(peer.describe(), notes=(
            "fused_moe_kernel is vLLM's, run by the installed Triton; moe_align_block_size, silu_and_mul and "
            "moe_sum (vLLM CUDA ops) are torch equivalents: benchmarks/peers/vllm_fused_moe.py"))
    t_start = time.perf_counter()
    for shape_name, shape in shapes.items():
        base, modules = build_experts(shape, device, dtype, args.seed, std)
        for t in tokens:
            row = one_row(shape_name, shape, t, base, modules, peer, timer, rates, args, device, dtype)
            result["rows"].append(row)
            print(f"{shape_name:15s} T={t:5d} floor {row['floor_ms']:.4f} ms  {row_line(row)}", flush=True)
            write_json(result, args.out)  # the rows so far: a run cut short keeps them
        del base, modules
        if device == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = time.perf_counter() - t_start
    if peer is not None:
        names = [n for n in result["rows"][0]["impls"] if n not in ("vllm_fused_moe", "vllm_moe_align")]
        print("device time / vLLM fused_moe's:", "  ".join(names))
        for row in result["rows"]:
            ratios = "  ".join(f"{row['impls'][n]['device_over_vllm']:.2f}" for n in names)
            print(f"{row['shape']:15s} T={row['tokens']:5d}  {ratios}")
    result["plot"] = plot(result, os.path.splitext(args.out)[0] + ".png")
    write_json(result, args.out)
    print(f"wrote {args.out} ({result['wall_s']:.1f} s)")
    if args.doc:
        update_doc(args.doc, result)
        print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
