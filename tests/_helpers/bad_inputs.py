"""The bad-input cases of the functional API: a registry of builders
`(framework, rng) -> (call, arrays)`, each a call that must raise and the
arrays it must leave as they were, and the compaction problem they start
from. Each test module keeps its own registry."""

from __future__ import annotations

import idempotent_moe as imoe
import numpy as np
import pytest

from . import assert_unchanged, make_data, make_scores, names, requires_torch, snapshot, to_framework

N, C = 12, 5
BUFFER = r"(\bx\b|buffer)"  # the Python API calls the buffers x, x[0], x[1], ...


class BadCases:
    """Builders registered with `@cases.bad(exc, *words, frameworks=...)`, one
    case per framework: `call` must raise `exc` with a message that names
    every one of `words` (regexes). `cases.params` parametrizes
    "build,framework,exc,match"; run_case runs one."""

    def __init__(self):
        self.params = []

    def bad(self, exc, *words, frameworks=("numpy", "torch")):
        def register(build):
            for fw in frameworks:
                marks = requires_torch if fw == "torch" else ()
                self.params.append(pytest.param(build, fw, exc, names(*words), marks=marks,
                                                id=f"{build.__name__}-{fw}"))
            return build

        return register


def run_case(build, framework, exc, match, rng) -> None:
    """The case's call raises exc with a message matching `match`, and every
    array it was given keeps its bits."""
    call, arrays = build(framework, rng)
    snaps = snapshot(*arrays)
    with pytest.raises(exc, match=match):
        call()
    assert_unchanged(arrays, snaps)


def setup(fw, rng, *, n=N, c=C, lead=(3,), score_dtype="float32"):
    """x [lead..., n, 4], distinct-ish scores [lead..., n] and an index output
    [lead..., c] of a valid compaction to capacity c."""
    x = make_data(lead + (n, 4), "float32", fw, rng)
    s = make_scores(lead + (n,), score_dtype, fw, rng, ties=False)
    out = to_framework(np.full(lead + (c,), -5, dtype=np.int64), fw)
    return x, s, out


def compact_call(x, s, out, capacity=C, **kwargs):
    def call():
        imoe.compact_(x, s, capacity, out_indices=out, **kwargs)

    return call, [a for a in (x, s, out) if a is not None and not isinstance(a, (list, str))]

