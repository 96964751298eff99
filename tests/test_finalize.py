"""finalize: weighted un-permute against the torch reference; fresh output, filtered pairs
skipped."""
import pytest
import torch
from helpers import assert_close, random_ids

from moe_triton.expand import expand
from moe_triton.finalize import finalize, finalize_torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,E,K,H",
                         [(0, 4, 2, 8), (1, 1, 1, 5), (3, 4, 4, 961), (17, 8, 2, 300),
                          (64, 8, 8, 33)])
def test_finalize(T, E, K, H, dtype, poisoned_empty):
    torch.manual_seed(T + H)
    layout = expand(random_ids(T, K, E, seed=T, filtered=0.25).int(), E, 16)
    y = torch.randn(layout.max_rows, H).to(dtype)  # padding rows hold values finalize must not read
    weights = torch.rand(T, K)
    out = finalize(y, weights, layout)
    assert out.shape == (T, H) and (T == 0 or out.data_ptr() != y.data_ptr())
    assert_close(out, finalize_torch(y, weights, layout.pair_to_row, K), dtype)


def test_finalize_ignores_nan_in_padding_and_filtered_weights():
    ids = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32)
    layout = expand(ids, 3, 16)
    y = torch.full((layout.max_rows, 4), float("nan"))
    real = layout.pair_to_row[layout.pair_to_row >= 0].long()
    y[real] = torch.randn(real.numel(), 4)
    weights = torch.tensor([[0.5, float("nan")], [0.25, 0.75]])  # the filtered slot's weight is NaN
    out = finalize(y, weights, layout)
    assert not out.isnan().any()
    assert_close(out, finalize_torch(y.nan_to_num(), weights.nan_to_num(), layout.pair_to_row, 2),
                 torch.float32)
