"""The MoE layers' routing statistics of one step, reduced over the pipeline for TensorBoard."""

from __future__ import annotations

import torch
import torch.distributed as _dist

from nanotrain.models.moe import MoEState
from nanotrain.parallel import accelerator, collectives


def _comm_device(pp_pg, reduce: bool) -> torch.device:
    """Where the statistics meet over ``pp_pg`` (the CPU when nothing is reduced)."""
    return accelerator.comm_device(pp_pg) if reduce else torch.device("cpu")


def step_scalars(state: MoEState, pp_pg=None, capacity: bool = False) -> dict[str, float]:
    """TensorBoard scalars of one step's routing, over every MoE layer of the pipeline (summed
    over ``pp_pg``: each stage holds some layers) for this rank's tokens (its dp/ep replica; its
    sequence shard under cp or REDUCE_SCATTER). ``moe/aux_loss`` and ``moe/z_loss``: means over
    (micro-batch, layer); ``moe/load_max_over_mean``: per layer the busiest expert's assignments
    over the mean (1 = balanced), summed over the step's micro-batches, max over layers;
    ``moe/dropped_tokens`` (capacity set): assignments dropped in the step. Every rank of
    ``pp_pg`` must call it (one all-reduce of 4 values, one of 1). The statistics are summed on
    their device and read back once (one host sync per call)."""
    reduce = pp_pg is not None and _dist.is_initialized() and _dist.get_world_size(pp_pg) > 1
    stats = state.stats
    device = stats[0]["aux"].device if stats else _comm_device(pp_pg, reduce)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if stats:
        aux, z = torch.stack([v for st in stats for v in (st["aux"], st["z"])]).view(-1, 2).double().sum(0)
    else:
        aux, z = zero, zero
    counts = [float(len(stats)), float(sum(st["dropped"] for st in stats))]  # host ints already
    sums = torch.cat([torch.stack([aux, z]), torch.tensor(counts, dtype=torch.float64, device=device)])
    by_layer: dict[int, list[torch.Tensor]] = {}
    for st in stats:
        by_layer.setdefault(st["layer"], []).append(st["load"])
    if by_layer:  # [L, E] assignments per (layer, expert) over the step's micro-batches
        loads = torch.stack([torch.stack(v).sum(0) for v in by_layer.values()]).double()
        ratio = torch.where(loads.sum(1) > 0, loads.amax(1) / loads.mean(1), zero)
        peak = ratio.max().reshape(1)  # ratios are >= 1 where counted: 0 = no assignment at all
    else:
        peak = zero.reshape(1)
    if reduce:
        comm = _comm_device(pp_pg, reduce)
        sums, peak = sums.to(comm), peak.to(comm)
        collectives.all_reduce(sums, group=pp_pg, what="all_reduce moe stats")
        collectives.all_reduce(peak, op=_dist.ReduceOp.MAX, group=pp_pg, what="all_reduce moe load peak")
    aux_sum, z_sum, n, dropped, worst = torch.cat([sums, peak]).tolist()
    count = max(n, 1.0)
    out = {"moe/aux_loss": aux_sum / count, "moe/z_loss": z_sum / count, "moe/load_max_over_mean": worst}
    if capacity:
        out["moe/dropped_tokens"] = dropped
    return out
