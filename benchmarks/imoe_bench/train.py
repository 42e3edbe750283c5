"""Workload T1: training with MoE layers.

- model: the M1 families at 4 layers (Mixtral-like: hidden 2048, intermediate
  7168, 8 experts, top-2; Qwen3-MoE-like: hidden 1024, moe intermediate 768,
  64 experts, top-8), batch 4 x 1024 tokens, bf16, one forward + backward
  (router auxiliary loss on);
- layer: the experts layer alone, forward + backward, at the Mixtral-8x7B
  shape (4096, 14336, 8, top-2) and the Qwen3-30B-A3B shape (2048, 768, 128,
  top-8), 16,384 tokens;

each with the "idempotent" experts implementation dropless and with capacity
1.0 and 1.25, against transformers' grouped_mm and eager, same weights,
interleaved rounds, medians; the layer cases also with a skewed router (+3
on expert 0's logit; the model cases run their own routers unchanged).
Reported: step time, tokens/s, peak memory, the bytes autograd saves
in the MoE layers (parameters excluded, saved-tensor hooks), and the FLOP
floor 6 T k 3 H I at the measured bf16 GEMM rate. --quick: tiny shapes on the
CPU in seconds (a check of the script, not a measurement).

    python -m imoe_bench train                       # the GPU: JSON, plot, table
    python -m imoe_bench train --quick               # the CPU, tiny shapes, seconds
    python -m imoe_bench train --doc docs/moe.md     # and the table of docs/moe.md
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time

import idempotent_moe.integrations as imoe_hf
import torch

from .model_timing import log, round_order
from .train_report import GRAD_NAMES, label

FULL = {
    "model": {
        "mixtral_like": dict(hidden=2048, inter=7168, experts=8, top_k=2, heads=16, kv=4),
        "qwen3_moe_like": dict(hidden=1024, inter=768, experts=64, top_k=8, heads=16, kv=4),
    },
    "layer": {
        "mixtral_8x7b": dict(hidden=4096, inter=14336, experts=8, top_k=2),
        "qwen3_30b_a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
    },
    "layers": 4, "batch": 4, "seq": 1024, "layer_tokens": 16384, "vocab": 32000,
}
QUICK = {
    "model": {
        "mixtral_like": dict(hidden=64, inter=96, experts=8, top_k=2, heads=4, kv=2),
        "qwen3_moe_like": dict(hidden=32, inter=24, experts=16, top_k=4, heads=4, kv=2),
    },
    "layer": {
        "mixtral_8x7b": dict(hidden=64, inter=128, experts=8, top_k=2),
        "qwen3_30b_a3b": dict(hidden=32, inter=24, experts=16, top_k=4),
    },
    "layers": 2, "batch": 2, "seq": 32, "layer_tokens": 256, "vocab": 128,
}
MODES = [("grouped_mm", None), ("eager", None), ("idempotent", None), ("idempotent", 1.0),
         ("idempotent", 1.25)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _allocated(device):
    """What is allocated when the peak is reset: the floor the steps' peak
    stands on (parameters, inputs, and whatever earlier modes left)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def bf16_rate(device, quick: bool) -> float:
    """Measured dense bf16 GEMM FLOP/s (the floor's rate)."""
    n = 256 if quick else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    reps = 3 if quick else 20
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def make_model(family: str, shape: dict, cfg: dict, device, dtype):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=cfg["vocab"], hidden_size=shape["hidden"], num_hidden_layers=cfg["layers"],
                  num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
                  max_position_embeddings=cfg["seq"], output_router_logits=True, use_cache=False)
    torch.manual_seed(0)
    if family == "mixtral_like":
        config = MixtralConfig(**common, intermediate_size=shape["inter"], num_local_experts=shape["experts"],
                               num_experts_per_tok=shape["top_k"])
        model = MixtralForCausalLM(config)
    else:
        config = Qwen3MoeConfig(**common, intermediate_size=shape["inter"],
                                moe_intermediate_size=shape["inter"],
                                num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                                head_dim=shape["hidden"] // shape["heads"])
        model = Qwen3MoeForCausalLM(config)
    return model.to(device, dtype).train()


def make_experts(shape: dict, device, dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                           num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"])
    torch.manual_seed(0)
    experts = MixtralExperts(config).to(device, dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02)
    return experts


def set_mode(target, config, implementation: str, capacity):
    setattr(config, imoe_hf.CAPACITY_FACTOR_ATTR, capacity)
    if hasattr(target, "set_experts_implementation"):
        if implementation == "idempotent":
            imoe_hf.use_idempotent_experts(target, capacity)
        else:
            target.set_experts_implementation(implementation)
    else:
        config._experts_implementation = implementation


class SavedBytes:
    """What autograd saves inside the experts modules while `active`,
    parameters excluded: one entry per tensor however often it is saved
    (`tensors`: (data_ptr, shape, dtype) -> [tensor's bytes, times saved]),
    and their bytes. `reset()` before each step."""

    def __init__(self, params):
        self.params = {p.data_ptr() for p in params}
        self.active = False
        self.reset()

    def reset(self):
        self.tensors: dict = {}

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.tensors.values())

    def pack(self, t):
        if self.active and t.data_ptr() not in self.params:
            entry = self.tensors.setdefault((t.data_ptr(), tuple(t.shape), t.dtype),
                                            [t.numel() * t.element_size(), 0])
            entry[1] += 1
        return t


def wrap_experts(model, counter: SavedBytes):
    for m in model.modules():
        if not (hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")):
            continue
        if getattr(m, "_t1_wrapped", False):
            continue
        forward = m.forward

        def counted(*a, _forward=forward, **k):
            counter.active = True
            try:
                return _forward(*a, **k)
            finally:
                counter.active = False
        m.forward = counted
        m._t1_wrapped = True


def time_step(fn, device, reps):
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def capacity_keep(idx: torch.Tensor, w: torch.Tensor, experts: int, factor) -> torch.Tensor:
    """[T, k] bool: the assignments a capacity keeps, by the library's rule
    (each expert its C = ceil(T k / E f) highest weights, ties by token)."""
    if factor is None:
        return torch.ones_like(idx, dtype=torch.bool)
    tokens, k = idx.shape
    cap = math.ceil(tokens * k / experts * factor)
    flat_e, flat_w = idx.reshape(-1), w.float().reshape(-1)
    order = torch.arange(flat_e.numel(), device=idx.device)          # token-major: ties by token
    order = order[torch.sort(-flat_w[order], stable=True).indices]   # then by weight, descending
    order = order[torch.sort(flat_e[order], stable=True).indices]    # then by expert
    counts = torch.bincount(flat_e, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=idx.device) - starts[flat_e[order]]
    return (rank < cap).view(tokens, k)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den else float((a - b).norm().item())


def layer_grads(experts, hidden, idx, w, grad):
    """(out, d hidden, d weights, d gate_up_proj, d down_proj) of one step."""
    experts.zero_grad(set_to_none=True)
    h = hidden.detach().requires_grad_()
    ww = w.detach().requires_grad_()
    out = experts(h, idx, ww)
    out.backward(grad)
    return [out.detach(), h.grad, ww.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


def fp32_reference(experts, hidden, idx, w, grad, keep):
    """layer_grads of an fp32 copy through transformers' eager loop, the
    dropped assignments' weights zeroed (their gradient is then zero too)."""
    ref = copy.deepcopy(experts).float()
    ref.config = copy.copy(experts.config)
    ref.config._experts_implementation = "eager"
    setattr(ref.config, imoe_hf.CAPACITY_FACTOR_ATTR, None)
    with _no_tf32():
        got = layer_grads(ref, hidden.float(), idx, w.float() * keep, grad.float())
    got[2] = got[2] * keep  # a dropped assignment's weight gets no gradient
    del ref
    return got


class _no_tf32:
    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old


def check_model(model, loss, impl, ref) -> dict:
    """The step's loss, and its gradients' relative error against
    grouped_mm's (MODES runs grouped_mm first; it fills `ref`)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if impl == "grouped_mm" and not ref:
        ref["loss"], ref["grads"] = loss.clone(), [g.clone() for g in grads]
        return {"loss": float(loss)}
    num = sum(float((g.double() - r.double()).square().sum()) for g, r in zip(grads, ref["grads"]))
    den = sum(float(r.double().square().sum()) for r in ref["grads"])
    return {"loss": float(loss), "loss_vs_grouped_mm": float(loss) - float(ref["loss"]),
            "grads_rel_err_vs_grouped_mm": (num / den) ** 0.5 if den else num ** 0.5}


def run_models(cfg, device, dtype, rounds, reps, rate):
    results = []
    tokens = cfg["batch"] * cfg["seq"]
    for family, shape in cfg["model"].items():
        model = make_model(family, shape, cfg, device, dtype)
        counter = SavedBytes(model.parameters())
        wrap_experts(model, counter)
        ids = model_ids(cfg, device)
        times, info, checks = {}, {}, {}
        ref = {}  # grouped_mm's loss and gradients, the yardstick of the others
        for skew in (False,):  # the model's own router (the skewed router: the layer cases)
            for r in range(rounds):  # interleaved: one step block per mode per round, A B C / C B A
                log(f"T1 {family}: round {r + 1} of {rounds}")
                for impl, cap in round_order(MODES, r):
                    key = (impl, cap, skew)
                    set_mode(model, model.config, impl, cap)

                    step = functools.partial(model_step, model, ids, counter)
                    loss = step()  # warm-up
                    if key not in checks:
                        checks[key] = check_model(model, loss, impl, ref)
                    _peak_reset(device)
                    before = _allocated(device)
                    times.setdefault(key, []).extend(time_step(step, device, reps))
                    info[key] = (_peak(device), counter.bytes, before)
        flops = 6 * tokens * shape["top_k"] * 3 * shape["hidden"] * shape["inter"] * cfg["layers"]
        for (impl, cap, skew), ts in times.items():
            med = statistics.median(ts)
            peak, saved, before = info[(impl, cap, skew)]
            results.append(dict(case="model", family=family, implementation=impl, capacity=cap, skewed=skew,
                                tokens=tokens, step_s=med, tokens_per_s=tokens / med, peak_bytes=peak,
                                allocated_before_bytes=before,
                                moe_saved_bytes=saved, moe_floor_s=flops / rate, samples=len(ts),
                                check=checks[(impl, cap, skew)]))
        del model, ref
    return results


def check_layer(experts, hidden, idx, w, grad, skew) -> dict:
    """{(impl, capacity, skew): check}: every mode's output and gradients
    against an fp32 reference of the same routing and the same kept
    assignments (relative Frobenius errors), and capacity's dropped count
    against the rule's."""
    checks = {}
    for cap in sorted({c for _, c in MODES}, key=lambda c: -1 if c is None else c):
        keep = capacity_keep(idx, w, experts.num_experts, cap)
        ref = fp32_reference(experts, hidden, idx, w, grad, keep)
        for impl, c in MODES:
            if c != cap:
                continue
            set_mode(experts, experts.config, impl, c)
            got = layer_grads(experts, hidden, idx, w, grad)
            check = {n: rel_err(a, b) for n, a, b in zip(GRAD_NAMES, got, ref)}
            if cap is not None:
                stats = experts.idempotent_stats
                check["dropped"] = int(stats[2]) if stats is not None else None
                check["dropped_by_rule"] = int((~keep).sum())
                check["dropped_ok"] = check["dropped"] == check["dropped_by_rule"]
            checks[(impl, c, skew)] = check
            del got
        del ref
    experts.zero_grad(set_to_none=True)
    return checks


def layer_inputs(shape: dict, tokens: int, device, dtype):
    """The layer's seeded (hidden [T, H], router logits [T, E], output gradient [T, H])."""
    g = torch.Generator(device=device).manual_seed(3)
    hidden = torch.randn(tokens, shape["hidden"], device=device, dtype=dtype, generator=g)
    logits = torch.randn(tokens, shape["experts"], device=device, generator=g)
    grad = torch.randn(tokens, shape["hidden"], device=device, dtype=dtype, generator=g)
    return hidden, logits, grad


def layer_routing(logits: torch.Tensor, top_k: int, skew: bool, dtype):
    """(weights, index) [T, k]: softmax top-k, renormalised; skewed: +3 on
    expert 0's logit."""
    lg = logits.clone()
    if skew:
        lg[:, 0] += 3.0
    w, idx = torch.softmax(lg, -1).topk(top_k, -1)
    return (w / w.sum(-1, keepdim=True)).to(dtype), idx


def model_ids(cfg: dict, device) -> torch.Tensor:
    """The models' seeded token ids [batch, seq] (the labels too)."""
    return torch.randint(1, cfg["vocab"], (cfg["batch"], cfg["seq"]),
                         generator=torch.Generator().manual_seed(1)).to(device)


def model_step(model, ids, counter=None) -> torch.Tensor:
    """One training step's forward (loss on the ids themselves) and backward,
    the router's auxiliary loss included where the config asks for it; what
    autograd saves counted by `counter` (a SavedBytes) when given."""
    model.zero_grad(set_to_none=True)
    if counter is None:
        loss = model(ids, labels=ids).loss
    else:
        counter.reset()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def each_model_step(cfg: dict, device, dtype, modes, what: str):
    """(family, implementation, capacity, step) for each T1 model family and
    each mode in `modes`: the model made once per family and freed after its
    modes, the step model_step on the seeded ids."""
    for family, shape in cfg["model"].items():
        model = make_model(family, shape, cfg, device, dtype)
        ids = model_ids(cfg, device)
        for impl, cap in modes:
            log(f"T1 {what} {family}: {label(dict(implementation=impl, capacity=cap))}")
            set_mode(model, model.config, impl, cap)
            yield family, impl, cap, functools.partial(model_step, model, ids)
        model.zero_grad(set_to_none=True)
        del model


def layer_step(experts, hidden, w, idx, grad, counter=None):
    """One forward and backward of the experts layer alone: fresh leaves for
    the hidden states and routing weights, `grad` as the output's gradient;
    what autograd saves counted by `counter` (a SavedBytes) when given."""
    experts.zero_grad(set_to_none=True)
    h = hidden.detach().requires_grad_()
    ww = w.detach().requires_grad_()
    if counter is None:
        out = experts(h, idx, ww)
    else:
        counter.reset()
        counter.active = True
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            out = experts(h, idx, ww)
        counter.active = False
    out.backward(grad)


def run_layers(cfg, device, dtype, rounds, reps, rate):
    results = []
    tokens = cfg["layer_tokens"]
    for name, shape in cfg["layer"].items():
        experts = make_experts(shape, device, dtype)
        hidden, logits, grad = layer_inputs(shape, tokens, device, dtype)
        times, info, checks = {}, {}, {}
        for skew in (False, True):
            w, idx = layer_routing(logits, shape["top_k"], skew, dtype)
            for r in range(rounds):
                log(f"T1 {name}{' skewed' if skew else ''}: round {r + 1} of {rounds}")
                for impl, cap in round_order(MODES, r):
                    key = (impl, cap, skew)
                    set_mode(experts, experts.config, impl, cap)
                    counter = SavedBytes(experts.parameters())
                    step = functools.partial(layer_step, experts, hidden, w, idx, grad, counter)
                    step()
                    _peak_reset(device)
                    before = _allocated(device)
                    times.setdefault(key, []).extend(time_step(step, device, reps))
                    info[key] = (_peak(device), counter.bytes, before)
            checks.update(check_layer(experts, hidden, idx, w, grad, skew))
        flops = 6 * tokens * shape["top_k"] * 3 * shape["hidden"] * shape["inter"]
        for (impl, cap, skew), ts in times.items():
            med = statistics.median(ts)
            peak, saved, before = info[(impl, cap, skew)]
            results.append(dict(case="layer", shape=name, implementation=impl, capacity=cap, skewed=skew,
                                tokens=tokens, step_s=med, tokens_per_s=tokens / med, peak_bytes=peak,
                                allocated_before_bytes=before,
                                moe_saved_bytes=saved, floor_s=flops / rate,
                                floor_fraction=flops / rate / med, samples=len(ts),
                                check=checks[(impl, cap, skew)]))
        del experts
    return results


def setup(device: str, quick: bool):
    """(device, sizes, dtype) of a T1 run, "idempotent" registered: "auto" is
    the GPU when there is one (the CPU with quick), quick sizes in float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
    imoe_hf.register()
    return torch.device(device), QUICK if quick else FULL, torch.float32 if quick else torch.bfloat16


def run(device: str = "auto", quick: bool = False, rounds: int = 0, reps: int = 0,
        only: str | None = None) -> dict:
    """T1 on `device` ("auto": the GPU when there is one); the JSON's data."""
    from .w4 import _machine

    dev, cfg, dtype = setup(device, quick)
    rounds = rounds or (1 if quick else 3)
    reps = reps or (1 if quick else 3)
    rate = bf16_rate(dev, quick)
    results = []
    if only in (None, "model"):
        results += run_models(cfg, dev, dtype, rounds, reps, rate)
    if only in (None, "layer"):
        results += run_layers(cfg, dev, dtype, rounds, reps, rate)
    return dict(workload="T1", machine=_machine(dev.type), quick=quick,
                dtype=str(dtype).removeprefix("torch."), gemm_flops_per_s=rate, rounds=rounds, reps=reps,
                config=cfg, results=results)
