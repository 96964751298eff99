"""Decode CUDA graphs and role-keyed streams, as a small library models/ plugs into.

    streams.py  get_stream(role): one shared stream per (device, role); run_branches(main, side)
    capture.py  capture_mode(), is_capture_mode(), ForwardMode; overlap_enabled(mode) (captured
                decode only), gathered_dispatch() (the all-to-all's fixed-capacity form)
    runner.py   DecodeGraphRunner: a graph per batch-size bucket over a decode step's static tensors;
                capture_graph: one graph over a step called on several input sets (benchmarks, tests)
"""
from .capture import ForwardMode, capture_mode, gathered_dispatch, is_capture_mode, overlap_enabled
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
    "CaptureStats", "DecodeGraphRunner", "capture_graph", "GraphConfig", "StaticInput", "bucket_for", "default_batch_sizes",
    "get_stream", "run_branches",
]
