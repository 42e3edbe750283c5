"""The documents stay sized for a first release, and the committed results
are the ones the documents cite: README.md at most 250 lines, docs/results.md
at most 300, the CHANGELOG's unreleased section at most 80, the committed
JSON under benchmarks/ at most 3,000 lines, each results file named by a
document or a script."""

from __future__ import annotations

import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def unreleased_lines(changelog: str) -> int:
    """Lines between the `## [Unreleased]` heading and the next `## [` heading."""
    inside, count = False, 0
    for line in changelog.splitlines():
        if line.startswith("## ["):
            if inside:
                break
            inside = line.startswith("## [Unreleased]")
            continue
        count += inside
    return count


@pytest.mark.parametrize("name,limit", [("README.md", 250), ("docs/results.md", 300)])
def test_document_within_its_size(name, limit):
    assert _lines(os.path.join(ROOT, name)) <= limit


def test_changelog_unreleased_section_within_80_lines():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        assert 0 < unreleased_lines(f.read()) <= 80


def test_unreleased_lines_counts_only_that_section():
    text = "# C\n\n## [Unreleased]\n\na\nb\n\n## [0.1.0]\n\nc\n"
    assert unreleased_lines(text) == 4


def test_committed_json_within_3000_lines():
    files = glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.json"), recursive=True)
    files = [f for f in files if "egg-info" not in f]
    assert files and sum(_lines(f) for f in files) <= 3000


def test_every_committed_result_is_cited():
    texts = []
    for pattern in ("README.md", "docs/*.md", "tools/*",
                    "benchmarks/**/*.md", "benchmarks/**/*.py", "benchmarks/**/*.sh"):
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            if os.path.isfile(path) and not path.startswith(RESULTS):
                with open(path, encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
    corpus = "\n".join(texts)
    uncited = [n for n in sorted(os.listdir(RESULTS)) if n not in corpus]
    assert not uncited, uncited
