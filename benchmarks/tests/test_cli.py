"""The command line's front door: every bad flag or path is one line on
stderr and a non-zero exit before any work starts (each in its own process,
as a user meets it: no traceback, nothing written), a GPU-sized workload on
the CPU asks for --quick or an explicit size, and --version answers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from labenv import package_env

pytest.importorskip("torch")


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(package_env(), CUDA_VISIBLE_DEVICES="")  # the CPU here, as in CI
    return subprocess.run([sys.executable, "-m", "imoe_bench", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "not-json.json").write_text("{ this is not json")
    (root / "a-file").write_text("x")
    (root / "doc.md").write_text("# doc\n")
    readonly = root / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    return root


BAD = {
    "from-json missing": ["w4", "--doc", "{doc}", "--from-json", "{root}/missing.json"],
    "from-json not JSON": ["kv", "--doc", "{doc}", "--from-json", "{root}/not-json.json"],
    "model from-json not JSON": ["model", "--doc", "{doc}", "--from-json", "{root}/not-json.json"],
    "permute from-json missing": ["permute", "--doc", "{doc}", "--from-json", "{root}/missing.json"],
    "readme JSON missing": ["readme", "{root}/missing.json", "--readme", "{doc}"],
    "readme JSON not JSON": ["readme", "{root}/not-json.json", "--readme", "{doc}"],
    "readme file missing": ["readme", "{root}/not-json.json", "--readme", "{root}/missing.md"],
    "bench --readme missing": ["bench", "--quick", "--readme", "{root}/missing.md"],
    "out is a file": ["bench", "--quick", "--out", "{root}/a-file"],
    "out below a file": ["sweep", "--quick", "--out", "{root}/a-file/sub"],
    "out unwritable": ["kv", "--quick", "--out", "{root}/readonly/sub"],
    "runs -1": ["bench", "--runs", "-1"],
    "runs not a number": ["sweep", "--runs", "many"],
    "threads -1": ["bench", "--threads", "-1"],
    "kv threads -1": ["kv", "--threads", "-1"],
    "permute runs -1": ["permute", "--runs", "-1"],
    "w4 tokens 0": ["w4", "--quick", "--tokens", "0"],
    "w4 tokens -16": ["w4", "--quick", "--tokens", "16,-16"],
    "w4 tokens not ints": ["w4", "--quick", "--tokens", "16,x"],
    "capacity factors nan": ["w4", "--quick", "--capacity-factors", "nan"],
    "capacity factors inf": ["w4", "--quick", "--capacity-factors", "1.0,inf"],
    "capacity factors 0": ["w4", "--quick", "--capacity-factors", "0"],
    "model rounds 0": ["model", "--quick", "--rounds", "0"],
    "model batches 0": ["model", "--quick", "--batches", "1,0"],
    "model tie-ulps nan": ["model", "--quick", "--tie-ulps", "nan"],
    "model h1-calls -1": ["model", "--quick", "--h1-calls", "-1"],
    "unknown workload": ["bench", "--quick", "--workloads", "W9"],
    "unknown dtype": ["kv", "--quick", "--dtypes", "float8"],
    "unknown family": ["model", "--quick", "--families", "gpt5"],
    "unknown device": ["bench", "--device", "tpu"],
    "unknown command": ["benchmark"],
    "no command": [],
    "model on the CPU without --quick": ["model", "--device", "cpu"],
    "w4 on the CPU without --quick": ["w4", "--device", "cpu"],
    "train on the CPU without --quick": ["train", "--device", "cpu"],
    "train rounds -1": ["train", "--quick", "--rounds", "-1"],
    "train unknown half": ["train", "--quick", "--only", "router"],
    "train from-json missing": ["train", "--doc", "{doc}", "--from-json", "{root}/missing.json"],
}


ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0  # root may write into a 0o500 folder


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skipif(
    n == "out unwritable" and ROOT_USER, reason="root writes anywhere")) for n in BAD])
def test_bad_invocation_is_one_line_and_a_nonzero_exit(name, paths):
    args = [a.format(root=paths, doc=paths / "doc.md") for a in BAD[name]]
    before = sorted(os.listdir(paths))
    proc = _run(*args, cwd=paths)
    assert proc.returncode != 0, (name, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, (name, proc.stderr)
    assert lines[0].strip(), lines
    assert proc.stdout == "", proc.stdout  # no work started, nothing printed
    assert sorted(os.listdir(paths)) == before  # nothing written (no imoe-results/ either)
    assert (paths / "doc.md").read_text() == "# doc\n"


def test_a_gpu_sized_run_on_the_cpu_asks_for_quick(paths):
    proc = _run("model", "--device", "cpu", cwd=paths)
    assert proc.returncode != 0 and "--quick" in proc.stderr and "GPU" in proc.stderr
    proc = _run("w4", "--device", "cpu", cwd=paths)
    assert proc.returncode != 0 and "--quick" in proc.stderr and "--tokens" in proc.stderr


def test_version():
    import idempotent_moe

    proc = _run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"imoe_bench 0.1.0 (idempotent_moe {idempotent_moe.__version__})"


def test_a_good_invocation_still_runs(tmp_path):
    """The checks refuse only what is wrong: a table regenerated from good
    JSON into a file that has its section passes them and writes the table
    (docs/results.md's CPU table, already its JSON: the file is unchanged)."""
    import shutil

    from labenv import ROOT

    doc = tmp_path / "results.md"
    shutil.copy(os.path.join(ROOT, "docs", "results.md"), doc)
    doc.write_text(doc.read_text().replace("| W1 | float16 | torch topk+gather |", "| stale |", 1))
    proc = _run("readme", os.path.join(ROOT, "benchmarks", "results", "main-cpu.json"), "--readme", str(doc))
    assert proc.returncode == 0, proc.stderr
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        assert doc.read_text() == f.read()


def test_a_module_command_is_one_line(monkeypatch):
    """MODULE_COMMANDS["NAME"] = (module, help) makes `python -m imoe_bench
    NAME ARGS...` call that module's main(ARGS) and return its status, and
    lists NAME in the help."""
    import types

    from imoe_bench import cli

    seen = []
    module = types.ModuleType("imoe_bench.example_workload")
    module.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "imoe_bench.example_workload", module)
    monkeypatch.setitem(cli.MODULE_COMMANDS, "example", ("example_workload", "an example workload"))
    assert cli.main(["example", "--quick", "--runs", "2"]) == 3
    assert seen == [["--quick", "--runs", "2"]]
    assert "example" in cli._parser().format_help()
