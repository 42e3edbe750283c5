"""Registering the "idempotent" experts implementation with transformers:
`import idempotent_moe` leaves transformers alone and registers when
transformers loads (or at once, after it); the integrations import without
torch or transformers, and say so without the native part; register()
twice, and under another name."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe", reason="needs transformers' experts interface")

from _helpers import package_env  # noqa: E402
from _helpers.hf_models import (  # noqa: E402
    logits,
    tiny_model,
    token_ids,
)
from idempotent_moe import integrations as hf  # noqa: E402


def _run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=package_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_idempotent_moe_leaves_transformers_alone_and_registers_when_it_loads():
    out = _run_python("""
        import sys
        import idempotent_moe
        assert "transformers" not in sys.modules and "torch" not in sys.modules
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        import idempotent_moe.integrations as hf
        assert ALL_EXPERTS_FUNCTIONS["idempotent"] is hf.idempotent_experts_forward
        print("ok")
    """)
    assert out == "ok"


def test_import_after_transformers_registers_at_once():
    """A model built before `import idempotent_moe` takes the name too."""
    out = _run_python("""
        from transformers import MixtralConfig, MixtralForCausalLM
        model = MixtralForCausalLM(MixtralConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, vocab_size=50))
        import idempotent_moe
        model.set_experts_implementation("idempotent")
        assert model.config._experts_implementation == "idempotent"
        print("ok")
    """)
    assert out == "ok"


def test_integrations_import_without_torch_or_transformers():
    """The hook works on NumPy arrays where neither is installed."""
    out = _run_python("""
        import sys
        sys.modules["torch"] = None
        sys.modules["transformers"] = None
        import numpy as np
        import idempotent_moe.integrations as hf
        x = np.arange(2 * 6 * 3, dtype=np.float32).reshape(2, 6, 3)
        s = np.array([[0, 5, 1, 4, 2, 3], [9, 0, 0, 0, 8, 7]], dtype=np.float32)
        kept, idx = hf.HuggingFaceMoEInplaceHook(capacity=3)(x, s, return_indices=True)
        assert idx.tolist() == [[3, 1, 5], [0, 4, 5]] and kept.shape == (2, 3, 3)
        try:
            hf.register()
        except ImportError:
            print("ok")
    """)
    assert out == "ok"


def test_integrations_without_the_native_part_say_so():
    """With torch installed but idempotent_moe._C missing (a source tree not
    built), the error names the native part, not torch."""
    out = _run_python("""
        import sys
        sys.modules["idempotent_moe._C"] = None
        try:
            import idempotent_moe.integrations
        except ImportError as e:
            assert "native part" in str(e) and "needs torch" not in str(e), e
            print("ok")
    """)
    assert out == "ok"


def test_register_is_idempotent_and_custom_names_work():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    hf.register()
    hf.register()
    assert ALL_EXPERTS_FUNCTIONS["idempotent"] is hf.idempotent_experts_forward
    hf.register("idempotent_test_alias")
    model = tiny_model("mixtral")
    ids = token_ids(1, 8)
    torch.testing.assert_close(logits(model, ids, "idempotent_test_alias"), logits(model, ids, "idempotent"),
                               rtol=0, atol=0)
