"""Attention scores per KV head, for grouped-query attention: what the
contiguous KV caches (`kv`) and the paged ones (`paged`, `_paged`) both
read. `reduce_head_scores` is public through `kv` (and the package)."""

from __future__ import annotations

from typing import Any

from . import _arrays

HEAD_REDUCTIONS = ("mean", "max")


def _namespace(x: Any) -> str:
    if _arrays.is_torch(x):
        return "torch"
    if hasattr(x, "__array_namespace__") and not _is_numpy(x):
        return "array_api"
    return "numpy"


def _is_numpy(x: Any) -> bool:
    import numpy as np

    return isinstance(x, np.ndarray)


def reduce_head_scores(scores: Any, kv_heads: int, head_reduce: str = "mean") -> Any:
    """Scores with one row per KV head, [B, kv_heads, S], from scores given
    per KV head (returned as they are), per query head [B, G x kv_heads, S]
    (the G query heads of each group, consecutive as in `repeat_kv`, reduced
    by `head_reduce`: "mean" or "max", computed in float32), or once per
    sequence [B, S] / [B, 1, S] (broadcast to every head: a view, no copy).
    Allocates only the reduced [B, kv_heads, S] float32 array when it reduces."""
    torch = _arrays.torch_module()
    if (torch is not None and type(scores) is torch.Tensor and type(kv_heads) is int and kv_heads >= 1
            and scores.dim() == 3 and scores.shape[1] == kv_heads and head_reduce in HEAD_REDUCTIONS):
        return scores  # one row per KV head already: the common call, checked in a few lines
    _arrays.check_array(scores, "attention_scores")
    kv_heads = _arrays.check_int(kv_heads, "kv_heads", minimum=1)
    if head_reduce not in HEAD_REDUCTIONS:
        raise ValueError(f"head_reduce must be one of {HEAD_REDUCTIONS}, got {head_reduce!r}")
    shape = _arrays.shape_of(scores)
    if len(shape) == 2:
        scores, shape = _unsqueeze_heads(scores), (shape[0], 1, shape[1])
    if len(shape) != 3:
        raise ValueError(
            f"attention_scores must be [batch, heads, seq] or [batch, seq], got {list(shape)}"
        )
    b, h, s = shape
    if h == kv_heads:
        return scores
    if h == 1:
        return _broadcast_heads(scores, (b, kv_heads, s))
    if h % kv_heads:
        raise ValueError(
            f"attention_scores has {h} heads: give one per KV head ({kv_heads}), one per query "
            f"head (a multiple of {kv_heads}), or one for all heads"
        )
    group = h // kv_heads
    kind = _namespace(scores)
    if kind == "torch":
        grouped = scores.float().reshape(b, kv_heads, group, s)
        return grouped.mean(2) if head_reduce == "mean" else grouped.amax(2)
    if kind == "numpy":
        import numpy as np

        grouped = np.asarray(scores, dtype=np.float32).reshape(b, kv_heads, group, s)
        return grouped.mean(2) if head_reduce == "mean" else grouped.max(2)
    xp = scores.__array_namespace__()
    grouped = xp.reshape(xp.astype(scores, xp.float32), (b, kv_heads, group, s))
    return xp.mean(grouped, axis=2) if head_reduce == "mean" else xp.max(grouped, axis=2)


def _unsqueeze_heads(scores: Any) -> Any:
    if _arrays.is_torch(scores):
        return scores.unsqueeze(1)
    if _namespace(scores) == "array_api":
        return scores.__array_namespace__().expand_dims(scores, axis=1)
    return scores[:, None, :]


def _broadcast_heads(scores: Any, shape: tuple) -> Any:
    if _arrays.is_torch(scores):
        return scores.expand(*shape)
    if _namespace(scores) == "array_api":
        return scores.__array_namespace__().broadcast_to(scores, shape)
    import numpy as np

    return np.broadcast_to(scores, shape)
