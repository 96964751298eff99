"""config.py: the tile configs' own checks, and what choose_config picks (layout, shared-memory fit)."""
import pytest
import torch

import moe_triton.config as configs
from moe_triton.config import GemmConfig, MoEConfig, choose_config
from moe_triton.expand import LayoutKind
from moe_triton.tools.bench import DEEPSEEK_V3, E64_K4, MIXTRAL_8X7B, QWEN3_30B_A3B


def test_split_first_gemm_is_rejected():
    with pytest.raises(ValueError, match="up.split_c"):
        MoEConfig(GemmConfig(16, 32, 16, split_c=2), GemmConfig(16, 32, 16))


def test_split_c_must_be_positive():
    with pytest.raises(ValueError, match="split_c"):
        GemmConfig(16, 32, 32, split_c=0)


def test_config_skips_the_sort_only_when_pairs_rarely_share_an_expert():
    cpu = torch.device("cpu")
    assert choose_config(1, 8, 128, 64, 64, cpu).layout is LayoutKind.PER_PAIR  # one token: K distinct experts
    assert choose_config(2, 2, 16, 64, 64, cpu).layout is LayoutKind.PER_PAIR  # P^2 = 16 <= E
    assert choose_config(8, 8, 128, 64, 64, cpu).layout is LayoutKind.SORTED


@pytest.mark.parametrize("splits", [None, 1, 3, 8], ids=str)
def test_decode_configs_fit_shared_memory(monkeypatch, splits):
    """Every decode config leaves num_stages copies of its tiles within an H200's shared memory."""
    limit = 232448  # H200: shared_memory_per_block_optin
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, limit))
    for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4):
        for T in (1, 4, 16, 64, 256, 512, 1024):
            c = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size, shape.intermediate_size,
                              torch.device("cuda"), down_split=splits)
            up_stage = c.up.block_c * (c.up.block_m + 2 * c.up.block_n) * 2  # a + gate + up tiles, bf16
            down_stage = c.down.block_c * (c.down.block_m + c.down.block_n) * 2
            assert c.up.num_stages * up_stage <= limit and c.down.num_stages * down_stage <= limit, c.describe()


@pytest.mark.parametrize("shape", [QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4], ids=lambda s: s.name)
@pytest.mark.parametrize("T", [16, 64, 256, 512, 1024])
def test_the_row_tile_holds_the_busiest_expert(monkeypatch, shape, T):
    """Under uniform routing the sorted layout's row tile holds the busiest expert's rows in nearly
    every routing: a shorter tile gives that expert a second row block (docs/sweep-block-m-*.txt)."""
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, 232448))
    E, K = shape.num_experts, shape.top_k
    c = choose_config(T, K, E, shape.hidden_size, shape.intermediate_size, torch.device("cuda"))
    if c.layout is LayoutKind.PER_PAIR or c.block_m == 128:  # one pair a tile; compute tiles
        return
    g = torch.Generator().manual_seed(T)
    busiest = [int(torch.bincount(torch.rand(T, E, generator=g).topk(K).indices.flatten(), minlength=E).max())
               for _ in range(20)]
    assert sum(rows <= c.block_m for rows in busiest) >= 18, (c.block_m, busiest)


@pytest.mark.parametrize("group", [128, 64, 32, 16])
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_fp8_steps_stay_inside_the_weight_blocks(monkeypatch, T, group):
    """A checkpoint with blocks narrower than 128 columns gets C steps that fit them (both GEMMs), as
    run_experts requires: each step reads one weight-block scale."""
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, 232448))
    c = choose_config(T, 8, 128, 2048, 768, torch.device("cuda"), torch.float8_e4m3fn, fp8_group=group)
    assert group % c.up.block_c == 0 and group % c.down.block_c == 0 and c.up.block_n % c.down.block_c == 0
    assert c.up.block_c == min(group, 128)  # no narrower than the group needs
