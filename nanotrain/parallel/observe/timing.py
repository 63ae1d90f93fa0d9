"""Interval timers that do not synchronise the host with the GPU until they are read.

On a GPU, ``time.perf_counter()`` around a forward measures how long the host took to *launch*
its kernels, not how long they ran. CUDA events recorded on the current stream measure the
device's time, and reading them (``elapsed_time``) waits only for the events themselves, so a
training loop reads them on logging steps and pays no sync on the others. On CPU the host clock
is exact and is used directly.
"""

from __future__ import annotations

import time

import torch

from nanotrain.parallel import accelerator


class IntervalTimer:
    """Sums the intervals between ``start()`` and ``stop()``; ``seconds()`` reads the total."""

    def __init__(self, device: torch.device | str | None = None):
        self.acc = accelerator.of(device) if device is not None else None  # events: the device's time
        self._host = 0.0
        self._t0: float | None = None
        self._events: list[tuple] = []  # (start, end) device events
        self._open = None

    def start(self) -> None:
        if self.acc:
            self._open = self.acc.Event(enable_timing=True)
            self._open.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.acc:
            if self._open is None:
                raise RuntimeError("IntervalTimer.stop() without start()")
            end = self.acc.Event(enable_timing=True)
            end.record()
            self._events.append((self._open, end))
            self._open = None
        else:
            if self._t0 is None:
                raise RuntimeError("IntervalTimer.stop() without start()")
            self._host += time.perf_counter() - self._t0
            self._t0 = None

    def fold_done(self) -> None:
        """Add the intervals whose end event has already happened, without waiting for the
        others (on CUDA ``query()`` never blocks; events on one stream complete in order): it
        keeps the events held to the last step or so, however long the timer is read after."""
        while self._events and self._events[0][1].query():
            start, end = self._events.pop(0)
            self._host += start.elapsed_time(end) / 1e3

    def pending(self) -> bool:
        """Whether recorded intervals remain that ``seconds()`` would have to wait for."""
        return bool(self._events)

    def seconds(self) -> float:
        """The summed intervals; on CUDA this waits for the recorded events (a sync point)."""
        if self.acc and self._events:
            self._events[-1][1].synchronize()
            self._host += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self._host
