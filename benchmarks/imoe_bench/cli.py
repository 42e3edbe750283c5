"""Command line: `python -m imoe_bench bench` runs the main job (W1 and W2
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
import json
import math
import os
import sys

from .report import COMMITTED_OUT, DEFAULT_OUT, output_dir
from .workloads import DTYPES, FULL

WORKLOADS = tuple(FULL)
__version__ = "0.1.0"

# Commands that live in a module of their own: NAME -> (module of imoe_bench
# with `main(argv) -> int`, help). `python -m imoe_bench NAME ARGS...` passes
# ARGS to that main; adding one is one line here.
MODULE_COMMANDS: dict = {}


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line on stderr (not the usage text) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _count(text: str) -> int:
    """An integer >= 0 (0: the command's default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"an integer >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = _count(text)
    if value == 0:
        raise argparse.ArgumentTypeError("an integer >= 1, got 0")
    return value


def _finite_nonnegative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a finite number >= 0, got {text}")
    return value


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
    parser = _Parser(prog="python -m imoe_bench")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="W1 and W2 beside torch topk + gather")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    bench.add_argument("--workloads", default="W1,W2", help=f"comma-separated: {','.join(WORKLOADS)}")
    bench.add_argument("--dtypes", default="",
                       help=f"comma-separated: {','.join(DTYPES)} (default: each workload's own "
                            "dtype, and float32 too on the CPU)")
    bench.add_argument("--runs", type=_count, default=0,
                       help="timed runs per row (default 15 on the CPU, 100 on the GPU)")
    bench.add_argument("--threads", type=_count, default=0,
                       help="CPU threads for torch and idempotent_moe alike (default: torch's)")
    bench.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    bench.add_argument("--out", default=None, help=_out_help("--readme"))
    bench.add_argument("--no-plot", action="store_true")
    bench.add_argument("--readme", default=None,
                       help="regenerate the results table of this file (README.md, docs/results.md) "
                            "from the new JSON")
    sweep = sub.add_parser("sweep", help="W5: N, keep ratio and row size sweeps (time / floor)")
    sweep.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    sweep.add_argument("--runs", type=_count, default=0)
    sweep.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    sweep.add_argument("--out", default=None, help=_out_help(None))
    sweep.add_argument("--no-plot", action="store_true")
    w4 = sub.add_parser("w4", help="W4: a Mixtral MoE block, eager and grouped_mm beside idempotent")
    w4.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    w4.add_argument("--runs", type=_count, default=0,
                    help="timed runs per row (default 100 on the GPU, 5 on the CPU)")
    w4.add_argument("--tokens", default="", help="comma-separated token counts (default 16,4096)")
    w4.add_argument("--capacity-factors", default="1.0,1.25",
                    help="comma-separated capacity factors for capacity-mode rows ('' for none)")
    w4.add_argument("--quick", action="store_true", help="a reduced block on the CPU, for a smoke test")
    _doc_outputs(w4, "regenerate the W4 table of this file (docs/results.md) from the new JSON")
    train = sub.add_parser("train", help="T1: training steps (models and the experts layer alone), "
                                          "grouped_mm and eager beside idempotent")
    train.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    train.add_argument("--rounds", type=_count, default=0, help="interleaved rounds (default 3; quick 1)")
    train.add_argument("--reps", type=_count, default=0, help="timed steps per mode and round (default 3)")
    train.add_argument("--only", choices=("model", "layer"), default=None, help="one half of T1")
    train.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, for a smoke test")
    train.add_argument("--profile", action="store_true",
                       help="both halves taken apart instead (--only: one): per kernel time, and the layer's "
                            "saved tensors (--reps profiled steps; no table, plot or doc)")
    train.add_argument("--memory", action="store_true",
                       help="both halves taken apart instead (--only: one): what is alive at a step's memory "
                            "peak, by allocating site (no table, plot or doc)")
    _doc_outputs(train, "regenerate the T1 table of this file (docs/moe.md) from the new JSON")
    kv = sub.add_parser("kv", help="W2 through the KV hook, the paged hook and the HF cache")
    kv.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    kv.add_argument("--dtypes", default="",
                    help=f"comma-separated: {','.join(DTYPES)} (default float16, and float32 too on the CPU)")
    kv.add_argument("--runs", type=_count, default=0)
    kv.add_argument("--threads", type=_count, default=0)
    kv.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    _doc_outputs(kv, "regenerate the table of this file (docs/kv.md) from the new JSON")
    permute = sub.add_parser("permute", help="permute_, grouping and ordered compaction beside torch "
                                              "(CPU; --device cuda: the GPU half)")
    permute.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    permute.add_argument("--runs", type=_count, default=0,
                         help="timed runs per row (default 15 on the CPU, 100 on CUDA)")
    permute.add_argument("--threads", type=_count, default=0, help="CPU threads (default: torch's)")
    permute.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    _doc_outputs(permute, "regenerate this file's permute table (docs/results.md) from the new JSON")
    _model_parser(sub)
    readme = sub.add_parser("readme", help="regenerate main-job tables from result JSON files "
                                            "(README.md: the GPU table; docs/results.md: all)")
    readme.add_argument("json", nargs="+")
    readme.add_argument("--readme", default="README.md", help="the file to update")
    for name, (_, help_text) in MODULE_COMMANDS.items():
        module = sub.add_parser(name, help=help_text, add_help=False)
        module.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _version() -> str:
    try:
        import idempotent_moe

        library = idempotent_moe.__version__
    except ImportError:
        library = "not installed"
    return f"imoe_bench {__version__} (idempotent_moe {library})"


def _model_parser(sub) -> None:
    from .model_families import IMPLS, MOE_FAMILIES

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
    model.add_argument("--rounds", type=_positive, default=3, help="interleaved timed rounds (default 3)")
    model.add_argument("--new-tokens", type=_count, default=0,
                       help="M1 tokens generated per call (default 48; 4 with --quick)")
    model.add_argument("--tie-ulps", type=_finite_nonnegative, default=4.0,
                       help="near-tie tolerance of the token check, in units in the last place of the "
                            "logits' dtype at the best logit (default 4)")
    model.add_argument("--skip-m1", action="store_true")
    model.add_argument("--skip-m2", action="store_true")
    model.add_argument("--skip-h1", action="store_true")
    model.add_argument("--m2-new-tokens", type=_count, default=0, help="M2 tokens generated (default 64)")
    model.add_argument("--h1-calls", type=_count, default=0, help="H1 calls per round (default 2000)")
    model.add_argument("--threads", type=_count, default=0,
                       help="CPU threads of torch (default: torch's; 1 with --quick)")
    model.add_argument("--quick", action="store_true",
                       help="tiny models on the CPU (unless --device), for a smoke test")
    model.add_argument("--full-on-cpu", action="store_true",
                       help="run the GPU-sized models on the CPU all the same (hours)")
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
    from . import model as model_bench
    from . import model_report
    from .model_families import MOE_FAMILIES

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
    """Comma-separated integers, each >= 1."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise SystemExit(f"{flag}: every value must be >= 1, got {text!r}")
    return values


def _floats(text: str, flag: str) -> tuple:
    """Comma-separated finite numbers, each > 0."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated numbers, got {text!r}") from None
    if any(not math.isfinite(v) or v <= 0 for v in values):
        raise SystemExit(f"{flag}: every value must be a finite number > 0, got {text!r}")
    return values


def _json_file(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        raise SystemExit(f"{flag}: no such file: {path}")
    try:
        with open(path) as f:
            json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SystemExit(f"{flag}: {path} is not a readable JSON file ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def _text_file(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        raise SystemExit(f"{flag}: no such file: {path}")
    if not os.access(path, os.R_OK | os.W_OK):
        raise SystemExit(f"{flag}: {path} is not readable and writable")


def _out_dir(path: str) -> None:
    """The output folder exists as a writable folder, or can be made in the
    nearest existing folder above it (nothing is created here)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SystemExit(f"--out: {path} exists and is not a folder")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise SystemExit(f"--out: {probe} is not a folder, so {path} cannot be made")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SystemExit(f"--out: {probe} is not writable")


def _cpu_run(device: str) -> bool:
    """Whether `device` ("auto", "cpu", "cuda") means the CPU here."""
    if device != "auto":
        return device == "cpu"
    try:
        import torch
    except ImportError:
        return True
    import idempotent_moe

    return not (torch.cuda.is_available() and idempotent_moe.cuda_available())


def _check(args) -> None:
    """Every flag and path, before any work starts: one line and a non-zero
    exit on the first that is wrong (argparse has checked the counts already)."""
    if getattr(args, "from_json", None):
        if args.command == "model" and not (args.doc or args.readme):
            raise SystemExit("--from-json needs --doc or --readme")
        if args.command != "model" and not args.doc:
            raise SystemExit("--from-json needs --doc")
        _json_file(args.from_json, "--from-json")
    for flag in ("doc", "readme"):
        if getattr(args, flag, None):
            _text_file(getattr(args, flag), f"--{flag}")
    if args.command == "readme":
        for path in args.json:
            _json_file(path, "readme")
        return
    if getattr(args, "from_json", None):
        return  # a table regenerated from JSON: nothing is run, nothing written under --out
    out = output_dir(args.out, getattr(args, "doc", None) or getattr(args, "readme", None))
    _out_dir(out)
    if args.command == "w4":
        _ints(args.tokens, "--tokens")
        _floats(args.capacity_factors, "--capacity-factors")
        if not args.quick and not args.tokens and _cpu_run(args.device):
            raise SystemExit("w4: the full-size block at 4096 tokens is sized for a GPU and this run "
                             "would be on the CPU; add --quick (a reduced block) or name the sizes "
                             "with --tokens")
    if args.command == "train" and args.profile and (args.doc or args.from_json or args.rounds):
        raise SystemExit("train --profile takes --device, --only, --reps, --quick and --out only (one "
                         "round of profiled steps)")
    if args.command == "train" and args.memory and (args.profile or args.doc or args.from_json or args.rounds
                                                    or args.reps):
        raise SystemExit("train --memory takes --device, --only, --quick and --out only (one recorded step "
                         "of each model and layer)")
    if args.command == "train" and not args.quick and _cpu_run(args.device):
        raise SystemExit("train: T1's models and 16,384-token layers are sized for a GPU and this run "
                         "would be on the CPU; add --quick (tiny shapes)")
    if args.command == "model":
        _ints(args.batches, "--batches")
        if not args.quick and not args.full_on_cpu and _cpu_run(args.device):
            raise SystemExit("model: the full-size models (M1's Mixtral-like model, M2's 32,768-token "
                             "prompt) are sized for a GPU and this run would be on the CPU (hours); add "
                             "--quick for the tiny models, or --full-on-cpu to run them all the same")


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MODULE_COMMANDS:
        import importlib

        module = importlib.import_module(f"{__package__}.{MODULE_COMMANDS[argv[0]][0]}")
        return module.main(argv[1:])
    args = _parser().parse_args(argv)
    _check(args)  # SystemExit with one line (status 1) on the first bad flag or path
    if args.command == "bench":
        from . import Options, run

        run(Options(device=args.device, workloads=_names(args.workloads, "--workloads", WORKLOADS),
                    dtypes=_names(args.dtypes, "--dtypes", DTYPES),
                    runs=args.runs, threads=args.threads, quick=args.quick,
                    out=output_dir(args.out, args.readme), plot=not args.no_plot, readme=args.readme))
    elif args.command == "sweep":
        from .sweep import run as run_sweep

        run_sweep(device=args.device, runs=args.runs, out=output_dir(args.out, None),
                  quick=args.quick, plot=not args.no_plot)
    elif args.command == "w4":
        from . import w4 as w4_bench

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
    elif args.command == "train":
        from . import train as t1

        if args.memory:
            from . import train_memory

            data = train_memory.run(device="cpu" if args.quick and args.device == "auto" else args.device,
                                    quick=args.quick, only=args.only)
            print(train_memory.tables(data))
            for path in train_memory.write(data, output_dir(args.out, None)):
                print("wrote", path)
            return 0
        if args.profile:
            from . import train_profile

            data = train_profile.run(device="cpu" if args.quick and args.device == "auto" else args.device,
                                     quick=args.quick, reps=args.reps, only=args.only)
            print(train_profile.tables(data))
            for path in train_profile.write(data, output_dir(args.out, None)):
                print("wrote", path)
            return 0
        from . import train_report

        if args.from_json:
            train_report.doc_from_json(args.doc, args.from_json)
            return 0
        if args.doc:
            from .report import require_section

            require_section(args.doc, "bench:t1")
        data = t1.run(device="cpu" if args.quick and args.device == "auto" else args.device,
                      quick=args.quick, rounds=args.rounds, reps=args.reps, only=args.only)
        print(train_report.table(data))
        for path in train_report.write(data, output_dir(args.out, args.doc), plot=not args.no_plot):
            print("wrote", path)
        if args.doc:
            train_report.update_doc(args.doc, data)
    elif args.command == "kv":
        from .kv import KVOptions, doc_from_json, run_kv

        if args.from_json:
            if not args.doc:
                raise SystemExit("--from-json needs --doc")
            doc_from_json(args.doc, args.from_json)
            return 0
        run_kv(KVOptions(device=args.device, runs=args.runs, threads=args.threads, quick=args.quick,
                         dtypes=_names(args.dtypes, "--dtypes", DTYPES),
                         out=output_dir(args.out, args.doc), plot=not args.no_plot, doc=args.doc))
    elif args.command == "permute":
        from .permute import doc_from_json as permute_doc
        from .permute import run as run_permute
        from .permute import run_cuda as run_permute_cuda
        from .report import require_section

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
        from .model_report import readme_from_json

        for path in args.json:
            readme_from_json(args.readme, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
