"""models/rotary.py against the float32 rotation on CPU under the interpreter and on the GPU:
rotate-half and interleaved, full and partial, strided q views; and the decode step's fused
rotation + K/V cache write against index_put into a copy of the cache."""
import pytest
import torch
from helpers import assert_close

from moe_triton.models.rms_norm import rms_norm_torch
from moe_triton.models.rotary import (
    apply_rotary,
    apply_rotary_torch,
    rotate_into_cache,
    rotate_into_cache_torch,
    rotated_once_torch,
)

CASES = [  # B, heads, L, D, D_rot, interleaved
    (2, 4, 3, 16, 16, False),
    (1, 3, 5, 24, 12, False),  # partial rotary (MiniMax-M2)
    (2, 2, 4, 16, 16, True),  # Cohere's pairs
    (3, 1, 1, 32, 8, True),
    (0, 2, 1, 16, 16, False),
]


def make(B, heads, L, D, D_rot, dtype, device="cpu"):
    g = torch.Generator().manual_seed(B * 100 + D)
    # [B, heads, L, D], as the models view q
    x = torch.randn(B, L, heads, D, generator=g).transpose(1, 2)
    angles = torch.rand(B, L, D_rot // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [B, L, D_rot]
    return [t.to(device, dtype) for t in (x, cos, sin)]


def norm_weight(D, dtype, device="cpu"):
    return (1 + torch.randn(D, generator=torch.Generator().manual_seed(D)) / 4).to(device, dtype)


def normed_rotation(x, cos, sin, interleaved, weight):
    """The float32 reference: Qwen3's per-head RMSNorm (when `weight` is given), then the
    rotation."""
    x = x.float() if weight is None else rms_norm_torch(x.float(), weight.float(), 1e-6)
    return apply_rotary_torch(x, cos.float(), sin.float(), interleaved)


@pytest.mark.parametrize("norm", [False, True], ids=["rotary", "norm+rotary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B,heads,L,D,D_rot,interleaved", CASES)
def test_apply_rotary(B, heads, L, D, D_rot, interleaved, dtype, norm):
    x, cos, sin = make(B, heads, L, D, D_rot, dtype)
    weight = norm_weight(D, dtype) if norm else None
    out = apply_rotary(x, cos, sin, interleaved, norm_weight=weight, norm_eps=1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, normed_rotation(x, cos, sin, interleaved, weight), dtype,
                 scale=2 if norm else 1)


def test_bf16_on_the_interpreter_takes_the_reference():
    """The interpreter's casts to bf16 truncate (moe_triton/platform.py): bf16 there runs the torch
    form."""
    x, cos, sin = make(4, 8, 3, 64, 64, torch.bfloat16)
    assert torch.equal(apply_rotary(x, cos, sin), rotated_once_torch(x, cos, sin))


def test_bad_tables_are_refused():
    x, cos, sin = make(2, 2, 3, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="cos / sin must be"):
        apply_rotary(x, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match=r"norm_weight must be \(16,\) in torch.float32"):
        apply_rotary(x, cos, sin, norm_weight=torch.ones(16, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B,heads,L,D,D_rot,interleaved", CASES + [(8, 32, 1, 128, 128, False),
                                                                  (1, 4, 4096, 128, 64, False)])
@pytest.mark.parametrize("norm", [False, True], ids=["rotary", "norm+rotary"])
def test_apply_rotary_on_the_gpu(B, heads, L, D, D_rot, interleaved, dtype, norm):
    x, cos, sin = make(B, heads, L, D, D_rot, dtype, "cuda")
    weight = norm_weight(D, dtype, "cuda") if norm else None
    out = apply_rotary(x, cos, sin, interleaved, norm_weight=weight, norm_eps=1e-6)
    assert_close(out, normed_rotation(x, cos, sin, interleaved, weight), dtype,
                 scale=2 if norm else 1)


CACHE_CASES = [  # B, Hkv, D, D_rot (0: NoPE), interleaved
    (3, 2, 16, 16, False),
    (2, 4, 24, 12, False),  # partial rotary
    (2, 2, 16, 16, True),
    (4, 1, 32, 0, False),  # a NoPE layer: the write alone
    (0, 2, 16, 16, False),
]


def decode_token(B, heads, D, D_rot, dtype, device="cpu", slots=5, S=9):
    """k, v as the models view them ((B, 1, Hkv, D) projections transposed), a rotary of (B, 1,
    D_rot) or None, a random cache and distinct slots (the last one the dummy) and positions."""
    g = torch.Generator().manual_seed(B * 10 + D + D_rot)
    k, v = (torch.randn(B, 1, heads, D, generator=g).transpose(1, 2) for _ in range(2))
    angles = torch.rand(B, 1, D_rot // 2, generator=g) * 6
    rotary = ((torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)) if D_rot
              else None)
    keys, values = (torch.randn(slots + 1, heads, S, D, generator=g) for _ in range(2))
    slot_ids = torch.randperm(slots + 1, generator=g)[:B]
    positions = torch.randint(0, S, (B,), generator=g)
    move = lambda t: t.to(device, dtype)  # noqa: E731
    rotary = tuple(map(move, rotary)) if rotary else None
    return (move(k), move(v), rotary, move(keys), move(values), slot_ids.to(device),
            positions.to(device))


@pytest.mark.parametrize("norm", [False, True], ids=["rotary", "norm+rotary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B,heads,D,D_rot,interleaved", CACHE_CASES)
def test_rotate_into_cache(B, heads, D, D_rot, interleaved, dtype, norm):
    k, v, rotary, keys, values, slots, positions = decode_token(B, heads, D, D_rot, dtype)
    weight = norm_weight(D, dtype) if norm else None
    expected_keys, expected_values = keys.clone(), values.clone()
    rotate_into_cache_torch(k, v, *(rotary or (None, None)), expected_keys, expected_values, slots,
                            positions,
                            interleaved)
    rotate_into_cache(k, v, rotary, keys, values, slots, positions, interleaved, norm_weight=weight,
                      norm_eps=1e-6)
    assert torch.equal(values, expected_values)  # a copy, and nothing else of the cache touched
    written = keys[slots, :, positions]  # [B, Hkv, D]
    untouched = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool)
    untouched[slots, positions] = False
    assert torch.equal(keys.transpose(1, 2)[untouched], expected_keys.transpose(1, 2)[untouched])
    normed = k.float() if weight is None else rms_norm_torch(k.float(), weight.float(), 1e-6)
    reference = (normed if rotary is None
                 else apply_rotary_torch(normed, *(t.float() for t in rotary), interleaved))
    assert_close(written, reference[:, :, 0], dtype, scale=2 if norm else 1)


@pytest.mark.parametrize("norm", [False, True], ids=["rotary", "norm+rotary"])
@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.float16),
                                          pytest.param("cuda", torch.bfloat16,
                                                       marks=pytest.mark.gpu)], ids=str)
@pytest.mark.parametrize("B,heads,D,D_rot,interleaved", [c for c in CACHE_CASES if c[3]])  # rotary
def test_the_query_rotates_in_the_cache_write(B, heads, D, D_rot, interleaved, dtype, device,
                                              norm):
    """q (B, Hq = 3 Hkv, 1, D) through the cache-write kernel: as apply_rotary (the prefill
    kernel) rotates it, bit for bit, and within the dtype's tolerance of float32 torch, normed by
    its own eps (not k's); the cache written as without the query."""
    k, v, rotary, keys, values, slots, positions = decode_token(B, heads, D, D_rot, dtype, device)
    q = torch.randn(B, 1, 3 * heads, D, generator=torch.Generator().manual_seed(3)).to(
        device, dtype).transpose(1, 2)  # a strided view, as the fused projection gives it
    k_weight, q_weight = ((norm_weight(D, dtype, device), norm_weight(D, dtype, device).flip(0))
                          if norm else (None, None))
    expected_keys, expected_values = keys.clone(), values.clone()
    rotate_into_cache(k, v, rotary, expected_keys, expected_values, slots, positions, interleaved,
                      norm_weight=k_weight, norm_eps=1e-6)
    out = rotate_into_cache(k, v, rotary, keys, values, slots, positions, interleaved,
                            norm_weight=k_weight, norm_eps=1e-6, query=q,
                            query_norm_weight=q_weight, query_norm_eps=0.25)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    cos, sin = rotary
    assert out.shape == q.shape and out.is_contiguous()
    assert torch.equal(out, apply_rotary(q, cos, sin, interleaved, norm_weight=q_weight,
                                         norm_eps=0.25))
    normed = q.float() if q_weight is None else rms_norm_torch(q.float(), q_weight.float(), 0.25)
    assert_close(out, apply_rotary_torch(normed, cos.float(), sin.float(), interleaved), dtype,
                 scale=2 if norm else 1)


def test_the_query_needs_its_own_norm_weight_when_k_has_one():
    k, v, rotary, keys, values, slots, positions = decode_token(2, 2, 16, 16, torch.float32)
    q = torch.randn(2, 4, 1, 16)
    with pytest.raises(ValueError, match="query_norm_weight and norm_weight go together"):
        rotate_into_cache(k, v, rotary, keys, values, slots, positions,
                          norm_weight=torch.ones(16), norm_eps=1e-6, query=q)
    with pytest.raises(ValueError, match="query must be"):
        rotate_into_cache(k, v, rotary, keys, values, slots, positions, query=q[:1])


def in_guards(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): `t` copied into the middle of a buffer three times its size, random
    elsewhere, so a write or read past either end of the view lands in memory the test owns and can
    inspect."""
    n = t.numel()
    buffer = torch.randn(3 * n, generator=torch.Generator().manual_seed(n)).to(t.device, t.dtype)
    view = buffer[n:2 * n].view(t.shape)
    view.copy_(t)
    return buffer, view


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rows_outside_the_cache_write_nothing(dtype, device):
    """Slots outside [0, slots + 1) and positions outside [0, S) (what a graph replays unchecked)
    are not written: the rest of the cache and the memory around it stay as they were. (bf16 on CPU:
    the torch reference.)"""
    S, num_slots = 9, 4  # three sequences and the dummy slot
    k, v, rotary, keys, values, _, _ = decode_token(6, 2, 16, 16, dtype, device,
                                                    slots=num_slots - 1, S=S)
    slots = torch.tensor([0, 3, -1, num_slots, 1, 2], device=device)
    positions = torch.tensor([S, 2, 0, 1, -1, S - 1], device=device)
    valid = [1, 5]  # (3, 2): the dummy slot is a slot; (2, S - 1): the last position
    (key_buffer, keys), (value_buffer, values) = in_guards(keys), in_guards(values)
    expected_keys, expected_values = key_buffer.clone(), value_buffer.clone()
    rows = slots[valid], slice(None), positions[valid]
    expected_values.view(3, -1)[1].view(values.shape)[rows] = v[valid, :, 0]
    written = torch.zeros_like(key_buffer, dtype=torch.bool)
    written.view(3, -1)[1].view(keys.shape)[rows] = True
    rotate_into_cache(k, v, rotary, keys, values, slots, positions)
    assert torch.equal(value_buffer, expected_values)
    assert torch.equal(key_buffer[~written], expected_keys[~written])
    # [2, Hkv, D]
    reference = apply_rotary_torch(k.float(), *(t.float() for t in rotary))[valid, :, 0]
    assert_close(keys[rows], reference, dtype)


def test_rotate_into_cache_refuses_mismatched_shapes():
    k, v, rotary, keys, values, slots, positions = decode_token(2, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="k / v must be"):
        rotate_into_cache(k, v, rotary, keys[:, :1], values[:, :1], slots, positions)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B,heads,D,D_rot,interleaved", CACHE_CASES + [(64, 4, 128, 128, False),
                                                                         (8, 8, 128, 64, True)])
@pytest.mark.parametrize("norm", [False, True], ids=["rotary", "norm+rotary"])
def test_rotate_into_cache_on_the_gpu(B, heads, D, D_rot, interleaved, dtype, norm):
    k, v, rotary, keys, values, slots, positions = decode_token(B, heads, D, D_rot, dtype, "cuda",
                                                                slots=64, S=33)
    weight = norm_weight(D, dtype, "cuda") if norm else None
    expected_keys, expected_values = keys.clone(), values.clone()
    normed = k if weight is None else rms_norm_torch(k.float(), weight.float(), 1e-6).to(dtype)
    rotate_into_cache_torch(normed, v, *(rotary or (None, None)), expected_keys, expected_values,
                            slots, positions,
                            interleaved)
    rotate_into_cache(k, v, rotary, keys, values, slots, positions, interleaved, norm_weight=weight,
                      norm_eps=1e-6)
    assert torch.equal(values, expected_values)
    # the rest of the cache untouched
    assert_close(keys, expected_keys.float(), dtype, scale=2 if norm else 1)
