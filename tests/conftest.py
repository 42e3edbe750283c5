"""The library tests' hooks and fixtures: transformers' deprecations as
errors, uninitialised memory poisoned on the CPU, the `gpu` marker's skip
without a usable GPU, and the `rng` fixture. The helpers the tests import
are in _helpers/ (benchmarks/tests/conftest.py loads this file by its path
for its hooks, so it imports none of them)."""

from __future__ import annotations

import numpy as np
import pytest

try:
    import torch
except ImportError:  # the NumPy-only tests still run
    torch = None

# transformers announces what it will remove with FutureWarning (and with
# DeprecationWarning in places); the tests, like the docs and the integrations,
# use its current API, so such a warning fails the test that triggers it. A
# deprecated argument is reported at the caller's line (deprecate_kwarg warns
# with stacklevel 2), hence its message beside the module.
TRANSFORMERS_DEPRECATIONS = (
    "error::FutureWarning:transformers",
    "error::DeprecationWarning:transformers",
    "error:.*is deprecated and will be removed in:FutureWarning",
)


def pytest_configure(config):
    for spec in TRANSFORMERS_DEPRECATIONS:
        config.addinivalue_line("filterwarnings", spec)
    poison_uninitialized_memory()


def poison_uninitialized_memory() -> None:
    """Without a GPU (CI), torch fills every tensor it allocates uninitialised
    (ours and those inside its ops, grouped_mm's unwritten rows among them)
    with NaN, or an integer dtype's largest value: a read of such memory fails
    a test every run instead of now and then. GPU runs keep torch's defaults,
    whose kernels and timings deterministic mode would change."""
    if torch is not None and not torch.cuda.is_available():
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True


def _gpu_ready() -> bool:
    if torch is None or not torch.cuda.is_available():
        return False
    import idempotent_moe

    return idempotent_moe.cuda_available()


def pytest_collection_modifyitems(config, items):
    if _gpu_ready():
        return
    skip = pytest.mark.skip(reason="needs torch.cuda and a CUDA build of idempotent_moe")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: reproducible, different per test."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
