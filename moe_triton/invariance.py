"""Batch-invariant mode: every token's output bit-identical whatever else shares its batch.

    with moe_triton.batch_invariant():
        out = layer(x)            # row t of out: the same bits as layer(x[t:t + 1])[0]

What changes inside it: the expert GEMMs take one tile configuration for every token count (the
prefill tiles, so no decode split-K whose count follows T: pipeline.default_config), and the
router's matmul runs in `linear.linear`, whose contraction order is fixed, in place of torch's,
whose BLAS picks kernels by the number of rows. Everything else in the layer already works row by
row in a fixed order (routing, expand, the per-token FP8 quantization, finalize's sum over the K
slots in slot order). Modules the layer calls but does not own (shared experts, an input or
output projection) are invariant only if they are; moe_triton.models' own (models/layers.py:
`Linear`, `gated_activation`, the rotary table, decode attention's split) read the mode too.
Read at each call, on the host: a plan made in one mode is never reused in the other.

The mode is one process-wide flag, not a context variable: torch.compile reads a module global
(and guards on it, recompiling when it flips) but cannot trace ContextVar.get. Threads that need
different modes at once cannot have them.
"""
from __future__ import annotations

import contextlib

_batch_invariant = False


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Within the block, calls are batch-invariant (module docstring); nested blocks restore the
    outer mode when they end."""
    global _batch_invariant
    if not isinstance(enabled, bool):
        raise ValueError(f"batch_invariant(enabled) takes True or False, got {enabled!r}")
    outer, _batch_invariant = _batch_invariant, enabled
    try:
        yield
    finally:
        _batch_invariant = outer


def batch_invariant_enabled() -> bool:
    return _batch_invariant
