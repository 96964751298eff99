"""moe_triton.parallel on GPUs over NCCL, one GPU per rank (run: pytest -m gpu tests/test_distributed_gpu.py).

The CPU suite's checks (tests/test_distributed.py) at real-ish sizes in bf16 on the compiled
Triton kernels: TP, EP by all-to-all and replicated, zero-token ranks, uneven counts, top-k above
E/ep, reduce-scatter, and outputs near the bf16 maximum that overflow if double-counted. Two GPUs
(the `nvidia-h200-x2` kind) cover world size 2; EP x TP needs four and is skipped on two.
Spawned ranks keep NVLink multicast off (distributed_harness.SUBPROCESS_ENV).
"""
import pytest
import torch

from distributed_harness import Case, rank_pools
from moe_triton.parallel import OutputLayout, ParallelSpec, TokenDispatch

pytestmark = pytest.mark.gpu
REPLICATED, SCATTERED = TokenDispatch.REPLICATED, OutputLayout.SCATTERED
SHAPE = dict(dtype=torch.bfloat16, num_experts=16, top_k=4, hidden=1024, intermediate=768)
HUGE = dict(SHAPE, huge=True)

CASES = {
    2: [
        Case(ParallelSpec(tp_size=2), (64,), **SHAPE),
        Case(ParallelSpec(tp_size=2, output=SCATTERED), (65,), **SHAPE),
        Case(ParallelSpec(tp_size=2), (0,), **SHAPE),
        Case(ParallelSpec(tp_size=2), (8,), **HUGE),
        Case(ParallelSpec(ep_size=2), (37, 0), **SHAPE),
        Case(ParallelSpec(ep_size=2), (0, 0), **SHAPE),
        Case(ParallelSpec(ep_size=2), (512, 3), **SHAPE),
        Case(ParallelSpec(ep_size=2), (4096, 1500), **SHAPE),
        Case(ParallelSpec(ep_size=2), (64, 64), filtered=True, **SHAPE),
        Case(ParallelSpec(ep_size=2), (1, 5), **dict(SHAPE, num_experts=8, top_k=8)),  # K > E/ep
        Case(ParallelSpec(ep_size=2), (128, 77), **dict(SHAPE, dtype=torch.float16)),
        Case(ParallelSpec(ep_size=2), (8, 8), **HUGE),
        Case(ParallelSpec(ep_size=2, dispatch=REPLICATED), (64,), **SHAPE),
        Case(ParallelSpec(ep_size=2, dispatch=REPLICATED, output=SCATTERED), (33,), **SHAPE),
        Case(ParallelSpec(ep_size=2, dispatch=REPLICATED), (8,), **HUGE),
        Case(ParallelSpec(tp_size=2), (64,), module="fused_moe", **SHAPE),
        Case(ParallelSpec(ep_size=2), (300, 0), module="fused_moe", **SHAPE),
    ],
    4: [
        Case(ParallelSpec(tp_size=4), (32,), **SHAPE),
        Case(ParallelSpec(ep_size=4), (64, 0, 300, 5), **SHAPE),
        Case(ParallelSpec(ep_size=2, tp_size=2), (256, 0), **SHAPE),
        Case(ParallelSpec(ep_size=2, tp_size=2, dispatch=REPLICATED), (64,), **SHAPE),
        Case(ParallelSpec(ep_size=2, tp_size=2), (8, 8), **HUGE),
    ],
}


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    with rank_pools(tmp_path_factory, "nccl") as get:
        yield get


@pytest.mark.parametrize("world_size,case", [
    pytest.param(w, c, marks=pytest.mark.skipif(torch.cuda.device_count() < w, reason=f"needs {w} GPUs"))
    for w, cases in CASES.items() for c in cases
], ids=lambda v: str(v) if isinstance(v, Case) else f"ws{v}")
def test_parallel_experts_match_the_reference_nccl(pools, world_size, case):
    pools(world_size).run(case)


# A whole model with parallel=, float32 (greedy tokens must match exactly): TP decodes through CUDA
# graphs with the NCCL all-reduce captured; all-to-all EP decodes eagerly (host-side split sizes).
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("spec", [ParallelSpec(tp_size=2), ParallelSpec(ep_size=2)],
                         ids=lambda s: f"ep{s.ep_size}xtp{s.tp_size}")
def test_sharded_model_matches_the_whole_checkpoint_nccl(pools, qwen3_checkpoint, spec):
    tokens = (7, 4) if spec.all_to_all else (6,)
    pools(2).run(Case(spec, tokens, dtype=torch.float32, module="model", checkpoint=qwen3_checkpoint))
