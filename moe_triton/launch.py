"""Bound launches: a Triton kernel launched with its arguments fixed but the tensors of each call.

`kernel[grid](*args)` binds and specializes every argument, hashes the specialization and looks
the compiled kernel up, on every call: on the H200's host that is 28 µs of a launch whose C part
takes 7 (benchmarks/host_overhead.py), more than the GPU time of a decode-sized kernel. The stage
plans (expand, expert_gemm, finalize, quantize) fix everything a call's shapes decide once and
hold it here; a call then hands the compiled kernel the stored arguments with its own tensors,
which must have the dtypes of the first call's (a plan's signature fixes them).

The specialization stays the JIT's: the first call goes through `kernel[grid]`, which compiles
or finds the kernel for those arguments, and a later call is launched directly only while it
still fits that specialization (same device, same dtypes, every 16-byte-aligned tensor still
aligned, no launch hooks installed, e.g. a profiler's); otherwise it goes through the JIT again. Under the
interpreter there is no compiled kernel and every call goes through the JIT.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime.interpreter import InterpretedFunction

_ALIGNMENT = 16  # bytes: Triton specializes pointer arguments on this divisibility

# The interpreter swaps triton.language's functions for its own while a kernel runs: two threads
# interpreting at once break each other's kernels (InterpreterError). Compiled launches need no lock.
_INTERPRETER_LOCK = threading.RLock()


def interpreter_serialized(kernel):
    """Mark a kernel that is launched: under the interpreter, one such launch runs at a time in the
    process, so concurrent calls from threads are safe; a compiled kernel is returned untouched."""
    if isinstance(kernel, InterpretedFunction):
        run = kernel.run

        @functools.wraps(run)
        def serialized_run(*args, **kwargs):
            with _INTERPRETER_LOCK:
                return run(*args, **kwargs)

        kernel.run = serialized_run  # KernelInterface's kernel[grid](...) calls self.run
    return kernel


class BoundLaunch:
    """One kernel launch: `fixed` holds every argument by name except the tensors passed to each
    call (by the same names); `options` are launch options (num_warps, num_stages)."""

    def __init__(self, kernel, grid: tuple[int, ...], fixed: dict, options: dict | None = None):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.fixed = fixed
        self.options = options or {}
        self._compiled: CompiledKernel | None = None
        self._device = -1
        self._values: list = []  # every argument in the kernel's order; None where a call's tensor goes
        # tensor name -> (position, dtype or None, must stay 16-byte aligned)
        self._slots: dict[str, tuple[int, torch.dtype | None, bool]] = {}

    def __call__(self, **tensors) -> None:
        if self._compiled is not None:
            values = self._direct_values(tensors)
            if values is not None:
                device = triton.runtime.driver.active.get_current_device()
                if device == self._device:
                    kernel = self._compiled
                    stream = triton.runtime.driver.active.get_current_stream(device)
                    kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
                    return
        args = {**self.fixed, **tensors}
        missing = set(self.kernel.arg_names) - args.keys()
        if missing:
            raise ValueError(f"{self.kernel.fn.__name__} was launched without {sorted(missing)}: fix them when "
                             "binding or pass them to the call")
        compiled = self.kernel[self.grid](**args, **self.options)
        if self._compiled is None and isinstance(compiled, CompiledKernel):
            self._remember(compiled, args, tensors)

    def _direct_values(self, tensors: dict) -> list | None:
        """The arguments of a direct launch, tensors as addresses; None where the JIT must see this call."""
        if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            return None
        values = self._values.copy()
        for name, value in tensors.items():
            position, dtype, aligned = self._slots[name]
            if isinstance(value, torch.Tensor):
                if value.dtype != dtype:
                    return None
                value = value.data_ptr()
                if aligned and value % _ALIGNMENT:
                    return None
            values[position] = value
        return values

    def _remember(self, compiled: CompiledKernel, args: dict, tensors: dict) -> None:
        names = self.kernel.arg_names
        self._values = [None if name in tensors else args[name] for name in names]
        self._slots = {name: (names.index(name), value.dtype, value.data_ptr() % _ALIGNMENT == 0)
                       if isinstance(value, torch.Tensor) else (names.index(name), None, False)
                       for name, value in tensors.items()}
        self._device = triton.runtime.driver.active.get_current_device()
        self._compiled = compiled


def _hooked(hook) -> bool:
    # Triton keeps its launch hooks in a HookChain (installed hooks in `.calls`); a plain callable
    # set in its place is a hook too.
    return hook is not None and bool(getattr(hook, "calls", True))


class PlanCache:
    """Plans by call signature, each made by its signature's first call; the newest `size` are kept
    (prefill sees a new token count per prompt length). A None signature is never stored."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._plans: dict = {}

    def get(self, signature):
        return self._plans.get(signature)

    def add(self, signature, plan):
        if signature is not None:
            if len(self._plans) >= self.size:
                self._plans.pop(next(iter(self._plans)), None)
            self._plans[signature] = plan
        return plan


def register_op(name: str, fake: Callable, *, mutates_args: tuple[str, ...] = (), backward: Callable | None = None,
                setup_context: Callable | None = None):
    """Decorator: the eager function becomes `torch.ops.moe_triton.<name>`, the node torch.compile
    and torch.export see; `fake` gives its outputs' metadata, `backward` (with `setup_context`) its
    gradient. A custom op, opaque to inductor, not a `torch.library.triton_op`: our kernels launch
    through plans (BoundLaunch's direct launch, or the interpreter on CPU), which inductor cannot
    trace, and the ops plan on the host per call signature."""
    def register(eager: Callable):
        op = torch.library.custom_op(f"moe_triton::{name}", eager, mutates_args=mutates_args)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return register
