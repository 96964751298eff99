"""quant_config.py: the experts' format from quantization configs in the shapes real checkpoints
write (the table, QUANT_CONFIGS, is in helpers.py: test_resolver.py runs its rules over it too), and
the exact FP8 format the loader holds them in (`checkpoint_format`), from the published configs."""
import json

import pytest
from helpers import (
    CT_FP8_WEIGHTS,
    CT_SCHEMES,
    DEEPSEEK_FP8,
    GPT_OSS_MXFP4,
    MINIMAX_M2_FP8,
    MODELOPT_FP8,
    MODELOPT_FP8_FILE,
    NVFP4_WEIGHTS,
    QUANT_CONFIGS,
    compressed,
    ct_fp8,
)

from moe_triton import WeightFormat
from moe_triton.quant_config import (
    QuantFormat,
    checkpoint_format,
    config_group_formats,
    experts_quantization,
)
from moe_triton.weights import NATIVE


@pytest.mark.parametrize("name", list(QUANT_CONFIGS))
def test_experts_format(name):
    config, expected = QUANT_CONFIGS[name]
    quant = experts_quantization(config)
    assert quant.format is expected, str(quant)


def test_the_deciding_group_is_named():
    quant = experts_quantization(QUANT_CONFIGS["ct-mixed-nvfp4-attention-fp8-experts"][0])
    assert "['experts']" in str(quant) and "attn" not in str(quant)
    assert quant.method == "compressed-tensors"
    assert experts_quantization(QUANT_CONFIGS["modelopt-nvfp4"][0]).method == "modelopt"


# ---- checkpoint_format: the experts' exact WeightFormat, for the loader --------------------------

@pytest.mark.parametrize("config,expected,scale", [
    (None, NATIVE, "weight_scale"),
    (DEEPSEEK_FP8, WeightFormat.fp8_block(128, 128), "weight_scale_inv"),
    (MINIMAX_M2_FP8, WeightFormat.fp8_block(128, 128), "weight_scale_inv"),
    ({**DEEPSEEK_FP8, "weight_block_size": [64, 32]}, WeightFormat.fp8_block(64, 32),
     "weight_scale_inv"),
    (ct_fp8("tensor"), WeightFormat.fp8_tensor(static_input=True), "weight_scale"),
    (ct_fp8("channel"), WeightFormat.fp8_channel(), "weight_scale"),
    (ct_fp8("block"), WeightFormat.fp8_block(128, 128), "weight_scale"),
    (ct_fp8("block", block=(32, 64), targets=["re:.*mlp.experts.*"]),
     WeightFormat.fp8_block(32, 64), "weight_scale"),
    # FP8 attention, unquantized experts
    (ct_fp8("channel", targets=["re:.*self_attn.*"]), NATIVE, "weight_scale"),
    (MODELOPT_FP8, WeightFormat.fp8_tensor(static_input=True), "weight_scale"),
    ({"quant_method": "modelopt", **MODELOPT_FP8_FILE}, WeightFormat.fp8_tensor(static_input=True),
     "weight_scale"),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
     WeightFormat.fp8_channel(), "weight_scale"),
], ids=lambda v: None if isinstance(v, (dict, type(None))) else str(v))
def test_checkpoint_format_reads_the_experts_format(config, expected, scale):
    fmt = checkpoint_format(config)
    assert fmt.experts == expected and fmt.weight_scale == scale
    assert experts_quantization(config).format is (QuantFormat.FP8 if expected.fp8
                                                   else QuantFormat.NONE)


def test_gpt_oss_config_reads_as_mxfp4_experts():
    assert checkpoint_format(GPT_OSS_MXFP4).experts == WeightFormat.mxfp4()
    assert experts_quantization(GPT_OSS_MXFP4).format is QuantFormat.MXFP4
    kept = {**GPT_OSS_MXFP4, "modules_to_not_convert": ["model.layers.*.mlp.experts"]}
    assert checkpoint_format(kept).experts == NATIVE
    assert experts_quantization(kept).format is QuantFormat.NONE


def test_modules_to_not_convert_can_keep_the_experts_unquantized():
    # transformers' matching: a suffix, or a regex from the start up to a module boundary
    for patterns in (["experts.0.w1", "experts.0.gate_proj"],
                     [r"model\.layers\.\d+\.mlp\.experts"]):
        config = {**MINIMAX_M2_FP8, "modules_to_not_convert": patterns}
        assert checkpoint_format(config).experts == NATIVE
        assert experts_quantization(config).format is QuantFormat.NONE
    assert checkpoint_format({**MINIMAX_M2_FP8,
                              "modules_to_not_convert": ["gate_proj_x", "mlp.gate"]}).experts.fp8


@pytest.mark.parametrize("config,match", [
    ("fp8", "quantization_config must be a mapping"),
    ({"quant_method": "awq", "bits": 4}, r"quant_method='awq': expected 'fp8'"),
    ({"quant_method": "fp8"}, "weight_block_size is missing"),
    ({**DEEPSEEK_FP8, "weight_block_size": [128]},
     r"weight_block_size=\[128\]: expected \[block_n, block_k\]"),
    ({**DEEPSEEK_FP8, "weight_block_size": [128, 100]}, "block_k a power of two"),
    ({**DEEPSEEK_FP8, "activation_scheme": "static"},
     "activation_scheme='static': expected 'dynamic'"),
    ({**DEEPSEEK_FP8, "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({**DEEPSEEK_FP8, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**DEEPSEEK_FP8, "modules_to_not_convert": ["re:("]},
     "modules_to_not_convert holds an invalid regex"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo='NVFP4': expected 'FP8'"),
    ({"quant_method": "modelopt"}, "quant_algo=None"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["*experts*"]},
     "excludes expert modules"),
    (ct_fp8("channel") | {"config_groups": {"g": {"targets": ["Linear"],
                                                  "weights": NVFP4_WEIGHTS}}},
     r"config_groups.g.weights=.*expected FP8 weights"),
    (compressed({"g": {"targets": ["Linear"],
                       "weights": {**CT_FP8_WEIGHTS, "strategy": "group", "group_size": 128},
                       "input_activations": CT_SCHEMES["channel"][1]}}),
     "config_groups.g.weights.strategy='group': expected 'tensor', 'channel' or 'block'"),
    (compressed({"g": {"targets": ["Linear"], "weights": CT_SCHEMES["channel"][0]}}),
     "config_groups.g.input_activations is missing: .*weight-only FP8 is not run"),
    (compressed({"g": {"targets": ["Linear"], "weights": CT_SCHEMES["channel"][0],
                       "input_activations": CT_SCHEMES["tensor"][1]}}),
     "static activation scales with strategy 'channel'"),
    (compressed({"g": {"targets": ["Linear"], "weights": {**CT_FP8_WEIGHTS, "strategy": "block"},
                       "input_activations": CT_SCHEMES["block"][1]}}),
     "block_structure=None: expected"),
    (compressed({"a": {"targets": ["re:.*experts.*"],
                       **dict(zip(("weights", "input_activations"), CT_SCHEMES["channel"],
                                  strict=True))},
                 "b": {"targets": ["re:.*down_proj"],
                       **dict(zip(("weights", "input_activations"), CT_SCHEMES["block"],
                                  strict=True))}}),
     r"config_groups \['a', 'b'\] give the experts different formats"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_checkpoint_format_names_the_key_it_cannot_run(config, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_format(config)


def test_config_group_formats_lists_every_group():
    config = compressed({"attn": {"targets": ["re:.*self_attn.*"], "weights": NVFP4_WEIGHTS},
                         "experts": {"targets": ["re:.*mlp.experts.*"],
                                     "weights": CT_SCHEMES["block"][0],
                                     "input_activations": CT_SCHEMES["block"][1]}})
    groups = dict(config_group_formats(config))
    assert ("not run here" in groups["config_groups.attn"]
            and "FP8 weights" in groups["config_groups.attn"])
    assert groups["config_groups.experts"].endswith(str(WeightFormat.fp8_block(128, 128)))
    assert config_group_formats(MINIMAX_M2_FP8) == [("quantization_config",
                                                     str(WeightFormat.fp8_block(128, 128)))]
    assert (config_group_formats(None) == []
            and "not run here" in config_group_formats({"quant_method": "awq"})[0][1])


def test_model_context_reads_a_modelopt_hf_quant_config_file(tmp_path):
    from moe_triton.runners import ModelContext

    (tmp_path / "hf_quant_config.json").write_text(json.dumps(MODELOPT_FP8_FILE))
    context = ModelContext.from_config({"architectures": ["X"]}, tmp_path)
    assert (checkpoint_format(context.quant_config).experts
            == WeightFormat.fp8_tensor(static_input=True))
    assert experts_quantization(context.quant_config).format is QuantFormat.FP8
    (tmp_path / "hf_quant_config.json").write_text("{not json")  # fails closed, as before
    assert (experts_quantization(ModelContext.from_config({}, tmp_path).quant_config).format
            is QuantFormat.UNREADABLE)
