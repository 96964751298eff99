"""transformers' own FP8 experts as an offline peer for the FP8 benchmark.

transformers runs its block-scaled FP8 experts (`fp8_grouped_mm_experts_forward`,
`fp8_batched_mm_experts_forward` in `transformers.integrations.finegrained_fp8`) on a Triton kernel
that it downloads from the Hugging Face Hub at run time (`kernels-community/finegrained-fp8`,
through the `kernels` package). The GPU machine has no network, so this module loads that kernel's
source from a local folder instead and installs it where transformers keeps the loaded kernel (the
module global `_FINEGRAINED_FP8`); transformers' forward functions then run unchanged, without the
Hub.

The kernel source is third-party (huggingface/kernels-community, Apache-2.0) and is not part of this
repository. To run the peer, put the package in `.peers/finegrained_fp8/` at the repository root
(the folder is git-ignored through `.git/info/exclude`); its `PROVENANCE.txt` lists the repository,
path and commit of every file. Without the folder, `available()` says why and the benchmark reports
the peer as not run.

    from fp8_peer import available, fp8_experts_forwards
    if (reason := available()) is None:
        forwards = fp8_experts_forwards(w13, w13_scale_inv, w2, w2_scale_inv)
        out = forwards.grouped_mm(hidden_states, topk_ids.long(), topk_weights)
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

PACKAGE = "finegrained_fp8"
PEER_DIR = Path(__file__).resolve().parent.parent / ".peers" / PACKAGE
SYMBOLS = ("matmul_2d", "matmul_batched", "matmul_grouped")

_loaded = None  # the imported package, once loaded
_failure: str | None = None  # why loading failed, once it has (an import is not retried)


def _load():
    """Import the package from PEER_DIR under its own name (its modules import each other
    relatively)."""
    global _loaded, _failure
    if _loaded is not None or _failure is not None:
        return _loaded
    init = PEER_DIR / "__init__.py"
    if not init.is_file():
        _failure = f"FP8 peer kernel not found: {init} is missing (see benchmarks/fp8_peer.py)"
        return None
    try:
        package = sys.modules.get(PACKAGE)
        if package is None:
            spec = importlib.util.spec_from_file_location(PACKAGE, init,
                                                          submodule_search_locations=[str(PEER_DIR)])
            package = importlib.util.module_from_spec(spec)
            sys.modules[PACKAGE] = package
            try:
                spec.loader.exec_module(package)
            except BaseException:
                for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
                    del sys.modules[name]
                raise
        elif Path(package.__file__).resolve().parent != PEER_DIR:
            _failure = (f"FP8 peer kernel not loaded: another {PACKAGE} is already imported from "
                        f"{package.__file__}")
            return None
        missing = [name for name in SYMBOLS if not callable(getattr(package, name, None))]
        if missing:
            _failure = f"FP8 peer kernel in {PEER_DIR} lacks {', '.join(missing)}"
            return None
        # (its import errors are reasons too)
        from transformers.integrations import finegrained_fp8  # noqa: F401
    except Exception as error:  # noqa: BLE001 - the reason is reported, not raised
        _failure = (f"FP8 peer kernel failed to import: {type(error).__name__}: "
                    f"{error}").splitlines()[0]
        return None
    _loaded = package
    return package


def available() -> str | None:
    """None when the peer can run, else one line saying why not (folder missing, import error,
    symbols missing)."""
    _load()
    return _failure


def install():
    """Put the local kernel where transformers keeps the Hub one, so its FP8 paths never download.
    Returns it."""
    package = _load()
    if package is None:
        raise RuntimeError(_failure)
    from transformers.integrations import finegrained_fp8

    kernel = finegrained_fp8.FineGrainedFP8(matmul=package.matmul_2d,
                                            batched_matmul=package.matmul_batched,
                                            grouped_matmul=package.matmul_grouped)
    finegrained_fp8._FINEGRAINED_FP8 = kernel
    return kernel


def fp8_experts(gate_up_proj: torch.Tensor, gate_up_proj_scale_inv: torch.Tensor,
                down_proj: torch.Tensor, down_proj_scale_inv: torch.Tensor,
                block: tuple[int, int] = (128, 128)) -> torch.nn.Module:
    """transformers' FP8Experts for a Qwen3-MoE-shaped layer (SiLU-gated, no bias) over the given
    weights.

    gate_up_proj (E, 2I, H) and down_proj (E, H, I) are float8_e4m3fn; their scale_inv are float32
    (E, 2I/block[0], H/block[1]) and (E, H/block[0], I/block[1]), as in a block-scaled checkpoint.
    """
    from transformers import Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import FP8Experts

    num_experts, two_intermediate, hidden_size = gate_up_proj.shape
    assert gate_up_proj.dtype == down_proj.dtype == torch.float8_e4m3fn, (
        "expert weights must be float8_e4m3fn")
    assert down_proj.shape == (num_experts, hidden_size, two_intermediate // 2), (
        "down_proj must be (E, H, I)")
    config = Qwen3MoeConfig(hidden_size=hidden_size, moe_intermediate_size=two_intermediate // 2,
                            num_experts=num_experts, hidden_act="silu")
    with torch.device("meta"):  # FP8Experts allocates its own (empty) weights; ours replace them
        experts = FP8Experts(config, block_size=list(block), activation_scheme="dynamic",
                             has_gate=True)
    experts.gate_up_proj = torch.nn.Parameter(gate_up_proj, requires_grad=False)
    experts.gate_up_proj_scale_inv = torch.nn.Parameter(gate_up_proj_scale_inv, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(down_proj, requires_grad=False)
    experts.down_proj_scale_inv = torch.nn.Parameter(down_proj_scale_inv, requires_grad=False)
    # set by transformers' use_experts_implementation wrapper when it loads a model
    experts._is_expert_parallel = False
    return experts


class Fp8ExpertsForwards(NamedTuple):
    """(hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K)) -> (T, H), one per
    transformers path."""

    grouped_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    batched_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    experts: torch.nn.Module


def fp8_experts_forwards(gate_up_proj: torch.Tensor, gate_up_proj_scale_inv: torch.Tensor,
                         down_proj: torch.Tensor, down_proj_scale_inv: torch.Tensor,
                         block: tuple[int, int] = (128, 128)) -> Fp8ExpertsForwards:
    """transformers' `fp8_grouped_mm_experts_forward` and `fp8_batched_mm_experts_forward` over the
    given weights.

    Installs the local kernel first (raises RuntimeError with `available()`'s reason when it
    cannot). Each callable calls transformers' function with the FP8Experts module as `self`,
    exactly as its experts dispatch does; pass hidden_states that do not require grad (or run under
    torch.no_grad()).
    """
    install()
    from transformers.integrations.finegrained_fp8 import (
        fp8_batched_mm_experts_forward,
        fp8_grouped_mm_experts_forward,
    )

    experts = fp8_experts(gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv,
                          block)

    def grouped_mm(hidden_states, top_k_index, top_k_weights):
        return fp8_grouped_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)

    def batched_mm(hidden_states, top_k_index, top_k_weights):
        return fp8_batched_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)

    return Fp8ExpertsForwards(grouped_mm, batched_mm, experts)
