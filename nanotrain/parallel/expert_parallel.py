"""Expert parallelism: send each token to the ep rank holding its expert, and the result back.

Rank ``r`` of ``ep_pg`` holds experts ``[r * E/ep, (r + 1) * E/ep)``. ``dispatch_to_experts``
takes this rank's assignments already grouped by (global) expert and:

1. exchanges the per-expert counts (one ``all_to_all_single`` of E integers: rank r learns how
   many rows every source sends to each of its local experts) — the split sizes of step 2 need
   them on the host (one device sync per MoE layer and direction, as in Megatron's dropless
   all-to-all dispatcher);
2. sends the rows with ``all_to_all_single`` and variable splits (``collectives.all_to_all``,
   differentiable: its backward is the reverse exchange);
3. regroups the received rows from (source, expert) order to (expert, source) order, runs the
   local experts, undoes the regrouping, and sends the outputs back the same way.

Every source sends its rows of one expert in its own order and they are concatenated in source
order, so the experts see, for any ep, the rows of the single-process model in a fixed order.
gloo (torch 2.13, checked) and NCCL both implement ``all_to_all_single`` with variable splits, so
one path serves both. An ep group of one does no communication.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from nanotrain.parallel.collectives import all_to_all, all_to_all_single
from nanotrain.parallel.part.adopt import Adopting
from nanotrain.parallel.sharding import row_shard_info, set_shard_info
from nanotrain.parallel.tensor_parallel import group_rank, group_size


def _ep_size(ep_pg) -> int:
    return 1 if ep_pg is None or not dist.is_initialized() else dist.get_world_size(ep_pg)


def exchange_counts(counts: list[int], ep_pg, device) -> list[list[int]]:
    """``recv[s][e]``: rows source rank s sends to this rank's local expert e."""
    ep = _ep_size(ep_pg)
    local = len(counts) // ep
    send = torch.tensor(counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    all_to_all_single(recv, send, ep_pg, what="all_to_all expert counts")
    flat = recv.tolist()
    return [flat[s * local : (s + 1) * local] for s in range(ep)]


def dispatch_to_experts(
    x: torch.Tensor, counts: list[int], ep_pg, experts: Callable[[torch.Tensor, list[int]], torch.Tensor]
) -> torch.Tensor:
    """``experts(rows, counts_per_local_expert)`` applied to every row of ``x`` [N, H] (grouped by
    global expert, ``counts[e]`` rows each) on the rank holding its expert; returns [N, H] in
    ``x``'s order."""
    ep = _ep_size(ep_pg)
    if ep == 1:
        return experts(x, counts)
    local = len(counts) // ep
    recv = exchange_counts(counts, ep_pg, x.device)
    send_splits = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]
    recv_splits = [sum(row) for row in recv]
    received = all_to_all(x, recv_splits, send_splits, ep_pg)
    # (source, expert) blocks -> (expert, source) blocks: a stable sort of the rows by block key
    sizes = torch.tensor([recv[s][e] for s in range(ep) for e in range(local)], dtype=torch.int64)
    keys = torch.tensor([e * ep + s for s in range(ep) for e in range(local)], dtype=torch.int64)
    perm = torch.argsort(keys.repeat_interleave(sizes), stable=True).to(x.device)
    per_expert = [sum(recv[s][e] for s in range(ep)) for e in range(local)]
    out_local = experts(received.index_select(0, perm), per_expert)
    back = out_local.index_select(0, torch.argsort(perm))
    return all_to_all(back, send_splits, recv_splits, ep_pg)


class ExpertParallel(Adopting):
    """An experts module (``experts(rows, counts)``; stacked ``gate_up`` / ``down`` weights
    ``[E, ...]``) cut to this rank's experts ``[r * E/ep, (r + 1) * E/ep)`` and wrapped in the
    exchange of rows with the other ep ranks (``dispatch_to_experts``). Call on the meta device:
    the stacked weights are replaced by this rank's slice, recorded on the expert axis ("ep") of
    the full tensors, so checkpoints and resharding see one tensor per layer."""

    def __init__(self, experts: nn.Module, ep_pg):
        super().__init__(experts)
        self.ep_pg = ep_pg
        ep, rank = group_size(ep_pg), group_rank(ep_pg)
        for stacked in experts.children():
            weight = getattr(stacked, "weight", None)
            if weight is None:
                continue
            full = tuple(weight.shape)
            if full[0] % ep:
                raise ValueError(f"{full[0]} experts cannot be split evenly over ep={ep}")
            local = nn.Parameter(torch.empty((full[0] // ep, *full[1:]), device=weight.device, dtype=weight.dtype))
            local.__dict__.update(weight.__dict__)  # marks set by earlier steps (sequence parallel) stay
            set_shard_info(local, row_shard_info(full, 0, (full[0],), rank, ep, axis="ep"))
            stacked.weight = local

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return dispatch_to_experts(x, counts, self.ep_pg, self.inner)
