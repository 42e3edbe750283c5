"""What the model benchmarks (M1, M2) share: synchronisation, the clock of one
generate() call, interleaved round order, peak memory, and progress lines
with timestamps."""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from dataclasses import dataclass, field


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def log(text: str) -> None:
    """A progress line with the wall-clock time (a GPU run is budgeted in minutes)."""
    now = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{now}] {text}", file=sys.stderr, flush=True)


def round_order(names: list, round_index: int) -> list:
    """A B C, C B A, A B C, ...: every implementation runs as often early as
    late in a pair of rounds, so drift (clocks, thermals, a neighbour's load)
    favours none of them."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


class StepClock:
    """A transformers streamer that stamps the time of every put(): generate()
    puts the prompt first, then each step's new tokens once they are on the
    host (a device-to-host copy: the step has finished on the GPU; generate
    synchronises there every step anyway to test its stopping criteria).
    The first new token's stamp ends the prefill; the last one, the decode."""

    def __init__(self, device: str):
        self.device = device
        self.stamps: list = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass
class GenerateTiming:
    """One timed generate(): total, time to the first new token (prefill and
    one step), the decode steps after it, and their median step (the pace of
    a step, without the one-off costs of a call: a compiled step's CUDA
    graph recorded again for a new static cache is one slow step)."""

    total_s: float
    first_token_s: float
    decode_s: float
    decode_steps: int
    step_median_s: float


def timed_generate(device: str, generate) -> tuple:
    """(generate(streamer=clock)'s output, GenerateTiming), synchronised
    before and after."""
    clock = StepClock(device)
    sync(device)
    t0 = time.perf_counter()
    out = generate(clock)
    sync(device)
    t1 = time.perf_counter()
    # stamps[0]: the prompt (before the prefill); stamps[1]: the first new token
    if len(clock.stamps) < 2:
        raise RuntimeError("generate() streamed no new token")
    first, last = clock.stamps[1], clock.stamps[-1]
    steps = [b - a for a, b in zip(clock.stamps[1:], clock.stamps[2:])]
    return out, GenerateTiming(t1 - t0, first - t0, last - first, len(steps),
                               statistics.median(steps) if steps else float("nan"))


def compile_events() -> dict:
    """What torch.compile has done so far in this process: frames dynamo
    compiled, CUDA graphs recorded (cudagraph trees) and the seconds spent
    recording them; {} where this torch does not keep them."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
    except ImportError:
        return {}
    records = compilation_time_metrics.get("CUDAGraphNode.record", [])
    return {"frames_compiled": int(counters["frames"]["ok"]), "cudagraphs_recorded": len(records),
            "cudagraph_record_s": float(sum(records))}


def compile_events_since(before: dict) -> dict:
    """compile_events() now, less `before`."""
    now = compile_events()
    return {k: v - before.get(k, 0) for k, v in now.items()}


@dataclass
class Samples:
    """The timed rounds of one row."""

    values: dict = field(default_factory=dict)  # name -> [per round]

    def add(self, **named) -> None:
        for name, value in named.items():
            self.values.setdefault(name, []).append(value)

    def median(self, name: str) -> float:
        return statistics.median(self.values[name])

    def minimum(self, name: str) -> float:
        return min(self.values[name])


def reset_peak(device: str) -> int:
    """Reset the CUDA peak counter; the bytes allocated now (0 on the CPU)."""
    import torch

    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return int(torch.cuda.memory_allocated())


def peak_since(device: str) -> int | None:
    """torch.cuda.max_memory_allocated() since the last reset_peak (None on the CPU)."""
    import torch

    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def error_text(exc: BaseException) -> str:
    """An exception as one line for the JSON and the table."""
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}"


def attempt(row: dict, label: str, fn):
    """fn()'s result; or, when it raises, None with the error kept in
    row["error"] (the row then stops being measured; the run goes on)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded in the row, the others go on
        row["error"] = error_text(e)
        log(f"{label}: {row['error']}")
        return None
