"""Host snapshots for asynchronous saves: copies of a rank's state that training cannot change
while a background thread writes them.

The buffers are kept for the next async save of this process and reused by shape and dtype:
pinned memory for a GPU tensor, plain memory for a CPU one. Fresh buffers at every save would
cost more than the copy itself, on the training thread: page-locking gigabytes on a GPU, and on
a CPU faulting in every page of a new allocation. The price is one host copy of the rank's
written state kept between saves. Reuse is safe because at most one save is in flight: the trainer commits (joins) the
previous one before it snapshots again.

The copies are taken off the training thread (``HostSnapshot.complete`` runs on the writer
thread), as torchtitan stages its async saves: nothing changes a parameter or an AdamW state
between the step boundary and the next ``optimizer.step()``, so the next step's forward and
backward run while the copies are made, and only the update waits for them
(``PendingSave.wait_snapshot``, called by ``train_step`` through ``before_update``).
"""

from __future__ import annotations

import torch

from nanotrain.parallel import accelerator


class HostSnapshot:
    """``snap(t)`` returns the host buffer that will hold ``t``'s values; ``complete()`` (any
    thread) makes them hold them. GPU copies are queued at once on a side stream that first
    waits for the training stream (non-blocking, to pinned memory: the DMA overlaps the next
    step's kernels) and waited for with one stream sync; CPU copies run in ``complete``, one
    after another: they run beside the next step's forward and backward, and more threads
    would take the step's cores."""

    _kept: dict[tuple, list[torch.Tensor]] = {}  # (pinned, shape, dtype) -> buffers of this process
    _streams: dict[tuple, object] = {}  # (device type, index) -> side stream of this process

    def __init__(self) -> None:
        self._taken: dict[tuple, int] = {}
        self._cpu_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._sides: dict[int, object] = {}  # the side streams this snapshot queued copies on

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        acc = accelerator.of(t.device)
        pinned = acc is not None
        key = (pinned, tuple(t.shape), t.dtype)
        n = self._taken.get(key, 0)
        self._taken[key] = n + 1
        buffers = self._kept.setdefault(key, [])
        if n == len(buffers):
            buffers.append(acc.pinned_empty(t.shape, t.dtype) if pinned else torch.empty(t.shape, dtype=t.dtype))
        if pinned:
            index = (t.device.type, t.device.index)
            if index not in self._streams:  # one side stream per device and process
                self._streams[index] = acc.Stream(t.device)
            side = self._streams[index]
            if index not in self._sides:  # once per save: the step's last update is in t
                side.wait_stream(acc.current_stream(t.device))
                self._sides[index] = side
            with acc.use_stream(side):
                buffers[n].copy_(t, non_blocking=True)
            return buffers[n]
        self._cpu_copies.append((buffers[n], t))
        return buffers[n]

    def complete(self) -> None:
        copies, self._cpu_copies = self._cpu_copies, []
        for dst, src in copies:
            dst.copy_(src)
        sides, self._sides = self._sides, {}
        for side in sides.values():
            side.synchronize()  # the pinned copies have landed (nothing else runs on a side stream)
