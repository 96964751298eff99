"""Decode attention's kernel (see decode_attention.py): a program per (sequence, KV head, split)
runs the online softmax over its share of the cached keys; with the step's own token it norms and
rotates q and k first (rotary.py's code) and the split holding the position takes that key from
registers; the last split of a (sequence, KV head) to finish combines the splits in split order."""
import triton
import triton.language as tl

from moe_triton.launch import interpreter_serialized
from moe_triton.platform import wait_then_release

from .rotary import normed_rotated


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # float32 caches: full-precision products (the default would round operands to tf32)
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@interpreter_serialized
@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, positions_ptr, sinks_ptr, out_ptr, part_out_ptr,
    part_stats_ptr, counter_ptr, stride_q_b, stride_q_h, stride_c_slot, stride_c_h, stride_c_s,
    NUM_SLOTS, S, scale, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
    IEEE: tl.constexpr, CHAINED: tl.constexpr,
    # the step's own token (NEW_TOKEN): k / v (B, Hkv, D) rows, q raw; normed (NORM) and rotated
    # (ROTATE: D_ROT columns, INTERLEAVED pairs) here, k and v written into the cache at pos
    new_k_ptr, new_v_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, q_eps, k_eps,
    stride_nk_b, stride_nk_h, stride_nv_b, stride_nv_h, stride_cos_b,
    NEW_TOKEN: tl.constexpr, ROTATE: tl.constexpr, D_ROT: tl.constexpr,
    INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
    PREFETCH: tl.constexpr,  # (NEW_TOKEN only) the first cached tile before the PDL wait
):
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the step's slots and positions, and the cache before pos, are older than the kernel in
    # front (the chain's invariant, platform.wait_then_release): read before the wait
    pos = tl.load(positions_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # a (slot, position) outside the cache reads nothing: every split stays empty, the row is NaN
    in_cache = (slot >= 0) & (slot < NUM_SLOTS) & (pos >= 0) & (pos < S)
    start = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    # split boundaries on BLOCK_N multiples, each split an equal share of the real context
    chunk = tl.cdiv(tl.cdiv(pos + 1 - start, SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.where(in_cache, tl.minimum(lo + chunk, pos + 1), lo)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BLOCK_G]; rows past GROUP pad to tl.dot's 16-row minimum
    g_ok, d_ok = g < GROUP, d < D
    row = tl.where(in_cache, slot, 0) * stride_c_slot + kv_head * stride_c_h
    cache_hi = tl.minimum(hi, pos) if NEW_TOKEN else hi  # the new key is not in the cache yet
    if PREFETCH:  # the first tile streams while the kernel in front (qkv's projection) drains;
        # without a new token that kernel may be rotary's, which writes the row at pos
        k, v, n_ok = _kv_tile(k_ptr, v_ptr, row, lo, cache_hi, stride_c_s, d, d_ok, BLOCK_N)
    # behind the kernel in front (PDL); the next (o_proj, gemv.py) may launch and load its weights
    wait_then_release(CHAINED)
    if NEW_TOKEN:  # q as the projection left it: normed and rotated as rotary.py does
        c_row = b * stride_cos_b + tl.zeros([BLOCK_G], tl.int64)
        q = normed_rotated(q_ptr, b * stride_q_b + heads.to(tl.int64) * stride_q_h, g_ok, d,
                           cos_ptr, sin_ptr, c_row, q_norm_ptr, q_eps, D, D_ROT, ROTATE,
                           INTERLEAVED, NORM)  # [BLOCK_G, BLOCK_D]
    else:
        q = tl.load(q_ptr + b * stride_q_b + heads[:, None] * stride_q_h + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, cache_hi, BLOCK_N):
        if not PREFETCH:
            k, v, n_ok = _kv_tile(k_ptr, v_ptr, row, n0, cache_hi, stride_c_s, d, d_ok, BLOCK_N)
        s = _dot(q, tl.trans(k), IEEE) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: the first key of every iteration is in range
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m = m_new
        if PREFETCH:  # the next tile, in flight while the loop goes round
            k, v, n_ok = _kv_tile(k_ptr, v_ptr, row, n0 + BLOCK_N, cache_hi, stride_c_s, d, d_ok,
                                  BLOCK_N)
    if NEW_TOKEN:
        if (lo <= pos) & (pos < hi):  # this split holds pos (hi > pos only inside the cache)
            m, total, acc = _attend_new_token(
                q, m, total, acc, new_k_ptr, new_v_ptr, k_ptr, v_ptr, row + pos * stride_c_s,
                b * stride_nk_b + kv_head * stride_nk_h, b * stride_nv_b + kv_head * stride_nv_h,
                cos_ptr, sin_ptr, c_row, k_norm_ptr, k_eps, scale, g, d, d_ok, D, D_ROT, ROTATE,
                INTERLEAVED, NORM)
    out_mask = g_ok[:, None] & d_ok[None, :]
    out = out_ptr + (b * GROUP * tl.num_programs(1) + heads)[:, None] * D + d[None, :]
    if SPLITS == 1:
        _store_combined(out, out_mask, acc, m, total, sinks_ptr, heads, g_ok, HAS_SINKS)
    else:
        # a split with no keys leaves (-inf, 0, 0): the combine weighs it 0
        part = (b * GROUP * tl.num_programs(1) + heads) * SPLITS + split  # [BLOCK_G]
        tl.store(part_out_ptr + part[:, None] * D + d[None, :], acc, mask=out_mask)
        tl.store(part_stats_ptr + part * 2, m, mask=g_ok)
        tl.store(part_stats_ptr + part * 2 + 1, total, mask=g_ok)
        # release: this split's partials (every thread's: the barrier first) are visible before
        # the count; acquire: the last sees all
        counter = counter_ptr + b * tl.num_programs(1) + kv_head
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
            tl.debug_barrier()
            first = (b * GROUP * tl.num_programs(1) + heads) * SPLITS  # [BLOCK_G] split 0's part
            sp = tl.arange(0, BLOCK_S)
            stats = part_stats_ptr + (first[:, None] + sp[None, :]) * 2  # [BLOCK_G, BLOCK_S]
            stats_ok = g_ok[:, None] & (sp[None, :] < SPLITS)
            ms = tl.load(stats, mask=stats_ok, other=float("-inf"))
            top = tl.max(ms, 1)  # [BLOCK_G]
            m = tl.where(top > float("-inf"), top, 0.0)  # no key read: every weight below is 0
            total = tl.sum(tl.load(stats + 1, mask=stats_ok, other=0.0)
                           * tl.exp(ms - m[:, None]), 1)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            # split order, whichever program came last; unrolled, so the loads issue together
            for s in tl.static_range(SPLITS):
                weight = tl.exp(tl.load(part_stats_ptr + (first + s) * 2, mask=g_ok,
                                        other=float("-inf")) - m)  # [BLOCK_G]
                acc += weight[:, None] * tl.load(
                    part_out_ptr + (first + s)[:, None] * D + d[None, :], mask=out_mask,
                    other=0.0)
            m = top
            _store_combined(out, out_mask, acc, m, total, sinks_ptr, heads, g_ok, HAS_SINKS)
            tl.atomic_xchg(counter, 0)  # ready for the next call


@triton.jit
def _kv_tile(k_ptr, v_ptr, row, n0, end, stride_c_s, d, d_ok, BLOCK_N: tl.constexpr):
    """Cached keys and values [n0, n0 + BLOCK_N) before `end` of one (slot, KV head) `row`:
    (k, v [BLOCK_N, BLOCK_D], n_ok [BLOCK_N])."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    tile = row + n[:, None].to(tl.int64) * stride_c_s + d[None, :]
    k = tl.load(k_ptr + tile, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_ptr + tile, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    return k, v, n_ok


@triton.jit
def _attend_new_token(q, m, total, acc, new_k_ptr, new_v_ptr, k_ptr, v_ptr, cache_row, k_row,
                      v_row, cos_ptr, sin_ptr, c_row, k_norm_ptr, k_eps, scale, g, d, d_ok,
                      D: tl.constexpr, D_ROT: tl.constexpr, ROTATE: tl.constexpr,
                      INTERLEAVED: tl.constexpr, NORM: tl.constexpr):
    """The new token's key and value into the cache row `cache_row`, and into the running softmax
    (m, total, acc) of q [BLOCK_G, BLOCK_D]: k normed and rotated as rotary.py's cache kernel
    writes it, every one of the BLOCK_G rows that one key (so the score is an elementwise sum)."""
    same = tl.zeros(g.shape, tl.int64)  # [BLOCK_G]: every row the one key's
    k = normed_rotated(new_k_ptr, k_row + same, tl.full(g.shape, 1, tl.int1), d, cos_ptr,
                       sin_ptr, c_row, k_norm_ptr, k_eps, D, D_ROT, ROTATE, INTERLEAVED,
                       NORM)  # [BLOCK_G, BLOCK_D], the rows alike
    cols = same[:, None] + d[None, :]  # [BLOCK_G, BLOCK_D]
    v = tl.load(new_v_ptr + v_row + cols, mask=d_ok[None, :], other=0.0)
    first = (g[:, None] == 0) & d_ok[None, :]
    tl.store(k_ptr + cache_row + cols, k, mask=first)
    tl.store(v_ptr + cache_row + cols, v, mask=first)
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), 1) * scale  # [BLOCK_G]
    m_new = tl.maximum(m, s)
    p = tl.exp(s - m_new)
    alpha = tl.exp(m - m_new)  # 0 where no key came before (m = -inf)
    total = total * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    return m_new, total, acc


@triton.jit
def _store_combined(out, out_mask, acc, m, total, sinks_ptr, heads, g_ok, HAS_SINKS: tl.constexpr):
    """acc / total at the running max m ([BLOCK_G] heads); m = -inf: no key read, NaN (0 / 0)."""
    read = m > float("-inf")
    if HAS_SINKS:  # gpt-oss: the head's sink logit joins the softmax's denominator, no value
        sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)
        top = tl.maximum(m, sink)
        scale = tl.where(read, tl.exp(m - top), 0.0)
        acc = acc * scale[:, None]
        total = total * scale + tl.where(read, tl.exp(sink - top), 0.0)
    tl.store(out, (acc / total[:, None]).to(out.dtype.element_ty), mask=out_mask)
