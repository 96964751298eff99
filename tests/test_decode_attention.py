"""models/decode_attention.py against its float32 reference (and that against SDPA), under the
interpreter in float16 / float32 on CPU and compiled on the GPU. The cache is poisoned with NaN
outside every sequence's context (the unused tail, the other slots, the window's excluded past):
reading any of it would show. With the step's own token (NewToken), against the float32 torch
forms of its two steps: rotary.py's references (norm, rotation, cache write), then attention's."""
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, compile_for_sm90, relative_error

from moe_triton.launch import PlanCache
from moe_triton.models import decode_attention as attention
from moe_triton.models.decode_attention import NewToken, decode_attention, decode_attention_torch
from moe_triton.models.rms_norm import rms_norm_torch
from moe_triton.models.rotary import rotate_into_cache_torch, rotated_once_torch

CASES = [  # B, Hq, Hkv, D, S, window
    (2, 4, 2, 16, 32, None),
    (3, 6, 2, 12, 40, None),  # 3 query heads per KV head, D not a power of two
    (1, 8, 1, 32, 100, None),  # one sequence: the context split over several programs
    (2, 4, 4, 16, 48, 7),  # sliding window, no GQA
    (4, 2, 1, 24, 20, 64),  # a window longer than any context
]


def make_case(B, Hq, Hkv, D, S, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.full((B + 2, Hkv, S, D), float("nan"))  # [slots + 1, Hkv, S, D]; unwritten = NaN
    values = torch.full_like(keys, float("nan"))
    slots = torch.randperm(B + 1, generator=g)[:B]  # [B] scattered over the cache, one slot unused
    positions = torch.randint(0, S, (B,), generator=g)  # [B]
    positions[0] = S - 1  # one sequence at the cache's end
    for b in range(B):
        n = int(positions[b]) + 1
        keys[slots[b], :, :n] = torch.randn(Hkv, n, D, generator=g)
        values[slots[b], :, :n] = torch.randn(Hkv, n, D, generator=g)
    q = torch.randn(B, Hq, D, generator=g)
    return [t.to(device, dtype) for t in (q, keys, values)] + [slots.to(device),
                                                               positions.to(device)]


def poison_outside_window(keys, values, slots, positions, window):
    for b in range(len(slots)):
        past = max(int(positions[b]) - window + 1, 0)
        keys[slots[b], :, :past] = float("nan")
        values[slots[b], :, :past] = float("nan")


SINK_CASES = [  # B, Hq, Hkv, D, S, window: gpt-oss's sinks, with its GQA and its sliding window
    (3, 8, 2, 16, 40, None),
    (2, 8, 2, 16, 48, 7),
]


def random_sinks(Hq, dtype, device="cpu", seed=1):
    # around the scores' own scale, so the sink takes a visible share of each softmax
    return (torch.randn(Hq, generator=torch.Generator().manual_seed(seed)) * 2).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,D,S,window,with_sinks",
                         [case + (False,) for case in CASES] + [case + (True,)
                                                                 for case in SINK_CASES])
def test_decode_attention(B, Hq, Hkv, D, S, window, with_sinks, dtype):
    q, keys, values, slots, positions = make_case(B, Hq, Hkv, D, S, dtype)
    if window:
        poison_outside_window(keys, values, slots, positions, window)
    sinks = random_sinks(Hq, dtype) if with_sinks else None
    out = decode_attention(q, keys, values, slots, positions, D**-0.5, window, sinks)
    assert out.shape == (B, Hq, D) and out.dtype == dtype
    expected = decode_attention_torch(q, keys, values, slots, positions, D**-0.5, window, sinks)
    assert_close(out, expected, dtype)
    if with_sinks:  # the sinks take a visible share
        without = decode_attention_torch(q, keys, values, slots, positions, D**-0.5, window)
        assert relative_error(without, expected) > 0.05


NEW_TOKEN_FORMS = {  # (rotary dims: None NoPE, interleaved pairs, per-head q / k norm)
    "norm, rotary": (None, False, True), "partial interleaved": (8, True, False),
    "NoPE": (0, False, False)}


def new_token_case(B, Hkv, D, form, dtype, device, seed=2):
    """The step's token: k, v (B, Hkv, 1, D), rotary (cos, sin (B, 1, D_rot)), q / k norms."""
    rotary_dims, interleaved, normed = NEW_TOKEN_FORMS[form]
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, Hkv, 1, D, generator=g).to(device, dtype) for _ in range(2))
    d_rot = D - D % 2 if rotary_dims is None else rotary_dims
    rotary = tuple(torch.randn(B, 1, d_rot, generator=g).to(device, dtype)
                   for _ in range(2)) if d_rot else None
    norms = [(torch.rand(D, generator=g).to(device, dtype) + 0.5, eps) for eps in (1e-6, 1e-2)]
    return NewToken(k, v, rotary, interleaved, *(norms if normed else (None, None)))


def new_token_reference(q, keys, values, slots, positions, scale, window, sinks, new):
    """Float32 torch: the token normed, rotated and written into copies of the cache, then the
    attention; (out, keys, values)."""
    def normed_rotated(x, norm):
        x = x.float() if norm is None else rms_norm_torch(x.float(), norm[0].float(), norm[1])
        return x if new.rotary is None else rotated_once_torch(x, *new.rotary, new.interleaved)
    keys, values = keys.float(), values.float()
    rotate_into_cache_torch(normed_rotated(new.k, new.k_norm), new.v.float(), None, None, keys,
                            values, slots, positions)
    q = normed_rotated(q[:, :, None], new.q_norm)[:, :, 0]
    out = decode_attention_torch(q, keys, values, slots, positions, scale, window, sinks)
    return out, keys, values


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", ""])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("form", list(NEW_TOKEN_FORMS))
@pytest.mark.parametrize("B,Hq,Hkv,D,S,window,with_sinks",
                         [case + (False,) for case in CASES] + [SINK_CASES[1] + (True,)])
def test_the_new_token_enters_the_cache_and_the_attention_in_one_launch(
        B, Hq, Hkv, D, S, window, with_sinks, form, dtype, prefetch, monkeypatch):
    """The first cached tile loaded before the wait or in the loop (a grid past the
    PREFETCH_PROGRAMS_PER_SM rule)."""
    plans = PlanCache()  # this test's plans alone: each variant plans afresh
    monkeypatch.setattr(attention, "_PLANS", plans)
    if not prefetch:
        monkeypatch.setattr(attention, "PREFETCH_PROGRAMS_PER_SM", 0)
    check_the_new_token(B, Hq, Hkv, D, S, window, with_sinks, form, dtype, "cpu")
    (plan,) = plans._plans.values()
    assert plan.launch.fixed["PREFETCH"] == prefetch


def check_the_new_token(B, Hq, Hkv, D, S, window, with_sinks, form, dtype, device):
    """Its position's cache row poisoned: read before it is written, it would show (NaN)."""
    q, keys, values, slots, positions = make_case(B, Hq, Hkv, D, S, dtype, device)
    positions[-1] = S  # a row past the cache: writes nothing, attends to nothing (NaN)
    inside = positions < S
    keys[slots[inside], :, positions[inside]] = float("nan")
    values[slots[inside], :, positions[inside]] = float("nan")
    if window:
        poison_outside_window(keys, values, slots, positions, window)
    sinks = random_sinks(Hq, dtype, device) if with_sinks else None
    new = new_token_case(B, Hkv, D, form, dtype, device)
    expected, expected_keys, expected_values = new_token_reference(
        q, keys, values, slots, positions, D**-0.5, window, sinks, new)
    out = decode_attention(q, keys, values, slots, positions, D**-0.5, window, sinks, new)
    assert out[-1].isnan().all() and expected[-1].isnan().all()
    assert_close(out[:-1], expected[:-1], dtype)
    rows = (slots[inside], slice(None), positions[inside])  # the written rows; the rest unchanged
    assert_close(keys[rows], expected_keys[rows], dtype)
    assert_close(values[rows], expected_values[rows], dtype)
    assert torch.equal(keys.isnan(), expected_keys.isnan())


def test_a_new_token_on_another_device_is_refused_before_launch():
    q, keys, values, slots, positions = make_case(2, 4, 2, 16, 32, torch.float32)
    new = NewToken(*(torch.zeros(2, 2, 1, 16, device="meta") for _ in range(2)))
    with pytest.raises(ValueError, match="must be on q's device cpu"):
        decode_attention(q, keys, values, slots, positions, 0.25, None, None, new)


def test_a_decode_layers_chained_kernels_compile_for_sm90():
    """The norm, the attention taking its new token (norm, rotary, cache write) and the routing,
    each launched by PDL, compiled for sm_90 without a GPU (tests/sm90_compile.py): Qwen3's and
    gpt-oss-120b's head shapes."""
    cases = [{"layer": [1, 32, 4, 128, 1024, 128, 8]}, {"layer": [8, 64, 8, 64, 2048, 128, 4]}]
    run = compile_for_sm90(cases, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == len(cases) and all("_decode_attention_kernel" in line
                                            for line in lines[:1]), run.stdout


def test_the_sinks_reference_is_transformers_gpt_oss_attention():
    """transformers' eager gpt-oss attention (its sinks in the softmax, dropped after) on each
    sequence's context."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    B, Hq, Hkv, D, S = 3, 8, 2, 16, 30
    q, keys, values, slots, positions = make_case(B, Hq, Hkv, D, S, torch.float32)
    sinks = random_sinks(Hq, torch.float32)
    ref = decode_attention_torch(q, keys, values, slots, positions, 0.3, None, sinks)
    module = SimpleNamespace(num_key_value_groups=Hq // Hkv, sinks=sinks, training=False)
    for b in range(B):
        n = int(positions[b]) + 1
        k, v = keys[slots[b], :, :n][None], values[slots[b], :, :n][None]  # [1, Hkv, n, D]
        theirs, _ = eager_attention_forward(module, q[b, None, :, None], k, v, None, 0.3)
        torch.testing.assert_close(ref[b], theirs[0, 0], rtol=1e-5, atol=1e-5)


def test_the_reference_is_sdpa_over_the_context():
    B, Hq, Hkv, D, S = 3, 6, 2, 16, 30
    q, keys, values, slots, positions = make_case(B, Hq, Hkv, D, S, torch.float32)
    ref = decode_attention_torch(q, keys, values, slots, positions, 0.3)
    for b in range(B):
        n = int(positions[b]) + 1
        k, v = keys[slots[b], :, :n], values[slots[b], :, :n]  # [Hkv, n, D]
        # [Hq, D]
        sdpa = F.scaled_dot_product_attention(q[b, :, None], k, v, scale=0.3, enable_gqa=True)[:, 0]
        torch.testing.assert_close(ref[b], sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_last_split_combines_and_leaves_its_counters_at_zero(device):
    """One launch: the last split of each (sequence, KV head) to finish combines. Called again
    with new queries (and on the GPU replayed from a CUDA graph), each result matches the
    reference and the same inputs give the same bits: the arrival counters went back to zero."""
    from moe_triton.models.decode_attention import num_splits

    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    B, Hq, Hkv, D, S = (1, 8, 2, 16, 64) if device == "cpu" else (2, 32, 4, 128, 2048)
    q, keys, values, slots, positions = make_case(B, Hq, Hkv, D, S, dtype, device)
    assert num_splits(B, Hkv, S, 16 if device == "cpu" else 64, q.device) > 1
    sinks = random_sinks(Hq, dtype, device)
    static_q = q.clone()

    def call():
        return decode_attention(static_q, keys, values, slots, positions, D**-0.5, None, sinks)

    first = call()
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        call = lambda: (graph.replay(), out)[1]  # noqa: E731
    for seed in range(3):
        static_q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)))
        assert_close(call(), decode_attention_torch(static_q, keys, values, slots, positions,
                                                    D**-0.5, None, sinks), dtype)
    static_q.copy_(q)
    assert torch.equal(call(), first)


def test_an_empty_batch_launches_nothing():
    q, keys, values, slots, positions = make_case(1, 4, 2, 16, 8, torch.float32)
    out = decode_attention(q[:0], keys, values, slots[:0], positions[:0], 0.25)
    assert out.shape == (0, 4, 16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rows_outside_the_cache_read_nothing_and_come_out_nan(dtype, device):
    """Slots outside [0, slots + 1) and positions outside [0, S) (what a graph replays unchecked):
    the cache sits in the middle of a buffer of random values, so a read past it would give a finite
    row. (bf16 on CPU: the torch reference.)"""
    B, Hq, Hkv, D, S, num_slots = 6, 4, 2, 16, 12, 4
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, Hq, D, generator=g).to(device, dtype)
    slots = torch.tensor([0, num_slots, -1, 2, 1, 3], device=device)
    positions = torch.tensor([S, 3, 2, 5, -1, S - 1], device=device)
    valid, outside = [3, 5], [0, 1, 2, 4]
    caches = []
    for _ in range(2):  # keys, values: each the middle third of a random buffer
        buffer = torch.randn(3 * num_slots * Hkv * S * D, generator=g).to(device, dtype)
        caches.append(
            buffer[buffer.numel() // 3: 2 * buffer.numel() // 3].view(num_slots, Hkv, S, D))
    keys, values = caches
    out = decode_attention(q, keys, values, slots, positions, D**-0.5)
    reference = decode_attention_torch(q, keys, values, slots, positions, D**-0.5)
    assert out[outside].isnan().all() and reference[outside].isnan().all()
    sinks = random_sinks(Hq, dtype, device)  # a sink is no key: those rows stay NaN
    assert decode_attention(q, keys, values, slots, positions, D**-0.5, None,
                            sinks)[outside].isnan().all()
    assert_close(out[valid],
                 decode_attention_torch(q[valid], keys, values, slots[valid], positions[valid],
                                        D**-0.5),
                 dtype)
    assert torch.equal(reference[valid],
                       decode_attention_torch(q[valid], keys, values, slots[valid],
                                              positions[valid], D**-0.5))


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v, s, p: (q[0], k, v, s, p), "q must be"),
    (lambda q, k, v, s, p: (q, k, v[:, :, :-1], s, p), "q must be"),
    (lambda q, k, v, s, p: (q[:, :3], k, v, s, p), "Hq % Hkv"),
    (lambda q, k, v, s, p: (q, k.half(), v.half(), s, p), "dtype"),
    (lambda q, k, v, s, p: (q, k, v, s[:1], p), "slots / positions"),
    (lambda q, k, v, s, p: (q, k, v, s, p, 0.25, None, torch.zeros(2)), "sinks must be"),
    (lambda q, k, v, s, p: (q, k, v, s, p, 0.25, None, torch.zeros(4, dtype=torch.int64)),
     "sinks must be"),
])
def test_bad_input_is_refused_before_launch(bad, match):
    args = make_case(2, 4, 2, 16, 8, torch.float32)
    args = bad(*args)
    with pytest.raises(ValueError, match=match):
        decode_attention(*args, *(() if len(args) > 5 else (0.25,)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,D,S,window",
                         CASES + [(1, 32, 4, 128, 4096, None), (8, 32, 4, 128, 1104, None),
                                  (2, 16, 8, 128, 2048, 512)])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_decode_attention_on_the_gpu(B, Hq, Hkv, D, S, window, dtype, with_sinks):
    q, keys, values, slots, positions = make_case(B, Hq, Hkv, D, S, dtype, "cuda")
    if window:
        poison_outside_window(keys, values, slots, positions, window)
    sinks = random_sinks(Hq, dtype, "cuda") if with_sinks else None
    out = decode_attention(q, keys, values, slots, positions, D**-0.5, window, sinks)
    assert_close(out, decode_attention_torch(q, keys, values, slots, positions, D**-0.5, window,
                                             sinks), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("form", list(NEW_TOKEN_FORMS))
@pytest.mark.parametrize("B,Hq,Hkv,D,S,window", [(1, 32, 4, 128, 4096, None),
                                                 (8, 32, 4, 128, 1104, None),
                                                 (2, 16, 8, 128, 2048, 512)])
def test_the_new_token_in_one_launch_on_the_gpu(B, Hq, Hkv, D, S, window, form, dtype):
    check_the_new_token(B, Hq, Hkv, D, S, window, False, form, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,window", [(1, 4096, None), (8, 2048, 128), (64, 1024, 128)])
def test_decode_attention_at_gpt_oss_shapes(B, S, window):
    """gpt-oss-120b: 64 query / 8 KV heads of 64, sinks, every other layer a 128-token window."""
    q, keys, values, slots, positions = make_case(B, 64, 8, 64, S, torch.bfloat16, "cuda")
    if window:
        poison_outside_window(keys, values, slots, positions, window)
    sinks = random_sinks(64, torch.bfloat16, "cuda")
    out = decode_attention(q, keys, values, slots, positions, 0.125, window, sinks)
    assert_close(out, decode_attention_torch(q, keys, values, slots, positions, 0.125, window,
                                             sinks), torch.bfloat16)
