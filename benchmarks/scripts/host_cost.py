"""H1 (docs/results.md#workloads) alone: host time per call, back to back with no
synchronisation, printed as one JSON object. The measurement lives in the
package (benchmarks/imoe_bench/hostcost.py) and runs as part of
`python -m imoe_bench model` (`--skip-m1 --skip-m2` for H1 alone, with
JSON, table and plot).

    python benchmarks/scripts/host_cost.py [--device cuda] [--calls 2000] [--rounds 5]
"""

import argparse
import json

import torch
from imoe_bench.hostcost import H1Options, run_h1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a small W1, for a smoke test")
    opts = ap.parse_args()
    print(json.dumps({"device": opts.device,
                      **run_h1(H1Options(opts.device, opts.calls, opts.rounds, opts.quick))}, indent=1))


if __name__ == "__main__":
    main()
