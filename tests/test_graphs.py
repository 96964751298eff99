"""graphs/: bucket choice, padding and slicing, capture-flag scoping, streams; replay == eager on
GPU."""
import itertools

import pytest
import torch
from helpers import assert_close

from moe_triton.graphs import (
    DecodeGraphRunner,
    ForwardMode,
    GraphConfig,
    StaticInput,
    bucket_for,
    capture_mode,
    default_batch_sizes,
    gathered_dispatch,
    get_stream,
    is_capture_mode,
    overlap_enabled,
    run_branches,
)

# ---- CPU -------------------------------------------------------------------------------------


def test_captured_decode_overlaps_only_in_the_buckets_where_it_measured_faster():
    from types import SimpleNamespace

    from moe_triton.models.causal_lm import OVERLAP_MAX_BATCH, CausalLM

    def overlaps(batch: int, use_overlap: bool = True) -> bool:
        model = SimpleNamespace(use_overlap=use_overlap)
        positions, slots = torch.zeros(batch, 1, dtype=torch.long), torch.arange(batch)
        return CausalLM.batch(model, ForwardMode.DECODE, positions, slots).overlap

    with capture_mode():
        assert overlaps(1) and overlaps(OVERLAP_MAX_BATCH)
        assert not overlaps(OVERLAP_MAX_BATCH + 1) and not overlaps(1, use_overlap=False)
    assert not overlaps(1)  # eager decode: one stream


def test_default_batch_sizes_follow_the_serving_engines():
    sizes = default_batch_sizes()
    assert (sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256
            and all(b - a == 8 for a, b in itertools.pairwise(sizes[3:])))
    assert default_batch_sizes(12) == (1, 2, 4, 8)


@pytest.mark.parametrize("batch,expected",
                         [(1, 1), (3, 4), (8, 8), (9, 16), (17, 24), (256, 256), (257, None)])
def test_bucket_for(batch, expected):
    assert bucket_for(batch, default_batch_sizes()) == expected


def test_capture_flag_is_scoped_and_cleared_on_errors():
    assert not is_capture_mode()
    with capture_mode():
        assert is_capture_mode()
        assert overlap_enabled(ForwardMode.DECODE)
        assert not overlap_enabled(ForwardMode.PREFILL)  # prefill capture sets the flag too
    assert not is_capture_mode() and not overlap_enabled(ForwardMode.DECODE)
    with pytest.raises(RuntimeError), capture_mode():
        raise RuntimeError("capture failed")
    assert not is_capture_mode()


@pytest.mark.parametrize("overlap,gathered",
                         [(True, True), (False, True), (True, False), (False, False)])
def test_overlap_and_the_gathered_dispatch_are_two_switches(overlap, gathered):
    """A capture turns both on by default; either can be off without the other (or capturing)."""
    with capture_mode():
        assert overlap_enabled(ForwardMode.DECODE) and gathered_dispatch()
    with capture_mode(overlap=overlap, gathered=gathered):
        assert is_capture_mode()
        assert overlap_enabled(ForwardMode.DECODE) == overlap and gathered_dispatch() == gathered
        assert not overlap_enabled(ForwardMode.PREFILL)
    assert not (is_capture_mode() or overlap_enabled(ForwardMode.DECODE) or gathered_dispatch())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA-less fallback")
def test_streams_are_none_without_cuda_and_branches_run_serially():
    assert get_stream("alt") is None
    order = []
    main, side = run_branches(lambda: order.append("main") or 1, lambda: order.append("side") or 2)
    assert (main, side) == (1, 2) and sorted(order) == ["main", "side"]


def affine_step(weight):
    return lambda inputs: inputs["x"] @ weight + inputs["position"].unsqueeze(-1).float()


def test_runner_without_cuda_runs_eagerly_with_the_same_results():
    weight = torch.randn(5, 3)
    runner = DecodeGraphRunner(affine_step(weight),
                               {"x": StaticInput((5,), torch.float32), "position": StaticInput()},
                               GraphConfig(enabled=False, show_progress=False))
    assert runner.capture().num_graphs == 0
    x, position = torch.randn(7, 5), torch.arange(7)
    assert torch.equal(runner({"x": x, "position": position}),
                       x @ weight + position.unsqueeze(-1).float())
    empty = runner({"x": torch.empty(0, 5), "position": torch.empty(0, dtype=torch.int64)})
    assert empty.shape == (0, 3)


@pytest.mark.parametrize("inputs,match", [
    ({"x": torch.randn(2, 5)}, "exactly"),
    ({"x": torch.randn(2, 5), "position": torch.arange(3)}, "leading batch"),
    ({"x": torch.randn(2, 4), "position": torch.arange(2)}, "'x'"),
    ({"x": torch.randn(2, 5), "position": torch.arange(2).int()}, "'position'"),
])
def test_runner_rejects_bad_batches(inputs, match):
    runner = DecodeGraphRunner(affine_step(torch.randn(5, 3)),
                               {"x": StaticInput((5,), torch.float32), "position": StaticInput()},
                               GraphConfig(enabled=False, show_progress=False))
    with pytest.raises(ValueError, match=match):
        runner(inputs)


def slot_step(calls):
    return lambda inputs: (calls.append(inputs["slot"].clone())
                           or inputs["slot"].float()[:, None] * 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bounded_inputs_are_checked_before_anything_is_copied_or_run(device):
    """The caller's slots must lie in [0, 4); the pad value 4 (a dummy slot) only the runner
    writes."""
    calls = []
    runner = DecodeGraphRunner(slot_step(calls), {"slot": StaticInput(pad_value=4, bounds=(0, 4))},
                               GraphConfig(batch_sizes=(4,), show_progress=False), device)
    runner.capture()
    calls.clear()
    before = {name: buffer.clone() for name, buffer in runner.static.items()}
    for bad, shown in (([0, 4], r"\[0, 4\]"), ([-1, 2, 3], r"\[-1, 3\]")):
        with pytest.raises(ValueError,
                           match=rf"input 'slot' must lie in \[0, 4\), got values in {shown}"):
            runner({"slot": torch.tensor(bad, device=device)})
    assert not calls and all(torch.equal(runner.static[n], b) for n, b in before.items())
    assert torch.equal(runner({"slot": torch.tensor([3, 0], device=device)}).cpu(),
                       torch.tensor([[6.0], [0.0]]))
    assert torch.equal(runner.run({"slot": torch.tensor([4], device=device)}).cpu(),
                       torch.tensor([[8.0]]))  # unchecked
    assert runner({"slot": torch.empty(0, dtype=torch.int64, device=device)}).shape == (0, 1)


def test_bounds_are_for_integer_inputs():
    with pytest.raises(ValueError, match="integer inputs"):
        StaticInput((5,), torch.float32, bounds=(0, 1))


# ---- GPU -------------------------------------------------------------------------------------


def moe_stack_step(num_layers=2, hidden=256, experts=16, top_k=4, intermediate=192, vocab=512):
    from moe_triton import FusedMoE

    torch.manual_seed(0)
    embedding = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    layers = []
    for _ in range(num_layers):
        layer = FusedMoE(experts, top_k, hidden, intermediate, dtype=torch.bfloat16, device="cuda")
        for p in layer.parameters():
            p.data.normal_(0, 0.05)
        layers.append(layer)

    @torch.no_grad()
    def step(inputs):
        x = embedding[inputs["token_ids"]]  # [B, H]
        for layer in layers:
            x = x + layer(x)
        return x.float()

    return step


@pytest.mark.gpu
def test_replay_equals_eager_for_every_bucket_and_padded_batch():
    step = moe_stack_step()
    config = GraphConfig(batch_sizes=(1, 2, 4, 8, 16, 24), show_progress=False)
    runner = DecodeGraphRunner(step, {"token_ids": StaticInput()}, config)
    stats = runner.capture()
    assert stats.num_graphs == 6 and stats.pool_bytes >= 0
    g = torch.Generator(device="cuda").manual_seed(1)
    # padded sizes, a repeat, one past the largest (eager)
    for batch in (1, 2, 3, 4, 5, 8, 13, 16, 24, 24, 30):
        ids = torch.randint(0, 512, (batch,), device="cuda", generator=g)
        assert_close(runner({"token_ids": ids}), step({"token_ids": ids}), torch.bfloat16)
    assert runner({"token_ids": torch.empty(0, dtype=torch.int64, device="cuda")}).shape == (0, 256)


@pytest.mark.gpu
def test_plans_made_while_capturing_one_runner_replay_right_in_the_next(monkeypatch):
    """Counters a plan keeps must not live in a capture's pool: the graphs sharing it write their
    temporaries there. With 64 x 64 tiles the router (16 x 256) splits in two, summed by the last
    program to arrive; the plans made while capturing the first runner's buckets (largest first)
    serve the second runner's capture, whose sums must still finish. On the H200 this sequence
    failed every time with the counters allocated in the plan (max error 0.45 at max 3.3)."""
    import moe_triton.gemv as gemv_module
    from moe_triton.launch import PlanCache

    monkeypatch.setattr(gemv_module, "_PLANS", PlanCache())  # plans made here, not reused
    monkeypatch.setattr(gemv_module, "TENSOR_CORE_TILE", gemv_module.GemvConfig(
        block_n=64, block_c=64, num_warps=4, num_stages=4, tensor_cores=True))
    assert gemv_module.choose_gemv_config(8, 16, 256, 132).slices == 2
    step = moe_stack_step()
    first = DecodeGraphRunner(step, {"token_ids": StaticInput()},
                              GraphConfig(batch_sizes=(1, 2, 4, 8, 16, 24), show_progress=False))
    first.capture()
    g = torch.Generator(device="cuda").manual_seed(3)
    for batch in (1, 2, 3, 4, 5, 8, 13, 16, 24):  # every graph replays its temporaries
        ids = torch.randint(0, 512, (batch,), device="cuda", generator=g)
        assert_close(first({"token_ids": ids}), step({"token_ids": ids}), torch.bfloat16)
    del first
    second = DecodeGraphRunner(step, {"token_ids": StaticInput()},
                               GraphConfig(batch_sizes=(8,), show_progress=False))
    second.capture()
    for batch in (8, 5, 8):
        ids = torch.randint(0, 512, (batch,), device="cuda", generator=g)
        assert_close(second({"token_ids": ids}), step({"token_ids": ids}), torch.bfloat16)


@pytest.mark.gpu
def test_a_lockstep_runner_replays_its_one_bucket_for_every_batch_and_refuses_a_larger_one():
    """Expert-parallel ranks replay the same graph at every step, also with no rows of their own."""
    calls = []
    step = moe_stack_step()
    counted = lambda inputs: calls.append(len(inputs["token_ids"])) or step(inputs)  # noqa: E731
    runner = DecodeGraphRunner(counted, {"token_ids": StaticInput()},
                               GraphConfig(batch_sizes=(8,), lockstep=True, show_progress=False))
    runner.capture()
    captured_calls = len(calls)
    g = torch.Generator(device="cuda").manual_seed(2)
    for batch in (0, 1, 5, 8):
        ids = torch.randint(0, 512, (batch,), device="cuda", generator=g)
        out = runner({"token_ids": ids})
        assert out.shape == (batch, 256)
        if batch:
            assert_close(out, step({"token_ids": ids}), torch.bfloat16)
    # every batch, 0 included, was a replay: the step never ran eagerly
    assert len(calls) == captured_calls
    with pytest.raises(ValueError, match="larger than the 8 rows captured for this lockstep"):
        runner({"token_ids": torch.zeros(9, dtype=torch.int64, device="cuda")})


@pytest.mark.gpu
def test_back_to_back_replays_hold_no_stale_state():
    step = moe_stack_step()
    runner = DecodeGraphRunner(step, {"token_ids": StaticInput()},
                               GraphConfig(batch_sizes=(8,), show_progress=False))
    runner.capture()
    first_ids = torch.arange(8, device="cuda")
    first = runner({"token_ids": first_ids})
    second = runner({"token_ids": first_ids + 100})
    # padded: rows 5..7 get the pad value, not stale ids
    third = runner({"token_ids": first_ids[:5]})
    assert not torch.equal(first, second)
    assert_close(first, step({"token_ids": first_ids}), torch.bfloat16)
    assert_close(second, step({"token_ids": first_ids + 100}), torch.bfloat16)
    assert_close(third, step({"token_ids": first_ids[:5]}), torch.bfloat16)
    assert torch.equal(runner.static["token_ids"][5:8].cpu(), torch.zeros(3, dtype=torch.int64))


@pytest.mark.gpu
def test_capture_with_streams_forked_and_joined_inside():
    weight_main = torch.randn(64, 64, device="cuda") / 8
    weight_side = torch.randn(64, 64, device="cuda") / 8

    def step(inputs):
        x = inputs["x"]
        main, side = run_branches(lambda: torch.tanh(x @ weight_main),
                                  lambda: torch.sigmoid(x @ weight_side),
                                  role="alt")
        main2, side2 = run_branches(lambda: main @ weight_side, lambda: side @ weight_main,
                                    role="alt_mlp")
        return main2 + side2

    runner = DecodeGraphRunner(step, {"x": StaticInput((64,), torch.float32)},
                               GraphConfig(batch_sizes=(4, 16), show_progress=False))
    runner.capture()
    for batch in (3, 16, 4):
        x = torch.randn(batch, 64, device="cuda")
        torch.cuda._sleep(1_000_000)  # hold the main stream back: a missing join would read early
        assert_close(runner({"x": x}), step({"x": x}), torch.float32, scale=10)


@pytest.mark.gpu
def test_role_streams_are_shared_per_device_and_role():
    assert get_stream("alt") is get_stream("alt")
    assert get_stream("alt") is not get_stream("alt_mlp")


@pytest.mark.gpu
def test_shared_role_streams_capture_in_less_memory_than_a_stream_per_layer():
    from moe_triton.tools.bench import branch_stack_capture_bytes

    shared = branch_stack_capture_bytes(32, stream_per_layer=False)
    per_layer = branch_stack_capture_bytes(32, stream_per_layer=True)
    assert shared < per_layer / 4, (f"shared {shared / 2**20:.0f} MiB vs "
                                    f"per-layer {per_layer / 2**20:.0f} MiB")
