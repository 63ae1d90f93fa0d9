"""Where this rank is right now: step, phase, and the last collective it entered.

Why: when a job hangs, every rank but one sits in a collective waiting for the one that never
comes, and the process-group timeout only says "timed out" on the ranks that waited. The hang
watchdog (``runtime/hang.py``) reads this record from another thread and writes it out, so the
reports of all ranks together name the rank that did not arrive, the phase and the group.

Why a process-wide record: the collectives are entered from many layers (tensor-parallel
functions, the pipeline engine, the gradient sync, the stop vote, the checkpoint's JSON
collectives); threading an object through all of them would change every signature for a
diagnostic. The record is one object per process, like torch's own default group and NCCL's
flight recorder, and it is written only by the training thread.

Why it costs nothing: every update is a plain attribute write (and ``mark`` one monotonic clock
read); nothing syncs the device or takes a lock. A phase given as a template and its parts
(``mark("forward (pp F micro-batch {})", mb)``: the pipeline engine marks every action) is kept
as that one tuple and formatted only when it is read (a report): no string is built per action.
The reader tolerates a torn view (a phase from one instant, a collective from the next): it is
a diagnosis, not a protocol.
"""

from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist


class HangRecord:
    """The training thread's position; see the module doc."""

    def __init__(self) -> None:
        self.armed = False  # the watchdog only judges while the training loop runs
        self.step = 0
        self._phase: tuple[str, tuple] = ("start", ())  # (template, parts): see ``phase``
        self.beat = time.monotonic()  # last phase change: the watchdog's clock
        self.collective: Optional[str] = None
        self.group = None  # the ProcessGroup object (ranks resolved when a report is written)
        self.names: dict[int, str] = {}  # id(group) -> "tp", "dp/dp_cp", ...

    def arm(self, step: int) -> None:
        self.step, self.armed = step, True
        self.mark("start of training")

    def disarm(self) -> None:
        self.armed = False

    def mark(self, phase: str, *parts) -> None:
        """The training thread entered ``phase`` (data, forward, backward, a pp action, optimizer,
        checkpoint, ...): progress, as far as the watchdog is concerned. With ``parts``,
        ``phase`` is a ``str.format`` template filled in only when the phase is read."""
        self._phase = (phase, parts)  # one attribute write: a reader never sees half of it
        self.beat = time.monotonic()

    @property
    def phase(self) -> str:
        """The current phase, formatted (see ``mark``)."""
        template, parts = self._phase
        return template.format(*parts) if parts else template

    def advance(self, step: int) -> None:
        self.step = step
        self.mark("step boundary")

    def entering(self, collective: str, group=None) -> None:
        """The training thread is about to enter ``collective`` on ``group`` (None: the world)."""
        self.collective, self.group = collective, group

    def name_group(self, group, name: str) -> None:
        """Give ``group`` a readable name in reports (ParallelContext names its own groups)."""
        if group is None:
            return
        old = self.names.get(id(group))
        self.names[id(group)] = name if old is None or name in old.split("/") else f"{old}/{name}"

    def forget_groups(self) -> None:
        """Drop every reference to a process group (``ParallelContext.destroy``): a group still
        referenced is not freed, and its threads then outlive the interpreter's teardown."""
        self.group, self.names = None, {}

    def describe_group(self, group) -> dict:
        """Name and global ranks of ``group`` (for reports; no communication)."""
        if not (dist.is_available() and dist.is_initialized()):
            return {"name": "world", "ranks": [0]}
        try:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        except (RuntimeError, ValueError):  # a group destroyed since
            ranks = []
        name = "world" if group is None else self.names.get(id(group), "group")
        return {"name": name, "ranks": sorted(ranks)}

    def snapshot(self) -> dict:
        return {
            "step": self.step,
            "phase": self.phase,
            "seconds_in_phase": round(time.monotonic() - self.beat, 3),
            "collective": None
            if self.collective is None
            else {"name": self.collective, "group": self.describe_group(self.group)},
        }


HANG_RECORD = HangRecord()
