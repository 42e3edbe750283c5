"""The tables in README.md and docs/ are the committed result JSON files,
rendered by the same code that writes them after a benchmark run: a table
edited by hand, or left behind when its JSON was refreshed, fails here."""

import glob
import importlib.util
import json
import os
import re
import shutil

import pytest
from idempotent_moe.bench import kv, permute, report, w4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# a generated section: <!-- key --> ... <!-- /key -->
SECTION = re.compile(r"<!-- ([\w:-]+) -->\n(.*?)<!-- /\1 -->", re.S)


def _ep_docs(path: str, json_path: str) -> None:
    """benchmarks/ep_bench.py's table of docs/distributed.md."""
    spec = importlib.util.spec_from_file_location("ep_bench", os.path.join(ROOT, "benchmarks", "ep_bench.py"))
    ep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep)
    with open(json_path) as f:
        ep.replace_docs(path, json.load(f))


# (document, result JSON, the renderer that rewrites the document's section)
TABLES = [
    ("README.md", "main-cuda.json", report.readme_from_json),
    ("docs/results.md", "main-cpu.json", report.readme_from_json),
    ("docs/results.md", "main-cuda.json", report.readme_from_json),
    ("docs/results.md", "permute-cpu.json", permute.doc_from_json),
    ("docs/results.md", "permute-cuda.json", permute.doc_from_json),
    ("docs/kv.md", "kv-cpu.json", kv.doc_from_json),
    ("docs/kv.md", "kv-cuda.json", kv.doc_from_json),
    ("docs/moe.md", "w4-cuda.json", w4.doc_from_json),
    ("docs/distributed.md", "ep-cuda.json", _ep_docs),
]


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
        f"benchmarks/results/{result} (`python -m idempotent_moe readme JSON --readme {doc}` for the "
        f"main job, `kv`, `permute` or `w4 --from-json JSON --doc {doc}`, `benchmarks/ep_bench.py` for EP)")


def _documents() -> list:
    pages = glob.glob(os.path.join(ROOT, "docs", "*.md"))
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in pages)


@pytest.mark.parametrize("doc", _documents())
def test_every_table_has_its_json(doc, tmp_path):
    """Every generated section of a document is one that TABLES renders, so
    none of them escapes the check above: with every section emptied, the
    renderers listed for the document fill all of them again."""
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    keys = {key for key, _ in SECTION.findall(text)}
    copy = tmp_path / os.path.basename(doc)
    copy.write_text(SECTION.sub(lambda m: f"<!-- {m[1]} -->\n<!-- /{m[1]} -->", text))
    for d, result, render in TABLES:
        if d == doc:
            render(str(copy), os.path.join(RESULTS, result))
    filled = {key for key, body in SECTION.findall(copy.read_text()) if body.strip()}
    assert filled == keys, (f"{doc}: generated sections {sorted(keys - filled)} have no entry in "
                            "TABLES (document, result JSON, renderer)")
