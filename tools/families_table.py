"""Write docs/families.md: which transformers MoE families the "idempotent"
experts implementation was checked on, dropless and in capacity mode.

    PYTHONPATH=python python tools/families_table.py [--out docs/families.md] [FAMILY ...]

Runs the discovery and the checks of tests/hf/test_hf_families.py (the same
code, on the installed transformers and idempotent_moe) and writes one row
per family: pass, xfail (a known failure, with its root cause), skip (cannot
be built generically, with why) or FAIL (a new failure: the message).
Exit status 1 when a check failed that is not a known failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_tests():
    path = ROOT / "tests" / "hf" / "test_hf_families.py"
    spec = importlib.util.spec_from_file_location("test_hf_families", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "families.md"))
    parser.add_argument("families", nargs="*", help="only these (default: every discovered family)")
    args = parser.parse_args(argv)

    import torch
    import transformers

    # As the test suite runs (tests/conftest.py): uninitialised memory poisoned.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    t = _load_tests()
    families = args.families or t.discover_families()
    rows, counts, new_failures = [], {"pass": 0, "xfail": 0, "skip": 0, "FAIL": 0}, 0
    start = time.time()
    for family in families:
        try:
            _, built = t.build_family(family)
            t.references(family)
        except t.Unbuildable as e:
            counts["skip"] += 1
            reason = _cell(f"skip: cannot be built generically: {e}")
            rows.append(f"| {family} | - | {reason} | {reason} |")
            continue
        cells = []
        for mode in t.MODES:
            known = t.KNOWN_FAILURES.get((family, mode)) or t.KNOWN_FAILURES.get(family)
            try:
                t.check_family(family, mode)
            except AssertionError as e:
                status = "xfail" if known else "FAIL"
                new_failures += not known
                cells.append(_cell(f"{status}: {known or e}"))
            except Exception as e:  # an error inside a forward is a failure too
                status = "xfail" if known else "FAIL"
                new_failures += not known
                cells.append(_cell(f"{status}: {known or f'{type(e).__name__}: {e}'}"))
            else:
                status = "FAIL (passes, but listed as a known failure)" if known else "pass"
                new_failures += bool(known)
                cells.append(status)
            counts[status.split()[0] if status.startswith("FAIL") else status] += 1
        rows.append(f"| {family} | {_cell(built)} | {cells[0]} | {cells[1]} |")
        print(f"{family}: {cells[0][:60]} / {cells[1][:60]}", file=sys.stderr)
    elapsed = time.time() - start
    total = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    text = "\n".join([
        "# Model families checked with the \"idempotent\" experts implementation",
        "",
        "Every model family of the installed transformers whose experts module uses",
        "`@use_experts_implementation`, found by `tests/hf/test_hf_families.py` (it",
        "runs in CI on the newest transformers, so a family transformers adds is",
        "checked without a change here). Each is built tiny from its config's",
        "defaults (hidden 64, 1-2 layers of which at least one MoE, 8 experts,",
        "top-2, vocabulary 128; random weights, float32, on the CPU), and",
        "\"idempotent\" is held to transformers' `grouped_mm` on one input: the",
        "output without a gradient (the library's fused path), the output and the",
        "gradients w.r.t. the input embeddings and the experts' weights with one",
        "(the training path: the fused experts layer where the module has the",
        "default gate and no bias or post-expert norm, else torch ops), within",
        "twice the spread of transformers' `eager` and `batched_mm` around",
        "`grouped_mm` (at least 1e-6 of the output's scale), and with as many",
        "calls of its experts function as `grouped_mm`'s. Capacity mode runs with",
        "capacity factor E / k, so C = T: the selection and the compaction run",
        "and nothing is dropped (the test checks the counts).",
        "",
        "The model column is the class built (a text-only `ForCausalLM` where the",
        "family has one, else its text model) and its layers. A random-weight",
        "check says that the implementation computes what transformers computes",
        "for the family's experts layout; it is not a quality test of the model.",
        "NemotronH keeps the 4 layers of its default block pattern (its layer",
        "count is that pattern's length).",
        "",
        "What the generic build fills in where a family's defaults alone do not",
        "make a model (each is in `tests/hf/test_hf_families.py`): a hash router's",
        "token-to-experts table (DeepSeek-V4's `tid2eid`, zeros until a",
        "checkpoint is loaded) gets k distinct experts per token, since the",
        "library refuses a token that names one expert twice with nonzero",
        "weights (`grouped_mm` computes it silently; LongCat-Flash's zero",
        "experts, repeats of weight 0, are taken); a multimodal rope's `mrope_section` is rescaled",
        "to the shrunk head dimension, also where only the model holds a default",
        "(GLM-4V-MoE, ERNIE-4.5-VL); a per-layer list that a standalone text",
        "config leaves unset (LFM2-MoE's `layer_types`, DeepSeek-OCR-2's",
        "`mlp_layer_types`) is filled with the values its model compares it with;",
        "models run with `use_cache=False` (a cache of only linear-attention",
        "layers has no sequence length to report).",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}: "
        f"{len(families)} families x {len(t.MODES)} modes: {total} ({elapsed:.0f} s).",
        "Regenerate with `PYTHONPATH=python python tools/families_table.py`.",
        "",
        "| family | model built | dropless | capacity (factor E/k) |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {total}", file=sys.stderr)
    return 1 if new_failures else 0


if __name__ == "__main__":
    sys.exit(main())
