"""Launch configuration: one function of (shape, token count, dtype, device) -> tile sizes.

No per-device tables: the choice reads the device's multiprocessor count and falls back to
sensible tiles for any device it has never seen. `fused_experts(config=...)` overrides it
explicitly (tests, tuning).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .expand import LayoutKind


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows per tile; also the expand stage's segment padding
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma_weights: bool = False  # load weight tiles through a TMA descriptor where the layout allows


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the two expert GEMMs; they share block_m because they share one ExpertLayout."""

    up: GemmConfig  # hidden -> act(gate) * up, (R, H) x (E, 2I, H)
    down: GemmConfig  # (R, I) x (E, H, I)
    layout: LayoutKind = LayoutKind.SORTED

    def __post_init__(self):
        if self.up.block_m != self.down.block_m:
            raise ValueError(f"up.block_m={self.up.block_m} and down.block_m={self.down.block_m} must match")

    @property
    def block_m(self) -> int:
        return self.up.block_m


def _block_m(num_pairs: int, num_experts: int) -> int:
    # Rows per active expert: a tile taller than that is mostly padding. Past 32 rows the GEMMs
    # turn compute-bound, where 128-row tiles beat 64-row ones at every size swept.
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    for block_m in (16, 32):
        if rows_per_expert <= block_m:
            return block_m
    return 128


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _gemm_config(block_m: int, n: int, k: int, num_tiles_m: int, num_sms: int, fused_gate: bool) -> GemmConfig:
    # Tiles from the H200 sweep in docs/sweep-2026-11-29.txt (benchmarks/sweep_configs.py); they
    # depend on the shape only through these rules, so an unseen device still gets a sane choice.
    if block_m <= 32:  # decode: stream the weights with long K steps and enough tiles in flight
        if fused_gate:  # two weight tiles (gate, up) per step
            return GemmConfig(block_m, 64, block_k=256, group_m=1, num_warps=4, num_stages=3)
        if k >= 4096:  # a long reduction keeps bytes in flight even with few, wide tiles
            return GemmConfig(block_m, 128, block_k=128, group_m=1, num_warps=4, num_stages=4)
        block_n = 64 if num_tiles_m * triton.cdiv(n, 64) >= 2 * num_sms else 32
        return GemmConfig(block_m, block_n, block_k=128, group_m=1, num_warps=4, num_stages=4)
    # prefill: compute-bound; a fused gate tile carries two accumulators, so half the columns
    if fused_gate:
        return GemmConfig(block_m, 128, block_k=64, group_m=8, num_warps=8, num_stages=4)
    return GemmConfig(block_m, 256, block_k=64, group_m=8, num_warps=8, num_stages=3)


def choose_config(num_tokens: int, top_k: int, num_experts: int, hidden_size: int,
                  intermediate_size: int, device: torch.device) -> MoEConfig:
    """Tiles for a layer with T tokens, top-k K, E experts, H hidden, I intermediate."""
    num_pairs = num_tokens * top_k
    # Skip the sort when pairs rarely share an expert: one token's K experts are distinct, and
    # P^2 <= E keeps the expected number of shared experts under one half.
    layout = LayoutKind.PER_PAIR if num_tokens == 1 or num_pairs**2 <= num_experts else LayoutKind.SORTED
    if device.type != "cuda":  # Triton interpreter: few large programs run fastest
        return MoEConfig(GemmConfig(16, 32, 32, group_m=1), GemmConfig(16, 32, 32, group_m=1), layout)
    block_m = 16 if layout is LayoutKind.PER_PAIR else _block_m(num_pairs, num_experts)
    tiles_m = num_pairs if layout is LayoutKind.PER_PAIR else triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    num_sms = _num_sms(device)
    return MoEConfig(
        up=_gemm_config(block_m, intermediate_size, hidden_size, tiles_m, num_sms, fused_gate=True),
        down=_gemm_config(block_m, hidden_size, intermediate_size, tiles_m, num_sms, fused_gate=False),
        layout=layout,
    )
