"""`perf/step_time_max_over_median`: the slowest rank's busy step time over the median rank's.

Why: a node that slows down (thermal throttling, a failing link, a noisy neighbour) is the usual
prelude to a hang, and it shows first as one rank taking longer than the rest. A rank's wall
time per step cannot show it: a synchronous job's collectives make every rank wait for the
slowest, so all wall times equal the slowest one's. What differs is the time a rank spends
outside those waits (``parallel/observe/wait_clock.py``): its busy time, its step time minus the time
it sat blocked on its peers (DP gradient sync, TP collectives, pipeline sends and receives, the
loss and grad-norm reductions). The slow rank's busy time is longer; its peers' waits grow
instead.

Every `log_interval` each rank contributes its mean busy time per step of the interval to one
all-gather of one number per rank (on the world group, on log steps only: those already read
the loss, so reading the wait clock's device events adds no sync), and the metrics rank logs
max / median. 1.0 is a balanced job. One rank whose work takes d seconds longer than its
peers' c shows (c + d) / c when the median is one of its peers (3 ranks or more), (c + d) /
(c + d/2) with 2 ranks (the median is then the mean of both). Pipeline stages doing unequal
work (the last one computes the loss) and the bubble of the first and last micro-batches show
as an imbalance too: compare the value with the job's own history, not with 1.0 alone.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from nanotrain.parallel import collectives
from nanotrain.parallel.observe.wait_clock import WAITS


def step_time_max_over_median(interval_s: float, steps: int, device: torch.device, group=None) -> float:
    """Every rank calls it at the same step with the summed wall time of its last ``steps``
    steps; returns max / median over the ranks of the mean busy time per step (wall time less
    the waits ``WAITS`` recorded in those steps). Reads (and so restarts) the wait clock."""
    busy = max(float(interval_s) - WAITS.read(), 0.0) / max(int(steps), 1)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 1.0
    mine = torch.tensor([busy], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    collectives.all_gather(out, mine, group=group, what="all_gather busy step times (stragglers)")
    times = torch.cat(out).tolist()
    median = statistics.median(times)
    return max(times) / median if median > 0 else 1.0
