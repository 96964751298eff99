"""moe_triton.parallel on CPU: the reduction table, sharding in one process, and spawned gloo ranks
(world sizes 2 and 4) whose outputs must equal the single-process reference on the full weights;
on GPUs (pytest -m gpu), the same checks over NCCL, one GPU per rank.

The spawned ranks run the Triton kernels under the interpreter at tiny sizes; a few cases use the
torch reference as the local experts (`backend="torch"`), so both local paths are covered.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_harness import SUBPROCESS_ENV, Case, rank_pools
from helpers import assert_close, copy_experts_, random_expert_weights, random_ids

from moe_triton import (
    Activation,
    ActivationKind,
    ExpertWeights,
    FusedMoE,
    Placement,
    WeightFormat,
    fused_experts,
    fused_experts_torch,
    run_experts,
)
from moe_triton.parallel import (
    Collective,
    OutputLayout,
    ParallelSpec,
    ReduceOver,
    Reduction,
    TokenDispatch,
    block_lead,
    compact_slots,
    localize_ids,
    new_parallel_groups,
    post_experts_reduction,
    scattered_rows,
    shard_expert_weights,
    shard_experts,
    torch_experts,
)

A2A, REPLICATED = TokenDispatch.ALL_TO_ALL, TokenDispatch.REPLICATED
FULL, SCATTERED = OutputLayout.FULL, OutputLayout.SCATTERED
NONE = Reduction(Collective.NONE)
RELU2 = Activation(ActivationKind.RELU2)


# ---- the post-experts reduction: one table -------------------------------------------------

REDUCTION_TABLE = [
    # (ep, tp, dispatch, output) -> reduction
    ((1, 1, A2A, FULL), NONE),  # one rank
    # TP only; dispatch is moot without EP
    ((1, 2, A2A, FULL), Reduction(Collective.ALL_REDUCE, ReduceOver.TP)),
    ((1, 2, REPLICATED, FULL), Reduction(Collective.ALL_REDUCE, ReduceOver.TP)),
    ((1, 2, A2A, SCATTERED), Reduction(Collective.REDUCE_SCATTER, ReduceOver.TP)),
    ((2, 1, A2A, FULL), NONE),  # the all-to-all combine already summed: no all-reduce
    ((2, 1, A2A, SCATTERED), NONE),  # tokens are each rank's own already
    # EP without all-to-all
    ((2, 1, REPLICATED, FULL), Reduction(Collective.ALL_REDUCE, ReduceOver.EP)),
    ((2, 1, REPLICATED, SCATTERED), Reduction(Collective.REDUCE_SCATTER, ReduceOver.EP)),
    # combine sums EP; TP slices remain
    ((2, 2, A2A, FULL), Reduction(Collective.ALL_REDUCE, ReduceOver.TP)),
    ((2, 2, A2A, SCATTERED), Reduction(Collective.REDUCE_SCATTER, ReduceOver.TP)),
    ((2, 2, REPLICATED, FULL), Reduction(Collective.ALL_REDUCE, ReduceOver.MOE)),
    ((2, 2, REPLICATED, SCATTERED), Reduction(Collective.REDUCE_SCATTER, ReduceOver.MOE)),
]


@pytest.mark.parametrize("setup,expected", REDUCTION_TABLE, ids=lambda v: "-".join(
    str(x.value if hasattr(x, "value") else x) for x in v) if isinstance(v, tuple) else None)
def test_post_experts_reduction(setup, expected):
    ep, tp, dispatch, output = setup
    assert post_experts_reduction(ParallelSpec(ep, tp, dispatch, output)) == expected


@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 1), (2, 2), (8, 4)])
@pytest.mark.parametrize("output", list(OutputLayout))
def test_all_to_all_is_never_reduced_over_ep(ep, tp, output):
    reduction = post_experts_reduction(ParallelSpec(ep, tp, A2A, output))
    assert reduction.over in (None, ReduceOver.TP)
    assert (reduction.collective is Collective.NONE) == (tp == 1)


def test_rank_grid():
    spec = ParallelSpec(ep_size=2, tp_size=2)
    assert spec.tp_groups() == [[0, 1], [2, 3]]  # TP innermost: consecutive ranks, one node
    assert spec.ep_groups() == [[0, 2], [1, 3]]
    assert [spec.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match="outside"):
        spec.coords(4)


@pytest.mark.parametrize("bad", [dict(ep_size=0), dict(tp_size=-1), dict(ep_size=1.5),
                                 dict(dispatch="all_to_all"), dict(output="full")], ids=str)
def test_spec_rejects(bad):
    with pytest.raises(ValueError, match="ParallelSpec"):
        ParallelSpec(**bad)


def test_groups_need_an_initialised_process_group():
    with pytest.raises(ValueError, match="init_process_group"):
        new_parallel_groups(ParallelSpec(tp_size=2))


@pytest.mark.parametrize("num_tokens,size", [(5, 2), (7, 4), (1, 4), (0, 2), (8, 4)])
def test_scattered_rows_cover_every_row_once(num_tokens, size):
    rows = [r for i in range(size) for r in scattered_rows(num_tokens, size, i)]
    assert rows == list(range(num_tokens))


# ---- sharding, in one process: the sum over ranks of the shards' outputs is the full layer ----

def _layer(E, K, H, I, activation, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13, w2 = random_expert_weights(g, E, H, I, activation.gated)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    return x, w13, w2, ids, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("ep,tp", [(1, 2), (1, 3), (2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("activation",
                         [Activation(), RELU2, Activation(ActivationKind.CLAMPED_SWIGLU, 0.5)],
                         ids=lambda a: a.kind.name)
def test_shards_sum_to_the_full_layer(ep, tp, activation):
    E, K, H, I = 8, 3, 12, 15 if tp == 3 else 10
    x, w13, w2, ids, weights = _layer(E, K, H, I, activation)
    spec = ParallelSpec(ep, tp)
    total = torch.zeros(len(x), H)
    for rank in range(spec.world_size):
        w13_r, w2_r = shard_experts(w13, w2, spec, rank, activation=activation)
        assert (w13_r.shape == (E // ep, w13.shape[1] // tp, H)
                and w2_r.shape == (E // ep, H, I // tp))
        assert w13_r.is_contiguous() and w2_r.is_contiguous()
        local = localize_ids(ids, spec.coords(rank)[0] * (E // ep), E // ep)
        total += torch_experts(x, ExpertWeights(w13_r, w2_r, activation.gated),
                               *compact_slots(local, weights, E // ep), activation=activation)
    assert_close(total, fused_experts_torch(x, w13, w2, ids, weights, activation=activation),
                 torch.float32, scale=2)


def test_triton_on_a_tp_shard_with_an_odd_slice():
    # I/tp = 33: the backend's own tail masking
    x, w13, w2, ids, weights = _layer(4, 2, 16, 2 * 33, Activation())
    spec = ParallelSpec(tp_size=2)
    total = sum(fused_experts(x, *shard_experts(w13, w2, spec, rank), ids, weights)
                for rank in range(2))
    assert_close(total, fused_experts_torch(x, w13, w2, ids, weights), torch.float32, scale=2)


def test_backend_padding_applies_per_partition():
    """Shard first, then pad I/tp to the backend's multiple (7688 / 8 = 961 in the field): still
    exact."""
    from moe_triton.runners.padding import pad_experts

    x, w13, w2, ids, weights = _layer(4, 2, 16, 30, Activation())
    spec = ParallelSpec(tp_size=2)
    total = torch.zeros(len(x), 16)
    for rank in range(2):
        # I/tp = 15 -> 16
        w13_r, w2_r = pad_experts(*shard_experts(w13, w2, spec, rank), 16, gated=True)
        assert w13_r.shape[1] == 32 and w2_r.shape[2] == 16
        total += torch_experts(x, ExpertWeights(w13_r, w2_r), ids, weights)
    assert_close(total, fused_experts_torch(x, w13, w2, ids, weights), torch.float32, scale=2)


def test_tp_shard_slices_gate_and_up_separately():
    E, H, I = 1, 1, 4
    # gate rows 0..3, up rows 4..7
    w13 = torch.arange(2 * I, dtype=torch.float32).reshape(E, 2 * I, H)
    w2 = torch.zeros(E, H, I)
    assert shard_experts(w13, w2, ParallelSpec(tp_size=2), 1)[0].flatten().tolist() == [2, 3, 6, 7]


# ---- FP8: scales cut with their weights -------------------------------------------------------

FP8_SHARD_FORMATS = {"block32": WeightFormat.fp8_block(32, 32),
                     "block16x32": WeightFormat.fp8_block(16, 32),
                     "channel": WeightFormat.fp8_channel(),
                     "tensor-static": WeightFormat.fp8_tensor(static_input=True)}


def fp8_experts(fmt, E, H, I, activation=Activation(), seed=0):
    g = torch.Generator().manual_seed(seed)
    native = ExpertWeights(*random_expert_weights(g, E, H, I, activation.gated), activation.gated)
    fp8 = native.to_format(WeightFormat.fp8_tensor() if fmt.static_input else fmt)
    return ExpertWeights(fp8.w13, fp8.w2, fp8.gated, fmt, fp8.w13_scale, fp8.w2_scale,
                         torch.tensor([3.0 / 448]) if fmt.static_input else None)


@pytest.mark.parametrize("ep,tp,I", [(1, 2, 64), (1, 2, 48), (2, 1, 40), (1, 4, 72), (2, 2, 48)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("activation", [Activation(), RELU2], ids=lambda a: a.kind.name)
@pytest.mark.parametrize("name", list(FP8_SHARD_FORMATS))
def test_fp8_shards_hold_exactly_their_slice_of_the_dequantized_weights(name, activation, ep,
                                                                        tp, I):
    """Every shard dequantizes to its slice of the full dequantized weights, bit for bit, behind
    block_lead zero columns (I/tp = 24 or 18 starts inside a 32-wide block); the shards' outputs sum
    to the full layer's."""
    fmt, E, H = FP8_SHARD_FORMATS[name], 4, 32
    full = fp8_experts(fmt, E, H, I, activation)
    w13, w2 = full.dequantized()
    spec, halves = ParallelSpec(ep, tp), 2 if activation.gated else 1
    x, ids, weights = torch.randn(9, H).half(), random_ids(9, 2, E, seed=I).int(), torch.rand(9, 2)
    total = torch.zeros(9, H)
    for rank in range(spec.world_size):
        shard = shard_expert_weights(full, spec, rank)
        ep_rank, tp_rank = spec.coords(rank)
        lead, cols = block_lead(fmt, I, spec, rank), I // tp
        first, experts = tp_rank * cols, slice(ep_rank * (E // ep), (ep_rank + 1) * (E // ep))
        assert (shard.intermediate_size == lead + cols and shard.format == fmt
                and shard.input_scale is full.input_scale)
        assert lead == (first % 32 if fmt.block else 0)
        s13, s2 = shard.dequantized()
        for local, glob in zip(s13.chunk(halves, 1), w13.chunk(halves, 1), strict=True):
            assert not local[:, :lead].any() and torch.equal(local[:, lead:],
                                                             glob[experts, first:first + cols])
        assert not s2[:, :, :lead].any() and torch.equal(s2[:, :, lead:],
                                                         w2[experts, :, first:first + cols])
        local_ids = localize_ids(ids, ep_rank * (E // ep), E // ep)
        total += torch_experts(x.float(), ExpertWeights(s13, s2, activation.gated),
                               *compact_slots(local_ids, weights, E // ep), activation=activation)
    assert_close(total, fused_experts_torch(x, w13, w2, ids, weights, activation=activation),
                 torch.float32, scale=2)


def test_fp8_tp_shards_on_triton_sum_to_the_unsharded_fp8_layer():
    """I/tp a multiple of the epilogue's 32-column activation groups: every rank quantizes exactly
    the intermediate values the unsharded layer does, so the sum differs only in fp16 rounding of
    the partials."""
    full = fp8_experts(WeightFormat.fp8_block(32, 32), 4, 32, 64)
    x, ids, weights = torch.randn(7, 32).half(), random_ids(7, 2, 4, seed=1).int(), torch.rand(7, 2)
    spec = ParallelSpec(tp_size=2)
    total = sum(run_experts(x, shard_expert_weights(full, spec, rank), ids, weights).float()
                for rank in range(2))
    assert_close(total, run_experts(x, full, ids, weights).float(), torch.float16, scale=2)


@pytest.mark.parametrize("ep,tp", [(1, 2), (2, 2)])
def test_biased_mxfp4_shards_on_triton_sum_to_the_unsharded_layer(ep, tp):
    """Shards cut packed weights and scales on whole 32-value groups (I/tp = 32 here); one TP
    rank adds the second GEMM's bias, which the TP sum would otherwise count tp times."""
    g = torch.Generator().manual_seed(3)
    w13, w2 = random_expert_weights(g, 4, 32, 64)
    full = ExpertWeights(w13, w2, w13_bias=torch.randn(4, 128, generator=g),
                         w2_bias=torch.randn(4, 32, generator=g)).to_format(WeightFormat.mxfp4())
    x, ids, weights = torch.randn(7, 32), random_ids(7, 2, 4, seed=1).int(), torch.rand(7, 2)
    spec = ParallelSpec(ep, tp)
    total = torch.zeros(7, 32)
    for rank in range(spec.world_size):
        local = localize_ids(ids, spec.coords(rank)[0] * (4 // ep), 4 // ep)
        total += run_experts(x, shard_expert_weights(full, spec, rank),
                             *compact_slots(local, weights, 4 // ep))
    assert_close(total, fused_experts_torch(x, *full.dequantized(), ids, weights,
                                            w13_bias=full.w13_bias, w2_bias=full.w2_bias),
                 torch.float32, scale=2)


@pytest.mark.parametrize("ep,tp", [(1, 2), (2, 1)])
def test_fused_moe_cuts_fp8_scales_when_it_loads_a_full_state_dict(ep, tp):
    from moe_triton.parallel import ParallelGroups

    fmt, spec = WeightFormat.fp8_block(32, 32), ParallelSpec(ep, tp)
    full = FusedMoE(4, 2, 32, 48, weight_format=fmt, placement=Placement("torch"),
                    dtype=torch.float16)
    experts = fp8_experts(fmt, 4, 32, 48)
    copy_experts_(full, experts)
    for rank in range(2):
        groups = ParallelGroups(spec, rank, None, None, None)  # loading needs no collective
        sharded = FusedMoE(4, 2, 32, 48, weight_format=fmt,
                           placement=Placement("torch", parallel=groups), dtype=torch.float16)
        sharded.load_state_dict(full.state_dict())
        expected = shard_expert_weights(experts, spec, rank)
        for field in ("w13", "w2", "w13_scale", "w2_scale"):
            actual = getattr(sharded.expert_weights(), field)
            assert actual.view(torch.uint8).equal(getattr(expected, field).view(torch.uint8)), field


@pytest.mark.parametrize("ep,tp", [(1, 2), (2, 1)])
def test_fused_moe_cuts_expert_biases_when_it_loads_a_full_state_dict(ep, tp):
    """gate_up_proj_bias follows its rows (I/tp of gate and of up, E/ep experts); down_proj_bias
    its experts, and only TP rank 0 keeps it (the TP sum adds each rank's); the router's bias is
    whole on every rank."""
    from moe_triton.parallel import ParallelGroups

    spec = ParallelSpec(ep, tp)
    full = FusedMoE(4, 2, 32, 48, placement=Placement("torch"), expert_bias=True, router_bias=True)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()
    for rank in range(2):
        groups = ParallelGroups(spec, rank, None, None, None)  # loading needs no collective
        sharded = FusedMoE(4, 2, 32, 48, placement=Placement("torch", parallel=groups),
                           expert_bias=True, router_bias=True)
        sharded.load_state_dict(full.state_dict())
        expected = shard_expert_weights(full.expert_weights(), spec, rank)
        for field in ("w13", "w2", "w13_bias", "w2_bias"):
            assert getattr(sharded.expert_weights(), field).equal(getattr(expected, field)), field
        assert sharded.gate_bias.equal(full.gate_bias)
        assert sharded.down_proj_bias.any() == (spec.coords(rank)[1] == 0)


@pytest.mark.parametrize("bad,match", [
    (dict(E=6, ep=4), "ep_size"), (dict(I=10, tp=4), "tp_size"), (dict(rows=7), "rows"),
], ids=["experts", "intermediate", "w13_rows"])
def test_shard_rejects(bad, match):
    E, I = bad.get("E", 8), bad.get("I", 8)
    w13, w2 = torch.zeros(E, bad.get("rows", 2 * I), 4), torch.zeros(E, 4, I)
    with pytest.raises(ValueError, match=match):
        shard_experts(w13, w2, ParallelSpec(bad.get("ep", 1), bad.get("tp", 1)), 0)


def test_localize_and_compact():
    ids = torch.tensor([[5, 2, 9], [4, 5, -1], [0, 16, 3]], dtype=torch.int32)
    local = localize_ids(ids, first_expert=4, num_local=2)  # the rank owning experts 4 and 5 of 16
    assert local.tolist() == [[1, -1, -1], [0, 1, -1], [-1, -1, -1]]
    weights = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    # K = 3 > E/ep = 2: local slots first
    ids2, weights2 = compact_slots(local, weights, num_local=2)
    assert ids2.tolist() == [[1, -1], [0, 1], [-1, -1]]
    assert torch.equal(weights2[:2, 0], weights[:2, 0]) and weights2[1, 1] == weights[1, 1]
    assert compact_slots(local, weights, num_local=3)[0] is local  # K <= E/ep: untouched


# ---- spawned gloo ranks: the parallel layer equals the full single-process reference ----------

# bf16 runs the torch experts: Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly
# (float16 is exact), and these cases test the collectives in bf16, not the kernels.
HUGE = dict(dtype=torch.bfloat16, huge=True, backend="torch")
CASES = {
    2: [
        Case(ParallelSpec(tp_size=2), (5,)),
        Case(ParallelSpec(tp_size=2), (6,), activation=RELU2),
        Case(ParallelSpec(tp_size=2, output=SCATTERED), (5,)),
        Case(ParallelSpec(tp_size=2), (0,)),
        Case(ParallelSpec(tp_size=2), (4,), **HUGE),
        Case(ParallelSpec(ep_size=2), (5, 3)),
        Case(ParallelSpec(ep_size=2), (0, 6)),
        Case(ParallelSpec(ep_size=2), (0, 0)),
        Case(ParallelSpec(ep_size=2), (7, 4), filtered=True),
        Case(ParallelSpec(ep_size=2), (6, 2), num_experts=4, top_k=3),  # K > E/ep
        Case(ParallelSpec(ep_size=2), (5, 3), dtype=torch.float16, backend="torch"),
        Case(ParallelSpec(ep_size=2), (4, 4), **HUGE),
        Case(ParallelSpec(ep_size=2, dispatch=REPLICATED), (5,)),
        Case(ParallelSpec(ep_size=2, dispatch=REPLICATED, output=SCATTERED), (5,)),
        Case(ParallelSpec(ep_size=2, dispatch=REPLICATED), (4,), **HUGE),
    ],
    4: [
        Case(ParallelSpec(tp_size=4), (5,), intermediate=12),  # I/tp = 3
        # a rank keeps no row
        Case(ParallelSpec(tp_size=4, output=SCATTERED), (3,), intermediate=12),
        Case(ParallelSpec(ep_size=4), (3, 0, 7, 1)),
        # K > E/ep
        Case(ParallelSpec(ep_size=4), (2, 5, 0, 3), top_k=4, filtered=True, backend="torch"),
        Case(ParallelSpec(ep_size=4, dispatch=REPLICATED), (6,)),
        Case(ParallelSpec(ep_size=2, tp_size=2), (4, 0)),
        Case(ParallelSpec(ep_size=2, tp_size=2), (3, 6), filtered=True),
        Case(ParallelSpec(ep_size=2, tp_size=2), (6, 1), dtype=torch.float16),
        Case(ParallelSpec(ep_size=2, tp_size=2, output=SCATTERED), (5, 2)),
        Case(ParallelSpec(ep_size=2, tp_size=2, dispatch=REPLICATED), (5,)),
        Case(ParallelSpec(ep_size=2, tp_size=2, dispatch=REPLICATED, output=SCATTERED), (7,)),
        Case(ParallelSpec(ep_size=2, tp_size=2), (4, 4), **HUGE),
    ],
}


# One level up: FusedMoE(parallel=...) and a whole model loaded with parallel=, against the same
# layer / checkpoint unsharded (run by the ranks, in float32, Triton kernels under the interpreter).
LAYER = dict(module="fused_moe", hidden=24, intermediate=12)
for world_size, specs in {2: [ParallelSpec(tp_size=2), ParallelSpec(ep_size=2),
                              ParallelSpec(ep_size=2, dispatch=REPLICATED)],
                          4: [ParallelSpec(ep_size=2, tp_size=2)]}.items():
    CASES[world_size] += [Case(spec, (5,) if not spec.all_to_all else (5, 0, 3, 2)[:spec.ep_size],
                               **LAYER)
                          for spec in specs]
CASES[2].append(Case(ParallelSpec(ep_size=2), (4, 3), module="fused_moe", activation=RELU2,
                     backend="torch"))
# FP8 layers, float16 activations (FP8 takes no float32 on the kernels): I/tp = 32 keeps the
# intermediate's 32-column quantization groups where the unsharded layer has them, so Triton shards
# sum to its output up to fp16 rounding; I/tp = 24 starts rank 1 inside a 32-wide block (block_lead
# zero columns), run on the dequantizing torch reference, which shows the scales were cut exactly.
FP8_LAYER = dict(module="fused_moe", dtype=torch.float16, hidden=32)
CASES[2] += [
    Case(ParallelSpec(tp_size=2), (5,), intermediate=64,
         weight_format=WeightFormat.fp8_block(32, 32), **FP8_LAYER),
    Case(ParallelSpec(tp_size=2), (5,), intermediate=48,
         weight_format=WeightFormat.fp8_block(32, 32), backend="torch", **FP8_LAYER),
    Case(ParallelSpec(ep_size=2), (5, 3), intermediate=24, weight_format=WeightFormat.fp8_channel(),
         **FP8_LAYER),
    Case(ParallelSpec(ep_size=2, dispatch=REPLICATED), (4,), intermediate=64, activation=RELU2,
         weight_format=WeightFormat.fp8_tensor(static_input=True), **FP8_LAYER),
]
# The gathered EP dispatch (decode graphs: a fixed capacity, nothing read on the host), run in
# graphs' capture mode: every EP rank the same rows, all-padding ranks (0 rows) and filtered ids
# included; unequal rows must be a ValueError on every rank (checked before any payload moves),
# never a hang.
CAPTURED = dict(captured=True)
CASES[2] += [
    Case(ParallelSpec(ep_size=2), (5, 5), **CAPTURED),
    Case(ParallelSpec(ep_size=2), (0, 0), **CAPTURED),
    Case(ParallelSpec(ep_size=2), (6, 6), filtered=True, **CAPTURED),
    Case(ParallelSpec(ep_size=2), (3, 3), num_experts=4, top_k=3, **CAPTURED),  # K > E/ep
    Case(ParallelSpec(ep_size=2), (4, 4), **HUGE, **CAPTURED),
    Case(ParallelSpec(ep_size=2), (5, 3), **CAPTURED),  # refused
    Case(ParallelSpec(ep_size=2), (4, 4), module="fused_moe", hidden=24, intermediate=12,
         **CAPTURED),
    # rows of 2-byte values whose ids could not start on a 4-byte boundary: gathered apart
    Case(ParallelSpec(ep_size=2), (3, 3), hidden=17, dtype=torch.float16, backend="torch",
         **CAPTURED),
]
CASES[4] += [
    Case(ParallelSpec(ep_size=4), (3, 3, 3, 3), top_k=4, filtered=True, backend="torch",
         **CAPTURED),
    Case(ParallelSpec(ep_size=2, tp_size=2), (4, 4), **CAPTURED),
    Case(ParallelSpec(ep_size=4), (2, 2, 0, 2), **CAPTURED),  # refused
]
# TP alone: the 4-rank model's TP groups, and the FP8 model's below (ep1xtp2)
MODEL_SPECS = {2: [ParallelSpec(ep_size=2)], 4: [ParallelSpec(ep_size=2, tp_size=2)]}


@pytest.mark.parametrize("world_size,spec",
                         [(w, s) for w, specs in MODEL_SPECS.items() for s in specs],
                         ids=lambda v: f"ep{v.ep_size}xtp{v.tp_size}" if isinstance(v, ParallelSpec)
                                       else f"ws{v}")
def test_sharded_model_matches_the_whole_checkpoint(pools, qwen3_checkpoint, world_size, spec):
    # under all-to-all, uneven prompts per rank
    tokens = (7, 4)[:spec.ep_size] if spec.all_to_all else (6,)
    pools(world_size).run(Case(spec, tokens, module="model", checkpoint=qwen3_checkpoint))


@pytest.fixture(scope="module")
def qwen3_fp8_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE quantized by transformers' FineGrainedFP8 (32 x 32 blocks, I = 32) in the
    published per-expert layout: at tp 2, rank 1's slice starts inside a block (block_lead 16)."""
    from helpers import (
        per_expert_fp8_layout,
        randomize_,
        save_checkpoint,
        transformers_fp8_checkpoint,
    )
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("qwen3_fp8")
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=64,
                            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)
    model = randomize_(Qwen3MoeForCausalLM(config).eval(), seed=1)
    written, _ = transformers_fp8_checkpoint(model, root / "written", (32, 32))
    return str(save_checkpoint(per_expert_fp8_layout(load_file(written / "model.safetensors")),
                               written, root / "fp8"))


@pytest.mark.parametrize("spec", [ParallelSpec(tp_size=2), ParallelSpec(ep_size=2)],
                         ids=lambda s: f"ep{s.ep_size}xtp{s.tp_size}")
def test_sharded_fp8_model_matches_the_whole_checkpoint(pools, qwen3_fp8_checkpoint, spec):
    """load_model(parallel=...) of an FP8 checkpoint: each rank cuts its experts and their block
    scales (float32 on the dequantizing torch reference, so the whole checkpoint's logits
    exactly)."""
    tokens = (7, 4) if spec.all_to_all else (6,)
    pools(2).run(Case(spec, tokens, module="model", checkpoint=qwen3_fp8_checkpoint,
                      backend="torch"))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4_checkpoint(tmp_path_factory):
    from helpers import gpt_oss_checkpoint

    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    gpt_oss_checkpoint(path, mxfp4=True, intermediate_size=64)  # tp 2: a 32-group per rank
    return str(path)


@pytest.mark.parametrize("spec", [ParallelSpec(ep_size=2), ParallelSpec(tp_size=2)],
                         ids=lambda s: f"ep{s.ep_size}xtp{s.tp_size}")
def test_sharded_gpt_oss_model_matches_the_whole_checkpoint(pools, gpt_oss_mxfp4_checkpoint,
                                                            spec):
    """load_model(parallel=...) of gpt-oss's published MXFP4 checkpoint: each rank cuts its
    experts' packed weights, scales and biases (TP: on whole 32-value groups, the second bias on
    one rank), and the router's bias stays whole."""
    tokens = (7, 4) if spec.all_to_all else (6,)
    pools(2).run(Case(spec, tokens, module="model", checkpoint=gpt_oss_mxfp4_checkpoint,
                      backend="torch"))


def test_fused_moe_rejects_a_scattered_output():
    from moe_triton.parallel import ParallelGroups

    spec = ParallelSpec(tp_size=2, output=SCATTERED)
    groups = ParallelGroups(spec, 0, None, None, None)  # never reaches a collective
    with pytest.raises(ValueError, match="parallel.spec.output"):
        FusedMoE(8, 2, 16, 10, placement=Placement(parallel=groups))


@pytest.mark.parametrize("spec", [ParallelSpec(ep_size=2), ParallelSpec(tp_size=2)],
                         ids=["ep2", "tp2"])
def test_gradients_are_refused_not_detached(spec):
    """The collectives are not differentiated: a sharded layer in grad mode with its parameters
    requiring grad (their default) refuses in one line before any collective."""
    from moe_triton.parallel import ParallelGroups

    groups = ParallelGroups(spec, 0, None, None, None)  # never reaches a collective
    layer = FusedMoE(8, 2, 16, 10, placement=Placement("torch", parallel=groups))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    with pytest.raises(ValueError, match="moe_triton.parallel has no backward") as refusal:
        layer(torch.randn(3, 16))
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("overlap,gathered", [(True, True), (False, True), (True, False)])
def test_the_all_to_all_reads_the_gathered_dispatch_switch_not_the_overlap(overlap, gathered,
                                                                           monkeypatch):
    """parallel_experts picks its dispatch by graphs' gathered_dispatch() alone."""
    import moe_triton.parallel.experts as parallel
    from moe_triton.graphs import capture_mode
    from moe_triton.parallel import ParallelGroups

    class Dispatched(Exception):
        pass

    def fake(name):
        def dispatch(*args):
            raise Dispatched(name)
        return dispatch

    monkeypatch.setattr(parallel, "dispatch", fake("dispatch"))
    monkeypatch.setattr(parallel, "dispatch_gathered", fake("dispatch_gathered"))
    groups = ParallelGroups(ParallelSpec(ep_size=2, dispatch=TokenDispatch.ALL_TO_ALL), 0, None,
                            None, None)
    weights = ExpertWeights(*random_expert_weights(torch.Generator().manual_seed(0), 4, 16, 8))
    ids = random_ids(3, 2, 8, seed=1)
    with torch.no_grad(), capture_mode(overlap=overlap, gathered=gathered), \
            pytest.raises(Dispatched) as taken:
        parallel.parallel_experts(torch.randn(3, 16), weights, ids, torch.rand(3, 2), groups,
                                  experts=torch_experts)
    assert str(taken.value) == ("dispatch_gathered" if gathered else "dispatch")


def test_resolver_keeps_flashinfer_off_sharded_experts():
    from moe_triton.platform import Platform
    from moe_triton.runners import ExpertBackend, ModelContext, resolve

    blackwell = Platform("cuda", (10, 0), "0.7.2")
    whole = ModelContext("Cohere2MoeForCausalLM")  # its rule picks a FlashInfer path on Blackwell
    sharded = ModelContext("Cohere2MoeForCausalLM", sharded_experts=True)
    assert resolve("auto", blackwell, whole).backend is not ExpertBackend.TRITON
    assert resolve("auto", blackwell, sharded).backend is ExpertBackend.TRITON
    for backend in ("flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutlass"):
        with pytest.raises(ValueError, match="not wired to the FlashInfer paths"):
            resolve(backend, blackwell, sharded)


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    with rank_pools(tmp_path_factory, "gloo") as get:
        yield get


@pytest.mark.parametrize("world_size,case", [(w, c) for w, cases in CASES.items() for c in cases],
                         ids=lambda v: str(v) if isinstance(v, Case) else f"ws{v}")
def test_parallel_experts_match_the_reference(pools, world_size, case):
    assert case.spec.world_size == world_size
    pools(world_size).run(case)


def test_docs_example_runs_under_torchrun(tmp_path):
    """docs/DISTRIBUTED.md's example, launched as the doc says, on 2 gloo ranks; it checks
    itself."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "DISTRIBUTED.md").read_text()
    [example] = [block for block in re.findall(r"```python\n(.*?)```", text, re.S)
                 if "init_process_group(" in block]
    script = tmp_path / "example.py"
    script.write_text(example)
    # the CPU path, on any machine
    env = {**os.environ, **SUBPROCESS_ENV, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script)], env=env, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

# ---- NCCL, one GPU per rank (pytest -m gpu) ------------------------------------------------------
# The gloo checks above at real-ish sizes in bf16 on the compiled Triton kernels: TP, EP by
# all-to-all and replicated, zero-token ranks, uneven counts, top-k above E/ep, reduce-scatter, and
# outputs near the bf16 maximum that overflow if double-counted. Two GPUs (the `nvidia-h200-x2`
# kind) cover world size 2; EP x TP needs four and is skipped on two. Spawned ranks keep NVLink
# multicast off (distributed_harness.SUBPROCESS_ENV).
NCCL_SHAPE = dict(dtype=torch.bfloat16, num_experts=16, top_k=4, hidden=1024, intermediate=768)
NCCL_HUGE = dict(NCCL_SHAPE, huge=True)

NCCL_CASES = {
    2: [
        Case(ParallelSpec(tp_size=2), (64,), **NCCL_SHAPE),
        Case(ParallelSpec(tp_size=2, output=SCATTERED), (65,), **NCCL_SHAPE),
        Case(ParallelSpec(tp_size=2), (0,), **NCCL_SHAPE),
        Case(ParallelSpec(tp_size=2), (8,), **NCCL_HUGE),
        Case(ParallelSpec(ep_size=2), (37, 0), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2), (0, 0), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2), (512, 3), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2), (4096, 1500), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2), (64, 64), filtered=True, **NCCL_SHAPE),
        # K > E/ep
        Case(ParallelSpec(ep_size=2), (1, 5), **dict(NCCL_SHAPE, num_experts=8, top_k=8)),
        Case(ParallelSpec(ep_size=2), (128, 77), **dict(NCCL_SHAPE, dtype=torch.float16)),
        Case(ParallelSpec(ep_size=2), (8, 8), **NCCL_HUGE),
        Case(ParallelSpec(ep_size=2, dispatch=REPLICATED), (64,), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2, dispatch=REPLICATED, output=SCATTERED), (33,), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2, dispatch=REPLICATED), (8,), **NCCL_HUGE),
        Case(ParallelSpec(tp_size=2), (64,), module="fused_moe", **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2), (300, 0), module="fused_moe", **NCCL_SHAPE),
        # the gathered dispatch, captured in a CUDA graph with NCCL inside and replayed (bit-equal
        # to eager)
        Case(ParallelSpec(ep_size=2), (64, 64), captured=True, **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2), (1, 1), captured=True,
             **dict(NCCL_SHAPE, num_experts=8, top_k=8)),
        Case(ParallelSpec(ep_size=2), (8, 8), filtered=True, captured=True, **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2), (8, 8), captured=True, **NCCL_HUGE),
        Case(ParallelSpec(ep_size=2), (37, 5), captured=True, **NCCL_SHAPE),  # refused
        Case(ParallelSpec(ep_size=2), (16, 16), module="fused_moe", captured=True, **NCCL_SHAPE),
    ],
    4: [
        Case(ParallelSpec(tp_size=4), (32,), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=4), (64, 0, 300, 5), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2, tp_size=2), (256, 0), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2, tp_size=2, dispatch=REPLICATED), (64,), **NCCL_SHAPE),
        Case(ParallelSpec(ep_size=2, tp_size=2), (8, 8), **NCCL_HUGE),
        Case(ParallelSpec(ep_size=4), (16, 16, 16, 16), captured=True, **NCCL_SHAPE),
    ],
}


@pytest.fixture(scope="module")
def nccl_pools(tmp_path_factory):
    """Spawned only when a gpu test asks for them."""
    with rank_pools(tmp_path_factory, "nccl") as get:
        yield get


@pytest.mark.gpu
@pytest.mark.parametrize("world_size,case", [
    pytest.param(w, c,
                 marks=pytest.mark.skipif(torch.cuda.device_count() < w, reason=f"needs {w} GPUs"))
    for w, cases in NCCL_CASES.items() for c in cases
], ids=lambda v: str(v) if isinstance(v, Case) else f"ws{v}")
def test_parallel_experts_match_the_reference_nccl(nccl_pools, world_size, case):
    nccl_pools(world_size).run(case)


# A whole model with parallel=, float32 (greedy tokens must match exactly), decoding through CUDA
# graphs: TP with the NCCL all-reduce captured, all-to-all EP with the gathered dispatch captured
# (one bucket, every rank replaying it in lockstep, each rank its own prompt).
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("spec", [ParallelSpec(tp_size=2), ParallelSpec(ep_size=2)],
                         ids=lambda s: f"ep{s.ep_size}xtp{s.tp_size}")
def test_sharded_model_matches_the_whole_checkpoint_nccl(nccl_pools, qwen3_checkpoint, spec):
    tokens = (7, 4) if spec.all_to_all else (6,)
    nccl_pools(2).run(Case(spec, tokens, dtype=torch.float32, module="model",
                           checkpoint=qwen3_checkpoint))
