"""W1 (MoE expert capacity) and W2 (KV-cache eviction) of the project's
workload list, each with its baselines, run side by side on the same inputs.

Every implementation goes end to end: from scores to the compacted buffer and
its indices. Every result is checked bit for bit against the torch baseline:
the same kept set per row, and the same bytes for every kept token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import idempotent_moe as imoe


@dataclass(frozen=True)
class Shape:
    name: str
    lead: tuple          # lead axes (rows)
    n: int               # slots per row
    row: int             # elements per token
    keep: int            # C
    sinks: int           # protected prefix
    buffers: int         # 1 (tokens) or 2 (K and V)


FULL = {
    "W1": Shape("W1", (8,), 4096, 1024, 2048, 0, 1),
    "W2": Shape("W2", (1, 32), 8192, 128, 4096, 4, 2),
    "W3": Shape("W3", (32,), 1024, 7168, 512, 0, 1),
}
QUICK = {
    "W1": Shape("W1", (8,), 512, 128, 256, 0, 1),
    "W2": Shape("W2", (1, 4), 1024, 64, 512, 4, 2),
    "W3": Shape("W3", (4,), 256, 896, 128, 0, 1),
}
# The dtype each workload is defined with (on the CPU, C1 also runs float32).
DTYPE = {"W1": "float16", "W2": "float16", "W3": "bfloat16"}
# The dtypes a run takes (--dtypes), on every device and workload.
DTYPES = ("float32", "float16", "bfloat16")

FLUSH_BYTES = 256 << 20

DESCRIPTION = {
    "W1": "MoE expert capacity: tokens [8, 4096, 1024], scores [8, 4096] fp32, C = 2048",
    "W2": "KV eviction: K, V [1, 32, 8192, 128], scores [1, 32, 8192], keep 4096, 4 sinks",
    "W3": "DeepSeek-like capacity after expert-parallel receive: [32, 1024, 7168] bf16, C = 512",
}


@dataclass
class Impl:
    """One implementation of a workload: `run` returns (values, indices),
    where values is a list with one [lead..., C, row] result per buffer."""

    name: str
    kind: str            # "baseline" or "ours"
    mode: str            # the mode whose floor applies: "gather", "swap" or "move"
    run: Callable[[], tuple]


class Problem:
    """The inputs of one workload at one dtype: pristine copies, and the
    working buffers that in-place implementations modify."""

    def __init__(self, shape: Shape, dtype, device: str, seed: int = 0,
                 flush_bytes: int = FLUSH_BYTES):
        import torch

        self.shape, self.dtype, self.device = shape, dtype, device
        g = torch.Generator(device="cpu").manual_seed(seed)
        full = shape.lead + (shape.n, shape.row)
        self.pristine = [
            torch.randn(full, generator=g, dtype=torch.float32).to(dtype).to(device)
            for _ in range(shape.buffers)
        ]
        self.scores = torch.rand(shape.lead + (shape.n,), generator=g).to(device)
        self.work = [p.clone() for p in self.pristine]
        # Ours writes its indices into a buffer allocated once, as a captured
        # inference step would: the call itself then allocates nothing.
        self.out_indices = torch.empty(shape.lead + (min(shape.keep, shape.n),),
                                       dtype=torch.int64, device=device)
        self.dim = len(shape.lead)
        # Larger than any last-level cache here (60 MB of L2 on an H200, tens
        # of MB of L3 on a server CPU): writing it after a reset sends every
        # implementation to a cold cache, as the floor from a large copy assumes.
        self._flush = torch.zeros(flush_bytes, dtype=torch.uint8, device=device)

    def reset(self) -> None:
        """Restore the working buffers from the pristine copies, then evict
        them from the caches."""
        for w, p in zip(self.work, self.pristine):
            w.copy_(p)
        self.flush()

    def flush(self) -> None:
        """Evict everything from the caches. On a GPU by a read (a
        reduction): a memset would leave tens of MB of dirty lines in L2 whose
        write-back the timed call would pay; the read evicts them, a restore's
        included, so every timed call starts from a clean, cold L2 (see
        docs/cuda-design.md, "Where it stands")."""
        if self._flush.is_cuda:
            import torch

            self._flush_sink = self._flush.view(torch.int64).max()
        else:
            self._flush.fill_(1)

    @property
    def row_bytes(self) -> int:
        return self.shape.row * self.pristine[0].element_size()


def torch_baseline(p: Problem) -> Impl:
    """topk (+ sort, for the KV workload: a recency-ordered cache) + gather."""
    import torch

    s, d, keep, sinks = p.shape, p.dim, p.shape.keep, p.shape.sinks

    def run():
        if sinks:
            top = torch.topk(p.scores[..., sinks:], keep - sinks, dim=-1).indices + sinks
            prefix = torch.arange(sinks, device=p.device).expand(*s.lead, sinks)
            idx = torch.sort(torch.cat([prefix, top], dim=-1), dim=-1).values
        else:
            idx = torch.topk(p.scores, keep, dim=-1).indices
        expanded = idx.unsqueeze(-1).expand(*idx.shape, s.row)
        return [torch.gather(w, d, expanded) for w in p.work], idx

    name = "torch topk+sort+gather" if sinks else "torch topk+gather"
    return Impl(name, "baseline", "gather", run)


def _numpy_view(t):
    """A NumPy view of a CPU tensor's memory, and the name of the dtype it
    reads: a dtype NumPy lacks (bfloat16, the float8s) is read as the
    integer of its width, which moves the same bytes."""
    import torch

    try:
        return t.numpy(), None
    except TypeError:
        as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.view(as_int).numpy(), str(as_int).replace("torch.", "")


def numpy_baseline(p: Problem) -> Impl:
    """argpartition + take_along_axis on NumPy views of the same memory."""
    import numpy as np

    s, d, keep, sinks = p.shape, p.dim, p.shape.keep, p.shape.sinks
    views = [_numpy_view(w) for w in p.work]
    work = [v for v, _ in views]
    scores = p.scores.numpy()
    name = "numpy argpartition+take"
    if views[0][1]:  # the row says that NumPy moved the tokens as integers
        name += f" ({str(p.dtype).replace('torch.', '')} as {views[0][1]})"

    def run():
        part = np.argpartition(-scores[..., sinks:], keep - sinks - 1, axis=-1)[..., : keep - sinks]
        idx = part + sinks
        if sinks:
            prefix = np.broadcast_to(np.arange(sinks), s.lead + (sinks,))
            idx = np.sort(np.concatenate([prefix, idx], axis=-1), axis=-1)
        return [np.take_along_axis(w, idx[..., None], axis=d) for w in work], idx

    return Impl(name, "baseline", "gather", run)


def ours(p: Problem, mode: str, threads: int) -> Impl:
    s = p.shape

    def run():
        bufs = p.work if len(p.work) > 1 else p.work[0]
        res = imoe.compact_(bufs, p.scores, s.keep, dim=p.dim, mode=mode,
                            protected_prefix=s.sinks, num_threads=threads,
                            out_indices=p.out_indices)
        values = list(res.values) if len(p.work) > 1 else [res.values]
        return values, res.indices

    return Impl(f"idempotent_moe {mode}", "ours", mode, run)


def _as_torch(x):
    import torch

    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


def check_against(p: Problem, result: tuple, reference: tuple) -> bool:
    """Bit-exact check of `result` against the baseline `reference`: per row
    the same multiset of kept scores (so the same top-C set, whatever order
    or tie-break each used), and every kept token bit-identical to the
    pristine token at the index reported for it."""
    import torch

    values, idx = result
    idx = _as_torch(idx).to(torch.int64)
    ref_idx = _as_torch(reference[1]).to(torch.int64)
    kept = torch.sort(torch.gather(p.scores, -1, idx), dim=-1).values
    ref_kept = torch.sort(torch.gather(p.scores, -1, ref_idx), dim=-1).values
    if not torch.equal(kept, ref_kept):
        return False
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[p.pristine[0].element_size()]
    expand = idx.unsqueeze(-1).expand(*idx.shape, p.shape.row)
    for v, pristine in zip(values, p.pristine):
        expected = torch.gather(pristine, p.dim, expand).view(bits)
        if not torch.equal(_as_torch(v).view(bits), expected):
            return False
    return True


def floor_bytes(p: Problem, impl: Impl, idx) -> int:
    """Bytes the implementation's mode must read and write at the least:
    scores read, indices written, and for the data: every kept token read and
    written (gather), each moved token read and written once (move), or each
    pair exchanged (swap: twice the move traffic)."""
    import torch

    idx = _as_torch(idx)
    rows = len(p.work) * p.row_bytes
    fixed = idx.numel() * 8 + p.scores.numel() * p.scores.element_size()
    if impl.mode == "gather":
        return fixed + 2 * idx.numel() * rows
    slots = torch.arange(idx.shape[-1], device=idx.device)
    moved = int((idx.to(torch.int64) != slots).sum())
    factor = 2 if impl.mode == "move" else 4
    return fixed + factor * moved * rows
