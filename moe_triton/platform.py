"""Where kernels can run: the one place that looks at the hardware, the interpreter and FlashInfer
(callers use `platform.detect_platform` so tests can monkeypatch it)."""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

try:  # grid dependency control: programmatic dependent launch (PDL)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without it: kernels never take their PDL branches
    gdc_launch_dependents = gdc_wait = None

# runners/flashinfer.py's API; older releases lack its prepare helpers and the routed top-k form
FLASHINFER_MIN_VERSION = (0, 7, 2)
FLASHINFER_READ_VERSION = "0.7.2.post1"


@triton.jit
def _defined_at_import():
    # triton.jit reads TRITON_INTERPRET at import, as for every kernel: tells how all are built
    pass


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET=1 was set before moe_triton was imported (setting it later does nothing)."""
    return isinstance(_defined_at_import, InterpretedFunction)


def interpreter_hint() -> str:
    if triton.knobs.runtime.interpret and not interpreter_enabled():
        return ("TRITON_INTERPRET=1 was set after moe_triton was imported, and its kernels were "
                "defined for the GPU: set it before the first import "
                "(restart the process or notebook kernel)")
    return "set TRITON_INTERPRET=1 before importing moe_triton"


def triton_can_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())


# tl.dot dtypes the interpreter gets right: bf16 is garbage (triton 3.9), so GEMMs refuse it there
INTERPRETER_DOT_DTYPES = (torch.float16, torch.float32)


@functools.cache
def device_limits(device: torch.device) -> tuple[int, int]:
    """A CUDA device's (SMs, shared memory a program may opt into, bytes)."""
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.shared_memory_per_block_optin


def dependent_launch(device: torch.device) -> bool:
    """A kernel may launch while the one before it drains (PDL: SM90 and later, compiled)."""
    return (gdc_wait is not None and device.type == "cuda" and not interpreter_enabled()
            and torch.cuda.get_device_capability(device)[0] >= 9)


@triton.jit
def wait_then_release(CHAINED: tl.constexpr):
    """A chained kernel's first step (launched by PDL, `launch_pdl`, behind the kernel in front):
    wait until that kernel's grid is complete and its writes visible, then let the next kernel
    launch. Releasing only after waiting keeps the chain's one invariant: when a kernel launches,
    everything before the kernel in front is complete, so what is older than that kernel may be
    read before waiting (weights always: no kernel writes them)."""
    if CHAINED:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(pointers):
    """Ask L2 for the line at each pointer (any shape) and go on: nothing waits for the bytes, no
    register receives them. Chained kernels stream weights this way before their wait. GPU only
    (inline PTX): callers take this branch only when chained, never under the interpreter."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [pointers], dtype=tl.int32,
                              is_pure=False, pack=1)


def triton_computes_exactly(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA, or the interpreter in fp16 / fp32: its bf16 casts truncate where a GPU rounds to
    nearest even (triton 3.9: 2047 of 4096 values differ), so dot-free kernels use this too."""
    return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled()
                                     and dtype in INTERPRETER_DOT_DTYPES)


def interpreter_dot_reason(dtype: torch.dtype, fp8_experts: bool = False) -> str:
    usable = "float16" if fp8_experts else "float16/float32"  # FP8 experts: 16-bit activations
    return (f"the Triton interpreter's {str(dtype).removeprefix('torch.')} tl.dot computes "
            f"wrong results (triton {triton.__version__}); use {usable} on CPU, "
            "or the torch backend")


def check_device(device, name: str = "device") -> torch.device | None:
    """`device` as a torch.device (None stays None), or a ValueError naming the fix."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name}={device!r} is not a device; "
                         "use 'cpu', 'cuda' or 'cuda:N'") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={str(device)!r} but this machine has no CUDA device "
                             f"(torch.cuda.is_available() is False); use {name}='cpu' "
                             "(the Triton kernels run there under TRITON_INTERPRET=1)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={str(device)!r} but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return parsed


@dataclass(frozen=True)
class Platform:
    device_type: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability, None on CPU
    flashinfer: str | None = None  # installed flashinfer-python version
    interpreter: bool = False  # Triton's CPU interpreter is on

    @property
    def sm(self) -> int | None:
        """Compute capability as one number (SM103 -> 103); None on CPU."""
        return None if self.capability is None else self.capability[0] * 10 + self.capability[1]

    def flashinfer_version(self) -> tuple[int, ...] | None:
        """0.7.2.post1 -> (0, 7, 2); None when absent or unparsable."""
        match = re.match(r"(\d+)\.(\d+)\.(\d+)", self.flashinfer or "")
        return tuple(int(part) for part in match.groups()) if match else None

    def __str__(self) -> str:
        if self.device_type == "cpu":
            return f"CPU (Triton interpreter {'on' if self.interpreter else 'off'})"
        return f"SM{self.sm}"


def _flashinfer_version() -> str | None:
    # Looked up without importing FlashInfer: importing it initialises CUDA and its JIT.
    if importlib.util.find_spec("flashinfer") is None:
        return None
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def detect_platform(device: torch.device | str | None = None) -> Platform:
    device = (torch.device(device) if device is not None
              else torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return Platform("cuda", torch.cuda.get_device_capability(device), _flashinfer_version(),
                        interpreter_enabled())
    return Platform("cpu", None, _flashinfer_version(), interpreter_enabled())


def named_platform(name: str) -> Platform:
    """`sm90`, `sm100`, ... or `cpu`, FlashInfer assumed: what a fully equipped machine gets."""
    if not isinstance(name, str):
        raise ValueError(f"platform={name!r} is not a platform name; "
                         "use cpu or sm<capability> such as sm90, sm100")
    name = name.strip().lower()
    if name == "cpu":
        return Platform("cpu")
    match = re.fullmatch(r"sm(\d+)(\d)", name)
    capability = (int(match.group(1)), int(match.group(2))) if match else None
    if capability not in KNOWN_CAPABILITIES:
        known = ", ".join(f"sm{major}{minor}" for major, minor in KNOWN_CAPABILITIES)
        raise ValueError(f"platform={name!r} is not a platform name; use cpu or one of {known}")
    return Platform("cuda", capability, FLASHINFER_READ_VERSION)


# Volta to Blackwell: a typo such as sm1000 is refused, not resolved for a GPU that does not exist
KNOWN_CAPABILITIES = ((7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 1),
                      (10, 3), (11, 0), (12, 0), (12, 1))
