"""Paged KV caches (vLLM's layout): compact sequences in place whose slots
live in the blocks of a shared pool, and hand back the blocks they no longer
need.

A pool is [num_blocks, block_size, kv_heads, head_dim] ("NHD", vLLM's flash
attention layout), [num_blocks, kv_heads, block_size, head_dim] ("HND") or
[num_blocks, block_size, row] (no head axis: an MLA latent cache). Sequence s
owns the blocks of its row of `block_tables` [S, max_blocks]: its logical
slot x lives in block block_tables[s, x // block_size], at offset
x % block_size. A compaction keeps min(C_s, len_s) tokens of each sequence
in its logical slots [0, C_s), moving rows between blocks of the pool itself
(pairwise swaps or copies, the idempotent map of `compact_`), so that the
blocks past ceil(C_s / block_size) hold nothing the sequence needs: they are
returned in `freed_blocks` for the engine to free.

Nothing of the pool's size is allocated: the maps are built into a
[S, heads, N] int32 workspace (N the longest sequence), and the check that no
block is written through two table entries takes an int32 workspace of
num_blocks + S x max_blocks + 512 elements (`paged_workspace_elems`; on CUDA
allocated through torch beside the pool unless one is passed, on the CPU the
C core allocates it). Pools on the CPU and on CUDA work alike; on CUDA the
maps are built and applied on the device, a bad map or table changes nothing
and is raised by `check_errors()`.

`apply_paged_map_` and `compact_paged_` choose their route once
(`_routes.traced_ops`): while torch.compile traces a call on torch tensors
(for compact_paged_, with seq_lens and capacity host ints) they call their
torch custom op (`_torch_ops`), else their direct path in `_paged`, the module
below both that the ops' implementations call too. `PagedCompaction` is
defined there and importable from here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _paged, _shapes
from ._heads import reduce_head_scores
from ._native import native
from ._paged import PagedCompaction
from ._routes import traced_ops
from .functional import idempotent_map

LAYOUTS = _shapes.LAYOUTS


def paged_target_map(
    block_size: int,
    seq_lens: Any,
    capacity: Any,
    scores: Any = None,
    *,
    active_indices: Sequence | None = None,
    kv_heads: int | None = None,
    per_head: bool | None = None,
    head_reduce: str = "mean",
    protected_prefix: int = 0,
    recent_window: int = 0,
    nan: str = "raise",
    num_threads: int | None = None,
    like: Any = None,
) -> Any:
    """The maps of a paged compaction, without touching any cache.

    seq_lens        [S] current lengths (list, array or tensor of ints).
    capacity        C, or [S] capacities: sequence s keeps min(C_s, len_s).
    scores          [S, N] (one selection per sequence, all heads together),
                    [S, kv_heads, N] (one per KV head) or [S, G x kv_heads, N]
                    (per query head, reduced by head_reduce); N >= max(seq_lens),
                    entries past a sequence's length are ignored. Sequence s
                    keeps its top C_s by score plus [0, P) and its last W slots.
    active_indices  instead of scores: S arrays, [K_s] (shared by all heads) or
                    [kv_heads, K_s] (per head); then C_s = K_s.
    per_head        one map per KV head (True) or one per sequence (False);
                    default: True when the selection has a head axis.

    Returns the involution [S, N] or [S, kv_heads, N] int32 with N =
    max(seq_lens) (identity past each length), in the framework and on the
    device of `scores` (or `like`).
    Sequences of equal (length, capacity) share one call of the C core.
    """
    return _paged.target_maps(block_size, seq_lens, capacity, scores, active_indices, kv_heads, per_head,
                              head_reduce, protected_prefix, recent_window, nan, num_threads, like,
                              idempotent_map)


def paged_policy_scores(policy: Any, caches: Any, block_tables: Any, seq_lens: Any, *,
                        layout: str = "NHD", observation: dict | None = None) -> Any:
    """Scores [S, Hkv, N] float32 (N = max(seq_lens)) of a kv_policies
    policy over paged pools [K, V] (torch tensors), per sequence: its keys and
    values are read through its block table into [1, Hkv, len_s, D] tensors
    for the policy (a copy of one sequence at a time, for scoring: nothing of
    the pool moves). `observation` may hold per-sequence "queries" [S, Hq, w,
    D], "attention_totals" [S, Hkv, N] and "scaling"; positions are the
    logical slots and `seen` the length. Entries past a length are -inf."""
    import torch

    from .kv_policies import get_policy, score_kv

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    pools = _shapes.as_list(caches)
    if len(pools) != 2:
        raise ValueError("a policy scores a K pool and a V pool: give [k_pool, v_pool]")
    k_pool, v_pool = pools
    if k_pool.dim() != 4:
        raise ValueError(f"policies score pools with a head axis, [blocks, ..., D]: got {list(k_pool.shape)}")
    policy = get_policy(policy)
    obs = dict(observation or {})
    lens = _paged.host_int64(seq_lens, "seq_lens")
    tables = torch.as_tensor(np.asarray(block_tables) if not isinstance(block_tables, torch.Tensor)
                             else block_tables, device=k_pool.device).long()
    block = k_pool.shape[1] if layout == "NHD" else k_pool.shape[2]
    heads = k_pool.shape[2] if layout == "NHD" else k_pool.shape[1]
    n_max = int(lens.max()) if len(lens) else 0
    out = torch.full((len(lens), heads, n_max), -math.inf, dtype=torch.float32, device=k_pool.device)

    def rows(pool, s, length):
        blocks = tables[s, : -(-length // block)]
        x = pool[blocks]  # [nblk, bs, H, D] or [nblk, H, bs, D]
        if layout == "NHD":
            x = x.permute(2, 0, 1, 3)
        else:
            x = x.permute(1, 0, 2, 3)
        return x.reshape(heads, -1, x.shape[-1])[None, :, :length]

    for s, length in enumerate(lens.tolist()):
        if length == 0:
            continue
        fields = {}
        if obs.get("queries") is not None:
            fields["queries"] = obs["queries"][s:s + 1]
        if obs.get("attention_totals") is not None:
            fields["attention_totals"] = obs["attention_totals"][s:s + 1, :, :length]
        if obs.get("scaling") is not None:
            fields["scaling"] = obs["scaling"]
        scores = score_kv(policy, rows(k_pool, s, length), rows(v_pool, s, length), **fields)
        out[s, :, :length] = reduce_head_scores(scores, heads)[0].float()
    return out


def paged_workspace_elems(num_blocks: int, num_seqs: int, max_blocks: int) -> int:
    """int32 elements of the workspace of `apply_paged_map_`: per-block marks,
    per-table-entry flags and 512 for the device check's error keys (the C
    API's imoe_paged_workspace_elems)."""
    return int(native().paged_workspace_elems(num_blocks, num_seqs, max_blocks))


def apply_paged_map_(
    caches: Any,
    block_tables: Any,
    target_map: Any,
    *,
    layout: str = "NHD",
    mode: str = "move",
    num_threads: int | None = None,
    workspace: Any = None,
) -> None:
    """Apply per-sequence maps to paged pools in place, through the block tables.

    caches        a pool or a list of pools (K and V) of one geometry, any dtype,
                  on the CPU or on CUDA (block_tables and target_map beside them).
    block_tables  [S, max_blocks] int32/int64.
    target_map    [S, N] (one map per sequence: each slot's whole row moves) or
                  [S, kv_heads, N] (one per KV head) int32/int64 involutions.
    workspace     optional int32, C-contiguous, at least
                  paged_workspace_elems(num_blocks, S, max_blocks) elements on
                  the pools' device; on CUDA it is allocated (torch.empty) when
                  not given, on the CPU the C core allocates its own.
    Every slot that moves must name a block of the pool, and no block may be
    written through two table entries (ValueError, nothing written). On CUDA
    the call does not synchronise: bad data changes nothing and is raised by
    `check_errors()`.
    """
    ops = traced_ops(caches, block_tables, target_map, workspace)
    if ops is not None:
        return ops.apply_paged_map_(caches, block_tables, target_map, layout=layout, mode=mode,
                                    num_threads=num_threads, workspace=workspace)
    _paged.apply_paged_map(caches, block_tables, target_map, layout, mode, num_threads, workspace)


def compact_paged_(
    caches: Any,
    block_tables: Any,
    seq_lens: Any,
    capacity: Any = None,
    scores: Any = None,
    *,
    active_indices: Sequence | None = None,
    target_map: Any = None,
    layout: str = "NHD",
    per_head: bool | None = None,
    head_reduce: str = "mean",
    protected_prefix: int = 0,
    recent_window: int = 0,
    mode: str = "move",
    nan: str = "raise",
    num_threads: int | None = None,
) -> PagedCompaction:
    """Compact sequences of a paged KV cache in place and return the freed blocks.

    caches          a pool or a list of pools (K and V), modified in place:
                    [num_blocks, block_size, kv_heads, head_dim] (layout "NHD"),
                    [num_blocks, kv_heads, block_size, head_dim] ("HND"), or
                    [num_blocks, block_size, row]; any dtype.
    block_tables    [S, max_blocks] int32/int64: sequence s's logical slot x is
                    in block block_tables[s, x // block_size]. Not modified.
                    On the host or on the pools' device.
    seq_lens        [S] current lengths.
    capacity        C or [S]: each sequence keeps min(C_s, len_s) tokens.
    scores          [S, N], [S, kv_heads, N] or [S, G x kv_heads, N]: see
                    paged_target_map. Or active_indices (S arrays), or a
                    precomputed target_map [S, N] / [S, kv_heads, N].
    mode            "move" (default: kept tail tokens are copied into holes,
                    the dropped ones are gone) or "swap" (a permutation of
                    each sequence's slots: restorable).

    Returns PagedCompaction(seq_lens, freed_blocks, target_map). Every input
    is checked before anything is written; a block that would move data and
    is shared with another live entry of the call (prefix caching) is refused.
    On CUDA the selection, the map and the moves run on the device. The
    freed blocks are host lists, so the host reads block_tables: give them on
    the host (as an engine's scheduler holds them; they are uploaded beside
    the pools) and the call never waits for the device; CUDA tables are read
    back (one synchronisation). The map is read back only when two live
    entries share a block. Bad data in the map or tables changes nothing and
    is raised by `check_errors()`.
    """
    ops = traced_ops(caches, block_tables, scores, target_map, active_indices)
    if ops is not None and ops.host_ints(seq_lens, capacity):
        return ops.compact_paged_(
            caches, block_tables, seq_lens, capacity, scores, active_indices=active_indices,
            target_map=target_map, layout=layout, per_head=per_head, head_reduce=head_reduce,
            protected_prefix=protected_prefix, recent_window=recent_window, mode=mode, nan=nan,
            num_threads=num_threads)
    return _paged.compact_paged(caches, block_tables, seq_lens, capacity, scores, active_indices, target_map,
                                layout, per_head, head_reduce, protected_prefix, recent_window, mode, nan,
                                num_threads, idempotent_map, apply_paged_map_)
