"""Every ```python block of README.md and docs/*.md, as written, on the CPU.

The blocks of one document run in order in one namespace, as the document
reads (a later block may use what an earlier one made). A block is preceded
in the document by an HTML comment that says what it needs, when it needs
more than a CPU:

    <!-- snippet: needs cuda -->                 skipped here, with that reason
    <!-- snippet: needs a multi-process launch --> (any "needs ..." is a skip)
    <!-- snippet: signature -->                 an API synopsis, not a program:
        each `[target =] callable(parameters) [-> type]` in it is checked
        against the callable's real signature (names, order, keyword-only
        marker, defaults) instead of being run.

Snippets build tiny inputs and tiny random transformers models from a config;
none downloads anything."""

from __future__ import annotations

import ast
import glob
import importlib
import inspect
import os
import re

import pytest
from _helpers import ROOT

pytest.importorskip("torch")

MARKER = re.compile(r"<!--\s*snippet:\s*(.+?)\s*-->")
# The modules whose public names a synopsis may call.
API_MODULES = ("idempotent_moe", "idempotent_moe.integrations", "idempotent_moe.distributed",
               "idempotent_moe.paged", "idempotent_moe.kv", "idempotent_moe.moe",
               "idempotent_moe.kv_policies", "idempotent_moe.integrations.hf_cache")


def _documents() -> list:
    pages = glob.glob(os.path.join(ROOT, "docs", "*.md"))
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in pages)


def _blocks(doc: str) -> list:
    """(line, code, marker or None) of each ```python block of `doc`."""
    with open(os.path.join(ROOT, doc)) as f:
        lines = f.read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            i += 1
            while lines[i].strip() != "```":
                i += 1
            before = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
            m = MARKER.search(before)
            blocks.append((start + 1, "\n".join(lines[start + 1:i]), m.group(1) if m else None))
        i += 1
    return blocks


CASES = [pytest.param(doc, line, code, marker, id=f"{doc}:{line}")
         for doc in _documents() for line, code, marker in _blocks(doc)]
NAMESPACES: dict = {}  # document -> (its namespace, the lines of the blocks run in it)


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i]
    return line


def _statements(code: str) -> list:
    """The block's logical lines: comments dropped, bracketed continuations joined."""
    out, current, depth = [], "", 0
    for raw in code.split("\n"):
        line = _strip_comment(raw).rstrip()
        if not line.strip() and depth == 0:
            continue
        current += (" " if current else "") + line.strip()
        depth += line.count("(") + line.count("[") - line.count(")") - line.count("]")
        if depth == 0:
            out.append(current)
            current = ""
    assert not current, f"unbalanced brackets: {current!r}"
    return out


SIGNATURE = re.compile(r"^(?:(?P<target>[\w, ]+?)\s*=\s*)?(?P<callee>[\w.]+)\((?P<params>.*)\)"
                       r"(?:\s*->\s*.+)?$")


def _library_names() -> dict:
    names = {}
    for module in API_MODULES:
        mod = importlib.import_module(module)
        names.update({k: v for k, v in vars(mod).items() if not k.startswith("_")})
    return names


def _resolve(callee: str, names: dict, instances: dict):
    head, *rest = callee.split(".")
    if head in instances:
        obj, bound = instances[head], True
    elif head in names:
        obj, bound = names[head], False
    else:
        raise AssertionError(f"{callee}: not a name of the library ({', '.join(API_MODULES)})")
    for attr in rest:
        obj, bound = getattr(obj, attr), False
    if bound:  # an instance called: its class's __call__
        obj = obj.__call__
    return obj


def _documented(params: str) -> list:
    """(name, kind, default or None) of the parameters written in a synopsis."""
    args = ast.parse(f"def _f({params}): pass").body[0].args
    out = []
    positional = args.posonlyargs + args.args
    pos_defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for a, d in zip(positional, pos_defaults):
        out.append((a.arg, "positional", d))
    if args.vararg:
        out.append((args.vararg.arg, "var", None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, "keyword", d))
    if args.kwarg:
        out.append((args.kwarg.arg, "varkw", None))
    return out


KINDS = {inspect.Parameter.POSITIONAL_ONLY: "positional",
         inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
         inspect.Parameter.VAR_POSITIONAL: "var", inspect.Parameter.KEYWORD_ONLY: "keyword",
         inspect.Parameter.VAR_KEYWORD: "varkw"}


def _check_signature(statement: str, names: dict, instances: dict) -> None:
    if statement.startswith(("import ", "from ")):
        return
    m = SIGNATURE.match(statement)
    assert m, f"not a synopsis `[target =] callable(parameters) [-> type]`: {statement!r}"
    target, callee = m["target"], m["callee"]
    obj = _resolve(callee, names, instances)
    real = [p for p in inspect.signature(obj).parameters.values()
            if p.name not in ("self", "cls") and not p.name.startswith("_")]
    written = _documented(m["params"])
    assert [(n, k) for n, k, _ in written] == [(p.name, KINDS[p.kind]) for p in real], (
        f"{callee}: the synopsis has ({m['params']}), the code {inspect.signature(obj)}")
    for (name, _, default), p in zip(written, real):
        if default is None:
            assert p.default is inspect.Parameter.empty, f"{callee}: {name} has a default, {p.default!r}"
            continue
        try:
            value = ast.literal_eval(default)
        except ValueError:
            continue  # not a literal (say, a name): the names and order checks stand
        assert p.default == value and type(p.default) is type(value), (
            f"{callee}: {name}={ast.unparse(default)} in the synopsis, {p.default!r} in the code")
    if target and inspect.isclass(obj) and "," not in target:
        instances[target.strip()] = obj


def _run(doc: str, line: int) -> None:
    """Run the document's block at `line` in the document's namespace, after
    every earlier block that has not run yet (so that one block selected
    alone, with -k, finds what the blocks before it made)."""
    namespace, done = NAMESPACES.setdefault(doc, ({"__name__": f"snippets of {doc}"}, set()))
    for at, code, marker in _blocks(doc):
        if at > line:
            break
        if marker is None and at not in done:
            done.add(at)
            exec(compile(code, f"{doc}:{at}", "exec"), namespace)


@pytest.mark.parametrize("doc, line, code, marker", CASES)
def test_snippet(doc, line, code, marker):
    if marker and marker.startswith("needs"):
        pytest.skip(marker)
    if marker == "signature":
        names, instances = _library_names(), {}
        for statement in _statements(code):
            _check_signature(statement, names, instances)
        return
    assert marker is None, f"{doc}:{line}: unknown snippet marker {marker!r}"
    _run(doc, line)
