"""benchmarks/q1_kv_cost.py in its quick mode (a tiny random Llama, seconds):
every policy's eviction timed in both settings, the memory samples, the
merge of a kvpress JSON and the tables of docs/kv.md."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    spec = importlib.util.spec_from_file_location(
        "q1_kv_cost", os.path.join(ROOT, "benchmarks", "q1_kv_cost.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_q1_kv_cost_quick(tmp_path):
    cost = _module()
    out = tmp_path / "cost.json"
    assert cost.main(["--quick", "--out", str(out), "--rounds", "1"]) == 0
    text = out.read_text()
    result = json.loads(text)
    budgets = result["budgets"]
    rows = {(r["setting"], r["policy"], r["budget"]): r for r in result["rows"]}
    assert len(rows) == 2 * (1 + len(cost.LIB_POLICIES) * len(budgets))
    for setting in ("prefill", "decode"):
        assert rows[(setting, "full", None)]["wall_ms"] > 0
        for policy in cost.LIB_POLICIES:
            for b in budgets:
                row = rows[(setting, policy, b)]
                assert "error" not in row, row
                assert row["evict_ms"] > 0 and row["layers"] == 2 and row["rounds"] == 1
                assert abs(row["evict_ms"] - row["score_ms"] - row["compact_ms"]) < 0.01
    assert rows[("decode", "auto", budgets[0])]["step_ms"] > 0
    assert "stats_ms" in rows[("prefill", "observed_attention", budgets[0])]
    mem = {(m["policy"], m["budget"]): m for m in result["memory"]}
    assert mem[("snapkv", budgets[0])]["final_kv_bytes"] < mem[("full", None)]["final_kv_bytes"]
    assert text.count("\n") < 60  # one row per line

    # kvpress's half, merged: its rows beside the library's (here the library's, renamed)
    kv = dict(result, kvpress_version="test", rows=[dict(r, lib="kvpress") for r in result["rows"]],
              memory=[dict(m, lib="kvpress") for m in result["memory"]])
    kv_path = tmp_path / "kv.json"
    kv_path.write_text(json.dumps(kv))
    assert cost.main(["--out", str(out), "--kvpress-json", str(kv_path)]) == 0
    merged = json.loads(out.read_text())
    assert merged["kvpress"]["kvpress_version"] == "test"
    assert len(merged["rows"]) == 2 * len(result["rows"])
    tables = cost.markdown_tables(merged)
    assert "| library: auto |" in tables and "| kvpress: snapkv |" in tables
    assert "| kvpress: full cache |" in tables
