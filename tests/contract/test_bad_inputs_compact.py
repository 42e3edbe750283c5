"""Bad input to compact_ (and idempotent_map): the right exception type, a
message that names the argument at fault, and every buffer, score array and
output exactly as it was: scores, capacity and options, outputs, active
indices, buffers; the failing row named whatever the threads. Each case is a
builder `(framework, rng) -> (call, arrays)`: `call` must raise, `arrays`
are snapshotted before and compared bit for bit after. Maps, restore_, the
original API and sizes: test_bad_inputs_maps.py."""

from __future__ import annotations

import re

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import (
    assert_unchanged,
    make_data,
    make_scores,
    requires_torch,
    snapshot,
    to_framework,
    torch,
)
from _helpers.bad_inputs import BUFFER, BadCases, C, N, compact_call, run_case, setup

CASES = BadCases()
bad = CASES.bad


# --------------------------------------------------------------------------- scores


@bad(ValueError, "scores", "(?i:nan)")
def nan_score(fw, rng):
    x, s, out = setup(fw, rng)
    s[0, 3] = float("nan")
    return compact_call(x, s, out)


@bad(ValueError, "scores", "(?i:nan)")
def nan_score_in_last_row(fw, rng):
    """Rows before it would already be compacted by a row-at-a-time check."""
    x, s, out = setup(fw, rng)
    s[-1, -1] = float("nan")
    return compact_call(x, s, out)


@bad(ValueError, "scores", "(?i:nan)", frameworks=("torch",))
def nan_bf16_score_in_last_row(fw, rng):
    x, s, out = setup(fw, rng, score_dtype="bfloat16")
    s[-1, 7] = float("nan")
    return compact_call(x, s, out)


@bad(TypeError, "scores")
def int_scores(fw, rng):
    x, _, out = setup(fw, rng)
    return compact_call(x, to_framework(np.arange(3 * N, dtype=np.int32).reshape(3, N), fw), out)


@bad(TypeError, "scores")
def float64_scores(fw, rng):
    x, _, out = setup(fw, rng)
    return compact_call(x, to_framework(np.ones((3, N)), fw), out)


@bad(ValueError, "scores")
def scores_with_wrong_n(fw, rng):
    x, _, out = setup(fw, rng)
    return compact_call(x, make_scores((3, N + 1), "float32", fw, rng), out, dim=1)


@bad(ValueError, "scores")
def scores_with_wrong_lead_shape(fw, rng):
    x, _, out = setup(fw, rng)
    return compact_call(x, make_scores((2, N), "float32", fw, rng), out)


@bad(TypeError, "scores", "(?i:grad)", frameworks=("torch",))
def scores_require_grad(fw, rng):
    x, s, out = setup(fw, rng)
    call, _ = compact_call(x, s.requires_grad_(), out)
    return call, [x, s.detach(), out]


@bad(TypeError, "scores", frameworks=("numpy",))
def big_endian_scores(fw, rng):
    """Read as native floats they would rank wrongly."""
    x, s, out = setup(fw, rng)
    return compact_call(x, s.astype(">f4"), out)


@bad(ValueError, "scores", frameworks=("numpy",))
def unaligned_scores(fw, rng):
    x, s, out = setup(fw, rng)
    raw = np.zeros(s.nbytes + 1, dtype=np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(s.shape)
    unaligned[...] = s
    return compact_call(x, unaligned, out)


@bad(TypeError, "scores")
def scores_not_an_array(fw, rng):
    x, _, out = setup(fw, rng)
    return compact_call(x, [[1.0] * N] * 3, out)


# --------------------------------------------------------------------------- capacity and options


@bad(ValueError, "capacity")
def negative_capacity(fw, rng):
    x, s, _ = setup(fw, rng)
    return compact_call(x, s, None, capacity=-1)


@bad(TypeError, "capacity")
def float_capacity(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, capacity=2.5)


@bad(TypeError, "capacity")
def bool_capacity(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, capacity=True)


@bad(TypeError, "capacity")
def missing_capacity(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, capacity=None)


@bad(ValueError, "(protected_prefix|recent_window)")
def prefix_plus_window_above_capacity(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, protected_prefix=3, recent_window=3)


@bad(ValueError, "protected_prefix")
def negative_protected_prefix(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, protected_prefix=-1)


@bad(ValueError, "recent_window")
def negative_recent_window(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, recent_window=-2)


@bad(ValueError, "mode")
def unknown_mode(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, mode="swop")


@bad(ValueError, "order")
def unknown_order(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, order="random")


@bad(ValueError, r"\bnan\b")
def unknown_nan_policy(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, nan="ignore")


@bad(ValueError, r"\bdim\b")
def dim_out_of_range(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, dim=3)


@bad(TypeError, r"\bdim\b")
def float_dim(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, dim=1.0)


@bad(ValueError, "index_dtype")
def unknown_index_dtype(fw, rng):
    x, s, _ = setup(fw, rng)
    return compact_call(x, s, None, index_dtype="int16")


@bad(ValueError, "num_threads")
def negative_num_threads(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, num_threads=-1)


# --------------------------------------------------------------------------- outputs


@bad(ValueError, "out_indices")
def out_indices_wrong_shape(fw, rng):
    x, s, _ = setup(fw, rng)
    return compact_call(x, s, to_framework(np.full((3, C + 1), -5, np.int64), fw))


@bad(ValueError, "out_indices")
def out_indices_wrong_lead_shape(fw, rng):
    x, s, _ = setup(fw, rng)
    return compact_call(x, s, to_framework(np.full((2, C), -5, np.int64), fw))


@bad(TypeError, "out_indices")
def out_indices_float(fw, rng):
    x, s, _ = setup(fw, rng)
    return compact_call(x, s, to_framework(np.full((3, C), -5, np.float32), fw))


@bad(TypeError, "out_indices")
def out_indices_int16(fw, rng):
    x, s, _ = setup(fw, rng)
    return compact_call(x, s, to_framework(np.full((3, C), -5, np.int16), fw))


@bad(BufferError, "out_indices", frameworks=("numpy",))
def out_indices_read_only(fw, rng):
    x, s, out = setup(fw, rng)
    out.flags.writeable = False
    return compact_call(x, s, out)


@bad(TypeError, "out_indices")
def out_indices_a_list(fw, rng):
    x, s, _ = setup(fw, rng)
    return compact_call(x, s, [0] * C)


@bad(ValueError, "out_target_map")
def out_target_map_wrong_shape(fw, rng):
    x, s, out = setup(fw, rng)
    tm = to_framework(np.full((3, N - 1), -1, np.int32), fw)
    call, arrays = compact_call(x, s, out, out_target_map=tm)
    return call, arrays + [tm]


@bad(TypeError, "out_target_map")
def out_target_map_float(fw, rng):
    x, s, out = setup(fw, rng)
    tm = to_framework(np.full((3, N), -1, np.float32), fw)
    call, arrays = compact_call(x, s, out, out_target_map=tm)
    return call, arrays + [tm]


@bad(TypeError, "out_target_map")
def out_target_map_int64(fw, rng):
    x, s, out = setup(fw, rng)
    tm = to_framework(np.full((3, N), -1, np.int64), fw)
    call, arrays = compact_call(x, s, out, out_target_map=tm)
    return call, arrays + [tm]


# --------------------------------------------------------------------------- active indices


def active_call(x, active, capacity=None, **kwargs):
    """compact_ with active indices and an index output of the shape a valid
    call with this capacity would have, so that only `active` is at fault."""
    k = capacity if capacity is not None else active.shape[-1]
    out = to_framework(np.full(x.shape[:1] + (k,), -5, np.int64),
                       "numpy" if isinstance(x, np.ndarray) else "torch")

    def call():
        imoe.compact_(x, active_indices=active, capacity=capacity, out_indices=out, **kwargs)

    return call, [x, active, out]


def _active(values, fw, dtype=np.int64):
    return to_framework(np.asarray(values, dtype=dtype), fw)


@bad(ValueError, "active")
def active_index_out_of_range(fw, rng):
    x, _, _ = setup(fw, rng)
    return active_call(x, _active([0, 4, N], fw))


@bad(ValueError, "active")
def active_index_negative(fw, rng):
    x, _, _ = setup(fw, rng)
    return active_call(x, _active([0, -1, 4], fw))


@bad(ValueError, "active", "(?i:duplicate|twice|repeat|distinct)")
def active_index_duplicate(fw, rng):
    x, _, _ = setup(fw, rng)
    return active_call(x, _active([[0, 3, 5], [1, 2, 3], [7, 9, 7]], fw))


@bad(TypeError, "active")
def active_indices_float(fw, rng):
    x, _, _ = setup(fw, rng)
    return active_call(x, _active([0, 3, 5], fw, np.float32))


@bad(TypeError, "active")
def active_indices_int8(fw, rng):
    x, _, _ = setup(fw, rng)
    return active_call(x, _active([0, 3, 5], fw, np.int8))


@bad(ValueError, "active")
def active_indices_wrong_lead_shape(fw, rng):
    x, _, _ = setup(fw, rng)
    return active_call(x, _active([[0, 3, 5], [1, 2, 3]], fw), dim=1)


@bad(ValueError, "capacity")
def capacity_differs_from_active_count(fw, rng):
    x, _, _ = setup(fw, rng)
    return active_call(x, _active([0, 3, 5], fw), capacity=4)


@bad(ValueError, "protected_prefix")
def protected_prefix_with_active(fw, rng):
    x, _, _ = setup(fw, rng)
    return active_call(x, _active([0, 3, 5], fw), protected_prefix=1)


@bad(ValueError, "scores", "active_indices")
def both_scores_and_active(fw, rng):
    x, s, out = setup(fw, rng)
    return compact_call(x, s, out, active_indices=_active([0, 1, 2, 3, 4], fw))


@bad(ValueError, "scores", "active_indices")
def neither_scores_nor_active(fw, rng):
    x, _, out = setup(fw, rng)
    return compact_call(x, None, out)


# --------------------------------------------------------------------------- buffers


@bad(BufferError, BUFFER, "(?i:read-?only|writ)", frameworks=("numpy",))
def read_only_buffer(fw, rng):
    x, s, out = setup(fw, rng)
    x.flags.writeable = False
    return compact_call(x, s, out)


@bad(BufferError, BUFFER, "(?i:read-?only|writ)", frameworks=("numpy",))
def read_only_second_buffer(fw, rng):
    x, s, out = setup(fw, rng)
    v = make_data((3, N, 2), "int8", fw, rng)
    v.flags.writeable = False
    call, arrays = compact_call([x, v], s, out)
    return call, arrays + [x, v]


@bad(ValueError, BUFFER, "contiguous")
def non_contiguous_row(fw, rng):
    x, s, out = setup(fw, rng)
    call, arrays = compact_call(x[:, :, ::2], s, out)
    return call, arrays + [x]


@bad(ValueError, BUFFER, frameworks=("numpy",))
def stride_zero_slots_numpy(fw, rng):
    x, s, out = setup(fw, rng)
    view = np.lib.stride_tricks.as_strided(x, shape=(3, N, 4), strides=(x.strides[0], 0, 4),
                                           writeable=True)
    call, arrays = compact_call(view, s, out)
    return call, arrays + [x]


@bad(BufferError, BUFFER, frameworks=("numpy",))
def broadcast_to_buffer_numpy(fw, rng):
    """NumPy marks broadcast views read-only."""
    x, s, out = setup(fw, rng)
    call, arrays = compact_call(np.broadcast_to(x[:1], (3, N, 4)), s, out)
    return call, arrays + [x]


@bad(ValueError, BUFFER, frameworks=("torch",))
def stride_zero_slots_torch(fw, rng):
    x, s, out = setup(fw, rng)
    base = x[:, :1]
    call, arrays = compact_call(base.expand(3, N, 4), s, out)
    return call, arrays + [x]


@bad(ValueError, BUFFER, frameworks=("torch",))
def stride_zero_rows_torch(fw, rng):
    """Three rows over one row of memory: compacting them would race."""
    x, s, out = setup(fw, rng)
    call, arrays = compact_call(x[:1].expand(3, N, 4), s, out)
    return call, arrays + [x]


@bad(ValueError, BUFFER)
def same_buffer_twice(fw, rng):
    """Swapping the same memory twice would undo the compaction."""
    x, s, out = setup(fw, rng)
    call, arrays = compact_call([x, x], s, out)
    return call, arrays


@bad(ValueError, BUFFER)
def overlapping_buffers(fw, rng):
    """x[..., :2] and x[..., 1:3] share a column: it would be swapped twice."""
    x, s, out = setup(fw, rng)
    call, arrays = compact_call([x[..., :2], x[..., 1:3]], s, out)
    return call, arrays + [x]


@bad(ValueError, "out_indices", frameworks=("numpy",))
def out_indices_aliases_the_buffer(fw, rng):
    memory = np.zeros(3 * N * 4, dtype=np.int64)
    x = memory.reshape(3, N, 4)
    x[...] = rng.integers(0, 1000, size=(3, N, 4))
    s = make_scores((3, N), "float32", fw, rng, ties=False)
    return compact_call(x, s, memory[: 3 * C].reshape(3, C))


@bad(TypeError, BUFFER, frameworks=("numpy",))
def object_dtype_buffer(fw, rng):
    _, s, out = setup(fw, rng)
    x = np.empty((3, N, 2), dtype=object)
    x[...] = 1
    return (lambda: imoe.compact_(x, s, C, out_indices=out)), [s, out]


@bad(ValueError, BUFFER)
def buffers_with_different_n(fw, rng):
    x, s, out = setup(fw, rng)
    v = make_data((3, N + 1, 2), "float16", fw, rng)
    call, arrays = compact_call([x, v], s, out, dim=1)
    return call, arrays + [v]


@bad(ValueError, BUFFER)
def buffers_with_different_lead_shapes(fw, rng):
    x, s, out = setup(fw, rng)
    v = make_data((2, N, 2), "float16", fw, rng)
    call, arrays = compact_call([x, v], s, out, dim=1)
    return call, arrays + [v]


@bad(ValueError, BUFFER)
def empty_list_of_buffers(fw, rng):
    _, s, out = setup(fw, rng)
    return compact_call([], s, out)


@bad(TypeError, BUFFER)
def list_as_buffer(fw, rng):
    _, s, out = setup(fw, rng)
    return compact_call([[1.0] * 4] * N, s, out)


@bad(TypeError, BUFFER)
def string_as_buffer(fw, rng):
    _, s, out = setup(fw, rng)
    return compact_call("tokens", s, out)


@bad(TypeError, BUFFER)
def none_as_buffer(fw, rng):
    _, s, out = setup(fw, rng)
    return compact_call(None, s, out)


@bad(TypeError, BUFFER, "(?i:grad)", frameworks=("torch",))
def buffer_requires_grad(fw, rng):
    x, s, out = setup(fw, rng)
    x.requires_grad_()
    call, _ = compact_call(x, s, out)
    return call, [x.detach(), s, out]


@bad(TypeError, BUFFER, "(?i:capsule)", frameworks=("torch",))
def raw_capsule_as_buffer(fw, rng):
    x, s, out = setup(fw, rng)
    call, _ = compact_call(torch.utils.dlpack.to_dlpack(x), s, out)
    return call, [x, s, out]


# --------------------------------------------------------------------------- the test


def test_enough_distinct_cases():
    assert len({p.values[0].__name__ for p in CASES.params}) >= 35


@pytest.mark.parametrize("build,framework,exc,match", CASES.params)
def test_bad_input(build, framework, exc, match, rng):
    run_case(build, framework, exc, match, rng)


# ------------------------------------------------------- threads


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_failing_row_does_not_depend_on_threads(threads, rng):
    """Threads claim rows in chunks, in whatever order they get to run: the
    error still names the lowest failing row, and nothing is written."""
    x = make_data((64, 256, 16), "float32", "numpy", rng)
    s = make_scores((64, 256), "float32", "numpy", rng, ties=False)
    s[[40, 9, 63], [7, 3, 1]] = np.nan
    out = np.full((64, 32), -5, dtype=np.int64)
    snaps = snapshot(x, s, out)
    with pytest.raises(ValueError, match=r"^scores: row 9, slot 3 is NaN"):
        imoe.compact_(x, s, 32, out_indices=out, num_threads=threads)
    assert_unchanged([x, s, out], snaps)


def test_more_threads_than_cores_match_one_thread(rng):
    """Threads that start late (more of them than cores) find their work taken
    by the others; the result is the same bits."""
    x = make_data((64, 256, 16), "float16", "numpy", rng)
    s = make_scores((64, 256), "float32", "numpy", rng)
    one, many = x.copy(), x.copy()
    a = imoe.compact_(one, s, 100, num_threads=1)
    b = imoe.compact_(many, s, 100, num_threads=32)
    np.testing.assert_array_equal(np.asarray(a.indices), np.asarray(b.indices))
    np.testing.assert_array_equal(one.view(np.uint16), many.view(np.uint16))


@requires_torch
@pytest.mark.parametrize("make, name", [
    (lambda: np.zeros((2, 8), np.int16), "int16"),
    (lambda: np.zeros((2, 8), ">f4"), "float32 (byte-swapped)"),
    (lambda: torch.zeros(2, 8, dtype=torch.float8_e4m3fn), "float8_e4m3fn"),
    (lambda: torch.zeros(2, 8, dtype=torch.uint8), "uint8"),
    (lambda: torch.zeros(2, 8, dtype=torch.complex64), "complex64"),
], ids=["int16", "byte-swapped", "float8", "uint8", "complex64"])
def test_a_refused_dtype_is_named_in_the_message(make, name):
    """The binding names an array's dtype only when a message needs it (a
    call that succeeds formats nothing): the name is still the dtype's."""
    x = np.arange(48, dtype=np.float32).reshape(2, 8, 3)
    before = x.copy()
    with pytest.raises(TypeError, match=re.escape(f"scores must have dtype float32, float16 or bfloat16, "
                                                  f"got {name}")):
        imoe.compact_(x, make(), 4)
    np.testing.assert_array_equal(x, before)
