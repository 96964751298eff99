"""models/rms_norm.py against its reference (transformers' RMSNorm arithmetic) and against
transformers' own module, under the interpreter on CPU and compiled on the GPU."""
import pytest
import torch
from helpers import assert_close

from moe_triton.models.rms_norm import add_rms_norm, rms_norm, rms_norm_torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 32), (5, 48), (2, 3, 4, 12), (0, 16), (37, 2048)], ids=str)
def test_rms_norm(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    weight = (1 + torch.randn(shape[-1], generator=g) / 4).to(dtype)
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rms_norm_torch(x.float(), weight.float(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 32), (5, 48), (2, 3, 4, 12), (0, 16), (37, 2048)], ids=str)
def test_add_rms_norm(shape, dtype):
    """The residual add fused in: the sum as torch's add rounds it, and the norm of that sum."""
    g = torch.Generator().manual_seed(4)
    x, residual = ((torch.randn(*shape, generator=g) * 3).to(dtype) for _ in range(2))
    weight = (1 + torch.randn(shape[-1], generator=g) / 4).to(dtype)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert x.numel() == 0 or summed.data_ptr() not in (x.data_ptr(), residual.data_ptr())  # fresh
    assert normed.shape == x.shape and normed.dtype == dtype
    assert_close(normed, rms_norm_torch((x + residual).float(), weight.float(), 1e-6), dtype)


def test_add_rms_norm_refuses_a_residual_of_another_shape_or_dtype():
    with pytest.raises(ValueError, match="residual must match x"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 7), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual must match x"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).half(), torch.ones(8), 1e-6)


def test_a_strided_view_and_transformers_module():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, 24, generator=g)[:, ::2]  # rows not evenly spaced in memory
    module = Qwen3MoeRMSNorm(24, eps=1e-5)
    module.weight.data = torch.randn(24, generator=g)
    torch.testing.assert_close(rms_norm(x, module.weight, 1e-5), module(x), rtol=1e-6, atol=1e-6)


def test_per_head_rows_out_of_a_fused_projection():
    """A per-head norm over [B, L, heads, D] sliced out of a QKV projection's wider rows."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 3, 4 * 8 + 2 * 2 * 8, generator=g)
    q = qkv[..., :32].view(2, 3, 4, 8)  # rows of 8, 4 per token, tokens 48 apart
    weight = 1 + torch.randn(8, generator=g) / 4
    out = rms_norm(q, weight, 1e-6)
    assert out.is_contiguous()
    torch.testing.assert_close(out, rms_norm_torch(q, weight, 1e-6), rtol=1e-6, atol=1e-6)


def test_bf16_on_the_interpreter_takes_the_reference():
    """The interpreter's casts to bf16 truncate (moe_triton/platform.py): bf16 there runs the torch
    form."""
    g = torch.Generator().manual_seed(2)
    x, weight = (torch.randn(64, 256, generator=g).bfloat16(),
                 (1 + torch.randn(256, generator=g) / 4).bfloat16())
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6))


def test_a_weight_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 2048), (64, 2048), (8, 1, 32, 128), (4096, 4096)], ids=str)
def test_rms_norm_on_the_gpu(shape, dtype):
    x = torch.randn(*shape, device="cuda").to(dtype)
    weight = (1 + torch.randn(shape[-1], device="cuda") / 4).to(dtype)
    out = rms_norm(x, weight, 1e-6)
    assert_close(out, rms_norm_torch(x.float(), weight.float(), 1e-6), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 2048), (64, 2048), (4096, 4096)], ids=str)
def test_add_rms_norm_on_the_gpu_equals_add_then_norm(shape, dtype):
    """Bit for bit what torch's add followed by the unfused kernel gives."""
    x, residual = (torch.randn(*shape, device="cuda").to(dtype) for _ in range(2))
    weight = (1 + torch.randn(shape[-1], device="cuda") / 4).to(dtype)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, rms_norm(x + residual, weight, 1e-6))
