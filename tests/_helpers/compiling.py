"""What the torch.compile tests share: the devices, a bit-for-bit comparison
of tensors and structures of them, the ops of a traced graph, and
assert_compiles. Import it after `pytest.importorskip("torch")`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from . import bits

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def same(a, b, where="out") -> None:
    """a and b hold the same structure, and bit-identical tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=where)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def op_targets(graph_module) -> set:
    """The call targets of a graph, overloads by their packet's name."""
    return {str(n.target).removesuffix(".default") for n in graph_module.graph.nodes
            if n.op == "call_function"}


def assert_compiles(fn, make, device, op_names, calls=2):
    """fn(*make(seed, device)) traces into one graph with no break, holding the
    ops named; compiled with fullgraph=True it leaves the same bits as eager in
    every argument and output, on `calls` fresh inputs."""
    explained = torch._dynamo.explain(fn)(*make(0, device))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    targets = op_targets(explained.graphs[0])
    for name in op_names:
        assert f"idempotent_moe.{name}" in targets, (name, targets)
    compiled = torch.compile(fn, fullgraph=True)
    for seed in range(1, calls + 1):
        args_c, args_e = make(seed, device), make(seed, device)
        out_c = compiled(*args_c)
        out_e = fn(*args_e)
        same(out_c, out_e)
        same(list(args_c), list(args_e), "arguments")


def seeded(seed: int) -> np.random.Generator:
    return np.random.default_rng(1000 + seed)


def to_device(device, *arrays):
    return [a.to(device) for a in arrays]


def distinct_rows(g, rows, n, k):
    return torch.from_numpy(np.stack([np.sort(g.choice(n, k, replace=False)) for _ in range(rows)]))
