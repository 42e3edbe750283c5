"""Bad input to the maps (compact_moe_tokens_inplace, apply_map_), restore_,
the original API (InplaceMoERouter, compact_kv_cache_inplace,
InplaceKVCompactor), values that would be truncated, and sizes checked
before anything is allocated: the right exception type, a message that
names the argument at fault, and every array exactly as it was. The cases
of compact_ itself: test_bad_inputs_compact.py."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import make_data, make_scores, to_framework, torch
from _helpers.bad_inputs import BadCases, C, N, run_case, setup

CASES = BadCases()
bad = CASES.bad


# --------------------------------------------------------------------------- maps


def _moe(fw, rng):
    return make_data((2, 6, 3), "float16", fw, rng)


def map_call(tokens, target_map):
    def call():
        imoe.compact_moe_tokens_inplace(tokens, target_map)

    return call, [tokens, target_map]


@bad(ValueError, "target_map", "(?i:involution|map)")
def target_map_not_an_involution(fw, rng):
    tm = np.tile(np.arange(6, dtype=np.int32), (2, 1))
    tm[1, [0, 1, 2]] = [1, 2, 0]  # a 3-cycle
    return map_call(_moe(fw, rng), to_framework(tm, fw))


@bad(ValueError, "target_map")
def target_map_out_of_range(fw, rng):
    tm = np.tile(np.arange(6, dtype=np.int32), (2, 1))
    tm[1, 5] = 6
    return map_call(_moe(fw, rng), to_framework(tm, fw))


@bad(ValueError, "target_map")
def target_map_negative(fw, rng):
    tm = np.tile(np.arange(6, dtype=np.int32), (2, 1))
    tm[0, 0] = -1
    return map_call(_moe(fw, rng), to_framework(tm, fw))


@bad(ValueError, "target_map")
def target_map_wrong_shape(fw, rng):
    return map_call(_moe(fw, rng), to_framework(np.tile(np.arange(5, dtype=np.int32), (2, 1)), fw))


@bad(TypeError, "target_map")
def target_map_float(fw, rng):
    return map_call(_moe(fw, rng), to_framework(np.tile(np.arange(6.0), (2, 1)), fw))


def restore_call(fw, rng, indices):
    x = make_data((2, 8, 3), "int8", fw, rng)
    idx = to_framework(np.asarray(indices, dtype=np.int64), fw)

    def call():
        imoe.restore_(x, idx)

    return call, [x, idx]


@bad(ValueError, r"\bindices\b", "(?i:duplicate|twice|repeat|distinct)")
def restore_duplicate_tail(fw, rng):
    return restore_call(fw, rng, [[0, 1, 2], [5, 5, 2]])


@bad(ValueError, r"\bindices\b")
def restore_moved_entry_below_capacity(fw, rng):
    return restore_call(fw, rng, [[0, 1, 2], [0, 2, 1]])


@bad(ValueError, r"\bindices\b")
def restore_index_out_of_range(fw, rng):
    return restore_call(fw, rng, [[0, 8, 2], [0, 1, 2]])


@bad(ValueError, r"\bindices\b")
def restore_negative_index(fw, rng):
    return restore_call(fw, rng, [[0, 1, 2], [-1, 1, 2]])


@bad(TypeError, r"\bindices\b")
def restore_float_indices(fw, rng):
    x = make_data((2, 8, 3), "int8", fw, rng)
    idx = to_framework(np.array([[0, 1, 2], [0, 1, 2]], dtype=np.float32), fw)
    return (lambda: imoe.restore_(x, idx)), [x, idx]


@bad(ValueError, r"\bindices\b", "mode='move'")
def restore_indices_of_a_move_compaction(fw, rng):
    """A move overwrote the dropped tokens: its indices cannot undo it."""
    x, s, _ = setup(fw, rng)
    idx = imoe.compact_(x, s, C, mode="move").indices
    return (lambda: imoe.restore_(x, idx)), [x, idx]


@bad(ValueError, r"\bindices\b")
def apply_map_indices_wrong_lead_shape(fw, rng):
    x = make_data((2, 8, 3), "int8", fw, rng)
    idx = to_framework(np.array([[0, 1, 7]] * 3, dtype=np.int64), fw)
    return (lambda: imoe.apply_map_(x, idx, dim=1)), [x, idx]


@bad(ValueError, r"\bindices\b", "target_map")
def apply_map_with_both_maps(fw, rng):
    x = make_data((2, 8, 3), "int8", fw, rng)
    idx = to_framework(np.array([[0, 1, 2]] * 2, dtype=np.int64), fw)
    tm = to_framework(np.tile(np.arange(8, dtype=np.int32), (2, 1)), fw)
    return (lambda: imoe.apply_map_(x, idx, target_map=tm)), [x, idx, tm]


# --------------------------------------------------------------------------- original API


@bad(ValueError, "(tokens|hidden_dim)")
def router_wrong_hidden_size(fw, rng):
    tokens = make_data((4, 10, 6), "float32", fw, rng)
    scores = make_scores((4, 10), "float32", fw, rng)
    router = imoe.InplaceMoERouter(hidden_dim=8, num_experts=4)
    return (lambda: router(tokens, scores, expert_capacity=3)), [tokens, scores]


@bad(ValueError, "(tokens|num_experts)")
def router_wrong_expert_count(fw, rng):
    tokens = make_data((4, 10, 6), "float32", fw, rng)
    scores = make_scores((4, 10), "float32", fw, rng)
    router = imoe.InplaceMoERouter(hidden_dim=6, num_experts=3)
    return (lambda: router(tokens, scores, expert_capacity=3)), [tokens, scores]


@bad(ValueError, "hidden_dim", frameworks=("numpy",))
def router_zero_hidden_dim(fw, rng):
    return (lambda: imoe.InplaceMoERouter(hidden_dim=0, num_experts=3)), []


@bad(ValueError, "value_cache")
def kv_cache_shapes_differ(fw, rng):
    k = make_data((1, 2, 16, 8), "float16", fw, rng)
    v = make_data((1, 2, 15, 8), "float16", fw, rng)
    s = make_scores((1, 2, 16), "float32", fw, rng)
    return (lambda: imoe.compact_kv_cache_inplace(k, v, s, 8)), [k, v, s]


@bad(ValueError, "key_cache")
def kv_cache_not_4d(fw, rng):
    k = make_data((2, 16, 8), "float16", fw, rng)
    v = make_data((2, 16, 8), "float16", fw, rng)
    s = make_scores((2, 16), "float32", fw, rng)
    return (lambda: imoe.compact_kv_cache_inplace(k, v, s, 8)), [k, v, s]


@bad(ValueError, "capacity")
def kv_map_capacity_differs_from_active_count(fw, rng):
    active = to_framework(np.array([0, 1, 5], dtype=np.int64), fw)
    compactor = imoe.InplaceKVCompactor()
    return (lambda: compactor.build_idempotent_map(1, 2, 16, active, capacity=4)), [active]


@bad(ValueError, "(protected_prefix|recent_window)")
def kv_sinks_above_capacity(fw, rng):
    k = make_data((1, 2, 16, 8), "float16", fw, rng)
    v = make_data((1, 2, 16, 8), "float16", fw, rng)
    s = make_scores((1, 2, 16), "float32", fw, rng)
    compactor = imoe.InplaceKVCompactor()
    return (lambda: compactor.compact_from_scores(k, v, s, 3, protected_prefix_len=4)), [k, v, s]


# ------------------------------------------------------- values that would be truncated


@bad(TypeError, "active_indices", "ints")
def float_active_indices_list(fw, rng):
    """A list of floats used to become int64 silently (1.5 -> 1)."""
    x, _, out = setup(fw, rng)
    return (lambda: imoe.compact_(x, active_indices=[0.5, 2.0, 7.25, 9.0, 11.0], dim=1,
                                  out_indices=out)), [x, out]


@bad(TypeError, "capacity", frameworks=("numpy",))
def float_capacity_of_the_vllm_hook(fw, rng):
    from idempotent_moe.integrations import VLLMInplaceCompactionHook

    x, _, _ = setup(fw, rng)
    return (lambda: VLLMInplaceCompactionHook(capacity=3.5)), [x]


@bad(TypeError, "recent_window", frameworks=("numpy",))
def float_recent_window_of_the_vllm_hook(fw, rng):
    """A float window used to pass the hook and reach the compaction."""
    from idempotent_moe.integrations import VLLMInplaceCompactionHook

    x, _, _ = setup(fw, rng)
    return (lambda: VLLMInplaceCompactionHook(capacity=8, recent_window=2.0)), [x]


@bad(ValueError, "protected_prefix_len must be >= 0", frameworks=("numpy",))
def negative_prefix_of_the_vllm_hook(fw, rng):
    from idempotent_moe.integrations import VLLMInplaceCompactionHook

    x, _, _ = setup(fw, rng)
    return (lambda: VLLMInplaceCompactionHook(capacity=8, protected_prefix_len=-1)), [x]


@bad(BufferError, "buffers", frameworks=("torch",))
def meta_tensor_without_a_cpp_stack_trace(fw, rng):
    """The producer's message comes through on one line."""
    x, _, _ = setup(fw, rng)

    def call():
        try:
            imoe.compact_(torch.empty(3, N, 4, device="meta"), torch.empty(3, N, device="meta"), C)
        except BufferError as e:
            assert "\n" not in str(e) and "Exception raised from" not in str(e), str(e)
            raise

    return call, [x]


# ------------------------------------------------------- sizes checked before allocating


@bad(ValueError, "num_experts", "2147483647")
def giant_num_experts(fw, rng):
    """out_offsets [E] was allocated before the core saw E: a MemoryError
    (NumPy) or the allocator's RuntimeError (torch) instead of this message."""
    x = make_data((16, 4), "float32", fw, rng)
    ids = to_framework(rng.integers(0, 4, size=16), fw)
    return (lambda: imoe.group_by_expert_(x, ids, num_experts=2**40)), [x, ids]


@bad(ValueError, "num_experts", "2147483647")
def num_experts_at_the_limit(fw, rng):
    x = make_data((16, 4), "float32", fw, rng)
    ids = to_framework(rng.integers(0, 4, size=16), fw)
    return (lambda: imoe.group_by_expert_(x, ids, num_experts=2**31 - 1)), [x, ids]


# --------------------------------------------------------------------------- the test


@pytest.mark.parametrize("build,framework,exc,match", CASES.params)
def test_bad_input(build, framework, exc, match, rng):
    run_case(build, framework, exc, match, rng)
