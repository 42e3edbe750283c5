"""The token-agreement check of M1 (docs/results.md#workloads).

Every generated token is judged by the baseline (transformers' grouped_mm
experts, same weights) on the same prefix: one forward of the baseline over
the prompt and the tokens generated before it (teacher forcing) gives the
baseline's logits at that step. A token is

- exact:     the baseline's best token there (the end-of-sequence ids that
             min_new_tokens forbade are left out, as in generate());
- near-tie:  another token whose baseline logit is within the tolerance of the
             best: `tie_ulps` units in the last place of the logits' dtype at
             the best logit's magnitude, tie_ulps x eps(dtype) x max(|best|, 1);
             kernels that round differently (fp32 accumulation order, fused
             GEMMs, compiled graphs) legitimately pick either of two such tokens;
- disagree:  anything further.

Judging each token on its own prefix keeps the check meaningful after a
sequence has taken a near-tie the other way. Beside it, how many tokens are
equal, position by position, to the baseline's own generate() output.

The judge's forward (the whole sequence at once, prefill-shaped GEMMs) is
not the baseline's decode (transformers runs decode steps through
batched_mm), and a model with random weights carries one rounding
difference far: the baseline's own tokens can disagree with the judge. An
implementation passes when its tokens equal the baseline's, or when it
disagrees no more than the baseline's own tokens do, within two standard
deviations of a count (`allowed_disagreements`; none when the baseline
has none).
"""

from __future__ import annotations

import math

TIE_ULPS = 4


def allowed_disagreements(baseline_disagree) -> int:
    """Disagreements an implementation may have when the baseline's own
    tokens have `baseline_disagree` (None: not judged, so none): that count
    plus two standard deviations of a Poisson count, 0 stays 0."""
    if not baseline_disagree:
        return 0
    return int(baseline_disagree + 2 * math.sqrt(baseline_disagree))


def tolerance(best, dtype, tie_ulps: float):
    """The near-tie tolerance for logits whose best value is `best` (a tensor)."""
    import torch

    return tie_ulps * torch.finfo(dtype).eps * best.abs().clamp(min=1.0)


def baseline_logits(model, prompt, generated, forbidden: list):
    """The baseline's logits [B, N, V] (float32) at each of the N generated
    positions, with the forbidden ids at -inf. `model` is already switched to
    the baseline implementation."""
    import torch

    n = generated.shape[1]
    ids = torch.cat([prompt, generated[:, :-1]], dim=1)
    with torch.no_grad():
        logits = model(ids, use_cache=False, logits_to_keep=n).logits.float()
    if forbidden:
        logits[..., forbidden] = float("-inf")
    return logits


def judge(logits, generated, dtype, tie_ulps: float) -> dict:
    """Counts of exact / near-tie / disagree tokens of `generated` [B, N]
    under the baseline's `logits` [B, N, V], the tolerance rule, and the
    largest gap (baseline best minus the token's logit) of a token that was
    not exact."""

    best_value, best = logits.max(dim=-1)
    chosen = logits.gather(-1, generated[..., None]).squeeze(-1)
    gap = best_value - chosen
    tol = tolerance(best_value, dtype, tie_ulps)
    exact = generated == best
    near = ~exact & (gap <= tol)
    disagree = ~exact & ~near
    not_exact = gap[~exact]
    return {"exact": int(exact.sum()), "near_tie": int(near.sum()), "disagree": int(disagree.sum()),
            "tokens": int(generated.numel()),
            "max_gap": float(not_exact.max()) if not_exact.numel() else 0.0,
            "max_tolerance": float(tol.max()),
            "rule": f"{tie_ulps:g} x eps({str(dtype).replace('torch.', '')}) x max(|best logit|, 1)"}


def equal_to(generated, reference) -> dict:
    """Tokens (and whole sequences) equal, position by position, to the
    baseline's own generate() output."""
    same = generated == reference
    return {"tokens_equal_baseline": int(same.sum()),
            "sequences_equal_baseline": int(same.all(dim=1).sum()),
            "sequences": int(generated.shape[0])}
