"""The two facts every public operation reads to choose its route: whether
torch.compile is tracing the caller (`compiling`), and whether one of the
library's torch custom ops is running its real implementation now (`depth`
> 0, `inside_op`). While tracing, a public function on torch tensors routes
to its custom op (_torch_ops, _moe_torch_ops); inside an op's real
implementation it takes its direct path, so that it does not route to the
op again. Torch-free: `import idempotent_moe` imports no torch.

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
