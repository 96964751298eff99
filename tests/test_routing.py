"""routing: `route` against `route_torch` over awkward sizes, and against transformers' own
routers."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, poison_, test_device

from moe_triton.routing import (
    RouteConfig,
    RouteTape,
    RoutingSpec,
    Scoring,
    SelectOn,
    biased_sigmoid_topk,
    grouped_topk,
    route,
    route_torch,
    softmax_topk,
    topk_sigmoid,
    topk_softmax,
)

# T = num_tokens, E = num_experts, K = top_k
GROUPS = {4: 2, 6: 3, 8: 4, 128: 8}  # n_group per E for the grouped spec: groups of 2, 2, 2, 16


def make_spec(kind, num_experts, top_k):
    """One spec per kind, or None where the kind cannot route E experts to K."""
    if kind == "softmax":
        return RoutingSpec(top_k)
    if kind == "softmax_renorm":
        return RoutingSpec(top_k, renormalize=True)
    if kind == "logits_softmax":
        return RoutingSpec(top_k, select_on=SelectOn.LOGITS)
    if kind == "logits_sigmoid_renorm":
        return RoutingSpec(top_k, Scoring.SIGMOID, SelectOn.LOGITS, renormalize=True)
    if kind == "sigmoid_biased":
        return RoutingSpec(top_k, Scoring.SIGMOID, renormalize=True, correction_bias=True)
    if kind == "grouped" and num_experts in GROUPS:
        n_group = GROUPS[num_experts]
        topk_group = max(n_group // 2, math.ceil(top_k / (num_experts // n_group)))
        return RoutingSpec(top_k, Scoring.SIGMOID, renormalize=True, n_group=n_group,
                           topk_group=topk_group,
                           routed_scaling_factor=2.5, correction_bias=True)
    return None


KINDS = ["softmax", "softmax_renorm", "logits_softmax", "logits_sigmoid_renorm", "sigmoid_biased",
         "grouped"]
CASES = [
    (kind, num_experts, top_k)
    for kind in KINDS
    for num_experts in (1, 4, 6, 8, 128)
    for top_k in sorted({k for k in (1, 2, num_experts) if k <= num_experts})
    if make_spec(kind, num_experts, top_k) is not None
]


def check_routing(topk_ids, topk_weights, ref_ids, ref_weights, num_experts):
    """Ids as sets per row (ids distinct, int32, in [0, E)); weights aligned to the sorted ids."""
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    ids = topk_ids.long().cpu()
    assert ((ids >= 0) & (ids < num_experts)).all(), "expert id out of range"
    sorted_ids, order = ids.sort(dim=-1)
    assert (sorted_ids[:, 1:] != sorted_ids[:, :-1]).all(), "repeated expert id in a row"
    ref_sorted, ref_order = ref_ids.long().cpu().sort(dim=-1)
    assert torch.equal(sorted_ids, ref_sorted), "different experts chosen"
    assert_close(topk_weights.cpu().gather(1, order),
                 ref_weights.float().cpu().gather(1, ref_order), torch.float32)


def poisoned_out(num_tokens, top_k, device):
    return (poison_(torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)),
            poison_(torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 17, 64])
@pytest.mark.parametrize("kind, num_experts, top_k", CASES)
def test_route(kind, num_experts, top_k, num_tokens, seed):
    device = test_device()
    spec = make_spec(kind, num_experts, top_k)
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(device)  # [T, E]
    bias = None
    if kind in ("sigmoid_biased", "grouped"):
        bias = (torch.randn(num_experts, generator=gen) * 0.5).to(device)  # [E]
    out = poisoned_out(num_tokens, top_k, device)
    topk_ids, topk_weights = route(logits, spec, bias, out=out)
    assert topk_ids is out[0] and topk_weights is out[1]
    check_routing(topk_ids, topk_weights, *route_torch(logits, spec, bias), num_experts)


@pytest.mark.parametrize("kind", KINDS)
def test_a_tape_replays_its_rows_and_records_every_token_s_experts(kind):
    """route(tape=...): a token whose replay flag is set and whose row holds ids runs those ids,
    in the row's order, weighted by the spec's rule at them; every other token (not replaying, or
    a row of -1) routes freely; then each token's row holds the ids it ran. The kernel in one
    launch, as route_torch applies the tape in torch; 37 tokens over 5 programs."""
    device = test_device()
    num_experts, top_k = (128, 8) if kind == "grouped" else (8, 2)
    num_tokens, num_rows = 37, 50
    spec = make_spec(kind, num_experts, top_k)
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(device)  # [T, E]
    bias = ((torch.randn(num_experts, generator=gen) * 0.5).to(device)
            if kind in ("sigmoid_biased", "grouped") else None)
    rows = torch.randperm(num_rows, generator=gen)[:num_tokens]  # [T]
    replay = torch.rand(num_tokens, generator=gen) < 0.6  # [T]
    given = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                         for _ in range(num_rows)]).int()  # [R, K]
    given[torch.rand(num_rows, generator=gen) < 0.3] = -1  # rows holding nothing: free
    tapes = [RouteTape(given.clone().to(device), rows.to(device), replay.to(device))
             for _ in range(2)]
    ours = route(logits, spec, bias, config=RouteConfig(block_t=8), tape=tapes[0])
    expected = route_torch(logits, spec, bias, tapes[1])
    assert torch.equal(ours[0].cpu(), expected[0].cpu())
    assert_close(ours[1].cpu(), expected[1].cpu(), torch.float32)
    assert torch.equal(tapes[0].ids.cpu(), tapes[1].ids.cpu())
    # independently: given rows where replayed, free routing elsewhere, all recorded
    replayed = replay & (given[rows, 0] >= 0)
    assert replayed.any() and not replayed.all()
    free_ids, _ = route_torch(logits, spec, bias)
    assert torch.equal(ours[0].cpu()[replayed], given[rows][replayed])
    assert torch.equal(ours[0].cpu()[~replayed], free_ids.cpu()[~replayed])
    assert torch.equal(tapes[0].ids.cpu()[rows], ours[0].cpu())
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(tapes[0].ids.cpu()[untouched], given[untouched])


def test_a_bad_tape_is_named_before_anything_launches(no_launch):
    logits = torch.randn(5, 8, device=test_device())
    ids = torch.full((9, 2), -1, dtype=torch.int32, device=logits.device)
    rows = torch.arange(5, device=logits.device)
    replay = torch.zeros(5, dtype=torch.bool, device=logits.device)
    for bad, match in ((RouteTape(ids, rows[:4], replay), "tape.rows"),
                       (RouteTape(ids.long(), rows, replay), "tape.ids"),
                       (RouteTape(ids[:, :1], rows, replay), "tape.ids"),
                       (RouteTape(ids, rows, replay.int()), "tape.replay"),
                       (RouteTape(ids, rows.tolist(), replay), "tape.rows")):
        for router in (route, route_torch):
            with pytest.raises(ValueError, match=match):
                router(logits, RoutingSpec(2), tape=bad)


@pytest.mark.parametrize("kind", ["softmax_renorm", "grouped"])
def test_route_many_programs(kind):
    # A 4-token tile over 17 tokens: 5 programs, the last one 1 token wide.
    spec = make_spec(kind, 8, 2)
    logits = torch.randn(17, 8, device=test_device())  # [T, E]
    bias = torch.randn(8, device=test_device()) if kind == "grouped" else None
    out = poisoned_out(17, 2, logits.device)
    route(logits, spec, bias, out=out, config=RouteConfig(block_t=4))
    check_routing(*out, *route_torch(logits, spec, bias), 8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_route_low_precision_logits(dtype):
    # Distinct multiples of 1/8 are exact in bf16, so no ties blur the comparison.
    num_tokens, num_experts = 9, 32
    logits = ((torch.rand(num_tokens, num_experts).argsort(dim=-1) - 16)
              / 8).to(dtype).to(test_device())
    spec = RoutingSpec(4, renormalize=True)
    check_routing(*route(logits, spec), *route_torch(logits, spec), num_experts)


def test_route_large_experts():
    # E = 512 (the largest we promise): an 8-token tile, several programs.
    spec = RoutingSpec(8, Scoring.SIGMOID, renormalize=True, n_group=8, topk_group=4,
                       correction_bias=True)
    logits = torch.randn(20, 512, device=test_device())  # [T, E]
    bias = torch.randn(512, device=test_device()) * 0.1
    check_routing(*route(logits, spec, bias), *route_torch(logits, spec, bias), 512)


def test_route_renormalize_guards_vanishing_sums():
    # Sigmoid scores near 1e-35: the "+ 1e-20" (NemotronH's) keeps weights tiny where a bare sum
    # gives ~1/K.
    logits = -80 + torch.randn(5, 8, device=test_device()) * 0.5  # [T, E]
    spec = RoutingSpec(2, Scoring.SIGMOID, renormalize=True)
    topk_ids, topk_weights = route(logits, spec)
    assert topk_weights.max().item() < 1e-10
    check_routing(topk_ids, topk_weights, *route_torch(logits, spec), 8)


def test_route_non_contiguous_logits():
    base = torch.randn(16, 40, device=test_device())  # [E', T'], read transposed and sliced
    logits = base.t()[3:20:2, 4:20]  # [9, 16], strides (2, 40)
    assert not logits.is_contiguous()
    for spec in (RoutingSpec(3), RoutingSpec(3, Scoring.SIGMOID, SelectOn.LOGITS),
                 RoutingSpec(4, Scoring.SIGMOID, renormalize=True, n_group=4, topk_group=2)):
        check_routing(*route(logits, spec), *route_torch(logits.contiguous(), spec), 16)


# numpy's nanmax (the interpreter's tl.max) warns on the all-NaN row; the GPU max just returns NaN.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("spec", [
    RoutingSpec(3), RoutingSpec(3, Scoring.SIGMOID, SelectOn.LOGITS, renormalize=True),
    RoutingSpec(3, Scoring.SIGMOID, renormalize=True, n_group=4, topk_group=2),
], ids=["softmax", "logits_sigmoid", "grouped"])
def test_route_nan_logits(spec):
    logits = torch.randn(4, 8, device=test_device())  # [T, E]
    logits[1, [0, 5, 6]] = float("nan")
    logits[2] = float("nan")
    logits[3, 2] = float("-inf")
    topk_ids, _ = route(logits, spec, out=poisoned_out(4, 3, logits.device))
    ids = topk_ids.long().cpu()
    assert ((ids >= 0) & (ids < 8)).all()
    assert all(len(set(row)) == 3 for row in ids.tolist())
    if spec.scoring is Scoring.SIGMOID:  # NaN ranks last: row 1 avoids its NaN experts
        assert not set(ids[1].tolist()) & {0, 5, 6}


def _bad_cases():
    x = torch.randn(4, 8)
    spec = RoutingSpec(2)
    grouped = RoutingSpec(2, Scoring.SIGMOID, n_group=2, topk_group=1, correction_bias=True)
    ids, weights = torch.empty(4, 2, dtype=torch.int32), torch.empty(4, 2)
    return {
        "logits_1d": (lambda: route(x[0], spec), "logits"),
        "logits_int": (lambda: route(x.int(), spec), "logits"),
        "no_experts": (lambda: route(x[:, :0], RoutingSpec(1)), "logits"),
        "top_k_zero": (lambda: route(x, RoutingSpec(0)), "top_k"),
        "top_k_above_e": (lambda: route(x, RoutingSpec(9)), "top_k"),
        "n_group_zero": (lambda: route(x, RoutingSpec(2, n_group=0)), "n_group"),
        "n_group_not_dividing": (lambda: route(x, RoutingSpec(2, n_group=3)), "n_group"),
        "groups_of_one": (lambda: route(x, RoutingSpec(2, n_group=8)), "n_group"),
        "topk_group_zero": (lambda: route(x, RoutingSpec(2, n_group=2, topk_group=0)),
                            "topk_group"),
        "topk_group_above_n_group": (lambda: route(x, RoutingSpec(2, n_group=2, topk_group=3)),
                                     "topk_group"),
        "top_k_above_kept_groups": (lambda: route(x, RoutingSpec(5, n_group=2, topk_group=1)),
                                    "top_k"),
        "bias_shape": (lambda: route(x, grouped, torch.zeros(7)), "correction_bias"),
        "bias_int": (lambda: route(x, grouped, torch.zeros(8, dtype=torch.int32)),
                     "correction_bias"),
        "bias_device": (lambda: route(x, grouped, torch.zeros(8, device="meta")),
                        "correction_bias"),
        "bias_with_logits": (lambda: RoutingSpec(2, select_on=SelectOn.LOGITS,
                                                 correction_bias=True),
                             "correction_bias"),
        "bias_not_in_spec": (lambda: route(x, spec, torch.zeros(8)), "correction_bias"),
        "bias_missing": (lambda: route(x, grouped), "correction_bias"),
        "out_not_pair": (lambda: route(x, spec, out=ids), "out"),
        "out_ids_shape": (lambda: route(x, spec, out=(ids[:3], weights)), "out"),
        "out_ids_dtype": (lambda: route(x, spec, out=(ids.long(), weights)), "out"),
        "out_weights_dtype": (lambda: route(x, spec, out=(ids, weights.half())), "out"),
        "out_weights_device": (lambda: route(x, spec, out=(ids, torch.empty(4, 2, device="meta"))),
                               "out"),
        "out_non_contiguous": (lambda: route(x, spec, out=(ids, torch.empty(2, 4).t())), "out"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_route_rejects(case):
    call, argument = _bad_cases()[case]
    with pytest.raises(ValueError, match=argument):
        call()


# ---- parity with transformers' own routers (float32) ----

HIDDEN, NUM_TOKENS = 32, 13


def _randomised(router, bias=None):
    torch.nn.init.normal_(router.weight)
    if bias is not None:
        bias.copy_(torch.randn_like(bias) * 0.3)
    return router.to(test_device())


def _compare(router_out, ours, num_experts):
    _, ref_weights, ref_ids = router_out
    check_routing(*ours, ref_ids, ref_weights, num_experts)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_moe_router(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=norm_topk_prob)
    router = _randomised(Qwen3MoeTopKRouter(config))
    hidden = torch.randn(NUM_TOKENS, HIDDEN, device=test_device())  # [T, H]
    logits = F.linear(hidden, router.weight)  # [T, E]
    _compare(router(hidden), softmax_topk(logits, 2, norm_topk_prob), 8)


@pytest.mark.parametrize("selection", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_cohere2_moe_router(selection, norm_topk_prob):
    from transformers import Cohere2MoeConfig
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter
    config = Cohere2MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3,
                              expert_selection_fn=selection, norm_topk_prob=norm_topk_prob)
    router = _randomised(Cohere2MoeTopKRouter(config))
    hidden = torch.randn(NUM_TOKENS, HIDDEN, device=test_device())  # [T, H]
    logits = F.linear(hidden, router.weight)  # [T, E]
    ours = (topk_softmax(logits, 3) if selection == "softmax"
            else topk_sigmoid(logits, 3, norm_topk_prob))
    _compare(router(hidden), ours, 8)


def test_minimax_m2_router():
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter
    config = MiniMaxM2Config(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    router = _randomised(MiniMaxM2TopKRouter(config))
    bias = torch.randn(8, device=test_device()) * 0.3  # [E]; M2 keeps it on the sparse block
    hidden = torch.randn(NUM_TOKENS, HIDDEN, device=test_device())  # [T, H]
    logits = F.linear(hidden, router.weight)  # [T, E]
    _compare(router(hidden, bias), biased_sigmoid_topk(logits, bias, 2), 8)


def test_minimax_m3_vl_router():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLTopKRouter
    config = MiniMaxM3VLTextConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    router = MiniMaxM3VLTopKRouter(config)
    router = _randomised(router, router.e_score_correction_bias)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, device=test_device())  # [T, H]
    logits = F.linear(hidden, router.weight)  # [T, E]
    _compare(router(hidden), biased_sigmoid_topk(logits, router.e_score_correction_bias, 2), 8)


@pytest.mark.parametrize("num_experts, n_group, topk_group, top_k",
                         [(8, 1, 1, 2), (8, 4, 2, 3), (16, 4, 1, 4)])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_nemotron_h_router(num_experts, n_group, topk_group, top_k, norm_topk_prob):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter
    config = NemotronHConfig(hidden_size=HIDDEN, n_routed_experts=num_experts,
                             num_experts_per_tok=top_k,
                             n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                             routed_scaling_factor=2.5)
    router = NemotronHTopkRouter(config)
    router = _randomised(router, router.e_score_correction_bias)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, device=test_device())  # [T, H]
    logits = F.linear(hidden, router.weight)  # [T, E]
    ours = grouped_topk(logits, router.e_score_correction_bias, top_k, n_group, topk_group,
                        norm_topk_prob, 2.5)
    _compare(router(hidden), ours, num_experts)


# ---- gradients: the logits' gradient flows through topk_weights ---------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_route_gradient(kind, dtype):
    """Against autograd through route_torch. The upstream gradient is a function of the chosen
    expert (not of its slot), so the slot order, which ties may change, does not matter."""
    spec = make_spec(kind, 8, 3)
    g = torch.Generator().manual_seed(KINDS.index(kind))
    # [T, E]
    logits = (torch.randn(17, 8, generator=g) * 3).to(dtype).to(test_device()).requires_grad_()
    # [E]
    bias = torch.rand(8, generator=g).to(test_device()) * 0.5 if spec.correction_bias else None
    per_expert = torch.randn(8, generator=g).to(test_device())  # [E]
    ids, weights = route(logits, spec, bias)
    assert weights.grad_fn is not None
    (grad,) = torch.autograd.grad((weights * per_expert[ids.long()]).sum(), logits)
    ref_ids, ref_weights = route_torch(logits, spec, bias)
    assert torch.equal(ids.sort(dim=1).values.cpu(), ref_ids.sort(dim=1).values.cpu())
    (expected,) = torch.autograd.grad((ref_weights * per_expert[ref_ids.long()]).sum(), logits)
    assert grad.dtype == dtype
    assert_close(grad, expected, dtype)


def test_route_refuses_its_eager_tools_when_gradients_are_needed():
    logits = torch.randn(4, 8, requires_grad=True)
    out = poisoned_out(4, 2, logits.device)
    for kwargs in (dict(out=out), dict(config=RouteConfig(block_t=4))):
        with pytest.raises(ValueError, match="has no backward") as refusal:
            route(logits, RoutingSpec(2), **kwargs)
        assert "\n" not in str(refusal.value)
    with torch.no_grad():
        assert route(logits, RoutingSpec(2), out=out)[0] is out[0]  # inference keeps them
