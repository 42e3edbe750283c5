"""Benchmarks of idempotent_moe beside their baselines (needs torch; matplotlib
for the plot, tqdm for the progress bar). Entry point: `python -m idempotent_moe bench`."""

from .runner import Options, run

__all__ = ["Options", "run"]
