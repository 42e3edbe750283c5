"""Command line: `python -m idempotent_moe bench` runs the main job (W1 and W2
beside torch on the best device present: table, JSON and plot); `w4` runs one
Mixtral MoE block through transformers' experts implementations and ours; `kv`
runs W2 through the KV hook, the paged hook and the Hugging Face cache;
`model` runs whole models in generate() (M1, M2) and the host cost per call (H1).

Results go to `--out` (default imoe-results/, which git ignores: a run in a
clone changes no tracked file). The committed results change only when asked:
`--readme FILE` / `--doc FILE` regenerate that file's table and write the JSON
under benchmarks/results (or `--out`); `--out benchmarks/results` alone
replaces the JSON."""

from __future__ import annotations

import argparse
import os
import sys

from .bench.report import COMMITTED_OUT, DEFAULT_OUT, output_dir
from .bench.workloads import DTYPES, FULL

WORKLOADS = tuple(FULL)


def _out_help(doc_flag: str | None) -> str:
    text = (f"folder for JSON and plot (default {DEFAULT_OUT}/, ignored by git; {COMMITTED_OUT} "
            "holds the committed results")
    if doc_flag:
        text += f"; with {doc_flag} the default is {COMMITTED_OUT}"
    return text + ")"


def _doc_outputs(parser: argparse.ArgumentParser, doc_help: str) -> None:
    """--out, --no-plot, --doc (the file whose table a run regenerates: `doc_help`) and --from-json."""
    parser.add_argument("--out", default=None, help=_out_help("--doc"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--doc", default=None, help=doc_help)
    parser.add_argument("--from-json", default=None,
                        help="with --doc: regenerate the table from this JSON instead of running")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m idempotent_moe")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="W1 and W2 beside torch topk + gather")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    bench.add_argument("--workloads", default="W1,W2", help=f"comma-separated: {','.join(WORKLOADS)}")
    bench.add_argument("--dtypes", default="",
                       help=f"comma-separated: {','.join(DTYPES)} (default: each workload's own "
                            "dtype, and float32 too on the CPU)")
    bench.add_argument("--runs", type=int, default=0,
                       help="timed runs per row (default 15 on the CPU, 100 on the GPU)")
    bench.add_argument("--threads", type=int, default=0,
                       help="CPU threads for torch and idempotent_moe alike (default: torch's)")
    bench.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    bench.add_argument("--out", default=None, help=_out_help("--readme"))
    bench.add_argument("--no-plot", action="store_true")
    bench.add_argument("--readme", default=None,
                       help="regenerate the results table of this file (README.md, docs/results.md) "
                            "from the new JSON")
    sweep = sub.add_parser("sweep", help="W5: N, keep ratio and row size sweeps (time / floor)")
    sweep.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    sweep.add_argument("--runs", type=int, default=0)
    sweep.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    sweep.add_argument("--out", default=None, help=_out_help(None))
    sweep.add_argument("--no-plot", action="store_true")
    w4 = sub.add_parser("w4", help="W4: a Mixtral MoE block, eager and grouped_mm beside idempotent")
    w4.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    w4.add_argument("--runs", type=int, default=0,
                    help="timed runs per row (default 100 on the GPU, 5 on the CPU)")
    w4.add_argument("--tokens", default="", help="comma-separated token counts (default 16,4096)")
    w4.add_argument("--capacity-factors", default="1.0,1.25",
                    help="comma-separated capacity factors for capacity-mode rows ('' for none)")
    w4.add_argument("--quick", action="store_true", help="a reduced block on the CPU, for a smoke test")
    _doc_outputs(w4, "regenerate the W4 table of this file (docs/moe.md) from the new JSON")
    kv = sub.add_parser("kv", help="W2 through the KV hook, the paged hook and the HF cache")
    kv.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    kv.add_argument("--dtypes", default="",
                    help=f"comma-separated: {','.join(DTYPES)} (default float16, and float32 too on the CPU)")
    kv.add_argument("--runs", type=int, default=0)
    kv.add_argument("--threads", type=int, default=0)
    kv.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    _doc_outputs(kv, "regenerate the table of this file (docs/kv.md) from the new JSON")
    permute = sub.add_parser("permute", help="permute_, grouping and ordered compaction beside torch "
                                              "(CPU; --device cuda: the GPU half)")
    permute.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    permute.add_argument("--runs", type=int, default=0,
                         help="timed runs per row (default 15 on the CPU, 100 on CUDA)")
    permute.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    permute.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    _doc_outputs(permute, "regenerate this file's permute table (docs/results.md) from the new JSON")
    _model_parser(sub)
    readme = sub.add_parser("readme", help="regenerate main-job tables from result JSON files "
                                            "(README.md: the GPU table; docs/results.md: all)")
    readme.add_argument("json", nargs="+")
    readme.add_argument("--readme", default="README.md", help="the file to update")
    return parser


def _model_parser(sub) -> None:
    from .bench.model_families import IMPLS, MOE_FAMILIES

    model = sub.add_parser("model", help="M1, M2, H1: MoE models in generate(), long context with "
                                          "eviction, host cost per call")
    model.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    model.add_argument("--families", default=",".join(MOE_FAMILIES),
                       help=f"comma-separated M1 models: {','.join(MOE_FAMILIES)}")
    model.add_argument("--batches", default="", help="comma-separated decode batch sizes (default 1,8,32; "
                                                      "1,4 with --quick)")
    model.add_argument("--caches", default="dynamic,static", help="comma-separated: dynamic,static")
    model.add_argument("--impls", default=",".join(IMPLS),
                       help="comma-separated experts implementations: eager, grouped_mm, idempotent, "
                            "idempotent-cap<factor>; ours take +gemm (the library's small-M grouped GEMM "
                            "at decode sizes) and +router (fused routers), e.g. idempotent+gemm+router")
    model.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (default 3)")
    model.add_argument("--new-tokens", type=int, default=0,
                       help="M1 tokens generated per call (default 48; 4 with --quick)")
    model.add_argument("--tie-ulps", type=float, default=4.0,
                       help="near-tie tolerance of the token check, in units in the last place of the "
                            "logits' dtype at the best logit (default 4)")
    model.add_argument("--skip-m1", action="store_true")
    model.add_argument("--skip-m2", action="store_true")
    model.add_argument("--skip-h1", action="store_true")
    model.add_argument("--m2-new-tokens", type=int, default=0, help="M2 tokens generated (default 64)")
    model.add_argument("--h1-calls", type=int, default=0, help="H1 calls per round (default 2000)")
    model.add_argument("--threads", type=int, default=0,
                       help="CPU threads of torch (default: torch's; 1 with --quick)")
    model.add_argument("--quick", action="store_true",
                       help="tiny models on the CPU (unless --device), for a smoke test")
    model.add_argument("--out", default=None, help=_out_help("--doc or --readme"))
    model.add_argument("--no-plot", action="store_true")
    model.add_argument("--doc", default=None,
                       help="fill the <!-- model:DEVICE --> section of this file (docs/results.md) with "
                            "every table of the new JSON")
    model.add_argument("--readme", default=None,
                       help="regenerate the headline (<!-- headline:DEVICE -->) of this file (README.md) "
                            "from the new JSON and the main job's JSON beside it")
    model.add_argument("--from-json", default=None,
                       help="with --doc and/or --readme: regenerate from this JSON instead of running")


def _run_model(args) -> None:
    from .bench import model as model_bench
    from .bench import model_report
    from .bench.model_families import MOE_FAMILIES

    if args.from_json:
        if not (args.doc or args.readme):
            raise SystemExit("--from-json needs --doc or --readme")
        if args.doc:
            model_report.doc_from_json(args.doc, args.from_json)
        if args.readme:
            model_report.headline_from_json(args.readme, args.from_json)
        return
    caches = _names(args.caches, "--caches", model_bench.CACHES)
    families = _names(args.families, "--families", tuple(MOE_FAMILIES))
    impls = tuple(v.strip() for v in args.impls.split(",") if v.strip())
    # --quick is the CPU smoke test unless a device is named
    device = "cpu" if args.quick and args.device == "auto" else args.device
    model_bench.run(model_bench.ModelOptions(
        device=device, families=families, batches=_ints(args.batches, "--batches"), caches=caches,
        impls=impls, rounds=args.rounds, new_tokens=args.new_tokens, tie_ulps=args.tie_ulps,
        skip_m1=args.skip_m1, skip_m2=args.skip_m2, skip_h1=args.skip_h1,
        m2_new_tokens=args.m2_new_tokens, h1_calls=args.h1_calls, threads=args.threads,
        quick=args.quick,
        out=output_dir(args.out, args.doc or args.readme), plot=not args.no_plot, doc=args.doc,
        readme=args.readme))


def _names(text: str, flag: str, choices: tuple) -> tuple:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in names if v not in choices]
    if unknown:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
    return names


def _ints(text: str, flag: str) -> tuple:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated integers, got {text!r}") from None


def _floats(text: str, flag: str) -> tuple:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated numbers, got {text!r}") from None


def main(argv: list | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        from .bench import Options, run

        run(Options(device=args.device, workloads=_names(args.workloads, "--workloads", WORKLOADS),
                    dtypes=_names(args.dtypes, "--dtypes", DTYPES),
                    runs=args.runs, threads=args.threads, quick=args.quick,
                    out=output_dir(args.out, args.readme), plot=not args.no_plot, readme=args.readme))
    elif args.command == "sweep":
        from .bench.sweep import run as run_sweep

        run_sweep(device=args.device, runs=args.runs, out=output_dir(args.out, None),
                  quick=args.quick, plot=not args.no_plot)
    elif args.command == "w4":
        from .bench import w4 as w4_bench

        if args.from_json:
            if not args.doc:
                raise SystemExit("--from-json needs --doc")
            w4_bench.doc_from_json(args.doc, args.from_json)
            return 0
        # --quick is the CPU smoke test unless a device is named
        device = "cpu" if args.quick and args.device == "auto" else args.device
        w4_bench.run(device=device, runs=args.runs, quick=args.quick,
                     tokens=_ints(args.tokens, "--tokens"),
                     capacity_factors=_floats(args.capacity_factors, "--capacity-factors"),
                     out=output_dir(args.out, args.doc), plot=not args.no_plot, doc=args.doc)
    elif args.command == "kv":
        from .bench.kv import KVOptions, doc_from_json, run_kv

        if args.from_json:
            if not args.doc:
                raise SystemExit("--from-json needs --doc")
            doc_from_json(args.doc, args.from_json)
            return 0
        run_kv(KVOptions(device=args.device, runs=args.runs, threads=args.threads, quick=args.quick,
                         dtypes=_names(args.dtypes, "--dtypes", DTYPES),
                         out=output_dir(args.out, args.doc), plot=not args.no_plot, doc=args.doc))
    elif args.command == "permute":
        from .bench.permute import doc_from_json as permute_doc
        from .bench.permute import run as run_permute
        from .bench.permute import run_cuda as run_permute_cuda
        from .bench.report import require_section

        out = output_dir(args.out, args.doc)
        if args.from_json:
            if not args.doc:
                raise SystemExit("--from-json needs --doc")
            permute_doc(args.doc, args.from_json)
        elif args.device == "cuda":
            run_permute_cuda(runs=args.runs, quick=args.quick, out=out, plot=not args.no_plot,
                             doc=args.doc)
        else:
            if args.doc:
                require_section(args.doc, "permute:cpu")
            run_permute(runs=args.runs, threads=args.threads, quick=args.quick, out=out,
                        plot=not args.no_plot)
            if args.doc:
                stem = "permute-cpu" + ("-quick" if args.quick else "")
                permute_doc(args.doc, os.path.join(out, stem + ".json"))
    elif args.command == "model":
        _run_model(args)
    elif args.command == "readme":
        from .bench.report import readme_from_json

        for path in args.json:
            readme_from_json(args.readme, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
