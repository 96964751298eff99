"""Bound launches: arguments fixed once; a call's tensors go straight to the compiled kernel while
they fit the first call's specialization (device, dtypes, 16-byte alignment, no launch hooks), else
via the JIT (its cost: see docs/PERFORMANCE.md, "Provenance moved out of the code (issue 26)")."""
from __future__ import annotations

import functools
import threading
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
    """`fixed`: every argument but each call's tensors; `options`: num_warps, num_stages."""

    def __init__(self, kernel, grid: tuple[int, ...], fixed: dict, options: dict | None = None):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.fixed = fixed
        self.options = options or {}
        self._compiled: CompiledKernel | None = None
        self._device = -1
        self._values: list = []  # every argument in order; None where a call's tensor goes
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
                    kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata,
                               None, None, None, *values)
                    return
        args = {**self.fixed, **tensors}
        missing = set(self.kernel.arg_names) - args.keys()
        if missing:
            raise ValueError(f"{self.kernel.fn.__name__} was launched without {sorted(missing)}: "
                             "fix them when binding or pass them to the call")
        compiled = self.kernel[self.grid](**args, **self.options)
        if self._compiled is None and isinstance(compiled, CompiledKernel):
            self._remember(compiled, args, tensors)

    def _direct_values(self, tensors: dict) -> list | None:
        """A direct launch's arguments, tensors as addresses; None where the JIT must see it."""
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
        self._slots = {
            name: (names.index(name), value.dtype, value.data_ptr() % _ALIGNMENT == 0)
            if isinstance(value, torch.Tensor) else (names.index(name), None, False)
            for name, value in tensors.items()}
        self._device = triton.runtime.driver.active.get_current_device()
        self._compiled = compiled


def _hooked(hook) -> bool:
    # a HookChain holds its installed hooks in `.calls`; a plain callable is a hook too
    return hook is not None and bool(getattr(hook, "calls", True))


class PlanCache:
    """Plans by call signature, newest `size` kept (prefill: a token count per prompt length)."""

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
