"""runners/resolver.py (with rules.py and catalog.py): every rule, with the platform faked.

SM90 is the H200; SM100/SM103 Blackwell datacenter parts (trtllm-gen); SM110 and SM120 newer parts
no rule pins. FlashInfer counts as installed unless a test says otherwise.
"""
import json
import logging
import re

import pytest
import torch
from helpers import QUANT_CONFIGS

import moe_triton.platform as platforms
from moe_triton import (
    SILU_AND_MUL,
    Activation,
    ActivationKind,
    FusedMoE,
    ModelContext,
    Placement,
    RoutingSpec,
    Scoring,
    resolve,
)
from moe_triton.platform import Platform
from moe_triton.runners import RULES, ExpertBackend, LayerTraits
from moe_triton.runners.resolver import parse_backend
from moe_triton.runners.rules import rule
from moe_triton.tools.cli import main

FI = "0.7.2.post1"
PLATFORMS = {
    "SM90": Platform("cuda", (9, 0), FI), "SM100": Platform("cuda", (10, 0), FI),
    "SM103": Platform("cuda", (10, 3), FI), "SM110": Platform("cuda", (11, 0), FI),
    "SM120": Platform("cuda", (12, 0), FI), "CPU": Platform("cpu", None, FI, interpreter=False),
}
BLACKWELL = ("SM100", "SM103")
COHERE2 = ("Cohere2MoeForCausalLM", "Cohere2VisionForConditionalGeneration")
MINIMAX = "MiniMaxM2ForCausalLM"
TRITON, TORCH = ExpertBackend.TRITON, ExpertBackend.TORCH
FUSED, ROUTED, CUTLASS = (ExpertBackend.FLASHINFER_TRTLLM, ExpertBackend.FLASHINFER_TRTLLM_ROUTED,
                          ExpertBackend.FLASHINFER_CUTLASS)


def default_on(platform_name):
    return TORCH if platform_name == "CPU" else TRITON


def auto(platform_name, architecture=None, quant=None, **context):
    return resolve("auto", PLATFORMS[platform_name], ModelContext(architecture, quant, **context))


# ---- auto, no rule ------------------------------------------------------------------------------

def test_default_triton_on_gpu_torch_on_cpu_triton_under_the_interpreter():
    assert auto("SM90").backend is TRITON and auto("SM100").backend is TRITON
    assert auto("CPU").backend is TORCH
    assert resolve("auto", Platform("cpu", interpreter=True)).backend is TRITON


@pytest.mark.parametrize("quant", ["none", "modelopt-nvfp4", "ct-nvfp4-linear"])
@pytest.mark.parametrize("platform_name", list(PLATFORMS))
def test_other_architectures_keep_the_default(platform_name, quant):
    """No global fallback: a rule for one family changes no other model's default."""
    resolution = auto(platform_name, "Qwen3MoeForCausalLM", QUANT_CONFIGS[quant][0])
    assert resolution.backend is default_on(platform_name) and resolution.rule == "default"


# ---- Cohere2-MoE -------------------------------------------------------------------------------

@pytest.mark.parametrize("architecture", COHERE2)
@pytest.mark.parametrize("quant", list(QUANT_CONFIGS))
@pytest.mark.parametrize("platform_name", list(PLATFORMS))
def test_cohere2_moe(platform_name, quant, architecture):
    config, experts_format = QUANT_CONFIGS[quant]
    resolution = auto(platform_name, architecture, config)
    pinned = platform_name in BLACKWELL and experts_format.value in ("unquantized", "NVFP4")
    assert resolution.backend is (FUSED if pinned else default_on(platform_name)), resolution.reason
    assert resolution.rule == "cohere2_moe"


def test_cohere2_reasons_say_why():
    assert "FP8" in auto("SM100", COHERE2[0], QUANT_CONFIGS["modelopt-fp8"][0]).reason
    assert "rejects" in auto("SM100", COHERE2[0],
                             QUANT_CONFIGS["ct-mixed-nvfp4-attention-fp8-experts"][0]).reason
    assert "fail closed" in auto("SM100", COHERE2[0],
                                 QUANT_CONFIGS["unreadable-separate-file"][0]).reason
    assert "SM100/SM103 only, not SM90" in auto("SM90", COHERE2[0]).reason


# ---- MiniMax-M2 --------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", list(QUANT_CONFIGS))
@pytest.mark.parametrize("platform_name", list(PLATFORMS))
def test_minimax_m2(platform_name, quant):
    resolution = auto(platform_name, MINIMAX, QUANT_CONFIGS[quant][0])
    pinned = platform_name in BLACKWELL and quant.startswith("modelopt-nvfp4")
    assert resolution.backend is (ROUTED if pinned
                                  else default_on(platform_name)), resolution.reason
    assert resolution.rule == "minimax_m2"


def test_minimax_m2_all_to_all_without_a_routed_registration_is_not_pinned():
    resolution = auto("SM100", MINIMAX, QUANT_CONFIGS["modelopt-nvfp4"][0], all_to_all="deepep")
    assert resolution.backend is TRITON
    assert ("'deepep' has no fused registration" in resolution.reason
            and "flashinfer_trtllm_routed" in resolution.reason)


@pytest.mark.parametrize("architecture,quant", [(COHERE2[0], "none"), (MINIMAX, "modelopt-nvfp4")])
def test_a_pin_that_cannot_run_keeps_the_default(architecture, quant):
    config = QUANT_CONFIGS[quant][0]
    assert "LoRA" in auto("SM100", architecture, config, lora=True).reason
    assert auto("SM100", architecture, config, lora=True).backend is TRITON
    assert auto("SM103", architecture, config, all_to_all="deepep").backend is TRITON
    no_flashinfer = resolve("auto", Platform("cuda", (10, 0), None),
                            ModelContext(architecture, config))
    assert no_flashinfer.backend is TRITON and "not installed" in no_flashinfer.reason
    old = resolve("auto", Platform("cuda", (10, 0), "0.6.1"), ModelContext(architecture, config))
    assert old.backend is TRITON and "older than 0.7.2" in old.reason


def test_layer_traits_also_keep_the_default():
    fp16_layer = LayerTraits(128, torch.float16, SILU_AND_MUL, RoutingSpec(2))
    resolution = resolve("auto", PLATFORMS["SM100"], ModelContext(COHERE2[0]), fp16_layer)
    assert resolution.backend is TRITON and "torch.float16" in resolution.reason


def test_biased_experts_keep_to_the_backends_that_add_biases():
    """gpt-oss's expert biases: a rule pinning FlashInfer for the model falls back to Triton
    with the reason; asking for FlashInfer outright is refused, naming it."""
    biased = LayerTraits(128, torch.bfloat16, SILU_AND_MUL, RoutingSpec(2), expert_bias=True)
    resolution = resolve("auto", PLATFORMS["SM100"], ModelContext(COHERE2[0]), biased)
    assert resolution.backend is TRITON and "does not add expert biases" in resolution.reason
    with pytest.raises(ValueError, match="does not add expert biases"):
        resolve(CUTLASS, PLATFORMS["SM90"], ModelContext(), biased)
    assert resolve(TORCH, PLATFORMS["CPU"], ModelContext(), biased).backend is TORCH


# ---- explicit requests -------------------------------------------------------------------------

@pytest.mark.parametrize("requested,platform_name", [
    (TRITON, "SM100"), (TORCH, "SM100"), (TORCH, "CPU"), (FUSED, "SM100"), (FUSED, "SM103"),
    (ROUTED, "SM103"), (CUTLASS, "SM90"), (CUTLASS, "SM120"), (TRITON, "SM90")])
@pytest.mark.parametrize("architecture", [COHERE2[0], MINIMAX, None])
def test_explicit_requests_are_never_rewritten(requested, platform_name, architecture):
    resolution = resolve(str(requested), PLATFORMS[platform_name], ModelContext(architecture))
    assert resolution.backend is requested and resolution.rule == "explicit request"


@pytest.mark.parametrize("requested,platform,context,reason", [
    ("flashinfer_trtllm", PLATFORMS["SM90"], ModelContext(), "SM100, SM103 only"),
    ("flashinfer_trtllm", PLATFORMS["SM110"], ModelContext(), "SM100, SM103 only"),
    ("flashinfer_trtllm_routed", PLATFORMS["SM120"], ModelContext(), "SM100, SM103 only"),
    ("flashinfer_cutlass", PLATFORMS["CPU"], ModelContext(), "needs a CUDA GPU"),
    ("flashinfer_trtllm", Platform("cuda", (10, 0), None), ModelContext(),
     "FlashInfer is not installed"),
    ("flashinfer_trtllm", PLATFORMS["SM100"],
     ModelContext(quant_config=QUANT_CONFIGS["modelopt-fp8"][0]), "FP8"),
    ("flashinfer_trtllm", PLATFORMS["SM100"], ModelContext(quant_config="hf_quant_config.json"),
     "unreadable"),
    ("flashinfer_cutlass", PLATFORMS["SM90"],
     ModelContext(quant_config=QUANT_CONFIGS["modelopt-nvfp4"][0]), "NVFP4"),
    ("flashinfer_trtllm_routed", PLATFORMS["SM100"], ModelContext(all_to_all="deepep"), "deepep"),
    ("flashinfer_cutlass", PLATFORMS["SM90"], ModelContext(lora=True), "LoRA"),
    ("triton", PLATFORMS["CPU"], ModelContext(), "interpreter"),
])
def test_impossible_explicit_requests_raise_naming_backend_platform_and_reason(requested, platform,
                                                                               context, reason):
    with pytest.raises(ValueError,
                       match=re.escape(f"backend='{requested}' cannot run "
                                       f"on {platform}: ")) as error:
        resolve(requested, platform, context)
    assert reason in str(error.value)


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError,
                       match="backend='cuda' is not a backend; pass one of auto, triton, torch"):
        parse_backend("cuda")


# ---- the layer: resolved once at construction, logged, kept -------------------------------------

def test_layer_resolves_through_the_replaceable_platform_detection(monkeypatch):
    monkeypatch.setattr(platforms, "detect_platform", lambda device=None: PLATFORMS["SM100"])
    layer = FusedMoE(8, 2, 128, 96, routing=RoutingSpec(2, Scoring.SOFTMAX, renormalize=True),
                     placement=Placement(context=ModelContext(COHERE2[0])), dtype=torch.bfloat16)
    assert layer.backend is FUSED and layer.resolution.rule == "cohere2_moe"
    assert "SM100" in str(layer.resolution)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(dtype=torch.float16), "torch.float16"),
    (dict(hidden_size=100), "hidden size 100 is not a multiple of 128"),
    (dict(activation=Activation(ActivationKind.CLAMPED_SWIGLU)), "CLAMPED_SWIGLU"),
    (dict(routing=RoutingSpec(2, Scoring.SIGMOID, correction_bias=True)),
     "flashinfer_trtllm_routed"),
])
def test_layer_rejects_an_impossible_request_at_construction(kwargs, reason):
    args = dict(hidden_size=128, dtype=torch.bfloat16, activation=SILU_AND_MUL) | kwargs
    with pytest.raises(ValueError,
                       match="backend='flashinfer_trtllm' cannot run on SM100") as error:
        FusedMoE(8, 2, args.pop("hidden_size"), 96,
                 placement=Placement("flashinfer_trtllm", platform=PLATFORMS["SM100"]), **args)
    assert reason in str(error.value)


def test_resolution_is_logged_once(caplog):
    context = ModelContext("LoggedOnceForTest")
    with caplog.at_level(logging.INFO, logger="moe_triton"):
        for _ in range(3):
            FusedMoE(4, 2, 16, 8, placement=Placement("torch", context, platform=PLATFORMS["CPU"]))
    assert len([r for r in caplog.records if "moe_triton experts backend" in r.getMessage()]) == 1


def test_rules_register_by_architecture_and_refuse_duplicates():
    assert ({RULES[name].name for name in COHERE2} == {"cohere2_moe"}
            and RULES[MINIMAX].name == "minimax_m2")
    with pytest.raises(ValueError, match="already has rule"):
        rule(MINIMAX)(lambda platform, context: None)


# ---- moe-triton resolve ------------------------------------------------------------------------

def write_config(tmp_path, architecture, quant=None, separate_file=False):
    config = {"architectures": [architecture], "hidden_size": 128}
    if quant is not None:
        config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    if separate_file:
        (tmp_path / "hf_quant_config.json").write_text(
            json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    return tmp_path


@pytest.mark.parametrize("args,backend,rule_name", [
    (["--platform", "sm100"], "flashinfer_trtllm", "cohere2_moe"),
    (["--platform", "sm90"], "triton", "cohere2_moe"),
    (["--platform", "sm100", "--lora"], "triton", "cohere2_moe"),
    (["--platform", "sm100", "--backend", "torch"], "torch", "explicit request"),
    (["--platform", "cpu"], "torch", "cohere2_moe"),
])
def test_cli_resolve_prints_backend_and_rule(tmp_path, capsys, args, backend, rule_name):
    model = write_config(tmp_path, COHERE2[0], QUANT_CONFIGS["ct-nvfp4-experts-regex"][0])
    assert main(["resolve", str(model), *args]) == 0
    out = capsys.readouterr().out
    assert f"backend:       {backend}\n" in out and f"rule:          {rule_name}\n" in out
    assert "NVFP4 experts" in out


def test_cli_resolve_reads_a_separate_modelopt_file_and_fails_closed_on_a_broken_one(tmp_path,
                                                                                     capsys):
    # hf_quant_config.json: ModelOpt NVFP4
    model = write_config(tmp_path, COHERE2[0], separate_file=True)
    assert main(["resolve", str(model / "config.json"), "--platform", "sm100"]) == 0
    out = capsys.readouterr().out
    assert "backend:       flashinfer_trtllm" in out and "ModelOpt quant_algo 'NVFP4'" in out
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    assert main(["resolve", str(model / "config.json"), "--platform", "sm100"]) == 0
    out = capsys.readouterr().out
    assert "backend:       triton" in out and "unreadable" in out


def test_cli_resolve_minimax_with_deepep(tmp_path, capsys):
    model = write_config(tmp_path, MINIMAX, QUANT_CONFIGS["modelopt-nvfp4"][0])
    assert main(["resolve", str(model), "--platform", "sm103", "--all-to-all", "deepep"]) == 0
    assert "no fused registration" in capsys.readouterr().out


def test_cli_resolve_refusals_exit_non_zero(tmp_path, capsys):
    model = write_config(tmp_path, MINIMAX)
    assert main(["resolve", str(model), "--platform", "sm90", "--backend",
                 "flashinfer_trtllm_routed"]) == 2
    assert "cannot run on SM90" in capsys.readouterr().err
    assert main(["resolve", str(tmp_path / "missing"), "--platform", "sm90"]) == 2
    assert main(["resolve", str(model), "--platform", "h200"]) == 2
    assert "not a platform name" in capsys.readouterr().err


# ---- moe-triton resolve reports what load_model runs ---------------------------------------------

def save_tiny(model, path, dtype: str, quantize=None):
    """`model` saved to `path` with config.json's dtype set; `quantize` (a compressed-tensors
    strategy): every projection in FP8 with its weight_scale, as compressed-tensors writes them
    (helpers.fp8_quantize)."""
    from helpers import ct_fp8, fp8_quantize
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text()) | {"dtype": dtype}
    if quantize is not None:
        tensors = {}
        for name, w in load_file(path / "model.safetensors").items():
            if name.endswith("proj.weight"):
                q, scale = fp8_quantize(w, quantize, (32, 32))
                tensors |= {name: q, name.removesuffix("weight") + "weight_scale": scale}
                if quantize == "tensor":  # static activations: an input scale per module
                    tensors[name.removesuffix("weight") + "input_scale"] = torch.ones(1) / 448
            else:
                tensors[name] = w
        save_file(tensors, path / "model.safetensors")
        config["quantization_config"] = ct_fp8(quantize,
                                               block=(32, 32) if quantize == "block" else None,
                                               ignore=["lm_head", "re:.*mlp.gate$"])
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from helpers import sparse_qwen3_moe, tiny_cohere2_moe

    root = tmp_path_factory.mktemp("resolve")
    torch.manual_seed(0)
    paths = {"qwen3 bf16": save_tiny(sparse_qwen3_moe(), root / "bf16", "bfloat16"),
             "qwen3 fp32": save_tiny(sparse_qwen3_moe(), root / "fp32", "float32"),
             "cohere2 bf16": save_tiny(tiny_cohere2_moe(), root / "cohere2", "bfloat16")}
    for strategy in ("block", "channel", "tensor"):
        paths[f"qwen3 fp8 {strategy}"] = save_tiny(sparse_qwen3_moe(), root / strategy, "bfloat16",
                                                   strategy)
    return paths


def printed_backend(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(["resolve", *map(str, argv)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert re.search(r"^layers: +\d+ MoE layers, resolved as load_model builds them", out,
                     re.M), out
    return re.search(r"^backend: +(\S+)$", out, re.M)[1]


def loaded_layer(path, **kwargs) -> FusedMoE:
    from moe_triton.models import load_model

    return next(m for m in load_model(path, **kwargs).modules() if isinstance(m, FusedMoE))


@pytest.mark.parametrize("platform", [None, "cpu", "sm90", "sm100"],
                         ids=["here", "cpu", "sm90", "sm100"])
@pytest.mark.parametrize("name", ["qwen3 bf16", "qwen3 fp32", "cohere2 bf16", "qwen3 fp8 block",
                                  "qwen3 fp8 channel", "qwen3 fp8 tensor"])
def test_cli_resolve_prints_the_backend_load_model_runs(checkpoints, name, platform, capsys,
                                                        monkeypatch):
    """Here (a CPU, the interpreter on) and on a plain CPU load_model runs: resolve prints its
    layers' backend. Elsewhere resolve prints what the resolver answers for the traits of the layer
    load_model built here (its dtype, weight format, activation, routing), on that platform."""
    path = checkpoints[name]
    printed = printed_backend(capsys, path, *(["--platform", platform] if platform else []))
    if platform in (None, "cpu"):
        if platform == "cpu":  # a CPU process without TRITON_INTERPRET: what --platform cpu names
            monkeypatch.setattr(platforms, "detect_platform",
                                lambda device=None: platforms.named_platform("cpu"))
        assert printed == loaded_layer(path).backend
        return
    layer = loaded_layer(path)
    traits = LayerTraits(layer.gate_up_proj.shape[-1], layer.gate_weight.dtype, layer.activation,
                         layer.routing, layer.weight_format)
    context = ModelContext.from_config(json.loads((path / "config.json").read_text()), path)
    assert printed == resolve("auto", platforms.named_platform(platform), context, traits).backend


def test_cli_resolve_takes_load_model_s_dtype_and_backend(checkpoints, capsys):
    """FP8 experts on the CPU's Triton kernels in float16 (the demo's --quant fp8); bf16 on them is
    refused, by load_model and by resolve, in one line."""
    fp8, bf16 = checkpoints["qwen3 fp8 block"], checkpoints["qwen3 bf16"]
    assert printed_backend(capsys, fp8, "--dtype", "float16", "--backend", "triton") == "triton"
    assert loaded_layer(fp8, dtype=torch.float16, backend="triton").backend == "triton"
    assert (printed_backend(capsys, fp8, "--dtype", "float16") == "torch"
            == loaded_layer(fp8, dtype=torch.float16).backend)
    with pytest.raises(ValueError, match="bfloat16 tl.dot computes wrong results") as refused:
        loaded_layer(bf16, backend="triton")
    assert main(["resolve", str(bf16), "--backend", "triton"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(refused.value) in err[0]


def test_cli_resolve_says_when_it_cannot_build_the_layers(tmp_path, capsys):
    model = write_config(tmp_path, COHERE2[0], QUANT_CONFIGS["ct-nvfp4-experts-regex"][0])
    assert main(["resolve", str(model), "--platform", "sm100"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^layers: +not built \(.*\): resolved without the layers' dtype and weight "
                     r"format$", out, re.M)


# ---- on the H200 (run there with pytest -m gpu) ------------------------------------------------

@pytest.mark.gpu
def test_on_this_gpu_auto_never_picks_trtllm_and_explicit_requests_fail_at_construction():
    platform = platforms.detect_platform("cuda")
    if platform.sm in (100, 103):
        pytest.skip("a Blackwell part: trtllm-gen is expected to resolve here")
    for architecture in (*COHERE2, MINIMAX, "Qwen3MoeForCausalLM"):
        for quant, _ in QUANT_CONFIGS.values():
            layer = FusedMoE(8, 2, 128, 96,
                             placement=Placement(context=ModelContext(architecture, quant)),
                             dtype=torch.bfloat16, device="cuda")
            assert layer.backend is TRITON, layer.resolution
    for backend in ("flashinfer_trtllm", "flashinfer_trtllm_routed"):
        with pytest.raises(ValueError, match=f"backend='{backend}' cannot run on SM{platform.sm}"):
            FusedMoE(8, 2, 128, 96, placement=Placement(backend), dtype=torch.bfloat16,
                     device="cuda")
    if platform.flashinfer is None:
        with pytest.raises(ValueError, match="FlashInfer is not installed"):
            FusedMoE(8, 2, 128, 96, placement=Placement("flashinfer_cutlass"), dtype=torch.bfloat16,
                     device="cuda")


def test_cli_resolve_shows_the_format_of_every_config_group(tmp_path, capsys):
    from helpers import CT_SCHEMES, MINIMAX_M2_FP8, NVFP4_WEIGHTS, compressed

    model = write_config(tmp_path, MINIMAX, MINIMAX_M2_FP8)
    assert main(["resolve", str(model), "--platform", "sm90"]) == 0
    out = capsys.readouterr().out
    assert ("  quantization_config: fp8 e4m3, 128x128 block scales, dynamic per-token-group "
            "activations") in out
    assert ("experts held:  fp8 e4m3, 128x128 block scales, dynamic per-token-group activations "
            "(load_model)") in out
    mixed = compressed({"attn": {"targets": ["re:.*self_attn.*"], "weights": NVFP4_WEIGHTS,
                                 "format": "nvfp4-pack-quantized"},
                        "experts": {"targets": ["re:.*mlp.experts.*"],
                                    "weights": CT_SCHEMES["channel"][0],
                                    "input_activations": CT_SCHEMES["channel"][1]}})
    model = write_config(tmp_path, COHERE2[0], mixed)
    assert main(["resolve", str(model), "--platform", "sm100"]) == 0
    out = capsys.readouterr().out
    assert "  config_groups.attn: not run here:" in out and "expected FP8 weights" in out
    assert ("  config_groups.experts: targets ['re:.*mlp.experts.*']: fp8 e4m3, per-channel "
            "scales") in out
    assert ("experts held:  fp8 e4m3, per-channel scales, dynamic per-token activations "
            "(load_model)") in out
    model = write_config(tmp_path, COHERE2[0], {"quant_method": "awq", "bits": 4})
    assert main(["resolve", str(model), "--platform", "sm90"]) == 0
    assert ("experts held:  not loadable: quantization_config.quant_method='awq'"
            in capsys.readouterr().out)
