"""Expand's kernels (histogram -> offsets -> scatter, or one program); pair p = t * K + j is valid
if 0 <= topk_ids[t, j] < E. Every kernel cuts the same BLOCK_P blocks: stable order, no atomics.
CHAINED: launched by PDL behind the kernel in front (the routing, then each other), whose
output each reads only after platform.wait_then_release."""
import triton
import triton.language as tl

from .launch import interpreter_serialized
from .platform import wait_then_release


@triton.jit
def _load_expert_ids(topk_ids_ptr, block, num_pairs, E, BLOCK_P: tl.constexpr):
    pairs = block * BLOCK_P + tl.arange(0, BLOCK_P)
    in_range = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=in_range, other=-1)
    # Compare before narrowing: an int64 id like 2**32 must not wrap into [0, E).
    valid = in_range & (ids >= 0) & (ids < E)
    return pairs, tl.where(valid, ids, 0).to(tl.int32), valid


@triton.jit
def _one_hot(ids, valid, E_PAD: tl.constexpr):
    return ((ids[:, None] == tl.arange(0, E_PAD)[None, :]) & valid[:, None]).to(tl.int32)


@triton.jit
def _rank_in_block(one_hot):
    """[BLOCK_P]: how many earlier pairs of the block go to the same expert."""
    return tl.sum((tl.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)


@interpreter_serialized
@triton.jit
def _expert_histogram_kernel(
    topk_ids_ptr, block_counts_ptr, num_pairs, E,
    BLOCK_P: tl.constexpr, E_PAD: tl.constexpr, CHAINED: tl.constexpr,
):
    """block_counts[b, e] = number of valid pairs of block b routed to expert e."""
    wait_then_release(CHAINED)
    block = tl.program_id(0)
    _, ids, valid = _load_expert_ids(topk_ids_ptr, block, num_pairs, E, BLOCK_P)
    experts = tl.arange(0, E_PAD)
    counts = tl.sum(_one_hot(ids, valid, E_PAD), axis=0)  # [E_PAD]
    tl.store(block_counts_ptr + block * E + experts, counts, mask=experts < E)


@interpreter_serialized
@triton.jit
def _expert_offsets_kernel(
    block_counts_ptr, block_prefix_ptr, expert_offsets_ptr, num_rows_ptr,
    sorted_pair_ids_ptr, block_expert_ptr,
    num_blocks, num_m_blocks, num_pairs, E,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, CHAINED: tl.constexpr,
):
    """One program: block prefixes, then _write_offsets; worst-case sizes (T, K, E): capturable."""
    wait_then_release(CHAINED)
    experts = tl.arange(0, E_PAD)
    is_expert = experts < E
    # Exclusive prefix over blocks, per expert: block_prefix[b, e] = sum of block_counts[:b, e].
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        mask = (blocks[:, None] < num_blocks) & is_expert[None, :]
        index = blocks[:, None] * E + experts[None, :]
        counts = tl.load(block_counts_ptr + index, mask=mask, other=0)  # [CHUNK, E_PAD]
        tl.store(block_prefix_ptr + index, tl.cumsum(counts, axis=0) - counts + running[None, :],
                 mask=mask)
        running += tl.sum(counts, axis=0)
    _write_offsets(running, expert_offsets_ptr, num_rows_ptr, sorted_pair_ids_ptr, block_expert_ptr,
                   num_m_blocks, num_pairs, BLOCK_M, E, E_PAD, CHUNK)


@triton.jit
def _write_offsets(counts, expert_offsets_ptr, num_rows_ptr, sorted_pair_ids_ptr, block_expert_ptr,
                   num_m_blocks, num_pairs, BLOCK_M: tl.constexpr, E, E_PAD: tl.constexpr,
                   CHUNK: tl.constexpr):
    """Offsets, rows in use, block -> expert map, sentinels; returns each expert's first row."""
    experts = tl.arange(0, E_PAD)
    is_expert = experts < E
    # Each expert's segment is padded to a multiple of BLOCK_M so a GEMM tile reads one expert.
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(expert_offsets_ptr + experts, starts, mask=is_expert)
    tl.store(expert_offsets_ptr + E, tl.sum(padded, axis=0))
    tl.store(num_rows_ptr, tl.sum(padded, axis=0))
    # Padding rows get the sentinel num_pairs (at most BLOCK_M - 1 per expert).
    pad = tl.arange(0, BLOCK_M)
    pad_rows = starts[:, None] + counts[:, None] + pad[None, :]  # [E_PAD, BLOCK_M]
    pad_mask = is_expert[:, None] & (pad[None, :] < (padded - counts)[:, None])
    tl.store(sorted_pair_ids_ptr + pad_rows, tl.zeros([E_PAD, BLOCK_M], tl.int32) + num_pairs,
             mask=pad_mask)
    # block_expert[m] = the expert whose segment holds rows [m * BLOCK_M, (m + 1) * BLOCK_M), or -1
    for start in range(0, num_m_blocks, CHUNK):
        m_blocks = start + tl.arange(0, CHUNK)
        first_row = m_blocks * BLOCK_M
        inside = ((first_row[:, None] >= starts[None, :]) & (first_row[:, None] < ends[None, :])
                  & is_expert[None, :])
        owner = tl.max(tl.where(inside, experts[None, :], -1), axis=1)  # [CHUNK]
        tl.store(block_expert_ptr + m_blocks, owner, mask=m_blocks < num_m_blocks)
    return starts


@interpreter_serialized
@triton.jit
def _scatter_pairs_kernel(
    topk_ids_ptr, block_prefix_ptr, expert_offsets_ptr, sorted_pair_ids_ptr, pair_to_row_ptr,
    num_pairs, E,
    BLOCK_P: tl.constexpr, E_PAD: tl.constexpr, CHAINED: tl.constexpr,
):
    """Row of each valid pair = its expert's offset + pairs of that expert in earlier blocks
    + pairs of that expert earlier in this block. Filtered pairs get row -1."""
    wait_then_release(CHAINED)
    block = tl.program_id(0)
    pairs, ids, valid = _load_expert_ids(topk_ids_ptr, block, num_pairs, E, BLOCK_P)
    base = tl.load(expert_offsets_ptr + ids, mask=valid, other=0)
    base += tl.load(block_prefix_ptr + block * E + ids, mask=valid, other=0)
    rows = base + _rank_in_block(_one_hot(ids, valid, E_PAD))
    tl.store(sorted_pair_ids_ptr + rows, pairs, mask=valid)
    tl.store(pair_to_row_ptr + pairs, tl.where(valid, rows, -1), mask=pairs < num_pairs)


@interpreter_serialized
@triton.jit
def _expand_one_program_kernel(
    topk_ids_ptr, expert_offsets_ptr, num_rows_ptr, sorted_pair_ids_ptr, block_expert_ptr,
    pair_to_row_ptr,
    num_pairs, num_blocks, num_m_blocks, E,
    BLOCK_P: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    CHAINED: tl.constexpr,
):
    """The three kernels above in one program, same blocks (expand.py's ONE_PROGRAM_BLOCKS)."""
    wait_then_release(CHAINED)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for block in range(num_blocks):
        _, ids, valid = _load_expert_ids(topk_ids_ptr, block, num_pairs, E, BLOCK_P)
        counts += tl.sum(_one_hot(ids, valid, E_PAD), axis=0)
    starts = _write_offsets(counts, expert_offsets_ptr, num_rows_ptr, sorted_pair_ids_ptr,
                            block_expert_ptr, num_m_blocks, num_pairs, BLOCK_M, E, E_PAD, CHUNK)
    earlier = starts  # [E_PAD]: the first free row of each expert, past the earlier blocks' pairs
    for block in range(num_blocks):
        pairs, ids, valid = _load_expert_ids(topk_ids_ptr, block, num_pairs, E, BLOCK_P)
        one_hot = _one_hot(ids, valid, E_PAD)  # [BLOCK_P, E_PAD]
        rows = tl.sum(one_hot * earlier[None, :], axis=1) + _rank_in_block(one_hot)
        tl.store(sorted_pair_ids_ptr + rows, pairs, mask=valid)
        tl.store(pair_to_row_ptr + pairs, tl.where(valid, rows, -1), mask=pairs < num_pairs)
        earlier += tl.sum(one_hot, axis=0)
