"""CPU calls under contention: W1 and W2 (docs/results.md#workloads) with one core busy.

A busy core is another process spinning (`while True: pass`), started for the
loaded half of every round and stopped after it, optionally pinned to one CPU.
Each round runs every case unloaded, then loaded; within each half every
build (this checkout, and any other given with --build) runs in its own
process, in alternating order, and each case interleaves one thread with the
default thread count. The inputs are restored before every call, by a NumPy
copy on the calling thread or by torch's copy_ (which wakes torch's own
thread pool, as the ops around a call in a model do). The figure of merit is
the loaded time with the default threads over the unloaded time with one
thread, per build (the goal: at most 2.5). Every timed call is checked
against a NumPy reference (the kept set, the indices and the kept rows, bit
for bit). Medians over all rounds; the machine's load average is recorded
with every half round, because other people use the machine too.

    python benchmarks/scripts/cpu_contention.py [--rounds 7] [--reps 5] [--pin CPU]
        [--workloads W1,W2] [--resets numpy,torch] [--build LABEL=PYTHONPATH ...]
        [--out imoe-results/cpu-contention.json]
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

RESETS = ("numpy", "torch")


def make_w1(rng):
    x = rng.standard_normal((8, 4096, 1024), dtype=np.float32).astype(np.float16)
    s = rng.random((8, 4096), dtype=np.float32)
    return {"buffers": [x], "scores": s, "capacity": 2048, "prefix": 0,
            "shape": "tokens [8, 4096, 1024] fp16, scores [8, 4096] fp32, C = 2048"}


def make_w2(rng):
    k = rng.standard_normal((1, 32, 8192, 128), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((1, 32, 8192, 128), dtype=np.float32).astype(np.float16)
    s = rng.random((1, 32, 8192), dtype=np.float32)
    return {"buffers": [k, v], "scores": s, "capacity": 4096, "prefix": 4,
            "shape": "K and V [1, 32, 8192, 128] fp16, scores [1, 32, 8192] fp32, "
                     "keep 4096 with 4 sinks"}


WORKLOADS = {"W1": make_w1, "W2": make_w2}


def reference(case):
    """The kept slots of each row, sorted: the prefix, then the top (C - P)
    of the other slots, ties to the lower index."""
    s, c, p = case["scores"], case["capacity"], case["prefix"]
    flat = s.reshape(-1, s.shape[-1])
    top = np.argsort(-flat[:, p:], axis=1, kind="stable")[:, : c - p] + p
    prefix = np.broadcast_to(np.arange(p), (flat.shape[0], p))
    return np.sort(np.concatenate([prefix, top], axis=1), axis=1)


class Case:
    """One workload's inputs, a working copy the calls modify, and its check."""

    def __init__(self, name, case):
        import torch

        self.name = name
        self.case = case
        self.originals = case["buffers"]
        self.work = [b.copy() for b in self.originals]
        self.kept = reference(case)
        self.torch_work = [torch.from_numpy(b) for b in self.work]
        self.torch_originals = [torch.from_numpy(b) for b in self.originals]
        self.scores = torch.from_numpy(case["scores"])

    def reset(self, how):
        if how == "torch":
            for w, o in zip(self.torch_work, self.torch_originals):
                w.copy_(o)
        else:
            for w, o in zip(self.work, self.originals):
                np.copyto(w, o)

    def call(self, threads):
        import idempotent_moe as imoe

        x = self.torch_work if len(self.torch_work) > 1 else self.torch_work[0]
        return imoe.compact_(x, self.scores, self.case["capacity"],
                             protected_prefix=self.case["prefix"], num_threads=threads)

    def check(self, result):
        c = self.case["capacity"]
        idx = np.asarray(result.indices).reshape(self.kept.shape[0], c)
        if not np.array_equal(np.sort(idx, axis=1), self.kept):
            return False
        for w, o in zip(self.work, self.originals):
            n, row = o.shape[-2], o.shape[-1]
            want = np.take_along_axis(o.reshape(-1, n, row), idx[:, :, None], axis=1)
            got = w.reshape(-1, n, row)[:, :c]
            if not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
                return False
        return True


def time_calls(case, threads, reps, reset):
    """reps timed calls, each on freshly restored inputs and checked."""
    times, ok = [], True
    case.reset(reset)
    case.call(threads)  # warm-up: pages, caches, the thread pool
    for _ in range(reps):
        case.reset(reset)
        t0 = time.perf_counter()
        res = case.call(threads)
        times.append((time.perf_counter() - t0) * 1e3)
        ok = ok and case.check(res)
    return times, ok


def worker(opts):
    """One pass over the cases in this process' build: prints JSON samples."""
    import idempotent_moe

    rng = np.random.default_rng(0)
    out = {"module": os.path.dirname(idempotent_moe.__file__), "samples": []}
    for name in opts.workloads.split(","):
        case = Case(name, WORKLOADS[name](rng))
        for reset in opts.resets.split(","):
            # threads: 1, and 0 = the library's default; A B B A over rounds
            for threads in ((1, 0) if opts.first_threads == 1 else (0, 1)):
                times, ok = time_calls(case, threads, opts.reps, reset)
                out["samples"].append({"workload": name, "reset": reset, "threads": threads,
                                       "times_ms": times, "correct": ok})
    print(json.dumps(out))


def start_load(pin):
    def pin_child():
        if pin is not None:
            os.sched_setaffinity(0, {pin})

    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin_child)
    time.sleep(0.3)  # let it start spinning
    return proc


def run_worker(opts, path, first_threads):
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--workloads", opts.workloads,
           "--resets", opts.resets, "--reps", str(opts.reps), "--first-threads", str(first_threads)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def default_threads():
    """The thread count of a default call: OpenMP's, capped by the affinity."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        omp = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        omp = os.cpu_count()
    return min(cpus, omp)


def summarize(samples, shapes):
    """Rows of medians from {(workload, reset, load, threads): ([ms], ok)}."""
    rows = []
    for (w, reset, load, t), (ts, ok) in sorted(samples.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2] == "loaded", kv[0][3] == 0)):
        base = statistics.median(samples[(w, reset, "unloaded", 1)][0])
        med = statistics.median(ts)
        rows.append({
            "workload": w, "shape": shapes[w], "reset": reset, "load": load,
            "threads": t if t else f"default ({default_threads()})",
            "median_ms": round(med, 3), "min_ms": round(min(ts), 3), "max_ms": round(max(ts), 3),
            "calls": len(ts), "over_unloaded_1_thread": round(med / base, 2), "correct": ok,
        })
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pin", type=int, default=None, help="pin the busy process to this CPU")
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--resets", default="numpy,torch",
                    help="what restores the inputs before each call: numpy, torch or both")
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=PYTHONPATH",
                    help="another build of idempotent_moe to measure beside this one")
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--first-threads", type=int, default=1, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.worker:
        return worker(opts)
    if set(opts.resets.split(",")) - set(RESETS):
        ap.error(f"--resets takes {', '.join(RESETS)}")

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    builds = [("this checkout", os.path.normpath(here))]
    for spec in opts.build:
        label, _, path = spec.partition("=")
        if not path:
            ap.error("--build takes LABEL=PYTHONPATH")
        builds.append((label, path))
    samples = {label: {} for label, _ in builds}
    modules, loadavg = {}, []
    for r in range(opts.rounds):
        for load in ("unloaded", "loaded"):
            proc = start_load(opts.pin) if load == "loaded" else None
            try:
                loadavg.append({"round": r, "load": load, "loadavg_1min": os.getloadavg()[0]})
                order = builds if r % 2 == 0 else builds[::-1]
                for i, (label, path) in enumerate(order):
                    got = run_worker(opts, path, 1 if (r + i) % 2 == 0 else 0)
                    modules[label] = got["module"]
                    for s in got["samples"]:
                        key = (s["workload"], s["reset"], load, s["threads"])
                        ts, ok = samples[label].get(key, ([], True))
                        samples[label][key] = (ts + s["times_ms"], ok and s["correct"])
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
        print(f"round {r + 1}/{opts.rounds} done", file=sys.stderr)

    shapes = {w: WORKLOADS[w](np.random.default_rng(0))["shape"] for w in
              opts.workloads.split(",")}
    results, ok = {}, True
    for label, _ in builds:
        rows = summarize(samples[label], shapes)
        results[label] = {"module": modules[label], "rows": rows}
        ok = ok and all(row["correct"] for row in rows)
        print(f"== {label} ({modules[label]})")
        for row in rows:
            print(f"{row['workload']}  reset {row['reset']:5s}  {row['load']:8s}  threads "
                  f"{str(row['threads']):11s}  median {row['median_ms']:7.2f} ms  "
                  f"min {row['min_ms']:7.2f}  x{row['over_unloaded_1_thread']:.2f} of unloaded "
                  f"1 thread  {'ok' if row['correct'] else 'WRONG'}")

    if opts.out:
        doc = {
            "benchmark": "benchmarks/scripts/cpu_contention.py",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{len(os.sched_getaffinity(0))} in this process' affinity; shared",
            "python": platform.python_version(), "numpy": np.__version__,
            "rounds": opts.rounds, "reps_per_round": opts.reps,
            "busy_process": "python -c 'while True: pass'"
                            + (f", pinned to CPU {opts.pin}" if opts.pin is not None
                               else ", not pinned"),
            "goal": "loaded, default threads: at most 2.5x the unloaded 1-thread median",
            "builds": results, "loadavg": loadavg,
        }
        with open(opts.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
