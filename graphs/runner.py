"""DecodeGraphRunner: one CUDA graph per batch-size bucket over a decode step, any callable from a
dict of static tensors (batch first) to one output tensor (batch first); it owns the buffers."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .capture import capture_mode

DecodeStep = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def default_batch_sizes(max_batch_size: int = 256) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8, as the serving engines capture."""
    small = tuple(s for s in (1, 2, 4, 8) if s <= max_batch_size)
    return small + tuple(range(16, max_batch_size + 1, 8))


def bucket_for(batch_size: int, batch_sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `batch_size`, or None past the largest."""
    fitting = [s for s in batch_sizes if s >= batch_size]
    return min(fitting) if fitting else None


@dataclass(frozen=True)
class StaticInput:
    shape: tuple[int, ...] = ()  # after the batch dimension
    dtype: torch.dtype = torch.int64
    pad_value: float = 0  # padding rows get it: valid input (a dummy KV slot), maybe out of bounds
    bounds: tuple[int, int] | None = None  # a caller's values in [low, high) (integers)

    def __post_init__(self):
        if self.bounds is not None and (self.dtype.is_floating_point or self.dtype.is_complex):
            raise ValueError(f"StaticInput.bounds is for integer inputs, not {self.dtype}")


@dataclass(frozen=True)
class GraphConfig:
    batch_sizes: tuple[int, ...] = field(default_factory=default_batch_sizes)
    enabled: bool = True  # False: every batch runs eagerly
    warmup_runs: int = 2  # eager runs before each capture: compile, settle the allocator
    copy_output: bool = True  # return a copy; False returns a view the next replay overwrites
    show_progress: bool = True
    # a collective inside (EP dispatch): always the largest bucket, so each rank meets its peers
    lockstep: bool = False


@dataclass(frozen=True)
class CaptureStats:
    num_graphs: int
    seconds: float
    pool_bytes: int  # device memory reserved by capture (the shared graph pool), after empty_cache


class DecodeGraphRunner:
    def __init__(self, step: DecodeStep, inputs: dict[str, StaticInput],
                 config: GraphConfig | None = None, device: torch.device | str | None = None):
        self.step = step
        self.specs = dict(inputs)
        self.config = config or GraphConfig()
        if not self.specs:
            raise ValueError("inputs must name at least one static input of the decode step")
        if not self.config.batch_sizes or min(self.config.batch_sizes) < 1:
            raise ValueError("config.batch_sizes must be positive sizes, "
                             f"got {self.config.batch_sizes}")
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (graph, output)
        self.static: dict[str, torch.Tensor] = {}  # name -> [max bucket, *shape] buffer
        self.stats: CaptureStats | None = None

    @property
    def uses_graphs(self) -> bool:
        return self.config.enabled and self.device.type == "cuda"

    def capture(self) -> CaptureStats:
        """Every bucket, largest first, into one shared pool (a no-op without CUDA)."""
        if not self.uses_graphs:
            self.stats = CaptureStats(0, 0.0, 0)
            return self.stats
        from tqdm import tqdm

        largest = max(self.config.batch_sizes)
        self.static = {name: torch.full((largest, *spec.shape), spec.pad_value, dtype=spec.dtype,
                                        device=self.device)
                       for name, spec in self.specs.items()}
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved_before, start = torch.cuda.memory_reserved(self.device), time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        sizes = sorted(set(self.config.batch_sizes), reverse=True)  # smaller ones fit its pool
        for size in tqdm(sizes, desc="capturing decode graphs", unit="graph",
                         disable=not self.config.show_progress):
            views = {name: buffer[:size] for name, buffer in self.static.items()}
            with capture_mode():
                self._warm_up(views)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = self.step(views)
            self.graphs[size] = (graph, output)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.stats = CaptureStats(len(self.graphs), time.perf_counter() - start,
                                  torch.cuda.memory_reserved(self.device) - reserved_before)
        return self.stats

    def _warm_up(self, views: dict[str, torch.Tensor]) -> None:
        # on a side stream, as torch.cuda.graph expects: lazy init never lands in a capture
        side, current = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.config.warmup_runs):
                self.step(views)
        current.wait_stream(side)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """`run(inputs)` after a host check of the bounded inputs (one sync), before any copy."""
        self._check(inputs)
        self._check_bounds(inputs)
        return self.run(inputs)

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The bucket's graph replayed, values unchecked (eager past the largest bucket); a batch of
        0 launches nothing once captured. Lockstep: always the largest bucket, 0 rows too; a larger
        batch is an error."""
        batch_size = self._check(inputs)
        if self.config.lockstep and self.graphs:
            bucket = max(self.graphs)
            if batch_size > bucket:  # an eager step would leave the peers waiting in their graphs
                raise ValueError(f"a batch of {batch_size} is larger than the {bucket} rows "
                                 "captured for this lockstep (expert-parallel) step: call setup() "
                                 "with a larger max_batch on every rank")
        else:
            bucket = bucket_for(batch_size, tuple(self.graphs))
            if batch_size == 0 and self.graphs:
                template = next(iter(self.graphs.values()))[1]
                return template.new_empty((0, *template.shape[1:]))
            if bucket is None or batch_size == 0:
                return self.step(inputs)
        for name, value in inputs.items():
            buffer = self.static[name]
            buffer[:batch_size].copy_(value)
            buffer[batch_size:bucket].fill_(self.specs[name].pad_value)  # rows stay valid input
        graph, output = self.graphs[bucket]
        graph.replay()
        return output[:batch_size].clone() if self.config.copy_output else output[:batch_size]

    def _check(self, inputs: dict[str, torch.Tensor]) -> int:
        if set(inputs) != set(self.specs):
            raise ValueError(f"inputs must be exactly {sorted(self.specs)}, got {sorted(inputs)}")
        sizes = {value.shape[0] if value.dim() else None for value in inputs.values()}
        if len(sizes) != 1 or None in sizes:
            raise ValueError("every input needs the same leading batch dimension, "
                             f"got {sorted(map(str, sizes))}")
        for name, value in inputs.items():
            spec = self.specs[name]
            if tuple(value.shape[1:]) != spec.shape or value.dtype != spec.dtype:
                raise ValueError(f"input {name!r} must be (batch, *{spec.shape}) {spec.dtype}, "
                                 f"got {tuple(value.shape)} {value.dtype}")
        return sizes.pop()

    def _check_bounds(self, inputs: dict[str, torch.Tensor]) -> None:
        bounded = {name: spec.bounds for name, spec in self.specs.items()
                   if spec.bounds is not None and inputs[name].numel()}
        if not bounded:
            return
        extremes = torch.stack([torch.stack([inputs[name].min(), inputs[name].max()]).long()
                                for name in bounded]).tolist()  # the one host sync
        for (name, (low, high)), (least, most) in zip(bounded.items(), extremes, strict=True):
            if least < low or most >= high:
                raise ValueError(f"input {name!r} must lie in [{low}, {high}), "
                                 f"got values in [{least}, {most}]")


def capture_graph(step: Callable[[int], object], num_variants: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of `step(0) ... step(num_variants - 1)` after a warm-up, for benchmarks and
    tests (rotating input sets keeps one call's weights out of L2 for the next)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(num_variants):  # warm-up: compile, fill the allocator outside capture
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_variants):
            step(i)
    graph.replay()
    torch.cuda.synchronize()
    return graph
