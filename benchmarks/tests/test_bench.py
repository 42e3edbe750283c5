"""The benchmarks at smoke size: the main job runs, checks every row bit for
bit, and writes JSON, a plot and a README table that reflect what it
measured; every subcommand runs on every workload and dtype its --help lists,
on the CPU and (marked gpu) on CUDA, and writes only under imoe-results/."""

import itertools
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from imoe_bench import report  # noqa: E402
from imoe_bench.cli import DTYPES, WORKLOADS, main  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_bench_quick_writes_json_plot_and_readme(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# t\n<!-- bench:cpu -->\nold\n<!-- /bench:cpu -->\ntail\n")
    assert main(["bench", "--device", "cpu", "--quick", "--runs", "2", "--out", str(tmp_path),
                 "--readme", str(readme)]) == 0
    data = json.loads((tmp_path / "main-cpu-quick.json").read_text())
    assert (tmp_path / "main-cpu-quick.png").stat().st_size > 1000
    rows = data["results"]
    impls = {r["impl"] for r in rows}
    assert {"torch topk+gather", "torch topk+sort+gather", "numpy argpartition+take",
            "idempotent_moe swap", "idempotent_moe move"} <= impls
    assert {(r["workload"], r["dtype"]) for r in rows} == {
        ("W1", "float16"), ("W1", "float32"), ("W2", "float16"), ("W2", "float32")}
    assert all(r["bit_exact"] for r in rows)
    assert all(r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] for r in rows)
    for r in rows:
        if r["impl"].startswith("torch"):
            assert r["speedup_vs_torch"] == pytest.approx(1.0)
        # move mode needs half of swap's traffic, and a floor is never negative
        assert r["floor_ms"] > 0
    text = readme.read_text()
    assert "old" not in text and "idempotent_moe move" in text and text.endswith("tail\n")
    assert "idempotent_moe swap" in capsys.readouterr().out


def test_check_rejects_a_wrong_result():
    import torch
    from imoe_bench import workloads

    p = workloads.Problem(workloads.QUICK["W1"], torch.float16, "cpu")
    base = workloads.torch_baseline(p).run()
    values, idx = base
    assert workloads.check_against(p, base, base)
    broken = [values[0].clone()]
    broken[0][0, 0, 0] += 1
    assert not workloads.check_against(p, (broken, idx), base)
    wrong_idx = idx.clone()
    wrong_idx[0, 0] = (wrong_idx[0, 0] + 1) % p.shape.n
    assert not workloads.check_against(p, (values, wrong_idx), base)


def test_readme_update_needs_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    data = {"machine": {"device": "cpu"}, "results": []}
    with pytest.raises(SystemExit):
        report.update_readme(str(readme), data)


def test_a_table_that_cannot_be_written_stops_the_run_before_it_starts(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="bench:cpu"):
        main(["bench", "--device", "cpu", "--quick", "--runs", "1", "--out", str(out),
              "--readme", str(readme)])
    assert not out.exists()
    with pytest.raises(SystemExit, match="kv:cpu"):
        main(["kv", "--device", "cpu", "--quick", "--runs", "1", "--out", str(out), "--doc", str(readme)])
    assert not out.exists()


def _written(root) -> set:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}


def _results(root, stem: str) -> list:
    """The rows of imoe-results/STEM.json, checking that nothing else was written."""
    written = _written(root)
    assert written == {os.path.join(report.DEFAULT_OUT, stem + ".json")}, written
    return json.loads((root / report.DEFAULT_OUT / (stem + ".json")).read_text())["results"]


@pytest.mark.parametrize("device", DEVICES)
def test_bench_every_listed_workload_and_dtype(device, tmp_path, monkeypatch):
    """`bench --workloads` x `--dtypes` as listed by --help: every pair runs
    and every row matches its baseline bit for bit; on the CPU NumPy's
    baseline reads a dtype it lacks (bfloat16) as the integer of its width and
    says so in the row."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--device", device, "--quick", "--runs", "1", "--no-plot",
                 "--workloads", ",".join(WORKLOADS), "--dtypes", ",".join(DTYPES)]) == 0
    rows = _results(tmp_path, f"main-{device}-quick")
    assert {(r["workload"], r["dtype"]) for r in rows} == set(itertools.product(WORKLOADS, DTYPES))
    assert all(r["bit_exact"] for r in rows)
    for workload, dtype in itertools.product(WORKLOADS, DTYPES):
        impls = [r["impl"] for r in rows if (r["workload"], r["dtype"]) == (workload, dtype)]
        assert impls[0].startswith("torch") and impls[-2:] == ["idempotent_moe swap", "idempotent_moe move"]
        if device == "cpu":
            numpy_row = "numpy argpartition+take" + (" (bfloat16 as int16)" if dtype == "bfloat16" else "")
            assert numpy_row in impls


@pytest.mark.parametrize("device", DEVICES)
def test_kv_every_listed_dtype(device, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["kv", "--device", device, "--quick", "--runs", "1", "--no-plot",
                 "--dtypes", ",".join(DTYPES)]) == 0
    rows = _results(tmp_path, f"kv-{device}-quick")
    assert {r["dtype"] for r in rows} == set(DTYPES)
    assert {r["workload"] for r in rows} == {"W2", "W2 paged"}
    assert all(r["bit_exact"] for r in rows)


@pytest.mark.parametrize("device", DEVICES)
def test_w4_and_permute_quick(device, tmp_path, monkeypatch):
    """The subcommands without workload or dtype options, at their defaults."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    assert main(["w4", "--device", device, "--quick", "--runs", "1", "--no-plot"]) == 0
    assert main(["permute", "--device", device, "--quick", "--runs", "1", "--no-plot"]) == 0
    written = _written(tmp_path)
    assert written == {os.path.join(report.DEFAULT_OUT, f"{stem}-{device}-quick.json")
                       for stem in ("w4", "permute")}, written


def test_unlisted_workloads_and_dtypes_are_refused():
    with pytest.raises(SystemExit, match="W9"):
        main(["bench", "--workloads", "W1,W9"])
    with pytest.raises(SystemExit, match="float64"):
        main(["kv", "--dtypes", "float64"])


def test_sweep_quick_writes_every_axis(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "--device", "cpu", "--quick", "--runs", "1", "--no-plot"]) == 0
    data = {"results": _results(tmp_path, "sweep-cpu-quick")}
    rows = data["results"]
    assert {r["axis"] for r in rows} == {"N", "keep ratio", "row bytes"}
    assert {r["n"] for r in rows if r["axis"] == "N"} == {256, 1024, 4096, 16384, 65536, 131072}
    assert all(r["bit_exact"] and r["time_over_floor"] > 0 for r in rows)
