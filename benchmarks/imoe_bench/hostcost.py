"""H1 (docs/results.md#workloads): host time per call, back to back with no synchronisation.

Each call is issued `calls` times in a row and timed on the host, with one
synchronisation before and one after the loop (on a GPU the queue absorbs
the work; a call whose device time exceeds its host time fills the queue and
is then timed at the device's pace, which the table shows as it is). Calls
run in interleaved rounds (A B C, C B A, ...); the median and the min over
the rounds are reported, beside one torch elementwise op and torch topk +
gather on the same host.

The hot calls, every output preallocated where the API allows it:
- compact_ with out_indices: tiny [8, 64, 128] fp16 (C = 32) and W1
  ([8, 4096, 1024] fp16, C = 2048);
- apply_map_ of the tiny call's indices;
- compact_kv_cache_inplace with out_indices: K and V [1, 8, 256, 64] fp16, keep 128;
- group_by_expert_ (the dispatch's grouping): [64, 128] fp16 tokens, 8 experts,
  out_offsets, out_perm and the plan workspace given;
- moe_dispatch (8 tokens, top-2 of 8 experts, H 2048) with `out` given, and
  allocating its outputs; moe_combine of its rows with `out` given.
On the CPU every call runs to completion on the host, so the figures are the
calls' whole cost there; --quick shrinks W1 and the call count.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from .model_timing import log, round_order, sync

W1_SHAPE, QUICK_W1_SHAPE = (8, 4096, 1024, 2048), (8, 512, 128, 256)  # E, T, D, C
TINY_SHAPE = (8, 64, 128, 32)


@dataclass
class H1Options:
    device: str
    calls: int
    rounds: int
    quick: bool


def _per_call_us(fn, calls: int, device: str) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync(device)
    return (t1 - t0) / calls * 1e6


def _calls(device: str, quick: bool) -> dict:
    """name -> (what it is, a zero-argument call)."""
    import idempotent_moe as imoe
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)

    def case(e, t, d, c):
        x = torch.randn(e, t, d, generator=g).to(device, torch.float16)
        s = torch.rand(e, t, generator=g).to(device)
        return x, s, torch.empty(e, c, dtype=torch.int64, device=device), c

    tiny = case(*TINY_SHAPE)
    w1 = case(*(QUICK_W1_SHAPE if quick else W1_SHAPE))
    w1_name = "W1" + (" (quick size)" if quick else "")
    imoe.compact_(tiny[0], tiny[1], tiny[3], out_indices=tiny[2])  # a valid map for apply_map_
    k = torch.randn(1, 8, 256, 64, generator=g).to(device, torch.float16)
    v = torch.randn(1, 8, 256, 64, generator=g).to(device, torch.float16)
    kv_scores = torch.rand(1, 8, 256, generator=g).to(device)
    kv_idx = torch.empty(1, 8, 128, dtype=torch.int64, device=device)
    tokens = torch.randn(64, 128, generator=g).to(device, torch.float16)
    experts = torch.randint(0, 8, (64,), generator=g).to(device)
    offsets = torch.empty(8, dtype=torch.int64, device=device)
    perm = torch.empty(64, dtype=torch.int64, device=device)
    group_ws = torch.empty(imoe.plan_workspace_elems("group", 1, 64, cuda=device == "cuda"),
                           dtype=torch.int32, device=device)
    y = torch.empty(1024, device=device)

    from idempotent_moe.moe import moe_combine, moe_dispatch, torch_outputs

    from .internals import dlpack_stream, native

    hidden = torch.randn(8, 2048, generator=g).to(device, torch.bfloat16)
    routing = torch.rand(8, 8, generator=g).topk(2, dim=1)
    top_idx, top_w = routing.indices.to(device), routing.values.to(device, torch.bfloat16)
    moe_rows = torch.randn(16, 2048, generator=g).to(device, torch.bfloat16)
    dest = moe_dispatch(hidden, top_idx, 8).dest
    dispatched = torch_outputs(hidden, 8, 8, 2, 16)
    combined = torch.empty(8, 2048, dtype=torch.bfloat16, device=device)
    core, stream = native(), dlpack_stream(tiny[0])

    def core_compact():
        core.compact([tiny[0]], [1], [1], scores=tiny[1], active_indices=None, capacity=tiny[3],
                     protected_prefix=0, recent_window=0, nan="raise", order="inplace",
                     out_indices=tiny[2], out_target_map=None, mode="swap", workspace=None,
                     num_threads=1, stream=stream)

    def topk_gather(c):
        x, s, _, cap = c
        idx = s.topk(cap, dim=1).indices
        return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))

    return {
        "torch add_ [1024] (one elementwise op)": ("torch", lambda: y.add_(1.0)),
        "torch narrow [8, 64, 128] (one view, as compact_ returns)": ("torch", lambda: tiny[0].narrow(
            1, 0, tiny[3])),
        "torch topk+gather [8, 64, 128]": ("torch", lambda: topk_gather(tiny)),
        f"torch topk+gather {w1_name}": ("torch", lambda: topk_gather(w1)),
        "compact_ [8, 64, 128], out_indices": ("ours", lambda: imoe.compact_(
            tiny[0], tiny[1], tiny[3], out_indices=tiny[2])),
        f"compact_ {w1_name}, out_indices": ("ours", lambda: imoe.compact_(
            w1[0], w1[1], w1[3], out_indices=w1[2])),
        "compact_ [8, 64, 128], the core's call alone": ("ours", core_compact),
        "apply_map_ [8, 64, 128]": ("ours", lambda: imoe.apply_map_(tiny[0], tiny[2])),
        "moe_dispatch [8 tokens, top-2 of 8, H 2048], out given": ("ours", lambda: moe_dispatch(
            hidden, top_idx, 8, out=dispatched)),
        "moe_dispatch [8 tokens, top-2 of 8, H 2048], allocating": ("ours", lambda: moe_dispatch(
            hidden, top_idx, 8)),
        "moe_combine [8 tokens, top-2, H 2048], out given": ("ours", lambda: moe_combine(
            moe_rows, dest, top_w, out=combined)),
        "compact_kv_cache_inplace [1, 8, 256, 64] keep 128, out_indices": ("ours", lambda: (
            imoe.compact_kv_cache_inplace(k, v, kv_scores, 128, out_indices=kv_idx))),
        "group_by_expert_ [64, 128], 8 experts": ("ours", lambda: imoe.group_by_expert_(
            tokens, experts, 8, out_offsets=offsets, out_perm=perm, workspace=group_ws)),
    }


def run_h1(opts: H1Options) -> dict:
    calls = _calls(opts.device, opts.quick)
    names = list(calls)
    per_round: dict = {name: [] for name in names}
    for r in range(opts.rounds):
        for name in round_order(names, r):
            per_round[name].append(_per_call_us(calls[name][1], opts.calls, opts.device))
    log(f"H1: {len(names)} calls x {opts.calls} x {opts.rounds} rounds done")
    add = statistics.median(per_round[names[0]])
    rows = [{"call": name, "kind": calls[name][0], "us_per_call": statistics.median(v),
             "us_per_call_min": min(v), "over_one_torch_op": statistics.median(v) / add,
             "rounds_us": v} for name, v in per_round.items()]
    return {"calls": opts.calls, "rounds": opts.rounds, "rows": rows}
