"""`python -m imoe_bench train` (workload T1) in its CPU quick mode: the JSON,
the plot and the table, every row checked (the layer's output and gradients
against an fp32 reference of the same kept assignments, capacity's dropped
count against its rule), and the fused layer saving fewer bytes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers' experts interface")
pytest.importorskip("matplotlib")

from imoe_bench import cli, train, train_report  # noqa: E402


@pytest.fixture(scope="module")
def layer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("t1")
    assert cli.main(["train", "--quick", "--only", "layer", "--out", str(out)]) == 0
    return out, json.loads((out / "t1-cpu-quick.json").read_text())


def test_quick_layer_run_writes_json_and_plot_and_checks_every_row(layer_run):
    out, report = layer_run
    assert (out / "t1-cpu-quick.png").stat().st_size > 0
    rows = report["results"]
    assert {r["implementation"] for r in rows} == {"grouped_mm", "eager", "idempotent"}
    assert {r["skewed"] for r in rows} == {False, True}
    for r in rows:
        check = r["check"]
        assert max(check[n] for n in train_report.GRAD_NAMES) < 1e-4, r
        if r["capacity"] is not None:
            assert check["dropped_ok"], r
    for shape in ("mixtral_8x7b", "qwen3_30b_a3b"):
        saved = {(r["implementation"], r["capacity"]): r["moe_saved_bytes"] for r in rows
                 if r["shape"] == shape and not r["skewed"]}
        assert 0 < saved[("idempotent", None)] < saved[("grouped_mm", None)]
        assert saved[("idempotent", 1.0)] <= saved[("idempotent", None)]


def test_the_table_renders_from_the_json(layer_run, tmp_path):
    out, report = layer_run
    doc = tmp_path / "doc.md"
    doc.write_text("# T1\n<!-- bench:t1 -->\nold\n<!-- /bench:t1 -->\n")
    assert cli.main(["train", "--doc", str(doc), "--from-json", str(out / "t1-cpu-quick.json")]) == 0
    text = doc.read_text()
    assert "old" not in text and text.count("| layer ") == len(report["results"])
    assert "idempotent capacity 1.0" in text and "dropped" in text


def test_the_peak_cell_shows_what_was_allocated_before_the_steps(layer_run):
    _, report = layer_run
    row = dict(report["results"][0], peak_bytes=3 * 2**30, allocated_before_bytes=2**30)
    assert "| 3,072 (1,024) |" in train_report.table(dict(report, results=[row]))
    older = {k: v for k, v in row.items() if k != "allocated_before_bytes"}  # JSON written before the field
    assert "| 3,072 |" in train_report.table(dict(report, results=[older]))
    assert all(r["allocated_before_bytes"] is None for r in report["results"])  # no allocator on the CPU


def test_capacity_keep_is_the_rule_ties_by_token():
    import torch

    idx = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    w = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.7, 0.3], [0.6, 0.4]])
    # T k / E = 8 / 3, factor 0.5: C = ceil(1.33) = 2 per expert
    keep = train.capacity_keep(idx, w, 3, 0.5)
    # expert 0: weights 0.5 (t0), 0.5 (t1), 0.7 (t2), 0.4 (t3) -> t2, then t0 (tie with t1, lower token)
    # expert 1: 0.5 (t0), 0.5 (t1), 0.6 (t3) -> t3, t0; expert 2: t2 alone
    assert keep.tolist() == [[True, True], [False, False], [True, True], [True, False]]


def test_profile_names_every_saved_tensor_and_the_fused_layer_keeps_no_row_copy(tmp_path):
    from imoe_bench import train_profile

    assert cli.main(["train", "--profile", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "t1-profile-cpu-quick.json").read_text())
    every = report["results"]
    assert {(r["case"], r["shape"], r["implementation"], r["capacity"]) for r in every} >= {
        ("model", f, i, c) for f in train.QUICK["model"] for i, c in train_profile.MODES}
    for r in every:
        k = r["kernels"]
        assert k["top"] and k["total_s"] > 0 and k["wall_s"] > 0, r
        assert abs(sum(e["s"] for e in k["top"]) - k["total_s"]) <= 1e-9 * max(1.0, k["total_s"])
    assert "### model " in train_profile.tables(report)
    rows = [r for r in every if r["case"] == "layer"]
    assert {(r["implementation"], r["capacity"]) for r in rows} == set(train_profile.MODES)
    for r in rows:
        assert r["saved_bytes"] == sum(s["bytes"] for s in r["saved"]) > 0
        names = [s["name"] for s in r["saved"]]
        if r["implementation"] == "idempotent":
            # what the layer may keep: the hidden states, the gate/up output, the routing, the int dispatch
            assert "[T k, H] assignment rows" not in names and "[T k, I] intermediate" not in names, r
            assert "[T k, 2I] gate/up output" in names, r
        else:
            assert "[T k, H] assignment rows" in names, r
    for shape in ("mixtral_8x7b", "qwen3_30b_a3b"):
        saved = {(r["implementation"], r["capacity"]): r["saved_bytes"] for r in rows
                 if r["shape"] == shape and not r["skewed"]}
        assert saved[("idempotent", None)] <= 0.5 * saved[("grouped_mm", None)]


def test_profile_refuses_the_flags_it_does_not_take(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--profile", "--quick", "--rounds", "2"])
    assert "--profile" in str(e.value)


def test_profile_takes_one_half(tmp_path):
    assert cli.main(["train", "--profile", "--quick", "--only", "model", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "t1-profile-cpu-quick.json").read_text())["results"]
    assert rows and {r["case"] for r in rows} == {"model"}


def _event(action, addr, size, *frames):
    return dict(action=action, addr=addr, size=size,
                frames=[dict(filename=f, line=n, name="fn") for f, n in frames])


def test_memory_peak_replays_the_trace_and_names_the_live_blocks_by_site():
    from imoe_bench import train_memory as tm

    lib = ("/x/site-packages/idempotent_moe/_moe_autograd.py", 7)
    torch_frame = ("/x/site-packages/torch/autograd/graph.py", 3)
    events = [
        _event("free_completed", 99, 1000),                  # allocated before the trace: not counted
        _event("alloc", 1, 100, torch_frame, lib),
        _event("alloc", 2, 50, lib),
        _event("free_requested", 1, 100),
        _event("free_completed", 1, 100),                    # one free per block
        _event("alloc", 3, 120, ("/x/site-packages/transformers/m.py", 9)),
        _event("alloc", 4, 10, torch_frame),                 # the peak: 50 + 120 + 10
        _event("free_completed", 3, 120),
        _event("alloc", 5, 60, lib),
    ]
    peak, alive = tm.peak_of(events)
    assert peak == 180
    assert sorted(size for size, _ in alive) == [10, 50, 120]
    sites = tm.by_site(alive)
    assert [(s["site"], s["bytes"], s["blocks"]) for s in sites] == [
        ("transformers/m.py:9 fn", 120, 1), ("idempotent_moe/_moe_autograd.py:7 fn", 50, 1),
        ("torch/autograd/graph.py:3 fn", 10, 1)]
    assert sites[0]["inner"] == "transformers/m.py:9 fn"
    many = [(1, [dict(filename=f"/a/f{i}.py", line=i, name="g")]) for i in range(tm.TOP + 3)]
    rows = tm.by_site(many)
    assert len(rows) == tm.TOP + 1 and rows[-1]["site"] == "3 more sites" and rows[-1]["blocks"] == 3


def test_memory_held_blocks_sum_the_blocks_in_use_by_site():
    from imoe_bench import train_memory as tm

    frames = [dict(filename="/x/site-packages/idempotent_moe/moe.py", line=4, name="fn")]
    snapshot = {"segments": [
        {"blocks": [dict(size=64, state="active_allocated", frames=frames),
                    dict(size=32, state="inactive", frames=frames),
                    dict(size=16, state="active_awaiting_free", frames=frames)]},
        {"blocks": [dict(size=8, state="active_allocated", frames=frames),
                    dict(size=128, state="active_allocated")]}]}  # allocated before the recording
    rows = tm.held_blocks(snapshot)
    assert [(r["site"], r["bytes"], r["blocks"]) for r in rows] == [
        ("(before the recording)", 128, 1), ("idempotent_moe/moe.py:4 fn", 72, 2)]


def test_memory_quick_run_reports_each_models_and_layers_peak(tmp_path):
    from imoe_bench import train_memory

    assert cli.main(["train", "--memory", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "t1-memory-cpu-quick.json").read_text())
    rows = report["results"]
    assert {(r["case"], r["family"], r["implementation"], r["capacity"]) for r in rows} == {
        (case, f, i, c) for case in ("model", "layer") for f in train.QUICK[case]
        for i, c in train_memory.MODES}
    assert all(r["peak_bytes"] > 0 and r["sites"] == [] for r in rows)
    assert "### layer " in train_memory.tables(report)
    assert cli.main(["train", "--memory", "--quick", "--only", "layer", "--out", str(tmp_path)]) == 0
    layer = json.loads((tmp_path / "t1-memory-cpu-quick.json").read_text())["results"]
    assert {r["case"] for r in layer} == {"layer"}
    with pytest.raises(SystemExit, match="--memory"):
        cli.main(["train", "--memory", "--quick", "--rounds", "2"])
