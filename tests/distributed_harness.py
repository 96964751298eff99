"""Multi-process harness of the distributed tests: a pool of spawned ranks that run cases in turn.

test_distributed.py runs it on gloo (CPU, kernels under the Triton interpreter) and, in its
tests marked gpu, on NCCL (one GPU per rank). Ranks are spawned once per world size and run
every case sent to them, so process start-up and process-group setup are paid once, not per case.

A case builds full weights and every rank's tokens from seeds, routes the tokens on each rank (so
ranks with no tokens go through routing too), runs `ParallelExperts` on the rank's shard and
compares with `fused_experts_torch` on the full weights: the single-process reference. Two more
kinds of case run the same check one level up: `FusedMoE(parallel=...)` loaded from a full layer's
state dict against that layer, and `load_model(..., parallel=...)` against the same checkpoint
loaded whole (logits and greedy tokens, each rank its own prompt under all-to-all EP).
"""
import contextlib
import dataclasses
import datetime
import os
import queue
import time
import traceback
from dataclasses import dataclass
from functools import partial

import torch
import torch.multiprocessing as mp

if not torch.cuda.is_available():
    # Before `import moe_triton`, in the parent (as conftest does) and in every spawned rank,
    # which imports this module to unpickle its entry point.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import assert_close  # noqa: E402

from moe_triton import (  # noqa: E402
    SILU_AND_MUL,
    Activation,
    ExpertWeights,
    FusedMoE,
    Placement,
    RoutingSpec,
    WeightFormat,
    fused_experts_torch,
    route,
    run_experts,
)
from moe_triton.graphs import capture_graph, capture_mode  # noqa: E402
from moe_triton.parallel import (  # noqa: E402
    Collective,
    ParallelExperts,
    ParallelSpec,
    block_lead,
    new_parallel_groups,
    post_experts_reduction,
    scattered_rows,
    torch_experts,
)
from moe_triton.weights import NATIVE  # noqa: E402

# Every process we start keeps NVLink multicast (NVLS) off, as issue 8 requires on the H200
# machines.
SUBPROCESS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                  "NVSHMEM_DISABLE_NVLS": "1"}
# A case has no wall-clock budget of its own: on a loaded 2-core machine the interpreter makes the
# same case many times slower, so a fixed budget failed cases that were only slow. A case fails when
# a rank reports an error or dies; ranks stuck in a collective report gloo's timeout, long enough
# that a peer merely late under load is not taken for a hang; CASE_LIMIT_S only ends a rank that
# loops outside any collective, far beyond what any case needs.
COLLECTIVE_TIMEOUT_S = 180
CASE_LIMIT_S = 1200
FAILED_PEER_WAIT_S = 3  # once a rank has failed, its peers may be stuck in a collective


@dataclass(frozen=True)
class Case:
    spec: ParallelSpec
    # T per token group: one per EP rank under ALL_TO_ALL (TP peers share), else one
    tokens: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    backend: str = "triton"  # the local experts: "triton" (run_experts) or "torch" (torch_experts)
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 16
    intermediate: int = 10
    activation: Activation = SILU_AND_MUL
    filtered: bool = False  # some ids set to -1 and to E: they must contribute nothing
    huge: bool = False  # positive bf16 outputs near the bf16 maximum, every rank the same tokens
    seed: int = 0
    module: str = "experts"  # what runs sharded: "experts" (ParallelExperts), "fused_moe", "model"
    # module="model": a checkpoint directory; tokens are then prompt lengths
    checkpoint: str | None = None
    weight_format: WeightFormat = NATIVE  # module="fused_moe": the experts quantized to this format
    captured: bool = False  # run in graphs' capture mode (all-to-all EP: the gathered dispatch);
    #                         on CUDA also capture it in a CUDA graph and replay. Unequal tokens:
    #                         the ValueError is checked

    def __str__(self):
        s = self.spec
        parts = [f"ep{s.ep_size}xtp{s.tp_size}", s.dispatch.value if s.ep_size > 1 else "",
                 s.output.value, "T" + "-".join(map(str, self.tokens)),
                 f"E{self.num_experts}K{self.top_k}", str(self.dtype).removeprefix("torch."),
                 self.backend, self.activation.kind.name.lower(),
                 "filtered" if self.filtered else "", "huge" if self.huge else "",
                 self.module if self.module != "experts" else "",
                 "captured" if self.captured else "",
                 str(self.weight_format).split(",")[1].strip().replace(" ", "-")
                 if self.weight_format.fp8 else ""]
        return "-".join(p for p in parts if p)


def _weights(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    E, H, I = case.num_experts, case.hidden, case.intermediate
    rows = 2 * I if case.activation.gated else I
    # all positive: every partial sum stays below the total, so only a double count overflows
    if case.huge:
        return (torch.rand(E, rows, H, generator=g) / H, torch.rand(E, H, I, generator=g) / I,
                torch.randn(E, H, generator=g))
    return (torch.randn(E, rows, H, generator=g) / H**0.5,
            torch.randn(E, H, I, generator=g) / I**0.5,
            torch.randn(E, H, generator=g))


def _tokens(case: Case, ep_rank: int, device) -> torch.Tensor:
    group = ep_rank if case.spec.all_to_all else 0
    g = torch.Generator().manual_seed(1000 * case.seed + 1 + (0 if case.huge else group))
    num_tokens = case.tokens[0 if case.huge else group]
    draw = torch.rand if case.huge else torch.randn
    x = draw(num_tokens, case.hidden, generator=g)  # [T, H]
    return x.to(case.dtype).to(device)  # [T, H]


def run_case(case: Case, groups, device: torch.device) -> None:
    """One rank's part of a case: route, run the parallel experts, compare with the full
    reference."""
    if case.module == "fused_moe":
        return run_fused_moe_case(case, groups, device)
    if case.module == "model":
        return run_model_case(case, groups, device)
    w13, w2, gate = (w.to(case.dtype).to(device) for w in _weights(case))
    x = _tokens(case, groups.ep_rank, device)  # [T, H]
    topk_ids, topk_weights = route(x.float() @ gate.float().T,
                                   RoutingSpec(case.top_k, renormalize=True))  # [T, K]
    if case.filtered:
        topk_ids[::3, 0] = -1
        topk_ids[1::3, -1] = case.num_experts
    # [T, H] float32
    ref = fused_experts_torch(x, w13, w2, topk_ids, topk_weights, activation=case.activation)
    if case.huge:  # outputs peak near 2.5e38: bf16 holds them (max 3.39e38), twice that is inf
        # split over w2 and the weights: each stays finite
        scale = (2.5e38 / ref.abs().max().item()) ** 0.5
        w2, topk_weights = (w2.float() * scale).to(case.dtype), topk_weights * scale
        # [T, H]
        ref = fused_experts_torch(x, w13, w2, topk_ids, topk_weights, activation=case.activation)

    local = run_experts if case.backend == "triton" else torch_experts
    experts = partial(local, activation=case.activation)
    layer = ParallelExperts.from_full(w13, w2, groups, activation=case.activation, experts=experts,
                                      device=device)
    out = _call(case, lambda: layer(x, topk_ids, topk_weights))
    if out is None:
        return
    reduction = post_experts_reduction(case.spec)
    if reduction.collective is Collective.REDUCE_SCATTER:
        group = groups.group(reduction.over)
        size, index = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        ref = ref[list(scattered_rows(len(x), size, index))]  # [<= ceil(T / W), H]
    assert out.dtype == case.dtype
    _compare(out, ref, case.dtype)
    if case.huge:
        assert torch.isfinite(out).all(), "the correct reduction overflowed"
        # The bug the reduction table prevents: one more all-reduce of an output that is already
        # complete (after a reducing combine, or a second time). Every rank holds the same tokens
        # here.
        doubled = out.clone()
        torch.distributed.all_reduce(doubled, group=groups.moe)
        assert torch.isinf(doubled).any(), ("a double count should overflow bf16 here; "
                                            "the case does not test it")


def run_fused_moe_case(case: Case, groups, device: torch.device) -> None:
    """FusedMoE(parallel=groups) given a full layer's state dict equals that layer on this rank's
    tokens. FP8 (`case.weight_format`): the full layer runs on the same backend as the shards, and
    its scales are cut with the weights on load."""
    w13, w2, gate = _weights(case)
    dims = (case.num_experts, case.top_k, case.hidden, case.intermediate)
    kwargs = dict(routing=RoutingSpec(case.top_k, renormalize=True, routed_scaling_factor=1.5),
                  activation=case.activation, dtype=case.dtype, device=device,
                  weight_format=case.weight_format)
    fp8 = case.weight_format.fp8 is not None
    full = FusedMoE(*dims, placement=Placement(case.backend if fp8 else "torch"), **kwargs)
    tensors = {"gate_weight": gate, "gate_up_proj": w13, "down_proj": w2}
    if fp8:
        fmt = case.weight_format
        experts = ExpertWeights(w13, w2, case.activation.gated).to_format(
            WeightFormat.fp8_tensor() if fmt.static_input else fmt)
        tensors.update(gate_up_proj=experts.w13, down_proj=experts.w2,
                       gate_up_proj_scale=experts.w13_scale,
                       down_proj_scale=experts.w2_scale)
        if fmt.static_input:
            tensors["input_scale"] = torch.tensor([3.0 / 448])
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(full, name).copy_(value)
    sharded = FusedMoE(*dims, placement=Placement(case.backend, parallel=groups), **kwargs)
    # full-size experts (and scales) in, this rank's shard kept
    sharded.load_state_dict(full.state_dict())
    assert sharded.gate_up_proj.shape[0] == case.num_experts // case.spec.ep_size
    lead = block_lead(case.weight_format, case.intermediate, case.spec, groups.rank)
    assert sharded.down_proj.shape[2] == case.intermediate // case.spec.tp_size + lead
    x = _tokens(case, groups.ep_rank, device)  # [T, H]
    out = _call(case, lambda: sharded(x))
    if out is None:
        return
    with torch.inference_mode():
        ref = full(x)
    assert out.dtype == case.dtype
    _compare(out, ref.float(), case.dtype)


def _call(case: Case, forward):
    """forward() under inference mode; a captured case runs it in capture mode, and on CUDA also
    replays it from a CUDA graph (which must equal the eager call bit for bit). None when the case
    expects the gathered dispatch's ValueError (unequal tokens per rank) and every rank got it."""
    with torch.inference_mode():
        if not case.captured:
            return forward()
        with capture_mode():
            try:
                eager = forward()  # outside a capture: the rows-per-rank rule is checked here
            except ValueError as error:
                assert (len(set(case.tokens)) > 1
                        and "same number of rows on every EP rank" in str(error)), error
                return None
            assert len(set(case.tokens)) == 1, "unequal rows per EP rank must be refused"
            if not eager.is_cuda:
                return eager
            # a warm-up output, then the captured one, which capture_graph's replay fills
            outputs = []
            capture_graph(lambda _: outputs.append(forward()), 1)
        assert torch.equal(outputs[-1], eager), ("the replayed graph differs from the eager "
                                                 "gathered call")
        return outputs[-1]


def run_model_case(case: Case, groups, device: torch.device) -> None:
    """load_model(parallel=groups) equals the whole checkpoint: prefill logits and greedy tokens."""
    from moe_triton.models import load_model

    model = load_model(case.checkpoint, dtype=case.dtype, device=device, backend=case.backend,
                       parallel=groups)
    whole = load_model(case.checkpoint, dtype=case.dtype, device=device, backend="torch")
    # the torch reference syncs with the host; the sharded model is captured where it can be
    whole.use_graphs = False
    # all-to-all EP: every rank its own prompt
    group = groups.ep_rank if case.spec.all_to_all else 0
    g = torch.Generator().manual_seed(100 + group)
    prompt = torch.randint(0, model.config.vocab_size, (2, case.tokens[group]),
                           generator=g).to(device)
    for lm in (model, whole):
        lm.setup(max_batch=2, max_seq=32)
    # all-to-all EP too: gathered, in lockstep
    assert (model.graphs is not None) == (device.type == "cuda")
    if model.graphs is not None:
        assert model.graphs.config.lockstep == case.spec.all_to_all
    with torch.inference_mode():
        _compare(model.prefill(prompt), whole.prefill(prompt).float(), case.dtype)
    # CPU: prefill's token and one decode step's (a step costs every rank a step of both models
    # under the interpreter); through CUDA graphs a third token, so that a replay follows a replay
    new_tokens = 3 if model.graphs is not None else 2
    assert torch.equal(model.generate(prompt, max_new_tokens=new_tokens),
                       whole.generate(prompt, max_new_tokens=new_tokens))


def _compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype is torch.bfloat16 or (out.is_cuda and dtype is torch.float16):
        # Real sizes in half precision: relative error in norm, as test_pipeline.py's GPU tests
        # (in float64: 1e38 squared fits)
        assert out.shape == ref.shape and torch.isfinite(out).all()
        err = (out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-300)
        assert err.item() < 1e-2, f"{dtype} relative error {err.item():.2e}"
    else:
        assert_close(out, ref, dtype, scale=2)


def _worker(rank: int, world_size: int, backend: str, init_file: str, tasks, results) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            device_id=device if device.type == "cuda" else None)
    groups_by_size = {}  # groups depend on (ep_size, tp_size) only; the spec rides along
    while (case := tasks.get()) is not None:
        try:
            sizes = (case.spec.ep_size, case.spec.tp_size)
            if sizes not in groups_by_size:
                groups_by_size[sizes] = new_parallel_groups(case.spec)
            run_case(case, dataclasses.replace(groups_by_size[sizes], spec=case.spec), device)
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    # spawn hands the children the parent's os.environ as it is at Process.start()
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


class RankPool:
    """`world_size` spawned ranks in one process group; `run(case)` runs a case on all of them."""

    def __init__(self, world_size: int, backend: str, init_file: str):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        env = dict(SUBPROCESS_ENV)
        if backend == "gloo" and not torch.cuda.is_available():
            env["TRITON_INTERPRET"] = "1"
        with _environment(env):
            self.processes = [ctx.Process(target=_worker,
                                          args=(rank, world_size, backend, init_file,
                                                self.tasks[rank], self.results), daemon=True)
                              for rank in range(world_size)]
            for p in self.processes:
                p.start()
        self.open = True

    def run(self, case: Case) -> None:
        for tasks in self.tasks:
            tasks.put(case)
        errors, pending, stuck = [], self.world_size, ""
        start = failed_at = time.monotonic()
        while pending and not stuck:
            try:
                rank, error = self.results.get(timeout=1)
            except queue.Empty:
                dead = [rank for rank, p in enumerate(self.processes) if not p.is_alive()]
                if errors and time.monotonic() - failed_at > FAILED_PEER_WAIT_S:
                    stuck = (f"{pending} rank(s) had not finished {FAILED_PEER_WAIT_S} s "
                             "after a failure")
                elif dead:
                    stuck = (f"rank(s) {dead} died "
                             f"(exit codes {[self.processes[r].exitcode for r in dead]})")
                elif time.monotonic() - start > CASE_LIMIT_S:
                    stuck = f"{pending} rank(s) had not finished after {CASE_LIMIT_S} s"
                continue
            pending -= 1
            if error:
                errors.append(f"--- rank {rank} ---\n{error}")
                failed_at = time.monotonic()
        if errors or stuck:
            # ranks may be out of step in their collectives: start afresh next time
            self.close(kill=True)
            raise AssertionError("\n".join([str(case), *sorted(errors), stuck]))

    def close(self, kill: bool = False) -> None:
        if not self.open:
            return
        self.open = False
        for p, tasks in zip(self.processes, self.tasks, strict=True):
            if kill:
                p.terminate()
            elif p.is_alive():
                tasks.put(None)
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


@contextlib.contextmanager
def rank_pools(tmp_path_factory, backend: str):
    """get(world_size): a live RankPool on `backend`, started on first use and again after a
    failure."""
    live: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in live or not live[world_size].open:
            init_file = tmp_path_factory.mktemp(backend) / "init"
            live[world_size] = RankPool(world_size, backend, str(init_file))
        return live[world_size]

    try:
        yield get
    finally:
        for pool in live.values():
            pool.close()
