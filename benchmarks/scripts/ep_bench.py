"""Expert parallelism on two ranks: ExpertParallelDispatcher (dropless, and
capacity mode at factors 1.0 and 1.25) against an out-of-place reference
dispatcher written in plain torch the way common implementations do it, for a
Mixtral-like and a DeepSeek-like layer in bf16.

Per configuration and implementation, on every rank: untimed warm-up calls,
then one call whose peak transient memory is recorded (CUDA caching
allocator: max_memory_allocated minus what was allocated before the call,
and memory_reserved before and after, after empty_cache), then `runs` timed
calls, each after a barrier: CUDA events around the whole call (dispatch,
expert function, combine; the host synchronisations inside it included) on
NCCL, perf_counter on gloo. A run's time is that of the slower rank; the
table gives the median and the minimum over the runs.

The expert function is a per-expert scale (expert e multiplies its rows by
1 + (e + 1) / 64), cheap and identical in both dispatchers, so the dispatch
dominates; `--experts mlp` gives both gated MLP experts (the dispatcher's one
grouped call against the reference's grouped GEMMs, or its batched GEMM over
the padded capacity buffer), and `--passes train` times forward and backward.
The routing weights are distinct fp32 numbers (a permutation of the global
assignments, scaled by a power of two), so capacity mode keeps the same
assignments whichever way a dispatcher breaks ties, and every output of the
dispatcher is compared with the reference's on every rank: bit for bit, or
with MLP experts or a backward, the largest difference relative to the
reference's largest value (their GEMMs group the rows differently).

The reference (one call, per rank):
  argsort of the T x k expert ids (stable; experts of a rank are contiguous,
  so this sorts by destination rank) + index_select into a send buffer,
  all_to_all_single of counts then tokens (and fp32 weights in capacity
  mode), a second argsort + index_select that groups the received rows by
  local expert; dropless: expert_fn on each expert's rows into a new output
  buffer; capacity: per expert topk of the weights (padded [L, max n] matrix,
  one topk) and a gather into an [L, C, D] buffer, expert_fn on the kept rows,
  a scatter of the outputs into a zeroed [N, D] buffer; then the inverse
  permutes (index_copy_), all_to_all_single back, and the same weighted
  combine as the dispatcher's (fp32, summed in j order).

Usage:
  python benchmarks/scripts/ep_bench.py                     # NCCL, two GPUs (starts two processes)
  python benchmarks/scripts/ep_bench.py --quick --no-plot   # gloo on the CPU, small sizes (a smoke test)
  python benchmarks/scripts/ep_bench.py --experts scale mlp --passes forward train   # everything
  torchrun --nproc-per-node 2 benchmarks/scripts/ep_bench.py
  python benchmarks/scripts/ep_bench.py --table-from benchmarks/results/ep-cuda.json \
      --docs docs/distributed.md
Writes OUT/ep-cuda.json (ep-cpu-quick.json with --quick) and its plot, OUT
being --out (default imoe-results/, ignored by git); with --docs, replaces the
<!-- bench:ep --> section of that file with the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MODELS = {
    "mixtral-like": dict(hidden=4096, experts=8, top_k=2, inter=14336),
    "deepseek-like": dict(hidden=7168, experts=256, top_k=8, inter=2048),
}
QUICK_MODELS = {
    "mixtral-like": dict(hidden=64, experts=8, top_k=2, inter=48),
    "deepseek-like": dict(hidden=96, experts=32, top_k=8, inter=32),
}
TOKENS = (4096, 16384)
QUICK_TOKENS = (48,)
FACTORS = (1.0, 1.25)
OURS, REFERENCE = "idempotent_moe", "reference (out of place)"
SECTION = "bench:ep"


# ----------------------------------------------------------------------------- inputs


def make_inputs(model: dict, tokens: int, rank: int, world: int, device, seed: int = 0):
    """This rank's hidden [T, D] bf16, topk_ids [T, k] int64 (uniform, distinct
    per token) and topk_weights [T, k] fp32, distinct over all ranks."""
    import torch

    k, num_experts = model["top_k"], model["experts"]
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    ids = torch.rand(tokens, num_experts, generator=gen).topk(k, dim=1).indices
    hidden = torch.randn(tokens, model["hidden"], generator=gen).to(torch.bfloat16)
    everyone = torch.Generator().manual_seed(seed)
    order = torch.randperm(tokens * world * k, generator=everyone)[rank * tokens * k:(rank + 1) * tokens * k]
    # Integers below 2**24 times a power of two: exact and distinct in fp32.
    weights = ((order + 1).double() * 2.0 ** -20).float().view(tokens, k)
    return hidden.to(device), ids.to(device), weights.to(device)


def make_expert_fn(num_experts: int):
    scales = [1.0 + (e + 1) / 64 for e in range(num_experts)]

    def expert_fn(expert: int, rows):
        return rows * scales[expert]

    return expert_fn


def make_mlp(model: dict, rank: int, world: int, device, train: bool):
    """This rank's experts as a gated MLP (silu): w_up [L, D, 2I] (gate, then
    up) and w_down [L, I, D] in bf16, each expert's weights seeded by its
    global index (the same on whichever rank holds it)."""
    import torch

    local = model["experts"] // world
    hidden, inter = model["hidden"], model["inter"]
    ups, downs = [], []
    for e in range(rank * local, (rank + 1) * local):
        gen = torch.Generator().manual_seed(10_000 + e)
        ups.append(torch.randn(hidden, 2 * inter, generator=gen) / hidden ** 0.5)
        downs.append(torch.randn(inter, hidden, generator=gen) / inter ** 0.5)
    w_up = torch.stack(ups).to(device, torch.bfloat16).requires_grad_(train)
    w_down = torch.stack(downs).to(device, torch.bfloat16).requires_grad_(train)
    return w_up, w_down


def _mlp(x, w_up, w_down):
    """silu(gate) * up, then down, for rows of one expert (2-d) or a padded
    batch of experts (3-d, bmm)."""
    import torch

    gate_up = torch.bmm(x, w_up) if x.dim() == 3 else x @ w_up
    inter = w_down.shape[-2]
    act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    return torch.bmm(act, w_down) if act.dim() == 3 else act @ w_down


def reference_grouped_mlp(grouped, per_expert: list, w_up, w_down):
    """The reference's experts on rows grouped by local expert: torch's
    grouped GEMM over the group offsets where it takes the operands (CUDA,
    bf16; the GEMMs transformers and Megatron's GroupedMLP use), else one
    matmul per expert."""
    import torch

    mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if mm is not None and grouped.is_cuda and grouped.shape[0]:
        offsets = torch.tensor(per_expert, device=grouped.device).cumsum(0).to(torch.int32)
        gate_up = mm(grouped, w_up, offs=offsets)
        inter = w_down.shape[-2]
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        return mm(act, w_down, offs=offsets)
    outs, start = [], 0
    for e, n in enumerate(per_expert):
        if n:
            outs.append(_mlp(grouped[start:start + n], w_up[e], w_down[e]))
        start += n
    return torch.cat(outs) if outs else grouped.new_empty(grouped.shape)


# ----------------------------------------------------------------------------- the reference


def _a2a(out, x, out_splits, in_splits, group, grad: bool):
    """all_to_all_single; torch.distributed.nn's differentiable one under autograd."""
    import torch.distributed as dist

    if grad:
        from torch.distributed.nn.functional import all_to_all_single

        return all_to_all_single(out, x, out_splits, in_splits, group=group)
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def reference_dispatch(hidden, topk_ids, topk_weights, expert_fn, num_experts: int,
                       capacity_factor: float | None, group=None, mlp=None, stats=None):
    """The out-of-place dispatcher (module docstring). Returns (out [T, D],
    dropped). With `mlp` (w_up, w_down of the local experts) instead of
    expert_fn, the experts are a gated MLP: grouped GEMMs when dropless, a
    batched GEMM over the padded [L, C, D] buffer in capacity mode (drop and
    pad). Differentiable where a gradient is recorded. `stats`, a dict,
    receives the bytes sent to other ranks."""
    import torch
    import torch.distributed as dist
    from idempotent_moe.distributed import expert_capacity

    grad = torch.is_grad_enabled() and (hidden.requires_grad or topk_weights.requires_grad
                                        or (mlp is not None and mlp[0].requires_grad))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = num_experts // world
    num_tokens, top_k = topk_ids.shape
    device = hidden.device

    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, hence by destination rank
    send = hidden.index_select(0, order // top_k)
    counts = torch.bincount(flat, minlength=num_experts)
    send_counts = torch.cat([counts.view(world, local),
                             torch.full((world, 1), num_tokens, dtype=counts.dtype, device=device)], 1)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits = send_counts[:, :local].sum(1).tolist()
    host_counts = recv_counts.cpu()
    per_source = host_counts[:, :local]
    recv_splits = per_source.sum(1).tolist()
    received = int(sum(recv_splits))
    recv = _a2a(hidden.new_empty(received, hidden.shape[1]), send, recv_splits, send_splits, group, grad)
    del send
    row = hidden.shape[1] * hidden.element_size()
    to_others = sum(n for r, n in enumerate(send_splits) if r != rank)
    from_others = sum(n for r, n in enumerate(recv_splits) if r != rank)
    sent_bytes = (to_others + from_others) * row + (world - 1) * (local + 1) * 8
    if capacity_factor is not None:
        send_w = topk_weights.detach().reshape(-1).float().index_select(0, order)
        recv_w = torch.empty(received, dtype=torch.float32, device=device)
        dist.all_to_all_single(recv_w, send_w, recv_splits, send_splits, group=group)
        sent_bytes += to_others * 4
        del send_w
    if stats is not None:
        stats["bytes_sent"] = sent_bytes

    # Second permute: (source rank, expert, token) -> (expert, source rank, token).
    local_ids = torch.repeat_interleave(torch.arange(local, device=device).repeat(world),
                                        per_source.reshape(-1).to(device), output_size=received)
    regroup = torch.argsort(local_ids, stable=True)
    grouped = recv.index_select(0, regroup)
    del recv
    per_expert = per_source.sum(0).tolist()
    first = rank * local
    dropped = 0
    if capacity_factor is None and mlp is not None:
        y_grouped = reference_grouped_mlp(grouped, per_expert, *mlp).to(grouped.dtype)
    elif capacity_factor is None:
        y_grouped = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(per_expert):
            if n:
                y_grouped[start:start + n] = expert_fn(first + e, grouped[start:start + n])
            start += n
    else:
        total_tokens = int(host_counts[:, local].sum())
        cap = expert_capacity(total_tokens, top_k, num_experts, capacity_factor)
        grouped_w = recv_w.index_select(0, regroup)
        del recv_w
        longest = max(per_expert) if per_expert else 0
        y_grouped = torch.zeros_like(grouped)
        if longest:
            n_e = torch.tensor(per_expert, device=device)
            seg_start = torch.cumsum(n_e, 0) - n_e
            expert_of_row = local_ids.index_select(0, regroup)
            slot = torch.arange(received, device=device) - seg_start.index_select(0, expert_of_row)
            padded = torch.full((local, longest), float("-inf"), device=device)
            padded[expert_of_row, slot] = grouped_w
            kept_per_expert = min(cap, longest)
            top = padded.topk(kept_per_expert, dim=1).indices  # [L, C], highest weight first
            src = (seg_start[:, None] + top).clamp_(max=max(received - 1, 0))
            buf = grouped.index_select(0, src.reshape(-1)).view(local, kept_per_expert, -1)  # [L, C, D]
            if mlp is not None:
                y_buf = _mlp(buf, *mlp).to(buf.dtype)  # the padding rows are computed too
                dropped = sum(n - min(cap, n) for n in per_expert)
            else:
                y_buf = torch.empty_like(buf)
                for e, n in enumerate(per_expert):
                    c = min(cap, n)
                    dropped += n - c
                    if c:
                        y_buf[e, :c] = expert_fn(first + e, buf[e, :c])
            del buf
            valid = torch.arange(kept_per_expert, device=device)[None, :] < n_e.clamp(max=cap)[:, None]
            y_grouped.index_copy_(0, src[valid], y_buf[valid])
            del y_buf
    del grouped
    y_recv = torch.empty_like(y_grouped)
    y_recv.index_copy_(0, regroup, y_grouped)
    del y_grouped
    back = _a2a(hidden.new_empty(num_tokens * top_k, hidden.shape[1]), y_recv, send_splits, recv_splits,
                group, grad)
    del y_recv
    y = torch.empty_like(back)
    y.index_copy_(0, order, back)
    del back
    y = y.view(num_tokens, top_k, -1)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=device)
    for j in range(top_k):
        out.add_(y[:, j].float() * topk_weights[:, j, None].float())
    return out.to(hidden.dtype), dropped


# ----------------------------------------------------------------------------- measuring


def _barrier(cuda: bool) -> None:
    import torch
    import torch.distributed as dist

    if cuda:
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def _all_max(values: list, cuda: bool) -> list:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _all_sum(values: list, cuda: bool) -> list:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def measure(call, cuda: bool, runs: int, warmup: int) -> tuple:
    """(first result, row fields): memory of one call, then `runs` timed calls."""
    import torch

    for _ in range(warmup):
        call()
    memory = {}
    if cuda:
        from imoe_bench.timing import cuda_memory

        torch.cuda.empty_cache()
        result, mine = cuda_memory(call)
        peak, reserved_before, reserved_after = _all_max(
            [mine["peak_allocated_bytes"], mine["reserved_before_bytes"], mine["reserved_after_bytes"]], cuda)
        memory = {"peak_transient_bytes": int(peak), "reserved_before_bytes": int(reserved_before),
                  "reserved_after_bytes": int(reserved_after)}
    else:
        result = call()
    samples = []
    if cuda:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(runs):
        _barrier(cuda)
        if cuda:
            start.record()
            call()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            call()
            samples.append((time.perf_counter() - t0) * 1e3)
    slowest = _all_max(samples, cuda)
    return result, {"median_ms": statistics.median(slowest), "min_ms": min(slowest), "runs": runs,
                    "this_rank_median_ms": statistics.median(samples), **memory}


def _machine(cuda: bool, world: int, backend: str) -> dict:
    import platform

    import torch

    info = {"device": "cuda" if cuda else "cpu", "world_size": world, "backend": backend,
            "python": platform.python_version(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    from imoe_bench.runner import git_commit

    info["commit"] = git_commit()
    if cuda:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def run_config(name: str, model: dict, tokens: int, rank: int, world: int, device, cuda: bool,
               runs: int, warmup: int, experts: str = "scale", train: bool = False):
    """Yields, per mode (dropless, then each capacity factor), the rows of the
    reference and of the dispatcher on one model and token count. `experts`:
    "scale" (a per-expert function, the dispatch dominates) or "mlp" (gated
    MLP experts: the dispatcher's one grouped call, the reference's grouped
    GEMMs or padded batched GEMM); `train`: forward and backward."""
    import torch
    from idempotent_moe.distributed import ExpertParallelDispatcher

    expert_fn = make_expert_fn(model["experts"])
    hidden, ids, weights = make_inputs(model, tokens, rank, world, device)
    hidden.requires_grad_(train)
    weights.requires_grad_(train)
    mlp = make_mlp(model, rank, world, device, train) if experts == "mlp" else None
    leaves = [hidden, weights, *(mlp or ())]
    grad_out = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(rank)).to(device)
    num_experts = model["experts"]
    for factor in (None, *FACTORS):
        base = {"model": name, **model, "tokens_per_rank": tokens, "dtype": "bfloat16",
                "mode": "dropless" if factor is None else f"capacity {factor:.2f}",
                "capacity_factor": factor, "expert_kind": experts,
                "pass": "forward+backward" if train else "forward"}
        disp = ExpertParallelDispatcher(model["experts"], model["top_k"], capacity_factor=factor)
        ref_stats = {}

        def ref_call(f=factor, ref_stats=ref_stats):
            return reference_dispatch(hidden, ids, weights, expert_fn, num_experts, f, mlp=mlp,
                                      stats=ref_stats)

        def our_call(disp=disp):
            if mlp is None:
                return disp(hidden, ids, weights, expert_fn), None
            return disp(hidden, ids, weights, experts=(*mlp, "silu")), None

        (ref_out, ref_dropped, ref_grads), ref_row = measure(_step(ref_call, leaves, grad_out, train), cuda,
                                                             runs, warmup)
        (out, _, grads), our_row = measure(_step(our_call, leaves, grad_out, train), cuda, runs, warmup)
        same = float(torch.equal(out, ref_out))
        diff = _rel_diff(out, ref_out)
        grad_diff = max((_rel_diff(a, b) for a, b in zip(grads, ref_grads)), default=0.0)
        del out, ref_out, grads, ref_grads
        st = disp.last_stats
        ours_bytes = st.row_bytes + st.meta_bytes + (sum(st.received) - st.received[rank]) * hidden.shape[1] \
            * hidden.element_size()
        exact_ranks, dropped, ref_dropped, our_sent, ref_sent = _all_sum(
            [same, st.dropped, ref_dropped, ours_bytes, ref_stats["bytes_sent"]], cuda)
        diff, grad_diff = _all_max([diff, grad_diff], cuda)
        check = {} if experts == "scale" and not train else {
            "max_rel_diff_vs_ref": diff, **({"grad_max_rel_diff_vs_ref": grad_diff} if train else {})}
        capacity = st.capacity
        yield [{**base, "impl": REFERENCE, **ref_row, "bit_exact": None, "dropped": int(ref_dropped),
                "capacity": capacity, "bytes_sent": int(ref_sent)},
               {**base, "impl": OURS, **our_row, "bit_exact": exact_ranks == world, "dropped": int(dropped),
                "capacity": capacity, "bytes_sent": int(our_sent), **check}]


def _step(call, leaves: list, grad_out, train: bool):
    """One timed call: the forward, and with `train` the backward of
    sum(out * grad_out); returns (out, dropped, the leaves' gradients)."""
    def step():
        if not train:
            out, dropped = call()
            return out, dropped, []
        for t in leaves:
            t.grad = None
        out, dropped = call()
        (out.float() * grad_out).sum().backward()
        return out.detach(), dropped, [t.grad for t in leaves]
    return step


def _rel_diff(a, b) -> float:
    """max |a - b| / max |b| (0 for two empty or zero tensors)."""
    if a.numel() == 0:
        return 0.0
    worst = float((a.float() - b.float()).abs().max())
    scale = float(b.float().abs().max())
    return worst / scale if scale else worst


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = not args.quick and args.device != "cpu"
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend)
    models = QUICK_MODELS if args.quick else MODELS
    tokens_list = QUICK_TOKENS if args.quick else tuple(args.tokens)
    runs = args.runs or (5 if args.quick else 50)
    warmup = 1 if args.quick else 3
    data = {"machine": _machine(cuda, world, backend), "quick": args.quick, "runs": runs,
            "warmup": warmup, "models": models, "results": []}
    try:
        for name in args.models:
            model = models[name]
            if model["experts"] % world:
                raise SystemExit(f"{name}: {model['experts']} experts do not split over {world} ranks")
            for tokens, experts, train in [(t, e, p == "train") for t in tokens_list for e in args.experts
                                           for p in args.passes]:
                for rows in run_config(name, model, tokens, rank, world, device, cuda, runs, warmup, experts,
                                       train):
                    data["results"] += rows
                    if rank == 0:
                        for r in rows:
                            print(f"{name} T={tokens} {r['expert_kind']} {r['pass']} {r['mode']} "
                                  f"{r['impl']}: median "
                                  f"{r['median_ms']:.3f} ms, min {r['min_ms']:.3f} ms, peak "
                                  f"{_mib(r.get('peak_transient_bytes'))} MiB, bit-exact "
                                  f"{r['bit_exact']}, dropped {r['dropped']}", flush=True)
                        write_json(data, args.out)  # partial results survive a later failure
        _barrier(cuda)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        finish(data, args)


# ----------------------------------------------------------------------------- results


def _stem(data: dict) -> str:
    return f"ep-{data['machine']['device']}" + ("-quick" if data.get("quick") else "")


def write_json(data: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, _stem(data) + ".json")
    with open(path, "w") as f:
        from imoe_bench.report import dumps

        f.write(dumps(data))
    return path


def _mib(nbytes) -> str:
    return "" if nbytes is None else f"{nbytes / 2**20:,.1f}"


def with_ratios(rows: list) -> list:
    """Each row with the reference's median over its own (times faster than
    the torch reference; above 1, faster) and its peak over the reference's,
    same model, tokens and mode."""
    ref = {_group(r): r for r in rows if r["impl"] == REFERENCE}
    out = []
    for r in rows:
        base = ref[_group(r)]
        out.append({**r, "speedup_vs_reference": base["median_ms"] / r["median_ms"],
                    "peak_vs_reference": (r["peak_transient_bytes"] / base["peak_transient_bytes"]
                                          if base.get("peak_transient_bytes") else None)})
    return out


def _group(r: dict) -> tuple:
    """The rows measured on the same inputs: one reference row each."""
    kind, which = r.get("expert_kind", "scale"), r.get("pass", "forward")
    return (r["model"], r["tokens_per_rank"], r["mode"], kind, which)


def _check(r: dict) -> str:
    """Bit for bit against the reference (a per-expert scale, forward), or the
    largest difference relative to the reference's largest value."""
    if r["bit_exact"] is None:
        return ""
    if "max_rel_diff_vs_ref" not in r:
        return "bit-exact" if r["bit_exact"] else "NOT bit-exact"
    text = "bit-exact" if r["bit_exact"] else f"out {r['max_rel_diff_vs_ref']:.1e} rel"
    if "grad_max_rel_diff_vs_ref" in r:
        text += f", grads {r['grad_max_rel_diff_vs_ref']:.1e} rel"
    return text


def table(data: dict) -> str:
    rows = with_ratios(data["results"])
    has_mem = any("peak_transient_bytes" in r for r in rows)
    has_kinds = any("expert_kind" in r for r in rows)
    head = ["model", "tokens / GPU"] + (["experts", "pass"] if has_kinds else []) + [
        "mode", "implementation", "median ms", "min ms", "x faster than torch ref"]
    if has_mem:
        head += ["peak transient MiB", "peak / ref", "reserved MiB before -> after"]
    if has_kinds:
        head += ["KiB sent per layer"]
    head += ["check vs ref", "dropped"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], str(r["tokens_per_rank"])]
        if has_kinds:
            cells += [r.get("expert_kind", "scale"), r.get("pass", "forward")]
        cells += [r["mode"], r["impl"], f"{r['median_ms']:.3f}", f"{r['min_ms']:.3f}",
                  f"{r['speedup_vs_reference']:.2f}x"]
        if has_mem:
            cells += [_mib(r.get("peak_transient_bytes")),
                      f"{r['peak_vs_reference']:.2f}" if r["peak_vs_reference"] is not None else "",
                      f"{_mib(r.get('reserved_before_bytes'))} -> {_mib(r.get('reserved_after_bytes'))}"]
        if has_kinds:
            cells += [f"{r['bytes_sent'] / 1024:,.1f}" if r.get("bytes_sent") is not None else ""]
        cells += [_check(r), str(r["dropped"])]
        lines.append("| " + " | ".join(cells) + " |")
    m = data["machine"]
    where = m.get("gpu") or m.get("cpu")
    models = "; ".join(f"{n}: D={v['hidden']}, E={v['experts']}, k={v['top_k']}"
                       for n, v in data["models"].items())
    lines.append("")
    lines.append(f"{m['world_size']} x {where}, {m['backend']}"
                 + (f" {m['nccl']}" if m.get("nccl") else "")
                 + f"; torch {m['torch']}; bf16; {models}; median and min of {data['runs']} runs "
                 f"(the slower rank's time) after {data['warmup']} warm-up calls; {m['date']}"
                 + (" (quick sizes)" if data.get("quick") else ""))
    return "\n".join(lines)


def plot(data: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    groups = list(dict.fromkeys(_group(r) for r in rows))
    impls = [REFERENCE, OURS]
    has_mem = any("peak_transient_bytes" in r for r in rows)
    fig, axes = plt.subplots(2 if has_mem else 1, 1, figsize=(2.0 + 1.0 * len(groups), 7 if has_mem else 4),
                             squeeze=False)
    width = 0.4
    panels = [("median_ms", "median time, ms (log)", 1.0)]
    if has_mem:
        panels.append(("peak_transient_bytes", "peak transient memory, MiB (log)", 2.0 ** -20))
    for ax, (key, label, scale) in zip(axes[:, 0], panels):
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for g, grp in enumerate(groups):
                for r in rows:
                    if _group(r) == grp and r["impl"] == impl:
                        xs.append(g + i * width)
                        ys.append(max(r[key] * scale, 1e-3))
            ax.bar(xs, ys, width, label=impl)
        ax.set_yscale("log")
        ax.set_ylabel(label, fontsize=8)
        ax.set_xticks([g + width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{m}\nT={t}\n{mode}" + ("" if (e, p) == ("scale", "forward") else f"\n{e} {p}")
                            for m, t, mode, e, p in groups], fontsize=6)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    m = data["machine"]
    axes[0, 0].set_title(f"expert-parallel dispatch + expert fn + combine, {m['world_size']} x "
                         f"{m.get('gpu') or m.get('cpu')} ({m['backend']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def replace_docs(path: str, data: dict) -> None:
    from imoe_bench.report import replace_section

    replace_section(path, SECTION, lambda: table(data))


def finish(data: dict, args) -> None:
    print(table(data))
    print(f"wrote {write_json(data, args.out)}")
    if args.plot:
        try:
            print(f"wrote {plot(data, os.path.join(args.out, _stem(data) + '.png'))}")
        except ImportError:
            print("matplotlib is not installed: no plot (draw it later with --table-from)")
    if args.docs:
        replace_docs(args.docs, data)
        print(f"updated the {SECTION} section of {args.docs}")


# ----------------------------------------------------------------------------- launching


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list, world: int, timeout: float) -> int:
    """Start this script once per rank (env:// rendezvous on 127.0.0.1)."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"ep_bench: ranks still running after {timeout:.0f} s; stopping them", file=sys.stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max((abs(p.returncode) for p in procs), default=0)


def parse(argv: list):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="gloo on the CPU, small sizes")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: NCCL, one GPU per rank; cpu: gloo (implied by --quick)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="tokens per rank")
    p.add_argument("--experts", nargs="+", choices=["scale", "mlp"], default=["scale"],
                   help="scale: a per-expert scale (the dispatch dominates); mlp: gated MLP experts "
                        "(the dispatcher's grouped call against the reference's grouped GEMMs)")
    p.add_argument("--passes", nargs="+", choices=["forward", "train"], default=["forward"],
                   help="forward, and/or train (forward and backward)")
    p.add_argument("--runs", type=int, default=0, help="timed runs (default 50, 5 with --quick)")
    p.add_argument("--out", default="imoe-results",
                   help="folder for JSON and plot (default imoe-results/, ignored by git; "
                        "benchmarks/results to replace the committed results)")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--docs", help="a markdown file whose <!-- bench:ep --> section gets the table")
    p.add_argument("--table-from", help="no run: table, plot and --docs from this JSON")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the ranks are stopped")
    return p.parse_args(argv)


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.table_from:
        with open(args.table_from) as f:
            data = json.load(f)
        args.out = os.path.dirname(args.table_from) or "."
        finish(data, args)
        return 0
    if "RANK" in os.environ:
        worker(args)
        # The group is destroyed and the results written: the rank leaves
        # without interpreter finalization, where gloo's worker threads can
        # still be torn down and abort the process (pytorch/pytorch#179291).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return launch(argv, args.world_size, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
