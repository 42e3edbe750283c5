"""The "idempotent" experts implementation is registered with transformers as
soon as both packages are imported, in either order, and `import
idempotent_moe` imports neither torch nor transformers.

If transformers' experts interface (`transformers.integrations.moe`) is
already imported, it is registered at once; otherwise a one-shot import hook
registers it right after that module runs. Registering imports
`idempotent_moe.integrations`, which needs torch; transformers has imported
torch by then.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings

EXPERTS_MODULE = "transformers.integrations.moe"


def _register() -> None:
    try:
        from . import integrations

        integrations.register()
    except ImportError as e:  # an older transformers, or no native part: say so, do not fail its import
        warnings.warn(f"idempotent_moe: the 'idempotent' experts implementation was not registered: {e}",
                      stacklevel=3)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of transformers.integrations.moe, then registers."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register()


class _AfterExpertsImport(importlib.abc.MetaPathFinder):
    """A meta-path finder that answers for one module only, once: it finds the
    module's real spec with the other finders and wraps its loader."""

    def __init__(self):
        self._lock = threading.Lock()

    def find_spec(self, fullname, path, target=None):
        if fullname != EXPERTS_MODULE:
            return None
        with self._lock:
            if self not in sys.meta_path:
                return None
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def register_when_transformers_loads() -> None:
    """Registers now if transformers' experts interface is loaded, else on its
    import (a finder that costs nothing until then, and nothing if
    transformers is never imported)."""
    if sys.modules.get(EXPERTS_MODULE) is not None:
        _register()
    elif not any(isinstance(f, _AfterExpertsImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterExpertsImport())
