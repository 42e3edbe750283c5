"""torch.compile through every public in-place operation: each is a torch
custom op (idempotent_moe::*) while torch traces, so a function calling it
compiles into one graph with no break, and the compiled function leaves the
same bits in every buffer and output as the eager one, on fresh data."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("torch.library.custom_op needs torch 2.4", allow_module_level=True)

import idempotent_moe as imoe  # noqa: E402
from conftest import bits, make_data, make_scores, package_env  # noqa: E402
from idempotent_moe import _torch_ops  # noqa: E402

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _same(a, b, where="out") -> None:
    """a and b hold the same structure, and bit-identical tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=where)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _op_targets(graph_module) -> set:
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
    targets = _op_targets(explained.graphs[0])
    for name in op_names:
        assert f"idempotent_moe.{name}" in targets, (name, targets)
    compiled = torch.compile(fn, fullgraph=True)
    for seed in range(1, calls + 1):
        args_c, args_e = make(seed, device), make(seed, device)
        out_c = compiled(*args_c)
        out_e = fn(*args_e)
        _same(out_c, out_e)
        _same(list(args_c), list(args_e), "arguments")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(1000 + seed)


def _to(device, *arrays):
    return [a.to(device) for a in arrays]


def _distinct_rows(g, rows, n, k):
    return torch.from_numpy(np.stack([np.sort(g.choice(n, k, replace=False)) for _ in range(rows)]))


# --------------------------------------------------------------------------- the functional core


def _compact_swap(x, s):
    return imoe.compact_(x, s, 24)


def _make_compact_swap(seed, device):
    g = _rng(seed)
    return _to(device, make_data((4, 64, 8), "float16", "torch", g),
               make_scores((4, 64), "float32", "torch", g))


def _compact_list_move_stable(k, v, s, idx):
    res = imoe.compact_([k, v], s, 20, dim=2, mode="move", order="stable", protected_prefix=2,
                        recent_window=3, out_indices=idx)
    return res.values, res.indices


def _make_compact_list(seed, device):
    g = _rng(seed)
    return _to(device, make_data((2, 3, 48, 8), "float32", "torch", g),
               make_data((2, 3, 48, 4), "bfloat16", "torch", g),
               make_scores((2, 3, 48), "bfloat16", "torch", g),
               torch.zeros(2, 3, 20, dtype=torch.int32))


def _compact_active(x, act, tm):
    return imoe.compact_(x, active_indices=act, out_target_map=tm)


def _make_compact_active(seed, device):
    g = _rng(seed)
    return _to(device, make_data((4, 40, 6), "int8", "torch", g), _distinct_rows(g, 4, 40, 10),
               torch.zeros(4, 40, dtype=torch.int32))


def _compact_score_order_nan(x, s):
    return imoe.compact_(x, s, 16, order="score", nan="lowest")


def _make_compact_nan(seed, device):
    g = _rng(seed)
    s = make_scores((4, 64), "float16", "torch", g)
    s[:, ::7] = float("nan")
    return _to(device, make_data((4, 64, 3), "float32", "torch", g), s)


def _map_both(s):
    return imoe.idempotent_map(s, 16, form="both", protected_prefix=1)


def _make_scores_only(seed, device):
    return _to(device, make_scores((3, 50), "float32", "torch", _rng(seed)))


def _map_shared_active(act):
    return imoe.idempotent_map(active_indices=act, num_slots=40, lead_shape=(2, 3), form="target_map")


def _make_shared_active(seed, device):
    g = _rng(seed)
    return _to(device, torch.from_numpy(g.choice(40, 12, replace=False)))


def _apply_indices(x, s):
    idx = imoe.idempotent_map(s, 16)
    return imoe.apply_map_(x, idx, mode="move"), idx


def _apply_target_map(x, s):
    tm = imoe.idempotent_map(s, 16, form="target_map")
    return imoe.apply_map_(x, target_map=tm), tm


def _make_x_scores(seed, device):
    g = _rng(seed)
    return _to(device, make_data((3, 50, 5), "bfloat16", "torch", g),
               make_scores((3, 50), "float32", "torch", g))


def _restore(x, s):
    res = imoe.compact_(x, s, 16, order="stable")
    imoe.restore_(x, res.indices, order="stable")
    return res.indices


def _permute(x, perm, y, perm1):
    imoe.permute_(x, perm)
    imoe.permute_(y, perm1, dim=0, inverse=True)
    return x, y


def _make_permute(seed, device):
    g = _rng(seed)
    perm = torch.from_numpy(np.stack([g.permutation(30) for _ in range(4)]))
    return _to(device, make_data((4, 30, 7), "float16", "torch", g), perm,
               make_data((25, 3), "int8", "torch", g), torch.from_numpy(g.permutation(25)).int())


def _group(x, w, ids):
    return imoe.group_by_expert_([x, w], ids, 6)


def _make_group(seed, device):
    g = _rng(seed)
    return _to(device, make_data((40, 8), "float32", "torch", g), make_data((40, 1), "float32", "torch", g),
               torch.from_numpy(g.integers(0, 6, 40)))


def _ungroup(x, perm):
    return imoe.ungroup_(x, perm)


def _make_ungroup(seed, device):
    g = _rng(seed)
    return _to(device, make_data((40, 8), "float16", "torch", g), torch.from_numpy(g.permutation(40)))


FUNCTIONAL = [
    ("compact_", _compact_swap, _make_compact_swap, ["compact_"]),
    ("compact_ list move stable", _compact_list_move_stable, _make_compact_list, ["compact_"]),
    ("compact_ active target_map", _compact_active, _make_compact_active, ["compact_"]),
    ("compact_ score nan", _compact_score_order_nan, _make_compact_nan, ["compact_"]),
    ("idempotent_map", _map_both, _make_scores_only, ["idempotent_map"]),
    ("idempotent_map shared active", _map_shared_active, _make_shared_active, ["idempotent_map"]),
    ("apply_map_ indices", _apply_indices, _make_x_scores, ["idempotent_map", "apply_map_"]),
    ("apply_map_ target_map", _apply_target_map, _make_x_scores, ["idempotent_map", "apply_map_"]),
    ("restore_", _restore, _make_x_scores, ["compact_", "restore_"]),
    ("permute_", _permute, _make_permute, ["permute_"]),
    ("group_by_expert_", _group, _make_group, ["group_by_expert_"]),
    ("ungroup_", _ungroup, _make_ungroup, ["ungroup_"]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, fn, make, ops", FUNCTIONAL, ids=[c[0] for c in FUNCTIONAL])
def test_functional_compiles(name, fn, make, ops, device):
    assert_compiles(fn, make, device, ops)


# --------------------------------------------------------------------------- paged caches

NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM = 12, 4, 2, 8


def _make_pools(seed, device, layout="NHD"):
    g = _rng(seed)
    shape = ((NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM) if layout == "NHD"
             else (NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM))
    tables = torch.from_numpy(g.permutation(NUM_BLOCKS).reshape(3, 4).astype(np.int32))
    return _to(device, make_data(shape, "float16", "torch", g), make_data(shape, "float16", "torch", g),
               tables)


def _compact_paged_scores(k, v, tables, s):
    r = imoe.compact_paged_([k, v], tables, [14, 9, 16], 6, s, protected_prefix=1)
    return r.target_map, r.seq_lens, r.freed_blocks


def _make_paged_scores(seed, device):
    # per query head (4 for 2 KV heads), reduced by their mean: no infinities
    scores = make_scores((3, 4, 16), "float32", "torch", _rng(seed), ties=False)
    return _make_pools(seed, device) + _to(device, scores)


def _compact_paged_active(k, v, tables, a0, a1, a2):
    r = imoe.compact_paged_([k, v], tables, [14, 9, 16], active_indices=[a0, a1, a2], layout="HND",
                            mode="swap")
    return r.target_map, r.seq_lens, r.freed_blocks


def _make_paged_active(seed, device):
    g = _rng(seed)
    active = [_distinct_rows(g, HEADS, n, 5) for n in (14, 9, 16)]
    return _make_pools(seed, device, "HND") + _to(device, *active)


def _compact_paged_map(k, v, tables, tm):
    r = imoe.compact_paged_(k, tables, [14, 9, 16], [5, 9, 3], target_map=tm)
    return r.target_map, r.seq_lens, r.freed_blocks


def _make_paged_map(seed, device):
    s = make_scores((3, 16), "float32", "torch", _rng(seed))
    tm = imoe.paged_target_map(BLOCK, [14, 9, 16], [5, 9, 3], s)
    return _make_pools(seed, device) + _to(device, tm)


def _apply_paged(k, v, tables, tm):
    imoe.apply_paged_map_([k, v], tables, tm, layout="HND")


def _make_apply_paged(seed, device):
    s = make_scores((3, HEADS, 16), "float32", "torch", _rng(seed))
    tm = imoe.paged_target_map(BLOCK, [14, 9, 16], 6, s, kv_heads=HEADS)
    return _make_pools(seed, device, "HND") + _to(device, tm)


PAGED = [
    ("compact_paged_ scores", _compact_paged_scores, _make_paged_scores),
    ("compact_paged_ active HND", _compact_paged_active, _make_paged_active),
    ("compact_paged_ target_map", _compact_paged_map, _make_paged_map),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, fn, make", PAGED, ids=[c[0] for c in PAGED])
def test_compact_paged_compiles(name, fn, make, device):
    """Freed blocks are tensors under compile (lists in eager): compared as lists."""
    explained = torch._dynamo.explain(fn)(*make(0, device))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    assert "idempotent_moe.compact_paged_" in _op_targets(explained.graphs[0])
    compiled = torch.compile(fn, fullgraph=True)
    for seed in (1, 2):
        args_c, args_e = make(seed, device), make(seed, device)
        tm_c, lens_c, freed_c = compiled(*args_c)
        tm_e, lens_e, freed_e = fn(*args_e)
        assert all(isinstance(f, torch.Tensor) for f in freed_c)
        assert [f.tolist() for f in freed_c] == freed_e and lens_c == lens_e
        _same(tm_c, tm_e)
        _same(list(args_c), list(args_e), "arguments")


@pytest.mark.parametrize("device", DEVICES)
def test_apply_paged_map_compiles(device):
    assert_compiles(_apply_paged, _make_apply_paged, device, ["apply_paged_map_"])


def test_compact_paged_with_tensor_lengths_keeps_the_direct_path():
    """seq_lens as a tensor: its values size the map, so the call takes the
    direct path (a graph break), and still compacts as in eager."""
    def fn(k, v, tables, s, lens):
        return imoe.compact_paged_([k, v], tables, lens, 6, s).target_map

    lens = torch.tensor([14, 9, 16])
    explained = torch._dynamo.explain(fn)(*_make_paged_scores(0, "cpu"), lens)
    assert explained.graph_break_count >= 1
    args_c, args_e = _make_paged_scores(1, "cpu"), _make_paged_scores(1, "cpu")
    _same(torch.compile(fn)(*args_c, lens), fn(*args_e, lens))
    _same(args_c, args_e, "arguments")


# --------------------------------------------------------------------------- KV and MoE front ends


def _kv_inplace(k, v, s):
    return imoe.compact_kv_cache_inplace(k, v, s, 16, protected_prefix_len=2, recent_window=3,
                                         return_indices=True)


def _kv_compactor(k, v, s, act):
    kv = imoe.InplaceKVCompactor()
    first = kv.compact_from_scores(k, v, s, 20, head_reduce="max")
    tm = kv.build_idempotent_map(2, 2, 40, act, 6)
    return first, tm, kv.compact(k, v, tm, 6)


def _make_kv(seed, device):
    g = _rng(seed)
    return _to(device, make_data((2, 2, 40, 8), "float16", "torch", g),
               make_data((2, 2, 40, 4), "float16", "torch", g),
               make_scores((2, 4, 40), "float32", "torch", g, ties=False),
               torch.from_numpy(np.sort(g.choice(20, 6, replace=False))))


def _make_kv_scores(seed, device):
    return _make_kv(seed, device)[:3]


def _moe(x, s):
    router = imoe.InplaceMoERouter(hidden_dim=8, num_experts=4)
    kept, idx = router(x, s, 12, return_indices=True)
    tm = imoe.generate_idempotent_moe_map(s, 5)
    return kept, idx, tm, imoe.compact_moe_tokens_inplace(x, tm)


def _make_moe(seed, device):
    g = _rng(seed)
    return _to(device, make_data((4, 32, 8), "bfloat16", "torch", g),
               make_scores((4, 32), "float32", "torch", g))


KV_MOE = [
    ("compact_kv_cache_inplace", _kv_inplace, _make_kv_scores, ["compact_"]),
    ("InplaceKVCompactor", _kv_compactor, _make_kv, ["compact_", "idempotent_map", "apply_map_"]),
    ("moe", _moe, _make_moe, ["compact_", "idempotent_map", "apply_map_"]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, fn, make, ops", KV_MOE, ids=[c[0] for c in KV_MOE])
def test_front_ends_compile(name, fn, make, ops, device):
    assert_compiles(fn, make, device, ops)


def _hook_call(x, s):
    from idempotent_moe.integrations import HuggingFaceMoEInplaceHook

    return HuggingFaceMoEInplaceHook(capacity=10, mode="move")(x, s, return_indices=True)


def _hook_forward(hidden, logits):
    from idempotent_moe.integrations import HuggingFaceMoEInplaceHook

    hook = HuggingFaceMoEInplaceHook(8, 4, 2)
    d = hook.forward(hidden, logits, 12, return_indices=True)
    out = hook.combine(d.expert_inputs * 2 + 1, d.indices, d.weights, hidden.shape[0])
    return out, d.expert_inputs, d.indices


def _same_routing(compiled, eager) -> None:
    """The compacted buffer and indices bit for bit; the arithmetic around
    them (softmax, combine), which inductor fuses, to rounding."""
    _same(list(compiled[1:]), list(eager[1:]))
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)


def _make_routing(seed, device, grad=False):
    g = _rng(seed)
    hidden = torch.from_numpy(g.standard_normal((32, 8)).astype(np.float32)).to(device)
    logits = torch.from_numpy(g.standard_normal((32, 4)).astype(np.float32)).to(device)
    return [hidden.requires_grad_(grad), logits.requires_grad_(grad)]


@pytest.mark.parametrize("device", DEVICES)
def test_hook_compiles(device):
    assert_compiles(_hook_call, _make_moe, device, ["compact_"])
    with torch.no_grad():
        explained = torch._dynamo.explain(_hook_forward)(*_make_routing(0, device))
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        compiled = torch.compile(_hook_forward, fullgraph=True)
        for seed in (1, 2):
            _same_routing(compiled(*_make_routing(seed, device)), _hook_forward(*_make_routing(seed, device)))


@pytest.mark.parametrize("device", DEVICES)
def test_hook_backward_compiles(device):
    """With grad, the compaction runs in the hook's autograd Function (the
    op in forward, restore_'s op on the gradient in backward): no graph
    break, and the same outputs and gradients as eager (to rounding: the
    arithmetic around the compaction is fused by inductor)."""
    from idempotent_moe.integrations import HuggingFaceMoEInplaceHook

    HuggingFaceMoEInplaceHook(capacity=1)  # builds the autograd Function outside the compiled code
    explained = torch._dynamo.explain(_hook_forward)(*_make_routing(0, device, grad=True))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(_hook_forward, fullgraph=True)
    for seed in (1, 2):
        args_c, args_e = _make_routing(seed, device, True), _make_routing(seed, device, True)
        res_c, res_e = compiled(*args_c), _hook_forward(*args_e)
        (res_c[0] * res_c[0]).sum().backward()
        (res_e[0] * res_e[0]).sum().backward()
        _same_routing([t.detach() for t in res_c], [t.detach() for t in res_e])
        for a_c, a_e in zip(args_c, args_e):
            torch.testing.assert_close(a_c.grad, a_e.grad, rtol=1e-5, atol=1e-5)


def test_eviction_cache_compiles():
    """An update that evicts in place (InplaceEvictionCache: K, V, positions
    and scores moved by compact_) traces through the op with no break."""
    pytest.importorskip("transformers")
    from idempotent_moe.integrations import InplaceEvictionCache

    def fn(cache, k, v, k_next, v_next):
        cache.update(k, v, 0)       # prefill: 20 tokens, an eviction is due
        keys, values = cache.update(k_next, v_next, 0)  # evicts to 8, then appends
        layer = cache.layers[0]
        return keys, values, layer.positions

    def make(seed, device):
        g = _rng(seed)
        cache = InplaceEvictionCache(budget=8, sink_tokens=2, recent_window=2, evict_every=4,
                                     order="stable")
        # finite keys: their norms are the scores
        data = [torch.from_numpy(g.standard_normal(shape).astype(np.float32)) for shape in
                ((1, 2, 20, 8), (1, 2, 20, 8), (1, 2, 1, 8), (1, 2, 1, 8))]
        return [cache] + _to(device, *data)

    explained = torch._dynamo.explain(fn)(*make(0, "cpu"))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    assert "idempotent_moe.compact_" in _op_targets(explained.graphs[0])
    compiled = torch.compile(fn, fullgraph=True)
    for seed in (1, 2):
        args_c, args_e = make(seed, "cpu"), make(seed, "cpu")
        out_c, out_e = compiled(*args_c), fn(*args_e)
        _same(out_c, out_e)
        assert out_c[0].shape[2] == 9
        assert args_c[0].layers[0].evictions == args_e[0].layers[0].evictions == 1


# --------------------------------------------------------------------------- the ops themselves

EXPECTED_WRITES = {
    "compact_": {"x", "out_indices", "out_target_map", "workspace"},
    "idempotent_map": {"out_indices", "out_target_map", "workspace"},
    "apply_map_": {"x", "workspace"},
    "restore_": {"x", "workspace"},
    "permute_": {"x", "workspace"},
    "ungroup_": {"x", "workspace"},
    "group_by_expert_": {"x", "out_offsets", "out_perm", "workspace"},
    "apply_paged_map_": {"caches", "workspace"},
    "compact_paged_": {"caches", "out_target_map"},
}


@pytest.mark.parametrize("name", sorted(EXPECTED_WRITES))
def test_ops_declare_what_they_write(name):
    schema = getattr(torch.ops.idempotent_moe, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == EXPECTED_WRITES[name]
    assert len(schema.returns) == 0  # outputs are written arguments: never a view of an input


OPCHECK = [
    ("compact_", lambda g: ([make_data((4, 32, 8), "float16", "torch", g)],
                            make_scores((4, 32), "float32", "torch", g), None, 12, None, "swap",
                            "inplace", 0, 0, "raise", torch.empty(4, 12, dtype=torch.int64), None, None,
                            None)),
    ("idempotent_map", lambda g: (make_scores((4, 32), "float32", "torch", g), None, 12, 32, [4],
                                  "stable", 1, 2, "raise", torch.empty(4, 12, dtype=torch.int64), None,
                                  None, None)),
    ("permute_", lambda g: ([make_data((4, 32, 8), "float16", "torch", g)],
                            torch.from_numpy(g.permutation(32)), None, True, None, None)),
    ("group_by_expert_", lambda g: ([make_data((32, 8), "float32", "torch", g)],
                                    torch.from_numpy(g.integers(0, 5, 32)), 5, None,
                                    torch.empty(6, dtype=torch.int64), torch.empty(32, dtype=torch.int64),
                                    None, None)),
]


@pytest.mark.parametrize("name, make", OPCHECK, ids=[c[0] for c in OPCHECK])
def test_opcheck(name, make):
    """torch's own checks of a custom op: the schema (declared writes are the
    only writes), the fake implementation, AOT dispatch with dynamic shapes."""
    result = torch.library.opcheck(getattr(torch.ops.idempotent_moe, name).default, make(_rng(0)))
    assert set(result.values()) == {"SUCCESS"}, result


def test_ops_run_in_eager():
    """Called directly, an op runs the public function's direct path."""
    g = _rng(3)
    x = make_data((4, 32, 8), "float16", "torch", g)
    s = make_scores((4, 32), "float32", "torch", g)
    y = x.clone()
    idx = torch.empty(4, 12, dtype=torch.int64)
    torch.ops.idempotent_moe.compact_([x], s, None, 12, None, "move", "inplace", 0, 0, "raise", idx,
                                      None, None, None)
    ref = imoe.compact_(y, s, 12, mode="move")
    _same([x, idx], [y, ref.indices])


def test_op_inside_a_compile_session_takes_the_direct_path(monkeypatch):
    """While a compile session is open (torch 2.13 reports is_compiling() for
    its whole length), an op's real implementation still calls the direct
    path: the public function does not route back into the op."""
    from idempotent_moe import _tracing

    monkeypatch.setattr(_tracing, "compiling", lambda: True)
    g = _rng(5)
    x = make_data((2, 16, 4), "float32", "torch", g)
    s = make_scores((2, 16), "float32", "torch", g)
    y = x.clone()
    idx = torch.empty(2, 6, dtype=torch.int64)
    torch.ops.idempotent_moe.compact_([x], s, None, 6, None, "swap", "inplace", 0, 0, "raise", idx,
                                      None, None, None)
    monkeypatch.undo()
    _same([x, idx], [y, imoe.compact_(y, s, 6).indices])


def test_takes_only_torch_tensors():
    t = torch.zeros(3)
    assert _torch_ops.takes(t, None, [1, 2], [[0, 1]])
    assert _torch_ops.takes([t, t])
    assert not _torch_ops.takes(np.zeros(3))            # NumPy keeps the direct path
    assert not _torch_ops.takes(t, np.zeros(3))
    assert not _torch_ops.takes([1, 2])                 # no tensor at all
    assert not _torch_ops.takes(t, [1.5])


def test_eager_calls_do_not_load_the_ops():
    """With torch imported but nothing compiling, calls on torch tensors take
    the direct path: the ops module is never imported."""
    code = textwrap.dedent("""
        import sys
        import torch
        import idempotent_moe as imoe
        x = torch.arange(48.0).reshape(2, 8, 3)
        s = torch.rand(2, 8)
        res = imoe.compact_(x, s, 3)
        imoe.restore_(x, res.indices)
        imoe.permute_(x, torch.arange(8).flip(0))
        assert "idempotent_moe._torch_ops" not in sys.modules
        print("ok")
    """)
    env = package_env()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_bad_data_under_compile_raises_and_changes_nothing():
    def fn(x, s, idx):
        return imoe.compact_(x, s, 8, out_indices=idx).values

    compiled = torch.compile(fn, fullgraph=True)
    g = _rng(4)
    x = make_data((2, 16, 4), "float32", "torch", g)
    s = make_scores((2, 16), "float32", "torch", g)
    idx = torch.zeros(2, 8, dtype=torch.int64)
    compiled(x.clone(), s, idx.clone())  # compiles on good data
    s[1, 5] = float("nan")
    before = [bits(x), bits(idx)]
    with pytest.raises(ValueError, match="NaN"):
        compiled(x, s, idx)
    for now, then in zip((x, idx), before):
        np.testing.assert_array_equal(bits(now), then)


# --------------------------------------------------------------------------- CUDA graphs


@pytest.mark.gpu
def test_reduce_overhead_replays_compact_on_new_data():
    """mode="reduce-overhead" captures compact_ in a CUDA graph: new data
    copied into the static inputs is compacted by the replays as in eager."""
    from torch._dynamo.utils import counters

    dev = "cuda"
    x = torch.empty(8, 256, 64, dtype=torch.float16, device=dev)
    s = torch.empty(8, 256, dtype=torch.float32, device=dev)
    idx = torch.empty(8, 64, dtype=torch.int64, device=dev)
    for t in (x, s, idx):
        torch._dynamo.mark_static_address(t)

    def fn(x, s, idx):
        kept, indices = imoe.compact_(x, s, 64, out_indices=idx)
        return kept.float()  # a kernel after the op, reading its view (exact)

    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    counters.clear()
    for step in range(5):  # warm-up, recording, then replays
        g = _rng(100 + step)
        new_x = make_data((8, 256, 64), "float16", "torch", g).to(dev)
        new_s = make_scores((8, 256), "float32", "torch", g).to(dev)
        x.copy_(new_x)
        s.copy_(new_s)
        out = compiled(x, s, idx).clone()
        ref_x, ref_idx = new_x.clone(), torch.empty_like(idx)
        ref_out = fn(ref_x, new_s, ref_idx)
        torch.cuda.synchronize()
        _same([x, idx, out], [ref_x, ref_idx, ref_out], f"step {step}")
    imoe.check_errors(x)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_the_fused_plan_helpers_trace_without_a_graph_break():
    """The CUDA plan's checks (transformers' activation by class, the small-M
    weight layout) run inside a compiled forward: a graph break there split
    every MoE layer of a compiled model in two."""
    activations = pytest.importorskip("transformers.activations")
    from idempotent_moe.integrations import _dispatch

    w = torch.randn(4, 128, 64).transpose(-2, -1)

    def f(x, w):
        ok = (_dispatch.activation_name(activations.SiLUActivation()) == "silu"
              and _dispatch.grouped_gemm_takes(w, True))
        return x + 1 if ok else x - 1

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(2), w), torch.full((2,), 2.0))
    assert _dispatch.activation_name(activations.GELUActivation()) == "gelu"
    assert _dispatch.activation_name(torch.nn.Tanh()) is None
