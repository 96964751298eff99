"""backends/quantization.py: the experts' format from quantization configs in the shapes real checkpoints
write (the table, QUANT_CONFIGS, is in helpers.py: test_resolver.py runs its rules over it too)."""
import pytest
from helpers import QUANT_CONFIGS

from moe_triton.backends.quantization import experts_quantization


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
