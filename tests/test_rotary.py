"""models/rotary.py against its reference (transformers' rotation, in the input dtype) on CPU under
the interpreter and on the GPU: rotate-half and interleaved, full and partial, strided q views."""
import pytest
import torch
from helpers import assert_close

from moe_triton.models.rotary import apply_rotary, apply_rotary_torch

CASES = [  # B, heads, L, D, D_rot, interleaved
    (2, 4, 3, 16, 16, False),
    (1, 3, 5, 24, 12, False),  # partial rotary (MiniMax-M2)
    (2, 2, 4, 16, 16, True),  # Cohere's pairs
    (3, 1, 1, 32, 8, True),
    (0, 2, 1, 16, 16, False),
]


def make(B, heads, L, D, D_rot, dtype, device="cpu"):
    g = torch.Generator().manual_seed(B * 100 + D)
    x = torch.randn(B, L, heads, D, generator=g).transpose(1, 2)  # [B, heads, L, D], as the models view q
    angles = torch.rand(B, L, D_rot // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [B, L, D_rot]
    return [t.to(device, dtype) for t in (x, cos, sin)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B,heads,L,D,D_rot,interleaved", CASES)
def test_apply_rotary(B, heads, L, D, D_rot, interleaved, dtype):
    x, cos, sin = make(B, heads, L, D, D_rot, dtype)
    out = apply_rotary(x, cos, sin, interleaved)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, apply_rotary_torch(x.float(), cos.float(), sin.float(), interleaved), dtype)


def test_bf16_on_the_interpreter_takes_the_reference():
    """The interpreter's casts to bf16 truncate (moe_triton/platform.py): bf16 there runs the torch form."""
    x, cos, sin = make(4, 8, 3, 64, 64, torch.bfloat16)
    assert torch.equal(apply_rotary(x, cos, sin), apply_rotary_torch(x, cos, sin))


def test_bad_tables_are_refused():
    x, cos, sin = make(2, 2, 3, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="cos / sin must be"):
        apply_rotary(x, cos[:, :2], sin[:, :2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B,heads,L,D,D_rot,interleaved", CASES + [(8, 32, 1, 128, 128, False),
                                                                  (1, 4, 4096, 128, 64, False)])
def test_apply_rotary_on_the_gpu(B, heads, L, D, D_rot, interleaved, dtype):
    x, cos, sin = make(B, heads, L, D, D_rot, dtype, "cuda")
    out = apply_rotary(x, cos, sin, interleaved)
    assert_close(out, apply_rotary_torch(x.float(), cos.float(), sin.float(), interleaved), dtype)
