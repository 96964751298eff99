"""Bound launches: arguments fixed once; a call's tensors go straight to the compiled kernel while
they fit the first call's specialization (device, dtypes, 16-byte alignment, no launch hooks), else
via the JIT (its cost: see docs/PERFORMANCE.md, "Provenance moved out of the code (issue 26)").
Plans (PlanCache) keep what outlives a call: bound launches, scratch, and arrival counters, which
come from `arrival_counters` so that none lives in a CUDA graph's pool. A captured graph writes a
plan's scratch and counters by address, so neither is ever freed while a graph may hold it: the
cache keeps every plan that holds scratch, and the counters' chunks live as long as the process."""
from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Callable

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime.interpreter import InterpretedFunction

_ALIGNMENT = 16  # bytes: Triton specializes pointer arguments on this divisibility

# The interpreter swaps tl's functions during a kernel: concurrent threads get InterpreterError.
_INTERPRETER_LOCK = threading.RLock()


def interpreter_serialized(kernel):
    """Under the interpreter, one launch of such kernels runs at a time; compiled: untouched."""
    if isinstance(kernel, InterpretedFunction):
        run = kernel.run

        @functools.wraps(run)
        def serialized_run(*args, **kwargs):
            with _INTERPRETER_LOCK:
                return run(*args, **kwargs)

        kernel.run = serialized_run  # KernelInterface's kernel[grid](...) calls self.run
    return kernel


class BoundLaunch:
    """`fixed`: every argument but each call's tensors; `options`: num_warps, num_stages. A kernel
    whose fixed `CHAINED` is set launches by PDL (platform.wait_then_release is its first step)."""

    def __init__(self, kernel, grid: tuple[int, ...], fixed: dict, options: dict | None = None):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.fixed = fixed
        self.options = (options or {}) | ({"launch_pdl": True} if fixed.get("CHAINED") else {})
        self._direct: DirectLaunch | None = None

    def __call__(self, **tensors) -> None:
        direct = self._direct
        if direct is not None and direct(tensors):
            return
        args = {**self.fixed, **tensors}
        missing = set(self.kernel.arg_names) - args.keys()
        if missing:
            raise ValueError(f"{self.kernel.fn.__name__} was launched without {sorted(missing)}: "
                             "fix them when binding or pass them to the call")
        compiled = self.kernel[self.grid](**args, **self.options)
        if direct is None and isinstance(compiled, CompiledKernel):
            self._direct = DirectLaunch(compiled, self.grid, self.kernel.arg_names, args, tensors)


class DirectLaunch:
    """A compiled kernel launched without the JIT: every argument but the call's tensors laid out
    once. Where Triton's launcher is the one this knows (Triton 3.6's: a C `launch` behind Python
    that encodes every TMA descriptor at every launch), its C function is called directly and a
    descriptor seen again (weights': expert_gemm.weight_descriptor caches them) is not encoded
    again; elsewhere the compiled kernel's own launcher takes the arguments."""

    def __init__(self, compiled: CompiledKernel, grid: tuple[int, int, int], names: list[str],
                 args: dict, tensors: dict):
        self.device = triton.runtime.driver.active.get_current_device()
        self._stream = triton.runtime.driver.active.get_current_stream  # bound: no proxy per call
        raw = _raw_launcher(compiled, len(names))
        kinds = list(compiled.src.signature.values()) if raw is not None else None
        if raw is None:  # CompiledKernel.run(grid, stream, function, metadata, hooks, *args)
            self._launch = compiled.run
            prefix = [*grid, None, compiled.function, compiled.packed_metadata, None, None, None]
        else:  # the C launch(grid, stream, function, cooperative, pdl, scratch, metadata, hooks,
            # *args with each descriptor expanded)
            self._launch, run = raw, compiled.run
            prefix = [*grid, None, compiled.function, run.launch_cooperative_grid,
                      run.launch_pdl, None, None, compiled.packed_metadata, None, None, None]
        metas = iter(getattr(compiled.metadata, "tensordesc_meta", None) or [])
        self._template = prefix
        self._slots: dict[str, tuple] = {}  # name -> (position, dtype, aligned, descriptor meta)
        self._encoded: dict[str, tuple] = {}  # name -> (weakref to a descriptor, its expansion)
        for i, name in enumerate(names):
            value = args[name]
            descriptor = kinds is not None and str(kinds[i]).startswith("tensordesc")
            meta = next(metas, None) if descriptor else None
            expanded = (self._expansion(name, value, meta) if descriptor
                        else [value.data_ptr() if isinstance(value, torch.Tensor) else value])
            if name in tensors:
                tensor = isinstance(value, torch.Tensor)
                self._slots[name] = (len(self._template), value.dtype if tensor else None,
                                     tensor and value.data_ptr() % _ALIGNMENT == 0,
                                     (meta,) if descriptor else None)
            self._template = self._template + expanded

    def __call__(self, tensors: dict) -> bool:
        """Launch with the call's tensors; False where the JIT must see the call (another dtype or
        alignment, another device, a launch hook installed): nothing is launched then."""
        if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            return False
        values = self._values(tensors)
        device = triton.runtime.driver.active.get_current_device()
        if values is None or device != self.device:
            return False
        values[3] = self._stream(device)
        self._launch(*values)
        return True

    def _values(self, tensors: dict) -> list | None:
        """Every launch argument in order, tensors as addresses; None where the JIT must see it."""
        values = self._template.copy()
        for name, value in tensors.items():
            position, dtype, aligned, descriptor = self._slots[name]
            if descriptor is not None:
                expanded = self._expansion(name, value, descriptor[0])
                values[position:position + len(expanded)] = expanded
                continue
            if isinstance(value, torch.Tensor):
                if value.dtype != dtype:
                    return None
                value = value.data_ptr()
                if aligned and value % _ALIGNMENT:
                    return None
            values[position] = value
        return values

    def _expansion(self, name: str, descriptor, meta) -> list:
        """A descriptor's launch arguments (its encoded tensor map, shape and strides), encoded
        once while the same descriptor object comes back."""
        held = self._encoded.get(name)
        if held is not None and held[0]() is descriptor:
            return held[1]
        # a descriptor not lowered to TMA expands to its base tensor: held as an address, so a
        # plan never keeps replaced weights alive
        expanded = [value.data_ptr() if isinstance(value, torch.Tensor) else value
                    for value in _make_tensordesc_arg(descriptor, meta)]
        self._encoded[name] = (weakref.ref(descriptor), expanded)
        return expanded


def _raw_launcher(compiled: CompiledKernel, num_args: int):
    """The C launch function behind Triton 3.6's CudaLauncher, or None where the launcher is not
    that one (another Triton, scratch memory to allocate per launch, another backend)."""
    run = getattr(compiled, "run", None)
    if (_make_tensordesc_arg is None or _BASE_ARGS_LEN != 13
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or len(getattr(getattr(compiled, "src", None), "signature", ())) != num_args):
        return None
    launch = getattr(run, "launch", None)
    if getattr(launch, "__name__", None) == "inner":  # wrap_handle_tensordesc's wrapper
        cells = dict(zip(launch.__code__.co_freevars,
                         (cell.cell_contents for cell in launch.__closure__ or ()), strict=True))
        launch = cells.get("launcher")
    return launch if isinstance(launch, types.BuiltinFunctionType) else None


try:  # Triton 3.6's NVIDIA launcher internals; elsewhere the compiled kernel's launcher runs
    from triton.backends.nvidia.driver import _BASE_ARGS_FORMAT_LEN as _BASE_ARGS_LEN
    from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg
except ImportError:
    _BASE_ARGS_LEN, _make_tensordesc_arg = None, None


def _hooked(hook) -> bool:
    # a HookChain holds its installed hooks in `.calls`; a plain callable is a hook too
    return hook is not None and bool(getattr(hook, "calls", True))


class PlanCache:
    """Plans by call signature, newest `size` kept (prefill: a token count per prompt length),
    except plans holding device scratch (`holds_scratch`: a split gemv's partials, the decode
    kernel's rows), which are kept however many: a CUDA graph captured through such a plan writes
    its scratch by address at every replay, so freeing it would have the graph write into whatever
    takes the memory next (seen on the H200 as a replay != eager failure deep into the GPU suite,
    where earlier tests fill the caches). Those are decode-size plans: as many as the shapes a
    process decodes."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._plans: dict = {}

    def get(self, signature):
        return self._plans.get(signature)

    def add(self, signature, plan):
        if signature is not None:
            if len(self._plans) >= self.size:
                self._evict_oldest()
            self._plans[signature] = plan
        return plan

    def _evict_oldest(self) -> None:
        for signature, plan in self._plans.items():
            if not getattr(plan, "holds_scratch", False):
                del self._plans[signature]
                return


# Counters handed out at most this many a chunk (4 MiB of int32): a model's plans take a few
# thousand, so a capture never needs a new chunk
COUNTER_CHUNK = 1 << 20
_COUNTER_CHUNKS: dict[torch.device, list] = {}  # device -> [chunk, next free counter]
_FULL_CHUNKS: list[torch.Tensor] = []  # kept: an evicted plan's counters may be in a graph
_COUNTER_LOCK = threading.Lock()  # threads planning at once never get the same counters


def arrival_counters(count: int, device: torch.device) -> torch.Tensor:
    """`count` int32 counters for a plan to keep, zero now and between its calls (its kernels'
    last arrivals reset them), never handed to another plan. Cut from a chunk allocated outside
    any CUDA graph capture: memory allocated while capturing belongs to the graph's pool, where
    a graph sharing the pool writes its temporaries over a counter between replays (seen on the
    H200: a split GEMV planned in one capture never finished its sums in the next runner's)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    with _COUNTER_LOCK:
        return _cut_counters(count, device, capturing)


def _cut_counters(count: int, device: torch.device, capturing: bool) -> torch.Tensor:
    entry = _COUNTER_CHUNKS.get(device)
    free = 0 if entry is None else entry[0].numel() - entry[1]
    if free < count or (not capturing and free < max(count, COUNTER_CHUNK // 4)):
        if capturing:
            raise RuntimeError(
                f"moe-triton plans its arrival counters outside CUDA graph capture, and {count} "
                "more were asked for inside one: run the step once eagerly before capturing it "
                "(the warm-up torch.cuda.graph asks for)")
        if entry is not None:
            _FULL_CHUNKS.append(entry[0])
        chunk = torch.zeros(max(COUNTER_CHUNK, count), dtype=torch.int32, device=device)
        if device.type == "cuda":  # zero before a kernel on another stream counts on it
            torch.cuda.current_stream(device).synchronize()
        entry = _COUNTER_CHUNKS[device] = [chunk, 0]
    start = entry[1]
    entry[1] += -(-count // 4) * 4  # the next starts 16 bytes aligned
    return entry[0][start:start + count]


def register_op(name: str, fake: Callable, *, mutates_args: tuple[str, ...] = (),
                backward: Callable | None = None, setup_context: Callable | None = None):
    """`torch.ops.moe_triton.<name>`: a custom op, not a triton_op (inductor can't trace plans)."""
    def register(eager: Callable):
        op = torch.library.custom_op(f"moe_triton::{name}", eager, mutates_args=mutates_args)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return register
