"""config.py: the tile configs' own checks, and what choose_config picks (layout, shared-memory
fit)."""
import pytest
import torch

import moe_triton.config as configs
from moe_triton.config import DecodeConfig, GemmConfig, MoEConfig, choose_config, decode_config
from moe_triton.expand import LayoutKind
from moe_triton.tools.bench import DEEPSEEK_V3, E64_K4, MIXTRAL_8X7B, QWEN3_30B_A3B, LayerShape


def test_split_first_gemm_is_rejected():
    with pytest.raises(ValueError, match="up.split_c"):
        MoEConfig(GemmConfig(16, 32, 16, split_c=2), GemmConfig(16, 32, 16))


def test_split_c_must_be_positive():
    with pytest.raises(ValueError, match="split_c"):
        GemmConfig(16, 32, 32, split_c=0)


def test_config_skips_the_sort_only_when_pairs_rarely_share_an_expert(monkeypatch):
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, 232448))
    cpu = torch.device("cpu")
    # one token: K distinct experts
    assert choose_config(1, 8, 128, 64, 64, cpu).layout is LayoutKind.PER_PAIR
    assert choose_config(2, 2, 16, 64, 64, cpu).layout is LayoutKind.PER_PAIR  # P^2 = 16 <= E
    # more: each GEMM program finds its expert's pairs while they fit 16-row tiles' registers
    assert choose_config(8, 8, 128, 64, 64, cpu).layout is LayoutKind.BY_EXPERT
    assert choose_config(64, 8, 128, 64, 64, cpu).layout is LayoutKind.BY_EXPERT  # 512 pairs
    assert choose_config(65, 8, 128, 64, 64, cpu).layout is LayoutKind.SORTED
    gpu = torch.device("cuda")  # 64 rows an expert: 64-row tiles, whose match would not fit
    assert choose_config(64, 8, 8, 64, 64, gpu).layout is LayoutKind.SORTED


def test_the_decode_kernel_refuses_a_layout_it_cannot_walk():
    tile = GemmConfig(16, 32, 32)
    with pytest.raises(ValueError, match="the decode kernel walks a PER_PAIR or SORTED layout"):
        MoEConfig(tile, tile, LayoutKind.BY_EXPERT, DecodeConfig(16, 16, 16, 16, 16))


@pytest.mark.parametrize("splits", [None, 1, 3, 8], ids=str)
def test_decode_configs_fit_shared_memory(monkeypatch, splits):
    """Every decode config leaves num_stages copies of its tiles within an H200's shared memory."""
    limit = 232448  # H200: shared_memory_per_block_optin
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, limit))
    for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4):
        for T in (1, 4, 16, 64, 256, 512, 1024):
            c = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                              shape.intermediate_size,
                              torch.device("cuda"), down_split=splits)
            # a + gate + up tiles, bf16
            up_stage = c.up.block_c * (c.up.block_m + 2 * c.up.block_n) * 2
            down_stage = c.down.block_c * (c.down.block_m + c.down.block_n) * 2
            assert (c.up.num_stages * up_stage <= limit
                    and c.down.num_stages * down_stage <= limit), c.describe()


@pytest.mark.parametrize("shape", [QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("T", [16, 64, 256, 512, 1024])
def test_the_row_tile_holds_the_busiest_expert(monkeypatch, shape, T):
    """Under uniform routing the sorted layout's row tile holds the busiest expert's rows in nearly
    every routing: a shorter tile gives that expert a second row block
    (docs/sweep-block-m-*.txt)."""
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, 232448))
    E, K = shape.num_experts, shape.top_k
    c = choose_config(T, K, E, shape.hidden_size, shape.intermediate_size, torch.device("cuda"))
    if c.layout is LayoutKind.PER_PAIR or c.block_m == 128:  # one pair a tile; compute tiles
        return
    g = torch.Generator().manual_seed(T)
    busiest = [int(torch.bincount(torch.rand(T, E, generator=g).topk(K).indices.flatten(),
                                  minlength=E).max())
               for _ in range(20)]
    assert sum(rows <= c.block_m for rows in busiest) >= 18, (c.block_m, busiest)


@pytest.mark.parametrize("group", [128, 64, 32])
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_fp8_steps_stay_inside_the_weight_blocks(monkeypatch, T, group):
    """A checkpoint with blocks of 32 to 128 columns gets C steps that fit them (both GEMMs): each
    step reads one weight-block scale and scales one FP8 product."""
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, 232448))
    c = choose_config(T, 8, 128, 2048, 768, torch.device("cuda"), torch.float8_e4m3fn,
                      fp8_group=group)
    assert (group % c.up.block_c == 0 and group % c.down.block_c == 0
            and c.up.block_n % c.down.block_c == 0)
    assert c.up.block_c == min(group, 128)  # no narrower than the group needs


TINY = LayerShape("the demo's model", 8, 2, 64, 48)


@pytest.mark.parametrize("limits", [(132, 232448), (84, 101376)], ids=["H200", "SM89-smem"])
@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_fp8_configs_step_at_least_32_columns_on_a_gpu(monkeypatch, group, limits):
    """Every FP8 config choose_config gives a GPU passes tl.dot's SM90 minimum (an 8-bit contraction
    of 32, M and N of 16) in both GEMMs, for blocks of 16 to 128 columns (the demo's are 16 x 16:
    issue 25 item 11), at every token count and split."""
    monkeypatch.setattr(configs, "device_limits", lambda device: limits)
    for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4, TINY):
        E, K, H, I = shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size
        for T in (1, 2, 4, 16, 64, 256, 1024, 4096, 16384):
            for split in (None, 1, 2):
                c = choose_config(T, K, E, H, I, torch.device("cuda"), torch.float8_e4m3fn,
                                  down_split=split, fp8_group=group)
                assert group >= 32 or c.block_m == 16, c.describe()  # float32 tiles: small ones
                for gemm in (c.up, c.down):
                    assert gemm.block_c >= 32, c.describe()
                    assert min(gemm.block_m, gemm.block_n) >= 16, c.describe()


# ---- the decode kernel's configs ----------------------------------------------------------------

def test_the_decode_kernel_is_opt_in(monkeypatch):
    """choose_config never takes the decode kernel (measured slower than the two GEMMs);
    decode_config adds it to choose_config's tiles, a program per SM, FP8's steps one block."""
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, 232448))
    cuda = torch.device("cuda")
    for T in (1, 4, 16, 64):
        assert choose_config(T, 8, 128, 2048, 768, cuda).decode is None
    one_token = decode_config(1, 8, 128, 2048, 768, cuda)
    assert one_token.decode.block_m == one_token.block_m and one_token.decode.programs == 132
    assert one_token.up == choose_config(1, 8, 128, 2048, 768, cuda).up
    fp8 = decode_config(1, 8, 256, 7168, 2048, cuda, torch.float8_e4m3fn).decode
    assert 128 % fp8.block_c == 128 % fp8.block_i == 0  # steps within one (128, 128) block
    with pytest.raises(ValueError, match="block_m=16"):
        MoEConfig(GemmConfig(16, 32, 32), GemmConfig(16, 32, 32), decode=DecodeConfig(32))


def test_the_second_gemm_is_a_dependent_launch_only_where_up_fills_two_waves(monkeypatch):
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, 232448))
    cuda = torch.device("cuda")
    assert choose_config(1, 8, 128, 2048, 768, cuda).down.chained  # up: 96 tiles
    assert not choose_config(1, 2, 8, 4096, 14336, cuda).down.chained  # 448: three waves
    assert not choose_config(4096, 8, 128, 2048, 768, cuda).down.chained
    assert not choose_config(1, 8, 128, 2048, 768, torch.device("cpu")).down.chained


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_decode_kernel_configs_fit_shared_memory(monkeypatch, dtype):
    limit = 232448
    monkeypatch.setattr(configs, "device_limits", lambda device: (132, limit))
    for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4):
        for T in (1, 2, 4, 16, 64):
            d = decode_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                              shape.intermediate_size, torch.device("cuda"), dtype).decode
            # the larger phase's weight tiles and the activations' tile (the phases' alias):
            # x's holds every token, 16 rows at the least
            stage = max(2 * d.block_n * d.block_c + max(16, T) * d.block_c,
                        d.block_h * d.block_i + d.block_m * d.block_i)
            assert d.num_stages * stage * dtype.itemsize <= limit, d
