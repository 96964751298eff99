"""Gradients through FusedMoE (issue 25, item 1): what the backward costs on each backend.

The triton backend runs our kernels forward and recomputes each expert's rows in float32 torch
backward (reference.py's fused_experts_backward_torch, one host read of the expert counts); the
torch backend runs the float32 reference both ways under autograd. Timed on Qwen3-30B-A3B's layer
(E128 K8 H2048 I768, router included) at 256 and 4096 tokens in bf16, CUDA events around whole
calls (host gaps included): the forward under torch.no_grad (inference), the forward in grad mode
(the differentiable op, its saved tensors), and forward + backward; the backward's share is
(forward + backward - forward in grad mode) / (forward + backward). The backward's FLOPs are twice
the forward's (an input and a weight gradient per GEMM), all in float32.

    python -m pytest benchmarks/test_grad.py -m gpu --benchmark-only --bench-table grad.md
"""
import pytest
import torch
from measure import event_median_seconds

from moe_triton import FusedMoE, Placement, RoutingSpec
from moe_triton.tools.bench import QWEN3_30B_A3B, layer_flops, random_experts


def qwen3_layer(backend: str) -> FusedMoE:
    shape = QWEN3_30B_A3B
    E, K, H, I = shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size
    layer = FusedMoE(E, K, H, I, routing=RoutingSpec(K, renormalize=True),
                     placement=Placement(backend), dtype=torch.bfloat16, device="cuda")
    w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
    with torch.no_grad():
        layer.gate_up_proj.copy_(w13)
        layer.down_proj.copy_(w2)
        layer.gate_weight.normal_(0, H**-0.5)
    layer.prepare_weights()
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("num_tokens", [256, 4096])
def test_forward_and_backward(benchmark, backend, num_tokens, record):
    shape = QWEN3_30B_A3B
    layer = qwen3_layer(backend)
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, shape.hidden_size, generator=g,
                    device="cuda").bfloat16().requires_grad_()
    grad_out = torch.randn(num_tokens, shape.hidden_size, generator=g, device="cuda").bfloat16()

    def forward_inference():
        with torch.no_grad():
            return layer(x)

    def forward_and_backward():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad_out)

    forward_inference_s = event_median_seconds(forward_inference)
    forward_grad_s = event_median_seconds(lambda: layer(x))
    train_s = event_median_seconds(forward_and_backward, iterations=10)
    backward_flops = 2 * layer_flops(shape, num_tokens)
    share = (train_s - forward_grad_s) / train_s
    record("FusedMoE forward and backward, Qwen3-30B-A3B layer (bf16)", dict(
        shape=shape.name, T=num_tokens, backend=backend,
        forward_ms=f"{forward_inference_s * 1e3:.3f}",
        forward_grad_mode_ms=f"{forward_grad_s * 1e3:.3f}",
        forward_backward_ms=f"{train_s * 1e3:.3f}",
        backward_share=f"{share:.2f}",
        backward_TFLOPs=f"{backward_flops / (train_s - forward_grad_s) / 1e12:.1f}",
    ))
    benchmark.extra_info.update(dict(
        shape=shape.name, num_experts=shape.num_experts, top_k=shape.top_k,
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_tokens=num_tokens, dtype="bfloat16", backend=backend,
        forward_s=forward_inference_s, forward_grad_mode_s=forward_grad_s,
        forward_backward_s=train_s,
        backward_share=share, backward_flops=backward_flops,
    ))
    benchmark.pedantic(lambda: (forward_and_backward(), torch.cuda.synchronize()), rounds=5,
                       warmup_rounds=1)
