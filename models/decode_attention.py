"""Flash-decoding over the static KV cache in place: only each sequence's context, no host read.
Given the step's own token (`NewToken`: its k, v and q as the projection left them), the same
launch norms and rotates q and k (rotary.py's kernels' code) and writes k and v into the cache:
the split holding the token's position takes its key from registers (no program reads a row
another writes), one kernel a decode layer instead of two."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from moe_triton.invariance import batch_invariant_enabled
from moe_triton.launch import BoundLaunch, PlanCache, arrival_counters, register_op
from moe_triton.platform import dependent_launch, device_limits, triton_computes_exactly
from moe_triton.weights import tensor_signature

from ._decode_attention_kernels import _decode_attention_kernel
from .rotary import check_cache_write, rotary_fits, rotate_into_cache


@dataclass(frozen=True)
class NewToken:
    """The decode step's own token, as the qkv projection left it: k, v (B, Hkv, 1, D), to be
    normed per head by `k_norm` (weight, eps; None: not), rotated by `rotary` (cos, sin (B, 1,
    D_rot); None: NoPE) and written into the cache at each row's position; the query is normed
    by `q_norm` and rotated alike (rotary.rotate_into_cache's arguments)."""
    k: torch.Tensor
    v: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    interleaved: bool = False
    q_norm: tuple[torch.Tensor, float] | None = None
    k_norm: tuple[torch.Tensor, float] | None = None


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, scale: float,
                     window: int | None = None, sinks: torch.Tensor | None = None,
                     new_token: NewToken | None = None) -> torch.Tensor:
    """q (B, Hq, D) at `positions` (B,) over cache rows `slots` (B,) of keys / values (slots + 1,
    Hkv, S, D): a fresh (B, Hq, D). A `window` W reads (pos - W, pos]; outside the cache: NaN.
    `sinks` (Hq,): a logit per head in the softmax's denominator only (gpt-oss). `new_token`:
    q is raw, and the token's k / v enter the cache first (NewToken), in the same launch where
    the kernel runs eagerly, else by rotary.rotate_into_cache before."""
    _check(q, keys, values, slots, positions, sinks)
    if new_token is not None:
        _check_new_token(new_token, q, keys, values)
    if new_token is not None and (torch.compiler.is_compiling() or not _fuses(new_token, q, keys)):
        q = _rotate_into_cache(q, keys, values, slots, positions, new_token)
        new_token = None
    if torch.compiler.is_compiling():
        return torch.ops.moe_triton.decode_attention(q, keys, values, slots, positions, scale,
                                                     window or 0, sinks)
    return _compute(q, keys, values, slots, positions, scale, window or 0, sinks, new_token)


def _fuses(new: NewToken, q: torch.Tensor, keys: torch.Tensor) -> bool:
    """One launch: the kernel runs (CUDA, or the interpreter in fp16 / fp32) on a contiguous
    cache, the token (checked as rotate_into_cache checks it) in q's dtype with its rotary's
    shape; else rotate_into_cache and then the attention."""
    return (triton_computes_exactly(q.device, q.dtype) and keys.is_contiguous()
            and new.k.stride(3) == new.v.stride(3) == 1 and new.k.dtype == q.dtype
            and (new.rotary is None or rotary_fits(*new.rotary, q.shape[0], 1, q.shape[2])))


def _check_new_token(new: NewToken, q: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor) -> None:
    tensors = [new.k, new.v, *(new.rotary or ()), *(n[0] for n in (new.q_norm, new.k_norm) if n)]
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"new_token's k, v, rotary and norm weights must be on q's device "
                         f"{q.device}, got {sorted({str(t.device) for t in tensors})}")
    check_cache_write(new.k, new.v, keys, values, new.k_norm and new.k_norm[0], q[:, :, None],
                      new.q_norm and new.q_norm[0])


def _rotate_into_cache(q, keys, values, slots, positions, new: NewToken) -> torch.Tensor:
    """The two-launch form: the token's k / v into the cache, q normed and rotated."""
    q_norm, k_norm = new.q_norm or (None, None), new.k_norm or (None, 0.0)
    rotated = rotate_into_cache(new.k, new.v, new.rotary, keys, values, slots, positions,
                                new.interleaved, norm_weight=k_norm[0], norm_eps=k_norm[1],
                                query=q[:, :, None], query_norm_weight=q_norm[0],
                                query_norm_eps=q_norm[1])
    return rotated[:, :, 0]


def _compute(q, keys, values, slots, positions, scale: float, window: int,
             sinks: torch.Tensor | None, new_token: NewToken | None = None) -> torch.Tensor:
    if not triton_computes_exactly(q.device, q.dtype):  # new_token None: decode_attention's
        return decode_attention_torch(q, keys, values, slots, positions, scale,
                                      window or None, sinks).to(q.dtype)
    return _launch(q, keys, values, slots, positions, scale, window, sinks, new_token)


# Programs an SM the split count aims at: at two pipeline stages (64 KB of K / V tiles a 4-warp
# program at 64-key tiles) three are resident, and a grid of ~4 an SM measured fastest at batch
# 32-64; batch 1 at a 1k context keeps a split a key tile (docs/PERFORMANCE.md, issue 30, ninth
# session).
PROGRAMS_PER_SM = 4
NUM_STAGES = 2  # 3 (Triton's default) holds two programs an SM: 45.8 -> 40.7 us at batch 64


def num_splits(batch: int, kv_heads: int, max_seq: int, block_n: int, device: torch.device) -> int:
    """As many as keep the grid within PROGRAMS_PER_SM programs an SM (8 programs on CPU), at
    most one split per block and 64; batch-invariant mode: batch 1's for every batch (the split
    sets a row's summation order)."""
    programs = PROGRAMS_PER_SM * device_limits(device)[0] if device.type == "cuda" else 8
    if batch_invariant_enabled():
        batch = 1
    return max(1, min(programs // (batch * kv_heads), triton.cdiv(max_seq, block_n), 64))


def _launch(q, keys, values, slots, positions, scale: float, window: int,
            sinks: torch.Tensor | None, new: NewToken | None) -> torch.Tensor:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, Hq, D]
    if q.shape[0] == 0:
        return out
    token = _token_tensors(new, out)
    signature = (tuple(tensor_signature(t) for t in (q, keys, values, slots, positions,
                                                     *token.values()))
                 + (scale, window, batch_invariant_enabled(), sinks is not None)
                 + ((new.interleaved, new.rotary is not None, new.q_norm and new.q_norm[1],
                     new.k_norm and new.k_norm[1]) if new is not None else ()))
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.add(signature, _plan(q, keys, scale, window, sinks is not None, new,
                                           token))
    # with one split: unread, each program normalises its own heads
    part_out = part_stats = out
    if plan.counters is not None:
        part_out = torch.empty(plan.parts + (q.shape[2],), dtype=torch.float32,
                               device=q.device)  # [B, Hq, splits, D] unnormalised outputs
        part_stats = torch.empty(plan.parts + (2,), dtype=torch.float32,
                                 device=q.device)  # [B, Hq, splits, 2] (max, sum) per split
    plan.launch(q_ptr=q, k_ptr=keys, v_ptr=values, slots_ptr=slots, positions_ptr=positions,
                sinks_ptr=out if sinks is None else sinks, out_ptr=out, part_out_ptr=part_out,
                part_stats_ptr=part_stats,
                counter_ptr=out if plan.counters is None else plan.counters, **token)
    return out


def _token_tensors(new: NewToken | None, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The kernel's new-token tensors; `out` where one is unread (no token, rotary or norm)."""
    if new is None:
        return dict.fromkeys(("new_k_ptr", "new_v_ptr", "cos_ptr", "sin_ptr", "q_norm_ptr",
                              "k_norm_ptr"), out)
    cos, sin = (t.contiguous() for t in new.rotary) if new.rotary is not None else (out, out)
    return dict(new_k_ptr=new.k, new_v_ptr=new.v, cos_ptr=cos, sin_ptr=sin,
                q_norm_ptr=new.q_norm[0] if new.q_norm else out,
                k_norm_ptr=new.k_norm[0] if new.k_norm else out)


@dataclass(frozen=True)
class _AttentionPlan:
    """One launch: (sequence, KV head, split) programs; the last split of a (sequence, KV head) to
    finish combines the splits' partial results in split order (so the bits never depend on which
    came last) and resets its counter, so a plan replays in a CUDA graph. Two calls of one plan
    must not overlap in time (a model's layers run one after another: overlap streams run a
    layer's other branches beside its attention, never a second attention)."""
    parts: tuple[int, int, int]  # (B, Hq, splits): one partial result per query head and split
    counters: torch.Tensor | None  # [B, Hkv] int32 arrivals, zero between calls; None: one split
    launch: BoundLaunch


def _plan(q, keys, scale: float, window: int, has_sinks: bool, new: NewToken | None,
          token: dict) -> _AttentionPlan:
    B, Hq, D = q.shape
    _, Hkv, S, _ = keys.shape
    BLOCK_N = 64 if q.is_cuda else 16
    splits = num_splits(B, Hkv, S, BLOCK_N, q.device)
    group = Hq // Hkv
    counters = arrival_counters(B * Hkv, q.device).view(B, Hkv) if splits > 1 else None
    launch = BoundLaunch(_decode_attention_kernel, (B, Hkv, splits), dict(
        stride_q_b=q.stride(0), stride_q_h=q.stride(1), stride_c_slot=keys.stride(0),
        stride_c_h=keys.stride(1), stride_c_s=keys.stride(2), NUM_SLOTS=keys.shape[0], S=S,
        scale=scale, window=window, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_N=BLOCK_N, SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits), HAS_SINKS=has_sinks, IEEE=q.dtype == torch.float32,
        CHAINED=dependent_launch(q.device),
        **_new_token_args(new, token, B * Hkv * splits, q.device)),
        dict(num_stages=NUM_STAGES))
    return _AttentionPlan((B, Hq, splits), counters, launch)


# With the step's own token the first cached K/V tile loads before the PDL wait, which holds it in
# registers across q's norm and rotation: 168 a thread at the GPU's 64-key tiles (108 without,
# sm_90, Triton 3.6.0), three 4-warp programs an SM. Prefetch only where the grid fits that.
PREFETCH_PROGRAMS_PER_SM = 3


def _prefetches(programs: int, device: torch.device) -> bool:
    sms = device_limits(device)[0] if device.type == "cuda" else 4
    return programs <= PREFETCH_PROGRAMS_PER_SM * sms


def _new_token_args(new: NewToken | None, token: dict, programs: int,
                    device: torch.device) -> dict:
    """The kernel's fixed new-token arguments (NEW_TOKEN False: unread)."""
    if new is None:
        return dict(q_eps=0.0, k_eps=0.0, stride_nk_b=0, stride_nk_h=0, stride_nv_b=0,
                    stride_nv_h=0, stride_cos_b=0, NEW_TOKEN=False, ROTATE=False, D_ROT=0,
                    INTERLEAVED=False, NORM=False, PREFETCH=False)
    return dict(q_eps=new.q_norm[1] if new.q_norm else 0.0,
                k_eps=new.k_norm[1] if new.k_norm else 0.0,
                stride_nk_b=new.k.stride(0), stride_nk_h=new.k.stride(1),
                stride_nv_b=new.v.stride(0), stride_nv_h=new.v.stride(1),
                stride_cos_b=token["cos_ptr"].stride(0) if new.rotary is not None else 0,
                NEW_TOKEN=True, ROTATE=new.rotary is not None,
                D_ROT=new.rotary[0].shape[-1] if new.rotary is not None else 0,
                INTERLEAVED=new.interleaved, NORM=new.k_norm is not None,
                PREFETCH=_prefetches(programs, device))


_PLANS = PlanCache()


def _check(q, keys, values, slots, positions, sinks) -> None:
    if (q.dim() != 3 or keys.dim() != 4 or keys.shape != values.shape
            or keys.stride() != values.stride()):
        raise ValueError(f"q must be (B, Hq, D) and keys / values the same (slots, Hkv, S, D) "
                         f"cache, got {tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    B, Hq, D = q.shape
    if keys.shape[3] != D or Hq % keys.shape[1] or keys.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError(f"q (B, Hq={Hq}, D={D}) needs a cache (slots, Hkv, S, D={D}) with "
                         f"Hq % Hkv == 0 and unit last strides, got {tuple(keys.shape)}")
    if keys.dtype != q.dtype or slots.shape != (B,) or positions.shape != (B,):
        raise ValueError(f"the cache must have q's dtype {q.dtype} and slots / positions shape "
                         f"({B},), got {keys.dtype}, {tuple(slots.shape)}, "
                         f"{tuple(positions.shape)}")
    if sinks is not None and (sinks.shape != (Hq,) or not sinks.dtype.is_floating_point
                              or sinks.device != q.device or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be a float tensor of shape ({Hq},) (one logit per query "
                         f"head) on {q.device}, got {sinks.dtype} {tuple(sinks.shape)} on "
                         f"{sinks.device}")


def _decode_attention_fake(q, *args):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@register_op("decode_attention", _decode_attention_fake)
def _decode_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         slots: torch.Tensor, positions: torch.Tensor, scale: float,
                         window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    return _compute(q, keys, values, slots, positions, scale, window, sinks)


def decode_attention_torch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           slots: torch.Tensor, positions: torch.Tensor, scale: float,
                           window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    B, Hq, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    in_cache = (slots >= 0) & (slots < keys.shape[0]) & (positions >= 0) & (positions < S)  # [B]
    rows = torch.where(in_cache, slots, 0)
    k = keys[rows].float().repeat_interleave(Hq // Hkv, dim=1)  # [B, Hq, S, D]
    v = values[rows].float().repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) * scale  # [B, Hq, S]
    columns = torch.arange(S, device=q.device)
    allowed = (columns[None, :] <= positions[:, None]) & in_cache[:, None]  # [B, S]; none: NaN
    if window:
        allowed &= columns[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    # what lies outside the context is never read, not even as 0 * x
    v = v.masked_fill(~allowed[:, None, :, None], 0.0)
    if sinks is None:
        return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v)  # [B, Hq, D]
    # one more logit per head, no value; none outside the cache (NaN, as without sinks)
    sink = sinks.float()[None, :, None].expand(B, Hq, 1).masked_fill(~in_cache[:, None, None],
                                                                     float("-inf"))
    weights = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :S]
    return torch.einsum("bhs,bhsd->bhd", weights, v)
