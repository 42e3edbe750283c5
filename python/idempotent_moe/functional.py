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

Each operation chooses its route once, here (`_routes.traced_ops`): while
torch.compile traces a call on torch tensors it calls the operation's torch
custom op (`_torch_ops`), else its direct path in `_compaction`, the module
below both that the op's implementation calls too. `Compacted` and `Grouped`
are defined there and importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _arrays, _compaction
from ._compaction import Compacted, Grouped, compact_tensors, direct_axis
from ._native import native
from ._routes import traced_ops


def set_num_threads(num_threads: int) -> None:
    """Threads for CPU work in later calls; 0 restores the OpenMP default."""
    _compaction.default_threads = _arrays.check_int(num_threads, "num_threads")


def get_num_threads() -> int:
    """The value set by set_num_threads (0 means the OpenMP default)."""
    return _compaction.default_threads


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


def plan_workspace_elems(kind: str, rows: int, n: int, *, cuda: bool) -> int:
    """The int32 elements of the plan workspace of a permutation call: kind
    "permute" (rows: those of perm, 1 when shared), "ordered" (those of the
    indices) or "group" (those of x), n slots per row. CPU: rows x n; CUDA:
    6 x rows x n for "permute", 7 x rows x n for the others."""
    return int(native().plan_workspace_elems(kind, rows, n, bool(cuda)))


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
        # The direct path (_compaction.compact), its two branches taken here so
        # that the common call (torch tensors and scores) costs no frame more.
        torch = _arrays.torch_module()
        d = direct_axis(torch, x, scores, capacity, dim, order)
        if d is not None:
            return compact_tensors(torch, x, scores, capacity, d, mode, protected_prefix, recent_window,
                                   nan, out_indices, out_target_map, index_dtype)
    return _compaction.compact_general(x, scores, capacity, active_indices, dim, mode, order,
                                       protected_prefix, recent_window, nan, out_indices,
                                       out_target_map, index_dtype, workspace, num_threads)


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
    return _compaction.idempotent_map(scores, capacity, active_indices, num_slots, lead_shape, form, order,
                                      protected_prefix, recent_window, nan, index_dtype, out_indices,
                                      out_target_map, workspace, num_threads)


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
    return _compaction.apply_map(x, indices, target_map, dim, mode, order, workspace, num_threads)


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
    return _compaction.restore(x, indices, dim, order, workspace, num_threads)


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
    return _compaction.permute(x, perm, dim, inverse, workspace, num_threads)


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
    out_offsets  optional [lead..., E] int32/int64 output.
    out_perm     optional [lead..., T] int32/int64 output.
    workspace    optional int32 plan workspace of at least
                 plan_workspace_elems("group", rows, T) elements (rows x T on
                 the CPU, 7 x rows x T on CUDA); else allocated as for
                 `permute_`.

    Returns Grouped(offsets, perm), a named (offsets, perm) pair: offsets[e]
    is where expert e's tokens end (they are x[offsets[e - 1]:offsets[e]],
    from 0 for expert 0), grouped slot i holds original slot perm[i], and
    `ungroup_(x, perm)` puts every token back. Grouped GEMMs run on the
    offsets directly (grouped_mm's `offs`, grouped_gemm's `offsets`, with
    index_dtype="int32"). On CUDA offsets and perm are computed on the
    device (histogram, scan, stable ranks; no host synchronisation; at most
    1024 experts), and ids out of range change nothing and are raised by
    `check_errors()`.
    """
    ops = traced_ops(x, expert_ids, out_offsets, out_perm, workspace)
    if ops is not None:
        return ops.group_by_expert_(x, expert_ids, num_experts, dim=dim, out_offsets=out_offsets,
                                    out_perm=out_perm, index_dtype=index_dtype, workspace=workspace,
                                    num_threads=num_threads)
    return _compaction.group_by_expert(x, expert_ids, num_experts, dim, out_offsets, out_perm,
                                       index_dtype, workspace, num_threads)


def ungroup_(x: Any, perm: Any, *, dim: int | None = None, workspace: Any = None,
             num_threads: int | None = None) -> Any:
    """Undo `group_by_expert_` in place: every token goes back to its original
    slot (`permute_(x, perm, inverse=True)`). Returns x."""
    ops = traced_ops(x, perm, workspace)
    if ops is not None:
        return ops.ungroup_(x, perm, dim=dim, workspace=workspace, num_threads=num_threads)
    return _compaction.ungroup(x, perm, dim, workspace, num_threads)
