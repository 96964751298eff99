"""linear.py: the batch-invariant matmul against float32 torch over awkward sizes, each row's bits
independent of the batch, its backward, and its refusals."""
import pytest
import torch
from helpers import assert_close, test_device

from moe_triton.linear import linear, linear_torch

# the interpreter's bf16 tl.dot is wrong (triton 3.9): bf16 runs on the GPU (below)
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,N,C", [(0, 8, 32), (1, 8, 32), (7, 130, 100), (37, 1, 33),
                                   (100, 65, 64)])
def test_linear(T, N, C, dtype):
    g = torch.Generator().manual_seed(T + N + C)
    x = torch.randn(T, C, generator=g).to(test_device(), dtype)
    w = (torch.randn(N, C, generator=g) / C ** 0.5).to(test_device(), dtype)
    out = linear(x, w)
    assert out.shape == (T, N) and out.dtype == dtype
    assert_close(out, linear_torch(x, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_has_the_same_bits_alone_and_in_any_batch(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 96, generator=g).to(test_device(), dtype)
    w = torch.randn(40, 96, generator=g).to(test_device(), dtype)
    full = linear(x, w)
    order = torch.randperm(70, generator=g).to(x.device)
    shuffled = linear(x[order], w)
    for t in (0, 5, 33, 69):
        assert torch.equal(linear(x[t:t + 1], w)[0], full[t])
        assert torch.equal(shuffled[(order == t).nonzero()[0, 0]], full[t])
        assert torch.equal(linear(x[:t + 1], w)[t], full[t])


def test_gradients_flow_as_torch_s():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 48, generator=g, device=test_device(), requires_grad=True)
    w = torch.randn(16, 48, generator=g, device=test_device(), requires_grad=True)
    grad = torch.randn(5, 16, generator=g, device=test_device())
    linear(x, w).backward(grad)
    expected = [t.detach().clone().requires_grad_() for t in (x, w)]
    torch.nn.functional.linear(*expected).backward(grad)
    assert_close(x.grad, expected[0].grad, torch.float32)
    assert_close(w.grad, expected[1].grad, torch.float32)


def test_bad_inputs_are_named(no_launch):
    x, w = torch.zeros(3, 8), torch.zeros(4, 8)
    for args, match in (((x[0], w), "x must be a 2-D"), ((x, w.int()), "w must be a 2-D"),
                        ((x, w.half()), "one dtype"), ((x, torch.zeros(4, 9)), "one dtype"),
                        (("x", w), "x must be")):
        with pytest.raises(ValueError, match=match):
            linear(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_router_sized_matmul_is_batch_invariant_on_the_gpu(dtype):
    """Qwen3-30B-A3B's router (E = 128, H = 2048) compiled for the GPU: within the dtype's
    tolerance of float32 torch, and a row's bits the same alone, in 7 rows and in 4096."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 2048, generator=g).to("cuda", dtype)
    w = (torch.randn(128, 2048, generator=g) / 2048 ** 0.5).to("cuda", dtype)
    full = linear(x, w)
    assert_close(full, linear_torch(x, w), dtype)
    for rows in (1, 7, 4096):
        assert torch.equal(linear(x[:rows], w), full[:rows])
