"""benchmarks/q1_kv_quality.py (the q1 package's cli_quality) in its quick
mode (a tiny random Llama, seconds): every setting, the merge into the
committed form and the tables of docs/kv.md; the two command lines as
scripts; and what kvpress's environment imports of the package, which must
not reach idempotent_moe."""

import json
import os
import subprocess
import sys

import labenv  # noqa: F401  (puts benchmarks/ on sys.path: the q1 package)
from labenv import ROOT, package_env
from q1 import cli_quality, cost_report, quality_tables

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def test_q1_kv_quality_quick(tmp_path):
    out = tmp_path / "q1.json"
    assert cli_quality.main(["--quick", "--out", str(out), "--trials", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["check"]["max_abs_nll_diff_vs_shared"] < 1e-4  # the shared prompt is the user's path
    assert set(result["prefill_ppl_ratio"]["snapkv"]) == {"16", "32"}
    assert result["memory"]["peak_kv_bytes_layer"] < result["memory"]["peak_kv_bytes_whole"]
    assert len(result["passkey"]["trials"]) == 2 and "decode_ppl_ratio" in result
    assert len(result["passkey_decode"]["trials"]) == 2 and "auto@16" in result["passkey_decode_table"]
    assert "| library: tova |" in quality_tables.markdown_tables(result)
    merged = tmp_path / "merged.json"  # the committed form: figures, no token ids or losses
    assert cli_quality.main(["--out", str(merged), "--merge", str(out)]) == 0
    compact = json.loads(merged.read_text())
    assert "tokens" not in compact and "prefill" not in compact and "nll" not in compact["check"]
    assert compact["prefill_ppl_ratio"] == json.loads(json.dumps(result["prefill_ppl_ratio"]))
    assert quality_tables.markdown_tables(compact) == quality_tables.markdown_tables(result)
    # a later run's figures replace the merged ones, both passkey settings included
    rerun = json.loads(out.read_text())
    for setting in ("passkey", "passkey_decode"):
        for row in rerun[setting]["trials"]:
            row["auto@16"] = not row["auto@16"]
    for row in rerun["passkey_decode"]["trials"]:
        row.pop("trial")  # as runs before the decode rows carried their index
    (tmp_path / "rerun.json").write_text(json.dumps(rerun))
    assert cli_quality.main(["--out", str(merged), "--update", str(tmp_path / "rerun.json")]) == 0
    updated = json.loads(merged.read_text())
    for setting in ("passkey", "passkey_decode"):
        flipped = sum(not r["auto@16"] for r in result[setting]["trials"])
        assert updated[f"{setting}_table"]["auto@16"] == {"passed": flipped, "trials": 2}


def test_the_scripts_print_the_packages_tables():
    """The two scripts docs/kv.md cites run as commands: their --tables of
    the committed JSON are the package's tables."""
    for script, name, render, end in (
            ("q1_kv_quality.py", "q1-kv-quality-cpu.json", quality_tables.markdown_tables, "\n"),
            ("q1_kv_cost.py", "q1-kv-cost-cpu.json", cost_report.markdown_tables, "")):
        path = os.path.join(RESULTS, name)
        run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--tables",
                              "--out", path], capture_output=True, text=True, env=package_env(), check=True)
        with open(path) as f:
            assert run.stdout == render(json.load(f)) + end, script


def test_kvpress_half_imports_nothing_of_the_library():
    """kvpress's environment has no idempotent_moe: the command lines and
    kvpress's halves import without it (the library's half is imported only
    to run it)."""
    code = ("import sys; sys.modules['idempotent_moe'] = None  # any import of it fails\n"
            "import q1.cli_quality, q1.cli_cost, q1.quality_kvpress, q1.cost_kvpress, q1.cost_memory\n")
    env = dict(package_env())
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "benchmarks"), env["PYTHONPATH"]])
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
