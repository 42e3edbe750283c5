"""Paths and environments shared by the lab's tests."""

from __future__ import annotations

import os
import sys

import idempotent_moe
import imoe_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "benchmarks", "scripts")
# The Q1 package (benchmarks/q1/) runs from a checkout and is never installed: the tests import it
# from its folder, after whatever PYTHONPATH gives.
BENCHMARKS = os.path.join(ROOT, "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)


def package_env() -> dict:
    """os.environ with the roots of the idempotent_moe and imoe_bench these
    tests import first on PYTHONPATH (installed in CI, python/ and benchmarks/
    in a checkout): a subprocess started with it imports the same packages."""
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__)))
             for m in (idempotent_moe, imoe_bench)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(roots + [os.environ.get("PYTHONPATH", "")]))
