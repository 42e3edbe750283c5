"""benchmarks/p1_experts.py (workload P1) in its CPU quick mode, and the parts
of the vLLM peer loader that need no GPU: the block alignment, the AST
extraction and the config functions. (The kernel itself runs in Triton's CPU
interpreter when triton is installed and VLLM_PATH names a vLLM checkout.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _helpers import ROOT, package_env  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "p1_experts.py")
LOADER = os.path.join(ROOT, "benchmarks", "peers", "vllm_fused_moe.py")
IMPLS = {"grouped_mm", "idempotent", "idempotent_grouped_mm", "idempotent_small_m", "idempotent_experts_gemm"}


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def loader():
    return _module(LOADER, "p1_vllm_fused_moe")


def _run(args, cwd):
    env = dict(package_env(), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def test_quick_mode_writes_every_figure(tmp_path):
    out = tmp_path / "res" / "p1-cpu.json"
    proc = _run(["--quick", "--out", str(out), "--tokens", "1,8", "--rounds", "2"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["workload"] == "P1" and r["quick"] is True and r["dtype"] == "bfloat16" and r["vllm"] is None
    for key in ("date", "torch", "transformers", "triton", "gpu_name", "driver", "commit", "device"):
        assert key in r["env"]
    assert r["env"]["device"] == "cpu" and r["env"]["torch"] == torch.__version__
    assert r["rates"]["copy_bandwidth_Bps"] > 0 and r["rates"]["bf16_matmul_flops"] > 0
    assert r["settings"]["rounds"] == 2
    assert [(row["shape"], row["tokens"]) for row in r["rows"]] == [
        (s, t) for s in ("tiny-mixtral", "tiny-qwen3") for t in (1, 8)]
    for row in r["rows"]:
        h, i, e, k, t = row["hidden"], row["intermediate"], row["experts"], row["top_k"], row["tokens"]
        assert 1 <= row["active_experts"] <= min(e, t * k)
        assert row["flops"] == 2 * t * k * 3 * h * i
        assert row["weight_bytes"] == row["active_experts"] * 3 * h * i * 2
        assert row["floor_ms"] == max(row["floor_bw_ms"], row["floor_flop_ms"]) > 0
        bandwidth = r["rates"]["copy_bandwidth_Bps"]
        assert row["floor_bw_ms"] == pytest.approx(row["weight_bytes"] / bandwidth * 1e3)
        assert set(row["impls"]) == IMPLS
        for name, m in row["impls"].items():
            assert len(m["device_ms_rounds"]) == 2 and m["device_ms"] > 0 and m["host_inclusive_ms"] > 0
            assert m["device_ms_min"] <= m["device_ms"] and m["host_enqueue_ms"] > 0 and m["calls"] >= 3
            assert m["device_over_floor"] == pytest.approx(m["device_ms"] / row["floor_ms"])
            assert m["queue_filled"] is None  # no device: nothing queued
            # bf16 experts against the fp32 reference of the same routing: a few bf16 ulps, not more
            assert 0 < m["max_abs_ref"] and m["rel_err"] < 2e-2, name
            assert m["max_abs_err"] < 0.05 * m["max_abs_ref"], name
    if importlib.util.find_spec("matplotlib") is not None:
        assert r["plot"] == str(out.with_suffix(".png")) and out.with_suffix(".png").stat().st_size > 0


def test_the_table_goes_into_a_document_and_is_its_json(tmp_path):
    """--doc writes P1's table into the document's bench:p1 section after a
    run; --doc with --from-json renders the same table from the JSON alone
    (what the committed docs are checked against); the text around the
    section is kept."""
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- bench:p1 -->\nold\n<!-- /bench:p1 -->\nafter\n")
    out = tmp_path / "p1.json"
    proc = _run(["--quick", "--out", str(out), "--tokens", "1,8", "--rounds", "1", "--doc", str(doc)],
                cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert text.startswith("before\n<!-- bench:p1 -->\n| shape | T |")
    assert text.endswith("<!-- /bench:p1 -->\nafter\n")
    assert "old" not in text
    result = json.loads(out.read_text())
    table = text.split("<!-- bench:p1 -->\n")[1].split("\n<!-- /bench:p1 -->")[0]
    body = [line for line in table.splitlines() if line.startswith("| tiny")]
    assert len(body) == len(result["rows"]) == 4
    first = result["rows"][0]["impls"]["idempotent"]
    assert f"| {first['device_ms'] * 1e3:,.1f} |" in body[0]
    assert "no vLLM" in table and str(result["env"]["commit"]) in table
    doc.write_text("before\n<!-- bench:p1 -->\nstale\n<!-- /bench:p1 -->\nafter\n")
    script = _module(SCRIPT, "p1_experts_doc")
    assert script.main(["--doc", str(doc), "--from-json", str(out)]) == 0
    assert doc.read_text() == text


def test_a_run_cut_short_keeps_its_rows(tmp_path):
    """The JSON is rewritten after every row: a run stopped in its second
    row (a time limit) leaves the first on disk, whole."""
    script = _module(SCRIPT, "p1_experts_cut")
    out = tmp_path / "p1.json"
    real, calls = script.one_row, []

    def one_row(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    script.one_row = one_row
    with pytest.raises(KeyboardInterrupt):
        script.main(["--quick", "--out", str(out), "--tokens", "1,8", "--rounds", "1",
                     "--shapes", "tiny-qwen3"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["tokens"]) for r in rows] == [("tiny-qwen3", 1)]
    assert not os.path.exists(str(out) + ".tmp")


def test_bad_arguments_are_refused(tmp_path, capsys):
    script = _module(SCRIPT, "p1_experts_script")
    out = str(tmp_path / "x.json")
    with pytest.raises(SystemExit) as exc:
        script.main(["--quick", "--out", out, "--rounds", "0"])
    assert exc.value.code == 2 and "--rounds" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown shapes"):
        script.main(["--quick", "--out", out, "--shapes", "nope"])
    with pytest.raises(SystemExit, match="--vllm-path"):
        script.main(["--quick", "--out", out, "--vllm-path", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        script.main(["--from-json", out])
    assert exc.value.code == 2 and "--doc" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        script.main(["--quick"])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def _aligned_by_loop(topk_ids, block_size, num_experts):
    flat = topk_ids.reshape(-1).tolist()
    pad = len(flat)
    ids, experts = [], []
    for e in range(num_experts):
        mine = [i for i, v in enumerate(flat) if v == e]
        if mine:
            padded = -(-len(mine) // block_size) * block_size
            ids += mine + [pad] * (padded - len(mine))
            experts += [e] * (padded // block_size)
    return ids, experts


@pytest.mark.parametrize("tokens,experts,top_k,block", [(1, 8, 2, 16), (7, 8, 2, 16), (33, 128, 8, 16),
                                                         (100, 8, 2, 64), (3, 64, 8, 32), (0, 8, 2, 16)])
def test_moe_align_block_size_has_vllms_semantics(loader, tokens, experts, top_k, block):
    g = torch.Generator().manual_seed(tokens * 7 + experts)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    sorted_ids, expert_ids, total = loader.moe_align_block_size(ids, block, experts)
    want_ids, want_experts = _aligned_by_loop(ids, block, experts)
    numel = tokens * top_k
    size = numel + experts * (block - 1)
    if numel < experts:
        size = min(size, numel * block)
    assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32
    assert sorted_ids.numel() == size and expert_ids.numel() == -(-size // block)
    assert total.tolist() == [len(want_ids)]
    assert sorted_ids[: len(want_ids)].tolist() == want_ids
    assert (sorted_ids[len(want_ids):] == numel).all()
    assert expert_ids[: len(want_experts)].tolist() == want_experts


SOURCE = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def inner(x):
        return x + 1

    @triton.jit
    def helper(x):
        return inner(x) * 2

    @triton.jit
    def unrelated(x):
        return x

    def get_default_config(M: int, E: int, N: int, K: int, topk: int, dtype: str | None,
                           block_shape: list[int] | None = None) -> dict[str, int]:
        if vllm_is_batch_invariant():
            return {"BLOCK_SIZE_M": 1}
        return {"BLOCK_SIZE_M": 16 if M <= E else 64}

    @triton.jit
    def fused_moe_kernel(a_ptr, N, K: tl.constexpr, BLOCK_SIZE_M: tl.constexpr):
        pid = tl.program_id(axis=0)
        y = helper(pid)
''')


def test_kernel_extraction_takes_the_kernel_and_the_jit_helpers_it_calls(loader):
    source, order, params = loader.extract_kernel_source(SOURCE)
    assert order == ["inner", "helper", "fused_moe_kernel"]
    assert params == ["a_ptr", "N", "K", "BLOCK_SIZE_M"]
    assert "def unrelated" not in source and "def get_default_config" not in source
    assert source.startswith("import triton\n")
    compile(source, "extract", "exec")
    with pytest.raises(ValueError, match="no @triton.jit function"):
        loader.extract_kernel_source(SOURCE, "get_default_config")


def test_config_functions_run_with_the_platform_stubbed(loader):
    fns = loader.extract_plain_functions(SOURCE, ("get_default_config",))
    assert fns["get_default_config"](4, 8, 768, 2048, 8, None) == {"BLOCK_SIZE_M": 16}
    assert fns["get_default_config"](512, 8, 768, 2048, 8, None) == {"BLOCK_SIZE_M": 64}
    with pytest.raises(ValueError, match="no function"):
        loader.extract_plain_functions(SOURCE, ("try_get_optimal_moe_config",))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or not os.environ.get("VLLM_PATH"),
                    reason="needs triton and VLLM_PATH, a vLLM checkout")
def test_vllm_kernel_in_the_triton_interpreter_matches_the_experts_in_fp64(loader):
    code = textwrap.dedent(f'''
        import importlib.util, torch
        spec = importlib.util.spec_from_file_location("peer", {LOADER!r})
        peer_mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(peer_mod)
        peer = peer_mod.VllmFusedMoe({os.environ["VLLM_PATH"]!r})
        g = torch.Generator().manual_seed(0)
        T, E, k, H, I = 20, 8, 2, 48, 40
        x = torch.randn(T, H, generator=g).half()
        w1 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).half()
        w2 = (torch.randn(E, H, I, generator=g) * 0.2).half()
        ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
        w = torch.softmax(torch.randn(T, k, generator=g), -1)
        cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=4)
        out = peer.forward(x, w1, w2, w, ids, cfg).double()
        ref = torch.zeros(T, H, dtype=torch.float64)
        for t in range(T):
            for j in range(k):
                e = ids[t, j]
                h = w1[e].double() @ x[t].double()
                ref[t] += w[t, j].double() * (w2[e].double() @ (torch.nn.functional.silu(h[:I]) * h[I:]))
        print(float((out - ref).abs().max() / ref.abs().max()))
    ''')
    env = dict(package_env(), TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1]) < 2e-3
