"""Q1: what KV eviction costs on a real trained model (SmolLM2-135M), in
quality and in time, the library beside kvpress. Run from a checkout by
benchmarks/q1_kv_quality.py and benchmarks/q1_kv_cost.py; never installed.

- settings.py, data.py, steps.py, provenance.py: what both measurements
  and both environments share (names, the model and inputs, a forward and
  its losses, where a run ran);
- policies.py: the library's policies and caches as Q1 runs them;
- quality.py (the library's settings), quality_kvpress.py (kvpress's),
  quality_tables.py, quality_merge.py, cli_quality.py: the quality
  measurement;
- cost.py (timers and rounds), cost_library.py, cost_kvpress.py,
  cost_memory.py, cost_report.py, cli_cost.py: the scoring cost.

kvpress runs in its own environment (transformers < 5.3) without
idempotent_moe: only policies.py, quality.py and cost_library.py import
the library at their top, and the command lines import the library and
those modules only to run the library's half."""
