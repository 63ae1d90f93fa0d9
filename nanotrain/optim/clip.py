"""Global gradient-norm clipping across tensor, pipeline (and expert) parallel ranks.

The norm is the one of the whole, unsharded model, what ``torch.nn.utils.clip_grad_norm_`` would
return on one device. Each rank takes the norms of the gradients it is responsible for (torch's
foreach kernel, in at least fp32), sums their squares in float64, and ONE all-reduce over the
model-parallel group ``pc.mp_pg`` (ep x pp x tp: one copy of the model, ``grid.py``) adds them:

* a parameter sharded over tp (``ShardInfo.axis`` contains "tp") counts its local elements on every
  tp rank; one replicated over tp counts only on tp rank 0 (exact; it assumes the gradient is
  identical on every tp rank: sequence-parallel norms must be tp-reduced first). The same for ep;
* each pipeline stage counts its own parameters; a tied replica on the last stage
  (``pipeline_parallel.tied``) is skipped, so the tied matrix counts once;
* dp / cp replicas hold identical, averaged gradients and are not in ``mp_pg``: no dp reduction;
* under ZeRO-1 each dp rank holds the average only on the pieces it owns (``shards``, from
  ``grad_sync.grad_shards()``): their squares are first summed over the sync's group (one
  2-element fp64 all-reduce per sync), then go into the same model-parallel sum; a parameter
  replicated over ep counts on ep rank 0 only after that sum; the tp and tied rules hold per piece.
  Under ZeRO-2 the pieces are the sync's accumulator (the parameters have no ``.grad``): the
  same sums, and clipping scales the accumulator.

Then every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``, as torch does.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from nanotrain.parallel import collectives
from nanotrain.parallel.parallel_context import ParallelContext
from nanotrain.parallel.pipeline_parallel.tied import is_tied_replica
from nanotrain.parallel.sharding import get_shard_info

_REPLICA_AXES = ("tp", "ep")  # mp axes whose ranks may hold copies of the same parameter


def _sharded_over(p: torch.Tensor, axis: str) -> bool:
    info = get_shard_info(p)
    return bool(info.axis) and axis in info.axis.split("_")


def _counted_here(p: torch.Tensor, pc: ParallelContext, axes: tuple[str, ...] = _REPLICA_AXES) -> bool:
    if is_tied_replica(p):
        return False
    rank = {"tp": pc.tp_rank, "ep": pc.ep_rank}
    return all(_sharded_over(p, ax) or rank[ax] == 0 for ax in axes)


def _sum_of_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for grads in _by_device_and_dtype(tensors).values():
        # One fused kernel per (device, dtype) for the per-tensor norms (accumulated in >= fp32,
        # fp64 for fp64 grads); their squares are summed in fp64.
        norms = torch._foreach_norm(grads, 2, dtype=torch.promote_types(grads[0].dtype, torch.float32))
        sq += torch.stack(norms).double().pow(2).sum()
    return sq


def _sharded_sum_of_squares(shards, pc: Optional[ParallelContext], device) -> torch.Tensor:
    """This rank's share of the squares of one reduce-scattered sync's parameters (module doc)."""
    over_ep, others = [], []
    for p, grad in shards.piece_grads():
        if pc is None or _counted_here(p, pc, ("tp",)):
            (over_ep if _sharded_over(p, "ep") else others).append(grad)
    part = torch.stack([_sum_of_squares(over_ep, device), _sum_of_squares(others, device)])
    if dist.get_world_size(shards.group) > 1:
        collectives.all_reduce(part, op=dist.ReduceOp.SUM, group=shards.group, what="all_reduce grad norm over dp")
    return part[0] + part[1] if pc is None or pc.ep_rank == 0 else part[0]


def global_grad_norm(params: Iterable[torch.Tensor], pc: Optional[ParallelContext] = None, shards=None) -> torch.Tensor:
    """L2 norm of the full model's gradient (fp32 0-d tensor; see module doc). ``pc`` None =
    one process holding the whole model. ``shards``: ``grad_sync.grad_shards()`` (None: every
    gradient holds the full average)."""
    params = list({id(p): p for p in params if p.grad is not None}.values())  # tied: once
    held = [p.grad for p in params] + [t for sh in shards or () for t in sh.tensors or ()]
    device = held[0].device if held else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    covered: set[int] = set()
    for sh in shards or ():
        covered.update(id(p) for p in sh.params)
        sq += _sharded_sum_of_squares(sh, pc, device)
    counted = [p.grad.detach() for p in params if id(p) not in covered and (pc is None or _counted_here(p, pc))]
    sq += _sum_of_squares(counted, device)
    group = None if pc is None else pc.mp_pg
    if group is not None and dist.get_world_size(group) > 1:
        collectives.all_reduce(sq, op=dist.ReduceOp.SUM, group=group, what="all_reduce grad norm")
    return sq.sqrt().float()


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: Optional[float], pc: Optional[ParallelContext] = None, shards=None
) -> torch.Tensor:
    """Clip gradients in place to the global norm ``max_norm``; return the norm before clipping.

    ``params``: this rank's parameters (after the dp gradient sync). ``max_norm`` None or <= 0
    only computes the norm (for logging). ``shards``: see ``global_grad_norm``. Must be called
    by every rank of ``pc.mp_pg`` (and, with ``shards``, of their groups).
    """
    params = list({id(p): p for p in params if p.grad is not None}.values())
    total_norm = global_grad_norm(params, pc, shards)
    if max_norm is None or max_norm <= 0:
        return total_norm
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    owned = [t for sh in shards or () for t in sh.tensors or ()]  # ZeRO-2's accumulator
    for (device, dtype), grads in _by_device_and_dtype([p.grad.detach() for p in params] + owned).items():
        torch._foreach_mul_(grads, clip_coef.to(device, dtype))
    return total_norm


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups
