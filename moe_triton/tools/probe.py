"""The temperature-0 probe: one layer on two backends, outputs and greedy tokens compared; fused
paths that are plausible but wrong (swapped gate/up halves) are a known failure."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..activation import SILU_AND_MUL
from ..layer import FusedMoE
from ..placement import Placement
from ..routing import RoutingSpec, Scoring

# Max |a - b| / max |b| accepted, by the dtype the layers compute in.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


class ProbeMismatch(AssertionError):
    def __init__(self, report: ProbeReport):
        super().__init__(str(report))
        self.report = report


@dataclass(frozen=True)
class ProbeReport:
    backend_a: str
    backend_b: str
    max_abs_diff: float
    rel_diff: float  # max |a - b| / max |b|
    token_agreement: float | None  # fraction of equal greedy tokens; None without an LM head
    tolerance: float
    min_token_agreement: float

    @property
    def passed(self) -> bool:
        tokens_ok = self.token_agreement is None or self.token_agreement >= self.min_token_agreement
        return self.rel_diff <= self.tolerance and tokens_ok

    def __str__(self) -> str:
        tokens = ("" if self.token_agreement is None
                  else f", greedy tokens agree {self.token_agreement:.1%}")
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: {self.backend_a} vs {self.backend_b}: "
                f"max abs diff {self.max_abs_diff:.3e}, "
                f"relative {self.rel_diff:.3e} (tolerance {self.tolerance:.1e}){tokens}")


def probe(layer_a: torch.nn.Module, layer_b: torch.nn.Module, hidden_states: torch.Tensor, *,
          lm_head: torch.Tensor | None = None, tolerance: float | None = None,
          min_token_agreement: float = 1.0) -> ProbeReport:
    """Both layers on hidden_states (T, H), lm_head (V, H); ProbeMismatch past `tolerance`
    (default by dtype) or below `min_token_agreement`."""
    with torch.no_grad():
        a, b = layer_a(hidden_states).float(), layer_b(hidden_states).float()  # [T, H]
    if a.shape != b.shape:
        raise ValueError("the layers disagree on the output shape: "
                         f"{tuple(a.shape)} vs {tuple(b.shape)}")
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    rel = max_abs / max(b.abs().max().item() if b.numel() else 0.0, 1e-30)
    agreement = None
    if lm_head is not None:
        tokens_a, tokens_b = ((a @ lm_head.float().T).argmax(-1),  # [T]
                              (b @ lm_head.float().T).argmax(-1))
        agreement = (tokens_a == tokens_b).float().mean().item() if tokens_a.numel() else 1.0
    report = ProbeReport(_name(layer_a), _name(layer_b), max_abs, rel, agreement,
                         (TOLERANCE.get(hidden_states.dtype, 3e-2) if tolerance is None
                          else tolerance),
                         min_token_agreement)
    if not report.passed:
        raise ProbeMismatch(report)
    return report


def _name(layer: torch.nn.Module) -> str:
    backend = getattr(layer, "backend", None)
    return str(backend) if backend is not None else type(layer).__name__


@dataclass(frozen=True)
class ProbeCase:
    """`moe-triton probe`'s layer: I is deliberately unaligned (padding runs)."""

    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 128
    intermediate_size: int = 96
    vocab_size: int = 64
    num_tokens: int = 16


def build_case(case: ProbeCase, backend: str, dtype: torch.dtype, device: torch.device,
               seed: int = 0):
    """The layer on `backend`, prepared, its inputs (T, H) and LM head (V, H)."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = case.num_experts, case.hidden_size, case.intermediate_size
    layer = FusedMoE(E, case.top_k, H, I,
                     routing=RoutingSpec(case.top_k, Scoring.SOFTMAX, renormalize=True),
                     activation=SILU_AND_MUL, placement=Placement(backend), dtype=dtype,
                     device=device)
    with torch.no_grad():
        layer.gate_weight.copy_(torch.randn(E, H, generator=g) / H**0.5)
        layer.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=g) / H**0.5)
        layer.down_proj.copy_(torch.randn(E, H, I, generator=g) / I**0.5)
    layer.prepare_weights()
    hidden_states = torch.randn(case.num_tokens, H, generator=g).to(dtype=dtype, device=device)
    lm_head = (torch.randn(case.vocab_size, H, generator=g) / H**0.5).to(device)
    return layer, hidden_states, lm_head
