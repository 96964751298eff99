"""Stage 1, routing: logits [T, E] -> topk_ids [T, K] int32, topk_weights [T, K] float32.

One Triton kernel per `RoutingSpec` (`route`), a torch reference (`route_torch`), one wrapper per
transformers router; all in float32. A row's ids are distinct, in [0, E), by descending key (as
torch.topk sorted=True), ties to the smaller index. A NaN key ranks below -inf, so NaN never yields
a bad or repeated id (a softmax row holding NaN is all NaN and routes to experts 0..K-1). The
renormalising + 1e-20 (NemotronH's 0 / 0 guard) changes float32 results only for sums < ~2e-13.

With a `RouteTape`, the same launch also records each token's ids in the tape and, where the token
replays, takes them from it instead, weighted by the same rule (a model's routing capture/replay).
"""
import enum
import math
import numbers
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import checks
from .launch import BoundLaunch, PlanCache, interpreter_serialized, register_op
from .linear import dense
from .platform import dependent_launch, interpreter_hint, triton_can_run_on, wait_then_release
from .weights import tensor_signature


class Scoring(enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class SelectOn(enum.Enum):
    SCORES = "scores"  # score all E experts, then choose the top k (plus correction bias if given)
    LOGITS = "logits"  # choose the top k on raw logits, then score only those k


@dataclass(frozen=True)
class RoutingSpec:
    top_k: int  # experts per token
    scoring: Scoring = Scoring.SOFTMAX
    select_on: SelectOn = SelectOn.SCORES
    renormalize: bool = False  # divide the k weights by their sum
    # grouped top-k (DeepSeek-V3): n_group contiguous groups, scored by their 2 best keys, and
    # only the topk_group best groups compete
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the final weights, after renormalisation
    correction_bias: bool = False  # per-expert bias on the scores, for selection only
    router_in_float32: bool = False  # router GEMM in float32 (NemotronH); read by the layer

    def __post_init__(self):
        if not isinstance(self.scoring, Scoring) or not isinstance(self.select_on, SelectOn):
            raise ValueError(f"RoutingSpec.scoring / select_on must be Scoring / SelectOn members, "
                             f"got {self}")
        for name in ("top_k", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"RoutingSpec.{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy integer -> int (a kernel constexpr)
        factor = self.routed_scaling_factor
        if (not isinstance(factor, numbers.Real) or isinstance(factor, bool)
                or not math.isfinite(factor)):
            raise ValueError(f"RoutingSpec.routed_scaling_factor must be a finite number, "
                             f"got {factor!r}")
        if self.top_k < 1:
            raise ValueError(f"RoutingSpec.top_k must be >= 1, got {self.top_k}")
        if self.n_group < 1:
            raise ValueError(f"RoutingSpec.n_group must be >= 1 (1 disables grouping), "
                             f"got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"RoutingSpec.topk_group must lie in [1, n_group={self.n_group}], "
                             f"got {self.topk_group}")
        if self.correction_bias and self.select_on is not SelectOn.SCORES:
            raise ValueError("RoutingSpec.correction_bias is added to scores; "
                             "it needs select_on=SelectOn.SCORES")

    def kernel_args(self) -> dict:
        return dict(TOP_K=self.top_k, K_PAD=triton.next_power_of_2(self.top_k),
                    SIGMOID=self.scoring is Scoring.SIGMOID,
                    SELECT_ON_LOGITS=self.select_on is SelectOn.LOGITS,
                    HAS_BIAS=self.correction_bias,
                    RENORMALIZE=self.renormalize, N_GROUP=self.n_group,
                    G_PAD=triton.next_power_of_2(self.n_group), TOPK_GROUP=self.topk_group,
                    routed_scaling_factor=float(self.routed_scaling_factor))


@dataclass(frozen=True)
class RouteConfig:
    block_t: int  # tokens per program, a power of two
    num_warps: int = 4

    def kernel_args(self) -> dict:
        return dict(BLOCK_T=self.block_t)

    def launch_options(self) -> dict:
        return dict(num_warps=self.num_warps)


@dataclass(frozen=True)
class RouteTape:
    """Where `route` records each token's ids and replays them from: token t's row of `ids` is
    rows[t]; it runs that row's ids instead of its top-k where replay[t] and the row holds ids
    (a row of -1 routes freely), then its row holds the ids it ran."""

    ids: torch.Tensor  # [R, K] int32, contiguous
    rows: torch.Tensor  # [T] int64, in [0, R)
    replay: torch.Tensor  # [T] bool


def route_config(num_tokens: int, num_experts: int) -> RouteConfig:
    """One token a warp (a warp per 1024 experts past that), up to four tokens a program: the
    top-k's K rounds of reductions are the kernel's time, and a row spread over warps pays a
    shared-memory round trip in each. On the H200 at E = 128 (48 launches chained by PDL): one
    token a warp 2.8-3.0 us a launch at any batch, where 32 tokens over 4 warps took 14.3 and
    one token over 4 warps 4.0 (docs/PERFORMANCE.md, issue 30)."""
    tokens = min(4, triton.next_power_of_2(num_tokens))
    warps_per_token = max(1, triton.next_power_of_2(num_experts) // 1024)
    return RouteConfig(block_t=tokens, num_warps=min(8, tokens * warps_per_token))


@triton.jit
def _take_max(keys, available, cols, PAD: tl.constexpr):
    # Row max of the available keys and the smallest column holding it. Keys must be NaN-free;
    # when every available key is -inf, all available columns match, so the result stays in range.
    masked = tl.where(available, keys, float("-inf"))
    best = tl.max(masked, axis=1)
    return best, tl.min(tl.where(available & (masked == best[:, None]), cols, PAD), axis=1)


@interpreter_serialized
@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, topk_ids_ptr, topk_weights_ptr, tape_ids_ptr, tape_rows_ptr,
    tape_replay_ptr,
    num_tokens, num_experts, stride_logits_t, stride_logits_e, routed_scaling_factor,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr, SELECT_ON_LOGITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TAPE: tl.constexpr,  # record into (and replay from) a RouteTape
    CHAINED: tl.constexpr,  # behind the router's projection (PDL); expand or the up GEMM next
):
    wait_then_release(CHAINED)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, E_PAD)[None, :]  # [1, E_PAD]
    kcols = tl.arange(0, K_PAD)[None, :]  # [1, K_PAD]
    row_ok = rows[:, None] < num_tokens
    col_ok = cols < num_experts
    k_ok = kcols < TOP_K
    if TAPE:
        tape_rows = tl.load(tape_rows_ptr + rows, mask=rows < num_tokens, other=0)  # [BLOCK_T]
        tape_offsets = tape_rows[:, None] * TOP_K + kcols  # [BLOCK_T, K_PAD]
        given = tl.load(tape_ids_ptr + tape_offsets, mask=row_ok & k_ok, other=-1)
        replaying = ((tl.load(tape_replay_ptr + rows, mask=rows < num_tokens, other=0) != 0)
                     & (tl.max(tl.where(kcols == 0, given, -1), axis=1) >= 0))  # [BLOCK_T]
    offsets = rows[:, None].to(tl.int64) * stride_logits_t + cols * stride_logits_e
    x = tl.load(logits_ptr + offsets, mask=row_ok & col_ok,
                other=0.0).to(tl.float32)  # [BLOCK_T, E_PAD]
    x = tl.where(col_ok, x, float("-inf"))  # padded experts: softmax weight 0, sigmoid 0

    if SELECT_ON_LOGITS:
        key, weight_src = x, x  # only the k chosen logits get scored, after selection
    else:
        if SIGMOID:
            scores = tl.sigmoid(x)
        else:  # the max ignores NaN (as on GPU); a NaN anywhere still makes the row's scores NaN
            e = tl.exp(x - tl.max(x, axis=1)[:, None])
            scores = e / tl.sum(e, axis=1)[:, None]  # [BLOCK_T, E_PAD]
        key, weight_src = scores, scores
        if HAS_BIAS:  # the bias steers selection only; weights stay unbiased
            key = scores + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    key = tl.where(key == key, key, float("-inf"))  # NaN ranks below every number
    available = tl.broadcast_to(col_ok, [BLOCK_T, E_PAD])  # padded experts are never chosen

    if N_GROUP > 1:
        group = cols // (num_experts // N_GROUP)  # [1, E_PAD]
        gcols = tl.arange(0, G_PAD)[None, :]  # [1, G_PAD]
        group_scores = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_group = available & (group == g)
            first, first_col = _take_max(key, in_group, cols, E_PAD)  # [BLOCK_T]
            second, _ = _take_max(key, in_group & (cols != first_col[:, None]), cols, E_PAD)
            group_scores = tl.where(gcols == g, (first + second)[:, None],
                                    group_scores)  # [BLOCK_T, G_PAD]
        group_free = tl.broadcast_to(gcols < N_GROUP, [BLOCK_T, G_PAD])
        in_kept = tl.zeros([BLOCK_T, E_PAD], tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, kept = _take_max(group_scores, group_free, gcols, G_PAD)  # [BLOCK_T]
            group_free = group_free & (gcols != kept[:, None])
            in_kept = in_kept | (group == kept[:, None])
        available = available & in_kept

    topk_ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    topk_weights = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    for j in range(TOP_K):
        _, pick = _take_max(key, available, cols, E_PAD)  # [BLOCK_T]
        if TAPE:  # a replayed id is weighted from the same scores as a chosen one
            pick = tl.where(replaying, tl.max(tl.where(kcols == j, given, -1), axis=1), pick)
        chosen = cols == pick[:, None]  # [BLOCK_T, E_PAD], one True per row
        available = available & ~chosen
        value = tl.sum(tl.where(chosen, weight_src, 0.0), axis=1)  # [BLOCK_T]
        topk_ids = tl.where(kcols == j, pick[:, None], topk_ids)
        topk_weights = tl.where(kcols == j, value[:, None], topk_weights)  # [BLOCK_T, K_PAD]

    if SELECT_ON_LOGITS:
        if SIGMOID:
            topk_weights = tl.sigmoid(topk_weights)
        else:
            e = tl.exp(topk_weights
                       - tl.max(tl.where(k_ok, topk_weights, float("-inf")), axis=1)[:, None])
            e = tl.where(k_ok, e, 0.0)
            topk_weights = e / tl.sum(e, axis=1)[:, None]
    if RENORMALIZE:
        topk_weights = topk_weights / (tl.sum(tl.where(k_ok, topk_weights, 0.0), axis=1)[:, None]
                                       + 1e-20)
    topk_weights = topk_weights * routed_scaling_factor

    out_offsets = rows[:, None] * TOP_K + kcols
    tl.store(topk_ids_ptr + out_offsets, topk_ids, mask=row_ok & k_ok)
    tl.store(topk_weights_ptr + out_offsets, topk_weights, mask=row_ok & k_ok)
    if TAPE:
        tl.store(tape_ids_ptr + tape_offsets, topk_ids, mask=row_ok & k_ok)


def router_logits(hidden_states: torch.Tensor, gate_weight: torch.Tensor, spec: RoutingSpec,
                  gate_bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden_states (T, H) @ gate_weight (E, H).T (+ gate_bias (E,), gpt-oss) -> logits (T, E),
    float32 if the spec says; by `linear.dense` (batch-invariant mode: `linear.linear`, whose
    rows never depend on the others; batch-1 decode: gemv)."""
    if spec.router_in_float32:
        x, w = hidden_states.float(), gate_weight.float()
        b = gate_bias.float() if gate_bias is not None else None
    else:
        x, w, b = hidden_states.to(gate_weight.dtype), gate_weight, gate_bias
    return dense(x, w, b)


def route(logits, spec: RoutingSpec, correction_bias=None, *, out=None,
          config: RouteConfig | None = None, tape: RouteTape | None = None):
    """logits (T, E) -> (topk_ids (T, K) int32, topk_weights (T, K) float32), into `out` if given
    (CUDA-graph buffers); `config` overrides tiles (tests); `tape` records and replays (module
    docstring). Under torch.compile / torch.export, or with grad needed, it is the op
    torch.ops.moe_triton.route (fresh outputs; backward below), a tape applied after it in torch."""
    if torch.compiler.is_compiling():
        if out is not None or config is not None:
            raise ValueError("route(out=..., config=...) writes caller buffers / overrides tiles "
                             "eagerly; under torch.compile or torch.export call it without them "
                             "(outputs are fresh)")
        routed = torch.ops.moe_triton.route(logits, correction_bias, *_spec_fields(spec))
        return routed if tape is None else apply_tape_torch(logits, *routed, spec, tape)
    if checks.grad_needed(logits):
        if out is not None or config is not None:
            raise ValueError("route(out=..., config=...) has no backward; with gradients needed "
                             "(grad mode on, the logits requiring grad) call it without them, or "
                             "under torch.no_grad()")
        _check_inputs(logits, spec, correction_bias, None, tape)
        checks.not_capturing("route")
        routed = torch.ops.moe_triton.route(logits, correction_bias, *_spec_fields(spec))
        return routed if tape is None else apply_tape_torch(logits, *routed, spec, tape)
    _check_inputs(logits, spec, correction_bias, out, tape)
    signature = (tensor_signature(logits), spec, tensor_signature(correction_bias), config,
                 tape is not None)
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.add(signature, plan_route(logits, spec, config, tape is not None))
    return plan(logits, correction_bias, out, tape)


@dataclass(frozen=True)
class RoutePlan:
    """`route` for one signature (the logits' metadata, the spec, the tiles), launch bound once."""

    num_tokens: int  # T
    top_k: int  # K
    launch: BoundLaunch | None  # None: no tokens

    def __call__(self, logits, correction_bias, out, tape: RouteTape | None = None):
        if out is None:
            out = (
                torch.empty(self.num_tokens, self.top_k, dtype=torch.int32,
                            device=logits.device),  # [T, K]
                torch.empty(self.num_tokens, self.top_k, dtype=torch.float32,
                            device=logits.device),  # [T, K]
            )
        if self.launch is not None:
            # never read when HAS_BIAS is off
            bias = correction_bias if correction_bias is not None else out[1]
            # never read without a tape (TAPE off)
            ids, rows, replay = (tape.ids, tape.rows, tape.replay) if tape else (out[0],) * 3
            self.launch(logits_ptr=logits, bias_ptr=bias, topk_ids_ptr=out[0],
                        topk_weights_ptr=out[1], tape_ids_ptr=ids, tape_rows_ptr=rows,
                        tape_replay_ptr=replay)
        return out


def plan_route(logits: torch.Tensor, spec: RoutingSpec, config: RouteConfig | None = None,
               tape: bool = False) -> RoutePlan:
    """The plan of `route(logits, spec, config=config)` for checked arguments (with a RouteTape
    at each call where `tape`)."""
    num_tokens, num_experts = logits.shape
    if num_tokens == 0:
        return RoutePlan(0, spec.top_k, None)
    config = config or route_config(num_tokens, num_experts)
    fixed = dict(num_tokens=num_tokens, num_experts=num_experts, stride_logits_t=logits.stride(0),
                 stride_logits_e=logits.stride(1), E_PAD=triton.next_power_of_2(num_experts),
                 **spec.kernel_args(), **config.kernel_args(), TAPE=tape,
                 CHAINED=dependent_launch(logits.device))
    grid = (triton.cdiv(num_tokens, config.block_t),)
    return RoutePlan(num_tokens, spec.top_k,
                     BoundLaunch(_route_kernel, grid, fixed, config.launch_options()))


_PLANS = PlanCache()


# ---- the op torch.compile and torch.export see: one opaque node, a fake for its shapes ----------

_SCORING, _SELECT_ON = list(Scoring), list(SelectOn)


def _spec_fields(spec: RoutingSpec) -> tuple:
    """A RoutingSpec as the op's plain arguments (its bias flag travels as the bias tensor)."""
    return (spec.top_k, _SCORING.index(spec.scoring), _SELECT_ON.index(spec.select_on),
            spec.renormalize, spec.n_group, spec.topk_group, float(spec.routed_scaling_factor))


def _spec_of(correction_bias, top_k, scoring, select_on, renormalize, n_group, topk_group,
             routed_scaling_factor) -> RoutingSpec:
    return RoutingSpec(top_k, _SCORING[scoring], _SELECT_ON[select_on], renormalize, n_group,
                       topk_group, routed_scaling_factor,
                       correction_bias=correction_bias is not None)


def _route_fake(logits, correction_bias, top_k, *spec):
    return (logits.new_empty(logits.shape[0], top_k, dtype=torch.int32),
            logits.new_empty(logits.shape[0], top_k, dtype=torch.float32))


def _route_setup_context(ctx, inputs, output):
    ctx.spec = _spec_of(*inputs[1:])
    ctx.save_for_backward(inputs[0], output[0])


def _route_backward(ctx, grad_ids, grad_weights):
    # the weights are smooth in the logits at the chosen ids (the bias only steers the choice)
    logits, topk_ids = ctx.saved_tensors
    with torch.enable_grad():
        x = logits.detach().requires_grad_()
        (grad_logits,) = torch.autograd.grad(topk_weights_torch(x, topk_ids, ctx.spec), x,
                                             grad_weights)
    return grad_logits, None, None, None, None, None, None, None, None


@register_op("route", _route_fake, backward=_route_backward, setup_context=_route_setup_context)
def _route_op(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, scoring: int,
              select_on: int, renormalize: bool, n_group: int, topk_group: int,
              routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _spec_of(correction_bias, top_k, scoring, select_on, renormalize, n_group, topk_group,
                    routed_scaling_factor)
    return route(logits, spec, correction_bias)


LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_inputs(logits, spec, correction_bias, out, tape=None):
    if not isinstance(spec, RoutingSpec):
        raise ValueError(f"spec must be a RoutingSpec, got {type(spec).__name__}")
    if (not isinstance(logits, torch.Tensor) or logits.dim() != 2
            or logits.dtype not in LOGIT_DTYPES):
        raise ValueError(f"logits must be a 2-D tensor of shape (T, E) in one of {LOGIT_DTYPES}; "
                         f"got {_describe(logits)}")
    if not triton_can_run_on(logits.device):
        raise ValueError(f"the routing kernel cannot run on {logits.device}: move the logits to a "
                         f"CUDA device, {interpreter_hint()}, or use route_torch "
                         "(the torch backend)")
    num_tokens, num_experts = logits.shape
    if num_experts < 1:
        raise ValueError("logits must have at least one expert column (E >= 1); "
                         "got shape (T, 0)")
    if spec.top_k > num_experts:
        raise ValueError(f"top_k={spec.top_k} exceeds the number of experts E={num_experts}; "
                         "lower top_k")
    if spec.n_group > 1:
        if num_experts % spec.n_group:
            raise ValueError(f"n_group={spec.n_group} must divide E={num_experts}")
        if num_experts // spec.n_group < 2:
            raise ValueError(f"n_group={spec.n_group} leaves groups of "
                             f"{num_experts // spec.n_group} expert; groups are scored by their 2 "
                             "best experts, so use n_group <= E // 2")
        if spec.top_k > spec.topk_group * (num_experts // spec.n_group):
            raise ValueError(f"top_k={spec.top_k} exceeds the "
                             f"{spec.topk_group * (num_experts // spec.n_group)} experts in "
                             f"topk_group={spec.topk_group} groups; raise topk_group or lower "
                             "top_k")
    if (correction_bias is not None) != spec.correction_bias:
        raise ValueError(f"correction_bias is "
                         f"{'given' if correction_bias is not None else 'missing'} but "
                         f"RoutingSpec.correction_bias={spec.correction_bias}: pass the bias "
                         "tensor exactly when the spec says the router has one")
    if correction_bias is not None:
        if (not isinstance(correction_bias, torch.Tensor)
                or correction_bias.shape != (num_experts,)
                or not correction_bias.dtype.is_floating_point
                or correction_bias.device != logits.device
                or not correction_bias.is_contiguous()):
            raise ValueError(f"correction_bias must be a contiguous floating-point tensor of shape "
                             f"({num_experts},) on {logits.device}; "
                             f"got {_describe(correction_bias)}")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError("out must be a (topk_ids, topk_weights) pair")
        for name, buf, dtype in (("out[0] (topk_ids)", out[0], torch.int32),
                                 ("out[1] (topk_weights)", out[1], torch.float32)):
            if (not isinstance(buf, torch.Tensor) or buf.shape != (num_tokens, spec.top_k)
                    or buf.dtype != dtype or buf.device != logits.device
                    or not buf.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape "
                                 f"({num_tokens}, {spec.top_k}) on {logits.device}; "
                                 f"got {_describe(buf)}")
    if tape is not None:
        _check_tape(tape, num_tokens, spec.top_k, logits.device)


def _check_tape(tape, num_tokens: int, top_k: int, device) -> None:
    if not isinstance(tape, RouteTape):
        raise ValueError(f"tape must be a RouteTape, got {type(tape).__name__}")
    rows = tape.ids.shape[0] if isinstance(tape.ids, torch.Tensor) else None  # R: any
    for name, t, dtype, shape in (("ids", tape.ids, torch.int32, (rows, top_k)),
                                  ("rows", tape.rows, torch.int64, (num_tokens,)),
                                  ("replay", tape.replay, torch.bool, (num_tokens,))):
        if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype
                or t.device != device or not t.is_contiguous()):
            want = f"(R, {top_k})" if name == "ids" else f"({num_tokens},)"
            raise ValueError(f"tape.{name} must be a contiguous {dtype} tensor of shape {want} "
                             f"on {device} (one row per token of the logits); "
                             f"got {_describe(t)}")


def _describe(t):
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return (f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
            + ("" if t.is_contiguous() else " (non-contiguous)"))


def route_torch(logits, spec: RoutingSpec, correction_bias=None, tape: RouteTape | None = None):
    """Pure-torch reference of `route`: same op, float32, torch.topk."""
    x = logits.float()  # [T, E]
    num_tokens, num_experts = x.shape
    if tape is not None:
        _check_tape(tape, num_tokens, spec.top_k, x.device)
    scores = x.sigmoid() if spec.scoring is Scoring.SIGMOID else x.softmax(dim=-1)  # [T, E]
    key = x if spec.select_on is SelectOn.LOGITS else scores
    if correction_bias is not None:
        key = key + correction_bias.float()  # [T, E]
    if spec.n_group > 1:
        grouped = key.view(num_tokens, spec.n_group, num_experts // spec.n_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(spec.topk_group, dim=-1).indices, True)  # [T, G]
        key = key.masked_fill(~kept.repeat_interleave(num_experts // spec.n_group, dim=1),
                              float("-inf"))
    topk_ids = key.topk(spec.top_k, dim=-1).indices  # [T, K]
    routed = topk_ids.to(torch.int32), topk_weights_torch(x, topk_ids, spec)
    return routed if tape is None else apply_tape_torch(x, *routed, spec, tape)


def apply_tape_torch(logits, topk_ids, topk_weights, spec: RoutingSpec, tape: RouteTape):
    """A tape's replay and record, in torch, on routed (T, K) ids and weights."""
    given = tape.ids[tape.rows]  # [T, K]
    replay = tape.replay[:, None] & (given[:, :1] >= 0)  # [T, 1]
    ids = torch.where(replay, given, topk_ids.to(torch.int32))
    weights = torch.where(replay, topk_weights_torch(logits, ids, spec), topk_weights)
    tape.ids[tape.rows] = ids
    return ids, weights


def topk_weights_torch(logits, topk_ids, spec: RoutingSpec):
    """Weights (T, K) float32 of the chosen experts from logits (T, E); route's backward."""
    x = logits.float()  # [T, E]
    topk_ids = topk_ids.long()
    if spec.select_on is SelectOn.LOGITS:
        chosen = x.gather(1, topk_ids)  # [T, K]
        topk_weights = (chosen.sigmoid() if spec.scoring is Scoring.SIGMOID
                        else chosen.softmax(dim=-1))
    else:
        scores = x.sigmoid() if spec.scoring is Scoring.SIGMOID else x.softmax(dim=-1)  # [T, E]
        topk_weights = scores.gather(1, topk_ids)  # [T, K]
    if spec.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * spec.routed_scaling_factor


def softmax_topk(logits, top_k, renormalize=False, *, out=None):
    """transformers `Qwen3MoeTopKRouter`: softmax over E, top-k, `norm_topk_prob` renormalises."""
    return route(logits, RoutingSpec(top_k, Scoring.SOFTMAX, SelectOn.SCORES, renormalize),
                 out=out)


def topk_softmax(logits, top_k, *, out=None):
    """transformers `Cohere2MoeTopKRouter` (selection "softmax"): top-k logits, softmax of the k."""
    return route(logits, RoutingSpec(top_k, Scoring.SOFTMAX, SelectOn.LOGITS), out=out)


def topk_sigmoid(logits, top_k, renormalize=False, *, out=None):
    """transformers `Cohere2MoeTopKRouter` (selection "sigmoid"): top-k logits, sigmoid of the k."""
    return route(logits, RoutingSpec(top_k, Scoring.SIGMOID, SelectOn.LOGITS, renormalize),
                 out=out)


def biased_sigmoid_topk(logits, correction_bias, top_k, *, out=None):
    """transformers `MiniMaxM2TopKRouter` / `MiniMaxM3VLTopKRouter`: top-k of sigmoid + bias."""
    spec = RoutingSpec(top_k, Scoring.SIGMOID, SelectOn.SCORES, renormalize=True,
                       correction_bias=True)
    return route(logits, spec, correction_bias, out=out)


def grouped_topk(logits, correction_bias, top_k, n_group, topk_group, renormalize,
                 routed_scaling_factor, *, out=None):
    """transformers `NemotronHTopkRouter` (DeepSeek-V3): grouped top-k of sigmoid + bias, scaled."""
    spec = RoutingSpec(top_k, Scoring.SIGMOID, SelectOn.SCORES, renormalize, n_group, topk_group,
                       routed_scaling_factor, correction_bias=True)
    return route(logits, spec, correction_bias, out=out)
