"""The shapes an operation's arguments give, worked out the same way by its
direct path (_compaction, _paged) and by the wrapper of its torch custom op
(_torch_ops): the buffers, their slot axes, the capacity, a map's
geometry, a paged pool's geometry and a paged selection's heads. Each judges
only what Python must know before the core is called; the core judges the
rest."""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _arrays

LAYOUTS = ("NHD", "HND")


def buffers(x: Any) -> tuple[list, bool]:
    """The buffers as a list, and whether the caller passed a sequence."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError("x is an empty sequence: give at least one buffer")
        for i, b in enumerate(x):
            _arrays.check_array(b, f"x[{i}]")
        return list(x), True
    _arrays.check_array(x, "x")
    return [x], False


def default_dim(bufs: list, selector: Any, shared_active: bool) -> int:
    if selector is not None and not shared_active:
        return len(_arrays.shape_of(selector)) - 1
    ndim = len(_arrays.shape_of(bufs[0]))
    if ndim < 2:
        raise ValueError("dim is needed for a 1-d buffer (it would hold no row axis)")
    return ndim - 2


def slot_dims(bufs: list, dim: int | None, selector: Any, shared_active: bool) -> list[int]:
    if dim is None:
        dim = default_dim(bufs, selector, shared_active)
    return [
        _arrays.normalize_dim(dim, len(_arrays.shape_of(b)), f"x[{i}]") for i, b in enumerate(bufs)
    ]


def row_ndims(bufs: list, dims: list[int]) -> list[int]:
    return [len(_arrays.shape_of(b)) - d - 1 for b, d in zip(bufs, dims)]


def capacity_of(capacity: Any, active: Any) -> int:
    """C as an int: with active indices it defaults to their count K."""
    if capacity is None and active is not None:
        return _arrays.shape_of(active)[-1]
    if capacity is None:
        raise TypeError("capacity is required with scores")
    return _arrays.check_int(capacity, "capacity", minimum=None)


def map_geometry(scores: Any, active: Any, num_slots: Any, lead_shape: Any) -> tuple:
    """(selector, lead, N) of idempotent_map: from scores [lead..., N], or from
    active indices with num_slots (N) and, when they are shared 1-d, lead_shape."""
    selector = scores if scores is not None else active
    sel_shape = _arrays.shape_of(selector)
    if scores is not None:
        return selector, sel_shape[:-1], sel_shape[-1]
    if num_slots is None:
        raise TypeError("num_slots (N) is required with active_indices")
    n = _arrays.check_int(num_slots, "num_slots")
    if len(sel_shape) == 1:
        return selector, tuple(_arrays.check_int(s, "lead_shape") for s in (lead_shape or ())), n
    return selector, sel_shape[:-1], n


class Pool(NamedTuple):
    num_blocks: int
    block_size: int
    heads: int | None  # None: no head axis
    slot_dim: int
    layout: str


def pool_geometry(pools: list, layout: str) -> Pool:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    shapes = [_arrays.shape_of(p) for p in pools]
    first = shapes[0]
    if len(first) not in (3, 4):
        raise ValueError(
            "a paged cache must be [num_blocks, block_size, kv_heads, head_dim] (NHD), "
            f"[num_blocks, kv_heads, block_size, head_dim] (HND) or [num_blocks, block_size, row]; "
            f"got {list(first)}"
        )
    for i, shape in enumerate(shapes):
        if len(shape) != len(first) or shape[:-1] != first[:-1]:
            raise ValueError(
                f"caches[{i}] {list(shape)} must match caches[0] {list(first)} on every axis "
                "but the last"
            )
    if len(first) == 3:
        return Pool(first[0], first[1], None, 1, layout)
    if layout == "NHD":
        return Pool(first[0], first[1], first[2], 1, layout)
    return Pool(first[0], first[2], first[1], 2, layout)


def as_list(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError("caches is an empty sequence: give at least one pool")
        return list(x)
    return [x]


def score_heads(shape: tuple, kv_heads: int | None, per_head: bool | None) -> int | None:
    """The KV heads of one map per head selected by scores of `shape` ([S, N]
    or [S, heads, N]), or None for one map per sequence (see paged_target_map)."""
    if per_head is None:
        per_head = len(shape) == 3 and (kv_heads is None or shape[1] != 1)
    if not per_head:
        return None
    if kv_heads is None:
        kv_heads = shape[1] if len(shape) == 3 else 1
    return kv_heads
