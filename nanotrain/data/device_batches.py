"""Each step's micro-batches on the training device, copied one step ahead.

The sampler cuts windows out of a memory-mapped token file, so its batches are CPU tensors; a
GPU model needs them on its device. On CUDA the next step's batch is read, pinned and copied with
``non_blocking=True`` on a side stream right after the current step's work was launched, so the
host reads data while the GPU computes and the copy overlaps the step (nanotron and torchtitan
leave this to a DataLoader with ``pin_memory``; our sampler is a pure function of the position,
so one step of look-ahead needs no worker processes). The compute stream waits for the copy
before it uses the tensors. On CPU the batch is used where it is. Under document masking each
micro-batch also holds its document ids (``sampler.py``), computed on the host with the windows
and copied with them: the step reads nothing back to find document boundaries.
"""

from __future__ import annotations

from typing import Optional

import torch

from nanotrain.parallel import accelerator

MicroBatches = list[tuple[torch.Tensor, ...]]  # (ids, targets) or (ids, targets, documents)


class BatchPrefetcher:
    """``get(consumed)`` = ``sampler.batch(consumed, dp_rank)`` on ``device``;
    ``prefetch(consumed)`` starts that copy early (an accelerator; a no-op on the CPU)."""

    def __init__(self, sampler, dp_rank: int, device: torch.device):
        self.sampler, self.dp_rank, self.device = sampler, dp_rank, torch.device(device)
        self.acc = accelerator.of(self.device)  # None: the CPU, or a device that runs at the call
        self._stream = self.acc.Stream(self.device) if self.acc else None
        self._ahead: Optional[tuple[int, MicroBatches]] = None  # (consumed samples, device batch)

    def get(self, consumed: int) -> MicroBatches:
        if self._ahead is not None and self._ahead[0] == consumed:
            batch, self._ahead = self._ahead[1], None
        else:
            batch = self._copy(consumed)
        if self.acc:
            current = self.acc.current_stream(self.device)
            current.wait_stream(self._stream)
            for tensors in batch:  # the caching allocator must not reuse them early
                for t in tensors:
                    self.acc.record_stream(t, current)
        return batch

    def prefetch(self, consumed: int) -> None:
        if self.acc:
            self._ahead = (consumed, self._copy(consumed))

    def _copy(self, consumed: int) -> MicroBatches:
        host = self.sampler.batch(consumed, self.dp_rank)
        if self.device.type == "cpu":
            return host
        if not self.acc:  # a device with no streams (a bare "meta" in unit tests): a plain copy
            return [tuple(t.to(self.device) for t in tensors) for tensors in host]
        pin = self.acc.pin
        with self.acc.use_stream(self._stream):
            return [tuple(pin(t).to(self.device, non_blocking=True) for t in tensors) for tensors in host]
