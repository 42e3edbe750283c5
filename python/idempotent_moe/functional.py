"""The functional core: compact buffers in place with an idempotent map.

Every buffer is seen as [lead..., N, row...]: the slot axis `dim`, the lead
axes before it (experts; batch x heads) and the row axes after it, whose bytes
must be contiguous. Scores are [lead..., N]. For each lead index, the kept
slots are moved into [0, C') with C' = min(capacity, N):

- a kept slot already below C' stays where it is;
- the j-th hole (dropped slot below C', ascending) takes the j-th kept slot at
  or beyond C' (ascending).

Nothing of size O(N x row) is ever allocated: the only allocation is the index
output [lead..., C'] when the caller does not pass `out_indices`, plus O(N)
bytes of host workspace per thread while a CPU call runs.

General permutations (`permute_`, `group_by_expert_`, `ungroup_`, and the
"stable" and "score" orders of a compaction) need an int32 plan workspace
(`plan_workspace_elems`): on the CPU rows x N elements (cycles are followed in
place through a fixed stack tile), allocated inside the call; on CUDA 6 x rows
x N (7 x rows x N when the permutation is computed on the device: grouping,
ordered apply/restore), where the permutation is split into two involutions
of disjoint swaps applied in two all-parallel passes; there the workspace is
allocated by the framework on the buffers' device before the call. Either way
the caller may pass `workspace=` (any C-contiguous int32 array with at least
that many elements, on the buffers' device): then nothing is allocated.
On CUDA, `compact_(..., order="stable"/"score")` and `idempotent_map` with
those orders select on the device, order the kept slots there (a scan;
"score" adds a sort by score) and, for `compact_`, apply the permutation
as above: 7 x rows x N, "ordered" plan workspace in both.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

from . import _arrays, _shapes, _tracing
from ._native import native

_num_threads = 0


def traced_ops(*arrays: Any) -> Any:
    """The module of torch ops (`_torch_ops`) when torch.compile is tracing a
    call on torch tensors, else None: then the call takes its direct path.
    Costs an eager call about 0.2 us (torch's is_compiling)."""
    if not _tracing.compiling():
        return None
    from . import _torch_ops

    return _torch_ops if _torch_ops.takes(*arrays) else None


class Grouped(NamedTuple):
    """What `group_by_expert_` returns (x itself is grouped in place):
    `offsets` [lead..., E + 1], the slot ranges of the experts (expert e holds
    [offsets[e], offsets[e + 1])), and `perm` [lead..., T], the permutation
    applied (grouped slot i holds original slot perm[i]); `ungroup_(x, perm)`
    undoes it."""

    offsets: Any
    perm: Any


class Compacted(NamedTuple):
    """What a compaction returns: `values` is a view of the first C' slots of
    each buffer (a tuple when several buffers were given), `indices` the
    original slot now held by each of those slots, [lead..., C']."""

    values: Any
    indices: Any


_new_compacted = tuple.__new__


def set_num_threads(num_threads: int) -> None:
    """Threads for CPU work in later calls; 0 restores the OpenMP default."""
    global _num_threads
    _num_threads = _arrays.check_int(num_threads, "num_threads")


def get_num_threads() -> int:
    """The value set by set_num_threads (0 means the OpenMP default)."""
    return _num_threads


def cuda_available() -> bool:
    """True when a CUDA device can run this build's kernels now: the build has
    them (`cuda_compiled()`), a driver is loaded and at least one visible
    device has a compute capability the build has code for. False otherwise,
    also when the native part is missing; never raises. The first call
    initialises the CUDA driver (as `torch.cuda.is_available()` does) but
    creates no context; the answer is kept for the process."""
    try:
        return native().cuda_device_count() > 0
    except ImportError:
        return False


def cuda_compiled() -> bool:
    """True when this build of idempotent_moe contains its CUDA kernels
    (nvcc was present when it was built), whether or not a device is here.
    False also when the native part is missing; never raises."""
    try:
        return bool(native().cuda_compiled())
    except ImportError:
        return False


def check_errors(x: Any = None) -> None:
    """Raise the data error that an earlier CUDA call found, if any.

    CUDA calls never synchronise the host, so bad data (a NaN score with
    nan="raise", active indices out of range or repeated, an invalid map, a
    bad permutation or ordered indices, expert ids out of range)
    cannot make the call itself raise: the call changes nothing at all (no
    buffer, no output) and records the error on the device. This function
    synchronises the current stream of x's device (torch's or CuPy's; with
    x None, torch's current device) and raises ValueError for a recorded
    error, clearing it. On the CPU, bad data raises in the call itself and
    this function returns at once.
    """
    if x is None:
        torch = _arrays.torch_module()
        if torch is None or not torch.cuda.is_available() or not cuda_available():
            return
        x = torch.empty(0, device="cuda")
    device = _arrays.cuda_device_of(x)
    if device is None or not cuda_available():
        return
    code = native().take_device_status(device, _arrays.stream_value(x))
    if code:
        raise ValueError(
            f"an earlier idempotent_moe call on cuda:{device} found bad data and changed "
            f"nothing: {native().status_message(code)}"
        )


def resolve_num_threads(num_threads: int | None) -> int:
    """The thread count a call runs with: its own, else set_num_threads' value."""
    if num_threads is None:
        return _num_threads
    return _arrays.check_int(num_threads, "num_threads")


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def plan_workspace_elems(kind: str, rows: int, n: int, *, cuda: bool) -> int:
    """The int32 elements of the plan workspace of a permutation call: kind
    "permute" (rows: those of perm, 1 when shared), "ordered" (those of the
    indices) or "group" (those of x), n slots per row. CPU: rows x n; CUDA:
    6 x rows x n for "permute", 7 x rows x n for the others."""
    return int(native().plan_workspace_elems(kind, rows, n, bool(cuda)))


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
    return _arrays.empty_index(like, (plan_workspace_elems(kind, rows, n, cuda=True),), "int32")


def _selector(scores: Any, active_indices: Any, like: Any) -> tuple[Any, Any]:
    """scores, or active indices as an index array (a list becomes one)."""
    if scores is not None:
        _arrays.check_array(scores, "scores")
    if active_indices is not None:
        active_indices = _arrays.as_index_array(active_indices, like, "active_indices")
    return scores, active_indices


# The index arrays a move-mode compact_ wrote last, by id, while they live
# (weak references: nothing is kept alive). restore_ refuses them: a move
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


def compact_(
    x: Any,
    scores: Any = None,
    capacity: int | None = None,
    *,
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
    """Compact `x` in place so that each row's kept slots fill [0, C').

    x               a buffer [lead..., N, row...] of any dtype, or a list of
                    buffers sharing lead shape and N (K and V; tokens and their
                    scores): all are moved by one map. Modified in place.
    scores          [lead..., N] float32/float16/bfloat16: each row keeps the
                    top `capacity` by score, ties to the lower index, plus the
                    protected prefix [0, P) and the recent window [N - W, N).
    capacity        C >= 0; C >= N keeps everything. With `active_indices`
                    it defaults to, and must equal, their count K.
    active_indices  instead of scores: [K] shared by all rows or
                    [lead..., K] per row, int32/int64, distinct, in [0, N).
    dim             the slot axis (default: the last axis of scores, or
                    x.ndim - 2 for shared 1-d active indices).
    mode            "swap" (default; a permutation, dropped tokens end in
                    [C', N), `restore_` undoes it) or "move" (kept tail tokens
                    are copied into holes: half the traffic; dropped tokens
                    below C' are overwritten).
    order           "inplace" (default): kept tokens below C' stay put (the
                    idempotent map: fewest moves, no workspace).
                    "stable": kept tokens in [0, C') in their original order
                    (a recency-ordered KV cache).
                    "score": by descending score, ties to the lower slot (the
                    order of torch.topk + gather); every kept token ranks by
                    its own score, protected ones included; needs scores.
                    For "stable" and "score", `indices` lists the kept slots
                    in that order, and the compaction is the permutation
                    indices ++ (dropped slots, ascending): in swap mode the
                    dropped tokens end in [C', N) in their original order and
                    `restore_(x, indices, order=order)` undoes it; in move
                    mode [C', N) is left unspecified.
    nan             "raise" (ValueError on a NaN score) or "lowest".
    out_indices     optional [lead..., C'] int32/int64 output; allocated
                    (index_dtype, same framework and device as x) when None.
    out_target_map  optional [lead..., N] int32 output for the involution
                    (order "inplace" only).
    workspace       "stable"/"score" only: optional int32 plan workspace,
                    C-contiguous, >= plan_workspace_elems("ordered", R, N)
                    elements (R = prod(lead); R x N on the CPU, 7 x R x N on
                    CUDA); else the CPU core allocates R x N x 4 bytes inside
                    the call, and on CUDA the framework allocates 7 x R x N
                    int32 on x's device before it. On CUDA, move mode applies
                    the whole permutation (as swap mode does).

    Returns Compacted(values, indices): values is a view of x narrowed to
    [:C'] on `dim` (a tuple of views for a list of buffers). A call that
    raises leaves every buffer and output exactly as it was. The indices of
    a move-mode call are remembered (weakly): `restore_` refuses them.
    """
    ops = traced_ops(x, scores, active_indices, out_indices, out_target_map, workspace)
    if ops is not None:
        return ops.compact_(
            x, scores, capacity, active_indices=active_indices, dim=dim, mode=mode, order=order,
            protected_prefix=protected_prefix, recent_window=recent_window, nan=nan,
            out_indices=out_indices, out_target_map=out_target_map, index_dtype=index_dtype,
            workspace=workspace, num_threads=num_threads)
    if (active_indices is None and workspace is None and num_threads is None
            and index_dtype in _arrays.INDEX_DTYPES):
        torch = _arrays.torch_module()
        d = direct_axis(torch, x, scores, capacity, dim, order)
        if d is not None:
            return compact_tensors(torch, x, scores, capacity, d, mode, protected_prefix, recent_window,
                                    nan, out_indices, out_target_map, index_dtype)
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
        num_threads=_num_threads, stream=_arrays.dlpack_stream(first))
    if _move_indices or mode == "move":
        _track_move_indices(out_indices, mode)
    return _new_compacted(Compacted, (views, out_indices))  # Compacted(...) without its frame


def idempotent_map(
    scores: Any = None,
    capacity: int | None = None,
    *,
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
    """Build the idempotent map without moving any data.

    form "indices" returns indices [lead..., C'] (the original slot held by
    each compacted slot); "target_map" returns the involution [lead..., N]
    int32 (fixed points and 2-cycles); "both" returns (indices, target_map).
    With scores [lead..., N], lead and N come from scores; with active indices
    give `num_slots` (N), and `lead_shape` for shared 1-d active indices.
    order "stable" / "score" (see `compact_`) lists the kept slots in that
    order; they have only the "indices" form. On CUDA they take the plan
    workspace `workspace` (plan_workspace_elems("ordered", R, N) int32 on the
    scores' device), allocated by the framework when None; unused elsewhere.
    """
    if form not in ("indices", "target_map", "both"):
        raise ValueError(f"form must be 'indices', 'target_map' or 'both', got {form!r}")
    ops = traced_ops(scores, active_indices, out_indices, out_target_map, workspace)
    if ops is not None:
        return ops.idempotent_map(
            scores, capacity, active_indices=active_indices, num_slots=num_slots,
            lead_shape=lead_shape, form=form, order=order, protected_prefix=protected_prefix,
            recent_window=recent_window, nan=nan, index_dtype=index_dtype, out_indices=out_indices,
            out_target_map=out_target_map, workspace=workspace, num_threads=num_threads)
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


def apply_map_(
    x: Any,
    indices: Any = None,
    *,
    target_map: Any = None,
    dim: int | None = None,
    mode: str = "swap",
    order: str = "inplace",
    workspace: Any = None,
    num_threads: int | None = None,
) -> Any:
    """Apply a map from `idempotent_map` or `compact_` to x in place.

    indices [lead..., C'] (int32/int64) returns views narrowed to [:C'];
    target_map [lead..., N] returns x itself (an involution does not say C').
    Either map is validated before anything moves. With order "stable" or
    "score", `indices` are those of an ordered compaction (distinct slots in
    [0, N), any order; [C'] shared by every row also works) and the
    permutation indices ++ (the other slots, ascending) is applied; the
    plan workspace is as for `compact_` (on CUDA: plan_workspace_elems(
    "ordered", rows(indices), N) int32, allocated by the framework unless
    given; move mode there applies the whole permutation).
    """
    if (indices is None) == (target_map is None):
        raise ValueError("give exactly one of indices and target_map")
    ops = traced_ops(x, indices, target_map, workspace)
    if ops is not None:
        return ops.apply_map_(x, indices, target_map=target_map, dim=dim, mode=mode, order=order,
                              workspace=workspace, num_threads=num_threads)
    torch = _arrays.torch_module()
    if (torch is not None and type(x) is torch.Tensor and type(indices) is torch.Tensor
            and dim is None and workspace is None and num_threads is None and order == "inplace"
            and not x.requires_grad and x.dim() > indices.dim() - 1 >= 0):
        # The hot path (one torch tensor, indices from compact_): the general
        # path's arithmetic in a few lines; the core judges every value.
        d = indices.dim() - 1
        view = x.narrow(d, 0, min(indices.shape[d], x.shape[d]))
        native().apply_indices((x,), (d,), (x.dim() - d - 1,), indices=indices, order=order, mode=mode,
                               workspace=None, num_threads=_num_threads, stream=_arrays.dlpack_stream(x))
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


def restore_(x: Any, indices: Any, *, dim: int | None = None, order: str = "inplace",
             workspace: Any = None, num_threads: int | None = None) -> Any:
    """Undo a swap compaction in place: x (or each buffer of a list) is given
    back bit for bit as it was before `compact_(..., mode="swap", order=order)`.

    The indices alone describe the whole permutation for every order:
    "inplace" is an involution (applied again), and "stable" / "score" put the
    dropped slots in [C', N) in ascending order, so their permutation is
    indices ++ (the other slots, ascending) and its inverse is applied
    (with the plan workspace of `compact_`). "stable" and "score" undo alike.
    A move-mode compaction cannot be undone (its dropped tokens are gone):
    ValueError for the indices array such a compaction wrote, unless a swap
    compaction has written it since. Returns x."""
    ops = traced_ops(x, indices, workspace)
    if ops is not None:
        return ops.restore_(x, indices, dim=dim, order=order, workspace=workspace,
                            num_threads=num_threads)
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


def permute_(
    x: Any,
    perm: Any,
    *,
    dim: int | None = None,
    inverse: bool = False,
    workspace: Any = None,
    num_threads: int | None = None,
) -> Any:
    """Permute the slots of x in place: afterwards x[..., i, ...] holds what
    x[..., perm[i], ...] held (along `dim`), as `x.copy_(x.index_select(dim,
    perm))` would, with no O(N x row) buffer. With `inverse=True`, old slot i
    goes to slot perm[i] instead (`x[perm] = x.clone()`), which undoes the
    forward permutation.

    x          a buffer [lead..., N, row...] of any dtype, or a list of buffers
               sharing lead shape and N: all move by the same permutation.
    perm       [N] shared by every row, or [lead..., N] per row; int32/int64;
               each row must hold every value of [0, N) exactly once
               (ValueError otherwise, with nothing moved).
    dim        the slot axis (default: perm.ndim - 1 for a per-row perm, else
               x.ndim - 2, or 0 for 1-d buffers).
    workspace  optional int32 plan workspace, C-contiguous, at least
               plan_workspace_elems("permute", rows(perm), N) elements
               (rows(perm) = 1 for a 1-d perm): rows(perm) x N on the CPU,
               6 x rows(perm) x N on CUDA; else that many int32 are
               allocated (CPU: inside the call; CUDA: by the framework on
               x's device). CPU: the plan is the permutation with its cycles
               marked; cycles are rotated in place through a 4 KiB stack
               tile. CUDA: cycle leaders and positions by pointer jumping,
               then one pass that rotates the cycles inside chunks of 16
               slots and two swap passes over the chunk seams (each row is
               read and written about 1.125 times); no host
               synchronisation, on the current stream. A bad perm on CUDA
               changes nothing and is raised by `check_errors()`.
    Returns x.
    """
    ops = traced_ops(x, perm, workspace)
    if ops is not None:
        return ops.permute_(x, perm, dim=dim, inverse=inverse, workspace=workspace,
                            num_threads=num_threads)
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


def group_by_expert_(
    x: Any,
    expert_ids: Any,
    num_experts: int,
    *,
    dim: int | None = None,
    out_offsets: Any = None,
    out_perm: Any = None,
    index_dtype: str = "int64",
    workspace: Any = None,
    num_threads: int | None = None,
) -> Grouped:
    """Dropless grouping in place: reorder the T slots of x so that the tokens
    of expert 0 come first, then those of expert 1, ..., each expert's tokens
    in their original order (a stable counting sort).

    x            [lead..., T, row...] of any dtype, or a list of buffers
                 (tokens and their routing weights) moved together.
    expert_ids   [lead..., T] int32/int64, each in [0, num_experts).
    dim          the slot axis (default: expert_ids.ndim - 1).
    out_offsets  optional [lead..., E + 1] int32/int64 output.
    out_perm     optional [lead..., T] int32/int64 output.
    workspace    optional int32 plan workspace of at least
                 plan_workspace_elems("group", rows, T) elements (rows x T on
                 the CPU, 7 x rows x T on CUDA); else allocated as for
                 `permute_`.

    Returns Grouped(offsets, perm), a named (offsets, perm) pair: expert e's
    tokens are x[offsets[e]:offsets[e + 1]], grouped slot i holds original
    slot perm[i], and `ungroup_(x, perm)` puts every token back. Grouped GEMMs
    run on the offsets directly. On CUDA offsets and perm are computed on the
    device (histogram, scan, stable ranks; no host synchronisation; at most
    1024 experts), and ids out of range change nothing and are raised by
    `check_errors()`.
    """
    ops = traced_ops(x, expert_ids, out_offsets, out_perm, workspace)
    if ops is not None:
        return ops.group_by_expert_(x, expert_ids, num_experts, dim=dim, out_offsets=out_offsets,
                                    out_perm=out_perm, index_dtype=index_dtype, workspace=workspace,
                                    num_threads=num_threads)
    bufs, _ = _shapes.buffers(x)
    expert_ids = _arrays.as_index_array(expert_ids, bufs[0], "expert_ids")
    num_experts = _arrays.check_int(num_experts, "num_experts")
    # The core's bound (IMOE_MAX_SLOTS, csrc/group.c), checked here too because
    # out_offsets [lead..., E + 1] is allocated before the core sees E.
    if num_experts >= 2**31 - 1:
        raise ValueError(f"num_experts {num_experts} is outside [0, {2**31 - 1})")
    ids_shape = _arrays.shape_of(expert_ids)
    if dim is None:
        dim = len(ids_shape) - 1
    dims = [_arrays.normalize_dim(dim, len(_arrays.shape_of(b)), f"x[{i}]") for i, b in enumerate(bufs)]
    lead = ids_shape[:-1]
    t = ids_shape[-1] if ids_shape else 0
    if out_offsets is None:
        out_offsets = _arrays.empty_index(bufs[0], lead + (num_experts + 1,), index_dtype)
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


def ungroup_(x: Any, perm: Any, *, dim: int | None = None, workspace: Any = None,
             num_threads: int | None = None) -> Any:
    """Undo `group_by_expert_` in place: every token goes back to its original
    slot (`permute_(x, perm, inverse=True)`). Returns x."""
    ops = traced_ops(x, perm, workspace)
    if ops is not None:
        return ops.ungroup_(x, perm, dim=dim, workspace=workspace, num_threads=num_threads)
    return permute_(x, perm, dim=dim, inverse=True, workspace=workspace, num_threads=num_threads)
