"""Q1: what KV eviction costs in quality, on a real trained model.

The command line of the q1 package (q1/cli_quality.py; the measurement's
definition: q1/quality.py). kvpress's half runs in its own environment with
`--kvpress-run` and imports nothing of idempotent_moe.

    python benchmarks/q1_kv_quality.py --out q1.json            # the library
    python benchmarks/q1_kv_quality.py --quick --out q.json     # seconds: a tiny random model
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, the q1 package's folder
from q1.cli_quality import main  # noqa: E402

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    sys.exit(main())
