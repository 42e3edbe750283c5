"""W2 (KV-cache eviction) through the KV integrations, beside torch:
`python -m imoe_bench kv [--quick]`.

K and V [1, 32, 8192, 128] fp16, scores [1, 32, 8192], keep 4096 with 4 sink
tokens (quick: [1, 4, 1024, 64], keep 512), end to end from scores to the
compacted cache and the original index of every kept token:

  W2        contiguous caches [B, H, S, D]
            - torch topk + sort + gather (the baseline)
            - VLLMInplaceCompactionHook, move and swap
            - InplaceEvictionCache: one layer holding W2 in its buffer evicts
              down to the budget (scores from a callable; the logical
              positions move with K and V)
  W2 paged  the same tokens in a paged pool [num_blocks, 16, H, D] under a
            random block table (vLLM's layout)
            - torch: topk + sort, then a gather through the block table
            - VLLMInplaceCompactionHook with block_tables, move and swap

Every row is checked bit for bit against its baseline (same kept set, every
kept token identical to the original at its reported index). JSON and a plot
go under --out (kv-DEVICE.json / .png; default imoe-results/).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from . import report, workloads
from .runner import RunOptions, _machine, _memory, _progress, start
from .timing import copy_bandwidth, time_calls

BLOCK_SIZE = 16


@dataclass
class KVOptions(RunOptions):
    doc: str | None = None  # regenerate the table between <!-- kv:DEVICE --> markers here


class PagedProblem:
    """W2's K and V in paged pools [num_blocks, BLOCK_SIZE, H, D] under a random
    block table, with the contiguous problem's scores."""

    def __init__(self, base: workloads.Problem, seed: int = 1):
        import torch

        s = base.shape
        heads = s.lead[1]
        self.base, self.shape, self.device = base, s, base.device
        self.blocks = -(-s.n // BLOCK_SIZE)
        num_blocks = self.blocks + 8
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.table = torch.randperm(num_blocks, generator=g)[: self.blocks].to(torch.int32)
        self.tables = self.table[None].to(base.device)
        self.host_tables = self.table[None].clone()
        self.pristine = []
        for p in base.pristine:
            pool = torch.zeros((num_blocks, BLOCK_SIZE, heads, s.row), dtype=p.dtype, device=p.device)
            x = torch.arange(s.n, device=p.device)
            pool[self.table.to(p.device)[x // BLOCK_SIZE].long(), x % BLOCK_SIZE] = p[0].transpose(0, 1)
            self.pristine.append(pool)
        self.work = [p.clone() for p in self.pristine]
        self.scores = base.scores

    def reset(self) -> None:
        for w, p in zip(self.work, self.pristine):
            w.copy_(p)
        self.base.flush()

    def logical(self, pool, count: int):
        """Slots [0, count) of the sequence as [1, H, count, D] (a gather, for checks)."""
        import torch

        x = torch.arange(count, device=pool.device)
        rows = pool[self.table.to(pool.device)[x // BLOCK_SIZE].long(), x % BLOCK_SIZE]
        return rows.transpose(0, 1).unsqueeze(0)


def hook_impl(p: workloads.Problem, mode: str) -> workloads.Impl:
    from idempotent_moe.integrations.vllm import VLLMInplaceCompactionHook

    hook = VLLMInplaceCompactionHook(p.shape.keep, protected_prefix_len=p.shape.sinks, mode=mode)

    def run():
        k, v, idx = hook(p.work[0], p.work[1], attention_scores=p.scores, return_indices=True)
        return [k, v], idx

    return workloads.Impl(f"vLLM hook {mode}", "ours", mode, run)


class CacheLayerProblem:
    """One InplaceEvictionCache layer holding W2's K and V (S tokens in its
    buffer), with a callable score that returns W2's scores."""

    def __init__(self, p: workloads.Problem):
        from idempotent_moe.integrations.hf_cache import InplaceEvictionCache

        s = p.shape
        self.p = p
        # Buffers large enough for the whole sequence, as after decoding up to
        # S tokens: the timed eviction is the in-place one.
        self.cache = InplaceEvictionCache(s.keep, sink_tokens=s.sinks, max_cache_len=s.n + 64,
                                          score=lambda k, v, pos, i: p.scores, mode="move")
        self.layer = None

    def reset(self) -> None:
        import torch

        self.cache.reset()
        k, v = (t.clone() for t in self.p.pristine)
        with torch.no_grad():
            self.cache.update(k, v, 0)
        self.layer = self.cache.layers[0]
        self.p.flush()

    def impl(self) -> workloads.Impl:
        def run():
            self.layer.evict()
            idx = self.layer.positions.to(self.p.out_indices.dtype)
            return [self.layer.keys, self.layer.values], idx

        return workloads.Impl("InplaceEvictionCache evict", "ours", "move", run)


def paged_torch_baseline(pp: PagedProblem) -> workloads.Impl:
    """topk + sort, then a gather of the kept tokens through the block table."""
    import torch

    s = pp.shape
    keep, sinks = s.keep, s.sinks

    def run():
        top = torch.topk(pp.scores[..., sinks:], keep - sinks, dim=-1).indices + sinks
        prefix = torch.arange(sinks, device=pp.device).expand(*s.lead, sinks)
        idx = torch.sort(torch.cat([prefix, top], dim=-1), dim=-1).values        # [1, H, C]
        blocks = pp.tables[0][(idx // BLOCK_SIZE)].long()
        offsets = idx % BLOCK_SIZE
        heads = torch.arange(s.lead[1], device=pp.device)[None, :, None]
        return [w[blocks, offsets, heads] for w in pp.work], idx                 # [1, H, C, D]

    return workloads.Impl("torch topk+sort+paged gather", "baseline", "gather", run)


def paged_hook_impl(pp: PagedProblem, mode: str) -> workloads.Impl:
    from idempotent_moe.integrations.vllm import VLLMInplaceCompactionHook

    s = pp.shape
    hook = VLLMInplaceCompactionHook(s.keep, protected_prefix_len=s.sinks, mode=mode)

    def run():
        # the table as an engine's scheduler holds it: on the host
        res = hook(pp.work[0], pp.work[1], attention_scores=pp.scores,
                   block_tables=pp.host_tables, seq_lens=[s.n])
        return res, res.target_map[..., : s.keep]

    return workloads.Impl(f"paged vLLM hook {mode}", "ours", mode, run)


def _paged_values(pp: PagedProblem, result: tuple) -> tuple:
    """Ours returns (PagedCompaction, idx): read the kept tokens back through
    the table for the check; the baseline already returns values."""
    from idempotent_moe.paged import PagedCompaction

    values, idx = result

    if isinstance(values, PagedCompaction):
        values = [pp.logical(w, pp.shape.keep) for w in pp.work]
    return values, idx


def run_kv(opts: KVOptions) -> dict:
    import torch

    device, threads, runs = start(opts, opts.doc, "kv")
    shape = (workloads.QUICK if opts.quick else workloads.FULL)["W2"]
    names = opts.dtypes or (("float16",) if device == "cuda" else ("float16", "float32"))
    dtypes = [getattr(torch, n) for n in names]
    bandwidth = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 28), runs=10)
    flush = 4 << 20 if opts.quick else workloads.FLUSH_BYTES
    cache_ok = importlib.util.find_spec("transformers") is not None
    per_dtype = 3 + (1 if cache_ok else 0) + 3
    bar = _progress(len(dtypes) * per_dtype)
    rows = []

    def measure(group, dtype, impl, reset, problem, reference, values_of=None):
        bar.set_description(f"{group} {str(dtype).replace('torch.', '')} {impl.name}")
        timing = time_calls(impl.run, reset, device=device, runs=runs, warmup=3)
        reset()
        result = impl.run()
        if values_of is not None:
            result = values_of(result)
        reference = result if reference is None else reference
        floor_s = workloads.floor_bytes(problem, impl, result[1]) / bandwidth
        rows.append({
            "workload": group, "dtype": str(dtype).replace("torch.", ""), "impl": impl.name,
            "kind": impl.kind, "mode": impl.mode, "median_ms": timing.median_ms,
            "min_ms": timing.min_ms, "runs": timing.runs, "floor_ms": floor_s * 1e3,
            "bit_exact": bool(workloads.check_against(problem, result, reference)),
            **(_memory(device, impl, _Resettable(reset)) if device == "cuda" else {}),
        })
        bar.update(1)
        return reference

    for dtype in dtypes:
        p = workloads.Problem(shape, dtype, device, flush_bytes=flush)
        ref = measure("W2", dtype, workloads.torch_baseline(p), p.reset, p, None)
        for mode in ("move", "swap"):
            measure("W2", dtype, hook_impl(p, mode), p.reset, p, ref)
        if cache_ok:
            layer = CacheLayerProblem(p)
            measure("W2", dtype, layer.impl(), layer.reset, p, ref)
            del layer
        pp = PagedProblem(p)
        check = _CheckView(pp)
        pref = measure("W2 paged", dtype, paged_torch_baseline(pp), pp.reset, check, None)
        for mode in ("move", "swap"):
            measure("W2 paged", dtype, paged_hook_impl(pp, mode), pp.reset, check, pref,
                    values_of=lambda r, pp=pp: _paged_values(pp, r))
        del pp
        del p
    bar.close()
    report.add_speedups(rows)
    data = {
        "machine": _machine(device, threads, bandwidth), "quick": opts.quick,
        "workloads": {
            "W2": workloads.DESCRIPTION["W2"] + " (contiguous caches)",
            "W2 paged": workloads.DESCRIPTION["W2"] + f" in a paged pool, block size {BLOCK_SIZE}",
        },
        "notes": [] if cache_ok else ["InplaceEvictionCache rows need transformers"],
        "results": rows,
    }
    print(report.table(data))
    stem = f"kv-{device}" + ("-quick" if opts.quick else "")
    for path in report.write_results(data, opts.out, stem, report._plot if opts.plot else None):
        print(f"wrote {path}")
    if opts.doc:
        update_doc(opts.doc, data)
        print(f"updated {opts.doc}")
    if not all(r["bit_exact"] for r in rows):
        raise SystemExit("a result did not match its baseline bit for bit")
    return data


def update_doc(path: str, data: dict) -> None:
    """Replace the table between <!-- kv:DEVICE --> and <!-- /kv:DEVICE -->."""
    report.replace_section(path, f"kv:{data['machine']['device']}", lambda: report.table(data))


def doc_from_json(path: str, json_path: str) -> None:
    update_doc(path, report.read_json(json_path))


class _Resettable:
    """What runner._memory needs of a problem: reset()."""

    def __init__(self, reset):
        self.reset = reset


class _CheckView:
    """The paged problem as check_against and floor_bytes see it: the
    contiguous pristine tokens (the logical sequence) and the scores."""

    def __init__(self, pp: PagedProblem):
        self.pristine = pp.base.pristine
        self.scores = pp.scores
        self.shape = pp.shape
        self.dim = pp.base.dim
        self.work = pp.work
        self.row_bytes = pp.base.row_bytes


