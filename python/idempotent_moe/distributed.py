"""Expert parallelism over torch.distributed: every rank owns a contiguous
block of experts, tokens travel to the ranks of their top-k experts by
all-to-all, each local expert's tokens are grouped (and, in capacity mode,
compacted to the expert's capacity) in place inside the receive buffer, the
caller's expert function runs on them, and the outputs travel back and are
combined in the original token order, weighted by the routing weights.

Shapes: T tokens on this rank, k experts per token, E experts, W ranks,
L = E / W local experts (rank r owns experts [r * L, (r + 1) * L)), D hidden.

One forward, per rank:

1. counting sort of the T x k assignments by expert (stable in token order,
   no argsort): one gathered send buffer [T * k, D], whose rows for rank r are
   contiguous because the experts of a rank are;
2. an all-to-all of counts [W, L + 1] (per local expert, plus this rank's T),
   then the split sizes are known on every rank;
3. all_to_all_single of the tokens (and, in capacity mode, of their fp32
   routing weights) into one receive buffer [N, D], ordered by
   (source rank, local expert, source token);
4. dropless: group the receive buffer by local expert in place
   (`group_by_expert_`, a stable counting sort that permutes the rows in
   place; on a GPU without the CUDA build, a counting sort and one gather).
   Capacity mode: one stable sort of the received assignments' keys
   (local expert ascending, routing weight descending, arrival order) gives
   one permutation, and `permute_` applies it in place: each local expert's
   segment then starts with its C kept rows, highest weight first;
5. `expert_fn(expert, rows)` runs once per local expert and its output
   overwrites its input rows; dropped rows are zeroed;
6. the same permutation is undone in place (`ungroup_` / `permute_` with
   inverse=True): the receive buffer now holds every assignment's output in
   the order it arrived;
7. all_to_all_single back, and the combine: out[t] = sum_j w[t, j] * y[t, j],
   summed in a fixed j order (fp32 for half-precision inputs).

Capacity rule (the same as the single-process capacity mode): with
T_all = the sum of T over the ranks, C = min(T_all, ceil(T_all * k / E *
capacity_factor)); each expert keeps the C assignments of highest routing
weight, ties to the lower (source rank, token index) -- that is, to the lower
index in the concatenation of all ranks' tokens in rank order -- and NaN
weights rank lowest. A dropped assignment comes back as a zero row and so adds
nothing to its token (for a finite routing weight: zero times NaN or inf is NaN).

Forward only (it runs under torch.no_grad()). The same code runs on gloo
(CPU tensors) and NCCL (CUDA tensors); capacity mode on CUDA needs
idempotent_moe built with its CUDA kernels.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ._arrays import check_int
from ._moe import (
    check_capacity_device,
    check_capacity_factor,
    check_top_k_index,
    combine,
    expert_capacity,
    order_by_expert,
)
from ._sorting import counting_sort
from .functional import cuda_available, group_by_expert_, permute_, ungroup_

__all__ = ["DispatchStats", "ExpertParallelDispatcher", "capacity_order", "expert_capacity"]


class DispatchStats(NamedTuple):
    """What the last call did on this rank (host integers).

    sent        assignments this rank sent, per destination rank (its own included)
    received    assignments this rank received, per source rank
    capacity    C per expert (None in dropless mode)
    dropped     assignments dropped by this rank's experts (summed over the
                ranks, the layer's total; 0 in dropless mode)
    total_tokens  T_all, the tokens of all ranks together
    """

    sent: list
    received: list
    capacity: int | None
    dropped: int
    total_tokens: int


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
                     ties to the lower (source rank, token index).

    dispatcher(hidden [T, D], topk_ids [T, k], topk_weights [T, k], expert_fn)
    returns [T, D] in hidden's dtype. expert_fn(expert, tokens [n, D]) -> [n, D]
    is called with a global expert index this rank owns and its rows (n >= 1,
    in an unspecified order: the function must treat rows independently); its
    output is cast to hidden's dtype. Every rank of the group must call it
    (T may differ between ranks, and may be 0). `last_stats` holds a
    DispatchStats of the last call.
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

    def _check(self, hidden, topk_ids, topk_weights, expert_fn):
        """Every argument judged on this rank before any collective: TypeError
        for kinds (not a tensor, a dtype the call cannot take, a tensor that
        requires grad: the call is forward only; expert_fn not callable),
        ValueError for values (shapes, devices, ids out of range or repeated
        within a token on CPU tensors)."""
        for name, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.requires_grad:
                raise TypeError(f"{name} requires grad: ExpertParallelDispatcher is forward only "
                                f"(it records no gradient); pass {name}.detach()")
        if not callable(expert_fn):
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

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 expert_fn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        self._check(hidden, topk_ids, topk_weights, expert_fn)
        world, local = self.world_size, self.num_local_experts
        num_tokens, top_k = topk_ids.shape
        device = hidden.device
        capacity_mode = self.capacity_factor is not None

        # 1. Sort the assignments by expert: rows for rank r are contiguous.
        order = order_by_expert(topk_ids, self.num_experts)
        counts, dest = order.counts, order.dest.reshape(-1)
        send = hidden.index_select(0, order.src_token)  # [S, D]

        # 2. Exchange counts per (rank, local expert), plus each rank's T.
        send_counts = torch.empty(world, local + 1, dtype=torch.int64, device=device)
        send_counts[:, :local] = counts.view(world, local)
        send_counts[:, local] = num_tokens
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits = send_counts[:, :local].sum(1).tolist()
        host_counts = recv_counts.cpu()
        per_source = host_counts[:, :local]  # [W, L]
        recv_splits = per_source.sum(1).tolist()
        total_tokens = int(host_counts[:, local].sum())
        per_expert = per_source.sum(0).tolist()  # rows of each local expert
        received = int(sum(recv_splits))

        # 3. Tokens (and, for capacity, their weights) to the owners.
        recv = hidden.new_empty(received, hidden.shape[1])
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        del send
        recv_w = None
        if capacity_mode:
            send_w = torch.empty(dest.numel(), dtype=torch.float32, device=device)
            send_w.scatter_(0, dest, topk_weights.reshape(-1).float())
            recv_w = torch.empty(received, dtype=torch.float32, device=device)
            dist.all_to_all_single(recv_w, send_w, recv_splits, send_splits, group=self.group)
            del send_w

        # 4. Group by local expert: (rank, expert, token) -> (expert, rank, token),
        #    in capacity mode also by descending weight within each expert.
        local_ids = torch.repeat_interleave(
            torch.arange(local, device=device).repeat(world), per_source.reshape(-1).to(device),
            output_size=received)
        capacity = None
        if capacity_mode:
            capacity = expert_capacity(total_tokens, top_k, self.num_experts, self.capacity_factor)
            perm = capacity_order(local_ids, recv_w)
            permute_(recv, perm, dim=0)
            grouped = recv
        else:
            # In place where our kernels run (the CPU; CUDA with the CUDA
            # build, up to 1024 local experts); else a counting sort and one gather.
            in_place = device.type == "cpu" or (cuda_available() and local <= 1024)
            if in_place:
                perm = group_by_expert_(recv, local_ids, local).perm
                grouped = recv
            else:
                perm, _, _ = counting_sort(local_ids, local)
                grouped = recv.index_select(0, perm)

        # 5. Each local expert: compute its (kept) rows, zero the dropped ones.
        dropped = _run_experts(grouped, per_expert, capacity, expert_fn, self.first_expert)

        # 6. Undo the grouping in place.
        if capacity_mode:
            permute_(recv, perm, dim=0, inverse=True)
        elif in_place:
            ungroup_(recv, perm)
        else:
            recv.index_copy_(0, perm, grouped)
        del grouped  # recv itself when grouped in place: it must be freed before the combine

        # 7. Outputs back to the senders, then the weighted combine.
        back = hidden.new_empty(dest.numel(), hidden.shape[1])
        dist.all_to_all_single(back, recv, send_splits, recv_splits, group=self.group)
        del recv
        self.last_stats = DispatchStats(send_splits, recv_splits, capacity, dropped, total_tokens)
        return combine(back, order.dest, topk_weights, hidden.dtype, upcast_terms=True)


def _run_experts(grouped: torch.Tensor, per_expert: list, capacity: int | None,
                 expert_fn: Callable[[int, torch.Tensor], torch.Tensor], first_expert: int) -> int:
    """expert_fn over each local expert's segment of `grouped` (its first
    min(C, n) rows in capacity mode), the output written over its input and
    the dropped rows zeroed; returns the rows dropped. A function of its own
    so that no view of the receive buffer outlives it."""
    dropped = 0
    start = 0
    for e, n in enumerate(per_expert):
        if n == 0:
            continue
        seg = grouped.narrow(0, start, n)
        c = n if capacity is None else min(capacity, n)
        dropped += n - c
        if c:
            out = expert_fn(first_expert + e, seg[:c])
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(seg[:c].shape):
                got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"expert_fn({first_expert + e}, rows {list(seg[:c].shape)}) must return "
                                 f"a tensor of the same shape, got {got}")
            seg[:c] = out
        if c < n:
            seg[c:] = 0
        start += n
    return dropped


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
