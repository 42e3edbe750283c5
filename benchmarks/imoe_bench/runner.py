"""The main job: W1 and W2 beside their baselines on the best device present,
with a progress bar, a table, JSON and a plot."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from dataclasses import dataclass

import idempotent_moe as imoe

from . import report, workloads
from .timing import copy_bandwidth, cuda_memory, time_calls

FLUSH, QUICK_FLUSH = workloads.FLUSH_BYTES, 4 << 20


@dataclass
class RunOptions:
    """What every benchmark run takes (0 and () for the device's defaults)."""

    device: str = "auto"
    dtypes: tuple = ()
    runs: int = 0
    threads: int = 0
    quick: bool = False
    out: str = report.DEFAULT_OUT
    plot: bool = True


@dataclass
class Options(RunOptions):
    workloads: tuple = ("W1", "W2")
    readme: str | None = None


def start(opts: RunOptions, doc: str | None, section: str) -> tuple:
    """The device, thread count and runs of a benchmark run by its options (device, threads,
    runs); fails before anything is measured when `doc` has no `section:DEVICE` to fill."""
    import torch

    device = pick_device(opts.device)
    if doc:
        report.require_section(doc, f"{section}:{device}")
    threads = opts.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    return device, threads, opts.runs or (100 if device == "cuda" else 15)


def pick_device(requested: str) -> str:
    import torch

    has_gpu = torch.cuda.is_available()
    if requested == "auto":
        if has_gpu and not imoe.cuda_available():
            print("note: a GPU is present but this build of idempotent_moe has no CUDA kernels; "
                  "benchmarking on the CPU", file=sys.stderr)
        return "cuda" if has_gpu and imoe.cuda_available() else "cpu"
    if requested == "cuda" and not (has_gpu and imoe.cuda_available()):
        raise SystemExit("--device cuda needs a GPU and a CUDA build of idempotent_moe")
    return requested


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        return _PlainProgress(total)


class _PlainProgress:
    def __init__(self, total: int):
        self.total, self.done = total, 0

    def set_description(self, text: str) -> None:
        print(f"[{self.done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n

    def close(self) -> None:
        pass


def git_commit() -> str | None:
    """The commit the measured code is: $IMOE_COMMIT when set (a copy of a
    checkout), else HEAD of the checkout this package lies in; None when the
    package is not in a checkout of its own (installed, or a copy inside
    another repository)."""
    if os.environ.get("IMOE_COMMIT"):
        return os.environ["IMOE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        def git(*cmd):
            return subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True,
                                  timeout=5).stdout.strip()

        top = git("rev-parse", "--show-toplevel")
        if not top or os.path.realpath(top) != os.path.realpath(root):
            return None
        return git("rev-parse", "--short", "HEAD") or None
    except (OSError, subprocess.SubprocessError):
        return None


def _machine(device: str, threads: int, bandwidth: float) -> dict:
    import numpy
    import torch

    info = {
        "device": device,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "idempotent_moe": imoe.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_bandwidth_GBps": bandwidth / 1e9,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["cuda"] = torch.version.cuda
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            info["driver"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        try:
            with open("/proc/cpuinfo") as f:
                names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
            info["cpu"] = names[0] if names else info["cpu"]
        except OSError:
            pass
    return info


def _memory(device: str, impl: workloads.Impl, problem: workloads.Problem) -> dict:
    """Peak bytes allocated by one call beyond what was allocated before it,
    and the reserved pool before and after (CUDA caching allocator)."""
    if device != "cuda":
        return {}
    problem.reset()
    return cuda_memory(impl.run)[1]


def measure(problem: workloads.Problem, impls: list, device: str, runs: int, bandwidth: float,
            bar, label: str) -> list:
    """Time every implementation on the same problem (the first is the
    reference), check each result bit for bit against it, and return one row
    each: timing, floor of its mode, check and memory."""
    rows, reference = [], None
    for impl in impls:
        bar.set_description(f"{label} {impl.name}")
        timing = time_calls(impl.run, problem.reset, device=device, runs=runs, warmup=3)
        problem.reset()
        result = impl.run()
        reference = result if reference is None else reference
        floor_ms = workloads.floor_bytes(problem, impl, result[1]) / bandwidth * 1e3
        rows.append({
            "impl": impl.name, "kind": impl.kind, "mode": impl.mode,
            "median_ms": timing.median_ms, "min_ms": timing.min_ms, "host_ms": timing.host_ms,
            "runs": timing.runs, "floor_ms": floor_ms,
            "time_over_floor": timing.median_ms / floor_ms,
            "bit_exact": bool(workloads.check_against(problem, result, reference)),
            **_memory(device, impl, problem),
        })
        bar.update(1)
    return rows


def run(opts: Options) -> dict:
    import torch

    device, threads, runs = start(opts, opts.readme, "bench")
    shapes = workloads.QUICK if opts.quick else workloads.FULL

    def dtypes_of(workload: str) -> list:
        names = opts.dtypes or ((workloads.DTYPE[workload],) if device == "cuda"
                                else (workloads.DTYPE[workload], "float32"))
        return [getattr(torch, name) for name in names]

    bandwidth = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 28), runs=10)

    per_problem = 4 if device == "cpu" else 3
    bar = _progress(sum(len(dtypes_of(w)) for w in opts.workloads) * per_problem)
    rows = []
    for name in opts.workloads:
        for dtype in dtypes_of(name):
            problem = workloads.Problem(shapes[name], dtype, device,
                                        flush_bytes=QUICK_FLUSH if opts.quick else FLUSH)
            impls = [workloads.torch_baseline(problem)]
            if device == "cpu":
                impls.append(workloads.numpy_baseline(problem))
            impls += [workloads.ours(problem, "swap", threads), workloads.ours(problem, "move", threads)]
            dtype_name = str(dtype).replace("torch.", "")
            for row in measure(problem, impls, device, runs, bandwidth, bar, f"{name} {dtype_name}"):
                rows.append({"workload": name, "dtype": dtype_name, **row})
            del problem
    bar.close()
    report.add_speedups(rows)
    data = {"machine": _machine(device, threads, bandwidth), "quick": opts.quick,
            "workloads": {w: workloads.DESCRIPTION[w] for w in opts.workloads}, "results": rows}
    print(report.table(data))
    paths = report.write(data, opts.out, plot=opts.plot)
    for path in paths:
        print(f"wrote {path}")
    if opts.readme:
        report.update_readme(opts.readme, data)
        print(f"updated {opts.readme}")
    if not all(r["bit_exact"] for r in rows):
        raise SystemExit("a result did not match its baseline bit for bit")
    return data
