"""`python -m idempotent_moe`: the self-check passes on this build and says
what it checked; `--version` prints the version; a bad flag is an error."""

import subprocess
import sys

import idempotent_moe
from _helpers import package_env


def _run(*args):
    return subprocess.run([sys.executable, "-m", "idempotent_moe", *args], env=package_env(),
                          capture_output=True, text=True, timeout=120)


def test_self_check_passes_and_reports():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"idempotent_moe {idempotent_moe.__version__}"
    compiled = "compiled" if idempotent_moe.cuda_compiled() else "not compiled"
    assert lines[1] == f"build: native part loaded, CUDA kernels {compiled}"
    assert lines[2].startswith(f"devices: cuda_available={idempotent_moe.cuda_available()}")
    assert any(line.startswith("parity cpu: ") and "ok" in line for line in lines)
    assert lines[-1] == "ok"


def test_parity_check_finds_a_wrong_compaction(monkeypatch):
    from idempotent_moe import __main__ as selfcheck

    assert selfcheck._parity("cpu") is None
    real = selfcheck.compact_
    monkeypatch.setattr(selfcheck, "compact_", lambda x, s, c: real(x, -s, c))  # keeps the lowest
    assert "kept slots" in selfcheck._parity("cpu")


def test_version_and_bad_flag():
    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"idempotent_moe {idempotent_moe.__version__}"
    proc = _run("--bench")
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr
