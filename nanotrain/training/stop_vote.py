"""All ranks agree to stop at the same step, without a host sync per step.

A stop request (a preemption signal) reaches some ranks only, so the ranks vote: each step posts
an asynchronous MAX all-reduce of the local flag, and the NEXT step reads it. Reading a fresh
all-reduce right away would make the host wait for the whole step's kernels every step on a GPU
(the all-reduce is queued behind them) and the host could never run ahead to launch the next
step; one step later it is done, or nearly. The price is one more step before the save, well
inside any signal delay (SLURM's is tens of seconds). Every rank reads the same reduced value
at the same step, so they stop together.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


class StopVote:
    def __init__(self, requested: Callable[[], bool], device: torch.device, group=None):
        self.requested, self.device, self.group = requested, device, group
        self._pending: Optional[tuple[object, torch.Tensor]] = None

    def poll(self) -> bool:
        """Post this step's vote; return the outcome of the previous step's vote."""
        agreed = self._read()
        flag = torch.tensor([1.0 if self.requested() else 0.0], device=self.device)
        work = None
        if dist.is_available() and dist.is_initialized():
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, flag)
        return agreed

    def close(self) -> None:
        """Complete the vote in flight (every rank calls it: the all-reduce must finish)."""
        self._read()

    def _read(self) -> bool:
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        return bool(flag.item() > 0)
