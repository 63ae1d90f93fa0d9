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

Repeated stragglers (``StragglerWatch``, with ``slurm.health`` on): the same all-gather gives
every rank every rank's busy time; a rank busy more than ``slurm.health.straggler_slowdown`` x the
lower median of the ranks of its own pipeline stage (they do the same work: tp shards, dp and cp
replicas; stages differ by design) in ``straggler_intervals`` log intervals in a row names its
node: the logging rank appends it to ``<run>/health/stragglers.jsonl`` and says so, and the next
requeue of the job (a preemption, a time limit, a hang) excludes it (``runtime/exclusions.py``).
A straggler alone does not requeue the job: a restart costs more than a slow node, until the
scheduler ends the run anyway.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nanotrain.parallel import collectives
from nanotrain.parallel.observe.hang_record import HANG_RECORD
from nanotrain.parallel.observe.wait_clock import WAITS


def step_time_max_over_median(
    interval_s: float, steps: int, device: torch.device, group=None, watch: Optional["StragglerWatch"] = None
) -> float:
    """Every rank calls it at the same step with the summed wall time of its last ``steps``
    steps; returns max / median over the ranks of the mean busy time per step (wall time less
    the waits ``WAITS`` recorded in those steps). Reads (and so restarts) the wait clock.
    ``watch``: told every rank's busy time (world group only)."""
    busy = max(float(interval_s) - WAITS.read(), 0.0) / max(int(steps), 1)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 1.0
    mine = torch.tensor([busy], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    collectives.all_gather(out, mine, group=group, what="all_gather busy step times (stragglers)")
    times = torch.cat(out).tolist()
    if watch is not None and group is None:
        watch.observe(times)
    median = statistics.median(times)
    return max(times) / median if median > 0 else 1.0


class StragglerWatch:
    """Names the node of a rank that straggles in ``intervals`` log intervals in a row (see the
    module doc). ``stage_of[r]``: rank r's pipeline stage; ``node_of(r)``: its node (None: not
    known); ``writer``: this rank records and prints (the logging rank)."""

    def __init__(
        self,
        stage_of: list[int],
        node_of: Callable[[int], Optional[str]],
        slowdown: float,
        intervals: int,
        run_dir: Path,
        writer: bool,
    ):
        self.stage_of, self.node_of = list(stage_of), node_of
        self.slowdown, self.intervals = float(slowdown), int(intervals)
        self.path = Path(run_dir) / "health" / "stragglers.jsonl"
        self.writer = writer
        self.streak = [0] * len(self.stage_of)
        self.named: list[dict] = []

    def ratios(self, times: list[float]) -> list[Optional[float]]:
        """Each rank's busy time over the lower median of its stage's ranks (None: alone)."""
        stages: dict[int, list[float]] = {}
        for rank, t in enumerate(times):
            stages.setdefault(self.stage_of[rank], []).append(t)
        out: list[Optional[float]] = []
        for rank, t in enumerate(times):
            peers = stages[self.stage_of[rank]]
            median = statistics.median_low(peers) if len(peers) > 1 else 0.0
            out.append(t / median if median > 0 else None)
        return out

    def observe(self, times: list[float]) -> list[dict]:
        """One log interval's busy times (rank order); returns the nodes named now."""
        if len(times) != len(self.streak):
            return []
        named_nodes = {e["node"] for e in self.named}
        found = []
        for rank, ratio in enumerate(self.ratios(times)):
            self.streak[rank] = self.streak[rank] + 1 if ratio is not None and ratio > self.slowdown else 0
            node = self.node_of(rank)
            if self.streak[rank] == self.intervals and node and node not in named_nodes:
                entry = {
                    "node": node,
                    "rank": rank,
                    "ratio": round(ratio, 3),
                    "step": HANG_RECORD.step,
                    "why": (
                        f"rank {rank} busy {ratio:.2f}x its pipeline stage's median in {self.intervals} log "
                        f"interval(s) in a row (slurm.health.straggler_slowdown {self.slowdown:g}), "
                        f"step {HANG_RECORD.step}"
                    ),
                    "job_id": os.environ.get("SLURM_JOB_ID"),
                    "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                    "time": time.time(),
                }
                named_nodes.add(node)
                self.named.append(entry)
                found.append(entry)
        if self.writer:
            for entry in found:
                self._record(entry)
        return found

    def _record(self, entry: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as fh:
                fh.write(json.dumps(entry) + "\n")
        except OSError as exc:  # a record is advice: never stop training for it
            print(f"stragglers: cannot write {self.path}: {exc}", file=sys.stderr, flush=True)
        print(f"stragglers: node {entry['node']}: {entry['why']}; excluded at the next requeue", flush=True)
