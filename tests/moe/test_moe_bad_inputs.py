"""Bad input to the MoE operations (idempotent_moe.moe): the right exception type, a
message that names the argument at fault, nothing allocated (the outputs a
call makes come from the direct path's allocators (_moe_core), which must not run), and every
array passed in, outputs included, bit for bit as it was.

Each case is (id, exception, words the message needs, builder); a builder
takes the data of one framework (`Data`) and returns (call, arrays)."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_unchanged, names, read_only, requires_torch, snapshot, torch
from idempotent_moe import _moe_core, moe

pytestmark = requires_torch

T, K, E, H, INTER, N = 6, 2, 4, 8, 5, 7
CASES = []


def case(id, exc, words, build, frameworks=("torch",)):
    for fw in frameworks:
        CASES.append(pytest.param(build, fw, exc, names(*words), id=f"{id}-{fw}"))


class Data:
    """Fresh, valid arguments of every operation for one framework."""

    def __init__(self, fw: str):
        rng = np.random.default_rng(7)
        ids = np.array([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]], dtype=np.int64)
        f32 = np.float32
        arrays = dict(
            hidden=rng.standard_normal((T, H)).astype(f32), ids=ids,
            w=rng.random((T, K)).astype(f32), rows=rng.standard_normal((T * K, H)).astype(f32),
            gate_up=rng.standard_normal((T * K, 2 * INTER)).astype(f32),
            grad_act=rng.standard_normal((T * K, INTER)).astype(f32),
            a=rng.standard_normal((T * K, H)).astype(f32), wmat=rng.standard_normal((E, H, N)).astype(f32),
            logits=rng.standard_normal((T, E)).astype(f32), src=rng.standard_normal((T, H)).astype(f32))
        for name, value in arrays.items():
            setattr(self, name, torch.from_numpy(value) if fw == "torch" else value)
        d = moe.moe_dispatch(self.hidden, self.ids, E)
        self.dest, self.offsets = d.dest, d.offsets
        self.fw = fw

    def full(self, shape, value, dtype="float32"):
        """An output array filled with `value` (its bits are compared after)."""
        a = np.full(shape, value, dtype=dtype)
        return torch.from_numpy(a) if self.fw == "torch" else a

    def out(self, capacity=None, rows=T * K):
        """A MoEDispatch of outputs full of sentinels."""
        return moe.MoEDispatch(self.full((rows, H), 7.0), self.full((E,), -5, "int32"),
                                   self.full((T, K), -5, "int32"), self.full((rows,), -5, "int32"),
                                   self.full((1,), -5, "int64"))


def _with(d, name, value):
    """d's `name` with entry [2, 1] set to `value` (a copy)."""
    a = getattr(d, name)
    a = a.clone() if d.fw == "torch" else a.copy()
    a[2, 1] = value
    return a


def _huge_dispatch():
    """[2^20, 2] ids (a broadcast view) for 6 tokens of 2^20 features: the
    rows of such a dispatch would be 8 TiB, allocated before the check."""
    hidden, ids = torch.zeros(T, 1 << 20), torch.zeros(1, K, dtype=torch.int64).expand(1 << 20, K)
    return (lambda: moe.moe_dispatch(hidden, ids, E)), [hidden, ids]


def no_grad(fn, *args, **kwargs):
    def call():
        with torch.no_grad():
            fn(*args, **kwargs)
    return call


def dispatch(d, *arrays, ids=None, experts=E, **kwargs):
    ids = d.ids if ids is None else ids
    out = kwargs.get("out")
    outs = list(out) if isinstance(out, moe.MoEDispatch) else []
    return (lambda: moe.moe_dispatch(d.hidden, ids, experts, **kwargs)), \
        [d.hidden, ids, *[a for a in (kwargs.get("top_k_weights"),) if a is not None], *outs, *arrays]


BOTH = ("torch", "numpy")

# --------------------------------------------------------------------------- moe_dispatch: values
for value in (-3, 0, 1025, 2**40):
    case(f"dispatch-num-experts-{value}", ValueError, ["num_experts", str(value)],
         lambda d, v=value: dispatch(d, experts=v), BOTH)
for value in (4.0, True, "4", None):
    case(f"dispatch-num-experts-{type(value).__name__}", TypeError, ["num_experts", "int"],
         lambda d, v=value: dispatch(d, experts=v))
case("dispatch-capacity-negative", ValueError, ["capacity", "None"],
     lambda d: dispatch(d, top_k_weights=d.w, capacity=-1), BOTH)
case("dispatch-capacity-huge", ValueError, ["capacity"],
     lambda d: dispatch(d, top_k_weights=d.w, capacity=2**40))
case("dispatch-capacity-huge-padded", ValueError, ["num_experts x capacity"],
     lambda d: dispatch(d, top_k_weights=d.w, experts=1024, capacity=2**22, layout="padded",
                        ids=d.ids * 0))
case("dispatch-capacity-float", TypeError, ["capacity", "int"],
     lambda d: dispatch(d, top_k_weights=d.w, capacity=2.5))
case("dispatch-capacity-bool", TypeError, ["capacity", "int"],
     lambda d: dispatch(d, top_k_weights=d.w, capacity=True))
case("dispatch-capacity-without-weights", ValueError, ["top_k_weights", "capacity"],
     lambda d: dispatch(d, capacity=3), BOTH)
case("dispatch-layout-unknown", ValueError, ["layout", "grouped"], lambda d: dispatch(d, layout="diagonal"))
case("dispatch-layout-not-str", TypeError, ["layout", "str"], lambda d: dispatch(d, layout=1))
case("dispatch-padded-without-capacity", ValueError, ["padded", "capacity"],
     lambda d: dispatch(d, layout="padded"))
case("dispatch-id-too-large", ValueError, [r"top_k_index\[2, 1\] = 3", "num_experts = 3"],
     lambda d: dispatch(d, experts=3, out=d.out()._replace(offsets=d.full((3,), -5, "int32"))), BOTH)
case("dispatch-id-negative", ValueError, [r"top_k_index\[2, 1\] = -1"],
     lambda d: dispatch(d, ids=_with(d, "ids", -1), out=d.out()), BOTH)
case("dispatch-repeated-expert-distinct", ValueError, [r"top_k_index\[2, 1\] = 2", "distinct"],
     lambda d: dispatch(d, ids=_with(d, "ids", 2), distinct=True, out=d.out()), BOTH)
case("dispatch-repeated-expert-distinct-capacity", ValueError, ["top_k_index", "distinct"],
     lambda d: dispatch(d, ids=d.ids[:, [1, 1]], top_k_weights=d.w, capacity=2, distinct=True, out=d.out()))
case("dispatch-weights-shape", ValueError, ["top_k_weights"],
     lambda d: dispatch(d, top_k_weights=d.w[:, :1]), BOTH)
case("dispatch-weights-dtype", TypeError, ["top_k_weights", "float32"],
     lambda d: dispatch(d, top_k_weights=d.ids, capacity=2))
case("dispatch-num-threads-negative", ValueError, ["num_threads"], lambda d: dispatch(d, num_threads=-1))
case("dispatch-num-threads-float", TypeError, ["num_threads"], lambda d: dispatch(d, num_threads=1.5))

# --------------------------------------------------------------------------- moe_dispatch: kinds and shapes
case("dispatch-hidden-list", TypeError, ["hidden", "list"],
     lambda d: ((lambda: moe.moe_dispatch(d.hidden.tolist(), d.ids, E)), [d.ids]))
case("dispatch-ids-list", TypeError, ["top_k_index", "list"],
     lambda d: ((lambda: moe.moe_dispatch(d.hidden, d.ids.tolist(), E)), [d.hidden]))
case("dispatch-weights-list", TypeError, ["top_k_weights", "list"],
     lambda d: ((lambda: moe.moe_dispatch(d.hidden, d.ids, E, top_k_weights=d.w.tolist(), capacity=2)),
                [d.hidden, d.ids]))
case("dispatch-ids-float", TypeError, ["top_k_index", "int32 or int64"],
     lambda d: dispatch(d, ids=d.ids.float() if d.fw == "torch" else d.ids.astype(np.float32)), BOTH)
case("dispatch-ids-1d", ValueError, ["top_k_index"], lambda d: dispatch(d, ids=d.ids[:, 0]), BOTH)
case("dispatch-ids-other-tokens", ValueError, ["hidden", "rows"], lambda d: dispatch(d, ids=d.ids[:4]), BOTH)
case("dispatch-ids-huge-tokens", ValueError, ["hidden", "1048576 rows"], lambda d: _huge_dispatch())
case("dispatch-hidden-0d", ValueError, ["hidden"],
     lambda d: ((lambda: moe.moe_dispatch(d.hidden[0, 0], d.ids, E)), [d.hidden, d.ids]))
case("dispatch-hidden-requires-grad-no-grad", TypeError, ["hidden", "requires grad"],
     lambda d: (no_grad(moe.moe_dispatch, d.hidden.requires_grad_(), d.ids, E), [d.hidden, d.ids]))
case("dispatch-weights-require-grad-out", TypeError, ["top_k_weights", "requires grad"],
     lambda d: dispatch(d, top_k_weights=d.w.requires_grad_(), capacity=2, out=d.out()))
case("dispatch-out-not-moedispatch", TypeError, ["out", "MoEDispatch"],
     lambda d: dispatch(d, d.rows, out=(d.rows,)))
case("dispatch-out-rows-other-dtype", TypeError, ["out_rows", "hidden's dtype float32", "float64"],
     lambda d: dispatch(d, out=d.out()._replace(rows=d.full((T * K, H // 2), 7.0, "float64"))), BOTH)
case("dispatch-out-rows-other-count", ValueError, ["out_rows", "12 rows"],
     lambda d: dispatch(d, out=d.out()._replace(rows=d.full((T * K - 1, H), 7.0))), BOTH)
case("dispatch-out-dest-int16", TypeError, ["out_dest", "int16"],
     lambda d: dispatch(d, out=d.out()._replace(dest=d.full((T, K), -5, "int16"))), BOTH)
case("dispatch-out-offsets-length", ValueError, ["out_offsets"],
     lambda d: dispatch(d, out=d.out()._replace(offsets=d.full((E + 1,), -5, "int32"))), BOTH)
case("dispatch-out-dropped-int32", TypeError, ["out_dropped"],
     lambda d: dispatch(d, out=d.out()._replace(dropped=d.full((1,), -5, "int32"))))
case("dispatch-out-src-read-only", BufferError, ["out_src", "read-only"],
     lambda d: dispatch(d, out=d.out()._replace(src=read_only(np.full(T * K, -5, np.int32)))), ("numpy",))
case("dispatch-out-rows-require-grad", TypeError, ["out_rows", "requires grad"],
     lambda d: dispatch(d, out=d.out()._replace(rows=d.full((T * K, H), 7.0).requires_grad_())))

# --------------------------------------------------------------------------- moe_dispatch: aliasing
def _hidden_in_rows(d):
    rows = d.full((T * K, H), 7.0)
    call = lambda: moe.moe_dispatch(rows[:T], d.ids, E, out=d.out()._replace(rows=rows))  # noqa: E731
    return call, [rows, d.ids]


def _ids_in_dest(d):
    out = d.out()._replace(dest=d.full((T, K), 1, "int64"))
    return (lambda: moe.moe_dispatch(d.hidden, out.dest, E, out=out)), [d.hidden, *out]


def _dest_and_src_overlap(d):
    ints = d.full((T * K + 2,), -5, "int32")
    out = d.out()._replace(dest=ints[:T * K].reshape(T, K), src=ints[2:])
    return (lambda: moe.moe_dispatch(d.hidden, d.ids, E, out=out)), [d.hidden, d.ids, ints, *out]


case("dispatch-hidden-inside-out-rows", ValueError, ["hidden", "out_rows"], _hidden_in_rows, BOTH)
case("dispatch-ids-are-out-dest", ValueError, ["top_k_index", "out_dest"], _ids_in_dest, BOTH)
case("dispatch-out-dest-overlaps-out-src", ValueError, ["out_dest", "out_src"], _dest_and_src_overlap, BOTH)


# --------------------------------------------------------------------------- moe_combine
def combine(d, *arrays, rows=None, dest=None, weights=None, **kwargs):
    rows, dest, weights = (d.rows if rows is None else rows), (d.dest if dest is None else dest), \
        (d.w if weights is None else weights)
    extra = [kwargs["out"]] if kwargs.get("out") is not None else []
    return (lambda: moe.moe_combine(rows, dest, weights, **kwargs)), \
        [a for a in (rows, dest, weights) if not isinstance(a, list)] + extra + list(arrays)


for arg in ("rows", "dest", "weights"):
    case(f"combine-{arg}-list", TypeError, [arg, "list"],
         lambda d, arg=arg: combine(d, **{arg: getattr(d, {"weights": "w"}.get(arg, arg)).tolist()}), BOTH)
case("combine-rows-int", TypeError, ["rows", "int32"],
     lambda d: combine(d, rows=d.full((T * K, H), 1, "int32")), BOTH)
case("combine-dest-float", TypeError, ["dest", "int32 or int64"],
     lambda d: combine(d, dest=d.full((T, K), 1.0)), BOTH)
case("combine-weights-shape", ValueError, ["weights"], lambda d: combine(d, weights=d.w[:, :1]), BOTH)
case("combine-weights-other-tokens", ValueError, ["weights"], lambda d: combine(d, weights=d.w[:4]), BOTH)
case("combine-dest-out-of-range", ValueError, [r"dest\[2, 1\] = 12"],
     lambda d: combine(d, dest=_with(d, "dest", T * K), out=d.full((T, H), 7.0)), BOTH)
case("combine-dest-below-minus-one", ValueError, [r"dest\[2, 1\] = -2"],
     lambda d: combine(d, dest=_with(d, "dest", -2), out=d.full((T, H), 7.0)), BOTH)
for value, exc in (("float17", ValueError), ("int32", ValueError), ("float64", ValueError), (3, TypeError)):
    case(f"combine-out-dtype-{value}", exc, ["out_dtype"], lambda d, v=value: combine(d, out_dtype=v), BOTH)
case("combine-out-dtype-torch-int", ValueError, ["out_dtype", "int64"],
     lambda d: combine(d, out_dtype=torch.int64))
case("combine-out-dtype-not-out-s", ValueError, ["out_dtype", "float16", "float32"],
     lambda d: combine(d, out=d.full((T, H), 7.0), out_dtype="float16"), BOTH)
case("combine-out-shape", ValueError, [r"\bout\b"], lambda d: combine(d, out=d.full((T, H + 1), 7.0)), BOTH)
case("combine-out-int", TypeError, [r"\bout\b", "int32"],
     lambda d: combine(d, out=d.full((T, H), 7, "int32")), BOTH)
case("combine-out-requires-grad", TypeError, [r"\bout\b", "requires grad"],
     lambda d: combine(d, out=d.full((T, H), 7.0).requires_grad_()))
case("combine-rows-require-grad-out", TypeError, ["rows", "requires grad"],
     lambda d: combine(d, rows=d.rows.requires_grad_(), out=d.full((T, H), 7.0)))
case("combine-rows-require-grad-no-grad", TypeError, ["rows", "requires grad"],
     lambda d: (no_grad(moe.moe_combine, d.rows.requires_grad_(), d.dest, d.w), [d.rows, d.dest, d.w]))
case("combine-rows-strided", ValueError, ["rows", "contiguous"],
     lambda d: combine(d, rows=d.full((H, T * K), 1.0).T), BOTH)


def _rows_in_out(d):
    buf = d.full((T * K, H), 7.0)
    return (lambda: moe.moe_combine(buf, d.dest, d.w, out=buf[:T])), [buf, d.dest, d.w]


def _weights_in_out(d):
    buf = d.full((T, H), 0.5)
    return (lambda: moe.moe_combine(d.rows, d.dest, buf[:, :K], out=buf)), [buf, d.rows, d.dest]


case("combine-rows-inside-out", ValueError, ["rows", r"\bout\b"], _rows_in_out, BOTH)
case("combine-weights-inside-out", ValueError, ["weights", r"\bout\b"], _weights_in_out, BOTH)

# --------------------------------------------------------------------------- gated_act, gated_act_backward
def act(d, *arrays, gate_up=None, **kwargs):
    g = d.gate_up if gate_up is None else gate_up
    extra = [v for k, v in kwargs.items() if k in ("out", "limit") and v is not None]
    return (lambda: moe.gated_act(g, **kwargs)), \
        [x for x in (g, *extra, *arrays) if not isinstance(x, list)]


case("act-gate-up-odd", ValueError, ["gate_up", "even"], lambda d: act(d, gate_up=d.gate_up[:, :-1]), BOTH)
case("act-gate-up-1d", ValueError, ["gate_up"], lambda d: act(d, gate_up=d.gate_up[0]), BOTH)
case("act-gate-up-int", TypeError, ["gate_up"], lambda d: act(d, gate_up=d.full((4, 6), 1, "int64")), BOTH)
case("act-gate-up-list", TypeError, ["gate_up", "list"], lambda d: act(d, gate_up=d.gate_up.tolist()))
case("act-unknown", ValueError, ["act", "silu"], lambda d: act(d, act="swish"), BOTH)
case("act-not-str", TypeError, ["act", "str"], lambda d: act(d, act=1))
case("act-limit-float", TypeError, ["limit"], lambda d: act(d, limit=d.full((E,), 3.0)), BOTH)
case("act-limit-2d", ValueError, ["limit"], lambda d: act(d, limit=d.full((2, 2), 3, "int32")), BOTH)
case("act-limit-empty", ValueError, ["limit"], lambda d: act(d, limit=d.full((0,), 3, "int32")), BOTH)
case("act-out-shape", ValueError, [r"\bout\b"], lambda d: act(d, out=d.full((T * K, INTER + 1), 7.0)), BOTH)
case("act-out-other-dtype", TypeError, [r"\bout\b", "F16"],
     lambda d: act(d, out=d.full((T * K, INTER), 7.0, "float16")), BOTH)
case("act-gate-up-require-grad-no-grad", TypeError, ["gate_up", "requires grad"],
     lambda d: (no_grad(moe.gated_act, d.gate_up.requires_grad_()), [d.gate_up]))


def _act_out_in_gate_up(d):
    g = d.full((T * K, 2 * INTER), 0.25)
    return (lambda: moe.gated_act(g, out=g[:, INTER:])), [g]


case("act-out-inside-gate-up", ValueError, ["gate_up", r"\bout\b"], _act_out_in_gate_up, BOTH)


def act_bwd(d, grad_act=None, **kwargs):
    ga = d.grad_act if grad_act is None else grad_act
    extra = [kwargs[k] for k in ("out", "row_scale", "act_out", "row_dot") if kwargs.get(k) is not None]
    return (lambda: moe.gated_act_backward(d.gate_up, ga, **kwargs)), \
        [x for x in (d.gate_up, ga, *extra) if not isinstance(x, list)]


case("act-bwd-grad-shape", ValueError, ["grad_act"], lambda d: act_bwd(d, grad_act=d.grad_act[:, :-1]), BOTH)
case("act-bwd-grad-list", TypeError, ["grad_act", "list"], lambda d: act_bwd(d, grad_act=d.grad_act.tolist()))
case("act-bwd-act-unknown", ValueError, ["act"], lambda d: act_bwd(d, act="tanh"), BOTH)
case("act-bwd-out-shape", ValueError, [r"\bout\b"],
     lambda d: act_bwd(d, out=d.full((T * K, INTER), 7.0)), BOTH)
case("act-bwd-grad-inside-out", ValueError, ["grad_act", r"\bout\b"],
     lambda d: (lambda o: act_bwd(d, grad_act=o[:, :INTER], out=o))(d.full((T * K, 2 * INTER), 7.0)), BOTH)
case("act-bwd-row-scale-1d", ValueError, ["row_scale"], lambda d: act_bwd(d, row_scale=d.full((T * K,), 1.0)),
     BOTH)
case("act-bwd-row-scale-rows", ValueError, ["row_scale"],
     lambda d: act_bwd(d, row_scale=d.full((T * K - 1, 1), 1.0)), BOTH)
case("act-bwd-row-scale-int", TypeError, ["row_scale"],
     lambda d: act_bwd(d, row_scale=d.full((T * K, 1), 1, "int32")), BOTH)
case("act-bwd-act-out-shape", ValueError, ["act_out"],
     lambda d: act_bwd(d, act_out=d.full((T * K, INTER + 1), 7.0)), BOTH)
case("act-bwd-act-out-other-dtype", TypeError, ["act_out", "F16"],
     lambda d: act_bwd(d, act_out=d.full((T * K, INTER), 7.0, "float16")), BOTH)
case("act-bwd-row-dot-shape", ValueError, ["row_dot"], lambda d: act_bwd(d, row_dot=d.full((T * K, 2), 7.0)),
     BOTH)
case("act-bwd-row-dot-f16", TypeError, ["row_dot"],
     lambda d: act_bwd(d, row_dot=d.full((T * K, 1), 7.0, "float16")), BOTH)
case("act-bwd-act-out-inside-gate-up", ValueError, ["gate_up", "act_out"],
     lambda d: act_bwd(d, act_out=d.gate_up[:, :INTER]), BOTH)
case("act-bwd-row-dot-inside-out", ValueError, ["row_dot", r"\bout\b"],
     lambda d: (lambda o: act_bwd(d, out=o, row_dot=o[:, :1]))(d.full((T * K, 2 * INTER), 7.0)), BOTH)


def _act_out_shifted_over_grad(d):
    """act_out overlapping grad_act one row apart: not the same view, refused."""
    buf = d.full((T * K + 1, INTER), 0.5)
    return act_bwd(d, grad_act=buf[:-1], act_out=buf[1:])


case("act-bwd-act-out-overlaps-grad", ValueError, ["grad_act", "act_out"], _act_out_shifted_over_grad, BOTH)


def _out_shifted_over_gate_up(d):
    """out overlapping gate_up one row apart: only gate_up itself may be out."""
    buf = d.full((T * K + 1, 2 * INTER), 0.5)
    gate_up, grad = buf[:-1], d.full((T * K, INTER), 0.25)
    return (lambda: moe.gated_act_backward(gate_up, grad, out=buf[1:])), [buf, grad]


def _grad_inside_gate_up_written_over(d):
    """out over gate_up stands for both: grad_act inside it is refused."""
    gate_up = d.full((T * K, 2 * INTER), 0.5)
    return (lambda: moe.gated_act_backward(gate_up, gate_up[:, :INTER], out=gate_up)), [gate_up]


case("act-bwd-out-overlaps-gate-up", ValueError, ["gate_up", r"\bout\b"], _out_shifted_over_gate_up, BOTH)
case("act-bwd-grad-inside-gate-up-as-out", ValueError, ["grad_act", "gate_up"],
     _grad_inside_gate_up_written_over, BOTH)

# --------------------------------------------------------------------------- grouped_gemm
def gemm(d, a=None, w=None, offsets=None, **kwargs):
    a, w = (d.a if a is None else a), (d.wmat if w is None else w)
    offsets = d.offsets if offsets is None else offsets
    extra = [kwargs["out"]] if kwargs.get("out") is not None else []
    return (lambda: moe.grouped_gemm(a, w, offsets, **kwargs)), \
        [x for x in (a, w, offsets, *extra) if not isinstance(x, list)]


def _offsets(d, values):
    return d.full((E,), 0, "int32") + (torch.tensor(values, dtype=torch.int32) if d.fw == "torch"
                                         else np.array(values, dtype=np.int32))


case("gemm-w-other-experts", ValueError, [r"\bw\b", "E = 4"], lambda d: gemm(d, w=d.wmat[:3]), BOTH)
case("gemm-w-other-k", ValueError, [r"\bw\b", "K = 8"], lambda d: gemm(d, w=d.wmat[:, :-1]), BOTH)
case("gemm-w-other-dtype", TypeError, [r"\bw\b"],
     lambda d: gemm(d, w=d.full((E, H, N), 1.0, "float16")), BOTH)
case("gemm-offsets-int64", TypeError, ["offsets", "I64"],
     lambda d: gemm(d, offsets=d.full((E,), 3, "int64")), BOTH)
case("gemm-offsets-empty", ValueError, ["offsets"], lambda d: gemm(d, offsets=d.full((0,), 0, "int32")), BOTH)
case("gemm-offsets-decreasing", ValueError, [r"offsets\[2\] = 1"],
     lambda d: gemm(d, offsets=_offsets(d, [3, 5, 1, 12]), out=d.full((T * K, N), 7.0)), BOTH)
case("gemm-offsets-beyond-rows", ValueError, [r"offsets\[3\] = 13"],
     lambda d: gemm(d, offsets=_offsets(d, [3, 5, 8, 13]), out=d.full((T * K, N), 7.0)), BOTH)
case("gemm-a-list", TypeError, [r"\ba\b", "list"], lambda d: gemm(d, a=d.a.tolist()))
case("gemm-out-shape", ValueError, [r"\bout\b"], lambda d: gemm(d, out=d.full((T * K, N + 1), 7.0)), BOTH)
case("gemm-out-inside-a", ValueError, [r"\ba\b", r"\bout\b"],
     lambda d: (lambda buf: gemm(d, a=buf[:, :H], out=buf[:, H - 1:H - 1 + N]))(d.full((T * K, H + N), 0.5)),
     BOTH)

# --------------------------------------------------------------------------- topk_softmax
def topk(d, logits=None, k=2, **kwargs):
    x = d.logits if logits is None else logits
    return (lambda: moe.topk_softmax(x, k, **kwargs)), [x] if not isinstance(x, list) else []


for value in (0, -1, E + 1, 2**40):
    case(f"topk-k-{value}", ValueError, ["k = "], lambda d, v=value: topk(d, k=v), BOTH)
case("topk-k-over-32", ValueError, ["k = 33"], lambda d: topk(d, logits=d.full((T, 64), 0.5), k=33))
for value in (2.0, True, "2"):
    case(f"topk-k-{type(value).__name__}", TypeError, ["k must be an int"], lambda d, v=value: topk(d, k=v))
case("topk-logits-int", TypeError, ["logits"], lambda d: topk(d, logits=d.full((T, E), 1, "int32")), BOTH)
case("topk-logits-list", TypeError, ["logits", "list"], lambda d: topk(d, logits=d.logits.tolist()))
case("topk-logits-3d", ValueError, ["logits"], lambda d: topk(d, logits=d.full((2, T, E), 0.5)), BOTH)
case("topk-logits-too-many-experts", ValueError, ["logits", "1025 experts"],
     lambda d: topk(d, logits=d.full((T, 1025), 0.5)), BOTH)
case("topk-out-dtype-unknown", ValueError, ["out_dtype", "float17"],
     lambda d: topk(d, out_dtype="float17"), BOTH)
case("topk-index-dtype-unknown", ValueError, ["index_dtype", "int8"],
     lambda d: topk(d, index_dtype="int8"), BOTH)
case("topk-index-dtype-not-a-dtype", TypeError, ["index_dtype"], lambda d: topk(d, index_dtype=5))
case("topk-logits-require-grad", TypeError, ["logits", "requires grad"],
     lambda d: topk(d, logits=d.logits.requires_grad_()))

# --------------------------------------------------------------------------- moe_gather_rows
def gather(d, num_rows=T * K, dest=None, **kwargs):
    dest = d.dest if dest is None else dest
    extra = [v for k, v in kwargs.items()
             if k in ("out", "weights") and v is not None and not isinstance(v, list)]
    return (lambda: moe.moe_gather_rows(d.src, dest, num_rows, **kwargs)), [d.src, dest, *extra]


for value in (-1, 2**40):
    case(f"gather-num-rows-{value}", ValueError, ["num_rows"], lambda d, v=value: gather(d, num_rows=v), BOTH)
for value in (2.0, True):
    case(f"gather-num-rows-{type(value).__name__}", TypeError, ["num_rows", "int"],
         lambda d, v=value: gather(d, num_rows=v))
case("gather-dest-beyond-rows", ValueError, [r"dest\[", "rows = 8"],
     lambda d: gather(d, num_rows=8, out=d.full((8, H), 7.0)), BOTH)
case("gather-dest-repeated", ValueError, [r"dest\[", "earlier entry"],
     lambda d: gather(d, dest=_with(d, "dest", 0), out=d.full((T * K, H), 7.0)), BOTH)
case("gather-weights-shape", ValueError, ["weights"], lambda d: gather(d, weights=d.w[:, :1]), BOTH)
case("gather-out-dtype-unknown", ValueError, ["out_dtype"], lambda d: gather(d, out_dtype="half-ish"), BOTH)
case("gather-out-other-rows", ValueError, [r"\bout\b", "num_rows"],
     lambda d: gather(d, out=d.full((T * K + 1, H), 7.0)), BOTH)
case("gather-out-dtype-not-out-s", ValueError, ["out_dtype", "bfloat16"],
     lambda d: gather(d, out=d.full((T * K, H), 7.0), out_dtype=torch.bfloat16))
case("gather-src-list", TypeError, ["src", "list"],
     lambda d: ((lambda: moe.moe_gather_rows(d.src.tolist(), d.dest, T * K)), [d.dest]))

# --------------------------------------------------------------------------- moe_weight_grad
def wgrad(d, a=None, dest=None, **kwargs):
    a, dest = (d.src if a is None else a), (d.dest if dest is None else dest)
    extra = [kwargs["out"]] if kwargs.get("out") is not None else []
    return (lambda: moe.moe_weight_grad(a, d.rows, dest, **kwargs)), [a, d.rows, dest, *extra]


case("wgrad-a-other-tokens", ValueError, [r"\ba\b"], lambda d: wgrad(d, a=d.src[:4]), BOTH)
case("wgrad-a-by-row-other-rows", ValueError, [r"\ba\b"], lambda d: wgrad(d, a_by_row=True), BOTH)
case("wgrad-b-list", TypeError, [r"\bb\b", "list"],
     lambda d: ((lambda: moe.moe_weight_grad(d.src, d.rows.tolist(), d.dest)), [d.src, d.dest]))
case("wgrad-dest-out-of-range", ValueError, [r"dest\["],
     lambda d: wgrad(d, dest=_with(d, "dest", 99), out=d.full((T, K), 7.0)), BOTH)
case("wgrad-out-dtype-not-a-dtype", TypeError, ["out_dtype"], lambda d: wgrad(d, out_dtype=3))
case("wgrad-out-shape", ValueError, [r"\bout\b"], lambda d: wgrad(d, out=d.full((T, K + 1), 7.0)), BOTH)


# --------------------------------------------------------------------------- recorded by autograd (torch ops)
def graded(d, fn, *args, **kwargs):
    """fn(*args) with its first tensor requiring grad: the differentiable path."""
    first = args[0].requires_grad_()
    return (lambda: fn(*args, **kwargs)), [a for a in args if isinstance(a, torch.Tensor)] + [first]


case("grad-dispatch-num-experts-negative", ValueError, ["num_experts"],
     lambda d: graded(d, moe.moe_dispatch, d.hidden, d.ids, -3))
case("grad-dispatch-num-experts-float", TypeError, ["num_experts", "int"],
     lambda d: graded(d, moe.moe_dispatch, d.hidden, d.ids, 4.0))
case("grad-dispatch-ids-list", TypeError, ["top_k_index", "list"],
     lambda d: graded(d, moe.moe_dispatch, d.hidden, d.ids.tolist(), E))
case("grad-dispatch-capacity-negative", ValueError, ["capacity"],
     lambda d: graded(d, moe.moe_dispatch, d.hidden, d.ids, E, top_k_weights=d.w, capacity=-1))
case("grad-combine-dest-list", TypeError, ["dest", "list"],
     lambda d: graded(d, moe.moe_combine, d.rows, d.dest.tolist(), d.w))
case("grad-combine-weights-shape", ValueError, ["weights"],
     lambda d: graded(d, moe.moe_combine, d.rows, d.dest, d.w[:, :1]))
case("grad-combine-out-dtype-unknown", ValueError, ["out_dtype", "float17"],
     lambda d: graded(d, moe.moe_combine, d.rows, d.dest, d.w, out_dtype="float17"))
case("grad-combine-out-dtype-int", ValueError, ["out_dtype", "int32"],
     lambda d: graded(d, moe.moe_combine, d.rows, d.dest, d.w, out_dtype=torch.int32))
case("grad-combine-out-dtype-not-a-dtype", TypeError, ["out_dtype"],
     lambda d: graded(d, moe.moe_combine, d.rows, d.dest, d.w, out_dtype=3))
case("grad-act-not-str", TypeError, ["act", "str"], lambda d: graded(d, moe.gated_act, d.gate_up, 1))
case("grad-act-unknown", ValueError, ["act"], lambda d: graded(d, moe.gated_act, d.gate_up, "swish"))
case("grad-gemm-offsets-list", TypeError, ["offsets", "list"],
     lambda d: graded(d, moe.grouped_gemm, d.a, d.wmat, d.offsets.tolist()))
case("grad-gather-num-rows-float", TypeError, ["num_rows", "int"],
     lambda d: graded(d, moe.moe_gather_rows, d.src, d.dest, 2.0))
case("grad-gather-num-rows-negative", ValueError, ["num_rows"],
     lambda d: graded(d, moe.moe_gather_rows, d.src, d.dest, -1))


# --------------------------------------------------------------------------- the test
@pytest.mark.parametrize("build, fw, exc, pattern", CASES)
def test_bad_input(build, fw, exc, pattern, monkeypatch):
    call, arrays = build(Data(fw))
    snaps = snapshot(*arrays)
    made = []
    for name in ("empty", "torch_outputs", "separate_outputs"):  # every allocator of the direct path
        real = getattr(_moe_core, name)
        monkeypatch.setattr(_moe_core, name, lambda *a, _real=real, **k: made.append(a[1:]) or _real(*a, **k))
    with pytest.raises(exc, match=pattern):
        call()
    assert not made, f"allocated {made} before raising"
    assert_unchanged(arrays, snaps)


def test_the_table_covers_every_operation():
    ids = [p.id for p in CASES]
    for op in ("dispatch", "combine", "act", "act-bwd", "gemm", "topk", "gather", "wgrad"):
        assert any(i.startswith(op + "-") for i in ids), op
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("fw", BOTH)
def test_empty_calls_are_good_calls(fw):
    """No token: every operation returns empty outputs of the right shapes."""
    d = Data(fw)
    hidden, ids, w = d.hidden[:0], d.ids[:0], d.w[:0]
    out = moe.moe_dispatch(hidden, ids, E, top_k_weights=w, capacity=0)
    assert tuple(out.rows.shape) == (0, H) and tuple(out.dest.shape) == (0, K)
    assert tuple(moe.moe_combine(d.rows, out.dest, w).shape) == (0, H)
    assert tuple(moe.gated_act(d.gate_up[:0]).shape) == (0, INTER)
    assert tuple(moe.topk_softmax(d.logits[:0], 2)[1].shape) == (0, 2)
    assert tuple(moe.moe_gather_rows(d.src[:0], out.dest, 0).shape) == (0, H)


def test_dtypes_are_taken_as_objects_and_names():
    d = Data("torch")
    for dtype, want in ((torch.bfloat16, torch.bfloat16), ("bfloat16", torch.bfloat16),
                        (np.float16, torch.float16), (np.dtype("float32"), torch.float32)):
        assert moe.moe_combine(d.rows, d.dest, d.w, out_dtype=dtype).dtype == want
    w, i = moe.topk_softmax(d.logits, 2, out_dtype=torch.float16, index_dtype=torch.int32)
    assert w.dtype == torch.float16 and i.dtype == torch.int32


def test_a_repeated_expert_is_two_assignments_without_distinct():
    d = Data("torch")
    ids = d.ids.clone()
    ids[2, 1] = ids[2, 0]
    out = moe.moe_dispatch(d.hidden, ids, E)
    assert out.dest[2, 0] != out.dest[2, 1] and int(out.offsets[-1]) == T * K


@pytest.mark.parametrize("fw", BOTH)
def test_distinct_takes_a_repeat_of_weight_zero(fw):
    """A repeat whose weight is 0 adds nothing (LongCat-Flash routes its zero
    experts so): `distinct` takes it, as two assignments; of nonzero weight,
    refuses it."""
    d = Data(fw)
    ids, w = _with(d, "ids", 2), _with(d, "w", 0.0)
    out = moe.moe_dispatch(d.hidden, ids, E, top_k_weights=w, distinct=True)
    assert int(out.offsets[2]) - int(out.offsets[1]) == 4  # expert 2: tokens 1, 2 (twice), 4
    with pytest.raises(ValueError, match="distinct"):
        moe.moe_dispatch(d.hidden, ids, E, top_k_weights=_with(d, "w", 0.5), distinct=True)
