"""Role-keyed streams: one shared CUDA stream per (device, role), never one per layer.

The caching allocator keeps a pool per stream, and a CUDA graph captured over many streams keeps
each one's memory: a 32-layer model with a stream per layer multiplies its capture memory, while
every layer sharing the role streams ("alt", "alt_mlp", ...) reuses the same blocks.
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_lock = threading.Lock()
A = TypeVar("A")
B = TypeVar("B")


def get_stream(role: str, device: torch.device | int | None = None) -> torch.cuda.Stream | None:
    """The shared stream for `role` on `device` (default: the current CUDA device), created on
    first use; None where CUDA is absent, so callers fall back to serial code with one `if`."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None else torch.device("cuda", device).index
    if index is None:
        index = torch.cuda.current_device()
    with _lock:
        if (index, role) not in _streams:
            _streams[(index, role)] = torch.cuda.Stream(device=index)
        return _streams[(index, role)]


def run_branches(main: Callable[[], A], side: Callable[[], B], role: str = "alt") -> tuple[A, B]:
    """Run `side` on the role's stream while `main` runs on the current one; both results are
    ready on the current stream when this returns. Serial where CUDA is absent.

    The fork (side stream waits for the current one) orders the side branch after everything
    issued before it, including the reads of earlier branch outputs, which is what lets the
    allocator hand their blocks to this branch safely; the join (current waits for side) makes
    the side result visible before anyone reads it.
    """
    stream = get_stream(role)
    if stream is None:
        return main(), side()
    current = torch.cuda.current_stream()
    stream.wait_stream(current)  # fork
    with torch.cuda.stream(stream):
        side_result = side()
    main_result = main()
    current.wait_stream(stream)  # join
    return main_result, side_result
