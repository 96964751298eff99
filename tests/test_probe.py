"""tools/probe.py and `moe-triton probe`: one layer on two backends, compared at temperature 0."""
import pytest
import torch

import moe_triton.tools.probe as probe_module
from moe_triton.tools.cli import main
from moe_triton.tools.probe import ProbeCase, ProbeMismatch, build_case, probe

CASE = ProbeCase(num_tokens=12)


def pair(backend_b="triton", seed=0):
    layer_a, x, lm_head = build_case(CASE, "torch", torch.float32, torch.device("cpu"), seed)
    layer_b, _, _ = build_case(CASE, backend_b, torch.float32, torch.device("cpu"), seed)
    return layer_a, layer_b, x, lm_head


def swap_gate_up_(layer):
    """The classic fused-path bug: [gate; up] read as [up; gate]."""
    with torch.no_grad():
        gate, up = layer.gate_up_proj.chunk(2, dim=1)
        layer.gate_up_proj.copy_(torch.cat([up, gate], dim=1))


def test_torch_and_triton_agree():
    layer_a, layer_b, x, lm_head = pair()
    report = probe(layer_a, layer_b, x, lm_head=lm_head)
    assert report.passed and report.token_agreement == 1.0
    assert (report.backend_a, report.backend_b) == ("torch", "triton")
    assert report.rel_diff <= report.tolerance == probe_module.TOLERANCE[torch.float32]
    assert str(report).startswith("PASS: torch vs triton")


def test_a_plausible_but_wrong_backend_fails_loudly():
    layer_a, layer_b, x, lm_head = pair()
    swap_gate_up_(layer_b)
    with pytest.raises(ProbeMismatch) as mismatch:
        probe(layer_a, layer_b, x, lm_head=lm_head)
    report = mismatch.value.report
    assert not report.passed and report.rel_diff > report.tolerance and report.token_agreement < 1.0
    assert str(mismatch.value).startswith("FAIL")


def test_token_agreement_threshold_and_no_lm_head():
    layer_a, layer_b, x, lm_head = pair(backend_b="torch")
    assert probe(layer_a, layer_b, x).token_agreement is None
    assert probe(layer_a, layer_b, x, lm_head=lm_head, min_token_agreement=1.0).passed


def test_cli_probe_passes(capsys):
    assert main(["probe", "torch", "triton", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "PASS: torch vs triton" in out and "greedy tokens agree 100.0%" in out


def test_cli_probe_exits_non_zero_on_a_mismatch(capsys, monkeypatch):
    def broken_build_case(case, backend, *args, **kwargs):
        layer, x, lm_head = build_case(case, backend, *args, **kwargs)
        if backend == "triton":
            swap_gate_up_(layer)
        return layer, x, lm_head

    monkeypatch.setattr(probe_module, "build_case", broken_build_case)
    assert main(["probe", "torch", "triton", "--tokens", "8"]) == 1
    assert "FAIL: torch vs triton" in capsys.readouterr().out


def test_cli_probe_refuses_an_impossible_backend(capsys):
    assert main(["probe", "torch", "flashinfer_trtllm"]) == 2
    assert "backend='flashinfer_trtllm' cannot run on CPU" in capsys.readouterr().err
