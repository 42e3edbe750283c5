"""The one route choice of a compaction operation: the public functions of
`functional` and `paged` ask `traced_ops` first; while torch.compile traces a
call on torch tensors they call the operation's torch custom op (`_torch_ops`),
else its direct path (`_compaction`, `_paged`). The ops' real implementations
call the direct paths themselves, so a call is routed once, at its public
function. Imports `_torch_ops` (and with it torch) only while tracing."""

from __future__ import annotations

from typing import Any

from . import _tracing


def traced_ops(*arrays: Any) -> Any:
    """The module of torch ops (`_torch_ops`) when torch.compile is tracing a
    call on torch tensors, else None: then the call takes its direct path.
    Costs an eager call about 0.2 us (torch's is_compiling)."""
    if not _tracing.compiling():
        return None
    from . import _torch_ops

    return _torch_ops if _torch_ops.takes(*arrays) else None
