"""Launch configuration: one function of (shape, token count, dtype, device) -> tile sizes.

No per-device tables: tiles follow from the token count, the shape and the element size; the
device enters only through two properties it reports (SM count, for how many tiles fill it;
shared memory per block, which the pipelined tiles must fit), so a device the function has never
seen still gets a sensible configuration. `run_experts(config=...)` overrides it explicitly
(tests, tuning); `choose_config(down_split=...)` fixes the decode split for sweeps.

Legend as everywhere: T tokens, K top-k, E experts, H hidden, I intermediate; a GEMM's tile is
BLOCK_M rows x BLOCK_N output columns, stepping BLOCK_C along its contraction width C.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from .expand import LayoutKind


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows per tile; also the expand stage's segment padding
    block_n: int  # output columns per tile
    block_c: int  # contraction width per step
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma_weights: bool = False  # load weight tiles through a TMA descriptor where the layout allows
    split_c: int = 1  # programs along C (split-K); > 1 hands float32 partials to finalize (expert_gemm.py)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_c"):  # tl.arange needs powers of two, tl.dot at least 16
            if not _power_of_two(getattr(self, name), at_least=16):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {getattr(self, name)!r}")
        if not _power_of_two(self.num_warps, at_least=1):
            raise ValueError(f"GemmConfig.num_warps must be a power of two, got {self.num_warps!r}")
        for name in ("group_m", "num_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GemmConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.split_c, int) or self.split_c < 1:
            raise ValueError(f"split_c must be >= 1, got {self.split_c}")

    def kernel_args(self) -> dict:
        """The expert GEMM kernel's tile constexprs."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_C=self.block_c, GROUP_M=self.group_m,
                    SPLIT_C=self.split_c)

    def launch_options(self) -> dict:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the two expert GEMMs; they share block_m because they share one ExpertLayout."""

    up: GemmConfig  # hidden -> act(gate) * up, (R, H) x (E, 2I, H); never split along C
    down: GemmConfig  # (R, I) x (E, H, I)
    layout: LayoutKind = LayoutKind.SORTED

    def __post_init__(self):
        if not isinstance(self.up, GemmConfig) or not isinstance(self.down, GemmConfig) or not isinstance(
                self.layout, LayoutKind):
            raise ValueError(f"MoEConfig takes two GemmConfigs and a LayoutKind, got {self.up!r}, {self.down!r}, "
                             f"{self.layout!r}")
        if self.up.block_m != self.down.block_m:
            raise ValueError(f"up.block_m={self.up.block_m} and down.block_m={self.down.block_m} must match")
        if self.up.split_c > 1:
            raise ValueError(f"up.split_c={self.up.split_c}: the first GEMM's activation needs the whole sum; "
                             "split only the second GEMM (down.split_c)")

    @property
    def block_m(self) -> int:
        return self.up.block_m

    def describe(self) -> str:
        """One line for benchmark tables, e.g. `sorted BM16 up 64x128/s4/w4/tma down 128x128/s4/w4/tma/S2`."""
        def gemm(c: GemmConfig) -> str:
            return (f"{c.block_n}x{c.block_c}/s{c.num_stages}/w{c.num_warps}{'/tma' if c.tma_weights else ''}"
                    f"{f'/S{c.split_c}' if c.split_c > 1 else ''}")
        return f"{self.layout.value} BM{self.block_m} up {gemm(self.up)} down {gemm(self.down)}"


def _power_of_two(value, at_least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= at_least and not value & (value - 1)


def _block_m(num_pairs: int, num_experts: int, fp8: bool) -> int:
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if fp8:
        # Not past 16 rows: the FP8 step promotion adds a third float32 tile to the fused gate's two,
        # and 128-row tiles spill (docs/sweep-fp8-prefill-2026-11-30.txt: 64-row tiles 1.6-3.5x
        # faster from 32 rows per expert up).
        return 16 if rows_per_expert <= 16 else 64
    # The tile must hold the busiest expert's rows, not the average expert's: a tile short of them
    # gives that expert a second row block. Under uniform routing an expert's rows are near-binomial
    # and the largest of E such counts sits near mean + sqrt(2 ln(E) mean) (the H200 sweep's
    # measured maxima were 80-100% of it, docs/sweep-block-m-2026-11-30.txt). There, 32-row tiles
    # beat 16-row ones by 4-11% at 16 rows per expert, 64-row tiles beat 32-row ones by 13% at 32;
    # past 64 rows the GEMMs are compute-bound and 128-row tiles win at every size swept.
    busiest = rows_per_expert + math.sqrt(2 * math.log(max(num_experts, 2)) * rows_per_expert)
    for block_m in (16, 32, 64):
        if busiest <= block_m:
            return block_m
    return 128


def _gemm_config(block_m: int, c: int, fused_gate: bool, streaming: bool) -> GemmConfig:
    # Tiles from the H200 sweeps in docs/sweep-*.txt (benchmarks/sweep_configs.py), for 2-byte
    # operands. They read the shape only through these rules, so an unseen device still gets a
    # sane choice. Weight tiles come through TMA descriptors wherever the layout allows.
    if streaming:  # decode: stream the weights; long C steps keep bytes in flight
        block_n = 64 if fused_gate else 128  # a fused gate tile loads two weight tiles per step
        # group_m > 1: an expert with more rows than one block has consecutive row blocks; grouped
        # ordering runs them on each weight tile back to back, so the second read hits L2 (with
        # group_m=1 they ran a wave apart and re-read the tile from HBM: Mixtral M=64 at 0.74).
        return GemmConfig(block_m, block_n, block_c=128, group_m=8, num_warps=4, num_stages=4, tma_weights=True)
    # prefill: compute-bound; a fused gate tile carries two accumulators, so half the columns
    if fused_gate:
        block_c = 32 if c >= 4096 else 64
        return GemmConfig(block_m, 128, block_c, group_m=8, num_warps=8, num_stages=4, tma_weights=True)
    return GemmConfig(block_m, 256, block_c=64, group_m=8, num_warps=8, num_stages=4, tma_weights=True)


def _expected_blocks(num_tokens: int, top_k: int, num_experts: int, block_m: int, layout: LayoutKind) -> float:
    """Row blocks a layer is expected to fill: one per pair without the sort; else the experts
    hit under uniform routing, E (1 - (1 - K/E)^T), each with its share of rows in block_m tiles."""
    num_pairs = num_tokens * top_k
    if layout is LayoutKind.PER_PAIR:
        return num_pairs
    experts_hit = num_experts * (1 - (1 - min(top_k, num_experts) / num_experts) ** num_tokens)  # K > E: filtered ids
    return experts_hit * -(-num_pairs / experts_hit // block_m)


def _down_split(config: GemmConfig, blocks: float, n: int, c: int, num_sms: int) -> GemmConfig:
    # Fewer output tiles than SMs: cut the second GEMM's C in two (finalize sums the two float32
    # partials). The H200 sweep (docs/sweep-split-k-2026-11-29.txt, whole layer, graph replays)
    # measured 2-4% faster at Qwen3 and Mixtral M=1 and no gain past one wave. Splitting the first
    # GEMM measured slower at every decode size (up to 1.9x) and is not offered.
    tiles = blocks * -(-n // config.block_n)
    c_steps = -(-c // config.block_c)
    return replace(config, split_c=2) if tiles < num_sms and c_steps >= 4 else config


def _for_element_size(config: GemmConfig, element_size: int) -> GemmConfig:
    # The tiles above fill shared memory with 2-byte operands; wider ones take proportionally shorter C steps.
    return replace(config, block_c=max(16, config.block_c * 2 // element_size))


def choose_config(num_tokens: int, top_k: int, num_experts: int, hidden_size: int, intermediate_size: int,
                  device: torch.device, dtype: torch.dtype = torch.bfloat16, down_split: int | None = None,
                  fp8_group: int = 128) -> MoEConfig:
    """Tiles for a layer with T tokens, top-k K, E experts, H hidden, I intermediate, weights in `dtype`
    (float8_e4m3fn for FP8 experts, whose C steps stay within `fp8_group`, the weight blocks' width,
    down to FP8_MIN_STEP: narrower blocks are scaled within the step, expert_gemm.py).

    `down_split` fixes the second decode GEMM's C slices instead of deriving them from the tile
    count (tuning, benchmarks/sweep_configs.py); shared memory is fitted either way."""
    num_pairs = num_tokens * top_k
    # Skip the sort when pairs rarely share an expert: one token's K experts are distinct, and
    # P^2 <= E keeps the expected number of shared experts under one half.
    layout = LayoutKind.PER_PAIR if num_tokens == 1 or num_pairs**2 <= num_experts else LayoutKind.SORTED
    if device.type != "cuda":  # Triton interpreter: few large programs run fastest
        tile = GemmConfig(16, 32, 32, group_m=1)
        return MoEConfig(tile, tile, layout)
    element_size = dtype.itemsize
    fp8 = element_size == 1
    block_m = 16 if layout is LayoutKind.PER_PAIR else _block_m(num_pairs, num_experts, fp8)
    if fp8 and fp8_group < FP8_MIN_STEP:
        # Blocks scaled within the step hold float32 copies of the tiles: the 16-row decode tiles
        # fit them on every FP8 GPU (prefill's 64-row tiles needed 139 KB on SM89, which has 99)
        block_m = 16
    # Weight-streaming tiles up to 64 rows (32 for FP8, whose only wider tile is its prefill tile)
    streaming = block_m <= (32 if fp8 else 64)
    up = _for_element_size(_gemm_config(block_m, hidden_size, fused_gate=True, streaming=streaming), element_size)
    down = _for_element_size(_gemm_config(block_m, intermediate_size, fused_gate=False, streaming=streaming),
                             element_size)
    num_sms, shared_memory = device_limits(device)
    fit = dict(min_block_c=16)
    if fp8:
        up, down = _fp8_steps(up, down, fp8_group)
        fit = dict(min_block_c=FP8_MIN_STEP, dequantized=fp8_group < FP8_MIN_STEP)
    if fp8 or streaming:
        up = _fit_shared_memory(up, element_size, limit=shared_memory, weight_tiles=2, **fit)
    if block_m <= 32:  # decode: few row blocks
        blocks = _expected_blocks(num_tokens, top_k, num_experts, block_m, layout)
        if down_split is None:
            down = _down_split(down, blocks, hidden_size, intermediate_size, num_sms)
        else:
            down = replace(down, split_c=down_split)
    if streaming:
        down = _fit_shared_memory(down, element_size, limit=shared_memory, **fit)
    return MoEConfig(up, down, layout)


def _fp8_steps(up: GemmConfig, down: GemmConfig, group: int = 128) -> tuple[GemmConfig, GemmConfig]:
    # FP8 scales come per C group: a step of the first GEMM is one 128-wide activation and
    # weight-block group (every public block is 128 x 128; a narrower block narrows the step), and
    # the second GEMM's steps stay within the groups the first GEMM's epilogue quantizes: one per
    # block_n output columns. Powers of two, so the smallest of them divides the others. Never
    # under FP8_MIN_STEP: narrower groups are scaled within the step.
    step = max(FP8_MIN_STEP, min(FP8_GROUP, group))
    up = replace(up, block_c=step)
    return up, replace(down, block_c=max(FP8_MIN_STEP, min(up.block_n, step)))


FP8_GROUP = 128  # the widest C step an FP8 scale group spans
FP8_MIN_STEP = 32  # an 8-bit tl.dot needs a contraction of at least 32 on SM90


def _fit_shared_memory(config: GemmConfig, element_size: int, limit: int, weight_tiles: int = 1,
                       min_block_c: int = 16, dequantized: bool = False) -> GemmConfig:
    """Fewer stages, then shorter C steps (down to `min_block_c`), until num_stages copies of every
    tile the C loop loads fit in shared memory (Triton pipelines each load), with one float32 copy
    of them when `dequantized` (FP8 scaled within the step); a fused gate loads two weight tiles."""
    def tile_elements(c: GemmConfig) -> int:
        return (c.block_m + weight_tiles * c.block_n) * c.block_c

    def total_bytes(c: GemmConfig) -> int:
        float32_copy = tile_elements(c) * 4 if dequantized else 0
        return c.num_stages * tile_elements(c) * element_size + float32_copy

    while total_bytes(config) > limit * SHARED_MEMORY_USE:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_c > min_block_c:
            config = replace(config, block_c=config.block_c // 2, num_stages=4)
        else:
            break
    return config


SHARED_MEMORY_USE = 0.85  # leave room for the epilogue's and the compiler's own buffers


@functools.lru_cache(maxsize=None)
def device_limits(device: torch.device) -> tuple[int, int]:
    """(SM count, shared memory per block with opt-in, bytes) of a CUDA device."""
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.shared_memory_per_block_optin
