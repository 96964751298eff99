"""Launch configuration: one function of (shape, token count, dtype, device) -> tile sizes.

No per-device tables: tiles follow from the token count, the shape and the element size; the
device enters only through two properties it reports (SM count, for how many tiles fill it;
shared memory per block, which the pipelined tiles must fit), so a device the function has never
seen still gets a sensible configuration. `fused_experts(config=...)` overrides it explicitly
(tests, tuning); `choose_config(split_k=...)` fixes the decode split for sweeps.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

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
    split_k: int = 1  # programs along K; > 1 hands float32 partials to the next stage (expert_gemm.py)

    def __post_init__(self):
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


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

    def describe(self) -> str:
        """One line for benchmark tables, e.g. `sorted BM16 up 64x128/s4/w4/tma/K2 down ...`."""
        def gemm(c: GemmConfig) -> str:
            return (f"{c.block_n}x{c.block_k}/s{c.num_stages}/w{c.num_warps}{'/tma' if c.tma_weights else ''}"
                    f"{f'/K{c.split_k}' if c.split_k > 1 else ''}")
        return f"{self.layout.value} BM{self.block_m} up {gemm(self.up)} down {gemm(self.down)}"


def _block_m(num_pairs: int, num_experts: int) -> int:
    # Rows per active expert: a tile taller than that is mostly padding. Past 32 rows the GEMMs
    # turn compute-bound, where 128-row tiles beat 64-row ones at every size swept.
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    for block_m in (16, 32):
        if rows_per_expert <= block_m:
            return block_m
    return 128


def _gemm_config(block_m: int, k: int, fused_gate: bool) -> GemmConfig:
    # Tiles from the H200 sweeps in docs/sweep-*.txt (benchmarks/sweep_configs.py), for 2-byte
    # operands. They read the shape only through these rules, so an unseen device still gets a
    # sane choice. Weight tiles come through TMA descriptors wherever the layout allows.
    if block_m <= 32:  # decode: stream the weights; long K steps keep bytes in flight
        block_n = 64 if fused_gate else 128  # a fused gate tile loads two weight tiles per step
        # group_m > 1: an expert with more rows than one block has consecutive row blocks; grouped
        # ordering runs them on each weight tile back to back, so the second read hits L2 (with
        # group_m=1 they ran a wave apart and re-read the tile from HBM: Mixtral M=64 at 0.74).
        return GemmConfig(block_m, block_n, block_k=128, group_m=8, num_warps=4, num_stages=4, tma_weights=True)
    # prefill: compute-bound; a fused gate tile carries two accumulators, so half the columns
    if fused_gate:
        block_k = 32 if k >= 4096 else 64
        return GemmConfig(block_m, 128, block_k, group_m=8, num_warps=8, num_stages=4, tma_weights=True)
    return GemmConfig(block_m, 256, block_k=64, group_m=8, num_warps=8, num_stages=4, tma_weights=True)


def _expected_blocks(num_tokens: int, top_k: int, num_experts: int, block_m: int, layout: LayoutKind) -> float:
    """Row blocks a layer is expected to fill: one per pair without the sort; else the experts
    hit under uniform routing, E (1 - (1 - K/E)^T), each with its share of rows in block_m tiles."""
    num_pairs = num_tokens * top_k
    if layout is LayoutKind.PER_PAIR:
        return num_pairs
    experts_hit = num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)
    return experts_hit * -(-num_pairs / experts_hit // block_m)


def _down_split_k(config: GemmConfig, blocks: float, n: int, k: int, num_sms: int) -> GemmConfig:
    # Fewer output tiles than SMs: cut the second GEMM's K in two (finalize sums the two float32
    # partials). The H200 sweep (docs/sweep-split-k-2026-11-29.txt, whole layer, graph replays)
    # measured 2-4% faster at Qwen3 and Mixtral M=1 and no gain past one wave. Splitting the first
    # GEMM measured slower at every decode size (up to 1.9x): its float32 [gate | up] partials
    # cost the second GEMM half its pipeline stages, so choose_config never splits it (explicit
    # configs still can).
    tiles = blocks * -(-n // config.block_n)
    k_steps = -(-k // config.block_k)
    return replace(config, split_k=2) if tiles < num_sms and k_steps >= 4 else config


def _for_element_size(config: GemmConfig, element_size: int) -> GemmConfig:
    # The tiles above fill shared memory with 2-byte operands; wider ones take proportionally shorter K steps.
    return replace(config, block_k=max(16, config.block_k * 2 // element_size))


def choose_config(num_tokens: int, top_k: int, num_experts: int, hidden_size: int, intermediate_size: int,
                  device: torch.device, dtype: torch.dtype = torch.bfloat16,
                  split_k: tuple[int, int] | None = None) -> MoEConfig:
    """Tiles for a layer with T tokens, top-k K, E experts, H hidden, I intermediate.

    `split_k` = (up, down) fixes the decode GEMMs' K slices instead of deriving them from the
    tile count (tuning, benchmarks/sweep_configs.py); shared memory is fitted either way."""
    num_pairs = num_tokens * top_k
    # Skip the sort when pairs rarely share an expert: one token's K experts are distinct, and
    # P^2 <= E keeps the expected number of shared experts under one half.
    layout = LayoutKind.PER_PAIR if num_tokens == 1 or num_pairs**2 <= num_experts else LayoutKind.SORTED
    if device.type != "cuda":  # Triton interpreter: few large programs run fastest
        return MoEConfig(GemmConfig(16, 32, 32, group_m=1), GemmConfig(16, 32, 32, group_m=1), layout)
    block_m = 16 if layout is LayoutKind.PER_PAIR else _block_m(num_pairs, num_experts)
    element_size = dtype.itemsize
    up = _for_element_size(_gemm_config(block_m, k=hidden_size, fused_gate=True), element_size)
    down = _for_element_size(_gemm_config(block_m, k=intermediate_size, fused_gate=False), element_size)
    if block_m <= 32:  # decode: few row blocks
        blocks = _expected_blocks(num_tokens, top_k, num_experts, block_m, layout)
        num_sms, shared_memory = _device_limits(device)
        if split_k is None:
            down = _down_split_k(down, blocks, hidden_size, intermediate_size, num_sms)
        else:
            up, down = replace(up, split_k=split_k[0]), replace(down, split_k=split_k[1])
        # With a split first GEMM the second one loads float32 [gate | up] partials per slice.
        down = _fit_shared_memory(down, element_size, a_tiles=2 * up.split_k if up.split_k > 1 else 0,
                                  limit=shared_memory)
    return MoEConfig(up, down, layout)


def _fit_shared_memory(config: GemmConfig, element_size: int, a_tiles: int, limit: int) -> GemmConfig:
    """Fewer stages, then shorter K steps, until num_stages copies of every tile the K loop loads
    fit in shared memory (Triton pipelines each load). `a_tiles` float32 `a` tiles per step
    replace the usual one `a` tile of `element_size` bytes."""
    def stage_bytes(c: GemmConfig) -> int:
        a = a_tiles * c.block_m * c.block_k * 4 if a_tiles else c.block_m * c.block_k * element_size
        return a + c.block_n * c.block_k * element_size

    while config.num_stages * stage_bytes(config) > limit * SHARED_MEMORY_USE:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_k > 16:
            config = replace(config, block_k=config.block_k // 2, num_stages=4)
        else:
            break
    return config


SHARED_MEMORY_USE = 0.85  # leave room for the epilogue's and the compiler's own buffers


@functools.lru_cache(maxsize=None)
def _device_limits(device: torch.device) -> tuple[int, int]:
    """(SM count, shared memory per block with opt-in, bytes) of a CUDA device."""
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.shared_memory_per_block_optin
