"""The lab's tests keep the library tests' settings: the `gpu` marker's skip
without a usable GPU, transformers' deprecations as errors and poisoned
uninitialised memory on the CPU (tests/conftest.py's hooks, loaded here too so
that benchmarks/tests also runs on its own): this module takes every name
of tests/conftest.py, its hooks and its `rng` fixture."""

import importlib.util
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("imoe_library_conftest",
                                               os.path.join(_ROOT, "tests", "conftest.py"))
_library = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_library)

globals().update({name: value for name, value in vars(_library).items() if not name.startswith("__")})
