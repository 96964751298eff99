"""Parity with transformers' own modules: experts_implementation="moe_triton" inside an unmodified
transformers model, its experts plain or FP8. (from_transformers: tests/test_models.py.)"""
import pytest
import torch
from helpers import all_sparse_qwen3_moe_checkpoint, assert_close

import moe_triton


def test_experts_implementation_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = all_sparse_qwen3_moe_checkpoint(tmp_path)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    logits = {}
    for impl in ("eager", "moe_triton"):
        model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl, dtype=torch.float32).eval()
        assert model.config._experts_implementation == impl
        with torch.no_grad():
            logits[impl] = model(ids).logits
    assert_close(logits["moe_triton"], logits["eager"], torch.float32, scale=10)


def test_experts_implementation_gives_transformers_gradients(tmp_path):
    """Fine-tuning through the drop-in: loss.backward() reaches every parameter as eager's does
    (experts, routers, norms, embeddings), float32 against float32."""
    from transformers import AutoModelForCausalLM

    path = all_sparse_qwen3_moe_checkpoint(tmp_path)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(4))
    grads = {}
    for impl in ("eager", "moe_triton"):
        model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl, dtype=torch.float32)
        model(ids, labels=ids).loss.backward()
        grads[impl] = {name: p.grad for name, p in model.named_parameters()}
    assert grads["moe_triton"].keys() == grads["eager"].keys()
    for name, expected in grads["eager"].items():
        assert grads["moe_triton"][name] is not None, f"{name} got no gradient"
        assert_close(grads["moe_triton"][name], expected, torch.float32, scale=10)


def test_experts_implementation_uses_our_kernels(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import moe_triton.integrations.transformers as integration

    calls = []
    real = integration.run_experts
    monkeypatch.setattr(integration, "run_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = AutoModelForCausalLM.from_pretrained(all_sparse_qwen3_moe_checkpoint(tmp_path), experts_implementation="moe_triton")
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert len(calls) == 2  # one per MoE layer


# ---- FP8: transformers' FP8Experts on our FP8 kernels (FP8ExpertsInterface) ---------------------------
# transformers builds FP8Experts only on an FP8-capable GPU (on CPU it dequantizes on load), so these
# build one directly, with parameters quantized by transformers' own Fp8Quantize, and check its
# dispatch and output against transformers' own dequantization (`_dequantize_fp8_weight`), in float32.
# Our FP8 path also quantizes activations (input and intermediate, each at most 2^-4 relative): the
# relative RMS bound of tests/test_fp8.py, FP8_RMS_TOL = 0.1, applies.

FP8_RMS_TOL = 0.1


def fp8_experts(block_size=(32, 32), activation_scheme="dynamic", E=8, H=64, I=32, seed=0):
    from transformers import FineGrainedFP8Config, Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts, Fp8Quantize
    from transformers.integrations.moe import use_experts_implementation
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    class Experts(FP8Experts):  # decorated as transformers decorates FP8Experts when it swaps experts in
        pass

    Experts = use_experts_implementation(experts_class=Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2)
    config._experts_implementation = "moe_triton"
    experts = Experts(config, block_size=block_size, activation_scheme=activation_scheme)
    block = list(block_size) if block_size else None
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=block)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, shape in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I))):
            if block_size:
                quantized = quantize._quantize_one(name, torch.randn(shape, generator=g) / shape[2] ** 0.5)
                getattr(experts, name).copy_(quantized[name])
                getattr(experts, f"{name}_scale_inv").copy_(quantized[f"{name}_scale_inv"])
            else:  # per tensor: gate and up each their own scale ([E, 2, 1]), down one ([E, 1, 1])
                w = torch.randn(shape, generator=g) / shape[2] ** 0.5
                halves = w.chunk(getattr(experts, f"{name}_scale_inv").shape[1], dim=1)
                scale = torch.stack([h.abs().amax(dim=(1, 2)) / 448 for h in halves], dim=1)[..., None]  # [E, n, 1]
                q = torch.cat([h / s[:, None] for h, s in zip(halves, scale.unbind(1))], dim=1)
                getattr(experts, name).copy_(q.to(torch.float8_e4m3fn))
                getattr(experts, f"{name}_scale_inv").copy_(scale)
        if activation_scheme == "static":
            experts.gate_up_proj_activation_scale.copy_(torch.rand(E, generator=g) * 0.001 + 4 / 448)
    return experts


def dequantized(experts, name):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight, scale = getattr(experts, name), getattr(experts, f"{name}_scale_inv")
    if experts.block_size is None:  # per tensor: expand each half's scale over its rows
        scale = scale.repeat_interleave(weight.shape[1] // scale.shape[1], dim=1)
        return weight.float() * scale
    return _dequantize_fp8_weight(weight, scale, experts.block_size, torch.float32)


@pytest.mark.parametrize("block_size,scheme", [((32, 32), "dynamic"), ((32, 16), "dynamic"), (None, "dynamic"),
                                               (None, "static")], ids=str)
def test_fp8_experts_interface_runs_transformers_fp8_experts_on_our_fp8_kernels(block_size, scheme, monkeypatch):
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    import moe_triton.integrations.transformers as integration

    assert ALL_FP8_EXPERTS_FUNCTIONS["moe_triton"] is integration.moe_triton_fp8_experts_forward  # importing registered it
    calls = []
    real = integration.run_experts
    monkeypatch.setattr(integration, "run_experts", lambda *a, **k: calls.append(a[1].format) or real(*a, **k))
    experts = fp8_experts(block_size, scheme)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=g).half()  # the interpreter's float16 (its bf16 dot is refused)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g)
    with torch.no_grad():
        out = experts(x, ids, weights)  # FP8Experts.forward, dispatched by config._experts_implementation
    assert len(calls) == 1 and calls[0].fp8 is not None and out.dtype == torch.float16
    reference = moe_triton.fused_experts_torch(x, dequantized(experts, "gate_up_proj"), dequantized(experts, "down_proj"),
                                               ids, weights)
    rms = ((out.float() - reference).square().mean() / reference.square().mean()).sqrt()
    assert rms < FP8_RMS_TOL, f"relative RMS error {rms:.3f}"


def test_fp8_experts_interface_gives_straight_through_gradients():
    """transformers' FP8Experts on our kernels in grad mode: the input's and routing weights' gradients
    of the dequantized float32 experts (the activations' quantization counts as the identity)."""
    experts = fp8_experts((32, 32))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 64, generator=g).half().requires_grad_()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g).requires_grad_()
    grad_out = torch.randn(9, 64, generator=g).half()
    grads = torch.autograd.grad(experts(x, ids, weights), (x, weights), grad_out)
    leaves = (x.detach().float().requires_grad_(), weights.detach().requires_grad_())
    reference = moe_triton.fused_experts_torch(leaves[0], dequantized(experts, "gate_up_proj"),
                                               dequantized(experts, "down_proj"), ids, leaves[1])
    for grad, expected in zip(grads, torch.autograd.grad(reference, leaves, grad_out.float())):
        assert_close(grad, expected, torch.float16)


def test_fp8_experts_the_kernels_cannot_run_are_refused_naming_why():
    experts = fp8_experts((32, 16), E=2, I=48)  # one grid over [gate; up] with I = 48: block row 1 mixes them
    with pytest.raises(ValueError, match=r"I=48: moe_triton runs block scales with dynamic activations and a "
                                         r"\[gate; up\] grid it can split"):
        experts(torch.randn(2, 64).half(), torch.tensor([[0, 1], [1, 0]]), torch.rand(2, 2))


@pytest.mark.gpu
def test_fp8_drop_in_on_the_gpu_keeps_transformers_fp8_experts_and_runs_ours(tmp_path, monkeypatch):
    """On an FP8 GPU transformers keeps FP8Experts; only the experts are FP8 here, so no FP8 linear of
    transformers' (whose kernel comes from the Hub) runs. bf16 adds to FP8's error: 0.08 relative."""
    from helpers import experts_fp8_qwen3_checkpoint, relative_error, spy_on_fp8_experts
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path = experts_fp8_qwen3_checkpoint(tmp_path, 256, 128, 64, (128, 128), "bfloat16")
    calls = spy_on_fp8_experts(monkeypatch)  # what transformers calls
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_triton", device_map="cuda")
    assert type(model.model.layers[0].mlp.experts).__name__ == "FP8Experts"
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5)).cuda()
    reference = AutoModelForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                     dtype=torch.float32, device_map="cuda")
    with torch.no_grad():
        assert relative_error(model(ids).logits, reference(ids).logits) < 0.08
    assert len(calls) == 2
