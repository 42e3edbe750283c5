"""The benchmarks of idempotent_moe beside their baselines: the workloads of
docs/results.md#workloads, their timers, JSON, plots and the tables of README.md and docs/
(needs torch; matplotlib for the plots, tqdm for the progress bar,
transformers for W4 and the models). Entry point: `python -m imoe_bench`."""

from .runner import Options, run

__all__ = ["Options", "run"]
