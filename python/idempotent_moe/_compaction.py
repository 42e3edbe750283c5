"""The direct paths of the compaction operations: what runs the core for the
public functions of `functional` (compact_, idempotent_map, apply_map_,
restore_, permute_, ungroup_, group_by_expert_) when torch.compile is not
tracing them, and for their torch custom ops (`_torch_ops`) when an op runs.
This module imports neither, so nothing here routes anywhere: a call goes
to the core.

Each operation is one function named as its public function without the
trailing underscore, with the public function's parameters (names, order,
defaults) all positional-or-keyword, so that the public function passes
them positionally (the cheapest call); what it does is the public
function's docstring. Also here, because the direct paths write or read
them: the results `Compacted` and `Grouped` (functional re-exports them), the
thread count of a call that names none (`default_threads`, set by
functional.set_num_threads) and the index arrays of move-mode compactions,
which `restore` refuses. Torch-free: torch is used only through the tensors
a caller passes (`_arrays.torch_module()`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

from . import _arrays, _shapes
from ._native import native

default_threads = 0
"""The threads of a CPU call that names none (functional.set_num_threads;
0 is OpenMP's default)."""


class Grouped(NamedTuple):
    """What `group_by_expert_` returns (x itself is grouped in place):
    `offsets` [lead..., E], each expert's end (expert e holds
    [offsets[e - 1], offsets[e]), from 0 for expert 0: the `offs` of
    grouped_mm), and `perm` [lead..., T], the permutation applied (grouped
    slot i holds original slot perm[i]); `ungroup_(x, perm)` undoes it."""

    offsets: Any
    perm: Any


class Compacted(NamedTuple):
    """What a compaction returns: `values` is a view of the first C' slots of
    each buffer (a tuple when several buffers were given), `indices` the
    original slot now held by each of those slots, [lead..., C']."""

    values: Any
    indices: Any


_new_compacted = tuple.__new__


def resolve_num_threads(num_threads: int | None) -> int:
    """The thread count a call runs with: its own, else set_num_threads' value."""
    if num_threads is None:
        return default_threads
    return _arrays.check_int(num_threads, "num_threads")


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


_ORDER_PLANS = {"stable": "ordered", "score": "ordered"}


def _workspace(workspace: Any, like: Any, kind: str, rows: int, n: int) -> Any:
    """The caller's workspace; or, for CUDA buffers, a new one from the
    framework on their device (the C/CUDA code never allocates). On the CPU
    None lets the core allocate it for the call. kind: a plan kind, or an
    order ("inplace" needs no workspace; "stable" and "score" the "ordered"
    plan)."""
    if workspace is not None:
        return workspace
    # An order needs the "ordered" plan unless it is "inplace"; a name that is
    # no order gets none here, so the core's message names `order`.
    kind = _ORDER_PLANS.get(kind, kind) if isinstance(kind, str) else None
    if kind not in native().PLAN_KINDS or like is None \
            or _arrays.cuda_device_of(like) is None:
        return None
    elems = int(native().plan_workspace_elems(kind, rows, n, True))  # functional.plan_workspace_elems
    return _arrays.empty_index(like, (elems,), "int32")


def _selector(scores: Any, active_indices: Any, like: Any) -> tuple[Any, Any]:
    """scores, or active indices as an index array (a list becomes one)."""
    if scores is not None:
        _arrays.check_array(scores, "scores")
    if active_indices is not None:
        active_indices = _arrays.as_index_array(active_indices, like, "active_indices")
    return scores, active_indices


# The index arrays a move-mode compaction wrote last, by id, while they live
# (weak references: nothing is kept alive). restore refuses them: a move
# overwrote the dropped tokens, so "undoing" it would scramble the buffer. An
# object without weak references (a DLPack capsule) is not tracked.
_move_indices: dict = {}


def _track_move_indices(indices: Any, mode: str) -> None:
    key = id(indices)
    _move_indices.pop(key, None)
    if mode == "move":
        try:
            _move_indices[key] = weakref.ref(indices, lambda _, key=key: _move_indices.pop(key, None))
        except TypeError:
            pass


def _from_move(indices: Any) -> bool:
    ref = _move_indices.get(id(indices))
    return ref is not None and ref() is indices


# --------------------------------------------------------------------------- compact_


def compact(
    x: Any,
    scores: Any = None,
    capacity: int | None = None,
    active_indices: Any = None,
    dim: int | None = None,
    mode: str = "swap",
    order: str = "inplace",
    protected_prefix: int = 0,
    recent_window: int = 0,
    nan: str = "raise",
    out_indices: Any = None,
    out_target_map: Any = None,
    index_dtype: str = "int64",
    workspace: Any = None,
    num_threads: int | None = None,
) -> Compacted:
    """compact_'s direct path: compact_tensors for the common call (torch
    tensors with scores, see direct_axis), compact_general for every other.
    (compact_ takes the two branches itself, so that the common call costs
    no frame more.)"""
    if (active_indices is None and workspace is None and num_threads is None
            and index_dtype in _arrays.INDEX_DTYPES):
        torch = _arrays.torch_module()
        d = direct_axis(torch, x, scores, capacity, dim, order)
        if d is not None:
            return compact_tensors(torch, x, scores, capacity, d, mode, protected_prefix, recent_window,
                                   nan, out_indices, out_target_map, index_dtype)
    return compact_general(x, scores, capacity, active_indices, dim, mode, order, protected_prefix,
                           recent_window, nan, out_indices, out_target_map, index_dtype, workspace,
                           num_threads)


def compact_general(
    x: Any,
    scores: Any = None,
    capacity: int | None = None,
    active_indices: Any = None,
    dim: int | None = None,
    mode: str = "swap",
    order: str = "inplace",
    protected_prefix: int = 0,
    recent_window: int = 0,
    nan: str = "raise",
    out_indices: Any = None,
    out_target_map: Any = None,
    index_dtype: str = "int64",
    workspace: Any = None,
    num_threads: int | None = None,
) -> Compacted:
    """compact_'s direct path for any call (compact_tensors is the same call
    in fewer steps for the common one)."""
    bufs, many = _shapes.buffers(x)
    scores, active = _selector(scores, active_indices, bufs[0])
    shared_active = active is not None and len(_arrays.shape_of(active)) == 1
    dims = _shapes.slot_dims(bufs, dim, scores if scores is not None else active, shared_active)
    n = _arrays.shape_of(bufs[0])[dims[0]]
    lead = _arrays.shape_of(bufs[0])[: dims[0]]
    capacity = _shapes.capacity_of(capacity, active)
    kept = max(0, min(capacity, n))
    if out_indices is None:
        out_indices = _arrays.empty_index(bufs[0], lead + (kept,), index_dtype)
    # Everything that can raise happens before the call writes: the views too.
    views = tuple(_arrays.narrow(b, d, kept) for b, d in zip(bufs, dims))
    native().compact(
        bufs, dims, _shapes.row_ndims(bufs, dims), scores=scores, active_indices=active,
        capacity=capacity, protected_prefix=protected_prefix, recent_window=recent_window,
        nan=nan, order=order, out_indices=out_indices, out_target_map=out_target_map, mode=mode,
        workspace=_workspace(workspace, bufs[0], order, _prod(lead), n),
        num_threads=resolve_num_threads(num_threads), stream=_arrays.dlpack_stream(bufs[0]),
    )
    _track_move_indices(out_indices, mode)
    return Compacted(views if many else views[0], out_indices)


def direct_axis(torch: Any, x: Any, scores: Any, capacity: Any, dim: Any, order: str) -> int | None:
    """The slot axis when a compaction by scores may call the core directly
    (compact_tensors): torch scores and buffers (tensor_buffers) with no
    gradient recorded, an int capacity >= 0, order "inplace", `dim` (else
    the scores' last axis) an int >= 0; else None. Callers add what their
    path also needs (compact_: no active indices, workspace or thread count)."""
    if (torch is None or type(scores) is not torch.Tensor or order != "inplace"
            or type(capacity) is not int or capacity < 0 or scores.requires_grad):
        return None
    d = scores.dim() - 1 if dim is None else dim
    return d if type(d) is int and d >= 0 and tensor_buffers(torch, x, d) else None


def tensor_buffers(torch: Any, x: Any, dim: int) -> bool:
    """Whether x is torch tensors with a slot axis `dim` none of which records
    a gradient: one tensor, or a non-empty list or tuple of them."""
    if type(x) is torch.Tensor:
        return x.dim() > dim and not x.requires_grad
    if (type(x) is not list and type(x) is not tuple) or not x:
        return False
    for b in x:
        if type(b) is not torch.Tensor or b.dim() <= dim or b.requires_grad:
            return False
    return True


def compact_tensors(torch: Any, x: Any, scores: Any, capacity: int, dim: int, mode: str,
                    protected_prefix: int, recent_window: int, nan: str, out_indices: Any,
                    out_target_map: Any, index_dtype: str) -> Compacted:
    """compact_ for its most common calls, torch tensors (one, or K and V)
    with scores, the slot axis given or the scores' last (the hot path of a
    model's layer and of a KV cache; tensor_buffers says which): the same
    call into the core, which judges every value, with what the general path
    works out here in a few lines."""
    many = type(x) is not torch.Tensor
    first = x[0] if many else x
    n = first.shape[dim]
    kept = capacity if capacity < n else n
    if out_indices is None:
        out_indices = torch.empty(first.shape[:dim] + (kept,), dtype=getattr(torch, index_dtype),
                                  device=first.device)
    # The views before the call writes: nothing can fail after it.
    if many:
        bufs = tuple(x)
        views = tuple([b.narrow(dim, 0, kept) for b in bufs])
        dims, rows = (dim,) * len(bufs), tuple([b.dim() - dim - 1 for b in bufs])
    else:  # tuples: the binding takes them as they are (a list is copied into one)
        bufs, views, dims, rows = (x,), x.narrow(dim, 0, kept), (dim,), (x.dim() - dim - 1,)
    native().compact(
        bufs, dims, rows, scores=scores, active_indices=None, capacity=capacity,
        protected_prefix=protected_prefix, recent_window=recent_window, nan=nan, order="inplace",
        out_indices=out_indices, out_target_map=out_target_map, mode=mode, workspace=None,
        num_threads=default_threads, stream=_arrays.dlpack_stream(first))
    if _move_indices or mode == "move":
        _track_move_indices(out_indices, mode)
    return _new_compacted(Compacted, (views, out_indices))  # Compacted(...) without its frame


# --------------------------------------------------------------------------- idempotent_map


def idempotent_map(
    scores: Any = None,
    capacity: int | None = None,
    active_indices: Any = None,
    num_slots: int | None = None,
    lead_shape: Sequence[int] | None = None,
    form: str = "indices",
    order: str = "inplace",
    protected_prefix: int = 0,
    recent_window: int = 0,
    nan: str = "raise",
    index_dtype: str = "int64",
    out_indices: Any = None,
    out_target_map: Any = None,
    workspace: Any = None,
    num_threads: int | None = None,
) -> Any:
    """idempotent_map's direct path; `form` is one of "indices",
    "target_map" and "both" (the public function judges it)."""
    scores, active = _selector(scores, active_indices, None)
    selector, lead, n = _shapes.map_geometry(scores, active, num_slots, lead_shape)
    capacity = _shapes.capacity_of(capacity, active)
    kept = max(0, min(capacity, n))
    if form in ("indices", "both") and out_indices is None:
        out_indices = _arrays.empty_index(selector, lead + (kept,), index_dtype)
    if form in ("target_map", "both") and out_target_map is None:
        out_target_map = _arrays.empty_index(selector, lead + (n,), "int32")
    target_map = out_target_map
    if active is not None and target_map is None and order == "inplace" \
            and _arrays.cuda_device_of(selector) is not None:
        # On CUDA, active indices in order "inplace" take N from a target map:
        # a scratch one ([lead..., N] int32) stands in for form="indices".
        target_map = _arrays.empty_index(selector, lead + (n,), "int32")
    native().build_map(
        scores=scores, active_indices=active, capacity=capacity,
        protected_prefix=protected_prefix, recent_window=recent_window, nan=nan, order=order,
        num_slots=n, out_indices=out_indices, out_target_map=target_map,
        workspace=_workspace(workspace, selector, order, _prod(lead), n),
        num_threads=resolve_num_threads(num_threads), stream=_arrays.dlpack_stream(selector),
    )
    if form == "indices":
        return out_indices
    if form == "target_map":
        return out_target_map
    return out_indices, out_target_map


# --------------------------------------------------------------------------- apply_map_, restore_


def apply_map(
    x: Any,
    indices: Any = None,
    target_map: Any = None,
    dim: int | None = None,
    mode: str = "swap",
    order: str = "inplace",
    workspace: Any = None,
    num_threads: int | None = None,
) -> Any:
    """apply_map_'s direct path; exactly one of indices and target_map is
    given (the public function judges it)."""
    torch = _arrays.torch_module()
    if (torch is not None and type(x) is torch.Tensor and type(indices) is torch.Tensor
            and dim is None and workspace is None and num_threads is None and order == "inplace"
            and not x.requires_grad and x.dim() > indices.dim() - 1 >= 0):
        # The hot path (one torch tensor, indices from compact_): the general
        # path's arithmetic in a few lines; the core judges every value.
        d = indices.dim() - 1
        view = x.narrow(d, 0, min(indices.shape[d], x.shape[d]))
        native().apply_indices((x,), (d,), (x.dim() - d - 1,), indices=indices, order=order, mode=mode,
                               workspace=None, num_threads=default_threads,
                               stream=_arrays.dlpack_stream(x))
        return view
    bufs, many = _shapes.buffers(x)
    the_map = indices if indices is not None else target_map
    _arrays.check_array(the_map, "indices" if indices is not None else "target_map")
    dims = _shapes.slot_dims(bufs, dim, the_map, False)
    rows = _shapes.row_ndims(bufs, dims)
    stream = _arrays.dlpack_stream(bufs[0])
    if target_map is not None:
        native().apply_target_map(bufs, dims, rows, target_map=target_map, order=order, mode=mode,
                                  num_threads=resolve_num_threads(num_threads), stream=stream)
        return x
    n = _arrays.shape_of(bufs[0])[dims[0]]
    ws = _workspace(workspace, bufs[0], order, _prod(_arrays.shape_of(indices)[:-1]), n)
    kept = _arrays.shape_of(indices)[-1]
    views = tuple(_arrays.narrow(b, d, kept) for b, d in zip(bufs, dims))
    native().apply_indices(bufs, dims, rows, indices=indices, order=order, mode=mode,
                           workspace=ws, num_threads=resolve_num_threads(num_threads), stream=stream)
    return views if many else views[0]


def restore(x: Any, indices: Any, dim: int | None = None, order: str = "inplace",
            workspace: Any = None, num_threads: int | None = None) -> Any:
    """restore_'s direct path (it refuses the indices of a move-mode compaction)."""
    if _from_move(indices):
        raise ValueError(
            "restore_ undoes swap compactions only: these indices were written by "
            "compact_(..., mode='move'), which overwrote the dropped tokens (to restore another "
            "buffer compacted in swap mode with them, pass a copy)")
    bufs, _ = _shapes.buffers(x)
    _arrays.check_array(indices, "indices")
    dims = _shapes.slot_dims(bufs, dim, indices, False)
    n = _arrays.shape_of(bufs[0])[dims[0]]
    ws = _workspace(workspace, bufs[0], order, _prod(_arrays.shape_of(indices)[:-1]), n)
    native().restore(bufs, dims, _shapes.row_ndims(bufs, dims), indices=indices, order=order,
                     workspace=ws, num_threads=resolve_num_threads(num_threads),
                     stream=_arrays.dlpack_stream(bufs[0]))
    return x


# ---------------------------------------------------------------- permute_, ungroup_, group_by_expert_


def _perm_dims(bufs: list, dim: int | None, perm: Any) -> list[int]:
    """The slot axis: `dim`, else the last axis of a per-row perm, else (a
    shared 1-d perm) the second-to-last axis of x, or 0 for 1-d buffers."""
    if dim is None:
        perm_ndim = len(_arrays.shape_of(perm))
        if perm_ndim > 1:
            dim = perm_ndim - 1
        else:
            dim = max(0, len(_arrays.shape_of(bufs[0])) - 2)
    return [
        _arrays.normalize_dim(dim, len(_arrays.shape_of(b)), f"x[{i}]") for i, b in enumerate(bufs)
    ]


def permute(
    x: Any,
    perm: Any,
    dim: int | None = None,
    inverse: bool = False,
    workspace: Any = None,
    num_threads: int | None = None,
) -> Any:
    """permute_'s direct path."""
    bufs, _ = _shapes.buffers(x)
    perm = _arrays.as_index_array(perm, bufs[0], "perm")
    dims = _perm_dims(bufs, dim, perm)
    pshape = _arrays.shape_of(perm)
    n = _arrays.shape_of(bufs[0])[dims[0]]
    ws = _workspace(workspace, bufs[0], "permute", _prod(pshape[:-1]), n)
    native().permute(bufs, dims, _shapes.row_ndims(bufs, dims), perm=perm, inverse=bool(inverse),
                     workspace=ws, num_threads=resolve_num_threads(num_threads),
                     stream=_arrays.dlpack_stream(bufs[0]))
    return x


def ungroup(x: Any, perm: Any, dim: int | None = None, workspace: Any = None,
            num_threads: int | None = None) -> Any:
    """ungroup_'s direct path: the inverse permutation."""
    return permute(x, perm, dim, True, workspace, num_threads)


def group_by_expert(
    x: Any,
    expert_ids: Any,
    num_experts: int,
    dim: int | None = None,
    out_offsets: Any = None,
    out_perm: Any = None,
    index_dtype: str = "int64",
    workspace: Any = None,
    num_threads: int | None = None,
) -> Grouped:
    """group_by_expert_'s direct path."""
    bufs, _ = _shapes.buffers(x)
    expert_ids = _arrays.as_index_array(expert_ids, bufs[0], "expert_ids")
    num_experts = _arrays.check_int(num_experts, "num_experts")
    # The core's bound (IMOE_MAX_SLOTS, csrc/group.c), checked here too because
    # out_offsets [lead..., E] is allocated before the core sees E.
    if num_experts >= 2**31 - 1:
        raise ValueError(f"num_experts {num_experts} is outside [0, {2**31 - 1})")
    ids_shape = _arrays.shape_of(expert_ids)
    if dim is None:
        dim = len(ids_shape) - 1
    dims = [_arrays.normalize_dim(dim, len(_arrays.shape_of(b)), f"x[{i}]") for i, b in enumerate(bufs)]
    lead = ids_shape[:-1]
    t = ids_shape[-1] if ids_shape else 0
    if out_offsets is None:
        out_offsets = _arrays.empty_index(bufs[0], lead + (num_experts,), index_dtype)
    else:
        _arrays.check_array(out_offsets, "out_offsets")
    if out_perm is None:
        out_perm = _arrays.empty_index(bufs[0], lead + (t,), index_dtype)
    else:
        _arrays.check_array(out_perm, "out_perm")
    ws = _workspace(workspace, bufs[0], "group", _prod(lead), t)
    native().group_by_expert(bufs, dims, _shapes.row_ndims(bufs, dims), expert_ids=expert_ids,
                             num_experts=num_experts, out_offsets=out_offsets, out_perm=out_perm,
                             workspace=ws, num_threads=resolve_num_threads(num_threads),
                             stream=_arrays.dlpack_stream(bufs[0]))
    return Grouped(out_offsets, out_perm)
