"""Launch configuration: (shape, token count, dtype, SM count, shared memory) -> tile sizes, by
rules measured on the H200 (see docs/PERFORMANCE.md, "Provenance moved out of the code (issue
26)"). A tile is BLOCK_M rows x BLOCK_N columns, stepping BLOCK_C along the contraction C."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton

from .expand import LayoutKind
from .platform import device_limits
from .weights import MXFP4_DTYPE, MXFP4_GROUP


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows per tile; also the expand stage's segment padding
    block_n: int  # output columns per tile
    block_c: int  # contraction width per step
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma_weights: bool = False  # weight tiles through a TMA descriptor where the layout allows
    split_c: int = 1  # programs along C (split-K); > 1 hands float32 partials to finalize
    # > 0: that many programs walk the tiles of the rows in use (sorted layout), else one per tile
    persistent_programs: int = 0
    tma_activations: bool = False  # row-space activations (down's) through a TMA descriptor
    # FP8 weight blocks at least a tile wide: one scale per step, so the promotion is an FMA per
    # element; off, a scale per column, whose vector load the pipeliner overlaps (decode's)
    scale_per_tile: bool = False
    # launched by PDL behind the first GEMM (decode's second; finalize too): its launch and
    # prologue overlap that one's tail, then it waits for its activations
    chained: bool = False

    def __post_init__(self):
        _check_tile_fields(self, ("block_m", "block_n", "block_c"), ("group_m", "num_stages"))
        if not isinstance(self.split_c, int) or self.split_c < 1:
            raise ValueError(f"split_c must be >= 1, got {self.split_c}")
        if not isinstance(self.persistent_programs, int) or self.persistent_programs < 0:
            raise ValueError("GemmConfig.persistent_programs must be an integer >= 0 (0: one "
                             f"program per tile), got {self.persistent_programs!r}")

    def kernel_args(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_C=self.block_c,
                    GROUP_M=self.group_m, SPLIT_C=self.split_c)

    def launch_options(self) -> dict:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class DecodeConfig:
    """The decode kernel's tiles (decode.py): `programs` persistent programs; up's units are
    block_n intermediate columns of a row block over all of H, stepping block_c; down's are
    block_h output columns over all of I, stepping block_i."""

    block_m: int = 16
    block_n: int = 64  # w13 rows a tile (the MMA's M)
    block_c: int = 128
    block_h: int = 64  # w2 rows a tile
    block_i: int = 128  # down's contraction step
    programs: int = 1  # the grid: at most one program per SM (a cooperative launch on a GPU)
    num_warps: int = 4
    num_stages: int = 4
    tma_weights: bool = True

    def __post_init__(self):
        _check_tile_fields(self, ("block_m", "block_n", "block_c", "block_h", "block_i"),
                           ("num_stages", "programs"))

    def launch_options(self) -> dict:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the two expert GEMMs; they share block_m because they share one ExpertLayout."""

    up: GemmConfig  # hidden -> act(gate) * up, (R, H) x (E, 2I, H); never split along C
    down: GemmConfig  # (R, I) x (E, H, I)
    layout: LayoutKind = LayoutKind.SORTED
    # set: both GEMMs in the decode kernel instead (opt-in: decode_config)
    decode: DecodeConfig | None = None

    def __post_init__(self):
        if (not isinstance(self.up, GemmConfig) or not isinstance(self.down, GemmConfig)
                or not isinstance(self.layout, LayoutKind)):
            raise ValueError(f"MoEConfig takes two GemmConfigs and a LayoutKind, got {self.up!r}, "
                             f"{self.down!r}, {self.layout!r}")
        if self.up.block_m != self.down.block_m:
            raise ValueError(f"up.block_m={self.up.block_m} and down.block_m={self.down.block_m} "
                             "must match")
        if self.decode is not None and (not isinstance(self.decode, DecodeConfig)
                                        or self.decode.block_m != self.up.block_m):
            raise ValueError(f"decode must be a DecodeConfig with block_m={self.up.block_m} (the "
                             f"shared layout's), got {self.decode!r}")
        if self.decode is not None and self.layout not in DECODE_LAYOUTS:
            walks = " or ".join(kind.name for kind in DECODE_LAYOUTS)
            raise ValueError(f"the decode kernel walks a {walks} layout, got "
                             f"layout={self.layout}: pass one of those")
        if self.up.split_c > 1:
            raise ValueError(f"up.split_c={self.up.split_c}: the first GEMM's activation needs the "
                             "whole sum; split only the second GEMM (down.split_c)")

    @property
    def block_m(self) -> int:
        return self.up.block_m

    def describe(self) -> str:
        def gemm(c: GemmConfig) -> str:
            return (f"{c.block_n}x{c.block_c}/s{c.num_stages}/w{c.num_warps}"
                    f"{'/tma' if c.tma_weights else ''}{'/tma_a' if c.tma_activations else ''}"
                    f"{f'/P{c.persistent_programs}' if c.persistent_programs else ''}"
                    f"{f'/S{c.split_c}' if c.split_c > 1 else ''}{'/pdl' if c.chained else ''}")
        if self.decode is not None:
            d = self.decode
            return (f"{self.layout.value} BM{self.block_m} decode {d.block_n}x{d.block_c}x"
                    f"{d.block_h}x{d.block_i}/P{d.programs}/s{d.num_stages}/w{d.num_warps}"
                    f"{'/tma' if d.tma_weights else ''}")
        return f"{self.layout.value} BM{self.block_m} up {gemm(self.up)} down {gemm(self.down)}"


def _check_tile_fields(config, blocks: tuple[str, ...], counts: tuple[str, ...]) -> None:
    """Tile sizes powers of two (tl.arange) of at least 16 (tl.dot), warps a power of two, and
    counts (stages, groups) integers >= 1; errors name the config class and field."""
    kind = type(config).__name__
    for name in blocks:
        if not _power_of_two(getattr(config, name), at_least=16):
            raise ValueError(f"{kind}.{name} must be a power of two >= 16, "
                             f"got {getattr(config, name)!r}")
    if not _power_of_two(config.num_warps, at_least=1):
        raise ValueError(f"{kind}.num_warps must be a power of two, got {config.num_warps!r}")
    for name in counts:
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
            raise ValueError(f"{kind}.{name} must be an integer >= 1, "
                             f"got {getattr(config, name)!r}")


def _power_of_two(value, at_least: int) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= at_least
            and not value & (value - 1))


def _block_m(num_pairs: int, num_experts: int, fp8: bool) -> int:
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if fp8:
        # FP8's step promotion adds a third float32 tile to the fused gate's two: 128 rows spill
        return 16 if rows_per_expert <= 16 else 64
    # fit the busiest expert: the largest of E near-binomial counts is ~ mean + sqrt(2 ln(E) mean)
    busiest = rows_per_expert + math.sqrt(2 * math.log(max(num_experts, 2)) * rows_per_expert)
    for block_m in (16, 32, 64):
        if busiest <= block_m:
            return block_m
    return 128


def _gemm_config(block_m: int, c: int, fused_gate: bool, streaming: bool) -> GemmConfig:
    if streaming:  # decode: stream the weights; long C steps keep bytes in flight
        block_n = 64 if fused_gate else 128  # a fused gate tile loads two weight tiles per step
        # group_m > 1: an expert's row blocks run back to back on a weight tile, re-read from L2
        return GemmConfig(block_m, block_n, block_c=128, group_m=8, num_warps=4, num_stages=4,
                          tma_weights=True)
    # prefill: compute-bound; a fused gate tile carries two accumulators, so half the columns
    if fused_gate:
        block_c = 32 if c >= 4096 else 64
        return GemmConfig(block_m, 128, block_c, group_m=8, num_warps=8, num_stages=4,
                          tma_weights=True)
    return GemmConfig(block_m, 256, block_c=64, group_m=8, num_warps=8, num_stages=4,
                      tma_weights=True)


def _expected_blocks(num_tokens: int, top_k: int, num_experts: int, block_m: int,
                     layout: LayoutKind) -> float:
    """One per pair unsorted; else E (1 - (1 - K/E)^T) experts hit, their rows in block_m tiles."""
    num_pairs = num_tokens * top_k
    if layout is LayoutKind.PER_PAIR:
        return num_pairs
    # K > E: filtered ids
    experts_hit = num_experts * (1 - (1 - min(top_k, num_experts) / num_experts) ** num_tokens)
    return experts_hit * -(-num_pairs / experts_hit // block_m)


def _down_split(config: GemmConfig, blocks: float, n: int, c: int, num_sms: int) -> GemmConfig:
    # Fewer output tiles than SMs: split down's C in two (finalize sums the float32 partials)
    tiles = blocks * -(-n // config.block_n)
    c_steps = -(-c // config.block_c)
    return replace(config, split_c=2) if tiles < num_sms and c_steps >= 4 else config


def _for_element_size(config: GemmConfig, element_size: int) -> GemmConfig:
    # The tiles fill shared memory with 2-byte operands; wider ones take shorter C steps.
    return replace(config, block_c=max(16, config.block_c * 2 // element_size))


def choose_config(num_tokens: int, top_k: int, num_experts: int, hidden_size: int,
                  intermediate_size: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                  down_split: int | None = None, fp8_group: int = 128) -> MoEConfig:
    """Tiles for weights in `dtype` (FP8: C steps within `fp8_group`, the blocks' width; uint8:
    MXFP4, whose tiles are bf16's, expanded in registers, in whole 32-value groups); `down_split`
    fixes the decode down GEMM's C slices (sweeps)."""
    if dtype == MXFP4_DTYPE:
        config = choose_config(num_tokens, top_k, num_experts, hidden_size, intermediate_size,
                               device, torch.bfloat16, down_split)
        return replace(config, up=_whole_groups(config.up), down=_whole_groups(config.down))
    num_pairs = num_tokens * top_k
    # Skip the sort when pairs rarely share an expert: one token's K experts are distinct, and
    # P^2 <= E keeps the expected number of shared experts under one half.
    layout = (LayoutKind.PER_PAIR if num_tokens == 1 or num_pairs**2 <= num_experts
              else LayoutKind.SORTED)
    if device.type != "cuda":  # Triton interpreter: few large programs run fastest
        tile = GemmConfig(16, 32, 32, group_m=1)
        return MoEConfig(tile, tile, _unsorted_if_it_fits(layout, 16, num_pairs))
    element_size = dtype.itemsize
    fp8 = element_size == 1
    block_m = 16 if layout is LayoutKind.PER_PAIR else _block_m(num_pairs, num_experts, fp8)
    layout = _unsorted_if_it_fits(layout, block_m, num_pairs)
    if fp8 and fp8_group < FP8_MIN_STEP:
        # scaled within the step: float32 tile copies fit every FP8 GPU only in 16-row tiles
        block_m = 16
    streaming = block_m <= (32 if fp8 else 64)
    up = _for_element_size(_gemm_config(block_m, hidden_size, fused_gate=True, streaming=streaming),
                           element_size)
    down = _for_element_size(_gemm_config(block_m, intermediate_size, fused_gate=False,
                                          streaming=streaming), element_size)
    num_sms, shared_memory = device_limits(device)
    fit = dict(min_block_c=16)
    if fp8:
        up, down = _fp8_steps(up, down, fp8_group)
        fit = dict(min_block_c=FP8_MIN_STEP, dequantized=fp8_group < FP8_MIN_STEP)
    if fp8 or streaming:
        up = _fit_shared_memory(up, element_size, limit=shared_memory, weight_tiles=2, **fit)
    blocks = _expected_blocks(num_tokens, top_k, num_experts, block_m, layout)
    if block_m <= 32:  # decode: few row blocks
        if down_split is None:
            down = _down_split(down, blocks, hidden_size, intermediate_size, num_sms)
        else:
            down = replace(down, split_c=down_split)
    if streaming:
        down = _fit_shared_memory(down, element_size, limit=shared_memory, **fit)
        # PDL: measured 3-8% faster where up's tiles fill at most two waves; slower (FP8 up to
        # 1.4x) past them (docs/PERFORMANCE.md, issue 28)
        up_tiles = blocks * -(-intermediate_size // up.block_n)
        down = replace(down, chained=up_tiles <= 2 * num_sms)
    else:
        up, down = replace(up, scale_per_tile=fp8), _prefill_down(down, fp8)
    return MoEConfig(up, down, layout)


def _whole_groups(config: GemmConfig) -> GemmConfig:
    return replace(config, block_c=max(config.block_c, MXFP4_GROUP))


def decode_config(num_tokens: int, top_k: int, num_experts: int, hidden_size: int,
                  intermediate_size: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> MoEConfig:
    """choose_config's, with the whole layer in the persistent decode kernel (decode.py): opt-in,
    as it measured slower than the two GEMMs on the H200 (docs/PERFORMANCE.md, issue 28)."""
    config = choose_config(num_tokens, top_k, num_experts, hidden_size, intermediate_size,
                           device, dtype)
    if config.layout is LayoutKind.BY_EXPERT:  # the decode kernel walks sorted blocks instead
        config = replace(config, layout=LayoutKind.SORTED)
    block_m = config.block_m
    if device.type != "cuda":  # the interpreter: small tiles, a few programs
        return replace(config, decode=DecodeConfig(block_m, 16, 32, 16, 32, programs=3))
    num_sms, shared_memory = device_limits(device)
    # 128-wide steps: one FP8 block; bf16's down steps twice that (fewer, longer copies)
    decode = DecodeConfig(block_m, block_n=64, block_c=128, block_h=64,
                          block_i=128 if dtype.itemsize == 1 else 256, programs=num_sms)
    return replace(config, decode=_fit_decode(decode, dtype.itemsize, shared_memory,
                                              decode_token_columns(num_tokens)))


def decode_token_columns(num_tokens: int) -> int:
    """The decode kernel's token columns: every token one, at least the MMA's 16."""
    return max(16, triton.next_power_of_2(num_tokens))


def _fit_decode(config: DecodeConfig, element_size: int, shared_memory: int,
                token_columns: int) -> DecodeConfig:
    def stage_bytes(c: DecodeConfig) -> int:  # the larger phase's tiles (their buffers alias)
        up = (2 * c.block_n + token_columns) * c.block_c  # gate, up and x's token rows
        return max(up, (c.block_h + c.block_m) * c.block_i) * element_size

    while (config.num_stages > 2
           and config.num_stages * stage_bytes(config) > shared_memory * SHARED_MEMORY_USE):
        config = replace(config, num_stages=config.num_stages - 1)
    return config


def _prefill_down(down: GemmConfig, fp8: bool) -> GemmConfig:
    # The second GEMM reads its rows in order: TMA feeds them as it does the weights. FP8: one
    # warpgroup on a 128-wide tile, which lies in one 128-row weight block (a scale per step, not
    # per column); both measured faster at every prefill case (docs/PERFORMANCE.md, issue 27).
    down = replace(down, tma_activations=True)
    return replace(down, block_n=FP8_GROUP, num_warps=4, scale_per_tile=True) if fp8 else down


def _fp8_steps(up: GemmConfig, down: GemmConfig,
               group: int = 128) -> tuple[GemmConfig, GemmConfig]:
    # A C step stays within one scale group: up's, a weight block's width; down's, also up's
    # block_n (the groups up's epilogue quantizes). Powers of two: the smallest divides the others.
    step = max(FP8_MIN_STEP, min(FP8_GROUP, group))
    up = replace(up, block_c=step)
    return up, replace(down, block_c=max(FP8_MIN_STEP, min(up.block_n, step)))


DECODE_LAYOUTS = (LayoutKind.PER_PAIR, LayoutKind.SORTED)  # the decode kernel's (decode.py)


def _unsorted_if_it_fits(layout: LayoutKind, block_m: int, num_pairs: int) -> LayoutKind:
    # Skip expand's kernels where each GEMM program can find its expert's pairs in the routing:
    # it holds the P routed ids and a [block_m, P] match in registers.
    fits = block_m * triton.next_power_of_2(num_pairs) <= BY_EXPERT_MATCH
    return LayoutKind.BY_EXPERT if layout is LayoutKind.SORTED and fits else layout


BY_EXPERT_MATCH = 8192  # 16-row tiles: up to 512 pairs (64 tokens of top-8)
# batch-invariant mode's tiles for every T: prefill's (sorted rows, no split along C)
INVARIANT_TOKENS = 4096
FP8_GROUP = 128  # the widest C step an FP8 scale group spans
FP8_MIN_STEP = 32  # an 8-bit tl.dot needs a contraction of at least 32 on SM90


def _fit_shared_memory(config: GemmConfig, element_size: int, limit: int, weight_tiles: int = 1,
                       min_block_c: int = 16, dequantized: bool = False) -> GemmConfig:
    """Fewer stages, then shorter C steps, until num_stages copies of the loaded tiles fit."""
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
