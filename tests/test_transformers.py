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
        model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl,
                                                     dtype=torch.float32).eval()
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
        model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl,
                                                     dtype=torch.float32)
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
    monkeypatch.setattr(integration, "run_experts",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    model = AutoModelForCausalLM.from_pretrained(all_sparse_qwen3_moe_checkpoint(tmp_path),
                                                 experts_implementation="moe_triton")
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert len(calls) == 2  # one per MoE layer


def qwen3_experts(seed=0, transposed=False):
    """transformers' Qwen3MoeExperts (E 4, H 16, I 8), random; `transposed` stores its weights as
    (E, H, 2I) and (E, I, H) under `is_transposed`, as gpt-oss-style experts do."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4)
    experts = Qwen3MoeExperts(config)
    g = torch.Generator().manual_seed(seed)
    for name, p in list(experts.named_parameters()):
        w = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        w = w.transpose(1, 2).contiguous() if transposed else w
        setattr(experts, name, torch.nn.Parameter(w))
    experts.is_transposed = transposed
    return experts


def routed(seed=1, T=5, E=4, H=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    return torch.randn(T, H, generator=g), ids, torch.rand(T, 2, generator=g)


def spy_on_weights(monkeypatch):
    """The ExpertWeights each drop-in call hands to run_experts, in order."""
    import moe_triton.integrations.transformers as integration

    seen, real = [], integration.run_experts
    spy = lambda *args, **kwargs: seen.append(args[1]) or real(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(integration, "run_experts", spy)
    return seen


def test_the_drop_in_builds_its_expert_weights_once_per_module(monkeypatch):
    """Built on the first call, reused while the module holds the same parameters; built anew
    after a parameter is replaced or its data moved (and the output is then the new weights')."""
    from moe_triton.integrations.transformers import moe_triton_experts_forward as forward

    seen = spy_on_weights(monkeypatch)
    experts, other = qwen3_experts(), qwen3_experts(seed=2)
    x, ids, weights = routed()
    with torch.no_grad():
        for module in (experts, experts, other, experts):
            forward(module, x, ids, weights)
        assert seen[1] is seen[0] and seen[3] is seen[0] and seen[2] is not seen[0]
        experts.down_proj = torch.nn.Parameter(experts.down_proj * 2)  # replaced
        out = forward(experts, x, ids, weights)
        assert seen[-1] is not seen[0] and seen[-1].w2 is experts.down_proj
        w13, w2 = experts.gate_up_proj, experts.down_proj
        assert_close(out, moe_triton.fused_experts_torch(x, w13, w2, ids, weights), torch.float32)
        experts.gate_up_proj.data = experts.gate_up_proj.data.clone()  # moved: same Parameter
        forward(experts, x, ids, weights)
        assert seen[-1] is not seen[-2]
        assert seen[-1].w13.data_ptr() == experts.gate_up_proj.data_ptr()


def test_the_drop_in_s_cached_views_follow_grad_mode():
    """Transposed storage is held as views: built under no_grad they carry no autograd, so a call
    in grad mode builds them again and gradients reach the parameters."""
    from moe_triton.integrations.transformers import moe_triton_experts_forward as forward

    experts = qwen3_experts(transposed=True)
    x, ids, weights = routed()
    with torch.no_grad():
        forward(experts, x, ids, weights)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    params = (experts.gate_up_proj, experts.down_proj)
    grads = torch.autograd.grad(forward(experts, x, ids, weights), params, grad_out)
    w13, w2 = (p.transpose(1, 2) for p in params)
    reference = moe_triton.fused_experts_torch(x, w13, w2, ids, weights)
    for grad, expected in zip(grads, torch.autograd.grad(reference, params, grad_out), strict=True):
        assert_close(grad, expected, torch.float32)


# ---- FP8: transformers' FP8Experts on our FP8 kernels (FP8ExpertsInterface) ----------------------
# transformers builds FP8Experts only on an FP8-capable GPU (on CPU it dequantizes on load), so
# these build one directly, with parameters quantized by transformers' own Fp8Quantize, and check
# its dispatch and output against transformers' own dequantization (`_dequantize_fp8_weight`), in
# float32. Our FP8 path also quantizes activations (input and intermediate, each at most 2^-4
# relative): the relative RMS bound of tests/test_fp8.py, FP8_RMS_TOL = 0.1, applies.

FP8_RMS_TOL = 0.1


def fp8_experts(block_size=(32, 32), activation_scheme="dynamic", E=8, H=64, I=32, seed=0):
    from transformers import FineGrainedFP8Config, Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import (
        ALL_FP8_EXPERTS_FUNCTIONS,
        FP8Experts,
        Fp8Quantize,
    )
    from transformers.integrations.moe import use_experts_implementation
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    # decorated as transformers decorates FP8Experts when it swaps experts in
    class Experts(FP8Experts):
        pass

    Experts = use_experts_implementation(experts_class=Experts,
                                         experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                            num_experts_per_tok=2)
    config._experts_implementation = "moe_triton"
    experts = Experts(config, block_size=block_size, activation_scheme=activation_scheme)
    block = list(block_size) if block_size else None
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=block)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, shape in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I))):
            if block_size:
                quantized = quantize._quantize_one(
                    name, torch.randn(shape, generator=g) / shape[2] ** 0.5)
                getattr(experts, name).copy_(quantized[name])
                getattr(experts, f"{name}_scale_inv").copy_(quantized[f"{name}_scale_inv"])
            else:  # per tensor: gate and up each their own scale ([E, 2, 1]), down one ([E, 1, 1])
                w = torch.randn(shape, generator=g) / shape[2] ** 0.5
                halves = w.chunk(getattr(experts, f"{name}_scale_inv").shape[1], dim=1)
                scale = torch.stack([h.abs().amax(dim=(1, 2)) / 448 for h in halves],
                                    dim=1)[..., None]  # [E, n, 1]
                q = torch.cat([h / s[:, None]
                               for h, s in zip(halves, scale.unbind(1), strict=True)], dim=1)
                getattr(experts, name).copy_(q.to(torch.float8_e4m3fn))
                getattr(experts, f"{name}_scale_inv").copy_(scale)
        if activation_scheme == "static":
            experts.gate_up_proj_activation_scale.copy_(torch.rand(E, generator=g) * 0.001
                                                        + 4 / 448)
    return experts


def dequantized(experts, name):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight, scale = getattr(experts, name), getattr(experts, f"{name}_scale_inv")
    if experts.block_size is None:  # per tensor: expand each half's scale over its rows
        scale = scale.repeat_interleave(weight.shape[1] // scale.shape[1], dim=1)
        return weight.float() * scale
    return _dequantize_fp8_weight(weight, scale, experts.block_size, torch.float32)


@pytest.mark.parametrize("block_size,scheme",
                         [((32, 32), "dynamic"), ((32, 16), "dynamic"), (None, "dynamic"),
                          (None, "static")], ids=str)
def test_fp8_experts_interface_runs_transformers_fp8_experts_on_our_fp8_kernels(block_size, scheme,
                                                                                monkeypatch):
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    import moe_triton.integrations.transformers as integration

    # importing registered it
    assert ALL_FP8_EXPERTS_FUNCTIONS["moe_triton"] is integration.moe_triton_fp8_experts_forward
    calls = []
    real = integration.run_experts
    monkeypatch.setattr(integration, "run_experts",
                        lambda *a, **k: calls.append(a[1].format) or real(*a, **k))
    experts = fp8_experts(block_size, scheme)
    g = torch.Generator().manual_seed(3)
    # the interpreter's float16 (its bf16 dot is refused)
    x = torch.randn(9, 64, generator=g).half()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g)
    with torch.no_grad():
        out = experts(x, ids, weights)  # FP8Experts.forward, dispatched by
        #                                 config._experts_implementation
    assert len(calls) == 1 and calls[0].fp8 is not None and out.dtype == torch.float16
    reference = moe_triton.fused_experts_torch(x, dequantized(experts, "gate_up_proj"),
                                               dequantized(experts, "down_proj"),
                                               ids, weights)
    rms = ((out.float() - reference).square().mean() / reference.square().mean()).sqrt()
    assert rms < FP8_RMS_TOL, f"relative RMS error {rms:.3f}"


def test_fp8_experts_interface_gives_straight_through_gradients():
    """transformers' FP8Experts on our kernels in grad mode: the input's and routing weights'
    gradients of the dequantized float32 experts (the activations' quantization counts as the
    identity)."""
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
    for grad, expected in zip(grads, torch.autograd.grad(reference, leaves, grad_out.float()),
                              strict=True):
        assert_close(grad, expected, torch.float16)


def test_fp8_drop_in_converts_scales_once_and_again_when_they_change(monkeypatch):
    """Per-tensor scales are converted into per-row ones on the first call only; a scale written in
    place or replaced is converted anew (the output follows it)."""
    seen = spy_on_weights(monkeypatch)
    experts = fp8_experts(None, "static")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=g).half()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g)

    def rms_error():
        out = experts(x, ids, weights)
        reference = moe_triton.fused_experts_torch(x, dequantized(experts, "gate_up_proj"),
                                                   dequantized(experts, "down_proj"), ids, weights)
        return ((out.float() - reference).square().mean() / reference.square().mean()).sqrt()

    with torch.no_grad():
        assert rms_error() < FP8_RMS_TOL
        experts(x, ids, weights)
        assert len(seen) == 2 and seen[1] is seen[0]
        experts.down_proj_scale_inv.mul_(2)  # in place
        assert rms_error() < FP8_RMS_TOL and seen[-1] is not seen[0]
        replaced = torch.nn.Parameter(experts.gate_up_proj_scale_inv * 0.5)
        experts.gate_up_proj_scale_inv = replaced
        assert rms_error() < FP8_RMS_TOL and seen[-1] is not seen[-2]


def test_fp8_experts_the_kernels_cannot_run_are_refused_naming_why():
    # one grid over [gate; up] with I = 48: block row 1 mixes them
    experts = fp8_experts((32, 16), E=2, I=48)
    with pytest.raises(ValueError,
                       match=r"I=48: moe_triton runs block scales with dynamic activations and a "
                                         r"\[gate; up\] grid it can split"):
        experts(torch.randn(2, 64).half(), torch.tensor([[0, 1], [1, 0]]), torch.rand(2, 2))


@pytest.mark.gpu
def test_fp8_drop_in_on_the_gpu_keeps_transformers_fp8_experts_and_runs_ours(tmp_path, monkeypatch):
    """On an FP8 GPU transformers keeps FP8Experts; only the experts are FP8 here, so no FP8 linear
    of transformers' (whose kernel comes from the Hub) runs. bf16 adds to FP8's error: 0.08
    relative."""
    from helpers import experts_fp8_qwen3_checkpoint, relative_error, spy_on_fp8_experts
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path = experts_fp8_qwen3_checkpoint(tmp_path, 256, 128, 64, (128, 128), "bfloat16")
    calls = spy_on_fp8_experts(monkeypatch)  # what transformers calls
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_triton",
                                                 device_map="cuda")
    assert type(model.model.layers[0].mlp.experts).__name__ == "FP8Experts"
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5)).cuda()
    reference = AutoModelForCausalLM.from_pretrained(path,
                                                     quantization_config=FineGrainedFP8Config(dequantize=True),
                                                     dtype=torch.float32, device_map="cuda")
    with torch.no_grad():
        assert relative_error(model(ids).logits, reference(ids).logits) < 0.08
    assert len(calls) == 2


@pytest.mark.gpu
def test_drop_in_calls_never_sync_the_host():
    """transformers' experts modules on moe_triton at Qwen3-30B-A3B's size, bf16 and FP8
    (FP8Experts, block-128), eager: no host sync from the second call of a size on (torch's sync
    debug mode)."""
    from helpers import no_host_sync
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, K, H, I = 128, 8, 2048, 768
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                            num_experts_per_tok=K)
    config._experts_implementation = "moe_triton"
    with torch.device("cuda"):
        bf16 = Qwen3MoeExperts(config).to(torch.bfloat16).requires_grad_(False)
    for p in bf16.parameters():
        p.normal_(0, H ** -0.5)
    fp8 = fp8_experts((128, 128), E=E, H=H, I=I).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (1, 8, 256):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(T, E, device="cuda", generator=g).topk(K).indices  # int64, as the router
        weights = torch.rand(T, K, device="cuda", generator=g, dtype=torch.bfloat16)
        with torch.no_grad():
            for experts in (bf16, fp8):
                expected = experts(x, ids, weights)
                with no_host_sync():
                    out = experts(x, ids, weights)
                assert torch.equal(out, expected)


# ---- gpt-oss: biased experts, interleaved gate/up, transposed storage, clamped swiglu ------------

def tiny_gpt_oss_config():
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"],
                        max_position_embeddings=131072)  # YaRN's 32 x 4096: no warning


def test_gpt_oss_experts_drop_in_matches_their_eager_forward_and_gradients():
    """GptOssExperts (has_bias, is_concatenated=False, is_transposed=True, alpha/limit) through
    the ExpertsInterface entry, against its own eager forward: outputs, and the gradients of x,
    the routing weights and every expert parameter, biases included. float32 on the CPU."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from moe_triton.integrations.transformers import moe_triton_experts_forward

    torch.manual_seed(0)
    experts = GptOssExperts(tiny_gpt_oss_config())
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(9, 64, requires_grad=True)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    weights = torch.rand(9, 2).softmax(-1).requires_grad_()
    grad_out = torch.randn(9, 64)
    inputs = [x, weights, *experts.parameters()]
    outs, grads = {}, {}
    for impl, forward in (("eager", experts.forward),
                          ("moe_triton", lambda *a: moe_triton_experts_forward(experts, *a))):
        outs[impl] = forward(x, ids, weights)
        grads[impl] = torch.autograd.grad(outs[impl], inputs, grad_out)
    assert_close(outs["moe_triton"], outs["eager"], torch.float32)
    for mine, theirs in zip(grads["moe_triton"], grads["eager"], strict=True):
        assert_close(mine, theirs, torch.float32)


def test_gpt_oss_model_with_moe_triton_experts_gives_eager_logits(monkeypatch):
    from transformers import GptOssForCausalLM

    import moe_triton.integrations.transformers as integration

    calls, real = [], integration.run_experts
    monkeypatch.setattr(integration, "run_experts",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(1)
    eager = GptOssForCausalLM(tiny_gpt_oss_config()).eval()
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if "experts" in name or "sinks" in name:
                p.normal_(0, 0.3)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = eager(ids).logits
        eager.set_experts_implementation("moe_triton")
        assert eager.config._experts_implementation == "moe_triton"
        actual = eager(ids).logits
    assert len(calls) == 2  # one per layer: the sliding and the full attention one
    assert_close(actual, expected, torch.float32, scale=10)


@pytest.mark.gpu
def test_gpt_oss_experts_drop_in_on_the_gpu():
    """bf16 at a realistic width, against the module's own eager forward (bf16 too)."""
    from helpers import relative_error
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from moe_triton.integrations.transformers import moe_triton_experts_forward

    config = tiny_gpt_oss_config()
    config.hidden_size, config.intermediate_size, config.num_local_experts = 1024, 1024, 8
    torch.manual_seed(0)
    experts = GptOssExperts(config).cuda().bfloat16()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 1024**-0.5)
    x = torch.randn(64, 1024, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(64)]).cuda()
    weights = torch.rand(64, 2, device="cuda").softmax(-1).bfloat16()
    with torch.no_grad():
        expected = experts(x, ids, weights)
        actual = moe_triton_experts_forward(experts, x, ids, weights)
    assert relative_error(actual, expected) < 1e-2
