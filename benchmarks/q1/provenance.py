"""What a Q1 result records of where it ran: package versions, the commit
(and whether the tree had changes), the machine. Either environment."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout: benchmarks/q1/ is two levels down


def version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def git_commit() -> dict:
    """The commit the measurement ran at, and whether the tree had changes."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except OSError:
        return {"commit": None, "dirty": None}


def machine(device: torch.device) -> dict:
    """The CPU (and GPU), the threads and affinity, the versions and the commit."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    gpu = {}
    if device.type == "cuda":
        gpu = {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return {"cpu": cpu, "cpu_affinity": affinity, "threads": torch.get_num_threads(), **gpu,
            "torch": torch.__version__, "transformers": version("transformers"),
            "python": platform.python_version(), **git_commit()}
