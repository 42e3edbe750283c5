"""Expert parallelism (idempotent_moe.distributed): two ranks over gloo on
127.0.0.1, each a subprocess running this file, against a single-process
reference with the same experts: dropless (fp32 within 1e-6, bf16 close),
capacity mode (per expert the top C assignments by routing weight, ties to
the lower (rank, token) index, dropped ones adding nothing), uneven and empty
ranks, experts that receive nothing, and bad arguments. Both ranks run every
scenario in one launch (one torch import, one process group). The NCCL run of
the same code on two GPUs is under the `gpu` marker."""

from __future__ import annotations

import argparse
import math
import weakref

import pytest
from _helpers import run_ranks

torch = pytest.importorskip("torch")

WORLD = 2
TIMEOUT_S = 120


def _scenarios() -> dict:
    """Name -> global inputs (the concatenation of the ranks' tokens in rank
    order) and settings; deterministic, so every process builds the same."""
    g = torch.Generator().manual_seed(1234)

    def make(tokens, num_experts, top_k, hidden=16, cf=None, dtype=torch.float32, ties=False,
             skip_experts=()):
        total = sum(tokens)
        allowed = [e for e in range(num_experts) if e not in skip_experts]
        order = torch.rand(total, len(allowed), generator=g).argsort(1)[:, :top_k]
        ids = torch.tensor(allowed)[order]
        if ties:
            weights = torch.tensor([0.25, 0.5])[torch.randint(0, 2, (total, top_k), generator=g)]
        else:
            weights = torch.rand(total, top_k, generator=g).softmax(-1)
        x = torch.randn(total, hidden, generator=g).to(dtype)
        return dict(tokens=tokens, num_experts=num_experts, top_k=top_k, cf=cf, x=x, ids=ids,
                    weights=weights)

    return {
        "dropless": make((13, 7), 8, 2),
        "dropless_int32_k1": make((9, 11), 2, 1),
        "dropless_bf16": make((12, 12), 4, 2, dtype=torch.bfloat16),
        "dropless_empty_rank": make((10, 0), 4, 2),
        "dropless_idle_expert": make((6, 5), 8, 3, skip_experts=(2, 5, 6)),
        "capacity_1.0": make((16, 12), 8, 2, cf=1.0),
        "capacity_0.5_ties": make((14, 10), 4, 2, cf=0.5, ties=True),
        "capacity_0.3_idle_expert": make((11, 13), 8, 2, cf=0.3, skip_experts=(7,)),
        "capacity_keep_all": make((8, 8), 2, 1, cf=4.0),
    }


def _experts(num_experts: int, hidden: int):
    g = torch.Generator().manual_seed(99)
    w = torch.randn(num_experts, hidden, hidden, generator=g) / math.sqrt(hidden)
    b = torch.randn(num_experts, hidden, generator=g) * 0.1

    def fn(e, x):
        return torch.tanh(x.float() @ w[e].to(x.device) + b[e].to(x.device)).to(x.dtype)

    return fn


def _reference(s: dict) -> tuple[torch.Tensor, int]:
    """Single process: every assignment computed, or per expert the top C by
    routing weight with ties to the lower global token index; (out, dropped)."""
    x, ids, weights = s["x"], s["ids"].long(), s["weights"]
    total, top_k = ids.shape
    fn = _experts(s["num_experts"], x.shape[1])
    y = torch.zeros(total, top_k, x.shape[1], dtype=x.dtype)
    keep = torch.ones(total, top_k, dtype=torch.bool)
    if s["cf"] is not None:
        cap = min(total, math.ceil(total * top_k / s["num_experts"] * s["cf"]))
        keep.zero_()
        for e in range(s["num_experts"]):
            cand = [(t, j) for t in range(total) for j in range(top_k) if ids[t, j] == e]
            cand.sort(key=lambda tj: (-float(weights[tj]), tj[0]))
            for t, j in cand[:cap]:
                keep[t, j] = True
    for e in range(s["num_experts"]):
        t, j = (ids == e).nonzero(as_tuple=True)
        if len(t):
            y[t, j] = fn(e, x[t])
    acc = torch.zeros(total, x.shape[1])
    for j in range(top_k):
        acc += torch.where(keep[:, j, None], y[:, j].float() * weights[:, j, None].float(), 0.0)
    return acc.to(x.dtype), int((~keep).sum())


TRAIN = {  # name: (scenario, expert kind)
    "train_dropless_fn": ("dropless", "fn"),
    "train_capacity_fn": ("capacity_1.0", "fn"),
    "train_dropless_grouped": ("dropless", "grouped"),
    "train_capacity_grouped": ("capacity_0.5_ties", "grouped"),
    "train_dropless_grouped_shard": ("dropless_idle_expert", "grouped_shard"),
}
INTER = 12  # the grouped experts' intermediate size


def _trainable(num_experts: int, hidden: int, kind: str) -> dict:
    """Leaf parameters of the experts: W, b for the per-expert function, or
    the gated MLP's w_up [E, D, 2I] and w_down [E, I, D] (silu)."""
    g = torch.Generator().manual_seed(7)
    if kind == "fn":
        return {"w": (torch.randn(num_experts, hidden, hidden, generator=g) / math.sqrt(hidden)),
                "b": torch.randn(num_experts, hidden, generator=g) * 0.1}
    return {"w_up": torch.randn(num_experts, hidden, 2 * INTER, generator=g) / math.sqrt(hidden),
            "w_down": torch.randn(num_experts, INTER, hidden, generator=g) / math.sqrt(INTER)}


def _expert_out(params: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """One expert on its rows, differentiable, in fp32."""
    if "w" in params:
        return torch.tanh(x @ params["w"][e] + params["b"][e])
    gate_up = x @ params["w_up"][e]
    return (torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]) @ params["w_down"][e]


def _train_reference(s: dict, kind: str) -> dict:
    """Single process, autograd: the output and the gradients of
    sum(out * G) w.r.t. hidden, the routing weights and the experts."""
    x = s["x"].float().clone().requires_grad_()
    weights = s["weights"].clone().requires_grad_()
    params = {k: v.requires_grad_() for k, v in _trainable(s["num_experts"], x.shape[1], kind).items()}
    ids = s["ids"].long()
    total, top_k = ids.shape
    keep = torch.ones(total, top_k, dtype=torch.bool)
    if s["cf"] is not None:
        cap = min(total, math.ceil(total * top_k / s["num_experts"] * s["cf"]))
        keep.zero_()
        for e in range(s["num_experts"]):
            cand = [(t, j) for t in range(total) for j in range(top_k) if ids[t, j] == e]
            cand.sort(key=lambda tj: (-float(s["weights"][tj]), tj[0]))
            for t, j in cand[:cap]:
                keep[t, j] = True
    out = torch.zeros(total, x.shape[1])
    for t in range(total):
        for j in range(top_k):
            if keep[t, j]:
                out = out + torch.zeros_like(out).index_add(
                    0, torch.tensor([t]), weights[t, j] * _expert_out(params, int(ids[t, j]), x[t:t + 1]))
    g = torch.Generator().manual_seed(11)
    grad = torch.randn(out.shape, generator=g)
    (out * grad).sum().backward()
    return {"out": out.detach(), "hidden": x.grad, "weights": weights.grad,
            **{k: v.grad for k, v in params.items()}, "grad": grad}


def _train_rank(dispatcher, s: dict, kind: str, sl: slice, device) -> dict:
    """This rank's share: its tokens' output and gradients, and its
    experts' parameter gradients (the ranks' sum is the reference's)."""
    x = s["x"][sl].float().to(device).requires_grad_()
    weights = s["weights"][sl].to(device).requires_grad_()
    full = _trainable(s["num_experts"], x.shape[1], kind)
    local = dispatcher.num_local_experts
    first = dispatcher.first_expert
    if kind == "grouped_shard":  # this rank holds only its own experts' weights
        params = {k: v[first:first + local].to(device).requires_grad_() for k, v in full.items()}
    else:
        params = {k: v.to(device).requires_grad_() for k, v in full.items()}
    if kind == "fn":
        out = dispatcher(x, s["ids"][sl].to(device), weights, lambda e, rows: _expert_out(params, e, rows))
    else:
        experts = (params["w_up"], params["w_down"], "silu")
        out = dispatcher(x, s["ids"][sl].to(device), weights, experts=experts)
    g = torch.Generator().manual_seed(11)
    grad = torch.randn(sum(s["tokens"]), x.shape[1], generator=g)[sl].to(device)
    (out * grad).sum().backward()
    grads = {}
    for k, v in params.items():
        got = v.grad.cpu()
        if kind == "grouped_shard":  # place the shard's gradient among all experts
            whole = torch.zeros_like(full[k])
            whole[first:first + local] = got
            got = whole
        grads[k] = got
    return {"out": out.detach().cpu(), "hidden": x.grad.cpu(), "weights": weights.grad.cpu(), **grads}


# ----------------------------------------------------------------------------- the worker


def _worker(rank: int, port: int, out_path: str, device_kind: str) -> None:
    import torch.distributed as dist
    from idempotent_moe.distributed import ExpertParallelDispatcher

    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    device = torch.device(device_kind, rank) if device_kind == "cuda" else torch.device("cpu")
    results = {}
    try:
        for name, s in _scenarios().items():
            if device_kind == "cuda" and s["cf"] is not None:
                import idempotent_moe

                if not idempotent_moe.cuda_available():
                    continue
            start = sum(s["tokens"][:rank])
            sl = slice(start, start + s["tokens"][rank])
            ids = s["ids"][sl].to(torch.int32 if "int32" in name else torch.int64)
            disp = ExpertParallelDispatcher(s["num_experts"], s["top_k"], capacity_factor=s["cf"])
            out = disp(s["x"][sl].to(device), ids.to(device), s["weights"][sl].to(device),
                       _experts(s["num_experts"], s["x"].shape[1]))
            results[name] = (out.cpu(), disp.last_stats)
        for name, (scenario, kind) in TRAIN.items():
            s = _scenarios()[scenario]
            start = sum(s["tokens"][:rank])
            sl = slice(start, start + s["tokens"][rank])
            disp = ExpertParallelDispatcher(s["num_experts"], s["top_k"], capacity_factor=s["cf"])
            results[name] = (_train_rank(disp, s, kind, sl, device), disp.last_stats)
        for name, args in {"odd_experts": (3, 1), "bad_top_k": (4, 5)}.items():
            try:
                ExpertParallelDispatcher(*args)
                results[name] = None
            except ValueError as exc:
                results[name] = str(exc)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(results, out_path)


def _launch(tmp_path, device_kind: str) -> list:
    paths = [str(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    run_ranks(__file__, [(paths[r], device_kind) for r in range(WORLD)], TIMEOUT_S)
    return [torch.load(path, weights_only=False) for path in paths]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("ep"), "cpu")


def _check(results, name):
    """The ranks' outputs against the single-process reference: fp32 within
    a few roundings (a row's matmul may round differently with the rows that
    travel beside it: the CPU's BLAS picks its kernel by the batch's size),
    bf16 within its rounding."""
    s = _scenarios()[name]
    ref, ref_dropped = _reference(s)
    out = torch.cat([results[r][name][0] for r in range(WORLD)])
    assert out.dtype == s["x"].dtype and out.shape == s["x"].shape
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    stats = [results[r][name][1] for r in range(WORLD)]
    assert sum(st.dropped for st in stats) == ref_dropped
    assert all(st.total_tokens == sum(s["tokens"]) for st in stats)
    # Only kept assignments travel: what the ranks received is the total less the dropped.
    total_assignments = sum(s["tokens"]) * s["top_k"]
    assert sum(sum(st.received) for st in stats) == total_assignments - ref_dropped
    assert [stats[0].sent[1], stats[1].sent[0]] == [stats[1].received[0], stats[0].received[1]]
    row = s["x"].shape[1] * s["x"].element_size()
    for r, st in enumerate(stats):
        assert st.row_bytes == st.sent[1 - r] * row  # no dropped row crosses to the other rank
    return stats, ref_dropped


DROPLESS = ["dropless", "dropless_int32_k1", "dropless_bf16", "dropless_empty_rank", "dropless_idle_expert"]
CAPACITY = ["capacity_1.0", "capacity_0.5_ties", "capacity_0.3_idle_expert", "capacity_keep_all"]


@pytest.mark.parametrize("name", DROPLESS)
def test_dropless_matches_single_process(gloo_results, name):
    stats, dropped = _check(gloo_results, name)
    assert dropped == 0 and all(st.capacity is None for st in stats)


@pytest.mark.parametrize("name", CAPACITY)
def test_capacity_drops_lowest_weight_overflow(gloo_results, name):
    stats, dropped = _check(gloo_results, name)
    s = _scenarios()[name]
    total = sum(s["tokens"])
    cap = min(total, math.ceil(total * s["top_k"] / s["num_experts"] * s["cf"]))
    assert all(st.capacity == cap for st in stats)
    if name == "capacity_keep_all":
        assert dropped == 0
    else:
        assert dropped > 0  # the scenarios are sized to overflow


@pytest.mark.parametrize("name", list(TRAIN))
def test_gradients_match_single_process(gloo_results, name):
    """Forward and backward through two ranks: each rank's tokens get the
    output and the gradients (hidden, routing weights) of the single-process
    experts, and the experts' parameter gradients summed over the ranks
    (each rank's experts saw the tokens of both) are the reference's; a
    dropped assignment's routing weight gets exactly zero gradient."""
    scenario, kind = TRAIN[name]
    s = _scenarios()[scenario]
    ref = _train_reference(s, "fn" if kind == "fn" else "grouped")
    ranks = [gloo_results[r][name][0] for r in range(WORLD)]
    for key in ("out", "hidden", "weights"):
        got = torch.cat([rk[key] for rk in ranks])
        torch.testing.assert_close(got, ref[key], atol=1e-5, rtol=1e-5, msg=f"{name}: {key}")
    for key in [k for k in ref if k.startswith(("w", "b")) and k != "weights"]:
        got = sum(rk[key] for rk in ranks)
        torch.testing.assert_close(got, ref[key], atol=1e-5, rtol=1e-5, msg=f"{name}: d {key}")
    if s["cf"] is not None:
        assert (ref["weights"] == 0).sum() > 0  # some assignments dropped: their gradient is exactly 0
        got = torch.cat([rk["weights"] for rk in ranks])
        assert torch.equal(got == 0, ref["weights"] == 0)


def test_bad_arguments(gloo_results):
    for r in range(WORLD):
        assert "multiple of the world size" in gloo_results[r]["odd_experts"]
        assert "top_k" in gloo_results[r]["bad_top_k"]


def test_needs_a_process_group():
    from idempotent_moe.distributed import ExpertParallelDispatcher

    with pytest.raises(RuntimeError, match="process group"):
        ExpertParallelDispatcher(4, 2)


class _LiveBytes:
    """A TorchDispatchMode counting the bytes of every storage an op creates
    (not a view or an in-place result of its inputs) until the tensor that
    created it is freed; `peak` is the most alive at once. A view keeps its
    base tensor alive, so a lingering view counts as its whole buffer."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.live = self.peak = 0
                self._ptrs = set()

            def _release(self, ptr, nbytes):
                self.live -= nbytes
                self._ptrs.discard(ptr)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)}
                for t in tree_leaves(out):
                    if not isinstance(t, torch.Tensor):
                        continue
                    ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                    if nbytes and ptr not in inputs and ptr not in self._ptrs:
                        self._ptrs.add(ptr)
                        self.live += nbytes
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(t, self._release, ptr, nbytes)
                return out

        return Mode()


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_receive_buffer_is_freed_before_the_combine(tmp_path, capacity_factor, monkeypatch):
    """One rank (gloo, world size 1): the dispatcher's peak is that of the
    combine (the returned rows, the fp32 sum and two [T, D] fp32 terms), not
    that plus the receive buffer, which an alias or a lingering view of it
    would keep alive. The exchange is a local copy here (exact for one rank):
    gloo's worker thread may hold a sent buffer a moment past the call, which
    would make the count depend on thread timing."""
    import torch.distributed as dist
    from idempotent_moe.distributed import ExpertParallelDispatcher

    def exchange(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        output.copy_(input)

    monkeypatch.setattr(dist, "all_to_all_single", exchange)

    tokens, hidden_size, top_k, experts = 256, 256, 2, 4
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(tokens, hidden_size, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        dispatcher = ExpertParallelDispatcher(experts, top_k, capacity_factor=capacity_factor)
        def expert_fn(e, rows):
            return rows * (1 + e)
        want = dispatcher(hidden, ids, weights, expert_fn)
        mode = _LiveBytes()
        with mode:
            got = dispatcher(hidden, ids, weights, expert_fn)
    finally:
        dist.destroy_process_group()
    assert torch.equal(got, want)
    rows = tokens * top_k * hidden_size * 4  # the receive buffer, and the returned rows
    term = tokens * hidden_size * 4  # one [T, D] fp32 tensor
    assert mode.peak >= rows + 3 * term  # the combine's own tensors were seen
    assert mode.peak <= rows + 3 * term + 64 * 1024, mode.peak


@pytest.mark.parametrize("bad", ["broadcast_row", "too_few_rows", "not_a_tensor"])
def test_expert_fn_of_the_wrong_shape_is_refused(tmp_path, bad, monkeypatch):
    """One rank (world size 1): an expert_fn whose result would broadcast into
    its rows, or not fit them, raises and names the expert."""
    import torch.distributed as dist
    from idempotent_moe.distributed import ExpertParallelDispatcher

    def exchange(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        output.copy_(input)

    monkeypatch.setattr(dist, "all_to_all_single", exchange)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(16, 8, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(16)])
    weights = torch.rand(16, 2, generator=g)

    def expert_fn(e, rows):
        if bad == "broadcast_row":
            return rows[:1]
        if bad == "too_few_rows":
            return rows[1:]
        return rows.tolist()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"expert_fn\(0, rows \[\d+, 8\]\) must return"):
            ExpertParallelDispatcher(4, 2)(hidden, ids, weights, expert_fn)
    finally:
        dist.destroy_process_group()


def _capacity_order_reference(local_ids: list, weights: list) -> list:
    """Sorted by local expert, then weight descending (NaN below -inf, -0 ==
    +0), then arrival index: Python's stable sorts, one key at a time."""
    def rank(w):
        return (0, 0.0) if math.isnan(w) else (1, w)
    order = sorted(range(len(weights)), key=lambda i: rank(weights[i]), reverse=True)
    return sorted(order, key=lambda i: local_ids[i])


def _capacity_order_inputs(n: int, local: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    local_ids = torch.randint(0, local, (n,), generator=g)
    special = torch.tensor([float("nan"), -0.0, 0.0, float("-inf"), float("inf"), 0.25, -0.25, 1.0])
    pick = torch.randint(0, 3, (n,), generator=g)
    weights = torch.where(pick == 0, special[torch.randint(0, len(special), (n,), generator=g)],
                          torch.where(pick == 1, torch.rand(n, generator=g).round(decimals=1),
                                      torch.rand(n, generator=g)))
    return local_ids, weights.float()


@pytest.mark.parametrize("n,local,seed", [(0, 3, 0), (1, 1, 1), (37, 4, 2), (500, 7, 3), (2000, 128, 4)])
def test_capacity_order_sorts_by_expert_then_weight_then_arrival(n, local, seed):
    """The dispatcher's capacity permutation: every local expert's rows
    together, highest routing weight first, NaN last, -0 tied with +0, ties
    in arrival order; the result is a permutation of [0, n)."""
    from idempotent_moe.distributed import capacity_order

    local_ids, weights = _capacity_order_inputs(n, local, seed)
    perm = capacity_order(local_ids, weights)
    assert perm.dtype == torch.int64 and perm.shape == (n,)
    assert perm.tolist() == _capacity_order_reference(local_ids.tolist(), weights.tolist())


@pytest.mark.gpu
def test_capacity_order_on_gpu_matches_cpu():
    from idempotent_moe.distributed import capacity_order

    local_ids, weights = _capacity_order_inputs(5000, 16, 5)
    want = capacity_order(local_ids, weights)
    got = capacity_order(local_ids.cuda(), weights.cuda())
    assert got.cpu().tolist() == want.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_two_gpus(tmp_path):
    results = _launch(tmp_path, "cuda")
    for name in DROPLESS + CAPACITY:
        if name in results[0]:
            _check(results, name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("out")
    parser.add_argument("device", choices=["cpu", "cuda"])
    a = parser.parse_args()
    _worker(a.rank, a.port, a.out, a.device)
