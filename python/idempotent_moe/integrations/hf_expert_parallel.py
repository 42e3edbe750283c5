"""Expert parallelism for transformers models on the library's dispatcher.

transformers shards a model's experts over ranks with its EP plan
(`DistributedConfig(ep_size=W, ...)`: each rank holds E / W experts) and
brings them their tokens through the `EPImplementation` that
`ep_implementation` names. This module adds one, "idempotent":

    from transformers.distributed import DistributedConfig
    model = AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="idempotent",
        distributed_config=DistributedConfig(tp_size=W, tp_plan={}, ep_size=W,
                                             ep_implementation="idempotent"))

Each layer's tokens go to their experts' ranks through
`distributed.ExpertParallelDispatcher`: in capacity mode (the config
attribute `idempotent_capacity_factor`, `set_capacity_factor`) the capacity
is decided before the exchange, so a dropped assignment never crosses the
network; each rank runs its experts in one grouped call of the "idempotent"
experts implementation; the exchanges are differentiable. The ranks of a
tensor-parallel group (which hold the same batch) each send a disjoint slice
of it, as transformers' all-to-all implementation does, and the outputs are
gathered back.

transformers' own implementations ("all_to_all", "all_reduce") run the
"idempotent" experts implementation on each rank's shard too: it leaves the
ids of other ranks' experts (the sentinel `num_local_experts`) out.

Registered with transformers' `EPImplementationInterface` beside the
experts implementation (`integrations.register`), where transformers has
the interface.
"""

from __future__ import annotations

import torch

from .._moe_rules import check_capacity_factor
from ..distributed import ExpertParallelDispatcher
from .hf_experts import CAPACITY_FACTOR_ATTR, experts_forward

EP_IMPLEMENTATION = "idempotent"


def register(name: str = EP_IMPLEMENTATION) -> bool:
    """Register the "idempotent" EP implementation with transformers; False
    where transformers has no EPImplementationInterface (no expert
    parallelism, or an older release) or torch has no distributed support."""
    if not torch.distributed.is_available():
        return False
    try:
        from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface
    except ImportError:
        return False
    if name not in EPImplementationInterface._global_mapping:
        EPImplementationInterface.register(name, _implementation(EPImplementation))
    return True


def _implementation(base: type) -> type:
    """The EPImplementation subclass (made here: transformers defines the base)."""

    class IdempotentEP(base):
        """Tokens to their experts' ranks through ExpertParallelDispatcher:
        drop before send in capacity mode, one grouped experts call per rank,
        differentiable exchanges."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            self.module = experts
            self.num_experts = self.num_local_experts * ep_mesh.size()
            self._dispatchers = {}

        def _dispatcher(self, top_k: int, factor: float | None) -> ExpertParallelDispatcher:
            key = (top_k, factor)
            if key not in self._dispatchers:
                group = self.ep_mesh.get_group()
                self._dispatchers[key] = ExpertParallelDispatcher(self.num_experts, top_k, group, factor)
            return self._dispatchers[key]

        def _grouped(self, rows, local_ids):
            """This rank's experts on the received rows, dropless (the capacity
            was decided before the exchange): the "idempotent" implementation."""
            ids = local_ids.view(-1, 1)
            ones = torch.ones(ids.shape, dtype=rows.dtype, device=rows.device)
            return experts_forward(self.module, rows, ids, ones, None)

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            num_tokens = hidden_states.shape[0]
            sliced = self.tp_mesh.size() > 1
            if sliced:  # the TP group shares the batch: each rank takes a disjoint slice
                hidden_states, top_k_index, top_k_weights = (
                    _to_slices(t, self.tp_mesh) for t in (hidden_states, top_k_index, top_k_weights))
            factor = check_capacity_factor(getattr(self.module.config, CAPACITY_FACTOR_ATTR, None),
                                           CAPACITY_FACTOR_ATTR)
            dispatcher = self._dispatcher(top_k_index.shape[-1], factor)
            out = dispatcher(hidden_states, top_k_index, top_k_weights, experts=self._grouped)
            stats = dispatcher.last_stats
            self.module.idempotent_stats = None if factor is None else (
                sum(stats.received) + stats.dropped, stats.capacity, stats.dropped)
            return _from_slices(out, self.tp_mesh, num_tokens) if sliced else out

    return IdempotentEP


def _to_slices(t: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's slice of a batch its TP group shares (no communication;
    the backward gathers the slices' gradients)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(0)]).to_local()


def _from_slices(t: torch.Tensor, mesh, num_tokens: int) -> torch.Tensor:
    """The TP group's slices gathered back into the whole batch."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(t.contiguous(), mesh, [Shard(0)], shape=(num_tokens, t.shape[-1]),
                              stride=(t.shape[-1], 1)).full_tensor()
