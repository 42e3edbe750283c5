"""The DLPack side of the binding, through idempotent_moe._C directly.

Capsules come from tests/core/dlpack_producer.py, which owns the memory and counts
deleter calls. The consumer contract checked here: a capsule the binding
consumes (renames to used_*) has its deleter called exactly once by the
binding, on success and on every error path; a capsule it leaves alone is
freed by its own destructor; either way the deleter runs exactly once."""

from __future__ import annotations

import gc
import sys

import idempotent_moe as imoe
import numpy as np
import pytest
from _helpers import (
    bits,
    expected_after,
    make_data,
    reference_indices,
    reference_kept,
    requires_torch,
    torch,
)
from dlpack_producer import (
    IS_COPIED,
    READ_ONLY,
    LegacyDLPackObject,
    ModernDLPackObject,
    Producer,
    capsule_name,
    offset_array,
)

_C = pytest.importorskip("idempotent_moe._C")

R, N, D, C = 3, 10, 4, 4
SWAP, MOVE = "swap", "move"


def compact(buffers, scores, out, capacity=C, *, target_map=None, mode=SWAP, active=None):
    """_C.compact on [R, N, D] buffers, slot axis 1, one row axis."""
    k = len(buffers)
    return _C.compact(buffers, (1,) * k, (1,) * k, scores=scores, active_indices=active,
                      out_indices=out, out_target_map=target_map, capacity=capacity, mode=mode)


def problem(rng):
    data = make_data((R, N, D), "float32", "numpy", rng)
    scores = rng.permutation(R * N).reshape(R, N).astype(np.float32)
    out = np.full((R, C), -5, dtype=np.int64)
    ref = reference_indices(reference_kept(scores, C), N, C)
    return data, scores, out, ref


def check_deleters(*producers):
    """The deleter contract: called exactly once for a capsule the binding took
    (renamed used_*), never for one it left to its producer."""
    gc.collect()
    for p in producers:
        expected = 1 if p.consumed else 0
        assert p.deleter_calls == expected, \
            f"deleter called {p.deleter_calls} times for a {capsule_name(p.capsule)} capsule"


# --------------------------------------------------------------------------- buffers


@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "legacy"])
def test_writable_capsule_compacts(versioned, rng):
    data, scores, out, ref = problem(rng)
    before = bits(data)
    producer = Producer(data, versioned=versioned)
    compact([producer.capsule], scores, out)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(bits(producer.array), expected_after(before, 1, ref, "swap"))
    assert producer.consumed, "a capsule the binding used must be renamed used_*"
    check_deleters(producer)


def test_null_strides(rng):
    data, scores, out, ref = problem(rng)
    before = bits(data)
    producer = Producer(data, null_strides=True)
    compact([producer.capsule], scores, out, mode=MOVE)
    np.testing.assert_array_equal(bits(data), expected_after(before, 1, ref, "move"))
    check_deleters(producer)


def test_element_strides(rng):
    """DLPack strides are in elements: a [R, N, D] view of every other slot."""
    base = make_data((R, 2 * N, D), "float32", "numpy", rng)
    _, scores, out, ref = problem(rng)
    before = bits(base)
    producer = Producer(base[:, ::2])
    compact([producer.capsule], scores, out)
    expected = before.copy()
    expected[:, ::2] = expected_after(before[:, ::2], 1, ref, "swap")
    np.testing.assert_array_equal(bits(base), expected)
    check_deleters(producer)


@pytest.mark.parametrize("null_strides", [False, True])
def test_byte_offset_is_honoured(null_strides, rng):
    data = offset_array((R, N, D), np.float32, 64, fill=make_data((R, N, D), "float32", "numpy",
                                                                   rng))
    allocation = data
    while isinstance(allocation.base, np.ndarray):
        allocation = allocation.base
    assert allocation.nbytes > data.nbytes
    front = allocation[:64].copy()
    _, scores, out, ref = problem(rng)
    before = bits(data)
    producer = Producer(data, byte_offset=64, null_strides=null_strides)
    compact([producer.capsule], scores, out)
    np.testing.assert_array_equal(bits(data), expected_after(before, 1, ref, "swap"))
    np.testing.assert_array_equal(allocation[:64], front)
    check_deleters(producer)


def test_capsules_for_scores_and_indices(rng):
    """Every argument may be a capsule; read-only scores are fine."""
    data, scores, out, ref = problem(rng)
    before = bits(data)
    producers = [Producer(data), Producer(scores, flags=READ_ONLY), Producer(out)]
    capsules = [p.capsule for p in producers]
    compact([capsules[0]], capsules[1], capsules[2])
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(bits(data), expected_after(before, 1, ref, "swap"))
    check_deleters(*producers)


def test_read_only_scores_capsule_with_legacy_buffers(rng):
    data, scores, out, ref = problem(rng)
    producers = [Producer(data, versioned=False), Producer(scores, flags=READ_ONLY)]
    capsules = [p.capsule for p in producers]
    compact([capsules[0]], capsules[1], out)
    np.testing.assert_array_equal(out, ref)
    check_deleters(*producers)


def test_target_map_capsule_and_restore(rng):
    data, scores, out, ref = problem(rng)
    before = bits(data)
    tm = np.full((R, N), -1, dtype=np.int32)
    producers = [Producer(data), Producer(tm)]
    capsules = [p.capsule for p in producers]
    compact([capsules[0]], scores, out, target_map=capsules[1])
    assert (tm[np.arange(R)[:, None], tm] == np.arange(N)).all()
    check_deleters(*producers)
    # restore through a fresh capsule over the same memory
    producer = Producer(data)
    _C.restore([producer.capsule], (1,), (1,), indices=out)
    np.testing.assert_array_equal(bits(data), before)
    check_deleters(producer)


# --------------------------------------------------------------------------- refusals


REFUSED = [
    pytest.param(dict(flags=READ_ONLY), id="read-only"),
    pytest.param(dict(flags=IS_COPIED), id="is-copied"),
    pytest.param(dict(flags=READ_ONLY | IS_COPIED), id="read-only-and-copied"),
    pytest.param(dict(version=(2, 0)), id="major-2"),
    pytest.param(dict(version=(0, 9)), id="major-0"),
    pytest.param(dict(name="used_dltensor_versioned"), id="used-versioned"),
    pytest.param(dict(name="used_dltensor", versioned=False), id="used-legacy"),
]


@pytest.mark.parametrize("options", REFUSED)
def test_refused_buffer_capsule(options, rng):
    data, scores, out, _ = problem(rng)
    snaps = [bits(data), bits(scores), bits(out)]
    producer = Producer(data, **options)
    with pytest.raises(BufferError):
        compact([producer.capsule], scores, out)
    for arr, snap in zip((data, scores, out), snaps):
        np.testing.assert_array_equal(bits(arr), snap)
    if "name" in options:  # someone else owns it: nobody here may free it
        assert capsule_name(producer.capsule) == options["name"]
        assert producer.deleter_calls == 0
    else:
        check_deleters(producer)


def test_read_only_out_indices_capsule(rng):
    data, scores, out, _ = problem(rng)
    snaps = [bits(data), bits(out)]
    producers = [Producer(data), Producer(out, flags=READ_ONLY)]
    capsules = [p.capsule for p in producers]
    with pytest.raises(BufferError):
        compact([capsules[0]], scores, capsules[1])
    np.testing.assert_array_equal(bits(data), snaps[0])
    np.testing.assert_array_equal(bits(out), snaps[1])
    check_deleters(*producers)


def _nan_scores(scores):
    scores = scores.copy()
    scores[-1, -1] = np.nan
    return scores


LATER_FAULTS = [
    # (what is wrong after the capsule, exception)
    pytest.param(lambda s, o: (_nan_scores(s), o), ValueError, id="nan-scores"),
    pytest.param(lambda s, o: (s.astype(np.float64), o), TypeError, id="float64-scores"),
    pytest.param(lambda s, o: (s[:, :-1], o), ValueError, id="scores-shape"),
    pytest.param(lambda s, o: (s, o.astype(np.float32)), TypeError, id="float-out-indices"),
    pytest.param(lambda s, o: (s, o[:, :-1]), ValueError, id="out-indices-shape"),
    pytest.param(lambda s, o: (s, "indices"), TypeError, id="out-indices-a-string"),
]


@pytest.mark.parametrize("fault,exc", LATER_FAULTS)
def test_deleter_called_once_when_a_later_argument_fails(fault, exc, rng):
    data, scores, out, _ = problem(rng)
    scores, out = fault(scores, out)
    snap = bits(data)
    producer = Producer(data)
    with pytest.raises(exc):
        compact([producer.capsule], scores, out)
    np.testing.assert_array_equal(bits(data), snap)
    check_deleters(producer)


@pytest.mark.parametrize("fault", ["nan-scores", "float-out-indices", "read-only-out-indices",
                                   "short-target-map"])
def test_deleters_of_every_argument_on_error(fault, rng):
    """Buffer, scores, indices and target map all capsules; one of them is bad."""
    data, scores, out, _ = problem(rng)
    tm = np.full((R, N), -1, dtype=np.int32)
    if fault == "nan-scores":
        scores = _nan_scores(scores)
    elif fault == "float-out-indices":
        out = out.astype(np.float32)
    elif fault == "short-target-map":
        tm = tm[:, :-1].copy()
    flags = READ_ONLY if fault == "read-only-out-indices" else 0
    producers = [Producer(data), Producer(scores, flags=READ_ONLY), Producer(out, flags=flags),
                 Producer(tm)]
    snaps = [bits(p.array) for p in producers]
    with pytest.raises((ValueError, TypeError, BufferError)) as info:
        compact([producers[0].capsule], producers[1].capsule, producers[2].capsule,
                target_map=producers[3].capsule)
    expected = {"nan-scores": ValueError, "float-out-indices": TypeError,
                "read-only-out-indices": BufferError, "short-target-map": ValueError}[fault]
    assert info.type is expected
    for p, snap in zip(producers, snaps):
        np.testing.assert_array_equal(bits(p.array), snap)
    check_deleters(*producers)


def test_build_map_with_capsules(rng):
    _, scores, out, ref = problem(rng)
    tm = np.full((R, N), -1, dtype=np.int32)
    producers = [Producer(scores, versioned=False), Producer(out), Producer(tm)]
    _C.build_map(scores=producers[0].capsule, out_indices=producers[1].capsule,
                 out_target_map=producers[2].capsule, capacity=C)
    np.testing.assert_array_equal(out, ref)
    assert all(p.consumed for p in producers)
    check_deleters(*producers)


def test_active_indices_capsule(rng):
    data, _, out, _ = problem(rng)
    before = bits(data)
    active = np.array([9, 0, 5, 2], dtype=np.int32)
    producers = [Producer(data), Producer(active, flags=READ_ONLY)]
    compact([producers[0].capsule], None, out, active=producers[1].capsule)
    ref = reference_indices([np.sort(active)] * R, N, C)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(bits(data), expected_after(before, 1, ref, "swap"))
    check_deleters(*producers)


def test_deleters_when_the_second_buffer_is_refused(rng):
    data, scores, out, _ = problem(rng)
    other = make_data((R, N, 2), "int16", "numpy", rng)
    snaps = [bits(data), bits(other)]
    producers = [Producer(data), Producer(other, flags=READ_ONLY)]
    with pytest.raises(BufferError):
        compact([p.capsule for p in producers], scores, out)
    np.testing.assert_array_equal(bits(data), snaps[0])
    np.testing.assert_array_equal(bits(other), snaps[1])
    check_deleters(*producers)


def test_deleters_when_buffers_disagree_on_n(rng):
    data, scores, out, _ = problem(rng)
    other = make_data((R, N + 1, 2), "int16", "numpy", rng)
    producers = [Producer(data), Producer(other)]
    with pytest.raises(ValueError):
        compact([p.capsule for p in producers], scores, out)
    check_deleters(*producers)


# --------------------------------------------------------------------------- __dlpack__ objects


def test_old_producer_without_keywords(rng):
    data, scores, out, ref = problem(rng)
    before = bits(data)
    obj = LegacyDLPackObject(data)
    compact([obj], scores, out)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(bits(data), expected_after(before, 1, ref, "swap"))
    assert obj.producers and all(p.consumed for p in obj.producers)
    check_deleters(*obj.producers)


class StreamOnlyDLPackObject(LegacyDLPackObject):
    """An older producer whose __dlpack__ knows `stream` and nothing newer."""

    def __dlpack__(self, stream=None):
        return super().__dlpack__()


def test_old_producer_with_stream_only(rng):
    data, scores, out, ref = problem(rng)
    before = bits(data)
    obj = StreamOnlyDLPackObject(data)
    compact([obj], scores, out)
    np.testing.assert_array_equal(bits(data), expected_after(before, 1, ref, "swap"))
    assert len(obj.producers) == 1 and obj.producers[0].consumed
    check_deleters(*obj.producers)


def test_modern_producer(rng):
    data, scores, out, ref = problem(rng)
    before = bits(data)
    obj = ModernDLPackObject(data)
    refs = sys.getrefcount(obj)
    compact([obj], scores, out)
    np.testing.assert_array_equal(bits(data), expected_after(before, 1, ref, "swap"))
    assert all(call["copy"] in (None, False) for call in obj.calls), "in place needs no copy"
    assert obj.calls[0]["max_version"][0] == 1, "ask for a versioned capsule"
    assert obj.producers and all(p.consumed for p in obj.producers)
    check_deleters(*obj.producers)
    after = sys.getrefcount(obj)
    assert after == refs


def test_modern_producer_read_only(rng):
    data, scores, out, _ = problem(rng)
    snap = bits(data)
    obj = ModernDLPackObject(data, flags=READ_ONLY)
    with pytest.raises(BufferError):
        compact([obj], scores, out)
    np.testing.assert_array_equal(bits(data), snap)
    assert obj.producers
    check_deleters(*obj.producers)


# --------------------------------------------------------------------------- reference counts


def _refcounts(*objs):
    return [sys.getrefcount(o) for o in objs]


def _numpy_args(rng):
    data, scores, out, _ = problem(rng)
    return data, scores, out


def _torch_args(rng):
    data, scores, out = _numpy_args(rng)
    return torch.from_numpy(data), torch.from_numpy(scores), torch.from_numpy(out)


FRAMEWORK_ARGS = [
    pytest.param(_numpy_args, id="numpy"),
    pytest.param(_torch_args, id="torch", marks=requires_torch),
]


@pytest.mark.parametrize("make_args", FRAMEWORK_ARGS)
def test_refcounts_unchanged_after_many_calls(make_args, rng):
    data, scores, out = make_args(rng)
    tm = np.zeros((R, N), np.int32) if isinstance(data, np.ndarray) else torch.zeros(
        (R, N), dtype=torch.int32)
    before = _refcounts(data, scores, out, tm)
    for _ in range(1000):
        compact([data], scores, out, target_map=tm)
    for _ in range(200):
        _C.apply_indices([data], (1,), (1,), indices=out, mode=SWAP)
        _C.restore([data], (1,), (1,), indices=out)
        imoe.compact_(data, scores, C, out_indices=out)
    gc.collect()
    after = _refcounts(data, scores, out, tm)
    assert after == before


@pytest.mark.parametrize("make_args", FRAMEWORK_ARGS)
def test_refcounts_unchanged_after_many_errors(make_args, rng):
    data, scores, out = make_args(rng)
    scores[-1, -1] = float("nan")
    bad_out = out[:, :-1]
    before = _refcounts(data, scores, out, bad_out)
    for _ in range(1000):
        with pytest.raises(ValueError):
            compact([data], scores, out)
        with pytest.raises(ValueError):
            compact([data, data[:, :-1]], scores, out)
    for _ in range(200):
        with pytest.raises(ValueError):
            imoe.compact_(data, scores, C, out_indices=bad_out)
    gc.collect()
    after = _refcounts(data, scores, out, bad_out)
    assert after == before


def test_capsule_refcount_unchanged(rng):
    data, scores, out, _ = problem(rng)
    producer = Producer(data)
    before = sys.getrefcount(producer.capsule)
    compact([producer.capsule], scores, out)
    after = sys.getrefcount(producer.capsule)  # (not inside assert: pytest keeps operands)
    assert after == before


@requires_torch
def test_torch_tensor_requiring_grad_is_a_type_error(rng):
    data, scores, out = _torch_args(rng)
    x = data.clone().requires_grad_()
    with pytest.raises(TypeError, match="grad"):
        imoe.compact_(x, scores, C, out_indices=out)
    with pytest.raises(TypeError, match="grad"):
        imoe.compact_([data, x], scores, C, out_indices=out)
    np.testing.assert_array_equal(bits(x), bits(data))


# --------------------------------------------------------------------------- DLPack's C exchange table


def _exchange_tensor_type():
    torch = pytest.importorskip("torch")
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this torch publishes no DLPack C exchange table")

    class Counted(torch.Tensor):
        """Counts __dlpack__ calls; inherits torch's exchange table."""

        calls = 0

        def __dlpack__(self, *args, **kwargs):
            type(self).calls += 1
            return torch.Tensor.__dlpack__(self, *args, **kwargs)

    return torch, Counted


def test_torch_tensors_are_borrowed_through_the_exchange_table():
    """A torch tensor is read through __dlpack_c_exchange_api__: no capsule,
    no __dlpack__ call, the same result, and no reference left behind."""
    torch, Counted = _exchange_tensor_type()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, 8, generator=g).as_subclass(Counted)
    scores = torch.rand(4, 64, generator=g).as_subclass(Counted)
    out = torch.empty(4, 20, dtype=torch.int64).as_subclass(Counted)
    expected = x.clone().as_subclass(torch.Tensor)
    refs = [sys.getrefcount(t) for t in (x, scores, out)]
    imoe.compact_(x, scores, 20, dim=1, out_indices=out)
    assert Counted.calls == 0
    assert [sys.getrefcount(t) for t in (x, scores, out)] == refs
    ref_idx = torch.topk(scores.as_subclass(torch.Tensor), 20, dim=1).indices.sort(dim=1).values
    assert torch.equal(out.as_subclass(torch.Tensor).sort(dim=1).values, ref_idx)
    kept = torch.gather(expected, 1, out.as_subclass(torch.Tensor)[..., None].expand(-1, -1, 8))
    assert torch.equal(x.as_subclass(torch.Tensor)[:, :20], kept)


def test_a_tensor_that_requires_grad_is_refused_before_any_export():
    """The exchange table would export it (__dlpack__ refuses it): the binding
    refuses it first, a TypeError naming the argument, with nothing exported."""
    torch, Counted = _exchange_tensor_type()
    x = torch.randn(6, 3).as_subclass(Counted).requires_grad_()
    before = x.detach().clone()
    from idempotent_moe._native import native

    with pytest.raises(TypeError, match=r"buffers\[0\] requires grad"):
        native().compact([x], [0], [1], scores=torch.rand(6), capacity=2,
                         out_indices=torch.empty(2, dtype=torch.int64), mode="move")
    assert Counted.calls == 0 and torch.equal(x.detach(), before)
