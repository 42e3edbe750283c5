"""transformers' expert parallelism as one rank sees it, in one process:
other ranks' experts arrive as a sentinel id with weight 0 and add nothing,
dropless and in capacity mode, as in transformers' grouped_mm, gradients
included (what grouped_mm leaves unwritten reaches none of them); the
experts implementation and ExpertParallelDispatcher on one gloo rank agree.
Two ranks: test_hf_expert_parallel.py."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers' experts interface")

from _helpers.hf_models import (  # noqa: E402
    capacity_reference,
    expert_mlp,
    experts_grads,
    run_experts,
    skewed_routing,
    standalone_experts,
)
from idempotent_moe import integrations as hf  # noqa: E402
from idempotent_moe.integrations import _dispatch  # noqa: E402


def _expert_parallel_routing(num_tokens, num_experts, top_k, seed):
    """Routing as one rank of transformers' expert parallelism sees it: ids of
    other ranks' experts become num_experts (several per token at times), with
    weight 0."""
    g = torch.Generator().manual_seed(seed)
    index = torch.topk(torch.randn(num_tokens, 2 * num_experts, generator=g), top_k, dim=-1).indices
    weights = torch.rand(index.shape, generator=g) + 0.05
    foreign = index >= num_experts
    index = index.masked_fill(foreign, num_experts)
    weights = weights.masked_fill(foreign, 0.0)
    assert foreign.any() and (foreign.sum(1) == top_k).any() and (~foreign).any()
    return index, weights


def _local_reference(experts, hidden, index, weights):
    out = torch.zeros_like(hidden)
    for e in range(experts.num_experts):
        tokens, slots = torch.where(index == e)
        y = expert_mlp(experts, hidden[tokens], e) * weights[tokens, slots, None]
        out = out.index_add(0, tokens, y)
    return out


@pytest.mark.parametrize("factor", [None, 4.0, 0.3], ids=["dropless", "capacity-drops-none", "capacity"])
def test_expert_parallel_sentinel_ids_add_nothing(factor):
    experts = standalone_experts()
    experts._is_expert_parallel = True
    hidden = torch.randn(40, 16, generator=torch.Generator().manual_seed(13))
    index, weights = _expert_parallel_routing(40, 8, 2, seed=8)
    with torch.no_grad():
        ours = run_experts(experts, hidden, index, weights, "idempotent", factor)
    if factor is None or factor == 4.0:
        expected = _local_reference(experts, hidden, index, weights)
    else:
        capacity = math.ceil(40 * 2 / 8 * factor)
        expected, dropped, _ = capacity_reference(experts, hidden, index, weights, capacity)
        assert experts.idempotent_stats[2].item() == dropped > 0
        assert int(experts.idempotent_stats[0]) == int((index < 8).sum())
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factor", [None, 4.0])
def test_expert_parallel_matches_transformers_grouped_mm(factor):
    import inspect

    from transformers.integrations import moe

    if "_is_expert_parallel" not in inspect.getsource(moe.grouped_mm_experts_forward):
        pytest.skip("this transformers' grouped_mm has no expert-parallel sentinels")
    experts = standalone_experts()
    experts._is_expert_parallel = True
    hidden = torch.randn(40, 16, generator=torch.Generator().manual_seed(14))
    index, weights = _expert_parallel_routing(40, 8, 2, seed=9)
    ours = experts_grads(experts, hidden, index, weights, "idempotent", factor)
    grouped = experts_grads(experts, hidden, index, weights, "grouped_mm")
    for a, b in zip(ours, grouped):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs keep torch's allocation defaults")
def test_cpu_runs_poison_uninitialized_memory():
    """conftest.poison_uninitialized_memory: what torch allocates and no one
    writes reads NaN, inside its ops too (the rows grouped_mm leaves past the
    last offset)."""
    assert torch.empty(8).isnan().all()
    x, w = torch.ones(4, 16), torch.ones(2, 16, 16)
    out = _dispatch.grouped_linear(x, w, torch.tensor([1, 2], dtype=torch.int32), True)
    assert (out[:2] == 16).all()
    if _dispatch.grouped_mm_usable(x, w):  # else a loop that writes zeros there
        assert out[2:].isnan().all()


def test_expert_parallel_gradients_ignore_what_grouped_mm_leaves_unwritten(monkeypatch):
    """grouped_mm leaves the rows past offsets[-1] (other ranks' assignments)
    unwritten: whatever they hold, NaN included, reaches no gradient."""
    from idempotent_moe.integrations import _dispatch as dispatch_module

    grouped_linear = dispatch_module.grouped_linear

    def unwritten_rows_nan(x, weight, offsets, transposed):
        out = grouped_linear(x, weight, offsets, transposed)
        past = (torch.arange(out.shape[0]) >= offsets[-1]).unsqueeze(-1)
        return out.masked_fill(past, float("nan"))

    experts = standalone_experts()
    experts._is_expert_parallel = True
    hidden = torch.randn(40, 16, generator=torch.Generator().manual_seed(14))
    index, weights = _expert_parallel_routing(40, 8, 2, seed=9)
    clean = experts_grads(experts, hidden, index, weights, "idempotent")
    monkeypatch.setattr(dispatch_module, "grouped_linear", unwritten_rows_nan)
    poisoned = experts_grads(experts, hidden, index, weights, "idempotent")
    for a, b in zip(poisoned, clean):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_expert_parallel_sentinels_only_where_the_module_is_split(monkeypatch):
    from idempotent_moe.integrations import _fused

    monkeypatch.setattr(_fused, "trains", lambda experts: False)  # training on the torch path
    experts = standalone_experts()
    index, weights = _expert_parallel_routing(10, 8, 2, seed=10)
    for grad in (False, True):  # the fused path (inference), the torch path
        with pytest.raises(ValueError, match=r"outside \[0, num_experts = 8\)|must lie in \[0, 8\)"):
            run_experts(experts, torch.randn(10, 16, requires_grad=grad), index, weights, "idempotent")
    experts._is_expert_parallel = True
    # Both paths check that a token's local experts are distinct (the fused
    # path in the C dispatch); other ranks' ids (8) may repeat.
    for grad in (False, True):  # a local expert twice
        with pytest.raises(ValueError, match="distinct"):
            run_experts(experts, torch.randn(2, 16, requires_grad=grad), torch.tensor([[3, 3], [8, 8]]),
                        torch.ones(2, 2), "idempotent")


def test_sort_by_expert_puts_sentinels_last():
    index = torch.tensor([[4, 1], [0, 4], [1, 2], [4, 4]])
    d = _dispatch.sort_by_expert(index, 4, sentinels=True)
    assert d.offsets.tolist() == [1, 3, 4, 4]
    assert d.local.tolist() == [[False, True], [True, False], [True, True], [False, False]]
    assert sorted(d.dest[~d.local].tolist()) == [4, 5, 6, 7]
    assert d.expert_of.tolist() == [0, 1, 1, 2, 3, 3, 3, 3]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("factor", [None, 0.5, 1.0, 1.3])
def test_experts_implementation_and_expert_parallel_dispatcher_agree(tmp_path, factor, ties):
    """The same routing through the experts implementation and through
    ExpertParallelDispatcher on one gloo rank: the same capacity, the same
    assignments dropped (ties to the lower token), the same output; and both
    refuse the same capacity factors."""
    import torch.distributed as dist
    from idempotent_moe.distributed import ExpertParallelDispatcher

    num_tokens, num_experts, top_k = 37, 8, 2
    experts = standalone_experts(num_experts)
    hidden = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(9))
    index, weights = skewed_routing(num_tokens, num_experts, top_k, seed=4, ties=ties)
    with torch.no_grad():
        ours = run_experts(experts, hidden, index, weights, "idempotent", factor)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        dispatcher = ExpertParallelDispatcher(num_experts, top_k, capacity_factor=factor)
        with torch.no_grad():
            theirs = dispatcher(hidden, index, weights, lambda e, x: expert_mlp(experts, x, e))
        for bad, error in [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                           (float("inf"), ValueError), ("1.0", TypeError), (True, TypeError)]:
            with pytest.raises(error):
                ExpertParallelDispatcher(num_experts, top_k, capacity_factor=bad)
            with pytest.raises(error):
                hf.set_capacity_factor(experts, bad)
    finally:
        dist.destroy_process_group()
    stats = dispatcher.last_stats
    if factor is None:
        assert experts.idempotent_stats is None and stats.capacity is None and stats.dropped == 0
    else:
        assignments, capacity, dropped = experts.idempotent_stats
        assert (assignments, capacity) == (num_tokens * top_k, stats.capacity)
        assert int(dropped) == stats.dropped
        if factor < 1.3:
            assert stats.dropped > 0  # the skewed routing overflows the first experts
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
