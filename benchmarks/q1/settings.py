"""What Q1's quality measurement runs by default: the budgets, the token
counts of the perplexity settings, the policy labels of each setting (in
the order of the tables' rows) and kvpress's presses. Names only: nothing
here imports idempotent_moe or kvpress, so both environments read it."""

from __future__ import annotations

from dataclasses import dataclass

BUDGETS = (128, 256, 512, 1024)


@dataclass(frozen=True)
class Lengths:
    """The perplexity settings' token counts: the prompt, then the
    continuation whose perplexity is measured."""

    prompt: int = 2048
    continuation: int = 512


FULL = Lengths()
QUICK = Lengths(192, 32)  # --quick: a prompt longer than the steady buffer, as in the real run

# The library's policies per setting: (label, policy) in the prefill setting, labels in the others
# (what each label runs: policies.library_policy).
PREFILL_POLICIES = (
    ("streaming_llm", "streaming_llm"), ("knorm", "knorm"), ("keydiff", "keydiff"), ("tova", "tova"),
    ("observed_attention", "observed_attention"), ("h2o_sum", "h2o_sum"), ("snapkv", "snapkv"),
    ("expected_attention", "expected_attention"),
    ("observed_attention_nosinks", "observed_attention_nosinks"), ("vatp", "vatp"),
    ("vatp_recent4", "vatp_recent4"), ("vatp_recent8", "vatp_recent8"), ("auto", "auto"),
)
DECODE_POLICIES = ("streaming_llm", "auto", "observed_attention", "tova")
PASSKEY_POLICIES = ("auto", "vatp_recent8", "streaming_llm", "snapkv", "tova", "observed_attention",
                    "expected_attention", "keydiff")
PASSKEY_DECODE_POLICIES = ("auto", "streaming_llm")
KVPRESS_PRESSES = ("ObservedAttentionPress", "TOVAPress", "SnapKVPress", "ExpectedAttentionPress",
                   "StreamingLLMPress", "KnormPress", "KeyDiffPress")
