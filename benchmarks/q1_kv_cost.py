"""Q1, scoring cost: what each KV policy's eviction costs in time, against kvpress's presses.

The command line of the q1 package (q1/cli_cost.py; the measurement's
definition: q1/cost.py and q1/cost_memory.py). kvpress's half runs in its
own environment with `--kvpress-run` and imports nothing of idempotent_moe.

    taskset -c 1 python benchmarks/q1_kv_cost.py --out cost.json          # the library
    taskset -c 1 .../venv-kvpress/bin/python benchmarks/q1_kv_cost.py --kvpress-run --out kv.json
    python benchmarks/q1_kv_cost.py --out cost.json --kvpress-json kv.json  # merge
    python benchmarks/q1_kv_cost.py --quick --out q.json                   # seconds: a tiny model
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, the q1 package's folder
from q1.cli_cost import main  # noqa: E402

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    sys.exit(main())
