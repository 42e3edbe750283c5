"""Both test suites from the repository root (`python -m pytest`: tests/ for
the library, benchmarks/tests/ for the benchmark lab, pyproject's testpaths).
The lab's package imoe_bench is used as installed (CI installs benchmarks/ as
a project); in a checkout where it is not installed, benchmarks/ goes on the
path. The library itself is never put on the path here: the tests import the
idempotent_moe that is installed or that PYTHONPATH names."""

import importlib.util
import os
import sys

LAB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks")

if importlib.util.find_spec("imoe_bench") is None:
    sys.path.insert(0, LAB)
