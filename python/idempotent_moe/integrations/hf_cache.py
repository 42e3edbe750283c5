"""A Hugging Face transformers (5.x) cache that evicts in place.

`InplaceEvictionCache(budget, ...)` is a `transformers.Cache` for
`model.generate(..., cache=cache)` (`past_key_values=cache` before
transformers 5.24, which renamed the argument). Each full-attention layer keeps
its keys and values in one preallocated buffer per layer,
[batch, kv_heads, slots, head_dim], with a valid length: new tokens are
written into the next free slots (no `torch.cat` per step), and an eviction
compacts the buffer in place with `compact_` (K, V, the logical positions
and, for attention scores, the accumulated scores, moved by one map), so the
freed slots are reused by the tokens that follow and no step copies the
whole cache.

When evictions happen (each at the start of the layer's next update, once
the forward that needed the tokens has used them):
  - after prefill, when the prompt left more than `budget` tokens;
  - with `evict_every=N`, every N decode steps, down to `budget` again. The
    buffer then holds budget + N slots and never grows.
Each eviction keeps, per KV head (or per sequence with per_head=False), the
first `sink_tokens` and the last `recent_window` logical positions plus the
best-scoring others, `budget` in all. Scores: "auto" (the default, where
`cache.attach(model)` hooks eager attention: the mean attention each token
received times its value's L1 norm (ObservedAttention(value_norm=1), VATP),
with the newest eighth of the budget kept when a prompt is compressed, and a
quarter of it given to the tokens the prompt's last 8 queries (its question)
attend to most, and the newest quarter while decoding; the window otherwise;
the cache records the last 8 queries for it), any policy of
`kv_policies` by name or instance (a user's `ScoringPolicy` included: the
cache keeps the running statistics it names, attention totals and the
observation window's queries, in place), "key_norm", "attention" (H2O's
unnormalised sum), or a callable `score(keys, values, positions, layer_idx)
-> [B, H, L]` (also [B, Hq, L] per query head, reduced by `head_reduce`, or
[B, L]); higher is kept.
A prompt is compressed layer by layer as each layer's forward ends
(`prefill_eviction="layer"`).

Positions stay logical: keys were cached with RoPE already applied, and
`get_seq_length()` reports every token seen, so position ids of new tokens
keep counting from the true length; `get_mask_sizes` reports the buffer's
length with an offset, as transformers' own sliding-window layers do.
A prompt longer than the steady buffer is held in the prompt's own K and V
tensors (no copy) until its eviction; the kept tokens then move once into the
steady buffer and the prompt-sized tensors are freed: memory falls to
`slots` per layer. Batches must not be padded (the padding mask cannot
follow tokens that moved); one sequence, or prompts of equal length. A
padded batch is refused (ValueError, before anything is written) where
transformers hands the position ids to the cache (5.24 on): `generate()`
derives them from the attention mask, so a padded row does not count on
from the tokens the cache has seen.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    get_layer_types_and_kwargs,
)

from .._arrays import check_int
from ..functional import compact_
from ..kv import reduce_head_scores
from ..kv_policies import POLICIES, Observation, ScoringPolicy
from ._eviction_policy import (
    AUTO_QUESTION,
    AUTO_RECENT_DECODE,
    AUTO_RECENT_PROMPT,
    AUTO_SCORER,
    AUTO_WINDOW,
    NAMED_POLICIES,
    PREFILL_EVICTIONS,
    SCORES,
    EvictionPolicy,
    check_score,
)

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _position_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The position ids of the tokens being cached, where transformers passes
    them to `Cache.update` (5.24 on: the attention's keyword arguments, as
    `kwargs={"position_ids": ...}`); None where it does not."""
    for where in (kwargs, kwargs.get("kwargs"), *args):
        if isinstance(where, dict) and isinstance(where.get("position_ids"), torch.Tensor):
            return where["position_ids"]
    return None


class InplaceEvictionLayer(CacheLayerMixin):
    """One full-attention layer: a buffer [B, H, slots, D] for K and for V,
    the logical position of each slot [B, H, slots] int32, and for attention
    scores the accumulated attention [B, H, slots] float32. `keys` and
    `values` are views of the valid slots [B, H, length, D]."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, policy: EvictionPolicy, layer_idx: int | None = None):
        super().__init__()
        self.policy = policy
        self.layer_idx = layer_idx
        self.length = 0       # valid slots
        self.seen = 0         # tokens seen: the logical length
        self.evictions = 0    # evictions done
        self.evicted = 0      # tokens evicted, in all
        self._k = self._v = self._pos = self._acc = None
        # Positions are written when read (_written_positions): slots
        # [_pos_upto, length) hold consecutive logical positions from
        # seen - (length - _pos_upto), unwritten and alike in every batch row
        # (a beam reorder or repeat moves nothing of them), so a decode step
        # writes K and V alone.
        self._pos_upto = 0
        self._adopted = False  # the buffers are a prompt's own K and V tensors
        self._pending = False  # evict at the start of the next update
        self._since = 0        # decode tokens since the last eviction or prefill
        self._last_forward = 0  # tokens of the last forward cached (1: a decode step)
        self._attention_hooked = False
        # The observation window: the last queries seen [B, Hq, w, D] (RoPE
        # applied), oldest first, `_q_len` of them valid; queries of a forward
        # are staged by the attention's pre-hook and join the window when the
        # layer's update has done any eviction that was due before them.
        self._q = None
        self._q_len = 0
        self._q_staged = None
        self._scaling = None
        self._pending_prefill = False  # the pending eviction follows a prefill
        self._attached = False  # the cache's attach(model) hooks feed this layer

    def __repr__(self) -> str:
        return (f"InplaceEvictionLayer(layer_idx={self.layer_idx}, length={self.length}, "
                f"seen={self.seen}, slots={self.slots})")

    # ---- buffers

    @property
    def slots(self) -> int:
        """Slots the layer's buffers hold now (0 before the first update)."""
        return 0 if self._k is None else self._k.shape[2]

    @property
    def positions(self) -> torch.Tensor | None:
        """Logical position of each valid slot, [B, H, length] int32."""
        return None if self._pos is None else self._written_positions()[:, :, : self.length]

    def _written_positions(self) -> torch.Tensor:
        """The position buffer with every valid slot's position written."""
        lo, n = self._pos_upto, self.length
        if lo < n:
            self._pos[:, :, lo:n].copy_(self._positions_for(self._pos, self.seen - (n - lo), n - lo))
            self._pos_upto = n
        return self._pos

    def buffer_bytes(self) -> int:
        """Bytes held by this layer's buffers."""
        return sum(t.numel() * t.element_size()
                   for t in (self._k, self._v, self._pos, self._acc, self._q) if t is not None)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _wants_acc(self) -> bool:
        # "auto" reads attention totals only where the cache is attached
        return "attention" in self.policy.needs and (self.policy.score != "auto" or self._attached)

    def _new_buffers(self, like_k: torch.Tensor, like_v: torch.Tensor, slots: int) -> tuple:
        b, h = like_k.shape[:2]
        k = like_k.new_empty((b, h, slots, like_k.shape[-1]))
        v = like_v.new_empty((b, h, slots, like_v.shape[-1]))
        pos = torch.empty((b, h, slots), dtype=torch.int32, device=like_k.device)
        acc = (torch.zeros((b, h, slots), dtype=torch.float32, device=like_k.device)
               if self._wants_acc() else None)
        return k, v, pos, acc

    def _move_into(self, slots: int) -> None:
        """New buffers of `slots` slots, holding the valid ones: a copy of
        `length` slots, done when a prompt's tensors are replaced by the
        steady buffer after its eviction, or when a buffer must grow."""
        k, v, pos, acc = self._new_buffers(self._k, self._v, slots)
        n = self.length
        k[:, :, :n].copy_(self._k[:, :, :n])
        v[:, :, :n].copy_(self._v[:, :, :n])
        pos[:, :, :n].copy_(self._written_positions()[:, :, :n])
        if acc is not None:
            acc[:, :, :n].copy_(self._acc[:, :, :n])
        self._k, self._v, self._pos, self._acc = k, v, pos, acc
        self._adopted = False

    def _positions_for(self, like: torch.Tensor, start: int, count: int) -> torch.Tensor:
        b, h = like.shape[:2]
        return torch.arange(start, start + count, dtype=torch.int32,
                            device=like.device).expand(b, h, count)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        q = key_states.shape[-2]
        if self.length == 0 and q > self.policy.slots:
            # A prompt longer than the steady buffer: hold it in its own tensors
            # (nothing is copied) until its eviction.
            self._k, self._v = key_states, value_states
            self._pos = self._positions_for(key_states, self.seen, q).contiguous()
            self._pos_upto = q
            self._acc = (torch.zeros(key_states.shape[:3], dtype=torch.float32,
                                     device=key_states.device) if self._wants_acc() else None)
            self._adopted = True
            self.length = q
            return
        need = self.length + q
        if self._k is None:
            self._k, self._v, self._pos, self._acc = self._new_buffers(
                key_states, value_states, max(self.policy.slots, need))
        elif need > self.slots:
            # Only without evict_every (or for a chunk longer than it): grow
            # geometrically, never per step.
            self._move_into(max(need, 2 * self.slots, self.policy.slots))
        lo = self.length
        self._k[:, :, lo:need].copy_(key_states)
        self._v[:, :, lo:need].copy_(value_states)
        if self._acc is not None:
            self._acc[:, :, lo:need].zero_()
        self.length = need

    def _publish(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    # ---- the CacheLayerMixin interface

    def _check_positions(self, position_ids: torch.Tensor | None, q: int) -> None:
        """Refuse tokens whose position ids do not count on from the tokens
        seen: a padded batch (generate() numbers each row from its first
        unmasked token), whose padding mask could not follow the tokens an
        eviction moves. Checked when a prompt or chunk arrives (q > 1) or the
        layer is empty: a decode step would pay a host synchronisation."""
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != q:
            return
        if q == 1 and self.seen > 0:
            return
        expected = torch.arange(self.seen, self.seen + q, device=position_ids.device)
        wrong = (position_ids != expected).any(dim=-1)
        if bool(wrong.any()):
            row = int(wrong.nonzero()[0, 0])
            raise ValueError(
                "InplaceEvictionCache does not support padded batches (an attention mask with "
                f"padding): the position ids of row {row} ({position_ids[row, :4].tolist()}...) do "
                f"not count on from the {self.seen} tokens the cache has seen, and a padding mask "
                "cannot follow the tokens an eviction moves. Generate one sequence at a time, or "
                "prompts of equal length without padding.")

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """What the buffers take, judged before anything is written: torch
        tensors (TypeError), K and V [B, H, q, D] of one B, H and q on one
        device (ValueError); once the layer holds buffers, their B, H, head
        sizes and device (ValueError) and dtypes (TypeError): a copy into
        them would broadcast or cast silently."""
        if not (isinstance(key_states, torch.Tensor) and isinstance(value_states, torch.Tensor)):
            bad, name = (key_states, "key_states") if not isinstance(key_states, torch.Tensor) \
                else (value_states, "value_states")
            raise TypeError(f"{name} must be a torch.Tensor, got {type(bad).__name__}")
        ks, vs = key_states.shape, value_states.shape
        if len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3] or key_states.device != value_states.device:
            raise ValueError(f"key_states and value_states must be [B, H, q, D] of one B, H and q on one "
                             f"device, got {list(ks)} on {key_states.device} and {list(vs)} on "
                             f"{value_states.device}")
        k = self._k
        if k is None:
            return
        if ks[:2] != k.shape[:2] or ks[3] != k.shape[3] or vs[3] != self._v.shape[3] \
                or key_states.device != k.device:
            raise ValueError(f"layer {self.layer_idx} holds keys {list(k.shape[:2])} x D = {k.shape[3]} "
                             f"and values of D = {self._v.shape[3]} on {k.device}; got key_states {list(ks)} "
                             f"and value_states {list(vs)} on {key_states.device}")
        if key_states.dtype != k.dtype or value_states.dtype != self._v.dtype:
            raise TypeError(f"layer {self.layer_idx} holds {k.dtype} keys and {self._v.dtype} values; got "
                            f"{key_states.dtype} and {value_states.dtype}")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """Evict if an eviction is due, write the new tokens into the next free
        slots, and return views of the valid slots [B, H, length, D]. Refuses
        (ValueError, nothing written) tokens whose position ids, where
        transformers passes them, do not follow the tokens seen: a padded batch;
        and states the buffers cannot take (_check_states)."""
        self._judge(key_states, value_states, args, kwargs)
        return self._update(key_states, value_states)

    def _judge(self, key_states: torch.Tensor, value_states: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """update's checks, before anything is written or evicted."""
        self._check_states(key_states, value_states)
        self._check_positions(_position_ids(args, kwargs), key_states.shape[-2])

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """update of states _judge has taken."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending:
            self.evict()
        self._commit_queries()
        q = key_states.shape[-2]
        self._append(key_states, value_states)
        self.seen += q
        budget, every = self.policy.budget, self.policy.evict_every
        self._last_forward = q
        if q > 1:  # prefill, or a prefill chunk
            self._since = 0
            self._pending = self._pending_prefill = self.length > budget
        else:
            self._since += 1
            self._pending = every is not None and self._since >= every and self.length > budget
            self._pending_prefill = False
        self._publish()
        return self.keys, self.values

    def _length_after_pending(self) -> int:
        return min(self.length, self.policy.budget) if self._pending else self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the valid slots after any pending eviction
        plus the query, placed so that the query's logical positions follow
        every cached token."""
        kv_length = self._length_after_pending() + query_length
        return kv_length, self.seen + query_length - kv_length

    def get_seq_length(self) -> int:
        """Tokens seen (the logical length), not the slots held."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = self.seen = self._since = self._pos_upto = self._last_forward = 0
        self._pending = self._pending_prefill = False
        self._q, self._q_len, self._q_staged = None, 0, None
        if self._adopted:
            self._k = self._v = self._pos = self._acc = None
            self._adopted = False
        if self._k is not None:
            self._publish()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self._k is None:
            return
        idx = beam_idx.to(self._k.device)  # unwritten positions are the same in every row: none to write
        for name in ("_k", "_v", "_pos", "_acc", "_q"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, idx))
        self._adopted = False
        self._publish()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is None:
            return
        for name in ("_k", "_v", "_pos", "_acc", "_q"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.repeat_interleave(repeats, dim=0))
        self._adopted = False
        self._publish()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "InplaceEvictionCache cannot crop: evicted tokens are gone (assisted generation "
            "needs a croppable cache)")

    # ---- eviction

    def observation(self, window: int | None = None) -> Observation:
        """What a kv_policies.ScoringPolicy reads of this layer now: views of
        the valid slots (keys, values, positions), the tokens seen, the last
        `window` queries of the observation window (all of them by default;
        None if none were recorded), the attention totals (None unless the
        policy needs them) and the attention's scale."""
        n = self.length
        queries = None
        if self._q is not None and self._q_len:
            w = self._q_len if window is None else min(window, self._q_len)
            queries = self._q[:, :, self._q.shape[2] - w:]
        acc = None if self._acc is None else self._acc[:, :, :n]
        return Observation(self._k[:, :, :n], self._v[:, :, :n], self._written_positions()[:, :, :n],
                           self.seen, queries, acc, self._scaling, self.layer_idx)

    def _scores(self, n: int, score: Any = None, budget: int | None = None) -> torch.Tensor:
        """Scores of the valid slots [B, H or 1, n], higher kept. Never a view
        of a buffer that the compaction moves."""
        heads = self._k.shape[1]
        score = self.policy.score if score is None else score
        if isinstance(score, str) and score in POLICIES:
            score = NAMED_POLICIES[score]
        if score == "auto":
            s = self._auto_scores(n, self.policy.budget if budget is None else budget)
        elif score == "key_norm":
            # Keys of small norm draw attention (Devoto et al., 2024): keep them.
            s = torch.linalg.vector_norm(self._k[:, :, :n], dim=-1).float().neg()
        elif score == "attention":
            if not self._attention_hooked:
                raise RuntimeError(
                    "score='attention' needs the attention weights: call cache.attach(model) "
                    "(with attn_implementation='eager') before generating")
            s = self._acc[:, :, :n].clone()
        elif isinstance(score, ScoringPolicy):
            if "attention" in score.needs and (self._acc is None or not self._attention_hooked):
                raise RuntimeError(
                    f"policy {score.name!r} needs the attention weights: call cache.attach(model) "
                    "with attn_implementation='eager' before generating")
            if "queries" in score.needs and not self._q_len:
                raise RuntimeError(
                    f"policy {score.name!r} needs the queries of the observation window: call "
                    "cache.attach(model) before generating")
            s = score.score(self.observation(score.window if "queries" in score.needs else None))
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"policy {score.name!r} returned {type(s).__name__}, not a tensor")
        else:
            s = score(self._k[:, :, :n], self._v[:, :, :n], self._written_positions()[:, :, :n],
                      self.layer_idx)
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"the score callable must return a torch.Tensor, got {type(s).__name__}")
        s = reduce_head_scores(s, heads, self.policy.head_reduce)
        if not self.policy.per_head and s.shape[1] > 1:
            s = s.float().mean(1, keepdim=True) if self.policy.head_reduce == "mean" \
                else s.float().amax(1, keepdim=True)
        return s

    def compressing_prompt(self) -> bool:
        """Whether an eviction now compresses a prompt: the last forward cached
        more tokens than `evict_every` (any number above one without it),
        rather than decode steps (EvictionPolicy.is_prompt)."""
        return self.policy.is_prompt(self._last_forward)

    def _auto_scores(self, n: int, budget: int) -> torch.Tensor:
        """score="auto": with the attention weights (attach(model), eager
        attention), ObservedAttention weighted by the values' L1 norm (VATP)
        with the newest budget // 8 tokens kept when a prompt is compressed
        and the newest budget // 4 while decoding; without them, the window
        (the newest tokens). When a prompt is compressed, the budget // 4
        tokens (besides the sinks and the newest) that the prompt's last
        AUTO_WINDOW queries attend to most, averaged over those queries and
        every query head of the layer (as TOVA's paper averages), are kept
        as well: the question at a prompt's end picks what it asks about,
        VATP the rest. Q1 in docs/kv.md measures each choice."""
        if self._acc is None or not self._attention_hooked:
            return self._written_positions()[:, :, :n].float()
        obs = self.observation(AUTO_WINDOW)
        pos, s = obs.positions, AUTO_SCORER.score(obs)
        if not self.compressing_prompt():
            return torch.where(pos >= self.seen - budget // AUTO_RECENT_DECODE, math.inf, s)
        recent = pos >= self.seen - budget // AUTO_RECENT_PROMPT
        k = min(budget // AUTO_QUESTION,
                budget - self.policy.sink_tokens - budget // AUTO_RECENT_PROMPT - self.policy.recent_window)
        if obs.queries is not None and k > 0:
            # [B, Hq, w, n] -> [B, n] (equal groups: the mean over KV heads of their groups' means)
            attn = obs.window_attention().mean(dim=(1, 2))
            attn = attn[:, None].expand_as(s).masked_fill(recent | (pos < self.policy.sink_tokens), -1.0)
            s = s.scatter(-1, attn.topk(k, dim=-1).indices, math.inf)
        return torch.where(recent, math.inf, s)

    def evict(self, budget: int | None = None, score: Any = None) -> int:
        """Compact the valid slots down to `budget` (the policy's by default)
        in place, scored by `score` (the policy's by default; another name,
        ScoringPolicy or callable scores this eviction only, from the
        statistics the layer keeps); returns the number of tokens evicted.
        A call that raises (a bad budget or score, scores of the wrong
        shape) changes nothing."""
        return self._compact(self._eviction(budget, score))

    def _eviction(self, budget: int | None, score: Any) -> tuple:
        """Everything an eviction needs, judged and scored, nothing changed:
        (budget, n, scores [B, H or 1, n] with the protected slots +inf), or
        (budget, n, None) when nothing is evicted."""
        budget = self.policy.budget if budget is None else check_int(budget, "budget", 0)
        if score is not None:
            check_score(score)
        if budget < self.policy.sink_tokens + self.policy.recent_window:
            raise ValueError(
                f"budget {budget} is below sink_tokens + recent_window "
                f"({self.policy.sink_tokens + self.policy.recent_window})")
        n = self.length
        if n <= budget:
            return budget, n, None
        pos = self._written_positions()[:, :, :n]
        keep = self.policy.sink_tokens
        protect = pos < keep
        if self.policy.recent_window:
            protect = protect | (pos >= self.seen - self.policy.recent_window)
        scores = self._scores(n, score, budget)
        if scores.dim() != 3 or scores.shape[0] != pos.shape[0] or scores.shape[-1] != n:
            raise ValueError(f"score gave scores {list(scores.shape)} for layer {self.layer_idx}; "
                             f"expected [{pos.shape[0]}, heads, {n}]")
        # A fresh [B, H, n] array: it aliases no buffer that moves.
        scores = torch.where(protect, math.inf, scores.float().clamp(max=_FLOAT32_MAX))
        return budget, n, scores

    def _compact(self, eviction: tuple) -> int:
        """The eviction `_eviction` judged: the compaction and the layer's
        state after it."""
        budget, n, scores = eviction
        self._pending = self._pending_prefill = False
        if scores is None:
            return 0
        pos = self._written_positions()[:, :, :n]
        buffers = [self._k[:, :, :n], self._v[:, :, :n], pos.unsqueeze(-1)]
        if self._acc is not None:
            buffers.append(self._acc[:, :, :n].unsqueeze(-1))
        compact_(buffers, scores, budget, dim=2, mode=self.policy.mode, order=self.policy.order,
                 index_dtype="int32")
        self.length = self._pos_upto = budget
        self.evictions += 1
        self.evicted += n - budget
        self._since = 0
        if self._adopted:
            self._move_into(max(self.policy.slots, budget))
        self._publish()
        return n - budget

    def stage_queries(self, queries: torch.Tensor, scaling: float | None = None) -> None:
        """Queries [B, Hq, T, D] (RoPE applied) of the tokens this layer is
        about to cache: they join the observation window at the layer's next
        update, after any eviction due before them."""
        self._q_staged = queries
        if scaling is not None:
            self._scaling = float(scaling)

    def _commit_queries(self) -> None:
        """Move the staged queries into the window buffer in place (the last
        `query_window` of them; older ones shift down)."""
        q = self._q_staged
        if q is None:
            return
        self._q_staged = None
        w = self.policy.query_window
        if self._q is None or self._q.shape[:2] != q.shape[:2] or self._q.shape[-1] != q.shape[-1]:
            self._q = q.new_zeros((q.shape[0], q.shape[1], w, q.shape[-1]))
            self._q_len = 0
        t = q.shape[2]
        if t >= w:
            self._q.copy_(q[:, :, t - w:])
        else:
            self._q[:, :, : w - t].copy_(self._q[:, :, t:].clone())
            self._q[:, :, w - t:].copy_(q)
        self._q_len = min(w, self._q_len + t)

    def accumulate_attention(self, attn_weights: torch.Tensor) -> None:
        """Add the attention each valid slot received, [B, Hq, q, length]
        summed over queries (query heads reduced to KV heads), to its score."""
        if self._acc is None:
            return
        n = attn_weights.shape[-1]
        if n != self.length:
            raise RuntimeError(
                f"attention weights over {n} keys, but layer {self.layer_idx} holds {self.length}")
        received = attn_weights.sum(dim=2, dtype=torch.float32)
        self._acc[:, :, :n] += reduce_head_scores(received, self._acc.shape[1], self.policy.head_reduce)


class InplaceEvictionCache(Cache):
    """A transformers 5.x Cache that evicts in place down to `budget` tokens
    per layer (and per KV head): after prefill, and with `evict_every=N`
    every N decode steps.

    cache = InplaceEvictionCache(budget=256, sink_tokens=4, recent_window=32,
                                 evict_every=64, config=model.config)
    out = model.generate(input_ids, cache=cache, max_new_tokens=512)

    One sequence, or prompts of equal length: a padded batch is refused
    (ValueError) where transformers passes the position ids to the cache.

    budget         tokens kept per layer after an eviction.
    sink_tokens    the first logical positions, always kept.
    recent_window  the last logical positions, always kept.
    evict_every    decode steps between evictions (None: only after prefill).
    score          "auto" (default): with attach(model) and eager attention,
                   the mean attention each token received times its value's
                   L1 norm (ObservedAttention(value_norm=1), VATP), with the
                   newest budget // 8 tokens kept when a prompt is compressed
                   (the last forward cached more than evict_every tokens),
                   with the budget // 4 tokens that the prompt's last 8
                   queries attend to most (its question), and budget // 4
                   while decoding; otherwise the window (sinks + the newest
                   tokens). Or a policy: a name of
                   kv_policies.POLICIES ("streaming_llm",
                   "knorm", "keydiff", "tova", "observed_attention",
                   "snapkv", "expected_attention"), a kv_policies.ScoringPolicy
                   (a user's policy: it names the statistics it needs), the
                   older "key_norm" and "attention" (H2O's unnormalised sum),
                   or a callable (keys, values, positions, layer_idx) -> scores.
                   Policies that need queries or attention need `attach(model)`
                   (attention: and attn_implementation="eager").
    head_reduce    "mean" or "max": how query-head scores become one per KV
                   head (grouped-query attention), and, with per_head=False,
                   how the KV heads' scores become one per sequence.
    per_head       one selection per KV head (True) or one per sequence.
    mode           "move" (default: dropped tokens are overwritten, half the
                   traffic) or "swap".
    order          the order of kept tokens: "inplace" (default); "stable"
                   (recency order) or "score", as compact_ (CPU and CUDA).
    max_cache_len  slots per layer buffer; default budget + evict_every, or
                   budget + 128 without evict_every (the buffer then grows
                   geometrically as decoding goes on).
    config         the model config: full-attention layers get this cache's
                   layers, sliding-window layers transformers' own.
    prefill_eviction  "layer" (default): a prompt is compressed layer by
                   layer, each layer as soon as its attention has run (with
                   attach(model), at the end of the layer's forward; without,
                   when the next layer caches its tokens), so the prefill
                   holds one or two full layers beside compressed ones;
                   "whole": every layer at its next update (the prefill then
                   holds the whole prompt in every layer).

    `peak_kv_bytes` is the most the evicting layers held at once, sampled
    after every prompt or chunk a layer cached and after each eviction.
    """

    def __init__(
        self,
        budget: int,
        *,
        sink_tokens: int = 4,
        recent_window: int = 0,
        evict_every: int | None = None,
        score: str | Callable = "auto",
        head_reduce: str = "mean",
        per_head: bool = True,
        mode: str = "move",
        order: str = "inplace",
        max_cache_len: int | None = None,
        config: Any = None,
        prefill_eviction: str = "layer",
    ):
        if max_cache_len is None:
            # The default's terms judged first: its sum must not hide them.
            check_int(budget, "budget", 1)
            if evict_every is not None:
                check_int(evict_every, "evict_every", 1)
            max_cache_len = budget + (128 if evict_every is None else evict_every)
        self.policy = EvictionPolicy(budget, sink_tokens, recent_window, evict_every, score,
                                     head_reduce, per_head, mode, order, max_cache_len,
                                     prefill_eviction)
        self.policy.check()
        if config is not None and not callable(getattr(config, "get_text_config", None)):
            raise TypeError(f"config must be a transformers PretrainedConfig, got {type(config).__name__}")
        self._hooks: list = []
        self._attached = False
        self._last_updated: InplaceEvictionLayer | None = None
        self.peak_kv_bytes = 0
        layers = []
        if config is not None:
            types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
            # transformers 5.24 returns one kwargs dict per layer, earlier versions one for all
            per_layer = kwargs if isinstance(kwargs, list) else [kwargs] * len(types)
            for i, (kind, layer_kwargs) in enumerate(zip(types, per_layer)):
                if kind == "full_attention":
                    layers.append(InplaceEvictionLayer(self.policy, i))
                else:
                    layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**layer_kwargs))
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        return f"InplaceEvictionCache(budget={self.policy.budget}, layers={len(self.layers)})"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple:
        check_int(layer_idx, "layer_idx", 0)
        fresh = []  # the layers made on first use: kept once the call is judged
        while len(self.layers) + len(fresh) <= layer_idx:
            fresh.append(InplaceEvictionLayer(self.policy, len(self.layers) + len(fresh)))
            fresh[-1]._attached = self._attached
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else fresh[-1]
        if isinstance(layer, InplaceEvictionLayer):
            # Judged before any layer is made, written or evicted.
            layer._judge(key_states, value_states, args, kwargs)
        elif layer_idx == 0:
            # A first layer of transformers' own (sliding window: GPT-OSS, Gemma) would
            # cache a padded batch before an evicting layer refuses it: check here, against
            # an evicting layer that has not seen this forward's tokens yet.
            evicting = self._evicting_layers()
            if evicting:
                evicting[0]._check_positions(_position_ids(args, kwargs), key_states.shape[-2])
        self.layers.extend(fresh)
        if not isinstance(layer, InplaceEvictionLayer):
            return layer.update(key_states, value_states, *args, **kwargs)
        prev = self._last_updated
        if (prev is not None and prev is not layer and prev._pending_prefill
                and self.policy.prefill_eviction == "layer" and not self._attached):
            # The previous layer's attention has run: its prompt can go now.
            prev.evict()
        out = layer._update(key_states, value_states)
        self._last_updated = layer
        if key_states.shape[-2] > 1:
            self._sample_peak()
        return out

    def _batch(self) -> int | None:
        """The batch size the evicting layers hold (None before any holds one)."""
        for layer in self._evicting_layers():
            if layer._k is not None:
                return layer._k.shape[0]
        return None

    def _check_batch_index(self, indices: Any, name: str) -> None:
        """A batch index every layer takes: a 1-d int32/int64 tensor (TypeError,
        ValueError), each in [0, B) (ValueError; read on CPU tensors only: on a
        GPU it would synchronise). Judged once, before any layer is changed."""
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
            kind = indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__
            raise TypeError(f"{name} must be an int32 or int64 torch.Tensor, got {kind}")
        if indices.dim() != 1:
            raise ValueError(f"{name} must be 1-d, got {list(indices.shape)}")
        batch = self._batch()
        if batch is not None and indices.numel() and indices.device.type == "cpu":
            lo, hi = int(indices.min()), int(indices.max())
            if lo < 0 or hi >= batch:
                raise ValueError(f"{name} must lie in [0, batch = {batch}), got [{lo}, {hi}]")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Every layer's rows in the order of `beam_idx` (beam search); judged
        first (_check_batch_index): a call that raises changes no layer."""
        self._check_batch_index(beam_idx, "beam_idx")
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._check_batch_index(indices, "indices")
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        check_int(repeats, "repeats", 1)
        super().batch_repeat_interleave(repeats)

    def _sample_peak(self) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.buffer_bytes())

    def _evicting_layers(self) -> list:
        return [layer for layer in self.layers if isinstance(layer, InplaceEvictionLayer)]

    def evict(self, budget: int | None = None, score: Any = None) -> int:
        """Evict every layer now, down to `budget` (the policy's by default),
        scored by `score` (the policy's by default, or any policy the kept
        statistics serve: see InplaceEvictionLayer.evict); returns the tokens
        evicted in all."""
        layers = self._evicting_layers()
        # Every layer judged and scored before any is compacted: a call that
        # raises changes no layer.
        evictions = [layer._eviction(budget, score) for layer in layers]
        evicted = sum(layer._compact(e) for layer, e in zip(layers, evictions))
        self._sample_peak()
        return evicted

    def buffer_bytes(self) -> int:
        """Bytes held by the evicting layers' buffers."""
        return sum(layer.buffer_bytes() for layer in self._evicting_layers())

    def attach(self, model: torch.nn.Module) -> InplaceEvictionCache:
        """Hook the attention modules of `model` (those with `layer_idx` and
        `num_key_value_groups`, as in Llama, Mistral, Qwen, Mixtral): policies
        that need attention accumulate the eager attention weights, policies
        that need queries record the last queries (recomputed from the
        module's q_proj, q_norm where it has one, and the rotary embedding
        for the window's tokens only), and a prompt is compressed at the end
        of each layer's forward. Returns self."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        wants_queries = "queries" in self.policy.needs
        # Every module judged before any hook is changed: a call that raises
        # leaves the cache attached as it was.
        modules = [m for m in model.modules()
                   if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "num_key_value_groups")]
        if not modules:
            raise ValueError("found no attention module with layer_idx in the model")
        if wants_queries and self.policy.score != "auto":  # "auto" does without queries
            for module in modules:
                if not hasattr(module, "q_proj"):
                    raise ValueError(f"policy needs queries, but {type(module).__name__} has no q_proj")
        self.detach()
        for module in modules:
            if wants_queries and hasattr(module, "q_proj"):
                self._hooks.append(module.register_forward_pre_hook(self._query_hook, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._attention_hook, with_kwargs=True))
        self._attached = True
        for layer in self._evicting_layers():
            layer._attached = True
        return self

    def detach(self) -> None:
        """Remove the hooks that attach() registered."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._attached = False
        for layer in self._evicting_layers():
            layer._attached = False

    def _is_mine(self, kwargs: dict) -> bool:
        """Whether the attention's forward caches into this cache (hooks stay
        on the model: a forward with another cache must not touch this one)."""
        for name in ("cache", "past_key_values", "past_key_value"):
            if kwargs.get(name) is not None:
                return kwargs[name] is self
        return False

    def _query_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._is_mine(kwargs):
            return
        idx = module.layer_idx
        if idx >= len(self.layers) or not isinstance(self.layers[idx], InplaceEvictionLayer):
            if idx < len(self.layers) or not self.policy.query_window:
                return
            while len(self.layers) <= idx:  # layers made on first use (no config)
                self.layers.append(InplaceEvictionLayer(self.policy, len(self.layers)))
                self.layers[-1]._attached = True
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if self.policy.score == "auto" and not self.policy.is_prompt(hidden.shape[1]):
            return  # a decode step: "auto" reads the queries only when it compresses a prompt
        w = self.policy.query_window
        h = hidden[:, -w:]
        head_dim = getattr(module, "head_dim", None) or module.q_proj.out_features // (
            module.config.num_attention_heads)
        q = module.q_proj(h).view(*h.shape[:2], -1, head_dim)
        if getattr(module, "q_norm", None) is not None:
            q = module.q_norm(q)
        q = q.transpose(1, 2)
        rope = kwargs.get("position_embeddings")
        if rope is None and len(args) > 1 and isinstance(args[1], tuple):
            rope = args[1]
        if rope is not None:
            cos, sin = (t[:, -w:].unsqueeze(1) for t in rope)
            q = q * cos + _rotate_half(q) * sin
        self.layers[idx].stage_queries(q.detach(), getattr(module, "scaling", None))

    def _attention_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._is_mine(kwargs):
            return
        idx = module.layer_idx
        if idx >= len(self.layers) or not isinstance(self.layers[idx], InplaceEvictionLayer):
            return
        layer = self.layers[idx]
        if layer._acc is not None:
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None and self.policy.score == "auto":
                pass  # no eager weights: "auto" keeps the window
            elif weights is None:
                raise RuntimeError(
                    "this policy needs attention weights, which only eager attention returns: "
                    "load the model with attn_implementation='eager'")
            else:
                layer._attention_hooked = True
                layer.accumulate_attention(weights)
        if layer._pending_prefill and self.policy.prefill_eviction == "layer":
            layer.evict()  # the layer's forward is done: compress its prompt now
            self._sample_peak()


# EvictionPolicy and the scores it takes live in _eviction_policy.py; the
# cache's module is where users find them.
__all__ = ["PREFILL_EVICTIONS", "SCORES", "EvictionPolicy", "InplaceEvictionCache", "InplaceEvictionLayer"]
