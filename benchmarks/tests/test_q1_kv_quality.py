"""benchmarks/q1_kv_quality.py in its quick mode (a tiny random Llama,
seconds): every setting, the merge into the committed form and the tables
of docs/kv.md."""

import importlib.util
import json
import os

from labenv import ROOT


def _module():
    spec = importlib.util.spec_from_file_location(
        "q1_kv_quality", os.path.join(ROOT, "benchmarks", "q1_kv_quality.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_q1_kv_quality_quick(tmp_path):
    q1 = _module()
    out = tmp_path / "q1.json"
    assert q1.main(["--quick", "--out", str(out), "--trials", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["check"]["max_abs_nll_diff_vs_shared"] < 1e-4  # the shared prompt is the user's path
    assert set(result["prefill_ppl_ratio"]["snapkv"]) == {"16", "32"}
    assert result["memory"]["peak_kv_bytes_layer"] < result["memory"]["peak_kv_bytes_whole"]
    assert len(result["passkey"]["trials"]) == 2 and "decode_ppl_ratio" in result
    assert len(result["passkey_decode"]["trials"]) == 2 and "auto@16" in result["passkey_decode_table"]
    assert "| library: tova |" in q1.markdown_tables(result)
    merged = tmp_path / "merged.json"  # the committed form: figures, no token ids or losses
    assert q1.main(["--out", str(merged), "--merge", str(out)]) == 0
    compact = json.loads(merged.read_text())
    assert "tokens" not in compact and "prefill" not in compact and "nll" not in compact["check"]
    assert compact["prefill_ppl_ratio"] == json.loads(json.dumps(result["prefill_ppl_ratio"]))
    assert q1.markdown_tables(compact) == q1.markdown_tables(result)
