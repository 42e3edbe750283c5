"""Run transformers' own Mixtral and Qwen3-MoE model tests with the experts
implementation forced to "idempotent", and with transformers' default, and
report pass/fail per test for each.

    python tools/transformers_moe_tests.py --transformers-src DIR [--modes default,dropless,capacity]
        [--json OUT.json] [-k EXPR] [-- EXTRA PYTEST ARGS]

DIR is a transformers source tree (a checkout at the tag of the installed
version, or a tree with at least its conftest.py, pyproject.toml and tests/);
tests/models/mixtral/test_modeling_mixtral.py and
tests/models/qwen3_moe/test_modeling_qwen3_moe.py run from it, against the
installed transformers and idempotent_moe. Modes, one pytest process each:

- default: transformers as it is (its default experts implementation).
- dropless: every call that would reach transformers' `grouped_mm` experts
  function (the default; also an explicit `set_experts_implementation
  ("grouped_mm")`) runs the "idempotent" implementation, dropless.
- capacity: the same in capacity mode, with capacity factor E / k, so that
  C = T: the selection and in-place compaction run, and nothing is dropped.

How the implementation is forced, and why this way: the same file is loaded
into each pytest process as a plugin (`-p transformers_moe_tests`). It wraps
`ExpertsInterface.get_interface`, the one place where every experts module
decorated with `@use_experts_implementation` resolves
`config._experts_implementation` to a function, on every forward (eager and
traced alike, so compiled and generation tests are covered). When that
resolves to transformers' own `grouped_mm_experts_forward`, ours is returned
instead. Nothing else changes: configs still say "grouped_mm" (tests that
inspect or save them see transformers' values), "eager" and "batched_mm"
still give transformers' implementations (the tests that compare
implementations keep their reference), and a test that patches the mapping
with its own function (a Mock) gets that function. Patching config defaults
instead would change what configs report and save; registering under a new
name would leave the default untouched. The eager calls of ours are counted
per test, so the report shows which tests really ran it (calls made inside
compiled graphs are not counted).

Exit status: 0 when every test that passes with the default also passes in
each forced mode, 1 otherwise, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL_TESTS = (
    "tests/models/mixtral/test_modeling_mixtral.py",
    "tests/models/qwen3_moe/test_modeling_qwen3_moe.py",
)
MODES = ("default", "dropless", "capacity")
MODE_ENV = "IMOE_HF_TESTS_MODE"
REPORT_ENV = "IMOE_HF_TESTS_REPORT"
PLUGIN = Path(__file__).stem


# ---------------------------------------------------------------------------
# The pytest plugin (runs inside each pytest process).

_results: dict = {}
_calls = {"count": 0}


def _forced_experts_forward(capacity_mode: bool):
    import torch
    from idempotent_moe.integrations import hf_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if not torch.compiler.is_compiling():
            _calls["count"] += 1
        factor = self.num_experts / top_k_index.shape[-1] if capacity_mode else None
        return hf_experts.experts_forward(self, hidden_states, top_k_index, top_k_weights, factor)

    forward.__name__ = f"idempotent_{'capacity' if capacity_mode else 'dropless'}_experts_forward"
    return forward


def _force_idempotent(mode: str) -> None:
    import idempotent_moe.integrations  # noqa: F401  registers "idempotent"
    from transformers.integrations import moe

    grouped = moe.grouped_mm_experts_forward
    forced = _forced_experts_forward(mode == "capacity")
    original = moe.ExpertsInterface.get_interface

    def get_interface(self, experts_implementation, default):
        fn = original(self, experts_implementation, default)
        return forced if fn is grouped else fn

    moe.ExpertsInterface.get_interface = get_interface


class _XdistHookspecs:
    """transformers' conftest registers a plugin with pytest-xdist's hooks;
    without xdist installed pytest would refuse it as unknown hooks."""

    def pytest_configure_node(self, node):
        """xdist: configure a worker node."""

    def pytest_testnodedown(self, node, error):
        """xdist: a worker node went down."""


def pytest_addhooks(pluginmanager):
    if not pluginmanager.has_plugin("xdist") and not pluginmanager.has_plugin("xdist.plugin"):
        try:
            import xdist  # noqa: F401
        except ImportError:
            pluginmanager.add_hookspecs(_XdistHookspecs)


def pytest_configure(config):
    mode = os.environ.get(MODE_ENV, "default")
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {MODES}, got {mode!r}")
    if mode != "default":
        _force_idempotent(mode)


def pytest_runtest_setup(item):
    _calls["count"] = 0


def pytest_runtest_logreport(report):
    """passed / failed / skipped from the call; "error" for a failed setup or
    teardown (a skip in setup is a skip)."""
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "calls": 0, "message": ""})
    if report.when == "call":
        entry["outcome"] = report.outcome
    elif report.outcome == "skipped":
        entry["outcome"] = "skipped"
    elif report.outcome == "failed" and entry["outcome"] != "failed":
        entry["outcome"] = "error"
    if report.outcome != "passed" and not entry["message"]:
        entry["message"] = _short_message(report)
    if report.when == "teardown":
        entry["calls"] = _calls["count"]


def _short_message(report) -> str:
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:300]
    crash = getattr(report.longrepr, "reprcrash", None)
    return (crash.message if crash is not None else str(report.longrepr))[:300]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(_results, indent=1, sort_keys=True))


# ---------------------------------------------------------------------------
# The runner.

def _tree_version(src: Path) -> str | None:
    """The transformers version a source tree belongs to: its setup.py, else
    its src/transformers/__init__.py, else a VERSION file beside tests/."""
    for rel, pattern in (("setup.py", r'version="([^"]+)"'),
                         ("src/transformers/__init__.py", r'__version__ = "([^"]+)"'),
                         ("VERSION", r"(\S+)")):
        path = src / rel
        if path.is_file():
            match = re.search(pattern, path.read_text(encoding="utf-8", errors="replace"))
            if match:
                return match.group(1)
    return None


def run_mode(src: Path, mode: str, tests: list[str], extra: list[str]) -> dict:
    """One pytest process over `tests` in the tree `src`; {nodeid: result}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ)
        env[MODE_ENV] = mode
        env[REPORT_ENV] = str(report)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-q",
               "--rootdir", str(src), *tests, *extra]
        print(f"[{mode}] {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        tail = proc.stdout.strip().splitlines()[-1:] or [""]
        print(f"[{mode}] pytest exit {proc.returncode}: {tail[0]}", flush=True)
        if not report.is_file():
            print(proc.stdout[-6000:], file=sys.stderr)
            raise RuntimeError(f"pytest wrote no report in mode {mode} (exit {proc.returncode})")
        return json.loads(report.read_text())


def compare(results: dict) -> tuple[dict, dict]:
    """Counts per mode, and per forced mode the tests that pass with the
    default but not there."""
    counts, regressions = {}, {}
    for mode, per_test in results.items():
        tally: dict = {}
        for entry in per_test.values():
            tally[entry["outcome"]] = tally.get(entry["outcome"], 0) + 1
        tally["ran idempotent"] = sum(1 for e in per_test.values() if e["calls"])
        counts[mode] = tally
    base = results.get("default")
    if base is not None:
        for mode, per_test in results.items():
            if mode != "default":
                regressions[mode] = sorted(
                    t for t, e in base.items() if e["outcome"] == "passed"
                    and per_test.get(t, {"outcome": "missing"})["outcome"] != "passed")
    return counts, regressions


def print_table(results: dict) -> None:
    modes = list(results)
    names = sorted(set().union(*(r.keys() for r in results.values())))
    width = max(len(n) for n in names) if names else 10
    print(f"\n{'test':<{width}}  " + "  ".join(f"{m:<10}" for m in modes))
    for name in names:
        cells = []
        for mode in modes:
            entry = results[mode].get(name)
            cell = "-" if entry is None else entry["outcome"] + ("*" if entry["calls"] else "")
            cells.append(f"{cell:<10}")
        print(f"{name:<{width}}  " + "  ".join(cells))
    print("(* : the idempotent implementation ran in that test, eagerly at least once)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transformers-src", required=True, type=Path,
                        help="transformers source tree at the installed version's tag")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--tests", nargs="+", default=list(MODEL_TESTS),
                        help="test files (or node ids) relative to the tree")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--json", type=Path, help="write every result and the comparison here")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest as they are")
    args = parser.parse_args(argv)

    src = args.transformers_src.resolve()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--modes takes a subset of {','.join(MODES)}, got {args.modes!r}")
    missing = [t for t in args.tests if not (src / t.split("::")[0]).is_file()]
    if missing:
        parser.error(f"not in {src}: {', '.join(missing)}")

    import transformers

    tree = _tree_version(src)
    print(f"transformers installed {transformers.__version__}, tree {tree or 'unknown'} ({src})")
    if tree is not None and tree != transformers.__version__:
        print(f"warning: the tree is transformers {tree}, the installed version {transformers.__version__}",
              file=sys.stderr)
    extra = (["-k", args.keyword] if args.keyword else []) + args.pytest_args
    results = {mode: run_mode(src, mode, args.tests, extra) for mode in modes}
    counts, regressions = compare(results)
    print_table(results)
    print()
    for mode in modes:
        print(f"{mode:<10} " + ", ".join(f"{k} {v}" for k, v in sorted(counts[mode].items())))
    for mode, failed in regressions.items():
        print(f"{mode}: {len(failed)} test(s) pass with the default and not here" + (":" if failed else ""))
        for name in failed:
            print(f"    {name}: {results[mode].get(name, {}).get('message', 'missing')}")
    if args.json:
        args.json.write_text(json.dumps({
            "transformers": transformers.__version__, "tree": tree, "modes": modes,
            "counts": counts, "regressions": regressions, "results": results}, indent=1))
    return 1 if any(regressions.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
