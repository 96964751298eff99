"""Triton kernels of the expand stage (expand.py launches them, in this order).

A (token, slot) pair p = t * K + j is *valid* when 0 <= topk_ids[t, j] < E; every other id is the
filtered sentinel and the pair takes no row. The pairs are cut into blocks of BLOCK_P; all three
kernels see the same blocks, which is what makes the order stable (by pair index within an expert)
and the whole stage deterministic without atomics.
"""
import triton
import triton.language as tl


@triton.jit
def _load_expert_ids(topk_ids_ptr, block, num_pairs, E, BLOCK_P: tl.constexpr):
    """Pair indices of `block`, their expert ids (int32) and validity."""
    pairs = block * BLOCK_P + tl.arange(0, BLOCK_P)
    in_range = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=in_range, other=-1)
    # Compare before narrowing: an int64 id like 2**32 must not wrap into [0, E).
    valid = in_range & (ids >= 0) & (ids < E)
    return pairs, tl.where(valid, ids, 0).to(tl.int32), valid


@triton.jit
def _expert_histogram_kernel(
    topk_ids_ptr, block_counts_ptr, num_pairs, E,
    BLOCK_P: tl.constexpr, E_PAD: tl.constexpr,
):
    """block_counts[b, e] = number of valid pairs of block b routed to expert e."""
    block = tl.program_id(0)
    _, ids, valid = _load_expert_ids(topk_ids_ptr, block, num_pairs, E, BLOCK_P)
    experts = tl.arange(0, E_PAD)
    one_hot = (ids[:, None] == experts[None, :]) & valid[:, None]  # [BLOCK_P, E_PAD]
    counts = tl.sum(one_hot.to(tl.int32), axis=0)  # [E_PAD]
    tl.store(block_counts_ptr + block * E + experts, counts, mask=experts < E)


@triton.jit
def _expert_offsets_kernel(
    block_counts_ptr, block_prefix_ptr, expert_offsets_ptr, num_rows_ptr,
    sorted_pair_ids_ptr, block_expert_ptr,
    num_blocks, num_m_blocks, num_pairs, E,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program: per-block prefixes, padded per-expert offsets, the block -> expert map, and the
    padding sentinels. Sizes are worst-case (fixed by T, K, E), so the stage is graph-capturable."""
    experts = tl.arange(0, E_PAD)
    is_expert = experts < E
    # Exclusive prefix over blocks, per expert: block_prefix[b, e] = sum of block_counts[:b, e].
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        mask = (blocks[:, None] < num_blocks) & is_expert[None, :]
        index = blocks[:, None] * E + experts[None, :]
        counts = tl.load(block_counts_ptr + index, mask=mask, other=0)  # [CHUNK, E_PAD]
        tl.store(block_prefix_ptr + index, tl.cumsum(counts, axis=0) - counts + running[None, :], mask=mask)
        running += tl.sum(counts, axis=0)
    # Each expert's segment is padded to a multiple of BLOCK_M so a GEMM tile reads one expert.
    padded = (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(expert_offsets_ptr + experts, starts, mask=is_expert)
    tl.store(expert_offsets_ptr + E, tl.sum(padded, axis=0))
    tl.store(num_rows_ptr, tl.sum(padded, axis=0))
    # Padding rows get the sentinel num_pairs (at most BLOCK_M - 1 per expert).
    pad = tl.arange(0, BLOCK_M)
    pad_rows = starts[:, None] + running[:, None] + pad[None, :]  # [E_PAD, BLOCK_M]
    pad_mask = is_expert[:, None] & (pad[None, :] < (padded - running)[:, None])
    tl.store(sorted_pair_ids_ptr + pad_rows, tl.zeros([E_PAD, BLOCK_M], tl.int32) + num_pairs, mask=pad_mask)
    # block_expert[m] = the expert whose segment holds rows [m * BLOCK_M, (m + 1) * BLOCK_M), else -1.
    for start in range(0, num_m_blocks, CHUNK):
        m_blocks = start + tl.arange(0, CHUNK)
        first_row = m_blocks * BLOCK_M
        inside = (first_row[:, None] >= starts[None, :]) & (first_row[:, None] < ends[None, :]) & is_expert[None, :]
        owner = tl.max(tl.where(inside, experts[None, :], -1), axis=1)  # [CHUNK]
        tl.store(block_expert_ptr + m_blocks, owner, mask=m_blocks < num_m_blocks)


@triton.jit
def _scatter_pairs_kernel(
    topk_ids_ptr, block_prefix_ptr, expert_offsets_ptr, sorted_pair_ids_ptr, pair_to_row_ptr,
    num_pairs, E,
    BLOCK_P: tl.constexpr, E_PAD: tl.constexpr,
):
    """Row of each valid pair = its expert's offset + pairs of that expert in earlier blocks
    + pairs of that expert earlier in this block. Filtered pairs get row -1."""
    block = tl.program_id(0)
    pairs, ids, valid = _load_expert_ids(topk_ids_ptr, block, num_pairs, E, BLOCK_P)
    experts = tl.arange(0, E_PAD)
    one_hot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)  # [BLOCK_P, E_PAD]
    earlier = tl.cumsum(one_hot, axis=0) - one_hot
    rank = tl.sum(earlier * one_hot, axis=1)  # [BLOCK_P]
    base = tl.load(expert_offsets_ptr + ids, mask=valid, other=0)
    base += tl.load(block_prefix_ptr + block * E + ids, mask=valid, other=0)
    rows = base + rank
    tl.store(sorted_pair_ids_ptr + rows, pairs, mask=valid)
    tl.store(pair_to_row_ptr + pairs, tl.where(valid, rows, -1), mask=pairs < num_pairs)
