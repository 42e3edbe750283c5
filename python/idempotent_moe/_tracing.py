"""Whether torch.compile is tracing the caller (`compiling`): the fact a
public operation reads to choose its route. While tracing, a public function
on torch tensors routes to its torch custom op (_torch_ops through _routes,
_moe_torch_ops through moe); the ops' real implementations call the
direct paths below them (_compaction, _paged, _moe_core), never the public
functions, so no call routes twice. Torch-free: `import idempotent_moe`
imports no torch.

`compiling` is read as an attribute (`_tracing.compiling()`): until torch is
imported it answers False and, once torch is there, it is replaced by
torch's own `torch.compiler.is_compiling` (about 0.2 us an eager call),
which torch.compile folds to True while it traces."""

from . import _arrays


def _until_torch() -> bool:
    global compiling
    torch = _arrays.torch_module()
    if torch is None:
        return False
    compiling = torch.compiler.is_compiling
    return compiling()


compiling = _until_torch
