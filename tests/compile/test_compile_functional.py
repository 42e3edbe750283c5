"""torch.compile through the functional core: compact_, idempotent_map,
apply_map_, restore_, permute_, group_by_expert_, ungroup_ and the paged
calls. Each is a torch custom op (idempotent_moe::*) while torch traces, so a
function calling it compiles into one graph with no break, and the compiled
function leaves the same bits in every buffer and output as the eager one,
on fresh data; on CUDA (`gpu`) also when replayed from a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("torch.library.custom_op needs torch 2.4", allow_module_level=True)

import idempotent_moe as imoe  # noqa: E402
from _helpers import make_data, make_scores  # noqa: E402
from _helpers.compiling import (  # noqa: E402
    DEVICES,
    assert_compiles,
    distinct_rows,
    op_targets,
    same,
    seeded,
    to_device,
)

# --------------------------------------------------------------------------- the functional core


def _compact_swap(x, s):
    return imoe.compact_(x, s, 24)


def _make_compact_swap(seed, device):
    g = seeded(seed)
    return to_device(device, make_data((4, 64, 8), "float16", "torch", g),
                     make_scores((4, 64), "float32", "torch", g))


def _compact_list_move_stable(k, v, s, idx):
    res = imoe.compact_([k, v], s, 20, dim=2, mode="move", order="stable", protected_prefix=2,
                        recent_window=3, out_indices=idx)
    return res.values, res.indices


def _make_compact_list(seed, device):
    g = seeded(seed)
    return to_device(device, make_data((2, 3, 48, 8), "float32", "torch", g),
                     make_data((2, 3, 48, 4), "bfloat16", "torch", g),
                     make_scores((2, 3, 48), "bfloat16", "torch", g),
                     torch.zeros(2, 3, 20, dtype=torch.int32))


def _compact_active(x, act, tm):
    return imoe.compact_(x, active_indices=act, out_target_map=tm)


def _make_compact_active(seed, device):
    g = seeded(seed)
    return to_device(device, make_data((4, 40, 6), "int8", "torch", g), distinct_rows(g, 4, 40, 10),
                     torch.zeros(4, 40, dtype=torch.int32))


def _compact_score_order_nan(x, s):
    return imoe.compact_(x, s, 16, order="score", nan="lowest")


def _make_compact_nan(seed, device):
    g = seeded(seed)
    s = make_scores((4, 64), "float16", "torch", g)
    s[:, ::7] = float("nan")
    return to_device(device, make_data((4, 64, 3), "float32", "torch", g), s)


def _map_both(s):
    return imoe.idempotent_map(s, 16, form="both", protected_prefix=1)


def _make_scores_only(seed, device):
    return to_device(device, make_scores((3, 50), "float32", "torch", seeded(seed)))


def _map_shared_active(act):
    return imoe.idempotent_map(active_indices=act, num_slots=40, lead_shape=(2, 3), form="target_map")


def _make_shared_active(seed, device):
    g = seeded(seed)
    return to_device(device, torch.from_numpy(g.choice(40, 12, replace=False)))


def _apply_indices(x, s):
    idx = imoe.idempotent_map(s, 16)
    return imoe.apply_map_(x, idx, mode="move"), idx


def _apply_target_map(x, s):
    tm = imoe.idempotent_map(s, 16, form="target_map")
    return imoe.apply_map_(x, target_map=tm), tm


def _make_x_scores(seed, device):
    g = seeded(seed)
    return to_device(device, make_data((3, 50, 5), "bfloat16", "torch", g),
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
    g = seeded(seed)
    perm = torch.from_numpy(np.stack([g.permutation(30) for _ in range(4)]))
    return to_device(device, make_data((4, 30, 7), "float16", "torch", g), perm,
                     make_data((25, 3), "int8", "torch", g), torch.from_numpy(g.permutation(25)).int())


def _group(x, w, ids):
    return imoe.group_by_expert_([x, w], ids, 6)


def _make_group(seed, device):
    g = seeded(seed)
    return to_device(device, make_data((40, 8), "float32", "torch", g),
                     make_data((40, 1), "float32", "torch", g), torch.from_numpy(g.integers(0, 6, 40)))


def _ungroup(x, perm):
    return imoe.ungroup_(x, perm)


def _make_ungroup(seed, device):
    g = seeded(seed)
    return to_device(device, make_data((40, 8), "float16", "torch", g), torch.from_numpy(g.permutation(40)))


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
    g = seeded(seed)
    shape = ((NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM) if layout == "NHD"
             else (NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM))
    tables = torch.from_numpy(g.permutation(NUM_BLOCKS).reshape(3, 4).astype(np.int32))
    return to_device(device, make_data(shape, "float16", "torch", g), make_data(shape, "float16", "torch", g),
                     tables)


def _compact_paged_scores(k, v, tables, s):
    r = imoe.compact_paged_([k, v], tables, [14, 9, 16], 6, s, protected_prefix=1)
    return r.target_map, r.seq_lens, r.freed_blocks


def _make_paged_scores(seed, device):
    # per query head (4 for 2 KV heads), reduced by their mean: no infinities
    scores = make_scores((3, 4, 16), "float32", "torch", seeded(seed), ties=False)
    return _make_pools(seed, device) + to_device(device, scores)


def _compact_paged_active(k, v, tables, a0, a1, a2):
    r = imoe.compact_paged_([k, v], tables, [14, 9, 16], active_indices=[a0, a1, a2], layout="HND",
                            mode="swap")
    return r.target_map, r.seq_lens, r.freed_blocks


def _make_paged_active(seed, device):
    g = seeded(seed)
    active = [distinct_rows(g, HEADS, n, 5) for n in (14, 9, 16)]
    return _make_pools(seed, device, "HND") + to_device(device, *active)


def _compact_paged_map(k, v, tables, tm):
    r = imoe.compact_paged_(k, tables, [14, 9, 16], [5, 9, 3], target_map=tm)
    return r.target_map, r.seq_lens, r.freed_blocks


def _make_paged_map(seed, device):
    s = make_scores((3, 16), "float32", "torch", seeded(seed))
    tm = imoe.paged_target_map(BLOCK, [14, 9, 16], [5, 9, 3], s)
    return _make_pools(seed, device) + to_device(device, tm)


def _apply_paged(k, v, tables, tm):
    imoe.apply_paged_map_([k, v], tables, tm, layout="HND")


def _make_apply_paged(seed, device):
    s = make_scores((3, HEADS, 16), "float32", "torch", seeded(seed))
    tm = imoe.paged_target_map(BLOCK, [14, 9, 16], 6, s, kv_heads=HEADS)
    return _make_pools(seed, device, "HND") + to_device(device, tm)


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
    assert "idempotent_moe.compact_paged_" in op_targets(explained.graphs[0])
    compiled = torch.compile(fn, fullgraph=True)
    for seed in (1, 2):
        args_c, args_e = make(seed, device), make(seed, device)
        tm_c, lens_c, freed_c = compiled(*args_c)
        tm_e, lens_e, freed_e = fn(*args_e)
        assert all(isinstance(f, torch.Tensor) for f in freed_c)
        assert [f.tolist() for f in freed_c] == freed_e and lens_c == lens_e
        same(tm_c, tm_e)
        same(list(args_c), list(args_e), "arguments")


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
    same(torch.compile(fn)(*args_c, lens), fn(*args_e, lens))
    same(args_c, args_e, "arguments")


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
        g = seeded(100 + step)
        new_x = make_data((8, 256, 64), "float16", "torch", g).to(dev)
        new_s = make_scores((8, 256), "float32", "torch", g).to(dev)
        x.copy_(new_x)
        s.copy_(new_s)
        out = compiled(x, s, idx).clone()
        ref_x, ref_idx = new_x.clone(), torch.empty_like(idx)
        ref_out = fn(ref_x, new_s, ref_idx)
        torch.cuda.synchronize()
        same([x, idx, out], [ref_x, ref_idx, ref_out], f"step {step}")
    imoe.check_errors(x)
    assert counters["inductor"]["cudagraph_skips"] == 0
