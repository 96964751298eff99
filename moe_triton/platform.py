"""Where kernels can run: the one place that looks at the hardware and the Triton interpreter."""
from __future__ import annotations

import torch
import triton


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return bool(triton.knobs.runtime.interpret)


def triton_can_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())
