"""backends/quantization.py: the experts' format from quantization configs in the shapes real checkpoints write."""
import pytest

from moe_triton.backends.quantization import QuantFormat, experts_quantization

NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel"}


def compressed(groups: dict, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "config_groups": groups, **extra}


def group(targets, fmt=None, weights=None) -> dict:
    return {"targets": targets, "weights": weights, **({"format": fmt} if fmt else {})}


# Shared with test_resolver.py: name -> (quantization_config, the experts' format)
CONFIGS = {
    "none": (None, QuantFormat.NONE),
    "ct-nvfp4-linear": (compressed({"group_0": group(["Linear"], weights=NVFP4_WEIGHTS)}, format="nvfp4-pack-quantized",
                                   ignore=["lm_head"]), QuantFormat.NVFP4),
    "ct-nvfp4-experts-regex": (compressed({"group_0": group(["re:.*experts.*"], "nvfp4-pack-quantized", NVFP4_WEIGHTS)}),
                               QuantFormat.NVFP4),
    "ct-fp8-linear": (compressed({"group_0": group(["Linear"], "float-quantized", FP8_WEIGHTS)}), QuantFormat.FP8),
    "ct-nvfp4-attention-only": (compressed({"attn": group(["re:.*self_attn.*"], "nvfp4-pack-quantized", NVFP4_WEIGHTS)}),
                                QuantFormat.NONE),
    # the field's bug: NVFP4 attention + FP8 experts looked like "NVFP4 somewhere"
    "ct-mixed-nvfp4-attention-fp8-experts": (compressed({
        "attn": group(["re:.*self_attn.*"], "nvfp4-pack-quantized", NVFP4_WEIGHTS),
        "experts": group(["re:.*mlp.experts.*"], "float-quantized", FP8_WEIGHTS)}, format="mixed-precision"),
        QuantFormat.FP8),
    "ct-mixed-nvfp4-experts-fp8-rest": (compressed({
        "rest": group(["Linear"], "float-quantized", FP8_WEIGHTS),
        "experts": group(["re:.*experts.*"], "nvfp4-pack-quantized", NVFP4_WEIGHTS)}), QuantFormat.NVFP4),
    "ct-experts-ignored": (compressed({"g": group(["Linear"], "nvfp4-pack-quantized", NVFP4_WEIGHTS)},
                                      ignore=["re:.*experts.*"]), QuantFormat.NONE),
    "ct-groups-disagree": (compressed({"a": group(["re:.*experts.*"], "nvfp4-pack-quantized", NVFP4_WEIGHTS),
                                       "b": group(["re:.*down_proj"], "float-quantized", FP8_WEIGHTS)}),
                           QuantFormat.UNREADABLE),
    "ct-nvfp4-by-weights-only": (compressed({"g": group(["Linear"], weights=NVFP4_WEIGHTS)}), QuantFormat.NVFP4),
    "ct-int4": (compressed({"g": group(["Linear"], "pack-quantized", {"num_bits": 4, "type": "int"})}),
                QuantFormat.OTHER),
    "ct-no-groups": ({"quant_method": "compressed-tensors"}, QuantFormat.UNREADABLE),
    "modelopt-nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, QuantFormat.NVFP4),
    "modelopt-nvfp4-nested": ({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}, QuantFormat.NVFP4),
    "modelopt-fp8": ({"quant_method": "modelopt", "quant_algo": "FP8"}, QuantFormat.FP8),
    "modelopt-mixed": ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, QuantFormat.UNREADABLE),
    "unreadable-separate-file": ({"quant_method": "modelopt"}, QuantFormat.UNREADABLE),
    "unreadable-file-name": ("hf_quant_config.json", QuantFormat.UNREADABLE),
    "unreadable-no-method": ({"bits": 4}, QuantFormat.UNREADABLE),
    "hf-fp8": ({"quant_method": "fp8", "weight_block_size": [128, 128]}, QuantFormat.FP8),
    "awq": ({"quant_method": "awq", "bits": 4}, QuantFormat.OTHER),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_experts_format(name):
    config, expected = CONFIGS[name]
    quant = experts_quantization(config)
    assert quant.format is expected, str(quant)


def test_the_deciding_group_is_named():
    quant = experts_quantization(CONFIGS["ct-mixed-nvfp4-attention-fp8-experts"][0])
    assert "['experts']" in str(quant) and "attn" not in str(quant)
    assert quant.method == "compressed-tensors"
    assert experts_quantization(CONFIGS["modelopt-nvfp4"][0]).method == "modelopt"
