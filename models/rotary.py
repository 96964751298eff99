"""Rotary embedding in one kernel, optionally after a per-head RMSNorm (Qwen3's q / k norm), also
fused into decode's K/V cache write: x * cos + rotate(x) * sin on each head's first D_rot dims."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_triton.launch import BoundLaunch, PlanCache, interpreter_serialized, register_op
from moe_triton.platform import dependent_launch, triton_computes_exactly, wait_then_release
from moe_triton.weights import tensor_signature

from .rms_norm import rms_norm_torch


@triton.jit
def _rstd(x, D: tl.constexpr, eps):
    x32 = x.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x32 * x32, 1) / D + eps)


@triton.jit
def _rms_normed(x, rstd, norm_ptr, cols, valid):
    """RMSNorm as rms_norm.py rounds it: normalised row to x's dtype, then the weight at `cols`."""
    weight = tl.load(norm_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    return ((x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
            * weight[None, :]).to(x.dtype)


@triton.jit
def _rotated(x, x_ptr, x_row, cos_ptr, sin_ptr, c_row, row_ok, cols, norm_ptr, rstd,
             D_ROT: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr):
    """x's first D_ROT columns rotated by the cos / sin rows at c_row, partners normed as x was."""
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...: rotate -> (-x1, x0), (-x3, x2), ...
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:  # halves: rotate -> (-x2, x1)
        partner = tl.where(cols < D_ROT // 2, cols + D_ROT // 2, cols - D_ROT // 2)
        sign = tl.where(cols < D_ROT // 2, -1.0, 1.0)
    rot = cols < D_ROT
    rot_mask = row_ok[:, None] & rot[None, :]
    x_partner = tl.load(x_ptr + x_row[:, None] + partner[None, :], mask=rot_mask, other=0.0)
    if NORM:
        x_partner = _rms_normed(x_partner, rstd, norm_ptr, partner, rot)
    cos = tl.load(cos_ptr + c_row[:, None] + cols[None, :], mask=rot_mask, other=1.0)
    sin = tl.load(sin_ptr + c_row[:, None] + cols[None, :], mask=rot_mask, other=0.0)
    # one rounding, not torch's three: the compiler fuses x * cos into an FMA whatever the casts
    rotated = (x.to(tl.float32) * cos.to(tl.float32)
               + x_partner.to(tl.float32) * sign[None, :] * sin.to(tl.float32))
    return tl.where(rot[None, :], rotated.to(x.dtype), x)


@interpreter_serialized
@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, norm_ptr, out_ptr, R, HEADS, L, eps,
                   stride_x_b, stride_x_h, stride_x_l, stride_c_b, stride_c_l,
                   D: tl.constexpr, D_ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                   NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (b, head, l) flattened, l fastest
    b, head, pos = rows // (HEADS * L), (rows // L) % HEADS, rows % L
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    x_row = b.to(tl.int64) * stride_x_b + head * stride_x_h + pos * stride_x_l  # [BLOCK_R]
    c_row = b.to(tl.int64) * stride_c_b + pos * stride_c_l
    out = normed_rotated(x_ptr, x_row, row_ok, cols, cos_ptr, sin_ptr, c_row, norm_ptr, eps, D,
                         D_ROT, True, INTERLEAVED, NORM)  # [BLOCK_R, BLOCK_D]
    out_row = rows.to(tl.int64) * D
    tl.store(out_ptr + out_row[:, None] + cols[None, :], out,
             mask=row_ok[:, None] & (cols[None, :] < D))


@interpreter_serialized
@triton.jit
def _rotary_into_cache_kernel(k_ptr, v_ptr, q_ptr, cos_ptr, sin_ptr, norm_ptr, q_norm_ptr, keys_ptr,
                              values_ptr, q_out_ptr, slots_ptr, positions_ptr, R, HEADS, R_Q,
                              Q_HEADS, NUM_SLOTS, S, eps, q_eps, stride_k_b, stride_k_h, stride_v_b,
                              stride_v_h, stride_q_b, stride_q_h, stride_c_b, stride_cache_slot,
                              stride_cache_h, stride_cache_s,
                              D: tl.constexpr, D_ROT: tl.constexpr, ROTATE: tl.constexpr,
                              INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
                              CHAINED: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_D: tl.constexpr):
    wait_then_release(CHAINED)  # behind qkv's projection (PDL); decode attention launches now
    cols = tl.arange(0, BLOCK_D)
    if tl.program_id(1) == 0:  # k and v, rows (b, kv head) flattened
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        b, head = rows // HEADS, rows % HEADS
        row_ok = rows < R
        slot = tl.load(slots_ptr + b, mask=row_ok, other=0).to(tl.int64)
        position = tl.load(positions_ptr + b, mask=row_ok, other=0).to(tl.int64)
        # a (slot, position) outside the cache writes nothing, also in a graph the host never checks
        in_cache = (slot >= 0) & (slot < NUM_SLOTS) & (position >= 0) & (position < S)
        cache_row = (slot * stride_cache_slot + head * stride_cache_h
                     + position * stride_cache_s)  # [BLOCK_R]
        mask = row_ok[:, None] & (cols[None, :] < D)
        store_mask = mask & in_cache[:, None]
        k = normed_rotated(k_ptr, b.to(tl.int64) * stride_k_b + head * stride_k_h, row_ok, cols,
                           cos_ptr, sin_ptr, b.to(tl.int64) * stride_c_b, norm_ptr, eps, D, D_ROT,
                           ROTATE, INTERLEAVED, NORM)
        tl.store(keys_ptr + cache_row[:, None] + cols[None, :], k, mask=store_mask)
        v = tl.load(v_ptr + b.to(tl.int64)[:, None] * stride_v_b + head[:, None] * stride_v_h
                    + cols[None, :], mask=mask, other=0.0)
        tl.store(values_ptr + cache_row[:, None] + cols[None, :], v, mask=store_mask)
    else:  # the query, rows (b, query head) flattened, into a fresh (B, Hq, D)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        b, head = rows // Q_HEADS, rows % Q_HEADS
        row_ok = rows < R_Q
        q = normed_rotated(q_ptr, b.to(tl.int64) * stride_q_b + head * stride_q_h, row_ok, cols,
                           cos_ptr, sin_ptr, b.to(tl.int64) * stride_c_b, q_norm_ptr, q_eps,
                           D, D_ROT, ROTATE, INTERLEAVED, NORM)
        tl.store(q_out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], q,
                 mask=row_ok[:, None] & (cols[None, :] < D))


@triton.jit
def normed_rotated(x_ptr, x_row, row_ok, cols, cos_ptr, sin_ptr, c_row, norm_ptr, eps,
                   D: tl.constexpr, D_ROT: tl.constexpr, ROTATE: tl.constexpr,
                   INTERLEAVED: tl.constexpr, NORM: tl.constexpr):
    """Rows x_row [BLOCK_R] of x, normed (NORM) then rotated (ROTATE) by the cos / sin at c_row."""
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < D),
                other=0.0)
    rstd = _rstd(x, D, eps)  # unused without NORM
    if NORM:
        x = _rms_normed(x, rstd, norm_ptr, cols, cols < D)
    if ROTATE:
        x = _rotated(x, x_ptr, x_row, cos_ptr, sin_ptr, c_row, row_ok, cols, norm_ptr, rstd, D_ROT,
                     INTERLEAVED, NORM)
    return x


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                 norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """x (B, heads, L, D), cos / sin (B, L, D_rot) -> a fresh (B, heads, L, D), normed first."""
    B, heads, L, D = x.shape
    if not rotary_fits(cos, sin, B, L, D):
        raise ValueError(f"cos / sin must be (B={B}, L={L}, D_rot <= {D}, even), got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    _check_norm(norm_weight, x)
    if torch.compiler.is_compiling():
        return torch.ops.moe_triton.rotary(x, cos, sin, interleaved, norm_weight, norm_eps)
    return _compute(x, cos, sin, interleaved, norm_weight, norm_eps)


def rotary_fits(cos: torch.Tensor, sin: torch.Tensor, B: int, L: int, D: int) -> bool:
    """cos / sin (B, L, D_rot) for heads of D: D_rot <= D and even."""
    return (cos.shape == sin.shape and cos.dim() == 3 and cos.shape[:2] == (B, L)
            and cos.shape[2] <= D and cos.shape[2] % 2 == 0)


def _check_norm(norm_weight: torch.Tensor | None, x: torch.Tensor) -> None:
    D = x.shape[-1]
    if norm_weight is not None and (norm_weight.shape != (D,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"norm_weight must be ({D},) in {x.dtype}, one weight per head dim, got "
                         f"{tuple(norm_weight.shape)} in {norm_weight.dtype}")


def _compute(x, cos, sin, interleaved: bool, norm_weight=None,
             norm_eps: float = 0.0) -> torch.Tensor:
    # the interpreter's bf16 casts truncate
    if not triton_computes_exactly(x.device, x.dtype) or x.stride(3) != 1:
        return rotated_once_torch(_normed_torch(x, norm_weight, norm_eps), cos, sin, interleaved)
    B, heads, L, D = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(B, heads, L, D, dtype=x.dtype, device=x.device)
    if B * heads * L:
        norm = x if norm_weight is None else norm_weight
        _rotary_launch(x, cos, sin, norm, norm_eps, interleaved, norm_weight is not None)(
            x_ptr=x, cos_ptr=cos, sin_ptr=sin, norm_ptr=norm, out_ptr=out)
    return out


def _rotary_launch(x, cos, sin, norm, eps: float, interleaved: bool, normed: bool) -> BoundLaunch:
    signature = (tensor_signature(x), tensor_signature(cos), tensor_signature(sin),
                 tensor_signature(norm), eps, interleaved, normed)
    launch = _LAUNCHES.get(signature)
    if launch is None:
        B, heads, L, D = x.shape
        R = B * heads * L
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_R = max(1, min(32, 4096 // BLOCK_D))
        fixed = dict(R=R, HEADS=heads, L=L, eps=eps, stride_x_b=x.stride(0), stride_x_h=x.stride(1),
                     stride_x_l=x.stride(2), stride_c_b=cos.stride(0), stride_c_l=cos.stride(1),
                     D=D, D_ROT=cos.shape[2], INTERLEAVED=interleaved, NORM=normed,
                     BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
        launch = _LAUNCHES.add(signature, BoundLaunch(_rotary_kernel, (triton.cdiv(R, BLOCK_R),),
                                                      fixed))
    return launch


_LAUNCHES = PlanCache()


def _rotary_fake(x, cos, sin, interleaved, norm_weight, norm_eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@register_op("rotary", _rotary_fake)
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
               norm_weight: torch.Tensor | None, norm_eps: float) -> torch.Tensor:
    return _compute(x, cos, sin, interleaved, norm_weight, norm_eps)


def rotate_into_cache(k: torch.Tensor, v: torch.Tensor,
                      rotary: tuple[torch.Tensor, torch.Tensor] | None, keys: torch.Tensor,
                      values: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                      interleaved: bool = False, norm_weight: torch.Tensor | None = None,
                      norm_eps: float = 0.0, query: torch.Tensor | None = None,
                      query_norm_weight: torch.Tensor | None = None,
                      query_norm_eps: float | None = None) -> torch.Tensor | None:
    """k (normed, rotated by `rotary` = (cos, sin) (B, 1, D_rot), or None: NoPE), v (B, Hkv, 1, D)
    into keys / values [slots[b], :, positions[b]]; rows outside the cache are not written. With
    `query` (B, Hq, 1, D): the same kernel norms it (by `query_norm_weight`, `query_norm_eps`,
    norm_eps if None) and rotates it into a fresh (B, Hq, 1, D), returned (decode's q and k in one
    launch)."""
    check_cache_write(k, v, keys, values, norm_weight, query, query_norm_weight)
    cos, sin = rotary if rotary is not None else (None, None)
    q_eps = norm_eps if query_norm_eps is None else query_norm_eps
    if torch.compiler.is_compiling():
        q_out = torch.ops.moe_triton.rotate_into_cache(
            k, v, cos, sin, keys, values, slots, positions, interleaved, norm_weight, norm_eps,
            k[:, :0] if query is None else query, query_norm_weight, q_eps)
    else:
        q_out = _write(k, v, cos, sin, keys, values, slots, positions, interleaved, norm_weight,
                       norm_eps, query, query_norm_weight, q_eps)
    return None if query is None else q_out


def check_cache_write(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      norm_weight: torch.Tensor | None = None, query: torch.Tensor | None = None,
                      query_norm_weight: torch.Tensor | None = None) -> None:
    """rotate_into_cache's arguments checked (a ValueError names the one that does not fit)."""
    B, heads, L, D = k.shape
    if (L != 1 or v.shape != k.shape or keys.shape[1:2] + keys.shape[3:] != (heads, D)
            or values.shape != keys.shape):
        raise ValueError(f"k / v must be (B, Hkv, 1, D) and the cache (slots, Hkv, S, D) with the "
                         f"same Hkv and D, got k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    _check_norm(norm_weight, k)
    if query is not None:
        if query.dim() != 4 or query.shape[0] != B or query.shape[2:] != (1, D):
            raise ValueError(f"query must be (B={B}, Hq, 1, D={D}) as k is, got "
                             f"{tuple(query.shape)}")
        if (query_norm_weight is None) != (norm_weight is None):
            raise ValueError("query_norm_weight and norm_weight go together: pass both (q and k "
                             "normed per head) or neither")
        _check_norm(query_norm_weight, query)


def _write(k, v, cos, sin, keys, values, slots, positions, interleaved: bool, norm_weight=None,
           norm_eps: float = 0.0, query=None, query_norm_weight=None,
           query_norm_eps: float = 0.0) -> torch.Tensor | None:
    contiguous = keys.is_contiguous() and values.is_contiguous()
    if not triton_computes_exactly(k.device, k.dtype) or not contiguous:
        rotate_into_cache_torch(_normed_torch(k, norm_weight, norm_eps), v, cos, sin, keys,
                                values, slots, positions, interleaved)
        if query is None:
            return None
        normed = _normed_torch(query, query_norm_weight, query_norm_eps)
        q_out = normed if cos is None else rotated_once_torch(normed, cos, sin, interleaved)
        return q_out.clone() if q_out is query else q_out  # fresh, as the kernel's
    k, v = (t if t.stride(3) == 1 else t.contiguous() for t in (k, v))
    q_out = None if query is None else torch.empty(query.shape, dtype=query.dtype,
                                                   device=query.device)  # [B, Hq, 1, D]
    if k.shape[0] * k.shape[1]:
        rotate = cos is not None
        # unread without rotation
        cos, sin = (cos.contiguous(), sin.contiguous()) if rotate else (k, k)
        norm = k if norm_weight is None else norm_weight
        tensors = dict(k_ptr=k, v_ptr=v, q_ptr=k if query is None else query, cos_ptr=cos,
                       sin_ptr=sin, norm_ptr=norm,
                       q_norm_ptr=norm if query_norm_weight is None else query_norm_weight,
                       keys_ptr=keys, values_ptr=values, q_out_ptr=k if q_out is None else q_out,
                       slots_ptr=slots, positions_ptr=positions)
        _cache_launch(tensors, norm_eps, query_norm_eps, interleaved, rotate,
                      norm_weight is not None, query is not None)(**tensors)
    return q_out


def _cache_launch(tensors: dict, eps: float, q_eps: float, interleaved: bool, rotate: bool,
                  normed: bool, with_query: bool) -> BoundLaunch:
    signature = (*(tensor_signature(t) for t in tensors.values()), eps, q_eps, interleaved, rotate,
                 normed, with_query)
    launch = _CACHE_LAUNCHES.get(signature)
    if launch is None:
        k, v, q, cos, keys = (tensors[name] for name in ("k_ptr", "v_ptr", "q_ptr", "cos_ptr",
                                                          "keys_ptr"))
        B, heads, _, D = k.shape
        R, R_Q = B * heads, B * q.shape[1] if with_query else 0
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_R = max(1, min(32, 4096 // BLOCK_D))
        fixed = dict(R=R, HEADS=heads, R_Q=R_Q, Q_HEADS=max(q.shape[1], 1),
                     NUM_SLOTS=keys.shape[0], S=keys.shape[2], eps=eps, q_eps=q_eps,
                     stride_k_b=k.stride(0), stride_k_h=k.stride(1), stride_v_b=v.stride(0),
                     stride_v_h=v.stride(1), stride_q_b=q.stride(0), stride_q_h=q.stride(1),
                     stride_c_b=cos.stride(0), stride_cache_slot=keys.stride(0),
                     stride_cache_h=keys.stride(1), stride_cache_s=keys.stride(2), D=D,
                     D_ROT=cos.shape[-1] if rotate else 0, ROTATE=rotate,
                     INTERLEAVED=interleaved, NORM=normed, CHAINED=dependent_launch(k.device),
                     BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
        # axis 1: the k / v programs, then the query's
        grid = (triton.cdiv(max(R, R_Q), BLOCK_R), 2 if R_Q else 1)
        launch = _CACHE_LAUNCHES.add(signature, BoundLaunch(_rotary_into_cache_kernel, grid,
                                                            fixed))
    return launch


_CACHE_LAUNCHES = PlanCache()


def _rotate_into_cache_fake(k, v, cos, sin, keys, values, slots, positions, interleaved,
                            norm_weight, norm_eps, query, query_norm_weight, query_norm_eps):
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


@register_op("rotate_into_cache", _rotate_into_cache_fake, mutates_args=("keys", "values"))
def _rotate_into_cache_op(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                          sin: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                          slots: torch.Tensor, positions: torch.Tensor, interleaved: bool,
                          norm_weight: torch.Tensor | None, norm_eps: float, query: torch.Tensor,
                          query_norm_weight: torch.Tensor | None,
                          query_norm_eps: float) -> torch.Tensor:
    q_out = _write(k, v, cos, sin, keys, values, slots, positions, interleaved, norm_weight,
                   norm_eps, query if query.shape[1] else None, query_norm_weight,
                   query_norm_eps)
    return query.new_empty(query.shape) if q_out is None else q_out


def rotate_into_cache_torch(k, v, cos, sin, keys, values, slots, positions,
                            interleaved: bool = False) -> None:
    """The reference: rotated_once_torch, then index_put of the rows in the cache (a host read)."""
    if cos is not None:
        k = rotated_once_torch(k, cos, sin, interleaved)
    ok = (slots >= 0) & (slots < keys.shape[0]) & (positions >= 0) & (positions < keys.shape[2])
    keys[slots[ok], :, positions[ok]] = k[ok, :, 0]
    values[slots[ok], :, positions[ok]] = v[ok, :, 0]


def _normed_torch(x: torch.Tensor, norm_weight: torch.Tensor | None,
                  norm_eps: float) -> torch.Tensor:
    return x if norm_weight is None else rms_norm_torch(x, norm_weight, norm_eps)


def rotated_once_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       interleaved: bool = False) -> torch.Tensor:
    return apply_rotary_torch(x.float(), cos.float(), sin.float(), interleaved).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       interleaved: bool = False) -> torch.Tensor:
    """The reference, as transformers computes it, in x's dtype."""
    rotate = rotate_interleaved if interleaved else rotate_half
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x_rot = x_rot * cos + rotate(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.numel() else x_rot
