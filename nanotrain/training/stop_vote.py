"""The per-step agreement of all ranks — stop (and why), the numbers went non-finite, a save is
still being written — without a host sync on a silent step.

A stop signal reaches some ranks only, a NaN is seen first where the loss lives and an async save
ends at different times on each rank, yet every rank must take the same branch at the same step
(save, stop, commit) or the others wait forever in the next collective. One all-reduce (MAX) of
four numbers per step settles it: the strongest stop code (``runtime.preemption``), whether the
step's loss or gradient norm was non-finite (and the step not skipped: ``training/spike.py``),
whether any rank's background checkpoint write (``checkpoints.async_save``) is still running
(the first settled vote in which none is makes every rank commit that save at the same step),
and whether the step was skipped (the host learns it here, a step late, at no extra sync).

The vote is read a step late (``settle(latest=False)``): the flags are written on the device
(``isfinite``, ``fill_``: no copy from pageable memory, which would wait for the stream), the
all-reduce is posted asynchronously, and on a GPU its result is copied to pinned memory behind an
event, so a silent step never waits for its own kernels. A stop thus lands one step after the
signal, well inside any signal delay, on every rank at the same step. A step that saves reads its
own vote first (``latest=True``): a non-finite step has already poisoned the weights, and saving
it would overwrite the last finite checkpoint.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from nanotrain.parallel import accelerator, collectives
from nanotrain.parallel.observe.hang_record import HANG_RECORD


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became non-finite at ``step``; nothing was saved after it."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(
            f"training diverged at step {step}: loss {loss:g}, grad norm {grad_norm:g} "
            "(not finite); stopped without saving this step"
        )


class SpikesPersist(TrainingDiverged):
    """`training.spike.policy: rewind` cannot rewind any more at ``step`` (``why``), or
    ``training.spike.max_consecutive_skips`` steps in a row were skipped (``rewinding`` False);
    ends the run as a divergence does (exit 3), with the last checkpoint kept."""

    def __init__(self, step: int, why: str, rewinding: bool = True):
        how = " and cannot rewind" if rewinding else ""
        RuntimeError.__init__(self, f"training spiked at step {step}{how}: {why}")
        self.step, self.loss, self.grad_norm = step, float("nan"), float("nan")


class StopVote:
    """``post`` every step, then ``settle``; see the module doc."""

    def __init__(self, stop_code: Callable[[], int], device: torch.device, group=None):
        self.stop_code, self.device, self.group = stop_code, torch.device(device), group
        self.acc = accelerator.of(self.device)  # None: the CPU, where work is done at the call
        # (step, work, flags, host copy and its event (None on the CPU), loss, grad norm) per vote
        self._pending: list[tuple] = []
        self.last_settled = (-1, False)  # (step, any rank still writing) of the latest vote read
        self.skips: list[tuple[int, list]] = []  # (step, values) of the skipped steps read, for the trainer

    def post(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        writing: bool = False,
        skipped: Optional[torch.Tensor] = None,
        values: Optional[torch.Tensor] = None,
    ) -> None:
        """Start this step's vote (asynchronous; nothing waits for the device here). ``writing``:
        this rank's background checkpoint write is still running (``checkpoints.async_save``).
        ``skipped``: the step's skip decision (``training/spike.py``; the same on every rank): a
        skipped step changed nothing, so its non-finite numbers are no divergence; ``values``:
        what to hand back with a skipped step (``skips``), copied to the host with the flags."""
        bad = ~(torch.isfinite(loss.detach().float()) & torch.isfinite(grad_norm.detach().float()))
        if skipped is not None:
            bad = bad & ~(skipped > 0)
        flags = torch.zeros(4, dtype=torch.float32, device=self.device)  # stop code, non-finite, writing, skipped
        flags[0].fill_(float(self.stop_code()))
        flags[1:2].copy_(bad.reshape(1))  # on the device
        flags[2].fill_(float(writing))
        if skipped is not None:
            flags[3:4].copy_(skipped.reshape(1))
        work = None
        if dist.is_available() and dist.is_initialized():
            work = collectives.all_reduce(
                flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True, what="all_reduce stop vote"
            )
        host = event = None
        if self.acc is not None:
            if work is not None:
                work.wait()  # the device's stream waits for the all-reduce; the host does not
            host = self.acc.pinned_empty((4,), flags.dtype)
            host.copy_(flags, non_blocking=True)
            if values is not None:  # the record of a skipped step: behind the same event
                values = self.acc.pinned_empty(tuple(values.shape), values.dtype).copy_(values, non_blocking=True)
            event = self.acc.Event()
            event.record()
        self._pending.append((step, work, flags, host, event, loss, grad_norm, values))

    def settle(self, latest: bool) -> int:
        """Read the votes posted so far — all of them (``latest``: this step's too, before a
        save) or all but the newest — and return the strongest stop code. Raises
        TrainingDiverged for the first step whose loss or grad norm was non-finite."""
        ready = self._pending if latest else self._pending[:-1]
        self._pending = [] if latest else self._pending[-1:]
        code = 0
        for step, work, flags, host, event, loss, grad_norm, values in ready:
            if event is not None:
                HANG_RECORD.entering("wait all_reduce stop vote", self.group)
                event.synchronize()  # this vote's copy to the host, not the steps queued after it
                stop, bad, writing, skipped = host.tolist()
            else:
                if work is not None:
                    HANG_RECORD.entering("wait all_reduce stop vote", self.group)
                    collectives.wait(work)
                stop, bad, writing, skipped = flags.tolist()
            self.last_settled = (step, writing > 0)  # (its step, a rank still writing a checkpoint)
            if bad > 0:
                self._pending = []
                raise TrainingDiverged(step, float(loss), float(grad_norm))
            if skipped > 0:
                self.skips.append((step, values.tolist() if values is not None else []))
            code = max(code, int(stop))
        return code

    def close(self) -> Optional[int]:
        """Complete every vote in flight (all ranks call it: the all-reduces must finish)."""
        return self.settle(latest=True) if self._pending else None
