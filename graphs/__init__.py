"""Decode CUDA graphs (runner.py), role-keyed streams (streams.py) and the capture mode
(capture.py), as a small library models/ plugs into."""
from .capture import (
    ForwardMode,
    capture_mode,
    gathered_dispatch,
    is_capture_mode,
    overlap_enabled,
)
from .runner import (
    CaptureStats,
    DecodeGraphRunner,
    GraphConfig,
    StaticInput,
    bucket_for,
    capture_graph,
    default_batch_sizes,
)
from .streams import get_stream, run_branches

__all__ = [
    "ForwardMode", "capture_mode", "gathered_dispatch", "is_capture_mode", "overlap_enabled",
    "CaptureStats", "DecodeGraphRunner", "capture_graph", "GraphConfig", "StaticInput",
    "bucket_for", "default_batch_sizes",
    "get_stream", "run_branches",
]
