"""Timers: CUDA events on the GPU, perf_counter on the CPU. Every timed call
gets freshly restored inputs from an untimed `reset`, so an in-place operation
never sees its own output."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Timing:
    median_ms: float      # device time (CUDA events), or wall time on the CPU
    min_ms: float
    runs: int
    host_ms: float        # median wall time of the call on the host (launch cost on a GPU)


# Cycles of GPU spin enqueued before each timed GPU call (about 0.5 ms on an
# H200): the host's launch work then overlaps it, as it does in a pipelined
# model, and the events time the device work. host_ms reports the launch cost.
BUSY_CYCLES = 1_000_000


def time_calls(
    fn: Callable[[], object],
    reset: Callable[[], object],
    *,
    device: str,
    runs: int,
    warmup: int,
    busy_cycles: int = BUSY_CYCLES,
) -> Timing:
    """Median and min of `runs` timed calls of fn, each after an untimed reset.
    On a GPU, `busy_cycles` of spin come first: more than the host needs to
    launch fn, so that the events time the device work alone."""
    import torch

    for _ in range(warmup):
        reset()
        fn()
    samples, host = [], []
    if device == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(runs):
            reset()
            torch.cuda._sleep(busy_cycles)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
    else:
        for _ in range(runs):
            reset()
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        host = samples
    return Timing(statistics.median(samples), min(samples), runs, statistics.median(host))


def interleaved_cuda(impls: dict, rounds: int, before: Callable[[], object] | None = None,
                     host_calls: int = 50) -> dict:
    """name -> (median device ms, host ms per call) of zero-argument CUDA
    calls timed side by side: three untimed calls each, then `rounds` rounds
    that call every implementation once, in reverse order every other round,
    each after `before` (untimed; e.g. an L2 flush) and BUSY_CYCLES of spin,
    between CUDA events; then `host_calls` calls of each back to back with no
    synchronisation (the host's time per call, the queue's drain left out)."""
    import torch

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = {name: [] for name in impls}
    for fn in impls.values():
        for _ in range(3):
            fn()
    for r in range(rounds):
        order = list(impls.items()) if r % 2 == 0 else list(reversed(impls.items()))
        for name, fn in order:
            if before is not None:
                before()
            torch.cuda._sleep(BUSY_CYCLES)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples[name].append(start.elapsed_time(stop))
    host = {}
    for name, fn in impls.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(host_calls):
            fn()
        host[name] = (time.perf_counter() - t0) / host_calls * 1e3
        torch.cuda.synchronize()
    return {name: (statistics.median(s), host[name]) for name, s in samples.items()}


def cuda_memory(fn: Callable[[], object]) -> tuple:
    """(fn's result, fields): the peak bytes one call of fn allocates beyond
    what was allocated before it, and the caching allocator's reserved pool
    before and after, on the current CUDA device."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    reserved_before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return result, {"peak_allocated_bytes": int(peak), "reserved_before_bytes": int(reserved_before),
                    "reserved_after_bytes": int(torch.cuda.memory_reserved())}


def copy_bandwidth(device: str, nbytes: int, runs: int) -> float:
    """Bytes read plus bytes written per second by a plain device copy of
    `nbytes`: the bandwidth the floors are computed from."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    timing = time_calls(lambda: dst.copy_(src), lambda: None, device=device, runs=runs, warmup=3)
    return 2 * nbytes / (timing.median_ms * 1e-3)
