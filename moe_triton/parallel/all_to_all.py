"""EP dispatch and combine: tokens to the ranks owning their experts, and back. Two ways.

Synced (eager; exact sizes), over `all_to_all_single`:

    rank's tokens [T, H], global ids [T, K]
      -> dispatch  one row per (token, owning rank): a token goes once to each rank owning any of
                   its experts, with the K ids made local there (-1 for slots owned elsewhere)
      -> experts   (the caller's local pipeline, on [Tr, H]: weighted, summed over the local slots)
      -> combine   rows back to their source rank, summed per token: [T, H] in the original order

Ts rows this rank sends, Tr rows it receives, W ranks in the EP group. Split sizes are exchanged
first, then read on the host (all_to_all_single takes Python lists), so dispatch waits for the
device: this way cannot be captured in a CUDA graph.

Gathered (capture-safe; a fixed capacity), over `all_gather_into_tensor` / `reduce_scatter`:

    rank's C rows [C, H], global ids [C, K]; C the same on every EP rank (a decode graph's bucket)
      -> dispatch_gathered  every rank's rows to every rank: [W * C, H], ids and weights with them
      -> experts            the local pipeline on [W * C, H] with the ids made local (-1 elsewhere):
                            only the rows routed here do GEMM work; the others come out zero
      -> combine_gathered   partial outputs summed over the EP ranks (float32) and scattered home: [C, H]

Every shape is known before launch and nothing is read on the host, so it captures. The capacity
rule: a rank sends all its C rows to every EP rank, the worst case of the synced path (a token owned
everywhere), so no row can overflow and none is dropped; the price is W * C rows per rank where the
synced path moves about min(K, W) * T, and a step at the bucket's size C however few rows are real.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .groups import reduce_scatter_single


@dataclass(frozen=True)
class DispatchPlan:
    """How rows left this rank, so `combine` can bring their results home."""
    num_tokens: int  # T on this rank
    send_token: torch.Tensor  # [Ts] int64 source token of each sent row; by destination rank, then token
    send_counts: tuple[int, ...]  # send_counts[r]: rows sent to EP rank r
    recv_counts: tuple[int, ...]  # recv_counts[r]: rows received from EP rank r


@dataclass(frozen=True)
class Dispatched:
    hidden_states: torch.Tensor  # [Tr, H] received rows, grouped by source rank
    topk_ids: torch.Tensor  # [Tr, K] int32 local expert ids; -1 where the slot's expert lives on another rank
    topk_weights: torch.Tensor  # [Tr, K] float32
    plan: DispatchPlan


def dispatch(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             experts_per_rank: int, group: dist.ProcessGroup) -> Dispatched:
    """Send each token (T, H) once to every EP rank owning one of its experts; a collective over `group`.

    Ids outside [0, E) are filtered: such slots travel nowhere, as fused_experts ignores them.
    """
    size = dist.get_world_size(group)
    num_tokens, top_k = topk_ids.shape
    hidden = hidden_states.shape[1]
    num_experts = experts_per_rank * size
    valid = (topk_ids >= 0) & (topk_ids < num_experts)  # [T, K]
    owner = torch.where(valid, topk_ids.long() // experts_per_rank, size)  # [T, K]; `size` = nowhere
    sends = torch.zeros(num_tokens, size + 1, dtype=torch.bool, device=topk_ids.device)
    sends = sends.scatter_(1, owner, True)[:, :size]  # [T, W]: token t goes to rank r
    dest, send_token = sends.T.nonzero(as_tuple=True)  # [Ts], [Ts]: by destination, then token
    send_counts = sends.sum(dim=0)  # [W]
    recv_counts = torch.empty_like(send_counts)  # [W]
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # sizes first: receivers allocate
    send_counts, recv_counts = tuple(send_counts.tolist()), tuple(recv_counts.tolist())
    received = sum(recv_counts)

    local_ids = topk_ids[send_token].long() - dest[:, None] * experts_per_rank  # [Ts, K]
    local_ids = torch.where(owner[send_token] == dest[:, None], local_ids, -1)  # [Ts, K]
    # ids and float32 weights share one exchange: the weights travel as their int32 bit patterns
    meta = torch.cat([local_ids.int(), topk_weights[send_token].float().view(torch.int32)], dim=1)  # [Ts, 2K]
    recv_meta = meta.new_empty(received, 2 * top_k)  # [Tr, 2K]
    dist.all_to_all_single(recv_meta, meta, list(recv_counts), list(send_counts), group=group)
    recv_x = hidden_states.new_empty(received, hidden)  # [Tr, H]
    dist.all_to_all_single(recv_x, hidden_states[send_token], list(recv_counts), list(send_counts), group=group)

    plan = DispatchPlan(num_tokens, send_token, send_counts, recv_counts)
    recv_ids = recv_meta[:, :top_k].contiguous()  # [Tr, K]
    recv_weights = recv_meta[:, top_k:].contiguous().view(torch.float32)  # [Tr, K]
    return Dispatched(recv_x, recv_ids, recv_weights, plan)


def combine(expert_out: torch.Tensor, plan: DispatchPlan, group: dist.ProcessGroup) -> torch.Tensor:
    """Send each received row's expert output (Tr, H) home and sum a token's rows: a fresh (T, H).

    The expert rank already applied the routing weights, so this is a plain sum; a token none of
    whose ids was valid gets zeros.
    """
    hidden = expert_out.shape[1]
    back = expert_out.new_empty(len(plan.send_token), hidden)  # [Ts, H]
    dist.all_to_all_single(back, expert_out.contiguous(), list(plan.send_counts), list(plan.recv_counts), group=group)
    # float32 sum of a token's (at most min(K, W)) rows, rounded once at the end
    out = torch.zeros(plan.num_tokens, hidden, dtype=torch.float32, device=expert_out.device)  # [T, H]
    return out.index_add_(0, plan.send_token, back.float()).to(expert_out.dtype)  # [T, H]


# ---- gathered: fixed capacity, capture-safe ------------------------------------------------------

@dataclass(frozen=True)
class Gathered:
    hidden_states: torch.Tensor  # [W * C, H] every EP rank's rows, rank after rank
    topk_ids: torch.Tensor  # [W * C, K] int32 global ids
    topk_weights: torch.Tensor  # [W * C, K] float32


def dispatch_gathered(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      group: dist.ProcessGroup) -> Gathered:
    """This rank's C rows (C, H) to every EP rank, with their global ids and weights; a collective.

    Every rank of `group` must hold the same C (the decode graph's batch bucket: padding rows are
    rows). Outside a CUDA-graph capture that is checked first (one host read), so a mismatch is a
    ValueError on every rank rather than a hang; inside a capture nothing touches the host.
    """
    size = dist.get_world_size(group)
    rows, top_k = topk_ids.shape
    if not (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_same_rows(rows, size, group, hidden_states.device)
    # ids and float32 weights share one gather: the weights travel as their int32 bit patterns
    meta = torch.cat([topk_ids.int(), topk_weights.float().view(torch.int32)], dim=1)  # [C, 2K]
    all_meta = meta.new_empty(size * rows, 2 * top_k)  # [W * C, 2K]
    dist.all_gather_into_tensor(all_meta, meta, group=group)
    all_x = hidden_states.new_empty(size * rows, hidden_states.shape[1])  # [W * C, H]
    dist.all_gather_into_tensor(all_x, hidden_states.contiguous(), group=group)
    return Gathered(all_x, all_meta[:, :top_k].contiguous(), all_meta[:, top_k:].contiguous().view(torch.float32))


def combine_gathered(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's expert output for every rank's rows (W * C, H), summed over the EP ranks and
    scattered home: a fresh (C, H). Summed in float32 and rounded once, as `combine` does."""
    size = dist.get_world_size(group)
    out = torch.empty(partial.shape[0] // size, partial.shape[1], dtype=torch.float32, device=partial.device)  # [C, H]
    reduce_scatter_single(out, partial.float().contiguous(), group=group)
    return out.to(partial.dtype)  # [C, H]


def _check_same_rows(rows: int, size: int, group: dist.ProcessGroup, device: torch.device) -> None:
    counts = torch.empty(size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(counts, torch.tensor([rows], dtype=torch.int64, device=device), group=group)
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"the gathered EP dispatch (CUDA-graph decode) needs the same number of rows on every EP "
                         f"rank, got {counts.tolist()}: pad every rank's batch to one size (DecodeGraphRunner "
                         "does, when every rank calls setup() with the same max_batch)")
