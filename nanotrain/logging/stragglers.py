"""`perf/step_time_max_over_median`: the slowest rank's step time over the median rank's.

Why: a node that slows down (thermal throttling, a failing link, a noisy neighbour) is the usual
prelude to a hang, and it shows first as one rank taking longer than the rest. Every
`log_interval` each rank contributes its mean step time of the interval to one all-gather of
one number per rank (on the world group, on log steps only: those already read the loss), and
the metrics rank logs max / median. 1.0 is a balanced job; a synchronous job's collectives pull
every rank's wall time towards the slowest, so a value above ~1.1 means one rank's host is
already behind the others (it spends its time elsewhere than waiting for its peers).
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from nanotrain.parallel import collectives


def step_time_max_over_median(mean_step_s: float, device: torch.device, group=None) -> float:
    """Every rank calls it at the same step; returns max / median of the ranks' step times."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 1.0
    mine = torch.tensor([float(mean_step_s)], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    collectives.all_gather(out, mine, group=group, what="all_gather step times (stragglers)")
    times = torch.cat(out).tolist()
    median = statistics.median(times)
    return max(times) / median if median > 0 else 1.0
