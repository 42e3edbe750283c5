"""The tables in README.md and docs/ are the committed result JSON files,
rendered by the same code that writes them after a benchmark run: a table
edited by hand, or left behind when its JSON was refreshed, fails here."""

import importlib.util
import json
import os
import shutil

import pytest
from idempotent_moe.bench import kv, permute, report, w4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _ep_docs(path: str, json_path: str) -> None:
    """benchmarks/ep_bench.py's table of docs/distributed.md."""
    spec = importlib.util.spec_from_file_location("ep_bench", os.path.join(ROOT, "benchmarks", "ep_bench.py"))
    ep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep)
    with open(json_path) as f:
        ep.replace_docs(path, json.load(f))


# (document, result JSON, the renderer that rewrites the document's section)
TABLES = [
    ("README.md", "main-cpu.json", report.readme_from_json),
    ("README.md", "main-cuda.json", report.readme_from_json),
    ("README.md", "kv-cuda.json", kv.doc_from_json),
    ("README.md", "permute-cpu.json", permute.doc_from_json),
    ("README.md", "permute-cuda.json", permute.doc_from_json),
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
        f"benchmarks/results/{result} (`python -m idempotent_moe readme JSON` for the main job, "
        f"`kv`, `permute` or `w4 --from-json JSON --doc {doc}`, `benchmarks/ep_bench.py` for EP)")
