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
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from . import _arrays, _shapes
from ._native import native
from .functional import idempotent_map, resolve_num_threads, traced_ops
from .kv import reduce_head_scores

LAYOUTS = _shapes.LAYOUTS


class PagedCompaction(NamedTuple):
    """What a paged compaction returns.

    seq_lens      the new length of each sequence, min(C_s, len_s) (list of int).
    freed_blocks  per sequence, the blocks its table no longer needs: entries
                  [ceil(new / block_size), ceil(old / block_size)) of its row
                  of block_tables, in table order (list of lists of int). The
                  table itself is not modified.
    target_map    the map applied, [S, N] (one per sequence) or [S, heads, N]
                  (one per KV head) int32, N = max(seq_lens) when built here:
                  an involution over logical slots,
                  identity past each sequence's length. The original slot now
                  held by slot i < seq_lens[s] is target_map[s, ..., i].
    """

    seq_lens: list
    freed_blocks: list
    target_map: Any


def _host_ints(values: Any, name: str) -> np.ndarray:
    """A host int64 copy of a list, NumPy array or tensor of ints."""
    if _arrays.is_torch(values):
        values = values.detach().cpu().numpy()
    elif not isinstance(values, (list, tuple, range, np.ndarray, int, np.integer)):
        values = np.from_dlpack(values) if hasattr(values, "__dlpack__") else values
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _identity_map(like: Any, shape: tuple) -> Any:
    """An int32 [lead..., N] array holding arange(N) in every row, beside `like`."""
    n = shape[-1]
    if _arrays.is_torch(like):
        torch = _arrays.torch_module()
        return torch.arange(n, dtype=torch.int32, device=like.device).expand(*shape).contiguous()
    out = np.empty(shape, dtype=np.int32)
    out[...] = np.arange(n, dtype=np.int32)
    return out


def _index_rows(x: Any, rows: np.ndarray) -> Any:
    if _arrays.is_torch(x):
        torch = _arrays.torch_module()
        return torch.from_numpy(rows).to(x.device)
    return rows


_NAN_ROW = re.compile(r"scores: row (\d+), (slot \d+ is NaN.*)", re.S)


@contextmanager
def _naming_sequences(members: list, heads: int | None) -> Iterator[None]:
    """Around an idempotent_map over the score rows of `members` (`heads` rows
    each, or one): the core numbers the rows it was given; a NaN it finds is
    reported by the sequence (and head) it belongs to instead."""
    try:
        yield
    except ValueError as e:
        found = _NAN_ROW.fullmatch(str(e))
        if found is None:
            raise
        seq, head = divmod(int(found.group(1)), heads or 1)
        where = f"sequence {members[seq]}" + (f", head {head}" if heads else "")
        raise ValueError(f"scores: {where}, {found.group(2)}") from e


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
    lens = _host_ints(seq_lens, "seq_lens").reshape(-1)
    s_count = len(lens)
    caps = _host_ints(capacity, "capacity").reshape(-1) if capacity is not None else None
    if caps is not None and len(caps) == 1:
        caps = np.full(s_count, caps[0], dtype=np.int64)
    if (lens < 0).any():
        raise ValueError("seq_lens must be >= 0")
    if (scores is None) == (active_indices is None):
        raise ValueError("give exactly one of scores and active_indices")
    block_size = _arrays.check_int(block_size, "block_size", minimum=1)

    if scores is not None:
        _arrays.check_array(scores, "scores")
        if caps is None or len(caps) != s_count:
            raise ValueError(f"capacity must be one int or one per sequence ({s_count})")
        if (caps < 0).any():
            raise ValueError("capacity must be >= 0")
        shape = _arrays.shape_of(scores)
        if len(shape) not in (2, 3) or shape[0] != s_count:
            raise ValueError(
                f"scores must be [S, N] or [S, heads, N] with S = {s_count}, got {list(shape)}")
        kv_heads = _shapes.score_heads(shape, kv_heads, per_head)
        per_head = kv_heads is not None
        if per_head:
            scores = reduce_head_scores(scores, kv_heads, head_reduce)
        elif len(shape) == 3:
            if shape[1] != 1:
                raise ValueError("per_head=False needs scores [S, N] or [S, 1, N]")
            scores = scores[:, 0]
        width = _arrays.shape_of(scores)[-1]
        if s_count and int(lens.max()) > width:
            raise ValueError(f"a sequence is longer ({int(lens.max())}) than scores' N = {width}")
        like = scores
    else:
        active = list(active_indices)
        if len(active) != s_count:
            raise ValueError(f"active_indices must hold one array per sequence ({s_count})")
        ndims = {len(_arrays.shape_of(a)) if not isinstance(a, (list, tuple, range)) else 1
                 for a in active}
        if ndims - {1, 2} or len(ndims) > 1:
            raise ValueError("active_indices: every entry must be [K_s], or every entry [heads, K_s]")
        per_head = ndims == {2}
        if per_head:
            heads = {_arrays.shape_of(a)[0] for a in active}
            if len(heads) != 1:
                raise ValueError("active_indices: every entry must have the same head count")
            kv_heads = heads.pop()
        if like is None:
            like = next((a for a in active if not isinstance(a, (list, tuple, range))), None)
    n = int(lens.max()) if s_count else 0
    lead = (s_count, kv_heads) if per_head else (s_count,)
    target_map = _identity_map(like, lead + (n,))
    if scores is not None:
        heads = kv_heads if per_head else None
        groups: dict = {}
        for s in range(s_count):
            groups.setdefault((int(lens[s]), int(caps[s])), []).append(s)
        for (length, cap), members in groups.items():
            if length == 0 or cap >= length:
                continue  # nothing moves: identity
            if members == list(range(members[0], members[-1] + 1)):
                # consecutive sequences: the map is built straight into its rows
                # (views, no gather, no index upload)
                rows = slice(members[0], members[-1] + 1)
                with _naming_sequences(members, heads):
                    idempotent_map(
                        scores[rows][..., :length], cap, form="target_map",
                        protected_prefix=protected_prefix, recent_window=recent_window, nan=nan,
                        num_threads=num_threads, out_target_map=target_map[rows, ..., :length],
                    )
                continue
            rows = _index_rows(scores, np.asarray(members, dtype=np.int64))
            with _naming_sequences(members, heads):
                part = idempotent_map(
                    scores[rows][..., :length], cap, form="target_map",
                    protected_prefix=protected_prefix, recent_window=recent_window, nan=nan,
                    num_threads=num_threads,
                )
            target_map[rows, ..., :length] = part
    else:
        for s, act in enumerate(active):
            length = int(lens[s])
            k = len(act) if isinstance(act, (list, tuple, range)) else _arrays.shape_of(act)[-1]
            if k > length:
                raise ValueError(
                    f"active_indices[{s}] keeps {k} slots of a sequence of length {length}")
            if length == 0 or k == length:
                continue
            if isinstance(act, (list, tuple, range)):
                act = _arrays.as_index_array(act, like, f"active_indices[{s}]")
            part = idempotent_map(
                active_indices=act, num_slots=length, form="target_map",
                lead_shape=(kv_heads,) if per_head else (), num_threads=num_threads,
            )
            target_map[s, ..., :length] = part
    return target_map


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
    lens = _host_ints(seq_lens, "seq_lens")
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


def _paged_workspace(pool: Any, tables: Any, num_blocks: int, workspace: Any) -> Any:
    if workspace is not None:
        _arrays.check_array(workspace, "workspace")
        return workspace
    if _arrays.cuda_device_of(pool) is None:
        return None  # the C core allocates its own on the CPU
    if not _arrays.is_torch(pool):
        raise TypeError("CUDA pools that are not torch tensors need workspace= (int32, "
                        "paged_workspace_elems(num_blocks, S, max_blocks) elements)")
    torch = _arrays.torch_module()
    s_count, max_blocks = _arrays.shape_of(tables)
    return torch.empty(paged_workspace_elems(num_blocks, s_count, max_blocks), dtype=torch.int32,
                       device=pool.device)


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
    pools = _shapes.as_list(caches)
    for i, p in enumerate(pools):
        _arrays.check_array(p, f"caches[{i}]")
    _arrays.check_array(block_tables, "block_tables")
    _arrays.check_array(target_map, "target_map")
    geo = _shapes.pool_geometry(pools, layout)
    map_shape = _arrays.shape_of(target_map)
    if len(map_shape) not in (2, 3):
        raise ValueError(f"target_map must be [S, N] or [S, kv_heads, N], got {list(map_shape)}")
    per_head = len(map_shape) == 3
    if per_head and geo.heads is None:
        raise ValueError("a per-head target_map needs pools with a head axis")
    if per_head and map_shape[1] != geo.heads:
        raise ValueError(f"target_map has {map_shape[1]} heads, the pools {geo.heads}")
    if geo.heads is None or (not per_head and geo.layout == "NHD"):
        # One map per sequence moves whole slots: row = everything after the slot axis.
        row_ndims = len(_arrays.shape_of(pools[0])) - 1 - geo.slot_dim
    else:
        row_ndims = 1
        if not per_head:  # HND: heads are rows apart; one map read for every head
            target_map = _broadcast_map(target_map, geo.heads)
    stream = _arrays.dlpack_stream(pools[0])
    if len(_arrays.shape_of(block_tables)) != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {list(_arrays.shape_of(block_tables))}")
    workspace = _paged_workspace(pools[0], block_tables, geo.num_blocks, workspace)
    native().paged_apply_target_map(
        pools, [geo.slot_dim] * len(pools), [row_ndims] * len(pools), block_tables=block_tables,
        target_map=target_map, mode=mode, workspace=workspace, num_threads=resolve_num_threads(num_threads),
        stream=stream,
    )


def _broadcast_map(target_map: Any, heads: int) -> Any:
    s, n = _arrays.shape_of(target_map)
    if _arrays.is_torch(target_map):
        return target_map.unsqueeze(1).expand(s, heads, n)
    return np.broadcast_to(np.asarray(target_map)[:, None, :], (s, heads, n))


def _shared_live_blocks(tables: np.ndarray, lens: np.ndarray, block_size: int) -> np.ndarray:
    """The blocks named by more than one live table entry (prefix caching)."""
    max_blocks = tables.shape[1]
    live = np.arange(max_blocks)[None, :] < (-(-lens // block_size))[:, None]
    blocks = tables[live]
    if blocks.size == 0:
        return blocks
    if blocks.min() < 0:
        raise ValueError("block_tables: a live entry names a negative block")
    unique, counts = np.unique(blocks, return_counts=True)
    return unique[counts > 1]


def _check_unshared(tables: np.ndarray, lens: np.ndarray, target_map: Any, block_size: int,
                    shared: np.ndarray) -> None:
    """ValueError when a block that moves data is also a live block of another
    table entry of the call (a prefix-cached block shared by two sequences).
    Reads the map back only when some live block is shared at all."""
    if shared.size == 0:
        return
    s_count, max_blocks = tables.shape
    tm_host = _host_ints(target_map, "target_map")
    n = tm_host.shape[-1]
    moved_slots = tm_host != np.arange(n)
    if moved_slots.ndim == 3:
        moved_slots = moved_slots.any(axis=1)
    padded = np.zeros((s_count, max_blocks * block_size), dtype=bool)
    padded[:, :n] = moved_slots
    moved = padded.reshape(s_count, max_blocks, block_size).any(axis=2)
    live = np.arange(max_blocks)[None, :] < (-(-lens // block_size))[:, None]
    moved_blocks = tables[moved & live]
    hit = moved_blocks[np.isin(moved_blocks, shared)]
    if hit.size:
        raise ValueError(
            f"block_tables: block {int(hit[0])} moves data but is shared with another live table "
            "entry (a prefix-cached block): copy it before compacting"
        )


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
    pools = _shapes.as_list(caches)
    for i, p in enumerate(pools):
        _arrays.check_array(p, f"caches[{i}]")
    geo = _shapes.pool_geometry(pools, layout)
    _arrays.check_array(block_tables, "block_tables")
    tables = _host_ints(block_tables, "block_tables")
    if tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {list(tables.shape)}")
    lens = _host_ints(seq_lens, "seq_lens").reshape(-1)
    s_count, max_blocks = tables.shape
    if len(lens) != s_count:
        raise ValueError(f"seq_lens has {len(lens)} entries, block_tables {s_count} rows")
    if (lens < 0).any() or (lens > max_blocks * geo.block_size).any():
        raise ValueError(
            f"seq_lens must lie in [0, max_blocks x block_size = {max_blocks * geo.block_size}]")
    if target_map is None:
        target_map = paged_target_map(
            geo.block_size, lens, capacity, scores, active_indices=active_indices,
            kv_heads=geo.heads, per_head=per_head if geo.heads is not None else False,
            head_reduce=head_reduce, protected_prefix=protected_prefix,
            recent_window=recent_window, nan=nan, num_threads=num_threads, like=pools[0],
        )
        new_lens = _new_lengths(lens, capacity, active_indices)
    else:
        _arrays.check_array(target_map, "target_map")
        if capacity is None:
            raise TypeError("capacity is required with target_map")
        new_lens = _new_lengths(lens, capacity, None)
    map_shape = _arrays.shape_of(target_map)
    n = map_shape[-1]
    if map_shape[0] != s_count or (lens > n).any():
        raise ValueError(f"target_map must be [S = {s_count}, ..., N >= max(seq_lens)]")
    if n > max_blocks * geo.block_size:
        raise ValueError("target_map is wider than max_blocks x block_size")
    _check_unshared(tables, lens, target_map, geo.block_size,
                    _shared_live_blocks(tables, lens, geo.block_size))

    apply_paged_map_(pools, _tables_beside(block_tables, pools[0]), target_map, layout=layout,
                     mode=mode, num_threads=num_threads)
    old_blocks = -(-lens // geo.block_size)
    new_blocks = -(-new_lens // geo.block_size)
    freed = [tables[s, new_blocks[s]:old_blocks[s]].tolist() for s in range(s_count)]
    return PagedCompaction([int(x) for x in new_lens], freed, target_map)


def _tables_beside(block_tables: Any, pool: Any) -> Any:
    """block_tables on the pool's device: host tables for a CUDA pool are
    copied there. From pageable memory the upload is staged at once and does
    not wait for the device; pinned tables are copied synchronously, so the
    caller may change them as soon as the call returns."""
    device = _arrays.cuda_device_of(pool)
    if device is None or _arrays.cuda_device_of(block_tables) == device:
        return block_tables
    if not _arrays.is_torch(pool):
        return block_tables  # the binding names the device mismatch
    torch = _arrays.torch_module()
    if not _arrays.is_torch(block_tables):
        block_tables = torch.from_numpy(np.ascontiguousarray(np.asarray(block_tables)))
    return block_tables.to(pool.device, non_blocking=not block_tables.is_pinned())


def _new_lengths(lens: np.ndarray, capacity: Any, active_indices: Sequence | None) -> np.ndarray:
    if active_indices is not None:
        ks = [len(a) if isinstance(a, (list, tuple, range)) else _arrays.shape_of(a)[-1]
              for a in active_indices]
        return np.minimum(np.asarray(ks, dtype=np.int64), lens)
    caps = _host_ints(capacity, "capacity").reshape(-1)
    if len(caps) == 1:
        caps = np.full(len(lens), caps[0], dtype=np.int64)
    if len(caps) != len(lens):
        raise ValueError(f"capacity must be one int or one per sequence ({len(lens)})")
    return np.minimum(caps, lens)
