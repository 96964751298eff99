"""graphs/: capture memory with a stream per layer vs shared role streams, and decode latency of
a 4-layer Qwen3-30B-A3B-shaped MoE stack (router + experts), eager vs CUDA-graph replay."""
import pytest
import torch
from measure import event_median_seconds

from moe_triton import FusedMoE
from moe_triton.graphs import DecodeGraphRunner, GraphConfig, StaticInput
from moe_triton.tools.bench import QWEN3_30B_A3B, branch_stack_capture_bytes

LAYERS = 4


@pytest.mark.gpu
def test_capture_memory_stream_per_layer_vs_shared(benchmark, record):
    shared = branch_stack_capture_bytes(32, stream_per_layer=False)
    per_layer = branch_stack_capture_bytes(32, stream_per_layer=True)
    record("graph capture memory, 32-layer stack, side branch per layer "
           "(T=2048, H=2048, bf16)", dict(
               streams="one per layer (32)", capture_reserved_MiB=f"{per_layer / 2**20:.0f}"))
    record("graph capture memory, 32-layer stack, side branch per layer "
           "(T=2048, H=2048, bf16)", dict(
               streams="shared role 'alt'", capture_reserved_MiB=f"{shared / 2**20:.0f}"))
    benchmark.extra_info.update(shared_bytes=shared, per_layer_bytes=per_layer)
    benchmark.pedantic(lambda: None, rounds=1)
    assert shared < per_layer


@pytest.fixture(scope="module")
def qwen_stack():
    shape = QWEN3_30B_A3B
    layers = []
    for _ in range(LAYERS):
        layer = FusedMoE(shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size,
                         dtype=torch.bfloat16, device="cuda")
        for p in layer.parameters():
            p.data.normal_(0, 0.02)
        layers.append(layer)

    @torch.no_grad()
    def step(inputs):
        x = inputs["hidden_states"]
        for layer in layers:
            x = x + layer(x)
        return x

    return step


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_decode_step_eager_vs_graph(benchmark, qwen_stack, batch, record):
    runner = DecodeGraphRunner(qwen_stack,
                               {"hidden_states": StaticInput((QWEN3_30B_A3B.hidden_size,),
                                                             torch.bfloat16)},
                               GraphConfig(batch_sizes=(batch,), show_progress=False))
    stats = runner.capture()
    x = torch.randn(batch, QWEN3_30B_A3B.hidden_size, device="cuda", dtype=torch.bfloat16)
    eager = event_median_seconds(lambda: qwen_stack({"hidden_states": x}))
    graph = event_median_seconds(lambda: runner({"hidden_states": x}))
    torch.testing.assert_close(runner({"hidden_states": x}), qwen_stack({"hidden_states": x}),
                               rtol=2e-2, atol=2e-2)
    record(f"decode step, {LAYERS} MoE layers of Qwen3-30B-A3B shape (router + experts, bf16)",
           dict(batch=batch, eager_us=f"{eager * 1e6:.1f}", graph_us=f"{graph * 1e6:.1f}",
                speedup=f"{eager / graph:.2f}x", capture_s=f"{stats.seconds:.2f}",
                pool_MiB=f"{stats.pool_bytes / 2**20:.1f}"))
    benchmark.extra_info.update(batch=batch, layers=LAYERS, eager_s=eager, graph_s=graph,
                                dtype="bfloat16", backend="triton", shape=QWEN3_30B_A3B.name)
    benchmark.pedantic(lambda: (runner({"hidden_states": x}), torch.cuda.synchronize()), rounds=30,
                       warmup_rounds=3)
