"""Shared test helpers: the NumPy reference of selection and pairing, bit-exact
views of torch tensors and NumPy arrays, array factories, the repository's
paths, the environment of subprocesses and the launcher of multi-rank
scripts. The hooks and fixtures are in conftest.py. Test modules import
these as `from _helpers import ...`: pytest puts tests/ on sys.path, where
tests/conftest.py is (no tests folder is a package)."""

from __future__ import annotations

import os

import numpy as np
import pytest

try:
    import torch
except ImportError:  # the NumPy-only tests still run
    torch = None

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)  # the repository

requires_torch = pytest.mark.skipif(torch is None, reason="needs torch")

FRAMEWORKS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("torch", id="torch", marks=requires_torch),
]
DATA_DTYPES = ["float64", "float32", "float16", "bfloat16", "int8", "uint8", "bool"]
SCORE_DTYPES = ["float32", "float16", "bfloat16"]
# For hypothesis strategies (sampled_from takes plain values, not params).
PROPERTY_FRAMEWORKS = ["numpy"] + (["torch"] if torch is not None else [])
PROPERTY_DTYPES = ["float32", "float16", "int8", "uint8", "float64", "bool"]


def property_settings(max_examples: int):
    """Hypothesis settings of the property tests: no deadline, big examples allowed."""
    from hypothesis import HealthCheck, settings

    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# Small values with many ties, -0.0 beside +0.0 and both infinities: exact in
# bf16 and fp16, so every score dtype sees the same ranking problem.
TIE_VALUES = np.array([-2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 1.0, 2.0, np.inf, -np.inf])


def package_env() -> dict:
    """os.environ with the root of the idempotent_moe these tests import first
    on PYTHONPATH (an installed wheel in CI, python/ in a checkout): a
    subprocess started with it imports the same package."""
    import idempotent_moe

    root = os.path.dirname(os.path.dirname(os.path.abspath(idempotent_moe.__file__)))
    return dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))



# --------------------------------------------------------------------------- arrays


def is_torch(x) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def supported(framework: str, dtype: str) -> bool:
    """NumPy has no bfloat16."""
    return not (framework == "numpy" and dtype == "bfloat16")


def _torch_dtype(name: str):
    return getattr(torch, name)


def make_data(shape, dtype: str, framework: str, rng: np.random.Generator):
    """A contiguous array of random bit patterns (NaN payloads, denormals and
    all), so that any arithmetic on the data would show up as a bit change."""
    shape = tuple(shape)
    if dtype == "bool":
        raw = rng.integers(0, 2, size=shape).astype(np.bool_)
        return torch.from_numpy(raw) if framework == "torch" else raw
    itemsize = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 1)
    raw = rng.integers(0, 256, size=shape + (itemsize,), dtype=np.uint8)
    ints = raw.view(f"<i{itemsize}").reshape(shape)  # torch has no uint16 / uint32 views
    if framework == "torch":
        return torch.from_numpy(ints).view(_torch_dtype(dtype))
    return ints.view(dtype)


def make_scores(shape, dtype: str, framework: str, rng: np.random.Generator, ties: bool = True):
    """Scores of `dtype` with many ties (or distinct-ish normals when not `ties`)."""
    shape = tuple(shape)
    if ties:
        values = rng.choice(TIE_VALUES, size=shape)
    else:
        values = rng.standard_normal(size=shape)
    return scores_from_values(values, dtype, framework)


def scores_from_values(values, dtype: str, framework: str):
    values = np.asarray(values, dtype=np.float64)
    if framework == "torch":
        return torch.from_numpy(values).to(_torch_dtype(dtype))
    return values.astype(dtype)


def to_framework(array: np.ndarray, framework: str):
    return torch.from_numpy(np.ascontiguousarray(array)) if framework == "torch" else array


def to_numpy(x) -> np.ndarray:
    """A NumPy copy of an integer or float32/float16 array (torch or NumPy)."""
    if is_torch(x):
        return x.detach().cpu().numpy().copy()
    return np.array(x, copy=True)


def scores_f64(scores) -> np.ndarray:
    """The scores as float64 (exact for every score dtype)."""
    if is_torch(scores):
        return scores.detach().double().cpu().numpy()
    return np.asarray(scores).astype(np.float64)


def bits(x) -> np.ndarray:
    """A NumPy copy of x's bit patterns, same shape: equal bits <=> equal memory."""
    if is_torch(x):
        t = x.detach()
        size = t.element_size()
        t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
        return t.cpu().numpy().copy()
    a = np.ascontiguousarray(x)
    if a.itemsize in (1, 2, 4, 8):
        return a.view(f"u{a.itemsize}").copy()
    return a.view(np.uint8).reshape(a.shape + (a.itemsize,)).copy()  # complex128, records


def snapshot(*arrays) -> list:
    return [bits(a) for a in arrays]


def assert_unchanged(arrays, snaps) -> None:
    for k, (a, s) in enumerate(zip(arrays, snaps)):
        np.testing.assert_array_equal(bits(a), s, err_msg=f"array #{k} was modified")


def read_only(a: np.ndarray) -> np.ndarray:
    """a, no longer writeable."""
    a.flags.writeable = False
    return a


def ulps(a, b) -> int:
    """Largest distance in units in the last place of two torch tensors, as fp32."""
    a, b = a.float().contiguous(), b.float().contiguous()
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def clone(x):
    return x.clone() if is_torch(x) else x.copy()


def data_ptr(x) -> int:
    return x.data_ptr() if is_torch(x) else x.__array_interface__["data"][0]


# --------------------------------------------------------------------------- bad input


def names(*words: str) -> str:
    """A regex that needs every one of `words` (regexes) somewhere in the message."""
    return "(?s)^" + "".join(f"(?=.*{w})" for w in words)


# --------------------------------------------------------------------------- reference


def reference_kept(scores, capacity: int, prefix: int = 0, window: int = 0,
                   nan_lowest: bool = False) -> list:
    """The kept set of every row (lead axes flattened), each sorted ascending.

    The first C of a stable sort by (score desc, index asc) over [P, N - W),
    plus the prefix [0, P) and the window [N - W, N), from float64 scores;
    -0.0 ties +0.0; with nan_lowest a NaN ranks below -inf.
    """
    s = scores_f64(scores)
    n = s.shape[-1]
    score_rows = rows(s)
    if capacity >= n:
        return [np.arange(n) for _ in range(score_rows.shape[0])]
    assert 0 <= capacity and prefix + window <= capacity
    middle = np.arange(prefix, n - window)
    kept_rows = []
    for row in score_rows:
        values = row[middle] + 0.0  # -0.0 + 0.0 == +0.0
        nan = np.isnan(values)
        assert nan_lowest or not nan.any(), "NaN in reference scores"
        desc = np.where(nan, 0.0, -values)
        order = np.lexsort((middle, desc, nan))  # last key is the primary one
        chosen = middle[order[: capacity - prefix - window]]
        kept = np.concatenate([np.arange(prefix), chosen, np.arange(n - window, n)])
        kept_rows.append(np.sort(kept))
    return kept_rows


def reference_indices(kept_rows, n: int, capacity: int, lead=None) -> np.ndarray:
    """The pairing rule: kept slots below C' are fixed points; the j-th hole
    (ascending) takes the j-th kept tail slot (ascending)."""
    c = max(0, min(capacity, n))
    out = np.empty((len(kept_rows), c), dtype=np.int64)
    for r, kept in enumerate(kept_rows):
        kept = np.asarray(kept)
        holes = np.setdiff1d(np.arange(c), kept)
        tail = np.sort(kept[kept >= c])
        assert len(holes) == len(tail)
        row = np.arange(c)
        row[holes] = tail
        out[r] = row
    return out if lead is None else out.reshape(tuple(lead) + (c,))


def rows(a: np.ndarray) -> np.ndarray:
    """a [lead..., K] as [R, K] (also when K is 0)."""
    a = np.asarray(a)
    return a.reshape(int(np.prod(a.shape[:-1], dtype=np.int64)), a.shape[-1])


def target_map_from_indices(indices: np.ndarray, n: int) -> np.ndarray:
    """The involution [lead..., N] that the indices [lead..., C'] describe."""
    indices = np.asarray(indices, dtype=np.int64)
    lead = indices.shape[:-1]
    flat = rows(indices)
    tm = np.tile(np.arange(n), (flat.shape[0], 1))
    for r in range(flat.shape[0]):
        for i, j in enumerate(flat[r]):
            tm[r, i], tm[r, j] = j, i
    return tm.reshape(tuple(lead) + (n,))


def expected_after(before_bits: np.ndarray, dim: int, indices: np.ndarray, mode: str) -> np.ndarray:
    """What a buffer (bits [lead..., N, row...], slot axis `dim`) holds after the
    compaction described by `indices` [lead..., C']."""
    shape = before_bits.shape
    lead, n = shape[:dim], shape[dim]
    r = int(np.prod(lead, dtype=np.int64))
    c = indices.shape[-1]
    row = int(np.prod(shape[dim + 1:], dtype=np.int64))
    src = np.ascontiguousarray(before_bits).reshape(r, n, row)
    idx = np.asarray(indices, dtype=np.int64).reshape(r, c)
    out = src.copy()
    for row in range(r):
        if mode == "swap":
            tm = target_map_from_indices(idx[row], n)
            out[row] = src[row][tm]
        else:
            out[row, :c] = src[row][idx[row]]
    return out.reshape(shape)


def assert_involution(target_map: np.ndarray) -> None:
    tm = np.asarray(target_map, dtype=np.int64)
    n = tm.shape[-1]
    flat = rows(tm)
    assert ((flat >= 0) & (flat < n)).all(), "target_map entry out of range"
    for row in flat:
        np.testing.assert_array_equal(row[row], np.arange(n), err_msg="not an involution")


def run_ranks(script: str, rank_args, timeout: float) -> None:
    """Start `script` once per rank as `python script RANK PORT *rank_args(r)`
    (one free port on 127.0.0.1 for the rendezvous, one OpenMP thread each,
    gloo on the loopback, tests/ on PYTHONPATH for the script's imports of
    the helpers), wait for all, and fail with every rank's output when one
    exits non-zero. `rank_args(r)` gives rank r's other arguments."""
    import socket
    import subprocess
    import sys

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    world = len(rank_args)
    procs = [subprocess.Popen([sys.executable, script, str(r), str(port), *rank_args[r]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n" + "\n".join(logs)
