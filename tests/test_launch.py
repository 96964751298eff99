"""BoundLaunch: fixed arguments plus each call's tensors give what `kernel[grid](...)` gives; on the
GPU the direct launch is taken, and calls the compiled kernel does not fit go through the JIT."""
import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from moe_triton.launch import BoundLaunch


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, (x * factor).to(out_ptr.dtype.element_ty), mask=offs < n)


N = 1000


def scale_launch() -> BoundLaunch:
    return BoundLaunch(_scale_kernel, (triton.cdiv(N, 256),), dict(n=N, factor=3.0, BLOCK=256))


def launch_and_check(launch: BoundLaunch, x: torch.Tensor) -> None:
    out = torch.full_like(x, float("nan"))
    launch(x_ptr=x, out_ptr=out)
    torch.testing.assert_close(out, (x.float() * 3.0).to(x.dtype), rtol=0, atol=0)


def test_each_call_takes_its_own_tensors():
    launch = scale_launch()
    for seed in range(3):
        launch_and_check(launch, torch.randn(N, generator=torch.Generator().manual_seed(seed)))


def test_an_argument_neither_fixed_nor_passed_is_named():
    launch = BoundLaunch(_scale_kernel, (4,), dict(n=N, BLOCK=256))
    with pytest.raises(ValueError, match="factor"):
        launch(x_ptr=torch.zeros(N), out_ptr=torch.zeros(N))


def test_a_direct_launch_is_refused_where_the_specialization_does_not_fit(monkeypatch):
    """The checks a direct launch makes before it skips the JIT, on a launch remembered as the
    compiled path remembers it (the interpreter compiles nothing, so it is set up by hand here)."""
    launch = scale_launch()
    x = torch.zeros(N + 4)
    launch._values = [None, None, N, 3.0, 256]
    launch._slots = {"x_ptr": (0, torch.float32, True), "out_ptr": (1, torch.float32, True)}
    aligned, out = x[:N], torch.zeros(N)
    assert launch._direct_values(dict(x_ptr=aligned, out_ptr=out)) == [aligned.data_ptr(), out.data_ptr(), N, 3.0, 256]
    assert launch._direct_values(dict(x_ptr=x[1:N + 1], out_ptr=out)) is None  # 4 bytes off: not 16-aligned
    assert launch._direct_values(dict(x_ptr=aligned.half(), out_ptr=out)) is None  # another dtype
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    assert launch._direct_values(dict(x_ptr=aligned, out_ptr=out)) is None  # a profiler's hook must see it


# ---- on the GPU: the direct launch ---------------------------------------------------------------

@pytest.fixture
def jit_calls(monkeypatch):
    """How many launches went through the JIT (`kernel[grid]`) rather than the direct path."""
    calls = []
    run = _scale_kernel.run

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(_scale_kernel, "run", counted)
    return calls


@pytest.mark.gpu
def test_later_calls_launch_the_compiled_kernel_directly(jit_calls):
    launch = scale_launch()
    for _ in range(4):
        launch_and_check(launch, torch.randn(N, device="cuda"))
    assert len(jit_calls) == 1


@pytest.mark.gpu
def test_a_call_the_specialization_does_not_fit_goes_through_the_jit(jit_calls):
    launch = scale_launch()
    launch_and_check(launch, torch.randn(N, device="cuda"))
    unaligned = torch.randn(N + 1, device="cuda")[1:]  # 4 bytes past an aligned address
    launch_and_check(launch, unaligned)
    launch_and_check(launch, torch.randn(N, device="cuda", dtype=torch.float16))
    assert len(jit_calls) == 3
    launch_and_check(launch, torch.randn(N, device="cuda"))
    assert len(jit_calls) == 3


@pytest.mark.gpu
def test_launch_hooks_see_every_launch(jit_calls, monkeypatch):
    launch = scale_launch()
    launch_and_check(launch, torch.randn(N, device="cuda"))
    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: seen.append(metadata))
    launch_and_check(launch, torch.randn(N, device="cuda"))
    assert len(seen) == 1 and len(jit_calls) == 2


@pytest.mark.gpu
def test_direct_launches_are_captured_by_cuda_graphs():
    launch = scale_launch()
    x, out = torch.randn(N, device="cuda"), torch.empty(N, device="cuda")
    launch(x_ptr=x, out_ptr=out)  # compiles outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(x_ptr=x, out_ptr=out)
    x.copy_(torch.randn(N, device="cuda"))
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, x * 3.0, rtol=0, atol=0)
