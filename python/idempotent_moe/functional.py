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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from . import _arrays
from ._native import native

MODES = {"swap": 0, "move": 1}
ORDERS = ("inplace",)
NAN_POLICIES = ("raise", "lowest")

_num_threads = 0


class Compacted(NamedTuple):
    """What a compaction returns: `values` is a view of the first C' slots of
    each buffer (a tuple when several buffers were given), `indices` the
    original slot now held by each of those slots, [lead..., C']."""

    values: Any
    indices: Any


def set_num_threads(num_threads: int) -> None:
    """Threads for CPU work in later calls; 0 restores the OpenMP default."""
    global _num_threads
    _num_threads = _arrays.check_int(num_threads, "num_threads")


def get_num_threads() -> int:
    """The value set by set_num_threads (0 means the OpenMP default)."""
    return _num_threads


def cuda_available() -> bool:
    """True when this build of idempotent_moe has its CUDA kernels."""
    try:
        return bool(native().cuda_compiled())
    except ImportError:
        return False


def check_errors(x: Any = None) -> None:
    """Raise the data error that an earlier CUDA call found, if any.

    CUDA calls never synchronise the host, so bad data (a NaN score with
    nan="raise", active indices out of range or repeated, an invalid map)
    cannot make the call itself raise: the call changes nothing at all (no
    buffer, no output) and records the error on the device. This function
    synchronises the current stream of x's device (torch's or CuPy's; with
    x None, torch's current device) and raises ValueError for a recorded
    error, clearing it. On the CPU, bad data raises in the call itself and
    this function returns at once.
    """
    if x is None:
        torch = _arrays._torch()
        if torch is None or not torch.cuda.is_available() or not cuda_available():
            return
        x = torch.empty(0, device="cuda")
    device = _arrays.cuda_device_of(x)
    if device is None or not cuda_available():
        return
    code = native().take_device_status(device, _arrays.dlpack_stream(x))
    if code:
        raise ValueError(
            f"an earlier idempotent_moe call on cuda:{device} found bad data and changed "
            f"nothing: {native().status_message(code)}"
        )


def _threads(num_threads: int | None) -> int:
    if num_threads is None:
        return _num_threads
    return _arrays.check_int(num_threads, "num_threads")


def _mode(mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
    return MODES[mode]


def _order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(
            f"order must be one of {ORDERS} in this version, got {order!r} "
            "(the 'stable' and 'score' orders need the permutation engine)"
        )


def _nan_lowest(nan: str) -> bool:
    if nan not in NAN_POLICIES:
        raise ValueError(f"nan must be one of {NAN_POLICIES}, got {nan!r}")
    return nan == "lowest"


def _buffers(x: Any) -> tuple[list, bool]:
    """The buffers as a list, and whether the caller passed a sequence."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError("x is an empty sequence: give at least one buffer")
        for i, b in enumerate(x):
            _arrays.check_array(b, f"x[{i}]")
        return list(x), True
    _arrays.check_array(x, "x")
    return [x], False


def _default_dim(bufs: list, selector: Any, shared_active: bool) -> int:
    if selector is not None and not shared_active:
        return len(_arrays.shape_of(selector)) - 1
    ndim = len(_arrays.shape_of(bufs[0]))
    if ndim < 2:
        raise ValueError("dim is needed for a 1-d buffer (it would hold no row axis)")
    return ndim - 2


def _dims(bufs: list, dim: int | None, selector: Any, shared_active: bool) -> list[int]:
    if dim is None:
        dim = _default_dim(bufs, selector, shared_active)
    return [
        _arrays.normalize_dim(dim, len(_arrays.shape_of(b)), f"x[{i}]") for i, b in enumerate(bufs)
    ]


def _row_ndims(bufs: list, dims: list[int]) -> list[int]:
    return [len(_arrays.shape_of(b)) - d - 1 for b, d in zip(bufs, dims)]


def _selector(scores: Any, active_indices: Any, like: Any) -> tuple[Any, Any]:
    if (scores is None) == (active_indices is None):
        raise ValueError("give exactly one of scores and active_indices")
    if scores is not None:
        _arrays.check_array(scores, "scores")
        return scores, None
    return None, _arrays.as_index_array(active_indices, like, "active_indices")


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
    order           "inplace": kept tokens below C' stay put.
    nan             "raise" (ValueError on a NaN score) or "lowest".
    out_indices     optional [lead..., C'] int32/int64 output; allocated
                    (index_dtype, same framework and device as x) when None.
    out_target_map  optional [lead..., N] int32 output for the involution.

    Returns Compacted(values, indices): values is a view of x narrowed to
    [:C'] on `dim` (a tuple of views for a list of buffers). A call that
    raises leaves every buffer and output exactly as it was.
    """
    bufs, many = _buffers(x)
    scores, active = _selector(scores, active_indices, bufs[0])
    _order(order)
    shared_active = active is not None and len(_arrays.shape_of(active)) == 1
    dims = _dims(bufs, dim, scores if scores is not None else active, shared_active)
    n = _arrays.shape_of(bufs[0])[dims[0]]
    lead = _arrays.shape_of(bufs[0])[: dims[0]]
    if active is not None:
        k = _arrays.shape_of(active)[-1]
        capacity = k if capacity is None else capacity
    if capacity is None:
        raise TypeError("capacity is required with scores")
    capacity = _arrays.check_int(capacity, "capacity", minimum=None)
    kept = max(0, min(capacity, n))
    if out_indices is None:
        out_indices = _arrays.empty_index(bufs[0], lead + (kept,), index_dtype)
    else:
        _arrays.check_array(out_indices, "out_indices")
    if out_target_map is not None:
        _arrays.check_array(out_target_map, "out_target_map")
    native().compact(
        bufs, dims, _row_ndims(bufs, dims), scores, active, out_indices, out_target_map,
        capacity, _arrays.check_int(protected_prefix, "protected_prefix"),
        _arrays.check_int(recent_window, "recent_window"), _nan_lowest(nan), _mode(mode),
        _threads(num_threads), _arrays.dlpack_stream(bufs[0]),
    )
    views = tuple(_arrays.narrow(b, d, kept) for b, d in zip(bufs, dims))
    return Compacted(views if many else views[0], out_indices)


def idempotent_map(
    scores: Any = None,
    capacity: int | None = None,
    *,
    active_indices: Any = None,
    num_slots: int | None = None,
    lead_shape: Sequence[int] | None = None,
    form: str = "indices",
    protected_prefix: int = 0,
    recent_window: int = 0,
    nan: str = "raise",
    index_dtype: str = "int64",
    out_indices: Any = None,
    out_target_map: Any = None,
    num_threads: int | None = None,
) -> Any:
    """Build the idempotent map without moving any data.

    form "indices" returns indices [lead..., C'] (the original slot held by
    each compacted slot); "target_map" returns the involution [lead..., N]
    int32 (fixed points and 2-cycles); "both" returns (indices, target_map).
    With scores [lead..., N], lead and N come from scores; with active indices
    give `num_slots` (N), and `lead_shape` for shared 1-d active indices.
    """
    if form not in ("indices", "target_map", "both"):
        raise ValueError(f"form must be 'indices', 'target_map' or 'both', got {form!r}")
    scores, active = _selector(scores, active_indices, None)
    selector = scores if scores is not None else active
    sel_shape = _arrays.shape_of(selector)
    if scores is not None:
        lead, n = sel_shape[:-1], sel_shape[-1]
    else:
        if num_slots is None:
            raise TypeError("num_slots (N) is required with active_indices")
        n = _arrays.check_int(num_slots, "num_slots")
        if len(sel_shape) == 1:
            lead = tuple(_arrays.check_int(s, "lead_shape") for s in (lead_shape or ()))
        else:
            lead = sel_shape[:-1]
        capacity = sel_shape[-1] if capacity is None else capacity
    if capacity is None:
        raise TypeError("capacity is required with scores")
    capacity = _arrays.check_int(capacity, "capacity", minimum=None)
    kept = max(0, min(capacity, n))
    if form in ("indices", "both") and out_indices is None:
        out_indices = _arrays.empty_index(selector, lead + (kept,), index_dtype)
    if form in ("target_map", "both") and out_target_map is None:
        out_target_map = _arrays.empty_index(selector, lead + (n,), "int32")
    target_map = out_target_map
    if active is not None and target_map is None:
        # Active indices do not say N: the core reads it from the target map,
        # so form="indices" needs a scratch one ([lead..., N] int32).
        target_map = _arrays.empty_index(selector, lead + (n,), "int32")
    native().build_map(
        scores, active, out_indices, target_map, capacity,
        _arrays.check_int(protected_prefix, "protected_prefix"),
        _arrays.check_int(recent_window, "recent_window"), _nan_lowest(nan), _threads(num_threads),
        _arrays.dlpack_stream(selector),
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
    num_threads: int | None = None,
) -> Any:
    """Apply a map from `idempotent_map` or `compact_` to x in place.

    indices [lead..., C'] (int32/int64) returns views narrowed to [:C'];
    target_map [lead..., N] returns x itself (an involution does not say C').
    Either map is validated before anything moves.
    """
    if (indices is None) == (target_map is None):
        raise ValueError("give exactly one of indices and target_map")
    bufs, many = _buffers(x)
    the_map = indices if indices is not None else target_map
    _arrays.check_array(the_map, "indices" if indices is not None else "target_map")
    dims = _dims(bufs, dim, the_map, False)
    rows = _row_ndims(bufs, dims)
    stream = _arrays.dlpack_stream(bufs[0])
    if indices is not None:
        native().apply_indices(bufs, dims, rows, indices, _mode(mode), _threads(num_threads), stream)
        kept = _arrays.shape_of(indices)[-1]
        views = tuple(_arrays.narrow(b, d, kept) for b, d in zip(bufs, dims))
        return views if many else views[0]
    native().apply_target_map(bufs, dims, rows, target_map, _mode(mode), _threads(num_threads),
                              stream)
    return x


def restore_(x: Any, indices: Any, *, dim: int | None = None, num_threads: int | None = None) -> Any:
    """Undo a swap compaction in place: x (or each buffer of a list) is given
    back bit for bit as it was before `compact_(..., mode="swap")`. Returns x."""
    bufs, _ = _buffers(x)
    _arrays.check_array(indices, "indices")
    dims = _dims(bufs, dim, indices, False)
    native().restore(bufs, dims, _row_ndims(bufs, dims), indices, _threads(num_threads),
                     _arrays.dlpack_stream(bufs[0]))
    return x
