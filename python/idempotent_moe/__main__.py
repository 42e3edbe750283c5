"""`python -m idempotent_moe`: a short self-check of this installation.

Prints the version, the build (whether its CUDA kernels were compiled), the
devices (whether a CUDA device can run them; the GPU's name when torch sees
one) and runs a tiny compaction on NumPy arrays (and on the GPU when one is
usable) against a plain NumPy reference. Exit status 0 when every check
passed, 1 otherwise. `--version` prints the version alone. The benchmarks
live in the repository's benchmarks/ project (`python -m imoe_bench`), not
in this package.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from . import __version__, compact_, cuda_available, cuda_compiled

_N, _C, _ROWS, _WIDTH = 64, 24, 3, 5


def _reference(x: np.ndarray, scores: np.ndarray, capacity: int) -> tuple:
    """The kept set of each row (the top `capacity` by score, ties to the lower
    slot) and the row contents compact_ must leave in its first `capacity` slots
    (as a set: inplace order keeps no particular order)."""
    kept_sets, rows = [], []
    for r in range(x.shape[0]):
        order = np.lexsort((np.arange(x.shape[1]), -scores[r].astype(np.float64)))
        kept = np.sort(order[:capacity])
        kept_sets.append(kept)
        rows.append(sorted(map(tuple, x[r, kept].tolist())))
    return kept_sets, rows


def _parity(device: str) -> str | None:
    """compact_ on a [3, 64, 5] buffer against the NumPy reference; None when
    it matches, else what differed."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((_ROWS, _N, _WIDTH)).astype(np.float32)
    scores = rng.permutation(_ROWS * _N).reshape(_ROWS, _N).astype(np.float32)
    kept, rows = _reference(x, scores, _C)
    if device == "cpu":
        buf, s = x.copy(), scores.copy()
        values, indices = compact_(buf, s, _C)
        values, indices = np.asarray(values), np.asarray(indices)
    else:
        import torch

        buf, s = torch.from_numpy(x.copy()).cuda(), torch.from_numpy(scores).cuda()
        values, indices = compact_(buf, s, _C)
        values, indices = values.cpu().numpy(), indices.cpu().numpy()
    for r in range(_ROWS):
        if not np.array_equal(np.sort(indices[r]), kept[r]):
            return f"row {r}: kept slots {sorted(indices[r].tolist())}, expected {kept[r].tolist()}"
        if not np.array_equal(values[r], x[r, indices[r]]):
            return f"row {r}: the values moved are not the slots named by the indices"
        if sorted(map(tuple, values[r].tolist())) != rows[r]:
            return f"row {r}: the kept rows differ from the reference"
    return None


def _gpu_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # a broken driver is reported as no GPU, not a traceback
        return None


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m idempotent_moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"idempotent_moe {__version__}")
    parser.parse_args(argv)
    ok = True
    print(f"idempotent_moe {__version__}")
    try:
        from ._native import native

        native()
    except ImportError as exc:
        print(f"build: FAILED, {exc}")
        return 1
    compiled, available, gpu = cuda_compiled(), cuda_available(), _gpu_name()
    print(f"build: native part loaded, CUDA kernels {'compiled' if compiled else 'not compiled'}")
    print(f"devices: cuda_available={available}, "
          + (f"torch sees {gpu}" if gpu else "no GPU seen by torch"))
    devices = ["cpu"] + (["cuda"] if available and gpu else [])
    for device in devices:
        try:
            problem = _parity(device)
        except Exception as exc:  # reported, not raised: this is the check
            problem = f"{type(exc).__name__}: {exc}"
        ok = ok and problem is None
        print(f"parity {device}: compact_ [{_ROWS}, {_N}, {_WIDTH}] keep {_C}: "
              + ("ok, matches the NumPy reference" if problem is None else f"FAILED, {problem}"))
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
