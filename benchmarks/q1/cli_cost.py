"""Q1, scoring cost: what each KV policy's eviction costs in time, against kvpress's presses.

The command line of `benchmarks/q1_kv_cost.py`: the measurement (cost.py,
which defines it; cost_memory.py for `--settings memory`) with the
library's half (cost_library.py) or, in kvpress's own environment
(transformers < 5.3), kvpress's (`--kvpress-run`, cost_kvpress.py: this
module imports the library's half only when it runs it); `--kvpress-json
kv.json` merges kvpress's JSON into --out, `--tables` prints the tables of
docs/kv.md (cost_report.py). `--random-weights` builds SmolLM2-135M's
architecture (data.SMOLLM2_135M) with seeded random weights and feeds
seeded pseudo-random token ids of the same length, where the GGUF file (and
its tokenizer) is not at hand: the times do not depend on the weights or
ids. `--prompt-len` sets the prefill prompt (2,048 by default; the decode
setting's prompt stays 1,024 tokens); past SmolLM2's 8,192 positions it
needs `--random-weights`, whose config then extends
`max_position_embeddings` to the prompt.

    taskset -c 1 python benchmarks/q1_kv_cost.py --out cost.json          # the library
    taskset -c 1 .../venv-kvpress/bin/python benchmarks/q1_kv_cost.py --kvpress-run --out kv.json
    python benchmarks/q1_kv_cost.py --out cost.json --kvpress-json kv.json  # merge
    python benchmarks/q1_kv_cost.py --quick --out q.json                   # seconds: a tiny model
    python benchmarks/q1_kv_cost.py --device cuda --random-weights --prompt-len 8192 --out gpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from .cost import TIMERS, run_rounds
from .cost_memory import memory_run
from .cost_report import dumps, markdown_tables, merge
from .data import GGUF, SMOLLM2_135M, documents, load_model, random_ids, random_model
from .provenance import machine, version
from .steps import log

BUDGETS = (256, 1024)
CONTEXT, EVICT_EVERY = 1024, 64
LIB_POLICIES = ("streaming_llm", "knorm", "keydiff", "tova", "observed_attention", "snapkv",
                "expected_attention", "auto")
KVPRESS_PRESSES = ("StreamingLLMPress", "KnormPress", "KeyDiffPress", "TOVAPress",
                   "ObservedAttentionPress", "SnapKVPress", "ExpectedAttentionPress")
MEMORY_POLICY = {"library": "snapkv", "kvpress": "SnapKVPress"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="a tiny random model and short inputs: seconds")
    p.add_argument("--settings", default="prefill,decode,memory")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--policies", default=",".join(LIB_POLICIES))
    p.add_argument("--kvpress-run", action="store_true", help="run kvpress (in its own environment)")
    p.add_argument("--kvpress-presses", default=",".join(KVPRESS_PRESSES))
    p.add_argument("--kvpress-json", help="kvpress's JSON to merge into --out")
    p.add_argument("--tables", action="store_true", help="print the markdown tables of --out and exit")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="float32 on the CPU, bfloat16 on cuda unless given")
    p.add_argument("--random-weights", action="store_true",
                   help="SmolLM2-135M's architecture with random weights, pseudo-random token ids")
    p.add_argument("--prompt-len", type=int, default=2048, help="the prefill prompt's tokens")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.tables:
        print(markdown_tables(json.loads(out.read_text())), end="")
        return 0
    if args.kvpress_json:
        out.write_text(dumps(merge(json.loads(out.read_text()),
                                   json.loads(Path(args.kvpress_json).read_text()))))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    positions = SMOLLM2_135M["max_position_embeddings"]
    if args.prompt_len > positions and not (args.quick or args.random_weights):
        p.error(f"--prompt-len past SmolLM2's {positions} positions needs --random-weights")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    TIMERS.sync = torch.cuda.synchronize if device.type == "cuda" else None
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    prompt, context, steps = args.prompt_len, CONTEXT, EVICT_EVERY
    if args.quick:
        prompt, context, steps = 192, 96, 8
        budgets = [16, 64]
    if args.kvpress_run:
        from . import cost_kvpress

        lib, prefill, decode = "kvpress", cost_kvpress.kv_prefill, cost_kvpress.kv_decode
    else:  # the library's half, imported here only: the kvpress environment lacks idempotent_moe
        from . import cost_library

        cost_library.wrap_library()
        lib, prefill, decode = "library", cost_library.lib_prefill, cost_library.lib_decode
    n_ids = max(prompt, context + 2 * steps)  # the decode setting reads past its prompt
    if args.random_weights and not args.quick:
        model = random_model(prompt, device, dtype)
        ids = random_ids(n_ids, SMOLLM2_135M["vocab_size"])
        name = "SmolLM2-135M-Instruct's architecture, random weights (seed 0)"
    else:
        model, tok = load_model(args.quick, device)
        model = model.to(dtype)
        ids = next(iter(documents(tok, args.quick, n_ids).values()))
        name = "random tiny Llama" if args.quick else f"SmolLM2-135M-Instruct ({GGUF})"
    ids_t = torch.tensor([ids], device=device)
    settings = args.settings.split(",")
    result = {"measurement": "Q1 scoring cost", "model": name, "quick": args.quick,
              "random_weights": args.quick or args.random_weights,
              "dtype": str(dtype).replace("torch.", ""), "device": device.type, "budgets": budgets,
              "prompt_tokens": prompt, "context_tokens": context, "evict_every": steps,
              "rounds": args.rounds, "settings": settings,
              "tokens_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(device)}
    if lib == "library" and device.type == "cuda":
        import idempotent_moe

        result["machine"]["idempotent_moe_cuda"] = idempotent_moe.cuda_available()
    if lib == "kvpress":
        import kvpress

        result["kvpress_version"] = getattr(kvpress, "__version__", None) or version("kvpress")
        policies = args.kvpress_presses.split(",")
    else:
        policies = args.policies.split(",")
    def checkpoint(rows):  # the rows so far, marked partial, replacing --out whole
        write_atomically(out, dumps({**result, "rows": rows, "partial": True}))

    result["rows"] = run_rounds(lib, prefill, decode, model, ids_t, budgets, policies, settings, args.rounds,
                                prompt, context, steps, log, checkpoint)
    if "memory" in settings:
        pol = MEMORY_POLICY[lib] if not args.quick or lib == "kvpress" else "snapkv"
        result["memory"] = [memory_run(model, ids_t[:, :prompt], lib, "full", None)]
        result["memory"] += [memory_run(model, ids_t[:, :prompt], lib, pol, b) for b in budgets]
        log(f"memory: {result['memory']}")
    TIMERS.unwrap()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_atomically(out, dumps(result))
    return 0


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a file beside it and a rename: a reader (or
    a run stopped mid-write) sees the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

