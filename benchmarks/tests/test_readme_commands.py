"""The README's two commands, in order, in one clone: the main job with its
defaults (`python -m imoe_bench bench`) changes no tracked file, because
every benchmark writes to a folder git ignores, and the tests run after it
(`python -m pytest`) still find the committed tables equal to their JSON."""

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from imoe_bench.cli import _parser, main  # noqa: E402
from imoe_bench.report import COMMITTED_OUT, DEFAULT_OUT, output_dir  # noqa: E402
from labenv import package_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_COMMANDS = ("bench", "sweep", "w4", "kv", "permute")


def _git(*args, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _checkout() -> bool:
    if shutil.which("git") is None:
        return False
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True,
                         text=True)
    return top.returncode == 0 and os.path.realpath(top.stdout.strip()) == os.path.realpath(ROOT)


needs_checkout = pytest.mark.skipif(not _checkout(), reason="needs git and a checkout of the project")


def _clone(dest) -> None:
    """The tracked files of this checkout as they stand (uncommitted edits
    included), in a fresh repository at `dest` with every file staged."""
    dest.mkdir()
    for name in _git("ls-files", "-z", cwd=ROOT).split("\0"):
        src = os.path.join(ROOT, name)
        if name and os.path.isfile(src):
            os.makedirs(dest / os.path.dirname(name), exist_ok=True)
            shutil.copy2(src, dest / name)
    _git("init", "-q", cwd=dest)
    _git("add", "-A", cwd=dest)


def _status(repo) -> set:
    """Every changed, untracked or ignored path of `repo`, with its status."""
    out = _git("status", "--porcelain", "--ignored", "--untracked-files=all", cwd=repo)
    return set(out.splitlines())


@needs_checkout
def test_default_output_folder_is_ignored_by_git():
    assert DEFAULT_OUT != os.path.join("benchmarks", "results")
    for command in BENCH_COMMANDS:
        args = _parser().parse_args([command])
        assert args.out is None, f"{command}: --out defaults to {args.out!r}, a path that may be tracked"
    for path in (f"{DEFAULT_OUT}/main-cpu.json", f"benchmarks/{DEFAULT_OUT}/kv-cpu.png"):
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
        assert ignored.returncode == 0, f".gitignore does not ignore {path}"


def test_committed_results_change_only_when_asked():
    assert output_dir(None, None) == DEFAULT_OUT
    # regenerating a document's table writes the JSON it is checked against
    assert output_dir(None, "docs/results.md") == COMMITTED_OUT
    assert output_dir("elsewhere", "docs/results.md") == "elsewhere"
    assert output_dir("elsewhere", None) == "elsewhere"


@needs_checkout
def test_readme_bench_then_tests_in_one_clone(tmp_path, monkeypatch):
    clone = tmp_path / "clone"
    _clone(clone)
    before = _status(clone)
    # 1. the main job with its defaults (quick sizes: the outputs' names end in
    # -quick, which .gitignore also lists under benchmarks/results, so the
    # check is where they went, not only that git shows nothing new)
    monkeypatch.chdir(clone)
    assert main(["bench", "--device", "cpu", "--quick", "--runs", "1"]) == 0
    new = _status(clone) - before
    assert new, "the main job wrote nothing"
    outside = sorted(line for line in new if not line.startswith(f"!! {DEFAULT_OUT}/"))
    assert not outside, f"the main job changed tracked files or wrote outside {DEFAULT_OUT}/: {outside}"
    assert os.path.exists(clone / DEFAULT_OUT / "main-cpu-quick.json")
    assert os.path.exists(clone / DEFAULT_OUT / "main-cpu-quick.png")
    # 2. the tests that read the committed results, in the same clone
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "benchmarks/tests/test_results_tables.py"], cwd=clone, env=package_env(),
                          capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
