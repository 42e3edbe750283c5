"""Expert parallelism over torch.distributed: every rank owns a contiguous
block of experts, tokens travel to the ranks of their top-k experts by
all-to-all, each rank runs its experts on what it received, and the outputs
travel back and are combined in the original token order, weighted by the
routing weights.

Shapes: T tokens on this rank, k experts per token, E experts, W ranks,
L = E / W local experts (rank r owns experts [r * L, (r + 1) * L)), D hidden.

One forward, per rank:

1. counting sort of the T x k assignments by expert (stable in token order,
   no argsort): the rows for rank r are contiguous, because the experts of a
   rank are;
2. an all-to-all of counts [W, L + 1] (per local expert, plus this rank's T),
   after which every rank knows every split size;
3. capacity mode, drop before send: the routing weights (4 bytes per
   assignment) go to the experts' owners, which rank them (`capacity_order`:
   each expert keeps its C highest weights, ties to the lower (source rank,
   token index)) and send back one keep flag per assignment (1 byte). Only
   the kept assignments' rows travel next: a dropped assignment never
   crosses the network, and the receive buffer holds at most L * C rows;
4. all_to_all_single of the (kept) token rows into one receive buffer,
   ordered by (source rank, local expert, source token);
5. the experts run on the received rows. With `experts=` (a transformers
   experts module, gate/up and down tensors run on the library's fused
   experts path, or a grouped callable of yours), one call over all local
   experts. With
   `expert_fn(expert, rows)`, one call per local expert on its rows, grouped
   in place in the receive buffer (`group_by_expert_`, a stable counting
   sort) and ungrouped after (out of place when a gradient is recorded);
6. all_to_all_single of the outputs back, and the combine: out[t] = sum_j
   w[t, j] * y[t, j], summed in a fixed j order (fp32 for half precision), a
   dropped assignment adding exactly nothing.

Capacity rule (the same as the single-process capacity mode): with
T_all = the sum of T over the ranks, C = min(T_all, ceil(T_all * k / E *
capacity_factor)); each expert keeps the C assignments of highest routing
weight, ties to the lower (source rank, token index) -- that is, to the lower
index in the concatenation of all ranks' tokens in rank order -- and NaN
weights rank lowest.

Differentiable: where a gradient is recorded (hidden, the routing weights or
the experts' weights require one), the exchanges are autograd functions whose
backward is the reverse all-to-all, so a model trains with it; the gradients
are those of the single-process experts, a dropped assignment's exactly zero.
The same code runs on gloo (CPU tensors) and NCCL (CUDA tensors); capacity
mode on CUDA needs idempotent_moe built with its CUDA kernels.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ._arrays import check_int
from ._moe_rules import (
    check_capacity_device,
    check_capacity_factor,
    check_top_k_index,
    combine,
    expert_capacity,
    order_by_expert,
)
from ._sorting import counting_sort
from .functional import cuda_available, group_by_expert_, ungroup_

__all__ = ["DispatchStats", "ExpertParallelDispatcher", "capacity_order", "expert_capacity",
           "keep_within_capacity"]


class DispatchStats(NamedTuple):
    """What the last call did on this rank (host integers).

    sent        assignments whose rows this rank sent, per destination rank
                (its own included; the kept ones in capacity mode)
    received    assignments whose rows this rank received, per source rank
    capacity    C per expert (None in dropless mode)
    dropped     assignments dropped by this rank's experts (summed over the
                ranks, the layer's total; 0 in dropless mode)
    total_tokens  T_all, the tokens of all ranks together
    row_bytes   bytes of token rows this rank sent to other ranks (the
                dispatch; the outputs' way back is as large as what it received)
    meta_bytes  bytes of counts, routing weights and keep flags this rank
                sent to other ranks
    """

    sent: list
    received: list
    capacity: int | None
    dropped: int
    total_tokens: int
    row_bytes: int
    meta_bytes: int


class ExpertParallelDispatcher:
    """Sends tokens to the ranks owning their experts and combines the results.

    ExpertParallelDispatcher(num_experts, top_k, group=None, capacity_factor=None)

    num_experts      E, a multiple of the group's world size W; rank r of the
                     group owns experts [r * E / W, (r + 1) * E / W).
    top_k            k experts per token.
    group            a torch.distributed process group (default: the world).
    capacity_factor  None: dropless (every assignment computed); else each
                     expert keeps at most C = min(T_all, ceil(T_all * k / E *
                     factor)) assignments, those of highest routing weight,
                     ties to the lower (source rank, token index); the
                     others are dropped before they are sent.

    dispatcher(hidden [T, D], topk_ids [T, k], topk_weights [T, k], expert_fn=None, *, experts=None)
    returns [T, D] in hidden's dtype. Exactly one of:

    expert_fn   expert_fn(expert, tokens [n, D]) -> [n, D], called once per
                local expert that received rows, with its global index and
                its rows (n >= 1, in an unspecified order: rows must be
                treated independently); the output is cast to hidden's dtype.
    experts     the local experts in one grouped call: a transformers experts
                module (its own forward, with top-1 routing and unit weights:
                set it dropless), a tuple (w_up [n, D, 2I], w_down [n, I, D],
                act) of gate/up and down weights in GEMM layout, run on the
                library's fused experts path, with act one of "silu", "gelu",
                "gelu_tanh", "relu" (n is E, all experts, sliced here, or L,
                this rank's shard), or a callable (rows [n, D], local_ids
                [n]) -> [n, D].

    Every rank of the group must call it (T may differ between ranks, and
    may be 0). `last_stats` holds a DispatchStats of the last call.
    """

    def __init__(self, num_experts: int, top_k: int, group=None, capacity_factor: float | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ExpertParallelDispatcher needs an initialised torch.distributed "
                               "process group")
        num_experts = check_int(num_experts, "num_experts", minimum=1)
        top_k = check_int(top_k, "top_k", minimum=1)
        if top_k > num_experts:
            raise ValueError(f"top_k must be in [1, num_experts = {num_experts}], got {top_k}")
        capacity_factor = check_capacity_factor(capacity_factor, "capacity_factor")
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world_size:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the world size "
                             f"({self.world_size}): experts are partitioned contiguously")
        self.num_experts = num_experts
        self.top_k = top_k
        self.group = group
        self.capacity_factor = capacity_factor
        self.num_local_experts = num_experts // self.world_size
        self.first_expert = self.rank * self.num_local_experts
        self.last_stats: DispatchStats | None = None

    def _check(self, hidden, topk_ids, topk_weights, expert_fn, experts):
        """Every argument judged on this rank before any collective: TypeError
        for kinds (not a tensor, a dtype the call cannot take; not exactly one
        of expert_fn and experts, expert_fn not callable), ValueError for
        values (shapes, devices, ids out of range or repeated within a token
        on CPU tensors). Tensors may require grad: the call is differentiable."""
        for name, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if (expert_fn is None) == (experts is None):
            raise TypeError("pass exactly one of expert_fn (one call per local expert) and experts= "
                            "(the local experts, one grouped call)")
        if expert_fn is not None and not callable(expert_fn):
            raise TypeError(f"expert_fn must be callable, got {type(expert_fn).__name__}")
        if hidden.dim() != 2:
            raise ValueError(f"hidden must be [T, D], got shape {tuple(hidden.shape)}")
        shape = (hidden.shape[0], self.top_k)
        if tuple(topk_ids.shape) != shape or tuple(topk_weights.shape) != shape:
            raise ValueError(f"topk_ids and topk_weights must be [T, k] = {list(shape)}, got "
                             f"{list(topk_ids.shape)} and {list(topk_weights.shape)}")
        if not hidden.is_floating_point():
            raise TypeError(f"hidden must be floating point, got {hidden.dtype}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if not topk_weights.is_floating_point():
            raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
        for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if t.device != hidden.device:
                raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}")
        check_top_k_index(topk_ids, self.num_experts, "topk_ids", weights=topk_weights)
        if self.capacity_factor is not None:
            check_capacity_device(hidden.device)
        return None if experts is None else _LocalExperts(experts, self.num_experts, self.num_local_experts,
                                                          self.first_expert)

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 expert_fn: Callable[[int, torch.Tensor], torch.Tensor] | None = None, *,
                 experts=None) -> torch.Tensor:
        local_experts = self._check(hidden, topk_ids, topk_weights, expert_fn, experts)
        grad = torch.is_grad_enabled() and (hidden.requires_grad or topk_weights.requires_grad
                                            or (local_experts is not None and local_experts.requires_grad))
        with torch.set_grad_enabled(grad):
            return self._forward(hidden, topk_ids, topk_weights, expert_fn, local_experts, grad)

    def _forward(self, hidden, topk_ids, topk_weights, expert_fn, local_experts, grad):
        world, local = self.world_size, self.num_local_experts
        num_tokens, top_k = topk_ids.shape
        device = hidden.device
        row_size = hidden.shape[1] * hidden.element_size()
        meta = _Meter(self.rank)

        # 1. Sort the assignments by expert: rows for rank r are contiguous.
        order = order_by_expert(topk_ids, self.num_experts)
        counts, dest = order.counts, order.dest.reshape(-1)

        # 2. Exchange counts per (rank, local expert), plus each rank's T.
        send_counts = torch.empty(world, local + 1, dtype=torch.int64, device=device)
        send_counts[:, :local] = counts.view(world, local)
        send_counts[:, local] = num_tokens
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        meta.add([local + 1] * world, 8)
        send_splits = send_counts[:, :local].sum(1).tolist()
        host_counts = recv_counts.cpu()
        per_source = host_counts[:, :local]  # [W, L]
        recv_splits = per_source.sum(1).tolist()
        total_tokens = int(host_counts[:, local].sum())
        received = int(sum(recv_splits))
        local_ids = torch.repeat_interleave(
            torch.arange(local, device=device).repeat(world), per_source.reshape(-1).to(device),
            output_size=received)

        # 3. Capacity: rank the assignments at their owners, send back a keep flag each.
        capacity, dropped, kept_rows, kept_flags = None, 0, None, None
        if self.capacity_factor is not None:
            capacity = expert_capacity(total_tokens, top_k, self.num_experts, self.capacity_factor)
            send_w = torch.empty(dest.numel(), dtype=torch.float32, device=device)
            send_w.scatter_(0, dest, topk_weights.detach().reshape(-1).float())
            recv_w = _exchange(send_w, recv_splits, send_splits, self.group, False)
            meta.add(send_splits, 4)
            del send_w
            keep = keep_within_capacity(local_ids, recv_w, per_source.sum(0).to(device), capacity)
            del recv_w
            kept_back = _exchange(keep.to(torch.uint8), send_splits, recv_splits, self.group, False)
            meta.add(recv_splits, 1)
            dropped = int(received - int(keep.sum()))
            recv_splits = _segment_sums(keep, recv_splits)
            send_splits = _segment_sums(kept_back.bool(), send_splits)
            local_ids = local_ids[keep]
            kept_flags = kept_back.bool()  # per sorted row: its assignment is kept
            kept_rows = kept_flags.nonzero().view(-1)
            del keep, kept_back

        # 4. The (kept) token rows to the owners.
        src_token = order.src_token if kept_rows is None else order.src_token.index_select(0, kept_rows)
        send = hidden.index_select(0, src_token)  # [S or kept, D]
        recv = _exchange(send, recv_splits, send_splits, self.group, grad)
        row_bytes = sum(n for r, n in enumerate(send_splits) if r != self.rank) * row_size
        del send

        # 5. The local experts on the received rows, in arrival order.
        if local_experts is not None:
            y = local_experts(recv, local_ids)
        else:
            y = _per_expert(recv, local_ids, local, expert_fn, self.first_expert, grad, hidden.dtype)
        del recv

        # 6. Outputs back to the senders, then the weighted combine.
        back = _exchange(y.to(hidden.dtype), send_splits, recv_splits, self.group, grad)
        del y
        self.last_stats = DispatchStats(send_splits, recv_splits, capacity, dropped, total_tokens,
                                        row_bytes, meta.bytes)
        if kept_flags is None:
            return combine(back, order.dest, topk_weights, hidden.dtype, upcast_terms=True)
        # back holds the kept assignments only: each assignment's row in it, or -1
        compact = (torch.cumsum(kept_flags, 0) - 1).index_select(0, dest).view(num_tokens, top_k)
        kept = kept_flags.index_select(0, dest).view(num_tokens, top_k)
        if back.shape[0] == 0:
            back = back.new_zeros(1, back.shape[1])
        return combine(back, compact.clamp(min=0), topk_weights, hidden.dtype, keep=kept, upcast_terms=True)


class _Meter:
    """Bytes sent to other ranks by the small exchanges of one call."""

    def __init__(self, rank: int):
        self.rank, self.bytes = rank, 0

    def add(self, splits: list, item_bytes: int) -> None:
        self.bytes += sum(n for r, n in enumerate(splits) if r != self.rank) * item_bytes


class _Exchange(torch.autograd.Function):
    """all_to_all_single as an autograd function: the backward sends the
    gradient back the way the rows came."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        return _Exchange.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list, in_splits: list, group, grad: bool) -> torch.Tensor:
    """Rows of x (split by in_splits per destination rank) to their ranks; the
    received rows, out_splits[r] from rank r, in rank order."""
    if grad:
        return _Exchange.apply(x, list(out_splits), list(in_splits), group)
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _segment_sums(flags: torch.Tensor, splits: list) -> list:
    """How many of `flags` are set in each consecutive segment of `splits`."""
    if not splits:
        return []
    return [int(v) for v in torch.stack([seg.sum() for seg in flags.split(splits)]).tolist()] \
        if flags.numel() else [0] * len(splits)


def keep_within_capacity(local_ids: torch.Tensor, weights: torch.Tensor, per_expert: torch.Tensor,
                         capacity: int) -> torch.Tensor:
    """[N] bool: the received assignments their expert keeps, the `capacity`
    highest routing weights of each local expert (`capacity_order`: ties in
    arrival order). per_expert[e] = how many of local_ids equal e."""
    n = local_ids.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=local_ids.device)
    perm = capacity_order(local_ids, weights)
    starts = torch.cumsum(per_expert, 0) - per_expert  # each expert's first sorted row
    rank_in_expert = torch.arange(n, device=local_ids.device) - starts.index_select(0, local_ids[perm])
    keep = torch.empty(n, dtype=torch.bool, device=local_ids.device)
    keep[perm] = rank_in_expert < capacity
    return keep


def _per_expert(recv: torch.Tensor, local_ids: torch.Tensor, local: int, expert_fn, first_expert: int,
                grad: bool, dtype: torch.dtype) -> torch.Tensor:
    """expert_fn over each local expert's received rows; the outputs in
    arrival order, in `dtype`. Grouped in place in the receive buffer and
    ungrouped after where no gradient is recorded (on CUDA, with the CUDA
    build); out of place (a gather and a scatter) otherwise."""
    in_place = not grad and (recv.device.type == "cpu" or (cuda_available() and local <= 1024))
    if in_place:
        grouped = group_by_expert_(recv, local_ids, local)
        perm, ends = grouped.perm, grouped.offsets.tolist()
        _run_experts(recv, [0] + ends, expert_fn, first_expert, recv)
        ungroup_(recv, perm)
        return recv
    perm, _, counts = counting_sort(local_ids, local)
    grouped = recv.index_select(0, perm)
    ends = torch.cumsum(counts, 0).tolist()
    out = _run_experts(grouped, [0] + ends, expert_fn, first_expert, None, dtype)
    return out.new_empty(out.shape).index_copy(0, perm, out) if out.numel() else out


def _run_experts(grouped: torch.Tensor, offsets: list, expert_fn, first_expert: int,
                 into: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """expert_fn over each segment [offsets[e], offsets[e + 1]) of `grouped`:
    written over its input rows (`into`), or concatenated into a new tensor."""
    outs = []
    for e in range(len(offsets) - 1):
        start, end = offsets[e], offsets[e + 1]
        if end == start:
            continue
        seg = grouped.narrow(0, start, end - start)
        out = expert_fn(first_expert + e, seg)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(seg.shape):
            got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"expert_fn({first_expert + e}, rows {list(seg.shape)}) must return "
                             f"a tensor of the same shape, got {got}")
        if into is not None:
            into.narrow(0, start, end - start).copy_(out)
        else:
            outs.append(out.to(dtype))
    if into is not None:
        return into
    return torch.cat(outs) if outs else grouped.new_empty((0,) + tuple(grouped.shape[1:]), dtype=dtype)


class _LocalExperts:
    """The local experts of `experts=`, as one grouped call: rows [n, D] and
    their local expert ids [n] -> outputs [n, D]."""

    def __init__(self, experts, num_experts: int, local: int, first: int):
        self.local, self.first, self.num_experts = local, first, num_experts
        self.module = self.call = None
        if callable(experts) and not isinstance(experts, torch.nn.Module):
            self.call, self.requires_grad = experts, False  # the caller's own grouped call
            return
        if isinstance(experts, torch.nn.Module):
            n = getattr(experts, "num_experts", None)
            if n not in (num_experts, local):
                raise ValueError(f"experts holds {n} experts: it must hold all {num_experts} or this rank's "
                                 f"{local}")
            self.module, self.offset = experts, first if n == num_experts else 0
            self.requires_grad = any(p.requires_grad for p in experts.parameters())
            return
        if not (isinstance(experts, tuple) and len(experts) == 3):
            raise TypeError("experts must be a transformers experts module, a tuple (w_up, w_down, act) or a "
                            f"callable (rows, local_ids) -> outputs, got {type(experts).__name__}")
        w_up, w_down, act = experts
        if not (isinstance(w_up, torch.Tensor) and isinstance(w_down, torch.Tensor)):
            raise TypeError("experts=(w_up, w_down, act): w_up and w_down must be torch tensors")
        if w_up.dim() != 3 or w_down.dim() != 3 or w_up.shape[0] != w_down.shape[0] \
                or w_up.shape[2] != 2 * w_down.shape[1]:
            raise ValueError(f"experts=(w_up [n, D, 2I], w_down [n, I, D], act): got {list(w_up.shape)} and "
                             f"{list(w_down.shape)}")
        if w_up.shape[0] not in (num_experts, local):
            raise ValueError(f"experts' weights hold {w_up.shape[0]} experts: they must hold all "
                             f"{num_experts} or this rank's {local}")
        if w_up.shape[0] == num_experts:
            w_up, w_down = w_up[first:first + local], w_down[first:first + local]
        if act not in ("silu", "gelu", "gelu_tanh", "relu"):
            raise ValueError(f"experts' act must be 'silu', 'gelu', 'gelu_tanh' or 'relu', got {act!r}")
        self.weights, self.act = (w_up, w_down), act
        self.requires_grad = w_up.requires_grad or w_down.requires_grad

    def __call__(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        if self.call is not None:
            out = self.call(rows, local_ids)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(rows.shape):
                got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"experts(rows {list(rows.shape)}, local_ids) must return a tensor of the "
                                 f"rows' shape, got {got}")
            return out
        ids = local_ids.view(-1, 1)
        if self.module is not None:  # its own forward: top-1, unit weights
            ones = torch.ones(ids.shape, dtype=rows.dtype, device=rows.device)
            return self.module(rows, ids + self.offset, ones)
        from ._moe_torch_ops import fused_experts

        w_up, w_down = self.weights
        ones = torch.ones(ids.shape, dtype=rows.dtype, device=rows.device)
        out, _ = fused_experts(rows, ids, ones, w_up, w_down, self.act, self.local)
        return out


def capacity_order(local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts received assignments by (local expert
    ascending, routing weight descending, arrival index ascending): the
    first C rows of each expert's segment are then the C it keeps under the
    capacity rule. Weights are ranked by the C core's order-preserving keys
    of their float32 values: -0 ties +0, NaN ranks below -inf."""
    bits = weights.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    key = torch.where(bits == 0x80000000, 0x80000000, key)  # -0 -> the key of +0
    key = torch.where(torch.isnan(weights), 0, key)  # below -inf's key 0x007FFFFF
    order = (local_ids.to(torch.int64) << 32) | (0xFFFFFFFF - key)
    return torch.argsort(order, stable=True)
