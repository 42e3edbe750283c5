"""The direct paths of the paged operations: what runs the core for
`paged.apply_paged_map_` and `paged.compact_paged_` when torch.compile is not
tracing them, and for their torch custom ops (`_torch_ops`) when an op runs;
the maps of `paged.paged_target_map` (`target_maps`); and what they share:
the result `PagedCompaction` (paged re-exports it), host copies of tables
and lengths, the check of shared blocks. Imports neither paged nor the ops.

Each function has its public function's parameters (names, order,
defaults), all positional-or-keyword as in `_compaction`; one made of other
operations also takes those as arguments (`build`: an idempotent_map,
`apply`: an apply_paged_map_), the direct ones by default. The public
functions of `paged` pass the public ones, so that under torch.compile each
inner call takes its own route; an op's implementation keeps the
defaults, so that nothing inside it routes again.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from . import _arrays, _compaction, _shapes
from ._heads import reduce_head_scores
from ._native import native


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


def host_int64(values: Any, name: str) -> np.ndarray:
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


def target_maps(
    block_size: int,
    seq_lens: Any,
    capacity: Any,
    scores: Any = None,
    active_indices: Sequence | None = None,
    kv_heads: int | None = None,
    per_head: bool | None = None,
    head_reduce: str = "mean",
    protected_prefix: int = 0,
    recent_window: int = 0,
    nan: str = "raise",
    num_threads: int | None = None,
    like: Any = None,
    build: Callable = _compaction.idempotent_map,
) -> Any:
    """paged_target_map's maps, each group's built by `build` (an idempotent_map)."""
    lens = host_int64(seq_lens, "seq_lens").reshape(-1)
    s_count = len(lens)
    caps = host_int64(capacity, "capacity").reshape(-1) if capacity is not None else None
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
                    build(
                        scores[rows][..., :length], cap, form="target_map",
                        protected_prefix=protected_prefix, recent_window=recent_window, nan=nan,
                        num_threads=num_threads, out_target_map=target_map[rows, ..., :length],
                    )
                continue
            rows = _index_rows(scores, np.asarray(members, dtype=np.int64))
            with _naming_sequences(members, heads):
                part = build(
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
            part = build(
                active_indices=act, num_slots=length, form="target_map",
                lead_shape=(kv_heads,) if per_head else (), num_threads=num_threads,
            )
            target_map[s, ..., :length] = part
    return target_map


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
    elems = int(native().paged_workspace_elems(num_blocks, s_count, max_blocks))  # paged_workspace_elems
    return torch.empty(elems, dtype=torch.int32, device=pool.device)


def apply_paged_map(
    caches: Any,
    block_tables: Any,
    target_map: Any,
    layout: str = "NHD",
    mode: str = "move",
    num_threads: int | None = None,
    workspace: Any = None,
) -> None:
    """apply_paged_map_'s direct path."""
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
        target_map=target_map, mode=mode, workspace=workspace,
        num_threads=_compaction.resolve_num_threads(num_threads), stream=stream,
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
    tm_host = host_int64(target_map, "target_map")
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


def compact_paged(
    caches: Any,
    block_tables: Any,
    seq_lens: Any,
    capacity: Any = None,
    scores: Any = None,
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
    build: Callable = _compaction.idempotent_map,
    apply: Callable = apply_paged_map,
) -> PagedCompaction:
    """compact_paged_'s direct path: its maps built by `build` (an
    idempotent_map), applied by `apply` (an apply_paged_map_)."""
    pools = _shapes.as_list(caches)
    for i, p in enumerate(pools):
        _arrays.check_array(p, f"caches[{i}]")
    geo = _shapes.pool_geometry(pools, layout)
    _arrays.check_array(block_tables, "block_tables")
    tables = host_int64(block_tables, "block_tables")
    if tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {list(tables.shape)}")
    lens = host_int64(seq_lens, "seq_lens").reshape(-1)
    s_count, max_blocks = tables.shape
    if len(lens) != s_count:
        raise ValueError(f"seq_lens has {len(lens)} entries, block_tables {s_count} rows")
    if (lens < 0).any() or (lens > max_blocks * geo.block_size).any():
        raise ValueError(
            f"seq_lens must lie in [0, max_blocks x block_size = {max_blocks * geo.block_size}]")
    if target_map is None:
        target_map = target_maps(
            geo.block_size, lens, capacity, scores, active_indices=active_indices,
            kv_heads=geo.heads, per_head=per_head if geo.heads is not None else False,
            head_reduce=head_reduce, protected_prefix=protected_prefix,
            recent_window=recent_window, nan=nan, num_threads=num_threads, like=pools[0], build=build,
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

    apply(pools, _tables_beside(block_tables, pools[0]), target_map, layout=layout, mode=mode,
          num_threads=num_threads)
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
    caps = host_int64(capacity, "capacity").reshape(-1)
    if len(caps) == 1:
        caps = np.full(len(lens), caps[0], dtype=np.int64)
    if len(caps) != len(lens):
        raise ValueError(f"capacity must be one int or one per sequence ({len(lens)})")
    return np.minimum(caps, lens)
