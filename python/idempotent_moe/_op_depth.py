"""Whether the real implementation of one of the library's torch custom ops
is running now (`depth` > 0): the public function it calls then takes its
direct path even while a compile session is open, instead of routing to the
op again. A plain module global, so that the traced routing checks read it
on every torch version; torch-free, like every module `import idempotent_moe`
loads."""

import contextlib
from collections.abc import Iterator

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
