"""Command line: `python -m idempotent_moe bench` runs the main job (W1 and W2
beside torch on the best device present: table, JSON and plot)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m idempotent_moe")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="W1 and W2 beside torch topk + gather")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    bench.add_argument("--workloads", default="W1,W2", help="comma-separated: W1,W2,W3")
    bench.add_argument("--dtypes", default="",
                       help="comma-separated torch dtypes (default: each workload's own dtype, "
                            "and float32 too on the CPU)")
    bench.add_argument("--runs", type=int, default=0,
                       help="timed runs per row (default 15 on the CPU, 100 on the GPU)")
    bench.add_argument("--threads", type=int, default=0,
                       help="CPU threads for torch and idempotent_moe alike (default: torch's)")
    bench.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    bench.add_argument("--out", default="benchmarks/results", help="folder for JSON and plot")
    bench.add_argument("--no-plot", action="store_true")
    bench.add_argument("--readme", default=None,
                       help="regenerate the results table of this README from the new JSON")
    sweep = sub.add_parser("sweep", help="W5: N, keep ratio and row size sweeps (time / floor)")
    sweep.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    sweep.add_argument("--runs", type=int, default=0)
    sweep.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    sweep.add_argument("--out", default="benchmarks/results")
    sweep.add_argument("--no-plot", action="store_true")
    readme = sub.add_parser("readme", help="regenerate README tables from result JSON files")
    readme.add_argument("json", nargs="+")
    readme.add_argument("--readme", default="README.md")
    return parser


def main(argv: list | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        from .bench import Options, run

        workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        unknown = [w for w in workloads if w not in ("W1", "W2", "W3")]
        if unknown:
            raise SystemExit(f"unknown workloads {unknown}: choose from W1, W2, W3")
        run(Options(device=args.device, workloads=workloads,
                    dtypes=tuple(d.strip() for d in args.dtypes.split(",") if d.strip()),
                    runs=args.runs, threads=args.threads, quick=args.quick, out=args.out,
                    plot=not args.no_plot, readme=args.readme))
    elif args.command == "sweep":
        from .bench.sweep import run as run_sweep

        run_sweep(device=args.device, runs=args.runs, out=args.out, quick=args.quick,
                  plot=not args.no_plot)
    elif args.command == "readme":
        from .bench.report import readme_from_json

        for path in args.json:
            readme_from_json(args.readme, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
