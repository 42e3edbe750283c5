"""vLLM's Triton fused MoE experts path, driven without the vllm package.

The kernel is vLLM's (https://github.com/vllm-project/vllm, Apache-2.0):
`fused_moe_kernel` and the @triton.jit helpers it calls, from
vllm/model_executor/layers/fused_moe/fused_moe.py, and vLLM's tuned configs
from .../fused_moe/configs/. Nothing of it is shipped with this project: it is
read at run time from the vLLM checkout given as `--vllm-path`, extracted
with `ast` and compiled by the installed Triton. Importing vllm itself would
need its compiled extension (vllm._C) and most of the package.

`VllmFusedMoe.forward` runs what vLLM's `fused_experts_impl` runs for an
unquantized bf16/fp16 MoE with SiLU gating, routing given:

1. moe_align_block_size: a CUDA op in vllm._C, here `moe_align_block_size`
   below, in torch with the op's semantics (token-expert pairs sorted by
   expert, each expert's list padded to a multiple of BLOCK_SIZE_M with the
   pad id T*k, one expert id per block, the padded total);
2. the gate/up GEMM: `fused_moe_kernel`, A read through the sorted ids;
3. the activation: vLLM's silu_and_mul CUDA op, here
   `silu(x[:, :I]) * x[:, I:]` in torch;
4. the down GEMM: `fused_moe_kernel` with MUL_ROUTED_WEIGHT (top_k 1);
5. the sum over top-k: vLLM's moe_sum CUDA op, here `torch.sum(dim=1)`.

The config for T tokens is picked as vLLM's `try_get_optimal_moe_config`
does: the JSON file `get_config_file_name(E, I, None)` names (the entry whose
batch size is nearest T), else vLLM's `get_default_config`, both functions
taken from the same file.

    python -m benchmarks.peers.vllm_fused_moe --vllm-path DIR   # prints what was loaded
"""

from __future__ import annotations
import __future__ as _future

import argparse
import ast
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import types

FUSED_MOE_PY = os.path.join("vllm", "model_executor", "layers", "fused_moe", "fused_moe.py")
CONFIG_DIR = os.path.join("vllm", "model_executor", "layers", "fused_moe", "configs")
KERNEL = "fused_moe_kernel"
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _is_triton_jit(node: ast.FunctionDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
        if isinstance(target, ast.Name) and target.id == "jit":
            return True
    return False


def extract_kernel_source(source: str, name: str = KERNEL) -> tuple[str, list[str], list[str]]:
    """(module source, jit function names in order, the kernel's parameter
    names) for the @triton.jit function `name` of `source` and every
    module-level @triton.jit function it calls, transitively."""
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if name not in functions or not _is_triton_jit(functions[name]):
        raise ValueError(f"no @triton.jit function {name!r} at module level")
    needed, todo = [], [name]
    while todo:
        fn = todo.pop()
        if fn in needed:
            continue
        needed.append(fn)
        for node in ast.walk(functions[fn]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                callee = functions.get(node.func.id)
                if callee is not None and _is_triton_jit(callee) and callee.name not in needed:
                    todo.append(callee.name)
    order = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in needed]
    lines = source.splitlines()
    parts = ["import triton", "import triton.language as tl", ""]
    for fn in order:
        node = functions[fn]
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        parts.append("\n".join(lines[start:node.end_lineno]))
        parts.append("")
    kernel = functions[name]
    params = [a.arg for a in kernel.args.posonlyargs + kernel.args.args + kernel.args.kwonlyargs]
    return "\n\n".join(parts), order, params


def extract_plain_functions(source: str, names: tuple) -> dict:
    """name -> function for the module-level functions `names` of `source`,
    compiled with postponed annotations (so `str | None` and friends need
    nothing) in a namespace with vLLM's platform queries stubbed for CUDA."""
    import torch

    tree = ast.parse(source)
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in found}
    if missing:
        raise ValueError(f"{FUSED_MOE_PY} has no function {sorted(missing)}")

    class _Platform:  # vllm.platforms.current_platform, as far as these functions ask it
        @staticmethod
        def get_device_name(device_id: int = 0) -> str:
            return torch.cuda.get_device_name(device_id)

        @staticmethod
        def is_rocm() -> bool:
            return False

        @staticmethod
        def is_cuda() -> bool:
            return True

    def _not_reached(*args, **kwargs):
        raise NotImplementedError("a quantized path of vLLM's config functions was reached")

    namespace = {"current_platform": _Platform, "vllm_is_batch_invariant": lambda: False,
                 "get_device_name_as_file_name": lambda: _Platform.get_device_name().replace(" ", "_"),
                 "envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_TUNED_CONFIG_FOLDER=None),
                 "should_moe_wna16_use_cuda": _not_reached, "torch": torch, "os": os, "json": json}
    module = ast.Module(body=found, type_ignores=[])
    exec(compile(module, FUSED_MOE_PY, "exec", flags=_future.annotations.compiler_flag, dont_inherit=True),
         namespace)
    return {n: namespace[n] for n in names}


def checkout_commit(vllm_path: str) -> str | None:
    """The checkout's commit: `git rev-parse HEAD` where it is a git work
    tree, else the 40-hex commit a COMMIT file or fused_moe.py's head names,
    else "VERSION (COMMIT)" from a wheel's vllm/_version.py (its commit
    abbreviated)."""
    try:  # only where the checkout is its own work tree's top (not a folder inside another repository)
        out = subprocess.run(["git", "-C", vllm_path, "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        lines = out.stdout.split()
        own = len(lines) == 2 and os.path.realpath(lines[0]) == os.path.realpath(vllm_path)
        if out.returncode == 0 and own and re.fullmatch(r"[0-9a-f]{40}", lines[1]):
            return lines[1]
    except (OSError, subprocess.SubprocessError):
        pass
    for path in (os.path.join(vllm_path, "COMMIT"), os.path.join(vllm_path, FUSED_MOE_PY)):
        if os.path.exists(path):
            with open(path) as f:
                m = re.search(r"\b([0-9a-f]{40})\b", f.read(4096))
            if m:
                return m.group(1)
    version_py = os.path.join(vllm_path, "vllm", "_version.py")
    if os.path.exists(version_py):
        with open(version_py) as f:
            text = f.read(8192)
        version = re.search(r"__version__ = version = '([^']+)'", text)
        commit = re.search(r"__commit_id__ = commit_id = 'g?([0-9a-f]{7,40})'", text)
        if version and commit:
            return f"{version.group(1)} ({commit.group(1)})"
    return None


def moe_align_block_size(topk_ids, block_size: int, num_experts: int):
    """vLLM's moe_align_block_size (a CUDA op in vllm._C) in torch, on the
    ids' device, no host synchronisation: (sorted_token_ids [P] int32,
    expert_ids [P / block_size] int32, num_tokens_post_padded [1] int32).

    The T*k flat positions of `topk_ids` [T, k] grouped by expert (ascending
    position within an expert), each expert's group padded to a multiple of
    `block_size` with the id T*k (which the kernel masks off); expert_ids[b]
    is the expert of block b; blocks past num_tokens_post_padded are never
    read by the kernel (they hold 0). P = T*k + E*(block_size-1), or at most
    T*k*block_size when T*k < E, as vLLM sizes it."""
    import torch

    device = topk_ids.device
    numel = topk_ids.numel()
    max_padded = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        max_padded = min(numel * block_size, max_padded)
    flat = topk_ids.reshape(-1).to(torch.int64)
    # scatter_add, not bincount: CUDA's bincount reads its input's max back to the host (a sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(numel, device=device) - count_start[expert_of]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    sorted_ids[padded_start[expert_of] + rank] = order.to(torch.int32)
    blocks = -(-max_padded // block_size)
    block_start = torch.arange(blocks, device=device) * block_size
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_start < padded_end[-1], expert_ids, 0).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


class VllmFusedMoe:
    """vLLM's fused MoE Triton path loaded from a checkout (module docstring)."""

    def __init__(self, vllm_path: str):
        import torch
        import triton
        import triton.language as tl

        self.vllm_path = os.path.abspath(vllm_path)
        path = os.path.join(self.vllm_path, FUSED_MOE_PY)
        if not os.path.exists(path):
            raise ValueError(f"--vllm-path {vllm_path!r} is not a vLLM checkout: no {FUSED_MOE_PY}")
        with open(path) as f:
            source = f.read()
        kernel_source, self.jit_functions, self.kernel_params = extract_kernel_source(source)
        # Triton reads a kernel's source back from its file: write the extract to one and import it.
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm_fused_moe_")
        module_path = os.path.join(self._tmp.name, "vllm_fused_moe_kernel.py")
        with open(module_path, "w") as f:
            f.write(kernel_source)
        spec = importlib.util.spec_from_file_location("vllm_fused_moe_kernel", module_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.kernel = getattr(module, KERNEL)
        fns = extract_plain_functions(source, ("get_config_file_name", "get_default_config"))
        self._config_file_name = fns["get_config_file_name"]
        self._default_config = fns["get_default_config"]
        self.commit = checkout_commit(self.vllm_path)
        self.triton_version = triton.__version__
        self._tl = tl
        self._torch = torch
        self._configs: dict = {}

    # ------------------------------------------------------------------ configs
    def config_for(self, num_tokens: int, num_experts: int, hidden: int, intermediate: int,
                   top_k: int) -> tuple[dict, str]:
        """(config, where it came from) as try_get_optimal_moe_config picks it
        for unquantized 16-bit weights w1 [E, 2I, H], w2 [E, H, I] and M = T."""
        name = self._config_file_name(num_experts, intermediate, None)
        if name not in self._configs:
            file = os.path.join(self.vllm_path, CONFIG_DIR, name)
            table = None
            if os.path.exists(file):
                with open(file) as f:
                    tuned = json.load(f)
                tuned.pop("triton_version", None)
                table = {int(k): v for k, v in tuned.items()}
            self._configs[name] = table
        table = self._configs[name]
        if table:
            key = min(table.keys(), key=lambda x: abs(x - num_tokens))
            return dict(table[key]), f"tuned: {name}, entry {key}"
        args = {"M": num_tokens, "E": num_experts, "N": intermediate, "K": hidden, "topk": top_k,
                "dtype": None, "block_shape": None, "is_marlin": False}
        params = inspect.signature(self._default_config).parameters
        config = self._default_config(**{k: v for k, v in args.items() if k in params})
        return dict(config), f"default: vLLM's get_default_config (no {name} in the checkout)"

    # ------------------------------------------------------------------ kernel
    def kernel_arguments(self, A, B, C, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                         mul_routed_weight: bool, top_k: int, config: dict, compute_type) -> tuple:
        """(grid, keyword arguments) for one fused_moe_kernel launch, as
        invoke_fused_moe_kernel builds them for unquantized weights, bound by
        name to the parameters this checkout's kernel declares."""
        triton_cdiv = lambda a, b: -(-a // b)  # noqa: E731
        M = A.size(0)
        EM = sorted_token_ids.size(0)
        if M < config["BLOCK_SIZE_M"]:
            EM = min(sorted_token_ids.size(0), M * top_k * config["BLOCK_SIZE_M"])
        values = {
            "a_ptr": A, "b_ptr": B, "c_ptr": C, "b_bias_ptr": None, "a_scale_ptr": None, "b_scale_ptr": None,
            "b_zp_ptr": None, "topk_weights_ptr": topk_weights, "sorted_token_ids_ptr": sorted_token_ids,
            "expert_ids_ptr": expert_ids, "num_tokens_post_padded_ptr": num_tokens_post_padded,
            "N": B.size(1), "K": B.size(2), "EM": EM, "num_valid_tokens": M * top_k,
            "stride_am": A.stride(0), "stride_ak": A.stride(1), "stride_be": B.stride(0),
            "stride_bk": B.stride(2), "stride_bn": B.stride(1),
            "stride_cm": C.stride(1), "stride_cn": C.stride(2),
            "stride_asm": 0, "stride_ask": 0, "stride_bse": 0, "stride_bsk": 0, "stride_bsn": 0,
            "stride_bbe": 0, "stride_bbn": 0, "group_n": 0, "group_k": 0,
            "MUL_ROUTED_WEIGHT": mul_routed_weight, "top_k": top_k, "compute_type": compute_type,
            "use_fp8_w8a8": False, "use_int8_w8a8": False, "use_int8_w8a16": False, "use_int4_w4a16": False,
            "per_channel_quant": False, "HAS_BIAS": False, "SPLIT_K": 1,
            "even_Ks": B.size(2) % config["BLOCK_SIZE_K"] == 0,
            # later checkouts: TMA descriptors, the swapped and tensor-descriptor
            # layouts (quantized or opt-in paths) off, as the unquantized call has them
            "a_desc": None, "b_desc": None, "naive_block_assignment": False, "SWAP_AB": False,
            "USE_TD": False, "USE_TMA_A": False, "USE_TMA_B": False, "C_IS_SORTED": False,
        }
        options = {}
        for key, value in config.items():
            if key in LAUNCH_OPTIONS:
                options[key] = value
            else:
                values[key] = value
        unknown = [p for p in self.kernel_params if p not in values]
        if unknown:
            raise ValueError(f"this vLLM's {KERNEL} takes parameters the loader does not know: {unknown}")
        kwargs = {p: values[p] for p in self.kernel_params}
        kwargs.update(options)
        grid = (triton_cdiv(EM, config["BLOCK_SIZE_M"]) * triton_cdiv(B.size(1), config["BLOCK_SIZE_N"]),)
        return grid, kwargs

    def _gemm(self, A, B, C, topk_weights, align, mul_routed_weight, top_k, config, compute_type):
        grid, kwargs = self.kernel_arguments(A, B, C, topk_weights, *align, mul_routed_weight, top_k, config,
                                             compute_type)
        self.kernel[grid](**kwargs)

    def align(self, topk_ids, config: dict, num_experts: int):
        return moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], num_experts)

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids, config: dict, align=None):
        """The experts' output [T, H]: hidden_states [T, H] (bf16/fp16,
        contiguous), w1 [E, 2I, H] (gate rows first, then up: transformers'
        gate_up_proj), w2 [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k].
        `align`: a precomputed `self.align(topk_ids, config, E)`, else computed
        here (as vLLM does)."""
        torch = self._torch
        compute_type = {torch.bfloat16: self._tl.bfloat16, torch.float16: self._tl.float16,
                        torch.float32: self._tl.float32}[hidden_states.dtype]
        T, H = hidden_states.shape
        E, N, _ = w1.shape
        top_k = topk_ids.size(1)
        if align is None:
            align = self.align(topk_ids, config, E)
        cache13 = torch.empty(T * top_k * max(N, H), device=hidden_states.device, dtype=hidden_states.dtype)
        cache1 = cache13[: T * top_k * N].view(T, top_k, N)
        cache3 = cache13[: T * top_k * H].view(T, top_k, H)
        self._gemm(hidden_states, w1, cache1, topk_weights, align, False, top_k, config, compute_type)
        x = cache1.view(-1, N)
        cache2 = torch.nn.functional.silu(x[:, : N // 2]) * x[:, N // 2:]
        self._gemm(cache2, w2, cache3, topk_weights, align, True, 1, config, compute_type)
        return torch.sum(cache3, dim=1)

    def describe(self) -> dict:
        return {"vllm_path": self.vllm_path, "vllm_commit": self.commit, "kernel": KERNEL,
                "jit_functions": self.jit_functions, "kernel_params": self.kernel_params,
                "triton_version": self.triton_version}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-path", required=True, help="a vLLM checkout (its source tree)")
    args = parser.parse_args(argv)
    peer = VllmFusedMoe(args.vllm_path)
    print(json.dumps(peer.describe(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
