"""How a rank's training ended: a closed set of names, shared by the trainer and the task.

The trainer ends ``COMPLETED`` or ``PREEMPTED`` (every rank agreed to stop, after saving); the
task (``runtime/ending.py``) then tells a ``PREEMPTED`` run apart on SLURM: requeued
(``PREEMPTED``), a user's scancel (``CANCELLED``) or not run again (``STOPPED``). A ``str`` enum,
so reports, JSON and comparisons with the plain names ("completed", ...) read the same as before.
"""

from __future__ import annotations

from enum import Enum


class Outcome(str, Enum):
    COMPLETED = "completed"  # reached training.train_steps
    PREEMPTED = "preempted"  # stopped and saved at a step boundary; requeued on SLURM (or local)
    CANCELLED = "cancelled"  # stopped and saved: a user's scancel, not requeued
    STOPPED = "stopped"  # stopped and saved; SLURM will not run it again (requeue budget spent)
    REQUEUED = "requeued"  # not trained: requeued at start-up, a node failed the health check (runtime/health.py)

    def __str__(self) -> str:  # the plain name in f-strings and prints, as a str would be
        return self.value

    __format__ = str.__format__
