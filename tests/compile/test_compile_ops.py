"""The custom ops (idempotent_moe::*) themselves: their schemas declare what
they write, torch.library.opcheck passes, they run the direct path in eager
and inside a compile session, only torch tensors take them, eager calls never
load them, and bad data under compile raises and changes nothing."""

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
from _helpers import bits, make_data, make_scores, package_env  # noqa: E402
from _helpers.compiling import (  # noqa: E402
    same,
    seeded,
)
from idempotent_moe import _torch_ops  # noqa: E402

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
                                    torch.empty(5, dtype=torch.int64), torch.empty(32, dtype=torch.int64),
                                    None, None)),
]


@pytest.mark.parametrize("name, make", OPCHECK, ids=[c[0] for c in OPCHECK])
def test_opcheck(name, make):
    """torch's own checks of a custom op: the schema (declared writes are the
    only writes), the fake implementation, AOT dispatch with dynamic shapes."""
    result = torch.library.opcheck(getattr(torch.ops.idempotent_moe, name).default, make(seeded(0)))
    assert set(result.values()) == {"SUCCESS"}, result


def test_ops_run_in_eager():
    """Called directly, an op runs the public function's direct path."""
    g = seeded(3)
    x = make_data((4, 32, 8), "float16", "torch", g)
    s = make_scores((4, 32), "float32", "torch", g)
    y = x.clone()
    idx = torch.empty(4, 12, dtype=torch.int64)
    torch.ops.idempotent_moe.compact_([x], s, None, 12, None, "move", "inplace", 0, 0, "raise", idx,
                                      None, None, None)
    ref = imoe.compact_(y, s, 12, mode="move")
    same([x, idx], [y, ref.indices])


def test_op_inside_a_compile_session_takes_the_direct_path(monkeypatch):
    """While a compile session is open (torch 2.13 reports is_compiling() for
    its whole length), an op's real implementation still calls the direct
    path: the public function does not route back into the op."""
    from idempotent_moe import _tracing

    monkeypatch.setattr(_tracing, "compiling", lambda: True)
    g = seeded(5)
    x = make_data((2, 16, 4), "float32", "torch", g)
    s = make_scores((2, 16), "float32", "torch", g)
    y = x.clone()
    idx = torch.empty(2, 6, dtype=torch.int64)
    torch.ops.idempotent_moe.compact_([x], s, None, 6, None, "swap", "inplace", 0, 0, "raise", idx,
                                      None, None, None)
    monkeypatch.undo()
    same([x, idx], [y, imoe.compact_(y, s, 6).indices])


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
    g = seeded(4)
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
