"""The facts a public operation reads to choose its route: whether
torch.compile is tracing the caller (`compiling`), and, for the MoE
operations, whether one of their torch custom ops is running its real
implementation now (`depth` > 0, `inside_op`). While tracing, a public
function on torch tensors routes to its custom op (_torch_ops through
_routes, _moe_torch_ops); an MoE op's real implementation calls the public
function again, which then takes its direct path instead of routing to the op
again. (The compaction ops' implementations call their direct paths,
_compaction and _paged, themselves: they need no depth.) Torch-free:
`import idempotent_moe` imports no torch.

`compiling` is read as an attribute (`_tracing.compiling()`): until torch is
imported it answers False and, once torch is there, it is replaced by
torch's own `torch.compiler.is_compiling` (about 0.2 us an eager call),
which torch.compile folds to True while it traces."""

import contextlib
from collections.abc import Iterator

from . import _arrays

depth = 0


@contextlib.contextmanager
def inside_op() -> Iterator[None]:
    """Around an op's real implementation."""
    global depth
    depth += 1
    try:
        yield
    finally:
        depth -= 1


def _until_torch() -> bool:
    global compiling
    torch = _arrays.torch_module()
    if torch is None:
        return False
    compiling = torch.compiler.is_compiling
    return compiling()


compiling = _until_torch
