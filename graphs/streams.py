"""Role-keyed streams: one shared CUDA stream per (device, role), never one per layer: a graph
captured over many streams keeps each one's allocator pool, so layers share the role streams."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_lock = threading.Lock()
A = TypeVar("A")
B = TypeVar("B")


def get_stream(role: str, device: torch.device | int | None = None) -> torch.cuda.Stream | None:
    """Created on first use; None where CUDA is absent, so callers fall back to serial code."""
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
    """`side` on the role's stream while `main` runs on the current one; both results ready on the
    current stream on return (serial without CUDA)."""
    stream = get_stream(role)
    if stream is None:
        return main(), side()
    current = torch.cuda.current_stream()
    stream.wait_stream(current)  # fork: after earlier reads, so their blocks may be reused
    with torch.cuda.stream(stream):
        side_result = side()
    main_result = main()
    current.wait_stream(stream)  # join: side's result visible before anyone reads it
    return main_result, side_result
