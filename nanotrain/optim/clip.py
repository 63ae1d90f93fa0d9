"""Global gradient-norm clipping across tensor, pipeline (and expert) parallel ranks.

The norm must be the one of the whole, unsharded model, i.e. what ``torch.nn.utils.
clip_grad_norm_`` would return on one device. Each rank takes the norms of the gradients it is
responsible for (torch's fused foreach kernel, in at least fp32), sums their squares in float64,
and ONE all-reduce over the model-parallel group ``pc.mp_pg``
(ep x pp x tp: the ranks that together hold exactly one copy of the model, see ``grid.py``) adds
them up:

* a parameter sharded over tp (``ShardInfo.axis`` contains "tp") contributes its local elements on
  every tp rank: the shards are disjoint pieces of the full tensor;
* a parameter replicated over tp (``axis`` None) contributes only on tp rank 0. This is exact (no
  division by tp and no rounding), and assumes its gradient is identical on every tp rank, which
  holds once the tp layers have reduced it (sequence-parallel norms must be tp-reduced before
  clipping, as they must before the optimizer step anyway). The same rule applies to ep: a
  parameter not sharded over "ep" counts only on ep rank 0;
* pipeline stages hold different parameters: each counts its own, the all-reduce adds them. A
  parameter tied across stages (embeddings on the first and last stage) has a replica on the last
  stage (``pipeline_parallel.tied``): the replica is skipped, so the tied matrix counts once;
* dp / cp replicas hold identical, already averaged gradients: they are not in ``mp_pg``, so each
  replica computes the same norm and no dp reduction is needed.

Then every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``, as torch does.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from nanotrain.parallel import collectives
from nanotrain.parallel.pipeline_parallel.tied import is_tied_replica
from nanotrain.parallel.sharding import get_shard_info

_REPLICA_AXES = ("tp", "ep")  # mp axes whose ranks may hold copies of the same parameter


def _counted_here(p: torch.Tensor, pc) -> bool:
    if is_tied_replica(p):
        return False
    info = get_shard_info(p)
    sharded_over = set(info.axis.split("_")) if info.axis else set()
    return all(ax in sharded_over or getattr(pc, f"{ax}_rank", 0) == 0 for ax in _REPLICA_AXES)


def global_grad_norm(params: Iterable[torch.Tensor], pc=None) -> torch.Tensor:
    """L2 norm of the full model's gradient (fp32 0-d tensor; see module doc). ``pc`` None =
    one process holding the whole model."""
    params = list({id(p): p for p in params if p.grad is not None}.values())  # tied: once
    device = params[0].grad.device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    counted = [p.grad.detach() for p in params if pc is None or _counted_here(p, pc)]
    for grads in _by_device_and_dtype(counted).values():
        # One fused kernel per (device, dtype) for the per-tensor norms (accumulated in >= fp32,
        # fp64 for fp64 grads); their squares are summed in fp64.
        norms = torch._foreach_norm(grads, 2, dtype=torch.promote_types(grads[0].dtype, torch.float32))
        sq += torch.stack(norms).double().pow(2).sum()
    group = getattr(pc, "mp_pg", None)
    if group is not None and dist.get_world_size(group) > 1:
        collectives.all_reduce(sq, op=dist.ReduceOp.SUM, group=group, what="all_reduce grad norm")
    return sq.sqrt().float()


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: Optional[float], pc=None) -> torch.Tensor:
    """Clip gradients in place to the global norm ``max_norm``; return the norm before clipping.

    ``params``: this rank's parameters (after the dp gradient sync). ``max_norm`` None or <= 0
    only computes the norm (for logging). Must be called by every rank of ``pc.mp_pg``.
    """
    params = list({id(p): p for p in params if p.grad is not None}.values())
    total_norm = global_grad_norm(params, pc)
    if max_norm is None or max_norm <= 0:
        return total_norm
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for (device, dtype), grads in _by_device_and_dtype([p.grad.detach() for p in params]).items():
        torch._foreach_mul_(grads, clip_coef.to(device, dtype))
    return total_norm


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups
