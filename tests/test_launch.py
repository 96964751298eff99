"""BoundLaunch: fixed arguments plus each call's tensors give what `kernel[grid](...)` gives; on the
GPU the direct launch is taken, and calls the compiled kernel does not fit go through the JIT."""
import gc
import itertools
import threading
import weakref

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from moe_triton import launch as launch_module
from moe_triton.launch import (
    BoundLaunch,
    DirectLaunch,
    PlanCache,
    arrival_counters,
    register_op,
)


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
    """The checks a direct launch makes before it skips the JIT, on a launch laid out as the
    compiled path lays it out (the interpreter compiles nothing, so it is set up by hand here)."""
    direct = object.__new__(DirectLaunch)
    direct._template = ["grid", None, N, 3.0, 256]
    direct._slots = {"x_ptr": (0, torch.float32, True, None),
                     "out_ptr": (1, torch.float32, True, None)}
    direct._encoded = {}
    x = torch.zeros(N + 4)
    aligned, out = x[:N], torch.zeros(N)
    assert direct._values(dict(x_ptr=aligned, out_ptr=out)) == [aligned.data_ptr(),
                                                                 out.data_ptr(), N, 3.0, 256]
    # 4 bytes off: not 16-aligned
    assert direct._values(dict(x_ptr=x[1:N + 1], out_ptr=out)) is None
    assert direct._values(dict(x_ptr=aligned.half(), out_ptr=out)) is None  # another dtype
    direct.device = -1
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    # a profiler's hook must see it: the call is refused before anything else is looked at
    assert direct(dict(x_ptr=aligned, out_ptr=out)) is False


def test_a_descriptor_is_encoded_once_while_the_same_one_comes_back(monkeypatch):
    """Weights' descriptors are cached objects: their tensor maps are encoded on first sight only;
    a new descriptor object (a moved weight, an activation's per-call one) is encoded anew."""
    import moe_triton.launch as launch

    encoded = []
    monkeypatch.setattr(launch, "_make_tensordesc_arg",
                        lambda descriptor, meta: encoded.append(descriptor) or [id(descriptor)])
    direct = object.__new__(DirectLaunch)
    direct._template, direct._encoded = [None, None], {}
    direct._slots = {"w_desc": (0, None, False, (None,)), "out_ptr": (1, torch.float32, True, None)}
    out = torch.zeros(4)
    first, second = object.__new__(Held), object.__new__(Held)
    for descriptor in (first, first, second, second, first):
        assert direct._values(dict(w_desc=descriptor, out_ptr=out)) == [id(descriptor),
                                                                       out.data_ptr()]
    assert encoded == [first, second, first]


class Held:
    """A stand-in descriptor: any object a weak reference can hold."""


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


def test_arrival_counters_are_zero_aligned_and_never_shared(monkeypatch):
    monkeypatch.setattr(launch_module, "_COUNTER_CHUNKS", {})
    monkeypatch.setattr(launch_module, "COUNTER_CHUNK", 64)
    cpu = torch.device("cpu")
    taken = [arrival_counters(n, cpu) for n in (3, 16, 1, 5)]
    starts = [t.data_ptr() for t in taken]
    assert all(t.dtype == torch.int32 and not t.any() for t in taken)
    assert all(start % 16 == 0 for start in starts)
    for t in taken:
        t.fill_(7)  # a plan's own: writing one touches no other
    assert [t.tolist() for t in taken] == [[7] * t.numel() for t in taken]
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in taken)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    # the chunk ran low (under a quarter left): a fresh one, zeroed, the old counters kept
    more = arrival_counters(40, cpu)
    assert not more.any() and more.untyped_storage().data_ptr() != \
        taken[0].untyped_storage().data_ptr()
    assert taken[0].tolist() == [7, 7, 7]


def test_a_full_chunk_outlives_the_plans_that_took_its_counters(monkeypatch):
    """A captured graph keeps writing the counters of a plan the cache has let go: the chunk they
    were cut from is never freed, even once no plan refers to it."""
    monkeypatch.setattr(launch_module, "_COUNTER_CHUNKS", {})
    monkeypatch.setattr(launch_module, "_FULL_CHUNKS", [])
    monkeypatch.setattr(launch_module, "COUNTER_CHUNK", 64)
    cpu = torch.device("cpu")
    counters = arrival_counters(8, cpu)
    chunk = weakref.ref(launch_module._COUNTER_CHUNKS[cpu][0])
    arrival_counters(60, cpu)  # a fresh chunk
    del counters
    gc.collect()
    assert chunk() is not None


class Scratch:
    def __init__(self, holds_scratch: bool):
        self.holds_scratch = holds_scratch


def test_the_cache_evicts_the_oldest_plan_that_holds_no_scratch():
    """A graph captured through a plan with scratch writes it at each replay: such plans stay
    however full the cache; the others go oldest first."""
    cache = PlanCache(size=3)
    plans = {name: cache.add(name, Scratch(name.startswith("scratch")))
             for name in ("scratch 1", "plain 1", "scratch 2")}
    cache.add("plain 2", Scratch(False))  # evicts plain 1, the oldest without scratch
    assert cache.get("plain 1") is None
    assert cache.get("scratch 1") is plans["scratch 1"] and cache.get("scratch 2") is plans[
        "scratch 2"]
    for i in range(4):  # past its size: plain 2 goes, every scratch plan stays
        cache.add(f"scratch {3 + i}", Scratch(True))
    assert all(cache.get(f"scratch {i}") is not None for i in range(1, 7))
    assert cache.get("plain 2") is None


@pytest.mark.gpu
def test_arrival_counters_asked_for_inside_a_capture_come_from_outside_it(monkeypatch):
    monkeypatch.setattr(launch_module, "_COUNTER_CHUNKS", {})
    device = torch.device("cuda", torch.cuda.current_device())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # no chunk yet: refused, not planted in the graph's pool
        with pytest.raises(RuntimeError, match="run the step once eagerly before capturing"):
            arrival_counters(8, device)
    first = arrival_counters(8, device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = arrival_counters(8, device)
    assert inside.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert not inside.any()


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


@triton.jit
def _copy_rows_kernel(in_desc, out_ptr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tile = in_desc.load([tl.program_id(0) * BLOCK, 0])
    tl.store(out_ptr + rows[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :], tile)


@pytest.mark.gpu
def test_descriptor_launches_call_the_c_launcher_and_encode_each_descriptor_once(monkeypatch):
    """On the GPU's Triton the direct path calls the launcher's C function itself; a descriptor
    that comes back (as cached weight descriptors do) is not encoded again, a new one is."""
    import types

    from triton.tools.tensor_descriptor import TensorDescriptor

    import moe_triton.launch as launch_module

    encoded, encode = [], launch_module._make_tensordesc_arg
    monkeypatch.setattr(launch_module, "_make_tensordesc_arg",
                        lambda descriptor, meta: encoded.append(1) or encode(descriptor, meta))
    a, b = (torch.randn(64, 16, device="cuda") for _ in range(2))
    descriptors = {id(t): TensorDescriptor.from_tensor(t, [16, 16]) for t in (a, b)}
    launch = BoundLaunch(_copy_rows_kernel, (4,), dict(BLOCK=16, WIDTH=16))
    for source in (a, a, a, b, b, a):
        out = torch.full_like(source, float("nan"))
        launch(in_desc=descriptors[id(source)], out_ptr=out)
        assert torch.equal(out, source)
    assert isinstance(launch._direct._launch, types.BuiltinFunctionType)
    assert len(encoded) == 3  # a when the direct launch was laid out, then b, then a again


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


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter's lock; compiled launches need none")
def test_threads_calling_the_kernels_at_once_get_what_one_thread_gets(qwen3_checkpoint):
    # The interpreter patches triton.language while a kernel runs: unserialized, two threads broke
    # each other's launches with InterpreterErrors.
    from moe_triton import RoutingSpec, fused_experts, route
    from moe_triton.models import load_model

    E, H, I, K, T = 8, 32, 32, 2, 16
    g = torch.Generator().manual_seed(0)
    w13, w2 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5,
               torch.randn(E, H, I, generator=g) / I**0.5)
    cases = [(torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)) for _ in range(2)]
    models = [load_model(qwen3_checkpoint, dtype=torch.float32) for _ in range(2)]  # one cache each
    prompt = torch.randint(0, 97, (1, 5), generator=g)

    def work(model) -> list[torch.Tensor]:
        results = []
        for x, logits in cases:
            ids, weights = route(logits, RoutingSpec(K, renormalize=True))
            results += [ids, fused_experts(x, w13, w2, ids, weights)]
        return results + [model.generate(prompt, 2)]

    expected = work(models[0])
    outcomes: list = [None, None]

    def run(i):
        try:
            outcomes[i] = work(models[i])
        except Exception as error:  # reported below, with the thread it came from
            outcomes[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for outcome in outcomes:
        assert not isinstance(outcome, Exception), repr(outcome)
        assert all(torch.equal(a, b) for a, b in zip(outcome, expected, strict=True))


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter's lock; compiled launches need none")
def test_every_launched_kernel_is_serialized_under_the_interpreter():
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction

    import moe_triton
    import moe_triton.models

    kernels = []
    for package in (moe_triton, moe_triton.models):
        for info in pkgutil.iter_modules(package.__path__):
            if info.name == "__main__":  # runs the command line
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            kernels += [(f"{module.__name__}.{name}", value) for name, value in vars(module).items()
                        if isinstance(value, InterpretedFunction) and name.endswith("_kernel")]
    assert len(kernels) >= 15
    unmarked = [name for name, kernel in kernels if "run" not in vars(kernel)]
    assert not unmarked, f"launched kernels without @interpreter_serialized: {unmarked}"


def _double_fake(x):
    return torch.empty_like(x)


def _double_setup(ctx, inputs, output):
    pass


def _double_backward(ctx, grad):
    return 2 * grad


@register_op("test_double", _double_fake, backward=_double_backward, setup_context=_double_setup)
def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def test_register_op_gives_the_op_its_fake_and_its_gradient():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert torch.ops.moe_triton.test_double.default is not None
    y = torch.ops.moe_triton.test_double(x)
    torch.testing.assert_close(y, 2 * x.detach(), rtol=0, atol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 2.0), rtol=0, atol=0)
    with FakeTensorMode() as mode:
        fake = torch.ops.moe_triton.test_double(mode.from_tensor(torch.empty(3, 4)))
    assert fake.shape == (3, 4)


def _library_sources():
    from pathlib import Path

    import moe_triton
    import moe_triton.graphs
    import moe_triton.models

    for package in (moe_triton, moe_triton.models, moe_triton.graphs):
        for path in sorted(Path(package.__path__[0]).rglob("*.py")):
            yield path, path.read_text()


def test_ops_register_and_kernels_launch_in_launch_py_only():
    """One helper registers every op (register_op); every kernel launches through a BoundLaunch."""
    import re

    registering = re.compile(r"torch\.library\.(custom_op|triton_op)|\.register_(fake|autograd)\b")
    launching = re.compile(r"\w+_kernel\[[^\]]*\]\(")
    offenders = [f"{path.name}:{number}"
                 for path, text in _library_sources() if path.name != "launch.py"
                 for number, line in enumerate(text.splitlines(), 1)
                 if not line.lstrip().startswith("#")
                 and (registering.search(line) or launching.search(line))]
    assert not offenders, ("register ops with launch.register_op, launch through BoundLaunch: "
                           f"{offenders}")
