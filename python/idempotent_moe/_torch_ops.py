"""The public in-place operations as torch custom ops (torch.library, namespace
`idempotent_moe`), so that torch.compile traces a call on torch tensors as one
opaque op instead of breaking the graph at the native call.

Imported only when a public function sees torch.compile tracing a call
(`_routes.traced_ops`), so `import idempotent_moe` never imports torch.

Each op declares the arguments it writes (`mutates_args`: the buffers, the
index outputs, the workspace) and returns nothing: a custom op may not return
a view of an input nor an input itself, so the wrappers below allocate the
outputs the caller did not give (with torch.empty, which traces), call the op,
and make the views (narrow) themselves. The fake implementations therefore
have no output to shape. The real implementation of an op calls the
operation's direct path (`_compaction`, `_paged`), which does every check and
the work: it never routes, so nothing here reaches functional or paged.

Options become op arguments of schema types str / int / bool (`mode` is
`apply_mode` in the schemas: torch's dispatcher reserves the name `mode`).
"""

from typing import Any, Optional

import torch

from . import _arrays, _compaction, _paged, _shapes

AVAILABLE = hasattr(torch.library, "custom_op")  # torch 2.4 on

def _ints(values: Any) -> bool:
    return all(_ints(v) if isinstance(v, (list, tuple, range)) else
               isinstance(v, int) and not isinstance(v, bool) for v in values)


def takes(*arrays: Any) -> bool:
    """Whether a call with these array arguments goes through the ops: every
    one is None, a torch tensor, a sequence of torch tensors or a (nested)
    sequence of ints, and at least one is a tensor. NumPy arrays and other
    DLPack producers keep the direct path."""
    if not AVAILABLE:
        return False
    found = False
    for a in arrays:
        if a is None:
            continue
        if isinstance(a, torch.Tensor):
            found = True
        elif isinstance(a, (list, tuple)) and a and all(isinstance(b, torch.Tensor) for b in a):
            found = True
        elif not (isinstance(a, (list, tuple, range)) and _ints(a)):
            return False
    return found


# --------------------------------------------------------------------------- argument types


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def _int(value: Any, name: str) -> int:
    return _arrays.check_int(value, name, minimum=None)


def _opt_int(value: Any, name: str) -> Optional[int]:
    return None if value is None else _int(value, name)


def _index_tensor(values: Any, like: Any, name: str) -> Any:
    """A list of ints as an int64 tensor beside `like` (as the direct path
    makes one); a tensor or None as it is."""
    if not isinstance(values, (list, tuple, range)):
        return values
    t = torch.as_tensor(values)
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must hold ints, got {t.dtype} values")
    device = like.device if isinstance(like, torch.Tensor) else None
    return t.to(dtype=torch.int64, device=device)


def _bufs(x: Any) -> tuple[list, bool]:
    return _shapes.buffers(x)


def _narrowed(bufs: list, dims: list, kept: Any, many: bool) -> Any:
    views = tuple(b.narrow(d, 0, kept) for b, d in zip(bufs, dims))
    return views if many else views[0]


# --------------------------------------------------------------------------- the ops


def _no_output(*args: Any, **kwargs: Any) -> None:
    """The fake implementation of every op: they return nothing (their outputs
    are arguments they write, allocated by the wrappers with their shapes)."""
    return None


def _op(name: str, mutates: tuple):
    """Register `fn` as the op idempotent_moe::name writing `mutates`."""
    def register(fn):
        op = torch.library.custom_op(f"idempotent_moe::{name}", mutates_args=mutates)(fn)
        op.register_fake(_no_output)
        return op
    return register


T = torch.Tensor
OptT = Optional[torch.Tensor]

if AVAILABLE:
    @_op("compact_", ("x", "out_indices", "out_target_map", "workspace"))
    def _compact_op(x: list[T], scores: OptT, active_indices: OptT, capacity: int, dim: Optional[int],
                    apply_mode: str, order: str, protected_prefix: int, recent_window: int, nan: str,
                    out_indices: T, out_target_map: OptT, workspace: OptT,
                    num_threads: Optional[int]) -> None:
        _compaction.compact(
            x, scores, capacity, active_indices=active_indices, dim=dim, mode=apply_mode, order=order,
            protected_prefix=protected_prefix, recent_window=recent_window, nan=nan,
            out_indices=out_indices, out_target_map=out_target_map, workspace=workspace,
            num_threads=num_threads)

    @_op("idempotent_map", ("out_indices", "out_target_map", "workspace"))
    def _map_op(scores: OptT, active_indices: OptT, capacity: int, num_slots: int, lead_shape: list[int],
                order: str, protected_prefix: int, recent_window: int, nan: str, out_indices: OptT,
                out_target_map: OptT, workspace: OptT, num_threads: Optional[int]) -> None:
        form = "both" if out_indices is not None and out_target_map is not None else (
            "indices" if out_indices is not None else "target_map")
        _compaction.idempotent_map(
            scores, capacity, active_indices=active_indices, num_slots=num_slots,
            lead_shape=lead_shape, form=form, order=order, protected_prefix=protected_prefix,
            recent_window=recent_window, nan=nan, out_indices=out_indices,
            out_target_map=out_target_map, workspace=workspace, num_threads=num_threads)

    @_op("apply_map_", ("x", "workspace"))
    def _apply_op(x: list[T], indices: OptT, target_map: OptT, dim: Optional[int], apply_mode: str,
                  order: str, workspace: OptT, num_threads: Optional[int]) -> None:
        _compaction.apply_map(x, indices, target_map=target_map, dim=dim, mode=apply_mode, order=order,
                              workspace=workspace, num_threads=num_threads)

    @_op("restore_", ("x", "workspace"))
    def _restore_op(x: list[T], indices: T, dim: Optional[int], order: str, workspace: OptT,
                    num_threads: Optional[int]) -> None:
        _compaction.restore(x, indices, dim=dim, order=order, workspace=workspace, num_threads=num_threads)

    @_op("permute_", ("x", "workspace"))
    def _permute_op(x: list[T], perm: T, dim: Optional[int], inverse: bool, workspace: OptT,
                    num_threads: Optional[int]) -> None:
        _compaction.permute(x, perm, dim=dim, inverse=inverse, workspace=workspace,
                            num_threads=num_threads)

    @_op("ungroup_", ("x", "workspace"))
    def _ungroup_op(x: list[T], perm: T, dim: Optional[int], workspace: OptT,
                    num_threads: Optional[int]) -> None:
        _compaction.ungroup(x, perm, dim=dim, workspace=workspace, num_threads=num_threads)

    @_op("group_by_expert_", ("x", "out_offsets", "out_perm", "workspace"))
    def _group_op(x: list[T], expert_ids: T, num_experts: int, dim: Optional[int], out_offsets: T,
                  out_perm: T, workspace: OptT, num_threads: Optional[int]) -> None:
        _compaction.group_by_expert(x, expert_ids, num_experts, dim=dim, out_offsets=out_offsets,
                                    out_perm=out_perm, workspace=workspace, num_threads=num_threads)

    @_op("apply_paged_map_", ("caches", "workspace"))
    def _apply_paged_op(caches: list[T], block_tables: T, target_map: T, layout: str, apply_mode: str,
                        num_threads: Optional[int], workspace: OptT) -> None:
        _paged.apply_paged_map(caches, block_tables, target_map, layout=layout, mode=apply_mode,
                               num_threads=num_threads, workspace=workspace)

    @_op("compact_paged_", ("caches", "out_target_map"))
    def _compact_paged_op(caches: list[T], block_tables: T, seq_lens: list[int],
                          capacity: Optional[list[int]], scores: OptT, active_indices: list[T],
                          active_given: bool, target_map: OptT, layout: str, per_head: Optional[bool],
                          head_reduce: str, protected_prefix: int, recent_window: int, apply_mode: str,
                          nan: str, num_threads: Optional[int], out_target_map: OptT) -> None:
        result = _paged.compact_paged(
            caches, block_tables, seq_lens, capacity, scores,
            active_indices=active_indices if active_given else None,
            target_map=target_map, layout=layout, per_head=per_head, head_reduce=head_reduce,
            protected_prefix=protected_prefix, recent_window=recent_window, mode=apply_mode,
            nan=nan, num_threads=num_threads)
        if out_target_map is not None:
            out_target_map.copy_(result.target_map)


# --------------------------------------------------------------------------- the wrappers
# Each takes the public function's arguments, with the same defaults applied
# by the caller, and returns what the public function returns.


def compact_(x, scores, capacity, *, active_indices, dim, mode, order, protected_prefix,
             recent_window, nan, out_indices, out_target_map, index_dtype, workspace,
             num_threads) -> _compaction.Compacted:
    bufs, many = _bufs(x)
    if scores is not None:
        _arrays.check_array(scores, "scores")
    active = _index_tensor(active_indices, bufs[0], "active_indices")
    shared_active = active is not None and active.dim() == 1
    dims = _shapes.slot_dims(bufs, dim, scores if scores is not None else active, shared_active)
    n = bufs[0].shape[dims[0]]
    lead = tuple(bufs[0].shape[: dims[0]])
    capacity = _shapes.capacity_of(capacity, active)
    kept = max(0, min(capacity, n))
    if out_indices is None:
        out_indices = _arrays.empty_index(bufs[0], lead + (kept,), index_dtype)
    views = _narrowed(bufs, dims, kept, many)
    torch.ops.idempotent_moe.compact_(
        bufs, scores, active, capacity, dim, _str(mode, "mode"), _str(order, "order"),
        _int(protected_prefix, "protected_prefix"), _int(recent_window, "recent_window"),
        _str(nan, "nan"), out_indices, out_target_map, workspace,
        _opt_int(num_threads, "num_threads"))
    return _compaction.Compacted(views, out_indices)


def idempotent_map(scores, capacity, *, active_indices, num_slots, lead_shape, form, order,
                   protected_prefix, recent_window, nan, index_dtype, out_indices, out_target_map,
                   workspace, num_threads) -> Any:
    if scores is not None:
        _arrays.check_array(scores, "scores")
    active = _index_tensor(active_indices, scores, "active_indices")
    selector, lead, n = _shapes.map_geometry(scores, active, num_slots, lead_shape)
    capacity = _shapes.capacity_of(capacity, active)
    kept = max(0, min(capacity, n))
    if form in ("indices", "both") and out_indices is None:
        out_indices = _arrays.empty_index(selector, lead + (kept,), index_dtype)
    if form in ("target_map", "both") and out_target_map is None:
        out_target_map = _arrays.empty_index(selector, lead + (n,), "int32")
    torch.ops.idempotent_moe.idempotent_map(
        scores, active, capacity, n, list(lead), _str(order, "order"),
        _int(protected_prefix, "protected_prefix"), _int(recent_window, "recent_window"),
        _str(nan, "nan"), out_indices if form != "target_map" else None,
        out_target_map if form != "indices" else None, workspace, _opt_int(num_threads, "num_threads"))
    if form == "indices":
        return out_indices
    if form == "target_map":
        return out_target_map
    return out_indices, out_target_map


def apply_map_(x, indices, *, target_map, dim, mode, order, workspace, num_threads) -> Any:
    bufs, many = _bufs(x)
    the_map = indices if indices is not None else target_map
    _arrays.check_array(the_map, "indices" if indices is not None else "target_map")
    out = x
    if indices is not None:
        out = _narrowed(bufs, _shapes.slot_dims(bufs, dim, indices, False), indices.shape[-1], many)
    torch.ops.idempotent_moe.apply_map_(bufs, indices, target_map, dim, _str(mode, "mode"),
                                        _str(order, "order"), workspace,
                                        _opt_int(num_threads, "num_threads"))
    return out


def restore_(x, indices, *, dim, order, workspace, num_threads) -> Any:
    bufs, _ = _bufs(x)
    _arrays.check_array(indices, "indices")
    torch.ops.idempotent_moe.restore_(bufs, indices, dim, _str(order, "order"), workspace,
                                      _opt_int(num_threads, "num_threads"))
    return x


def permute_(x, perm, *, dim, inverse, workspace, num_threads) -> Any:
    bufs, _ = _bufs(x)
    perm = _index_tensor(perm, bufs[0], "perm")
    _arrays.check_array(perm, "perm")
    torch.ops.idempotent_moe.permute_(bufs, perm, dim, bool(inverse), workspace,
                                      _opt_int(num_threads, "num_threads"))
    return x


def ungroup_(x, perm, *, dim, workspace, num_threads) -> Any:
    bufs, _ = _bufs(x)
    perm = _index_tensor(perm, bufs[0], "perm")
    _arrays.check_array(perm, "perm")
    torch.ops.idempotent_moe.ungroup_(bufs, perm, dim, workspace, _opt_int(num_threads, "num_threads"))
    return x


def group_by_expert_(x, expert_ids, num_experts, *, dim, out_offsets, out_perm, index_dtype,
                     workspace, num_threads) -> _compaction.Grouped:
    bufs, _ = _bufs(x)
    expert_ids = _index_tensor(expert_ids, bufs[0], "expert_ids")
    _arrays.check_array(expert_ids, "expert_ids")
    num_experts = _arrays.check_int(num_experts, "num_experts")
    lead = tuple(expert_ids.shape[:-1])
    t = expert_ids.shape[-1] if expert_ids.dim() else 0
    if out_offsets is None:
        out_offsets = _arrays.empty_index(bufs[0], lead + (num_experts,), index_dtype)
    if out_perm is None:
        out_perm = _arrays.empty_index(bufs[0], lead + (t,), index_dtype)
    torch.ops.idempotent_moe.group_by_expert_(bufs, expert_ids, num_experts, dim, out_offsets, out_perm,
                                              workspace, _opt_int(num_threads, "num_threads"))
    return _compaction.Grouped(out_offsets, out_perm)


def apply_paged_map_(caches, block_tables, target_map, *, layout, mode, num_threads, workspace) -> None:
    pools = _shapes.as_list(caches)
    torch.ops.idempotent_moe.apply_paged_map_(pools, block_tables, target_map, _str(layout, "layout"),
                                              _str(mode, "mode"), _opt_int(num_threads, "num_threads"),
                                              workspace)


def host_ints(*values: Any) -> bool:
    """Whether every value is an int or a sequence of ints (host values the
    tracer can read): compact_paged_ goes through its op only then."""
    return all(v is None or (isinstance(v, int) and not isinstance(v, bool))
               or (isinstance(v, (list, tuple, range)) and _ints(v)) for v in values)


def _int_list(values: Any) -> list:
    return [values] if isinstance(values, int) else list(values)


def compact_paged_(caches, block_tables, seq_lens, capacity, scores, *, active_indices, target_map,
                   layout, per_head, head_reduce, protected_prefix, recent_window, mode, nan,
                   num_threads) -> _paged.PagedCompaction:
    """The op does the whole direct-path compaction (host checks of the
    tables included, at run time); here the lengths, the map's shape and the
    freed blocks come from the host ints seq_lens and capacity. The freed
    blocks are 1-d tensors (copies of block_tables' entries): a compiled graph
    cannot give host lists without waiting for the data."""
    pools = _shapes.as_list(caches)
    for i, p in enumerate(pools):
        _arrays.check_array(p, f"caches[{i}]")
    geo = _shapes.pool_geometry(pools, layout)
    _arrays.check_array(block_tables, "block_tables")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {list(block_tables.shape)}")
    lens = _int_list(seq_lens)
    s_count = block_tables.shape[0]
    if len(lens) != s_count:
        raise ValueError(f"seq_lens has {len(lens)} entries, block_tables {s_count} rows")
    caps = None if capacity is None else _int_list(capacity)
    active = None
    if active_indices is not None:
        like = scores if scores is not None else pools[0]
        active = [_index_tensor(a, like, f"active_indices[{s}]") for s, a in enumerate(active_indices)]
        new_lens = [min(a.shape[-1], n) for a, n in zip(active, lens)]
    else:
        if caps is None and target_map is not None:
            raise TypeError("capacity is required with target_map")
        if caps is None or len(caps) not in (1, s_count):
            raise ValueError(f"capacity must be one int or one per sequence ({s_count})")
        new_lens = [min(c, n) for c, n in zip(caps * s_count if len(caps) == 1 else caps, lens)]
    out_map = None
    if target_map is None:
        if scores is not None:
            _arrays.check_array(scores, "scores")
            heads = _shapes.score_heads(tuple(scores.shape), geo.heads,
                                       per_head if geo.heads is not None else False)
            device = scores.device
        else:
            heads = active[0].shape[0] if active and active[0].dim() == 2 else None
            device = pools[0].device
        n = max(lens) if lens else 0
        shape = (s_count, heads, n) if heads is not None else (s_count, n)
        out_map = torch.empty(shape, dtype=torch.int32, device=device)
    torch.ops.idempotent_moe.compact_paged_(
        pools, block_tables, lens, caps, scores, active or [], active is not None, target_map,
        _str(layout, "layout"), per_head, _str(head_reduce, "head_reduce"),
        _int(protected_prefix, "protected_prefix"), _int(recent_window, "recent_window"),
        _str(mode, "mode"), _str(nan, "nan"), _opt_int(num_threads, "num_threads"), out_map)
    size = geo.block_size
    freed = [block_tables[s, -(-new // size):-(-old // size)].clone()
             for s, (new, old) in enumerate(zip(new_lens, lens))]
    return _paged.PagedCompaction(new_lens, freed, out_map if target_map is None else target_map)
