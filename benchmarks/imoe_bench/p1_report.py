"""Workload P1's table (benchmarks/p1_experts.py's JSON): the experts forward
alone, per MoE shape and token count, the library's default beside
transformers' grouped_mm and vLLM's fused_moe, against the floor.

    python benchmarks/p1_experts.py --doc docs/moe.md --from-json benchmarks/results/p1-cuda.json
"""

from __future__ import annotations

from . import report

SECTION = "bench:p1"
DEFAULT = "idempotent"


def _us(impl: dict | None) -> str:
    return "" if impl is None else f"{impl['device_ms'] * 1e3:,.1f}"


def _ratio(a: dict | None, b: dict | None) -> str:
    return "" if a is None or b is None else f"{a['device_ms'] / b['device_ms']:.2f}"


def markdown_table(result: dict) -> str:
    """One row per (shape, T): the floor and each implementation's device
    time (us, median over interleaved rounds), the default over the floor
    and over vLLM (its alignment in torch, and its kernel alone with the
    alignment done outside the timed call), the default's host-inclusive
    time, and the default's and grouped_mm's largest error against the
    experts in fp32; then the run's machine, versions and commit."""
    head = ("| shape | T | floor us | default us | x floor | grouped_mm us | vLLM us "
            "| vLLM kernel alone us | default / vLLM | default / vLLM kernel | default host-incl. us "
            "| max err default / grouped_mm |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in result["rows"]:
        impls = row["impls"]
        ours, mm = impls.get(DEFAULT), impls.get("grouped_mm")
        vllm, pre = impls.get("vllm_fused_moe"), impls.get("vllm_fused_moe_prealigned")
        floor = row["floor_ms"]
        lines.append(
            f"| {row['shape']} | {row['tokens']:,} | {floor * 1e3:,.1f} | {_us(ours)} | "
            f"{ours['device_ms'] / floor:.2f} | {_us(mm)} | {_us(vllm)} | {_us(pre)} | "
            f"{_ratio(ours, vllm)} | {_ratio(ours, pre)} | {ours['host_inclusive_ms'] * 1e3:,.1f} | "
            f"{ours['max_abs_err']:.1e} / {mm['max_abs_err']:.1e} |")
    env = result["env"]
    vllm_info = result.get("vllm") or {}
    tuned = sum(1 for r in result["rows"]
                if str((r.get("vllm_config") or {}).get("source", "")).startswith("tuned"))
    peer = (f"vLLM {vllm_info.get('vllm_commit') or 'checkout'}'s fused_moe_kernel (Triton "
            f"{env.get('triton')}), its tuned config in {tuned} of {len(result['rows'])} rows"
            if vllm_info else "no vLLM")
    lines.append("")
    lines.append(f"{env.get('gpu_name') or env.get('device')}; torch {env['torch']}; "
                 f"transformers {env['transformers']}; {result['dtype']}; {peer}; "
                 f"commit {env.get('commit')}; {env['date']}")
    return "\n".join(lines)


def update_doc(path: str, result: dict) -> None:
    report.replace_section(path, SECTION, lambda: markdown_table(result))


def doc_from_json(path: str, json_path: str) -> None:
    update_doc(path, report.read_json(json_path))
