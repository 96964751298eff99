"""EP dispatch and combine: synced (eager: split sizes read on the host), or gathered (capturable:
every rank's C rows to each of the W ranks, none can overflow, at W * C rows vs ~min(K, W) * T)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .groups import reduce_scatter_single


@dataclass(frozen=True)
class DispatchPlan:
    num_tokens: int  # T on this rank
    send_token: torch.Tensor  # [Ts] int64 source token of each sent row; by destination, then token
    send_counts: tuple[int, ...]  # send_counts[r]: rows sent to EP rank r (Ts in all)
    recv_counts: tuple[int, ...]  # recv_counts[r]: rows received from EP rank r (Tr in all)


@dataclass(frozen=True)
class Dispatched:
    hidden_states: torch.Tensor  # [Tr, H] received rows, grouped by source rank
    topk_ids: torch.Tensor  # [Tr, K] int32 local expert ids; -1 where the expert lives elsewhere
    topk_weights: torch.Tensor  # [Tr, K] float32
    plan: DispatchPlan


def dispatch(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             experts_per_rank: int, group: dist.ProcessGroup) -> Dispatched:
    """Each token (T, H) once to each EP rank owning one of its experts; ids not in [0, E): none."""
    size = dist.get_world_size(group)
    num_tokens, top_k = topk_ids.shape
    hidden = hidden_states.shape[1]
    num_experts = experts_per_rank * size
    valid = (topk_ids >= 0) & (topk_ids < num_experts)  # [T, K]
    owner = torch.where(valid, topk_ids.long() // experts_per_rank, size)  # [T, K]; `size`: nowhere
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
    meta = torch.cat([local_ids.int(), topk_weights[send_token].float().view(torch.int32)],
                     dim=1)  # [Ts, 2K]
    recv_meta = meta.new_empty(received, 2 * top_k)  # [Tr, 2K]
    dist.all_to_all_single(recv_meta, meta, list(recv_counts), list(send_counts), group=group)
    recv_x = hidden_states.new_empty(received, hidden)  # [Tr, H]
    dist.all_to_all_single(recv_x, hidden_states[send_token], list(recv_counts), list(send_counts),
                           group=group)

    plan = DispatchPlan(num_tokens, send_token, send_counts, recv_counts)
    recv_ids = recv_meta[:, :top_k].contiguous()  # [Tr, K]
    recv_weights = recv_meta[:, top_k:].contiguous().view(torch.float32)  # [Tr, K]
    return Dispatched(recv_x, recv_ids, recv_weights, plan)


def combine(expert_out: torch.Tensor, plan: DispatchPlan, group: dist.ProcessGroup) -> torch.Tensor:
    """Each row's weighted output (Tr, H) home, summed per token: a fresh (T, H), 0 if unrouted."""
    hidden = expert_out.shape[1]
    back = expert_out.new_empty(len(plan.send_token), hidden)  # [Ts, H]
    dist.all_to_all_single(back, expert_out.contiguous(), list(plan.send_counts),
                           list(plan.recv_counts), group=group)
    # float32 sum of a token's (at most min(K, W)) rows, rounded once at the end
    out = torch.zeros(plan.num_tokens, hidden, dtype=torch.float32,
                      device=expert_out.device)  # [T, H]
    return out.index_add_(0, plan.send_token, back.float()).to(expert_out.dtype)


@dataclass(frozen=True)
class Gathered:
    hidden_states: torch.Tensor  # [W * C, H] every EP rank's rows, rank after rank (a strided view)
    topk_ids: torch.Tensor  # [W * C, K] int32 global ids
    topk_weights: torch.Tensor  # [W * C, K] float32


def dispatch_gathered(hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, group: dist.ProcessGroup) -> Gathered:
    """This rank's C rows (C, H), ids and weights to every EP rank. Every rank must hold the same C:
    checked outside a capture (one host read), so a mismatch is a ValueError rather than a hang."""
    size = dist.get_world_size(group)
    rows, top_k = topk_ids.shape
    if not (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_same_rows(rows, size, group, hidden_states.device)
    meta = torch.cat([topk_ids.int(), topk_weights.float().view(torch.int32)], dim=1)  # [C, 2K]
    hidden = hidden_states.shape[1]
    x_bytes = hidden * hidden_states.element_size()
    if x_bytes % meta.element_size():  # the ids could not start on a 4-byte boundary: apart
        all_meta = meta.new_empty(size * rows, 2 * top_k)  # [W * C, 2K]
        dist.all_gather_into_tensor(all_meta, meta, group=group)
        all_x = hidden_states.new_empty(size * rows, hidden)  # [W * C, H]
        dist.all_gather_into_tensor(all_x, hidden_states.contiguous(), group=group)
    else:  # one collective: each row's hidden state, ids and weights side by side as bytes
        packed = torch.cat([hidden_states.contiguous().view(torch.uint8).view(rows, x_bytes),
                            meta.view(torch.uint8).view(rows, 8 * top_k)], dim=1)  # [C, bytes]
        everything = packed.new_empty(size * rows, packed.shape[1])  # [W * C, bytes]
        dist.all_gather_into_tensor(everything, packed, group=group)
        all_x = everything[:, :x_bytes].view(hidden_states.dtype)  # [W * C, H], strided rows
        all_meta = everything[:, x_bytes:].view(torch.int32)  # [W * C, 2K]
    return Gathered(all_x, all_meta[:, :top_k].contiguous(),
                    all_meta[:, top_k:].contiguous().view(torch.float32))


def combine_gathered(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Partials (W * C, H) summed over EP ranks in float32, scattered home: a fresh (C, H)."""
    size = dist.get_world_size(group)
    out = torch.empty(partial.shape[0] // size, partial.shape[1], dtype=torch.float32,
                      device=partial.device)  # [C, H]
    reduce_scatter_single(out, partial.float().contiguous(), group=group)
    return out.to(partial.dtype)


def _check_same_rows(rows: int, size: int, group: dist.ProcessGroup, device: torch.device) -> None:
    counts = torch.empty(size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(counts, torch.tensor([rows], dtype=torch.int64, device=device),
                                group=group)
    if len(set(counts.tolist())) != 1:
        raise ValueError("the gathered EP dispatch (CUDA-graph decode) needs the same number of "
                         f"rows on every EP rank, got {counts.tolist()}: pad every rank's batch to "
                         "one size (DecodeGraphRunner does, when every rank calls setup() with the "
                         "same max_batch)")
