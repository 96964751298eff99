"""MoE model families built on the expert layer (issue 5; empty for now)."""
