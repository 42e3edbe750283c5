"""Every transformers MoE family whose experts module uses
`@use_experts_implementation`, in the INSTALLED transformers, run through the
"idempotent" experts implementation, dropless and in capacity mode.

The families are found at collection time (a newer transformers adds its own);
each is built once, tiny and with random weights, on the CPU in float32: its
config's defaults shrunk by name (hidden and intermediate sizes, 1-2 layers
with at least one MoE layer, heads, experts 8, top-k 2, a small vocabulary).
Then, on one seeded input, "idempotent" must match transformers' grouped_mm
(the logits, or the last hidden state of a model without a head, and the
gradients of one backward w.r.t. the input embeddings and the experts'
weights: the training path) within a tolerance
taken from transformers' own spread on that input (eager's and batched_mm's
difference from grouped_mm),
with as many calls of our experts function as grouped_mm makes of its own.

Capacity mode runs with capacity factor E / k: C = T, so nothing is dropped
while the selection and the compaction still run.

docs/families.md is this file's table (tools/families_table.py writes it).
A family that cannot be built generically is skipped with the reason; one
that builds and fails only with "idempotent" is an xfail with its root cause.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import re
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
moe_integration = pytest.importorskip("transformers.integrations.moe")

import idempotent_moe.integrations as imoe_hf  # noqa: E402  (registers "idempotent")
from idempotent_moe.integrations import hf_experts  # noqa: E402

TOKENS = (2, 8)  # batch, sequence: T = 16 tokens per experts call
HIDDEN, INTER, MOE_INTER, VOCAB = 64, 32, 16, 128
HEADS, HEAD_DIM, EXPERTS, TOP_K, LAYERS = 4, 16, 8, 2, 2
ATOL = 1e-6  # the floor where transformers' three agree exactly (times the output's scale)
MAX_PARAMETERS = 4_000_000  # a tiny model; more means the shrink missed a size
MODES = ("dropless", "capacity")

# xfail(strict=True) reasons: families that build and pass with grouped_mm but
# fail with "idempotent" (root causes found in the library; see docs/families.md).
KNOWN_FAILURES: dict = {}


# --------------------------------------------------------------------------- discovery


def _models_root() -> str:
    import transformers.models

    return os.path.dirname(transformers.models.__file__)


def discover_families() -> list:
    """The model directories of the installed transformers whose modeling file
    decorates an experts module with `use_experts_implementation` (text search:
    nothing is imported)."""
    root = _models_root()
    found = []
    for name in sorted(os.listdir(root)):
        directory = os.path.join(root, name)
        if not os.path.isdir(directory):
            continue
        for file in sorted(os.listdir(directory)):
            if file.startswith("modeling_") and file.endswith(".py"):
                with open(os.path.join(directory, file), encoding="utf-8") as f:
                    if "@use_experts_implementation" in f.read():
                        found.append(name)
                        break
    return found


class Unbuildable(Exception):
    """The family cannot be built generically (the message says why)."""


# --------------------------------------------------------------------------- the shrinker

_EXPERTS = re.compile(r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$")
_TOP_K = re.compile(r"^(num_experts_per_tok|num_experts_per_token|moe_topk|moe_k|top_k_experts|top_k)$")
_SHARED = re.compile(r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$")
_RANK = re.compile(r"(lora_rank|gate_rank|lowrank|_rank)$")
_DENSE_FIRST = {"first_k_dense_replace": 0, "num_dense_layers": 0, "moe_layer_start_index": 0,
                "moe_layer_interval": 1, "decoder_sparse_step": 1, "moe_layer_freq": 1,
                "expert_layer_period": 1, "expert_layer_offset": 0, "mlp_only_layers": [],
                "prefix_dense_sliding_window_pattern": 0}
_SUBMODULE_SIZES = {"depth": 1, "encoder_layers": 1, "n_layers": 1, "num_heads": 2,
                    "encoder_attention_heads": 2, "d_model": 32, "encoder_ffn_dim": 32}


def _small(value, size):
    if isinstance(value, list):
        return [_small(v, size) for v in value]
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return size
    return value


def shrink_kwargs(defaults: dict, layers: int = LAYERS) -> dict:
    """Keyword overrides that make a config of these defaults tiny: only the
    keys changed (what a config derives from them is derived again)."""
    out: dict = {}
    heads = defaults.get("num_attention_heads") or HEADS
    for key, value in defaults.items():
        if isinstance(value, bool) or isinstance(value, (dict, float, str)):
            continue
        if key in _DENSE_FIRST:
            out[key] = _DENSE_FIRST[key]
        elif key == "moe_layer_end_index":
            out[key] = layers - 1
        elif key == "num_hidden_layers":
            out[key] = layers
        elif key in ("vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input"):
            out[key] = VOCAB
        elif key == "hidden_size":
            out[key] = HIDDEN
        elif key.endswith("hidden_size") and isinstance(value, int):
            out[key] = HIDDEN if value == defaults.get("hidden_size") else 32
        elif "intermediate_size" in key:
            if value:
                out[key] = _small(value, MOE_INTER if ("moe" in key or "expert" in key) else INTER)
        elif _EXPERTS.match(key):
            out[key] = _small(value, EXPERTS)
        elif _TOP_K.match(key):
            out[key] = _small(value, TOP_K) if not isinstance(value, int) else min(value, TOP_K)
        elif _SHARED.match(key):
            if value or value is None:  # None: dots1 multiplies by it
                out[key] = _small(value, 1)
        elif key in ("n_group", "num_expert_group", "topk_group"):
            if value:
                out[key] = 1
        elif key == "index_topk":
            out[key] = max(4, defaults.get("index_kpool") or 0)
        elif key in ("mamba_d_state", "ssm_state_size"):
            out[key] = 16
        elif key in ("mamba_n_heads", "mamba_num_heads"):  # times the head dim: expand x hidden
            out[key] = 8
        elif key in ("mamba_d_head",):
            out[key] = 16
        elif key == "mamba_dt_rank":
            out[key] = 8
        elif key in ("n_groups", "mamba_n_groups"):
            out[key] = 1
        elif key.endswith("num_key_value_heads"):
            if value:
                out[key] = 1 if value == 1 else (HEADS if value == heads else 2)
        elif key.endswith(("num_attention_heads", "_num_heads", "n_heads")) or key == "num_heads":
            if value:
                out[key] = _small(value, HEADS)
        elif key == "linear_num_key_heads":
            out[key] = 2
        elif key == "linear_num_value_heads":
            out[key] = 4
        elif key in ("qk_rope_head_dim", "qk_nope_head_dim"):
            if value:
                out[key] = 8
        elif key == "qk_head_dim":
            continue  # derived
        elif key.endswith("head_dim"):
            if value or (value is None and key == "head_dim"):
                same_as_rope = value == defaults.get("qk_rope_head_dim")
                out[key] = 8 if same_as_rope else HEAD_DIM
        elif _RANK.search(key):
            if value:
                out[key] = 16
        elif key in ("max_position_embeddings", "model_max_length") and isinstance(value, int):
            out[key] = min(value, 512)
        elif key in ("sliding_window", "sliding_window_size") and isinstance(value, int):
            out[key] = min(value, 64)
        elif key in _SUBMODULE_SIZES and isinstance(value, int):
            out[key] = _SUBMODULE_SIZES[key]
        elif key.endswith("token_id") or key.endswith("token_index"):
            out[key] = _small_token(value)
    rope = defaults.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        out["rope_parameters"] = {**rope, "mrope_section": _mrope(rope, out)}
    for key, value in defaults.items():  # MoE switches off by default (gemma4's enable_moe_block)
        if value is False and re.match(r"^(enable|use)_moe", key):
            out[key] = True
    if "moe_intermediate_size" in defaults and defaults["moe_intermediate_size"] is None:
        out["moe_intermediate_size"] = MOE_INTER
    return out


def _mrope(rope: dict, out: dict) -> list:
    """The multimodal rope's sections (time, height, width) rescaled to sum
    to half the shrunk rotary dimension."""
    section = rope["mrope_section"]
    rotary = out.get("qk_rope_head_dim") or int((out.get("head_dim") or HEAD_DIM)
                                                 * rope.get("partial_rotary_factor", 1.0))
    target = rotary // 2
    scaled = [max(1, v * target // sum(section)) for v in section]
    scaled[-1] += target - sum(scaled)
    return scaled


def _small_token(value):
    if isinstance(value, list):
        return [_small_token(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
        return VOCAB - 1 - value % 16
    return value


def _per_layer(defaults: dict) -> dict:
    """The keys holding one entry per layer (lists or strings as long as
    num_hidden_layers)."""
    n = defaults.get("num_hidden_layers")
    return {k: v for k, v in defaults.items()
            if isinstance(v, (list, str)) and n and len(v) == n and n > 1 and k != "_name_or_path"}


def _layer_windows(defaults: dict, layers: int) -> list:
    """Windows [i, i + layers) of the per-layer keys, the most varied first
    (so that a MoE layer is among them whatever the family calls it)."""
    per_layer = _per_layer(defaults)
    if not per_layer:
        return []
    n = defaults["num_hidden_layers"]
    seen, windows = set(), []
    for i in range(n - layers + 1):
        cut = tuple((k, tuple(v[i:i + layers]) if isinstance(v, list) else v[i:i + layers])
                    for k, v in sorted(per_layer.items()))
        if cut not in seen:
            seen.add(cut)
            variety = sum(len(set(v)) for _, v in cut)
            windows.append((-variety, i, {k: (list(v) if isinstance(v, tuple) else v) for k, v in cut}))
    windows.sort(key=lambda w: (w[0], w[1]))
    out = []
    for _, _, cut in windows[:6]:
        for k, v in cut.items():
            if k == "num_attention_heads_per_layer" or k.endswith("heads_per_layer"):
                cut[k] = [HEADS for _ in v]
        out.append(cut)
    return out


# --------------------------------------------------------------------------- building


def _quiet():
    """Building a family from its defaults may warn (deprecated defaults,
    ignored keys): not what these tests are about."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    stack.callback(hf_logging.set_verbosity, level)
    return stack


def experts_modules(model) -> list:
    return [m for _, m in hf_experts._experts_modules(model)]


def _model_classes(family: str) -> list:
    """(rank, class) of the family's model classes to try, best first: a
    text-only ForCausalLM, a text-only base model, then the composite ones."""
    from transformers import PreTrainedModel

    try:
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except Exception as e:  # an optional dependency the family needs
        raise Unbuildable(f"importing modeling_{family} failed: {type(e).__name__}: {e}") from e
    ranked = []
    for name, cls in vars(modeling).items():
        if not (inspect.isclass(cls) and issubclass(cls, PreTrainedModel)
                and cls.__module__ == modeling.__name__) or name.endswith("PreTrainedModel"):
            continue
        config_class = getattr(cls, "config_class", None)
        if config_class is None:
            continue
        composite = bool(getattr(config_class, "sub_configs", None))
        if name.endswith("ForCausalLM"):
            rank = 0
        elif name.endswith("Model"):
            rank = 1
        elif name.endswith("ForConditionalGeneration"):
            rank = 2
        else:
            continue
        ranked.append((rank + 3 * composite, name, cls))
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [cls for _, _, cls in ranked]


def _shrunk_sub(sub: dict) -> dict:
    """A sub-config's dict (vision, audio, text of a composite), shrunk to one
    layer, its own sub-configs too; its per-layer keys are derived again."""
    out = {**sub, **shrink_kwargs(sub, layers=1)}
    for key in list(_per_layer(sub)) + ["per_layer_config"]:
        out.pop(key, None)
    for key, value in sub.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = _shrunk_sub(value)
    return out


def _shrunk_configs(config_class, source: str = "") -> list:
    """Candidate tiny configs of config_class: the plain shrink, then windows
    of its per-layer lists (1 or 2 layers each)."""
    with _quiet():
        defaults = config_class().to_dict()
    sub_kwargs = {key: _shrunk_sub(defaults[key]) for key in getattr(config_class, "sub_configs", None) or {}
                  if isinstance(defaults.get(key), dict)}
    attempts = []
    for layers in (LAYERS, 1):
        base = {**shrink_kwargs(defaults, layers), **sub_kwargs}
        rope = defaults.get("rope_parameters")
        implicit = re.search(r"[\"']mrope_section[\"'],\s*(\[[\d, ]+\])", source)
        if isinstance(rope, dict) and "mrope_section" not in rope and implicit:  # the model's default
            rope = {**rope, "mrope_section": [int(v) for v in re.findall(r"\d+", implicit.group(1))]}
            base["rope_parameters"] = {**rope, "mrope_section": _mrope(rope, base)}
        if "initializer_range" in defaults:
            base["initializer_range"] = 0.08
        attempts.append(base)
        attempts += [{**base, **cut} for cut in _layer_windows(defaults, layers)]
        attempts += [{**base, **fill} for fill in _unset_layer_types(defaults, source, layers)]
    return attempts


def _unset_layer_types(defaults: dict, source: str, layers: int) -> list:
    """Where a standalone config leaves a per-layer list None that its model
    indexes (lfm2_moe's layer_types, deepseek_ocr2's mlp_layer_types): the
    list filled with each value the modeling file compares it with."""
    fills = []
    for key, value in defaults.items():
        if value is None and key.endswith("layer_types"):
            found = re.findall(rf"{key}\[\w+\]\s*[!=]=\s*[\"'](\w+)[\"']", source)
            fills += [{key: [v] * layers} for v in dict.fromkeys(found)]
    return fills


def _fill_hash_tables(model) -> None:
    """A hash router's token-to-experts table (DeepSeek-V4's tid2eid: zeros
    at init, "real values come from the checkpoint") filled as a checkpoint
    fills it: k distinct experts per token. All zeros would name expert 0 k
    times per token, which the library refuses (each token's experts must be
    distinct, as torch.topk gives them)."""
    generator = torch.Generator().manual_seed(2)
    for module in model.modules():
        if "Router" not in type(module).__name__:
            continue
        experts = getattr(module, "n_routed_experts", None) or getattr(module, "num_experts", None)
        for buffer in module.buffers(recurse=False):
            if buffer.dtype == torch.long and buffer.dim() == 2 and experts and buffer.shape[1] <= experts:
                rows = [torch.randperm(experts, generator=generator)[:buffer.shape[1]]
                        for _ in range(buffer.shape[0])]
                buffer.copy_(torch.stack(rows))


@functools.cache
def build_family(family: str):
    """(model, description) for the family: the first candidate class and
    config that builds a model with an experts module; Unbuildable otherwise.
    Seeded, float32, eval mode, parameters frozen (run_model unfreezes the
    experts' own for the gradients it checks)."""
    errors = []
    for cls in _model_classes(family):
        for kwargs in _shrunk_configs(cls.config_class, inspect.getsource(inspect.getmodule(cls))):
            try:
                with _quiet():
                    config = cls.config_class(**kwargs)
                    with torch.device("meta"):  # its size first: a shrink that missed a size is refused
                        size = sum(p.numel() for p in cls(config).parameters())
                    if size > MAX_PARAMETERS:
                        raise Unbuildable(f"{size / 1e6:.0f}M parameters after shrinking its config")
                    torch.manual_seed(0)
                    model = cls(config).float().eval()
            except Exception as e:  # this candidate does not build: try the next
                errors.append(f"{cls.__name__}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            if experts_modules(model):
                model.requires_grad_(False)
                _fill_hash_tables(model)
                layers = getattr(config, "num_hidden_layers", None)
                return model, f"{cls.__name__} ({layers} layers, {len(experts_modules(model))} MoE)"
            errors.append(f"{cls.__name__}: no experts module with this config")
    if not errors:
        raise Unbuildable("no ForCausalLM / Model / ForConditionalGeneration class")
    error = Unbuildable(errors[0])
    error.errors = errors
    raise error


# --------------------------------------------------------------------------- the checks


class _Counted:
    """The experts functions of ExpertsInterface wrapped for one run: each
    call counted, with its (num_experts, k) and, per experts module, the
    tokens of its last call (Ergo's, for one, calls the interface with every
    token repeated k times and top-1 routing)."""

    def __init__(self):
        self.calls: dict = {}
        self.shapes: set = set()
        self.tokens: dict = {}

    @contextlib.contextmanager
    def installed(self):
        mapping = moe_integration.ExpertsInterface._global_mapping
        saved = {name: mapping[name] for name in ("idempotent", "grouped_mm")}
        for name, fn in saved.items():
            mapping[name] = self._wrap(name, fn)
        try:
            yield self
        finally:
            mapping.update(saved)

    def _wrap(self, name, fn):
        def counted(experts, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            self.shapes.add((experts.num_experts, top_k_index.shape[-1]))
            self.tokens[experts] = top_k_index.numel() // top_k_index.shape[-1]
            return fn(experts, hidden_states, top_k_index, top_k_weights, *args, **kwargs)

        return counted


def _output(out):
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return out[0]


def experts_weights(model) -> list:
    """The experts modules' own parameters (weights, biases), in module order."""
    return [p for m in experts_modules(model) for p in m.parameters(recurse=False)]


def run_model(model, impl: str, ids: torch.Tensor, probe: torch.Tensor | None):
    """(output without gradient, output with gradient, gradient w.r.t. the
    input embeddings, the probe, gradient w.r.t. the experts' weights, all
    flattened into one vector) of `model` under experts implementation
    `impl`. The embedding module's output is made a leaf that requires grad,
    and so are the experts' own parameters (the others stay frozen): the
    experts see hidden states and weights that record a gradient, as in
    training."""
    model.set_experts_implementation(impl)
    with torch.no_grad():
        plain = _output(model(input_ids=ids, use_cache=False)).float()
    leaf = {}

    def hook(module, args, out):
        leaf["embeds"] = out.detach().requires_grad_(True)
        return leaf["embeds"]

    weights = experts_weights(model)
    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        for w in weights:
            w.requires_grad_(True)
        out = _output(model(input_ids=ids, use_cache=False)).float()
        if probe is None:
            probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((out * probe).sum(), [leaf["embeds"], *weights], allow_unused=True)
    finally:
        handle.remove()
        for w in weights:
            w.requires_grad_(False)
    grad_w = torch.cat([(torch.zeros_like(w) if g is None else g).flatten()
                        for w, g in zip(weights, grads[1:])])
    return plain, out.detach(), grads[0], probe, grad_w


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def tolerance(reference: torch.Tensor, spread: float) -> float:
    """Twice transformers' own spread (eager's and batched_mm's largest
    difference from grouped_mm), at least ATOL times the output's scale."""
    scale = max(1.0, reference.abs().max().item())
    return max(2 * spread, ATOL * scale)


@contextlib.contextmanager
def _reference_errors(description: str):
    try:
        yield
    except Unbuildable:
        raise
    except Exception as e:
        raise Unbuildable(f"{description}: transformers' own implementations fail on the tiny model: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from e


@functools.cache
def references(family: str):
    """(input ids, grouped_mm's run, eager's and batched_mm's runs, grouped_mm's
    call count, the (E, k) of its calls) of the family's model: once per
    family, for both modes. Unbuildable where transformers' own
    implementations do not run it (nothing of ours to check there)."""
    model, description = build_family(family)
    torch.manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, min(vocab, VOCAB), TOKENS)
    counter = _Counted()
    with counter.installed(), _reference_errors(description):
        imoe_hf.set_capacity_factor(model, None)
        grouped = run_model(model, "grouped_mm", ids, None)
        # transformers' other two: their spread is the tolerance (batched_mm's
        # batched GEMMs round as capacity mode's padded GEMMs do)
        mapping = moe_integration.ExpertsInterface._global_mapping
        impls = ["eager"] + [i for i in ("batched_mm",) if i in mapping]
        others = [run_model(model, impl, ids, grouped[3]) for impl in impls]
    grouped_calls = counter.calls.get("grouped_mm", 0)
    if not grouped_calls:
        raise Unbuildable(f"{description}: its forward never calls the experts interface")
    return ids, grouped, others, grouped_calls, frozenset(counter.shapes)


def check_family(family: str, mode: str) -> str:
    """Run `family` in `mode`; AssertionError with what differs, or a line
    saying what matched."""
    model, description = build_family(family)
    ids, grouped, others, grouped_calls, shapes = references(family)
    counter = _Counted()
    with counter.installed():
        if mode == "capacity":
            # C = ceil(T k / E f), at most T: f = E / k keeps every assignment
            imoe_hf.set_capacity_factor(model, max(e / k for e, k in shapes))
        try:
            ours = run_model(model, "idempotent", ids, grouped[3])
            stats = imoe_hf.capacity_stats(model)
        finally:
            imoe_hf.set_capacity_factor(model, None)
            model.set_experts_implementation("grouped_mm")
    calls = counter.calls.get("idempotent", 0)
    assert calls == grouped_calls, (
        f"{description}: the idempotent experts function ran {calls} times, grouped_mm's {grouped_calls}")
    if mode == "capacity":
        modules = experts_modules(model)
        assert len(stats) == len([m for m in modules if getattr(m, "idempotent_stats", None)]) > 0, \
            f"{description}: no capacity statistics: capacity mode did not run"
        tokens = {name: counter.tokens[model.get_submodule(name)] for name in stats}
        assert all(s.dropped == 0 and s.capacity == tokens[name] for name, s in stats.items()), \
            f"{description}: capacity E/k is not C = T (the call's tokens, {tokens}) " \
            f"with nothing dropped: {stats}"
    names = {0: "output (no grad)", 1: "output (grad)", 2: "d output / d embeddings",
             4: "d output / d experts' weights"}
    lines = []
    for i, name in names.items():
        ref, got = grouped[i], ours[i]
        assert torch.isfinite(ref).all(), f"{description}: grouped_mm's {name} is not finite"
        spread = max(_diff(ref, other[i]) for other in others)
        tol = tolerance(ref, spread)
        err = _diff(ref, got)
        assert err <= tol, (f"{description}, {mode}: {name} differs from grouped_mm by {err:.3g} "
                            f"(tolerance {tol:.3g}; eager and batched_mm vs grouped_mm {spread:.3g})")
        lines.append(f"{name} {err:.2g} <= {tol:.2g}")
    return f"{description}: " + "; ".join(lines)


# --------------------------------------------------------------------------- the tests


def _params() -> list:
    params = []
    for family in discover_families():
        for mode in MODES:
            marks = []
            reason = KNOWN_FAILURES.get((family, mode)) or KNOWN_FAILURES.get(family)
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            params.append(pytest.param(family, mode, id=f"{family}-{mode}", marks=marks))
    return params


@pytest.fixture(scope="module", autouse=True)
def _models_of_this_module():
    """The models are built once per family for this module, then freed."""
    yield
    references.cache_clear()
    build_family.cache_clear()


@pytest.mark.parametrize(("family", "mode"), _params())
def test_family_matches_grouped_mm(family, mode):
    try:
        build_family(family)
        references(family)
    except Unbuildable as e:
        pytest.skip(f"{family} cannot be built generically: {e}")
    check_family(family, mode)


def test_discovery_finds_the_documented_families():
    families = discover_families()
    assert {"mixtral", "qwen3_moe", "olmoe", "gpt_oss"} <= set(families), families
