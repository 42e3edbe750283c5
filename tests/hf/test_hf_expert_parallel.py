"""transformers' expert parallelism with the library: a tiny Mixtral loaded
with `DistributedConfig(tp_size=2, tp_plan={}, ep_size=2, ...)` on two ranks
(gloo on 127.0.0.1, each a subprocess running this file) against the same
model in one process:

- the "idempotent" experts implementation on each rank's shard under
  transformers' own EP implementations ("all_to_all": local ids; and
  "all_reduce": other ranks' experts as the sentinel id) gives the
  single-process logits;
- the "idempotent" EP implementation (ExpertParallelDispatcher) gives them
  too, dropless and in capacity mode (the same assignments dropped: the
  ranks' dropped counts add up to the single-process count), and trains:
  the loss and the gradients (embedding, each rank's expert shard) are the
  single-process ones."""

from __future__ import annotations

import argparse
import os

import pytest
from _helpers import run_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.distributed.expert_parallel", reason="needs transformers' EP")
pytest.importorskip("accelerate", reason="transformers' distributed loading needs accelerate")

WORLD = 2
TIMEOUT_S = 240
CASES = [  # (EP implementation, capacity factor, train)
    ("all_to_all", None, False),
    ("all_reduce", None, False),
    ("idempotent", None, True),
    ("idempotent", 0.75, True),
]
IDS = (2, 24)


def _ids():
    return torch.randint(1, 96, IDS, generator=torch.Generator().manual_seed(1))


def _save_model(path: str) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=48, num_local_experts=8,
                           num_experts_per_tok=2, initializer_range=0.2, output_router_logits=True)
    MixtralForCausalLM(config).save_pretrained(path)


def _step(model, capacity, train: bool) -> dict:
    """Logits (no gradient), and with `train` the loss and the gradients of
    the embedding and of layer 0's experts (this rank's shard)."""
    import idempotent_moe.integrations as imoe_hf

    imoe_hf.set_capacity_factor(model, capacity)
    ids = _ids()
    with torch.no_grad():
        logits = model(ids).logits
    out = {"logits": logits, "dropped": sum(s.dropped for s in imoe_hf.capacity_stats(model).values())}
    if train:
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        experts = model.model.layers[0].mlp.experts
        grad = experts.gate_up_proj.grad
        out.update(loss=loss.detach(), embed=_local(model.model.embed_tokens.weight.grad),
                   experts=_local(grad))
        model.zero_grad(set_to_none=True)
        model.eval()
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _worker(rank: int, port: int, path: str, out_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import idempotent_moe.integrations  # noqa: F401  (registers "idempotent")
    from idempotent_moe.distributed import ExpertParallelDispatcher
    from transformers import MixtralForCausalLM
    from transformers.distributed import DistributedConfig

    calls = []
    real_call = ExpertParallelDispatcher.__call__
    ExpertParallelDispatcher.__call__ = lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    try:
        for impl, capacity, train in CASES:
            config = DistributedConfig(tp_size=WORLD, tp_plan={}, ep_size=WORLD, ep_implementation=impl)
            model = MixtralForCausalLM.from_pretrained(path, distributed_config=config,
                                                       experts_implementation="idempotent")
            calls.clear()
            results[(impl, capacity)] = _step(model, capacity, train)
            results[(impl, capacity)]["dispatcher_calls"] = len(calls)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process results by capacity, the two ranks' results)."""
    import idempotent_moe.integrations  # noqa: F401
    from transformers import MixtralForCausalLM

    root = tmp_path_factory.mktemp("hf_ep")
    path = str(root / "model")
    _save_model(path)
    outs = [str(root / f"rank{r}.pt") for r in range(WORLD)]
    run_ranks(__file__, [(path, outs[r]) for r in range(WORLD)], TIMEOUT_S)
    model = MixtralForCausalLM.from_pretrained(path, experts_implementation="idempotent")
    reference = {capacity: _step(model, capacity, True) for capacity in {c for _, c, _ in CASES}}
    return reference, [torch.load(o, weights_only=False) for o in outs]


@pytest.mark.parametrize("impl,capacity,train", CASES)
def test_expert_parallel_logits_match_one_process(runs, impl, capacity, train):
    reference, ranks = runs
    want = reference[capacity]
    for r in range(WORLD):
        got = ranks[r][(impl, capacity)]
        torch.testing.assert_close(got["logits"], want["logits"], atol=1e-5, rtol=1e-5)
        # the library's dispatcher runs under its own EP implementation only (two layers per forward)
        assert (got["dispatcher_calls"] >= 2) == (impl == "idempotent"), got["dispatcher_calls"]
    if capacity is not None:
        assert want["dropped"] > 0  # the factor is sized to drop
        assert sum(ranks[r][(impl, capacity)]["dropped"] for r in range(WORLD)) == want["dropped"]


@pytest.mark.parametrize("capacity", [c for impl, c, train in CASES if train])
def test_idempotent_expert_parallel_trains_like_one_process(runs, capacity):
    reference, ranks = runs
    want = reference[capacity]
    experts = want["experts"].shape[0] // WORLD
    for r in range(WORLD):
        got = ranks[r][("idempotent", capacity)]
        torch.testing.assert_close(got["loss"], want["loss"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["embed"], want["embed"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["experts"], want["experts"][r * experts:(r + 1) * experts],
                                   atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("path")
    parser.add_argument("out")
    a = parser.parse_args()
    _worker(a.rank, a.port, a.path, a.out)
