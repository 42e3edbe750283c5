"""The library's modules talk through public names: no module of
idempotent_moe imports another module's private name (`from .x import _y`)
or reads one (`x._y`). A private module (`_arrays`, `_tracing`, ...) is
fine to import; its names without a leading underscore are its interface.
The compiled binding `_C` and dunder names are not private names here."""

from __future__ import annotations

import ast
import os

import idempotent_moe

PACKAGE = os.path.dirname(os.path.abspath(idempotent_moe.__file__))


def _modules() -> list:
    found = []
    for folder, _, files in os.walk(PACKAGE):
        found += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    assert len(found) > 20, found
    return sorted(found)


def _is_module(base: str, dotted: str | None, name: str) -> bool:
    """Whether `name`, imported from `dotted` relative to `base`, is a module of the package."""
    path = os.path.join(base, *(dotted.split(".") if dotted else []), name)
    return os.path.exists(path + ".py") or os.path.isdir(path)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_C"


def offences(path: str, source: str | None = None) -> list:
    """The private names the module at `path` (its text: `source`, else the
    file's) takes from other modules of the package."""
    if source is None:
        with open(path) as f:
            source = f.read()
    tree = ast.parse(source, path)
    modules, found = set(), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        dotted = node.module or ""
        if node.level == 0:
            if not dotted.startswith("idempotent_moe"):
                continue
            base, dotted = os.path.dirname(PACKAGE), dotted
        else:
            base = os.path.dirname(path)
            for _ in range(node.level - 1):
                base = os.path.dirname(base)
        for alias in node.names:
            if _is_module(base, dotted, alias.name):
                modules.add(alias.asname or alias.name)
            elif _private(alias.name):
                found.append(f"line {node.lineno}: from {'.' * node.level}{dotted} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_takes_another_modules_private_names():
    bad = {os.path.relpath(p, PACKAGE): o for p in _modules() if (o := offences(p))}
    assert not bad, bad


def test_the_rule_catches_both_forms():
    code = "from .. import functional\nfrom ..functional import _secret\nfunctional._hidden()\n"
    where = os.path.join(PACKAGE, "integrations", "example.py")  # judged as if it lived there
    assert offences(where, code) == ["line 2: from ..functional import _secret", "line 3: functional._hidden"]


def _imported_modules(name: str) -> set:
    """The modules of the package that the module `name` imports, lazily or not
    (`from . import x`, `from .x import y`)."""
    path = os.path.join(PACKAGE, name + ".py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names if _is_module(PACKAGE, None, a.name))
    return found


# One route per operation: the public modules choose it (`_routes`; for the
# MoE operations `moe` itself), the ops (`_torch_ops`, `_moe_torch_ops`) and
# the public functions both call the direct paths below them, and nothing
# below imports anything above.
ABOVE_THE_DIRECT_PATHS = {"functional", "paged", "kv", "_routes", "_torch_ops"}


def test_the_direct_paths_and_the_ops_import_nothing_above_them():
    for name in ("_compaction", "_paged", "_heads", "_shapes"):
        assert not _imported_modules(name) & ABOVE_THE_DIRECT_PATHS, name
    assert not _imported_modules("_torch_ops") & {"functional", "paged", "kv", "_routes"}
    assert _imported_modules("_routes") == {"_tracing", "_torch_ops"}
    for name in ("_moe_core", "_moe_autograd", "_moe_torch_ops"):
        assert not _imported_modules(name) & (ABOVE_THE_DIRECT_PATHS | {"moe", "integrations"}), name


# The public modules whose every exported name docs/architecture.md must
# place in a file (its "Python half" table): one hop from the doc to the code.
PUBLIC_MODULES = ("idempotent_moe", "idempotent_moe.moe", "idempotent_moe.distributed",
                  "idempotent_moe.kv_policies", "idempotent_moe.integrations")


def unplaced_names(doc: str, modules=PUBLIC_MODULES) -> list:
    """(module, name) of each `__all__` name that no backquoted span of
    `doc` names."""
    import importlib
    import re

    spans = " ".join(re.findall(r"`([^`]+)`", doc))
    missing = []
    for dotted in modules:
        module = importlib.import_module(dotted)
        for name in module.__all__:
            if not re.search(r"(?<![\w.])" + re.escape(name) + r"(?!\w)", spans):
                missing.append((dotted, name))
    return missing


def test_architecture_md_places_every_public_name():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "architecture.md")) as f:
        doc = f.read()
    assert unplaced_names(doc) == []


def test_the_placement_rule_catches_a_missing_name():
    assert unplaced_names("`fuse_routers_extra`, `unfuse_routers`", ("idempotent_moe.integrations",)) \
        .count(("idempotent_moe.integrations", "fuse_routers")) == 1
