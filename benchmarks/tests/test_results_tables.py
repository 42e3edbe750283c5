"""The tables in README.md and docs/ are the committed result JSON files,
rendered by the same code that writes them after a benchmark run: a table
edited by hand, or left behind when its JSON was refreshed, fails here."""

import glob
import importlib.util
import json
import os
import re
import shutil

import labenv  # noqa: F401  (puts benchmarks/ on sys.path: the q1 package)
import pytest
from imoe_bench import kv, model_report, permute, report, train_report, w4
from q1 import cost_report, quality_tables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# a generated section: <!-- key --> ... <!-- /key -->
SECTION = re.compile(r"<!-- ([\w:-]+) -->\n(.*?)<!-- /\1 -->", re.S)


def _ep_docs(path: str, json_path: str) -> None:
    """benchmarks/scripts/ep_bench.py's table of docs/distributed.md."""
    spec = importlib.util.spec_from_file_location(
        "ep_bench", os.path.join(ROOT, "benchmarks", "scripts", "ep_bench.py"))
    ep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep)
    with open(json_path) as f:
        ep.replace_docs(path, json.load(f))


def _q1_tables(markdown_tables, key: str):
    """The renderer of docs/kv.md's section `key` from a Q1 JSON (the q1
    package's markdown_tables, what `benchmarks/q1_kv_*.py --tables` prints)."""
    def render(path: str, json_path: str) -> None:
        with open(json_path) as f:
            text = markdown_tables(json.load(f))
        report.replace_section(path, key, lambda: text.rstrip("\n"))

    return render


# (document, result JSON, the renderer that rewrites the document's section)
TABLES = [
    ("docs/results.md", "main-cpu.json", model_report.readme_from_json),
    ("docs/results.md", "main-cuda.json", model_report.readme_from_json),
    ("docs/results.md", "permute-cpu.json", permute.doc_from_json),
    ("docs/results.md", "permute-cuda.json", permute.doc_from_json),
    ("docs/kv.md", "kv-cpu.json", kv.doc_from_json),
    ("docs/kv.md", "kv-cuda.json", kv.doc_from_json),
    ("docs/results.md", "w4-cuda.json", w4.doc_from_json),
    ("docs/distributed.md", "ep-cuda.json", _ep_docs),
    ("docs/kv.md", "q1-kv-quality-cpu.json", _q1_tables(quality_tables.markdown_tables, "q1:tables")),
    # the 40 more passkey trials at budget 512
    ("docs/kv.md", "q1-passkey-512-cpu.json", _q1_tables(quality_tables.markdown_tables, "q1:passkey512")),
    ("docs/kv.md", "q1-kv-cost-cpu.json", _q1_tables(cost_report.markdown_tables, "q1:cost")),
    ("docs/moe.md", "t1-cuda.json", train_report.doc_from_json),
]
# The README headline (M1, M2 and W1-W3 beside them; imoe_bench/model_report.py) is
# rendered from the model benchmark's GPU JSON once one is committed; until
# then the README has no headline section, which test_every_table_has_its_json
# holds it to.
if os.path.exists(os.path.join(RESULTS, "model-cuda.json")):
    TABLES.append(("README.md", "model-cuda.json", model_report.readme_from_json))
    TABLES.append(("docs/results.md", "model-cuda.json", model_report.doc_from_json))


@pytest.mark.parametrize("doc, result, render", TABLES, ids=[f"{d}:{r}" for d, r, _ in TABLES])
def test_table_is_its_json(doc, result, render, tmp_path):
    path = os.path.join(ROOT, doc)
    copy = tmp_path / os.path.basename(doc)
    shutil.copy(path, copy)
    render(str(copy), os.path.join(RESULTS, result))
    with open(path) as f:
        committed = f.read()
    assert copy.read_text() == committed, (
        f"{doc}: the table of {result} differs from what its JSON renders; regenerate it from "
        f"benchmarks/results/{result} (`python -m imoe_bench readme JSON --readme {doc}` for the "
        f"main job, `kv`, `permute` or `w4 --from-json JSON --doc {doc}`, "
        "`benchmarks/scripts/ep_bench.py` for EP)")


def _documents() -> list:
    pages = glob.glob(os.path.join(ROOT, "docs", "*.md"))
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in pages)


@pytest.mark.parametrize("doc", _documents())
def test_every_table_has_its_json(doc, tmp_path):
    """Every generated section of a document is one that TABLES renders, so
    none of them escapes the check above: with every section emptied, the
    renderers listed for the document fill all of them again. A section left
    empty in the document (a table whose JSON is not committed yet) is not
    checked."""
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    keys = {key for key, body in SECTION.findall(text) if body.strip()}
    copy = tmp_path / os.path.basename(doc)
    copy.write_text(SECTION.sub(lambda m: f"<!-- {m[1]} -->\n<!-- /{m[1]} -->", text))
    for d, result, render in TABLES:
        if d == doc:
            render(str(copy), os.path.join(RESULTS, result))
    filled = {key for key, body in SECTION.findall(copy.read_text()) if body.strip()}
    assert filled == keys, (f"{doc}: generated sections {sorted(keys - filled)} have no entry in "
                            "TABLES (document, result JSON, renderer)")


# A speed ratio that does not read "x faster than ...": "vs torch" (ambiguous),
# "time / torch" or "time / ref" (a slowdown).
OTHER_RATIOS = re.compile(r"\| *(vs [^|]*|time / (torch|ref)[^|]*) *\|")


@pytest.mark.parametrize("doc", _documents())
def test_one_ratio_convention(doc):
    """Every speed ratio in a generated table says how many times faster than
    its baseline a row is: above 1 means faster."""
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    for key, body in SECTION.findall(text):
        if not body.strip():
            continue
        header = body.strip().splitlines()[0]
        assert not OTHER_RATIOS.search(header), f"{doc}, section {key}: {header}"


def _cells(markdown: str) -> list:
    lines = [ln for ln in markdown.splitlines() if ln.startswith("|") and not ln.startswith("|---")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[1:]]


def _row(impl: str, median_ms: float, kind: str, **extra) -> dict:
    return {"impl": impl, "kind": kind, "median_ms": median_ms, "min_ms": median_ms, **extra}


def test_faster_reads_above_one():
    """A row twice as fast as torch shows 2.00x in every renderer."""
    machine = {"device": "cpu", "cpu": "test", "threads": 1, "torch": "0", "date": "today",
               "copy_bandwidth_GBps": 1.0}
    main_rows = [{**_row(impl, ms, kind, mode="gather"), "workload": "W1", "dtype": "float16",
                  "floor_ms": 0.5, "bit_exact": True}
                 for impl, ms, kind in (("torch topk+gather", 2.0, "baseline"),
                                        ("idempotent_moe move", 1.0, "ours"))]
    report.add_speedups(main_rows)
    cells = _cells(report.table({"machine": machine, "results": main_rows}))
    assert cells[1]["x faster than torch"] == "2.00x"
    permute_rows = [{**_row(impl, ms, kind), "workload": "permute", "bit_exact": True,
                     "transient_bytes": 0, "time_ratio_vs_torch": ms / 2.0}
                    for impl, ms, kind in (("torch index_select", 2.0, "baseline"),
                                           ("idempotent_moe permute_", 1.0, "ours"))]
    cells = _cells(permute.table({"machine": machine, "results": permute_rows}))
    assert cells[1]["x faster than torch"] == "2.00x"



def test_every_cited_result_is_committed():
    """A `benchmarks/results/NAME` named in README.md, benchmarks/README.md or
    docs/*.md is there, unless cited as history (`git show COMMIT:benchmarks/results/NAME`)."""
    missing = []
    for doc in _documents() + ["benchmarks/README.md"]:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        cited = r"(git show [0-9a-f]{7,40}:)?benchmarks/results/([A-Za-z0-9._*-]+\.[a-z]+)"
        for m in re.finditer(cited, text):
            if not m.group(1) and not os.path.exists(os.path.join(RESULTS, m.group(2))):
                missing.append(f"{doc}: {m.group(2)}")
    assert not missing, missing
