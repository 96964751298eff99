"""Capture state: whether the graph manager is capturing, and the batch's forward mode.

Capture mode alone does not tell decode from prefill (a prefill capture sets it too), so model
code decides overlap from both: `overlap_enabled(mode)` is true only for a *decode* batch
*while capturing*.
"""
from __future__ import annotations

import contextlib
import contextvars
import enum

import torch

_capturing = contextvars.ContextVar("moe_triton_capturing", default=False)


class ForwardMode(enum.Enum):
    DECODE = "decode"  # one new token per sequence
    PREFILL = "prefill"  # a chunk of prompt tokens (also extend)


def is_capture_mode() -> bool:
    # torch.compile never runs inside our graph manager (its own CUDA graphs are reduce-overhead's),
    # and its tracer cannot read a ContextVar: answer before looking
    return not torch.compiler.is_compiling() and _capturing.get()


@contextlib.contextmanager
def capture_mode():
    """Set only by the graph manager around warm-up and capture; cleared after, also on errors."""
    token = _capturing.set(True)
    try:
        yield
    finally:
        _capturing.reset(token)


def overlap_enabled(mode: ForwardMode) -> bool:
    """Branches overlap on alternate streams only in captured decode."""
    return is_capture_mode() and mode is ForwardMode.DECODE
