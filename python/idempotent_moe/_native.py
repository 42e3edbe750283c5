"""Loads the compiled extension lazily, so that `import idempotent_moe` never
fails: the first call that needs the native part raises a clear error instead."""

from __future__ import annotations

import importlib
from types import ModuleType

_module: ModuleType | None = None
_error: BaseException | None = None


def native() -> ModuleType:
    """The extension module `idempotent_moe._C`, imported on first use."""
    global _module, _error
    if _module is not None:
        return _module
    if _error is None:
        try:
            _module = importlib.import_module("idempotent_moe._C")
            return _module
        except ImportError as exc:  # keep the cause for every later call
            _error = exc
    raise ImportError(
        "the native part of idempotent_moe (idempotent_moe._C) is not built or failed to load: "
        f"{_error}. Build it from a clone of the project's repository with `pip install .` (a C "
        "compiler is needed; nvcc adds the CUDA kernels, IMOE_NO_CUDA=1 skips them). The PyPI "
        "package named idempotent-moe is a different project: do not install it for this one."
    ) from _error
