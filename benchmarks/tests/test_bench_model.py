"""`python -m imoe_bench model` (M1, M2, H1): the quick configuration end
to end on the CPU (JSON and plot written, every row present, tokens judged
against grouped_mm's), rows that fail recorded without stopping the run, a
disagreement failing it, the near-tie rule, and the README headline rendered
from a synthetic model JSON beside the committed main-job JSON."""

import copy
import json
import os
import re
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from imoe_bench import model_agreement, model_m1, model_report, model_timing, train_report  # noqa: E402
from imoe_bench.cli import main  # noqa: E402
from imoe_bench.hostcost import TINY_SHAPE  # noqa: E402
from imoe_bench.model_families import IMPLS, MOE_FAMILIES  # noqa: E402
from imoe_bench.model_timing import round_order  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN_CUDA = os.path.join(ROOT, "benchmarks", "results", "main-cuda.json")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_quick_run_writes_every_row(device, tmp_path, capsys):
    assert main(["model", "--quick", "--device", device, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / f"model-{device}-quick.json").read_text())
    assert (tmp_path / f"model-{device}-quick.png").stat().st_size > 1000
    m = data["machine"]
    assert m["device"] == device and m["torch"] and m["transformers"] and m["date"]
    if device == "cuda":
        assert m["gpu"] and "driver" in m
    assert set(data["families"]) == set(MOE_FAMILIES)
    opts = data["options"]
    assert opts["rounds"] >= 3 and opts["impls"] == list(IMPLS) and opts["caches"] == ["dynamic", "static"]

    prefill = data["m1"]["prefill"]
    assert {(r["family"], r["impl"]) for r in prefill} == {(f, i) for f in MOE_FAMILIES for i in IMPLS}
    for r in prefill:
        assert "error" not in r, r
        assert 0 < r["min_ms"] <= r["median_ms"] and r["tokens"] == opts["prefill_tokens"]
        assert (r["capacity_factor"] is None) == ("dropped" not in r)
        if device == "cuda":
            assert r["peak_allocated_bytes"] > 0 and r["peak_total_bytes"] >= r["peak_allocated_bytes"]

    decode = data["m1"]["decode"]
    expected = {(f, c, b, i) for f in MOE_FAMILIES for c in opts["caches"] for b in opts["batches"]
                for i in IMPLS}
    assert {(r["family"], r["cache"], r["batch"], r["impl"]) for r in decode} == expected
    assert len(decode) == len(expected)
    for r in decode:
        assert "error" not in r, r
        assert r["decode_tokens_per_s"] > 0 and len(r["decode_tokens_per_s_rounds"]) == opts["rounds"]
        assert r["same_tokens_every_round"]
        assert r["step_median_ms"] > 0
        assert r["step_tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["step_median_ms"])
        a = r["agreement"]
        assert a["tokens"] == r["batch"] * opts["new_tokens"]
        assert a["exact"] + a["near_tie"] + a["disagree"] == a["tokens"]
        assert a["sequences"] == r["batch"] and 0 <= a["tokens_equal_baseline"] <= a["tokens"]
        if r["capacity_factor"] is None:
            assert r["agreement_checked"] and r["ok"] is True and a["disagree"] == 0
        else:  # capacity mode drops: reported, never judged
            assert not r["agreement_checked"] and r["ok"] is None
        if r["impl"] == "grouped_mm":
            assert r["speedup_vs_grouped_mm"] == pytest.approx(1.0)
            assert r["step_speedup_vs_grouped_mm"] == pytest.approx(1.0)
            assert a["tokens_equal_baseline"] == a["tokens"]
        if r["compiled"]:  # what torch.compile did in each timed round
            events = r["compile_events_rounds"]
            assert len(events) == opts["rounds"]
            assert all(e["cudagraphs_recorded"] >= 0 and e["frames_compiled"] >= 0 for e in events)
        else:
            assert "compile_events_rounds" not in r

    m2 = data["m2"]["rows"]
    budget = data["m2"]["options"]["budget"]
    assert [r["cache"] for r in m2] == ["DynamicCache", f"InplaceEvictionCache({budget})"]
    for r in m2:
        assert "error" not in r, r
        assert r["total_ms"] > r["first_token_ms"] > 0 and r["decode_tokens_per_s"] > 0
    assert m2[1]["evicted_tokens_layer0"] > 0
    assert m2[1]["cache_buffer_bytes"] > 0

    calls = [r["call"] for r in data["h1"]["rows"]]
    assert calls[0].startswith("torch add_") and data["h1"]["rows"][0]["over_one_torch_op"] == 1.0
    assert any("topk+gather" in c for c in calls)
    tiny = f"[{TINY_SHAPE[0]}, {TINY_SHAPE[1]}, {TINY_SHAPE[2]}]"
    for call in ("compact_ " + tiny, "apply_map_", "compact_kv_cache_inplace", "group_by_expert_"):
        assert any(c.startswith(call) for c in calls), call
    assert all(r["us_per_call"] > 0 for r in data["h1"]["rows"])

    out = capsys.readouterr().out
    assert "M1 decode" in out and "InplaceEvictionCache" in out and "host us / call" in out
    assert "median step ms" in out  # the rows keep it, so the table shows it


def test_the_median_step_leaves_out_one_slow_step(monkeypatch):
    """A call whose first decode step records a CUDA graph: the rate pays for
    it, the median step is the pace of the others."""
    now = [0.0]
    monkeypatch.setattr(model_timing.time, "perf_counter", lambda: now[0])

    def generate(clock):
        now[0] += 0.020
        clock.put(None)  # the prompt
        for dt in (0.030, 0.100, 0.003, 0.003, 0.004, 0.003):  # prefill + first token, then 5 steps
            now[0] += dt
            clock.put(None)
        return "out"

    out, t = model_timing.timed_generate("cpu", generate)
    assert out == "out" and t.decode_steps == 5
    assert t.first_token_s == pytest.approx(0.050)
    assert t.decode_s == pytest.approx(0.113)
    assert t.step_median_s == pytest.approx(0.003)


def _small(tmp_path, *extra) -> list:
    return ["model", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-plot", "--families",
            "mixtral", "--batches", "2", "--caches", "dynamic", "--skip-m2", "--skip-h1", *extra]


def test_a_row_that_fails_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    real = model_m1.use_impl

    def use_impl(model, impl):
        if impl.name == "eager":
            raise RuntimeError("eager cannot run here")
        real(model, impl)

    monkeypatch.setattr(model_m1, "use_impl", use_impl)
    assert main(_small(tmp_path)) == 0
    data = json.loads((tmp_path / "model-cpu-quick.json").read_text())
    for rows in (data["m1"]["prefill"], data["m1"]["decode"]):
        failed = [r for r in rows if r["impl"] == "eager"]
        assert len(failed) == 1
        assert failed[0]["error"] == "RuntimeError: eager cannot run here"
        assert "median_ms" not in failed[0] and "decode_tokens_per_s" not in failed[0]
        assert all("error" not in r for r in rows if r["impl"] != "eager")
    assert "error: RuntimeError: eager cannot run here" in model_report.table(data)


def test_tokens_that_disagree_fail_the_run_after_writing(tmp_path, monkeypatch):
    real = model_agreement.judge
    calls = []

    def judge(logits, generated, dtype, tie_ulps):  # the baseline (judged first) agrees, the rest do not
        verdict = real(logits, generated, dtype, tie_ulps)
        calls.append(1)
        wrong = 0 if len(calls) == 1 else 1
        return {**verdict, "exact": verdict["exact"] - wrong, "disagree": verdict["disagree"] + wrong}

    def equal_to(generated, reference):  # and no sequence identical to grouped_mm's own
        return {**real_equal(generated, reference), "sequences_equal_baseline": 0}

    real_equal = model_agreement.equal_to
    monkeypatch.setattr(model_agreement, "judge", judge)
    monkeypatch.setattr(model_agreement, "equal_to", equal_to)
    with pytest.raises(SystemExit, match="mixtral dynamic batch 2 idempotent"):
        main(_small(tmp_path, "--impls", "grouped_mm,idempotent,idempotent-cap1.25"))
    data = json.loads((tmp_path / "model-cpu-quick.json").read_text())
    rows = {r["impl"]: r for r in data["m1"]["decode"]}
    assert rows["idempotent"]["ok"] is False and rows["idempotent-cap1.25"]["ok"] is None


def test_disagreements_allowed_are_those_of_the_baselines_own_tokens(tmp_path, monkeypatch):
    """Where the baseline's own tokens disagree with the judge (its decode
    kernels are not the judge's), another implementation may disagree as
    often, within two standard deviations of a count; never more."""
    allowed = model_agreement.allowed_disagreements
    assert allowed(None) == 0 and allowed(0) == 0 and allowed(1) == 3 and allowed(45) == 58
    real, real_equal = model_agreement.judge, model_agreement.equal_to
    extra = {"calls": 0, "ours": 58}

    def judge(logits, generated, dtype, tie_ulps):  # per batch the baseline first: 45, then ours
        verdict = real(logits, generated, dtype, tie_ulps)
        extra["calls"] += 1
        return {**verdict, "disagree": verdict["disagree"] + (45 if extra["calls"] % 2 else extra["ours"])}

    monkeypatch.setattr(model_agreement, "judge", judge)
    monkeypatch.setattr(model_agreement, "equal_to", lambda generated, reference: {
        **real_equal(generated, reference), "sequences_equal_baseline": 0})
    main(_small(tmp_path, "--impls", "grouped_mm,idempotent"))
    rows = {r["impl"]: r for r in json.loads((tmp_path / "model-cpu-quick.json").read_text())["m1"]["decode"]}
    a = rows["idempotent"]["agreement"]
    assert rows["idempotent"]["ok"] is True and (a["baseline_disagree"], a["disagree_allowed"]) == (45, 58)
    extra.update(calls=0, ours=59)
    with pytest.raises(SystemExit, match="mixtral dynamic batch 2 idempotent"):
        main(_small(tmp_path, "--impls", "grouped_mm,idempotent"))


def test_near_tie_rule():
    dtype = torch.bfloat16
    eps = torch.finfo(dtype).eps
    best = 8.0
    tol = 4 * eps * best
    logits = torch.full((1, 4, 6), -5.0)
    logits[0, :, 0] = best
    logits[0, 1, 1] = best - tol / 2       # within the tolerance
    logits[0, 2, 2] = best - 2 * tol       # beyond it
    logits[0, 3, 3] = best - tol / 2
    generated = torch.tensor([[0, 1, 2, 3]])
    verdict = model_agreement.judge(logits, generated, dtype, tie_ulps=4)
    assert (verdict["exact"], verdict["near_tie"], verdict["disagree"]) == (1, 2, 1)
    assert verdict["max_gap"] == pytest.approx(2 * tol)
    # the tolerance never falls below that of a logit of magnitude 1
    small = model_agreement.tolerance(torch.tensor([0.01]), dtype, 4)
    assert float(small) == pytest.approx(4 * eps)
    assert model_agreement.equal_to(generated, torch.tensor([[0, 1, 5, 3]])) == {
        "tokens_equal_baseline": 3, "sequences_equal_baseline": 0, "sequences": 1}


def test_compile_events_count_what_torch_compile_did():
    import torch
    from imoe_bench.model_timing import compile_events, compile_events_since

    before = compile_events()
    assert set(before) == {"frames_compiled", "cudagraphs_recorded", "cudagraph_record_s"}
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    fn(torch.ones(3))
    fn(torch.ones(3))  # the cached frame: compiled once
    events = compile_events_since(before)
    assert events["frames_compiled"] == 1 and events["cudagraphs_recorded"] == 0


def test_rounds_alternate_their_order():
    assert [round_order(["a", "b", "c"], r) for r in range(3)] == [
        ["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


@pytest.mark.parametrize("args, message", [
    (["--impls", "grouped_mm,fast"], "fast"),
    (["--impls", "idempotent-cap0"], "idempotent-cap0"),
    (["--families", "llama"], "llama"),
    (["--caches", "paged"], "paged"),
    (["--new-tokens", "1"], "new-tokens"),
    (["--from-json", "x.json"], "--doc or --readme"),
])
def test_bad_options_are_refused(args, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main(["model", "--quick", "--out", str(tmp_path), *args])
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- the README headline


def _decode(family, cache, batch, impl, rate, **extra):
    row = {"family": family, "impl": impl, "cache": cache, "batch": batch, "decode_tokens_per_s": rate,
           "capacity_factor": 1.25 if "cap" in impl else None,
           "agreement": {"exact": 96, "near_tie": 0, "disagree": 0, "tokens": 96},
           "agreement_checked": "cap" not in impl, "ok": True if "cap" not in impl else None}
    row.update(extra)
    return row


def synthetic_model_json() -> dict:
    families = {"mixtral": {"key": "mixtral", "name": "Mixtral-like", "config_class": "MixtralConfig",
                            "config": {}, "dtype": "bfloat16"},
                "qwen3moe": {"key": "qwen3moe", "name": "Qwen3-MoE-like", "config_class": "Qwen3MoeConfig",
                             "config": {}, "dtype": "bfloat16"}}
    prefill = []
    for fam in families:
        for impl, ms, peak in (("eager", 40.0, 600 << 20), ("grouped_mm", 26.0, 546 << 20),
                               ("idempotent", 13.0, 378 << 20), ("idempotent-cap1.25", 12.0, 370 << 20)):
            prefill.append({"family": fam, "impl": impl, "tokens": 4096, "median_ms": ms, "min_ms": ms,
                            "peak_allocated_bytes": peak, "capacity_factor": None})
    decode = []
    for fam in families:
        for cache in ("dynamic", "static"):
            for batch in (1, 8, 32):
                decode.append(_decode(fam, cache, batch, "grouped_mm", 100.0 * batch))
                if fam == "qwen3moe" and cache == "static" and batch == 32:
                    decode.append({"family": fam, "impl": "idempotent", "cache": cache, "batch": batch,
                                   "capacity_factor": None, "error": "BackendCompilerFailed: boom"})
                else:
                    near = {"exact": 90, "near_tie": 6, "disagree": 0, "tokens": 96}
                    decode.append(_decode(fam, cache, batch, "idempotent", 200.0 * batch, agreement=near))
                decode.append(_decode(fam, cache, batch, "idempotent-cap1.25", 250.0 * batch))
    m2 = [{"cache": "DynamicCache", "total_ms": 3000.0, "decode_tokens_per_s": 50.0, "first_token_ms": 1800.0,
           "peak_allocated_bytes": 2000 << 20},
          {"cache": "InplaceEvictionCache(2048)", "total_ms": 1500.0, "decode_tokens_per_s": 80.0,
           "first_token_ms": 700.0, "peak_allocated_bytes": 500 << 20}]
    data = {"machine": {"device": "cuda", "gpu": "NVIDIA H200", "driver": "580.1", "torch": "2.11.0",
                        "transformers": "5.17.0", "commit": "abc1234", "date": "2026-12-01T00:00:00+00:00"},
            "quick": False, "families": families,
            "options": {"prefill_tokens": 4096, "new_tokens": 48, "decode_prompt": 128, "rounds": 3,
                        "batches": [1, 8, 32], "caches": ["dynamic", "static"], "impls": list(IMPLS)},
            "m1": {"prefill": prefill, "decode": decode},
            "m2": {"model": {"name": "Llama-like"}, "rows": m2,
                   "options": {"prompt_tokens": 32768, "prefill_chunk": 2048, "budget": 2048,
                               "evict_every": 32, "new_tokens": 64}},
            "h1": None}
    model_m1.add_ratios(data["m1"]["prefill"], "median_ms", False, ("family",))
    model_m1.add_ratios(data["m1"]["decode"], "decode_tokens_per_s", True, ("family", "cache", "batch"))
    for r in m2:
        r["speedup_vs_dynamic_cache"] = m2[0]["total_ms"] / r["total_ms"]
    return data


def _cells(markdown: str) -> list:
    lines = [ln for ln in markdown.splitlines() if ln.startswith("|") and not ln.startswith("|---")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[1:]]


def test_headline_from_a_synthetic_json(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(MAIN_CUDA, results / "main-cuda.json")
    (results / "model-cuda.json").write_text(json.dumps(synthetic_model_json()))
    readme = tmp_path / "README.md"
    readme.write_text("# t\n<!-- headline:cuda -->\nold\n<!-- /headline:cuda -->\ntail\n")
    # the `model` subcommand and the `readme` subcommand render the same table
    assert main(["model", "--from-json", str(results / "model-cuda.json"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old" not in text and text.endswith("tail\n")
    copy_ = tmp_path / "README2.md"
    copy_.write_text("# t\n<!-- headline:cuda -->\n<!-- /headline:cuda -->\ntail\n")
    model_report.readme_from_json(str(copy_), str(results / "model-cuda.json"))
    assert copy_.read_text() == text

    section = text.split("<!-- headline:cuda -->")[1].split("<!-- /headline:cuda -->")[0]
    header = section.strip().splitlines()[0]
    assert not re.search(r"\| *(vs [^|]*|time / (torch|ref)[^|]*) *\|", header)
    rows = _cells(section)
    by = {(r["workload"], r["measure"]): r for r in rows}
    pre = by[("M1 Mixtral-like", "prefill 4,096 tokens (time, peak alloc)")]
    assert pre["x faster than baseline"] == "2.00x"
    assert pre["baseline's figure"] == "26.0 ms, 546 MiB" and pre["our figure"] == "13.0 ms, 378 MiB"
    dec = by[("M1 Qwen3-MoE-like", "decode tokens/s, batch 8, dynamic cache")]
    figures = (dec["baseline's figure"], dec["our figure"], dec["x faster than baseline"])
    assert figures == ("800", "1600", "2.00x")
    assert dec["check"] == "ok: 90 exact, 6 near-tie, 0 disagree"
    failed = by[("M1 Qwen3-MoE-like", "decode tokens/s, batch 32, static cache")]
    assert failed["our figure"] == "error" and "BackendCompilerFailed" in failed["check"]
    # one row per family x (prefill + caches x batches), dropless only
    assert sum(r["workload"].startswith("M1") for r in rows) == 2 * (1 + 2 * 3)
    m2 = next(r for r in rows if r["workload"] == "M2 Llama-like")
    assert m2["x faster than baseline"] == "2.00x" and "500 MiB" in m2["our figure"]
    main_rows = json.load(open(MAIN_CUDA))["results"]
    for workload in ("W1", "W2", "W3"):
        row = next(r for r in rows if r["workload"] == workload)
        best = min((r for r in main_rows if r["workload"] == workload and r["kind"] != "baseline"),
                   key=lambda r: r["median_ms"])
        assert row["x faster than baseline"] == f"{best['speedup_vs_torch']:.2f}x"
        assert row["check"] == "bit-exact"
    assert "NVIDIA H200; driver 580.1" in section and "commit abc1234" in section


def synthetic_t1_json() -> dict:
    def row(case, name, impl, ms, capacity=None, skewed=False, **extra):
        key = "family" if case == "model" else "shape"
        r = {"case": case, key: name, "implementation": impl, "capacity": capacity, "skewed": skewed,
             "tokens": 4096 if case == "model" else 16384, "step_s": ms / 1e3, "peak_bytes": 9 << 30,
             "moe_saved_bytes": (4 << 30) if impl == "grouped_mm" else (2 << 30)}
        if case == "model":
            r["check"] = {"loss": 5.0} if impl == "grouped_mm" else {
                "loss": 5.0, "loss_vs_grouped_mm": 1e-3, "grads_rel_err_vs_grouped_mm": 2e-3}
        else:
            r["floor_fraction"] = 30.0 / ms
            r["check"] = {n: (5e-3 if impl == "grouped_mm" else 4e-3) for n in train_report.GRAD_NAMES}
        r.update(extra)
        return r
    results = [row("model", "mixtral_like", "grouped_mm", 48.0),
               row("model", "mixtral_like", "idempotent", 40.0),
               row("model", "mixtral_like", "idempotent", 38.0, capacity=1.0),
               row("layer", "mixtral_8x7b", "grouped_mm", 72.0),
               row("layer", "mixtral_8x7b", "idempotent", 60.0),
               row("layer", "mixtral_8x7b", "idempotent", 58.0, skewed=True),
               row("layer", "mixtral_8x7b", "grouped_mm", 75.0, skewed=True)]
    return {"workload": "T1", "quick": False, "dtype": "bfloat16", "rounds": 2, "reps": 3,
            "config": {"batch": 4, "seq": 1024}, "gemm_flops_per_s": 7e14, "results": results,
            "machine": {"device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11.0", "transformers": "5.17.0",
                        "commit": "def5678", "date": "2026-12-07T00:00:00+00:00"}}


def test_headline_takes_t1_rows_from_the_training_json_beside(tmp_path):
    shutil.copy(MAIN_CUDA, tmp_path / "main-cuda.json")
    (tmp_path / "model-cuda.json").write_text(json.dumps(synthetic_model_json()))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- headline:cuda -->\n<!-- /headline:cuda -->\n")
    model_report.readme_from_json(str(readme), str(tmp_path / "model-cuda.json"))
    assert "| T1 " not in readme.read_text()  # no training JSON: no T1 rows
    (tmp_path / "t1-cuda.json").write_text(json.dumps(synthetic_t1_json()))
    model_report.readme_from_json(str(readme), str(tmp_path / "model-cuda.json"))
    rows = {r["workload"]: r for r in _cells(readme.read_text()) if r["workload"].startswith("T1")}
    assert set(rows) == {"T1 Mixtral-like", "T1 Mixtral-8x7B layer"}  # dropless, balanced only
    model, layer = rows["T1 Mixtral-like"], rows["T1 Mixtral-8x7B layer"]
    assert model["measure"] == "training step, 4 x 1,024 tokens (time, peak alloc)"
    assert (model["baseline's figure"], model["our figure"]) == ("48.0 ms, 9,216 MiB", "40.0 ms, 9,216 MiB")
    assert model["x faster than baseline"] == "1.20x" and "grads 2.0e-03 rel" in model["check"]
    assert layer["our figure"] == "60.0 ms, 50%, 2,048 MiB" and layer["x faster than baseline"] == "1.20x"
    assert layer["check"] == "vs fp32: max rel 4.0e-03 (grouped_mm 5.0e-03)"
    assert "T1: NVIDIA H200; torch 2.11.0; transformers 5.17.0; commit def5678" in readme.read_text()


def test_headline_needs_the_main_json(tmp_path):
    path = tmp_path / "model-cuda.json"
    path.write_text(json.dumps(synthetic_model_json()))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- headline:cuda -->\n<!-- /headline:cuda -->\n")
    with pytest.raises(SystemExit, match="main-cuda.json"):
        model_report.readme_from_json(str(readme), str(path))
    assert readme.read_text() == "<!-- headline:cuda -->\n<!-- /headline:cuda -->\n"


def test_doc_table_from_a_synthetic_json(tmp_path):
    data = synthetic_model_json()
    data["h1"] = {"calls": 2000, "rounds": 3, "rows": [
        {"call": "torch add_", "kind": "torch", "us_per_call": 9.0, "us_per_call_min": 8.5,
         "over_one_torch_op": 1.0},
        {"call": "compact_ W1", "kind": "ours", "us_per_call": 27.0, "us_per_call_min": 26.0,
         "over_one_torch_op": 3.0}]}
    path = tmp_path / "model-cuda.json"
    path.write_text(json.dumps(data))
    doc = tmp_path / "results.md"
    doc.write_text("<!-- model:cuda -->\n<!-- /model:cuda -->\n")
    assert main(["model", "--from-json", str(path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    tables = [t for t in re.split(r"\n\n", text) if t.startswith("|")]
    assert len(tables) == 4  # prefill, decode, M2, H1
    decode = _cells(tables[1])
    assert len(decode) == len(data["m1"]["decode"])
    cap = next(r for r in decode if r["implementation"] == "idempotent-cap1.25")
    assert cap["tokens vs grouped_mm"].startswith("capacity (not judged)")
    assert _cells(tables[3])[1]["cost in torch ops"] == "3.0"


def test_plot_of_a_synthetic_json(tmp_path):
    data = copy.deepcopy(synthetic_model_json())
    path = model_report.plot(data, str(tmp_path / "model.png"))
    assert os.path.getsize(path) > 1000


def test_impl_names_take_the_options_of_ours():
    from imoe_bench.model_families import parse_impl

    impl = parse_impl("idempotent-cap1.25+router+gemm")
    assert (impl.experts_implementation, impl.capacity_factor, impl.small_m_gemm, impl.fused_router) == \
        ("idempotent", 1.25, True, True)
    assert not parse_impl("idempotent").small_m_gemm and parse_impl("idempotent+gemm").small_m_gemm
    assert not parse_impl("idempotent+gemm").experts_gemm and parse_impl("idempotent+xg").experts_gemm
    for bad in ("grouped_mm+gemm", "idempotent+gemm+gemm", "grouped_mm+xg", "idempotent+fast",
                "idempotent-cap0+gemm"):
        with pytest.raises(ValueError, match="unknown experts implementation"):
            parse_impl(bad)


def _decode_profile():
    import importlib.util

    path = os.path.join(ROOT, "benchmarks", "scripts", "decode_profile.py")
    spec = importlib.util.spec_from_file_location("decode_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_profile_unions_kernel_intervals_and_takes_one_step():
    dp = _decode_profile()
    assert dp.busy_us([(5, 7), (0, 2), (1, 3), (10, 11), (6, 6.5)]) == 3 + 2 + 1
    assert dp.busy_us([]) == 0
    # gaps: 2 (short), 30 (long), none (inside [50, 60)), 2 (short, from the end of [50, 60))
    assert dp.gaps_us([(0, 10), (12, 20), (50, 60), (55, 58), (62, 63)]) == (2 + 2, 30)
    assert dp.gaps_us([]) == (0.0, 0.0) and dp.gaps_us([(0, 5), (1, 2)]) == (0.0, 0.0)
    long = {"wall": 1000.0, "busy": 700.0, "short_gaps": 90.0, "long_gaps": 180.0, "kernels": 40,
            "graphs": 4, "cuda": True, "by_name": {"a": (30, 600.0), "b": (10, 100.0)}}
    one = {"wall": 100.0, "busy": 70.0, "short_gaps": 9.0, "long_gaps": 18.0, "kernels": 4, "graphs": 1,
           "cuda": True, "by_name": {"a": (3, 60.0)}}
    row = dp.step_profile(long, one, 9, top=1)
    assert (row["wall_us_per_step"], row["device_busy_us_per_step"], row["device_idle_us_per_step"]) == \
        (100.0, 70.0, 30.0)
    assert (row["device_short_gaps_us_per_step"], row["device_long_gaps_us_per_step"]) == (9.0, 18.0)
    assert row["kernels_per_step"] == 4.0 and row["graph_launches_per_step"] == round(3 / 9, 2)
    assert row["top_kernels"] == [{"name": "a", "launches_per_step": 3.0, "us_per_step": 60.0}]
    assert row["top_host"] == []
    long["host_by_name"] = {"guards": (18, 450.0), "aten::add": (27, 90.0)}
    one["host_by_name"] = {"guards": (2, 45.0), "aten::add": (3, 18.0)}
    row = dp.step_profile(long, one, 9, top=2)
    assert row["top_host"] == [
        {"name": "guards", "calls_per_step": round(16 / 9, 2), "self_us_per_step": 45.0},
        {"name": "aten::add", "calls_per_step": round(24 / 9, 2), "self_us_per_step": 8.0}]


def _run_benchmark_script(name: str, *args: str):
    """benchmarks/scripts/<name> in its own process, against the idempotent_moe the
    tests import (an installed wheel in CI)."""
    import subprocess
    import sys

    from labenv import package_env

    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scripts", name), *args],
                          env=package_env(), capture_output=True, text=True, timeout=600)


def test_decode_profile_profiles_the_prefill_as_one_step(tmp_path):
    """--prefill: one profiled forward of M1's prefill per implementation
    (the quick model on the CPU: host ops, no kernels), and --cache, which
    is the decode's, refused with it."""
    out = tmp_path / "prefill.json"
    proc = _run_benchmark_script("decode_profile.py", "--device", "cpu", "--family", "mixtral",
                                 "--prefill", "32", "--impls", "grouped_mm,idempotent", "--top", "3",
                                 "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert (data["cache"], data["prefill_tokens"], data["batch"], data["new_tokens"]) == ("prefill", 32, 1, 0)
    assert set(data["impls"]) == {"grouped_mm", "idempotent"}
    for row in data["impls"].values():
        assert row["wall_us_per_step"] > 0 and row["device_busy_us_per_step"] is None
        assert len(row["top_host"]) == 3 and all(op["calls_per_step"] >= 1 for op in row["top_host"])
    refused = _run_benchmark_script("decode_profile.py", "--device", "cpu", "--prefill", "32", "--cache",
                                    "static")
    assert refused.returncode == 2 and "--cache is the decode's" in refused.stderr


def test_guard_check_times_the_guards_a_compiled_step_passes(tmp_path):
    """benchmarks/scripts/guard_check.py on the CPU (two quick layers, its own
    process: it routes the CPU through the fused routers): every check of
    every round passed (else it stops), and the counts come from the guards
    torch printed."""
    out = tmp_path / "guards.json"
    proc = _run_benchmark_script("guard_check.py", "--device", "cpu", "--layers", "2", "--rounds", "2",
                                 "--calls", "20", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["layers"] == 2 and set(data["impls"]) == {"grouped_mm", "idempotent+router"}
    for row in data["impls"].values():
        assert len(row["check_us_rounds"]) == 2 and row["check_us"] > 0
        assert 0 < row["identity_guards"] < row["guard_lines"]
    assert data["impls"]["idempotent+router"]["fused_routers_traced"]
    assert not data["impls"]["grouped_mm"]["fused_routers_traced"]


def test_prefill_rows_of_a_later_run_name_their_commit():
    """m1.prefill_machine (prefill rows measured after the rest) shows in the
    tables' footer and in the README headline's, beside the run's own commit."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "benchmarks", "results", "model-cuda.json")) as f:
        data = json.load(f)
    with open(os.path.join(root, "benchmarks", "results", "main-cuda.json")) as f:
        main_job = json.load(f)
    data["m1"].pop("prefill_machine", None)
    assert "prefill rows" not in model_report.table(data)
    data["m1"]["prefill_machine"] = dict(data["machine"], commit="abc1234", date="2030-01-01")
    note = "prefill rows: commit abc1234, 2030-01-01"
    assert note in model_report.table(data)
    assert note in model_report.headline(data, main_job)
    assert "dropless, small-M GEMM, fused router" in model_report.headline(data, main_job)
