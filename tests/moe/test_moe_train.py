"""Training on the library's MoE path: the backward kernels (gated_act_backward,
moe_gather_rows, moe_weight_grad) against plain torch references, the
autograd of the torch ops (gradcheck in float64), the fused experts layer
(gradcheck dropless and capacity, float32 and bf16 against float64, frozen
experts, dropped assignments, what is saved for backward), torch.compile
(fullgraph, forward and backward), and CUDA against the CPU (`gpu`)."""

import pytest

torch = pytest.importorskip("torch")

from idempotent_moe import _moe_autograd as ag  # noqa: E402
from idempotent_moe import _moe_torch_ops, moe  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ACTS = ["silu", "gelu", "gelu_tanh", "relu"]
T, H, E, K, INTER = 7, 8, 4, 2, 6


def routing(num_tokens=T, num_experts=E, top_k=K, seed=0, skew=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skew:
        logits[:, 0] += 3.0
    w, idx = torch.softmax(logits, -1).topk(top_k, -1)
    return (w / w.sum(-1, keepdim=True)).to(device), idx.to(device)


def layer_inputs(dtype=torch.float64, seed=0, device="cpu", grad=True):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype) \
            .requires_grad_(grad)
    return rand(T, H), rand(E, H, 2 * INTER, scale=0.4), rand(E, INTER, H, scale=0.4)


def reference_layer(hidden, idx, w, w_up, w_down, act, capacity=None):
    """The experts layer with torch ops only, per assignment (the truth)."""
    keep = torch.ones_like(w, dtype=torch.bool)
    if capacity is not None:  # each expert keeps its C highest weights, ties to the lower token
        for e in range(E):
            pos = (idx == e).nonzero()
            order = sorted(pos.tolist(), key=lambda p: (-float(w[p[0], p[1]]), p[0]))
            for t, j in order[capacity:]:
                keep[t, j] = False
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(idx.shape[1]):
            if keep[t, j]:
                e = int(idx[t, j])
                h = hidden[t] @ w_up[e]
                a = ag._ACT[act](h[:INTER]) * h[INTER:]
                out[t] = out[t] + w[t, j] * (a @ w_down[e])
    return out


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gated_act_backward_matches_the_float64_derivative(act, dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(9, 2 * 5, generator=g) * 2).to(dtype)
    grad = torch.randn(9, 5, generator=g).to(dtype)
    limit = torch.tensor([3, 3, 7], dtype=torch.int32)
    out = moe.gated_act_backward(gate_up, grad, act, limit=limit)
    x = gate_up.double().requires_grad_()
    y = ag._ACT[act](x[:, :5]) * x[:, 5:]
    (truth,) = torch.autograd.grad(y, x, grad.double())
    eps = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    err = (out[:7].double() - truth[:7]).abs() / (truth[:7].abs() + 1)
    assert err.max() <= eps
    assert (out[7:] == 0).all()  # rows past the limit are zeros
    assert torch.equal(out, ag.ref_gated_act_backward(gate_up, grad, act, limit)) or dtype != torch.float32 \
        or (out - ag.ref_gated_act_backward(gate_up, grad, act, limit)).abs().max() < 1e-5


def lane_dot(grad, a):
    """<grad[r], a[r]> in the fused pass's order: float32 products, feature i
    to lane (i // 8) % 32 in increasing i, then p[l] += p[l + s]."""
    prod = grad.float() * a.float()
    lanes = torch.zeros(prod.shape[0], 32)
    for i in range(prod.shape[1]):
        lanes[:, (i // 8) % 32] += prod[:, i]
    s = 16
    while s:
        lanes[:, :s] = lanes[:, :s] + lanes[:, s:2 * s]
        s //= 2
    return lanes[:, :1]


def fused_act_inputs(dtype, inter, rows=11, seed=5, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 2).to(device, dtype)
    grad = torch.randn(rows, inter, generator=g).to(device, dtype)
    scale = torch.rand(rows, 1, generator=g).to(device)
    return gate_up, grad, scale, torch.tensor([2, 5, 8], dtype=torch.int32, device=device)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [37, 264])  # a partial last chunk; more chunks than lanes
def test_gated_act_backward_scales_rows_and_gives_the_forward_and_its_dot_in_one_pass(act, dtype, inter):
    gate_up, grad, scale, limit = fused_act_inputs(dtype, inter)
    act_out = torch.full((11, inter), 7.0, dtype=dtype)
    dot = torch.full((11, 1), 7.0)
    out = moe.gated_act_backward(gate_up, grad, act, limit=limit, row_scale=scale, act_out=act_out,
                                 row_dot=dot)
    # d(gate_up) of the scaled grad: the plain kernel given grad * scale in float32, bit for bit
    assert torch.equal(out, moe.gated_act_backward(gate_up, grad.float() * scale, act, limit=limit))
    fwd = moe.gated_act(gate_up, act, limit=limit)  # the forward's bits
    assert torch.equal(act_out[:8], (fwd[:8].float() * scale[:8]).to(dtype))
    assert torch.equal(dot[:8], lane_dot(grad[:8], fwd[:8]))
    assert (act_out[8:] == 0).all() and (dot[8:] == 0).all() and (out[8:] == 0).all()
    truth = (grad[:8].double() * fwd[:8].double()).sum(-1, keepdim=True)
    assert torch.allclose(dot[:8].double(), truth, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_backward_writes_act_out_over_grad_itself(dtype):
    gate_up, grad, scale, limit = fused_act_inputs(dtype, 40)
    apart = torch.empty_like(grad)
    dot = torch.empty(11, 1)
    want = moe.gated_act_backward(gate_up, grad, "silu", limit=limit, row_scale=scale, act_out=apart,
                                  row_dot=dot)
    dot_in_place = torch.empty(11, 1)
    got = moe.gated_act_backward(gate_up, grad, "silu", limit=limit, row_scale=scale, act_out=grad,
                                 row_dot=dot_in_place)
    assert torch.equal(got, want) and torch.equal(grad, apart) and torch.equal(dot_in_place, dot)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_backward_writes_d_gate_up_over_gate_up_itself(act, dtype):
    gate_up, grad, scale, limit = fused_act_inputs(dtype, 40)
    dot, act_out = torch.empty(11, 1), torch.empty_like(grad)
    want = moe.gated_act_backward(gate_up, grad, act, limit=limit, row_scale=scale, act_out=act_out,
                                  row_dot=dot)
    over, dot2, act_out2 = gate_up.clone(), torch.empty(11, 1), torch.empty_like(grad)
    got = moe.gated_act_backward(over, grad, act, limit=limit, row_scale=scale, act_out=act_out2,
                                 row_dot=dot2, out=over)
    assert got.data_ptr() == over.data_ptr() and torch.equal(over, want)
    assert torch.equal(act_out2, act_out) and torch.equal(dot2, dot)  # read from gate_up before it changed


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_writes_each_assignment_row_and_zeros_elsewhere(weighted, dtype):
    src = torch.randn(4, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    dest = torch.tensor([[0, 5], [2, -1], [-1, -1], [3, 1]], dtype=torch.int32)
    w = torch.rand(4, 2, generator=torch.Generator().manual_seed(2)) if weighted else None
    out = torch.full((7, 5), float("nan"), dtype=dtype)
    moe.moe_gather_rows(src, dest, 7, weights=w, out=out)
    assert torch.equal(out, ag.ref_gather_rows(src, dest, 7, w, dtype))
    assert (out[[4, 6]] == 0).all()


def test_weight_grad_is_the_dot_product_in_the_documented_order():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(3, 70, generator=g), torch.randn(5, 70, generator=g)
    dest = torch.tensor([[4, -1], [0, 2], [1, 3]], dtype=torch.int64)
    out = moe.moe_weight_grad(a, b, dest)
    lanes = torch.zeros(3, 2, 32)
    for h in range(70):  # lane h mod 32, in increasing h, each product rounded
        prod = a[:, None, h] * b[dest.clamp(min=0), h]
        lanes[:, :, h % 32] += prod
    s = 16
    while s:
        lanes[..., :s] = lanes[..., :s] + lanes[..., s:2 * s]
        s //= 2
    truth = lanes[..., 0].masked_fill(dest < 0, 0)
    assert torch.equal(out, truth)
    by_row = moe.moe_weight_grad(b, b, dest, a_by_row=True)
    assert torch.allclose(by_row, (b[dest.clamp(min=0)] ** 2).sum(-1).masked_fill(dest < 0, 0), atol=1e-5)


def test_bad_arguments_are_named_and_leave_out_untouched():
    out = torch.full((4, 3), 7.0)
    with pytest.raises(ValueError, match=r"dest\[0, 1\] = 5 is outside"):
        moe.moe_gather_rows(torch.ones(2, 3), torch.tensor([[0, 5], [1, 2]]), 4, out=out)
    with pytest.raises(ValueError, match="names a row an earlier entry named"):
        moe.moe_gather_rows(torch.ones(2, 3), torch.tensor([[0, 1], [1, 2]]), 4, out=out)
    assert (out == 7).all()
    with pytest.raises(ValueError, match="grad_act"):
        moe.gated_act_backward(torch.ones(2, 6), torch.ones(2, 2))
    with pytest.raises(ValueError, match="even"):
        moe.gated_act_backward(torch.ones(2, 5), torch.ones(2, 2))
    with pytest.raises(TypeError, match="dest"):
        moe.moe_weight_grad(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(2, 2))
    wg = torch.full((2, 2), 7.0)
    with pytest.raises(ValueError, match="outside"):
        moe.moe_weight_grad(torch.ones(2, 3), torch.ones(4, 3), torch.tensor([[0, 4], [1, 2]]), out=wg)
    assert (wg == 7).all()


# --------------------------------------------------------------------------- autograd of the ops


@pytest.mark.parametrize("act", ACTS)
def test_gradcheck_of_the_composed_ops(act):
    w, idx = routing()
    hidden, w_up, w_down = layer_inputs()
    w = w.double().requires_grad_()

    def layer(hidden, w, w_up, w_down):
        d = moe.moe_dispatch(hidden, idx, E, top_k_weights=w)
        h = moe.grouped_gemm(d.rows, w_up, d.offsets)
        a = moe.gated_act(h, act, limit=d.offsets)
        return moe.moe_combine(moe.grouped_gemm(a, w_down, d.offsets), d.dest, w)

    inputs = (hidden, w, w_up, w_down)
    if act == "relu":  # keep finite differences off the kink
        with torch.no_grad():
            hidden.add_(0.05 * torch.sign(hidden))
    assert torch.autograd.gradcheck(layer, inputs, fast_mode=True)
    assert torch.allclose(layer(*inputs), reference_layer(*inputs[:1], idx, *inputs[1:], act))


def test_ops_route_to_autograd_only_when_a_gradient_is_recorded():
    w, idx = routing()
    hidden = torch.randn(T, H)
    d = moe.moe_dispatch(hidden, idx, E)
    assert d.rows.grad_fn is None and not d.rows.requires_grad
    d = moe.moe_dispatch(hidden.requires_grad_(), idx, E)
    assert d.rows.grad_fn is not None
    out = moe.moe_combine(d.rows, d.dest, w)
    (g,) = torch.autograd.grad(out.sum(), hidden)
    assert torch.allclose(g, torch.full_like(g, 1.0) * w.sum(-1, keepdim=True), atol=1e-6)


# --------------------------------------------------------------------------- the fused layer


def fused(hidden, idx, w, w_up, w_down, act="silu", capacity=None, route="entry"):
    """The fused layer through its entry (eager: the autograd.Function), or
    through the op pair that torch.compile traces (route "op")."""
    if route == "op":
        out, _, _, _, dropped = torch.ops.idempotent_moe.experts_forward(hidden, idx, w, w_up, w_down, act, E,
                                                                          capacity, False)
        return out, dropped
    return _moe_torch_ops.fused_experts(hidden, idx, w, w_up, w_down, act, E, capacity)


def test_eager_calls_skip_the_op_dispatch_and_meta_tensors_take_the_ops():
    w, idx = routing()
    hidden, w_up, w_down = layer_inputs(torch.float32, seed=5)
    out, _ = fused(hidden, idx, w, w_up, w_down)
    assert type(out.grad_fn).__name__ == "EagerExpertsBackward"
    out, _ = fused(hidden, idx, w, w_up, w_down, route="op")
    assert type(out.grad_fn).__name__ != "EagerExpertsBackward"
    meta = [t.detach().to("meta").requires_grad_(t.requires_grad) for t in (hidden, w, w_up, w_down)]
    out, _ = fused(meta[0], idx.to("meta"), *meta[1:])  # the fake implementation: shapes only
    assert out.device.type == "meta" and out.shape == (T, H)
    assert type(out.grad_fn).__name__ != "EagerExpertsBackward"


@pytest.mark.parametrize("route", ["entry", "op"])
@pytest.mark.parametrize("capacity", [None, 2, 0])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gradcheck_of_the_fused_layer(capacity, act, route):
    w, idx = routing(skew=True)  # expert 0 overloaded, some experts empty
    w = w.double()
    w[1] = w[2]  # equal weights: ties go to the lower token
    idx[1] = idx[2]
    w.requires_grad_()
    hidden, w_up, w_down = layer_inputs(seed=1)
    inputs = (hidden, w, w_up, w_down)

    def layer(hidden, w, w_up, w_down):
        return fused(hidden, idx, w, w_up, w_down, act, capacity, route)[0]
    if capacity is None:
        assert torch.autograd.gradcheck(layer, inputs, fast_mode=True)
    else:  # a nudged weight may change the selection at a tie: w held fixed there
        assert torch.autograd.gradcheck(lambda h, u, d: layer(h, w, u, d), (hidden, w_up, w_down),
                                        fast_mode=True)
    truth = reference_layer(hidden, idx, w, w_up, w_down, act, capacity)
    out = layer(*inputs)
    assert torch.allclose(out, truth)
    probe = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    got = torch.autograd.grad((out * probe).sum(), inputs)
    if not truth.requires_grad:  # capacity 0: everything dropped
        assert all((g == 0).all() for g in got)
        return
    want = torch.autograd.grad((truth * probe).sum(), inputs)  # the selection a constant
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("route", ["entry", "op"])
@pytest.mark.parametrize("capacity", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_gradients_against_float64(capacity, dtype, route):
    w, idx = routing(skew=True)
    grads = {}
    for dt in (torch.float64, dtype):
        hidden, w_up, w_down = layer_inputs(dt, seed=2)
        ww = w.to(dt).requires_grad_()
        out, _ = fused(hidden, idx, ww, w_up, w_down, "silu", capacity, route)
        probe = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out).to(dt)
        grads[dt] = [out] + list(torch.autograd.grad((out * probe).sum(), (hidden, ww, w_up, w_down)))
    # bf16 tolerance: a few bf16 ulps of each value's scale (the same bound as
    # the per-assignment torch layer in bf16 meets against float64)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    for lo, hi in zip(grads[dtype], grads[torch.float64]):
        assert ((lo.double() - hi).abs() <= tol * (hi.abs().max() + 1)).all()


def test_dropped_assignments_get_exactly_zero_gradient_and_are_counted():
    w, idx = routing(skew=True)
    hidden, w_up, w_down = layer_inputs(torch.float32, seed=3)
    w = w.requires_grad_()
    out, dropped = fused(hidden, idx, w, w_up, w_down, "silu", 1)
    d = moe.moe_dispatch(hidden.detach(), idx, E, top_k_weights=w.detach(), capacity=1)
    kept = d.dest >= 0
    assert int(dropped) == int((~kept).sum()) > 0
    gh, gw = torch.autograd.grad(out.square().sum(), (hidden, w))
    assert (gw[~kept] == 0).all() and (gw[kept] != 0).all()
    untouched = ~kept.any(-1)  # tokens whose every assignment was dropped
    assert untouched.any() and (gh[untouched] == 0).all() and (out[untouched] == 0).all()


def saved_tensors(fn):
    """Shapes of the tensors autograd saves while fn runs (parameters included)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return shapes, result


@pytest.mark.parametrize("capacity", [None, 2])
def test_the_fused_layer_saves_no_rows_by_hidden_copy(capacity):
    w, idx = routing(num_tokens=16)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(16, 24, generator=g, requires_grad=True)
    w_up = torch.randn(E, 24, 2 * INTER, generator=g, requires_grad=True)
    w_down = torch.randn(E, INTER, 24, generator=g, requires_grad=True)
    rows = 16 * K
    shapes, (out, _) = saved_tensors(lambda: fused(hidden, idx, w, w_up, w_down, "silu", capacity))
    assert (rows, 24) not in shapes  # never the gathered rows nor the expert outputs
    kept = rows if capacity is None else E * capacity  # the gate/up output: 8 of 32 rows with capacity 2
    assert (kept, 2 * INTER) in shapes
    assert capacity is None or (rows, 2 * INTER) not in shapes
    assert (16, 24) in shapes  # hidden, for dW_up only
    # the torch path of the same layer keeps [rows, H] tensors
    composed, _ = saved_tensors(lambda: moe.moe_combine(
        moe.grouped_gemm(moe.gated_act(moe.grouped_gemm(
            d.rows, w_up, d.offsets), "silu", limit=d.offsets), w_down, d.offsets), d.dest, w)
        if (d := moe.moe_dispatch(hidden, idx, E)) else None)
    assert (rows, 24) in composed


class _Created(TorchDispatchMode):
    """The shapes of the tensors made zero (or filled), and of those made
    empty, while active."""

    def __init__(self):
        super().__init__()
        self.zeros, self.empties = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if "zero" in name or "fill" in name or name.startswith("full"):
            self.zeros.append(tuple(out.shape))
        if "empty" in name:
            self.empties.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("route", ["entry", "op"])
def test_the_backward_is_handed_no_zeros_for_the_outputs_without_a_gradient(route):
    """gate_up [rows, 2I] leaves the forward without a gradient: autograd
    must not fill a zero tensor of its size for the backward (on the
    Mixtral-8x7B layer that is 1.75 GiB and 0.6 ms per step)."""
    w, idx = routing(num_tokens=16)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(16, 24, generator=g, requires_grad=True)
    w_up = torch.randn(E, 24, 2 * 5, generator=g, requires_grad=True)
    w_down = torch.randn(E, 5, 24, generator=g, requires_grad=True)
    out, _ = fused(hidden, idx, w, w_up, w_down, "silu", None, route)
    with _Created() as created:
        out.backward(torch.ones_like(out))
    assert (16 * K, 2 * 5) not in created.zeros
    assert hidden.grad is not None and w_up.grad.abs().sum() > 0
    # an output that reaches no loss gives no gradient and no error
    hidden.grad = None
    out, dropped = fused(hidden, idx, w, w_up, w_down, "silu", None, route)
    (out.sum() * 0 + hidden.sum()).backward()
    assert torch.equal(hidden.grad, torch.ones_like(hidden))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_weights_and_per_assignment_on_the_kernels_equal_the_torch_gathers(dtype):
    """The layer's two small gathers run as one library call each (a gather
    of weighted ones; a weight gradient of one column) where the dtypes are
    the kernels': the values of the torch indexing they replace, bit for bit."""
    w, idx = routing(num_tokens=16, skew=True)
    w = w.to(dtype)
    d = moe.moe_dispatch(torch.zeros(16, 1), idx, E, top_k_weights=w, capacity=3)
    rows = int(d.offsets[-1]) + 2  # two rows no assignment names
    got = ag.row_weights(d.dest, w, rows, torch.float32)
    flat = d.dest.reshape(-1).long()
    want = torch.zeros(rows + 1).index_copy_(0, torch.where(flat < 0, rows, flat), w.reshape(-1).float())
    assert torch.equal(got, want[:rows].unsqueeze(-1))
    values = torch.randn(rows, 1)
    kept = d.dest >= 0
    want = torch.where(kept, values.reshape(-1)[d.dest.clamp(min=0).long()], 0).to(dtype)
    assert torch.equal(ag.per_assignment(values, d.dest, dtype), want)
    assert (~kept).any() and bool((ag.per_assignment(values, d.dest, dtype)[~kept] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_d_gate_up_takes_the_saved_gate_up_unless_the_graph_is_kept(dtype):
    """The eager backward is the saved gate_up's last reader: d(gate_up) is
    written over it (no [rows, 2I] allocation), except where the graph is
    kept (retain_graph), whose next backward reads gate_up again."""
    w, idx = routing()
    hidden, w_up, w_down = layer_inputs(dtype, seed=3)
    out, _ = fused(hidden, idx, w, w_up, w_down)
    with _Created() as kept:
        first = torch.autograd.grad(out.square().sum(), (hidden, w_up, w_down), retain_graph=True)
    with _Created() as freed:
        second = torch.autograd.grad(out.square().sum(), (hidden, w_up, w_down))
    for a, b in zip(first, second):  # the kept graph's gate_up was left as it was
        assert torch.equal(a, b)
    if dtype != torch.float64:  # the library's kernels (float64 runs the torch references)
        assert (T * K, 2 * INTER) in kept.empties
        assert (T * K, 2 * INTER) not in freed.empties + freed.zeros
    want = torch.autograd.grad(reference_layer(hidden, idx, w, w_up, w_down, "silu").square().sum(),
                               (hidden, w_up, w_down))
    for a, b in zip(second, want):
        assert torch.allclose(a, b, atol=1e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("capacity", [0, 1, 3, 9])
def test_what_a_capacity_keeps_is_bounded_by_it_whatever_the_routing(capacity):
    """The gate/up output saved for the backward has min(T k, max(1, E C))
    rows, the same for a balanced and a skewed router, and the gradients
    of the layer with that bound are the reference's (its float64 loop over
    the kept assignments)."""
    hidden, w_up, w_down = layer_inputs(torch.float64, seed=8)
    found = []
    for skew in (False, True):
        w, idx = routing(seed=9, skew=skew)
        shapes, (out, dropped) = saved_tensors(
            lambda w=w, idx=idx: fused(hidden, idx, w, w_up, w_down, "silu", capacity))
        found.append(sorted(s for s in shapes if len(s) == 2 and s[-1] == 2 * INTER))
        ref = reference_layer(hidden, idx, w, w_up, w_down, "silu", capacity=capacity)
        got = torch.autograd.grad(out.sum(), (hidden, w_up, w_down))
        want = ([torch.zeros_like(t) for t in (hidden, w_up, w_down)] if capacity == 0  # all dropped
                else torch.autograd.grad(ref.sum(), (hidden, w_up, w_down)))
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-10), (skew, capacity)
        over = torch.bincount(idx.reshape(-1), minlength=E) - capacity
        assert int(dropped) == int(over.clamp(min=0).sum())
    assert found[0] == found[1] == [(min(T * K, max(1, E * capacity)), 2 * INTER)]


@pytest.mark.parametrize("capacity", [None, 3, 1, 0])
def test_a_capacity_gathers_only_the_rows_it_keeps(capacity, monkeypatch):
    """Where E C < T k, the forward never makes a row per assignment: the
    dispatch sorts (one column), and only the kept rows are gathered."""
    made = []  # the shape of every row array the forward makes
    dispatch, gather = ag._moe_core.moe_dispatch, ag.gather_rows_direct
    monkeypatch.setattr(ag._moe_core, "moe_dispatch",
                        lambda *a, **k: made.append(tuple((d := dispatch(*a, **k)).rows.shape)) or d)
    monkeypatch.setattr(ag, "gather_rows_direct",
                        lambda *a: made.append(tuple((x := gather(*a)).shape)) or x)
    w, idx = routing(seed=9, skew=True)
    hidden, w_up, w_down = layer_inputs(torch.float32, seed=8)
    with torch.no_grad():
        fused(hidden, idx, w, w_up, w_down, "silu", capacity)
    keeps = T * K if capacity is None else min(T * K, max(1, E * capacity))
    assert [s for s in made if s[1] == H] == [(keeps, H)], (capacity, made)


@pytest.mark.parametrize("route", ["entry", "op"])
def test_weight_gradients_arrive_in_the_parameters_layout(route):
    """transformers keeps the experts' weights as [E, N, K] and passes their
    transposed views: the weight gradients come back as the transposed views
    of contiguous tensors, so each parameter's incoming gradient is
    contiguous and autograd keeps it instead of copying it (a transient the
    size of the weight). The values are those of contiguous weights."""
    w, idx = routing(skew=True)
    hidden, w_up, w_down = layer_inputs(torch.float32, seed=4)
    params = [t.detach().transpose(-2, -1).contiguous().requires_grad_() for t in (w_up, w_down)]
    incoming = []
    for p in params:
        p.register_hook(lambda g: incoming.append(g.is_contiguous()))
    out, _ = fused(hidden, idx, w, *(p.transpose(-2, -1) for p in params), route=route)
    out.square().sum().backward()
    assert incoming == [True, True]
    want = torch.autograd.grad(fused(hidden, idx, w, w_up, w_down)[0].square().sum(), (w_up, w_down))
    for p, g in zip(params, want):
        assert torch.allclose(p.grad.transpose(-2, -1), g, atol=1e-5)


def test_grouped_gemm_weight_gradient_arrives_in_the_parameters_layout():
    a = torch.randn(9, H, dtype=torch.float64, requires_grad=True)
    param = torch.randn(E, 5, H, dtype=torch.float64, requires_grad=True)  # [E, N, K]
    offsets = torch.tensor([2, 2, 6, 9], dtype=torch.int32)
    incoming = []
    param.register_hook(lambda g: incoming.append(g.is_contiguous()))
    moe.grouped_gemm(a, param.transpose(-2, -1), offsets).square().sum().backward()
    assert incoming == [True]
    w = param.detach().transpose(-2, -1).contiguous().requires_grad_()
    moe.grouped_gemm(a.detach(), w, offsets).square().sum().backward()
    assert torch.allclose(param.grad.transpose(-2, -1), w.grad)


@pytest.mark.parametrize("name", ["experts_backward", "experts_backward_"])
def test_opcheck_of_the_fused_layer_backward_ops_with_transposed_weights(name):
    """The backward ops' fake implementation gives the weight gradients the
    strides the real ones do (the weights' own layout); the second writes
    d(gate_up) over gate_up, as its schema says, and the first writes nothing."""
    op = getattr(torch.ops.idempotent_moe, name)
    w, idx = routing()
    hidden, w_up, w_down = layer_inputs(torch.float32, seed=6, grad=False)
    w_up, w_down = (t.transpose(-2, -1).contiguous().transpose(-2, -1) for t in (w_up, w_down))
    out, gate_up, offsets, dest, _ = torch.ops.idempotent_moe.experts_forward(hidden, idx, w, w_up, w_down,
                                                                              "silu", E, None, False)
    needs = (True, True, True, True)
    args = (torch.ones_like(out), hidden, w, w_up, w_down, gate_up, offsets, dest, "silu", *needs)
    result = torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result
    saved = gate_up.clone()
    grads = op(*args)
    assert grads[2].stride() == w_up.stride() and grads[3].stride() == w_down.stride()
    want = torch.ops.idempotent_moe.experts_backward(*args[:5], saved.clone(), *args[6:])
    for a, b in zip(grads, want):
        assert torch.equal(a, b)
    assert torch.equal(gate_up, saved) == (name == "experts_backward")


@pytest.mark.parametrize("capacity", [None, 3, 1, 0])
def test_opcheck_of_the_fused_layer_op(capacity):
    """torch's checks of experts_forward: schema, autograd registration, and
    a fake implementation whose outputs match the real ones (the gate/up
    output's kept rows included). AOT dispatch is left out: the rows past
    offsets[-1] are never written, so two runs need not agree there."""
    w, idx = routing()
    hidden, w_up, w_down = layer_inputs(torch.float32, seed=7)
    result = torch.library.opcheck(
        torch.ops.idempotent_moe.experts_forward.default,
        (hidden, idx, w.requires_grad_(), w_up, w_down, "silu", E, capacity, False),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_frozen_experts_compute_no_weight_gradient_and_keep_no_hidden():
    w, idx = routing()
    hidden, w_up, w_down = layer_inputs(torch.float32, seed=6)
    w_up.requires_grad_(False)
    w_down.requires_grad_(False)
    calls = []
    real = ag.grouped_mm_dw
    ag.grouped_mm_dw = lambda *a: calls.append(a) or real(*a)
    try:
        shapes, (out, _) = saved_tensors(lambda: fused(hidden, idx, w, w_up, w_down))
        (gh,) = torch.autograd.grad(out.sum(), hidden)
    finally:
        ag.grouped_mm_dw = real
    assert calls == []
    assert (T, H) not in shapes
    ref = reference_layer(hidden.double(), idx, w.double(), w_up.double(), w_down.double(), "silu")
    (gr,) = torch.autograd.grad(ref.sum(), hidden)
    assert torch.allclose(gh.double(), gr.double(), atol=1e-4)


def test_compiled_fused_layer_fullgraph_forward_and_backward():
    w, idx = routing()
    hidden, w_up, w_down = layer_inputs(torch.float32, seed=7)
    torch._dynamo.reset()

    def step(hidden, w, w_up, w_down):
        out, dropped = fused(hidden, idx, w, w_up, w_down, "silu", 3)
        return out.square().sum(), dropped

    ww = w.clone().requires_grad_()
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    backend = AotEagerAndRecordGraphs()
    loss, dropped = torch.compile(step, fullgraph=True, backend=backend)(hidden, ww, w_up, w_down)
    got = torch.autograd.grad(loss, (hidden, ww, w_up, w_down))
    # the traced backward takes the op that writes d(gate_up) over the saved gate_up
    (bw,) = backend.bw_graphs
    assert "idempotent_moe.experts_backward_." in bw.code
    ww2 = w.clone().requires_grad_()
    loss2, dropped2 = step(hidden, ww2, w_up, w_down)
    want = torch.autograd.grad(loss2, (hidden, ww2, w_up, w_down))
    assert torch.allclose(loss, loss2) and int(dropped) == int(dropped2)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


# --------------------------------------------------------------------------- CUDA


def _cuda_grads(dtype, capacity, device):
    w, idx = routing(num_tokens=64, num_experts=8, seed=9, skew=True, device=device)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(64, 128, generator=g).to(device, dtype).requires_grad_()
    w_up = (torch.randn(8, 128, 96, generator=g) * 0.1).to(device, dtype).requires_grad_()
    w_down = (torch.randn(8, 48, 128, generator=g) * 0.1).to(device, dtype).requires_grad_()
    # weights exact in bf16, so that every dtype ranks (and drops) the same assignments
    w = w.to(torch.bfloat16).to(dtype).requires_grad_()
    out, dropped = _moe_torch_ops.fused_experts(hidden, idx, w, w_up, w_down, "silu", 8, capacity)
    grads = torch.autograd.grad(out.square().sum(), (hidden, w, w_up, w_down))
    return [out, dropped] + list(grads)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [None, 12])
def test_cuda_fused_layer_gradients_match_the_cpu(capacity):
    cpu = _cuda_grads(torch.float32, capacity, "cpu")
    gpu = _cuda_grads(torch.float32, capacity, "cuda")
    assert int(cpu[1]) == int(gpu[1])
    for a, b in zip(cpu[:1] + cpu[2:], gpu[:1] + gpu[2:]):
        assert torch.allclose(a, b.cpu(), rtol=1e-3, atol=1e-3)
    bf16 = _cuda_grads(torch.bfloat16, capacity, "cuda")
    for a, b in zip(gpu[:1] + gpu[2:], bf16[:1] + bf16[2:]):
        assert ((a - b.float()).abs() <= 4e-2 * (a.abs().max() + 1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_backward_kernels_match_the_cpu(act, dtype):
    g = torch.Generator().manual_seed(10)
    gate_up = torch.randn(33, 2 * 40, generator=g).to(dtype)
    grad = torch.randn(33, 40, generator=g).to(dtype)
    limit = torch.tensor([5, 20, 29], dtype=torch.int32)
    cpu = moe.gated_act_backward(gate_up, grad, act, limit=limit)
    gpu = moe.gated_act_backward(gate_up.cuda(), grad.cuda(), act, limit=limit.cuda()).cpu()
    ulp = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    assert ((cpu.double() - gpu.double()).abs() <= ulp * (cpu.double().abs() + 1)).all()
    assert (gpu[29:] == 0).all()
    src = torch.randn(6, 40, generator=g).to(dtype)
    dest = torch.tensor([[0, 9], [3, -1], [-1, -1], [4, 1], [2, 5], [7, 8]], dtype=torch.int32)
    w = torch.rand(6, 2, generator=g)
    rows_cpu = moe.moe_gather_rows(src, dest, 11, weights=w)
    rows_gpu = moe.moe_gather_rows(src.cuda(), dest.cuda(), 11, weights=w.cuda()).cpu()
    assert torch.equal(rows_cpu, rows_gpu)  # the same bits
    b = torch.randn(11, 40, generator=g).to(dtype)
    assert torch.equal(moe.moe_weight_grad(src, b, dest), moe.moe_weight_grad(
        src.cuda(), b.cuda(), dest.cuda()).cpu())
    assert torch.equal(moe.moe_weight_grad(b, b, dest, a_by_row=True), moe.moe_weight_grad(
        b.cuda(), b.cuda(), dest.cuda(), a_by_row=True).cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [37, 264])  # one element at a time; 16-byte chunks where 2-byte
def test_cuda_fused_activation_backward_matches_the_cpu(act, dtype, inter):
    results = []
    for device in ("cpu", "cuda"):
        gate_up, grad, scale, limit = fused_act_inputs(dtype, inter, rows=300, device=device)
        act_out, dot = torch.empty_like(grad), torch.empty(300, 1, device=device)
        out = moe.gated_act_backward(gate_up, grad, act, limit=limit, row_scale=scale, act_out=act_out,
                                     row_dot=dot)
        in_place = grad.clone()
        out2 = moe.gated_act_backward(gate_up, in_place, act, limit=limit, row_scale=scale, act_out=in_place)
        assert torch.equal(out2, out) and torch.equal(in_place, act_out)
        over = gate_up.clone()  # d(gate_up) written over gate_up itself
        moe.gated_act_backward(over, grad, act, limit=limit, row_scale=scale, out=over)
        assert torch.equal(over, out)
        fwd = moe.gated_act(gate_up, act, limit=limit)  # the device's own forward, bit for bit
        assert torch.equal(act_out[:8], (fwd[:8].float() * scale[:8]).to(dtype))
        results.append([x.cpu().double() for x in (out, act_out, dot)])
    ulp = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    for cpu, gpu in zip(*results):
        assert ((cpu - gpu).abs() <= ulp * (cpu.abs() + 1)).all()
    assert all((gpu[8:] == 0).all() for gpu in results[1])


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("case", ["chunks", "odd_width", "offset_rows", "other_out_dtype"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_gather_rows_in_16_byte_chunks_and_one_at_a_time_match_the_cpu(dtype, case, weighted):
    """The CUDA gather copies whole aligned 16-byte chunks where it can (rows
    of 64 features) and one element at a time elsewhere (an odd width, rows
    at an offset of 2 elements, another out dtype): the CPU's bits either
    way, and the rows no assignment names zeroed over NaN."""
    g = torch.Generator().manual_seed(11)
    width = 6 if case == "odd_width" else 64
    cols = slice(2, None) if case == "offset_rows" else slice(0, width)
    src = torch.randn(9, width + 2, generator=g).to(dtype)[:, cols]
    dest = torch.tensor([[0, 9], [3, -1], [-1, -1], [4, 1], [2, 5], [7, 8], [10, 11], [-1, 12], [13, 6]],
                        dtype=torch.int32)
    w = torch.rand(9, 2, generator=g) if weighted else None
    out_dtype = torch.float32 if case == "other_out_dtype" and dtype != torch.float32 else dtype
    want = torch.full((16, width + 2), float("nan"), dtype=out_dtype)
    got = want.cuda()
    moe.moe_gather_rows(src, dest, 15, weights=w, out=want[:15, cols])
    w_gpu = None if w is None else w.cuda()
    moe.moe_gather_rows(src.cuda(), dest.cuda(), 15, weights=w_gpu, out=got[:15, cols])
    assert torch.equal(want[:15, cols], ag.ref_gather_rows(src, dest, 15, w, out_dtype))
    assert torch.equal(got.cpu().nan_to_num(7.0), want.nan_to_num(7.0))
    assert (want[14, cols] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [14, 15, 16])  # every row named (no zeroing pass); one or two left
def test_cuda_gather_rows_writes_every_row_whether_or_not_each_is_named(rows):
    g = torch.Generator().manual_seed(12)
    src = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    dest = torch.tensor([[0, 9], [3, -1], [-1, -1], [4, 1], [2, 5], [7, 8], [10, 11], [-1, 12], [13, 6]],
                        dtype=torch.int32)
    for fill in (float("nan"), 3.0):  # the zeroing pass skipped, then not: no stale bits either way
        got = torch.full((rows, 64), fill, dtype=torch.bfloat16, device="cuda")
        moe.moe_gather_rows(src.cuda(), dest.cuda(), rows, out=got)
        assert torch.equal(got.cpu(), ag.ref_gather_rows(src, dest, rows, None, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("named", [True, False])  # every row named: no zeroing pass; one row left
def test_cuda_gather_rows_of_a_long_dest_checked_in_blocks(named):
    """Past 8,192 entries the dest check runs in blocks (here 300,000 x 8:
    the most, 256) that count the kept entries together: R of them skip the
    zeroing pass, fewer do not; an entry out of range in the last block
    records the error and writes nothing."""
    tokens, k = 300_000, 8
    g = torch.Generator().manual_seed(13)
    dest = torch.randperm(tokens * k, generator=g).to(torch.int32).view(tokens, k)
    rows = tokens * k if named else tokens * k + 1
    src = torch.randn(tokens, 8, generator=g).to(torch.bfloat16)
    got = torch.full((rows, 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe.moe_gather_rows(src.cuda(), dest.cuda(), rows, out=got)
    assert torch.equal(got.cpu(), ag.ref_gather_rows(src, dest, rows, None, torch.bfloat16))
    import idempotent_moe as imoe

    dest.view(-1)[-1] = rows
    out = torch.full((rows, 8), 7.0, dtype=torch.bfloat16, device="cuda")
    moe.moe_gather_rows(src.cuda(), dest.cuda(), rows, out=out)
    with pytest.raises(ValueError, match="outside|range"):
        imoe.check_errors(out)
    assert bool((out == 7).all())


@pytest.mark.gpu
def test_cuda_bad_dest_is_a_recorded_error_and_writes_nothing():
    import idempotent_moe as imoe

    out = torch.full((4, 3), 7.0, device="cuda")
    moe.moe_gather_rows(torch.ones(2, 3, device="cuda"), torch.tensor([[0, 5], [1, 2]], device="cuda"), 4,
                            out=out)
    with pytest.raises(ValueError, match="outside|range"):
        imoe.check_errors(out)
    assert (out == 7).all()
