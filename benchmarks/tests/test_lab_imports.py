"""The lab uses the library's public names only: no module of imoe_bench or
of the Q1 package (q1/) and no script imports a private module of
idempotent_moe (a name starting with `_` at any level) or reads a private
attribute of one, except through imoe_bench/internals.py, the one door,
which says what it takes and why. And
the library's wheel carries no benchmark code: idempotent_moe has no `bench`
subpackage and its `python -m` entry is the self-check."""

import ast
import glob
import os

from labenv import ROOT

LAB = os.path.join(ROOT, "benchmarks")
DOOR = os.path.join(LAB, "imoe_bench", "internals.py")
LIBRARY_ALIASES = ("idempotent_moe", "imoe", "hf", "F")


def _lab_files() -> list:
    files = glob.glob(os.path.join(LAB, "imoe_bench", "*.py"))
    files += glob.glob(os.path.join(LAB, "scripts", "*.py"))
    files += glob.glob(os.path.join(LAB, "*.py")) + glob.glob(os.path.join(LAB, "q1", "*.py"))
    assert len(files) > 20, files
    return sorted(f for f in files if f != DOOR)


def _private(dotted: str) -> bool:
    return dotted.split(".")[0] == "idempotent_moe" and any(p.startswith("_") for p in dotted.split(".")[1:])


def _offences(path: str) -> list:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    library_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"import {alias.name}")
                if alias.name.startswith("idempotent_moe"):
                    library_names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if _private(node.module) or (node.module.startswith("idempotent_moe")
                                             and alias.name.startswith("_")):
                    found.append(f"from {node.module} import {alias.name}")
                elif node.module.startswith("idempotent_moe"):
                    library_names.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in library_names and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_lab_imports_only_public_names_of_the_library():
    offences = {os.path.relpath(f, ROOT): o for f in _lab_files() if (o := _offences(f))}
    assert not offences, f"private names of idempotent_moe outside imoe_bench/internals.py: {offences}"


def test_the_check_finds_a_private_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import idempotent_moe as imoe\nfrom idempotent_moe._native import native\n"
                   "from idempotent_moe.integrations import _dispatch, hf_router\nhf_router._FLAG = 1\n"
                   "imoe._C\n")
    assert _offences(str(bad)) == ["from idempotent_moe._native import native",
                                   "from idempotent_moe.integrations import _dispatch",
                                   "hf_router._FLAG", "imoe._C"]


def test_the_library_package_holds_no_benchmark_code():
    import idempotent_moe

    package = os.path.dirname(os.path.abspath(idempotent_moe.__file__))
    assert not os.path.exists(os.path.join(package, "bench"))
    for name in glob.glob(os.path.join(package, "**", "*.py"), recursive=True):
        with open(name) as f:
            text = f.read()
        assert "imoe_bench" not in text.replace("python -m imoe_bench", ""), name
