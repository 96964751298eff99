"""expand: the Triton layout equals the torch reference exactly (the order is stable)."""
import importlib

import pytest
import torch
from helpers import random_ids

from moe_triton.expand import expand, expand_torch, max_rows

expand_module = importlib.import_module("moe_triton.expand")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("E,K", [(1, 1), (4, 2), (4, 4), (8, 1), (8, 8), (6, 3), (128, 8)])
@pytest.mark.parametrize("T", [0, 1, 3, 17, 64])
@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "three-kernels"])
def test_expand(T, E, K, block_m, seed, one_program, poisoned_empty, monkeypatch):
    monkeypatch.setattr(expand_module, "ONE_PROGRAM_BLOCKS", 10**6 if one_program else 0)
    ids = random_ids(T, K, E, seed, filtered=0.2 if seed else 0.0).int()
    layout = expand(ids, E, block_m)
    expected = expand_torch(ids, E, block_m)
    rows = int(layout.num_rows.item())
    assert layout.max_rows == max_rows(T * K, E, block_m) >= rows
    assert torch.equal(layout.expert_offsets, expected["expert_offsets"])
    assert rows == expected["sorted_pair_ids"].numel()
    assert torch.equal(layout.sorted_pair_ids[:rows], expected["sorted_pair_ids"])
    assert torch.equal(layout.pair_to_row, expected["pair_to_row"])
    blocks = rows // block_m
    assert torch.equal(layout.block_expert[:blocks], expected["block_expert"])
    assert (layout.block_expert[blocks:] == -1).all()


def test_expand_int64_ids_never_wrap_into_range():
    E = 4
    # low 32 bits of 2**32 + 1 are 1
    ids = torch.tensor([[2**32 + 1, 1], [-(2**33), 3]], dtype=torch.int64)
    layout = expand(ids, E, 16)
    assert layout.pair_to_row.tolist()[0] == -1 and layout.pair_to_row.tolist()[2] == -1
    assert torch.equal(layout.pair_to_row, expand_torch(ids, E, 16)["pair_to_row"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk_ids=torch.zeros(3, dtype=torch.int32), num_experts=4, block_m=16), "topk_ids"),
    (dict(topk_ids=torch.zeros(3, 2), num_experts=4, block_m=16), "topk_ids"),
    (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int32), num_experts=0, block_m=16), "num_experts"),
    (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int32), num_experts=4, block_m=24), "block_m"),
])
def test_expand_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        expand(**kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 64])
@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "three-kernels"])
def test_chained_expand_reads_the_routing_after_it_is_written(T, one_program, monkeypatch):
    """On SM90 the kernels launch by PDL behind the routing kernel that writes their ids, and
    behind each other: each call routes fresh logits, then expands them, 30 times in a row with
    no sync between; every layout equals the reference on its own routing."""
    from moe_triton.platform import dependent_launch
    from moe_triton.routing import RoutingSpec, route

    monkeypatch.setattr(expand_module, "ONE_PROGRAM_BLOCKS", 10**6 if one_program else 0)
    E, K = 128, 8
    assert dependent_launch(torch.device("cuda"))
    calls = []
    for i in range(30):
        logits = torch.randn(T, E, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        ids, _ = route(logits, RoutingSpec(K))
        calls.append((ids, expand(ids, E, 16)))
    for ids, layout in calls:
        expected = expand_torch(ids.cpu(), E, 16)  # on the CPU
        rows = int(layout.num_rows.item())
        assert torch.equal(layout.sorted_pair_ids[:rows].cpu(), expected["sorted_pair_ids"])
        assert torch.equal(layout.pair_to_row.cpu(), expected["pair_to_row"])
        assert torch.equal(layout.block_expert[:rows // 16].cpu(), expected["block_expert"])
