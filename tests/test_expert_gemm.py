"""expert GEMM: every row in use against a float32 einsum over the same (token, expert) rows."""
import gc
import importlib
import weakref

import pytest
import torch
from helpers import assert_close, random_ids

from moe_triton.activation import Activation, ActivationKind, activation_torch
from moe_triton.config import GemmConfig
from moe_triton.expand import expand
from moe_triton.expert_gemm import expert_gemm, expert_gemm_torch

expert_gemm_module = importlib.import_module("moe_triton.expert_gemm")  # `moe_triton.expert_gemm` is the function


def rows_in_use(layout):
    rows = int(layout.num_rows.item())
    pairs = layout.sorted_pair_ids[:rows].long()
    real = pairs < layout.num_pairs
    row_ids = torch.arange(rows)[real]
    experts = layout.block_expert.long().repeat_interleave(layout.block_m)[:rows][real]
    return row_ids, pairs[real] // layout.top_k, experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", [None, Activation(ActivationKind.SILU_AND_MUL), Activation(ActivationKind.RELU2)],
                         ids=lambda a: a.kind.name if a else "plain")
@pytest.mark.parametrize("T,E,K,N,K_in", [(1, 1, 1, 16, 16), (3, 4, 2, 66, 40), (17, 8, 8, 50, 961), (64, 8, 2, 961, 72)])
def test_expert_gemm_gather(T, E, K, N, K_in, activation, dtype, poisoned_empty):
    torch.manual_seed(T + N)
    x = torch.randn(T, K_in).to(dtype)
    gated = activation is not None and activation.gated
    w = (torch.randn(E, 2 * N if gated else N, K_in) / K_in**0.5).to(dtype)
    layout = expand(random_ids(T, K, E, seed=T).int(), E, 16)
    out = expert_gemm(x, w, layout, GemmConfig(16, 32, 32, group_m=2), gather=True, activation=activation)
    row_ids, tokens, experts = rows_in_use(layout)
    expected = expert_gemm_torch(x, w, tokens, experts)
    if activation is not None:
        expected = activation_torch(expected, activation)
    assert_close(out[row_ids], expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_expert_gemm_row_space_and_transposed_weights(dtype, poisoned_empty):
    torch.manual_seed(0)
    T, E, K, N, K_in = 17, 4, 2, 40, 33
    layout = expand(random_ids(T, K, E, seed=5).int(), E, 16)
    a = torch.randn(layout.max_rows, K_in).to(dtype)
    w_t = (torch.randn(E, K_in, N) / K_in**0.5).to(dtype)  # stored transposed, used as a (E, N, K_in) view
    out = expert_gemm(a, w_t.transpose(1, 2), layout, GemmConfig(16, 32, 16), gather=False)
    row_ids, _, experts = rows_in_use(layout)
    assert_close(out[row_ids], expert_gemm_torch(a, w_t.transpose(1, 2), row_ids, experts), dtype)


def test_expert_gemm_rejects_mismatched_block_m():
    layout = expand(random_ids(3, 1, 2, 0).int(), 2, 32)
    with pytest.raises(ValueError, match="block_m"):
        expert_gemm(torch.randn(3, 16), torch.randn(2, 16, 16), layout, GemmConfig(16, 32, 32), gather=True)


@pytest.mark.parametrize("activation", [None, Activation(ActivationKind.SILU_AND_MUL)],
                         ids=lambda a: a.kind.name if a else "plain")
@pytest.mark.parametrize("N,K_in", [(40, 32), (33, 64)])  # N not a multiple of block_n: tiles spill into the next expert
def test_expert_gemm_tma_weights(N, K_in, activation, poisoned_empty):
    torch.manual_seed(N)
    T, E, K = 17, 4, 2
    x = torch.randn(T, K_in).half()
    gated = activation is not None
    w = (torch.randn(E, 2 * N if gated else N, K_in) / K_in**0.5).half()
    layout = expand(random_ids(T, K, E, seed=1).int(), E, 16)
    config = GemmConfig(16, 32, 16, tma_weights=True)
    out = expert_gemm(x, w, layout, config, gather=True, activation=activation)
    row_ids, tokens, experts = rows_in_use(layout)
    expected = expert_gemm_torch(x, w, tokens, experts)
    if activation is not None:
        expected = activation_torch(expected, activation)
    assert_close(out[row_ids], expected, torch.float16)


def test_weight_descriptors_live_as_long_as_their_weights():
    """A weight tensor keeps its TMA descriptors (one per tile) while it stays at one address, gets
    new ones when its storage moves, and leaves nothing behind when it dies: the cache holds views
    of the storage, never the tensor."""
    descriptors = expert_gemm_module._DESCRIPTORS
    config = GemmConfig(16, 64, 32, tma_weights=True)
    w = torch.randn(4, 64, 32)
    first = expert_gemm_module._weight_descriptor(w, config)
    assert expert_gemm_module._weight_descriptor(w, config) is first
    assert expert_gemm_module._weight_descriptor(w, GemmConfig(16, 32, 32, tma_weights=True)) is not first
    w.data = torch.randn(4, 64, 32)  # a parameter's storage replaced in place (e.g. module.half())
    moved = expert_gemm_module._weight_descriptor(w, config)
    assert moved is not first and moved.base.data_ptr() == w.data_ptr()
    alive, key = weakref.ref(w), id(w)
    del w, first, moved
    gc.collect()
    assert alive() is None and key not in descriptors
