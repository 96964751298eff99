"""Capture state, set by the graph manager around warm-up and capture, and the switches it sets."""
from __future__ import annotations

import contextlib
import contextvars
import enum

import torch

_capturing = contextvars.ContextVar("moe_triton_capturing", default=False)
_overlap = contextvars.ContextVar("moe_triton_overlap", default=False)
_gathered_dispatch = contextvars.ContextVar("moe_triton_gathered_dispatch", default=False)


class ForwardMode(enum.Enum):
    DECODE = "decode"  # one new token per sequence
    PREFILL = "prefill"  # a chunk of prompt tokens (also extend)


def _read(flag: contextvars.ContextVar) -> bool:
    # torch.compile never runs inside our graph manager, and its tracer cannot read a ContextVar
    return not torch.compiler.is_compiling() and flag.get()


def is_capture_mode() -> bool:
    return _read(_capturing)


def overlap_enabled(mode: ForwardMode) -> bool:
    """Branches overlap on alternate streams only in captured decode (a prefill capture sets it)."""
    return _read(_overlap) and mode is ForwardMode.DECODE


def gathered_dispatch() -> bool:
    return _read(_gathered_dispatch)


@contextlib.contextmanager
def capture_mode(*, overlap: bool = True, gathered: bool = True):
    tokens = [(flag, flag.set(value)) for flag, value in
              ((_capturing, True), (_overlap, overlap), (_gathered_dispatch, gathered))]
    try:
        yield
    finally:
        for flag, token in reversed(tokens):
            flag.reset(token)
