"""How long this rank's training steps sat blocked on its peers (``WAITS``), so that a rank's
own work in a step (its step time minus these waits) can be compared across ranks.

Why: a synchronous job's collectives make every rank wait for the slowest, so every rank's wall
time per step is the slowest one's and a comparison of wall times cannot see a straggler. The
time a rank spends outside those waits can: the slow rank's is longer, and its peers show the
difference as waiting. `perf/step_time_max_over_median` (``logging/stragglers.py``) compares it.

What counts as waiting: every blocking call of ``collectives.py`` (a synchronous collective, a
work handle's ``wait()``: DP gradient buckets, ZeRO gathers, asynchronous TP collectives,
pipeline sends and receives, the loss and grad-norm reductions), while the trainer holds a step
window open (``begin_step`` .. ``end_step``); outside a window (evaluation, saves, the stop vote,
the metrics' own gathers) nothing is timed or recorded. Nested calls (a wrapper calling another)
count once.

On the CPU (gloo) these calls block the host, and the host clock measures them. On a GPU (NCCL)
they only make the compute stream wait, so the host clock would see nothing: the window's timer
is then a pair of device events per call on the current stream (``timing.IntervalTimer``),
which measure how long the stream stalled there, a collective's own transfer included. Events
that already happened are folded in at each ``end_step`` (``query()``, never a wait); the rest
are read by ``read()``, which the metrics call on log steps only, after the step's loss has
been read (that read already waited for the step): no host sync is added to any step.
"""

from __future__ import annotations

import torch

from nanotrain.parallel.observe.timing import IntervalTimer


class WaitClock:
    """Per process; the trainer opens a window per step, ``collectives.py`` times into it."""

    def __init__(self):
        self._window: IntervalTimer | None = None  # the open step's waits; None: not timing
        self._counted: list[IntervalTimer] = []  # closed windows with events not yet folded in
        self._seconds = 0.0  # folded in, not read yet
        self._nested = 0

    def begin_step(self, device: torch.device | str | None = None) -> None:
        """Open a step's window; waits are timed on ``device``'s clock (module doc)."""
        self._window = IntervalTimer(device if torch.device(device or "cpu").type != "cpu" else None)

    def end_step(self) -> None:
        """Close the window: its waits count towards the next ``read()``."""
        if self._window is not None:
            self._counted.append(self._window)
            self._window = None
        pending = []
        for timer in self._counted:
            timer.fold_done()
            if timer.pending():
                pending.append(timer)
            else:
                self._seconds += timer.seconds()
        self._counted = pending

    def reset(self) -> None:
        """Forget every wait recorded so far (a new training loop starts)."""
        self._window, self._counted, self._seconds, self._nested = None, [], 0.0, 0

    def read(self) -> float:
        """Seconds waited in the windows closed since the last read; on a GPU this waits for
        their last events (call it where the host has already waited for the step)."""
        total = self._seconds + sum(timer.seconds() for timer in self._counted)
        self._counted, self._seconds = [], 0.0
        return total

    def start(self) -> IntervalTimer | None:
        """Start timing a blocking call; returns what ``stop`` takes (None: not timed, outside
        a window, nested in a timed call, or inside a graph ``torch.compile`` traces)."""
        timer = self._window
        if timer is None or self._nested or torch.compiler.is_compiling():
            return None
        self._nested = 1
        timer.start()
        return timer

    def stop(self, timer: IntervalTimer | None) -> None:
        if timer is not None:
            timer.stop()
            self._nested = 0


WAITS = WaitClock()
