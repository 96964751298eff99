"""fused_experts: the whole Triton layer against the float32 torch reference."""
import pytest
import torch

from conftest import assert_close
from moe_triton import Activation, ActivationKind, GemmConfig, LayoutKind, MoEConfig, fused_experts, fused_experts_torch
from test_expand import random_ids


def make_layer(T, E, K, H, I, dtype, seed, activation=Activation(), filtered=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I if activation.gated else I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    ids = random_ids(T, K, E, seed, filtered).int()
    weights = torch.rand(T, K, generator=g)
    return x, w13, w2, ids, weights


def config_for(layout: LayoutKind) -> MoEConfig:
    return MoEConfig(GemmConfig(16, 32, 32, group_m=2), GemmConfig(16, 32, 16), layout)


# fp16 intermediates are rounded once between the GEMMs; the reference keeps float32 throughout.
# PER_PAIR makes one tile per pair: the interpreter runs it at decode-like sizes only.
@pytest.mark.parametrize("T,layout", [(T, LayoutKind.SORTED) for T in (0, 1, 3, 17, 64)]
                         + [(T, LayoutKind.PER_PAIR) for T in (0, 1, 3, 17)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("E,K", [(1, 1), (4, 1), (4, 2), (4, 4), (8, 2), (8, 8)])
def test_fused_experts(T, E, K, seed, dtype, layout, poisoned_empty):
    x, w13, w2, ids, weights = make_layer(T, E, K, H=40, I=33, dtype=dtype, seed=seed, filtered=0.2 * seed)
    out = fused_experts(x, w13, w2, ids, weights, config=config_for(layout))
    assert out.shape == (T, 40) and out.dtype == dtype
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights), dtype, scale=2)


@pytest.mark.parametrize("T,E,K,H,I", [(17, 4, 2, 72, 961), (3, 8, 8, 100, 96)])
def test_fused_experts_awkward_widths(T, E, K, H, I, poisoned_empty):
    x, w13, w2, ids, weights = make_layer(T, E, K, H, I, torch.float16, seed=T)
    assert_close(fused_experts(x, w13, w2, ids, weights), fused_experts_torch(x, w13, w2, ids, weights),
                 torch.float16, scale=2)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-epilogue", "standalone-activation"])
@pytest.mark.parametrize("activation", [
    Activation(ActivationKind.SILU_AND_MUL), Activation(ActivationKind.GELU_AND_MUL),
    Activation(ActivationKind.GELU_TANH_AND_MUL), Activation(ActivationKind.RELU2),
    Activation(ActivationKind.CLAMPED_SWIGLU, swiglu_limit=0.5, swiglu_alpha=1.702),
], ids=lambda a: a.kind.name)
def test_fused_experts_activations(activation, fuse, poisoned_empty):
    x, w13, w2, ids, weights = make_layer(17, 8, 2, 40, 33, torch.float32, seed=3, activation=activation)
    out = fused_experts(x, w13, w2, ids, weights, activation=activation, fuse_activation=fuse)
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights, activation=activation), torch.float32)


# Split-C (split-K) of the second GEMM: float32 partials per C slice, summed by finalize. Slices
# that do not divide the C steps (3 into 5 steps of 16 for I=65) leave a short or empty slice,
# which must still store zeros; filtered ids must stay unread.
@pytest.mark.parametrize("splits", [2, 3, 4, 8], ids=lambda s: f"down{s}")
@pytest.mark.parametrize("layout", list(LayoutKind), ids=lambda k: k.value)
@pytest.mark.parametrize("activation", [
    Activation(ActivationKind.SILU_AND_MUL), Activation(ActivationKind.RELU2),
    Activation(ActivationKind.CLAMPED_SWIGLU, swiglu_limit=0.5, swiglu_alpha=1.702),
], ids=lambda a: a.kind.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_c(splits, layout, activation, dtype, poisoned_empty):
    x, w13, w2, ids, weights = make_layer(5, 8, 2, 40, 65, dtype, seed=7, activation=activation, filtered=0.2)
    config = MoEConfig(GemmConfig(16, 32, 32, group_m=2), GemmConfig(16, 32, 16, split_c=splits), layout)
    out = fused_experts(x, w13, w2, ids, weights, activation=activation, config=config)
    assert out.dtype == dtype
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights, activation=activation), dtype, scale=2)


def test_split_c_is_bit_stable(poisoned_empty):
    x, w13, w2, ids, weights = make_layer(9, 8, 2, 64, 96, torch.float16, seed=8)
    config = MoEConfig(GemmConfig(16, 32, 16), GemmConfig(16, 32, 16, split_c=3))
    assert torch.equal(fused_experts(x, w13, w2, ids, weights, config=config),
                       fused_experts(x, w13, w2, ids, weights, config=config))


def test_split_first_gemm_is_rejected():
    with pytest.raises(ValueError, match="up.split_c"):
        MoEConfig(GemmConfig(16, 32, 16, split_c=2), GemmConfig(16, 32, 16))


def test_split_c_must_be_positive():
    with pytest.raises(ValueError, match="split_c"):
        GemmConfig(16, 32, 32, split_c=0)


@pytest.mark.parametrize("layout", list(LayoutKind), ids=lambda k: k.value)
def test_filtered_ids_contribute_nothing(layout, poisoned_empty):
    x, w13, w2, ids, weights = make_layer(17, 8, 4, 40, 33, torch.float32, seed=4, filtered=0.3)
    ids[0] = -1  # a token whose every slot is filtered gets zeros
    weights[(ids < 0) | (ids >= 8)] = float("nan")  # a filtered slot's weight is never read
    assert (ids == -1).any() and (ids == 8).any()
    out = fused_experts(x, w13, w2, ids, weights, config=config_for(layout))
    assert torch.equal(out[0], torch.zeros(40))
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights.nan_to_num()), torch.float32)


def test_config_skips_the_sort_only_when_pairs_rarely_share_an_expert():
    from moe_triton import choose_config

    cpu = torch.device("cpu")
    assert choose_config(1, 8, 128, 64, 64, cpu).layout is LayoutKind.PER_PAIR  # one token: K distinct experts
    assert choose_config(2, 2, 16, 64, 64, cpu).layout is LayoutKind.PER_PAIR  # P^2 = 16 <= E
    assert choose_config(8, 8, 128, 64, 64, cpu).layout is LayoutKind.SORTED


def test_output_is_fresh_and_input_unchanged():
    x, w13, w2, ids, weights = make_layer(17, 4, 2, 40, 33, torch.float32, seed=5)
    inputs = [t.clone() for t in (x, w13, w2, ids, weights)]
    out = fused_experts(x, w13, w2, ids, weights)
    assert out.data_ptr() not in {t.data_ptr() for t in (x, w13, w2, ids, weights)}
    for before, after in zip(inputs, (x, w13, w2, ids, weights)):
        assert torch.equal(before, after)


def test_non_contiguous_inputs(poisoned_empty):
    x, w13, w2, ids, weights = make_layer(17, 4, 2, 40, 33, torch.float32, seed=6)
    x_strided = torch.randn(40, 17).T  # column-major (T, H)
    x_strided.copy_(x)
    ids64 = ids.long().T.contiguous().T  # int64, transposed storage
    weights_strided = weights.T.contiguous().T
    out = fused_experts(x_strided, w13, w2, ids64, weights_strided)
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights), torch.float32)


def test_empty_batch_launches_nothing(monkeypatch):
    import moe_triton.fused_moe as fused_moe

    monkeypatch.setattr(fused_moe, "expand", lambda *a, **k: pytest.fail("launched for 0 tokens"))
    x, w13, w2, ids, weights = make_layer(0, 4, 2, 40, 33, torch.float32, seed=0)
    out = fused_experts(x, w13, w2, ids, weights)
    assert out.shape == (0, 40)


def _bad(**changes):
    x, w13, w2, ids, weights = make_layer(3, 4, 2, 16, 8, torch.float32, seed=0)
    args = dict(hidden_states=x, w13=w13, w2=w2, topk_ids=ids, topk_weights=weights)
    args.update({k: v(args) if callable(v) else v for k, v in changes.items()})
    return args


@pytest.mark.parametrize("args,match", [
    (_bad(hidden_states=lambda a: a["hidden_states"][None]), "hidden_states"),
    (_bad(hidden_states=lambda a: a["hidden_states"].double()), "hidden_states"),
    (_bad(w13=lambda a: a["w13"].half()), "w13"),
    (_bad(w13=lambda a: a["w13"][:, :, :8]), "w13"),
    (_bad(w13=lambda a: a["w13"][:0], w2=lambda a: a["w2"][:0]), "E=0"),
    (_bad(w13=lambda a: a["w13"][:, :15]), "w13"),
    (_bad(w2=lambda a: a["w2"][:, :, :4]), "w2"),
    (_bad(topk_ids=lambda a: a["topk_ids"].float()), "topk_ids"),
    (_bad(topk_ids=lambda a: a["topk_ids"][:2]), "topk_ids"),
    (_bad(topk_ids=lambda a: a["topk_ids"][:, :0], topk_weights=lambda a: a["topk_weights"][:, :0]), "top_k"),
    (_bad(topk_weights=lambda a: a["topk_weights"][:, :1]), "topk_weights"),
    (_bad(topk_weights=lambda a: a["topk_ids"]), "topk_weights"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_raises_before_launch(args, match, monkeypatch):
    import moe_triton.fused_moe as fused_moe

    monkeypatch.setattr(fused_moe, "expand", lambda *a, **k: pytest.fail("launched before validating"))
    with pytest.raises(ValueError, match=match):
        fused_experts(**args)


def test_nan_hidden_states_stay_in_their_rows():
    x, w13, w2, ids, weights = make_layer(17, 4, 2, 40, 33, torch.float32, seed=7)
    x[3] = float("nan")
    out = fused_experts(x, w13, w2, ids, weights)
    assert out[3].isnan().all()
    others = torch.ones(17, dtype=torch.bool)
    others[3] = False
    assert not out[others].isnan().any()


@pytest.mark.parametrize("splits", [None, 1, 3, 8], ids=str)
def test_decode_configs_fit_shared_memory(monkeypatch, splits):
    """Every decode config leaves num_stages copies of its tiles within an H200's shared memory."""
    from moe_triton import choose_config, config as configs
    from moe_triton.tools.bench import DEEPSEEK_V3, E64_K4, MIXTRAL_8X7B, QWEN3_30B_A3B

    limit = 232448  # H200: shared_memory_per_block_optin
    monkeypatch.setattr(configs, "_device_limits", lambda device: (132, limit))
    for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4):
        for T in (1, 4, 16, 64, 256):
            c = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size, shape.intermediate_size,
                              torch.device("cuda"), down_split=splits)
            up_stage = c.up.block_c * (c.up.block_m + 2 * c.up.block_n) * 2  # a + gate + up tiles, bf16
            down_stage = c.down.block_c * (c.down.block_m + c.down.block_n) * 2
            assert c.up.num_stages * up_stage <= limit and c.down.num_stages * down_stage <= limit, c.describe()
