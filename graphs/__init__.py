"""Decode CUDA-graph capture and role-keyed streams (issue 4; empty for now)."""
